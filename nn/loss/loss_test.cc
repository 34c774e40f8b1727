#include "nn/loss/loss.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

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

// Logits of 1e4 in f32 with label smoothing (0.9 on the target, 0.05 on
// each other class): the gradient is softmax - smoothed target to f32's
// precision near 0.5. The log-softmax underneath rounded max + log(sum) at
// 1e4's magnitude and gave 0.233280 where 0.233333 is due.
TEST(CrossEntropyTest, LargeLogitsKeepTheGradientsPrecision) {
  Tensor logits = FromVector({0, 1e4, 1e4}, {1, 3}).set_requires_grad(true);
  const Tensor loss = CrossEntropy(logits, FromVectorOf<int64_t>({1}, {1}), {.label_smoothing = 0.1});
  EXPECT_NEAR(loss.Item(), 0.9 * std::log(2.0) + 0.1 / 3 * (1e4 + 3 * std::log(2.0)), 1e-2);
  Backward(loss);
  const std::vector<float> g = logits.grad().ToVector<float>();
  EXPECT_NEAR(g[0], 0.0 - 0.1 / 3, 1e-6);
  EXPECT_NEAR(g[1], 0.5 - (0.9 + 0.1 / 3), 1e-6);
  EXPECT_NEAR(g[2], 0.5 - 0.1 / 3, 1e-6);
}

TEST(CrossEntropyTest, BadInputsAreNamed) {
  Tensor logits = Zeros({3, 10});
  std::string err = ErrorOf([&] { CrossEntropy(logits, FromVectorOf<int64_t>({1, 12, 3}, {3})); });
  EXPECT_NE(err.find("target 12 (sample 1) is out of range for 10 classes"), std::string::npos) << err;
  err = ErrorOf([&] { CrossEntropy(logits, FromVectorOf<int64_t>({1, -1, 3}, {3})); });
  EXPECT_NE(err.find("target -1"), std::string::npos) << err;
  err = ErrorOf([&] { CrossEntropy(logits, FromVectorOf<int64_t>({1, 2}, {2})); });
  EXPECT_NE(err.find("target of shape [2] does not match logits [3, 10]"), std::string::npos) << err;
  err = ErrorOf([&] { CrossEntropy(Zeros(Shape{}), FromVectorOf<int64_t>({1}, {1})); });
  EXPECT_EQ(err, "cross_entropy: expected logits [C], [N, C] or [N, C, d1, ...], got []");
}

// --- cross-entropy on [N, C, d1, ...], probability targets, unbatched [C] ---

// A naive f64 cross-entropy, PyTorch's definition written out: logits
// [N, C, S] row-major (S = d1 * ... , 1 for [N, C]), and either class
// indices [N, S] or probabilities [N, C, S]; weights [C] (empty: all ones).
struct CeReference {
  std::vector<double> per;  // [N, S]
  double sum = 0, mean = 0;
};

CeReference ReferenceCrossEntropy(const std::vector<double>& x, int64_t n, int64_t c, int64_t s,
                                  const std::vector<int64_t>* index, const std::vector<double>* prob,
                                  const std::vector<double>& w, double eps, int64_t ignore_index) {
  CeReference ref;
  double divisor = 0;
  const auto weight = [&](int64_t k) { return w.empty() ? 1.0 : w[static_cast<size_t>(k)]; };
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < s; ++j) {
      const auto at = [&](int64_t k) { return static_cast<size_t>((i * c + k) * s + j); };
      double top = -std::numeric_limits<double>::infinity();
      for (int64_t k = 0; k < c; ++k) top = std::max(top, x[at(k)]);
      double z = 0;
      for (int64_t k = 0; k < c; ++k) z += std::exp(x[at(k)] - top);
      std::vector<double> lp(static_cast<size_t>(c));
      for (int64_t k = 0; k < c; ++k) lp[k] = x[at(k)] - top - std::log(z);
      double loss = 0;
      if (index != nullptr) {
        const int64_t t = (*index)[static_cast<size_t>(i * s + j)];
        if (t != ignore_index) {
          double uniform = 0;
          for (int64_t k = 0; k < c; ++k) uniform -= weight(k) * lp[k];
          loss = (1 - eps) * -weight(t) * lp[t] + eps / c * uniform;
          divisor += weight(t);
        }
      } else {
        for (int64_t k = 0; k < c; ++k) loss -= weight(k) * ((1 - eps) * (*prob)[at(k)] + eps / c) * lp[k];
        divisor += 1;
      }
      ref.per.push_back(loss);
      ref.sum += loss;
    }
  }
  ref.mean = ref.sum / divisor;
  return ref;
}

// Runs the three reductions and compares them with the reference.
void ExpectCrossEntropy(const Tensor& logits, const Tensor& target, const CeReference& ref, const Shape& per_shape,
                        CrossEntropyOptions options, double tol = 1e-12) {
  options.reduction = Reduction::kNone;
  const Tensor none = CrossEntropy(logits, target, options);
  ASSERT_EQ(none.shape(), per_shape);
  const std::vector<double> got = none.ToVector<double>();
  ASSERT_EQ(got.size(), ref.per.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], ref.per[i], tol) << "element " << i;
  options.reduction = Reduction::kSum;
  EXPECT_NEAR(CrossEntropy(logits, target, options).Item(), ref.sum, tol);
  options.reduction = Reduction::kMean;
  const Tensor mean = CrossEntropy(logits, target, options);
  EXPECT_EQ(mean.shape(), Shape{});
  EXPECT_NEAR(mean.Item(), ref.mean, tol);
}

// Every shape's per-element target shape: the logits' less dim 1.
Shape WithoutClassDim(Shape shape) {
  shape.erase(shape.begin() + 1);
  return shape;
}

// Class indices on [N, C, d1, ...] (segmentation): per-element losses of
// the target's shape, weights, label smoothing and ignored elements, and
// kMean over the kept elements' weights, against the naive loop.
TEST(CrossEntropyTest, SpatialClassIndicesMatchANaiveLoop) {
  const std::vector<double> w = {0.5, 2.0, 1.0, 1.5};
  for (const Shape& shape : {Shape{2, 4, 3}, Shape{2, 4, 2, 3}, Shape{3, 4, 1}, Shape{1, 4, 2, 1, 2}}) {
    const int64_t n = shape[0], c = shape[1];
    const int64_t s = Zeros(shape).numel() / (n * c);
    const std::vector<double> x = ops::MulScalar(RandomLeaf(shape, 41, false), 3.0).ToVector<double>();
    // Every class and some ignored elements (the value c stands for them).
    std::vector<int64_t> t(static_cast<size_t>(n * s));
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int64_t>((i * 3 + 1) % (c + 1));
    for (int64_t& v : t) v = v == c ? -100 : v;
    const Tensor logits = FromVector(x, shape, {.dtype = DType::kFloat64});
    const Tensor target = FromVectorOf<int64_t>(t, WithoutClassDim(shape));
    for (const std::vector<double>& weight : {std::vector<double>{}, w}) {
      for (double eps : {0.0, 0.2}) {
        SCOPED_TRACE(ShapeToString(shape) + (weight.empty() ? " unweighted" : " weighted") + " eps " +
                     std::to_string(eps));
        const Tensor wt = weight.empty() ? Tensor() : FromVector(weight, {c}, {.dtype = DType::kFloat64});
        ExpectCrossEntropy(logits, target, ReferenceCrossEntropy(x, n, c, s, &t, nullptr, weight, eps, -100),
                           WithoutClassDim(shape), {.label_smoothing = eps, .weight = wt});
        // u8 labels, as segmentation masks are stored, with ignore_index 255.
        std::vector<uint8_t> t8;
        for (int64_t v : t) t8.push_back(static_cast<uint8_t>(v == -100 ? 255 : v));
        ExpectCrossEntropy(logits, FromVectorOf<uint8_t>(t8, WithoutClassDim(shape)),
                           ReferenceCrossEntropy(x, n, c, s, &t, nullptr, weight, eps, -100), WithoutClassDim(shape),
                           {.label_smoothing = eps, .ignore_index = 255, .weight = wt});
      }
    }
  }
}

