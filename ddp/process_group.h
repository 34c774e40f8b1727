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
// Versions. A collective or receive that writes into a caller's tensor
// (AllReduce's, a non-root's Broadcast tensor, an output) bumps that
// tensor's storage version (nn::Storage::version) once the transport call
// has returned, as an in-place op does: an optimizer's f32 master of a
// 16-bit parameter then takes the new values at its next step instead of
// writing its own back, and autograd refuses a saved tensor that changed.
// Tensors only read (a root's, a send's) keep their version.
//
// Errors. Argument errors (undefined or non-contiguous tensors, tensors on
// two devices, mismatched sizes, an output that shares memory with an input
// other than in the collective's in-place layout: AllGather's input as
// output's block rank(), ReduceScatter's output as input's block rank(), on
// the root Gather's input / Scatter's output as the rooted buffer's block
// root; AllToAll has none) throw std::invalid_argument at the call. Such a
// rank does not take part; for a collective the other ranks do call, they
// wait for it until their deadline unless the program stops them. A rank
// that cannot issue a call for want of resources (std::bad_alloc for the
// call's own bookkeeping, no thread to run it) aborts the group before the
// exception leaves the call, so that its peers fail at once with a reason
// naming it and the call ("ProcessGroup::AllReduce failed on rank 1 before
// it was issued: std::bad_alloc"). Past that point (messages posted in the
// call, a collective run on the caller's thread) the call returns its Work,
// and a failure of its bookkeeping fails that Work with RESOURCE_EXHAUSTED
// naming it ("could not post send to rank 0 ...: its bookkeeping failed";
// a post that had failed already keeps its own reason, with a note) and
// aborts the group the same way; nothing else (a message that went)
// completes that Work first. A collective
// that fails (a peer died, a deadline passed, ranks disagreed) completes its
// Work with the transport's Status code, its message prefixed with the
// collective ("all_reduce bucket 3(sum, f32 [4]) (collective #5 on rank 0):
// "); Work::Wait throws it as a DistributedError. A collective that never
// ran because the group was aborted before says "not run: the group was
// aborted: <reason>" after that prefix. After such a failure the
// communicator is aborted: every later collective fails at once with the
// first reason, on every rank (peers are told the transport's reason,
// without this rank's prefix).
//
// Debug mode (DDP_DEBUG=detail, or ProcessGroupOptions::debug_detail):
// before each collective the ranks exchange a fixed-size fingerprint (the
// collective's number, kind, dtype, shape, root, reduction) and compare
// them, so that ranks running different collectives report which rank runs
// what, instead of hanging or exchanging garbage.
// DDP_DEBUG other than off, info or detail (any case; unset or empty is
// off): every rank of a group being made throws std::invalid_argument
// naming the variable, each rank that had a bad value and the value; the
// ranks share their values when the group is made, so one rank's mistake
// does not leave the others waiting for it. A bad DDP_COLLECTIVE_THREAD
// (not auto, comm or caller) is shared and refused the same way. The ranks
// may set different valid DDP_COLLECTIVE_THREAD values: it only chooses
// which of a rank's own threads runs its CPU collectives, in the same order.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ddp/trace.h"
#include "nn/tensor/tensor.h"
#include "transport/communicator.h"

namespace ddp::dist {

enum class DebugLevel : int;  // ddp/debug_mode.h

namespace internal {
class DeviceFence;
/// Options for a communicator call made inside a task: the time left until
/// the task's `deadline` (at least 1 ms, so that a call made just at the
/// deadline reports TIMED_OUT itself), never a fresh full timeout.
transport::CallOptions Within(transport::Deadline deadline);

/// Keeps `object` reachable, never freed, for the rest of the process (one
/// list, defined in process_group.cc): for what is left on purpose to a
/// task or thread still running, such as a stuck group's state or a hook's
/// GradBucket, so that LeakSanitizer does not report it as lost.
void KeepForever(std::shared_ptr<void> object);

/// While one lives, the collectives that this thread issues with an empty
/// label (on any group) take `label` instead. DDP's reducer holds one,
/// naming the bucket, while a communication hook runs: a desync report or a
/// failure of the hook's unlabelled all-reduce then says which bucket it
/// was. Labels given by the caller are kept; Run's descriptions are kept
/// and the label appended to their kind (unless it holds the label already),
/// so that a failing task names the bucket too. The
/// previous label comes back when it is destroyed (scopes nest). `label`
/// is referred to, not copied (the reducer's runs on every bucket of every
/// step): it must outlive the scope.
class ScopedDefaultLabel {
 public:
  explicit ScopedDefaultLabel(const std::string& label);
  ~ScopedDefaultLabel();
  ScopedDefaultLabel(const ScopedDefaultLabel&) = delete;
  ScopedDefaultLabel& operator=(const ScopedDefaultLabel&) = delete;

