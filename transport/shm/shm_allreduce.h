#ifndef DDP_TRANSPORT_SHM_SHM_ALLREDUCE_H_
#define DDP_TRANSPORT_SHM_SHM_ALLREDUCE_H_

// All-reduce among ranks of one host through shared memory and cross-memory
// attach (CMA, process_vm_readv), without UCX on the data path.
//
// Why: on a host, UCX's tag protocol adds a rendezvous handshake and a
// receive into a separate buffer before the reduction can read it.
//
// Small vectors (staging path): each rank copies its input into its staging
// buffer in the segment and announces it; once every rank has, each rank
// folds all staged inputs into its own output. One rendezvous per call:
// on a machine whose cores also run other work, every rendezvous waits for
// the peer to be scheduled, and that wait, not the arithmetic, is what small
// vectors cost. Staging buffers alternate between even and odd calls, so no
// rank ever waits for a slower one to finish reading.
//
// Large vectors (direct path): each rank owns a slice and reads the peers'
// pieces of it straight out of their buffers with cross-memory attach
// (process_vm_readv), one cache-sized chunk at a time, reducing each chunk
// while it is in cache and writing the result straight into every peer's
// output (process_vm_writev) while it is still in cache. One copy per byte
// each way, no handshake, each rank reduces only its share, and two
// rendezvous per call.
// docs/benchmarks.md has the measurements behind the thresholds.
//
// Protocol (per call, sequence number s, the same on every rank):
//   1. (staging) copy the input to staging buffer s % 2;
//      publish args[s % 2] (addresses, count, dtype, op); arrived = s
//   2. wait until every rank arrived; counts, dtypes and ops must agree,
//      and be valid (a dtype or op outside its enum, or a count whose bytes
//      overflow size_t, fails with INVALID_ARGUMENT on every rank)
//   3. staging: fold every staged input, in rank order; done.
//      direct: per chunk of own slice, fold every rank's input, write the
//      result into every rank's output; finished = s; wait until every rank
//      finished (until then they read this rank's input and write its
//      output).
//
// Broadcast: small buffers through the root's staging buffer (no wait
// after arriving), larger ones read from the root's buffer with CMA by
// every other rank at once; the root waits until all have read.
//
// A rank that returns with an error before every peer finished the call
// (its deadline passed while a peer was late, say) first marks the call
// abandoned and waits (up to 200 ms) for writes into its memory already
// under way; peers check the mark around every copy and fail the call with
// its error, so a straggler never writes into buffers the caller has taken
// back, nor returns data read from them after they were.
//
// Failures: a rank that fails after arriving (a CMA error, a failing slice
// function) records its error and sets its `failed` word to the call,
// publishes finished, and
// waits within the deadline for its live peers to finish before it
// returns, so nobody writes into its buffers after it returned; the peers
// see the mark once they have waited for it and fail the call as well,
// with that rank's error code and message (which name the cause).
//
// A rank that cannot begin a call (its wait for every rank to be done with
// the call before the last failed) takes the call's number all the same,
// marks it failed and abandoned and publishes its arrival with that
// failure alone; the peers fail the call at once with its error. Its later
// calls fail with FAILED_PRECONDITION naming that error: it could not keep
// its numbering in step with the peers'.
//
// Reduce, gather and scatter: the root waits for every rank to arrive and
// compares all arguments; the other ranks wait for the root alone and
// compare theirs with its own. Up to ShmOptions::rooted_staging_bytes they
// go through staging buffers (the root folds or copies out the others'
// inputs; a scatter's ranks copy their blocks out of the root's) and nobody
// waits after that, so a rank may run one call ahead of a slow root: each
// call first waits until every rank is done with the call before the last,
// whose staging buffer and arguments it reuses. Larger ones use CMA and end
// with every rank (reduce, gather) or the root (scatter) waiting for all to
// finish.
//
// AllReduceThrough is the direct path with a pause: each rank folds its
// whole slice, hands it to a caller's function (the hierarchical
// all-reduce passes it to the same slice's owners on the other hosts), and
// only then writes it into every rank's output. A rank that fails on the
// way (its fold, the function, a copy) tells the function's other parties
// through the caller's FailFn before it waits for its group: they are
// outside the group and would otherwise wait for it until their deadline.
//
// Every wait has a deadline and runs the watchdog about every 100 ms,
// telling it which rank the wait needs (it fails the wait when that rank is
// gone; the counter is read once more first, as a rank that published and
// then exited did its part). Where the caller passed no watchdog, a wait
// that sleeps looks at the awaited peer's pidfd as often instead, so a
// peer whose process exited fails it with PEER_LOST, not at the deadline.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "transport/shm/segment.h"
#include "transport/shm/shareable.h"
#include "transport/status.h"
#include "transport/store/store.h"
#include "transport/types.h"

