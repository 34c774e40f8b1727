// TcpStoreServer: one thread, one epoll set, every connection non-blocking.
//
// Connections are named by ids that are never reused, so an epoll event or a
// parked waiter that outlives its connection is recognised and ignored.
// Handlers never destroy a connection they are handling: they mark it dead
// (close now) or closing (close once the reply is out), and the loop
// destroys it at the end of the round.

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "transport/store/socket.h"
#include "transport/store/tcp_store.h"
#include "transport/store/wire.h"

namespace ddp::transport::store {
namespace {

constexpr uint64_t kWakeId = 0;
// Listening socket i (one per bound address) is kFirstListenId + i;
// connections are numbered after the last one.
constexpr uint64_t kFirstListenId = 1;
// Reads per readable event before the loop moves on to other connections.
constexpr int kReadsPerEvent = 16;
// Connections accepted per round: small enough that a flood cannot evict a
// rank's connection between its accept and the read of its handshake (the
// handshake is read right at accept).
constexpr int kAcceptBatch = 16;
constexpr int kListenBacklog = 1024;
// Most bytes read and dropped from a closing connection after its last
// reply: the rest of the largest frame a client may be in the middle of.
constexpr size_t kMostDrainedBytes = wire::kFrameHeaderBytes + wire::kMaxFrameBytes;
// Pause before accepting again when the process is out of file descriptors.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);
// Upper bound of one epoll wait; the loop also wakes for every event, timer
// and Stop(), so this only bounds how stale a missed wake-up could leave it.
constexpr int kMaxPollMs = 1000;
constexpr size_t kLogLinesPerSecond = 20;
// Most bytes one recv() takes, through a buffer of the server's (a frame's
// buffer is reserved whole and appended to, never zero-filled).
constexpr size_t kReadChunkBytes = 256 * 1024;
// A connection keeps up to this much buffer memory between frames. A bigger
// buffer (a large value came through) is let go once done with: thousands
// of connections that once moved a 4 MiB value must not keep 4 MiB each,
// which max_buffered_bytes does not count.
constexpr size_t kKeepBufferBytes = 64 * 1024;
// What one stored entry costs beyond its key's and value's bytes (the hash
// node, two std::string headers, the bucket, allocator rounding: about 100
// bytes with libstdc++), charged against max_stored_bytes with them. Without
// it, a flood of 1-byte keys with empty values held 13 to 100 times the
// bound in memory.
constexpr size_t kEntryOverheadBytes = 128;

struct Connection {
  uint64_t id = 0;
  UniqueFd fd;
  std::string peer;
  bool authenticated = false;
  bool closing = false;  // no more input; close once `out` drains
  // Its client shut down its sending side (a half-close) after the whole
  // of the frame that waits for room: that frame is still read and
  // answered, and no further hang-up is watched for while it waits.
  bool input_ended = false;
  bool dead = false;     // close at the end of this round
  // Turned away for want of a place (RefuseForNow): it lingers only to
  // close cleanly, holds no place, and is not counted as open.
  bool refused_for_now = false;
  // Closing with every reply out: the write side is shut down, and input
  // is read and dropped until its end, the closing timer or
  // kMostDrainedBytes (`drained` so far), before the close.
  bool draining = false;
  size_t drained = 0;
  Deadline timer{};      // handshake deadline; when authenticated, when to check
                         // a partly received frame for progress; when closing,
                         // close deadline
  std::string in;        // the frame being received, header included
  size_t reserved = 0;   // bytes of the buffer bound held for that frame
  Deadline last_read{};  // when bytes of the frame last arrived
  std::string out;
  size_t out_pos = 0;    // bytes of `out` already sent
  size_t capacity = 0;   // in's and out's capacity, as last counted in buffer_capacity_
  uint32_t events = 0;   // current epoll interest
  std::unordered_set<uint64_t> waiters;

  size_t pending_out() const { return out.size() - out_pos; }
};

struct Waiter {
  uint64_t connection = 0;
  uint32_t request_id = 0;
  wire::Op op = wire::Op::kGet;
  std::vector<std::string> keys;
  Deadline deadline{};
  // Distinct keys of `keys` not set now, kept by Put and Delete: a Set
  // looks only at the waiters it may complete (missing reaches 0), so a
  // thousand ranks each waiting on a thousand keys cost the server a
  // million steps in all, not a million per Set.
  size_t missing = 0;
};

// Keys in log lines: printable, bounded.
std::string Printable(std::string_view text, size_t max = 64) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < max; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  if (text.size() > max) out += "...";
  return out;
}

// The default log sink: lines go to stderr from a thread of their own
// through a bounded queue, so that a stderr nobody reads (a full pipe to a
// launcher that stopped reading) holds up that thread, never a store's.
// One for the process, never joined: it may sit in that write at exit.
// Fork-safe: the queue's lock is held across fork(), and a child starts
// with an empty queue (the parent's lines are the parent's to print) and
// its own writer on its first line. At exit, lines still queued get a
// short, bounded chance to be written (kExitFlush).
class StderrLog {
 public:
  static StderrLog& Get() {
    static auto* log = new StderrLog();
    return *log;
  }

  void Post(std::string line) {
    std::lock_guard<std::mutex> lock(mu_);
    if (writer_pid_ != getpid()) {  // first use, or a child forked since
      writer_pid_ = getpid();
      std::thread([this] { Run(); }).detach();
    }
    if (lines_.size() >= kMostQueued) {
      ++dropped_;
      return;
    }
    lines_.push_back(std::move(line));
    cv_.notify_one();
  }

 private:
  static constexpr size_t kMostQueued = 256;
  static constexpr auto kExitFlush = std::chrono::milliseconds(200);

  StderrLog() {
    pthread_atfork([] { Get().mu_.lock(); }, [] { Get().mu_.unlock(); }, [] { Get().InChild(); });
    std::atexit([] { Get().Flush(std::chrono::steady_clock::now() + kExitFlush); });
  }

  // The forking thread holds mu_ (taken before the fork); nothing else of
  // the parent runs here. The condition variables may name waiters of
  // threads the child does not have, so they are made anew, not destroyed
  // (destroying one with waiters waits for them).
  void InChild() {
    new (&cv_) std::condition_variable();
    new (&idle_cv_) std::condition_variable();
    lines_.clear();
    dropped_ = 0;
    writing_ = false;
    mu_.unlock();
  }

