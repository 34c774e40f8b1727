// Layers. Parameter names, printed forms and default initialization follow
// PyTorch's (kaiming-uniform with a = sqrt(5) for Linear and Conv2d weights,
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for their biases), so state dicts are
// interchangeable with PyTorch models of the same structure. Each layer
// checks its input's shape and names itself in the error:
//   Linear(784->512) `0`: expected input [..., 784], got [64, 785]
#pragma once

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "nn/modules/module.h"
#include "nn/ops/dispatch.h"
#include "nn/tensor/generator.h"

namespace ddp::nn::modules {

/// y = x W^T + b; x [..., in_features] -> [..., out_features].
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, Generator& gen = DefaultGenerator());
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "Linear"; }
  std::string ExtraRepr() const override;
  std::string ShortRepr() const override;
  const Tensor& weight() const { return weight_; }
  /// Undefined when the layer has no bias.
  const Tensor& bias() const { return bias_; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

 private:
  int64_t in_, out_;
  Tensor weight_, bias_;
};

/// Square-kernel 2-D convolution options (same value for height and width).
struct Conv2dOptions {
  int64_t stride = 1;
  int64_t padding = 0;
  int64_t dilation = 1;
  int64_t groups = 1;
  bool bias = true;
};

/// x [N, in, H, W] -> [N, out, OH, OW]; weight [out, in/groups, k, k]. An
/// unbatched x [in, H, W] gives [out, OH, OW] (as PyTorch 1.13); an error
/// from the op then shows the input as a batch of one, [1, in, H, W].
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, Conv2dOptions options = {},
         Generator& gen = DefaultGenerator());
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "Conv2d"; }
  std::string ExtraRepr() const override;
  std::string ShortRepr() const override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  int64_t in_channels() const { return in_; }
  int64_t out_channels() const { return out_; }
  int64_t kernel_size() const { return kernel_; }
  const Conv2dOptions& options() const { return options_; }

 private:
  int64_t in_, out_, kernel_;
  Conv2dOptions options_;
  Tensor weight_, bias_;
};

/// 1-D convolution options (stride, padding, dilation along the length).
struct Conv1dOptions {
  int64_t stride = 1;
  int64_t padding = 0;
  int64_t dilation = 1;
  int64_t groups = 1;
  bool bias = true;
};

/// x [N, in, L] -> [N, out, OL]; weight [out, in/groups, k]. An unbatched x
/// [in, L] gives [out, OL], as PyTorch 1.13 (errors show it as given, not
/// as the batch of one it runs as). Runs as Conv2d over a plane of
/// height 1 (ops::Conv1d), so on every device Conv2d runs on. Arguments
/// are checked as Conv2d's, naming the layer and the argument;
/// initialization as PyTorch's (kaiming-uniform, a = sqrt(5)).
class Conv1d : public Module {
 public:
  Conv1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, Conv1dOptions options = {},
         Generator& gen = DefaultGenerator());
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "Conv1d"; }
  std::string ExtraRepr() const override;
  std::string ShortRepr() const override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  const Conv1dOptions& options() const { return options_; }

 private:
  int64_t in_, out_, kernel_;
  Conv1dOptions options_;
  Tensor weight_, bias_;
};

struct BatchNormOptions {
  double eps = 1e-5;
  /// Weight of the batch statistic in the running ones; nullopt (PyTorch's
  /// momentum=None): their cumulative average, 1 / num_batches_tracked.
  std::optional<double> momentum = 0.1;
  bool affine = true;               ///< learnable weight (gamma) and bias (beta)
  bool track_running_stats = true;  ///< running_mean / running_var / num_batches_tracked buffers
};

/// Throws std::invalid_argument naming `module` and the option when eps is
/// not finite and > 0, or a momentum is outside [0, 1]. Shared with ddp's
/// SyncBatchNorm.
void CheckBatchNormOptions(const BatchNormOptions& options, const std::string& module);
/// The running statistics' update factor for a training batch, once
/// `num_batches_tracked` counts it: the momentum, or 1 / num_batches_tracked
/// without one. Shared with ddp's SyncBatchNorm.
double RunningAverageFactor(const BatchNormOptions& options, const Tensor& num_batches_tracked);
/// The same for a count already on the host.
double RunningAverageFactor(const BatchNormOptions& options, int64_t num_batches_tracked);
/// "0.1", or "None" without a momentum, as PyTorch prints it.
std::string MomentumRepr(const std::optional<double>& momentum);

