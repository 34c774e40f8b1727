#include "transport/ucx/ucx_p2p.h"

#include <sched.h>

#include <cstring>
#include <sstream>

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
  bool is_send = false;
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

ucp_tag_t WireTag(bool user, int source, p2p::Tag tag) {
  return (user ? kUserChannel : 0) | (static_cast<ucp_tag_t>(source) << p2p::kTagBits) | tag;
}

}  // namespace

StatusOr<std::unique_ptr<UcxPointToPoint>> UcxPointToPoint::Create(
    std::shared_ptr<Context> context, const P2pOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return InvalidArgumentError("rank " + std::to_string(options.rank) +
                                " is outside a world of size " + std::to_string(options.size));
  }
  if (options.size > (1 << (64 - p2p::kTagBits - 2))) {
    return InvalidArgumentError("world size " + std::to_string(options.size) +
                                " does not fit in the tag's rank bits");
  }
  if (options.idle_mode == IdleMode::kSleep && !context->wakeup()) {
    return InvalidArgumentError("idle mode kSleep needs a UCX context created with wakeup");
  }
  DDP_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker, Worker::Create(context));
  return std::unique_ptr<UcxPointToPoint>(
      new UcxPointToPoint(std::move(context), std::move(worker), options));
}

UcxPointToPoint::UcxPointToPoint(std::shared_ptr<Context> context, std::unique_ptr<Worker> worker,
                                 const P2pOptions& options)
    : context_(std::move(context)), worker_(std::move(worker)), options_(options) {
  registrations_.set_context(context_->get());
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
  if (!endpoints_.empty()) return FailedPreconditionError("UCX endpoints already connected");
  if (static_cast<int>(addresses.size()) != options_.size) {
    return InvalidArgumentError("expected " + std::to_string(options_.size) +
                                " worker addresses, got " + std::to_string(addresses.size()));
  }
  if (!same_host.empty() && static_cast<int>(same_host.size()) != options_.size) {
    return InvalidArgumentError("same_host has " + std::to_string(same_host.size()) +
                                " entries for a world of size " + std::to_string(options_.size));
  }
  peers_.resize(options_.size);
  endpoints_.assign(options_.size, nullptr);
  for (int peer = 0; peer < options_.size; ++peer) {
    peers_[peer] = std::make_unique<PeerState>();
    peers_[peer]->owner = this;
    peers_[peer]->rank = peer;
    if (addresses[peer].empty()) {
      return InvalidArgumentError("empty UCX worker address for rank " + std::to_string(peer));
    }
    ucp_ep_params_t params;
    std::memset(&params, 0, sizeof(params));
    const bool local = peer == options_.rank || same_host.empty() || same_host[peer];
    peers_[peer]->peer_error_mode = !local;
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
    DDP_RETURN_IF_ERROR(FromUcs(ucp_ep_create(worker_->get(), &params, &endpoints_[peer]),
                                "connecting to rank " + std::to_string(peer)));
  }
  return Status::Ok();
}

void UcxPointToPoint::SetWatchdog(std::function<Status(Deadline, int)> check) {
  watchdog_ = std::move(check);
}

void UcxPointToPoint::MarkPeerLost(int peer, Status reason) {
  if (peer < 0 || peer >= static_cast<int>(peers_.size())) return;
  if (peers_[peer]->failure.ok()) peers_[peer]->failure = std::move(reason);
}

void UcxPointToPoint::EndpointErrorCallback(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* peer = static_cast<PeerState*>(arg);
  if (peer->failure.ok()) {
    Status s = FromUcs(status, "connection to rank " + std::to_string(peer->rank));
    // Whatever UCX calls it, an endpoint error means the peer is unreachable.
    peer->failure = PeerLostError(s.message());
  }
}

