#include "transport/fault/peer_monitor.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <string_view>

#include "transport/fault/process.h"
#include "transport/store/store.h"
#include "transport/store/wire.h"

namespace ddp::transport::fault {
namespace {

int PidfdOpen(int pid) {
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
}

// A connection the server ended (TcpStoreClient's words), not one this
// process closed, one left unusable by a request that timed out half-sent,
// or a call that ran out of time.
bool ServerEndedConnection(const Status& s) {
  return s.code() == StatusCode::kUnavailable && s.message().starts_with("lost the connection");
}

// Such a connection whose server said, before it went, that its owner
// stopped it: its stop notice comes right after the client's words
// ("lost the connection to the store at HOST:PORT: "), with the owner's
// reason after it. Only there: the reason and other answers may hold
// communicator names, which may hold the notice's words.
bool ServerToldItsStop(const Status& s) {
  if (!ServerEndedConnection(s)) return false;
  const size_t after_endpoint = s.message().find(": ");
  return after_endpoint != std::string::npos &&
         std::string_view(s.message()).substr(after_endpoint + 2).starts_with(store::wire::kStopNotice);
}

}  // namespace

Deadline PeerMonitor::StoreDeadline(Deadline deadline) const {
  return std::min(deadline, Clock::now() + options_.store_call_cap);
}

PeerMonitor::PeerMonitor(PeerMonitorOptions options, store::Store* store)
    : options_(std::move(options)), store_(store), started_at_(TicksSinceBoot()) {
  pidfds_.assign(options_.local_pids.size(), -1);
  gone_at_start_.assign(options_.local_pids.size(), false);
  start_times_ = std::make_unique<std::atomic<uint64_t>[]>(options_.local_pids.size());
  first_unread_ = std::make_unique<std::atomic<int64_t>[]>(options_.local_pids.size());
  closed_seen_ = std::make_unique<std::atomic<bool>[]>(options_.local_pids.size());
  for (size_t r = 0; r < options_.local_pids.size(); ++r) {
    if (static_cast<int>(r) == options_.rank || options_.local_pids[r] <= 0) continue;
    pidfds_[r] = PidfdOpen(options_.local_pids[r]);
    // ESRCH: the peer died between the exchange of pids and now. It stays
    // dead: kill(pid, 0) would take a process that reused the pid for it.
    if (pidfds_[r] < 0 && errno == ESRCH) gone_at_start_[r] = true;
    // Without pidfd support (old kernel, seccomp, no descriptor left) fall
    // back to looking at the process in Check() (ProcessGoneNow), knowing
    // when it started: a process that reused the pid started later.
    if (pidfds_[r] < 0 && !gone_at_start_[r]) start_times_[r] = ProcessStartTime(options_.local_pids[r]);
  }
}

PeerMonitor::~PeerMonitor() {
  for (int fd : pidfds_) {
    if (fd >= 0) close(fd);
  }
}

PeerMonitor::Closed PeerMonitor::PeerClosed(int peer, Deadline deadline) {
  std::atomic<bool>& seen = closed_seen_[static_cast<size_t>(peer)];
  if (seen.load(std::memory_order_relaxed)) return Closed::kYes;
  if (store_ != nullptr && store_->StoppedCleanly()) return Closed::kStoreStopped;
  // No store, or no time to ask it: nothing says the peer closed cleanly.
  if (store_ == nullptr || Clock::now() >= deadline) return Closed::kNo;
  auto value = store_->TryGet(options_.key_prefix + "closed/" + std::to_string(peer),
                              StoreDeadline(deadline));
  // This very read may be the one that learned of the stop.
  if (!value.ok()) return store_->StoppedCleanly() ? Closed::kStoreStopped : Closed::kUnknown;
  if (!value->has_value()) return Closed::kNo;
  seen.store(true, std::memory_order_relaxed);
  return Closed::kYes;
}

bool PeerMonitor::Exited(size_t rank) const {
  const int pid = options_.local_pids[rank];
  if (static_cast<int>(rank) == options_.rank || pid <= 0) return false;
  if (gone_at_start_[rank]) return true;
  if (pidfds_[rank] >= 0) {
    pollfd p{pidfds_[rank], POLLIN, 0};
    return poll(&p, 1, 0) > 0;
  }
  // A zombie too, which kill(pid, 0) takes for alive; and another process
  // under the pid.
  uint64_t started = start_times_[rank].load(std::memory_order_relaxed);
  if (started == kReplaced) return true;
  if (started == 0 && !ProcessGoneNow(pid)) {
    // Not read at the start (no descriptor then). The peer was running
    // before the monitor started: a process under its pid that started
    // later took the pid after the peer died, and is not adopted.
    started = ProcessStartTime(pid);
    if (started != 0 && started_at_ != 0 && started > started_at_) started = kReplaced;
    start_times_[rank].store(started, std::memory_order_relaxed);
    if (started == kReplaced) return true;
  }
  return ProcessGoneNow(pid, started);
}

std::vector<int> PeerMonitor::ExitedPeers() const {
  std::vector<int> exited;
  for (size_t r = 0; r < options_.local_pids.size(); ++r) {
    if (Exited(r)) exited.push_back(static_cast<int>(r));
  }
  return exited;
}

Status PeerMonitor::Check(Deadline deadline, int awaited_peer) {
  if (awaited_peer < 0) return Check(deadline, std::span<const int>());
  return Check(deadline, std::span<const int>(&awaited_peer, 1));
}

Status PeerMonitor::Check(Deadline deadline, std::span<const int> awaited_peers) {
  for (size_t r = 0; r < options_.local_pids.size(); ++r) {
    const int pid = options_.local_pids[r];
    if (!Exited(r)) continue;
    const bool awaited = std::find(awaited_peers.begin(), awaited_peers.end(),
                                   static_cast<int>(r)) != awaited_peers.end();
    const int64_t asked = Clock::now().time_since_epoch().count();
    const Closed mark = PeerClosed(static_cast<int>(r), deadline);
    // The store's owner stopped it after a clean end of the job: a peer
    // closing since could not post its mark, so an exit is a failure only
    // for a wait that needs something from that peer.
    if (mark == Closed::kStoreStopped && !awaited) continue;
    if (mark == Closed::kUnknown && !awaited && Clock::now() < deadline) {
      // The store could not be read this round (a hiccup): the peer may
      // have closed cleanly, so it is not declared lost on that alone. The
      // next round asks again; a second failure in a row counts as "not
      // closed", so a peer that died while the store stays unreadable is
      // still reported, one round later. A round counts as the next one
      // only if it asked after the first failed one had its answer: rounds
      // of two threads that overlap met the same hiccup. With no time left
      // there is no next round: the peer is reported (see the header).
      const int64_t answered = std::max<int64_t>(1, Clock::now().time_since_epoch().count());
      int64_t first = 0;
      if (first_unread_[r].compare_exchange_strong(first, answered, std::memory_order_relaxed) ||
          asked <= first) {
        continue;
      }
    }
    if (mark != Closed::kUnknown) first_unread_[r].store(0, std::memory_order_relaxed);
    const bool closed = mark == Closed::kYes;
    if (closed && !awaited) continue;
    // A rank that exits after reporting a failure is not the cause: the
    // reason it posted names the rank that really failed.
    Status posted = PostedAbort(deadline);
    if (!posted.ok()) return posted;
    lost_peer_ = static_cast<int>(r);
    std::string what = "rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                       " on this host) exited";
    if (closed) {
      what += " while this rank waited for it; it had closed its communicator, so it left "
              "the job early (the ranks stopped at different steps)";
    } else if (mark == Closed::kStoreStopped) {
      // Its mark may have been posted before the stop, unread here.
      what += " while this rank waited for it; it may have closed its communicator and left the job early "
              "(the ranks stopped at different steps): its mark can no longer be read, as the rendezvous "
              "store was stopped after a clean shutdown";
    }
    return PeerLostError(what);
  }
  // With no time left the caller reports its own deadline, naming what it
  // waited for, which says more than a store read that could not start.
  // A store stopped after a clean end of the job has no abort to tell.
  const Clock::time_point now = Clock::now();
  if (store_ == nullptr || now >= deadline) return Status::Ok();
  if (store_->StoppedCleanly()) return StoppedCleanly(deadline, awaited_peers);
  const Deadline until = std::min(deadline, now + options_.store_call_cap);
  const int64_t asked = now.time_since_epoch().count();
  auto posted = store_->TryGet(options_.key_prefix + "abort", until);
  if (!posted.ok()) {
    const StatusCode code = posted.status().code();
    // This read learned that the store's owner stopped it after a clean
    // end of the job (a split's ranks still at their last collectives):
    // no abort reason will come, and its server was not lost.
    if (code == StatusCode::kUnavailable && store_->StoppedCleanly()) return StoppedCleanly(deadline, awaited_peers);
    if (code == StatusCode::kTimedOut && until == deadline) {
      // Not (yet) evidence that the store is gone: the call ran out of time
      // while asking it.
      return TimedOutError("deadline passed while reading the job's abort state from the "
                           "rendezvous store: " + posted.status().message());
    }
    const std::string server =
        options_.store_rank >= 0 ? "rank " + std::to_string(options_.store_rank)
        : options_.store_rank == -2
            ? std::string("rank 0 of the communicator this one was split from (not a member here)")
            : std::string("the launcher");
    if (code != StatusCode::kTimedOut && code != StatusCode::kUnavailable) {
      // The store answered, with an error of its own (a job token that does
      // not match, a refused request): no sign that its server is gone.
      return Status(code, "reading the job's abort state from the rendezvous store (" + server +
                              " serves it): " + posted.status().message());
    }
    if (code == StatusCode::kTimedOut) {
      // One answer slower than the cap (the server's process paused: a GC,
      // swapping, a starved host) must not abort a healthy job: this round
      // learns nothing, and a second slow round in a row reports the
      // server lost. Rounds of two threads that overlap met the same stall
      // (as for the closed marks above).
      const int64_t answered = std::max<int64_t>(1, Clock::now().time_since_epoch().count());
      int64_t first = 0;
      if (first_slow_abort_read_.compare_exchange_strong(first, answered, std::memory_order_relaxed) ||
          asked <= first) {
        return Status::Ok();
      }
    }
    Status lost = posted.status();
    const std::string serving =
        ServerEndedConnection(lost) && options_.describe_server ? options_.describe_server(ServerToldItsStop(lost)) : "";
    // Ahead of the client's words, which end with the call that met the loss.
    if (!serving.empty()) lost = Status(lost.code(), serving + "; " + lost.message());
    return PeerLostError("the rendezvous store cannot be reached (" + server +
                         " serves it, and has died or stopped serving it): " + lost.ToString());
  }
  first_slow_abort_read_.store(0, std::memory_order_relaxed);
  if (posted->has_value()) return DecodeAbort(**posted);
  return Status::Ok();
}

