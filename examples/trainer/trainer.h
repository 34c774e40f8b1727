#ifndef DDP_EXAMPLES_TRAINER_TRAINER_H_
#define DDP_EXAMPLES_TRAINER_TRAINER_H_

// The training loop behind //examples:train and //examples:scaling_bench:
// data-parallel training of an image classifier, with evaluation, metrics,
// checkpoints and exact resume (bit for bit, except that --comm_hook=powersgd
// restarts its error feedback at zero: its iteration and warm-start Q are
// saved, its per-rank residuals are not; and that on a GPU
// it takes DDP_NN_CUDA_CONV_SEARCH=0: cuDNN's searched algorithms differ per
// process). Every rank calls Train; rank 0 talks to the
// person watching (see console.h) and writes files.

#include <atomic>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "examples/trainer/config.h"
#include "examples/trainer/console.h"
#include "examples/trainer/parallel.h"

namespace ddp::examples::trainer {

/// How Train reports.
struct RunOptions {
  std::FILE* out = stdout;                ///< Rank 0's output.
  std::optional<ConsoleOptions> console;  ///< Default: detected from `out`.
  bool quiet = false;                     ///< No header, progress or epoch lines.
  bool print_result = true;               ///< The final RESULT line.
  /// Evaluate on the test set (benchmarks turn it off; test_acc is then NaN).
  bool evaluate = true;
  /// Set (to the signal number) by a SIGINT/SIGTERM/SIGHUP handler: the
  /// ranks agree to stop at the same step boundary, one step after the
  /// signal reached one of them, and rank 0 saves a checkpoint there.
  const std::atomic<int>* stop = nullptr;
  /// This rank's place among its node's ranks (LOCAL_RANK, SLURM_LOCALID,
  /// OMPI_COMM_WORLD_LOCAL_RANK): --device=cuda uses GPU local_rank modulo
  /// the visible GPUs.
  int local_rank = 0;
  /// When the process started (wall_s counts from here); default: Train's start.
  std::optional<std::chrono::steady_clock::time_point> start_time;
};

/// What a run achieved (identical on every rank except where noted: the
/// timings and communication figures are this rank's own measurements).
struct RunResult {
  int world_size = 1;
  int64_t steps = 0;             ///< Optimizer steps done, counting resumed ones.
  int64_t epochs_done = 0;       ///< Complete epochs.
  /// Complete epochs plus the part of the current one (fractional at
  /// --max_steps), counting a resumed run's earlier part.
  double epochs = 0;
  int64_t measured_steps = 0;    ///< Steps in the throughput figure.
  /// Global (every rank's samples over this rank's training time),
  /// excluding evaluation, checkpoints and the first 5 steps of this
  /// process (all steps when there were no more than 5).
  double samples_per_s = 0;
  double train_loss = 0;         ///< Mean loss per sample of the last (partial) epoch, all ranks.
  double test_loss = 0;          ///< Last evaluation.
  double test_acc = 0;           ///< Last evaluation, fraction in [0, 1].
  double wall_s = 0;             ///< This rank's, from RunOptions::start_time.
  /// The communication figures cover the same steps as samples_per_s
  /// (before, they included the warm-up steps).
  double comm_share = 0;         ///< See CommTotals::CommShare (NaN: no data).
  double comm_overlap = 0;       ///< See CommTotals::Overlap.
  int64_t comm_iterations = 0;   ///< DDP's synchronizing iterations in them.
  int stopped_by_signal = 0;     ///< Non-zero: interrupted by this signal.
  std::string checkpoint_saved;  ///< Path of the last checkpoint written ("" none).
};

/// Checks everything that can be checked before the ranks start, so that a
/// mistake gets one message instead of one per rank: the flags, the dataset
/// files, the batch size against a rank's share of the data, and with
/// --resume the checkpoint against the model, optimizer and schedule (from
/// its header alone, CheckTrainCheckpointHeader: rank 0 reads the data,
/// under --save_timeout_s). Last, it makes the folders of
/// --checkpoint and --log_dir that are missing, and appends them to
/// `made_folders` (when given), outermost first, for the caller to remove
/// if it stops before any rank starts; when it throws, it has removed them.
/// Throws UsageError; std::runtime_error when the host fails a folder's
/// write test (out of file handles, a full disk, an I/O error), which is
/// no fault of the flags.
void CheckSetup(const TrainConfig& config, int world_size, std::vector<std::string>* made_folders = nullptr);

/// Trains as configured. Collective: every rank of `parallel` calls it.
/// Before training, rank 0 checks the paths it writes (--checkpoint,
/// --log_dir) and every rank throws with its answer (a UsageError for a
/// path it refuses; where its host failed the check, rank 0 its
/// std::runtime_error and the others a JobError), since
/// under ddprun, srun or mpirun no launcher ran CheckSetup. Throws
/// UsageError for user mistakes found late (a corrupt checkpoint) and
/// JobError when the job fails (a peer died). A rank whose own failure
/// could not be told to the others (the collective failed too) throws its
/// own, naming both.
RunResult Train(const TrainConfig& config, Parallel& parallel, const RunOptions& options);

/// For restart `restart` (> 0) of a job: rank 0 decides with
/// ResumeAfterRestart whether the job resumes from its own last checkpoint
/// (it saved it, perhaps on a disk only its host sees), and every rank
/// follows, so that all resume or none: sets config.resume alike on every
/// rank. Returns rank 0's line saying which it did ("" on the others).
/// Collective: every rank of `parallel` calls it, before Train. When rank
/// 0 refuses the checkpoint as unreadable, it throws its UsageError and the
/// others LeadUsageError; when it fails otherwise (out of memory), it
/// throws its own exception and the others LeadJobError with its reason:
/// every rank stops at once either way.
std::string FollowRankZeroOnRestart(TrainConfig& config, int restart, Parallel& parallel);

/// "RESULT model=cnn ranks=2 epochs=2 samples_per_s=... train_loss=...
/// test_acc=... wall_s=..." (no newline).
std::string ResultLine(const TrainConfig& config, const RunResult& result);

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_TRAINER_H_
