// The CUDA backend of nn: device memory, copies and kernels for tensors on
// "cuda:N". Built only with --config=cuda.
//
// Usage: call ddp::nn::cuda::Init() once, before the first CUDA tensor (it is
// idempotent and thread-safe). It was chosen over a static registrar so that
// linking the library never changes behaviour by itself, and so that a
// binary decides when CUDA becomes visible. Init() registers the device
// backend (caching allocator, copies, synchronize), the kernel table and
// nn/optim's device kernels (fused SGD/Adam, unscale-and-check); it
// does not touch the driver, so it is safe before fork/exec and on a machine
// without a GPU (the first allocation then fails naming the device).
//
//   ddp::nn::cuda::Init();
//   nn::Tensor x = nn::Randn({64, 784}).To(nn::Device::Parse("cuda:0"));
#pragma once

namespace ddp::nn::cuda {

/// Registers the CUDA device backend and kernel table with nn (idempotent).
void Init();

/// Whether f32 GEMMs may use TF32 tensor cores (10-bit mantissa inputs,
/// f32 accumulation). Off by default, so that results match f32 to ~1e-6
/// relative; DDP_NN_CUDA_TF32=1 (or on, true, yes) turns it on at startup.
void SetAllowTf32(bool allow);
bool AllowTf32();

}  // namespace ddp::nn::cuda
