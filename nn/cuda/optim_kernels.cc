#include "nn/cuda/optim_kernels.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
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
    const std::string what = !p.defined() ? "(undefined)"
                                          : ShapeToString(p.shape()) + " " + std::string(DTypeName(p.dtype())) +
                                                " on " + p.device().ToString() +
                                                (p.is_contiguous() ? "" : " (not contiguous)");
    throw std::invalid_argument(std::string(op) + ": the parameter " + what +
                                " must be a contiguous f32 or f64 CUDA tensor");
  }
}

void CheckStep(const char* op, int64_t step) {
  if (step < 1) throw std::invalid_argument(std::string(op) + ": step counts from 1, got " + std::to_string(step));
}

launch::SgdCoefficients SgdCoefficientsOf(const optim::SgdStepArgs& o) {
  launch::SgdCoefficients c;
  c.weight_decay = o.weight_decay;
  c.momentum = o.momentum;
  c.keep = 1.0 - o.dampening;
  c.neg_lr = -o.lr;
  c.grad_scale = o.grad_scale;
  c.first_step = o.step == 1;
  c.nesterov = o.nesterov;
  return c;
}

// The entries of a multi-tensor launch, split by dtype: for each dtype in
// order of first appearance, its tensors in the order given.
class EntriesByDType {
 public:
  void Add(DType dtype, const launch::MultiTensorEntry& entry) {
    for (auto& [d, entries] : groups_) {
      if (d == dtype) {
        entries.push_back(entry);
        return;
      }
    }
    groups_.push_back({dtype, {entry}});
  }
  const std::vector<std::pair<DType, std::vector<launch::MultiTensorEntry>>>& groups() const { return groups_; }

 private:
  std::vector<std::pair<DType, std::vector<launch::MultiTensorEntry>>> groups_;
};

}  // namespace

void SgdStep(const Tensor& p, const Tensor& grad, const Tensor& momentum_buffer, const optim::SgdStepArgs& o) {
  CheckParam("SgdStep", p);
  CheckStep("SgdStep", o.step);
  CheckState("SgdStep", p, "grad", grad);
  if (o.momentum != 0) CheckState("SgdStep", p, "momentum_buffer", momentum_buffer);
  DeviceGuard guard(p.device().index);
  LaunchChecked("kernel `sgd_step`", [&] {
    return launch::SgdStep(p.data_ptr(), grad.data_ptr(), o.momentum != 0 ? momentum_buffer.data_ptr() : nullptr,
                           p.numel(), SgdCoefficientsOf(o), ToDt(p.dtype()), CurrentStream(p.device()));
  });
  p.storage()->BumpVersion();
}

void SgdStepMulti(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                  const std::vector<Tensor>& momentum_buffers, const optim::SgdStepArgs& o) {
  if (grads.size() != params.size() || momentum_buffers.size() != params.size()) {
    throw std::invalid_argument("SgdStepMulti: " + std::to_string(params.size()) + " parameters, " +
                                std::to_string(grads.size()) + " gradients and " +
                                std::to_string(momentum_buffers.size()) + " momentum buffers");
  }
  if (params.empty()) return;
  CheckStep("SgdStepMulti", o.step);
  // Every tensor is checked before the first launch, so a bad one leaves
  // every parameter untouched.
  const Device device = params.front().device();
  EntriesByDType entries;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string op = "SgdStepMulti: parameter " + std::to_string(i);
    const Tensor& p = params[i];
    CheckParam(op.c_str(), p);
    if (p.device() != device) {
      throw std::invalid_argument(op + " is on " + p.device().ToString() + ", parameter 0 on " + device.ToString());
    }
    CheckState(op.c_str(), p, "grad", grads[i]);
    if (o.momentum != 0) CheckState(op.c_str(), p, "momentum_buffer", momentum_buffers[i]);
    launch::MultiTensorEntry e;
    e.operands[0] = p.data_ptr();
    e.operands[1] = grads[i].data_ptr();
    e.operands[2] = o.momentum != 0 ? momentum_buffers[i].data_ptr() : nullptr;
    e.numel = p.numel();
    entries.Add(p.dtype(), e);
  }
  DeviceGuard guard(device.index);
  const cudaStream_t stream = CurrentStream(device);
  const launch::SgdCoefficients c = SgdCoefficientsOf(o);
  for (const auto& [dtype, list] : entries.groups()) {
    LaunchChecked("kernel `sgd_step_multi`", [&] {
      return launch::SgdStepMulti(list.data(), static_cast<int64_t>(list.size()), c, ToDt(dtype), stream);
    });
  }
  for (const Tensor& p : params) p.storage()->BumpVersion();
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
  LaunchChecked("kernel `adam_step`", [&] {
    return launch::AdamStep(p.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                            o.amsgrad ? max_exp_avg_sq.data_ptr() : nullptr, p.numel(), c, ToDt(p.dtype()),
                            CurrentStream(p.device()));
  });
  p.storage()->BumpVersion();
}

