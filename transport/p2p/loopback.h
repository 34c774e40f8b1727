#ifndef DDP_TRANSPORT_P2P_LOOPBACK_H_
#define DDP_TRANSPORT_P2P_LOOPBACK_H_

// An in-process implementation of PointToPoint: N ranks are N endpoints of
// one LoopbackHub, usually driven by N threads. It makes algorithm tests fast
// and deterministic, and serves a world of size 1 in production.
//
// Semantics, chosen to be at least as strict as UCX so that an algorithm that
// passes here is not relying on luck:
//   - Messages match a receive by (source, tag); among several candidates
//     the oldest wins (FIFO per source and tag). A send with no receive yet is
//     queued as unexpected.
//   - Rendezvous: a send completes only when its bytes have been copied into
//     the matching receive buffer (one memcpy, no intermediate copy). An
//     algorithm that reuses a send buffer before the send completes, or waits
//     on a send before posting the receive it depends on, fails here.
//   - A message whose size differs from the receive's completes the receive
//     with INVALID_ARGUMENT (nothing copied); the send completes normally, as
//     with UCX, where the sender does not learn of the mismatch.
//   - A notice (PostNotice) is a send whose bytes the hub copies and owns:
//     it has no handle, so the sender's Cancel, CancelAll and Disconnect
//     leave it queued for a receive the peer posts later. Kill of either
//     rank or Disconnect of the receiver drops it, and a notice to a rank
//     whose endpoint has gone (and has not connected again) is dropped as
//     it is posted, so that a later endpoint of that rank never takes a
//     note meant for the old one; beyond kMaxNoticesPerPeer
//     undelivered ones from one rank to another, the oldest is dropped.
//   - Unlike notices, plain sends queued to a rank stay queued across its
//     Disconnect and go to its next endpoint: the thread harness reuses a
//     hub for consecutive runs whose ranks connect at different times, and
//     a rank's first sends of a run may reach a peer still ending the last.
//   - WaitAll refuses a request listed twice (INVALID_ARGUMENT), as UCX does.
//   - Less strict than UCX in one way: a send cancelled or released before
//     it was matched (Cancel, CancelAll, a failed wait) is dropped here,
//     while UCX, which completes small sends as they are posted, still
//     delivers it to the peer's next receive on that tag. A call that
//     reuses a tag after an earlier one failed can take the old message on
//     UCX and not here (delivering them here fails the ring all-reduce's
//     NoteLeftByAnEarlierCallAtTheSameTagIsIgnored test that way).
//   - Kill(rank) simulates a process death: peers' operations with that rank
//     fail with PEER_LOST, the rank's own with ABORTED.
//
// Threading: the hub is thread-safe; each endpoint is used by one thread at a
// time (as the PointToPoint contract says). The hub must outlive its
// endpoints.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::p2p {

/// Traffic counters of one rank, for tests that check how much data an
/// algorithm moves through each rank.
struct LoopbackStats {
  uint64_t messages_sent = 0;
  uint64_t bytes_sent = 0;
  uint64_t messages_received = 0;
  uint64_t bytes_received = 0;
  /// The most sends to this rank queued at once before it posted their
  /// receive (what a real transport would buffer as unexpected messages).
  uint64_t peak_unexpected_sends = 0;
};

class LoopbackHub {
 public:
  /// The most ranks a hub takes: it keeps a byte counter per pair of ranks
  /// (size² of them, 128 MiB here), and its ranks are usually threads.
  static constexpr int kMaxSize = 1 << 12;

  /// A group of `size` ranks, 1 to kMaxSize; another size aborts the
  /// process naming it (a larger one failed with std::bad_alloc).
  explicit LoopbackHub(int size);
  ~LoopbackHub();

  LoopbackHub(const LoopbackHub&) = delete;
  LoopbackHub& operator=(const LoopbackHub&) = delete;

  int size() const { return size_; }

  /// The endpoint of `rank`; at most one per rank. INVALID_ARGUMENT for a
  /// rank outside [0, size), FAILED_PRECONDITION if already connected.
  StatusOr<std::unique_ptr<PointToPoint>> Connect(int rank);

  /// Simulates the death of `rank`: its queued messages are dropped, peers'
  /// pending and later operations with it fail with PEER_LOST, and its own
  /// pending and later operations fail with ABORTED. Wakes every waiter.
  /// Idempotent. These test hooks abort the process, naming the hook and
  /// the rank, for a rank outside [0, size).
  void Kill(int rank);