// Probability ("soft label") targets of the logits' shape, [N, C] and
// [N, C, d1, ...]: weights scale each class's term, label smoothing mixes in
// the uniform distribution, kMean divides by the element count whatever the
// weights, and no element is ignored (ignore_index keeps its default -100).
TEST(CrossEntropyTest, ProbabilityTargetsMatchANaiveLoop) {
  const std::vector<double> w = {0.5, 2.0, 1.0};
  for (const Shape& shape : {Shape{4, 3}, Shape{2, 3, 4}, Shape{2, 3, 2, 2}}) {
    const int64_t n = shape[0], c = shape[1];
    const int64_t s = Zeros(shape).numel() / (n * c);
    const std::vector<double> x = ops::MulScalar(RandomLeaf(shape, 42, false), 3.0).ToVector<double>();
    // Distributions over dim 1 (one of them one-hot), and unnormalized
    // values, which PyTorch accepts as well.
    const std::vector<double> p = ops::Softmax(ops::MulScalar(RandomLeaf(shape, 43, false), 2.0), 1).ToVector<double>();
    std::vector<double> one_hot(p.size(), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < s; ++j) one_hot[static_cast<size_t>((i * c + (i + j) % c) * s + j)] = 1.0;
    }
    const std::vector<double> raw = RandomLeaf(shape, 44, false).ToVector<double>();
    const Tensor logits = FromVector(x, shape, {.dtype = DType::kFloat64});
    for (const std::vector<double>* q : std::vector<const std::vector<double>*>{&p, &one_hot, &raw}) {
      for (const std::vector<double>& weight : {std::vector<double>{}, w}) {
        for (double eps : {0.0, 0.3}) {
          SCOPED_TRACE(ShapeToString(shape) + (weight.empty() ? " unweighted" : " weighted") + " eps " +
                       std::to_string(eps) + (q == &p ? " softmax" : q == &one_hot ? " one-hot" : " raw"));
          const Tensor wt = weight.empty() ? Tensor() : FromVector(weight, {c}, {.dtype = DType::kFloat64});
          ExpectCrossEntropy(logits, FromVector(*q, shape, {.dtype = DType::kFloat64}),
                             ReferenceCrossEntropy(x, n, c, s, nullptr, q, weight, eps, -100), WithoutClassDim(shape),
                             {.label_smoothing = eps, .weight = wt});
        }
      }
    }
  }
}

// A class index to ignore means nothing to a probability target, so one
// set (>= 0) is refused, naming ignore_index, as PyTorch refuses it: soft
// labels with padding masked by ignore_index would otherwise train on the
// padding. Negative values (the default -100) are the "none" setting.
TEST(CrossEntropyTest, ProbabilityTargetsRefuseAnIgnoreIndex) {
  const Tensor logits = RandomLeaf({2, 3}, 61, false);
  const Tensor probs = ops::Softmax(RandomLeaf({2, 3}, 62, false), 1);
  for (int64_t ignore : {0, 2, 7}) {
    EXPECT_EQ(ErrorOf([&] { CrossEntropy(logits, probs, {.ignore_index = ignore}); }),
              "cross_entropy: ignore_index " + std::to_string(ignore) +
                  " is not supported with class-probability (floating) targets; leave it negative (the default "
                  "-100) or give class indices")
        << ignore;
  }
  // Unbatched [C] and spatial [N, C, d] probabilities are refused too.
  EXPECT_NE(ErrorOf([&] { CrossEntropy(logits.View({6}), probs.View({6}), {.ignore_index = 1}); }).find("ignore_index 1"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { CrossEntropy(logits.View({1, 3, 2}), probs.View({1, 3, 2}), {.ignore_index = 0}); })
                .find("ignore_index 0"),
            std::string::npos);
  // The default, and any other negative value, is accepted.
  EXPECT_TRUE(std::isfinite(CrossEntropy(logits, probs).Item()));
  EXPECT_EQ(CrossEntropy(logits, probs, {.ignore_index = -1}).Item(), CrossEntropy(logits, probs).Item());
  // Class indices keep ignore_index >= 0.
  EXPECT_NEAR(CrossEntropy(logits, FromVectorOf<int64_t>({0, 1}, {2}), {.ignore_index = 0}).Item(),
              CrossEntropy(logits.Slice(0, 1, 2), FromVectorOf<int64_t>({1}, {1})).Item(), 1e-6);
}

// Unbatched logits [C]: a 0-d class index or a [C] probability target, and
// a 0-d loss for every reduction, equal to the batch of one's.
TEST(CrossEntropyTest, UnbatchedLogitsAreABatchOfOne) {
  const Tensor logits = FromVector({0.3, -1.2, 2.0, 0.7}, {4}, {.dtype = DType::kFloat64});
  const Tensor probs = FromVector({0.1, 0.2, 0.3, 0.4}, {4}, {.dtype = DType::kFloat64});
  const Tensor weight = FromVector({1.0, 0.5, 2.0, 1.5}, {4}, {.dtype = DType::kFloat64});
  for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    for (double eps : {0.0, 0.1}) {
      const CrossEntropyOptions o = {.reduction = r, .label_smoothing = eps, .weight = weight};
      const Tensor index = CrossEntropy(logits, FromVectorOf<int64_t>({2}, Shape{}), o);
      EXPECT_EQ(index.shape(), Shape{});
      const Tensor batched = CrossEntropy(logits.View({1, 4}), FromVectorOf<int64_t>({2}, {1}), o);
      EXPECT_NEAR(index.Item(), batched.ToVector<double>()[0], 1e-15);
      const Tensor soft = CrossEntropy(logits, probs, o);
      EXPECT_EQ(soft.shape(), Shape{});
      EXPECT_NEAR(soft.Item(), CrossEntropy(logits.View({1, 4}), probs.View({1, 4}), o).ToVector<double>()[0], 1e-15);
    }
  }
  // An ignored 0-d target: no loss, a NaN mean, as PyTorch.
  EXPECT_EQ(CrossEntropy(logits, FromVectorOf<int64_t>({-100}, Shape{}), {.reduction = Reduction::kNone}).Item(), 0.0);
  EXPECT_TRUE(std::isnan(CrossEntropy(logits, FromVectorOf<int64_t>({-100}, Shape{})).Item()));
}

TEST(CrossEntropyTest, SpatialProbabilityAndUnbatchedGradients) {
  const Tensor w = FromVector({0.3, 2.0, 1.0, 0.5}, {4}, {.dtype = DType::kFloat64});
  const Tensor target = FromVectorOf<int64_t>({2, 0, -100, 1, 3, 3, 0, -100, 1, 2, 2, 0}, {2, 2, 3});
  const Tensor none_ignored = FromVectorOf<int64_t>({2, 0, 1, 3, 0, 1}, {2, 3});
  for (double eps : {0.0, 0.1}) {
    for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      for (const Tensor& weight : {Tensor(), w}) {
        SCOPED_TRACE("eps " + std::to_string(eps) + (weight.defined() ? " weighted" : ""));
        const CrossEntropyOptions o = {.reduction = r, .label_smoothing = eps, .weight = weight};
        EXPECT_TRUE(
            GradCheck([&](const V& in) { return CrossEntropy(in[0], target, o); }, {RandomLeaf({2, 4, 2, 3}, 51)}));
        EXPECT_TRUE(GradCheck([&](const V& in) { return CrossEntropy(in[0], none_ignored, o); },
                              {RandomLeaf({2, 4, 3}, 52)}));
        // Probabilities: the gradient reaches the logits and the target.
        EXPECT_TRUE(GradCheck([&](const V& in) { return CrossEntropy(in[0], in[1], o); },
                              {RandomLeaf({3, 4}, 53), RandomLeaf({3, 4}, 54)}));
        EXPECT_TRUE(GradCheck([&](const V& in) { return CrossEntropy(in[0], in[1], o); },
                              {RandomLeaf({2, 4, 3}, 55), RandomLeaf({2, 4, 3}, 56)}));
        EXPECT_TRUE(GradCheck([&](const V& in) { return CrossEntropy(in[0], in[1], o); },
                              {RandomLeaf({4}, 57), RandomLeaf({4}, 58)}));
        EXPECT_TRUE(GradCheck([&](const V& in) { return CrossEntropy(in[0], FromVectorOf<int64_t>({1}, Shape{}), o); },
                              {RandomLeaf({4}, 59)}));
      }
    }
  }
}