Status UcxPointToPoint::Close(Deadline deadline, bool force_remote) {
  if (closed_) return Status::Ok();
  closed_ = true;
  // Requests first: abandon whatever is still pending.
  for (auto& slot : slots_) {
    if (slot->in_use && !slot->abandoned) Abandon(slot.get());
  }
  // Then endpoints: flush those whose peer is alive, force the others.
  std::vector<void*> closing;
  for (size_t peer = 0; peer < endpoints_.size(); ++peer) {
    if (endpoints_[peer] == nullptr) continue;
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // Force only where the peer is gone, or may be (force_remote): flushing
    // towards it would wait for an answer that never comes, and UCX 1.13
    // asserts when a worker is destroyed while a closing endpoint still
    // holds sends. UCX asks for peer error mode on both sides for a forced
    // close: remote endpoints have it on both sides, and a dead peer has no
    // side left to disturb.
    const bool force = !peers_[peer]->failure.ok() ||
                       (force_remote && peers_[peer]->peer_error_mode);
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* request = ucp_ep_close_nbx(endpoints_[peer], &param);
    if (UCS_PTR_IS_PTR(request)) closing.push_back(request);
    endpoints_[peer] = nullptr;
  }
  Status result;
  while (true) {
    bool pending = false;
    for (void*& request : closing) {
      if (request == nullptr) continue;
      if (ucp_request_check_status(request) == UCS_INPROGRESS) {
        pending = true;
      } else {
        ucp_request_free(request);
        request = nullptr;
      }
    }
    if (!pending) break;
    if (Clock::now() > deadline) {
      // The worker's destruction releases what is left.
      for (void* request : closing) {
        if (request != nullptr) ucp_request_free(request);
      }
      result = TimedOutError("closing UCX endpoints: peers did not confirm in time");
      break;
    }
    worker_->Progress();
  }
  // Abandoned requests complete with an error once their endpoints are gone;
  // give them one last chance before the worker goes.
  for (int i = 0; i < 100; ++i) {
    bool any = false;
    for (auto& slot : slots_) any |= slot->in_use;
    if (!any) break;
    worker_->Progress();
  }
  registrations_.Clear();
  return result;
}

Status UcxPointToPoint::RegisterStagingBuffer(void* data, size_t bytes) {
  return registrations_.Register(data, bytes);
}

Status UcxPointToPoint::CheckPeer(int peer, const char* what) const {
  if (closed_) return FailedPreconditionError(std::string(what) + " after the transport was closed");
  if (peer < 0 || peer >= options_.size) {
    return InvalidArgumentError(std::string(what) + " rank " + std::to_string(peer) +
                                " outside a world of size " + std::to_string(options_.size));
  }
  if (endpoints_.empty()) return FailedPreconditionError(std::string(what) + " before Connect()");
  if (!peers_[peer]->failure.ok()) return peers_[peer]->failure;
  return Status::Ok();
}

