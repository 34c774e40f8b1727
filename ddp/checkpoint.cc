#include "ddp/checkpoint.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <thread>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/device_ops.h"
#include "ddp/distributed_data_parallel.h"
#include "nn/io/atomic_file.h"

namespace ddp::dist {
namespace {

// Outcome of one rank's part, in a fixed size so that it can be exchanged
// with one collective whatever happened: a uint8 tensor of kRecordBytes,
// its first byte a flag (1 done, 0 failed, or one of those below), then a
// text that ends with a zero byte.
constexpr int64_t kRecordBytes = 1024;

// The status record while the root is still writing or reading (its first
// byte is 1 or 0 otherwise).
constexpr char kStillGoing = 2;
// A final record: root's work ran past the timeout (a failure; every rank
// aborts the group).
constexpr char kOutOfTime = 3;
// A final record of RestoreCheckpoint's loads: this rank could not put
// back the state it had before the call (a failure).
constexpr char kNotPutBack = 4;
// A final record of an exchange of arguments (Agree): building this
// rank's record threw.
constexpr char kNotTold = 5;

// internal::SetFaultForTesting's functions, one per FaultPoint.
struct Faults {
  std::mutex mu;
  std::map<internal::FaultPoint, std::function<void()>> at;
};

Faults& TheFaults() {
  static auto* f = new Faults;  // never destroyed
  return *f;
}

void RunFault(internal::FaultPoint point) {
  std::function<void()> fault;
  {
    Faults& f = TheFaults();
    std::lock_guard<std::mutex> lock(f.mu);
    auto it = f.at.find(point);
    if (it != f.at.end()) fault = it->second;
  }
  if (fault) fault();
}

// Makes `record` (a record, as kRecordBytes says) say `flag` and the
// first kRecordBytes - 2 bytes of `message`, in place: nothing is
// allocated.
void Rewrite(nn::Tensor& record, char flag, const char* message) {
  char* p = static_cast<char*>(record.data_ptr());
  std::memset(p, 0, kRecordBytes);
  p[0] = flag;
  std::strncpy(p + 1, message, kRecordBytes - 2);
}

// What the exception `e` says, valid while `e` lives; nothing is allocated.
const char* WhatOf(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return "an exception that is not a std::exception";
}

// Called from the handler of what threw on this rank alone (memory
// running out) where it would leave a collective call while the other
// ranks are in, or on their way to, the call's next exchange: they would
// wait for this one until the group's timeout, or past it for a
// LoadCheckpoint whose exchange lasts as long as the reads. The group is
// aborted with a reason naming the call, `path` (when not null), this
// rank, `doing` and what threw, so that every rank's exchange fails at
// once with it; the caller then rethrows. The reason's code is
// RESOURCE_EXHAUSTED for memory running out (std::bad_alloc, and
// std::length_error: a size past what a container holds), ABORTED for
// anything else. As ProcessGroup's own collectives, an argument error
// (another std::logic_error) leaves the group as it is: every rank throws
// it alike (a root outside the group), and nobody waits. A group of one
// rank has nobody waiting and stays usable. When the reason cannot be
// built (memory still short), the group is aborted with a shorter one.
void AbortForThisRank(ProcessGroup& pg, const char* call, const std::string* path, const char* doing) noexcept {
  if (pg.size() == 1) return;
  const char* what = "an exception that is not a std::exception";
  bool out_of_memory = false;
  try {
    throw;  // the exception being handled
  } catch (const std::bad_alloc& e) {
    out_of_memory = true;
    what = e.what();
  } catch (const std::length_error& e) {
    out_of_memory = true;
    what = e.what();
  } catch (const std::logic_error&) {
    return;
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  auto reason = [out_of_memory](std::string message) {
    return out_of_memory ? transport::ResourceExhaustedError(std::move(message))
                         : transport::AbortedError(std::move(message));
  };
  try {
    if (!pg.aborted_reason().ok()) return;
    const std::string named = path == nullptr ? "" : " " + (path->empty() ? "''" : *path);
    pg.Abort(reason(std::string(call) + named + ": rank " + std::to_string(pg.rank()) + " " + doing + ": " + what));
    return;
  } catch (...) {
  }
  try {
    pg.Abort(reason(call));
  } catch (...) {
    // Nothing more can be done: the others wait until the group's timeout.
  }
}

// AbortForThisRank, for the buffers of a collective call's first exchange.
void AbortForFirstBuffers(ProcessGroup& pg, const char* call, const std::string* path) noexcept {
  AbortForThisRank(pg, call, path, "could not make the buffers to exchange its outcome with the other ranks");
}

// AbortForThisRank's `doing` for what a rank prepares alone between two
// exchanges (the arguments' messages, the copies a work owns, its status
// buffer, its thread).
constexpr char kThrewAlone[] = "threw while it prepared its part, before the ranks' next exchange";

// Runs `prepare`, what this rank does alone before the next exchange of
// the collective call `call` (messages, the copies a work owns): what it
// throws aborts the group (AbortForThisRank) and is rethrown, so that the
// others fail at once.
template <typename F>
decltype(auto) PrepareAlone(ProcessGroup& pg, const char* call, const std::string* path, F&& prepare) {
  try {
    RunFault(internal::FaultPoint::kPreparingAlone);
    return prepare();
  } catch (...) {
    AbortForThisRank(pg, call, path, kThrewAlone);
    throw;
  }
}

// Inside a catch handler: makes `record` (a record) say that `doing`
// failed, "<doing> threw: <what><after>", or "<doing> ran out of memory:
// <what><after>" for a std::bad_alloc. In place: nothing is allocated,
// since memory may be what ran out.
void RewriteThrown(nn::Tensor& record, const char* doing, const char* after = "") {
  const char* what = "an exception that is not a std::exception";
  bool out_of_memory = false;
  try {
    throw;  // the exception being handled, not a copy
  } catch (const std::bad_alloc& e) {
    out_of_memory = true;
    what = e.what();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  Rewrite(record, 0, "");
  std::snprintf(static_cast<char*>(record.data_ptr()) + 1, kRecordBytes - 1, "%s %s: %s%s", doing,
                out_of_memory ? "ran out of memory" : "threw", what, after);
}

// The text of rank r's record in `all`, every rank's record in rank order
// (an all-gather of records).
std::string RecordText(const nn::Tensor& all, int r) {
  const char* p = static_cast<const char*>(all.data_ptr()) + r * kRecordBytes;
  return std::string(p + 1, strnlen(p + 1, kRecordBytes - 1));
}

// "rank 1: why; rank 3: why" over the ranks whose record says they failed,
// empty when none did. A record holds the first kRecordBytes - 2 bytes of
// a reason; `full`, when not empty, stands for this rank's own reason in
// whole.
std::string FailedRanks(const ProcessGroup& pg, const nn::Tensor& all, const std::string& full = "") {
  std::string failures;
  for (int r = 0; r < pg.size(); ++r) {
    if (static_cast<const char*>(all.data_ptr())[r * kRecordBytes] == 1) continue;
    const std::string why = r == pg.rank() && !full.empty() ? full : RecordText(all, r);
    failures += (failures.empty() ? "rank " : "; rank ") + std::to_string(r) + ": " + why;
  }
  return failures;
}

const nn::modules::Module& Unwrap(const nn::modules::Module& model) {
  if (auto* ddp = dynamic_cast<const DistributedDataParallel*>(&model)) return *ddp->module();
  return model;
}

nn::modules::Module& Unwrap(nn::modules::Module& model) {
  if (auto* ddp = dynamic_cast<DistributedDataParallel*>(&model)) return *ddp->module();
  return model;
}

}  // namespace

namespace internal {

void SetFaultForTesting(FaultPoint point, std::function<void()> fault) {
  Faults& f = TheFaults();
  std::lock_guard<std::mutex> lock(f.mu);
  f.at[point] = std::move(fault);
}

}  // namespace internal

nn::io::Checkpoint MakeCheckpoint(const nn::modules::Module& model,
                                  const nn::optim::Optimizer* optimizer, nn::io::Metadata metadata,
                                  const nn::optim::LrScheduler* scheduler,
                                  const nn::optim::GradScaler* scaler, const PowerSgdState* powersgd,
                                  const PeriodicModelAverager* averager,
                                  const PostLocalSgdState* post_local_sgd,
                                  const nn::optim::ReduceLrOnPlateau* plateau) {
  nn::io::Checkpoint c;
  c.model = Unwrap(model).GetStateDict();
  if (optimizer != nullptr) c.optimizer = optimizer->StateDict();
  auto append = [&c](const nn::optim::NamedTensors& part) {
    c.optimizer.insert(c.optimizer.end(), part.begin(), part.end());
  };
  if (scheduler != nullptr) append(scheduler->StateDict());
  if (scaler != nullptr) append(scaler->StateDict());
  if (powersgd != nullptr) append(powersgd->StateDict(Unwrap(model).NamedParameters()));
  if (averager != nullptr) append(averager->StateDict());
  if (post_local_sgd != nullptr) append(post_local_sgd->StateDict());
  if (plateau != nullptr) append(plateau->StateDict());
  c.metadata = std::move(metadata);
  return c;
}

namespace {

using Clock = std::chrono::steady_clock;

// Runs `work`, turning what it throws into its error; empty when it worked.
std::string ErrorOf(const internal::StoppableWork& work, const std::atomic<bool>& stop) {
  try {
    work(stop);
    return "";
  } catch (const std::exception& e) {
    return e.what()[0] != '\0' ? e.what() : "an exception without a message";
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// The threads Background left running (stuck in the filesystem) and the
// process's exit. Such a thread, when its work returns at last, frees what
// it owns (the checkpoint's tensors, its streams): during the exit, that
// would run while the process's static objects (an allocator, the CUDA
// runtime) are destroyed under it. So once the exit has begun (the
// handler below has run), such a thread parks instead, owning those, and
// the exit ends it. Never destroyed: the threads use it at any time.
struct LeftBehind {
  std::mutex mu;
  std::condition_variable cv;
  bool exiting = false;
  int ending = 0;  // threads left behind that are freeing what they own
};

LeftBehind& TheLeftBehind() {
  static auto* l = new LeftBehind;  // never destroyed
  return *l;
}

// Run by std::exit, registered once for each thread left behind (see
// Background::LeaveBehind): from its first run on, such threads park; one
// already freeing what it owns gets up to a second to finish, after which
// the exit goes on whatever it does. Later runs find the exit begun and
// return at once.
void OnExitWithThreadsLeftBehind() {
  LeftBehind& l = TheLeftBehind();
  std::unique_lock lock(l.mu);
  if (l.exiting) return;
  l.exiting = true;
  l.cv.wait_for(lock, std::chrono::seconds(1), [&l] { return l.ending == 0; });
}

// The end of a thread left behind, once its work returned: `state`, the
// last owner of what the work used, is freed, unless the process is
// exiting (see LeftBehind) or `keep` (its exit handler could not be
// registered).
template <typename State>
void EndLeftBehind(std::shared_ptr<State> state, bool keep) {
  LeftBehind& l = TheLeftBehind();
  std::unique_lock lock(l.mu);
  if (l.exiting || keep) {
    lock.unlock();
    // Owning the state until the exit, which ends this thread; nothing
    // waits for it.
    while (true) std::this_thread::sleep_for(std::chrono::hours(1));
  }
  ++l.ending;
  lock.unlock();
  state.reset();
  lock.lock();
  --l.ending;
  l.cv.notify_all();
}

// A rank's part (a write, a read), on a thread of its own, so that the
// caller's thread can tell the others it is still going. The work runs on
// the caller's current streams: a save's copies from the GPU come after
// the caller's queued kernels (an optimizer step), a load's copies to it
// before the caller's next ones. Everything the thread touches lives in
// State, which the thread shares, so that a thread stuck in the
// filesystem can be left behind (see ~Background).
class Background {
 public:
  // `what`: starts the line printed when the thread is abandoned (the
  // checkpoint's path and this rank's part in it).
  Background(internal::StoppableWork work, std::string what, std::chrono::milliseconds stop_grace)
      : state_(std::make_shared<State>(std::move(work))), what_(std::move(what)), stop_grace_(stop_grace) {
    try {
      state_->streams = internal::CaptureCurrentStreams();
      thread_ = std::thread([s = state_]() mutable {
        std::string error =
            ErrorOf([&s](const std::atomic<bool>& stop) { s->streams->Run([&] { s->work(stop); }); }, s->stop);
        bool left_behind = false;
        bool keep = false;
        {
          std::lock_guard lock(s->mu);
          s->error = std::move(error);
          s->done = true;
          left_behind = s->left_behind;
          keep = s->keep;
          s->cv.notify_all();
        }
        if (left_behind) EndLeftBehind(std::move(s), keep);
      });
    } catch (const std::exception& e) {
      // Not started (no thread to be had: std::system_error): a work that
      // failed at once, saying why. The callers hand that on as the
      // outcome, so the other ranks learn it instead of waiting out their
      // deadline for a status that never comes.
      std::lock_guard lock(state_->mu);
      state_->error = std::string("could not start the thread for it: ") + e.what();
      state_->done = true;
    }
  }
  // A work past its deadline was asked to stop (Finish) and ends within a
  // piece. One that does not within stop_grace is stuck in the filesystem
  // (a write or an fsync that never returns): waiting longer would hang the
  // caller without a bound, so it is reported and left running on its own.
  // Its stop flag is set, so a writer that ever returns removes its
  // temporary file and leaves the target as it was, unless it had already
  // passed its last check before the rename. Should that happen during
  // the process's exit, the rest of the work and of its thread's function
  // runs then, but the thread does not free its State (see LeftBehind).
  ~Background() {
    if (!WaitUntil(Clock::now())) {
      const bool renaming = Stop();
      if (!WaitUntil(Clock::now() + stop_grace_) && LeaveBehind()) {
        std::fprintf(stderr,
                     "[ddp] %s: the work did not end within %lld ms of being asked to stop (a write, read or "
                     "fsync stuck in the filesystem?); it is left running on a detached thread and its outcome "
                     "is dropped. %s\n",
                     what_.c_str(), static_cast<long long>(stop_grace_.count()),
                     renaming ? "A writer had already begun renaming its new, complete file into place, which "
                                "may yet happen."
                              : "A writer stops before its rename: the file at the path stays as it was, and the "
                                "temporary file beside it is removed if the write ever returns.");
        std::fflush(stderr);
        thread_.detach();
        return;
      }
    }
    if (thread_.joinable()) thread_.join();  // not when it never started
  }
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;

  // Marks the work as left behind, unless it ended meanwhile (false: it
  // is joined); from then on its thread frees what it owns (see
  // LeftBehind). The exit handler is registered again for each thread:
  // std::exit runs it before it destroys the static objects made before
  // this point, among them those that what the thread owns was made with
  // (an allocator, the CUDA runtime), while the statics made after a
  // registration are destroyed before it runs. Registered once, at the
  // first thread left behind, it let a later thread free into statics
  // made in between. Should it not be registered (no memory), the thread
  // never frees its State.
  bool LeaveBehind() {
    std::lock_guard lock(state_->mu);
    if (state_->done) return false;
    state_->left_behind = true;
    state_->keep = std::atexit(OnExitWithThreadsLeftBehind) != 0;
    return true;
  }
  // Waits until the work ends or `until`; true when it ended.
  bool WaitUntil(Clock::time_point until) {
    std::unique_lock lock(state_->mu);
    return state_->cv.wait_until(lock, until, [this] { return state_->done; });
  }
  // Asks the work to stop; true when a writer in it had already passed
  // its last check before its rename (nn::io::OrderedStop): its new file
  // is, or is about to be, in place.
  bool Stop() { return state_->ordered_stop.Stop(); }
  // Lets the work go on until `deadline`, then asks it to stop.
  void Finish(Clock::time_point deadline) {
    if (!WaitUntil(deadline)) Stop();
  }
  // Once WaitUntil returned true: the work's error, empty when it worked.
  std::string error() {
    std::lock_guard lock(state_->mu);
    return state_->error;
  }

 private:
  struct State {
    explicit State(internal::StoppableWork w) : work(std::move(w)) {}
    internal::StoppableWork work;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    bool left_behind = false;  // its thread was detached (see LeftBehind)
    bool keep = false;         // left behind, never to be freed (see LeaveBehind)
    std::string error;
    std::atomic<bool> stop{false};
    nn::io::OrderedStop ordered_stop{stop};
    std::unique_ptr<internal::CapturedStreams> streams;  // set before the thread starts
  };
  std::shared_ptr<State> state_;
  std::string what_;
  std::chrono::milliseconds stop_grace_;
  std::thread thread_;
};

void CheckWait(const char* name, std::chrono::milliseconds timeout, std::chrono::milliseconds heartbeat,
               std::chrono::milliseconds stop_grace) {
  if (timeout.count() <= 0 || timeout > kMostTimeout) {
    throw std::invalid_argument(std::string(name) + "::timeout must be in (0 ms, 30 days], got " +
                                std::to_string(timeout.count()) + " ms");
  }
  if (heartbeat.count() <= 0) {
    throw std::invalid_argument(std::string(name) + "::heartbeat must be positive, got " +
                                std::to_string(heartbeat.count()) + " ms");
  }
  if (stop_grace.count() <= 0 || stop_grace > kMostTimeout) {
    throw std::invalid_argument(std::string(name) + "::stop_grace must be in (0 ms, 30 days], got " +
                                std::to_string(stop_grace.count()) + " ms");
  }
}

// 62 bits of the FNV-1a hash of `text`: nonnegative, so that one
// all-reduce of the maximum of it and of its negation gives the largest
// and the smallest over the ranks.
int64_t Digest(const std::string& text) {
  uint64_t h = 14695981039346656037ull;
  for (const unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 2);
}

// "rank 2" or "ranks 1, 3, 4", the list cut after a few.
std::string RankList(const std::vector<int>& ranks) {
  constexpr size_t kShown = 8;
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < kShown; ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > kShown) out += " and " + std::to_string(ranks.size() - kShown) + " more";
  return out;
}

// What the ranks of a collective call must agree on before it does
// anything, and how its errors read.
struct Agreement {
  std::string call;      // "SaveCheckpoint"
  std::string path;      // this rank's
  std::string not_done;  // "not written"
  // This rank's complaint about its own arguments (an empty path, options
  // CheckWait refuses), empty when none.
  std::string refused;
  // What every rank must pass alike (empty on every rank: nothing), as
  // the message shows it ("'/a/c.safetensors'", "root 1"), and the error's
  // words for values that differ ("different paths (rank 0 writes...)").
  std::string value;
  std::string shown;
  std::string differ;
};

// Before a collective call does anything: every rank found its arguments
// valid and passed the same value. Unchecked, a rank whose arguments were
// refused would throw alone, leaving the others to wait for it until the
// group's timeout, and ranks that passed different values would go on
// each with its own (SaveCheckpoint: rank 0 writes its path, and a rank
// that passed another, expecting to write its own file, would learn
// nothing of it). One all-reduce of four numbers when they agree
// (measured with three: 0.5 to 0.75 ms with 2 ranks on a loaded 2-core
// host, against 27 to 38 ms for the whole SaveCheckpoint of the test MLP,
// about 2%, and nothing next to a save of real size), after making the
// all-gather's buffers (1 KB per rank); only when they do not agree, an
// all-gather of every rank's record names who passed what. Every rank
// then throws the same std::invalid_argument, or a std::runtime_error
// naming the rank on which the comparison threw (with what threw: on every
// rank when building its record threw, on that rank alone when making the
// buffers did, since nothing is exchanged after that).
void Agree(ProcessGroup& pg, const Agreement& a) {
  // Built only on the way to a throw: from here to the all-gather, a
  // throw would take this rank out of the exchanges and leave the others
  // waiting for it until the group's timeout.
  auto call_and_path = [&a] {
    // An empty path would vanish from the messages.
    return a.call + " " + (a.path.empty() ? "''" : a.path);
  };
  auto group_failed = [&](const DistributedError& e) {
    return DistributedError(transport::Status(e.code(), call_and_path() + ": " + a.not_done +
                                                            ": the group failed while the ranks compared their "
                                                            "arguments: " + e.status().message()));
  };
  const int64_t digest = Digest(a.value);
  // The one allocation this rank cannot take part without.
  nn::Tensor summary;
  try {
    RunFault(internal::FaultPoint::kMakingFirstBuffers);
    summary = nn::Zeros({4}, {.dtype = nn::DType::kInt64});
  } catch (...) {
    AbortForFirstBuffers(pg, a.call.c_str(), &a.path);
    throw;
  }
  int64_t* s = static_cast<int64_t*>(summary.data_ptr());
  s[0] = a.refused.empty() ? 0 : 1;
  s[1] = digest;
  s[2] = -digest;
  // The buffers of the all-gather below, made before the first exchange
  // so that a rank whose record cannot be built there (memory running
  // out) still has one to send. A rank that cannot make them puts its
  // rank + 1 in s[3], and every rank fails at once naming the last such
  // rank.
  nn::Tensor record;
  nn::Tensor all;
  std::exception_ptr no_buffers;
  try {
    RunFault(internal::FaultPoint::kMakingArgumentBuffers);
    record = nn::Zeros({kRecordBytes}, {.dtype = nn::DType::kUInt8});
    all = nn::Empty({kRecordBytes * pg.size()}, {.dtype = nn::DType::kUInt8});
  } catch (...) {
    no_buffers = std::current_exception();
    s[3] = pg.rank() + 1;
  }
  try {
    pg.AllReduce(summary, transport::ReduceOp::kMax, "checkpoint arguments").Wait();
  } catch (const DistributedError& e) {
    throw group_failed(e);
  }
  if (s[3] != 0) {
    const int r = static_cast<int>(s[3] - 1);
    throw std::runtime_error(call_and_path() + ": " + a.not_done + ": rank " + std::to_string(r) +
                             " could not make the buffers to compare the ranks' arguments" +
                             (r == pg.rank() ? std::string(": ") + WhatOf(no_buffers) : std::string()));
  }
  if (s[0] == 0 && s[1] == -s[2]) return;
  // Every rank has the same result, so every rank gets here too. A
  // record: the digest in 16 hex digits, then the value as shown (its
  // first 1006 bytes). Whatever throws while this rank builds it, the rank
  // still takes part in the all-gather, with a record written in place
  // (nothing allocated: memory may be what ran out) saying what threw.
  const bool ok = a.refused.empty();
  bool told = true;
  try {
    RunFault(internal::FaultPoint::kTellingArguments);
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(digest));
    Rewrite(record, ok ? 1 : 0, ok ? (hex + a.shown).c_str() : a.refused.c_str());
  } catch (...) {
    told = false;
    Rewrite(record, kNotTold, "");
    std::snprintf(static_cast<char*>(record.data_ptr()) + 1, kRecordBytes - 1,
                  "telling the other ranks its arguments threw: %s", WhatOf(std::current_exception()));
  }
  try {
    pg.AllGather(all, record, "checkpoint arguments").Wait();
  } catch (const DistributedError& e) {
    throw group_failed(e);
  }
  for (int r = 0; r < pg.size(); ++r) {
    if (static_cast<const char*>(all.data_ptr())[r * kRecordBytes] != kNotTold) continue;
    throw std::runtime_error(call_and_path() + ": " + a.not_done + ": the ranks could not compare their "
                             "arguments: " + FailedRanks(pg, all, told ? a.refused : ""));
  }
  const std::string failures = FailedRanks(pg, all, a.refused);
  if (!failures.empty()) {
    throw std::invalid_argument(call_and_path() + ": " + a.not_done + ": invalid arguments on " + failures);
  }
  // The ranks grouped by value, in the order of each value's first rank.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < pg.size(); ++r) {
    const std::string text = RecordText(all, r);
    auto same = std::find_if(groups.begin(), groups.end(),
                             [&text](const auto& g) { return g.first.compare(0, 16, text, 0, 16) == 0; });
    if (same == groups.end()) {
      groups.emplace_back(text, std::vector<int>{r});
    } else {
      same->second.push_back(r);
    }
  }
  constexpr size_t kShown = 8;
  std::string passed;
  for (size_t i = 0; i < groups.size() && i < kShown; ++i) {
    const auto& [text, ranks] = groups[i];
    const bool cut = text.size() == static_cast<size_t>(kRecordBytes - 2);
    passed += std::string(i ? "; " : "") + RankList(ranks) + " passed " + text.substr(16) + (cut ? "..." : "");
  }
  if (groups.size() > kShown) passed += "; and " + std::to_string(groups.size() - kShown) + " other values";
  throw std::invalid_argument(a.call + ": " + a.not_done + ", the ranks passed " + a.differ + ": " + passed);
}

// This rank's complaint about its wait options, empty when they are valid.
std::string RefusedWait(const char* name, std::chrono::milliseconds timeout, std::chrono::milliseconds heartbeat,
                        std::chrono::milliseconds stop_grace) {
  try {
    CheckWait(name, timeout, heartbeat, stop_grace);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// This rank's complaint about a load's wait options, then its load options
// (which nn::io's loaders check only once a read begins: here no rank
// reads when one rank's are refused), empty when both are valid.
std::string RefusedLoad(const LoadWaitOptions& wait, const nn::io::LoadOptions& options) {
  std::string refused = RefusedWait("LoadWaitOptions", wait.timeout, wait.heartbeat, wait.stop_grace);
  if (!refused.empty()) return refused;
  try {
    nn::io::CheckLoadOptions(options);
  } catch (const std::invalid_argument& e) {
    return e.what();
  } catch (const std::exception& e) {
    // A device's count that cannot be had (a CUDA error): this rank cannot
    // load on it either.
    return std::string("LoadOptions could not be checked: ") + e.what();
  }
  return "";
}

// Called while a throw on this rank alone in a wait is handled: aborts the
// group (AbortForThisRank) unless nobody waits for this rank any more,
// which is once the wait's last exchange has ended (`exchanged`) and the
// wait was the call's last exchange (`after`).
void AbortIfOthersWait(ProcessGroup& pg, const std::string& call, internal::AfterTheWait after,
                       bool exchanged) noexcept {
  if (!exchanged || after != internal::AfterTheWait::kTheCallEnds) {
    AbortForThisRank(pg, call.c_str(), nullptr, kThrewAlone);
  }
}

// What `root` does alone while the others wait: a write or read that may
// take longer than the group's timeout. `root` runs `work` on a thread and
// broadcasts a status record every `heartbeat` ("still going", then the
// outcome), so the others wait as long as it goes on, up to `timeout`.
// Returns the outcome on every rank: empty, or root's error. Past the
// timeout `work` is asked to stop, then every rank gets "<task> did not
// finish within <option> (N ms)", and the group is aborted with
// `abort_reason` and that limit (the others' next collective would wait
// for root past their deadline). A group that fails meanwhile leaves a
// write going until the timeout (a checkpoint half written is worth
// finishing) and stops a read at once (its bytes would be thrown away),
// as `if_the_group_fails` says. `*exchanged` turns true once this rank's
// last exchange of the wait has ended (then its caller's guard aborts
// nothing when `after` says that it was the call's last). A throw while
// the work may still go on aborts the group (as the guard does, naming
// `call`) before the work is waited for.
std::string RootWorks(ProcessGroup& pg, int root, const internal::StoppableWork& work,
                      std::chrono::milliseconds timeout, std::chrono::milliseconds heartbeat,
                      const std::string& call, const std::string& task, const std::string& option,
                      const std::string& abort_reason, std::chrono::milliseconds stop_grace,
                      internal::IfTheGroupFails if_the_group_fails, internal::AfterTheWait after,
                      bool* exchanged) {
  // Each record is a collective bound by the group's timeout.
  heartbeat = std::min(heartbeat, std::max(pg.options().timeout / 4, std::chrono::milliseconds(1)));
  const std::string limit = option + " (" + std::to_string(timeout.count()) + " ms)";
  const char* what = "checkpoint status";
  // One record for every round, made before the first: nothing is
  // allocated per heartbeat.
  nn::Tensor record = nn::Zeros({kRecordBytes}, {.dtype = nn::DType::kUInt8});
  // Root's outcome in full: the record carries its first 1 KB to the
  // others, which a long path can fill before the reason itself.
  std::string root_outcome;
  if (pg.rank() != root) {
    // Records until one is not "still going": root sends a final one by
    // `timeout` at the latest.
    do {
      pg.Broadcast(record, root, what).Wait();  // overwrites the whole record
    } while (static_cast<const char*>(record.data_ptr())[0] == kStillGoing);
    *exchanged = true;
    // Root aborts the group too, but it may be slow to get there (a busy
    // host): a next collective here must not wait for it and time out
    // with another reason.
    if (static_cast<const char*>(record.data_ptr())[0] == kOutOfTime) {
      pg.Abort(transport::TimedOutError(abort_reason + " within " + limit));
    }
  } else {
    const Clock::time_point deadline = Clock::now() + timeout;
    std::exception_ptr group_error;
    bool timed_out = false;
    std::string work_outcome;  // how `work` ended, once the group failed
    {
      Background background(work, abort_reason, stop_grace);
      try {
        while (true) {
          if (background.WaitUntil(std::min(deadline, Clock::now() + heartbeat))) {
            root_outcome = background.error();
            Rewrite(record, root_outcome.empty() ? 1 : 0, root_outcome.c_str());
          } else if (Clock::now() >= deadline) {
            // Stopped before the others hear that the file is as it was, in
            // step with the writer's last check before its rename; a writer
            // past it gets a heartbeat more (a rename is quick) to say how it
            // ended.
            const bool renaming = background.Stop();
            if (renaming && background.WaitUntil(Clock::now() + heartbeat)) {
              root_outcome = background.error();
              Rewrite(record, root_outcome.empty() ? 1 : 0, root_outcome.c_str());
            } else {
              RunFault(internal::FaultPoint::kRootOutOfTime);
              root_outcome = task + " did not finish within " + limit +
                             (renaming ? "; it was renaming the new file into place, which may have happened or "
                                         "may yet happen"
                                       : "");
              Rewrite(record, kOutOfTime, root_outcome.c_str());
              timed_out = true;
            }
          } else {
            Rewrite(record, kStillGoing, "");
          }
          try {
            // Alone, nobody waits: only the outcome matters.
            if (pg.size() > 1) pg.Broadcast(record, root, what).Wait();
          } catch (...) {
            group_error = std::current_exception();
            break;
          }
          if (static_cast<const char*>(record.data_ptr())[0] != kStillGoing) break;
        }
        *exchanged = true;
        if (timed_out && pg.size() > 1) pg.Abort(transport::TimedOutError(abort_reason + " within " + limit));
        // As Finish, knowing whether the work had to be stopped.
        const bool stop_now = group_error && if_the_group_fails == internal::IfTheGroupFails::kStopTheWork;
        const bool stopped = !background.WaitUntil(stop_now ? Clock::now() : deadline);
        if (stopped) background.Stop();
        if (group_error) {
          // The group's error alone would leave root's caller guessing
          // whether the work it let go on (a write: is the new file in
          // place?) completed.
          const std::string went_on =
              "meanwhile rank " + std::to_string(root) + " went on with " + task + ", which ";
          if (stopped && stop_now) {
            work_outcome = went_on + "was asked to stop at once: its outcome is of no use once the group failed";
          } else if (stopped) {
            work_outcome = went_on + "did not finish within " + limit + " and was asked to stop";
          } else {
            const std::string error = background.error();
            work_outcome = went_on + (error.empty() ? "completed" : "failed: " + error);
          }
        }
      } catch (const DistributedError&) {
        throw;
      } catch (...) {
        // Before ~Background waits for the work (up to `stop_grace`), so
        // that the others hear of it now, not at their timeout.
        AbortIfOthersWait(pg, call, after, *exchanged);
        throw;
      }
    }  // the work ends here
    if (group_error) {
      try {
        std::rethrow_exception(group_error);
      } catch (const DistributedError& e) {
        throw DistributedError(transport::Status(e.code(), e.status().message() + "; " + work_outcome));
      }
    }
  }
  RunFault(internal::FaultPoint::kAfterTheLastExchange);
  if (pg.rank() == root) return root_outcome;
  const char* p = static_cast<const char*>(record.data_ptr());
  return p[0] == 1 ? std::string() : std::string(p + 1, strnlen(p + 1, kRecordBytes - 1));
}

// RunOnEveryRankWhileOthersWait's wait. `*every_rank_out_of_time`: the
// ranks ran past `timeout` (its caller then throws, on every rank alike).
// `call`, `after` and `*exchanged` as RootWorks'.
std::string EveryRankWorks(ProcessGroup& pg, const internal::StoppableWork& work,
                           std::chrono::milliseconds timeout, std::chrono::milliseconds heartbeat,
                           const std::string& call, const std::string& option,
                           const std::string& abort_reason,
                           std::chrono::milliseconds stop_grace,
                           internal::IfTheGroupFails if_the_group_fails, internal::AfterTheWait after,
                           bool* every_rank_out_of_time, bool* exchanged) {
  heartbeat = std::min(heartbeat, std::max(pg.options().timeout / 4, std::chrono::milliseconds(1)));
  const std::string limit = option + " (" + std::to_string(timeout.count()) + " ms)";
  // Each round's flag, the largest over the ranks: 0 done, 1 still going,
  // 2 out of time.
  constexpr int32_t kDone = 0, kGoing = 1, kOutOfTime = 2;
  const Clock::time_point deadline = Clock::now() + timeout;
  std::string error;
  int32_t outcome = kGoing;
  bool out_of_time = false;
  std::exception_ptr group_error;
  // One flag for every round, made before the first: nothing is
  // allocated per heartbeat.
  nn::Tensor flag = nn::Zeros({1}, {.dtype = nn::DType::kInt32});
  int32_t* const flag_value = static_cast<int32_t*>(flag.data_ptr());
  {
    Background background(work, abort_reason, stop_grace);
    try {
      bool done = false;
      while (outcome == kGoing) {
        if (!done) done = background.WaitUntil(std::min(deadline, Clock::now() + heartbeat));
        if (done) error = background.error();
        out_of_time = !done && Clock::now() >= deadline;
        *flag_value = done ? kDone : out_of_time ? kOutOfTime : kGoing;
        try {
          if (pg.size() > 1) pg.AllReduce(flag, transport::ReduceOp::kMax, "checkpoint read status").Wait();
        } catch (...) {
          group_error = std::current_exception();
          break;
        }
        // Done here and others still going: the next round's all-reduce
        // waits for theirs, at most a heartbeat away.
        outcome = *flag_value;
      }
      *exchanged = true;
      // A rank still in its work: the others' next collective would wait for
      // it past their deadline; end the group now, with the reason.
      if (out_of_time && pg.size() > 1) pg.Abort(transport::TimedOutError(abort_reason + " within " + limit));
      // A work whose outcome the group's error makes useless (a read) is
      // stopped at once rather than waited for.
      const bool stop_now = group_error && if_the_group_fails == internal::IfTheGroupFails::kStopTheWork;
      background.Finish(stop_now ? Clock::now() : deadline);
    } catch (const DistributedError&) {
      throw;
    } catch (...) {
      // Before ~Background waits for the work (up to `stop_grace`), so
      // that the others hear of it now, not at their timeout.
      AbortIfOthersWait(pg, call, after, *exchanged);
      throw;
    }
  }  // the work ends here
  if (group_error) std::rethrow_exception(group_error);
  RunFault(internal::FaultPoint::kAfterTheLastExchange);
  *every_rank_out_of_time = outcome == kOutOfTime;
  return error;
}

}  // namespace

namespace internal {

// What throws on this rank alone in these (memory running out as it makes
// its status buffer, its thread or a status) would leave the others
// waiting for its next status until the group's timeout: it aborts the
// group first (AbortForThisRank, with its rule: not for an argument error,
// which every rank throws alike), naming `call` and this rank. A
// DistributedError is the group's own failure. What throws once this
// rank's last exchange of the wait has ended aborts nothing only when that
// was the call's last exchange (`after`): otherwise the others go on to
// the call's next one and would wait there for this rank.
std::string RunOnRootWhileOthersWait(ProcessGroup& pg, int root, const StoppableWork& work,
                                     std::chrono::milliseconds timeout, std::chrono::milliseconds heartbeat,
                                     const std::string& call, const std::string& task, const std::string& option,
                                     const std::string& abort_reason, std::chrono::milliseconds stop_grace,
                                     IfTheGroupFails if_the_group_fails, AfterTheWait after) {
  bool exchanged = false;
  try {
    RunFault(FaultPoint::kPreparingAlone);
    return RootWorks(pg, root, work, timeout, heartbeat, call, task, option, abort_reason, stop_grace,
                     if_the_group_fails, after, &exchanged);
  } catch (const DistributedError&) {
    throw;
  } catch (...) {
    AbortIfOthersWait(pg, call, after, exchanged);
    throw;
  }
}

std::string RunOnEveryRankWhileOthersWait(ProcessGroup& pg, const StoppableWork& work,
                                          std::chrono::milliseconds timeout, std::chrono::milliseconds heartbeat,
                                          const std::string& call, const std::string& task,
                                          const std::string& option, const std::string& abort_reason,
                                          std::chrono::milliseconds stop_grace,
                                          IfTheGroupFails if_the_group_fails, AfterTheWait after) {
  std::string error;
  bool out_of_time = false;
  bool exchanged = false;
  try {
    RunFault(FaultPoint::kPreparingAlone);
    error = EveryRankWorks(pg, work, timeout, heartbeat, call, option, abort_reason, stop_grace,
                           if_the_group_fails, after, &out_of_time, &exchanged);
  } catch (const DistributedError&) {
    throw;
  } catch (...) {
    AbortIfOthersWait(pg, call, after, exchanged);
    throw;
  }
  // Every rank alike, after the last exchange.
  if (out_of_time) {
    throw std::runtime_error(task + " did not finish on every rank within " + option + " (" +
                             std::to_string(timeout.count()) + " ms)");
  }
  return error;
}

}  // namespace internal

void SaveCheckpoint(ProcessGroup& pg, const std::string& path, const nn::io::Checkpoint& checkpoint,
                    const SaveOptions& options) {
  // A group already aborted (a rank failed, a collective timed out): rank
  // 0's state follows a failed collective and may not match the other
  // replicas, and no rank could learn how the write went. The file keeps
  // the last checkpoint the group saved, so that a SaveCheckpoint that
  // throws before it writes leaves no doubt about what `path` holds. (A
  // group that fails while rank 0 writes lets the write finish: see
  // RunOnRootWhileOthersWait.)
  const transport::Status aborted = pg.aborted_reason();
  if (!aborted.ok()) {
    throw DistributedError(transport::Status(
        aborted.code(), "SaveCheckpoint " + path + ": not written, the file is left as it was: the group "
                        "was aborted before the save: " + aborted.message()));
  }
  // An empty path or options refused on one rank, or another path on one:
  // every rank throws before rank 0 writes anything.
  Agree(pg, PrepareAlone(pg, "SaveCheckpoint", &path, [&] {
          return Agreement{
              .call = "SaveCheckpoint",
              .path = path,
              .not_done = "not written",
              .refused = path.empty() ? "the path is empty"
                                      : RefusedWait("SaveOptions", options.timeout, options.heartbeat,
                                                    options.stop_grace),
              .value = path,
              .shown = "'" + path + "'",
              .differ = "different paths (rank 0 writes the file, and every rank must pass its path)"};
        }));
  // The work owns its copies (the checkpoint's tensors are shared, not
  // copied): a write stuck in the filesystem outlives this call.
  internal::StoppableWork write;
  std::string call;
  std::string task;
  std::string option;
  std::string cannot_write;
  PrepareAlone(pg, "SaveCheckpoint", &path, [&] {
    call = "SaveCheckpoint " + path;
    nn::io::Checkpoint saved = checkpoint;
    saved.metadata[kWorldSizeKey] = std::to_string(pg.size());
    write = [path, saved = std::move(saved)](const std::atomic<bool>& stop) {
      nn::io::SaveCheckpoint(path, saved, &stop);
    };
    task = "the write";
    option = "SaveOptions::timeout";
    cannot_write = "SaveCheckpoint: rank 0 could not write " + path;
  });
  const std::string error = internal::RunOnRootWhileOthersWait(pg, 0, write, options.timeout, options.heartbeat,
                                                               call, task, option, cannot_write, options.stop_grace,
                                                               internal::IfTheGroupFails::kLetTheWorkFinish,
                                                               internal::AfterTheWait::kTheCallEnds);
  if (!error.empty()) throw std::runtime_error("SaveCheckpoint: rank 0 could not write " + path + ": " + error);
}

namespace {

// What a rank read, for comparing across ranks: the data checksum, the
// number of tensors and their bytes.
std::string Fingerprint(const nn::io::Checkpoint& c) {
  size_t bytes = 0;
  for (const auto& part : {&c.model, &c.optimizer}) {
    for (const auto& [name, t] : *part) bytes += t.nbytes();
  }
  return "data checksum " + (c.data_checksum.empty() ? std::string("none") : c.data_checksum) + ", " +
         std::to_string(c.model.size() + c.optimizer.size()) + " tensors of " + std::to_string(bytes) +
         " bytes, step " + (c.metadata.count("step") ? c.metadata.at("step") : std::string("unset"));
}

// A rank's account of its load, for AgreeOnLoad: the exchange's buffers,
// made before the read, so that a rank that cannot build its account
// afterwards (memory running out: what it read may have filled it) still
// has a record to send, written in place.
struct LoadAccount {
  explicit LoadAccount(const ProcessGroup& pg)
      : record(nn::Zeros({kRecordBytes}, {.dtype = nn::DType::kUInt8})),
        all(nn::Empty({kRecordBytes * pg.size()}, {.dtype = nn::DType::kUInt8})),
        number(nn::Zeros({1}, {.dtype = nn::DType::kInt64})) {}
  nn::Tensor record;  // this rank's, as Rewrite writes it
  nn::Tensor all;     // every rank's, once exchanged
  // LoadCheckpointFromRank's: the length of root's bytes, then whether
  // some rank could not make room for them.
  nn::Tensor number;
  // This rank's reason in full: a record holds its first 1 KB, which a
  // long path can fill before the reason itself. Empty when it read, or
  // when the reason could not be copied.
  std::string failure;
};

// A LoadAccount, made as the call's first allocation after its arguments
// were compared: a rank that cannot make it aborts the group
// (AbortForFirstBuffers) and rethrows, so that the others, already waiting
// for its read, fail at once instead of at their deadline.
LoadAccount MakeLoadAccount(ProcessGroup& pg, const char* call, const std::string& path) {
  try {
    RunFault(internal::FaultPoint::kMakingFirstBuffers);
    return LoadAccount(pg);
  } catch (...) {
    AbortForFirstBuffers(pg, call, &path);
    throw;
  }
}

// Every rank's outcome, exchanged; throws one error naming each rank that
// failed when any did. A rank that loaded puts what it read (Fingerprint)
// in its record: ranks that read different files (a node-local disk with
// an older copy, a network filesystem's client cache after rank 0 replaced
// the file) fail together, naming what each read, instead of training from
// different states. `call` begins every message: "LoadCheckpoint /a/c".
void AgreeOnLoad(ProcessGroup& pg, const std::string& call, LoadAccount& account) {
  RunFault(internal::FaultPoint::kExchangingLoadAccounts);
  pg.AllGather(account.all, account.record, "checkpoint load status").Wait();
  const nn::Tensor& all = account.all;
  const std::string failures = FailedRanks(pg, all, account.failure);
  if (!failures.empty()) {
    throw std::runtime_error(call + " failed on " + failures);
  }
  std::string read;
  bool differ = false;
  for (int r = 0; r < pg.size(); ++r) {
    const std::string what = RecordText(all, r);
    differ = differ || what != RecordText(all, 0);
    read += (r == 0 ? "rank " : "; rank ") + std::to_string(r) + " read " + what;
  }
  if (differ) {
    throw std::runtime_error(call + ": the ranks read different files (a stale copy on a node's own disk, "
                             "or a network filesystem's cache?): " + read);
  }
}

// One warning, on rank 0, when `checkpoint` was saved by a group of
// another size (kWorldSizeKey). Not an error: DDP's state does not depend
// on the size, and elastic resumes are legitimate. `call` as AgreeOnLoad's.
void WarnOnOtherWorldSize(const ProcessGroup& pg, const std::string& call, const nn::io::Checkpoint& checkpoint) {
  if (pg.rank() != 0) return;
  const auto it = checkpoint.metadata.find(kWorldSizeKey);
  if (it == checkpoint.metadata.end()) return;  // older, or not saved by SaveCheckpoint
  int64_t saved = 0;
  const std::string& value = it->second;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), saved);
  // Not a size (some other writer's key): nothing to compare.
  if (error != std::errc() || end != value.data() + value.size() || saved < 1) return;
  if (saved == pg.size()) return;
  std::fprintf(stderr,
               "[ddp] %s: saved by a group of %s ranks, loaded by a group of %d; the model and "
               "optimizer state load as they are, but what the training script derives from the world "
               "size (per-rank batch, data sampler position, a learning rate scaled by it) may need "
               "adjusting\n",
               call.c_str(), it->second.c_str(), pg.size());
  std::fflush(stderr);
}

}  // namespace

nn::io::Checkpoint LoadCheckpoint(ProcessGroup& pg, const std::string& path,
                                  const nn::io::LoadOptions& options, const LoadWaitOptions& wait) {
  // An empty path or options refused on one rank: every rank throws,
  // before any read.
  Agree(pg, PrepareAlone(pg, "LoadCheckpoint", &path, [&] {
          return Agreement{.call = "LoadCheckpoint",
                           .path = path,
                           .not_done = "nothing was read",
                           .refused = path.empty() ? "the path is empty" : RefusedLoad(wait, options)};
        }));
  // Before the read, as LoadAccount says.
  LoadAccount account = MakeLoadAccount(pg, "LoadCheckpoint", path);
  std::string call;
  // Owned by the work too: a read stuck in the filesystem outlives this call.
  std::shared_ptr<nn::io::Checkpoint> read;
  internal::StoppableWork work;
  std::string task;
  std::string option;
  std::string cannot_read;
  PrepareAlone(pg, "LoadCheckpoint", &path, [&] {
    call = "LoadCheckpoint " + path;
    read = std::make_shared<nn::io::Checkpoint>();
    work = [read, path, options](const std::atomic<bool>& stop) {
      nn::io::LoadOptions stoppable = options;
      stoppable.stop = &stop;
      *read = nn::io::LoadCheckpoint(path, stoppable);
    };
    task = "the read";
    option = "LoadWaitOptions::timeout";
    cannot_read = "LoadCheckpoint: rank " + std::to_string(pg.rank()) + " could not read " + path;
  });
  // The reads take as long as each rank's storage does (the host that
  // wrote the file has it in memory): the ranks done first wait for the
  // others, hearing that they are still reading.
  std::string what;
  try {
    what = internal::RunOnEveryRankWhileOthersWait(pg, work, wait.timeout, wait.heartbeat, call, task, option,
                                                   cannot_read, wait.stop_grace,
                                                   internal::IfTheGroupFails::kStopTheWork);
  } catch (const DistributedError&) {
    throw;
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(call + ": " + e.what());
  }
  nn::io::Checkpoint checkpoint = std::move(*read);
  if (what.empty()) {
    try {
      RunFault(internal::FaultPoint::kAccountingForLoad);
      Rewrite(account.record, 1, Fingerprint(checkpoint).c_str());
    } catch (...) {
      RewriteThrown(account.record, "saying what it read");
    }
  } else {
    Rewrite(account.record, 0, what.c_str());
    account.failure = std::move(what);
  }
  AgreeOnLoad(pg, call, account);
  WarnOnOtherWorldSize(pg, call, checkpoint);
  return checkpoint;
}

nn::io::Checkpoint LoadCheckpointFromRank(ProcessGroup& pg, const std::string& path, int root,
                                          const nn::io::LoadOptions& options, const LoadWaitOptions& wait) {
  // A root, root's path or options refused on one rank, or another root
  // on one (two ranks would each read and send, as roots of collectives
  // that do not match): every rank throws, before any read. The others'
  // paths are only named in messages, and may be empty.
  Agree(pg, PrepareAlone(pg, "LoadCheckpointFromRank", &path, [&] {
          std::string refused;
          if (root < 0 || root >= pg.size()) {
            refused = "root " + std::to_string(root) + " is not a rank of the group (size " +
                      std::to_string(pg.size()) + ")";
          } else if (pg.rank() == root && path.empty()) {
            refused = "the path is empty (rank " + std::to_string(root) + " reads it)";
          } else {
            refused = RefusedLoad(wait, options);
          }
          return Agreement{.call = "LoadCheckpointFromRank",
                           .path = path,
                           .not_done = "nothing was read",
                           .refused = refused,
                           .value = std::to_string(root),
                           .shown = "root " + std::to_string(root),
                           .differ = "different roots (every rank must pass the rank that reads the file)"};
        }));
  // Root's path on every rank, for the messages: another rank's may be
  // empty, or name a file that rank has not got (its own disk).
  std::string from;
  std::string root_path;
  PrepareAlone(pg, "LoadCheckpointFromRank", &path, [&] {
    from = "rank " + std::to_string(root);
    if (pg.rank() == root) root_path = path;
  });
  try {
    pg.BroadcastObject(&root_path, root);
  } catch (const DistributedError& e) {
    throw DistributedError(transport::Status(
        e.code(), "LoadCheckpointFromRank '" + path + "': nothing was read: the group failed while " + from +
                      " sent the path it reads: " + e.status().message()));
  }
  // Before the read, as LoadAccount says.
  LoadAccount account = MakeLoadAccount(pg, "LoadCheckpointFromRank", root_path);
  // Root reads (for as long as it takes, within wait.timeout, while the
  // others hear that it is still reading), then sends the bytes.
  std::string call;
  // Owned by the work: a read stuck in the filesystem outlives this call.
  std::shared_ptr<std::string> bytes;
  internal::StoppableWork work;
  std::string task;
  std::string option;
  std::string cannot_read;
  PrepareAlone(pg, "LoadCheckpointFromRank", &root_path, [&] {
    call = "LoadCheckpointFromRank '" + root_path + "' (read by " + from + ")";
    bytes = std::make_shared<std::string>();
    work = [bytes, path](const std::atomic<bool>& stop) {
      *bytes = nn::io::SafetensorsFile::ReadBytes(path, &stop);
    };
    task = "the read";
    option = "LoadWaitOptions::timeout";
    cannot_read = "LoadCheckpointFromRank: " + from + " could not read '" + root_path + "'";
  });
  const std::string error =
      internal::RunOnRootWhileOthersWait(pg, root, work, wait.timeout, wait.heartbeat, call, task, option,
                                         cannot_read, wait.stop_grace, internal::IfTheGroupFails::kStopTheWork);
  if (!error.empty()) throw std::runtime_error(call + " failed on " + from + ": " + error);
  // Root's bytes to the others, in three steps: their length; whether
  // every rank could make room for them (a checkpoint larger than the
  // memory a rank has left), one all-reduce of a number; then the bytes,
  // only when every rank could. A rank without room says so in its record
  // and every rank fails in the exchange below naming it: receiving the
  // bytes in one collective, that rank would leave the call alone while
  // the others waited for it until the group's timeout.
  int64_t* number = static_cast<int64_t*>(account.number.data_ptr());
  int64_t length = pg.rank() == root ? static_cast<int64_t>(bytes->size()) : -1;
  auto group_failed = [&](const DistributedError& e) {
    return DistributedError(transport::Status(
        e.code(), call + ": nothing was loaded: the group failed while " + from + " sent the " +
                      (length >= 0 ? std::to_string(length) + " " : std::string()) +
                      "bytes it read: " + e.status().message()));
  };
  number[0] = length;
  try {
    pg.Broadcast(account.number, root, "checkpoint length").Wait();
  } catch (const DistributedError& e) {
    throw group_failed(e);
  }
  length = number[0];
  bool room = true;
  if (pg.rank() != root) {
    try {
      RunFault(internal::FaultPoint::kReceivingCheckpoint);
      bytes->resize(static_cast<size_t>(length));
    } catch (...) {
      room = false;
      // In place, with nothing allocated: memory is what ran out.
      char doing[96];
      std::snprintf(doing, sizeof(doing), "making room for the %lld bytes rank %d read",
                    static_cast<long long>(length), root);
      RewriteThrown(account.record, doing);
    }
  }
  number[0] = room ? 0 : 1;
  try {
    pg.AllReduce(account.number, transport::ReduceOp::kMax, "checkpoint room").Wait();
  } catch (const DistributedError& e) {
    throw group_failed(e);
  }
  nn::io::Checkpoint checkpoint;
  if (number[0] != 0) {
    // Nothing is sent; the ranks that had room are not named.
    if (room) Rewrite(account.record, 1, "");
  } else {
    try {
      if (pg.size() > 1 && length > 0) {
        // The task owns the bytes: a Wait that gives up may return while
        // it still runs.
        pg.Run({.kind = "checkpoint bytes", .dtype = nn::DType::kUInt8, .shape = {length}, .root = root},
               [bytes, root](transport::Communicator* comm, transport::Deadline deadline) {
                 if (comm == nullptr) return transport::Status::Ok();
                 return comm->Broadcast(bytes->data(), bytes->size(), transport::DataType::kU8, root,
                                        internal::Within(deadline));
               })
            .Wait();
      }
    } catch (const DistributedError& e) {
      throw group_failed(e);
    } catch (...) {
      // Issuing it threw here alone (memory running out): the others are
      // in the broadcast.
      AbortForThisRank(pg, "LoadCheckpointFromRank", &root_path, kThrewAlone);
      throw;
    }
    try {
      RunFault(internal::FaultPoint::kAccountingForLoad);
      checkpoint =
          nn::io::LoadCheckpointFromBytes(std::move(*bytes), root_path + " (read by " + from + ")", options);
      Rewrite(account.record, 1, Fingerprint(checkpoint).c_str());
    } catch (const std::bad_alloc&) {
      RewriteThrown(account.record, "loading the checkpoint");
    } catch (const std::exception& e) {
      Rewrite(account.record, 0, e.what());
      try {
        account.failure = e.what();
      } catch (const std::bad_alloc&) {
        // The record has the reason's first 1 KB.
      }
    }
  }
  AgreeOnLoad(pg, call, account);
  WarnOnOtherWorldSize(pg, call, checkpoint);
  return checkpoint;
}

namespace {

// Which component of RestoreCheckpoint takes a key of checkpoint.optimizer.
enum class Owner { kOptimizer, kScheduler, kScaler, kPowerSgd, kAverager, kPostLocalSgd, kPlateau, kNone };

Owner OwnerOf(const std::string& key) {
  if (key == "lr" || key.rfind("state.", 0) == 0 || key.rfind("group.", 0) == 0 ||
      key.rfind("param_groups.", 0) == 0) {
    return Owner::kOptimizer;
  }
  if (key.rfind("scheduler.", 0) == 0) return Owner::kScheduler;
  if (key.rfind("scaler.", 0) == 0) return Owner::kScaler;
  if (key.rfind("powersgd.", 0) == 0) return Owner::kPowerSgd;
  if (key.rfind("averager.", 0) == 0) return Owner::kAverager;
  if (key.rfind("post_local_sgd.", 0) == 0) return Owner::kPostLocalSgd;
  if (key.rfind("plateau.", 0) == 0) return Owner::kPlateau;
  return Owner::kNone;
}

// "`a`, `b`, `c` and 4 more": a parameter-by-parameter optimizer state can
// hold hundreds of keys; the first few say what it is.
std::string KeyList(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 4;
  std::string out;
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) out += (i ? ", `" : "`") + keys[i] + "`";
  if (keys.size() > kShown) out += " and " + std::to_string(keys.size() - kShown) + " more";
  return out;
}

// What RestoreCheckpoint restores: the model (unwrapped) and the
// components given, each of which may be null.
struct RestoreTargets {
  nn::modules::Module& model;
  nn::optim::Optimizer* optimizer;
  nn::optim::LrScheduler* scheduler;
  nn::optim::GradScaler* scaler;
  PowerSgdState* powersgd;
  PeriodicModelAverager* averager;
  PostLocalSgdState* post_local_sgd;
  nn::optim::ReduceLrOnPlateau* plateau;
};

// What the scheduler's check computed, which its load sets: its
// functions are asked once per group for the check and the load together.
using CheckedSchedulerState = std::optional<nn::optim::LrScheduler::CheckedState>;

// Every reason `checkpoint` cannot be restored into `to`, checking
// everything and changing nothing; empty when it can. `scheduler_state`
// receives the scheduler's checked state when it passed its check.
std::vector<std::string> RestoreProblems(const nn::io::Checkpoint& checkpoint, const RestoreTargets& to,
                                         CheckedSchedulerState& scheduler_state, bool strict,
                                         nn::modules::IncompatibleKeys& keys) {
  // The names RestoreCheckpoint's arguments have, which its messages use.
  nn::modules::Module& target = to.model;
  auto* const optimizer = to.optimizer;
  auto* const scheduler = to.scheduler;
  auto* const scaler = to.scaler;
  auto* const powersgd = to.powersgd;
  auto* const averager = to.averager;
  auto* const post_local_sgd = to.post_local_sgd;
  auto* const plateau = to.plateau;
  std::vector<std::string> problems;
  std::map<Owner, std::vector<std::string>> unused;
  for (const auto& [key, t] : checkpoint.optimizer) {
    const Owner owner = OwnerOf(key);
    if ((owner == Owner::kOptimizer && optimizer == nullptr) || (owner == Owner::kScheduler && scheduler == nullptr) ||
        (owner == Owner::kScaler && scaler == nullptr) || (owner == Owner::kPowerSgd && powersgd == nullptr) ||
        (owner == Owner::kAverager && averager == nullptr) ||
        (owner == Owner::kPostLocalSgd && post_local_sgd == nullptr) ||
        (owner == Owner::kPlateau && plateau == nullptr) || owner == Owner::kNone) {
      unused[owner].push_back(key);
    }
  }
  for (const auto& [owner, keys] : unused) {
    switch (owner) {
      case Owner::kOptimizer:
        problems.push_back("the checkpoint holds optimizer state (" + KeyList(keys) +
                           ") and no optimizer was given: pass `optimizer`");
        break;
      case Owner::kScheduler:
        problems.push_back("the checkpoint holds learning-rate scheduler state (" + KeyList(keys) +
                           ") and no scheduler was given: pass `scheduler`");
        break;
      case Owner::kScaler:
        problems.push_back("the checkpoint holds GradScaler state (" + KeyList(keys) +
                           ") and no scaler was given: pass `scaler`");
        break;
      case Owner::kPowerSgd:
        problems.push_back("the checkpoint holds PowerSGD state (" + KeyList(keys) +
                           ") and no PowerSGD state was given: pass `powersgd`");
        break;
      case Owner::kAverager:
        problems.push_back("the checkpoint holds PeriodicModelAverager state (" + KeyList(keys) +
                           ") and no averager was given: pass `averager`");
        break;
      case Owner::kPostLocalSgd:
        problems.push_back("the checkpoint holds post-local-SGD hook state (" + KeyList(keys) +
                           ") and no PostLocalSgdState was given: pass `post_local_sgd`");
        break;
      case Owner::kPlateau:
        problems.push_back("the checkpoint holds ReduceLrOnPlateau state (" + KeyList(keys) +
                           ") and no plateau scheduler was given: pass `plateau`");
        break;
      case Owner::kNone:
        problems.push_back("optimizer-list keys that no component takes (" + KeyList(keys) +
                           "): the optimizer takes `lr`, `group.*`, `param_groups.*` and `state.*`, the scheduler "
                           "`scheduler.*`, "
                           "the scaler `scaler.*`, PowerSGD `powersgd.*`, the averager `averager.*`, "
                           "the post-local-SGD hook `post_local_sgd.*`, ReduceLrOnPlateau `plateau.*`");
        break;
    }
  }
  // Any std::exception of a check is one more problem, named by the
  // component: an invalid_argument names its part already, but another
  // kind (a LambdaSchedule's function that throws for the saved step, say)
  // would otherwise escape alone, without the other problems or the
  // component it came from.
  auto check = [&problems](const char* component, const std::function<void()>& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      problems.push_back(e.what());
    } catch (const std::exception& e) {
      problems.push_back(std::string("checking the ") + component + "'s state threw: " + e.what());
    } catch (...) {
      // A user's function (a LambdaSchedule's) may throw anything: escaping
      // here, it would skip the collective restore's exchange, and the
      // other ranks would wait for this one until the group's timeout.
      problems.push_back(std::string("checking the ") + component +
                         "'s state threw an exception that is not a std::exception");
    }
  };
  check("model", [&] { keys = target.CheckStateDict(checkpoint.model, strict); });
  // Not strict, the optimizer's part still is: its state of a parameter
  // the model skips (a replaced head's) would go to no parameter, or to
  // another one of the same name; refused, naming them, rather than
  // guessed at.
  if (optimizer != nullptr && !strict) {
    std::vector<std::string> named;
    for (const std::vector<std::string>* list : {&keys.missing, &keys.unexpected}) {
      for (const std::string& name : *list) {
        const std::string prefix = "state." + name + ".";
        for (const auto& [key, t] : checkpoint.optimizer) {
          if (key.compare(0, prefix.size(), prefix) == 0) {
            named.push_back(name);
            break;
          }
        }
      }
    }
    if (!named.empty()) {
      problems.push_back("RestoreOptions::strict = false, and the checkpoint's optimizer state names parameters "
                         "the model does not load (" +
                         KeyList(named) +
                         "): the optimizer's part is loaded strictly; to fine-tune from this checkpoint, restore "
                         "the model alone (no optimizer, and a copy of the checkpoint with its optimizer list "
                         "cleared)");
    }
  }
  if (optimizer != nullptr) check("optimizer", [&] { optimizer->CheckStateDict(checkpoint.optimizer); });
  if (scheduler != nullptr) {
    check("scheduler", [&] { scheduler_state = scheduler->CheckStateDict(checkpoint.optimizer); });
  }
  if (scaler != nullptr) check("scaler", [&] { scaler->CheckStateDict(checkpoint.optimizer); });
  const nn::modules::NamedTensors params = target.NamedParameters();
  if (powersgd != nullptr) check("powersgd", [&] { powersgd->CheckStateDict(checkpoint.optimizer, params); });
  if (averager != nullptr) check("averager", [&] { averager->CheckStateDict(checkpoint.optimizer); });
  if (post_local_sgd != nullptr) {
    check("post_local_sgd", [&] { post_local_sgd->CheckStateDict(checkpoint.optimizer); });
  }
  if (plateau != nullptr) check("plateau", [&] { plateau->CheckStateDict(checkpoint.optimizer); });
  return problems;
}

// "2 problem(s):\n  first\n  second".
std::string ProblemList(const std::vector<std::string>& problems) {
  std::string list = std::to_string(problems.size()) + " problem(s):";
  for (const std::string& p : problems) list += "\n  " + p;
  return list;
}

// Copies `checkpoint` into `to`, once RestoreProblems found nothing (and
// gave `scheduler_state`). `begun`, when given, receives the name of each
// part as its load begins: after a throw, its last entry is the part that
// threw, and the others were loaded.
void LoadRestoreTargets(const nn::io::Checkpoint& checkpoint, const RestoreTargets& to,
                        const CheckedSchedulerState& scheduler_state, bool strict,
                        std::vector<const char*>* begun = nullptr) {
  auto begin = [begun](const char* part) {
    if (begun != nullptr) begun->push_back(part);
  };
  begin("model");
  to.model.LoadStateDict(checkpoint.model, strict);
  // The optimizer before the scheduler, which sets the lr for its step.
  if (to.optimizer != nullptr) {
    begin("optimizer");
    to.optimizer->LoadStateDict(checkpoint.optimizer);
  }
  if (to.scheduler != nullptr) {
    begin("scheduler");
    to.scheduler->LoadChecked(scheduler_state.value());
  }
  if (to.scaler != nullptr) {
    begin("scaler");
    to.scaler->LoadStateDict(checkpoint.optimizer);
  }
  if (to.powersgd != nullptr) {
    begin("powersgd");
    to.powersgd->LoadStateDict(checkpoint.optimizer, to.model.NamedParameters());
  }
  if (to.averager != nullptr) {
    begin("averager");
    to.averager->LoadStateDict(checkpoint.optimizer);
  }
  if (to.post_local_sgd != nullptr) {
    begin("post_local_sgd");
    to.post_local_sgd->LoadStateDict(checkpoint.optimizer);
  }
  // After the optimizer: the plateau keeps the rate the optimizer restored.
  if (to.plateau != nullptr) {
    begin("plateau");
    to.plateau->LoadStateDict(checkpoint.optimizer);
  }
}

// Every restored object's state before a collective restore, held on the
// CPU so that a load that fails on any rank can be undone on every rank.
// Its size is RestoreOptions::rollback's cost (see checkpoint.h).
struct RestoreSnapshot {
  nn::modules::StateDict model;
  nn::modules::NamedTensors optimizer;
  std::optional<nn::optim::LrScheduler::Snapshot> scheduler;
  nn::modules::NamedTensors scaler;
  nn::modules::NamedTensors powersgd;
  nn::modules::NamedTensors averager;
  nn::modules::NamedTensors post_local_sgd;
  nn::modules::NamedTensors plateau;
};

// `fresh` (a copy nothing else holds) on the CPU: moved there when on a
// device, otherwise kept as it is.
nn::modules::NamedTensors OnCpu(nn::modules::NamedTensors fresh) {
  for (auto& [name, t] : fresh) {
    if (!t.device().is_cpu()) t = t.To(nn::kCPU);
  }
  return fresh;
}

RestoreSnapshot TakeSnapshot(const RestoreTargets& to) {
  RestoreSnapshot s;
  // The model's state dict holds handles on its memory: copied. The
  // components' StateDict give copies already (the optimizer's all at
  // once on the parameters' device, then moved here).
  for (const auto& [name, t] : to.model.GetStateDict()) {
    s.model.emplace_back(name, t.device().is_cpu() ? t.Clone() : t.To(nn::kCPU));
  }
  if (to.optimizer != nullptr) s.optimizer = OnCpu(to.optimizer->StateDict());
  if (to.scheduler != nullptr) s.scheduler = to.scheduler->TakeSnapshot();
  if (to.scaler != nullptr) s.scaler = to.scaler->StateDict();
  // With the residuals: this rank's own, which a checkpoint leaves out.
  if (to.powersgd != nullptr) s.powersgd = OnCpu(to.powersgd->StateDict(to.model.NamedParameters(), true));
  if (to.averager != nullptr) s.averager = to.averager->StateDict();
  if (to.post_local_sgd != nullptr) s.post_local_sgd = to.post_local_sgd->StateDict();
  if (to.plateau != nullptr) s.plateau = to.plateau->StateDict();
  return s;
}

// Puts back, from `s`, each part whose load began (`begun`, as
// LoadRestoreTargets fills it), the last first: the scheduler before the
// optimizer, so that the optimizer's own rates and momenta are the ones
// left. Empty when every part was put back; otherwise what threw, the
// remaining parts still put back.
std::string PutBack(const RestoreSnapshot& s, const RestoreTargets& to, const std::vector<const char*>& begun) {
  std::string failures;
  for (auto it = begun.rbegin(); it != begun.rend(); ++it) {
    const std::string part = *it;
    try {
      if (part == "model") {
        to.model.LoadStateDict(s.model, /*strict=*/true);
      } else if (part == "optimizer") {
        to.optimizer->LoadStateDict(s.optimizer);
      } else if (part == "scheduler") {
        to.scheduler->RestoreSnapshot(s.scheduler.value());
      } else if (part == "scaler") {
        to.scaler->LoadStateDict(s.scaler);
      } else if (part == "powersgd") {
        to.powersgd->LoadStateDict(s.powersgd, to.model.NamedParameters());
      } else if (part == "averager") {
        to.averager->LoadStateDict(s.averager);
      } else if (part == "post_local_sgd") {
        to.post_local_sgd->LoadStateDict(s.post_local_sgd);
      } else if (part == "plateau") {
        to.plateau->LoadStateDict(s.plateau);
      }
    } catch (const std::exception& e) {
      failures += (failures.empty() ? "putting the " : "; putting the ") + part + "'s state back threw: " + e.what();
    } catch (...) {
      failures += (failures.empty() ? "putting the " : "; putting the ") + part +
                  "'s state back threw an exception that is not a std::exception";
    }
  }
  return failures;
}

// "loading the scheduler's state threw: why (the model and the optimizer
// were loaded before it)", from LoadRestoreTargets' `begun`.
std::string LoadFailure(const std::vector<const char*>& begun, const std::string& why) {
  std::string loaded;
  for (size_t i = 0; i + 1 < begun.size(); ++i) {
    loaded += std::string(i == 0 ? "the " : i + 2 == begun.size() ? " and the " : ", the ") + begun[i];
  }
  return std::string("loading the ") + (begun.empty() ? "checkpoint" : begun.back()) + "'s state threw: " + why +
         (loaded.empty() ? " (nothing was loaded before it)"
                         : " (" + loaded + (begun.size() == 2 ? " was" : " were") + " loaded before it)");
}

// FNV-1a of the missing then the unexpected keys, each ending with a zero
// byte and the lists apart: the same on every process for the same keys.
// Allocates nothing (it runs where memory may have run out).
uint64_t KeysDigest(const nn::modules::IncompatibleKeys& keys) {
  uint64_t h = 14695981039346656037ull;
  auto add = [&h](unsigned char c) {
    h ^= c;
    h *= 1099511628211ull;
  };
  for (const std::string& k : keys.missing) {
    for (char c : k) add(static_cast<unsigned char>(c));
    add(0);
  }
  add(1);
  for (const std::string& k : keys.unexpected) {
    for (char c : k) add(static_cast<unsigned char>(c));
    add(0);
  }
  return h;
}

// The passing records (`all`, every one passing) whose keys' digest is not
// rank 0's: "ranks 1, 2 skip other keys than rank 0", or empty.
std::string RanksSkippingOtherKeys(const ProcessGroup& pg, const nn::Tensor& all) {
  auto digest = [&all](int r) {
    uint64_t d = 0;
    std::memcpy(&d, static_cast<const char*>(all.data_ptr()) + r * kRecordBytes + 1, sizeof(d));
    return d;
  };
  std::string ranks;
  int count = 0;
  for (int r = 1; r < pg.size(); ++r) {
    if (digest(r) == digest(0)) continue;
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    ++count;
  }
  if (count == 0) return "";
  return (count == 1 ? "rank " : "ranks ") + ranks + (count == 1 ? " skips" : " skip") + " other keys than rank 0";
}

// "missing keys `a`, `b` and unexpected keys none".
std::string SkippedKeys(const nn::modules::IncompatibleKeys& keys) {
  return "missing keys " + (keys.missing.empty() ? std::string("none") : KeyList(keys.missing)) +
         " and unexpected keys " + (keys.unexpected.empty() ? std::string("none") : KeyList(keys.unexpected));
}

}  // namespace

