// cuDNN convolution and the pooling kernels against the CPU kernels (tag
// "gpu"). Inputs are N(0, 1). Tolerances, |gpu - cpu| <= atol + rtol * |cpu|,
// with T the number of products summed into one output:
// - f32 (FMA kernels, TF32 off): rtol 1e-4, atol 2e-6 * T (reordered sums);
// - f64: rtol 1e-10, atol 1e-12 * T;
// - f16 / bf16: the CPU computes in f32 and rounds once, cuDNN may round
//   intermediate tiles: rtol 1e-2 / 4e-2, atol 1e-2 * sqrt(T) / 4e-2 * sqrt(T);
// - pooling: max is exact (same element chosen, same index); averages
//   rtol 1e-6 (f32) or one 16-bit ulp.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "nn/cuda/allocator.h"
#include "nn/cuda/conv.h"
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

int64_t ConvOut(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) { return (in + 2 * p - d * (k - 1) - 1) / s + 1; }

Tol ConvTol(DType dt, double terms) {
  switch (dt) {
    case DType::kFloat64: return {1e-10, 1e-12 * terms};
    case DType::kFloat16: return {1e-2, 1e-2 * std::sqrt(terms)};
    case DType::kBFloat16: return {4e-2, 4e-2 * std::sqrt(terms)};
    default: return {1e-4, 2e-6 * terms};
  }
}

struct ConvCase {
  Shape x, w;
  ops::Conv2dParams p;
  bool bias;
};

void CheckConv(const ConvCase& c, DType dt) {
  const std::string what = "conv2d x" + ShapeToString(c.x) + " w" + ShapeToString(c.w) + " s" +
                           std::to_string(c.p.stride_h) + " p" + std::to_string(c.p.pad_h) + " d" +
                           std::to_string(c.p.dilation_h) + " g" + std::to_string(c.p.groups) + " " +
                           std::string(DTypeName(dt));
  const Tensor x = RandnOf(c.x, dt), w = RandnOf(c.w, dt);
  const Tensor b = c.bias ? RandnOf({c.w[0]}, dt) : Tensor();
  const int64_t oh = ConvOut(c.x[2], c.w[2], c.p.stride_h, c.p.pad_h, c.p.dilation_h);
  const int64_t ow = ConvOut(c.x[3], c.w[3], c.p.stride_w, c.p.pad_w, c.p.dilation_w);
  const Shape ys = {c.x[0], c.w[0], oh, ow};
  const Tensor y_cpu = Empty(ys, {.dtype = dt});
  Cpu().conv2d_forward(x, w, b, y_cpu, c.p);
  const Tensor xg = x.To(kGpu), wg = w.To(kGpu);
  const Tensor y_gpu = Empty(ys, {.dtype = dt, .device = kGpu});
  Gpu().conv2d_forward(xg, wg, c.bias ? b.To(kGpu) : Tensor(), y_gpu, c.p);
  const double fwd_terms = static_cast<double>(c.w[1] * c.w[2] * c.w[3]);
  ExpectClose(y_cpu, y_gpu, ConvTol(dt, fwd_terms), what + " forward");

  const Tensor dy = RandnOf(ys, dt);
  const Tensor dx_cpu = Empty(c.x, {.dtype = dt}), dw_cpu = Empty(c.w, {.dtype = dt});
  const Tensor db_cpu = c.bias ? Empty({c.w[0]}, {.dtype = dt}) : Tensor();
  Cpu().conv2d_backward(x, w, dy, dx_cpu, dw_cpu, db_cpu, c.p);
  const Tensor dx_gpu = Empty(c.x, {.dtype = dt, .device = kGpu}), dw_gpu = Empty(c.w, {.dtype = dt, .device = kGpu});
  const Tensor db_gpu = c.bias ? Empty({c.w[0]}, {.dtype = dt, .device = kGpu}) : Tensor();
  Gpu().conv2d_backward(xg, wg, dy.To(kGpu), dx_gpu, dw_gpu, db_gpu, c.p);
  const double dx_terms = static_cast<double>(c.w[0] * c.w[2] * c.w[3]);
  const double dw_terms = static_cast<double>(c.x[0] * oh * ow);
  ExpectClose(dx_cpu, dx_gpu, ConvTol(dt, dx_terms), what + " dx");
  ExpectClose(dw_cpu, dw_gpu, ConvTol(dt, dw_terms), what + " dw");
  if (c.bias) ExpectClose(db_cpu, db_gpu, ConvTol(dt, dw_terms), what + " db");
}

ops::Conv2dParams Params(int64_t stride, int64_t pad, int64_t dilation = 1, int64_t groups = 1) {
  ops::Conv2dParams p;
  p.stride_h = p.stride_w = stride;
  p.pad_h = p.pad_w = pad;
  p.dilation_h = p.dilation_w = dilation;
  p.groups = groups;
  return p;
}

class CudaConvPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Init();
    ManualSeed(31);
  }
};

