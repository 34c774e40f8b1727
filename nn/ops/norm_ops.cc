// Batch normalization. Shapes: x [N, C, *]; weight, bias, running_mean,
// running_var [C]. Saved statistics are in the dtype the device's kernels
// compute them in (KernelTable::batch_norm_saved_dtype; f64 by default).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "nn/ops/cpu/cpu_kernels.h"
#include "nn/ops/functional.h"
#include "nn/ops/op_util.h"

namespace ddp::nn::ops {

using detail::LambdaNode;

Tensor BatchNorm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                 const Tensor& bias, bool training, double momentum, double eps) {
  detail::CheckDefinedOperand("batch_norm", "input", x);
  if (x.dim() < 2) throw std::invalid_argument("batch_norm: expected input [N, C, ...], got " + ShapeToString(x.shape()));
  const int64_t c = x.size(1);
  auto check = [&](const Tensor& t, const char* name) {
    if (t.defined() && (t.dim() != 1 || t.size(0) != c)) {
      throw std::invalid_argument(std::string("batch_norm: ") + name + " of shape " + ShapeToString(t.shape()) +
                                  " for an input with " + std::to_string(c) + " channels " + ShapeToString(x.shape()));
    }
  };
  // eps keeps the variance's inverse square root finite; momentum weighs
  // the running statistics' update, so it matters only when training
  // updates them (PyTorch leaves both unchecked and returns NaN or drifting
  // statistics).
  if (!(eps > 0) || !std::isfinite(eps)) {
    throw std::invalid_argument("batch_norm: eps must be finite and > 0, got " + detail::ErrorValue(eps));
  }
  if (training && running_mean.defined() && !(momentum >= 0 && momentum <= 1)) {
    throw std::invalid_argument("batch_norm: momentum must be in [0, 1], got " + detail::ErrorValue(momentum));
  }
  check(weight, "weight");
  check(bias, "bias");
  check(running_mean, "running_mean");
  check(running_var, "running_var");
  // The kernels update the running statistics as a pair (cuDNN takes both or
  // neither): one alone would silently never be updated.
  if (running_mean.defined() != running_var.defined()) {
    const bool mean = running_mean.defined();
    throw std::invalid_argument(std::string("batch_norm: ") + (mean ? "running_mean " : "running_var ") +
                                ShapeToString((mean ? running_mean : running_var).shape()) + " is given without " +
                                (mean ? "running_var" : "running_mean") + ": pass both running statistics or neither");
  }
  if (!training && (!running_mean.defined() || !running_var.defined())) {
    throw std::invalid_argument("batch_norm: eval mode needs running statistics");
  }
  if (training && x.numel() == 0) {
    // An empty batch, as PyTorch allows it: an empty output, the running
    // statistics unchanged, and zero gradients for weight and bias.
    Tensor y = detail::NewLike(x);
    if (!detail::AnyRequiresGrad({&x, &weight, &bias})) return y;
    const DType bias_dtype = bias.defined() ? bias.dtype() : x.dtype();
    auto node = std::make_shared<LambdaNode>("BatchNormBackward", [bias_dtype](LambdaNode& n,
                                                                               std::vector<Tensor>& g) {
      const Tensor xv = n.saved[0].Get(), wv = n.saved[1].Get();
      Tensor gx, gw, gb;
      if (n.needs_input_grad(0)) gx = detail::NewLike(xv);
      if (n.needs_input_grad(1)) gw = Zeros(wv.shape(), {.dtype = wv.dtype(), .device = wv.device()});
      if (n.needs_input_grad(2)) gb = Zeros({xv.size(1)}, {.dtype = bias_dtype, .device = xv.device()});
      (void)g;
      return std::vector<Tensor>{gx, gw, gb};
    });
    node->saved.emplace_back(x);
    node->saved.emplace_back(weight);
    detail::ConnectNode(node, {&x, &weight, &bias}, {&y});
    return y;
  }
  if (training && x.numel() / std::max<int64_t>(c, 1) <= 1) {
    throw std::invalid_argument("batch_norm: expected more than 1 value per channel when training, got input " +
                                ShapeToString(x.shape()));
  }
  // The saved statistics stay in the dtype the kernels compute them in (f64
  // unless the device says otherwise, as CUDA does for cuDNN's f32): backward
  // uses the mean and invstd the forward normalized with, unrounded, and
  // reads them without a conversion.
  Tensor y = detail::NewLike(x);
  const auto saved_dtype = ops::KernelsFor(x.device().type).batch_norm_saved_dtype;
  const DType saved = saved_dtype != nullptr ? saved_dtype(x, training) : DType::kFloat64;
  Tensor mean = Empty({c}, {.dtype = saved, .device = x.device()});
  Tensor invstd = Empty({c}, {.dtype = saved, .device = x.device()});
  DDP_KERNEL(x.device(), batch_norm_forward)(x, weight, bias, running_mean, running_var, training, momentum, eps, y,
                                            mean, invstd);
  if (!detail::AnyRequiresGrad({&x, &weight, &bias})) return y;
  // The bias gradient is made in the bias's dtype: f32 for an f32 bias under
  // autocast, where x is 16-bit (the sums behind it are f64 either way).
  const DType bias_dtype = bias.defined() ? bias.dtype() : x.dtype();
  auto node = std::make_shared<LambdaNode>("BatchNormBackward", [training, eps, bias_dtype](LambdaNode& n,
                                                                                           std::vector<Tensor>& g) {
    const Tensor xv = n.saved[0].Get(), wv = n.saved[1].Get();
    Tensor gx, gw, gb;
    if (n.needs_input_grad(0)) gx = detail::NewLike(xv);
    if (n.needs_input_grad(1)) gw = detail::NewLike(wv);
    if (n.needs_input_grad(2)) gb = Empty({xv.size(1)}, {.dtype = bias_dtype, .device = xv.device()});
    DDP_KERNEL(xv.device(), batch_norm_backward)(xv, g[0], wv, n.saved[2].Get(), n.saved[3].Get(), training, eps,
                                                 gx, gw, gb);
    return std::vector<Tensor>{gx, gw, gb};
  });
  node->saved.emplace_back(x);
  node->saved.emplace_back(weight);
  node->saved.emplace_back(mean);
  node->saved.emplace_back(invstd);
  detail::ConnectNode(node, {&x, &weight, &bias}, {&y});
  return y;
}

