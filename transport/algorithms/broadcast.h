#ifndef DDP_TRANSPORT_ALGORITHMS_BROADCAST_H_
#define DDP_TRANSPORT_ALGORITHMS_BROADCAST_H_

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms {

/// Broadcast from args.root, pipelined in chunks: every rank's args.recv
/// (args.count elements) receives the root's args.send. On the root, send
/// may equal recv; elsewhere send is ignored (it may be null). Short
/// messages (fewer chunks than ranks) go down a binary tree, log2 p deep;
/// longer ones down a chain, where each rank forwards every chunk once, so
/// the root's link, not its fan-out, sets the pace. args.op is ignored. Uses
/// phase 0 of the tag range.
Status Broadcast(p2p::PointToPoint& p2p, const CollectiveArgs& args);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_BROADCAST_H_
