#include "transport/algorithms/tree_all_reduce.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

#include "transport/algorithms/binary_tree.h"
#include "transport/algorithms/pipeline.h"
#include "transport/reduce/reduce.h"

namespace ddp::transport::algorithms {
namespace {

// Smaller than the ring's chunk: a tree pipeline fills after depth * chunk
// bytes, and the tree is chosen for medium messages.
constexpr size_t kTreeChunkBytes = 64 << 10;
constexpr int kTreeDepth = 4;

constexpr const char* kWhat[2][2] = {
    {"tree all-reduce, tree 0 reduce", "tree all-reduce, tree 0 broadcast"},
    {"tree all-reduce, tree 1 reduce", "tree all-reduce, tree 1 broadcast"}};

// One of the two trees as this rank runs it. Chunk c covers elements
// [offset + c * ce, ...) of the vector.
struct Tree {
  int index = 0;
  internal::TreeNode node;
  size_t offset = 0;
  size_t count = 0;
  size_t chunks = 0;
  p2p::Tag up_tag = 0;    // children -> parent, partial results
  p2p::Tag down_tag = 0;  // parent -> children, final results
  // Per child, a ring of `depth` chunk slots receiving its partial results.
  std::vector<unsigned char*> slots;
  std::vector<std::vector<p2p::RequestId>> child_recv;  // [child][c % depth]
  // The up-send of chunk c when it reads the recv chunk, which the final
  // result will overwrite: its receive may be posted only after it completes.
  std::vector<p2p::RequestId> up_send_from_recv;
  std::vector<p2p::RequestId> down_recv;
  size_t up_done = 0;         // chunks whose up step is done
  size_t next_down_post = 0;  // next chunk whose down receive to post
};

}  // namespace

Status TreeAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  const internal::CollectiveStart start = internal::StartFlatAllReduce(p2p, args, internal::kTreeAllReduceKind);
  if (start.finished) return start.status;
  const internal::Fingerprint& fingerprint = start.fingerprint;
  const int p = p2p.size(), r = p2p.rank();
  const size_t es = DataTypeSize(args.dtype);
  const auto* send = static_cast<const unsigned char*>(args.send);
  auto* recv = static_cast<unsigned char*>(args.recv);

  const size_t ce = internal::ChunkElems(args, kTreeChunkBytes);
  const size_t depth = static_cast<size_t>(internal::PipelineDepth(args, kTreeDepth));
  const reduce::ReduceFn reduce_fn = reduce::GetReduceFn(args.dtype, args.op);
  const internal::BlockLayout halves{args.count, 2};
  const auto nodes = internal::DoubleBinaryTree(p, r);

  // One scratch block carved into per-tree, per-child slot rings.
  size_t scratch_bytes = 0;
  for (int t = 0; t < 2; ++t) {
    const size_t slot_elems = std::min(ce, std::max<size_t>(halves.size(t), 1));
    scratch_bytes += nodes[t].children.size() * depth * slot_elems * es;
  }
  internal::Scratch scratch(scratch_bytes);
  unsigned char* next_slots = scratch.data();

  // This call's own data tags (CallDataBase): a chunk a failed call at
  // this tag sent, delivered although cancelled, is not taken as this one's.
  const uint64_t base = internal::CallDataBase(args.call_id);
  std::array<Tree, 2> trees;
  for (int t = 0; t < 2; ++t) {
    Tree& tree = trees[t];
    tree.index = t;
    tree.node = nodes[t];
    tree.offset = halves.offset(t);
    tree.count = halves.size(t);
    tree.chunks = internal::ChunkCount(tree.count, ce);
    tree.up_tag = PhaseTag(args.tag, 2 * t);
    tree.down_tag = PhaseTag(args.tag, 2 * t + 1);
    const size_t slot_elems = std::min(ce, std::max<size_t>(tree.count, 1));
    for (size_t i = 0; i < tree.node.children.size(); ++i) {
      tree.slots.push_back(next_slots);
      next_slots += depth * slot_elems * es;
      tree.child_recv.emplace_back(depth, 0);
    }
    tree.up_send_from_recv.assign(tree.chunks, 0);
    tree.down_recv.assign(tree.chunks, 0);
  }
  auto chunk_elems = [&](const Tree& tree, size_t c) {
    return std::min(ce, tree.count - c * ce);
  };
  auto input_at = [&](const Tree& tree, size_t c) { return send + (tree.offset + c * ce) * es; };
  auto output_at = [&](const Tree& tree, size_t c) { return recv + (tree.offset + c * ce) * es; };
  auto slot_ptr = [&](Tree& tree, size_t i, size_t c) {
    const size_t slot_elems = std::min(ce, std::max<size_t>(tree.count, 1));
    return tree.slots[i] + (c % depth) * slot_elems * es;
  };

