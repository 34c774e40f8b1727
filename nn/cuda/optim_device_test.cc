// nn/optim on cuda:0 (tag "gpu"): the optimizers, the loss scaler and
// gradient clipping on device parameters against the same calls on the CPU,
// and autocast training of the CNN on the GPU against the CPU's f32 run.
//
// Tolerances, |gpu - cpu| <= atol + rtol * |cpu|:
// - f32 and f64 updates after 3-6 steps: rtol 1e-5, atol 1e-6 (nvcc fuses
//   multiply-adds in the SGD and Adam kernels);
// - bf16 parameters (f32 master copies on both sides): rtol 1e-2, atol 1e-3,
//   one bf16 rounding of a master that agrees to 1e-5;
// - clipping: the norm to 1e-5 relative; the infinity norm exactly (a
//   maximum involves no rounding), NaN and inf as on the CPU.
// Autocast per model (one forward and backward of the MLP and of a small
// conv + batch-norm CNN on cuda:0 against the CPU in f32; the check and
// tolerances of nn/ops/autocast_training.h, which nn/ops:autocast_test runs
// on the CPU): logits within 2% (bf16) / 0.5% (f16) relative Frobenius
// error, gradients within 15%.
// Autocast training (30 steps on synthetic batches, since the GPU machine may
// lack the dataset; the scenario nn/ops:autocast_test runs on the CPU, where
// f16 follows f32 to 0.1% and bf16 to 1%): first loss within 1% (f16) / 2%
// (bf16) of the CPU's f32 loss, mean of the last 10 losses within 10% of
// the f32 run's and below 75% of the first loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "nn/cuda/cuda.h"
#include "nn/cuda/gpu_test_util.h"
#include "nn/cuda/optim_kernels.h"
#include "nn/ops/autocast_training.h"
#include "nn/optim/adadelta.h"
#include "nn/optim/adagrad.h"
#include "nn/optim/adam.h"
#include "nn/optim/clip_grad.h"
#include "nn/optim/grad_scaler.h"
#include "nn/optim/rmsprop.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/generator.h"

