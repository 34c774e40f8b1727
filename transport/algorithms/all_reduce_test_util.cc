#include "transport/algorithms/all_reduce_test_util.h"

#include <algorithm>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
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
using ::ddp::transport::testing::Load;
using ::ddp::transport::testing::RunRanks;
using ::ddp::transport::testing::Store;
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

// Unit roundoff of the floating dtypes (half the distance from 1 to the next
// value).
double UnitRoundoff(DataType dtype) {
  switch (dtype) {
    case DataType::kF16: return std::ldexp(1.0, -11);
    case DataType::kBF16: return std::ldexp(1.0, -8);
    case DataType::kF64: return std::ldexp(1.0, -53);
    default: return std::ldexp(1.0, -24);
  }
}

// A quiet NaN of `dtype` whose payload is `payload` (a few low bits).
void StoreNaN(DataType dtype, void* buf, size_t i, unsigned payload) {
  if (dtype == DataType::kF32) {
    const uint32_t bits = 0x7fc00000u | (payload & 0xffu);
    std::memcpy(static_cast<unsigned char*>(buf) + 4 * i, &bits, 4);
  } else {
    const uint16_t bits =
        static_cast<uint16_t>((dtype == DataType::kF16 ? 0x7e00u : 0x7fc0u) | (payload & 0x1fu));
    std::memcpy(static_cast<unsigned char*>(buf) + 2 * i, &bits, 2);
  }
}

// Rank `rank`'s random input for one case of SweepRandomValues, in `dtype`:
// non-integers (so that the reduction's order shows in the low bits), and
// at the front a few special payloads: +0 on even ranks and -0 on odd ones
// (max and min of the two depend on the operands' order), -0 everywhere,
// NaNs with a payload per rank (which NaN survives a sum depends on the
// order), and one NaN on the last rank only.
constexpr size_t kSpecials = 4;
std::vector<unsigned char> RandomInput(DataType dtype, ReduceOp op, int world, int rank,
                                       size_t count) {
  std::mt19937_64 gen(static_cast<uint64_t>(world) * 1000003u + static_cast<uint64_t>(rank) * 7919u +
                      static_cast<uint64_t>(dtype) * 101u + static_cast<uint64_t>(op));
  // Products stay near 1 so that 16 of them keep full precision in f16.
  std::uniform_real_distribution<double> value(op == ReduceOp::kProd ? 0.8 : -1.0,
                                               op == ReduceOp::kProd ? 1.25 : 1.0);
  std::bernoulli_distribution negative(0.5);
  std::vector<unsigned char> buf(count * DataTypeSize(dtype));
  for (size_t i = 0; i < count; ++i) {
    double v = value(gen);
    if (op == ReduceOp::kProd && negative(gen)) v = -v;
    Store(dtype, buf.data(), i, v);
  }
  if (count >= kSpecials) {
    Store(dtype, buf.data(), 0, rank % 2 == 0 ? 0.0 : -0.0);
    Store(dtype, buf.data(), 1, -0.0);
    StoreNaN(dtype, buf.data(), 2, 1u + static_cast<unsigned>(rank));
    if (rank == world - 1) StoreNaN(dtype, buf.data(), 3, 3u);
  }
  return buf;
}

}  // namespace

