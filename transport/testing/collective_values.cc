#include "transport/testing/collective_values.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "transport/reduce/half.h"

namespace ddp::transport::testing {
namespace {

bool IsSigned(DataType dtype) { return dtype != DataType::kU8; }

// Rounds `v` to what the dtype holds, so that avg's division is done in the
// same precision as the kernels do it.
double AvgIn(DataType dtype, double sum, int world) {
  switch (dtype) {
    case DataType::kF32:
      return static_cast<float>(sum) / static_cast<float>(world);
    case DataType::kF16:
      return reduce::HalfToFloat(reduce::FloatToHalf(static_cast<float>(sum) /
                                                     static_cast<float>(world)));
    case DataType::kBF16:
      return reduce::BFloat16ToFloat(reduce::FloatToBFloat16(static_cast<float>(sum) /
                                                             static_cast<float>(world)));
    case DataType::kF64:
      return sum / world;
    case DataType::kI32:
    case DataType::kI64:
    case DataType::kU8:
      // Integer division truncates toward zero.
      return static_cast<double>(static_cast<int64_t>(sum) / world);
  }
  return 0;
}

}  // namespace

double Contribution(ReduceOp op, DataType dtype, int rank, size_t i) {
  const size_t r = static_cast<size_t>(rank);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: {
      const double v = static_cast<double>((r + i) % 5);
      return IsSigned(dtype) ? v - 2 : v;
    }
    case ReduceOp::kMax:
    case ReduceOp::kMin: {
      const double v = static_cast<double>((r * 7 + i * 3) % 11);
      return IsSigned(dtype) ? v - 5 : v;
    }
    case ReduceOp::kProd: {
      const size_t k = (r + i) % 7;
      if (k == 0) return 2;
      if (k == 3 && IsSigned(dtype)) return -1;
      return 1;
    }
  }
  return 0;
}

double Expected(ReduceOp op, DataType dtype, int world, size_t i) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: {
      // Whole cycles of (r + i) % 5 over r add 0+1+2+3+4 = 10 each; the
      // remaining ranks add a short run.
      const size_t w = static_cast<size_t>(world);
      double sum = 10.0 * static_cast<double>(w / 5);
      for (size_t t = 0; t < w % 5; ++t) sum += static_cast<double>((i + t) % 5);
      if (IsSigned(dtype)) sum -= 2.0 * world;
      return op == ReduceOp::kSum ? sum : AvgIn(dtype, sum, world);
    }
    case ReduceOp::kMax:
    case ReduceOp::kMin: {
      double best = Contribution(op, dtype, 0, i);
      for (int r = 1; r < world; ++r) {
        const double v = Contribution(op, dtype, r, i);
        best = op == ReduceOp::kMax ? std::max(best, v) : std::min(best, v);
      }
      return best;
    }
    case ReduceOp::kProd: {
      // Ranks with (r + i) % 7 == 0 give 2, == 3 give -1 (signed types).
      int twos = 0, minus = 0;
      for (int r = 0; r < world; ++r) {
        const size_t k = (static_cast<size_t>(r) + i) % 7;
        twos += k == 0;
        minus += k == 3 && IsSigned(dtype);
      }
      return std::ldexp(minus % 2 ? -1.0 : 1.0, twos);
    }
  }
  return 0;
}

void Store(DataType dtype, void* buf, size_t i, double v) {
  switch (dtype) {
    case DataType::kF32: static_cast<float*>(buf)[i] = static_cast<float>(v); break;
    case DataType::kF64: static_cast<double*>(buf)[i] = v; break;
    case DataType::kF16:
      static_cast<uint16_t*>(buf)[i] = reduce::FloatToHalf(static_cast<float>(v));
      break;
    case DataType::kBF16:
      static_cast<uint16_t*>(buf)[i] = reduce::FloatToBFloat16(static_cast<float>(v));
      break;
    case DataType::kI32: static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v); break;
    case DataType::kI64: static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v); break;
    case DataType::kU8:
      static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>(static_cast<int64_t>(v));
      break;
  }
}

double Load(DataType dtype, const void* buf, size_t i) {
  switch (dtype) {
    case DataType::kF32: return static_cast<const float*>(buf)[i];
    case DataType::kF64: return static_cast<const double*>(buf)[i];
    case DataType::kF16: return reduce::HalfToFloat(static_cast<const uint16_t*>(buf)[i]);
    case DataType::kBF16: return reduce::BFloat16ToFloat(static_cast<const uint16_t*>(buf)[i]);
    case DataType::kI32: return static_cast<const int32_t*>(buf)[i];
    case DataType::kI64: return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
    case DataType::kU8: return static_cast<const uint8_t*>(buf)[i];
  }
  return 0;
}

std::vector<unsigned char> Contributions(ReduceOp op, DataType dtype, int rank, size_t count,
                                         size_t first) {
  std::vector<unsigned char> buf(count * DataTypeSize(dtype));
  for (size_t j = 0; j < count; ++j) Store(dtype, buf.data(), j, Contribution(op, dtype, rank, first + j));
  return buf;
}

std::vector<unsigned char> Expectations(ReduceOp op, DataType dtype, int world, size_t count,
                                        size_t first) {
  std::vector<unsigned char> buf(count * DataTypeSize(dtype));
  for (size_t j = 0; j < count; ++j) Store(dtype, buf.data(), j, Expected(op, dtype, world, first + j));
  return buf;
}

std::string Compare(DataType dtype, const void* got, const void* want, size_t count) {
  const size_t es = DataTypeSize(dtype);
  const auto* g = static_cast<const unsigned char*>(got);
  const auto* w = static_cast<const unsigned char*>(want);
  if (count == 0 || std::memcmp(g, w, count * es) == 0) return "";
  size_t first = count, wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(g + i * es, w + i * es, es) != 0) {
      if (first == count) first = i;
      ++wrong;
    }
  }
  return "element " + std::to_string(first) + " is " + std::to_string(Load(dtype, got, first)) +
         ", expected " + std::to_string(Load(dtype, want, first)) + " (" +
         std::to_string(wrong) + " of " + std::to_string(count) + " elements wrong)";
}

}  // namespace ddp::transport::testing
