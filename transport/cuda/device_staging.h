#ifndef DDP_TRANSPORT_CUDA_DEVICE_STAGING_H_
#define DDP_TRANSPORT_CUDA_DEVICE_STAGING_H_

// Device memory as the communicator sees it: which pointers are device
// memory, and a CopyEngine over a CUDA stream with pinned host slots. Built
// from device_staging_cuda.cc under --config=cuda and device_staging_none.cc
// otherwise (every pointer is host memory, no engine can be made). No CUDA
// header here, so //transport's public headers stay free of CUDA.

#include <cstddef>
#include <memory>

#include "transport/cuda/staging_pipeline.h"
#include "transport/status.h"

namespace ddp::transport::cuda {

/// True in the --config=cuda build.
bool BuiltWithCuda();

/// Classifies `p` with cudaPointerGetAttributes, asked with a device whose
/// primary context is active; with none active, `p` is host memory and no
/// context is made. Host memory (pageable or pinned), null, and every
/// pointer of a build or machine without CUDA are host memory.
PointerKind ClassifyPointer(const void* p);

/// Copies between device buffers and pinned host slots, and reductions on
/// the device, on one dedicated stream of one device. The stream is a blocking stream: it starts after
/// work already queued on the legacy default stream, so inputs written by
/// kernels on that stream are ready; work on other streams must be
/// synchronized by the caller first. Waits poll CUDA events against the
/// caller's deadline; nothing blocks in the driver.
class DeviceCopyEngine : public CopyEngine {
 public:
  /// Two pinned slots of `slot_bytes` rounded up to kStagingSlotAlign (so
  /// that slot 1 and scratch 1 are aligned), as much device scratch, and a
  /// stream on `device`.
  static StatusOr<std::unique_ptr<DeviceCopyEngine>> Create(int device, size_t slot_bytes);
  /// Waits (bounded) for queued copies before freeing the slots, and frees
  /// the scratch on the engine's stream (bounded, not cudaFree's wait for
  /// the whole device); if either does not finish, the memory is leaked
  /// rather than freed under the copies or waited for without bound.
  ~DeviceCopyEngine() override;

  size_t slot_bytes() const override;
  std::byte* slot(int s) override;
  std::byte* scratch(int s) override;
  /// ReduceAsync (reduce_kernels.h) on the engine's stream.
  Status Reduce(void* dst, const void* const* sources, int num_sources, size_t count,
                DataType dtype, ReduceOp op) override;
  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                size_t rows) override;
  Status MarkIn(int s) override;
  Status WaitIn(int s, Deadline deadline) override;
  Status WaitAll(Deadline deadline) override;

  struct State;

 private:
  explicit DeviceCopyEngine(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace ddp::transport::cuda

#endif  // DDP_TRANSPORT_CUDA_DEVICE_STAGING_H_
