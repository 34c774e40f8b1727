#include "transport/algorithms/pipeline.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "transport/p2p/group_view.h"

namespace ddp::transport::algorithms::internal {
namespace {

bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

}  // namespace

Status CheckWorldSize(std::string_view collective, const p2p::PointToPoint& p2p) {
  if (p2p.size() <= kMaxWorldSize) return Status();
  return InvalidArgumentError(std::string(collective) + ": world size " +
                              std::to_string(p2p.size()) + " exceeds the limit of " +
                              std::to_string(kMaxWorldSize) + " ranks");
}

Status CheckArgs(std::string_view collective, const p2p::PointToPoint& p2p,
                 const CollectiveArgs& args, const BufferShape& shape) {
  DDP_RETURN_IF_ERROR(CheckWorldSize(collective, p2p));
  const std::string name(collective);
  auto invalid = [&](const std::string& why) { return InvalidArgumentError(name + ": " + why); };
  if (args.deadline == Deadline{}) return invalid("deadline is not set");
  const size_t es = DataTypeSize(args.dtype);
  if (es == 0) {
    return invalid("dtype " + std::to_string(static_cast<int>(args.dtype)) +
                   " is not a valid DataType");
  }
  if (shape.uses_op && std::string_view(ReduceOpName(args.op)) == "unknown") {
    return invalid("op " + std::to_string(static_cast<int>(args.op)) +
                   " is not a valid ReduceOp");
  }
  if (shape.uses_root && (args.root < 0 || args.root >= p2p.size())) {
    return invalid("root " + std::to_string(args.root) + " is outside [0, " +
                   std::to_string(p2p.size()) + ")");
  }
  if (args.tag > p2p::kMaxTag - (kTagsPerCollective - 1)) {
    return invalid("tag " + std::to_string(args.tag) +
                   " leaves no room for the collective's tag range");
  }
  if (args.tuning.pipeline_depth < 0 || args.tuning.pipeline_depth > kMaxPipelineDepth) {
    return invalid("tuning.pipeline_depth " + std::to_string(args.tuning.pipeline_depth) +
                   " is outside [0, " + std::to_string(kMaxPipelineDepth) + "]");
  }
  const size_t limit = std::numeric_limits<size_t>::max() / es;
  if (shape.send_elems > limit || shape.recv_elems > limit) {
    return invalid("count " + std::to_string(args.count) + " of " + DataTypeName(args.dtype) +
                   " overflows the address space");
  }
  if (shape.needs_send && shape.send_elems > 0 && args.send == nullptr) {
    return invalid("send buffer is null with count " + std::to_string(args.count));
  }
  if (shape.recv_elems > 0 && args.recv == nullptr) {
    return invalid("recv buffer is null with count " + std::to_string(args.count));
  }
  // The reduction kernels read elements as their type: buffers must be
  // aligned to the element size (any allocator's memory is).
  auto misaligned = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % es != 0; };
  if (shape.needs_send && shape.send_elems > 0 && misaligned(args.send)) {
    return invalid("send buffer is not aligned to the " + std::to_string(es) + "-byte size of " +
                   DataTypeName(args.dtype));
  }
  if (shape.recv_elems > 0 && misaligned(args.recv)) {
    return invalid("recv buffer is not aligned to the " + std::to_string(es) + "-byte size of " +
                   DataTypeName(args.dtype));
  }
  if (shape.needs_send && shape.recv_alias_offset != -2 &&
      Overlaps(args.send, shape.send_elems * es, args.recv, shape.recv_elems * es)) {
    const auto* send = static_cast<const unsigned char*>(args.send);
    const bool allowed =
        shape.recv_alias_offset == -1
            ? args.recv == args.send
            : args.recv == send + shape.recv_alias_offset;
    if (!allowed) {
      return invalid(shape.recv_alias_offset == -1
                         ? "send and recv buffers partially overlap (in-place needs send == recv)"
                         : "recv overlaps send other than at this rank's block (in-place needs "
                           "recv == send + rank * count)");
    }
  }
  return Status();
}

Status CheckBlockOwner(std::string_view collective, const p2p::PointToPoint& p2p,
                       const CollectiveArgs& args) {
  DDP_RETURN_IF_ERROR(CheckWorldSize(collective, p2p));
  const std::vector<int>* owner = args.tuning.block_owner;
  if (owner == nullptr) return Status();
  const int p = p2p.size();
  const std::string name(collective);
  if (owner->size() != static_cast<size_t>(p)) {
    return InvalidArgumentError(name + ": tuning.block_owner has " +
                                std::to_string(owner->size()) + " entries for " +
                                std::to_string(p) + " ranks");
  }
  std::vector<int> listed_at(p, -1);
  for (int b = 0; b < p; ++b) {
    const int q = (*owner)[b];
    if (q < 0 || q >= p) {
      return InvalidArgumentError(name + ": tuning.block_owner[" + std::to_string(b) + "] is " +
                                  std::to_string(q) + ", outside [0, " + std::to_string(p) + ")");
    }
    if (listed_at[q] >= 0) {
      return InvalidArgumentError(name + ": tuning.block_owner lists rank " + std::to_string(q) +
                                  " twice (entries " + std::to_string(listed_at[q]) + " and " +
                                  std::to_string(b) + ")");
    }
    listed_at[q] = b;
  }
  return Status();
}

size_t ChunkElems(const CollectiveArgs& args, size_t default_bytes) {
  const size_t bytes = args.tuning.chunk_bytes != 0 ? args.tuning.chunk_bytes : default_bytes;
  return std::max<size_t>(1, bytes / DataTypeSize(args.dtype));
}

int PipelineDepth(const CollectiveArgs& args, int fallback) {
  return args.tuning.pipeline_depth > 0 ? args.tuning.pipeline_depth : fallback;
}

std::string DescribePeer(const p2p::PointToPoint& p2p, int peer) {
  if (const auto* view = dynamic_cast<const p2p::GroupView*>(&p2p)) {
    if (peer >= 0 && peer < view->size()) {
      // Down through every level of views to the rank that the transport
      // underneath, and so its own errors, name.
      int rank = view->ParentRank(peer);
      const p2p::PointToPoint* below = &view->parent();
      while (const auto* lower = dynamic_cast<const p2p::GroupView*>(below)) {
        rank = lower->ParentRank(rank);
        below = &lower->parent();
      }
      return "group rank " + std::to_string(peer) + " (rank " + std::to_string(rank) + ")";
    }
  }
  return "rank " + std::to_string(peer);
}

int BaseRank(const p2p::PointToPoint& p2p, int rank) {
  const p2p::PointToPoint* level = &p2p;
  while (const auto* view = dynamic_cast<const p2p::GroupView*>(level)) {
    if (rank < 0 || rank >= view->size()) return -1;
    rank = view->ParentRank(rank);
    level = &view->parent();
  }
  return rank;
}