 private:
  const std::string* previous_;
};

/// Test only: the next NewGroup call in this process that forms a group
/// this rank is a member of fails (std::bad_alloc) once every member holds
/// the new group's communicator, as when there is no memory for its part.
void FailNextNewGroupAfterSplitForTesting();

/// Test only: the next collective to finish its task in this process (on
/// any group and thread), or the next messages posted in the call that
/// issues them, then fails its bookkeeping (its trace event) with
/// std::bad_alloc, as when memory runs out there. Armed inside a task, it
/// is that task's.
void FailNextBookkeepingForTesting();

/// Test only: the next messages posted in the call that issues them (a
/// Send, Recv or BatchIsendIrecv with nothing queued or running ahead), in
/// this process, fail before they are posted with std::bad_alloc, as when
/// memory runs out there. On a group aborted already that post reports the
/// abort (its code, "not run: the group was aborted: ...") and uses the
/// failure up. Only such a post uses it: messages that go through the
/// communication thread (something queued or running ahead on their group,
/// a CUDA tensor, a group of one) leave it armed, and it then fails the
/// next post made in the call, on any group of this process.
void FailNextPostForTesting();

/// ProcessGroup::AllGatherObject gathers the objects padded to the longest
/// in one all-gather while size() x the longest object is at most this many
/// bytes, else broadcasts each rank's bytes from it (see there).
inline constexpr size_t kObjectAllGatherPaddedBytes = size_t{1} << 20;
/// Test only: that bound, set to the same value on every rank (ranks with
/// different bounds would run different transport calls) before the
/// AllGatherObject calls it is for; 0 always broadcasts.
void SetObjectAllGatherPaddedBytesForTesting(size_t bytes);
/// Test only: the transport calls AllGatherObject has made in this process.
uint64_t ObjectAllGatherCallsForTesting();
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
  /// before this one and this one could have used its whole timeout, plus
  /// ProcessGroupOptions::wait_margin. For
  /// CUDA tensors, also orders the calling thread's current stream after
  /// the collective (no host wait for the device).
  void Wait();
  /// Waits until done or `deadline`; the collective's status, or TIMED_OUT
  /// for the wait itself (the collective then keeps its own deadline).
  /// Device tensors: only Wait delivers results. WaitFor does not order the
  /// caller's stream after the collective, nor copy a CUDA Recv's data out
  /// of its host staging buffer: after an OK here, call Wait (it returns at
  /// once) before reading device results. Host tensors hold their results
  /// once it returned OK.
  transport::Status WaitFor(transport::Deadline deadline);
  /// True once finished (successfully or not), and always in a child
  /// forked after the call was issued, where Wait says why; never blocks. Like WaitFor,
  /// it delivers nothing to device tensors: Wait does.
  bool IsCompleted() const;
  /// False for a default-constructed handle.
  bool valid() const { return state_ != nullptr; }

  /// When the collective started and finished running on the
  /// communication thread (time_point{} while not yet, and in a forked
  /// child where a thread of the parent held its lock at the fork).
  std::chrono::steady_clock::time_point started() const;
  std::chrono::steady_clock::time_point finished() const;

  struct State;

