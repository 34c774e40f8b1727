#include "ddp/process_group.h"

#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "ddp/debug_mode.h"
#include "ddp/device_ops.h"
#include "transport/fork/fork_guard.h"
#include "transport/shm/shareable.h"

namespace ddp::dist {

using transport::Clock;
using transport::Deadline;
using transport::Status;
using transport::StatusOr;
using std::chrono::milliseconds;

DistributedError::DistributedError(Status status)
    : std::runtime_error(status.ToString()), status_(std::move(status)) {}

transport::DataType ToTransportType(nn::DType dtype) {
  switch (dtype) {
    case nn::DType::kFloat32: return transport::DataType::kF32;
    case nn::DType::kFloat64: return transport::DataType::kF64;
    case nn::DType::kFloat16: return transport::DataType::kF16;
    case nn::DType::kBFloat16: return transport::DataType::kBF16;
    case nn::DType::kInt64: return transport::DataType::kI64;
    case nn::DType::kUInt8: return transport::DataType::kU8;
    case nn::DType::kInt32: return transport::DataType::kI32;
  }
  throw std::invalid_argument("dtype " + std::to_string(static_cast<int>(dtype)) +
                              " has no transport type");
}

std::string CollectiveDescription::ToString() const {
  std::string s = kind + "(";
  if (has_op) s += std::string(transport::ReduceOpName(op)) + ", ";
  if (root >= 0) s += "root " + std::to_string(root) + ", ";
  s += std::string(nn::DTypeName(dtype)) + " " + nn::ShapeToString(shape) + ")";
  return s;
}

// ------------------------------------------------------- point-to-point ----

namespace {

// Set by internal::FailNextBookkeepingForTesting: the next item's
// bookkeeping after its task throws std::bad_alloc. This hook and
// fail_next_post are read before they are exchanged: every item (this one)
// and every post in the call (both) reach them, and an exchange is a write
// to a line shared by every group's threads.
std::atomic<bool> fail_next_bookkeeping{false};

// AllGatherObject's choice between one padded all-gather and a broadcast
// per rank (size() x the longest object, in bytes; every rank must use the
// same), and the transport calls its tasks made, for the tests.
std::atomic<size_t> object_all_gather_padded_bytes{internal::kObjectAllGatherPaddedBytes};
std::atomic<uint64_t> object_all_gather_calls{0};
// Set by internal::FailNextPostForTesting: the next post on a caller's
// thread (Impl::PostHere) throws std::bad_alloc before its messages go.
std::atomic<bool> fail_next_post{false};
// Set by internal::FailNextNewGroupAfterSplitForTesting.
std::atomic<bool> fail_next_new_group_after_split{false};


// Tags of the transport's user channel: the top two bits say whose message
// it is, so that the group's own messages never match a user's Recv.
constexpr uint32_t kHeaderChannel = 1u << 30;  // a Send's header
constexpr uint32_t kMonitoredBarrierTag = 2u << 30;
// GatherObject's and ScatterObject's bytes, sent between the two ranks.
constexpr uint32_t kObjectTag = 3u << 30;

// Work::WaitFor on a point-to-point message: polls without a pause, then
// polls yielding the core, then sleeps between polls of a hundredth of the
// time slept so far, from 50 us up to 1 ms: a message that comes late is
// noticed at most 1% (or 50 us) late. Sleeps of 50 us throughout took
// 0.19-0.34 s of CPU over a sender's 1.5 s delay, a core's fifth that the
// late rank may need on a host whose cores are all busy.
constexpr int kSpinPolls = 2000;
constexpr int kYieldPolls = 2000;
constexpr std::chrono::microseconds kShortestPollSleep{50};
constexpr std::chrono::microseconds kLongestPollSleep{1000};

// A Send's header: dtype, element count, rank, and up to kHeaderDims sizes.
constexpr int kHeaderDims = 8;
constexpr size_t kHeaderWords = 3 + kHeaderDims;
using P2pHeader = std::array<int64_t, kHeaderWords>;

P2pHeader HeaderOf(const nn::Tensor& t) {
  P2pHeader h{};
  h[0] = static_cast<int64_t>(t.dtype());
  h[1] = t.numel();
  h[2] = t.dim();
  for (int64_t d = 0; d < std::min<int64_t>(t.dim(), kHeaderDims); ++d) h[3 + d] = t.size(d);
  return h;
}

// "f32 [3, 4] (48 bytes)", from a header.
std::string DescribeHeader(const P2pHeader& h) {
  const auto dtype = static_cast<nn::DType>(h[0]);
  std::string s = std::string(nn::DTypeName(dtype)) + " ";
  if (h[2] <= kHeaderDims) {
    s += nn::ShapeToString(nn::Shape(h.begin() + 3, h.begin() + 3 + h[2]));
  } else {
    s += std::to_string(h[2]) + "-d";
  }
  return s + " (" + std::to_string(h[1] * static_cast<int64_t>(nn::ElementSize(dtype))) + " bytes)";
}

// RESOURCE_EXHAUSTED "out of memory": the reason where there is no memory
// to say more. Short enough to be held in the string itself, so that
// making it allocates nothing; peers learn it with the rank that aborted.
Status OutOfMemory() noexcept { return Status(transport::StatusCode::kResourceExhausted, "out of memory"); }

// A collective or a receive wrote into the caller's `t` (undefined: nothing
// was written). Its storage's version moves, as after an in-place op, so
// that what keeps a copy made from it notices: autograd's saved tensors,
// and an optimizer's f32 master of a 16-bit parameter, which would
// otherwise write its stale value back at the next step (local SGD's
// averaged weights lost). Bumped once the transport call has returned,
// whatever its status: a failed one may have written part of the tensor.
void MarkWritten(const nn::Tensor& t) {
  if (t.defined()) t.storage()->BumpVersion();
}

}  // namespace

transport::CallOptions internal::Within(Deadline deadline) {
  const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  return {.timeout = std::max(left, milliseconds(1))};
}

// One Send or Recv of the group. It is posted in issue order (by the caller
// or the communication thread); then any thread may advance it (Poll), under
// its own mutex. Both sides post a header message (dtype, shape) and the
// payload at once; Poll looks at the header first, so that a mismatch is
// reported with both sides' sizes instead of as a truncated message.
class P2pTransfer {
 public:
  P2pTransfer(bool send, nn::Tensor tensor, int peer, uint32_t tag, int rank)
      : send_(send), tensor_(std::move(tensor)), peer_(peer), tag_(tag), rank_(rank) {}

  // Communication thread, in issue order: posts the messages.
  Status Post(transport::Communicator* comm, milliseconds timeout) {
    std::lock_guard lock(mu_);
    comm_ = comm;
    call_ = {.timeout = timeout};
    // CUDA tensors go through host memory: the copy to the host runs here,
    // after the fence made sure the producers of the tensor have finished
    // (of the data only: a parameter that requires grad is sent as well).
    host_ = tensor_.device().is_cpu() ? tensor_
                                      : (send_ ? tensor_.Detach().To(nn::kCPU)
                                               : nn::Empty(tensor_.shape(), {.dtype = tensor_.dtype()}));
    if (send_) {
      header_ = HeaderOf(tensor_);
      header_work_ = comm->SendAsync(header_.data(), kHeaderWords, transport::DataType::kI64, peer_,
                                     tag_ | kHeaderChannel, call_);
      if (tensor_.numel() > 0) {
        payload_work_ = comm->SendAsync(host_.data_ptr(), static_cast<size_t>(tensor_.numel()),
                                        ToTransportType(tensor_.dtype()), peer_, tag_, call_);
      }
    } else {
      header_work_ = comm->RecvAsync(header_.data(), kHeaderWords, transport::DataType::kI64, peer_,
                                     tag_ | kHeaderChannel, call_);
      // Posted now rather than once the header is in: the sender's header
      // goes first and Poll reads it first, so a mismatch is still reported
      // with both sizes before the payload's own failure is looked at.
      if (tensor_.numel() > 0) {
        payload_work_ = comm->RecvAsync(host_.data_ptr(), static_cast<size_t>(tensor_.numel()),
                                        ToTransportType(tensor_.dtype()), peer_, tag_, call_);
      }
    }
    return Status::Ok();
  }

  // Any thread, after Post: advances the transfer without blocking; true
  // once it finished, with its result in *status.
  bool Poll(Status* status) {
    std::lock_guard lock(mu_);
    if (!finished_ && !header_done_) {
      StatusOr<bool> header = header_work_.Test();
      if (!header.ok()) return Finish(Named(header.status(), /*header=*/true), status);
      if (!*header) return false;
      header_done_ = true;
      if (!send_) {
        const P2pHeader mine = HeaderOf(tensor_);
        if (header_[0] != mine[0] || header_[1] != mine[1]) {
          Status mismatch = transport::InvalidArgumentError(
              Name() + ": receives into " + DescribeHeader(mine) + ", rank " + std::to_string(peer_) + " sent " +
              DescribeHeader(header_));
          // Both ranks fail with this reason; the payload is cancelled
          // (a pending receive sees the abort when tested).
          comm_->Abort(mismatch);
          if (payload_work_.valid()) (void)payload_work_.Test();
          return Finish(std::move(mismatch), status);
        }
      }
    }
    if (!finished_ && payload_work_.valid()) {
      StatusOr<bool> payload = payload_work_.Test();
      if (!payload.ok()) return Finish(Named(payload.status(), /*header=*/false), status);
      if (!*payload) return false;
    }
    return Finish(Status::Ok(), status);
  }

  // The first waiter's thread, in Wait after success: a CUDA tensor
  // received through host memory gets its data. With the Work's `fence`
  // the copy is queued on the communication stream (after the fence's
  // issue event, so after the tensor's earlier users), and Wait records the
  // fence's completion event after it: every waiter's stream, on whichever
  // thread, then waits for the copy (OrderConsumer), not only the stream of
  // the waiter that queued it. Without one, on the caller's current stream.
  Status Deliver(internal::DeviceFence* fence) {
    std::lock_guard lock(mu_);
    if (send_ || tensor_.device().is_cpu()) return Status::Ok();
    // Not waited for (wait = false): the deadline is unused.
    if (fence != nullptr) return fence->ConvertOnCommStream(tensor_, host_, /*wait=*/false, Clock::now());
    // The receiving tensor may require grad (a parameter): the copy is a
    // data transfer, not an op to record.
    nn::NoGradGuard no_grad;
    tensor_.CopyFrom(host_);
    return Status::Ok();
  }

 private:
  // "ProcessGroup::Recv on rank 1 from rank 0 (tag 8)".
  std::string Name() const {
    return std::string("ProcessGroup::") + (send_ ? "Send" : "Recv") + " on rank " + std::to_string(rank_) +
           (send_ ? " to rank " : " from rank ") + std::to_string(peer_) + " (tag " + std::to_string(tag_) + ")";
  }

  // A transport failure of the header or the payload, prefixed with the
  // call, this rank, the peer and the user's tag: the transport's own text
  // names neither the call nor this rank, and a header's tag is the user's
  // plus kHeaderChannel.
  Status Named(const Status& failure, bool header) const {
    return Status(failure.code(),
                  Name() + ": " +
                      (header ? "its header (on the transport's tag " + std::to_string(tag_ | kHeaderChannel) + "): "
                              : std::string()) +
                      failure.message());
  }

  bool Finish(Status result, Status* status) {
    if (!finished_) {
      finished_ = true;
      status_ = std::move(result);
      // A host receive landed in the tensor itself (a device one is copied
      // in by Deliver, which bumps the version as every copy does).
      if (!send_ && payload_work_.valid() && tensor_.device().is_cpu()) MarkWritten(tensor_);
    }
    *status = status_;
    return true;
  }

  std::mutex mu_;
  const bool send_;
  const nn::Tensor tensor_;
  const int peer_;
  const uint32_t tag_;
  const int rank_;
  nn::Tensor host_;   // tensor_ itself, or its copy in host memory
  P2pHeader header_{};  // a send's own header; the sender's, for a receive
  transport::Communicator* comm_ = nullptr;
  transport::CallOptions call_;
  transport::Work header_work_;
  transport::Work payload_work_;
  bool header_done_ = false;
  bool finished_ = false;
  Status status_;
};

// ---------------------------------------------------------------- Work ----

namespace {

// FAILED_PRECONDITION for `what`, made in process `creator`, used in this
// process, which was forked from it: the communication thread that would
// run or finish it, and the locks that a thread of `creator` may have held
// at the fork, are that process's.
Status ForkedFromCreator(pid_t creator, const std::string& what) {
  if (Status s = transport::fork::CheckNotForkedChild(what); !s.ok()) return s;
  return transport::FailedPreconditionError(
      what + ": this process (pid " + std::to_string(getpid()) + ") was forked from pid " +
      std::to_string(creator) + ", where the process group was made; a forked child cannot use it. "
      "Make a new group in the child");
}

}  // namespace

struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  // The collective and this rank ("all_reduce bucket 3(sum, f32 [4]) on
  // rank 0"), for the waiter's own timeout.
  std::string what;
  Clock::time_point started{};
  Clock::time_point finished{};
  // How long Wait() may block: this call's timeout plus that of every
  // collective queued ahead of it (each one is bounded by its own deadline).
  Clock::duration wait_budget{};
  // Orders device work around the collective (null for CPU tensors).
  std::shared_ptr<internal::DeviceFence> fence;
  // Point-to-point: the messages, posted by the communication thread
  // (`posted`); the Work is done once all of them are.
  std::vector<std::shared_ptr<P2pTransfer>> transfers;
  bool posted = false;
  // Whether the messages were delivered (Deliver), under deliver_mu: the
  // first waiter delivers, later ones return after it. Not a once_flag:
  // glibc's pthread_once makes a futex system call on every first use, one
  // per message (measured: 8% of a small ping-pong's time).
  std::mutex deliver_mu;
  bool delivered = false;
  // The process that issued the call: in one forked from it, nothing
  // finishes the call and its lock may have been held at the fork.
  const pid_t pid = getpid();

  // The first result counts (a waiter and the communication thread may
  // both finish a point-to-point Work).
  void Finish(Status s, Clock::time_point end) {
    {
      std::lock_guard lock(mu);
      if (done) return;
      status = std::move(s);
      finished = end;
      done = true;
    }
    cv.notify_all();
  }

  // Polls the messages once (after they were posted); true once finished:
  // every one arrived, or one failed.
  bool Drive() {
    Status first;
    bool all = true;
    for (const std::shared_ptr<P2pTransfer>& t : transfers) {
      Status s;
      if (!t->Poll(&s)) {
        all = false;
      } else if (!s.ok() && first.ok()) {
        first = std::move(s);
      }
    }
    if (!all && first.ok()) return false;
    Finish(std::move(first), Clock::now());
    return true;
  }
};

void Work::Wait() {
  if (state_ == nullptr) throw std::logic_error("Work::Wait on an empty handle");
  Status s = WaitFor(Clock::now() + state_->wait_budget);
  if (!s.ok()) throw DistributedError(std::move(s));
  internal::DeviceFence* fence = state_->fence.get();
  if (!state_->transfers.empty()) {
    std::lock_guard lock(state_->deliver_mu);
    if (!state_->delivered) {
      for (const std::shared_ptr<P2pTransfer>& t : state_->transfers) {
        if (Status d = t->Deliver(fence); !d.ok()) throw DistributedError(std::move(d));
      }
      // After the copies on the communication stream: what OrderConsumer
      // makes this waiter's stream, and any later waiter's, wait for.
      if (fence != nullptr) {
        if (Status d = fence->MarkDone(); !d.ok()) throw DistributedError(std::move(d));
      }
      state_->delivered = true;
    }
  }
  if (fence != nullptr) fence->OrderConsumer();
}

