#include "nn/cuda/cuda_error.h"

namespace ddp::nn::cuda {

void CheckCuda(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return;
  // Reading the error resets it for non-sticky errors, so that one failed
  // call does not make the next unrelated check fail too.
  (void)cudaGetLastError();
  throw CudaError(std::string(call) + " failed: " + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")",
                  static_cast<int>(err));
}

void CheckCublas(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw CudaError(std::string(call) + " failed: " + cublasGetStatusString(status) + " (" +
                      cublasGetStatusName(status) + ")",
                  static_cast<int>(status));
}

void CheckLaunch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return;
  throw CudaError(std::string("launch of kernel `") + kernel + "` failed: " + cudaGetErrorString(err) + " (" +
                      cudaGetErrorName(err) + ")",
                  static_cast<int>(err));
}

void CheckNotFailedBefore(cudaError_t pending, const char* what) {
  if (pending == cudaSuccess) return;
  (void)cudaGetLastError();
  throw CudaError(std::string("CUDA had already failed before ") + what + ": " + cudaGetErrorString(pending) + " (" +
                      cudaGetErrorName(pending) + ")",
                  static_cast<int>(pending));
}

}  // namespace ddp::nn::cuda
