#include "transport/algorithms/ring_all_reduce.h"

#include <chrono>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/algorithms/all_gather.h"
#include "transport/algorithms/all_reduce_test_util.h"
#include "transport/algorithms/pipeline.h"
#include "transport/algorithms/reduce_scatter.h"
#include "transport/algorithms/stale_send_test_util.h"
#include "transport/algorithms/tree_all_reduce.h"
#include "transport/p2p/group_view.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms {
namespace {

using testing::AllReduceCase;
using testing::Arrivals;
using testing::CancelledSendDeliveringEndpoint;
using testing::CheckAllReduce;
using testing::WaitCountingEndpoint;

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

// Runs `body` on `world` loopback ranks, rank `late` entering only once
// `before` other ranks have returned from it (up to 20 s). No rank is
// killed on an error: a killed rank's notices would be dropped. Expects
// the whole run under 3 s: no rank waited for its deadline.
std::vector<Status> RunWithARankAfterOthersReturned(int world, int late, int before,
                                                    const ::ddp::transport::testing::RankFn& body) {
  Arrivals returned;
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> statuses = ::ddp::transport::testing::RunRanks(
      world,
      [&](p2p::PointToPoint& p2p) -> Status {
        if (p2p.rank() == late && !returned.AwaitAtLeast(before)) {
          return TimedOutError(std::to_string(before) + " ranks did not return within 20 s");
        }
        Status status = body(p2p);
        if (p2p.rank() != late) returned.Arrive();
        return status;
      },
      options);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3)) << "some rank waited for its deadline";
  return statuses;
}

