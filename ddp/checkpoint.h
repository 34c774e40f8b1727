#ifndef DDP_DDP_CHECKPOINT_H_
#define DDP_DDP_CHECKPOINT_H_

// Checkpoints of data-parallel training: rank 0 writes (one atomic file, so
// a crash leaves the previous checkpoint or the new one, never a mix), every
// rank reads. Both are collective so that a failure on one rank becomes the
// same error on every rank instead of a hang at the next collective.
//
//   // save (every rank calls it; only rank 0 touches the disk); the
//   // scheduler and the scaler are optional
//   dist::SaveCheckpoint(pg, path, dist::MakeCheckpoint(*model, &opt, {{"step", "120"}}, &sched, &scaler));
//   // resume (every rank; LoadCheckpointFromRank when only rank 0 has the file)
//   nn::io::Checkpoint c = dist::LoadCheckpoint(pg, path);
//   dist::RestoreCheckpoint(pg, c, *model, &opt, &sched, &scaler);
//
// The model is the wrapped module (a DistributedDataParallel is unwrapped
// automatically, so keys never carry its "module." prefix and a checkpoint
// loads into a plain model too). The optimizer, scheduler and scaler share
// the checkpoint's optimizer list ("lr", "group.*", "param_groups.*" and
// "state.*", "scheduler.*", "scaler.*"), as nn/io/checkpoint.h and the
// example trainer lay it out.
// So do PowerSGD's state ("powersgd.*": its iteration and Q's, not the
// per-rank residuals, which a resumed run starts at zero; see
// powersgd_hook.h), a PeriodicModelAverager's step ("averager.*") and the
// post-local-SGD hook's iteration ("post_local_sgd.*", PostLocalSgdState),
// so that a resumed run keeps compressing past PowerSGD's warm-up, keeps
// its averaging period and stays in the local phase once it has begun.
//
// A sharded optimizer (ZeroRedundancyOptimizer, OverlappedZeroOptimizer)
// is no nn::optim::Optimizer, and MakeCheckpoint given a
// ZeroRedundancyOptimizer's local() would save rank 0's shard alone. Save its whole state instead: on every rank
// (collective) append its ConsolidatedStateDict(0) to the optimizer list
// of rank 0's MakeCheckpoint(model, nullptr, ...), scheduler included.
// Resume with its LoadStateDict(c.optimizer) on every rank (it skips the
// other components' keys), then RestoreCheckpoint with no optimizer and a
// copy of `c` whose optimizer list lacks the optimizer's own keys ("lr",
// "group.*", "param_groups.*", "state.*"), so that a scheduler (over a
// ZeroRedundancyOptimizer's local()) still finds "scheduler.*".

#include <atomic>
#include <chrono>
#include <functional>
#include <string>

#include "ddp/model_averaging.h"
#include "ddp/powersgd_hook.h"
#include "ddp/process_group.h"
#include "nn/io/checkpoint.h"
#include "nn/modules/module.h"
#include "nn/optim/grad_scaler.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/optimizer.h"