 private:
  friend class ProcessGroup;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

/// CPU blocks of at least this many bytes come from shareable memory once
/// ShareLargeCpuBlocks ran.
inline constexpr size_t kShareableBlockBytes = size_t{256} << 10;

/// Makes the CPU allocator take blocks of kShareableBlockBytes and more
/// (up to 256 at once) from shareable memory (transport/shm/shareable.h),
/// so that large tensors, gradients among them, are buffers the other
/// ranks of the host reach through mappings instead of cross-memory attach
/// (about 3x faster for megabytes). A process group whose ranks share a
/// host calls it when created; idempotent.
void ShareLargeCpuBlocks();

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

/// Largest tag of ProcessGroup::Send/Recv: the tags above it are reserved
/// for the group's own messages (the monitored barrier, Send's headers).
inline constexpr uint32_t kMaxP2pTag = (1u << 30) - 1;

/// One operation of ProcessGroup::BatchIsendIrecv (torch.distributed.P2POp).
struct P2POp {
  enum class Kind : int { kSend = 0, kRecv = 1 };
  Kind kind = Kind::kSend;
  nn::Tensor tensor;  ///< Sent from, or received into (contiguous, whole).
  int peer = 0;       ///< Destination of a send, source of a receive.
  uint32_t tag = 0;   ///< At most kMaxP2pTag.

  static P2POp Send(nn::Tensor tensor, int dst, uint32_t tag = 0) {
    return {Kind::kSend, std::move(tensor), dst, tag};
  }
  static P2POp Recv(nn::Tensor tensor, int src, uint32_t tag = 0) {
    return {Kind::kRecv, std::move(tensor), src, tag};
  }
};

/// Which thread runs a group's collectives on CPU tensors.
enum class CollectiveThread {
  /// kCaller when the communicator's waits yield (CommunicatorInfo::
  /// yields_when_idle: the ranks on this kernel have more busy threads than
  /// cores, or over TCP between hosts no core to spare for the kernel's
  /// network stack), else kCommThread.
  kAuto,
  /// The group's communication thread: the caller (DDP's backward) goes on
  /// computing while they run.
  kCommThread,
  /// The thread that issues them, whenever nothing is queued or running
  /// ahead (the returned Work is then complete): no hand-off to another
  /// thread and no second busy thread per rank. Where cores are
  /// oversubscribed the communication thread overlaps nothing (it takes the
  /// cores backward needs) and its wake-ups and waits cost time: on 2 cores
  /// with 2 ranks DDP ran 1-8% faster this way (docs/benchmarks.md). The
  /// communicator is then told of one busy thread fewer per rank
  /// (Communicator::SetBusyThreadsPerRank), so its waits spin where the
  /// ranks' training threads fit the cores.
  kCaller,
};

/// The longest ProcessGroupOptions::timeout (30 days).
inline constexpr std::chrono::milliseconds kMostTimeout{30LL * 24 * 3600 * 1000};

struct ProcessGroupOptions {
  /// Deadline of each collective, counted from when it starts running; at
  /// most kMostTimeout.
  std::chrono::milliseconds timeout{300000};
  /// Fingerprint check before each collective (see the header comment).
  /// DDP_DEBUG=detail in the environment turns it on as well.
  bool debug_detail = false;
  /// Nice value of the communication thread (0: the process's own). A
  /// positive value lets compute threads win the core while a collective
  /// waits for a late peer, when ranks have no spare cores.
  int comm_thread_nice = 0;
  /// Where CPU collectives run (device collectives always use the
  /// communication thread, which orders them with the streams).
  /// DDP_COLLECTIVE_THREAD=auto|comm|caller (any case) in the environment overrides it.
  CollectiveThread collective_thread = CollectiveThread::kAuto;
  /// How long Work::Wait waits past the point where its collective and
  /// every one queued ahead of it could have used their whole timeouts
  /// (counted from the call), and the destructor past the same point for
  /// the unfinished ones, before giving up: Wait with TIMED_OUT "not
  /// finished by the waiter's deadline", the destructor by aborting the
  /// communicator. A collective's own deadline starts when it starts
  /// running, and its failure reaches the waiter a little after it (a
  /// transport noticing the deadline, a busy core): the margin lets a
  /// collective that times out report its own error, which names what it
  /// waited for, instead of the waiter's. With the default, only a task
  /// that ignores its deadline (Run) outlives it; a Wait that gave up
  /// leaves the collective running, writing its tensors until it ends. At
  /// least 0, at most kMostTimeout (else std::invalid_argument naming it).
  std::chrono::milliseconds wait_margin{5000};
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
  /// group. Collective: every rank calls it. Throws DistributedError, or
  /// std::invalid_argument on every rank for a bad DDP_DEBUG or
  /// DDP_COLLECTIVE_THREAD on any rank.
  /// comm_options.busy_threads_per_rank left at 0 becomes 2: the caller's
  /// thread computes while the group's thread waits in collectives.
  static std::shared_ptr<ProcessGroup> CreateFromEnvironment(
      ProcessGroupOptions options = {}, transport::CommunicatorOptions comm_options = {});
  /// A one-process group with no transport (collectives are local).
  static std::shared_ptr<ProcessGroup> Single(ProcessGroupOptions options = {});

