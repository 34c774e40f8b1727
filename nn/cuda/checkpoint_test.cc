// Checkpoints and CUDA tensors (tag "gpu"): a state dict saved from cuda:0
// loads onto the CPU and onto cuda:0 with every byte intact (PyTorch's
// map_location), and a model's state moves between devices through a file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "nn/cuda/cuda.h"
#include "nn/io/checkpoint.h"
#include "nn/modules/models.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

std::string TmpPath(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return std::string(base ? base : "/tmp") + "/" + std::to_string(getpid()) + "_" + name;
}

void ExpectSameBytes(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  const Tensor ac = a.To(kCPU).Contiguous(), bc = b.To(kCPU).Contiguous();
  EXPECT_EQ(std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()), 0) << what;
}

TEST(CudaCheckpointTest, SavedOnTheGpuLoadsOnTheCpuAndOnTheGpu) {
  Init();
  Generator gen(4);
  auto model = modules::MakeResNet18({.num_classes = 10, .stem = modules::ResNetStem::kCifar}, gen);
  model->To(kGpu);
  const io::NamedTensors state = model->GetStateDict();
  // A non-contiguous GPU tensor and 16-bit dtypes too.
  io::NamedTensors saved = state;
  saved.emplace_back("transposed", Randn({5, 7}).To(kGpu).Transpose(0, 1));
  saved.emplace_back("half", Randn({9}).To(DType::kFloat16).To(kGpu));
  saved.emplace_back("bf16", Randn({9}).To(DType::kBFloat16).To(kGpu));
  const std::string path = TmpPath("gpu_state.safetensors");
  io::SaveTensors(path, saved);

  const io::LoadedTensors on_cpu = io::LoadTensors(path);
  const io::LoadedTensors on_gpu = io::LoadTensors(path, {.device = kGpu});
  ASSERT_EQ(on_cpu.tensors.size(), saved.size());
  ASSERT_EQ(on_gpu.tensors.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    ASSERT_EQ(on_cpu.tensors[i].first, saved[i].first);
    EXPECT_TRUE(on_cpu.tensors[i].second.device().is_cpu()) << saved[i].first;
    EXPECT_EQ(on_gpu.tensors[i].second.device(), kGpu) << saved[i].first;
    ExpectSameBytes(saved[i].second, on_cpu.tensors[i].second, saved[i].first + " (cpu)");
    ExpectSameBytes(saved[i].second, on_gpu.tensors[i].second, saved[i].first + " (gpu)");
  }

  // The state dict loads into a fresh model on the CPU: same parameters.
  Generator other(99);
  auto cpu_model = modules::MakeResNet18({.num_classes = 10, .stem = modules::ResNetStem::kCifar}, other);
  io::NamedTensors model_state(on_cpu.tensors.begin(), on_cpu.tensors.begin() + state.size());
  cpu_model->LoadStateDict(model_state);
  const io::NamedTensors loaded = cpu_model->GetStateDict();
  for (size_t i = 0; i < state.size(); ++i) ExpectSameBytes(state[i].second, loaded[i].second, state[i].first);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace ddp::nn::cuda