namespace {
// The tensors a block cannot do without (weight and bias may be undefined),
// named: an undefined one used to fail later, inside the kernel's read,
// with a message that named no argument.
void CheckDefined(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> needed) {
  for (const auto& [name, t] : needed) {
    if (!t->defined()) throw std::invalid_argument(std::string(op) + ": " + name + " is undefined");
  }
}
void CheckChannels(const char* op, const Tensor& x, std::initializer_list<const Tensor*> per_channel) {
  CheckDefined(op, {{"x", &x}});
  if (x.dim() < 2) throw std::invalid_argument(std::string(op) + ": expected input [N, C, ...], got " + ShapeToString(x.shape()));
  for (const Tensor* t : per_channel) {
    if (t->defined() && (t->dim() != 1 || t->size(0) != x.size(1))) {
      throw std::invalid_argument(std::string(op) + ": per-channel tensor of shape " + ShapeToString(t->shape()) +
                                  " for input " + ShapeToString(x.shape()));
    }
  }
}
// The kernels read dy as x's dtype and shape: another would read past its end.
void CheckDy(const char* op, const Tensor& dy, const Tensor& x) {
  if (dy.shape() != x.shape()) {
    throw std::invalid_argument(std::string(op) + ": dy " + ShapeToString(dy.shape()) + " vs x " +
                                ShapeToString(x.shape()) + " (expected the same shape)");
  }
  if (dy.dtype() != x.dtype()) {
    throw std::invalid_argument(std::string(op) + ": dy has dtype " + std::string(DTypeName(dy.dtype())) + ", x " +
                                std::string(DTypeName(x.dtype())) + " (expected the same dtype)");
  }
  if (dy.device() != x.device()) {
    throw std::invalid_argument(std::string(op) + ": dy is on " + dy.device().ToString() + ", x on " +
                                x.device().ToString() + " (expected one device)");
  }
}
Tensor Sums(const Tensor& x) { return Empty({x.size(1)}, {.dtype = DType::kFloat64, .device = x.device()}); }
}  // namespace

BatchNormSums BatchNormStats(const Tensor& x) {
  CheckChannels("batch_norm_stats", x, {});
  BatchNormSums r{Sums(x), Sums(x)};
  DDP_KERNEL(x.device(), batch_norm_stats)(x, r.sum, r.sum_sq);
  return r;
}

Tensor BatchNormElementwise(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& weight,
                            const Tensor& bias) {
  CheckDefined("batch_norm_elementwise", {{"mean", &mean}, {"invstd", &invstd}});
  CheckChannels("batch_norm_elementwise", x, {&mean, &invstd, &weight, &bias});
  Tensor y = detail::NewLike(x);
  DDP_KERNEL(x.device(), batch_norm_elementwise)(x, mean, invstd, weight, bias, y);
  return y;
}

BatchNormSums BatchNormBackwardReduce(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd) {
  CheckDefined("batch_norm_backward_reduce", {{"dy", &dy}, {"mean", &mean}, {"invstd", &invstd}});
  CheckChannels("batch_norm_backward_reduce", x, {&mean, &invstd});
  CheckDy("batch_norm_backward_reduce", dy, x);
  BatchNormSums r{Sums(x), Sums(x)};
  DDP_KERNEL(x.device(), batch_norm_backward_reduce)(dy, x, mean, invstd, r.sum, r.sum_sq);
  return r;
}

