#include "transport/algorithms/reduce_scatter.h"

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/algorithms/block_owner_test_util.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/collective_values.h"
#include "transport/testing/data_types.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms {
namespace {

using namespace std::chrono_literals;
using ::ddp::transport::testing::Compare;
using ::ddp::transport::testing::Contributions;
using ::ddp::transport::testing::kAllDataTypes;
using ::ddp::transport::testing::Expectations;
using ::ddp::transport::testing::RunRanks;
using ::testing::HasSubstr;

constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax,
                                ReduceOp::kMin, ReduceOp::kProd};

// Rank q contributes Contribution(op, dtype, q, i) at global element i of
// the world * count input; rank r must end with the reduced block r.
void Check(int world, size_t count, DataType dtype, ReduceOp op, bool in_place,
           size_t chunk_bytes) {
  const std::string what = "world=" + std::to_string(world) + " count=" + std::to_string(count) +
                           " " + DataTypeName(dtype) + " " + ReduceOpName(op) +
                           (in_place ? " in-place" : "") + " chunk=" + std::to_string(chunk_bytes);
  const size_t es = DataTypeSize(dtype);
  const std::vector<unsigned char> want = Expectations(op, dtype, world, count * world);
  std::vector<std::string> wrong(world);
  auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
    const int r = p2p.rank();
    std::vector<unsigned char> send = Contributions(op, dtype, r, count * world);
    const std::vector<unsigned char> original = send;
    std::vector<unsigned char> recv(count * es + 1, 0x5A);
    CollectiveArgs args;
    args.send = send.data();
    args.recv = in_place ? send.data() + r * count * es : recv.data();
    args.count = count;
    args.dtype = dtype;
    args.op = op;
    args.deadline = DeadlineIn(30s);
    args.tuning.chunk_bytes = chunk_bytes;
    DDP_RETURN_IF_ERROR(RingReduceScatter(p2p, args));
    wrong[r] = Compare(dtype, args.recv, want.data() + r * count * es, count);
    if (!in_place && recv[count * es] != 0x5A) wrong[r] = "wrote past the end of recv";
    if (!in_place && send != original) wrong[r] = "modified the send buffer";
    return Status();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << what << " rank " << r << ": " << statuses[r];
    EXPECT_EQ(wrong[r], "") << what << " rank " << r;
  }
}

class RingReduceScatterWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(RingReduceScatterWorldTest, CountsAndChunking) {
  const int world = GetParam();
  for (bool in_place : {false, true}) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{2}, size_t{37}}) {
      for (size_t chunk : {size_t{0}, size_t{8}}) {
        Check(world, count, DataType::kF32, ReduceOp::kSum, in_place, chunk);
      }
    }
    Check(world, 301, DataType::kF32, ReduceOp::kAvg, in_place, 12);
  }
}

TEST_P(RingReduceScatterWorldTest, EveryTypeAndOp) {
  for (DataType dtype : kAllDataTypes) {
    for (ReduceOp op : kAllOps) Check(GetParam(), 11, dtype, op, GetParam() % 2 == 0, 4);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, RingReduceScatterWorldTest,
                         ::testing::Values(1, 2, 3, 4, 5, 7, 8, 9, 16));

TEST(RingReduceScatterTest, LargeVector) {
  Check(4, 1 << 18, DataType::kF32, ReduceOp::kSum, false, 0);
}

TEST(RingReduceScatterTest, MismatchedCountsFailOnEveryRank) {
  // 0 included: an empty call still proves its arguments.
  for (size_t odd : {21, 0}) {
    const auto deadline = DeadlineIn(10s);
    auto statuses = RunRanks(4, [&](p2p::PointToPoint& p2p) -> Status {
      const size_t count = p2p.rank() == 2 ? odd : 20;
      std::vector<float> send(count * 4, 1.0f), recv(count);
      CollectiveArgs args;
      args.send = send.data();
      args.recv = recv.data();
      args.count = count;
      args.deadline = deadline;
      return RingReduceScatter(p2p, args);
    });
    EXPECT_LT(Clock::now() + 8s, deadline) << "odd count " << odd;
    int named = 0;
    for (const Status& s : statuses) {
      EXPECT_FALSE(s.ok()) << "odd count " << odd;
      named += s.message().find("count " + std::to_string(odd) + " ") != std::string::npos;
    }
    EXPECT_GT(named, 0) << "odd count " << odd;
  }
}

TEST(RingReduceScatterTest, RecvOverlappingAnotherBlockIsRejected) {
  auto statuses = RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> send(8, 1.0f);
    CollectiveArgs args;
    args.send = send.data();
    // Rank 1's in-place slot is send + 4; send + 2 straddles two blocks.
    args.recv = send.data() + 2;
    args.count = 4;
    args.deadline = DeadlineIn(5s);
    return RingReduceScatter(p2p, args);
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("ring reduce-scatter: recv overlaps send"));
  }
}

