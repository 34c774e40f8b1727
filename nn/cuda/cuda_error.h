// CUDA, cuBLAS and cuDNN status codes become exceptions here, in one place,
// with the name of the failing call and the library's own description, so
// that "cudaMemcpyAsync(device to host) failed: an illegal memory access was
// encountered (cudaErrorIllegalAddress)" reaches the user instead of a code.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <new>
#include <stdexcept>
#include <string>

namespace ddp::nn::cuda {

/// A failed CUDA runtime or library call.
class CudaError : public std::runtime_error {
 public:
  CudaError(const std::string& message, int code) : std::runtime_error(message), code_(code) {}
  /// The library's status code (cudaError_t or cublasStatus_t value).
  int code() const { return code_; }

 private:
  int code_;
};

/// Device memory exhausted even after the cache was released. Derives from
/// std::bad_alloc, as the Allocator contract asks, and carries a message.
class CudaOutOfMemory : public std::bad_alloc {
 public:
  explicit CudaOutOfMemory(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

/// Throws CudaError naming `call` unless err is cudaSuccess. Clears the
/// runtime's sticky last-error slot for non-sticky errors.
void CheckCuda(cudaError_t err, const char* call);
/// Throws CudaError naming `call` unless status is CUBLAS_STATUS_SUCCESS.
void CheckCublas(cublasStatus_t status, const char* call);
/// After a kernel launch: throws naming `kernel` when the launch failed.
void CheckLaunch(const char* kernel);

/// Throws CudaError "CUDA had already failed before <what>: ..." unless
/// `pending` (the thread's last error, read just before a launch) is
/// cudaSuccess, so that an earlier failure is not reported as the launch's
/// own. Reads the error as CheckCuda does (clearing it unless sticky).
void CheckNotFailedBefore(cudaError_t pending, const char* what);

/// Runs a launch wrapper of launch.h, `launch` (a callable returning its
/// cudaError_t), and checks its code as CheckCuda(code, what). An error
/// already pending on this thread is reported first, by
/// CheckNotFailedBefore, and nothing is launched. cudaPeekAtLastError only
/// reads host-side state: it adds no wait on the device.
template <typename F>
void LaunchChecked(const char* what, F&& launch) {
  CheckNotFailedBefore(cudaPeekAtLastError(), what);
  CheckCuda(launch(), what);
}

}  // namespace ddp::nn::cuda
