#ifndef DDP_TRANSPORT_COMMUNICATOR_H_
#define DDP_TRANSPORT_COMMUNICATOR_H_

// The public API of //transport: collectives and point-to-point messages
// between the ranks of a job, over UCX between processes and hosts, with a
// shared-memory fast path between ranks of one host.
//
// Error model: every call returns a Status. A collective's arguments are
// checked before any message is exchanged (INVALID_ARGUMENT), in two kinds:
//  - what every rank passes alike (dtype, op, root, algorithm,
//    staged_reduce, a count whose bytes overflow the address space): every
//    rank of the call refuses it the same way, none takes part, and the
//    communicator stays usable. Ranks that disagree on these are a program
//    error the check cannot see: the others wait for the refusing rank
//    until their deadline, and it must not go on to its next collective;
//  - what only this rank has (its buffers: null with a count, misaligned,
//    overlapping other than in place, on two CUDA devices, host memory
//    next to device memory; AllToAllV's count lists; AllReduceThrough's
//    function): the other ranks cannot know
//    that it will not take part, so the refusing rank aborts the
//    communicator, as a failed collective does. Its message starts "rank R
//    refused the call: "; the others fail within ~100 ms with "rank R
//    aborted the job: rank R refused the call: ...", in that call or, a
//    rank whose part was done before it could tell (a tree leaf whose data
//    went out), in its next one. No rank pairs a later call with another's.
//    The abort is immediate: this rank's earlier async calls that have not
//    finished fail with it too.
// Send and Recv refuse their own arguments without aborting: they are not
// numbered with the collectives, and the peer's matching call times out.
// Any failure once communication started (a peer died: PEER_LOST; a
// deadline passed: TIMED_OUT; ranks passed different counts:
// INVALID_ARGUMENT) aborts the communicator: the reason is posted to the
// job's store so that every rank learns it within ~100 ms, and every later
// call fails at once with that first reason. Create a new communicator (a
// new job) to continue.
//
// Threading: see transport/README.md. In short: calls may come from any
// thread but must be issued in the same order on every rank; blocking calls
// run on the caller's thread once earlier async calls have finished; async
// calls run in issue order on one internal thread; never two threads drive
// UCX at once. A call's deadline counts from when it can start: for an
// async call when it starts running, for a blocking one once the earlier
// async calls have finished (that wait is bounded by their own deadlines);
// time spent waiting for another thread's call counts (a queued call held
// up by one past its deadline fails with TIMED_OUT and aborts).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport {

/// Where staged all-reduces and reduce-scatters on device buffers reduce
/// (see transport/README.md, Device buffers).
enum class StagedReduce : int {
  kAuto = 0,    ///< DDP_STAGED_REDUCE (device or host) when set, else kHost.
  kDevice = 1,  ///< On the GPU; the host only moves bytes. Up to 16 ranks, else as kHost.
  kHost = 2,    ///< On the host CPU, in the pinned staging slots.
};

/// How a communicator is formed. Fields left at their defaults are taken from
/// the launch environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT, DDP_STORE_ADDR, DDP_STORE_PORT, DDP_JOB_TOKEN,
/// DDP_STORE_HOST; see
/// transport/launch/README.md) by Communicator::CreateFromEnvironment.
struct CommunicatorOptions {
  int rank = 0;                 ///< This process's rank in [0, world_size).
  int world_size = 1;           ///< Number of ranks, 1 to 2^22 (4194304).
  int local_rank = 0;           ///< Rank among the processes of this host.
  int local_world_size = 1;     ///< Processes of this job on this host, 1 to world_size.
  std::string store_host = "127.0.0.1";  ///< Where the rendezvous store listens.
  int store_port = 0;           ///< Its TCP port; 0 with world_size 1 and host_store: any free one.
  bool host_store = true;       ///< Rank 0 serves the store (else a launcher does).
  std::string job_token;        ///< Shared secret every rank presents to the store.
  /// Prefix of this communicator's store keys. A process that makes a
  /// second communicator of the same name on the same store (after
  /// destroying the first, say) gets fresh keys for it ("name#1", then
  /// "name#2", ...): every rank must make its communicators in the same
  /// order, as creation is collective anyway (a Create refused for its
  /// world_size, name or store_port, before the store, does not count).
  /// No newline in it; at most 896 bytes: the store's keys start with it,
  /// and leave 960 bytes for it with what "#<n>" and each Split's
  /// "/split<n>/<color>" add (a Split past that is refused, naming it).
  std::string name = "default";

