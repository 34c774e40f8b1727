#include "examples/trainer/trainer.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ddp/trace.h"
#include "examples/trainer/device.h"
#include "examples/trainer/format.h"
#include "examples/trainer/metrics_log.h"
#include "examples/trainer/optimizer.h"
#include "examples/trainer/train_state.h"
#include "examples/trainer/zoo.h"
#include "nn/autograd/engine.h"
#include "nn/data/data_loader.h"
#include "nn/data/sampler.h"
#include "nn/io/atomic_file.h"
#include "nn/io/safetensors.h"
#include "nn/loss/loss.h"
#include "nn/ops/autocast.h"
#include "nn/ops/functional.h"
#include "nn/optim/lr_scheduler.h"

namespace ddp::examples::trainer {
namespace {

// The launcher's next restart of this job, as {restart, of max}, when it
// has one left: ddprun and torchrun give the ranks the failures so far in
// TORCHELASTIC_RESTART_COUNT (train's own launcher, DDP_RESTART_COUNT) and
// the restarts allowed in TORCHELASTIC_MAX_RESTARTS. Nothing when no
// restart was asked, none is left, or a value is not a count: the message
// that uses it then says to resume by hand.
std::optional<std::pair<int, int>> NextLauncherRestart() {
  const auto count = [](const char* name) -> std::optional<int> {
    const char* v = std::getenv(name);
    if (v == nullptr || *v < '0' || *v > '9') return std::nullopt;
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(v, &end, 10);
    if (*end != '\0' || errno != 0 || n > 1000000) return std::nullopt;
    return static_cast<int>(n);
  };
  const std::optional<int> max = count("TORCHELASTIC_MAX_RESTARTS");
  std::optional<int> done = count("TORCHELASTIC_RESTART_COUNT");
  if (!done) done = count("DDP_RESTART_COUNT");
  if (!max || !done || *done >= *max) return std::nullopt;
  return std::make_pair(*done + 1, *max);
}

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Whether `error` is a UsageError: a refusal of the user's flags or paths
// (exit status 2), where anything else is a failure of the run (1).
bool IsUsageError(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const UsageError&) {
    return true;
  } catch (...) {
    return false;
  }
}

// What `error` says, for the other ranks: never empty, since they tell
// "nothing went wrong" by an empty text.
std::string ExceptionText(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what()[0] != '\0' ? e.what() : "an exception without a message";
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// `error` as this rank rethrows it: itself when it is a std::exception
// that says something, else one of its kind (a UsageError, or a JobError)
// that says what it was: an empty what() would leave the rank's line
// without a reason, and an exception that is not a std::exception would
// end the program unreported.
std::exception_ptr Reportable(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    if (e.what()[0] != '\0') return error;
  } catch (...) {
  }
  if (IsUsageError(error)) return std::make_exception_ptr(UsageError(ExceptionText(error)));
  return std::make_exception_ptr(JobError(ExceptionText(error)));
}

// Runs `collective` (a ShareFromLead or GatherFromEveryRank that hands on
// this rank's outcome) and returns what it returns. When it fails (a peer
// lost: JobError) while this rank holds an error of its own (`own`), it
// throws that error's kind (UsageError or JobError) with both reasons: the
// lost collective's alone used to be this rank's line, and its own reason,
// the cause of the run's end, was lost.
// Throws `own`'s kind (UsageError or JobError) with `own`'s reason, adding
// that the collective that was to tell the others failed (`lost`).
[[noreturn]] void ThrowOwnAndLost(const std::exception_ptr& own, const JobError& lost) {
  const std::string both = ExceptionText(own) + " (the other ranks could not be told: " + lost.what() + ")";
  if (IsUsageError(own)) throw UsageError(both);
  throw JobError(both);
}

template <typename F>
auto TellingOthers(const std::exception_ptr& own, F&& collective) -> decltype(collective()) {
  try {
    return collective();
  } catch (const JobError& lost) {
    if (!own) throw;
    ThrowOwnAndLost(own, lost);
  }
}

// Steps at least this long finish each stop vote at once (see Go).
constexpr double kSlowStepS = 0.25;

// --amp on the CPU: the whole model in 16 bits. On CUDA: f32 master
// weights, and autocast runs GEMMs and convolutions in 16 bits
// (AutocastDTypeOf).
nn::DType ComputeDType(const TrainConfig& c) {
  if (c.device == "cuda") return nn::DType::kFloat32;
  if (c.amp == "bf16") return nn::DType::kBFloat16;
  if (c.amp == "fp16") return nn::DType::kFloat16;
  return nn::DType::kFloat32;
}

std::optional<nn::DType> AutocastDTypeOf(const TrainConfig& c) {
  if (c.device != "cuda" || c.amp == "off") return std::nullopt;
  return c.amp == "bf16" ? nn::DType::kBFloat16 : nn::DType::kFloat16;
}

// Rank `rank`'s loader of the training set: its shard, reshuffled each epoch.
std::unique_ptr<nn::data::DataLoader> MakeTrainLoader(const TrainConfig& c, const Datasets& data,
                                                      int rank, int world, int workers) {
  nn::data::DistributedSamplerOptions sampler;
  sampler.num_replicas = world;
  sampler.rank = rank;
  sampler.shuffle = true;
  sampler.seed = c.seed;
  nn::data::DataLoaderOptions options;
  options.batch_size = c.batch_size;
  options.num_workers = workers;
  return std::make_unique<nn::data::DataLoader>(
      data.train, std::make_shared<nn::data::DistributedSampler>(data.train->Size(), sampler),
      data.train_transform, options);
}

std::string OptimizerSummary(const TrainConfig& c) {
  std::string s = c.optimizer + " lr " + StringPrintf("%g", c.lr);
  // A cycled momentum replaces --momentum, and is said with the schedule.
  if ((c.optimizer == "sgd" || c.optimizer == "rmsprop") && c.momentum > 0 && !c.cycle_momentum) {
    s += StringPrintf(" momentum %g", c.momentum);
  }
  if (c.weight_decay > 0) {
    s += StringPrintf(" weight decay %g", c.weight_decay);
    if (!c.decay_norm_and_bias) s += " (none on biases and norms)";
  }
  if (c.scheduler != "none") s += ", " + c.scheduler + " schedule";
  if (c.cycle_momentum) {
    const nn::optim::OneCycleOptions o;
    s += StringPrintf(" with momentum cycled %g-%g-%g", o.max_momentum, o.base_momentum,
                      o.max_momentum);
  }
  if (c.amp != "off") s += ", " + c.amp + " mixed precision";
  return s;
}

// --scheduler's LrScheduler of `optimizer`: over its one rate, every
// group's (EveryGroupsRate), or with --cycle_momentum over the optimizer
// itself, whose momentum the schedule drives too (a bare rate has none).
// Both give every group the same rate; their saved states differ only with
// several groups (a base rate per group), and only runs with the flag save
// the second, which a resume with the other value refuses first.
std::unique_ptr<nn::optim::LrScheduler> MakeScheduler(nn::optim::Optimizer& optimizer,
                                                      std::shared_ptr<RunSchedule> schedule) {
  if (schedule->CyclesMomentum()) {
    return std::make_unique<nn::optim::LrScheduler>(optimizer, std::move(schedule));
  }
  return std::make_unique<nn::optim::LrScheduler>(EveryGroupsRate(optimizer), std::move(schedule));
}

// Global training throughput over the last few steps, for the live bar.
class RecentRate {
 public:
  void Add(Clock::time_point end, double samples) {
    window_.emplace_back(end, samples);
    while (window_.size() > 2 && end - window_.front().first > std::chrono::seconds(3)) {
      window_.pop_front();
    }
  }
  void Reset() { window_.clear(); }
  // Samples per second between the oldest and newest entries.
  double Rate() const {
    if (window_.size() < 2) return NAN;
    double samples = 0;
    for (size_t i = 1; i < window_.size(); ++i) samples += window_[i].second;
    const double dt = Seconds(window_.back().first - window_.front().first);
    return dt > 0 ? samples / dt : NAN;
  }
  // Seconds per step over the window.
  double StepTime() const {
    if (window_.size() < 2) return NAN;
    return Seconds(window_.back().first - window_.front().first) / (window_.size() - 1);
  }

