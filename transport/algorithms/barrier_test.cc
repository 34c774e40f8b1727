#include "transport/algorithms/barrier.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms {
namespace {

using namespace std::chrono_literals;
using ::ddp::transport::testing::RunRanks;
using ::testing::HasSubstr;

// Ranks arrive at different times; nobody may leave before the last one
// arrived. Repeated with fresh tags, as a communicator would.
TEST(BarrierTest, NoRankLeavesBeforeTheLastArrives) {
  for (int world : {1, 2, 3, 4, 5, 7, 8, 9, 13, 16}) {
    constexpr int kRounds = 5;
    std::vector<std::vector<Clock::time_point>> arrived(kRounds, std::vector<Clock::time_point>(world));
    std::vector<std::vector<Clock::time_point>> left(kRounds, std::vector<Clock::time_point>(world));
    auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
      const int r = p2p.rank();
      for (int round = 0; round < kRounds; ++round) {
        // A different rank is late each round.
        if (r == round % world) std::this_thread::sleep_for(20ms);
        arrived[round][r] = Clock::now();
        CollectiveArgs args;
        args.tag = CollectiveTag(round);
        args.deadline = DeadlineIn(10s);
        DDP_RETURN_IF_ERROR(Barrier(p2p, args));
        left[round][r] = Clock::now();
      }
      return Status();
    });
    for (int r = 0; r < world; ++r) ASSERT_TRUE(statuses[r].ok()) << statuses[r];
    for (int round = 0; round < kRounds; ++round) {
      const auto last = *std::max_element(arrived[round].begin(), arrived[round].end());
      for (int r = 0; r < world; ++r) {
        EXPECT_GE(left[round][r], last) << "world=" << world << " round " << round << " rank " << r;
      }
    }
  }
}

TEST(BarrierTest, AbsentRankTimesOutAtTheDeadline) {
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  std::vector<Clock::duration> took(4);
  auto statuses = RunRanks(
      4,
      [&](p2p::PointToPoint& p2p) -> Status {
        if (p2p.rank() == 3) return Status();
        CollectiveArgs args;
        const auto start = Clock::now();
        args.deadline = start + 200ms;
        Status s = Barrier(p2p, args);
        took[p2p.rank()] = Clock::now() - start;
        return s;
      },
      options);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kTimedOut) << statuses[r];
    EXPECT_THAT(statuses[r].message(), HasSubstr("barrier"));
    EXPECT_LT(took[r], 2s);
  }
}

TEST(BarrierTest, KilledRankGivesPeerLost) {
  p2p::LoopbackHub hub(3);
  auto statuses = ::ddp::transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
    if (p2p.rank() == 1) {
      std::this_thread::sleep_for(30ms);
      hub.Kill(1);
      return AbortedError("killed");
    }
    CollectiveArgs args;
    args.deadline = DeadlineIn(20s);
    return Barrier(p2p, args);
  });
  EXPECT_EQ(statuses[0].code(), StatusCode::kPeerLost) << statuses[0];
  EXPECT_EQ(statuses[2].code(), StatusCode::kPeerLost) << statuses[2];
}

TEST(BarrierTest, UnsetDeadlineIsRejected) {
  auto statuses = RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    return Barrier(p2p, CollectiveArgs{});
  });
  for (const Status& s : statuses) EXPECT_THAT(s.message(), HasSubstr("deadline is not set"));
}

}  // namespace
}  // namespace ddp::transport::algorithms
