#ifndef DDP_TRANSPORT_ALGORITHMS_PIPELINE_H_
#define DDP_TRANSPORT_ALGORITHMS_PIPELINE_H_

// Helpers shared by the algorithm implementations (private to this package):
// argument checks, the block/chunk arithmetic, and a tracker of outstanding
// requests that cancels them on every error path.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::algorithms::internal {

/// What a collective's buffers must look like, for CheckArgs.
struct BufferShape {
  size_t send_elems = 0;      ///< Elements read from args.send.
  size_t recv_elems = 0;      ///< Elements written to args.recv.
  bool uses_root = false;     ///< Whether args.root must be a valid rank.
  bool uses_op = false;       ///< Whether args.op matters.
  bool needs_send = true;     ///< Whether args.send is read on this rank.
  /// recv may alias send only at this byte offset into send (-1: recv must
  /// equal send or not overlap it; -2: any overlap is fine).
  int64_t recv_alias_offset = -1;
};

/// INVALID_ARGUMENT naming the collective, p2p.size() and kMaxWorldSize
/// when the world is larger than the algorithms' rank arithmetic allows.
Status CheckWorldSize(std::string_view collective, const p2p::PointToPoint& p2p);

/// INVALID_ARGUMENT naming the collective and the argument at fault, or OK.
/// Includes CheckWorldSize.
Status CheckArgs(std::string_view collective, const p2p::PointToPoint& p2p,
                 const CollectiveArgs& args, const BufferShape& shape);

/// INVALID_ARGUMENT naming the entry at fault when args.tuning.block_owner
/// is set but is not a permutation of [0, p2p.size()) (one entry per rank,
/// each rank once), or OK. BlockLayout indexes it by rank and places blocks
/// by its values, so anything else reads past it or lays two blocks over
/// one another. Includes CheckWorldSize (it runs before CheckArgs).
Status CheckBlockOwner(std::string_view collective, const p2p::PointToPoint& p2p,
                       const CollectiveArgs& args);

/// `count` split into `blocks` nearly equal parts (the first count % blocks
/// parts one element longer), as every ring and tree algorithm splits data.
/// With `place`, block b is the part numbered place[b] (a ring view's rank
/// b holding the block of the job's rank place[b]).
struct BlockLayout {
  size_t count = 0;
  int blocks = 1;
  const std::vector<int>* place = nullptr;
  size_t offset(int b) const {
    const int at = place != nullptr ? (*place)[b] : b;
    const size_t base = count / blocks, rem = count % blocks;
    return at * base + std::min<size_t>(at, rem);
  }
  size_t size(int b) const {
    const int at = place != nullptr ? (*place)[b] : b;
    const size_t base = count / blocks, rem = count % blocks;
    return base + (static_cast<size_t>(at) < rem ? 1 : 0);
  }
};

/// Elements per chunk: args.tuning.chunk_bytes (or `default_bytes`) rounded
/// down to whole elements, at least one.
size_t ChunkElems(const CollectiveArgs& args, size_t default_bytes);
/// Chunks of `chunk_elems` (> 0) covering `n` elements: ceil(n / chunk_elems),
/// without the (n + chunk_elems - 1) that wraps to a count of 0 when
/// chunk_elems is near SIZE_MAX (tuning.chunk_bytes = SIZE_MAX with u8).
inline size_t ChunkCount(size_t n, size_t chunk_elems) {
  return n / chunk_elems + (n % chunk_elems != 0 ? 1 : 0);
}
/// Receives to keep posted ahead: args.tuning.pipeline_depth or `fallback`.
int PipelineDepth(const CollectiveArgs& args, int fallback);

/// Calls that take turns on a phase's data tags (CallDataBase) and on its
/// argument check's tags (FingerprintTag): calls this many apart share them.
inline constexpr uint64_t kCallDataSlots = 16;
/// Tags of one call's argument check in a phase: the fingerprint, the later
/// rounds of CheckEveryRank and DirectExchange's block sizes.
inline constexpr uint64_t kCheckTagsPerCall = 3;
/// Tags the stop notes of a phase take turns on, one per call (StopNoteTag).
inline constexpr uint64_t kStopNoteTags = 16;

/// Data messages of a phase use step tags [0, kDataSteps); the rest of the
/// phase's 2^kStepTagBits tags carry the argument checks of kCallDataSlots
/// calls in turn (FingerprintTag) and the stop notes (StopNoteTag).
inline constexpr uint64_t kDataSteps = (uint64_t{1} << kStepTagBits) -
                                       kCallDataSlots * kCheckTagsPerCall - kStopNoteTags;

