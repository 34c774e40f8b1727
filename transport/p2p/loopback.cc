#include "transport/p2p/loopback.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace ddp::transport::p2p {
namespace {

std::string HexTag(Tag tag) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%" PRIx64, tag);
  return buf;
}

std::string Describe(bool is_send, int owner, int peer, Tag tag, size_t bytes) {
  return "rank " + std::to_string(owner) + (is_send ? " sending " : " receiving ") +
         std::to_string(bytes) + " bytes " + (is_send ? "to" : "from") + " rank " +
         std::to_string(peer) + " (tag " + HexTag(tag) + ")";
}

// The test hooks (Kill, IsKilled, Stats, BytesBetween, BytesBetweenGroups)
// return no Status:
// a rank outside the hub is a broken test, which must not pass on the
// nothing or zero it would otherwise be handed.
void CheckHookRank(const char* hook, const char* argument, int rank, int size) {
  if (rank >= 0 && rank < size) return;
  std::fprintf(stderr, "fatal: LoopbackHub::%s: %s %d is outside [0, %d)\n", hook, argument, rank,
               size);
  std::abort();
}

}  // namespace

// The endpoint is a thin handle: all state lives in the hub, under its lock.
class LoopbackEndpoint final : public PointToPoint {
 public:
  LoopbackEndpoint(LoopbackHub* hub, int rank) : hub_(hub), rank_(rank) {}
  ~LoopbackEndpoint() override { hub_->Disconnect(rank_); }

  int rank() const override { return rank_; }
  int size() const override { return hub_->size(); }

  StatusOr<RequestId> PostSend(int peer, Tag tag, const void* data, size_t bytes) override {
    return hub_->Post(rank_, /*is_send=*/true, peer, tag, data, nullptr, bytes);
  }
  StatusOr<RequestId> PostRecv(int peer, Tag tag, void* data, size_t bytes) override {
    return hub_->Post(rank_, /*is_send=*/false, peer, tag, nullptr, data, bytes);
  }
  StatusOr<bool> Test(RequestId request) override { return hub_->Test(rank_, request); }
  Status WaitAll(std::span<const RequestId> requests, Deadline deadline) override {
    return hub_->WaitAll(rank_, requests.data(), requests.size(), deadline);
  }
  StatusOr<size_t> WaitAny(std::span<const RequestId> requests, Deadline deadline) override {
    return hub_->WaitAny(rank_, requests.data(), requests.size(), deadline);
  }
  Status PostNotice(int peer, Tag tag, const void* data, size_t bytes) override {
    return hub_->PostNotice(rank_, peer, tag, data, bytes);
  }
  void MarkWatched(RequestId request) override { hub_->MarkWatched(rank_, request); }
  void Cancel(RequestId request) override { hub_->Cancel(rank_, request); }
  void CancelAll(std::span<const RequestId> requests) override {
    hub_->CancelAll(rank_, requests.data(), requests.size());
  }

 private:
  LoopbackHub* const hub_;
  const int rank_;
};

LoopbackHub::LoopbackHub(int size) : size_(size) {
  if (size < 1 || size > kMaxSize) {
    std::fprintf(stderr,
                 "fatal: LoopbackHub: size %d is outside [1, %d] (the hub keeps a byte counter "
                 "per pair of ranks)\n",
                 size, kMaxSize);
    std::abort();
  }
  for (int i = 0; i < size; ++i) ranks_.push_back(std::make_unique<RankState>());
  pair_bytes_.assign(static_cast<size_t>(size) * size, 0);
}

LoopbackHub::~LoopbackHub() = default;