  /// Deadline of every call that does not pass its own, and of creation.
  /// milliseconds::max() (any timeout past the clock's range) gives a
  /// deadline that never comes.
  std::chrono::milliseconds timeout{300000};
  /// How long posting or reading the job's abort reason may take outside a
  /// call: an explicit Abort, a failed creation (its reason's post and its
  /// marks of leaving share one; when the post was over within it, the
  /// marks get 0.2 s each at least, so that a slow store still has them),
  /// a failed call's reason (posted in the background: the call itself
  /// returns by its deadline), and leaving
  /// (this rank's closed mark; after an abort, its count of the ranks that
  /// left).
  std::chrono::milliseconds abort_store_time{1000};
  /// Longest a single store access inside a call may take before the store
  /// counts as unreachable (the rank serving it lost), when the call's
  /// deadline is further away.
  std::chrono::milliseconds store_call_cap{2000};
  /// All-reduce algorithm; kAuto lets the selection table choose per size
  /// and topology. DDP_ALLREDUCE_ALGO overrides kAuto from the environment.
  /// Equal on every rank.
  Algorithm algorithm = Algorithm::kAuto;
  /// Topology description to use instead of discovery (DDP_TOPOLOGY_FILE).
  /// The same description on every rank (the path may differ).
  std::string topology_file;
  /// Use the shared-memory path between ranks of one host when possible:
  /// for every all-reduce when all ranks are on one host, for the
  /// hierarchical all-reduce's steps inside each host otherwise.
  /// DDP_SHARED_MEMORY=0 (or false, off, no) in the environment turns it off.
  bool shared_memory = true;
  /// Tuning for tests: bytes per pipelined chunk (0: algorithm default), so
  /// that small inputs reach the multi-chunk paths. At most 1 GiB.
  size_t chunk_bytes = 0;
  /// Pin the thread that creates the communicator and the communicator's own
  /// thread to one core (local rank modulo the cores this process may use),
  /// as mpirun does by default. On a busy machine this keeps two ranks off
  /// one core's run queue (measured: 4 KiB all-reduce 3 us pinned, 500+ us
  /// not, with 12 other runnable processes). Off by default: it also pins
  /// whatever else the creating thread runs. Communicators made on that
  /// thread later (a Split, a second Create) still count the CPUs the
  /// process had before the pin when choosing to spin or yield.
  bool bind_to_core = false;
  /// Threads of each rank that keep a core busy while its collectives wait
  /// (0: one). A training loop that computes backward while DDP's
  /// communication thread reduces gradients has two. Waits spin while every
  /// such thread of the ranks on this kernel can have a core of its own
  /// (and, over TCP between hosts, one core is left for the kernel);
  /// otherwise they yield, since a spinning wait takes the core a compute
  /// thread or the network stack needs (measured on 2 cores:
  /// docs/benchmarks.md).
  int busy_threads_per_rank = 0;
  /// Collectives on device buffers (CUDA build) go through pinned host
  /// memory in chunks of this many bytes per rank's slot (0: 4 MiB; at
  /// most 1 GiB); tests shrink it to reach the multi-chunk paths. Equal on
  /// every rank.
  size_t device_chunk_bytes = 0;
  /// Device buffers of ranks on one host: exchange CUDA IPC handles and
  /// copy and reduce GPU to GPU instead of staging through host memory,
  /// when every rank reaches every peer's GPU (the same GPU or peer access).
  /// Off by default until measured on a GPU; DDP_CUDA_IPC=1 (or true, on,
  /// yes) turns it on.
  /// Equal on every rank.
  bool cuda_ipc = false;
  /// Where staged all-reduces and reduce-scatters on device buffers reduce.
  /// Equal on every rank.
  StagedReduce staged_reduce = StagedReduce::kAuto;
};

