// Embedding lookup. Shapes: weight [V, D] (V rows of D elements), indices
// [I] (the caller's index tensor flattened; i64 or i32), out [I, D].
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "nn/ops/cpu/cpu_kernels.h"

namespace ddp::nn::ops::cpu {

namespace {

std::vector<int64_t> Indices(const Tensor& indices) {
  const Tensor ic = ContiguousData(indices);
  const int64_t n = ic.numel();
  std::vector<int64_t> out(n);
  if (ic.dtype() == DType::kInt64) {
    const int64_t* p = static_cast<const int64_t*>(ic.data_ptr());
    for (int64_t i = 0; i < n; ++i) out[i] = p[i];
  } else if (ic.dtype() == DType::kInt32) {
    const int32_t* p = static_cast<const int32_t*>(ic.data_ptr());
    for (int64_t i = 0; i < n; ++i) out[i] = p[i];
  } else {
    throw std::invalid_argument("embedding: indices must be i64 or i32, got " + std::string(DTypeName(ic.dtype())));
  }
  return out;
}

}  // namespace

void EmbeddingForward(const Tensor& weight, const Tensor& indices, const Tensor& out) {
  const int64_t v = weight.size(0), d = weight.size(1);
  const std::vector<int64_t> idx = Indices(indices);
  // Every index is checked before anything is written: a refused call
  // leaves out untouched.
  for (size_t i = 0; i < idx.size(); ++i) {
    if (idx[i] < 0 || idx[i] >= v) {
      throw std::out_of_range("embedding: index " + std::to_string(idx[i]) + " at position " + std::to_string(i) +
                              " is out of range [0, " + std::to_string(v) + ") of a table of " + std::to_string(v) +
                              " embeddings");
    }
  }
  if (!out.is_contiguous()) throw std::invalid_argument("embedding: out must be contiguous");
  const Tensor wc = ContiguousData(weight);
  const size_t row_bytes = static_cast<size_t>(d) * ElementSize(weight.dtype());
  const char* wp = static_cast<const char*>(wc.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  for (size_t i = 0; i < idx.size(); ++i) {
    if (row_bytes > 0) std::memcpy(op + i * row_bytes, wp + idx[i] * row_bytes, row_bytes);
  }
}

void EmbeddingBackward(const Tensor& indices, const Tensor& grad_out, int64_t padding_idx,
                       const Tensor& grad_weight) {
  const int64_t v = grad_weight.size(0), d = grad_weight.size(1);
  const std::vector<int64_t> idx = Indices(indices);
  if (!grad_weight.is_contiguous()) throw std::invalid_argument("embedding_backward: grad_weight must be contiguous");
  const Tensor gc = ContiguousData(grad_out);
  DDP_DISPATCH_FLOATING(grad_weight.dtype(), "embedding_backward", {
    using A = acc_t<scalar_t>;
    scalar_t* gw = static_cast<scalar_t*>(grad_weight.data_ptr());
    const scalar_t* g = static_cast<const scalar_t*>(gc.data_ptr());
    for (int64_t i = 0; i < v * d; ++i) gw[i] = scalar_t(0.0f);
    for (size_t i = 0; i < idx.size(); ++i) {
      const int64_t row = idx[i];
      // Checked by the forward; kept here too so a stray index cannot write outside.
      if (row == padding_idx || row < 0 || row >= v) continue;
      scalar_t* dst = gw + row * d;
      const scalar_t* src = g + static_cast<int64_t>(i) * d;
      for (int64_t k = 0; k < d; ++k) dst[k] = static_cast<scalar_t>(static_cast<A>(dst[k]) + static_cast<A>(src[k]));
    }
  });
}

}  // namespace ddp::nn::ops::cpu
