// Division by a divisor fixed at launch, without a hardware divide per
// element: the quotient of n by d is (mulhi(n, magic) + n) >> shift, with
// magic and shift computed once on the host (the multiply-by-reciprocal
// method of Granlund and Montgomery). Valid for 1 <= d and n < 2^31, which
// keeps the sum within 32 bits. An int64 division costs tens of instructions
// per element on the GPU, more than a memory-bound kernel can hide; this
// costs three. Shared by host and device code, so the host tests check it.
#pragma once

#include <cstdint>

#include "nn/cuda/launch.h"

namespace ddp::nn::cuda::launch {

/// Divides unsigned 32-bit values below 2^31 by `divisor` (1 <= divisor < 2^31).
struct FastDivider {
  uint32_t divisor = 1, magic = 1, shift = 0;

  FastDivider() = default;
  explicit FastDivider(uint32_t d) : divisor(d) {
    while (shift < 32 && (uint64_t{1} << shift) < d) ++shift;  // shift = ceil(log2(d))
    magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }

  DDP_HOST_DEVICE uint32_t Div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(n, magic);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * magic) >> 32);
#endif
    return (hi + n) >> shift;
  }
};

/// The channel of element idx in a contiguous [N, C, S] tensor:
/// (idx / s) % c, for tensors of fewer than 2^31 elements.
struct ChannelOf32 {
  FastDivider s, c;
  DDP_HOST_DEVICE int64_t operator()(int64_t idx) const {
    const uint32_t row = s.Div(static_cast<uint32_t>(idx));
    return static_cast<int64_t>(row - c.Div(row) * c.divisor);
  }
};

/// As ChannelOf32 with hardware division, for any size.
struct ChannelOf64 {
  int64_t s, c;
  DDP_HOST_DEVICE int64_t operator()(int64_t idx) const { return (idx / s) % c; }
};

}  // namespace ddp::nn::cuda::launch
