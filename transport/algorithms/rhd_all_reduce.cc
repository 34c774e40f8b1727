#include "transport/algorithms/rhd_all_reduce.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "transport/algorithms/pipeline.h"
#include "transport/reduce/reduce.h"

namespace ddp::transport::algorithms {
namespace {

constexpr size_t kRhdChunkBytes = 256 << 10;
constexpr int kRhdDepth = 4;
// Recursive doubling up to these sizes. On two ranks doubling sends the
// same bytes as halving-doubling in one exchange instead of two, and only
// the reduction grows (the whole vector instead of half): across two
// network namespaces over TCP, 64 KiB took 189 us against 277 us
// (docs/benchmarks.md). On more ranks each doubling step sends the whole
// vector, so it stays the choice for tiny messages only.
constexpr size_t kDefaultDoublingBytes = 8 << 10;
constexpr size_t kTwoRankDoublingBytes = 64 << 10;

// Step s's chunk c is message s * kStepMessages + c % kStepMessages of the
// call's data slot (CallDataBase), so that consecutive calls at one tag
// move data at different tags: a failed call's chunks, delivered although
// cancelled, are not taken by the next call. The slot holds 64 steps (0 to
// 62 are used, see unfold_step); chunk indices wrap within a step, far
// beyond the window of messages in flight (kMaxPipelineDepth).
constexpr uint64_t kStepMessages = internal::kCallDataSlotSteps / 64;
static_assert(kStepMessages > 2 * kMaxPipelineDepth);

int LargestPowerOfTwoAtMost(int p) {
  int b = 1;
  while (b * 2 <= p) b *= 2;
  return b;
}

}  // namespace

Status RhdAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  const internal::CollectiveStart start = internal::StartFlatAllReduce(p2p, args, internal::kRhdAllReduceKind);
  if (start.finished) return start.status;
  const int p = p2p.size(), r = p2p.rank();
  const size_t es = DataTypeSize(args.dtype);
  const auto* send = static_cast<const unsigned char*>(args.send);
  auto* recv = static_cast<unsigned char*>(args.recv);

  // Ranks below 2 * extra pair up (even hands to odd); the p2 remaining
  // ranks get new ranks 0..p2-1 in which the exchanges are a hypercube.
  const int p2 = LargestPowerOfTwoAtMost(p);
  const int extra = p - p2;
  const bool folded = r < 2 * extra && r % 2 == 0;
  const int nr = r < 2 * extra ? r / 2 : r - extra;
  auto real = [extra](int v) { return v < extra ? 2 * v + 1 : v + extra; };
  const size_t doubling_bytes = args.tuning.rhd_doubling_bytes != 0
                                    ? args.tuning.rhd_doubling_bytes
                                    : p == 2 ? kTwoRankDoublingBytes
                                             : kDefaultDoublingBytes;
  const bool doubling = args.count * es <= doubling_bytes;
  // The mode is compared with the arguments. Ranks whose tuning differs
  // (the contract says it must not) can take different modes for the same
  // call, and then their fingerprints agreed while their messages did not:
  // a halving rank waited for a fingerprint message from each step partner,
  // which a doubling partner sends in front of its data instead, and a
  // doubling rank took a halving partner's chunk as data of the wrong size
  // and waited for a stop note, both until their deadline. Now the ring
  // check sees two neighbours in different modes (there are some wherever
  // the exchanging ranks disagree; a folded rank is checked by its
  // partner), they fail at once naming both modes, and their stop notes
  // reach the others, which wait for those while nothing they need can
  // come: every rank compares a peer's fingerprint before it takes that
  // peer's data, so none uses data of the other mode, whatever its size.
  internal::Fingerprint fingerprint = start.fingerprint;
  if (doubling) fingerprint.kind = internal::kRhdDoublingAllReduceKind;
  // Doubling sends the working vector and reduces into it, so its send must
  // finish first: one message per step, no chunks (the vector is small).
  const size_t ce = doubling ? args.count : internal::ChunkElems(args, kRhdChunkBytes);
  const size_t depth = doubling ? 1 : static_cast<size_t>(internal::PipelineDepth(args, kRhdDepth));
  const size_t slot_elems = std::min(ce, args.count);
  // Doubling: a receive slot and a send stage, each with room for the
  // fingerprint in front of the vector (doubling_step).
  constexpr size_t kHeader = sizeof(internal::PackedFingerprint);
  const size_t doubling_message = kHeader + args.count * es;
  internal::Scratch scratch(doubling ? 2 * doubling_message : depth * slot_elems * es);
  const reduce::ReduceFn reduce_fn = reduce::GetReduceFn(args.dtype, args.op);
  const p2p::Tag tag = PhaseTag(args.tag, 0);
  const uint64_t base = internal::CallDataBase(args.call_id);
  auto chunk_tag = [&](int step, size_t c) {
    return internal::StepTag(tag, base + static_cast<uint64_t>(step) * kStepMessages +
                                      c % kStepMessages);
  };

