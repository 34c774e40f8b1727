#ifndef DDP_DDP_MODEL_AVERAGING_H_
#define DDP_DDP_MODEL_AVERAGING_H_

// Local SGD and model averaging (PyTorch's post_localSGD_hook and
// PeriodicModelAverager): after a warm-up of ordinary DDP steps, each rank
// (or each group of ranks, say the ranks of one host) steps on its own
// gradients, and every few steps the parameters are averaged across all
// ranks. Communication drops from one gradient all-reduce per step to one
// parameter all-reduce per period, for a slower network than DDP needs;
// the replicas differ between averages.
//
//   DistributedDataParallel ddp(model, {.process_group = pg});
//   ddp.RegisterCommHook(hooks::PostLocalSgdHook({.start_iteration = 100}));
//   PeriodicModelAverager averager({.period = 4, .warmup_steps = 100});
//   for (...) {
//     opt.ZeroGrad(); nn::Backward(loss_fn(ddp(x), y)); opt.Step();
//     averager.AverageParameters(model->Parameters());
//   }
//
// With the same warm-up in both, the first warmup_steps steps are plain
// DDP. For plain SGD, averaging every step (period 1) after local steps
// gives the DDP step itself: the mean of p - lr g_r over ranks is p - lr
// times the mean gradient. Optimizer state (momentum) stays local, as in
// PyTorch.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ddp/comm_hooks.h"
#include "ddp/process_group.h"
#include "nn/tensor/tensor.h"

namespace ddp::dist {

struct PostLocalSgdOptions {
  /// Iterations (calls of the hook on the last bucket) that all-reduce
  /// gradients across the whole group, as DDP's default, before local
  /// steps begin (>= 0).
  int64_t start_iteration = 0;
  /// After that, gradients are averaged within this group (say the ranks
  /// of a host, from NewSubgroupsByHost; it contains this rank, as every
  /// group object does). Null: each rank steps on its own gradients
  /// (PyTorch's post_local_gradient_allreduce=False). Unlike PyTorch, null
  /// does not mean one subgroup per node: pass NewSubgroupsByHost(*pg) for
  /// that. Under Join the subgroup's sum over its active ranks is divided
  /// by its full size, as in PyTorch. A subgroup made from the DDP group
  /// by NewGroup is aborted with it (a rank that fails in the local phase
  /// stops its subgroup peers too).
  std::shared_ptr<ProcessGroup> subgroup;
};

class PostLocalSgdState;

namespace hooks {

/// Global all-reduce for start_iteration iterations, then the subgroup's
/// (or none). Throws std::invalid_argument for a negative start_iteration.
/// One hook object per DistributedDataParallel: it counts its iterations.
/// It takes local gradients (on_local_gradients() is true) and divides
/// them itself; a hook that calls it from its own body must be made with
/// CommHook::OnLocalGradients too. Called with a bucket already divided
/// (GradBucket::divided(), from a plain hook) it throws std::logic_error
/// naming itself rather than divide again. When the calling hook wrote the
/// bucket's buffer in place first (GradBucket::buffer_written(): clipped
/// it, or divided it, which this hook then does again) it warns once per
/// state on stderr, naming the bucket, and goes on.
CommHook PostLocalSgdHook(PostLocalSgdOptions options);
/// The same hook counting its iterations in `state`, which the caller keeps to
/// save and restore the count (see PostLocalSgdState). One
/// DistributedDataParallel per state: a call from a second wrapper (on any
/// group) throws std::logic_error while the hook copy serving the first (the
/// one its wrapper keeps) is alive; once it is gone, the state serves the new
/// one. That call is a hook failing in backward: the second wrapper's group is
/// aborted with the message, as for any hook that throws (when both wrappers
/// share a group, the first one stops with it). Throws std::invalid_argument
/// for a null state.
CommHook PostLocalSgdHook(std::shared_ptr<PostLocalSgdState> state);

}  // namespace hooks

/// What the post-local-SGD hook keeps across iterations: its options and
/// the count of its calls on the last bucket, which decides when the local
/// phase begins (PyTorch's PostLocalSGDState and its `iter`). Without it a
/// resumed run counted from 0 again and redid start_iteration global
/// all-reduces. The count is the same on every rank, so rank 0's
/// checkpoint restores every rank:
///
///   auto local_sgd = std::make_shared<PostLocalSgdState>(options);
///   ddp_model.RegisterCommHook(hooks::PostLocalSgdHook(local_sgd));
///   ... save: local_sgd->StateDict(); resume: local_sgd->LoadStateDict(saved)
///
/// The hook updates the count on the thread running backward, unlocked:
/// iteration(), StateDict and LoadStateDict must not run while a backward
/// (or its bucket hooks) is in flight; call them between iterations.
class PostLocalSgdState {
 public:
  using NamedTensors = std::vector<std::pair<std::string, nn::Tensor>>;

  /// Throws std::invalid_argument for a negative start_iteration.
  explicit PostLocalSgdState(PostLocalSgdOptions options = {});

  const PostLocalSgdOptions& options() const { return options_; }
  /// Hook calls on the last bucket so far; the local phase runs from
  /// iteration options().start_iteration on.
  int64_t iteration() const { return iteration_; }

