// Checkpoints and CUDA tensors (tag "gpu"): a state dict saved from cuda:0
// loads onto the CPU and onto cuda:0 with every byte intact (PyTorch's
// map_location), a device map sends each saved device where it says, a
// model's state moves between devices through a file, and an optimizer's
// device state saved from cuda:0 resumes on the CPU.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "nn/cuda/cuda.h"
#include "nn/cuda/stream.h"
#include "nn/io/checkpoint.h"
#include "nn/modules/models.h"
#include "nn/optim/adam.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

std::string TmpPath(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return std::string(base ? base : "/tmp") + "/" + std::to_string(getpid()) + "_" + name;
}

// A gradient that depends on the parameter: (w - 0.3) + 0.1 sin(step + 0.7 i), on the CPU.
Tensor GradFor(const Tensor& w, int step) {
  std::vector<double> v = w.ToVector<double>();
  for (size_t i = 0; i < v.size(); ++i) v[i] = (v[i] - 0.3) + 0.1 * std::sin(step + 0.7 * i);
  return FromVector(v, w.shape());
}

void ExpectSameBytes(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  const Tensor ac = a.Detach().To(kCPU).Contiguous(), bc = b.Detach().To(kCPU).Contiguous();
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

TEST(CudaCheckpointTest, DeviceMapSendsEachSavedDeviceToItsTarget) {
  Init();
  const Tensor on_gpu = Randn({6, 5}).To(kGpu);
  const Tensor on_cpu = Randn({4});
  const std::string path = TmpPath("mixed.safetensors");
  io::SaveTensors(path, {{"gpu", on_gpu}, {"cpu", on_cpu}});
  // The file says where each tensor came from (only the non-CPU one).
  EXPECT_EQ(io::SafetensorsFile::Read(path).metadata().at(io::kDevicesKey), R"({"gpu":"cuda:0"})");

  struct Case {
    std::map<std::string, std::string> map;
    Device device;
    Device gpu_target, cpu_target;
  };
  const Case cases[] = {
      {{{"cuda:0", "cpu"}}, kCPU, kCPU, kCPU},
      {{{"cuda:0", "cuda:0"}}, kCPU, kGpu, kCPU},
      {{{"cuda:0", "cpu"}, {"cpu", "cuda:0"}}, kCPU, kCPU, kGpu},
      {{{"cuda", "cpu"}}, kGpu, kCPU, kGpu},  // unmapped (cpu) goes to .device
      {{}, kGpu, kGpu, kGpu},
  };
  for (const Case& c : cases) {
    const io::LoadedTensors t = io::LoadTensors(path, {.device = c.device, .device_map = c.map});
    ASSERT_EQ(t.tensors.size(), 2u);
    EXPECT_EQ(t.tensors[0].second.device(), c.gpu_target) << c.gpu_target.ToString();
    EXPECT_EQ(t.tensors[1].second.device(), c.cpu_target) << c.cpu_target.ToString();
    ExpectSameBytes(on_gpu, t.tensors[0].second, "gpu");
    ExpectSameBytes(on_cpu, t.tensors[1].second, "cpu");
    EXPECT_EQ(t.metadata.count(io::kDevicesKey), 0u);
  }
  std::remove(path.c_str());
}

// A device map or target past the visible GPUs fails before the file is
// read, naming the entry.
TEST(CudaCheckpointTest, DeviceThatDoesNotExistIsRefusedBeforeTheFileIsRead) {
  Init();
  const std::string missing = "cuda:" + std::to_string(DeviceCount());
  const std::string path = TmpPath("never_written.safetensors");
  auto error_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "(no std::invalid_argument)";
  };
  const std::string by_map =
      error_of([&] { io::LoadTensors(path, {.device_map = {{"cuda:0", missing}}}); });
  EXPECT_NE(by_map.find("device_map entry \"cuda:0\" -> \"" + missing + "\""), std::string::npos)
      << by_map;
  EXPECT_NE(by_map.find(missing + " does not exist"), std::string::npos) << by_map;
  const std::string by_device =
      error_of([&] { io::LoadTensors(path, {.device = Device::Parse(missing)}); });
  EXPECT_NE(by_device.find("LoadOptions::device: " + missing + " does not exist"), std::string::npos)
      << by_device;
}

TEST(CudaCheckpointTest, OptimizerStateSavedOnCuda0ResumesOnTheCpu) {
  Init();
  Generator gen(8);
  const Tensor w0 = Randn({32, 17}, {}, gen);
  const Tensor gpu_w = w0.To(kGpu), cpu_w = w0.Clone();
  optim::Adam gpu_opt({{"w", gpu_w}}, {.lr = 1e-2});
  for (int s = 0; s < 3; ++s) {
    gpu_w.set_grad(GradFor(gpu_w.To(kCPU), s).To(kGpu));
    gpu_opt.Step();
  }
  io::Checkpoint ckpt;
  ckpt.model = {{"w", gpu_w}};
  ckpt.optimizer = gpu_opt.StateDict();
  for (const auto& [k, t] : ckpt.optimizer) {
    if (k.find("exp_avg") != std::string::npos) {
      EXPECT_EQ(t.device(), kGpu) << k;
    }
  }
  const std::string path = TmpPath("adam_gpu.safetensors");
  io::SaveCheckpoint(path, ckpt);

  const io::Checkpoint back = io::LoadCheckpoint(path, {.device_map = {{"cuda:0", "cpu"}}});
  for (const auto& [k, t] : back.optimizer) EXPECT_TRUE(t.device().is_cpu()) << k;
  cpu_w.CopyFrom(back.model[0].second);
  optim::Adam cpu_opt({{"w", cpu_w}}, {.lr = 1e-2});
  cpu_opt.LoadStateDict(back.optimizer);
  // One more step on each side from the same state: the same parameters.
  const Tensor g = GradFor(cpu_w, 3);
  cpu_w.set_grad(g);
  gpu_w.set_grad(g.To(kGpu));
  cpu_opt.Step();
  gpu_opt.Step();
  const std::vector<double> a = cpu_w.ToVector<double>(), b = gpu_w.To(kCPU).ToVector<double>();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * std::max(1.0, std::abs(a[i]))) << i;
  std::remove(path.c_str());
}

}  // namespace
}  // namespace ddp::nn::cuda
