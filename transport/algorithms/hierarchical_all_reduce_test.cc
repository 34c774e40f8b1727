#include "transport/algorithms/hierarchical_all_reduce.h"

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/algorithms/all_reduce_test_util.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms {
namespace {

using namespace std::chrono_literals;
using testing::AllReduceFn;
using testing::CheckAllReduce;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Contiguous hosts of `per_host` ranks: host of rank r is r / per_host.
std::vector<int> Contiguous(int world, int per_host) {
  std::vector<int> hosts(world);
  for (int r = 0; r < world; ++r) hosts[r] = r / per_host;
  return hosts;
}

// Round-robin placement: host of rank r is r % num_hosts (ids shuffled).
std::vector<int> Interleaved(int world, int num_hosts) {
  std::vector<int> hosts(world);
  for (int r = 0; r < world; ++r) hosts[r] = 100 - r % num_hosts;
  return hosts;
}

AllReduceFn With(std::vector<int> hosts) {
  return [hosts](p2p::PointToPoint& p2p, const CollectiveArgs& args) {
    return HierarchicalAllReduce(p2p, args, hosts);
  };
}

TEST(GroupByHostTest, UniformHostsGiveIntraAndInterGroups) {
  p2p::LoopbackHub hub(6);
  auto ep = std::move(hub.Connect(4)).value();
  // Hosts: {0, 2, 4} and {1, 3, 5}; rank 4 is local index 2 on the first.
  const std::vector<int> hosts = {7, 9, 7, 9, 7, 9};
  auto groups = GroupByHost(*ep, hosts);
  ASSERT_TRUE(groups.ok()) << groups.status();
  EXPECT_EQ(groups->num_hosts, 2);
  EXPECT_EQ(groups->ranks_per_host, 3);
  EXPECT_THAT(groups->intra, ElementsAre(0, 2, 4));
  EXPECT_THAT(groups->inter, ElementsAre(4, 5));
}

TEST(GroupByHostTest, UnevenHostsFallBackToOneGroup) {
  p2p::LoopbackHub hub(5);
  auto ep = std::move(hub.Connect(1)).value();
  auto groups = GroupByHost(*ep, std::vector<int>{0, 0, 0, 1, 1});
  ASSERT_TRUE(groups.ok());
  EXPECT_EQ(groups->ranks_per_host, 0);
  EXPECT_THAT(groups->intra, ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(groups->inter, ElementsAre(1));
  auto wrong = GroupByHost(*ep, std::vector<int>{0, 1});
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("host_of_rank has 2 entries for 5 ranks"));
  // The all-reduce says it was the one given the list.
  std::vector<float> data(4, 1.0f);
  CollectiveArgs args;
  args.send = data.data();
  args.recv = data.data();
  args.count = data.size();
  args.deadline = DeadlineIn(5s);
  Status status = HierarchicalAllReduce(*ep, args, std::vector<int>{0, 1});
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(),
              HasSubstr("hierarchical all-reduce: host_of_rank has 2 entries for 5 ranks; expected 5"));
}

class HierarchicalWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(HierarchicalWorldTest, EveryHostLayoutMatchesClosedForm) {
  const int world = GetParam();
  std::vector<std::vector<int>> layouts = {{}, Contiguous(world, 1), Contiguous(world, world)};
  for (int per_host = 2; per_host < world; ++per_host) {
    if (world % per_host == 0) {
      layouts.push_back(Contiguous(world, per_host));
      layouts.push_back(Interleaved(world, world / per_host));
    }
  }
  // Uneven: the first rank alone on a host.
  if (world > 2) {
    std::vector<int> uneven(world, 1);
    uneven[0] = 0;
    layouts.push_back(uneven);
  }
  for (const auto& hosts : layouts) {
    SCOPED_TRACE("hosts of " + std::to_string(hosts.size()) + " ranks, first " +
                 (hosts.empty() ? std::string("none") : std::to_string(hosts[0])));
    testing::SweepCounts(With(hosts), world);
  }
}

TEST_P(HierarchicalWorldTest, EveryTypeAndOp) {
  const int world = GetParam();
  const int per_host = world % 2 == 0 ? 2 : 1;
  testing::SweepTypesAndOps(With(Contiguous(world, per_host)), world, 29, 8);
}

INSTANTIATE_TEST_SUITE_P(Worlds, HierarchicalWorldTest,
                         ::testing::Values(1, 2, 3, 4, 5, 6, 8, 9, 12, 16));

TEST(HierarchicalAllReduceTest, LargeVectorOnTwoHostsOfFour) {
  CheckAllReduce(With(Contiguous(8, 4)), {8, (1 << 20) + 5, DataType::kF32, ReduceOp::kSum, false});
}

// Only the inter-host step crosses hosts, and it carries one shard per
// rank: each rank sends about 2 (H-1)/H * N/L bytes to other hosts, not N.
TEST(HierarchicalAllReduceTest, OnlyOneShardPerRankCrossesHosts) {
  constexpr int kHosts = 2, kPerHost = 4, kWorld = kHosts * kPerHost;
  constexpr size_t kCount = 1 << 16;
  const std::vector<int> hosts = Contiguous(kWorld, kPerHost);
  p2p::LoopbackHub hub(kWorld);
  auto statuses = ::ddp::transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> data(kCount, 1.0f);
    CollectiveArgs args;
    args.send = data.data();
    args.recv = data.data();
    args.count = kCount;
    args.deadline = DeadlineIn(30s);
    return HierarchicalAllReduce(p2p, args, hosts);
  });
  for (const Status& s : statuses) ASSERT_TRUE(s.ok()) << s;
  const double shard_bytes = kCount * sizeof(float) / kPerHost;
  for (int from = 0; from < kWorld; ++from) {
    uint64_t cross = 0;
    for (int to = 0; to < kWorld; ++to) {
      if (hosts[to] != hosts[from]) cross += hub.BytesBetween(from, to);
    }
    // 2 (H-1)/H of a shard, plus fingerprints.
    EXPECT_LE(cross, 2.0 * (kHosts - 1) / kHosts * shard_bytes + 256) << "rank " << from;
    EXPECT_GE(cross, 2.0 * (kHosts - 1) / kHosts * shard_bytes) << "rank " << from;
  }
}

