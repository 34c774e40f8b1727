#include "transport/algorithms/rooted_reduce.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/algorithms/disagreement_test_util.h"
#include "transport/algorithms/pipeline.h"
#include "transport/algorithms/rhd_all_reduce.h"
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

// Ends the waits of the ranks a case does not check once every rank it
// checks has returned: from then on each rank that has returned is killed,
// as a failed process exits, so that a peer still waiting for it fails with
// PEER_LOST at once instead of at its deadline. Every checked rank's result
// is in before the first kill, so no checked rank sees one; a returned rank
// has no message left to give, so a waiting rank's outcome is the same
// failure it would reach at its deadline, only sooner.
class KillOnceCheckedReturned {
 public:
  KillOnceCheckedReturned(p2p::LoopbackHub& hub, std::vector<char> checked)
      : hub_(hub), checked_(std::move(checked)), returned_(checked_.size(), 0) {
    for (char c : checked_) checked_running_ += c ? 1 : 0;
  }

  /// Called by each rank as its collective returns.
  void Returned(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    returned_[rank] = 1;
    if (checked_[rank]) --checked_running_;
    if (checked_running_ > 0) return;
    for (size_t r = 0; r < returned_.size(); ++r) {
      if (returned_[r]) hub_.Kill(static_cast<int>(r));  // idempotent
    }
  }

 private:
  p2p::LoopbackHub& hub_;
  const std::vector<char> checked_;
  std::mutex mu_;
  std::vector<char> returned_;
  int checked_running_ = 0;
};

constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin,
                                ReduceOp::kProd};

struct Case {
  int world = 1;
  int root = 0;
  size_t count = 0;
  DataType dtype = DataType::kF32;
  ReduceOp op = ReduceOp::kSum;
  Algorithm algorithm = Algorithm::kAuto;
  bool in_place = false;
  size_t chunk_bytes = 0;
  std::string Describe() const {
    return "world=" + std::to_string(world) + " root=" + std::to_string(root) +
           " count=" + std::to_string(count) + " " + DataTypeName(dtype) + " " +
           ReduceOpName(op) + " " + AlgorithmName(algorithm) + (in_place ? " in-place" : "") +
           " chunk=" + std::to_string(chunk_bytes);
  }
};

// Every rank reduces Contributions to the root; the root's recv must equal
// the closed form bit for bit and nothing past it may change; the other
// ranks pass a null recv and must leave their send untouched.
void Check(const Case& c) {
  const size_t es = DataTypeSize(c.dtype);
  const std::vector<unsigned char> want = Expectations(c.op, c.dtype, c.world, c.count);
  std::vector<std::string> wrong(c.world);
  auto statuses = RunRanks(c.world, [&](p2p::PointToPoint& p2p) -> Status {
    const int r = p2p.rank();
    const std::vector<unsigned char> input = Contributions(c.op, c.dtype, r, c.count);
    std::vector<unsigned char> send(input);
    send.push_back(0x5A);
    std::vector<unsigned char> recv(c.count * es + 1, 0x5A);
    const bool is_root = r == c.root;
    CollectiveArgs args;
    args.send = is_root && c.in_place ? recv.data() : send.data();
    if (is_root && c.in_place && c.count > 0) std::memcpy(recv.data(), input.data(), c.count * es);
    args.recv = is_root ? recv.data() : nullptr;
    args.count = c.count;
    args.dtype = c.dtype;
    args.op = c.op;
    args.root = c.root;
    args.deadline = DeadlineIn(30s);
    args.tuning.chunk_bytes = c.chunk_bytes;
    DDP_RETURN_IF_ERROR(Reduce(p2p, args, c.algorithm));
    if (is_root) {
      wrong[r] = Compare(c.dtype, recv.data(), want.data(), c.count);
      if (recv[c.count * es] != 0x5A) wrong[r] = "wrote past the end of recv";
    }
    if (!c.in_place || !is_root) {
      if (Compare(c.dtype, send.data(), input.data(), c.count) != "" || send.back() != 0x5A) {
        wrong[r] = "changed its send buffer";
      }
    }
    return Status();
  });
  for (int r = 0; r < c.world; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << c.Describe() << " rank " << r << ": " << statuses[r];
    EXPECT_EQ(wrong[r], "") << c.Describe() << " rank " << r;
  }
}

class ReduceWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(ReduceWorldTest, EveryRootCountAndAlgorithm) {
  const int world = GetParam();
  for (Algorithm algorithm : {Algorithm::kTree, Algorithm::kRing, Algorithm::kAuto}) {
    for (int root = 0; root < world; ++root) {
      for (size_t count : {size_t{0}, size_t{1}, static_cast<size_t>(world - 1),
                           static_cast<size_t>(world + 2), size_t{37}}) {
        // Default chunks: one chunk. 8-byte chunks: many, through the
        // pipelined paths.
        for (size_t chunk : {size_t{0}, size_t{8}}) {
          Check({.world = world, .root = root, .count = count, .dtype = DataType::kF32,
                 .op = ReduceOp::kSum, .algorithm = algorithm, .in_place = root % 2 == 1,
                 .chunk_bytes = chunk});
        }
      }
    }
  }
}

TEST_P(ReduceWorldTest, EveryTypeAndOp) {
  const int world = GetParam();
  for (Algorithm algorithm : {Algorithm::kTree, Algorithm::kRing}) {
    for (DataType dtype : kAllDataTypes) {
      for (ReduceOp op : kAllOps) {
        Check({.world = world, .root = world / 2, .count = 19, .dtype = dtype, .op = op,
               .algorithm = algorithm, .in_place = false, .chunk_bytes = 4});
        Check({.world = world, .root = world - 1, .count = 19, .dtype = dtype, .op = op,
               .algorithm = algorithm, .in_place = true, .chunk_bytes = 0});
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReduceWorldTest,
                         ::testing::Values(1, 2, 3, 4, 5, 6, 7, 8, 9, 16));

TEST(ReduceTest, TheTreeTakesShortVectorsTheRingLongOnes) {
  EXPECT_EQ(ChooseReduce(0), Algorithm::kTree);
  EXPECT_EQ(ChooseReduce(kTreeReduceMaxBytes), Algorithm::kTree);
  EXPECT_EQ(ChooseReduce(kTreeReduceMaxBytes + 1), Algorithm::kRing);
}

// No rank holds more than twice a pipeline's depth of chunks per child as
// unexpected messages (plus the argument check's fingerprints): a leaf of
// the tree posted every chunk at once.
TEST(ReduceTest, TheTreesChunksInFlightAreBoundedByThePipelineDepth) {
  constexpr int kDepth = 4, kWorld = 5;
  constexpr size_t kCount = size_t{1} << 18;
  p2p::LoopbackHub hub(kWorld);
  const std::vector<float> in(kCount, 1.0f);
  std::vector<float> out(kCount);
  auto statuses = RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
    CollectiveArgs args;
    args.send = in.data();
    args.recv = p2p.rank() == 0 ? out.data() : nullptr;
    args.count = kCount;
    args.dtype = DataType::kF32;
    args.op = ReduceOp::kSum;
    args.root = 0;
    args.tag = CollectiveTag(9);
    args.deadline = DeadlineIn(60s);
    args.tuning.chunk_bytes = 1024;
    args.tuning.pipeline_depth = kDepth;
    return TreeReduce(p2p, args);
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << statuses[r];
    // A binomial tree of 5: the root has 3 children.
    EXPECT_LE(hub.Stats(r).peak_unexpected_sends, uint64_t{3 * 2 * kDepth + 4}) << "rank " << r;
  }
  EXPECT_EQ(out[0], 5.0f);
  EXPECT_EQ(out[kCount - 1], 5.0f);
}

TEST(ReduceTest, LargeVectors) {
  // Across the automatic switch point, both sides.
  const size_t just_over = kTreeReduceMaxBytes / 4 + 1;
  Check({.world = 5, .root = 3, .count = just_over, .op = ReduceOp::kAvg});
  Check({.world = 3, .root = 0, .count = kTreeReduceMaxBytes / 4, .op = ReduceOp::kMax,
         .in_place = true});
  Check({.world = 4, .root = 1, .count = (1 << 20) + 3, .algorithm = Algorithm::kRing});
  Check({.world = 4, .root = 2, .count = (1 << 18) + 1, .dtype = DataType::kBF16,
         .algorithm = Algorithm::kTree, .in_place = true});
}

// chunk_bytes near SIZE_MAX with u8: the chunk count used to be
// (n + ce - 1) / ce, which wraps to 0, so the call returned OK having moved
// nothing.
TEST(ReduceTest, HugeChunkBytesStillReduce) {
  for (size_t chunk : {~size_t{0}, ~size_t{0} - 1}) {
    for (Algorithm algorithm : {Algorithm::kTree, Algorithm::kRing}) {
      Check({.world = 4, .root = 1, .count = 1000, .dtype = DataType::kU8, .op = ReduceOp::kSum,
             .algorithm = algorithm, .chunk_bytes = chunk});
      Check({.world = 3, .root = 2, .count = 37, .dtype = DataType::kU8, .op = ReduceOp::kMax,
             .algorithm = algorithm, .in_place = true, .chunk_bytes = chunk});
    }
  }
}

TEST(ReduceTest, RootOutOfRangeIsNamedOnEveryRank) {
  for (int root : {3, -1}) {
    auto statuses = RunRanks(3, [&](p2p::PointToPoint& p2p) -> Status {
      std::vector<float> buf(4);
      CollectiveArgs args;
      args.send = buf.data();
      args.recv = buf.data();
      args.count = buf.size();
      args.root = root;
      args.deadline = DeadlineIn(5s);
      return Reduce(p2p, args, Algorithm::kAuto);
    });
    for (const Status& s : statuses) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_THAT(s.message(),
                  HasSubstr("reduce: root " + std::to_string(root) + " is outside [0, 3)"));
    }
  }
}

TEST(ReduceTest, NullBuffersAreNamedWhereTheyMatter) {
  auto statuses = RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> buf(4);
    CollectiveArgs args;
    args.send = p2p.rank() == 1 ? nullptr : buf.data();
    args.recv = nullptr;  // wrong on the root only
    args.count = buf.size();
    args.deadline = DeadlineIn(5s);
    return Reduce(p2p, args, Algorithm::kTree);
  });
  EXPECT_THAT(statuses[0].message(), HasSubstr("recv buffer is null"));
  EXPECT_THAT(statuses[1].message(), HasSubstr("send buffer is null"));
}

