#include "transport/algorithms/gather_scatter.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/algorithms/disagreement_test_util.h"
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


// Rank q's block: Contributions of rank q (distinct per rank and element).
std::vector<unsigned char> Block(DataType dtype, int q, size_t count) {
  return Contributions(ReduceOp::kSum, dtype, q, count);
}

// The root's whole buffer: every rank's block, in rank order.
std::vector<unsigned char> AllBlocks(DataType dtype, int world, size_t count) {
  std::vector<unsigned char> all;
  for (int q = 0; q < world; ++q) {
    const std::vector<unsigned char> b = Block(dtype, q, count);
    all.insert(all.end(), b.begin(), b.end());
  }
  return all;
}

void CheckGather(int world, int root, size_t count, DataType dtype, bool in_place) {
  const std::string what = "gather world=" + std::to_string(world) + " root=" +
                           std::to_string(root) + " count=" + std::to_string(count) + " " +
                           DataTypeName(dtype) + (in_place ? " in-place" : "");
  const size_t es = DataTypeSize(dtype);
  const std::vector<unsigned char> want = AllBlocks(dtype, world, count);
  std::vector<std::string> wrong(world);
  auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
    const int r = p2p.rank();
    const bool is_root = r == root;
    std::vector<unsigned char> send = Block(dtype, r, count);
    std::vector<unsigned char> recv(world * count * es + 1, 0x5A);
    CollectiveArgs args;
    args.send = send.data();
    if (is_root && in_place) {
      if (count > 0) std::memcpy(recv.data() + r * count * es, send.data(), count * es);
      args.send = recv.data() + r * count * es;
    }
    args.recv = is_root ? recv.data() : nullptr;
    args.count = count;
    args.dtype = dtype;
    args.root = root;
    args.deadline = DeadlineIn(30s);
    DDP_RETURN_IF_ERROR(Gather(p2p, args));
    if (is_root) {
      wrong[r] = Compare(dtype, recv.data(), want.data(), world * count);
      if (recv[world * count * es] != 0x5A) wrong[r] = "wrote past the end of recv";
    }
    return Status();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << what << " rank " << r << ": " << statuses[r];
    EXPECT_EQ(wrong[r], "") << what << " rank " << r;
  }
}

void CheckScatter(int world, int root, size_t count, DataType dtype, bool in_place) {
  const std::string what = "scatter world=" + std::to_string(world) + " root=" +
                           std::to_string(root) + " count=" + std::to_string(count) + " " +
                           DataTypeName(dtype) + (in_place ? " in-place" : "");
  const size_t es = DataTypeSize(dtype);
  std::vector<std::string> wrong(world);
  auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
    const int r = p2p.rank();
    const bool is_root = r == root;
    std::vector<unsigned char> send = AllBlocks(dtype, world, count);
    std::vector<unsigned char> recv(count * es + 1, 0x5A);
    CollectiveArgs args;
    args.send = is_root ? send.data() : nullptr;
    args.recv = is_root && in_place ? send.data() + r * count * es : recv.data();
    args.count = count;
    args.dtype = dtype;
    args.root = root;
    args.deadline = DeadlineIn(30s);
    DDP_RETURN_IF_ERROR(Scatter(p2p, args));
    const std::vector<unsigned char> want = Block(dtype, r, count);
    wrong[r] = Compare(dtype, args.recv, want.data(), count);
    if (!(is_root && in_place) && recv[count * es] != 0x5A) wrong[r] = "wrote past the end";
    if (is_root && Compare(dtype, send.data(), AllBlocks(dtype, world, count).data(),
                           world * count) != "") {
      wrong[r] = "the root's send buffer changed";
    }
    return Status();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << what << " rank " << r << ": " << statuses[r];
    EXPECT_EQ(wrong[r], "") << what << " rank " << r;
  }
}

class GatherScatterWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(GatherScatterWorldTest, EveryRootAndCount) {
  const int world = GetParam();
  for (int root = 0; root < world; ++root) {
    for (size_t count : {size_t{0}, size_t{1}, static_cast<size_t>(world + 2), size_t{37}}) {
      CheckGather(world, root, count, DataType::kF32, root % 2 == 1);
      CheckScatter(world, root, count, DataType::kF32, root % 2 == 0);
    }
  }
}