// [N, C, d] with label smoothing: an ignored element whose logits hold -inf
// contributes 0, not inf * 0 = NaN, and gets a zero gradient, as on [N, C];
// every element ignored gives a NaN mean and a zero gradient.
TEST(CrossEntropyTest, SpatialSmoothingIgnoredElementWithInfiniteLogitStaysFinite) {
  const double inf = std::numeric_limits<double>::infinity();
  // [1, 3, 2]: position 0 has logits {1, 2, 3} (target 2), position 1 {-inf, 0, 0} (ignored).
  for (const Tensor& weight : {Tensor(), FromVector({0.5, 1.0, 2.0}, {3}, {.dtype = DType::kFloat64})}) {
    Tensor logits = FromVector({1, -inf, 2, 0, 3, 0}, {1, 3, 2}, {.dtype = DType::kFloat64, .requires_grad = true});
    const Tensor target = FromVectorOf<int64_t>({2, -100}, {1, 2});
    const std::vector<double> wv = weight.defined() ? weight.ToVector<double>() : std::vector<double>{};
    const std::vector<int64_t> kept_target = {2};
    const CeReference ref = ReferenceCrossEntropy({1, 2, 3}, 1, 3, 1, &kept_target, nullptr, wv, 0.1, -100);
    const std::vector<double> none =
        CrossEntropy(logits, target, {.reduction = Reduction::kNone, .label_smoothing = 0.1, .weight = weight})
            .ToVector<double>();
    ASSERT_EQ(none.size(), 2u);
    EXPECT_NEAR(none[0], ref.per[0], 1e-12);
    EXPECT_EQ(none[1], 0.0);
    Tensor mean = CrossEntropy(logits, target, {.label_smoothing = 0.1, .weight = weight});
    EXPECT_NEAR(mean.Item(), ref.mean, 1e-12);
    Backward(mean);
    const std::vector<double> g = logits.grad().ToVector<double>();
    for (int k = 0; k < 3; ++k) {
      EXPECT_TRUE(std::isfinite(g[2 * k])) << k;
      EXPECT_EQ(g[2 * k + 1], 0.0) << k;
    }
    logits.set_grad(Tensor());
    Tensor all_ignored = CrossEntropy(logits, FromVectorOf<int64_t>({-100, -100}, {1, 2}),
                                      {.label_smoothing = 0.1, .weight = weight});
    EXPECT_TRUE(std::isnan(all_ignored.Item()));
    Backward(all_ignored);
    EXPECT_EQ(logits.grad().ToVector<double>(), std::vector<double>(6, 0.0));
  }
}

TEST(CrossEntropyTest, SpatialAndProbabilitySixteenBitLogitsComputeInF32) {
  for (bool probabilities : {false, true}) {
    Tensor logits =
        FromVector({1, 2, 3, 1, 0, -1, 0.5, 0.25}, {1, 4, 2}, {.dtype = DType::kBFloat16, .requires_grad = true});
    const Tensor target = probabilities ? Full({1, 4, 2}, 0.25, {.dtype = DType::kBFloat16})
                                        : FromVectorOf<int64_t>({3, 0}, {1, 2});
    const Tensor loss = CrossEntropy(logits, target, {.label_smoothing = 0.1});
    EXPECT_EQ(loss.dtype(), DType::kFloat32) << probabilities;
    const std::vector<double> x = logits.Detach().ToVector<double>();
    const std::vector<int64_t> t = {3, 0};
    const std::vector<double> q(8, 0.25);
    EXPECT_NEAR(loss.Item(),
                ReferenceCrossEntropy(x, 1, 4, 2, probabilities ? nullptr : &t, probabilities ? &q : nullptr, {}, 0.1,
                                      -100)
                    .mean,
                1e-6)
        << probabilities;
    Backward(loss);
    EXPECT_EQ(logits.grad().dtype(), DType::kBFloat16) << probabilities;
  }
}

// A target that fits neither kind is refused naming both shapes (and which
// kind it was taken for); an out-of-range class names its position.
TEST(CrossEntropyTest, SpatialAndProbabilityBadInputsAreNamed) {
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Zeros({2, 3, 4}), FromVectorOf<int64_t>({0, 0, 0, 0, 0, 0}, {2, 3})); }),
            "cross_entropy: target of shape [2, 3] does not match logits [2, 3, 4] (expected [2, 4] for class "
            "indices, or [2, 3, 4] floating for probabilities)");
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Zeros({3}), FromVectorOf<int64_t>({1}, {1})); }),
            "cross_entropy: target of shape [1] does not match logits [3] (expected [] for class indices, or [3] "
            "floating for probabilities)");
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Zeros({2, 3}), Zeros({2, 4})); }),
            "cross_entropy: floating target of shape [2, 4] does not match logits [2, 3] (a floating target holds "
            "class probabilities, of the logits' shape; class indices [2] must be i64, i32 or u8)");
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Zeros({2, 3}), Zeros({2})); }),
            "cross_entropy: floating target of shape [2] does not match logits [2, 3] (a floating target holds "
            "class probabilities, of the logits' shape; class indices [2] must be i64, i32 or u8)");
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Zeros({2, 3, 5}), Zeros({2, 3, 5}, {.dtype = DType::kInt64})); }),
            "cross_entropy: target of shape [2, 3, 5] is i64, but a target of the logits' shape holds class "
            "probabilities and must be floating (class indices have shape [2, 5])");
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Zeros({2, 3}), Zeros({2, 3}), {.weight = Ones({4})}); }),
            "cross_entropy: weight of shape [4] does not match 3 classes (expected [3])");
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Zeros({2, 3}), Zeros({2, 3}), {.label_smoothing = 2.0}); }),
            "cross_entropy: label_smoothing must be in [0, 1], got 2");
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Zeros({2, 3}), Tensor()); }), "cross_entropy: target is undefined");
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Tensor(), Zeros({2, 3})); }), "cross_entropy: logits are undefined");
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Zeros({2, 3, 2}), FromVectorOf<int64_t>({0, 1, 3, 0}, {2, 2})); }),
            "cross_entropy: target 3 (sample 1, position 0) is out of range for 3 classes [0, 2]");
  EXPECT_EQ(ErrorOf([] {
              CrossEntropy(Zeros({2, 3, 2, 3}), FromVectorOf<int64_t>({0, 1, 2, 0, 1, 2, 0, 1, 2, 2, -1, 0}, {2, 2, 3}),
                           {.label_smoothing = 0.1});
            }),
            "cross_entropy: target -1 (sample 1, position [1, 1]) is out of range for 3 classes [0, 2]");
  EXPECT_EQ(ErrorOf([] { CrossEntropy(Zeros({3}), FromVectorOf<int64_t>({3}, Shape{})); }),
            "cross_entropy: target 3 (sample 0) is out of range for 3 classes [0, 2]");
}

// label_smoothing outside [0, 1] is refused, NaN included. Before, NaN
// passed the check (x < 0 || x > 1) and made every loss NaN.
TEST(CrossEntropyTest, LabelSmoothingOutsideZeroToOneIsRefused) {
  const Tensor logits = Zeros({2, 3});
  const Tensor target = FromVectorOf<int64_t>({0, 2}, {2});
  EXPECT_EQ(ErrorOf([&] { CrossEntropy(logits, target, {.label_smoothing = std::nan("")}); }),
            "cross_entropy: label_smoothing must be in [0, 1], got nan");
  EXPECT_EQ(ErrorOf([&] { CrossEntropy(logits, target, {.label_smoothing = 1.5}); }),
            "cross_entropy: label_smoothing must be in [0, 1], got 1.5");
  EXPECT_EQ(ErrorOf([&] { CrossEntropy(logits, target, {.label_smoothing = 1.0}); }), "");
  // Every digit that tells the value apart: with six decimals this one read
  // "got 1.000000", a value in range.
  EXPECT_EQ(ErrorOf([&] { CrossEntropy(logits, target, {.label_smoothing = 1.0000001}); }),
            "cross_entropy: label_smoothing must be in [0, 1], got 1.0000001");
}

TEST(CrossEntropyTest, SixteenBitLogitsComputeInF32) {
  Tensor logits = FromVector({1, 2, 3, 1, 0, -1}, {2, 3}, {.dtype = DType::kBFloat16, .requires_grad = true});
  Tensor loss = CrossEntropy(logits, FromVectorOf<int64_t>({2, 0}, {2}));
  EXPECT_EQ(loss.dtype(), DType::kFloat32);
  Backward(loss);
  EXPECT_EQ(logits.grad().dtype(), DType::kBFloat16);
}