Status Work::WaitFor(Deadline deadline) {
  if (state_ == nullptr) return transport::FailedPreconditionError("WaitFor on an empty Work handle");
  if (state_->pid != getpid()) {
    // A call issued before the fork: what would finish it (the
    // communication thread, the peers' messages) is the parent's, and a
    // parent thread may have held its lock at the fork. One finished by
    // then still reports its status when its lock is free.
    std::unique_lock lock(state_->mu, std::try_to_lock);
    if (lock.owns_lock() && state_->done) return state_->status;
    return ForkedFromCreator(state_->pid, "waiting for " +
                                              (state_->what.empty() ? std::string("a call") : state_->what) +
                                              " issued before the fork");
  }
  {
    std::unique_lock lock(state_->mu);
    if (!state_->cv.wait_until(lock, deadline, [&] { return state_->done || state_->posted; })) {
      return transport::TimedOutError(
          (state_->what.empty() ? std::string("collective") : state_->what) +
          ": not finished by the waiter's deadline (the collective keeps its own)");
    }
    if (state_->done) return state_->status;
  }
  // Posted messages: this thread drives them (the communication thread
  // polls them only every millisecond or so). Polled flat out at first, for
  // latency; a peer that is late (seconds, perhaps, on a host whose cores
  // are all busy, this one included) is then waited for in sleeps that
  // grow with the wait (kShortestPollSleep to kLongestPollSleep).
  Clock::time_point sleeping_since{};
  for (int polls = 0; !state_->Drive(); ++polls) {
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      return transport::TimedOutError(
          (state_->what.empty() ? std::string("point-to-point message") : state_->what) +
          ": not finished by the waiter's deadline");
    }
    if (polls >= kSpinPolls + kYieldPolls) {
      if (polls == kSpinPolls + kYieldPolls) sleeping_since = now;
      const auto slept = std::chrono::duration_cast<std::chrono::microseconds>(now - sleeping_since);
      std::this_thread::sleep_for(std::clamp(slept / 100, kShortestPollSleep, kLongestPollSleep));
    } else if (polls >= kSpinPolls) {
      std::this_thread::yield();
    }
  }
  std::lock_guard lock(state_->mu);
  return state_->status;
}

bool Work::IsCompleted() const {
  if (state_ == nullptr) return false;
  // In a forked child nothing finishes a call issued before the fork, and
  // its lock may have been held at the fork: it counts as completed, and
  // Wait reports why (a loop on IsCompleted spun forever).
  if (state_->pid != getpid()) return true;
  {
    std::lock_guard lock(state_->mu);
    if (state_->done || !state_->posted) return state_->done;
  }
  return state_->Drive();
}

std::chrono::steady_clock::time_point Work::started() const {
  if (state_ == nullptr) return {};
  // In a forked child, a parent thread may have held the lock at the fork.
  std::unique_lock lock(state_->mu, std::defer_lock);
  if (state_->pid != getpid()) {
    if (!lock.try_lock()) return {};
  } else {
    lock.lock();
  }
  return state_->started;
}

std::chrono::steady_clock::time_point Work::finished() const {
  if (state_ == nullptr) return {};
  std::unique_lock lock(state_->mu, std::defer_lock);
  if (state_->pid != getpid()) {
    if (!lock.try_lock()) return {};
  } else {
    lock.lock();
  }
  return state_->finished;
}

// ---------------------------------------------------------------- Impl ----

// The group whose task this thread is running, if any (Impl::Run).
namespace {
thread_local const ProcessGroup::Impl* tls_running_group = nullptr;

// Marks `group` as the one whose task this thread runs, for its lifetime
// (the group marked before, if any, comes back after).
class RunningTaskMark {
 public:
  explicit RunningTaskMark(const ProcessGroup::Impl* group) : outer_(tls_running_group) {
    tls_running_group = group;
  }
  ~RunningTaskMark() { tls_running_group = outer_; }
  RunningTaskMark(const RunningTaskMark&) = delete;
  RunningTaskMark& operator=(const RunningTaskMark&) = delete;

 private:
  const ProcessGroup::Impl* outer_;
};

// The recorders a group's collectives go to (ProcessGroup::set_trace);
// null when there is none.
using Traces = std::shared_ptr<const std::vector<std::shared_ptr<TraceRecorder>>>;

// Records a collective named `name` in each of `traces`.
void Record(const Traces& traces, const std::string& name, std::chrono::steady_clock::time_point start,
            std::chrono::steady_clock::time_point end, bool ok) {
  if (traces == nullptr) return;
  for (const auto& trace : *traces) {
    trace->Complete(name, "comm", start, end, "\"ok\": " + std::string(ok ? "true" : "false"));
  }
}
}  // namespace

class ProcessGroup::Impl {
 public:
  // `comm` is taken once every member is made: a failure before (no
  // memory) leaves it with the caller (NewGroup aborts it then).
  Impl(std::unique_ptr<transport::Communicator>&& comm, int rank, int size,
       const ProcessGroupOptions& options)
      : rank_(rank), size_(size), options_(options),
        on_caller_(comm != nullptr &&
                   (options.collective_thread == CollectiveThread::kCaller ||
                    (options.collective_thread == CollectiveThread::kAuto &&
                     comm->info().yields_when_idle))) {
    comm_ = std::move(comm);
    // The communication thread was counted as busy; with collectives on the
    // caller it mostly sleeps, so waits may spin again if the cores allow
    // (measured: MLP, 2 ranks on 2 cores, docs/benchmarks.md).
    const int busy = comm_ != nullptr ? comm_->info().busy_threads_per_rank : 1;
    if (on_caller_ && busy > 1) comm_->SetBusyThreadsPerRank(busy - 1);
  }

  bool on_caller() const { return on_caller_; }
  // True in a process forked from the one that made this group.
  bool forked() const { return getpid() != pid_; }
  // Null on one rank. Its const queries are safe from any thread.
  const transport::Communicator* comm() const { return comm_.get(); }

  ~Impl() { Stop(); }

  // How the communication thread runs an item.
  enum class Mode {
    kCollective,    // fingerprint-checked in debug mode, counted
    kUnchecked,     // counted, no fingerprint (it must not wait for late ranks)
    kPointToPoint,  // posts `transfers`; done once they are; not counted
  };

  // `fence` orders a collective on device tensors with the caller's stream;
  // null only for host tensors and calls without data (a barrier). No
  // default: a device collective that forgot it raced its producer kernels.
  // `own_time`: how long the item itself may run, when not the timeout.
  Work Enqueue(CollectiveDescription description, Task task,
               std::shared_ptr<internal::DeviceFence> fence, Mode mode = Mode::kCollective,
               std::vector<std::shared_ptr<P2pTransfer>> transfers = {},
               Clock::duration own_time = Clock::duration::zero()) {
    if (tls_running_group == this) {
      // It would be queued behind the task that issues it, which waits for
      // it: a stall until the deadline, then the group aborted.
      throw std::logic_error("ProcessGroup: " + description.ToString() + " was issued on rank " +
                             std::to_string(rank_) +
                             " from inside a task of the same process group (a Run/RunFenced task or a "
                             "communication hook's work); it would wait for that task, which waits for it. "
                             "Use the transport::Communicator the task is given, or issue it after the task");
    }
    auto state = std::make_shared<Work::State>();
    state->fence = std::move(fence);
    state->transfers = std::move(transfers);
    state->what = description.ToString() + " on rank " + std::to_string(rank_);
    Work work(state);
    // In a child forked after this group was made, its communication
    // thread does not exist (an item queued for it would wait out the whole
    // budget) and a parent thread may have held mu_ at the fork: refused
    // before taking it. A group made in the child is the child's own.
    if (forked()) {
      state->Finish(ForkedFromCreator(pid_, state->what), Clock::now());
      return work;
    }
    std::unique_lock lock(mu_);
    if (stopping_) {
      lock.unlock();
      state->Finish(transport::FailedPreconditionError(state->what +
                                                       ": not run: the process group is shutting down"),
                    Clock::now());
      return work;
    }
    if (own_time == Clock::duration::zero()) own_time = options_.timeout;
    // Bounded (a century) so that a long timeout times thousands of queued
    // calls cannot overflow the clock arithmetic of Wait.
    constexpr Clock::duration kMostBudget = std::chrono::hours(24 * 365 * 100);
    // What is queued or running ahead may take as long as each item's own
    // time (a monitored barrier's is twice the timeout and more), then
    // this one its own.
    const int64_t own_ms = std::chrono::ceil<milliseconds>(own_time).count();
    const int64_t budget_ms = ahead_ms_ + own_ms + options_.wait_margin.count();
    state->wait_budget = budget_ms > std::chrono::duration_cast<milliseconds>(kMostBudget).count()
                             ? kMostBudget
                             : Clock::duration(milliseconds(budget_ms));
    // Host messages with nothing queued or running ahead of them are posted
    // here, on the caller's thread, instead of waking the communication
    // thread for it (that hop was half of a small message's latency: 40-50
    // us one way against 20 us; docs/benchmarks.md). mu_ is held, so nothing
    // issued later overtakes them.
    const bool post_here = mode == Mode::kPointToPoint && state->fence == nullptr &&
                           comm_ != nullptr && queue_.empty() && running_ == 0;
    Status posted;
    // Whether the thread must be woken: for a new item, or for messages to
    // poll when it sleeps without a timeout (nothing in flight). A wake-up
    // per message would cost a context switch each on a busy core.
    bool wake = true;
    // Run here (collectives_on_caller): nothing is ahead of it.
    const bool run_here = !post_here && on_caller_ && mode != Mode::kPointToPoint &&
                          state->fence == nullptr && queue_.empty() && running_ == 0;
    if (!run_here && !thread_.joinable()) {
      // Started before the item is queued or its messages posted: a thread
      // that cannot start (std::system_error) leaves the call throwing with
      // nothing done, not with an item that runs later anyway (one
      // collective more than the caller, and the peers, expect).
      thread_ = std::thread([this] { Loop(); });
      pthread_getcpuclockid(thread_.native_handle(), &thread_clock_);
      has_clock_.store(true, std::memory_order_release);
    }
    if (mode == Mode::kPointToPoint) ReserveInFlight();
    // What the trace event of messages posted here is named, made before
    // they are posted: from the post on, nothing here may throw (the
    // caller would get no Work for messages in flight).
    const Traces trace = traces_;
    std::string trace_name;
    if (post_here && trace != nullptr) trace_name = description.ToString();
    if (post_here) {
      posted = PostHere(task, state);
      // Listed in in_flight_ (where the thread polls it) only by
      // FinishPostedHere, once its bookkeeping is done: until then nothing
      // but this call can finish the Work, so that a failure there is what
      // the Work reports (listed at once, it could be finished by the
      // thread's poll first: OK, or with the abort's text). Its room stays
      // reserved meanwhile.
      if (posted.ok()) ++p2p_pending_;
      wake = false;
    } else if (run_here) {
      // running_ keeps the thread from starting anything issued meanwhile.
      Item item{std::move(description), std::move(task), state, mode, own_ms};
      ++running_;
      ahead_ms_ += own_ms;
      // Outlives `this`: set when the task destroyed the group (Stop).
      const std::shared_ptr<std::atomic<bool>> gone = gone_;
      lock.unlock();
      RunGuarded(item, trace, gone);
      if (gone->load(std::memory_order_acquire)) return work;
      lock.lock();
      --running_;
      ahead_ms_ -= own_ms;
      if (Idle()) idle_cv_.notify_all();
      lock.unlock();
      cv_.notify_one();  // items issued meanwhile, or Stop, may wait for it
      return work;
    } else {
      queue_.push_back(Item{std::move(description), std::move(task), state, mode, own_ms});
      ahead_ms_ += own_ms;
      if (mode == Mode::kPointToPoint) ++p2p_pending_;
    }
    lock.unlock();
    if (wake) cv_.notify_one();
    if (post_here) FinishPostedHere(state, std::move(posted), trace, trace_name);
    return work;
  }

  // Returns false when it gave up on a task that ignored both its deadline
  // and the abort: the thread still runs it and was detached, so this
  // object (the communicator included) must never be freed.
  bool Stop() {
    // Once: ProcessGroup's destructor stops it, and ~Impl calls this again.
    if (stopped_) return true;
    stopped_ = true;
    std::unique_lock lock(mu_);
    // The last reference was dropped inside a task of this group (RunningTaskMark),
    // on whichever thread runs it, or by the communication thread
    // dropping a finished task.
    const bool inside_task = tls_running_group == this;
    if (inside_task || std::this_thread::get_id() == thread_.get_id()) {
      StopFromOwnWork(lock, inside_task);
      return true;
    }
    if (!thread_.joinable()) return true;
    // Let queued collectives finish within their own deadlines, as a
    // program that waited for them would have (PyTorch's gloo group drains
    // its queue the same way): a peer that comes late but in time succeeds.
    // Each one ends by its deadline at the latest, and the first failure
    // aborts the group, so the rest fail at once. The bound is what a Wait
    // on the last of them allows (their own times, one timeout for the
    // messages in flight, the wait margin); past it (a task that ignores its
    // deadline) the communicator is aborted, so that the peers fail at once.
    const Clock::time_point start = Clock::now();
    const int64_t drain_ms = std::min<int64_t>(
        ahead_ms_ + (in_flight_.empty() ? 0 : options_.timeout.count()) + options_.wait_margin.count(),
        kMostDrainMs);
    const Deadline deadline = start + milliseconds(drain_ms);
    const auto idle = [&] { return Idle(); };
    if (!idle_cv_.wait_until(lock, std::min(deadline, start + kQuietDrain), idle)) {
      std::fprintf(stderr,
                   "[ddp] process group of rank %d destroyed with %zu collective(s) unfinished (%zu queued, "
                   "%zu running, %zu point-to-point in flight): waiting up to %lld s more for them to finish "
                   "within their own deadlines\n",
                   rank_, queue_.size() + running_ + in_flight_.size(), queue_.size(), running_,
                   in_flight_.size(),
                   static_cast<long long>(
                       std::chrono::ceil<std::chrono::seconds>(deadline - Clock::now()).count()));
      std::fflush(stderr);
    }
    if (!idle_cv_.wait_until(lock, deadline, idle)) {
      const size_t pending = queue_.size() + running_ + in_flight_.size();
      lock.unlock();
      Abort(transport::AbortedError("process group of rank " + std::to_string(rank_) +
                                    " destroyed with " + std::to_string(pending) +
                                    " collective(s) unfinished past their deadlines"),
            /*cascade=*/false);
      lock.lock();
      // The abort ends every task that checks it within moments. One that
      // still runs after one more wait margin ignores its deadline and the
      // abort alike, and might never return: joining it would hang the
      // destructor. What is queued or in flight fails now; the thread is
      // left to finish the task on its own, with this object kept.
      if (!idle_cv_.wait_for(lock, options_.wait_margin, idle) && running_ > 0) {
        GiveUpOnRunningTask(lock);
        return false;
      }
    }
    stopping_ = true;
    lock.unlock();
    cv_.notify_all();
    has_clock_.store(false, std::memory_order_release);
    thread_.join();
    return true;
  }

  // Stop, past the abort, with a task (`running_`) still inside: fails the
  // queued and in-flight Works with the abort reason and detaches the
  // thread. The object is leaked by the caller, so the task may still use
  // the communicator it was given, and the thread, once the task returns,
  // sees `stopping_` and exits through this object's (kept) members.
  void GiveUpOnRunningTask(std::unique_lock<std::mutex>& lock) {
    std::deque<Item> queued = std::move(queue_);
    queue_.clear();
    for (const Item& item : queued) p2p_pending_ -= item.mode == Mode::kPointToPoint ? 1 : 0;
    Status reason = aborted_reason();
    if (reason.ok()) reason = transport::AbortedError("process group destroyed");
    // Finished where they are, under mu_ (the thread, should the task
    // return, waits for it), then cleared: in_flight_ keeps the room
    // reserved for the running item, should it be messages the thread adds
    // there when it returns, and no copy of the list is made (this runs in
    // the destructor). Lock order: mu_, then a Work's own locks, as in
    // Enqueue.
    for (const std::shared_ptr<Work::State>& state : in_flight_) {
      if (!state->Drive()) state->Finish(reason, Clock::now());
    }
    in_flight_.clear();
    stopping_ = true;
    lock.unlock();
    for (Item& item : queued) item.state->Finish(reason, Clock::now());
    std::fprintf(stderr,
                 "[ddp] process group of rank %d destroyed while a task still runs %lld ms past the abort "
                 "(it ignores its deadline and the abort): its thread is left running and the group's "
                 "memory (the communicator included) is kept for it; %zu queued collective(s) failed\n",
                 rank_, static_cast<long long>(options_.wait_margin.count()), queued.size());
    std::fflush(stderr);
    cv_.notify_all();
    has_clock_.store(false, std::memory_order_release);
    thread_.detach();
  }

