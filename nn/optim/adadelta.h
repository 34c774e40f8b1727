#ifndef DDP_NN_OPTIM_ADADELTA_H_
#define DDP_NN_OPTIM_ADADELTA_H_

#include "nn/optim/optimizer.h"

namespace ddp::nn::optim {

/// torch.optim.Adadelta's options and defaults.
struct AdadeltaOptions {
  double lr = 1.0;
  double rho = 0.9;
  double eps = 1e-6;
  double weight_decay = 0.0;  ///< L2 penalty added to the gradient.
  bool maximize = false;      ///< Ascend: the gradient is negated first.
};

/// Adadelta (Zeiler 2012) with PyTorch's rule:
///   sq = rho * sq + (1 - rho) * g * g
///   delta = sqrt(acc + eps) / sqrt(sq + eps) * g
///   acc = rho * acc + (1 - rho) * delta * delta;  p = p - lr * delta
/// State slots: "square_avg", "acc_delta".
class Adadelta : public Optimizer {
 public:
  /// Throws std::invalid_argument, naming "Adadelta" and the one option at
  /// fault with its value, for rho outside [0, 1], or a negative, NaN or
  /// infinite lr, eps or weight_decay.
  Adadelta(NamedParameters params, AdadeltaOptions options);
  /// Parameter groups (ParamGroup), each with `defaults` overridden by its
  /// options ("lr", "rho", "eps", "weight_decay", "maximize"). Throws
  /// std::invalid_argument as the constructor above, naming the group, and
  /// for an unknown option.
  Adadelta(std::vector<ParamGroup> groups, AdadeltaOptions defaults);
  /// The options of `group` (its lr the one it was made with; lr(group) is
  /// the current one).
  const AdadeltaOptions& options(size_t group = 0) const { return options_.at(group); }

 protected:
  void Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool fresh,
              float grad_scale) override;
  void Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t step, bool fresh,
              double grad_scale) override;
  void DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t step,
                    bool fresh, double grad_scale) override;
  void CheckDeviceKernels(Device device) const override;
  const char* Name() const override { return "Adadelta"; }
  std::vector<Hyperparameter> Hyperparameters(size_t group) const override;
  std::vector<Hyperparameter> DefaultHyperparameters() const override;
  void AppendGroupOptions(const std::map<std::string, double>& values, double lr) override;
  void CheckHyperparameters(size_t group, const std::map<std::string, double>& values) const override;
  void SetHyperparameters(size_t group, const std::map<std::string, double>& values) override;

 private:
  static std::vector<Hyperparameter> HyperparametersOf(const AdadeltaOptions& o);
  template <typename T>
  void Kernel(size_t group, T* p, const T* g, T* const* slots, int64_t n, T grad_scale) const;

  /// The constructor's checks of everything but lr (the base checks that).
  static void CheckOptions(const AdadeltaOptions& o);

  /// `base` with the saved values of `values` (see CheckHyperparameters);
  /// throws as the constructor does.
  static AdadeltaOptions WithSaved(AdadeltaOptions base, const std::map<std::string, double>& values);

  std::vector<AdadeltaOptions> options_;  // per group
  AdadeltaOptions defaults_;  // for groups AddParamGroup appends
};

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_ADADELTA_H_