 private:
  std::deque<std::pair<Clock::time_point, double>> window_;
};

// Makes folder `dir` and every missing one above it, as
// create_directories does, and appends to `made` (when given) those this
// call made itself, outermost first: not one that was there, nor one that
// another process made meanwhile. Returns the error of the first that
// could not be made.
std::error_code MakeFolders(const std::string& dir, std::vector<std::string>* made) {
  std::error_code ec;
  std::vector<std::filesystem::path> missing;  // deepest first
  for (std::filesystem::path p = dir; !p.empty(); p = p.parent_path()) {
    if (std::filesystem::exists(p, ec) || ec) break;
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    const bool new_folder = std::filesystem::create_directory(*it, ec);
    if (ec) return ec;
    if (new_folder && made != nullptr) made->push_back(it->string());
  }
  // Made by someone else meanwhile, or there all along: whether it is a
  // folder is what the write test below finds out.
  std::filesystem::create_directories(dir, ec);
  return ec;
}

// Removes the folders of `made` (MakeFolders' list, outermost first),
// deepest first, each only while it is empty: one that something was put
// into meanwhile stays, and so does every folder above it.
void RemoveFoldersMade(const std::vector<std::string>& made) {
  for (auto it = made.rbegin(); it != made.rend(); ++it) ::rmdir(it->c_str());
}

// Why no file can be created in a folder: "" when one can.
struct FolderProblem {
  std::string why;  ///< "folder DIR: ..." with the system's reason
  /// The host's failure (out of file handles, a full disk, an I/O error),
  /// not the path's: the run fails (exit status 1) rather than refusing
  /// its flags (2), and "choose a writable path" would be no answer.
  bool host_failure = false;
};

// Whether errno `err` from making a folder or a file in it is the host's
// failure rather than the path's (a read-only filesystem, no permission,
// no such place): see FolderProblem.
bool IsHostFailure(int err) {
  return err == EMFILE || err == ENFILE || err == ENOSPC || err == EDQUOT || err == EIO || err == ENOMEM;
}

// Why no file can be created in `dir` (made if missing; those made are
// appended to `made`, when given, see MakeFolders).
FolderProblem UnwritableFolder(const std::string& dir, std::vector<std::string>* made = nullptr) {
  const std::error_code ec = MakeFolders(dir, made);
  if (ec) {
    // A file where a folder must be (the folder itself, or one above it):
    // named, where "folder a/b/c: Not a directory" left the user to find
    // which one.
    if (std::string file = FileWhereAFolderMustBe(dir); !file.empty()) return {file};
    return {"folder " + dir + ": " + ec.message(), IsHostFailure(ec.value())};
  }
  const std::string probe = dir + "/.ddp_train_write_test." + std::to_string(getpid());
  std::FILE* f = std::fopen(probe.c_str(), "we");  // "e": O_CLOEXEC
  if (f == nullptr) {
    const int err = errno;
    if (IsHostFailure(err)) return {"folder " + dir + ": no file could be created there: " + std::strerror(err), true};
    return {"folder " + dir + ": not writable (" + std::strerror(err) + ")"};
  }
  std::fclose(f);
  std::remove(probe.c_str());
  return {};
}

// What `path` is when it exists, through symbolic links, but is not a
// regular file ("a FIFO"); "" when it is absent or a regular file. The
// trainer's outputs are written beside their path and renamed over it,
// which nn::io refuses for anything but a regular file: found only at the
// first save or chart, after training, and a FIFO at --checkpoint was taken
// for another run's checkpoint and linked to <stem>.prev first.
std::string NonRegularKind(const std::string& path) {
  std::error_code ec;
  switch (std::filesystem::status(path, ec).type()) {
    case std::filesystem::file_type::directory:
      return "a folder";
    case std::filesystem::file_type::fifo:
      return "a FIFO";
    case std::filesystem::file_type::socket:
      return "a socket";
    case std::filesystem::file_type::block:
      return "a block device";
    case std::filesystem::file_type::character:
      return "a character device";
    case std::filesystem::file_type::unknown:
      return "not a file";
    default:
      return "";  // absent, regular, or not looked at (the write reports why)
  }
}

// "stdout" or "stderr" when `path`, through links, is the regular file that
// this process's stdout or stderr writes to (a link to /dev/stdout under
// `> out.txt`); else "". Replacing it would lose what was written there,
// and the output after it would go to a file no longer in any folder.
std::string OwnOutputAt(const std::string& path) {
  struct stat target{};
  if (::stat(path.c_str(), &target) != 0 || !S_ISREG(target.st_mode)) return "";
  for (const auto& [fd, name] : {std::pair<int, const char*>{STDOUT_FILENO, "stdout"}, {STDERR_FILENO, "stderr"}}) {
    struct stat own{};
    if (::fstat(fd, &own) == 0 && own.st_dev == target.st_dev && own.st_ino == target.st_ino) return name;
  }
  return "";
}

// Throws UsageError unless files can be created in `dir` (made if missing;
// see MakeFolders for `made`), so that an unwritable --checkpoint or
// --log_dir fails now, not after an epoch of training; std::runtime_error
// when the host is at fault (FolderProblem::host_failure).
void CheckWritable(const std::string& dir, const char* flag, const std::string& value,
                   std::vector<std::string>* made) {
  const FolderProblem problem = UnwritableFolder(dir, made);
  if (problem.why.empty()) return;
  const std::string line = std::string("cannot write --") + flag + "=" + value + " (" + problem.why + ")";
  if (problem.host_failure) throw std::runtime_error(line);
  throw UsageError(line + "; choose a writable path" +
                   (std::string(flag) == "checkpoint" ? ", or --checkpoint=none" : ""));
}

// This rank's --trace file in `folder`, as DDP names it.
std::string TraceFile(const std::string& folder, int rank) {
  return folder + "/trace_rank" + std::to_string(rank) + ".json";
}

// Throws UsageError unless this rank can write its --trace file into
// `folder` (its --log_dir, or the working directory): the trace is written
// when the rank ends, and a folder found unwritable only then would cost the
// trace of a whole run. Every rank writes its own, on its own host. A
// trace file that is a FIFO or a terminal is streamed (DDP opens it at the
// start, waiting a bounded time for its reader): it takes that one rank's
// trace, and is never replaced. std::runtime_error when the host is at
// fault (FolderProblem::host_failure).
void CheckTraceFolder(const TrainConfig& config, const std::string& folder, int rank) {
  if (!config.trace || folder.empty()) return;
  const std::string where = config.log_dir.empty() ? std::string("the working directory")
                                                   : "--log_dir=" + config.log_dir;
  if (const FolderProblem problem = UnwritableFolder(folder); !problem.why.empty()) {
    const std::string line = "--trace cannot write this rank's trace into " + where + " (" + problem.why + ")";
    if (problem.host_failure) throw std::runtime_error(line);
    throw UsageError(line + "; " +
                     (config.log_dir.empty() ? "run from a writable folder, or pass a writable --log_dir"
                                             : std::string("pass a writable --log_dir")) +
                     ", or drop --trace");
  }
  const std::string file = TraceFile(folder, rank);
  if (dist::TraceRecorder::IsStreamTarget(file)) return;
  if (const std::string kind = NonRegularKind(file); !kind.empty()) {
    throw UsageError("--trace cannot write this rank's trace into " + where + ": " + file + " is " +
                     kind + ", not a regular file, and the trace would replace it; move it away, " +
                     (config.log_dir.empty() ? "run from another folder, pass a --log_dir"
                                             : std::string("pass another --log_dir")) +
                     ", or drop --trace");
  }
}

// Throws UsageError when --checkpoint names a folder (an existing one, or a
// path ending in '/'): the save would fail only at the end of the first
// epoch.
void CheckCheckpointIsAFile(const TrainConfig& config) {
  const std::string& path = config.checkpoint;
  if (path.empty()) return;
  const bool slash = path.back() == '/';
  std::error_code ec;
  if (!slash && !std::filesystem::is_directory(path, ec)) return;
  const std::string folder = slash ? path.substr(0, path.size() - 1) : path;
  throw UsageError("--checkpoint=" + path + (slash ? " ends in '/'" : " is a folder") +
                   "; it names the checkpoint file itself: pass --checkpoint=" + folder + "/" +
                   config.model + "_" + config.dataset + ".safetensors, for example, or "
                   "--checkpoint=none");
}

// The bounded looks below (at --checkpoint's header, at --log_dir's
// metrics, a restart's read) run on threads of their own, left running
// once their caller gives up; this counts those not yet done with their
// work. Constant-initialised and trivially destructible: read while the
// process exits.
constinit std::atomic<int> looks_running{0};

// exit()'s handler while a look left behind may still run: a read that
// returns once exit() has begun destroying the program's statics (nn/io's
// tables, the test seams' state, the C++ runtime's own) would run on in
// what is being torn down, undefined behaviour that could crash over the
// exit status just reported. The process ends at once instead, with that
// status and its stdio flushed: the look's own state (shared_ptr) and the
// file it reads need no teardown, and the run's own files were closed as
// the run ended. What is lost: exit handlers registered before this one
// (the rendezvous store's stderr log flushes its queued lines so, for at
// most 200 ms), and only at an exit with a look still hung.
void EndAtOnceIfALookRuns(int status, void* /*unused*/) {
  if (looks_running.load() == 0) return;
  std::fflush(nullptr);
  ::_exit(status);
}

// Runs `work` on a thread of its own, detached, counted in looks_running
// until it returns. Throws what std::thread throws (std::system_error:
// no thread left, RLIMIT_NPROC), counting nothing.
void StartLook(std::function<void()> work) {
  looks_running.fetch_add(1);
  try {
    std::thread([work = std::move(work)] {
      work();
      looks_running.fetch_sub(1);
    }).detach();
  } catch (...) {
    looks_running.fetch_sub(1);
    throw;
  }
}

// Said by a caller that gives up on its look: from then on, an exit while
// it still runs ends the process at once (EndAtOnceIfALookRuns). Registered
// at each give-up, so that it runs before the destructors of the statics
// made so far (exit() runs its handlers last registered first); a handler
// that cannot be registered leaves the exit as it was.
void LeaveLookBehind() { (void)::on_exit(&EndAtOnceIfALookRuns, nullptr); }

// The folders rank 0 writes into: --checkpoint's and --log_dir (made if
// missing; those made are appended to `made`, when given, outermost
// first). Throws UsageError.
// IsAnotherRunsCheckpoint(config.checkpoint, config.job), read on a thread
// of its own for at most half of --timeout_s: a read hung in the
// filesystem (a stale network mount, a FIFO put at the path) held rank 0
// with no deadline while the others failed at theirs, not knowing why.
// With `kind`, also what the file is (KeptFileKind), when another run's,
// within the same time. Empty past the deadline, within the time the
// others wait for rank 0's word. A read left behind owns what it uses.
// The most a stop waits for that look (KeepAnotherRunsCheckpoint): half
// of the default --timeout_s, 150 s, outlasted a launcher's grace between
// SIGTERM and SIGKILL (ddprun's and torchrun's are 30 s), and the stop was
// killed before its line. Leaves the rest of the grace to the step.
constexpr std::chrono::seconds kStopLookLimit{10};

// How long rank 0 looks at the file at --checkpoint: half of --timeout_s,
// and at a stop at most kStopLookLimit.
std::chrono::milliseconds LookWait(const TrainConfig& config, bool at_stop) {
  const std::chrono::milliseconds half(config.timeout_s * 500);
  return at_stop ? std::min<std::chrono::milliseconds>(half, kStopLookLimit) : half;
}

// Where a fresh run's first save would keep the file at --checkpoint
// (FreePreviousCheckpointPath), looked up by the same bounded look: its
// lstat of each .prev name, hung in the filesystem, held rank 0 with no
// deadline too.
struct KeptName {
  std::string path;
  bool too_long = false;  // the folder cannot hold a name that long (ENAMETOOLONG)
};

std::optional<bool> LookAtAnotherRunsCheckpointWithin(const TrainConfig& config, std::string* kind = nullptr,
                                                      bool at_stop = false, KeptName* kept = nullptr) {
  struct Look {
    std::mutex mu;
    std::condition_variable done_cv;
    bool done = false;
    bool another = false;
    std::string kind;
    KeptName kept;
  };
  const auto look = std::make_shared<Look>();
  StartLook([look, path = config.checkpoint, job = config.job, want_kind = kind != nullptr,
             want_kept = kept != nullptr] {
    const bool another = IsAnotherRunsCheckpoint(path, job);
    const std::string what = another && want_kind ? KeptFileKind(path) : "";
    KeptName name;
    if (another && want_kept) {
      name.path = FreePreviousCheckpointPath(path);
      struct stat st{};
      name.too_long = ::lstat(name.path.c_str(), &st) != 0 && errno == ENAMETOOLONG;
    }
    std::lock_guard lock(look->mu);
    look->another = another;
    look->kind = what;
    look->kept = std::move(name);
    look->done = true;
    look->done_cv.notify_all();
  });
  const auto wait = LookWait(config, at_stop);
  std::unique_lock lock(look->mu);
  if (!look->done_cv.wait_for(lock, wait, [&look] { return look->done; })) {
    LeaveLookBehind();
    return std::nullopt;
  }
  if (kind != nullptr) *kind = look->kind;
  if (kept != nullptr) *kept = look->kept;
  return look->another;
}

// How a look past its deadline is told: the file, and the time waited.
std::string UnreadHeader(const TrainConfig& config, bool at_stop = false) {
  const std::chrono::milliseconds wait = LookWait(config, at_stop);
  return StringPrintf("cannot read the header of --checkpoint=%s within %s (%s), to tell whose file it is",
                      config.checkpoint.c_str(), FormatSeconds(wait.count() / 1000.0).c_str(),
                      wait < std::chrono::milliseconds(config.timeout_s * 500)
                          ? "the most a stop waits, to end within a launcher's grace"
                          : "half of --timeout_s");
}

// LookAtAnotherRunsCheckpointWithin, throwing JobError naming the file past
// the deadline.
bool IsAnotherRunsCheckpointWithin(const TrainConfig& config, std::string* kind = nullptr,
                                   KeptName* kept = nullptr) {
  const std::optional<bool> another = LookAtAnotherRunsCheckpointWithin(config, kind, /*at_stop=*/false, kept);
  if (!another) {
    throw JobError(UnreadHeader(config) +
                   (kept != nullptr ? ", or to find the name beside it (" +
                                          PreviousCheckpointPath(config.checkpoint, 1) + ", ...) that keeps it"
                                    : "") +
                   ": its disk may hang; pass a --checkpoint on a working disk, or a longer --timeout_s");
  }
  return *another;
}

// MetricsLog(config.log_dir, ...), made on a thread of its own for at most
// half of --timeout_s: its looks at metrics.csv and metrics.run (a resume
// reads every row) hung in the filesystem held rank 0 with no deadline
// while the others failed at theirs, not knowing why. Past it, throws
// JobError naming the files; the construction left behind owns what it
// uses. Its own exceptions are rethrown as they are.
std::unique_ptr<MetricsLog> OpenMetricsLogWithin(const TrainConfig& config, std::string title, std::string subtitle,
                                                 int64_t resume_step, bool resume_at_epoch_end, std::string run) {
  struct Open {
    std::mutex mu;
    std::condition_variable done_cv;
    bool done = false;
    std::unique_ptr<MetricsLog> log;
    std::exception_ptr error;
  };
  const auto open = std::make_shared<Open>();
  StartLook([open, dir = config.log_dir, title = std::move(title), subtitle = std::move(subtitle), resume_step,
             resume_at_epoch_end, run = std::move(run)] {
    std::unique_ptr<MetricsLog> log;
    std::exception_ptr error;
    try {
      log = std::make_unique<MetricsLog>(dir, title, subtitle, resume_step, resume_at_epoch_end, run);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard lock(open->mu);
    open->log = std::move(log);
    open->error = error;
    open->done = true;
    open->done_cv.notify_all();
  });
  const auto wait = std::chrono::milliseconds(config.timeout_s * 500);
  std::unique_lock lock(open->mu);
  if (!open->done_cv.wait_for(lock, wait, [&open] { return open->done; })) {
    LeaveLookBehind();
    throw JobError(StringPrintf("--log_dir=%s: cannot %s %s/metrics.csv and %s/metrics.run within %s (half of "
                                "--timeout_s): its disk may hang; pass a --log_dir on a working disk, or a longer "
                                "--timeout_s",
                                config.log_dir.c_str(), resume_step >= 0 ? "read" : "look at",
                                config.log_dir.c_str(), config.log_dir.c_str(),
                                FormatSeconds(config.timeout_s * 0.5).c_str()));
  }
  if (open->error) std::rethrow_exception(open->error);
  return std::move(open->log);
}

void CheckOutputFolders(const TrainConfig& config, std::vector<std::string>* made = nullptr) {
  if (!config.checkpoint.empty()) {
    // A symbolic link at --checkpoint is written through (nn::io's atomic
    // writer): its target's folder is the one that must be writable.
    std::string target;
    try {
      target = nn::io::AtomicWriteTarget(config.checkpoint);
    } catch (const nn::io::CheckpointError& e) {
      throw UsageError("cannot write --checkpoint=" + config.checkpoint + " (" + e.what() +
                       "); choose a writable path, or --checkpoint=none");
    }
    if (const std::string kind = NonRegularKind(target); !kind.empty()) {
      throw UsageError("--checkpoint=" + config.checkpoint +
                       (target == config.checkpoint ? " is " : " leads to " + target + ", ") + kind +
                       ", not a regular file, and each save would replace it; pass the path of a "
                       "checkpoint file (new or old), or --checkpoint=none");
    }
    const std::string parent = std::filesystem::path(target).parent_path().string();
    CheckWritable(parent.empty() ? "." : parent, "checkpoint", config.checkpoint, made);
    // The file itself, in a folder that takes files: a name the filesystem
    // refuses (longer than NAME_MAX) is otherwise "there" to the look for
    // another run's checkpoint, and fails only at the first save.
    struct stat st{};
    const int err = ::lstat(target.c_str(), &st) == 0 ? 0 : errno;
    if (IsHostFailure(err) || err == ESTALE) {
      // The disk's failure (EIO, ENOMEM, a stale network handle), not the
      // path's: the run fails (exit status 1), and "choose a writable
      // path" would send the user after a path that may be right.
      throw std::runtime_error("cannot look at --checkpoint=" + config.checkpoint + " (" + target + ": " +
                               std::strerror(err) + "): the host failed, not the path; retry once it has "
                               "recovered, or pass a --checkpoint on a working disk");
    }
    if (err != 0 && err != ENOENT) {
      throw UsageError("cannot write --checkpoint=" + config.checkpoint + " (" + target + ": " +
                       std::strerror(err) + "); choose a writable path, or --checkpoint=none");
    }
    // Another run's file there is kept under a longer name before the
    // first save (KeepAsPreviousCheckpoint): one past NAME_MAX would fail
    // only then, after training.
    KeptName kept_name;
    if (err == 0 && !config.resume && IsAnotherRunsCheckpointWithin(config, nullptr, &kept_name)) {
      const std::string& kept = kept_name.path;
      if (kept_name.too_long) {
        throw UsageError("--checkpoint=" + config.checkpoint + " holds another run's file, which this run would "
                         "keep as " + kept + " before its first save, and that name cannot be made (" +
                         std::strerror(ENAMETOOLONG) + "); pass a shorter --checkpoint path, or move that "
                         "file away");
      }
    }
  }
  if (!config.log_dir.empty()) {
    CheckWritable(config.log_dir, "log_dir", config.log_dir, made);
    for (const std::string name : {"metrics.csv", "chart.svg", "metrics.run"}) {
      const std::string file = config.log_dir + "/" + name;
      const std::string kind = NonRegularKind(file);
      // A FIFO or a terminal at metrics.csv is a stream of its rows
      // (MetricsLog), written into, never replaced.
      if (name == "metrics.csv" && MetricsLog::IsStream(file)) continue;
      if (const std::string own = OwnOutputAt(file); !own.empty()) {
        throw UsageError("--log_dir=" + config.log_dir + ": " + file + " is this run's " + own +
                         ", a regular file, and the run would replace it with its " + name +
                         " (and lose what was written there); pass another --log_dir, or send " + own +
                         " into a pipe (| tee FILE), where metrics.csv streams");
      }
      if (!kind.empty()) {
        throw UsageError("--log_dir=" + config.log_dir + ": " + file + " is " + kind +
                         ", not a regular file, and the run would replace it with its " + name +
                         "; move it away, or pass another --log_dir" +
                         (name == "metrics.csv" ? " (a named pipe or a terminal there takes the rows as a stream)"
                                                : ""));
      }
    }
  }
}

// While it lives, this process's claim on one checkpoint file for this
// host: an abstract Unix socket named after the file's absolute path. Two
// runs saving to one file would replace each other's saves (and a resume
// would continue whichever wrote last); the kernel drops the claim however
// the process ends, and it leaves no file behind. Where no socket can be
// made, nothing is claimed. Throws UsageError when another process holds it.
class CheckpointClaim {
 public:
  CheckpointClaim() = default;
  explicit CheckpointClaim(const std::string& checkpoint) {
    std::error_code ec;
    const std::string target = nn::io::AtomicWriteTarget(checkpoint);
    const std::filesystem::path absolute = std::filesystem::absolute(target, ec);
    if (ec) return;
    const std::string name = "ddp-train-checkpoint:" +
                             std::to_string(std::hash<std::string>{}(absolute.lexically_normal().string()));
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path + 1, name.data(), name.size());  // sun_path[0] == 0: abstract
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), length) == 0) {
      fd_ = fd;
      return;
    }
    const int error = errno;
    ::close(fd);
    if (error != EADDRINUSE) return;
    throw UsageError("--checkpoint=" + checkpoint + " is in use: another run on this host saves to it "
                     "now; wait for that run to end, or pass another --checkpoint (or --checkpoint=none)");
  }
  ~CheckpointClaim() {
    if (fd_ >= 0) ::close(fd_);
  }
  CheckpointClaim(const CheckpointClaim&) = delete;
  CheckpointClaim& operator=(const CheckpointClaim&) = delete;
  CheckpointClaim& operator=(CheckpointClaim&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }

 private:
  int fd_ = -1;
};