  // Stop, when the last reference to the group was dropped by one of its
  // own tasks: inside the task (`inside_task`, on the communication thread
  // or on a caller's: collectives_on_caller), or by the communication
  // thread dropping a task that held it. Nothing can wait for the item that
  // runs on this very thread, and the communication thread cannot be
  // joined from itself. What is still queued or in flight fails, and so
  // does the running task's collective if it was inside it: the
  // communicator is aborted, so that peers do not wait for them. Then
  // `gone_` tells Run and the communication thread to return without
  // touching this object again; the thread is detached, or joined when
  // this is a caller's thread.
  void StopFromOwnWork(std::unique_lock<std::mutex>& lock, bool inside_task) {
    const bool on_thread = std::this_thread::get_id() == thread_.get_id();
    std::deque<Item> queued = std::move(queue_);
    queue_.clear();
    std::vector<std::shared_ptr<Work::State>> flying = std::move(in_flight_);
    in_flight_.clear();
    stopping_ = true;
    // A caller's item is over as far as the group goes: Enqueue returns
    // without counting it down (gone_), and the thread may now exit.
    if (inside_task && !on_thread && running_ > 0) --running_;
    lock.unlock();
    const size_t unfinished = queued.size() + flying.size() + (inside_task ? 1 : 0);
    if (unfinished > 0) {
      Abort(transport::AbortedError(
                "process group of rank " + std::to_string(rank_) + " destroyed by a task of its own on " +
                (on_thread ? "its communication thread" : "the caller's thread") + " with " +
                std::to_string(unfinished) + " collective(s) unfinished"),
            /*cascade=*/false);
    }
    Status reason = aborted_reason();
    if (reason.ok()) reason = transport::FailedPreconditionError("process group destroyed");
    for (Item& item : queued) item.state->Finish(reason, Clock::now());
    for (const std::shared_ptr<Work::State>& state : flying) {
      if (!state->Drive()) state->Finish(reason, Clock::now());
    }
    has_clock_.store(false, std::memory_order_release);
    gone_->store(true, std::memory_order_release);
    if (on_thread) {
      thread_.detach();
    } else if (thread_.joinable()) {
      cv_.notify_all();
      thread_.join();
    }
  }

  // `cascade`: also abort the live groups made from this one (NewGroup),
  // so that none of their ranks waits out its deadline for a rank that gave
  // up; they get the reason this group settled on (the first, perhaps a
  // peer's). Not when this group is merely destroyed: a subgroup may
  // outlive it.
  void Abort(const Status& given, bool cascade = true) {
    // An OK reason would leave a group without a communicator unaborted
    // (the communicator itself takes it as "no reason given"): the same
    // here, so that every group stops alike.
    const Status reason =
        given.ok() ? transport::AbortedError("ProcessGroup::Abort was called with an OK status (no reason given)")
                   : given;
    if (comm_ != nullptr) {
      comm_->Abort(reason);
    } else {
      std::lock_guard lock(abort_mu_);
      if (aborted_.ok()) aborted_ = reason;
    }
    if (!cascade) return;
    Status settled = aborted_reason();
    if (settled.ok()) settled = reason;
    std::vector<std::weak_ptr<ProcessGroup>> children;
    {
      std::lock_guard lock(abort_mu_);
      children = children_;
    }
    for (const auto& weak : children) {
      if (std::shared_ptr<ProcessGroup> child = weak.lock()) child->Abort(settled);
    }
  }

  // A group made from this one; aborted at once if this one already is.
  void AddChild(const std::shared_ptr<ProcessGroup>& child) {
    {
      std::lock_guard lock(abort_mu_);
      std::erase_if(children_, [](const std::weak_ptr<ProcessGroup>& w) { return w.expired(); });
      children_.push_back(child);
    }
    if (const Status reason = aborted_reason(); !reason.ok()) child->Abort(reason);
  }

  // The host's ranks exchange through shared memory (on one host, or inside
  // each host of several).
  bool host_shared_memory() const {
    return comm_ != nullptr && (comm_->info().shared_memory || comm_->info().host_shared_memory);
  }

  Status aborted_reason() const {
    if (comm_ != nullptr) return comm_->aborted_reason();
    std::lock_guard lock(abort_mu_);
    return aborted_;
  }

  // Each user's recorder gets every collective: a second wrapper with a
  // trace of its own on this group must not take the first one's over
  // (which then recorded nothing more, not even after the second ended).
  // A new list replaces the old, so that a collective running keeps the
  // one it started with without holding mu_.
  void set_trace(std::shared_ptr<TraceRecorder> trace) {
    std::lock_guard lock(mu_);
    if (trace == nullptr) {
      traces_.reset();
      return;
    }
    auto traces = std::make_shared<std::vector<std::shared_ptr<TraceRecorder>>>();
    if (traces_ != nullptr) *traces = *traces_;
    if (std::find(traces->begin(), traces->end(), trace) == traces->end()) traces->push_back(std::move(trace));
    traces_ = std::move(traces);
  }
  void StopTrace(const TraceRecorder* trace) {
    std::lock_guard lock(mu_);
    if (traces_ == nullptr) return;
    auto traces = std::make_shared<std::vector<std::shared_ptr<TraceRecorder>>>();
    for (const auto& t : *traces_) {
      if (t.get() != trace) traces->push_back(t);
    }
    if (traces->empty()) {
      traces_.reset();
    } else {
      traces_ = std::move(traces);
    }
  }

  std::chrono::nanoseconds CpuTime() const {
    if (!has_clock_.load(std::memory_order_acquire)) return std::chrono::nanoseconds(0);
    timespec ts{};
    if (clock_gettime(thread_clock_, &ts) != 0) return std::chrono::nanoseconds(0);
    return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
  }

  uint64_t run_count() const { return run_count_.load(std::memory_order_relaxed); }
  // 1, 2, ...: the number of this group's next monitored barrier.
  uint64_t NextMonitoredBarrier() { return monitored_barriers_.fetch_add(1) + 1; }

 private:
  struct Item {
    CollectiveDescription description;
    Task task;
    std::shared_ptr<Work::State> state;
    Mode mode = Mode::kCollective;
    int64_t own_ms = 0;  // how long it may run (Enqueue)
  };

  // Runs a point-to-point item's `task` (posting its messages) on the
  // caller's thread, under mu_; marks `state` posted when it succeeded.
  // Never throws: some messages may be posted when something fails.
  Status PostHere(const Task& task, const std::shared_ptr<Work::State>& state) noexcept {
    const Clock::time_point start = Clock::now();
    {
      std::lock_guard state_lock(state->mu);
      state->started = start;
    }
    Status status;
    // Consumed by this post even on an aborted group, so that it never
    // fires later on another; loaded first, so that a post when it is not
    // armed does not write the shared flag.
    const bool fail_post =
        fail_next_post.load(std::memory_order_relaxed) && fail_next_post.exchange(false, std::memory_order_relaxed);
    try {
      status = aborted_reason();
      if (!status.ok()) {
        // Worded as Run words it for messages queued behind other work; the
        // abort's own reason when there is no memory for that. The abort
        // comes before a failure of this post: it is why nothing went.
        try {
          return Status(status.code(), "not run: the group was aborted: " + status.message());
        } catch (...) {
          return status;
        }
      }
      if (fail_post) throw std::bad_alloc();
      try {
        status = task(comm_.get(), start + options_.timeout);
      } catch (const std::exception& e) {
        status = transport::InternalError(std::string("posting a message threw: ") + e.what());
      } catch (...) {
        status = transport::InternalError("posting a message threw an exception that is not a std::exception");
      }
    } catch (...) {
      // No memory to say why in full. The reason is the peers' too
      // (FinishPostedHere aborts the group with it): it names this rank
      // when there is memory for that, else it says "out of memory", short
      // enough to be held in the string itself (OutOfMemory).
      try {
        return transport::ResourceExhaustedError("rank " + std::to_string(rank_) +
                                                 " ran out of memory while posting a point-to-point message");
      } catch (...) {
        return OutOfMemory();
      }
    }
    if (status.ok()) {
      std::lock_guard state_lock(state->mu);
      state->posted = true;
    }
    return status;
  }

  // After PostHere, with mu_ released: records the trace event (named
  // `trace_name`); then lists posted messages in in_flight_ for the thread
  // to poll, or, when the post failed, aborts the group and fails the Work.
  // Never throws, as RunGuarded: the messages may be in flight and the
  // caller gets the Work. Bookkeeping that runs out of memory
  // (internal::FailNextBookkeepingForTesting stands for that) fails the
  // Work with RESOURCE_EXHAUSTED naming it, or, when the post had failed
  // already, with the post's failure and a note of its own, and aborts the
  // group (with that first failure), so that the peer does not wait for
  // what this rank cannot follow. The Work is not listed then: nothing
  // else finishes it first.
  void FinishPostedHere(const std::shared_ptr<Work::State>& state, Status posted, const Traces& trace,
                        const std::string& trace_name) noexcept {
    const Clock::time_point end = Clock::now();
    bool listed = false;
    try {
      if (fail_next_bookkeeping.load(std::memory_order_relaxed) &&
          fail_next_bookkeeping.exchange(false, std::memory_order_relaxed)) {
        throw std::bad_alloc();
      }
      Record(trace, trace_name, state->started, end, posted.ok());
      if (posted.ok()) {
        ListPostedHere(state, /*list=*/true);
        listed = true;
        return;
      }
      if (aborted_reason().ok()) Abort(posted);
      state->Finish(transport::Status(posted.code(), state->what + ": " + posted.message()), end);
    } catch (...) {
      const bool post_failed = !posted.ok();
      if (!post_failed && !listed) ListPostedHere(state, /*list=*/false);
      // The first failure counts: a post that failed already (the group
      // aborted before it, the transport's refusal) keeps its own reason.
      // OutOfMemory when there is no memory for more.
      Status reason = OutOfMemory();
      bool named = false;
      try {
        std::string text;
        try {
          throw;
        } catch (const std::exception& e) {
          text = e.what();
        } catch (...) {
          text = "an exception not derived from std::exception";
        }
        reason = post_failed ? Status(posted.code(), state->what + ": " + posted.message() +
                                                         " (and its bookkeeping failed: " + text + ")")
                             : transport::ResourceExhaustedError("could not post " + state->what +
                                                                 ": its bookkeeping failed: " + text);
        named = true;
      } catch (...) {
      }
      try {
        if (!post_failed) {
          Abort(reason);
        } else if (aborted_reason().ok()) {
          Abort(posted);
        }
      } catch (...) {
      }
      if (post_failed && !named) reason = std::move(posted);  // its own text, without the call's name
      state->Finish(std::move(reason), end);
    }
  }

  // FinishPostedHere, for messages that were posted: the room Enqueue kept
  // for them (p2p_pending_) is theirs in in_flight_ (`list`, waking the
  // thread when nothing else was listed: it sleeps without a timeout then),
  // or is given up (their Work failed).
  // The count goes down only once the Work is listed: should the listing
  // throw, FinishPostedHere gives the room up (`list` false), and the count
  // is taken down once, never twice (a size_t below 0 would make every later
  // reservation fail).
  void ListPostedHere(const std::shared_ptr<Work::State>& state, bool list) {
    std::unique_lock lock(mu_);
    if (!list) {
      --p2p_pending_;
      return;
    }
    const bool wake = in_flight_.empty();
    in_flight_.push_back(state);  // never allocates: room reserved (ReserveInFlight)
    --p2p_pending_;
    lock.unlock();
    if (wake) cv_.notify_one();
  }

  // Under mu_, before a point-to-point item is queued or posted: room in
  // in_flight_ for it and for every one queued or running ahead
  // (p2p_pending_), so that adding a posted item there never allocates. On
  // the communication thread a std::bad_alloc there ended the process, and
  // on the caller's it left the call throwing with its messages posted; a
  // throw here leaves nothing done.
  void ReserveInFlight() {
    const size_t needed = in_flight_.size() + p2p_pending_ + 1;
    if (needed > in_flight_.capacity()) in_flight_.reserve(std::max(needed, 2 * in_flight_.capacity()));
  }

  // Under mu_.
  bool Idle() const { return queue_.empty() && running_ == 0 && in_flight_.empty(); }

  // Polls the posted point-to-point Works once; drops the finished ones.
  // Called with `lock` held; releases it while polling. When `stopping`,
  // Works still unfinished are failed (Stop aborted the communicator, so
  // their messages were cancelled).
  void PollInFlight(std::unique_lock<std::mutex>& lock, bool stopping) {
    // One at a time, by index, with no copy of the list (a copy's
    // std::bad_alloc on this thread ended the process): only this thread
    // removes entries, so those not yet polled stay where they are; posts
    // on a caller's thread add theirs at the end meanwhile (polled next
    // time: a caller posting without pause must not keep the thread here),
    // and Stop's last resorts empty the list.
    const size_t listed = in_flight_.size();
    for (size_t i = 0; i < listed && i < in_flight_.size(); ++i) {
      const std::shared_ptr<Work::State> state = in_flight_[i];
      lock.unlock();
      try {
        if (!state->Drive() && stopping) {
          Status reason = aborted_reason();
          state->Finish(reason.ok() ? transport::FailedPreconditionError(
                                          "process group destroyed with a message in flight")
                                    : reason,
                        Clock::now());
        }
      } catch (...) {
        // No memory to report a mismatch or the abort's reason (out of
        // this thread it ended the process): the messages fail, and so
        // does the group, so that the peer does not wait for them.
        Status reason = OutOfMemory();
        try {
          reason = transport::ResourceExhaustedError(state->what + ": no memory to follow its messages");
        } catch (...) {
        }
        try {
          Abort(reason);
        } catch (...) {
        }
        state->Finish(std::move(reason), Clock::now());
      }
      lock.lock();
    }
    std::erase_if(in_flight_, [](const std::shared_ptr<Work::State>& state) {
      std::lock_guard state_lock(state->mu);
      return state->done;
    });
    if (Idle()) idle_cv_.notify_all();
  }

