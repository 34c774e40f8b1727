#include "nn/tensor/dtype.h"

#include <stdexcept>
#include <string>

namespace ddp::nn {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "f32";
    case DType::kFloat64: return "f64";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
    case DType::kInt64: return "i64";
    case DType::kUInt8: return "u8";
    case DType::kInt32: return "i32";
  }
  return "unknown";
}

DType ParseDType(std::string_view name) {
  struct Entry {
    std::string_view a, b;
    DType t;
  };
  static constexpr Entry kNames[] = {
      {"f32", "float32", DType::kFloat32}, {"f64", "float64", DType::kFloat64},
      {"f16", "float16", DType::kFloat16}, {"bf16", "bfloat16", DType::kBFloat16},
      {"i64", "int64", DType::kInt64},     {"u8", "uint8", DType::kUInt8},
      {"i32", "int32", DType::kInt32},
  };
  for (const Entry& e : kNames) {
    if (name == e.a || name == e.b) return e.t;
  }
  throw std::invalid_argument("unknown dtype `" + std::string(name) +
                              "` (expected one of f32, f64, f16, bf16, i64, u8, i32)");
}

DType PromoteTypes(DType a, DType b) {
  if (a == b) return a;
  const bool fa = IsFloating(a), fb = IsFloating(b);
  if (fa && !fb) return a;
  if (fb && !fa) return b;
  if (fa && fb) {
    if (a == DType::kFloat64 || b == DType::kFloat64) return DType::kFloat64;
    return DType::kFloat32;  // f32 with a 16-bit type, or f16 with bf16
  }
  // Integers: the wider signed type.
  if (a == DType::kInt64 || b == DType::kInt64) return DType::kInt64;
  return DType::kInt32;
}

DType ResultType(DType a, bool a_is_0d, DType b, bool b_is_0d) {
  if (a_is_0d == b_is_0d) return PromoteTypes(a, b);
  const DType dimensioned = a_is_0d ? b : a;
  const DType zero_dim = a_is_0d ? a : b;
  // PyTorch ranks operands by category first (integer, then floating); a
  // 0-d tensor of the same or a lower category leaves the type to the one
  // with dimensions, so a scale held in a 0-d f32 keeps a bf16 tensor bf16.
  if (!IsFloating(dimensioned) && IsFloating(zero_dim)) return zero_dim;
  return dimensioned;
}

namespace detail {
void ThrowUnsupportedDType(std::string_view what, DType dtype) {
  throw std::invalid_argument(std::string(what) + ": dtype " + std::string(DTypeName(dtype)) +
                              " is not supported");
}
}  // namespace detail

}  // namespace ddp::nn
