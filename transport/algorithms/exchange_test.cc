#include "transport/algorithms/exchange.h"

#include <chrono>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/algorithms/broadcast.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms {
namespace {

using namespace std::chrono_literals;
using ::ddp::transport::testing::RunRanks;
using ::testing::HasSubstr;

// Bytes rank `from` sends to rank `to`: a size that differs per pair (some
// pairs send nothing) and contents that name both ends.
size_t PairBytes(int from, int to) { return static_cast<size_t>((from * 7 + to * 3) % 5) * 3; }
unsigned char PairByte(int from, int to, size_t i) {
  return static_cast<unsigned char>(from * 31 + to * 17 + i);
}

CollectiveArgs Args(std::chrono::milliseconds timeout, size_t count = 4) {
  CollectiveArgs args;
  args.count = count;
  args.dtype = DataType::kU8;
  args.deadline = DeadlineIn(timeout);
  return args;
}

TEST(DirectExchange, EveryPairGetsItsOwnBytes) {
  for (int world = 1; world <= 5; ++world) {
    std::vector<std::string> wrong(world);
    auto statuses = RunRanks(world, [&](p2p::PointToPoint& p2p) -> Status {
      const int r = p2p.rank(), p = p2p.size();
      std::vector<std::vector<unsigned char>> out(p), in(p);
      std::vector<ExchangeBlock> blocks(p);
      for (int q = 0; q < p; ++q) {
        out[q].resize(PairBytes(r, q));
        for (size_t i = 0; i < out[q].size(); ++i) out[q][i] = PairByte(r, q, i);
        in[q].assign(PairBytes(q, r), 0);
        blocks[q] = {out[q].data(), out[q].size(), in[q].data(), in[q].size()};
      }
      DDP_RETURN_IF_ERROR(DirectExchange(p2p, blocks, Args(10s)));
      for (int q = 0; q < p; ++q) {
        if (q == r) continue;
        for (size_t i = 0; i < in[q].size(); ++i) {
          if (in[q][i] != PairByte(q, r, i)) {
            wrong[r] = "byte " + std::to_string(i) + " from rank " + std::to_string(q);
          }
        }
      }
      return Status();
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(statuses[r].ok()) << "world " << world << " rank " << r << ": " << statuses[r];
      EXPECT_EQ(wrong[r], "") << "world " << world << " rank " << r;
    }
  }
}

TEST(DirectExchange, ARankRunningAnotherCollectiveFailsFastWithBothDescriptions) {
  const auto start = Clock::now();
  auto statuses = RunRanks(3, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<unsigned char> data(8, 1);
    if (p2p.rank() == 1) {
      CollectiveArgs args = Args(20s, data.size());
      args.send = args.recv = data.data();
      return Broadcast(p2p, args);
    }
    std::vector<ExchangeBlock> blocks(3, ExchangeBlock{data.data(), 1, data.data() + 4, 1});
    return DirectExchange(p2p, blocks, Args(20s, data.size()));
  });
  EXPECT_LT(Clock::now() - start, 10s);
  // Rank 1 checks rank 0's fingerprint, rank 2 checks rank 1's: whichever
  // compares first names both collectives; the others may see it die first.
  bool named = false;
  for (const Status& status : statuses) {
    EXPECT_FALSE(status.ok());
    named |= status.code() == StatusCode::kInvalidArgument &&
             status.message().find("broadcast") != std::string::npos &&
             status.message().find("direct exchange") != std::string::npos;
  }
  EXPECT_TRUE(named) << statuses[0] << "\n" << statuses[1] << "\n" << statuses[2];
}

TEST(DirectExchange, AMissingPeerTimesOutAtTheDeadline) {
  const auto start = Clock::now();
  auto statuses = RunRanks(
      2,
      [&](p2p::PointToPoint& p2p) -> Status {
        if (p2p.rank() == 1) return Status();  // never joins
        std::vector<unsigned char> data(2, 1);
        std::vector<ExchangeBlock> blocks(2, ExchangeBlock{data.data(), 1, data.data() + 1, 1});
        return DirectExchange(p2p, blocks, Args(200ms));
      },
      {.kill_on_error = false});
  EXPECT_EQ(statuses[0].code(), StatusCode::kTimedOut) << statuses[0];
  EXPECT_LT(Clock::now() - start, 5s);
}

TEST(DirectExchange, WrongNumberOfBlocksIsRefused) {
  auto statuses = RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    std::vector<ExchangeBlock> blocks(3);
    return DirectExchange(p2p, blocks, Args(1s));
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("3 blocks for 2 ranks"));
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
