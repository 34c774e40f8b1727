#ifndef DDP_NN_OPTIM_DEVICE_KERNELS_H_
#define DDP_NN_OPTIM_DEVICE_KERNELS_H_

// The device halves of nn/optim: fused update and unscale kernels that a
// device backend registers per device type, so that nn/optim never depends
// on a backend at build time. nn::cuda::Init() registers CUDA's
// (nn/cuda/optim_kernels.h). Optimizers, GradScaler and ClipGradNorm look a
// parameter's device type up here. ClipGradNorm's finite norms compose the
// ops kernel table's elementwise kernels and reductions; its infinity norm
// needs `max_abs` from here.
//
// Conventions: every tensor of one call is contiguous and lives on one
// device; parameters, gradients and state share the compute dtype (f32 or
// f64); kernels are queued on the device's current stream and never wait
// for the device.

#include <cstdint>
#include <vector>

#include "nn/tensor/tensor.h"

namespace ddp::nn::optim {

/// One SGD step's coefficients (PyTorch's rule, see sgd.h).
struct SgdStepArgs {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  /// 1 when the update starts the momentum buffer (buf = d): the
  /// parameter's first, or its first after a state without a buffer was
  /// loaded. Used for nothing else: SGD passes 2 for every later update,
  /// not the parameter's step count, so that parameters whose counts
  /// differ share one sgd_step_multi call.
  int64_t step = 1;
  double grad_scale = 1.0;   ///< Multiplies the gradient as it is read.

  friend bool operator==(const SgdStepArgs&, const SgdStepArgs&) = default;
};

/// One Adam/AdamW step's coefficients (PyTorch's rule, see adam.h).
struct AdamStepArgs {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool decoupled = false;  ///< AdamW.
  int64_t step = 1;
  double grad_scale = 1.0;
};

/// One Adadelta step's coefficients (PyTorch's rule, see adadelta.h).
struct AdadeltaStepArgs {
  double lr = 1.0;
  double rho = 0.9;
  double eps = 1e-6;
  double weight_decay = 0.0;  ///< L2 penalty added to the (scaled) gradient.
  double grad_scale = 1.0;    ///< Multiplies the gradient as it is read.
};

/// One RMSprop step's coefficients (PyTorch's rule, see rmsprop.h).
struct RmspropStepArgs {
  double lr = 0.01;
  double alpha = 0.99;
  double eps = 1e-8;
  double weight_decay = 0.0;  ///< L2 penalty added to the (scaled) gradient.
  double momentum = 0.0;
  bool centered = false;
  double grad_scale = 1.0;    ///< Multiplies the gradient as it is read.
};

/// One Adagrad step's coefficients (PyTorch's rule, see adagrad.h). The
/// accumulator arrives already holding initial_accumulator_value on the
/// parameter's first update.
struct AdagradStepArgs {
  /// This step's rate: lr / (1 + (step - 1) * lr_decay), in f64.
  double clr = 0.01;
  double eps = 1e-10;
  double weight_decay = 0.0;  ///< L2 penalty added to the (scaled) gradient.
  double grad_scale = 1.0;    ///< Multiplies the gradient as it is read.
};

/// Kernels of one device type; an empty entry is reported by name.
struct DeviceOptimKernels {
  /// p and momentum_buffer (undefined when momentum is 0) updated in place.
  void (*sgd_step)(const Tensor& p, const Tensor& grad, const Tensor& momentum_buffer,
                   const SgdStepArgs& args) = nullptr;
  /// p, exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad, else undefined) in place.
  void (*adam_step)(const Tensor& p, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                    const Tensor& max_exp_avg_sq, const AdamStepArgs& args) = nullptr;
  /// Multiplies every tensor (any floating dtype) by inv_scale in place and
  /// sets found_inf (one f32 element on the same device, zeroed by the
  /// caller) to 1 if any element was inf or NaN; never reads it back.
  void (*unscale_and_check)(const std::vector<Tensor>& tensors, double inv_scale,
                            const Tensor& found_inf) = nullptr;
  // Entries are appended, never reordered (designated initializers name them in order).
  /// p, square_avg and acc_delta updated in place.
  void (*adadelta_step)(const Tensor& p, const Tensor& grad, const Tensor& square_avg, const Tensor& acc_delta,
                        const AdadeltaStepArgs& args) = nullptr;
  /// Raises out (one f64 element on the same device, zeroed by the caller)
  /// to the largest |element| of the tensors (any floating dtype, undefined
  /// ones skipped); a NaN anywhere makes out NaN. Never reads it back.
  void (*max_abs)(const std::vector<Tensor>& tensors, const Tensor& out) = nullptr;
  /// sgd_step on params[i], grads[i] and momentum_buffers[i] (undefined
  /// when momentum is 0) for every i, all with `args` (so all starting
  /// their buffer or none); the vectors have one length, the parameters one device, maybe
  /// several shapes and dtypes. Optional: SGD calls it once per group of
  /// parameters with equal args where it is registered, sgd_step per
  /// parameter where not.
  void (*sgd_step_multi)(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                         const std::vector<Tensor>& momentum_buffers, const SgdStepArgs& args) = nullptr;
  /// p, square_avg, momentum_buffer (undefined when momentum is 0) and
  /// grad_avg (undefined unless centered) updated in place.
  void (*rmsprop_step)(const Tensor& p, const Tensor& grad, const Tensor& square_avg, const Tensor& momentum_buffer,
                       const Tensor& grad_avg, const RmspropStepArgs& args) = nullptr;
  /// p and sum updated in place.
  void (*adagrad_step)(const Tensor& p, const Tensor& grad, const Tensor& sum, const AdagradStepArgs& args) = nullptr;
};

/// Installs the kernels of a device type (replacing any previous ones).
/// The CPU has none by default: CPU parameters are updated by nn/optim's
/// own vectorized loops. A test may register CPU kernels to run the device
/// path on CPU tensors (and unregister them with an empty table).
void RegisterDeviceOptimKernels(DeviceType type, const DeviceOptimKernels& kernels);
/// The kernels of a device type (all entries empty when none were registered).
const DeviceOptimKernels& DeviceOptimKernelsFor(DeviceType type);

namespace internal {
/// True when tensors on `device` take the device path: any non-CPU device,
/// and the CPU while a CPU table is registered (tests).
bool UsesDevicePath(Device device);
/// Throws std::runtime_error naming the op, the entry and the device.
[[noreturn]] void ThrowNoDeviceKernel(const char* op, const char* entry, Device device);
}  // namespace internal

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_DEVICE_KERNELS_H_
