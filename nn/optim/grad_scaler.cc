#include "nn/optim/grad_scaler.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nn/ops/dispatch.h"
#include "nn/optim/device_kernels.h"

namespace ddp::nn::optim {
namespace {

// True if any element is inf or NaN; with `unscale`, also multiplies in place.
// Checked in the element's own precision: an f64 gradient above f32's
// range (3.4e38) is finite, and rounded to float it would read as inf.
template <typename T>
bool CheckAndMaybeUnscale(T* g, int64_t n, float inv_scale, bool unscale) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const acc_t<T> v = static_cast<acc_t<T>>(g[i]);
    bad |= !std::isfinite(v);
    if (unscale) g[i] = static_cast<T>(v * inv_scale);
  }
  return bad;
}

// The gradients to scan, checked to be on the optimizer's device, as the
// loops and kernels read them: contiguous. A gradient of other strides
// (set_grad accepts any, and Step reads any, as PyTorch) is scanned as a
// contiguous copy, which WriteBack puts into it after an unscale.
struct Grads {
  explicit Grads(const Optimizer& opt) {
    for (const auto& [name, p] : opt.params()) {
      const Tensor& g = p.grad();
      if (!g.defined()) continue;
      if (g.device() != opt.device()) {
        throw std::invalid_argument("GradScaler: gradient of `" + name + "` is on " + g.device().ToString() +
                                    ", the parameter on " + p.device().ToString() + ", the optimizer on " +
                                    opt.device().ToString());
      }
      if (g.is_contiguous()) {
        dense.push_back(g);
      } else {
        dense.push_back(g.Detach().Contiguous());
        strided.emplace_back(g, dense.back());
      }
    }
    // Nothing to check would read as "no inf": a step that skipped nothing
    // while the loss was never backpropagated (PyTorch raises here too).
    if (dense.empty() && !opt.params().empty()) {
      throw std::logic_error(
          "GradScaler: no parameter of the optimizer has a gradient (its first is `" +
          opt.params().front().first +
          "`); run backward on scaler.Scale(loss) before Unscale or Step");
    }
  }
  void WriteBack() const {
    NoGradGuard guard;
    for (const auto& [g, copy] : strided) g.CopyFrom(copy);
  }
  std::vector<Tensor> dense;
  std::vector<std::pair<Tensor, Tensor>> strided;  // (gradient, its copy in dense)
};

// Device path: resets `flag` (one f32 element on the device, allocated once
// per device and holding only 0 or 1) with a kernel rather than a host copy,
// then queues the check (and the unscale when inv_scale != 1). Nothing is
// read back here.
void DeviceScan(const Optimizer& opt, const std::vector<Tensor>& grads, float inv_scale, Tensor& flag) {
  const auto fn = DeviceOptimKernelsFor(opt.device().type).unscale_and_check;
  if (fn == nullptr) internal::ThrowNoDeviceKernel("GradScaler", "unscale_and_check", opt.device());
  if (!flag.defined() || flag.device() != opt.device()) {
    flag = Zeros({1}, {.dtype = DType::kFloat32, .device = opt.device()});
  } else {
    DDP_KERNEL(flag.device(), affine)(flag, 0.0, 0.0, flag);
  }
  fn(grads, static_cast<double>(inv_scale), flag);
}

bool ScanGrads(Optimizer& opt, float inv_scale, bool unscale) {
  bool bad = false;
  const Grads grads(opt);
  for (const Tensor& g : grads.dense) {
    DDP_DISPATCH_FLOATING(g.dtype(), "GradScaler",
                          bad |= CheckAndMaybeUnscale(g.data<scalar_t>(), g.numel(), inv_scale, unscale));
    if (unscale) g.storage()->BumpVersion();
  }
  if (unscale) grads.WriteBack();
  return bad;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  // Each refusal names the one option at fault, with its value as given.
  // The scale is kept in f32: an init_scale past its range would start as inf.
  const GradScalerOptions& o = options_;
  if (!(o.init_scale > 0) || !std::isfinite(static_cast<float>(o.init_scale))) {
    throw std::invalid_argument("GradScaler: init_scale " + internal::OptionValueText(o.init_scale) +
                                " must be > 0 and finite in f32");
  }
  if (!(o.growth_factor > 1) || !std::isfinite(o.growth_factor)) {
    throw std::invalid_argument("GradScaler: growth_factor " + internal::OptionValueText(o.growth_factor) +
                                " must be finite and > 1");
  }
  if (!(o.backoff_factor > 0 && o.backoff_factor < 1)) {
    throw std::invalid_argument("GradScaler: backoff_factor " + internal::OptionValueText(o.backoff_factor) +
                                " must be in (0, 1)");
  }
  if (o.growth_interval < 1) {
    throw std::invalid_argument("GradScaler: growth_interval " + std::to_string(o.growth_interval) +
                                " must be at least 1");
  }
  scale_ = static_cast<float>(options_.init_scale);
}

