// What the files that call cuDNN share: its statuses as exceptions, one
// handle per thread and device, and its names of nn's dtypes.
#pragma once

#include <cudnn.h>

#include "nn/tensor/device.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {

/// Throws CudaError naming `call` and cuDNN's message unless `status` is success.
void CheckCudnn(cudnnStatus_t status, const char* call);

/// This thread's cuDNN handle for `device` (created on first use; see
/// library_handles.h). Set its stream before each use.
cudnnHandle_t CudnnHandleFor(Device device);

/// Owns one cuDNN descriptor `d` (null until created), destroyed with it.
/// The wrappers that create and set a descriptor derive from (or hold) one,
/// so that it is destroyed even when they throw after creating it.
template <typename T, cudnnStatus_t (*Destroy)(T)>
struct CudnnDescriptor {
  T d = nullptr;
  CudnnDescriptor() = default;
  ~CudnnDescriptor() {
    if (d != nullptr) (void)Destroy(d);
  }
  CudnnDescriptor(const CudnnDescriptor&) = delete;
  CudnnDescriptor& operator=(const CudnnDescriptor&) = delete;
};
using CudnnTensorDescriptor = CudnnDescriptor<cudnnTensorDescriptor_t, &cudnnDestroyTensorDescriptor>;

/// cuDNN's type for f32, f64, f16 and bf16; std::invalid_argument naming
/// the dtype for any other.
cudnnDataType_t CudnnType(DType t);

}  // namespace ddp::nn::cuda