// On a ring view in another order than the ranks' (RingViewOrder over
// RingViewHosts), every block keeps its rank's place in the buffers, and half
// as many bytes cross between hosts as on the ring in rank order.
TEST(RingReduceScatterTest, OnARingViewBlocksKeepTheirRanksPlaces) {
  constexpr int kWorld = testing::kRingViewWorld;
  constexpr size_t kCount = 1000;
  uint64_t crossing[2] = {0, 0};
  for (bool on_view : {false, true}) {
    SCOPED_TRACE(on_view ? "on the ring view" : "in rank order");
    p2p::LoopbackHub hub(kWorld);
    std::vector<std::vector<float>> out(kWorld);
    auto statuses = RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
      const int r = p2p.rank();
      // Element i of block q is 100 * q + i on every rank: block q sums to
      // 4 * (100 * q + i) and must reach rank q.
      std::vector<float> in(kCount * kWorld);
      for (int q = 0; q < kWorld; ++q) {
        for (size_t i = 0; i < kCount; ++i) in[q * kCount + i] = static_cast<float>(100 * q + i % 7);
      }
      out[r].assign(kCount, 0.0f);
      CollectiveArgs args;
      args.send = in.data();
      args.recv = out[r].data();
      args.count = kCount;
      args.dtype = DataType::kF32;
      args.tag = CollectiveTag(3);
      args.deadline = DeadlineIn(30s);
      return on_view ? testing::RunOnRingView(p2p, args, RingReduceScatter)
                     : RingReduceScatter(p2p, args);
    });
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(statuses[r].ok()) << statuses[r];
      EXPECT_EQ(out[r][0], static_cast<float>(kWorld * 100 * r)) << "rank " << r;
      EXPECT_EQ(out[r][kCount - 1], static_cast<float>(kWorld * (100 * r + (kCount - 1) % 7))) << "rank " << r;
    }
    crossing[on_view] = hub.BytesBetweenGroups(testing::RingViewHosts());
  }
  testing::ExpectRingViewHalvesTheCrossing(crossing);
}

// A block_owner that is not one entry per rank, each rank once, is refused
// on every rank, naming the entry, before any block is placed by it (a
// short one was read past its end, a repeated rank laid two blocks over one
// another).
TEST(RingReduceScatterTest, BlockOwnerThatIsNotAPermutationIsNamed) {
  testing::ExpectBlockOwnersThatAreNotPermutationsRefused(RingReduceScatter, /*send_blocks=*/3,
                                                          /*recv_blocks=*/1);
}

// One rank passes another count (per rank) or dtype of the same size, at
// every place of 5 and 6 ranks, in one chunk and in many: no rank may
// return OK. With the harness killing failed ranks, every rank fails well
// before the deadline; without, by it at the latest.
TEST(RingReduceScatterTest, OneRankWithAnotherCountOrDtypeFailsEveryRank) {
  testing::ExpectOneRankWithAnotherCountOrDtypeFailsEveryRank(RingReduceScatter, /*send_has_every_block=*/true);
}

// Nobody killed: the ranks further from the odd one than its successor
// waited for data until their deadline; the successor's stop note now
// fails them at once.
TEST(RingReduceScatterTest, OneRankWithAnotherCountStopsTheWholeRing) {
  testing::ExpectOneRankWithAnotherCountStopsTheRing(RingReduceScatter, /*send_has_every_block=*/true);
}

}  // namespace
}  // namespace ddp::transport::algorithms