TEST(ReduceTest, PartialOverlapOnTheRootIsRefused) {
  auto statuses = RunRanks(1, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> buf(8);
    CollectiveArgs args;
    args.send = buf.data();
    args.recv = buf.data() + 1;
    args.count = 4;
    args.deadline = DeadlineIn(5s);
    return Reduce(p2p, args, Algorithm::kAuto);
  });
  EXPECT_THAT(statuses[0].message(), HasSubstr("partially overlap"));
}

// A rank passing another count, or another root, fails at once (its ring
// successor names both values), not at the deadline.
TEST(ReduceTest, RanksDisagreeingOnCountOrRootFailFast) {
  for (Algorithm algorithm : {Algorithm::kTree, Algorithm::kRing}) {
    for (bool root_differs : {false, true}) {
      const auto deadline = DeadlineIn(10s);
      auto statuses = RunRanks(4, [&](p2p::PointToPoint& p2p) -> Status {
        std::vector<float> send(64, 1.0f), recv(64);
        CollectiveArgs args;
        args.send = send.data();
        args.recv = recv.data();
        args.count = !root_differs && p2p.rank() == 2 ? 48 : 64;
        args.root = root_differs && p2p.rank() == 2 ? 1 : 0;
        args.deadline = deadline;
        args.tuning.chunk_bytes = 16;
        return Reduce(p2p, args, algorithm);
      });
      const std::string what = std::string(AlgorithmName(algorithm)) +
                               (root_differs ? " root" : " count");
      EXPECT_LT(Clock::now() + 8s, deadline) << what;
      EXPECT_FALSE(statuses[2].ok()) << what;
      int named = 0;
      for (const Status& s : statuses) named += s.message().find("disagree") != std::string::npos;
      EXPECT_GT(named, 0) << what;
      EXPECT_FALSE(statuses[0].ok()) << what << ": the root returned " << statuses[0];
    }
  }
}

