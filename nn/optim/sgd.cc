#include "nn/optim/sgd.h"

#include "nn/optim/device_kernels.h"
#include "nn/optim/kernel_util.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ddp::nn::optim {

namespace {

std::vector<std::string> BufferIf(bool wanted) {
  return wanted ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
}

}  // namespace

// Each refusal names the one option at fault, with its value as given.
void Sgd::CheckOptions(const SgdOptions& o) const {
  internal::CheckFiniteNonNegative("SGD", {{"momentum", o.momentum}, {"weight_decay", o.weight_decay}});
  // PyTorch puts no bound on dampening: a negative one (the new gradient
  // weighted by more than 1) is taken as given. Only a value that would
  // make the buffer inf or NaN is refused.
  if (!std::isfinite(o.dampening)) {
    throw std::invalid_argument("SGD: dampening " + internal::OptionValueText(o.dampening) + " must be finite");
  }
  if (o.nesterov && o.momentum <= 0) {
    throw std::invalid_argument("SGD: momentum " + internal::OptionValueText(o.momentum) +
                                " must be > 0 with nesterov");
  }
  if (o.nesterov && o.dampening != 0) {
    throw std::invalid_argument("SGD: dampening " + internal::OptionValueText(o.dampening) +
                                " must be 0 with nesterov");
  }
}

// As PyTorch: no momentum buffer (None) at momentum 0, and one started as
// buf = d at the first step that uses it, also after loading a state
// without one. At momentum 0, a buffer in a loaded state (earlier versions
// saved a zero one) is checked and dropped.
Sgd::Sgd(NamedParameters params, SgdOptions options)
    : Sgd(std::vector<ParamGroup>{{.params = std::move(params)}}, options) {}

// Momentum zero or not is structural (GroupOptionValues holds every group
// to the defaults'), so the defaults decide the buffer for all groups.
Sgd::Sgd(std::vector<ParamGroup> groups, SgdOptions defaults)
    : OptimizerWithOptions("SGD", groups, defaults, BufferIf(defaults.momentum != 0),
                           {.may_be_absent = true, .dropped = BufferIf(defaults.momentum == 0)}) {
  TakeGroupOptions(groups);
}

std::vector<Optimizer::Hyperparameter> Sgd::HyperparametersOf(const SgdOptions& o) const {
  // Momentum zero or not decides whether a buffer is kept.
  return {{.name = "momentum", .value = o.momentum, .structural = true},
          {.name = "dampening", .value = o.dampening},
          {.name = "weight_decay", .value = o.weight_decay},
          {.name = "nesterov", .value = o.nesterov ? 1.0 : 0.0, .flag = true, .structural = true},
          {.name = "maximize", .value = o.maximize ? 1.0 : 0.0, .flag = true}};
}

void Sgd::ReadValues(const std::map<std::string, double>& values, SgdOptions& o) const {
  o.momentum = values.at("momentum");
  o.dampening = values.at("dampening");
  o.weight_decay = values.at("weight_decay");
  o.nesterov = values.at("nesterov") != 0;
  o.maximize = values.at("maximize") != 0;
}

namespace {

// One SGD pass over n elements. Options are template constants and every
// coefficient a value parameter: with coefficients captured by reference,
// GCC could not rule out that the stores to p and buf change them, and left
// the loop scalar (15 GB/s against 37 GB/s for Adam in optim_bench).
template <bool kWd, bool kMom, bool kFirst, bool kNesterov, typename T>
DDP_OPTIM_INLINE void SgdLoop(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ buf, int64_t n,
             T grad_scale, T wd, T mom, T keep, T neg_lr) {
  for (int64_t i = 0; i < n; ++i) {
    T d = g[i] * grad_scale;
    if constexpr (kWd) d = d + wd * p[i];
    if constexpr (kMom) {
      T b;
      if constexpr (kFirst) {
        b = d;
      } else {
        b = buf[i] * mom + keep * d;
      }
      buf[i] = b;
      if constexpr (kNesterov) {
        d = d + mom * b;
      } else {
        d = b;
      }
    }
    p[i] = p[i] + neg_lr * d;
  }
}

}  // namespace

