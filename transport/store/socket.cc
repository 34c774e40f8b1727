#include "transport/store/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "transport/store/backoff.h"

namespace ddp::transport::store {

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) Reset(other.Release());
  return *this;
}

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string ErrnoString(int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (maybe not buf).
  return strerror_r(err, buf, sizeof(buf));
}

int MillisecondsUntil(Deadline deadline) {
  const auto now = Clock::now();
  if (deadline <= now) return 0;
  const Clock::duration left = deadline - now;
  // Compared before rounding: ceil() of a distance near Deadline::max()
  // overflows in its own arithmetic.
  if (left >= std::chrono::milliseconds(INT_MAX)) return INT_MAX;
  return static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
}

int PollUntil(pollfd* fds, nfds_t count, Deadline deadline) {
  while (true) {
    const int ready = poll(fds, count, MillisecondsUntil(deadline));
    if (ready < 0 && errno == EINTR) continue;
    // One poll waits at most INT_MAX ms (24.8 days); a deadline further
    // out than that is waited for in turns, not reported as passed.
    if (ready == 0 && Clock::now() < deadline) continue;
    return ready;
  }
}

std::string Unbracketed(const std::string& host) {
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') return host.substr(1, host.size() - 2);
  return host;
}

std::string FormatAddress(const sockaddr* addr, socklen_t len) {
  char host[NI_MAXHOST];
  char port[NI_MAXSERV];
  if (getnameinfo(addr, len, host, sizeof(host), port, sizeof(port),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "(unknown address)";
  }
  if (addr->sa_family == AF_INET6) return std::string("[") + host + "]:" + port;
  return std::string(host) + ":" + port;
}

std::string PeerAddress(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "(unknown peer)";
  return FormatAddress(reinterpret_cast<sockaddr*>(&addr), len);
}

namespace {

std::string HostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

struct AddrInfoDeleter {
  void operator()(addrinfo* ai) const { freeaddrinfo(ai); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// One connect attempt to an address when more addresses follow it.
constexpr auto kConnectAttemptTime = std::chrono::seconds(2);
// First pause between connect rounds (before the draw takes up to half).
constexpr auto kConnectBackoffFirst = std::chrono::milliseconds(5);
// Longest pause between connect rounds while nobody listens yet.
constexpr auto kRefusedBackoffMax = std::chrono::milliseconds(200);
// The same when every address is a loopback one: the store is on this host
// (every single-host job and test), a refused connection costs this host a
// few system calls and no other host anything, and the pause is what a
// rank loses once the store is up. With 200 ms, ranks that had waited for
// a rank 0 starting late (4 ranks on 2 busy cores) connected 60-120 ms
// after its store listened.
constexpr auto kRefusedLoopbackBackoffMax = std::chrono::milliseconds(20);
// Longest pause between lookups of a name that does not resolve yet: a
// thousand ranks waiting for one name ask the cluster's name server at most
// a thousand times a second.
constexpr auto kLookupBackoffMax = std::chrono::milliseconds(1000);
// Ports ListenTcp picks (port 0) before giving up on finding one free at
// every address.
constexpr int kPickPortAttempts = 8;

// Resolves `host` by the deadline. Numeric addresses are parsed at once.
// A name is looked up on a thread of its own: with an unreachable name
// server a plain getaddrinfo waits out the C library's own retries (seconds
// times attempts) whatever the caller's deadline. When the deadline passes
// first, the lookup is abandoned to its thread, which frees its result when
// it ends. (glibc's getaddrinfo_a would do the same, but its helper thread
// is invisible to ThreadSanitizer, which then crashes in it.)
StatusOr<AddrInfoPtr> Resolve(const std::string& host, int port, bool passive, Deadline deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  const std::string service = std::to_string(port);
  addrinfo* result = nullptr;
  addrinfo numeric = hints;
  numeric.ai_flags |= AI_NUMERICHOST;
  int rc = getaddrinfo(host.c_str(), service.c_str(), &numeric, &result);
  if (rc == 0) return AddrInfoPtr(result);
  if (rc != EAI_NONAME) {
    return UnavailableError("cannot resolve " + HostPort(host, port) + ": " + gai_strerror(rc));
  }

  struct Lookup {
    std::mutex mu;
    std::condition_variable done_cv;
    bool done = false;
    bool abandoned = false;
    int rc = 0;
    addrinfo* result = nullptr;
  };
  auto lookup = std::make_shared<Lookup>();
  std::thread([lookup, host, service, hints] {
    addrinfo* found = nullptr;
    const int code = getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
    std::lock_guard<std::mutex> lock(lookup->mu);
    if (lookup->abandoned) {
      if (found != nullptr) freeaddrinfo(found);
      return;
    }
    lookup->rc = code;
    lookup->result = found;
    lookup->done = true;
    lookup->done_cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(lookup->mu);
  if (!lookup->done_cv.wait_until(lock, deadline, [&] { return lookup->done; })) {
    lookup->abandoned = true;
    return TimedOutError("cannot resolve " + HostPort(host, port) +
                         ": no answer from the name service before the deadline");
  }
  if (lookup->rc != 0) {
    return UnavailableError("cannot resolve " + HostPort(host, port) + ": " +
                            gai_strerror(lookup->rc));
  }
  return AddrInfoPtr(lookup->result);
}

// True for a connection whose two ends are one socket: TCP's simultaneous
// open lets a connect to a port in the ephemeral range that nobody listens
// on pick that very port as its own and connect to itself.
bool ConnectedToItself(int fd) {
  sockaddr_storage local{}, peer{};
  socklen_t local_len = sizeof(local), peer_len = sizeof(peer);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
    return false;
  }
  return FormatAddress(reinterpret_cast<sockaddr*>(&local), local_len) ==
         FormatAddress(reinterpret_cast<sockaddr*>(&peer), peer_len);
}

// 127.0.0.0/8, ::1, or an IPv4-mapped 127.x.
bool IsLoopbackAddress(const sockaddr* addr) {
  if (addr->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(addr)->sin_addr.s_addr) >> 24) == 127;
  }
  if (addr->sa_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
  }
  return false;
}

// Why `addr`, refused by bind() with EADDRNOTAVAIL, cannot be bound here,
// and whether that is the caller's to fix: only an address of none of this
// host's interfaces, and not a loopback one, is. A loopback address is
// chosen by the program as often as by the user, and fails for the host's
// sake (loopback down in a fresh network namespace, ::1 with IPv6 off); an
// address configured on an interface of this host that cannot be bound now
// is the host's state too (the interface down, an IPv6 address tentative in
// duplicate address detection, a link-local one with another interface's
// scope, as IN6_ARE_ADDR_EQUAL ignores scopes; one without a scope is
// refused with EINVAL before this), named by what is known of it; a family
// of which the host has no address at all is turned off (IPv6 disabled by
// sysctl, as socket(AF_INET6) still works there).
std::string NotBindableReason(const sockaddr* addr, bool* callers) {
  *callers = false;
  if (IsLoopbackAddress(addr)) {
    return "a loopback address this host cannot use now (loopback down, or IPv6 off)";
  }
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return "this host's addresses could not be listed (getifaddrs: " + ErrnoString(errno) + ")";
  }
  bool family_seen = false;
  // The interface holding the address (one that is up first), and whether
  // it is up.
  std::string interface;
  bool up = false;
  for (const ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != addr->sa_family) continue;
    family_seen = true;
    const bool same =
        addr->sa_family == AF_INET
            ? reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr ==
                  reinterpret_cast<const sockaddr_in*>(addr)->sin_addr.s_addr
            : IN6_ARE_ADDR_EQUAL(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr,
                                 &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr);
    if (same && (interface.empty() || (!up && (i->ifa_flags & IFF_UP) != 0))) {
      interface = i->ifa_name;
      up = (i->ifa_flags & IFF_UP) != 0;
    }
  }
  freeifaddrs(list);
  const char* family = addr->sa_family == AF_INET ? "IPv4" : "IPv6";
  if (!interface.empty()) {
    // Configured here, but not bindable now: what is known is the
    // interface's state; past that, the likely causes.
    if (!up) return "an address of this host's interface " + interface + ", which is down";
    return "an address of this host's interface " + interface +
           " that cannot be bound now (an IPv6 address still tentative in duplicate address detection, or "
           "a link-local one given with another interface's scope)";
  }
  if (!family_seen) return std::string("this host has no ") + family + " address at all (" + family + " off)";
  *callers = true;
  return "not an address of this host";
}

// The net.ipv4.ip_unprivileged_port_start sysctl (which IPv6 obeys too):
// ports below it need CAP_NET_BIND_SERVICE. 1024, the kernel's default,
// when it cannot be read.
int UnprivilegedPortStart() {
  int start = 1024;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_unprivileged_port_start", "re")) {
    if (std::fscanf(f, "%d", &start) != 1) start = 1024;
    std::fclose(f);
  }
  return start;
}

