// Bucket assignment (no processes needed).

#include "ddp/reducer.h"

#include <gtest/gtest.h>

namespace ddp::dist::internal {
namespace {

using nn::DType;
using nn::Tensor;

std::vector<size_t> Reverse(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  return order;
}

// The peers' MLP: 1.weight [512, 784], 1.bias, 3.weight [256, 512], 3.bias,
// 5.weight [10, 256], 5.bias.
std::vector<Tensor> MlpShapes() {
  return {nn::Empty({512, 784}), nn::Empty({512}), nn::Empty({256, 512}),
          nn::Empty({256}),      nn::Empty({10, 256}), nn::Empty({10})};
}

TEST(AssignBucketsTest, PyTorchRuleWithoutInPlaceBuckets) {
  // 1 MiB first bucket: it closes once 1.weight pushes it past the limit.
  const auto buckets = AssignBuckets(MlpShapes(), Reverse(6), 1 << 20, 25 << 20, 0);
  ASSERT_EQ(buckets.size(), 1u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{5, 4, 3, 2, 1, 0}));
}

TEST(AssignBucketsTest, LargeGradientGetsItsOwnBucket) {
  // 1.weight (1.5 MiB) and 3.weight (512 KiB) are at least 512 KiB: alone;
  // the small ones share a bucket, complete when 1.bias arrives.
  const auto buckets = AssignBuckets(MlpShapes(), Reverse(6), 1 << 20, 25 << 20, 512 << 10);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{5, 4, 3, 1}));
  EXPECT_EQ(buckets[2], (std::vector<size_t>{0}));
}

TEST(AssignBucketsTest, FirstBucketSmallThenCap) {
  // 100 KiB first bucket, then 600 KiB; nothing in place below 1 MiB.
  const auto buckets = AssignBuckets(MlpShapes(), Reverse(6), 100 << 10, 600 << 10, 1 << 20);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{5, 4, 3, 2}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{1}));  // complete before 1.weight arrives
  EXPECT_EQ(buckets[2], (std::vector<size_t>{0}));
}

TEST(AssignBucketsTest, TinyLimitMeansOneBucketPerParameter) {
  const auto buckets = AssignBuckets(MlpShapes(), Reverse(6), 1, 1, 0);
  ASSERT_EQ(buckets.size(), 6u);
  for (size_t b = 0; b < 6; ++b) EXPECT_EQ(buckets[b], std::vector<size_t>{5 - b});
}

TEST(AssignBucketsTest, OneDtypePerBucketInCompletionOrder) {
  std::vector<Tensor> params = {nn::Empty({4}), nn::Empty({4}, {.dtype = DType::kBFloat16}),
                                nn::Empty({4}), nn::Empty({4}, {.dtype = DType::kBFloat16})};
  const auto buckets = AssignBuckets(params, Reverse(4), 1 << 20, 1 << 20, 1 << 20);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{3, 1}));  // bf16, complete first
  EXPECT_EQ(buckets[1], (std::vector<size_t>{2, 0}));  // f32
}

TEST(AssignBucketsTest, FollowsTheGivenOrder) {
  // The order the MLP's gradients arrive in: weight before bias.
  const auto buckets = AssignBuckets(MlpShapes(), {4, 5, 2, 3, 0, 1}, 1 << 20, 25 << 20, 512 << 10);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{0}));
  EXPECT_EQ(buckets[2], (std::vector<size_t>{4, 5, 3, 1}));
}

}  // namespace
}  // namespace ddp::dist::internal