namespace ddp::dist {

namespace internal {

/// The default of SaveOptions::stop_grace and LoadWaitOptions::stop_grace:
/// how long a write or read asked to stop may take to end before its
/// thread is abandoned. A piece (nn::io::kStopCheckBytes) to storage that
/// is slow but working takes well under it.
inline constexpr std::chrono::milliseconds kStopGrace{std::chrono::minutes(1)};

}  // namespace internal

/// The model's state dict (sharing the model's tensors, no copy) and, in
/// checkpoint.optimizer, the optimizer's state followed by the scheduler's,
/// the scaler's, PowerSGD's (without residuals; its parameters named as
/// the model names them), the averager's, the post-local-SGD hook's and
/// ReduceLrOnPlateau's (each may be null: nothing of it is saved). Called on rank 0 for
/// SaveCheckpoint: what it saves of PowerSGD, the averager and the hook is
/// the same on every rank.
nn::io::Checkpoint MakeCheckpoint(const nn::modules::Module& model,
                                  const nn::optim::Optimizer* optimizer,
                                  nn::io::Metadata metadata = {},
                                  const nn::optim::LrScheduler* scheduler = nullptr,
                                  const nn::optim::GradScaler* scaler = nullptr,
                                  const PowerSgdState* powersgd = nullptr,
                                  const PeriodicModelAverager* averager = nullptr,
                                  const PostLocalSgdState* post_local_sgd = nullptr,
                                  const nn::optim::ReduceLrOnPlateau* plateau = nullptr);

/// How long the others wait for rank 0's write in SaveCheckpoint.
struct SaveOptions {
  /// The write's deadline, which may be longer than the group's timeout
  /// (many GB to slow storage). Past it, every rank throws, the group is
  /// aborted, and rank 0 stops writing within 64 MiB (kStopCheckBytes),
  /// leaving the file at `path` as it was; only a write whose rename into
  /// place had already begun at the deadline may still replace it, and
  /// the error then says so.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// How often rank 0 tells the others that it is still writing (each
  /// message is a collective bound by the group's timeout, and so is at
  /// most a quarter of it).
  std::chrono::milliseconds heartbeat{std::chrono::seconds(1)};
  /// How long rank 0 waits, once its write was asked to stop (past
  /// `timeout`, or when the group failed), for the writing thread to end.
  /// A write stops within a piece, unless the filesystem itself hangs (a
  /// write or an fsync that never returns, as on a stuck network mount):
  /// past this grace, rank 0 prints to stderr that the write of `path` did
  /// not finish, leaves the thread behind (detached, owning what it uses)
  /// and returns. The file at `path` stays as it was: the writer looks at
  /// its stop flag once more before renaming its temporary file into
  /// place, and removes that file if it ever returns (unless its rename
  /// had already begun at the stop, which the message then says). When
  /// the process exits while that thread is still stuck, the exit ends it.
  /// Should its call return during the exit, the rest of the write still
  /// runs then (its stop check, closing and removing the temporary file,
  /// freeing its own buffers), and so do restoring the streams and
  /// recording its outcome; then, once the exit has marked itself begun,
  /// the thread keeps what it owns (the checkpoint's copy and tensors, its
  /// streams) and waits for the exit to end it, instead of freeing them
  /// while the process's static objects (allocators, the CUDA runtime) are
  /// destroyed. The exit marks itself begun before it destroys any static
  /// object made before the thread was left behind (those that what it
  /// owns was made with); statics made later may be destroyed before. A
  /// thread already freeing what it owns when the exit begins gets up to
  /// 1 s more, after which the exit goes on while it frees.
  std::chrono::milliseconds stop_grace{internal::kStopGrace};
};

/// The metadata key under which SaveCheckpoint records the group's size
/// ("4"). LoadCheckpoint and LoadCheckpointFromRank compare it with theirs:
/// a different size loads (DDP's state does not depend on it, and an
/// elastic resume on fewer or more ranks is legitimate), with one warning
/// on stderr from rank 0 naming both sizes, since what the training script
/// derives from it (per-rank batch, data sampler position, a learning rate
/// scaled by it) may need attention. Checkpoints without it (older ones,
/// nn::io::SaveCheckpoint's) load without a warning.
inline constexpr char kWorldSizeKey[] = "world_size";

/// Collective. Rank 0 writes `checkpoint` to `path` atomically; the others
/// wait for it, as long as it goes on writing, up to `options.timeout`.
/// Every rank throws the same error when rank 0 failed or ran out of time.
/// `checkpoint` is read on a thread of rank 0's while its caller's thread
/// keeps the others informed. The file's metadata also records pg.size()
/// under kWorldSizeKey (replacing a value the caller put there). On a
/// group already aborted (a rank failed before the call), every rank
/// throws DistributedError at once, naming `path` and the group's reason,
/// and rank 0 leaves the file as it was: its state follows a failed
/// collective and may not match the other replicas. Every rank must pass
/// the same, non-empty `path` (the one rank 0 writes) and valid
/// `options`: the ranks compare them first (one all-reduce of four
/// numbers), and when a rank passed another path, an empty one or options
/// it refuses, every rank throws the same std::invalid_argument naming
/// the ranks and what they passed, nothing is written, and the group
/// stays usable. A rank on which that comparison throws (memory running
/// out) still takes part in it: every rank throws std::runtime_error at
/// once naming it and what threw, and nothing is written. A rank that
/// cannot make the buffers of that comparison rethrows what threw after
/// aborting the group with a reason naming the call, itself and what
/// threw: the others throw that DistributedError at once, nothing is
/// written, and the group is no longer usable. So does a rank on which
/// what it prepares alone before an exchange throws (the comparison's
/// messages; once the arguments agreed, the copy of `checkpoint` the
/// write owns, the status buffer, the writing thread), the reason saying
/// that it "threw while it prepared its part": rank 0 may then have begun
/// its write, which the group's failure lets finish. So do LoadCheckpoint
/// and LoadCheckpointFromRank (for their comparison, root's path, the
/// account of the read and the reading thread) and the collective
/// RestoreCheckpoint (for its checks' outcomes, with nothing changed).
void SaveCheckpoint(ProcessGroup& pg, const std::string& path, const nn::io::Checkpoint& checkpoint,
                    const SaveOptions& options = {});

/// How long ranks wait for the others' reads in LoadCheckpoint (every rank
/// reads: one whose host just wrote the file has it in memory, the others
/// read it from slow storage) and for the root's in LoadCheckpointFromRank.
struct LoadWaitOptions {
  /// The reads' deadline, which may be longer than the group's timeout
  /// (many GB from slow storage). Past it, every rank throws, the group is
  /// aborted, and the ranks still reading stop within 64 MiB.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// How often ranks still reading tell the others so (at most a quarter
  /// of the group's timeout).
  std::chrono::milliseconds heartbeat{std::chrono::seconds(1)};
  /// How long a rank whose read was asked to stop waits for its reading
  /// thread to end; past it (a filesystem that hangs in a read), it prints
  /// to stderr that the read of `path` did not finish, leaves the thread
  /// behind (detached, owning what it uses, its result dropped) and throws
  /// as it would have. As SaveOptions::stop_grace, at the process's exit
  /// too.
  std::chrono::milliseconds stop_grace{internal::kStopGrace};
};

/// Collective. Every rank reads `path`. When any rank fails, every rank
/// throws one error naming each failing rank and its reason (another
/// rank's cut at about 1 KB, this rank's own in full); so it does
/// when the ranks read different contents (the data checksum, the tensors'
/// count and bytes, the "step" entry differ: a stale copy on a node's own
/// disk, a network filesystem's client cache just after rank 0 replaced
/// the file), naming what each rank read. A rank whose memory runs out
/// once it has read (saying what it read throws std::bad_alloc) is named
/// the same way ("ran out of memory"): the buffers of that exchange are
/// made before the read.
/// The ranks wait for each other's reads up to `wait.timeout`; when the
/// group fails meanwhile, the reads still going are stopped at once (what
/// they read would be thrown away) and every rank throws the group's
/// DistributedError. An empty `path`, or a `wait` or `options` (see
/// nn::io::CheckLoadOptions: a device_map entry or a device this process
/// cannot load on) that one rank refuses, fails every rank alike with
/// std::invalid_argument, naming the rank and the option, before any read
/// (as SaveCheckpoint's options).
nn::io::Checkpoint LoadCheckpoint(ProcessGroup& pg, const std::string& path,
                                  const nn::io::LoadOptions& options = {}, const LoadWaitOptions& wait = {});


/// Collective. Rank `root` reads `path` and sends its bytes to the others,
/// which parse the same bytes: the file need only be where `root` can read
/// it (a checkpoint SaveCheckpoint wrote on rank 0's own disk, with no
/// filesystem shared between hosts), and it is read once, not once per
/// rank. The others wait for the read as long as it goes on, up to
/// `wait.timeout` (the group's timeout then bounds sending the bytes);
/// when the group fails meanwhile, root stops its read at once.
/// When `root` cannot read it, or any rank cannot load it, every rank
/// throws one error naming each failing rank and its reason (a rank that
/// cannot make room for root's bytes, memory running out, is named so
/// before any byte is sent; a group that fails while they are sent gives
/// a DistributedError naming the call and what was being sent); messages
/// begin "LoadCheckpointFromRank '<root's path>' (read by rank <root>)",
/// whatever path this rank passed (root sends its path to the others
/// first, a broadcast of a few bytes). Every rank
/// must pass the same `root`, inside the group, valid `wait` and
/// `options` (each rank loads the bytes with its own; see
/// nn::io::CheckLoadOptions), and root a non-empty `path` (the others' is
/// only named in messages): the ranks compare them first, and otherwise
/// every rank throws the same std::invalid_argument naming the ranks and
/// what they passed, before any read.
nn::io::Checkpoint LoadCheckpointFromRank(ProcessGroup& pg, const std::string& path, int root = 0,
                                          const nn::io::LoadOptions& options = {},
                                          const LoadWaitOptions& wait = {});

/// How RestoreCheckpoint matches the model's keys and undoes a load that
/// failed.
struct RestoreOptions {
  /// Once the checks passed (on every rank, for the collective restore),
  /// the state of the objects restored is copied to the CPU before
  /// loading, so that when a load fails (on any rank), the objects are put
  /// back as they were before the call. The cost, per rank, for the
  /// length of the call: host memory for the model's state dict (its
  /// parameters and persistent buffers, a tied weight once per name), the
  /// optimizer's state (SGD with
  /// momentum: one more copy of the parameters; Adam: two, plus an f32
  /// master of each 16-bit parameter) and PowerSGD's Q's and residuals
  /// (with `powersgd`), the other components a few numbers each: about 3x
  /// the f32 parameters' bytes with Adam. With parameters on a GPU, the
  /// optimizer's StateDict makes its copies there first, so the device
  /// also needs room for the optimizer's state once more, briefly. A copy
  /// that cannot be made fails the restore (every rank's) before anything
  /// changes. Set false where that memory is not there (a model near the
  /// host's memory): a failed load is then not undone.
  bool rollback = true;
  // After `rollback`, so that positional initializers keep their meaning.
  /// As PyTorch's load_state_dict(strict=...). True: the checkpoint's
  /// model keys must be the model's, no more, no fewer. False (to
  /// fine-tune from a checkpoint with a new head): the keys in both are
  /// loaded, their shapes and dtypes still checked as when strict, and the
  /// model's keys the checkpoint lacks (`missing`) and the checkpoint's
  /// keys the model lacks (`unexpected`) are skipped and returned. Only
  /// the model's part is loosened: the other components load strictly,
  /// and a checkpoint whose optimizer state ("state.<name>.*") names a
  /// skipped key is refused with an optimizer given, naming the keys
  /// (restore the model alone, with no optimizer and the optimizer list
  /// cleared in a copy of the checkpoint). The collective restore also
  /// refuses, on every rank, ranks that would skip different keys. The
  /// model's keys skipped keep each rank's own values: equal on every rank
  /// when a DistributedDataParallel wraps the model (its constructor
  /// broadcasts rank 0's), before or after the call.
  bool strict = true;
};

/// Copies the checkpoint into the model (strictly by default: keys, shapes
/// and dtypes must match, see Module::LoadStateDict and
/// RestoreOptions::strict), the optimizer, then the
/// scheduler (which sets the optimizer's lr for its restored step), the
/// scaler, PowerSGD's state, the averager's, the post-local-SGD hook's and
/// ReduceLrOnPlateau's; each of the last seven may be null. All or nothing: every part is checked before anything changes,
/// and one std::invalid_argument lists every problem (a component's check
/// that throws anything else, a LambdaSchedule's function included, even
/// what is no std::exception, is one more problem; the scheduler's rates
/// are computed once, by its check, and the load sets those). A key of
/// checkpoint.optimizer that no given component takes is a problem too,
/// naming the argument to pass: optimizer state ("lr", "group.*",
/// "param_groups.*", "state.*") without
/// an optimizer, "scheduler.*" without a scheduler, "scaler.*" without a
/// scaler, "powersgd.*" without `powersgd`, "averager.*" without
/// `averager`, "post_local_sgd.*" without `post_local_sgd`, "plateau.*"
/// without `plateau`, or keys none of them takes. (A sharded optimizer loads its
/// own state: leave its keys out of a copy of checkpoint.optimizer, as the
/// top of this file says.) A load can still throw once the checks passed (a
/// learning-rate target that refuses the restored rate, memory running
/// out): with options.rollback (the default), the parts loaded are then
/// put back, bitwise as they were, and the load's own exception is
/// rethrown; when a part cannot be put back, a std::runtime_error names
/// the load's failure and the part, asking to restore again or rebuild
/// the objects. Call before the first backward of the resumed run. Runs on
/// this rank alone: with several ranks, the collective overload below
/// makes a failure on one rank an error on every rank. Returns the model's
/// keys that were skipped: empty when options.strict.
nn::modules::IncompatibleKeys RestoreCheckpoint(
    const nn::io::Checkpoint& checkpoint, nn::modules::Module& model, nn::optim::Optimizer* optimizer,
    nn::optim::LrScheduler* scheduler = nullptr, nn::optim::GradScaler* scaler = nullptr,
    PowerSgdState* powersgd = nullptr, PeriodicModelAverager* averager = nullptr,
    PostLocalSgdState* post_local_sgd = nullptr, nn::optim::ReduceLrOnPlateau* plateau = nullptr,
    const RestoreOptions& options = {});

/// Collective RestoreCheckpoint, for a resume on every rank: each rank
/// checks its own model and components as above, then the ranks exchange
/// their outcomes (one all-gather, bound by the group's timeout) before
/// any of them changes anything. When a rank's checks failed (a rank that
/// built another model, passed no scheduler...), every rank throws one
/// std::invalid_argument naming each failing rank and its problems, and
/// every rank's model and components are left as they were: no rank goes
/// on to train and then hang at its next collective. Another rank's
/// problems come cut at about 1 KB; a rank's own are given in full. A
/// rank whose checks or copy throw (memory running out) is named the same
/// way, with what threw ("ran out of memory: std::bad_alloc"): once the
/// call has made its buffers (about 1 KB per rank), it still takes part in
/// the exchange. On a group that fails during the exchange, it throws the
/// group's DistributedError, also with nothing changed.
///
/// Once every rank's checks passed, a load can still throw on one rank (a
/// learning-rate target that refuses the restored rate, memory running
/// out): the ranks then compare their loads (one all-reduce of a number)
/// and every rank throws one std::runtime_error naming each failing rank,
/// the part whose load threw, why, and the parts loaded before it. All or
/// nothing, with options.rollback (the default): before throwing, every
/// rank puts back the parts it loaded from the copy it made, the last
/// loaded first, so that every rank's model, optimizer (its slots, steps,
/// rates and options), scheduler (its step, base rates and the rates it
/// drives, even ones set by hand since its last step), scaler, PowerSGD
/// state (Q's and this rank's residuals), averager, post-local-SGD hook
/// and plateau are bitwise as they were before the call, and the message
/// says so. A rank that cannot put a part back (putting back throws) is
/// named with the part and why, and the message then asks to restore
/// again (or rebuild the objects) before training. A rank on which telling
/// the others how its load went throws (memory running out) still takes
/// part in the comparison, and is named with what threw. Without rollback, a
/// rank that did not fail holds the checkpoint's state in every part; a
/// failing rank holds it in the parts loaded before the one that threw
/// (in the order above), that part may be half loaded, and the rest is as
/// it was. The group stays usable: restore again on every rank (or
/// rebuild the objects) before training. A group that fails during this
/// comparison gives its DistributedError, which says how this rank's load
/// went and, with rollback, that this rank put its parts back (or which
/// it could not): a rank whose comparison had completed before the group
/// failed may have returned with the checkpoint loaded.
///
/// Returns the model's keys that were skipped, the same on every rank:
/// with options.strict = false, ranks whose checks passed but that would
/// skip different keys (each rank built another model) make every rank
/// throw std::invalid_argument naming the ranks that differ from rank 0
/// and this rank's skipped keys, with nothing changed (ranks that pass
/// different `strict` values load as long as their skipped keys agree).
nn::modules::IncompatibleKeys RestoreCheckpoint(
    ProcessGroup& pg, const nn::io::Checkpoint& checkpoint, nn::modules::Module& model,
    nn::optim::Optimizer* optimizer, nn::optim::LrScheduler* scheduler = nullptr,
    nn::optim::GradScaler* scaler = nullptr, PowerSgdState* powersgd = nullptr,
    PeriodicModelAverager* averager = nullptr, PostLocalSgdState* post_local_sgd = nullptr,
    nn::optim::ReduceLrOnPlateau* plateau = nullptr, const RestoreOptions& options = {});

namespace internal {

/// A rank's long part of a collective (a write, a read): it should end
/// soon after `stop` turns true (nn/io's writers and readers do, within a
/// piece of kStopCheckBytes). One that has not ended `stop_grace` after
/// the stop is abandoned on a detached thread (stuck in the filesystem),
/// so a work given a grace shorter than its caller can afford to hang must
/// own what it uses (capture by value, results through a shared_ptr). The
/// default grace, kMostTimeout, is for works that refer to their caller's
/// objects: in practice they are always waited for, never left behind.
using StoppableWork = std::function<void(const std::atomic<bool>& stop)>;

/// What RunOnRootWhileOthersWait and RunOnEveryRankWhileOthersWait do with
/// a work still going when the group fails.
enum class IfTheGroupFails {
  /// Let it go on until its timeout, then ask it to stop: a write half
  /// done is worth finishing, and its caller learns whether the new file
  /// is in place.
  kLetTheWorkFinish = 0,
  /// Ask it to stop at once and wait for it at most `stop_grace`: a read,
  /// whose bytes nobody uses once the group's error is thrown, so that the
  /// error comes within a heartbeat instead of after the read or its
  /// timeout.
  kStopTheWork = 1,
};

/// What the caller of RunOnRootWhileOthersWait or
/// RunOnEveryRankWhileOthersWait does once the wait's last exchange has
/// ended, which decides whether a throw on one rank past it aborts the
/// group.
enum class AfterTheWait {
  /// The ranks exchange more in the same call (LoadCheckpoint's agreement
  /// on what was read, LoadCheckpointFromRank's sending of the bytes): a
  /// rank that throws past the wait's last exchange would leave the others
  /// waiting for it there, so it aborts the group.
  kTheCallExchangesMore = 0,
  /// The wait is the call's last exchange (SaveCheckpoint): nobody waits
  /// for a rank that throws past it, and the group stays usable.
  kTheCallEnds = 1,
};

/// What SaveCheckpoint's writer and LoadCheckpointFromRank's reader share
/// (exposed for tests): collective; `root` runs `work` on a thread of its
/// own and tells the others every `heartbeat` (at most a quarter of the
/// group's timeout) that it is still going, so they wait as long as it
/// does, up to `timeout`. Returns root's outcome on every rank: empty, or
/// what `work` threw (in full on root, its first 1 KB elsewhere). Past `timeout`, every rank gets "<task> did not
/// finish within <option> (N ms)" (root asks `work` to stop before the
/// others hear it, through nn::io::OrderedStop; when a writer in `work` had
/// already passed its last check before its rename, root waits a
/// heartbeat more for its outcome, and otherwise the error adds that the
/// new file may be in place), root returns once it ends, and the group is
/// aborted with `abort_reason` and that limit. When the group fails while `work` goes on, root lets it go on
/// until `timeout` (kLetTheWorkFinish) or asks it to stop at once
/// (kStopTheWork) before it rethrows the group's DistributedError, its
/// message ending with how `work` ended ("; meanwhile rank 0 went on with
/// <task>, which completed", "which failed: <reason>", "which did not
/// finish within <option> (N ms) and was asked to stop", or "which was
/// asked to stop at once: its outcome is of no use once the group failed"). A `work` still going `stop_grace`
/// after it was asked to stop is left running on a detached thread, with
/// a line on stderr starting with `abort_reason` that says so. What
/// throws on one rank alone before its last exchange, other than the
/// group's DistributedError (memory running out as it makes its status
/// buffer or thread), aborts the group with a reason of its own, then is
/// rethrown: "<call>: rank R threw while it prepared its part, before the
/// ranks' next exchange: <what>", RESOURCE_EXHAUSTED for memory running
/// out (std::bad_alloc, std::length_error), ABORTED for anything else, so
/// that the others throw at once instead of at the group's timeout. As
/// ProcessGroup's collectives, an argument error (another
/// std::logic_error, such as a `root` outside the group, which every rank
/// throws alike) leaves the group usable, and so does what throws once the
/// ranks' last exchange has ended when `after` is kTheCallEnds (nobody
/// waits then); with kTheCallExchangesMore it aborts the group as above,
/// since the others go on to the call's next exchange. Root aborts the
/// group before it waits for a work that such a throw leaves behind, so
/// that the others do not wait for that `stop_grace` first.
std::string RunOnRootWhileOthersWait(ProcessGroup& pg, int root, const StoppableWork& work,
                                     std::chrono::milliseconds timeout, std::chrono::milliseconds heartbeat,
                                     const std::string& call, const std::string& task, const std::string& option,
                                     const std::string& abort_reason,
                                     std::chrono::milliseconds stop_grace = kMostTimeout,
                                     IfTheGroupFails if_the_group_fails = IfTheGroupFails::kLetTheWorkFinish,
                                     AfterTheWait after = AfterTheWait::kTheCallExchangesMore);

/// LoadCheckpoint's wait (exposed for tests): collective; every rank runs
/// `work` on a thread of its own, and the ranks tell each other every
/// `heartbeat` whether any is still going, so that those done first wait
/// for the last, up to `timeout`. Returns this rank's outcome: empty, or
/// what its `work` threw. Past `timeout`, every rank throws
/// std::runtime_error "<task> did not finish on every rank within <option>
/// (N ms)" and the ranks still in `work` abort the group with
/// `abort_reason` and that limit, ask `work` to stop and throw once it
/// ends, or once `stop_grace` has passed (as RunOnRootWhileOthersWait).
/// When the group fails, a rank still in `work` lets it go on until
/// `timeout` or stops it at once, as `if_the_group_fails` says, before it
/// rethrows the group's DistributedError. What throws on one rank alone
/// aborts the group naming `call`, as in RunOnRootWhileOthersWait (past
/// the last exchange only when `after` is kTheCallExchangesMore).
std::string RunOnEveryRankWhileOthersWait(ProcessGroup& pg, const StoppableWork& work,
                                          std::chrono::milliseconds timeout, std::chrono::milliseconds heartbeat,
                                          const std::string& call, const std::string& task,
                                          const std::string& option,
                                          const std::string& abort_reason,
                                          std::chrono::milliseconds stop_grace = kMostTimeout,
                                          IfTheGroupFails if_the_group_fails = IfTheGroupFails::kLetTheWorkFinish,
                                          AfterTheWait after = AfterTheWait::kTheCallExchangesMore);

/// Test only: where SetFaultForTesting's function runs.
enum class FaultPoint {
  /// The collective RestoreCheckpoint, where, after some rank's load
  /// failed and this rank put its state back, it tells the others how its
  /// load went.
  kTellingLoads = 0,
  /// SaveCheckpoint, LoadCheckpoint and LoadCheckpointFromRank, where this
  /// rank makes the buffers to compare the ranks' arguments, before the
  /// first exchange.
  kMakingArgumentBuffers = 1,
  /// The same calls, once the ranks found their arguments refused or
  /// different, where this rank tells the others its own.
  kTellingArguments = 2,
  /// The collective RestoreCheckpoint, as this rank begins its checks,
  /// before the ranks exchange their outcomes.
  kCheckingRestore = 3,
  /// The same call, just before that exchange: a test ends there what its
  /// fault at kCheckingRestore began (memory that ran out comes back).
  kExchangingRestoreChecks = 4,
  /// LoadCheckpoint and LoadCheckpointFromRank, once this rank has read
  /// the checkpoint (or failed to), as it builds its account of what it
  /// read, before the ranks exchange their accounts.
  kAccountingForLoad = 5,
  /// The same calls, just before that exchange: a test ends there what its
  /// fault at kAccountingForLoad began.
  kExchangingLoadAccounts = 6,
  /// LoadCheckpointFromRank, on a rank other than the root, as it makes
  /// room for the bytes the root read, before they are sent.
  kReceivingCheckpoint = 7,
  /// SaveCheckpoint, LoadCheckpoint, LoadCheckpointFromRank and the
  /// collective RestoreCheckpoint, as this rank makes the buffers of an
  /// exchange the others may already be in: the comparison of the
  /// arguments (not in RestoreCheckpoint), then, in the loads, the
  /// exchange of how the read went, and in RestoreCheckpoint, of the
  /// checks' outcomes.
  kMakingFirstBuffers = 8,
  /// SaveCheckpoint, LoadCheckpoint and LoadCheckpointFromRank, as this
  /// rank prepares alone what it needs before the ranks' next exchange:
  /// (1) the comparison of the arguments' messages, (2) once they agreed,
  /// the work's copies, its messages (in LoadCheckpointFromRank, (2) is
  /// root's path and (3) what follows its broadcast), then (3, or 4) in
  /// RunOnRootWhileOthersWait or RunOnEveryRankWhileOthersWait, the status
  /// buffer and the thread.
  kPreparingAlone = 9,
  /// RunOnRootWhileOthersWait and RunOnEveryRankWhileOthersWait, once the
  /// ranks' last exchange has ended, as this rank builds what it returns.
  kAfterTheLastExchange = 10,
  /// RunOnRootWhileOthersWait, on root, once `timeout` has passed and the
  /// work was asked to stop, as root words what it tells the others.
  kRootOutOfTime = 11,
};

/// Test only: from now on, this process runs `fault` at `point`; what
/// `fault` throws stands for what may throw there (memory running out).
/// An empty function: nothing runs.
void SetFaultForTesting(FaultPoint point, std::function<void()> fault);

}  // namespace internal

}  // namespace ddp::dist

#endif  // DDP_DDP_CHECKPOINT_H_
