// Embedding lookup. Shapes: weight [V, D] (V embeddings of D elements),
// indices [S...] (i64 or i32) -> out [S..., D]. Backward: the weight's
// gradient [V, D] sums the output gradient's rows by index, except the
// padding row's.
#include <optional>
#include <stdexcept>
#include <string>

#include "nn/ops/cpu/cpu_kernels.h"
#include "nn/ops/functional.h"
#include "nn/ops/op_util.h"

namespace ddp::nn::ops {

using detail::LambdaNode;

int64_t EmbeddingPaddingRow(int64_t padding_idx, int64_t num_embeddings) {
  // As PyTorch: -num_embeddings <= padding_idx < num_embeddings.
  if (padding_idx >= num_embeddings || padding_idx < -num_embeddings) {
    throw std::invalid_argument("padding_idx must be in [-" + std::to_string(num_embeddings) + ", " +
                                std::to_string(num_embeddings) + "), got " + std::to_string(padding_idx));
  }
  return padding_idx < 0 ? padding_idx + num_embeddings : padding_idx;
}

Tensor Embedding(const Tensor& weight, const Tensor& indices, std::optional<int64_t> padding_idx) {
  detail::CheckFloatingOperand("embedding", "weight", weight);
  detail::CheckDefinedOperand("embedding", "indices", indices);
  if (indices.dtype() != DType::kInt64 && indices.dtype() != DType::kInt32) {
    throw std::invalid_argument("embedding: indices must be i64 or i32, got " +
                                std::string(DTypeName(indices.dtype())));
  }
  if (weight.dim() != 2) {
    throw std::invalid_argument("embedding: weight must be [num_embeddings, embedding_dim], got " +
                                ShapeToString(weight.shape()));
  }
  const int64_t v = weight.size(0), d = weight.size(1);
  int64_t pad = -1;  // no row is padding
  if (padding_idx.has_value()) {
    try {
      pad = EmbeddingPaddingRow(*padding_idx, v);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("embedding: ") + e.what());
    }
  }
  detail::CheckSameDevice("embedding", weight, indices);
  // The kernels are the CPU's alone (outside the per-device table).
  if (!weight.device().is_cpu()) {
    throw std::invalid_argument("embedding: implemented on the CPU only, not on " + weight.device().ToString());
  }
  Shape out_shape = indices.shape();
  out_shape.push_back(d);
  Tensor out = Empty({indices.numel(), d}, {.dtype = weight.dtype(), .device = weight.device()});
  cpu::EmbeddingForward(weight, indices, out);
  out = out.View(out_shape);
  if (!detail::AnyRequiresGrad({&weight})) return out;
  const Shape w_shape = weight.shape();
  auto node = std::make_shared<LambdaNode>("EmbeddingBackward", [w_shape, pad, d](LambdaNode& n,
                                                                                 std::vector<Tensor>& g) {
    const Tensor idx = n.saved[0].Get();
    Tensor gw = Empty(w_shape, {.dtype = g[0].dtype(), .device = g[0].device()});
    cpu::EmbeddingBackward(idx, g[0].Reshape({idx.numel(), d}), pad, gw);
    return std::vector<Tensor>{gw};
  });
  // The indices are saved as they are: an in-place change to them before
  // backward is reported by the saved tensor's version check.
  node->saved.emplace_back(indices);
  detail::ConnectNode(node, {&weight}, {&out});
  return out;
}

}  // namespace ddp::nn::ops
