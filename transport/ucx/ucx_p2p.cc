#include "transport/ucx/ucx_p2p.h"

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>
#include <thread>

#include "transport/ucx/ucx_status.h"

namespace ddp::transport::ucx {

// One outstanding send or receive. Slots are heap-allocated and never move,
// because UCX callbacks hold a pointer to them as user_data.
struct UcxPointToPoint::Slot {
  UcxPointToPoint* owner = nullptr;
  uint32_t index = 0;
  uint32_t generation = 0;  // bumped on release so stale ids are rejected
  bool in_use = false;
  bool done = false;
  bool abandoned = false;  // cancelled while UCX still owned the request
  bool unconfirmed = false;  // abandoned, and still with UCX after its recall
  bool is_send = false;
  bool watched = false;  // MarkWatched: a receive the caller may do without
  bool held = false;     // listed by the wait now running (see Release)
  bool released_while_held = false;  // released, back on the free list once unheld
  uint64_t listed_in = 0;  // the last WaitAll that listed it: repeats are errors
  int peer = 0;
  p2p::Tag tag = 0;
  size_t bytes = 0;
  ucs_status_t ucs = UCS_OK;
  ucp_tag_recv_info_t info{};
  void* request = nullptr;  // UCX's request; nullptr when completed inline
};

namespace {

constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};

constexpr ucp_tag_t kUserChannel = ucp_tag_t{1} << 63;

// Progress passes a wait makes, at most, to take in what a peer sent before
// the watchdog found it gone; each pass handles up to 16 shared-memory
// messages or one socket read.
constexpr int kDrainPolls = 1024;

// UCX cancels only receives it has not matched yet. A matched receive (the
// rest of a rendezvous or multi-fragment message still to come) and every
// send keep using the caller's buffer: after a cancel they get
// P2pOptions::recall_grace to complete, then their peer's endpoint is closed
// by force, which completes them; the wait for that is bounded by
// kForceCloseTime.
constexpr auto kForceCloseTime = std::chrono::milliseconds(1000);

// A wait that fails gets its requests back before it returns (Recall), but
// never more than this past its deadline: a send or matched receive to a
// live peer may still complete until kRecallGraceOverrun after it, and the
// forced closes get the rest (at least one progress pass). What UCX still
// holds then is counted unconfirmed.
constexpr auto kRecallOverrun = std::chrono::milliseconds(20);
// Part of kRecallOverrun: even a wait whose deadline has passed gives a
// request that is about to complete this long before closing its peer by
// force (which makes the peer lost for later calls).
constexpr auto kRecallGraceOverrun = std::chrono::milliseconds(10);

// How long a sleeping wait sleeps between polls where its context has no
// wakeup (set by Create or set_idle_mode): a message is noticed at most this late.
constexpr auto kSleepStepWithoutWakeup = std::chrono::microseconds(500);

// Why a wait run inside the watchdog refuses a request.
constexpr char kHeldByOuterWait[] = " held by the wait whose watchdog runs this one";

ucp_tag_t WireTag(bool user, int source, p2p::Tag tag) {
  return (user ? kUserChannel : 0) | (static_cast<ucp_tag_t>(source) << p2p::kTagBits) | tag;
}

// UCX cannot check a worker address: it has no length, and UCX 1.13 aborts
// (an assertion) on one whose first byte names an address format it does
// not know. That byte's low 4 bits are the format: 0 or 1 in UCX 1.13
// (UCX_ADDRESS_VERSION=v1 or v2), and this worker's own in any UCX. Other
// damage UCX reports as INVALID_PARAM.
Status CheckWorkerAddress(const std::string& address, const std::string& own, int peer) {
  if (address.empty()) {
    return InvalidArgumentError("empty UCX worker address for rank " + std::to_string(peer));
  }
  constexpr unsigned kFormatMask = 0x0f;
  constexpr unsigned kLastFormatOfUcx113 = 1;
  const unsigned format = static_cast<unsigned char>(address[0]) & kFormatMask;
  const unsigned own_format = static_cast<unsigned char>(own[0]) & kFormatMask;
  if (format > kLastFormatOfUcx113 && format != own_format) {
    return InvalidArgumentError("UCX worker address for rank " + std::to_string(peer) +
                                " has format " + std::to_string(format) + ", unknown to this UCX" +
                                " (not a worker address, or one from another UCX)");
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<UcxPointToPoint>> UcxPointToPoint::Create(
    std::shared_ptr<Context> context, const P2pOptions& options) {
  if (context == nullptr) return InvalidArgumentError("UCX point-to-point: no context (null)");
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return InvalidArgumentError("rank " + std::to_string(options.rank) +
                                " is outside a world of size " + std::to_string(options.size));
  }
  if (options.size > (1 << (64 - p2p::kTagBits - 2))) {
    return InvalidArgumentError("world size " + std::to_string(options.size) +
                                " does not fit in the tag's rank bits");
  }
  if (options.polls_per_clock_read < 1 ||
      (options.polls_per_clock_read & (options.polls_per_clock_read - 1)) != 0) {
    return InvalidArgumentError("polls_per_clock_read " +
                                std::to_string(options.polls_per_clock_read) +
                                " is not a power of two");
  }
  // A poll that finds work may take long (a socket's worth of a large
  // message over TCP): with thousands of polls between clock reads, a
  // wait would look at its deadline and run its watchdog far too late.
  constexpr int kMostPollsPerClockRead = 256;
  if (options.polls_per_clock_read > kMostPollsPerClockRead) {
    return InvalidArgumentError("polls_per_clock_read " +
                                std::to_string(options.polls_per_clock_read) +
                                " is more than the most, " +
                                std::to_string(kMostPollsPerClockRead));
  }
  // A sleeping wait sleeps at most a watchdog period between looks at its
  // deadline: a negative period made it block in epoll_wait with no
  // timeout at all, and zero made it spin.
  if (options.watchdog_period <= std::chrono::milliseconds(0)) {
    return InvalidArgumentError("watchdog_period of " +
                                std::to_string(options.watchdog_period.count()) +
                                " ms is not positive");
  }
  if (options.recall_grace < std::chrono::milliseconds(0)) {
    return InvalidArgumentError("recall_grace of " + std::to_string(options.recall_grace.count()) +
                                " ms is negative");
  }
  if (options.idle_polls_before_backoff < 0) {
    return InvalidArgumentError("idle_polls_before_backoff " +
                                std::to_string(options.idle_polls_before_backoff) +
                                " is negative");
  }
  DDP_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker, Worker::Create(context));
  return std::unique_ptr<UcxPointToPoint>(
      new UcxPointToPoint(std::move(context), std::move(worker), options));
}

UcxPointToPoint::UcxPointToPoint(std::shared_ptr<Context> context, std::unique_ptr<Worker> worker,
                                 const P2pOptions& options)
    : context_(std::move(context)), worker_(std::move(worker)), options_(options) {
}

UcxPointToPoint::~UcxPointToPoint() {
  if (!closed_) Close(DeadlineIn(std::chrono::milliseconds(2000))).IgnoreError();
  // The worker before the slots (declared after it): destroying the worker
  // completes the sends it still holds (one the peer never took, whose
  // endpoint's flush gave up), and their callbacks release their slots.
  worker_.reset();
}

Status UcxPointToPoint::Connect(std::span<const std::string> addresses,
                                const std::vector<bool>& same_host) {
  // After Close nothing may be sent, and nothing would close new endpoints
  // before the worker goes.
  if (closed_) return FailedPreconditionError("Connect after the transport was closed");
  if (!endpoints_.empty()) return FailedPreconditionError("UCX endpoints already connected");
  if (static_cast<int>(addresses.size()) != options_.size) {
    return InvalidArgumentError("expected " + std::to_string(options_.size) +
                                " worker addresses, got " + std::to_string(addresses.size()));
  }
  if (!same_host.empty() && static_cast<int>(same_host.size()) != options_.size) {
    return InvalidArgumentError("same_host has " + std::to_string(same_host.size()) +
                                " entries for a world of size " + std::to_string(options_.size));
  }
  // Every address is checked before any endpoint exists, so that a bad one
  // leaves nothing half-connected.
  for (int peer = 0; peer < options_.size; ++peer) {
    DDP_RETURN_IF_ERROR(CheckWorkerAddress(addresses[peer], worker_->address(), peer));
  }
  // Fresh states for each attempt, those of failed attempts kept until the
  // worker goes: an endpoint of a failed attempt whose close UCX did not
  // confirm may still call its error callback, which holds a pointer to its
  // peer's state, and must not fail the new connection.
  for (auto& state : peers_) retired_peers_.push_back(std::move(state));
  peers_.clear();
  for (int peer = 0; peer < options_.size; ++peer) {
    const bool local = peer == options_.rank || same_host.empty() || same_host[peer];
    peers_.push_back(std::make_unique<PeerState>(
        PeerState{.owner = this, .rank = peer, .peer_error_mode = !local}));
  }
  endpoints_.assign(options_.size, nullptr);
  for (int peer = 0; peer < options_.size; ++peer) {
    const bool local = !peers_[peer]->peer_error_mode;
    ucp_ep_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(addresses[peer].data());
    // Peer mode: a dead peer completes our requests with an error instead of
    // leaving them pending forever. Shared memory cannot do that in UCX 1.13
    // (selecting it would push local traffic onto TCP loopback), so local
    // peers are watched by pid instead (see Connect's comment).
    params.err_mode = local ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &UcxPointToPoint::EndpointErrorCallback;
    params.err_handler.arg = peers_[peer].get();
    Status created = FromUcs(ucp_ep_create(worker_->get(), &params, &endpoints_[peer]),
                             "connecting to rank " + std::to_string(peer));
    if (!created.ok()) {
      // Close the endpoints made so far (nothing was sent on them), so that
      // later calls fail as before Connect() and Connect may be retried.
      endpoints_[peer] = nullptr;
      std::vector<int> made(peer);
      std::iota(made.begin(), made.end(), 0);
      CloseEndpoints(made, /*force_remote=*/true, DeadlineIn(std::chrono::milliseconds(1000)))
          .IgnoreError();
      endpoints_.clear();
      return created;
    }
  }
  return Status::Ok();
}

void UcxPointToPoint::set_idle_mode(IdleMode mode, int idle_polls_before_backoff) {
  // kSleep on a context without wakeup sleeps in short steps (BackOff),
  // here as in Create: the same option is valid whenever it is set.
  options_.idle_mode = mode;
  options_.idle_polls_before_backoff = std::max(idle_polls_before_backoff, 0);
}

void UcxPointToPoint::SetWatchdog(std::function<Status(Deadline, std::span<const int>)> check) {
  watchdog_ = std::move(check);
}

void UcxPointToPoint::MarkPeerLost(int peer, Status reason) {
  if (peer < 0 || peer >= static_cast<int>(peers_.size())) return;
  if (peers_[peer]->failure.ok()) peers_[peer]->failure = std::move(reason);
}

std::vector<int> UcxPointToPoint::PeersWithFailedEndpoints() {
  worker_->Progress();
  std::vector<int> failed;
  for (const auto& peer : peers_) {
    if (peer->endpoint_failed) failed.push_back(peer->rank);
  }
  return failed;
}

void UcxPointToPoint::EndpointErrorCallback(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* peer = static_cast<PeerState*>(arg);
  peer->endpoint_failed = true;
  if (peer->failure.ok()) {
    Status s = FromUcs(status, "connection to rank " + std::to_string(peer->rank));
    // Whatever UCX calls it, an endpoint error means the peer is unreachable.
    peer->failure = PeerLostError(s.message());
  }
}

Status UcxPointToPoint::Close(Deadline deadline, bool force_remote) {
  if (closed_) return Status::Ok();
  closed_ = true;
  // Requests first: abandon whatever is still pending, and get back from
  // UCX what it does not give up by itself.
  for (auto& slot : slots_) {
    if (slot->in_use && !slot->abandoned) Abandon(slot.get());
  }
  Recall(deadline);
  // Then endpoints: flush those whose peer is alive, force the others.
  std::vector<int> all(endpoints_.size());
  std::iota(all.begin(), all.end(), 0);
  Status result = CloseEndpoints(all, force_remote, deadline);
  // Abandoned requests complete with an error once their endpoints are gone,
  // and notices (PostNotice, never abandoned) with their endpoint's flush or
  // close; give both one last chance before the worker goes.
  for (int i = 0; i < 100 && (abandoned_ > 0 || !notices_.empty()); ++i) worker_->Progress();
  return result;
}

bool UcxPointToPoint::AwaitRequests(std::span<void*> requests, Deadline until) {
  Polls polls;
  while (true) {
    bool pending = false;
    for (void*& request : requests) {
      if (request == nullptr) continue;
      if (ucp_request_check_status(request) == UCS_INPROGRESS) {
        pending = true;
      } else {
        ucp_request_free(request);
        request = nullptr;
      }
    }
    if (!pending) return false;
    // At least one progress pass, also when `until` has passed already.
    if (polls.total > 0 && Clock::now() > until) return true;
    PollUntil(polls, until);
    ++polls.total;
  }
}

Status UcxPointToPoint::CloseEndpoints(std::span<const int> peers, bool force_remote,
                                       Deadline deadline) {
  std::vector<void*> closing;
  std::vector<int> closing_peers;  // closing[i] is the endpoint to closing_peers[i]
  // The first close UCX refused, and the ranks of any later ones: those
  // endpoints stay open until the worker is destroyed (which destroys
  // them), and Close reports every one.
  Status refused;
  std::string also_refused;
  auto close = [&](int peer, bool force) {
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* request = ucp_ep_close_nbx(endpoints_[peer], &param);
    if (UCS_PTR_IS_PTR(request)) {
      closing.push_back(request);
      closing_peers.push_back(peer);
    } else if (UCS_PTR_IS_ERR(request) && !refused.ok()) {
      also_refused += (also_refused.empty() ? "" : ", ") + std::to_string(peer);
    } else if (UCS_PTR_IS_ERR(request)) {
      // Not the caller's bad argument: UCX 1.13 cannot force an endpoint
      // without peer error mode (one to a lost rank on this host).
      refused = FailedPreconditionError(
          FromUcs(UCS_PTR_STATUS(request),
                  std::string("closing UCX endpoints: the ") + (force ? "forced " : "") +
                      "close of the endpoint to rank " + std::to_string(peer) +
                      " was refused (left open until the worker is destroyed)")
              .message());
    }
    endpoints_[peer] = nullptr;
  };
  std::vector<void*> flushing;
  std::vector<int> flushing_peers;  // flushing[i] is the endpoint to flushing_peers[i]
  for (int peer : peers) {
    if (endpoints_[peer] == nullptr) continue;
    // Force only where the peer is gone, or may be (force_remote): flushing
    // towards it would wait for an answer that never comes, and UCX 1.13
    // asserts when a worker is destroyed while a closing endpoint still
    // holds sends. UCX asks for peer error mode on both sides for a forced
    // close: remote endpoints have it on both sides, and a dead peer has no
    // side left to disturb. (UCX 1.13 refuses, INVALID_PARAM, to force an
    // endpoint without it, to a lost rank on this host: that one is left
    // open until the worker's destruction.)
    const bool force = !peers_[peer]->failure.ok() ||
                       (force_remote && peers_[peer]->peer_error_mode);
    if (!force && peers_[peer]->peer_error_mode) {
      // A live remote peer is flushed before its endpoint is closed: UCX
      // takes no second close of an endpoint, so one whose close (flush)
      // did not finish could not be forced afterwards, and would still be
      // closing when the worker goes (a peer that hangs, or is stopped).
      ucp_request_param_t param;
      std::memset(&param, 0, sizeof(param));
      void* request = ucp_ep_flush_nbx(endpoints_[peer], &param);
      if (UCS_PTR_IS_PTR(request)) {
        flushing.push_back(request);
        flushing_peers.push_back(peer);
        continue;
      }
      close(peer, /*force=*/UCS_PTR_IS_ERR(request));
      continue;
    }
    close(peer, force);
  }
  auto name_also_refused = [&] {
    if (also_refused.empty()) return;
    refused = FailedPreconditionError(refused.message() +
                                      "; so was the close of the endpoint(s) to rank(s) " +
                                      also_refused);
    also_refused.clear();
  };
  // Every flush still pending at the deadline, its peer's endpoint then
  // closed by force (which completes the flush, and UCX frees it then).
  std::string unflushed;
  const bool flush_timed_out = AwaitRequests(flushing, deadline);
  for (size_t i = 0; i < flushing.size(); ++i) {
    const bool flushed = flushing[i] == nullptr;
    if (!flushed) {
      ucp_request_free(flushing[i]);
      unflushed += (unflushed.empty() ? "" : ", ") + std::to_string(flushing_peers[i]);
    }
    close(flushing_peers[i], /*force=*/!flushed || !peers_[flushing_peers[i]]->failure.ok());
  }
  name_also_refused();
  // The forced closes of peers that did not take the flush get their own
  // bound: the flush has used up the deadline.
  const Deadline until = flush_timed_out ? DeadlineIn(kForceCloseTime) : deadline;
  if (AwaitRequests(closing, until)) {
    // The worker's destruction releases what is left.
    std::string ranks;
    for (size_t i = 0; i < closing.size(); ++i) {
      if (closing[i] == nullptr) continue;
      ucp_request_free(closing[i]);
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(closing_peers[i]);
    }
    return TimedOutError("closing UCX endpoints: rank(s) " + ranks +
                         " did not confirm the close in time" +
                         (refused.ok() ? std::string() : "; " + refused.message()));
  }
  DDP_RETURN_IF_ERROR(refused);
  if (!unflushed.empty()) {
    return TimedOutError("closing UCX endpoints: rank(s) " + unflushed +
                         " did not take what was sent in time; closed by force");
  }
  return Status::Ok();
}

Status UcxPointToPoint::CheckPeer(int peer, p2p::Tag tag, const char* what) const {
  // Built only for an error: every post passes through here.
  auto post = [&] {
    return std::string(what) + " rank " + std::to_string(peer) + " (tag " + std::to_string(tag) +
           ")";
  };
  if (closed_) return FailedPreconditionError(post() + ": the transport was closed");
  if (peer < 0 || peer >= options_.size) {
    return InvalidArgumentError(std::string(what) + " rank " + std::to_string(peer) +
                                " outside a world of size " + std::to_string(options_.size));
  }
  if (endpoints_.empty()) {
    return FailedPreconditionError(post() + ": not connected (Connect() not called, or it failed)");
  }
  const Status& failure = peers_[peer]->failure;
  if (!failure.ok()) {
    // This post first, then why its peer is gone (which may name an
    // earlier operation that gave it up).
    return Status(failure.code(), post() + ": " + failure.message());
  }
  return Status::Ok();
}

StatusOr<UcxPointToPoint::Slot*> UcxPointToPoint::AllocateSlot(bool is_send, int peer,
                                                               p2p::Tag tag, const void* data,
                                                               size_t bytes) {
  if (tag > p2p::kMaxTag) {
    return InvalidArgumentError(std::string(is_send ? "send to" : "receive from") + " rank " +
                                std::to_string(peer) + ": tag " + std::to_string(tag) +
                                " exceeds " + std::to_string(p2p::kTagBits) + " bits");
  }
  // UCX would read (send) or write (receive) through it, and crash.
  if (bytes > 0 && data == nullptr) {
    return InvalidArgumentError(std::string(is_send ? "send to" : "receive from") + " rank " +
                                std::to_string(peer) + " (tag " + std::to_string(tag) +
                                "): null buffer for " + std::to_string(bytes) + " bytes");
  }
  Slot* slot;
  if (!free_slots_.empty()) {
    slot = slots_[free_slots_.back()].get();
    free_slots_.pop_back();
  } else {
    slots_.push_back(std::make_unique<Slot>());
    slot = slots_.back().get();
    slot->owner = this;
    slot->index = static_cast<uint32_t>(slots_.size() - 1);
  }
  slot->in_use = true;
  slot->done = false;
  slot->abandoned = false;
  slot->unconfirmed = false;
  slot->is_send = is_send;
  slot->watched = false;
  slot->held = false;
  slot->released_while_held = false;
  slot->peer = peer;
  slot->tag = tag;
  slot->bytes = bytes;
  slot->ucs = UCS_OK;
  slot->info = {};
  slot->request = nullptr;
  return slot;
}

p2p::RequestId UcxPointToPoint::IdOf(const Slot* slot) const {
  return (static_cast<uint64_t>(slot->generation) << 32) | (slot->index + 1);
}

UcxPointToPoint::Slot* UcxPointToPoint::Lookup(p2p::RequestId id) const {
  const uint64_t index_plus_one = id & 0xffffffffu;
  if (index_plus_one == 0 || index_plus_one > slots_.size()) return nullptr;
  Slot* slot = slots_[index_plus_one - 1].get();
  if (!slot->in_use || slot->abandoned || slot->generation != (id >> 32)) return nullptr;
  return slot;
}

void UcxPointToPoint::Release(Slot* slot) {
  if (slot->request != nullptr) ucp_request_free(slot->request);
  slot->request = nullptr;
  slot->in_use = false;
  if (slot->abandoned) --abandoned_;
  slot->abandoned = false;
  ++slot->generation;
  // Released by a call inside the watchdog (Cancel, Test, Close) of the
  // wait that holds it: that wait still reads the slot, so it goes back to
  // the free list when the wait lets go of it (LetGo), not now, when a
  // later post could take it and a second release would list it twice.
  if (slot->held) {
    slot->released_while_held = true;
    return;
  }
  free_slots_.push_back(slot->index);
}

void UcxPointToPoint::LetGo(std::span<Slot* const> slots) {
  for (Slot* slot : slots) {
    slot->held = false;
    if (slot->released_while_held) {
      slot->released_while_held = false;
      free_slots_.push_back(slot->index);
    }
  }
}

bool UcxPointToPoint::GivenUpWhileHeld(const Slot* slot) {
  return slot->released_while_held || slot->abandoned;
}

void UcxPointToPoint::Abandon(Slot* slot) {
  if (slot->done || slot->request == nullptr) {
    Release(slot);
    return;
  }
  slot->abandoned = true;
  ++abandoned_;
  // A receive that UCX has not matched yet completes at once (the callback
  // runs with CANCELED and releases the slot); anything else keeps running
  // until Recall gets it back.
  ucp_request_cancel(worker_->get(), slot->request);
}

void UcxPointToPoint::Recall(Deadline limit) {
  if (abandoned_ == 0) return;
  // The grace ends kRecallGraceOverrun past `limit`; forced closes may run
  // kRecallOverrun past it (from now, when `limit` has passed already), so
  // that they still get a progress pass.
  const Deadline limit_or_now = std::max(limit, Clock::now());
  const Deadline hard_limit = DeadlineAfter(limit_or_now, kRecallOverrun);
  // Requests with a lost peer never complete by themselves.
  CloseEndpointsOfAbandoned(/*lost_peers_only=*/true, hard_limit);
  const Deadline grace =
      std::min(DeadlineIn(options_.recall_grace), DeadlineAfter(limit_or_now, kRecallGraceOverrun));
  auto live_peer_left = [this] {
    for (const auto& slot : slots_) {
      if (slot->in_use && slot->abandoned && peers_[slot->peer]->failure.ok()) return true;
    }
    return false;
  };
  Polls polls;
  while (live_peer_left() && Clock::now() < grace) PollUntil(polls, grace);
  CloseEndpointsOfAbandoned(/*lost_peers_only=*/false, hard_limit);
  // What is still abandoned now (same-host peers, or a limit that came
  // first) may use its buffer after the caller got it back: counted once
  // each, so that callers keep such buffers (algorithms' Scratch).
  for (const auto& slot : slots_) {
    if (slot->in_use && slot->abandoned && !slot->unconfirmed) {
      slot->unconfirmed = true;
      ++unconfirmed_releases_;
    }
  }
}

void UcxPointToPoint::CloseEndpointsOfAbandoned(bool lost_peers_only, Deadline limit) {
  std::vector<int> owners;
  for (const auto& slot : slots_) {
    if (!slot->in_use || !slot->abandoned) continue;
    const int peer = slot->peer;
    if (lost_peers_only && peers_[peer]->failure.ok()) continue;
    // Later operations with the peer fail with this. Its side may see
    // errors once the endpoint is gone: the price of never writing into a
    // buffer the caller got back.
    MarkPeerLost(peer, PeerLostError("rank " + std::to_string(peer) + " given up: " +
                                     Describe(slot.get()) +
                                     " was still running after it was cancelled"));
    // UCX 1.13 refuses to close an endpoint by force without peer error
    // mode (those to ranks on this host): such a request stays with UCX
    // until it completes, or the peer's process or this worker is gone.
    if (!peers_[peer]->peer_error_mode || endpoints_[peer] == nullptr) continue;
    if (std::find(owners.begin(), owners.end(), peer) == owners.end()) owners.push_back(peer);
  }
  if (owners.empty()) return;
  const Deadline deadline = std::min(DeadlineIn(kForceCloseTime), limit);
  CloseEndpoints(owners, /*force_remote=*/true, deadline).IgnoreError();
  // The forced close completes their requests with CANCELED, and the
  // callbacks release the slots.
  auto owned_left = [&] {
    for (const auto& slot : slots_) {
      if (slot->in_use && slot->abandoned &&
          std::find(owners.begin(), owners.end(), slot->peer) != owners.end()) {
        return true;
      }
    }
    return false;
  };
  // At least one pass, also when `limit` has passed: a forced close
  // usually completes its requests in the next progress.
  Polls polls;
  do {
    PollUntil(polls, deadline);
  } while (owned_left() && Clock::now() < deadline);
}

void UcxPointToPoint::SendCallback(void* request, ucs_status_t status, void* user_data) {
  auto* slot = static_cast<Slot*>(user_data);
  slot->done = true;
  slot->ucs = status;
  slot->request = request;
  if (slot->abandoned) slot->owner->Release(slot);
}

void UcxPointToPoint::RecvCallback(void* request, ucs_status_t status,
                                   const ucp_tag_recv_info_t* info, void* user_data) {
  auto* slot = static_cast<Slot*>(user_data);
  slot->done = true;
  slot->ucs = status;
  if (status == UCS_OK && info != nullptr) slot->info = *info;
  slot->request = request;
  if (slot->abandoned) slot->owner->Release(slot);
}

void UcxPointToPoint::NoticeCallback(void* request, ucs_status_t, void* user_data) {
  // Delivered, or dropped (the endpoint closed or failed): either way done.
  auto* notice = static_cast<Notice*>(user_data);
  notice->done = true;
  notice->request = request;
  if (notice->posted) notice->owner->EraseNotice(notice);
}

void UcxPointToPoint::EraseNotice(Notice* notice) {
  if (notice->request != nullptr) ucp_request_free(notice->request);
  notices_.remove_if([notice](const Notice& n) { return &n == notice; });
}

Status UcxPointToPoint::PostNotice(int peer, p2p::Tag tag, const void* data, size_t bytes) {
  DDP_RETURN_IF_ERROR(CheckPeer(peer, tag, "notice to"));
  if (tag > p2p::kMaxTag) {
    return InvalidArgumentError("notice to rank " + std::to_string(peer) + ": tag " +
                                std::to_string(tag) + " exceeds " +
                                std::to_string(p2p::kTagBits) + " bits");
  }
  if (bytes > p2p::kMaxNoticeBytes || (bytes > 0 && data == nullptr)) {
    return InvalidArgumentError("notice of " + std::to_string(bytes) + " bytes to rank " +
                                std::to_string(peer) +
                                (bytes > p2p::kMaxNoticeBytes
                                     ? " is larger than " + std::to_string(p2p::kMaxNoticeBytes)
                                     : std::string(" has a null buffer")));
  }
  int in_flight = 0;
  for (const Notice& n : notices_) in_flight += n.peer == peer ? 1 : 0;
  if (in_flight >= p2p::kMaxNoticesPerPeer) {
    return UnavailableError("notice to rank " + std::to_string(peer) + ": " +
                            std::to_string(in_flight) + " earlier notices to it are in flight");
  }
  Notice& notice = notices_.emplace_back();
  notice.owner = this;
  notice.peer = peer;
  notice.bytes.assign(static_cast<const unsigned char*>(data),
                      static_cast<const unsigned char*>(data) + bytes);
  ucp_request_param_t param;
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxPointToPoint::NoticeCallback;
  param.user_data = &notice;
  void* request = ucp_tag_send_nbx(endpoints_[peer], notice.bytes.data(), bytes,
                                   WireTag(false, options_.rank, tag), &param);
  notice.posted = true;
  if (UCS_PTR_IS_ERR(request)) {
    EraseNotice(&notice);
    return FromUcsOfPeerTraffic(UCS_PTR_STATUS(request), "notice to rank " + std::to_string(peer));
  }
  // Completed inline (UCX has copied the bytes), or already by a callback.
  if (request == nullptr || notice.done) {
    if (notice.request == nullptr) notice.request = request;
    EraseNotice(&notice);
    return Status::Ok();
  }
  notice.request = request;
  return Status::Ok();
}

StatusOr<p2p::RequestId> UcxPointToPoint::PostSend(int peer, p2p::Tag tag, const void* data,
                                                   size_t bytes) {
  return Send(false, peer, tag, data, bytes);
}

StatusOr<p2p::RequestId> UcxPointToPoint::PostUserSend(int peer, p2p::Tag tag, const void* data,
                                                       size_t bytes) {
  return Send(true, peer, tag, data, bytes);
}

StatusOr<p2p::RequestId> UcxPointToPoint::PostRecv(int peer, p2p::Tag tag, void* data,
                                                   size_t bytes) {
  return Recv(false, peer, tag, data, bytes);
}

StatusOr<p2p::RequestId> UcxPointToPoint::PostUserRecv(int peer, p2p::Tag tag, void* data,
                                                       size_t bytes) {
  return Recv(true, peer, tag, data, bytes);
}

StatusOr<p2p::RequestId> UcxPointToPoint::Send(bool user, int peer, p2p::Tag tag,
                                               const void* data, size_t bytes) {
  DDP_RETURN_IF_ERROR(CheckPeer(peer, tag, "send to"));
  DDP_ASSIGN_OR_RETURN(Slot * slot, AllocateSlot(true, peer, tag, data, bytes));
  ucp_request_param_t param;
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxPointToPoint::SendCallback;
  param.user_data = slot;
  void* request = ucp_tag_send_nbx(endpoints_[peer], data, bytes,
                                   WireTag(user, options_.rank, tag), &param);
  if (UCS_PTR_IS_ERR(request)) {
    Release(slot);
    return FromUcsOfPeerTraffic(UCS_PTR_STATUS(request), "tag send to rank " + std::to_string(peer));
  }
  if (request == nullptr) {
    slot->done = true;  // completed inline: the buffer is already reusable
  } else if (!slot->done) {
    slot->request = request;
  }
  return IdOf(slot);
}

StatusOr<p2p::RequestId> UcxPointToPoint::Recv(bool user, int peer, p2p::Tag tag, void* data,
                                               size_t bytes) {
  // A lost peer may have sent what this receive is for before it went: a
  // rank that finished its part and left cleanly (its endpoint's close
  // reads here as an endpoint error) while this one was still busy
  // elsewhere. UCX keeps such a message until a receive takes it, so the
  // receive is posted all the same, and fails only when nothing it could
  // take has come.
  const Status checked = CheckPeer(peer, tag, "receive from");
  const bool lost = !checked.ok() && !closed_ && peer >= 0 && peer < options_.size &&
                    !endpoints_.empty() && !peers_[peer]->failure.ok();
  if (!checked.ok() && !lost) return checked;
  DDP_ASSIGN_OR_RETURN(Slot * slot, AllocateSlot(false, peer, tag, data, bytes));
  ucp_request_param_t param;
  // No immediate completion: UCX 1.13 leaves recv_info unset when a receive
  // completes inline, and the received length is how a count mismatch
  // between ranks is caught.
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &UcxPointToPoint::RecvCallback;
  param.user_data = slot;
  param.recv_info.tag_info = &slot->info;
  void* request = ucp_tag_recv_nbx(worker_->get(), data, bytes, WireTag(user, peer, tag), kFullMask,
                                   &param);
  if (UCS_PTR_IS_ERR(request)) {
    Release(slot);
    return FromUcsOfPeerTraffic(UCS_PTR_STATUS(request), "tag receive from rank " + std::to_string(peer));
  }
  if (request == nullptr) {
    Release(slot);
    return InternalError("UCX completed a receive inline despite NO_IMM_CMPL");
  }
  if (!slot->done) slot->request = request;
  if (lost) {
    // The rest of a message that came in fragments is still to be taken
    // in; bounded, as the drain after a watchdog report is.
    for (int i = 0; i < kDrainPolls && !slot->done; ++i) {
      if (worker_->Progress() == 0) break;
    }
    if (!slot->done) {
      Abandon(slot);
      Recall(cancel_limit_);
      return checked;
    }
  }
  return IdOf(slot);
}

std::string UcxPointToPoint::Describe(const Slot* slot) const {
  std::ostringstream out;
  out << (slot->is_send ? "send of " : "receive of ") << slot->bytes << " bytes "
      << (slot->is_send ? "to" : "from") << " rank " << slot->peer << " (tag " << slot->tag << ")";
  return out.str();
}

std::string UcxPointToPoint::DescribeAny(std::span<Slot* const> slots) const {
  constexpr size_t kNamed = 4;
  std::string out = "WaitAny: each of " + std::to_string(slots.size()) + " requests (";
  for (size_t i = 0; i < slots.size() && i < kNamed; ++i) {
    out += (i == 0 ? "" : "; ") + Describe(slots[i]);
  }
  if (slots.size() > kNamed) out += "; and " + std::to_string(slots.size() - kNamed) + " more";
  return out + ")";
}

Status UcxPointToPoint::SlotStatus(const Slot* slot) const {
  if (slot->ucs == UCS_ERR_MESSAGE_TRUNCATED) {
    return InvalidArgumentError(Describe(slot) + ": rank " + std::to_string(slot->peer) +
                                " sent a larger message (counts differ across ranks?)");
  }
  if (slot->ucs != UCS_OK) {
    // An endpoint error that the error callback already attributed to the
    // peer is the more useful message.
    const Status& failure = peers_[slot->peer]->failure;
    if (!failure.ok()) return Status(failure.code(), Describe(slot) + ": " + failure.message());
    return FromUcsOfPeerTraffic(slot->ucs, Describe(slot));
  }
  if (!slot->is_send && slot->info.length != slot->bytes) {
    return InvalidArgumentError(Describe(slot) + ": rank " + std::to_string(slot->peer) +
                                " sent " + std::to_string(slot->info.length) +
                                " bytes (counts differ across ranks?)");
  }
  return Status::Ok();
}

Status UcxPointToPoint::PendingSlotStatus(const Slot* slot) const {
  const Status& failure = peers_[slot->peer]->failure;
  if (!failure.ok()) return Status(failure.code(), Describe(slot) + ": " + failure.message());
  return Status::Ok();
}

bool UcxPointToPoint::Poll(Polls& polls) {
  const bool busy = worker_->Progress() != 0;
  if (busy) {
    polls.idle = 0;
  } else if (polls.idle < std::numeric_limits<int>::max()) {
    ++polls.idle;  // saturates: a wait of minutes would overflow it
  }
  // Yielding waits give up the core at every idle poll once past the
  // threshold (with a threshold of 1, over TCP, the kernel's network stack
  // gets the core as soon as there is nothing to do).
  if (!busy && options_.idle_mode == IdleMode::kYield &&
      polls.idle >= options_.idle_polls_before_backoff) {
    sched_yield();
  }
  return busy;
}

Status UcxPointToPoint::Idle(Polls& polls, Deadline deadline, Clock::time_point started,
                             std::span<Slot* const> pending, bool any) {
  const bool busy = Poll(polls);
  // Reading the clock costs ~20 ns; doing it every 16 polls (the default
  // polls_per_clock_read) keeps the deadline check well under a
  // microsecond late while idle. Polls that
  // found work count too: a peer that keeps this worker busy (a stream of
  // messages on other tags) must not hold a wait past its deadline.
  const unsigned clock_mask = static_cast<unsigned>(options_.polls_per_clock_read) - 1;
  if ((++polls.total & clock_mask) != 0) return Status::Ok();
  const Clock::time_point now = Clock::now();
  if (now >= deadline) {
    // The poll above may have completed what the wait needs: it came in
    // time, and the caller finds it done (it was reported TIMED_OUT). For
    // WaitAny that is not a watched receive that failed with its lost peer
    // and that the wait passes over: counted, it made this return OK at
    // every deadline check, and the wait never ended.
    auto done = [](const Slot* slot) { return slot->done; };
    auto ends_any = [&](const Slot* slot) {
      return slot->done && !SkipLostWatched(slot, SlotStatus(slot), pending, /*any=*/true);
    };
    if (any ? std::any_of(pending.begin(), pending.end(), ends_any)
            : std::all_of(pending.begin(), pending.end(), done)) {
      return Status::Ok();
    }
    // Or failed one of its requests (a truncated message, a peer lost):
    // that failure is the cause, the deadline only came after it.
    for (const Slot* slot : pending) {
      Status failure = slot->done ? SlotStatus(slot) : PendingSlotStatus(slot);
      if (!failure.ok() && !SkipLostWatched(slot, failure, pending, /*any=*/false)) return failure;
    }
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - started);
    const Slot* first = *std::find_if_not(pending.begin(), pending.end(), done);
    return TimedOutError((any && pending.size() > 1 ? DescribeAny(pending) : Describe(first)) +
                         " still pending after " +
                         std::to_string(waited.count()) + " ms (deadline passed)");
  }
  // Only in waits that already lasted a millisecond: the watchdog's store
  // round trip gives up the core, which on a busy machine may not come
  // back for another task's whole time slice (see transport/shm).
  if (watchdog_ && now - started >= std::chrono::milliseconds(1) && now >= next_watchdog_) {
    next_watchdog_ = DeadlineAfter(now, options_.watchdog_period);
    // Every peer the wait still needs something from: one that closed
    // cleanly and exited is lost to this wait wherever it is in the list.
    // A watched receive's peer is not, while the wait needs some other
    // request (MarkWatched).
    const bool needs_unwatched = NeedsUnwatched(pending);
    std::vector<int> awaited;
    size_t done_before = 0;
    for (const Slot* slot : pending) {
      if (slot->done) {
        ++done_before;
      } else if (!(slot->watched && needs_unwatched) &&
                 std::find(awaited.begin(), awaited.end(), slot->peer) == awaited.end()) {
        awaited.push_back(slot->peer);
      }
    }
    // A Cancel from inside the watchdog must let this wait return by its
    // deadline, as the watchdog itself must.
    Status health;
    {
      // Restored on every way out (a watchdog that throws included): a
      // passed limit left behind would give later Cancels no grace.
      struct Restore {
        Deadline& limit;
        Deadline saved;
        ~Restore() { limit = saved; }
      } restore{cancel_limit_, cancel_limit_};
      cancel_limit_ = deadline;
      health = watchdog_(deadline, awaited);
    }
    // The watchdog may have given up a request of this very wait: the
    // wait ends, and nothing reads or writes that request's buffer now.
    for (const Slot* slot : pending) {
      if (!GivenUpWhileHeld(slot)) continue;
      if (!health.ok()) return health;
      return AbortedError(Describe(slot) +
                          ": given up inside the watchdog of the wait that held it");
    }
    if (!health.ok()) {
      // What an exited peer sent before it left is already here: drain it
      // before calling the wait lost. Bounded, because a live peer may keep
      // sending: a few shared-memory queues' or socket buffers' worth, and
      // not past the deadline.
      for (int i = 1; i <= kDrainPolls && worker_->Progress() != 0; ++i) {
        if ((i & 15) == 0 && Clock::now() >= deadline) break;
      }
      const size_t done_after = static_cast<size_t>(
          std::count_if(pending.begin(), pending.end(), [](const Slot* slot) { return slot->done; }));
      if (done_after == done_before) return health;
      // A request the wait needs finished in the drain (WaitAny may return
      // it), but the report is about the job, not that request: check
      // again at the next clock read, for what the wait needs next, not a
      // whole period later.
      next_watchdog_ = Clock::time_point{};
    }
  }
  if (busy) return Status::Ok();
  // A sleep ends when the watchdog is next due (or the wait has lasted the
  // millisecond it waits for), rounded up to whole milliseconds: a sleep of
  // a whole period from then on would make the watchdog's first run come a
  // period late, and a later one up to two periods after the one before.
  std::chrono::milliseconds max_sleep = options_.watchdog_period;
  if (watchdog_) {
    const Clock::time_point due = std::max(next_watchdog_, started + std::chrono::milliseconds(1));
    max_sleep = std::min(max_sleep, std::chrono::ceil<std::chrono::milliseconds>(
                                        std::max(due - now, Clock::duration::zero())));
  }
  return BackOff(polls, now, deadline, max_sleep);
}