int ViewRank(const p2p::PointToPoint& p2p, int base) {
  if (dynamic_cast<const p2p::GroupView*>(&p2p) == nullptr) return base;
  // Error paths only: a search over the view's ranks.
  for (int r = 0; r < p2p.size(); ++r) {
    if (BaseRank(p2p, r) == base) return r;
  }
  return -1;
}

std::string DescribeBaseRank(const p2p::PointToPoint& p2p, int base) {
  const int rank = ViewRank(p2p, base);
  return rank >= 0 ? DescribePeer(p2p, rank) : "rank " + std::to_string(base);
}

Status Annotate(const Status& status, std::string_view context) {
  if (status.ok()) return status;
  return Status(status.code(), std::string(context) + ": " + status.message());
}

std::string Describe(const p2p::PointToPoint& p2p, const Where& where) {
  std::string s = where.what;
  if (where.steps > 0) {
    s += " step " + std::to_string(where.step + 1) + "/" + std::to_string(where.steps);
  }
  if (where.chunk != Where::kNoChunk) s += " chunk " + std::to_string(where.chunk);
  s += ": ";
  s += where.is_send ? "send to " : "receive from ";
  s += DescribePeer(p2p, where.peer);
  return s;
}

namespace {
const char* KindName(int32_t kind) {
  switch (kind) {
    case kRingAllReduceKind: return "ring all-reduce";
    case kTreeAllReduceKind: return "tree all-reduce";
    case kRhdAllReduceKind:
    case kRhdDoublingAllReduceKind: return "rhd all-reduce";
    case kHierarchicalAllReduceKind: return "hierarchical all-reduce";
    case kReduceScatterKind: return "reduce-scatter";
    case kAllGatherKind: return "all-gather";
    case kBroadcastKind: return "broadcast";
    case kBarrierKind: return "barrier";
    case kDirectExchangeKind: return "direct exchange";
    case kTreeReduceKind: return "tree reduce";
    case kRingReduceKind: return "ring reduce";
    case kGatherKind: return "gather";
    case kScatterKind: return "scatter";
  }
  return "unknown collective";
}

bool IsRhdKind(int32_t kind) {
  return kind == kRhdAllReduceKind || kind == kRhdDoublingAllReduceKind;
}

// What a disagreement between `theirs` and `mine` adds when only the
// halving-doubling mode tells them apart: the same call, so the cause is
// the tuning, which the fingerprints do not carry.
std::string ModeHint(const Fingerprint& theirs, const Fingerprint& mine) {
  Fingerprint same_kind = theirs;
  same_kind.kind = mine.kind;
  if (theirs.kind == mine.kind || !IsRhdKind(theirs.kind) || !IsRhdKind(mine.kind) ||
      !(same_kind == mine)) {
    return "";
  }
  return " (the same call in the other mode: tuning.rhd_doubling_bytes differs between them, "
         "and must be equal on every rank)";
}
}  // namespace

Fingerprint MakeFingerprint(const CollectiveArgs& args, FingerprintKind kind, bool uses_op,
                            bool uses_root) {
  Fingerprint f;
  f.count = args.count;
  f.dtype = static_cast<int32_t>(args.dtype);
  f.op = uses_op ? static_cast<int32_t>(args.tuning.checked_op.value_or(args.op)) : -1;
  f.root = uses_root ? args.tuning.checked_root.value_or(args.root) : -1;
  f.kind = kind;
  f.whole_count = args.tuning.checked_whole_count.value_or(args.count);
  return f;
}

std::string Fingerprint::ToString() const {
  if (kind == kBarrierKind) return KindName(kind);  // no count, dtype, op or root
  std::string s = std::string(KindName(kind)) + ", count " + std::to_string(count) + " of " +
                  DataTypeName(static_cast<DataType>(dtype));
  if (op >= 0) s += std::string(", op ") + ReduceOpName(static_cast<ReduceOp>(op));
  if (root >= 0) s += ", root " + std::to_string(root);
  if (whole_count != count) s += ", a step of a call with count " + std::to_string(whole_count);
  // A call with count 0 moves nothing and has no mode (it is never sent
  // as kRhdDoublingAllReduceKind).
  if (IsRhdKind(kind) && count != 0) {
    s += kind == kRhdDoublingAllReduceKind ? ", in recursive-doubling mode"
                                           : ", in halving-doubling mode";
  }
  return s;
}

Status PeerCheck::Post(Requests& requests, p2p::Tag phase_tag, uint64_t call_id,
                       const std::vector<int>& to, const std::vector<int>& from) {
  const p2p::Tag tag = FingerprintTag(phase_tag, call_id);
  from_ = from;
  Fingerprint* held = requests.Hold<Fingerprint>(1 + from_.size());
  held[0] = mine_;
  sent_ = held;
  theirs_ = held + 1;
  ids_.assign(from_.size(), 0);
  for (size_t i = 0; i < from_.size(); ++i) {
    Where where{what_.c_str(), 0, 0, Where::kNoChunk, false, from_[i]};
    DDP_ASSIGN_OR_RETURN(ids_[i], requests.Recv(where, tag, theirs_ + i, sizeof(Fingerprint)));
  }
  for (int peer : to) {
    Where where{what_.c_str(), 0, 0, Where::kNoChunk, true, peer};
    DDP_RETURN_IF_ERROR(requests.Send(where, tag, sent_, sizeof(Fingerprint)).status());
  }
  requests.check_ = this;
  return Status();
}

Status PeerCheck::Verify(Requests& requests) {
  if (verified_) return Status();
  verified_ = true;
  for (size_t i = 0; i < from_.size(); ++i) {
    Where where{what_.c_str(), 0, 0, Where::kNoChunk, false, from_[i], /*check_message=*/true};
    DDP_RETURN_IF_ERROR(requests.Wait(ids_[i], where));
    DDP_RETURN_IF_ERROR(Compare(requests.p2p(), i));
  }
  return Status();
}

Status PeerCheck::VerifyAsTheyArrive(Requests& requests) {
  if (verified_) return Status();
  verified_ = true;
  std::vector<p2p::RequestId> pending = ids_;
  std::vector<size_t> index(ids_.size());
  for (size_t i = 0; i < index.size(); ++i) index[i] = i;
  while (!pending.empty()) {
    StatusOr<size_t> got = requests.p2p().WaitAny(pending, requests.deadline());
    if (!got.ok()) return Annotate(got.status(), what_ + ": waiting for the peers' arguments");
    const size_t i = index[*got];
    requests.Forget(pending[*got]);
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(*got));
    index.erase(index.begin() + static_cast<std::ptrdiff_t>(*got));
    DDP_RETURN_IF_ERROR(Compare(requests.p2p(), i));
  }
  return Status();
}

Status PeerCheck::Compare(const p2p::PointToPoint& p2p, size_t i) {
  return CompareWith(p2p, from_[i], theirs_[i]);
}