void UnscaleAndCheck(const std::vector<Tensor>& tensors, double inv_scale, const Tensor& found_inf) {
  if (!found_inf.defined() || found_inf.numel() != 1 || found_inf.dtype() != DType::kFloat32 ||
      !found_inf.device().is_cuda()) {
    throw std::invalid_argument("UnscaleAndCheck: found_inf must be a one-element f32 CUDA tensor");
  }
  // Every tensor is checked before the first launch, so a bad one leaves
  // every tensor untouched. One launch per dtype and table of tensors
  // (multi_tensor.h) rather than one per tensor: ResNet-50's 161 gradients
  // took 0.5 ms a step in 161 launches.
  EntriesByDType entries;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (!t.defined()) continue;
    if (t.device() != found_inf.device() || !t.is_contiguous() || !IsFloating(t.dtype())) {
      throw std::invalid_argument("UnscaleAndCheck: tensor " + std::to_string(i) + " (" + ShapeToString(t.shape()) +
                                  " " + std::string(DTypeName(t.dtype())) + " on " + t.device().ToString() +
                                  ") must be a contiguous floating tensor on " + found_inf.device().ToString());
    }
    launch::MultiTensorEntry e;
    e.operands[0] = t.data_ptr();
    e.numel = t.numel();
    entries.Add(t.dtype(), e);
  }
  DeviceGuard guard(found_inf.device().index);
  const cudaStream_t stream = CurrentStream(found_inf.device());
  for (const auto& [dtype, list] : entries.groups()) {
    LaunchChecked("kernel `unscale_and_check`", [&] {
      return launch::UnscaleAndCheckMulti(list.data(), static_cast<int64_t>(list.size()), inv_scale,
                                          static_cast<float*>(found_inf.data_ptr()), ToDt(dtype), stream);
    });
  }
  for (const Tensor& t : tensors) {
    if (t.defined()) t.storage()->BumpVersion();
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
  LaunchChecked("kernel `adadelta_step`", [&] {
    return launch::AdadeltaStep(p.data_ptr(), grad.data_ptr(), square_avg.data_ptr(), acc_delta.data_ptr(), p.numel(),
                                c, ToDt(p.dtype()), CurrentStream(p.device()));
  });
  p.storage()->BumpVersion();
  square_avg.storage()->BumpVersion();
  acc_delta.storage()->BumpVersion();
}

void RmspropStep(const Tensor& p, const Tensor& grad, const Tensor& square_avg, const Tensor& momentum_buffer,
                 const Tensor& grad_avg, const optim::RmspropStepArgs& o) {
  CheckParam("RmspropStep", p);
  CheckState("RmspropStep", p, "grad", grad);
  CheckState("RmspropStep", p, "square_avg", square_avg);
  if (o.momentum != 0) CheckState("RmspropStep", p, "momentum_buffer", momentum_buffer);
  if (o.centered) CheckState("RmspropStep", p, "grad_avg", grad_avg);
  // 1 - alpha and -lr in f64 as the CPU loop forms them; the kernel rounds them to the element type.
  launch::RmspropCoefficients c;
  c.alpha = o.alpha;
  c.one_minus_alpha = 1.0 - o.alpha;
  c.eps = o.eps;
  c.weight_decay = o.weight_decay;
  c.momentum = o.momentum;
  c.neg_lr = -o.lr;
  c.grad_scale = o.grad_scale;
  c.centered = o.centered;
  DeviceGuard guard(p.device().index);
  LaunchChecked("kernel `rmsprop_step`", [&] {
    return launch::RmspropStep(p.data_ptr(), grad.data_ptr(), square_avg.data_ptr(),
                               o.momentum != 0 ? momentum_buffer.data_ptr() : nullptr,
                               o.centered ? grad_avg.data_ptr() : nullptr, p.numel(), c, ToDt(p.dtype()),
                               CurrentStream(p.device()));
  });
  p.storage()->BumpVersion();
  square_avg.storage()->BumpVersion();
  if (o.momentum != 0) momentum_buffer.storage()->BumpVersion();
  if (o.centered) grad_avg.storage()->BumpVersion();
}

void AdagradStep(const Tensor& p, const Tensor& grad, const Tensor& sum, const optim::AdagradStepArgs& o) {
  CheckParam("AdagradStep", p);
  CheckState("AdagradStep", p, "grad", grad);
  CheckState("AdagradStep", p, "sum", sum);
  launch::AdagradCoefficients c;
  c.eps = o.eps;
  c.weight_decay = o.weight_decay;
  c.neg_clr = -o.clr;
  c.grad_scale = o.grad_scale;
  DeviceGuard guard(p.device().index);
  LaunchChecked("kernel `adagrad_step`", [&] {
    return launch::AdagradStep(p.data_ptr(), grad.data_ptr(), sum.data_ptr(), p.numel(), c, ToDt(p.dtype()),
                               CurrentStream(p.device()));
  });
  p.storage()->BumpVersion();
  sum.storage()->BumpVersion();
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
    LaunchChecked("kernel `max_abs`", [&] {
      return launch::MaxAbs(t.data_ptr(), t.numel(), static_cast<double*>(out.data_ptr()), ToDt(t.dtype()), stream);
    });
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
                                                           .sgd_step_multi = &SgdStepMulti,
                                                           .rmsprop_step = &RmspropStep,
                                                           .adagrad_step = &AdagradStep,
                                                       });
}

}  // namespace ddp::nn::cuda
