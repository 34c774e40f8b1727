#ifndef DDP_TRANSPORT_ALGORITHMS_REDUCE_SCATTER_H_
#define DDP_TRANSPORT_ALGORITHMS_REDUCE_SCATTER_H_

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms {

/// Reduce-scatter around a ring, chunked and pipelined. args.send holds
/// size() * args.count elements (block i destined for rank i); args.recv
/// receives args.count elements: block rank() reduced over all ranks (kAvg
/// divided by size()). In-place: args.recv == args.send + rank() * count
/// elements. Scratch memory is a few chunks. Uses phase 0 of the tag range.
Status RingReduceScatter(p2p::PointToPoint& p2p, const CollectiveArgs& args);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_REDUCE_SCATTER_H_
