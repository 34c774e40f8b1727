#ifndef DDP_TRANSPORT_ALGORITHMS_ALL_REDUCE_H_
#define DDP_TRANSPORT_ALGORITHMS_ALL_REDUCE_H_

// One entry point for every all-reduce algorithm: the communicator calls
// this with the algorithm it was asked for (kAuto to let the selection table
// and DDP_ALLREDUCE_ALGO decide) and the host of every rank.

#include <span>

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::algorithms {

/// Runs `algorithm` (kAuto: ChooseAllReduceAlgorithm from the message size,
/// the world size and host_of_rank) with `args`. host_of_rank: one host id
/// per rank, identical on every rank; empty means one host.
Status AllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args,
                 Algorithm algorithm = Algorithm::kAuto, std::span<const int> host_of_rank = {});

/// The algorithm AllReduce would run for these arguments.
StatusOr<Algorithm> ResolveAllReduceAlgorithm(const p2p::PointToPoint& p2p,
                                              const CollectiveArgs& args, Algorithm algorithm,
                                              std::span<const int> host_of_rank);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_ALL_REDUCE_H_
