#include <mutex>

#include "nn/cuda/allocator.h"
#include "nn/cuda/copy.h"
#include "nn/cuda/cuda.h"
#include "nn/cuda/kernels.h"
#include "nn/cuda/optim_kernels.h"
#include "nn/cuda/stream.h"
#include "nn/ops/dispatch.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {

void Init() {
  static std::once_flag once;
  std::call_once(once, [] {
    DeviceBackend backend;
    backend.allocator = &CudaAllocator();
    backend.copy_bytes = &CopyBytes;
    backend.copy_strided = &CopyStrided;
    backend.synchronize = &Synchronize;
    backend.fill = &Fill;
    backend.device_count = &DeviceCount;
    RegisterDeviceBackend(DeviceType::kCUDA, backend);
    ops::RegisterKernels(DeviceType::kCUDA, CudaKernelTable());
    RegisterOptimKernels();
  });
}

}  // namespace ddp::nn::cuda
