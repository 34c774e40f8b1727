#include "nn/modules/layers.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <typeinfo>

#include "nn/modules/init.h"
#include "nn/ops/functional.h"

namespace ddp::nn::modules {

namespace {

std::string Pair(int64_t a, int64_t b) { return "(" + std::to_string(a) + ", " + std::to_string(b) + ")"; }
const char* PyBool(bool b) { return b ? "True" : "False"; }
// Python's repr of a float, as PyTorch prints arguments: the fewest
// significant digits that read back as the same double; positional when the
// decimal exponent is in [-4, 16), with ".0" on a whole number; otherwise
// scientific with a signed exponent of at least two digits ("1e-05").
std::string PyFloat(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[40];
  for (int precision = 0; precision <= 16; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*e", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  // buf is "[-]d[.ddd]e[+-]xx": split it into sign, digits and exponent.
  std::string text = buf;
  std::string sign;
  if (text[0] == '-') {
    sign = "-";
    text.erase(0, 1);
  }
  const size_t e = text.find('e');
  const int exponent = std::atoi(text.c_str() + e + 1);
  std::string digits = text.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int n = static_cast<int>(digits.size());
  if (exponent < -4 || exponent >= 16) {
    std::string out = sign + digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    char exp_text[16];
    std::snprintf(exp_text, sizeof(exp_text), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + exp_text;
  }
  if (exponent < 0) return sign + "0." + std::string(-exponent - 1, '0') + digits;
  if (n <= exponent + 1) return sign + digits + std::string(exponent + 1 - n, '0') + ".0";
  return sign + digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
}

// A value in an error message: every digit that tells it apart (momentum
// 1.0000001 is not shown as 1), but a whole number without ".0" ("got 2").
std::string ErrorFloat(double v) {
  std::string text = PyFloat(v);
  if (text.size() > 2 && text.compare(text.size() - 2, 2, ".0") == 0) text.resize(text.size() - 2);
  return text;
}

// Kaiming-uniform (a = sqrt(5)) weights and U(-1/sqrt(fan_in), 1/sqrt(fan_in)) biases.
void ResetLikePyTorch(const Tensor& weight, const Tensor& bias, Generator& gen) {
  KaimingUniform(weight, std::sqrt(5.0), "fan_in", "leaky_relu", gen);
  if (bias.defined()) {
    const double fan_in = static_cast<double>(FanInOut(weight).first);
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(fan_in) : 0.0;
    Uniform(bias, -bound, bound, gen);
  }
}

// An unbatched [C, H, W] input, which PyTorch 1.13's 2-D convolution and
// pooling layers take: the layer runs on it as a batch of one, [1, C, H, W],
// and the result loses that dimension again (both views, so gradients flow).
Tensor RunUnbatched(Module& layer, const Tensor& x) {
  return ops::Squeeze(layer.Forward(ops::Unsqueeze(x, 0)), 0);
}

// Called first in every Forward here: the shape checks and ops read the
// input's shape, and on an undefined tensor that fails in Tensor with a
// logic_error naming neither the layer nor its path.
void CheckDefinedInput(const Module& layer, const Tensor& x) {
  if (!x.defined()) throw std::invalid_argument(layer.Describe() + ": input is undefined");
}

// A Python tuple of sizes, as PyTorch prints one: "(5,)", "(3, 4)".
std::string PyTuple(const Shape& sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i > 0 ? ", " : "") + std::to_string(sizes[i]);
  return s + (sizes.size() == 1 ? ",)" : ")");
}

// Runs an op, rethrowing its refusal with the layer and its path in front,
// as the same exception type: an index out of range stays std::out_of_range
// (PyTorch's IndexError), a missing kernel std::runtime_error. Only these
// exact types are rebuilt; a subclass (a kernel's cuda::CudaError with its
// status code) goes through untouched, as from Conv2d, since a copy of the
// base would lose its type.
template <typename Fn>
Tensor NamingTheLayer(const Module& layer, Fn fn) {
  try {
    return fn();
  } catch (const std::out_of_range& e) {
    if (typeid(e) != typeid(std::out_of_range)) throw;
    throw std::out_of_range(layer.Describe() + ": " + e.what());
  } catch (const std::invalid_argument& e) {
    if (typeid(e) != typeid(std::invalid_argument)) throw;
    throw std::invalid_argument(layer.Describe() + ": " + e.what());
  } catch (const std::runtime_error& e) {
    if (typeid(e) != typeid(std::runtime_error)) throw;
    throw std::runtime_error(layer.Describe() + ": " + e.what());
  }
}

}  // namespace

// ---------------------------------------------------------------- Linear

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, Generator& gen)
    : in_(in_features), out_(out_features) {
  // Each size named on its own, as Conv2d's channel counts; 0 is allowed
  // (an empty weight), as in PyTorch.
  for (const auto& [what, size] : {std::pair<const char*, int64_t>{"in_features", in_features},
                                   std::pair<const char*, int64_t>{"out_features", out_features}}) {
    if (size < 0) {
      throw std::invalid_argument("Linear(" + std::to_string(in_features) + ", " + std::to_string(out_features) +
                                  "): " + what + " must be >= 0, got " + std::to_string(size));
    }
  }
  weight_ = RegisterParameter("weight", Empty({out_features, in_features}));
  if (bias) bias_ = RegisterParameter("bias", Empty({out_features}));
  ResetLikePyTorch(weight_, bias_, gen);
}

std::string Linear::ExtraRepr() const {
  return "in_features=" + std::to_string(in_) + ", out_features=" + std::to_string(out_) +
         ", bias=" + PyBool(bias_.defined());
}

std::string Linear::ShortRepr() const { return "Linear(" + std::to_string(in_) + "->" + std::to_string(out_) + ")"; }

Tensor Linear::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  if (x.dim() < 1 || x.size(-1) != in_) {
    Fail("expected input [..., " + std::to_string(in_) + "], got " + ShapeToString(x.shape()));
  }
  try {
    return ops::Linear(x, weight_, bias_);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());  // e.g. an integer input: named with the layer and its path
  }
}

