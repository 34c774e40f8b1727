// Shapes: cross-entropy on logits [N, C, d...] (d... possibly none) with
// class indices [N, d...] or probabilities [N, C, d...], per-element losses
// [N, d...] (unbatched [C] runs as [1, C]); NLL on log_probs [N, C, d...]
// with target and per-element losses [N, d...]; class weights [C]. The
// pointwise losses (MSE, L1, smooth L1, Huber, BCE with logits, KL
// divergence) take input and target of one shape [*] and give per-element
// losses [*]; BCE's weights broadcast to [*], its pos_weight usually [C] for
// the last dimension C.
#include "nn/loss/loss.h"

#include <any>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nn/autograd/function.h"
#include "nn/autograd/node.h"
#include "nn/ops/autocast.h"
#include "nn/ops/dispatch.h"
#include "nn/ops/functional.h"

namespace ddp::nn::loss {

namespace {

class CrossEntropyBackward final : public autograd::Node {
 public:
  CrossEntropyBackward(const Tensor& log_probs, const Tensor& target, CrossEntropyOptions options, double count,
                       DType logits_dtype)
      : log_probs_(log_probs), target_(target), options_(options), count_(count), logits_dtype_(logits_dtype) {}

  std::vector<Tensor> Apply(std::vector<Tensor>&& grads) override {
    const Tensor lp = log_probs_.Get();
    Tensor g = grads[0];
    if (options_.reduction == Reduction::kMean) {
      Tensor scaled = Empty(g.shape(), {.dtype = g.dtype(), .device = g.device()});
      DDP_KERNEL(g.device(), affine)(g, 1.0 / count_, -0.0, scaled);  // -0.0: a pure scale, as MulScalar
      g = scaled;
    }
    Tensor dlogits = Empty(lp.shape(), {.dtype = logits_dtype_, .device = lp.device()});
    DDP_KERNEL(lp.device(), cross_entropy_backward)(lp, target_.Get(), g, options_.label_smoothing,
                                                    options_.ignore_index, dlogits);
    return {dlogits};
  }
  std::string name() const override { return "CrossEntropyBackward"; }
  void ReleaseSaved() override {
    log_probs_.Release();
    target_.Release();
  }

 private:
  autograd::SavedTensor log_probs_, target_;
  CrossEntropyOptions options_;
  double count_;
  DType logits_dtype_;
};

// Backward of NllLoss. The input is not saved: the gradient depends only on
// the target, the weights and the incoming gradient. The weights are saved
// with their version like the target: they may alias the caller's tensor,
// and one changed in place between forward and backward would give a
// gradient that mixes the new weights with the old kMean divisor.
class NllLossBackward final : public autograd::Node {
 public:
  NllLossBackward(const Tensor& target, const Tensor& weight, int64_t ignore_index, double scale,
                  Shape input_shape, DType dtype)
      : target_(target),
        weight_(weight),
        ignore_index_(ignore_index),
        scale_(scale),
        input_shape_(std::move(input_shape)),
        dtype_(dtype) {}

  std::vector<Tensor> Apply(std::vector<Tensor>&& grads) override {
    Tensor g = grads[0];
    if (scale_ != 1.0) {
      Tensor scaled = Empty(g.shape(), {.dtype = g.dtype(), .device = g.device()});
      DDP_KERNEL(g.device(), affine)(g, scale_, -0.0, scaled);  // -0.0: a pure scale, as MulScalar
      g = scaled;
    }
    Tensor dlp = Empty(input_shape_, {.dtype = dtype_, .device = g.device()});
    DDP_KERNEL(g.device(), nll_loss_backward)(target_.Get(), weight_.Get(), g, ignore_index_, dlp);
    return {dlp};
  }
  std::string name() const override { return "NllLossBackward"; }
  void ReleaseSaved() override {
    target_.Release();
    weight_.Release();
  }

