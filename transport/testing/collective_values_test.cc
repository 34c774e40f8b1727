#include "transport/testing/collective_values.h"

#include "gtest/gtest.h"

namespace ddp::transport::testing {
namespace {

constexpr DataType kAllTypes[] = {DataType::kF32, DataType::kF64, DataType::kF16,
                                  DataType::kBF16, DataType::kI32, DataType::kI64,
                                  DataType::kU8};

// The closed forms must agree with a plain fold over the contributions.
TEST(CollectiveValuesTest, ClosedFormsMatchAFoldOverRanks) {
  for (DataType dtype : kAllTypes) {
    for (int world = 1; world <= 16; ++world) {
      for (size_t i = 0; i < 40; ++i) {
        double sum = 0, prod = 1;
        for (int r = 0; r < world; ++r) {
          sum += Contribution(ReduceOp::kSum, dtype, r, i);
          prod *= Contribution(ReduceOp::kProd, dtype, r, i);
        }
        EXPECT_EQ(Expected(ReduceOp::kSum, dtype, world, i), sum);
        EXPECT_EQ(Expected(ReduceOp::kProd, dtype, world, i), prod);
      }
    }
  }
  // Spot values: 3 ranks at i = 0 contribute -2, -1, 0 (signed).
  EXPECT_EQ(Expected(ReduceOp::kSum, DataType::kI32, 3, 0), -3);
  EXPECT_EQ(Expected(ReduceOp::kAvg, DataType::kI32, 3, 0), -1);
  // 2 ranks: -2 + -1 = -3, and -3 / 2 truncates toward zero.
  EXPECT_EQ(Expected(ReduceOp::kAvg, DataType::kI32, 2, 0), -1);
  EXPECT_EQ(Expected(ReduceOp::kAvg, DataType::kF32, 2, 0), -1.5);
}

TEST(CollectiveValuesTest, CompareReportsTheFirstDifference) {
  auto a = Contributions(ReduceOp::kSum, DataType::kF32, 0, 10);
  auto b = a;
  EXPECT_EQ(Compare(DataType::kF32, a.data(), b.data(), 10), "");
  Store(DataType::kF32, b.data(), 7, 99);
  EXPECT_NE(Compare(DataType::kF32, a.data(), b.data(), 10).find("element 7"), std::string::npos);
}

}  // namespace
}  // namespace ddp::transport::testing
