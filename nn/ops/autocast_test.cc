// Autocast on the CPU: which ops run in the low dtype and which in f32, that
// gradients reach the f32 weights as f32 and stay close to an f32 run, the
// cast cache, and a few training steps on Fashion-MNIST under bf16.
//
// Tolerances (relative Frobenius error against the same model run in f32,
// one forward and backward on random inputs): logits within 2% in bf16 (8-bit
// mantissa) and 0.5% in f16 (11-bit); gradients within 15% in bf16 and 3% in
// f16. Gradients are looser because the batch sums behind them cancel (the
// rounding error does not): PyTorch 1.13's CPU autocast on the same MLP and
// CNN gives 0.4-0.5% on the logits and 4-9% on the first layers' gradients.
#include "nn/ops/autocast.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "nn/autograd/engine.h"
#include "nn/data/data_loader.h"
#include "nn/data/idx.h"
#include "nn/data/sampler.h"
#include "nn/loss/loss.h"
#include "nn/modules/layers.h"
#include "nn/modules/models.h"
#include "nn/ops/autocast_training.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/generator.h"

namespace ddp::nn {
namespace {

struct Tolerance {
  double logits;
  double grads;
};
constexpr Tolerance kBf16Tolerance{0.02, 0.15};
constexpr Tolerance kF16Tolerance{0.005, 0.03};

// ||a - b|| / ||b||, shared with the GPU tests.
using testing::RelativeError;

TEST(AutocastGuardTest, NestsAndRestores) {
  EXPECT_FALSE(AutocastDType().has_value());
  {
    AutocastGuard outer(DType::kBFloat16);
    EXPECT_EQ(AutocastDType(), DType::kBFloat16);
    {
      AutocastGuard inner(DType::kFloat16);
      EXPECT_EQ(AutocastDType(), DType::kFloat16);
      {
        AutocastGuard off(std::nullopt);
        EXPECT_FALSE(AutocastDType().has_value());
      }
      EXPECT_EQ(AutocastDType(), DType::kFloat16);
    }
    EXPECT_EQ(AutocastDType(), DType::kBFloat16);
  }
  EXPECT_FALSE(AutocastDType().has_value());
}

TEST(AutocastGuardTest, IsPerThread) {
  AutocastGuard guard(DType::kBFloat16);
  std::optional<DType> seen = DType::kFloat32;
  std::thread t([&] { seen = AutocastDType(); });
  t.join();
  EXPECT_FALSE(seen.has_value());
  EXPECT_EQ(AutocastDType(), DType::kBFloat16);
}

TEST(AutocastGuardTest, RejectsDTypesOtherThanSixteenBitFloats) {
  for (DType bad : {DType::kFloat32, DType::kFloat64, DType::kInt64}) {
    try {
      AutocastGuard guard(bad);
      FAIL() << "accepted " << DTypeName(bad);
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("got ") + std::string(DTypeName(bad))), std::string::npos)
          << e.what();
    }
    EXPECT_FALSE(AutocastDType().has_value());
  }
}

TEST(AutocastTest, LinearRunsInLowDTypeAndGivesF32Gradients) {
  ManualSeed(1);
  const Tensor x = Randn({8, 32});
  const Tensor w = Randn({16, 32}).set_requires_grad(true);
  const Tensor b = Randn({16}).set_requires_grad(true);
  const Tensor y32 = ops::Linear(x, w, b);
  Backward(ops::Sum(y32));
  const Tensor gw32 = w.grad().Clone(), gb32 = b.grad().Clone();
  w.set_grad(Tensor());
  b.set_grad(Tensor());

  for (DType low : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(std::string(DTypeName(low)));
    const Tolerance tol = low == DType::kBFloat16 ? kBf16Tolerance : kF16Tolerance;
    Tensor y, s;
    {
      AutocastGuard guard(low);
      y = ops::Linear(x, w, b);
      s = ops::Sum(y);
    }
    EXPECT_EQ(y.dtype(), low);
    EXPECT_EQ(s.dtype(), DType::kFloat32);  // reductions promote
    EXPECT_LT(RelativeError(y, y32), tol.logits);
    Backward(s);
    ASSERT_TRUE(w.grad().defined());
    EXPECT_EQ(w.grad().dtype(), DType::kFloat32);
    EXPECT_EQ(b.grad().dtype(), DType::kFloat32);
    EXPECT_LT(RelativeError(w.grad(), gw32), tol.grads);
    EXPECT_LT(RelativeError(b.grad(), gb32), tol.grads);
    w.set_grad(Tensor());
    b.set_grad(Tensor());
  }
}