Status UcxPointToPoint::BackOff(const Polls& polls, Clock::time_point now, Deadline deadline,
                                std::chrono::milliseconds max_sleep) {
  if (polls.idle < options_.idle_polls_before_backoff) return Status::Ok();
  switch (options_.idle_mode) {
    case IdleMode::kSpin:
      // Even with a core per rank, a long idle stretch means the peer is
      // not running (a busy machine): let it have the core.
      if (polls.idle >= 16 * int64_t{options_.idle_polls_before_backoff}) sched_yield();
      break;
    case IdleMode::kYield:
      break;  // in Poll, at every idle poll
    case IdleMode::kSleep: {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
      if (!context_->wakeup()) {
        // No event fd to sleep on: a bounded sleep between polls, so that
        // the core stays free at the cost of up to that much latency.
        // `max_sleep` is cut to a millisecond (more than the step) before it
        // becomes nanoseconds: a watchdog period of milliseconds::max()
        // overflowed there, and the wait never slept.
        std::this_thread::sleep_for(std::min<Clock::duration>(
            {kSleepStepWithoutWakeup, std::max<Clock::duration>(deadline - now, {}),
             std::min(max_sleep, std::chrono::milliseconds(1))}));
        break;
      }
      DDP_RETURN_IF_ERROR(worker_->WaitForEvents(SleepMilliseconds(left, max_sleep)));
      break;
    }
  }
  return Status::Ok();
}

