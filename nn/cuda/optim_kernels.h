// Optimizer updates and the loss scaler's unscale/inf-check on the device:
// fused kernels, one per parameter and step, or, for SGD and the unscale,
// one per group of tensors (multi-tensor launches, as PyTorch's _foreach
// kernels); the same arithmetic as nn/optim's CPU kernels (PyTorch's rules). These are the device halves of nn/optim:
// Init() registers them with nn/optim's registry (nn/optim/device_kernels.h),
// through which Sgd, Adam, AdamW, Adadelta, Rmsprop, Adagrad, GradScaler and ClipGradNorm's
// infinity norm reach them for CUDA tensors; nn/optim itself never depends
// on this library.
#pragma once

#include <cstdint>
#include <vector>

#include "nn/optim/device_kernels.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {

/// p -= lr * update(grad * args.grad_scale) in place (PyTorch's rule);
/// momentum_buffer (p's shape, undefined when momentum is 0) carries the
/// state; args.step counts from 1 (the first step initializes the buffer).
/// p, grad and the buffer: contiguous, one CUDA device, one dtype (f32 or
/// f64). Registered with nn/optim as its CUDA `sgd_step`.
void SgdStep(const Tensor& p, const Tensor& grad, const Tensor& momentum_buffer, const optim::SgdStepArgs& args);

/// SgdStep on params[i], grads[i], momentum_buffers[i] (undefined when
/// momentum is 0) for every i, with the same args, in a few launches (one
/// per dtype and table of up to 48 tensors and 320 chunks of 64 Ki
/// elements), bit for bit as SgdStep would give. The three vectors have one
/// length; the parameters may differ in shape and dtype (f32 or f64), not
/// in device. Every tensor is checked before anything is queued. Registered
/// as nn/optim's CUDA `sgd_step_multi`.
void SgdStepMulti(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                  const std::vector<Tensor>& momentum_buffers, const optim::SgdStepArgs& args);

/// One Adam (args.decoupled false) or AdamW step in place; exp_avg,
/// exp_avg_sq (and max_exp_avg_sq with amsgrad, else undefined) hold the
/// state. Same layout rules as SgdStep.
void AdamStep(const Tensor& p, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
              const Tensor& max_exp_avg_sq, const optim::AdamStepArgs& args);

/// For the dynamic loss scaler: multiplies each tensor by inv_scale in place
/// and sets found_inf (an f32 tensor of one element on the same device) to 1
/// when any element was inf or NaN. Never reads found_inf back: no host
/// synchronization; the caller zeroes it before the first call of a step.
/// Tensors: contiguous, floating, any mix of dtypes (undefined ones
/// skipped), all checked before anything is queued; one launch per dtype
/// and table of up to 110 tensors and 320 chunks.
void UnscaleAndCheck(const std::vector<Tensor>& tensors, double inv_scale, const Tensor& found_inf);

/// One Adadelta step in place: square_avg and acc_delta hold the state
/// (zero before the first step). Same layout rules as SgdStep. Registered
/// as nn/optim's CUDA `adadelta_step`.
void AdadeltaStep(const Tensor& p, const Tensor& grad, const Tensor& square_avg, const Tensor& acc_delta,
                  const optim::AdadeltaStepArgs& args);

/// For ClipGradNorm's infinity norm: raises out (a one-element f64 CUDA
/// tensor holding a value >= 0, zeroed by the caller) to the largest |x|
/// over the tensors (contiguous, floating, out's device; undefined ones
/// skipped), NaN when any element is NaN. Never reads out back. Registered
/// as nn/optim's CUDA `max_abs`.
void MaxAbs(const std::vector<Tensor>& tensors, const Tensor& out);

/// One RMSprop step in place: square_avg, momentum_buffer (undefined when
/// args.momentum is 0) and grad_avg (undefined unless args.centered) hold
/// the state (zero before the first step). Same layout rules as SgdStep.
/// Registered as nn/optim's CUDA `rmsprop_step`.
void RmspropStep(const Tensor& p, const Tensor& grad, const Tensor& square_avg, const Tensor& momentum_buffer,
                 const Tensor& grad_avg, const optim::RmspropStepArgs& args);

/// One Adagrad step in place at rate args.clr: sum holds the state (the
/// initial accumulator value before the first step). Same layout rules as
/// SgdStep. Registered as nn/optim's CUDA `adagrad_step`.
void AdagradStep(const Tensor& p, const Tensor& grad, const Tensor& sum, const optim::AdagradStepArgs& args);

/// Registers SgdStep, AdamStep, UnscaleAndCheck, AdadeltaStep, MaxAbs,
/// SgdStepMulti, RmspropStep and AdagradStep with nn/optim for CUDA devices
/// (Init() calls it).
void RegisterOptimKernels();

}  // namespace ddp::nn::cuda
