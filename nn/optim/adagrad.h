#ifndef DDP_NN_OPTIM_ADAGRAD_H_
#define DDP_NN_OPTIM_ADAGRAD_H_

#include "nn/optim/optimizer.h"

namespace ddp::nn::optim {

/// torch.optim.Adagrad's options and defaults.
struct AdagradOptions {
  double lr = 0.01;
  double lr_decay = 0.0;                  ///< The rate at step t is lr / (1 + (t - 1) * lr_decay).
  double weight_decay = 0.0;              ///< L2 penalty added to the gradient.
  double initial_accumulator_value = 0.0;  ///< What "sum" starts from.
  double eps = 1e-10;
  bool maximize = false;                  ///< Ascend: the gradient is negated first.
};

/// Adagrad (Duchi et al. 2011) with PyTorch's rule, t = step:
///   g = g + wd * p
///   clr = lr / (1 + (t - 1) * lr_decay)        (in f64)
///   sum = sum + g * g                          (sum starts at initial_accumulator_value)
///   p = p - clr * g / (sqrt(sum) + eps)
/// State slot: "sum", held from the start as PyTorch makes it when the
/// optimizer is built (a state saved before the first step holds it, with
/// step 0, and so does one saved before the first step of a parameter that
/// AddParamGroup added), filled with the
/// initial_accumulator_value of the parameter's group. PyTorch fills every
/// parameter's with the constructor's value and leaves a group's own unread;
/// here a group's own is taken (they agree unless a group overrides it).
class Adagrad : public OptimizerWithOptions<AdagradOptions> {
 public:
  /// Throws std::invalid_argument, naming "Adagrad" and the one option at
  /// fault with its value, for a negative, NaN or infinite lr, lr_decay,
  /// weight_decay, initial_accumulator_value or eps.
  Adagrad(NamedParameters params, AdagradOptions options);
  /// Parameter groups (ParamGroup), each with `defaults` overridden by its
  /// options ("lr", "lr_decay", "weight_decay",
  /// "initial_accumulator_value", "eps", "maximize"). Throws
  /// std::invalid_argument as the constructor above, naming the group, and
  /// for an unknown option.
  Adagrad(std::vector<ParamGroup> groups, AdagradOptions defaults);

 protected:
  void Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool fresh,
              float grad_scale) override;
  void Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t step, bool fresh,
              double grad_scale) override;
  void DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t step,
                    bool fresh, double grad_scale) override;
  void CheckDeviceKernels(Device device) const override;
  const char* Name() const override { return "Adagrad"; }
  std::vector<Hyperparameter> HyperparametersOf(const AdagradOptions& o) const override;
  void ReadValues(const std::map<std::string, double>& values, AdagradOptions& o) const override;
  void CheckOptions(const AdagradOptions& o) const override;
  std::vector<double> StartSlotValues(size_t group) const override;

 private:
  template <typename T>
  void Kernel(size_t group, T* p, const T* g, T* sum, int64_t n, int64_t step, T grad_scale) const;
  /// This step's rate for `group`: lr / (1 + (step - 1) * lr_decay).
  double StepRate(size_t group, int64_t step) const;
};

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_ADAGRAD_H_
