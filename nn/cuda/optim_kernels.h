// Optimizer updates and the loss scaler's unscale/inf-check on the device:
// one fused kernel per parameter and step, the same arithmetic as nn/optim's
// CPU kernels (PyTorch's rules). These are the device halves of nn/optim:
// Init() registers them with nn/optim's registry (nn/optim/device_kernels.h),
// through which Sgd, Adam, AdamW and GradScaler reach them for CUDA
// parameters; nn/optim itself never depends on this library.
#pragma once

#include <cstdint>

#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {

/// PyTorch's SGD options.
struct SgdUpdate {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

/// p -= lr * update(grad * grad_scale) in place; momentum_buffer (p's shape,
/// undefined when momentum is 0) carries the state. `step` counts from 1 (the
/// first step initializes the buffer). p, grad and the buffer: contiguous, one
/// CUDA device, one dtype (f32 or f64).
void SgdStep(const Tensor& p, const Tensor& grad, const Tensor& momentum_buffer, int64_t step, const SgdUpdate& o,
             double grad_scale = 1.0);

/// PyTorch's Adam (decoupled = false) or AdamW (decoupled = true) options.
struct AdamUpdate {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool decoupled = false;
};

/// One Adam/AdamW step in place; exp_avg, exp_avg_sq (and max_exp_avg_sq with
/// amsgrad, else undefined) hold the state. Same layout rules as SgdStep.
void AdamStep(const Tensor& p, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
              const Tensor& max_exp_avg_sq, int64_t step, const AdamUpdate& o, double grad_scale = 1.0);

/// For the dynamic loss scaler: multiplies each tensor by inv_scale in place
/// and sets found_inf (an f32 tensor of one element on the same device) to 1
/// when any element was inf or NaN. Never reads found_inf back: no host
/// synchronization; the caller zeroes it before the first call of a step.
void UnscaleAndCheck(const std::vector<Tensor>& tensors, double inv_scale, const Tensor& found_inf);

/// Registers SgdStep, AdamStep and UnscaleAndCheck with nn/optim for CUDA
/// devices (Init() calls it).
void RegisterOptimKernels();

}  // namespace ddp::nn::cuda