/// Per-call settings.
struct CallOptions {
  /// This call's deadline from its start (a blocking call's once earlier
  /// async calls have finished; see Threading above); 0 or below: the communicator's
  /// timeout (a negative value is not an expired deadline: a caller whose
  /// time is up must fail the call itself). milliseconds::max(): a
  /// deadline that never comes.
  std::chrono::milliseconds timeout{0};
  /// All-reduce (and AllReduceThrough): kAuto follows the communicator's
  /// choice. Reduce: kTree, kRing, kSharedMemory or kAuto (see
  /// Communicator::Reduce). Every other call has no algorithm to choose
  /// and refuses any but kAuto (INVALID_ARGUMENT, on every rank alike).
  Algorithm algorithm = Algorithm::kAuto;
  /// All-reduce and reduce-scatter on device buffers: where a staged call
  /// reduces; kAuto follows the communicator's choice. Other calls ignore
  /// it. Equal on every rank; a value outside the enum is INVALID_ARGUMENT
  /// in every call.
  StagedReduce staged_reduce = StagedReduce::kAuto;
};

/// Handle of an asynchronous call. Cheap to copy; all copies see one result.
/// Buffers passed to the call must stay valid and untouched until it is done.
class Work {
 public:
  Work() = default;
  /// Waits until the call finishes; returns its status (FAILED_PRECONDITION
  /// at once from inside AllReduceThrough's slice function, as Wait(deadline)).
  Status Wait();
  /// Waits until the call finishes or `deadline` passes (TIMED_OUT; the call
  /// itself keeps running until its own deadline). From inside
  /// AllReduceThrough's slice function on the call's communicator, where
  /// the call cannot progress, an unfinished call is FAILED_PRECONDITION at
  /// once (the call goes on).
  Status Wait(Deadline deadline);
  /// True once finished successfully; the call's error once it failed.
  /// FAILED_PRECONDITION as Wait from inside the slice function.
  StatusOr<bool> Test();
  /// False for a default-constructed handle.
  bool valid() const { return state_ != nullptr; }

  struct State;

