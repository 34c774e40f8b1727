#include "nn/optim/device_kernels.h"

#include <atomic>
#include <stdexcept>
#include <string>

namespace ddp::nn::optim {

namespace {

struct Registry {
  DeviceOptimKernels tables[kNumDeviceTypes];
  std::atomic<bool> cpu_registered{false};
};

Registry& TheRegistry() {
  static Registry* r = new Registry();
  return *r;
}

}  // namespace

void RegisterDeviceOptimKernels(DeviceType type, const DeviceOptimKernels& kernels) {
  Registry& r = TheRegistry();
  r.tables[static_cast<int>(type)] = kernels;
  if (type == DeviceType::kCPU) {
    r.cpu_registered = kernels.sgd_step != nullptr || kernels.adam_step != nullptr ||
                       kernels.adadelta_step != nullptr || kernels.unscale_and_check != nullptr ||
                       kernels.max_abs != nullptr || kernels.sgd_step_multi != nullptr ||
                       kernels.rmsprop_step != nullptr || kernels.adagrad_step != nullptr;
  }
}

const DeviceOptimKernels& DeviceOptimKernelsFor(DeviceType type) {
  return TheRegistry().tables[static_cast<int>(type)];
}

namespace internal {

bool UsesDevicePath(Device device) { return !device.is_cpu() || TheRegistry().cpu_registered.load(); }

void ThrowNoDeviceKernel(const char* op, const char* entry, Device device) {
  throw std::runtime_error(std::string(op) + ": no device kernel `" + entry + "` for " + device.ToString() +
                           (device.is_cuda() ? " (the CUDA library registers them in nn::cuda::Init(), in a "
                                               "build with --config=cuda)"
                                             : ""));
}

}  // namespace internal

}  // namespace ddp::nn::optim
