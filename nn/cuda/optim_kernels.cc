#include "nn/cuda/optim_kernels.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "nn/cuda/cuda_error.h"
#include "nn/cuda/indexing.h"
#include "nn/cuda/launch.h"
#include "nn/cuda/stream.h"
#include "nn/optim/device_kernels.h"

namespace ddp::nn::cuda {

namespace {

void CheckState(const char* op, const Tensor& p, const char* name, const Tensor& t) {
  if (!t.defined()) throw std::invalid_argument(std::string(op) + ": " + name + " is undefined");
  if (t.shape() != p.shape() || t.dtype() != p.dtype() || t.device() != p.device() || !t.is_contiguous()) {
    throw std::invalid_argument(std::string(op) + ": " + name + " " + ShapeToString(t.shape()) + " " +
                                std::string(DTypeName(t.dtype())) + " on " + t.device().ToString() +
                                (t.is_contiguous() ? "" : " (not contiguous)") + " does not match the parameter " +
                                ShapeToString(p.shape()) + " " + std::string(DTypeName(p.dtype())) + " on " +
                                p.device().ToString());
  }
}

void CheckParam(const char* op, const Tensor& p) {
  if (!p.defined() || !p.device().is_cuda() || !p.is_contiguous() ||
      (p.dtype() != DType::kFloat32 && p.dtype() != DType::kFloat64)) {
    throw std::invalid_argument(std::string(op) + ": the parameter must be a contiguous f32 or f64 CUDA tensor");
  }
}

void CheckStep(const char* op, int64_t step) {
  if (step < 1) throw std::invalid_argument(std::string(op) + ": step counts from 1, got " + std::to_string(step));
}

}  // namespace

void SgdStep(const Tensor& p, const Tensor& grad, const Tensor& momentum_buffer, const optim::SgdStepArgs& o) {
  const int64_t step = o.step;
  CheckParam("SgdStep", p);
  CheckStep("SgdStep", step);
  CheckState("SgdStep", p, "grad", grad);
  if (o.momentum != 0) CheckState("SgdStep", p, "momentum_buffer", momentum_buffer);
  launch::SgdCoefficients c;
  c.weight_decay = o.weight_decay;
  c.momentum = o.momentum;
  c.keep = 1.0 - o.dampening;
  c.neg_lr = -o.lr;
  c.grad_scale = o.grad_scale;
  c.first_step = step == 1;
  c.nesterov = o.nesterov;
  DeviceGuard guard(p.device().index);
  CheckCuda(launch::SgdStep(p.data_ptr(), grad.data_ptr(), o.momentum != 0 ? momentum_buffer.data_ptr() : nullptr,
                            p.numel(), c, ToDt(p.dtype()), CurrentStream(p.device())),
            "kernel `sgd_step`");
  p.storage()->BumpVersion();
}

void AdamStep(const Tensor& p, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
              const Tensor& max_exp_avg_sq, const optim::AdamStepArgs& o) {
  const int64_t step = o.step;
  CheckParam("AdamStep", p);
  CheckStep("AdamStep", step);
  CheckState("AdamStep", p, "grad", grad);
  CheckState("AdamStep", p, "exp_avg", exp_avg);
  CheckState("AdamStep", p, "exp_avg_sq", exp_avg_sq);
  if (o.amsgrad) CheckState("AdamStep", p, "max_exp_avg_sq", max_exp_avg_sq);
  // Scalars in f64 as Python computes them; the kernel rounds them to the element type.
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  launch::AdamCoefficients c;
  c.beta1 = o.beta1;
  c.one_minus_beta1 = 1.0 - o.beta1;
  c.beta2 = o.beta2;
  c.one_minus_beta2 = 1.0 - o.beta2;
  c.eps = o.eps;
  c.weight_decay = o.weight_decay;
  c.decay = 1.0 - o.lr * o.weight_decay;
  c.neg_step_size = -(o.lr / bc1);
  c.bc2_sqrt = std::sqrt(bc2);
  c.grad_scale = o.grad_scale;
  c.coupled_weight_decay = !o.decoupled && o.weight_decay != 0;
  c.decoupled_weight_decay = o.decoupled;
  DeviceGuard guard(p.device().index);
  CheckCuda(launch::AdamStep(p.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                             o.amsgrad ? max_exp_avg_sq.data_ptr() : nullptr, p.numel(), c, ToDt(p.dtype()),
                             CurrentStream(p.device())),
            "kernel `adam_step`");
  p.storage()->BumpVersion();
}

void UnscaleAndCheck(const std::vector<Tensor>& tensors, double inv_scale, const Tensor& found_inf) {
  if (!found_inf.defined() || found_inf.numel() != 1 || found_inf.dtype() != DType::kFloat32 ||
      !found_inf.device().is_cuda()) {
    throw std::invalid_argument("UnscaleAndCheck: found_inf must be a one-element f32 CUDA tensor");
  }
  DeviceGuard guard(found_inf.device().index);
  const cudaStream_t stream = CurrentStream(found_inf.device());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (!t.defined()) continue;
    if (t.device() != found_inf.device() || !t.is_contiguous() || !IsFloating(t.dtype())) {
      throw std::invalid_argument("UnscaleAndCheck: tensor " + std::to_string(i) + " (" + ShapeToString(t.shape()) +
                                  " " + std::string(DTypeName(t.dtype())) + " on " + t.device().ToString() +
                                  ") must be a contiguous floating tensor on " + found_inf.device().ToString());
    }
    CheckCuda(launch::UnscaleAndCheck(t.data_ptr(), t.numel(), inv_scale, static_cast<float*>(found_inf.data_ptr()),
                                      ToDt(t.dtype()), stream),
              "kernel `unscale_and_check`");
    t.storage()->BumpVersion();
  }
}