 private:
  friend class Communicator;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

/// What creation learned about the job (for logs and tests).
struct CommunicatorInfo {
  int num_hosts = 1;
  bool shared_memory = false;  ///< The intra-host fast path is in use.
  /// Several hosts: the hierarchical all-reduce's steps inside each host
  /// use the shared-memory path.
  bool host_shared_memory = false;
  /// Why the ranks of this host went without the shared-memory path (one
  /// could not create or map the segment, or cross-memory attach is not
  /// permitted): the same text on each of them. Empty when it was not
  /// tried or they took it.
  std::string shared_memory_unavailable;
  std::string ucx_tls;         ///< UCX transports in force.
  std::string net_device;      ///< RDMA port chosen for this rank ("" none).
  std::string ring_order;      ///< Rank order of rings, "0 2 1 3".
  /// UCX moves CUDA device memory itself: Broadcast, AllGather, Send/Recv
  /// and the device-reduce exchanges hand it device pointers; otherwise
  /// they are staged through host memory.
  bool ucx_cuda_memory = false;
  /// The staged-reduce choice in force (never kAuto).
  StagedReduce staged_reduce = StagedReduce::kHost;
  /// Ranks of the job on this rank's kernel, itself included (same boot id,
  /// whatever the host names: containers on one machine share its cores).
  int ranks_sharing_kernel = 1;
  /// Waits yield the CPU instead of spinning: those ranks times
  /// busy_threads_per_rank outnumber the cores this rank may use, or, when
  /// peers on other hosts are reached over TCP, leave none for the kernel's
  /// network stack (topology::ChooseIdlePolicy).
  bool yields_when_idle = false;
  /// Over TCP with no core to spare: waits yield at the first idle poll.
  bool yields_at_once = false;
  /// The busy threads per rank those choices were made for (at least 1;
  /// see Communicator::SetBusyThreadsPerRank).
  int busy_threads_per_rank = 1;
};

/// Device buffers: in a build with --config=cuda, every collective and
/// Send/Recv also accepts CUDA device pointers (cudaMalloc), detected per
/// call. Collectives stage them through pinned host memory in pipelined
/// chunks, reducing on the device or the host (StagedReduce), or hand them
/// to a UCX that moves device memory (see transport/README.md); every rank
/// must pass the same kind of memory to one collective, and one call's
/// buffers are all host memory or all on one device (else INVALID_ARGUMENT
/// naming them; a buffer this rank does not use, such as a non-root's
/// recv, does not count). Inputs must be complete: the copies, and a
/// CUDA-enabled UCX handed the buffers as they are, wait for work on the
/// legacy default stream, not for other streams. Results are in place when
/// the call returns. Without CUDA every pointer is host memory.
class Communicator {
 public:
  /// Forms the communicator with every other rank. Collective: every rank
  /// calls it. Installs the fork guard: in a child forked (without exec)
  /// after this, every call into the transport fails with
  /// FAILED_PRECONDITION, and destroying a communicator does nothing.
  /// A bad option (INVALID_ARGUMENT naming it) fails every rank: one that
  /// only this rank has wrong is posted to the store for the others, and
  /// so is a rank that another process of the job claimed first (the job
  /// fails, naming both processes).
  static StatusOr<std::unique_ptr<Communicator>> Create(const CommunicatorOptions& options);
  /// Create() with the fields of `defaults` that the launch environment
  /// defines replaced by its values. NOT_FOUND when there is no launch
  /// environment; INVALID_ARGUMENT naming a malformed variable.
  static StatusOr<std::unique_ptr<Communicator>> CreateFromEnvironment(
      CommunicatorOptions defaults = {});

  /// Leaves the job: waits for pending async calls (at most min(timeout,
  /// 30 s); calls still queued or running then are ended by an abort),
  /// tells the store this rank closed cleanly, closes UCX. Rank 0, when it
  /// serves the store, waits (bounded) for the other ranks to leave first:
  /// without an abort, at most min(timeout, 30 s), and no longer than until
  /// each rank not yet left is gone (exited, or its connection broke); after
  /// an abort, 1 s for every rank (to read the reason), then up to 3 s in all
  /// only for ranks that may still come: one that is gone, or that sits
  /// stopped on this host (SIGSTOP, SIGTSTP, a debugger) and has been for
  /// 0.5 s, holds it no longer. A rank that merely runs slowly is waited for
  /// the whole 3 s; a stopped rank on another host cannot be seen and is
  /// waited for as a slow one. When it then stops the store under ranks
  /// not yet left (a split of theirs running on), their store calls fail
  /// UNAVAILABLE saying so: after a clean shutdown, which ranks of which
  /// communicator had not left, and rank 0 prints the same as a warning on
  /// stderr; after an abort, how many of each communicator's ranks. A clean
  /// stop tells no abort, so the ranks of a split still running on past it
  /// go on; but when a communicator whose ranks had not left was aborted
  /// (a split without rank 0, just before) and each of the others with
  /// ranks not left was aborted too or has rank 0 as a member (so it runs
  /// no collective any more), the stop is not a clean one and names each
  /// abort reason (rank 0 warns with it as well): their ranks' next wait
  /// fails with PEER_LOST carrying it instead of waiting out its deadline
  /// (and so does a Send/Recv between other ranks of a communicator of
  /// rank 0's). The whole destruction keeps to min(timeout, 30 s) from its
  /// start and 0.2 s more to close (the marks in the store, the endpoints),
  /// however long any of those steps would take alone (a stopped store or
  /// peer). Outside that bound, each with a bound of its own: an abort of
  /// calls still running, or the thread posting an abort that a failed
  /// peer check started just before (joined here), may add
  /// abort_store_time; and a communicator that staged device buffers waits
  /// for its staging copies and frees their slots, up to 2 s for each and
  /// so 4 s per device used (a device that does not answer by then leaks
  /// them rather than blocking); and this rank's mark of leaving and its
  /// count among the ranks that left get 0.2 s each even where the steps
  /// before used up the 0.2 s to close (a queued call that ran to the
  /// deadline, then its abort's post), so that rank 0 does not wait for
  /// this rank and warn that it had not left.
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  int local_rank() const;
  int local_size() const;
  const CommunicatorInfo& info() const;
  /// Re-chooses how waits idle (info().yields_when_idle, yields_at_once) as
  /// CommunicatorOptions::busy_threads_per_rank would have at creation; a
  /// program that moves its collectives onto its computing thread has one
  /// busy thread fewer (ddp::ProcessGroup does). Local to this rank, and
  /// inherited by later Splits. Waits for a collective in flight (from
  /// AllReduceThrough's slice function: applies at once to the rest of
  /// that call); do not call it while another thread reads info().
  void SetBusyThreadsPerRank(int busy_threads_per_rank);

