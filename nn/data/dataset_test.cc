#include "nn/data/dataset.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

namespace ddp::nn::data {
namespace {

using ::testing::HasSubstr;

TEST(InMemoryImageDataset, HoldsPixelsAndLabels) {
  InMemoryImageDataset ds("tiny", {1, 1, 2}, 3, {1, 2, 3, 4, 5, 6}, {2, 0, 1});
  EXPECT_EQ(ds.Size(), 3);
  EXPECT_EQ(ds.Label(0), 2);
  uint8_t px[2];
  ds.Get(2, px);
  EXPECT_EQ(px[0], 5);
  EXPECT_EQ(px[1], 6);
  EXPECT_THAT(ds.Name(), HasSubstr("tiny (3 x [1, 1, 2])"));
}

TEST(InMemoryImageDataset, RejectsMismatchedSizes) {
  try {
    InMemoryImageDataset ds("tiny", {1, 1, 2}, 3, {1, 2, 3}, {2, 0});
    FAIL();
  } catch (const DatasetError& e) {
    EXPECT_THAT(e.what(), HasSubstr("2 labels need 4 pixel bytes"));
  }
}

// C*H*W past int64 wrapped (2^63 became INT64_MIN, and 0 labels then
// "needed" 0 bytes); the shape is now rejected by name.
TEST(InMemoryImageDataset, RejectsShapeWhosePixelCountOverflows) {
  const int64_t big = int64_t{1} << 21;
  try {
    InMemoryImageDataset ds("huge", {big, big, big}, 3, {}, {});
    FAIL() << "accepted " << ds.Name();
  } catch (const DatasetError& e) {
    EXPECT_THAT(e.what(), HasSubstr("image shape [2097152, 2097152, 2097152]"));
  }
  // The count fits, the bytes of all samples do not.
  try {
    InMemoryImageDataset ds("many", {1, int64_t{1} << 31, int64_t{1} << 31}, 3, {}, std::vector<uint8_t>(4));
    FAIL() << "accepted " << ds.Name();
  } catch (const DatasetError& e) {
    EXPECT_THAT(e.what(), HasSubstr("[1, 2147483648, 2147483648] times 4 labels overflows"));
  }
}

TEST(InMemoryImageDataset, RejectsLabelOutOfRange) {
  try {
    InMemoryImageDataset ds("tiny", {1, 1, 1}, 3, {1, 2}, {2, 3});
    FAIL();
  } catch (const DatasetError& e) {
    EXPECT_THAT(e.what(), HasSubstr("label 3 of sample 1 is out of range [0, 3)"));
  }
}

TEST(InMemoryImageDataset, IndexOutOfRangeIsAnError) {
  InMemoryImageDataset ds("tiny", {1, 1, 1}, 3, {1, 2}, {2, 1});
  EXPECT_THROW(ds.Label(2), std::out_of_range);
  EXPECT_THROW(ds.Pixels(-1), std::out_of_range);
}

TEST(SyntheticDataset, SameSeedSameData) {
  SyntheticDataset a({100, {3, 8, 8}, 7, 42});
  SyntheticDataset b({100, {3, 8, 8}, 7, 42});
  SyntheticDataset c({100, {3, 8, 8}, 7, 43});
  std::vector<uint8_t> pa(192), pb(192), pc(192);
  int differ = 0;
  for (int64_t i = 0; i < 100; ++i) {
    a.Get(i, pa.data());
    b.Get(i, pb.data());
    c.Get(i, pc.data());
    EXPECT_EQ(pa, pb);
    EXPECT_EQ(a.Label(i), b.Label(i));
    EXPECT_GE(a.Label(i), 0);
    EXPECT_LT(a.Label(i), 7);
    differ += pa != pc;
  }
  EXPECT_EQ(differ, 100);
}

TEST(SyntheticDataset, UsesEveryClassAndOddShapes) {
  SyntheticDataset ds({700, {1, 3, 5}, 7, 1});
  std::vector<int> count(7);
  for (int64_t i = 0; i < ds.Size(); ++i) ++count[ds.Label(i)];
  for (int c = 0; c < 7; ++c) EXPECT_GT(count[c], 60) << c;
}

// Images of one class are closer to each other than to another class's:
// the data is learnable, not pure noise.
TEST(SyntheticDataset, ClassesAreSeparable) {
  SyntheticDataset ds({400, {3, 16, 16}, 4, 9});
  const int n = 768;
  std::vector<std::vector<uint8_t>> by_class[4];
  std::vector<uint8_t> px(n);
  for (int64_t i = 0; i < ds.Size(); ++i) {
    ds.Get(i, px.data());
    by_class[ds.Label(i)].push_back(px);
  }
  auto dist = [&](const std::vector<uint8_t>& x, const std::vector<uint8_t>& y) {
    int64_t d = 0;
    for (int k = 0; k < n; ++k) d += std::abs(int(x[k]) - int(y[k]));
    return d;
  };
  ASSERT_GE(by_class[0].size(), 2u);
  ASSERT_GE(by_class[1].size(), 1u);
  EXPECT_LT(dist(by_class[0][0], by_class[0][1]) * 2, dist(by_class[0][0], by_class[1][0]));
}

TEST(SyntheticDataset, RejectsBadOptions) {
  EXPECT_THROW(SyntheticDataset({10, {0, 2, 2}, 3, 0}), std::invalid_argument);
  EXPECT_THROW(SyntheticDataset({10, {1, 2, 2}, 0, 0}), std::invalid_argument);
  EXPECT_THROW(SyntheticDataset({-1, {1, 2, 2}, 2, 0}), std::invalid_argument);
  const int64_t big = int64_t{1} << 21;
  try {
    SyntheticDataset huge({10, {big, big, big}, 3, 0});
    FAIL() << "accepted " << huge.Name();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("image shape [2097152, 2097152, 2097152] has more pixels"));
  }
  SyntheticDataset ds({10, {1, 2, 2}, 2, 0});
  EXPECT_THROW(ds.Label(10), std::out_of_range);
}

}  // namespace
}  // namespace ddp::nn::data
