// Loss functions (differentiable).
#pragma once

#include <cstdint>

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
};

/// Cross-entropy of logits [N, C] against class indices target [N] (i64; u8
/// and i32 are converted). Computed in f32 for 16-bit logits (the loss is
/// then f32; the gradient returns in the logits' dtype). A target outside
/// [0, C) that is not ignore_index is an error naming the target, the
/// sample and the class count.
Tensor CrossEntropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& options = {});

/// Mean (or sum, or per element) of (input - target)^2; shapes must match.
Tensor MseLoss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::kMean);

/// Module-style wrappers.
class CrossEntropyLoss {
 public:
  explicit CrossEntropyLoss(CrossEntropyOptions options = {}) : options_(options) {}
  Tensor operator()(const Tensor& logits, const Tensor& target) const { return CrossEntropy(logits, target, options_); }

 private:
  CrossEntropyOptions options_;
};

class MSELoss {
 public:
  explicit MSELoss(Reduction reduction = Reduction::kMean) : reduction_(reduction) {}
  Tensor operator()(const Tensor& input, const Tensor& target) const { return MseLoss(input, target, reduction_); }

 private:
  Reduction reduction_;
};

}  // namespace ddp::nn::loss
