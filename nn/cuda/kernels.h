// The CUDA kernel table (see nn/ops/dispatch.h for each entry's contract).
// Entries that are still empty fail by name ("op `conv2d_forward` has no
// kernel for device cuda:0 yet").
#pragma once

#include "nn/ops/dispatch.h"

namespace ddp::nn::cuda {

/// The kernels this library implements, for ops::RegisterKernels.
ops::KernelTable CudaKernelTable();

}  // namespace ddp::nn::cuda