// A -0 gradient reaching the kMean loss keeps its sign through the 1 / N
// scale, as PyTorch's x * s: the logits' gradient is -0 * (softmax - onehot),
// -0 off the target and +0 on it, the zero signs kSum (no scale) gives.
// Before, the scale added +0.0 and turned the incoming -0 into +0.
TEST(CrossEntropyTest, MeanScalingKeepsTheSignOfAZeroGradient) {
  const Tensor target = FromVectorOf<int64_t>({2, 0}, {2});
  for (Reduction r : {Reduction::kMean, Reduction::kSum}) {
    Tensor logits = FromVector({1, 2, 3, 1, 0, -1}, {2, 3}, {.dtype = DType::kFloat64, .requires_grad = true});
    Backward(ops::MulScalar(CrossEntropy(logits, target, {.reduction = r}), -0.0));
    const std::vector<double> g = logits.grad().ToVector<double>();
    ASSERT_EQ(g.size(), 6u);
    for (int i = 0; i < 6; ++i) {
      const bool on_target = i == 2 || i == 3;
      EXPECT_EQ(g[i], 0.0) << i;
      EXPECT_EQ(std::signbit(g[i]), !on_target) << "element " << i << (r == Reduction::kMean ? " kMean" : " kSum");
    }
  }
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

// As for cross-entropy: kMean's 1 / (kept weight) keeps a -0 incoming
// gradient -0, so the gradient at each target is -w * -0 = +0, as kSum
// gives. Before, the scale made it +0 and the gradient -0.
TEST(NllLossTest, MeanScalingKeepsTheSignOfAZeroGradient) {
  const Tensor target = FromVectorOf<int64_t>({0, 1, 0}, {3});
  for (Reduction r : {Reduction::kMean, Reduction::kSum}) {
    Tensor lp = FromVector({-0.5, -1.0, -2.0, -0.25, -0.1, -3.0}, {3, 2},
                           {.dtype = DType::kFloat64, .requires_grad = true});
    Backward(ops::MulScalar(NllLoss(lp, target, {.reduction = r}), -0.0));
    const std::vector<double> g = lp.grad().ToVector<double>();
    ASSERT_EQ(g.size(), 6u);
    for (int i : {0, 3, 4}) {
      EXPECT_EQ(g[i], 0.0) << i;
      EXPECT_FALSE(std::signbit(g[i])) << "element " << i << (r == Reduction::kMean ? " kMean" : " kSum");
    }
  }
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

// Unbatched log-probabilities [C] with a 0-d class index, as torch's
// NLLLoss accepts: -weight[t] lp[t], a 0-d loss for every reduction, and
// the gradient back in [C]. An ignored target gives 0 (kNone, kSum) or
// NaN (kMean), as a batch of one.
TEST(NllLossTest, UnbatchedInputIsABatchOfOne) {
  const Tensor w = FromVector({1.0, 0.5, 2.0}, {3}, {.dtype = DType::kFloat64});
  for (const Tensor& weight : {Tensor(), w}) {
    for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      SCOPED_TRACE(std::string(weight.defined() ? "weighted " : "") + std::to_string(static_cast<int>(r)));
      Tensor x = FromVector({0.3, -1.2, 2.0}, {3}, {.dtype = DType::kFloat64, .requires_grad = true});
      const Tensor lp = ops::LogSoftmax(x, 0);
      const std::vector<double> lpv = lp.ToVector<double>();
      const NllLossOptions o = {.reduction = r, .weight = weight};
      const Tensor loss = NllLoss(lp, FromVectorOf<int64_t>({2}, Shape{}), o);
      EXPECT_EQ(loss.shape(), Shape{});
      // kMean divides by weight[2]: the unweighted value again.
      const double scale = weight.defined() && r != Reduction::kMean ? 2.0 : 1.0;
      EXPECT_NEAR(loss.Item(), -scale * lpv[2], 1e-15);
      EXPECT_TRUE(GradCheck([&](const V& in) { return NllLoss(in[0], FromVectorOf<int64_t>({1}, Shape{}), o); },
                            {RandomLeaf({3}, 71)}));
    }
  }
  const Tensor lp = ops::LogSoftmax(FromVector({0.3, -1.2, 2.0}, {3}), 0);
  EXPECT_EQ(NllLoss(lp, FromVectorOf<int64_t>({-100}, Shape{}), {.reduction = Reduction::kSum}).Item(), 0.0);
  EXPECT_TRUE(std::isnan(NllLoss(lp, FromVectorOf<int64_t>({-100}, Shape{})).Item()));
  // u8 class indices are converted, as for batches.
  EXPECT_EQ(NllLoss(lp, FromVectorOf<uint8_t>({0}, Shape{})).Item(), -lp.ToVector<double>()[0]);
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
            "nll_loss: target of shape [1] does not match unbatched log-probabilities [4] (expected a 0-d class "
            "index)");
  EXPECT_EQ(ErrorOf([&] { NllLoss(Zeros(Shape{}), FromVectorOf<int64_t>({1}, Shape{})); }),
            "nll_loss: expected log-probabilities [C], [N, C] or [N, C, d1, ...], got []");
  EXPECT_EQ(ErrorOf([&] { NllLoss(Zeros({4}), FromVectorOf<int64_t>({4}, Shape{})); }),
            "nll_loss: target 4 (sample 0) is out of range for 4 classes [0, 3]");
  EXPECT_EQ(ErrorOf([&] { NllLoss(FromVectorOf<int64_t>({0, 0}, {1, 2}), FromVectorOf<int64_t>({1}, {1})); }),
            "nll_loss: log-probabilities must be floating, got i64");
  // Named here, as cross_entropy does; before, Tensor's "shape on an undefined tensor" named no op.
  EXPECT_EQ(ErrorOf([&] { NllLoss(Tensor(), target); }), "nll_loss: log-probabilities are undefined");
  EXPECT_EQ(ErrorOf([&] { NllLoss(lp, Tensor()); }), "nll_loss: target is undefined");
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

// Class weights changed in place between forward and backward are reported,
// as PyTorch reports it, for NLL and for weighted cross-entropy. Before, the
// backward read the new weights and divided by the old sum of the kept ones
// (here -3 / 3.5 where the forward's gradient is -w[t] / 3.5).
TEST(NllLossTest, WeightChangedInPlaceBeforeBackwardIsReported) {
  const Tensor target = FromVectorOf<int64_t>({2, 1, 0}, {3});
  for (bool cross_entropy : {false, true}) {
    Tensor input = FromVector({-1, -2, -3, -0.5, -1, -2, -2, -2, -2}, {3, 3},
                              {.dtype = DType::kFloat64, .requires_grad = true});
    Tensor w = FromVector({0.5, 1.0, 2.0}, {3}, {.dtype = DType::kFloat64});
    Tensor loss = cross_entropy ? CrossEntropy(input, target, {.weight = w}) : NllLoss(input, target, {.weight = w});
    w.Fill(3.0);
    const std::string err = ErrorOf([&] { Backward(loss); });
    EXPECT_NE(err.find("NllLossBackward"), std::string::npos) << cross_entropy << ": " << err;
    EXPECT_NE(err.find("modified in place"), std::string::npos) << cross_entropy << ": " << err;
    EXPECT_FALSE(input.grad().defined()) << cross_entropy;
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

// An undefined operand is refused naming mse_loss, rather than read for
// its dtype.
TEST(MseTest, UndefinedOperandsAreNamed) {
  EXPECT_EQ(ErrorOf([] { MseLoss(Tensor(), Zeros({2})); }), "mse_loss: input is undefined");
  EXPECT_EQ(ErrorOf([] { MseLoss(Zeros({2}), Tensor()); }), "mse_loss: target is undefined");
}

// Operands on two devices are refused naming mse_loss and both devices
// (host memory registered as cuda:0 in a child process).
TEST(MseTest, OperandsOnTwoDevicesAreNamed) {
  EXPECT_EXIT(
      {
        nn::testing::RegisterHostAsCuda();
        ops::RegisterKernels(DeviceType::kCUDA, ops::KernelsFor(DeviceType::kCPU));
        const Device cuda(DeviceType::kCUDA, 0);
        std::fprintf(stderr, "mse: [%s]\n", ErrorOf([&] { MseLoss(Zeros({2}), Zeros({2}).To(cuda)); }).c_str());
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      "mse: \\[mse_loss: input is on cpu, target on cuda:0 \\(expected one device\\)\\]");
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

// --- pointwise losses against PyTorch ---
// Expected values from PyTorch 2 in f64:
//   import torch, torch.nn.functional as F
//   d = torch.float64
//   x = torch.tensor([[0.5, -1.2, 3.0], [0.0, 2.5, -0.7]], dtype=d)
//   y = torch.tensor([[1.0, -1.0, 0.5], [0.0, -0.5, -2.0]], dtype=d)
//   F.l1_loss(x, y, reduction="none"); F.l1_loss(x, y); F.l1_loss(x, y, reduction="sum")
//   F.smooth_l1_loss(x, y, reduction="none", beta=b); F.smooth_l1_loss(x, y, beta=b)    # b in 1, 0.5, 0
//   F.huber_loss(x, y, reduction="none", delta=dl); F.huber_loss(x, y, reduction="sum", delta=dl)  # dl in 1, 0.5, 2
Tensor RegressionInput() { return FromVector({0.5, -1.2, 3.0, 0.0, 2.5, -0.7}, {2, 3}, {.dtype = DType::kFloat64}); }
Tensor RegressionTarget() { return FromVector({1.0, -1.0, 0.5, 0.0, -0.5, -2.0}, {2, 3}, {.dtype = DType::kFloat64}); }

void ExpectValues(const Tensor& got, const Shape& shape, const std::vector<double>& want, double tol = 1e-12) {
  ASSERT_EQ(got.shape(), shape);
  const std::vector<double> g = got.ToVector<double>();
  ASSERT_EQ(g.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(g[i], want[i], tol) << "element " << i;
}

TEST(L1Test, MatchesPyTorch) {
  const Tensor x = RegressionInput(), y = RegressionTarget();
  ExpectValues(L1(x, y, Reduction::kNone), {2, 3}, {0.5, 0.19999999999999996, 2.5, 0.0, 3.0, 1.3});
  ExpectValues(L1(x, y), {}, {1.25});
  ExpectValues(L1(x, y, Reduction::kSum), {}, {7.5});
  ExpectValues(L1Loss(Reduction::kSum)(x, y), {}, {7.5});
}

TEST(SmoothL1Test, MatchesPyTorch) {
  const Tensor x = RegressionInput(), y = RegressionTarget();
  ExpectValues(SmoothL1(x, y, {.reduction = Reduction::kNone}), {2, 3},
               {0.125, 0.01999999999999999, 2.0, 0.0, 2.5, 0.8});
  ExpectValues(SmoothL1(x, y), {}, {0.9075000000000001});
  ExpectValues(SmoothL1(x, y, {.reduction = Reduction::kNone, .beta = 0.5}), {2, 3},
               {0.25, 0.03999999999999998, 2.25, 0.0, 2.75, 1.05});
  ExpectValues(SmoothL1(x, y, {.beta = 0.5}), {}, {1.0566666666666666});
  // beta == 0 is L1.
  ExpectValues(SmoothL1(x, y, {.reduction = Reduction::kNone, .beta = 0.0}), {2, 3},
               {0.5, 0.19999999999999996, 2.5, 0.0, 3.0, 1.3});
  ExpectValues(SmoothL1Loss({.beta = 0.0})(x, y), {}, {1.25});
}

TEST(HuberTest, MatchesPyTorch) {
  const Tensor x = RegressionInput(), y = RegressionTarget();
  ExpectValues(Huber(x, y, {.reduction = Reduction::kNone}), {2, 3},
               {0.125, 0.01999999999999999, 2.0, 0.0, 2.5, 0.8});
  ExpectValues(Huber(x, y, {.reduction = Reduction::kSum}), {}, {5.445});
  ExpectValues(Huber(x, y, {.reduction = Reduction::kNone, .delta = 0.5}), {2, 3},
               {0.125, 0.01999999999999999, 1.125, 0.0, 1.375, 0.525});
  ExpectValues(Huber(x, y, {.reduction = Reduction::kSum, .delta = 0.5}), {}, {3.17});
  ExpectValues(Huber(x, y, {.reduction = Reduction::kNone, .delta = 2.0}), {2, 3},
               {0.125, 0.01999999999999999, 3.0, 0.0, 4.0, 0.8450000000000001});
  ExpectValues(HuberLoss({.reduction = Reduction::kSum, .delta = 2.0})(x, y), {}, {7.989999999999999});
}

// Below the threshold the quadratic part is PyTorch's bit for bit (the
// split into min and excess leaves z itself there), in f32 too.
TEST(HuberTest, QuadraticPartIsExactBelowTheThreshold) {
  const Tensor x = FromVector({1e-4, 0.3, -0.999}, {3});
  const Tensor y = Zeros({3});
  const std::vector<double> huber = Huber(x, y, {.reduction = Reduction::kNone}).ToVector<double>();
  const std::vector<double> smooth = SmoothL1(x, y, {.reduction = Reduction::kNone, .beta = 2.0}).ToVector<double>();
  const std::vector<double> xs = x.ToVector<double>();
  for (size_t i = 0; i < xs.size(); ++i) {
    const float z = std::abs(static_cast<float>(xs[i]));
    EXPECT_EQ(huber[i], static_cast<double>(0.5f * z * z)) << i;
    EXPECT_EQ(smooth[i], static_cast<double>(0.5f * z * z / 2.0f)) << i;
  }
}

// delta = +inf never reaches the linear part: 0.5 z^2 everywhere with
// gradient d = input - target, as PyTorch
//   F.huber_loss(torch.tensor([1., -2.]), torch.zeros(2), reduction="none", delta=float("inf"))  # [0.5, 2.0]
// Before, the linear term was 0 * inf = NaN for every element.
TEST(HuberTest, InfiniteDeltaIsQuadraticEverywhere) {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    SCOPED_TRACE(std::string(DTypeName(dt)));
    const Tensor big = FromVector({1e30}, {1}, {.dtype = dt});
    // f32 overflows to inf, as PyTorch's z * z.
    EXPECT_EQ(Huber(big, Zeros({1}, {.dtype = dt}), {.delta = inf}).Item(), dt == DType::kFloat32 ? inf : 0.5 * (1e30 * 1e30));
    Tensor x = FromVector({1, -2}, {2}, {.dtype = dt, .requires_grad = true});
    const Tensor y = Zeros({2}, {.dtype = dt});
    EXPECT_EQ(Huber(x, y, {.reduction = Reduction::kNone, .delta = inf}).ToVector<double>(),
              (std::vector<double>{0.5, 2.0}));
    const Tensor sum = Huber(x, y, {.reduction = Reduction::kSum, .delta = inf});
    EXPECT_EQ(sum.Item(), 2.5);
    Backward(sum);
    EXPECT_EQ(x.grad().ToVector<double>(), (std::vector<double>{1.0, -2.0}));
  }
  // Smooth L1 with beta = +inf: 0.5 z^2 / inf = 0, as PyTorch.
  EXPECT_EQ(SmoothL1(FromVector({1, -2}, {2}), Zeros({2}), {.reduction = Reduction::kSum, .beta = inf}).Item(), 0.0);
}

// An infinite |input - target| gives an infinite loss and the linear part's
// slope as gradient, as PyTorch 1.13 (f32 and f64 alike):
//   x = torch.tensor([inf, -inf, 1.0, 3.0], requires_grad=True)
//   t = torch.tensor([0.0, 0.0, 0.0, inf], requires_grad=True)
//   F.smooth_l1_loss(x, t, reduction="none", beta=b)
//     # [inf, inf, 0.5 (b = 1) or 0.75 (b = 0.5), inf]; x.grad [1, -1, 1, -1], t.grad [-1, 1, -1, 1]
//   F.huber_loss(x, t, reduction="none", delta=2.0)  # [inf, inf, 0.5, inf]; x.grad [2, -2, 1, -2]
//   F.smooth_l1_loss(x, t)  # mean: inf; x.grad [0.25, -0.25, 0.25, -0.25]
// Before, min(z, limit) was z - relu(z - limit) = inf - inf: NaN loss and gradient.
TEST(PointwiseLossTest, InfiniteDifferenceGivesInfiniteLossAndFiniteGradient) {
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&, const Tensor&, Reduction)> loss;
    double quadratic;  // the loss at |x - t| = 1
    double slope;      // the gradient's magnitude beyond the threshold
  };
  const std::vector<Case> cases = {
      {"smooth_l1 beta 1", [](const Tensor& x, const Tensor& t, Reduction r) {
         return SmoothL1(x, t, {.reduction = r, .beta = 1.0});
       }, 0.5, 1.0},
      {"smooth_l1 beta 0.5", [](const Tensor& x, const Tensor& t, Reduction r) {
         return SmoothL1(x, t, {.reduction = r, .beta = 0.5});
       }, 0.75, 1.0},
      {"huber delta 1", [](const Tensor& x, const Tensor& t, Reduction r) {
         return Huber(x, t, {.reduction = r, .delta = 1.0});
       }, 0.5, 1.0},
      {"huber delta 2", [](const Tensor& x, const Tensor& t, Reduction r) {
         return Huber(x, t, {.reduction = r, .delta = 2.0});
       }, 0.5, 2.0},
  };
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " " + std::string(DTypeName(dt)));
      // The slope applies to every element but the third: |x - t| = 1 has
      // gradient 1 in each case (the boundary or beyond it for slope 1, the
      // quadratic's z for delta 2).
      const double s = c.slope, g2 = 1.0;
      Tensor x = FromVector({inf, -inf, 1.0, 3.0}, {4}, {.dtype = dt, .requires_grad = true});
      Tensor t = FromVector({0.0, 0.0, 0.0, inf}, {4}, {.dtype = dt, .requires_grad = true});
      const Tensor per = c.loss(x, t, Reduction::kNone);
      EXPECT_EQ(per.ToVector<double>(), (std::vector<double>{inf, inf, c.quadratic, inf}));
      Backward(ops::Sum(per));
      EXPECT_EQ(x.grad().ToVector<double>(), (std::vector<double>{s, -s, g2, -s}));
      EXPECT_EQ(t.grad().ToVector<double>(), (std::vector<double>{-s, s, -g2, s}));
      x.set_grad(Tensor());
      t.set_grad(Tensor());
      const Tensor mean = c.loss(x, t, Reduction::kMean);
      EXPECT_EQ(mean.ToVector<double>(), (std::vector<double>{inf}));
      Backward(mean);
      EXPECT_EQ(x.grad().ToVector<double>(), (std::vector<double>{s / 4, -s / 4, g2 / 4, -s / 4}));
    }
  }
}