Status PeerCheck::CompareWith(const p2p::PointToPoint& p2p, int peer, const Fingerprint& theirs) {
  if (theirs == mine_) return Status();
  if (differing_peer_ < 0) {
    differing_kind_ = theirs.kind;
    differing_peer_ = peer;
    differing_ = theirs;
  }
  return InvalidArgumentError(what_ + ": ranks disagree on the arguments: " +
                              DescribePeer(p2p, peer) + " passed " + theirs.ToString() + " but " +
                              DescribePeer(p2p, p2p.rank()) + " passed " + mine_.ToString() +
                              ModeHint(theirs, mine_));
}

Status CheckEmptyCall(p2p::PointToPoint& p2p, Deadline deadline, const char* what,
                      const Fingerprint& mine, const std::vector<CheckRound>& rounds,
                      uint64_t call_id) {
  PeerCheck compare(what, mine);  // only for its comparison and its error text
  const std::string check = std::string(what) + ", argument check";
  Requests requests(p2p, deadline);
  size_t expected = 0;
  std::vector<int> everyone;  // the peers of every round, once each
  std::vector<size_t> from_each;  // per peer of `everyone`: its fingerprints not yet here
  const CheckRound* first = nullptr;
  for (const CheckRound& round : rounds) {
    if (round.peers.empty()) continue;
    if (first == nullptr) first = &round;
    expected += round.peers.size();
    for (int peer : round.peers) {
      const auto at = std::find(everyone.begin(), everyone.end(), peer);
      if (at == everyone.end()) {
        everyone.push_back(peer);
        from_each.push_back(1);
      } else {
        ++from_each[static_cast<size_t>(at - everyone.begin())];
      }
    }
  }
  if (first == nullptr) return Status();
  // Message buffers live in `requests`, so they outlast its cancellations.
  Fingerprint* held = requests.Hold<Fingerprint>(1 + expected);
  held[0] = mine;
  // What is awaited, by position in `ids`: a peer's fingerprint or, with a
  // call id, its stop note (note set).
  struct Awaited {
    int peer = 0;
    Fingerprint* fingerprint = nullptr;
    Requests::StopNote* note = nullptr;
  };
  std::vector<p2p::RequestId> ids;
  std::vector<Awaited> awaited;
  ids.reserve(expected + everyone.size());
  awaited.reserve(expected + everyone.size());
  Fingerprint* theirs = held + 1;
  for (const CheckRound& round : rounds) {
    const p2p::Tag tag = FingerprintTag(round.phase_tag, call_id);
    for (int peer : round.peers) {
      Where where{check.c_str(), 0, 0, Where::kNoChunk, false, peer};
      DDP_ASSIGN_OR_RETURN(const p2p::RequestId id,
                           requests.Recv(where, tag, theirs, sizeof(Fingerprint)));
      ids.push_back(id);
      awaited.push_back({peer, theirs++, nullptr});
    }
  }
  // A rank that finds a disagreement returns at once, and its return
  // cancels its fingerprint sends: a peer that had not taken them yet (it
  // entered the call later) would wait for its deadline. So the finder
  // also tells every peer in a notice, which outlasts its return; with no
  // call id a note left unread by an earlier call could not be told apart,
  // and the check stays without them. The tag is the one a ring rank of
  // the same call listens to (StopNoteTag of the first phase), so that a
  // rank which passed a count other than 0 hears of it too, and a note
  // from such a rank stops this one. Costs the agreeing call one receive
  // per peer, posted and cancelled.
  const p2p::Tag stop_tag = StopNoteTag(first->phase_tag, call_id);
  Requests::StopNote* notes = nullptr;
  if (call_id != 0) {
    notes = requests.Hold<Requests::StopNote>(everyone.size());
    for (size_t i = 0; i < everyone.size(); ++i) {
      Where where{check.c_str(), 0, 0, Where::kNoChunk, false, everyone[i]};
      DDP_ASSIGN_OR_RETURN(const p2p::RequestId id,
                           requests.Recv(where, stop_tag, &notes[i], sizeof(Requests::StopNote)));
      requests.p2p().MarkWatched(id);  // a peer that agrees and leaves sends none
      ids.push_back(id);
      awaited.push_back({everyone[i], nullptr, &notes[i]});
    }
  }
  for (const CheckRound& round : rounds) {
    const p2p::Tag tag = FingerprintTag(round.phase_tag, call_id);
    for (int peer : round.peers) {
      Where where{check.c_str(), 0, 0, Where::kNoChunk, true, peer};
      DDP_RETURN_IF_ERROR(requests.Send(where, tag, &held[0], sizeof(Fingerprint)).status());
    }
  }
  auto tell_everyone = [&](int their_rank, const Fingerprint& their_fingerprint) {
    Requests::StopNote* note = requests.Hold<Requests::StopNote>(1);
    note->theirs = their_fingerprint;
    note->finders = mine;
    note->their_rank = BaseRank(p2p, their_rank);
    note->finder = BaseRank(p2p, p2p.rank());
    note->call_id = call_id;
    for (int peer : everyone) {
      // A plain send when the transport refuses the notice (UCX with
      // notices to that peer still in flight): it reaches a peer already
      // waiting, and is cancelled with the rest as this rank returns.
      if (p2p.PostNotice(peer, stop_tag, note, sizeof(*note)).ok()) continue;
      Where where{check.c_str(), 0, 0, Where::kNoChunk, true, peer};
      requests.Send(where, stop_tag, note, sizeof(*note)).status().IgnoreError();
    }
  };
  // A note that `sender` sent: from a finder of this empty call, or from a
  // ring rank of the same call that passed another count.
  auto note_error = [&](int sender, const Requests::StopNote& note) {
    const int finder = static_cast<int>(note.finder);
    const std::string how = BaseRank(p2p, sender) == finder
                                ? "told this rank"
                                : DescribePeer(p2p, sender) + " passed that on";
    if (note.theirs.kind == 0) {
      return InvalidArgumentError(
          check + ": " + DescribeBaseRank(p2p, finder) + " received data from " +
          DescribeBaseRank(p2p, static_cast<int>(note.their_rank)) +
          " that did not match its own arguments (" + note.finders.ToString() +
          "), so ranks disagree on the arguments, and " + how);
    }
    return InvalidArgumentError(check + ": " + DescribeBaseRank(p2p, finder) +
                                " found that ranks disagree on the arguments, and " + how + ": " +
                                DescribeBaseRank(p2p, static_cast<int>(note.their_rank)) +
                                " passed " + note.theirs.ToString() + " but " +
                                DescribeBaseRank(p2p, finder) + " passed " +
                                note.finders.ToString() +
                                ModeHint(note.theirs, note.finders));
  };
  // In the order they arrive, so that the first disagreement fails at once
  // even while some peer has not sent (it may run another collective, or
  // have returned).
  size_t fingerprints_left = expected;
  while (fingerprints_left > 0) {
    StatusOr<size_t> got = p2p.WaitAny(ids, deadline);
    if (!got.ok()) return Annotate(got.status(), check + ": waiting for the peers' arguments");
    const size_t i = *got;
    const Awaited done = awaited[i];
    requests.Forget(ids[i]);
    if (done.note != nullptr) {
      if (done.note->call_id != call_id) {
        // Left unread by an earlier call at this tag (notices outlast
        // their call), or from a call kStopNoteTags ahead: not this one's.
        Where where{check.c_str(), 0, 0, Where::kNoChunk, false, done.peer};
        StatusOr<p2p::RequestId> again =
            requests.Recv(where, stop_tag, done.note, sizeof(Requests::StopNote));
        if (!again.ok() && again.status().code() == StatusCode::kPeerLost) {
          // That peer has left: no note of this call can come from it.
          ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(i));
          awaited.erase(awaited.begin() + static_cast<std::ptrdiff_t>(i));
          continue;
        }
        DDP_ASSIGN_OR_RETURN(ids[i], std::move(again));
        requests.p2p().MarkWatched(ids[i]);
        continue;
      }
      return note_error(done.peer, *done.note);
    }
    ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(i));
    awaited.erase(awaited.begin() + static_cast<std::ptrdiff_t>(i));
    --fingerprints_left;
    Status differs = compare.CompareWith(p2p, done.peer, *done.fingerprint);
    if (!differs.ok()) {
      if (call_id != 0) tell_everyone(done.peer, *done.fingerprint);
      return differs;
    }
    // A peer whose every fingerprint agreed with this rank's has nothing to
    // tell it: a disagreement it finds is with a rank that disagrees with
    // this one too, whose fingerprint or note comes here. Its note's
    // receive is given up, so that the peer may return and close its
    // endpoints (a failed endpoint fails every wait on it) while this rank
    // still waits for a slower one.
    const size_t k = static_cast<size_t>(std::find(everyone.begin(), everyone.end(), done.peer) - everyone.begin());
    if (--from_each[k] == 0) {
      for (size_t j = 0; j < awaited.size(); ++j) {
        if (awaited[j].note == nullptr || awaited[j].peer != done.peer) continue;
        const p2p::RequestId id = ids[j];
        requests.Forget(id);
        p2p.CancelAll(std::span<const p2p::RequestId>(&id, 1));
        ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(j));
        awaited.erase(awaited.begin() + static_cast<std::ptrdiff_t>(j));
        break;
      }
    }
  }
  // Every fingerprint agreed with this rank's, and every caller's first
  // round reaches all the other ranks, so no rank of this collective has a
  // note to send: the notes' receives (all that is left in `ids`) are
  // given up.
  if (!ids.empty()) {
    for (p2p::RequestId id : ids) requests.Forget(id);
    p2p.CancelAll(ids);
  }
  return requests.WaitAll(what);
}