TEST(AutocastTest, MatmulCastsBothOperandsAndLeavesF64Alone) {
  ManualSeed(2);
  const Tensor a = Randn({4, 8}).set_requires_grad(true), b = Randn({8, 3});
  AutocastGuard guard(DType::kBFloat16);
  const Tensor c = ops::Matmul(a, b);
  EXPECT_EQ(c.dtype(), DType::kBFloat16);
  const Tensor batched = ops::Matmul(Randn({2, 4, 8}), Randn({2, 8, 3}));
  EXPECT_EQ(batched.dtype(), DType::kBFloat16);
  const Tensor d = ops::Matmul(Randn({4, 8}, {.dtype = DType::kFloat64}), Randn({8, 3}, {.dtype = DType::kFloat64}));
  EXPECT_EQ(d.dtype(), DType::kFloat64);
  Backward(ops::Sum(c));
  EXPECT_EQ(a.grad().dtype(), DType::kFloat32);
  // Two vectors: a dot product in the low dtype, summed in f32 before the
  // one rounding (it gave f32, from 16-bit products).
  const Tensor u = Full({300}, 1.0f + 1.0f / 128), v = Full({300}, 1.0f);
  const Tensor dot = ops::Matmul(u, v);
  EXPECT_EQ(dot.dtype(), DType::kBFloat16);
  EXPECT_EQ(dot.dim(), 0);
  EXPECT_EQ(dot.ToVector<double>()[0], Full({}, 300.0 * (1 + 1.0 / 128)).To(DType::kBFloat16).ToVector<double>()[0]);
}

// f64 is not eligible for autocast (as in PyTorch): Linear and Conv2d with an
// f64 input and an f32 weight cast the weight to bf16 and then the f64 input
// down to bf16 with it, silently; now they refuse, naming both dtypes. All-f64
// layers still run in f64.
TEST(AutocastTest, LayersRefuseToMixF64WithAutocastOperands) {
  ManualSeed(3);
  AutocastGuard guard(DType::kBFloat16);
  const Tensor x64 = Randn({2, 8}, {.dtype = DType::kFloat64}), w32 = Randn({3, 8});
  const auto error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string linear = error([&] { ops::Linear(x64, w32, Tensor()); });
  EXPECT_EQ(linear.rfind("linear: under autocast (bf16) the input is f64 and the weight f32", 0), 0u) << linear;
  const std::string reversed = error([&] { ops::Linear(w32.View({3, 8}), x64.View({2, 8}), Tensor()); });
  EXPECT_EQ(reversed.rfind("linear: under autocast (bf16) the input is f32 and the weight f64", 0), 0u) << reversed;
  const Tensor img64 = Randn({1, 2, 5, 5}, {.dtype = DType::kFloat64}), k32 = Randn({4, 2, 3, 3});
  const std::string conv = error([&] { ops::Conv2d(img64, k32, Tensor()); });
  EXPECT_EQ(conv.rfind("conv2d: under autocast (bf16) the input is f64 and the weight f32", 0), 0u) << conv;
  EXPECT_EQ(ops::Linear(x64, w32.To(DType::kFloat64), Tensor()).dtype(), DType::kFloat64);
  EXPECT_EQ(ops::Conv2d(img64, k32.To(DType::kFloat64), Tensor()).dtype(), DType::kFloat64);
}

TEST(AutocastTest, RangeSensitiveOpsComputeInF32) {
  ManualSeed(3);
  const Tensor x16 = Randn({4, 10}).To(DType::kBFloat16);
  AutocastGuard guard(DType::kBFloat16);
  EXPECT_EQ(ops::LogSoftmax(x16, 1).dtype(), DType::kFloat32);
  EXPECT_EQ(ops::Softmax(x16, 1).dtype(), DType::kFloat32);
  EXPECT_EQ(ops::Sum(x16).dtype(), DType::kFloat32);
  EXPECT_EQ(ops::Mean(x16, {1}).dtype(), DType::kFloat32);
  EXPECT_EQ(loss::MseLoss(x16, Zeros({4, 10}, {.dtype = DType::kBFloat16})).dtype(), DType::kFloat32);
  EXPECT_EQ(loss::CrossEntropy(x16, FromVectorOf<int64_t>({0, 1, 2, 3}, {4})).dtype(), DType::kFloat32);
  // Elementwise ops keep their input's dtype.
  EXPECT_EQ(ops::Relu(x16).dtype(), DType::kBFloat16);
  // Without autocast nothing is promoted.
  AutocastGuard off(std::nullopt);
  EXPECT_EQ(ops::LogSoftmax(x16, 1).dtype(), DType::kBFloat16);
  EXPECT_EQ(ops::Sum(x16).dtype(), DType::kBFloat16);
}

