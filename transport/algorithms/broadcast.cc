#include "transport/algorithms/broadcast.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "transport/algorithms/binary_tree.h"
#include "transport/algorithms/pipeline.h"

namespace ddp::transport::algorithms {
namespace {

constexpr size_t kBroadcastChunkBytes = 128 << 10;
constexpr int kBroadcastDepth = 4;

}  // namespace

Status Broadcast(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  const int p = p2p.size(), r = p2p.rank();
  const bool is_root = r == args.root;
  internal::BufferShape shape;
  shape.send_elems = args.count;
  shape.recv_elems = args.count;
  shape.uses_root = true;
  shape.needs_send = is_root;
  DDP_RETURN_IF_ERROR(internal::CheckArgs("broadcast", p2p, args, shape));
  const internal::Fingerprint fingerprint = internal::MakeFingerprint(
      args, internal::kBroadcastKind, /*uses_op=*/false, /*uses_root=*/true);
  const p2p::Tag tag = PhaseTag(args.tag, 0);
  // Every rank proves that all the others agree before any data moves. A
  // check of its neighbours alone let ranks farther from the one that
  // disagreed return OK: with roots 0, 0, 3, 0, 0, ranks 1, 3 and 4 failed,
  // but the root, whose neighbours all agreed, sent, and rank 2, a leaf
  // under it, took the data; both returned OK. Costs ceil(log2 p) rounds of small messages before the
  // root's first send (it waited one round for its children's before);
  // with the verdict the same on every rank, a disagreement fails them all
  // at once and leaves every receive buffer untouched. A count of 0 is
  // proven the same way (no algorithm other than this one answers it).
  DDP_RETURN_IF_ERROR(internal::CheckEveryRank(p2p, args.deadline, "broadcast", fingerprint,
                                               tag, args.call_id));
  if (args.count == 0) return Status();
  const size_t es = DataTypeSize(args.dtype);
  const auto* send = static_cast<const unsigned char*>(args.send);
  auto* recv = static_cast<unsigned char*>(args.recv);
  if (p == 1) {
    if (recv != send) std::memmove(recv, send, args.count * es);
    return Status();
  }

  const size_t ce = internal::ChunkElems(args, kBroadcastChunkBytes);
  const size_t depth = static_cast<size_t>(internal::PipelineDepth(args, kBroadcastDepth));
  const size_t k = internal::ChunkCount(args.count, ce);
  const bool chain = k >= static_cast<size_t>(p);
  const internal::TreeNode node =
      chain ? internal::ChainTree(p, args.root, r) : internal::HeapTree(p, args.root, r);
  const char* what = chain ? "broadcast (chain)" : "broadcast (tree)";
  auto chunk_n = [&](size_t c) { return std::min(ce, args.count - c * ce); };

  // This call's own data tags (CallDataBase): a chunk a failed call at
  // this tag sent, delivered although cancelled, is not taken as this one's.
  const uint64_t base = internal::CallDataBase(args.call_id);
  internal::Requests requests(p2p, args.deadline);
  // At most a pipeline's depth of chunks in flight to each child: a child
  // holds any more as unexpected messages (the root used to post every
  // chunk at once), so chunk c waits for the sends of chunk c - depth.
  std::vector<std::vector<std::pair<int, p2p::RequestId>>> in_flight(depth);
  auto forward = [&](const unsigned char* data, size_t c) -> Status {
    auto& slot = in_flight[c % depth];
    for (const auto& [child, id] : slot) {
      internal::Where where{what, 0, 0, c - depth, true, child};
      DDP_RETURN_IF_ERROR(requests.Wait(id, where));
    }
    slot.clear();
    for (int child : node.children) {
      internal::Where where{what, 0, 0, c, true, child};
      DDP_ASSIGN_OR_RETURN(const p2p::RequestId id, requests.Send(where, internal::CallStepTag(tag, base, c),
                                                                  data + c * ce * es, chunk_n(c) * es));
      slot.emplace_back(child, id);
    }
    return Status();
  };

  if (is_root) {
    const size_t first = std::min(k, depth);
    for (size_t c = 0; c < first; ++c) DDP_RETURN_IF_ERROR(forward(send, c));
    // Copy while the first chunks travel.
    if (recv != send) std::memcpy(recv, send, args.count * es);
    for (size_t c = first; c < k; ++c) DDP_RETURN_IF_ERROR(forward(send, c));
    return requests.WaitAll(what);
  }

  std::vector<p2p::RequestId> ids(depth, 0);
  auto post = [&](size_t c) -> Status {
    if (c >= k) return Status();
    internal::Where where{what, 0, 0, c, false, node.parent};
    DDP_ASSIGN_OR_RETURN(ids[c % depth], requests.Recv(where, internal::CallStepTag(tag, base, c),
                                                       recv + c * ce * es, chunk_n(c) * es));
    return Status();
  };
  for (size_t c = 0; c < depth; ++c) DDP_RETURN_IF_ERROR(post(c));
  for (size_t c = 0; c < k; ++c) {
    internal::Where where{what, 0, 0, c, false, node.parent};
    DDP_RETURN_IF_ERROR(requests.Wait(ids[c % depth], where));
    DDP_RETURN_IF_ERROR(post(c + depth));
    DDP_RETURN_IF_ERROR(forward(recv, c));
  }
  return requests.WaitAll(what);
}

}  // namespace ddp::transport::algorithms