namespace ddp::nn::cuda {
namespace {

using ::ddp::nn::cuda::testing::ExpectClose;
using ::ddp::nn::cuda::testing::kGpu;
using ::ddp::nn::cuda::testing::RandnOf;
using ::ddp::nn::cuda::testing::Tol;
using optim::NamedParameters;

using Factory = std::function<std::unique_ptr<optim::Optimizer>(NamedParameters)>;

std::vector<std::pair<std::string, Factory>> AllOptimizers() {
  using namespace optim;  // NOLINT: option structs only
  return {
      {"sgd", [](NamedParameters p) { return std::make_unique<Sgd>(p, SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true}); }},
      {"sgd_plain", [](NamedParameters p) { return std::make_unique<Sgd>(p, SgdOptions{.lr = 0.1}); }},
      {"adam", [](NamedParameters p) { return std::make_unique<Adam>(p, AdamOptions{.lr = 1e-2, .weight_decay = 1e-2, .amsgrad = true}); }},
      {"adamw", [](NamedParameters p) { return std::make_unique<AdamW>(p, AdamWOptions{.lr = 1e-2}); }},
      {"adadelta", [](NamedParameters p) { return std::make_unique<Adadelta>(p, AdadeltaOptions{.weight_decay = 1e-2}); }},
      {"rmsprop", [](NamedParameters p) { return std::make_unique<Rmsprop>(p, RmspropOptions{.weight_decay = 1e-2, .momentum = 0.9, .centered = true}); }},
      {"rmsprop_maximize", [](NamedParameters p) { return std::make_unique<Rmsprop>(p, RmspropOptions{.alpha = 0.3, .centered = true, .maximize = true}); }},
      {"adagrad", [](NamedParameters p) { return std::make_unique<Adagrad>(p, AdagradOptions{.lr = 0.1, .lr_decay = 0.5, .weight_decay = 1e-2, .initial_accumulator_value = 0.3, .maximize = true}); }},
  };
}

// 2112 and 64 elements: several blocks, and a tail.
NamedParameters MakeParams(DType dtype, Device device, uint64_t seed) {
  Generator gen(seed);
  return {{"fc.weight", Randn({64, 33}, {}, gen).To(dtype).To(device)},
          {"fc.bias", Randn({64}, {}, gen).To(dtype).To(device)}};
}

// The same gradients on both sides, computed on the CPU from the CPU's
// parameters (so the trajectory feeds back), times `scale`.
void SetGrads(const NamedParameters& cpu, const NamedParameters& gpu, int step, double scale = 1.0) {
  for (size_t k = 0; k < cpu.size(); ++k) {
    const Tensor& p = cpu[k].second;
    std::vector<double> v = p.ToVector<double>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = scale * ((v[i] - 0.3) + 0.1 * std::sin(step + 0.7 * i));
    const Tensor g = FromVector(v, p.shape(), {.dtype = p.dtype()});
    p.set_grad(g);
    gpu[k].second.set_grad(g.To(kGpu));
  }
}

Tol ParamTol(DType dtype) { return dtype == DType::kBFloat16 ? Tol{1e-2, 1e-3} : Tol{1e-5, 1e-6}; }

void ExpectParamsClose(const NamedParameters& cpu, const NamedParameters& gpu, DType dtype) {
  for (size_t k = 0; k < cpu.size(); ++k) {
    EXPECT_EQ(gpu[k].second.device(), kGpu);
    EXPECT_EQ(gpu[k].second.dtype(), dtype);
    ExpectClose(cpu[k].second, gpu[k].second, ParamTol(dtype), cpu[k].first);
  }
}

TEST(OptimDeviceTest, EveryOptimizerOnCudaFollowsTheCpu) {
  Init();
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    for (const auto& [name, make] : AllOptimizers()) {
      SCOPED_TRACE(name + " " + std::string(DTypeName(dtype)));
      NamedParameters cpu = MakeParams(dtype, kCPU, 1), gpu = MakeParams(dtype, kGpu, 1);
      auto cpu_opt = make(cpu);
      auto gpu_opt = make(gpu);
      EXPECT_EQ(gpu_opt->device(), kGpu);
      for (int s = 0; s < 3; ++s) {
        SetGrads(cpu, gpu, s);
        cpu_opt->Step();
        gpu_opt->Step();
      }
      ExpectParamsClose(cpu, gpu, dtype);
      // State stays on the device; "lr", the options and the step counts are
      // host tensors.
      const optim::NamedTensors cs = cpu_opt->StateDict(), gs = gpu_opt->StateDict();
      ASSERT_EQ(cs.size(), gs.size());
      for (size_t i = 0; i < cs.size(); ++i) {
        ASSERT_EQ(gs[i].first, cs[i].first);
        const std::string& key = gs[i].first;
        const bool host_scalar =
            key.rfind("state.", 0) != 0 || (key.size() > 5 && key.compare(key.size() - 5, 5, ".step") == 0);
        EXPECT_EQ(gs[i].second.device(), host_scalar ? kCPU : kGpu) << gs[i].first;
        EXPECT_EQ(gs[i].second.dtype(), cs[i].second.dtype()) << gs[i].first;
        ExpectClose(cs[i].second, gs[i].second, Tol{1e-5, 1e-6}, gs[i].first);
      }
      // The CPU's state loaded into a new GPU optimizer continues like the CPU.
      NamedParameters gpu2 = MakeParams(dtype, kGpu, 9);
      for (size_t k = 0; k < cpu.size(); ++k) gpu2[k].second.CopyFrom(cpu[k].second);
      auto gpu2_opt = make(gpu2);
      gpu2_opt->LoadStateDict(cs);
      for (int s = 3; s < 5; ++s) {
        SetGrads(cpu, gpu2, s);
        cpu_opt->Step();
        gpu2_opt->Step();
      }
      ExpectParamsClose(cpu, gpu2, dtype);
      for (const auto& [key, t] : gpu2_opt->StateDict()) {
        if (key.find(".exp_avg") != std::string::npos || key.find(".momentum_buffer") != std::string::npos ||
            key.find(".square_avg") != std::string::npos || key.find(".master") != std::string::npos) {
          EXPECT_EQ(t.device(), kGpu) << key;
        }
      }
    }
  }
}