 private:
  autograd::SavedTensor target_;
  autograd::SavedTensor weight_;  // in the compute dtype, or undefined
  int64_t ignore_index_;
  double scale_;   // 1 / (sum of the kept weights) for kMean, else 1
  Shape input_shape_;
  DType dtype_;
};

// An option's value in an error: the fewest significant digits that read
// back as the same double. std::to_string's six decimals showed a refused
// label_smoothing of 1.0000001 as "1.000000", a value the check accepts, and
// a beta of -1e-9 as "-0.000000".
std::string ErrorValue(double v) {
  if (std::isnan(v)) return "nan";
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// A Reduction value cast from an integer that names none of the three
// (each loss would otherwise fall through to a different one of them).
void CheckReduction(const char* op, Reduction reduction) {
  if (reduction != Reduction::kMean && reduction != Reduction::kSum && reduction != Reduction::kNone) {
    throw std::invalid_argument(std::string(op) + ": unknown reduction " +
                                std::to_string(static_cast<int>(reduction)) + ", expected kMean, kSum or kNone");
  }
}

// Class weights: [C], floating, on `device`, and given no gradient.
void CheckWeight(const char* op, const Tensor& weight, int64_t classes, Device device) {
  if (!weight.defined()) return;
  if (weight.dim() != 1 || weight.size(0) != classes) {
    throw std::invalid_argument(std::string(op) + ": weight of shape " + ShapeToString(weight.shape()) +
                                " does not match " + std::to_string(classes) + " classes (expected [" +
                                std::to_string(classes) + "])");
  }
  if (!IsFloating(weight.dtype())) {
    throw std::invalid_argument(std::string(op) + ": weight must be floating, got " +
                                std::string(DTypeName(weight.dtype())));
  }
  if (weight.device() != device) {
    throw std::invalid_argument(std::string(op) + ": weight is on " + weight.device().ToString() + ", input on " +
                                device.ToString() + " (expected one device)");
  }
  if (autograd::AnyRequiresGrad({&weight})) {
    throw std::invalid_argument(std::string(op) +
                                ": weight requires grad, but no gradient flows to class weights (detach it)");
  }
}

// What kMean divides by: the sum of weight[t] over the targets t that are not
// ignore_index (their count without weights). Targets must be in range.
double KeptWeight(const Tensor& target, const Tensor& weight, int64_t ignore_index) {
  const Tensor ht = target.Detach().To(kCPU).Contiguous();
  const int64_t* t = ht.data<int64_t>();
  std::vector<double> w;
  if (weight.defined()) w = weight.Detach().To(kCPU).ToVector<double>();
  double total = 0;
  for (int64_t i = 0; i < ht.numel(); ++i) {
    if (t[i] != ignore_index) total += w.empty() ? 1.0 : w[static_cast<size_t>(t[i])];
  }
  return total;
}

Tensor CastTo(const Tensor& x, DType dtype) { return x.dtype() == dtype ? x : ops::Cast(x, dtype); }

// The shape [1, C, 1, ...] of `dims` dimensions that broadcasts class
// weights [C] over logits [N, C, d1, ...].
Shape ClassShape(int64_t dims, int64_t classes) {
  Shape shape(static_cast<size_t>(dims), 1);
  shape[1] = classes;
  return shape;
}

// Where element i of a target [N] or [N, d1, ...] sits, for errors:
// "sample n", "sample n, position p" or "sample n, position [p1, p2, ...]".
std::string TargetPosition(const Shape& shape, int64_t i) {
  if (shape.size() <= 1) return "sample " + std::to_string(i);
  int64_t inner = 1;
  for (size_t d = 1; d < shape.size(); ++d) inner *= shape[d];
  const std::string where = "sample " + std::to_string(i / inner) + ", position ";
  int64_t rest = i % inner;
  if (shape.size() == 2) return where + std::to_string(rest);
  std::vector<int64_t> index(shape.size() - 1);
  for (size_t d = shape.size() - 1; d >= 1; --d) {
    index[d - 1] = rest % shape[d];
    rest /= shape[d];
  }
  std::string text = where + "[";
  for (size_t k = 0; k < index.size(); ++k) text += (k == 0 ? "" : ", ") + std::to_string(index[k]);
  return text + "]";
}

// Cross-entropy of class indices composed of differentiable ops: log-softmax
// over the class dim, the (weighted) NLL, and with label smoothing the
// (weighted) uniform part. Logits [N, C, d1, ...], target [N, d1, ...] (i64),
// per-element losses [N, d1, ...]. Serves class weights and spatial logits;
// unweighted [N, C] keeps the fused kernels.
Tensor ComposedCrossEntropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& options,
                            DType compute) {
  const int64_t c = logits.size(1);
  const Tensor lp = ops::LogSoftmax(CastTo(logits, compute), 1);
  const Tensor w = options.weight.defined() ? options.weight.Detach().To(compute) : Tensor();
  // Checked here so that the error names cross_entropy and the position.
  const Tensor ht = target.Detach().To(kCPU).Contiguous();
  const int64_t* t = ht.data<int64_t>();
  const int64_t n = ht.numel();
  // Per element: 0 when its uniform term counts, 1 when it is ignored.
  std::vector<int64_t> skip(static_cast<size_t>(n));
  bool any_ignored = false;
  for (int64_t i = 0; i < n; ++i) {
    skip[i] = t[i] == options.ignore_index ? 1 : 0;
    any_ignored |= skip[i] != 0;
    if (t[i] != options.ignore_index && (t[i] < 0 || t[i] >= c)) {
      throw std::out_of_range("cross_entropy: target " + std::to_string(t[i]) + " (" +
                              TargetPosition(target.shape(), i) + ") is out of range for " + std::to_string(c) +
                              " classes [0, " + std::to_string(c - 1) + "]");
    }
  }
  Tensor per = NllLoss(lp, target, {.reduction = Reduction::kNone, .weight = w, .ignore_index = options.ignore_index});
  const double eps = options.label_smoothing;
  if (eps > 0.0) {
    // -sum_k weight[k] * log_probs[i, k, ...], 0 for ignored elements.
    const Tensor weighted = w.defined() ? ops::Mul(lp, w.View(ClassShape(lp.dim(), c))) : lp;
    Tensor uniform;
    if (!any_ignored) {
      uniform = ops::Neg(ops::Sum(weighted, {1}));
    } else if (logits.dim() == 2) {
      // An ignored row must give 0 by selection, in the forward and the
      // backward: multiplying by a 0 mask makes inf * 0 = NaN for a row with
      // a -inf log-probability, and for the inf gradient scale of a mean
      // over nothing kept. NLL with one class does the selection: viewed as
      // [N, 1, C], element (i, k) is class 0 at position k, and target[i, k]
      // is 0 for a kept row, 1 (passed as the ignore index) for an ignored
      // one; its loss is -weighted[i, k] or 0, its gradient likewise 0.
      const Tensor sel = FromVectorOf<int64_t>(skip, {n, 1}).To(logits.device()).Expand({n, c});
      uniform = ops::Sum(NllLoss(ops::View(weighted, {n, 1, c}), sel,
                                 {.reduction = Reduction::kNone, .ignore_index = 1}),
                         {1});
    } else {
      // The same selection after the class sum, on [N * d1 * ..., 1]: a
      // selector of the target's size rather than C times it (a segmentation
      // batch has millions of pixels). The NLL's gradient is 0 at an ignored
      // element, so the sum of a -inf row there sends back zeros, not NaN.
      const Tensor summed = ops::Sum(weighted, {1});
      const Tensor sel = FromVectorOf<int64_t>(skip, {n}).To(logits.device());
      uniform = ops::Reshape(NllLoss(ops::Reshape(summed, {n, 1}), sel,
                                     {.reduction = Reduction::kNone, .ignore_index = 1}),
                             summed.shape());
    }
    per = ops::Add(ops::MulScalar(per, 1.0 - eps), ops::MulScalar(uniform, eps / static_cast<double>(c)));
  }
  switch (options.reduction) {
    case Reduction::kNone: return per;
    case Reduction::kSum: return ops::Sum(per);
    case Reduction::kMean: return ops::MulScalar(ops::Sum(per), 1.0 / KeptWeight(ht, w, options.ignore_index));
  }
  return per;
}

// Cross-entropy of class probabilities ("soft labels"), as PyTorch's: logits
// and target [N, C, d1, ...], per-element losses [N, d1, ...]
// -sum_c weight[c] * q[n, c, ...] * log_softmax(logits)[n, c, ...] with
// q = (1 - s) target + s / C. kMean divides by N * d1 * ... (not by the
// weights). Gradients flow to the target too.
Tensor ProbabilityCrossEntropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& options,
                               DType compute) {
  const int64_t c = logits.size(1);
  const Tensor lp = ops::LogSoftmax(CastTo(logits, compute), 1);
  Tensor q = CastTo(target, compute);
  const double eps = options.label_smoothing;
  if (eps > 0.0) q = ops::AddScalar(ops::MulScalar(q, 1.0 - eps), eps / static_cast<double>(c));
  Tensor product = ops::Mul(lp, q);
  if (options.weight.defined()) {
    product = ops::Mul(product, options.weight.Detach().To(compute).View(ClassShape(lp.dim(), c)));
  }
  const Tensor per = ops::Neg(ops::Sum(product, {1}));
  switch (options.reduction) {
    case Reduction::kNone: return per;
    case Reduction::kSum: return ops::Sum(per);
    case Reduction::kMean:
      // PyTorch divides by numel / C, and gives NaN when there is nothing.
      return ops::DivScalar(ops::Sum(per), logits.numel() == 0 ? 0.0 : static_cast<double>(per.numel()));
  }
  return per;
}

}  // namespace

