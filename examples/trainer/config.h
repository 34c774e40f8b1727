#ifndef DDP_EXAMPLES_TRAINER_CONFIG_H_
#define DDP_EXAMPLES_TRAINER_CONFIG_H_

// What one training run does: the trainer's flags as a plain struct, so that
// the library can be driven by //examples:train's gflags, by the scaling
// benchmark, and by tests, without global state.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::examples::trainer {

/// A mistake a user can fix: a bad flag, missing dataset files, a checkpoint
/// of another model. The message is one line that says what is wrong and
/// how to fix it; programs print it and exit with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Models the trainer knows, in the order --help lists them.
inline const std::vector<std::string>& ModelNames() {
  static const std::vector<std::string> kNames = {"cnn", "mlp", "resnet18", "resnet34",
                                                  "resnet50"};
  return kNames;
}
/// Datasets the trainer knows.
inline const std::vector<std::string>& DatasetNames() {
  static const std::vector<std::string> kNames = {"fashion_mnist", "mnist", "cifar10",
                                                  "synthetic"};
  return kNames;
}

/// Learning-rate schedules the trainer knows (--scheduler), in the order
/// --help lists them.
inline const std::vector<std::string>& SchedulerNames() {
  static const std::vector<std::string> kNames = {"none",        "step",          "multistep",
                                                  "exponential", "cosine",        "warm_restarts",
                                                  "onecycle",    "plateau"};
  return kNames;
}

/// Every setting of a run. Defaults are //examples:train's defaults.
struct TrainConfig {
  // Model and data.
  std::string model = "cnn";
  std::string dataset = "fashion_mnist";
  std::string data_dir;            ///< Empty: the dataset's usual folder.
  int64_t train_samples = 0;       ///< Use the first N training samples; 0: all.
  int64_t test_samples = 0;        ///< Use the first N test samples; 0: all.
  int workers = 1;                 ///< Loader threads per rank; 0: on the training thread.
  uint64_t seed = 0;               ///< Initialization, shuffling and augmentation.

  // Schedule.
  int64_t epochs = 2;
  int64_t max_steps = 0;           ///< Stop after this many optimizer steps; 0: no limit.
  int64_t batch_size = 64;         ///< Samples per rank per micro-batch.
  int64_t grad_accum_steps = 1;    ///< Micro-batches per optimizer step.
  int64_t eval_every = 0;          ///< Steps between evaluations; 0: at each epoch end.

  // Optimizer.
  std::string optimizer = "sgd";
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 0.0;
  /// Weight decay on every parameter (true), or only on those of two or
  /// more dimensions (false): biases and BatchNorm's (and SyncBatchNorm's)
  /// weights and biases then form a second parameter group without weight
  /// decay.
  bool decay_norm_and_bias = true;
  std::string scheduler = "cosine";  ///< One of SchedulerNames().
  /// The schedules' settings, each for the schedulers named (ValidateConfig
  /// refuses one given to another). Steps are optimizer steps, the unit of
  /// every schedule but plateau's, which takes one metric per epoch.
  /// step: the factor after each third of the run; multistep: at each
  /// milestone; exponential: per step (needed); plateau: of each reduction.
  /// Unset: 0.1 (LrGamma).
  std::optional<double> lr_gamma;
  std::vector<int64_t> lr_milestones;  ///< multistep: steps where the rate drops (needed).
  int64_t lr_t0 = 0;                   ///< warm_restarts: steps of the first cycle (needed).
  int64_t lr_t_mult = 1;               ///< warm_restarts: each cycle this many times the last.
  int64_t lr_patience = 10;            ///< plateau: epochs without improvement tolerated.
  /// onecycle: also cycle the optimizer's momentum (SGD's momentum, Adam's
  /// and AdamW's beta1) against the rate, 0.95 to 0.85 at the peak rate and
  /// back, as PyTorch's OneCycleLR does by default (its cycle_momentum);
  /// false: the rate alone, as before the flag.
  bool cycle_momentum = false;
  /// Of lr_t0, lr_t_mult and lr_patience, those given on the command line
  /// (a value equal to the default counts as given: it is still another
  /// scheduler's flag).
  std::vector<std::string> schedule_flags_given;
  std::string amp = "off";         ///< off, bf16, fp16.
  std::string device = "cpu";      ///< cpu, or cuda (a CUDA build; cuda:LOCAL_RANK mod GPUs).
  /// Subnormal floats as zero on the CPU (x86 FTZ/DAZ), set per process
  /// before any thread starts (nn::ops::SetFlushDenormal); ranks must agree,
  /// or their updates of the same values differ.
  bool flush_denormal = true;