TEST_F(CudaConvPoolTest, ConvolutionMatchesCpu) {
  const ConvCase cases[] = {
      {{2, 3, 9, 11}, {4, 3, 3, 3}, Params(1, 1), true},
      {{2, 3, 12, 12}, {5, 3, 3, 3}, Params(2, 0, 2), false},
      {{2, 4, 8, 8}, {6, 2, 3, 3}, Params(1, 1, 1, 2), true},
      {{3, 8, 5, 5}, {16, 8, 1, 1}, Params(1, 0), true},
      {{2, 3, 32, 32}, {16, 3, 7, 7}, Params(2, 3), false},
  };
  for (const ConvCase& c : cases) {
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) CheckConv(c, dt);
  }
}

TEST_F(CudaConvPoolTest, AlgorithmSearchRunsOncePerShapeAndWarmStepsAllocateNothing) {
  const ConvCase c{{4, 16, 14, 14}, {32, 16, 3, 3}, Params(1, 1), true};
  CheckConv(c, DType::kFloat32);  // searches forward, backward data, backward filter
  const size_t searches = ConvAlgorithmSearches();
  const uint64_t allocations = CudaAllocator().Stats(kGpu).system_allocations;
  CheckConv(c, DType::kFloat32);
  EXPECT_EQ(ConvAlgorithmSearches(), searches);
  EXPECT_EQ(CudaAllocator().Stats(kGpu).system_allocations, allocations);
  CheckConv({{4, 16, 15, 15}, {32, 16, 3, 3}, Params(1, 1), true}, DType::kFloat32);  // a new shape
  EXPECT_EQ(ConvAlgorithmSearches(), searches + 3);
}

TEST_F(CudaConvPoolTest, WrongOutputShapeIsNamed) {
  const Tensor x = Empty({1, 3, 8, 8}, {.device = kGpu}), w = Empty({4, 3, 3, 3}, {.device = kGpu});
  const Tensor y = Empty({1, 4, 8, 8}, {.device = kGpu});  // no padding: should be 6x6
  try {
    Gpu().conv2d_forward(x, w, Tensor(), y, Params(1, 0));
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[1, 4, 6, 6]"), std::string::npos) << e.what();
  }
}

// cuDNN rejects a 0 dimension in a descriptor: an empty batch threw in the
// forward, and the backward never reached its zero fills.
TEST_F(CudaConvPoolTest, EmptyBatchGivesAnEmptyOutputAndZeroGradients) {
  const Tensor x = Empty({0, 3, 32, 32}, {.device = kGpu}), w = RandnOf({16, 3, 3, 3}, DType::kFloat32).To(kGpu);
  const Tensor b = RandnOf({16}, DType::kFloat32).To(kGpu);
  const Tensor y = Empty({0, 16, 30, 30}, {.device = kGpu});
  Gpu().conv2d_forward(x, w, b, y, Params(1, 0));
  const Tensor dy = Empty({0, 16, 30, 30}, {.device = kGpu});
  const Tensor dx = Empty({0, 3, 32, 32}, {.device = kGpu});
  const Tensor dw = Full({16, 3, 3, 3}, 7.0f).To(kGpu), db = Full({16}, 7.0f).To(kGpu);
  Gpu().conv2d_backward(x, w, dy, dx, dw, db, Params(1, 0));
  EXPECT_EQ(dw.To(kCPU).ToVector<float>(), std::vector<float>(16 * 3 * 3 * 3, 0.0f));
  EXPECT_EQ(db.To(kCPU).ToVector<float>(), std::vector<float>(16, 0.0f));
}

ops::Pool2dParams Pool(int64_t k, int64_t s, int64_t p, int64_t d = 1, bool ceil = false, bool include_pad = true) {
  ops::Pool2dParams q;
  q.kernel_h = q.kernel_w = k;
  q.stride_h = q.stride_w = s;
  q.pad_h = q.pad_w = p;
  q.dilation_h = q.dilation_w = d;
  q.ceil_mode = ceil;
  q.count_include_pad = include_pad;
  return q;
}

struct PoolCase {
  Shape x;
  int64_t oh, ow;
  ops::Pool2dParams p;
};

const PoolCase kPoolCases[] = {
    {{2, 3, 8, 8}, 4, 4, Pool(2, 2, 0)},                    // the CNN's 2x2
    {{2, 3, 9, 9}, 5, 5, Pool(3, 2, 1)},                    // ResNet's stem: overlapping windows
    {{1, 2, 11, 10}, 4, 3, Pool(3, 2, 0, 2)},               // dilation 2 (max only)
    {{1, 2, 8, 8}, 4, 4, Pool(3, 2, 0, 1, true)},           // ceil mode: a partial last window
    {{1, 2, 7, 7}, 4, 4, Pool(3, 2, 1, 1, false, false)},   // padding not counted in averages
};

