#include "transport/algorithms/rhd_all_reduce.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/algorithms/all_reduce_test_util.h"
#include "transport/algorithms/ring_all_reduce.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms {
namespace {

using testing::AllReduceCase;
using testing::AllReduceFn;
using testing::CheckAllReduce;
using ::testing::HasSubstr;

// Halving-doubling for everything but 1-byte messages.
const AllReduceFn kHalving = [](p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  CollectiveArgs a = args;
  a.tuning.rhd_doubling_bytes = 1;
  return RhdAllReduce(p2p, a);
};

// Recursive doubling for every size.
const AllReduceFn kDoubling = [](p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  CollectiveArgs a = args;
  a.tuning.rhd_doubling_bytes = size_t{1} << 40;
  return RhdAllReduce(p2p, a);
};

class RhdAllReduceWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(RhdAllReduceWorldTest, CountsAndChunkingMatchClosedForm) {
  testing::SweepCounts(kHalving, GetParam());
  testing::SweepCounts(kDoubling, GetParam());
}

TEST_P(RhdAllReduceWorldTest, EveryTypeAndOp) {
  testing::SweepTypesAndOps(kHalving, GetParam(), 29, 8);
  testing::SweepTypesAndOps(kDoubling, GetParam(), 29, 0);
}

INSTANTIATE_TEST_SUITE_P(Worlds, RhdAllReduceWorldTest,
                         ::testing::Values(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16));

TEST(RhdAllReduceTest, DefaultSwitchesBetweenModesBySize) {
  // 1000 floats (4000 bytes) take recursive doubling, 10000 take halving.
  for (size_t count : {size_t{1000}, size_t{10000}}) {
    CheckAllReduce(RhdAllReduce, {5, count, DataType::kF32, ReduceOp::kAvg, false});
  }
  // Two ranks double up to 64 KiB: 10000 floats (40 KB) double, 16385
  // (just over 64 KiB) and 100000 halve.
  for (size_t count : {size_t{10000}, size_t{16384}, size_t{16385}, size_t{100000}}) {
    CheckAllReduce(RhdAllReduce, {2, count, DataType::kF32, ReduceOp::kAvg, false});
  }
}

// Recursive doubling reduces each element on both partners: they must get
// the same bits even where the order of the operands matters (max and min
// of +0 and -0).
TEST(RhdAllReduceTest, DoublingGivesEveryRankTheSameBits) {
  for (int world : {2, 3, 4, 8}) {
    for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
      constexpr size_t kCount = 40;
      std::vector<std::vector<float>> out(world, std::vector<float>(kCount));
      auto statuses = transport::testing::RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
        // Even ranks +0, odd ranks -0.
        std::vector<float> in(kCount, p2p.rank() % 2 == 0 ? 0.0f : -0.0f);
        CollectiveArgs args;
        args.send = in.data();
        args.recv = out[p2p.rank()].data();
        args.count = kCount;
        args.dtype = DataType::kF32;
        args.op = op;
        args.tag = CollectiveTag(3);
        args.deadline = DeadlineIn(std::chrono::seconds(30));
        return kDoubling(p2p, args);
      });
      for (int r = 0; r < world; ++r) ASSERT_TRUE(statuses[r].ok()) << statuses[r];
      for (int r = 1; r < world; ++r) {
        EXPECT_EQ(std::memcmp(out[r].data(), out[0].data(), kCount * sizeof(float)), 0)
            << "world " << world << " " << ReduceOpName(op) << ": rank " << r << " got "
            << (std::signbit(out[r][0]) ? "-0" : "+0") << ", rank 0 "
            << (std::signbit(out[0][0]) ? "-0" : "+0");
      }
    }
  }
}