nn::modules::IncompatibleKeys RestoreCheckpoint(const nn::io::Checkpoint& checkpoint, nn::modules::Module& model,
                                                nn::optim::Optimizer* optimizer, nn::optim::LrScheduler* scheduler,
                                                nn::optim::GradScaler* scaler, PowerSgdState* powersgd,
                                                PeriodicModelAverager* averager, PostLocalSgdState* post_local_sgd,
                                                nn::optim::ReduceLrOnPlateau* plateau, const RestoreOptions& options) {
  const RestoreTargets to{Unwrap(model), optimizer, scheduler, scaler, powersgd, averager, post_local_sgd, plateau};
  // Everything is checked before anything is copied: a failure on the
  // optimizer's part must not leave the model's weights replaced.
  CheckedSchedulerState scheduler_state;
  nn::modules::IncompatibleKeys keys;
  const std::vector<std::string> problems = RestoreProblems(checkpoint, to, scheduler_state, options.strict, keys);
  if (!problems.empty()) {
    throw std::invalid_argument("RestoreCheckpoint: nothing was restored, " + ProblemList(problems));
  }
  if (!options.rollback) {
    LoadRestoreTargets(checkpoint, to, scheduler_state, options.strict);
    return keys;
  }
  // A copy that cannot be made (memory running out) throws here, before
  // anything changed.
  const RestoreSnapshot snapshot = TakeSnapshot(to);
  std::vector<const char*> begun;
  try {
    LoadRestoreTargets(checkpoint, to, scheduler_state, options.strict, &begun);
  } catch (...) {
    const std::exception_ptr load_error = std::current_exception();
    const std::string not_put_back = PutBack(snapshot, to, begun);
    if (not_put_back.empty()) throw;  // the load's own error, nothing changed
    throw std::runtime_error("RestoreCheckpoint: " + LoadFailure(begun, WhatOf(load_error)) + ", then " +
                             not_put_back + ": restore again, or rebuild the objects, before training");
  }
  return keys;
}