TEST_F(CudaConvPoolTest, MaxPoolingMatchesCpuIndicesIncluded) {
  for (const PoolCase& c : kPoolCases) {
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
      const std::string what = "max_pool2d x" + ShapeToString(c.x) + " k" + std::to_string(c.p.kernel_h) + " " +
                               std::string(DTypeName(dt));
      const Tensor x = RandnOf(c.x, dt);
      const Shape ys = {c.x[0], c.x[1], c.oh, c.ow};
      const Tensor y_cpu = Empty(ys, {.dtype = dt}), i_cpu = Empty(ys, {.dtype = DType::kInt32});
      Cpu().max_pool2d_forward(x, y_cpu, i_cpu, c.p);
      const Tensor y_gpu = Empty(ys, {.dtype = dt, .device = kGpu});
      const Tensor i_gpu = Empty(ys, {.dtype = DType::kInt32, .device = kGpu});
      Gpu().max_pool2d_forward(x.To(kGpu), y_gpu, i_gpu, c.p);
      ExpectClose(y_cpu, y_gpu, {0, 0}, what);
      ExpectClose(i_cpu, i_gpu, {0, 0}, what + " indices");

      const Tensor dy = RandnOf(ys, dt);
      const Tensor dx_cpu = Empty(c.x, {.dtype = dt});
      Cpu().max_pool2d_backward(dy, i_cpu, dx_cpu, c.p);
      const Tensor dx_gpu = Empty(c.x, {.dtype = dt, .device = kGpu});
      Gpu().max_pool2d_backward(dy.To(kGpu), i_gpu, dx_gpu, c.p);
      // Overlapping windows may add the same two gradients in another order.
      ExpectClose(dx_cpu, dx_gpu, dt == DType::kBFloat16 ? Tol{8e-3, 1e-3} : Tol{1e-6, 1e-7}, what + " backward");
    }
  }
}

TEST_F(CudaConvPoolTest, AveragePoolingMatchesCpu) {
  for (const PoolCase& c : kPoolCases) {
    if (c.p.dilation_h != 1) continue;  // average pooling has no dilation
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
      const std::string what = "avg_pool2d x" + ShapeToString(c.x) + " k" + std::to_string(c.p.kernel_h) +
                               (c.p.count_include_pad ? "" : " exclude-pad") + " " + std::string(DTypeName(dt));
      const Tol tol = dt == DType::kBFloat16 ? Tol{8e-3, 1e-3} : Tol{1e-6, 1e-7};
      const Tensor x = RandnOf(c.x, dt);
      const Shape ys = {c.x[0], c.x[1], c.oh, c.ow};
      const Tensor y_cpu = Empty(ys, {.dtype = dt});
      Cpu().avg_pool2d_forward(x, y_cpu, c.p);
      const Tensor y_gpu = Empty(ys, {.dtype = dt, .device = kGpu});
      Gpu().avg_pool2d_forward(x.To(kGpu), y_gpu, c.p);
      ExpectClose(y_cpu, y_gpu, tol, what);

      const Tensor dy = RandnOf(ys, dt);
      const Tensor dx_cpu = Empty(c.x, {.dtype = dt});
      Cpu().avg_pool2d_backward(dy, dx_cpu, c.p);
      const Tensor dx_gpu = Empty(c.x, {.dtype = dt, .device = kGpu});
      Gpu().avg_pool2d_backward(dy.To(kGpu), dx_gpu, c.p);
      ExpectClose(dx_cpu, dx_gpu, tol, what + " backward");
    }
  }
}

TEST_F(CudaConvPoolTest, AdaptiveAveragePoolingMatchesCpu) {
  const std::pair<Shape, Shape> cases[] = {
      {{2, 3, 7, 7}, {1, 1}}, {{2, 3, 7, 7}, {3, 2}}, {{1, 2, 5, 5}, {7, 7}}, {{1, 1, 10, 3}, {4, 3}}};
  for (const auto& [xs, os] : cases) {
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
      const std::string what = "adaptive_avg_pool2d " + ShapeToString(xs) + " -> " + ShapeToString(os) + " " +
                               std::string(DTypeName(dt));
      const Tol tol = dt == DType::kBFloat16 ? Tol{8e-3, 1e-3} : Tol{1e-6, 1e-7};
      const Tensor x = RandnOf(xs, dt);
      const Shape ys = {xs[0], xs[1], os[0], os[1]};
      const Tensor y_cpu = Empty(ys, {.dtype = dt});
      Cpu().adaptive_avg_pool2d_forward(x, y_cpu);
      const Tensor y_gpu = Empty(ys, {.dtype = dt, .device = kGpu});
      Gpu().adaptive_avg_pool2d_forward(x.To(kGpu), y_gpu);
      ExpectClose(y_cpu, y_gpu, tol, what);

      const Tensor dy = RandnOf(ys, dt);
      const Tensor dx_cpu = Empty(xs, {.dtype = dt});
      Cpu().adaptive_avg_pool2d_backward(dy, dx_cpu);
      const Tensor dx_gpu = Empty(xs, {.dtype = dt, .device = kGpu});
      Gpu().adaptive_avg_pool2d_backward(dy.To(kGpu), dx_gpu);
      ExpectClose(dx_cpu, dx_gpu, tol, what + " backward");
    }
  }
}

}  // namespace
}  // namespace ddp::nn::cuda