// What to tell about EACCES from bind() of `port`: privileges only for a
// port the kernel holds privileged; any other refusal comes from a
// security policy (SELinux, AppArmor, a seccomp or BPF filter).
std::string BindDeniedHint(int port) {
  const int start = UnprivilegedPortStart();
  if (port > 0 && port < start) {
    return " (port " + std::to_string(port) + " is privileged: ports below " + std::to_string(start) +
           " need privileges (net.ipv4.ip_unprivileged_port_start); give a port of " + std::to_string(start) +
           " or above)";
  }
  return " (port " + std::to_string(port) + " is not a privileged one here (ports below " +
         std::to_string(start) + " are); a security policy such as SELinux or AppArmor may forbid this "
         "process to bind it)";
}

void SetPort(sockaddr_storage& addr, int port) {
  if (addr.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(static_cast<uint16_t>(port));
  }
}

// One listening socket per address in `addrs`, all on `port`, or on the port
// the first one picked when `port` is 0. `*port_taken` tells that a later
// address had that picked port in use (another pick may do).
StatusOr<std::vector<UniqueFd>> ListenOnAll(const std::string& host, int port,
                                            const std::vector<const addrinfo*>& addrs,
                                            bool ipv6_only, int backlog, bool* port_taken) {
  *port_taken = false;
  std::vector<UniqueFd> fds;
  std::string skipped;  // why the addresses this host cannot use were skipped, each
  bool not_here_only = true;  // every one skipped is not this host's, the caller's to fix
  int chosen = port;
  for (const addrinfo* ai : addrs) {
    sockaddr_storage addr{};
    std::memcpy(&addr, ai->ai_addr, ai->ai_addrlen);
    SetPort(addr, chosen);
    const std::string where = FormatAddress(reinterpret_cast<sockaddr*>(&addr), ai->ai_addrlen);
    // `step` ("", "socket: ", "listen: ") failed with `err`.
    auto failure = [&](const std::string& step, int err) {
      std::string at = HostPort(host, chosen);
      if (at != where) at += " (" + where + ")";
      std::string text = "cannot listen on " + at + ": " + step + ErrnoString(err);
      if (err == EADDRINUSE) {
        // The usual cause where rank 0 serves the store: RANK=0 given to
        // two processes (or two launchers as node 0), whose second bind
        // is the first thing that fails.
        return FailedPreconditionError(
            text + ": another process on this host already listens on " + where +
            " (a second process started as rank 0 of a job whose rank 0 serves the store, a store left "
            "running by an earlier job, or another program holding MASTER_PORT " + std::to_string(chosen) +
            "); check RANK and MASTER_PORT");
      }
      if (err == EACCES) {
        return PermissionDeniedError(text + (step.empty() ? BindDeniedHint(chosen)
                                                          : " (a security policy such as SELinux or AppArmor "
                                                            "may forbid this process to do it)"));
      }
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        return ResourceExhaustedError(text + " (this process or host is out of descriptors or memory)");
      }
      return InternalError(std::move(text));
    };
    UniqueFd fd(socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                       ai->ai_protocol));
    if (!fd.valid()) {
      const int err = errno;
      if (err == EAFNOSUPPORT || err == EPROTONOSUPPORT) {
        skipped += (skipped.empty() ? "" : "; ") + where + ": " + ErrnoString(err);
        not_here_only = false;
        continue;
      }
      return failure("socket: ", err);
    }
    // Lets a restarted launcher reuse its port while old connections sit in
    // TIME_WAIT; it does not let two live listeners share a port.
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    // An IPv6 wildcard would take the IPv4 addresses too, and then the IPv4
    // socket of the same name could not bind.
    if (ai->ai_family == AF_INET6 && ipv6_only) {
      setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    }
    if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), ai->ai_addrlen) != 0) {
      const int err = errno;
      if (err == EADDRNOTAVAIL) {
        bool callers = false;
        const std::string why = NotBindableReason(reinterpret_cast<sockaddr*>(&addr), &callers);
        skipped += (skipped.empty() ? "" : "; ") + where + ": " + ErrnoString(err) + " (" + why + ")";
        not_here_only = not_here_only && callers;
        continue;
      }
      *port_taken = err == EADDRINUSE && port == 0 && !fds.empty();
      return failure("", err);
    }
    if (listen(fd.get(), backlog) != 0) {
      const int err = errno;
      return failure("listen: ", err);
    }
    if (chosen == 0) {
      DDP_ASSIGN_OR_RETURN(chosen, LocalPort(fd.get()));
    }
    fds.push_back(std::move(fd));
  }
  if (fds.empty()) {
    // Not one address of this host, the caller's to fix; loopback down, a
    // family this host cannot use (IPv6 off) or an address not usable yet
    // is the host's.
    const std::string text = "cannot listen on " + HostPort(host, port) + ": " + skipped;
    return not_here_only ? InvalidArgumentError(text) : UnavailableError(text);
  }
  return fds;
}

}  // namespace

