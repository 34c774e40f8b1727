// Test helpers shared by the CPU autocast test and the GPU one
// (nn/cuda/optim_device_test), so that the CPU run calibrates the GPU's:
// - ExpectAutocastModelsMatchCpuF32: one forward and backward of the MLP and
//   of a conv + batch-norm CNN under f16 (loss scaled by 1024, as with
//   GradScaler) and bf16 autocast on a device, against the CPU in f32.
//   Tolerances (relative Frobenius error): logits 2% in bf16 (8-bit
//   mantissa) and 0.5% in f16 (11-bit); gradients 15% in both. Gradients
//   below a ReLU are dominated by units whose pre-activation lies within
//   rounding of zero and flips its mask: in the MLP two such units (of 4096,
//   at |h| ~ 1e-4) make 6% in f16, ten make 7-9% in bf16 (measured on the
//   CPU). PyTorch 1.13's CPU bf16 autocast on the MLP and CNN gives 0.4-0.5%
//   on the logits and 4-9% on the first layers' gradients. A wrong cast or a
//   lost gradient is off by O(100%).
// - TrainCnn: a few SGD steps of the peers' CNN on real Fashion-MNIST
//   batches or synthetic ones, in f32 or under autocast, with or without
//   the dynamic loss scaler, on any device.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nn/autograd/engine.h"
#include "nn/data/data_loader.h"
#include "nn/data/idx.h"
#include "nn/loss/loss.h"
#include "nn/modules/layers.h"
#include "nn/modules/models.h"
#include "nn/ops/autocast.h"
#include "nn/ops/functional.h"
#include "nn/optim/grad_scaler.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/generator.h"

