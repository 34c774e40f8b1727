#ifndef DDP_DDP_OVERLAPPED_ZERO_OPTIMIZER_H_
#define DDP_DDP_OVERLAPPED_ZERO_OPTIMIZER_H_

// The optimizer step run inside DistributedDataParallel's gradient
// reduction, sharded across the ranks (ZeRO stage 1 overlapped with DDP, as
// PyTorch's ZeroRedundancyOptimizer(overlap_with_ddp=True) with
// hook_with_zero_step). Each bucket goes through one
// Communicator::AllReduceThrough: the ranks reduce-scatter the bucket's
// gradients, each rank updates the parameters of its slice of the bucket
// with its own optimizer (holding momentum, Adam's moments and so on for
// that slice only), and the ranks all-gather the updated parameters instead
// of gradients, straight into each other's parameters: at construction the
// parameters of each bucket move into one flat buffer laid out as the
// bucket (Tensor::SetData, so every handle stays valid). Per step a rank
// updates 1/N of the parameters, the bytes sent equal plain DDP's, and
// there is no separate pass of the optimizer over every parameter, nor
// the copy of the reduced buckets back into .grad (the hook is registered
// WithoutGradWriteBack).
//
//   DistributedDataParallel ddp(model, {.process_group = pg});
//   OverlappedZeroOptimizer opt(ddp, [](nn::optim::NamedParameters shard) {
//     return std::make_unique<nn::optim::Sgd>(std::move(shard), nn::optim::SgdOptions{.lr = 0.05, .momentum = 0.9});
//   });
//   for (...) { auto loss = ...(ddp(x)); nn::Backward(loss); opt.Step(); }
//
// Parameter groups (biases and norms without weight decay, say) go to the
// second constructor, as ZeroRedundancyOptimizer's: each slice's optimizer
// has the same groups, holding its views of them, and lr(k) / set_lr(k, lr)
// reach group k in every slice. One scheduler drives every group from its
// own rate, as over the unsharded optimizer:
//   nn::optim::LrScheduler sched(opt.LrTargets(), nn::optim::CosineSchedule(100));
//
// The parameters change during backward, as soon as their bucket is
// reduced, so Step() only ends the step: it clears the gradients (after
// backward .grad holds this rank's own gradient, not the average, which
// only the step saw). The result equals DDP followed by the unsharded
// optimizer, to rounding: the step is elementwise and each element's owner
// runs it on the averaged gradient. On one rank Step() runs the optimizer
// of every parameter.
//
// What it asks of the training loop, as PyTorch's overlap does:
// - Nothing may read a parameter's old value after its gradient is ready
//   (a detached use of a weight later in backward would see the new one).
// - No gradient clipping, GradScaler or other look at the averaged
//   gradients between backward and step: there is no such moment.
// - CPU parameters, contiguous; DdpOptions::find_unused_parameters and
//   static_graph off (a parameter unused on every rank would still take a
//   step, with a zero gradient).
// - The buckets stay as first built (no rebuild from the observed gradient
//   order), so that each rank's slice, and the state it keeps for it, never
//   moves. Build it after moving or converting the model: Module::To gives
//   the parameters new memory, which the next backward refuses (every rank
//   fails, naming the bucket).
// - NoSync works (the step runs at the synchronizing backward); Join works
//   (ranks that ran out of data still step their slices with the others'
//   gradients, inside each shadowed backward, at the rate they hold: a
//   per-iteration learning-rate scheduler must be stepped on joined ranks
//   too, in Join's shadow_step, or their slices keep the rate they had
//   when they joined). The pattern of ZeroRedundancyOptimizer works here
//   as well: `{.shadow_step = [&] { opt.Step(); sched.Step(); }}`, where
//   Step() ends the shadowed step as it ends one of this rank's own.
// - The optimizer's update must be elementwise (every nn::optim optimizer
//   is; one that looks at whole tensors, as LAMB's norms, would see only a
//   piece). It runs where
//   the group runs collectives: on its communication thread, whose
//   floating-point mode (flush to zero) is the one the process had when
//   the group was made, or on the training thread
//   (ProcessGroup::collectives_on_caller).
// - Checkpoints: ConsolidatedStateDict gathers the whole state on one rank
//   in the unsharded optimizer's format (a plain optimizer, or this one on
//   any number of ranks, loads it); LoadStateDict takes such a state on
//   every rank and keeps its slices' entries.
// - No AddParamGroup (ZeroRedundancyOptimizer has one): the slices follow
//   DDP's buckets, which hold the parameters trained when the wrapper was
//   built; a layer unfrozen later needs a new wrapper and optimizer.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddp/distributed_data_parallel.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/optimizer.h"

