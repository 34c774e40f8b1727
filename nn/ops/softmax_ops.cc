// log-softmax and softmax along one dimension.
#include <stdexcept>

#include "nn/ops/autocast.h"
#include "nn/ops/functional.h"
#include "nn/ops/op_util.h"

namespace ddp::nn::ops {

using detail::LambdaNode;

Tensor LogSoftmax(const Tensor& x_in, int64_t dim) {
  detail::CheckDefinedOperand("log_softmax", "input", x_in);
  if (x_in.dim() == 0) {
    // PyTorch takes a scalar as one element along dim 0 (or -1): log-softmax
    // of it is 0 for a finite value (and softmax 1).
    detail::WrapDimOf("log_softmax", x_in, dim);
    return Reshape(LogSoftmax(Reshape(x_in, {1}), 0), {});
  }
  // Autocast: exponentials need f32's range.
  const Tensor x = autocast::ToFloat32(x_in);
  if (!IsFloating(x.dtype())) {
    throw std::invalid_argument("log_softmax: needs a floating tensor, got " + std::string(DTypeName(x.dtype())));
  }
  dim = detail::WrapDimOf("log_softmax", x, dim);
  Tensor y = detail::NewLike(x);
  DDP_KERNEL(x.device(), log_softmax_forward)(x, dim, y);
  if (!detail::AnyRequiresGrad({&x})) return y;
  auto node = std::make_shared<LambdaNode>("LogSoftmaxBackward", [dim](LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor yv = n.saved[0].Get();
    Tensor gx = detail::NewLike(yv);
    DDP_KERNEL(yv.device(), log_softmax_backward)(g[0], yv, dim, gx);
    return std::vector<Tensor>{gx};
  });
  node->saved.emplace_back(y);
  detail::ConnectNode(node, {&x}, {&y});
  return y;
}

Tensor Softmax(const Tensor& x_in, int64_t dim) {
  detail::CheckDefinedOperand("softmax", "input", x_in);
  const Tensor x = autocast::ToFloat32(x_in);
  // Checked here too, so that an error names softmax rather than the
  // log_softmax it is computed with.
  if (!IsFloating(x.dtype())) {
    throw std::invalid_argument("softmax: needs a floating tensor, got " + std::string(DTypeName(x.dtype())));
  }
  detail::WrapDimOf("softmax", x, dim);
  // exp(log_softmax) in a 16-bit dtype would round the log-probability
  // before the exp, and exp magnifies that error (bf16: ~3% at e^-10).
  // 16-bit inputs therefore go through f32 and are rounded once, at the end;
  // the casts are differentiable, so the gradient comes back in x's dtype.
  if (x.dtype() == DType::kBFloat16 || x.dtype() == DType::kFloat16) {
    return Cast(Exp(LogSoftmax(Cast(x, DType::kFloat32), dim)), x.dtype());
  }
  return Exp(LogSoftmax(x, dim));
}

}  // namespace ddp::nn::ops
