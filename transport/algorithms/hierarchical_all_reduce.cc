#include "transport/algorithms/hierarchical_all_reduce.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "transport/algorithms/pipeline.h"
#include "transport/algorithms/rhd_all_reduce.h"
#include "transport/algorithms/ring.h"
#include "transport/algorithms/ring_all_reduce.h"
#include "transport/p2p/group_view.h"
#include "transport/reduce/reduce.h"

namespace ddp::transport::algorithms {
namespace {

// Shards up to this size cross hosts by halving-doubling (latency-bound),
// larger ones by ring (bandwidth-bound).
constexpr size_t kInterHostRhdBytes = 256 << 10;

// The step between hosts is an all-reduce of its own at phase 1, whose
// argument check wants a whole collective's range above its tag: the top
// phase's worth of tags that a collective alone may start at cannot take it.
constexpr p2p::Tag kMaxNestingTag =
    p2p::kMaxTag - (kTagsPerCollective - 1) - (p2p::Tag{1} << kStepTagBits);

// INVALID_ARGUMENT naming `tag` when the step between hosts has no room
// above it; checked before any step, where that step named a tag of its own
// after the first one had run.
Status CheckNestingTag(const char* what, p2p::Tag tag) {
  if (tag <= kMaxNestingTag) return Status::Ok();
  return InvalidArgumentError(std::string(what) + ": tag " + std::to_string(tag) +
                              " leaves no room for the step between hosts (at most " +
                              std::to_string(kMaxNestingTag) + ")");
}

}  // namespace

StatusOr<HostGroups> GroupByHost(const p2p::PointToPoint& p2p,
                                 std::span<const int> host_of_rank) {
  // Before the per-rank lists below, which a refused world would allocate.
  DDP_RETURN_IF_ERROR(internal::CheckWorldSize("host grouping", p2p));
  const int p = p2p.size(), r = p2p.rank();
  if (!host_of_rank.empty() && host_of_rank.size() != static_cast<size_t>(p)) {
    return InvalidArgumentError("host_of_rank has " + std::to_string(host_of_rank.size()) +
                                " entries for " + std::to_string(p) + " ranks; expected " +
                                std::to_string(p) + " (one host id per rank), or none for one host");
  }
  HostGroups groups;
  std::vector<std::vector<int>> hosts;
  if (host_of_rank.empty()) {
    hosts.emplace_back();
    for (int i = 0; i < p; ++i) hosts[0].push_back(i);
  } else {
    std::map<int, size_t> index;  // host id -> position, in order of lowest rank
    for (int i = 0; i < p; ++i) {
      auto [it, added] = index.emplace(host_of_rank[i], hosts.size());
      if (added) hosts.emplace_back();
      hosts[it->second].push_back(i);
    }
  }
  const size_t per_host = hosts[0].size();
  const bool uniform = std::all_of(hosts.begin(), hosts.end(),
                                   [&](const auto& h) { return h.size() == per_host; });
  groups.num_hosts = static_cast<int>(hosts.size());
  groups.ranks_per_host = uniform ? static_cast<int>(per_host) : 0;
  if (!uniform) {
    for (int i = 0; i < p; ++i) groups.intra.push_back(i);
    groups.inter = {r};
    return groups;
  }
  for (const auto& host : hosts) {
    auto it = std::find(host.begin(), host.end(), r);
    if (it == host.end()) continue;
    groups.intra = host;
    const size_t local = static_cast<size_t>(it - host.begin());
    for (const auto& other : hosts) groups.inter.push_back(other[local]);
  }
  return groups;
}

Status InterHostAllReduce(p2p::PointToPoint& inter, void* shard, size_t count, int world_size,
                          const CollectiveArgs& args) {
  // The divisor of avg: below the group's own size it can only be a wrong
  // argument, and one of 0 or less aborted the process (DivideInPlace).
  if (world_size < inter.size()) {
    return InvalidArgumentError("hierarchical all-reduce (inter-host all-reduce): world_size " +
                                std::to_string(world_size) + " is less than the " +
                                std::to_string(inter.size()) +
                                " ranks of the inter-host group");
  }
  DDP_RETURN_IF_ERROR(CheckNestingTag("hierarchical all-reduce (inter-host all-reduce)", args.tag));
  // Avg is finished here, by the world size rather than the number of hosts.
  CollectiveArgs across = args;
  across.send = shard;
  across.recv = shard;
  across.count = count;
  across.op = args.op == ReduceOp::kAvg ? ReduceOp::kSum : args.op;
  // Hosts calling avg and sum must not agree (nor an f16 average the caller
  // divided first and passed as a sum, with its avg as the checked op).
  across.tuning.checked_op = args.tuning.checked_op.value_or(args.op);
  // Equal shards do not prove equal calls (10 and 11 elements over two
  // ranks a host both give one shard of 5): hosts compare the whole count
  // too, so that every rank of a mismatched call fails here.
  across.tuning.checked_whole_count = args.tuning.checked_whole_count.value_or(args.count);
  across.tag = PhaseTag(args.tag, 1);
  Status status = count * DataTypeSize(args.dtype) <= kInterHostRhdBytes
                      ? RhdAllReduce(inter, across)
                      : RingAllReduce(inter, across);
  DDP_RETURN_IF_ERROR(
      internal::Annotate(status, "hierarchical all-reduce (inter-host all-reduce)"));
  if (args.op == ReduceOp::kAvg) reduce::DivideInPlace(args.dtype, shard, count, world_size);
  return Status::Ok();
}

Status HierarchicalAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args,
                             std::span<const int> host_of_rank) {
  internal::BufferShape shape;
  shape.send_elems = args.count;
  shape.recv_elems = args.count;
  shape.uses_op = true;
  DDP_RETURN_IF_ERROR(internal::CheckArgs("hierarchical all-reduce", p2p, args, shape));
  DDP_RETURN_IF_ERROR(CheckNestingTag("hierarchical all-reduce", args.tag));
  StatusOr<HostGroups> grouped = GroupByHost(p2p, host_of_rank);
  if (!grouped.ok()) return internal::Annotate(grouped.status(), "hierarchical all-reduce");
  const HostGroups groups = *std::move(grouped);
  const internal::Fingerprint fingerprint = internal::MakeFingerprint(
      args, internal::kHierarchicalAllReduceKind, /*uses_op=*/true, /*uses_root=*/false);
  if (args.count == 0) {
    // The full algorithm checks the ranks of its own host in step 1 and
    // its inter-host group in step 2 (that all-reduce's own check): a host
    // whose ranks all pass 0 must reach both.
    std::vector<int> inter_peers;
    for (int q : groups.inter) {
      if (q != p2p.rank()) inter_peers.push_back(q);
    }
    return internal::CheckEmptyCall(
        p2p, args.deadline, "hierarchical all-reduce", fingerprint,
        {{PhaseTag(args.tag, 0), internal::OtherRanks(p2p)},
         {PhaseTag(PhaseTag(args.tag, 1), 0), std::move(inter_peers)}},
        args.call_id);
  }

  DDP_ASSIGN_OR_RETURN(p2p::GroupView intra, p2p::GroupView::Create(p2p, groups.intra));
  DDP_ASSIGN_OR_RETURN(p2p::GroupView inter, p2p::GroupView::Create(p2p, groups.inter));
  const int local = intra.rank();
  const size_t es = DataTypeSize(args.dtype);
  const internal::BlockLayout layout{args.count, intra.size()};
  auto* shard = static_cast<unsigned char*>(args.recv) + layout.offset(local) * es;
  const size_t shard_count = layout.size(local);

  // 1. Reduce-scatter inside the host.
  internal::RingParams params;
  params.dtype = args.dtype;
  params.op = args.op;
  params.tag = PhaseTag(args.tag, 0);
  params.deadline = args.deadline;
  params.call_id = args.call_id;
  params.chunk_elems = internal::ChunkElems(args, internal::kRingChunkBytes);
  params.depth = internal::PipelineDepth(args, internal::kRingDepth);
  params.what = "hierarchical all-reduce (intra-host reduce-scatter)";
  params.fingerprint = &fingerprint;
  DDP_RETURN_IF_ERROR(internal::RingReduceScatterBlocks(intra, args.send, shard, layout, params));

  // 2. All-reduce of this shard across hosts (phases 1-2).
  DDP_RETURN_IF_ERROR(InterHostAllReduce(inter, shard, shard_count, p2p.size(), args));

  // 3. All-gather inside the host (phase 3).
  params.tag = PhaseTag(args.tag, 3);
  params.what = "hierarchical all-reduce (intra-host all-gather)";
  params.fingerprint = nullptr;  // checked in step 1
  return internal::RingAllGatherBlocks(intra, args.recv, layout, params);
}

}  // namespace ddp::transport::algorithms