int UcxPointToPoint::SleepMilliseconds(std::chrono::milliseconds left, std::chrono::milliseconds max_sleep) {
  // Clamped before the narrowing: a negative int would make epoll_wait
  // block with no timeout at all.
  const int64_t ms = std::clamp<int64_t>(std::min(left.count(), max_sleep.count()), 0,
                                         std::numeric_limits<int>::max());
  return static_cast<int>(ms);
}

void UcxPointToPoint::PollUntil(Polls& polls, Deadline until) {
  if (Poll(polls)) return;
  // A close or a forced cancel may complete in a progress callback that
  // signals no event, so sleeps are short; an error from the sleep only
  // makes this loop spin until `until`.
  BackOff(polls, Clock::now(), until, std::chrono::milliseconds(1)).IgnoreError();
}

StatusOr<bool> UcxPointToPoint::Test(p2p::RequestId id) {
  Slot* slot = Lookup(id);
  if (slot == nullptr) {
    return InvalidArgumentError("Test: request id " + std::to_string(id) + " unknown or released");
  }
  if (!slot->done) worker_->Progress();
  if (!slot->done) {
    Status failure = PendingSlotStatus(slot);
    if (!failure.ok()) {
      // Inside the watchdog, the running wait's deadline bounds this as it
      // bounds a Cancel there.
      Abandon(slot);
      Recall(cancel_limit_);
      return failure;
    }
    return false;
  }
  Status status = SlotStatus(slot);
  Release(slot);
  if (!status.ok()) return status;
  return true;
}