StatusOr<UcxPointToPoint::Slot*> UcxPointToPoint::AllocateSlot(bool is_send, int peer,
                                                               p2p::Tag tag, size_t bytes) {
  if (tag > p2p::kMaxTag) {
    return InvalidArgumentError("tag " + std::to_string(tag) + " exceeds " +
                                std::to_string(p2p::kTagBits) + " bits");
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
  slot->is_send = is_send;
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
  slot->abandoned = false;
  ++slot->generation;
  free_slots_.push_back(slot->index);
}

void UcxPointToPoint::Abandon(Slot* slot) {
  if (slot->done || slot->request == nullptr) {
    Release(slot);
    return;
  }
  slot->abandoned = true;
  // Receives are cancelled at once (the callback runs with CANCELED). A send
  // cannot be recalled; it completes when the peer takes it or its endpoint
  // closes, and the callback releases the slot then.
  ucp_request_cancel(worker_->get(), slot->request);
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
  DDP_RETURN_IF_ERROR(CheckPeer(peer, "send to"));
  DDP_ASSIGN_OR_RETURN(Slot * slot, AllocateSlot(true, peer, tag, bytes));
  ucp_request_param_t param;
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxPointToPoint::SendCallback;
  param.user_data = slot;
  if (bytes >= options_.registered_threshold_bytes) {
    if (ucp_mem_h memh = registrations_.Find(data, bytes)) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh;
    }
  }
  void* request = ucp_tag_send_nbx(endpoints_[peer], data, bytes,
                                   WireTag(user, options_.rank, tag), &param);
  if (UCS_PTR_IS_ERR(request)) {
    Release(slot);
    return FromUcs(UCS_PTR_STATUS(request), "tag send to rank " + std::to_string(peer));
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
  DDP_RETURN_IF_ERROR(CheckPeer(peer, "receive from"));
  DDP_ASSIGN_OR_RETURN(Slot * slot, AllocateSlot(false, peer, tag, bytes));
  ucp_request_param_t param;
  // No immediate completion: UCX 1.13 leaves recv_info unset when a receive
  // completes inline, and the received length is how a count mismatch
  // between ranks is caught.
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &UcxPointToPoint::RecvCallback;
  param.user_data = slot;
  param.recv_info.tag_info = &slot->info;
  if (bytes >= options_.registered_threshold_bytes) {
    if (ucp_mem_h memh = registrations_.Find(data, bytes)) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh;
    }
  }
  void* request = ucp_tag_recv_nbx(worker_->get(), data, bytes, WireTag(user, peer, tag), kFullMask,
                                   &param);
  if (UCS_PTR_IS_ERR(request)) {
    Release(slot);
    return FromUcs(UCS_PTR_STATUS(request), "tag receive from rank " + std::to_string(peer));
  }
  if (request == nullptr) {
    Release(slot);
    return InternalError("UCX completed a receive inline despite NO_IMM_CMPL");
  }
  if (!slot->done) slot->request = request;
  return IdOf(slot);
}

std::string UcxPointToPoint::Describe(const Slot* slot) const {
  std::ostringstream out;
  out << (slot->is_send ? "send of " : "receive of ") << slot->bytes << " bytes "
      << (slot->is_send ? "to" : "from") << " rank " << slot->peer << " (tag " << slot->tag << ")";
  return out.str();
}

Status UcxPointToPoint::SlotStatus(const Slot* slot) const {
  if (slot->ucs == UCS_ERR_MESSAGE_TRUNCATED) {
    return InvalidArgumentError(Describe(slot) + ": rank " + std::to_string(slot->peer) +
                                " sent a larger message (counts differ across ranks?)");
  }
  if (slot->ucs != UCS_OK) {
    // An endpoint error that the error callback already attributed to the
    // peer is the more useful message.
    if (!peers_[slot->peer]->failure.ok()) return peers_[slot->peer]->failure;
    return FromUcs(slot->ucs, Describe(slot));
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

Status UcxPointToPoint::Idle(int& idle_polls, Deadline deadline, Clock::time_point started,
                             const Slot* waiting_for) {
  if (worker_->Progress() != 0) {
    idle_polls = 0;
    return Status::Ok();
  }
  ++idle_polls;
  // Yielding waits give up the core at every idle poll once past the
  // threshold (with a threshold of 1, over TCP, the kernel's network stack
  // gets the core as soon as there is nothing to do).
  if (options_.idle_mode == IdleMode::kYield && idle_polls >= options_.idle_polls_before_backoff) {
    sched_yield();
  }
  // Reading the clock costs ~20 ns; doing it every 16 idle polls keeps the
  // deadline check well under a microsecond late.
  if ((idle_polls & 15) != 0) return Status::Ok();
  const Clock::time_point now = Clock::now();
  if (now >= deadline) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - started);
    return TimedOutError(Describe(waiting_for) + " still pending after " +
                         std::to_string(waited.count()) + " ms (deadline passed)");
  }
  // Only in waits that already lasted a millisecond: the watchdog's store
  // round trip gives up the core, which on a busy machine may not come
  // back for another task's whole time slice (see transport/shm).
  if (watchdog_ && now - started >= std::chrono::milliseconds(1) && now >= next_watchdog_) {
    next_watchdog_ = now + options_.watchdog_period;
    Status health = watchdog_(deadline, waiting_for != nullptr ? waiting_for->peer : -1);
    if (!health.ok()) {
      // What an exited peer sent before it left is already here: drain it
      // before calling the wait lost.
      while (worker_->Progress() != 0) {
      }
      if (waiting_for == nullptr || !waiting_for->done) return health;
    }
  }
  if (idle_polls >= options_.idle_polls_before_backoff) {
    switch (options_.idle_mode) {
      case IdleMode::kSpin:
        // Even with a core per rank, a long idle stretch means the peer is
        // not running (a busy machine): let it have the core.
        if (idle_polls >= 16 * options_.idle_polls_before_backoff) sched_yield();
        break;
      case IdleMode::kYield:
        break;  // above, at every idle poll
      case IdleMode::kSleep: {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
        const int timeout_ms =
            static_cast<int>(std::min<int64_t>(std::max<int64_t>(left.count(), 0),
                                               options_.watchdog_period.count()));
        DDP_RETURN_IF_ERROR(worker_->WaitForEvents(timeout_ms));
        break;
      }
    }
  }
  return Status::Ok();
}

