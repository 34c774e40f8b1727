#include "transport/testing/expected_values.h"

#include <cmath>
#include <cstring>

#include "transport/reduce/half.h"

namespace ddp::transport::testing {

double InputValue(int rank, size_t i, ReduceOp op) {
  if (op == ReduceOp::kProd) return 1 + static_cast<double>((i + rank) % 2);
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
  if (op == ReduceOp::kAvg) {
    const bool integer = dtype == DataType::kI32 || dtype == DataType::kI64 || dtype == DataType::kU8;
    acc = integer ? std::trunc(acc / ranks) : acc / ranks;
  }
  if (dtype == DataType::kU8) acc = std::fmod(acc, 256.0);  // u8 wraps
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

size_t CountWrong(DataType dtype, const void* data, size_t count, int ranks, ReduceOp op,
                  size_t offset, std::string* first) {
  // Averages of small integers are exact in f32/f64; the 16-bit floats round
  // them to their precision.
  const double tolerance = dtype == DataType::kF16 ? 1e-3 : dtype == DataType::kBF16 ? 8e-3 : 1e-6;
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    const double expected = ExpectedValue(ranks, offset + i, op, dtype);
    const double got = Load(dtype, data, i);
    if (std::fabs(got - expected) > tolerance * std::max(1.0, std::fabs(expected))) {
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
