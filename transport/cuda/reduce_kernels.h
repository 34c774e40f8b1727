#ifndef DDP_TRANSPORT_CUDA_REDUCE_KERNELS_H_
#define DDP_TRANSPORT_CUDA_REDUCE_KERNELS_H_

#include <cstddef>

namespace ddp::transport::cuda {

/// dst[i] += src[i] for i in [0, count), on the given CUDA stream (nullptr:
/// the default stream). Both pointers are device memory. Returns the CUDA
/// error code of the launch (0 on success); completion is asynchronous. An
/// error already pending before the call (cudaPeekAtLastError: sticky, or
/// left by unrelated code) is returned without launching and left pending,
/// with `*failed_before` (when given) set.
int SumF32Async(float* dst, const float* src, size_t count, void* stream,
                bool* failed_before = nullptr);

/// Most sources ReduceAsync takes (they travel in the kernel's arguments).
inline constexpr int kMaxReduceSources = 16;

/// dst[i] = op over k in [0, num_sources) of sources[k][i], for i in [0,
/// count), on `stream`. dtype and op are transport DataType and ReduceOp
/// values; 16-bit floats are reduced in f32 and rounded once, avg divides
/// the sum by num_sources (integers truncate). Pointers may be any device
/// memory the current device can read (IPC-opened peers' included); dst
/// may equal one source. Returns the CUDA error of the launch
/// (cudaErrorInvalidValue for an unknown dtype or op or too many sources),
/// or, as SumF32Async, one pending before it (`*failed_before` set).
int ReduceAsync(void* dst, const void* const* sources, int num_sources, size_t count, int dtype,
                int op, void* stream, bool* failed_before = nullptr);

}  // namespace ddp::transport::cuda

#endif  // DDP_TRANSPORT_CUDA_REDUCE_KERNELS_H_