TEST(OptimDeviceTest, GradScalerOnCudaSkipsInfAndFollowsTheCpu) {
  Init();
  NamedParameters cpu = MakeParams(DType::kFloat32, kCPU, 3), gpu = MakeParams(DType::kFloat32, kGpu, 3);
  optim::Adam cpu_opt(cpu, {.lr = 1e-2}), gpu_opt(gpu, {.lr = 1e-2});
  optim::GradScaler cpu_scaler({.init_scale = 1024}), gpu_scaler({.init_scale = 1024});
  for (int s = 0; s < 4; ++s) {
    SetGrads(cpu, gpu, s, 1024.0);
    if (s % 2 == 1) {  // explicit unscale on odd steps, fused on even ones
      cpu_scaler.Unscale(cpu_opt);
      gpu_scaler.Unscale(gpu_opt);
      ExpectClose(cpu[0].second.grad(), gpu[0].second.grad(), Tol{1e-6, 0}, "unscaled gradient");
    }
    EXPECT_TRUE(cpu_scaler.Step(cpu_opt));
    EXPECT_TRUE(gpu_scaler.Step(gpu_opt));
    EXPECT_FALSE(gpu_scaler.found_inf());
    cpu_scaler.Update();
    gpu_scaler.Update();
  }
  ExpectParamsClose(cpu, gpu, DType::kFloat32);

  // An inf in one gradient on the device: no step, the scale backs off.
  const Tensor before = gpu[1].second.To(kCPU);
  SetGrads(cpu, gpu, 9, 1024.0);
  Tensor bad = cpu[0].second.grad().Clone();
  bad.data<float>()[100] = std::numeric_limits<float>::infinity();
  gpu[0].second.set_grad(bad.To(kGpu));
  EXPECT_FALSE(gpu_scaler.Step(gpu_opt));
  EXPECT_TRUE(gpu_scaler.found_inf());
  gpu_scaler.Update();
  EXPECT_EQ(gpu_scaler.scale(), 512.0);
  ExpectClose(before, gpu[1].second, Tol{0, 0}, "parameter after a skipped step");
  // A NaN found by an explicit Unscale on the device.
  bad.data<float>()[100] = std::nanf("");
  gpu[0].second.set_grad(bad.To(kGpu));
  gpu_scaler.Unscale(gpu_opt);
  EXPECT_FALSE(gpu_scaler.Step(gpu_opt));
  gpu_scaler.Update();
  EXPECT_EQ(gpu_scaler.scale(), 256.0);
  // The device flag is reset for the next iteration: a finite step goes through.
  SetGrads(cpu, gpu, 10, 256.0);
  EXPECT_TRUE(gpu_scaler.Step(gpu_opt));
  EXPECT_FALSE(gpu_scaler.found_inf());
  gpu_scaler.Update();
}

TEST(OptimDeviceTest, ClipGradNormOnCudaMatchesTheCpu) {
  Init();
  for (double norm_type : {2.0, 1.0, 3.0}) {
    SCOPED_TRACE(norm_type);
    NamedParameters cpu = MakeParams(DType::kFloat32, kCPU, 4), gpu = MakeParams(DType::kFloat32, kGpu, 4);
    SetGrads(cpu, gpu, 1);
    const double cn = optim::ClipGradNorm({cpu[0].second, cpu[1].second}, 0.5, norm_type);
    const double gn = optim::ClipGradNorm({gpu[0].second, gpu[1].second}, 0.5, norm_type);
    EXPECT_GT(cn, 0.5);
    EXPECT_NEAR(gn, cn, 1e-5 * cn);
    for (size_t k = 0; k < cpu.size(); ++k) {
      ExpectClose(cpu[k].second.grad(), gpu[k].second.grad(), Tol{1e-5, 1e-7}, cpu[k].first);
    }
  }
}