Status UcxPointToPoint::WaitAll(std::span<const p2p::RequestId> requests, Deadline deadline) {
  // Resolve ids once; an unknown or repeated id is a caller bug reported
  // before waiting. Handles are released also then, each once.
  std::vector<Slot*> slots;
  slots.reserve(requests.size());
  const uint64_t wait = ++waits_;
  Status invalid;
  for (p2p::RequestId id : requests) {
    Slot* slot = Lookup(id);
    // A wait inside the watchdog must leave the running wait's requests
    // to it: releasing one here would free its slot twice.
    if (slot == nullptr || slot->listed_in == wait || slot->held) {
      if (invalid.ok()) {
        invalid = InvalidArgumentError("WaitAll: request id " + std::to_string(id) +
                                       (slot == nullptr ? " unknown or released"
                                        : slot->held    ? kHeldByOuterWait
                                                        : " listed twice"));
      }
      continue;
    }
    slot->listed_in = wait;
    slots.push_back(slot);
  }
  if (!invalid.ok()) {
    for (Slot* slot : slots) Abandon(slot);
    Recall(deadline);
    return invalid;
  }
  for (Slot* slot : slots) slot->held = true;
  // Every way out (a watchdog that throws included), the slots released
  // meanwhile included.
  struct Unhold {
    UcxPointToPoint* self;
    std::span<Slot* const> slots;
    ~Unhold() { self->LetGo(slots); }
  } unhold{this, slots};
  const Clock::time_point started = Clock::now();
  Status result;
  size_t first_pending = 0;
  Polls polls;
  while (true) {
    // A slot is checked as the wait moves past it: one that finished with an
    // error (a truncated message) fails the wait at once, not at the
    // deadline of a later slot still pending.
    // A watched receive whose peer is lost is passed over while the wait
    // needs another request; the release below reports it if it stays the
    // only failure.
    while (first_pending < slots.size() && slots[first_pending]->done) {
      result = SlotStatus(slots[first_pending]);
      if (!result.ok() &&
          !SkipLostWatched(slots[first_pending], result, std::span(slots).subspan(first_pending),
                           /*any=*/false)) {
        break;
      }
      result = Status::Ok();
      ++first_pending;
    }
    if (!result.ok()) break;
    // Check every slot for errors, not only the first pending one, so a lost
    // peer fails the wait at once.
    bool all_done = true;
    const auto rest = std::span(slots).subspan(first_pending);
    for (Slot* slot : rest) {
      Status s = slot->done ? SlotStatus(slot) : PendingSlotStatus(slot);
      if (!s.ok() && !SkipLostWatched(slot, s, rest, /*any=*/false)) {
        result = s;
        break;
      }
      all_done &= slot->done;
    }
    if (!result.ok() || all_done) break;
    result = Idle(polls, deadline, started, rest, /*any=*/false);
    if (!result.ok()) break;
    // Idle looks only at the requests from the first pending one on: one
    // the wait moved past, given up inside the watchdog, ends it alike.
    const auto passed = std::span(slots).first(first_pending);
    const auto given_up = std::find_if(passed.begin(), passed.end(), GivenUpWhileHeld);
    if (given_up != passed.end()) {
      result = AbortedError(Describe(*given_up) + ": given up inside the watchdog of the wait that held it");
      break;
    }
  }
  for (Slot* slot : slots) {
    // Given up inside the watchdog: not this wait's to release (again).
    if (GivenUpWhileHeld(slot)) continue;
    slot->held = false;
    if (slot->done) {
      if (result.ok()) {
        Status s = SlotStatus(slot);
        if (!s.ok()) result = s;
      }
      Release(slot);
    } else {
      Abandon(slot);
    }
  }
  // Nothing may write into the caller's buffers once it has the result
  // (within kRecallOverrun of the deadline: see Recall).
  Recall(deadline);
  return result;
}