  // Waits until this process's writer has written everything queued, or
  // until `deadline` (stderr may be a pipe nobody reads).
  void Flush(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (writer_pid_ != getpid()) return;  // no writer in this process: nothing queued
    idle_cv_.wait_until(lock, deadline, [&] { return lines_.empty() && dropped_ == 0 && !writing_; });
  }

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      // Waits for lines in turns of a second (nothing else to wait for).
      if (!cv_.wait_for(lock, std::chrono::seconds(1), [&] { return !lines_.empty(); })) continue;
      std::string text;
      for (const std::string& line : lines_) text += "ddp store: " + line + "\n";
      lines_.clear();
      if (dropped_ > 0) {
        text += "ddp store: " + std::to_string(dropped_) + " lines dropped: stderr was not read\n";
        dropped_ = 0;
      }
      writing_ = true;
      lock.unlock();
      for (size_t done = 0; done < text.size();) {
        const ssize_t n = write(STDERR_FILENO, text.data() + done, text.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      lock.lock();
      writing_ = false;
      idle_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;       // lines queued
  std::condition_variable idle_cv_;  // the writer finished a batch
  std::deque<std::string> lines_;    // under mu_
  uint64_t dropped_ = 0;             // under mu_
  bool writing_ = false;             // the writer has a batch out of the queue; under mu_
  pid_t writer_pid_ = 0;             // the process whose writer thread runs; under mu_
};

std::optional<int64_t> ParseInt64(std::string_view text) {
  if (text.empty()) return std::nullopt;
  int64_t value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

}  // namespace

class TcpStoreServer::Impl {
 public:
  Impl(TcpStoreServerOptions options, std::vector<UniqueFd> listen_fds, int port)
      : options_(std::move(options)),
        listen_fds_(std::move(listen_fds)),
        port_(port),
        next_id_(kFirstListenId + listen_fds_.size()),
        read_chunk_(kReadChunkBytes) {
    if (!options_.log) {
      options_.log = [](const std::string& line) { StderrLog::Get().Post(line); };
    }
  }

  ~Impl() { Stop(); }

  Status Init() {
    // A shortage (descriptors under `ulimit -n`, memory, threads under
    // `ulimit -u`) is RESOURCE_EXHAUSTED: the same start may succeed later.
    auto failed = [](const char* step, int err) {
      std::string text = std::string("cannot start the store server: ") + step + ": " + ErrnoString(err);
      const bool shortage = err == EMFILE || err == ENFILE || err == ENOMEM || err == EAGAIN;
      return shortage ? ResourceExhaustedError(std::move(text)) : InternalError(std::move(text));
    };
    epoll_fd_.Reset(epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_fd_.valid()) return failed("epoll_create1", errno);
    wake_fd_.Reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake_fd_.valid()) return failed("eventfd", errno);
    DDP_RETURN_IF_ERROR(AddListeners());
    DDP_RETURN_IF_ERROR(AddToEpoll(wake_fd_.get(), kWakeId, EPOLLIN));
    listening_ = true;
    // std::thread throws where no thread can start: a Status, not an
    // exception out of Start (which promises one, and ended the process).
    try {
      thread_ = std::thread([this] { Run(); });
    } catch (const std::system_error& e) {
      return failed("its thread", e.code().value());
    }
    return Status::Ok();
  }

  void Stop(std::string why = "", bool clean_end = false) {
    std::lock_guard<std::mutex> lock(stop_mu_);
    if (!thread_.joinable()) return;
    stop_reason_ = std::move(why);  // read by the server thread once it sees stop_
    stop_clean_end_ = clean_end;    // likewise
    stop_.store(true);
    const uint64_t one = 1;
    ssize_t n = write(wake_fd_.get(), &one, sizeof(one));
    (void)n;
    thread_.join();
  }

  int port() const { return port_; }
  const std::string& address() const { return options_.bind_address; }

  TcpStoreServerStats stats() const {
    TcpStoreServerStats s;
    s.accepted = accepted_.load();
    s.authenticated = authenticated_.load();
    s.refused_token = refused_token_.load();
    s.dropped_silent = dropped_silent_.load();
    s.evicted = evicted_.load();
    s.refused_malformed = refused_malformed_.load();
    s.refused_oversized = refused_oversized_.load();
    s.dropped_stalled = dropped_stalled_.load();
    s.open_connections = open_connections_.load();
    s.stored_bytes = stored_bytes_.load();
    s.buffered_bytes = buffered_bytes_.load();
    s.receiving_bytes = receiving_bytes_.load();
    s.parked_waits = parked_waits_.load();
    s.parked_key_bytes = parked_key_bytes_.load();
    s.requests = requests_.load();
    s.frames_waiting_for_room = frames_waiting_for_room_.load();
    s.buffer_capacity_bytes = buffer_capacity_bytes_.load();
    return s;
  }

 private:
  // ---- the loop ----

  void Run() {
    std::vector<epoll_event> events(256);
    while (!stop_.load()) {
      const int n = epoll_wait(epoll_fd_.get(), events.data(), static_cast<int>(events.size()),
                               NextTimeoutMs());
      if (n < 0 && errno != EINTR) {
        Log("epoll_wait failed: " + ErrnoString(errno) + "; stopping the store");
        break;
      }
      for (int i = 0; i < n; ++i) {
        const uint64_t id = events[i].data.u64;
        if (id == kWakeId) {
          uint64_t value;
          ssize_t r = read(wake_fd_.get(), &value, sizeof(value));
          (void)r;
        } else if (id < next_listen_id()) {
          AcceptSome(listen_fds_[id - kFirstListenId].get());
        } else {
          OnConnectionEvent(id, events[i].events);
        }
      }
      RetryDeferredWakes();
      FireTimers();
      FinishRound();
      if (!deferred_wakes_.empty()) {
        // Connections closed just now (FireTimers, FinishRound) may have
        // freed the room the held-back wakes wait for: tried only at the
        // next round, they waited for the next event, up to kMaxPollMs.
        RetryDeferredWakes();
        FinishRound();
      }
      buffered_bytes_.store(buffered_);
      receiving_bytes_.store(receiving_);
      frames_waiting_for_room_.store(waiting_for_memory_.size());
      buffer_capacity_bytes_.store(buffer_capacity_);
    }
    Shutdown();
  }

  int NextTimeoutMs() const {
    Deadline next = Clock::now() + std::chrono::milliseconds(kMaxPollMs);
    if (!timers_.empty()) next = std::min(next, timers_.begin()->first);
    if (!waiter_deadlines_.empty()) next = std::min(next, waiter_deadlines_.begin()->first);
    if (!listening_) next = std::min(next, accept_resume_);
    return MillisecondsUntil(next);
  }

  void FireTimers() {
    const Deadline now = Clock::now();
    while (!timers_.empty() && timers_.begin()->first <= now) {
      const uint64_t id = timers_.begin()->second;
      timers_.erase(timers_.begin());
      Connection* c = Find(id);
      if (c == nullptr) continue;
      c->timer = Deadline{};
      if (c->authenticated && !c->closing) {
        CheckFrameProgress(*c, now);
        continue;
      }
      if (!c->authenticated && !c->closing) {
        ++dropped_silent_;
        Log("dropped connection from " + c->peer + ": no handshake within " +
            std::to_string(options_.handshake_timeout.count()) + " ms");
      }
      MarkDead(*c);
    }
    while (!waiter_deadlines_.empty() && waiter_deadlines_.begin()->first <= now) {
      const uint64_t waiter_id = waiter_deadlines_.begin()->second;
      auto it = waiters_.find(waiter_id);
      if (it == waiters_.end()) {
        waiter_deadlines_.erase(waiter_deadlines_.begin());
        continue;
      }
      Waiter waiter = it->second;
      RemoveWaiter(waiter_id);
      if (Connection* c = Find(waiter.connection)) {
        // A wait whose keys exist was held back for room (WakeWaiters):
        // "not set" would send its caller looking for a rank that never
        // wrote the key.
        QueueReply(*c, ErrorReply(waiter.request_id,
                                  TimedOutError(AllExist(waiter.keys)
                                                    ? "set, but the reply waited for room in the "
                                                      "store's buffers (max_buffered_bytes) until "
                                                      "the deadline: the store is overloaded"
                                                    : NotSetBeforeTheDeadline(waiter.keys))));
      }
    }
    if (!listening_ && now >= accept_resume_) {
      if (AddListeners().ok()) listening_ = true;
    }
  }

  // The timer of a connection part-way through a request: one whose client
  // sent nothing more for frame_stall_timeout is dropped, releasing the
  // room held for the whole frame (it would wait for the rest forever).
  void CheckFrameProgress(Connection& c, Deadline now) {
    if (c.in.empty()) return;
    // While the frame waits for room, the server is the one not reading.
    const Deadline due = DeadlineAfter(waiting_for_memory_.count(c.id) ? now : c.last_read,
                               options_.frame_stall_timeout);
    if (due > now) {
      c.timer = due;
      timers_.emplace(due, c.id);
      return;
    }
    ++dropped_stalled_;
    const std::optional<uint32_t> length = wire::PeekFrameLength(c.in);
    Log("dropped connection from " + c.peer + ": it sent " + std::to_string(c.in.size()) +
        " of the " +
        (length ? std::to_string(wire::kFrameHeaderBytes + *length) + " bytes"
                : std::string("header")) +
        " of a request and then nothing for " +
        std::to_string(options_.frame_stall_timeout.count()) + " ms");
    MarkDead(c);
  }

  // Destroys dead and drained-closing connections; updates epoll interest;
  // lets connections that waited for buffer space read again.
  void FinishRound() {
    std::vector<uint64_t> touched;
    touched.swap(touched_);
    // The dead go first, so that the room they held goes to the frames
    // waiting for it in this round: granted after them, it waited for the
    // next event, up to kMaxPollMs, and a queue of connections that died
    // waiting (their close unseen while they were not read) moved one a
    // second, holding up every frame behind them.
    for (uint64_t id : touched) {
      Connection* c = Find(id);
      if (c == nullptr) continue;
      if (!c->dead && c->closing && !c->draining && c->pending_out() == 0) StartDraining(*c);
      if (c->dead) Destroy(id);
    }
    while (!memory_queue_.empty()) {
      const uint64_t id = memory_queue_.front();
      Connection* c = Find(id);
      if (!waiting_for_memory_.count(id) || c == nullptr || c->dead || c->closing) {
        waiting_for_memory_.erase(id);
        memory_queue_.pop_front();
        continue;
      }
      const size_t frame_bytes = wire::kFrameHeaderBytes + *wire::PeekFrameLength(c->in);
      if (!Fits(frame_bytes)) break;  // first come, first served
      HoldRoom(*c, frame_bytes);
      c->last_read = Clock::now();  // the client's stall clock starts again
      touched.push_back(id);
      waiting_for_memory_.erase(id);
      memory_queue_.pop_front();
    }
    for (uint64_t id : touched) {
      Connection* c = Find(id);
      if (c == nullptr) continue;
      UpdateInterest(*c);
      CountCapacity(*c);
    }
  }

  void Shutdown() {
    const Status stopping =
        UnavailableError(std::string(stop_clean_end_ ? wire::kCleanStopNotice : wire::kStopNotice) +
                         (stop_reason_.empty() ? "" : ": " + stop_reason_));
    // Answer every parked call so that no client waits for its deadline.
    std::vector<uint64_t> ids;
    for (auto& [id, w] : waiters_) ids.push_back(id);
    for (uint64_t waiter_id : ids) {
      Waiter waiter = waiters_[waiter_id];
      RemoveWaiter(waiter_id);
      if (Connection* c = Find(waiter.connection)) {
        QueueReply(*c, ErrorReply(waiter.request_id, stopping));
      }
    }
    std::vector<uint64_t> conns;
    for (auto& [id, c] : connections_) {
      conns.push_back(id);
      // A client with no call under way reads this (request id 0: the
      // server is closing the connection) ahead of the end of the stream,
      // with its next call: it learns why the store went away (its owner
      // closed it after a clean shutdown, say), not only that it did.
      if (c.authenticated && !c.closing) QueueReply(c, ErrorReply(0, stopping));
    }
    for (uint64_t id : conns) Destroy(id);
    // A child forked without exec holds copies of the listening sockets:
    // close() alone would leave them accepting, and a client connecting
    // would complete the TCP handshake and then wait out its deadline.
    for (const UniqueFd& fd : listen_fds_) shutdown(fd.get(), SHUT_RDWR);
    listen_fds_.clear();
  }

  // ---- accepting ----

  uint64_t next_listen_id() const { return kFirstListenId + listen_fds_.size(); }

  // Every listening socket into the epoll set (again, after a pause; one
  // already there from a try that failed part-way is fine).
  Status AddListeners() {
    for (size_t i = 0; i < listen_fds_.size(); ++i) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = kFirstListenId + i;
      if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, listen_fds_[i].get(), &ev) != 0 &&
          errno != EEXIST) {
        return InternalError("epoll_ctl(ADD) of a listening socket: " + ErrnoString(errno));
      }
    }
    return Status::Ok();
  }

  void AcceptSome(int listen_fd) {
    for (int i = 0; i < kAcceptBatch; ++i) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        const int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK) return;
        if (err == EINTR || err == ECONNABORTED) continue;
        if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
          if (!unauthenticated_.empty()) {
            Evict("out of file descriptors");
            continue;
          }
          Log("cannot accept connections: " + ErrnoString(err) + "; pausing for " +
              std::to_string(kAcceptPause.count()) + " ms");
          PauseAccepting();
          return;
        }
        Log("accept failed: " + ErrnoString(err));
        return;
      }
      UniqueFd owned(fd);
      const std::string peer = FormatAddress(reinterpret_cast<sockaddr*>(&addr), len);
      // Connections being closed after a refusal (draining_) hold no place:
      // the oldest makes way for a newcomer that gets one, and a newcomer
      // refused for want of a place lingers as they do.
      const size_t live = connections_.size() - draining_.size();
      if (connections_.size() >= options_.max_connections && !draining_.empty() &&
          live < options_.max_connections) {
        Destroy(*draining_.begin());
      }
      if (live >= options_.max_connections) {
        if (unauthenticated_.empty()) {
          RefuseForNow(std::move(owned), peer,
                       "the store already holds " + std::to_string(live) +
                           " connections, its limit (TcpStoreServerOptions::max_connections)");
          continue;
        }
        Evict("the connection limit was reached");
      }
      if (unauthenticated_.size() >= options_.max_unauthenticated) {
        Evict("newer connections arrived");
      }
      ++accepted_;
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      const uint64_t id = next_id_++;
      Connection& c = connections_[id];
      c.id = id;
      c.fd = std::move(owned);
      c.peer = peer;
      c.timer = DeadlineAfter(Clock::now(), options_.handshake_timeout);
      timers_.emplace(c.timer, id);
      unauthenticated_.insert(id);
      open_connections_.store(connections_.size() - refused_lingering_);
      if (!AddToEpoll(c.fd.get(), id, EPOLLIN).ok()) {
        MarkDead(c);
        continue;
      }
      c.events = EPOLLIN;
      // A rank sends its handshake right after connecting; reading it now
      // authenticates the rank before a flood can push it out.
      OnReadable(c);
      Touch(c);
    }
  }

  // Answers a connection that gets no place here: its reply, then the end of
  // the stream, and what it still sends (its hello, a request behind it) is
  // read and dropped while it lingers as a refused connection does
  // (StartDraining: at most max_unauthenticated of them, for at most
  // refused_close_grace, or kMostDrainedBytes), so that the close meets no
  // unread input. Closed at once with input unread, it was reset, and a
  // newcomer that sent more than a hello lost the reply to the reset.
  // Clients retry, so only the 1st, 2nd, 4th, 8th... refusal is logged.
  void RefuseForNow(UniqueFd fd, const std::string& peer, const std::string& why) {
    ++refused_for_now_;
    if ((refused_for_now_ & (refused_for_now_ - 1)) == 0) {
      Log("refused connection from " + peer + ": " + why + " (" +
          std::to_string(refused_for_now_) + " refused so far)");
    }
    const uint64_t id = next_id_++;
    Connection& c = connections_[id];
    c.id = id;
    c.fd = std::move(fd);
    c.peer = peer;
    c.refused_for_now = true;
    ++refused_lingering_;
    if (!AddToEpoll(c.fd.get(), id, EPOLLIN).ok()) {
      MarkDead(c);
      return;
    }
    c.events = EPOLLIN;
    Refuse(c, HandshakeReply(UnavailableError(why)));
  }

  void PauseAccepting() {
    for (const UniqueFd& fd : listen_fds_) epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd.get(), nullptr);
    listening_ = false;
    accept_resume_ = Clock::now() + kAcceptPause;
  }

  // Drops the oldest connection that has not presented a token.
  void Evict(const std::string& why) {
    if (unauthenticated_.empty()) return;
    const uint64_t id = *unauthenticated_.begin();
    Connection* c = Find(id);
    if (c != nullptr) {
      ++evicted_;
      Log("dropped connection from " + c->peer + " before its handshake: " + why);
    }
    Destroy(id);
  }

  // ---- reading ----

  void OnConnectionEvent(uint64_t id, uint32_t events) {
    Connection* c = Find(id);
    if (c == nullptr || c->dead) return;
    if (c->draining) {
      Drain(*c);
      return;
    }
    if (events & (EPOLLHUP | EPOLLERR)) {
      // Reset or fully shut down: nothing more can be read or delivered.
      MarkDead(*c);
      return;
    }
    if ((events & EPOLLRDHUP) && waiting_for_memory_.count(id)) {
      // Its client ended its stream while the frame waited for room (the
      // connection is not read meanwhile, so only this says so). When the
      // rest of the frame arrived before that end (a client that sent its
      // request and shut down its sending side), the request is answered
      // in its turn, as one read at once would be; cut short, it never can
      // be, and the frame's place in the queue and the connection's slot
      // go now, not when its turn comes. A client that closed altogether
      // after a whole request looks the same from here: its request is
      // handled, and the reply meets the reset.
      if (RestOfFrameArrived(*c)) {
        c->input_ended = true;
        Touch(*c);  // stops watching for the hang-up it has seen
        return;
      }
      Log("dropped connection from " + c->peer +
          ": its client closed while its request waited for room in the store's buffers");
      AnswerParkedAtEndOfStream(*c);
      MarkDead(*c);
      return;
    }
    if (events & EPOLLOUT) Flush(*c);
    if (!c->dead && (events & EPOLLIN)) OnReadable(*c);
    Touch(*c);
  }

  // Whether the socket holds the rest of the frame whose header is in `c.in`
  // (the connection is not read while that frame waits for room).
  static bool RestOfFrameArrived(const Connection& c) {
    const std::optional<uint32_t> length = wire::PeekFrameLength(c.in);
    int queued = 0;
    if (!length || ioctl(c.fd.get(), FIONREAD, &queued) != 0) return false;
    return wire::kFrameHeaderBytes + *length <= c.in.size() + static_cast<size_t>(queued);
  }

  size_t FrameLimit(const Connection& c) const {
    return c.authenticated ? wire::kMaxFrameBytes : wire::kMaxHandshakeBytes;
  }

  // True when `bytes` more can be buffered. With nothing buffered anything
  // fits, so one frame can always make progress and nobody waits forever.
  bool Fits(size_t bytes) const {
    return buffered_ == 0 || buffered_ + bytes <= options_.max_buffered_bytes;
  }

  // Reads exactly up to the end of the current frame, never into the next:
  // a frame's whole size is reserved against the total bound when its header
  // arrives, and the connection waits (stops reading) while it does not fit.
  // A request left part-way gets a timer (CheckFrameProgress).
  void OnReadable(Connection& c) {
    ReadFrames(c);
    if (c.authenticated && !c.dead && !c.closing && !c.in.empty() && c.timer == Deadline{}) {
      c.timer = DeadlineAfter(c.last_read, options_.frame_stall_timeout);
      timers_.emplace(c.timer, c.id);
    }
  }

  void ReadFrames(Connection& c) {
    for (int reads = 0;;) {
      if (c.dead || c.closing) return;
      size_t want = 0;
      if (c.in.size() < wire::kFrameHeaderBytes) {
        want = wire::kFrameHeaderBytes - c.in.size();
      } else {
        const uint32_t length = *wire::PeekFrameLength(c.in);
        const size_t frame_bytes = wire::kFrameHeaderBytes + length;
        if (length > FrameLimit(c)) {
          RefuseOversized(c, length);
          return;
        }
        if (c.in.size() == frame_bytes) {
          HandleFrame(c);
          continue;
        }
        if (c.reserved == 0) {
          // Behind frames already waiting for room, even when this one
          // would fit: steady small requests would otherwise take every
          // bit of room freed and a waiting large Set would never get its
          // turn. Handshakes are exempt from waiting altogether: they are
          // small (kMaxHandshakeBytes), few (max_unauthenticated) and must
          // be read at once, or a rank's connection could be evicted or
          // dropped at its handshake deadline while large frames of
          // others hold every bit of room.
          const bool must_wait =
              c.authenticated && (!waiting_for_memory_.empty() || !Fits(frame_bytes));
          if (must_wait) {
            if (waiting_for_memory_.insert(c.id).second) memory_queue_.push_back(c.id);
            Touch(c);
            return;
          }
          HoldRoom(c, frame_bytes);
        }
        c.in.reserve(frame_bytes);  // once per frame
        want = frame_bytes - c.in.size();
      }
      // Level-triggered epoll reports the rest on the next round.
      if (reads == kReadsPerEvent) return;
      ++reads;
      const ssize_t n = recv(c.fd.get(), read_chunk_.data(), std::min(want, read_chunk_.size()), 0);
      if (n > 0) {
        c.in.append(read_chunk_.data(), static_cast<size_t>(n));
        c.last_read = Clock::now();
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n == 0 && !c.waiters.empty()) {
        AnswerParkedAtEndOfStream(c);
        if (c.dead) return;
      }
      if (n == 0 && c.pending_out() > 0) {
        // The end of the client's stream, with replies not yet sent: it may
        // have shut down only its sending side (a half-close) and still be
        // reading them. Nothing more comes in (a request cut short by the
        // end is not answered, and the room held for it goes now); the
        // connection closes once they are out.
        ReleaseRoom(c);
        std::string().swap(c.in);
        CloseOnceSent(c, options_.frame_stall_timeout);
        return;
      }
      MarkDead(c);  // peer closed or reset, every reply sent: nothing more to answer
      return;
    }
  }

  // The end of the stream of a client with calls parked: each is answered
  // now, in the order they parked, naming why, instead of being dropped
  // unanswered (its caller waited for its deadline). A client that shut
  // down only its sending side (a half-close) can still read the answer,
  // but it looks the same here as one that exited or called Close()
  // (shutdown of both sides: nothing of the reading side shows on the
  // wire), and keeping the calls until their keys are set would hold every
  // closed client's connection and parked keys until its deadline.
  void AnswerParkedAtEndOfStream(Connection& c) {
    std::vector<uint64_t> ids(c.waiters.begin(), c.waiters.end());
    std::sort(ids.begin(), ids.end());  // waiter ids grow as calls park
    for (uint64_t waiter_id : ids) {
      auto it = waiters_.find(waiter_id);
      if (it == waiters_.end()) continue;
      const uint32_t request_id = it->second.request_id;
      RemoveWaiter(waiter_id);
      QueueReply(c, ErrorReply(request_id,
                               UnavailableError("the store stopped waiting: the client ended its "
                                                "stream (a half-close or an exit, which the "
                                                "store cannot tell apart), and a wait is not "
                                                "kept past that")));
      if (c.dead) return;
    }
  }

  // The room under max_buffered_bytes held for the frame `c` is receiving
  // (its whole size, from its header on), and its release when the frame is
  // whole or will never be.
  void HoldRoom(Connection& c, size_t frame_bytes) {
    c.reserved = frame_bytes;
    buffered_ += frame_bytes;
    receiving_ += frame_bytes;
  }
  void ReleaseRoom(Connection& c) {
    buffered_ -= c.reserved;
    receiving_ -= c.reserved;
    c.reserved = 0;
  }

  void RefuseOversized(Connection& c, uint32_t length) {
    ++refused_oversized_;
    const std::string why = "frame of " + std::to_string(length) + " bytes exceeds the limit of " +
                            std::to_string(FrameLimit(c));
    Log("refused " + std::string(c.authenticated ? "request" : "handshake") + " from " + c.peer +
        ": " + why);
    const Status error = ResourceExhaustedError(why);
    Refuse(c, c.authenticated ? ErrorReply(0, error) : HandshakeReply(error));
  }

  void HandleFrame(Connection& c) {
    if (c.authenticated) ClearTimer(c);  // the frame is whole: no stall to watch for
    ReleaseRoom(c);
    // The frame is handled where it lies, moved out of the connection; the
    // buffer comes back empty, with its memory only when that is small.
    std::string frame;
    frame.swap(c.in);
    const std::string_view body = std::string_view(frame).substr(wire::kFrameHeaderBytes);
    if (c.authenticated) {
      HandleRequest(c, body);
    } else {
      HandleHandshake(c, body);
    }
    if (frame.capacity() <= kKeepBufferBytes) {
      frame.clear();
      c.in.swap(frame);
    }
  }

  // ---- handshake ----

  void HandleHandshake(Connection& c, std::string_view body) {
    wire::Reader r(body);
    std::string_view magic;
    uint16_t version = 0;
    uint16_t reserved = 0;
    std::string_view token;
    if (!r.Bytes(4, magic) || magic != std::string_view(wire::kMagic, 4)) {
      ++refused_malformed_;
      Log("refused connection from " + c.peer + ": not a store handshake");
      MarkDead(c);
      return;
    }
    if (!r.U16(version)) {
      MalformedHandshake(c, "truncated handshake");
      return;
    }
    if (version != wire::kVersion) {
      ++refused_malformed_;
      const std::string why = "client speaks store protocol version " + std::to_string(version) +
                              ", this server speaks " + std::to_string(wire::kVersion);
      Log("refused connection from " + c.peer + ": " + why);
      Refuse(c, HandshakeReply(FailedPreconditionError(why)));
      return;
    }
    if (!r.U16(reserved) || !r.String(token, wire::kMaxHandshakeBytes) || !r.at_end()) {
      MalformedHandshake(c, "malformed handshake");
      return;
    }
    if (!wire::TokensEqual(options_.job_token, token)) {
      ++refused_token_;
      Log("refused connection from " + c.peer + ": wrong job token");
      Refuse(c, HandshakeReply(PermissionDeniedError("wrong job token")));
      return;
    }
    c.authenticated = true;
    ++authenticated_;
    unauthenticated_.erase(c.id);
    ClearTimer(c);
    QueueReply(c, HandshakeReply(Status::Ok()));
  }

  void MalformedHandshake(Connection& c, const std::string& why) {
    ++refused_malformed_;
    Log("refused connection from " + c.peer + ": " + why);
    Refuse(c, HandshakeReply(InvalidArgumentError(why)));
  }

  static std::string HandshakeReply(const Status& status) {
    wire::Writer w;
    w.Bytes(std::string_view(wire::kMagic, 4));
    w.U16(wire::kVersion);
    w.U8(static_cast<uint8_t>(status.code()));
    w.String(status.message());
    return w.Frame();
  }

  // ---- requests ----

  static std::string ErrorReply(uint32_t request_id, const Status& status) {
    wire::Writer w;
    w.U32(request_id);
    w.U8(static_cast<uint8_t>(status.code()));
    w.String(status.message());
    return w.Frame();
  }

  static wire::Writer OkReply(uint32_t request_id) {
    wire::Writer w;
    w.U32(request_id);
    w.U8(static_cast<uint8_t>(StatusCode::kOk));
    return w;
  }

  // Reads a key: INVALID_ARGUMENT when missing or empty, RESOURCE_EXHAUSTED
  // when longer than kMaxKeyBytes.
  static Status ReadKey(wire::Reader& r, std::string_view& key) {
    return ReadBounded(r, key, kMaxKeyBytes, "key", /*allow_empty=*/false);
  }

  static Status ReadBounded(wire::Reader& r, std::string_view& out, size_t max,
                            const char* what, bool allow_empty) {
    uint32_t n = 0;
    if (!r.U32(n)) return InvalidArgumentError(std::string("truncated ") + what);
    if (n > max) {
      return ResourceExhaustedError(std::string(what) + " of " + std::to_string(n) +
                                    " bytes exceeds the limit of " + std::to_string(max));
    }
    if (!r.Bytes(n, out)) return InvalidArgumentError(std::string("truncated ") + what);
    if (n == 0 && !allow_empty) return InvalidArgumentError(std::string("empty ") + what);
    return Status::Ok();
  }

  void HandleRequest(Connection& c, std::string_view body) {
    wire::Reader r(body);
    uint8_t op = 0;
    uint32_t request_id = 0;
    if (!r.U8(op) || !r.U32(request_id)) {
      RefuseRequest(c, 0, op, InvalidArgumentError("truncated request header"));
      return;
    }
    ++requests_;  // before any reply to it can reach the client
    Status status;
    switch (static_cast<wire::Op>(op)) {
      case wire::Op::kSet: status = DoSet(c, request_id, r); break;
      case wire::Op::kGet: status = DoGet(c, request_id, r); break;
      case wire::Op::kTryGet: status = DoTryGet(c, request_id, r); break;
      case wire::Op::kAdd: status = DoAdd(c, request_id, r); break;
      case wire::Op::kWait: status = DoWait(c, request_id, r); break;
      case wire::Op::kDelete: status = DoDelete(c, request_id, r); break;
      case wire::Op::kCompareSet: status = DoCompareSet(c, request_id, r); break;
      case wire::Op::kMultiGet: status = DoMultiGet(c, request_id, r); break;
      case wire::Op::kNumKeys: status = DoNumKeys(c, request_id, r); break;
      case wire::Op::kCheck: status = DoCheck(c, request_id, r); break;
      default:
        status = InvalidArgumentError("unknown operation " + std::to_string(op));
        break;
    }
    if (status.ok()) return;
    if (status.code() == StatusCode::kInvalidArgument) {
      // The request does not follow the protocol: refuse it and drop the
      // connection, since nothing it sends next can be trusted.
      RefuseRequest(c, request_id, op, status);
      return;
    }
    // A well-formed request that breaks a bound or fails: answer it.
    QueueReply(c, ErrorReply(request_id, status));
  }

  void RefuseRequest(Connection& c, uint32_t request_id, uint8_t op, const Status& status) {
    ++refused_malformed_;
    Log("refused " + std::string(wire::OpName(op)) + " request from " + c.peer + ": " +
        status.message());
    Refuse(c, ErrorReply(request_id, status));
  }

  // Handlers return OK once they have answered or parked the request, an
  // INVALID_ARGUMENT for a malformed one, or another error to send back.
  Status DoSet(Connection& c, uint32_t request_id, wire::Reader& r) {
    std::string_view key, value;
    DDP_RETURN_IF_ERROR(ReadKey(r, key));
    DDP_RETURN_IF_ERROR(ReadBounded(r, value, kMaxValueBytes, "value", /*allow_empty=*/true));
    if (!r.at_end()) return InvalidArgumentError("trailing bytes after set");
    DDP_RETURN_IF_ERROR(Put(key, value));
    QueueReply(c, OkReply(request_id).Frame());
    return Status::Ok();
  }

  Status DoGet(Connection& c, uint32_t request_id, wire::Reader& r) {
    uint32_t timeout_ms = 0;
    std::string_view key;
    if (!r.U32(timeout_ms)) return InvalidArgumentError("truncated get");
    DDP_RETURN_IF_ERROR(ReadKey(r, key));
    if (!r.at_end()) return InvalidArgumentError("trailing bytes after get");
    auto it = data_.find(std::string(key));
    if (it != data_.end()) {
      wire::Writer w = OkReply(request_id);
      w.String(it->second);
      QueueReply(c, w.Frame());
      return Status::Ok();
    }
    return Park(c, request_id, wire::Op::kGet, {std::string(key)}, timeout_ms);
  }

  Status DoTryGet(Connection& c, uint32_t request_id, wire::Reader& r) {
    std::string_view key;
    DDP_RETURN_IF_ERROR(ReadKey(r, key));
    if (!r.at_end()) return InvalidArgumentError("trailing bytes after try_get");
    wire::Writer w = OkReply(request_id);
    auto it = data_.find(std::string(key));
    w.U8(it != data_.end() ? 1 : 0);
    if (it != data_.end()) w.String(it->second);
    QueueReply(c, w.Frame());
    return Status::Ok();
  }

  Status DoAdd(Connection& c, uint32_t request_id, wire::Reader& r) {
    int64_t delta = 0;
    std::string_view key;
    if (!r.I64(delta)) return InvalidArgumentError("truncated add");
    DDP_RETURN_IF_ERROR(ReadKey(r, key));
    if (!r.at_end()) return InvalidArgumentError("trailing bytes after add");
    int64_t current = 0;
    auto it = data_.find(std::string(key));
    if (it != data_.end()) {
      std::optional<int64_t> parsed = ParseInt64(it->second);
      if (!parsed) {
        return FailedPreconditionError("key '" + Printable(key) +
                                       "' holds a value that is not an integer");
      }
      current = *parsed;
    }
    int64_t result = 0;
    if (__builtin_add_overflow(current, delta, &result)) {
      return FailedPreconditionError("adding " + std::to_string(delta) + " to key '" +
                                     Printable(key) + "' overflows");
    }
    DDP_RETURN_IF_ERROR(Put(key, std::to_string(result)));
    wire::Writer w = OkReply(request_id);
    w.I64(result);
    QueueReply(c, w.Frame());
    return Status::Ok();
  }

  // A wait's or multi-get's timeout and key list.
  Status ReadKeyList(wire::Reader& r, const char* what, uint32_t& timeout_ms, std::vector<std::string>& keys) {
    if (!r.U32(timeout_ms)) return InvalidArgumentError(std::string("truncated ") + what);
    return ReadKeys(r, what, keys);
  }

  // A key list (a check's, or the rest of a wait's), to the end of the request.
  static Status ReadKeys(wire::Reader& r, const char* what, std::vector<std::string>& keys) {
    uint32_t count = 0;
    if (!r.U32(count)) return InvalidArgumentError(std::string("truncated ") + what);
    if (count > wire::kMaxWaitKeys) {
      return ResourceExhaustedError(std::string(what) + " on " + std::to_string(count) +
                                    " keys exceeds the limit of " + std::to_string(wire::kMaxWaitKeys));
    }
    keys.reserve(count);
    for (uint32_t i = 0; i < count; ++i) {
      std::string_view key;
      DDP_RETURN_IF_ERROR(ReadKey(r, key));
      keys.emplace_back(key);
    }
    if (!r.at_end()) return InvalidArgumentError(std::string("trailing bytes after ") + what);
    return Status::Ok();
  }

  Status DoWait(Connection& c, uint32_t request_id, wire::Reader& r) {
    uint32_t timeout_ms = 0;
    std::vector<std::string> keys;
    DDP_RETURN_IF_ERROR(ReadKeyList(r, "wait", timeout_ms, keys));
    if (AllExist(keys)) {
      QueueReply(c, OkReply(request_id).Frame());
      return Status::Ok();
    }
    return Park(c, request_id, wire::Op::kWait, std::move(keys), timeout_ms);
  }

  Status DoMultiGet(Connection& c, uint32_t request_id, wire::Reader& r) {
    uint32_t timeout_ms = 0;
    std::vector<std::string> keys;
    DDP_RETURN_IF_ERROR(ReadKeyList(r, "multi_get", timeout_ms, keys));
    if (AllExist(keys)) {
      StatusOr<std::string> reply = ValuesReply(request_id, keys);
      DDP_RETURN_IF_ERROR(reply.status());
      QueueReply(c, *reply);
      return Status::Ok();
    }
    return Park(c, request_id, wire::Op::kMultiGet, std::move(keys), timeout_ms);
  }

  // The bytes of a multi-get's reply to `keys` (all set).
  size_t ValuesReplyBytes(const std::vector<std::string>& keys) const {
    size_t bytes = 64;
    for (const std::string& key : keys) bytes += 4 + data_.at(key).size();
    return bytes;
  }

  // A multi-get's reply frame: the keys' values in order, or
  // RESOURCE_EXHAUSTED when they are more than one frame carries.
  StatusOr<std::string> ValuesReply(uint32_t request_id, const std::vector<std::string>& keys) const {
    const size_t bytes = ValuesReplyBytes(keys);
    if (bytes > wire::kMaxFrameBytes) {
      return ResourceExhaustedError("the values of the " + std::to_string(keys.size()) + " keys from '" +
                                    Printable(keys.front()) + "' total " + std::to_string(bytes) +
                                    " bytes, " + wire::kReplyTooLarge + " (" +
                                    std::to_string(wire::kMaxFrameBytes) + "): ask for fewer keys at once");
    }
    wire::Writer w = OkReply(request_id);
    for (const std::string& key : keys) w.String(data_.at(key));
    return w.Frame();
  }

  Status DoNumKeys(Connection& c, uint32_t request_id, wire::Reader& r) {
    if (!r.at_end()) return InvalidArgumentError("trailing bytes after num_keys");
    wire::Writer w = OkReply(request_id);
    w.I64(static_cast<int64_t>(data_.size()));
    QueueReply(c, w.Frame());
    return Status::Ok();
  }

  Status DoCheck(Connection& c, uint32_t request_id, wire::Reader& r) {
    std::vector<std::string> keys;
    DDP_RETURN_IF_ERROR(ReadKeys(r, "check", keys));
    wire::Writer w = OkReply(request_id);
    w.U8(AllExist(keys) ? 1 : 0);
    QueueReply(c, w.Frame());
    return Status::Ok();
  }

  Status DoDelete(Connection& c, uint32_t request_id, wire::Reader& r) {
    std::string_view key;
    DDP_RETURN_IF_ERROR(ReadKey(r, key));
    if (!r.at_end()) return InvalidArgumentError("trailing bytes after delete");
    auto it = data_.find(std::string(key));
    const bool existed = it != data_.end();
    if (existed) {
      stored_bytes_ -= EntryBytes(it->first, it->second);
      data_.erase(it);
      CountKeyChange(std::string(key), /*set=*/false);
    }
    wire::Writer w = OkReply(request_id);
    w.U8(existed ? 1 : 0);
    QueueReply(c, w.Frame());
    return Status::Ok();
  }

  // One step of the server's single thread, so no other request comes
  // between the comparison and the write.
  Status DoCompareSet(Connection& c, uint32_t request_id, wire::Reader& r) {
    std::string_view key, expected, desired;
    uint8_t has_expected = 0;
    DDP_RETURN_IF_ERROR(ReadKey(r, key));
    if (!r.U8(has_expected)) return InvalidArgumentError("truncated compare_set");
    if (has_expected > 1) {
      return InvalidArgumentError("compare_set's has_expected is " + std::to_string(has_expected) +
                                  ", not 0 or 1");
    }
    if (has_expected) {
      DDP_RETURN_IF_ERROR(ReadBounded(r, expected, kMaxValueBytes, "value", /*allow_empty=*/true));
    }
    DDP_RETURN_IF_ERROR(ReadBounded(r, desired, kMaxValueBytes, "value", /*allow_empty=*/true));
    if (!r.at_end()) return InvalidArgumentError("trailing bytes after compare_set");
    auto it = data_.find(std::string(key));
    const bool matches = has_expected ? it != data_.end() && it->second == expected : it == data_.end();
    if (matches) DDP_RETURN_IF_ERROR(Put(key, desired));
    wire::Writer w = OkReply(request_id);
    if (matches) {
      w.U8(1);
      w.String(desired);
    } else {
      w.U8(it != data_.end() ? 1 : 0);
      if (it != data_.end()) w.String(it->second);
    }
    QueueReply(c, w.Frame());
    return Status::Ok();
  }

  // ---- data and waiters ----

  // What an entry counts against max_stored_bytes.
  static size_t EntryBytes(std::string_view key, std::string_view value) {
    return key.size() + value.size() + kEntryOverheadBytes;
  }

  Status Put(std::string_view key, std::string_view value) {
    std::string k(key);
    auto it = data_.find(k);
    const size_t old_bytes = it == data_.end() ? 0 : EntryBytes(it->first, it->second);
    const size_t new_bytes = EntryBytes(key, value);
    if (stored_bytes_ - old_bytes + new_bytes > options_.max_stored_bytes) {
      return ResourceExhaustedError("the store holds " + std::to_string(stored_bytes_.load()) +
                                    " bytes; setting key '" + Printable(key) +
                                    "' would exceed its limit of " +
                                    std::to_string(options_.max_stored_bytes));
    }
    stored_bytes_ = stored_bytes_ - old_bytes + new_bytes;
    if (it == data_.end()) {
      data_.emplace(std::move(k), std::string(value));
      CountKeyChange(std::string(key), /*set=*/true);
    } else {
      it->second.assign(value);
    }
    WakeWaiters(std::string(key));
    return Status::Ok();
  }

  // Why a wait on `keys` ran out of time: a key of them still missing, by
  // name (whole: a rank's keys differ at their end), so that its caller can
  // tell whose key it waited for.
  std::string NotSetBeforeTheDeadline(const std::vector<std::string>& keys) const {
    const std::string* first_missing = nullptr;
    size_t missing = 0;
    for (const std::string& key : keys) {
      if (data_.find(key) != data_.end()) continue;
      if (first_missing == nullptr) first_missing = &key;
      ++missing;
    }
    if (first_missing == nullptr) return "not set before the deadline";
    std::string text = "key '" + Printable(*first_missing, kMaxKeyBytes) + "' not set before the deadline";
    if (keys.size() > 1) {
      text += " (" + std::to_string(missing) + " of the " + std::to_string(keys.size()) + " keys missing)";
    }
    return text;
  }

  bool AllExist(const std::vector<std::string>& keys) const {
    for (const std::string& key : keys) {
      if (data_.find(key) == data_.end()) return false;
    }
    return true;
  }

  // What a waiter's keys hold: each key in the waiter and in key_waiters_,
  // with some bookkeeping per key.
  static size_t ParkedKeyBytes(const std::vector<std::string>& keys) {
    size_t bytes = 0;
    for (const std::string& key : keys) bytes += 2 * key.size() + 64;
    return bytes;
  }

  Status Park(Connection& c, uint32_t request_id, wire::Op op, std::vector<std::string> keys,
              uint32_t timeout_ms) {
    if (timeout_ms == 0) {
      QueueReply(c, ErrorReply(request_id, TimedOutError(NotSetBeforeTheDeadline(keys))));
      return Status::Ok();
    }
    if (c.waiters.size() >= options_.max_waits_per_connection) {
      return ResourceExhaustedError("already " + std::to_string(c.waiters.size()) +
                                    " waits parked on this connection (the limit)");
    }
    const size_t key_bytes = ParkedKeyBytes(keys);
    if (parked_key_bytes_ + key_bytes > options_.max_parked_key_bytes) {
      return ResourceExhaustedError("a wait on " + std::to_string(keys.size()) + " keys (" +
                                    std::to_string(key_bytes) + " bytes parked) over the " +
                                    std::to_string(parked_key_bytes_.load()) +
                                    " bytes of keys parked now exceeds the store's limit of " +
                                    std::to_string(options_.max_parked_key_bytes) +
                                    " (TcpStoreServerOptions::max_parked_key_bytes)");
    }
    parked_key_bytes_ += key_bytes;
    const uint64_t waiter_id = next_waiter_id_++;
    Waiter& w = waiters_[waiter_id];
    w.connection = c.id;
    w.request_id = request_id;
    w.op = op;
    w.keys = std::move(keys);
    w.deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    for (const std::string& key : w.keys) {
      if (key_waiters_[key].insert(waiter_id).second && data_.find(key) == data_.end()) ++w.missing;
    }
    waiter_deadlines_.emplace(w.deadline, waiter_id);
    c.waiters.insert(waiter_id);
    parked_waits_ = waiters_.size();
    return Status::Ok();
  }

  void RemoveWaiter(uint64_t waiter_id) {
    auto it = waiters_.find(waiter_id);
    if (it == waiters_.end()) return;
    Waiter& w = it->second;
    for (const std::string& key : w.keys) {
      auto kw = key_waiters_.find(key);
      if (kw == key_waiters_.end()) continue;
      kw->second.erase(waiter_id);
      if (kw->second.empty()) key_waiters_.erase(kw);
    }
    waiter_deadlines_.erase({w.deadline, waiter_id});
    if (Connection* c = Find(w.connection)) c->waiters.erase(waiter_id);
    parked_key_bytes_ -= ParkedKeyBytes(w.keys);
    waiters_.erase(it);
    parked_waits_ = waiters_.size();
  }

  // Answers the waits that `key` completes. Replies count against the
  // total buffer bound like frames read: when the next one does not fit
  // (thousands of ranks parked on one large value), the rest stay parked
  // and are answered as replies drain (RetryDeferredWakes), instead of all
  // being copied into memory at once.
  // `key` was created (set) or removed: the waiters on it miss one key
  // fewer or one more.
  void CountKeyChange(const std::string& key, bool set) {
    auto kw = key_waiters_.find(key);
    if (kw == key_waiters_.end()) return;
    for (uint64_t waiter_id : kw->second) {
      auto it = waiters_.find(waiter_id);
      if (it == waiters_.end()) continue;
      if (set) {
        --it->second.missing;
      } else {
        ++it->second.missing;
      }
    }
  }

  void WakeWaiters(const std::string& key) {
    auto kw = key_waiters_.find(key);
    if (kw == key_waiters_.end()) return;
    std::vector<uint64_t> candidates;
    for (uint64_t waiter_id : kw->second) {
      auto it = waiters_.find(waiter_id);
      if (it != waiters_.end() && it->second.missing == 0) candidates.push_back(waiter_id);
    }
    for (uint64_t waiter_id : candidates) {
      auto it = waiters_.find(waiter_id);
      if (it == waiters_.end()) continue;
      const size_t reply_bytes =
          it->second.op == wire::Op::kGet        ? 64 + data_.at(it->second.keys.front()).size()
          : it->second.op == wire::Op::kMultiGet ? std::min<size_t>(ValuesReplyBytes(it->second.keys), wire::kMaxFrameBytes)
                                                 : 64;
      if (!Fits(reply_bytes)) {
        deferred_wakes_.insert(key);
        return;
      }
      Waiter w = it->second;
      RemoveWaiter(waiter_id);
      Connection* c = Find(w.connection);
      if (c == nullptr) continue;
      if (w.op == wire::Op::kMultiGet) {
        StatusOr<std::string> values = ValuesReply(w.request_id, w.keys);
        QueueReply(*c, values.ok() ? *values : ErrorReply(w.request_id, values.status()));
        Touch(*c);
        continue;
      }
      wire::Writer reply = OkReply(w.request_id);
      if (w.op == wire::Op::kGet) reply.String(data_.at(w.keys.front()));
      QueueReply(*c, reply.Frame());
      Touch(*c);
    }
  }

  void RetryDeferredWakes() {
    if (deferred_wakes_.empty()) return;
    std::unordered_set<std::string> keys;
    keys.swap(deferred_wakes_);
    for (const std::string& key : keys) WakeWaiters(key);
  }

  // ---- writing and closing ----

  void QueueReply(Connection& c, const std::string& frame) {
    if (c.dead) return;
    // A reply goes into an empty buffer whatever its size: only replies
    // left unread behind others say that a client stopped reading. A limit
    // below one reply (a 4 MiB value) dropped every client that read one,
    // logging "0 bytes of replies unread".
    if (c.pending_out() > 0 && c.pending_out() + frame.size() > options_.max_connection_output_bytes) {
      Log("dropped connection from " + c.peer + ": " + std::to_string(c.pending_out()) +
          " bytes of replies unread (the limit is " +
          std::to_string(options_.max_connection_output_bytes) + ")");
      MarkDead(c);
      return;
    }
    if (c.out_pos > 0 && c.out_pos >= c.pending_out()) {
      // More of `out` is sent than waits: drop the sent part, or a client
      // that never quite catches up would grow it without end.
      c.out.erase(0, c.out_pos);
      c.out_pos = 0;
    }
    c.out += frame;
    buffered_ += frame.size();
    Flush(c);
    Touch(c);  // for its epoll interest and its buffer's size
  }

  void Flush(Connection& c) {
    while (!c.dead && c.pending_out() > 0) {
      const ssize_t n = send(c.fd.get(), c.out.data() + c.out_pos, c.pending_out(),
                             MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out_pos += static_cast<size_t>(n);
        buffered_ -= static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      MarkDead(c);
      return;
    }
    if (c.pending_out() == 0) {
      if (c.out.capacity() > kKeepBufferBytes) {
        std::string().swap(c.out);  // a big reply went out: let its memory go
      } else {
        c.out.clear();
      }
      c.out_pos = 0;
    }
  }

  // Sends `frame` and closes the connection once it is out (or after a grace).
  void Refuse(Connection& c, const std::string& frame) {
    QueueReply(c, frame);
    if (c.dead) return;
    CloseOnceSent(c, options_.refused_close_grace);  // see StartDraining
  }

  // Reads nothing more from `c` and closes it once its replies are out, or
  // `grace` from now.
  void CloseOnceSent(Connection& c, std::chrono::milliseconds grace) {
    c.closing = true;
    unauthenticated_.erase(c.id);
    ClearTimer(c);
    c.timer = DeadlineAfter(Clock::now(), grace);
    timers_.emplace(c.timer, c.id);
    Touch(c);
  }

  // A closing connection whose replies are all out. A close with input
  // unread resets the connection, and a client still sending (the rest of
  // a frame that was refused) then fails in its send, or loses the reply
  // to the reset, without reading why. So the write side is shut down
  // first (the reply, then the end of the stream), and the input read and
  // dropped until the client ends it too, the closing timer fires, or
  // kMostDrainedBytes came: bounded in time and in work.
  void StartDraining(Connection& c) {
    c.draining = true;
    shutdown(c.fd.get(), SHUT_WR);
    Drain(c);
    if (c.dead) return;
    draining_.insert(c.id);
    if (draining_.size() <= options_.max_unauthenticated) return;
    const uint64_t oldest = *draining_.begin();
    if (oldest == c.id) {
      MarkDead(c);  // the caller destroys it
    } else {
      Destroy(oldest);
    }
  }

  void Drain(Connection& c) {
    for (int reads = 0; reads < kReadsPerEvent; ++reads) {
      const ssize_t n = recv(c.fd.get(), read_chunk_.data(), read_chunk_.size(), 0);
      if (n > 0) {
        c.drained += static_cast<size_t>(n);
        if (c.drained < kMostDrainedBytes) continue;
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      }
      MarkDead(c);  // its end, a reset, or enough read
      return;
    }
    Touch(c);  // for its epoll interest
  }

  void MarkDead(Connection& c) {
    c.dead = true;
    Touch(c);
  }

  void Touch(const Connection& c) { touched_.push_back(c.id); }

  void ClearTimer(Connection& c) {
    if (c.timer != Deadline{}) timers_.erase({c.timer, c.id});
    c.timer = Deadline{};
  }

  void Destroy(uint64_t id) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    Connection& c = it->second;
    std::vector<uint64_t> waiter_ids(c.waiters.begin(), c.waiters.end());
    for (uint64_t waiter_id : waiter_ids) RemoveWaiter(waiter_id);
    ClearTimer(c);
    unauthenticated_.erase(id);
    draining_.erase(id);
    ReleaseRoom(c);
    buffered_ -= c.pending_out();
    buffer_capacity_ -= c.capacity;
    waiting_for_memory_.erase(id);
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
    // Ends the connection for every copy of the descriptor (a child forked
    // without exec holds one), so the client learns now, not at its deadline.
    // Only the server thread gets here, which a forked child does not have.
    shutdown(c.fd.get(), SHUT_RDWR);
    if (c.refused_for_now) --refused_lingering_;
    connections_.erase(it);
    open_connections_.store(connections_.size() - refused_lingering_);
  }

  void UpdateInterest(Connection& c) {
    uint32_t want = 0;
    if (c.draining) want |= EPOLLIN;
    if (!c.closing) {
      // A connection waiting for room is not read; it watches for its
      // client's hang-up instead (a FIN alone raises no EPOLLHUP), until it
      // has seen one after a whole frame (input_ended).
      if (!waiting_for_memory_.count(c.id)) {
        want |= EPOLLIN;
      } else if (!c.input_ended) {
        want |= EPOLLRDHUP;
      }
    }
    if (c.pending_out() > 0) want |= EPOLLOUT;
    if (want == c.events) return;
    epoll_event ev{};
    ev.events = want;
    ev.data.u64 = c.id;
    if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev) == 0) c.events = want;
  }

  // Brings buffer_capacity_ up to date with `c`'s buffers.
  void CountCapacity(Connection& c) {
    const size_t capacity = c.in.capacity() + c.out.capacity();
    buffer_capacity_ = buffer_capacity_ - c.capacity + capacity;
    c.capacity = capacity;
  }

  Status AddToEpoll(int fd, uint64_t id, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      return InternalError("epoll_ctl(ADD): " + ErrnoString(errno));
    }
    return Status::Ok();
  }

  Connection* Find(uint64_t id) {
    auto it = connections_.find(id);
    return it == connections_.end() ? nullptr : &it->second;
  }

  // At most kLogLinesPerSecond lines a second reach the sink; a flood of
  // refused connections must not flood the log as well.
  void Log(const std::string& line) {
    const Deadline now = Clock::now();
    if (now - log_window_start_ >= std::chrono::seconds(1)) {
      log_window_start_ = now;
      log_lines_in_window_ = 0;
    }
    if (log_lines_in_window_ >= kLogLinesPerSecond) {
      ++log_suppressed_;
      return;
    }
    ++log_lines_in_window_;
    if (log_suppressed_ > 0) {
      options_.log(line + " (" + std::to_string(log_suppressed_) +
                   " earlier messages suppressed)");
      log_suppressed_ = 0;
    } else {
      options_.log(line);
    }
  }

  TcpStoreServerOptions options_;
  std::vector<UniqueFd> listen_fds_;
  const int port_;
  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;
  std::thread thread_;
  std::mutex stop_mu_;
  std::atomic<bool> stop_{false};
  std::string stop_reason_;  // given to Stop; written before stop_ is set
  bool stop_clean_end_ = false;  // given to Stop; written before stop_ is set

  // Server-thread state.
  bool listening_ = false;
  Deadline accept_resume_{};
  uint64_t next_id_;
  std::vector<char> read_chunk_;  // what recv() takes, before it joins a frame
  std::unordered_map<uint64_t, Connection> connections_;
  std::set<uint64_t> unauthenticated_;  // ids grow with age: begin() is the oldest
  // Connections draining before their close (StartDraining), oldest first:
  // at most max_unauthenticated, and the first to go when a newcomer finds
  // every place taken, so that refused clients that never hang up cannot
  // hold the job's places for their second of grace.
  std::set<uint64_t> draining_;
  std::set<std::pair<Deadline, uint64_t>> timers_;
  std::vector<uint64_t> touched_;
  // Bytes reserved for frames being received plus replies not yet sent.
  size_t buffered_ = 0;
  size_t receiving_ = 0;  // of which reserved for frames being received
  // Capacity of every connection's buffers, as of each one's last activity.
  size_t buffer_capacity_ = 0;
  std::unordered_set<std::string> deferred_wakes_;  // keys whose waits await room (WakeWaiters)
  // Connections whose next frame does not fit under the bound yet, and the
  // same in the order they began to wait (ids of connections gone since are
  // dropped when they reach the front): room goes to the longest waiting.
  std::set<uint64_t> waiting_for_memory_;
  std::deque<uint64_t> memory_queue_;
  std::unordered_map<std::string, std::string> data_;
  uint64_t next_waiter_id_ = 1;
  std::unordered_map<uint64_t, Waiter> waiters_;
  std::unordered_map<std::string, std::unordered_set<uint64_t>> key_waiters_;
  std::set<std::pair<Deadline, uint64_t>> waiter_deadlines_;
  Deadline log_window_start_{};
  size_t log_lines_in_window_ = 0;
  size_t log_suppressed_ = 0;

  // Counters, read from other threads.
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> authenticated_{0};
  std::atomic<uint64_t> refused_token_{0};
  uint64_t refused_for_now_ = 0;  // server thread only
  size_t refused_lingering_ = 0;  // connections_ with refused_for_now; server thread only
  std::atomic<uint64_t> dropped_silent_{0};
  std::atomic<uint64_t> evicted_{0};
  std::atomic<uint64_t> refused_malformed_{0};
  std::atomic<uint64_t> refused_oversized_{0};
  std::atomic<uint64_t> dropped_stalled_{0};
  std::atomic<uint64_t> open_connections_{0};
  std::atomic<uint64_t> stored_bytes_{0};
  std::atomic<uint64_t> buffered_bytes_{0};  // buffered_ at the end of the last round, for stats()
  std::atomic<uint64_t> receiving_bytes_{0};  // receiving_, likewise
  std::atomic<uint64_t> parked_waits_{0};    // waiters_.size(), for stats()
  std::atomic<uint64_t> parked_key_bytes_{0};  // ParkedKeyBytes of every waiter's keys
  std::atomic<uint64_t> requests_{0};        // requests received, for stats()
  std::atomic<uint64_t> frames_waiting_for_room_{0};  // waiting_for_memory_.size(), for stats()
  std::atomic<uint64_t> buffer_capacity_bytes_{0};  // buffer_capacity_, for stats()
};