  internal::Requests requests(p2p, args.deadline);
  // Children prove their arguments to their tree-0 parent before any data:
  // a mismatch stops tree 0 at that parent, so no rank completes. Each rank
  // also sends its arguments to its ring successor and checks its ring
  // predecessor's, the check of the ring, halving-doubling, broadcast and
  // reduce: ranks that chose different algorithms (another
  // CallOptions::algorithm, a count on the other side of the selection
  // table's threshold) meet in it and fail, where they all waited for the
  // deadline. It costs one more small message each way where the parent is
  // not the successor: on 4 ranks sharing 2 cores, a forced tree of 4 KiB
  // took about 10 us more (45 -> 55 us in the quietest runs); no change was
  // seen at 256 KiB and 4 MiB (the table takes the tree from 64 KiB).
  //
  // A rank also swaps fingerprints with every other rank it takes data
  // from (its parent and children in both trees), so that it compares a
  // peer's arguments with its own before any of that peer's data: without
  // it, a rank whose tree-1 parent or child passed another count or dtype
  // could take that data first and fail on its size ("message size
  // mismatch: rank 0 sent 256 bytes (tag 0x200000) but rank 4 expected
  // 128", 5 ranks, rank 0 passing 64 of f64), naming neither count nor
  // dtype, and its note told the others only its own arguments. One fingerprint
  // each way per pair (a peer that is also a ring neighbour, or a peer in
  // both trees, is listed once): every tree edge carries one each way.
  // That costs a rank at most three more small messages sent and four more
  // received (a rank is a leaf in one of the two trees, so it has four tree
  // peers at most), fewer than two more each way on average (counted for 2
  // to 64 ranks; none on 2), all posted before any data. The ring
  // predecessor is still awaited first, so a rank running another
  // algorithm is met there.
  //
  // A disagreement one rank's check finds stops every rank: a stop note
  // goes around the ring of the check (Requests::RelayStops). Without it,
  // only the ranks checking the odd one failed, and the others waited for
  // the reduction the failed ones never passed on, until their deadline.
  internal::PeerCheck check("tree all-reduce", fingerprint);
  {
    const int next = (r + 1) % p, prev = (r + p - 1) % p;
    DDP_RETURN_IF_ERROR(requests.RelayStops("tree all-reduce", args.call_id, PhaseTag(args.tag, 0), prev,
                                            next));
    std::vector<int> to = {next}, from = {prev};
    auto add = [](std::vector<int>& peers, int peer) {
      if (peer >= 0 && std::find(peers.begin(), peers.end(), peer) == peers.end()) {
        peers.push_back(peer);
      }
    };
    // Tree 0's parent first among the sends and its children first among
    // the receives, the check that stops tree 0 before any data.
    for (const Tree& tree : trees) {
      add(to, tree.node.parent);
      for (int child : tree.node.children) {
        add(to, child);
        add(from, child);
      }
    }
    for (const Tree& tree : trees) add(from, tree.node.parent);
    DDP_RETURN_IF_ERROR(check.Post(requests, PhaseTag(args.tag, 0), args.call_id, to, from));
  }

  auto post_child_recvs = [&](Tree& tree, size_t c) -> Status {
    if (c >= tree.chunks) return Status();
    for (size_t i = 0; i < tree.node.children.size(); ++i) {
      internal::Where where{kWhat[tree.index][0], 0, 0, c, false, tree.node.children[i]};
      DDP_ASSIGN_OR_RETURN(tree.child_recv[i][c % depth],
                           requests.Recv(where, internal::CallStepTag(tree.up_tag, base, c),
                                         slot_ptr(tree, i, c), chunk_elems(tree, c) * es));
    }
    return Status();
  };

  auto send_down = [&](Tree& tree, size_t c) -> Status {
    for (int child : tree.node.children) {
      internal::Where where{kWhat[tree.index][1], 0, 0, c, true, child};
      DDP_RETURN_IF_ERROR(requests.Send(where, internal::CallStepTag(tree.down_tag, base, c),
                                        output_at(tree, c), chunk_elems(tree, c) * es)
                              .status());
    }
    return Status();
  };