Status PeerMonitor::StoppedCleanly(Deadline deadline, std::span<const int> awaited_peers) {
  const int server = options_.store_rank;
  // The split case (-2: its server is no member here) and a launcher (-1)
  // leave no member behind; nor does this rank serving the store itself.
  if (server < 0 || server == options_.rank) return Status::Ok();
  // The last holder stops the store after destroying its communicators,
  // this one's member included: a wait that needs something from it (or
  // that does not say whom it needs) will never get it.
  if (!awaited_peers.empty() &&
      std::find(awaited_peers.begin(), awaited_peers.end(), server) == awaited_peers.end()) {
    return Status::Ok();
  }
  // The client answers at once, with the reason the server's owner gave.
  auto read = store_->TryGet(options_.key_prefix + "abort", StoreDeadline(deadline));
  const std::string said = read.ok() ? std::string("it stopped the store") : read.status().message();
  return PeerLostError("rank " + std::to_string(server) +
                       ", which served the rendezvous store, left this communicator after a clean shutdown "
                       "while this rank still waited for it: " + said);
}

Status PeerMonitor::PostedAbort(Deadline deadline) {
  if (store_ == nullptr || Clock::now() >= deadline) return Status::Ok();
  auto posted = store_->TryGet(options_.key_prefix + "abort", StoreDeadline(deadline));
  if (posted.ok() && posted->has_value()) return DecodeAbort(**posted);
  return Status::Ok();
}

