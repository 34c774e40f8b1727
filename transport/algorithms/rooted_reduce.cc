#include "transport/algorithms/rooted_reduce.h"

#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "transport/algorithms/binary_tree.h"
#include "transport/algorithms/pipeline.h"
#include "transport/algorithms/ring.h"
#include "transport/reduce/reduce.h"

namespace ddp::transport::algorithms {
namespace {

// The tree is chosen for short vectors: chunks small enough that a few
// levels pipeline, as in the tree all-reduce.
constexpr size_t kTreeReduceChunkBytes = 64 << 10;
constexpr int kTreeReduceDepth = 4;

// CheckArgs, fingerprint, count 0 and one rank (StartCollective): recv is
// written on the root only. A tree reduce of count 0 proves its arguments
// the way a tree reduce of any other count does (CheckEveryRank), so that
// a rank passing 0 where the others pass more fails every rank at once: the
// all-pairs check of StartCollective sends each rank a lone fingerprint,
// which the tree ranks' rounds never take, and the ranks that waited for a
// round's message from the empty rank waited for their deadline. A ring
// reduce of count 0 keeps the all-pairs check: the ring's own check is its
// neighbours', which the lone fingerprints match.
internal::CollectiveStart StartReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args,
                                      internal::FingerprintKind kind) {
  internal::BufferShape shape;
  shape.send_elems = args.count;
  shape.recv_elems = p2p.rank() == args.root ? args.count : 0;
  shape.uses_root = true;
  shape.uses_op = true;
  if (args.count != 0 || kind != internal::kTreeReduceKind) {
    return internal::StartCollective(p2p, args, kind, shape);
  }
  constexpr const char* kWhat = "tree reduce";
  internal::CollectiveStart start;
  start.finished = true;
  start.status = internal::CheckArgs(kWhat, p2p, args, shape);
  if (!start.status.ok()) return start;
  start.fingerprint = internal::MakeFingerprint(args, kind, shape.uses_op, shape.uses_root);
  start.status = internal::CheckEveryRank(p2p, args.deadline, kWhat, start.fingerprint,
                                          PhaseTag(args.tag, 0), args.call_id);
  return start;
}

}  // namespace

