#include "transport/cuda/reduce_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace ddp::transport::cuda {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill an H100/H200 (132 SMs) several times over.
constexpr size_t kMaxBlocks = 4096;

int Blocks(size_t count) {
  const size_t needed = (count + kThreads - 1) / kThreads;
  return static_cast<int>(needed < kMaxBlocks ? needed : kMaxBlocks);
}

// dst, src: [count] float. Grid-stride loop so one launch covers any count.
__global__ void SumF32Kernel(float* __restrict__ dst,
                             const float* __restrict__ src, size_t count) {
  const size_t stride = size_t{blockDim.x} * gridDim.x;
  for (size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    dst[i] += src[i];
  }
}

// Values in the type they are reduced in: f32 for the 16-bit floats.
template <typename T> struct Acc { using Type = T; };
template <> struct Acc<__half> { using Type = float; };
template <> struct Acc<__nv_bfloat16> { using Type = float; };

__device__ float Widen(__half v) { return __half2float(v); }
__device__ float Widen(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ T Widen(T v) { return v; }

template <typename T> __device__ T Narrow(typename Acc<T>::Type v) { return static_cast<T>(v); }
template <> __device__ __half Narrow<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __nv_bfloat16 Narrow<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename A> __device__ bool IsNan(A x) {
  if constexpr (std::is_floating_point_v<A>) {
    return x != x;
  } else {
    return false;
  }
}

// Whether x carries a minus sign (-0.0 included), for a tie of +0 and -0;
// integers that tie are the same value, so either may be kept.
template <typename A> __device__ bool SignBit(A x) {
  if constexpr (std::is_floating_point_v<A>) {
    return signbit(x);
  } else {
    return false;
  }
}

// Integer sums and products wrap, as on the host (transport/reduce): done
// in the unsigned type, where overflow is defined (signed overflow is not,
// and the compiler may assume it never happens). uint8_t promotes to int,
// whose sum or product of two bytes cannot overflow.
template <typename A> __device__ A WrapAdd(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}
template <typename A> __device__ A WrapMul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}

// Matches transport/types.h ReduceOp.
enum Op { kSum = 0, kAvg = 1, kMax = 2, kMin = 3, kProd = 4 };

struct Sources {
  const void* p[kMaxReduceSources];
};

// dst: [count]; sources.p[k]: [count], k < n. One thread per element per
// grid-stride step; the n reads of an element are independent loads.
template <typename T, int kOp>
__global__ void ReduceKernel(T* dst, Sources sources, int n, size_t count) {
  using A = typename Acc<T>::Type;
  const size_t stride = size_t{blockDim.x} * gridDim.x;
  for (size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += stride) {
    A acc = Widen(static_cast<const T*>(sources.p[0])[i]);
    for (int k = 1; k < n; ++k) {
      const A v = Widen(static_cast<const T*>(sources.p[k])[i]);
      if constexpr (kOp == kSum || kOp == kAvg) acc = WrapAdd(acc, v);
      // A NaN from any source wins, as on the host (transport/reduce): a
      // bare comparison keeps a NaN only where it came first. A tie of +0
      // and -0 gives +0 for max and -0 for min in either order, as on the
      // host (IEEE 754-2019 maximum and minimum), so the result does not
      // depend on the order the sources are folded in.
      if constexpr (kOp == kMax) acc = IsNan(acc) || acc > v || (acc == v && !SignBit(acc)) ? acc : v;
      if constexpr (kOp == kMin) acc = IsNan(acc) || acc < v || (acc == v && SignBit(acc)) ? acc : v;
      if constexpr (kOp == kProd) acc = WrapMul(acc, v);
    }
    if constexpr (kOp == kAvg) acc = static_cast<A>(acc / static_cast<A>(n));
    dst[i] = Narrow<T>(acc);
  }
}

template <typename T>
cudaError_t Launch(void* dst, const Sources& sources, int n, size_t count, int op,
                   cudaStream_t stream) {
  T* out = static_cast<T*>(dst);
  const int blocks = Blocks(count);
  switch (op) {
    case kSum: ReduceKernel<T, kSum><<<blocks, kThreads, 0, stream>>>(out, sources, n, count); break;
    case kAvg: ReduceKernel<T, kAvg><<<blocks, kThreads, 0, stream>>>(out, sources, n, count); break;
    case kMax: ReduceKernel<T, kMax><<<blocks, kThreads, 0, stream>>>(out, sources, n, count); break;
    case kMin: ReduceKernel<T, kMin><<<blocks, kThreads, 0, stream>>>(out, sources, n, count); break;
    case kProd: ReduceKernel<T, kProd><<<blocks, kThreads, 0, stream>>>(out, sources, n, count); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// An error pending before the launch (sticky, or left unread by unrelated
// code) would come back from the cudaGetLastError after it, as if the
// launch had failed, and be cleared: it is returned as it is, flagged, and
// nothing is launched.
bool FailedBefore(cudaError_t* error, bool* failed_before) {
  if (failed_before != nullptr) *failed_before = false;
  *error = cudaPeekAtLastError();
  if (*error == cudaSuccess) return false;
  if (failed_before != nullptr) *failed_before = true;
  return true;
}

}  // namespace

int SumF32Async(float* dst, const float* src, size_t count, void* stream, bool* failed_before) {
  cudaError_t before = cudaSuccess;
  if (FailedBefore(&before, failed_before)) return before;
  if (count == 0) return cudaSuccess;
  SumF32Kernel<<<Blocks(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      dst, src, count);
  return static_cast<int>(cudaGetLastError());
}

int ReduceAsync(void* dst, const void* const* sources, int num_sources, size_t count, int dtype,
                int op, void* stream, bool* failed_before) {
  cudaError_t before = cudaSuccess;
  if (FailedBefore(&before, failed_before)) return before;
  if (num_sources < 1 || num_sources > kMaxReduceSources) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  Sources s{};
  for (int k = 0; k < num_sources; ++k) s.p[k] = sources[k];
  const auto st = static_cast<cudaStream_t>(stream);
  // Matches transport/types.h DataType.
  switch (dtype) {
    case 0: return Launch<float>(dst, s, num_sources, count, op, st);
    case 1: return Launch<double>(dst, s, num_sources, count, op, st);
    case 2: return Launch<__half>(dst, s, num_sources, count, op, st);
    case 3: return Launch<__nv_bfloat16>(dst, s, num_sources, count, op, st);
    case 4: return Launch<int32_t>(dst, s, num_sources, count, op, st);
    case 5: return Launch<int64_t>(dst, s, num_sources, count, op, st);
    case 6: return Launch<uint8_t>(dst, s, num_sources, count, op, st);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace ddp::transport::cuda