// ---------------------------------------------------------------- Conv2d

namespace {

// The constructor checks of Conv1d and Conv2d, as PyTorch's _ConvNd makes
// them: groups must be positive and divide both channel counts; zero
// channels are allowed (an empty weight), negative ones not.
void CheckConvArguments(const char* layer, int64_t in_channels, int64_t out_channels, int64_t kernel_size,
                        int64_t stride, int64_t dilation, int64_t padding, int64_t groups) {
  const std::string where =
      std::string(layer) + "(" + std::to_string(in_channels) + ", " + std::to_string(out_channels) + "): ";
  auto at_least = [&where](const char* what, int64_t v, int64_t lowest) {
    if (v < lowest) {
      throw std::invalid_argument(where + what + " must be >= " + std::to_string(lowest) + ", got " +
                                  std::to_string(v));
    }
  };
  at_least("in_channels", in_channels, 0);
  at_least("out_channels", out_channels, 0);
  at_least("groups", groups, 1);
  for (const auto& [what, count] : {std::pair<const char*, int64_t>{"in_channels", in_channels},
                                    std::pair<const char*, int64_t>{"out_channels", out_channels}}) {
    if (count % groups != 0) {
      throw std::invalid_argument(where + what + " (" + std::to_string(count) + ") must be divisible by groups (" +
                                  std::to_string(groups) + ")");
    }
  }
  at_least("kernel_size", kernel_size, 1);
  at_least("stride", stride, 1);
  at_least("dilation", dilation, 1);
  at_least("padding", padding, 0);
}

}  // namespace

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, Conv2dOptions options, Generator& gen)
    : in_(in_channels), out_(out_channels), kernel_(kernel_size), options_(options) {
  CheckConvArguments("Conv2d", in_channels, out_channels, kernel_size, options.stride, options.dilation,
                     options.padding, options.groups);
  weight_ = RegisterParameter("weight", Empty({out_channels, in_channels / options.groups, kernel_size, kernel_size}));
  if (options.bias) bias_ = RegisterParameter("bias", Empty({out_channels}));
  ResetLikePyTorch(weight_, bias_, gen);
}