  /// recv[i] = op over all ranks of send[i], for i in [0, count). send may
  /// equal recv (in place). kAvg divides by size() (integers truncate).
  Status AllReduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                   const CallOptions& call = {});
  /// In-place AllReduce.
  Status AllReduce(void* buffer, size_t count, DataType dtype, ReduceOp op,
                   const CallOptions& call = {});
  /// Called by AllReduceThrough with a piece of this rank's slice:
  /// `reduced` holds elements [offset, offset + count) of the reduction
  /// (kAvg divided), in memory of the call; `out` is recv + offset, still
  /// holding recv's values there from before the call. It writes the
  /// piece's result into `out` (a plain all-reduce would copy `reduced`).
  using SliceFn =
      std::function<Status(const void* reduced, void* out, size_t offset, size_t count)>;
  /// An all-reduce whose result passes through `apply` on the rank that
  /// owns each slice, before the ranks exchange it: the ranks
  /// reduce-scatter send, each calls apply on the pieces of its slice that
  /// ThroughPieces lists, in that order (once with count 0 for an empty
  /// slice), to write its slice of recv, and the ranks then all-gather the
  /// slices, so every rank's recv ends as the slices their owners wrote.
  /// The bytes moved are an AllReduce's. Made for an optimizer step fused
  /// into the gradient reduction: send the gradients, recv the parameters
  /// (laid out as the gradients are); each rank updates the parameters of
  /// its slice from the reduced gradients, and the others receive them
  /// instead of gradients. Host buffers; send may equal recv. An apply
  /// that fails (or throws) fails the call on every rank, and, as any
  /// failed collective, aborts the communicator. apply runs inside the
  /// call, holding the communicator: a collective, Send, Recv (or their
  /// async forms) or Split it makes on this communicator fails at once with
  /// FAILED_PRECONDITION naming the slice function (it would wait for the
  /// call it runs in), without aborting (its arguments are checked first:
  /// a bad one aborts, as anywhere), and so does Work::Wait or Test on
  /// an unfinished call of this communicator (queued by any thread, or a
  /// SendAsync/RecvAsync posted before: it cannot progress until apply
  /// returns, and goes on); SetBusyThreadsPerRank applies at once to the
  /// rest of the call. On one host it
  /// runs in the shared-memory engine, one cache-sized piece at a time:
  /// fold, apply and write into the others' recv while the piece is in
  /// cache; two rendezvous. Elsewhere as ReduceScatter and AllGather on
  /// copies padded to equal slices, with the whole slice as one piece.
  Status AllReduceThrough(const void* send, void* recv, size_t count, DataType dtype,
                          ReduceOp op, const SliceFn& apply, const CallOptions& call = {});
  /// The pieces [offset, offset + count) of this rank's slice that an
  /// AllReduceThrough of `count` elements of `dtype` (with call.algorithm
  /// kAuto) hands to its function, in order. The slices are equal blocks
  /// rounded up to whole 64-byte lines, so the last ranks' may be short or
  /// empty (one piece of count 0). The same in every call with these
  /// arguments. An unknown dtype: none.
  std::vector<std::pair<size_t, size_t>> ThroughPieces(size_t count, DataType dtype) const;
  /// Rank `rank`'s slice [first, second) of an AllReduceThrough of `count`
  /// elements of `dtype` among `size` ranks (its pieces cover it); {0, 0}
  /// when size < 1 or rank is outside [0, size).
  static std::pair<size_t, size_t> ThroughSlice(size_t count, DataType dtype, int size, int rank);
  /// Copies `count` elements of root's `buffer` into every rank's `buffer`.
  Status Broadcast(void* buffer, size_t count, DataType dtype, int root,
                   const CallOptions& call = {});
  /// recv[r * count + i] = rank r's send[i]; recv holds size() * count
  /// elements. send may equal recv + rank() * count (in place).
  Status AllGather(const void* send, void* recv, size_t count, DataType dtype,
                   const CallOptions& call = {});
  /// recv[i] = op over ranks r of r's send[rank() * count + i]; send holds
  /// size() * count elements, recv count.
  Status ReduceScatter(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                       const CallOptions& call = {});
  /// recv[q * count + i] = rank q's send[rank() * count + i]: send and recv
  /// hold size() * count elements each, block q of send goes to rank q.
  /// send and recv must not overlap. On one host each rank reads its blocks
  /// straight out of the others' send buffers (shared-memory path, CMA).
  /// Device buffers are copied whole to host memory and back (one staged
  /// copy each way, not pipelined).
  Status AllToAll(const void* send, void* recv, size_t count, DataType dtype,
                  const CallOptions& call = {});
  /// All-to-all with a size per pair: send_counts[q] elements go to rank q
  /// (the blocks lie in send one after another, in rank order) and
  /// recv_counts[q] come from rank q (likewise in recv); both spans have
  /// size() entries. send_counts[q] here must equal recv_counts[rank()] on
  /// rank q: a pair that disagrees fails on the receiving rank with
  /// INVALID_ARGUMENT naming the sizes. Device buffers as AllToAll.
  Status AllToAllV(const void* send, std::span<const size_t> send_counts, void* recv,
                   std::span<const size_t> recv_counts, DataType dtype,
                   const CallOptions& call = {});
  /// Rooted collectives (MPI_Reduce, MPI_Gather, MPI_Scatter, ncclReduce).
  /// Every rank calls them with the same count, dtype, root (and op): a
  /// root outside [0, size()) is INVALID_ARGUMENT on the rank that passed
  /// it; a buffer only the root uses that it refuses (null, misaligned,
  /// overlapping other than in place) aborts the communicator (see the error model at
  /// the top), so the other ranks fail too; ranks that disagree fail (INVALID_ARGUMENT naming both values, or
  /// the abort reason of the rank that found it) or time out at the call's
  /// deadline. Device buffers (those this rank uses) go through the pinned
  /// staging slots chunk by chunk, with the host collective on each chunk
  /// (the host reduces).
  /// On one host they go through the shared-memory engine (CMA).
  ///
  /// Root's recv[i] = op over ranks of send[i], i in [0, count); recv is
  /// ignored on the other ranks (it may be null there); on the root send
  /// may equal recv (in place). kAvg divides by size() (integers
  /// truncate). call.algorithm: kTree (binomial tree over UCX), kRing (ring
  /// reduce-scatter then gather to the root over UCX), kSharedMemory, or
  /// kAuto (shared memory on one host, else the tree up to 256 KiB and the
  /// ring above); others are INVALID_ARGUMENT.
  Status Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                int root, const CallOptions& call = {});
  /// Root's recv[r * count + i] = rank r's send[i]: recv holds size() *
  /// count elements on the root and is ignored elsewhere (it may be null).
  /// On the root send may equal recv + root * count (in place).
  Status Gather(const void* send, void* recv, size_t count, DataType dtype, int root,
                const CallOptions& call = {});
  /// Rank r's recv[i] = root's send[r * count + i]: send holds size() *
  /// count elements on the root and is ignored elsewhere (it may be null).
  /// On the root recv may equal send + root * count (in place).
  Status Scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
                 const CallOptions& call = {});
  /// Returns once every rank has entered the barrier.
  Status Barrier(const CallOptions& call = {});
  /// Sends `count` elements to `peer`, matched by its Recv with the same tag.
  /// Returns when the buffer may be reused. Not ordered with collectives.
  /// Posting (Send, Recv and their async forms) waits for a collective that
  /// another thread is running only until this call's deadline: then
  /// TIMED_OUT, nothing was posted, and the communicator stays usable.
  /// A device buffer handed to a CUDA-enabled UCX as it is (here and in
  /// the direct broadcast and all-gather) goes once the work queued on the
  /// legacy default stream is done, polled until the call's deadline; for
  /// these four calls a wait that fails posts nothing, as above.
  Status Send(const void* data, size_t count, DataType dtype, int peer, uint32_t tag,
              const CallOptions& call = {});
  /// Receives exactly `count` elements from `peer` (another count:
  /// INVALID_ARGUMENT).
  ///
  /// A posted Send/Recv keeps to its deadline even when a collective on
  /// another thread takes the communicator while it waits: about 250 ms
  /// after the deadline it returns TIMED_OUT naming peer, tag and size, and
  /// aborts the communicator. Its request is cancelled before it returns
  /// (by this thread, or by the collective's thread at its next health
  /// check, about every 100 ms inside a wait) and the message then says
  /// "the buffer is the caller's again". Only when that thread does not
  /// check in within another 250 ms (it is computing, not waiting) does the
  /// message say so instead: the cancel happens at its next check or when it
  /// ends, and until then the buffer may still be read (Send) or written
  /// (Recv), so it must stay valid until that call ends.
  Status Recv(void* data, size_t count, DataType dtype, int peer, uint32_t tag,
              const CallOptions& call = {});

  /// Asynchronous variants. Collectives run in issue order on the
  /// communicator's thread; SendAsync/RecvAsync post at once and complete as
  /// Work::Wait/Test drive them (they are never queued behind collectives).
  /// Dropping the last copy of an unfinished RecvAsync's Work cancels the
  /// receive before the destructor returns: it takes no later message and
  /// never writes into its buffer afterwards, so the buffer may be freed
  /// then. The cancel needs the UCX worker, so the drop waits for a
  /// collective that another thread is running (at most until that call's
  /// deadline). A dropped SendAsync keeps going until it completes or its
  /// deadline passes (its buffer must stay valid until then) and is
  /// released by a later SendAsync/RecvAsync.
  Work AllReduceAsync(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      const CallOptions& call = {});
  Work BroadcastAsync(void* buffer, size_t count, DataType dtype, int root,
                      const CallOptions& call = {});
  Work AllGatherAsync(const void* send, void* recv, size_t count, DataType dtype,
                      const CallOptions& call = {});
  Work ReduceScatterAsync(const void* send, void* recv, size_t count, DataType dtype,
                          ReduceOp op, const CallOptions& call = {});
  Work AllToAllAsync(const void* send, void* recv, size_t count, DataType dtype,
                     const CallOptions& call = {});
  /// The counts are copied: the spans need not outlive the call.
  Work AllToAllVAsync(const void* send, std::span<const size_t> send_counts, void* recv,
                      std::span<const size_t> recv_counts, DataType dtype,
                      const CallOptions& call = {});
  Work ReduceAsync(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                   int root, const CallOptions& call = {});
  Work GatherAsync(const void* send, void* recv, size_t count, DataType dtype, int root,
                   const CallOptions& call = {});
  Work ScatterAsync(const void* send, void* recv, size_t count, DataType dtype, int root,
                    const CallOptions& call = {});
  Work BarrierAsync(const CallOptions& call = {});
  Work SendAsync(const void* data, size_t count, DataType dtype, int peer, uint32_t tag,
                 const CallOptions& call = {});
  Work RecvAsync(void* data, size_t count, DataType dtype, int peer, uint32_t tag,
                 const CallOptions& call = {});

  /// Split's color of a rank that joins no new communicator.
  static constexpr int kNoColor = -1;
  /// Collective, in order with this communicator's other collectives: forms
  /// a new communicator of the ranks that pass the same `color` (>= 0),
  /// ranked by `key`, ties by rank here (MPI_Comm_split, ncclCommSplit). A
  /// rank passing kNoColor takes part and gets no communicator (nullptr).
  /// The new one has this one's settings (as its creation settled them:
  /// the DDP_* environment is not read again) and rendezvous store and its
  /// own connections. The whole split (the exchange of colors and keys, the
  /// registration below, and the new communicator's creation) keeps to one
  /// deadline, call.timeout (default: this communicator's timeout), counted
  /// as a blocking call's (see Threading above). When rank 0 of this communicator serves the
  /// store (host_store), the store stays up while any communicator split
  /// from it lives there, and the last to go waits (within its timeout) for
  /// every rank of every communicator that uses the store to leave, except
  /// for a communicator whose own leaving here found each of its ranks
  /// left or gone (see ~Communicator), and for the ranks of that host that
  /// exited without leaving a communicator split where the serving rank
  /// took part in the Split (of any color). A color below kNoColor on any
  /// rank: INVALID_ARGUMENT on every rank, naming that rank (the colors are
  /// exchanged first); no communicator is formed and this one stays usable. Where a process outside this
  /// communicator serves the store, rank 0 registers the new communicators
  /// there (so that it stays up for them) and tells every rank how that
  /// went: if it failed, no communicator is formed, of any color, every
  /// rank returns rank 0's reason naming its own color, and this one stays
  /// usable.
  StatusOr<std::unique_ptr<Communicator>> Split(int color, int key, const CallOptions& call = {});

  /// Aborts the communicator with `reason` (posted to the store); later calls
  /// fail with it. An OK `reason` aborts with ABORTED "no reason given".
  void Abort(const Status& reason);
  /// OK, or the reason the communicator was aborted.
  Status aborted_reason() const;
  /// Time this rank's collectives have spent waiting for other ranks (to
  /// arrive, or to finish with this rank's buffers), summed since creation:
  /// how long slower ranks kept it waiting (inside a collective; on a
  /// communication thread that may overlap this rank's own work). Counted
  /// in the shared-memory engine: all-reduce (also AllReduceThrough),
  /// broadcast, barrier, all-to-all, reduce, gather and scatter among the
  /// ranks of a host, and inside each host of a hierarchical all-reduce
  /// (whose wait for the host's slice owners includes their exchange with
  /// the other hosts). What goes over UCX is not counted, as waiting there
  /// cannot be told from moving data: all-gather, reduce-scatter and
  /// point-to-point messages, also on one host. Any thread.
  std::chrono::nanoseconds PeerWaitTime() const;

  /// The all-reduce algorithm this communicator uses for `bytes` bytes.
  Algorithm SelectedAlgorithm(size_t bytes) const;
  /// The algorithm a Reduce of `bytes` bytes runs when it asks for
  /// `requested` (CallOptions::algorithm): kSharedMemory, kTree or kRing.
  Algorithm SelectedReduceAlgorithm(size_t bytes, Algorithm requested = Algorithm::kAuto) const;

  class Impl;

 private:
  explicit Communicator(std::unique_ptr<Impl> impl);
  static Work FinishedWork(Status status);
  static Work NewWork(std::shared_ptr<Work::State> state);
  std::unique_ptr<Impl> impl_;
};

namespace internal {
/// The number a process claims its rank with (Create): drawn from
/// `entropy_source` (std::random_device's token), or, where that source is
/// missing, made of the pid, an address and the clocks instead of throwing.
uint64_t ClaimNonce(const std::string& entropy_source);
}  // namespace internal

}  // namespace ddp::transport

#endif  // DDP_TRANSPORT_COMMUNICATOR_H_
