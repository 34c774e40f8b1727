#include "nn/optim/adadelta.h"

#include "nn/optim/device_kernels.h"
#include "nn/optim/kernel_util.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace ddp::nn::optim {
namespace {

// One Adadelta pass over n elements, coefficients by value so that the loop
// vectorizes (see SgdLoop).
template <bool kWd, typename T>
void AdadeltaLoop(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ sq,
                  T* __restrict__ acc, int64_t n, T grad_scale, T rho, T one_rho, T eps, T wd,
                  T neg_lr) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = g[i] * grad_scale;
    if constexpr (kWd) gi = gi + wd * p[i];
    const T s = sq[i] * rho + one_rho * gi * gi;
    sq[i] = s;
    const T std_dev = std::sqrt(s + eps);
    const T delta = std::sqrt(acc[i] + eps) / std_dev * gi;
    acc[i] = acc[i] * rho + one_rho * delta * delta;
    p[i] = p[i] + neg_lr * delta;
  }
}

}  // namespace

Adadelta::Adadelta(NamedParameters params, AdadeltaOptions options)
    : Optimizer(std::move(params), options.lr, {"square_avg", "acc_delta"}), options_(options) {
  set_maximize(options_.maximize);
  CheckOptions(options_);
}

void Adadelta::CheckOptions(const AdadeltaOptions& o) {
  // eps and weight_decay also finite: either inf makes the update NaN.
  if (!(o.rho >= 0 && o.rho <= 1 && o.eps >= 0 && o.weight_decay >= 0 && std::isfinite(o.eps) &&
        std::isfinite(o.weight_decay))) {
    throw std::invalid_argument("Adadelta: rho " + std::to_string(o.rho) + " must be in [0, 1], eps " +
                                std::to_string(o.eps) + " and weight_decay " + std::to_string(o.weight_decay) +
                                " finite and >= 0");
  }
}

std::vector<Optimizer::Hyperparameter> Adadelta::Hyperparameters() const {
  return {{.name = "rho", .value = options_.rho},
          {.name = "eps", .value = options_.eps},
          {.name = "weight_decay", .value = options_.weight_decay},
          {.name = "maximize", .value = options_.maximize ? 1.0 : 0.0, .flag = true}};
}

AdadeltaOptions Adadelta::WithSaved(const std::map<std::string, double>& values) const {
  AdadeltaOptions o = options_;
  o.rho = values.at("rho");
  o.eps = values.at("eps");
  o.weight_decay = values.at("weight_decay");
  o.maximize = values.at("maximize") != 0;
  CheckOptions(o);
  return o;
}

void Adadelta::CheckHyperparameters(const std::map<std::string, double>& values) const { WithSaved(values); }

void Adadelta::SetHyperparameters(const std::map<std::string, double>& values) {
  options_ = WithSaved(values);
  set_maximize(options_.maximize);
}

template <typename T>
void Adadelta::Kernel(T* p, const T* g, T* const* slots, int64_t n, T grad_scale) const {
  T* sq = slots[0];
  T* acc = slots[1];
  const T rho = static_cast<T>(options_.rho), one_rho = static_cast<T>(1.0 - options_.rho);
  const T eps = static_cast<T>(options_.eps);
  const T wd = static_cast<T>(options_.weight_decay);
  const T neg_lr = static_cast<T>(-lr());
  internal::WithFlag(options_.weight_decay != 0, [&](auto w) {
    AdadeltaLoop<w.value>(p, g, sq, acc, n, grad_scale, rho, one_rho, eps, wd, neg_lr);
  });
}

void Adadelta::Update(float* p, const float* g, float* const* slots, int64_t n, int64_t, bool,
                      float grad_scale) {
  Kernel(p, g, slots, n, grad_scale);
}

void Adadelta::Update(double* p, const double* g, double* const* slots, int64_t n, int64_t, bool,
                      double grad_scale) {
  Kernel(p, g, slots, n, grad_scale);
}

void Adadelta::CheckDeviceKernels(Device device) const {
  if (DeviceOptimKernelsFor(device.type).adadelta_step == nullptr) {
    internal::ThrowNoDeviceKernel(Name(), "adadelta_step", device);
  }
}

// One fused kernel per parameter (it follows Kernel above operation by
// operation): one pass over p, g and the two slots instead of the ten that
// composing elementwise ops would take.
void Adadelta::DeviceUpdate(const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t, bool,
                            double grad_scale) {
  DeviceOptimKernelsFor(p.device().type)
      .adadelta_step(p, g, slots[0], slots[1],
                     AdadeltaStepArgs{.lr = lr(),
                                      .rho = options_.rho,
                                      .eps = options_.eps,
                                      .weight_decay = options_.weight_decay,
                                      .grad_scale = grad_scale});
}

}  // namespace ddp::nn::optim
