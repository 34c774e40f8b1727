#include "nn/loss/loss.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "nn/autograd/engine.h"
#include "nn/ops/dispatch.h"
#include "nn/ops/functional.h"
#include "nn/ops/gradcheck.h"
#include "nn/tensor/testing/host_as_device.h"

namespace ddp::nn::loss {
namespace {

using testing::GradCheck;
using testing::RandomLeaf;
using V = std::vector<Tensor>;

template <typename Fn>
std::string ErrorOf(Fn fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(CrossEntropyTest, MatchesTheFormula) {
  Tensor logits = FromVector({1, 2, 3, 1, 0, -1}, {2, 3}, {.dtype = DType::kFloat64});
  Tensor target = FromVectorOf<int64_t>({2, 0}, {2});
  const double l0 = -3 + std::log(std::exp(1) + std::exp(2) + std::exp(3));
  const double l1 = -1 + std::log(std::exp(1) + std::exp(0) + std::exp(-1));
  EXPECT_NEAR(CrossEntropy(logits, target).Item(), (l0 + l1) / 2, 1e-12);
  EXPECT_NEAR(CrossEntropy(logits, target, {.reduction = Reduction::kSum}).Item(), l0 + l1, 1e-12);
  EXPECT_EQ(CrossEntropy(logits, target, {.reduction = Reduction::kNone}).shape(), (Shape{2}));
  // Ignored samples are left out of the mean.
  Tensor t2 = FromVectorOf<int64_t>({2, -100}, {2});
  EXPECT_NEAR(CrossEntropy(logits, t2).Item(), l0, 1e-12);
  // u8 labels (as datasets keep them) are accepted.
  EXPECT_NEAR(CrossEntropy(logits, FromVectorOf<uint8_t>({2, 0}, {2})).Item(), (l0 + l1) / 2, 1e-12);
}

TEST(CrossEntropyTest, Gradients) {
  Tensor target = FromVectorOf<int64_t>({2, 0, 4, 1}, {4});
  for (double smoothing : {0.0, 0.1}) {
    for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      EXPECT_TRUE(GradCheck([&](const V& in) {
        return CrossEntropy(in[0], target, {.reduction = r, .label_smoothing = smoothing});
      }, {RandomLeaf({4, 5}, 1)}));
    }
  }
  Tensor ignored = FromVectorOf<int64_t>({2, -100, 4, 1}, {4});
  EXPECT_TRUE(GradCheck([&](const V& in) { return CrossEntropy(in[0], ignored, {.label_smoothing = 0.2}); },
                        {RandomLeaf({4, 5}, 2)}));
  Tensor strided = RandomLeaf({5, 4}, 3, false).Transpose(0, 1);
  strided.set_requires_grad(true);
  EXPECT_TRUE(GradCheck([&](const V& in) { return CrossEntropy(in[0], target); }, {strided}));
}

TEST(CrossEntropyTest, BadInputsAreNamed) {
  Tensor logits = Zeros({3, 10});
  std::string err = ErrorOf([&] { CrossEntropy(logits, FromVectorOf<int64_t>({1, 12, 3}, {3})); });
  EXPECT_NE(err.find("target 12 (sample 1) is out of range for 10 classes"), std::string::npos) << err;
  err = ErrorOf([&] { CrossEntropy(logits, FromVectorOf<int64_t>({1, -1, 3}, {3})); });
  EXPECT_NE(err.find("target -1"), std::string::npos) << err;
  err = ErrorOf([&] { CrossEntropy(logits, FromVectorOf<int64_t>({1, 2}, {2})); });
  EXPECT_NE(err.find("target of shape [2] does not match logits [3, 10]"), std::string::npos) << err;
  err = ErrorOf([&] { CrossEntropy(Zeros({3}), FromVectorOf<int64_t>({1}, {1})); });
  EXPECT_NE(err.find("expected logits [N, C]"), std::string::npos) << err;
}

// label_smoothing outside [0, 1] is refused, NaN included. Before, NaN
// passed the check (x < 0 || x > 1) and made every loss NaN.
TEST(CrossEntropyTest, LabelSmoothingOutsideZeroToOneIsRefused) {
  const Tensor logits = Zeros({2, 3});
  const Tensor target = FromVectorOf<int64_t>({0, 2}, {2});
  EXPECT_EQ(ErrorOf([&] { CrossEntropy(logits, target, {.label_smoothing = std::nan("")}); }),
            "cross_entropy: label_smoothing must be in [0, 1], got nan");
  EXPECT_EQ(ErrorOf([&] { CrossEntropy(logits, target, {.label_smoothing = 1.5}); }),
            "cross_entropy: label_smoothing must be in [0, 1], got 1.500000");
  EXPECT_EQ(ErrorOf([&] { CrossEntropy(logits, target, {.label_smoothing = 1.0}); }), "");
}

TEST(CrossEntropyTest, SixteenBitLogitsComputeInF32) {
  Tensor logits = FromVector({1, 2, 3, 1, 0, -1}, {2, 3}, {.dtype = DType::kBFloat16, .requires_grad = true});
  Tensor loss = CrossEntropy(logits, FromVectorOf<int64_t>({2, 0}, {2}));
  EXPECT_EQ(loss.dtype(), DType::kFloat32);
  Backward(loss);
  EXPECT_EQ(logits.grad().dtype(), DType::kBFloat16);
}

// Log-probabilities [4, 3] (any values: NLL does not normalize), targets
// {0, 1, 2, ignored}, weights {2, 0.5, 1}: per-sample 2 * 0.5, 0.5 * 0.25,
// 1 * 1.2 and 0; the mean divides by the kept weights 2 + 0.5 + 1.
Tensor NllInput() {
  return FromVector({-0.5, -1.0, -2.0, -1.5, -0.25, -3.0, -0.1, -2.5, -1.2, -0.7, -0.8, -0.9}, {4, 3},
                    {.dtype = DType::kFloat64});
}

TEST(NllLossTest, WeightedAndIgnoredMatchTheHandComputedValues) {
  const Tensor lp = NllInput();
  const Tensor target = FromVectorOf<int64_t>({0, 1, 2, -100}, {4});
  const Tensor w = FromVector({2.0, 0.5, 1.0}, {3}, {.dtype = DType::kFloat64});
  EXPECT_EQ(NllLoss(lp, target, {.reduction = Reduction::kNone, .weight = w}).ToVector<double>(),
            (std::vector<double>{1.0, 0.125, 1.2, 0.0}));
  EXPECT_NEAR(NllLoss(lp, target, {.reduction = Reduction::kSum, .weight = w}).Item(), 2.325, 1e-15);
  EXPECT_NEAR(NllLoss(lp, target, {.weight = w}).Item(), 2.325 / 3.5, 1e-15);
  // Without weights the mean counts the kept samples.
  EXPECT_NEAR(NllLoss(lp, target).Item(), (0.5 + 0.25 + 1.2) / 3, 1e-15);
  // ignore_index may be a class: sample 3's class 1 is then left out too,
  // and its weight with it.
  const Tensor t1 = FromVectorOf<int64_t>({0, 1, 2, 1}, {4});
  EXPECT_NEAR(NllLoss(lp, t1, {.weight = w, .ignore_index = 1}).Item(), (1.0 + 1.2) / 3.0, 1e-15);
  // The module wrapper; i32 targets are converted.
  EXPECT_NEAR(NLLLoss({.weight = w})(lp, FromVectorOf<int32_t>({0, 1, 2, -100}, {4})).Item(), 2.325 / 3.5, 1e-15);
}

// No classes at all ([2, 0]): a target that is not ignore_index is out of
// range, as in PyTorch (before, no target was checked and the loss was
// whatever memory held); ignored ones give a loss of 0 each.
TEST(NllLossTest, NoClassesRefusesEveryTargetButIgnoredOnes) {
  const Tensor lp = Empty({2, 0}, {.dtype = DType::kFloat64});
  try {
    NllLoss(lp, FromVectorOf<int64_t>({0, 0}, {2}), {.reduction = Reduction::kNone});
    ADD_FAILURE() << "a target of 0 classes was accepted";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("target 0 (sample 0) is out of range for 0 classes"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(NllLoss(Empty({2, 0, 3}, {.dtype = DType::kFloat64}), FromVectorOf<int64_t>({0, 0, 0, 0, 0, 0}, {2, 3})),
               std::out_of_range);
  const Tensor ignored = FromVectorOf<int64_t>({-100, -100}, {2});
  EXPECT_EQ(NllLoss(lp, ignored, {.reduction = Reduction::kNone}).ToVector<double>(), (std::vector<double>{0.0, 0.0}));
  EXPECT_EQ(NllLoss(lp, ignored, {.reduction = Reduction::kSum}).Item(), 0.0);
}

// PyTorch's mean over nothing kept is 0 / 0 = NaN; the sum is 0 and the
// gradient zeros.
TEST(NllLossTest, EveryTargetIgnoredGivesNaNMean) {
  Tensor lp = NllInput();
  lp.set_requires_grad(true);
  const Tensor target = FromVectorOf<int64_t>({-100, -100, -100, -100}, {4});
  const Tensor w = FromVector({2.0, 0.5, 1.0}, {3}, {.dtype = DType::kFloat64});
  Tensor mean = NllLoss(lp, target, {.weight = w});
  EXPECT_TRUE(std::isnan(mean.Item()));
  EXPECT_TRUE(std::isnan(NllLoss(lp, target).Item()));
  EXPECT_EQ(NllLoss(lp, target, {.reduction = Reduction::kSum}).Item(), 0.0);
  Backward(mean);
  EXPECT_EQ(lp.grad().ToVector<double>(), std::vector<double>(12, 0.0));
}

// [N, C, d] input, [N, d] target: lp[n, c, s] = -(6n + 2c + s + 1) / 10,
// targets {{2, 0}, {1, ignored}}, weights {1, 2, 3}: 3 * 0.5, 1 * 0.2,
// 2 * 0.9, 0; the mean divides by 3 + 1 + 2.
TEST(NllLossTest, SpatialTargets) {
  std::vector<double> v;
  for (int n = 0; n < 2; ++n) {
    for (int c = 0; c < 3; ++c) {
      for (int s = 0; s < 2; ++s) v.push_back(-(6 * n + 2 * c + s + 1) / 10.0);
    }
  }
  const Tensor lp = FromVector(v, {2, 3, 2}, {.dtype = DType::kFloat64});
  const Tensor target = FromVectorOf<int64_t>({2, 0, 1, -100}, {2, 2});
  const Tensor w = FromVector({1.0, 2.0, 3.0}, {3}, {.dtype = DType::kFloat64});
  const Tensor none = NllLoss(lp, target, {.reduction = Reduction::kNone, .weight = w});
  ASSERT_EQ(none.shape(), (Shape{2, 2}));
  const std::vector<double> got = none.ToVector<double>(), want = {1.5, 0.2, 1.8, 0.0};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-15) << i;
  EXPECT_NEAR(NllLoss(lp, target, {.weight = w}).Item(), 3.5 / 6.0, 1e-15);
  std::string err = ErrorOf([&] { NllLoss(lp, FromVectorOf<int64_t>({2, 0, 3, 1}, {2, 2})); });
  EXPECT_EQ(err, "nll_loss: target 3 (sample 1, position 0) is out of range for 3 classes [0, 2]");
}

TEST(NllLossTest, Gradients) {
  const Tensor w = FromVector({0.3, 2.0, 1.0, 0.5, 1.5}, {5}, {.dtype = DType::kFloat64});
  const Tensor target = FromVectorOf<int64_t>({2, -100, 4, 1}, {4});
  const Tensor target3 = FromVectorOf<int64_t>({2, 0, 4, -100, 1, 3}, {2, 3});
  for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    for (const Tensor& weight : {Tensor(), w}) {
      EXPECT_TRUE(GradCheck([&](const V& in) { return NllLoss(in[0], target, {.reduction = r, .weight = weight}); },
                            {RandomLeaf({4, 5}, 4)}));
      EXPECT_TRUE(GradCheck([&](const V& in) { return NllLoss(in[0], target3, {.reduction = r, .weight = weight}); },
                            {RandomLeaf({2, 5, 3}, 5)}));
    }
  }
  // The closed form: d mean / d lp[i, t_i] = -w[t_i] / (sum of kept weights).
  Tensor lp = RandomLeaf({4, 5}, 6);
  Backward(NllLoss(lp, target, {.weight = w}));
  const std::vector<double> g = lp.grad().ToVector<double>();
  const double kept = 1.0 + 1.5 + 2.0;
  EXPECT_NEAR(g[0 * 5 + 2], -1.0 / kept, 1e-15);
  EXPECT_NEAR(g[2 * 5 + 4], -1.5 / kept, 1e-15);
  EXPECT_NEAR(g[3 * 5 + 1], -2.0 / kept, 1e-15);
  for (int k = 0; k < 5; ++k) EXPECT_EQ(g[1 * 5 + k], 0.0) << k;  // the ignored sample
}

TEST(NllLossTest, BadInputsAreNamed) {
  const Tensor lp = Zeros({3, 4});
  const Tensor target = FromVectorOf<int64_t>({1, 0, 3}, {3});
  EXPECT_EQ(ErrorOf([&] { NllLoss(lp, FromVectorOf<int64_t>({1, 4, 3}, {3})); }),
            "nll_loss: target 4 (sample 1) is out of range for 4 classes [0, 3]");
  EXPECT_EQ(ErrorOf([&] { NllLoss(lp, FromVectorOf<int64_t>({1, 0, -1}, {3})); }),
            "nll_loss: target -1 (sample 2) is out of range for 4 classes [0, 3]");
  EXPECT_EQ(ErrorOf([&] { NllLoss(lp, target, {.weight = Ones({3})}); }),
            "nll_loss: weight of shape [3] does not match 4 classes (expected [4])");
  EXPECT_EQ(ErrorOf([&] { NllLoss(lp, target, {.weight = Ones({1, 4})}); }),
            "nll_loss: weight of shape [1, 4] does not match 4 classes (expected [4])");
  EXPECT_EQ(ErrorOf([&] { NllLoss(lp, target, {.weight = FromVectorOf<int64_t>({1, 1, 1, 1}, {4})}); }),
            "nll_loss: weight must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { NllLoss(lp, FromVector({1, 0, 3}, {3})); }),
            "nll_loss: target must hold class indices (i64, i32 or u8), got f32");
  EXPECT_EQ(ErrorOf([&] { NllLoss(lp, FromVectorOf<int64_t>({1, 0}, {2})); }),
            "nll_loss: target of shape [2] does not match log-probabilities [3, 4] (expected [3])");
  EXPECT_EQ(ErrorOf([&] { NllLoss(Zeros({4}), FromVectorOf<int64_t>({1}, {1})); }),
            "nll_loss: expected log-probabilities [N, C] or [N, C, d1, ...], got [4]");
  EXPECT_EQ(ErrorOf([&] { NllLoss(FromVectorOf<int64_t>({0, 0}, {1, 2}), FromVectorOf<int64_t>({1}, {1})); }),
            "nll_loss: log-probabilities must be floating, got i64");
  Tensor trainable = Ones({4});
  trainable.set_requires_grad(true);
  EXPECT_EQ(ErrorOf([&] { NllLoss(lp, target, {.weight = trainable}); }),
            "nll_loss: weight requires grad, but no gradient flows to class weights (detach it)");
  EXPECT_EQ(ErrorOf([&] { NllLoss(lp, target, {.weight = trainable.Detach()}); }), "");
}

TEST(NllLossTest, SixteenBitInputComputesInF32) {
  Tensor lp = FromVector({-1, -2, -0.5, -3}, {2, 2}, {.dtype = DType::kBFloat16, .requires_grad = true});
  Tensor loss = NllLoss(lp, FromVectorOf<int64_t>({1, 0}, {2}));
  EXPECT_EQ(loss.dtype(), DType::kFloat32);
  EXPECT_EQ(loss.Item(), 1.25);
  Backward(loss);
  EXPECT_EQ(lp.grad().dtype(), DType::kBFloat16);
  EXPECT_EQ(lp.grad().ToVector<double>(), (std::vector<double>{0, -0.5, -0.5, 0}));
}

// Cross-entropy with class weights: sample i weighs weight[t_i]; with label
// smoothing the uniform part weighs each class by its weight; the mean
// divides by the kept samples' weights (PyTorch's formula).
TEST(CrossEntropyTest, ClassWeightsMatchTheFormula) {
  const Tensor logits = FromVector({1, 2, 3, 1, 0, -1, 0.5, 0.5, -2}, {3, 3}, {.dtype = DType::kFloat64});
  const Tensor target = FromVectorOf<int64_t>({2, 0, -100}, {3});
  const std::vector<double> w = {0.5, 1.0, 2.0};
  const Tensor weight = FromVector(w, {3}, {.dtype = DType::kFloat64});
  // -log_softmax of the first two rows.
  std::vector<std::vector<double>> nl(2);
  const double x[2][3] = {{1, 2, 3}, {1, 0, -1}};
  for (int i = 0; i < 2; ++i) {
    const double lse = std::log(std::exp(x[i][0]) + std::exp(x[i][1]) + std::exp(x[i][2]));
    for (int k = 0; k < 3; ++k) nl[i].push_back(lse - x[i][k]);
  }
  const double kept = w[2] + w[0];
  EXPECT_NEAR(CrossEntropy(logits, target, {.weight = weight}).Item(), (w[2] * nl[0][2] + w[0] * nl[1][0]) / kept,
              1e-12);
  const double eps = 0.3;
  double per[2];
  for (int i = 0; i < 2; ++i) {
    const int t = i == 0 ? 2 : 0;
    double uniform = 0;
    for (int k = 0; k < 3; ++k) uniform += w[k] * nl[i][k];
    per[i] = (1 - eps) * w[t] * nl[i][t] + eps / 3 * uniform;
  }
  const Tensor none = CrossEntropy(logits, target, {.reduction = Reduction::kNone, .label_smoothing = eps, .weight = weight});
  const std::vector<double> got = none.ToVector<double>();
  ASSERT_EQ(got.size(), 3u);
  EXPECT_NEAR(got[0], per[0], 1e-12);
  EXPECT_NEAR(got[1], per[1], 1e-12);
  EXPECT_EQ(got[2], 0.0);
  EXPECT_NEAR(CrossEntropy(logits, target, {.reduction = Reduction::kSum, .label_smoothing = eps, .weight = weight}).Item(),
              per[0] + per[1], 1e-12);
  EXPECT_NEAR(CrossEntropy(logits, target, {.label_smoothing = eps, .weight = weight}).Item(),
              (per[0] + per[1]) / kept, 1e-12);
  // All-ones weights give the unweighted loss, through the other path.
  const Tensor ones = Ones({3}, {.dtype = DType::kFloat64});
  for (double s : {0.0, 0.2}) {
    for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      const std::vector<double> a =
          CrossEntropy(logits, target, {.reduction = r, .label_smoothing = s, .weight = ones}).ToVector<double>();
      const std::vector<double> b = CrossEntropy(logits, target, {.reduction = r, .label_smoothing = s}).ToVector<double>();
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-12) << i;
    }
  }
}

