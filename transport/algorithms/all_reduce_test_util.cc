#include "transport/algorithms/all_reduce_test_util.h"

#include <algorithm>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/collective_values.h"
#include "transport/testing/data_types.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms::testing {
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

// Bytes after the output that must stay untouched.
constexpr size_t kGuardBytes = 64;
constexpr unsigned char kGuard = 0xA5;

bool IsFailure(StatusCode code) {
  return code == StatusCode::kPeerLost || code == StatusCode::kTimedOut ||
         code == StatusCode::kInvalidArgument || code == StatusCode::kAborted;
}

}  // namespace

std::string ToString(const AllReduceCase& c) {
  return "world=" + std::to_string(c.world) + " count=" + std::to_string(c.count) + " " +
         DataTypeName(c.dtype) + " " + ReduceOpName(c.op) +
         (c.in_place ? " in-place" : " out-of-place") +
         (c.chunk_bytes ? " chunk_bytes=" + std::to_string(c.chunk_bytes) : "") +
         (c.depth ? " depth=" + std::to_string(c.depth) : "");
}

void CheckAllReduce(const AllReduceFn& fn, const AllReduceCase& c) {
  const size_t bytes = c.count * DataTypeSize(c.dtype);
  const std::vector<unsigned char> want = Expectations(c.op, c.dtype, c.world, c.count);
  std::vector<std::string> wrong(c.world);
  auto statuses = RunRanks(c.world, [&](p2p::PointToPoint& p2p) -> Status {
    const int r = p2p.rank();
    std::vector<unsigned char> input = Contributions(c.op, c.dtype, r, c.count);
    std::vector<unsigned char> send(bytes + kGuardBytes, kGuard), recv(bytes + kGuardBytes, kGuard);
    if (bytes > 0) std::memcpy(send.data(), input.data(), bytes);
    CollectiveArgs args;
    args.send = send.data();
    args.recv = c.in_place ? send.data() : recv.data();
    args.count = c.count;
    args.dtype = c.dtype;
    args.op = c.op;
    args.tag = CollectiveTag(7);
    args.deadline = DeadlineIn(30s);
    args.tuning.chunk_bytes = c.chunk_bytes;
    args.tuning.pipeline_depth = c.depth;
    DDP_RETURN_IF_ERROR(fn(p2p, args));
    const auto* out = static_cast<const unsigned char*>(args.recv);
    wrong[r] = Compare(c.dtype, out, want.data(), c.count);
    for (size_t i = bytes; i < bytes + kGuardBytes && wrong[r].empty(); ++i) {
      if (out[i] != kGuard) wrong[r] = "wrote past the end of recv at byte " + std::to_string(i);
    }
    // Out-of-place must leave the input alone.
    if (!c.in_place && wrong[r].empty() && bytes > 0 &&
        std::memcmp(send.data(), input.data(), bytes) != 0) {
      wrong[r] = "modified the send buffer";
    }
    return Status();
  });
  for (int r = 0; r < c.world; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << ToString(c) << " rank " << r << ": " << statuses[r];
    EXPECT_EQ(wrong[r], "") << ToString(c) << " rank " << r;
  }
}

void SweepCounts(const AllReduceFn& fn, int world) {
  const size_t odd = 2 * static_cast<size_t>(world) * 7 + 1;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    for (bool in_place : {false, true}) {
      for (size_t count : {size_t{0}, size_t{1}, static_cast<size_t>(world > 1 ? world - 1 : 2), odd}) {
        CheckAllReduce(fn, {world, count, DataType::kF32, op, in_place});
      }
      // Many chunks per block, with a shallow and a deep pipeline; chunks of
      // 12 bytes (3 floats) do not divide the blocks, so partial chunks and
      // empty trailing chunks occur.
      for (int depth : {1, 3}) {
        CheckAllReduce(fn, {world, 613, DataType::kF32, op, in_place, 12, depth});
      }
      CheckAllReduce(fn, {world, 5000, DataType::kF32, op, in_place, 256, 0});
    }
  }
}

void SweepTypesAndOps(const AllReduceFn& fn, int world, size_t count, size_t chunk_bytes) {
  for (DataType dtype : kAllDataTypes) {
    for (ReduceOp op : kAllOps) {
      for (bool in_place : {false, true}) {
        CheckAllReduce(fn, {world, count, dtype, op, in_place, chunk_bytes});
      }
    }
  }
}

