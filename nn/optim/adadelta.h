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
class Adadelta : public OptimizerWithOptions<AdadeltaOptions> {
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

 protected:
  void Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool fresh,
              float grad_scale) override;
  void Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t step, bool fresh,
              double grad_scale) override;
  void DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t step,
                    bool fresh, double grad_scale) override;
  void CheckDeviceKernels(Device device) const override;
  const char* Name() const override { return "Adadelta"; }
  std::vector<Hyperparameter> HyperparametersOf(const AdadeltaOptions& o) const override;
  void ReadValues(const std::map<std::string, double>& values, AdadeltaOptions& o) const override;
  void CheckOptions(const AdadeltaOptions& o) const override;

 private:
  template <typename T>
  void Kernel(size_t group, T* p, const T* g, T* const* slots, int64_t n, T grad_scale) const;
};

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_ADADELTA_H_