/// Tag of data message `index` within the phase starting at `phase_tag`.
/// Indices wrap at kDataSteps, far beyond the messages ever in flight at once.
inline p2p::Tag StepTag(p2p::Tag phase_tag, uint64_t index) {
  return phase_tag + index % kDataSteps;
}

/// Where call `call_id` (CollectiveArgs::call_id) starts its data
/// messages' indices, for StepTag: the phase's data tags split into
/// kCallDataSlots slots of kCallDataSlotSteps tags, one per call in turn.
/// A failed call's sends may still reach the peer after their cancellation
/// (UCX completes small sends as they are posted), and would be taken by
/// the next call that waits at their tag: the ranks of the next calls, which
/// reuse the tag when the library is used without the communicator's
/// CollectiveTag sequence, take none of them (calls kCallDataSlots apart
/// share a slot; CallStepTag keeps a phase in its slot). Call 0 (not known)
/// starts at 0, as before.
inline constexpr uint64_t kCallDataSlotSteps = kDataSteps / kCallDataSlots;
inline uint64_t CallDataBase(uint64_t call_id) {
  return (call_id % kCallDataSlots) * kCallDataSlotSteps;
}

/// Tag of data message `index` of the call whose slot starts at `base`
/// (CallDataBase), within the phase starting at `phase_tag`. Indices wrap
/// within the slot, far beyond the messages ever in flight at once, so a
/// phase of any length stays in its call's tags: numbered on from the
/// slot's start, a phase of more than kCallDataSlotSteps messages (a small
/// tuning.chunk_bytes with a large count) ran into the next call's slot,
/// where a failed call's last chunks were taken by the next call's first.
inline p2p::Tag CallStepTag(p2p::Tag phase_tag, uint64_t base, uint64_t index) {
  return phase_tag + base + index % kCallDataSlotSteps;
}

/// Tag of the fingerprint exchanged in the phase starting at `phase_tag`
/// in call `call_id` (CollectiveArgs::call_id, 0 when not known). The next
/// tags carry CheckEveryRank's later rounds (+1) and DirectExchange's block
/// sizes (+2). Consecutive calls at one phase tag check at different tags,
/// as they move data (CallDataBase): a failed call's fingerprint, delivered
/// although cancelled (UCX completes small sends as they are posted), was
/// taken by the next call at the tag, which then failed INVALID_ARGUMENT
/// when its count differed from the failed call's.
inline p2p::Tag FingerprintTag(p2p::Tag phase_tag, uint64_t call_id) {
  return phase_tag + kDataSteps + kCheckTagsPerCall * (call_id % kCallDataSlots);
}

/// Tag of the note a ring rank that found a disagreement sends on around
/// the ring (Requests::RelayStops) in call `call_id` (CollectiveArgs::call_id,
/// 0 when not known). Consecutive calls at the same phase tag use different
/// tags, because a rank keeps its note's receive posted until its call
/// ends: a predecessor done with call N that finds a disagreement in call
/// N + 1 would otherwise have that note taken by this rank's call N (and
/// dropped as another call's, or cancelled at its end), and call N + 1 here
/// would wait for its deadline. Calls kStopNoteTags apart share a tag: a
/// note from a rank that many calls ahead (all of them failed, without
/// this rank) is still dropped.
inline p2p::Tag StopNoteTag(p2p::Tag phase_tag, uint64_t call_id) {
  return phase_tag + kDataSteps + kCallDataSlots * kCheckTagsPerCall + call_id % kStopNoteTags;
}

/// "rank 3", or "group rank 1 (rank 5)" when `p2p` is a GroupView, 5 being
/// the rank of the transport under every level of views.
std::string DescribePeer(const p2p::PointToPoint& p2p, int peer);

/// Rank `rank` of `p2p` as the transport under every level of GroupViews
/// numbers it. Stop notes carry ranks so: the ranks of one call may run its
/// steps on views of different orders (a hierarchical call's ranks that
/// pass count 0 check the whole world while the others run their host's
/// ring), and a note's ranks read in the receiver's own numbering named
/// other ranks than the finder meant.
int BaseRank(const p2p::PointToPoint& p2p, int rank);
/// The rank of `p2p` whose BaseRank is `base`, or -1 when none is.
int ViewRank(const p2p::PointToPoint& p2p, int base);
/// DescribePeer of the rank whose BaseRank is `base`, or "rank <base>"
/// when it is not in `p2p`.
std::string DescribeBaseRank(const p2p::PointToPoint& p2p, int base);

