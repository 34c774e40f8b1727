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

// Whether a backend registered anything in `k`.
bool AnyEntry(const DeviceOptimKernels& k) {
  return k.sgd_step != nullptr || k.adam_step != nullptr || k.adadelta_step != nullptr ||
         k.unscale_and_check != nullptr || k.max_abs != nullptr || k.sgd_step_multi != nullptr ||
         k.rmsprop_step != nullptr || k.adagrad_step != nullptr;
}

Registry& TheRegistry() {
  static Registry* r = new Registry();
  return *r;
}

}  // namespace

void RegisterDeviceOptimKernels(DeviceType type, const DeviceOptimKernels& kernels) {
  Registry& r = TheRegistry();
  r.tables[static_cast<int>(type)] = kernels;
  if (type == DeviceType::kCPU) {
    r.cpu_registered = AnyEntry(kernels);
  }
}

const DeviceOptimKernels& DeviceOptimKernelsFor(DeviceType type) {
  return TheRegistry().tables[static_cast<int>(type)];
}

namespace internal {

bool UsesDevicePath(Device device) { return !device.is_cpu() || TheRegistry().cpu_registered.load(); }

void ThrowNoDeviceKernel(const char* op, const char* entry, Device device) {
  // A backend that registered its table but lacks this entry (nn/cuda has
  // no rmsprop_step yet) is not helped by being told to call Init.
  std::string hint;
  if (AnyEntry(DeviceOptimKernelsFor(device.type))) {
    hint = " (its backend registered kernels without this entry)";
  } else if (device.is_cuda()) {
    hint = " (the CUDA library registers them in nn::cuda::Init(), in a build with --config=cuda)";
  }
  throw std::runtime_error(std::string(op) + ": no device kernel `" + entry + "` for " + device.ToString() + hint);
}

}  // namespace internal

}  // namespace ddp::nn::optim
