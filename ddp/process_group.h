#ifndef DDP_DDP_PROCESS_GROUP_H_
#define DDP_DDP_PROCESS_GROUP_H_

// ProcessGroup: collectives on nn tensors between the ranks of a job, over a
// transport::Communicator. This is the only place in the project where
// tensors and the transport meet (DistributedDataParallel, SyncBatchNorm and
// the checkpoint helpers all go through it).
//
// Threading. Every collective runs on the group's communication thread, in
// the order it was issued; the calling thread gets a Work handle back at
// once and continues (backward keeps computing while buckets are reduced).
// Blocking use is `pg.AllReduce(t).Wait()`. Because one thread runs them
// all, collectives issued from different threads of one rank are still
// executed in one order, but that order must be the same on every rank:
// issue collectives from one thread, or in an order that is deterministic.
// The thread sleeps on a condition variable while the queue is empty (it
// never spins between collectives); inside a collective the transport waits
// for late peers by polling and then yielding the CPU.
//
// Device tensors. In a build with --config=cuda, every collective also takes
// contiguous CUDA tensors (all tensors of one call on one device). The call
// records an event on the caller's current stream; the communication thread
// waits for it (on a per-device communication stream, and by polling with
// the collective's deadline) before the transport moves the data (device
// pointers to UCX when it handles CUDA memory, otherwise staged through
// pinned host memory; reductions run on the device). Work::Wait then makes
// the caller's current stream wait for the collective's completion event:
// no device-wide synchronize. See ddp/device_ops.h. In a build without CUDA
// a CUDA tensor is refused with a message saying to build with
// --config=cuda.
//
// Errors. Argument errors (undefined or non-contiguous tensors, tensors on
// two devices, mismatched sizes) throw std::invalid_argument at the call. A collective
// that fails (a peer died, a deadline passed, ranks disagreed) completes its
// Work with the transport's Status; Work::Wait throws it as a
// DistributedError. After such a failure the communicator is aborted: every
// later collective fails at once with the first reason, on every rank.
//
// Debug mode (DDP_DEBUG=detail, or ProcessGroupOptions::debug_detail):
// before each collective the ranks exchange a fixed-size fingerprint (the
// collective's number, kind, dtype, shape, root, reduction) and compare
// them, so that ranks running different collectives report which rank runs
// what, instead of hanging or exchanging garbage.

#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/trace.h"
#include "nn/tensor/tensor.h"
#include "transport/communicator.h"

namespace ddp::dist {

namespace internal {
class DeviceFence;
}  // namespace internal

/// The API version of //ddp (bumped on incompatible change).
inline constexpr int kDdpApiVersion = 1;

/// A collective failed or ranks disagreed: carries the transport's Status.
class DistributedError : public std::runtime_error {
 public:
  explicit DistributedError(transport::Status status);
  const transport::Status& status() const { return status_; }
  transport::StatusCode code() const { return status_.code(); }

 private:
  transport::Status status_;
};

/// The transport's element type of an nn dtype (every dtype has one).
transport::DataType ToTransportType(nn::DType dtype);

/// Handle of a collective issued to a ProcessGroup. Cheap to copy; all
/// copies see one result. Tensors passed to the collective must not be
/// touched until it is completed.
class Work {
 public:
  Work() = default;

  /// Waits until the collective finished; throws DistributedError on
  /// failure. Bounded: gives up (TIMED_OUT) once every collective queued
  /// before this one and this one could have used its whole timeout. For
  /// CUDA tensors, also orders the calling thread's current stream after
  /// the collective (no host wait for the device).
  void Wait();
  /// Waits until done or `deadline`; the collective's status, or TIMED_OUT
  /// for the wait itself (the collective then keeps its own deadline).
  transport::Status WaitFor(transport::Deadline deadline);
  /// True once finished (successfully or not); never blocks.
  bool IsCompleted() const;
  /// False for a default-constructed handle.
  bool valid() const { return state_ != nullptr; }

  /// When the collective started and finished running on the
  /// communication thread (time_point{} while not yet).
  std::chrono::steady_clock::time_point started() const;
  std::chrono::steady_clock::time_point finished() const;

  struct State;

 private:
  friend class ProcessGroup;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

/// What a collective does, for debug-mode checks, traces and messages.
struct CollectiveDescription {
  std::string kind;  ///< "all_reduce", "broadcast", a hook's own name...
  nn::DType dtype = nn::DType::kFloat32;
  nn::Shape shape;
  int root = -1;  ///< Broadcast root; -1 when it does not apply.
  transport::ReduceOp op = transport::ReduceOp::kSum;
  bool has_op = false;  ///< Whether `op` applies.
  /// "all_reduce(sum, f32 [1024])".
  std::string ToString() const;
};

struct ProcessGroupOptions {
  /// Deadline of each collective, counted from when it starts running.
  std::chrono::milliseconds timeout{300000};
  /// Fingerprint check before each collective (see the header comment).
  /// DDP_DEBUG=detail in the environment turns it on as well.
  bool debug_detail = false;
  /// Nice value of the communication thread (0: the process's own). A
  /// positive value lets compute threads win the core while a collective
  /// waits for a late peer, when ranks have no spare cores.
  int comm_thread_nice = 0;
};

class ProcessGroup {
 public:
  /// A custom collective run on the communication thread: it gets the
  /// communicator (null in a one-process group made without one) and the
  /// deadline of this call.
  using Task = std::function<transport::Status(transport::Communicator* comm,
                                               transport::Deadline deadline)>;

