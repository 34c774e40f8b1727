// Every collective refuses a world larger than kMaxWorldSize before it
// computes with ranks or allocates per-rank lists: the algorithms form rank
// values up to about twice the world size in int (a heap tree's 2v + 2, a
// rotation r + p - 1), which overflowed above 2^30 ranks.

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/algorithms/all_gather.h"
#include "transport/algorithms/all_reduce.h"
#include "transport/algorithms/barrier.h"
#include "transport/algorithms/broadcast.h"
#include "transport/algorithms/exchange.h"
#include "transport/algorithms/gather_scatter.h"
#include "transport/algorithms/hierarchical_all_reduce.h"
#include "transport/algorithms/pipeline.h"
#include "transport/algorithms/reduce_scatter.h"
#include "transport/algorithms/rhd_all_reduce.h"
#include "transport/algorithms/ring_all_reduce.h"
#include "transport/algorithms/rooted_reduce.h"
#include "transport/algorithms/tree_all_reduce.h"

namespace ddp::transport::algorithms {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

// A transport that claims `size` ranks and moves nothing: every post fails,
// and is counted, so a collective that got past its checks shows.
class HugeWorld final : public p2p::PointToPoint {
 public:
  explicit HugeWorld(int size) : size_(size) {}
  int rank() const override { return 1; }
  int size() const override { return size_; }
  StatusOr<p2p::RequestId> PostSend(int, p2p::Tag, const void*, size_t) override {
    ++posts;
    return AbortedError("HugeWorld moves nothing");
  }
  StatusOr<p2p::RequestId> PostRecv(int, p2p::Tag, void*, size_t) override {
    ++posts;
    return AbortedError("HugeWorld moves nothing");
  }
  Status PostNotice(int, p2p::Tag, const void*, size_t) override {
    ++posts;
    return AbortedError("HugeWorld moves nothing");
  }
  StatusOr<bool> Test(p2p::RequestId) override { return AbortedError("HugeWorld"); }
  Status WaitAll(std::span<const p2p::RequestId>, Deadline) override {
    return AbortedError("HugeWorld");
  }
  StatusOr<size_t> WaitAny(std::span<const p2p::RequestId>, Deadline) override {
    return AbortedError("HugeWorld");
  }
  void MarkWatched(p2p::RequestId) override {}
  void Cancel(p2p::RequestId) override {}
  void CancelAll(std::span<const p2p::RequestId>) override {}

  int posts = 0;

 private:
  const int size_;
};

struct Entry {
  const char* name;
  std::function<Status(p2p::PointToPoint&, const CollectiveArgs&)> run;
};

const std::vector<Entry>& Entries() {
  static const std::vector<Entry> entries = {
      {"RingAllReduce", RingAllReduce},
      {"TreeAllReduce", TreeAllReduce},
      {"RhdAllReduce", RhdAllReduce},
      {"HierarchicalAllReduce",
       [](p2p::PointToPoint& p2p, const CollectiveArgs& args) {
         return HierarchicalAllReduce(p2p, args, {});
       }},
      {"AllReduceAuto",
       [](p2p::PointToPoint& p2p, const CollectiveArgs& args) {
         return AllReduce(p2p, args, Algorithm::kAuto);
       }},
      {"RingReduceScatter", RingReduceScatter},
      {"RingAllGather", RingAllGather},
      {"Broadcast", Broadcast},
      {"Barrier", Barrier},
      {"TreeReduce", TreeReduce},
      {"RingReduce", RingReduce},
      {"Gather", Gather},
      {"Scatter", Scatter},
      {"DirectExchange",
       [](p2p::PointToPoint& p2p, const CollectiveArgs& args) {
         return DirectExchange(p2p, {}, args);
       }},
  };
  return entries;
}

class WorldSizeTest : public ::testing::TestWithParam<size_t> {};

TEST_P(WorldSizeTest, AWorldAboveTheLimitIsRefusedNamingSizeAndLimit) {
  const Entry& entry = Entries()[GetParam()];
  constexpr int kSize = kMaxWorldSize + 1;
  HugeWorld p2p(kSize);
  // The buffers a rank's own block needs; a collective that read or wrote
  // the whole world's worth of them would crash, as it should.
  float send[4] = {1, 2, 3, 4}, recv[4] = {};
  CollectiveArgs args;
  args.send = send;
  args.recv = recv;
  args.count = 1;
  args.dtype = DataType::kF32;
  args.deadline = DeadlineIn(5s);
  const Status status = entry.run(p2p, args);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("world size " + std::to_string(kSize) +
                                          " exceeds the limit of " +
                                          std::to_string(kMaxWorldSize) + " ranks"));
  EXPECT_EQ(p2p.posts, 0) << "it posted messages before refusing";
}

INSTANTIATE_TEST_SUITE_P(Collectives, WorldSizeTest,
                         ::testing::Range(size_t{0}, Entries().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return std::string(Entries()[info.param].name);
                         });

// The limit itself is allowed: a real transport of that size would run.
TEST(WorldSizeLimitTest, TheLimitItselfIsAccepted) {
  HugeWorld at_limit(kMaxWorldSize);
  EXPECT_TRUE(internal::CheckWorldSize("test", at_limit).ok());
  HugeWorld above(kMaxWorldSize + 1);
  EXPECT_FALSE(internal::CheckWorldSize("test", above).ok());
}

}  // namespace
}  // namespace ddp::transport::algorithms
