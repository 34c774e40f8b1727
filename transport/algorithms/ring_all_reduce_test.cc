#include "transport/algorithms/ring_all_reduce.h"

#include <chrono>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/algorithms/all_reduce_test_util.h"
#include "transport/algorithms/tree_all_reduce.h"
#include "transport/p2p/group_view.h"
#include "transport/testing/thread_harness.h"

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

TEST(RingAllReduceTest, RandomValuesGiveEveryRankTheSameBits) {
  for (int world : {2, 3, 5, 8}) testing::SweepRandomValues(RingAllReduce, world);
}

TEST(RingAllReduceTest, MismatchedCountsFailOnEveryRank) {
  for (int world : {2, 3, 5}) testing::CheckMismatchedCountsFailEverywhere(RingAllReduce, world);
}

// Inside a sub-group (a ring in topology order, a host's ranks) group and
// real ranks differ: a mismatch names both sides by both, this rank too
// (it used to give this rank's group rank as if it were its real one).
TEST(RingAllReduceTest, MismatchInAGroupNamesEachRankByItsRealRank) {
  const std::vector<int> members = {2, 0, 1};  // group rank g is real rank members[g]
  auto statuses = ::ddp::transport::testing::RunRanks(3, [&](p2p::PointToPoint& parent) -> Status {
    StatusOr<p2p::GroupView> view = p2p::GroupView::Create(parent, members);
    if (!view.ok()) return view.status();
    const size_t count = parent.rank() == 1 ? 121 : 120;
    std::vector<float> send(count, 1.0f), recv(count);
    CollectiveArgs args;
    args.send = send.data();
    args.recv = recv.data();
    args.count = count;
    args.tag = CollectiveTag(0);
    args.deadline = DeadlineIn(std::chrono::seconds(10));
    return RingAllReduce(*view, args);
  });
  int reported = 0;
  for (int real = 0; real < 3; ++real) {
    const std::string& m = statuses[real].message();
    EXPECT_FALSE(statuses[real].ok()) << "rank " << real;
    if (m.find("disagree on the arguments") == std::string::npos) continue;  // may see a peer's failure instead
    ++reported;
    if (m.find("found that ranks disagree") != std::string::npos) {
      // A rank further on, told by a stop note from its ring predecessor:
      // it names the two ranks that differ (the odd one, group rank 2, and
      // the one after it), each by both.
      EXPECT_NE(m.find("this rank's ring predecessor"), std::string::npos)
          << "rank " << real << ": " << m;
      EXPECT_NE(m.find("group rank 2 (rank 1) passed ring all-reduce, count 121"),
                std::string::npos)
          << "rank " << real << ": " << m;
      EXPECT_NE(m.find("but group rank 0 (rank 2) passed ring all-reduce, count 120"),
                std::string::npos)
          << "rank " << real << ": " << m;
      continue;
    }
    const int group = real == 2 ? 0 : real + 1;
    EXPECT_NE(m.find("but group rank " + std::to_string(group) + " (rank " + std::to_string(real) + ") passed"),
              std::string::npos)
        << "rank " << real << ": " << m;
  }
  EXPECT_GT(reported, 0) << "no rank reported the mismatch";
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
