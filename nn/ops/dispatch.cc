#include "nn/ops/dispatch.h"

#include <stdexcept>
#include <string>

#include "nn/ops/cpu/cpu_kernels.h"

namespace ddp::nn::ops {

namespace {

struct Tables {
  KernelTable tables[kNumDeviceTypes];
  Tables() { tables[static_cast<int>(DeviceType::kCPU)] = cpu::CpuKernelTable(); }
};

Tables& AllTables() {
  static Tables* t = new Tables();
  return *t;
}

}  // namespace

void RegisterKernels(DeviceType type, const KernelTable& table) {
  AllTables().tables[static_cast<int>(type)] = table;
}

const KernelTable& KernelsFor(DeviceType type) { return AllTables().tables[static_cast<int>(type)]; }

namespace detail {
void ThrowNoKernel(const char* op, Device device) {
  throw std::runtime_error("op `" + std::string(op) + "` has no kernel for device " + device.ToString() +
                           (device.is_cuda() ? " yet (the CUDA kernels are registered by the CUDA library, "
                                               "built with --config=cuda)"
                                             : ""));
}

Tensor SumToShape(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  // Pad the target with leading ones to g's rank, sum, then drop them.
  Shape padded(g.dim() - shape.size(), 1);
  padded.insert(padded.end(), shape.begin(), shape.end());
  Tensor out = Empty(padded, {.dtype = g.dtype(), .device = g.device()});
  DDP_KERNEL(g.device(), sum_to)(g, out, 1.0);
  return out.View(shape);
}
}  // namespace detail

}  // namespace ddp::nn::ops