// Conv2d, BatchNorm2d, ReLU, MaxPool2d, Flatten, Linear. The convolution has
// no bias, as in ResNets: batch norm removes it, so its true gradient is 0.
std::shared_ptr<modules::Sequential> SmallBnCnn() {
  using namespace modules;  // NOLINT: layer names only
  return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 8, 3, Conv2dOptions{.bias = false}), std::make_shared<BatchNorm2d>(8),
      std::make_shared<ReLU>(),
      std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(), std::make_shared<Linear>(8 * 6 * 6, 10)});
}

struct RunResult {
  Tensor logits;
  Tensor loss;
  std::vector<Tensor> grads;
};

RunResult ForwardBackward(modules::Module& model, const Tensor& x, const Tensor& y, std::optional<DType> low) {
  for (const Tensor& p : model.Parameters()) p.set_grad(Tensor());
  RunResult r;
  {
    AutocastGuard guard(low);
    r.logits = model.Forward(x);
    r.loss = loss::CrossEntropy(r.logits, y);
  }
  Backward(r.loss);
  for (const Tensor& p : model.Parameters()) r.grads.push_back(p.grad().Clone());
  return r;
}

void ExpectCloseToF32(modules::Module& model, const Tensor& x, const Tensor& y, DType low, Tolerance tol) {
  const RunResult ref = ForwardBackward(model, x, y, std::nullopt);
  const RunResult amp = ForwardBackward(model, x, y, low);
  EXPECT_EQ(ref.logits.dtype(), DType::kFloat32);
  EXPECT_EQ(amp.logits.dtype(), low);
  EXPECT_EQ(amp.loss.dtype(), DType::kFloat32);
  EXPECT_LT(RelativeError(amp.logits, ref.logits), tol.logits);
  EXPECT_NEAR(amp.loss.Item(), ref.loss.Item(), tol.logits * std::abs(ref.loss.Item()));
  const auto named = model.NamedParameters();
  for (size_t i = 0; i < named.size(); ++i) {
    SCOPED_TRACE(named[i].first);
    EXPECT_EQ(named[i].second.dtype(), DType::kFloat32);
    ASSERT_TRUE(amp.grads[i].defined());
    EXPECT_EQ(amp.grads[i].dtype(), DType::kFloat32);
    const double err = RelativeError(amp.grads[i], ref.grads[i]);
    EXPECT_LT(err, tol.grads);
    std::printf("%s %s gradient relative error %.4f\n", std::string(DTypeName(low)).c_str(),
                named[i].first.c_str(), err);
  }
}

TEST(AutocastTest, MlpBf16GradientsAreF32AndCloseToF32Run) {
  ManualSeed(4);
  auto model = modules::MakeMlp();
  const Tensor x = Randn({16, 1, 28, 28});
  const Tensor y = FromVectorOf<int64_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5}, {16});
  ExpectCloseToF32(*model, x, y, DType::kBFloat16, kBf16Tolerance);
  ExpectCloseToF32(*model, x, y, DType::kFloat16, kF16Tolerance);
}

TEST(AutocastTest, CnnBf16GradientsAreF32AndCloseToF32Run) {
  ManualSeed(5);
  auto model = modules::MakeCnn();
  const Tensor x = Randn({8, 1, 28, 28});
  const Tensor y = FromVectorOf<int64_t>({3, 1, 4, 1, 5, 9, 2, 6}, {8});
  ExpectCloseToF32(*model, x, y, DType::kBFloat16, kBf16Tolerance);
}

TEST(AutocastTest, BatchNormKeepsLowDTypeOutputAndF32Statistics) {
  ManualSeed(6);
  auto model = SmallBnCnn();
  const Tensor x = Randn({8, 1, 15, 15});
  const Tensor y = FromVectorOf<int64_t>({3, 1, 4, 1, 5, 9, 2, 6}, {8});
  {
    AutocastGuard guard(DType::kBFloat16);
    const Tensor conv = model->Child("0")->Forward(x);
    EXPECT_EQ(conv.dtype(), DType::kBFloat16);
    const Tensor bn = model->Child("1")->Forward(conv);
    EXPECT_EQ(bn.dtype(), DType::kBFloat16);
  }
  for (const auto& [name, t] : model->NamedBuffers()) {
    if (name.find("running") != std::string::npos) {
      EXPECT_EQ(t.dtype(), DType::kFloat32) << name;
    }
  }
  ExpectCloseToF32(*model, x, y, DType::kBFloat16, kBf16Tolerance);
}