// A world that is not a power of two folds: one rank of a pair only sends
// its vector, and got no receive to pace it, so it posted every chunk at
// once and its partner held them all as unexpected messages (4096 here).
// Now no rank has more than a pipeline's depth of them queued, plus the
// argument check's fingerprints.
TEST(RhdAllReduceTest, TheFoldsSendsAreFlowControlled) {
  constexpr size_t kCount = size_t{1} << 20;
  constexpr int kDepth = 4;
  p2p::LoopbackHub hub(3);
  const std::vector<float> in(kCount, 1.0f);
  std::vector<std::vector<float>> out(3, std::vector<float>(kCount));
  auto statuses = transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
    CollectiveArgs args;
    args.send = in.data();
    args.recv = out[p2p.rank()].data();
    args.count = kCount;
    args.dtype = DataType::kF32;
    args.op = ReduceOp::kSum;
    args.tag = CollectiveTag(5);
    args.deadline = DeadlineIn(std::chrono::seconds(60));
    args.tuning.chunk_bytes = 1024;
    args.tuning.pipeline_depth = kDepth;
    return kHalving(p2p, args);
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << statuses[r];
    EXPECT_EQ(out[r][0], 3.0f);
    EXPECT_EQ(out[r][kCount - 1], 3.0f);
    EXPECT_LE(hub.Stats(r).peak_unexpected_sends, uint64_t{2 * kDepth + 2}) << "rank " << r;
  }
}

TEST(RhdAllReduceTest, LargeVectorWithDefaultChunks) {
  CheckAllReduce(RhdAllReduce, {6, (1 << 20) + 3, DataType::kF32, ReduceOp::kSum, false});
}

// chunk_bytes near SIZE_MAX with u8: the chunk count used to be
// (n + ce - 1) / ce, which wraps to 0, so the call returned OK having moved
// nothing.
TEST(RhdAllReduceTest, HugeChunkBytesStillReduce) {
  for (size_t chunk : {~size_t{0}, ~size_t{0} - 1}) {
    CheckAllReduce(kHalving, {4, 1000, DataType::kU8, ReduceOp::kSum, false, chunk});
    CheckAllReduce(kHalving, {3, 37, DataType::kU8, ReduceOp::kMax, true, chunk});
  }
}

TEST(RhdAllReduceTest, RandomValuesGiveEveryRankTheSameBits) {
  for (int world : {2, 3, 5, 8}) {
    testing::SweepRandomValues(kHalving, world);
    testing::SweepRandomValues(kDoubling, world);
  }
}

TEST(RhdAllReduceTest, MismatchedCountsFailOnEveryRank) {
  for (int world : {2, 3, 5, 6}) {
    testing::CheckMismatchedCountsFailEverywhere(kHalving, world);
    testing::CheckMismatchedCountsFailEverywhere(kDoubling, world);
  }
}

// Runs `call` on `world` loopback ranks that are not killed on an error,
// rank `odd` entering only once every other rank has entered a wait inside
// the call (up to 20 s), so that they are all inside it when its messages
// come (a rank that entered after its neighbours had returned would get no
// note from them: they withdraw it); `call` learns whether it is the odd
// rank.
std::vector<Status> RunWithALateOddRank(int world, int odd,
                                        const std::function<Status(p2p::PointToPoint&, bool)>& call) {
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  std::vector<testing::Arrivals> waited(world);  // the waits each rank entered
  return transport::testing::RunRanks(
      world,
      [&](p2p::PointToPoint& p2p) -> Status {
        const int r = p2p.rank();
        if (r != odd) {
          testing::WaitCountingEndpoint counting(p2p, waited[r]);
          return call(counting, false);
        }
        for (int other = 0; other < world; ++other) {
          if (other != odd && !waited[other].AwaitAtLeast(1)) {
            return TimedOutError("rank " + std::to_string(other) + " did not wait inside the call within 20 s");
          }
        }
        return call(p2p, true);
      },
      options);
}

// RunWithALateOddRank with `fn`, every rank passing 64 floats but rank
// `odd`, which passes 65.
std::vector<Status> RunWithALateOddCount(const AllReduceFn& fn, int world, int odd) {
  const Deadline deadline = DeadlineIn(std::chrono::seconds(6));
  return RunWithALateOddRank(world, odd, [&](p2p::PointToPoint& p2p, bool is_odd) {
    std::vector<float> data(65, 1.0f);
    CollectiveArgs args;
    args.send = data.data();
    args.recv = data.data();
    args.count = is_odd ? 65 : 64;
    args.dtype = DataType::kF32;
    args.op = ReduceOp::kSum;
    args.tag = CollectiveTag(7);
    args.deadline = deadline;
    return fn(p2p, args);
  });
}