  // Runs one item, on the communication thread or (collectives_on_caller)
  // on the caller's; running_ counts it and mu_ is not held. Returns whether
  // it posted point-to-point messages that are still in flight.
  bool Run(Item& item, const Traces& trace) {
    // Outlives `this`: set when the task dropped the last reference to the
    // group, which was then destroyed inside it (StopFromOwnWork).
    const std::shared_ptr<std::atomic<bool>> gone = gone_;
    const Clock::time_point start = Clock::now();
    {
      std::lock_guard state_lock(item.state->mu);
      item.state->started = start;
    }
    const uint64_t sequence =
        item.mode == Mode::kPointToPoint ? 0 : run_count_.fetch_add(1, std::memory_order_relaxed);
    // What a failure of this item says first: the collective, its number
    // and this rank (the transport's status names neither).
    const std::string named =
        item.description.ToString() +
        (item.mode == Mode::kPointToPoint ? std::string(" on rank ")
                                          : " (collective #" + std::to_string(sequence) + " on rank ") +
        std::to_string(rank_) + (item.mode == Mode::kPointToPoint ? ": " : "): ");
    Status status = aborted_reason();
    if (!status.ok()) {
      status = Status(status.code(), named + "not run: the group was aborted: " + status.message());
    } else {
      const Deadline deadline = start + options_.timeout;
      try {
        if (options_.debug_detail && comm_ != nullptr && size_ > 1 &&
            item.mode == Mode::kCollective) {
          status = CheckFingerprints(*comm_, rank_, size_, sequence, item.description.ToString(),
                                     deadline);
        }
        internal::DeviceFence* fence = item.state->fence.get();
        if (status.ok() && fence != nullptr) status = fence->WaitReady(deadline);
        if (status.ok()) {
          // A task that issues work on this group would wait for itself
          // (nothing else runs until it returns): Enqueue refuses that.
          const RunningTaskMark mark(this);
          status = item.task(comm_.get(), deadline);
        }
        if (status.ok() && fence != nullptr) status = fence->MarkDone();
      } catch (const std::exception& e) {
        status = transport::InternalError(item.description.ToString() + " threw: " + e.what());
      } catch (...) {
        status = transport::InternalError(item.description.ToString() +
                                          " threw an exception that is not a std::exception");
      }
      if (gone->load(std::memory_order_acquire)) {
        // Destroyed inside the task: the communicator was aborted (and
        // freed) already. Only the item, which the caller owns, is left.
        if (status.ok() && item.mode == Mode::kPointToPoint) {
          status = transport::AbortedError("the process group was destroyed by this task");
        }
        if (!status.ok()) status = Status(status.code(), named + status.message());
        Record(trace, item.description.ToString(), start, Clock::now(), status.ok());
        item.state->Finish(std::move(status), Clock::now());
        return false;
      }
      if (!status.ok()) {
        // The peers learn the transport's reason; this rank's Work says
        // which of its collectives failed.
        Abort(status);
        status = Status(status.code(), named + status.message());
      }
    }
    if (fail_next_bookkeeping.load(std::memory_order_relaxed) &&
        fail_next_bookkeeping.exchange(false, std::memory_order_relaxed)) {
      throw std::bad_alloc();
    }
    const Clock::time_point end = Clock::now();
    Record(trace, item.description.ToString(), start, end, status.ok());
    const bool posted = status.ok() && item.mode == Mode::kPointToPoint;
    if (posted) {
      {
        std::lock_guard state_lock(item.state->mu);
        item.state->posted = true;
      }
      item.state->cv.notify_all();
    } else {
      item.state->Finish(std::move(status), end);
    }
    return posted;
  }

  // Run, which must not throw: the item's own exceptions are caught
  // inside, but its bookkeeping (naming it, its trace event) may still run
  // out of memory. Out of the communication thread that ended the process;
  // out of a caller's thread it left the item counted as running, so that
  // nothing queued after it ever started. The item fails instead, and the
  // group (when the item did not destroy it: `gone`) is aborted, so that
  // the peers do not wait for this rank's part of it.
  bool RunGuarded(Item& item, const Traces& trace, const std::shared_ptr<std::atomic<bool>>& gone) noexcept {
    try {
      return Run(item, trace);
    } catch (...) {
      Status reason = OutOfMemory();
      try {
        std::string text;
        try {
          throw;
        } catch (const std::exception& e) {
          text = e.what();
        } catch (...) {
          text = "an exception not derived from std::exception";
        }
        // Nothing of `this` is read: the item may have destroyed it.
        reason = transport::ResourceExhaustedError("could not run " + item.state->what +
                                                   ": its bookkeeping failed: " + text);
        if (!gone->load(std::memory_order_acquire)) Abort(reason);
      } catch (...) {
        // No memory for the reason either: the item fails, and the peers
        // learn, that this rank ran out of memory (OutOfMemory).
        if (!gone->load(std::memory_order_acquire)) {
          try {
            Abort(reason);
          } catch (...) {
          }
        }
      }
      item.state->Finish(std::move(reason), Clock::now());
      return false;
    }
  }

  void Loop() {
    if (options_.comm_thread_nice != 0) {
      // Per-thread on Linux: the thread id names this thread only.
      const int current = getpriority(PRIO_PROCESS, 0);
      setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)),
                  current + options_.comm_thread_nice);
    }
    // Outlives `this`: set when the group was destroyed on this thread.
    const std::shared_ptr<std::atomic<bool>> gone = gone_;
    std::unique_lock lock(mu_);
    while (true) {
      // An item running on a caller's thread (running_) goes first.
      const auto ready = [&] { return (stopping_ || !queue_.empty()) && running_ == 0; };
      if (in_flight_.empty()) {
        // Also wakes for messages posted on a caller's thread.
        cv_.wait(lock, [&] { return ready() || !in_flight_.empty(); });
      } else {
        // Messages in flight: poll them now and then, so that they complete
        // (and meet their deadline) even when nobody waits for them.
        cv_.wait_for(lock, kInFlightPollInterval, ready);
        PollInFlight(lock, stopping_ && queue_.empty());
      }
      if (queue_.empty() || running_ > 0) {
        if (stopping_ && queue_.empty() && in_flight_.empty() && running_ == 0) return;
        continue;
      }
      Item item = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
      const Traces trace = traces_;
      lock.unlock();
      const bool posted = RunGuarded(item, trace, gone);
      // The task goes before mu_ is taken again: it may hold the last
      // reference to this group, whose destructor then runs here, on this
      // very thread (Stop sees that, takes mu_ itself and sets `gone`
      // instead of joining), after which nothing of `this` may be touched.
      // So may the task itself, while it ran (Run saw `gone` then).
      item.task = nullptr;
      if (gone->load(std::memory_order_acquire)) return;
      lock.lock();
      --running_;
      ahead_ms_ -= item.own_ms;
      if (item.mode == Mode::kPointToPoint) {
        // Never allocates: Enqueue reserved room for it (ReserveInFlight).
        if (posted) in_flight_.push_back(item.state);
        --p2p_pending_;
      }
      if (Idle()) idle_cv_.notify_all();
    }
  }

  // How often the thread polls messages in flight while it has nothing
  // else to do (a waiter drives its own messages without this delay).
  static constexpr milliseconds kInFlightPollInterval{1};
  // Stop waits this long for unfinished collectives before it says on
  // stderr what it waits for.
  static constexpr milliseconds kQuietDrain{2000};
  // Stop's longest wait (a century, as a Work's wait budget): many queued
  // calls of a long timeout must not overflow the clock arithmetic.
  static constexpr int64_t kMostDrainMs = int64_t{100} * 365 * 24 * 3600 * 1000;

  std::unique_ptr<transport::Communicator> comm_;
  const int rank_;
  const int size_;
  const ProcessGroupOptions options_;
  const pid_t pid_ = getpid();  // the process that made the group

  std::mutex mu_;
  std::condition_variable cv_;       // the thread waits for work
  std::condition_variable idle_cv_;  // Stop waits for the queue to drain
  std::deque<Item> queue_;
  // Point-to-point Works posted and not yet finished.
  std::vector<std::shared_ptr<Work::State>> in_flight_;
  // Point-to-point items queued or running on the communication thread, or
  // posted on a caller's thread and not yet listed (FinishPostedHere):
  // in_flight_ has room for them (ReserveInFlight).
  size_t p2p_pending_ = 0;
  size_t running_ = 0;  // items running, on the thread or on a caller's
  // The sum of the own times of the items queued and running, in ms (int64:
  // no overflow even for many calls of a 30-day timeout): how long a new
  // item may wait before it starts.
  int64_t ahead_ms_ = 0;
  const bool on_caller_;
  bool stopping_ = false;
  bool stopped_ = false;  // Stop ran (only the destroying thread touches it)
  std::thread thread_;
  Traces traces_;  // null: no recorder (set_trace)
  clockid_t thread_clock_{};
  std::atomic<bool> has_clock_{false};
  std::atomic<uint64_t> run_count_{0};
  std::atomic<uint64_t> monitored_barriers_{0};
  // Shared with the communication thread: set once this object is destroyed
  // by one of its own tasks or on that thread (StopFromOwnWork): Run and the
  // thread must then return at once.
  const std::shared_ptr<std::atomic<bool>> gone_ = std::make_shared<std::atomic<bool>>(false);

  mutable std::mutex abort_mu_;
  Status aborted_;  // one-process groups only; otherwise the communicator's
  std::vector<std::weak_ptr<ProcessGroup>> children_;  // made by NewGroup
};

// -------------------------------------------------------- ProcessGroup ----

