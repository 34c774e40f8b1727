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

}  // namespace
}  // namespace ddp::transport
