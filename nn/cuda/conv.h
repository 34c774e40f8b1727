// Convolution with cuDNN (the KernelTable's conv2d entries).
//
// The algorithm of each (direction, device, dtype, input, weight, geometry,
// TF32 setting) is chosen once by cuDNN's exhaustive search
// (cudnnFind*AlgorithmEx, timing every algorithm on the real buffers, like
// PyTorch's cudnn.benchmark) and cached for the process; later calls with the
// same shapes go straight to the cached algorithm. Workspaces come from the
// caching allocator, so a warm training step allocates no device memory.
// f32 convolutions use FMA kernels only unless AllowTf32(); f16 and bf16 use
// tensor cores with f32 accumulation; f64 is supported.
#pragma once

#include <cstddef>

#include "nn/ops/dispatch.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {

/// y[N,O,OH,OW] = conv(x[N,C,H,W], w[O,C/g,KH,KW]) + bias[O] (bias may be undefined).
void Conv2dForward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const ops::Conv2dParams& p);
/// Gradients of Conv2dForward; any of dx, dw, db may be undefined. Written, not accumulated.
void Conv2dBackward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                    const Tensor& db, const ops::Conv2dParams& p);

/// Number of algorithm searches run so far (each new shape costs one per direction).
size_t ConvAlgorithmSearches();

}  // namespace ddp::nn::cuda