GradScaler::PerOptimizer& GradScaler::StateOf(const Optimizer& optimizer) {
  auto [it, made] = optimizers_.try_emplace(optimizer.instance_id());
  if (made) {
    for (auto flag = spare_flags_.begin(); flag != spare_flags_.end(); ++flag) {
      if (flag->device() == optimizer.device()) {
        it->second.flag = std::move(*flag);
        spare_flags_.erase(flag);
        break;
      }
    }
  }
  return it->second;
}

void GradScaler::Reset() {
  for (auto& [opt, state] : optimizers_) {
    if (state.flag.defined()) spare_flags_.push_back(std::move(state.flag));
  }
  optimizers_.clear();
}

bool GradScaler::found_inf() const {
  for (const auto& [opt, state] : optimizers_) {
    if (state.found_inf) return true;
  }
  return false;
}

void GradScaler::Unscale(Optimizer& optimizer) {
  if (!options_.enabled) return;
  PerOptimizer& state = StateOf(optimizer);
  if (state.stage == Stage::kUnscaled) {
    throw std::logic_error("GradScaler: Unscale called twice for this optimizer before Update");
  }
  if (state.stage == Stage::kStepped) {
    throw std::logic_error("GradScaler: Unscale called after Step for this optimizer, before Update");
  }
  // An unscaled f16 gradient is written back in f16, where g / scale drops
  // below the smallest subnormal (6e-8) for many gradients that were fine
  // scaled: they would become 0. PyTorch's unscale_ refuses f16 gradients
  // too. Step without Unscale reads them in f32 and unscales there. (bf16
  // has f32's exponent range, so unscaling it loses nothing of that sort.)
  for (const auto& [name, p] : optimizer.params()) {
    const Tensor& g = p.grad();
    if (g.defined() && g.dtype() == DType::kFloat16) {
      throw std::invalid_argument("GradScaler: gradient of `" + name +
                                  "` is f16, which Unscale would flush towards zero (g / scale rounded "
                                  "to f16); keep f32 gradients, or call Step without Unscale (it unscales "
                                  "in f32 as the optimizer reads)");
    }
  }
  // PyTorch computes the reciprocal in f64 and rounds it to f32.
  const float inv = static_cast<float>(1.0 / static_cast<double>(scale_));
  if (internal::UsesDevicePath(optimizer.device())) {
    const Grads grads(optimizer);
    DeviceScan(optimizer, grads.dense, inv, state.flag);  // read in Step
    grads.WriteBack();  // queued after the unscale on the device
    state.flag_pending = true;
    state.found_inf = false;
  } else {
    state.found_inf = ScanGrads(optimizer, inv, true);
  }
  state.stage = Stage::kUnscaled;
}

