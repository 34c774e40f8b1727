#include "transport/algorithms/exchange.h"

#include <atomic>
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
    std::vector<ExchangeBlock> blocks(3);
    for (int q = 0; q < 3; ++q) blocks[q] = {data.data(), 1, data.data() + 4 + q, 1};  // own byte per peer
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

// A recv block that overlaps another recv block or a send block is refused,
// naming both ranks, before anything moves (the bytes that landed there were
// whichever transfer came last, and the call returned OK); send blocks that
// share bytes, one buffer for every peer, are fine.
TEST(DirectExchange, RecvBlocksOverlappingOtherBlocksAreNamed) {
  constexpr int kWorld = 3;
  enum class Layout { kRecvOverlapsRecv, kSendOverlapsRecv, kSharedSend };
  for (Layout layout : {Layout::kRecvOverlapsRecv, Layout::kSendOverlapsRecv, Layout::kSharedSend}) {
    std::vector<std::string> wrong(kWorld);
    auto statuses = RunRanks(kWorld, [&](p2p::PointToPoint& p2p) -> Status {
      const int r = p2p.rank();
      // 4 bytes to and from each peer; the peers in ascending order.
      const int a = (r + 1) % kWorld < (r + 2) % kWorld ? (r + 1) % kWorld : (r + 2) % kWorld;
      const int b = a == (r + 1) % kWorld ? (r + 2) % kWorld : (r + 1) % kWorld;
      std::vector<unsigned char> buf(32, 0);
      const std::vector<unsigned char> out(4, static_cast<unsigned char>(10 + r));
      std::vector<ExchangeBlock> blocks(kWorld);
      blocks[a] = {out.data(), 4, buf.data() + 8, 4};
      blocks[b] = {out.data(), 4, buf.data() + 16, 4};
      if (layout == Layout::kRecvOverlapsRecv) blocks[b].recv = buf.data() + 10;
      if (layout == Layout::kSendOverlapsRecv) blocks[b].send = buf.data() + 14;
      DDP_RETURN_IF_ERROR(DirectExchange(p2p, blocks, Args(5s)));
      if (buf[8] != 10 + a || buf[16] != 10 + b) wrong[r] = "wrong bytes";
      return Status();
    });
    for (int r = 0; r < kWorld; ++r) {
      const int a = r == 0 ? 1 : 0, b = r == 2 ? 1 : 2;
      switch (layout) {
        case Layout::kRecvOverlapsRecv:
          EXPECT_THAT(statuses[r].message(),
                      HasSubstr("the recv blocks for ranks " + std::to_string(a) + " and " +
                                std::to_string(b) + " overlap"))
              << "rank " << r << ": " << statuses[r];
          break;
        case Layout::kSendOverlapsRecv:
          EXPECT_THAT(statuses[r].message(),
                      HasSubstr("the send block for rank " + std::to_string(b) +
                                " overlaps the recv block for rank " + std::to_string(b)))
              << "rank " << r << ": " << statuses[r];
          break;
        case Layout::kSharedSend:
          EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
          EXPECT_EQ(wrong[r], "") << "rank " << r;
          break;
      }
      if (layout != Layout::kSharedSend) {
        EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r;
      }
    }
  }
}

