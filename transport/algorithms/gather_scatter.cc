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
// there), then CheckArgs with the root's whole buffer on the root, and the
// check that every rank passed the same arguments.
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
  internal::CollectiveStart start;
  start.status = internal::CheckArgs(what, p2p, args, shape);
  if (!start.status.ok()) {
    start.finished = true;
    return start;
  }
  start.fingerprint = internal::MakeFingerprint(
      args, gather ? internal::kGatherKind : internal::kScatterKind, /*uses_op=*/false,
      /*uses_root=*/true);
  // Every rank proves that all the others agree before any data moves, as
  // the broadcast does (CheckEveryRank): checking its ring neighbours and
  // the root only, a rank whose own checks passed returned OK while a rank
  // elsewhere disagreed (a scatter's ranks took their blocks from the root
  // while a rank that took itself for the root failed). The root's check
  // costs ceil(log2 p) small messages instead of one from or to every rank.
  // A count of 0 is proven the same way (only these answer it).
  start.status = internal::CheckEveryRank(p2p, args.deadline, what, start.fingerprint,
                                          PhaseTag(args.tag, 0), args.call_id);
  if (!start.status.ok() || args.count == 0) {
    start.finished = true;
  } else if (p == 1) {
    start.finished = true;
    if (args.recv != args.send) std::memmove(args.recv, args.send, args.count * es);
  }
  return start;
}

}  // namespace

Status Gather(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  constexpr const char* kWhat = "gather";
  const internal::CollectiveStart start = StartRooted(p2p, args, /*gather=*/true);
  if (start.finished) return start.status;
  const int p = p2p.size(), r = p2p.rank();
  const size_t bytes = args.count * DataTypeSize(args.dtype);
  auto* recv = static_cast<unsigned char*>(args.recv);
  // This call's own data tag (CallDataBase): a block a failed call at this
  // tag sent, delivered although cancelled, is not taken as this one's.
  const p2p::Tag tag =
      internal::StepTag(PhaseTag(args.tag, 0), internal::CallDataBase(args.call_id));

  internal::Requests requests(p2p, args.deadline);
  if (r != args.root) {
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, true, args.root};
    DDP_RETURN_IF_ERROR(requests.Send(where, tag, args.send, bytes).status());
    return requests.WaitAll(kWhat);
  }
  std::vector<p2p::RequestId> ids;
  std::vector<int> from;
  for (int i = 1; i < p; ++i) {
    const int q = (r + i) % p;
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, false, q};
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId id,
                         requests.Recv(where, tag, recv + q * bytes, bytes));
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
  // This call's own data tag (CallDataBase): a block a failed call at this
  // tag sent, delivered although cancelled, is not taken as this one's.
  const p2p::Tag tag =
      internal::StepTag(PhaseTag(args.tag, 0), internal::CallDataBase(args.call_id));

  internal::Requests requests(p2p, args.deadline);
  if (r != args.root) {
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, false, args.root};
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId id,
                         requests.Recv(where, tag, args.recv, bytes));
    DDP_RETURN_IF_ERROR(requests.Wait(id, where));
    return requests.WaitAll(kWhat);
  }
  for (int i = 1; i < p; ++i) {
    const int q = (r + i) % p;
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, true, q};
    DDP_RETURN_IF_ERROR(
        requests.Send(where, tag, send + q * bytes, bytes).status());
  }
  if (args.recv != send + r * bytes) std::memcpy(args.recv, send + r * bytes, bytes);
  return requests.WaitAll(kWhat);
}

}  // namespace ddp::transport::algorithms