// Every rank failed with kInvalidArgument naming what rank `odd` passed
// ("count 65 of f32") and what the others passed.
void ExpectEveryRankNamesBoth(const std::vector<Status>& statuses, int odd, const std::string& odd_passed,
                              const std::string& others_passed, const std::string& what) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    const Status& s = statuses[r];
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": rank " << r << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("rank " + std::to_string(odd) + " passed rhd all-reduce, " + odd_passed))
        << what << ": rank " << r;
    EXPECT_THAT(s.message(), HasSubstr("passed rhd all-reduce, " + others_passed)) << what << ": rank " << r;
  }
}

// One rank passes count 65 among ranks passing 64: every rank fails naming
// the odd rank's count and the others', as every ring rank does. A rank
// whose partner in a step was the odd one, and which did not check it, got
// that rank's data first and failed on its size ("message size mismatch:
// rank 5 sent 260 bytes but rank 4 expected 256"), and the ranks its note
// reached learnt only their own count.
TEST(RhdAllReduceTest, EveryRankNamesBothCountsOfADisagreement) {
  const std::pair<const char*, const AllReduceFn*> modes[] = {{"doubling", &kDoubling},
                                                              {"halving", &kHalving}};
  for (const auto& [mode, fn] : modes) {
    for (int world : {5, 6, 8}) {
      for (int odd = 0; odd < world; ++odd) {
        const std::string what = std::string(mode) + ", " + std::to_string(world) +
                                 " ranks, rank " + std::to_string(odd) + " passes count 65";
        const std::vector<Status> statuses = RunWithALateOddCount(*fn, world, odd);
        ExpectEveryRankNamesBoth(statuses, odd, "count 65 of f32", "count 64 of f32", what);
        // The first case that fails says enough.
        if (HasFailure()) return;
      }
    }
  }
}

// A rank told of a disagreement by a stop note says which neighbour told
// it: a folded rank (even, below 2 (p - p2)) checks nobody and hears from
// its halving-doubling partner, rank r + 1; an exchanging rank hears from
// its predecessor in the exchanging ranks' ring. Both said "the ring passed
// that on", though a folded rank is on no ring.
TEST(RhdAllReduceTest, ANoteSaysWhichNeighbourPassedItOn) {
  const std::pair<const char*, const AllReduceFn*> modes[] = {{"doubling", &kDoubling},
                                                              {"halving", &kHalving}};
  for (const auto& [mode, fn] : modes) {
    for (int world : {5, 6, 7}) {
      int p2 = 1;
      while (p2 * 2 <= world) p2 *= 2;
      const int extra = world - p2;
      auto real = [extra](int v) { return v < extra ? 2 * v + 1 : v + extra; };
      for (int odd = 0; odd < world; ++odd) {
        const std::string what = std::string(mode) + ", " + std::to_string(world) +
                                 " ranks, rank " + std::to_string(odd) + " passes count 65";
        const std::vector<Status> statuses = RunWithALateOddCount(*fn, world, odd);
        int folded_seen = 0;
        for (int r = 0; r < world; ++r) {
          const std::string& m = statuses[r].message();
          const bool folded = r < 2 * extra && r % 2 == 0;
          const bool relayed = m.find("found that ranks disagree") != std::string::npos ||
                               m.find("did not match its own arguments") != std::string::npos;
          EXPECT_TRUE(relayed || !folded) << what << ": folded rank " << r << ": " << m;
          if (!relayed) continue;  // this rank's own check found it
          const std::string role = folded ? "halving-doubling partner" : "ring predecessor";
          const int nr = r < 2 * extra ? r / 2 : r - extra;
          const int from = folded ? r + 1 : real((nr + p2 - 1) % p2);
          const std::string by = "rank " + std::to_string(from);
          // Relayed by `from`, or found by it.
          const bool names_it =
              m.find("this rank's " + role + " " + by + " passed that on") != std::string::npos ||
              m.find(by + ", this rank's " + role + ",") != std::string::npos;
          EXPECT_TRUE(names_it) << what << ": rank " << r << " should name its " << role << " "
                                << by << ": " << m;
          folded_seen += folded;
        }
        EXPECT_EQ(folded_seen, extra) << what;
        if (HasFailure()) return;
      }
    }
  }
}