  internal::Requests requests(p2p, args.deadline);
  // Fingerprints go around the ring of the p2 exchanging ranks, plus from
  // each handing-off rank to its partner: every rank is checked by an
  // exchanging rank before that one sends anything the others need. The
  // partner, rank r - 1, is awaited first: whichever flat all-reduce it
  // runs, it sends its fingerprint to rank r (the ring's and the tree's
  // successor, the fold's partner), while the ring predecessor here is a
  // rank that the ring and the tree never send to. So a rank whose count
  // took it to halving-doubling while the others run the ring fails at
  // once on its partner's fingerprint; it waited on the other one until
  // its deadline.
  //
  // An exchanging rank also compares the fingerprint of its partner of
  // every step, so that it never takes data from a rank whose arguments it
  // has not compared with its own. Without that, a rank whose step partner
  // passed another count failed on the data's size ("message size
  // mismatch: rank 5 sent 260 bytes but rank 4 expected 256") without
  // the other's count, and told the others only its own. The step partners
  // are awaited after the two above, so a rank running another algorithm
  // is still met first where it is. In halving mode that costs an
  // exchanging rank up to log2(p2) more small messages each way, one fewer
  // where a step partner is its ring neighbour (none on 2 or 3 ranks), all
  // posted before any data. In doubling mode (the small messages, where
  // those messages cost the most: rhd at 4 B on 4 ranks took 33-36 us
  // against 30-31 us without them) the fingerprint travels in front of the
  // step's vector instead, in the same message, to every partner other
  // than the ring successor (which has it already), and is compared before
  // the vector is used (doubling_step). A partner that passed another
  // count sends a message of another size, which carries nothing to read:
  // the rank then fails with the stop note of a ring check, which names
  // both values (Requests::WaitWithFingerprint).
  //
  // A disagreement one rank's check finds stops every rank: a stop note
  // goes around the exchanging ranks' ring, and each of those tells its
  // folded partner (Requests::RelayStops). Without it, only the ranks
  // checking the odd one failed, and their partners in later steps, and
  // the folded ones, waited for them until their deadline.
  internal::PeerCheck check("rhd all-reduce", fingerprint);
  const int next = real((nr + 1) % p2), prev = real((nr + p2 - 1) % p2);
  if (folded) {
    DDP_RETURN_IF_ERROR(requests.RelayStops("rhd all-reduce", args.call_id, tag, r + 1, -1, -1,
                                            /*from_partner=*/true));
    DDP_RETURN_IF_ERROR(check.Post(requests, tag, args.call_id, {r + 1}, {}));
  } else {
    const int partner = r < 2 * extra ? r - 1 : -1;
    DDP_RETURN_IF_ERROR(requests.RelayStops("rhd all-reduce", args.call_id, tag, prev, next, partner));
    std::vector<int> to = {next}, from;
    if (partner >= 0) from.push_back(partner);
    from.push_back(prev);
    // One fingerprint each way per pair: a step partner that is also a
    // ring neighbour is listed once.
    for (int mask = 1; mask < p2 && !doubling; mask *= 2) {
      const int peer = real(nr ^ mask);
      if (std::find(to.begin(), to.end(), peer) == to.end()) to.push_back(peer);
      if (std::find(from.begin(), from.end(), peer) == from.end()) from.push_back(peer);
    }
    DDP_RETURN_IF_ERROR(check.Post(requests, tag, args.call_id, to, from));
  }

