#include "transport/store/backoff.h"

#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace ddp::transport::store {
namespace {

using namespace std::chrono_literals;

// The schedule: doubling to a cap, spread by the draw over the upper half
// of the ceiling, and never past the deadline.
TEST(BackoffTest, RetryPausesDoubleToACapSpreadByTheDrawWithinTheDeadline) {
  const Clock::duration first = 10ms, most = 500ms, lots = 1h;
  EXPECT_EQ(RetryPause(0, 0.0, first, most, lots), Clock::duration(5ms));
  EXPECT_EQ(RetryPause(1, 0.0, first, most, lots), Clock::duration(10ms));
  EXPECT_EQ(RetryPause(3, 0.0, first, most, lots), Clock::duration(40ms));
  EXPECT_EQ(RetryPause(6, 0.0, first, most, lots), Clock::duration(250ms));
  EXPECT_EQ(RetryPause(1000, 0.0, first, most, lots), Clock::duration(250ms));
  EXPECT_EQ(RetryPause(0, 0.5, first, most, lots), Clock::duration(7500us));
  // Two clients refused together with different draws come back apart.
  EXPECT_EQ(RetryPause(2, 0.25, first, most, lots), Clock::duration(25ms));
  EXPECT_EQ(RetryPause(2, 0.75, first, most, lots), Clock::duration(35ms));
  EXPECT_LE(RetryPause(1000, 0.999999, first, most, lots), most);
  EXPECT_GT(RetryPause(1000, 0.999999, first, most, lots), Clock::duration(499ms));
  // A draw out of range is clamped, not extrapolated.
  EXPECT_EQ(RetryPause(2, -3.0, first, most, lots), Clock::duration(20ms));
  EXPECT_EQ(RetryPause(2, 7.0, first, most, lots), Clock::duration(40ms));
  // Never past the deadline; none once it has passed.
  EXPECT_EQ(RetryPause(6, 0.5, first, most, 3ms), Clock::duration(3ms));
  EXPECT_EQ(RetryPause(6, 0.5, first, most, Clock::duration::zero()), Clock::duration::zero());
  EXPECT_EQ(RetryPause(6, 0.5, first, most, -5ms), Clock::duration::zero());
}

// Draws are in [0, 1), and two threads (two ranks' clients) draw apart.
TEST(BackoffTest, RetryDrawsAreUnitIntervalAndDifferBetweenThreads) {
  auto draws = [] {
    std::vector<double> out;
    for (int i = 0; i < 16; ++i) out.push_back(RetryDraw());
    return out;
  };
  std::vector<double> a, b;
  std::thread ta([&] { a = draws(); });
  std::thread tb([&] { b = draws(); });
  ta.join();
  tb.join();
  for (const std::vector<double>* v : {&a, &b}) {
    for (double d : *v) {
      EXPECT_GE(d, 0.0);
      EXPECT_LT(d, 1.0);
    }
  }
  EXPECT_NE(a, b) << "two threads drew the same sequence: their retries would go in step";
}

}  // namespace
}  // namespace ddp::transport::store
