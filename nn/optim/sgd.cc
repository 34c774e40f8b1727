#include "nn/optim/sgd.h"

#include "nn/optim/device_kernels.h"
#include "nn/optim/kernel_util.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::nn::optim {

namespace {

std::vector<std::string> BufferIf(bool wanted) {
  return wanted ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
}

// The constructor's checks of everything but lr (the base checks that).
void CheckOptions(const SgdOptions& o) {
  // Written so that NaN fails it too; an infinite one makes the update inf
  // or NaN.
  const auto ok = [](double x) { return x >= 0 && std::isfinite(x); };
  if (!(ok(o.momentum) && ok(o.weight_decay) && ok(o.dampening))) {
    throw std::invalid_argument("SGD: momentum " + std::to_string(o.momentum) + ", dampening " +
                                std::to_string(o.dampening) + " and weight_decay " +
                                std::to_string(o.weight_decay) + " must be finite and >= 0");
  }
  if (o.nesterov && (o.momentum <= 0 || o.dampening != 0)) {
    throw std::invalid_argument("SGD: nesterov needs momentum > 0 and dampening 0, got momentum " +
                                std::to_string(o.momentum) + " and dampening " + std::to_string(o.dampening));
  }
}

}  // namespace

// As PyTorch: no momentum buffer (None) at momentum 0, and one started as
// buf = d at the first step that uses it, also after loading a state
// without one. At momentum 0, a buffer in a loaded state (earlier versions
// saved a zero one) is checked and dropped.
Sgd::Sgd(NamedParameters params, SgdOptions options)
    : Optimizer(std::move(params), options.lr, BufferIf(options.momentum != 0),
                {.may_be_absent = true, .dropped = BufferIf(options.momentum == 0)}),
      options_(options) {
  CheckOptions(options_);
  set_maximize(options_.maximize);
}

std::vector<Optimizer::Hyperparameter> Sgd::Hyperparameters() const {
  // Momentum zero or not decides whether a buffer is kept.
  return {{.name = "momentum", .value = options_.momentum, .structural = true},
          {.name = "dampening", .value = options_.dampening},
          {.name = "weight_decay", .value = options_.weight_decay},
          {.name = "nesterov", .value = options_.nesterov ? 1.0 : 0.0, .flag = true, .structural = true},
          {.name = "maximize", .value = options_.maximize ? 1.0 : 0.0, .flag = true}};
}

SgdOptions Sgd::WithSaved(const std::map<std::string, double>& values) const {
  SgdOptions o = options_;
  o.momentum = values.at("momentum");
  o.dampening = values.at("dampening");
  o.weight_decay = values.at("weight_decay");
  o.nesterov = values.at("nesterov") != 0;
  o.maximize = values.at("maximize") != 0;
  CheckOptions(o);
  return o;
}

void Sgd::CheckHyperparameters(const std::map<std::string, double>& values) const { WithSaved(values); }

void Sgd::SetHyperparameters(const std::map<std::string, double>& values) {
  options_ = WithSaved(values);
  set_maximize(options_.maximize);
}

namespace {

// One SGD pass over n elements. Options are template constants and every
// coefficient a value parameter: with coefficients captured by reference,
// GCC could not rule out that the stores to p and buf change them, and left
// the loop scalar (15 GB/s against 37 GB/s for Adam in optim_bench).
template <bool kWd, bool kMom, bool kFirst, bool kNesterov, typename T>
void SgdLoop(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ buf, int64_t n,
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
void Sgd::Kernel(T* p, const T* g, T* buf, int64_t n, bool first, T grad_scale) const {
  const T wd = static_cast<T>(options_.weight_decay);
  const T mom = static_cast<T>(options_.momentum);
  const T keep = static_cast<T>(1.0 - options_.dampening);
  const T neg_lr = static_cast<T>(-lr());
  internal::WithFlag(options_.weight_decay != 0, [&](auto w) {
    internal::WithFlag(options_.momentum != 0, [&](auto m) {
      internal::WithFlag(first, [&](auto f) {
        internal::WithFlag(options_.nesterov, [&](auto nv) {
          SgdLoop<w.value, m.value, f.value, nv.value>(p, g, buf, n, grad_scale, wd, mom, keep,
                                                       neg_lr);
        });
      });
    });
  });
}

// The buffer's first update is the parameter's first, or its first after a
// state without a buffer was loaded: `fresh`, not step 1.
void Sgd::Update(float* p, const float* g, float* const* slots, int64_t n, int64_t, bool fresh,
                 float grad_scale) {
  Kernel(p, g, options_.momentum != 0 ? slots[0] : nullptr, n, fresh, grad_scale);
}

void Sgd::Update(double* p, const double* g, double* const* slots, int64_t n, int64_t, bool fresh,
                 double grad_scale) {
  Kernel(p, g, options_.momentum != 0 ? slots[0] : nullptr, n, fresh, grad_scale);
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
SgdStepArgs Sgd::StepArgs(bool fresh, double grad_scale) const {
  return SgdStepArgs{.lr = lr(),
                     .momentum = options_.momentum,
                     .dampening = options_.dampening,
                     .weight_decay = options_.weight_decay,
                     .nesterov = options_.nesterov,
                     .step = fresh ? 1 : 2,
                     .grad_scale = grad_scale};
}

void Sgd::DeviceUpdate(const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t, bool fresh,
                       double grad_scale) {
  DeviceOptimKernelsFor(p.device().type).sgd_step(p, g, options_.momentum != 0 ? slots[0] : Tensor(),
                                                  StepArgs(fresh, grad_scale));
}

// With `sgd_step_multi`, one call per group of parameters that share device,
// dtype and arguments; the arguments differ only in whether the update
// starts the momentum buffer (see StepArgs), so parameters whose step counts
// drifted apart are still updated together. Each group keeps the
// parameters' order.
void Sgd::DeviceUpdateAll(const std::vector<DeviceUpdateItem>& items, double grad_scale) {
  if (items.empty()) return;
  const DeviceOptimKernels& k = DeviceOptimKernelsFor(items.front().p.device().type);
  if (k.sgd_step_multi == nullptr) {
    Optimizer::DeviceUpdateAll(items, grad_scale);
    return;
  }
  struct Group {
    Device device;
    DType dtype;
    SgdStepArgs args;
    std::vector<Tensor> params, grads, buffers;
  };
  std::vector<Group> groups;
  for (const DeviceUpdateItem& item : items) {
    const SgdStepArgs args = StepArgs(item.fresh, grad_scale);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) {
      return g.device == item.p.device() && g.dtype == item.p.dtype() && g.args == args;
    });
    if (it == groups.end()) {
      groups.push_back({.device = item.p.device(), .dtype = item.p.dtype(), .args = args});
      it = std::prev(groups.end());
    }
    it->params.push_back(item.p);
    it->grads.push_back(item.g);
    it->buffers.push_back(options_.momentum != 0 ? item.slots[0] : Tensor());
  }
  for (const Group& g : groups) k.sgd_step_multi(g.params, g.grads, g.buffers, g.args);
}

}  // namespace ddp::nn::optim