namespace ddp::transport::shm {

/// Element range [begin, end) of `rank`'s slice of `count` elements of
/// `elem` bytes among `size` ranks, as the direct path and
/// AllReduceThrough cut the vector: equal blocks rounded up to whole
/// 64-byte cache lines (so that no two ranks write the same line); the last
/// ranks' slices may be short or empty.
struct SliceRange {
  size_t begin = 0;
  size_t end = 0;
};
SliceRange SliceOf(size_t count, size_t elem, int size, int rank);

namespace internal {
/// True when process `pid` (not necessarily a child) exits within `within`:
/// through a pidfd, or, where none can be had (old kernels, no descriptor
/// left), by looking at the process every millisecond.
bool ProcessExitsWithin(int pid, std::chrono::milliseconds within);
}  // namespace internal

/// staging_bytes, rooted_staging_bytes and chunk_bytes are rank 0's on
/// every rank: ShmAllReduce::Create adopts them from rank 0, since every
/// rank must take the same path (staged or direct) for a call and lay out
/// the segment alike.
struct ShmOptions {
  int rank = 0;             ///< Rank in the group (all ranks on this host).
  int size = 1;
  std::vector<int> pids;    ///< Per rank: its process id (for CMA).
  /// Per rank: the number messages call it by (its rank in the job when
  /// the group is part of one); empty: its rank in the group.
  std::vector<int> names;
  /// Vectors up to this many bytes use the staging path.
  size_t staging_bytes = 8 << 10;
  /// Reduce, gather and scatter: up to this many bytes (the root's whole
  /// buffer) use the staging path, at least staging_bytes, at most half a
  /// rank's staging area. Longer than for the all-reduce: only the root
  /// folds or copies, and nobody waits for it (measured on 2 and 4 ranks,
  /// docs/benchmarks.md: a 64 KiB reduce staged 8-19 us, direct 9-105 us).
  size_t rooted_staging_bytes = 64 << 10;
  /// Bytes per CMA read in the reduce-scatter (sized to stay in L2).
  size_t chunk_bytes = 256 << 10;
  /// Ranks outnumber cores: start yielding after 2 us of polling.
  bool yield_when_idle = false;
  /// Otherwise, poll this long before yielding.
  std::chrono::microseconds spin_time{250};
  /// How often a long wait runs the watchdog (or, without one, looks at
  /// the awaited peer's pidfd), and the longest it sleeps at once; positive
  /// (Create refuses 0 or less), and one longer than a century counts as a
  /// century (milliseconds::max(): never).
  std::chrono::milliseconds watchdog_period{100};
};

class ShmAllReduce {
 public:
  /// Collective over the group: maps the shared segment. Fails with
  /// UNAVAILABLE, on every rank alike, when a rank cannot create or map
  /// the segment or CMA is not permitted between the ranks (the caller then
  /// uses UCX alone). Options are checked first, on every rank: when one
  /// rank's are bad (its size, rank, pids, names, staging_bytes,
  /// chunk_bytes or watchdog_period), every
  /// rank fails with its INVALID_ARGUMENT, which names that rank and the
  /// option, once the ranks have posted their verdicts (not at the
  /// deadline); so does a disagreement on the group's size.
  /// The collectives below fail with FAILED_PRECONDITION in a child made
  /// by fork() after this: its mapping of the segment is the parent's.
  static StatusOr<std::unique_ptr<ShmAllReduce>> Create(store::Store& store,
                                                        const std::string& key_prefix,
                                                        const ShmOptions& options,
                                                        Deadline deadline);
  ~ShmAllReduce();

  /// recv[i] = op over ranks of send[i], i in [0, count). send may equal recv.
  /// Must be called by every rank of the group in the same order.
  /// `checked_op`, when given, is the op the ranks compare instead of `op`
  /// (the caller's own op when it rewrote it: an f16 average divided
  /// first and then summed must not agree with a plain sum). The same for
  /// the calls below that take it.
  Status AllReduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                   Deadline deadline, const std::function<Status(Deadline, int)>& watchdog,
                   std::optional<ReduceOp> checked_op = std::nullopt);

