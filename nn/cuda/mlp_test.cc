// A whole model on cuda:0 against the same model on the CPU (tag "gpu"): the
// peers' MLP (784-512-256-10 with ReLU), batch 64, cross-entropy, one
// forward and backward. Same initial weights (same seed), same batch.
// Tolerances: loss rtol 1e-5; every gradient |gpu - cpu| <= 1e-5 + 1e-4 *
// |cpu| (the GPU's GEMM and sums accumulate in a different order).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "nn/autograd/engine.h"
#include "nn/cuda/allocator.h"
#include "nn/cuda/cuda.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/ops/dispatch.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

struct StepResult {
  double loss;
  std::vector<std::pair<std::string, Tensor>> grads;  // on the CPU
  std::vector<int64_t> predictions;
};

StepResult Step(Device device, const Tensor& images, const Tensor& labels) {
  Generator gen(2024);
  auto model = modules::MakeMlp(gen);
  model->To(device);
  const Tensor logits = model->Forward(images.To(device));
  const Tensor loss = loss::CrossEntropy(logits, labels.To(device));
  Backward(loss);
  StepResult r;
  r.loss = loss.Item();
  for (const auto& [name, p] : model->NamedParameters()) {
    EXPECT_EQ(p.device(), device) << name;
    EXPECT_TRUE(p.grad().defined()) << name;
    r.grads.emplace_back(name, p.grad().To(kCPU));
  }
  NoGradGuard guard;
  const Tensor pred = Empty({images.size(0)}, {.dtype = DType::kInt64, .device = device});
  ops::KernelsFor(device.type).argmax(logits.Detach(), 1, pred);
  r.predictions = pred.To(kCPU).ToVector<int64_t>();
  return r;
}

TEST(CudaMlpTest, ForwardAndBackwardMatchTheCpu) {
  Init();
  Generator data(7);
  const Tensor images = Rand({64, 1, 28, 28}, {}, data);
  Tensor label_values = Empty({64});
  UniformFill(label_values, 0.0, 10.0, data);
  const Tensor labels = label_values.To(DType::kInt64);
  const StepResult cpu = Step(kCPU, images, labels);
  const StepResult gpu = Step(kGpu, images, labels);
  EXPECT_NEAR(gpu.loss, cpu.loss, 1e-5 * std::abs(cpu.loss));
  ASSERT_EQ(gpu.grads.size(), cpu.grads.size());
  for (size_t i = 0; i < cpu.grads.size(); ++i) {
    const auto& [name, g_cpu] = cpu.grads[i];
    ASSERT_EQ(gpu.grads[i].first, name);
    const std::vector<double> want = g_cpu.ToVector<double>();
    const std::vector<double> got = gpu.grads[i].second.ToVector<double>();
    ASSERT_EQ(got.size(), want.size()) << name;
    int bad = 0;
    for (size_t j = 0; j < want.size(); ++j) {
      if (!(std::abs(got[j] - want[j]) <= 1e-5 + 1e-4 * std::abs(want[j])) && ++bad <= 3) {
        ADD_FAILURE() << name << "[" << j << "]: cpu " << want[j] << ", gpu " << got[j];
      }
    }
    EXPECT_EQ(bad, 0) << name;
  }
  EXPECT_EQ(gpu.predictions, cpu.predictions);
}

TEST(CudaMlpTest, SecondStepAllocatesNoNewDeviceMemory) {
  Init();
  Generator data(8);
  const Tensor images = Rand({64, 1, 28, 28}, {}, data);
  Tensor label_values = Empty({64});
  UniformFill(label_values, 0.0, 10.0, data);
  const Tensor labels = label_values.To(DType::kInt64);
  Generator gen(1);
  auto model = modules::MakeMlp(gen);
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
  EXPECT_EQ(first, second);  // same weights (no optimizer step), same batch: same loss, bit for bit
}

}  // namespace
}  // namespace ddp::nn::cuda
