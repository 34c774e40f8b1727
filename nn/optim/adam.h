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
///   (max as torch.maximum: a NaN on either side is kept in vmax)
///   p = p - lr / (1 - beta1^t) * m / denom
/// State slots: "exp_avg", "exp_avg_sq", and "max_exp_avg_sq" with amsgrad.
class Adam : public OptimizerWithOptions<AdamOptions> {
 public:
  /// Throws std::invalid_argument, naming the optimizer (Adam, AdamW) and
  /// the one option at fault with its value, for beta1 or beta2 outside
  /// [0, 1), or a negative, NaN or infinite lr, eps or weight_decay.
  Adam(NamedParameters params, AdamOptions options);
  /// Parameter groups (ParamGroup), each with `defaults` overridden by its
  /// options ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad",
  /// "maximize"). Throws std::invalid_argument as the constructor above,
  /// naming the group, for an unknown option, and for amsgrad differing
  /// from the defaults (one slot layout for all).
  Adam(std::vector<ParamGroup> groups, AdamOptions defaults);

 protected:
  /// AdamW: the same with decoupled weight decay.
  Adam(std::vector<ParamGroup> groups, AdamOptions defaults, bool decoupled);

  void Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool fresh,
              float grad_scale) override;
  void Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t step, bool fresh,
              double grad_scale) override;
  void DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t step,
                    bool fresh, double grad_scale) override;
  void CheckDeviceKernels(Device device) const override;
  const char* Name() const override { return decoupled_ ? "AdamW" : "Adam"; }
  const char* MomentumOption() const override { return "beta1"; }
  std::vector<Hyperparameter> HyperparametersOf(const AdamOptions& o) const override;
  void ReadValues(const std::map<std::string, double>& values, AdamOptions& o) const override;
  void CheckOptions(const AdamOptions& o) const override;

 private:
  template <typename T>
  void Kernel(size_t group, T* p, const T* g, T* const* slots, int64_t n, int64_t step, T grad_scale) const;
  bool decoupled_;
};

/// AdamW (Loshchilov and Hutter): Adam whose weight decay shrinks the
/// parameter directly, p = p * (1 - lr * weight_decay), before the update.
class AdamW : public Adam {
 public:
  AdamW(NamedParameters params, AdamWOptions options);
  /// Parameter groups, as Adam's (a group with "weight_decay" 0 is not
  /// decayed: biases and norms, as commonly).
  AdamW(std::vector<ParamGroup> groups, AdamWOptions defaults);
};

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_ADAM_H_
