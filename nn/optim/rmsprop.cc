#include "nn/optim/rmsprop.h"

#include "nn/optim/device_kernels.h"
#include "nn/optim/kernel_util.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ddp::nn::optim {
namespace {

// The slots in PyTorch's order; which are kept depends on the structural
// options (momentum zero or not, centered), the same for every group.
std::vector<std::string> Slots(const RmspropOptions& o) {
  std::vector<std::string> slots = {"square_avg"};
  if (o.momentum != 0) slots.push_back("momentum_buffer");
  if (o.centered) slots.push_back("grad_avg");
  return slots;
}

template <typename T>
struct RmspropCoefficients {
  T grad_scale, wd, alpha, one_alpha, lerp_keep, eps, mom, neg_lr;
};

// One RMSprop pass over n elements, each line one of PyTorch's tensor ops
// in its order of operands (addcmul is self + (value * t1) * t2, addcdiv
// self + (value * t1) / t2). The centered average is lerp(ga, g, w) with
// w = 1 - alpha, computed as ATen's scalar lerp: ga + w * (g - ga) for
// |w| < 0.5, else g - (g - ga) * (1 - w) (kSmallW). Coefficients arrive by
// value so that the loop vectorizes (see SgdLoop).
template <bool kWd, bool kCentered, bool kSmallW, bool kMom, typename T>
DDP_OPTIM_INLINE void RmspropLoop(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ sq,
                                  T* __restrict__ buf, T* __restrict__ ga, int64_t n, const RmspropCoefficients<T> c) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = g[i] * c.grad_scale;
    if constexpr (kWd) gi = gi + c.wd * p[i];
    const T s = sq[i] * c.alpha + c.one_alpha * gi * gi;
    sq[i] = s;
    T avg;
    if constexpr (kCentered) {
      T a;
      if constexpr (kSmallW) {
        a = ga[i] + c.one_alpha * (gi - ga[i]);
      } else {
        a = gi - (gi - ga[i]) * c.lerp_keep;
      }
      ga[i] = a;
      avg = std::sqrt(s - a * a) + c.eps;
    } else {
      avg = std::sqrt(s) + c.eps;
    }
    if constexpr (kMom) {
      const T b = buf[i] * c.mom + gi / avg;
      buf[i] = b;
      p[i] = p[i] + c.neg_lr * b;
    } else {
      p[i] = p[i] + (c.neg_lr * gi) / avg;
    }
  }
}

}  // namespace

Rmsprop::Rmsprop(NamedParameters params, RmspropOptions options)
    : Rmsprop(std::vector<ParamGroup>{{.params = std::move(params)}}, options) {}

// momentum zero or not and centered are structural (GroupOptionValues holds
// every group to the defaults'), so the defaults decide the slots for all.
Rmsprop::Rmsprop(std::vector<ParamGroup> groups, RmspropOptions defaults)
    : OptimizerWithOptions("RMSprop", groups, defaults, Slots(defaults)) {
  TakeGroupOptions(groups);
}

// Each refusal names the one option at fault, with its value as given.
void Rmsprop::CheckOptions(const RmspropOptions& o) const {
  // PyTorch asks only alpha >= 0; above 1, (1 - alpha) * g * g subtracts
  // and the square root of a negative average is NaN.
  if (!(o.alpha >= 0 && o.alpha <= 1)) {
    throw std::invalid_argument("RMSprop: alpha " + internal::OptionValueText(o.alpha) + " must be in [0, 1]");
  }
  // Infinite ones too: each makes the update inf or NaN (or stalls it at 0).
  internal::CheckFiniteNonNegative("RMSprop",
                                   {{"eps", o.eps}, {"weight_decay", o.weight_decay}, {"momentum", o.momentum}});
}

