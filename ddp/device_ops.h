#ifndef DDP_DDP_DEVICE_OPS_H_
#define DDP_DDP_DEVICE_OPS_H_

// What //ddp needs from CUDA, behind a header with no CUDA in it (private to
// //ddp). Built from device_ops_cuda.cc under --config=cuda and from
// device_ops_none.cc otherwise, so that the plain build of //ddp stays
// CPU-only and a CUDA tensor there is refused with one clear line.
//
// Ordering model for a collective on a CUDA tensor (the Reducer's buckets,
// SyncBatchNorm's statistics, broadcasts of parameters):
//   1. At issue, on the caller's thread, an event is recorded on the
//      caller's current stream of the tensor's device: the tensor is ready
//      once the work queued before it (the bucket copies) has run.
//   2. On the communication thread, the per-device communication stream
//      waits on that event (cudaStreamWaitEvent) and the thread polls it
//      with the collective's deadline before it hands the device pointers to
//      the transport, whose copies run on the transport's own stream. No
//      device-wide synchronize anywhere.
//   3. When the transport returns, the data is in place; a completion event
//      is recorded on the communication stream.
//   4. Work::Wait, on the consumer's thread, makes the consumer's current
//      stream wait on the completion event (no host wait beyond the Work's
//      own completion).
// Every tensor a collective uses is declared to the caching allocator with
// RecordStream(communication stream), so its block is not handed out again
// before the communication stream has passed it.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/tensor/tensor.h"
#include "transport/status.h"
#include "transport/types.h"

namespace ddp::dist::internal {

/// True when //ddp was built with --config=cuda.
bool DeviceSupportBuilt();

/// The line every CUDA entry point of a CUDA-less build throws with.
std::string NoCudaMessage(const std::string& what);

/// Throws std::invalid_argument (starting with `where`) unless collectives
/// can run on tensors of `device` in this build.
void CheckCollectiveDevice(nn::Device device, const std::string& where);

/// Orders one collective on device tensors (see the header comment).
class DeviceFence {
 public:
  virtual ~DeviceFence() = default;
  /// Communication thread: the communication stream waits for the issue
  /// event, and the thread polls it until `deadline`.
  virtual transport::Status WaitReady(transport::Deadline deadline) = 0;
  /// Communication thread: copies `bytes` between two buffers of the fence's
  /// device on the communication stream (one-process groups).
  virtual transport::Status CopyOnCommStream(void* dst, const void* src, size_t bytes) = 0;
  /// Communication thread: dst = src converted to dst's dtype (both on the
  /// fence's device), queued on the communication stream; when `wait`,
  /// polls until it has run (before the transport reads dst), against
  /// `deadline`.
  virtual transport::Status ConvertOnCommStream(const nn::Tensor& dst, const nn::Tensor& src,
                                                bool wait, transport::Deadline deadline) = 0;
  /// Communication thread, after the collective: records the completion event.
  virtual transport::Status MarkDone() = 0;
  /// Consumer thread: its current stream of the device waits on the
  /// completion event (no host wait).
  virtual void OrderConsumer() = 0;
};

/// Records the issue event on the calling thread's current stream of
/// `device` and declares `tensors` used on the communication stream.
/// Throws in a build without CUDA.
std::unique_ptr<DeviceFence> MakeFence(nn::Device device, const std::vector<nn::Tensor>& tensors);

/// The current streams of the thread that made it (see CaptureCurrentStreams).
class CapturedStreams {
 public:
  virtual ~CapturedStreams() = default;
  /// Runs `fn` on the calling thread with the captured streams as its
  /// current streams, then restores this thread's own.
  virtual void Run(const std::function<void()>& fn) const = 0;
};

/// Captures the calling thread's current stream of every visible GPU, for
/// work moved to another thread (a checkpoint's copies, on a thread of their
/// own) to queue its copies where the caller would have. That thread's
/// current stream is otherwise the legacy default stream, which does not
/// wait for the non-blocking streams nn makes, nor they for it: a save would
/// read weights before the optimizer's kernels on the caller's stream have
/// written them, a load would return with its copies still in flight. The
/// caller's streams must outlive every Run. Without CUDA, Run just calls fn.
std::unique_ptr<CapturedStreams> CaptureCurrentStreams();

}  // namespace ddp::dist::internal

#endif  // DDP_DDP_DEVICE_OPS_H_
