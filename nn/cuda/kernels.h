// The CUDA kernel table (see nn/ops/dispatch.h for each entry's contract).
// Entries that are still empty fail by name ("op `conv2d_forward` has no
// kernel for device cuda:0 yet").
#pragma once

#include <cstdint>

#include "nn/ops/dispatch.h"

namespace ddp::nn::cuda {

/// The kernels this library implements, for ops::RegisterKernels.
ops::KernelTable CudaKernelTable();

/// Whether unary, unary_backward and binary move 16 bytes per operand and
/// load or store (8 bf16/f16, 4 f32 or 2 f64 elements) when every operand is
/// contiguous over the output and 16-byte aligned, instead of one element
/// at a time through the index arithmetic. Off by default until measured on
/// a GPU; DDP_NN_CUDA_VEC=1 turns it on for a process (any value but 0 or 1
/// is an error naming it), tests switch it with the setter.
bool VectorizedElementwise();
void SetVectorizedElementwise(bool on);
/// Launches that took that path so far in this process (for tests).
uint64_t PackedElementwiseLaunches();

}  // namespace ddp::nn::cuda