StatusOr<std::vector<UniqueFd>> ListenTcp(const std::string& given_host, int port, int backlog,
                                          Deadline deadline) {
  // No name service knows "[::1]": the brackets were looked up with it.
  const std::string host = Unbracketed(given_host);
  if (port < 0 || port > 65535) {
    return InvalidArgumentError("port " + std::to_string(port) + " is out of range [0, 65535]");
  }
  if (host.empty()) {
    return InvalidArgumentError("cannot listen at port " + std::to_string(port) +
                                ": the address to bind is empty (\"\"); give a host name or "
                                "address (0.0.0.0 or :: for every address)");
  }
  DDP_ASSIGN_OR_RETURN(AddrInfoPtr found, Resolve(host, port, /*passive=*/true, deadline));
  // Every address the name has, each once (a name listed twice in
  // /etc/hosts comes back twice): clients try them in their own order, and
  // one refused at an address we left out would never find the store.
  std::vector<const addrinfo*> addrs;
  std::vector<std::string> seen;
  bool has_ipv4 = false;
  for (const addrinfo* ai = found.get(); ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6) continue;
    std::string key = FormatAddress(ai->ai_addr, ai->ai_addrlen);
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) continue;
    seen.push_back(std::move(key));
    addrs.push_back(ai);
    has_ipv4 = has_ipv4 || ai->ai_family == AF_INET;
  }
  if (addrs.empty()) {
    return UnavailableError("cannot listen on " + HostPort(host, port) +
                            ": the name has no IPv4 or IPv6 address");
  }
  for (int attempt = 1;; ++attempt) {
    bool port_taken = false;
    StatusOr<std::vector<UniqueFd>> fds =
        ListenOnAll(host, port, addrs, /*ipv6_only=*/has_ipv4, backlog, &port_taken);
    if (fds.ok() || !port_taken || attempt == kPickPortAttempts) return fds;
  }
}