  /// Forms the group from the launch environment (RANK, WORLD_SIZE, ...;
  /// see transport/launch). Without a launch environment, a one-process
  /// group. Collective: every rank calls it. Throws DistributedError.
  /// comm_options.busy_threads_per_rank left at 0 becomes 2: the caller's
  /// thread computes while the group's thread waits in collectives.
  static std::shared_ptr<ProcessGroup> CreateFromEnvironment(
      ProcessGroupOptions options = {}, transport::CommunicatorOptions comm_options = {});
  /// A one-process group with no transport (collectives are local).
  static std::shared_ptr<ProcessGroup> Single(ProcessGroupOptions options = {});

  /// Takes over `comm`; nothing else may call it from now on.
  ProcessGroup(std::unique_ptr<transport::Communicator> comm, ProcessGroupOptions options);
  /// Waits (bounded) for queued collectives; if they do not finish in time
  /// the communicator is aborted so that peers fail instead of waiting.
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const ProcessGroupOptions& options() const { return options_; }
  /// Whether the debug-mode fingerprint check runs.
  bool debug_detail() const { return options_.debug_detail; }

  /// In place: every element becomes `op` over all ranks. Contiguous CPU tensor.
  Work AllReduce(const nn::Tensor& tensor, transport::ReduceOp op = transport::ReduceOp::kSum,
                 const std::string& label = "");
  /// In place: root's values on every rank.
  Work Broadcast(const nn::Tensor& tensor, int root, const std::string& label = "");
  /// `output` (size() * input.numel() elements, input's dtype) receives
  /// rank r's `input` at offset r * input.numel().
  Work AllGather(const nn::Tensor& output, const nn::Tensor& input, const std::string& label = "");
  /// `output` (input.numel() / size() elements) receives block rank() of
  /// `op` over all ranks' `input`.
  Work ReduceScatter(const nn::Tensor& output, const nn::Tensor& input,
                     transport::ReduceOp op = transport::ReduceOp::kSum,
                     const std::string& label = "");
  /// Rows (along dim 0) exchanged between ranks
  /// (torch.distributed.all_to_all_single): input_splits[q] rows of `input`,
  /// in rank order, go to rank q; output_splits[q] rows of `output` come
  /// from rank q. Empty splits: size() equal parts of dim 0. CPU tensors,
  /// contiguous, of one dtype and row shape; input_splits[q] here must equal
  /// output_splits[rank()] on rank q.
  Work AllToAll(const nn::Tensor& output, const nn::Tensor& input,
                std::vector<int64_t> output_splits = {}, std::vector<int64_t> input_splits = {},
                const std::string& label = "");
  /// Completes once every rank has entered it.
  Work Barrier();
  /// A group of some of this group's ranks (torch.distributed.new_group):
  /// rank i of the new group is ranks[i]. Collective over this group, in
  /// issue order with its other collectives: every rank calls it with the
  /// same list, and a rank not in it gets nullptr. The new group has this
  /// group's options, its own communicator (Communicator::Split) and
  /// communication thread, and may outlive this group. Throws
  /// std::invalid_argument for an empty list, a rank out of range or given
  /// twice, DistributedError when forming it fails.
  std::shared_ptr<ProcessGroup> NewGroup(const std::vector<int>& ranks);

  /// Runs `task` on the communication thread, in issue order with the other
  /// collectives (what communication hooks build on). `description` is what
  /// the debug check compares across ranks. `device_tensors` (all on one
  /// CUDA device) are ordered like a built-in collective's: the task starts
  /// once the work queued on them before this call has run, and Wait orders
  /// the caller's stream after the task.
  Work Run(const CollectiveDescription& description, Task task,
           const std::vector<nn::Tensor>& device_tensors = {});
  /// Run, for //ddp's own hooks: the task also gets the fence of
  /// `device_tensors` (null when they are CPU tensors or none), to queue
  /// device work on the communication stream.
  using FencedTask = std::function<transport::Status(
      transport::Communicator* comm, transport::Deadline deadline, internal::DeviceFence* fence)>;
  Work RunFenced(const CollectiveDescription& description, FencedTask task,
                 const std::vector<nn::Tensor>& device_tensors);

  /// Records each collective as a trace event (null: stop recording).
  void set_trace(std::shared_ptr<TraceRecorder> trace);
  /// CPU time the communication thread has used so far (zero before its
  /// first collective): what shows that it sleeps instead of spinning.
  std::chrono::nanoseconds CommThreadCpuTime() const;
  /// Collectives run so far (including failed ones).
  uint64_t collectives_run() const;
  /// OK, or the reason this group's communicator was aborted.
  transport::Status aborted_reason() const;
  /// Aborts the communicator: queued and later collectives fail with `reason`
  /// here, and peers learn it within about 100 ms.
  void Abort(const transport::Status& reason);

  class Impl;

 private:
  ProcessGroup(std::unique_ptr<transport::Communicator> comm, int rank, int size,
               ProcessGroupOptions options);
  static void CheckTensor(const nn::Tensor& t, const char* call, const char* what);

  int rank_ = 0;
  int size_ = 1;
  ProcessGroupOptions options_;
  std::unique_ptr<Impl> impl_;
};

/// The job-wide group used when none is given (PyTorch's default group).
/// InitProcessGroup creates it from the environment (collective); it is
/// replaced by a later call and released by DestroyProcessGroup.
std::shared_ptr<ProcessGroup> InitProcessGroup(
    ProcessGroupOptions options = {}, transport::CommunicatorOptions comm_options = {});
/// Makes `group` the default one.
void SetDefaultProcessGroup(std::shared_ptr<ProcessGroup> group);
/// The default group; throws std::logic_error when none was set.
std::shared_ptr<ProcessGroup> DefaultProcessGroup();
/// Drops the default group (destroyed once nobody else holds it).
void DestroyProcessGroup();

}  // namespace ddp::dist

#endif  // DDP_DDP_PROCESS_GROUP_H_