std::string Conv2d::ExtraRepr() const {
  std::string s = std::to_string(in_) + ", " + std::to_string(out_) + ", kernel_size=" + Pair(kernel_, kernel_) +
                  ", stride=" + Pair(options_.stride, options_.stride);
  if (options_.padding != 0) s += ", padding=" + Pair(options_.padding, options_.padding);
  if (options_.dilation != 1) s += ", dilation=" + Pair(options_.dilation, options_.dilation);
  if (options_.groups != 1) s += ", groups=" + std::to_string(options_.groups);
  if (!options_.bias) s += ", bias=False";
  return s;
}

std::string Conv2d::ShortRepr() const {
  return "Conv2d(" + std::to_string(in_) + "->" + std::to_string(out_) + ", " + std::to_string(kernel_) + "x" +
         std::to_string(kernel_) + ")";
}

Tensor Conv2d::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  if (x.dim() == 3 && x.size(0) == in_) return RunUnbatched(*this, x);
  if (x.dim() != 4 || x.size(1) != in_) {
    Fail("expected input [N, " + std::to_string(in_) + ", H, W] or [" + std::to_string(in_) + ", H, W], got " +
         ShapeToString(x.shape()));
  }
  const ops::Conv2dParams p{options_.stride, options_.stride, options_.padding, options_.padding,
                            options_.dilation, options_.dilation, options_.groups};
  try {
    return ops::Conv2d(x, weight_, bias_, p);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
}

// ---------------------------------------------------------------- Conv1d

Conv1d::Conv1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, Conv1dOptions options, Generator& gen)
    : in_(in_channels), out_(out_channels), kernel_(kernel_size), options_(options) {
  CheckConvArguments("Conv1d", in_channels, out_channels, kernel_size, options.stride, options.dilation,
                     options.padding, options.groups);
  weight_ = RegisterParameter("weight", Empty({out_channels, in_channels / options.groups, kernel_size}));
  if (options.bias) bias_ = RegisterParameter("bias", Empty({out_channels}));
  ResetLikePyTorch(weight_, bias_, gen);
}

std::string Conv1d::ExtraRepr() const {
  std::string s = std::to_string(in_) + ", " + std::to_string(out_) + ", kernel_size=" + PyTuple({kernel_}) +
                  ", stride=" + PyTuple({options_.stride});
  if (options_.padding != 0) s += ", padding=" + PyTuple({options_.padding});
  if (options_.dilation != 1) s += ", dilation=" + PyTuple({options_.dilation});
  if (options_.groups != 1) s += ", groups=" + std::to_string(options_.groups);
  if (!options_.bias) s += ", bias=False";
  return s;
}

std::string Conv1d::ShortRepr() const {
  return "Conv1d(" + std::to_string(in_) + "->" + std::to_string(out_) + ", " + std::to_string(kernel_) + ")";
}

Tensor Conv1d::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  // An unbatched [C, L] input goes to the op as it is (the op runs it as a
  // batch of one), so that its errors show the shape as given.
  if ((x.dim() != 3 && x.dim() != 2) || x.size(-2) != in_) {
    Fail("expected input [N, " + std::to_string(in_) + ", L] or [" + std::to_string(in_) + ", L], got " +
         ShapeToString(x.shape()));
  }
  const ops::Conv1dParams p{options_.stride, options_.padding, options_.dilation, options_.groups};
  return NamingTheLayer(*this, [&] { return ops::Conv1d(x, weight_, bias_, p); });
}