  /// Takes over `comm`; nothing else may call it from now on.
  ProcessGroup(std::unique_ptr<transport::Communicator> comm, ProcessGroupOptions options);
  /// Waits for the queued, running and in-flight collectives to finish
  /// within their own deadlines (a peer that comes late but in time
  /// succeeds; past about 2 s it says on stderr what it waits for). Each
  /// ends by its deadline, and a failure aborts the group, so the rest end
  /// at once; if some are still unfinished after their deadlines (a task
  /// that ignores its own), the communicator is aborted ("destroyed with N
  /// collective(s) unfinished past their deadlines") so that peers fail
  /// instead of waiting. A task still running one wait_margin after that
  /// ignores the abort too: the destructor then fails what is queued, says
  /// so on stderr and returns, leaving the task on its thread and keeping
  /// the group's memory (the communicator included) for it.
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// This process's rank in the group that NewGroup calls started from
  /// (the job's, for a group made from the world); rank() elsewhere.
  /// What names per-process files, which group ranks would make collide.
  int root_rank() const { return root_rank_; }
  const ProcessGroupOptions& options() const { return options_; }
  /// Whether the debug-mode fingerprint check runs.
  bool debug_detail() const { return options_.debug_detail; }
  /// DDP_DEBUG as this process read it when the group was made (kOff when
  /// unset; ProcessGroupOptions::debug_detail does not change it). What the
  /// group's users (DDP's logging) follow, so that setting the variable
  /// later changes nothing: a level read again could differ between ranks.
  DebugLevel debug_level() const { return debug_level_; }
  /// Whether CPU collectives run on the caller's thread (the resolved
  /// ProcessGroupOptions::collective_thread).
  bool collectives_on_caller() const;

  /// The pieces [offset, offset + count) of this rank's slice that a
  /// transport::Communicator::AllReduceThrough of `numel` elements of
  /// `dtype` hands to its function, in order (one piece of the whole
  /// vector on one rank). A negative `numel` throws std::invalid_argument.
  std::vector<std::pair<int64_t, int64_t>> ThroughPieces(int64_t numel, nn::DType dtype) const;

  /// Zeros for a tensor this group reduces again and again (DDP's gradient
  /// buckets). On the CPU, when the group's ranks share a host, it lies in
  /// shareable memory (transport/shm/shareable.h): the host's ranks then
  /// copy with it through mappings instead of cross-memory attach, about 3x
  /// faster for megabytes (docs/benchmarks.md). Otherwise nn::Zeros.
  nn::Tensor CollectiveZeros(const nn::Shape& shape, nn::TensorOptions options = {}) const;

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
  /// from rank q. Empty splits: size() equal parts of dim 0. Contiguous
  /// tensors on one device (CUDA tensors are copied to the host whole and
  /// back), of one dtype and row shape; input_splits[q] here must equal
  /// output_splits[rank()] on rank q.
  Work AllToAll(const nn::Tensor& output, const nn::Tensor& input,
                std::vector<int64_t> output_splits = {}, std::vector<int64_t> input_splits = {},
                const std::string& label = "");
  // Rooted collectives (torch.distributed.reduce, gather, scatter) over
  // Communicator::Reduce/Gather/Scatter. Contiguous tensors on one device
  // (CUDA tensors go through the transport's staging slots; the list forms
  // take CPU tensors only); every rank
  // passes the same root (and op), and the same element count and dtype
  // for the tensors it sends or receives; a buffer that only the root uses
  // may be undefined elsewhere. Ranks that disagree fail with a
  // DistributedError (DDP_DEBUG=detail names what each rank ran).