// A NaN difference gives a NaN gradient, as PyTorch 1.13 (f32, f64, bf16;
// f16 for huber_loss, whose smooth_l1 backward has no f16 CPU kernel there):
//   x = torch.tensor([nan, 0.5, -3.0, inf, 0.25, -0.75], requires_grad=True)
//   t = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.5], requires_grad=True)
//   F.smooth_l1_loss(x, t, reduction="sum").backward()
//     # x.grad [nan, 0.5, -1, 1, -0.75, 0.75], t.grad its negation
//   F.smooth_l1_loss(x, t, beta=0.5).backward()  # x.grad [nan, 1, -1, 1, -1, 1] / 6
//   F.huber_loss(x, t, delta=2.0, reduction="sum").backward()
//     # x.grad [nan, 0.5, -2, 2, -0.75, 0.75], t.grad its negation
// A zero gradient there would let a NaN sample pass the non-finite checks
// of gradient scaling.
TEST(PointwiseLossTest, NaNDifferenceGivesNaNGradient) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&, const Tensor&)> loss;
    std::vector<double> grad;  // of x; t's is its negation
    double tol;
  };
  const std::vector<Case> cases = {
      {"smooth_l1 beta 1 sum", [](const Tensor& x, const Tensor& t) {
         return SmoothL1(x, t, {.reduction = Reduction::kSum});
       }, {nan, 0.5, -1.0, 1.0, -0.75, 0.75}, 0.0},
      {"smooth_l1 beta 0.5 mean", [](const Tensor& x, const Tensor& t) {
         return SmoothL1(x, t, {.beta = 0.5});
       }, {nan, 1.0 / 6, -1.0 / 6, 1.0 / 6, -1.0 / 6, 1.0 / 6}, 1e-3},
      {"huber delta 2 sum", [](const Tensor& x, const Tensor& t) {
         return Huber(x, t, {.reduction = Reduction::kSum, .delta = 2.0});
       }, {nan, 0.5, -2.0, 2.0, -0.75, 0.75}, 0.0},
  };
  for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " " + std::string(DTypeName(dt)));
      Tensor x = FromVector({nan, 0.5, -3.0, inf, 0.25, -0.75}, {6}, {.dtype = dt, .requires_grad = true});
      Tensor t = FromVector({0.0, 0.0, 0.0, 0.0, 1.0, -1.5}, {6}, {.dtype = dt, .requires_grad = true});
      const Tensor loss = c.loss(x, t);
      EXPECT_TRUE(std::isnan(loss.Item()));
      Backward(loss);
      ASSERT_EQ(x.grad().dtype(), dt);
      const std::vector<double> gx = x.grad().ToVector<double>(), gt = t.grad().ToVector<double>();
      ASSERT_EQ(gx.size(), c.grad.size());
      ASSERT_EQ(gt.size(), c.grad.size());
      EXPECT_TRUE(std::isnan(gx[0])) << gx[0];
      EXPECT_TRUE(std::isnan(gt[0])) << gt[0];
      for (size_t i = 1; i < c.grad.size(); ++i) {
        EXPECT_NEAR(gx[i], c.grad[i], c.tol) << "x element " << i;
        EXPECT_NEAR(gt[i], -c.grad[i], c.tol) << "t element " << i;
      }
    }
  }
}

