#include "transport/algorithms/broadcast.h"

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/algorithms/disagreement_test_util.h"
#include "transport/algorithms/ring_all_reduce.h"
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
using ::testing::HasSubstr;

void Check(int world, int root, size_t count, DataType dtype, bool in_place, size_t chunk_bytes) {
  const std::string what = "world=" + std::to_string(world) + " root=" + std::to_string(root) +
                           " count=" + std::to_string(count) + " " + DataTypeName(dtype) +
                           (in_place ? " in-place" : "") + " chunk=" + std::to_string(chunk_bytes);
  const size_t es = DataTypeSize(dtype);
  const std::vector<unsigned char> want = Contributions(ReduceOp::kMax, dtype, root, count);
  std::vector<std::string> wrong(world);
  auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
    const int r = p2p.rank();
    std::vector<unsigned char> send = Contributions(ReduceOp::kMax, dtype, r, count);
    std::vector<unsigned char> recv(count * es + 1, 0x5A);
    if (in_place && count > 0) std::memcpy(recv.data(), send.data(), count * es);
    CollectiveArgs args;
    args.send = in_place ? recv.data() : (r == root ? send.data() : nullptr);
    args.recv = recv.data();
    args.count = count;
    args.dtype = dtype;
    args.root = root;
    args.deadline = DeadlineIn(30s);
    args.tuning.chunk_bytes = chunk_bytes;
    DDP_RETURN_IF_ERROR(Broadcast(p2p, args));
    wrong[r] = Compare(dtype, recv.data(), want.data(), count);
    if (recv[count * es] != 0x5A) wrong[r] = "wrote past the end of recv";
    return Status();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << what << " rank " << r << ": " << statuses[r];
    EXPECT_EQ(wrong[r], "") << what << " rank " << r;
  }
}

class BroadcastWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(BroadcastWorldTest, EveryRootCountAndShape) {
  const int world = GetParam();
  for (int root = 0; root < world; ++root) {
    for (size_t count : {size_t{0}, size_t{1}, static_cast<size_t>(world + 2), size_t{37}}) {
      // Default chunks: one chunk, tree. Tiny chunks: many chunks, chain
      // (count 37 with 8-byte chunks) or tree (few chunks).
      for (size_t chunk : {size_t{0}, size_t{8}}) {
        Check(world, root, count, DataType::kF32, root % 2 == 1, chunk);
      }
    }
  }
}

TEST_P(BroadcastWorldTest, EveryType) {
  for (DataType dtype : kAllDataTypes) {
    Check(GetParam(), GetParam() / 2, 19, dtype, false, 4);
    Check(GetParam(), GetParam() - 1, 19, dtype, true, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, BroadcastWorldTest,
                         ::testing::Values(1, 2, 3, 4, 5, 6, 7, 8, 9, 16));

TEST(BroadcastTest, LargeVector) {
  Check(5, 3, (1 << 20) + 1, DataType::kF32, false, 0);
  Check(5, 0, 1 << 20, DataType::kBF16, true, 0);
}

// No rank holds more than a pipeline's depth of chunks as unexpected
// messages (plus the argument check's fingerprints): the root posted every
// chunk at once, and a rank forwarded each as it came, whatever its
// children had taken. A chain (4 ranks, 1024 chunks) and a tree (many
// ranks, few chunks is a tree; 9 ranks and 8 chunks).
TEST(BroadcastTest, ChunksInFlightAreBoundedByThePipelineDepth) {
  constexpr int kDepth = 4;
  for (const auto& [world, count] : {std::pair{4, size_t{1} << 18}, std::pair{9, size_t{2048}}}) {
    SCOPED_TRACE(std::to_string(world) + " ranks, " + std::to_string(count) + " floats");
    p2p::LoopbackHub hub(world);
    std::vector<std::vector<float>> data(world, std::vector<float>(count));
    for (size_t i = 0; i < count; ++i) data[1][i] = static_cast<float>(i % 1000);
    auto statuses = RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
      CollectiveArgs args;
      args.send = data[p2p.rank()].data();
      args.recv = data[p2p.rank()].data();
      args.count = count;
      args.dtype = DataType::kF32;
      args.root = 1;
      args.tag = CollectiveTag(7);
      args.deadline = DeadlineIn(60s);
      args.tuning.chunk_bytes = 1024;
      args.tuning.pipeline_depth = kDepth;
      return Broadcast(p2p, args);
    });
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(statuses[r].ok()) << statuses[r];
      EXPECT_EQ(data[r][count - 1], static_cast<float>((count - 1) % 1000)) << "rank " << r;
      EXPECT_LE(hub.Stats(r).peak_unexpected_sends, uint64_t{kDepth + 4}) << "rank " << r;
    }
  }
}