// ---------------------------------------------------------------- BatchNorm

void CheckBatchNormOptions(const BatchNormOptions& options, const std::string& module) {
  if (!(options.eps > 0) || !std::isfinite(options.eps)) {
    throw std::invalid_argument(module + ": BatchNormOptions::eps must be finite and > 0, got " +
                                ErrorFloat(options.eps));
  }
  if (options.momentum.has_value() && !(*options.momentum >= 0 && *options.momentum <= 1)) {
    throw std::invalid_argument(module + ": BatchNormOptions::momentum must be in [0, 1] (or nullopt), got " +
                                ErrorFloat(*options.momentum));
  }
}

double RunningAverageFactor(const BatchNormOptions& options, const Tensor& num_batches_tracked) {
  if (options.momentum.has_value()) return *options.momentum;
  if (!num_batches_tracked.defined()) return 0.0;  // no running statistics to update
  return RunningAverageFactor(options, static_cast<int64_t>(num_batches_tracked.Item()));
}

double RunningAverageFactor(const BatchNormOptions& options, int64_t num_batches_tracked) {
  if (options.momentum.has_value()) return *options.momentum;
  return num_batches_tracked > 0 ? 1.0 / static_cast<double>(num_batches_tracked) : 1.0;
}

std::string MomentumRepr(const std::optional<double>& momentum) {
  return momentum.has_value() ? PyFloat(*momentum) : "None";
}

BatchNorm::BatchNorm(int64_t num_features, BatchNormOptions options, std::string_view layer)
    : num_features_(num_features), options_(options) {
  if (num_features < 1) {
    throw std::invalid_argument(std::string(layer) + ": num_features must be positive, got " +
                                std::to_string(num_features));
  }
  CheckBatchNormOptions(options, std::string(layer));
  if (options.affine) {
    weight_ = RegisterParameter("weight", Ones({num_features}));
    bias_ = RegisterParameter("bias", Zeros({num_features}));
  }
  if (options.track_running_stats) {
    running_mean_ = RegisterBuffer("running_mean", Zeros({num_features}));
    running_var_ = RegisterBuffer("running_var", Ones({num_features}));
    num_batches_tracked_ = RegisterBuffer("num_batches_tracked", Zeros({}, {.dtype = DType::kInt64}));
  }
}

bool BatchNorm::MayBeAbsentFromState(const std::string& name) const { return name == "num_batches_tracked"; }

std::string BatchNorm::ExtraRepr() const {
  return std::to_string(num_features_) + ", eps=" + PyFloat(options_.eps) + ", momentum=" +
         MomentumRepr(options_.momentum) + ", affine=" + PyBool(options_.affine) +
         ", track_running_stats=" + PyBool(options_.track_running_stats);
}

std::string BatchNorm::ShortRepr() const { return TypeName() + "(" + std::to_string(num_features_) + ")"; }

int64_t TrackedBatchCount::Get(const Tensor& num_batches_tracked, const Module& layer) {
  const std::shared_ptr<Storage> storage = num_batches_tracked.storage();
  if (storage == nullptr) throw std::logic_error(layer.Describe() + ": num_batches_tracked has no storage");
  const uint64_t version = storage->version();
  if (storage_.lock() != storage || version != version_) {
    count_ = static_cast<int64_t>(num_batches_tracked.Item());
    storage_ = storage;
    version_ = version;
  }
  return count_;
}

void TrackedBatchCount::Set(const Tensor& num_batches_tracked, int64_t count) {
  {
    NoGradGuard guard;
    num_batches_tracked.Fill(static_cast<double>(count));
  }
  const std::shared_ptr<Storage> storage = num_batches_tracked.storage();
  count_ = count;
  storage_ = storage;
  version_ = storage != nullptr ? storage->version() : 0;
}