TEST(PointwiseLossTest, GradientsToInputAndTarget) {
  for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    const V in = {RandomLeaf({3, 4}, 11), RandomLeaf({3, 4}, 12)};
    EXPECT_TRUE(GradCheck([&](const V& t) { return L1(t[0], t[1], r); }, in));
    for (double beta : {1.0, 0.3}) {
      EXPECT_TRUE(GradCheck([&](const V& t) { return SmoothL1(t[0], t[1], {.reduction = r, .beta = beta}); }, in));
      EXPECT_TRUE(GradCheck([&](const V& t) { return Huber(t[0], t[1], {.reduction = r, .delta = beta}); }, in));
    }
  }
}

// Expected values from PyTorch 2 in f64:
//   xi = torch.tensor([[0.3, -1.5, 2.0], [100.0, -100.0, 0.0]], dtype=d)
//   yi = torch.tensor([[1.0, 0.0, 0.25], [0.0, 1.0, 1.0]], dtype=d)
//   w = torch.tensor([0.5, 1.0, 2.0], dtype=d); pw = torch.tensor([1.0, 3.0, 0.5], dtype=d)
//   F.binary_cross_entropy_with_logits(xi, yi, reduction="none"); F.binary_cross_entropy_with_logits(xi, yi)
//   F.binary_cross_entropy_with_logits(xi, yi, weight=w, pos_weight=pw, reduction="none")  # and "sum"
TEST(BceWithLogitsTest, MatchesPyTorch) {
  const Tensor x = FromVector({0.3, -1.5, 2.0, 100.0, -100.0, 0.0}, {2, 3}, {.dtype = DType::kFloat64});
  const Tensor y = FromVector({1.0, 0.0, 0.25, 0.0, 1.0, 1.0}, {2, 3}, {.dtype = DType::kFloat64});
  ExpectValues(BinaryCrossEntropyWithLogits(x, y, {.reduction = Reduction::kNone}), {2, 3},
               {0.554355244468527, 0.20141327798275246, 1.6269280110429727, 100.0, 100.0, 0.6931471805599453});
  ExpectValues(BinaryCrossEntropyWithLogits(x, y), {}, {33.84597395234237});
  const Tensor w = FromVector({0.5, 1.0, 2.0}, {3}, {.dtype = DType::kFloat64});
  const Tensor pw = FromVector({1.0, 3.0, 0.5}, {3}, {.dtype = DType::kFloat64});
  ExpectValues(BinaryCrossEntropyWithLogits(x, y, {.reduction = Reduction::kNone, .weight = w, .pos_weight = pw}),
               {2, 3}, {0.2771776222342635, 0.20141327798275244, 3.222124019325202, 50.0, 300.0, 0.6931471805599453});
  ExpectValues(BCEWithLogitsLoss({.reduction = Reduction::kSum, .weight = w, .pos_weight = pw})(x, y), {},
               {354.3938621001021});
  // A weight [2, 1] broadcasts over the columns.
  const Tensor w_rows = FromVector({2.0, 0.0}, {2, 1}, {.dtype = DType::kFloat64});
  ExpectValues(BinaryCrossEntropyWithLogits(x, y, {.reduction = Reduction::kNone, .weight = w_rows}), {2, 3},
               {2 * 0.554355244468527, 2 * 0.20141327798275246, 2 * 1.6269280110429727, 0.0, 0.0, 0.0});
}