Tensor NllLoss(const Tensor& input, const Tensor& target_in, const NllLossOptions& options) {
  if (!input.defined()) throw std::invalid_argument("nll_loss: log-probabilities are undefined");
  if (!target_in.defined()) throw std::invalid_argument("nll_loss: target is undefined");
  CheckReduction("nll_loss", options.reduction);
  if (input.dim() < 1) {
    throw std::invalid_argument("nll_loss: expected log-probabilities [C], [N, C] or [N, C, d1, ...], got " +
                                ShapeToString(input.shape()));
  }
  if (!IsFloating(input.dtype())) {
    throw std::invalid_argument("nll_loss: log-probabilities must be floating, got " +
                                std::string(DTypeName(input.dtype())));
  }
  if (input.dim() == 1) {
    // Unbatched [C] with a 0-d target: a batch of one, and kNone's loss
    // back to 0-d, as PyTorch (and CrossEntropy here).
    if (target_in.dim() != 0) {
      throw std::invalid_argument("nll_loss: target of shape " + ShapeToString(target_in.shape()) +
                                  " does not match unbatched log-probabilities " + ShapeToString(input.shape()) +
                                  " (expected a 0-d class index)");
    }
    const Tensor loss = NllLoss(ops::Unsqueeze(input, 0), target_in.Detach().Reshape({1}), options);
    return options.reduction == Reduction::kNone ? ops::Reshape(loss, {}) : loss;
  }
  Shape expected = input.shape();
  expected.erase(expected.begin() + 1);
  if (target_in.shape() != expected) {
    throw std::invalid_argument("nll_loss: target of shape " + ShapeToString(target_in.shape()) +
                                " does not match log-probabilities " + ShapeToString(input.shape()) +
                                " (expected " + ShapeToString(expected) + ")");
  }
  if (IsFloating(target_in.dtype())) {
    throw std::invalid_argument("nll_loss: target must hold class indices (i64, i32 or u8), got " +
                                std::string(DTypeName(target_in.dtype())));
  }
  if (target_in.device() != input.device()) {
    throw std::invalid_argument("nll_loss: target is on " + target_in.device().ToString() +
                                ", log-probabilities on " + input.device().ToString() + " (expected one device)");
  }
  CheckWeight("nll_loss", options.weight, input.size(1), input.device());
  const DType compute = input.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  const Tensor lp = input.dtype() == compute ? input : ops::Cast(input, compute);
  const Tensor target = target_in.dtype() == DType::kInt64 ? target_in.Detach() : target_in.Detach().To(DType::kInt64);
  const Tensor weight = !options.weight.defined()                ? Tensor()
                        : options.weight.dtype() == compute      ? options.weight.Detach()
                                                                  : options.weight.Detach().To(compute);
  Tensor losses = Empty(expected, {.dtype = compute, .device = input.device()});
  // Also checks every target is a class or ignore_index.
  DDP_KERNEL(input.device(), nll_loss_forward)(lp, target, weight, options.ignore_index, losses);
  double scale = 1.0;
  Tensor out;
  if (options.reduction == Reduction::kNone) {
    out = losses;
  } else {
    out = Empty({}, {.dtype = compute, .device = input.device()});
    DDP_KERNEL(input.device(), sum_to)(losses.View({losses.numel()}), out.View({1}), 1.0);
    if (options.reduction == Reduction::kMean) {
      // 0 / 0 = NaN when nothing is kept, as PyTorch.
      scale = 1.0 / KeptWeight(target, weight, options.ignore_index);
      // -0.0: a pure scale, as MulScalar. (sum_to sums from +0, so no -0
      // reaches this today; the scalings of the backward do receive one.)
      DDP_KERNEL(out.device(), affine)(out, scale, -0.0, out);
    }
  }
  if (!autograd::AnyRequiresGrad({&lp})) return out;
  auto node = std::make_shared<NllLossBackward>(target, weight, options.ignore_index, scale, lp.shape(), compute);
  autograd::ConnectNode(node, {&lp}, {&out});
  return out;
}

