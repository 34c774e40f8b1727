#include "nn/optim/adagrad.h"

#include "nn/optim/device_kernels.h"
#include "nn/optim/kernel_util.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace ddp::nn::optim {
namespace {

// One Adagrad pass over n elements, each line one of PyTorch's tensor ops
// (addcmul_ with value 1 is sum + g * g; addcdiv_ with value -clr is
// p + (-clr * g) / std). Coefficients by value so that the loop vectorizes
// (see SgdLoop).
template <bool kWd, typename T>
DDP_OPTIM_INLINE void AdagradLoop(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ sum, int64_t n,
                                  T grad_scale, T wd, T eps, T neg_clr) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = g[i] * grad_scale;
    if constexpr (kWd) gi = gi + wd * p[i];
    const T s = sum[i] + gi * gi;
    sum[i] = s;
    const T std_dev = std::sqrt(s) + eps;
    p[i] = p[i] + (neg_clr * gi) / std_dev;
  }
}

}  // namespace

Adagrad::Adagrad(NamedParameters params, AdagradOptions options)
    : Adagrad(std::vector<ParamGroup>{{.params = std::move(params)}}, options) {}

Adagrad::Adagrad(std::vector<ParamGroup> groups, AdagradOptions defaults)
    : OptimizerWithOptions("Adagrad", groups, defaults, {"sum"}) {
  TakeGroupOptions(groups);
}

// Each group's own value, where PyTorch fills every parameter's sum with
// the constructor's (a group's "initial_accumulator_value" is saved there
// but unread): a group option that nothing read would be a trap.
std::vector<double> Adagrad::StartSlotValues(size_t group) const {
  return {options_[group].initial_accumulator_value};
}

// Each refusal names the one option at fault, with its value as given.
// PyTorch asks each to be >= 0; infinite ones are refused too, as each
// makes the update inf or NaN, or stalls it at 0.
void Adagrad::CheckOptions(const AdagradOptions& o) const {
  internal::CheckFiniteNonNegative("Adagrad", {{"lr_decay", o.lr_decay},
                                               {"weight_decay", o.weight_decay},
                                               {"initial_accumulator_value", o.initial_accumulator_value},
                                               {"eps", o.eps}});
}

std::vector<Optimizer::Hyperparameter> Adagrad::HyperparametersOf(const AdagradOptions& o) const {
  return {{.name = "lr_decay", .value = o.lr_decay},
          {.name = "weight_decay", .value = o.weight_decay},
          {.name = "initial_accumulator_value", .value = o.initial_accumulator_value},
          {.name = "eps", .value = o.eps},
          {.name = "maximize", .value = o.maximize ? 1.0 : 0.0, .flag = true}};
}

void Adagrad::ReadValues(const std::map<std::string, double>& values, AdagradOptions& o) const {
  o.lr_decay = values.at("lr_decay");
  o.weight_decay = values.at("weight_decay");
  o.initial_accumulator_value = values.at("initial_accumulator_value");
  o.eps = values.at("eps");
  o.maximize = values.at("maximize") != 0;
}

double Adagrad::StepRate(size_t group, int64_t step) const {
  return lr(group) / (1.0 + static_cast<double>(step - 1) * options_[group].lr_decay);
}

// The sum is held from the start (StartSlotValues), so `fresh` does not
// arise.
template <typename T>
void Adagrad::Kernel(size_t group, T* p, const T* g, T* sum, int64_t n, int64_t step, T grad_scale) const {
  const AdagradOptions& o = options_[group];
  const T wd = static_cast<T>(o.weight_decay);
  const T eps = static_cast<T>(o.eps);
  const T neg_clr = static_cast<T>(-StepRate(group, step));
  internal::WithFlag(o.weight_decay != 0, [&](auto w) {
    internal::RunVectorized([&]() DDP_OPTIM_LAMBDA_INLINE {
      AdagradLoop<w.value>(p, g, sum, n, grad_scale, wd, eps, neg_clr);
    });
  });
}

void Adagrad::Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool,
                     float grad_scale) {
  Kernel(group, p, g, slots[0], n, step, grad_scale);
}

void Adagrad::Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t step, bool,
                     double grad_scale) {
  Kernel(group, p, g, slots[0], n, step, grad_scale);
}

void Adagrad::CheckDeviceKernels(Device device) const {
  if (DeviceOptimKernelsFor(device.type).adagrad_step == nullptr) {
    internal::ThrowNoDeviceKernel(Name(), "adagrad_step", device);
  }
}

void Adagrad::DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots,
                           int64_t step, bool, double grad_scale) {
  const AdagradOptions& o = options_[group];
  DeviceOptimKernelsFor(p.device().type)
      .adagrad_step(p, g, slots[0],
                    AdagradStepArgs{.clr = StepRate(group, step),
                                    .eps = o.eps,
                                    .weight_decay = o.weight_decay,
                                    .grad_scale = grad_scale});
}

}  // namespace ddp::nn::optim