void SweepRandomValues(const AllReduceFn& fn, int world, size_t count, size_t chunk_bytes) {
  for (DataType dtype : {DataType::kF32, DataType::kF16, DataType::kBF16}) {
    const size_t es = DataTypeSize(dtype);
    for (ReduceOp op : kAllOps) {
      const bool in_place = (static_cast<int>(op) + static_cast<int>(dtype)) % 2 == 0;
      const AllReduceCase c{world, count, dtype, op, in_place, chunk_bytes};
      std::vector<std::vector<unsigned char>> inputs(world), outputs(world);
      for (int r = 0; r < world; ++r) inputs[r] = RandomInput(dtype, op, world, r, count);
      auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
        const int r = p2p.rank();
        std::vector<unsigned char> send = inputs[r];
        outputs[r].assign(count * es, 0);
        CollectiveArgs args;
        args.send = send.data();
        args.recv = in_place ? send.data() : outputs[r].data();
        args.count = count;
        args.dtype = dtype;
        args.op = op;
        args.tag = CollectiveTag(11);
        args.deadline = DeadlineIn(30s);
        args.tuning.chunk_bytes = chunk_bytes;
        DDP_RETURN_IF_ERROR(fn(p2p, args));
        if (in_place) outputs[r] = send;
        return Status();
      });
      bool all_ok = true;
      for (int r = 0; r < world; ++r) {
        EXPECT_TRUE(statuses[r].ok()) << ToString(c) << " rank " << r << ": " << statuses[r];
        all_ok &= statuses[r].ok();
      }
      if (!all_ok) continue;
      // Every rank holds the same bits: an all-reduce whose ranks reduce in
      // different orders gives models that drift apart.
      for (int r = 1; r < world; ++r) {
        if (std::memcmp(outputs[r].data(), outputs[0].data(), count * es) == 0) continue;
        size_t i = 0;
        while (std::memcmp(outputs[r].data() + i * es, outputs[0].data() + i * es, es) == 0) ++i;
        auto bits = [&](int rank) {
          uint32_t b = 0;
          std::memcpy(&b, outputs[rank].data() + i * es, es);
          char text[16];
          std::snprintf(text, sizeof(text), "0x%0*x", static_cast<int>(2 * es), b);
          return std::to_string(Load(dtype, outputs[rank].data(), i)) + " (" + text + ")";
        };
        ADD_FAILURE() << ToString(c) << ": rank " << r << " differs from rank 0 at element " << i
                      << ": " << bits(r) << " against " << bits(0);
      }
      // And close to the exact result of the rounded inputs: each of the
      // world - 1 reductions (and avg's division) rounds once.
      const double u = UnitRoundoff(dtype);
      size_t bad = 0;
      std::string first_bad;
      for (size_t i = 0; i < count; ++i) {
        double exact = op == ReduceOp::kProd ? 1.0 : 0.0, magnitude = op == ReduceOp::kProd ? 1.0 : 0.0;
        bool nan = false;
        for (int r = 0; r < world; ++r) {
          const double x = Load(dtype, inputs[r].data(), i);
          nan |= std::isnan(x);
          switch (op) {
            case ReduceOp::kSum:
            case ReduceOp::kAvg: exact += x; magnitude += std::fabs(x); break;
            case ReduceOp::kProd: exact *= x; magnitude *= std::fabs(x); break;
            case ReduceOp::kMax: exact = r == 0 ? x : std::max(exact, x); break;
            case ReduceOp::kMin: exact = r == 0 ? x : std::min(exact, x); break;
          }
        }
        if (op == ReduceOp::kAvg) {
          exact /= world;
          magnitude /= world;
        }
        const double got = Load(dtype, outputs[0].data(), i);
        const double tolerance = (op == ReduceOp::kMax || op == ReduceOp::kMin)
                                     ? 0.0
                                     : 2.0 * (world + 1) * u * magnitude + 1e-7;
        const bool good = nan ? std::isnan(got) : std::fabs(got - exact) <= tolerance;
        if (!good && bad++ == 0) {
          first_bad = "element " + std::to_string(i) + " is " + std::to_string(got) +
                      ", exact " + std::to_string(exact);
        }
      }
      EXPECT_EQ(bad, 0u) << ToString(c) << ": " << bad << " elements off the exact result, first "
                         << first_bad;
    }
  }
}

namespace {

// The ranks in `odd_ones` pass `odd_count` to `odd_fn`, the others `count`
// to `fn`: every rank must fail, naming the disagreement, well before the
// deadline. Run twice: with the harness killing a failed rank (as a crashed
// process looks to its peers), and without, where a rank that rejects the
// arguments and returns must still make its peers fail, not leave them
// waiting for it until their deadlines.
void CheckOddOnesFailEverywhere(const AllReduceFn& fn, size_t count, const AllReduceFn& odd_fn,
                                size_t odd_count, int world, const std::vector<int>& odd_ones) {
  for (bool kill : {true, false}) {
    ::ddp::transport::testing::HarnessOptions options;
    options.kill_on_error = kill;
    const std::string label = "world=" + std::to_string(world) +
                              (kill ? " (failed ranks killed)" : " (nobody killed)");
    // Without the kill, a rank that is not next to the odd one learns of
    // the mismatch only at its deadline (see the header): a short one.
    const Clock::duration timeout = kill ? Clock::duration(10s) : Clock::duration(300ms);
    std::vector<Clock::duration> took(world);
    auto statuses = RunRanks(
        world,
        [&](p2p::PointToPoint& p2p) -> Status {
          const bool odd =
              std::find(odd_ones.begin(), odd_ones.end(), p2p.rank()) != odd_ones.end();
          const size_t n = odd ? odd_count : count;
          std::vector<float> send(n, 1.0f), recv(n);
          CollectiveArgs args;
          args.send = send.data();
          args.recv = recv.data();
          args.count = n;
          const auto start = Clock::now();
          args.deadline = start + timeout;
          args.tuning.chunk_bytes = 16;
          Status status = odd ? odd_fn(p2p, args) : fn(p2p, args);
          took[p2p.rank()] = Clock::now() - start;
          return status;
        },
        options);
    bool named_mismatch = false;
    for (int r = 0; r < world; ++r) {
      // No rank returns OK, with or without the kill.
      EXPECT_TRUE(IsFailure(statuses[r].code())) << label << " rank " << r << ": "
                                                 << statuses[r];
      if (kill) {
        // Detected from the arguments, not by waiting for the deadline.
        EXPECT_LT(took[r], 2s) << label << " rank " << r << " waited for its deadline: "
                               << statuses[r];
      } else {
        EXPECT_LT(took[r], timeout + 2s) << label << " rank " << r << " overstayed its deadline";
      }
      named_mismatch |=
          statuses[r].message().find("disagree on the arguments") != std::string::npos ||
          statuses[r].message().find("size mismatch") != std::string::npos;
    }
    EXPECT_TRUE(named_mismatch) << label << ": no rank reported the size mismatch";
  }
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