/// The same status with `context` and ": " prepended to its message.
Status Annotate(const Status& status, std::string_view context);

/// Where a collective is, for error messages; formatted only on error.
struct Where {
  static constexpr size_t kNoChunk = ~size_t{0};
  const char* what = "";  ///< "ring reduce-scatter"
  int step = 0;           ///< 0-based
  int steps = 0;          ///< total, 0 when not meaningful
  size_t chunk = 0;       ///< kNoChunk when not meaningful
  bool is_send = false;
  int peer = 0;
  /// An argument check's own message (a Fingerprint or Verdict), not data.
  bool check_message = false;
};

/// "ring reduce-scatter step 2/3 chunk 4: receive from rank 5".
std::string Describe(const p2p::PointToPoint& p2p, const Where& where);

/// What every rank of a collective must have passed alike. Ranks send it to
/// a neighbour before their data, so that a count mismatch fails at once
/// with both values, instead of as a timeout or, worse, as messages that
/// happen to match in size and give a silently wrong result. The tuning is
/// left out (a Verdict of two fingerprints stays within UCX's short
/// messages); a receive of a message of another size names
/// tuning.chunk_bytes among the causes (Requests::Wait).
struct Fingerprint {
  uint64_t count = 0;
  int32_t dtype = 0;
  int32_t op = 0;     ///< -1 when the collective does not reduce
  int32_t root = 0;   ///< -1 when the collective has no root
  int32_t kind = 0;   ///< FingerprintKind: which collective and algorithm
  /// Tuning::checked_whole_count, else `count`.
  uint64_t whole_count = 0;

  bool operator==(const Fingerprint&) const = default;
  /// "ring all-reduce, count 120 of f32, op sum", plus ", a step of a call
  /// with count 480" when whole_count differs from count, and the mode of
  /// a halving-doubling all-reduce that moves data (", in
  /// recursive-doubling mode").
  std::string ToString() const;
};

/// A Fingerprint in 24 bytes, for carrying in front of a message's data
/// (Requests::WaitWithFingerprint): with the 32-byte one, a 64-byte
/// message grew past what UCX sends as a short message over shared memory
/// (am_short 100 bytes, 8 of them the tag) and 64 B rhd calls got slower.
/// Exact for every fingerprint of arguments that passed CheckArgs (dtype,
/// op and kind fit a byte).
struct PackedFingerprint {
  uint64_t count = 0;
  uint64_t whole_count = 0;
  int32_t root = 0;
  int8_t dtype = 0;
  int8_t op = 0;
  int8_t kind = 0;
  int8_t unused = 0;

  static PackedFingerprint Pack(const Fingerprint& f) {
    PackedFingerprint p;
    p.count = f.count;
    p.whole_count = f.whole_count;
    p.root = f.root;
    p.dtype = static_cast<int8_t>(f.dtype);
    p.op = static_cast<int8_t>(f.op);
    p.kind = static_cast<int8_t>(f.kind);
    return p;
  }
  Fingerprint Unpack() const {
    Fingerprint f;
    f.count = count;
    f.whole_count = whole_count;
    f.root = root;
    f.dtype = dtype;
    f.op = op;
    f.kind = kind;
    return f;
  }
};
static_assert(sizeof(PackedFingerprint) == 24, "sent as raw bytes: no padding");

/// Fingerprint::kind values: a rank running another collective or another
/// algorithm is a mismatch too (say, CallOptions::algorithm forced on one
/// rank, or a count on the other side of the selection table's threshold).
enum FingerprintKind : int32_t {
  kRingAllReduceKind = 1,
  kTreeAllReduceKind = 2,
  kRhdAllReduceKind = 3,
  kHierarchicalAllReduceKind = 4,
  kReduceScatterKind = 5,
  kAllGatherKind = 6,
  kBroadcastKind = 7,
  kBarrierKind = 8,
  kDirectExchangeKind = 9,
  kTreeReduceKind = 10,
  kRingReduceKind = 11,
  kGatherKind = 12,
  kScatterKind = 13,
  /// The halving-doubling all-reduce in recursive-doubling mode (its
  /// kRhdAllReduceKind runs halving then doubling): which mode a call
  /// takes depends on Tuning::rhd_doubling_bytes besides the size, and the
  /// modes exchange different messages, so ranks in different modes must
  /// fail on the check rather than wait on each other.
  kRhdDoublingAllReduceKind = 14,
};

