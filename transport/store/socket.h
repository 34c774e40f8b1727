#ifndef DDP_TRANSPORT_STORE_SOCKET_H_
#define DDP_TRANSPORT_STORE_SOCKET_H_

// Small POSIX socket helpers for the store: an owning file descriptor,
// listening, connecting and whole-buffer I/O, each bounded by a deadline.
// Private to //transport.

#include <poll.h>
#include <sys/socket.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::store {

/// Owns a file descriptor; closes it on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  /// Gives up ownership.
  int Release() { return std::exchange(fd_, -1); }
  void Reset(int fd = -1);

 private:
  int fd_ = -1;
};

/// `host` without the brackets around it when written "[::1]" (as in
/// "[::1]:29500", torchrun's and URLs' way to set an IPv6 address off from
/// its port); any other host as it is. ListenTcp and ConnectTcp take both.
std::string Unbracketed(const std::string& host);

/// "10.0.0.1:29500" or "[::1]:29500".
std::string FormatAddress(const sockaddr* addr, socklen_t len);
/// The remote end of a connected socket, formatted as above.
std::string PeerAddress(int fd);

/// Non-blocking listening TCP sockets, one per address `host` resolves to
/// (a name with an IPv4 and an IPv6 address gets both), all on `port` (0
/// picks one free at every address). Binds those addresses only. An
/// address this host does not have or cannot use (::1 with IPv6 off) is
/// skipped; any other failure at any address fails the whole. The name is
/// looked up once, by `deadline` (TIMED_OUT past it). Each error names the
/// address and the reason: FAILED_PRECONDITION for a port another process
/// listens on (EADDRINUSE, with the likely causes: a second rank 0, a store
/// left from an earlier job, another program on MASTER_PORT),
/// PERMISSION_DENIED when binding is refused (said to be a privileged port
/// only below net.ipv4.ip_unprivileged_port_start, else a security policy
/// is named), RESOURCE_EXHAUSTED when descriptors or memory ran out,
/// INVALID_ARGUMENT for an empty host, a port out of range or a host none
/// of whose addresses is on any interface of this host (loopback ones
/// aside), each address named; UNAVAILABLE for a name that does not
/// resolve, or addresses this host cannot use now (a loopback address with
/// loopback down or IPv6 off, a family turned off, an address of an
/// interface of this host that cannot be bound now: the interface down,
/// named, or an IPv6 address still tentative), INTERNAL for any other
/// failure.
StatusOr<std::vector<UniqueFd>> ListenTcp(const std::string& host, int port, int backlog,
                                          Deadline deadline);

/// The local port of a bound socket.
StatusOr<int> LocalPort(int fd);

/// True when `fd` is bound to a loopback address (127.0.0.0/8, ::1, or an
/// IPv4-mapped 127.x), which no other host can reach.
bool BoundToLoopback(int fd);

/// A TCP port that nothing listens on now at any IPv4 address: bound to
/// port 0 and released at once, so another process may take it before the
/// caller does (torchrun picks its MASTER_PORT the same way).
/// UNAVAILABLE with the reason when no socket can be bound.
StatusOr<int> FreeTcpPort();

/// Connects to `host`:`port`, retrying until `deadline` (the server may not
/// be up yet): refused or unreachable attempts, and names that do not
/// resolve (yet: a Kubernetes headless service has no record until its pod
/// is up), looked up again every round. Past the deadline, UNAVAILABLE with
/// the last reason (naming the host), or TIMED_OUT when the name service
/// had not answered. The socket is non-blocking. An empty host is
/// INVALID_ARGUMENT at once.
StatusOr<UniqueFd> ConnectTcp(const std::string& host, int port, Deadline deadline);

/// ConnectTcp's pause after `retry` failed rounds in a row (0: after the
/// first), when `unit`, in [0, 1), is the caller's random draw: between half
/// and all of a ceiling doubling from 5 ms to 200 ms while nobody listens
/// (to 20 ms when every address tried is a loopback one, `loopback`),
/// or to 1 s while the name does not resolve (`lookup_failed`), and never
/// past `left`. The draw spreads ranks started together, which would
/// otherwise knock on a store not yet up all at the same instants.
Clock::duration ConnectRetryPause(int retry, bool lookup_failed, double unit,
                                  Clock::duration left, bool loopback = false);

/// Sends all of `data` on a non-blocking socket before `deadline`.
/// TIMED_OUT when the deadline passed with `*sent` bytes out; UNAVAILABLE
/// when the peer is gone.
Status SendAll(int fd, std::string_view data, Deadline deadline, size_t* sent);

/// Reads whatever is available (at most `max` bytes) into `out`, waiting
/// until `deadline` for the first byte. UNAVAILABLE on end of stream.
Status RecvSome(int fd, std::string& out, size_t max, Deadline deadline);

/// Milliseconds until `deadline`, rounded up, clamped to [0, INT_MAX].
int MillisecondsUntil(Deadline deadline);

/// poll() until an event or `deadline`, however far: through EINTR, and in
/// turns of at most INT_MAX ms (poll's longest wait, 24.8 days). 0 only once
/// the deadline has passed; -1 with errno set on failure.
int PollUntil(pollfd* fds, nfds_t count, Deadline deadline);

/// strerror as a std::string, thread-safe.
std::string ErrnoString(int err);

}  // namespace ddp::transport::store

#endif  // DDP_TRANSPORT_STORE_SOCKET_H_
