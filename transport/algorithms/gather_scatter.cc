#include "transport/algorithms/gather_scatter.h"

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "transport/algorithms/pipeline.h"

namespace ddp::transport::algorithms {
namespace {

// How both begin: the block count fits, the root's send either is its
// block of recv or lies outside recv (gather; CheckArgs allows any overlap
// there), then StartCollective with the root's whole buffer on the root.
internal::CollectiveStart StartRooted(p2p::PointToPoint& p2p, const CollectiveArgs& args,
                                      bool gather) {
  const char* what = gather ? "gather" : "scatter";
  const int p = p2p.size();
  const bool is_root = p2p.rank() == args.root;
  internal::CollectiveStart refused;
  refused.finished = true;
  if (args.count > std::numeric_limits<size_t>::max() / p) {
    refused.status = InvalidArgumentError(std::string(what) + ": count " +
                                          std::to_string(args.count) + " times " +
                                          std::to_string(p) + " ranks overflows");
    return refused;
  }
  const size_t es = DataTypeSize(args.dtype);
  // The root's buffer of size() blocks, on every rank: the others' own
  // block may fit while the root's buffer does not, and then only the root
  // refused while they waited for it (and the root's overlap check below
  // would compute with wrapped sums). A bad dtype (es 0) CheckArgs names.
  if (es != 0 && args.count * p > std::numeric_limits<size_t>::max() / es) {
    refused.status = InvalidArgumentError(std::string(what) + ": count " +
                                          std::to_string(args.count) + " of " +
                                          DataTypeName(args.dtype) + " times " +
                                          std::to_string(p) +
                                          " ranks overflows the address space");
    return refused;
  }
  if (gather && is_root && args.count > 0 && args.send != nullptr && args.recv != nullptr) {
    const auto send = reinterpret_cast<uintptr_t>(args.send);
    const auto recv = reinterpret_cast<uintptr_t>(args.recv);
    const uintptr_t own = recv + args.root * args.count * es;
    if (send != own && send < recv + p * args.count * es && recv < send + args.count * es) {
      refused.status = InvalidArgumentError(
          "gather: send overlaps recv other than at the root's block (in-place needs send == "
          "recv + root * count)");
      return refused;
    }
  }
  internal::BufferShape shape;
  shape.uses_root = true;
  if (gather) {
    shape.send_elems = args.count;
    shape.recv_elems = is_root ? args.count * p : 0;
    shape.recv_alias_offset = -2;  // checked above
  } else {
    shape.send_elems = is_root ? args.count * p : 0;
    shape.needs_send = is_root;
    shape.recv_elems = args.count;
    shape.recv_alias_offset = is_root ? static_cast<int64_t>(args.root * args.count * es) : -1;
  }
  return internal::StartCollective(p2p, args, gather ? internal::kGatherKind : internal::kScatterKind,
                                   shape);
}

// Whom rank r sends its fingerprint to, and whom it takes one from: its
// ring neighbours, and besides the root and the ranks whose data it takes
// or gives (gather: every rank sends one to the root; scatter: the root
// sends one to every rank). Each rank's data then comes from, or goes to,
// a rank whose arguments it has seen.
std::vector<int> RootedCheckTo(int p, int r, int root, bool gather) {
  const int next = (r + 1) % p;
  std::vector<int> to = {next};
  if (gather && r != root && next != root) to.push_back(root);
  if (!gather && r == root) {
    for (int q = 0; q < p; ++q) {
      if (q != r && q != next) to.push_back(q);
    }
  }
  return to;
}

std::vector<int> RootedCheckFrom(int p, int r, int root, bool gather) {
  const int prev = (r + p - 1) % p;
  std::vector<int> from = {prev};
  if (gather && r == root) {
    for (int q = 0; q < p; ++q) {
      if (q != r && q != prev) from.push_back(q);
    }
  }
  if (!gather && r != root && prev != root) from.push_back(root);
  return from;
}

}  // namespace

Status Gather(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  constexpr const char* kWhat = "gather";
  const internal::CollectiveStart start = StartRooted(p2p, args, /*gather=*/true);
  if (start.finished) return start.status;
  const int p = p2p.size(), r = p2p.rank();
  const size_t bytes = args.count * DataTypeSize(args.dtype);
  auto* recv = static_cast<unsigned char*>(args.recv);
  const p2p::Tag tag = PhaseTag(args.tag, 0);

  internal::Requests requests(p2p, args.deadline);
  internal::PeerCheck check(kWhat, start.fingerprint);
  // The ring check, and every sender's fingerprint to the root: checking
  // only its predecessor, the root took the blocks of a rank further round
  // the ring that passed another dtype of the same size and returned OK.
  DDP_RETURN_IF_ERROR(check.Post(requests, tag, RootedCheckTo(p, r, args.root, /*gather=*/true),
                                 RootedCheckFrom(p, r, args.root, /*gather=*/true)));
  if (r != args.root) {
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, true, args.root};
    DDP_RETURN_IF_ERROR(requests.Send(where, internal::StepTag(tag, 0), args.send, bytes).status());
    return requests.WaitAll(kWhat);
  }
  std::vector<p2p::RequestId> ids;
  std::vector<int> from;
  for (int i = 1; i < p; ++i) {
    const int q = (r + i) % p;
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, false, q};
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId id,
                         requests.Recv(where, internal::StepTag(tag, 0), recv + q * bytes, bytes));
    ids.push_back(id);
    from.push_back(q);
  }
  // The own block while the others arrive.
  if (recv + r * bytes != args.send) std::memcpy(recv + r * bytes, args.send, bytes);
  for (size_t i = 0; i < ids.size(); ++i) {
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, false, from[i]};
    DDP_RETURN_IF_ERROR(requests.Wait(ids[i], where));
  }
  return requests.WaitAll(kWhat);
}

Status Scatter(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  constexpr const char* kWhat = "scatter";
  const internal::CollectiveStart start = StartRooted(p2p, args, /*gather=*/false);
  if (start.finished) return start.status;
  const int p = p2p.size(), r = p2p.rank();
  const size_t bytes = args.count * DataTypeSize(args.dtype);
  const auto* send = static_cast<const unsigned char*>(args.send);
  const p2p::Tag tag = PhaseTag(args.tag, 0);

  internal::Requests requests(p2p, args.deadline);
  internal::PeerCheck check(kWhat, start.fingerprint);
  // The ring check, and the root's fingerprint to every rank: checking only
  // their predecessors, the ranks took blocks from a root that passed
  // another dtype of the same size and returned OK.
  DDP_RETURN_IF_ERROR(check.Post(requests, tag, RootedCheckTo(p, r, args.root, /*gather=*/false),
                                 RootedCheckFrom(p, r, args.root, /*gather=*/false)));
  if (r != args.root) {
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, false, args.root};
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId id,
                         requests.Recv(where, internal::StepTag(tag, 0), args.recv, bytes));
    DDP_RETURN_IF_ERROR(requests.Wait(id, where));
    return requests.WaitAll(kWhat);
  }
  for (int i = 1; i < p; ++i) {
    const int q = (r + i) % p;
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, true, q};
    DDP_RETURN_IF_ERROR(
        requests.Send(where, internal::StepTag(tag, 0), send + q * bytes, bytes).status());
  }
  if (args.recv != send + r * bytes) std::memcpy(args.recv, send + r * bytes, bytes);
  return requests.WaitAll(kWhat);
}

}  // namespace ddp::transport::algorithms