TEST_P(GatherScatterWorldTest, EveryType) {
  for (DataType dtype : kAllDataTypes) {
    CheckGather(GetParam(), GetParam() / 2, 19, dtype, false);
    CheckScatter(GetParam(), GetParam() - 1, 19, dtype, true);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, GatherScatterWorldTest,
                         ::testing::Values(1, 2, 3, 4, 5, 7, 9, 16));

TEST(GatherScatterTest, LargeBlocks) {
  CheckGather(4, 3, (1 << 18) + 1, DataType::kF32, false);
  CheckScatter(3, 1, (1 << 18) + 3, DataType::kBF16, false);
}

TEST(GatherScatterTest, RootOutOfRangeIsNamedOnEveryRank) {
  for (bool gather : {true, false}) {
    auto statuses = RunRanks(3, [&](p2p::PointToPoint& p2p) -> Status {
      std::vector<float> buf(12);
      CollectiveArgs args;
      args.send = buf.data();
      args.recv = buf.data();
      args.count = 4;
      args.root = 7;
      args.deadline = DeadlineIn(5s);
      return gather ? Gather(p2p, args) : Scatter(p2p, args);
    });
    for (const Status& s : statuses) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_THAT(s.message(), HasSubstr(std::string(gather ? "gather" : "scatter") +
                                         ": root 7 is outside [0, 3)"));
    }
  }
}

TEST(GatherScatterTest, BadBuffersAreNamed) {
  auto statuses = RunRanks(1, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> buf(8);
    CollectiveArgs args;
    args.send = buf.data() + 1;  // inside recv, not at the root's block
    args.recv = buf.data();
    args.count = 4;
    args.deadline = DeadlineIn(5s);
    return Gather(p2p, args);
  });
  EXPECT_THAT(statuses[0].message(), HasSubstr("send overlaps recv other than at the root"));
  statuses = RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<float> buf(8);
    CollectiveArgs args;
    args.send = p2p.rank() == 0 ? nullptr : buf.data();  // needed on the root only
    args.recv = buf.data();
    args.count = 4;
    args.deadline = DeadlineIn(5s);
    return Scatter(p2p, args);
  });
  EXPECT_THAT(statuses[0].message(), HasSubstr("scatter: send buffer is null"));
}

// A count whose root buffer (size() blocks) overflows the address space,
// though one block fits, is refused on every rank, naming the count, not
// only on the root while the others wait for it; and the root names the
// overflow, not an overlap found with wrapped sums.
TEST(GatherScatterTest, CountWhoseRootBufferOverflowsIsRefusedOnEveryRank) {
  constexpr int kWorld = 3;
  const size_t count = std::numeric_limits<size_t>::max() / 8 / kWorld + 1;  // count * 8 fits
  const std::string error = "count " + std::to_string(count) + " of i64 times 3 ranks overflows the address space";
  for (bool gather : {true, false}) {
    for (int root : {0, 2}) {
      SCOPED_TRACE(std::string(gather ? "gather" : "scatter") + " root " + std::to_string(root));
      auto statuses = RunRanks(kWorld, [&](p2p::PointToPoint& p2p) -> Status {
        std::vector<int64_t> send(4, 1), recv(4, 0);
        CollectiveArgs args;
        args.send = send.data();
        args.recv = recv.data();
        args.count = count;
        args.dtype = DataType::kI64;
        args.root = root;
        args.deadline = DeadlineIn(5s);
        return gather ? Gather(p2p, args) : Scatter(p2p, args);
      });
      for (int r = 0; r < kWorld; ++r) {
        EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << statuses[r];
        EXPECT_THAT(statuses[r].message(), HasSubstr(error)) << "rank " << r;
      }
    }
  }
}

TEST(GatherScatterTest, RanksDisagreeingOnCountOrRootFailFast) {
  for (bool gather : {true, false}) {
    for (bool root_differs : {false, true}) {
      const auto deadline = DeadlineIn(10s);
      auto statuses = RunRanks(4, [&](p2p::PointToPoint& p2p) -> Status {
        std::vector<float> send(4 * 16, 1.0f), recv(4 * 16);
        CollectiveArgs args;
        args.send = send.data();
        args.recv = recv.data();
        args.count = !root_differs && p2p.rank() == 1 ? 12 : 16;
        args.root = root_differs && p2p.rank() == 1 ? 2 : 0;
        args.deadline = deadline;
        return gather ? Gather(p2p, args) : Scatter(p2p, args);
      });
      const std::string what =
          std::string(gather ? "gather" : "scatter") + (root_differs ? " root" : " count");
      EXPECT_LT(Clock::now() + 8s, deadline) << what;
      EXPECT_FALSE(statuses[1].ok()) << what;
      int named = 0;
      for (const Status& s : statuses) named += s.message().find("disagree") != std::string::npos;
      EXPECT_GT(named, 0) << what;
    }
  }
}

