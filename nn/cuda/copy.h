// Copies between host and device memory and between devices, with the
// stream order explicit:
//
// - host -> device: the source is copied into a pinned staging buffer and
//   DMA'd on the destination's current stream, in chunks that alternate
//   between two buffers so the host copy of one chunk overlaps the DMA of
//   the other. Returns once the source has been read: the caller may reuse
//   it at once. Later work on the same stream sees the data; another stream
//   must wait on an event recorded on this one.
// - device -> host: DMA on the source's current stream into the pinned
//   buffers, then copied out; returns when the data is in the destination
//   (a host wait with the deadline of WaitTimeout()).
// - device -> device (same GPU): cudaMemcpyAsync on the current stream.
// - device -> device (two GPUs): the copy runs on the source's current stream
//   after an event from the destination's current stream (its memory may be
//   in use there), and the destination's stream then waits for the copy.
#pragma once

#include <cstddef>

#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {

/// Bytes per pinned staging chunk (two chunks per device).
inline constexpr size_t kStagingChunkBytes = size_t{4} << 20;

/// Copies nbytes between contiguous buffers; at least one side is on a CUDA device.
void CopyBytes(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);
/// dst = src elementwise for two tensors of one shape on one CUDA device,
/// any strides (stride 0 broadcasts), converting dtypes.
void CopyStrided(const Tensor& dst, const Tensor& src);
/// Every element of dst (on a CUDA device, any strides) = *value, one
/// element of dst's dtype in host memory, on the current stream: a memset
/// when dst is contiguous and the element's bytes are all equal (zero, -1 in
/// the integers), else the fill kernel.
void Fill(const Tensor& dst, const void* value);
/// Host wait for the device's queued work (see SynchronizeDevice in stream.h).
void Synchronize(Device device);

}  // namespace ddp::nn::cuda
