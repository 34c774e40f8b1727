#ifndef DDP_TRANSPORT_UCX_UCX_P2P_H_
#define DDP_TRANSPORT_UCX_UCX_P2P_H_

// Tagged point-to-point messaging over UCX: the implementation of
// p2p::PointToPoint between processes.
//
// Tags: the algorithm's tag fills the low p2p::kTagBits bits; the sender's
// rank fills the bits above (up to bit 62), and receives match all 64 bits,
// so a receive from rank 3 never takes a message from rank 5 that carries
// the same tag. Bit 63 separates the user's Send/Recv messages (PostUser*)
// from the collectives' messages, so neither can match the other.
//
// Progress: all progress happens inside Test / WaitAll / WaitAny on the
// calling thread. While idle a wait spins, yields the CPU or sleeps on the
// worker's event fd (IdleMode); once it has lasted a millisecond it runs the
// watchdog every `watchdog_period` (the communicator checks the store for an
// abort reason and the liveness of peers on this host there).
//
// Cancelling: a wait that fails, Test that fails, Cancel and Close give up
// their unfinished requests and return once UCX has let go of them, so that
// nothing writes into (or sends from) the caller's buffers afterwards. UCX
// cancels a receive it has not matched yet at once; a send or a matched
// receive gets a grace (P2pOptions::recall_grace, 100 ms) to complete,
// then its peer's endpoint is closed by force, which completes it, and the
// peer is lost (later operations with it fail with PEER_LOST). The
// exception: UCX 1.13 cannot force an endpoint without peer error mode,
// those to ranks on this host; such a peer is lost too, but its request
// stays with UCX until it completes or the peer's process is gone: a
// receive may then still write into the caller's buffer (and a send read
// from it) after the call that gave it up returned, possibly even after
// Close. Nothing bounces such
// receives through memory of our own (a matched receive cannot be moved to
// another buffer), so callers keep the buffers of a failed call until then
// (algorithms/collective.h); UnconfirmedReleases counts such requests, and
// the algorithms' own scratch memory is kept for good when it grows.
// A failed WaitAll returns at most 20 ms (plus one progress pass) past its
// deadline: the grace ends 10 ms after the deadline (or sooner, at
// recall_grace), and the forced closes get the rest; a Cancel or CancelAll run by the watchdog keeps to the
// deadline of the wait that runs it the same way. Requests UCX has not
// given back by then count as UnconfirmedReleases.
// Outside a wait (Cancel, CancelAll, Test), CancelAll gives up all its
// requests first and then waits once: one grace and one round of forced
// closes (at most the grace + 1 s; + 2 s when some of the peers had
// already failed, whose endpoints are closed by force first, before the
// grace) however many peers they go to, where a loop of Cancel would wait
// that long for each peer in turn.
//
// Threading: one thread at a time (the communicator serializes callers).

#include <chrono>
#include <functional>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <ucp/api/ucp.h>

#include "transport/p2p/point_to_point.h"
#include "transport/status.h"
#include "transport/ucx/resources.h"

namespace ddp::transport::ucx {

/// What a wait does when the worker has nothing to progress.
enum class IdleMode {
  kSpin,   ///< Keep polling (yield only after long idle): a core per rank.
  kYield,  ///< sched_yield() between polls: ranks sharing cores let each other run.
  kSleep,  ///< Sleep on the worker's event fd; without wakeup, 0.5 ms steps (see set_idle_mode).
};

struct P2pOptions {
  int rank = 0;
  int size = 1;
  IdleMode idle_mode = IdleMode::kSpin;
  /// Idle polls before yielding or sleeping; not negative (Create refuses it).
  int idle_polls_before_backoff = 256;
  /// A wait reads the clock (for its deadline and the watchdog) once per
  /// this many polls, a power of two of at most 256 (a read costs ~20 ns).
  /// Tests set 1 to meet a deadline that has passed at the wait's first poll.
  int polls_per_clock_read = 16;
  /// How often a wait runs the watchdog (waits longer than a millisecond),
  /// and the longest a sleeping wait sleeps; positive (Create refuses 0 or less).
  std::chrono::milliseconds watchdog_period{100};
  /// How long a cancelled send (or matched receive) may still complete
  /// before its peer's endpoint is closed by force (see Cancel); 0 forces
  /// at once, a negative grace is refused.
  std::chrono::milliseconds recall_grace{100};
};

class UcxPointToPoint final : public p2p::PointToPoint {
 public:
  /// Creates the worker; Connect() must follow before any message.
  static StatusOr<std::unique_ptr<UcxPointToPoint>> Create(std::shared_ptr<Context> context,
                                                           const P2pOptions& options);
  ~UcxPointToPoint() override;

