// Element types of tensors, including the two 16-bit float formats used for
// mixed precision. Half and BFloat16 are storage types: arithmetic converts
// them to float, so kernels templated on the element type compute in f32.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

namespace ddp::nn {

/// Element type of a tensor. Values are stable: new types are appended only.
enum class DType : int8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt64 = 4,
  kUInt8 = 5,
  kInt32 = 6,
};

/// Bytes per element.
constexpr size_t ElementSize(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
    case DType::kInt32: return 4;
  }
  return 0;
}

/// True for f32, f64, f16 and bf16.
constexpr bool IsFloating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 ||
         t == DType::kBFloat16;
}

/// Short name as printed in messages: "f32", "bf16", "i64"...
std::string_view DTypeName(DType t);

/// Parses a short name ("f32", "float32", "bf16", ...); throws on unknown names.
DType ParseDType(std::string_view name);

/// The type both operands of a binary op are computed in (PyTorch's rules for
/// floats: any f64 -> f64, f16 with bf16 -> f32, a float with an integer -> the float).
DType PromoteTypes(DType a, DType b);

/// torch.result_type of two tensor operands, either of which may be 0-d: a
/// 0-d operand is weaker than one with dimensions and decides the type only
/// when it is floating and the other is an integer (i64[3] * 0-d f64 -> f64,
/// bf16[3] * 0-d f32 -> bf16, u8[3] * 0-d i64 -> u8). Two operands of the
/// same kind (both 0-d, or both not) promote as PromoteTypes.
DType ResultType(DType a, bool a_is_0d, DType b, bool b_is_0d);