namespace {

// Descriptors the server's process keeps besides its connections (UCX,
// shared memory, files, the listening sockets).
constexpr rlim_t kOtherDescriptors = 1024;

// Each connection holds a descriptor, and a job of thousands of ranks (one
// or two connections each, more with split communicators) needs more than
// the soft limit many systems start processes with (1024): past it, accept
// fails and ranks wait out their deadline at the handshake. The soft limit
// is raised, never lowered, towards what max_connections needs, within the
// hard limit (as Go's runtime and Python's multiprocessing users do).
// Returns the soft limit in force afterwards (RLIM_INFINITY when unknown).
rlim_t RaiseDescriptorLimit(size_t max_connections) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return RLIM_INFINITY;
  const rlim_t want = static_cast<rlim_t>(max_connections) + kOtherDescriptors;
  if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= want) return limit.rlim_cur;
  rlimit raised = limit;
  raised.rlim_cur = limit.rlim_max == RLIM_INFINITY ? want : std::min(want, limit.rlim_max);
  // Best effort: a refusal leaves the old limit.
  return setrlimit(RLIMIT_NOFILE, &raised) == 0 ? raised.rlim_cur : limit.rlim_cur;
}

// The connections that fit under a soft descriptor limit of `soft`, leaving
// the process a share for its other files. Past the limit accept fails
// before the server can say why, and the newcomers wait out their deadline
// at the handshake; within it, one over max_connections is told the limit.
size_t ConnectionsThatFit(rlim_t soft) {
  if (soft == RLIM_INFINITY) return std::numeric_limits<size_t>::max();
  const rlim_t reserve = std::clamp<rlim_t>(soft / 4, 16, kOtherDescriptors);
  return soft > reserve + 1 ? static_cast<size_t>(soft - reserve) : 1;
}

}  // namespace