// Shapes: send [count] on every rank, recv [count] on the root. Chunk c of
// a rank's partial result is its input chunk folded with the same chunk
// from each child, in child order; it then goes to the parent (the root
// keeps it in recv). Receives run `depth` chunks ahead per child.
Status TreeReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  constexpr const char* kWhat = "tree reduce";
  const internal::CollectiveStart start = StartReduce(p2p, args, internal::kTreeReduceKind);
  if (start.finished) return start.status;
  const int p = p2p.size(), r = p2p.rank();
  const bool is_root = r == args.root;
  const size_t es = DataTypeSize(args.dtype);
  const auto* send = static_cast<const unsigned char*>(args.send);

  const size_t ce = internal::ChunkElems(args, kTreeReduceChunkBytes);
  const size_t depth = static_cast<size_t>(internal::PipelineDepth(args, kTreeReduceDepth));
  const size_t k = internal::ChunkCount(args.count, ce);
  const internal::TreeNode node = internal::BinomialTree(p, args.root, r);
  const size_t children = node.children.size();
  const reduce::ReduceFn reduce_fn = reduce::GetReduceFn(args.dtype, args.op);
  auto chunk_n = [&](size_t c) { return std::min(ce, args.count - c * ce); };

  // Per child, `depth` chunk slots; an inner rank's partial results live in
  // a whole-vector buffer, as each stays there until its send to the
  // parent completes. The root folds into recv; a leaf sends its input.
  const size_t slot_elems = std::min(ce, args.count);
  const size_t slots_bytes = children * depth * slot_elems * es;
  const bool own_partial = !is_root && children > 0;
  internal::Scratch scratch(slots_bytes + (own_partial ? args.count * es : 0));
  unsigned char* partial =
      is_root ? static_cast<unsigned char*>(args.recv) : scratch.data() + slots_bytes;
  auto slot = [&](size_t i, size_t c) {
    return scratch.data() + ((i * depth) + c % depth) * slot_elems * es;
  };

  // Every rank proves that all the others agree before any data moves
  // (CheckEveryRank, as the broadcast): checking its ring predecessor and
  // its children, a rank whose own checks passed (a leaf, whose only work
  // is to send) returned OK while the root failed. That check was also
  // what kept a parent from folding a leaf's bytes of another dtype of the
  // same size, posted before the leaf's own check could fail; now no bytes
  // move before every rank knows all agree. Costs ceil(log2 p) rounds of
  // small messages before the first chunk moves.
  const p2p::Tag tag = PhaseTag(args.tag, 0);
  DDP_RETURN_IF_ERROR(
      internal::CheckEveryRank(p2p, args.deadline, kWhat, start.fingerprint, tag,
                                                  args.call_id));
  // This call's own data tags (CallDataBase): a chunk a failed call at
  // this tag sent, delivered although cancelled, is not taken as this one's.
  const uint64_t base = internal::CallDataBase(args.call_id);
  internal::Requests requests(p2p, args.deadline);

  std::vector<p2p::RequestId> ids(children * depth, 0);
  auto post = [&](size_t c) -> Status {
    if (c >= k) return Status();
    for (size_t i = 0; i < children; ++i) {
      internal::Where where{kWhat, 0, 0, c, false, node.children[i]};
      DDP_ASSIGN_OR_RETURN(ids[i * depth + c % depth],
                           requests.Recv(where, internal::CallStepTag(tag, base, c), slot(i, c),
                                         chunk_n(c) * es));
    }
    return Status();
  };
  for (size_t c = 0; c < depth; ++c) DDP_RETURN_IF_ERROR(post(c));
  // At most 2 * depth chunks in flight to the parent (the parent's `depth`
  // receives, and as many queued behind them, so that a send rarely waits):
  // a leaf, which waits for no child, posted every chunk at once, and its
  // parent held the rest as unexpected messages.
  const size_t window = 2 * depth;
  std::vector<p2p::RequestId> sent(window, 0);
  for (size_t c = 0; c < k; ++c) {
    const size_t n = chunk_n(c);
    const unsigned char* mine = send + c * ce * es;
    unsigned char* out = children > 0 ? partial + c * ce * es : nullptr;
    const unsigned char* result = mine;
    for (size_t i = 0; i < children; ++i) {
      internal::Where where{kWhat, 0, 0, c, false, node.children[i]};
      DDP_RETURN_IF_ERROR(requests.Wait(ids[i * depth + c % depth], where));
      reduce_fn(out, result, slot(i, c), n);
      result = out;
    }
    DDP_RETURN_IF_ERROR(post(c + depth));  // the slots of chunk c are free again
    if (node.parent >= 0) {
      if (c >= window) {
        internal::Where where{kWhat, 0, 0, c - window, true, node.parent};
        DDP_RETURN_IF_ERROR(requests.Wait(sent[c % window], where));
      }
      internal::Where where{kWhat, 0, 0, c, true, node.parent};
      DDP_ASSIGN_OR_RETURN(sent[c % window], requests.Send(where, internal::CallStepTag(tag, base, c), result, n * es));
    } else if (args.op == ReduceOp::kAvg) {
      reduce::DivideInPlace(args.dtype, out, n, p);
    }
  }
  return requests.WaitAll(kWhat);
}