// A leaf that passes another dtype of the same size (the tree's messages
// fit) fails on every rank, the root included: the root checks each child
// whose data it folds, not only its ring predecessor. 3 ranks, root 0:
// rank 1 is a leaf under the root and rank 0's ring predecessor is rank 2,
// so before the children were checked the root folded rank 1's bits as its
// own dtype and returned OK. The root's fingerprint receives are posted
// before it sends its own, which rank 1 (and through it rank 2) must see
// before failing, so the root always gets both fingerprints (no rank is
// killed on error: a killed rank 1 could fail rank 2 before rank 2 sent
// its own; rank 2 may then wait for rank 1's until the short deadline).
// Ranks 1 and 2 start with a head start for the root, not needed by the
// check: it is what let their data reach the root before they failed.
TEST(ReduceTest, ChildWithAnotherDtypeOfTheSameSizeFailsTheRoot) {
  const std::pair<DataType, DataType> pairs[] = {{DataType::kF16, DataType::kBF16},
                                                 {DataType::kF32, DataType::kI32}};
  for (const auto& [agreed, odd] : pairs) {
    const std::string what = std::string(DataTypeName(odd)) + " among " + DataTypeName(agreed);
    const auto deadline = DeadlineIn(5s);
    std::atomic<bool> root_started{false};
    auto statuses = RunRanks(3, [&](p2p::PointToPoint& p2p) -> Status {
      const int r = p2p.rank();
      if (r == 0) {
        root_started = true;
      } else {
        while (!root_started && Clock::now() < deadline) std::this_thread::yield();
        std::this_thread::sleep_for(100ms);
      }
      std::vector<float> send(16, 1.0f), recv(16, 0.0f);
      CollectiveArgs args;
      args.send = send.data();
      args.recv = r == 0 ? recv.data() : nullptr;
      args.count = 16 * sizeof(float) / DataTypeSize(agreed);
      args.dtype = r == 1 ? odd : agreed;
      args.op = ReduceOp::kSum;
      args.root = 0;
      args.deadline = deadline;
      return Reduce(p2p, args, Algorithm::kTree);
    }, {.kill_on_error = false});
    for (int r = 0; r < 3; ++r) EXPECT_FALSE(statuses[r].ok()) << what << ": rank " << r;
    EXPECT_EQ(statuses[0].code(), StatusCode::kInvalidArgument) << what << ": " << statuses[0];
    EXPECT_THAT(statuses[0].message(), HasSubstr("rank 1 passed tree reduce")) << what;
    EXPECT_THAT(statuses[0].message(), HasSubstr(DataTypeName(odd))) << what;
  }
}