TEST(RhdAllReduceTest, EmptyCallOnOneRankFailsEveryRank) {
  for (int world : {2, 3, 5, 6}) {
    testing::CheckEmptyAgainstNonEmptyFailsEverywhere(kHalving, kHalving, world);
    testing::CheckEmptyAgainstNonEmptyFailsEverywhere(kDoubling, kDoubling, world);
    testing::CheckEmptyAgainstNonEmptyFailsEverywhere(kHalving, RingAllReduce, world);
  }
}

TEST(RhdAllReduceTest, KilledRankFailsEverySurvivor) {
  for (int world : {2, 3, 6}) testing::CheckKilledRankFailsSurvivors(RhdAllReduce, world);
}

// A rank may finish its part and leave while its ring successor still waits
// for data from another peer. On 4 ranks in doubling mode, rank 1 is done
// after its steps with ranks 0 and 3, while rank 2 may still wait for rank
// 0's second-step vector; all along rank 2 watches for a stop note from
// rank 1, its ring predecessor. Here rank 1 returns and is killed (as UCX
// shows the exit of a rank that left) before rank 2 starts that wait, and
// rank 0 holds its vector for rank 2 until rank 2 has waited 300 ms: rank
// 2 needs nothing more from rank 1 and must complete. It failed PEER_LOST
// at once on the note's receive (a flaky failure of a 4-rank job whose
// ranks ended at different times).
TEST(RhdAllReduceTest, ARankWhoseRingPredecessorLeftAfterItsPartStillCompletes) {
  std::mutex mu;
  std::condition_variable cv;
  bool rank1_gone = false, rank2_waits = false, rank2_returned = false;
  auto await = [&](const bool& flag, std::chrono::milliseconds limit) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, limit, [&] { return flag; });
  };
  auto set = [&](bool& flag) {
    std::lock_guard lock(mu);
    flag = true;
    cv.notify_all();
  };
  // Rank 0 holds its sends to rank 2 until rank 2 has waited for them
  // (it returns at once when the lost note fails its wait).
  class Rank0 final : public testing::WaitObservingEndpoint {
   public:
    Rank0(p2p::PointToPoint& inner, std::function<void()> hold)
        : WaitObservingEndpoint(inner), hold_(std::move(hold)) {}
    StatusOr<p2p::RequestId> PostSend(int peer, p2p::Tag tag, const void* data,
                                      size_t bytes) override {
      if (peer == 2) hold_();
      return WaitObservingEndpoint::PostSend(peer, tag, data, bytes);
    }

   private:
    std::function<void()> hold_;
  };
  // Rank 2 enters its wait for rank 0's vector (its only receive from rank
  // 0) once rank 1 is gone, and says when it is in it and when it is out.
  class Rank2 final : public testing::WaitObservingEndpoint {
   public:
    Rank2(p2p::PointToPoint& inner, std::function<void()> before, std::function<void()> after)
        : WaitObservingEndpoint(inner), before_(std::move(before)), after_(std::move(after)) {}
    StatusOr<p2p::RequestId> PostRecv(int peer, p2p::Tag tag, void* data, size_t bytes) override {
      StatusOr<p2p::RequestId> id = WaitObservingEndpoint::PostRecv(peer, tag, data, bytes);
      if (peer == 0 && id.ok()) from0_ = *id;
      return id;
    }
    StatusOr<size_t> WaitAny(std::span<const p2p::RequestId> requests, Deadline deadline) override {
      const bool for_rank0 = from0_ != 0 && std::find(requests.begin(), requests.end(), from0_) !=
                                                requests.end();
      if (for_rank0) before_();
      StatusOr<size_t> index = WaitObservingEndpoint::WaitAny(requests, deadline);
      if (for_rank0) after_();
      return index;
    }

   private:
    std::function<void()> before_, after_;
    p2p::RequestId from0_ = 0;
  };
  p2p::LoopbackHub hub(4);
  bool rank2_saw_rank1_gone = false, rank2_entered = false;
  std::vector<std::vector<float>> out(4, std::vector<float>(8));
  auto statuses = transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
    const int r = p2p.rank();
    const std::vector<float> in(8, static_cast<float>(r + 1));
    CollectiveArgs args;
    args.send = in.data();
    args.recv = out[r].data();
    args.count = in.size();
    args.dtype = DataType::kF32;
    args.op = ReduceOp::kSum;
    args.tag = CollectiveTag(3);
    args.call_id = 4;
    args.deadline = DeadlineIn(std::chrono::seconds(20));
    Rank0 rank0(p2p, [&] {
      rank2_entered = await(rank2_waits, std::chrono::seconds(10));
      await(rank2_returned, std::chrono::milliseconds(300));
    });
    Rank2 rank2(
        p2p,
        [&] {
          rank2_saw_rank1_gone = await(rank1_gone, std::chrono::seconds(10));
          set(rank2_waits);
        },
        [&] { set(rank2_returned); });
    p2p::PointToPoint& endpoint = r == 0 ? rank0 : r == 2 ? static_cast<p2p::PointToPoint&>(rank2) : p2p;
    Status status = kDoubling(endpoint, args);
    if (r == 1) {
      hub.Kill(1);
      set(rank1_gone);
    }
    return status;
  });
  EXPECT_TRUE(rank2_saw_rank1_gone);
  EXPECT_TRUE(rank2_entered);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
    EXPECT_EQ(out[r], std::vector<float>(8, 10.0f)) << "rank " << r;
  }
}