// chunk_bytes near SIZE_MAX with u8: the chunk count used to be
// (n + ce - 1) / ce, which wraps to 0, so the call returned OK having moved
// nothing.
TEST(BroadcastTest, HugeChunkBytesStillMoveTheData) {
  for (size_t chunk : {~size_t{0}, ~size_t{0} - 1}) {
    Check(4, 1, 1000, DataType::kU8, false, chunk);
    Check(3, 2, 37, DataType::kU8, true, chunk);
  }
}

TEST(BroadcastTest, RootOutOfRangeIsNamedOnEveryRank) {
  auto statuses = RunRanks(3, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> buf(4);
    CollectiveArgs args;
    args.send = buf.data();
    args.recv = buf.data();
    args.count = buf.size();
    args.root = 3;
    args.deadline = DeadlineIn(5s);
    return Broadcast(p2p, args);
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("broadcast: root 3 is outside [0, 3)"));
  }
}

TEST(BroadcastTest, NullBuffersAreNamed) {
  auto statuses = RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> buf(4);
    CollectiveArgs args;
    args.send = nullptr;  // fine off the root, wrong on it
    args.recv = p2p.rank() == 1 ? nullptr : buf.data();
    args.count = buf.size();
    args.deadline = DeadlineIn(5s);
    return Broadcast(p2p, args);
  });
  EXPECT_THAT(statuses[0].message(), HasSubstr("send buffer is null"));
  EXPECT_THAT(statuses[1].message(), HasSubstr("recv buffer is null"));
}

// The empty rank and whoever checks it fail at once, and nobody waits for
// the deadline (EmptyCallOnOneRankFailsEveryRank below asks more: every
// rank fails, naming both counts).
TEST(BroadcastTest, EmptyCallOnOneRankFailsFast) {
  for (int odd : {0, 2}) {  // the root, then another rank
    const auto deadline = DeadlineIn(10s);
    auto statuses = RunRanks(4, [&](p2p::PointToPoint& p2p) -> Status {
      std::vector<float> buf(16, 1.0f);
      CollectiveArgs args;
      args.send = buf.data();
      args.recv = buf.data();
      args.count = p2p.rank() == odd ? 0 : buf.size();
      args.deadline = deadline;
      return Broadcast(p2p, args);
    });
    EXPECT_LT(Clock::now() + 8s, deadline) << "empty on rank " << odd;
    EXPECT_FALSE(statuses[odd].ok()) << "empty on rank " << odd;
    int named = 0;
    for (const Status& s : statuses) named += s.message().find("disagree") != std::string::npos;
    EXPECT_GT(named, 0) << "empty on rank " << odd;
  }
}

TEST(BroadcastTest, RanksDisagreeingOnTheRootFailFast) {
  const auto deadline = DeadlineIn(10s);
  auto statuses = RunRanks(4, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> buf(16, 1.0f);
    CollectiveArgs args;
    args.send = buf.data();
    args.recv = buf.data();
    args.count = buf.size();
    args.root = p2p.rank() == 2 ? 1 : 0;
    args.deadline = deadline;
    return Broadcast(p2p, args);
  });
  EXPECT_LT(Clock::now() + 8s, deadline);
  int named = 0;
  for (const Status& s : statuses) named += s.message().find("disagree") != std::string::npos;
  EXPECT_GT(named, 0);
  EXPECT_FALSE(statuses[2].ok());
}