StatusOr<std::unique_ptr<PointToPoint>> LoopbackHub::Connect(int rank) {
  if (rank < 0 || rank >= size_) {
    return InvalidArgumentError("loopback: rank " + std::to_string(rank) + " is outside [0, " +
                                std::to_string(size_) + ")");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (ranks_[rank]->connected) {
    return FailedPreconditionError("loopback: rank " + std::to_string(rank) +
                                   " is already connected");
  }
  ranks_[rank]->connected = true;
  ranks_[rank]->closed = false;
  return std::unique_ptr<PointToPoint>(new LoopbackEndpoint(this, rank));
}

void LoopbackHub::Disconnect(int rank) {
  std::unique_lock<std::mutex> lock(mu_);
  RankState& me = *ranks_[rank];
  std::vector<RequestId> ids;
  for (const auto& [id, op] : me.ops) ids.push_back(id);
  for (RequestId id : ids) ReleaseLocked(lock, rank, id);
  // Notices to this rank die with it; those it sent stay for their peers.
  std::vector<Op*> notices;
  for (Op* op : me.unexpected_sends) {
    if (op->is_notice) notices.push_back(op);
  }
  for (Op* op : notices) DropNoticeLocked(me, op);
  me.connected = false;
  me.closed = true;
}

void LoopbackHub::Kill(int rank) {
  CheckHookRank("Kill", "rank", rank, size_);
  std::lock_guard<std::mutex> lock(mu_);
  if (ranks_[rank]->killed) return;
  ranks_[rank]->killed = true;
  const std::string lost = "rank " + std::to_string(rank) + " was lost (killed)";
  for (int q = 0; q < size_; ++q) {
    RankState& rs = *ranks_[q];
    // Receives waiting on the dead rank, or owned by it.
    for (auto it = rs.posted_recvs.begin(); it != rs.posted_recvs.end();) {
      Op* op = *it;
      if (q == rank) {
        FinishLocked(op, AbortedError(lost + "; " + Describe(false, q, op->peer, op->tag, op->bytes)));
      } else if (op->peer == rank) {
        FinishLocked(op, PeerLostError(lost + " before its message arrived; " +
                                       Describe(false, q, op->peer, op->tag, op->bytes)));
      } else {
        ++it;
        continue;
      }
      it = rs.posted_recvs.erase(it);
    }
    // Queued sends from the dead rank (dropped), or to it (never delivered).
    for (auto it = rs.unexpected_sends.begin(); it != rs.unexpected_sends.end();) {
      Op* op = *it;
      if (op->is_notice && (op->owner == rank || q == rank)) {
        it = rs.unexpected_sends.erase(it);
        FreeNoticeLocked(rs, op);
        continue;
      }
      if (op->owner == rank) {
        FinishLocked(op, AbortedError(lost + "; " + Describe(true, op->owner, op->peer, op->tag, op->bytes)));
      } else if (q == rank) {
        FinishLocked(op, PeerLostError(lost + " before receiving; " +
                                       Describe(true, op->owner, op->peer, op->tag, op->bytes)));
      } else {
        ++it;
        continue;
      }
      it = rs.unexpected_sends.erase(it);
    }
  }
  for (auto& rs : ranks_) rs->cv.notify_all();
}

bool LoopbackHub::IsKilled(int rank) const {
  CheckHookRank("IsKilled", "rank", rank, size_);
  std::lock_guard<std::mutex> lock(mu_);
  return ranks_[rank]->killed;
}

uint64_t LoopbackHub::BytesBetweenGroups(const std::vector<int>& group_of_rank) const {
  // A list shorter than the hub left the ranks past its end out of every
  // group (their bytes never counted); a longer one named ranks that do not
  // exist. Either is a broken test that would pass on a smaller count.
  if (group_of_rank.size() != static_cast<size_t>(size_)) {
    std::fprintf(stderr,
                 "fatal: LoopbackHub::BytesBetweenGroups: group_of_rank has %zu entries, "
                 "expected one per rank (%d)\n",
                 group_of_rank.size(), size_);
    std::abort();
  }
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t bytes = 0;
  for (int a = 0; a < size_; ++a) {
    for (int b = 0; b < size_; ++b) {
      if (group_of_rank[a] != group_of_rank[b]) bytes += pair_bytes_[static_cast<size_t>(a) * size_ + b];
    }
  }
  return bytes;
}

uint64_t LoopbackHub::BytesBetween(int from, int to) const {
  CheckHookRank("BytesBetween", "from", from, size_);
  CheckHookRank("BytesBetween", "to", to, size_);
  std::lock_guard<std::mutex> lock(mu_);
  return pair_bytes_[static_cast<size_t>(from) * size_ + to];
}

LoopbackStats LoopbackHub::Stats(int rank) const {
  CheckHookRank("Stats", "rank", rank, size_);
  std::lock_guard<std::mutex> lock(mu_);
  return ranks_[rank]->stats;
}

StatusOr<RequestId> LoopbackHub::Post(int rank, bool is_send, int peer, Tag tag,
                                      const void* send_data, void* recv_data, size_t bytes) {
  if (peer < 0 || peer >= size_) {
    return InvalidArgumentError("loopback: peer " + std::to_string(peer) + " is outside [0, " +
                                std::to_string(size_) + ")");
  }
  if (tag > kMaxTag) {
    return InvalidArgumentError("loopback: tag " + HexTag(tag) + " does not fit in " +
                                std::to_string(kTagBits) + " bits");
  }
  if (bytes > 0 && (is_send ? send_data == nullptr : recv_data == nullptr)) {
    return InvalidArgumentError("loopback: null buffer for " +
                                Describe(is_send, rank, peer, tag, bytes));
  }
  std::unique_lock<std::mutex> lock(mu_);
  RankState& me = *ranks_[rank];
  if (me.killed) {
    return AbortedError("rank " + std::to_string(rank) + " was killed; " +
                        Describe(is_send, rank, peer, tag, bytes));
  }
  if (ranks_[peer]->killed) {
    return PeerLostError("rank " + std::to_string(peer) + " was lost (killed); " +
                         Describe(is_send, rank, peer, tag, bytes));
  }
  auto owned = std::make_unique<Op>();
  Op* op = owned.get();
  op->id = next_id_++;
  op->owner = rank;
  op->peer = peer;
  op->tag = tag;
  op->is_send = is_send;
  op->send_data = send_data;
  op->recv_data = recv_data;
  op->bytes = bytes;
  me.ops.emplace(op->id, std::move(owned));
  const RequestId id = op->id;

  // Oldest matching counterpart first: FIFO per (source, tag).
  if (is_send) {
    auto& queue = ranks_[peer]->posted_recvs;
    auto it = std::find_if(queue.begin(), queue.end(),
                           [&](Op* r) { return r->peer == rank && r->tag == tag; });
    if (it == queue.end()) {
      RankState& to = *ranks_[peer];
      to.unexpected_sends.push_back(op);
      to.stats.peak_unexpected_sends =
          std::max<uint64_t>(to.stats.peak_unexpected_sends, to.unexpected_sends.size());
      return id;
    }
    Op* recv = *it;
    queue.erase(it);
    Complete(lock, op, recv);
  } else {
    auto& queue = me.unexpected_sends;
    auto it = std::find_if(queue.begin(), queue.end(),
                           [&](Op* s) { return s->owner == peer && s->tag == tag; });
    if (it == queue.end()) {
      me.posted_recvs.push_back(op);
      return id;
    }
    Op* send = *it;
    queue.erase(it);
    Complete(lock, send, op);
    if (send->is_notice) FreeNoticeLocked(me, send);
  }
  return id;
}

Status LoopbackHub::PostNotice(int rank, int peer, Tag tag, const void* data, size_t bytes) {
  if (peer < 0 || peer >= size_) {
    return InvalidArgumentError("loopback: notice to peer " + std::to_string(peer) +
                                " is outside [0, " + std::to_string(size_) + ")");
  }
  if (tag > kMaxTag) {
    return InvalidArgumentError("loopback: notice tag " + HexTag(tag) + " does not fit in " +
                                std::to_string(kTagBits) + " bits");
  }
  if (bytes > kMaxNoticeBytes || (bytes > 0 && data == nullptr)) {
    return InvalidArgumentError("loopback: notice of " + std::to_string(bytes) + " bytes from rank " +
                                std::to_string(rank) + " to rank " + std::to_string(peer) +
                                (bytes > kMaxNoticeBytes
                                     ? " is larger than " + std::to_string(kMaxNoticeBytes)
                                     : std::string(" has a null buffer")));
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (ranks_[rank]->killed) {
    return AbortedError("rank " + std::to_string(rank) + " was killed; notice " +
                        Describe(true, rank, peer, tag, bytes));
  }
  if (ranks_[peer]->killed) {
    return PeerLostError("rank " + std::to_string(peer) + " was lost (killed); notice " +
                         Describe(true, rank, peer, tag, bytes));
  }
  RankState& to = *ranks_[peer];
  // A closed rank's notices died with its endpoint (Disconnect); one sent
  // to it afterwards would wait for the next endpoint of that rank, whose
  // calls (a fresh communicator's, numbered from 1 again) it is not for.
  if (to.closed) return Status();
  auto owned = std::make_unique<Op>();
  Op* op = owned.get();
  op->owner = rank;
  op->peer = peer;
  op->tag = tag;
  op->is_send = true;
  op->is_notice = true;
  op->notice_bytes.assign(static_cast<const unsigned char*>(data),
                          static_cast<const unsigned char*>(data) + bytes);
  op->send_data = op->notice_bytes.data();
  op->bytes = bytes;
  to.notices.push_back(std::move(owned));

  auto& queue = to.posted_recvs;
  auto it = std::find_if(queue.begin(), queue.end(),
                         [&](Op* r) { return r->peer == rank && r->tag == tag; });
  if (it != queue.end()) {
    Op* recv = *it;
    queue.erase(it);
    Complete(lock, op, recv);
    FreeNoticeLocked(to, op);
    return Status();
  }
  // Bounded: past the limit the oldest undelivered one from this rank goes.
  int queued = 0;
  Op* oldest = nullptr;
  for (Op* s : to.unexpected_sends) {
    if (s->is_notice && s->owner == rank) {
      if (oldest == nullptr) oldest = s;
      ++queued;
    }
  }
  if (queued >= kMaxNoticesPerPeer) DropNoticeLocked(to, oldest);
  to.unexpected_sends.push_back(op);
  to.stats.peak_unexpected_sends =
      std::max<uint64_t>(to.stats.peak_unexpected_sends, to.unexpected_sends.size());
  return Status();
}

void LoopbackHub::DropNoticeLocked(RankState& to, Op* notice) {
  auto& queue = to.unexpected_sends;
  queue.erase(std::remove(queue.begin(), queue.end(), notice), queue.end());
  FreeNoticeLocked(to, notice);
}

void LoopbackHub::FreeNoticeLocked(RankState& to, Op* notice) {
  to.notices.remove_if([notice](const std::unique_ptr<Op>& n) { return n.get() == notice; });
}

void LoopbackHub::Complete(std::unique_lock<std::mutex>& lock, Op* send, Op* recv) {
  send->state = OpState::kCopying;
  recv->state = OpState::kCopying;
  const bool sizes_match = send->bytes == recv->bytes;
  // The copy runs without the lock so that ranks copy in parallel; both ops
  // are in kCopying, which Cancel and Kill leave alone.
  lock.unlock();
  if (sizes_match && send->bytes > 0) std::memcpy(recv->recv_data, send->send_data, send->bytes);
  lock.lock();
  if (sizes_match) {
    RankState& s = *ranks_[send->owner];
    RankState& r = *ranks_[recv->owner];
    ++s.stats.messages_sent;
    s.stats.bytes_sent += send->bytes;
    ++r.stats.messages_received;
    r.stats.bytes_received += recv->bytes;
    pair_bytes_[static_cast<size_t>(send->owner) * size_ + recv->owner] += send->bytes;
    FinishLocked(recv, Status());
  } else {
    FinishLocked(recv, InvalidArgumentError(
                           "message size mismatch: rank " + std::to_string(send->owner) +
                           " sent " + std::to_string(send->bytes) + " bytes (tag " +
                           HexTag(send->tag) + ") but rank " + std::to_string(recv->owner) +
                           " expected " + std::to_string(recv->bytes)));
  }
  FinishLocked(send, Status());
}

void LoopbackHub::FinishLocked(Op* op, Status status) {
  op->state = OpState::kDone;
  op->status = std::move(status);
  ranks_[op->owner]->cv.notify_all();
}

LoopbackHub::Op* LoopbackHub::FindLocked(int rank, RequestId request) {
  auto& ops = ranks_[rank]->ops;
  auto it = ops.find(request);
  return it == ops.end() ? nullptr : it->second.get();
}

void LoopbackHub::ReleaseLocked(std::unique_lock<std::mutex>& lock, int rank,
                                RequestId request) {
  RankState& me = *ranks_[rank];
  Op* op = FindLocked(rank, request);
  if (op == nullptr) return;
  // A copy in progress touches the caller's buffer; it must finish before
  // the handle is released (it is a bounded memcpy, not a wait on a peer).
  me.cv.wait(lock, [&] { return op->state != OpState::kCopying; });
  if (op->state == OpState::kQueued) {
    auto& queue = op->is_send ? ranks_[op->peer]->unexpected_sends : me.posted_recvs;
    queue.erase(std::remove(queue.begin(), queue.end(), op), queue.end());
  }
  me.ops.erase(request);
}

StatusOr<bool> LoopbackHub::Test(int rank, RequestId request) {
  std::unique_lock<std::mutex> lock(mu_);
  Op* op = FindLocked(rank, request);
  if (op == nullptr) {
    return InvalidArgumentError("loopback: rank " + std::to_string(rank) +
                                " has no outstanding request " + std::to_string(request));
  }
  if (op->state != OpState::kDone) return false;
  Status status = op->status;
  ReleaseLocked(lock, rank, request);
  if (!status.ok()) return status;
  return true;
}

Status LoopbackHub::WaitAll(int rank, const RequestId* requests, size_t n, Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  RankState& me = *ranks_[rank];
  auto release_all = [&] {
    for (size_t i = 0; i < n; ++i) ReleaseLocked(lock, rank, requests[i]);
  };
  // A repeated id is refused before any wait, as UCX does.
  std::vector<RequestId> sorted(requests, requests + n);
  std::sort(sorted.begin(), sorted.end());
  auto repeated = std::adjacent_find(sorted.begin(), sorted.end());
  if (repeated != sorted.end()) {
    const RequestId id = *repeated;
    release_all();
    return InvalidArgumentError("loopback: rank " + std::to_string(rank) + " WaitAll: request " +
                                std::to_string(id) + " listed twice");
  }
  while (true) {
    const Op* pending = nullptr;
    for (size_t i = 0; i < n; ++i) {
      const Op* op = FindLocked(rank, requests[i]);
      if (op == nullptr) {
        release_all();
        return InvalidArgumentError("loopback: rank " + std::to_string(rank) +
                                    " has no outstanding request " + std::to_string(requests[i]));
      }
      if (op->state == OpState::kDone && !op->status.ok() &&
          !SkipLostWatched(rank, op, requests, n, /*any=*/false)) {
        Status status = op->status;
        release_all();
        return status;
      }
      if (op->state != OpState::kDone && pending == nullptr) pending = op;
    }
    if (pending == nullptr) {
      release_all();
      return Status();
    }
    if (Clock::now() >= deadline) {
      Status status = TimedOutError("deadline passed with " +
                                    Describe(pending->is_send, rank, pending->peer, pending->tag,
                                             pending->bytes) +
                                    " still pending");
      release_all();
      return status;
    }
    me.cv.wait_until(lock, deadline);
  }
}

StatusOr<size_t> LoopbackHub::WaitAny(int rank, const RequestId* requests, size_t n,
                                      Deadline deadline) {
  if (n == 0) return InvalidArgumentError("loopback: WaitAny on an empty request list");
  std::unique_lock<std::mutex> lock(mu_);
  RankState& me = *ranks_[rank];
  while (true) {
    for (size_t i = 0; i < n; ++i) {
      const Op* op = FindLocked(rank, requests[i]);
      if (op == nullptr) {
        return InvalidArgumentError("loopback: rank " + std::to_string(rank) +
                                    " has no outstanding request " + std::to_string(requests[i]));
      }
      if (op->state == OpState::kDone && !SkipLostWatched(rank, op, requests, n, /*any=*/true)) {
        Status status = op->status;
        ReleaseLocked(lock, rank, requests[i]);
        if (!status.ok()) return status;
        return i;
      }
    }
    if (Clock::now() >= deadline) {
      const Op* op = FindLocked(rank, requests[0]);
      return TimedOutError("deadline passed with " + std::to_string(n) +
                           " requests pending, the first: " +
                           Describe(op->is_send, rank, op->peer, op->tag, op->bytes));
    }
    me.cv.wait_until(lock, deadline);
  }
}

bool LoopbackHub::SkipLostWatched(int rank, const Op* op, const RequestId* requests, size_t n,
                                  bool any) {
  if (!op->watched || op->status.code() != StatusCode::kPeerLost) return false;
  for (size_t i = 0; i < n; ++i) {
    const Op* other = FindLocked(rank, requests[i]);
    if (other != nullptr && !other->watched && (any || other->state != OpState::kDone)) return true;
  }
  return false;
}

void LoopbackHub::MarkWatched(int rank, RequestId request) {
  std::lock_guard<std::mutex> lock(mu_);
  Op* op = FindLocked(rank, request);
  if (op != nullptr && !op->is_send) op->watched = true;
}

void LoopbackHub::Cancel(int rank, RequestId request) {
  std::unique_lock<std::mutex> lock(mu_);
  ReleaseLocked(lock, rank, request);
}

void LoopbackHub::CancelAll(int rank, const RequestId* requests, size_t n) {
  std::unique_lock<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) ReleaseLocked(lock, rank, requests[i]);
}

}  // namespace ddp::transport::p2p