namespace {

// The environment variables a group reads when it is made, read once and
// without throwing: a group of several ranks shares the bad values in
// CheckDebugModeAgrees, so that all of them stop together.
struct Environment {
  DebugSetting debug;
  std::optional<CollectiveThread> collective_thread;  // set and valid
  std::optional<std::string> bad_collective_thread;   // set and not valid
};

Environment ReadEnvironment() {
  Environment env;
  env.debug = DebugSettingFromEnvironment();
  if (const char* v = std::getenv("DDP_COLLECTIVE_THREAD"); v != nullptr && *v != '\0') {
    // Any case, as DDP_DEBUG: "Caller" is no less clear than "caller".
    std::string value = v;
    std::transform(value.begin(), value.end(), value.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (value == "auto") {
      env.collective_thread = CollectiveThread::kAuto;
    } else if (value == "comm") {
      env.collective_thread = CollectiveThread::kCommThread;
    } else if (value == "caller") {
      env.collective_thread = CollectiveThread::kCaller;
    } else {
      env.bad_collective_thread = std::string(v);  // as set, for the message
    }
  }
  return env;
}

// Where no peer waits (Single, a group of one rank): a bad value throws at once.
void RefuseBadEnvironment(const Environment& env) {
  if (env.debug.bad_value) {
    throw std::invalid_argument("DDP_DEBUG=" + QuotedEnvValue(*env.debug.bad_value) + ": " + kDebugAccepted);
  }
  if (env.bad_collective_thread) {
    throw std::invalid_argument("DDP_COLLECTIVE_THREAD=" + QuotedEnvValue(*env.bad_collective_thread) + ": " +
                                kCollectiveThreadAccepted);
  }
}

// `options` with the environment's settings over them. Throws only for the
// options' own errors (the timeout, the wait margin), which the caller gave
// every rank alike.
ProcessGroupOptions WithEnvironment(ProcessGroupOptions options, const Environment& env) {
  if (env.debug.level == DebugLevel::kDetail) options.debug_detail = true;
  if (env.collective_thread) options.collective_thread = *env.collective_thread;
  if (options.timeout.count() <= 0) {
    throw std::invalid_argument("ProcessGroupOptions::timeout must be positive, got " +
                                std::to_string(options.timeout.count()) + " ms");
  }
  if (options.timeout > kMostTimeout) {
    throw std::invalid_argument("ProcessGroupOptions::timeout is at most 30 days (" +
                                std::to_string(kMostTimeout.count()) + " ms), got " +
                                std::to_string(options.timeout.count()) +
                                " ms: every collective needs a deadline that can pass");
  }
  if (options.wait_margin.count() < 0 || options.wait_margin > kMostTimeout) {
    throw std::invalid_argument("ProcessGroupOptions::wait_margin must be in [0, " +
                                std::to_string(kMostTimeout.count()) + "] ms, got " +
                                std::to_string(options.wait_margin.count()) + " ms");
  }
  return options;
}

}  // namespace

ProcessGroup::ProcessGroup(std::unique_ptr<transport::Communicator>&& comm, int rank, int size,
                           ProcessGroupOptions options, DebugLevel debug_level)
    : rank_(rank), size_(size), root_rank_(rank), options_(options), debug_level_(debug_level) {
  impl_ = std::make_unique<Impl>(std::move(comm), rank_, size_, options_);
}

// Bad environment values count as unset in the delegation: the body below
// shares them with the peers, which all refuse them together.
ProcessGroup::ProcessGroup(std::unique_ptr<transport::Communicator> comm,
                           ProcessGroupOptions options)
    : ProcessGroup(nullptr, 0, 1, WithEnvironment(options, ReadEnvironment()), DebugLevel{}) {
  if (comm == nullptr) throw std::invalid_argument("ProcessGroup: communicator is null");
  rank_ = comm->rank();
  size_ = comm->size();
  root_rank_ = rank_;
  // Read again, once, for this group: what is shared below is what it uses.
  const Environment env = ReadEnvironment();
  options_ = WithEnvironment(options, env);
  debug_level_ = env.debug.level;
  if (size_ > 1) {
    // Throws std::invalid_argument on every rank when any rank's DDP_DEBUG
    // or DDP_COLLECTIVE_THREAD is bad, after all of them have taken part.
    const transport::Status agreed =
        CheckDebugModeAgrees(*comm, options_.debug_detail, env.debug.bad_value,
                             env.bad_collective_thread, transport::Clock::now() + options_.timeout);
    if (!agreed.ok()) throw DistributedError(agreed);
  } else {
    RefuseBadEnvironment(env);
  }
  impl_ = std::make_unique<Impl>(std::move(comm), rank_, size_, options_);
  if (size_ > 1 && impl_->host_shared_memory()) ShareLargeCpuBlocks();
}

namespace internal {

void KeepForever(std::shared_ptr<void> object) {
  // Leaked with the objects: destroying it at exit would free them under
  // the thread or task that still uses them.
  static std::mutex* mu = new std::mutex;
  static auto* kept = new std::vector<std::shared_ptr<void>>;
  std::lock_guard lock(*mu);
  kept->push_back(std::move(object));
}

}  // namespace internal

ProcessGroup::~ProcessGroup() {
  // In a process forked from this one, the communication thread does not
  // exist and the parent's may have held the locks: stopping it would hang.
  // The child's copy is left as it is (the communicator does the same).
  if (impl_->forked()) {
    static_cast<void>(impl_.release());
    return;
  }
  // A task that ignores its deadline and the abort still runs on the
  // communication thread, which was detached: the group's memory stays for
  // it (Impl::Stop said so on stderr).
  if (!impl_->Stop()) internal::KeepForever(std::move(impl_));
}

bool ProcessGroup::collectives_on_caller() const { return impl_->on_caller(); }

std::vector<std::pair<int64_t, int64_t>> ProcessGroup::ThroughPieces(int64_t numel,
                                                                    nn::DType dtype) const {
  // A negative count would reach the transport as a count near 2^64 (its
  // slice cut into billions of pieces).
  if (numel < 0) {
    throw std::invalid_argument("ProcessGroup::ThroughPieces: numel " + std::to_string(numel) + " is negative");
  }
  const transport::Communicator* comm = impl_->comm();
  if (comm == nullptr) return {{0, numel}};
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (const auto& [offset, count] :
       comm->ThroughPieces(static_cast<size_t>(numel), ToTransportType(dtype))) {
    pieces.emplace_back(static_cast<int64_t>(offset), static_cast<int64_t>(count));
  }
  return pieces;
}

std::shared_ptr<ProcessGroup> ProcessGroup::CreateFromEnvironment(
    ProcessGroupOptions options, transport::CommunicatorOptions comm_options) {
  if (comm_options.timeout == transport::CommunicatorOptions{}.timeout) {
    comm_options.timeout = options.timeout;
  }
  // The caller's thread computes while this group's thread waits in
  // collectives (DDP's backward): two busy threads per rank.
  if (comm_options.busy_threads_per_rank == 0) comm_options.busy_threads_per_rank = 2;
  auto comm = transport::Communicator::CreateFromEnvironment(comm_options);
  if (!comm.ok()) {
    if (comm.status().code() == transport::StatusCode::kNotFound) return Single(options);
    throw DistributedError(comm.status());
  }
  return std::make_shared<ProcessGroup>(std::move(*comm), options);
}

std::shared_ptr<ProcessGroup> ProcessGroup::Single(ProcessGroupOptions options) {
  const Environment env = ReadEnvironment();
  RefuseBadEnvironment(env);  // no peer waits
  return std::shared_ptr<ProcessGroup>(
      new ProcessGroup(nullptr, 0, 1, WithEnvironment(options, env), env.debug.level));
}

void ProcessGroup::CheckTensor(const nn::Tensor& t, const char* call, const char* what) {
  const std::string where = std::string("ProcessGroup::") + call + ": " + what;
  if (!t.defined()) throw std::invalid_argument(where + " is undefined");
  internal::CheckCollectiveDevice(t.device(), where);
  if (!t.is_contiguous()) {
    throw std::invalid_argument(where + " is not contiguous (shape " + nn::ShapeToString(t.shape()) +
                                ", strides " + nn::ShapeToString(t.strides()) + ")");
  }
}

namespace {

// The fence of a collective on `tensors`: null when they are CPU tensors;
// throws when they are on two devices.
std::shared_ptr<internal::DeviceFence> FenceFor(const std::vector<nn::Tensor>& tensors,
                                                const char* call) {
  const nn::Device device = tensors.at(0).device();
  for (const nn::Tensor& t : tensors) {
    if (t.device() != device) {
      throw std::invalid_argument(std::string("ProcessGroup::") + call + ": tensors on " +
                                  device.ToString() + " and " + t.device().ToString() +
                                  "; one collective uses one device");
    }
  }
  if (device.is_cpu()) return nullptr;
  return internal::MakeFence(device, tensors);
}

void CheckRoot(int root, int size, const char* call, const char* what) {
  if (root < 0 || root >= size) {
    throw std::invalid_argument(std::string("ProcessGroup::") + call + ": " + what + " " +
                                std::to_string(root) + " is outside a group of size " +
                                std::to_string(size));
  }
}

// The list forms of the rooted collectives stage through host memory.
void CheckHost(const nn::Tensor& t, const char* call, const std::string& what) {
  if (!t.device().is_cpu()) {
    throw std::invalid_argument(std::string("ProcessGroup::") + call + ": " + what + " is on " +
                                t.device().ToString() + "; " + call + " takes CPU tensors");
  }
}

// "f32 [2, 3]".
std::string TypeAndShape(const nn::Tensor& t) {
  return std::string(nn::DTypeName(t.dtype())) + " " + nn::ShapeToString(t.shape());
}

// Throws std::invalid_argument when `written` and `read` (contiguous, as
// CheckTensor made sure) share memory, unless `written` starts exactly
// `in_place` bytes after `read` (the transport's in-place layout for this
// collective, which `rule` states; no `in_place`: they must not overlap at
// all). The transport would refuse the layout too, but by aborting the
// communicator for every rank; the layout is this rank's own argument error.
void CheckOverlap(const char* call, const nn::Tensor& written, const char* written_name,
                  const nn::Tensor& read, const char* read_name,
                  std::optional<std::ptrdiff_t> in_place, const char* rule) {
  if (written.nbytes() == 0 || read.nbytes() == 0) return;
  const auto w = reinterpret_cast<uintptr_t>(written.data_ptr());
  const auto r = reinterpret_cast<uintptr_t>(read.data_ptr());
  if (!(w < r + read.nbytes() && r < w + written.nbytes())) return;
  if (in_place.has_value() && static_cast<std::ptrdiff_t>(w - r) == *in_place) return;
  throw std::invalid_argument(std::string("ProcessGroup::") + call + ": " + written_name + " (" +
                              TypeAndShape(written) + ") and " + read_name + " (" +
                              TypeAndShape(read) + ") share memory " +
                              (in_place.has_value() ? "other than in place (" + std::string(rule) + ")"
                                                    : std::string("(") + rule + ")"));
}

// dst = src for a one-process group (the same device for both).
Status LocalCopy(internal::DeviceFence* fence, void* dst, const void* src, size_t bytes) {
  if (fence != nullptr) return fence->CopyOnCommStream(dst, src, bytes);
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
  return Status::Ok();
}

// The label that collectives issued on this thread with none take (set by
// internal::ScopedDefaultLabel), or null.
thread_local const std::string* tls_default_label = nullptr;

// A collective's kind as descriptions give it: "all_reduce bucket 3", with
// the caller's label, else this thread's default label, else none.
std::string Labelled(const std::string& kind, const std::string& label) {
  if (!label.empty()) return kind + " " + label;
  if (tls_default_label != nullptr && !tls_default_label->empty()) {
    return kind + " " + *tls_default_label;
  }
  return kind;
}

// Called from the handler of a failure on this rank before its part of a
// collective was queued, or while it was (no memory for the call's own
// bookkeeping or for a copy of its object, no thread to run it): the peers
// would wait for it until the group's timeout, so the group is aborted with
// a reason naming this rank and the call. The caller rethrows (the
// exception being handled goes on as it came: a failure to say why is
// swallowed here). A group of one rank has nobody waiting and stays usable.
void AbortBeforeIssued(ProcessGroup& pg, const char* what) noexcept {
  try {
    if (pg.size() == 1 || !pg.aborted_reason().ok()) return;
    std::string text;
    try {
      throw;
    } catch (const std::exception& e) {
      text = e.what();
    } catch (...) {
      text = "an exception not derived from std::exception";
    }
    pg.Abort(transport::AbortedError(std::string("ProcessGroup::") + what + " failed on rank " +
                                     std::to_string(pg.rank()) + " before it was issued: " + text));
  } catch (...) {
    // No memory even for the reason: the caller's exception still leaves.
  }
}

// AbortBeforeIssued, except for what leaves the group as it is: the
// caller's argument errors (std::invalid_argument, and std::logic_error
// such as a collective issued from inside the group's own task: the header
// says such a rank does not take part), and a DistributedError, which the
// group itself raised for a collective that did run. std::length_error (a
// size past what a container holds) is a lack of memory like bad_alloc.
void AbortUnlessArgumentError(ProcessGroup& pg, const char* what) noexcept {
  try {
    throw;
  } catch (const std::length_error&) {
  } catch (const std::logic_error&) {
    return;
  } catch (const DistributedError&) {
    return;
  } catch (...) {
  }
  AbortBeforeIssued(pg, what);
}

}  // namespace

internal::ScopedDefaultLabel::ScopedDefaultLabel(const std::string& label) : previous_(tls_default_label) {
  tls_default_label = &label;
}

internal::ScopedDefaultLabel::~ScopedDefaultLabel() { tls_default_label = previous_; }

Work ProcessGroup::AllReduce(const nn::Tensor& tensor, transport::ReduceOp op,
                             const std::string& label) try {
  CheckTensor(tensor, "AllReduce", "tensor");
  CollectiveDescription d{Labelled("all_reduce", label), tensor.dtype(),
                          tensor.shape(), -1, op, true};
  const transport::DataType type = ToTransportType(tensor.dtype());
  // The task holds the tensor, so its memory outlives the collective.
  return impl_->Enqueue(std::move(d), [tensor, op, type](transport::Communicator* comm,
                                                           Deadline deadline) {
    if (comm == nullptr) return Status::Ok();
    Status status = comm->AllReduce(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type,
                                    op, internal::Within(deadline));
    MarkWritten(tensor);
    return status;
  }, FenceFor({tensor}, "AllReduce"));
} catch (...) {
  AbortUnlessArgumentError(*this, "AllReduce");
  throw;
}

Work ProcessGroup::Broadcast(const nn::Tensor& tensor, int root, const std::string& label) try {
  CheckTensor(tensor, "Broadcast", "tensor");
  if (root < 0 || root >= size_) {
    throw std::invalid_argument("ProcessGroup::Broadcast: root " + std::to_string(root) +
                                " is outside a group of size " + std::to_string(size_));
  }
  CollectiveDescription d{Labelled("broadcast", label), tensor.dtype(),
                          tensor.shape(), root, transport::ReduceOp::kSum, false};
  const transport::DataType type = ToTransportType(tensor.dtype());
  return impl_->Enqueue(std::move(d), [tensor, root, type](transport::Communicator* comm,
                                                             Deadline deadline) {
    if (comm == nullptr) return Status::Ok();
    Status status = comm->Broadcast(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type,
                                    root, internal::Within(deadline));
    if (comm->rank() != root) MarkWritten(tensor);  // the root's is only read
    return status;
  }, FenceFor({tensor}, "Broadcast"));
} catch (...) {
  AbortUnlessArgumentError(*this, "Broadcast");
  throw;
}

Work ProcessGroup::AllGather(const nn::Tensor& output, const nn::Tensor& input,
                             const std::string& label) try {
  CheckTensor(output, "AllGather", "output");
  CheckTensor(input, "AllGather", "input");
  if (output.dtype() != input.dtype() || output.numel() != input.numel() * size_) {
    throw std::invalid_argument(
        "ProcessGroup::AllGather: output must hold size() x input elements of input's dtype: input " +
        std::string(nn::DTypeName(input.dtype())) + " " + nn::ShapeToString(input.shape()) +
        ", output " + std::string(nn::DTypeName(output.dtype())) + " " +
        nn::ShapeToString(output.shape()) + ", size() " + std::to_string(size_));
  }
  CheckOverlap("AllGather", output, "output", input, "input",
               -static_cast<std::ptrdiff_t>(rank_) * static_cast<std::ptrdiff_t>(input.nbytes()),
               "input may only be output's block rank()");
  CollectiveDescription d{Labelled("all_gather", label), input.dtype(),
                          input.shape(), -1, transport::ReduceOp::kSum, false};
  const transport::DataType type = ToTransportType(input.dtype());
  std::shared_ptr<internal::DeviceFence> fence = FenceFor({output, input}, "AllGather");
  internal::DeviceFence* local = fence.get();  // owned by the Work, which outlives the task
  return impl_->Enqueue(std::move(d), [output, input, type, local](
                                          transport::Communicator* comm, Deadline deadline) {
    Status status =
        comm == nullptr
            ? LocalCopy(local, output.data_ptr(), input.data_ptr(), input.nbytes())
            : comm->AllGather(input.data_ptr(), output.data_ptr(),
                              static_cast<size_t>(input.numel()), type, internal::Within(deadline));
    MarkWritten(output);
    return status;
  }, std::move(fence));
} catch (...) {
  AbortUnlessArgumentError(*this, "AllGather");
  throw;
}

Work ProcessGroup::AllToAll(const nn::Tensor& output, const nn::Tensor& input,
                            std::vector<int64_t> output_splits, std::vector<int64_t> input_splits,
                            const std::string& label) try {
  CheckTensor(output, "AllToAll", "output");
  CheckTensor(input, "AllToAll", "input");
  const std::string where = "ProcessGroup::AllToAll: ";
  if (output.dim() == 0 || input.dim() == 0 || output.dtype() != input.dtype() ||
      output.numel() * input.size(0) != input.numel() * output.size(0)) {
    throw std::invalid_argument(where + "input and output need rows of one dtype and size: input " +
                                std::string(nn::DTypeName(input.dtype())) + " " +
                                nn::ShapeToString(input.shape()) + ", output " +
                                std::string(nn::DTypeName(output.dtype())) + " " +
                                nn::ShapeToString(output.shape()));
  }
  // Splits in rows, checked against dim 0; then in elements.
  auto resolve = [&](std::vector<int64_t>& splits, const nn::Tensor& t, const char* name) {
    const int64_t rows = t.size(0);
    if (splits.empty()) {
      if (rows % size_ != 0) {
        throw std::invalid_argument(where + name + " has " + std::to_string(rows) +
                                    " rows, not a multiple of size() " + std::to_string(size_) +
                                    "; pass split sizes");
      }
      splits.assign(static_cast<size_t>(size_), rows / size_);
    }
    int64_t total = 0;
    for (int64_t s : splits) {
      if (s < 0 || s > rows) {
        throw std::invalid_argument(where + name + " split size " + std::to_string(s) +
                                    (s < 0 ? " is negative" : " exceeds its " + std::to_string(rows) + " rows"));
      }
      total += s;  // at most size() * rows: no overflow

    }
    if (static_cast<int>(splits.size()) != size_ || total != rows) {
      throw std::invalid_argument(where + std::to_string(splits.size()) + " " + name +
                                  " split sizes adding up to " + std::to_string(total) + " for " +
                                  std::to_string(rows) + " rows and size() " + std::to_string(size_));
    }
    std::vector<size_t> elements;
    const int64_t row = rows > 0 ? t.numel() / rows : 0;
    for (int64_t s : splits) elements.push_back(static_cast<size_t>(s * row));
    return elements;
  };
  std::vector<size_t> sends = resolve(input_splits, input, "input");
  std::vector<size_t> receives = resolve(output_splits, output, "output");
  // What this rank sends itself is what it receives from itself (the
  // transport checks the pairs between ranks; a one-rank group has only this one).
  if (sends[static_cast<size_t>(rank_)] != receives[static_cast<size_t>(rank_)]) {
    throw std::invalid_argument(where + "rank " + std::to_string(rank_) + " sends itself " +
                                std::to_string(input_splits[static_cast<size_t>(rank_)]) +
                                " rows (input split " + std::to_string(rank_) + ") but receives " +
                                std::to_string(output_splits[static_cast<size_t>(rank_)]) +
                                " (output split " + std::to_string(rank_) + ")");
  }
  CheckOverlap("AllToAll", output, "output", input, "input", std::nullopt,
               "AllToAll has no in-place form");
  CollectiveDescription d{Labelled("all_to_all", label), input.dtype(),
                          {static_cast<int64_t>(size_)}, -1, transport::ReduceOp::kSum, false};
  const transport::DataType type = ToTransportType(input.dtype());
  std::shared_ptr<internal::DeviceFence> fence = FenceFor({output, input}, "AllToAll");
  internal::DeviceFence* local = fence.get();  // owned by the Work, which outlives the task
  return impl_->Enqueue(std::move(d), [output, input, type, sends, receives, local](
                                          transport::Communicator* comm, Deadline deadline) {
    Status status = comm == nullptr
                        ? LocalCopy(local, output.data_ptr(), input.data_ptr(), input.nbytes())
                        : comm->AllToAllV(input.data_ptr(), sends, output.data_ptr(), receives,
                                          type, internal::Within(deadline));
    MarkWritten(output);
    return status;
  }, std::move(fence));
} catch (...) {
  AbortUnlessArgumentError(*this, "AllToAll");
  throw;
}

Work ProcessGroup::ReduceScatter(const nn::Tensor& output, const nn::Tensor& input,
                                 transport::ReduceOp op, const std::string& label) try {
  CheckTensor(output, "ReduceScatter", "output");
  CheckTensor(input, "ReduceScatter", "input");
  if (output.dtype() != input.dtype() || input.numel() != output.numel() * size_) {
    throw std::invalid_argument(
        "ProcessGroup::ReduceScatter: input must hold size() x output elements of output's dtype: "
        "input " + std::string(nn::DTypeName(input.dtype())) + " " +
        nn::ShapeToString(input.shape()) + ", output " +
        std::string(nn::DTypeName(output.dtype())) + " " + nn::ShapeToString(output.shape()) +
        ", size() " + std::to_string(size_));
  }
  CheckOverlap("ReduceScatter", output, "output", input, "input",
               static_cast<std::ptrdiff_t>(rank_) * static_cast<std::ptrdiff_t>(output.nbytes()),
               "output may only be input's block rank()");
  CollectiveDescription d{Labelled("reduce_scatter", label),
                          input.dtype(), input.shape(), -1, op, true};
  const transport::DataType type = ToTransportType(input.dtype());
  std::shared_ptr<internal::DeviceFence> fence = FenceFor({output, input}, "ReduceScatter");
  internal::DeviceFence* local = fence.get();  // owned by the Work, which outlives the task
  return impl_->Enqueue(std::move(d), [output, input, op, type, local](
                                          transport::Communicator* comm, Deadline deadline) {
    Status status = comm == nullptr
                        ? LocalCopy(local, output.data_ptr(), input.data_ptr(), input.nbytes())
                        : comm->ReduceScatter(input.data_ptr(), output.data_ptr(),
                                              static_cast<size_t>(output.numel()), type, op,
                                              internal::Within(deadline));
    MarkWritten(output);
    return status;
  }, std::move(fence));
} catch (...) {
  AbortUnlessArgumentError(*this, "ReduceScatter");
  throw;
}

Work ProcessGroup::Reduce(const nn::Tensor& tensor, int root, transport::ReduceOp op,
                          const std::string& label) try {
  CheckTensor(tensor, "Reduce", "tensor");
  CheckRoot(root, size_, "Reduce", "root");
  CollectiveDescription d{Labelled("reduce", label), tensor.dtype(),
                          tensor.shape(), root, op, true};
  const transport::DataType type = ToTransportType(tensor.dtype());
  std::shared_ptr<internal::DeviceFence> fence = FenceFor({tensor}, "Reduce");
  return impl_->Enqueue(std::move(d), [tensor, root, op, type](
                                          transport::Communicator* comm, Deadline deadline) {
    if (comm == nullptr) return Status::Ok();
    void* result = comm->rank() == root ? tensor.data_ptr() : nullptr;
    Status status = comm->Reduce(tensor.data_ptr(), result, static_cast<size_t>(tensor.numel()),
                                 type, op, root, internal::Within(deadline));
    if (result != nullptr) MarkWritten(tensor);  // the other ranks' are only read
    return status;
  }, std::move(fence));
} catch (...) {
  AbortUnlessArgumentError(*this, "Reduce");
  throw;
}

Work ProcessGroup::Gather(const nn::Tensor& output, const nn::Tensor& input, int root,
                          const std::string& label) {
  return RootedExchange(true, input, output, root, label, nullptr);
}

Work ProcessGroup::RootedExchange(bool gather, const nn::Tensor& local, const nn::Tensor& rooted,
                                  int root, const std::string& label, std::function<void()> host) try {
  // Gather: local is the input, rooted the root's output; Scatter: local
  // is the output, rooted the root's input.
  const char* call = gather ? "Gather" : "Scatter";
  const char* local_name = gather ? "input" : "output";
  const char* rooted_name = gather ? "output" : "input";
  CheckTensor(local, call, local_name);
  CheckRoot(root, size_, call, "root");
  const bool is_root = rank_ == root;
  if (is_root) {
    CheckTensor(rooted, call, rooted_name);
    if (rooted.dtype() != local.dtype() || rooted.numel() != local.numel() * size_) {
      const nn::Tensor& input = gather ? local : rooted;
      const nn::Tensor& output = gather ? rooted : local;
      throw std::invalid_argument(std::string("ProcessGroup::") + call + ": the root's " +
                                  rooted_name + " must hold size() x " + local_name +
                                  " elements of " + local_name + "'s dtype: input " +
                                  TypeAndShape(input) + ", output " + TypeAndShape(output) +
                                  ", size() " + std::to_string(size_));
    }
    // In place on the root only: the root's own block of the rooted buffer.
    const auto own = static_cast<std::ptrdiff_t>(root) * static_cast<std::ptrdiff_t>(local.nbytes());
    if (gather) {
      CheckOverlap(call, rooted, "the root's output", local, "input", -own,
                   "input may only be output's block root");
    } else {
      CheckOverlap(call, local, "output", rooted, "the root's input", own,
                   "output may only be input's block root");
    }
  }
  const std::string kind = gather ? "gather" : "scatter";
  CollectiveDescription d{Labelled(kind, label), local.dtype(), local.shape(),
                          root, transport::ReduceOp::kSum, false};
  const transport::DataType type = ToTransportType(local.dtype());
  std::shared_ptr<internal::DeviceFence> fence = FenceFor(
      is_root ? std::vector<nn::Tensor>{local, rooted} : std::vector<nn::Tensor>{local}, call);
  internal::DeviceFence* on_device = fence.get();  // owned by the Work, which outlives the task
  return impl_->Enqueue(std::move(d), [gather, local, rooted, root, is_root, type, host,
                                       on_device](transport::Communicator* comm, Deadline deadline) {
    if (!gather && host) host();  // packs the root's input
    const size_t count = static_cast<size_t>(local.numel());
    void* root_buffer = is_root ? rooted.data_ptr() : nullptr;
    Status status =
        comm == nullptr
            ? LocalCopy(on_device, gather ? root_buffer : local.data_ptr(),
                        gather ? local.data_ptr() : root_buffer, local.nbytes())
            : (gather ? comm->Gather(local.data_ptr(), root_buffer, count, type, root,
                                     internal::Within(deadline))
                      : comm->Scatter(root_buffer, local.data_ptr(), count, type, root,
                                      internal::Within(deadline)));
    // A gather writes the root's output, a scatter every rank's.
    if (!gather) {
      MarkWritten(local);
    } else if (is_root) {
      MarkWritten(rooted);
    }
    DDP_RETURN_IF_ERROR(status);
    if (gather && host) host();  // copies the root's output into a list
    return Status::Ok();
  }, std::move(fence));
} catch (...) {
  AbortUnlessArgumentError(*this, gather ? "Gather" : "Scatter");
  throw;
}

namespace {

// The list of a rooted collective's list form: size() tensors like `like`
// on the root, none elsewhere.
void CheckRootList(const std::vector<nn::Tensor>& list, const nn::Tensor& like, int rank, int size,
                   int root, const char* call, const char* name, const char* like_name) {
  const std::string where = std::string("ProcessGroup::") + call + ": ";
  if (rank != root) {
    if (!list.empty()) {
      throw std::invalid_argument(where + "rank " + std::to_string(rank) + " is not the root (" +
                                  std::to_string(root) + ") and must pass no " + name + ", got " +
                                  std::to_string(list.size()));
    }
    return;
  }
  if (static_cast<int>(list.size()) != size) {
    throw std::invalid_argument(where + "the root passed " + std::to_string(list.size()) + " " +
                                name + " for a group of size " + std::to_string(size));
  }
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string what = std::string(name) + "[" + std::to_string(i) + "]";
    if (!list[i].defined()) throw std::invalid_argument(where + what + " is undefined");
    CheckHost(list[i], call, what);
    if (list[i].dtype() != like.dtype() || list[i].numel() != like.numel()) {
      throw std::invalid_argument(where + what + " is " + TypeAndShape(list[i]) + ", " + like_name +
                                  " is " + TypeAndShape(like) +
                                  "; each needs the same dtype and element count");
    }
  }
}

}  // namespace

