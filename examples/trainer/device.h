#ifndef DDP_EXAMPLES_TRAINER_DEVICE_H_
#define DDP_EXAMPLES_TRAINER_DEVICE_H_

// --device: where a rank trains. Built from device_cuda.cc under
// --config=cuda and from device_none.cc otherwise; the header has no CUDA in
// it, so the plain trainer stays CPU-only.

#include <string>

#include "nn/tensor/device.h"

namespace ddp::examples::trainer {

/// True when the trainer was built with --config=cuda.
bool CudaBuilt();

/// Throws UsageError (one line) unless `device` is "cpu", or "cuda" in a
/// CUDA build. Touches no driver: safe in the launcher before it spawns.
void CheckDeviceFlag(const std::string& device);

/// In a worker, after it was spawned: the device this rank computes on.
/// "cuda" initializes nn's CUDA backend and picks cuda:(local_rank modulo
/// the visible devices), so several ranks may share one GPU. Never call it
/// in a launcher before fork/exec.
nn::Device WorkerDevice(const std::string& device, int local_rank);

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_DEVICE_H_
