// Batch norm on CUDA against the CPU kernels (tag "gpu"): training and eval
// forward, backward, running-statistics update, the SyncBatchNorm building
// blocks, 4-D and 2-D inputs, f32/f64/bf16/f16 activations with f32 parameters,
// with the reductions on one block per channel and split over several, and
// with cuDNN's training-mode kernels (both modes). Our kernels accumulate
// statistics in f64 as the CPU does, so per-channel outputs agree to the
// rounding of their own dtype (rtol 1e-6 for f32); activations and dx to
// rtol 1e-5 (f32), 1e-10 (f64) or one bf16 ulp. cuDNN accumulates in f32:
// its f32 statistics and outputs are held to 1e-4, dx to 1e-3.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nn/cuda/batch_norm.h"
#include "nn/cuda/cuda.h"
#include "nn/cuda/gpu_test_util.h"
#include "nn/autograd/engine.h"
#include "nn/ops/dispatch.h"
#include "nn/ops/functional.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {
namespace {

using testing::Cpu;
using testing::ExpectClose;
using testing::Gpu;
using testing::kGpu;
using testing::RandnOf;
using testing::Tol;

Tol ActTol(DType dt) {
  switch (dt) {
    case DType::kFloat64: return {1e-10, 1e-12};
    case DType::kBFloat16: return {8e-3, 1e-2};
    case DType::kFloat16: return {2e-3, 2e-3};
    default: return {1e-5, 1e-5};
  }
}
const Tol kStatTol{1e-6, 1e-7};

Tensor G(const Tensor& t) { return t.defined() ? t.To(kGpu) : Tensor(); }

// Each test starts on our kernels with one block per channel (the defaults
// are cuDNN's training kernels and split reductions): the tests that are
// about cuDNN or the split path switch to them themselves.
class CudaBatchNormTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Init();
    ManualSeed(5);
    was_kernels_ = BatchNormKernelChoice();
    was_split_ = BatchNormSplitReductions();
    SetBatchNormKernels(BatchNormKernels::kOwn);
    SetBatchNormSplitReductions(false);
  }
  void TearDown() override {
    SetBatchNormKernels(was_kernels_);
    SetBatchNormSplitReductions(was_split_);
  }

 private:
  BatchNormKernels was_kernels_ = BatchNormKernels::kOwn;
  bool was_split_ = false;
};

// Forward (batch statistics or running ones) and backward of one
// configuration on both devices. Parameters and running statistics are f64
// for f64 activations, else f32 unless `params` says otherwise.
// The kernels the current settings run for a configuration, for messages.
std::string KernelName(const Shape& shape, DType dt, bool training) {
  // cuDNN takes f32 and 16-bit training batches of 3 or more dimensions.
  if (training && BatchNormKernelChoice() != BatchNormKernels::kOwn && dt != DType::kFloat64 &&
      shape.size() >= 3) {
    return BatchNormKernelChoice() == BatchNormKernels::kCudnn ? "cudnn " : "cudnn persistent ";
  }
  return BatchNormSplitReductions() ? "split " : "";
}

