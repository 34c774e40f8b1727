#include "transport/algorithms/ring_all_reduce.h"

#include "gtest/gtest.h"
#include "transport/algorithms/all_reduce_test_util.h"
#include "transport/algorithms/tree_all_reduce.h"

namespace ddp::transport::algorithms {
namespace {

using testing::AllReduceCase;
using testing::CheckAllReduce;

class RingAllReduceWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(RingAllReduceWorldTest, CountsAndChunkingMatchClosedForm) {
  testing::SweepCounts(RingAllReduce, GetParam());
}

TEST_P(RingAllReduceWorldTest, EveryTypeAndOp) {
  testing::SweepTypesAndOps(RingAllReduce, GetParam(), 29, 8);
}

INSTANTIATE_TEST_SUITE_P(Worlds, RingAllReduceWorldTest,
                         ::testing::Values(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16));

TEST(RingAllReduceTest, LargeVectorWithDefaultChunks) {
  CheckAllReduce(RingAllReduce, {4, (1 << 20) + 3, DataType::kF32, ReduceOp::kSum, false});
  CheckAllReduce(RingAllReduce, {3, 1 << 20, DataType::kBF16, ReduceOp::kAvg, true});
}

// chunk_bytes near SIZE_MAX with u8: the chunk count used to be
// (n + ce - 1) / ce, which wraps to 0, so the call returned OK having moved
// nothing.
TEST(RingAllReduceTest, HugeChunkBytesStillReduce) {
  for (size_t chunk : {~size_t{0}, ~size_t{0} - 1}) {
    CheckAllReduce(RingAllReduce, {4, 1000, DataType::kU8, ReduceOp::kSum, false, chunk});
    CheckAllReduce(RingAllReduce, {3, 37, DataType::kU8, ReduceOp::kMax, true, chunk});
  }
}

TEST(RingAllReduceTest, MismatchedCountsFailOnEveryRank) {
  for (int world : {2, 3, 5}) testing::CheckMismatchedCountsFailEverywhere(RingAllReduce, world);
}

TEST(RingAllReduceTest, EmptyCallOnOneRankFailsEveryRank) {
  for (int world : {2, 3, 5}) {
    testing::CheckEmptyAgainstNonEmptyFailsEverywhere(RingAllReduce, RingAllReduce, world);
    testing::CheckEmptyAgainstNonEmptyFailsEverywhere(RingAllReduce, TreeAllReduce, world);
  }
}

TEST(RingAllReduceTest, KilledRankFailsEverySurvivor) {
  for (int world : {2, 4, 7}) testing::CheckKilledRankFailsSurvivors(RingAllReduce, world);
}

TEST(RingAllReduceTest, AbsentRankTimesOutAtTheDeadline) {
  testing::CheckAbsentRankTimesOut(RingAllReduce, 4);
}

TEST(RingAllReduceTest, BadArgumentsNameTheArgument) {
  testing::CheckBadArguments(RingAllReduce, "ring all-reduce");
}


TEST(RingTrafficTest, NoRankMovesMoreThanItsShare) {
  // Each rank sends and receives 2 (p-1)/p of the vector, the optimum.
  for (int world : {2, 3, 5, 8}) {
    testing::CheckTraffic(RingAllReduce, world, 1 << 14, 2.0 * (world - 1) / world);
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