namespace {

// The ranks in `odd_ones` pass `odd_count` to `odd_fn`, the others `count`
// to `fn`: every rank must fail, naming the disagreement, well before the
// deadline.
void CheckOddOnesFailEverywhere(const AllReduceFn& fn, size_t count, const AllReduceFn& odd_fn,
                                size_t odd_count, int world, const std::vector<int>& odd_ones) {
  const auto deadline = DeadlineIn(10s);
  auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
    const bool odd = std::find(odd_ones.begin(), odd_ones.end(), p2p.rank()) != odd_ones.end();
    const size_t n = odd ? odd_count : count;
    std::vector<float> send(n, 1.0f), recv(n);
    CollectiveArgs args;
    args.send = send.data();
    args.recv = recv.data();
    args.count = n;
    args.deadline = deadline;
    args.tuning.chunk_bytes = 16;
    return odd ? odd_fn(p2p, args) : fn(p2p, args);
  });
  // Detected from the arguments, not by waiting for the deadline.
  EXPECT_LT(Clock::now() + 8s, deadline) << "world=" << world;
  bool named_mismatch = false;
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(IsFailure(statuses[r].code())) << "world=" << world << " rank " << r << ": "
                                               << statuses[r];
    named_mismatch |= statuses[r].message().find("disagree on the arguments") != std::string::npos ||
                      statuses[r].message().find("size mismatch") != std::string::npos;
  }
  EXPECT_TRUE(named_mismatch) << "world=" << world << ": no rank reported the size mismatch";
}

}  // namespace

void CheckMismatchedCountsFailEverywhere(const AllReduceFn& fn, int world) {
  const size_t count = 100 + 10 * static_cast<size_t>(world);
  CheckOddOnesFailEverywhere(fn, count, fn, count + 1, world, {world / 2});
}

void CheckEmptyAgainstNonEmptyFailsEverywhere(const AllReduceFn& fn, const AllReduceFn& empty_fn,
                                              int world, std::vector<int> empty_ranks) {
  if (empty_ranks.empty()) empty_ranks = {world / 2};
  CheckOddOnesFailEverywhere(fn, 100 + 10 * static_cast<size_t>(world), empty_fn, 0, world,
                             empty_ranks);
}

void CheckKilledRankFailsSurvivors(const AllReduceFn& fn, int world) {
  const int victim = world - 1;
  const auto deadline = DeadlineIn(20s);
  p2p::LoopbackHub hub(world);
  auto statuses = ::ddp::transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> send(1000, 1.0f), recv(1000);
    CollectiveArgs args;
    args.send = send.data();
    args.recv = recv.data();
    args.count = send.size();
    args.deadline = deadline;
    args.tuning.chunk_bytes = 64;
    std::thread killer;
    if (p2p.rank() == victim) {
      // The victim enters the collective under another tag, so its messages
      // never match and it is certainly stuck inside when it dies.
      args.tag = CollectiveTag(99);
      killer = std::thread([&] {
        std::this_thread::sleep_for(100ms);
        hub.Kill(victim);
      });
    }
    Status status = fn(p2p, args);
    if (killer.joinable()) killer.join();
    return status;
  });
  const auto now = Clock::now();
  EXPECT_LT(now + 15s, deadline) << "survivors took until near the deadline";
  for (int r = 0; r < world; ++r) {
    if (r == victim) {
      EXPECT_FALSE(statuses[r].ok()) << "victim";
      continue;
    }
    EXPECT_TRUE(statuses[r].code() == StatusCode::kPeerLost ||
                statuses[r].code() == StatusCode::kTimedOut)
        << "world=" << world << " rank " << r << ": " << statuses[r];
    // The error says where (a chunk, or the argument check that precedes
    // the data), the direction and the peer.
    EXPECT_THAT(statuses[r].message(),
                ::testing::ContainsRegex("(chunk [0-9]+|argument check): (receive from|send to) "
                                         "(group )?rank [0-9]+"))
        << statuses[r];
  }
  if (world == 4) std::printf("example survivor error: %s\n", statuses[0].ToString().c_str());
}

