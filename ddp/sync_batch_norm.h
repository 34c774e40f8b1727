#ifndef DDP_DDP_SYNC_BATCH_NORM_H_
#define DDP_DDP_SYNC_BATCH_NORM_H_

// SyncBatchNorm: batch normalization whose training statistics are those of
// the global batch (every rank's local batch together), so that N ranks
// with B samples each normalize exactly as one process with N*B samples.
//
// Forward (training): each rank computes, per channel, its sample count,
// mean and sum of squared deviations; one all-gather brings every rank's
// triple, and each rank combines them (Chan's parallel variance formula,
// in f64), so ranks with different batch sizes, including empty ones, are
// weighted by their counts. Running statistics are updated with the global
// mean and unbiased variance. A global batch empty on every rank is
// BatchNorm's empty batch: an empty output, the running statistics
// unchanged, the batch counted in num_batches_tracked. A global batch of
// one value per channel is refused on every rank (std::invalid_argument,
// "expected more than 1 value per channel across all ranks when
// training"), as BatchNorm on the whole batch refuses it (PyTorch 1.13's
// ValueError; its SyncBatchNorm across several ranks divides by zero in
// the running variance instead), changing no buffer and not counting the
// batch (PyTorch's BatchNorm counts it before refusing). The running
// statistics and the count are written last, once the output is made: a
// forward that fails leaves them as they were.
// Backward: one all-reduce of the per-channel sums of dy and dy*(x-mean)
// gives the global terms of dx; weight and bias get this rank's own terms,
// which DistributedDataParallel then averages like every other gradient.
// Eval: the running statistics (without them, the local batch's own),
// locally, with no communication.
// On a CUDA input (CUDA build) the same statistics come from nn's
// batch-norm building blocks on the device: per-channel sums give a mean,
// sums of x less that mean give the count, mean and squared deviations
// (two passes, so a large mean does not cancel); one small copy to the
// host, where the ranks' rows are gathered and merged as above; the
// normalization and the running statistics' update on the device; backward
// all-reduces sum(dy) and sum(dy * xhat) on the device. The batch count
// comes from a host copy of num_batches_tracked (nn's TrackedBatchCount),
// read back only after an outside write, so that copy of the row is the
// forward's only read of device memory.
// With one rank it computes exactly what BatchNorm computes.
//
// Every rank must run forward and backward through the layer the same
// number of times (a rank with an empty batch too), since each is a
// collective. Its backward all-reduce runs on the backward thread between
// DDP's bucket all-reduces, so it must come at the same point among them
// on every rank: with find_unused_parameters, a parameter used on some
// ranks only and registered before the layer but bucketed with parameters
// after it launches its bucket at different points on different ranks,
// and the collectives pair wrongly (PyTorch has the same limit). Keep such
// parameters after the SyncBatchNorm layers, or use the same graph on
// every rank.

#include <memory>
#include <string>

#include "ddp/process_group.h"
#include "nn/modules/layers.h"
#include "nn/modules/module.h"

namespace ddp::dist {

class SyncBatchNorm : public nn::modules::Module {
 public:
  /// New layer with BatchNorm's parameters and buffers (same names).
  /// `group` null: the default process group, looked up at each forward.
  SyncBatchNorm(int64_t num_features, nn::modules::BatchNormOptions options = {},
                std::shared_ptr<ProcessGroup> group = nullptr);
  /// Takes over `bn`'s parameters and buffers (the same tensors, so an
  /// optimizer that holds them keeps working) and its training mode.
  static std::shared_ptr<SyncBatchNorm> FromBatchNorm(const nn::modules::BatchNorm& bn,
                                                      std::shared_ptr<ProcessGroup> group = nullptr);