StatusOr<size_t> UcxPointToPoint::WaitAny(std::span<const p2p::RequestId> requests,
                                          Deadline deadline) {
  if (requests.empty()) return InvalidArgumentError("WaitAny on no requests");
  std::vector<Slot*> slots;
  slots.reserve(requests.size());
  for (p2p::RequestId id : requests) {
    Slot* slot = Lookup(id);
    if (slot == nullptr || slot->held) {
      return InvalidArgumentError("WaitAny: request id " + std::to_string(id) +
                                  (slot == nullptr ? " unknown or released" : kHeldByOuterWait));
    }
    slots.push_back(slot);
  }
  for (Slot* slot : slots) slot->held = true;
  // Every way out, the slots released meanwhile included.
  struct Unhold {
    UcxPointToPoint* self;
    std::span<Slot* const> slots;
    ~Unhold() { self->LetGo(slots); }
  } unhold{this, slots};
  const Clock::time_point started = Clock::now();
  Polls polls;
  while (true) {
    for (size_t i = 0; i < slots.size(); ++i) {
      Slot* slot = slots[i];
      Status s = slot->done ? SlotStatus(slot) : PendingSlotStatus(slot);
      if (!s.ok() && SkipLostWatched(slot, s, slots, /*any=*/true)) continue;
      if (slot->done) {
        Release(slot);
        if (!s.ok()) return s;
        return i;
      }
      DDP_RETURN_IF_ERROR(s);
    }
    DDP_RETURN_IF_ERROR(Idle(polls, deadline, started, slots, /*any=*/true));
  }
}

