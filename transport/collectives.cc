#include "transport/collectives.h"

#include <vector>

#include "transport/algorithms/all_gather.h"
#include "transport/algorithms/all_reduce.h"
#include "transport/algorithms/barrier.h"
#include "transport/algorithms/broadcast.h"
#include "transport/algorithms/hierarchical_all_reduce.h"
#include "transport/algorithms/reduce_scatter.h"
#include "transport/algorithms/selection.h"

namespace ddp::transport::internal {

Algorithm SelectAllReduce(size_t bytes, const topology::Topology& topology) {
  return algorithms::SelectFromRules(algorithms::DefaultAllReduceRules(),
                                     {.bytes = bytes,
                                      .world_size = topology.size(),
                                      .num_hosts = topology.num_hosts(),
                                      .uniform_hosts = topology.Uniform()});
}

Algorithm ChooseAllReduce(const AllReduceChoice& c, const topology::Topology& topology) {
  // The call's request, else the configured one (DDP_ALLREDUCE_ALGO), each
  // only where it can run: shared memory needs the engine up, hierarchical
  // more than one host.
  auto runs_here = [&](Algorithm a) {
    return a != Algorithm::kAuto && !(a == Algorithm::kSharedMemory && !c.shared_memory) &&
           !(a == Algorithm::kHierarchical && topology.num_hosts() < 2);
  };
  if (runs_here(c.requested)) return c.requested;
  if (runs_here(c.configured)) return c.configured;
  if (c.shared_memory) return Algorithm::kSharedMemory;
  if (c.host_shared_memory && topology.num_hosts() > 1 && topology.Uniform()) {
    return Algorithm::kHierarchical;
  }
  return SelectAllReduce(c.bytes, topology);
}

Status RunAllReduce(Algorithm algorithm, p2p::PointToPoint& p2p,
                    const algorithms::CollectiveArgs& args) {
  if (algorithm != Algorithm::kRing && algorithm != Algorithm::kTree &&
      algorithm != Algorithm::kRhd) {
    return InternalError(std::string("not a flat all-reduce algorithm: ") + AlgorithmName(algorithm));
  }
  return algorithms::AllReduce(p2p, args, algorithm);
}

Status RunHierarchicalAllReduce(p2p::PointToPoint& p2p, const topology::Topology& topology,
                                const algorithms::CollectiveArgs& args) {
  std::vector<int> host_of_rank(topology.size());
  for (int r = 0; r < topology.size(); ++r) host_of_rank[r] = topology.ranks[r].host;
  return algorithms::HierarchicalAllReduce(p2p, args, host_of_rank);
}

Status RunHierarchicalThroughShm(shm::ShmAllReduce& host, p2p::PointToPoint& inter,
                                 int world_size, const algorithms::CollectiveArgs& args,
                                 const std::function<Status(Deadline, int)>& watchdog,
                                 const shm::ShmAllReduce::FailFn& abort) {
  // Called on every rank, for an empty slice too: the inter-host call then
  // still checks the arguments against the other hosts.
  auto across = [&](void* slice, size_t, size_t count) {
    return algorithms::InterHostAllReduce(inter, slice, count, world_size, args);
  };
  return host.AllReduceThrough(args.send, args.recv, args.count, args.dtype, args.op, across,
                               args.deadline, watchdog, args.tuning.checked_op, abort);
}

Status RunBroadcast(p2p::PointToPoint& p2p, const algorithms::CollectiveArgs& args) {
  return algorithms::Broadcast(p2p, args);
}

Status RunAllGather(p2p::PointToPoint& p2p, const algorithms::CollectiveArgs& args) {
  return algorithms::RingAllGather(p2p, args);
}

Status RunReduceScatter(p2p::PointToPoint& p2p, const algorithms::CollectiveArgs& args) {
  return algorithms::RingReduceScatter(p2p, args);
}

Status RunBarrier(p2p::PointToPoint& p2p, const algorithms::CollectiveArgs& args) {
  return algorithms::Barrier(p2p, args);
}

}  // namespace ddp::transport::internal