  /// x [N, C, *] -> same shape. Throws std::invalid_argument naming the
  /// module when x is undefined, C differs from num_features or x is not
  /// floating-point; in training with more than one rank it aborts the
  /// group first, so that the peers, already in the statistics' collective,
  /// stop at once with that reason instead of at the group's timeout. In
  /// training without a group of its own and with no default group set,
  /// it throws std::invalid_argument naming the module (eval needs none).
  nn::Tensor Forward(const nn::Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "SyncBatchNorm"; }
  /// As BatchNorm: a state without num_batches_tracked loads, keeping the count.
  bool MayBeAbsentFromState(const std::string& name) const override;
  std::string ExtraRepr() const override;
  std::string ShortRepr() const override;

  int64_t num_features() const { return num_features_; }
  /// The group it was given; null: the default group, looked up at each forward.
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  const nn::modules::BatchNormOptions& options() const { return options_; }
  const nn::Tensor& weight() const { return weight_; }
  const nn::Tensor& bias() const { return bias_; }
  const nn::Tensor& running_mean() const { return running_mean_; }
  const nn::Tensor& running_var() const { return running_var_; }
  const nn::Tensor& num_batches_tracked() const { return num_batches_tracked_; }

 private:
  // Sets group_ of the SyncBatchNorm layers already in a converted tree.
  friend std::shared_ptr<nn::modules::Module> ConvertSyncBatchNorm(std::shared_ptr<nn::modules::Module> module,
                                                                   std::shared_ptr<ProcessGroup> group);

  struct Adopt {};
  SyncBatchNorm(Adopt, const nn::modules::BatchNorm& bn, std::shared_ptr<ProcessGroup> group);
  // Fail(message), after aborting the group in training with more than one
  // rank: for an input refused on this rank alone, before any collective.
  [[noreturn]] void Refuse(const std::string& message) const;
  // Aborts the group (more than one rank) with `e` as this rank's failure
  // in a training forward; the caller rethrows.
  void AbortForLocalFailure(ProcessGroup& pg, const std::exception& e) const;

  int64_t num_features_;
  nn::modules::BatchNormOptions options_;
  std::shared_ptr<ProcessGroup> group_;
  nn::Tensor weight_, bias_, running_mean_, running_var_, num_batches_tracked_;
  // Host copy of num_batches_tracked; the buffer's version tells when it was
  // written from outside (LoadStateDict, Fill, a BatchNorm sharing it).
  nn::modules::TrackedBatchCount tracked_;
};

/// Replaces every BatchNorm (1d, 2d) in `module`'s tree by a SyncBatchNorm
/// that takes over its parameters, buffers and mode; returns the module
/// (or the new layer when `module` itself is a BatchNorm). SyncBatchNorm
/// layers already in the tree stay in place and take `group` as well (as
/// PyTorch's convert_sync_batchnorm gives every batch-norm layer its
/// process_group), so converting again moves a model to another group. Call it before
/// wrapping in DistributedDataParallel and before creating the optimizer.
/// A BatchNorm registered at several paths becomes one SyncBatchNorm at
/// all of them. Throws std::invalid_argument naming the path, and replaces
/// nothing, when a BatchNorm is also owned outside the registry (e.g. a
/// member its parent kept from RegisterModule): that owner would go on
/// running the local layer (no layer's group changes then either).
/// Forwards must look children up by name.
std::shared_ptr<nn::modules::Module> ConvertSyncBatchNorm(std::shared_ptr<nn::modules::Module> module,
                                                          std::shared_ptr<ProcessGroup> group = nullptr);

namespace internal {

/// Makes CPU inputs take the device formulation as well (nn's building
/// blocks for the local row and the elementwise passes), so that CPU tests
/// cover what a GPU runs. Process-wide; for tests.
void SetSyncBatchNormBuildingBlocks(bool on);

/// Makes the next multi-rank training forward of any SyncBatchNorm in this
/// process throw std::bad_alloc where it computes its local statistics,
/// before it joins the gather (as a rank whose device memory ran out).
/// For tests.
void FailNextSyncBatchNormForwardForTesting();

}  // namespace internal

}  // namespace ddp::dist

#endif  // DDP_DDP_SYNC_BATCH_NORM_H_