Work ProcessGroup::GatherList(const std::vector<nn::Tensor>& outputs, const nn::Tensor& input,
                              int root) {
  return ListExchange(true, input, outputs, root);
}

Work ProcessGroup::Scatter(const nn::Tensor& output, const nn::Tensor& input, int root,
                           const std::string& label) {
  return RootedExchange(false, output, input, root, label, nullptr);
}

Work ProcessGroup::ScatterList(const nn::Tensor& output, const std::vector<nn::Tensor>& inputs,
                               int root) {
  return ListExchange(false, output, inputs, root);
}

Work ProcessGroup::ListExchange(bool gather, const nn::Tensor& local,
                                const std::vector<nn::Tensor>& list, int root) try {
  const char* call = gather ? "GatherList" : "ScatterList";
  const char* local_name = gather ? "input" : "output";
  CheckTensor(local, call, local_name);
  CheckHost(local, call, local_name);  // the list is staged by the host
  CheckRootList(list, local, rank_, size_, root, call, gather ? "outputs" : "inputs", local_name);
  if (rank_ != root) return RootedExchange(gather, local, nn::Tensor(), root, "", nullptr);
  // One staging buffer on the root (the list's tensors need not be
  // adjacent), filled or emptied on the communication thread: the list is
  // read after, and written before, the collectives issued around this one.
  const int64_t n = local.numel();
  const nn::Tensor staged = nn::Empty({size_ * n}, {.dtype = local.dtype()});
  return RootedExchange(gather, local, staged, root, "", [gather, staged, list, n] {
    // The list may hold parameters (requires_grad): these copies move data
    // and are no part of any graph, whatever the grad mode of the thread
    // that runs them (on by default on the communication thread).
    nn::NoGradGuard no_grad;
    for (size_t r = 0; r < list.size(); ++r) {
      const nn::Tensor block = staged.Narrow(0, static_cast<int64_t>(r) * n, n);
      if (gather) {
        list[r].CopyFrom(block.View(list[r].shape()));
      } else {
        block.CopyFrom(list[r].Detach().Reshape({n}));
      }
    }
  });
} catch (...) {
  AbortUnlessArgumentError(*this, gather ? "GatherList" : "ScatterList");
  throw;
}

Work ProcessGroup::Barrier() try {
  CollectiveDescription d{"barrier", nn::DType::kUInt8, {0}, -1, transport::ReduceOp::kSum, false};
  return impl_->Enqueue(std::move(d), [](transport::Communicator* comm, Deadline deadline) {
    if (comm == nullptr) return Status::Ok();
    return comm->Barrier(internal::Within(deadline));
  }, nullptr);
} catch (...) {
  AbortUnlessArgumentError(*this, "Barrier");
  throw;
}

namespace {

// "op #1 (recv from rank 0 tag 3, f32 [4])".
std::string DescribeP2pOp(const P2POp& op, size_t index) {
  return "op #" + std::to_string(index) + " (" +
         (op.kind == P2POp::Kind::kSend ? "send to" : "recv from") + " rank " +
         std::to_string(op.peer) + " tag " + std::to_string(op.tag) + ", " + TypeAndShape(op.tensor) +
         ")";
}

// Throws std::invalid_argument when a receive's buffer shares memory with
// any other op's of the batch: the messages are posted at once and land in
// any order, so an in-place ring ({Send(t, next), Recv(t, prev)}) may
// overwrite t before it was sent, and two receives into one buffer leave it
// holding whichever came last. Sends only read, and may overlap each other.
void CheckP2pOverlap(const std::vector<P2POp>& ops, const char* call) {
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].kind != P2POp::Kind::kRecv || ops[i].tensor.nbytes() == 0) continue;
    const auto r = reinterpret_cast<uintptr_t>(ops[i].tensor.data_ptr());
    const size_t r_bytes = ops[i].tensor.nbytes();
    for (size_t j = 0; j < ops.size(); ++j) {
      // Two receives were compared already at the earlier one's turn.
      if (j == i || ops[j].tensor.nbytes() == 0 ||
          (j < i && ops[j].kind == P2POp::Kind::kRecv)) {
        continue;
      }
      const auto o = reinterpret_cast<uintptr_t>(ops[j].tensor.data_ptr());
      if (!(r < o + ops[j].tensor.nbytes() && o < r + r_bytes)) continue;
      const size_t a = std::min(i, j), b = std::max(i, j);
      throw std::invalid_argument(std::string("ProcessGroup::") + call + ": " +
                                  DescribeP2pOp(ops[a], a) + " and " + DescribeP2pOp(ops[b], b) +
                                  " share memory; a receive's buffer must not overlap any other "
                                  "op's (the messages land in any order)");
    }
  }
}

}  // namespace

void ProcessGroup::CheckPeer(int peer, uint32_t tag, const char* call, const char* what) const {
  const std::string where = std::string("ProcessGroup::") + call + ": ";
  if (peer < 0 || peer >= size_) {
    throw std::invalid_argument(where + what + " " + std::to_string(peer) +
                                " is outside a group of size " + std::to_string(size_));
  }
  if (peer == rank_) {
    throw std::invalid_argument(where + what + " " + std::to_string(peer) +
                                " is this rank; a rank cannot send to or receive from itself");
  }
  if (tag > kMaxP2pTag) {
    throw std::invalid_argument(where + "tag " + std::to_string(tag) + " is above kMaxP2pTag (" +
                                std::to_string(kMaxP2pTag) +
                                "); larger tags are reserved for the group's own messages");
  }
}

Work ProcessGroup::PostPointToPoint(const std::vector<P2POp>& ops, const char* call) try {
  if (ops.empty()) {
    throw std::invalid_argument(std::string("ProcessGroup::") + call + ": no operations");
  }
  std::vector<nn::Tensor> tensors;
  std::vector<std::shared_ptr<P2pTransfer>> transfers;
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& op = ops[i];
    const bool send = op.kind == P2POp::Kind::kSend;
    if (!send && op.kind != P2POp::Kind::kRecv) {
      throw std::invalid_argument(std::string("ProcessGroup::") + call + ": op #" +
                                  std::to_string(i) + " has kind " +
                                  std::to_string(static_cast<int>(op.kind)));
    }
    const std::string what = ops.size() == 1 ? std::string("tensor")
                                             : "op #" + std::to_string(i) + "'s tensor";
    CheckTensor(op.tensor, call, what.c_str());
    CheckPeer(op.peer, op.tag, call, send ? "dst" : "src");
    ToTransportType(op.tensor.dtype());  // throws for a dtype the transport lacks
    tensors.push_back(op.tensor);
    transfers.push_back(std::make_shared<P2pTransfer>(send, op.tensor, op.peer, op.tag, rank_));
  }
  CheckP2pOverlap(ops, call);
  const P2POp& first = ops.front();
  std::string kind = ops.size() > 1 ? "batch_isend_irecv of " + std::to_string(ops.size()) + ", first "
                                     : std::string();
  kind += std::string(first.kind == P2POp::Kind::kSend ? "send to" : "recv from") + " rank " +
          std::to_string(first.peer) + " tag " + std::to_string(first.tag);
  CollectiveDescription d{kind, first.tensor.dtype(), first.tensor.shape(), -1,
                          transport::ReduceOp::kSum, false};
  const milliseconds timeout = options_.timeout;
  std::shared_ptr<internal::DeviceFence> fence = FenceFor(tensors, call);
  return impl_->Enqueue(
      std::move(d),
      [transfers, timeout](transport::Communicator* comm, Deadline) {
        if (comm == nullptr) {
          return transport::InternalError("point-to-point message in a group without transport");
        }
        for (const std::shared_ptr<P2pTransfer>& t : transfers) {
          DDP_RETURN_IF_ERROR(t->Post(comm, timeout));
        }
        return Status::Ok();
      },
      std::move(fence), Impl::Mode::kPointToPoint, transfers);
} catch (...) {
  AbortUnlessArgumentError(*this, call);
  throw;
}

Work ProcessGroup::Send(const nn::Tensor& tensor, int dst, uint32_t tag) try {
  return PostPointToPoint({P2POp::Send(tensor, dst, tag)}, "Send");
} catch (...) {
  AbortUnlessArgumentError(*this, "Send");
  throw;
}

Work ProcessGroup::Recv(const nn::Tensor& tensor, int src, uint32_t tag) try {
  return PostPointToPoint({P2POp::Recv(tensor, src, tag)}, "Recv");
} catch (...) {
  AbortUnlessArgumentError(*this, "Recv");
  throw;
}

Work ProcessGroup::BatchIsendIrecv(const std::vector<P2POp>& ops) {
  return PostPointToPoint(ops, "BatchIsendIrecv");
}

namespace {

// The description of an object collective: the sizes differ across ranks,
// so the debug check compares only the kind and root.
CollectiveDescription ObjectCollective(const char* kind, int root) {
  return {kind, nn::DType::kUInt8, {}, root, transport::ReduceOp::kSum, false};
}

// Sizes `buffer` to `bytes` for an object collective: a rank without
// memory for it fails with a status naming the size and `what` it is for
// (the failure aborts the group, so the peers fail at once, naming it too).
Status SizeBuffer(std::string& buffer, size_t bytes, int rank, const std::string& what) {
  try {
    buffer.resize(bytes);
  } catch (const std::exception& e) {  // std::bad_alloc, std::length_error
    return transport::ResourceExhaustedError("rank " + std::to_string(rank) + " has no memory for " +
                                             std::to_string(bytes) + " bytes (" + what + "): " + e.what());
  }
  return Status::Ok();
}

// The longest object's owner and length, for SizeBuffer's message.
std::string LongestText(const std::vector<int64_t>& sizes) {
  const auto it = std::max_element(sizes.begin(), sizes.end());
  return "the longest object, rank " + std::to_string(it - sizes.begin()) + "'s, has " + std::to_string(*it) +
         " bytes";
}

}  // namespace

void internal::FailNextNewGroupAfterSplitForTesting() {
  fail_next_new_group_after_split.store(true, std::memory_order_relaxed);
}

void internal::FailNextBookkeepingForTesting() { fail_next_bookkeeping.store(true, std::memory_order_relaxed); }