std::vector<Optimizer::Hyperparameter> Rmsprop::HyperparametersOf(const RmspropOptions& o) const {
  // momentum zero or not decides whether momentum_buffer is kept, centered
  // whether grad_avg is.
  return {{.name = "alpha", .value = o.alpha},
          {.name = "eps", .value = o.eps},
          {.name = "weight_decay", .value = o.weight_decay},
          {.name = "momentum", .value = o.momentum, .structural = true},
          {.name = "centered", .value = o.centered ? 1.0 : 0.0, .flag = true, .structural = true},
          {.name = "maximize", .value = o.maximize ? 1.0 : 0.0, .flag = true}};
}

void Rmsprop::ReadValues(const std::map<std::string, double>& values, RmspropOptions& o) const {
  o.alpha = values.at("alpha");
  o.eps = values.at("eps");
  o.weight_decay = values.at("weight_decay");
  o.momentum = values.at("momentum");
  o.centered = values.at("centered") != 0;
  o.maximize = values.at("maximize") != 0;
}

// Coefficients are rounded to T first, as PyTorch passes Python floats to
// kernels of the tensor's type.
template <typename T>
void Rmsprop::Kernel(size_t group, T* p, const T* g, T* const* slots, int64_t n, T grad_scale) const {
  const RmspropOptions& o = options_[group];
  T* sq = slots[0];
  T* buf = o.momentum != 0 ? slots[1] : nullptr;
  T* ga = o.centered ? slots[o.momentum != 0 ? 2 : 1] : nullptr;
  const RmspropCoefficients<T> c{.grad_scale = grad_scale,
                                 .wd = static_cast<T>(o.weight_decay),
                                 .alpha = static_cast<T>(o.alpha),
                                 .one_alpha = static_cast<T>(1.0 - o.alpha),
                                 .lerp_keep = static_cast<T>(1) - static_cast<T>(1.0 - o.alpha),
                                 .eps = static_cast<T>(o.eps),
                                 .mom = static_cast<T>(o.momentum),
                                 .neg_lr = static_cast<T>(-lr(group))};
  // ATen's lerp branches on its weight w = 1 - alpha (rounded to T); the
  // large-weight form multiplies by 1 - w, taken in T (lerp_keep).
  const bool small_w = std::fabs(c.one_alpha) < static_cast<T>(0.5);
  internal::WithFlag(o.weight_decay != 0, [&](auto w) {
    internal::WithFlag(o.centered, [&](auto ctr) {
      internal::WithFlag(small_w, [&](auto sw) {
        internal::WithFlag(o.momentum != 0, [&](auto m) {
          internal::RunVectorized([&]() DDP_OPTIM_LAMBDA_INLINE {
            RmspropLoop<w.value, ctr.value, sw.value, m.value>(p, g, sq, buf, ga, n, c);
          });
        });
      });
    });
  });
}

void Rmsprop::Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t, bool,
                     float grad_scale) {
  Kernel(group, p, g, slots, n, grad_scale);
}

void Rmsprop::Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t, bool,
                     double grad_scale) {
  Kernel(group, p, g, slots, n, grad_scale);
}

void Rmsprop::CheckDeviceKernels(Device device) const {
  if (DeviceOptimKernelsFor(device.type).rmsprop_step == nullptr) {
    internal::ThrowNoDeviceKernel(Name(), "rmsprop_step", device);
  }
}

void Rmsprop::DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t,
                           bool, double grad_scale) {
  const RmspropOptions& o = options_[group];
  const Tensor buf = o.momentum != 0 ? slots[1] : Tensor();
  const Tensor ga = o.centered ? slots[o.momentum != 0 ? 2 : 1] : Tensor();
  DeviceOptimKernelsFor(p.device().type)
      .rmsprop_step(p, g, slots[0], buf, ga,
                    RmspropStepArgs{.lr = lr(group),
                                    .alpha = o.alpha,
                                    .eps = o.eps,
                                    .weight_decay = o.weight_decay,
                                    .momentum = o.momentum,
                                    .centered = o.centered,
                                    .grad_scale = grad_scale});
}

}  // namespace ddp::nn::optim