namespace {

// What a rank of CheckEveryRank knows of the ranks it has heard from,
// directly or through others: the fingerprint they all passed (`rank` is
// one of them), or, once two of them differ, both (other_rank >= 0). The
// ranks are numbered as BaseRank does, as a stop note's are: a note may
// name a rank outside the view that runs the check. Sent as raw bytes: no
// padding.
struct Verdict {
  Fingerprint fingerprint;
  int64_t rank = 0;
  Fingerprint other;
  int64_t other_rank = -1;

  bool agrees() const { return other_rank < 0; }
};
static_assert(sizeof(Verdict) == 2 * sizeof(Fingerprint) + 2 * sizeof(int64_t));

// `mine` widened by what `theirs` knows. A disagreement already found is
// kept: any one proves the call wrong.
void Merge(Verdict& mine, const Verdict& theirs) {
  if (!mine.agrees()) return;
  if (!theirs.agrees()) {
    mine = theirs;
  } else if (!(theirs.fingerprint == mine.fingerprint)) {
    mine.other = mine.fingerprint;
    mine.other_rank = mine.rank;
    mine.fingerprint = theirs.fingerprint;
    mine.rank = theirs.rank;
  }
}

}  // namespace

Status CheckEveryRank(p2p::PointToPoint& p2p, Deadline deadline, const char* what,
                      const Fingerprint& mine, p2p::Tag phase_tag, uint64_t call_id) {
  const int p = p2p.size(), r = p2p.rank();
  if (p == 1) return Status();
  int rounds = 0;
  while ((int64_t{1} << rounds) < p) ++rounds;
  auto peer_at = [&](int64_t offset) { return static_cast<int>(((r + offset) % p + p) % p); };
  const std::string check = std::string(what) + ", argument check";
  const p2p::Tag tag = FingerprintTag(phase_tag, call_id);
  Requests requests(p2p, deadline);
  // Message buffers live in `requests`, so they outlast its cancellations.
  Fingerprint* plain = requests.Hold<Fingerprint>(2);  // [0] sent, [1] received in round 0
  Verdict* sent = requests.Hold<Verdict>(rounds);
  Verdict* got = requests.Hold<Verdict>(rounds);
  plain[0] = mine;
  // Stop notes from the ring predecessor, at the tag every ring rank of
  // the same call listens to (see the disagreement with a rank of another
  // collective below), watched by every wait. Only with a call id: a note
  // of an earlier call could not be told apart without one.
  if (call_id != 0) {
    DDP_RETURN_IF_ERROR(requests.RelayStops(check.c_str(), call_id, phase_tag, peer_at(-1),
                                            peer_at(1)));
  }
  std::vector<p2p::RequestId> recv_ids(rounds);
  for (int k = 0; k < rounds; ++k) {
    const int from = peer_at(-(int64_t{1} << k));
    Where where{check.c_str(), k, rounds, Where::kNoChunk, false, from};
    if (k == 0) {
      DDP_ASSIGN_OR_RETURN(recv_ids[k], requests.Recv(where, tag, &plain[1], sizeof(Fingerprint)));
    } else {
      DDP_ASSIGN_OR_RETURN(recv_ids[k], requests.Recv(where, tag + 1, &got[k], sizeof(Verdict)));
    }
  }
  p2p::RequestId first_send = 0;
  {
    Where where{check.c_str(), 0, rounds, Where::kNoChunk, true, peer_at(1)};
    DDP_ASSIGN_OR_RETURN(first_send, requests.Send(where, tag, &plain[0], sizeof(Fingerprint)));
  }
  Verdict state;
  state.fingerprint = mine;
  state.rank = BaseRank(p2p, r);
  auto disagreement = [&] {
    return InvalidArgumentError(check + ": ranks disagree on the arguments: " +
                                DescribeBaseRank(p2p, static_cast<int>(state.rank)) + " passed " +
                                state.fingerprint.ToString() + " but " +
                                DescribeBaseRank(p2p, static_cast<int>(state.other_rank)) +
                                " passed " + state.other.ToString());
  };
  // Once a disagreement is known it is the cause: a wait that fails after
  // it (a peer running another collective never sends the later rounds,
  // and fails, or has the job aborted) reports the disagreement.
  //
  // A stop note (from a rank of this check, or a ring rank of the same
  // call, that found a disagreement) ends the wait for round k without its
  // message. What it names joins this rank's verdict, and round k is taken
  // later with the other unmerged rounds, as its sender waits for that: a
  // rank that returned on the note left the rounds it had not sent, and
  // cancelled those it had, and ranks that waited for them reached their
  // deadline. A note with no verdict to tell (a ring rank's data of
  // another size, kind 0) is the error as it is.
  bool noted = false;
  auto wait = [&](int k) -> Status {
    const int from = peer_at(-(int64_t{1} << k));
    Status status =
        requests.Wait(recv_ids[k], Where{check.c_str(), k, rounds, Where::kNoChunk, false, from,
                                         /*check_message=*/true});
    if (!status.ok() && !noted && requests.took_stop_note() &&
        requests.stop_got_->theirs.kind != 0) {
      noted = true;
      Verdict told;
      told.fingerprint = requests.stop_got_->theirs;
      told.rank = requests.stop_got_->their_rank;
      told.other = requests.stop_got_->finders;
      told.other_rank = requests.stop_got_->finder;
      Merge(state, told);
      return Status();
    }
    if (!status.ok() && !state.agrees()) return disagreement();
    return status;
  };
  // Round k's message is merged before round k + 1 is sent, until a
  // disagreement is known: from then on the rounds go out at once.
  std::vector<int> unmerged;
  for (int k = 0; k < rounds; ++k) {
    if (k > 0) {
      sent[k] = state;
      Where where{check.c_str(), k, rounds, Where::kNoChunk, true, peer_at(int64_t{1} << k)};
      DDP_RETURN_IF_ERROR(requests.Send(where, tag + 1, &sent[k], sizeof(Verdict)).status());
    }
    if (!state.agrees()) {
      unmerged.push_back(k);
      continue;
    }
    DDP_RETURN_IF_ERROR(wait(k));
    if (noted) {  // round k's message is still to come
      unmerged.push_back(k);
      continue;
    }
    if (k == 0) {
      Verdict theirs;
      theirs.fingerprint = plain[1];
      theirs.rank = BaseRank(p2p, peer_at(-1));
      Merge(state, theirs);
    } else {
      Merge(state, got[k]);
    }
  }
  // A rank of a collective that takes no part in the later rounds (a
  // barrier, a ring all-reduce) neither sends nor takes them: with one
  // known to be in the call, the rounds still outstanding may never end, so
  // this rank fails as soon as its round 0 is taken. Waiting for them held
  // a broadcast rank among barrier ranks until its deadline, though it
  // knew the verdict after round 0. Round 0 is the fingerprint that the
  // successor's own argument check takes, whatever collective it runs (as
  // a ring neighbour's PeerCheck): given up, the successor would wait for
  // it until its deadline. The later rounds already sent reach the peers
  // that have posted their receives (every rank of this check posts them
  // all as it enters).
  //
  // A rank whose own rounds all agree may still wait for a round from such
  // a rank (rank 1 of broadcast ranks 0 to 2 waits for rank 3's second
  // round, a ring all-reduce rank), with nobody left to tell it: it waited
  // until its deadline. So this rank also sends the disagreement on around
  // the ring as a stop note (Requests::RelayStops), which every rank of the
  // call watches while it waits and passes on as it fails.
  if (!state.agrees() &&
      (!TakesPartInEveryRankRounds(state.fingerprint.kind) ||
       !TakesPartInEveryRankRounds(state.other.kind))) {
    Requests::StopNote note;
    // One of the two differs from this rank's own.
    const bool first_differs = !(state.fingerprint == mine);
    note.theirs = first_differs ? state.fingerprint : state.other;
    note.their_rank = first_differs ? state.rank : state.other_rank;
    note.finders = mine;
    note.finder = BaseRank(p2p, r);
    // Not when a note told this rank: it has passed that one on.
    if (call_id != 0 && !requests.took_stop_note()) {
      requests.SendStopNote(note).IgnoreError();  // not waited for (RelayStops)
    }
    requests.Wait(first_send, Where{check.c_str(), 0, rounds, Where::kNoChunk, true, peer_at(1)})
        .IgnoreError();  // the disagreement is the cause either way
    return disagreement();
  }
  // Otherwise every rank known runs the rounds: the rest are taken all
  // the same, as their senders wait for that.
  for (int k : unmerged) DDP_RETURN_IF_ERROR(wait(k));
  Status sends = requests.WaitAll(check.c_str());
  if (!state.agrees()) return disagreement();
  return sends;
}

