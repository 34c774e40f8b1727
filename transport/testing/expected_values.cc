#include "transport/testing/expected_values.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "transport/reduce/half.h"

namespace ddp::transport::testing {

double InputValue(int rank, size_t i, ReduceOp op) {
  // Every other element is a 2 on the first 16 ranks; from rank 16 on, the
  // ranks go in blocks of 4, block b having its 2s where i % 32 == b. No
  // element gets more than 12 twos, so the product stays at most 2^12,
  // exact in every dtype but u8 however many ranks there are (f16
  // overflowed at 2^16 from 32 ranks, i32 at 2^31), and each of ranks 16 to
  // 143 still shows in some element (with 1s everywhere, a product that
  // dropped one of them passed).
  if (op == ReduceOp::kProd) {
    if (rank < 16) return 1 + static_cast<double>((i + rank) % 2);
    return i % 32 == static_cast<size_t>(rank - 16) / 4 ? 2 : 1;
  }
  return 1 + static_cast<double>((static_cast<size_t>(rank) * 3 + i) % 7);
}

double ExpectedValue(int ranks, size_t i, ReduceOp op, DataType dtype) {
  double acc = InputValue(0, i, op);
  for (int r = 1; r < ranks; ++r) {
    const double v = InputValue(r, i, op);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc += v; break;
      case ReduceOp::kProd: acc *= v; break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
    }
  }
  // u8 wraps, in the sum as well before an average divides it (the kernels
  // sum in the dtype, then divide).
  if (dtype == DataType::kU8) acc = std::fmod(acc, 256.0);
  if (op == ReduceOp::kAvg) {
    const bool integer = dtype == DataType::kI32 || dtype == DataType::kI64 || dtype == DataType::kU8;
    acc = integer ? std::trunc(acc / ranks) : acc / ranks;
  }
  return acc;
}

void Store(DataType dtype, void* data, size_t i, double value) {
  switch (dtype) {
    case DataType::kF32: static_cast<float*>(data)[i] = static_cast<float>(value); break;
    case DataType::kF64: static_cast<double*>(data)[i] = value; break;
    case DataType::kF16: static_cast<uint16_t*>(data)[i] = reduce::FloatToHalf(static_cast<float>(value)); break;
    case DataType::kBF16: static_cast<uint16_t*>(data)[i] = reduce::FloatToBFloat16(static_cast<float>(value)); break;
    case DataType::kI32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(value); break;
    case DataType::kI64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(value); break;
    case DataType::kU8: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(value); break;
  }
}

double Load(DataType dtype, const void* data, size_t i) {
  switch (dtype) {
    case DataType::kF32: return static_cast<const float*>(data)[i];
    case DataType::kF64: return static_cast<const double*>(data)[i];
    case DataType::kF16: return reduce::HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case DataType::kBF16: return reduce::BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DataType::kI32: return static_cast<const int32_t*>(data)[i];
    case DataType::kI64: return static_cast<const int64_t*>(data)[i];
    case DataType::kU8: return static_cast<const uint8_t*>(data)[i];
  }
  return 0;
}

void FillInput(DataType dtype, void* data, size_t count, int rank, ReduceOp op, size_t offset) {
  for (size_t i = 0; i < count; ++i) Store(dtype, data, i, InputValue(rank, offset + i, op));
}

void FillUnexpected(DataType dtype, void* data, size_t count, int ranks, ReduceOp op,
                    size_t offset) {
  const bool integer = dtype == DataType::kI32 || dtype == DataType::kI64 || dtype == DataType::kU8;
  for (size_t i = 0; i < count; ++i) {
    if (!integer) {
      Store(dtype, data, i, std::nan(""));
      continue;
    }
    const double next = ExpectedValue(ranks, offset + i, op, dtype) + 1;
    Store(dtype, data, i, dtype == DataType::kU8 ? std::fmod(next, 256.0) : next);
  }
}

namespace {

// The relative error CountWrong allows `expected`. Averages of small
// integers are exact in f32/f64; the 16-bit floats round them to their
// precision. Their sums are exact while the sum is an integer they hold
// exactly (up to 2^11 in f16, 2^8 in bf16; every partial sum is smaller,
// the inputs being positive). Past that, and for an f16 average, which the
// communicator divides before it sums, each of the n - 1 additions and n
// divisions rounds within one unit roundoff (2^-11, 2^-8) of the result:
// 2 * ranks of them bound the error, so that a long sum done right is not
// counted wrong (a fixed tolerance was, from about 31 ranks).
double Tolerance(DataType dtype, int ranks, ReduceOp op, double expected) {
  const bool f16 = dtype == DataType::kF16;
  if (!f16 && dtype != DataType::kBF16) return 1e-6;
  const double base = f16 ? 1e-3 : 8e-3;
  const double exact_up_to = f16 ? 0x1p11 : 0x1p8;
  const double unit_roundoff = f16 ? 0x1p-11 : 0x1p-8;
  bool rounded_on_the_way = false;
  if (op == ReduceOp::kSum) rounded_on_the_way = expected > exact_up_to;
  if (op == ReduceOp::kAvg) rounded_on_the_way = (f16 && ranks > 1) || expected * ranks > exact_up_to;
  return rounded_on_the_way ? std::max(base, 2.0 * ranks * unit_roundoff) : base;
}

}  // namespace

size_t CountWrong(DataType dtype, const void* data, size_t count, int ranks, ReduceOp op,
                  size_t offset, std::string* first) {
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    const double expected = ExpectedValue(ranks, offset + i, op, dtype);
    const double got = Load(dtype, data, i);
    const double tolerance = Tolerance(dtype, ranks, op, expected);
    // Written so that a NaN result counts as wrong (every comparison with
    // NaN is false).
    if (!(std::fabs(got - expected) <= tolerance * std::max(1.0, std::fabs(expected)))) {
      if (wrong == 0 && first != nullptr) {
        *first = "element " + std::to_string(offset + i) + ": expected " +
                 std::to_string(expected) + ", got " + std::to_string(got);
      }
      ++wrong;
    }
  }
  return wrong;
}

}  // namespace ddp::transport::testing
