// conv2d through oneDNN primitives (f32). The primitives choose their own
// blocked memory formats ("any"); tensors stay NCHW between ops, so inputs
// and outputs are reordered on each call. Primitives are cached per shape.
#pragma once

#include "nn/ops/config.h"
#include "nn/ops/dispatch.h"

namespace ddp::nn::ops::cpu::onednn {

/// Whether conv2d with these operands runs on oneDNN under `algorithm`.
bool ShouldUse(const Tensor& x, const Tensor& w, const Conv2dParams& p, ConvAlgorithm algorithm);
/// Runs the convolution; false (nothing written) when oneDNN has no
/// implementation for this geometry, so the caller falls back to im2col.
bool Conv2dForward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const Conv2dParams& p);
bool Conv2dBackward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                    const Tensor& db, const Conv2dParams& p);

}  // namespace ddp::nn::ops::cpu::onednn