  /// "post_local_sgd.iteration" (i64 scalar): the iteration counter. The
  /// options (the subgroup among them) are the caller's to pass again.
  NamedTensors StateDict() const;
  /// Restores StateDict's key from a list that may hold other components'
  /// keys. Throws std::invalid_argument naming a missing or malformed
  /// "post_local_sgd.iteration" (not an i64 scalar, negative, given twice)
  /// or an unexpected "post_local_sgd." key, changing nothing.
  void LoadStateDict(const NamedTensors& state);
  /// The checks of LoadStateDict alone: throws as it would, changes nothing.
  void CheckStateDict(const NamedTensors& state) const;

 private:
  friend CommHook hooks::PostLocalSgdHook(std::shared_ptr<PostLocalSgdState> state);
  PostLocalSgdOptions options_;
  int64_t iteration_ = 0;
  // The hook copy the state serves: a second live wrapper would count
  // iteration_ too, from its own backward thread, unsynchronized.
  internal::StateAttachment attachment_;
};

struct ModelAveragerOptions {
  /// Average every this many steps (>= 1).
  int64_t period = 1;
  /// Steps before the first average (>= 0); usually the hook's
  /// start_iteration, so that the warm-up is plain DDP.
  int64_t warmup_steps = 0;
  /// Unset: the default process group (InitProcessGroup). Set, it is the
  /// group to average over, as NewGroup returned it on this rank: null on a
  /// rank outside that group, whose averager then averages nothing (as
  /// PyTorch's on a non-member), so every rank may build one from the same
  /// NewGroup call.
  std::optional<std::shared_ptr<ProcessGroup>> process_group;
};

/// Averages parameters across a group every `period` steps once
/// `warmup_steps` have passed (torch.distributed.algorithms.model_averaging).
class PeriodicModelAverager {
 public:
  /// Throws std::invalid_argument for a period below 1 or a negative
  /// warm-up, std::logic_error when there is no group at all.
  explicit PeriodicModelAverager(ModelAveragerOptions options);

  /// Call once per optimizer step, after it, with the same tensors on
  /// every rank. Averages those that have a gradient on any rank when this
  /// step is due, then counts the step; returns whether it averaged. On a
  /// rank outside the group (a null process_group) it only counts the step
  /// and returns false, at once, without communicating. As in
  /// PyTorch, frozen parameters and ones unused on every rank keep their
  /// values; unlike PyTorch, which decides on each rank alone, one small
  /// all-reduce agrees on the set, so a parameter with a gradient on some
  /// ranks only (a branch they alone took, gradients set to none) is
  /// averaged on all of them and the ranks' collectives pair up.
  /// Collective on due steps, so not for use under Join (a rank that
  /// joined would not take part). Throws DistributedError when an
  /// all-reduce fails, and std::invalid_argument on every rank, naming
  /// both counts, when the ranks pass lists of different lengths (an empty
  /// one included: due steps agree on the count first, in one small
  /// all-reduce); a call that throws leaves the step uncounted.
  bool AverageParameters(const std::vector<nn::Tensor>& params);

  /// Steps counted so far.
  int64_t step() const { return step_; }

  using NamedTensors = std::vector<std::pair<std::string, nn::Tensor>>;
  /// "averager.step" (i64 scalar): the step counter, the same on every
  /// rank, so rank 0's checkpoint restores every rank's. The options are
  /// the caller's to pass again.
  NamedTensors StateDict() const;
  /// Restores StateDict's key from a list that may hold other components'
  /// keys. Throws std::invalid_argument naming a missing or malformed
  /// "averager.step" (not an i64 scalar, negative) or an unexpected
  /// "averager." key, changing nothing.
  void LoadStateDict(const NamedTensors& state);
  /// The checks of LoadStateDict alone: throws as it would, changes nothing.
  void CheckStateDict(const NamedTensors& state) const;

 private:
  ModelAveragerOptions options_;
  int64_t step_ = 0;
};

/// Replaces each tensor by its mean over the ranks of `group` (collective):
/// one all-reduce per dtype and device, through a flat copy (tensors of 256
/// KiB and more, not f16, with an all-reduce each: in place when contiguous,
/// else through a contiguous copy, so that a view on one rank pairs with a
/// contiguous tensor on another). The ranks first agree,
/// in one small all-reduce, that every one passed only defined floating
/// tensors: an undefined or integer tensor on one rank throws
/// std::invalid_argument on every rank, naming the tensor's index and the
/// rank, before any average. A tensor passed twice (the same storage,
/// offset, shape and strides) is averaged once; tensors that otherwise
/// share memory (overlapping views, or strided views whose spans interleave)
/// are refused the same way, naming both. Tensors whose dtype, shape or
/// kind of device differ between ranks (the same count of elements
/// included) are refused too, on every rank, naming the first such tensor
/// and both ranks' descriptions, before any average; the group stays
/// usable (the transport would abort it on the unpaired all-reduces).
/// When an all-reduce fails, waits for the ones
/// already issued before throwing the first error (DistributedError): the
/// tensors averaged through a flat copy keep their values, those averaged
/// in place may hold partial sums.
void AverageParameters(const std::vector<nn::Tensor>& params, ProcessGroup& group);

/// Test only: from now on, AverageParameters runs `fault` on this process
/// once the ranks have agreed on the tensors, just before its first
/// average (a test aborts the group there, with no race against the
/// averages). An empty function: nothing runs.
void SetAverageFaultForTesting(std::function<void()> fault);

/// Groups of the ranks on each host (by host name), as
/// torch.distributed.new_subgroups() for one group per node: collective
/// over `group`; returns this rank's host group.
std::shared_ptr<ProcessGroup> NewSubgroupsByHost(ProcessGroup& group);

}  // namespace ddp::dist

#endif  // DDP_DDP_MODEL_AVERAGING_H_