// One rank passes another root, count, op or dtype of the same size to the
// tree reduce, at every place of 5 and 6 ranks: every rank fails at once,
// naming a rank that differs and both values, and the root's recv is not
// written. Ranks checked their ring predecessor and their children: without
// the harness killing failed ranks, leaves whose checks passed sent their
// data and returned OK while the root failed. Run without the kill too:
// every rank must learn of it from the check, not from a peer's death.
TEST(ReduceTest, OneRankDisagreeingFailsEveryRankOfTheTreeNamingIt) {
  enum class Odd { kRoot, kCount, kOp, kDtype };
  for (bool kill : {true, false}) {
    for (int world : {5, 6}) {
      for (int root : {0, world - 2}) {
        for (int odd = 0; odd < world; ++odd) {
          for (Odd differs : {Odd::kRoot, Odd::kCount, Odd::kOp, Odd::kDtype}) {
            constexpr size_t kCount = 16;
            const int odd_root = odd == root ? (root + 3) % world : odd;
            std::string want_odd, want_rest;
            switch (differs) {
              case Odd::kRoot:
                want_odd = "root " + std::to_string(odd_root);
                want_rest = "root " + std::to_string(root);
                break;
              case Odd::kCount:
                want_odd = "count " + std::to_string(kCount + 1) + " of f32";
                want_rest = "count " + std::to_string(kCount) + " of f32";
                break;
              case Odd::kOp:
                want_odd = "op max";
                want_rest = "op sum";
                break;
              case Odd::kDtype:
                want_odd = "of i32";
                want_rest = "of f32";
                break;
            }
            const std::string what = std::string(kill ? "" : "no kill, ") + "world=" +
                                     std::to_string(world) + " root=" + std::to_string(root) +
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
                  args.op = ReduceOp::kSum;
                  args.root = root;
                  args.deadline = deadline;
                  if (r == odd && differs == Odd::kRoot) args.root = odd_root;
                  if (r == odd && differs == Odd::kCount) args.count = kCount + 1;
                  if (r == odd && differs == Odd::kOp) args.op = ReduceOp::kMax;
                  if (r == odd && differs == Odd::kDtype) args.dtype = DataType::kI32;
                  Status status = TreeReduce(p2p, args);
                  for (float x : recv) written[r] += x != -1.0f;
                  return status;
                },
                options);
            EXPECT_LT(Clock::now() + 8s, deadline) << what;
            testing::ExpectEveryRankNamesTheOddRank(statuses, odd, want_odd, want_rest, written, what);
            // The first case that fails says enough; the rest would repeat
            // it, some waiting for their deadline.
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

// The ring reduce keeps its ring check: one rank passing another root,
// count, op or dtype of the same size, at every place of 5 and 6 ranks,
// still makes every rank fail (at once with the harness killing failed
// ranks; without, by the deadline at the latest: the ranks not next to the
// odd one fail on the stop note, or, when they entered after it passed,
// wait for blocks that never come).
TEST(ReduceTest, OneRankDisagreeingFailsEveryRankOfTheRing) {
  enum class Odd { kRoot, kCount, kOp, kDtype };
  for (bool kill : {true, false}) {
    for (int world : {5, 6}) {
      if (!kill && world != 5) continue;  // short deadlines, one world: keeps it short
      for (int odd = 0; odd < world; ++odd) {
        for (Odd differs : {Odd::kRoot, Odd::kCount, Odd::kOp, Odd::kDtype}) {
          const std::string what = std::string(kill ? "" : "no kill, ") + "world=" +
                                   std::to_string(world) + " odd rank " + std::to_string(odd) +
                                   " differs in " + std::to_string(static_cast<int>(differs));
          const auto timeout = kill ? Clock::duration(10s) : Clock::duration(300ms);
          std::vector<Clock::duration> took(world);
          ::ddp::transport::testing::HarnessOptions options;
          options.kill_on_error = kill;
          auto statuses = RunRanks(
              world,
              [&](p2p::PointToPoint& p2p) -> Status {
                const int r = p2p.rank();
                std::vector<float> send(41, 1.0f), recv(41);
                CollectiveArgs args;
                args.send = send.data();
                args.recv = recv.data();
                args.count = r == odd && differs == Odd::kCount ? 41 : 40;
                args.dtype = r == odd && differs == Odd::kDtype ? DataType::kI32 : DataType::kF32;
                args.op = r == odd && differs == Odd::kOp ? ReduceOp::kMax : ReduceOp::kSum;
                // The odd rank takes itself for the root (rank 0, the root,
                // takes rank 2).
                args.root = r == odd && differs == Odd::kRoot ? (odd == 0 ? 2 : odd) : 0;
                args.tuning.chunk_bytes = 16;
                const auto start = Clock::now();
                args.deadline = start + timeout;
                Status status = RingReduce(p2p, args);
                took[r] = Clock::now() - start;
                return status;
              },
              options);
          for (int r = 0; r < world; ++r) {
            EXPECT_FALSE(statuses[r].ok()) << what << ": rank " << r << " returned OK";
            EXPECT_LT(took[r], kill ? Clock::duration(2s) : timeout + 2s)
                << what << ": rank " << r << ": " << statuses[r];
          }
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(ReduceTest, EmptyCallOnOneRankFailsFast) {
  const auto deadline = DeadlineIn(10s);
  auto statuses = RunRanks(3, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> buf(16, 1.0f);
    CollectiveArgs args;
    args.send = buf.data();
    args.recv = buf.data();
    args.count = p2p.rank() == 1 ? 0 : buf.size();
    args.deadline = deadline;
    return Reduce(p2p, args, Algorithm::kAuto);
  });
  EXPECT_LT(Clock::now() + 8s, deadline);
  EXPECT_FALSE(statuses[1].ok());
  EXPECT_FALSE(statuses[0].ok());
}

// One rank passes count 0 to a reduce of a short vector (the tree, chosen
// or forced), at every place of 5 and 6 ranks, with nobody killed: every
// rank fails well before its deadline, naming the empty rank and both
// counts, and no recv is written. The count-0 call used to send each rank
// a lone fingerprint, which the tree ranks' check (CheckEveryRank) never
// takes, so the ranks expecting a later round's message from the empty
// rank waited for their deadline.
TEST(ReduceTest, EmptyCallOnOneRankFailsEveryRankOfTheTreeAtOnce) {
  constexpr size_t kCount = 16;
  for (Algorithm algorithm : {Algorithm::kAuto, Algorithm::kTree}) {
    for (int world : {5, 6}) {
      for (int empty = 0; empty < world; ++empty) {
        const std::string what = std::string(AlgorithmName(algorithm)) +
                                 " world=" + std::to_string(world) + " empty rank " +
                                 std::to_string(empty);
        const auto timeout = Clock::duration(5s);
        std::vector<Clock::duration> took(world);
        std::vector<int> written(world, 0);
        ::ddp::transport::testing::HarnessOptions options;
        options.kill_on_error = false;
        auto statuses = RunRanks(
            world,
            [&](p2p::PointToPoint& p2p) -> Status {
              const int r = p2p.rank();
              std::vector<float> send(kCount, 1.0f), recv(kCount, -1.0f);
              CollectiveArgs args;
              args.send = send.data();
              args.recv = recv.data();
              args.count = r == empty ? 0 : kCount;
              args.root = 1;
              const auto start = Clock::now();
              args.deadline = start + timeout;
              Status status = Reduce(p2p, args, algorithm);
              took[r] = Clock::now() - start;
              for (float x : recv) written[r] += x != -1.0f;
              return status;
            },
            options);
        for (int r = 0; r < world; ++r) {
          const Status& s = statuses[r];
          EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": rank " << r << ": " << s;
          EXPECT_THAT(s.message(), HasSubstr("rank " + std::to_string(empty) +
                                             " passed tree reduce, count 0 of f32"))
              << what << ": rank " << r;
          EXPECT_THAT(s.message(), HasSubstr("count " + std::to_string(kCount) + " of f32"))
              << what << ": rank " << r;
          EXPECT_LT(took[r], 2s) << what << ": rank " << r << ": " << s;
          EXPECT_EQ(written[r], 0) << what << ": rank " << r << " had its recv written";
        }
        // The first case that fails says enough; the rest would repeat it,
        // each waiting for its deadline.
        if (HasFailure()) return;
      }
    }
  }
}

// Under the automatic choice, one rank whose count puts it on the other
// side of kTreeReduceMaxBytes runs the other algorithm: the tree (count 0
// or a short vector) among ring ranks, or the ring among tree ranks, at
// every place of 3, 5 and 8 ranks, with nobody killed. The tree ranks and
// the ring ranks next to a tree rank fail well before the deadline, naming
// the odd rank and both counts, and no tree rank's recv is written. The
// ring ranks further on fail on the stop note (Requests::RelayStops), or,
// when they entered after it passed, wait for blocks that never come (the
// communicator's abort ends that wait; here KillOnceCheckedReturned does,
// once the checked ranks have returned): not checked here. The tree ranks'
// check (CheckEveryRank) waited for later rounds from ring ranks, which
// sent only their ring check, so a lone tree rank among ring ranks, and
// tree ranks two or more places after a lone ring rank, waited for their
// deadline.
TEST(ReduceTest, RanksChoosingTheTreeAndTheRingFailFast) {
  constexpr size_t kLong = kTreeReduceMaxBytes / sizeof(float) + 1;  // the ring
  struct Mix {
    size_t odd_count, rest_count;
  };
  const Mix mixes[] = {{0, kLong}, {16, kLong}, {kLong, 16}};
  // With a call id the tree ranks' check also takes the ring ranks' stop
  // notes (CheckEveryRank); one that did returned at once, leaving the
  // rounds it had not sent, and ranks waiting for them hit their deadline.
  for (uint64_t call_id : {uint64_t{0}, uint64_t{5}})
  for (const Mix& mix : mixes) {
    for (int world : {3, 5, 8}) {
      for (int odd = 0; odd < world; ++odd) {
        const std::string what = "call id " + std::to_string(call_id) + ", world=" +
                                 std::to_string(world) + " rank " + std::to_string(odd) +
                                 " count " + std::to_string(mix.odd_count) + ", the others " +
                                 std::to_string(mix.rest_count);
        std::vector<Clock::duration> took(world);
        std::vector<int> written(world, 0);
        // Which ranks run the tree, and which can know of the mismatch: a
        // tree rank, or a ring rank whose predecessor runs the tree. The
        // others only wait for blocks that never come, until the ranks that
        // know have returned and are killed (a shorter deadline for them
        // is the backstop).
        std::vector<char> tree(world, 0), knows(world, 0);
        for (int r = 0; r < world; ++r) {
          tree[r] = ChooseReduce((r == odd ? mix.odd_count : mix.rest_count) * sizeof(float)) == Algorithm::kTree;
        }
        for (int r = 0; r < world; ++r) knows[r] = tree[r] || tree[(r + world - 1) % world];
        ::ddp::transport::testing::HarnessOptions options;
        options.kill_on_error = false;
        p2p::LoopbackHub hub(world);
        KillOnceCheckedReturned ender(hub, knows);
        auto statuses = RunRanks(
            hub,
            [&](p2p::PointToPoint& p2p) -> Status {
              const int r = p2p.rank();
              const size_t count = r == odd ? mix.odd_count : mix.rest_count;
              std::vector<float> send(count, 1.0f), recv(count, -1.0f);
              CollectiveArgs args;
              args.send = send.data();
              args.recv = recv.data();
              args.count = count;
              args.root = world - 1;
              args.call_id = call_id;
              const auto start = Clock::now();
              args.deadline = start + (knows[r] ? Clock::duration(4s) : Clock::duration(1500ms));
              Status status = Reduce(p2p, args, Algorithm::kAuto);
              took[r] = Clock::now() - start;
              for (float x : recv) written[r] += x != -1.0f;
              ender.Returned(r);
              return status;
            },
            options);
        for (int r = 0; r < world; ++r) {
          const Status& s = statuses[r];
          EXPECT_FALSE(s.ok()) << what << ": rank " << r << " returned OK";
          if (!knows[r]) continue;
          EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": rank " << r << ": " << s;
          EXPECT_THAT(s.message(), HasSubstr("rank " + std::to_string(odd) + " passed"))
              << what << ": rank " << r;
          EXPECT_THAT(s.message(), HasSubstr("count " + std::to_string(mix.odd_count) + " of f32"))
              << what << ": rank " << r;
          EXPECT_THAT(s.message(), HasSubstr("count " + std::to_string(mix.rest_count) + " of f32"))
              << what << ": rank " << r;
          EXPECT_LT(took[r], 2s) << what << ": rank " << r << ": " << s;
          if (tree[r]) {
            EXPECT_EQ(written[r], 0) << what << ": rank " << r << " had its recv written";
          }
        }
        // The first case that fails says enough; the rest would repeat it,
        // each waiting for its deadline.
        if (HasFailure()) return;
      }
    }
  }
}

// A rank of another collective that takes no part in the tree reduce's
// check rounds, among ring reduce ranks, nobody killed: rank 0 of 5 runs
// the halving-doubling all-reduce, where it hands its data to rank 1 and
// checks nobody. Rank 1 fails at once, naming it. The ring reduce ranks
// also send the tree reduce's later check rounds (PostEveryRankRounds); a
// failed one waited for them to be taken, which rank 0 never does, until
// its deadline. The other ranks only have to fail: once rank 1 has
// returned, KillOnceCheckedReturned ends their waits.
TEST(ReduceTest, ARankOfAnotherCollectiveAmongRingReduceRanksFailsItsSuccessorAtOnce) {
  constexpr int kWorld = 5;
  std::vector<Clock::duration> took(kWorld);
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  p2p::LoopbackHub hub(kWorld);
  KillOnceCheckedReturned ender(hub, {0, 1, 0, 0, 0});
  auto statuses = RunRanks(
      hub,
      [&](p2p::PointToPoint& p2p) -> Status {
        std::vector<float> send(70000, 1.0f), recv(send.size());
        CollectiveArgs args;
        args.send = send.data();
        args.recv = recv.data();
        args.count = send.size();
        const auto start = Clock::now();
        args.deadline = start + 4s;
        Status status = p2p.rank() == 0 ? RhdAllReduce(p2p, args) : RingReduce(p2p, args);
        took[p2p.rank()] = Clock::now() - start;
        ender.Returned(p2p.rank());
        return status;
      },
      options);
  const Status& s = statuses[1];
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 0 passed rhd all-reduce"));
  EXPECT_LT(took[1], 2s) << s;
  for (int r = 0; r < kWorld; ++r) EXPECT_FALSE(statuses[r].ok()) << "rank " << r;
}

TEST(ReduceTest, KilledRankFailsTheRoot) {
  for (Algorithm algorithm : {Algorithm::kTree, Algorithm::kRing}) {
    p2p::LoopbackHub hub(5);
    const auto deadline = DeadlineIn(20s);
    auto statuses = RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
      if (p2p.rank() == 3) {
        std::this_thread::sleep_for(50ms);
        hub.Kill(3);
        return AbortedError("killed");
      }
      std::vector<float> send(1000, 1.0f), recv(1000);
      CollectiveArgs args;
      args.send = send.data();
      args.recv = recv.data();
      args.count = send.size();
      args.deadline = deadline;
      args.tuning.chunk_bytes = 64;
      return Reduce(p2p, args, algorithm);
    });
    EXPECT_LT(Clock::now() + 15s, deadline);
    EXPECT_TRUE(statuses[0].code() == StatusCode::kPeerLost ||
                statuses[0].code() == StatusCode::kTimedOut)
        << AlgorithmName(algorithm) << ": " << statuses[0];
  }
}

TEST(ReduceTest, AbsentRankTimesOutAtTheDeadline) {
  p2p::LoopbackHub hub(3);
  const auto started = Clock::now();
  auto statuses = RunRanks(
      hub,
      [&](p2p::PointToPoint& p2p) -> Status {
        if (p2p.rank() == 2) return Status();  // never calls
        std::vector<float> buf(100, 1.0f), out(100);
        CollectiveArgs args;
        args.send = buf.data();
        args.recv = out.data();
        args.count = buf.size();
        args.deadline = DeadlineIn(300ms);
        return Reduce(p2p, args, Algorithm::kTree);
      },
      {.kill_on_error = false});
  EXPECT_LT(Clock::now() - started, 5s);
  EXPECT_EQ(statuses[0].code(), StatusCode::kTimedOut) << statuses[0];
}

// A reduce of a vector far above kScratchRetainBytes leaves no thread's
// Scratch arena holding it: the tree's inner ranks keep their partial sums
// of the whole vector, and the ring's non-roots their block, in memory that
// is freed when the call returns. (Both used to stay with the thread:
// a 4 GiB reduce left 4 GiB on every inner rank.)
TEST(RootedReduceTest, LargeReduceLeavesNoLargeScratchBehind) {
  // Tree: an inner rank (rank 2 of 4) holds partial sums of the whole vector
  // (10 MiB). Ring: each non-root holds its block, half of 18 MiB.
  const size_t cap = internal::kScratchRetainBytes;
  const struct {
    Status (*fn)(p2p::PointToPoint&, const CollectiveArgs&);
    int world;
    size_t count;
  } cases[] = {{&TreeReduce, 4, (cap + cap / 4) / sizeof(float)},
               {&RingReduce, 2, (2 * cap + cap / 4) / sizeof(float)}};
  for (const auto& c : cases) {
    std::vector<size_t> retained(c.world);
    auto statuses = RunRanks(c.world, [&](p2p::PointToPoint& p2p) -> Status {
      std::vector<float> send(c.count, 1.0f), recv(p2p.rank() == 0 ? c.count : 0);
      CollectiveArgs args;
      args.send = send.data();
      args.recv = p2p.rank() == 0 ? recv.data() : nullptr;
      args.count = c.count;
      args.root = 0;
      args.deadline = DeadlineIn(60s);
      args.tuning.chunk_bytes = 256 << 10;  // slots of at most 13 chunks: 3.25 MiB
      DDP_RETURN_IF_ERROR(c.fn(p2p, args));
      if (p2p.rank() == 0 && (recv[0] != c.world || recv[c.count - 1] != c.world)) {
        return InternalError("wrong result");
      }
      retained[p2p.rank()] = internal::ScratchRetainedBytes();
      return Status();
    });
    for (int r = 0; r < c.world; ++r) {
      ASSERT_TRUE(statuses[r].ok()) << statuses[r];
      // The reduce's chunk slots (a few MiB) may stay; the vector must not.
      EXPECT_LE(retained[r], size_t{4} << 20) << "world " << c.world << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