// Rank root + 1 takes itself for the root; the others agree on the true
// root. In the tree shape (one chunk), the impostor sends its own buffer to
// its children before its check of its ring predecessor (the true root)
// fails; a rank whose tree parent is the impostor but whose ring predecessor
// agrees with it used to take that data and return OK with it (world 4:
// rank root + 3). The true root starts last, so that the impostor's check
// waits and its data goes out first; the impostor's ring successor, which
// fails at once on the impostor's fingerprint, starts after the others have
// posted their receives (the harness kills a failed rank, and its
// fingerprint, not yet taken, would go with it). Every rank must fail, and
// none may return OK with anything but the root's data.
TEST(BroadcastTest, RankTakingItselfForTheRootFailsEveryRankInTheTree) {
  constexpr size_t kCount = 16;  // one chunk: the tree, not the chain
  for (int world : {4, 5, 8}) {
    for (int root : {0, world - 2}) {
      const int impostor = (root + 1) % world;
      const std::string what = "world=" + std::to_string(world) + " root=" + std::to_string(root) +
                               " impostor=" + std::to_string(impostor);
      const std::vector<unsigned char> want =
          Contributions(ReduceOp::kMax, DataType::kF32, root, kCount);
      std::vector<std::string> wrong(world);
      const auto deadline = DeadlineIn(10s);
      auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
        const int r = p2p.rank();
        if (r == root) std::this_thread::sleep_for(200ms);
        if (r == (impostor + 1) % world) std::this_thread::sleep_for(100ms);
        const std::vector<unsigned char> send =
            Contributions(ReduceOp::kMax, DataType::kF32, r, kCount);
        std::vector<unsigned char> recv(kCount * sizeof(float), 0);
        CollectiveArgs args;
        args.send = send.data();
        args.recv = recv.data();
        args.count = kCount;
        args.dtype = DataType::kF32;
        args.root = r == impostor ? impostor : root;
        args.deadline = deadline;
        DDP_RETURN_IF_ERROR(Broadcast(p2p, args));
        wrong[r] = Compare(DataType::kF32, recv.data(), want.data(), kCount);
        return Status();
      });
      EXPECT_LT(Clock::now() + 8s, deadline) << what;
      int named = 0;
      for (int r = 0; r < world; ++r) {
        EXPECT_FALSE(statuses[r].ok()) << what << " rank " << r << " returned OK"
                                       << (wrong[r].empty() ? "" : " with wrong data: " + wrong[r]);
        named += statuses[r].message().find("disagree") != std::string::npos;
      }
      EXPECT_GT(named, 0) << what;
    }
  }
}

// One rank passes another root, count or dtype than the rest, at every
// place of a 5- and a 6-rank tree and chain. Every rank must fail, at once,
// naming a rank that differs and both values, and no receive buffer may
// have been written. Ranks checked only their neighbours: without the
// harness killing failed ranks, those farther from the odd one returned OK
// with the root's data (5 ranks, roots 0, 0, 3, 0, 0: the root and rank 2,
// a leaf under it, whose own neighbours agreed), and with it, the others
// failed as PEER_LOST, not naming the disagreement. Every rank must learn
// of it from the check itself, not from a peer's death.
TEST(BroadcastTest, OneRankDisagreeingFailsEveryRankNamingIt) {
  enum class Odd { kRoot, kCount, kDtype };
  for (bool kill : {true, false}) {
    for (int world : {5, 6}) {
      for (bool chain : {false, true}) {
        for (int root : {0, world - 2}) {
          for (int odd = 0; odd < world; ++odd) {
            for (Odd differs : {Odd::kRoot, Odd::kCount, Odd::kDtype}) {
              // A chain needs at least as many chunks as ranks: 16 floats
              // in 4-byte chunks; the tree gets them in one chunk.
              constexpr size_t kCount = 16;
              const size_t chunk = chain ? 4 : 0;
              const int odd_root = odd == root ? (root + 3) % world : odd;
              const size_t odd_count = kCount + 1;
              const DataType odd_dtype = DataType::kI32;  // the size of f32
              std::string want_odd, want_rest;
              switch (differs) {
                case Odd::kRoot:
                  want_odd = "root " + std::to_string(odd_root);
                  want_rest = "root " + std::to_string(root);
                  break;
                case Odd::kCount:
                  want_odd = "count " + std::to_string(odd_count) + " of f32";
                  want_rest = "count " + std::to_string(kCount) + " of f32";
                  break;
                case Odd::kDtype:
                  want_odd = "of i32";
                  want_rest = "of f32";
                  break;
              }
              const std::string what =
                  std::string(kill ? "" : "no kill, ") + "world=" + std::to_string(world) +
                  (chain ? " chain" : " tree") + " root=" + std::to_string(root) +
                  " odd rank " + std::to_string(odd) + " passed " + want_odd;
              std::vector<int> written(world, 0);
              const auto deadline = DeadlineIn(10s);
              ::ddp::transport::testing::HarnessOptions options;
              options.kill_on_error = kill;
              auto statuses = RunRanks(
                  world,
                  [&](p2p::PointToPoint& p2p) -> Status {
                    const int r = p2p.rank();
                    std::vector<float> send(kCount + 1, 1.0f);
                    std::vector<float> recv(kCount + 1, -1.0f);
                    CollectiveArgs args;
                    args.send = send.data();
                    args.recv = recv.data();
                    args.count = kCount;
                    args.dtype = DataType::kF32;
                    args.root = root;
                    args.deadline = deadline;
                    args.tuning.chunk_bytes = chunk;
                    if (r == odd && differs == Odd::kRoot) args.root = odd_root;
                    if (r == odd && differs == Odd::kCount) args.count = odd_count;
                    if (r == odd && differs == Odd::kDtype) args.dtype = odd_dtype;
                    Status status = Broadcast(p2p, args);
                    for (float x : recv) written[r] += x != -1.0f;
                    return status;
                  },
                  options);
              EXPECT_LT(Clock::now() + 8s, deadline) << what;
              testing::ExpectEveryRankNamesTheOddRank(statuses, odd, want_odd, want_rest, written, what);
              // The first case that fails says enough; the rest would
              // repeat it, some waiting for their deadline.
              if (HasFailure()) return;
            }
          }
        }
      }
    }
  }
}