// Adadelta (its fused kernel) with and without weight decay, in f32 and f64,
// with the loss scaler's fused unscale, on sizes with tails.
TEST(OptimDeviceTest, AdadeltaOnCudaFollowsTheCpu) {
  Init();
  auto make = [](DType dtype, Device device) {
    Generator gen(5);
    return NamedParameters{{"a", Randn({1}, {}, gen).To(dtype).To(device)},
                           {"b", Randn({7, 3}, {}, gen).To(dtype).To(device)},
                           {"c", Randn({2113}, {}, gen).To(dtype).To(device)}};
  };
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    for (double wd : {0.0, 2e-2}) {
      for (bool scaler : {false, true}) {
        SCOPED_TRACE(std::string(DTypeName(dtype)) + " weight_decay " + std::to_string(wd) +
                     (scaler ? " with GradScaler" : ""));
        NamedParameters cpu = make(dtype, kCPU), gpu = make(dtype, kGpu);
        optim::Adadelta cpu_opt(cpu, {.lr = 0.5, .weight_decay = wd}), gpu_opt(gpu, {.lr = 0.5, .weight_decay = wd});
        optim::GradScaler cpu_scaler({.init_scale = 256}), gpu_scaler({.init_scale = 256});
        for (int s = 0; s < 6; ++s) {
          SetGrads(cpu, gpu, s, scaler ? 256.0 : 1.0);
          if (scaler) {
            ASSERT_TRUE(cpu_scaler.Step(cpu_opt));
            ASSERT_TRUE(gpu_scaler.Step(gpu_opt));
            cpu_scaler.Update();
            gpu_scaler.Update();
          } else {
            cpu_opt.Step();
            gpu_opt.Step();
          }
          ExpectParamsClose(cpu, gpu, dtype);
        }
        const optim::NamedTensors cs = cpu_opt.StateDict(), gs = gpu_opt.StateDict();
        ASSERT_EQ(cs.size(), gs.size());
        for (size_t i = 0; i < cs.size(); ++i) ExpectClose(cs[i].second, gs[i].second, Tol{1e-5, 1e-6}, gs[i].first);
      }
    }
  }
}

// Gradients of three parameters, one of them bf16, with `bad` at element
// `where` of the first (none when where < 0); returns the CPU's norm.
double ClipCase(double max_norm, double bad, int64_t where) {
  NamedParameters cpu = MakeParams(DType::kFloat32, kCPU, 6), gpu = MakeParams(DType::kFloat32, kGpu, 6);
  const Tensor third = RandnOf({301}, DType::kBFloat16);
  cpu.emplace_back("extra", third.Clone());
  gpu.emplace_back("extra", third.To(kGpu));
  SetGrads(cpu, gpu, 2);
  if (where >= 0) {
    Tensor g = cpu[0].second.grad();
    g.data<float>()[where] = static_cast<float>(bad);
    gpu[0].second.set_grad(g.To(kGpu));
  }
  std::vector<Tensor> cp, gp;
  for (size_t k = 0; k < cpu.size(); ++k) {
    cp.push_back(cpu[k].second);
    gp.push_back(gpu[k].second);
  }
  const double cn = optim::ClipGradNorm(cp, max_norm, optim::kInfNorm);
  const double gn = optim::ClipGradNorm(gp, max_norm, optim::kInfNorm);
  if (std::isnan(cn)) {
    EXPECT_TRUE(std::isnan(gn)) << gn;
  } else {
    EXPECT_EQ(gn, cn);
  }
  for (size_t k = 0; k < cpu.size(); ++k) {
    const std::vector<double> want = cpu[k].second.grad().ToVector<double>(),
                              got = gpu[k].second.grad().To(kCPU).ToVector<double>();
    EXPECT_EQ(want.size(), got.size()) << cpu[k].first;
    int bad_count = 0;
    for (size_t i = 0; i < std::min(want.size(), got.size()); ++i) {
      const bool same =
          std::isnan(want[i]) ? std::isnan(got[i]) : std::abs(got[i] - want[i]) <= 1e-6 * std::abs(want[i]);
      if (!same && ++bad_count <= 3) {
        ADD_FAILURE() << cpu[k].first << "[" << i << "]: cpu " << want[i] << ", gpu " << got[i];
      }
    }
  }
  return cn;
}

