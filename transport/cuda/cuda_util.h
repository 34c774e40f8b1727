#ifndef DDP_TRANSPORT_CUDA_CUDA_UTIL_H_
#define DDP_TRANSPORT_CUDA_CUDA_UTIL_H_

// Small helpers shared by the CUDA sources of transport/cuda (CUDA build
// only; private).

#include <cuda.h>  // types only: nothing links libcuda
#include <cuda_runtime.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::cuda {

inline Status CudaError(cudaError_t error, const std::string& what) {
  return InternalError(what + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                       ")");
}

// Whether `device`'s primary context exists already. Since CUDA 12,
// cudaSetDevice creates it: a scope that put device 0 back on a thread that
// never used it (a communication thread) would give every process a
// context on GPU 0, hundreds of MiB each. The runtime has no call for this;
// the driver's cuDevicePrimaryCtxGetState is reached through its entry
// point (nothing links libcuda). True when it cannot be asked, which keeps
// the plain restore.
// (nn/cuda/stream.cc has the same check for nn::cuda::DeviceGuard.)
inline bool PrimaryContextActive(int device) {
  using DeviceGet = CUresult (*)(CUdevice*, int);
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  struct Driver {
    DeviceGet device_get = nullptr;
    GetState get_state = nullptr;
  };
  static const Driver driver = [] {
    Driver d;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuDeviceGet", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      d.device_get = reinterpret_cast<DeviceGet>(fn);
    }
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      d.get_state = reinterpret_cast<GetState>(fn);
    }
    (void)cudaGetLastError();
    return d;
  }();
  if (driver.device_get == nullptr || driver.get_state == nullptr) return true;
  CUdevice handle{};
  unsigned int flags = 0;
  int active = 1;
  if (driver.device_get(&handle, device) != CUDA_SUCCESS) return true;
  if (driver.get_state(handle, &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
}

// Makes `device` current for the scope and restores the caller's: the
// communicator may run on its own thread (current device 0) or on a user
// thread that works on another device. A previous device without a context
// (the default 0 of a thread that never chose one) is not put back.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) status_ = cudaSetDevice(device);
    if (previous_ == device) previous_ = -1;
  }
  ~DeviceScope() {
    if (previous_ >= 0 && PrimaryContextActive(previous_)) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

// The error of launching `what` (reduce_kernels.h), told apart from one
// pending before the launch, which earlier work caused.
inline Status LaunchError(int error, bool failed_before, const std::string& what) {
  if (failed_before) {
    return CudaError(static_cast<cudaError_t>(error),
                     "launching " + what + ": CUDA had already failed before this launch");
  }
  return CudaError(static_cast<cudaError_t>(error), "launching " + what);
}

// A DeviceScope that could not select its device.
inline Status ScopeStatus(const DeviceScope& scope, int device) {
  if (scope.status() == cudaSuccess) return Status::Ok();
  return CudaError(scope.status(), "selecting CUDA device " + std::to_string(device));
}

// Longest pause between two polls of PollEvent.
inline constexpr std::chrono::microseconds kMaxPollSleep{50};

// Polls `event` until it completes or `deadline` passes: never a blocking
// synchronize. Copies and kernels of a few MiB take well under a
// millisecond, so a short spin, then yields; a longer wait sleeps between
// polls, 2 us doubling up to kMaxPollSleep, so that it does not hold a core
// the training thread needs. No sleep runs past the deadline, and the event
// is queried once more after the last one.
inline Status PollEvent(cudaEvent_t event, Deadline deadline, const std::string& what) {
  std::chrono::microseconds sleep{2};
  for (int polls = 0;; ++polls) {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return Status::Ok();
    if (status != cudaErrorNotReady) return CudaError(status, what);
    const Deadline now = Clock::now();
    if (now >= deadline) {
      return TimedOutError(what + " not finished by the call's deadline");
    }
    if (polls < 64) continue;
    if (polls < 512) {
      sched_yield();
      continue;
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(sleep, deadline - now));
    sleep = std::min(sleep * 2, kMaxPollSleep);
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