StatusOr<bool> UcxPointToPoint::Test(p2p::RequestId id) {
  Slot* slot = Lookup(id);
  if (slot == nullptr) return InvalidArgumentError("unknown or released request id");
  if (!slot->done) worker_->Progress();
  if (!slot->done) {
    Status failure = PendingSlotStatus(slot);
    if (!failure.ok()) {
      Abandon(slot);
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
  // Resolve ids once; an unknown id is a caller bug reported before waiting.
  std::vector<Slot*> slots;
  slots.reserve(requests.size());
  for (p2p::RequestId id : requests) {
    Slot* slot = Lookup(id);
    if (slot == nullptr) {
      for (Slot* s : slots) Abandon(s);
      return InvalidArgumentError("WaitAll: unknown or released request id");
    }
    slots.push_back(slot);
  }
  const Clock::time_point started = Clock::now();
  Status result;
  size_t first_pending = 0;
  int idle_polls = 0;
  while (true) {
    while (first_pending < slots.size() && slots[first_pending]->done) ++first_pending;
    // Check every slot for errors, not only the first pending one, so a lost
    // peer fails the wait at once.
    bool all_done = true;
    for (size_t i = first_pending; i < slots.size(); ++i) {
      Slot* slot = slots[i];
      Status s = slot->done ? SlotStatus(slot) : PendingSlotStatus(slot);
      if (!s.ok()) {
        result = s;
        break;
      }
      all_done &= slot->done;
    }
    if (!result.ok() || all_done) break;
    result = Idle(idle_polls, deadline, started, slots[first_pending]);
    if (!result.ok()) break;
  }
  for (Slot* slot : slots) {
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
  return result;
}

StatusOr<size_t> UcxPointToPoint::WaitAny(std::span<const p2p::RequestId> requests,
                                          Deadline deadline) {
  if (requests.empty()) return InvalidArgumentError("WaitAny on no requests");
  std::vector<Slot*> slots;
  slots.reserve(requests.size());
  for (p2p::RequestId id : requests) {
    Slot* slot = Lookup(id);
    if (slot == nullptr) return InvalidArgumentError("WaitAny: unknown or released request id");
    slots.push_back(slot);
  }
  const Clock::time_point started = Clock::now();
  int idle_polls = 0;
  while (true) {
    for (size_t i = 0; i < slots.size(); ++i) {
      Slot* slot = slots[i];
      if (slot->done) {
        Status s = SlotStatus(slot);
        Release(slot);
        if (!s.ok()) return s;
        return i;
      }
      DDP_RETURN_IF_ERROR(PendingSlotStatus(slot));
    }
    DDP_RETURN_IF_ERROR(Idle(idle_polls, deadline, started, slots[0]));
  }
}

void UcxPointToPoint::Cancel(p2p::RequestId id) {
  Slot* slot = Lookup(id);
  if (slot != nullptr) Abandon(slot);
}

}  // namespace ddp::transport::ucx