  /// In place on the root: root's `tensor` becomes `op` over every rank's;
  /// the other ranks' tensors are left as they were.
  Work Reduce(const nn::Tensor& tensor, int root,
              transport::ReduceOp op = transport::ReduceOp::kSum, const std::string& label = "");
  /// Root's `output` (size() x input.numel() elements, input's dtype)
  /// receives rank r's `input` at offset r * input.numel(); `output` is not
  /// used on the other ranks.
  Work Gather(const nn::Tensor& output, const nn::Tensor& input, int root,
              const std::string& label = "");
  /// torch's list form (a name of its own: `Gather({t}, ...)` would pick the
  /// overload above): on the root, outputs[r] (size() tensors of input's
  /// dtype and element count, any shape) receives rank r's `input`; the
  /// other ranks pass an empty list.
  Work GatherList(const std::vector<nn::Tensor>& outputs, const nn::Tensor& input, int root);
  /// `output` receives block rank() (output.numel() elements) of root's
  /// `input` (size() x output.numel() elements, output's dtype); `input`
  /// is not used on the other ranks.
  Work Scatter(const nn::Tensor& output, const nn::Tensor& input, int root,
               const std::string& label = "");
  /// torch's list form: `output` receives root's inputs[rank()] (size()
  /// tensors of output's dtype and element count, on the root; an empty
  /// list elsewhere).
  Work ScatterList(const nn::Tensor& output, const std::vector<nn::Tensor>& inputs, int root);

  /// Completes once every rank has entered it.
  Work Barrier();

  // Point-to-point (torch.distributed.isend / irecv). Not collective: only
  // the two ranks take part, and no debug-mode fingerprint is exchanged.
  // The message is posted after the collectives issued before it (a tensor
  // an earlier collective writes is sent once that collective is done): at
  // once on the calling thread when nothing is queued, else by the
  // communication thread when it gets there. It is not queued behind later
  // collectives: its Work completes when the message has gone or arrived,
  // driven by Wait/WaitFor/IsCompleted (or, every millisecond or so, by the
  // communication thread). A Send is matched by the Recv of the same tag
  // from this rank, in issue order; it announces its dtype and shape first,
  // so a Recv of another dtype or element count fails on both ranks with a
  // DistributedError naming both.
  // Bad arguments (a rank outside the group, this rank itself, a tag above
  // kMaxP2pTag, an undefined or non-contiguous tensor, a receive's tensor
  // that shares memory with any other op's of the same call: the messages
  // land in any order) throw std::invalid_argument at the call; sends may
  // share memory with each other. CUDA tensors are staged through host
  // memory; a received CUDA tensor's data is copied in on the communication
  // stream by the first Wait, and every Wait (from any thread, on any
  // stream) orders the caller's current stream after that copy.

  /// Sends `tensor` to rank `dst`, matched by its Recv with `tag`.
  Work Send(const nn::Tensor& tensor, int dst, uint32_t tag = 0);
  /// Receives into `tensor` (same dtype and element count as the Send) from
  /// rank `src`'s Send with `tag`.
  Work Recv(const nn::Tensor& tensor, int src, uint32_t tag = 0);
  /// Posts every op at once, in order (torch.distributed.batch_isend_irecv);
  /// one Work for all of them. Exchanges in which every rank sends before it
  /// receives (rings, halo exchanges) belong in one batch, or in Sends and
  /// Recvs issued before any Wait.
  Work BatchIsendIrecv(const std::vector<P2POp>& ops);

  // Object collectives on byte strings (torch.distributed's
  // broadcast_object_list, all_gather_object, gather_object,
  // scatter_object_list: serialize objects to strings first). Blocking,
  // in issue order with the other collectives; every rank calls them. Sizes
  // may differ per rank and be 0. Failures throw DistributedError. A rank
  // that fails (no memory for a peer's object, or for the copy of its own
  // that the call keeps) aborts the group, so every rank fails at once
  // naming it instead of waiting out the timeout; a buffer it has no memory
  // for is named with its size in bytes (RESOURCE_EXHAUSTED). A call from
  // inside a task of the same group throws std::logic_error on that rank
  // and leaves the group as it is, as the other collectives do.