struct Evaluation {
  double loss = 0;
  double accuracy = 0;
  /// A rank stopped early on a signal: the figures cover part of the set.
  bool interrupted = false;
};

class Run {
 public:
  Run(const TrainConfig& c, Parallel& par, const RunOptions& opt)
      : c_(c),
        par_(par),
        opt_(opt),
        rank_(par.rank()),
        world_(par.world_size()),
        lead_(par.rank() == 0),
        start_(opt.start_time.value_or(Clock::now())),
        console_(opt.out, opt.console.value_or(DetectConsoleOptions(opt.out))) {}

  RunResult Go();

 private:
  void Setup();
  void Say(const std::string& line) {
    if (lead_ && !opt_.quiet) console_.Line(line);
  }
  // Writes to the metrics log (rank 0's). A failure (a full disk) turns
  // the log off with a warning instead of ending rank 0 alone while the
  // others wait in their next collective.
  template <typename F>
  void Log(F&& write) {
    if (log_ == nullptr) return;
    try {
      write(*log_);
    } catch (const std::exception& e) {
      log_.reset();
      if (!opt_.quiet) console_.Line(std::string("warning: ") + e.what() + "; metrics are no longer logged");
    }
  }
  // Collective: every rank passes what its own checks threw (null for
  // nothing), found on it alone (its GPU, its folders). Returns when no
  // rank threw; else every rank throws at once instead of waiting for the
  // failing one until --timeout_s: a rank that threw rethrows its own
  // exception, and the others throw the lowest such rank's reason as "rank
  // R cannot go on: ...", a UsageError when that rank refused its input (a
  // UsageError: exit status 2), a JobError when it failed otherwise (out
  // of memory, an I/O error: exit status 1).
  void StopIfAnyRankCannotGoOn(const std::exception_ptr& mine);
  int StopSignal() const { return opt_.stop != nullptr ? opt_.stop->load() : 0; }
  // Whether a stop signal arrived by now or arrives within `grace`.
  bool AwaitStopSignal(std::chrono::milliseconds grace) const {
    const Clock::time_point until = Clock::now() + grace;
    while (StopSignal() == 0 && opt_.stop != nullptr && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return StopSignal() != 0;
  }
  // Trains one optimizer step on up to grad_accum_steps micro-batches;
  // false at the end of the epoch's data.
  bool TrainStep(nn::data::DataLoader& loader);
  // Sums the loss of the current logging stretch over the ranks and writes
  // the CSV row. Collective.
  void FlushMetrics();
  Evaluation Evaluate();
  // Keeps `e` unless it was interrupted (then returns false: the ranks
  // stop, see StopNow).
  bool RecordEvaluation(const Evaluation& e, int64_t epoch_number);
  // On --resume: the evaluation the run before was to make at the
  // checkpoint's step (an epoch end, a multiple of --eval_every), made now
  // if metrics.csv lacks it, or with no --log_dir at all. The checkpoint is
  // saved before that evaluation, which a signal cuts short; the resumed run
  // then starts past it. Returns the agreed stop signal if this evaluation
  // is interrupted in turn.
  int EvaluateMissedAtResume();
  // --scheduler=plateau: takes the epoch's metric (a test or train loss).
  // Returns the line that says it lowered the rate ("" when it did not).
  std::string StepPlateau(double metric);
  // On --resume at an epoch's end with --scheduler=plateau: the checkpoint
  // was saved before that epoch's evaluation, whose test loss the plateau
  // then took; it takes it now (evaluating again when the evaluation was
  // not just made). Returns the agreed stop signal if the evaluation is
  // interrupted.
  int StepPlateauMissedAtResume();
  // A stop vote that every rank waits for (after an interrupted
  // evaluation, which every rank learns of together): the agreed signal.
  int StopNow();
  // Collective: whether a stop should leave the checkpoint file alone (see
  // Go); rank 0 decides.
  bool KeepAnotherRunsCheckpoint();
  // Collective: all ranks call it at the same step.
  void SaveCheckpoint();
  double Lr() const { return sharded_ ? sharded_->lr() : optimizer_->lr(); }
  // What a checkpoint saves and restores (not a sharded optimizer's state).
  TrainComponents Components() const {
    TrainComponents parts{model_.get(), optimizer_.get(), scheduler_.get(), scaler_.get()};
    parts.train_size = data_.train->Size();
    parts.schedule = schedule_.get();
    parts.batches_per_epoch = batches_per_epoch_;
    parts.bucket_order = par_.BucketOrder();
    parts.powersgd = par_.PowerSgd();
    parts.plateau = plateau_.get();
    return parts;
  }
  bool StepLimitReached() const { return c_.max_steps > 0 && pos_.step >= c_.max_steps; }
  bool AtEpochStart() const { return pos_.batch_in_epoch == 0 && pos_.epoch_start == 0; }
  // Resumed where an epoch ended: at an epoch start past the first, and not
  // one that LoadTrainCheckpoint moved to past an abandoned epoch (saved
  // mid-epoch, resumed with another sample order), which never ended.
  bool AtEpochEndResumed() const {
    return AtEpochStart() && pos_.epoch > 0 && pos_.untrained_epochs == 0;
  }
  // Steps of the current epoch trained before its first batch in this data
  // order (a resume past its start on other ranks): the whole epoch's
  // steps less those left in it, so that progress counts up to
  // steps_per_epoch_. Call after the sampler's start is set.
  int64_t StepsBeforeStart() const {
    if (pos_.epoch_start == 0) return 0;
    const int64_t accum = c_.grad_accum_steps;
    const int64_t left = (train_loader_->NumBatches() + accum - 1) / accum;
    return std::max<int64_t>(0, steps_per_epoch_ - left);
  }

  const TrainConfig& c_;
  Parallel& par_;
  const RunOptions& opt_;
  const int rank_;
  const int world_;
  const bool lead_;
  const Clock::time_point start_;
  Console console_;

  Datasets data_;
  std::shared_ptr<nn::modules::Module> model_;
  nn::DType compute_dtype_ = nn::DType::kFloat32;
  nn::Device device_ = nn::kCPU;  // --device; cuda:LOCAL_RANK modulo the GPUs
  std::optional<nn::DType> autocast_dtype_;  // --amp on CUDA
  // One of the two: an optimizer of every parameter, or with --zero one
  // sharded across the ranks.
  std::unique_ptr<nn::optim::Optimizer> optimizer_;
  std::unique_ptr<Parallel::ShardedOptimizer> sharded_;
  std::shared_ptr<RunSchedule> schedule_;  // scheduler_'s (null without one)
  std::unique_ptr<nn::optim::LrScheduler> scheduler_;
  std::unique_ptr<nn::optim::ReduceLrOnPlateau> plateau_;  // --scheduler=plateau
  std::unique_ptr<nn::optim::GradScaler> scaler_;
  std::unique_ptr<nn::data::DataLoader> train_loader_;
  std::unique_ptr<nn::data::DataLoader> test_loader_;
  std::unique_ptr<MetricsLog> log_;
  nn::loss::CrossEntropyLoss loss_fn_;

  TrainPosition pos_;
  int64_t steps_per_epoch_ = 0;
  // The last training step's wall time on this rank (rank 0's decides
  // whether stop votes are finished at once; see Go).
  double last_step_s_ = 0;
  // Micro-batches per rank of a whole epoch; the loader's NumBatches() is
  // fewer in an epoch resumed past its start (pos_.epoch_start).
  int64_t batches_per_epoch_ = 0;
  nn::data::DistributedSampler* train_sampler_ = nullptr;  // train_loader_'s
  int64_t steps_this_process_ = 0;

  // Logging stretch (this rank): losses since the last flush, each batch's
  // mean times its samples, and the samples.
  double stretch_loss_sum_ = 0;
  int64_t stretch_loss_count_ = 0;
  double stretch_train_s_ = 0;
  double stretch_samples_ = 0;
  int64_t last_flushed_step_ = -1;
  // The learning rate the last TrainStep trained with.
  double last_step_lr_ = NAN;

  // Rank 0's progress display: local running loss of the epoch (weighted
  // as the stretch's).
  double shown_loss_sum_ = 0;
  int64_t shown_loss_count_ = 0;
  RecentRate rate_;

  // Throughput: training time and samples after the warm-up steps.
  static constexpr int64_t kWarmupSteps = 5;
  double measured_s_ = 0;
  double measured_samples_ = 0;
  int64_t measured_steps_ = 0;
  CommTotals warmup_comm_;  // DDP's totals at the end of the warm-up steps
  double all_steps_s_ = 0;
  double all_samples_ = 0;

  std::optional<Evaluation> last_eval_;
  int64_t last_eval_step_ = -1;
  double last_epoch_train_loss_ = NAN;
  // Rank 0: held from the start to the end of the run.
  CheckpointClaim checkpoint_claim_;
  std::string checkpoint_saved_;
  int64_t checkpoint_saved_step_ = -1;
  int64_t last_checkpoint_step_ = -1;
  // Rank 0, a fresh run: --checkpoint held another run's checkpoint at the
  // start, to be kept under a PreviousCheckpointPath name at this run's first save
  // (the default path is the same for every run of a model and dataset).
  bool keep_previous_ = false;
  // What keep_previous_'s file is (KeptFileKind), for the messages.
  std::string kept_kind_ = "another run's checkpoint";
  // KeepAnotherRunsCheckpoint kept the file because rank 0 could not read
  // its header in time (rank 0 only).
  bool kept_unread_ = false;
  // Why KeepAnotherRunsCheckpoint's look could not start, when it kept the
  // file for that (rank 0 only).
  std::string kept_unlooked_;
};

// What every rank must share: the flags that shape the run, and the data
// each rank loaded. Under ddprun, srun or mpirun each rank parses its own
// command line and reads its own copy of the data (another folder, another
// --train_samples in a wrapper script); ranks that differ would train on
// different things silently, or run different collectives and wait for
// each other until --timeout_s. "name\tvalue" lines, in a fixed order.
std::string SharedSettings(const TrainConfig& c, const Datasets& d) {
  auto flag = [](bool v) { return std::string(v ? "true" : "false"); };
  auto data = [](const nn::data::Dataset& set) {
    // The labels' FNV-1a hash: a copy of another dataset, or one cut at
    // another place, with the same counts and shape still differs.
    uint64_t hash = 1469598103934665603ull;
    for (int64_t i = 0; i < set.Size(); ++i) {
      hash = (hash ^ static_cast<uint64_t>(set.Label(i))) * 1099511628211ull;
    }
    return set.Name() + ", " + std::to_string(set.Size()) + " samples of " + set.Shape().ToString() + ", " +
           std::to_string(set.NumClasses()) + " classes, labels hash " +
           StringPrintf("%016llx", static_cast<unsigned long long>(hash));
  };
  const std::pair<std::string, std::string> settings[] = {
      {"--model", c.model},
      {"--dataset", c.dataset},
      {"--train_samples", std::to_string(c.train_samples)},
      {"--test_samples", std::to_string(c.test_samples)},
      {"--seed", std::to_string(c.seed)},
      {"--epochs", std::to_string(c.epochs)},
      {"--max_steps", std::to_string(c.max_steps)},
      {"--batch_size", std::to_string(c.batch_size)},
      {"--grad_accum_steps", std::to_string(c.grad_accum_steps)},
      {"--eval_every", std::to_string(c.eval_every)},
      {"--log_every", std::to_string(c.log_every)},
      {"--optimizer", c.optimizer},
      {"--lr", ExactDouble(c.lr)},
      {"--momentum", ExactDouble(c.momentum)},
      {"--weight_decay", ExactDouble(c.weight_decay)},
      {"--decay_norm_and_bias", flag(c.decay_norm_and_bias)},
      {"--scheduler", c.scheduler},
      {"--lr_gamma", c.lr_gamma ? ExactDouble(*c.lr_gamma) : "default"},
      {"--lr_milestones", FormatMilestones(c.lr_milestones)},
      {"--lr_t0", std::to_string(c.lr_t0)},
      {"--lr_t_mult", std::to_string(c.lr_t_mult)},
      {"--lr_patience", std::to_string(c.lr_patience)},
      {"--cycle_momentum", flag(c.cycle_momentum)},
      {"--amp", c.amp},
      {"--device", c.device},
      // Subnormals flushed on one rank and kept on another: the same
      // update gives other values, and the replicas drift apart.
      {"--flush_denormal", flag(c.flush_denormal)},
      {"--sync_bn", flag(c.sync_bn)},
      {"--zero", flag(c.zero)},
      {"--zero_overlap", flag(c.zero_overlap)},
      {"--bucket_cap_mb", ExactDouble(c.bucket_cap_mb)},
      {"--comm_hook", c.comm_hook},
      {"--powersgd_start_step", std::to_string(c.powersgd_start_step)},
      {"--timeout_s", std::to_string(c.timeout_s)},
      {"--find_unused_parameters", flag(c.find_unused_parameters)},
      {"--ddp_stats", flag(c.ddp_stats)},
      {"--trace", flag(c.trace)},
      // Whether checkpoints are saved, not where: only rank 0 writes, and
      // the others' paths may differ. A rank without one skips the saves'
      // collectives that the others wait in.
      {"--checkpoint", c.checkpoint.empty() ? "none" : "PATH"},
      {"--checkpoint_every", std::to_string(c.checkpoint_every)},
      // Each rank waits for rank 0's write or read this long: one with a
      // shorter deadline fails the job on a save that the others wait for.
      {"--save_timeout_s", std::to_string(c.save_timeout_s)},
      {"--save_stop_grace_s", std::to_string(c.save_stop_grace_s)},
      {"--resume", flag(c.resume)},
      {"training data", data(*d.train)},
      {"test data", data(*d.test)},
  };
  std::string lines;
  for (const auto& [name, value] : settings) lines += name + "\t" + value + "\n";
  return lines;
}

// The first setting in which `mine` differs from rank 0's `lead`, as
// "--batch_size=32 but rank 0 with --batch_size=64"; empty when none.
std::string FirstDifference(const std::string& mine, const std::string& lead) {
  auto lines = [](const std::string& text) {
    std::vector<std::pair<std::string, std::string>> out;
    size_t start = 0;
    for (size_t end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
      const std::string line = text.substr(start, end - start);
      const size_t tab = line.find('\t');
      out.emplace_back(line.substr(0, tab), tab == std::string::npos ? "" : line.substr(tab + 1));
    }
    return out;
  };
  auto shown = [](const std::pair<std::string, std::string>& s) {
    return s.first.rfind("--", 0) == 0 ? s.first + "=" + s.second : s.first + " " + s.second;
  };
  const auto a = lines(mine), b = lines(lead);
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i >= a.size() || i >= b.size()) return "another trainer version than rank 0";
    if (a[i] != b[i]) return shown(a[i]) + " but rank 0 with " + shown(b[i]);
  }
  return "";
}