namespace ddp::dist {

class OverlappedZeroOptimizer {
 public:
  /// Builds the optimizer of one rank's slice of one bucket: 1-D views of
  /// the pieces of the parameters in that slice, named after them (with
  /// "[begin:end]" where a parameter is cut). Called at construction, once
  /// per bucket this rank owns part of.
  using Factory =
      std::function<std::unique_ptr<nn::optim::Optimizer>(nn::optim::NamedParameters shard)>;

  /// Moves each bucket's parameters into a flat buffer, builds this rank's
  /// optimizers and registers the fused step as `ddp`'s communication hook
  /// (keep this object alive while `ddp` trains; `ddp` must outlive it: a
  /// backward of `ddp` after this object is destroyed fails on every rank,
  /// as `ddp` keeps the hook). Collective: every rank
  /// builds it, before the first backward. Throws std::invalid_argument for
  /// a null factory or one that returns null, a parameter that is not a
  /// contiguous CPU tensor (naming it), a trained parameter that is not in
  /// DDP's buckets or a bucket parameter that is not trained (requires_grad
  /// changed after the wrapper was built), find_unused_parameters or
  /// static_graph; std::logic_error after the first backward (on more
  /// than one rank; one rank runs no hook, and Step() steps everything),
  /// and on every rank, naming the rank, when DDP refuses the hook on any
  /// (one registered there before): a rank that had registered it keeps a
  /// hook that refuses to run, naming the refusal.
  /// What one rank refuses in its own module or factory (an exception of
  /// any type), or a flat buffer it has no memory for, fails every rank
  /// together, naming that rank; so do factories that build optimizers of
  /// another kind, rate or options on some ranks (naming the first option
  /// that differs and each rank's value). A refused construction leaves the
  /// parameters in their memory (an optimizer built on `ddp` before goes on
  /// training): they move into the flat buffers last.
  OverlappedZeroOptimizer(DistributedDataParallel& ddp, Factory make);

  /// Builds the optimizer of one rank's slice of one bucket over parameter
  /// groups: one group per group given at construction, in order and with
  /// its options, holding the views of that group's parameters in the
  /// slice (a group may be empty).
  using GroupFactory =
      std::function<std::unique_ptr<nn::optim::Optimizer>(std::vector<nn::optim::ParamGroup> shard)>;

  /// Parameter groups (a group of biases and norms without weight decay,
  /// say): every trained parameter of `ddp`'s module in exactly one group,
  /// as the module's tensor under its name. Collective, as the constructor
  /// above; the ranks must agree on each parameter's group and on every
  /// group's options (compared across ranks, refused on every rank naming
  /// the first difference). Throws std::invalid_argument as above, naming
  /// a group's parameter that is not a trained one of the module, or is in
  /// two groups, a trained parameter in no group, and a factory whose
  /// optimizer does not have the groups it was given, each with its views
  /// in order and under their names (for either constructor).
  OverlappedZeroOptimizer(DistributedDataParallel& ddp, std::vector<nn::optim::ParamGroup> groups,
                          GroupFactory make);
  ~OverlappedZeroOptimizer();
  OverlappedZeroOptimizer(const OverlappedZeroOptimizer&) = delete;
  OverlappedZeroOptimizer& operator=(const OverlappedZeroOptimizer&) = delete;

  /// Ends the step the backward ran: clears every gradient. When no
  /// synchronizing backward of this rank completed since the last Step()
  /// (none ran, or only under NoSync; one shadowed in Join::Wait counts,
  /// for Join's shadow_step) it keeps the gradients and throws
  /// std::logic_error, or DistributedError with the reason when the group
  /// was aborted (a failed backward). On one rank it steps every
  /// parameter, as a plain optimizer, after the same check (there, with
  /// nothing reduced, a forward that synchronizes on N ranks counts, as
  /// DistributedDataParallel::iterations() does).
  void Step();
  /// Clears every gradient (for loops that call it before backward).
  void ZeroGrad();