// |x| = 100 in f32: exp(100) would overflow and log(sigmoid(-100)) underflow
// to log(0); the stable form gives PyTorch's values and gradients.
//   x32 = torch.tensor([100.0, -100.0, 100.0, -100.0, 0.0]); y32 = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
//   F.binary_cross_entropy_with_logits(x32, y32, reduction="none")  # [0, 100, 100, 0, 0.6931471824645996]
//   xg = torch.tensor([0.0, 0.0, 100.0, -100.0], requires_grad=True); yg = torch.tensor([1.0, 0.0, 0.0, 1.0])
//   F.binary_cross_entropy_with_logits(xg, yg, reduction="sum").backward()  # xg.grad: [-0.5, 0.5, 1, -1]
TEST(BceWithLogitsTest, LargeLogitsStayFiniteInF32) {
  const Tensor x = FromVector({100.0, -100.0, 100.0, -100.0, 0.0}, {5});
  const Tensor y = FromVector({1.0, 1.0, 0.0, 0.0, 1.0}, {5});
  const Tensor loss = BinaryCrossEntropyWithLogits(x, y, {.reduction = Reduction::kNone});
  EXPECT_EQ(loss.dtype(), DType::kFloat32);
  ExpectValues(loss, {5}, {0.0, 100.0, 100.0, 0.0, 0.6931471824645996}, 1e-6);
  for (double v : loss.ToVector<double>()) EXPECT_TRUE(std::isfinite(v)) << v;
  // The gradient sigmoid(x) - y, at x = 0 too (where |x| has no derivative).
  Tensor xg = FromVector({0.0, 0.0, 100.0, -100.0}, {4});
  xg.set_requires_grad(true);
  Backward(BinaryCrossEntropyWithLogits(xg, FromVector({1.0, 0.0, 0.0, 1.0}, {4}), {.reduction = Reduction::kSum}));
  ExpectValues(xg.grad(), {4}, {-0.5, 0.5, 1.0, -1.0}, 1e-7);
}

// Large logits with target 1: the loss is softplus(-x) = log1p(exp(-x)),
// about exp(-x), which log(1 + exp(-x)) loses (0 in f32 from x = 17, a
// relative error of 3e-8 at x = 20 and 1e-3 at x = 30 in f64). Expected
// values from PyTorch 1.13's log-sigmoid, which PyTorch's BCE equals here:
//   x = torch.tensor([20.0, 30.0, 16.0], dtype=d, requires_grad=True); l = -F.logsigmoid(x)
//   # f32: [2.06115369216775e-09, 9.357622912219837e-14, 1.1253516873921399e-07]
//   # f64: [2.061153620314381e-09, 9.357622968839737e-14, 1.1253516838717682e-07]
//   l.sum().backward()  # x.grad = -sigmoid(-x)
//   # f32: [-2.06115369216775e-09, -9.357622912219837e-14, -1.1253516163378663e-07]
//   # f64: [-2.0611536181902033e-09, -9.3576229688393e-14, -1.12535162055095e-07]
// (PyTorch 1.13's binary_cross_entropy_with_logits itself still computes
// log(1 + exp): it gives [0, 0, 1.1920928e-07] in f32.)
TEST(BceWithLogitsTest, LargeLogitsKeepTheTinyLossLog1pGives) {
  struct Case {
    DType dtype;
    double rtol;
    std::vector<double> loss, grad;
  };
  const std::vector<Case> cases = {
      {DType::kFloat32, 1e-6, {2.06115369216775e-09, 9.357622912219837e-14, 1.1253516873921399e-07},
       {-2.06115369216775e-09, -9.357622912219837e-14, -1.1253516163378663e-07}},
      {DType::kFloat64, 1e-13, {2.061153620314381e-09, 9.357622968839737e-14, 1.1253516838717682e-07},
       {-2.0611536181902033e-09, -9.3576229688393e-14, -1.12535162055095e-07}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(DTypeName(c.dtype)));
    Tensor x = FromVector({20.0, 30.0, 16.0}, {3}, {.dtype = c.dtype, .requires_grad = true});
    const Tensor y = Ones({3}, {.dtype = c.dtype});
    const Tensor loss = BinaryCrossEntropyWithLogits(x, y, {.reduction = Reduction::kNone});
    const std::vector<double> got = loss.ToVector<double>();
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], c.loss[i], c.rtol * c.loss[i]) << "element " << i;
    Backward(ops::Sum(loss));
    const std::vector<double> grad = x.grad().ToVector<double>();
    for (size_t i = 0; i < grad.size(); ++i) {
      EXPECT_NEAR(grad[i], c.grad[i], c.rtol * std::abs(c.grad[i])) << "element " << i;
    }
  }
}

TEST(BceWithLogitsTest, Gradients) {
  const Tensor w = FromVector({0.5, 1.0, 2.0, 1.5}, {4}, {.dtype = DType::kFloat64});
  const Tensor pw = FromVector({1.0, 3.0, 0.5, 2.0}, {4}, {.dtype = DType::kFloat64});
  for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    // Targets in [0, 1) (soft labels); gradients flow to them too, as in PyTorch.
    Tensor target = ops::MulScalar(ops::AddScalar(RandomLeaf({3, 4}, 22, false), 1.0), 0.5).Detach();
    target.set_requires_grad(true);
    const V in = {ops::MulScalar(RandomLeaf({3, 4}, 21, false), 4.0).Detach().set_requires_grad(true), target};
    EXPECT_TRUE(GradCheck([&](const V& t) { return BinaryCrossEntropyWithLogits(t[0], t[1], {.reduction = r}); }, in));
    EXPECT_TRUE(GradCheck([&](const V& t) {
      return BinaryCrossEntropyWithLogits(t[0], t[1], {.reduction = r, .weight = w, .pos_weight = pw});
    }, in));
  }
}

// Expected values from PyTorch 2 in f64:
//   lp = torch.log_softmax(torch.tensor([[1.0, 2.0, 0.5], [0.1, -0.3, 0.7]], dtype=d), 1)
//   t = torch.tensor([[0.2, 0.8, 0.0], [0.3, 0.3, 0.4]], dtype=d)
//   F.kl_div(lp, t, reduction=r)  # r in "none", "mean", "sum", "batchmean"
//   tl = torch.log(torch.tensor([[0.2, 0.7, 0.1], [0.3, 0.3, 0.4]], dtype=d))
//   F.kl_div(lp, tl, reduction="none", log_target=True)  # and "batchmean"
Tensor KlInput() {
  return FromVector({-1.464368784107945, -0.4643687841079449, -1.964368784107945, -1.2506003020246401,
                     -1.6506003020246403, -0.6506003020246401},
                    {2, 3}, {.dtype = DType::kFloat64});
}

TEST(KlDivTest, MatchesPyTorch) {
  const Tensor lp = KlInput();
  const Tensor t = FromVector({0.2, 0.8, 0.0, 0.3, 0.3, 0.4}, {2, 3}, {.dtype = DType::kFloat64});
  ExpectValues(KlDiv(lp, t, {.reduction = Reduction::kNone}), {2, 3},
               {-0.029013825665231086, 0.1929801862349882, 0.0, 0.013988249309611234, 0.13398824930961123,
                -0.10627617193980593});
  ExpectValues(KlDiv(lp, t), {}, {0.03427778120819561});
  ExpectValues(KlDiv(lp, t, {.reduction = Reduction::kSum}), {}, {0.20566668724917364});
  ExpectValues(KLDivLoss({.batch_mean = true})(lp, t), {}, {0.10283334362458682});
  const Tensor tl = ops::Log(FromVector({0.2, 0.7, 0.1, 0.3, 0.3, 0.4}, {2, 3}, {.dtype = DType::kFloat64}));
  ExpectValues(KlDiv(lp, tl, {.reduction = Reduction::kNone, .log_target = true}), {2, 3},
               {-0.029013825665231075, 0.07538568811844872, -0.03382163088861006, 0.0139882493096112,
                0.13398824930961123, -0.10627617193980594});
  ExpectValues(KlDiv(lp, tl, {.batch_mean = true, .log_target = true}), {}, {0.027125279122012035});
}