void Run::StopIfAnyRankCannotGoOn(const std::exception_ptr& mine) {
  // Each rank's outcome as one string: "" for none, else 'u' (a refusal)
  // or 'f' (a failure) and the reason, never empty even for an exception
  // without a message.
  std::string own;
  if (mine) own = (IsUsageError(mine) ? "u" : "f") + ExceptionText(mine);
  const std::vector<std::string> all =
      world_ == 1 ? std::vector<std::string>{own}
                  : TellingOthers(mine, [&] { return par_.GatherFromEveryRank(own); });
  int first = -1;
  int count = 0;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[static_cast<size_t>(r)].empty()) continue;
    if (first < 0) first = r;
    ++count;
  }
  // A rank that threw ends with its own exception and line (its line names
  // it: see Fail in train_main.cc); the others say whose they stop for.
  if (mine) std::rethrow_exception(Reportable(mine));
  if (first < 0) return;
  const std::string& theirs = all[static_cast<size_t>(first)];
  std::string out = "rank " + std::to_string(first) + " cannot go on: " + theirs.substr(1);
  if (count > 1) {
    out += StringPrintf(" (and %d other rank%s could not either)", count - 1, count == 2 ? "" : "s");
  }
  if (theirs[0] == 'u') throw UsageError(out);
  throw JobError(out);
}