  /// The epoll_wait timeout, in ms, of one idle sleep with `left` until the
  /// wait's deadline and at most `max_sleep`: 0 for a deadline passed, at
  /// most INT_MAX (about 24.8 days) however long both are.
  static int SleepMilliseconds(std::chrono::milliseconds left, std::chrono::milliseconds max_sleep);

  /// This worker's address, to publish through the store.
  const std::string& address() const { return worker_->address(); }

  /// Creates an endpoint to every rank (self included) from their worker
  /// addresses, indexed by rank. `same_host[r]` says rank r shares this host
  /// (empty: all do). UCX 1.13's shared-memory and self transports have no
  /// peer failure handler, so endpoints to ranks on this host use error mode
  /// NONE and their death is detected by the communicator's liveness check
  /// (MarkPeerLost); endpoints to other hosts use peer error mode, so a dead
  /// peer completes requests with an error instead of hanging. On error no
  /// endpoint is left (later messages fail as before Connect) and Connect
  /// may be called again.
  Status Connect(std::span<const std::string> addresses,
                 const std::vector<bool>& same_host = {});

  /// Runs `check` about every `period` inside waits, passing the wait's
  /// deadline (it must return by then) and the ranks of its pending
  /// requests, each once; a non-OK result ends the wait with that status,
  /// unless a last progress pass completes one of the wait's requests.
  /// Used to learn about aborts posted by other ranks and peers on this
  /// host that exited. `check` may Cancel (keeping to the wait's deadline),
  /// also a request of the running wait: that wait then ends, ABORTED
  /// naming it (or with `check`'s own failure). A wait inside `check` that
  /// lists a request of the running wait fails INVALID_ARGUMENT.
  void SetWatchdog(std::function<Status(Deadline, std::span<const int>)> check);

  /// Records that `peer` is gone (learned elsewhere, e.g. its process exited);
  /// pending and later operations with it fail with `reason`, except a
  /// later receive of a message the peer sent before it went (UCX holds it
  /// until a receive takes it), which succeeds.
  void MarkPeerLost(int peer, Status reason);

  /// Progresses the worker once, so that UCX reports the connections it
  /// found broken meanwhile, and returns the ranks whose endpoint UCX
  /// reported failed (only endpoints to other hosts can: peer error mode).
  /// Such a rank's process died or closed its endpoint to this one by force
  /// (it gave up on this rank). Ranks only marked lost here (MarkPeerLost,
  /// a recalled request) are not listed: those may be well.
  std::vector<int> PeersWithFailedEndpoints();

  /// Flushes and closes every endpoint, waiting at most until `deadline`;
  /// a remote endpoint whose flush did not finish by then (a peer that
  /// hangs) is closed by force, waiting at most 1 s more, so that none is
  /// still closing when the worker goes. Later messages and Connect fail
  /// (FAILED_PRECONDITION). Called by the
  /// destructor if not called before. An endpoint whose close UCX refused
  /// (1.13 cannot force one to a lost rank on this host) stays open until
  /// the worker is destroyed, and Close returns FAILED_PRECONDITION naming
  /// its rank (every such rank).
  /// `force_remote`: close endpoints to other hosts without flushing (after
  /// an abort: a flush towards a host that went silent never completes, and
  /// UCX cannot destroy a worker whose endpoints still hold sends).
  Status Close(Deadline deadline, bool force_remote = false);

  const P2pOptions& options() const { return options_; }
  /// Changes how later waits idle. kSleep sleeps on the event fd of a
  /// context created with wakeup; without one it sleeps 0.5 ms between
  /// polls (a message is noticed up to that late, and no core is kept
  /// busy). A negative threshold counts as 0 (back off at the first idle
  /// poll).
  void set_idle_mode(IdleMode mode, int idle_polls_before_backoff);

