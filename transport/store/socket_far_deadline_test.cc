// The socket waits with a deadline further out than one poll() can wait
// (INT_MAX ms, 24.8 days). This binary stands in for poll: a wait of
// INT_MAX ms returns 0 at once, the way the real one returns once those
// days have passed, after running the test's hook (which makes the socket
// ready). A wait that took that 0 for its deadline failed with TIMED_OUT
// though its deadline was still far off.

#include <dlfcn.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <functional>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "transport/store/socket.h"

namespace {

std::function<void()> on_longest_wait;  // set by a test; runs once
int longest_waits = 0;                  // polls asked to wait INT_MAX ms

}  // namespace

extern "C" int poll(pollfd* fds, nfds_t count, int timeout_ms) {
  using RealPoll = int (*)(pollfd*, nfds_t, int);
  static const RealPoll real = reinterpret_cast<RealPoll>(dlsym(RTLD_NEXT, "poll"));
  if (timeout_ms == INT_MAX) {
    ++longest_waits;
    if (on_longest_wait) {
      std::function<void()> hook = std::move(on_longest_wait);
      on_longest_wait = nullptr;
      hook();
      return 0;  // as if 24.8 days went by with nothing
    }
  }
  return real(fds, count, timeout_ms);
}

namespace ddp::transport::store {
namespace {

struct SocketPair {
  UniqueFd a, b;
  SocketPair() {
    int fds[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds), 0);
    a.Reset(fds[0]);
    b.Reset(fds[1]);
  }
};

TEST(SocketFarDeadlineTest, MillisecondsUntilTheFurthestDeadlineIsTheLongestPoll) {
  EXPECT_EQ(MillisecondsUntil(Deadline::max()), INT_MAX);
  EXPECT_EQ(MillisecondsUntil(Deadline::min()), 0);
}

TEST(SocketFarDeadlineTest, ReceiveWithAFarDeadlineReturnsTheDataThatComesAfterOnePollsLongestWait) {
  SocketPair pair;
  longest_waits = 0;
  on_longest_wait = [&] { ASSERT_EQ(write(pair.b.get(), "hi", 2), 2); };
  std::string got;
  const Status received = RecvSome(pair.a.get(), got, 16, Deadline::max());
  ASSERT_TRUE(received.ok()) << received.ToString();
  EXPECT_EQ(got, "hi");
  EXPECT_EQ(longest_waits, 2);  // waited again after the first turn ran out
}

TEST(SocketFarDeadlineTest, SendWithAFarDeadlineFinishesOnceThePeerReadsAfterOnePollsLongestWait) {
  SocketPair pair;
  // More than the socket buffers take, so that the send has to wait.
  const std::string data(8 << 20, 'x');
  std::atomic<size_t> received{0};
  std::thread reader;
  longest_waits = 0;
  // The peer starts reading only when the sender's first turn runs out.
  on_longest_wait = [&] {
    reader = std::thread([&] {
      char buf[64 * 1024];
      const Deadline give_up = DeadlineIn(std::chrono::seconds(30));
      while (received < data.size() && Clock::now() < give_up) {
        const ssize_t n = read(pair.b.get(), buf, sizeof(buf));
        if (n > 0) {
          received += static_cast<size_t>(n);
          continue;
        }
        if (n == 0) return;  // the sender gave up
        pollfd pfd{pair.b.get(), POLLIN, 0};
        poll(&pfd, 1, 100);
      }
    });
  };
  size_t sent = 0;
  const Status status = SendAll(pair.a.get(), data, Deadline::max(), &sent);
  if (!status.ok()) pair.a.Reset();  // the reader sees the end and stops
  if (reader.joinable()) reader.join();
  ASSERT_TRUE(status.ok()) << status.ToString() << " after " << sent << " bytes";
  EXPECT_EQ(sent, data.size());
  EXPECT_EQ(received, data.size());
  EXPECT_GE(longest_waits, 2);
}

}  // namespace
}  // namespace ddp::transport::store