// A rank passing another dtype of the same size (bf16 where the others
// pass f16), not next to the root on the ring: the root of a gather (and,
// in a scatter whose root is the odd one, every rank) took its bytes and
// returned OK. Now no rank that takes data from it returns OK.
TEST(GatherScatterTest, ADtypeOfTheSameSizeOnOneRankFailsEveryRankThatTakesItsData) {
  for (bool gather : {true, false}) {
    const int odd = gather ? 2 : 0;  // root 0; rank 2 is not the root's ring neighbour
    const auto deadline = DeadlineIn(10s);
    auto statuses = RunRanks(4, [&](p2p::PointToPoint& p2p) -> Status {
      std::vector<uint16_t> send(4 * 16, 1), recv(4 * 16);
      CollectiveArgs args;
      args.send = send.data();
      args.recv = recv.data();
      args.count = 16;
      args.root = 0;
      args.dtype = p2p.rank() == odd ? DataType::kBF16 : DataType::kF16;
      args.deadline = deadline;
      return gather ? Gather(p2p, args) : Scatter(p2p, args);
    });
    const std::string what = gather ? "gather" : "scatter";
    EXPECT_LT(Clock::now() + 8s, deadline) << what;
    // Gather: the root takes rank 2's block; scatter: every rank takes the
    // root's. Each fails: with the difference, or because the rank that
    // saw it first left the call.
    int named = 0;
    for (int r = 0; r < 4; ++r) {
      const bool takes_odd_data = gather ? r == 0 : r != 0;
      if (takes_odd_data) {
        EXPECT_FALSE(statuses[r].ok()) << what << ": rank " << r << " returned OK";
      }
      named += statuses[r].message().find("disagree") != std::string::npos;
    }
    EXPECT_GT(named, 0) << what;
  }
}

// One rank passes another root, count or dtype of the same size, at every
// place of 5 and 6 ranks: every rank fails at once, naming a rank that
// differs and both values, with no scatter block delivered. Ranks checked
// their ring neighbours and the root only: without the harness killing
// failed ranks, those whose checks passed returned OK (a scatter's ranks
// with their blocks while a rank that took itself for the root failed; a
// gather's senders while the root failed). Run without the kill too: every
// rank must learn of it from the check, not from a peer's death.
TEST(GatherScatterTest, OneRankDisagreeingFailsEveryRankNamingIt) {
  enum class Odd { kRoot, kCount, kDtype };
  for (bool gather : {true, false}) {
    for (bool kill : {true, false}) {
      for (int world : {5, 6}) {
        for (int root : {0, world - 2}) {
          for (int odd = 0; odd < world; ++odd) {
            for (Odd differs : {Odd::kRoot, Odd::kCount, Odd::kDtype}) {
              constexpr size_t kCount = 4;
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
                case Odd::kDtype:
                  want_odd = "of i32";
                  want_rest = "of f32";
                  break;
              }
              const std::string what = std::string(gather ? "gather" : "scatter") +
                                       (kill ? "" : ", no kill") + ", world=" +
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
                    std::vector<float> send(world * (kCount + 1), 1.0f);
                    std::vector<float> recv(world * (kCount + 1), -1.0f);
                    CollectiveArgs args;
                    args.send = send.data();
                    args.recv = recv.data();
                    args.count = kCount;
                    args.dtype = DataType::kF32;
                    args.root = root;
                    args.deadline = deadline;
                    if (r == odd && differs == Odd::kRoot) args.root = odd_root;
                    if (r == odd && differs == Odd::kCount) args.count = kCount + 1;
                    if (r == odd && differs == Odd::kDtype) args.dtype = DataType::kI32;
                    Status status = gather ? Gather(p2p, args) : Scatter(p2p, args);
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

TEST(GatherScatterTest, KilledRankFailsTheRoot) {
  for (bool gather : {true, false}) {
    p2p::LoopbackHub hub(4);
    const auto deadline = DeadlineIn(20s);
    auto statuses = RunRanks(hub, [&](p2p::PointToPoint& p2p) -> Status {
      if (p2p.rank() == 2) {
        std::this_thread::sleep_for(50ms);
        hub.Kill(2);
        return AbortedError("killed");
      }
      // Rank 2 dies before its turn: the root waits on it (gather) or the
      // others wait on a root held up by it (scatter's root sends first).
      std::vector<float> send(4 * 1000, 1.0f), recv(4 * 1000);
      CollectiveArgs args;
      args.send = send.data();
      args.recv = recv.data();
      args.count = 1000;
      args.deadline = deadline;
      return gather ? Gather(p2p, args) : Scatter(p2p, args);
    });
    EXPECT_LT(Clock::now() + 15s, deadline);
    if (gather) {
      EXPECT_TRUE(statuses[0].code() == StatusCode::kPeerLost ||
                  statuses[0].code() == StatusCode::kTimedOut)
          << statuses[0];
    } else {
      // The root's send to the dead rank fails, or the rank after it loses
      // its argument check.
      int failed = 0;
      for (int r : {0, 1, 3}) failed += !statuses[r].ok();
      EXPECT_GT(failed, 0);
    }
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
