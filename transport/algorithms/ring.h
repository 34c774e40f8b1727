#ifndef DDP_TRANSPORT_ALGORITHMS_RING_H_
#define DDP_TRANSPORT_ALGORITHMS_RING_H_

// The two ring phases that ring all-reduce, reduce-scatter, all-gather and
// the hierarchical all-reduce are built from (private to this package).
//
// Shapes: a vector of L.count elements split into p = size() blocks by
// BlockLayout; rank r owns block r.
//
// Ring order: rank r sends only to r+1 and receives only from r-1, so every
// link carries (p-1)/p of the vector once per phase, and no rank handles more
// than its share (bandwidth-optimal). Each block is cut into chunks that
// stream through the ring: while chunk c of a step is reduced, chunk c+1 is
// already arriving.

#include <cstddef>

#include "transport/algorithms/collective.h"
#include "transport/algorithms/pipeline.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::algorithms::internal {

/// Everything a ring phase needs besides buffers and the layout.
struct RingParams {
  DataType dtype = DataType::kF32;
  ReduceOp op = ReduceOp::kSum;  ///< kAvg reduces as a sum; callers divide.
  p2p::Tag tag = 0;              ///< Phase tag: uses [tag, tag + 2^kStepTagBits).
  Deadline deadline{};
  size_t chunk_elems = 1;
  int depth = 1;
  const char* what = "ring";     ///< Names the collective in errors.
  /// CollectiveArgs::call_id, for the stop notes and the data tags
  /// (CallDataBase: consecutive calls at one tag move data at different tags).
  uint64_t call_id = 0;
  /// When set, exchanged with the ring neighbours and checked before the
  /// first data is used (see PeerCheck); null when an earlier phase of the
  /// same collective already checked.
  const Fingerprint* fingerprint = nullptr;
  /// The caller has already sent `fingerprint` to the ring successor with
  /// FingerprintTag(tag, call_id), in a Requests that outlives this phase
  /// (PostEveryRankRounds); only the predecessor's is received here.
  bool fingerprint_sent = false;
  /// When set, the reduce-scatter stores here, as it returns, the
  /// Fingerprint::kind of a predecessor whose fingerprint differed, or of
  /// the rank a stop note named (Requests::RelayStops); 0 when none did or
  /// none arrived.
  int32_t* differing_kind = nullptr;
};

/// Default chunk for the ring phases: large enough that per-message costs
/// vanish, small enough that a few of them stay in L2.
inline constexpr size_t kRingChunkBytes = 256 << 10;
inline constexpr int kRingDepth = 4;

/// Reads the whole vector from `send`; on return `out` (L.size(rank)
/// elements) holds block rank() reduced over all ranks. `out` may be
/// send + L.offset(rank) (in-place) or not overlap `send` at all. Scratch
/// memory is a few chunks, not the vector.
Status RingReduceScatterBlocks(p2p::PointToPoint& p2p, const void* send, void* out,
                               const BlockLayout& layout, const RingParams& params);

/// `buf` holds the whole vector, with this rank's block already in place;
/// on return it holds every rank's block. No scratch memory.
Status RingAllGatherBlocks(p2p::PointToPoint& p2p, void* buf, const BlockLayout& layout,
                           const RingParams& params);

}  // namespace ddp::transport::algorithms::internal

#endif  // DDP_TRANSPORT_ALGORITHMS_RING_H_
