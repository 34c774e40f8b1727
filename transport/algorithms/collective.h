#ifndef DDP_TRANSPORT_ALGORITHMS_COLLECTIVE_H_
#define DDP_TRANSPORT_ALGORITHMS_COLLECTIVE_H_

// The one argument struct every collective algorithm takes, and the tag
// layout they share. Each algorithm is a free function
//
//   Status RingAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args);
//
// that must be called on every rank of `p2p` with the same count, dtype, op,
// root, tag and tuning (buffers and deadlines are per rank). It returns when
// this rank's part is done: the receive buffer holds the result and every
// send has completed, so both buffers may be reused. On error, every
// request still outstanding has been cancelled before the return (the
// receive buffer's contents are then unspecified), and, as far as the
// PointToPoint can promise it, nothing reads or writes the caller's buffers
// afterwards: the loopback and UCX to peers on other hosts promise it; UCX
// to a peer on the same host does not for a send or an already matched
// receive that did not finish within the recall grace (UCX 1.13 cannot
// close such an endpoint by force), which may still complete, reading
// `send` or writing `recv`, until it does or that peer's process exits
// (transport/ucx/ucx_p2p.h). That peer is marked lost and the communicator
// aborts, but a caller that keeps running after a failed collective must
// not free or reuse its buffers until then. The algorithms keep the same
// rule for their own scratch memory: after a call during which the
// PointToPoint's UnconfirmedReleases grew, its Scratch blocks (pipeline.h)
// are quarantined for the rest of the process, never freed or handed to a
// later call; other failed calls free them as a successful call does.
//
// Tags: one collective may use the tags [tag, tag + kTagsPerCollective). The
// communicator passes CollectiveTag(sequence_number) so that consecutive
// collectives never match each other's messages. Inside, the range is split
// into kMaxPhases phases of 2^kStepTagBits tags; composite algorithms give
// each part a phase.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "transport/p2p/point_to_point.h"
#include "transport/types.h"