void internal::FailNextPostForTesting() { fail_next_post.store(true, std::memory_order_relaxed); }

void internal::SetObjectAllGatherPaddedBytesForTesting(size_t bytes) {
  object_all_gather_padded_bytes.store(bytes, std::memory_order_relaxed);
}

uint64_t internal::ObjectAllGatherCallsForTesting() {
  return object_all_gather_calls.load(std::memory_order_relaxed);
}

void ProcessGroup::BroadcastObject(std::string* object, int root) {
  if (object == nullptr) throw std::invalid_argument("ProcessGroup::BroadcastObject: object is null");
  CheckRoot(root, size_, "BroadcastObject", "root");
  // The task owns the bytes: a Wait that gives up (its budget spent behind
  // slow items) returns while the task may still run, and must not leave it
  // writing into the caller's string.
  std::shared_ptr<std::string> bytes;
  Work work;
  try {
    bytes = std::make_shared<std::string>(std::move(*object));
    work = impl_->Enqueue(
        ObjectCollective("broadcast_object", root),
        [bytes, root](transport::Communicator* comm, Deadline deadline) {
          if (comm == nullptr) return Status::Ok();
          int64_t size = static_cast<int64_t>(bytes->size());
          DDP_RETURN_IF_ERROR(
              comm->Broadcast(&size, 1, transport::DataType::kI64, root, internal::Within(deadline)));
          if (size < 0) {
            return transport::InternalError("root " + std::to_string(root) + " sent a negative size, " +
                                            std::to_string(size));
          }
          if (comm->rank() != root) {
            DDP_RETURN_IF_ERROR(SizeBuffer(*bytes, static_cast<size_t>(size), comm->rank(),
                                           "root " + std::to_string(root) + "'s object"));
          }
          if (size == 0) return Status::Ok();
          return comm->Broadcast(bytes->data(), static_cast<size_t>(size), transport::DataType::kU8, root,
                                 internal::Within(deadline));
        },
        nullptr);
  } catch (...) {
    // Not issued: the caller's object comes back as it was (the header
    // promises it; a call refused from inside a task left it empty).
    if (bytes != nullptr) *object = std::move(*bytes);
    AbortUnlessArgumentError(*this, "BroadcastObject");
    throw;
  }
  work.Wait();
  *object = std::move(*bytes);
}

std::vector<std::string> ProcessGroup::AllGatherObject(const std::string& object) {
  std::shared_ptr<std::vector<std::string>> out;
  Work work;
  try {
    out = std::make_shared<std::vector<std::string>>();
    // The task owns its copies (see BroadcastObject).
    work = impl_->Enqueue(
        ObjectCollective("all_gather_object", -1),
        [object, out](transport::Communicator* comm, Deadline deadline) mutable {
          if (comm == nullptr) {
            *out = {std::move(object)};
            return Status::Ok();
          }
          // Every rank's length first. Then, when size() x the longest
          // object is at most the padded limit (1 MiB), every object padded
          // to the longest in one all-gather: two transport calls, what a
          // few bytes from every rank (the trainer's stats line) should
          // cost. Above it, each rank's bytes broadcast from it straight
          // into the string returned for it: one call per rank with a
          // non-empty object, but the result is the only buffer that holds
          // the gathered bytes (the padded copy, held next to the result,
          // takes n times the longest object, far more than the result
          // where lengths differ).
          const size_t n = static_cast<size_t>(comm->size());
          const int me = comm->rank();
          std::vector<int64_t> sizes(n);
          const int64_t mine = static_cast<int64_t>(object.size());
          object_all_gather_calls.fetch_add(1, std::memory_order_relaxed);
          DDP_RETURN_IF_ERROR(
              comm->AllGather(&mine, sizes.data(), 1, transport::DataType::kI64, internal::Within(deadline)));
          size_t longest = 0;
          for (size_t r = 0; r < n; ++r) {
            if (sizes[r] < 0) {
              return transport::InternalError("rank " + std::to_string(r) + " sent a negative size, " +
                                              std::to_string(sizes[r]));
            }
            longest = std::max(longest, static_cast<size_t>(sizes[r]));
          }
          std::vector<std::string> got(n);
          const size_t padded_limit = object_all_gather_padded_bytes.load(std::memory_order_relaxed);
          if (longest <= padded_limit / n) {
            if (longest > 0) {
              std::string padded = std::move(object);
              DDP_RETURN_IF_ERROR(SizeBuffer(padded, longest, me, "its own object padded; " + LongestText(sizes)));
              std::string all;
              DDP_RETURN_IF_ERROR(
                  SizeBuffer(all, n * longest, me, "every rank's object padded; " + LongestText(sizes)));
              object_all_gather_calls.fetch_add(1, std::memory_order_relaxed);
              DDP_RETURN_IF_ERROR(comm->AllGather(padded.data(), all.data(), longest, transport::DataType::kU8,
                                                  internal::Within(deadline)));
              for (size_t r = 0; r < n; ++r) {
                DDP_RETURN_IF_ERROR(SizeBuffer(got[r], static_cast<size_t>(sizes[r]), me,
                                               "rank " + std::to_string(r) + "'s object; " + LongestText(sizes)));
                std::memcpy(got[r].data(), all.data() + r * longest, got[r].size());
              }
            }
            *out = std::move(got);
            return Status::Ok();
          }
          got[static_cast<size_t>(me)] = std::move(object);
          for (size_t r = 0; r < n; ++r) {
            if (static_cast<int>(r) == me) continue;
            DDP_RETURN_IF_ERROR(SizeBuffer(got[r], static_cast<size_t>(sizes[r]), me,
                                           "rank " + std::to_string(r) + "'s object; " + LongestText(sizes)));
          }
          for (size_t r = 0; r < n; ++r) {
            if (sizes[r] == 0) continue;
            object_all_gather_calls.fetch_add(1, std::memory_order_relaxed);
            DDP_RETURN_IF_ERROR(comm->Broadcast(got[r].data(), got[r].size(), transport::DataType::kU8,
                                                static_cast<int>(r), internal::Within(deadline)));
          }
          *out = std::move(got);
          return Status::Ok();
        },
        nullptr);
  } catch (...) {
    AbortUnlessArgumentError(*this, "AllGatherObject");
    throw;
  }
  work.Wait();
  return std::move(*out);
}

std::vector<std::string> ProcessGroup::GatherObject(const std::string& object, int dst) {
  CheckRoot(dst, size_, "GatherObject", "dst");
  std::shared_ptr<std::vector<std::string>> out;
  Work work;
  try {
    out = std::make_shared<std::vector<std::string>>();
    work = impl_->Enqueue(
        ObjectCollective("gather_object", dst),
        [object, dst, out](transport::Communicator* comm, Deadline deadline) mutable {
          if (comm == nullptr) {
            *out = {std::move(object)};
            return Status::Ok();
          }
          // The lengths to dst, then each rank's bytes sent to dst, which
          // receives them straight into the string returned for that rank:
          // no rank pads its object to the longest (a small object's rank
          // needed memory for the longest one to take part), and dst needs
          // no memory for the gathered bytes beyond the result.
          const int me = comm->rank();
          const size_t n = static_cast<size_t>(comm->size());
          std::vector<int64_t> sizes(me == dst ? n : 0);
          const int64_t mine = static_cast<int64_t>(object.size());
          DDP_RETURN_IF_ERROR(comm->Gather(&mine, me == dst ? sizes.data() : nullptr, 1, transport::DataType::kI64,
                                           dst, internal::Within(deadline)));
          if (me != dst) {
            if (object.empty()) return Status::Ok();
            return comm->Send(object.data(), object.size(), transport::DataType::kU8, dst, kObjectTag,
                              internal::Within(deadline));
          }
          std::vector<std::string> got(n);
          got[static_cast<size_t>(me)] = std::move(object);
          for (size_t r = 0; r < n; ++r) {
            if (static_cast<int>(r) == me || sizes[r] == 0) continue;
            if (sizes[r] < 0) {
              return transport::InternalError("rank " + std::to_string(r) + " sent a negative size, " +
                                              std::to_string(sizes[r]));
            }
            DDP_RETURN_IF_ERROR(SizeBuffer(got[r], static_cast<size_t>(sizes[r]), me,
                                           "rank " + std::to_string(r) + "'s object; " + LongestText(sizes)));
            DDP_RETURN_IF_ERROR(comm->Recv(got[r].data(), got[r].size(), transport::DataType::kU8,
                                           static_cast<int>(r), kObjectTag, internal::Within(deadline)));
          }
          *out = std::move(got);
          return Status::Ok();
        },
        nullptr);
  } catch (...) {
    AbortUnlessArgumentError(*this, "GatherObject");
    throw;
  }
  work.Wait();
  return std::move(*out);
}

std::string ProcessGroup::ScatterObject(const std::vector<std::string>& objects, int src) {
  CheckRoot(src, size_, "ScatterObject", "src");
  std::shared_ptr<std::string> out;
  // Set when src passed the wrong number of objects: every rank learns it
  // from the sizes and throws, instead of waiting for bytes that never come.
  std::shared_ptr<int64_t> bad_count;
  Work work;
  try {
    out = std::make_shared<std::string>();
    bad_count = std::make_shared<int64_t>(-1);
    // The task owns a copy (see BroadcastObject); only src's is read.
    std::vector<std::string> mine = rank_ == src ? objects : std::vector<std::string>{};
    work = impl_->Enqueue(
        ObjectCollective("scatter_object", src),
        [objects = std::move(mine), src, out, bad_count](transport::Communicator* comm,
                                                         Deadline deadline) mutable {
          const size_t n = comm == nullptr ? 1 : static_cast<size_t>(comm->size());
          const int me = comm == nullptr ? 0 : comm->rank();
          // sizes[q]: the length of rank q's object; one more entry for src's
          // count of objects.
          std::vector<int64_t> sizes(n + 1, 0);
          if (me == src) {
            sizes[n] = static_cast<int64_t>(objects.size());
            if (objects.size() == n) {
              for (size_t q = 0; q < n; ++q) sizes[q] = static_cast<int64_t>(objects[q].size());
            }
          }
          if (comm != nullptr) {
            DDP_RETURN_IF_ERROR(comm->Broadcast(sizes.data(), n + 1, transport::DataType::kI64, src,
                                                internal::Within(deadline)));
          }
          if (sizes[n] != static_cast<int64_t>(n)) {
            *bad_count = sizes[n];
            return Status::Ok();
          }
          if (comm == nullptr) {
            *out = objects[0];
            return Status::Ok();
          }
          // src sends each rank its object, which that rank receives
          // straight into the string it returns, sized to it: nothing is
          // padded to the longest (a rank given a small object needed
          // memory for the longest one, and src for all of them padded).
          if (me == src) {
            for (size_t q = 0; q < n; ++q) {
              if (static_cast<int>(q) == me || objects[q].empty()) continue;
              DDP_RETURN_IF_ERROR(comm->Send(objects[q].data(), objects[q].size(), transport::DataType::kU8,
                                             static_cast<int>(q), kObjectTag, internal::Within(deadline)));
            }
            *out = std::move(objects[static_cast<size_t>(me)]);
            return Status::Ok();
          }
          const int64_t length = sizes[static_cast<size_t>(me)];
          if (length < 0) {
            return transport::InternalError("src " + std::to_string(src) + " sent a negative size, " +
                                            std::to_string(length));
          }
          const std::vector<int64_t> lengths(sizes.begin(), sizes.end() - 1);
          DDP_RETURN_IF_ERROR(SizeBuffer(*out, static_cast<size_t>(length), me,
                                         "its object from src " + std::to_string(src) + "; " + LongestText(lengths)));
          if (length == 0) return Status::Ok();
          return comm->Recv(out->data(), out->size(), transport::DataType::kU8, src, kObjectTag,
                            internal::Within(deadline));
        },
        nullptr);
  } catch (...) {
    AbortUnlessArgumentError(*this, "ScatterObject");
    throw;
  }
  work.Wait();
  if (*bad_count >= 0) {
    throw std::invalid_argument("ProcessGroup::ScatterObject: src " + std::to_string(src) +
                                " passed " + std::to_string(*bad_count) +
                                " objects for a group of size " + std::to_string(size_));
  }
  return std::move(*out);
}

void ProcessGroup::MonitoredBarrier(milliseconds timeout, bool wait_all_ranks) {
  // Waited for outside IssueMonitoredBarrier's handler: the barrier was
  // issued, so a failure of the wait (no memory for its error's text) must
  // not abort the group saying that it failed before it was issued.
  IssueMonitoredBarrier(timeout, wait_all_ranks).Wait();
}

Work ProcessGroup::IssueMonitoredBarrier(milliseconds timeout, bool wait_all_ranks) try {
  if (timeout.count() < 0) {
    throw std::invalid_argument("ProcessGroup::MonitoredBarrier: timeout " +
                                std::to_string(timeout.count()) + " ms is negative");
  }
  if (timeout.count() == 0) timeout = options_.timeout;
  // Past the cap of ProcessGroupOptions::timeout the waits below (twice the
  // timeout, then in nanoseconds on the clock) would overflow; 30 days is
  // "forever" for a barrier all the same.
  timeout = std::min(timeout, kMostTimeout);
  const int64_t number = static_cast<int64_t>(impl_->NextMonitoredBarrier());
  // Ranks other than 0 wait for rank 0's verdict this long: rank 0 may
  // enter up to `timeout` after them and then wait `timeout` itself.
  const milliseconds others_wait = 2 * timeout + milliseconds(1000);
  CollectiveDescription d{"monitored_barrier", nn::DType::kInt64, {}, 0, transport::ReduceOp::kSum,
                          false};
  // No fingerprint exchange: it would wait the group's timeout for a missing
  // rank instead of naming it.
  return impl_->Enqueue(std::move(d), [timeout, wait_all_ranks, number, others_wait](
                            transport::Communicator* comm, Deadline) {
    if (comm == nullptr || comm->size() == 1) return Status::Ok();
    const int n = comm->size();
    const Clock::time_point start = Clock::now();
    // The transport's own deadline is later than ours, so that a missing
    // rank is reported here (by name) rather than as a timed-out receive.
    const transport::CallOptions call{.timeout = others_wait + milliseconds(1000)};
    const std::string what = "monitored barrier #" + std::to_string(number);
    // A failure: abort the group with `reason` (the other ranks learn it
    // within ~100 ms) and cancel what is still posted.
    auto fail = [comm](Status reason, std::vector<transport::Work>& works) {
      comm->Abort(reason);
      for (transport::Work& w : works) {
        if (w.valid()) (void)w.Test();
      }
      return reason;
    };
    if (comm->rank() != 0) {
      std::vector<int64_t> message = {number, -1};
      std::vector<transport::Work> works = {
          comm->SendAsync(&message[0], 1, transport::DataType::kI64, 0, kMonitoredBarrierTag, call),
          comm->RecvAsync(&message[1], 1, transport::DataType::kI64, 0, kMonitoredBarrierTag, call)};
      const Deadline deadline = start + others_wait;
      for (transport::Work& w : works) {
        if (w.Wait(deadline).ok()) continue;
        // Past the deadline Wait no longer polls: Test does, once.
        StatusOr<bool> done = w.Test();
        // The group failed (rank 0's verdict, a lost peer): the posted
        // transfers point into this frame, so abort before it goes.
        if (!done.ok()) return fail(done.status(), works);
        if (*done) continue;
        return fail(transport::TimedOutError(what + ": rank " + std::to_string(comm->rank()) +
                                             " was not released by rank 0 within " +
                                             std::to_string(others_wait.count()) +
                                             " ms (rank 0 did not arrive)"),
                    works);
      }
      if (message[1] != number) {
        return fail(transport::InvalidArgumentError(
                        what + ": rank 0 released rank " + std::to_string(comm->rank()) +
                        " from monitored barrier #" + std::to_string(message[1])),
                    works);
      }
      return Status::Ok();
    }
    // Rank 0: every other rank's arrival, by one deadline.
    std::vector<int64_t> arrived(static_cast<size_t>(n), -1);
    std::vector<transport::Work> works(static_cast<size_t>(n));
    for (int r = 1; r < n; ++r) {
      works[r] = comm->RecvAsync(&arrived[r], 1, transport::DataType::kI64, r, kMonitoredBarrierTag,
                                 call);
    }
    const Deadline deadline = start + timeout;
    std::vector<int> missing;
    for (int r = 1; r < n; ++r) {
      if (!missing.empty() && !wait_all_ranks) break;
      // Once an earlier rank used up the deadline, Wait returns without
      // polling; Test polls once, so a rank that did arrive is not named.
      bool came = works[r].Wait(deadline).ok();
      if (!came) {
        StatusOr<bool> done = works[r].Test();
        if (!done.ok()) return fail(done.status(), works);  // a lost peer, an abort
        came = *done;
      }
      if (came) {
        if (arrived[r] != number) {
          return fail(transport::InvalidArgumentError(
                          what + ": rank " + std::to_string(r) + " is at monitored barrier #" +
                          std::to_string(arrived[r])),
                      works);
        }
        continue;
      }
      missing.push_back(r);
    }
    if (!missing.empty()) {
      std::string names;
      for (int r : missing) names += (names.empty() ? "" : ", ") + std::to_string(r);
      const bool several = missing.size() > 1;
      return fail(transport::TimedOutError(
                      what + ": rank" + (several ? "s " : " ") + names + (several ? " have" : " has") +
                      " not arrived within " + std::to_string(timeout.count()) + " ms" +
                      (wait_all_ranks ? " (waited for all ranks)" : " (the first missing rank)")),
                  works);
    }
    // Release them.
    std::vector<transport::Work> releases;
    for (int r = 1; r < n; ++r) {
      releases.push_back(
          comm->SendAsync(&arrived[r], 1, transport::DataType::kI64, r, kMonitoredBarrierTag, call));
    }
    for (transport::Work& w : releases) {
      if (Status sent = w.Wait(Clock::now() + call.timeout); !sent.ok()) return fail(sent, releases);
    }
    return Status::Ok();
  }, nullptr, Impl::Mode::kUnchecked, {}, others_wait + milliseconds(2000));
} catch (...) {
  AbortUnlessArgumentError(*this, "MonitoredBarrier");
  throw;
}