void Run::Setup() {
  data_ = LoadDatasets(c_);
  // The first collective: before anything the ranks could disagree on.
  if (world_ > 1) {
    const std::string mine = SharedSettings(c_, data_);
    const std::string difference = FirstDifference(mine, par_.ShareFromLead(mine));
    std::vector<double> differing = {difference.empty() ? 0.0 : 1.0};
    par_.SumAcrossRanks(differing);
    if (!difference.empty()) {
      // Only a rank other than 0 differs from rank 0, and Fail in
      // train_main.cc names it at the start of the line ("rank 1: ").
      throw UsageError("started with " + difference + "; every rank needs the same flags and data");
    }
    if (differing[0] > 0) {
      throw UsageError(StringPrintf("%.0f rank(s) were started with other flags or data than rank 0 (each "
                                    "names what differs); every rank needs the same flags and data",
                                    differing[0]));
    }
  }
  CheckBatchFitsShard(c_, data_.train->Size(), world_);
  // Under a launcher no CheckSetup ran; every rank finds the same answer.
  CheckPowerSgdStarts(c_, BatchesInEpoch(data_.train->Size(), world_, c_.batch_size));
  CheckScheduleFits(c_, BatchesInEpoch(data_.train->Size(), world_, c_.batch_size));
  model_ = MakeModel(c_, data_.train->Shape(), data_.train->NumClasses());
  // What each rank finds on its own host: its device (a node with no
  // visible GPU) and its trace folder. In the worker only (never the
  // launcher): CUDA is initialized here.
  // Only their UsageError is a refusal of the input: anything else (out
  // of memory, a driver's or the filesystem's error) fails the run.
  std::exception_ptr own_error;
  try {
    device_ = WorkerDevice(c_.device, opt_.local_rank);
    CheckTraceFolder(c_, par_.TraceFolder(), rank_);
  } catch (...) {
    own_error = std::current_exception();
  }
  StopIfAnyRankCannotGoOn(own_error);
  if (!device_.is_cpu()) model_->To(device_);
  par_.Prepare(model_, c_);
  const int64_t num_params = CountParameters(*model_);
  compute_dtype_ = ComputeDType(c_);
  autocast_dtype_ = AutocastDTypeOf(c_);
  if (compute_dtype_ != nn::DType::kFloat32) model_->To(compute_dtype_);
  model_->Train();
  if (c_.zero) {
    // Grouped by the whole parameters' shapes, before the split.
    sharded_ = par_.Shard(
        ParamGroupsOf(c_, model_->NamedParameters()),
        [this](std::vector<nn::optim::ParamGroup> shard) { return MakeOptimizer(c_, std::move(shard)); },
        c_.zero_overlap);
  } else {
    optimizer_ = MakeOptimizer(c_, ParamGroupsOf(c_, model_->NamedParameters()));
  }
  if (c_.amp == "fp16") {
    // f16 gradients underflow without loss scaling; bf16 has f32's range.
    scaler_ = std::make_unique<nn::optim::GradScaler>();
  }

  train_loader_ = MakeTrainLoader(c_, data_, rank_, world_, c_.workers);
  nn::data::DataLoaderOptions test_options;
  // Evaluation keeps no graph, so batches can be larger than training's;
  // not much larger, though: its first batch faults in all of its memory
  // (the CNN at 1000: some 200 MB, over a second on a small VM; at 256 a
  // quarter of that, and the run took 0.5-1 s less).
  test_options.batch_size =
      c_.model.rfind("resnet", 0) == 0 ? std::max<int64_t>(c_.batch_size, 64) : 256;
  test_options.num_workers = c_.workers;
  test_loader_ = std::make_unique<nn::data::DataLoader>(
      data_.test, std::make_shared<nn::data::StridedSampler>(data_.test->Size(), world_, rank_),
      data_.test_transform, test_options);

  // MakeTrainLoader's sampler, whose start a resumed epoch sets.
  train_sampler_ = &dynamic_cast<nn::data::DistributedSampler&>(train_loader_->sampler());
  const int64_t batches = train_loader_->NumBatches();
  batches_per_epoch_ = batches;
  steps_per_epoch_ = (batches + c_.grad_accum_steps - 1) / c_.grad_accum_steps;
  // The trainer's one rate, in every parameter group.
  const nn::optim::LrTarget lr_target =
      sharded_ ? nn::optim::LrTarget{[this] { return Lr(); }, [this](double lr) { sharded_->set_lr(lr); }}
               : EveryGroupsRate(*optimizer_);
  if (HasRunSchedule(c_.scheduler)) {
    // Over the whole run; a resumed one continues the saved horizon.
    schedule_ = std::make_shared<RunSchedule>(c_, RunEndStep(c_, batches));
    // (--zero's rate target cannot cycle momentum: ValidateConfig refuses it.)
    scheduler_ = sharded_ ? std::make_unique<nn::optim::LrScheduler>(lr_target, schedule_)
                          : MakeScheduler(*optimizer_, schedule_);
  } else if (c_.scheduler == "plateau") {
    plateau_ = std::make_unique<nn::optim::ReduceLrOnPlateau>(lr_target, PlateauOptionsOf(c_));
  }

  std::string resume_note;
  if (c_.resume) {
    TrainComponents parts = Components();
    // Whether the sharded load failed here: each rank checks its own shard
    // of the state, so its refusal is this rank's own finding (the entry it
    // refused), not rank 0's; the other ranks learn only which rank failed.
    bool shard_load_failed = false;
    if (sharded_) {
      parts.load_optimizer = [this, &shard_load_failed](const nn::optim::NamedTensors& whole) {
        try {
          sharded_->Load(whole);
        } catch (...) {
          shard_load_failed = true;
          throw;
        }
      };
    }
    // Rank 0 reads the file and sends its bytes to the others: it saved
    // it, perhaps on a disk only its host sees, and its failure to read it
    // is every rank's. The read may take as long as the save did, longer
    // than --timeout_s: the others wait for it as they wait for a save,
    // told that rank 0 is still going, up to --save_timeout_s. The read
    // owns what it uses (a read stuck in the filesystem is left behind
    // after --save_stop_grace_s): its outcome comes back through `read`,
    // looked at only once RunOnLead has returned, when it has ended.
    struct Read {
      std::string bytes;
      std::exception_ptr error;  // rank 0's own, rethrown as it was
    };
    const auto read = std::make_shared<Read>();
    const std::string late = StringPrintf(
        "rank 0 was still reading %s after %lld s (--save_timeout_s bounds a resume's read as "
        "well as a save): pass a longer --save_timeout_s, or a --checkpoint on a faster disk",
        c_.checkpoint.c_str(), static_cast<long long>(c_.save_timeout_s));
    const std::string failure = par_.RunOnLead(
        [read, path = c_.checkpoint](const std::atomic<bool>& stop) {
          try {
            read->bytes = ReadTrainCheckpoint(path, &stop);
          } catch (...) {
            read->error = std::current_exception();
            throw;
          }
        },
        std::chrono::seconds(c_.save_timeout_s), late, std::chrono::seconds(c_.save_stop_grace_s),
        /*discardable=*/true);
    if (!failure.empty()) {
      // Rank 0's refusal of the file (UsageError, exit status 2) or its
      // failure to read it (out of memory, say: exit status 1): every rank
      // ends with rank 0's kind, which it alone can tell from the text.
      bool refused = false;
      if (lead_ && read->error) {
        try {
          std::rethrow_exception(read->error);
        } catch (const UsageError&) {
          refused = true;
        } catch (...) {
        }
      }
      refused = TellingOthers(read->error, [&] {
                  return par_.ShareFromLead(refused ? "refused" : "failed");
                }) == "refused";
      if (read->error) std::rethrow_exception(Reportable(read->error));
      if (refused) throw LeadUsageError(failure);
      throw LeadJobError(failure);
    }
    std::string bytes = par_.ShareFromLead(std::move(read->bytes));
    try {
      pos_ = LoadTrainCheckpoint(c_.checkpoint, std::move(bytes), parts, c_, world_, &resume_note);
    } catch (const UsageError& e) {
      // Every rank holds rank 0's bytes and the same flags (checked at the
      // start), so every rank refuses them alike: rank 0's line says why.
      // Not so for a shard of the optimizer state (--zero): the rank that
      // refused its shard prints why, each rank its own line.
      if (lead_ || shard_load_failed) throw;
      throw LeadUsageError(e.what());
    }
  }
  // A fresh run's identity; a resumed run goes on with its checkpoint's (a
  // checkpoint saved before they were has none: a new one then, for its
  // saves). Rank 0's is the one saved and logged. The metrics of a resume
  // from such a checkpoint are matched against no identity (continued, as
  // an older trainer's log is): a new one there would differ at each resume
  // of the same checkpoint and set the run's own rows aside.
  const bool checkpoint_named_run = !pos_.run.empty();
  if (pos_.run.empty()) pos_.run = NewRunId();
  const std::string metrics_run = c_.resume && !checkpoint_named_run ? std::string() : pos_.run;
  // Under ddprun, srun or mpirun no launcher ran CheckSetup: rank 0, which
  // writes the checkpoint and the metrics, checks their paths here and every
  // rank stops with its answer, instead of rank 0 alone at the first save.
  // Rank 0's outcome for every rank: "" for none, else 'u' and its refusal
  // of the flags or paths (a UsageError: exit status 2 on every rank), or
  // 'f' and its failure (out of memory, an I/O error on metrics.csv: exit
  // status 1), never empty even for an exception without a message.
  std::string outcome;
  std::exception_ptr setup_error;
  if (lead_) {
    // A failure leaves none of the folders made here (see CheckSetup).
    std::vector<std::string> made;
    try {
      CheckCheckpointIsAFile(c_);
      CheckOutputFolders(c_, &made);
      if (!c_.checkpoint.empty()) checkpoint_claim_ = CheckpointClaim(c_.checkpoint);
      if (!c_.log_dir.empty()) {
        log_ = OpenMetricsLogWithin(
            c_, c_.model + " on " + c_.dataset,
            std::to_string(world_) + (world_ == 1 ? " rank" : " ranks") + ", global batch " +
                FormatCount(c_.GlobalBatch(world_)) + ", " + OptimizerSummary(c_),
            c_.resume ? pos_.step : -1, c_.resume && AtEpochEndResumed(), metrics_run);
      }
    } catch (...) {
      setup_error = std::current_exception();
      outcome = (IsUsageError(setup_error) ? "u" : "f") + ExceptionText(setup_error);
      RemoveFoldersMade(made);
    }
  }
  outcome = TellingOthers(setup_error, [&] { return par_.ShareFromLead(std::move(outcome)); });
  if (setup_error) std::rethrow_exception(Reportable(setup_error));
  if (!outcome.empty()) {
    if (outcome[0] == 'u') throw LeadUsageError(outcome.substr(1));
    throw LeadJobError(outcome.substr(1));
  }

  // Every rank built the same model from the same seed; attaching makes
  // rank 0's values the common start regardless.
  par_.Attach(model_, c_, pos_.step, pos_.bucket_order);

  const bool u = console_.options().unicode;
  const std::string dot = u ? " \u00b7 " : ", ";
  Say(console_.Bold(c_.model) + " (" + FormatCount(num_params) + " parameters)" + dot +
      std::to_string(world_) + (world_ == 1 ? " rank" : " ranks") + dot + data_.description +
      dot + "global batch " + FormatCount(c_.GlobalBatch(world_)) + " (" +
      std::to_string(world_) + " x " + std::to_string(c_.batch_size) +
      (c_.grad_accum_steps > 1 ? " x " + std::to_string(c_.grad_accum_steps) + " accumulated"
                               : "") +
      ")");
  std::string plan = "  " + OptimizerSummary(c_) + dot + std::to_string(c_.epochs) +
                     (c_.epochs == 1 ? " epoch" : " epochs") + " of " +
                     FormatCount(steps_per_epoch_) + " steps";
  if (c_.max_steps > 0) plan += " (at most " + FormatCount(c_.max_steps) + " steps)";
  if (world_ > 1 && c_.comm_hook != "allreduce") {
    plan += dot + (c_.comm_hook == "powersgd"
                       ? "PowerSGD gradients (rank 1 after step " +
                             FormatCount(c_.powersgd_start_step) + ")"
                       : c_.comm_hook + "-compressed gradients");
  }
  if (plateau_) {
    // What the plateau watches: benchmarks train without evaluating.
    plan += dot + StringPrintf("rate x%g after %lld epoch%s without a lower %s loss", c_.LrGamma(),
                               static_cast<long long>(c_.lr_patience + 1),
                               c_.lr_patience == 0 ? "" : "s", opt_.evaluate ? "test" : "train");
  }
  if (world_ > 1 && c_.zero) {
    plan += dot + std::string(c_.zero_overlap ? "optimizer state sharded, stepped inside backward"
                                              : "optimizer state sharded");
  }
  Say(console_.Dim(plan));
  if (!c_.checkpoint.empty()) {
    Say(console_.Dim("  checkpoint " + c_.checkpoint +
                     (c_.resume ? " (resuming)" : "")));
  }
  KeptName kept_name;
  keep_previous_ = lead_ && !c_.resume && !c_.checkpoint.empty() &&
                   IsAnotherRunsCheckpointWithin(c_, &kept_kind_, &kept_name);
  if (keep_previous_) {
    // Only a checkpoint of this trainer's can be resumed: a file another
    // program wrote is refused by --resume.
    // A file whose header the host failed to read may be one of this
    // trainer's checkpoints: --resume continues it only if it reads then.
    const bool checkpoint = kept_kind_ == "another run's checkpoint";
    const bool unread = kept_kind_ == "a file whose header cannot be read now";
    Say("  note: " + c_.checkpoint + " holds " + kept_kind_ + "; this run's first save " +
        "keeps it as " + kept_name.path +
        (checkpoint ? " (--resume continues it instead)"
                    : unread ? " (if it is a checkpoint of this trainer's, --resume continues it once it reads)"
                             : ""));
  }
  if (log_) Say(console_.Dim("  metrics " + log_->csv_path() + ", chart " + log_->chart_path()));
  if (log_ && !log_->kept_previous().empty()) {
    const bool another = log_->kept_another_run();
    Say("  note: --log_dir held " +
        std::string(another ? "the metrics of another run than the checkpoint's"
                            : "an earlier run's metrics") +
        "; kept as " + log_->kept_previous() +
        (log_->kept_previous_chart().empty() ? "" : " and " + log_->kept_previous_chart()) +
        (another ? ", and this run's rows start afresh" : " (--resume continues a run's rows instead)"));
  }
  if (log_ && !log_->dropped_rows().empty()) {
    // Said, not refused: the chart goes on without them.
    const std::vector<std::string>& dropped = log_->dropped_rows();
    Say("  note: --log_dir: " + std::to_string(dropped.size()) +
        (dropped.size() == 1 ? " line is" : " lines are") + " not a row of this trainer's and " +
        (dropped.size() == 1 ? "is" : "are") + " dropped from the metrics: " + dropped.front() +
        (dropped.size() > 1 ? " (and " + std::to_string(dropped.size() - 1) + " more)" : ""));
  }
  if (c_.resume) {
    if (!resume_note.empty()) Say("  note: " + resume_note);
    // The sampler on the resumed epoch, so that its size (below) counts
    // the start.
    train_sampler_->set_start(pos_.epoch_start, pos_.epoch);
    train_sampler_->SetEpoch(pos_.epoch);
    Say(StringPrintf("  resumed at epoch %lld, step %lld (%lld of the epoch's %lld steps done)",
                     static_cast<long long>(pos_.epoch + 1), static_cast<long long>(pos_.step),
                     static_cast<long long>(StepsBeforeStart() +
                                            pos_.batch_in_epoch / c_.grad_accum_steps),
                     static_cast<long long>(steps_per_epoch_)));
    // `--resume` after a run that finished (the README's next command
    // after the default run) trains nothing: say so, and what would.
    if (pos_.epoch >= c_.epochs || StepLimitReached()) {
      const std::string end = StepLimitReached() ? "--max_steps=" + std::to_string(c_.max_steps)
                                                 : "--epochs=" + std::to_string(c_.epochs);
      const bool schedule_ends_with_run =
          c_.scheduler == "step" || c_.scheduler == "cosine" || c_.scheduler == "onecycle";
      Say("  note: nothing is left to train: the checkpoint is already where " + end + " ends the run" +
          (schedule_ends_with_run
               ? "; its --scheduler=" + c_.scheduler +
                     " schedule ended there too, so to train more start a new run, without --resume"
               : std::string("; pass a larger --epochs") + (c_.max_steps > 0 ? " or --max_steps" : "") +
                     " to train on"));
    }
  }
}

