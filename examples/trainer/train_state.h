#ifndef DDP_EXAMPLES_TRAINER_TRAIN_STATE_H_
#define DDP_EXAMPLES_TRAINER_TRAIN_STATE_H_

// Training checkpoints: everything a resumed run needs to continue exactly
// where the saved one was, in one safetensors file written atomically:
//
//   model.*   the model's state dict (parameters and buffers)
//   optim.*   optimizer state (step counts, momentum or Adam moments, f32
//             master copies), LR scheduler step (or --scheduler=plateau's
//             best metric and counts), loss-scaler state, and
//             with --comm_hook=powersgd PowerSGD's iteration and Q's (not
//             the per-rank residuals: they restart at zero)
//   metadata  position (epoch, micro-batch in the epoch, optimizer step, and
//             the samples of the epoch's order trained, which another number
//             of ranks or batch size continues from), the
//             running loss sums of the epoch (exact, as hex floats), the
//             settings that decide the data order (model, dataset, ranks,
//             batch size, accumulation, seed), and the learning-rate
//             schedule (--scheduler, --lr, the step it ends at, and the
//             --epochs and --max_steps that set that step, and the
//             --lr_gamma, --lr_milestones, --lr_t0, --lr_t_mult,
//             --lr_patience or --cycle_momentum its kind uses), and
//             --comm_hook and --sync_bn (another value on resume: a note),
//             --amp, --device and the model's floating dtype (with --amp,
//             f32 on CUDA and 16-bit on the CPU: converted on load)
//
// The data loader's order is a pure function of (seed, epoch, position), so
// the position is all a resumed run needs to see the same batches. On other
// ranks, batch size or accumulation the batches differ, but the epoch's
// sample order does not: the run trains the rest of it (see epoch_start).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "ddp/powersgd_hook.h"
#include "examples/trainer/config.h"
#include "nn/io/checkpoint.h"
#include "nn/modules/module.h"
#include "nn/optim/grad_scaler.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/optimizer.h"

namespace ddp::examples::trainer {

/// Where a run is.
struct TrainPosition {
  int64_t epoch = 0;           ///< 0-based epoch in progress.
  /// Micro-batches of that epoch already trained on by each rank, counted
  /// from epoch_start.
  int64_t batch_in_epoch = 0;
  /// Positions of the epoch's sample order (DistributedSampler's padded
  /// list) trained before this data order's first batch: 0, except after a
  /// resume in the middle of an epoch on another number of ranks, batch
  /// size or accumulation, which trains the positions from here on
  /// (DistributedSampler::set_start).
  int64_t epoch_start = 0;
  int64_t step = 0;            ///< Optimizer steps done since the run began.
  /// Sample losses of the epoch summed over every rank (each micro-batch's
  /// mean times its samples), and the samples, as of the last metrics
  /// flush (a checkpoint taken on Ctrl-C may miss the few steps since
  /// then; scheduled ones flush first).
  double epoch_loss_sum = 0;
  int64_t epoch_loss_count = 0;
  /// Not saved: set by LoadTrainCheckpoint to 1 when it moved past an epoch
  /// of which part was never trained (the saved run had another seed or
  /// training set), which then does not count as done.
  int64_t untrained_epochs = 0;
  /// DDP's bucket order (DistributedDataParallel::BucketOrder) when the run
  /// was saved: empty when it had none, or the checkpoint did not record a
  /// well-formed one. Not checked against the model here; the caller uses it
  /// only for a model with as many trainable parameters.
  std::vector<int64_t> bucket_order;
  /// With --scheduler=plateau: the optimizer step at which the plateau
  /// scheduler last took a metric (-1: never). A checkpoint saved at an
  /// epoch's end, before its evaluation, has the step before; the resumed
  /// run evaluates again and gives the plateau that epoch's test loss.
  int64_t plateau_at_step = -1;
  /// The run's identity (NewRunId), saved with its checkpoints and kept
  /// through its resumes; empty for a checkpoint saved before they were.
  std::string run;
};

/// A new run's identity: 16 hex digits, random. It names the run whose
/// rows --log_dir's metrics hold, so that a resume continues its own run's
/// rows only (see MetricsLog).
std::string NewRunId();

/// --scheduler's learning-rate schedule over a horizon, the optimizer step
/// it ends at: step (x --lr_gamma after each third of it), multistep (x
/// --lr_gamma at each of --lr_milestones), exponential (x --lr_gamma per
/// step), cosine (to 0 at it), warm_restarts (cosine over --lr_t0 steps,
/// restarting, each cycle --lr_t_mult times the last) or onecycle (up to
/// --lr and down over it; PyTorch's OneCycleLR with max_lr --lr and
/// total_steps the horizon). A resumed run continues the saved one's
/// horizon (LoadTrainCheckpoint sets it), not the one its own flags give.
/// Not for none or plateau (ReduceLrOnPlateau, driven by a metric).
class RunSchedule : public nn::optim::Schedule {
 public:
  /// `kind`: "step" or "cosine" (the other flags at their defaults).
  RunSchedule(std::string kind, int64_t steps);
  /// config.scheduler's schedule with config's settings. Throws
  /// std::invalid_argument for none, plateau, or an unknown kind.
  RunSchedule(const TrainConfig& config, int64_t steps);
  const std::string& kind() const { return kind_; }
  int64_t steps() const { return steps_; }
  /// Whether the rate depends on the horizon (step, cosine, onecycle): for
  /// the others a resumed run may end elsewhere.
  bool uses_horizon() const { return kind_ == "step" || kind_ == "cosine" || kind_ == "onecycle"; }
  /// Takes effect at the scheduler's next step or LoadStateDict.
  void set_steps(int64_t steps);
  double Lr(double base_lr, int64_t t) const override { return schedule_->Lr(base_lr, t); }
  /// onecycle with config.cycle_momentum: the momentum the schedule sets.
  bool CyclesMomentum() const override { return schedule_->CyclesMomentum(); }
  double Momentum(int64_t t) const override { return schedule_->Momentum(t); }
  std::vector<double> MomentumBounds() const override { return schedule_->MomentumBounds(); }

