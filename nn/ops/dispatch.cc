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
  // The target must be a shape that broadcasts to g's (as torch's
  // sum_to_size): no more dimensions than g, and each size equal to g's
  // trailing one or 1. Checked here, before the padding below takes a
  // longer target's rank difference as a huge count.
  const int64_t lead = g.dim() - static_cast<int64_t>(shape.size());
  bool fits = lead >= 0;
  for (size_t i = 0; fits && i < shape.size(); ++i) {
    fits = shape[i] == 1 || shape[i] == g.shape()[static_cast<size_t>(lead) + i];
  }
  if (!fits) {
    throw std::invalid_argument("SumToShape: cannot sum a gradient of shape " + ShapeToString(g.shape()) +
                                " to shape " + ShapeToString(shape) +
                                " (the target needs no more dimensions than the gradient, and each of its sizes "
                                "equal to the gradient's trailing one or 1)");
  }
  // Pad the target with leading ones to g's rank, sum, then drop them.
  Shape padded(g.dim() - shape.size(), 1);
  padded.insert(padded.end(), shape.begin(), shape.end());
  Tensor out = Empty(padded, {.dtype = g.dtype(), .device = g.device()});
  DDP_KERNEL(g.device(), sum_to)(g, out, 1.0);
  return out.View(shape);
}
}  // namespace detail

}  // namespace ddp::nn::ops
