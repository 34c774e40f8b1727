#include "transport/algorithms/all_gather.h"

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

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
using ::ddp::transport::testing::RunRanks;

enum class Placement { kSeparate, kInPlace, kSendAtRecvStart };

// Rank q's block is Contribution(kMax, dtype, q, j): it differs per rank, so
// a block in the wrong place shows.
void Check(int world, size_t count, DataType dtype, Placement placement, size_t chunk_bytes) {
  const std::string what = "world=" + std::to_string(world) + " count=" + std::to_string(count) +
                           " " + DataTypeName(dtype) + " placement=" +
                           std::to_string(static_cast<int>(placement)) +
                           " chunk=" + std::to_string(chunk_bytes);
  const size_t es = DataTypeSize(dtype);
  std::vector<unsigned char> want;
  for (int q = 0; q < world; ++q) {
    auto block = Contributions(ReduceOp::kMax, dtype, q, count);
    want.insert(want.end(), block.begin(), block.end());
  }
  std::vector<std::string> wrong(world);
  auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
    const int r = p2p.rank();
    const std::vector<unsigned char> mine = Contributions(ReduceOp::kMax, dtype, r, count);
    std::vector<unsigned char> send = mine;
    std::vector<unsigned char> recv(count * world * es + 1, 0x5A);
    CollectiveArgs args;
    args.recv = recv.data();
    switch (placement) {
      case Placement::kSeparate:
        args.send = send.data();
        break;
      case Placement::kInPlace:
        if (count > 0) std::memcpy(recv.data() + r * count * es, mine.data(), count * es);
        args.send = recv.data() + r * count * es;
        break;
      case Placement::kSendAtRecvStart:
        if (count > 0) std::memcpy(recv.data(), mine.data(), count * es);
        args.send = recv.data();
        break;
    }
    args.count = count;
    args.dtype = dtype;
    args.deadline = DeadlineIn(30s);
    args.tuning.chunk_bytes = chunk_bytes;
    DDP_RETURN_IF_ERROR(RingAllGather(p2p, args));
    wrong[r] = Compare(dtype, recv.data(), want.data(), count * world);
    if (recv[count * world * es] != 0x5A) wrong[r] = "wrote past the end of recv";
    return Status();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << what << " rank " << r << ": " << statuses[r];
    EXPECT_EQ(wrong[r], "") << what << " rank " << r;
  }
}

class RingAllGatherWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(RingAllGatherWorldTest, CountsPlacementsAndChunking) {
  for (Placement placement : {Placement::kSeparate, Placement::kInPlace,
                              Placement::kSendAtRecvStart}) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{2}, size_t{37}}) {
      for (size_t chunk : {size_t{0}, size_t{8}}) Check(GetParam(), count, DataType::kF32, placement, chunk);
    }
  }
}

TEST_P(RingAllGatherWorldTest, EveryType) {
  for (DataType dtype : kAllDataTypes) Check(GetParam(), 13, dtype, Placement::kSeparate, 4);
}

INSTANTIATE_TEST_SUITE_P(Worlds, RingAllGatherWorldTest,
                         ::testing::Values(1, 2, 3, 4, 5, 7, 8, 9, 16));

TEST(RingAllGatherTest, LargeVector) { Check(4, 1 << 18, DataType::kF32, Placement::kInPlace, 0); }

TEST(RingAllGatherTest, MismatchedCountsFailOnEveryRank) {
  // 0 included: an empty call still proves its arguments.
  for (size_t odd : {9, 0}) {
    const auto deadline = DeadlineIn(10s);
    auto statuses = RunRanks(3, [&](p2p::PointToPoint& p2p) -> Status {
      const size_t count = p2p.rank() == 0 ? odd : 8;
      std::vector<float> send(count, 1.0f), recv(count * 3);
      CollectiveArgs args;
      args.send = send.data();
      args.recv = recv.data();
      args.count = count;
      args.deadline = deadline;
      return RingAllGather(p2p, args);
    });
    EXPECT_LT(Clock::now() + 8s, deadline) << "odd count " << odd;
    for (const Status& s : statuses) EXPECT_FALSE(s.ok()) << "odd count " << odd;
  }
}

// On a ring view in another order than the ranks' (RingViewOrder over
// RingViewHosts), every block keeps its rank's place in the buffers, and half
// as many bytes cross between hosts as on the ring in rank order.
TEST(RingAllGatherTest, OnARingViewBlocksKeepTheirRanksPlaces) {
  constexpr int kWorld = testing::kRingViewWorld;
  constexpr size_t kCount = 1000;
  uint64_t crossing[2] = {0, 0};
  for (bool on_view : {false, true}) {
    SCOPED_TRACE(on_view ? "on the ring view" : "in rank order");
    p2p::LoopbackHub hub(kWorld);
    std::vector<std::vector<float>> out(kWorld);
    auto statuses = RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
      const int r = p2p.rank();
      const std::vector<float> in(kCount, static_cast<float>(r + 1));
      out[r].assign(kCount * kWorld, 0.0f);
      CollectiveArgs args;
      args.send = in.data();
      args.recv = out[r].data();
      args.count = kCount;
      args.dtype = DataType::kF32;
      args.tag = CollectiveTag(3);
      args.deadline = DeadlineIn(30s);
      return on_view ? testing::RunOnRingView(p2p, args, RingAllGather) : RingAllGather(p2p, args);
    });
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(statuses[r].ok()) << statuses[r];
      for (int q = 0; q < kWorld; ++q) {
        EXPECT_EQ(out[r][q * kCount], static_cast<float>(q + 1)) << "rank " << r << " block " << q;
        EXPECT_EQ(out[r][q * kCount + kCount - 1], static_cast<float>(q + 1)) << "rank " << r << " block " << q;
      }
    }
    crossing[on_view] = hub.BytesBetweenGroups(testing::RingViewHosts());
  }
  testing::ExpectRingViewHalvesTheCrossing(crossing);
}

// A block_owner that is not one entry per rank, each rank once, is refused
// on every rank, naming the entry, before any block is placed by it (a
// short one was read past its end, a repeated rank laid two blocks over one
// another).
TEST(RingAllGatherTest, BlockOwnerThatIsNotAPermutationIsNamed) {
  testing::ExpectBlockOwnersThatAreNotPermutationsRefused(RingAllGather, /*send_blocks=*/1,
                                                          /*recv_blocks=*/3);
}

// One rank passes another count (per rank) or dtype of the same size, at
// every place of 5 and 6 ranks, in one chunk and in many: no rank may
// return OK. With the harness killing failed ranks, every rank fails well
// before the deadline; without, by it at the latest.
TEST(RingAllGatherTest, OneRankWithAnotherCountOrDtypeFailsEveryRank) {
  testing::ExpectOneRankWithAnotherCountOrDtypeFailsEveryRank(RingAllGather, /*send_has_every_block=*/false);
}

// Nobody killed: the ranks further from the odd one than its successor
// waited for blocks until their deadline; the successor's stop note now
// fails them at once.
TEST(RingAllGatherTest, OneRankWithAnotherCountStopsTheWholeRing) {
  testing::ExpectOneRankWithAnotherCountStopsTheRing(RingAllGather, /*send_has_every_block=*/false);
}

}  // namespace
}  // namespace ddp::transport::algorithms
