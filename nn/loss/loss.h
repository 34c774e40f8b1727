// Loss functions (differentiable).
#pragma once

#include <cstdint>
#include <utility>

#include "nn/tensor/tensor.h"

namespace ddp::nn::loss {

/// How per-element losses combine. Values are stable.
enum class Reduction : int8_t { kMean = 0, kSum = 1, kNone = 2 };

struct CrossEntropyOptions {
  Reduction reduction = Reduction::kMean;
  /// Mixes the target with the uniform distribution: (1 - s) onehot + s / C
  /// for class indices, (1 - s) target + s / C for probabilities. In [0, 1].
  double label_smoothing = 0.0;
  /// Class-index elements with this target contribute nothing (and are not
  /// counted by kMean). Probability targets have no ignored elements: with
  /// them it must be negative (as the default), else it is an error, as in
  /// PyTorch.
  int64_t ignore_index = -100;
  /// Per-class weights [C] (floating, on the logits' device, needing no
  /// gradient), or undefined for all ones. With class indices, element i's
  /// loss is scaled by weight[target_i] (with label smoothing, the uniform
  /// part by the weights of every class), and kMean divides by the sum of
  /// weight[target_i] over non-ignored elements, as PyTorch. With
  /// probabilities, class c's term is scaled by weight[c] and kMean still
  /// divides by the element count, as PyTorch.
  Tensor weight;
};

struct NllLossOptions {
  Reduction reduction = Reduction::kMean;
  /// Per-class weights [C] (floating, on the input's device), or undefined
  /// for all ones. No gradient flows to them.
  Tensor weight;
  /// Elements with this target contribute nothing and weigh nothing in kMean.
  int64_t ignore_index = -100;
};

/// torch.nn.functional.cross_entropy. Logits [N, C], [N, C, d1, ...] (e.g.
/// segmentation) or unbatched [C], and a target of one of two kinds:
///  - class indices (i64; u8 and i32 are converted) of the logits' shape
///    less the class dim ([N], [N, d1, ...], or 0-d for [C]): per element
///    -weight[t] log_softmax(logits)[n, t, ...], 0 where t is ignore_index;
///    kMean divides by the sum of weight[t] over the non-ignored elements
///    (NaN when that is 0). A target outside [0, C) that is not
///    ignore_index is an error naming it, its position and the class count.
///  - class probabilities (floating, the logits' shape): per element
///    -sum_c weight[c] target[n, c, ...] log_softmax(logits)[n, c, ...];
///    kMean divides by the element count N * d1 * ...; the target receives
///    a gradient too. ignore_index must be negative (an error naming it
///    otherwise).
/// kNone returns the per-element losses ([N], [N, d1, ...], or 0-d for
/// unbatched logits), kSum their sum. Computed in f32 for 16-bit logits
/// (the loss is then f32; the gradient returns in the logits' dtype).
/// Unweighted class indices on [N, C] run on the fused cross_entropy
/// kernels; the other cases are compositions of the differentiable ops
/// (log-softmax over dim 1, NllLoss). Errors name the shapes of a target
/// that fits neither kind.
Tensor CrossEntropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& options = {});

/// Negative log-likelihood (PyTorch's nll_loss) of log-probabilities
/// log_probs [N, C], [N, C, d1, ...] or unbatched [C] against class indices
/// target [N], [N, d1, ...] or 0-d (i64; u8 and i32 are converted; [C]
/// runs as a batch of one, a 0-d loss for every reduction): per element
/// -weight[t] * log_probs[n, t, ...] with t the target, 0 where t is
/// ignore_index. kNone returns them in the target's shape, kSum their sum,
/// kMean their sum over the sum of weight[t] of the non-ignored elements
/// (NaN when that is 0, e.g. every target ignored). 16-bit input computes
/// in f32. Errors name the bad target and its position, a weight of the
/// wrong shape or dtype, or a target that does not hold class indices.
Tensor NllLoss(const Tensor& log_probs, const Tensor& target, const NllLossOptions& options = {});

/// Mean (or sum, or per element) of (input - target)^2; shapes must match.
Tensor MseLoss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::kMean);

// Pointwise losses of input and target of one shape (PyTorch broadcasts
// nothing here either, apart from BCE's weights). They are compositions of
// the differentiable ops, so they run on any device with those kernels and
// pass gradients to input and target. Errors name the loss and both shapes.

/// |input - target|, as F.l1_loss. Computes in the operands' promoted dtype
/// (16-bit in f32 under autocast, as MseLoss).
Tensor L1(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::kMean);

struct SmoothL1Options {
  Reduction reduction = Reduction::kMean;
  /// Where the quadratic part ends (>= 0; 0 is L1).
  double beta = 1.0;
};

/// F.smooth_l1_loss: with z = |input - target|, 0.5 z^2 / beta where
/// z < beta, else z - 0.5 beta. An infinite z gives inf with gradient
/// +-1, as PyTorch.
Tensor SmoothL1(const Tensor& input, const Tensor& target, const SmoothL1Options& options = {});

