#ifndef DDP_EXAMPLES_TRAINER_PARALLEL_H_
#define DDP_EXAMPLES_TRAINER_PARALLEL_H_

// The trainer's view of data parallelism: the replica it runs forward on,
// accumulation without synchronization, and the few collectives the
// trainer itself needs (metric sums). One implementation wraps the model in
// ddp::dist::DistributedDataParallel.

#include <memory>
#include <string>
#include <vector>

#include "examples/trainer/config.h"
#include "nn/modules/module.h"
#include "nn/tensor/tensor.h"

namespace ddp::examples::trainer {

/// A failure of the job (a peer died, a deadline passed); the trainer
/// reports it and exits non-zero.
class JobError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Parallel {
 public:
  virtual ~Parallel() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  /// Wraps `model` (already initialized identically on every rank; rank 0's
  /// values win). Collective. Call once, before the first Forward.
  virtual void Attach(std::shared_ptr<nn::modules::Module> model, const TrainConfig& config) = 0;
  /// Forward through the wrapped model (the DDP wrapper's forward).
  virtual nn::Tensor Forward(const nn::Tensor& input) = 0;
  /// While the returned guard lives, backward accumulates gradients locally
  /// (no communication); the first backward after it synchronizes.
  virtual std::unique_ptr<void, void (*)(void*)> NoSync() = 0;
  /// Called after the last backward of an optimizer step, before the step:
  /// on return every rank holds the averaged gradients.
  virtual void FinishBackward() = 0;

  /// values[i] = sum over ranks of values[i]. Collective.
  virtual void SumAcrossRanks(std::vector<double>& values) = 0;

  /// Runtime statistics since the last call, one line, or "" when there are
  /// none (for --ddp_stats).
  virtual std::string TakeStatsLine() = 0;
  /// Fractions of backward time spent in communication and of that time
  /// hidden behind computation, over the whole run (negative: unknown).
  virtual double CommShare() const = 0;
  virtual double CommOverlap() const = 0;
  /// Writes this rank's Chrome trace to `path` (for --trace).
  virtual void WriteTrace(const std::string& path) = 0;
};

/// Joins the job described by the launch environment (RANK, WORLD_SIZE,
/// ...), or forms a one-process job without one. Collective. Throws
/// JobError when the job cannot be formed.
std::unique_ptr<Parallel> JoinJob();

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_PARALLEL_H_