bool GradScaler::Step(Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.Step();
    return true;
  }
  PerOptimizer& state = StateOf(optimizer);
  if (state.stage == Stage::kStepped) {
    throw std::logic_error("GradScaler: Step called twice for this optimizer before Update");
  }
  // Not unscaled yet (by Unscale on it, whatever other optimizers had).
  const bool fused = state.stage == Stage::kReady;
  // What a throwing optimizer.Step restores (see below); the stage is only
  // changed once the step is taken.
  const bool flag_pending_before = state.flag_pending;
  if (internal::UsesDevicePath(optimizer.device())) {
    // Fused: check only (a multiply by 1 leaves the values as they are);
    // the optimizer unscales as it reads. Either way, one read of the flag.
    if (fused) {
      DeviceScan(optimizer, Grads(optimizer).dense, 1.0f, state.flag);
    } else if (!state.flag_pending) {
      throw std::logic_error("GradScaler: Unscale ran on the CPU but Step finds the parameters on " +
                             optimizer.device().ToString());
    }
    state.flag_pending = false;
    state.found_inf = state.flag.Item() != 0.0;
  } else if (state.flag_pending) {
    // Unscale left its verdict in the device flag and found_inf false;
    // stepping here would ignore an inf it found.
    throw std::logic_error("GradScaler: Unscale ran on the device but Step finds the parameters on " +
                           optimizer.device().ToString());
  } else if (fused) {
    state.found_inf = ScanGrads(optimizer, 1.0f, false);
  }
  if (state.found_inf) {
    state.stage = Stage::kStepped;
    state.step_failed = false;
    return false;
  }
  if (fused) optimizer.set_grad_scale(static_cast<float>(1.0 / static_cast<double>(scale_)));
  try {
    optimizer.Step();
  } catch (...) {
    // The optimizer checks its gradients before updating any parameter, so
    // a throw leaves it as it was: this optimizer goes back to where it was
    // before this call (not unscaled when fused; unscaled, with the device
    // flag still holding Unscale's verdict, after Unscale), so that Step may
    // be called again, and Update does not count the iteration as clean.
    optimizer.set_grad_scale(1.0);
    state.flag_pending = flag_pending_before;
    state.step_failed = true;
    throw;
  }
  optimizer.set_grad_scale(1.0);
  state.stage = Stage::kStepped;
  state.step_failed = false;
  return true;
}

