#include "nn/optim/adam.h"

#include "nn/optim/device_kernels.h"
#include "nn/optim/kernel_util.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace ddp::nn::optim {
namespace {

std::vector<std::string> Slots(bool amsgrad) {
  if (amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

template <typename T>
struct AdamCoefficients {
  T grad_scale, wd, decay, b1, one_b1, b2, one_b2, bc2_sqrt, eps, neg_step_size;
};

// One Adam pass over n elements. Coefficients arrive by value, so that the
// stores through p, m and v cannot change them and the loop vectorizes
// (see SgdLoop).
template <bool kCoupledWd, bool kDecoupledWd, bool kAmsgrad, typename T>
DDP_OPTIM_INLINE void AdamLoop(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
              T* __restrict__ vmax, int64_t n, const AdamCoefficients<T> c) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = g[i] * c.grad_scale;
    T pi = p[i];
    if constexpr (kCoupledWd) gi = gi + c.wd * pi;
    if constexpr (kDecoupledWd) pi = pi * c.decay;
    const T mi = m[i] * c.b1 + c.one_b1 * gi;
    const T vi = v[i] * c.b2 + c.one_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    T s = vi;
    if constexpr (kAmsgrad) {
      // torch.maximum: a NaN on either side is kept (vmax != vmax is NaN).
      s = (vmax[i] > vi || vmax[i] != vmax[i]) ? vmax[i] : vi;
      vmax[i] = s;
    }
    const T denom = std::sqrt(s) / c.bc2_sqrt + c.eps;
    p[i] = pi + c.neg_step_size * (mi / denom);
  }
}

}  // namespace

Adam::Adam(NamedParameters params, AdamOptions options)
    : Adam(std::vector<ParamGroup>{{.params = std::move(params)}}, options, false) {}

Adam::Adam(std::vector<ParamGroup> groups, AdamOptions defaults) : Adam(std::move(groups), defaults, false) {}

// amsgrad is structural (GroupOptionValues holds every group to the
// defaults'), so the defaults decide the slots for all groups.
Adam::Adam(std::vector<ParamGroup> groups, AdamOptions defaults, bool decoupled)
    : OptimizerWithOptions(decoupled ? "AdamW" : "Adam", groups, defaults, Slots(defaults.amsgrad)),
      decoupled_(decoupled) {
  TakeGroupOptions(groups);
}

// Each refusal names the one option at fault, with its value as given.
void Adam::CheckOptions(const AdamOptions& o) const {
  const std::pair<const char*, double> betas[] = {{"beta1", o.beta1}, {"beta2", o.beta2}};
  for (const auto& [name, x] : betas) {
    if (!(x >= 0 && x < 1)) {
      throw std::invalid_argument(std::string(Name()) + ": " + name + " " + internal::OptionValueText(x) +
                                  " must be in [0, 1)");
    }
  }
  // Infinite ones are refused too: an infinite eps stalls every update at
  // 0, an infinite weight_decay makes it inf or NaN.
  internal::CheckFiniteNonNegative(Name(), {{"eps", o.eps}, {"weight_decay", o.weight_decay}});
}

std::vector<Optimizer::Hyperparameter> Adam::HyperparametersOf(const AdamOptions& o) const {
  // amsgrad decides whether max_exp_avg_sq is kept.
  return {{.name = "beta1", .value = o.beta1},
          {.name = "beta2", .value = o.beta2},
          {.name = "eps", .value = o.eps},
          {.name = "weight_decay", .value = o.weight_decay},
          {.name = "amsgrad", .value = o.amsgrad ? 1.0 : 0.0, .flag = true, .structural = true},
          {.name = "maximize", .value = o.maximize ? 1.0 : 0.0, .flag = true}};
}

void Adam::ReadValues(const std::map<std::string, double>& values, AdamOptions& o) const {
  o.beta1 = values.at("beta1");
  o.beta2 = values.at("beta2");
  o.eps = values.at("eps");
  o.weight_decay = values.at("weight_decay");
  o.amsgrad = values.at("amsgrad") != 0;
  o.maximize = values.at("maximize") != 0;
}

AdamW::AdamW(NamedParameters params, AdamWOptions o)
    : AdamW(std::vector<ParamGroup>{{.params = std::move(params)}}, o) {}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions o)
    : Adam(std::move(groups), AdamOptions{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.amsgrad, o.maximize},
           true) {}

template <typename T>
void Adam::Kernel(size_t group, T* p, const T* g, T* const* slots, int64_t n, int64_t step, T grad_scale) const {
  const AdamOptions& o = options_[group];
  const double lr = this->lr(group);
  T* m = slots[0];
  T* v = slots[1];
  T* vmax = o.amsgrad ? slots[2] : nullptr;
  // Scalars in f64 as Python computes them, then rounded to T.
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  const T neg_step_size = static_cast<T>(-(lr / bc1));
  const T bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  const T b1 = static_cast<T>(o.beta1), one_b1 = static_cast<T>(1.0 - o.beta1);
  const T b2 = static_cast<T>(o.beta2), one_b2 = static_cast<T>(1.0 - o.beta2);
  const T eps = static_cast<T>(o.eps);
  const T wd = static_cast<T>(o.weight_decay);
  const T decay = static_cast<T>(1.0 - lr * o.weight_decay);
  const AdamCoefficients<T> c{grad_scale, wd, decay, b1, one_b1, b2, one_b2, bc2_sqrt, eps,
                              neg_step_size};
  internal::WithFlag(!decoupled_ && o.weight_decay != 0, [&](auto cw) {
    internal::WithFlag(decoupled_, [&](auto dw) {
      internal::WithFlag(o.amsgrad, [&](auto ams) {
        internal::RunVectorized([&]() DDP_OPTIM_LAMBDA_INLINE {
          AdamLoop<cw.value, dw.value, ams.value>(p, g, m, v, vmax, n, c);
        });
      });
    });
  });
}

void Adam::Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool,
                  float grad_scale) {
  Kernel(group, p, g, slots, n, step, grad_scale);
}

void Adam::Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t step, bool,
                  double grad_scale) {
  Kernel(group, p, g, slots, n, step, grad_scale);
}

void Adam::CheckDeviceKernels(Device device) const {
  if (DeviceOptimKernelsFor(device.type).adam_step == nullptr) {
    internal::ThrowNoDeviceKernel(Name(), "adam_step", device);
  }
}

void Adam::DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots,
                        int64_t step, bool, double grad_scale) {
  const AdamOptions& o = options_[group];
  DeviceOptimKernelsFor(p.device().type).adam_step(p, g, slots[0], slots[1], o.amsgrad ? slots[2] : Tensor(),
     AdamStepArgs{.lr = lr(group),
                  .beta1 = o.beta1,
                  .beta2 = o.beta2,
                  .eps = o.eps,
                  .weight_decay = o.weight_decay,
                  .amsgrad = o.amsgrad,
                  .decoupled = decoupled_,
                  .step = step,
                  .grad_scale = grad_scale});
}

}  // namespace ddp::nn::optim