namespace ddp::nn::testing {

/// The first `count` batches of 64 Fashion-MNIST training images, in file order.
inline std::vector<data::Batch> FashionMnistBatches(int count) {
  auto train = data::LoadFashionMnist(data::kFashionMnistDebianDir, data::Split::kTrain);
  data::DataLoader loader(train, nullptr, data::TransformOptions{}, {.batch_size = 64});
  loader.StartEpoch(0);
  std::vector<data::Batch> batches;
  while (static_cast<int>(batches.size()) < count) {
    auto b = loader.Next();
    if (!b) break;
    batches.push_back(std::move(*b));
  }
  return batches;
}

/// `count` batches of 64 synthetic 1x28x28 images that a CNN can learn,
/// for machines without the dataset (a GPU machine may lack it): class c
/// (labels cycle through 0..9) is an 8x8 square 1.0 brighter at one of ten
/// places, on uniform noise in [0, 1). Train with lr 0.01: the loss falls
/// smoothly from 2.30 to about 0.4 in 30 steps (at 0.05 it reaches 0.1 and
/// then diverges, which no two precisions do alike).
inline std::vector<data::Batch> SyntheticBatches(int count) {
  Generator gen(31);
  std::vector<data::Batch> batches;
  for (int b = 0; b < count; ++b) {
    std::vector<int64_t> labels(64);
    for (int i = 0; i < 64; ++i) labels[i] = (b * 64 + i * 7) % 10;
    Tensor images = Rand({64, 1, 28, 28}, {}, gen);
    float* px = images.data<float>();
    for (int i = 0; i < 64; ++i) {
      const int64_t c = labels[i], top = 2 + 8 * (c / 4), left = 2 + 6 * (c % 4);
      float* img = px + i * 784;
      for (int64_t r = top; r < top + 8; ++r) {
        for (int64_t q = left; q < left + 8; ++q) img[r * 28 + q] += 1.0f;
      }
    }
    data::Batch batch;
    batch.images = images;
    batch.labels = FromVectorOf<int64_t>(labels, {64});
    batches.push_back(std::move(batch));
  }
  return batches;
}

/// What a run saw.
struct Trajectory {
  std::vector<double> losses;  ///< One per batch (unscaled).
  int steps_taken = 0;         ///< Optimizer steps (the scaler skips some).
  DType logits_dtype = DType::kFloat32;
  DType loss_dtype = DType::kFloat32;
  bool grads_f32 = true;  ///< Every parameter's gradient was f32 at every step.
  bool params_f32 = true;
};

/// SGD (momentum 0.9) on the CNN from seed 11, one step per batch.
inline Trajectory TrainCnn(Device device, std::optional<DType> autocast, bool use_scaler,
                           const std::vector<data::Batch>& batches, double lr = 0.05) {
  Generator gen(11);
  auto model = modules::MakeCnn(gen);
  model->To(device);
  optim::Sgd opt(model->NamedParameters(), {.lr = lr, .momentum = 0.9});
  optim::GradScaler scaler({.init_scale = 1024.0, .enabled = use_scaler});
  Trajectory t;
  for (const data::Batch& b : batches) {
    opt.ZeroGrad();
    const Tensor x = b.images.To(device), y = b.labels.To(device);
    Tensor loss;
    {
      AutocastGuard guard(autocast);
      const Tensor logits = model->Forward(x);
      t.logits_dtype = logits.dtype();
      loss = loss::CrossEntropy(logits, y);
    }
    t.loss_dtype = loss.dtype();
    Backward(ops::MulScalar(loss, scaler.scale()));
    for (const Tensor& p : model->Parameters()) {
      t.grads_f32 = t.grads_f32 && p.grad().defined() && p.grad().dtype() == DType::kFloat32;
    }
    t.steps_taken += scaler.Step(opt) ? 1 : 0;
    scaler.Update();
    t.losses.push_back(loss.Item());
  }
  for (const Tensor& p : model->Parameters()) t.params_f32 = t.params_f32 && p.dtype() == DType::kFloat32;
  return t;
}

/// Mean of losses[from, to).
inline double MeanLoss(const std::vector<double>& v, size_t from, size_t to) {
  return std::accumulate(v.begin() + from, v.begin() + to, 0.0) / static_cast<double>(to - from);
}

/// An autocast run `t` of 30 batches in `dtype` against the f32 run `ref`:
/// low-precision logits, f32 loss, gradients and parameters, at most two
/// skipped steps, a first loss within `first_tol` (relative) of f32's, and
/// a last-10 mean that fell below 0.75 of its first loss and is within 10%
/// of f32's.
inline void ExpectTrainedLikeF32(const Trajectory& t, const Trajectory& ref, DType dtype,
                                 double first_tol) {
  const double last = MeanLoss(t.losses, 20, 30);
  const double ref_last = MeanLoss(ref.losses, 20, 30);
  EXPECT_EQ(t.logits_dtype, dtype);
  EXPECT_EQ(t.loss_dtype, DType::kFloat32);
  EXPECT_TRUE(t.grads_f32);
  EXPECT_TRUE(t.params_f32);
  EXPECT_GE(t.steps_taken, 28);
  EXPECT_NEAR(t.losses[0], ref.losses[0], first_tol * ref.losses[0]);
  EXPECT_LT(last, 0.75 * t.losses[0]);
  EXPECT_NEAR(last, ref_last, 0.1 * ref_last);
}

inline double RelativeError(const Tensor& a, const Tensor& b) {
  const std::vector<double> va = a.Detach().ToVector<double>(), vb = b.Detach().ToVector<double>();
  EXPECT_EQ(va.size(), vb.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < va.size() && i < vb.size(); ++i) {
    num += (va[i] - vb[i]) * (va[i] - vb[i]);
    den += vb[i] * vb[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

struct Pass {
  Tensor logits, loss;
  std::vector<Tensor> grads;
};

// One forward and backward; the loss is multiplied by loss_scale before
// backward and the gradients divided by it after, as GradScaler does (f16
// needs it: without it small activation gradients fall into f16's subnormals).
inline Pass ForwardBackward(modules::Module& model, const Tensor& x, const Tensor& y, std::optional<DType> low,
                            double loss_scale = 1.0) {
  Pass r;
  {
    AutocastGuard guard(low);
    r.logits = model.Forward(x);
    r.loss = loss::CrossEntropy(r.logits, y);
  }
  Backward(ops::MulScalar(r.loss, loss_scale));
  for (const Tensor& p : model.Parameters()) r.grads.push_back(ops::MulScalar(p.grad(), 1.0 / loss_scale));
  return r;
}

/// The per-model check described at the top, with the models on `device`.
inline void ExpectAutocastModelsMatchCpuF32(Device device) {
  using Factory = std::function<std::shared_ptr<modules::Module>(Generator&)>;
  const std::pair<const char*, Factory> models[] = {
      {"mlp", [](Generator& g) { return modules::MakeMlp(g); }},
      {"conv-bn cnn",
       [](Generator& g) {
         using namespace modules;  // NOLINT: layer names only
         // No convolution bias: batch norm cancels it, so its gradient is ~0.
         return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
             std::make_shared<Conv2d>(1, 8, 3, Conv2dOptions{.bias = false}, g), std::make_shared<BatchNorm2d>(8),
             std::make_shared<ReLU>(), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
             std::make_shared<Linear>(8 * 13 * 13, 10, true, g)});
       }},
  };
  Generator data(12);
  const Tensor x = Randn({16, 1, 28, 28}, {}, data);
  const Tensor y = FromVectorOf<int64_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5}, {16});
  for (const auto& [model_name, make] : models) {
    Generator g_ref(21);
    auto ref_model = make(g_ref);
    const Pass ref = ForwardBackward(*ref_model, x, y, std::nullopt);
    for (DType low : {DType::kFloat16, DType::kBFloat16}) {
      SCOPED_TRACE(std::string(model_name) + " " + std::string(DTypeName(low)));
      const double logits_tol = low == DType::kBFloat16 ? 0.02 : 0.005;
      const double grads_tol = 0.15;
      Generator g(21);
      auto model = make(g);
      model->To(device);
      const double loss_scale = low == DType::kFloat16 ? 1024.0 : 1.0;
      const Pass amp = ForwardBackward(*model, x.To(device), y.To(device), low, loss_scale);
      EXPECT_EQ(amp.logits.dtype(), low);
      EXPECT_EQ(amp.logits.device(), device);
      EXPECT_EQ(amp.loss.dtype(), DType::kFloat32);
      EXPECT_LT(RelativeError(amp.logits, ref.logits), logits_tol);
      EXPECT_NEAR(amp.loss.Item(), ref.loss.Item(), logits_tol * std::abs(ref.loss.Item()));
      const auto named = model->NamedParameters();
      ASSERT_EQ(amp.grads.size(), ref.grads.size());
      for (size_t i = 0; i < named.size(); ++i) {
        ASSERT_TRUE(amp.grads[i].defined()) << named[i].first;
        EXPECT_EQ(named[i].second.dtype(), DType::kFloat32) << named[i].first;
        EXPECT_EQ(amp.grads[i].dtype(), DType::kFloat32) << named[i].first;
        EXPECT_EQ(amp.grads[i].device(), device) << named[i].first;
        const double err = RelativeError(amp.grads[i], ref.grads[i]);
        std::printf("%s %s %s: %s gradient relative error %.4f\n", device.ToString().c_str(), model_name,
                    std::string(DTypeName(low)).c_str(), named[i].first.c_str(), err);
        EXPECT_LT(err, grads_tol) << named[i].first;
      }
    }
  }
}

}  // namespace ddp::nn::testing