// A rank that enters the call after the ranks that found the disagreement
// have returned still learns of it from their stop notes (notices, which
// outlast their sender's call), instead of waiting for its deadline: with
// notes sent as plain sends, their cancellation at the finders' return lost
// them, and ranks 0, 2 and 3 failed TIMED_OUT after 6 s.
TEST(RingAllReduceTest, RankEnteringAfterTheFindersReturnedStillStops) {
  // Only ranks 1 and 2, the finders, can return before rank 3 enters.
  auto statuses = RunWithARankAfterOthersReturned(4, 3, 2, [&](p2p::PointToPoint& p2p) -> Status {
    const size_t count = p2p.rank() == 1 ? 9 : 8;
    std::vector<float> send(count, 1.0f), recv(count);
    CollectiveArgs args;
    args.send = send.data();
    args.recv = recv.data();
    args.count = count;
    args.tag = CollectiveTag(0);
    args.call_id = 1;
    args.deadline = DeadlineIn(std::chrono::seconds(6));
    return RingAllReduce(p2p, args);
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << statuses[r];
    EXPECT_NE(statuses[r].message().find("disagree on the arguments"), std::string::npos)
        << "rank " << r << ": " << statuses[r];
  }
}

// A note left unread by a failed call (its receiver had returned) must not
// stop a later call at the same tag: it carries the failed call's id.
// (Consecutive calls' notes take different tags, so the later call here is
// the next one whose notes share call 1's.)
TEST(RingAllReduceTest, NoteLeftByAnEarlierCallAtTheSameTagIsIgnored) {
  Arrivals first_done;
  Arrivals rank3_waits;  // in call 2
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  auto statuses = ::ddp::transport::testing::RunRanks(
      4,
      [&](p2p::PointToPoint& p2p) -> Status {
        const int r = p2p.rank();
        CollectiveArgs args;
        args.tag = CollectiveTag(0);
        // Call 1: rank 1 passes another count and rank 3 stays out, so
        // rank 2's note to rank 3 is never read. Rank 0 waits for rank 3
        // until its (short) deadline.
        if (r != 3) {
          const size_t count = r == 1 ? 9 : 8;
          std::vector<float> send(count, 1.0f), recv(count);
          args.send = send.data();
          args.recv = recv.data();
          args.count = count;
          args.call_id = 1;
          args.deadline = DeadlineIn(std::chrono::milliseconds(r == 0 ? 1000 : 6000));
          if (RingAllReduce(p2p, args).ok()) return InternalError("call 1 passed on rank " + std::to_string(r));
        }
        first_done.Arrive();
        if (!first_done.AwaitAtLeast(4)) return TimedOutError("call 1 did not end on every rank within 20 s");
        // Call 2, at the same tag, agrees. Rank 2 holds back until rank 3
        // waits for its arguments, so that rank 3 meets the old note first.
        if (r == 2 && !rank3_waits.AwaitAtLeast(1)) {
          return TimedOutError("rank 3 did not wait in call 2 within 20 s");
        }
        std::vector<float> send(8, 1.0f), recv(8);
        args.send = send.data();
        args.recv = recv.data();
        args.count = 8;
        // The next call to share call 1's stop-note tag (StopNoteTag), so
        // that the old note does reach this call's receive.
        args.call_id = 1 + internal::kStopNoteTags;
        args.deadline = DeadlineIn(std::chrono::seconds(6));
        WaitCountingEndpoint counted(p2p, rank3_waits);
        DDP_RETURN_IF_ERROR(RingAllReduce(r == 3 ? counted : p2p, args));
        for (float v : recv) {
          if (v != 4.0f) return InternalError("rank " + std::to_string(r) + " got " + std::to_string(v));
        }
        return Status();
      },
      options);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

// Two ring all-reduces at the same tag, as a caller of the algorithm
// library without the communicator's tag sequence makes them. In call 1
// rank 1 stays out, and rank 0 fails at its deadline with its first data
// chunks posted; their sends, cancelled, still reach rank 1 (as on UCX).
// Call 2 must not take them as its own data: when every call used the
// same data tags, rank 1 took call 1's chunks (100s) in place of call 2's,
// whose sends on rank 0 were then never taken, and both ranks failed
// TIMED_OUT at call 2's deadline (rank 0 completing its sends, rank 1
// waiting for rank 0's block).
TEST(RingAllReduceTest, DataLeftByAFailedCallAtTheSameTagIsNotTaken) {
  Arrivals first_failed;
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  auto statuses = ::ddp::transport::testing::RunRanks(
      2,
      [&](p2p::PointToPoint& p2p) -> Status {
        const int r = p2p.rank();
        CollectiveArgs args;
        args.tag = CollectiveTag(0);
        args.count = 8;
        args.tuning.chunk_bytes = sizeof(float);  // 4 chunks per block
        args.tuning.pipeline_depth = 2;           // 2 chunks posted: within kMaxNoticesPerPeer
        if (r == 0) {
          std::vector<float> send(8, 100.0f), recv(8);
          args.send = send.data();
          args.recv = recv.data();
          args.call_id = 1;
          args.deadline = DeadlineIn(std::chrono::milliseconds(300));
          CancelledSendDeliveringEndpoint delivering(p2p);
          Status first = RingAllReduce(delivering, args);
          if (first.code() != StatusCode::kTimedOut) {
            return InternalError("call 1 on rank 0 ended with " + first.ToString());
          }
          if (delivering.delivered() < 2) {
            return InternalError("call 1 left " + std::to_string(delivering.delivered()) +
                                 " cancelled data sends, expected 2");
          }
          first_failed.Arrive();
        } else if (!first_failed.AwaitAtLeast(1)) {
          return TimedOutError("call 1 did not fail on rank 0 within 20 s");
        }
        std::vector<float> send(8), recv(8);
        for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>(r * 10 + i);
        args.send = send.data();
        args.recv = recv.data();
        args.call_id = 2;
        args.deadline = DeadlineIn(std::chrono::seconds(5));
        DDP_RETURN_IF_ERROR(internal::Annotate(RingAllReduce(p2p, args), "call 2"));
        for (size_t i = 0; i < recv.size(); ++i) {
          const float expected = static_cast<float>(10 + 2 * i);
          if (recv[i] != expected) {
            return InternalError("call 2: rank " + std::to_string(r) + " got " +
                                 std::to_string(recv[i]) + " at " + std::to_string(i) +
                                 ", expected " + std::to_string(expected));
          }
        }
        return Status();
      },
      options);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

// An endpoint whose first Cancel waits (up to 20 s) until `gate` has an
// arrival: a ring rank's first Cancel in a call that agrees is that of its
// stop note's receive, at the end of the call, so the rank stays in the
// call, with that receive posted, after its predecessor has finished it.
class CancelHoldingEndpoint final : public testing::WaitObservingEndpoint {
 public:
  CancelHoldingEndpoint(p2p::PointToPoint& inner, Arrivals& gate)
      : WaitObservingEndpoint(inner), gate_(gate) {}
  void Cancel(p2p::RequestId request) override {
    if (!held_) {
      held_ = true;
      gate_.AwaitAtLeast(1);
    }
    WaitObservingEndpoint::Cancel(request);
  }

 private:
  Arrivals& gate_;
  bool held_ = false;
};

// Two calls at the same tag on a ring 0 -> 1 -> 2 -> 0. Call 1 agrees;
// rank 2 stays in it, its stop note's receive posted, until rank 1 has
// finished call 1 and failed call 2, where rank 0 passes another count and
// rank 1 finds it and sends its note to rank 2. That note is call 2's:
// when it went to the tag of call 1's receive, call 1 took it and dropped
// it, and rank 2 waited in call 2 for rank 1's fingerprint (cancelled as
// rank 1 returned) until its deadline, TIMED_OUT.
TEST(StopNoteTest, NoteOfTheNextCallReachingARankStillInThisOneIsKept) {
  Arrivals rank1_failed_call2;
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;  // a killed rank's notices would be dropped
  auto statuses = ::ddp::transport::testing::RunRanks(
      3,
      [&](p2p::PointToPoint& p2p) -> Status {
        const int r = p2p.rank();
        CollectiveArgs args;
        args.tag = CollectiveTag(0);
        {
          std::vector<float> send(4, static_cast<float>(r)), recv(12);
          args.send = send.data();
          args.recv = recv.data();
          args.count = 4;
          args.call_id = 1;
          args.deadline = DeadlineIn(std::chrono::seconds(20));
          CancelHoldingEndpoint held(p2p, rank1_failed_call2);
          Status first = RingAllGather(r == 2 ? held : p2p, args);
          if (!first.ok()) return internal::Annotate(first, "call 1");
          for (size_t i = 0; i < recv.size(); ++i) {
            if (recv[i] != static_cast<float>(i / 4)) {
              return InternalError("call 1: rank " + std::to_string(r) + " got " +
                                   std::to_string(recv[i]) + " at " + std::to_string(i));
            }
          }
        }
        const size_t count = r == 0 ? 5 : 4;
        std::vector<float> send(count, 1.0f), recv(3 * count);
        args.send = send.data();
        args.recv = recv.data();
        args.count = count;
        args.call_id = 2;
        args.deadline = DeadlineIn(std::chrono::seconds(6));
        Status second = RingAllGather(p2p, args);
        if (r == 1) rank1_failed_call2.Arrive();
        return second;
      },
      options);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << statuses[r];
    EXPECT_NE(statuses[r].message().find("disagree on the arguments"), std::string::npos)
        << "rank " << r << ": " << statuses[r];
  }
}

// Count 0 proves the arguments by an exchange of fingerprints between all
// pairs (CheckEmptyCall). A rank that enters such a call after the ranks
// that found a disagreement have returned learns of it from their stop
// notes (notices, which outlast their senders' call): the fingerprints it
// waited for were plain sends, cancelled as their senders returned, and
// rank 2 here failed TIMED_OUT at its 6 s deadline.
TEST(RingAllReduceTest, EmptyCallRankEnteringAfterTheFindersReturnedStillStops) {
  for (auto* collective : {&RingAllReduce, &RingAllGather, &RingReduceScatter}) {
    // Ranks 0 and 1, the finders, return before rank 2 enters.
    auto statuses = RunWithARankAfterOthersReturned(3, 2, 2, [&](p2p::PointToPoint& p2p) -> Status {
      CollectiveArgs args;
      args.count = 0;
      args.dtype = p2p.rank() == 0 ? DataType::kF64 : DataType::kF32;
      args.tag = CollectiveTag(0);
      args.call_id = 1;
      args.deadline = DeadlineIn(std::chrono::seconds(6));
      return collective(p2p, args);
    });
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << statuses[r];
      EXPECT_NE(statuses[r].message().find("disagree on the arguments"), std::string::npos)
          << "rank " << r << ": " << statuses[r];
      EXPECT_NE(statuses[r].message().find("count 0 of f64"), std::string::npos)
          << "rank " << r << ": " << statuses[r];
      EXPECT_NE(statuses[r].message().find("count 0 of f32"), std::string::npos)
          << "rank " << r << ": " << statuses[r];
    }
  }
}

// The notes of a failed empty call that nobody read (rank 2 stayed out of
// call 1) must not fail a later one whose notes take the same tag.
TEST(RingAllReduceTest, EmptyCallIgnoresNotesLeftByAnEarlierCall) {
  Arrivals first_done;
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  auto statuses = ::ddp::transport::testing::RunRanks(
      3,
      [&](p2p::PointToPoint& p2p) -> Status {
        const int r = p2p.rank();
        CollectiveArgs args;
        args.count = 0;
        args.tag = CollectiveTag(0);
        args.deadline = DeadlineIn(std::chrono::seconds(6));
        if (r != 2) {
          args.dtype = r == 0 ? DataType::kF64 : DataType::kF32;
          args.call_id = 1;
          if (RingAllReduce(p2p, args).ok()) return InternalError("call 1 passed on rank " + std::to_string(r));
        }
        first_done.Arrive();
        if (!first_done.AwaitAtLeast(3)) return TimedOutError("call 1 did not end on every rank within 20 s");
        args.dtype = DataType::kF32;
        args.call_id = 1 + internal::kStopNoteTags;  // its notes share call 1's tag
        return RingAllReduce(p2p, args);
      },
      options);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

// An endpoint whose sends to `peer` wait until `gate` has an arrival (up
// to 20 s), then until `woke` has two (up to 300 ms), before they are
// posted.
class SendHoldingEndpoint final : public testing::WaitObservingEndpoint {
 public:
  SendHoldingEndpoint(p2p::PointToPoint& inner, int peer, Arrivals& gate, Arrivals& woke)
      : WaitObservingEndpoint(inner), peer_(peer), gate_(gate), woke_(woke) {}
  StatusOr<p2p::RequestId> PostSend(int peer, p2p::Tag tag, const void* data, size_t bytes) override {
    if (peer == peer_) {
      gate_.AwaitAtLeast(1);
      woke_.AwaitAtLeast(2, std::chrono::milliseconds(300));
    }
    return WaitObservingEndpoint::PostSend(peer, tag, data, bytes);
  }

 private:
  int peer_;
  Arrivals& gate_;
  Arrivals& woke_;
};

// An empty call on which every rank agrees: rank 1 has every fingerprint,
// returns and is lost (its process exits and closes its endpoints) while
// ranks 0 and 2 still wait, rank 2 for rank 0's fingerprint (held back
// until rank 1 is gone and rank 2 has come back from a second wait, or 300
// ms). They kept a stop note's receive posted from rank 1 to the end, and
// its loss failed their call with PEER_LOST although every rank agreed (rank
// 2's second wait came back with it); a peer whose fingerprint agreed has
// no note to send.
TEST(RingAllReduceTest, EmptyCallOutlivesAnAgreeingPeerThatLeft) {
  p2p::LoopbackHub hub(3);
  Arrivals rank1_gone, rank2_woke;
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  auto statuses = ::ddp::transport::testing::RunRanks(
      hub,
      [&](p2p::PointToPoint& endpoint) -> Status {
        const int r = endpoint.rank();
        SendHoldingEndpoint holding(endpoint, 2, rank1_gone, rank2_woke);
        WaitCountingEndpoint counting(endpoint, rank2_woke, /*returns=*/true);
        p2p::PointToPoint& p2p = r == 0   ? static_cast<p2p::PointToPoint&>(holding)
                                 : r == 2 ? static_cast<p2p::PointToPoint&>(counting)
                                          : endpoint;
        CollectiveArgs args;
        args.count = 0;
        args.dtype = DataType::kF32;
        args.tag = CollectiveTag(0);
        args.call_id = 1;
        args.deadline = DeadlineIn(std::chrono::seconds(6));
        Status status = RingAllReduce(p2p, args);
        if (r == 1) {
          hub.Kill(1);
          rank1_gone.Arrive();
        }
        return status;
      },
      options);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

// Tuning::chunk_bytes must be equal on every rank, but the argument check
// does not compare it (the fingerprint's messages stay within UCX's short
// messages). A rank that passes another one sends chunks of other sizes:
// every rank fails at once, and the error names chunk_bytes as a cause. It
// said only "message size mismatch" or "did not match its own arguments
// (ring all-reduce, count 16 of f32, op sum)", with every value compared
// alike.
TEST(RingAllReduceTest, AnotherChunkSizeOnOneRankFailsEveryRankNamingIt) {
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  for (int world : {2, 3, 4}) {
    const auto start = std::chrono::steady_clock::now();
    auto statuses = ::ddp::transport::testing::RunRanks(
        world,
        [&](p2p::PointToPoint& p2p) -> Status {
          std::vector<float> send(16, 1.0f), recv(16);
          CollectiveArgs args;
          args.send = send.data();
          args.recv = recv.data();
          args.count = send.size();
          args.tag = CollectiveTag(0);
          args.call_id = 1;
          args.tuning.chunk_bytes = p2p.rank() == 0 ? 4 : 8;
          args.deadline = DeadlineIn(std::chrono::seconds(30));
          return RingAllReduce(p2p, args);
        },
        options);
    // Far below the 30 s deadline, far above a normal run on a loaded host.
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15))
        << world << " ranks: some rank waited for its deadline";
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument)
          << world << " ranks, rank " << r << ": " << statuses[r];
      EXPECT_NE(statuses[r].message().find("tuning.chunk_bytes"), std::string::npos)
          << world << " ranks, rank " << r << ": " << statuses[r];
    }
  }
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
