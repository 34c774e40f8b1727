// Shapes: logits [N, C], target [N], per-sample losses [N].
#include "nn/loss/loss.h"

#include <stdexcept>
#include <string>
#include <utility>

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
      DDP_KERNEL(g.device(), affine)(g, 1.0 / count_, 0.0, scaled);
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

}  // namespace

Tensor CrossEntropy(const Tensor& logits, const Tensor& target_in, const CrossEntropyOptions& options) {
  if (logits.dim() != 2) {
    throw std::invalid_argument("cross_entropy: expected logits [N, C], got " + ShapeToString(logits.shape()));
  }
  if (!IsFloating(logits.dtype())) {
    throw std::invalid_argument("cross_entropy: logits must be floating, got " +
                                std::string(DTypeName(logits.dtype())));
  }
  if (target_in.dim() != 1 || target_in.size(0) != logits.size(0)) {
    throw std::invalid_argument("cross_entropy: target of shape " + ShapeToString(target_in.shape()) +
                                " does not match logits " + ShapeToString(logits.shape()) + " (expected [" +
                                std::to_string(logits.size(0)) + "])");
  }
  if (IsFloating(target_in.dtype())) {
    throw std::invalid_argument("cross_entropy: target must hold class indices (i64, i32 or u8), got " +
                                std::string(DTypeName(target_in.dtype())));
  }
  if (target_in.device() != logits.device()) {
    throw std::invalid_argument("cross_entropy: target is on " + target_in.device().ToString() +
                                ", logits on " + logits.device().ToString() + " (expected one device)");
  }
  // Written so that NaN fails it too.
  if (!(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0)) {
    throw std::invalid_argument("cross_entropy: label_smoothing must be in [0, 1], got " +
                                std::to_string(options.label_smoothing));
  }
  const Tensor target = target_in.dtype() == DType::kInt64 ? target_in : target_in.Detach().To(DType::kInt64);
  const int64_t n = logits.size(0);
  const DType compute = logits.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  Tensor log_probs = Empty(logits.shape(), {.dtype = compute, .device = logits.device()});
  Tensor losses = Empty({n}, {.dtype = compute, .device = logits.device()});
  DDP_KERNEL(logits.device(), cross_entropy_forward)(logits, target, options.label_smoothing, options.ignore_index,
                                                     log_probs, losses);
  // Only non-ignored samples count towards the mean.
  const Tensor host_target = target.Detach().To(kCPU).Contiguous();
  const int64_t* t = host_target.data<int64_t>();
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) kept += t[i] != options.ignore_index;
  const double count = static_cast<double>(kept);
  Tensor out;
  if (options.reduction == Reduction::kNone) {
    out = losses;
  } else {
    out = Empty({}, {.dtype = compute, .device = logits.device()});
    DDP_KERNEL(logits.device(), sum_to)(losses, out.View({1}), 1.0);
    if (options.reduction == Reduction::kMean) DDP_KERNEL(out.device(), affine)(out, 1.0 / count, 0.0, out);
  }
  if (!autograd::AnyRequiresGrad({&logits})) return out;
  auto node = std::make_shared<CrossEntropyBackward>(log_probs, target, options, count, logits.dtype());
  autograd::ConnectNode(node, {&logits}, {&out});
  return out;
}

Tensor MseLoss(const Tensor& input_in, const Tensor& target_in, Reduction reduction) {
  // Named here: an integer operand otherwise fails deep inside Sub or Square.
  for (const auto& [what, t] : {std::pair<const char*, const Tensor*>{"input", &input_in}, {"target", &target_in}}) {
    if (!IsFloating(t->dtype())) {
      throw std::invalid_argument(std::string("mse_loss: ") + what + " must be floating, got " +
                                  std::string(DTypeName(t->dtype())));
    }
  }
  // Autocast: squared differences in f32 (16-bit squares overflow or underflow).
  const Tensor input = ops::autocast::ToFloat32(input_in), target = ops::autocast::ToFloat32(target_in);
  if (input.shape() != target.shape()) {
    throw std::invalid_argument("mse_loss: input " + ShapeToString(input.shape()) + " and target " +
                                ShapeToString(target.shape()) + " differ in shape");
  }
  const Tensor sq = ops::Square(ops::Sub(input, target));
  switch (reduction) {
    case Reduction::kMean: return ops::Mean(sq);
    case Reduction::kSum: return ops::Sum(sq);
    case Reduction::kNone: return sq;
  }
  return sq;
}

}  // namespace ddp::nn::loss
