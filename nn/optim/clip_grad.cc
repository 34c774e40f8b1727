#include "nn/optim/clip_grad.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nn/ops/dispatch.h"
#include "nn/optim/device_kernels.h"
#include "nn/optim/optimizer.h"

namespace ddp::nn::optim {
namespace {

// Sum of |g|^q (or the max of |g| for the infinity norm), accumulated in f64.
template <typename T>
double Accumulate(const T* g, int64_t n, double q) {
  double acc = 0;
  if (std::isinf(q)) {
    for (int64_t i = 0; i < n; ++i) {
      const double a = std::fabs(static_cast<double>(static_cast<acc_t<T>>(g[i])));
      if (a > acc || std::isnan(a)) acc = a;  // once NaN, nothing compares greater: NaN stays
    }
  } else if (q == 2.0) {
    for (int64_t i = 0; i < n; ++i) {
      const double v = static_cast<double>(static_cast<acc_t<T>>(g[i]));
      acc += v * v;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      acc += std::pow(std::fabs(static_cast<double>(static_cast<acc_t<T>>(g[i]))), q);
    }
  }
  return acc;
}

// Multiplies by the coefficient rounded to the type g is computed in (f64
// for f64 gradients, f32 for the others). PyTorch's mul_ does the same for
// f32 and f64 gradients; for bf16 and f16 ones it differs, as it computes
// the norm in the gradients' own type and rounds the coefficient to it
// (bf16 [1, 3, -7, 100]: norm 100.5 and coefficient 0.02978 for a max_norm
// of 3, where the f64 norm here gives 100.29 and 0.02991): the f64 norm is
// kept on purpose (nn/optim/README.md, ClipGradNorm).
template <typename T>
void Scale(T* g, int64_t n, double coef) {
  const acc_t<T> c = static_cast<acc_t<T>>(coef);
  for (int64_t i = 0; i < n; ++i) g[i] = static_cast<T>(static_cast<acc_t<T>>(g[i]) * c);
}

// Device gradients: sum over all gradients of |g|^q (q finite) into one f64
// element on the device, composed from the device's kernels, read back
// once. |g|^q is exp(q log|g|) (0 for g = 0, inf and NaN carried through).
// The powers are taken in f64, as on the CPU: in f32, an element of 3e19
// squared is inf, and the clip then zeroed every gradient.
double DeviceSum(const std::vector<Tensor>& grads, double q) {
  const Device dev = grads.front().device();
  const auto& k = ops::KernelsFor(dev.type);
  if (!k.unary || !k.affine || !k.sum_to || !k.add_scaled_) {
    ops::detail::ThrowNoKernel("ClipGradNorm (unary, affine, sum_to, add_scaled_)", dev);
  }
  const Tensor total = Zeros({1}, {.dtype = DType::kFloat64, .device = dev});
  for (const Tensor& g : grads) {
    if (g.numel() == 0) continue;
    const DType dt = DType::kFloat64;
    const Tensor flat = g.View({g.numel()});
    const Tensor x = flat.dtype() == dt ? flat : flat.To(dt);
    const Tensor powered = Empty({g.numel()}, {.dtype = dt, .device = dev});
    if (q == 2.0) {
      k.unary(ops::UnaryOp::kSquare, x, powered);
    } else if (q == 1.0) {
      k.unary(ops::UnaryOp::kAbs, x, powered);
    } else {
      const Tensor t = Empty({g.numel()}, {.dtype = dt, .device = dev});
      k.unary(ops::UnaryOp::kAbs, x, powered);
      k.unary(ops::UnaryOp::kLog, powered, t);
      k.affine(t, q, 0.0, t);
      k.unary(ops::UnaryOp::kExp, t, powered);
    }
    const Tensor part = Empty({1}, {.dtype = DType::kFloat64, .device = dev});
    k.sum_to(powered, part, 1.0);
    k.add_scaled_(total, part, 1.0);
  }
  return total.Item();  // the one host synchronization
}

// Device gradients, infinity norm: the largest |g| over all gradients, kept
// in one f64 element on the device by the device's `max_abs` kernel (NaN
// wins, as on the CPU) and read back once.
double DeviceMaxAbs(const std::vector<Tensor>& grads) {
  const Device dev = grads.front().device();
  const auto max_abs = DeviceOptimKernelsFor(dev.type).max_abs;
  if (max_abs == nullptr) internal::ThrowNoDeviceKernel("ClipGradNorm (infinity norm)", "max_abs", dev);
  // Checked before anything runs: the clipping itself scales with `affine`.
  if (!ops::KernelsFor(dev.type).affine) ops::detail::ThrowNoKernel("ClipGradNorm (affine)", dev);
  const Tensor out = Zeros({1}, {.dtype = DType::kFloat64, .device = dev});
  max_abs(grads, out);
  return out.Item();  // the one host synchronization
}

// Clamps g to [-c, c], compared in the type g is computed in; an element
// out of range takes the bound rounded to T, NaN fails both tests and stays.
template <typename T>
void ClampValues(T* g, int64_t n, double c) {
  const acc_t<T> hi = static_cast<acc_t<T>>(c), lo = -hi;
  const T hi_t = static_cast<T>(hi), lo_t = static_cast<T>(lo);
  for (int64_t i = 0; i < n; ++i) {
    const acc_t<T> v = static_cast<acc_t<T>>(g[i]);
    if (v < lo) {
      g[i] = lo_t;
    } else if (v > hi) {
      g[i] = hi_t;
    }
  }
}

}  // namespace

void ClipGradValue(const std::vector<Tensor>& params, double clip_value) {
  if (!(clip_value >= 0)) {
    throw std::invalid_argument("ClipGradValue: clip_value must be >= 0, got " + internal::OptionValueText(clip_value));
  }
  // Every gradient checked before any is changed.
  std::vector<Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    if (!p.defined() || !p.grad().defined()) continue;
    const Tensor& g = p.grad();
    if (!g.device().is_cpu() && ops::KernelsFor(g.device().type).clamp == nullptr) {
      throw std::invalid_argument("ClipGradValue: the gradient of parameter " + std::to_string(i) + " is on " +
                                  g.device().ToString() + ", which has no clamp kernel registered");
    }
    if (!IsFloating(g.dtype())) {
      throw std::invalid_argument("ClipGradValue: the gradient of parameter " + std::to_string(i) + " has dtype " +
                                  std::string(DTypeName(g.dtype())) + ", expected a floating type");
    }
    grads.push_back(g);
  }
  if (std::isinf(clip_value)) return;
  for (const Tensor& g : grads) {
    // One of other strides is clamped as a contiguous copy, written back.
    const Tensor work = g.is_contiguous() ? g : g.Detach().Contiguous();
    if (work.device().is_cpu()) {
      DDP_DISPATCH_FLOATING(work.dtype(), "ClipGradValue", ClampValues(work.data<scalar_t>(), work.numel(), clip_value));
    } else {
      // The device's clamp kernel, in place, on the current stream; the
      // bound rounded to the gradient's type as on the CPU.
      double hi = clip_value;
      DDP_DISPATCH_FLOATING(work.dtype(), "ClipGradValue",
                            hi = static_cast<double>(static_cast<acc_t<scalar_t>>(scalar_t(clip_value))));
      ops::KernelsFor(work.device().type).clamp(work, -hi, hi, work);
    }
    if (!g.is_contiguous()) {
      NoGradGuard guard;
      g.CopyFrom(work);
    }
    g.storage()->BumpVersion();
  }
}