std::shared_ptr<ProcessGroup> ProcessGroup::NewGroup(const std::vector<int>& ranks) {
  // Up to the Enqueue, a failure leaves the peers waiting for this rank in
  // the comparison below: the group is aborted, naming it.
  std::string invalid;
  bool member = false;
  int64_t count = 0;
  std::shared_ptr<std::unique_ptr<transport::Communicator>> made;
  std::shared_ptr<std::array<int64_t, 3>> differs;
  Work work;
  try {
    std::vector<bool> seen(static_cast<size_t>(size_), false);
    // FNV-1a over the ranks in order: what the ranks compare before forming
    // the group (an order that differs is a different list).
    uint64_t digest = 14695981039346656037ull;
    // What is wrong with this rank's list, if anything: said after the
    // exchange below (as a length of -1), so that the other ranks fail with
    // it instead of waiting for this one until their deadline.
    if (ranks.empty()) invalid = "the rank list is empty";
    for (int r : ranks) {
      if (r < 0 || r >= size_ || seen[static_cast<size_t>(r)]) {
        invalid = "rank " + std::to_string(r) +
                  (r >= 0 && r < size_ ? " given twice" : " is not in [0, " + std::to_string(size_) + ")");
        break;
      }
      seen[static_cast<size_t>(r)] = true;
      digest = (digest ^ static_cast<uint64_t>(r)) * 1099511628211ull;
    }
    const auto it = std::find(ranks.begin(), ranks.end(), rank_);
    member = it != ranks.end();
    const int color = member ? 0 : transport::Communicator::kNoColor;
    const int key = static_cast<int>(it - ranks.begin());
    made = std::make_shared<std::unique_ptr<transport::Communicator>>();
    // The first rank whose list differs from rank 0's (-1: none), and both
    // lists' lengths; the same on every rank, since all see the same data.
    differs = std::make_shared<std::array<int64_t, 3>>(std::array<int64_t, 3>{-1, 0, 0});
    count = invalid.empty() ? static_cast<int64_t>(ranks.size()) : -1;
    // The lists are compared by the task itself (below), also in debug mode,
    // where a fingerprint of the list would fail first, as a desync.
    CollectiveDescription d{"new_group", nn::DType::kInt64, {}, -1, transport::ReduceOp::kSum, false};
    work = impl_->Enqueue(std::move(d), [color, key, made, differs, count, digest](
                                     transport::Communicator* comm, Deadline deadline) {
      if (comm == nullptr) return Status::Ok();  // one process: the list is {0}
      // Every rank's (length, digest), always (not only in debug mode): ranks
      // that pass different lists would otherwise form wrong groups silently.
      const std::array<int64_t, 2> mine = {count, static_cast<int64_t>(digest)};
      std::vector<int64_t> all(2 * static_cast<size_t>(comm->size()));
      DDP_RETURN_IF_ERROR(comm->AllGather(mine.data(), all.data(), 2, transport::DataType::kI64,
                                          internal::Within(deadline)));
      for (int r = 0; r < comm->size(); ++r) {
        if (all[2 * r] < 0) {  // a list its own rank refused
          *differs = {r, all[0], -1};
          return Status::Ok();
        }
      }
      for (int r = 1; r < comm->size(); ++r) {
        if (all[2 * r] != all[0] || all[2 * r + 1] != all[1]) {
          *differs = {r, all[0], all[2 * r]};
          return Status::Ok();  // refused after the Work, on every rank alike
        }
      }
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - transport::Clock::now());
      auto child = comm->Split(color, key, {.timeout = std::max(left, milliseconds(1))});
      if (!child.ok()) return child.status();
      *made = std::move(*child);
      return Status::Ok();
    }, nullptr);
  } catch (...) {
    AbortUnlessArgumentError(*this, "NewGroup");
    throw;
  }
  work.Wait();
  if (!invalid.empty()) {
    throw std::invalid_argument("ProcessGroup::NewGroup: " + invalid + ". No group was formed on any rank");
  }
  if ((*differs)[0] >= 0 && (*differs)[2] < 0) {
    throw std::invalid_argument("ProcessGroup::NewGroup: rank " + std::to_string((*differs)[0]) +
                                " passed an invalid rank list (its error names the problem). No group was "
                                "formed on any rank");
  }
  if ((*differs)[0] >= 0) {
    const int64_t r = (*differs)[0];
    throw std::invalid_argument(
        "ProcessGroup::NewGroup: rank " + std::to_string(r) + " passed a different rank list (" +
        std::to_string((*differs)[2]) + " ranks) from rank 0's (" + std::to_string((*differs)[1]) +
        " ranks" + ((*differs)[1] == (*differs)[2] ? ", another order or other ranks" : "") +
        "); every rank must pass the same list. No group was formed (this rank passed " +
        std::to_string(count) + " ranks)");
  }
  if (!member) return nullptr;
  // From here every member holds the new group's communicator, and this
  // group's call is done on every rank: a failure to make this rank's part
  // of the new group (no memory, no thread) leaves this group usable, and
  // aborts the new group's communicator instead, so that the other members
  // fail at their first collective in it, naming this rank, instead of
  // waiting for it.
  std::unique_ptr<ProcessGroup> owned;
  std::shared_ptr<ProcessGroup> child;
  try {
    if (fail_next_new_group_after_split.exchange(false, std::memory_order_relaxed)) throw std::bad_alloc();
    // The parent's settings as they are (the environment is not read again:
    // a DDP_DEBUG changed since on some ranks would fail the group on all).
    const int child_rank = *made == nullptr ? 0 : (*made)->rank();
    const int child_size = *made == nullptr ? 1 : (*made)->size();
    // Owned by the unique_ptr until the shared one holds it (a throw for its
    // control block leaves it there, to be aborted below).
    owned.reset(new ProcessGroup(std::move(*made), child_rank, child_size, options_, debug_level_));
    child = std::shared_ptr<ProcessGroup>(std::move(owned));
    if (child_size > 1 && child->impl_->host_shared_memory()) ShareLargeCpuBlocks();
    child->root_rank_ = root_rank_;
    impl_->AddChild(child);
    return child;
  } catch (...) {
    try {
      std::string text;
      try {
        throw;
      } catch (const std::exception& e) {
        text = e.what();
      } catch (...) {
        text = "an exception not derived from std::exception";
      }
      const Status reason = transport::AbortedError(
          "ProcessGroup::NewGroup failed on rank " + std::to_string(rank_) +
          " after every member had formed the new group's communicator, so the new group is aborted (the group "
          "it was made from stays usable): " + text);
      if (child != nullptr) {
        child->Abort(reason);
      } else if (owned != nullptr) {
        owned->Abort(reason);
      } else if (*made != nullptr) {
        (*made)->Abort(reason);
      }
    } catch (...) {
      // No memory even for the reason: the caller's exception still leaves.
    }
    throw;
  }
}

Work ProcessGroup::Run(const CollectiveDescription& description, Task task,
                       const std::vector<nn::Tensor>& device_tensors) try {
  if (!task) throw std::invalid_argument("ProcessGroup::Run: empty task for " + description.kind);
  return IssueTask(
      description,
      [task = std::move(task)](transport::Communicator* comm, Deadline deadline,
                               internal::DeviceFence*) { return task(comm, deadline); },
      device_tensors, "Run");
} catch (...) {
  AbortUnlessArgumentError(*this, "Run");
  throw;
}

Work ProcessGroup::RunFenced(const CollectiveDescription& description, FencedTask task,
                             const std::vector<nn::Tensor>& device_tensors) try {
  if (!task) throw std::invalid_argument("ProcessGroup::RunFenced: empty task for " + description.kind);
  return IssueTask(description, std::move(task), device_tensors, "RunFenced");
} catch (...) {
  AbortUnlessArgumentError(*this, "RunFenced");
  throw;
}

// Run's and RunFenced's body, with no handler of its own: the caller's
// names the call the user made when it aborts the group.
Work ProcessGroup::IssueTask(const CollectiveDescription& description, FencedTask task,
                             const std::vector<nn::Tensor>& device_tensors, const char* call) {
  std::shared_ptr<internal::DeviceFence> fence;
  if (!device_tensors.empty()) {
    for (const nn::Tensor& t : device_tensors) CheckTensor(t, call, "device tensor");
    fence = FenceFor(device_tensors, call);
  }
  internal::DeviceFence* local = fence.get();  // owned by the Work, which outlives the task
  // Inside a communication hook the reducer's default label names the
  // bucket: a failure of the task (which becomes the abort reason the peers
  // report) then says which bucket it was, on every rank. The label is the
  // same on every rank, so the fingerprints still match.
  CollectiveDescription labelled = description;
  if (tls_default_label != nullptr && !tls_default_label->empty() &&
      labelled.kind.find(*tls_default_label) == std::string::npos) {
    // A kind that ends with the label's head ("fp16_compress bucket 1",
    // the label "bucket 1 of `fc.weight`") takes only the rest of it.
    const std::string& label = *tls_default_label;
    const size_t of = label.find(" of ");
    const std::string_view head = std::string_view(label).substr(0, of);
    if (of != std::string::npos && std::string_view(labelled.kind).ends_with(head)) {
      labelled.kind += label.substr(of);
    } else {
      labelled.kind += " " + label;
    }
  }
  return impl_->Enqueue(
      std::move(labelled),
      [task = std::move(task), local](transport::Communicator* comm, Deadline deadline) {
        return task(comm, deadline, local);
      },
      std::move(fence));
}

void ProcessGroup::set_trace(std::shared_ptr<TraceRecorder> trace) {
  impl_->set_trace(std::move(trace));
}

void ProcessGroup::StopTrace(const TraceRecorder* trace) { impl_->StopTrace(trace); }

std::chrono::nanoseconds ProcessGroup::CommThreadCpuTime() const { return impl_->CpuTime(); }

std::chrono::nanoseconds ProcessGroup::PeerWaitTime() const {
  const transport::Communicator* comm = impl_->comm();
  return comm != nullptr ? comm->PeerWaitTime() : std::chrono::nanoseconds(0);
}

uint64_t ProcessGroup::collectives_run() const { return impl_->run_count(); }

Status ProcessGroup::aborted_reason() const { return impl_->aborted_reason(); }

void ProcessGroup::Abort(const Status& reason) { impl_->Abort(reason); }

namespace {

// At most this many large CPU blocks live in shareable memory at once (one
// memfd, so one file descriptor, each); beyond it they come from the system.
constexpr int kMaxShareableBlocks = 256;
std::atomic<int> shareable_blocks{0};

}  // namespace

void ShareLargeCpuBlocks() {
  static std::once_flag once;
  std::call_once(once, [] {
    nn::SetCpuLargeBlockSource({
        .min_bytes = kShareableBlockBytes,
        .allocate = [](size_t bytes) -> void* {
          if (shareable_blocks.fetch_add(1) >= kMaxShareableBlocks) {
            shareable_blocks.fetch_sub(1);
            return nullptr;
          }
          auto memory = transport::shm::AllocateShareable(bytes);
          if (!memory.ok()) {
            shareable_blocks.fetch_sub(1);
            return nullptr;
          }
          return *memory;
        },
        .release = [](void* block, size_t) {
          // Not shareable (allocated before the source, or declined): the
          // allocator frees it itself.
          if (!transport::shm::FreeShareable(block).ok()) return false;
          shareable_blocks.fetch_sub(1);
          return true;
        },
    });
  });
}

nn::Tensor ProcessGroup::CollectiveZeros(const nn::Shape& shape, nn::TensorOptions options) const {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const size_t bytes = static_cast<size_t>(numel) * nn::ElementSize(options.dtype);
  if (!options.device.is_cpu() || size_ < 2 || bytes == 0 || !impl_->host_shared_memory()) {
    return nn::Zeros(shape, options);
  }
  auto memory = transport::shm::AllocateShareable(bytes);
  // Out of memfds or address space: an ordinary tensor works, via CMA.
  if (!memory.ok()) return nn::Zeros(shape, options);
  nn::Tensor t = nn::Tensor::FromBlob(*memory, shape, options.dtype, options.device,
                                      [](void* p) { transport::shm::FreeShareable(p).IgnoreError(); });
  t.set_requires_grad(options.requires_grad);
  return t;
}

// ------------------------------------------------------- default group ----

namespace {
std::mutex default_mu;
std::shared_ptr<ProcessGroup>& DefaultSlot() {
  static auto* slot = new std::shared_ptr<ProcessGroup>();
  return *slot;
}
}  // namespace

std::shared_ptr<ProcessGroup> InitProcessGroup(ProcessGroupOptions options,
                                               transport::CommunicatorOptions comm_options) {
  auto group = ProcessGroup::CreateFromEnvironment(options, comm_options);
  SetDefaultProcessGroup(group);
  return group;
}

void SetDefaultProcessGroup(std::shared_ptr<ProcessGroup> group) {
  {
    std::lock_guard lock(default_mu);
    std::swap(DefaultSlot(), group);
  }
  // `group` now holds the old default, released here, outside the lock: its
  // destructor waits for its work, which may call DefaultProcessGroup().
}

std::shared_ptr<ProcessGroup> DefaultProcessGroup() {
  std::lock_guard lock(default_mu);
  if (DefaultSlot() == nullptr) {
    throw std::logic_error(
        "no default process group: call ddp::dist::InitProcessGroup() first, or pass a group");
  }
  return DefaultSlot();
}

void DestroyProcessGroup() {
  std::shared_ptr<ProcessGroup> old;
  {
    std::lock_guard lock(default_mu);
    old = std::move(DefaultSlot());
    DefaultSlot() = nullptr;
  }
  // `old` is released here, outside the lock (its destructor may wait).
}

}  // namespace ddp::dist
