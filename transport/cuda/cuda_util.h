#ifndef DDP_TRANSPORT_CUDA_CUDA_UTIL_H_
#define DDP_TRANSPORT_CUDA_CUDA_UTIL_H_

// Small helpers shared by the CUDA sources of transport/cuda (CUDA build
// only; private).

#include <cuda_runtime.h>
#include <sched.h>

#include <string>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::cuda {

inline Status CudaError(cudaError_t error, const std::string& what) {
  return InternalError(what + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                       ")");
}

// Makes `device` current for the scope and restores the caller's: the
// communicator may run on its own thread (current device 0) or on a user
// thread that works on another device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) status_ = cudaSetDevice(device);
    if (previous_ == device) previous_ = -1;
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

// Polls `event` until it completes or `deadline` passes: never a blocking
// synchronize. Copies and kernels of a few MiB take well under a
// millisecond, so a short spin, then yields.
inline Status PollEvent(cudaEvent_t event, Deadline deadline, const std::string& what) {
  for (int polls = 0;; ++polls) {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return Status::Ok();
    if (status != cudaErrorNotReady) return CudaError(status, what);
    if (Clock::now() >= deadline) {
      return TimedOutError(what + " not finished by the call's deadline");
    }
    if (polls > 64) sched_yield();
  }
}

// Records `event` on `stream` and polls it: everything queued on the stream
// so far is done.
inline Status WaitStream(cudaStream_t stream, cudaEvent_t event, Deadline deadline,
                         const std::string& what) {
  const cudaError_t status = cudaEventRecord(event, stream);
  if (status != cudaSuccess) return CudaError(status, "recording an event after " + what);
  return PollEvent(event, deadline, what);
}

}  // namespace ddp::transport::cuda

#endif  // DDP_TRANSPORT_CUDA_CUDA_UTIL_H_