Tensor CrossEntropy(const Tensor& logits, const Tensor& target_in, const CrossEntropyOptions& options) {
  if (!logits.defined()) throw std::invalid_argument("cross_entropy: logits are undefined");
  if (!target_in.defined()) throw std::invalid_argument("cross_entropy: target is undefined");
  CheckReduction("cross_entropy", options.reduction);
  if (logits.dim() < 1) {
    throw std::invalid_argument("cross_entropy: expected logits [C], [N, C] or [N, C, d1, ...], got " +
                                ShapeToString(logits.shape()));
  }
  if (!IsFloating(logits.dtype())) {
    throw std::invalid_argument("cross_entropy: logits must be floating, got " +
                                std::string(DTypeName(logits.dtype())));
  }
  const bool probabilities = IsFloating(target_in.dtype());
  // Class indices have the logits' shape less the class dim (dim 0 of
  // unbatched [C] logits, else dim 1); probabilities the logits' shape.
  Shape indices_shape = logits.shape();
  indices_shape.erase(indices_shape.begin() + (logits.dim() == 1 ? 0 : 1));
  if (probabilities && target_in.shape() != logits.shape()) {
    throw std::invalid_argument("cross_entropy: floating target of shape " + ShapeToString(target_in.shape()) +
                                " does not match logits " + ShapeToString(logits.shape()) +
                                " (a floating target holds class probabilities, of the logits' shape; class "
                                "indices " + ShapeToString(indices_shape) + " must be i64, i32 or u8)");
  }
  if (!probabilities && target_in.shape() != indices_shape) {
    if (target_in.shape() == logits.shape()) {
      throw std::invalid_argument("cross_entropy: target of shape " + ShapeToString(target_in.shape()) +
                                  " is " + std::string(DTypeName(target_in.dtype())) +
                                  ", but a target of the logits' shape holds class probabilities and must be "
                                  "floating (class indices have shape " + ShapeToString(indices_shape) + ")");
    }
    throw std::invalid_argument("cross_entropy: target of shape " + ShapeToString(target_in.shape()) +
                                " does not match logits " + ShapeToString(logits.shape()) + " (expected " +
                                ShapeToString(indices_shape) + " for class indices, or " +
                                ShapeToString(logits.shape()) + " floating for probabilities)");
  }
  if (target_in.device() != logits.device()) {
    throw std::invalid_argument("cross_entropy: target is on " + target_in.device().ToString() +
                                ", logits on " + logits.device().ToString() + " (expected one device)");
  }
  // Written so that NaN fails it too.
  if (!(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0)) {
    throw std::invalid_argument("cross_entropy: label_smoothing must be in [0, 1], got " +
                                ErrorValue(options.label_smoothing));
  }
  // A class to ignore has no meaning for a distribution over the classes;
  // PyTorch refuses it too, rather than train on what was meant as masked.
  if (probabilities && options.ignore_index >= 0) {
    throw std::invalid_argument("cross_entropy: ignore_index " + std::to_string(options.ignore_index) +
                                " is not supported with class-probability (floating) targets; leave it negative "
                                "(the default -100) or give class indices");
  }
  if (logits.dim() == 1) {
    // Unbatched: a batch of one, and kNone's loss back to 0-d.
    const Tensor batched_target = probabilities ? ops::Unsqueeze(target_in, 0) : target_in.Detach().Reshape({1});
    const Tensor loss = CrossEntropy(ops::Unsqueeze(logits, 0), batched_target, options);
    return options.reduction == Reduction::kNone ? ops::Reshape(loss, {}) : loss;
  }
  const DType compute = logits.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  CheckWeight("cross_entropy", options.weight, logits.size(1), logits.device());
  if (probabilities) return ProbabilityCrossEntropy(logits, target_in, options, compute);
  const Tensor target = target_in.dtype() == DType::kInt64 ? target_in : target_in.Detach().To(DType::kInt64);
  if (options.weight.defined() || logits.dim() > 2) return ComposedCrossEntropy(logits, target, options, compute);
  const int64_t n = logits.size(0);
  Tensor log_probs = Empty(logits.shape(), {.dtype = compute, .device = logits.device()});
  Tensor losses = Empty({n}, {.dtype = compute, .device = logits.device()});
  DDP_KERNEL(logits.device(), cross_entropy_forward)(logits, target, options.label_smoothing, options.ignore_index,
                                                     log_probs, losses);
  // Only non-ignored samples count towards the mean. Counted for kMean
  // alone: it copies the target to the host, a device sync that kNone and
  // kSum need not wait for (they never read the count).
  const double count = options.reduction == Reduction::kMean ? KeptWeight(target, Tensor(), options.ignore_index) : 1.0;
  Tensor out;
  if (options.reduction == Reduction::kNone) {
    out = losses;
  } else {
    out = Empty({}, {.dtype = compute, .device = logits.device()});
    DDP_KERNEL(logits.device(), sum_to)(losses, out.View({1}), 1.0);
    // -0.0: a pure scale, as in NllLoss.
    if (options.reduction == Reduction::kMean) DDP_KERNEL(out.device(), affine)(out, 1.0 / count, -0.0, out);
  }
  if (!autograd::AnyRequiresGrad({&logits})) return out;
  auto node = std::make_shared<CrossEntropyBackward>(log_probs, target, options, count, logits.dtype());
  autograd::ConnectNode(node, {&logits}, {&out});
  return out;
}

