#ifndef DDP_TRANSPORT_ALGORITHMS_HIERARCHICAL_ALL_REDUCE_H_
#define DDP_TRANSPORT_ALGORITHMS_HIERARCHICAL_ALL_REDUCE_H_

#include <span>
#include <vector>

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms {

/// All-reduce for ranks on several hosts, composed from the ring phases and
/// a flat all-reduce over GroupViews:
///   1. inside each host, a ring reduce-scatter: the host's L ranks each end
///      with one of L shards, reduced over the host (shared memory);
///   2. across hosts, the H ranks holding the same shard all-reduce it
///      (halving-doubling for small shards, ring otherwise): only 1/L of
///      the vector crosses the network per rank;
///   3. inside each host, a ring all-gather of the shards.
/// host_of_rank[i] is rank i's host (any ids). It must be identical on
/// every rank, and that is not checked: comparing it would cost a round of
/// messages per call, and ranks that disagree build different groups, so
/// their argument checks need not even meet; they wait for messages that
/// are never sent, failing only at their deadline (TIMED_OUT). Derive it
/// from something every rank shares (the communicator uses its topology,
/// which the ranks compare once, when it is created).
/// Hosts are ordered by their lowest rank. Every host must hold the same
/// number of ranks; otherwise, or when host_of_rank is empty, all ranks are
/// treated as one host (a flat ring). args as for RingAllReduce. Uses phases
/// 0-3 of the tag range.
Status HierarchicalAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args,
                             std::span<const int> host_of_rank);

/// Step 2 on its own: `shard` (count elements, in place) all-reduced over
/// `inter`, the ranks of every host that hold the same shard; with kAvg,
/// divided by `world_size` (INVALID_ARGUMENT, naming it, when it is below
/// inter.size()). args supply dtype, op, tag and deadline, and count the
/// whole call's count, which the hosts compare besides the shard's (its
/// buffers are ignored). The communicator also runs it between
/// the shared-memory steps of a host (transport/collectives.h). Uses phases
/// 1-2 of the tag range.
Status InterHostAllReduce(p2p::PointToPoint& inter, void* shard, size_t count, int world_size,
                          const CollectiveArgs& args);

/// The grouping HierarchicalAllReduce uses, for tests and logs.
struct HostGroups {
  int num_hosts = 1;
  int ranks_per_host = 1;  ///< 0 when hosts hold different numbers of ranks
  std::vector<int> intra;  ///< the calling rank's host, ascending
  std::vector<int> inter;  ///< one rank per host with the caller's local index
};

/// INVALID_ARGUMENT, naming host_of_rank and both sizes (the caller
/// prefixes what it was doing), when host_of_rank has a size other than 0
/// or p2p.size(), or when p2p.size() exceeds kMaxWorldSize.
StatusOr<HostGroups> GroupByHost(const p2p::PointToPoint& p2p, std::span<const int> host_of_rank);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_HIERARCHICAL_ALL_REDUCE_H_
