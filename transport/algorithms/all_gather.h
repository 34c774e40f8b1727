#ifndef DDP_TRANSPORT_ALGORITHMS_ALL_GATHER_H_
#define DDP_TRANSPORT_ALGORITHMS_ALL_GATHER_H_

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms {

/// All-gather around a ring, chunked and pipelined. args.send holds
/// args.count elements; args.recv receives size() * args.count, block i
/// from rank i. In-place: args.send == args.recv + rank() * count elements
/// (any other overlap of send with recv also works: the own block is moved
/// into place first). args.op is ignored. Uses phase 0 of the tag range.
Status RingAllGather(p2p::PointToPoint& p2p, const CollectiveArgs& args);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_ALL_GATHER_H_