TEST(AutocastTest, CastOfAParameterIsCachedUntilItChanges) {
  ManualSeed(7);
  const Tensor w = Randn({4, 4}).set_requires_grad(true);
  const Tensor x = Randn({2, 4});
  {
    AutocastGuard guard(DType::kBFloat16);
    const Tensor y1 = ops::Linear(x, w, Tensor());
    EXPECT_EQ(ops::autocast::CachedCasts(), 1u);
    const Tensor y2 = ops::Linear(x, w, Tensor());
    EXPECT_EQ(ops::autocast::CachedCasts(), 1u);
    // Both uses reach the f32 weight: the gradient is twice one use's.
    Backward(ops::Sum(ops::Add(y1, y2)));
    const Tensor g2 = w.grad().Clone();
    w.set_grad(Tensor());
    Backward(ops::Sum(ops::Linear(x, w, Tensor())));
    EXPECT_LT(RelativeError(g2, ops::MulScalar(w.grad(), 2.0)), 1e-6);
    // An in-place update (as an optimizer makes) invalidates the cached cast.
    {
      NoGradGuard no_grad;
      w.Fill(0.5);
    }
    const Tensor y3 = ops::Linear(x, w, Tensor());
    const Tensor expect = ops::MulScalar(ops::Sum(x.To(DType::kBFloat16), {1}, true), 0.5);
    EXPECT_LT(RelativeError(y3.Detach().Narrow(1, 0, 1), expect), 1e-2);
    // Nested guards share the cache; a disabled scope does not cast.
    {
      AutocastGuard off(std::nullopt);
      EXPECT_EQ(ops::Linear(x, w, Tensor()).dtype(), DType::kFloat32);
    }
    EXPECT_EQ(ops::autocast::CachedCasts(), 1u);
  }
  EXPECT_EQ(ops::autocast::CachedCasts(), 0u);
}

// Conv1d casts its parameters themselves, not the views of height 1 it
// hands to Conv2d, so their casts are cached as Linear's and Conv2d's are
// (before, the weight's view was no leaf and was cast again on every call).
TEST(AutocastTest, Conv1dsParameterCastsAreCached) {
  ManualSeed(8);
  const Tensor w = Randn({4, 2, 3}).set_requires_grad(true);
  const Tensor b = Randn({4}).set_requires_grad(true);
  const Tensor x = Randn({2, 2, 9});
  {
    AutocastGuard guard(DType::kBFloat16);
    const Tensor y1 = ops::Conv1d(x, w, b);
    const Tensor y2 = ops::Conv1d(x, w, b);
    EXPECT_EQ(ops::autocast::CachedCasts(), 2u);  // the weight and the bias
    EXPECT_EQ(y1.dtype(), DType::kBFloat16);
    Backward(ops::Sum(ops::Add(y1, y2)));
  }
  EXPECT_EQ(w.grad().dtype(), DType::kFloat32);
  EXPECT_EQ(w.grad().shape(), w.shape());
  EXPECT_EQ(b.grad().dtype(), DType::kFloat32);
}

// SetData onto another view of the same storage, with no write between:
// the storage and its version are unchanged, yet the cached cast is of the
// old view's values and shape.
TEST(AutocastTest, ACachedCastIsNotReusedAfterSetDataToAnotherViewOfItsStorage) {
  const Tensor whole = FromVector(std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8}, {2, 4});
  Tensor w = whole.Narrow(0, 0, 1).Detach().set_requires_grad(true);  // [[1, 2, 3, 4]]
  const Tensor x = Ones({1, 4});
  AutocastGuard guard(DType::kBFloat16);
  EXPECT_EQ(ops::Linear(x, w, Tensor()).Item(), 10.0);
  {
    NoGradGuard no_grad;
    w.SetData(whole.Narrow(0, 1, 1));  // [[5, 6, 7, 8]], the same storage
  }
  EXPECT_EQ(ops::Linear(x, w, Tensor()).Item(), 26.0);
  {
    NoGradGuard no_grad;
    w.SetData(whole.Narrow(1, 0, 2).Transpose(0, 1));  // [[1, 5], [2, 6]]: the shape changes too
  }
  EXPECT_EQ(ops::Linear(Ones({1, 2}), w, Tensor()).Detach().To(DType::kFloat32).ToVector<float>(),
            (std::vector<float>{6, 8}));
}

