#include "transport/store/socket.h"

#include <fcntl.h>
#include <linux/capability.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "transport/store/backoff.h"

namespace ddp::transport::store {
namespace {

using namespace std::chrono_literals;

constexpr Clock::duration kLots = 1h;

// Writes `text` to the file `path`; false when it cannot.
bool WriteFile(const std::string& path, const std::string& text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool written = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  return close(fd) == 0 && written;
}

// Runs `body` in a child in user, network and mount namespaces of its own,
// where it is root of a network of its own (it may set that network's
// sysctls, and mount over files of its own view) and has no privilege
// outside. Returns what `body` returned ("" when all was as expected), or
// why the child could not run it.
std::string InOwnNetworkNamespace(const std::function<std::string()>& body) {
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return std::string("pipe2: ") + std::strerror(errno);
  const uid_t uid = getuid();
  const gid_t gid = getgid();
  const pid_t child = fork();
  if (child < 0) return std::string("fork: ") + std::strerror(errno);
  if (child == 0) {
    close(out[0]);
    std::string result;
    if (unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) != 0) {
      result = std::string("unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS): ") + std::strerror(errno) +
               " (this test needs user namespaces)";
    } else if (!WriteFile("/proc/self/setgroups", "deny") ||
               !WriteFile("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") ||
               !WriteFile("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1")) {
      result = std::string("mapping the user to root of the namespace: ") + std::strerror(errno);
    } else if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      result = std::string("making the mounts private: ") + std::strerror(errno);
    } else {
      result = body();
    }
    const bool sent = write(out[1], result.data(), result.size()) == static_cast<ssize_t>(result.size());
    _exit(sent ? 0 : 1);
  }
  close(out[1]);
  std::string got;
  const Deadline deadline = DeadlineIn(30s);
  pollfd readable{.fd = out[0], .events = POLLIN, .revents = 0};
  char buf[4096];
  ssize_t n = 1;
  while (n > 0 && PollUntil(&readable, 1, deadline) > 0) {
    n = read(out[0], buf, sizeof(buf));
    if (n > 0) got.append(buf, static_cast<size_t>(n));
  }
  close(out[0]);
  if (n != 0) kill(child, SIGKILL);  // still writing past the deadline
  int status = 0;
  waitpid(child, &status, 0);
  if (n != 0) return "the child did not finish within 30 s; it wrote: " + got;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "the child failed (status " + std::to_string(status) + "): " + got;
  return got;
}

// "" when ListenTcp(host, port) fails with `code` and a message holding
// `text`; else what it did.
std::string ListenFails(const std::string& host, int port, StatusCode code, const std::string& text) {
  StatusOr<std::vector<UniqueFd>> fds = ListenTcp(host, port, 16, DeadlineIn(10s));
  if (fds.ok()) return "ListenTcp(" + host + ") succeeded; expected " + text + "\n";
  if (fds.status().code() != code || fds.status().message().find(text) == std::string::npos) {
    return "ListenTcp(" + host + "): " + fds.status().ToString() + "; expected code " +
           std::to_string(static_cast<int>(code)) + " and \"" + text + "\"\n";
  }
  return "";
}

// Brings the loopback interface of this network namespace up, as root of
// it. A new namespace's lo is down and has no 127.0.0.1 until it comes up,
// and some kernels check that the address is local before the port's
// privilege (EADDRNOTAVAIL before EACCES), so a test of the port's refusal
// needs it up.
std::string BringLoopbackUp() {
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::string("socket for SIOCSIFFLAGS: ") + std::strerror(errno) + "\n";
  ifreq request{};
  std::strncpy(request.ifr_name, "lo", IFNAMSIZ - 1);
  std::string failed;
  if (ioctl(fd, SIOCGIFFLAGS, &request) != 0) {
    failed = std::string("SIOCGIFFLAGS lo: ") + std::strerror(errno) + "\n";
  } else {
    request.ifr_flags = static_cast<short>(request.ifr_flags | IFF_UP);
    if (ioctl(fd, SIOCSIFFLAGS, &request) != 0) {
      failed = std::string("SIOCSIFFLAGS lo up: ") + std::strerror(errno) + "\n";
    }
  }
  close(fd);
  return failed;
}