/// The fingerprint of `args` for a collective of `kind`.
Fingerprint MakeFingerprint(const CollectiveArgs& args, FingerprintKind kind, bool uses_op,
                            bool uses_root);

class Requests;

/// Exchanges Fingerprints with neighbours (posted at the start of a
/// collective) and compares them before the collective's first blocking
/// wait of any kind (Requests calls Verify); as the neighbours' data sends
/// come after their fingerprint, this costs no extra latency. Every rank
/// must be checked by a neighbour that forwards data the others depend on,
/// so one mismatch makes every rank fail.
class PeerCheck {
 public:
  PeerCheck(const char* what, const Fingerprint& mine)
      : what_(std::string(what) + ", argument check"), mine_(mine) {}

  /// Sends this rank's fingerprint to each of `to` and receives one from
  /// each of `from`, with FingerprintTag(phase_tag, call_id), and registers
  /// with `requests` so that its first blocking wait verifies.
  Status Post(Requests& requests, p2p::Tag phase_tag, uint64_t call_id, const std::vector<int>& to,
              const std::vector<int>& from);
  /// Waits for the fingerprints from `from` (once) and compares; a
  /// difference is INVALID_ARGUMENT naming the peer and both values.
  Status Verify(Requests& requests);
  /// Verify, but taking the fingerprints in the order they arrive, so the
  /// first mismatch fails at once even while some peer has not sent yet
  /// (a direct exchange's peers may never send).
  Status VerifyAsTheyArrive(Requests& requests);
  /// Compares `theirs`, what `peer` sent beside its data rather than as a
  /// message of its own (Requests::WaitWithFingerprint), with this rank's:
  /// INVALID_ARGUMENT naming the peer and both values when they differ.
  Status CompareWith(const p2p::PointToPoint& p2p, int peer, const Fingerprint& theirs);
  bool verified() const { return verified_; }
  /// Fingerprint::kind of the first peer found to differ, 0 while none has.
  int32_t differing_kind() const { return differing_kind_; }
  /// The first peer found to differ (-1 while none has), and what it passed.
  int differing_peer() const { return differing_peer_; }
  const Fingerprint& differing() const { return differing_; }
  const Fingerprint& mine() const { return mine_; }

 private:
  Status Compare(const p2p::PointToPoint& p2p, size_t i);

  std::string what_;  // "<collective>, argument check", for errors
  Fingerprint mine_;
  std::vector<int> from_;
  // The fingerprints sent and received, in memory the Requests owns (Post):
  // a collective that returns early destroys its PeerCheck before its
  // Requests cancels the messages, which may still be in flight until then.
  const Fingerprint* sent_ = nullptr;
  Fingerprint* theirs_ = nullptr;
  std::vector<p2p::RequestId> ids_;
  bool verified_ = false;
  int32_t differing_kind_ = 0;
  int differing_peer_ = -1;
  Fingerprint differing_;
};

/// The whole of a collective whose count is 0, on a world of more than one
/// rank: nothing moves, but the arguments are still proven, so that a rank
/// passing 0 where the others pass more fails at once, on every rank,
/// instead of leaving them waiting for data it never sends. Which algorithm
/// the peers run is not known here (the automatic choice depends on the
/// size), so `mine` goes to each of `peers` with FingerprintTag(phase_tag, call_id),
/// the tag every algorithm's own check uses, and one is expected back from
/// each: O(peers) small messages. An algorithm whose steps check different
/// groups of peers with different tags passes one round per step: all are
/// sent before any is awaited, and all are awaited together, in the order
/// they arrive, so the first difference fails at once.
///
/// With a `call_id` (CollectiveArgs::call_id, not 0), a rank that finds a
/// difference also tells every peer of every round in a stop note, a notice
/// (PointToPoint::PostNotice) at StopNoteTag(phase tag of the first round,
/// call_id), before it returns; each rank listens for those notes from
/// every peer, and fails INVALID_ARGUMENT with the first of this call
/// (naming the two ranks and both their values), ignoring one of another
/// call. Its return cancels its fingerprint sends, so a peer that entered
/// the call later learns of the difference only from the note; without a
/// call id it waits for its deadline, TIMED_OUT. Costs the agreeing call
/// one receive per peer, posted and cancelled.
struct CheckRound {
  p2p::Tag phase_tag = 0;
  std::vector<int> peers;
};
Status CheckEmptyCall(p2p::PointToPoint& p2p, Deadline deadline, const char* what,
                      const Fingerprint& mine, const std::vector<CheckRound>& rounds,
                      uint64_t call_id);

