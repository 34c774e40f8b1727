#ifndef DDP_NN_OPTIM_RMSPROP_H_
#define DDP_NN_OPTIM_RMSPROP_H_

#include "nn/optim/optimizer.h"

namespace ddp::nn::optim {

/// torch.optim.RMSprop's options and defaults.
struct RmspropOptions {
  double lr = 0.01;
  double alpha = 0.99;        ///< Smoothing of the squared-gradient average.
  double eps = 1e-8;
  double weight_decay = 0.0;  ///< L2 penalty added to the gradient.
  double momentum = 0.0;
  bool centered = false;      ///< Divide by the gradient's estimated variance.
  bool maximize = false;      ///< Ascend: the gradient is negated first.
};

/// RMSprop with PyTorch's (2.x) rule:
///   g = g + wd * p
///   sq = alpha * sq + (1 - alpha) * g * g
///   centered: ga = lerp(ga, g, 1 - alpha); avg = sqrt(sq - ga * ga) + eps
///   else:     avg = sqrt(sq) + eps
///   momentum != 0: buf = momentum * buf + g / avg;  p = p - lr * buf
///   else:          p = p - lr * g / avg
/// State slots: "square_avg", then "momentum_buffer" when momentum != 0 and
/// "grad_avg" when centered (PyTorch keeps them under the same names).
class Rmsprop : public OptimizerWithOptions<RmspropOptions> {
 public:
  /// Throws std::invalid_argument, naming "RMSprop" and the one option at
  /// fault with its value, for alpha outside [0, 1] (PyTorch takes one
  /// above 1, which makes the squared average negative and the update
  /// NaN), or a negative, NaN or infinite lr, eps, weight_decay or
  /// momentum.
  Rmsprop(NamedParameters params, RmspropOptions options);
  /// Parameter groups (ParamGroup), each with `defaults` overridden by its
  /// options ("lr", "alpha", "eps", "weight_decay", "momentum", "centered",
  /// "maximize"). Throws std::invalid_argument as the constructor above,
  /// naming the group, for an unknown option, and for centered or momentum
  /// zero-or-not differing from the defaults (one slot layout for all).
  Rmsprop(std::vector<ParamGroup> groups, RmspropOptions defaults);

 protected:
  void Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool fresh,
              float grad_scale) override;
  void Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t step, bool fresh,
              double grad_scale) override;
  void DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t step,
                    bool fresh, double grad_scale) override;
  void CheckDeviceKernels(Device device) const override;
  const char* Name() const override { return "RMSprop"; }
  const char* MomentumOption() const override { return "momentum"; }
  std::vector<Hyperparameter> HyperparametersOf(const RmspropOptions& o) const override;
  void ReadValues(const std::map<std::string, double>& values, RmspropOptions& o) const override;
  void CheckOptions(const RmspropOptions& o) const override;

 private:
  template <typename T>
  void Kernel(size_t group, T* p, const T* g, T* const* slots, int64_t n, T grad_scale) const;
};

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_RMSPROP_H_