// One rank passes another dtype of the same size (i32 where the others
// pass f32) or another count, at every place of 5 and 6 ranks, every pair
// exchanging 4 bytes: no rank may return OK, and the difference is named.
// Each rank checked its ring predecessor only, and the sends go out before
// the first wait: without the harness killing failed ranks, ranks
// elsewhere took the odd rank's bytes as f32 and returned OK. A rank whose
// peer failed before that peer's fingerprint reached it fails as PEER_LOST
// (killed) or at its deadline (not killed) instead of naming the
// difference: short deadlines without the kill.
TEST(DirectExchange, OneRankWithAnotherDtypeOrCountFailsEveryRank) {
  for (bool empty_messages : {false, true}) {
    for (bool kill : {true, false}) {
      for (int world : {5, 6}) {
        if (!kill && world != 5) continue;  // deadlines: keeps the test short
        for (int odd = 0; odd < world; ++odd) {
          for (bool dtype : {true, false}) {
            const std::string what = std::string(empty_messages ? "empty messages, " : "") +
                                     (kill ? "" : "no kill, ") + "world=" +
                                     std::to_string(world) + " odd rank " +
                                     std::to_string(odd) + (dtype ? " i32" : " count 5");
            const std::string want_odd = dtype ? "count 4 of i32" : "count 5 of f32";
            const auto timeout = kill ? Clock::duration(10s) : Clock::duration(300ms);
            std::vector<Clock::duration> took(world);
            ::ddp::transport::testing::HarnessOptions options;
            options.kill_on_error = kill;
            auto statuses = RunRanks(
                world,
                [&](p2p::PointToPoint& p2p) -> Status {
                  const int r = p2p.rank();
                  std::vector<float> out(world, 1.0f), in(world, 0.0f);
                  std::vector<ExchangeBlock> blocks(world);
                  for (int q = 0; q < world; ++q) blocks[q] = {&out[q], 4, &in[q], 4};
                  CollectiveArgs args;
                  args.count = r == odd && !dtype ? 5 : 4;
                  args.dtype = r == odd && dtype ? DataType::kI32 : DataType::kF32;
                  const auto start = Clock::now();
                  args.deadline = start + timeout;
                  Status status = DirectExchange(p2p, blocks, args, empty_messages);
                  took[r] = Clock::now() - start;
                  return status;
                },
                options);
            int named = 0;
            for (int r = 0; r < world; ++r) {
              const Status& s = statuses[r];
              EXPECT_FALSE(s.ok()) << what << ": rank " << r << " returned OK";
              EXPECT_LT(took[r], kill ? Clock::duration(2s) : timeout + 2s)
                  << what << ": rank " << r << ": " << s;
              named += s.code() == StatusCode::kInvalidArgument &&
                       s.message().find("rank " + std::to_string(odd) + " passed") !=
                           std::string::npos &&
                       s.message().find(want_odd) != std::string::npos &&
                       s.message().find("count 4 of f32") != std::string::npos;
            }
            EXPECT_GT(named, 0) << what << ": no rank named the difference";
            // The first case that fails says enough.
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

// With empty messages (as the communicator's all-to-all with a size per
// pair runs it), a pair that disagrees on one block's size fails on both
// of its ranks, each naming both ranks and both sizes: rank `from` sends 4
// bytes to rank `to`, which expects 2 or 8. Only the receiver failed
// before (its receive was the wrong size); the sender returned OK. The
// other ranks are not asserted on: the pair's failed ranks may cancel
// blocks meant for them (short deadline, nobody killed). Once both ranks
// of the pair have their results, every rank is killed, so that the others
// stop waiting for their deadline (up to 2 s a case; 6 s over the 24).
TEST(DirectExchange, APairDisagreeingOnABlockSizeFailsBothOfItsRanks) {
  constexpr int kWorld = 4;
  for (int from = 0; from < kWorld; ++from) {
    for (int to = 0; to < kWorld; ++to) {
      if (from == to) continue;
      for (size_t expected : {size_t{2}, size_t{8}}) {
        const std::string what = "rank " + std::to_string(from) + " sends rank " +
                                 std::to_string(to) + " 4 bytes, which expects " +
                                 std::to_string(expected);
        p2p::LoopbackHub hub(kWorld);
        std::atomic<int> pair_done{0};
        auto statuses = RunRanks(
            hub,
            [&](p2p::PointToPoint& p2p) -> Status {
              const int r = p2p.rank();
              std::vector<unsigned char> out(4 * kWorld, 1), in(8 * kWorld, 0);
              std::vector<ExchangeBlock> blocks(kWorld);
              for (int q = 0; q < kWorld; ++q) {
                blocks[q] = {&out[4 * q], 4, &in[8 * q], r == to && q == from ? expected : 4};
              }
              Status status = DirectExchange(p2p, blocks, Args(2s), /*empty_messages=*/true);
              if ((r == from || r == to) && pair_done.fetch_add(1) == 1) {
                for (int q = 0; q < kWorld; ++q) hub.Kill(q);
              }
              return status;
            },
            {.kill_on_error = false});
        const std::string want = "rank " + std::to_string(from) + " sends rank " +
                                 std::to_string(to) + " 4 bytes but rank " + std::to_string(to) +
                                 " expects " + std::to_string(expected);
        for (int r : {from, to}) {
          EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument)
              << what << ": rank " << r << ": " << statuses[r];
          EXPECT_THAT(statuses[r].message(), HasSubstr(want)) << what << ": rank " << r;
        }
        if (HasFailure()) return;  // the first case says enough
      }
    }
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