struct HuberOptions {
  Reduction reduction = Reduction::kMean;
  /// Where the quadratic part ends (> 0; +inf is 0.5 z^2 everywhere).
  double delta = 1.0;
};

/// F.huber_loss: with z = |input - target|, 0.5 z^2 where z < delta, else
/// delta (z - 0.5 delta) (= delta * SmoothL1 with beta = delta). An infinite
/// z gives inf with gradient +-delta, as PyTorch.
Tensor Huber(const Tensor& input, const Tensor& target, const HuberOptions& options = {});

struct BceWithLogitsOptions {
  Reduction reduction = Reduction::kMean;
  /// Per-element weights broadcast to the input's shape, or undefined for
  /// all ones. kMean still divides by the element count, as PyTorch.
  Tensor weight;
  /// Weights of the positive term, broadcast over the last (class) dimension
  /// (usually [C]), or undefined for all ones.
  Tensor pos_weight;
};

/// F.binary_cross_entropy_with_logits of logits x against targets y in
/// [0, 1] of x's shape: weight * ((1 - y) x + lw * softplus(-x)) with
/// lw = 1 + (pos_weight - 1) y and softplus(-x) = log1p(exp(-|x|)) +
/// max(-x, 0), finite for any finite x (|x| = 100 in f32 included) and
/// exact to rounding where exp(-|x|) is below the dtype's epsilon; the
/// gradient is exact to rounding, at x = 0 too. 16-bit operands compute in
/// f32 (the loss is f32).
/// Weights must be floating, on the input's device, and need no gradient
/// (as PyTorch, which refuses them too).
Tensor BinaryCrossEntropyWithLogits(const Tensor& input, const Tensor& target,
                                    const BceWithLogitsOptions& options = {});

struct KlDivOptions {
  Reduction reduction = Reduction::kMean;
  /// PyTorch's reduction "batchmean": the sum over the batch size
  /// (input.size(0); the sum for a 0-d input), which is the KL divergence
  /// per sample, where kMean divides by the element count. Needs reduction
  /// kMean (the mean it refines).
  bool batch_mean = false;
  /// Whether the target holds log-probabilities rather than probabilities.
  bool log_target = false;
};

/// F.kl_div of log-probabilities `input` against `target` of its shape:
/// per element target * (log(target) - input), 0 where target == 0 (xlogy);
/// with log_target, exp(target) * (target - input). The gradient to a
/// target of 0 is finite (log of the dtype's smallest normal number in
/// place of log 0; PyTorch: NaN). 16-bit operands compute in f32.
Tensor KlDiv(const Tensor& input, const Tensor& target, const KlDivOptions& options = {});

/// Module-style wrappers.
class CrossEntropyLoss {
 public:
  explicit CrossEntropyLoss(CrossEntropyOptions options = {}) : options_(std::move(options)) {}
  Tensor operator()(const Tensor& logits, const Tensor& target) const { return CrossEntropy(logits, target, options_); }

 private:
  CrossEntropyOptions options_;
};

class NLLLoss {
 public:
  explicit NLLLoss(NllLossOptions options = {}) : options_(std::move(options)) {}
  Tensor operator()(const Tensor& log_probs, const Tensor& target) const { return NllLoss(log_probs, target, options_); }

 private:
  NllLossOptions options_;
};

class MSELoss {
 public:
  explicit MSELoss(Reduction reduction = Reduction::kMean) : reduction_(reduction) {}
  Tensor operator()(const Tensor& input, const Tensor& target) const { return MseLoss(input, target, reduction_); }

 private:
  Reduction reduction_;
};

// The functions above are named like CrossEntropy, so that the classes can
// carry PyTorch's module names.
class L1Loss {
 public:
  explicit L1Loss(Reduction reduction = Reduction::kMean) : reduction_(reduction) {}
  Tensor operator()(const Tensor& input, const Tensor& target) const { return L1(input, target, reduction_); }

 private:
  Reduction reduction_;
};

class SmoothL1Loss {
 public:
  explicit SmoothL1Loss(SmoothL1Options options = {}) : options_(options) {}
  Tensor operator()(const Tensor& input, const Tensor& target) const { return SmoothL1(input, target, options_); }

 private:
  SmoothL1Options options_;
};

class HuberLoss {
 public:
  explicit HuberLoss(HuberOptions options = {}) : options_(options) {}
  Tensor operator()(const Tensor& input, const Tensor& target) const { return Huber(input, target, options_); }

 private:
  HuberOptions options_;
};

class BCEWithLogitsLoss {
 public:
  explicit BCEWithLogitsLoss(BceWithLogitsOptions options = {}) : options_(std::move(options)) {}
  Tensor operator()(const Tensor& input, const Tensor& target) const {
    return BinaryCrossEntropyWithLogits(input, target, options_);
  }

 private:
  BceWithLogitsOptions options_;
};

class KLDivLoss {
 public:
  explicit KLDivLoss(KlDivOptions options = {}) : options_(options) {}
  Tensor operator()(const Tensor& input, const Tensor& target) const { return KlDiv(input, target, options_); }

 private:
  KlDivOptions options_;
};

}  // namespace ddp::nn::loss
