// The CUDA-less build of device_ops.h: only CPU tensors reach collectives.

#include <stdexcept>

#include "ddp/device_ops.h"

namespace ddp::dist::internal {

bool DeviceSupportBuilt() { return false; }

std::string NoCudaMessage(const std::string& what) {
  return what + " needs CUDA, but this binary was built without it; rebuild with "
                "`bazel build --config=cuda ...`";
}

void CheckCollectiveDevice(nn::Device device, const std::string& where) {
  if (device.is_cpu()) return;
  throw std::invalid_argument(where + " is on " + device.ToString() + ": " +
                              NoCudaMessage("a collective on a device tensor"));
}

std::unique_ptr<DeviceFence> MakeFence(nn::Device device, const std::vector<nn::Tensor>&) {
  throw std::invalid_argument(NoCudaMessage("a collective on " + device.ToString()));
}

namespace {
class NoStreams final : public CapturedStreams {
 public:
  void Run(const std::function<void()>& fn) const override { fn(); }
};
}  // namespace

std::unique_ptr<CapturedStreams> CaptureCurrentStreams() { return std::make_unique<NoStreams>(); }

}  // namespace ddp::dist::internal