namespace {

// Input and target of a pointwise loss: defined, floating, one shape, one device.
void CheckPointwise(const char* op, const Tensor& input, const Tensor& target) {
  for (const auto& [what, t] : {std::pair<const char*, const Tensor*>{"input", &input}, {"target", &target}}) {
    if (!t->defined()) throw std::invalid_argument(std::string(op) + ": " + what + " is undefined");
    if (!IsFloating(t->dtype())) {
      throw std::invalid_argument(std::string(op) + ": " + what + " must be floating, got " +
                                  std::string(DTypeName(t->dtype())));
    }
  }
  if (input.shape() != target.shape()) {
    throw std::invalid_argument(std::string(op) + ": input " + ShapeToString(input.shape()) + " and target " +
                                ShapeToString(target.shape()) + " differ in shape");
  }
  if (input.device() != target.device()) {
    throw std::invalid_argument(std::string(op) + ": input is on " + input.device().ToString() + ", target on " +
                                target.device().ToString() + " (expected one device)");
  }
}

}  // namespace

Tensor MseLoss(const Tensor& input_in, const Tensor& target_in, Reduction reduction) {
  // Named here: an undefined, integer or misplaced operand otherwise fails
  // deep inside Sub or Square (or reading the dtype of nothing).
  CheckPointwise("mse_loss", input_in, target_in);
  CheckReduction("mse_loss", reduction);
  // Autocast: squared differences in f32 (16-bit squares overflow or underflow).
  const Tensor input = ops::autocast::ToFloat32(input_in), target = ops::autocast::ToFloat32(target_in);
  const Tensor sq = ops::Square(ops::Sub(input, target));
  switch (reduction) {
    case Reduction::kMean: return ops::Mean(sq);
    case Reduction::kSum: return ops::Sum(sq);
    case Reduction::kNone: return sq;
  }
  return sq;
}

