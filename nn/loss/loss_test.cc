#include "nn/loss/loss.h"

#include <gtest/gtest.h>

#include <cmath>

#include "nn/autograd/engine.h"
#include "nn/ops/functional.h"
#include "nn/ops/gradcheck.h"

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
