#ifndef DDP_NN_OPTIM_SGD_H_
#define DDP_NN_OPTIM_SGD_H_

#include "nn/optim/device_kernels.h"
#include "nn/optim/optimizer.h"

namespace ddp::nn::optim {

/// torch.optim.SGD's options and defaults (lr has no default there).
struct SgdOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;  ///< L2 penalty added to the gradient.
  bool nesterov = false;      ///< Needs momentum > 0 and dampening 0.
  bool maximize = false;      ///< Ascend: the gradient is negated first.
};

/// Stochastic gradient descent with PyTorch's rule:
///   d = g + wd * p
///   buf = d on the first step, else momentum * buf + (1 - dampening) * d
///   d = nesterov ? d + momentum * buf : buf        (when momentum != 0)
///   p = p - lr * d
/// State slot: "momentum_buffer", kept only when momentum != 0 (PyTorch's
/// is None at momentum 0). A loaded state without one makes the next step
/// the buffer's first (buf = d); one with a buffer loads into momentum 0
/// (states saved by earlier versions hold a zero one) and is dropped.
class Sgd : public OptimizerWithOptions<SgdOptions> {
 public:
  /// Throws std::invalid_argument, naming "SGD" and the one option at fault
  /// with its value, for a negative, NaN or infinite lr, momentum or
  /// weight_decay, a NaN or infinite dampening (a negative one is taken, as
  /// PyTorch takes it), or nesterov without momentum or with dampening.
  Sgd(NamedParameters params, SgdOptions options);
  /// Parameter groups (ParamGroup), each with `defaults` overridden by its
  /// options ("lr", "momentum", "dampening", "weight_decay", "nesterov",
  /// "maximize"). Throws std::invalid_argument as the constructor above,
  /// naming the group, for an unknown option, and for nesterov or momentum
  /// zero-or-not differing from the defaults (one buffer layout for all).
  Sgd(std::vector<ParamGroup> groups, SgdOptions defaults);

 protected:
  void Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool fresh,
              float grad_scale) override;
  void Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t step, bool fresh,
              double grad_scale) override;
  void DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots, int64_t step,
                    bool fresh, double grad_scale) override;
  void DeviceUpdateAll(const std::vector<DeviceUpdateItem>& items) override;
  void CheckDeviceKernels(Device device) const override;
  const char* Name() const override { return "SGD"; }
  const char* MomentumOption() const override { return "momentum"; }
  std::vector<Hyperparameter> HyperparametersOf(const SgdOptions& o) const override;
  void ReadValues(const std::map<std::string, double>& values, SgdOptions& o) const override;
  void CheckOptions(const SgdOptions& o) const override;

 private:
  template <typename T>
  void Kernel(size_t group, T* p, const T* g, T* buf, int64_t n, bool first, T grad_scale) const;
  /// The device kernels' arguments for an update of `group` with these
  /// fresh and grad_scale; `step` is 1 when fresh, else 2 (the kernels need
  /// no more).
  SgdStepArgs StepArgs(size_t group, bool fresh, double grad_scale) const;
};

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_SGD_H_