void ExpectForwardAndBackwardMatchCpu(const Shape& shape, DType dt, bool training, bool affine,
                                      std::optional<DType> params = std::nullopt,
                                      DType saved = DType::kFloat32) {
  const std::string kernels = KernelName(shape, dt, training);
  const std::string what = kernels + "batch_norm " + ShapeToString(shape) + " " + std::string(DTypeName(dt)) +
                           (training ? " train" : " eval") + (affine ? " affine" : "") + " params " +
                           std::string(DTypeName(params.value_or(DType::kFloat32))) + " saved " +
                           std::string(DTypeName(saved));
  const bool cudnn = kernels.rfind("cudnn", 0) == 0;
  const int64_t c = shape[1];
  const DType pdt = params.value_or(dt == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32);
  // cuDNN's f32 arithmetic, against f64 on the CPU.
  const Tol stat_tol = cudnn ? Tol{1e-4, 1e-5} : kStatTol;
  const Tol act_tol = cudnn && dt == DType::kFloat32 ? Tol{1e-4, 1e-4} : ActTol(dt);
  const Tol dx_tol = cudnn && dt == DType::kFloat32 ? Tol{1e-3, 1e-4} : ActTol(dt);
  // 16-bit parameters and running statistics: both sides round the same f64
  // values, at most an ulp apart.
  const Tol param_tol = pdt == DType::kBFloat16 || pdt == DType::kFloat16 ? ActTol(DType::kBFloat16) : stat_tol;
  // Activations off zero and not unit-scaled, so the statistics matter.
  const Tensor x = RandnOf(shape, dt, 1.5, 2.0);
  const Tensor w = affine ? RandnOf({c}, pdt) : Tensor(), b = affine ? RandnOf({c}, pdt) : Tensor();
  const Tensor rm0 = RandnOf({c}, pdt), rv0 = RandnOf({c}, pdt, 2.0, 0.1);
  const Tensor rm_cpu = rm0.Clone(), rv_cpu = rv0.Clone();
  const Tensor y_cpu = Empty(shape, {.dtype = dt});
  const Tensor sm_cpu = Empty({c}, {.dtype = saved}), si_cpu = Empty({c}, {.dtype = saved});
  Cpu().batch_norm_forward(x, w, b, rm_cpu, rv_cpu, training, 0.1, 1e-5, y_cpu, sm_cpu, si_cpu);
  const Tensor rm_gpu = rm0.To(kGpu), rv_gpu = rv0.To(kGpu);
  const Tensor y_gpu = Empty(shape, {.dtype = dt, .device = kGpu});
  const Tensor sm_gpu = Empty({c}, {.dtype = saved, .device = kGpu});
  const Tensor si_gpu = Empty({c}, {.dtype = saved, .device = kGpu});
  const Tensor xg = x.To(kGpu), wg = G(w), bg = G(b);
  Gpu().batch_norm_forward(xg, wg, bg, rm_gpu, rv_gpu, training, 0.1, 1e-5, y_gpu, sm_gpu, si_gpu);
  ExpectClose(y_cpu, y_gpu, act_tol, what + " y");
  ExpectClose(sm_cpu, sm_gpu, stat_tol, what + " save_mean");
  ExpectClose(si_cpu, si_gpu, stat_tol, what + " save_invstd");
  ExpectClose(rm_cpu, rm_gpu, param_tol, what + " running_mean");
  ExpectClose(rv_cpu, rv_gpu, param_tol, what + " running_var");

  const Tensor dy = RandnOf(shape, dt);
  const Tensor dx_cpu = Empty(shape, {.dtype = dt});
  const Tensor dw_cpu = affine ? Empty({c}, {.dtype = pdt}) : Tensor();
  const Tensor db_cpu = affine ? Empty({c}, {.dtype = pdt}) : Tensor();
  Cpu().batch_norm_backward(x, dy, w, sm_cpu, si_cpu, training, 1e-5, dx_cpu, dw_cpu, db_cpu);
  const Tensor dx_gpu = Empty(shape, {.dtype = dt, .device = kGpu});
  const Tensor dw_gpu = affine ? Empty({c}, {.dtype = pdt, .device = kGpu}) : Tensor();
  const Tensor db_gpu = affine ? Empty({c}, {.dtype = pdt, .device = kGpu}) : Tensor();
  Gpu().batch_norm_backward(xg, dy.To(kGpu), wg, sm_gpu, si_gpu, training, 1e-5, dx_gpu, dw_gpu, db_gpu);
  ExpectClose(dx_cpu, dx_gpu, dx_tol, what + " dx");
  if (affine) {
    const Tol grad_tol = param_tol.rtol > 1e-5 ? param_tol : Tol{1e-5, 1e-5};
    ExpectClose(dw_cpu, dw_gpu, grad_tol, what + " dweight");
    ExpectClose(db_cpu, db_gpu, grad_tol, what + " dbias");
  }
}