/// Proves that every rank of `p2p` passed the same fingerprint, with every
/// rank ending on the same verdict: INVALID_ARGUMENT naming two ranks that
/// differ and both their values on every rank, or OK on every rank. A
/// neighbour check (PeerCheck) fails only the ranks next to the one that
/// disagrees, and the others fail later, at their deadline or as the
/// failure reaches them; where ranks can finish without data from the
/// failing ones (a broadcast's other subtrees), they would return OK. Must
/// be called on every rank before any data moves, in ceil(log2 p) rounds
/// of a dissemination pattern: in round k, rank r hears from rank r - 2^k
/// (mod p) and tells rank r + 2^k what it has heard so far, so that after
/// the last round each rank has heard from all p. Round 0 carries plain
/// fingerprints with FingerprintTag(phase_tag, call_id), as every PeerCheck does, so
/// a ring neighbour running another collective is caught there; the later
/// rounds use the next tag. A rank that has found a disagreement sends it
/// on in all its remaining rounds at once, and every rank waits for all its
/// messages either way, so that none leaves another waiting for a send (a
/// wait that fails after a disagreement is known reports the disagreement),
/// except when the disagreement shows a rank of a collective that takes no
/// part in the rounds (TakesPartInEveryRankRounds): such a rank never sends
/// the later rounds nor takes them, so this rank then returns the
/// disagreement at once, giving up what is outstanding, after sending it
/// on around the ring as a stop note (Requests::RelayStops, at
/// StopNoteTag(phase_tag, call_id), the tag ring ranks of the same call
/// listen to): a rank whose own rounds agree but that waits for a round
/// from such a rank learns of it from that note, which every wait here
/// watches (with a `call_id` only: without one, such a rank waits for its
/// deadline). A note that reaches a rank whose kinds all take part in the
/// rounds joins its verdict, and it takes its outstanding rounds as before.
/// Costs the agreeing call one receive posted and cancelled.
/// Costs each rank ceil(log2 p) small messages, in as many sequential
/// rounds.
Status CheckEveryRank(p2p::PointToPoint& p2p, Deadline deadline, const char* what,
                      const Fingerprint& mine, p2p::Tag phase_tag, uint64_t call_id);

/// Whether a collective of this FingerprintKind proves its arguments with
/// CheckEveryRank (broadcast, gather, scatter, tree reduce).
bool ChecksEveryRank(int32_t kind);

/// Whether a rank of a collective of this FingerprintKind sends and takes
/// every round of CheckEveryRank: those that run it, and the ring reduce
/// (PostEveryRankRounds). A rank of CheckEveryRank that knows the ranks
/// disagree and that one of them is of another kind fails at once,
/// without waiting for its outstanding rounds.
bool TakesPartInEveryRankRounds(int32_t kind);

/// What a collective (`what`, for errors) that checks only its ring
/// predecessor (a PeerCheck from rank r - 1 at FingerprintTag(phase_tag, call_id),
/// which is also round 0 of CheckEveryRank) adds so that ranks running
/// CheckEveryRank at the same tags never wait for it: the ring reduce,
/// where a rank whose count puts it on the other side of
/// kTreeReduceMaxBytes runs the tree reduce. Posts
/// the PeerCheck's own send (round 0: `mine` to rank r + 1; the PeerCheck
/// then only receives, RingParams::fingerprint_sent) and CheckEveryRank's
/// rounds 1 and later at once, each carrying `mine` as is (no merging: its
/// kind alone tells a tree rank that the call is wrong), and the receives
/// of those rounds, so that every rank of CheckEveryRank gets all its
/// rounds and fails at once, where the ones waiting for a round from this
/// rank waited for their deadline. All in `requests`, which the caller
/// waits for at its end, and on its error path when the PeerCheck met a
/// collective that ChecksEveryRank (PeerCheck::differing_kind): a message
/// cancelled before a tree rank took it (the PeerCheck's, when this rank
/// failed it) left that rank waiting, and its senders wait for their sends
/// to be taken. Not otherwise: a rank of another collective at these tags
/// (a ring all-reduce) never takes nor sends these rounds, and waiting for
/// them held the failure until the deadline. Costs ceil(log2 p) - 1 small messages each way more than the
/// PeerCheck, none waited for before the data.
Status PostEveryRankRounds(Requests& requests, const char* what, const Fingerprint& mine,
                           p2p::Tag phase_tag, uint64_t call_id);

