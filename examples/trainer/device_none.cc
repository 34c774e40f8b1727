// --device in a build without CUDA: only "cpu".

#include "examples/trainer/config.h"
#include "examples/trainer/device.h"

namespace ddp::examples::trainer {

bool CudaBuilt() { return false; }

void CheckDeviceFlag(const std::string& device) {
  if (device == "cpu") return;
  if (device == "cuda") {
    throw UsageError(
        "--device=cuda: this trainer was built without CUDA; rebuild it with "
        "`bazel build --config=cuda //examples:train`");
  }
  throw UsageError("unknown --device=" + device + "; use cpu or cuda");
}

nn::Device WorkerDevice(const std::string& device, int) {
  CheckDeviceFlag(device);
  return nn::kCPU;
}

}  // namespace ddp::examples::trainer
