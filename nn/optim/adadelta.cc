#include "nn/optim/adadelta.h"

#include "nn/optim/device_kernels.h"
#include "nn/optim/kernel_util.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace ddp::nn::optim {
namespace {

// One Adadelta pass over n elements, coefficients by value so that the loop
// vectorizes (see SgdLoop).
template <bool kWd, typename T>
DDP_OPTIM_INLINE void AdadeltaLoop(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ sq,
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
    : Adadelta(std::vector<ParamGroup>{{.params = std::move(params)}}, options) {}

Adadelta::Adadelta(std::vector<ParamGroup> groups, AdadeltaOptions defaults)
    : OptimizerWithOptions("Adadelta", groups, defaults, {"square_avg", "acc_delta"}) {
  TakeGroupOptions(groups);
}

// Each refusal names the one option at fault, with its value as given.
void Adadelta::CheckOptions(const AdadeltaOptions& o) const {
  if (!(o.rho >= 0 && o.rho <= 1)) {
    throw std::invalid_argument("Adadelta: rho " + internal::OptionValueText(o.rho) + " must be in [0, 1]");
  }
  // eps and weight_decay also finite: either inf makes the update NaN.
  internal::CheckFiniteNonNegative("Adadelta", {{"eps", o.eps}, {"weight_decay", o.weight_decay}});
}

std::vector<Optimizer::Hyperparameter> Adadelta::HyperparametersOf(const AdadeltaOptions& o) const {
  return {{.name = "rho", .value = o.rho},
          {.name = "eps", .value = o.eps},
          {.name = "weight_decay", .value = o.weight_decay},
          {.name = "maximize", .value = o.maximize ? 1.0 : 0.0, .flag = true}};
}

void Adadelta::ReadValues(const std::map<std::string, double>& values, AdadeltaOptions& o) const {
  o.rho = values.at("rho");
  o.eps = values.at("eps");
  o.weight_decay = values.at("weight_decay");
  o.maximize = values.at("maximize") != 0;
}

template <typename T>
void Adadelta::Kernel(size_t group, T* p, const T* g, T* const* slots, int64_t n, T grad_scale) const {
  const AdadeltaOptions& o = options_[group];
  T* sq = slots[0];
  T* acc = slots[1];
  const T rho = static_cast<T>(o.rho), one_rho = static_cast<T>(1.0 - o.rho);
  const T eps = static_cast<T>(o.eps);
  const T wd = static_cast<T>(o.weight_decay);
  const T neg_lr = static_cast<T>(-lr(group));
  internal::WithFlag(o.weight_decay != 0, [&](auto w) {
    internal::RunVectorized([&]() DDP_OPTIM_LAMBDA_INLINE {
      AdadeltaLoop<w.value>(p, g, sq, acc, n, grad_scale, rho, one_rho, eps, wd, neg_lr);
    });
  });
}

void Adadelta::Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t, bool,
                      float grad_scale) {
  Kernel(group, p, g, slots, n, grad_scale);
}

void Adadelta::Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t, bool,
                      double grad_scale) {
  Kernel(group, p, g, slots, n, grad_scale);
}

void Adadelta::CheckDeviceKernels(Device device) const {
  if (DeviceOptimKernelsFor(device.type).adadelta_step == nullptr) {
    internal::ThrowNoDeviceKernel(Name(), "adadelta_step", device);
  }
}

// One fused kernel per parameter (it follows Kernel above operation by
// operation): one pass over p, g and the two slots instead of the ten that
// composing elementwise ops would take.
void Adadelta::DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots,
                            int64_t, bool, double grad_scale) {
  const AdadeltaOptions& o = options_[group];
  DeviceOptimKernelsFor(p.device().type)
      .adadelta_step(p, g, slots[0], slots[1],
                     AdadeltaStepArgs{.lr = lr(group),
                                      .rho = o.rho,
                                      .eps = o.eps,
                                      .weight_decay = o.weight_decay,
                                      .grad_scale = grad_scale});
}

}  // namespace ddp::nn::optim
