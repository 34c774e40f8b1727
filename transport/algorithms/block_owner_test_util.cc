#include "transport/algorithms/block_owner_test_util.h"

#include <chrono>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/p2p/group_view.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms::testing {

using namespace std::chrono_literals;

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

}  // namespace ddp::transport::algorithms::testing