// An empty call on one rank fails every rank at once with both counts, with
// or without the harness killing failed ranks (it used to fail only the
// empty rank and those that compared with it; the rest waited for data
// until the deadline, or returned OK).
TEST(BroadcastTest, EmptyCallOnOneRankFailsEveryRank) {
  for (bool kill : {true, false}) {
    for (int odd : {0, 3}) {
      const std::string what = std::string(kill ? "" : "no kill, ") + "empty on rank " +
                               std::to_string(odd);
      const auto deadline = DeadlineIn(10s);
      ::ddp::transport::testing::HarnessOptions options;
      options.kill_on_error = kill;
      auto statuses = RunRanks(
          5,
          [&](p2p::PointToPoint& p2p) -> Status {
            std::vector<float> buf(16, 1.0f);
            CollectiveArgs args;
            args.send = buf.data();
            args.recv = buf.data();
            args.count = p2p.rank() == odd ? 0 : buf.size();
            args.deadline = deadline;
            return Broadcast(p2p, args);
          },
          options);
      EXPECT_LT(Clock::now() + 8s, deadline) << what;
      for (int r = 0; r < 5; ++r) {
        EXPECT_THAT(statuses[r].message(), HasSubstr("count 0 of f32")) << what << ": rank " << r;
        EXPECT_THAT(statuses[r].message(), HasSubstr("count 16 of f32")) << what << ": rank " << r;
      }
      if (HasFailure()) return;
    }
  }
}

// Ranks 0 to 2 of 4 in a broadcast while rank 3 runs a ring all-reduce at
// the same tag and call id, nobody killed. Rank 0 finds the ring rank in
// its first round and fails at once, and rank 2 hears of it in its second;
// rank 1's second round comes from rank 3, which never sends it, and
// rank 1, whose own rounds all agreed, waited for it until its deadline
// (TIMED_OUT, naming nothing that differed). Now the rank that finds a
// disagreement also sends it around the ring in a stop note, so every
// rank fails at once naming both collectives. The 30 s deadline and 15 s
// bound leave room for a loaded host.
TEST(BroadcastTest, ARankInAnotherCollectiveStopsEveryBroadcastRank) {
  constexpr int kWorld = 4;
  testing::ExpectOddCollectiveStopsEveryRank(
      kWorld, /*odd=*/kWorld - 1,
      [](p2p::PointToPoint& p2p, CollectiveArgs args) {
        std::vector<float> in(8, 1.0f), out(8);
        args.send = in.data();
        args.recv = out.data();
        args.count = in.size();
        return RingAllReduce(p2p, args);
      },
      "ring all-reduce",
      [](p2p::PointToPoint& p2p, CollectiveArgs args) {
        std::vector<float> in(8, 1.0f);
        args.send = in.data();
        args.recv = in.data();
        args.count = in.size();
        return Broadcast(p2p, args);
      },
      "broadcast, count 8 of f32");
}

TEST(BroadcastTest, KilledRootFailsEveryOtherRank) {
  p2p::LoopbackHub hub(5);
  const auto deadline = DeadlineIn(20s);
  auto statuses = ::ddp::transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
    if (p2p.rank() == 0) {
      std::this_thread::sleep_for(50ms);
      hub.Kill(0);
      return AbortedError("killed");
    }
    std::vector<float> buf(1000);
    CollectiveArgs args;
    args.recv = buf.data();
    args.count = buf.size();
    args.deadline = deadline;
    args.tuning.chunk_bytes = 64;
    return Broadcast(p2p, args);
  });
  EXPECT_LT(Clock::now() + 15s, deadline);
  for (int r = 1; r < 5; ++r) {
    EXPECT_TRUE(statuses[r].code() == StatusCode::kPeerLost ||
                statuses[r].code() == StatusCode::kTimedOut)
        << "rank " << r << ": " << statuses[r];
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