  // One exchange with `peer` at `step`: send `send_n` elements from `out`,
  // receive `recv_n` elements into `in` (combined with what is there when
  // `combine`, through scratch slots), chunked with `depth` receives ahead.
  // Returns when both directions are done: partners move in lockstep.
  auto exchange = [&](const char* what, int step, int peer, const unsigned char* out,
                      size_t send_n, unsigned char* in, size_t recv_n, bool combine) -> Status {
    const size_t ks = internal::ChunkCount(send_n, ce), kr = internal::ChunkCount(recv_n, ce);
    std::vector<p2p::RequestId> recv_ids(depth, 0), send_ids(depth, 0);
    size_t next_send = 0, next_recv = 0;
    for (size_t m = 0; m < std::max(ks, kr); ++m) {
      while (next_recv < kr && next_recv < m + depth) {
        const size_t c = next_recv++;
        const size_t n = std::min(ce, recv_n - c * ce);
        unsigned char* dst = combine ? scratch.data() + (c % depth) * slot_elems * es
                                     : in + c * ce * es;
        internal::Where where{what, step, 0, c, false, peer};
        DDP_ASSIGN_OR_RETURN(recv_ids[c % depth], requests.Recv(where, chunk_tag(step, c), dst, n * es));
      }
      while (next_send < ks && next_send < m + depth) {
        const size_t c = next_send++;
        const size_t n = std::min(ce, send_n - c * ce);
        internal::Where where{what, step, 0, c, true, peer};
        DDP_ASSIGN_OR_RETURN(send_ids[c % depth], requests.Send(where, chunk_tag(step, c), out + c * ce * es, n * es));
      }
      if (m >= kr) {
        // Only sending (the fold's hand-off, the result handed back): no
        // receive paces the loop, so wait for this send before posting
        // beyond `depth` of them, or every chunk would be in flight at
        // once, held by the receiver as unexpected messages.
        internal::Where where{what, step, 0, m, true, peer};
        DDP_RETURN_IF_ERROR(requests.Wait(send_ids[m % depth], where));
        continue;
      }
      internal::Where where{what, step, 0, m, false, peer};
      DDP_RETURN_IF_ERROR(requests.Wait(recv_ids[m % depth], where));
      if (combine) {
        // Doubling reduces into the vector it is sending: wait for the send.
        if (doubling) DDP_RETURN_IF_ERROR(requests.WaitAllInStep(what));
        const size_t n = std::min(ce, recv_n - m * ce);
        unsigned char* mine = in + m * ce * es;
        const unsigned char* theirs = scratch.data() + (m % depth) * slot_elems * es;
        // Doubling: both partners reduce the same elements, so both put the
        // lower rank's first and get the same bits (max and min of +0 and
        // -0, or of two NaNs, depend on the order).
        if (doubling && peer < r) {
          reduce_fn(mine, theirs, mine, n);
        } else {
          reduce_fn(mine, mine, theirs, n);
        }
      }
    }
    return requests.WaitAllInStep(what);
  };