/// Every rank of `p2p` but this one.
std::vector<int> OtherRanks(const p2p::PointToPoint& p2p);

/// How a collective begins: CheckArgs against `shape`, the call's
/// fingerprint (`kind` names the collective and algorithm), and the calls
/// that end right here: count 0, whose arguments are still proven against
/// every rank (CheckEmptyCall, phase 0), and a world of one rank, whose
/// result is a copy of send into recv (shape.recv_elems elements).
/// `finished` says the call ended here, with `status`.
struct CollectiveStart {
  Status status;
  bool finished = false;
  Fingerprint fingerprint;
};
CollectiveStart StartCollective(p2p::PointToPoint& p2p, const CollectiveArgs& args,
                                FingerprintKind kind, const BufferShape& shape);

/// StartCollective for the flat all-reduces (ring, tree, rhd).
CollectiveStart StartFlatAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args, FingerprintKind kind);

/// Scratch blocks up to this size come from the per-thread arena and stay
/// there for the next call; larger ones are allocated for the call and freed
/// at its end, so that one huge collective (a tree reduce's whole-vector
/// partial sums on an inner rank) does not leave every thread that ran it
/// holding that much for the rest of the process. The defaults need at most
/// (8 + 4 + 1) x 256 KiB (the ring's slots).
inline constexpr size_t kScratchRetainBytes = size_t{8} << 20;

/// Scratch memory for one collective, from a per-thread arena of two blocks
/// that keep their largest size (up to kScratchRetainBytes each). A
/// collective runs on one thread and needs a few MiB at most; reusing the
/// arena avoids a fresh mapping, and its page faults, on every call. A
/// nested Scratch takes the arena's second block (the ring reduce keeps its
/// block in one while its reduce-scatter uses the other); a third, or one
/// above kScratchRetainBytes, gets memory of its own, freed with it.
///
/// Except after a failed call whose requests the PointToPoint could not
/// confirm it let go of (UnconfirmedReleases grew while a Requests of this
/// thread lived inside this Scratch's lifetime; UCX to a same-host peer, see
/// collective.h): a late receive may still write into the block, so it is
/// neither freed nor handed to the next call but quarantined, kept for the
/// rest of the process (ScratchQuarantinedBytes). An arena block leaves the
/// arena, so its grow path never frees it either. Failed calls abort the
/// communicator, so this happens a few times per process at most.
class Scratch {
 public:
  explicit Scratch(size_t bytes);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  unsigned char* data() const { return data_; }

 private:
  unsigned char* data_ = nullptr;
  std::unique_ptr<unsigned char[]> own_;  // only when not from the arena
  size_t own_bytes_ = 0;
  void* arena_block_ = nullptr;           // the arena's ScratchBlock, when from it
  uint64_t unconfirmed_at_start_ = 0;     // this thread's count, at construction
};

/// Bytes the calling thread's Scratch arena holds between calls (for tests).
size_t ScratchRetainedBytes();

/// Scratch blocks quarantined (never freed) in this process, and their bytes
/// (which also count the argument checks' message buffers of such calls).
struct ScratchQuarantine {
  size_t blocks = 0;
  size_t bytes = 0;
};
ScratchQuarantine ScratchQuarantined();

/// The requests one collective has outstanding. Every error path leaves
/// through the destructor, which cancels what is still outstanding (in one
/// CancelAll, so that hung peers are waited for together, not one after
/// the other), so no transfer touches the caller's buffers after the
/// collective returns, as far as the PointToPoint's Cancel can promise
/// that (not for a same-host UCX peer: see collective.h). The argument checks' messages live in memory this
/// object owns, so that they outlast the PeerCheck that posted them; when
/// the PointToPoint's UnconfirmedReleases grew meanwhile, the destructor
/// quarantines that memory and tells this thread's Scratch blocks to do so
/// too (see Scratch).
class Requests {
 public:
  Requests(p2p::PointToPoint& p2p, Deadline deadline)
      : p2p_(p2p), deadline_(deadline), unconfirmed_at_start_(p2p.UnconfirmedReleases()) {}
  ~Requests();
  Requests(const Requests&) = delete;
  Requests& operator=(const Requests&) = delete;

