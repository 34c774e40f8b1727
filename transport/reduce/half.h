#ifndef DDP_TRANSPORT_REDUCE_HALF_H_
#define DDP_TRANSPORT_REDUCE_HALF_H_

// Scalar conversions between f32 and the two 16-bit float formats, rounding
// to nearest-even. They are the reference for the vector kernels in
// reduce.cc, which must produce the same bits (the tests compare all 65536
// inputs and many f32 values), and the fallback on CPUs without F16C/AVX2.

#include <bit>
#include <cstdint>

namespace ddp::transport::reduce {

/// IEEE binary16 bits -> f32 (exact). NaNs come back quiet, as F16C does.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) {
    const uint32_t quiet = mantissa != 0 ? 0x00400000u : 0u;
    return std::bit_cast<float>(sign | 0x7F800000u | quiet | (mantissa << 13));
  }
  if (exponent == 0) {
    // Zero or subnormal: mantissa units of 2^-24, exact in f32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign != 0 ? -magnitude : magnitude;
  }
  // Rebias the exponent from 15 to 127.
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

/// f32 -> IEEE binary16 bits, round to nearest-even; overflow gives inf;
/// NaN stays NaN (quiet, top payload bits kept).
inline uint16_t FloatToHalf(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude >= 0x7F800000u) {
    const uint32_t nan_bits =
        magnitude > 0x7F800000u ? 0x200u | ((magnitude >> 13) & 0x3FFu) : 0u;
    return static_cast<uint16_t>(sign | 0x7C00u | nan_bits);
  }
  // 65520 (0x477FF000) is halfway between the largest half, 65504, and 2^16;
  // the tie goes to the even neighbour, which is infinity.
  if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half (2^-14): the result is a multiple of
    // 2^-24. Adding 0.5 makes the FPU round at exactly that position
    // (f32's ulp in [0.5, 1) is 2^-24), with round-to-nearest-even; the low
    // mantissa bits are then the half's bits (0x400 = smallest normal).
    const float rounded = std::bit_cast<float>(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(rounded) - 0x3F000000u));
  }
  // Normal: round the 13 dropped mantissa bits to nearest-even (a carry
  // into the exponent is correct), then rebias 127 -> 15.
  const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded >> 13) - (112u << 10)));
}

/// bfloat16 bits -> f32 (exact: bf16 is the top half of an f32).
inline float BFloat16ToFloat(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

/// f32 -> bfloat16 bits, round to nearest-even; NaN stays NaN (quiet).
inline uint16_t FloatToBFloat16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x40u);
  }
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace ddp::transport::reduce

#endif  // DDP_TRANSPORT_REDUCE_HALF_H_
