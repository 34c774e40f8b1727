#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <limits>
#include <thread>

#include "transport/store/backoff.h"
#include "transport/store/socket.h"
#include "transport/store/tcp_store.h"
#include "transport/store/wire.h"

namespace ddp::transport::store {

struct TcpStoreClient::Reply {
  std::string body;  // the reply's fields after request id and status
};

namespace {

// Keys in error messages: printable, bounded.
std::string Quote(std::string_view key) {
  std::string out = "'";
  for (size_t i = 0; i < key.size() && i < 80; ++i) {
    const unsigned char c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'') {
      out.push_back(static_cast<char>(c));
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  if (key.size() > 80) out += "...";
  return out + "'";
}

// Refuses a key the server would refuse, naming the call and the key (its
// first bytes: the key itself may be megabytes), before anything is sent.
// `position` names where it stands in a list of keys ("" for one key).
Status CheckKey(std::string_view key, const char* op, const std::string& position = "") {
  const std::string where = position.empty() ? "" : " (" + position + ")";
  if (key.empty()) return InvalidArgumentError(std::string("store ") + op + ": a key is empty" + where);
  if (key.size() > kMaxKeyBytes) {
    return ResourceExhaustedError(std::string("store ") + op + ": key " + Quote(key) + where + " is " +
                                  std::to_string(key.size()) + " bytes, more than the limit of " +
                                  std::to_string(kMaxKeyBytes));
  }
  return Status::Ok();
}

// Every key of a Wait's or MultiGet's list, each named by its place in it.
Status CheckKeys(std::span<const std::string> keys, const char* op) {
  for (size_t i = 0; i < keys.size(); ++i) {
    DDP_RETURN_IF_ERROR(CheckKey(keys[i], op,
                                 "key " + std::to_string(i + 1) + " of " + std::to_string(keys.size())));
  }
  return Status::Ok();
}

uint32_t TimeoutMs(Deadline deadline) {
  return static_cast<uint32_t>(std::max(MillisecondsUntil(deadline), 0));
}

// Pops one complete frame body off the front of `buffer`. INTERNAL when the
// server announces a frame larger than the protocol allows.
StatusOr<std::optional<std::string>> PopFrame(std::string& buffer) {
  std::optional<uint32_t> length = wire::PeekFrameLength(buffer);
  if (!length) return std::optional<std::string>();
  if (*length > wire::kMaxFrameBytes) {
    return InternalError("the store sent a frame of " + std::to_string(*length) +
                         " bytes, more than the protocol allows");
  }
  if (buffer.size() < wire::kFrameHeaderBytes + *length) return std::optional<std::string>();
  std::string body = buffer.substr(wire::kFrameHeaderBytes, *length);
  buffer.erase(0, wire::kFrameHeaderBytes + *length);
  return std::optional<std::string>(std::move(body));
}

// Reads one frame before `deadline`.
StatusOr<std::string> ReadFrame(int fd, std::string& buffer, Deadline deadline) {
  while (true) {
    DDP_ASSIGN_OR_RETURN(std::optional<std::string> frame, PopFrame(buffer));
    if (frame) return std::move(*frame);
    DDP_RETURN_IF_ERROR(RecvSome(fd, buffer, 64 * 1024, deadline));
  }
}

// `bytes` with anything but printable ASCII as \xNN.
std::string Printable(std::string_view bytes) {
  std::string out;
  for (unsigned char c : bytes) {
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '"') {
      out.push_back(static_cast<char>(c));
    } else {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

std::string ElapsedMs(Deadline start) {
  return std::to_string(
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count());
}

// First and longest pauses between handshakes turned away: closed before
// any answer (the server evicting while flooded, or restarting), and "full"
// (every place held; one frees up only when a client leaves, so sooner
// tries are wasted). Hundreds of ranks refused at once retried in step at a
// fixed 10 or 50 ms, each wave refused alike.
constexpr auto kClosedRetryFirst = std::chrono::milliseconds(10);
constexpr auto kClosedRetryMost = std::chrono::milliseconds(500);
constexpr auto kFullRetryFirst = std::chrono::milliseconds(50);
constexpr auto kFullRetryMost = std::chrono::milliseconds(1000);

// How long past its deadline a call that carries its timeout reads on for
// the server's answer (see Call). The server answers a millisecond or two
// after the caller's deadline; the rest is for a loaded machine, and bounds
// how late a call whose server does not answer at all returns.
constexpr auto kServerVerdictGrace = std::chrono::milliseconds(100);

}  // namespace

StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::Connect(const std::string& given_host,
                                                                  int port,
                                                                  std::string_view job_token,
                                                                  Deadline deadline) {
  const std::string host = Unbracketed(given_host);  // "[::1]": the address ::1
  if (job_token.size() > wire::kMaxTokenBytes) {
    return InvalidArgumentError("the job token (DDP_JOB_TOKEN) is " + std::to_string(job_token.size()) +
                                " bytes, more than the limit of " + std::to_string(wire::kMaxTokenBytes));
  }
  const std::string endpoint =
      (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
  wire::Writer hello;
  hello.Bytes(std::string_view(wire::kMagic, 4));
  hello.U16(wire::kVersion);
  hello.U16(0);
  hello.String(job_token);
  const std::string hello_frame = hello.Frame();

  std::string last_error;
  int retries = 0;  // handshakes turned away so far, in a row
  while (true) {
    StatusOr<UniqueFd> connected = ConnectTcp(host, port, deadline);
    // Out of time after a refusal: the refusal is the news.
    if (!connected.ok() && !last_error.empty()) break;
    DDP_ASSIGN_OR_RETURN(UniqueFd fd, std::move(connected));
    std::string buffer;
    Status sent = SendAll(fd.get(), hello_frame, deadline, nullptr);
    StatusOr<std::string> reply = sent.ok() ? ReadFrame(fd.get(), buffer, deadline)
                                            : StatusOr<std::string>(sent);
    if (!reply.ok() && reply.status().code() == StatusCode::kInternal) {
      // A frame longer than the protocol allows: another service's greeting
      // or error page ("SSH-2.0-..." reads as a frame of 1.4 GB). Trying
      // again only gets the same answer until the deadline.
      return UnavailableError("the store at " + endpoint +
                              " answered the handshake with something else than the store "
                              "protocol (it began \"" + Printable(buffer.substr(0, 24)) +
                              "\"): is MASTER_PORT another service's port?");
    }
    if (!reply.ok()) {
      if (reply.status().code() == StatusCode::kTimedOut) {
        if (!last_error.empty()) break;
        // A live store answers a hello at once, whatever its load; silence
        // until the deadline is most often a port that is not a store's.
        return TimedOutError("the store at " + endpoint +
                             " accepted the connection but did not answer the handshake before the deadline "
                             "(a store answers at once: is MASTER_PORT another service's port that waits "
                             "for its client to speak first, or is the process serving the store stopped "
                             "or hung?)");
      }
      // Closed before answering: the server evicted us while flooded, or is
      // restarting. Try again while there is time.
      last_error = reply.status().message();
      if (Clock::now() >= deadline) break;
      std::this_thread::sleep_for(RetryPause(retries++, RetryDraw(), kClosedRetryFirst,
                                             kClosedRetryMost, deadline - Clock::now()));
      continue;
    }
    wire::Reader r(*reply);
    std::string_view magic, message;
    uint16_t version = 0;
    uint8_t code = 0;
    // All of it, to the last byte: a connection that reached itself (TCP's
    // simultaneous open, nobody listening yet) reads back this process's
    // own hello, which with an empty token is a well-formed "OK" with one
    // byte left over.
    if (!r.Bytes(4, magic) || magic != std::string_view(wire::kMagic, 4) || !r.U16(version) ||
        !r.U8(code) || !r.String(message, wire::kMaxFrameBytes) || !r.at_end()) {
      return UnavailableError("the store at " + endpoint +
                              " answered the handshake with something else than the store "
                              "protocol");
    }
    if (version != wire::kVersion) {
      return FailedPreconditionError("the store at " + endpoint + " speaks store protocol version " +
                                     std::to_string(version) + ", this process speaks " +
                                     std::to_string(wire::kVersion));
    }
    const auto status_code = static_cast<StatusCode>(code);
    if (status_code == StatusCode::kPermissionDenied) {
      return PermissionDeniedError("the store at " + endpoint +
                                   " refused this process's job token: DDP_JOB_TOKEN must be "
                                   "the same in every process of the job");
    }
    if (status_code == StatusCode::kUnavailable) {
      // Full for now (every place held by the job); a place may free up.
      last_error = "it refused the connection: " + std::string(message);
      if (Clock::now() >= deadline) break;
      std::this_thread::sleep_for(RetryPause(retries++, RetryDraw(), kFullRetryFirst,
                                             kFullRetryMost, deadline - Clock::now()));
      continue;
    }
    if (status_code != StatusCode::kOk) {
      return Status(status_code, "the store at " + endpoint +
                                     " refused the connection: " + std::string(message));
    }
    auto client = std::unique_ptr<TcpStoreClient>(new TcpStoreClient(fd.Release(), endpoint));
    client->read_buffer_ = std::move(buffer);
    return client;
  }
  return UnavailableError("cannot connect to the store at " + endpoint + ": " + last_error);
}

TcpStoreClient::TcpStoreClient(int fd, std::string endpoint)
    : fd_(fd), owner_pid_(getpid()), endpoint_(std::move(endpoint)) {}

TcpStoreClient::~TcpStoreClient() {
  // close() alone leaves the connection open while a forked child (a data
  // loader worker forked without exec) holds a copy of the descriptor: the
  // server would keep this connection and its parked calls. shutdown() ends
  // it for every copy, so only the process that connected may do it; a
  // child destroying its copy of this object just closes its descriptor.
  if (getpid() == owner_pid_) shutdown(fd_, SHUT_RDWR);
  UniqueFd closer(fd_);
}

bool TcpStoreClient::StoppedCleanly() const { return stopped_cleanly_.load(); }

void TcpStoreClient::Close() {
  closed_.store(true);
  // Wakes a poll() blocked on this socket in another thread; the descriptor
  // itself stays open (and unused) until destruction, so it cannot be reused
  // under that thread's feet.
  shutdown(fd_, SHUT_RDWR);
}

StatusOr<TcpStoreClient::Reply> TcpStoreClient::Call(uint8_t op, bool carries_timeout,
                                                     std::string_view fields, Deadline deadline,
                                                     const std::string& what) {
  const Deadline start = Clock::now();
  // The connection, taken for this call: behind another thread's call (a
  // Get parked for minutes), no later than this call's own deadline; it
  // waited for the other's, however far. (A flag and a condition variable,
  // not a timed mutex: GCC 12's ThreadSanitizer has no interceptor for the
  // pthread_mutex_clocklock that try_lock_until takes, so it would not see
  // the lock.)
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!idle_cv_.wait_until(lock, deadline, [&] { return !busy_; })) {
      return TimedOutError("store " + what + " timed out after " + ElapsedMs(start) +
                           " ms waiting for another thread's call on this connection to the store at " +
                           endpoint_ + " (nothing was sent; a thread that parks on a key for long needs a "
                           "client of its own)");
    }
    busy_ = true;
  }
  struct GiveBack {
    TcpStoreClient& client;
    ~GiveBack() {
      {
        std::lock_guard<std::mutex> lock(client.mu_);
        client.busy_ = false;
      }
      client.idle_cv_.notify_one();
    }
  } give_back{*this};
  if (!broken_.ok()) return broken_;
  if (closed_.load()) {
    broken_ = UnavailableError("the connection to the store at " + endpoint_ +
                               " was closed by this process");
    return broken_;
  }
  auto timed_out = [&] {
    return TimedOutError("store " + what + " timed out after " + ElapsedMs(start) +
                         " ms (store at " + endpoint_ + ")");
  };
  if (Clock::now() >= deadline) return timed_out();  // nothing sent
  auto lost = [&](const Status& why) {
    broken_ = closed_.load() ? UnavailableError("the connection to the store at " + endpoint_ +
                                                " was closed by this process")
                             : UnavailableError("lost the connection to the store at " +
                                                endpoint_ + ": " + why.message());
    // This call's request named too; later calls get broken_ alone.
    return UnavailableError(broken_.message() + " (during the " + what + ")");
  };
  // An UNAVAILABLE the server answered with: its owner stopping it after a
  // clean end of the job says so at the start (wire::kCleanStopNotice, then
  // the end or ": " and its reason), never inside the reason's free text.
  auto stopped = [&](const Status& why) {
    const std::string_view said = why.message();
    if (why.code() == StatusCode::kUnavailable && said.starts_with(wire::kCleanStopNotice)) {
      const std::string_view rest = said.substr(wire::kCleanStopNotice.size());
      if (rest.empty() || rest.starts_with(": ")) stopped_cleanly_.store(true);
    }
    return lost(why);
  };

  // A request carries at most INT_MAX ms (24.8 days). When a deadline
  // further out was cut to that, the server's TIMED_OUT comes with the
  // caller's deadline still ahead: the request (a read, safe to repeat) is
  // sent again for the time left, rather than failing weeks early.
  while (true) {
    const uint32_t request_id = next_request_id_++;
    if (next_request_id_ == 0) next_request_id_ = 1;
    wire::Writer w;
    w.U8(op);
    w.U32(request_id);
    const uint32_t carried_ms = carries_timeout ? TimeoutMs(deadline) : 0;
    if (carries_timeout) w.U32(carried_ms);
    w.Bytes(fields);
    const std::string frame = w.Frame();
    size_t sent = 0;
    Status send_status = SendAll(fd_, frame, deadline, &sent);
    if (!send_status.ok()) {
      if (send_status.code() != StatusCode::kTimedOut) return lost(send_status);
      if (sent > 0) {
        // Half a frame is on the wire; the stream cannot be resynchronised.
        // Shut down, so that the server, which would wait for the rest of
        // the frame with room held for all of it, sees the end at once.
        broken_ = UnavailableError("the connection to the store at " + endpoint_ +
                                   " is unusable: a request timed out half-sent");
        shutdown(fd_, SHUT_RDWR);
      }
      return timed_out();
    }
    // A request that carries its timeout is answered by the server at its
    // own deadline, which is this one plus the request's way there (and the
    // milliseconds rounded up): read on a little past it for that answer,
    // which says why (which key was missing, or an overloaded store).
    Deadline read_by = deadline;
    while (true) {
      StatusOr<std::string> body = ReadFrame(fd_, read_buffer_, read_by);
      if (!body.ok()) {
        if (body.status().code() == StatusCode::kTimedOut) {
          if (carries_timeout && read_by == deadline) {
            read_by = DeadlineAfter(deadline, kServerVerdictGrace);
            if (read_by > deadline) continue;
          }
          return timed_out();
        }
        return lost(body.status());
      }
      wire::Reader r(*body);
      uint32_t reply_id = 0;
      uint8_t code = 0;
      if (!r.U32(reply_id) || !r.U8(code)) return lost(InternalError("malformed reply"));
      if (reply_id != request_id) {
        if (reply_id == 0) {
          // The server refused something on this connection and is closing it.
          std::string_view message;
          r.String(message, wire::kMaxFrameBytes);
          return stopped(Status(static_cast<StatusCode>(code), std::string(message)));
        }
        continue;  // the late answer to a call that already gave up
      }
      const auto status_code = static_cast<StatusCode>(code);
      if (status_code == StatusCode::kOk) {
        Reply reply;
        std::string_view rest;
        r.Bytes(r.remaining(), rest);
        reply.body.assign(rest);
        return reply;
      }
      std::string_view message;
      r.String(message, wire::kMaxFrameBytes);
      if (status_code == StatusCode::kTimedOut) {
        if (carried_ms == static_cast<uint32_t>(INT_MAX) && Clock::now() < deadline) break;  // again
        return TimedOutError(timed_out().message() + ": " + std::string(message));
      }
      if (status_code == StatusCode::kUnavailable) return stopped(Status(status_code, std::string(message)));
      return Status(status_code, "store " + what + ": " + std::string(message));
    }
  }
}

Status TcpStoreClient::Set(std::string_view key, std::string_view value, Deadline deadline) {
  DDP_RETURN_IF_ERROR(CheckKey(key, "set"));
  if (value.size() > kMaxValueBytes) {
    return ResourceExhaustedError("store value of " + std::to_string(value.size()) +
                                  " bytes for key " + Quote(key) + " exceeds the limit of " +
                                  std::to_string(kMaxValueBytes));
  }
  wire::Writer w;
  w.String(key);
  w.String(value);
  DDP_ASSIGN_OR_RETURN(Reply reply, Call(static_cast<uint8_t>(wire::Op::kSet), false, w.body(),
                                         deadline, "set of key " + Quote(key)));
  (void)reply;
  return Status::Ok();
}

StatusOr<std::string> TcpStoreClient::Get(std::string_view key, Deadline deadline) {
  DDP_RETURN_IF_ERROR(CheckKey(key, "get"));
  wire::Writer w;
  w.String(key);
  DDP_ASSIGN_OR_RETURN(Reply reply, Call(static_cast<uint8_t>(wire::Op::kGet), true, w.body(),
                                         deadline, "get of key " + Quote(key)));
  wire::Reader r(reply.body);
  std::string_view value;
  if (!r.String(value, kMaxValueBytes) || !r.at_end()) {
    return InternalError("malformed get reply from the store at " + endpoint_);
  }
  return std::string(value);
}

StatusOr<std::optional<std::string>> TcpStoreClient::TryGet(std::string_view key,
                                                            Deadline deadline) {
  DDP_RETURN_IF_ERROR(CheckKey(key, "try_get"));
  wire::Writer w;
  w.String(key);
  DDP_ASSIGN_OR_RETURN(Reply reply, Call(static_cast<uint8_t>(wire::Op::kTryGet), false, w.body(),
                                         deadline, "try_get of key " + Quote(key)));
  wire::Reader r(reply.body);
  uint8_t found = 0;
  std::string_view value;
  if (!r.U8(found) || (found && !r.String(value, kMaxValueBytes)) || !r.at_end()) {
    return InternalError("malformed try_get reply from the store at " + endpoint_);
  }
  if (!found) return std::optional<std::string>();
  return std::optional<std::string>(std::string(value));
}

StatusOr<int64_t> TcpStoreClient::Add(std::string_view key, int64_t delta, Deadline deadline) {
  DDP_RETURN_IF_ERROR(CheckKey(key, "add"));
  wire::Writer w;
  w.I64(delta);
  w.String(key);
  DDP_ASSIGN_OR_RETURN(Reply reply, Call(static_cast<uint8_t>(wire::Op::kAdd), false, w.body(),
                                         deadline, "add to key " + Quote(key)));
  wire::Reader r(reply.body);
  int64_t value = 0;
  if (!r.I64(value) || !r.at_end()) {
    return InternalError("malformed add reply from the store at " + endpoint_);
  }
  return value;
}

Status TcpStoreClient::Wait(std::span<const std::string> keys, Deadline deadline) {
  // One request names at most wire::kMaxWaitKeys keys (the server bounds its
  // frames). A longer list is waited for a piece at a time, every piece
  // against the same deadline: all keys exist once every piece returned.
  DDP_RETURN_IF_ERROR(CheckKeys(keys, "wait"));
  while (keys.size() > wire::kMaxWaitKeys) {
    DDP_RETURN_IF_ERROR(Wait(keys.first(wire::kMaxWaitKeys), deadline));
    keys = keys.subspan(wire::kMaxWaitKeys);
  }
  if (keys.empty()) return Status::Ok();
  wire::Writer w;
  w.U32(static_cast<uint32_t>(keys.size()));
  for (const std::string& key : keys) {
    w.String(key);
  }
  std::string what = "wait for key " + Quote(keys.front());
  if (keys.size() > 1) what += " and " + std::to_string(keys.size() - 1) + " more";
  DDP_ASSIGN_OR_RETURN(Reply reply,
                       Call(static_cast<uint8_t>(wire::Op::kWait), true, w.body(), deadline, what));
  (void)reply;
  return Status::Ok();
}

StatusOr<std::vector<std::string>> TcpStoreClient::MultiGet(std::span<const std::string> keys,
                                                            Deadline deadline) {
  DDP_RETURN_IF_ERROR(CheckKeys(keys, "multi_get"));
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (size_t first = 0; first < keys.size(); first += kMaxMultiGetKeys) {
    DDP_RETURN_IF_ERROR(
        MultiGetPart(keys.subspan(first, std::min(kMaxMultiGetKeys, keys.size() - first)), deadline, values));
  }
  return values;
}

Status TcpStoreClient::MultiGetPart(std::span<const std::string> part, Deadline deadline,
                                    std::vector<std::string>& values) {
  wire::Writer w;
  w.U32(static_cast<uint32_t>(part.size()));
  for (const std::string& key : part) {
    w.String(key);
  }
  std::string what = "get of key " + Quote(part.front());
  if (part.size() > 1) what = "get of " + std::to_string(part.size()) + " keys from " + Quote(part.front());
  StatusOr<Reply> reply = Call(static_cast<uint8_t>(wire::Op::kMultiGet), true, w.body(), deadline, what);
  if (!reply.ok() && reply.status().code() == StatusCode::kResourceExhausted && part.size() > 1 &&
      reply.status().message().find(wire::kReplyTooLarge) != std::string::npos) {
    // Values too large together for one reply (each fits one): half the
    // keys at a time. Reads repeat safely. Any other refusal (the server's
    // limits on parked calls) would meet each half the same: it stands.
    const size_t half = part.size() / 2;
    DDP_RETURN_IF_ERROR(MultiGetPart(part.first(half), deadline, values));
    return MultiGetPart(part.subspan(half), deadline, values);
  }
  DDP_RETURN_IF_ERROR(reply.status());
  wire::Reader r(reply->body);
  for (size_t i = 0; i < part.size(); ++i) {
    std::string_view value;
    if (!r.String(value, kMaxValueBytes)) {
      return InternalError("malformed multi_get reply from the store at " + endpoint_ + " (" + what + ")");
    }
    values.emplace_back(value);
  }
  if (!r.at_end()) return InternalError("malformed multi_get reply from the store at " + endpoint_ + " (" + what + ")");
  return Status::Ok();
}

StatusOr<bool> TcpStoreClient::Check(std::span<const std::string> keys, Deadline deadline) {
  DDP_RETURN_IF_ERROR(CheckKeys(keys, "check"));
  // Like Wait, a piece of at most wire::kMaxWaitKeys keys per request.
  for (size_t first = 0; first < keys.size(); first += wire::kMaxWaitKeys) {
    const std::span<const std::string> part =
        keys.subspan(first, std::min<size_t>(wire::kMaxWaitKeys, keys.size() - first));
    wire::Writer w;
    w.U32(static_cast<uint32_t>(part.size()));
    for (const std::string& key : part) w.String(key);
    std::string what = "check of key " + Quote(part.front());
    if (part.size() > 1) what += " and " + std::to_string(part.size() - 1) + " more";
    DDP_ASSIGN_OR_RETURN(Reply reply, Call(static_cast<uint8_t>(wire::Op::kCheck), false, w.body(),
                                           deadline, what));
    wire::Reader r(reply.body);
    uint8_t all_exist = 0;
    if (!r.U8(all_exist) || all_exist > 1 || !r.at_end()) {
      return InternalError("malformed check reply from the store at " + endpoint_);
    }
    if (!all_exist) return false;
  }
  return true;
}

StatusOr<int64_t> TcpStoreClient::NumKeys(Deadline deadline) {
  DDP_ASSIGN_OR_RETURN(Reply reply, Call(static_cast<uint8_t>(wire::Op::kNumKeys), false, "",
                                         deadline, "num_keys"));
  wire::Reader r(reply.body);
  int64_t count = 0;
  if (!r.I64(count) || count < 0 || !r.at_end()) {
    return InternalError("malformed num_keys reply from the store at " + endpoint_);
  }
  return count;
}

StatusOr<bool> TcpStoreClient::Delete(std::string_view key, Deadline deadline) {
  DDP_RETURN_IF_ERROR(CheckKey(key, "delete"));
  wire::Writer w;
  w.String(key);
  DDP_ASSIGN_OR_RETURN(Reply reply, Call(static_cast<uint8_t>(wire::Op::kDelete), false, w.body(),
                                         deadline, "delete of key " + Quote(key)));
  wire::Reader r(reply.body);
  uint8_t existed = 0;
  if (!r.U8(existed) || !r.at_end()) {
    return InternalError("malformed delete reply from the store at " + endpoint_);
  }
  return existed != 0;
}

StatusOr<std::optional<std::string>> TcpStoreClient::CompareSet(std::string_view key,
                                                                std::optional<std::string_view> expected,
                                                                std::string_view desired,
                                                                Deadline deadline) {
  DDP_RETURN_IF_ERROR(CheckKey(key, "compare_set"));
  const size_t bytes = desired.size() + (expected ? expected->size() : 0);
  if (bytes > kMaxValueBytes) {
    return ResourceExhaustedError("store compare_set of key " + Quote(key) + " carries " +
                                  std::to_string(bytes) + " bytes of values, more than the limit of " +
                                  std::to_string(kMaxValueBytes));
  }
  wire::Writer w;
  w.String(key);
  w.U8(expected ? 1 : 0);
  if (expected) w.String(*expected);
  w.String(desired);
  DDP_ASSIGN_OR_RETURN(Reply reply, Call(static_cast<uint8_t>(wire::Op::kCompareSet), false, w.body(),
                                         deadline, "compare_set of key " + Quote(key)));
  wire::Reader r(reply.body);
  uint8_t found = 0;
  std::string_view value;
  if (!r.U8(found) || (found && !r.String(value, kMaxValueBytes)) || !r.at_end()) {
    return InternalError("malformed compare_set reply from the store at " + endpoint_);
  }
  if (!found) return std::optional<std::string>();
  return std::optional<std::string>(std::string(value));
}

}  // namespace ddp::transport::store