namespace ddp::transport::algorithms {

inline constexpr int kStepTagBits = 20;
inline constexpr int kPhaseTagBits = 4;
inline constexpr int kCollectiveTagBits = kStepTagBits + kPhaseTagBits;
/// Tags one collective may use, starting at CollectiveArgs::tag.
inline constexpr p2p::Tag kTagsPerCollective = p2p::Tag{1} << kCollectiveTagBits;
/// Phases a collective can split its tag range into.
inline constexpr int kMaxPhases = 1 << kPhaseTagBits;

/// The base tag of the collective with sequence number `sequence` (any
/// value; it wraps after 2^16 - 1 collectives, far more than can be in
/// flight). The top range of tags is left out: a collective run inside
/// another at one of its phases (the hierarchical all-reduce's step between
/// hosts, at phase 1) checks for a whole range above its own tag, which
/// the top range's phases would not have.
inline p2p::Tag CollectiveTag(uint64_t sequence) {
  constexpr int kSequenceBits = p2p::kTagBits - kCollectiveTagBits;
  constexpr uint64_t kRanges = (uint64_t{1} << kSequenceBits) - 1;
  return (sequence % kRanges) << kCollectiveTagBits;
}

/// The base tag of phase `phase` (< kMaxPhases) of the collective at `tag`.
inline p2p::Tag PhaseTag(p2p::Tag tag, int phase) {
  return tag + (static_cast<p2p::Tag>(phase) << kStepTagBits);
}

/// The most ranks a collective accepts. The algorithms compute ranks as
/// int, and the largest value they form is below twice the world size (a
/// heap tree's child 2v + 2, a rotation r + p - 1, the power of two above
/// p): a world of 2^30 or more would overflow, so every collective refuses
/// it up front. UCX's own limit (tag bits for the source rank) is far lower.
inline constexpr int kMaxWorldSize = (1 << 30) - 1;

/// The largest Tuning::pipeline_depth accepted.
inline constexpr int kMaxPipelineDepth = 64;

/// How an algorithm runs, not what it computes. Zero means the algorithm's
/// default. Must be equal on every rank.
struct Tuning {
  /// Bytes per pipelined message. Tests set it to a few bytes so that small
  /// inputs go through the multi-chunk paths.
  size_t chunk_bytes = 0;
  /// Receives posted ahead of the one being processed, 1 to
  /// kMaxPipelineDepth; scratch memory grows with it.
  int pipeline_depth = 0;
  /// Halving-doubling all-reduce: messages of at most this many bytes use
  /// recursive doubling (log2 p exchanges of the whole vector) instead of
  /// halving then doubling (2 log2 p exchanges of shrinking halves). 0: the
  /// default (8 KiB); 1 forces halving-doubling for tests. Ranks that
  /// take different modes for a call fail it (INVALID_ARGUMENT).
  size_t rhd_doubling_bytes = 0;
  /// The op the ranks' argument check compares, when it is not `op`: the
  /// hierarchical all-reduce's step between hosts sums for avg (it divides
  /// by the whole world afterwards), and must still tell avg from sum.
  std::optional<ReduceOp> checked_op;
  /// The root the ranks' argument check compares and names, when it is not
  /// `root`: the communicator runs the rooted reduce on its ring's order,
  /// where `root` is the root's place, and errors should name its rank.
  std::optional<int> checked_root;
  /// The count of the whole call that this one is a step of, compared
  /// between ranks besides `count`: the hierarchical all-reduce's step
  /// between hosts reduces one shard, whose size can agree between hosts
  /// that passed different counts (the ranks holding it would pass the
  /// check and then wait on their host's ranks that failed).
  std::optional<size_t> checked_whole_count;
  /// All-gather and reduce-scatter on a ring's order (a GroupView): the
  /// block of p2p rank b is the job's rank (*block_owner)[b]'s, in the
  /// buffers' layout. nullptr: b's own. Equal-sized blocks only.
  const std::vector<int>* block_owner = nullptr;
};

/// Arguments of one collective. `count` is in elements of `dtype`; its
/// meaning per collective (per rank or in total) is in each header.
struct CollectiveArgs {
  const void* send = nullptr;  ///< Input; may equal `recv` (in-place).
  void* recv = nullptr;        ///< Output.
  size_t count = 0;            ///< Elements, see the collective's header.
  DataType dtype = DataType::kF32;
  ReduceOp op = ReduceOp::kSum;  ///< Reductions only; kAvg divides by size().
  int root = 0;                  ///< Rooted collectives only (broadcast, reduce, gather, scatter).
  p2p::Tag tag = 0;              ///< First tag; see CollectiveTag().
  Deadline deadline{};           ///< Every wait gives up here with TIMED_OUT.
  /// Which call this is, equal on every rank and different from the calls
  /// before it that used the same tag (the communicator passes its
  /// sequence number); 0: not known. With it, a rank that finds the ranks
  /// disagree tells the others in notices that outlast its return
  /// (PointToPoint::PostNotice), and notes left from another call are
  /// ignored; without it, a rank that enters the call after the finder
  /// returned waits for its deadline. It also chooses the tags of every
  /// algorithm's data and argument check (CallDataBase and FingerprintTag
  /// in pipeline.h: slot call_id % 16), so every rank must pass the same
  /// call_id: ranks whose ids differ wait for each other's fingerprints at
  /// different tags until their deadline (TIMED_OUT; the check cannot
  /// compare what it never receives), unless the ids are a multiple of 16
  /// apart (they share a slot and meet). A caller that goes on after a
  /// failed call at the same tag must pass ids that differ, and not by a
  /// multiple of 16: a message of the failed call delivered although
  /// cancelled (UCX completes a small send as it is posted) is otherwise
  /// taken by the next call in its slot, data as that call's data (a wrong
  /// result), a fingerprint as that call's argument, a stop note (all
  /// notes of call 0 look alike) failing a call whose ranks agree. The
  /// communicator's (tag, slot) pairs repeat only 65,535 x 16 calls apart,
  /// and it aborts after a failed call, so there no such message reaches a
  /// later call.
  uint64_t call_id = 0;
  Tuning tuning;
};

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_COLLECTIVE_H_