  /// Called with a rank's reduced slice, elements [offset, offset + count)
  /// of its output, which it may change in place before the group gets it.
  using SliceFn = std::function<Status(void* slice, size_t offset, size_t count)>;

  /// Called with this rank's error when it fails an AllReduceThrough after
  /// arriving (its fold, `across` or the copies), before it waits for its
  /// peers in the group: `across` may pair it with processes outside the
  /// group, which wait for it where this group cannot tell them anything.
  using FailFn = std::function<void(const Status& error)>;

  /// recv[i] = op over ranks of send[i] as AllReduce, except that each
  /// rank's slice passes through `across` between the reduction and the
  /// copies into the other ranks' outputs; `across` runs once per call on
  /// every rank, also for an empty slice. kAvg reduces as kSum and leaves
  /// the division to `across` (the divisor is the caller's); the ranks
  /// still check that they all passed the same op. Every rank of the group
  /// must call it where the others do; a rank calling AllReduce instead
  /// fails the argument check on every rank. `failed`, when given, tells
  /// `across`'s other parties of this rank's failure (see FailFn): a rank
  /// whose fold fails never calls `across`, and one that fails waits for
  /// its group's peers, which may themselves wait in `across` for a party
  /// that waits for this rank.
  Status AllReduceThrough(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                          const SliceFn& across, Deadline deadline,
                          const std::function<Status(Deadline, int)>& watchdog,
                          std::optional<ReduceOp> checked_op = std::nullopt,
                          const FailFn& failed = nullptr);

  /// Called with a piece of a rank's slice: `reduced` holds elements
  /// [offset, offset + count) of the reduction (kAvg divided), in scratch
  /// memory of the call; `out` is recv + offset, still holding recv's
  /// values from before the call. It writes the piece's result into `out`.
  using ApplyFn =
      std::function<Status(const void* reduced, void* out, size_t offset, size_t count)>;

  /// recv = the slices `apply` made, on every rank: each rank folds its
  /// slice of every rank's send one piece at a time (apply_piece_elems;
  /// the last may be shorter) into cache-sized scratch memory (not into
  /// recv), calls `apply` on the piece, and writes the piece's `out` into
  /// every peer's recv while it is still in cache. `apply` runs on the
  /// pieces in order, or once with count 0 for an empty slice. Two
  /// rendezvous, as AllReduce's direct path, at any size. send may equal
  /// recv. Every rank of the group calls it where the others do; a rank
  /// calling another collective fails the argument check on every rank.
  Status AllReduceApply(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                        const ApplyFn& apply, Deadline deadline,
                        const std::function<Status(Deadline, int)>& watchdog,
                        std::optional<ReduceOp> checked_op = std::nullopt);

  /// buffer = root's buffer, on every rank of the group (small buffers
  /// through the root's staging buffer, larger ones read from the root's
  /// memory with CMA). Every rank of the group calls it where the others
  /// do; differing counts, dtypes or roots fail on every rank. A root
  /// outside the group fails at once on the rank that passed it, which
  /// publishes nothing: a peer that passed a valid root waits for it until
  /// its deadline.
  Status Broadcast(void* buffer, size_t count, DataType dtype, int root, Deadline deadline,
                   const std::function<Status(Deadline, int)>& watchdog);

  /// recv[q * count + i] = rank q's send[rank * count + i]: up to the
  /// staging limit (size * count elements in all) through the staging
  /// buffers, larger ones with each rank reading its block of every peer's
  /// send buffer with CMA (one copy); send and recv hold size * count
  /// elements and must not overlap (unchecked). Every
  /// rank of the group calls it where the others do; differing counts or
  /// dtypes fail on every rank.
  Status AllToAll(const void* send, void* recv, size_t count, DataType dtype, Deadline deadline,
                  const std::function<Status(Deadline, int)>& watchdog);

