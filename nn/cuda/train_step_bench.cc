// Prints images/s of one training step's forward and backward on cuda:0
// (no optimizer step: nn/optim updates on the CPU only so far), for a model
// on synthetic data. Needs a GPU. Compare with PyTorch on the same GPU and
// settings (the same model, batch, dtype and TF32 choice).
//
//   bazel run --config=cuda //nn/cuda:train_step_bench -- --model=resnet50 --batch=256
//   bazel run --config=cuda //nn/cuda:train_step_bench -- --model=cnn --batch=128 --tf32
#include <gflags/gflags.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>

#include "nn/autograd/engine.h"
#include "nn/cuda/allocator.h"
#include "nn/cuda/cuda.h"
#include "nn/cuda/stream.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

DEFINE_string(model, "resnet50", "mlp, cnn, resnet18 or resnet50 (ResNets with the CIFAR stem, 32x32 input)");
DEFINE_int64(batch, 256, "images per step");
DEFINE_int32(warmup, 3, "steps before timing (the first searches convolution algorithms)");
DEFINE_int32(steps, 10, "timed steps");
DEFINE_bool(tf32, false, "allow TF32 tensor cores for f32 GEMM and convolution");

namespace ddp::nn::cuda {
namespace {

int Main() {
  Init();
  SetAllowTf32(FLAGS_tf32);
  const Device gpu(DeviceType::kCUDA, 0);
  std::shared_ptr<modules::Module> model;
  Shape input;
  if (FLAGS_model == "mlp") {
    model = modules::MakeMlp();
    input = {FLAGS_batch, 1, 28, 28};
  } else if (FLAGS_model == "cnn") {
    model = modules::MakeCnn();
    input = {FLAGS_batch, 1, 28, 28};
  } else if (FLAGS_model == "resnet18" || FLAGS_model == "resnet50") {
    const modules::ResNetOptions o{.num_classes = 10, .stem = modules::ResNetStem::kCifar};
    model = FLAGS_model == "resnet18" ? std::shared_ptr<modules::Module>(modules::MakeResNet18(o))
                                      : std::shared_ptr<modules::Module>(modules::MakeResNet50(o));
    input = {FLAGS_batch, 3, 32, 32};
  } else {
    throw std::invalid_argument("--model must be mlp, cnn, resnet18 or resnet50, got `" + FLAGS_model + "`");
  }
  if (FLAGS_batch < 1 || FLAGS_steps < 1 || FLAGS_warmup < 0) {
    throw std::invalid_argument("--batch and --steps must be >= 1 and --warmup >= 0");
  }
  model->To(gpu);
  model->Train();
  const Tensor images = Randn(input).To(gpu);
  Tensor label_values = Empty({FLAGS_batch});
  UniformFill(label_values, 0.0, 10.0);
  const Tensor labels = label_values.To(DType::kInt64).To(gpu);
  auto step = [&] {
    model->ZeroGrad();
    const Tensor loss = loss::CrossEntropy(model->Forward(images), labels);
    Backward(loss);
  };
  for (int i = 0; i < FLAGS_warmup; ++i) step();
  SynchronizeDevice(gpu);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < FLAGS_steps; ++i) step();
  SynchronizeDevice(gpu);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const AllocatorStats st = CudaAllocator().Stats(gpu);
  std::printf("model %s batch %lld tf32 %s: %.1f images/s (%.2f ms/step over %d steps); device memory in use "
              "%.1f MiB, peak %.1f MiB, cached %.1f MiB, cudaMalloc calls %llu\n",
              FLAGS_model.c_str(), static_cast<long long>(FLAGS_batch), FLAGS_tf32 ? "on" : "off",
              FLAGS_batch * FLAGS_steps / seconds, 1e3 * seconds / FLAGS_steps, FLAGS_steps,
              st.in_use_bytes / 1048576.0, st.peak_in_use_bytes / 1048576.0, st.cached_bytes / 1048576.0,
              static_cast<unsigned long long>(st.system_allocations));
  return 0;
}

}  // namespace
}  // namespace ddp::nn::cuda

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  try {
    return ddp::nn::cuda::Main();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_step_bench: %s\n", e.what());
    return 1;
  }
}
