#include "transport/algorithms/barrier.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/algorithms/broadcast.h"
#include "transport/algorithms/disagreement_test_util.h"
#include "transport/algorithms/ring_all_reduce.h"
#include "transport/algorithms/stale_send_test_util.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms {
namespace {

using namespace std::chrono_literals;
using ::ddp::transport::testing::RunRanks;
using ::testing::HasSubstr;

// Ranks arrive at different times; nobody may leave before the last one
// arrived. Repeated with fresh tags, as a communicator would.
TEST(BarrierTest, NoRankLeavesBeforeTheLastArrives) {
  for (int world : {1, 2, 3, 4, 5, 7, 8, 9, 13, 16}) {
    constexpr int kRounds = 5;
    std::vector<std::vector<Clock::time_point>> arrived(kRounds, std::vector<Clock::time_point>(world));
    std::vector<std::vector<Clock::time_point>> left(kRounds, std::vector<Clock::time_point>(world));
    auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
      const int r = p2p.rank();
      for (int round = 0; round < kRounds; ++round) {
        // A different rank is late each round.
        if (r == round % world) std::this_thread::sleep_for(20ms);
        arrived[round][r] = Clock::now();
        CollectiveArgs args;
        args.tag = CollectiveTag(round);
        args.deadline = DeadlineIn(10s);
        DDP_RETURN_IF_ERROR(Barrier(p2p, args));
        left[round][r] = Clock::now();
      }
      return Status();
    });
    for (int r = 0; r < world; ++r) ASSERT_TRUE(statuses[r].ok()) << statuses[r];
    for (int round = 0; round < kRounds; ++round) {
      const auto last = *std::max_element(arrived[round].begin(), arrived[round].end());
      for (int r = 0; r < world; ++r) {
        EXPECT_GE(left[round][r], last) << "world=" << world << " round " << round << " rank " << r;
      }
    }
  }
}

TEST(BarrierTest, AbsentRankTimesOutAtTheDeadline) {
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  std::vector<Clock::duration> took(4);
  auto statuses = RunRanks(
      4,
      [&](p2p::PointToPoint& p2p) -> Status {
        if (p2p.rank() == 3) return Status();
        CollectiveArgs args;
        const auto start = Clock::now();
        args.deadline = start + 200ms;
        Status s = Barrier(p2p, args);
        took[p2p.rank()] = Clock::now() - start;
        return s;
      },
      options);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kTimedOut) << statuses[r];
    EXPECT_THAT(statuses[r].message(), HasSubstr("barrier"));
    EXPECT_LT(took[r], 2s);
  }
}

TEST(BarrierTest, KilledRankGivesPeerLost) {
  p2p::LoopbackHub hub(3);
  auto statuses = ::ddp::transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
    if (p2p.rank() == 1) {
      std::this_thread::sleep_for(30ms);
      hub.Kill(1);
      return AbortedError("killed");
    }
    CollectiveArgs args;
    args.deadline = DeadlineIn(20s);
    return Barrier(p2p, args);
  });
  EXPECT_EQ(statuses[0].code(), StatusCode::kPeerLost) << statuses[0];
  EXPECT_EQ(statuses[2].code(), StatusCode::kPeerLost) << statuses[2];
}

// Two ranks one collective out of step: rank 0 in a barrier, rank 1 in a
// broadcast of one byte, 0, from itself, with the same tag. The byte comes
// on the tag of the barrier's round 0 and equals the round number, so the
// barrier took it for its peer's round and (where the transport completes
// a short send without its receive, as UCX does) returned OK. Both must
// fail, naming the two collectives.
TEST(BarrierTest, PeerInAnotherCollectiveFailsBothRanks) {
  const auto deadline = DeadlineIn(10s);
  auto statuses = RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    CollectiveArgs args;
    args.tag = CollectiveTag(0);
    args.deadline = deadline;
    if (p2p.rank() == 0) return Barrier(p2p, args);
    unsigned char byte = 0;
    args.send = &byte;
    args.recv = &byte;
    args.count = 1;
    args.dtype = DataType::kU8;
    args.root = 1;
    return Broadcast(p2p, args);
  });
  EXPECT_LT(Clock::now() + 8s, deadline);
  // The barrier always gets the broadcast's fingerprint. The broadcast may
  // instead find the barrier's rank already gone (the harness kills a
  // failed rank), before or after its own check.
  EXPECT_EQ(statuses[0].code(), StatusCode::kInvalidArgument) << statuses[0];
  EXPECT_THAT(statuses[0].message(),
              HasSubstr("barrier, argument check: ranks disagree on the arguments: rank 1 passed "
                        "broadcast, count 1 of u8, root 1 but rank 0 passed barrier"));
  EXPECT_TRUE(statuses[1].code() == StatusCode::kInvalidArgument ||
              statuses[1].code() == StatusCode::kPeerLost)
      << statuses[1];
  if (statuses[1].code() == StatusCode::kInvalidArgument) {
    EXPECT_THAT(statuses[1].message(), HasSubstr("rank 0 passed barrier but rank 1 passed "
                                                 "broadcast, count 1 of u8, root 1"));
  }
}