// With class weights and label smoothing, an ignored row's uniform term is
// left out by selection, not by multiplying with 0: a row of logits holding
// -inf (log-probability -inf) that is ignored does not turn the loss into
// inf * 0 = NaN. The loss is the kept row's alone, as PyTorch's.
TEST(CrossEntropyTest, WeightedSmoothingIgnoredRowWithInfiniteLogitStaysFinite) {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::kFloat64, DType::kFloat32}) {
    Tensor logits = FromVector({1, 2, 3, -inf, 0, 0}, {2, 3}, {.dtype = dt, .requires_grad = true});
    const Tensor target = FromVectorOf<int64_t>({2, -100}, {2});
    const Tensor weight = Ones({3}, {.dtype = dt});
    const double eps = 0.1;
    // Row 0 by hand: (1 - eps) * -lp[2] + eps / 3 * -sum_k lp[k].
    const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
    const double row0 = (1 - eps) * (lse - 3) + eps / 3 * ((lse - 1) + (lse - 2) + (lse - 3));
    const double tol = dt == DType::kFloat64 ? 1e-12 : 1e-5;
    const std::vector<double> none =
        CrossEntropy(logits, target, {.reduction = Reduction::kNone, .label_smoothing = eps, .weight = weight})
            .ToVector<double>();
    ASSERT_EQ(none.size(), 2u);
    EXPECT_NEAR(none[0], row0, tol);
    EXPECT_EQ(none[1], 0.0);
    EXPECT_NEAR(
        CrossEntropy(logits, target, {.reduction = Reduction::kSum, .label_smoothing = eps, .weight = weight}).Item(),
        row0, tol);
    Tensor mean = CrossEntropy(logits, target, {.label_smoothing = eps, .weight = weight});
    EXPECT_NEAR(mean.Item(), row0, tol) << DTypeName(dt);
    Backward(mean);
    const std::vector<double> g = logits.grad().ToVector<double>();
    ASSERT_EQ(g.size(), 6u);
    for (int k = 0; k < 3; ++k) {
      const double p = std::exp(k + 1 - lse);
      const double smoothed = (k == 2 ? 1 - eps : 0.0) + eps / 3;
      EXPECT_NEAR(g[k], p - smoothed, tol) << k;
      EXPECT_EQ(g[3 + k], 0.0) << k;
    }
  }
}