bool ChecksEveryRank(int32_t kind) {
  return kind == kBroadcastKind || kind == kGatherKind || kind == kScatterKind ||
         kind == kTreeReduceKind;
}

bool TakesPartInEveryRankRounds(int32_t kind) {
  return ChecksEveryRank(kind) || kind == kRingReduceKind;
}

Status PostEveryRankRounds(Requests& requests, const char* what, const Fingerprint& mine,
                           p2p::Tag phase_tag, uint64_t call_id) {
  p2p::PointToPoint& p2p = requests.p2p();
  const int p = p2p.size(), r = p2p.rank();
  int rounds = 0;
  while ((int64_t{1} << rounds) < p) ++rounds;
  if (rounds == 0) return Status();
  auto peer_at = [&](int64_t offset) { return static_cast<int>(((r + offset) % p + p) % p); };
  const std::string check = std::string(what) + ", argument check";
  const p2p::Tag tag = FingerprintTag(phase_tag, call_id);
  Fingerprint* plain = requests.Hold<Fingerprint>(1);
  Verdict* sent = requests.Hold<Verdict>(1);
  Verdict* got = requests.Hold<Verdict>(rounds);
  *plain = mine;
  sent->fingerprint = mine;
  sent->rank = BaseRank(p2p, r);
  for (int k = 1; k < rounds; ++k) {
    Where where{check.c_str(), k, rounds, Where::kNoChunk, false, peer_at(-(int64_t{1} << k))};
    DDP_RETURN_IF_ERROR(requests.Recv(where, tag + 1, &got[k], sizeof(Verdict)).status());
  }
  {
    Where where{check.c_str(), 0, rounds, Where::kNoChunk, true, peer_at(1)};
    DDP_RETURN_IF_ERROR(requests.Send(where, tag, plain, sizeof(Fingerprint)).status());
  }
  for (int k = 1; k < rounds; ++k) {
    Where where{check.c_str(), k, rounds, Where::kNoChunk, true, peer_at(int64_t{1} << k)};
    DDP_RETURN_IF_ERROR(requests.Send(where, tag + 1, sent, sizeof(Verdict)).status());
  }
  return Status();
}

std::vector<int> OtherRanks(const p2p::PointToPoint& p2p) {
  std::vector<int> others;
  for (int q = 0; q < p2p.size(); ++q) {
    if (q != p2p.rank()) others.push_back(q);
  }
  return others;
}