// Every collective tag leaves room for the step between hosts, which runs
// as an all-reduce of its own at phase 1 and checks its tag range: before,
// the 65,536th collective's tag had none, and every rank failed.
TEST(HierarchicalAllReduceTest, EverySequenceNumberLeavesRoomForTheStepBetweenHosts) {
  for (uint64_t s : {uint64_t{0}, uint64_t{65534}, uint64_t{65535}, uint64_t{65536}, uint64_t{131071}}) {
    EXPECT_LE(PhaseTag(CollectiveTag(s), 1), p2p::kMaxTag - (kTagsPerCollective - 1)) << s;
  }
  for (uint64_t s = 0; s < (uint64_t{1} << 17); ++s) {
    ASSERT_LE(CollectiveTag(s), p2p::kMaxTag - 2 * kTagsPerCollective + 1) << s;
  }
  for (const uint64_t s : {uint64_t{65535}, uint64_t{65534}}) {
    const std::vector<int> hosts = Contiguous(4, 2);
    AllReduceFn at_sequence = [hosts, s](p2p::PointToPoint& p2p, const CollectiveArgs& args) {
      CollectiveArgs a = args;
      a.tag = CollectiveTag(s);
      return HierarchicalAllReduce(p2p, a, hosts);
    };
    for (size_t count : {size_t{0}, size_t{1000}}) {
      CheckAllReduce(at_sequence, {.world = 4, .count = count, .dtype = DataType::kF32, .op = ReduceOp::kSum});
    }
  }
}

// A tag that a collective alone may start at, but that leaves the step
// between hosts no room, is refused on every rank, naming that tag, before
// anything moves: the step's own check refused it, naming a tag the caller
// never passed, after the reduce-scatter inside each host had run.
TEST(HierarchicalAllReduceTest, TagWithoutRoomForTheStepBetweenHostsIsNamedUpFront) {
  const p2p::Tag top = p2p::kMaxTag - (kTagsPerCollective - 1);
  for (size_t count : {size_t{0}, size_t{1000}}) {
    SCOPED_TRACE("count " + std::to_string(count));
    p2p::LoopbackHub hub(4);
    auto statuses = ::ddp::transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
      std::vector<float> send(count, 1.0f), recv(count, 0.0f);
      CollectiveArgs args;
      args.send = send.data();
      args.recv = recv.data();
      args.count = count;
      args.tag = top;
      args.deadline = DeadlineIn(5s);
      return HierarchicalAllReduce(p2p, args, Contiguous(4, 2));
    });
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << statuses[r];
      EXPECT_THAT(statuses[r].message(),
                  HasSubstr("hierarchical all-reduce: tag " + std::to_string(top) +
                            " leaves no room for the step between hosts"))
          << "rank " << r;
      EXPECT_EQ(hub.Stats(r).messages_sent, 0u) << "rank " << r;
    }
  }
  // The step between hosts on its own, as the communicator runs it.
  auto statuses = ::ddp::transport::testing::RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> shard(8, 1.0f);
    CollectiveArgs args;
    args.tag = top;
    args.deadline = DeadlineIn(5s);
    return InterHostAllReduce(p2p, shard.data(), shard.size(), 4, args);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(statuses[r].message(),
                HasSubstr("(inter-host all-reduce): tag " + std::to_string(top) +
                          " leaves no room for the step between hosts"))
        << "rank " << r << ": " << statuses[r];
  }
}

