// Prints images/s of whole training steps on cuda:0 (forward, cross-entropy,
// backward, nn::optim::Sgd with momentum) for a model on synthetic data, one
// machine-readable line per precision mode. Needs a GPU. Modes: fp32; bf16
// (autocast, f32 master weights); fp16 (autocast and the dynamic loss
// scaler, nn::optim::GradScaler), as PyTorch's AMP recipe has it.
// tools/bench/torch_train_step_bench.py does the same in PyTorch and prints
// the same line; tools/gpu_check.sh runs both and prints the ratios.
//
//   bazel run --config=cuda //nn/cuda:train_step_bench -- --model=resnet50 --batch=256 --modes=fp32,bf16,fp16
//   bazel run --config=cuda //nn/cuda:train_step_bench -- --model=cnn --batch=128 --tf32 --optimizer=false
//   bazel run --config=cuda //nn/cuda:train_step_bench -- --device=cpu --batch=2 --steps=1   # smoke test
//
// Output, per mode (keys are stable; tools/gpu_check.sh parses them):
//   BENCH impl=ours model=resnet50 mode=fp32 batch=256 warmup=5 steps=20 optimizer=sgd tf32=off
//         images_per_s=... ms_per_step=... final_loss=... skipped_steps=0 params=...
#include <cuda_profiler_api.h>
#include <gflags/gflags.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "nn/autograd/engine.h"
#include "nn/cuda/allocator.h"
#include "nn/cuda/cuda.h"
#include "nn/cuda/stream.h"
#include "nn/io/checkpoint.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/ops/autocast.h"
#include "nn/ops/functional.h"
#include "nn/optim/grad_scaler.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

DEFINE_string(model, "resnet50", "mlp, cnn, resnet18 or resnet50 (ResNets with the CIFAR stem, 32x32 input)");
DEFINE_int64(batch, 256, "images per step");
DEFINE_string(modes, "fp32",
              "comma-separated precision modes, each timed on a fresh model: fp32, bf16 (autocast), fp16 "
              "(autocast and GradScaler)");
DEFINE_int32(warmup, 5, "untimed steps first (the first ones search convolution algorithms)");
DEFINE_int32(steps, 20, "timed steps");
DEFINE_bool(tf32, false, "allow TF32 tensor cores for f32 GEMM and convolution");
DEFINE_bool(optimizer, true,
            "include the SGD update (lr 0.01, momentum 0.9, weight decay 5e-4) in each step; false: forward "
            "and backward only");
DEFINE_bool(print_loss, false,
            "print a LOSS line after every step (a diagnosis of training: each line waits for the device, "
            "so the timing is not a figure to compare)");
DEFINE_string(save_init, "",
              "write the first mode's initial state dict and its batch (tensors `input.images`, "
              "`input.labels`) to this safetensors file, for running the same start in PyTorch "
              "(tools/bench/torch_train_step_bench.py --load_init)");
DEFINE_bool(profiler_range, false,
            "bracket the timed steps with cudaProfilerStart/Stop, for `ncu --profile-from-start off` "
            "(kernels of the timed steps only)");
DEFINE_uint64(seed, 1, "seed of the model's initialization and the synthetic batch");
DEFINE_string(device, "cuda:0",
              "cuda:N, or cpu for a smoke test of this benchmark without a GPU (tiny --batch; not a figure to "
              "compare)");