TEST(KlDivTest, Gradients) {
  // Probabilities in [0.1, 0.9], so that the finite differences stay positive.
  Tensor t = ops::AddScalar(ops::MulScalar(RandomLeaf({3, 4}, 32, false), 0.4), 0.5).Detach();
  t.set_requires_grad(true);
  const V in = {RandomLeaf({3, 4}, 31), t};
  for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    for (bool log_target : {false, true}) {
      EXPECT_TRUE(GradCheck([&](const V& x) { return KlDiv(x[0], x[1], {.reduction = r, .log_target = log_target}); },
                            in));
    }
  }
  EXPECT_TRUE(GradCheck([&](const V& x) { return KlDiv(x[0], x[1], {.batch_mean = true}); }, in));
}

// A target of 0 adds 0 and sends the input no gradient; the target's own
// gradient stays finite (PyTorch's is NaN there).
TEST(KlDivTest, ZeroTargetGivesNoNaN) {
  Tensor lp = KlInput();
  lp.set_requires_grad(true);
  Tensor t = FromVector({0.2, 0.8, 0.0, 0.3, 0.3, 0.4}, {2, 3}, {.dtype = DType::kFloat64});
  t.set_requires_grad(true);
  Backward(KlDiv(lp, t, {.reduction = Reduction::kSum}));
  EXPECT_EQ(lp.grad().ToVector<double>()[2], 0.0);
  for (double g : t.grad().ToVector<double>()) EXPECT_TRUE(std::isfinite(g)) << g;
  // f32 too (its own smallest normal number).
  EXPECT_NEAR(KlDiv(lp.Detach().To(DType::kFloat32), t.Detach().To(DType::kFloat32), {.reduction = Reduction::kSum})
                  .Item(),
              0.20566668724917364, 1e-6);
}

// A negative target gives NaN, as xlogy(t, t) in PyTorch 1.13 (f32 and f64):
//   x = torch.tensor([0.0, -1.0, -0.5, -2.0], requires_grad=True)
//   t = torch.tensor([-0.5, 0.0, 0.5, -1e-40], requires_grad=True)
//   F.kl_div(x, t, reduction="none")  # [nan, 0, -0.0966, nan]
//   x.grad [0.5, -0, -0.5, 1e-40] (finite), t.grad [nan, nan, 0.8069, nan]
// (here the target's gradient at t == 0 stays finite, as ZeroTargetGivesNoNaN says).
TEST(KlDivTest, NegativeTargetGivesNaN) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    SCOPED_TRACE(std::string(DTypeName(dt)));
    const double tiny_negative = dt == DType::kFloat32 ? -1e-40 : -1e-310;
    EXPECT_TRUE(std::isnan(KlDiv(Zeros({1}, {.dtype = dt}), Full({1}, -0.5, {.dtype = dt})).Item()));
    Tensor x = FromVector({0.0, -1.0, -0.5, -2.0}, {4}, {.dtype = dt, .requires_grad = true});
    Tensor t = FromVector({-0.5, 0.0, 0.5, tiny_negative}, {4}, {.dtype = dt, .requires_grad = true});
    const Tensor per = KlDiv(x, t, {.reduction = Reduction::kNone});
    const std::vector<double> v = per.ToVector<double>();
    EXPECT_TRUE(std::isnan(v[0])) << v[0];
    EXPECT_EQ(v[1], 0.0);
    EXPECT_NEAR(v[2], 0.5 * std::log(0.5) + 0.25, 1e-6);
    EXPECT_TRUE(std::isnan(v[3])) << v[3];
    Backward(ops::Sum(per));
    const std::vector<double> gx = x.grad().ToVector<double>(), gt = t.grad().ToVector<double>();
    EXPECT_EQ(gx[0], 0.5);
    EXPECT_EQ(gx[2], -0.5);
    EXPECT_NEAR(gx[3], -tiny_negative, 1e-45);
    EXPECT_TRUE(std::isnan(gt[0])) << gt[0];
    EXPECT_NEAR(gt[2], std::log(0.5) + 1 + 0.5, 1e-6);
    EXPECT_TRUE(std::isnan(gt[3])) << gt[3];
    // The log-target form is exp(t) (t - input): finite for any finite t.
    EXPECT_TRUE(std::isfinite(KlDiv(Zeros({1}, {.dtype = dt}), Full({1}, -0.5, {.dtype = dt}), {.log_target = true})
                                  .Item()));
  }
}

// A Reduction cast from an integer that names none of the three is refused,
// naming the loss and the value. Before, each loss fell through to one of
// the three silently: the per-element losses for the pointwise ones, the
// sum for nll_loss and the fused cross_entropy.
TEST(LossTest, UnknownReductionIsNamed) {
  const Reduction bad = static_cast<Reduction>(7);
  const Tensor a = Zeros({2, 3}), t = FromVectorOf<int64_t>({0, 2}, {2});
  const std::vector<std::pair<std::string, std::function<void()>>> calls = {
      {"cross_entropy", [&] { CrossEntropy(a, t, {.reduction = bad}); }},
      {"nll_loss", [&] { NllLoss(a, t, {.reduction = bad}); }},
      {"mse_loss", [&] { MseLoss(a, a, bad); }},
      {"l1_loss", [&] { L1(a, a, bad); }},
      {"smooth_l1_loss", [&] { SmoothL1(a, a, {.reduction = bad}); }},
      {"huber_loss", [&] { Huber(a, a, {.reduction = bad}); }},
      {"binary_cross_entropy_with_logits", [&] { BinaryCrossEntropyWithLogits(a, a, {.reduction = bad}); }},
      {"kl_div", [&] { KlDiv(a, a, {.reduction = bad}); }},
  };
  for (const auto& [op, call] : calls) {
    EXPECT_EQ(ErrorOf(call), op + ": unknown reduction 7, expected kMean, kSum or kNone");
  }
}

TEST(PointwiseLossTest, BadInputsAreNamed) {
  const Tensor a = Zeros({2, 3}), b = Zeros({3});
  EXPECT_EQ(ErrorOf([&] { L1(a, b); }), "l1_loss: input [2, 3] and target [3] differ in shape");
  EXPECT_EQ(ErrorOf([&] { SmoothL1(a, b); }), "smooth_l1_loss: input [2, 3] and target [3] differ in shape");
  EXPECT_EQ(ErrorOf([&] { Huber(a, b); }), "huber_loss: input [2, 3] and target [3] differ in shape");
  EXPECT_EQ(ErrorOf([&] { BinaryCrossEntropyWithLogits(a, b); }),
            "binary_cross_entropy_with_logits: input [2, 3] and target [3] differ in shape");
  EXPECT_EQ(ErrorOf([&] { KlDiv(b, a); }), "kl_div: input [3] and target [2, 3] differ in shape");
  EXPECT_EQ(ErrorOf([&] { L1(a, Zeros({2, 3}, {.dtype = DType::kInt64})); }), "l1_loss: target must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { SmoothL1(a, a, {.beta = -1.0}); }), "smooth_l1_loss: beta must be >= 0, got -1");
  EXPECT_EQ(ErrorOf([&] { Huber(a, a, {.delta = 0.0}); }), "huber_loss: delta must be > 0, got 0");
  // A small bad value is shown as given (six decimals made both "-0.000000").
  EXPECT_EQ(ErrorOf([&] { SmoothL1(a, a, {.beta = -1e-9}); }), "smooth_l1_loss: beta must be >= 0, got -1e-09");
  EXPECT_EQ(ErrorOf([&] { Huber(a, a, {.delta = -2.5e-7}); }), "huber_loss: delta must be > 0, got -2.5e-07");
  EXPECT_EQ(ErrorOf([&] { BinaryCrossEntropyWithLogits(a, a, {.pos_weight = Ones({4})}); }),
            "binary_cross_entropy_with_logits: pos_weight [4] does not broadcast to input [2, 3]");
  EXPECT_EQ(ErrorOf([&] { BinaryCrossEntropyWithLogits(a, a, {.weight = Ones({3, 3})}); }),
            "binary_cross_entropy_with_logits: weight [3, 3] does not broadcast to input [2, 3]");
  Tensor w = Ones({3});
  w.set_requires_grad(true);
  EXPECT_EQ(ErrorOf([&] { BinaryCrossEntropyWithLogits(a, a, {.weight = w}); }),
            "binary_cross_entropy_with_logits: weight requires grad, but no gradient flows to it (detach it)");
  EXPECT_EQ(ErrorOf([&] { KlDiv(a, a, {.reduction = Reduction::kSum, .batch_mean = true}); }),
            "kl_div: batch_mean needs reduction kMean, got kSum");
}

}  // namespace
}  // namespace ddp::nn::loss