/// A batch-norm layer's host copy of its num_batches_tracked buffer (an i64
/// scalar). Reading the buffer on a GPU is a copy to the host that waits for
/// all queued work, so the layer keeps what it last read or wrote and reads
/// the buffer again only when it changed since: another storage (To(), a
/// new buffer) or an in-place write through any tensor on it (LoadStateDict,
/// CopyFrom, Fill, another layer sharing the buffer), which bumps the
/// storage's version. A write that bypasses the version (raw memory) is not
/// seen. Shared by BatchNorm and ddp's SyncBatchNorm.
class TrackedBatchCount {
 public:
  /// The buffer's value. Throws std::logic_error naming `layer` when the
  /// buffer has no storage.
  int64_t Get(const Tensor& num_batches_tracked, const Module& layer);
  /// Writes `count` into the buffer (no autograd) and remembers it.
  void Set(const Tensor& num_batches_tracked, int64_t count);

 private:
  int64_t count_ = 0;
  std::weak_ptr<Storage> storage_;
  uint64_t version_ = 0;
};

/// Batch normalization over the channel dimension (1) of its input. In
/// training the batch statistics normalize and update the running ones; in
/// eval the running statistics normalize. Fields are public through
/// accessors so that ddp's SyncBatchNorm can take them over.
class BatchNorm : public Module {
 public:
  /// Throws std::invalid_argument naming `layer` (the subclass's TypeName,
  /// which a base constructor cannot call) and the argument when
  /// num_features < 1 or an option is out of range.
  BatchNorm(int64_t num_features, BatchNormOptions options, std::string_view layer = "BatchNorm");
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string ExtraRepr() const override;
  std::string ShortRepr() const override;
  int64_t num_features() const { return num_features_; }
  const BatchNormOptions& options() const { return options_; }
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  const Tensor& running_mean() const { return running_mean_; }
  const Tensor& running_var() const { return running_var_; }
  /// i64 scalar counting training batches. A training batch refused for
  /// having one value per channel is not counted: a refused call changes
  /// nothing. PyTorch counts it before checking (so with momentum=None its
  /// next batch gets 1/2 where this one's gets 1); a deliberate difference.
  const Tensor& num_batches_tracked() const { return num_batches_tracked_; }
  /// num_batches_tracked may be absent from a loaded state (PyTorch 2's
  /// rule; files saved before PyTorch 0.4.1 and many exported weight files
  /// lack it): it keeps its count.
  bool MayBeAbsentFromState(const std::string& name) const override;

 protected:
  /// Throws naming the layer when x has the wrong rank or channel count.
  virtual void CheckInput(const Tensor& x) const = 0;

 private:
  int64_t num_features_;
  BatchNormOptions options_;
  Tensor weight_, bias_, running_mean_, running_var_, num_batches_tracked_;
  TrackedBatchCount tracked_;  // host copy of num_batches_tracked
};

/// Input [N, C] or [N, C, L].
class BatchNorm1d : public BatchNorm {
 public:
  explicit BatchNorm1d(int64_t num_features, BatchNormOptions options = {})
      : BatchNorm(num_features, options, "BatchNorm1d") {}
  std::string TypeName() const override { return "BatchNorm1d"; }

 protected:
  void CheckInput(const Tensor& x) const override;
};

/// Input [N, C, H, W].
class BatchNorm2d : public BatchNorm {
 public:
  explicit BatchNorm2d(int64_t num_features, BatchNormOptions options = {})
      : BatchNorm(num_features, options, "BatchNorm2d") {}
  std::string TypeName() const override { return "BatchNorm2d"; }

 protected:
  void CheckInput(const Tensor& x) const override;
};

/// Layer normalization over the last dimensions of its input, which must
/// be normalized_shape: x [*, D1, ..., Dk] -> x's shape, each row of
/// D1 * ... * Dk elements normalized by its own mean and biased variance.
/// With elementwise_affine, learnable weight (ones) and bias (zeros) of
/// normalized_shape, as PyTorch's. The constructor refuses, naming the
/// layer and the argument, an empty normalized_shape, a negative size, or
/// an eps that is not finite and > 0 (as BatchNorm's; PyTorch takes 0).
/// CPU only: an input on another device is refused naming the device.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(Shape normalized_shape, double eps = 1e-5, bool elementwise_affine = true);
  /// LayerNorm({normalized_size}).
  explicit LayerNorm(int64_t normalized_size, double eps = 1e-5, bool elementwise_affine = true)
      : LayerNorm(Shape{normalized_size}, eps, elementwise_affine) {}
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "LayerNorm"; }
  std::string ExtraRepr() const override;
  std::string ShortRepr() const override;
  const Shape& normalized_shape() const { return normalized_shape_; }
  double eps() const { return eps_; }
  /// Undefined without elementwise_affine.
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }

 private:
  Shape normalized_shape_;
  double eps_;
  Tensor weight_, bias_;
};