TEST(RhdAllReduceTest, AbsentRankTimesOutAtTheDeadline) {
  testing::CheckAbsentRankTimesOut(RhdAllReduce, 5);
}

TEST(RhdAllReduceTest, BadArgumentsNameTheArgument) {
  testing::CheckBadArguments(RhdAllReduce, "rhd all-reduce");
}


// A step partner whose arguments differ in a way that keeps its messages
// size (i32 for f32, max for sum): doubling carries each fingerprint in
// front of the step's vector, and a rank compares it before it reduces
// that vector. Every rank fails naming both values (the stop notes tell
// those that took nothing from the odd rank).
TEST(RhdAllReduceTest, DoublingNamesAPartnerThatPassedAnotherDtypeOrOp) {
  struct Odd {
    DataType dtype;
    ReduceOp op;
    const char* passed;  // as the fingerprint names it
  };
  const Odd odds[] = {{DataType::kI32, ReduceOp::kSum, "count 64 of i32, op sum"},
                      {DataType::kF32, ReduceOp::kMax, "count 64 of f32, op max"}};
  for (const Odd& o : odds) {
    for (int world : {4, 5, 8}) {
      for (int odd = 0; odd < world; ++odd) {
        const std::string what = std::to_string(world) + " ranks, rank " + std::to_string(odd) +
                                 " passes " + o.passed;
        const Deadline deadline = DeadlineIn(std::chrono::seconds(6));
        const std::vector<Status> statuses = RunWithALateOddRank(
            world, odd, [&](p2p::PointToPoint& p2p, bool is_odd) {
              std::vector<float> data(64, 1.0f);
              CollectiveArgs args;
              args.send = data.data();
              args.recv = data.data();
              args.count = 64;
              args.dtype = is_odd ? o.dtype : DataType::kF32;
              args.op = is_odd ? o.op : ReduceOp::kSum;
              args.tag = CollectiveTag(3);
              args.deadline = deadline;
              return kDoubling(p2p, args);
            });
        ExpectEveryRankNamesBoth(statuses, odd, o.passed, "count 64 of f32, op sum", what);
        if (HasFailure()) return;
      }
    }
  }
}

