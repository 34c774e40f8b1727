#include "transport/algorithms/block_owner_test_util.h"

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/p2p/group_view.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms::testing {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::vector<int>& RingViewOrder() {
  static const std::vector<int> order = {0, 2, 1, 3};
  return order;
}

const std::vector<int>& RingViewHosts() {
  static const std::vector<int> hosts = {0, 1, 0, 1};
  return hosts;
}

Status RunOnRingView(p2p::PointToPoint& p2p, CollectiveArgs args, const BlockCollectiveFn& fn) {
  DDP_ASSIGN_OR_RETURN(p2p::GroupView view, p2p::GroupView::Create(p2p, RingViewOrder()));
  args.tuning.block_owner = &RingViewOrder();
  return fn(view, args);
}

void ExpectRingViewHalvesTheCrossing(const uint64_t crossing[2]) {
  EXPECT_GT(crossing[0], 0u);
  EXPECT_EQ(2 * crossing[1], crossing[0]);
}

void ExpectBlockOwnersThatAreNotPermutationsRefused(const BlockCollectiveFn& fn,
                                                    size_t send_blocks, size_t recv_blocks) {
  constexpr int kWorld = 3;
  constexpr size_t kCount = 4;
  const struct {
    std::vector<int> owner;
    const char* error;
  } cases[] = {
      {{0, 0, 2}, "tuning.block_owner lists rank 0 twice (entries 0 and 1)"},
      {{0, 1, 3}, "tuning.block_owner[2] is 3, outside [0, 3)"},
      {{2, -1, 0}, "tuning.block_owner[1] is -1, outside [0, 3)"},
      {{0}, "tuning.block_owner has 1 entries for 3 ranks"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.error);
    auto statuses = transport::testing::RunRanks(kWorld, [&](p2p::PointToPoint& p2p) -> Status {
      std::vector<float> send(kCount * send_blocks, 1.0f), recv(kCount * recv_blocks, 0.0f);
      CollectiveArgs args;
      args.send = send.data();
      args.recv = recv.data();
      args.count = kCount;
      args.dtype = DataType::kF32;
      args.deadline = DeadlineIn(5s);
      args.tuning.block_owner = &c.owner;
      return fn(p2p, args);
    });
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument)
          << "rank " << r << ": " << statuses[r];
      EXPECT_THAT(statuses[r].message(), ::testing::HasSubstr(c.error)) << "rank " << r;
    }
  }
}

void ExpectOneRankWithAnotherCountOrDtypeFailsEveryRank(const BlockCollectiveFn& fn, bool send_has_every_block) {
  for (int world : {5, 6}) {
    for (size_t chunk : {size_t{0}, size_t{8}}) {
      for (int odd = 0; odd < world; ++odd) {
        for (bool dtype : {false, true}) {
          // Without the kill, ranks not next to the odd one wait for their
          // (short) deadline: in many chunks only, to keep the test short.
          for (bool kill : {true, false}) {
            if (!kill && chunk == 0) continue;
            const std::string what = "world=" + std::to_string(world) + " chunk=" +
                                     std::to_string(chunk) + " odd rank " + std::to_string(odd) +
                                     (dtype ? " i32" : " count 9") + (kill ? "" : " (nobody killed)");
            const auto timeout = kill ? Clock::duration(10s) : Clock::duration(300ms);
            std::vector<Clock::duration> took(world);
            transport::testing::HarnessOptions options;
            options.kill_on_error = kill;
            auto statuses = transport::testing::RunRanks(
                world,
                [&](p2p::PointToPoint& p2p) -> Status {
                  const bool is_odd = p2p.rank() == odd;
                  const size_t count = is_odd && !dtype ? 9 : 8;
                  std::vector<float> send(count * (send_has_every_block ? world : 1), 1.0f);
                  std::vector<float> recv(count * (send_has_every_block ? 1 : world));
                  CollectiveArgs args;
                  args.send = send.data();
                  args.recv = recv.data();
                  args.count = count;
                  args.dtype = is_odd && dtype ? DataType::kI32 : DataType::kF32;
                  args.tuning.chunk_bytes = chunk;
                  const auto start = Clock::now();
                  args.deadline = start + timeout;
                  Status status = fn(p2p, args);
                  took[p2p.rank()] = Clock::now() - start;
                  return status;
                },
                options);
            for (int r = 0; r < world; ++r) {
              EXPECT_FALSE(statuses[r].ok()) << what << ": rank " << r << " returned OK";
              EXPECT_LT(took[r], kill ? Clock::duration(2s) : timeout + 2s)
                  << what << ": rank " << r << ": " << statuses[r];
            }
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  }
}

void ExpectOneRankWithAnotherCountStopsTheRing(const BlockCollectiveFn& fn, bool send_has_every_block) {
  constexpr int kWorld = 5;
  for (int odd = 0; odd < kWorld; ++odd) {
    const std::string what = "rank " + std::to_string(odd) + " of " + std::to_string(kWorld) +
                             " passes count 9, nobody killed";
    std::vector<Clock::duration> took(kWorld);
    transport::testing::HarnessOptions options;
    options.kill_on_error = false;
    const auto start = Clock::now();
    auto statuses = transport::testing::RunRanks(
        kWorld,
        [&](p2p::PointToPoint& p2p) -> Status {
          const bool is_odd = p2p.rank() == odd;
          // The others are inside the call when the note comes.
          if (is_odd) std::this_thread::sleep_for(300ms);
          const size_t count = is_odd ? 9 : 8;
          std::vector<float> send(count * (send_has_every_block ? kWorld : 1), 1.0f);
          std::vector<float> recv(count * (send_has_every_block ? 1 : kWorld));
          CollectiveArgs args;
          args.send = send.data();
          args.recv = recv.data();
          args.count = count;
          args.deadline = start + 6s;
          Status status = fn(p2p, args);
          took[p2p.rank()] = Clock::now() - start;
          return status;
        },
        options);
    for (int r = 0; r < kWorld; ++r) {
      const Status& s = statuses[r];
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": rank " << r << ": " << s;
      EXPECT_THAT(s.message(), ::testing::ContainsRegex("rank " + std::to_string(odd) +
                                                        " passed [a-z -]+, count 9 of f32"))
          << what << ": rank " << r;
      EXPECT_THAT(s.message(), ::testing::HasSubstr("count 8 of f32")) << what << ": rank " << r;
      EXPECT_LT(took[r], 3s) << what << ": rank " << r << ": " << s;
    }
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace ddp::transport::algorithms::testing