// Drops every capability this process has (in its user namespace).
std::string DropCapabilities() {
  __user_cap_header_struct header{.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
  __user_cap_data_struct none[2] = {};
  if (syscall(SYS_capset, &header, none) != 0) return std::string("capset: ") + std::strerror(errno) + "\n";
  return "";
}

// Where IPv6 is turned off (sysctl disable_ipv6, socket(AF_INET6) still
// working), ::1 and any other IPv6 address are refused by bind() as not
// this host's; that is the host's state, not bad input: UNAVAILABLE, each
// address named with why. (SelfLaunchOrExit binds 127.0.0.1 itself, and
// exits 2, "bad input", only for INVALID_ARGUMENT.)
TEST(SocketTest, AddressesTheHostCannotUseAreUnavailableNotBadInput) {
  const std::string failures = InOwnNetworkNamespace([] {
    if (!WriteFile("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1") ||
        !WriteFile("/proc/sys/net/ipv6/conf/default/disable_ipv6", "1") ||
        !WriteFile("/proc/sys/net/ipv6/conf/lo/disable_ipv6", "1")) {
      return std::string("turning IPv6 off: ") + std::strerror(errno);
    }
    return ListenFails("::1", 0, StatusCode::kUnavailable,
                       "cannot listen on [::1]:0: [::1]:0: Cannot assign requested address (a loopback address "
                       "this host cannot use now (loopback down, or IPv6 off))") +
           ListenFails("2001:db8::1", 0, StatusCode::kUnavailable,
                       "[2001:db8::1]:0: Cannot assign requested address (this host has no IPv6 address at all "
                       "(IPv6 off))");
  });
  EXPECT_EQ(failures, "");
}

// An address of no interface of this host, given by the user, stays bad
// input, named.
TEST(SocketTest, AnAddressOfAnotherHostIsBadInputNamingIt) {
  StatusOr<std::vector<UniqueFd>> fds = ListenTcp("192.0.2.1", 0, 16, DeadlineIn(10s));
  ASSERT_FALSE(fds.ok());
  EXPECT_EQ(fds.status().code(), StatusCode::kInvalidArgument) << fds.status();
  EXPECT_EQ(fds.status().message(),
            "cannot listen on 192.0.2.1:0: 192.0.2.1:0: Cannot assign requested address (not an address of this "
            "host)");
}

// A port below net.ipv4.ip_unprivileged_port_start, bound without
// CAP_NET_BIND_SERVICE, is named privileged with the limit that holds here
// (not always 1024).
TEST(SocketTest, APortBelowTheUnprivilegedStartIsNamedPrivileged) {
  const std::string failures = InOwnNetworkNamespace([] {
    if (!WriteFile("/proc/sys/net/ipv4/ip_unprivileged_port_start", "5000")) {
      return std::string("setting ip_unprivileged_port_start: ") + std::strerror(errno);
    }
    std::string failed = BringLoopbackUp();
    if (failed.empty()) failed = DropCapabilities();
    if (!failed.empty()) return failed;
    return ListenFails("127.0.0.1", 3000, StatusCode::kPermissionDenied,
                       "cannot listen on 127.0.0.1:3000: Permission denied (port 3000 is privileged: ports below "
                       "5000 need privileges (net.ipv4.ip_unprivileged_port_start); give a port of 5000 or "
                       "above)");
  });
  EXPECT_EQ(failures, "");
}

// A port refused though it is not a privileged one is not said to need
// privileges: a security policy is named instead. The refusal comes from
// the kernel's limit (5000), while ListenTcp reads 1000 from a file mounted
// over the sysctl, as a policy's refusal would look to it.
TEST(SocketTest, APortRefusedAboveTheUnprivilegedStartNamesAPolicy) {
  const std::string failures = InOwnNetworkNamespace([] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string fake = std::string(tmp != nullptr ? tmp : "/tmp") + "/unprivileged_port_start_XXXXXX";
    const int fd = mkstemp(fake.data());
    if (fd < 0) return std::string("mkstemp: ") + std::strerror(errno);
    const bool written = write(fd, "1000\n", 5) == 5;
    close(fd);
    const char* sysctl = "/proc/sys/net/ipv4/ip_unprivileged_port_start";
    if (!written || !WriteFile(sysctl, "5000") || mount(fake.c_str(), sysctl, nullptr, MS_BIND, nullptr) != 0) {
      return std::string("setting ip_unprivileged_port_start: ") + std::strerror(errno);
    }
    std::string failed = BringLoopbackUp();
    if (failed.empty()) failed = DropCapabilities();
    if (!failed.empty()) return failed;
    failed = ListenFails("127.0.0.1", 3000, StatusCode::kPermissionDenied,
                         "cannot listen on 127.0.0.1:3000: Permission denied (port 3000 is not a privileged one "
                         "here (ports below 1000 are); a security policy such as SELinux or AppArmor may forbid "
                         "this process to bind it)");
    unlink(fake.c_str());
    return failed;
  });
  EXPECT_EQ(failures, "");
}