Tensor BatchNorm::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  CheckInput(x);
  const bool use_batch_stats = is_training() || !options_.track_running_stats;
  // Only a training batch with running statistics updates them, so only it
  // needs the factor (and, without a momentum, the count).
  double factor = RunningAverageFactor(options_, int64_t{0});
  int64_t tracked = -1;  // the count after this batch, stored once it ran
  if (is_training() && options_.track_running_stats) {
    tracked = tracked_.Get(num_batches_tracked_, *this) + 1;
    factor = RunningAverageFactor(options_, tracked);
  }
  Tensor y;
  try {
    y = ops::BatchNorm(x, running_mean_, running_var_, weight_, bias_, use_batch_stats, factor, options_.eps);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
  // Counted only now: a refused batch (one value per channel, an integer
  // input) updated no statistic, so it must not shift the count either
  // (without a momentum the count is the next update's weight).
  if (tracked >= 0) tracked_.Set(num_batches_tracked_, tracked);
  return y;
}

void BatchNorm1d::CheckInput(const Tensor& x) const {
  if ((x.dim() != 2 && x.dim() != 3) || x.size(1) != num_features()) {
    Fail("expected input [N, " + std::to_string(num_features()) + "] or [N, " + std::to_string(num_features()) +
         ", L], got " + ShapeToString(x.shape()));
  }
}

void BatchNorm2d::CheckInput(const Tensor& x) const {
  if (x.dim() != 4 || x.size(1) != num_features()) {
    Fail("expected input [N, " + std::to_string(num_features()) + ", H, W], got " + ShapeToString(x.shape()));
  }
}

// ---------------------------------------------------------------- LayerNorm

LayerNorm::LayerNorm(Shape normalized_shape, double eps, bool elementwise_affine)
    : normalized_shape_(std::move(normalized_shape)), eps_(eps) {
  if (normalized_shape_.empty()) {
    throw std::invalid_argument("LayerNorm: normalized_shape must have at least one dimension, got ()");
  }
  for (int64_t size : normalized_shape_) {
    if (size < 0) {
      throw std::invalid_argument("LayerNorm: normalized_shape must have sizes >= 0, got " +
                                  PyTuple(normalized_shape_));
    }
  }
  if (!(eps > 0) || !std::isfinite(eps)) {
    throw std::invalid_argument("LayerNorm: eps must be finite and > 0, got " + ErrorFloat(eps));
  }
  if (elementwise_affine) {
    weight_ = RegisterParameter("weight", Ones(normalized_shape_));
    bias_ = RegisterParameter("bias", Zeros(normalized_shape_));
  }
}

std::string LayerNorm::ExtraRepr() const {
  return PyTuple(normalized_shape_) + ", eps=" + PyFloat(eps_) + ", elementwise_affine=" + PyBool(weight_.defined());
}

std::string LayerNorm::ShortRepr() const { return "LayerNorm(" + PyTuple(normalized_shape_) + ")"; }

Tensor LayerNorm::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  const auto k = static_cast<int64_t>(normalized_shape_.size());
  if (x.dim() < k || !std::equal(normalized_shape_.begin(), normalized_shape_.end(), x.shape().end() - k)) {
    std::string last = ShapeToString(normalized_shape_);
    Fail("expected input [*, " + last.substr(1) + " (normalized_shape " + PyTuple(normalized_shape_) + "), got " +
         ShapeToString(x.shape()));
  }
  return NamingTheLayer(*this, [&] { return ops::LayerNorm(x, normalized_shape_, weight_, bias_, eps_); });
}

