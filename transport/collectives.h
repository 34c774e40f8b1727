#ifndef DDP_TRANSPORT_COLLECTIVES_H_
#define DDP_TRANSPORT_COLLECTIVES_H_

// The communicator's bridge to transport/algorithms: which algorithm runs a
// collective, given the topology. Private to //transport.

#include <cstddef>
#include <functional>

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/shm/shm_allreduce.h"
#include "transport/status.h"
#include "transport/topology/topology.h"
#include "transport/types.h"

namespace ddp::transport::internal {

/// The all-reduce algorithm for `bytes` bytes on `topology` from the
/// selection table (never kAuto, never kSharedMemory).
Algorithm SelectAllReduce(size_t bytes, const topology::Topology& topology);

/// What decides an all-reduce's algorithm.
struct AllReduceChoice {
  size_t bytes = 0;
  Algorithm requested = Algorithm::kAuto;  ///< CallOptions::algorithm.
  Algorithm configured = Algorithm::kAuto; ///< Options or DDP_ALLREDUCE_ALGO.
  bool shared_memory = false;              ///< The shm engine is up.
  /// Several hosts, each reducing among its ranks through shared memory
  /// (the hierarchical all-reduce's fast path).
  bool host_shared_memory = false;
};

/// The per-call choice: the request, else the configuration, else the shm
/// engine when it is up, else the hierarchical all-reduce at every size
/// when uniform hosts reduce inside through shared memory (one exchange
/// between hosts per call, where a flat algorithm crosses hosts at several
/// steps), else the table. Requests that cannot run here fall back: shm
/// without the engine, hierarchical on one host.
Algorithm ChooseAllReduce(const AllReduceChoice& choice, const topology::Topology& topology);

/// Runs a flat all-reduce algorithm (ring, tree, rhd) over `p2p`.
Status RunAllReduce(Algorithm algorithm, p2p::PointToPoint& p2p,
                    const algorithms::CollectiveArgs& args);
/// Hierarchical all-reduce over the hosts of `topology`.
Status RunHierarchicalAllReduce(p2p::PointToPoint& p2p, const topology::Topology& topology,
                                const algorithms::CollectiveArgs& args);
/// The hierarchical all-reduce with its steps inside a host in shared
/// memory: `host` (this rank's host's ranks) reduces the inputs, each rank
/// all-reduces its slice over `inter` (the ranks of the other hosts with
/// this rank's local index; InterHostAllReduce), and `host` shares the
/// slices. Every host must run it, not RunHierarchicalAllReduce: the two
/// slice the vector differently. `abort` tells every rank of the job of
/// this rank's failure at once (the communicator's abort): it is called
/// when this rank fails after its host's ranks met, before it waits for
/// them, so that the ranks of other hosts waiting for it in the inter-host
/// step fail with its error instead of at their deadline.
Status RunHierarchicalThroughShm(shm::ShmAllReduce& host, p2p::PointToPoint& inter,
                                 int world_size, const algorithms::CollectiveArgs& args,
                                 const std::function<Status(Deadline, int)>& watchdog,
                                 const shm::ShmAllReduce::FailFn& abort);
Status RunBroadcast(p2p::PointToPoint& p2p, const algorithms::CollectiveArgs& args);
Status RunAllGather(p2p::PointToPoint& p2p, const algorithms::CollectiveArgs& args);
Status RunReduceScatter(p2p::PointToPoint& p2p, const algorithms::CollectiveArgs& args);
Status RunBarrier(p2p::PointToPoint& p2p, const algorithms::CollectiveArgs& args);

}  // namespace ddp::transport::internal

#endif  // DDP_TRANSPORT_COLLECTIVES_H_