// Every target ignored with kMean: the loss is 0 / 0 = NaN (as PyTorch), but
// the gradient is 0 everywhere. Before, the backward multiplied the 1/0 = inf
// scale by the 0 mask of the ignored rows and NaN reached logits.grad.
TEST(CrossEntropyTest, WeightedSmoothingEveryTargetIgnoredGivesZeroGradient) {
  for (double eps : {0.0, 0.1, 1.0}) {
    Tensor logits = FromVector({1, 2, 3, 0.5, 0, -1}, {2, 3}, {.dtype = DType::kFloat64, .requires_grad = true});
    const Tensor target = FromVectorOf<int64_t>({-100, -100}, {2});
    const Tensor weight = FromVector({0.5, 1.0, 2.0}, {3}, {.dtype = DType::kFloat64});
    Tensor mean = CrossEntropy(logits, target, {.label_smoothing = eps, .weight = weight});
    EXPECT_TRUE(std::isnan(mean.Item())) << eps;
    EXPECT_EQ(CrossEntropy(logits, target, {.reduction = Reduction::kSum, .label_smoothing = eps, .weight = weight})
                  .Item(),
              0.0);
    Backward(mean);
    EXPECT_EQ(logits.grad().ToVector<double>(), std::vector<double>(6, 0.0)) << eps;
  }
}