// Rank 2 of five runs `odd` (given the tag, call id and deadline; it sets
// its buffers and count) while the others run a barrier at the same tag
// and call id: every rank must fail INVALID_ARGUMENT naming `odd_name` and
// the barrier, within 15 s of a 30 s deadline.
void ExpectOddRankAmongBarrierRanksFailsEveryRank(const testing::CollectiveCall& odd,
                                                  const std::string& odd_name) {
  testing::ExpectOddCollectiveStopsEveryRank(
      /*world=*/5, /*odd=*/2, odd, odd_name,
      [](p2p::PointToPoint& p2p, CollectiveArgs args) { return Barrier(p2p, args); }, "barrier");
}

// One rank of five in a ring all-reduce while the others are in a barrier,
// nobody killed, with a call id as the communicator passes: every rank
// fails at once, naming both collectives. The barrier's check stopped only
// the rank after the odd one; the others waited for rounds that never came
// and timed out at their deadline (ranks 0, 1 and 4 after the full 6 s).
// The 30 s deadline and 15 s bound leave room for a loaded host while a
// rank that waits out its deadline still fails the test.
TEST(BarrierTest, ARankInAnotherCollectiveStopsEveryBarrierRank) {
  ExpectOddRankAmongBarrierRanksFailsEveryRank(
      [](p2p::PointToPoint& p2p, CollectiveArgs args) {
        std::vector<float> in(8, 1.0f), out(8);
        args.send = in.data();
        args.recv = out.data();
        args.count = in.size();
        return RingAllReduce(p2p, args);
      },
      "ring all-reduce");
}

// One rank of five in a broadcast while the others are in a barrier,
// nobody killed. The broadcast rank's argument check (CheckEveryRank)
// finds the barrier in its first round; the barrier ranks never send its
// later rounds, so it must fail at once rather than wait for them: it
// waited until its deadline and only then reported the disagreement.
TEST(BarrierTest, ABroadcastRankAmongBarrierRanksFailsAtOnce) {
  ExpectOddRankAmongBarrierRanksFailsEveryRank(
      [](p2p::PointToPoint& p2p, CollectiveArgs args) {
        std::vector<float> data(8, 1.0f);
        args.send = data.data();
        args.recv = data.data();
        args.count = data.size();
        return Broadcast(p2p, args);
      },
      "broadcast, count 8 of f32");
}

// Two barriers at the same tag, as a caller of the algorithm library
// without the communicator's tag sequence makes them. In call 1 rank 1
// stays out and rank 0 fails at its deadline; its round's send, cancelled,
// still reaches rank 1 (as a small send does on UCX). Call 2 must not take
// it for rank 0's round: when every call used the same round tags, rank 1
// did, rank 0's own round was then never taken, and rank 0 failed
// TIMED_OUT. On more ranks such an old round lets a rank leave a barrier
// that a peer has not entered.
TEST(BarrierTest, RoundLeftByAFailedCallAtTheSameTagIsNotTaken) {
  std::promise<void> first_failed;
  std::shared_future<void> first_failed_seen = first_failed.get_future().share();
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  auto statuses = RunRanks(
      2,
      [&](p2p::PointToPoint& p2p) -> Status {
        CollectiveArgs args;
        args.tag = CollectiveTag(0);
        if (p2p.rank() == 0) {
          args.call_id = 1;
          args.deadline = DeadlineIn(300ms);
          testing::CancelledSendDeliveringEndpoint delivering(p2p);
          Status first = Barrier(delivering, args);
          if (first.code() != StatusCode::kTimedOut) {
            return InternalError("call 1 on rank 0 ended with " + first.ToString());
          }
          if (delivering.delivered() != 1) {
            return InternalError("call 1 left " + std::to_string(delivering.delivered()) +
                                 " cancelled rounds, expected 1");
          }
          first_failed.set_value();
        } else if (first_failed_seen.wait_for(20s) != std::future_status::ready) {
          return TimedOutError("call 1 did not fail on rank 0 within 20 s");
        }
        args.call_id = 2;
        args.deadline = DeadlineIn(5s);
        return Barrier(p2p, args);
      },
      options);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

TEST(BarrierTest, UnsetDeadlineIsRejected) {
  auto statuses = RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    return Barrier(p2p, CollectiveArgs{});
  });
  for (const Status& s : statuses) EXPECT_THAT(s.message(), HasSubstr("deadline is not set"));
}

}  // namespace
}  // namespace ddp::transport::algorithms