bool Run::TrainStep(nn::data::DataLoader& loader) {
  const Clock::time_point t0 = Clock::now();
  const int64_t remaining = train_loader_->NumBatches() - pos_.batch_in_epoch;
  const int64_t group = std::min<int64_t>(c_.grad_accum_steps, remaining);
  if (group <= 0) return false;
  double samples = 0;
  const double scale = scaler_ ? scaler_->scale() : 1.0;
  for (int64_t i = 0; i < group; ++i) {
    std::optional<nn::data::Batch> batch = loader.Next();
    if (!batch) return false;
    // Micro-batches before the last only accumulate; the last one's
    // backward synchronizes everything accumulated.
    std::unique_ptr<Parallel::NoSyncScope> no_sync;
    if (i + 1 < group) no_sync = par_.NoSync();
    nn::Tensor x = batch->images;
    nn::Tensor labels = batch->labels;
    if (!device_.is_cpu()) {
      x = x.To(device_);
      labels = labels.To(device_);
    }
    if (compute_dtype_ != nn::DType::kFloat32) x = x.To(compute_dtype_);
    nn::Tensor loss;
    {
      std::optional<nn::AutocastGuard> autocast;
      if (autocast_dtype_) autocast.emplace(autocast_dtype_);
      const nn::Tensor logits = par_.Forward(x);
      loss = loss_fn_(logits, labels);
    }
    const double value = loss.Item();
    par_.Backward(nn::ops::MulScalar(loss, scale / static_cast<double>(group)));
    // The batch's mean loss, weighted by its samples: a short last batch
    // counts for what it holds, as PyTorch's examples average.
    const int64_t batch_samples = batch->images.size(0);
    stretch_loss_sum_ += value * static_cast<double>(batch_samples);
    stretch_loss_count_ += batch_samples;
    shown_loss_sum_ += value * static_cast<double>(batch_samples);
    shown_loss_count_ += batch_samples;
    samples += static_cast<double>(batch_samples) * world_;
  }
  if (scaler_) {
    scaler_->Step(*optimizer_);
    scaler_->Update();
  } else if (sharded_) {
    sharded_->Step();
  } else {
    optimizer_->Step();
  }
  // The rate this step trained with, for metrics.csv: the scheduler sets
  // the next step's now.
  last_step_lr_ = Lr();
  if (scheduler_) scheduler_->Step();
  if (sharded_) {
    sharded_->ZeroGrad();
  } else {
    optimizer_->ZeroGrad();
  }
  pos_.batch_in_epoch += group;
  pos_.step += 1;
  steps_this_process_ += 1;

  const Clock::time_point t1 = Clock::now();
  const double dt = Seconds(t1 - t0);
  stretch_train_s_ += dt;
  stretch_samples_ += samples;
  all_steps_s_ += dt;
  all_samples_ += samples;
  if (steps_this_process_ > kWarmupSteps) {
    measured_s_ += dt;
    measured_samples_ += samples;
    measured_steps_ += 1;
  } else if (steps_this_process_ == kWarmupSteps) {
    warmup_comm_ = par_.Totals();
  }
  rate_.Add(t1, samples);
  return true;
}

void Run::FlushMetrics() {
  if (last_flushed_step_ == pos_.step) return;
  std::vector<double> v = {stretch_loss_sum_, static_cast<double>(stretch_loss_count_)};
  par_.SumAcrossRanks(v);
  pos_.epoch_loss_sum += v[0];
  pos_.epoch_loss_count += static_cast<int64_t>(v[1]);
  if (log_ && v[1] > 0) {
    StepRecord r;
    r.step = pos_.step;
    r.epoch = pos_.epoch + 1;
    r.loss = v[0] / v[1];
    r.lr = last_step_lr_;
    r.samples_per_s = stretch_train_s_ > 0 ? stretch_samples_ / stretch_train_s_ : 0;
    Log([&](MetricsLog& log) { log.AddStep(r); });
  }
  stretch_loss_sum_ = 0;
  stretch_loss_count_ = 0;
  stretch_train_s_ = 0;
  stretch_samples_ = 0;
  last_flushed_step_ = pos_.step;
}

Evaluation Run::Evaluate() {
  // Without --sync_bn each rank's BatchNorm statistics follow its own
  // batches (DDP broadcasts rank 0's before each training forward, and the
  // forward then updates them); every rank scores its test slice with rank
  // 0's, those of the model the checkpoint holds.
  par_.BroadcastBuffers();
  model_->Eval();
  double loss_sum = 0;
  double correct = 0;
  double count = 0;
  double interrupted = 0;
  {
    nn::NoGradGuard no_grad;
    nn::loss::CrossEntropyOptions sum;
    sum.reduction = nn::loss::Reduction::kSum;
    test_loader_->StartEpoch(0);
    while (std::optional<nn::data::Batch> batch = test_loader_->Next()) {
      // The launcher kills a rank a few seconds after a signal; a long
      // evaluation gives way (the checkpoint was saved before it).
      if (StopSignal() != 0) {
        interrupted = 1;
        break;
      }
      nn::Tensor x = batch->images;
      nn::Tensor labels = batch->labels;
      if (!device_.is_cpu()) {
        x = x.To(device_);
        labels = labels.To(device_);
      }
      if (compute_dtype_ != nn::DType::kFloat32) x = x.To(compute_dtype_);
      std::optional<nn::AutocastGuard> autocast;
      if (autocast_dtype_) autocast.emplace(autocast_dtype_);
      // The module itself, not the DDP wrapper: evaluation needs no gradient
      // synchronization and must not count as a training iteration.
      const nn::Tensor logits = model_->Forward(x);
      loss_sum += nn::loss::CrossEntropy(logits, labels, sum).Item();
      const std::vector<int64_t> predicted = nn::ops::Argmax(logits, 1).ToVector<int64_t>();
      const std::vector<int64_t> truth = batch->labels.ToVector<int64_t>();
      for (size_t i = 0; i < truth.size(); ++i) correct += predicted[i] == truth[i];
      count += static_cast<double>(truth.size());
    }
  }
  model_->Train();
  // One sum whether or not this rank stopped early, so that the ranks'
  // collectives still pair up.
  std::vector<double> v = {loss_sum, correct, count, interrupted};
  par_.SumAcrossRanks(v);
  Evaluation e;
  e.loss = v[2] > 0 ? v[0] / v[2] : NAN;
  e.accuracy = v[2] > 0 ? v[1] / v[2] : NAN;
  e.interrupted = v[3] > 0;
  return e;
}

bool Run::RecordEvaluation(const Evaluation& e, int64_t epoch_number) {
  if (e.interrupted) return false;
  last_eval_ = e;
  last_eval_step_ = pos_.step;
  // A resumed finished run evaluates again at the step the log may hold.
  Log([&](MetricsLog& log) {
    if (!log.HasEvalAt(pos_.step)) log.AddEval({pos_.step, epoch_number, e.loss, e.accuracy});
  });
  return true;
}

int Run::EvaluateMissedAtResume() {
  if (!c_.resume || !opt_.evaluate || pos_.step == 0) return 0;
  const bool epoch_end = AtEpochEndResumed();
  // An --eval_every evaluation due at this step is due though the epoch was
  // abandoned; it belongs to that epoch (pos_.epoch, moved past it).
  const bool scheduled = c_.eval_every > 0 && pos_.step % c_.eval_every == 0;
  if (!epoch_end && !scheduled) return 0;
  // Rank 0 keeps the log; every rank evaluates (a collective) or none.
  // Without a log nothing tells whether the run before finished that
  // evaluation: it is made again rather than perhaps never.
  // A streamed metrics.csv was not read back: it tells nothing either.
  const bool no_record = log_ == nullptr || log_->streaming();
  std::string missed = lead_ && (no_record || !log_->HasEvalAt(pos_.step)) ? "1" : "";
  if (par_.ShareFromLead(std::move(missed)).empty()) return 0;
  const int64_t epoch_number =
      epoch_end || pos_.untrained_epochs > 0 ? pos_.epoch : pos_.epoch + 1;
  if (!RecordEvaluation(Evaluate(), epoch_number)) return StopNow();
  Say(StringPrintf("  evaluated at step %lld (epoch %lld), %s: test loss %.4f  test acc %.2f%%",
                   static_cast<long long>(pos_.step), static_cast<long long>(epoch_number),
                   !no_record ? "missing from the metrics"
                              : log_ == nullptr
                                  ? "where the run before was to evaluate (no --log_dir says whether it did)"
                                  : "where the run before was to evaluate (a streamed metrics.csv is not read back)",
                   last_eval_->loss, last_eval_->accuracy * 100));
  return 0;
}

std::string Run::StepPlateau(double metric) {
  const double before = Lr();
  plateau_->Step(metric);
  pos_.plateau_at_step = pos_.step;
  return Lr() != before ? StringPrintf("  plateau: learning rate %g -> %g", before, Lr()) : "";
}

int Run::StepPlateauMissedAtResume() {
  if (!plateau_ || !c_.resume || !opt_.evaluate || !AtEpochEndResumed() ||
      pos_.plateau_at_step == pos_.step) {
    return 0;
  }
  // Every rank decides alike: the position and the checkpoint are shared.
  if (!last_eval_ || last_eval_step_ != pos_.step) {
    if (!RecordEvaluation(Evaluate(), pos_.epoch)) return StopNow();
  }
  // The same loss and state as the run before, which said what it did
  // (unless a signal cut its evaluation short).
  StepPlateau(last_eval_->loss);
  return 0;
}

int Run::StopNow() {
  par_.FinishStopVote();
  par_.VoteStop(StopSignal());
  return par_.FinishStopVote();
}

bool Run::KeepAnotherRunsCheckpoint() {
  // This run saved before (or resumes one): the file is its own.
  if (c_.checkpoint.empty() || c_.resume || last_checkpoint_step_ >= 0) return false;
  std::string keep;
  if (lead_) {
    // Within half of --timeout_s (at most kStopLookLimit), as at the start: a header read hung in
    // the filesystem held rank 0 here for good, and the others failed at
    // their deadline not knowing why. A file whose header cannot be read
    // in time may be a good checkpoint: it is left as it is, and said so.
    // The look's start can fail (no memory for its state; no thread left
    // under RLIMIT_NPROC): rank 0 must still share its word, or the others
    // wait in ShareFromLead until --timeout_s without its reason, and its
    // own stop line is lost. A look that could not start is taken as one
    // that did not end: the file is left as it is, and said why.
    std::optional<bool> another;
    try {
      another = LookAtAnotherRunsCheckpointWithin(c_, &kept_kind_, /*at_stop=*/true);
    } catch (...) {
      kept_unlooked_ = ExceptionText(std::current_exception());
    }
    if (!another && kept_unlooked_.empty()) kept_unread_ = true;
    if (!another || *another) keep = "1";
  }
  return !par_.ShareFromLead(std::move(keep)).empty();
}