namespace {

// A setting that would make the server refuse or drop every client (no
// connection, no handshake time, no room for one reply, nothing stored),
// named, before anything binds: such a server would otherwise start and
// leave its clients to fail at their deadlines for no reason they can see.
Status CheckOptions(const TcpStoreServerOptions& o) {
  auto at_least_one = [](const char* name, uint64_t value) {
    return value >= 1 ? Status::Ok()
                      : InvalidArgumentError(std::string("TcpStoreServerOptions::") + name + " is " +
                                             std::to_string(value) + "; it must be at least 1");
  };
  auto positive = [](const char* name, std::chrono::milliseconds value) {
    return value.count() > 0 ? Status::Ok()
                             : InvalidArgumentError(std::string("TcpStoreServerOptions::") + name + " is " +
                                                    std::to_string(value.count()) + " ms; it must be positive");
  };
  DDP_RETURN_IF_ERROR(positive("handshake_timeout", o.handshake_timeout));
  DDP_RETURN_IF_ERROR(positive("frame_stall_timeout", o.frame_stall_timeout));
  DDP_RETURN_IF_ERROR(at_least_one("max_unauthenticated", o.max_unauthenticated));
  DDP_RETURN_IF_ERROR(at_least_one("max_connections", o.max_connections));
  DDP_RETURN_IF_ERROR(at_least_one("max_stored_bytes", o.max_stored_bytes));
  DDP_RETURN_IF_ERROR(at_least_one("max_connection_output_bytes", o.max_connection_output_bytes));
  DDP_RETURN_IF_ERROR(at_least_one("max_waits_per_connection", o.max_waits_per_connection));
  DDP_RETURN_IF_ERROR(at_least_one("max_parked_key_bytes", o.max_parked_key_bytes));
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(TcpStoreServerOptions options) {
  if (options.job_token.size() > wire::kMaxTokenBytes) {
    return InvalidArgumentError("TcpStoreServerOptions::job_token (DDP_JOB_TOKEN) is " +
                                std::to_string(options.job_token.size()) + " bytes, more than the limit of " +
                                std::to_string(wire::kMaxTokenBytes));
  }
  DDP_RETURN_IF_ERROR(CheckOptions(options));
  options.max_connections =
      std::min(options.max_connections, ConnectionsThatFit(RaiseDescriptorLimit(options.max_connections)));
  const Deadline start_deadline =
      options.start_deadline.value_or(DeadlineIn(kDefaultServerStartTimeout));
  DDP_ASSIGN_OR_RETURN(std::vector<UniqueFd> listen_fds,
                       ListenTcp(options.bind_address, options.port, kListenBacklog, start_deadline));
  DDP_ASSIGN_OR_RETURN(int port, LocalPort(listen_fds.front().get()));
  const bool loopback_only = std::all_of(listen_fds.begin(), listen_fds.end(),
                                         [](const UniqueFd& fd) { return BoundToLoopback(fd.get()); });
  auto impl = std::make_unique<Impl>(std::move(options), std::move(listen_fds), port);
  DDP_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl), loopback_only));
}

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl, bool loopback_only)
    : impl_(std::move(impl)), loopback_only_(loopback_only) {}