// ---------------------------------------------------------------- Embedding

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<int64_t> padding_idx,
                     Generator& gen)
    : num_(num_embeddings), dim_(embedding_dim) {
  const std::string where =
      "Embedding(" + std::to_string(num_embeddings) + ", " + std::to_string(embedding_dim) + "): ";
  if (num_embeddings < 0) {
    throw std::invalid_argument(where + "num_embeddings must be >= 0, got " + std::to_string(num_embeddings));
  }
  if (embedding_dim < 0) {
    throw std::invalid_argument(where + "embedding_dim must be >= 0, got " + std::to_string(embedding_dim));
  }
  if (padding_idx.has_value()) {
    // Kept as the row (-1 is num_embeddings - 1), as PyTorch's module does.
    try {
      padding_idx_ = ops::EmbeddingPaddingRow(*padding_idx, num_embeddings);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(where + e.what());
    }
  }
  weight_ = RegisterParameter("weight", Empty({num_embeddings, embedding_dim}));
  NormalFill(weight_, 0.0, 1.0, gen);
  if (padding_idx_.has_value()) {
    NoGradGuard guard;
    weight_.Select(0, *padding_idx_).Fill(0.0);
  }
}

std::string Embedding::ExtraRepr() const {
  std::string s = std::to_string(num_) + ", " + std::to_string(dim_);
  if (padding_idx_.has_value()) s += ", padding_idx=" + std::to_string(*padding_idx_);
  return s;
}

std::string Embedding::ShortRepr() const {
  return "Embedding(" + std::to_string(num_) + ", " + std::to_string(dim_) + ")";
}

Tensor Embedding::Forward(const Tensor& indices) {
  CheckDefinedInput(*this, indices);
  return NamingTheLayer(*this, [&] { return ops::Embedding(weight_, indices, padding_idx_); });
}

// ---------------------------------------------------------------- activations

// The op's refusals (an integer input to GELU, Sigmoid or Tanh; an integer
// input to ReLU off the CPU) are rethrown naming the layer and its path, as
// the other layers' are: the op alone names only itself ("Sigmoid: needs a
// floating tensor"), which does not say which of a model's layers got it.
Tensor ReLU::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  try {
    return ops::Relu(x);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
}