CollectiveStart StartCollective(p2p::PointToPoint& p2p, const CollectiveArgs& args,
                                FingerprintKind kind, const BufferShape& shape) {
  const char* what = KindName(kind);
  CollectiveStart start;
  start.status = CheckArgs(what, p2p, args, shape);
  if (!start.status.ok()) {
    start.finished = true;
    return start;
  }
  start.fingerprint = MakeFingerprint(args, kind, shape.uses_op, shape.uses_root);
  if (args.count == 0) {
    start.finished = true;
    start.status = CheckEmptyCall(p2p, args.deadline, what, start.fingerprint,
                                  {{PhaseTag(args.tag, 0), OtherRanks(p2p)}}, args.call_id);
  } else if (p2p.size() == 1) {
    start.finished = true;
    if (args.recv != args.send) {
      std::memmove(args.recv, args.send, shape.recv_elems * DataTypeSize(args.dtype));
    }
  }
  return start;
}

CollectiveStart StartFlatAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args,
                                   FingerprintKind kind) {
  BufferShape shape;
  shape.send_elems = args.count;
  shape.recv_elems = args.count;
  shape.uses_op = true;
  return StartCollective(p2p, args, kind, shape);
}

namespace {
struct ScratchBlock {
  std::unique_ptr<unsigned char[]> buffer;
  size_t size = 0;
  bool in_use = false;
};
thread_local ScratchBlock scratch_arena[2];

// How many times a Requests of this thread ended with requests its
// PointToPoint could not confirm it let go of.
thread_local uint64_t unconfirmed_releases = 0;

// Blocks a late receive may still write into: kept, never freed, for the
// rest of the process (deliberately leaked, also at exit).
struct QuarantineList {
  std::mutex mutex;
  std::vector<std::unique_ptr<unsigned char[]>> blocks;
  std::vector<std::deque<std::vector<std::max_align_t>>> messages;  // Requests' held_
  size_t bytes = 0;
};
QuarantineList& TheQuarantine() {
  static QuarantineList* const quarantine = new QuarantineList;
  return *quarantine;
}
void QuarantineBlock(std::unique_ptr<unsigned char[]> block, size_t bytes) {
  QuarantineList& q = TheQuarantine();
  std::lock_guard<std::mutex> lock(q.mutex);
  q.blocks.push_back(std::move(block));
  q.bytes += bytes;
}
void QuarantineMessages(std::deque<std::vector<std::max_align_t>> held) {
  size_t bytes = 0;
  for (const auto& v : held) bytes += v.size() * sizeof(std::max_align_t);
  QuarantineList& q = TheQuarantine();
  std::lock_guard<std::mutex> lock(q.mutex);
  q.messages.push_back(std::move(held));  // a move: the vectors' memory stays put
  q.bytes += bytes;
}
}  // namespace

ScratchQuarantine ScratchQuarantined() {
  QuarantineList& q = TheQuarantine();
  std::lock_guard<std::mutex> lock(q.mutex);
  return ScratchQuarantine{q.blocks.size(), q.bytes};
}

Scratch::Scratch(size_t bytes) : unconfirmed_at_start_(unconfirmed_releases) {
  ScratchBlock* block = nullptr;
  if (bytes <= kScratchRetainBytes) {
    for (ScratchBlock& b : scratch_arena) {
      if (!b.in_use) {
        block = &b;
        break;
      }
    }
  }
  if (block == nullptr) {
    own_.reset(new unsigned char[std::max<size_t>(bytes, 1)]);
    own_bytes_ = std::max<size_t>(bytes, 1);
    data_ = own_.get();
    return;
  }
  if (block->size < bytes || block->buffer == nullptr) {
    block->buffer.reset();  // free first: the peak is the new size, not both
    block->size = 0;        // until the new block is there (new may throw)
    block->buffer.reset(new unsigned char[std::max<size_t>(bytes, 1)]);
    block->size = std::max<size_t>(bytes, 1);
  }
  block->in_use = true;
  arena_block_ = block;
  data_ = block->buffer.get();
}

Scratch::~Scratch() {
  const bool unconfirmed = unconfirmed_releases != unconfirmed_at_start_;
  if (arena_block_ == nullptr) {
    if (unconfirmed) QuarantineBlock(std::move(own_), own_bytes_);
    return;
  }
  auto* block = static_cast<ScratchBlock*>(arena_block_);
  if (unconfirmed) {
    // Out of the arena: the next call gets fresh memory, and a later grow
    // cannot free this block under a late write.
    QuarantineBlock(std::move(block->buffer), block->size);
    block->size = 0;
  }
  block->in_use = false;
}

size_t ScratchRetainedBytes() {
  size_t total = 0;
  for (const ScratchBlock& b : scratch_arena) total += b.size;
  return total;
}

Requests::~Requests() {
  // All at once: cancelling one by one could wait a grace period and a
  // forced close per peer (UCX), far past the deadline when many are hung.
  if (!outstanding_.empty()) p2p_.CancelAll(outstanding_);
  // Also counts what a failed Wait or WaitAll gave up inside the PointToPoint.
  if (p2p_.UnconfirmedReleases() != unconfirmed_at_start_) {
    ++unconfirmed_releases;
    // The argument checks' messages may be among them.
    if (!held_.empty()) QuarantineMessages(std::move(held_));
  }
}

void* Requests::HoldBytes(size_t bytes) {
  const size_t unit = sizeof(std::max_align_t);
  return held_.emplace_back(std::max<size_t>(1, (bytes + unit - 1) / unit)).data();
}

void Requests::Track(p2p::RequestId id) {
  position_[id] = outstanding_.size();
  outstanding_.push_back(id);
}

void Requests::Forget(p2p::RequestId id) {
  auto it = position_.find(id);
  if (it == position_.end()) return;
  const size_t i = it->second;
  position_.erase(it);
  if (i + 1 != outstanding_.size()) {
    outstanding_[i] = outstanding_.back();
    position_[outstanding_[i]] = i;
  }
  outstanding_.pop_back();
}

StatusOr<p2p::RequestId> Requests::Send(const Where& where, p2p::Tag tag, const void* data,
                                        size_t bytes) {
  auto id = p2p_.PostSend(where.peer, tag, data, bytes);
  if (!id.ok()) return Annotate(id.status(), Describe(p2p_, where));
  Track(*id);
  return *id;
}

StatusOr<p2p::RequestId> Requests::Recv(const Where& where, p2p::Tag tag, void* data,
                                        size_t bytes) {
  auto id = p2p_.PostRecv(where.peer, tag, data, bytes);
  if (!id.ok()) return Annotate(id.status(), Describe(p2p_, where));
  Track(*id);
  return *id;
}

Status Requests::RelayStops(const char* what, uint64_t call_id, p2p::Tag phase_tag, int from,
                            int to, int leaf, bool from_partner) {
  relay_what_ = what;
  call_id_ = call_id;
  relay_from_ = from;
  relay_from_partner_ = from_partner;
  relay_to_ = to;
  relay_leaf_ = leaf;
  stop_tag_ = StopNoteTag(phase_tag, call_id);
  stop_got_ = Hold<StopNote>(1);
  Where where{what, 0, 0, Where::kNoChunk, false, from};
  DDP_ASSIGN_OR_RETURN(stop_recv_, Recv(where, stop_tag_, stop_got_, sizeof(StopNote)));
  // Watched, not awaited: a predecessor that agreed may finish its part
  // and leave while this rank still waits for data from another peer.
  p2p_.MarkWatched(stop_recv_);
  return Status();
}