namespace {

Tensor Reduce(const Tensor& per_element, Reduction reduction) {
  switch (reduction) {
    case Reduction::kMean: return ops::Mean(per_element);
    case Reduction::kSum: return ops::Sum(per_element);
    case Reduction::kNone: return per_element;
  }
  return per_element;
}

// The dtype of the log/exp losses: f64 when an operand is, else f32 (16-bit
// operands too, as NllLoss).
DType WideDType(const Tensor& a, const Tensor& b) {
  return a.dtype() == DType::kFloat64 || b.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

// Whether `from` broadcasts to `to` without changing `to` (numpy rules).
bool BroadcastsTo(const Shape& from, const Shape& to) {
  if (from.size() > to.size()) return false;
  for (size_t i = 1; i <= from.size(); ++i) {
    const int64_t f = from[from.size() - i], t = to[to.size() - i];
    if (f != t && f != 1) return false;
  }
  return true;
}

// An element weight of BCE: undefined, or floating, on the input's device,
// broadcasting to its shape, and needing no gradient. Returned detached in
// `dtype`.
Tensor ElementWeight(const char* op, const char* what, const Tensor& weight, const Tensor& input, DType dtype) {
  if (!weight.defined()) return Tensor();
  if (!IsFloating(weight.dtype())) {
    throw std::invalid_argument(std::string(op) + ": " + what + " must be floating, got " +
                                std::string(DTypeName(weight.dtype())));
  }
  if (!BroadcastsTo(weight.shape(), input.shape())) {
    throw std::invalid_argument(std::string(op) + ": " + what + " " + ShapeToString(weight.shape()) +
                                " does not broadcast to input " + ShapeToString(input.shape()));
  }
  if (weight.device() != input.device()) {
    throw std::invalid_argument(std::string(op) + ": " + what + " is on " + weight.device().ToString() +
                                ", input on " + input.device().ToString() + " (expected one device)");
  }
  if (autograd::AnyRequiresGrad({&weight})) {
    throw std::invalid_argument(std::string(op) + ": " + what +
                                " requires grad, but no gradient flows to it (detach it)");
  }
  return weight.dtype() == dtype ? weight.Detach() : weight.Detach().To(dtype);
}

// z = m + r with m = min(z, limit) and r = max(z - limit, 0). Below the limit
// r is exactly 0 and m is z itself, so the quadratic parts of SmoothL1 and
// Huber round as PyTorch's. m is a clamp rather than z - r, which an
// infinite z would make inf - inf = NaN: there the loss is inf.
std::pair<Tensor, Tensor> SplitAt(const Tensor& z, double limit) {
  return {ops::Clamp(z, std::nullopt, limit), ops::Relu(ops::AddScalar(z, -limit))};
}

// Per-element smooth L1 (kHuber false, limit beta) or Huber (limit delta) of
// inputs {input, target}, with PyTorch's backward rather than the one the
// forward's ops would compose. With d = input - target, the derivative is
// clamp(d, -limit, limit), divided by beta for smooth L1: the slope beyond
// the limit, d's own multiple inside it, and NaN for a NaN d (clamp keeps
// NaN). Composed of Abs and Clamp, the gradient would be 0 at NaN, hiding a
// NaN sample from the non-finite checks of gradient scaling; infinite d
// gets the slope, as before.
template <bool kHuber>
struct PiecewiseQuadraticLoss : autograd::Function<PiecewiseQuadraticLoss<kHuber>> {
  static constexpr const char* kName = kHuber ? "HuberLossBackward" : "SmoothL1LossBackward";
  static std::vector<Tensor> Forward(autograd::AutogradContext* ctx, const std::vector<Tensor>& in, double limit) {
    const Tensor d = ops::Sub(in[0], in[1]);
    const auto [m, r] = SplitAt(ops::Abs(d), limit);
    const Tensor half_sq = ops::MulScalar(ops::Square(m), 0.5);
    // Smooth L1: 0.5 m^2 / beta + r, that is 0.5 z^2 / beta below beta and
    // 0.5 beta + (z - beta) from it. Huber: 0.5 m^2 + delta r, that is
    // 0.5 z^2 below delta and 0.5 delta^2 + delta (z - delta) from it.
    // An infinite delta leaves Huber all quadratic, as PyTorch; its linear
    // term would be r * inf = 0 * inf = NaN.
    const Tensor per = !kHuber                ? ops::Add(ops::DivScalar(half_sq, limit), r)
                       : std::isinf(limit) ? half_sq
                                           : ops::Add(half_sq, ops::MulScalar(r, limit));
    ctx->SaveForBackward({d});
    ctx->saved_data["limit"] = limit;
    return {per};
  }
  static std::vector<Tensor> Backward(autograd::AutogradContext* ctx, const std::vector<Tensor>& grad) {
    const Tensor d = ctx->GetSavedTensors()[0];
    const double limit = std::any_cast<double>(ctx->saved_data["limit"]);
    Tensor slope = ops::Clamp(d, -limit, limit);
    if (!kHuber) slope = ops::DivScalar(slope, limit);
    const Tensor gd = ops::Mul(grad[0], slope);
    return {ctx->NeedsInputGrad(0) ? gd : Tensor(), ctx->NeedsInputGrad(1) ? ops::Neg(gd) : Tensor()};
  }
};

}  // namespace

Tensor L1(const Tensor& input_in, const Tensor& target_in, Reduction reduction) {
  CheckPointwise("l1_loss", input_in, target_in);
  CheckReduction("l1_loss", reduction);
  const Tensor input = ops::autocast::ToFloat32(input_in), target = ops::autocast::ToFloat32(target_in);
  return Reduce(ops::Abs(ops::Sub(input, target)), reduction);
}

Tensor SmoothL1(const Tensor& input_in, const Tensor& target_in, const SmoothL1Options& options) {
  CheckPointwise("smooth_l1_loss", input_in, target_in);
  CheckReduction("smooth_l1_loss", options.reduction);
  // Written so that NaN fails it too.
  if (!(options.beta >= 0.0)) {
    throw std::invalid_argument("smooth_l1_loss: beta must be >= 0, got " + ErrorValue(options.beta));
  }
  if (options.beta == 0.0) return L1(input_in, target_in, options.reduction);
  const Tensor input = ops::autocast::ToFloat32(input_in), target = ops::autocast::ToFloat32(target_in);
  return Reduce(PiecewiseQuadraticLoss<false>::Apply({input, target}, options.beta)[0], options.reduction);
}

Tensor Huber(const Tensor& input_in, const Tensor& target_in, const HuberOptions& options) {
  CheckPointwise("huber_loss", input_in, target_in);
  CheckReduction("huber_loss", options.reduction);
  if (!(options.delta > 0.0)) {
    throw std::invalid_argument("huber_loss: delta must be > 0, got " + ErrorValue(options.delta));
  }
  const Tensor input = ops::autocast::ToFloat32(input_in), target = ops::autocast::ToFloat32(target_in);
  return Reduce(PiecewiseQuadraticLoss<true>::Apply({input, target}, options.delta)[0], options.reduction);
}

Tensor BinaryCrossEntropyWithLogits(const Tensor& input_in, const Tensor& target_in,
                                    const BceWithLogitsOptions& options) {
  constexpr const char* kOp = "binary_cross_entropy_with_logits";
  CheckPointwise(kOp, input_in, target_in);
  CheckReduction(kOp, options.reduction);
  const DType compute = WideDType(input_in, target_in);
  const Tensor x = CastTo(input_in, compute), y = CastTo(target_in, compute);
  const Tensor weight = ElementWeight(kOp, "weight", options.weight, x, compute);
  const Tensor pos_weight = ElementWeight(kOp, "pos_weight", options.pos_weight, x, compute);
  // softplus(-x) = -log(sigmoid(x)) = log1p(exp(-|x|)) + max(-x, 0): exp
  // never overflows, and log1p keeps exp(-|x|) where 1 + exp(-|x|) would
  // round it away (f32 softplus(-20) = 2.06e-9, as torch.nn.functional.
  // logsigmoid gives; PyTorch 1.13's BCE, with log(1 + exp), gives 0 there).
  // -|x| is written -x - 2 max(-x, 0) rather than with Abs:
  // Abs has derivative 0 at 0, which would drop this term's -1/2 there (the
  // logits of a zero-initialized classifier).
  const Tensor neg_x = ops::Neg(x);
  const Tensor neg_part = ops::Relu(neg_x);
  const Tensor minus_abs = ops::Sub(neg_x, ops::MulScalar(neg_part, 2.0));
  const Tensor softplus = ops::Add(ops::Log1p(ops::Exp(minus_abs)), neg_part);
  // (1 - y) x + (1 + (pos_weight - 1) y) softplus(-x).
  const Tensor positive =
      pos_weight.defined() ? ops::Mul(ops::AddScalar(ops::Mul(ops::AddScalar(pos_weight, -1.0), y), 1.0), softplus)
                           : softplus;
  Tensor per = ops::Add(ops::Mul(ops::AddScalar(ops::Neg(y), 1.0), x), positive);
  if (weight.defined()) per = ops::Mul(per, weight);
  return Reduce(per, options.reduction);
}

Tensor KlDiv(const Tensor& input_in, const Tensor& target_in, const KlDivOptions& options) {
  CheckPointwise("kl_div", input_in, target_in);
  CheckReduction("kl_div", options.reduction);
  if (options.batch_mean && options.reduction != Reduction::kMean) {
    throw std::invalid_argument(std::string("kl_div: batch_mean needs reduction kMean, got ") +
                                (options.reduction == Reduction::kSum ? "kSum" : "kNone"));
  }
  const DType compute = WideDType(input_in, target_in);
  const Tensor input = CastTo(input_in, compute), target = CastTo(target_in, compute);
  Tensor per;
  if (options.log_target) {
    per = ops::Mul(ops::Exp(target), ops::Sub(target, input));
  } else {
    // xlogy(t, t) - t * input, as PyTorch. t log t is 0 at t == 0: the log
    // reads max(t, tiny), t itself from tiny up (the ReLU is exactly 0 there),
    // so that 0 * log(0) = NaN never forms, in the forward or the backward.
    const double tiny =
        compute == DType::kFloat64 ? std::numeric_limits<double>::min() : std::numeric_limits<float>::min();
    const Tensor at_least_tiny = ops::Add(target, ops::Relu(ops::AddScalar(ops::Neg(target), tiny)));
    // That floor would also make a negative t finite, where xlogy(t, t) is
    // NaN: sqrt(min(t, 0)) is 0 for t >= 0 and NaN for t < 0, and added to
    // the log it gives PyTorch's NaN loss (and target gradient) there. It is
    // computed from the detached target, so it adds no gradient of its own.
    const Tensor nan_if_negative = ops::Sqrt(ops::Clamp(target.Detach(), std::nullopt, 0.0));
    const Tensor log_t = ops::Add(ops::Log(at_least_tiny), nan_if_negative);
    per = ops::Sub(ops::Mul(target, log_t), ops::Mul(target, input));
  }
  if (options.batch_mean) {
    const Tensor sum = ops::Sum(per);
    return input.dim() == 0 ? sum : ops::DivScalar(sum, static_cast<double>(input.size(0)));
  }
  return Reduce(per, options.reduction);
}

}  // namespace ddp::nn::loss