// One rank passes 2049 floats, just above the 8 KiB up to which the others
// (2048) take recursive doubling, so it runs halving-doubling: it expects
// a fingerprint message of its own from each step partner, which doubling
// ranks carry in front of their data instead, and their data is not the
// size it expects either. Every rank must still fail at once, naming both
// counts (the ring check and its stop notes), not wait for its deadline.
TEST(RhdAllReduceTest, RanksOnBothSidesOfTheDoublingSizeFailNamingBothCounts) {
  for (int world : {4, 5, 8}) {
    for (int odd = 0; odd < world; ++odd) {
      const std::string what =
          std::to_string(world) + " ranks, rank " + std::to_string(odd) + " passes count 2049";
      const auto start = std::chrono::steady_clock::now();
      const std::vector<Status> statuses = RunWithALateOddRank(
          world, odd, [&](p2p::PointToPoint& p2p, bool is_odd) {
            std::vector<float> data(2049, 1.0f);
            CollectiveArgs args;
            args.send = data.data();
            args.recv = data.data();
            args.count = is_odd ? 2049 : 2048;
            args.deadline = DeadlineIn(std::chrono::seconds(20));
            return RhdAllReduce(p2p, args);
          });
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << what;
      ExpectEveryRankNamesBoth(statuses, odd, "count 2049 of f32", "count 2048 of f32", what);
      if (HasFailure()) return;
    }
  }
}

// Ranks whose tuning.rhd_doubling_bytes put the same 256-byte call in
// different modes: one rank forced to halving-doubling (1) among ranks on
// the default (recursive doubling up to 8 KiB), or the reverse. Their
// fingerprints were equal, so no check failed: a halving rank waited for a
// fingerprint message from each step partner, which a doubling rank
// carries in front of its data instead, and a doubling rank took a
// halving partner's chunk as data of the wrong size and waited for a stop
// note that no check sent, both until their deadline (and on 2 ranks each
// failed on the other's message size, naming neither mode). Every rank
// must fail at once, naming both modes and the option that chose them.
TEST(RhdAllReduceTest, RanksInDifferentModesFailAtOnceNamingBoth) {
  const std::string halving = "count 64 of f32, op sum, in halving-doubling mode";
  const std::string doubling = "count 64 of f32, op sum, in recursive-doubling mode";
  for (bool odd_halves : {true, false}) {
    for (int world : {2, 3, 4, 5, 6, 8}) {
      for (int odd = 0; odd < world; ++odd) {
        const std::string what = std::to_string(world) + " ranks, rank " + std::to_string(odd) +
                                 (odd_halves ? " halves, the others double"
                                             : " doubles, the others halve");
        const auto start = std::chrono::steady_clock::now();
        const std::vector<Status> statuses = RunWithALateOddRank(
            world, odd, [&](p2p::PointToPoint& p2p, bool is_odd) {
              std::vector<float> data(64, 1.0f);
              CollectiveArgs args;
              args.send = data.data();
              args.recv = data.data();
              args.count = 64;
              args.deadline = DeadlineIn(std::chrono::seconds(20));
              // 1: halving-doubling for 256 B; 0: the default, doubling.
              args.tuning.rhd_doubling_bytes = is_odd == odd_halves ? 1 : 0;
              return RhdAllReduce(p2p, args);
            });
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << what;
        ExpectEveryRankNamesBoth(statuses, odd, odd_halves ? halving : doubling,
                                 odd_halves ? doubling : halving, what);
        for (size_t r = 0; r < statuses.size(); ++r) {
          EXPECT_THAT(statuses[r].message(), HasSubstr("tuning.rhd_doubling_bytes"))
              << what << ": rank " << r;
        }
        if (HasFailure()) return;
      }
    }
  }
}