  // Reduce chunk c with the children's partial results and pass it up (or,
  // at the root, finish it and start it down).
  auto up_step = [&](Tree& tree, size_t c) -> Status {
    const size_t n = chunk_elems(tree, c);
    const unsigned char* mine = input_at(tree, c);
    unsigned char* out = output_at(tree, c);
    const unsigned char* result = mine;
    if (!tree.node.children.empty()) {
      for (size_t i = 0; i < tree.node.children.size(); ++i) {
        internal::Where where{kWhat[tree.index][0], 0, 0, c, false, tree.node.children[i]};
        DDP_RETURN_IF_ERROR(requests.Wait(tree.child_recv[i][c % depth], where));
        reduce_fn(out, i == 0 ? mine : out, slot_ptr(tree, i, c), n);
      }
      result = out;
      DDP_RETURN_IF_ERROR(post_child_recvs(tree, c + depth));
    }
    tree.up_done = c + 1;
    if (tree.node.parent >= 0) {
      internal::Where where{kWhat[tree.index][0], 0, 0, c, true, tree.node.parent};
      DDP_ASSIGN_OR_RETURN(const p2p::RequestId id,
                           requests.Send(where, internal::CallStepTag(tree.up_tag, base, c), result, n * es));
      if (result == out) tree.up_send_from_recv[c] = id;
      return Status();
    }
    // Root: the chunk is final.
    if (result != out) std::memcpy(out, result, n * es);
    if (args.op == ReduceOp::kAvg) reduce::DivideInPlace(args.dtype, out, n, p);
    return send_down(tree, c);
  };

  // Posts the down receive of chunk next_down_post onward, up to `limit`;
  // `wait` forces it (waiting for the up-send that still reads the chunk),
  // otherwise it stops at the first up-send still in flight.
  auto post_down = [&](Tree& tree, size_t limit, bool wait) -> Status {
    while (tree.next_down_post < std::min(limit, tree.up_done)) {
      const size_t c = tree.next_down_post;
      internal::Where where{kWhat[tree.index][0], 0, 0, c, true, tree.node.parent};
      if (tree.up_send_from_recv[c] != 0) {
        if (wait) {
          DDP_RETURN_IF_ERROR(requests.Wait(tree.up_send_from_recv[c], where));
        } else {
          DDP_ASSIGN_OR_RETURN(const bool done, requests.Test(tree.up_send_from_recv[c], where));
          if (!done) break;
        }
        tree.up_send_from_recv[c] = 0;
      }
      where.what = kWhat[tree.index][1];
      where.is_send = false;
      DDP_ASSIGN_OR_RETURN(tree.down_recv[c],
                           requests.Recv(where, internal::CallStepTag(tree.down_tag, base, c),
                                         output_at(tree, c), chunk_elems(tree, c) * es));
      ++tree.next_down_post;
    }
    return Status();
  };

  auto down_step = [&](Tree& tree, size_t c) -> Status {
    DDP_RETURN_IF_ERROR(post_down(tree, c + 1, /*wait=*/true));
    internal::Where where{kWhat[tree.index][1], 0, 0, c, false, tree.node.parent};
    DDP_RETURN_IF_ERROR(requests.Wait(tree.down_recv[c], where));
    return send_down(tree, c);
  };

  for (Tree& tree : trees) {
    for (size_t c = 0; c < depth; ++c) DDP_RETURN_IF_ERROR(post_child_recvs(tree, c));
  }
  // Chunk j goes up both trees, then chunk j - depth comes down both: the
  // lag lets the root's results arrive while later chunks are reduced. All
  // waits are on chunks no later than the current one, so no cycle forms.
  const size_t lag = depth;
  const size_t steps = std::max(trees[0].chunks, trees[1].chunks) + lag;
  for (size_t j = 0; j < steps; ++j) {
    for (Tree& tree : trees) {
      if (j < tree.chunks) DDP_RETURN_IF_ERROR(up_step(tree, j));
    }
    for (Tree& tree : trees) {
      if (tree.node.parent < 0) continue;
      if (j >= lag && j - lag < tree.chunks) DDP_RETURN_IF_ERROR(down_step(tree, j - lag));
      DDP_RETURN_IF_ERROR(post_down(tree, j + depth, /*wait=*/false));
    }
  }
  return requests.WaitAll("tree all-reduce");
}

}  // namespace ddp::transport::algorithms