void UcxPointToPoint::MarkWatched(p2p::RequestId id) {
  Slot* slot = Lookup(id);
  if (slot != nullptr && !slot->is_send) slot->watched = true;
}

bool UcxPointToPoint::NeedsUnwatched(std::span<Slot* const> slots) {
  return std::any_of(slots.begin(), slots.end(),
                     [](const Slot* slot) { return !slot->done && !slot->watched; });
}

bool UcxPointToPoint::SkipLostWatched(const Slot* slot, const Status& failure,
                                      std::span<Slot* const> slots, bool any) {
  if (!slot->watched || failure.code() != StatusCode::kPeerLost) return false;
  if (any) {
    return std::any_of(slots.begin(), slots.end(), [](const Slot* other) { return !other->watched; });
  }
  return NeedsUnwatched(slots);
}

void UcxPointToPoint::Cancel(p2p::RequestId id) {
  Slot* slot = Lookup(id);
  if (slot == nullptr) return;
  Abandon(slot);
  Recall(cancel_limit_);
}

void UcxPointToPoint::CancelAll(std::span<const p2p::RequestId> ids) {
  // Everything is given up before anything is waited for, so that Recall's
  // grace and forced closes cover every peer at once. Lookup rejects ids
  // already abandoned, so a repeated id is skipped like a released one.
  bool any = false;
  for (p2p::RequestId id : ids) {
    Slot* slot = Lookup(id);
    if (slot == nullptr) continue;
    Abandon(slot);
    any = true;
  }
  if (any) Recall(cancel_limit_);
}

}  // namespace ddp::transport::ucx