namespace ddp::nn::cuda {
namespace {

// The peer script uses the same values (tools/bench/torch_train_step_bench.py).
constexpr optim::SgdOptions kSgd{.lr = 0.01, .momentum = 0.9, .weight_decay = 5e-4};

struct Mode {
  std::optional<DType> autocast;  // nullopt: f32 throughout
  bool loss_scaler = false;       // f16 needs it (range); bf16 does not
};

Mode ParseMode(const std::string& name) {
  if (name == "fp32") return {};
  if (name == "bf16") return {.autocast = DType::kBFloat16};
  if (name == "fp16") return {.autocast = DType::kFloat16, .loss_scaler = true};
  throw std::invalid_argument("--modes: unknown mode `" + name + "` (known: fp32, bf16, fp16)");
}

std::vector<std::string> SplitModes(const std::string& list) {
  std::vector<std::string> names;
  std::stringstream in(list);
  for (std::string name; std::getline(in, name, ',');) {
    ParseMode(name);  // reject a bad list before any step runs
    names.push_back(name);
  }
  if (names.empty()) throw std::invalid_argument("--modes is empty");
  return names;
}

struct Model {
  std::shared_ptr<modules::Module> module;
  Shape input;
};

Model MakeModel(Generator& gen) {
  if (FLAGS_model == "mlp") return {modules::MakeMlp(gen), {FLAGS_batch, 1, 28, 28}};
  if (FLAGS_model == "cnn") return {modules::MakeCnn(gen), {FLAGS_batch, 1, 28, 28}};
  const modules::ResNetOptions o{.num_classes = 10, .stem = modules::ResNetStem::kCifar};
  if (FLAGS_model == "resnet18") return {modules::MakeResNet18(o, gen), {FLAGS_batch, 3, 32, 32}};
  if (FLAGS_model == "resnet50") return {modules::MakeResNet50(o, gen), {FLAGS_batch, 3, 32, 32}};
  throw std::invalid_argument("--model must be mlp, cnn, resnet18 or resnet50, got `" + FLAGS_model + "`");
}

// Times one mode on a fresh model and prints its BENCH line.
void RunMode(const std::string& mode_name, Device device) {
  const Mode mode = ParseMode(mode_name);
  Generator gen(FLAGS_seed);
  Model m = MakeModel(gen);
  m.module->To(device);
  m.module->Train();
  const Tensor images = Randn(m.input, {}, gen).To(device);
  Tensor label_values = Empty({FLAGS_batch});
  UniformFill(label_values, 0.0, 10.0, gen);
  const Tensor labels = label_values.To(DType::kInt64).To(device);
  if (!FLAGS_save_init.empty()) {
    io::NamedTensors state = m.module->GetStateDict();
    state.emplace_back("input.images", images);
    state.emplace_back("input.labels", labels);
    io::SaveTensors(FLAGS_save_init, state);
    FLAGS_save_init.clear();  // the first mode's start only
  }

  // Printed so that tools/gpu_check.sh can tell when the two sides built different models.
  int64_t param_count = 0;
  for (const auto& [name, p] : m.module->NamedParameters()) param_count += p.numel();
  optim::Sgd opt(m.module->NamedParameters(), kSgd);
  optim::GradScaler scaler({.enabled = mode.loss_scaler});
  int64_t skipped_steps = 0;
  Tensor loss;
  int step_index = 0;
  auto step = [&] {
    opt.ZeroGrad();
    {
      AutocastGuard guard(mode.autocast);
      loss = loss::CrossEntropy(m.module->Forward(images), labels);
    }
    if (FLAGS_print_loss) {
      std::printf("LOSS impl=ours mode=%s step=%d loss=%.6f\n", mode_name.c_str(), step_index, loss.Item());
    }
    ++step_index;
    Backward(mode.loss_scaler ? ops::MulScalar(loss, scaler.scale()) : loss);
    if (!FLAGS_optimizer) return;
    if (mode.loss_scaler) {
      skipped_steps += scaler.Step(opt) ? 0 : 1;
      scaler.Update();
    } else {
      opt.Step();
    }
  };
  auto sync = [&] {
    if (device.is_cuda()) SynchronizeDevice(device);
  };
  for (int i = 0; i < FLAGS_warmup; ++i) step();
  sync();
  skipped_steps = 0;
  const auto start = std::chrono::steady_clock::now();
  if (FLAGS_profiler_range && device.is_cuda()) cudaProfilerStart();
  for (int i = 0; i < FLAGS_steps; ++i) step();
  sync();
  if (FLAGS_profiler_range && device.is_cuda()) cudaProfilerStop();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double final_loss = loss.Item();
  if (!std::isfinite(final_loss)) {
    throw std::runtime_error("mode " + mode_name + ": the loss is " + std::to_string(final_loss) +
                             " after the timed steps; the figures would be meaningless");
  }
  std::printf(
      "BENCH impl=ours model=%s mode=%s batch=%lld warmup=%d steps=%d optimizer=%s tf32=%s images_per_s=%.1f "
      "ms_per_step=%.2f final_loss=%.4f skipped_steps=%lld params=%lld device=%s\n",
      FLAGS_model.c_str(), mode_name.c_str(), static_cast<long long>(FLAGS_batch), FLAGS_warmup, FLAGS_steps,
      FLAGS_optimizer ? "sgd" : "none", FLAGS_tf32 ? "on" : "off", FLAGS_batch * FLAGS_steps / seconds,
      1e3 * seconds / FLAGS_steps, final_loss, static_cast<long long>(skipped_steps),
      static_cast<long long>(param_count), device.ToString().c_str());
  if (!device.is_cuda()) return;
  const AllocatorStats st = CudaAllocator().Stats(device);
  std::printf("  after %s: device memory in use %.1f MiB, peak %.1f MiB, cached %.1f MiB, cudaMalloc calls %llu "
              "(the allocator's counters since the process started)\n",
              mode_name.c_str(), st.in_use_bytes / 1048576.0, st.peak_in_use_bytes / 1048576.0,
              st.cached_bytes / 1048576.0, static_cast<unsigned long long>(st.system_allocations));
}

int Main() {
  if (FLAGS_batch < 1 || FLAGS_steps < 1 || FLAGS_warmup < 0) {
    throw std::invalid_argument("--batch and --steps must be >= 1 and --warmup >= 0");
  }
  const std::vector<std::string> modes = SplitModes(FLAGS_modes);
  const Device device = Device::Parse(FLAGS_device);
  Init();
  SetAllowTf32(FLAGS_tf32);
  // A mode that fails does not stop the next ones (one GPU run must yield as
  // many figures as it can); the exit status says that one failed.
  int status = 0;
  for (const std::string& mode : modes) {
    try {
      RunMode(mode, device);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "train_step_bench: mode %s failed: %s\n", mode.c_str(), e.what());
      status = 1;
    }
    std::fflush(stdout);  // each mode's line out at once: a later mode may be cut off by a timeout
  }
  return status;
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