nn::modules::IncompatibleKeys RestoreCheckpoint(ProcessGroup& pg, const nn::io::Checkpoint& checkpoint,
                                                nn::modules::Module& model, nn::optim::Optimizer* optimizer,
                                                nn::optim::LrScheduler* scheduler, nn::optim::GradScaler* scaler,
                                                PowerSgdState* powersgd, PeriodicModelAverager* averager,
                                                PostLocalSgdState* post_local_sgd,
                                                nn::optim::ReduceLrOnPlateau* plateau, const RestoreOptions& options) {
  const RestoreTargets to{Unwrap(model), optimizer, scheduler, scaler, powersgd, averager, post_local_sgd, plateau};
  // Every rank reaches the exchange below whatever its checks found, or
  // the others would wait for it until the group's timeout. Its buffers
  // (and the comparison of the loads', which sends on the same ones) come
  // first: the one allocation this rank cannot take part without. From
  // here to the exchange, whatever throws (memory running out) is written
  // into this rank's record in place, with nothing allocated: a handler
  // that built its message would throw again, out of the call, when memory
  // is what ran out.
  // A rank that cannot make them aborts the group (AbortForFirstBuffers),
  // so that the others, already in the exchange, fail at once.
  nn::Tensor record;
  nn::Tensor all;
  nn::Tensor any_failed;
  try {
    RunFault(internal::FaultPoint::kMakingFirstBuffers);
    record = nn::Zeros({kRecordBytes}, {.dtype = nn::DType::kUInt8});
    all = nn::Empty({kRecordBytes * pg.size()}, {.dtype = nn::DType::kUInt8});
    any_failed = nn::Zeros({1}, {.dtype = nn::DType::kInt64});
  } catch (...) {
    AbortForFirstBuffers(pg, "RestoreCheckpoint", nullptr);
    throw;
  }
  bool ok = true;
  // This rank's problems in full (its record holds their first 1 KB),
  // empty when it has none or could not list them.
  std::string mine;
  CheckedSchedulerState scheduler_state;
  nn::modules::IncompatibleKeys keys;
  try {
    RunFault(internal::FaultPoint::kCheckingRestore);
    const std::vector<std::string> problems = RestoreProblems(checkpoint, to, scheduler_state, options.strict, keys);
    ok = problems.empty();
    if (!ok) mine = ProblemList(problems);
  } catch (...) {
    ok = false;
    RewriteThrown(record, "checking the checkpoint");
  }
  // Taken before the exchange, so that a rank that cannot take it (memory
  // running out) fails every rank with nothing changed.
  std::optional<RestoreSnapshot> snapshot;
  if (ok && options.rollback) {
    try {
      snapshot.emplace(TakeSnapshot(to));
    } catch (...) {
      ok = false;
      RewriteThrown(record, "copying this rank's state, to put it back if a load fails,",
                    " (RestoreOptions::rollback = false restores without one)");
    }
  }
  if (ok) {
    // A passing record carries a digest of the keys this rank skips, so
    // that ranks that would load different parts of the model (built
    // differently, with strict = false) are refused before any loads.
    char* p = static_cast<char*>(record.data_ptr());
    p[0] = 1;
    const uint64_t digest = KeysDigest(keys);
    std::memcpy(p + 1, &digest, sizeof(digest));
  } else if (!mine.empty()) {
    Rewrite(record, 0, mine.c_str());
  }
  RunFault(internal::FaultPoint::kExchangingRestoreChecks);
  // Between the checks and the first change: a rank whose peers failed
  // leaves its model as it was, so no replica goes on from another state.
  pg.AllGather(all, record, "checkpoint restore status").Wait();
  const std::string failures = FailedRanks(pg, all, mine);
  if (!failures.empty()) {
    throw std::invalid_argument("RestoreCheckpoint: nothing was restored on any rank, it failed on " + failures);
  }
  const std::string other_keys = RanksSkippingOtherKeys(pg, all);
  if (!other_keys.empty()) {
    throw std::invalid_argument(
        "RestoreCheckpoint: nothing was restored on any rank, the ranks would load different keys of the model "
        "(RestoreOptions::strict = false): " +
        other_keys + "; this rank (" + std::to_string(pg.rank()) + ") skips " + SkippedKeys(keys) +
        ": every rank must build the same model");
  }
  // A load can still throw once every check passed (a learning-rate
  // target that refuses the restored rate, memory running out). That rank
  // would throw alone while the others went on to train and then waited
  // for it at their next collective: one more all-reduce of a number tells
  // every rank, and only on a failure an all-gather names who failed and
  // why.
  std::vector<const char*> begun;
  std::exception_ptr load_error;
  try {
    LoadRestoreTargets(checkpoint, to, scheduler_state, options.strict, &begun);
  } catch (...) {
    load_error = std::current_exception();
  }
  auto own_load = [&]() -> std::string {
    return load_error ? LoadFailure(begun, WhatOf(load_error)) : std::string("loaded every part");
  };
  // Every rank that throws first puts back what it loaded (with
  // RestoreOptions::rollback): empty, or what it could not put back.
  auto put_back = [&]() -> std::string {
    if (!snapshot.has_value()) return "";
    const std::string why = PutBack(*snapshot, to, begun);
    snapshot.reset();  // the memory goes back before the throw
    return why;
  };
  static_cast<int64_t*>(any_failed.data_ptr())[0] = load_error ? 1 : 0;
  std::string not_put_back;
  // This rank's account in full (its record holds the first 1 KB), empty
  // when only its record has one.
  std::string story;
  // Whether telling the others threw before this rank's put-back ended.
  bool in_doubt = false;
  try {
    pg.AllReduce(any_failed, transport::ReduceOp::kMax, "checkpoint restore loads").Wait();
    if (static_cast<const int64_t*>(any_failed.data_ptr())[0] == 0) return keys;
    // Whatever throws from here to the all-gather (memory running out),
    // this rank still takes part in it, with a record saying what threw:
    // the others would otherwise wait for it until the group's timeout.
    try {
      not_put_back = put_back();
      RunFault(internal::FaultPoint::kTellingLoads);
      const bool ok = !load_error && not_put_back.empty();
      if (!ok) story = own_load() + (not_put_back.empty() ? "" : ", then " + not_put_back);
      // Whether a rank could not put its state back is its record's first
      // byte, since the text may be cut.
      Rewrite(record, ok ? 1 : not_put_back.empty() ? 0 : kNotPutBack, story.c_str());
    } catch (...) {
      story.clear();
      // A put-back cut short, or one that failed, leaves this rank's state
      // in doubt.
      in_doubt = snapshot.has_value() || !not_put_back.empty();
      snapshot.reset();
      // In place, with nothing allocated: memory may be what ran out.
      Rewrite(record, in_doubt ? kNotPutBack : 0, "");
      std::snprintf(static_cast<char*>(record.data_ptr()) + 1, kRecordBytes - 1,
                    "%s%s, then telling the other ranks how its load went threw: %s%s",
                    load_error ? "loading threw: " : "loaded every part", load_error ? WhatOf(load_error) : "",
                    WhatOf(std::current_exception()), in_doubt ? "; its state may not all be put back" : "");
    }
    pg.AllGather(all, record, "checkpoint restore loads").Wait();
  } catch (const DistributedError& e) {
    if (snapshot.has_value()) not_put_back = put_back();
    const std::string own = own_load();
    const std::string after =
        !options.rollback ? ""
        : !not_put_back.empty() ? "; then " + not_put_back
        : in_doubt              ? "; its state may not all be put back"
                                : "; it put every part back as it was before the call";
    throw DistributedError(transport::Status(
        e.code(), "RestoreCheckpoint: the group failed while the ranks compared their loads, after this rank " +
                      own + after + ": " + e.status().message()));
  }
  if (!options.rollback) {
    throw std::runtime_error("RestoreCheckpoint: every rank's checks passed, but loading failed on " +
                             FailedRanks(pg, all, story) +
                             "; the ranks that did not fail loaded every part: restore again on every rank before "
                             "training");
  }
  bool all_put_back = true;
  for (int r = 0; r < pg.size(); ++r) {
    if (static_cast<const char*>(all.data_ptr())[r * kRecordBytes] == kNotPutBack) all_put_back = false;
  }
  throw std::runtime_error(
      "RestoreCheckpoint: every rank's checks passed, but loading failed on " + FailedRanks(pg, all, story) +
      (all_put_back ? "; every rank put its model and components back as they were before the call"
                    : "; not every rank could put its state back as it was (said above): restore again on every "
                      "rank, or rebuild the objects, before training"));
}

}  // namespace ddp::dist