// 7 ranks, 0, 1, 5 and 6 in halving-doubling mode, 2, 3 and 4 in
// recursive doubling; ranks 1, 3, 5 and 6 exchange (ring 1, 3, 5, 6), 0,
// 2 and 4 fold into 1, 3 and 5. Rank 3 finds that rank 1 differs and its
// note goes on through 5 (which checks its partner 4 first, late here, so
// the note comes before its own check) and 6 to rank 1. Rank 1's own
// checks agree (0 and 6 halve as it does; rank 3, its step partner, never
// sends it a fingerprint message), and the note named it as the rank that
// differs, so rank 6 did not pass it on: rank 1, and its folded partner 0,
// waited for their deadline. Rank 1 enters once 0, 2, 3, 5 and 6 are
// inside the call (a rank that enters after its neighbours have returned
// gets no note: they withdraw it). Rank 4 enters after its partner 5 has
// returned and withdrawn its note, and waits for its shorter deadline (a
// bare algorithm has no abort to tell a late rank).
TEST(RhdAllReduceTest, ANoteReachesTheRankItNamesWhenThatRanksChecksAgree) {
  constexpr int kWorld = 7;
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  std::vector<std::chrono::steady_clock::duration> took(kWorld);
  std::vector<testing::Arrivals> waited(kWorld);  // the waits each rank entered
  testing::Arrivals rank5_returned;
  const std::vector<Status> statuses = transport::testing::RunRanks(
      kWorld,
      [&](p2p::PointToPoint& p2p) -> Status {
        const int r = p2p.rank();
        if (r == 1) {
          for (int other : {0, 2, 3, 5, 6}) {
            if (!waited[other].AwaitAtLeast(1)) {
              return TimedOutError("rank " + std::to_string(other) + " did not wait inside the call within 20 s");
            }
          }
        }
        if (r == 4 && !rank5_returned.AwaitAtLeast(1)) return TimedOutError("rank 5 did not return within 20 s");
        const auto start = std::chrono::steady_clock::now();
        std::vector<float> data(64, 1.0f);
        CollectiveArgs args;
        args.send = data.data();
        args.recv = data.data();
        args.count = 64;
        args.deadline = DeadlineIn(std::chrono::seconds(r == 4 ? 1 : 10));
        // 1: halving-doubling for 256 B; 0: the default, doubling.
        args.tuning.rhd_doubling_bytes = r == 2 || r == 3 || r == 4 ? 0 : 1;
        testing::WaitCountingEndpoint counting(p2p, waited[r]);
        Status status = RhdAllReduce(counting, args);
        took[r] = std::chrono::steady_clock::now() - start;
        if (r == 5) rank5_returned.Arrive();
        return status;
      },
      options);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_FALSE(statuses[r].ok()) << "rank " << r;
    if (r == 4) continue;
    EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << statuses[r];
    EXPECT_THAT(statuses[r].message(), HasSubstr("tuning.rhd_doubling_bytes")) << "rank " << r;
    EXPECT_LT(took[r], std::chrono::seconds(3)) << "rank " << r << ": " << statuses[r];
  }
}

