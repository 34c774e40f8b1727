#include "transport/algorithms/barrier.h"

#include <array>

#include "transport/algorithms/pipeline.h"

namespace ddp::transport::algorithms {

Status Barrier(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  if (args.deadline == Deadline{}) return InvalidArgumentError("barrier: deadline is not set");
  if (args.tag > p2p::kMaxTag - (kTagsPerCollective - 1)) {
    return InvalidArgumentError("barrier: tag " + std::to_string(args.tag) +
                                " leaves no room for the collective's tag range");
  }
  DDP_RETURN_IF_ERROR(internal::CheckWorldSize("barrier", p2p));
  const int p = p2p.size(), r = p2p.rank();
  if (p == 1) return Status();
  const p2p::Tag tag = PhaseTag(args.tag, 0);
  int rounds = 0;
  while ((1 << rounds) < p) ++rounds;
  // One byte per round and direction; the value is the round, a cheap
  // sanity check that the rounds line up.
  std::array<unsigned char, 32> out{}, in{};
  internal::Requests requests(p2p, args.deadline);
  // Each rank checks its ring predecessor's fingerprint before round 0's
  // wait, as the other collectives do: a rank one collective out of step
  // (say, in a broadcast of one byte that happens to be 0 while this rank
  // is in a barrier) fails on both sides instead of passing for round 0.
  // A barrier has no count, dtype, op or root: only its kind is compared.
  internal::Fingerprint fingerprint;
  fingerprint.dtype = static_cast<int32_t>(DataType::kU8);
  fingerprint.op = -1;
  fingerprint.root = -1;
  fingerprint.kind = internal::kBarrierKind;
  internal::PeerCheck check("barrier", fingerprint);
  // A disagreement stops every rank of the barrier, as it stops a ring
  // (Requests::RelayStops): the rank that finds it tells its successor,
  // and each rank passes the note on. Without it only the rank after the
  // odd one failed, and the others waited for rounds that never came until
  // their deadline (5 ranks, rank 2 in a ring all-reduce: ranks 0, 1 and 4
  // timed out after 6 s); a note from a ring rank that found a barrier
  // rank among its neighbours now stops them too.
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  DDP_RETURN_IF_ERROR(requests.RelayStops("barrier", args.call_id, tag, prev, next));
  DDP_RETURN_IF_ERROR(check.Post(requests, tag, args.call_id, {next}, {prev}));
  // Each call's rounds at tags of its own (CallDataBase): a round of a
  // failed call that still reached its peer (a small send on UCX) would
  // stand in for that rank's round in the next call at this tag, and let
  // the peer leave a barrier the rank had not entered.
  const uint64_t base = internal::CallDataBase(args.call_id);
  for (int k = 0; k < rounds; ++k) {
    const int to = (r + (1 << k)) % p, from = (r - (1 << k) % p + p) % p;
    out[k] = static_cast<unsigned char>(k);
    internal::Where recv_where{"barrier", k, rounds, 0, false, from};
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId id,
                         requests.Recv(recv_where, internal::CallStepTag(tag, base, k), &in[k], 1));
    internal::Where send_where{"barrier", k, rounds, 0, true, to};
    DDP_RETURN_IF_ERROR(
        requests.Send(send_where, internal::CallStepTag(tag, base, k), &out[k], 1).status());
    DDP_RETURN_IF_ERROR(requests.Wait(id, recv_where));
    if (in[k] != k) {
      return InternalError("barrier round " + std::to_string(k) + ": rank " +
                           std::to_string(from) + " sent round " + std::to_string(in[k]));
    }
  }
  return requests.WaitAll("barrier");
}

}  // namespace ddp::transport::algorithms
