// Whole models on cuda:0 against the same models on the CPU (tag "gpu"): one
// forward and backward with the same initial weights (same seed) and the
// same batch. Compared: the loss, the logits, every parameter's gradient and
// every buffer (BatchNorm running statistics) afterwards.
//
// Tolerance per tensor: |gpu - cpu| <= rtol * |cpu| + atol * max|cpu|. The
// GPU sums in other orders (cuBLAS, cuDNN, tree reductions); deeper models
// amplify that, BatchNorm most (it divides by batch statistics):
// - MLP (784-512-256-10):          rtol 1e-4, atol 1e-5
// - CNN (the peers' 2-conv model):  rtol 1e-3, atol 1e-4
// - ResNet-18, CIFAR stem, batch 4 (both BatchNorm paths), in f64:
//   rtol 1e-7, atol 1e-9
// A wrong kernel is off by O(1) of the tensor's scale, far outside these.
//
// ResNet-18 runs in f64 because in f32 the comparison is not continuous: at
// initialization every BatchNorm bias is 0, so some pre-ReLU values lie
// within f32 rounding of 0 and their ReLU masks differ between any two
// summation orders (the CPU's f32 run differs from its own f64 run the same
// way). Each flipped element moves its channel's bias gradient, and the
// error then spreads to every earlier layer: a few percent of a tensor's
// scale, measured on the CPU alone. In f64 no mask flips.
//
// Also the losses that run through the NLL kernels (class-weighted
// cross-entropy, NllLoss) on one input tensor, and the pointwise losses
// composed of elementwise ops (L1, smooth L1, Huber, BCE with logits, KL
// divergence): rtol 1e-5, atol 1e-5.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "nn/autograd/engine.h"
#include "nn/cuda/allocator.h"
#include "nn/cuda/batch_norm.h"
#include "nn/cuda/cuda.h"
#include "nn/loss/loss.h"
#include "nn/cuda/optim_kernels.h"
#include "nn/modules/models.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

using Factory = std::function<std::shared_ptr<modules::Module>(Generator&)>;

struct StepResult {
  double loss = 0;
  Tensor logits;                                       // on the CPU
  std::vector<std::pair<std::string, Tensor>> grads;   // on the CPU
  std::vector<std::pair<std::string, Tensor>> buffers; // on the CPU, after the step
};

StepResult Step(const Factory& make, Device device, DType dtype, const Tensor& images, const Tensor& labels) {
  Generator gen(2024);
  auto model = make(gen);
  model->Train();
  model->To(dtype);
  model->To(device);
  const Tensor logits = model->Forward(images.To(dtype).To(device));
  const Tensor loss = loss::CrossEntropy(logits, labels.To(device));
  Backward(loss);
  StepResult r;
  r.loss = loss.Item();
  r.logits = logits.Detach().To(kCPU);
  for (const auto& [name, p] : model->NamedParameters()) {
    EXPECT_EQ(p.device(), device) << name;
    EXPECT_TRUE(p.grad().defined()) << name;
    r.grads.emplace_back(name, p.grad().To(kCPU));
  }
  for (const auto& [name, b] : model->NamedBuffers()) r.buffers.emplace_back(name, b.To(kCPU));
  return r;
}