Tensor ReLU::ForwardOwned(Tensor x) {
  CheckDefinedInput(*this, x);
  try {
    return ops::ReluOwned(std::move(x));
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
}

Tensor GELU::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  try {
    return ops::Gelu(x, tanh_);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
}

Tensor Sigmoid::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  try {
    return ops::Sigmoid(x);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
}

Tensor Tanh::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  try {
    return ops::Tanh(x);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
}

// ---------------------------------------------------------------- pooling

namespace {

// The checks of ops' PoolOutput, made at construction so that a bad
// argument is reported where it is given, naming the layer and the argument.
void CheckPoolArguments(const char* layer, const ops::Pool2dParams& p) {
  auto at_least_one = [layer](const char* what, int64_t v) {
    if (v < 1) throw std::invalid_argument(std::string(layer) + ": " + what + " must be >= 1, got " + std::to_string(v));
  };
  at_least_one("kernel_size", p.kernel_h);
  at_least_one("stride", p.stride_h);
  at_least_one("dilation", p.dilation_h);
  if (p.pad_h < 0 || p.pad_h * 2 > p.kernel_h) {
    throw std::invalid_argument(std::string(layer) + ": padding must be between 0 and half of kernel_size (" +
                                std::to_string(p.kernel_h) + "), got " + std::to_string(p.pad_h));
  }
}

}  // namespace

MaxPool2d::MaxPool2d(int64_t kernel_size, std::optional<int64_t> stride, int64_t padding, int64_t dilation,
                     bool ceil_mode) {
  const int64_t s = stride.value_or(kernel_size);
  p_ = {kernel_size, kernel_size, s, s, padding, padding, dilation, dilation, ceil_mode, true};
  CheckPoolArguments("MaxPool2d", p_);
}

std::string MaxPool2d::ExtraRepr() const {
  return "kernel_size=" + std::to_string(p_.kernel_h) + ", stride=" + std::to_string(p_.stride_h) +
         ", padding=" + std::to_string(p_.pad_h) + ", dilation=" + std::to_string(p_.dilation_h) +
         ", ceil_mode=" + PyBool(p_.ceil_mode);
}

Tensor MaxPool2d::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  if (x.dim() == 3) return RunUnbatched(*this, x);
  if (x.dim() != 4) Fail("expected input [N, C, H, W] or [C, H, W], got " + ShapeToString(x.shape()));
  try {
    return ops::MaxPool2d(x, p_);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
}

AvgPool2d::AvgPool2d(int64_t kernel_size, std::optional<int64_t> stride, int64_t padding, bool ceil_mode,
                     bool count_include_pad) {
  const int64_t s = stride.value_or(kernel_size);
  p_ = {kernel_size, kernel_size, s, s, padding, padding, 1, 1, ceil_mode, count_include_pad};
  CheckPoolArguments("AvgPool2d", p_);
}

std::string AvgPool2d::ExtraRepr() const {
  return "kernel_size=" + std::to_string(p_.kernel_h) + ", stride=" + std::to_string(p_.stride_h) +
         ", padding=" + std::to_string(p_.pad_h);
}

Tensor AvgPool2d::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  if (x.dim() == 3) return RunUnbatched(*this, x);
  if (x.dim() != 4) Fail("expected input [N, C, H, W] or [C, H, W], got " + ShapeToString(x.shape()));
  try {
    return ops::AvgPool2d(x, p_);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(int64_t out_h, int64_t out_w) : out_h_(out_h), out_w_(out_w) {
  // The op refuses it too, but only at the first Forward and naming itself
  // (adaptive_avg_pool2d), not where the size was given. 0 is taken, as in
  // PyTorch 1.13: an empty output.
  if (out_h < 0 || out_w < 0) {
    throw std::invalid_argument("AdaptiveAvgPool2d: output_size must be >= 0, got " + Pair(out_h, out_w));
  }
}

std::string AdaptiveAvgPool2d::ExtraRepr() const { return "output_size=" + Pair(out_h_, out_w_); }

Tensor AdaptiveAvgPool2d::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  if (x.dim() == 3) return RunUnbatched(*this, x);
  if (x.dim() != 4) Fail("expected input [N, C, H, W] or [C, H, W], got " + ShapeToString(x.shape()));
  try {
    return ops::AdaptiveAvgPool2d(x, out_h_, out_w_);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
}

// ---------------------------------------------------------------- misc

Dropout::Dropout(double p, Generator& gen) : p_(p), gen_(&gen) {
  // Written so that NaN fails it too.
  if (!(p >= 0.0 && p <= 1.0)) throw std::invalid_argument("Dropout: probability must be in [0, 1], got " + ErrorFloat(p));
}

std::string Dropout::ExtraRepr() const { return "p=" + PyFloat(p_) + ", inplace=False"; }

Tensor Dropout::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  try {
    return ops::Dropout(x, p_, is_training(), *gen_);
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
}

std::string Flatten::ExtraRepr() const {
  return "start_dim=" + std::to_string(start_) + ", end_dim=" + std::to_string(end_);
}

Tensor Flatten::Forward(const Tensor& x) {
  CheckDefinedInput(*this, x);
  try {
    return ops::Flatten(x, start_, end_);
  } catch (const std::exception& e) {
    Fail(e.what());
  }
}

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules) {
  for (const auto& m : modules) Push(m);
}

void Sequential::Push(std::shared_ptr<Module> module) {
  RegisterModule(std::to_string(ChildSlots().size()), std::move(module));
}

std::shared_ptr<Module> Sequential::at(size_t i) const { return Child(std::to_string(i)); }

Tensor Sequential::Forward(const Tensor& x) {
  Tensor y;
  for (const auto& [name, child] : ChildSlots()) {
    // Intermediate results belong to this loop alone, so children may reuse them.
    y = y.defined() ? child->ForwardOwned(std::move(y)) : child->Forward(x);
  }
  return y.defined() ? y : x;
}

}  // namespace ddp::nn::modules