// Sets the split reductions for a scope, then restores the setting.
class SplitReductions {
 public:
  explicit SplitReductions(bool on) : was_(BatchNormSplitReductions()) { SetBatchNormSplitReductions(on); }
  ~SplitReductions() { SetBatchNormSplitReductions(was_); }
  SplitReductions(const SplitReductions&) = delete;
  SplitReductions& operator=(const SplitReductions&) = delete;

 private:
  bool was_;
};

// Sets the training kernels for a scope, then restores the setting.
class Kernels {
 public:
  explicit Kernels(BatchNormKernels k) : was_(BatchNormKernelChoice()) { SetBatchNormKernels(k); }
  ~Kernels() { SetBatchNormKernels(was_); }
  Kernels(const Kernels&) = delete;
  Kernels& operator=(const Kernels&) = delete;

 private:
  BatchNormKernels was_;
};

// cuDNN's kernels, both modes, on the shapes and dtypes of the tests above
// (f64, eval mode and 2-D inputs run ours whatever the setting). cuDNN
// must take f32; whether it took f16 and bf16 is printed.
TEST_F(CudaBatchNormTest, CudnnTrainingKernelsMatchCpu) {
  for (BatchNormKernels k : {BatchNormKernels::kCudnn, BatchNormKernels::kCudnnPersistent}) {
    const Kernels setting(k);
    for (const Shape& shape : {Shape{8, 6, 5, 4}, Shape{16, 7}, Shape{4, 3, 16, 20}, Shape{64, 3, 32, 32},
                               Shape{40000, 2}}) {
      for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
        for (bool affine : {true, false}) ExpectForwardAndBackwardMatchCpu(shape, dt, true, affine);
      }
    }
    for (DType params : {DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
      ExpectForwardAndBackwardMatchCpu({8, 6, 5, 4}, DType::kFloat32, true, true, params);
    }
    ExpectForwardAndBackwardMatchCpu({8, 6, 5, 4}, DType::kFloat32, false, true);
    // The spatial mode must take f32 (PyTorch runs it so); what the
    // persistent mode took is reported, as is bf16 in both.
    if (k == BatchNormKernels::kCudnn) {
      EXPECT_FALSE(BatchNormCudnnDeclined(DType::kFloat32)) << "cuDNN declined f32 batch norm";
    }
    std::printf("cuDNN batch norm (%s): f32 %s, bf16 %s\n", k == BatchNormKernels::kCudnn ? "spatial" : "persistent",
                BatchNormCudnnDeclined(DType::kFloat32) ? "declined, ours ran it" : "taken",
                BatchNormCudnnDeclined(DType::kBFloat16) ? "declined, ours ran it" : "taken");
  }
}

TEST_F(CudaBatchNormTest, ForwardAndBackwardMatchCpu) {
  // S = 20 and 1 take the flattened per-channel loop, S = 320 the row loop;
  // every channel here fits one block of the split reductions.
  for (bool split : {false, true}) {
    const SplitReductions setting(split);
    for (const Shape& shape : {Shape{8, 6, 5, 4}, Shape{16, 7}, Shape{4, 3, 16, 20}}) {
      for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
        for (bool training : {true, false}) {
          for (bool affine : {true, false}) ExpectForwardAndBackwardMatchCpu(shape, dt, training, affine);
        }
      }
    }
  }
}

