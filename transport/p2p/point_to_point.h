#ifndef DDP_TRANSPORT_P2P_POINT_TO_POINT_H_
#define DDP_TRANSPORT_P2P_POINT_TO_POINT_H_

// The point-to-point interface that every collective algorithm is written
// against. Two implementations: UCX between processes (transport/ucx) and an
// in-process loopback between threads (transport/p2p/loopback.h) that makes
// algorithm tests fast and deterministic.
//
// Threading: one PointToPoint object is driven by one thread at a time.

#include <cstddef>
#include <cstdint>
#include <span>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::p2p {

/// Message tag. Algorithms own the low kTagBits bits; implementations may
/// use the bits above for the source rank or a communicator id, so a tag
/// must fit in kTagBits. A message matches a receive when peer and tag match.
using Tag = uint64_t;
inline constexpr int kTagBits = 40;
inline constexpr Tag kMaxTag = (Tag{1} << kTagBits) - 1;

/// Handle of an outstanding send or receive, issued by the implementation.
/// 0 is never a valid handle (it marks "no request").
using RequestId = uint64_t;

/// Undelivered notices (PostNotice) a transport keeps for one peer.
inline constexpr int kMaxNoticesPerPeer = 4;
/// The largest notice, in bytes.
inline constexpr size_t kMaxNoticeBytes = 256;

class PointToPoint {
 public:
  virtual ~PointToPoint() = default;

  /// This process's rank in [0, size()).
  virtual int rank() const = 0;
  /// Number of ranks.
  virtual int size() const = 0;

  /// Starts sending `bytes` bytes at `data` to `peer`. The buffer must stay
  /// valid and unchanged until the request completes. Sends to self are
  /// allowed and match a receive from self.
  virtual StatusOr<RequestId> PostSend(int peer, Tag tag, const void* data,
                                       size_t bytes) = 0;

  /// Starts receiving exactly `bytes` bytes from `peer` into `data`. A message
  /// of another size completes the request with INVALID_ARGUMENT.
  virtual StatusOr<RequestId> PostRecv(int peer, Tag tag, void* data,
                                       size_t bytes) = 0;

  /// Drives progress once; true when `request` has completed (successfully:
  /// a failed request returns its error). A completed request's handle is
  /// released and must not be used again.
  virtual StatusOr<bool> Test(RequestId request) = 0;

  /// Posts a notice: a small message of `bytes` bytes at `data` to `peer`,
  /// fire and forget. The transport copies the bytes before returning and
  /// gives no handle: the notice outlives the caller's later Cancel and
  /// CancelAll, so it reaches a receive the peer posts after this rank has
  /// returned from a failed call (a plain send would be cancelled with it).
  /// It matches a receive like a send of the same peer and tag. It is
  /// dropped, unread, when either rank is lost or closes. Each transport
  /// keeps at most kMaxNoticesPerPeer undelivered notices to one peer (see
  /// the implementation for what happens to one more). Errors name the
  /// peer; a caller that only tries to help the peer may ignore them.
  virtual Status PostNotice(int peer, Tag tag, const void* data, size_t bytes) = 0;

  /// Waits until every request in `requests` completes, or the deadline
  /// passes (TIMED_OUT naming the peer still pending), or a request fails
  /// (its error; PEER_LOST names the peer). On return all handles are
  /// released, also on error (outstanding ones are cancelled).
  virtual Status WaitAll(std::span<const RequestId> requests,
                         Deadline deadline) = 0;

  /// Waits until at least one of `requests` completes and returns its index;
  /// that handle is released, the others stay valid. Errors as WaitAll,
  /// except that on error the other handles stay valid (the caller cancels).
  virtual StatusOr<size_t> WaitAny(std::span<const RequestId> requests,
                                   Deadline deadline) = 0;

  /// Marks `request`, a posted receive, as watched: a message that may come
  /// (another rank's stop note), not one the caller needs. While a wait
  /// still has some other request pending, the loss of a watched receive's
  /// peer fails nothing, and the implementation's liveness checks do not
  /// count that peer as waited for: a peer that finished its part and left
  /// cleanly never sends such a message, and that is no error. A wait left
  /// with watched receives only treats them as any other. Ignored for a
  /// send and for unknown or released ids.
  virtual void MarkWatched(RequestId request) = 0;

  /// Cancels and releases an outstanding request (no-op if already done).
  /// Returns once nothing uses the request's buffer any more, as far as the
  /// implementation can promise that: the loopback always can; UCX cannot
  /// for a send or a matched receive to a peer on the same host that does
  /// not finish within its grace, which may still read or write the buffer
  /// later, until it completes or that peer's process exits (the peer is
  /// marked lost; see transport/ucx/ucx_p2p.h).
  virtual void Cancel(RequestId request) = 0;

  /// Cancel for each of `requests` (unknown or released ids are skipped),
  /// but all at once: an implementation that has to wait for a request to
  /// let go of its buffer waits for all of them together, so the time this
  /// takes does not grow with the number of requests or peers. Error paths
  /// that give up several requests use this rather than a loop of Cancel.
  virtual void CancelAll(std::span<const RequestId> requests) = 0;

  /// How many requests given up so far (by Cancel, CancelAll or a failed
  /// wait) this implementation could not confirm it let go of: their buffers
  /// may still be read or written later (see Cancel). Only ever grows; a
  /// caller compares it before and after to learn whether buffers it gave
  /// in are safe to free. Always 0 for implementations whose Cancel can
  /// promise it (the loopback).
  virtual uint64_t UnconfirmedReleases() const { return 0; }
};

}  // namespace ddp::transport::p2p

#endif  // DDP_TRANSPORT_P2P_POINT_TO_POINT_H_