TEST(CrossEntropyTest, ClassWeightGradientsAndErrors) {
  const Tensor w = FromVector({0.3, 2.0, 1.0, 0.5, 1.5}, {5}, {.dtype = DType::kFloat64});
  const Tensor target = FromVectorOf<int64_t>({2, -100, 4, 1}, {4});
  for (double smoothing : {0.0, 0.1}) {
    for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      EXPECT_TRUE(GradCheck([&](const V& in) {
        return CrossEntropy(in[0], target, {.reduction = r, .label_smoothing = smoothing, .weight = w});
      }, {RandomLeaf({4, 5}, 7)}));
    }
  }
  const Tensor logits = Zeros({3, 4});
  const Tensor t = FromVectorOf<int64_t>({1, 0, 3}, {3});
  EXPECT_EQ(ErrorOf([&] { CrossEntropy(logits, t, {.weight = Ones({5})}); }),
            "cross_entropy: weight of shape [5] does not match 4 classes (expected [4])");
  EXPECT_EQ(ErrorOf([&] { CrossEntropy(logits, FromVectorOf<int64_t>({1, 7, 3}, {3}), {.weight = Ones({4})}); }),
            "cross_entropy: target 7 (sample 1) is out of range for 4 classes [0, 3]");
  // bf16 logits with f32 weights: the loss in f32, the gradient in bf16.
  Tensor l16 = FromVector({1, 2, 3, 1, 0, -1}, {2, 3}, {.dtype = DType::kBFloat16, .requires_grad = true});
  Tensor loss = CrossEntropy(l16, FromVectorOf<int64_t>({2, 0}, {2}), {.weight = Ones({3})});
  EXPECT_EQ(loss.dtype(), DType::kFloat32);
  Backward(loss);
  EXPECT_EQ(l16.grad().dtype(), DType::kBFloat16);
}