TEST_F(CudaBatchNormTest, LongChannelsSplitOverBlocksMatchCpu) {
  // Few channels with many elements each: the split reductions cut every
  // channel over several blocks, on the row path (S = 1024: 16 parts), the
  // flattened path (S = 9: 4 parts) and for BatchNorm1d (S = 1: 9 parts);
  // the one-block-per-channel kernels run the same shapes (host_test checks
  // these part counts).
  for (bool split : {false, true}) {
    const SplitReductions setting(split);
    for (const Shape& shape : {Shape{64, 3, 32, 32}, Shape{2048, 4, 3, 3}, Shape{40000, 2}}) {
      for (DType dt : {DType::kFloat32, DType::kBFloat16}) ExpectForwardAndBackwardMatchCpu(shape, dt, true, true);
    }
    // Parameters and running statistics read and written in their own 16-bit
    // and 64-bit dtypes (the split path reads them in place), train and eval.
    for (DType params : {DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
      for (bool training : {true, false}) {
        ExpectForwardAndBackwardMatchCpu({8, 6, 5, 4}, DType::kFloat32, training, true, params);
      }
    }
  }
}

// Shapes at the edges of the launch plans, fp16 activations, and saved
// statistics in f64 (what nn's op passes: the kernels write them in place):
// {5, 2, 3500} leaves the last part of each channel's rows empty on the
// row path; {2, 70000} has more channels than a grid's y dimension holds;
// {1, 4} has one value per channel (variance 0, running variance unbiased
// by 1).
TEST_F(CudaBatchNormTest, EdgeShapesFp16AndF64SavedStatisticsMatchCpu) {
  for (bool split : {false, true}) {
    const SplitReductions setting(split);
    ExpectForwardAndBackwardMatchCpu({5, 2, 3500}, DType::kFloat32, true, true);
    for (bool training : {true, false}) ExpectForwardAndBackwardMatchCpu({2, 70000}, DType::kFloat32, training, true);
    ExpectForwardAndBackwardMatchCpu({1, 4}, DType::kFloat32, true, true);
    for (const Shape& shape : {Shape{8, 6, 5, 4}, Shape{64, 3, 32, 32}}) {
      for (bool training : {true, false}) ExpectForwardAndBackwardMatchCpu(shape, DType::kFloat16, training, true);
    }
    for (bool training : {true, false}) {
      ExpectForwardAndBackwardMatchCpu({8, 6, 5, 4}, DType::kFloat32, training, true, std::nullopt, DType::kFloat64);
    }
  }
}

// Element by element: NaN where the CPU has NaN, the same infinity where it
// has one, else within 1e-5.
void ExpectSameWithNonFinite(const Tensor& cpu, const Tensor& gpu, const std::string& what) {
  const std::vector<double> want = cpu.ToVector<double>(), got = gpu.To(kCPU).ToVector<double>();
  ASSERT_EQ(want.size(), got.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const bool ok = std::isnan(want[i])   ? std::isnan(got[i])
                    : std::isinf(want[i]) ? got[i] == want[i]
                                          : std::abs(got[i] - want[i]) <= 1e-5 + 1e-5 * std::abs(want[i]);
    if (!ok && ++bad <= 5) ADD_FAILURE() << what << ": element " << i << ": cpu " << want[i] << ", gpu " << got[i];
  }
}

// A NaN or an infinity in a channel makes that channel's variance, running
// variance and output NaN, as on the CPU (an fp16 overflow under autocast
// must show, not turn into a variance of 0), and its mean NaN or that
// infinity, also as on the CPU; the other channel is unaffected. The
// infinity sits once inside channel 0 and once at its first element,
// x[0, 0, 0, 0], which the split path subtracts from every element as its
// shift: an infinite shift would make the mean inf - inf = NaN where the
// CPU's is inf.
TEST_F(CudaBatchNormTest, NonFiniteInputsPropagateAsOnCpu) {
  const double nan = std::nan("");
  const int64_t inside = (1 * 2 + 0) * 64 + 3 * 8 + 3;  // x[1, 0, 3, 3]
  struct Case {
    std::string name;
    std::vector<std::pair<int64_t, double>> values;  // flat index into x, value
    double mean;                                     // channel 0's mean on the CPU
  };
  const Case cases[] = {
      {"NaN", {{inside, nan}}, nan},
      {"inf", {{inside, HUGE_VAL}}, HUGE_VAL},
      {"inf first", {{0, HUGE_VAL}}, HUGE_VAL},
      {"-inf first", {{0, -HUGE_VAL}}, -HUGE_VAL},
      {"inf first and -inf", {{0, HUGE_VAL}, {inside, -HUGE_VAL}}, nan},
  };
  for (bool split : {false, true}) {
    const SplitReductions setting(split);
    for (const Case& k : cases) {
      const std::string what = std::string(split ? "split " : "") + "batch_norm with " + k.name;
      const Shape shape{4, 2, 8, 8};
      const Tensor x = RandnOf(shape, DType::kFloat32, 1.5, 2.0);
      for (const auto& [index, value] : k.values) x.data<float>()[index] = static_cast<float>(value);
      const Tensor rm0 = RandnOf({2}, DType::kFloat32), rv0 = RandnOf({2}, DType::kFloat32, 2.0, 0.1);
      const Tensor rm_cpu = rm0.Clone(), rv_cpu = rv0.Clone(), rm_gpu = rm0.To(kGpu), rv_gpu = rv0.To(kGpu);
      const Tensor y_cpu = Empty(shape), sm_cpu = Empty({2}), si_cpu = Empty({2});
      Cpu().batch_norm_forward(x, Tensor(), Tensor(), rm_cpu, rv_cpu, true, 0.1, 1e-5, y_cpu, sm_cpu, si_cpu);
      const Tensor y_gpu = Empty(shape, {.device = kGpu});
      const Tensor sm_gpu = Empty({2}, {.device = kGpu}), si_gpu = Empty({2}, {.device = kGpu});
      Gpu().batch_norm_forward(x.To(kGpu), Tensor(), Tensor(), rm_gpu, rv_gpu, true, 0.1, 1e-5, y_gpu, sm_gpu,
                               si_gpu);
      ASSERT_TRUE(std::isnan(rv_cpu.ToVector<double>()[0])) << what << ": the CPU's reference changed";
      const double cpu_mean = sm_cpu.ToVector<double>()[0];
      ASSERT_TRUE(std::isnan(k.mean) ? std::isnan(cpu_mean) : cpu_mean == k.mean)
          << what << ": the CPU's reference mean changed: " << cpu_mean;
      ExpectSameWithNonFinite(rv_cpu, rv_gpu, what + " running_var");
      ExpectSameWithNonFinite(rm_cpu, rm_gpu, what + " running_mean");
      ExpectSameWithNonFinite(sm_cpu, sm_gpu, what + " save_mean");
      ExpectSameWithNonFinite(si_cpu, si_gpu, what + " save_invstd");
      ExpectSameWithNonFinite(y_cpu, y_gpu, what + " y");
    }
  }
}

// Eval-mode backward is dx = weight * invstd * dy, as on the CPU: it does
// not read x, so an infinity or NaN in x leaves dx finite (computed as
// k * (dy - 0 - (x - mean) * 0) it would be NaN there). dweight does read x
// and is not finite in that channel, alike on both devices. Both reduction
// paths.
TEST_F(CudaBatchNormTest, EvalBackwardDoesNotReadX) {
  for (bool split : {false, true}) {
    const SplitReductions setting(split);
    for (double bad : {HUGE_VAL, std::nan("")}) {
      const std::string what =
          std::string(split ? "split " : "") + "eval batch_norm backward with " + (std::isnan(bad) ? "NaN" : "inf");
      const Shape shape{4, 2, 8, 8};
      const Tensor x = RandnOf(shape, DType::kFloat32, 1.5, 2.0), dy = RandnOf(shape, DType::kFloat32);
      x.data<float>()[(1 * 2 + 0) * 64 + 3 * 8 + 3] = static_cast<float>(bad);  // x[1, 0, 3, 3]
      const Tensor w = RandnOf({2}, DType::kFloat32), b = RandnOf({2}, DType::kFloat32);
      const Tensor rm = RandnOf({2}, DType::kFloat32), rv = RandnOf({2}, DType::kFloat32, 2.0, 0.1);
      const Tensor y_cpu = Empty(shape), sm_cpu = Empty({2}), si_cpu = Empty({2});
      Cpu().batch_norm_forward(x, w, b, rm, rv, false, 0.1, 1e-5, y_cpu, sm_cpu, si_cpu);
      const Tensor xg = x.To(kGpu), wg = w.To(kGpu);
      const Tensor y_gpu = Empty(shape, {.device = kGpu});
      const Tensor sm_gpu = Empty({2}, {.device = kGpu}), si_gpu = Empty({2}, {.device = kGpu});
      Gpu().batch_norm_forward(xg, wg, b.To(kGpu), rm.To(kGpu), rv.To(kGpu), false, 0.1, 1e-5, y_gpu, sm_gpu, si_gpu);
      ExpectSameWithNonFinite(y_cpu, y_gpu, what + " y");

      const Tensor dx_cpu = Empty(shape), dw_cpu = Empty({2}), db_cpu = Empty({2});
      Cpu().batch_norm_backward(x, dy, w, sm_cpu, si_cpu, false, 1e-5, dx_cpu, dw_cpu, db_cpu);
      const Tensor dx_gpu = Empty(shape, {.device = kGpu});
      const Tensor dw_gpu = Empty({2}, {.device = kGpu}), db_gpu = Empty({2}, {.device = kGpu});
      Gpu().batch_norm_backward(xg, dy.To(kGpu), wg, sm_gpu, si_gpu, false, 1e-5, dx_gpu, dw_gpu, db_gpu);
      for (double v : dx_cpu.ToVector<double>()) ASSERT_TRUE(std::isfinite(v)) << what << ": the CPU's dx changed";
      ASSERT_FALSE(std::isfinite(dw_cpu.ToVector<double>()[0])) << what << ": the CPU's dweight changed";
      ExpectSameWithNonFinite(dx_cpu, dx_gpu, what + " dx");
      ExpectSameWithNonFinite(dw_cpu, dw_gpu, what + " dweight");
      ExpectSameWithNonFinite(db_cpu, db_gpu, what + " dbias");
    }
  }
}

// Through the op and autograd, as a model runs it: with cuDNN chosen the op
// keeps the saved statistics in f32 (what cuDNN computes), and the input,
// weight and bias gradients and the running statistics match the CPU.
// A channel mean large against its spread (1e7 and 3): our kernels' f32 dx
// stays close to the same inputs' f64 dx, as on the CPU
// (ops_gradcheck_test's F32BackwardFollowsF64AtALargeChannelMean). The
// backward kernel rounded the mean to f32 before x - mean (f32's step at 1e7
// is 1), which put dx about 2e-3 of its largest value off f64's.
TEST_F(CudaBatchNormTest, F32BackwardFollowsF64AtALargeChannelMean) {
  const Shape shape{64, 8, 3};
  // f32 values, and exactly the same values in f64.
  const Tensor x = RandnOf(shape, DType::kFloat32, 1e7, 3.0), dy = RandnOf(shape, DType::kFloat32);
  const Tensor w = RandnOf({8}, DType::kFloat32, 1.0, 0.5), b = RandnOf({8}, DType::kFloat32);
  auto dx_of = [&](DType dt) {
    const Tensor xg = x.To(dt).To(kGpu).set_requires_grad(true);
    const Tensor y = ops::BatchNorm(xg, Tensor(), Tensor(), w.To(dt).To(kGpu), b.To(dt).To(kGpu), true, 0.1, 1e-5);
    Backward(ops::Sum(ops::Mul(y, dy.To(dt).To(kGpu))));
    return xg.grad().To(kCPU).ToVector<double>();
  };
  const std::vector<double> dx32 = dx_of(DType::kFloat32), dx64 = dx_of(DType::kFloat64);
  double worst = 0, largest = 0;
  for (size_t i = 0; i < dx64.size(); ++i) {
    worst = std::max(worst, std::abs(dx32[i] - dx64[i]));
    largest = std::max(largest, std::abs(dx64[i]));
  }
  EXPECT_LT(worst / largest, 1e-6) << "largest |dx| " << largest;
}

TEST_F(CudaBatchNormTest, CudnnThroughTheOpMatchesCpu) {
  const Kernels setting(BatchNormKernels::kCudnn);
  const Shape shape{16, 8, 6, 6};
  const Tensor x = RandnOf(shape, DType::kFloat32, 1.5, 2.0), dy = RandnOf(shape, DType::kFloat32);
  const Tensor w = RandnOf({8}, DType::kFloat32), b = RandnOf({8}, DType::kFloat32);
  const Tensor rm = RandnOf({8}, DType::kFloat32), rv = RandnOf({8}, DType::kFloat32, 2.0, 0.1);
  EXPECT_EQ(BatchNormSavedDType(x.To(kGpu), true), DType::kFloat32);
  EXPECT_EQ(BatchNormSavedDType(x.To(kGpu), false), DType::kFloat64);
  struct Run {
    Tensor x, w, b, rm, rv;
  };
  auto run = [&](Device device) {
    // Copies: the CPU run must not change what the GPU run starts from.
    auto copy = [&](const Tensor& t) { return t.To(device).Clone(); };
    Run r{copy(x), copy(w), copy(b), copy(rm), copy(rv)};
    for (Tensor* t : {&r.x, &r.w, &r.b}) t->set_requires_grad(true);
    const Tensor y = ops::BatchNorm(r.x, r.rm, r.rv, r.w, r.b, true, 0.1, 1e-5);
    Backward(ops::Sum(ops::Mul(y, dy.To(device))));
    return r;
  };
  const Run cpu = run(kCPU), gpu = run(kGpu);
  const Tol tol{1e-4, 1e-4};
  ExpectClose(cpu.x.grad(), gpu.x.grad(), {1e-3, 1e-4}, "op dx");
  ExpectClose(cpu.w.grad(), gpu.w.grad(), tol, "op dweight");
  ExpectClose(cpu.b.grad(), gpu.b.grad(), tol, "op dbias");
  ExpectClose(cpu.rm, gpu.rm, tol, "op running_mean");
  ExpectClose(cpu.rv, gpu.rv, tol, "op running_var");
  EXPECT_FALSE(BatchNormCudnnDeclined(DType::kFloat32));
}

// The SyncBatchNorm building blocks of one shape, f32 and bf16.
void ExpectBuildingBlocksMatchCpu(const Shape& shape) {
  const int64_t c = shape[1];
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const std::string what = std::string(BatchNormSplitReductions() ? "split " : "") + "building blocks " +
                             ShapeToString(shape) + " " + std::string(DTypeName(dt));
    const Tensor x = RandnOf(shape, dt, -0.5, 3.0), dy = RandnOf(shape, dt);
    const Tensor xg = x.To(kGpu), dyg = dy.To(kGpu);
    const Tensor s_cpu = Empty({c}, {.dtype = DType::kFloat64}), q_cpu = Empty({c}, {.dtype = DType::kFloat64});
    Cpu().batch_norm_stats(x, s_cpu, q_cpu);
    const Tensor s_gpu = Empty({c}, {.dtype = DType::kFloat64, .device = kGpu});
    const Tensor q_gpu = Empty({c}, {.dtype = DType::kFloat64, .device = kGpu});
    Gpu().batch_norm_stats(xg, s_gpu, q_gpu);
    ExpectClose(s_cpu, s_gpu, {1e-12, 1e-12}, what + " sum");
    ExpectClose(q_cpu, q_gpu, {1e-12, 1e-12}, what + " sum_sq");

    const Tensor mean = RandnOf({c}, DType::kFloat32), invstd = RandnOf({c}, DType::kFloat32, 1.0, 0.1);
    const Tensor w = RandnOf({c}, DType::kFloat32), b = RandnOf({c}, DType::kFloat32);
    const Tensor y_cpu = Empty(shape, {.dtype = dt});
    Cpu().batch_norm_elementwise(x, mean, invstd, w, b, y_cpu);
    const Tensor y_gpu = Empty(shape, {.dtype = dt, .device = kGpu});
    Gpu().batch_norm_elementwise(xg, mean.To(kGpu), invstd.To(kGpu), w.To(kGpu), b.To(kGpu), y_gpu);
    ExpectClose(y_cpu, y_gpu, ActTol(dt), what + " elementwise");

    const Tensor sd_cpu = Empty({c}, {.dtype = DType::kFloat64}), sx_cpu = Empty({c}, {.dtype = DType::kFloat64});
    Cpu().batch_norm_backward_reduce(dy, x, mean, invstd, sd_cpu, sx_cpu);
    const Tensor sd_gpu = Empty({c}, {.dtype = DType::kFloat64, .device = kGpu});
    const Tensor sx_gpu = Empty({c}, {.dtype = DType::kFloat64, .device = kGpu});
    Gpu().batch_norm_backward_reduce(dyg, xg, mean.To(kGpu), invstd.To(kGpu), sd_gpu, sx_gpu);
    ExpectClose(sd_cpu, sd_gpu, {1e-10, 1e-10}, what + " sum_dy");
    ExpectClose(sx_cpu, sx_gpu, {1e-10, 1e-10}, what + " sum_dy_xhat");

    const Tensor mdy = RandnOf({c}, DType::kFloat32), mdx = RandnOf({c}, DType::kFloat32);
    const Tensor dx_cpu = Empty(shape, {.dtype = dt});
    Cpu().batch_norm_backward_elementwise(dy, x, mean, invstd, w, mdy, mdx, dx_cpu);
    const Tensor dx_gpu = Empty(shape, {.dtype = dt, .device = kGpu});
    Gpu().batch_norm_backward_elementwise(dyg, xg, mean.To(kGpu), invstd.To(kGpu), w.To(kGpu), mdy.To(kGpu),
                                          mdx.To(kGpu), dx_gpu);
    ExpectClose(dx_cpu, dx_gpu, ActTol(dt), what + " backward_elementwise");
  }
}

TEST_F(CudaBatchNormTest, SyncBatchNormBuildingBlocksMatchCpu) {
  // {256, 5, 8, 8}: 4 parts per channel in the split reductions; {0, ...}:
  // an empty local batch, as SyncBatchNorm allows.
  for (bool split : {false, true}) {
    const SplitReductions setting(split);
    for (const Shape& shape : {Shape{6, 5, 3, 7}, Shape{256, 5, 8, 8}, Shape{0, 5, 3, 7}}) {
      ExpectBuildingBlocksMatchCpu(shape);
    }
  }
}

TEST_F(CudaBatchNormTest, EvalWithoutRunningStatisticsIsAnError) {
  const Tensor x = Empty({2, 3}, {.device = kGpu});
  const Tensor y = Empty({2, 3}, {.device = kGpu});
  EXPECT_THROW(Gpu().batch_norm_forward(x, Tensor(), Tensor(), Tensor(), Tensor(), false, 0.1, 1e-5, y,
                                        Empty({3}, {.device = kGpu}), Empty({3}, {.device = kGpu})),
               std::invalid_argument);
}

}  // namespace
}  // namespace ddp::nn::cuda
