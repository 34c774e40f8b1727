#ifndef DDP_TRANSPORT_ALGORITHMS_RING_ALL_REDUCE_H_
#define DDP_TRANSPORT_ALGORITHMS_RING_ALL_REDUCE_H_

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms {

/// All-reduce around a ring: reduce-scatter, then all-gather, both chunked
/// and pipelined. args.count elements in args.send and args.recv (in-place
/// when equal). Each rank sends and receives 2 (p-1)/p of the vector: the
/// bandwidth-optimal choice for large messages; latency grows with 2 (p-1)
/// steps. Uses phases 0 and 1 of the tag range.
Status RingAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_RING_ALL_REDUCE_H_