void AdadeltaStep(const Tensor& p, const Tensor& grad, const Tensor& square_avg, const Tensor& acc_delta,
                  const optim::AdadeltaStepArgs& o) {
  CheckParam("AdadeltaStep", p);
  CheckState("AdadeltaStep", p, "grad", grad);
  CheckState("AdadeltaStep", p, "square_avg", square_avg);
  CheckState("AdadeltaStep", p, "acc_delta", acc_delta);
  // 1 - rho and -lr in f64 as the CPU loop forms them; the kernel rounds them to the element type.
  launch::AdadeltaCoefficients c;
  c.rho = o.rho;
  c.one_minus_rho = 1.0 - o.rho;
  c.eps = o.eps;
  c.weight_decay = o.weight_decay;
  c.neg_lr = -o.lr;
  c.grad_scale = o.grad_scale;
  DeviceGuard guard(p.device().index);
  CheckCuda(launch::AdadeltaStep(p.data_ptr(), grad.data_ptr(), square_avg.data_ptr(), acc_delta.data_ptr(),
                                 p.numel(), c, ToDt(p.dtype()), CurrentStream(p.device())),
            "kernel `adadelta_step`");
  p.storage()->BumpVersion();
  square_avg.storage()->BumpVersion();
  acc_delta.storage()->BumpVersion();
}

void MaxAbs(const std::vector<Tensor>& tensors, const Tensor& out) {
  if (!out.defined() || out.numel() != 1 || out.dtype() != DType::kFloat64 || !out.device().is_cuda() ||
      !out.is_contiguous()) {
    throw std::invalid_argument("MaxAbs: out must be a one-element f64 CUDA tensor");
  }
  // Every tensor is checked before the first launch, so a bad one leaves out untouched.
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (!t.defined()) continue;
    if (t.device() != out.device() || !t.is_contiguous() || !IsFloating(t.dtype())) {
      throw std::invalid_argument("MaxAbs: tensor " + std::to_string(i) + " (" + ShapeToString(t.shape()) + " " +
                                  std::string(DTypeName(t.dtype())) + " on " + t.device().ToString() +
                                  ") must be a contiguous floating tensor on " + out.device().ToString());
    }
  }
  DeviceGuard guard(out.device().index);
  const cudaStream_t stream = CurrentStream(out.device());
  for (const Tensor& t : tensors) {
    if (!t.defined()) continue;
    CheckCuda(launch::MaxAbs(t.data_ptr(), t.numel(), static_cast<double*>(out.data_ptr()), ToDt(t.dtype()), stream),
              "kernel `max_abs`");
  }
  out.storage()->BumpVersion();
}

void RegisterOptimKernels() {
  optim::RegisterDeviceOptimKernels(DeviceType::kCUDA, optim::DeviceOptimKernels{
                                                           .sgd_step = &SgdStep,
                                                           .adam_step = &AdamStep,
                                                           .unscale_and_check = &UnscaleAndCheck,
                                                           .adadelta_step = &AdadeltaStep,
                                                           .max_abs = &MaxAbs,
                                                       });
}

}  // namespace ddp::nn::cuda
