#ifndef DDP_TRANSPORT_ALGORITHMS_TREE_ALL_REDUCE_H_
#define DDP_TRANSPORT_ALGORITHMS_TREE_ALL_REDUCE_H_

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms {

/// All-reduce over a double binary tree (see binary_tree.h): the first half
/// of the vector is reduced up tree 0 and broadcast back down it, the second
/// half the same on tree 1, both pipelined in chunks so that a chunk moves
/// up while earlier ones come down. args.count elements in args.send and
/// args.recv (in-place when equal). Latency grows with log2(p) rather than
/// p; each rank still moves about as many bytes as in a ring. Uses phases
/// 0-3 of the tag range.
Status TreeAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_TREE_ALL_REDUCE_H_