  /// Like PostSend/PostRecv, on the user channel (Communicator::Send/Recv).
  StatusOr<p2p::RequestId> PostUserSend(int peer, p2p::Tag tag, const void* data, size_t bytes);
  StatusOr<p2p::RequestId> PostUserRecv(int peer, p2p::Tag tag, void* data, size_t bytes);

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  StatusOr<p2p::RequestId> PostSend(int peer, p2p::Tag tag, const void* data,
                                    size_t bytes) override;
  /// A receive from a lost peer is posted all the same, to take what the
  /// peer sent before it went; when a bounded drain completes nothing for
  /// it, it is given up (as Cancel does) and the post fails with the
  /// peer's error. Giving it up may close the peer's endpoint by force:
  /// the post then waits up to 1 s for UCX to confirm (about 10 ms seen
  /// against a stopped peer), or inside the watchdog until the running
  /// wait's deadline (plus 20 ms). PostUserRecv alike.
  StatusOr<p2p::RequestId> PostRecv(int peer, p2p::Tag tag, void* data,
                                    size_t bytes) override;
  /// A tag send from a copy this object owns (see PointToPoint). UCX cannot
  /// drop a send it has started, so with kMaxNoticesPerPeer notices to
  /// `peer` still in flight, another fails (UNAVAILABLE, naming the peer).
  /// A notice moves only while this object calls into UCX (waits, Test,
  /// Close's flush); Close completes or drops every one.
  Status PostNotice(int peer, p2p::Tag tag, const void* data, size_t bytes) override;
  /// A pending request whose peer is lost is given up (as Cancel does,
  /// within the same bound) and Test returns the peer's error.
  StatusOr<bool> Test(p2p::RequestId request) override;
  Status WaitAll(std::span<const p2p::RequestId> requests, Deadline deadline) override;
  StatusOr<size_t> WaitAny(std::span<const p2p::RequestId> requests,
                           Deadline deadline) override;
  /// A watched receive whose peer is lost (its endpoint failed, or
  /// MarkPeerLost) fails no wait that still needs an unwatched request, and
  /// the watchdog does not hear of its peer as waited for.
  void MarkWatched(p2p::RequestId request) override;
  void Cancel(p2p::RequestId request) override;
  void CancelAll(std::span<const p2p::RequestId> requests) override;
  /// Requests still with UCX after their recall (same-host peers): see
  /// the Cancelling note above.
  uint64_t UnconfirmedReleases() const override { return unconfirmed_releases_; }

 private:
  struct Slot;
  // A notice in flight: its bytes, and UCX's request (null until UCX
  // returns one, or when it completed inline).
  struct Notice {
    UcxPointToPoint* owner = nullptr;
    int peer = 0;
    std::vector<unsigned char> bytes;
    void* request = nullptr;
    bool posted = false;  // ucp_tag_send_nbx has returned
    bool done = false;    // UCX called NoticeCallback
  };
  struct PeerState {
    UcxPointToPoint* owner = nullptr;
    int rank = 0;
    Status failure;  // set once the endpoint reported an error, or MarkPeerLost
    bool endpoint_failed = false;  // UCX called the endpoint's error handler
    bool peer_error_mode = false;
  };

  UcxPointToPoint(std::shared_ptr<Context> context, std::unique_ptr<Worker> worker,
                  const P2pOptions& options);

  static void SendCallback(void* request, ucs_status_t status, void* user_data);
  static void RecvCallback(void* request, ucs_status_t status,
                           const ucp_tag_recv_info_t* info, void* user_data);
  static void NoticeCallback(void* request, ucs_status_t status, void* user_data);
  // Frees a completed notice and its request.
  void EraseNotice(Notice* notice);
  static void EndpointErrorCallback(void* arg, ucp_ep_h ep, ucs_status_t status);

