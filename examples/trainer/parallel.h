#ifndef DDP_EXAMPLES_TRAINER_PARALLEL_H_
#define DDP_EXAMPLES_TRAINER_PARALLEL_H_

// The trainer's view of data parallelism: the replica it runs forward and
// backward on, accumulation without synchronization, and the few
// collectives the trainer itself needs (metric sums). Implemented over
// ddp::dist::DistributedDataParallel (parallel.cc); the trainer itself
// never names ddp/, which keeps its loop readable and lets a failure of the
// job reach it as one exception type.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/powersgd_hook.h"
#include "examples/trainer/config.h"
#include "nn/modules/module.h"
#include "nn/optim/optimizer.h"
#include "nn/tensor/tensor.h"

namespace ddp::examples::trainer {

/// A failure of the job (a peer died, a deadline passed); the trainer
/// reports it and exits non-zero.
class JobError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Marks a failure that every rank learned from rank 0 (rank 0's own
/// reason, shared so that all of them stop alike: a resume's checkpoint
/// that cannot be read, a save that failed). Rank 0 prints the reason; the
/// others print a short line pointing at rank 0's, as torchrun's workers
/// each report their own failure only, and the launcher's summary repeats
/// the first one.
class FromLead {
 public:
  virtual ~FromLead() = default;
};
/// Rank 0's UsageError (exit status 2), as every rank throws it.
class LeadUsageError : public UsageError, public FromLead {
 public:
  using UsageError::UsageError;
};
/// Rank 0's failure of the run (exit status 1), as every rank throws it.
class LeadJobError : public JobError, public FromLead {
 public:
  using JobError::JobError;
};
/// Whether `e` is a failure learned from rank 0 (see FromLead).
inline bool IsFromLead(const std::exception& e) { return dynamic_cast<const FromLead*>(&e) != nullptr; }

/// DDP's runtime statistics summed over a run's synchronizing iterations.
struct CommTotals {
  int64_t iterations = 0;
  double forward_ms = 0;           ///< DDP forward (buffer broadcast included).
  double backward_compute_ms = 0;  ///< End of forward to the last gradient.
  double backward_comm_ms = 0;     ///< First bucket launched to last bucket reduced.
  double overlap_ms = 0;           ///< Part of backward_comm_ms hidden behind compute.
  double exposed_ms = 0;           ///< Backward waiting after its last gradient.

  /// Communication time as a share of forward + backward (0..1); NaN
  /// without data.
  double CommShare() const;
  /// Share of communication hidden behind backward compute (0..1); NaN
  /// without data.
  double Overlap() const;
};

class Parallel {
 public:
  /// While alive, backward accumulates gradients locally (no communication);
  /// the first backward after it synchronizes everything accumulated.
  class NoSyncScope {
   public:
    virtual ~NoSyncScope() = default;
  };

  /// An optimizer whose state is sharded across the ranks (--zero): each
  /// rank holds the state of its own part of the parameters.
  class ShardedOptimizer {
   public:
    virtual ~ShardedOptimizer() = default;
    /// The learning rate of every part and every parameter group (the
    /// groups share it; schedulers drive it on every rank).
    virtual double lr() const = 0;
    virtual void set_lr(double lr) = 0;
    /// Ends the step: updates this rank's part, then every rank gets every
    /// parameter (collective); with --zero_overlap the update already ran
    /// inside backward and this only clears the gradients.
    virtual void Step() = 0;
    virtual void ZeroGrad() = 0;
    /// The whole state in the unsharded format, on rank 0 (empty on the
    /// others). Collective.
    virtual nn::optim::NamedTensors Consolidate() = 0;
    /// Loads a whole state (Consolidate's, or an unsharded optimizer's);
    /// each rank keeps its part. Throws std::invalid_argument, changing
    /// nothing, for a state this optimizer cannot take.
    virtual void Load(const nn::optim::NamedTensors& whole) = 0;
  };
  /// Builds the optimizer of one rank's part over parameter groups: the
  /// groups given to Shard, in order and with their options, each holding
  /// the pieces of its parameters that the rank owns.
  using OptimizerFactory =
      std::function<std::unique_ptr<nn::optim::Optimizer>(std::vector<nn::optim::ParamGroup>)>;

  virtual ~Parallel() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  /// Adapts a freshly built model before the optimizer sees its parameters
  /// (--sync_bn replaces BatchNorm layers by SyncBatchNorm). May replace
  /// `model`.
  virtual void Prepare(std::shared_ptr<nn::modules::Module>& model, const TrainConfig& config) = 0;
  /// Wraps `model` for training. Collective; once, before the first Forward.
  /// Every rank must hold the same architecture; rank 0's values win.
  /// `step`: optimizer steps already taken (a resumed run): when the
  /// checkpoint held no PowerSGD state, --comm_hook=powersgd counts its
  /// warm-up from there, so that it still starts compressing after
  /// --powersgd_start_step.
  /// `bucket_order`: BucketOrder() of the run being resumed (empty for
  /// none); used when it is a permutation of the model's trainable
  /// parameters, ignored otherwise.
  virtual void Attach(std::shared_ptr<nn::modules::Module> model, const TrainConfig& config,
                      int64_t step, const std::vector<int64_t>& bucket_order = {}) = 0;
  /// DDP's agreed bucket order (DistributedDataParallel::BucketOrder), to
  /// save with a checkpoint; empty before it is agreed, or with one rank.
  virtual std::vector<int64_t> BucketOrder() const = 0;
  /// The PowerSGD hook's state under --comm_hook=powersgd (null otherwise),
  /// from Prepare on, so that a checkpoint can be loaded into it before
  /// Attach registers the hook.
  virtual dist::PowerSgdState* PowerSgd() const { return nullptr; }
  /// Forward through the wrapper (training).
  virtual nn::Tensor Forward(const nn::Tensor& input) = 0;
  /// Backward from `loss`; unless inside a NoSyncScope, every rank holds the
  /// averaged gradients when it returns.
  virtual void Backward(const nn::Tensor& loss) = 0;
  virtual std::unique_ptr<NoSyncScope> NoSync() = 0;
  /// Copies rank 0's buffers (BatchNorm running statistics) into every
  /// rank's model, as DDP does before each training forward; then every
  /// rank evaluates rank 0's model, the one its checkpoint holds.
  /// Collective; after Attach. Nothing to do for a model without buffers.
  virtual void BroadcastBuffers() = 0;
  /// The parameters of `groups` split among the ranks, each rank's part
  /// updated by an optimizer from `make` (ZeroRedundancyOptimizer). The
  /// groups are formed from whole parameters before the split (a piece is a
  /// 1-D view whatever its parameter's shape). One group without options is
  /// split as a plain list, with that optimizer's state layout. Not
  /// collective.
  /// `overlap` (--zero_overlap): the parts are DDP's buckets, and each is
  /// updated inside backward as soon as its gradients are reduced
  /// (OverlappedZeroOptimizer, over the same groups); it starts working at
  /// Attach, which must follow (lr, set_lr and Load work before).
  virtual std::unique_ptr<ShardedOptimizer> Shard(std::vector<nn::optim::ParamGroup> groups,
                                                  const OptimizerFactory& make, bool overlap) = 0;

  /// values[i] = sum over ranks of values[i]. Collective.
  virtual void SumAcrossRanks(std::vector<double>& values) = 0;
  /// Rank 0's `value` on every rank (what the others pass is ignored).
  /// Collective.
  virtual std::string ShareFromLead(std::string value) = 0;
  /// Every rank's `value`, by rank. Collective.
  virtual std::vector<std::string> GatherFromEveryRank(const std::string& value) = 0;
  /// Runs `work` on rank 0, on a thread of its own, while the others wait
  /// for it (a checkpoint's write): rank 0 tells them every second, or
  /// every quarter of --timeout_s when shorter, that it is still going, so
  /// they wait as long as it does, up to `timeout`, instead of failing at
  /// the collectives' deadline. `work` should end soon after its `stop`
  /// turns true. Returns rank 0's outcome on every rank: "" or what `work`
  /// threw. Past `timeout` every rank throws JobError `late`, and the job's
  /// group is aborted. Once asked to stop (past `timeout`, or when the job
  /// failed), `work` has `stop_grace` to end; one that does not (stuck in
  /// the filesystem) is left running on a detached thread, with a line on
  /// stderr, and rank 0 throws as it would have. So `work` must own what it
  /// uses: captures by value, results through a shared_ptr, no reference
  /// to the caller's locals or members. When the job fails while `work`
  /// goes on, a write (`discardable` false) goes on until `timeout`, as a
  /// save half done is worth finishing; a read whose bytes the failure
  /// makes useless (`discardable` true) is asked to stop at once, so that
  /// the failure is reported within a heartbeat. Collective.
  virtual std::string RunOnLead(const std::function<void(const std::atomic<bool>& stop)>& work,
                                std::chrono::milliseconds timeout, const std::string& late,
                                std::chrono::milliseconds stop_grace, bool discardable) = 0;
  /// Stopping together: a signal (Ctrl-C, SIGTERM) reaches the ranks at
  /// different steps, so each rank votes at every step boundary and all of
  /// them act on the same vote one step later. VoteStop(signal) returns the
  /// outcome of the previous vote (the largest signal any rank voted, 0 for
  /// none; 0 at the first call) and starts this one without waiting for it,
  /// so its latency hides behind the next step. Collective: every rank
  /// calls it at the same points. FinishStopVote() waits for a vote still
  /// in flight and returns its outcome (0 when none).
  /// `slow` (rank 0's say; ignored elsewhere) rides along with the vote:
  /// SlowSteps() is its value in the last vote that finished, the same on
  /// every rank, so that all of them can switch to finishing each vote at
  /// once (where a step takes so long that the vote's latency does not
  /// matter, and acting a step late would outlast the launcher's grace).
  virtual int VoteStop(int signal, bool slow = false) = 0;
  virtual int FinishStopVote() = 0;
  virtual bool SlowSteps() const = 0;

  /// DDP's statistics since the last call, as one line ("" when none),
  /// adding them to Totals(). With `every_rank` the line ends with every
  /// rank's wait for the others, gathered across the ranks: then it is
  /// collective, and every rank calls it at the same point (the end of an
  /// epoch) with the same value.
  virtual std::string TakeStatsLine(bool every_rank) = 0;
  /// Whether this rank runs its collectives on the calling thread
  /// (ProcessGroup::collectives_on_caller): then backward hides none of the
  /// gradient communication, and CommTotals::Overlap is not a measure of it.
  virtual bool CollectivesOnCaller() const = 0;
  /// Totals over the run so far (asking changes nothing: TakeStatsLine's
  /// next line is the same).
  virtual CommTotals Totals() = 0;
  /// The folder this rank's Chrome trace (config.trace) goes into as
  /// trace_rank<r>.json: JoinJob's `trace_dir` ("" for none). DDP writes it
  /// once, when this object is destroyed after the run; a failure then is
  /// a warning on stderr, not the run's.
  virtual std::string TraceFolder() const = 0;
};

/// Joins the job described by the launch environment (RANK, WORLD_SIZE,
/// ...), or forms a one-process job without one. Collective. Throws
/// JobError when the job cannot be formed. `trace_dir` (when not empty)
/// receives trace_rank<r>.json with --trace. `timeout` bounds forming the
/// job and every collective.
std::unique_ptr<Parallel> JoinJob(const std::string& trace_dir = "",
                                  std::chrono::milliseconds timeout = std::chrono::seconds(300));

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_PARALLEL_H_