void PeerMonitor::PostAbort(const Status& reason, Deadline deadline) {
  if (store_ == nullptr || reason.ok() || Clock::now() >= deadline) return;
  // Written only where no reason is yet, in one store call: with a look
  // and then a write, two ranks failing at once both found none and the
  // second overwrote the first, so ranks reported different first causes.
  store_->CompareSet(options_.key_prefix + "abort", std::nullopt, EncodeAbort(options_.rank, reason),
                     StoreDeadline(deadline))
      .status()
      .IgnoreError();
}

void PeerMonitor::PostClosed(Deadline deadline) {
  if (store_ == nullptr || Clock::now() >= deadline) return;
  store_->Set(options_.key_prefix + "closed/" + std::to_string(options_.rank), "1",
              StoreDeadline(deadline))
      .IgnoreError();
}

std::string PeerMonitor::EncodeAbort(int rank, const Status& reason) {
  const std::string head = std::to_string(static_cast<int>(reason.code())) + "\n" + std::to_string(rank) + "\n";
  const std::string& message = reason.message();
  if (head.size() + message.size() <= store::kMaxValueBytes) return head + message;
  // The store refuses a larger value, and the peers would learn nothing:
  // the reason's start goes, saying that the rest was cut.
  const std::string note = " [... cut: the reason had " + std::to_string(message.size()) +
                           " bytes, more than the rendezvous store's value limit of " +
                           std::to_string(store::kMaxValueBytes) + "]";
  size_t keep = store::kMaxValueBytes - head.size() - note.size();
  // Cut between UTF-8 characters: a continuation byte (10xxxxxx) at the
  // cut belongs to a character begun before it, which goes whole (peers
  // write the reason into JSON error files, which must be UTF-8). At most
  // three steps back: a reason that is not UTF-8 is cut where it falls.
  for (int back = 0; back < 3 && keep > 0 && (static_cast<unsigned char>(message[keep]) & 0xC0) == 0x80;
       ++back) {
    --keep;
  }
  return head + message.substr(0, keep) + note;
}

Status PeerMonitor::DecodeAbort(const std::string& value) {
  const size_t first = value.find('\n');
  const size_t second = first == std::string::npos ? first : value.find('\n', first + 1);
  if (second == std::string::npos) {
    return InternalError("the job was aborted with an unreadable reason: " + value);
  }
  int code = static_cast<int>(StatusCode::kInternal);
  try {
    code = std::stoi(value.substr(0, first));
  } catch (...) {
  }
  if (code <= 0 || code > static_cast<int>(StatusCode::kResourceExhausted)) {
    code = static_cast<int>(StatusCode::kInternal);
  }
  return Status(static_cast<StatusCode>(code),
                "rank " + value.substr(first + 1, second - first - 1) +
                    " aborted the job: " + value.substr(second + 1));
}

}  // namespace ddp::transport::fault
