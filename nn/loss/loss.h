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
  /// Mixes the one-hot target with the uniform distribution: (1 - s) onehot + s / C.
  double label_smoothing = 0.0;
  /// Samples with this target contribute nothing (and are not counted by kMean).
  int64_t ignore_index = -100;
  /// Per-class weights [C] (floating, on the logits' device), or undefined
  /// for all ones. Sample i's loss is scaled by weight[target_i] (with label
  /// smoothing, the uniform part by the weights of every class), and kMean
  /// divides by the sum of weight[target_i] over non-ignored samples, as
  /// PyTorch. Weighted cross-entropy runs through NllLoss.
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

/// Cross-entropy of logits [N, C] against class indices target [N] (i64; u8
/// and i32 are converted). Computed in f32 for 16-bit logits (the loss is
/// then f32; the gradient returns in the logits' dtype). A target outside
/// [0, C) that is not ignore_index is an error naming the target, the
/// sample and the class count.
Tensor CrossEntropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& options = {});

/// Negative log-likelihood (PyTorch's nll_loss) of log-probabilities
/// log_probs [N, C] or [N, C, d1, ...] against class indices target [N] or
/// [N, d1, ...] (i64; u8 and i32 are converted): per element
/// -weight[t] * log_probs[n, t, ...] with t the target, 0 where t is
/// ignore_index. kNone returns them in the target's shape, kSum their sum,
/// kMean their sum over the sum of weight[t] of the non-ignored elements
/// (NaN when that is 0, e.g. every target ignored). 16-bit input computes
/// in f32. Errors name the bad target and its position, a weight of the
/// wrong shape or dtype, or a target that does not hold class indices.
Tensor NllLoss(const Tensor& log_probs, const Tensor& target, const NllLossOptions& options = {});

/// Mean (or sum, or per element) of (input - target)^2; shapes must match.
Tensor MseLoss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::kMean);

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

}  // namespace ddp::nn::loss