TEST(HierarchicalAllReduceTest, RandomValuesGiveEveryRankTheSameBits) {
  testing::SweepRandomValues(With(Contiguous(4, 2)), 4);
  testing::SweepRandomValues(With(Contiguous(6, 3)), 6);
  testing::SweepRandomValues(With(Interleaved(6, 2)), 6);
  std::vector<int> uneven(5, 1);
  uneven[0] = 0;
  testing::SweepRandomValues(With(uneven), 5);
}

TEST(HierarchicalAllReduceTest, MismatchedCountsFailOnEveryRank) {
  testing::CheckMismatchedCountsFailEverywhere(With(Contiguous(4, 2)), 4);
  testing::CheckMismatchedCountsFailEverywhere(With(Contiguous(6, 3)), 6);
}

// Hosts passing 10 and 11 elements over two ranks each hold shards of 5
// and 6 at local index 0 but 5 and 5 at index 1: the ranks at index 1
// passed the check between hosts and waited, until their deadline, in the
// all-gather inside their host for the rank at index 0 that had failed.
TEST(HierarchicalAllReduceTest, HostsPassingCountsWithAnEqualShardFailAtOnce) {
  // Nobody is killed: each rank must find the mismatch on its own.
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  const auto deadline = DeadlineIn(20s);
  auto statuses = ::ddp::transport::testing::RunRanks(4, [&](p2p::PointToPoint& p2p) -> Status {
    const size_t count = p2p.rank() < 2 ? 10 : 11;
    std::vector<float> send(count, 1.0f), recv(count, 0.0f);
    CollectiveArgs args;
    args.send = send.data();
    args.recv = recv.data();
    args.count = count;
    args.tag = CollectiveTag(3);
    args.deadline = deadline;
    return HierarchicalAllReduce(p2p, args, Contiguous(4, 2));
  }, options);
  EXPECT_LT(Clock::now() + 15s, deadline) << "ranks took until near the deadline";
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << statuses[r];
    EXPECT_THAT(statuses[r].message(), HasSubstr("count 10")) << "rank " << r;
    EXPECT_THAT(statuses[r].message(), HasSubstr("count 11")) << "rank " << r;
  }
}

TEST(HierarchicalAllReduceTest, EmptyCallFailsEveryRank) {
  // One rank of a host, then every rank of a host: the others reach it only
  // in their inter-host step.
  testing::CheckEmptyAgainstNonEmptyFailsEverywhere(With(Contiguous(4, 2)), With(Contiguous(4, 2)), 4);
  testing::CheckEmptyAgainstNonEmptyFailsEverywhere(With(Contiguous(4, 2)), With(Contiguous(4, 2)), 4,
                                                    {2, 3});
  testing::CheckEmptyAgainstNonEmptyFailsEverywhere(With(Contiguous(6, 3)), With(Contiguous(6, 3)), 6,
                                                    {0, 1});
}

TEST(HierarchicalAllReduceTest, KilledRankFailsEverySurvivor) {
  testing::CheckKilledRankFailsSurvivors(With(Contiguous(6, 2)), 6);
}

TEST(HierarchicalAllReduceTest, AbsentRankTimesOutAtTheDeadline) {
  testing::CheckAbsentRankTimesOut(With(Contiguous(4, 2)), 4);
}

TEST(HierarchicalAllReduceTest, BadArgumentsNameTheArgument) {
  testing::CheckBadArguments(With({}), "hierarchical all-reduce");
}

// The world size that InterHostAllReduce divides avg by cannot be below the
// number of ranks it reduces over: 0 or less is refused, naming it, on every
// rank (the division by 0 or less aborted the process).
TEST(InterHostAllReduceTest, WorldSizeBelowTheGroupIsNamed) {
  for (const auto& [ranks, world_size] : {std::pair{1, 0}, std::pair{1, -2}, std::pair{2, 1}}) {
    SCOPED_TRACE("ranks " + std::to_string(ranks) + " world_size " + std::to_string(world_size));
    auto statuses = ::ddp::transport::testing::RunRanks(ranks, [&](p2p::PointToPoint& p2p) -> Status {
      std::vector<float> shard(5, 2.0f);
      CollectiveArgs args;
      args.dtype = DataType::kF32;
      args.op = ReduceOp::kAvg;
      args.tag = CollectiveTag(1);
      args.deadline = DeadlineIn(5s);
      return InterHostAllReduce(p2p, shard.data(), shard.size(), world_size, args);
    });
    for (int r = 0; r < ranks; ++r) {
      EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << statuses[r];
      EXPECT_THAT(statuses[r].message(),
                  HasSubstr("world_size " + std::to_string(world_size) + " is less than the " +
                            std::to_string(ranks) + " ranks"))
          << "rank " << r;
    }
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