TEST(OptimDeviceTest, ClipGradNormInfinityNormOnCudaMatchesTheCpu) {
  Init();
  const double inf = std::numeric_limits<double>::infinity();
  // The largest |g| is about 3: clipped at 0.5, untouched at 100.
  EXPECT_GT(ClipCase(0.5, 0.0, -1), 0.5);
  EXPECT_LT(ClipCase(100.0, 0.0, -1), 100.0);
  for (double bad : {std::numeric_limits<double>::quiet_NaN(), inf, -inf}) {
    for (int64_t where : {0, 1000, 2111}) {
      SCOPED_TRACE(std::to_string(bad) + " at " + std::to_string(where));
      ClipCase(1.0, bad, where);
    }
  }
}

// Sizes for the multi-tensor launches: empty, one element, a chunk and one
// more, odd sizes, and last one tensor longer than a launch's 320 chunks,
// so that it continues in a second table.
std::vector<int64_t> ManySizes(int count) {
  std::vector<int64_t> sizes = {0, 1, 65537, 65536, 3, 0, 131071};
  for (int i = static_cast<int>(sizes.size()); i < count - 1; ++i) sizes.push_back(1 + (i * 7919) % 5000);
  sizes.push_back(65536 * 320 + 4099);
  return sizes;
}

// x * inv_scale as the kernel computes it: in f32 for f32, f16 and bf16
// (rounded back to the dtype), in f64 for f64.
Tensor UnscaledOnCpu(const Tensor& t, double inv_scale) {
  std::vector<double> v = t.ToVector<double>();
  for (double& x : v) {
    x = t.dtype() == DType::kFloat64 ? x * inv_scale
                                     : static_cast<double>(static_cast<float>(x) * static_cast<float>(inv_scale));
  }
  return FromVector(v, t.shape(), {.dtype = t.dtype()});
}

// 100 tensors of mixed dtypes (an undefined one among them) in one call:
// every element as the CPU computes it, and found_inf set exactly when one
// tensor holds an inf or NaN (the last tensor, past its first table; a
// middle one; none).
TEST(OptimDeviceTest, UnscaleAndCheckOverManyTensorsMatchesTheCpu) {
  Init();
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};
  const std::vector<int64_t> sizes = ManySizes(100);
  std::vector<Tensor> cpu;
  for (size_t i = 0; i < sizes.size(); ++i) cpu.push_back(RandnOf({sizes[i]}, dtypes[i % 4], 0.0, 100.0));
  constexpr double kInvScale = 0.37;  // not a power of two: every product rounds
  auto on_gpu = [&](int bad_tensor, double bad) {
    std::vector<Tensor> gpu;
    for (size_t i = 0; i < cpu.size(); ++i) {
      Tensor t = cpu[i];
      if (static_cast<int>(i) == bad_tensor) {
        std::vector<double> v = t.ToVector<double>();
        v[v.size() - 1] = bad;
        t = FromVector(v, t.shape(), {.dtype = t.dtype()});
      }
      gpu.push_back(t.To(kGpu));
    }
    gpu.insert(gpu.begin() + 40, Tensor());  // skipped
    return gpu;
  };
  auto flag_after = [&](const std::vector<Tensor>& gpu) {
    const Tensor flag = Zeros({1}, {.dtype = DType::kFloat32, .device = kGpu});
    UnscaleAndCheck(gpu, kInvScale, flag);
    return flag.To(kCPU).data<float>()[0];
  };

  const std::vector<Tensor> gpu = on_gpu(-1, 0.0);
  EXPECT_EQ(flag_after(gpu), 0.0f);
  for (size_t i = 0, k = 0; i < gpu.size(); ++i) {
    if (!gpu[i].defined()) continue;
    ExpectClose(UnscaledOnCpu(cpu[k], kInvScale), gpu[i], Tol{0, 0},
                "tensor " + std::to_string(k) + " " + std::string(DTypeName(cpu[k].dtype())));
    ++k;
  }
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(flag_after(on_gpu(99, inf)), 1.0f) << "inf at the end of the last tensor";
  EXPECT_EQ(flag_after(on_gpu(49, std::nan(""))), 1.0f) << "NaN in a middle (f16) tensor";
  EXPECT_EQ(flag_after(on_gpu(2, -inf)), 1.0f) << "-inf at the end of the first multi-chunk tensor";
}