double MeanOf(const std::vector<double>& v, size_t from, size_t to) {
  return std::accumulate(v.begin() + from, v.begin() + to, 0.0) / static_cast<double>(to - from);
}

TEST(AutocastTest, Bf16TrainingOnFashionMnistLowersTheLoss) {
  ManualSeed(8);
  auto model = modules::MakeCnn();
  auto train = data::LoadFashionMnist(data::kFashionMnistDebianDir, data::Split::kTrain);
  data::DataLoader loader(train, std::make_shared<data::RandomSampler>(train->Size(), 1), data::TransformOptions{},
                          {.batch_size = 64, .num_workers = 1});
  optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  std::vector<double> losses;
  loader.StartEpoch(0);
  while (losses.size() < 120) {
    auto batch = loader.Next();
    ASSERT_TRUE(batch.has_value());
    opt.ZeroGrad();
    Tensor loss;
    {
      AutocastGuard guard(DType::kBFloat16);
      loss = loss::CrossEntropy(model->Forward(batch->images), batch->labels);
    }
    ASSERT_EQ(loss.dtype(), DType::kFloat32);
    Backward(loss);
    for (const Tensor& p : model->Parameters()) ASSERT_EQ(p.grad().dtype(), DType::kFloat32);
    opt.Step();
    losses.push_back(loss.Item());
  }
  const double first = MeanOf(losses, 0, 20), last = MeanOf(losses, losses.size() - 20, losses.size());
  std::printf("bf16 autocast CNN: first-20 loss %.4f, last-20 loss %.4f\n", first, last);
  EXPECT_LT(last, 0.6 * first);
  for (const Tensor& p : model->Parameters()) EXPECT_EQ(p.dtype(), DType::kFloat32);
}

// The per-model check the GPU test runs on cuda:0, here with the CPU's
// 16-bit kernels (which convert to f32 and round like the GPU's).
TEST(AutocastTest, MlpAndConvBnCnnMatchTheF32RunInF16AndBf16) { testing::ExpectAutocastModelsMatchCpuF32(kCPU); }

// The scenario the GPU test (nn/cuda/optim_device_test) runs on cuda:0,
// here on the CPU: 30 steps on the given batches in f32, in f16 with the
// loss scaler and in bf16. The 16-bit runs must train (the last 10 losses below
// 75% of the first) and follow the f32 run: first loss within 1% (f16) or
// 2% (bf16), mean of the last 10 within 10%.
void ExpectSixteenBitFollowsF32(const std::vector<data::Batch>& batches, double lr) {
  ASSERT_EQ(batches.size(), 30u);
  const testing::Trajectory ref = testing::TrainCnn(kCPU, std::nullopt, false, batches, lr);
  const double ref_last = testing::MeanLoss(ref.losses, 20, 30);
  for (double l : ref.losses) std::printf("%.3f ", l);
  std::printf("\n");
  EXPECT_LT(ref_last, 0.75 * ref.losses[0]);
  struct Case {
    DType dtype;
    bool scaler;
    double first_tol;
  };
  for (const Case& c : {Case{DType::kFloat16, true, 0.01}, Case{DType::kBFloat16, false, 0.02}}) {
    SCOPED_TRACE(std::string(DTypeName(c.dtype)));
    const testing::Trajectory t = testing::TrainCnn(kCPU, c.dtype, c.scaler, batches, lr);
    const double last = testing::MeanLoss(t.losses, 20, 30);
    std::printf("%s: first loss %.4f (f32 %.4f), last-10 %.4f (f32 %.4f), %d steps taken\n",
                std::string(DTypeName(c.dtype)).c_str(), t.losses[0], ref.losses[0], last, ref_last, t.steps_taken);
    testing::ExpectTrainedLikeF32(t, ref, c.dtype, c.first_tol);
  }
}

TEST(AutocastTest, F16WithGradScalerAndBf16FollowTheF32TrajectoryOnFashionMnist) {
  ExpectSixteenBitFollowsF32(testing::FashionMnistBatches(30), 0.05);
}

// The synthetic batches the GPU test trains on (a GPU machine may lack the
// dataset): the same expectations hold for them on the CPU.
TEST(AutocastTest, F16WithGradScalerAndBf16FollowTheF32TrajectoryOnSyntheticData) {
  ExpectSixteenBitFollowsF32(testing::SyntheticBatches(30), 0.01);
}

}  // namespace
}  // namespace ddp::nn