Status Requests::SendStopNote(const StopNote& note) {
  StopNote* held = Hold<StopNote>(1);
  *held = note;
  held->call_id = call_id_;
  // A notice outlasts this rank's return, which cancels a plain send still
  // waiting for its receive; the plain send stays for calls without an id
  // (a note from an earlier call could not be told apart) and for a
  // transport that refuses the notice (UCX with notices to that rank still
  // in flight).
  auto post = [&](int to) -> Status {
    if (call_id_ != 0 && p2p_.PostNotice(to, stop_tag_, held, sizeof(StopNote)).ok()) {
      return Status();
    }
    Where where{relay_what_, 0, 0, Where::kNoChunk, true, to};
    StatusOr<p2p::RequestId> id = Send(where, stop_tag_, held, sizeof(StopNote));
    if (id.ok()) note_sends_.push_back(*id);
    return id.status();
  };
  // Not to the finder, which has failed, nor from the finder to the rank
  // that differs when that is its successor, which checks the finder itself
  // (two ranks on the ring). Passed on, a note does go to the rank that
  // differs: its own checks may all agree (its predecessor passed what it
  // did, and a halving-doubling step partner in the other mode never sends
  // it a fingerprint message of its own), and it waited for its deadline.
  const int finder = ViewRank(p2p_, static_cast<int>(note.finder));
  const int their_rank = ViewRank(p2p_, static_cast<int>(note.their_rank));
  const bool checks_finder = finder == p2p_.rank() && relay_to_ == their_rank;
  if (relay_to_ >= 0 && relay_to_ != finder && !checks_finder) {
    DDP_RETURN_IF_ERROR(post(relay_to_));
  }
  if (relay_leaf_ >= 0 && relay_leaf_ != finder) DDP_RETURN_IF_ERROR(post(relay_leaf_));
  return Status();
}

Status Requests::VerifyFirst() {
  if (check_ == nullptr || check_->verified()) return Status();
  Status status = check_->Verify(*this);
  if (!status.ok() && stop_got_ != nullptr && check_->differing_peer() >= 0) {
    StopNote note;
    note.theirs = check_->differing();
    note.finders = check_->mine();
    note.their_rank = BaseRank(p2p_, check_->differing_peer());
    note.finder = BaseRank(p2p_, p2p_.rank());
    // Not waited for (RelayStops); the check's own error is the one to report.
    SendStopNote(note).IgnoreError();
  }
  return status;
}

Status Requests::WaitOrStop(p2p::RequestId id, bool* request_failed) {
  if (request_failed != nullptr) *request_failed = false;
  while (stop_recv_ != 0) {
    // The request first: a deadline names it.
    const p2p::RequestId both[2] = {id, stop_recv_};
    StatusOr<size_t> got = p2p_.WaitAny(both, deadline_);
    // On error WaitAny releases the failed request only; the destructor's
    // CancelAll skips released ids, so both stay listed.
    if (!got.ok()) {
      if (request_failed != nullptr) *request_failed = true;
      return got.status();
    }
    if (*got == 0) {
      Forget(id);
      return Status();
    }
    Forget(stop_recv_);
    stop_recv_ = 0;
    DDP_ASSIGN_OR_RETURN(const bool ours, TakeNote());
    if (ours) return StopNoteError();
  }
  // The note's sender has left (TakeNote): the request alone.
  const p2p::RequestId one[1] = {id};
  Status status = p2p_.WaitAll(one, deadline_);
  Forget(id);  // released by WaitAll either way
  if (!status.ok() && request_failed != nullptr) *request_failed = true;
  return status;
}

StatusOr<bool> Requests::TakeNote() {
  if (stop_got_->call_id == call_id_) return true;
  // Left unread by an earlier call at the same tag (notices outlast their
  // call), or sent by a rank kStopNoteTags calls ahead (StopNoteTag): not
  // this call's business.
  Where where{relay_what_, 0, 0, Where::kNoChunk, false, relay_from_};
  StatusOr<p2p::RequestId> again = Recv(where, stop_tag_, stop_got_, sizeof(StopNote));
  if (!again.ok() && again.status().code() == StatusCode::kPeerLost) {
    // The note's sender has left (it may have finished its part of this
    // call): no note of this call can come, and the data wait goes on
    // without one, as a watched receive's lost peer promises.
    stop_recv_ = 0;
    return false;
  }
  DDP_ASSIGN_OR_RETURN(stop_recv_, std::move(again));
  p2p_.MarkWatched(stop_recv_);
  return false;
}

Status Requests::StopNoteError() {
  const StopNote note = *stop_got_;
  stopped_by_kind_ = note.theirs.kind;
  took_stop_note_ = true;
  SendStopNote(note).IgnoreError();  // not waited for (RelayStops)
  const int finder = static_cast<int>(note.finder);  // BaseRank's numbering
  // Who told this rank: the finder itself, or a rank that passed it on.
  const std::string role =
      relay_from_partner_ ? "halving-doubling partner" : "ring predecessor";
  const bool from_finder = BaseRank(p2p_, relay_from_) == finder;
  const std::string who = DescribeBaseRank(p2p_, finder) +
                          (from_finder ? ", this rank's " + role + "," : std::string());
  const std::string how = from_finder ? "told this rank"
                                      : "this rank's " + role + " " +
                                            DescribePeer(p2p_, relay_from_) + " passed that on";
  if (note.theirs.kind == 0) {
    return InvalidArgumentError(
        who + " received data from " +
        DescribeBaseRank(p2p_, static_cast<int>(note.their_rank)) +
        " that did not match its own arguments (" + note.finders.ToString() +
        ", or its tuning.chunk_bytes, which must be equal on every rank too), so ranks "
        "disagree on the arguments, and " + how);
  }
  return InvalidArgumentError(who + " found that ranks disagree on the arguments, and " + how +
                              ": " + DescribeBaseRank(p2p_, static_cast<int>(note.their_rank)) +
                              " passed " + note.theirs.ToString() + " but " +
                              DescribeBaseRank(p2p_, finder) + " passed " +
                              note.finders.ToString() +
                              ModeHint(note.theirs, note.finders));
}

namespace {
// Whether a receive failed for a message of another size, in the words of
// the transports (p2p/loopback.cc's matching, ucx/ucx_p2p.cc's SlotStatus),
// not for another INVALID_ARGUMENT (an unknown or released request id, one
// listed twice).
bool IsSizeMismatch(const Status& status) {
  if (status.code() != StatusCode::kInvalidArgument) return false;
  const std::string& message = status.message();
  return message.find("message size mismatch") != std::string::npos ||
         message.find("counts differ across ranks") != std::string::npos;
}

// What a data receive failing for a message of another size adds to its
// error. The argument check compares count and dtype but not the tuning:
// ranks that pass another tuning.chunk_bytes cut the data into messages of
// other sizes, and the size error alone named nothing that differed. The
// argument check's own messages (`where.check_message`) have fixed sizes,
// which no count or tuning changes.
Status WithSizeHint(const Status& status, const Where& where) {
  if (where.is_send || where.check_message || !IsSizeMismatch(status)) return status;
  return Status(status.code(), status.message() +
                                   " (the peer passed another count or dtype, or another "
                                   "tuning.chunk_bytes, which must be equal on every rank too)");
}
}  // namespace