Tensor BatchNormBackwardElementwise(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                                    const Tensor& weight, const Tensor& mean_dy, const Tensor& mean_dy_xhat) {
  CheckDefined("batch_norm_backward_elementwise", {{"dy", &dy},
                                                   {"mean", &mean},
                                                   {"invstd", &invstd},
                                                   {"mean_dy", &mean_dy},
                                                   {"mean_dy_xhat", &mean_dy_xhat}});
  CheckChannels("batch_norm_backward_elementwise", x, {&mean, &invstd, &weight, &mean_dy, &mean_dy_xhat});
  CheckDy("batch_norm_backward_elementwise", dy, x);
  Tensor dx = detail::NewLike(x);
  DDP_KERNEL(x.device(), batch_norm_backward_elementwise)(dy, x, mean, invstd, weight, mean_dy, mean_dy_xhat, dx);
  return dx;
}

}  // namespace ddp::nn::ops

// Layer normalization. Shapes: x [*, D1, ..., Dk] with normalized_shape
// [D1, ..., Dk]; weight and bias normalized_shape (or undefined); the saved
// statistics [M] per row, M the product of the leading dimensions.
namespace ddp::nn::ops {

Tensor LayerNorm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight, const Tensor& bias,
                 double eps) {
  detail::CheckFloatingOperand("layer_norm", "input", x);
  if (weight.defined()) detail::CheckFloatingOperand("layer_norm", "weight", weight);
  if (bias.defined()) detail::CheckFloatingOperand("layer_norm", "bias", bias);
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  if (k == 0) throw std::invalid_argument("layer_norm: normalized_shape must have at least one dimension, got []");
  for (int64_t s : normalized_shape) {
    if (s < 0) {
      throw std::invalid_argument("layer_norm: normalized_shape " + ShapeToString(normalized_shape) +
                                  " has a negative size");
    }
  }
  if (!(eps > 0) || !std::isfinite(eps)) {
    throw std::invalid_argument("layer_norm: eps must be finite and > 0, got " + detail::ErrorValue(eps));
  }
  if (x.dim() < k || !std::equal(normalized_shape.begin(), normalized_shape.end(), x.shape().end() - k)) {
    throw std::invalid_argument("layer_norm: expected input [*, " +
                                ShapeToString(normalized_shape).substr(1) + " (normalized_shape " +
                                ShapeToString(normalized_shape) + "), got " + ShapeToString(x.shape()));
  }
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"weight", &weight}, {"bias", &bias}}) {
    if (!t->defined()) continue;
    if (t->shape() != normalized_shape) {
      throw std::invalid_argument(std::string("layer_norm: ") + name + " of shape " + ShapeToString(t->shape()) +
                                  " for normalized_shape " + ShapeToString(normalized_shape));
    }
    detail::CheckSameDevice("layer_norm", x, *t);
  }
  // The kernels are the CPU's alone (outside the per-device table).
  if (!x.device().is_cpu()) {
    throw std::invalid_argument("layer_norm: implemented on the CPU only, not on " + x.device().ToString());
  }
  int64_t rows = 1;
  for (int64_t d = 0; d < x.dim() - k; ++d) rows *= x.size(d);
  Tensor y = detail::NewLike(x);
  Tensor mean = Empty({rows}, {.dtype = DType::kFloat64, .device = x.device()});
  Tensor invstd = Empty({rows}, {.dtype = DType::kFloat64, .device = x.device()});
  const int64_t cols = NumElements(normalized_shape);
  cpu::LayerNormForward(x, weight, bias, rows, cols, eps, y, mean, invstd);
  if (!detail::AnyRequiresGrad({&x, &weight, &bias})) return y;
  // The bias is not saved (backward needs only its dtype): an optimizer
  // step on it before backward is no error, as in PyTorch.
  const DType bias_dtype = bias.defined() ? bias.dtype() : x.dtype();
  auto node = std::make_shared<LambdaNode>("LayerNormBackward", [rows, cols, normalized_shape, bias_dtype](
                                                                    LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor xv = n.saved[0].Get(), wv = n.saved[1].Get();
    Tensor gx, gw, gb;
    if (n.needs_input_grad(0)) gx = detail::NewLike(xv);
    if (n.needs_input_grad(1)) gw = detail::NewLike(wv);
    if (n.needs_input_grad(2)) gb = Empty(normalized_shape, {.dtype = bias_dtype, .device = xv.device()});
    cpu::LayerNormBackward(xv, g[0], wv, rows, cols, n.saved[2].Get(), n.saved[3].Get(), gx, gw, gb);
    return std::vector<Tensor>{gx, gw, gb};
  });
  node->saved.emplace_back(x);
  node->saved.emplace_back(weight);
  node->saved.emplace_back(mean);
  node->saved.emplace_back(invstd);
  detail::ConnectNode(node, {&x, &weight, &bias}, {&y});
  return y;
}

}  // namespace ddp::nn::ops
