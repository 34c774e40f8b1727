#include "transport/store/socket.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "transport/store/backoff.h"

namespace ddp::transport::store {
namespace {

using namespace std::chrono_literals;

constexpr Clock::duration kLots = 1h;

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
