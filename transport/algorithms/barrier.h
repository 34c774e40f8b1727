#ifndef DDP_TRANSPORT_ALGORITHMS_BARRIER_H_
#define DDP_TRANSPORT_ALGORITHMS_BARRIER_H_

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms {

/// Returns once every rank has entered the barrier. Dissemination: in round
/// k = 0, 1, ... (ceil(log2 p) rounds) rank r signals r + 2^k and waits for
/// r - 2^k, so after the last round every rank has heard, directly or not,
/// from every other. Only args.tag, args.call_id and args.deadline are
/// used. Each rank checks that its ring predecessor is in a barrier too; a
/// rank that finds it is not stops the other ranks with a note passed
/// around the ring (as the ring collectives do), so they fail at once
/// instead of at their deadline. Uses phase 0 of the tag range.
Status Barrier(p2p::PointToPoint& p2p, const CollectiveArgs& args);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_BARRIER_H_
