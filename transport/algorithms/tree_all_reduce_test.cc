#include "transport/algorithms/tree_all_reduce.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "gmock/gmock.h"
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
using ::testing::HasSubstr;

// Lets one rank of a case enter its collective only once every other rank
// is blocked in a wait or has returned: each has then posted all it could
// without the late rank, the state a fixed head start (300 ms a case, 40 s
// in all) only made likely.
class LateEntryGate {
 public:
  explicit LateEntryGate(int others) : others_(others) {}

  /// A rank starts (+1) or stops (-1) being blocked; a rank that has
  /// returned counts as blocked for good.
  void Blocked(int delta) {
    std::lock_guard<std::mutex> lock(mu_);
    blocked_ += delta;
    cv_.notify_all();
  }

  /// Waits until every other rank is blocked at once, or until `deadline`
  /// (the case then runs anyway; its checks do not depend on the order).
  void WaitForOthers(Deadline deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return blocked_ == others_; });
  }

 private:
  const int others_;
  std::mutex mu_;
  std::condition_variable cv_;
  int blocked_ = 0;
};

// An endpoint that reports its blocking waits to a LateEntryGate and passes
// every call on.
class GateReportingEndpoint final : public testing::WaitObservingEndpoint {
 public:
  GateReportingEndpoint(p2p::PointToPoint& inner, LateEntryGate& gate)
      : WaitObservingEndpoint(inner), gate_(gate) {}

 private:
  void BeforeWait() override { gate_.Blocked(+1); }
  void AfterWait() override { gate_.Blocked(-1); }

  LateEntryGate& gate_;
};

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

// One rank passes another count (65 or 66 of f32: the first changes only
// tree 0's half, the second both) or a dtype of another size (64 of f64)
// among ranks passing 64 of f32, entering once all of them are blocked
// (LateEntryGate), and nobody is killed: every rank fails INVALID_ARGUMENT
// naming what the odd rank passed and what the others passed, count and
// dtype, as the ring does. A rank
// whose tree-1 child was the odd one (a leaf in both trees, as rank 0 is
// on an odd number of ranks, sends its data before its first wait), and
// which did not check it, could take that data before the others' stop
// note came and fail on its size
// ("message size mismatch: rank 0 sent 256 bytes (tag 0x200000) but rank 4
// expected 128", naming neither count), and the ranks its note reached
// learnt only their own arguments.
TEST(TreeAllReduceTest, EveryRankNamesBothArgumentsOfADisagreement) {
  struct Odd {
    size_t count;
    DataType dtype;
    const char* passed;  // as the fingerprint names it
  };
  const Odd odds[] = {{65, DataType::kF32, "count 65 of f32"},
                      {66, DataType::kF32, "count 66 of f32"},
                      {64, DataType::kF64, "count 64 of f64"}};
  for (const Odd& o : odds) {
    for (int world : {4, 5, 7, 8, 9, 12}) {
      for (int odd = 0; odd < world; ++odd) {
        const std::string what =
            std::to_string(world) + " ranks, rank " + std::to_string(odd) + " passes " + o.passed;
        ::ddp::transport::testing::HarnessOptions options;
        options.kill_on_error = false;
        const Deadline deadline = DeadlineIn(6s);
        LateEntryGate gate(world - 1);
        const std::vector<Status> statuses = transport::testing::RunRanks(
            world,
            [&](p2p::PointToPoint& endpoint) -> Status {
              GateReportingEndpoint p2p(endpoint, gate);
              const bool is_odd = p2p.rank() == odd;
              if (is_odd) gate.WaitForOthers(deadline - 1s);
              std::vector<double> data(66, 1.0);  // room for every case
              CollectiveArgs args;
              args.send = data.data();
              args.recv = data.data();
              args.count = is_odd ? o.count : 64;
              args.dtype = is_odd ? o.dtype : DataType::kF32;
              args.op = ReduceOp::kSum;
              args.deadline = deadline;
              const Status status = TreeAllReduce(p2p, args);
              if (!is_odd) gate.Blocked(+1);
              return status;
            },
            options);
        for (int r = 0; r < world; ++r) {
          const Status& s = statuses[r];
          EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": rank " << r << ": " << s;
          EXPECT_THAT(s.message(), HasSubstr("rank " + std::to_string(odd) +
                                             " passed tree all-reduce, " + o.passed))
              << what << ": rank " << r;
          EXPECT_THAT(s.message(), HasSubstr("passed tree all-reduce, count 64 of f32"))
              << what << ": rank " << r;
        }
        // The first case that fails says enough.
        if (HasFailure()) return;
      }
    }
  }
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