Status Requests::Wait(p2p::RequestId id, const Where& where) {
  DDP_RETURN_IF_ERROR(VerifyFirst());
  if (stop_recv_ != 0) {
    bool request_failed = false;
    Status status = WaitOrStop(id, &request_failed);
    if (status.ok()) return status;
    // Only a message of another size tells of the peer's arguments; another
    // INVALID_ARGUMENT of the request (an id the transport does not know,
    // one listed twice) is this rank's own fault, and a note naming the
    // peer as the one whose data did not fit sent the others a wrong cause.
    const bool size_mismatch = request_failed && IsSizeMismatch(status);
    if (request_failed) status = WithSizeHint(status, where);
    if (size_mismatch && !where.is_send && check_ != nullptr) {
      // Data that does not fit (another count) from a peer this rank does
      // not check: a rank that does check it stops the others, but its
      // note would end here, as this rank returns. So this rank stops them
      // itself, with what it knows: the peer, and its own arguments.
      StopNote note;
      note.finders = check_->mine();
      note.their_rank = BaseRank(p2p_, where.peer);
      note.finder = BaseRank(p2p_, p2p_.rank());
      SendStopNote(note).IgnoreError();  // not waited for (RelayStops)
    }
    return Annotate(status, Describe(p2p_, where));
  }
  const p2p::RequestId one[1] = {id};
  Status status = p2p_.WaitAll(one, deadline_);
  Forget(id);  // released by WaitAll either way
  status = WithSizeHint(status, where);
  return Annotate(status, Describe(p2p_, where));
}

Status Requests::WaitWithFingerprint(p2p::RequestId id, const Where& where,
                                     const void* header) {
  DDP_RETURN_IF_ERROR(VerifyFirst());
  auto unpack = [header] {
    PackedFingerprint packed;
    std::memcpy(&packed, header, sizeof(packed));
    return packed.Unpack();
  };
  Fingerprint theirs;
  if (stop_recv_ == 0 || check_ == nullptr) {
    // A note already ended this rank's part (the caller returned on it), or
    // the caller broke the contract: compare what came, with no note.
    DDP_RETURN_IF_ERROR(Wait(id, where));
    if (check_ == nullptr) return Status();
    theirs = unpack();
    return Annotate(check_->CompareWith(p2p_, where.peer, theirs), Describe(p2p_, where));
  }
  bool request_failed = false;
  Status status = WaitOrStop(id, &request_failed);
  if (status.ok()) {
    theirs = unpack();
    Status differs = check_->CompareWith(p2p_, where.peer, theirs);
    if (!differs.ok()) {
      StopNote note;
      note.theirs = theirs;
      note.finders = check_->mine();
      note.their_rank = BaseRank(p2p_, where.peer);
      note.finder = BaseRank(p2p_, p2p_.rank());
      SendStopNote(note).IgnoreError();  // not waited for (RelayStops)
    }
    return Annotate(differs, Describe(p2p_, where));
  }
  // A note, a lost peer, the deadline or a request the transport refused
  // (not a message of another size): as it is.
  if (!request_failed || !IsSizeMismatch(status)) {
    return Annotate(status, Describe(p2p_, where));
  }
  // Another size: the peer passed another count or dtype, which some ring
  // check finds (the ring covers every exchanging rank, so some neighbours
  // differ); its note names both values. Before the fingerprint rode with
  // the data, this rank had the peer's own message and named both itself.
  StatusOr<size_t> got = InternalError("no wait for a note");
  while (true) {
    if (stop_recv_ == 0) {
      got = PeerLostError("the note's sender " + DescribePeer(p2p_, relay_from_) + " has left");
      break;
    }
    const p2p::RequestId note_only[1] = {stop_recv_};
    got = p2p_.WaitAny(note_only, deadline_);
    if (!got.ok()) break;
    Forget(stop_recv_);
    stop_recv_ = 0;
    StatusOr<bool> ours = TakeNote();
    if (!ours.ok()) return Annotate(ours.status(), Describe(p2p_, where));
    if (*ours) return StopNoteError();
  }
  // No note by the deadline: say what is known, and tell the others that.
  StopNote note;
  note.finders = check_->mine();
  note.their_rank = BaseRank(p2p_, where.peer);
  note.finder = BaseRank(p2p_, p2p_.rank());
  SendStopNote(note).IgnoreError();  // not waited for (RelayStops)
  return Status(status.code(), Describe(p2p_, where) + ": " + status.message() +
                                   "; no rank's note named that peer's arguments (" +
                                   got.status().message() + ")");
}

StatusOr<bool> Requests::Test(p2p::RequestId id, const Where& where) {
  auto done = p2p_.Test(id);
  if (!done.ok()) {
    Forget(id);
    return Annotate(done.status(), Describe(p2p_, where));
  }
  if (*done) Forget(id);
  return *done;
}

Status Requests::WaitAllInStep(const char* what) {
  if (stop_recv_ == 0) return WaitAll(what);
  DDP_RETURN_IF_ERROR(VerifyFirst());
  std::vector<p2p::RequestId> pending;
  pending.reserve(outstanding_.size());
  for (p2p::RequestId id : outstanding_) {
    if (id != stop_recv_) pending.push_back(id);
  }
  // One by one, each with the note (a WaitAny of two per request): a
  // WaitAny of them all at once would search them all on every return.
  for (p2p::RequestId id : pending) {
    Status status = WaitOrStop(id);
    if (!status.ok()) return Annotate(status, std::string(what) + ": completing sends");
  }
  return Status();
}

Status Requests::WaitAll(const char* what) {
  DDP_RETURN_IF_ERROR(VerifyFirst());
  if (stop_recv_ != 0) {
    // This rank has all its data, which passed every other rank after that
    // rank's check (or came straight from the predecessor, checked here):
    // no note can come any more.
    Forget(stop_recv_);
    p2p_.Cancel(stop_recv_);
    stop_recv_ = 0;
  }
  // Notes passed on as plain sends are not waited for (RelayStops): their
  // receiver may have finished, or failed, without taking them, and a
  // rank that goes on after passing one (CheckEveryRank) waited for it
  // until its deadline.
  for (p2p::RequestId id : note_sends_) {
    if (position_.count(id) == 0) continue;
    Forget(id);
    p2p_.Cancel(id);
  }
  note_sends_.clear();
  if (outstanding_.empty()) return Status();
  std::vector<p2p::RequestId> all;
  all.swap(outstanding_);
  position_.clear();
  return Annotate(p2p_.WaitAll(all, deadline_), std::string(what) + ": completing sends");
}

}  // namespace ddp::transport::algorithms::internal