// sgd_step_multi over many tensors (f32 and f64, odd sizes, one spanning two
// tables) gives bit for bit what SgdStep per tensor gives, on a first step
// (the buffer starts as d) and a later one.
TEST(OptimDeviceTest, SgdStepMultiEqualsPerTensorSgdStep) {
  Init();
  const std::vector<int64_t> sizes = ManySizes(60);
  const optim::SgdStepArgs configs[] = {{.lr = 0.1, .grad_scale = 0.5},
                                        {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true},
                                        {.lr = 0.02, .momentum = 0.8, .dampening = 0.25, .weight_decay = 1e-2}};
  for (const optim::SgdStepArgs& config : configs) {
    SCOPED_TRACE("momentum " + std::to_string(config.momentum) + " dampening " + std::to_string(config.dampening) +
                 (config.nesterov ? " nesterov" : ""));
    const bool momentum = config.momentum != 0;
    std::vector<Tensor> p_one, g_one, buf_one, p_multi, g_multi, buf_multi;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const DType dtype = i % 3 == 1 ? DType::kFloat64 : DType::kFloat32;
      const Tensor p = RandnOf({sizes[i]}, dtype), g = RandnOf({sizes[i]}, dtype), buf = RandnOf({sizes[i]}, dtype);
      p_one.push_back(p.To(kGpu));
      p_multi.push_back(p.To(kGpu));
      g_one.push_back(g.To(kGpu));
      g_multi.push_back(g.To(kGpu));
      buf_one.push_back(momentum ? buf.To(kGpu) : Tensor());
      buf_multi.push_back(momentum ? buf.To(kGpu) : Tensor());
    }
    for (int64_t step : {1, 2}) {
      optim::SgdStepArgs args = config;
      args.step = step;
      for (size_t i = 0; i < sizes.size(); ++i) SgdStep(p_one[i], g_one[i], buf_one[i], args);
      SgdStepMulti(p_multi, g_multi, buf_multi, args);
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      ExpectClose(p_one[i].To(kCPU), p_multi[i], Tol{0, 0}, "parameter " + std::to_string(i));
      if (momentum) ExpectClose(buf_one[i].To(kCPU), buf_multi[i], Tol{0, 0}, "buffer " + std::to_string(i));
    }
  }
}

TEST(OptimDeviceTest, AutocastModelsOnCudaMatchTheCpuF32Run) {
  Init();
  nn::testing::ExpectAutocastModelsMatchCpuF32(kGpu);
}

// The CNN under autocast on cuda:0: f16 with the loss scaler, and bf16 with and without.
TEST(OptimDeviceTest, AutocastCnnTrainsOnCudaAndFollowsTheCpuF32Run) {
  Init();
  const std::vector<data::Batch> batches = nn::testing::SyntheticBatches(30);
  constexpr double kLr = 0.01;
  const nn::testing::Trajectory ref = nn::testing::TrainCnn(kCPU, std::nullopt, false, batches, kLr);
  EXPECT_LT(nn::testing::MeanLoss(ref.losses, 20, 30), 0.75 * ref.losses[0]);
  const double ref_last = nn::testing::MeanLoss(ref.losses, 20, 30);
  struct Case {
    DType dtype;
    bool scaler;
    double first_tol;
  };
  for (const Case& c : {Case{DType::kFloat16, true, 0.01}, Case{DType::kBFloat16, false, 0.02},
                        Case{DType::kBFloat16, true, 0.02}}) {
    SCOPED_TRACE(std::string(DTypeName(c.dtype)) + (c.scaler ? " with GradScaler" : ""));
    const nn::testing::Trajectory t = nn::testing::TrainCnn(kGpu, c.dtype, c.scaler, batches, kLr);
    const double last = nn::testing::MeanLoss(t.losses, 20, 30);
    std::printf("cuda:0 %s%s: first loss %.4f (cpu f32 %.4f), last-10 %.4f (cpu f32 %.4f), %d steps taken\n",
                std::string(DTypeName(c.dtype)).c_str(), c.scaler ? " + GradScaler" : "", t.losses[0],
                ref.losses[0], last, ref_last, t.steps_taken);
    nn::testing::ExpectTrainedLikeF32(t, ref, c.dtype, c.first_tol);
  }
}

}  // namespace
}  // namespace ddp::nn::cuda