  // Whether some request of a wait on `slots` is neither done nor watched.
  static bool NeedsUnwatched(std::span<Slot* const> slots);
  // Whether the wait on `slots` goes on past `failure` of `slot`: a watched
  // receive whose peer is lost, while the wait has an unwatched request
  // still pending, or with `any` (WaitAny, which returns one done) at all.
  static bool SkipLostWatched(const Slot* slot, const Status& failure,
                              std::span<Slot* const> slots, bool any);
  // OK, or why a post to `peer` with `tag` cannot go: the post named first,
  // then the reason (a lost peer's included).
  Status CheckPeer(int peer, p2p::Tag tag, const char* what) const;
  // Closes the endpoints to `peers` (by force where the peer is lost, or is
  // remote and `force_remote`) and waits for UCX to confirm until `deadline`.
  // Other remote endpoints are flushed until `deadline` first; those whose
  // flush did not finish are closed by force, waiting up to 1 s more.
  Status CloseEndpoints(std::span<const int> peers, bool force_remote, Deadline deadline);
  // Polls until UCX has completed every non-null request in `requests` or
  // `until` passes, freeing (and nulling) the completed ones; returns
  // whether any is left.
  bool AwaitRequests(std::span<void*> requests, Deadline until);
  StatusOr<p2p::RequestId> Send(bool user, int peer, p2p::Tag tag, const void* data, size_t bytes);
  StatusOr<p2p::RequestId> Recv(bool user, int peer, p2p::Tag tag, void* data, size_t bytes);
  // A slot for a post whose peer CheckPeer accepted; refuses a tag beyond
  // kTagBits and a null buffer with bytes.
  StatusOr<Slot*> AllocateSlot(bool is_send, int peer, p2p::Tag tag, const void* data,
                               size_t bytes);
  Slot* Lookup(p2p::RequestId id) const;
  p2p::RequestId IdOf(const Slot* slot) const;
  // Releases a slot whose UCX request has completed (or never existed).
  void Release(Slot* slot);
  // Ends a wait's hold on `slots`: those released meanwhile (inside its
  // watchdog) go back to the free list.
  void LetGo(std::span<Slot* const> slots);
  // Whether a call inside the watchdog gave up `slot` while a wait held it.
  static bool GivenUpWhileHeld(const Slot* slot);
  // Cancels a pending slot; UCX may still own its request, in which case the
  // callback frees both later. Recall must follow before the caller gets
  // its buffers back.
  void Abandon(Slot* slot);
  // Waits (bounded) until UCX has completed every abandoned request: a short
  // grace for those it could not cancel, then their peers' endpoints are
  // closed by force and the peers marked lost. Stops waiting at `limit`.
  void Recall(Deadline limit);
  void CloseEndpointsOfAbandoned(bool lost_peers_only, Deadline limit);
  // The status of a finished slot: OK, its UCX error or a size mismatch.
  Status SlotStatus(const Slot* slot) const;
  // A pending slot's error learned from outside the request (peer lost).
  Status PendingSlotStatus(const Slot* slot) const;
  // A wait's poll counts.
  struct Polls {
    int idle = 0;         // consecutive polls that found nothing to do (saturates)
    unsigned total = 0;   // every poll; paces the clock reads
  };
  // One poll of the worker; in yield mode, past the threshold, an idle poll
  // yields. Returns whether the poll found work.
  bool Poll(Polls& polls);
  // After an idle poll: yields or sleeps on the event fd as the idle mode
  // asks, sleeping at most `max_sleep` and not past `deadline`.
  Status BackOff(const Polls& polls, Clock::time_point now, Deadline deadline,
                 std::chrono::milliseconds max_sleep);
  // One poll of the worker plus back-off, deadline and watchdog handling,
  // for a wait on `pending` (the first not done yet). Past the deadline,
  // the wait still succeeds when that very poll completed what it needs
  // (every request, or with `any` one of them), and fails with the error of
  // a request that poll failed (or whose peer is lost); otherwise a timeout
  // names the first still pending, or every one when `any` (WaitAny) and
  // there are several. The watchdog hears of every pending request's peer, and
  // its failure ends the wait unless the drain after it completes one of
  // `pending`.
  Status Idle(Polls& polls, Deadline deadline, Clock::time_point started,
              std::span<Slot* const> pending, bool any);
  // One poll plus back-off, for loops that wait on UCX alone until `until`
  // (closes, recalls): a same-host peer sharing the core still gets to run.
  void PollUntil(Polls& polls, Deadline until);
  std::string Describe(const Slot* slot) const;
  // The first few of a WaitAny's requests, and how many more.
  std::string DescribeAny(std::span<Slot* const> slots) const;

  // Members are destroyed bottom-up: requests, then endpoints, then the
  // worker, then the context, which is the order UCX requires.
  std::shared_ptr<Context> context_;
  std::unique_ptr<Worker> worker_;
  std::vector<std::unique_ptr<PeerState>> peers_;
  // Peer states of failed Connect attempts (see Connect), kept for UCX's
  // error callbacks until the destructor has destroyed the worker.
  std::vector<std::unique_ptr<PeerState>> retired_peers_;
  std::vector<ucp_ep_h> endpoints_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<uint32_t> free_slots_;
  // Notices in flight. Still alive while the destructor resets the worker,
  // which completes the last ones through NoticeCallback.
  std::list<Notice> notices_;
  P2pOptions options_;
  std::function<Status(Deadline, std::span<const int>)> watchdog_;
  Clock::time_point next_watchdog_{};
  // How long Cancel/CancelAll may wait: the enclosing wait's deadline while
  // the watchdog runs (it may cancel), otherwise no limit of its own.
  Deadline cancel_limit_ = Deadline::max();
  uint64_t waits_ = 0;  // WaitAll calls so far
  int abandoned_ = 0;   // abandoned slots whose request UCX still holds
  uint64_t unconfirmed_releases_ = 0;  // see UnconfirmedReleases
  bool closed_ = false;
};

}  // namespace ddp::transport::ucx

#endif  // DDP_TRANSPORT_UCX_UCX_P2P_H_
