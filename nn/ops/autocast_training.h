// Test helper shared by the CPU autocast test and the GPU one
// (nn/cuda/optim_device_test): a few SGD steps of the peers' CNN on real
// Fashion-MNIST batches, in f32 or under autocast, with or without the
// dynamic loss scaler, on any device.
#pragma once

#include <memory>
#include <numeric>
#include <optional>
#include <vector>

#include "nn/autograd/engine.h"
#include "nn/data/data_loader.h"
#include "nn/data/idx.h"
#include "nn/loss/loss.h"
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

/// What a run saw.
struct Trajectory {
  std::vector<double> losses;  ///< One per batch (unscaled).
  int steps_taken = 0;         ///< Optimizer steps (the scaler skips some).
  DType logits_dtype = DType::kFloat32;
  DType loss_dtype = DType::kFloat32;
  bool grads_f32 = true;  ///< Every parameter's gradient was f32 at every step.
  bool params_f32 = true;
};

/// SGD (lr 0.05, momentum 0.9) on the CNN from seed 11, one step per batch.
inline Trajectory TrainCnn(Device device, std::optional<DType> autocast, bool use_scaler,
                           const std::vector<data::Batch>& batches) {
  Generator gen(11);
  auto model = modules::MakeCnn(gen);
  model->To(device);
  optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
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

}  // namespace ddp::nn::testing