  /// Posts a send / receive; errors are annotated with `where`.
  StatusOr<p2p::RequestId> Send(const Where& where, p2p::Tag tag, const void* data,
                                size_t bytes);
  StatusOr<p2p::RequestId> Recv(const Where& where, p2p::Tag tag, void* data, size_t bytes);

  /// Waits for one request (any progress also advances the others) until the
  /// deadline; errors are annotated with `where`.
  Status Wait(p2p::RequestId id, const Where& where);

  /// Waits for everything outstanding (the sends, at the end); `what` names
  /// the collective in errors.
  Status WaitAll(const char* what);

  /// WaitAll at the end of one step of a collective whose later steps still
  /// need the stop note (RelayStops): the note's receive stays posted, and
  /// each request is awaited with it, so a rank whose partner stopped does
  /// not wait for its sends until the deadline. Without RelayStops, WaitAll.
  Status WaitAllInStep(const char* what);

  /// Wait for a receive whose message starts with the sender's
  /// PackedFingerprint (at `theirs`, the start of the receive buffer, read
  /// once the receive is complete), which replaces a separate fingerprint
  /// message from that peer (halving-doubling's step partners in doubling
  /// mode: a message fewer each way per partner). Needs RelayStops and a
  /// PeerCheck. A fingerprint that differs from this rank's fails as
  /// PeerCheck does, naming the peer and both values, and sends a stop note
  /// as a finder. A message of another size carries no fingerprint to
  /// read: the peer passed another count or dtype, and the ring check
  /// finds some pair that differs and its note reaches this rank, so this
  /// waits for that note (until the deadline) and fails with it, naming
  /// both values; only a deadline with no note returns the size error.
  Status WaitWithFingerprint(p2p::RequestId id, const Where& where, const void* theirs);

  /// Completed without blocking? Releases it when so.
  StatusOr<bool> Test(p2p::RequestId id, const Where& where);

  /// Makes a ring's argument check stop the whole ring, not only the rank
  /// that checks the one that differs: without it, the ranks further on
  /// waited for data from the failed rank until their deadline (nothing
  /// flows to them from the rank that disagrees, which may run another
  /// algorithm altogether). Posts the receive of a stop note from `from`
  /// (the ring predecessor) at StopNoteTag(phase_tag, call_id), which every later
  /// Wait watches besides its own request. A rank whose PeerCheck (checking
  /// `from`) finds a disagreement sends a note naming both ranks and values
  /// to `to` (the successor) as it fails; a rank that receives one fails
  /// with it, INVALID_ARGUMENT, and sends it on, until the next rank is the
  /// one that found it (also to the rank it names as differing, whose own
  /// checks may all agree). Call before the PeerCheck's Post. The notes are not
  /// waited for (the next rank may run another collective, or have failed
  /// on its own check, and never take one). With a `call_id` (not 0, see
  /// CollectiveArgs::call_id) they go as notices (PointToPoint::PostNotice),
  /// which outlast this rank's return and reach a rank that posts its
  /// receive later; a note from another call (one left unread at the same
  /// tag, kStopNoteTags calls away at least) is ignored and the receive
  /// posted again. Without one, plain sends:
  /// this object's end cancels a note not yet taken, so a rank that had not
  /// yet posted its receive by then waits for its deadline. Costs the agreeing
  /// call one receive posted and cancelled, and every Wait watching two
  /// requests instead of one. `to` -1: this rank passes notes on to no one.
  /// `leaf` (-1 for none): a rank that checks nobody and passes nothing on,
  /// whose only note comes from here (halving-doubling's folded rank, whose
  /// `from` is this rank): it is sent every note, even one naming it as
  /// the rank that differs, as nothing else would stop it. A receive that
  /// fails INVALID_ARGUMENT (data of another size, from a peer this rank
  /// does not check) sends a note too, naming that peer and this rank's
  /// own arguments only, as this rank's return would end the others' notes.
  /// `from_partner`: `from` is this rank's halving-doubling partner (a
  /// folded rank's), not its ring predecessor; a note's error says which
  /// of the two passed it on.
  Status RelayStops(const char* what, uint64_t call_id, p2p::Tag phase_tag, int from, int to,
                    int leaf = -1, bool from_partner = false);
  /// Fingerprint::kind of the rank that differed, as a stop note received
  /// here named it; 0 while none came.
  int32_t stopped_by_kind() const { return stopped_by_kind_; }
  /// Whether a wait here ended on a stop note of this call.
  bool took_stop_note() const { return took_stop_note_; }

  p2p::PointToPoint& p2p() { return p2p_; }
  Deadline deadline() const { return deadline_; }