void ExpectTensorClose(const std::string& what, const Tensor& cpu, const Tensor& gpu, double rtol, double atol) {
  ASSERT_EQ(cpu.shape(), gpu.shape()) << what;
  const std::vector<double> want = cpu.ToVector<double>();
  const std::vector<double> got = gpu.ToVector<double>();
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::abs(v));
  int bad = 0;
  for (size_t j = 0; j < want.size(); ++j) {
    if (!(std::abs(got[j] - want[j]) <= rtol * std::abs(want[j]) + atol * scale) && ++bad <= 3) {
      ADD_FAILURE() << what << "[" << j << "]: cpu " << want[j] << ", gpu " << got[j] << " (max |cpu| " << scale
                    << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

void CompareModels(const Factory& make, const Shape& input, int64_t classes, double rtol, double atol,
                   DType dtype = DType::kFloat32) {
  Init();
  Generator data(7);
  const Tensor images = Rand(input, {}, data);
  Tensor label_values = Empty({input[0]});
  UniformFill(label_values, 0.0, static_cast<double>(classes), data);
  const Tensor labels = label_values.To(DType::kInt64);
  const StepResult cpu = Step(make, kCPU, dtype, images, labels);
  const StepResult gpu = Step(make, kGpu, dtype, images, labels);
  EXPECT_NEAR(gpu.loss, cpu.loss, rtol * std::abs(cpu.loss));
  ExpectTensorClose("logits", cpu.logits, gpu.logits, rtol, atol);
  ASSERT_EQ(gpu.grads.size(), cpu.grads.size());
  for (size_t i = 0; i < cpu.grads.size(); ++i) {
    ASSERT_EQ(gpu.grads[i].first, cpu.grads[i].first);
    ExpectTensorClose("grad of " + cpu.grads[i].first, cpu.grads[i].second, gpu.grads[i].second, rtol, atol);
  }
  ASSERT_EQ(gpu.buffers.size(), cpu.buffers.size());
  for (size_t i = 0; i < cpu.buffers.size(); ++i) {
    ASSERT_EQ(gpu.buffers[i].first, cpu.buffers[i].first);
    if (cpu.buffers[i].second.dtype() == DType::kInt64) {  // num_batches_tracked
      EXPECT_EQ(gpu.buffers[i].second.ToVector<int64_t>(), cpu.buffers[i].second.ToVector<int64_t>());
    } else {
      ExpectTensorClose("buffer " + cpu.buffers[i].first, cpu.buffers[i].second, gpu.buffers[i].second, rtol, atol);
    }
  }
}

TEST(CudaModelsTest, MlpForwardAndBackwardMatchTheCpu) {
  CompareModels([](Generator& g) { return modules::MakeMlp(g); }, {64, 1, 28, 28}, 10, 1e-4, 1e-5);
}

TEST(CudaModelsTest, CnnForwardAndBackwardMatchTheCpu) {
  CompareModels([](Generator& g) { return modules::MakeCnn(g); }, {16, 1, 28, 28}, 10, 1e-3, 1e-4);
}

// f64 runs our BatchNorm kernels (cuDNN's take f32 and 16-bit only), here
// with one block per channel (DDP_NN_CUDA_BN_SPLIT=0).
TEST(CudaModelsTest, ResNet18CifarForwardAndBackwardMatchTheCpu) {
  const bool was = BatchNormSplitReductions();
  SetBatchNormSplitReductions(false);
  CompareModels(
      [](Generator& g) {
        return modules::MakeResNet18({.num_classes = 10, .stem = modules::ResNetStem::kCifar}, g);
      },
      {4, 3, 32, 32}, 10, 1e-7, 1e-9, DType::kFloat64);
  SetBatchNormSplitReductions(was);
}

// The same with BatchNorm's split path (the default): its kernels and
// in-place per-channel reads through a whole model. At batch 4 every
// channel fits one block (batch_norm_test covers several; a larger batch
// would double the CPU reference's time in f64).
TEST(CudaModelsTest, ResNet18WithSplitBatchNormPathMatchesTheCpu) {
  const bool was = BatchNormSplitReductions();
  SetBatchNormSplitReductions(true);
  CompareModels(
      [](Generator& g) {
        return modules::MakeResNet18({.num_classes = 10, .stem = modules::ResNetStem::kCifar}, g);
      },
      {4, 3, 32, 32}, 10, 1e-7, 1e-9, DType::kFloat64);
  SetBatchNormSplitReductions(was);
}

// Five SGD steps (momentum 0.9, weight decay) of the CNN on one fixed batch:
// on the CPU with nn/optim's Sgd, on the GPU with the fused device update.
// The losses must fall and follow each other (rtol 1e-3 per step).
TEST(CudaModelsTest, CnnTrainingStepsWithDeviceSgdFollowTheCpu) {
  Init();
  Generator data(9);
  const Tensor images = Rand({32, 1, 28, 28}, {}, data);
  Tensor label_values = Empty({32});
  UniformFill(label_values, 0.0, 10.0, data);
  const Tensor labels = label_values.To(DType::kInt64);
  optim::SgdStepArgs o{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4};

  Generator gen_cpu(3), gen_gpu(3);
  auto cpu_model = modules::MakeCnn(gen_cpu);
  auto gpu_model = modules::MakeCnn(gen_gpu);
  gpu_model->To(kGpu);
  optim::Sgd cpu_opt(cpu_model->NamedParameters(),
                     {.lr = o.lr, .momentum = o.momentum, .weight_decay = o.weight_decay});
  std::vector<Tensor> buffers;
  for (const auto& [name, p] : gpu_model->NamedParameters()) {
    buffers.push_back(Zeros(p.shape(), {.dtype = p.dtype(), .device = kGpu}));
  }
  const Tensor x = images.To(kGpu), y = labels.To(kGpu);
  std::vector<double> cpu_losses, gpu_losses;
  for (int64_t step = 1; step <= 5; ++step) {
    cpu_opt.ZeroGrad();
    const Tensor cpu_loss = loss::CrossEntropy(cpu_model->Forward(images), labels);
    Backward(cpu_loss);
    cpu_opt.Step();
    cpu_losses.push_back(cpu_loss.Item());

    gpu_model->ZeroGrad();
    const Tensor gpu_loss = loss::CrossEntropy(gpu_model->Forward(x), y);
    Backward(gpu_loss);
    NoGradGuard no_grad;
    size_t i = 0;
    o.step = step;
    for (const auto& [name, p] : gpu_model->NamedParameters()) SgdStep(p, p.grad(), buffers[i++], o);
    gpu_losses.push_back(gpu_loss.Item());
  }
  EXPECT_LT(cpu_losses.back(), cpu_losses.front());
  for (size_t k = 0; k < cpu_losses.size(); ++k) {
    EXPECT_NEAR(gpu_losses[k], cpu_losses[k], 1e-3 * std::abs(cpu_losses[k])) << "step " << k + 1;
  }
}

// The loss and the input's gradient (on the CPU) of loss_of(x), x a leaf
// holding `input` on `device`.
std::pair<double, Tensor> LossAndGrad(const Tensor& input, Device device,
                                      const std::function<Tensor(const Tensor&)>& loss_of) {
  Tensor x = input.To(device).Detach();
  x.set_requires_grad(true);
  const Tensor loss = loss_of(x);
  Backward(loss);
  return {loss.Item(), x.grad().To(kCPU)};
}

// Class-weighted cross-entropy (log-softmax, then the nll_loss kernels; with
// label smoothing also the weighted uniform part) and NllLoss on spatial
// targets, each with one ignored target.
TEST(CudaModelsTest, WeightedCrossEntropyAndNllLossMatchTheCpu) {
  Init();
  Generator data(11);
  Tensor logits = Empty({16, 10});
  UniformFill(logits, -3.0, 3.0, data);
  Tensor label_values = Empty({16});
  UniformFill(label_values, 0.0, 10.0, data);
  Tensor labels = label_values.To(DType::kInt64);
  labels.Narrow(0, 3, 1).Fill(-100);
  Tensor weight = Empty({10});
  UniformFill(weight, 0.5, 2.0, data);
  for (double smoothing : {0.0, 0.1}) {
    for (loss::Reduction reduction : {loss::Reduction::kMean, loss::Reduction::kSum}) {
      const std::string what = "cross_entropy with weights, smoothing " + std::to_string(smoothing) +
                               (reduction == loss::Reduction::kMean ? ", mean" : ", sum");
      auto on = [&](Device device) {
        return LossAndGrad(logits, device, [&](const Tensor& x) {
          const loss::CrossEntropyOptions options{
              .reduction = reduction, .label_smoothing = smoothing, .weight = weight.To(device)};
          return loss::CrossEntropy(x, labels.To(device), options);
        });
      };
      const auto [cpu_loss, cpu_grad] = on(kCPU);
      const auto [gpu_loss, gpu_grad] = on(kGpu);
      EXPECT_NEAR(gpu_loss, cpu_loss, 1e-5 * std::abs(cpu_loss)) << what;
      ExpectTensorClose(what + ": dlogits", cpu_grad, gpu_grad, 1e-5, 1e-5);
    }
  }

  Tensor log_probs = Empty({4, 5, 3});
  UniformFill(log_probs, -4.0, 0.0, data);
  Tensor target_values = Empty({4, 3});
  UniformFill(target_values, 0.0, 5.0, data);
  Tensor target = target_values.To(DType::kInt64);
  target.Narrow(0, 1, 1).Narrow(1, 2, 1).Fill(-100);
  Tensor class_weight = Empty({5});
  UniformFill(class_weight, 0.5, 2.0, data);
  auto on = [&](Device device) {
    return LossAndGrad(log_probs, device, [&](const Tensor& x) {
      return loss::NllLoss(x, target.To(device), {.weight = class_weight.To(device)});
    });
  };
  const auto [cpu_loss, cpu_grad] = on(kCPU);
  const auto [gpu_loss, gpu_grad] = on(kGpu);
  EXPECT_NEAR(gpu_loss, cpu_loss, 1e-5 * std::abs(cpu_loss)) << "nll_loss [4, 5, 3] with weights";
  ExpectTensorClose("nll_loss [4, 5, 3] with weights: dlog_probs", cpu_grad, gpu_grad, 1e-5, 1e-5);
}

// The pointwise losses are compositions of elementwise ops and reductions;
// on the GPU they run on those kernels alone. BCE's logits include +-100
// (the stable form must stay finite on the device too).
TEST(CudaModelsTest, PointwiseLossesMatchTheCpu) {
  Init();
  Generator data(12);
  Tensor input = Empty({8, 5});
  UniformFill(input, -3.0, 3.0, data);
  Tensor target = Empty({8, 5});
  UniformFill(target, 0.05, 1.0, data);
  Tensor logits = input.Clone();
  logits.Narrow(0, 0, 1).Fill(100.0);
  logits.Narrow(0, 1, 1).Fill(-100.0);
  Tensor weight = Empty({8, 1});
  UniformFill(weight, 0.5, 2.0, data);
  Tensor pos_weight = Empty({5});
  UniformFill(pos_weight, 0.5, 3.0, data);
  const Tensor log_probs = input.Clone();  // any values: kl_div does not check them
  using LossFn = std::function<Tensor(const Tensor&, const Tensor&, Device)>;
  const std::vector<std::tuple<std::string, Tensor, LossFn>> cases = {
      {"l1", input, [](const Tensor& x, const Tensor& t, Device) { return loss::L1(x, t); }},
      {"smooth_l1 beta 0.5", input,
       [](const Tensor& x, const Tensor& t, Device) { return loss::SmoothL1(x, t, {.beta = 0.5}); }},
      {"huber delta 2, sum", input,
       [](const Tensor& x, const Tensor& t, Device) {
         return loss::Huber(x, t, {.reduction = loss::Reduction::kSum, .delta = 2.0});
       }},
      {"bce with logits, weights", logits,
       [&](const Tensor& x, const Tensor& t, Device device) {
         return loss::BinaryCrossEntropyWithLogits(
             x, t, {.weight = weight.To(device), .pos_weight = pos_weight.To(device)});
       }},
      {"kl_div batchmean", log_probs,
       [](const Tensor& x, const Tensor& t, Device) { return loss::KlDiv(x, t, {.batch_mean = true}); }},
      {"kl_div log_target, sum", log_probs,
       [](const Tensor& x, const Tensor& t, Device) {
         return loss::KlDiv(x, t, {.reduction = loss::Reduction::kSum, .log_target = true});
       }},
  };
  for (const auto& [what, x, fn] : cases) {
    auto on = [&](Device device) {
      return LossAndGrad(x, device, [&](const Tensor& xd) { return fn(xd, target.To(device), device); });
    };
    const auto [cpu_loss, cpu_grad] = on(kCPU);
    const auto [gpu_loss, gpu_grad] = on(kGpu);
    EXPECT_TRUE(std::isfinite(gpu_loss)) << what;
    EXPECT_NEAR(gpu_loss, cpu_loss, 1e-5 * std::abs(cpu_loss) + 1e-6) << what;
    ExpectTensorClose(what + ": dinput", cpu_grad, gpu_grad, 1e-5, 1e-5);
  }
}

TEST(CudaModelsTest, SecondStepAllocatesNoNewDeviceMemory) {
  Init();
  Generator data(8);
  const Tensor images = Rand({32, 1, 28, 28}, {}, data);
  Tensor label_values = Empty({32});
  UniformFill(label_values, 0.0, 10.0, data);
  const Tensor labels = label_values.To(DType::kInt64);
  Generator gen(1);
  auto model = modules::MakeCnn(gen);  // convolutions, pooling, linear layers
  model->To(kGpu);
  const Tensor x = images.To(kGpu), y = labels.To(kGpu);
  auto step = [&] {
    model->ZeroGrad();
    const Tensor loss = loss::CrossEntropy(model->Forward(x), y);
    Backward(loss);
    return loss.Item();
  };
  const double first = step();
  const uint64_t warm = CudaAllocator().Stats(kGpu).system_allocations;
  const double second = step();
  EXPECT_EQ(CudaAllocator().Stats(kGpu).system_allocations, warm);
  // Same weights (no optimizer step) and batch, and the cached algorithms
  // are deterministic for a fixed choice: the same loss.
  EXPECT_NEAR(first, second, 1e-6 * std::abs(first));
}

}  // namespace
}  // namespace ddp::nn::cuda