double ClipGradNorm(const std::vector<Tensor>& params, double max_norm, double norm_type,
                    bool error_if_nonfinite) {
  if (!(norm_type > 0)) {
    throw std::invalid_argument("ClipGradNorm: norm_type must be > 0, got " + internal::OptionValueText(norm_type));
  }
  // A NaN max_norm would turn every gradient into NaN; a negative one would
  // flip their signs.
  if (!(max_norm >= 0)) {
    throw std::invalid_argument("ClipGradNorm: max_norm must be >= 0, got " + internal::OptionValueText(max_norm));
  }
  // The gradients as the loops and kernels read them: contiguous. One of
  // other strides (set_grad accepts any, as PyTorch) is read as a
  // contiguous copy, and the clipped values are written back through its
  // strides.
  std::vector<Tensor> grads;
  std::vector<std::pair<Tensor, Tensor>> strided;  // (gradient, its copy in grads)
  size_t first = 0;  // the position of the first parameter with a gradient
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    if (!p.defined() || !p.grad().defined()) continue;
    const Tensor& g = p.grad();
    // Checked here, with every gradient, before any is read or scaled: the
    // device path would take an integer one into the norm and then fail to
    // scale it after scaling the ones before it.
    if (!IsFloating(g.dtype())) {
      throw std::invalid_argument("ClipGradNorm: the gradient of parameter " + std::to_string(i) + " has dtype " +
                                  std::string(DTypeName(g.dtype())) + ", expected a floating type");
    }
    if (grads.empty()) first = i;
    if (!grads.empty() && g.device() != grads.front().device()) {
      throw std::invalid_argument("ClipGradNorm: gradients on two devices: parameter " + std::to_string(first) +
                                  "'s on " + grads.front().device().ToString() + ", parameter " + std::to_string(i) +
                                  "'s on " + g.device().ToString());
    }
    if (g.is_contiguous()) {
      grads.push_back(g);
      continue;
    }
    // A gradient shared by two parameters is counted and scaled once per
    // parameter, as PyTorch's foreach scaling does and as a shared
    // contiguous one is here: the second gets the first's copy again, so the
    // copy is scaled twice and written back once.
    auto same_view = std::find_if(strided.begin(), strided.end(), [&g](const std::pair<Tensor, Tensor>& s) {
      const Tensor& h = s.first;
      return h.storage() == g.storage() && h.storage_offset() == g.storage_offset() && h.shape() == g.shape() &&
             h.strides() == g.strides() && h.dtype() == g.dtype();
    });
    if (same_view != strided.end()) {
      grads.push_back(same_view->second);
    } else {
      grads.push_back(g.Detach().Contiguous());
      strided.emplace_back(g, grads.back());
    }
  }
  const bool device_path = !grads.empty() && internal::UsesDevicePath(grads.front().device());
  double acc = 0;
  if (device_path) acc = std::isinf(norm_type) ? DeviceMaxAbs(grads) : DeviceSum(grads, norm_type);
  for (const Tensor& g : grads) {
    if (device_path) break;
    double part = 0;
    DDP_DISPATCH_FLOATING(g.dtype(), "ClipGradNorm", part = Accumulate(g.data<scalar_t>(), g.numel(), norm_type));
    if (std::isinf(norm_type)) {
      if (part > acc || std::isnan(part)) acc = part;
    } else {
      acc += part;
    }
  }
  const double total = std::isinf(norm_type) ? acc : std::pow(acc, 1.0 / norm_type);
  if (!std::isfinite(total) && error_if_nonfinite) {
    throw std::runtime_error("ClipGradNorm: the total norm of order " + internal::OptionValueText(norm_type) +
                             " of the gradients is " + internal::OptionValueText(total));
  }
  // Clamped at 1 as PyTorch does, and rounded per gradient to the type it
  // is scaled in (only f64 gradients take the f64 coefficient).
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0 || std::isnan(coef)) {
    for (const Tensor& g : grads) {
      if (device_path) {
        // Rounded as on the CPU; queued on the device's stream.
        const double c = g.dtype() == DType::kFloat64 ? coef : static_cast<double>(static_cast<float>(coef));
        ops::KernelsFor(g.device().type).affine(g, c, 0.0, g);
      } else {
        DDP_DISPATCH_FLOATING(g.dtype(), "ClipGradNorm", Scale(g.data<scalar_t>(), g.numel(), coef));
      }
      g.storage()->BumpVersion();
    }
    NoGradGuard guard;
    for (const auto& [g, copy] : strided) g.CopyFrom(copy);
  }
  return total;
}

}  // namespace ddp::nn::optim