  // One step of doubling: the whole vector each way, reduced into it once
  // both have gone. The message starts with this rank's fingerprint unless
  // `peer` is the ring successor, which checks it apart; one from `peer`
  // starts with its fingerprint unless `peer` is the ring predecessor,
  // checked apart: compared before its vector is used.
  auto doubling_step = [&](int step, int peer) -> Status {
    const char* what = "rhd all-reduce, recursive doubling";
    const p2p::Tag step_tag = chunk_tag(step, 0);
    const size_t bytes = args.count * es;
    const bool send_header = peer != next, recv_header = peer != prev;
    unsigned char* slot = scratch.data();  // [fingerprint][vector]
    unsigned char* stage = scratch.data() + doubling_message;
    const internal::Where recv_where{what, step, 0, 0, false, peer};
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId recv_id,
                         requests.Recv(recv_where, step_tag, recv_header ? slot : slot + kHeader,
                                       recv_header ? doubling_message : bytes));
    const unsigned char* out = recv;
    if (send_header) {
      const internal::PackedFingerprint packed = internal::PackedFingerprint::Pack(fingerprint);
      std::memcpy(stage, &packed, kHeader);
      std::memcpy(stage + kHeader, recv, bytes);
      out = stage;
    }
    const internal::Where send_where{what, step, 0, 0, true, peer};
    DDP_RETURN_IF_ERROR(
        requests.Send(send_where, step_tag, out, send_header ? doubling_message : bytes).status());
    if (recv_header) {
      DDP_RETURN_IF_ERROR(requests.WaitWithFingerprint(recv_id, recv_where, slot));
    } else {
      DDP_RETURN_IF_ERROR(requests.Wait(recv_id, recv_where));
    }
    // Reduces into the vector it sent, and the next step refills the
    // stage: wait for the send.
    DDP_RETURN_IF_ERROR(requests.WaitAllInStep(what));
    const unsigned char* theirs = slot + kHeader;
    // Both partners reduce the same elements, so both put the lower rank's
    // first and get the same bits (max and min of +0 and -0, or of two
    // NaNs, depend on the order).
    if (peer < r) {
      reduce_fn(recv, theirs, recv, args.count);
    } else {
      reduce_fn(recv, recv, theirs, args.count);
    }
    return Status();
  };

  int step = 0;
  if (folded) {
    // Hand the vector to the partner, get the result back at the end.
    DDP_RETURN_IF_ERROR(exchange("rhd all-reduce, fold", step, r + 1, send, args.count,
                                 nullptr, 0, false));
  } else {
    if (recv != send) std::memcpy(recv, send, args.count * es);
    if (r < 2 * extra) {
      DDP_RETURN_IF_ERROR(exchange("rhd all-reduce, fold", step, r - 1, nullptr, 0, recv,
                                   args.count, true));
    }
  }
  ++step;

  if (!folded) {
    if (doubling) {
      for (int mask = 1; mask < p2; mask *= 2, ++step) {
        DDP_RETURN_IF_ERROR(doubling_step(step, real(nr ^ mask)));
      }
      if (args.op == ReduceOp::kAvg) reduce::DivideInPlace(args.dtype, recv, args.count, p);
    } else {
      // Recursive halving: keep the half of the current block range on this
      // rank's side of the split, send the other half, reduce the partner's
      // copy of the kept half. Ends owning block nr.
      const internal::BlockLayout layout{args.count, p2};
      int lo = 0, hi = p2;
      auto at = [&](int block) { return recv + layout.offset(block) * es; };
      auto span = [&](int a, int b) { return layout.offset(b) - layout.offset(a); };
      for (int mask = p2 / 2; mask >= 1; mask /= 2, ++step) {
        const int mid = (lo + hi) / 2;
        const bool upper = (nr & mask) != 0;
        const int keep_lo = upper ? mid : lo, keep_hi = upper ? hi : mid;
        const int give_lo = upper ? lo : mid, give_hi = upper ? mid : hi;
        DDP_RETURN_IF_ERROR(exchange("rhd all-reduce, halving", step, real(nr ^ mask),
                                     at(give_lo), span(give_lo, give_hi), at(keep_lo),
                                     span(keep_lo, keep_hi), true));
        lo = keep_lo;
        hi = keep_hi;
      }
      if (args.op == ReduceOp::kAvg) {
        reduce::DivideInPlace(args.dtype, at(nr), layout.size(nr), p);
      }
      // Recursive doubling of the owned range back to the whole vector.
      for (int mask = 1; mask < p2; mask *= 2, ++step) {
        const bool upper = (nr & mask) != 0;
        const int other_lo = upper ? lo - mask : hi, other_hi = upper ? lo : hi + mask;
        DDP_RETURN_IF_ERROR(exchange("rhd all-reduce, doubling", step, real(nr ^ mask), at(lo),
                                     span(lo, hi), at(other_lo), span(other_lo, other_hi),
                                     false));
        lo = std::min(lo, other_lo);
        hi = std::max(hi, other_hi);
      }
    }
  }

  // The step index of the hand-back must agree on both sides of a pair,
  // so it is fixed rather than counted: 62, past any step of 2^31 ranks,
  // and the last that kStepMessages leaves room for in the call's slot.
  const int unfold_step = 62;
  if (r < 2 * extra) {
    if (folded) {
      DDP_RETURN_IF_ERROR(exchange("rhd all-reduce, hand-back", unfold_step, r + 1, nullptr, 0,
                                   recv, args.count, false));
    } else {
      DDP_RETURN_IF_ERROR(exchange("rhd all-reduce, hand-back", unfold_step, r - 1, recv,
                                   args.count, nullptr, 0, false));
    }
  }
  return requests.WaitAll("rhd all-reduce");
}

}  // namespace ddp::transport::algorithms