void Run::SaveCheckpoint() {
  if (c_.checkpoint.empty() || last_checkpoint_step_ == pos_.step) return;
  nn::optim::NamedTensors whole;
  if (sharded_) whole = sharded_->Consolidate();
  last_checkpoint_step_ = pos_.step;
  // Rank 0 alone writes; the others learn its outcome, so that a failed
  // save (a full disk) stops every rank with rank 0's reason instead of
  // rank 0 alone while the others wait in their next collective. They wait
  // up to --save_timeout_s, told that rank 0 is still writing: a large
  // model on a slow disk may take longer than --timeout_s.
  // What rank 0 writes, gathered here so that the write owns it (one stuck
  // in the filesystem is left behind after --save_stop_grace_s, and must
  // then touch nothing of this Run). Its tensors share the model's and
  // optimizer's storage: nothing changes them until RunOnLead returns, as
  // training waits for it. A write left behind has been told to stop
  // before: whatever it reads afterwards (the run ends, or a later step
  // changes the parameters) goes only to its temporary file, which it
  // removes rather than renaming it to the checkpoint's path.
  nn::io::Checkpoint checkpoint;
  // A failure gathering it (a state dict, a copy out of memory) is rank
  // 0's alone: it goes to the work, which rethrows it, so that every rank
  // hears it through RunOnLead instead of waiting for rank 0 there.
  std::exception_ptr gather_error;
  if (lead_) {
    try {
      TrainComponents parts = Components();
      if (sharded_) parts.optimizer_state = &whole;
      checkpoint = TrainCheckpointOf(parts, pos_, c_, world_);
    } catch (...) {
      gather_error = std::current_exception();
    }
  }
  // The write's outcome, shared with it; `mu` is held only to read or set
  // these, never across a filesystem call.
  struct Outcome {
    std::mutex mu;
    std::string kept;  // where another run's checkpoint went, if it was there
    std::exception_ptr error;
  };
  const auto outcome = std::make_shared<Outcome>();
  const auto kept_now = [&outcome] {
    std::lock_guard lock(outcome->mu);
    return outcome->kept;
  };
  // `moved`: where another run's checkpoint went before the write (rank 0
  // knows once the write has ended). It is still at the path too, unless
  // the filesystem has no hard links (see KeepAsPreviousCheckpoint).
  const auto late_message = [&](const std::string& moved) {
    std::error_code ec;
    const std::string left =
        moved.empty() ? "the file there is the one before, if any"
                      : kept_kind_ + ", which was at " + c_.checkpoint + ", is now " + moved +
                            (std::filesystem::exists(c_.checkpoint, ec)
                                 ? ""
                                 : ", and nothing is left at " + c_.checkpoint);
    return StringPrintf("rank 0 was still writing %s after %lld s (--save_timeout_s); %s: pass a "
                        "longer --save_timeout_s, or a --checkpoint on a faster disk",
                        c_.checkpoint.c_str(), static_cast<long long>(c_.save_timeout_s),
                        left.c_str());
  };
  const std::string late = late_message("");
  std::string failure;
  try {
    failure = par_.RunOnLead(
        [outcome, checkpoint = std::move(checkpoint), gather_error, path = c_.checkpoint, job = c_.job,
         keep_previous = keep_previous_, kind = kept_kind_](const std::atomic<bool>& stop) {
          try {
            if (gather_error) std::rethrow_exception(gather_error);
            std::string kept;
            // Checked again: the file may have gone (or become this job's)
            // since the start.
            if (keep_previous && IsAnotherRunsCheckpoint(path, job)) {
              kept = KeepAsPreviousCheckpoint(path);
              std::lock_guard lock(outcome->mu);
              outcome->kept = kept;
            }
            try {
              WriteTrainCheckpoint(path, checkpoint, &stop);
            } catch (...) {
              // Any failure of the write (a CheckpointSaveError, or one that
              // is not the disk's: out of memory): the file kept is still at
              // the path unless the new one is in place (SavedButNotDurable):
              // then it is not the same file, and stays kept. Otherwise it
              // is as it was, under one name. Where it was renamed (no hard
              // links), the path is empty now, and the line must say where
              // it went.
              if (!kept.empty() && ForgetKeptCheckpoint(path, kept)) {
                kept.clear();
                std::lock_guard lock(outcome->mu);
                outcome->kept.clear();
              }
              if (kept.empty()) throw;
              // What the file is (KeptFileKind), as the start said: a
              // file another program wrote is no run's checkpoint.
              const std::string where = " (" + kind + ", which was at " + path + ", is " + kept + ")";
              try {
                throw;
              } catch (const CheckpointSaveError& e) {
                throw CheckpointSaveError(std::string(e.what()) + where);
              } catch (const std::exception&) {
                throw std::runtime_error(ExceptionText(std::current_exception()) + where);
              } catch (...) {
                throw std::runtime_error("an exception that is not a std::exception" + where);
              }
            }
          } catch (...) {
            std::lock_guard lock(outcome->mu);
            outcome->error = std::current_exception();
            throw;
          }
        },
        std::chrono::seconds(c_.save_timeout_s), late, std::chrono::seconds(c_.save_stop_grace_s),
        /*discardable=*/false);
  } catch (const JobError& e) {
    // Rank 0's own failure, gathering the checkpoint or writing it (the
    // work rethrows a gathering's), when the collective that tells the
    // others failed too (a peer lost): its reason first, as TellingOthers
    // words it; a write's names another run's checkpoint it kept. Its line
    // gave the peer loss alone.
    std::exception_ptr own = gather_error;
    {
      std::lock_guard lock(outcome->mu);
      if (outcome->error) own = outcome->error;
    }
    if (own && e.what() != late) {
      const std::string text = ExceptionText(own);
      ThrowOwnAndLost(std::make_exception_ptr(JobError(SavedButNotDurable(text)
                                                           ? "rank 0: " + text
                                                           : "rank 0 could not save the checkpoint: " + text)),
                      e);
    }
    // On rank 0 the write has ended by now, unless it was left behind
    // (stuck past --save_stop_grace_s): `kept` is then where the other
    // run's checkpoint went before the write, which, told to stop, never
    // replaces the file at the path.
    const std::string kept = kept_now();
    if (kept.empty()) throw;
    if (e.what() == late) throw JobError(late_message(kept));
    throw JobError(std::string(e.what()) + " (" + kept_kind_ + ", which was at " + c_.checkpoint + ", is " + kept +
                   ")");
  }
  // RunOnLead returned: the write has ended, and the outcome is final.
  keep_previous_ = false;
  // Every rank, rank 0 too, ends with the same error of the run (exit
  // status 1): the save's failure is rank 0's disk's, not a flag's.
  if (!failure.empty()) {
    // A checkpoint in place whose folder's fsync failed was saved: its line
    // says so itself, and "could not save" would contradict it.
    throw LeadJobError(SavedButNotDurable(failure) ? "rank 0: " + failure
                                                   : "rank 0 could not save the checkpoint: " + failure);
  }
  if (outcome->error) std::rethrow_exception(outcome->error);
  if (lead_) {
    checkpoint_saved_ = c_.checkpoint;
    checkpoint_saved_step_ = pos_.step;
    if (const std::string kept = kept_now(); !kept.empty()) {
      Say("  " + kept_kind_ + ", which was at " + c_.checkpoint + ", is now " + kept);
    }
  }
}

RunResult Run::Go() {
  Setup();
  RunResult result;
  result.world_size = world_;
  int signal = 0;
  bool job_failed = false;  // a peer left mid-collective: no more collectives
  int64_t epochs_done = pos_.epoch - pos_.untrained_epochs;
  try {
    signal = EvaluateMissedAtResume();
    if (signal == 0) signal = StepPlateauMissedAtResume();
    while (pos_.epoch < c_.epochs && !StepLimitReached() && signal == 0) {
      const Clock::time_point epoch_start = Clock::now();
      double paused_s = 0;  // evaluation and checkpoints inside the epoch
      const int64_t epoch_number = pos_.epoch + 1;
      // Every rank sets the same start: the ranks' shards stay disjoint and
      // equal in length, so every rank takes the same number of steps.
      train_sampler_->set_start(pos_.epoch_start, pos_.epoch);
      train_loader_->StartEpoch(pos_.epoch, pos_.batch_in_epoch);
      const int64_t steps_before = StepsBeforeStart();
      const int64_t done_at_start = steps_before + pos_.batch_in_epoch / c_.grad_accum_steps;
      if (lead_ && !opt_.quiet) {
        console_.StartEpoch(epoch_number, c_.epochs, steps_per_epoch_, done_at_start);
      }
      shown_loss_sum_ = 0;
      shown_loss_count_ = 0;
      rate_.Reset();
      bool epoch_complete = false;
      while (true) {
        // Every rank stops at the same step (see Parallel::VoteStop). With
        // steps of kSlowStepS or more (rank 0's last, shared through the
        // vote), each vote is finished here: a signal is then acted on at
        // the end of the step it came in, not one step later, which with
        // such steps could outlast the launcher's grace before its SIGKILL.
        // The vote's latency (tens of microseconds) is nothing next to them.
        signal = par_.VoteStop(StopSignal(), last_step_s_ >= kSlowStepS);
        if (signal == 0 && par_.SlowSteps()) signal = par_.FinishStopVote();
        if (signal != 0) break;
        if (StepLimitReached()) break;
        const Clock::time_point step_start = Clock::now();
        if (!TrainStep(*train_loader_)) {
          epoch_complete = true;
          break;
        }
        last_step_s_ = Seconds(Clock::now() - step_start);
        const bool epoch_end = pos_.batch_in_epoch >= train_loader_->NumBatches();
        if (pos_.step % c_.log_every == 0 || epoch_end || StepLimitReached()) FlushMetrics();
        const bool eval_now = opt_.evaluate && c_.eval_every > 0 &&
                              pos_.step % c_.eval_every == 0 && !epoch_end;
        const bool save_now = c_.checkpoint_every > 0 && pos_.step % c_.checkpoint_every == 0 &&
                              !epoch_end && !StepLimitReached();
        if (eval_now || save_now) {
          const Clock::time_point p0 = Clock::now();
          if (save_now) {
            FlushMetrics();
            SaveCheckpoint();
          }
          if (eval_now) {
            FlushMetrics();
            if (lead_ && !opt_.quiet) console_.Status("evaluating");
            if (RecordEvaluation(Evaluate(), epoch_number)) {
              // The epoch's line shows only its last evaluation; metrics.csv
              // (--log_dir) is not the only place to see this one.
              Say(StringPrintf("  step %lld (epoch %lld/%lld)  test loss %.4f  test acc ",
                               static_cast<long long>(pos_.step), static_cast<long long>(epoch_number),
                               static_cast<long long>(c_.epochs), last_eval_->loss) +
                  console_.Green(StringPrintf("%.2f%%", last_eval_->accuracy * 100)));
            } else if ((signal = StopNow()) != 0) {
              break;
            }
          }
          paused_s += Seconds(Clock::now() - p0);
          rate_.Reset();
        }
        if (lead_ && !opt_.quiet) {
          const int64_t done = steps_before + pos_.batch_in_epoch / c_.grad_accum_steps +
                               (pos_.batch_in_epoch % c_.grad_accum_steps != 0);
          const double eta = rate_.StepTime() * static_cast<double>(steps_per_epoch_ - done);
          console_.Progress(done, rate_.Rate(),
                            shown_loss_count_ > 0
                                ? std::optional<double>(shown_loss_sum_ / shown_loss_count_)
                                : std::nullopt,
                            eta);
        }
        if (epoch_end) {
          epoch_complete = true;
          break;
        }
      }
      if (lead_ && !opt_.quiet) console_.EndEpoch();
      if (signal != 0) break;

      // End of the epoch, or of the run at --max_steps: the ranks agree on
      // it (both are decided by the step count), so collectives are safe.
      FlushMetrics();
      const double train_s = Seconds(Clock::now() - epoch_start) - paused_s;
      last_epoch_train_loss_ =
          pos_.epoch_loss_count > 0 ? pos_.epoch_loss_sum / pos_.epoch_loss_count : NAN;
      // The ranks' waits are gathered only when the line is printed.
      const std::string stats = par_.TakeStatsLine(/*every_rank=*/c_.ddp_stats);
      const bool evaluate_now = opt_.evaluate && last_eval_step_ != pos_.step;
      if (epoch_complete) {
        ++epochs_done;
        pos_.epoch += 1;
        pos_.batch_in_epoch = 0;
        pos_.epoch_start = 0;
        pos_.epoch_loss_sum = 0;
        pos_.epoch_loss_count = 0;
      }
      // Without evaluation the plateau takes the epoch's train loss, known
      // now (and saved with the checkpoint, which no longer holds it).
      // (The line saying it lowered the rate comes after the epoch's.)
      std::string plateau_line;
      if (plateau_ && epoch_complete && !opt_.evaluate) plateau_line = StepPlateau(last_epoch_train_loss_);
      // Saved before the evaluation, which a signal may cut short.
      SaveCheckpoint();
      if (evaluate_now) {
        if (lead_ && !opt_.quiet) {
          console_.Status("evaluating on " + FormatCount(data_.test->Size()) + " test images");
        }
        if (!RecordEvaluation(Evaluate(), epoch_number) && (signal = StopNow()) != 0) break;
      }
      // Once per epoch, after its evaluation (a run resumed from this
      // checkpoint evaluates again: StepPlateauMissedAtResume).
      if (plateau_ && epoch_complete && opt_.evaluate && last_eval_ && last_eval_step_ == pos_.step) {
        plateau_line = StepPlateau(last_eval_->loss);
      }
      if (log_) {
        Log([&](MetricsLog& log) {
          if (epoch_complete) log.AddEpochEnd(epoch_number, pos_.step);
          log.WriteChart();
        });
      }
      std::string line =
          console_.Bold(StringPrintf("epoch %lld/%lld", static_cast<long long>(epoch_number),
                                     static_cast<long long>(c_.epochs))) +
          StringPrintf("  train loss %.4f", last_epoch_train_loss_);
      if (last_eval_) {
        line += StringPrintf("  test loss %.4f  test acc ", last_eval_->loss) +
                console_.Green(StringPrintf("%.2f%%", last_eval_->accuracy * 100));
      }
      line += "  " + FormatSeconds(train_s);
      if (!epoch_complete) line += StringPrintf("  (stopped at --max_steps=%lld)",
                                                static_cast<long long>(c_.max_steps));
      Say(line);
      if (!plateau_line.empty()) Say(plateau_line);
      if (c_.ddp_stats && !stats.empty()) Say(console_.Dim("  ddp: " + stats));
    }
    // The vote still in flight: its outcome no longer matters, but every
    // rank has it in flight and waits for it.
    par_.FinishStopVote();
    if (opt_.evaluate && signal == 0 && !last_eval_) {
      // Nothing left to train (a resumed finished run): still report accuracy.
      if (!RecordEvaluation(Evaluate(), pos_.epoch + 1)) signal = StopNow();
    }
  } catch (const JobError&) {
    // The ranks agree to stop together, but a rank signalled twice, or
    // killed when the launcher's grace ran out, leaves at once: a rank still
    // inside a collective sees its peer leave, perhaps just before its own
    // signal arrives. That is the interruption, not a new failure.
    if (!AwaitStopSignal(std::chrono::seconds(1))) throw;
    signal = StopSignal();
    job_failed = true;
    last_checkpoint_step_ = pos_.step;  // the state may be mid-step: do not save it
  }

  if (signal != 0) {
    // The ranks agreed to stop at this step boundary (after a JobError
    // nothing is saved: see above). The losses of the steps since the last
    // metrics row go into the epoch's loss and metrics.csv first, as at a
    // row: the checkpoint's epoch loss then covers every step it holds.
    if (!job_failed) FlushMetrics();
    // The chart is otherwise drawn at epoch ends only: a run stopped in its
    // first epoch (a long one: a ResNet on the CPU) left rows and no chart.
    if (!job_failed) Log([](MetricsLog& log) { log.WriteChart(); });
    // A fresh run stopped before its first save (started at the default
    // path without --resume, and Ctrl-C at once) would replace another
    // run's checkpoint with a few steps of its own: that one is kept.
    const bool kept = !job_failed && KeepAnotherRunsCheckpoint();
    if (!kept) SaveCheckpoint();
    if (lead_) {
      std::string where = StringPrintf("stopped by %s at epoch %lld, step %lld",
                                       signal == SIGINT ? "Ctrl-C" : sigabbrev_np(signal),
                                       static_cast<long long>(pos_.epoch + 1),
                                       static_cast<long long>(pos_.step));
      if (!checkpoint_saved_.empty()) {
        // A launcher with restarts left sends TERM to the ranks still up
        // when one fails, then starts the job again from this checkpoint
        // itself. It sends the same TERM when it is itself stopped, and
        // then does not restart: the rank cannot tell which, so both are
        // said. Ctrl-C is never restarted.
        const std::optional<std::pair<int, int>> next =
            signal == SIGINT ? std::nullopt : NextLauncherRestart();
        where += StringPrintf(
            "; checkpoint of step %lld in %s", static_cast<long long>(checkpoint_saved_step_),
            checkpoint_saved_.c_str());
        where += next ? StringPrintf(" (if a rank failed, the launcher restarts the job from it: "
                                     "restart %d of %d; otherwise continue with --resume)",
                                     next->first, next->second)
                      : std::string(" (continue with --resume)");
      }
      if (kept && !kept_unlooked_.empty()) {
        where += "; cannot look at the header of --checkpoint=" + c_.checkpoint + ", to tell whose file it is (" +
                 kept_unlooked_ + "), so it was left as it was (this run had saved nothing yet)";
      } else if (kept && kept_unread_) {
        where += "; " + UnreadHeader(c_, /*at_stop=*/true) + " (its disk may hang), so it was left as it was (this run had "
                 "saved nothing yet)";
      } else if (kept && kept_kind_ == "another run's checkpoint") {
        where += "; the checkpoint at " + c_.checkpoint +
                 ", another run's, was left as it was (this run had saved nothing yet)";
      } else if (kept) {
        // A safetensors file exported from Python, say: not a checkpoint.
        where += "; the file at " + c_.checkpoint + ", " + kept_kind_ +
                 ", was left as it was (this run had saved nothing yet)";
      }
      if (!opt_.quiet) console_.Line(where);
    }
  }

  if (c_.trace && !par_.TraceFolder().empty()) {
    // DDP writes it once, when the rank ends (a failure then is a warning
    // on stderr: the run itself finished); a FIFO's or terminal's was
    // streamed all along, and is ended then.
    const std::string file = TraceFile(par_.TraceFolder(), rank_);
    if (dist::TraceRecorder::IsStreamTarget(file)) {
      Say(console_.Dim("  trace streamed into " + file + " (a FIFO or terminal: one JSON document, ended "
                       "when the rank ends)"));
    } else {
      Say(console_.Dim("  trace " + file + " when the ranks end (one per rank; open them in ui.perfetto.dev)"));
    }
  }

  result.steps = pos_.step;
  result.epochs_done = epochs_done;
  // Not steps over this run's steps per epoch: those of a resumed run's
  // first part may have been others (another number of ranks).
  // An epoch resumed past its start: the share of its order trained.
  const double part =
      pos_.epoch_start == 0
          ? static_cast<double>(pos_.batch_in_epoch) /
                static_cast<double>(std::max<int64_t>(1, train_loader_->NumBatches()))
          : std::min(1.0, static_cast<double>(pos_.epoch_start + pos_.batch_in_epoch *
                                                                   c_.batch_size * world_) /
                              static_cast<double>(std::max<int64_t>(1, data_.train->Size())));
  result.epochs = static_cast<double>(pos_.epoch - pos_.untrained_epochs) + part;
  result.measured_steps = measured_steps_;
  result.samples_per_s = measured_s_ > 0 ? measured_samples_ / measured_s_ : NAN;
  if (measured_steps_ == 0 && all_steps_s_ > 0) {
    // A run of warm-up steps only: report them rather than nothing.
    result.samples_per_s = all_samples_ / all_steps_s_;
  }
  result.train_loss = last_epoch_train_loss_;
  if (last_eval_) {
    result.test_loss = last_eval_->loss;
    result.test_acc = last_eval_->accuracy;
  } else {
    result.test_loss = NAN;
    result.test_acc = NAN;
  }
  CommTotals totals = par_.Totals();
  if (measured_steps_ > 0) {
    // Over the steps samples_per_s counts (a run of warm-up steps only
    // reports them all, as samples_per_s does).
    totals.iterations -= warmup_comm_.iterations;
    totals.forward_ms -= warmup_comm_.forward_ms;
    totals.backward_compute_ms -= warmup_comm_.backward_compute_ms;
    totals.backward_comm_ms -= warmup_comm_.backward_comm_ms;
    totals.overlap_ms -= warmup_comm_.overlap_ms;
    totals.exposed_ms -= warmup_comm_.exposed_ms;
  }
  result.comm_iterations = totals.iterations;
  result.comm_share = totals.CommShare();
  result.comm_overlap = totals.Overlap();
  result.stopped_by_signal = signal;
  result.checkpoint_saved = checkpoint_saved_;
  result.wall_s = Seconds(Clock::now() - start_);
  if (lead_ && signal == 0 && !opt_.quiet) {
    std::string done = "done in " + FormatSeconds(result.wall_s) + ": ";
    if (last_eval_) {
      done += "test accuracy " + console_.Green(StringPrintf("%.2f%%", result.test_acc * 100)) + ", ";
    }
    done += FormatRate(result.samples_per_s) + " samples/s";
    if (!checkpoint_saved_.empty()) done += ", checkpoint " + checkpoint_saved_;
    Say(done);
  }
  if (lead_ && signal == 0 && opt_.print_result && !console_.closed()) {
    std::fprintf(opt_.out, "%s\n", ResultLine(c_, result).c_str());
    std::fflush(opt_.out);
  }
  return result;
}

}  // namespace

