// Two calls of one collective at the same tag, as a caller of the algorithm
// library without the communicator's tag sequence makes them: the data a
// failed first call sent, delivered although cancelled (as UCX does for a
// small send), must not be taken by the second call as its own.

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/algorithms/all_reduce_test_util.h"
#include "transport/algorithms/broadcast.h"
#include "transport/algorithms/exchange.h"
#include "transport/algorithms/gather_scatter.h"
#include "transport/algorithms/pipeline.h"
#include "transport/algorithms/rhd_all_reduce.h"
#include "transport/algorithms/ring_all_reduce.h"
#include "transport/algorithms/rooted_reduce.h"
#include "transport/algorithms/stale_send_test_util.h"
#include "transport/algorithms/tree_all_reduce.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms {
namespace {

using testing::Arrivals;
using testing::CancelledSendDeliveringEndpoint;

constexpr size_t kCount = 8;

// Fails its receive at a data tag of phase `phase` (INTERNAL) that comes
// after `skip` such receives, so that its rank leaves the call after the
// argument check (and, with `skip`, after that many of its peers' data
// messages); passes every other call on.
class FailingDataRecvEndpoint final : public testing::WaitObservingEndpoint {
 public:
  FailingDataRecvEndpoint(p2p::PointToPoint& inner, int phase, size_t skip = 0)
      : WaitObservingEndpoint(inner), phase_(phase), skip_(skip) {}
  StatusOr<p2p::RequestId> PostRecv(int peer, p2p::Tag tag, void* data, size_t bytes) override {
    constexpr p2p::Tag kPhaseTags = p2p::Tag{1} << kStepTagBits;
    const bool data_tag = (tag & (kPhaseTags - 1)) < internal::kDataSteps;
    if (!failed_ && data_tag && static_cast<int>(tag >> kStepTagBits) % kMaxPhases == phase_ &&
        seen_++ == skip_) {
      failed_ = true;
      return InternalError("injected failure of a data receive");
    }
    return WaitObservingEndpoint::PostRecv(peer, tag, data, bytes);
  }

 private:
  const int phase_;
  const size_t skip_;
  size_t seen_ = 0;
  bool failed_ = false;
};

// Runs one call of the collective on `p2p` with `args` (tag, call id,
// deadline and tuning set). Call 1 sends 100s; call 2 sends rank r's
// values r * 10 + i and checks its result.
using RunCall = std::function<Status(p2p::PointToPoint& p2p, CollectiveArgs args, bool second)>;

float Value(int rank, size_t i, bool second) {
  return second ? static_cast<float>(rank * 10) + static_cast<float>(i) : 100.0f;
}

Status ExpectValues(const std::vector<float>& got, const std::function<float(size_t)>& expected,
                    int rank) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != expected(i)) {
      return InternalError("rank " + std::to_string(rank) + " got " +
                           std::to_string(got[i]) + " at " + std::to_string(i) + ", expected " +
                           std::to_string(expected(i)));
    }
  }
  return Status();
}