void GradScaler::Update() {
  if (!options_.enabled) return;
  // An iteration that only unscaled (found an inf, and so skipped the step)
  // is one too: PyTorch's update takes it, and the scale must back off.
  bool started = false;
  bool found = false;
  // A Step that threw and was not retried: the iteration applied no update
  // for that optimizer, and is not counted as a clean step.
  bool failed = false;
  for (auto& [opt, state] : optimizers_) {
    started = started || state.stage != Stage::kReady || state.step_failed;
    failed = failed || state.step_failed;
    // Unscaled on the device but never stepped: its check counts too (as
    // PyTorch's update takes every optimizer's found_inf).
    if (state.flag_pending) {
      state.found_inf = state.flag.Item() != 0.0;
      state.flag_pending = false;
    }
    found = found || state.found_inf;
  }
  if (!started) throw std::logic_error("GradScaler: Update called without Unscale or Step");
  if (found) {
    scale_ = static_cast<float>(scale_ * options_.backoff_factor);
    growth_tracker_ = 0;
  } else if (failed) {
    // Neither grown nor backed off: the tracker keeps its count.
  } else if (++growth_tracker_ >= options_.growth_interval) {
    const float grown = static_cast<float>(scale_ * options_.growth_factor);
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
  Reset();
}

NamedTensors GradScaler::StateDict() const {
  if (!options_.enabled) return {};
  return {{"scaler.scale", FromVector({scale_}, {}, {.dtype = DType::kFloat32})},
          {"scaler.growth_tracker", FromVectorOf<int64_t>({growth_tracker_}, {})},
          {"scaler.growth_factor", FromVector({options_.growth_factor}, {}, {.dtype = DType::kFloat64})},
          {"scaler.backoff_factor", FromVector({options_.backoff_factor}, {}, {.dtype = DType::kFloat64})},
          {"scaler.growth_interval", FromVectorOf<int64_t>({options_.growth_interval}, {})}};
}

namespace {

struct ScalerState {
  float scale;
  int64_t growth_tracker;
  GradScalerOptions options;
};

// The checks of LoadStateDict: the state it would load (with `options`
// where the state has none of its own), or throws.
ScalerState ReadScalerState(const NamedTensors& state, GradScalerOptions options) {
  const Tensor* scale = nullptr;
  const Tensor* tracker = nullptr;
  const Tensor* growth_factor = nullptr;
  const Tensor* backoff_factor = nullptr;
  const Tensor* growth_interval = nullptr;
  for (const auto& [k, t] : state) {
    if (k == "scaler.scale") scale = &t;
    else if (k == "scaler.growth_tracker") tracker = &t;
    else if (k == "scaler.growth_factor") growth_factor = &t;
    else if (k == "scaler.backoff_factor") backoff_factor = &t;
    else if (k == "scaler.growth_interval") growth_interval = &t;
    else if (k.rfind("scaler.", 0) == 0) throw std::invalid_argument("GradScaler.LoadStateDict: unexpected `" + k + "`");
  }
  // The options: all three or none (a state saved before they were).
  const int given = (growth_factor != nullptr) + (backoff_factor != nullptr) + (growth_interval != nullptr);
  if (given != 0) {
    constexpr const char* kWho = "GradScaler.LoadStateDict";
    internal::CheckStateScalar(kWho, "scaler.growth_factor", growth_factor, DType::kFloat64);
    internal::CheckStateScalar(kWho, "scaler.backoff_factor", backoff_factor, DType::kFloat64);
    internal::CheckStateScalar(kWho, "scaler.growth_interval", growth_interval, DType::kInt64);
    const double growth = growth_factor->To(kCPU).data<double>()[0];
    const double backoff = backoff_factor->To(kCPU).data<double>()[0];
    const int64_t interval = growth_interval->To(kCPU).data<int64_t>()[0];
    // The constructor's conditions, one key at a time.
    if (!(growth > 1) || !std::isfinite(growth)) {
      throw std::invalid_argument(std::string(kWho) + ": scaler.growth_factor " + internal::OptionValueText(growth) +
                                  " must be finite and > 1");
    }
    if (!(backoff > 0 && backoff < 1)) {
      throw std::invalid_argument(std::string(kWho) + ": scaler.backoff_factor " + internal::OptionValueText(backoff) +
                                  " must be in (0, 1)");
    }
    if (interval < 1) {
      throw std::invalid_argument(std::string(kWho) + ": scaler.growth_interval " + std::to_string(interval) +
                                  " must be at least 1");
    }
    options.growth_factor = growth;
    options.backoff_factor = backoff;
    options.growth_interval = interval;
  }
  internal::CheckStateScalar("GradScaler.LoadStateDict", "scaler.scale", scale, DType::kFloat32);
  internal::CheckStateScalar("GradScaler.LoadStateDict", "scaler.growth_tracker", tracker, DType::kInt64);
  const float s = scale->To(kCPU).data<float>()[0];
  if (!(s > 0) || !std::isfinite(s)) {
    throw std::invalid_argument("GradScaler.LoadStateDict: scaler.scale " + internal::OptionValueText(s) +
                                " must be finite and > 0");
  }
  // One at or past growth_interval (a state saved by a scaler with a longer
  // interval, without its options): Update grows the scale at its next
  // clean step (it compares with >=). A negative one is corrupt.
  const int64_t t = tracker->To(kCPU).data<int64_t>()[0];
  if (t < 0) {
    throw std::invalid_argument("GradScaler.LoadStateDict: scaler.growth_tracker " + std::to_string(t) +
                                " must be at least 0");
  }
  // Update counts one more clean step: past the largest i64 it would wrap.
  if (t == std::numeric_limits<int64_t>::max()) {
    throw std::invalid_argument("GradScaler.LoadStateDict: scaler.growth_tracker " + std::to_string(t) +
                                " is the largest i64: the next Update's count would overflow");
  }
  return {s, t, options};
}

}  // namespace

void GradScaler::CheckStateDict(const NamedTensors& state) const {
  if (!options_.enabled) return;
  ReadScalerState(state, options_);
}

void GradScaler::LoadStateDict(const NamedTensors& state) {
  if (!options_.enabled) return;  // as PyTorch's: a disabled scaler keeps no state
  const ScalerState s = ReadScalerState(state, options_);
  options_.growth_factor = s.options.growth_factor;
  options_.backoff_factor = s.options.backoff_factor;
  options_.growth_interval = s.options.growth_interval;
  scale_ = s.scale;
  growth_tracker_ = s.growth_tracker;
  Reset();
}

}  // namespace ddp::nn::optim