  /// `*object` on every rank becomes root's (moved, not copied, in and
  /// out; after a failure in the collective it is empty, after one before
  /// it was issued it is as it was).
  void BroadcastObject(std::string* object, int root);
  /// Every rank's `object`, in rank order. The lengths are exchanged
  /// first. Small objects (size() x the longest at most
  /// internal::kObjectAllGatherPaddedBytes, 1 MiB) are then padded to the
  /// longest and gathered in one all-gather: two transport calls in all.
  /// Larger ones are broadcast from each rank with a non-empty object
  /// straight into the string returned for it, one call per such rank:
  /// beyond the result, a rank needs no memory for the gathered bytes.
  std::vector<std::string> AllGatherObject(const std::string& object);
  /// On `dst`: every rank's `object` in rank order; elsewhere empty. The
  /// lengths are gathered to dst, then each rank sends its bytes to dst,
  /// which receives them into the string returned for that rank (nothing
  /// padded: a rank needs no memory for the others' objects).
  std::vector<std::string> GatherObject(const std::string& object, int dst);
  /// Rank q receives `objects[q]` of rank `src`; `objects` is read on src
  /// only and must hold size() strings there (otherwise every rank throws
  /// std::invalid_argument naming src's count, and the group stays usable).
  /// src broadcasts the lengths, then sends each rank its object, received
  /// into the string returned (nothing padded to the longest).
  std::string ScatterObject(const std::vector<std::string>& objects, int src);

  /// A barrier that names the ranks that did not come
  /// (torch.distributed.monitored_barrier). Rank 0 waits up to `timeout`
  /// (0: the group's timeout; above kMostTimeout, kMostTimeout) for every
  /// other rank's message, then releases
  /// them. When some are missing it throws a DistributedError naming the
  /// first missing rank, or all of them when `wait_all_ranks`, and aborts the
  /// group so that every other rank throws the same reason instead of
  /// hanging (the other ranks give up on rank 0 after 2 x timeout + 1 s). A
  /// debugging aid: it costs 2 (size() - 1) messages through rank 0.
  void MonitoredBarrier(std::chrono::milliseconds timeout = std::chrono::milliseconds(0),
                        bool wait_all_ranks = false);

  /// A group of some of this group's ranks (torch.distributed.new_group):
  /// rank i of the new group is ranks[i]. Collective over this group, in
  /// issue order with its other collectives: every rank calls it with the
  /// same list, and a rank not in it gets nullptr. The new group has this
  /// group's options and debug level (the environment is not read again),
  /// its own communicator (Communicator::Split) and
  /// communication thread, and may outlive this group. Throws
  /// std::invalid_argument for an empty list, a rank out of range or given
  /// twice (on every rank, after the comparison below: the others name the
  /// rank whose list it was),
  /// DistributedError when forming it fails. The ranks always compare
  /// their lists (length and a digest, one small all-gather) before forming
  /// the group: when a rank's list differs from rank 0's (other ranks, or
  /// another order), every rank throws std::invalid_argument naming that
  /// rank, no group is formed and this group stays usable. A member that
  /// fails (no memory) to make its part of the new group once every member
  /// holds the new communicator throws; it aborts the new group's
  /// communicator, so that the other members' first collective in it fails
  /// at once naming it ("ProcessGroup::NewGroup failed on rank R after every
  /// member had formed ..."), and leaves this group usable: this group's
  /// call was done on every rank.
  std::shared_ptr<ProcessGroup> NewGroup(const std::vector<int>& ranks);