StatusOr<int> LocalPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return InternalError("getsockname: " + ErrnoString(errno));
  }
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return InternalError("socket is neither IPv4 nor IPv6");
}

bool BoundToLoopback(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return false;
  return IsLoopbackAddress(reinterpret_cast<const sockaddr*>(&addr));
}

StatusOr<int> FreeTcpPort() {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return UnavailableError("looking for a free port: socket: " + ErrnoString(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return UnavailableError("looking for a free port: bind: " + ErrnoString(errno));
  }
  return LocalPort(fd.get());
}

Clock::duration ConnectRetryPause(int retry, bool lookup_failed, double unit,
                                  Clock::duration left, bool loopback) {
  const Clock::duration most = lookup_failed ? Clock::duration(kLookupBackoffMax)
                               : loopback    ? Clock::duration(kRefusedLoopbackBackoffMax)
                                             : Clock::duration(kRefusedBackoffMax);
  return RetryPause(retry, unit, kConnectBackoffFirst, most, left);
}

StatusOr<UniqueFd> ConnectTcp(const std::string& given_host, int port, Deadline deadline) {
  // "[::1]" was looked up as a name, again and again until the deadline.
  const std::string host = Unbracketed(given_host);
  if (port < 1 || port > 65535) {
    return InvalidArgumentError("port " + std::to_string(port) + " is out of range [1, 65535]");
  }
  // No lookup of "" ever succeeds: refused now, not retried to the deadline.
  if (host.empty()) {
    return InvalidArgumentError("cannot connect to the store at port " + std::to_string(port) +
                                ": the host is empty (\"\"); give a host name or address");
  }
  int retries = 0;  // failed rounds so far
  std::string last_error;
  bool lookup_failed = false;  // the last round ended at the name lookup
  while (true) {
    // Looked up every round: the name may have no record yet (a headless
    // service before its pod is up), or a new address once it has one.
    StatusOr<AddrInfoPtr> addrs = Resolve(host, port, /*passive=*/false, deadline);
    if (!addrs.ok() && addrs.status().code() == StatusCode::kTimedOut) {
      // The deadline passed with the name service silent. An answer of the
      // round before ("no such name") says more.
      if (lookup_failed) break;
      if (last_error.empty()) return addrs.status();
      return TimedOutError(addrs.status().message() + " (the round before: " + last_error + ")");
    }
    lookup_failed = !addrs.ok();
    if (lookup_failed) last_error = addrs.status().message();
    bool loopback = !lookup_failed;  // every address of this round is a loopback one
    for (addrinfo* ai = lookup_failed ? nullptr : addrs->get(); ai != nullptr; ai = ai->ai_next) {
      loopback = loopback && IsLoopbackAddress(ai->ai_addr);
      UniqueFd fd(socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                         ai->ai_protocol));
      if (!fd.valid()) {
        last_error = "socket: " + ErrnoString(errno);
        continue;
      }
      int err = 0;
      if (connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          // With more addresses to try, one that never answers (a
          // black-holed IPv6 route ahead of a working IPv4 one) gets a
          // slice of the time, not all of it.
          const Deadline attempt_deadline =
              ai->ai_next == nullptr ? deadline : std::min(deadline, DeadlineIn(kConnectAttemptTime));
          pollfd pfd{fd.get(), POLLOUT, 0};
          const int n = PollUntil(&pfd, 1, attempt_deadline);
          if (n == 0) {
            last_error = "connection attempt timed out";
            continue;
          }
          socklen_t len = sizeof(err);
          err = 0;
          if (n < 0 || getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        }
      }
      if (err == 0 && ConnectedToItself(fd.get())) {
        last_error = "nobody listens there (the connection reached itself)";
        continue;
      }
      if (err == 0) {
        const int one = 1;
        setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return fd;
      }
      last_error = ErrnoString(err);
    }
    if (Clock::now() >= deadline) break;
    // Nobody listens yet (the store host may start after us), or the name
    // has no address yet: try again.
    std::this_thread::sleep_for(ConnectRetryPause(retries++, lookup_failed, RetryDraw(),
                                                  deadline - Clock::now(), loopback));
    if (Clock::now() >= deadline) break;
  }
  if (lookup_failed) {
    return UnavailableError(last_error + " (looked up until the deadline)");
  }
  return UnavailableError("cannot connect to the store at " + HostPort(host, port) + ": " +
                          last_error);
}