// Shapes: send [count] on every rank, split into p blocks (BlockLayout);
// rank q ends the reduce-scatter with block q reduced, and the root gathers
// the blocks into recv. The root's own block is reduced straight into its
// place in recv (in place when send == recv).
Status RingReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  const internal::CollectiveStart start = StartReduce(p2p, args, internal::kRingReduceKind);
  if (start.finished) return start.status;
  const int p = p2p.size(), r = p2p.rank();
  const bool is_root = r == args.root;
  const size_t es = DataTypeSize(args.dtype);
  const internal::BlockLayout layout{args.count, p};
  auto* recv = static_cast<unsigned char*>(args.recv);

  // Off the root, this rank's block is kept here between the two phases: a
  // Scratch, which the arena keeps for the next call only while it is small
  // (the reduce-scatter's nested Scratch takes the arena's other block).
  std::optional<internal::Scratch> block_scratch;
  unsigned char* block = nullptr;  // recv is null off the root
  if (is_root) {
    block = recv + layout.offset(r) * es;
  } else {
    block = block_scratch.emplace(layout.size(r) * es).data();
  }

  internal::RingParams params;
  params.dtype = args.dtype;
  params.op = args.op;
  params.tag = PhaseTag(args.tag, 0);
  params.deadline = args.deadline;
  params.call_id = args.call_id;
  params.fingerprint = &start.fingerprint;
  params.chunk_elems = internal::ChunkElems(args, internal::kRingChunkBytes);
  params.depth = internal::PipelineDepth(args, internal::kRingDepth);
  params.what = "ring reduce (reduce-scatter)";
  // A rank whose count the automatic choice (ChooseReduce) sends to the
  // tree runs CheckEveryRank at the tags of this ring's check: the rounds
  // it expects from this rank go out with the ring's check, and stay
  // posted when the check fails here, so it fails at once instead of at its
  // deadline (PostEveryRankRounds).
  internal::Requests rounds(p2p, args.deadline);
  DDP_RETURN_IF_ERROR(
      internal::PostEveryRankRounds(rounds, "ring reduce", start.fingerprint, params.tag,
                                    params.call_id));
  params.fingerprint_sent = true;
  int32_t differing_kind = 0;
  params.differing_kind = &differing_kind;
  if (Status scattered = internal::RingReduceScatterBlocks(p2p, args.send, block, layout, params);
      !scattered.ok()) {
    // Tree ranks wait for their round messages to be taken; they all send.
    if (internal::ChecksEveryRank(differing_kind)) {
      rounds.WaitAll("ring reduce, argument check").IgnoreError();
    }
    return scattered;
  }
  // Every rank divides its own block: p divisions of N/p at once.
  if (args.op == ReduceOp::kAvg) reduce::DivideInPlace(args.dtype, block, layout.size(r), p);

  constexpr const char* kGatherWhat = "ring reduce (gather to the root)";
  const p2p::Tag tag = PhaseTag(args.tag, 1);
  // At this call's own data tag (CallDataBase), as the ring phases.
  const p2p::Tag block_tag = internal::StepTag(tag, internal::CallDataBase(args.call_id));
  internal::Requests requests(p2p, args.deadline);
  if (is_root) {
    for (int q = 0; q < p; ++q) {
      if (q == r || layout.size(q) == 0) continue;
      internal::Where where{kGatherWhat, 0, 0, internal::Where::kNoChunk, false, q};
      DDP_RETURN_IF_ERROR(requests
                              .Recv(where, block_tag, recv + layout.offset(q) * es,
                                    layout.size(q) * es)
                              .status());
    }
  } else if (layout.size(r) > 0) {
    internal::Where where{kGatherWhat, 0, 0, internal::Where::kNoChunk, true, args.root};
    DDP_RETURN_IF_ERROR(
        requests.Send(where, block_tag, block, layout.size(r) * es).status());
  }
  DDP_RETURN_IF_ERROR(requests.WaitAll(kGatherWhat));
  return rounds.WaitAll("ring reduce, argument check");
}

Algorithm ChooseReduce(size_t bytes) {
  return bytes <= kTreeReduceMaxBytes ? Algorithm::kTree : Algorithm::kRing;
}

Status Reduce(p2p::PointToPoint& p2p, const CollectiveArgs& args, Algorithm algorithm) {
  if (algorithm != Algorithm::kTree && algorithm != Algorithm::kRing) {
    const size_t es = DataTypeSize(args.dtype);
    // A count whose bytes overflow, or a bad dtype: TreeReduce names it.
    const bool fits = es != 0 && args.count <= std::numeric_limits<size_t>::max() / es;
    algorithm = fits ? ChooseReduce(args.count * es) : Algorithm::kTree;
  }
  return algorithm == Algorithm::kTree ? TreeReduce(p2p, args) : RingReduce(p2p, args);
}

}  // namespace ddp::transport::algorithms
