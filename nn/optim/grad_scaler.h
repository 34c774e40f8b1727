#ifndef DDP_NN_OPTIM_GRAD_SCALER_H_
#define DDP_NN_OPTIM_GRAD_SCALER_H_

// Dynamic loss scaling for f16 training, with the behaviour and defaults of
// PyTorch's GradScaler. Per iteration:
//
//   Backward(loss * scaler.scale());
//   scaler.Unscale(opt);            // optional: only to clip unscaled grads
//   ClipGradNorm(...);
//   scaler.Step(opt);               // skipped when a gradient is inf/NaN
//   scaler.Update();                // lowers or raises the scale
//
// Without Unscale, unscaling is fused into the optimizer's update (no extra
// pass over the gradients) and .grad keeps the scaled values.
//
// Several optimizers may share one scaler (PyTorch keeps a state per
// optimizer too): each is unscaled at most once per iteration, by Unscale or
// by its own Step, and is skipped only when its own gradients hold an inf or
// NaN; Update backs the scale off when any optimizer's did.
//
// Under DDP the gradients are identical on every rank after the all-reduce,
// so every rank takes the same decision.
//
// Gradients on a device (CUDA) are checked and unscaled there by the
// registered unscale_and_check kernel into a one-element found-inf flag on
// the device; the flag is read once, in Step (one host synchronization per
// optimizer and iteration, none per tensor).

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "nn/optim/optimizer.h"

namespace ddp::nn::optim {

/// torch.cuda.amp.GradScaler's options and defaults.
struct GradScalerOptions {
  double init_scale = 65536.0;     ///< 2^16.
  double growth_factor = 2.0;      ///< Scale multiplier after growth_interval good steps.
  double backoff_factor = 0.5;     ///< Scale multiplier after a step with inf/NaN.
  int64_t growth_interval = 2000;  ///< Good steps in a row before growing.
  bool enabled = true;             ///< Off: scale 1, Step always steps.
};

class GradScaler {
 public:
  /// Throws std::invalid_argument, naming the one option at fault with its
  /// value, for an init_scale <= 0 or beyond f32's range, a growth_factor
  /// <= 1 or infinite, a backoff_factor outside (0, 1) or a growth_interval
  /// < 1.
  explicit GradScaler(GradScalerOptions options = {});

  /// Factor to multiply the loss by before backward (1 when disabled).
  double scale() const { return options_.enabled ? scale_ : 1.0; }
  /// Divides the optimizer's gradients by the scale in place and records
  /// whether any is inf or NaN. At most once per optimizer between Update
  /// calls, and not after that optimizer's Step.
  /// Gradients may have any strides (a non-contiguous one is scanned as a
  /// contiguous copy and the result written back through its strides).
  /// Throws std::invalid_argument for an f16 gradient (as PyTorch's
  /// unscale_): g / scale in f16 flushes small gradients to zero; Step
  /// without Unscale unscales those in f32.
  void Unscale(Optimizer& optimizer);
  /// Steps the optimizer unless one of its gradients is inf or NaN (checked
  /// here if Unscale was not called for it; unscaling is then fused into the
  /// step). At most once per optimizer between Update calls. Returns
  /// whether it stepped. When the optimizer's Step throws (a gradient of
  /// the wrong shape, say), the exception propagates and this optimizer is
  /// left as before the call: Step may be called again once the cause is
  /// fixed, and an Update without that retry counts the iteration neither
  /// as clean (the growth tracker keeps its count) nor as an inf.
  bool Step(Optimizer& optimizer);
  /// Updates the scale from this iteration's outcome (lowered when any
  /// optimizer's gradients held an inf or NaN) and starts the next
  /// iteration for every optimizer; call after Step, or after Unscale alone
  /// (an iteration whose step the caller skipped). Throws std::logic_error
  /// when no optimizer was unscaled or stepped since the last Update.
  void Update();
  /// Whether this iteration found inf/NaN gradients in any optimizer's
  /// (valid after Step; for CPU gradients also after Unscale).
  bool found_inf() const;
  /// The options (growth and backoff ones as LoadStateDict last set them).
  const GradScalerOptions& options() const { return options_; }
  /// Good steps since the last change of scale.
  int64_t growth_tracker() const { return growth_tracker_; }

  /// "scaler.scale" (f32 scalar) and "scaler.growth_tracker" (i64 scalar),
  /// and the options PyTorch's state_dict saves with them:
  /// "scaler.growth_factor", "scaler.backoff_factor" (f64 scalars) and
  /// "scaler.growth_interval" (i64 scalar). Empty for a scaler constructed
  /// disabled, as PyTorch's state_dict().
  NamedTensors StateDict() const;
  /// Restores StateDict's keys from a list that may hold other keys; the
  /// saved growth_factor, backoff_factor and growth_interval replace this
  /// scaler's, as in PyTorch (a state saved without them keeps this
  /// scaler's). Throws std::invalid_argument naming a missing or malformed
  /// key (or an unexpected "scaler." one, a negative growth tracker, or an
  /// option the constructor would refuse), changing nothing. A tracker at or
  /// past growth_interval grows the scale at the next clean step. A scaler
  /// constructed disabled ignores the state, its "scaler." keys included
  /// (well-formed or not), as PyTorch's load_state_dict returns at once.
  void LoadStateDict(const NamedTensors& state);
  /// The checks of LoadStateDict alone: throws as it would, changes nothing
  /// (a disabled scaler's checks nothing).
  void CheckStateDict(const NamedTensors& state) const;

 private:
  enum class Stage { kReady, kUnscaled, kStepped };

  // One optimizer's part of the iteration (PyTorch's per-optimizer state).
  struct PerOptimizer {
    Stage stage = Stage::kReady;
    bool found_inf = false;
    Tensor flag;                // device found-inf flag (one f32 element)
    bool flag_pending = false;  // Unscale left a result in flag for Step to read
    bool step_failed = false;   // the optimizer's Step threw, and was not retried since
  };

  /// The optimizer's state in this iteration (made on its first use).
  PerOptimizer& StateOf(const Optimizer& optimizer);
  /// Starts a new iteration for every optimizer, keeping device flags for reuse.
  void Reset();

  GradScalerOptions options_;
  float scale_;  // f32 like PyTorch's scale tensor
  int64_t growth_tracker_ = 0;
  // Keyed by Optimizer::instance_id (not the address, which a new optimizer
  // may take over from a destroyed one), from an optimizer's first Unscale
  // or Step in an iteration until Update.
  std::unordered_map<uint64_t, PerOptimizer> optimizers_;
  // Device flags of past iterations, reused, so that a steady state
  // allocates none.
  std::vector<Tensor> spare_flags_;
};

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_GRAD_SCALER_H_