  /// Whether Kill(rank) was called.
  bool IsKilled(int rank) const;

  /// Counters of `rank` so far (messages completed successfully).
  LoopbackStats Stats(int rank) const;

  /// Bytes delivered from rank `from` to rank `to` so far.
  uint64_t BytesBetween(int from, int to) const;
  /// Bytes delivered so far between ranks of different groups, rank r being
  /// in group group_of_rank[r] (hosts, say): what would cross a network.
  /// Aborts, naming both sizes, unless group_of_rank has one entry per rank.
  uint64_t BytesBetweenGroups(const std::vector<int>& group_of_rank) const;

 private:
  friend class LoopbackEndpoint;

  enum class OpState { kQueued, kCopying, kDone };

  // One posted send or receive, owned by the rank that posted it until its
  // handle is released (Test/Wait returning it, or Cancel); a notice is
  // owned by the receiving rank's `notices` until delivered or dropped.
  struct Op {
    RequestId id = 0;
    int owner = 0;
    int peer = 0;
    Tag tag = 0;
    bool is_send = false;
    const void* send_data = nullptr;
    void* recv_data = nullptr;
    size_t bytes = 0;
    OpState state = OpState::kQueued;
    Status status;
    bool watched = false;                     // a receive marked by MarkWatched
    bool is_notice = false;                   // id 0, in the receiver's `notices`
    std::vector<unsigned char> notice_bytes;  // a notice's copy; send_data points here
  };

  struct RankState {
    std::condition_variable cv;           // signalled when an op of this rank changes state
    std::deque<Op*> posted_recvs;         // receives of this rank not yet matched
    std::deque<Op*> unexpected_sends;     // sends to this rank not yet matched
    std::unordered_map<RequestId, std::unique_ptr<Op>> ops;  // owned, not yet released
    std::list<std::unique_ptr<Op>> notices;  // notices to this rank, queued or copying
    bool connected = false;
    // Disconnected and not connected again: notices to it are dropped at
    // once. Not before the first Connect, whose endpoint takes them.
    bool closed = false;
    bool killed = false;
    LoopbackStats stats;
  };

  // Endpoint operations; `rank` is the caller.
  StatusOr<RequestId> Post(int rank, bool is_send, int peer, Tag tag, const void* send_data,
                           void* recv_data, size_t bytes);
  StatusOr<bool> Test(int rank, RequestId request);
  Status WaitAll(int rank, const RequestId* requests, size_t n, Deadline deadline);
  StatusOr<size_t> WaitAny(int rank, const RequestId* requests, size_t n, Deadline deadline);
  Status PostNotice(int rank, int peer, Tag tag, const void* data, size_t bytes);
  void MarkWatched(int rank, RequestId request);
  void Cancel(int rank, RequestId request);
  void CancelAll(int rank, const RequestId* requests, size_t n);
  void Disconnect(int rank);

  // Copies `send` into `recv` (outside the lock) and completes both.
  void Complete(std::unique_lock<std::mutex>& lock, Op* send, Op* recv);
  // Marks `op` done with `status` and wakes its owner. Lock held.
  void FinishLocked(Op* op, Status status);
  // Removes `op` from the match queues, waiting out a copy in progress, and
  // releases it. Lock held.
  void ReleaseLocked(std::unique_lock<std::mutex>& lock, int rank, RequestId request);
  Op* FindLocked(int rank, RequestId request);
  // Whether `op`, done, failed only because its peer was lost, is a
  // watched receive, and the wait on `requests` has an unwatched one still
  // pending, or with `any` (WaitAny) at all: then the wait goes on without
  // it (PointToPoint::MarkWatched). Lock held.
  bool SkipLostWatched(int rank, const Op* op, const RequestId* requests, size_t n, bool any);
  // Takes a queued notice out of `to`'s unexpected sends and frees it (`to`
  // is its receiver). Lock held.
  void DropNoticeLocked(RankState& to, Op* notice);
  // Frees a notice that Complete has delivered to `to`. Lock held.
  void FreeNoticeLocked(RankState& to, Op* notice);

  const int size_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<RankState>> ranks_;
  std::vector<uint64_t> pair_bytes_;  // [from * size_ + to]
  RequestId next_id_ = 1;
};

}  // namespace ddp::transport::p2p

#endif  // DDP_TRANSPORT_P2P_LOOPBACK_H_
