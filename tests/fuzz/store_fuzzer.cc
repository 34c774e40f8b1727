// Fuzzes the rendezvous store's server through its socket: each input is the
// byte stream of one or two client connections to a fresh TcpStoreServer.
//
// Input layout:
//   byte 0    flags: bit 0 sends a valid handshake (the right job token)
//             first, so the rest is requests; without it the handshake is
//             fuzzed too. Bit 1 splits the rest over two connections, A and
//             B, at the fraction byte 1 / 256 (A's parked Gets and Waits can
//             then be woken by B's Sets).
//   byte 1    (bit 1 only) where to split.
//   the rest  bytes sent as they are.
//
// Properties checked on every input:
//   - the server survives (no crash, no sanitizer report);
//   - once a client half-closes, the server ends that connection promptly
//     (no connection outlives its client);
//   - with a valid handshake, the first reply frame that arrives is the
//     handshake's OK (a connection the server resets may lose its replies
//     before they are read, so a connection with none is not checked);
//   - every complete reply frame is within the protocol's size bound;
//   - stored bytes are within the configured bound after each connection's
//     bytes have been sent and once both connections have ended (the server
//     is sampled there, not after every request);
//   - afterwards a well-behaved client of the job is still served.

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "tests/fuzz/fuzz_target.h"
#include "transport/store/socket.h"
#include "transport/store/tcp_store.h"
#include "transport/store/wire.h"

namespace ddp::fuzz {
namespace {

using transport::Clock;
using transport::Deadline;
namespace store = transport::store;
namespace wire = transport::store::wire;

constexpr char kToken[] = "fuzz-job-token";
constexpr size_t kMaxStoredBytes = 64 << 10;
constexpr auto kIoTimeout = std::chrono::seconds(10);

std::string Handshake() {
  wire::Writer w;
  w.Bytes(std::string_view(wire::kMagic, 4));
  w.U16(wire::kVersion);
  w.U16(0);
  w.String(kToken);
  return w.Frame();
}

// Reads what is available into `received`; false once the server closed or
// reset the connection.
bool ReadAvailable(int fd, std::string& received) {
  char buf[16 << 10];
  for (;;) {
    const ssize_t r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r > 0) {
      received.append(buf, static_cast<size_t>(r));
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
}

// Sends `data` while reading the replies, so that neither side can block on
// a full socket buffer. Stops early when the server drops the connection.
void SendPumping(int fd, std::string_view data, std::string& received) {
  size_t sent = 0;
  const Deadline deadline = Clock::now() + kIoTimeout;
  while (sent < data.size()) {
    pollfd p{fd, POLLIN | POLLOUT, 0};
    const int ms = store::MillisecondsUntil(deadline);
    FUZZ_CHECK(ms > 0, "the server stopped reading a connection for 10 s");
    if (poll(&p, 1, ms) <= 0) continue;
    if ((p.revents & (POLLIN | POLLHUP | POLLERR)) && !ReadAvailable(fd, received)) return;
    if (p.revents & POLLOUT) {
      const ssize_t w =
          send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        sent += static_cast<size_t>(w);
      } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return;  // dropped by the server
      }
    }
  }
}

// Half-closes and reads until the server closes its end.
void DrainToEnd(int fd, std::string& received) {
  shutdown(fd, SHUT_WR);
  const Deadline deadline = Clock::now() + kIoTimeout;
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int ms = store::MillisecondsUntil(deadline);
    FUZZ_CHECK(ms > 0, "the server kept a half-closed connection open for 10 s");
    if (poll(&p, 1, ms) <= 0) continue;
    if (!ReadAvailable(fd, received)) return;
  }
}

// Checks the frames the server sent on one connection.
void CheckReplies(std::string_view received, bool valid_handshake) {
  size_t pos = 0;
  bool first = true;
  while (received.size() - pos >= wire::kFrameHeaderBytes) {
    const uint32_t length = *wire::PeekFrameLength(received.substr(pos));
    FUZZ_CHECK(length <= wire::kMaxFrameBytes, "a reply frame exceeds the protocol's bound");
    if (received.size() - pos - wire::kFrameHeaderBytes < length) break;  // cut by a drop
    const std::string_view body = received.substr(pos + wire::kFrameHeaderBytes, length);
    if (first && valid_handshake) {
      wire::Reader r(body);
      std::string_view magic;
      uint16_t version = 0;
      uint8_t status = 0xff;
      FUZZ_CHECK(r.Bytes(4, magic) && magic == std::string_view(wire::kMagic, 4) &&
                     r.U16(version) && r.U8(status),
                 "the reply to a valid handshake is not a handshake reply");
      FUZZ_CHECK(status == 0, "a valid handshake was refused");
    }
    first = false;
    pos += wire::kFrameHeaderBytes + length;
  }
}

}  // namespace
}  // namespace ddp::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ddp::fuzz;
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  const bool handshake = flags & 1;
  const bool two_connections = (flags & 2) && size >= 2;
  std::string_view rest(reinterpret_cast<const char*>(data) + (two_connections ? 2 : 1),
                        size - (two_connections ? 2 : 1));
  std::string_view part_a, part_b = rest;
  if (two_connections) {
    const size_t split = rest.size() * data[1] / 256;
    part_a = rest.substr(0, split);
    part_b = rest.substr(split);
  }

  store::TcpStoreServerOptions options;
  options.bind_address = "127.0.0.1";
  options.job_token = kToken;
  options.handshake_timeout = std::chrono::milliseconds(2000);
  options.max_unauthenticated = 4;
  options.max_stored_bytes = kMaxStoredBytes;
  options.max_connection_output_bytes = 256 << 10;
  options.max_waits_per_connection = 8;
  options.log = [](const std::string&) {};
  auto server = store::TcpStoreServer::Start(options);
  FUZZ_CHECK(server.ok(), "cannot start a store server");
  const int port = (*server)->port();

  const auto connect = [&] {
    auto fd = store::ConnectTcp("127.0.0.1", port, Clock::now() + kIoTimeout);
    FUZZ_CHECK(fd.ok(), "cannot connect to the store server");
    return std::move(fd).value();
  };
  const std::string prefix = handshake ? Handshake() : std::string();
  std::string received_a, received_b;
  store::UniqueFd a;
  const auto check_stored = [&] {
    FUZZ_CHECK((*server)->stats().stored_bytes <= kMaxStoredBytes,
               "the store holds more than its bound");
  };
  if (two_connections) {
    a = connect();
    SendPumping(a.get(), prefix + std::string(part_a), received_a);
    check_stored();
  }
  {
    store::UniqueFd b = connect();
    SendPumping(b.get(), prefix + std::string(part_b), received_b);
    check_stored();
    DrainToEnd(b.get(), received_b);
  }
  if (two_connections) DrainToEnd(a.get(), received_a);
  CheckReplies(received_a, handshake);
  CheckReplies(received_b, handshake);
  check_stored();
  auto client = store::TcpStoreClient::Connect("127.0.0.1", port, kToken,
                                               Clock::now() + kIoTimeout);
  FUZZ_CHECK(client.ok(), "a client of the job cannot connect after the input");
  auto probe = (*client)->TryGet("fuzz/probe", Clock::now() + kIoTimeout);
  FUZZ_CHECK(probe.ok(), "a client of the job is not served after the input");
  return 0;
}
