#include "nn/cuda/cudnn_util.h"

#include <stdexcept>
#include <string>

#include "nn/cuda/cuda_error.h"
#include "nn/cuda/library_handles.h"

namespace ddp::nn::cuda {
namespace {

void CreateCudnn(cudnnHandle_t* handle) { CheckCudnn(cudnnCreate(handle), "cudnnCreate"); }

}  // namespace

void CheckCudnn(cudnnStatus_t status, const char* call) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  throw CudaError(std::string(call) + " failed: " + cudnnGetErrorString(status), static_cast<int>(status));
}

cudnnHandle_t CudnnHandleFor(Device device) { return LibraryHandles<cudnnHandle_t, CreateCudnn>::For(device); }

cudnnDataType_t CudnnType(DType t) {
  switch (t) {
    case DType::kFloat32: return CUDNN_DATA_FLOAT;
    case DType::kFloat64: return CUDNN_DATA_DOUBLE;
    case DType::kFloat16: return CUDNN_DATA_HALF;
    case DType::kBFloat16: return CUDNN_DATA_BFLOAT16;
    default:
      throw std::invalid_argument("cuDNN on CUDA: unsupported dtype " + std::string(DTypeName(t)) +
                                  " (f32, f64, f16, bf16)");
  }
}

}  // namespace ddp::nn::cuda
