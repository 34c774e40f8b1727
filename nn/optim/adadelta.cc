#include "nn/optim/adadelta.h"

#include "nn/optim/kernel_util.h"
#include "nn/ops/dispatch.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace ddp::nn::optim {

Adadelta::Adadelta(NamedParameters params, AdadeltaOptions options)
    : Optimizer(std::move(params), options.lr, {"square_avg", "acc_delta"}), options_(options) {
  if (!(options_.rho >= 0 && options_.rho <= 1 && options_.eps >= 0 && options_.weight_decay >= 0)) {
    throw std::invalid_argument("Adadelta: rho " + std::to_string(options_.rho) +
                                " must be in [0, 1], eps " + std::to_string(options_.eps) +
                                " and weight_decay " + std::to_string(options_.weight_decay) +
                                " >= 0");
  }
}

template <typename T>
void Adadelta::Kernel(T* p, const T* g, T* const* slots, int64_t n, T grad_scale) const {
  T* sq = slots[0];
  T* acc = slots[1];
  const T rho = static_cast<T>(options_.rho), one_rho = static_cast<T>(1.0 - options_.rho);
  const T eps = static_cast<T>(options_.eps);
  const T wd = static_cast<T>(options_.weight_decay);
  const T neg_lr = static_cast<T>(-lr());
  T* __restrict__ pr = p;
  const T* __restrict__ gr = g;
  T* __restrict__ sqr = sq;
  T* __restrict__ accr = acc;
  auto loop = [&](auto use_wd) {
    for (int64_t i = 0; i < n; ++i) {
      T gi = gr[i] * grad_scale;
      if constexpr (use_wd) gi = gi + wd * pr[i];
      const T s = sqr[i] * rho + one_rho * gi * gi;
      sqr[i] = s;
      const T std_dev = std::sqrt(s + eps);
      const T delta = std::sqrt(accr[i] + eps) / std_dev * gi;
      accr[i] = accr[i] * rho + one_rho * delta * delta;
      pr[i] = pr[i] + neg_lr * delta;
    }
  };
  internal::WithFlag(options_.weight_decay != 0, loop);
}

void Adadelta::Update(float* p, const float* g, float* const* slots, int64_t n, int64_t,
                      float grad_scale) {
  Kernel(p, g, slots, n, grad_scale);
}

void Adadelta::Update(double* p, const double* g, double* const* slots, int64_t n, int64_t,
                      double grad_scale) {
  Kernel(p, g, slots, n, grad_scale);
}

// No fused device kernel: the rule is composed from the device's elementwise
// kernels (ten passes over n elements instead of one, all queued on the
// current stream). Same order of operations as Kernel above.
void Adadelta::CheckDeviceKernels(Device device) const {
  const auto& k = ops::KernelsFor(device.type);
  if (!k.affine || !k.add_scaled_ || !k.binary || !k.unary) {
    ops::detail::ThrowNoKernel("adadelta (affine, add_scaled_, binary, unary)", device);
  }
}

void Adadelta::DeviceUpdate(const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t,
                            double grad_scale) {
  const Device dev = p.device();
  const Tensor& sq = slots[0];
  const Tensor& acc = slots[1];
  const double rho = options_.rho, one_rho = 1.0 - options_.rho, eps = options_.eps;
  auto temp = [&] { return Empty(p.shape(), {.dtype = p.dtype(), .device = dev}); };
  const auto& k = ops::KernelsFor(dev.type);
  const Tensor gi = temp(), t1 = temp(), t2 = temp(), t3 = temp();
  k.affine(g, grad_scale, 0.0, gi);
  if (options_.weight_decay != 0) k.add_scaled_(gi, p, options_.weight_decay);
  k.binary(ops::BinaryOp::kMul, gi, gi, t1);   // g^2
  k.affine(sq, rho, 0.0, sq);
  k.add_scaled_(sq, t1, one_rho);               // sq = rho sq + (1 - rho) g^2
  k.affine(sq, 1.0, eps, t2);
  k.unary(ops::UnaryOp::kSqrt, t2, t1);         // t1 = sqrt(sq + eps)
  k.affine(acc, 1.0, eps, t2);
  k.unary(ops::UnaryOp::kSqrt, t2, t3);         // t3 = sqrt(acc + eps)
  k.binary(ops::BinaryOp::kDiv, t3, t1, t2);
  k.binary(ops::BinaryOp::kMul, t2, gi, t3);    // t3 = delta
  k.binary(ops::BinaryOp::kMul, t3, t3, t1);    // t1 = delta^2
  k.affine(acc, rho, 0.0, acc);
  k.add_scaled_(acc, t1, one_rho);              // acc = rho acc + (1 - rho) delta^2
  k.add_scaled_(p, t3, -lr());
  sq.storage()->BumpVersion();
  acc.storage()->BumpVersion();
}

}  // namespace ddp::nn::optim
