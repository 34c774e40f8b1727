// --device in a CUDA build.

#include "examples/trainer/config.h"
#include "examples/trainer/device.h"
#include "nn/cuda/cuda.h"
#include "nn/cuda/stream.h"

namespace ddp::examples::trainer {

bool CudaBuilt() { return true; }

void CheckDeviceFlag(const std::string& device) {
  if (device == "cpu" || device == "cuda") return;
  throw UsageError("unknown --device=" + device + "; use cpu or cuda");
}

nn::Device WorkerDevice(const std::string& device, int local_rank) {
  CheckDeviceFlag(device);
  if (device == "cpu") return nn::kCPU;
  nn::cuda::Init();
  const int count = nn::cuda::DeviceCount();
  if (count < 1) {
    throw UsageError("--device=cuda: no CUDA device is visible to the rank with local rank " +
                     std::to_string(local_rank) + " (check CUDA_VISIBLE_DEVICES and the driver)");
  }
  const nn::Device d(nn::DeviceType::kCUDA, local_rank % count);
  nn::cuda::CheckDevice(d);
  return d;
}

}  // namespace ddp::examples::trainer