TcpStoreServer::~TcpStoreServer() { Stop(); }
int TcpStoreServer::port() const { return impl_->port(); }
const std::string& TcpStoreServer::address() const { return impl_->address(); }
void TcpStoreServer::Stop() { impl_->Stop(); }
void TcpStoreServer::Stop(std::string why) {
  const bool clean_end = SaysCleanShutdown(why);
  impl_->Stop(std::move(why), clean_end);
}
void TcpStoreServer::Stop(std::string why, bool clean_end) { impl_->Stop(std::move(why), clean_end); }

bool TcpStoreServer::SaysCleanShutdown(std::string_view why) {
  // Rank 0's communicator ends its reason with its own words, after every
  // name it quotes: a name cannot put these at the end.
  const std::string plain = std::string(kCleanShutdownWords) + " and stopped the store";
  if (why.ends_with(plain)) return true;
  constexpr std::string_view kAdvice = " had not left (destroy every communicator on every rank before rank ";
  constexpr std::string_view kEnd = "'s)";
  if (!why.ends_with(kEnd)) return false;
  const size_t at = why.rfind(kAdvice);
  if (at == std::string_view::npos) return false;
  const std::string_view rank = why.substr(at + kAdvice.size(), why.size() - kEnd.size() - at - kAdvice.size());
  return !rank.empty() && std::all_of(rank.begin(), rank.end(), [](char c) { return c >= '0' && c <= '9'; });
}
TcpStoreServerStats TcpStoreServer::stats() const { return impl_->stats(); }

}  // namespace ddp::transport::store