  /// Runs `task` on the communication thread (or the caller's: see
  /// collectives_on_caller), in issue order with the other collectives
  /// (what communication hooks build on). `description` is what
  /// the debug check compares across ranks. `device_tensors` (all on one
  /// CUDA device) are ordered like a built-in collective's: the task starts
  /// once the work queued on them before this call has run, and Wait orders
  /// the caller's stream after the task. The task must not issue work on
  /// this group (it would wait for itself): that throws std::logic_error
  /// inside it, which fails its Work and aborts the group; it uses the
  /// Communicator it is given. A task's exception of any type fails its
  /// Work (and aborts the group). A task that drops the last reference to
  /// the group destroys it inside itself: its own Work gets its result,
  /// what was queued or in flight fails, and the communicator is aborted
  /// (the task's collective counts as unfinished; the task must not use
  /// `comm` after that).
  Work Run(const CollectiveDescription& description, Task task,
           const std::vector<nn::Tensor>& device_tensors = {});
  /// Run, for //ddp's own hooks: the task also gets the fence of
  /// `device_tensors` (null when they are CPU tensors or none), to queue
  /// device work on the communication stream.
  using FencedTask = std::function<transport::Status(
      transport::Communicator* comm, transport::Deadline deadline, internal::DeviceFence* fence)>;
  Work RunFenced(const CollectiveDescription& description, FencedTask task,
                 const std::vector<nn::Tensor>& device_tensors);

  /// Records each collective as a trace event in `trace` too (each of
  /// several recorders set gets every collective; null: stop recording
  /// into all of them).
  void set_trace(std::shared_ptr<TraceRecorder> trace);
  /// Stops recording into `trace`, leaving the other users' recorders.
  void StopTrace(const TraceRecorder* trace);
  /// CPU time the communication thread has used so far (zero before its
  /// first collective): what shows that it sleeps instead of spinning.
  std::chrono::nanoseconds CommThreadCpuTime() const;
  /// transport::Communicator::PeerWaitTime of the group's communicator
  /// (0 without one): time its collectives spent waiting for slower ranks.
  std::chrono::nanoseconds PeerWaitTime() const;
  /// Collectives run so far (including failed ones).
  uint64_t collectives_run() const;
  /// OK, or the reason this group's communicator was aborted.
  transport::Status aborted_reason() const;
  /// Aborts the communicator: queued and later collectives fail with `reason`
  /// here, and peers learn it within about 100 ms. The groups made from this
  /// one by NewGroup (still alive) are aborted with it. An OK `reason`
  /// aborts with ABORTED "... no reason given", one-process groups too.
  void Abort(const transport::Status& reason);

  class Impl;

 private:
  // `options` already hold the environment's settings and passed their
  // checks (WithEnvironment); the environment is not read here. `comm` is
  // taken only when the group is made: a throw leaves it with the caller.
  ProcessGroup(std::unique_ptr<transport::Communicator>&& comm, int rank, int size,
               ProcessGroupOptions options, DebugLevel debug_level);
  static void CheckTensor(const nn::Tensor& t, const char* call, const char* what);
  void CheckPeer(int peer, uint32_t tag, const char* call, const char* what) const;
  // Gather (`gather`) or Scatter between each rank's `local` tensor and the
  // root's `rooted` one; `host` (may be empty) runs on the communication
  // thread before a scatter (packing a list) or after a gather (unpacking).
  Work RootedExchange(bool gather, const nn::Tensor& local, const nn::Tensor& rooted, int root,
                      const std::string& label, std::function<void()> host);
  // GatherList (`gather`) or ScatterList: `list` staged through one buffer.
  Work ListExchange(bool gather, const nn::Tensor& local, const std::vector<nn::Tensor>& list,
                    int root);
  Work PostPointToPoint(const std::vector<P2POp>& ops, const char* call);
  // MonitoredBarrier up to the Enqueue (its handler aborts the group for a
  // failure before the barrier was issued); the caller waits.
  Work IssueMonitoredBarrier(std::chrono::milliseconds timeout, bool wait_all_ranks);
  // Run's and RunFenced's work; `call` names the one the user made.
  Work IssueTask(const CollectiveDescription& description, FencedTask task,
                 const std::vector<nn::Tensor>& device_tensors, const char* call);

  int rank_ = 0;
  int size_ = 1;
  int root_rank_ = 0;
  ProcessGroupOptions options_;
  DebugLevel debug_level_{};  // kOff
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
