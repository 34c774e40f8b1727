#include "transport/testing/expected_values.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/reduce/reduce.h"

namespace ddp::transport::testing {
namespace {

constexpr DataType kAllTypes[] = {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16,
                                  DataType::kI32, DataType::kI64, DataType::kU8};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin,
                                ReduceOp::kProd};

// An output buffer filled by FillUnexpected before a checked call counts
// every element wrong, whatever the dtype, op and rank count: a call that
// wrote nothing cannot pass.
TEST(ExpectedValuesTest, FillUnexpectedIsCountedWrongEverywhere) {
  constexpr size_t kCount = 50;
  for (DataType dtype : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      for (int ranks : {1, 2, 3, 9, 16, 40, 64}) {
        std::vector<uint64_t> buffer(kCount);
        FillUnexpected(dtype, buffer.data(), kCount, ranks, op, 5);
        EXPECT_EQ(CountWrong(dtype, buffer.data(), kCount, ranks, op, 5), kCount)
            << DataTypeName(dtype) << " " << ReduceOpName(op) << " over " << ranks << " ranks";
      }
    }
  }
}

// A NaN where a number is expected is wrong (before, the comparison with
// NaN was false, so it was counted right).
TEST(ExpectedValuesTest, ANaNResultIsCountedWrong) {
  for (DataType dtype : {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16}) {
    std::vector<uint64_t> buffer(1);
    Store(dtype, buffer.data(), 0, std::nan(""));
    std::string first;
    EXPECT_EQ(CountWrong(dtype, buffer.data(), 1, 2, ReduceOp::kSum, 0, &first), 1u) << DataTypeName(dtype);
    EXPECT_NE(first.find("element 0: expected"), std::string::npos) << first;
  }
}

// Each rank's input folded into the result one rank at a time by the real
// kernels, rounding to the dtype at every step as a ring or a chain does;
// an f16 average divides each input first, as the communicator does.
std::vector<uint64_t> ReducedByKernels(DataType dtype, ReduceOp op, int ranks, size_t count) {
  std::vector<uint64_t> acc(count), input(count);
  const bool divide_first = dtype == DataType::kF16 && op == ReduceOp::kAvg && ranks > 1;
  const ReduceOp fold = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  for (int r = 0; r < ranks; ++r) {
    std::vector<uint64_t>& into = r == 0 ? acc : input;
    FillInput(dtype, into.data(), count, r, op);
    if (divide_first) reduce::DivideInPlace(dtype, into.data(), count, ranks);
    if (r > 0) reduce::Reduce(dtype, fold, acc.data(), input.data(), count);
  }
  if (op == ReduceOp::kAvg && !divide_first) reduce::DivideInPlace(dtype, acc.data(), count, ranks);
  return acc;
}

// --check on large jobs: a reduction done right is never counted wrong, up
// to 128 ranks, in every dtype and op (before, an f16 product overflowed
// from 32 ranks, its inputs' 2s doubling it every other rank, and the
// 16-bit floats' fixed tolerance did not grow with the roundings of a long
// sum).
TEST(ExpectedValuesTest, AReductionDoneRightIsNeverWrongUpTo128Ranks) {
  constexpr size_t kCount = 64;
  for (DataType dtype : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      for (int ranks : {1, 2, 3, 7, 9, 16, 17, 31, 32, 33, 48, 64, 100, 128}) {
        const std::vector<uint64_t> got = ReducedByKernels(dtype, op, ranks, kCount);
        std::string first;
        EXPECT_EQ(CountWrong(dtype, got.data(), kCount, ranks, op, 0, &first), 0u)
            << DataTypeName(dtype) << " " << ReduceOpName(op) << " over " << ranks << " ranks: " << first;
      }
    }
  }
}

// The tolerance stays tight enough to see a rank's contribution missing
// from a sum or a product, on the rank counts the collective tests sweep.
TEST(ExpectedValuesTest, AMissingRankIsCountedWrong) {
  constexpr size_t kCount = 64;
  for (DataType dtype : kAllTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProd}) {
      for (int ranks = 2; ranks <= 16; ++ranks) {
        const std::vector<uint64_t> short_one = ReducedByKernels(dtype, op, ranks - 1, kCount);
        EXPECT_GT(CountWrong(dtype, short_one.data(), kCount, ranks, op), 0u)
            << DataTypeName(dtype) << " " << ReduceOpName(op) << " over " << ranks << " ranks";
      }
    }
  }
}

// A product that leaves out any one rank, however many there are, is
// counted wrong over 64 elements (before, ranks from 16 on gave only 1s, so
// a product that dropped one of them passed). u8 is left out past 15 ranks:
// its product wraps to 0 there with or without the missing rank.
TEST(ExpectedValuesTest, AProductMissingAnyOneRankIsCountedWrong) {
  constexpr size_t kCount = 64;
  for (DataType dtype : kAllTypes) {
    for (int ranks : {2, 9, 16, 17, 31, 32, 33, 64, 100, 128}) {
      if (dtype == DataType::kU8 && ranks > 15) continue;
      for (int missing = 0; missing < ranks; ++missing) {
        std::vector<uint64_t> short_one(kCount);
        for (size_t i = 0; i < kCount; ++i) {
          double product = 1;
          for (int r = 0; r < ranks; ++r) {
            if (r != missing) product *= InputValue(r, i, ReduceOp::kProd);
          }
          Store(dtype, short_one.data(), i, product);
        }
        EXPECT_GT(CountWrong(dtype, short_one.data(), kCount, ranks, ReduceOp::kProd), 0u)
            << DataTypeName(dtype) << " product over " << ranks << " ranks without rank " << missing;
      }
    }
  }
}

// Up to 16 ranks (the sizes the collective tests sweep) the inputs and
// results are those the tests were written against.
TEST(ExpectedValuesTest, ProductInputsAreOnesAndTwosAndStayWithinTwoToTheTwelfth) {
  for (int rank = 0; rank < 16; ++rank) {
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(InputValue(rank, i, ReduceOp::kProd), 1 + static_cast<double>((i + rank) % 2));
    }
  }
  for (int ranks : {16, 32, 64, 1000}) {
    for (size_t i = 0; i < 64; ++i) {
      EXPECT_LE(ExpectedValue(ranks, i, ReduceOp::kProd, DataType::kF64), 4096) << ranks << " ranks";
    }
  }
}

}  // namespace
}  // namespace ddp::transport::testing
