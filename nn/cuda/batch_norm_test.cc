// Batch norm on CUDA against the CPU kernels (tag "gpu"): training and eval
// forward, backward, running-statistics update, the SyncBatchNorm building
// blocks, 4-D and 2-D inputs, f32/f64/bf16 activations with f32 parameters.
// Both sides accumulate statistics in f64, so per-channel outputs agree to
// the rounding of their own dtype (rtol 1e-6 for f32); activations and dx
// to rtol 1e-5 (f32), 1e-10 (f64) or one bf16 ulp.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "nn/cuda/cuda.h"
#include "nn/cuda/gpu_test_util.h"
#include "nn/ops/dispatch.h"
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
    default: return {1e-5, 1e-5};
  }
}
const Tol kStatTol{1e-6, 1e-7};

Tensor G(const Tensor& t) { return t.defined() ? t.To(kGpu) : Tensor(); }

class CudaBatchNormTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Init();
    ManualSeed(5);
  }
};

TEST_F(CudaBatchNormTest, ForwardAndBackwardMatchCpu) {
  // S = 20 and 1 take the flattened per-channel loop, S = 320 the row loop.
  for (const Shape& shape : {Shape{8, 6, 5, 4}, Shape{16, 7}, Shape{4, 3, 16, 20}}) {
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
      for (bool training : {true, false}) {
        for (bool affine : {true, false}) {
          const std::string what = "batch_norm " + ShapeToString(shape) + " " + std::string(DTypeName(dt)) +
                                   (training ? " train" : " eval") + (affine ? " affine" : "");
          const int64_t c = shape[1];
          const DType pdt = dt == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
          // Activations off zero and not unit-scaled, so the statistics matter.
          const Tensor x = RandnOf(shape, dt, 1.5, 2.0);
          const Tensor w = affine ? RandnOf({c}, pdt) : Tensor(), b = affine ? RandnOf({c}, pdt) : Tensor();
          const Tensor rm0 = RandnOf({c}, pdt), rv0 = RandnOf({c}, pdt, 2.0, 0.1);
          const Tensor rm_cpu = rm0.Clone(), rv_cpu = rv0.Clone();
          const Tensor y_cpu = Empty(shape, {.dtype = dt});
          const Tensor sm_cpu = Empty({c}), si_cpu = Empty({c});
          Cpu().batch_norm_forward(x, w, b, rm_cpu, rv_cpu, training, 0.1, 1e-5, y_cpu, sm_cpu, si_cpu);
          const Tensor rm_gpu = rm0.To(kGpu), rv_gpu = rv0.To(kGpu);
          const Tensor y_gpu = Empty(shape, {.dtype = dt, .device = kGpu});
          const Tensor sm_gpu = Empty({c}, {.device = kGpu}), si_gpu = Empty({c}, {.device = kGpu});
          const Tensor xg = x.To(kGpu), wg = G(w), bg = G(b);
          Gpu().batch_norm_forward(xg, wg, bg, rm_gpu, rv_gpu, training, 0.1, 1e-5, y_gpu, sm_gpu, si_gpu);
          ExpectClose(y_cpu, y_gpu, ActTol(dt), what + " y");
          ExpectClose(sm_cpu, sm_gpu, kStatTol, what + " save_mean");
          ExpectClose(si_cpu, si_gpu, kStatTol, what + " save_invstd");
          ExpectClose(rm_cpu, rm_gpu, kStatTol, what + " running_mean");
          ExpectClose(rv_cpu, rv_gpu, kStatTol, what + " running_var");

          const Tensor dy = RandnOf(shape, dt);
          const Tensor dx_cpu = Empty(shape, {.dtype = dt});
          const Tensor dw_cpu = affine ? Empty({c}, {.dtype = pdt}) : Tensor();
          const Tensor db_cpu = affine ? Empty({c}, {.dtype = pdt}) : Tensor();
          Cpu().batch_norm_backward(x, dy, w, sm_cpu, si_cpu, training, dx_cpu, dw_cpu, db_cpu);
          const Tensor dx_gpu = Empty(shape, {.dtype = dt, .device = kGpu});
          const Tensor dw_gpu = affine ? Empty({c}, {.dtype = pdt, .device = kGpu}) : Tensor();
          const Tensor db_gpu = affine ? Empty({c}, {.dtype = pdt, .device = kGpu}) : Tensor();
          Gpu().batch_norm_backward(xg, dy.To(kGpu), wg, sm_gpu, si_gpu, training, dx_gpu, dw_gpu, db_gpu);
          ExpectClose(dx_cpu, dx_gpu, ActTol(dt), what + " dx");
          if (affine) {
            ExpectClose(dw_cpu, dw_gpu, {1e-5, 1e-5}, what + " dweight");
            ExpectClose(db_cpu, db_gpu, {1e-5, 1e-5}, what + " dbias");
          }
        }
      }
    }
  }
}

TEST_F(CudaBatchNormTest, SyncBatchNormBuildingBlocksMatchCpu) {
  const Shape shape = {6, 5, 3, 7};
  const int64_t c = 5;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const std::string what = "building blocks " + std::string(DTypeName(dt));
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

TEST_F(CudaBatchNormTest, EvalWithoutRunningStatisticsIsAnError) {
  const Tensor x = Empty({2, 3}, {.device = kGpu});
  const Tensor y = Empty({2, 3}, {.device = kGpu});
  EXPECT_THROW(Gpu().batch_norm_forward(x, Tensor(), Tensor(), Tensor(), Tensor(), false, 0.1, 1e-5, y,
                                        Empty({3}, {.device = kGpu}), Empty({3}, {.device = kGpu})),
               std::invalid_argument);
}

}  // namespace
}  // namespace ddp::nn::cuda