Status SendAll(int fd, std::string_view data, Deadline deadline, size_t* sent) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd{fd, POLLOUT, 0};
      const int ready = PollUntil(&pfd, 1, deadline);
      if (ready < 0) {
        if (sent) *sent = done;
        return UnavailableError("poll: " + ErrnoString(errno));
      }
      if (ready == 0) {
        if (sent) *sent = done;
        return TimedOutError("send timed out");
      }
      continue;
    }
    if (sent) *sent = done;
    return UnavailableError(ErrnoString(errno));
  }
  if (sent) *sent = done;
  return Status::Ok();
}

Status RecvSome(int fd, std::string& out, size_t max, Deadline deadline) {
  char buf[64 * 1024];
  while (true) {
    const ssize_t n = recv(fd, buf, std::min(max, sizeof(buf)), 0);
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
      return Status::Ok();
    }
    if (n == 0) return UnavailableError("connection closed by the peer");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return UnavailableError(ErrnoString(errno));
    pollfd pfd{fd, POLLIN, 0};
    const int ready = PollUntil(&pfd, 1, deadline);
    if (ready < 0) return UnavailableError("poll: " + ErrnoString(errno));
    if (ready == 0) return TimedOutError("receive timed out");
  }
}

}  // namespace ddp::transport::store
