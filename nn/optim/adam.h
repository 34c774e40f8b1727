#ifndef DDP_NN_OPTIM_ADAM_H_
#define DDP_NN_OPTIM_ADAM_H_

#include "nn/optim/optimizer.h"

namespace ddp::nn::optim {

/// torch.optim.Adam's options and defaults.
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  ///< L2 penalty added to the gradient.
  bool amsgrad = false;
  bool maximize = false;      ///< Ascend: the gradient is negated first.
};

/// torch.optim.AdamW's options and defaults (weight decay 1e-2).
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  ///< Decoupled: p *= 1 - lr * weight_decay.
  bool amsgrad = false;
  bool maximize = false;       ///< Ascend: the gradient is negated first.
};

/// Adam, with PyTorch's rule (t = step, bias corrections in f64):
///   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
///   denom = sqrt(amsgrad ? max(vmax, v) : v) / sqrt(1 - beta2^t) + eps
///   p = p - lr / (1 - beta1^t) * m / denom
/// State slots: "exp_avg", "exp_avg_sq", and "max_exp_avg_sq" with amsgrad.
class Adam : public Optimizer {
 public:
  /// Throws std::invalid_argument for betas outside [0, 1) or negative
  /// lr, eps or weight decay.
  Adam(NamedParameters params, AdamOptions options);

 protected:
  /// AdamW: the same with decoupled weight decay.
  Adam(NamedParameters params, AdamOptions options, bool decoupled);

  void Update(float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool fresh,
              float grad_scale) override;
  void Update(double* p, const double* g, double* const* slots, int64_t n, int64_t step, bool fresh,
              double grad_scale) override;
  void DeviceUpdate(const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t step, bool fresh,
                    double grad_scale) override;
  void CheckDeviceKernels(Device device) const override;
  const char* Name() const override { return decoupled_ ? "AdamW" : "Adam"; }
  std::vector<Hyperparameter> Hyperparameters() const override;
  void CheckHyperparameters(const std::map<std::string, double>& values) const override;
  void SetHyperparameters(const std::map<std::string, double>& values) override;

 private:
  template <typename T>
  void Kernel(T* p, const T* g, T* const* slots, int64_t n, int64_t step, T grad_scale) const;
  /// The constructor's checks of everything but lr (the base checks that).
  void CheckOptions(const AdamOptions& o) const;

  /// These options with the saved values of `values` (see
  /// CheckHyperparameters); throws as the constructor does.
  AdamOptions WithSaved(const std::map<std::string, double>& values) const;

  AdamOptions options_;
  bool decoupled_;
};

/// AdamW (Loshchilov and Hutter): Adam whose weight decay shrinks the
/// parameter directly, p = p * (1 - lr * weight_decay), before the update.
class AdamW : public Adam {
 public:
  AdamW(NamedParameters params, AdamWOptions options);
};

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_ADAM_H_
