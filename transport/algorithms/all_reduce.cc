#include "transport/algorithms/all_reduce.h"

#include <string>

#include "transport/algorithms/hierarchical_all_reduce.h"
#include "transport/algorithms/rhd_all_reduce.h"
#include "transport/algorithms/ring_all_reduce.h"
#include "transport/algorithms/selection.h"
#include "transport/algorithms/tree_all_reduce.h"

namespace ddp::transport::algorithms {

StatusOr<Algorithm> ResolveAllReduceAlgorithm(const p2p::PointToPoint& p2p,
                                              const CollectiveArgs& args, Algorithm algorithm,
                                              std::span<const int> host_of_rank) {
  SelectionInput input;
  input.bytes = args.count * DataTypeSize(args.dtype);
  input.world_size = p2p.size();
  if (algorithm == Algorithm::kAuto) {
    // The hosts only inform the choice here: the caller may not have asked
    // for the hierarchical algorithm, so the error names the choice.
    StatusOr<HostGroups> grouped = GroupByHost(p2p, host_of_rank);
    if (!grouped.ok()) {
      return Status(grouped.status().code(),
                    "all-reduce (automatic choice of algorithm): " + grouped.status().message());
    }
    const HostGroups& groups = *grouped;
    input.num_hosts = groups.num_hosts;
    input.uniform_hosts = groups.ranks_per_host > 0;
  }
  return ChooseAllReduceAlgorithm(algorithm, input);
}

Status AllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args, Algorithm algorithm,
                 std::span<const int> host_of_rank) {
  DDP_ASSIGN_OR_RETURN(const Algorithm chosen,
                       ResolveAllReduceAlgorithm(p2p, args, algorithm, host_of_rank));
  switch (chosen) {
    case Algorithm::kRing: return RingAllReduce(p2p, args);
    case Algorithm::kTree: return TreeAllReduce(p2p, args);
    case Algorithm::kRhd: return RhdAllReduce(p2p, args);
    case Algorithm::kHierarchical: return HierarchicalAllReduce(p2p, args, host_of_rank);
    case Algorithm::kSharedMemory:
      return FailedPreconditionError(
          "all-reduce: the shm algorithm runs over shared memory, not over a point-to-point "
          "transport; the communicator runs it (transport/shm)");
    case Algorithm::kAuto: break;
  }
  return InternalError("all-reduce: selection returned no algorithm");
}

}  // namespace ddp::transport::algorithms