  /// Root's recv[i] = op over ranks of send[i] (recv ignored elsewhere; on
  /// the root it may equal send). Small vectors through the staging
  /// buffers (the root folds them); larger ones as AllReduce's direct path,
  /// each rank folding its slice and writing it into the root's output
  /// only. Every rank of the group calls it where the others do. Differing
  /// counts, dtypes, ops or roots fail on the root and on every rank that
  /// differs from it; on the direct path on every rank, but staged a rank
  /// that agrees with the root compares with it alone and may return OK.
  /// A root outside the group fails at once on the rank that passed it,
  /// which publishes nothing (its peers wait for it until their deadline).
  Status Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                int root, Deadline deadline,
                const std::function<Status(Deadline, int)>& watchdog,
                std::optional<ReduceOp> checked_op = std::nullopt);

  /// Root's recv[q * count + i] = rank q's send[i] (recv ignored elsewhere;
  /// on the root send may be recv + root * count). Small blocks through the
  /// staging buffers, larger ones written by each rank into the root's
  /// output with CMA. Disagreements fail as for Reduce.
  Status Gather(const void* send, void* recv, size_t count, DataType dtype, int root,
                Deadline deadline, const std::function<Status(Deadline, int)>& watchdog);

  /// Rank q's recv[i] = root's send[q * count + i] (send ignored elsewhere;
  /// on the root recv may be send + root * count). Small buffers through
  /// the root's staging buffer, larger ones read by each rank from the
  /// root's input with CMA. Disagreements fail as for Reduce, except that
  /// the other ranks compare with the root alone on either path.
  Status Scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
                 Deadline deadline, const std::function<Status(Deadline, int)>& watchdog);

  /// Returns once every rank has called Barrier.
  Status Barrier(Deadline deadline, const std::function<Status(Deadline, int)>& watchdog);

  const ShmOptions& options() const { return options_; }
  /// Elements of `dtype` per AllReduceApply piece (the chunk size). A
  /// value that is no DataType (size 0, whose calls fail the argument
  /// check) counts as one byte: the size divided by zero.
  size_t apply_piece_elems(DataType dtype) const {
    return std::max<size_t>(1, chunk_.size() / std::max<size_t>(1, DataTypeSize(dtype)));
  }
  // The staging limit of reduce, gather and scatter (see ShmOptions).
  size_t rooted_staging_bytes() const {
    return std::min(std::max(options_.rooted_staging_bytes, options_.staging_bytes),
                    staging_capacity_ / 2);
  }
  /// The staging limit from the next call on (at most half a rank's
  /// staging area). Every rank must set the same between the same calls:
  /// a call that the limits send down different paths on different ranks
  /// fails with INVALID_ARGUMENT on every rank.
  void set_staging_bytes(size_t bytes);
  void set_yield_when_idle(bool yield) { options_.yield_when_idle = yield; }
  size_t max_staging_bytes() const { return staging_capacity_; }
  /// Copies with a peer's buffer that went through a mapping of its
  /// shareable memory instead of cross-memory attach, since creation.
  uint64_t mapped_copies() const { return mapped_copies_; }
  /// Peers' shareable regions this rank has mapped (see MapPeerBuffer).
  struct MappingStats {
    uint64_t regions = 0;  ///< mapped now, all peers together
    uint64_t bytes = 0;    ///< their size now
    uint64_t maps = 0;     ///< regions mapped since creation (each an mmap)
  };
  MappingStats mapping_stats() const;
  /// Time this rank's calls spent waiting for other ranks (to arrive, to
  /// finish, to free a staging slot), summed since creation. Any thread.
  std::chrono::nanoseconds peer_wait() const {
    return std::chrono::nanoseconds(peer_wait_ns_.load(std::memory_order_relaxed));
  }

  struct Control;
  struct Shared;
  /// What a call is, in Control::Args (so that ranks in different calls
  /// report the mismatch).
  enum class Kind : int32_t {
    kAllReduce = 0, kThrough = 1, kBroadcast = 2, kBarrier = 3, kAllToAll = 4, kReduce = 5,
    kGather = 6, kScatter = 7, kApply = 8
  };

 private:
  ShmAllReduce(std::unique_ptr<Segment> segment, const ShmOptions& options,
               size_t staging_capacity);

  Shared& shared() const;
  // "rank N" for group rank `rank`, N as options_.names says.
  std::string RankName(int rank) const;
  Control& control(int rank) const;
  // Stores this rank's counter and wakes sleeping waiters.
  void Publish(std::atomic<uint64_t> Control::*field, uint64_t value);
  char* staging(int rank, uint64_t call) const;
  // Waits until `field` of every rank (or of `only`, if >= 0) reaches `value`.
  Status WaitFor(std::atomic<uint64_t> Control::*field, uint64_t value, int only,
                 Deadline deadline, const std::function<Status(Deadline, int)>& watchdog,
                 const char* phase);
  // Publishes this call's arguments, waits for every rank (or `wait_for`
  // alone) to arrive and checks that they agree; returns the call's
  // sequence number.
  // `op` is the ReduceOp of an all-reduce, the root of a broadcast.
  // INVALID_ARGUMENT naming `root` when it is not a rank of the group.
  Status CheckRoot(const char* what, int root) const;
  // `root`: of a reduce, gather or scatter, else -1. `direct`: the call
  // copies with peers' buffers (not staged), so publish the shareable
  // regions holding send and recv.
  StatusOr<uint64_t> Arrive(const void* send, void* recv, size_t count, DataType dtype, int32_t op,
                            Kind kind, int32_t root, bool direct, Deadline deadline,
                            const std::function<Status(Deadline, int)>& watchdog,
                            int wait_for = -1);
  // With `only` >= 0, against that rank alone.
  Status CheckAgreement(uint64_t call, size_t count, DataType dtype, int32_t op, Kind kind,
                        int32_t root, int only = -1) const;
  Status CopyWithPeer(bool write, int peer, void* local, uint64_t remote, size_t bytes) const;
  // Whether `peer` gave up on the current call (returned before every rank
  // finished it): its buffers may have been reused since.
  bool Abandoned(int peer) const;
  // process_vm_readv/writev of all `bytes`: 0, or the errno that stopped it.
  int CopyBytes(bool write, int peer, void* local, uint64_t remote, size_t bytes) const;
  // The error for a failed CopyBytes of [local, local + bytes) with a peer
  // that has not left the call; an EFAULT waits (up to 500 ms, not past the
  // call's deadline) for the peer's exit: PEER_LOST if it exits, else
  // INVALID_ARGUMENT after the whole 500 ms, TIMED_OUT after a wait the
  // deadline cut short.
  Status CopyError(bool write, int peer, int error, void* local, size_t bytes) const;
  // [remote, remote + bytes) of `peer`'s memory, mapped here, when it lies
  // in shareable memory the peer published for the current call and the
  // mapping succeeds (cached per region; never made once the peer's pidfd
  // shows it exited, as its pid may be another process's); else null
  // (use CMA).
  char* MapPeerBuffer(int peer, uint64_t remote, size_t bytes) const;
  // Unmaps the mapped regions of each peer (of `only`, if >= 0) that their
  // owner freed, if it freed any since the last look (Args::freed of
  // `call`, which every peer, or `only`, has arrived at).
  void ForgetFreedRegions(uint64_t call, int only) const;
  Status ReadFromPeer(int peer, void* local, uint64_t remote, size_t bytes) const {
    return CopyWithPeer(false, peer, local, remote, bytes);
  }
  Status WriteToPeer(int peer, const void* local, uint64_t remote, size_t bytes) const {
    return CopyWithPeer(true, peer, const_cast<void*>(local), remote, bytes);
  }
  // recv null (a reduce's other ranks): folds nothing, only finishes. With
  // `own` (a reduce's root), folds that as this rank's input, not its
  // staging buffer, and the others after it (AllReduce folds in rank
  // order, so that every rank ends with the same bits).
  Status StagedAllReduce(void* recv, size_t count, DataType dtype, ReduceOp op,
                         const void* own = nullptr);
  // Folds this rank's slice [begin, end) of every rank's input into `recv`;
  // with `share`, writes each reduced chunk into every peer's output while
  // it is in cache. With `to_root` >= 0 (a reduce) on another rank than
  // that one, folds each chunk into a scratch chunk and writes it into the
  // root's output instead (recv is unused).
  // With `into` (AllReduceApply), folds element a of the slice into
  // into[a - begin] instead of recv[a], and shares nothing.
  Status ReduceSlice(const void* send, void* recv, size_t begin, size_t end, DataType dtype,
                     ReduceOp op, bool share, int to_root = -1, char* into = nullptr);
  // Writes elements [begin, end) of `recv` into every peer's output.
  Status ShareSlice(const void* recv, size_t begin, size_t end, size_t elem);
  // Publishes reduced and finished, then waits until every rank finished;
  // fails when a peer failed the call.
  Status Finish(Deadline deadline, const std::function<Status(Deadline, int)>& watchdog);
  // The error of a peer that marked `call` failed (its code, its message
  // prefixed with its rank), else OK; with `only` >= 0, of that peer, which
  // is known to have left the call.
  Status PeerFailure(uint64_t call, int only = -1) const;
  // Waits until every rank is done with the call before the last (whose
  // staging buffer and arguments the next call reuses).
  Status ClaimSlot(Deadline deadline, const std::function<Status(Deadline, int)>& watchdog);
  // Fails the call that could not claim its slot (ClaimSlot's `error`) so
  // that its peers fail it at once, and this engine's later calls too.
  Status FailUnclaimed(Status error);
  // The error of a peer (of `only`, if >= 0) whose arrival at `call` was
  // its failure alone (FailUnclaimed: its arguments are an earlier call's),
  // else OK. Checked after the wait for arrivals, before the arguments.
  Status UnclaimedFailure(uint64_t call, int only) const;
  // Runs a call's body after ClaimSlot; when it fails after the call began,
  // abandons the call.
  template <typename Body>
  Status InCall(Deadline deadline, const std::function<Status(Deadline, int)>& watchdog,
                Body body);
  // Records `error` as this rank's failure of the current call, marks the
  // call abandoned so that no peer copies with this rank's buffers any
  // more, and waits (briefly) for writes already begun; returns `error`.
  Status Abandon(Status error);
  // Records `error` as this rank's failure of `call` and publishes finished.
  void MarkFailed(uint64_t call, const Status& error);
  // Marks the current call failed, calls `failed` (when given) with the
  // error, waits (within the deadline) for the peers still alive to finish
  // it, and returns `error`.
  Status FailAfterArrival(Status error, Deadline deadline,
                          const std::function<Status(Deadline, int)>& watchdog,
                          const FailFn& failed = nullptr);

  // Whether `peer`'s process exits within `within`: through the pidfd
  // taken when the engine was made (immune to the reuse of its pid since),
  // else by its pid (internal::ProcessExitsWithin).
  bool PeerExitsWithin(int peer, std::chrono::milliseconds within) const;
  // PEER_LOST: `peer`'s process exited.
  Status PeerExited(int peer) const;

  std::unique_ptr<Segment> segment_;
  ShmOptions options_;
  size_t staging_capacity_;
  // Per rank: a pidfd of its process, opened when the engine was made; -1
  // for this rank, a rank of this same process, or where none could be
  // had (kernels before 5.3, no descriptor left).
  std::vector<int> peer_pidfds_;
  // Per peer: the call (sequence_) in which its pidfd last showed it alive
  // around a write by pid (see CopyWithPeer).
  mutable std::vector<uint64_t> pid_checked_in_call_;
  uint64_t sequence_ = 0;
  // Set once a call failed before it began (FailUnclaimed): later calls
  // fail with FAILED_PRECONDITION naming it.
  Status unusable_;
  // This process's pid and fork count (ForksSeen in the .cc) when the
  // engine was made: a forked child, whose count differs, may not call.
  int owner_pid_ = 0;
  uint64_t forks_at_creation_ = 0;
  Clock::time_point next_watchdog_{};  // when a wait next runs the watchdog
  // The running call's deadline (Create's during set-up): CopyError's wait
  // for a peer's exit ends by then.
  Deadline call_deadline_ = Deadline::max();
  std::vector<char> chunk_;  // CMA landing buffer, reused across calls
  std::vector<char> folded_;  // a reduce's folded chunk on its way to the root
  std::vector<char> applied_;  // AllReduceApply's reduced slice
  struct PeerMapping {
    uint64_t id = 0;        // the peer's ShareableRegion::id
    char* local = nullptr;  // null: mapping failed, use CMA
    uint64_t size = 0;
    int32_t fd = -1;        // the memfd's number in the peer
    uint64_t device = 0;    // and its identity, to tell when the peer closed
    uint64_t inode = 0;     // it (inode 0: not opened)
    uint64_t last_call = 0;  // the last call that copied through it
  };
  struct PeerMappings {
    std::vector<PeerMapping> lru;  // least recently used first
    uint64_t bytes = 0;            // sum of the sizes of lru's mapped regions
    uint64_t freed_seen = 0;       // the peer's Args::freed when last checked
  };
  // Caches of the const copy functions; peer_mappings_ per rank.
  mutable std::vector<PeerMappings> peer_mappings_;
  mutable uint64_t maps_made_ = 0;
  mutable uint64_t mapped_copies_ = 0;
  std::atomic<uint64_t> peer_wait_ns_{0};
};

}  // namespace ddp::transport::shm

#endif  // DDP_TRANSPORT_SHM_SHM_ALLREDUCE_H_