 private:
  friend class PeerCheck;
  friend Status CheckEveryRank(p2p::PointToPoint& p2p, Deadline deadline, const char* what,
                               const Fingerprint& mine, p2p::Tag phase_tag,
                               uint64_t call_id);
  friend Status PostEveryRankRounds(Requests& requests, const char* what,
                                    const Fingerprint& mine, p2p::Tag phase_tag,
                                    uint64_t call_id);
  friend Status CheckEmptyCall(p2p::PointToPoint& p2p, Deadline deadline, const char* what,
                               const Fingerprint& mine, const std::vector<CheckRound>& rounds,
                               uint64_t call_id);
  void Track(p2p::RequestId id);
  void Forget(p2p::RequestId id);
  // `n` value-initialised messages that live as long as this object (an
  // argument check's message buffers).
  template <typename T>
  T* Hold(size_t n) {
    static_assert(std::is_trivially_copyable_v<T> && alignof(T) <= alignof(std::max_align_t));
    T* held = static_cast<T*>(HoldBytes(n * sizeof(T)));
    for (size_t i = 0; i < n; ++i) new (held + i) T();
    return held;
  }
  void* HoldBytes(size_t bytes);
  // Runs the registered PeerCheck before the first blocking wait (and
  // starts a stop note when it fails and RelayStops was called).
  Status VerifyFirst();
  // Waits for `id` or a stop note, whichever comes first (RelayStops); the
  // caller annotates errors. `request_failed`, when given, tells whether
  // an error is the request's own (not a note's, nor the re-post of one).
  // Once the note's sender has left, waits for `id` alone.
  Status WaitOrStop(p2p::RequestId id, bool* request_failed = nullptr);
  // The error of the stop note that has arrived in stop_got_, after passing
  // it on; stop_recv_ is already released.
  Status StopNoteError();
  // Whether the note that has arrived in stop_got_ (stop_recv_ released)
  // belongs to this call; when not, posts the note's receive again, or
  // leaves stop_recv_ 0 when the note's sender has left (no note can come).
  StatusOr<bool> TakeNote();
  // What a rank that found a disagreement sends on around the ring.
  struct StopNote {
    // What `their_rank` passed; kind 0 when not known, as `finder` found
    // only that the data `their_rank` sent did not fit its own arguments.
    Fingerprint theirs;
    Fingerprint finders;   // what `finder` passed
    // Both ranks as BaseRank numbers them, not as this view does.
    int64_t their_rank = 0;
    int64_t finder = 0;    // the rank whose check found it
    uint64_t call_id = 0;  // CollectiveArgs::call_id of the finder's call
  };
  // Posts `note` to relay_to_, unless that rank is one of the two it names,
  // and to relay_leaf_, unless that rank found it.
  Status SendStopNote(const StopNote& note);

  PeerCheck* check_ = nullptr;
  p2p::PointToPoint& p2p_;
  const Deadline deadline_;
  // p2p_.UnconfirmedReleases() at construction: the destructor tells this
  // thread's Scratch blocks when it grew (they are then quarantined).
  const uint64_t unconfirmed_at_start_;
  // Posted and not yet completed, and where each sits in that list: a
  // collective of many chunks keeps thousands of sends outstanding until
  // its end, and a search per wait made it quadratic in the chunks.
  std::vector<p2p::RequestId> outstanding_;
  std::unordered_map<p2p::RequestId, size_t> position_;
  std::deque<std::vector<std::max_align_t>> held_;  // Hold
  // RelayStops: the stop note's receive (0 when none is posted), its
  // buffer, the rank it comes from and whether that is a halving-doubling
  // partner, the rank to send notes on to, and the tag.
  p2p::RequestId stop_recv_ = 0;
  StopNote* stop_got_ = nullptr;
  int relay_from_ = -1;
  bool relay_from_partner_ = false;
  int relay_to_ = -1;
  int relay_leaf_ = -1;
  p2p::Tag stop_tag_ = 0;
  const char* relay_what_ = "";
  uint64_t call_id_ = 0;  // RelayStops' call_id
  int32_t stopped_by_kind_ = 0;
  bool took_stop_note_ = false;
  // Notes SendStopNote posted as plain sends: WaitAll gives them up.
  std::vector<p2p::RequestId> note_sends_;
};

}  // namespace ddp::transport::algorithms::internal

#endif  // DDP_TRANSPORT_ALGORITHMS_PIPELINE_H_