// Call 1: `sender` fails at its deadline with data sends posted (its peer
// left the call on a failed data receive at `phase`), and those sends are
// delivered all the same. Call 2, at the same tag with the next call id,
// must give the right result on both ranks: when every call used the same
// data tags, the peer took call 1's 100s in place of call 2's data, and
// the sender's own sends of call 2 were never taken (TIMED_OUT).
// `sender_deadline`: how long the sender's call 1 runs, past the time its
// peer takes to fail (`skip` messages).
void ExpectStaleDataIgnored(const RunCall& run, int sender, int phase,
                            const Tuning& tuning = {}, size_t skip = 0,
                            std::chrono::milliseconds sender_deadline =
                                std::chrono::milliseconds(300)) {
  Arrivals first_failed;
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  auto statuses = ::ddp::transport::testing::RunRanks(
      2,
      [&](p2p::PointToPoint& p2p) -> Status {
        const int r = p2p.rank();
        CollectiveArgs args;
        args.tag = CollectiveTag(0);
        args.count = kCount;
        args.tuning = tuning;
        args.tuning.chunk_bytes = sizeof(float);  // several chunks
        args.tuning.pipeline_depth = 2;           // within kMaxNoticesPerPeer
        args.call_id = 1;
        if (r == sender) {
          args.deadline = DeadlineIn(sender_deadline);
          CancelledSendDeliveringEndpoint delivering(p2p);
          Status first = run(delivering, args, false);
          first_failed.Arrive();  // the other rank goes on, whatever came of it
          if (first.ok()) return InternalError("call 1 on the sender returned OK");
          if (delivering.delivered() < 1) {
            return InternalError("call 1 left no cancelled data send to deliver (" +
                                 first.ToString() + ")");
          }
        } else {
          args.deadline = DeadlineIn(sender_deadline + std::chrono::seconds(5));
          FailingDataRecvEndpoint failing(p2p, phase, skip);
          Status first = run(failing, args, false);
          if (first.code() != StatusCode::kInternal) {
            return InternalError("call 1 on the other rank ended with " + first.ToString());
          }
          if (!first_failed.AwaitAtLeast(1)) {
            return TimedOutError("call 1 did not fail on the sender within 20 s");
          }
        }
        args.call_id = 2;
        args.deadline = DeadlineIn(std::chrono::seconds(5));
        return internal::Annotate(run(p2p, args, true), "call 2");
      },
      options);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

// An all-reduce (sum) of kCount floats.
RunCall AllReduceCall(Status (*all_reduce)(p2p::PointToPoint&, const CollectiveArgs&)) {
  return [all_reduce](p2p::PointToPoint& p2p, CollectiveArgs args, bool second) -> Status {
    std::vector<float> send(kCount), recv(kCount);
    for (size_t i = 0; i < kCount; ++i) send[i] = Value(p2p.rank(), i, second);
    args.send = send.data();
    args.recv = recv.data();
    DDP_RETURN_IF_ERROR(all_reduce(p2p, args));
    if (!second) return Status();
    return ExpectValues(recv, [](size_t i) { return 10.0f + 2.0f * static_cast<float>(i); },
                        p2p.rank());
  };
}

// A reduce (sum) to rank 0.
RunCall ReduceCall(Status (*reduce)(p2p::PointToPoint&, const CollectiveArgs&)) {
  return [reduce](p2p::PointToPoint& p2p, CollectiveArgs args, bool second) -> Status {
    std::vector<float> send(kCount), recv(kCount);
    for (size_t i = 0; i < kCount; ++i) send[i] = Value(p2p.rank(), i, second);
    args.send = send.data();
    args.recv = recv.data();
    DDP_RETURN_IF_ERROR(reduce(p2p, args));
    if (!second || p2p.rank() != 0) return Status();
    return ExpectValues(recv, [](size_t i) { return 10.0f + 2.0f * static_cast<float>(i); }, 0);
  };
}

TEST(StaleDataTest, RhdAllReduceInDoublingMode) {
  ExpectStaleDataIgnored(AllReduceCall(RhdAllReduce), /*sender=*/0, /*phase=*/0);
}

TEST(StaleDataTest, RhdAllReduceInHalvingMode) {
  Tuning tuning;
  tuning.rhd_doubling_bytes = 1;
  ExpectStaleDataIgnored(AllReduceCall(RhdAllReduce), /*sender=*/0, /*phase=*/0, tuning);
}

TEST(StaleDataTest, TreeAllReduce) {
  ExpectStaleDataIgnored(AllReduceCall(TreeAllReduce), /*sender=*/0, /*phase=*/0);
}

TEST(StaleDataTest, Broadcast) {
  ExpectStaleDataIgnored(
      [](p2p::PointToPoint& p2p, CollectiveArgs args, bool second) -> Status {
        std::vector<float> buffer(kCount);
        if (p2p.rank() == 0) {
          for (size_t i = 0; i < kCount; ++i) buffer[i] = Value(0, i, second);
        }
        args.send = buffer.data();
        args.recv = buffer.data();
        DDP_RETURN_IF_ERROR(Broadcast(p2p, args));
        if (!second) return Status();
        return ExpectValues(buffer, [](size_t i) { return static_cast<float>(i); }, p2p.rank());
      },
      /*sender=*/0, /*phase=*/0);
}

// A phase of more messages than a call's slot of data tags holds
// (kCallDataSlotSteps): call 1 fails after that many chunks, so its last
// chunks, delivered although cancelled, are past the end of its slot. Call
// 2 must not take them: numbered on from the slot's start, they were at
// the tags of call 2's first chunks, and rank 1 took them as its own.
TEST(StaleDataTest, BroadcastLongerThanACallsSlot) {
  const size_t count = internal::kCallDataSlotSteps + 8;
  ExpectStaleDataIgnored(
      [count](p2p::PointToPoint& p2p, CollectiveArgs args, bool second) -> Status {
        std::vector<float> buffer(count);
        if (p2p.rank() == 0) {
          for (size_t i = 0; i < count; ++i) buffer[i] = Value(0, i, second);
        }
        args.send = buffer.data();
        args.recv = buffer.data();
        args.count = count;
        DDP_RETURN_IF_ERROR(Broadcast(p2p, args));
        if (!second) return Status();
        return ExpectValues(buffer, [](size_t i) { return static_cast<float>(i); }, p2p.rank());
      },
      /*sender=*/0, /*phase=*/0, Tuning{}, /*skip=*/internal::kCallDataSlotSteps,
      /*sender_deadline=*/std::chrono::seconds(6));
}

TEST(StaleDataTest, TreeReduce) {
  ExpectStaleDataIgnored(ReduceCall(TreeReduce), /*sender=*/1, /*phase=*/0);
}

// The ring reduce's gather to the root (phase 1), after its reduce-scatter.
TEST(StaleDataTest, RingReduceGatherToTheRoot) {
  ExpectStaleDataIgnored(ReduceCall(RingReduce), /*sender=*/1, /*phase=*/1);
}

TEST(StaleDataTest, Gather) {
  ExpectStaleDataIgnored(
      [](p2p::PointToPoint& p2p, CollectiveArgs args, bool second) -> Status {
        std::vector<float> send(kCount), recv(2 * kCount);
        for (size_t i = 0; i < kCount; ++i) send[i] = Value(p2p.rank(), i, second);
        args.send = send.data();
        args.recv = recv.data();
        DDP_RETURN_IF_ERROR(Gather(p2p, args));
        if (!second || p2p.rank() != 0) return Status();
        return ExpectValues(
            recv, [](size_t i) { return Value(static_cast<int>(i / kCount), i % kCount, true); },
            0);
      },
      /*sender=*/1, /*phase=*/0);
}

TEST(StaleDataTest, Scatter) {
  ExpectStaleDataIgnored(
      [](p2p::PointToPoint& p2p, CollectiveArgs args, bool second) -> Status {
        std::vector<float> send(2 * kCount), recv(kCount);
        for (size_t i = 0; i < send.size(); ++i) {
          send[i] = Value(static_cast<int>(i / kCount), i % kCount, second);
        }
        args.send = send.data();
        args.recv = recv.data();
        DDP_RETURN_IF_ERROR(Scatter(p2p, args));
        if (!second) return Status();
        const int r = p2p.rank();
        return ExpectValues(recv, [r](size_t i) { return Value(r, i, true); }, r);
      },
      /*sender=*/0, /*phase=*/0);
}

TEST(StaleDataTest, DirectExchange) {
  ExpectStaleDataIgnored(
      [](p2p::PointToPoint& p2p, CollectiveArgs args, bool second) -> Status {
        const int r = p2p.rank(), peer = 1 - r;
        std::vector<float> send(kCount), recv(kCount);
        for (size_t i = 0; i < kCount; ++i) send[i] = Value(r, i, second);
        std::vector<ExchangeBlock> blocks(2);
        blocks[peer] = {send.data(), kCount * sizeof(float), recv.data(), kCount * sizeof(float)};
        DDP_RETURN_IF_ERROR(DirectExchange(p2p, blocks, args));
        if (!second) return Status();
        return ExpectValues(recv, [peer](size_t i) { return Value(peer, i, true); }, r);
      },
      /*sender=*/0, /*phase=*/0);
}

// Two calls at the same tag with different counts. In call 1 rank 1 stays
// out and rank 0 fails at its deadline; its fingerprint, cancelled, still
// reaches rank 1 (as on UCX). Call 2, with another count on both ranks,
// must not take it as its own: when every call checked at the same tag,
// rank 1 compared call 1's count (8) with its own (16) and failed
// INVALID_ARGUMENT, "ranks disagree on the arguments", on a correct call.
void ExpectStaleFingerprintIgnored(Status (*collective)(p2p::PointToPoint&,
                                                        const CollectiveArgs&)) {
  Arrivals first_failed;
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  auto statuses = ::ddp::transport::testing::RunRanks(
      2,
      [&](p2p::PointToPoint& p2p) -> Status {
        const int r = p2p.rank();
        CollectiveArgs args;
        args.tag = CollectiveTag(0);
        if (r == 0) {
          std::vector<float> send(kCount, 1.0f), recv(kCount);
          args.send = send.data();
          args.recv = recv.data();
          args.count = kCount;
          args.call_id = 1;
          args.deadline = DeadlineIn(std::chrono::milliseconds(300));
          CancelledSendDeliveringEndpoint delivering(p2p, /*deliver_checks=*/true);
          Status first = collective(delivering, args);
          first_failed.Arrive();
          if (first.ok()) return InternalError("call 1 on rank 0 returned OK");
          if (delivering.delivered() < 1) {
            return InternalError("call 1 left no cancelled send to deliver (" + first.ToString() +
                                 ")");
          }
        } else if (!first_failed.AwaitAtLeast(1)) {
          return TimedOutError("call 1 did not fail on rank 0 within 20 s");
        }
        std::vector<float> send(2 * kCount, 1.0f), recv(2 * kCount);
        args.send = send.data();
        args.recv = recv.data();
        args.count = 2 * kCount;
        args.call_id = 2;
        args.deadline = DeadlineIn(std::chrono::seconds(5));
        return internal::Annotate(collective(p2p, args), "call 2");
      },
      options);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

TEST(StaleFingerprintTest, RingAllReduce) { ExpectStaleFingerprintIgnored(RingAllReduce); }

TEST(StaleFingerprintTest, RhdAllReduce) { ExpectStaleFingerprintIgnored(RhdAllReduce); }

// CheckEveryRank's first round.
TEST(StaleFingerprintTest, Broadcast) { ExpectStaleFingerprintIgnored(Broadcast); }

}  // namespace
}  // namespace ddp::transport::algorithms
