#include "transport/cuda/reduce_kernels.h"

#include <cuda_runtime.h>

namespace ddp::transport::cuda {
namespace {

// dst, src: [count] float. Grid-stride loop so one launch covers any count.
__global__ void SumF32Kernel(float* __restrict__ dst,
                             const float* __restrict__ src, size_t count) {
  const size_t stride = size_t{blockDim.x} * gridDim.x;
  for (size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    dst[i] += src[i];
  }
}

}  // namespace

int SumF32Async(float* dst, const float* src, size_t count, void* stream) {
  if (count == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  // Enough blocks to fill an H100/H200 (132 SMs) several times over.
  const size_t blocks_needed = (count + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(blocks_needed < 4096 ? blocks_needed : 4096);
  SumF32Kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      dst, src, count);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace ddp::transport::cuda
