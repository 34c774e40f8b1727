#ifndef DDP_TRANSPORT_ALGORITHMS_GATHER_SCATTER_H_
#define DDP_TRANSPORT_ALGORITHMS_GATHER_SCATTER_H_

// Gather to one rank and scatter from it (MPI_Gather, MPI_Scatter), each a
// direct exchange with the root: the root posts one message per rank at
// once, every other rank one message. The root's link carries (p-1) blocks
// either way, which no tree can lower; a tree would only save the root
// per-message costs, which matter for many ranks and tiny blocks.
//
// Both prove that every rank passed the same arguments (count, dtype, root,
// collective) before any data moves, in ceil(log2 p) rounds of small
// messages (CheckEveryRank): one rank that differs fails every rank at
// once, naming it and both values, and no receive buffer is written.

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms {

/// Root's args.recv[q * count + i] = rank q's args.send[i]: recv holds
/// size() * count elements on the root and is ignored elsewhere (it may be
/// null). On the root, send may equal recv + root * count (in place).
/// args.op is ignored. Uses phase 0 of the tag range.
Status Gather(p2p::PointToPoint& p2p, const CollectiveArgs& args);

/// Rank q's args.recv[i] = root's args.send[q * count + i]: send holds
/// size() * count elements on the root and is ignored elsewhere (it may be
/// null). On the root, recv may equal send + root * count (in place).
/// args.op is ignored. Uses phase 0 of the tag range.
Status Scatter(p2p::PointToPoint& p2p, const CollectiveArgs& args);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_GATHER_SCATTER_H_