// The fingerprint in front of a doubling step's data is compared before
// that data is used. On 4 ranks, rank 1 passes i32 (or max) among f32 sums
// and rank 0 is its first partner; rank 1 is not rank 0's ring predecessor
// (rank 3), so rank 0 has no fingerprint of rank 1 but the one in front of
// its data. Rank 1 enters once ranks 0 and 2 wait inside the call (for
// their ring predecessors' fingerprints), and rank 3 only once ranks 1 and
// 2 have failed and returned, so rank 1's data is in rank 0's buffer
// before rank 0 has its predecessor's fingerprint, and before any stop
// note can reach it (rank 3 would pass it on): rank 0 must find the
// disagreement in that data itself.
TEST(RhdAllReduceTest, DoublingComparesThePartnersFingerprintBeforeItsData) {
  struct Odd {
    DataType dtype;
    ReduceOp op;
    const char* passed;  // as the fingerprint names it
  };
  const Odd odds[] = {{DataType::kI32, ReduceOp::kSum, "count 64 of i32, op sum"},
                      {DataType::kF32, ReduceOp::kMax, "count 64 of f32, op max"}};
  for (const Odd& o : odds) {
    ::ddp::transport::testing::HarnessOptions options;
    options.kill_on_error = false;
    const Deadline deadline = DeadlineIn(std::chrono::seconds(2));
    std::vector<testing::Arrivals> waited(4);  // the waits each rank entered
    testing::Arrivals ranks_1_2_returned;
    const std::vector<Status> statuses = transport::testing::RunRanks(
        4,
        [&](p2p::PointToPoint& p2p) -> Status {
          const int r = p2p.rank();
          const bool is_odd = r == 1;
          for (int other : {0, 2}) {
            if (r == 1 && !waited[other].AwaitAtLeast(1)) {
              return TimedOutError("rank " + std::to_string(other) + " did not wait inside the call within 20 s");
            }
          }
          if (r == 3 && !ranks_1_2_returned.AwaitAtLeast(2)) {
            return TimedOutError("ranks 1 and 2 did not return within 20 s");
          }
          std::vector<float> data(64, 1.0f);
          CollectiveArgs args;
          args.send = data.data();
          args.recv = data.data();
          args.count = 64;
          args.dtype = is_odd ? o.dtype : DataType::kF32;
          args.op = is_odd ? o.op : ReduceOp::kSum;
          args.deadline = deadline;
          testing::WaitCountingEndpoint counting(p2p, waited[r]);
          Status status = kDoubling(counting, args);
          if (r == 1 || r == 2) ranks_1_2_returned.Arrive();
          return status;
        },
        options);
    // Rank 3 enters after ranks 1 and 2 have failed and withdrawn their
    // messages, and waits for its deadline: only rank 0 is looked at.
    EXPECT_EQ(statuses[0].code(), StatusCode::kInvalidArgument) << o.passed << ": " << statuses[0];
    EXPECT_THAT(statuses[0].message(),
                HasSubstr("rhd all-reduce, recursive doubling chunk 0: receive from rank 1: "
                          "rhd all-reduce, argument check: ranks disagree on the arguments: "
                          "rank 1 passed rhd all-reduce, " + std::string(o.passed) +
                          ", in recursive-doubling mode but rank 0 passed rhd all-reduce, count 64 "
                          "of f32, op sum, in recursive-doubling mode"))
        << o.passed;
  }
}

// Doubling (the small messages) sends each rank's fingerprint on its own
// to the ring successor only, and to every other step partner in front of
// the step's vector: one small message each way, plus one per step. A
// separate fingerprint to every step partner cost a forced rhd at 4 B on
// 4 ranks about 3-5 us (30-31 us before them, 33-36 us with them).
TEST(RhdTrafficTest, DoublingSendsOneFingerprintMessagePerRank) {
  for (int world : {4, 8, 16}) {
    int steps = 0;
    while ((1 << steps) < world) ++steps;
    p2p::LoopbackHub hub(world);
    const std::vector<Status> statuses =
        transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
          std::vector<float> data(16, 1.0f);
          CollectiveArgs args;
          args.send = data.data();
          args.recv = data.data();
          args.count = 16;
          args.deadline = DeadlineIn(std::chrono::seconds(30));
          return kDoubling(p2p, args);
        });
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(statuses[r].ok()) << "world " << world << " rank " << r << ": " << statuses[r];
      const p2p::LoopbackStats stats = hub.Stats(r);
      EXPECT_EQ(stats.messages_sent, static_cast<uint64_t>(1 + steps))
          << "world " << world << " rank " << r;
      EXPECT_EQ(stats.messages_received, static_cast<uint64_t>(1 + steps))
          << "world " << world << " rank " << r;
    }
  }
}

TEST(RhdTrafficTest, NoRankMovesMoreThanItsShare) {
  // 2 (p2-1)/p2 of the vector, plus the whole vector for a handing-off pair.
  for (int world : {2, 3, 5, 8}) {
    testing::CheckTraffic(RhdAllReduce, world, 1 << 14, 3.0);
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