namespace detail {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 from binary32, rounding to nearest even; NaN stays NaN.
inline uint16_t FloatToHalfBits(float value) {
  uint32_t x = FloatBits(value);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t out;
  if (x >= (143u << 23)) {  // |value| >= 65536, inf or NaN
    out = x > (255u << 23) ? 0x7e00u : 0x7c00u;
  } else if (x < (113u << 23)) {
    // Result is subnormal or zero: adding 0.5 (as a float whose mantissa
    // lines up with the half's last subnormal bit) lets the FPU round.
    const uint32_t magic = 126u << 23;
    out = FloatBits(BitsFloat(x) + BitsFloat(magic)) - magic;
  } else {
    const uint32_t odd = (x >> 13) & 1u;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
    out = x >> 13;  // a carry out of the mantissa correctly lands on inf
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in float.
    return BitsFloat(sign | FloatBits(static_cast<float>(mant) * 5.9604644775390625e-8f));
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t FloatToBFloat16Bits(float value) {
  const uint32_t x = FloatBits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

inline float BFloat16BitsToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

// binary64 straight to a 16-bit format with kMant fraction bits and exponent
// bias kBias (binary16: 10, 15; bfloat16: 7, 127), rounding to nearest even,
// subnormals included; overflow gives inf, NaN stays NaN (quiet, sign kept).
// Not through float: that rounds twice, and a double a hair above the
// midpoint of two neighbours becomes the midpoint in float, whose tie then
// goes to the even neighbour (1 + 2^-11 + 2^-30 gave 1.0 in f16, not 1 + 2^-10).
template <int kMant, int kBias>
inline uint16_t DoubleTo16Bits(double value) {
  uint64_t x;
  std::memcpy(&x, &value, 8);
  const uint16_t sign = static_cast<uint16_t>((x >> 48) & 0x8000u);
  x &= ~(uint64_t{1} << 63);
  const uint64_t inf = uint64_t{2 * kBias + 1} << kMant;
  if (x > 0x7ff0000000000000ull) return static_cast<uint16_t>(sign | inf | (1u << (kMant - 1)));
  constexpr uint64_t kFraction = (uint64_t{1} << 52) - 1;
  const int exponent = static_cast<int>(x >> 52) - 1023;
  uint64_t bits;  // the result's bits followed by `shift` bits to round away
  int shift;
  if (exponent >= 1 - kBias) {
    // Normal: the rebiased exponent above the fraction, so that a carry out
    // of the rounded fraction steps the exponent (past the largest: inf).
    bits = (static_cast<uint64_t>(exponent + kBias) << 52) | (x & kFraction);
    shift = 52 - kMant;
  } else {
    // Subnormal: the significand with its leading 1, in units of the
    // smallest subnormal, 2^(1 - kBias - kMant), once shifted.
    bits = (x & kFraction) | (uint64_t{1} << 52);
    shift = 52 - kMant + (1 - kBias - exponent);
    if (shift > 53) return sign;  // under half the smallest subnormal: +-0
  }
  const uint64_t rest = bits & ((uint64_t{1} << shift) - 1), half = uint64_t{1} << (shift - 1);
  uint64_t out = bits >> shift;
  if (rest > half || (rest == half && (out & 1))) ++out;
  return static_cast<uint16_t>(sign | (out < inf ? out : inf));
}

}  // namespace detail

/// IEEE binary16. Converts implicitly to and from float (round to nearest even).
struct Half {
  uint16_t bits = 0;
  Half() = default;
  Half(float f) : bits(detail::FloatToHalfBits(f)) {}  // NOLINT: implicit by design
  /// From a double in one rounding (through float it would round twice).
  template <typename D>
    requires std::is_same_v<D, double>
  Half(D d) : bits(detail::DoubleTo16Bits<10, 15>(d)) {}  // NOLINT: implicit, as from float
  operator float() const { return detail::HalfBitsToFloat(bits); }
  static Half FromBits(uint16_t b) {
    Half h;
    h.bits = b;
    return h;
  }
};

/// bfloat16 (the upper half of a binary32). Converts implicitly to and from float.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  BFloat16(float f) : bits(detail::FloatToBFloat16Bits(f)) {}  // NOLINT: implicit by design
  /// From a double in one rounding (through float it would round twice).
  template <typename D>
    requires std::is_same_v<D, double>
  BFloat16(D d) : bits(detail::DoubleTo16Bits<7, 127>(d)) {}  // NOLINT: implicit, as from float
  operator float() const { return detail::BFloat16BitsToFloat(bits); }
  static BFloat16 FromBits(uint16_t b) {
    BFloat16 h;
    h.bits = b;
    return h;
  }
};

/// The DType of a C++ element type: DTypeOf<float>() == DType::kFloat32.
template <typename T>
constexpr DType DTypeOf();
template <> constexpr DType DTypeOf<float>() { return DType::kFloat32; }
template <> constexpr DType DTypeOf<double>() { return DType::kFloat64; }
template <> constexpr DType DTypeOf<Half>() { return DType::kFloat16; }
template <> constexpr DType DTypeOf<BFloat16>() { return DType::kBFloat16; }
template <> constexpr DType DTypeOf<int64_t>() { return DType::kInt64; }
template <> constexpr DType DTypeOf<uint8_t>() { return DType::kUInt8; }
template <> constexpr DType DTypeOf<int32_t>() { return DType::kInt32; }

/// The type arithmetic on T is carried out in: float for the 16-bit floats.
template <typename T> struct AccType { using type = T; };
template <> struct AccType<Half> { using type = float; };
template <> struct AccType<BFloat16> { using type = float; };
template <typename T> using acc_t = typename AccType<T>::type;

}  // namespace ddp::nn

// Runs the statement list with `scalar_t` bound to the C++ type of `dtype`,
// for the floating types; any other dtype throws naming `what`.
#define DDP_DISPATCH_FLOATING(dtype, what, ...)                                  \
  do {                                                                           \
    switch (dtype) {                                                             \
      case ::ddp::nn::DType::kFloat32: { using scalar_t = float; __VA_ARGS__; break; }      \
      case ::ddp::nn::DType::kFloat64: { using scalar_t = double; __VA_ARGS__; break; }     \
      case ::ddp::nn::DType::kFloat16: { using scalar_t = ::ddp::nn::Half; __VA_ARGS__; break; } \
      case ::ddp::nn::DType::kBFloat16: { using scalar_t = ::ddp::nn::BFloat16; __VA_ARGS__; break; } \
      default: ::ddp::nn::detail::ThrowUnsupportedDType(what, dtype);            \
    }                                                                            \
  } while (0)

// As DDP_DISPATCH_FLOATING, for every dtype.
#define DDP_DISPATCH_ALL(dtype, what, ...)                                       \
  do {                                                                           \
    switch (dtype) {                                                             \
      case ::ddp::nn::DType::kFloat32: { using scalar_t = float; __VA_ARGS__; break; }      \
      case ::ddp::nn::DType::kFloat64: { using scalar_t = double; __VA_ARGS__; break; }     \
      case ::ddp::nn::DType::kFloat16: { using scalar_t = ::ddp::nn::Half; __VA_ARGS__; break; } \
      case ::ddp::nn::DType::kBFloat16: { using scalar_t = ::ddp::nn::BFloat16; __VA_ARGS__; break; } \
      case ::ddp::nn::DType::kInt64: { using scalar_t = int64_t; __VA_ARGS__; break; }      \
      case ::ddp::nn::DType::kUInt8: { using scalar_t = uint8_t; __VA_ARGS__; break; }      \
      case ::ddp::nn::DType::kInt32: { using scalar_t = int32_t; __VA_ARGS__; break; }      \
      default: ::ddp::nn::detail::ThrowUnsupportedDType(what, dtype);            \
    }                                                                            \
  } while (0)

namespace ddp::nn::detail {
[[noreturn]] void ThrowUnsupportedDType(std::string_view what, DType dtype);
}  // namespace ddp::nn::detail