  /// The rate of the next steps, for every slice (schedulers call it on
  /// every rank between steps, not during backward); at first the
  /// factory's. Group 0's with several groups.
  double lr() const;
  /// Sets the rate of the only group; throws std::invalid_argument,
  /// changing nothing, unless `lr` is finite and >= 0, and
  /// std::logic_error with several groups (set each group's, as
  /// Optimizer::set_lr asks).
  void set_lr(double lr);
  /// Number of parameter groups (1 for the constructor without groups).
  size_t num_groups() const;
  /// The rate of `group`, and setting it in every slice; throw as above,
  /// and std::out_of_range for a group this optimizer lacks.
  double lr(size_t group) const;
  void set_lr(size_t group, double lr);
  /// One learning-rate target per group (lr(k) / set_lr(k, lr)), for an
  /// LrScheduler or ReduceLrOnPlateau over all of them; this optimizer
  /// must outlive them.
  std::vector<nn::optim::LrTarget> LrTargets();
  /// Steps run so far (synchronizing backwards, shadowed ones included).
  int64_t steps() const;
  /// Elements of the parameters this rank updates (its slices).
  int64_t owned_elements() const;

  /// Collective: the whole state on rank `to` ("lr", the options
  /// ("group.*"; with several groups "param_groups.*" with each group's
  /// rate and the whole's group sizes and members), and per parameter, in
  /// the groups' order,
  /// "state.<name>.step" and its elementwise entries in the parameter's
  /// shape, as the unsharded optimizer's StateDict), empty elsewhere.
  /// Throws std::invalid_argument for a rank outside the group, and on
  /// every rank at once, naming the values, when the ranks pass different
  /// `to` (one small all-gather agrees on it before any state is sent).
  /// A rank whose slices' state dicts fail (any exception type) aborts the
  /// group, so that the others fail at once naming it, and rethrows.
  nn::optim::NamedTensors ConsolidatedStateDict(int to = 0);
  /// Loads a whole state (ConsolidatedStateDict's, or a plain optimizer's
  /// StateDict) on every rank; each slice's optimizer takes its pieces. Not
  /// collective, but every rank must load the same state. The state is
  /// first checked, one parameter at a time, by loading that parameter's
  /// entries into a throwaway optimizer of it (so the check holds one
  /// parameter's state at most), so that a bad state fails every rank
  /// alike before anything changes; then each slice's optimizer checks
  /// its own part, for every slice before any loads. Throws
  /// std::invalid_argument naming a "state." key of no trained parameter
  /// (a frozen parameter's "step" is let through as the 0-d i64 0 that a
  /// parameter never updated saves, and refused naming its shape
  /// otherwise; with that step, its slots held from the start, Adagrad's
  /// "sum", are let through in its shape and refused naming both shapes
  /// otherwise), an entry whose size is not its parameter's, or a param
  /// group whose saved size or members are not this optimizer's (and,
  /// from the optimizer's own check, another group count). Any other
  /// failure of the checks (std::bad_alloc, say) is rethrown as it came;
  /// nothing is loaded there. One while loading, after every check passed
  /// (out of memory), may leave the slices loaded before it. On more than
  /// one rank, either aborts the group first, naming this rank and the
  /// reason, so that the peers' next backward or Step() fails at once
  /// instead of waiting for this rank until the timeout.
  void LoadStateDict(const nn::optim::NamedTensors& state);

  struct State;

 private:
  // The constructors' shared part; `grouped`: groups were given (else one
  // group of every trained parameter, from a Factory).
  OverlappedZeroOptimizer(DistributedDataParallel& ddp, std::vector<nn::optim::ParamGroup> groups,
                          GroupFactory make, bool grouped);

  std::shared_ptr<State> state_;
};

}  // namespace ddp::dist

#endif  // DDP_DDP_OVERLAPPED_ZERO_OPTIMIZER_H_