// A device whose table has no NLL kernels (as nn/cuda's had before it gained
// them): NllLoss, and cross-entropy with weights, fail naming the op and the
// device. Simulated in a child process with host memory as cuda:0 and the CPU
// kernels as its table, less the NLL entries.
TEST(NllLossTest, DeviceWithoutNllKernelIsNamed) {
  EXPECT_EXIT(
      {
        nn::testing::RegisterHostAsCuda();
        ops::KernelTable table = ops::KernelsFor(DeviceType::kCPU);
        table.nll_loss_forward = nullptr;
        table.nll_loss_backward = nullptr;
        ops::RegisterKernels(DeviceType::kCUDA, table);
        const Device cuda(DeviceType::kCUDA, 0);
        const Tensor lp = Zeros({2, 3}).To(cuda);
        const Tensor target = FromVectorOf<int64_t>({0, 2}, {2}).To(cuda);
        std::fprintf(stderr, "nll: [%s]\n", ErrorOf([&] { NllLoss(lp, target); }).c_str());
        std::fprintf(stderr, "ce: [%s]\n",
                     ErrorOf([&] { CrossEntropy(lp, target, {.weight = Ones({3}).To(cuda)}); }).c_str());
        std::fprintf(stderr, "plain ce: [%s]\n", ErrorOf([&] { CrossEntropy(lp, target); }).c_str());
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      "nll: \\[op `nll_loss_forward` has no kernel for device cuda:0[^]]*\\]\n"
      "ce: \\[op `nll_loss_forward` has no kernel for device cuda:0[^]]*\\]\n"
      "plain ce: \\[\\]");
}

TEST(MseTest, ValueGradientAndShapeCheck) {
  Tensor a = FromVector({1, 2, 3}, {3}, {.dtype = DType::kFloat64});
  Tensor b = FromVector({1, 0, 0}, {3}, {.dtype = DType::kFloat64});
  EXPECT_NEAR(MseLoss(a, b).Item(), 13.0 / 3, 1e-12);
  EXPECT_NEAR(MseLoss(a, b, Reduction::kSum).Item(), 13.0, 1e-12);
  EXPECT_TRUE(GradCheck([](const V& in) { return MseLoss(in[0], in[1]); }, {RandomLeaf({3, 4}, 1), RandomLeaf({3, 4}, 2)}));
  EXPECT_NE(ErrorOf([] { MseLoss(Zeros({3}), Zeros({4})); }).find("differ in shape"), std::string::npos);
}

// Integer operands are refused naming mse_loss and the dtype, not by the
// Sub or Square inside it.
TEST(MseTest, IntegerOperandsAreNamed) {
  const Tensor i = Ones({3}, {.dtype = DType::kInt64});
  EXPECT_EQ(ErrorOf([&] { MseLoss(i, Ones({3})); }), "mse_loss: input must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { MseLoss(Ones({3}), i); }), "mse_loss: target must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { CrossEntropy(Zeros({2, 3}, {.dtype = DType::kInt32}), FromVectorOf<int64_t>({0, 1}, {2})); }),
            "cross_entropy: logits must be floating, got i32");
}

// As PyTorch: the mean over no elements is NaN (the sum is 0), and a 16-bit
// mean is finite where the 16-bit sum is not (100000 * 4 > f16's 65504).
TEST(MseTest, EmptyIsNaNAndSixteenBitMeanDoesNotOverflow) {
  EXPECT_TRUE(std::isnan(MseLoss(Zeros({0}), Zeros({0})).Item()));
  EXPECT_TRUE(std::isnan(MseLoss(Zeros({0, 3}), Zeros({0, 3})).Item()));
  EXPECT_EQ(MseLoss(Zeros({0}), Zeros({0}), Reduction::kSum).Item(), 0.0);
  const Tensor x = Zeros({100000}, {.dtype = DType::kFloat16});
  const Tensor y = Full({100000}, 2.0, {.dtype = DType::kFloat16});
  const Tensor loss = MseLoss(x, y);
  EXPECT_EQ(loss.dtype(), DType::kFloat16);
  EXPECT_EQ(loss.Item(), 4.0);
}

}  // namespace
}  // namespace ddp::nn::loss
