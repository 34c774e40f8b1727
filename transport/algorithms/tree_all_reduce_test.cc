#include "transport/algorithms/tree_all_reduce.h"

#include <chrono>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/algorithms/all_reduce_test_util.h"
#include "transport/algorithms/ring_all_reduce.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms {
namespace {

using namespace std::chrono_literals;
using testing::AllReduceCase;
using testing::CheckAllReduce;

class TreeAllReduceWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(TreeAllReduceWorldTest, CountsAndChunkingMatchClosedForm) {
  testing::SweepCounts(TreeAllReduce, GetParam());
}

TEST_P(TreeAllReduceWorldTest, EveryTypeAndOp) {
  testing::SweepTypesAndOps(TreeAllReduce, GetParam(), 29, 8);
}

INSTANTIATE_TEST_SUITE_P(Worlds, TreeAllReduceWorldTest,
                         ::testing::Values(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16));

TEST(TreeAllReduceTest, LargeVectorWithDefaultChunks) {
  CheckAllReduce(TreeAllReduce, {4, (1 << 20) + 3, DataType::kF32, ReduceOp::kSum, false});
  CheckAllReduce(TreeAllReduce, {3, 1 << 20, DataType::kBF16, ReduceOp::kAvg, true});
}

// chunk_bytes near SIZE_MAX with u8: the chunk count used to be
// (n + ce - 1) / ce, which wraps to 0, so the call returned OK having moved
// nothing.
TEST(TreeAllReduceTest, HugeChunkBytesStillReduce) {
  for (size_t chunk : {~size_t{0}, ~size_t{0} - 1}) {
    CheckAllReduce(TreeAllReduce, {4, 1000, DataType::kU8, ReduceOp::kSum, false, chunk});
    CheckAllReduce(TreeAllReduce, {3, 37, DataType::kU8, ReduceOp::kMax, true, chunk});
  }
}

TEST(TreeAllReduceTest, RandomValuesGiveEveryRankTheSameBits) {
  for (int world : {2, 3, 5, 8}) testing::SweepRandomValues(TreeAllReduce, world);
}

TEST(TreeAllReduceTest, MismatchedCountsFailOnEveryRank) {
  for (int world : {2, 3, 5}) testing::CheckMismatchedCountsFailEverywhere(TreeAllReduce, world);
}

TEST(TreeAllReduceTest, EmptyCallOnOneRankFailsEveryRank) {
  for (int world : {2, 3, 5}) {
    testing::CheckEmptyAgainstNonEmptyFailsEverywhere(TreeAllReduce, TreeAllReduce, world);
    testing::CheckEmptyAgainstNonEmptyFailsEverywhere(TreeAllReduce, RingAllReduce, world);
  }
  // Only leaves, which the tree never sends to before the data comes back.
  testing::CheckEmptyAgainstNonEmptyFailsEverywhere(TreeAllReduce, TreeAllReduce, 7, {5, 6});
}

TEST(TreeAllReduceTest, KilledRankFailsEverySurvivor) {
  for (int world : {2, 4, 7}) testing::CheckKilledRankFailsSurvivors(TreeAllReduce, world);
}

TEST(TreeAllReduceTest, AbsentRankTimesOutAtTheDeadline) {
  testing::CheckAbsentRankTimesOut(TreeAllReduce, 4);
}

TEST(TreeAllReduceTest, BadArgumentsNameTheArgument) {
  testing::CheckBadArguments(TreeAllReduce, "tree all-reduce");
}

// No rank holds more than a pipeline's depth of chunks per tree as
// unexpected messages (plus the argument check's fingerprints), whatever the
// chunk count (256 here): a rank sends chunk j up only after chunk j - depth
// came back down, so the lockstep is the send window (6 at most seen).
TEST(TreeAllReduceTest, ChunksInFlightAreBoundedByThePipelineDepth) {
  constexpr int kDepth = 4;
  constexpr size_t kCount = size_t{1} << 18;
  for (int world : {2, 5, 8}) {
    SCOPED_TRACE(std::to_string(world) + " ranks");
    p2p::LoopbackHub hub(world);
    std::vector<std::vector<float>> data(world, std::vector<float>(kCount, 1.0f));
    auto statuses = ::ddp::transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
      CollectiveArgs args;
      args.send = data[p2p.rank()].data();
      args.recv = data[p2p.rank()].data();
      args.count = kCount;
      args.dtype = DataType::kF32;
      args.op = ReduceOp::kSum;
      args.tag = CollectiveTag(11);
      args.deadline = DeadlineIn(60s);
      args.tuning.chunk_bytes = 1024;
      args.tuning.pipeline_depth = kDepth;
      return TreeAllReduce(p2p, args);
    });
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(statuses[r].ok()) << statuses[r];
      EXPECT_EQ(data[r][0], static_cast<float>(world)) << "rank " << r;
      EXPECT_EQ(data[r][kCount - 1], static_cast<float>(world)) << "rank " << r;
      EXPECT_LE(hub.Stats(r).peak_unexpected_sends, uint64_t{2 * kDepth + 4}) << "rank " << r;
    }
  }
}

TEST(TreeTrafficTest, NoRankMovesMoreThanItsShare) {
  // An inner node of one tree sends its half up and twice down (1.5x),
  // and is a leaf of the other (0.5x).
  for (int world : {2, 3, 5, 8}) {
    testing::CheckTraffic(TreeAllReduce, world, 1 << 14, 2.0);
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