// Coefficients are rounded to T first, as PyTorch passes Python floats to
// kernels of the tensor's type; each line is one PyTorch tensor op.
template <typename T>
void Sgd::Kernel(size_t group, T* p, const T* g, T* buf, int64_t n, bool first, T grad_scale) const {
  const SgdOptions& o = options_[group];
  const T wd = static_cast<T>(o.weight_decay);
  const T mom = static_cast<T>(o.momentum);
  const T keep = static_cast<T>(1.0 - o.dampening);
  const T neg_lr = static_cast<T>(-lr(group));
  internal::WithFlag(o.weight_decay != 0, [&](auto w) {
    internal::WithFlag(o.momentum != 0, [&](auto m) {
      internal::WithFlag(first, [&](auto f) {
        internal::WithFlag(o.nesterov, [&](auto nv) {
          internal::RunVectorized([&]() DDP_OPTIM_LAMBDA_INLINE {
            SgdLoop<w.value, m.value, f.value, nv.value>(p, g, buf, n, grad_scale, wd, mom, keep,
                                                         neg_lr);
          });
        });
      });
    });
  });
}

// The buffer's first update is the parameter's first, or its first after a
// state without a buffer was loaded: `fresh`, not step 1.
void Sgd::Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t, bool fresh,
                 float grad_scale) {
  Kernel(group, p, g, options_[group].momentum != 0 ? slots[0] : nullptr, n, fresh, grad_scale);
}

void Sgd::Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t, bool fresh,
                 double grad_scale) {
  Kernel(group, p, g, options_[group].momentum != 0 ? slots[0] : nullptr, n, fresh, grad_scale);
}

void Sgd::CheckDeviceKernels(Device device) const {
  const DeviceOptimKernels& k = DeviceOptimKernelsFor(device.type);
  if (k.sgd_step == nullptr && k.sgd_step_multi == nullptr) {
    internal::ThrowNoDeviceKernel(Name(), "sgd_step", device);
  }
}

// The kernel reads the step only to start the buffer (buf = d) at step 1,
// so every other update (all of them without momentum, which keeps no
// buffer) is passed as 2: the arguments then differ between
// parameters only in whether their buffer starts now, and parameters whose
// counts drifted apart (one skipped a step without a gradient) still share
// one sgd_step_multi call. SGD itself keeps the real counts (step_count,
// the saved state); nothing reads them from these arguments.
SgdStepArgs Sgd::StepArgs(size_t group, bool fresh, double grad_scale) const {
  const SgdOptions& o = options_[group];
  return SgdStepArgs{.lr = lr(group),
                     .momentum = o.momentum,
                     .dampening = o.dampening,
                     .weight_decay = o.weight_decay,
                     .nesterov = o.nesterov,
                     .step = fresh ? 1 : 2,
                     .grad_scale = grad_scale};
}

void Sgd::DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t,
                       bool fresh, double grad_scale) {
  DeviceOptimKernelsFor(p.device().type)
      .sgd_step(p, g, options_[group].momentum != 0 ? slots[0] : Tensor(), StepArgs(group, fresh, grad_scale));
}

// With `sgd_step_multi`, one call per batch of parameters that share device,
// dtype and arguments. Within a param group the arguments differ only in
// whether the update starts the momentum buffer (see StepArgs), so
// parameters whose step counts drifted apart are still updated together;
// param groups differ in their rate and options, and each batch is of one
// param group (two groups with equal arguments share one). Each batch keeps
// the parameters' order.
void Sgd::DeviceUpdateAll(const std::vector<DeviceUpdateItem>& items) {
  if (items.empty()) return;
  const DeviceOptimKernels& k = DeviceOptimKernelsFor(items.front().p.device().type);
  if (k.sgd_step_multi == nullptr) {
    Optimizer::DeviceUpdateAll(items);
    return;
  }
  struct Batch {
    Device device;
    DType dtype;
    SgdStepArgs args;
    std::vector<Tensor> params, grads, buffers;
  };
  std::vector<Batch> batches;
  for (const DeviceUpdateItem& item : items) {
    const SgdStepArgs args = StepArgs(item.group, item.fresh, item.grad_scale);
    auto it = std::find_if(batches.begin(), batches.end(), [&](const Batch& b) {
      return b.device == item.p.device() && b.dtype == item.p.dtype() && b.args == args;
    });
    if (it == batches.end()) {
      batches.push_back({.device = item.p.device(), .dtype = item.p.dtype(), .args = args});
      it = std::prev(batches.end());
    }
    it->params.push_back(item.p);
    it->grads.push_back(item.g);
    it->buffers.push_back(options_[item.group].momentum != 0 ? item.slots[0] : Tensor());
  }
  for (const Batch& b : batches) k.sgd_step_multi(b.params, b.grads, b.buffers, b.args);
}

}  // namespace ddp::nn::optim