// While nobody listens, ConnectTcp's pauses grow from a few ms to at most
// 200 ms whatever the draws; while the name does not resolve, to at most
// 1 s. Each is at least half its ceiling, so none shrinks below the one
// before until the cap.
TEST(SocketTest, ConnectRetryPausesGrowWithinTheirBoundsWhateverTheDraws) {
  std::mt19937_64 engine(12345);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (bool lookup_failed : {false, true}) {
    SCOPED_TRACE(lookup_failed ? "lookup failed" : "refused");
    const Clock::duration most = lookup_failed ? Clock::duration(1s) : Clock::duration(200ms);
    for (int trial = 0; trial < 50; ++trial) {
      Clock::duration before = Clock::duration::zero();
      for (int retry = 0; retry < 20; ++retry) {
        const Clock::duration pause = ConnectRetryPause(retry, lookup_failed, unit(engine), kLots);
        EXPECT_GE(pause, Clock::duration(2500us)) << "retry " << retry;
        EXPECT_LE(pause, most) << "retry " << retry;
        EXPECT_GE(pause, std::min<Clock::duration>(before, most / 2)) << "retry " << retry;
        before = pause;
      }
      EXPECT_GE(before, most / 2) << "never reached the cap's range";
    }
  }
  // Never past the deadline.
  EXPECT_EQ(ConnectRetryPause(10, false, 0.5, 7ms), Clock::duration(7ms));
  EXPECT_EQ(ConnectRetryPause(10, true, 0.5, Clock::duration::zero()), Clock::duration::zero());
}

// A store on this host (a loopback address) is knocked on at most every
// 20 ms: a rank connects that soon after a late rank 0 starts listening.
TEST(SocketTest, ConnectRetryPausesToALoopbackStoreStayShort) {
  std::mt19937_64 engine(54321);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int trial = 0; trial < 50; ++trial) {
    Clock::duration before = Clock::duration::zero();
    for (int retry = 0; retry < 20; ++retry) {
      const Clock::duration pause =
          ConnectRetryPause(retry, /*lookup_failed=*/false, unit(engine), kLots, /*loopback=*/true);
      EXPECT_GE(pause, Clock::duration(2500us)) << "retry " << retry;
      EXPECT_LE(pause, Clock::duration(20ms)) << "retry " << retry;
      before = pause;
    }
    EXPECT_GE(before, Clock::duration(10ms)) << "never reached the cap's range";
  }
  // A name that does not resolve yet waits as long as any other.
  EXPECT_GE(ConnectRetryPause(20, /*lookup_failed=*/true, 0.5, kLots, /*loopback=*/true),
            Clock::duration(500ms));
}

// Two ranks started together, each retrying against a store not up yet,
// knock at different instants: their pauses (from each thread's own draw)
// differ. Without a spread they were the same fixed 5, 10, 20 ... 200 ms.
TEST(SocketTest, TwoClientsConnectRetryPausesDiffer) {
  EXPECT_NE(ConnectRetryPause(3, false, 0.1, kLots), ConnectRetryPause(3, false, 0.9, kLots));
  EXPECT_NE(ConnectRetryPause(8, true, 0.1, kLots), ConnectRetryPause(8, true, 0.9, kLots));
  auto schedule = [] {
    std::vector<Clock::duration> out;
    for (int retry = 0; retry < 12; ++retry) {
      out.push_back(ConnectRetryPause(retry, false, RetryDraw(), kLots));
    }
    return out;
  };
  std::vector<Clock::duration> a, b;
  std::thread ta([&] { a = schedule(); });
  std::thread tb([&] { b = schedule(); });
  ta.join();
  tb.join();
  EXPECT_NE(a, b) << "two clients would retry in step";
}

}  // namespace
}  // namespace ddp::transport::store