 private:
  std::string kind_;
  double gamma_ = 0.1;
  std::vector<int64_t> milestones_;
  int64_t t0_ = 0;
  int64_t t_mult_ = 1;
  double max_lr_ = 0;
  bool cycle_momentum_ = false;
  int64_t steps_ = 0;
  std::shared_ptr<nn::optim::Schedule> schedule_;
};

/// Whether --scheduler=`scheduler` is a RunSchedule driven by an
/// LrScheduler (not none, nor plateau).
inline bool HasRunSchedule(const std::string& scheduler) {
  return scheduler != "none" && scheduler != "plateau";
}

/// --scheduler=plateau's ReduceLrOnPlateau options: factor --lr_gamma,
/// patience --lr_patience (epochs), PyTorch's defaults otherwise.
nn::optim::PlateauOptions PlateauOptionsOf(const TrainConfig& config);

/// The optimizer step where a run that is at `position` ends: after
/// config.epochs epochs of `batches_per_epoch` micro-batches per rank
/// (config.grad_accum_steps to a step), or at config.max_steps if sooner.
/// `batches_this_epoch`: the micro-batches per rank of the position's epoch
/// when it starts past its beginning (position.epoch_start > 0; see
/// BatchesInEpoch); -1: batches_per_epoch.
int64_t RunEndStep(const TrainConfig& config, int64_t batches_per_epoch,
                   const TrainPosition& position = {}, int64_t batches_this_epoch = -1);

/// Throws UsageError when --comm_hook=powersgd would compress no step: the
/// run (RunEndStep with `batches_per_epoch`, from its start) ends at or
/// before config.powersgd_start_step, the steps all-reduced in full first.
/// Names both flags and the run's steps. Nothing to check for other hooks.
void CheckPowerSgdStarts(const TrainConfig& config, int64_t batches_per_epoch);

/// Throws UsageError when the schedule would not do what its flags say in
/// a run (from its start) of RunEndStep(config, batches_per_epoch) steps:
/// --lr_milestones at or past its end, or --scheduler=plateau in a run that
/// ends before its first epoch does (the plateau takes a metric at epoch
/// ends only). Names the flags and the run's steps.
void CheckScheduleFits(const TrainConfig& config, int64_t batches_per_epoch);

/// Micro-batches of `batch_size` per rank in an epoch of `train_size`
/// samples on `world_size` ranks that starts at position `epoch_start` of
/// its order, as the trainer's DistributedSampler and DataLoader make them.
int64_t BatchesInEpoch(int64_t train_size, int world_size, int64_t batch_size,
                       int64_t epoch_start = 0);

/// What gets saved and restored.
struct TrainComponents {
  nn::modules::Module* model = nullptr;
  /// Null for a sharded optimizer (--zero), which the next two stand for.
  nn::optim::Optimizer* optimizer = nullptr;
  nn::optim::LrScheduler* scheduler = nullptr;  ///< May be null.
  nn::optim::GradScaler* scaler = nullptr;      ///< May be null.
  /// A sharded optimizer's whole state (gathered), saved instead of
  /// optimizer->StateDict(). May be null.
  const nn::optim::NamedTensors* optimizer_state = nullptr;
  /// A sharded optimizer's loader of the whole saved state, used instead
  /// of optimizer->LoadStateDict; must throw before changing anything,
  /// std::invalid_argument for a state it refuses.
  std::function<void(const nn::optim::NamedTensors&)> load_optimizer;
  /// Samples in the training set: saved, and compared on load as part of
  /// the data order (-1: not known, not compared).
  int64_t train_size = -1;
  /// The scheduler's schedule (null without one): its horizon is saved, and
  /// set on load before the scheduler's state.
  RunSchedule* schedule = nullptr;
  /// Micro-batches per epoch on each rank of this run, from which a resumed
  /// schedule's horizon follows (-1: not known; the saved horizon stays).
  int64_t batches_per_epoch = -1;
  /// DDP's agreed bucket order, saved when not empty (Parallel::BucketOrder).
  std::vector<int64_t> bucket_order;
  /// The PowerSGD hook's state (--comm_hook=powersgd; null otherwise): its
  /// iteration and Q's are saved ("powersgd.*", the same on every rank) and
  /// restored, so that a resumed run goes on compressing where the saved
  /// one was instead of warming up again. A checkpoint without them (saved
  /// with another hook) leaves it as it is; one with them is ignored by a
  /// run without PowerSGD.
  dist::PowerSgdState* powersgd = nullptr;
  /// --scheduler=plateau's ReduceLrOnPlateau (null otherwise): its state is
  /// saved ("plateau.*") and restored; the rate it set is the optimizer's.
  nn::optim::ReduceLrOnPlateau* plateau = nullptr;
};

/// A checkpoint that could not be written (a full disk, no permission, a
/// read-only filesystem): a failure of the run, not of its flags, so that
/// every rank ends with the same exit status (1, not UsageError's 2). The
/// message names the --checkpoint path and the system's reason.
class CheckpointSaveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The line of a CheckpointSaveError for a save of `path` whose system
/// call failed with errno `err`: the reason (strerror) and what to do about
/// it, which depends on the reason (free space on a full disk, another
/// folder where writing is not allowed). `detail` (the failed call, or "")
/// is added for reasons without advice of their own, without the path or
/// the reason when it repeats them (the writer's message leads with both).
std::string CheckpointSaveProblem(const std::string& path, int err, const std::string& detail);

/// Whether `failure` (a CheckpointSaveError's text, perhaps with more
/// after it) says the checkpoint is in place, readable, and only the fsync
/// of its folder failed: a crash of the host could still lose it.
bool SavedButNotDurable(const std::string& failure);

/// Saves a checkpoint to `path` atomically, creating its folder. Call on
/// rank 0 only. Throws CheckpointSaveError naming the path when it cannot
/// be written, or when it is in place but its folder's fsync failed
/// (SavedButNotDurable says which). Once `*stop` (when given) is true, the write ends within a
/// piece of kStopCheckBytes with that error, leaving `path` as it was.
void SaveTrainCheckpoint(const std::string& path, const TrainComponents& parts,
                         const TrainPosition& position, const TrainConfig& config, int world_size,
                         const std::atomic<bool>* stop = nullptr);

/// SaveTrainCheckpoint in two halves. TrainCheckpointOf gathers what a
/// save writes: the metadata, and the model's and optimizer's tensors as
/// handles sharing their storage (no copy), so the caller must not change
/// those tensors until the write has ended or was stopped. WriteTrainCheckpoint
/// writes it to `path` as SaveTrainCheckpoint does, touching nothing of the
/// components: a thread that owns its copy of the checkpoint can run it.
nn::io::Checkpoint TrainCheckpointOf(const TrainComponents& parts, const TrainPosition& position,
                                     const TrainConfig& config, int world_size);
void WriteTrainCheckpoint(const std::string& path, const nn::io::Checkpoint& checkpoint,
                          const std::atomic<bool>* stop = nullptr);

/// Loads `path` into `parts` (all or nothing) and returns the position to
/// continue from. A missing or unreadable file, or a checkpoint of another
/// model, optimizer or precision, throws UsageError with one line that names
/// the differing keys and the fix; so does one of another --scheduler,
/// --lr or schedule flag (--lr_gamma, ...), and one whose schedule this run's --epochs or --max_steps would end
/// elsewhere (naming the flags and both values). When the saved run had
/// another number of ranks, batch size or accumulation, a mid-epoch
/// position continues with the samples of the epoch's order it had not
/// trained (epoch_start), split across this run's ranks, and `note` says
/// so. When it had another seed or training set, that order is another
/// one: the position moves to the start of the next epoch, the epoch left
/// is not counted as done (untrained_epochs), and `note` says so (and that
/// nothing is left to train when it was the last). The schedule keeps its
/// horizon unless this run, with the same --epochs and --max_steps, ends at
/// another step (another number of steps per epoch, or fewer left in a
/// resumed epoch): then it ends where this run ends, and `note` says so.
/// Another --comm_hook or --sync_bn loads, with a note naming both values.
/// The same --amp on another --device loads: the model state is converted
/// to this model's dtype (f32 on CUDA, 16-bit on the CPU), the f32 values
/// kept as the optimizer's master copies; a checkpoint that did not record
/// its model's dtype (an older trainer's) is refused then, naming --device.
/// A checkpoint from before schedules were recorded
/// takes the horizon from this run's flags and the rate from the file, with
/// a note. Only refusals of the file's content are UsageErrors: a failure
/// of this process or the job while loading (std::bad_alloc, a collective
/// of load_optimizer that failed) is thrown as it came.
TrainPosition LoadTrainCheckpoint(const std::string& path, const TrainComponents& parts,
                                  const TrainConfig& config, int world_size, std::string* note);
/// The same from the checkpoint file's bytes, read by ReadTrainCheckpoint
/// (perhaps on another rank); `path` names them in messages.
TrainPosition LoadTrainCheckpoint(const std::string& path, std::string bytes,
                                  const TrainComponents& parts, const TrainConfig& config,
                                  int world_size, std::string* note);
/// The refusals of LoadTrainCheckpoint that the checkpoint's header decides,
/// from its header alone (no tensor's data is read, however large the
/// file): a path that holds no checkpoint, a header that is not valid or
/// not a checkpoint's; and, in the line LoadTrainCheckpoint gives, a
/// checkpoint of another model (names, shapes, dtypes), optimizer,
/// precision, dataset or schedule, or whose position is out of range or
/// would end its schedule elsewhere. Left to LoadTrainCheckpoint, which
/// reads the data: a data region whose checksum does not match, optimizer,
/// scheduler or loss-scaler state this run cannot use, and a scheduler step
/// other than the position's. `parts` as for LoadTrainCheckpoint (its
/// optimizer, scheduler and scaler are not used); nothing of them changes.
/// internal::SetReadPause does not apply. Throws UsageError; a read of
/// the header the host failed (EIO, EMFILE) throws std::runtime_error.
void CheckTrainCheckpointHeader(const std::string& path, const TrainComponents& parts,
                                const TrainConfig& config, int world_size);
/// The bytes of the checkpoint at `path`; throws the UsageError of a
/// missing or unreadable file, or of a path with a file where one of its
/// folders must be (naming that file). A read the host failed (EIO,
/// EMFILE, ENOMEM) throws std::runtime_error instead: the file may be good. Once `*stop` (when given) is true, the read
/// ends within a piece of kStopCheckBytes with a UsageError.
std::string ReadTrainCheckpoint(const std::string& path, const std::atomic<bool>* stop = nullptr);

/// "F is a file, not a folder" when the nearest of `dir` and the folders
/// above it that is there (through links) is not a folder: F stands where
/// a folder of the path must be, which the system reports only as "Not a
/// directory" or, for a look at a path below it, as absent. "" when that
/// one is a folder, or when none can be looked at.
std::string FileWhereAFolderMustBe(const std::string& dir);

namespace internal {

/// Makes ReadTrainCheckpoint (and IsAnotherRunsCheckpoint, without a stop)
/// wait `pause` before it reads a file that is
/// there, as a slow disk would, giving way to its stop within 10 ms; for
/// tests of the deadlines around a resume's read. Process-wide; zero (the
/// default) turns it off. A non-empty `started_mark` names a file created
/// as each pause begins, for a test to see that the read is under way.
/// For tests only.
void SetReadPause(std::chrono::milliseconds pause, const std::string& started_mark = "");

}  // namespace internal

/// A short, stable name of the job whose launch token is `token` and whose
/// launcher's run id (LaunchEnv::run_id: ddprun's DDP_RUN_ID, one per run and
/// kept through its restarts, or torchrun's rendezvous id) is `run_id` (a
/// hash: the token itself is a secret and stays out of checkpoint files);
/// empty when both are empty. The run id tells apart runs that reuse a
/// token, as scripts setting DDP_JOB_TOKEN do; under torchrun, which gives
/// no token, it alone names the job, so two torchrun jobs given the same
/// --rdzv_id (or --rdzv-id) are one job to a restart.
std::string JobFingerprint(const std::string& token, const std::string& run_id = "");

/// For restart `restart` (> 0) of a job: sets config.resume when
/// config.checkpoint holds a checkpoint saved by this job (config.job), so
/// that the ranks continue where the failed attempt's last checkpoint left
/// off instead of starting over; a checkpoint of another run is left alone.
/// Returns a line saying which it did. Reads only the file's header; throws
/// UsageError naming the path and the reason when a file is there but its
/// header cannot be read: it may be this job's, and starting over would
/// replace it; any other failure (std::bad_alloc) goes on as it came, a
/// failure of the restart, not of its flags. Called on rank 0 only, whose
/// decision the others follow: rank 0 saved the checkpoint, perhaps on a
/// disk that only its host sees.
std::string ResumeAfterRestart(TrainConfig& config, int restart);

/// Whether `path` holds a file that this job may not replace without
/// keeping it: a checkpoint that another run saved (its job is not `job`,
/// or either is unnamed; from the header alone), a safetensors file that
/// the trainer did not write (weights exported from Python, say), or a
/// file whose header cannot be read, whose run is unknown. A stop before a
/// fresh run's first save leaves such a file alone.
bool IsAnotherRunsCheckpoint(const std::string& path, const std::string& job);

/// What such a file is, for the messages that say it is kept: "a file this
/// trainer did not write" when its header reads and has none of the
/// trainer's metadata (--resume cannot continue it), "a file that does not
/// read as a safetensors file" when its bytes are not safetensors (a
/// PyTorch .pt, a text file; --resume refuses it too), "a file whose header
/// cannot be read now" when the host failed the read (EIO, ESTALE, no
/// memory), else "another run's checkpoint".
std::string KeptFileKind(const std::string& path);

/// Where a fresh run keeps another run's checkpoint at `path` instead of
/// replacing it: `<stem>.prev<extension>` beside it for n = 1
/// (".../cnn_fashion_mnist.prev.safetensors"), `<stem>.prev.<n><extension>`
/// for n > 1 (".../cnn_fashion_mnist.prev.2.safetensors").
std::string PreviousCheckpointPath(const std::string& path, int n = 1);

/// The first PreviousCheckpointPath(path, n) that no file has now: where
/// KeepAsPreviousCheckpoint would keep the file at `path` (unless another
/// process takes that name first), or the first one too long for its
/// folder (ENAMETOOLONG), where the keep would fail. For a symbolic link to a file on another
/// filesystem, the first free PreviousCheckpointPath of that file.
std::string FreePreviousCheckpointPath(const std::string& path);

/// Gives the file at `path` the first free PreviousCheckpointPath name,
/// never replacing a file there (an earlier run's kept checkpoint), and
/// syncs the folder; returns that name. The file stays at `path` too (a
/// hard link) until a save renames a new file over it; on a filesystem
/// without hard links it is renamed instead, and `path` is then empty.
/// When `path` is a symbolic link, the file it leads to is the one kept
/// (the save writes through the link), and the link stays: where that file
/// cannot have a second name beside the link (it is on another filesystem,
/// or hard links are missing), its kept name is beside the file itself
/// (PreviousCheckpointPath of the file), a hard link or, without them,
/// the file renamed, and the save makes a new file there through the link.
/// Call on rank 0 only, before a fresh run's first save over another run's
/// checkpoint (IsAnotherRunsCheckpoint). Throws UsageError naming both
/// paths when that fails; `path` is then as it was.
std::string KeepAsPreviousCheckpoint(const std::string& path);

/// After a save that failed: removes the name `previous` that
/// KeepAsPreviousCheckpoint gave the file at `path`, if `path` still is
/// that file (the save did not replace it), and returns whether it did.
bool ForgetKeptCheckpoint(const std::string& path, const std::string& previous);

/// Throws the UsageError LoadTrainCheckpoint would for a model mismatch,
/// reading only the model part of `path` (used before starting ranks).
void CheckCheckpointMatchesModel(const std::string& path, const nn::modules::Module& model,
                                 const TrainConfig& config);

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_TRAIN_STATE_H_
