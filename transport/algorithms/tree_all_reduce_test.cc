#include "transport/algorithms/tree_all_reduce.h"

#include "gtest/gtest.h"
#include "transport/algorithms/all_reduce_test_util.h"
#include "transport/algorithms/ring_all_reduce.h"

namespace ddp::transport::algorithms {
namespace {

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


TEST(TreeTrafficTest, NoRankMovesMoreThanItsShare) {
  // An inner node of one tree sends its half up and twice down (1.5x),
  // and is a leaf of the other (0.5x).
  for (int world : {2, 3, 5, 8}) {
    testing::CheckTraffic(TreeAllReduce, world, 1 << 14, 2.0);
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