void CheckAbsentRankTimesOut(const AllReduceFn& fn, int world) {
  const int absent = 0;
  const auto timeout = 300ms;
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  std::vector<Clock::duration> took(world);
  auto statuses = RunRanks(
      world,
      [&](p2p::PointToPoint& p2p) -> Status {
        if (p2p.rank() == absent) return Status();
        std::vector<float> send(100, 1.0f), recv(100);
        CollectiveArgs args;
        args.send = send.data();
        args.recv = recv.data();
        args.count = send.size();
        const auto start = Clock::now();
        args.deadline = start + timeout;
        Status status = fn(p2p, args);
        took[p2p.rank()] = Clock::now() - start;
        return status;
      },
      options);
  for (int r = 0; r < world; ++r) {
    if (r == absent) continue;
    EXPECT_EQ(statuses[r].code(), StatusCode::kTimedOut) << "world=" << world << " rank " << r
                                                         << ": " << statuses[r];
    EXPECT_GE(took[r], timeout) << "rank " << r;
    EXPECT_LT(took[r], timeout + 2s) << "rank " << r << " overstayed its deadline";
  }
}

void CheckTraffic(const AllReduceFn& fn, int world, size_t count, double factor) {
  p2p::LoopbackHub hub(world);
  auto statuses = ::ddp::transport::testing::RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> data(count, 1.0f);
    CollectiveArgs args;
    args.send = data.data();
    args.recv = data.data();
    args.count = count;
    args.deadline = DeadlineIn(30s);
    return fn(p2p, args);
  });
  const double limit = factor * static_cast<double>(count * sizeof(float)) + 1024;
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << statuses[r];
    const p2p::LoopbackStats stats = hub.Stats(r);
    EXPECT_LE(static_cast<double>(stats.bytes_sent), limit) << "world=" << world << " rank " << r;
    EXPECT_LE(static_cast<double>(stats.bytes_received), limit)
        << "world=" << world << " rank " << r;
  }
}

void CheckBadArguments(const AllReduceFn& fn, const std::string& name) {
  struct Bad {
    const char* why;
    std::function<void(CollectiveArgs&, std::vector<float>&)> mutate;
    const char* expect;
  };
  const std::vector<Bad> cases = {
      {"null send", [](CollectiveArgs& a, auto&) { a.send = nullptr; }, "send buffer is null"},
      {"null recv", [](CollectiveArgs& a, auto&) { a.recv = nullptr; }, "recv buffer is null"},
      {"no deadline", [](CollectiveArgs& a, auto&) { a.deadline = Deadline{}; },
       "deadline is not set"},
      {"bad dtype", [](CollectiveArgs& a, auto&) { a.dtype = static_cast<DataType>(42); },
       "dtype 42"},
      {"bad op", [](CollectiveArgs& a, auto&) { a.op = static_cast<ReduceOp>(9); }, "op 9"},
      {"partial overlap",
       [](CollectiveArgs& a, std::vector<float>& buf) {
         a.send = buf.data();
         a.recv = buf.data() + 1;
       },
       "overlap"},
      {"tag too large", [](CollectiveArgs& a, auto&) { a.tag = p2p::kMaxTag; }, "tag"},
      {"negative depth", [](CollectiveArgs& a, auto&) { a.tuning.pipeline_depth = -1; },
       "pipeline_depth -1 is outside [0, 64]"},
      {"huge depth", [](CollectiveArgs& a, auto&) { a.tuning.pipeline_depth = 100000; },
       "pipeline_depth 100000"},
      {"misaligned recv",
       [](CollectiveArgs& a, auto&) { a.recv = static_cast<char*>(a.recv) + 1; },
       "not aligned"},
  };
  for (const Bad& bad : cases) {
    auto statuses = RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
      std::vector<float> buf(40, 1.0f), out(40);
      CollectiveArgs args;
      args.send = buf.data();
      args.recv = out.data();
      args.count = 20;
      args.deadline = DeadlineIn(5s);
      bad.mutate(args, buf);
      return fn(p2p, args);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << bad.why << ": " << statuses[r];
      EXPECT_THAT(statuses[r].message(), HasSubstr(bad.expect)) << bad.why;
      EXPECT_THAT(statuses[r].message(), HasSubstr(name)) << bad.why;
    }
  }
}

}  // namespace ddp::transport::algorithms::testing
