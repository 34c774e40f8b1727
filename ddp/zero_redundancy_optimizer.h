#ifndef DDP_DDP_ZERO_REDUNDANCY_OPTIMIZER_H_
#define DDP_DDP_ZERO_REDUNDANCY_OPTIMIZER_H_

// An optimizer whose state is sharded across the ranks of a process group
// (ZeRO stage 1; PyTorch's torch.distributed.optim.ZeroRedundancyOptimizer).
// Every parameter has one owner rank; each rank keeps optimizer state
// (momentum, Adam's moments, f32 masters of 16-bit parameters) for the
// parameters it owns only, and Step updates only those, then each owner
// broadcasts its updated parameters so that every replica stays identical.
// With Adam on N ranks a rank holds about 1/N of the two moment buffers.
//
// It runs after DistributedDataParallel has averaged the gradients, so the
// result equals the unsharded optimizer's bit for bit: the owner runs the
// same update on the same averaged gradient, and the others copy its bytes.
//
//   auto model = ...;
//   DistributedDataParallel ddp(model, {.process_group = pg});
//   ZeroRedundancyOptimizer opt(model->NamedParameters(), pg,
//       [](nn::optim::NamedParameters shard) {
//         return std::make_unique<nn::optim::Adam>(std::move(shard), nn::optim::AdamOptions{.lr = 1e-3});
//       });
//   opt.ZeroGrad(); nn::Backward(loss); opt.Step();
//
// Checkpoints: ConsolidatedStateDict gathers the whole state on one rank in
// the unsharded optimizer's format (so a plain optimizer loads it too), and
// LoadStateDict takes such a state on every rank and keeps its own shard.
//
// Loss scaling: GradScaler checks only the gradients its optimizer holds,
// which here are one rank's shard, so ranks could disagree on skipping a
// step; use it with the unsharded optimizer.

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "ddp/process_group.h"
#include "nn/optim/optimizer.h"

namespace ddp::dist {

class ZeroRedundancyOptimizer {
 public:
  /// Builds the optimizer of one rank's shard (in the order the parameters
  /// were given; possibly empty when there are more ranks than parameters).
  using Factory =
      std::function<std::unique_ptr<nn::optim::Optimizer>(nn::optim::NamedParameters shard)>;

  /// Collective only in that every rank must construct it with the same
  /// parameters (same names, shapes and order) and the same kind of
  /// optimizer; nothing is sent. Throws std::invalid_argument for a list
  /// that no optimizer would take (nn::optim::CheckParameters), or a null
  /// group or factory.
  ZeroRedundancyOptimizer(nn::optim::NamedParameters params, std::shared_ptr<ProcessGroup> pg,
                          const Factory& make);

  /// Updates this rank's shard from its gradients, then broadcasts every
  /// shard from its owner. Collective. Throws DistributedError when a
  /// broadcast fails.
  void Step();
  /// Clears every parameter's gradient (the shard's and the others').
  void ZeroGrad(bool set_to_none = true);

  double lr() const { return local_->lr(); }
  /// Sets the rate of this rank's shard; schedulers run on every rank.
  void set_lr(double lr) { local_->set_lr(lr); }

  /// Owner rank of parameter i (in construction order).
  int owner(size_t i) const { return owner_[i]; }
  /// This rank's optimizer (over its shard).
  nn::optim::Optimizer& local() { return *local_; }
  const nn::optim::Optimizer& local() const { return *local_; }

  /// Collective: the whole optimizer's state, as the unsharded optimizer's
  /// StateDict would give it (CPU tensors), on rank `to`; an empty list on
  /// the other ranks.
  nn::optim::NamedTensors ConsolidatedStateDict(int to = 0);
  /// Collective: loads a whole state (ConsolidatedStateDict's, or a plain
  /// optimizer's StateDict); each rank keeps the entries of the parameters
  /// it owns. A key naming no parameter, or an entry the shard's optimizer
  /// refuses, fails on every rank (std::invalid_argument naming it on the
  /// rank that found it, naming that rank on the others).
  void LoadStateDict(const nn::optim::NamedTensors& state);

  /// The entries of a whole state that this rank's shard holds: "lr" and
  /// the "state." entries of the parameters it owns (what LoadStateDict
  /// loads; not collective). Throws std::invalid_argument naming a
  /// "state." key of no parameter.
  nn::optim::NamedTensors ShardOf(const nn::optim::NamedTensors& state) const;

  /// The owner of each parameter: largest first, each to the rank with the
  /// fewest elements so far (ties to the lower rank, then the earlier
  /// parameter), so shards hold about equal numbers of elements.
  static std::vector<int> Partition(const nn::optim::NamedParameters& params, int world_size);

 private:
  nn::optim::NamedParameters params_;
  std::shared_ptr<ProcessGroup> pg_;
  std::vector<int> owner_;
  std::unique_ptr<nn::optim::Optimizer> local_;
};

}  // namespace ddp::dist

#endif  // DDP_DDP_ZERO_REDUNDANCY_OPTIMIZER_H_