void CheckSetup(const TrainConfig& config, int world_size, std::vector<std::string>* made_folders) {
  ValidateConfig(config);
  CheckDeviceFlag(config.device);
  CheckCheckpointIsAFile(config);
  const Datasets data = LoadDatasets(config);
  CheckBatchFitsShard(config, data.train->Size(), world_size);
  CheckPowerSgdStarts(config, BatchesInEpoch(data.train->Size(), world_size, config.batch_size));
  CheckScheduleFits(config, BatchesInEpoch(data.train->Size(), world_size, config.batch_size));
  const auto model = MakeModel(config, data.train->Shape(), data.train->NumClasses());
  if (config.resume) {
    // What the ranks would refuse (another model, optimizer, precision or
    // schedule), once, from the checkpoint's header: its data, of any size,
    // is read by rank 0 alone, under --save_timeout_s and a stop, and
    // checked there.
    if (ComputeDType(config) != nn::DType::kFloat32) model->To(ComputeDType(config));
    const auto optimizer = MakeOptimizer(config, ParamGroupsOf(config, model->NamedParameters()));
    std::unique_ptr<RunSchedule> schedule;
    const int64_t batches = MakeTrainLoader(config, data, 0, world_size, 0)->NumBatches();
    std::unique_ptr<nn::optim::ReduceLrOnPlateau> plateau;
    if (HasRunSchedule(config.scheduler)) {
      schedule = std::make_unique<RunSchedule>(config, RunEndStep(config, batches));
    } else if (config.scheduler == "plateau") {
      plateau = std::make_unique<nn::optim::ReduceLrOnPlateau>(EveryGroupsRate(*optimizer),
                                                               PlateauOptionsOf(config));
    }
    TrainComponents parts{model.get(), optimizer.get()};
    parts.train_size = data.train->Size();
    parts.schedule = schedule.get();
    parts.batches_per_epoch = batches;
    parts.plateau = plateau.get();
    CheckTrainCheckpointHeader(config.checkpoint, parts, config, world_size);
  }
  // Folders are made last: a run refused for another reason leaves none.
  // Nor one refused here: --checkpoint's folder is made before --log_dir
  // is looked at, and was left empty when --log_dir was refused.
  std::vector<std::string> made;
  try {
    CheckOutputFolders(config, &made);
    // Only a look, for a refusal in one line before any rank starts: rank 0
    // claims the file for the run.
    if (!config.checkpoint.empty()) CheckpointClaim look(config.checkpoint);
  } catch (...) {
    RemoveFoldersMade(made);
    throw;
  }
  if (made_folders != nullptr) made_folders->insert(made_folders->end(), made.begin(), made.end());
}

RunResult Train(const TrainConfig& config, Parallel& parallel, const RunOptions& options) {
  ValidateConfig(config);
  CheckDeviceFlag(config.device);
  Run run(config, parallel, options);
  return run.Go();
}

// ResumeAfterRestart(config, restart), on a thread of its own for at most
// half of --timeout_s: its read of the checkpoint's header, hung in the
// filesystem, held rank 0 with no deadline while the others failed at
// theirs, not knowing why. Past it, throws JobError naming the file. A
// read left behind owns what it uses (a copy of the config).
std::string ResumeAfterRestartWithin(TrainConfig& config, int restart) {
  struct Look {
    std::mutex mu;
    std::condition_variable done_cv;
    bool done = false;
    TrainConfig config;
    std::string note;
    std::exception_ptr error;
  };
  const auto look = std::make_shared<Look>();
  look->config = config;
  StartLook([look, restart] {
    TrainConfig c;
    {
      std::lock_guard lock(look->mu);
      c = look->config;
    }
    std::string note;
    std::exception_ptr error;
    try {
      note = ResumeAfterRestart(c, restart);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard lock(look->mu);
    look->config = std::move(c);
    look->note = std::move(note);
    look->error = error;
    look->done = true;
    look->done_cv.notify_all();
  });
  const auto wait = std::chrono::milliseconds(config.timeout_s * 500);
  std::unique_lock lock(look->mu);
  if (!look->done_cv.wait_for(lock, wait, [&look] { return look->done; })) {
    LeaveLookBehind();
    throw JobError(StringPrintf("restart %d of the job: cannot read the header of the checkpoint at %s within %s "
                                "(half of --timeout_s), to tell whether it is this job's: its disk may hang; "
                                "it is left as it is. Pass a --checkpoint on a working disk, or a longer "
                                "--timeout_s",
                                restart, config.checkpoint.c_str(), FormatSeconds(config.timeout_s * 0.5).c_str()));
  }
  if (look->error) std::rethrow_exception(look->error);
  config = look->config;
  return look->note;
}

std::string FollowRankZeroOnRestart(TrainConfig& config, int restart, Parallel& parallel) {
  // Rank 0's decision for every rank: "1" to resume, "0" to start over,
  // else 'u' and its refusal of the checkpoint (a UsageError: exit status
  // 2 on every rank) or 'f' and its failure (out of memory: exit status
  // 1), never empty even for an exception without a message. Any
  // exception is shared: one that ended rank 0 before its ShareFromLead
  // left the others waiting for it until they lost it or --timeout_s
  // passed, without its reason.
  std::string decision;
  std::string note;
  std::exception_ptr error;
  if (parallel.rank() == 0) {
    try {
      note = ResumeAfterRestartWithin(config, restart);
      decision = config.resume ? "1" : "0";
    } catch (...) {
      error = std::current_exception();
      decision = (IsUsageError(error) ? "u" : "f") + ExceptionText(error);
    }
  }
  decision = TellingOthers(error, [&] { return parallel.ShareFromLead(std::move(decision)); });
  if (error) std::rethrow_exception(Reportable(error));
  if (decision == "0" || decision == "1") {
    config.resume = decision == "1";
    return note;
  }
  if (!decision.empty() && decision[0] == 'u') throw LeadUsageError(decision.substr(1));
  throw LeadJobError(decision.empty() ? std::string("rank 0 shared no restart decision") : decision.substr(1));
}

std::string ResultLine(const TrainConfig& c, const RunResult& r) {
  const std::string epochs = r.epochs == std::floor(r.epochs) ? StringPrintf("%.0f", r.epochs)
                                                               : StringPrintf("%.2f", r.epochs);
  return StringPrintf(
      "RESULT model=%s ranks=%d epochs=%s samples_per_s=%.1f train_loss=%.4f test_acc=%.4f "
      "wall_s=%.1f",
      c.model.c_str(), r.world_size, epochs.c_str(), r.samples_per_s, r.train_loss, r.test_acc,
      r.wall_s);
}

}  // namespace ddp::examples::trainer
