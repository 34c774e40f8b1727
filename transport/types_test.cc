#include "transport/types.h"

#include <chrono>

#include <gtest/gtest.h>

namespace ddp::transport {
namespace {

using namespace std::chrono_literals;

TEST(DeadlineInTest, IsThatFarFromNow) {
  const Deadline before = Clock::now();
  const Deadline deadline = DeadlineIn(1500ms);
  EXPECT_GE(deadline - before, 1500ms);
  EXPECT_LT(deadline - Clock::now(), 1501ms);
  EXPECT_LE(DeadlineIn(-5ms), Clock::now());
}

TEST(DeadlineInTest, TooLongATimeoutSaturatesInsteadOfWrapping) {
  // milliseconds::max() is about 292 million years; in the clock's
  // nanoseconds it would wrap into the past.
  EXPECT_EQ(DeadlineIn(std::chrono::milliseconds::max()), Deadline::max());
  const auto centuries = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::years(400));
  EXPECT_EQ(DeadlineIn(centuries), Deadline::max());
  EXPECT_GT(DeadlineIn(std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::years(100))),
            Clock::now() + std::chrono::years(99));
}

TEST(DeadlineInTest, TooNegativeATimeoutIsInThePastInsteadOfWrapping) {
  // -400 years in the clock's nanoseconds leaves int64's range: it used to
  // wrap into the future (about 185 years from now).
  const auto centuries = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::years(-400));
  EXPECT_LE(DeadlineIn(centuries), Clock::now());
  EXPECT_LE(DeadlineIn(std::chrono::milliseconds::min()), Clock::now());
  // Still a usable distance from now, both ways.
  EXPECT_GT(Clock::now() - DeadlineIn(centuries), 0ms);
}

TEST(DeadlineAfterTest, MovesAFiniteDeadlineByTheAllowance) {
  const Deadline deadline = Clock::now();
  EXPECT_EQ(DeadlineAfter(deadline, 250ms), deadline + 250ms);
  EXPECT_EQ(DeadlineAfter(deadline, -250ms), deadline - 250ms);
  EXPECT_EQ(DeadlineAfter(deadline, 0ms), deadline);
}

TEST(DeadlineAfterTest, AnUnboundedDeadlineStaysUnboundedInsteadOfWrapping) {
  // Deadline::max() + 250 ms wraps to near Deadline::min(): a wait given it
  // would end before it began.
  EXPECT_EQ(DeadlineAfter(Deadline::max(), 250ms), Deadline::max());
  EXPECT_EQ(DeadlineAfter(DeadlineIn(std::chrono::milliseconds::max()), 250ms), Deadline::max());
  EXPECT_EQ(DeadlineAfter(Deadline::max() - 100ms, 250ms), Deadline::max());
  EXPECT_EQ(DeadlineAfter(Deadline::max() - 250ms, 250ms), Deadline::max());
  EXPECT_EQ(DeadlineAfter(Deadline::min(), -250ms), Deadline::min());
  EXPECT_EQ(DeadlineAfter(Deadline::min() + 100ms, -250ms), Deadline::min());
}

TEST(DeadlineAfterTest, AnAllowanceBeyondTheClocksRangeSaturatesInsteadOfWrapping) {
  // milliseconds::max() in the clock's nanoseconds would wrap.
  EXPECT_EQ(DeadlineAfter(Clock::now(), std::chrono::milliseconds::max()), Deadline::max());
  EXPECT_EQ(DeadlineAfter(Deadline::max(), std::chrono::milliseconds::max()), Deadline::max());
  EXPECT_EQ(DeadlineAfter(Deadline::min(), std::chrono::milliseconds::min()), Deadline::min());
  EXPECT_LT(DeadlineAfter(Clock::now(), std::chrono::milliseconds::min()), Clock::now());
}

}  // namespace
}  // namespace ddp::transport
