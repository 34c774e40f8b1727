#ifndef DDP_TRANSPORT_CUDA_REDUCE_KERNELS_H_
#define DDP_TRANSPORT_CUDA_REDUCE_KERNELS_H_

#include <cstddef>

namespace ddp::transport::cuda {

/// dst[i] += src[i] for i in [0, count), on the given CUDA stream (nullptr:
/// the default stream). Both pointers are device memory. Returns the CUDA
/// error code of the launch (0 on success); completion is asynchronous.
int SumF32Async(float* dst, const float* src, size_t count, void* stream);

}  // namespace ddp::transport::cuda

#endif  // DDP_TRANSPORT_CUDA_REDUCE_KERNELS_H_