  // Data parallelism.
  bool sync_bn = false;
  /// Shard the optimizer state across ranks (ZeroRedundancyOptimizer).
  bool zero = false;
  /// With zero: each rank's step runs inside backward, on each gradient
  /// bucket as soon as it is reduced (OverlappedZeroOptimizer).
  bool zero_overlap = false;
  double bucket_cap_mb = 25.0;
  /// How DDP reduces gradient buckets: allreduce (f32), fp16 or bf16
  /// (compressed on the wire), powersgd (rank 1 after powersgd_start_step).
  std::string comm_hook = "allreduce";
  /// With powersgd: optimizer steps all-reduced in full before compression
  /// starts (>= 0; PowerSgdOptions::start_iteration, PyTorch's
  /// start_powerSGD_iter). Compression starts at step N + 1.
  int64_t powersgd_start_step = 1000;
  /// Deadline of every collective, in seconds: a rank that stops
  /// responding (hung, stopped, cut off) fails the job after this long.
  int64_t timeout_s = 300;
  bool find_unused_parameters = false;
  bool ddp_stats = false;          ///< Print DDP's runtime statistics per epoch.
  bool trace = false;              ///< Write a Chrome trace per rank.

  // Files. Paths are absolute once ResolvePaths ran.
  std::string checkpoint;          ///< Empty: no checkpoints.
  int64_t checkpoint_every = 0;    ///< Also save every N steps; 0: at epoch ends only.
  /// Deadline of one checkpoint save, and of --resume's read, in seconds:
  /// the other ranks wait for rank 0's write or read this long (it tells
  /// them it is still going), not --timeout_s.
  int64_t save_timeout_s = 1800;
  /// Once rank 0's write or read has run past save_timeout_s (or the job
  /// failed meanwhile) it is asked to stop, which it does within a piece;
  /// one stuck in the filesystem (a write or an fsync that never returns,
  /// as on a hung network mount) is left behind on its thread after this
  /// many seconds more, and the run ends with its error instead of waiting
  /// for it without a bound. The file at the checkpoint path stays as it
  /// was: a writer told to stop never renames its temporary file into place.
  int64_t save_stop_grace_s = 60;
  bool resume = false;             ///< Continue from `checkpoint`.
  /// Identifies the job across its restarts (JobFingerprint of its token
  /// and its launcher's run id),
  /// saved in checkpoints: a restarted job resumes only from its own.
  std::string job;
  std::string log_dir;             ///< Empty: no CSV or chart.
  int64_t log_every = 10;          ///< Steps between CSV rows.

  /// --lr_gamma, or its default 0.1.
  double LrGamma() const { return lr_gamma.value_or(0.1); }

  /// Global batch: batch_size * world_size * grad_accum_steps.
  int64_t GlobalBatch(int world_size) const {
    return batch_size * world_size * grad_accum_steps;
  }
};

/// The value "--checkpoint" takes to mean the default location.
inline constexpr char kDefaultCheckpoint[] = "auto";

/// Checks values and combinations that need no files: names, ranges,
/// options that contradict each other, values that would do nothing (a
/// --data_dir for synthetic data). Throws UsageError.
void ValidateConfig(const TrainConfig& config);

/// Where "--checkpoint=auto" saves: $XDG_CACHE_HOME (or $HOME/.cache)
/// /ddp/checkpoints/<model>_<dataset>.safetensors.
std::string DefaultCheckpointPath(const TrainConfig& config);

/// Makes data_dir, checkpoint and log_dir absolute (relative to the user's
/// directory: see examples/user_path.h), replaces "auto" by DefaultCheckpointPath and
/// "none" by no checkpoint.
void ResolvePaths(TrainConfig& config);

/// --lr_milestones' value ("1000,2000") as steps; "" gives none. Throws
/// UsageError naming the flag for anything but comma-separated integers.
std::vector<int64_t> ParseMilestones(const std::string& text);
/// The milestones as --lr_milestones takes them: "1000,2000".
std::string FormatMilestones(const std::vector<int64_t>& milestones);

/// "one of a, b, c" for messages.
std::string OneOf(const std::vector<std::string>& names);

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_CONFIG_H_