/// A lookup table: indices (i64 or i32) of any shape S -> [S..., embedding_dim],
/// row i of weight [num_embeddings, embedding_dim] for index i. weight is
/// drawn from N(0, 1) with `gen`. padding_idx (negative counts from the end,
/// as PyTorch's, and is kept as the non-negative row) names a row
/// initialised to zero whose gradient is always zero. An index outside
/// [0, num_embeddings) is refused (std::out_of_range) naming the index, its
/// position and the range. CPU only: another device is refused naming it.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<int64_t> padding_idx = std::nullopt,
            Generator& gen = DefaultGenerator());
  Tensor Forward(const Tensor& indices) override;
  using Module::Forward;
  std::string TypeName() const override { return "Embedding"; }
  std::string ExtraRepr() const override;
  std::string ShortRepr() const override;
  const Tensor& weight() const { return weight_; }
  int64_t num_embeddings() const { return num_; }
  int64_t embedding_dim() const { return dim_; }
  /// The padding row, in [0, num_embeddings), or nullopt.
  std::optional<int64_t> padding_idx() const { return padding_idx_; }

 private:
  int64_t num_, dim_;
  std::optional<int64_t> padding_idx_;
  Tensor weight_;
};

class ReLU : public Module {
 public:
  Tensor Forward(const Tensor& x) override;
  /// Rectifies in place when the input's memory is referenced nowhere else.
  Tensor ForwardOwned(Tensor x) override;
  using Module::Forward;
  std::string TypeName() const override { return "ReLU"; }
};

class GELU : public Module {
 public:
  explicit GELU(bool tanh_approximation = false) : tanh_(tanh_approximation) {}
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "GELU"; }
  std::string ExtraRepr() const override { return tanh_ ? "approximate='tanh'" : "approximate='none'"; }

 private:
  bool tanh_;
};

class Sigmoid : public Module {
 public:
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "Sigmoid"; }
};

class Tanh : public Module {
 public:
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "Tanh"; }
};

/// Max over kernel x kernel windows of [N, C, H, W], or of an unbatched
/// [C, H, W] (as Conv2d's). Stride nullopt (PyTorch's None) means
/// stride = kernel_size. Arguments are checked here, each error naming the
/// layer and the argument: kernel_size, stride and dilation >= 1, padding
/// in [0, kernel_size / 2] (an explicit stride 0 is refused, as in PyTorch).
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(int64_t kernel_size, std::optional<int64_t> stride = std::nullopt, int64_t padding = 0,
                     int64_t dilation = 1, bool ceil_mode = false);
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "MaxPool2d"; }
  std::string ExtraRepr() const override;

 private:
  ops::Pool2dParams p_;
};

/// Mean over kernel x kernel windows. Input, stride and the checks as MaxPool2d's.
class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(int64_t kernel_size, std::optional<int64_t> stride = std::nullopt, int64_t padding = 0,
                     bool ceil_mode = false, bool count_include_pad = true);
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "AvgPool2d"; }
  std::string ExtraRepr() const override;

 private:
  ops::Pool2dParams p_;
};

/// [N, C, H, W] -> [N, C, out_h, out_w] by averaging adaptive windows;
/// unbatched [C, H, W] -> [C, out_h, out_w]. An output size of 0 gives an
/// empty output (and a zero gradient), as PyTorch 1.13; a negative one is
/// refused at construction, naming the layer and output_size, as the other
/// pools' arguments.
class AdaptiveAvgPool2d : public Module {
 public:
  AdaptiveAvgPool2d(int64_t out_h, int64_t out_w);
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "AdaptiveAvgPool2d"; }
  std::string ExtraRepr() const override;

 private:
  int64_t out_h_, out_w_;
};

/// Zeroes elements with probability p in training (scaling the rest by 1/(1-p)).
/// Unlike Linear's and Conv2d's, which draw only the initial weights, its
/// generator is drawn from at every training forward: it must outlive the
/// module (the default, the process's generator, does).
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5, Generator& gen = DefaultGenerator());
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "Dropout"; }
  std::string ExtraRepr() const override;

 private:
  double p_;
  Generator* gen_;
};

/// Merges dimensions start..end (default: all but the batch dimension).
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1) : start_(start_dim), end_(end_dim) {}
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "Flatten"; }
  std::string ExtraRepr() const override;

 private:
  int64_t start_, end_;
};

class Identity : public Module {
 public:
  Tensor Forward(const Tensor& x) override { return x; }
  using Module::Forward;
  std::string TypeName() const override { return "Identity"; }
};

/// Runs its children in order; they are named "0", "1", ... as in PyTorch.
/// Forward looks children up in the registry, so ReplaceChild takes effect.
class Sequential : public Module {
 public:
  Sequential() = default;
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
  /// Appends a module under the next index.
  void Push(std::shared_ptr<Module> module);
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "Sequential"; }
  /// Registrations, a module registered twice counted twice.
  size_t size() const { return ChildSlots().size(); }
  /// Child i.
  std::shared_ptr<Module> at(size_t i) const;
};

}  // namespace ddp::nn::modules
