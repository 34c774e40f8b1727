// Device-side helpers shared by the .cu kernels: element types, conversions,
// the strided index computation, block reductions and dtype dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "nn/cuda/launch.h"

namespace ddp::nn::cuda::device {

using launch::Dt;
using launch::Indexing;
using launch::kMaxDims;

/// The type arithmetic runs in: f32 for the 16-bit floats (as on the CPU).
template <typename T> struct Acc { using type = T; };
template <> struct Acc<__half> { using type = float; };
template <> struct Acc<__nv_bfloat16> { using type = float; };
template <typename T> using acc_t = typename Acc<T>::type;

/// Value conversion with the CPU's semantics: 16-bit floats are made by
/// rounding to nearest even, from f64 in one step (through f32 would round
/// twice), from the other types through f32; everything else is a static_cast.
template <typename To, typename From>
__device__ __forceinline__ To Cast(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<From, __half>) {
    return Cast<To>(__half2float(v));
  } else if constexpr (std::is_same_v<From, __nv_bfloat16>) {
    return Cast<To>(__bfloat162float(v));
  } else if constexpr (std::is_same_v<To, __half> && std::is_same_v<From, double>) {
    return __double2half(v);  // cvt.rn.f16.f64
  } else if constexpr (std::is_same_v<To, __nv_bfloat16> && std::is_same_v<From, double>) {
    return __double2bfloat16(v);
  } else if constexpr (std::is_same_v<To, __half>) {
    return __float2half_rn(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, __nv_bfloat16>) {
    return __float2bfloat16_rn(static_cast<float>(v));
  } else {
    return static_cast<To>(v);
  }
}

/// Offsets of element `linear` in up to three operands (launch.h).
template <int N>
__device__ __forceinline__ void Offsets(const Indexing& ix, int64_t linear, int64_t (&off)[N]) {
  launch::OffsetsOf<N>(ix, linear, off);
}

/// Grid for a grid-stride loop over n elements with 256-thread blocks.
inline unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 65536 ? (blocks < 1 ? 1 : blocks) : 65536);
}

/// Sum of v over the block (blockDim.x a multiple of 32, at most 1024).
/// `scratch` holds 32 values; the result is valid in every thread.
template <typename A>
__device__ A BlockSum(A v, A* scratch) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = threadIdx.x < warps ? scratch[threadIdx.x] : A(0);
  if (warp == 0) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  return scratch[0];
}

/// Maximum of v over the block; as BlockSum.
template <typename A>
__device__ A BlockMax(A v, A* scratch) {
  for (int o = 16; o > 0; o /= 2) v = fmax(v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = threadIdx.x < warps ? scratch[threadIdx.x] : -INFINITY;
  if (warp == 0) {
    for (int o = 16; o > 0; o /= 2) v = fmax(v, __shfl_down_sync(0xffffffffu, v, o));
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  return scratch[0];
}

/// Threads per block for a row of d elements: one warp for short rows, up to 256.
inline unsigned RowThreads(int64_t d) {
  unsigned t = 32;
  while (t < 256 && static_cast<int64_t>(t) < d) t *= 2;
  return t;
}

}  // namespace ddp::nn::cuda::device

// Runs the statements with scalar_t bound to the element type of `dt`
// (floating types only); any other dtype runs nothing, which the host side
// never lets happen (it checks dtypes first).
#define DDP_CUDA_DISPATCH_FLOATING(dt, ...)                                          \
  switch (dt) {                                                                      \
    case ::ddp::nn::cuda::launch::Dt::kF32: { using scalar_t = float; __VA_ARGS__; break; }   \
    case ::ddp::nn::cuda::launch::Dt::kF64: { using scalar_t = double; __VA_ARGS__; break; }  \
    case ::ddp::nn::cuda::launch::Dt::kF16: { using scalar_t = __half; __VA_ARGS__; break; }  \
    case ::ddp::nn::cuda::launch::Dt::kBF16: { using scalar_t = __nv_bfloat16; __VA_ARGS__; break; } \
    default: break;                                                                  \
  }

// As above, for every dtype.
#define DDP_CUDA_DISPATCH_ALL(dt, ...)                                               \
  switch (dt) {                                                                      \
    case ::ddp::nn::cuda::launch::Dt::kF32: { using scalar_t = float; __VA_ARGS__; break; }   \
    case ::ddp::nn::cuda::launch::Dt::kF64: { using scalar_t = double; __VA_ARGS__; break; }  \
    case ::ddp::nn::cuda::launch::Dt::kF16: { using scalar_t = __half; __VA_ARGS__; break; }  \
    case ::ddp::nn::cuda::launch::Dt::kBF16: { using scalar_t = __nv_bfloat16; __VA_ARGS__; break; } \
    case ::ddp::nn::cuda::launch::Dt::kI64: { using scalar_t = int64_t; __VA_ARGS__; break; } \
    case ::ddp::nn::cuda::launch::Dt::kU8: { using scalar_t = uint8_t; __VA_ARGS__; break; }  \
    case ::ddp::nn::cuda::launch::Dt::kI32: { using scalar_t = int32_t; __VA_ARGS__; break; } \
    default: break;                                                                  \
  }
