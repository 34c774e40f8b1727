// Kernel-level checks: the two GEMM backends and the two convolution
// algorithms agree; 16-bit inputs compute in f32 (pooling gradients too);
// bad targets are reported; edge values and shapes (NaN through ReLU,
// 16-bit and empty means, integer division, no inner dimension) behave as
// in PyTorch.
#include <gtest/gtest.h>

#include <unistd.h>

#include <functional>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nn/autograd/engine.h"
#include "nn/ops/config.h"
#include "nn/ops/cpu/cpu_kernels.h"
#include "nn/ops/dispatch.h"
#include "nn/ops/functional.h"
#include "nn/tensor/testing/host_as_device.h"

namespace ddp::nn::ops {
namespace {

double MaxAbsDiff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.ToVector<double>(), y = b.ToVector<double>();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(x[i] - y[i]));
  return m;
}

TEST(KernelsTest, GemmBackendsAgreeIncludingTransposedOperands) {
  Generator gen(1);
  Tensor a = Rand({37, 19}, {}, gen), b = Rand({23, 19}, {}, gen);
  Tensor ref = Matmul(a.To(DType::kFloat64), b.To(DType::kFloat64).Transpose(0, 1));
  for (GemmBackend backend : {GemmBackend::kOneDnn, GemmBackend::kOpenBlas}) {
    SetGemmBackend(backend);
    Tensor c = Matmul(a, b.Transpose(0, 1));
    EXPECT_LT(MaxAbsDiff(c, ref), 1e-4) << static_cast<int>(backend);
    Tensor c2 = Matmul(a.Transpose(0, 1).Contiguous().Transpose(0, 1), b.Transpose(0, 1));
    EXPECT_LT(MaxAbsDiff(c2, ref), 1e-4);
  }
  SetGemmBackend(GemmBackend::kOneDnn);
}

// OpenBLAS takes 32-bit sizes: one past 2^31 - 1 is refused, named, before
// any memory is read (the pointers here point at nothing that large).
TEST(KernelsTest, GemmSizesPastOpenBlasLimitAreNamed) {
  const int64_t big = int64_t{1} << 31;
  float f = 0;
  double d = 0;
  auto error = [](const std::function<void()>& gemm) {
    try {
      gemm();
    } catch (const std::length_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error([&] { cpu::Dgemm(false, false, 1, 1, big, 1, &d, big, &d, 1, 0, &d, 1); }),
            "dgemm: k = 2147483648 exceeds OpenBLAS's limit of 2147483647");
  EXPECT_EQ(error([&] { cpu::Dgemm(false, false, 1, 1, 1, 1, &d, 1, &d, 1, 0, &d, big + 5); }),
            "dgemm: ldc = 2147483653 exceeds OpenBLAS's limit of 2147483647");
  SetGemmBackend(GemmBackend::kOpenBlas);
  EXPECT_EQ(error([&] { cpu::Sgemm(false, false, big, 1, 1, 1, &f, 1, &f, 1, 0, &f, 1); }),
            "sgemm: m = 2147483648 exceeds OpenBLAS's limit of 2147483647");
  SetGemmBackend(GemmBackend::kOneDnn);
  // Within the limit, both still compute.
  const double a = 3, b = 4;
  cpu::Dgemm(false, false, 1, 1, 1, 2, &a, 1, &b, 1, 0, &d, 1);
  EXPECT_EQ(d, 24);
}

TEST(KernelsTest, SixteenBitLinearComputesInF32) {
  Generator gen(2);
  Tensor x = Rand({8, 16}, {}, gen), w = Rand({4, 16}, {}, gen), b = Rand({4}, {}, gen);
  Tensor ref = Linear(x, w, b);
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    Tensor y = Linear(x.To(t), w.To(t), b.To(t));
    EXPECT_EQ(y.dtype(), t);
    EXPECT_LT(MaxAbsDiff(y, ref), t == DType::kFloat16 ? 2e-2 : 1e-1) << DTypeName(t);
    // An f32 input into a 16-bit layer is cast to the layer's dtype.
    EXPECT_EQ(Linear(x, w.To(t), b.To(t)).dtype(), t);
  }
}

TEST(KernelsTest, ConvAlgorithmsAgree) {
  struct Case {
    Shape x, w;
    Conv2dParams p;
  } cases[] = {
      {{4, 1, 28, 28}, {32, 1, 3, 3}, {}},
      {{4, 32, 13, 13}, {64, 32, 3, 3}, {}},
      {{2, 16, 9, 9}, {32, 16, 3, 3}, {.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1}},
      {{2, 32, 8, 8}, {32, 16, 3, 3}, {.pad_h = 2, .pad_w = 2, .dilation_h = 2, .dilation_w = 2, .groups = 2}},
      {{2, 64, 7, 7}, {16, 64, 1, 1}, {}},
  };
  Generator gen(3);
  for (const Case& c : cases) {
    Tensor x = Rand(c.x, {}, gen), w = Rand(c.w, {}, gen), b = Rand({c.w[0]}, {}, gen);
    std::vector<Tensor> results;
    for (ConvAlgorithm algo : {ConvAlgorithm::kIm2col, ConvAlgorithm::kOneDnn}) {
      SetConvAlgorithm(algo);
      Tensor xl = x.Detach(), wl = w.Detach(), bl = b.Detach();
      xl.set_requires_grad(true);
      wl.set_requires_grad(true);
      bl.set_requires_grad(true);
      Tensor y = Conv2d(xl, wl, bl, c.p);
      Backward(Sum(Square(y)));
      results.insert(results.end(), {y, xl.grad(), wl.grad(), bl.grad()});
    }
    SetConvAlgorithm(ConvAlgorithm::kAuto);
    for (int k = 0; k < 4; ++k) {
      const double scale = 1 + std::fabs(results[k].ToVector<double>()[0]);
      EXPECT_LT(MaxAbsDiff(results[k], results[k + 4]) / scale, 1e-3) << ShapeToString(c.x) << " output " << k;
    }
  }
}

// An empty batch (N = 0): the output is [0, O, OH, OW], and backward gives
// zero weight and bias gradients, as PyTorch 1.13:
//   x = torch.zeros(0, 3, 5, 5, requires_grad=True); w = torch.randn(4, 3, 3, 3, requires_grad=True)
//   F.conv2d(x, w, b).sum().backward()  # w.grad 0, b.grad [0, 0, 0, 0], x.grad [0, 3, 5, 5]
// Buffers of NaN are freed just before backward, so that a gradient buffer
// left unwritten (reusing their memory) would show.
TEST(KernelsTest, Conv2dOfAnEmptyBatchGivesZeroWeightAndBiasGradients) {
  struct Case {
    Shape x, w;
    Conv2dParams p;
  } cases[] = {
      {{0, 3, 5, 5}, {4, 3, 3, 3}, {}},
      {{0, 4, 6, 6}, {6, 2, 3, 3}, {.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1, .groups = 2}},
      {{0, 8, 4, 4}, {5, 8, 1, 1}, {}},
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Generator gen(9);
  for (ConvAlgorithm algo : {ConvAlgorithm::kIm2col, ConvAlgorithm::kOneDnn, ConvAlgorithm::kAuto}) {
    SetConvAlgorithm(algo);
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
      for (const Case& c : cases) {
        SCOPED_TRACE(ShapeToString(c.w) + " " + std::string(DTypeName(dt)) + " algorithm " +
                     std::to_string(static_cast<int>(algo)));
        Tensor x = Zeros(c.x, {.dtype = dt, .requires_grad = true});
        Tensor w = Rand(c.w, {.dtype = dt}, gen).Detach();
        w.set_requires_grad(true);
        Tensor b = Rand({c.w[0]}, {.dtype = dt}, gen).Detach();
        b.set_requires_grad(true);
        const Tensor y = Conv2d(x, w, b, c.p);
        ASSERT_EQ(y.shape()[0], 0);
        ASSERT_EQ(y.shape()[1], c.w[0]);
        for (int k = 0; k < 4; ++k) {
          Full(c.w, nan, {.dtype = dt});
          Full({c.w[0]}, nan, {.dtype = dt});
        }
        Backward(Sum(y));
        ASSERT_TRUE(w.grad().defined());
        ASSERT_TRUE(b.grad().defined());
        EXPECT_EQ(x.grad().shape(), c.x);
        EXPECT_EQ(w.grad().shape(), c.w);
        for (double g : w.grad().ToVector<double>()) EXPECT_EQ(g, 0.0);
        EXPECT_EQ(b.grad().ToVector<double>(), std::vector<double>(static_cast<size_t>(c.w[0]), 0.0));
      }
    }
  }
  SetConvAlgorithm(ConvAlgorithm::kAuto);
}

// Every input shape gets its own oneDNN primitives; a run meeting many
// (images of varying sizes) keeps at most kOneDnnConvCacheEntries of them,
// and a shape evicted and met again is built anew and still right. Before,
// the cache grew with every shape for the life of the process.
TEST(KernelsTest, OneDnnConvCacheIsBounded) {
  Generator gen(5);
  const Tensor w = Rand({4, 2, 3, 3}, {}, gen);
  const Tensor first = Rand({1, 2, 8, 8}, {}, gen);
  SetConvAlgorithm(ConvAlgorithm::kOneDnn);
  const Tensor y_first = Conv2d(first, w, Tensor(), {});
  for (int64_t size = 9; size < 9 + kOneDnnConvCacheEntries + 8; ++size) {
    Conv2d(Rand({1, 2, 8, size}, {}, gen), w, Tensor(), {});
    EXPECT_LE(OneDnnConvCacheSize(), kOneDnnConvCacheEntries) << size;
  }
  EXPECT_EQ(OneDnnConvCacheSize(), kOneDnnConvCacheEntries);
  const Tensor again = Conv2d(first, w, Tensor(), {});  // evicted: built again
  SetConvAlgorithm(ConvAlgorithm::kIm2col);
  const Tensor reference = Conv2d(first, w, Tensor(), {});
  SetConvAlgorithm(ConvAlgorithm::kAuto);
  EXPECT_EQ(MaxAbsDiff(again, y_first), 0.0);
  EXPECT_LT(MaxAbsDiff(again, reference), 1e-4);
}

// The vectorized f32 path for 2x2/2 max pooling against the generic path
// (f64), with odd sizes (an uncovered last row and column) and a NaN.
TEST(KernelsTest, MaxPool2x2FastPathMatchesGenericPath) {
  const Pool2dParams p{.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2};
  for (const Shape& shape : {Shape{2, 3, 26, 26}, Shape{2, 3, 11, 11}, Shape{1, 2, 5, 18}}) {
    Generator gen(4);
    Tensor base = Randn(shape, {.dtype = DType::kFloat64}, gen);
    base.data<double>()[7] = std::nan("");
    Tensor x32 = base.To(DType::kFloat32), x64 = base.Detach();
    x32.set_requires_grad(true);
    x64.set_requires_grad(true);
    Tensor y32 = MaxPool2d(x32, p), y64 = MaxPool2d(x64, p);
    const std::vector<double> a = y32.ToVector<double>(), b = y64.ToVector<double>();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::isnan(b[i])) {
        EXPECT_TRUE(std::isnan(a[i])) << i;
      } else {
        EXPECT_FLOAT_EQ(a[i], b[i]) << i;
      }
    }
    Tensor g = Randn(y64.shape(), {.dtype = DType::kFloat64}, gen);
    Backward(y32, g.To(DType::kFloat32));
    Backward(y64, g);
    EXPECT_LT(MaxAbsDiff(x32.grad(), x64.grad()), 1e-6) << ShapeToString(shape);
  }
}

// A window with several NaNs: the last one in scan order gets the gradient,
// as PyTorch's indices say (max_pool2d(..., return_indices=True) on these
// inputs gives 2, 4 and 3). The 2x2/2 paths (f32 vectorized and its tail,
// f64 scalar) and the generic one (3x3/1) are checked.
TEST(KernelsTest, MaxPoolPicksTheLastNaNAsPyTorch) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Pool2dParams p22{.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2};
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    // Ten windows side by side (vector body and tail), each [[nan, 1], [nan, 2]].
    std::vector<double> v;
    for (int row = 0; row < 2; ++row) {
      for (int k = 0; k < 10; ++k) {
        v.push_back(nan);
        v.push_back(row == 0 ? 1 : 2);
      }
    }
    Tensor x = FromVector(v, Shape{1, 1, 2, 20}).To(dtype);
    x.set_requires_grad(true);
    Tensor y = MaxPool2d(x, p22);
    for (double e : y.ToVector<double>()) EXPECT_TRUE(std::isnan(e)) << DTypeName(dtype);
    Backward(Sum(y));
    const std::vector<double> g = x.grad().ToVector<double>();
    for (int k = 0; k < 10; ++k) {
      EXPECT_EQ(g[2 * k], 0) << DTypeName(dtype) << " window " << k;
      EXPECT_EQ(g[20 + 2 * k], 1) << DTypeName(dtype) << " window " << k;  // the second row's NaN
    }
    // [[1, nan], [nan, 2]] in the first 2x2 window of a 4x4 plane: index 4.
    Tensor x4 = FromVector({1, nan, 0, 0, nan, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, Shape{1, 1, 4, 4}).To(dtype);
    x4.set_requires_grad(true);
    Backward(Sum(MaxPool2d(x4, p22)));
    EXPECT_EQ(x4.grad().ToVector<double>()[1], 0) << DTypeName(dtype);
    EXPECT_EQ(x4.grad().ToVector<double>()[4], 1) << DTypeName(dtype);
    // The generic path: one 3x3 window over [[1, nan, 0], [nan, 2, 0], [0, 0, 0]]: index 3.
    const Pool2dParams p33{.kernel_h = 3, .kernel_w = 3, .stride_h = 1, .stride_w = 1};
    Tensor x3 = FromVector({1, nan, 0, nan, 2, 0, 0, 0, 0}, Shape{1, 1, 3, 3}).To(dtype);
    x3.set_requires_grad(true);
    Backward(Sum(MaxPool2d(x3, p33)));
    EXPECT_EQ(x3.grad().ToVector<double>(), (std::vector<double>{0, 0, 0, 1, 0, 0, 0, 0, 0})) << DTypeName(dtype);
  }
}

// With ceil_mode the last windows of an odd-sized plane hang over its edge:
// only the cells inside count. Plane 1 holds larger values right after
// plane 0, so a window that read past plane 0 would return one of them.
TEST(KernelsTest, MaxPool2x2CeilModeStaysInsideThePlane) {
  const Pool2dParams p{.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2, .ceil_mode = true};
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    std::vector<double> values;
    for (int i = 1; i <= 9; ++i) values.push_back(-i);                  // plane 0: -1 .. -9
    for (int i = 0; i < 9; ++i) values.push_back(100 + i);              // plane 1: 100 .. 108
    Tensor x = FromVector(values, Shape{1, 2, 3, 3}).To(dtype);
    Tensor y = MaxPool2d(x, p);
    ASSERT_EQ(y.shape(), (Shape{1, 2, 2, 2}));
    EXPECT_EQ(y.ToVector<double>(), (std::vector<double>{-1, -3, -7, -9, 104, 105, 107, 108}))
        << DTypeName(dtype);
  }
}

// Backward finds each maximum by an i32 offset within its plane, so a plane
// of 2^31 elements or more is refused when a gradient is wanted, before any
// output is allocated (the GPU kernel wrapped the offsets, zeroing half the
// gradient). A broadcast view makes the huge input without its memory.
TEST(KernelsTest, MaxPoolRefusesPlanesBeyondItsI32Indices) {
  Tensor leaf = Ones({1, 1, 1, 1});
  leaf.set_requires_grad(true);
  const Tensor x = Expand(leaf, {1, 1, 65536, 32769});
  const Pool2dParams p{.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2};
  try {
    MaxPool2d(x, p);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("65536x32769 elements is more than the i32 indices"),
              std::string::npos)
        << e.what();
  }
}

// The plane's element count is checked without forming H * W, which for
// an empty batch can leave int64: [0, 1, 2^32, 2^32] (a broadcast view,
// holding nothing) made H * W wrap to 0, and the plane passed as small.
TEST(KernelsTest, MaxPoolRefusesAHugePlaneOfAnEmptyBatch) {
  Tensor leaf = Ones({1, 1, 1, 1});
  leaf.set_requires_grad(true);
  const int64_t side = int64_t{1} << 32;
  const Tensor x = Expand(leaf, {0, 1, side, side});
  const Pool2dParams p{.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2};
  try {
    MaxPool2d(x, p);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("4294967296x4294967296 elements is more than the i32 indices"),
              std::string::npos)
        << e.what();
  }
  // Without a gradient no indices are kept: the empty batch runs.
  EXPECT_EQ(MaxPool2d(x.Detach(), p).shape(), (Shape{0, 1, side / 2, side / 2}));
}

// An empty batch costs no memory in the CPU pooling kernels: max pooling
// without a gradient took one output plane of i32 scratch, and a 16-bit
// pooling gradient one input plane of f32, both sized from H and W alone
// ([0, 1, 2^31, 2^31] asked for 2^62 elements and threw).
TEST(KernelsTest, PoolingAnEmptyBatchAllocatesNoPlane) {
  const int64_t side = int64_t{1} << 31;
  const Pool2dParams p{.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2};
  EXPECT_EQ(MaxPool2d(Expand(Ones({1, 1, 1, 1}), {0, 1, side, side}), p).shape(),
            (Shape{0, 1, side / 2, side / 2}));
  Tensor leaf = Ones({1, 1, 1, 1}, {.dtype = DType::kBFloat16});
  leaf.set_requires_grad(true);
  Backward(Sum(AvgPool2d(Expand(leaf, {0, 1, side, side}), p)));
  ASSERT_TRUE(leaf.grad().defined());
  EXPECT_EQ(leaf.grad().To(DType::kFloat32).ToVector<float>(), std::vector<float>{0.0f});
}

// An empty batch takes no im2col scratch: it was sized for one image even
// when there was none, so an empty batch of broadcast [2^31, 2^31] planes
// asked for 9 * 2^62 elements and threw. The gradients stay as for any
// empty batch (zero dw and db).
TEST(KernelsTest, Conv2dOfAnEmptyBatchTakesNoScratch) {
  const int64_t side = int64_t{1} << 31;
  for (ConvAlgorithm algo : {ConvAlgorithm::kIm2col, ConvAlgorithm::kOneDnn, ConvAlgorithm::kAuto}) {
    SCOPED_TRACE(static_cast<int>(algo));
    SetConvAlgorithm(algo);
    Tensor leaf = Ones({1, 1, 1, 1});
    leaf.set_requires_grad(true);
    Tensor w = Ones({2, 1, 3, 3});
    w.set_requires_grad(true);
    Tensor b = Ones({2});
    b.set_requires_grad(true);
    const Tensor y = Conv2d(Expand(leaf, {0, 1, side, side}), w, b, {});
    EXPECT_EQ(y.shape(), (Shape{0, 2, side - 2, side - 2}));
    Backward(Sum(y));
    EXPECT_EQ(w.grad().ToVector<float>(), std::vector<float>(18, 0.0f));
    EXPECT_EQ(b.grad().ToVector<float>(), std::vector<float>(2, 0.0f));
    EXPECT_EQ(leaf.grad().ToVector<float>(), std::vector<float>{0.0f});
  }
  SetConvAlgorithm(ConvAlgorithm::kAuto);
}

// window starting inside) do not rule out a window with no tap inside the
// input: a 2-tap window with dilation 2 and padding 1 on a single row reads
// rows -1 and 1. PyTorch accepts these arguments too. Such a window gives
// -inf and sends its gradient nowhere; before, every one of them sent it to
// cell (0, 0) of its plane.
TEST(KernelsTest, MaxPoolWindowWithNoInputCellGetsMinusInfAndNoGradient) {
  const Pool2dParams p{.kernel_h = 2, .kernel_w = 2, .stride_h = 1, .stride_w = 1, .pad_h = 1, .pad_w = 1,
                       .dilation_h = 2, .dilation_w = 1};
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    Tensor x = FromVector({1, 2, 3, -4, -5, -6}, Shape{1, 2, 1, 3}).To(dtype);
    x.set_requires_grad(true);
    Tensor y = MaxPool2d(x, p);
    ASSERT_EQ(y.shape(), (Shape{1, 2, 1, 4})) << DTypeName(dtype);
    for (double v : y.ToVector<double>()) EXPECT_EQ(v, -inf) << DTypeName(dtype);
    Backward(Sum(y));
    EXPECT_EQ(x.grad().ToVector<double>(), std::vector<double>(6, 0.0)) << DTypeName(dtype);
  }
}

// ceil_mode on an input smaller than the window, as PyTorch takes it: one
// window, hanging over the edge (GoogLeNet's MaxPool2d(3, 2, ceil_mode) on a
// 2x2 map; a 2x2 window on 1x1). Without ceil_mode no window fits.
TEST(KernelsTest, CeilModePoolsAnInputSmallerThanTheWindow) {
  EXPECT_EQ(ConvOutputSize(2, 3, 2, 0, 1, true), 1);
  EXPECT_EQ(ConvOutputSize(1, 2, 2, 0, 1, true), 1);
  EXPECT_EQ(ConvOutputSize(1, 2, 2, 0, 1, false), 0);
  EXPECT_EQ(ConvOutputSize(1, 4, 2, 0, 1, true), 0);  // short by more than a stride
  const Pool2dParams p{.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .ceil_mode = true};
  Tensor x = FromVector({1, 4, 3, 2}, Shape{1, 1, 2, 2});
  Tensor y = MaxPool2d(x, p);
  ASSERT_EQ(y.shape(), (Shape{1, 1, 1, 1}));
  EXPECT_EQ(y.ToVector<double>(), (std::vector<double>{4}));
  Tensor a = AvgPool2d(x, p);
  ASSERT_EQ(a.shape(), (Shape{1, 1, 1, 1}));
  EXPECT_EQ(a.ToVector<double>(), (std::vector<double>{2.5}));
  EXPECT_THROW(MaxPool2d(x, {.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2}), std::invalid_argument);
}

// Overlapping windows add several terms into one input gradient. In bf16 the
// sum is taken in f32 and rounded once (as the CUDA kernels do): the result
// equals the f32 computation on the same values, rounded to bf16, bit for
// bit. Rounding after every term drifts by a few bf16 ulps.
TEST(KernelsTest, SixteenBitPoolingGradientsRoundOnce) {
  const KernelTable& cpu = KernelsFor(DeviceType::kCPU);
  const Pool2dParams p{.kernel_h = 3, .kernel_w = 3, .stride_h = 1, .stride_w = 1, .pad_h = 1, .pad_w = 1};
  Generator gen(11);
  const Shape xs{2, 3, 9, 9};
  const Tensor x = Randn(xs, {}, gen).To(DType::kBFloat16);
  // Bitwise equality, read as the bf16 values both sides hold.
  auto expect_same = [](const Tensor& got, const Tensor& f32, const char* what) {
    const std::vector<double> a = got.ToVector<double>(), b = f32.To(DType::kBFloat16).ToVector<double>();
    ASSERT_EQ(a.size(), b.size()) << what;
    int differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
    EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << a.size() << " gradients";
  };
  {
    // Max pooling, stride 1: a local maximum is picked by up to nine windows.
    const Tensor y = Empty(xs, {.dtype = DType::kBFloat16}), ind = Empty(xs, {.dtype = DType::kInt32});
    cpu.max_pool2d_forward(x, y, ind, p);
    const Tensor dy = Randn(xs, {}, gen).To(DType::kBFloat16);
    const Tensor dx = Empty(xs, {.dtype = DType::kBFloat16}), dx32 = Empty(xs);
    cpu.max_pool2d_backward(dy, ind, dx, p);
    cpu.max_pool2d_backward(dy.To(DType::kFloat32), ind, dx32, p);
    expect_same(dx, dx32, "max_pool2d");
  }
  {
    const Tensor dy = Randn(xs, {}, gen).To(DType::kBFloat16);
    const Tensor dx = Empty(xs, {.dtype = DType::kBFloat16}), dx32 = Empty(xs);
    cpu.avg_pool2d_backward(dy, dx, p);
    cpu.avg_pool2d_backward(dy.To(DType::kFloat32), dx32, p);
    expect_same(dx, dx32, "avg_pool2d");
  }
  {
    // 9x9 -> 13x13: neighbouring output windows share input cells.
    const Tensor dy = Randn({2, 3, 13, 13}, {}, gen).To(DType::kBFloat16);
    const Tensor dx = Empty(xs, {.dtype = DType::kBFloat16}), dx32 = Empty(xs);
    cpu.adaptive_avg_pool2d_backward(dy, dx);
    cpu.adaptive_avg_pool2d_backward(dy.To(DType::kFloat32), dx32);
    expect_same(dx, dx32, "adaptive_avg_pool2d");
  }
}

// torch.relu keeps NaN (and -0): for every floating dtype, contiguous or
// strided, and in place (ReluOwned). The gradient is 0 where x <= 0 and g
// elsewhere, NaN included (PyTorch's threshold_backward passes it there).
TEST(KernelsTest, ReluKeepsNaN) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(std::string(DTypeName(t)));
    const Tensor x = FromVector({-1.5, nan, 0.0, 2.0, -0.0}, {5}, {.dtype = t});
    const Tensor wide = FromVector({-1.5, 9, nan, 9, 0.0, 9, 2.0, 9, -0.0, 9}, {10}, {.dtype = t});
    const Tensor strided = wide.Slice(0, 0, 10, 2);
    ASSERT_FALSE(strided.is_contiguous());
    for (const Tensor& y : {Relu(x), Relu(strided), ReluOwned(x.Clone())}) {
      const std::vector<double> v = y.ToVector<double>();
      EXPECT_EQ(v[0], 0.0);
      EXPECT_TRUE(std::isnan(v[1]));
      EXPECT_EQ(v[2], 0.0);
      EXPECT_EQ(v[3], 2.0);
      EXPECT_EQ(v[4], 0.0);
      EXPECT_TRUE(std::signbit(v[4]));  // -0 stays -0, as in PyTorch
    }
  }
  Tensor x = FromVector({-1.5, 0.0, 2.0, nan}, {4}, {.requires_grad = true});
  Backward(Sum(Relu(x)));
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{0, 0, 1, 1}));
}

// torch.clamp in PyTorch 1.13 (f64; every value here is exact in each dtype):
//   x = torch.tensor([nan, -inf, -1, 0, 0.5, 1, 2, inf], dtype=torch.float64, requires_grad=True)
//   x.clamp(0, 1)   # [nan, 0, 0, 0, 0.5, 1, 1, 1];      grad [0, 0, 0, 1, 1, 1, 0, 0]
//   x.clamp(min=0)  # [nan, 0, 0, 0, 0.5, 1, 2, inf];    grad [0, 0, 0, 1, 1, 1, 1, 1]
//   x.clamp(max=1)  # [nan, -inf, -1, 0, 0.5, 1, 1, 1];  grad [0, 1, 1, 1, 1, 1, 0, 0]
//   x.clamp(2, 1)   # [nan, 1, 1, 1, 1, 1, 1, 1];        grad all 0
//   x.clamp(1, 1)   # [nan, 1, 1, 1, 1, 1, 1, 1];        grad [0, 0, 0, 0, 0, 1, 0, 0]
// NaN stays NaN and gets no gradient; the bounds themselves pass it.
TEST(KernelsTest, ClampMatchesPyTorchAtNaNInfinitiesAndBounds) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> in = {nan, -inf, -1, 0, 0.5, 1, 2, inf};
  struct Case {
    std::optional<double> lo, hi;
    std::vector<double> values, grad;
  };
  const std::vector<Case> cases = {
      {0.0, 1.0, {nan, 0, 0, 0, 0.5, 1, 1, 1}, {0, 0, 0, 1, 1, 1, 0, 0}},
      {0.0, std::nullopt, {nan, 0, 0, 0, 0.5, 1, 2, inf}, {0, 0, 0, 1, 1, 1, 1, 1}},
      {std::nullopt, 1.0, {nan, -inf, -1, 0, 0.5, 1, 1, 1}, {0, 1, 1, 1, 1, 1, 0, 0}},
      {2.0, 1.0, {nan, 1, 1, 1, 1, 1, 1, 1}, {0, 0, 0, 0, 0, 0, 0, 0}},
      {1.0, 1.0, {nan, 1, 1, 1, 1, 1, 1, 1}, {0, 0, 0, 0, 0, 1, 0, 0}},
  };
  const auto expect_same = [](const std::vector<double>& got, const std::vector<double>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      if (std::isnan(want[i])) {
        EXPECT_TRUE(std::isnan(got[i])) << "element " << i << ": " << got[i];
      } else {
        EXPECT_EQ(got[i], want[i]) << "element " << i;
      }
    }
  };
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    for (size_t c = 0; c < cases.size(); ++c) {
      SCOPED_TRACE(std::string(DTypeName(t)) + " case " + std::to_string(c));
      Tensor x = FromVector(in, {8}, {.dtype = t, .requires_grad = true});
      const Tensor y = Clamp(x, cases[c].lo, cases[c].hi);
      EXPECT_EQ(y.dtype(), t);
      expect_same(y.ToVector<double>(), cases[c].values);
      Backward(Sum(y));
      expect_same(x.grad().ToVector<double>(), cases[c].grad);
      // Every other element of a wider tensor: the strided path.
      std::vector<double> wide;
      for (double v : in) wide.insert(wide.end(), {v, 7.0});
      const Tensor strided = FromVector(wide, {16}, {.dtype = t}).Slice(0, 0, 16, 2);
      ASSERT_FALSE(strided.is_contiguous());
      expect_same(Clamp(strided, cases[c].lo, cases[c].hi).ToVector<double>(), cases[c].values);
    }
  }
}

// The bounds are rounded to the tensor's dtype first, as PyTorch compares a
// tensor with a scalar in the tensor's dtype (1.13, bf16):
//   b = torch.tensor([1.0, 1.0078125], dtype=torch.bfloat16, requires_grad=True)
//   b.clamp(max=1.005)  # [1.0, 1.0078125], grad [1, 1] (1.005 rounds up to 1.0078125)
//   b.clamp(max=1.003)  # [1.0, 1.0],       grad [1, 0] (1.003 rounds down to 1.0)
//   torch.tensor([1.0], requires_grad=True).clamp(max=1.00000001)  # grad [1]
// f16 (which 1.13 does not clamp on the CPU) follows the same rule, with
// steps of 2^-10 above 1.
TEST(KernelsTest, ClampRoundsItsBoundsToTheDtypeAsPyTorch) {
  struct Case {
    DType dtype;
    double step;  // the dtype's next value above 1, minus 1
    double up, down;  // bounds that round to 1 + step and to 1
  };
  for (const Case& c : {Case{DType::kBFloat16, 0.0078125, 1.005, 1.003},
                        Case{DType::kFloat16, 0.0009765625, 1.0006, 1.0004}}) {
    SCOPED_TRACE(std::string(DTypeName(c.dtype)));
    Tensor x = FromVector({1.0, 1.0 + c.step}, {2}, {.dtype = c.dtype, .requires_grad = true});
    Tensor y = Clamp(x, std::nullopt, c.up);
    EXPECT_EQ(y.ToVector<double>(), (std::vector<double>{1.0, 1.0 + c.step}));
    Backward(Sum(y));
    EXPECT_EQ(x.grad().ToVector<double>(), (std::vector<double>{1, 1}));
    x.set_grad(Tensor());
    y = Clamp(x, std::nullopt, c.down);
    EXPECT_EQ(y.ToVector<double>(), (std::vector<double>{1.0, 1.0}));
    Backward(Sum(y));
    EXPECT_EQ(x.grad().ToVector<double>(), (std::vector<double>{1, 0}));
  }
  Tensor one = FromVector({1.0}, {1}, {.requires_grad = true});
  Backward(Sum(Clamp(one, std::nullopt, 1.00000001)));
  EXPECT_EQ(one.grad().ToVector<double>(), (std::vector<double>{1}));
  one.set_grad(Tensor());
  const Tensor lifted = Clamp(one, 1.00000001, std::nullopt);
  EXPECT_EQ(lifted.ToVector<double>(), (std::vector<double>{1}));
  Backward(Sum(lifted));
  EXPECT_EQ(one.grad().ToVector<double>(), (std::vector<double>{1}));
}

// log1p keeps a tiny x that 1 + x rounds away (f32 log(1 + 1e-10) is 0),
// and matches PyTorch's values at its edges (1.13):
//   torch.log1p(torch.tensor([1e-7, 2, -0.5, -1, inf, nan, -2]))
//   # [9.9999994e-08, 1.0986123, -0.69314718, -inf, inf, nan, nan]
TEST(KernelsTest, Log1pIsAccurateForTinyInputsAndMatchesPyTorchAtTheEdges) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> tiny = Log1p(FromVector({1e-10}, {1})).ToVector<double>();
  EXPECT_EQ(tiny[0], static_cast<double>(1e-10f));
  EXPECT_EQ(Log(AddScalar(FromVector({1e-10}, {1}), 1.0)).ToVector<double>()[0], 0.0);  // what log1p avoids
  const std::vector<double> in = {1e-7, 2, -0.5, -1, inf, nan, -2};
  const std::vector<double> f32 = Log1p(FromVector(in, {7})).ToVector<double>();
  const std::vector<double> want = {9.99999940631823847070e-08, 1.09861230850219726562, -6.93147182464599609375e-01};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(f32[i], want[i]) << i;
  EXPECT_EQ(f32[3], -inf);
  EXPECT_EQ(f32[4], inf);
  EXPECT_TRUE(std::isnan(f32[5]));
  EXPECT_TRUE(std::isnan(f32[6]));
  const std::vector<double> f64 = Log1p(FromVector(in, {7}, {.dtype = DType::kFloat64})).ToVector<double>();
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(f64[i], std::log1p(in[i])) << i;
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    const Tensor y = Log1p(FromVector({0.5, 2.0}, {2}, {.dtype = t}));
    EXPECT_EQ(y.dtype(), t);
    EXPECT_EQ(y.ToVector<double>(), FromVector({std::log1p(0.5), std::log1p(2.0)}, {2}, {.dtype = t}).ToVector<double>())
        << DTypeName(t);
  }
  // d/dx log1p(x) = 1 / (1 + x).
  Tensor x = FromVector({1e-10, 1.0, -0.5}, {3}, {.dtype = DType::kFloat64, .requires_grad = true});
  Backward(Sum(Log1p(x)));
  EXPECT_EQ(x.grad().ToVector<double>(), (std::vector<double>{1.0 / (1.0 + 1e-10), 0.5, 2.0}));
}

// The mean scales the f64 sum before rounding into the 16-bit result: the
// sum of 100000 ones overflows f16 (max 65504), their mean does not.
TEST(KernelsTest, SixteenBitMeanScalesBeforeRounding) {
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(std::string(DTypeName(t)));
    const Tensor ones = Ones({100000}, {.dtype = t});
    const Tensor mean = Mean(ones);
    EXPECT_EQ(mean.dtype(), t);
    EXPECT_EQ(mean.Item(), 1.0);
    const Tensor rows = Mean(Ones({2, 100000}, {.dtype = t}), {1});
    EXPECT_EQ(rows.ToVector<double>(), (std::vector<double>{1.0, 1.0}));
  }
  // bf16 values near its maximum: the sum leaves f32's range, the mean does not.
  const Tensor big = Full({4}, 3e38, {.dtype = DType::kBFloat16});
  EXPECT_NEAR(Mean(big).Item(), 3e38, 3e36);
}

// A mean over no elements is NaN, as in PyTorch; its gradient is empty.
TEST(KernelsTest, MeanOfNothingIsNaN) {
  Tensor empty = Zeros({0}, {.requires_grad = true});
  const Tensor m = Mean(empty);
  EXPECT_TRUE(std::isnan(m.Item()));
  Backward(m);
  EXPECT_EQ(empty.grad().shape(), (Shape{0}));
  const Tensor rows = Mean(Zeros({3, 0}), {1});
  ASSERT_EQ(rows.shape(), (Shape{3}));
  for (double v : rows.ToVector<double>()) EXPECT_TRUE(std::isnan(v));
  EXPECT_EQ(Mean(Zeros({0, 3}), {1}).shape(), (Shape{0}));
  EXPECT_EQ(Sum(Zeros({0})).Item(), 0.0);
}

// A forward's error names the op that was called, not its backward node
// ("SumBackward: ..." sent the reader to a backward never run).
TEST(KernelsTest, ForwardErrorsNameTheOp) {
  auto error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const Tensor ints = Zeros({2, 3}, {.dtype = DType::kInt64});
  EXPECT_EQ(error([&] { Mean(ints); }).rfind("Mean: needs a floating tensor", 0), 0u) << error([&] { Mean(ints); });
  EXPECT_EQ(error([&] { Sigmoid(ints); }).rfind("Sigmoid: needs a floating tensor", 0), 0u)
      << error([&] { Sigmoid(ints); });
  const std::string repeated = error([&] { Sum(Zeros({2, 3}), {1, 1}); });
  EXPECT_EQ(repeated.rfind("Sum: dimension 1 repeated", 0), 0u) << repeated;
}

// Integer tensors sum in i64, as torch.sum of an integer or bool tensor:
//   x = torch.arange(24, dtype=torch.int32).reshape(2, 3, 4) * 7 - 50
//   x.sum()  # 732, int64
//   x.sum(dim=(0, 2))  # [20, 244, 468]
//   x.sum(dim=1, keepdim=True)  # [[[-66, -45, -24, -3]], [[186, 207, 228, 249]]]
//   x.sum(dim=-1)  # [[-158, -46, 66], [178, 290, 402]]
//   torch.tensor([200, 100, 255], dtype=torch.uint8).sum()  # 555, no u8 wrap
//   torch.tensor([2**62, 2**62]).sum()  # -2**63: i64 wraps
//   torch.zeros(0, 3, dtype=torch.int64).sum(0)  # [0, 0, 0]
TEST(KernelsTest, IntegerSumsAreI64AsPyTorch) {
  std::vector<double> values(24);
  for (int i = 0; i < 24; ++i) values[i] = i * 7 - 50;
  for (DType dt : {DType::kInt32, DType::kInt64}) {
    SCOPED_TRACE(std::string(DTypeName(dt)));
    const Tensor x = FromVector(values, {2, 3, 4}, {.dtype = dt});
    const Tensor all = Sum(x);
    EXPECT_EQ(all.dtype(), DType::kInt64);
    EXPECT_EQ(all.shape(), (Shape{}));
    EXPECT_EQ(all.ToVector<int64_t>(), (std::vector<int64_t>{732}));
    const Tensor outer = Sum(x, {0, 2});
    EXPECT_EQ(outer.shape(), (Shape{3}));
    EXPECT_EQ(outer.ToVector<int64_t>(), (std::vector<int64_t>{20, 244, 468}));
    const Tensor kept = Sum(x, {1}, true);
    EXPECT_EQ(kept.shape(), (Shape{2, 1, 4}));
    EXPECT_EQ(kept.ToVector<int64_t>(), (std::vector<int64_t>{-66, -45, -24, -3, 186, 207, 228, 249}));
    EXPECT_EQ(Sum(x, {-1}).ToVector<int64_t>(), (std::vector<int64_t>{-158, -46, 66, 178, 290, 402}));
    // A strided view reads its own elements.
    EXPECT_EQ(Sum(x.Transpose(0, 2), {2}).ToVector<int64_t>(),
              Sum(x, {0}).Transpose(0, 1).Contiguous().ToVector<int64_t>());
    EXPECT_FALSE(Sum(x).requires_grad());
  }
  const Tensor mask = FromVector({200, 100, 255}, {3}, {.dtype = DType::kUInt8});
  EXPECT_EQ(Sum(mask).ToVector<int64_t>(), (std::vector<int64_t>{555}));
  EXPECT_EQ(Sum(Cast(FromVector({1.0, 0.0, 1.0}, {3}), DType::kInt64)).ToVector<int64_t>(),
            (std::vector<int64_t>{2}));
  const int64_t big = int64_t{1} << 62;
  EXPECT_EQ(Sum(FromVectorOf<int64_t>({big, big}, {2})).ToVector<int64_t>(),
            (std::vector<int64_t>{std::numeric_limits<int64_t>::min()}));
  EXPECT_EQ(Sum(Zeros({0, 3}, {.dtype = DType::kInt64}), {0}).ToVector<int64_t>(), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(Sum(Full({}, 5.0, {.dtype = DType::kInt32}), {0}).ToVector<int64_t>(), (std::vector<int64_t>{5}));
  EXPECT_THROW(Sum(Zeros({2, 3}, {.dtype = DType::kInt64}), {2}), std::out_of_range);
}

// Another device has no integer sum kernel: refused naming the op, the dtype
// and the device (host memory registered as cuda:0 in a child process).
TEST(KernelsTest, IntegerSumOffTheCpuIsRefused) {
  EXPECT_EXIT(
      {
        nn::testing::RegisterHostAsCuda();
        ops::RegisterKernels(DeviceType::kCUDA, ops::KernelsFor(DeviceType::kCPU));
        const Tensor x = Zeros({2}, {.dtype = DType::kInt64}).To(Device(DeviceType::kCUDA, 0));
        try {
          Sum(x);
          std::fprintf(stderr, "sum: accepted\n");
        } catch (const std::exception& e) {
          std::fprintf(stderr, "sum: [%s]\n", e.what());
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      "sum: \\[Sum: summing an integer tensor \\(i64\\) is implemented on the CPU only, not on cuda:0\\]");
}

// An empty dimension has no largest element: the error names it (it was a
// shape error of an internal View).
TEST(KernelsTest, ArgmaxOverAnEmptyDimensionSaysSo) {
  try {
    Argmax(Zeros({3, 0}), 1);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("argmax: dimension 1 of [3, 0] has size 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(Argmax(Zeros({0, 3}), 1).shape(), (Shape{0}));  // nothing to reduce
}

// Argmax along every dimension of a 4-d tensor, against torch.argmax: the
// reduced dimension goes last and the others keep their order, so the
// indices land where PyTorch puts them (dim 0 and 1 were scrambled).
TEST(KernelsTest, ArgmaxAlongEveryDimensionMatchesPyTorch) {
  std::vector<double> v(120);
  for (int i = 0; i < 120; ++i) v[i] = (i * 53) % 120;  // a permutation of 0..119
  const Tensor x = FromVector(v, {2, 3, 4, 5});
  // torch.argmax(((torch.arange(120) * 53) % 120).float().reshape(2, 3, 4, 5), d).flatten()
  const std::vector<std::vector<int64_t>> expected = {
      {1, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 1, 0, 1, 0,
       1, 0, 1, 0, 1, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1},
      {1, 0, 0, 2, 0, 2, 0, 1, 0, 0, 0, 0, 2, 0, 2, 0, 1, 0, 0, 0,
       0, 0, 0, 0, 2, 0, 1, 0, 1, 0, 0, 0, 0, 2, 0, 1, 0, 1, 0, 0},
      {3, 2, 0, 3, 1, 0, 3, 1, 3, 1, 1, 3, 2, 0, 2, 2, 0, 2, 0, 3, 3, 1, 3, 1, 3, 3, 1, 3, 2, 0},
      {2, 4, 1, 3, 0, 2, 1, 1, 3, 0, 2, 1, 1, 0, 0, 4, 1, 1, 0, 0, 4, 1, 3, 0},
  };
  for (int64_t d = 0; d < 4; ++d) {
    SCOPED_TRACE("dim " + std::to_string(d));
    Shape shape = x.shape();
    shape.erase(shape.begin() + d);
    const Tensor out = Argmax(x, d);
    EXPECT_EQ(out.shape(), shape);
    EXPECT_EQ(out.ToVector<int64_t>(), expected[d]);
    EXPECT_EQ(Argmax(x, d - 4).ToVector<int64_t>(), expected[d]);
    // A strided (transposed) input gives the same answer as its contiguous copy.
    const Tensor t = x.Transpose(0, 3);
    EXPECT_EQ(Argmax(t, d).ToVector<int64_t>(), Argmax(t.Contiguous(), d).ToVector<int64_t>());
  }
}

// torch.argmax takes NaN as the largest value: the first NaN of a row wins,
// wherever it stands (before, NaNs were skipped unless one came first).
TEST(KernelsTest, ArgmaxPicksTheFirstNaNAsPyTorch) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> rows = {1,   nan,  3, nan,  //
                                    nan, 5,    7, 1,    //
                                    5,   2,    1, nan,  //
                                    inf, nan, -inf, nan, //
                                    -inf, -inf, 2, 2};
  const std::vector<int64_t> expected = {1, 0, 3, 1, 2};  // torch.argmax(x, 1), every floating dtype
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(std::string(DTypeName(t)));
    const Tensor x = FromVector(rows, {5, 4}, {.dtype = t});
    EXPECT_EQ(Argmax(x, 1).ToVector<int64_t>(), expected);
    EXPECT_EQ(Argmax(x.Transpose(0, 1), 0).ToVector<int64_t>(), expected);
    EXPECT_EQ(Argmax(x.Transpose(0, 1).Contiguous(), 0).ToVector<int64_t>(), expected);
  }
}

// One unit in the last place of v in a 16-bit format with `bits`
// significant bits (8 for bf16, 11 for f16), no finer than `tiny` (the
// format's smallest subnormal).
double Ulp16(double v, int bits, double tiny) {
  int e = 0;
  std::frexp(v, &e);
  return std::max(std::ldexp(1.0, e - bits), tiny);
}

// Softmax of a 16-bit tensor is computed in f32 and rounded once: each
// element is within one 16-bit ulp of the exact value. Before, the 16-bit
// log-softmax was rounded before its exp (bf16: about 3% off at e^-14).
TEST(KernelsTest, SixteenBitSoftmaxRoundsOnce) {
  std::vector<double> x;
  for (int i = 0; i < 8; ++i) x.push_back(-2.0 * i);  // linspace(0, -14, 8)
  double total = 0;
  for (double v : x) total += std::exp(v);
  struct Format {
    DType dtype;
    int bits;
    double tiny;
  };
  for (const Format f : {Format{DType::kBFloat16, 8, std::ldexp(1.0, -133)}, Format{DType::kFloat16, 11, std::ldexp(1.0, -24)}}) {
    SCOPED_TRACE(DTypeName(f.dtype));
    Tensor t = FromVector(x, {8}, {.dtype = f.dtype, .requires_grad = true});
    const Tensor y = Softmax(t, 0);
    EXPECT_EQ(y.dtype(), f.dtype);
    const std::vector<double> got = y.ToVector<double>();
    for (size_t i = 0; i < x.size(); ++i) {
      const double exact = std::exp(x[i]) / total;
      EXPECT_LE(std::fabs(got[i] - exact), Ulp16(exact, f.bits, f.tiny)) << i << ": " << got[i] << " vs " << exact;
    }
    // The gradient still flows, in the input's dtype: d y0 / d x_j = y0 (delta_0j - y_j).
    Backward(Select(y, 0, 0));
    ASSERT_TRUE(t.grad().defined());
    EXPECT_EQ(t.grad().dtype(), f.dtype);
    const std::vector<double> g = t.grad().ToVector<double>();
    const double y0 = std::exp(x[0]) / total;
    for (size_t j = 0; j < x.size(); ++j) {
      const double want = y0 * ((j == 0 ? 1.0 : 0.0) - std::exp(x[j]) / total);
      EXPECT_NEAR(g[j], want, 0.02 * std::fabs(want) + 1e-7) << j;
    }
  }
}

// A 0-d tensor has one dimension as far as dim arguments go, as in PyTorch:
// dim 0 or -1 is accepted, anything else is out of range. Softmax of a
// scalar is 1, log-softmax 0 (gradient 0), argmax 0; sum and mean over it
// change nothing.
TEST(KernelsTest, ScalarTakesDimZeroOrMinusOne) {
  for (int64_t dim : {0, -1}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    for (DType t : {DType::kFloat32, DType::kBFloat16}) {
      const Tensor s = Full({}, 3.0, {.dtype = t});
      const Tensor ls = LogSoftmax(s, dim), sm = Softmax(s, dim);
      EXPECT_EQ(ls.shape(), Shape{});
      EXPECT_EQ(ls.dtype(), t);
      EXPECT_EQ(ls.Item(), 0.0);
      EXPECT_EQ(sm.shape(), Shape{});
      EXPECT_EQ(sm.Item(), 1.0);
    }
    Tensor x = Full({}, 3.0, {.requires_grad = true});
    Backward(LogSoftmax(x, dim));
    EXPECT_EQ(x.grad().shape(), Shape{});
    EXPECT_EQ(x.grad().Item(), 0.0);
    x.set_grad(Tensor());
    Backward(Softmax(x, dim));
    EXPECT_EQ(x.grad().Item(), 0.0);

    for (const Tensor& s : {Full({}, 3.0), FromVectorOf<int64_t>({7}, {})}) {
      const Tensor a = Argmax(s, dim);
      EXPECT_EQ(a.shape(), Shape{});
      EXPECT_EQ(a.dtype(), DType::kInt64);
      EXPECT_EQ(a.ToVector<int64_t>(), std::vector<int64_t>{0});
    }
    EXPECT_EQ(Sum(Full({}, 3.0), {dim}).Item(), 3.0);
    EXPECT_EQ(Sum(Full({}, 3.0), {dim}, /*keepdim=*/true).shape(), Shape{});
    EXPECT_EQ(Mean(Full({}, 3.0), {dim}).Item(), 3.0);
    Tensor leaf = Full({}, 3.0, {.requires_grad = true});
    Backward(Mul(Transpose(leaf, dim, 0), Full({}, 2.0)));
    EXPECT_EQ(leaf.grad().Item(), 2.0);
  }
  const Tensor s = Full({}, 3.0);
  for (int64_t dim : {1, -2}) {
    EXPECT_THROW(LogSoftmax(s, dim), std::out_of_range);
    EXPECT_THROW(Softmax(s, dim), std::out_of_range);
    EXPECT_THROW(Argmax(s, dim), std::out_of_range);
    EXPECT_THROW(Sum(s, {dim}), std::out_of_range);
  }
  EXPECT_THROW(Sum(s, {0, -1}), std::invalid_argument);  // repeated, as in PyTorch
}

// Binary ops with a 0-d tensor operand take torch.result_type's dtype: the
// 0-d one decides only when it is floating and the other is not. Values as
// PyTorch 1.13 gives them (the 0-d operand is rounded to the result dtype).
TEST(KernelsTest, ZeroDimOperandPromotesAsPyTorch) {
  const Tensor half_f32 = Full({}, 1.005);
  const Tensor x = FromVector({100, 3}, {2}, {.dtype = DType::kBFloat16});
  for (const Tensor& y : {Mul(x, half_f32), Mul(half_f32, x)}) {
    EXPECT_EQ(y.dtype(), DType::kBFloat16);
    EXPECT_EQ(y.ToVector<float>(), (std::vector<float>{101.0f, 3.03125f}));
  }
  EXPECT_EQ(Add(Ones({3}), Full({}, 0.1, {.dtype = DType::kFloat64})).dtype(), DType::kFloat32);
  EXPECT_EQ(Sub(Ones({3}, {.dtype = DType::kFloat16}), Full({}, 1e-4, {.dtype = DType::kFloat64})).dtype(),
            DType::kFloat16);
  // An integer tensor with a 0-d float: the 0-d one's float dtype.
  const Tensor ints = FromVector({1, 2, 3}, {3}, {.dtype = DType::kInt64});
  const Tensor by_half = Mul(ints, Full({}, 0.5));
  EXPECT_EQ(by_half.dtype(), DType::kFloat32);
  EXPECT_EQ(by_half.ToVector<double>(), (std::vector<double>{0.5, 1.0, 1.5}));
  const Tensor plus = Add(ints, Full({}, 0.25, {.dtype = DType::kFloat64}));
  EXPECT_EQ(plus.dtype(), DType::kFloat64);
  EXPECT_EQ(plus.ToVector<double>(), (std::vector<double>{1.25, 2.25, 3.25}));
  // Integers with a 0-d integer: the dimensioned dtype, wrapping as u8 does.
  const Tensor bytes = Mul(FromVector({200, 100, 3}, {3}, {.dtype = DType::kUInt8}), FromVectorOf<int64_t>({2}, {}));
  EXPECT_EQ(bytes.dtype(), DType::kUInt8);
  EXPECT_EQ(bytes.ToVector<double>(), (std::vector<double>{144, 200, 6}));
  EXPECT_EQ(Div(FromVector({7, 6}, {2}, {.dtype = DType::kInt32}), FromVectorOf<int64_t>({2}, {})).ToVector<double>(),
            (std::vector<double>{3.5, 3.0}));
  // Two 0-d operands, or a 1-element tensor with dimensions: the usual promotion.
  EXPECT_EQ(Mul(Full({}, 2.0, {.dtype = DType::kBFloat16}), Full({}, 2.0)).dtype(), DType::kFloat32);
  EXPECT_EQ(Mul(x, Full({1}, 2.0)).dtype(), DType::kFloat32);
  // The 0-d operand's gradient comes back in its own dtype.
  Tensor a = FromVector({1, 2, 3}, {3}, {.dtype = DType::kBFloat16, .requires_grad = true});
  Tensor b = Full({}, 2.0, {.requires_grad = true});
  Backward(Sum(Mul(a, b)));
  EXPECT_EQ(a.grad().dtype(), DType::kBFloat16);
  EXPECT_EQ(a.grad().ToVector<float>(), (std::vector<float>{2, 2, 2}));
  EXPECT_EQ(b.grad().dtype(), DType::kFloat32);
  EXPECT_EQ(b.grad().Item(), 6.0);
}

// An empty dims list reduces every dimension, as x.sum(dim=[]) does in
// PyTorch 1.13 (it reduced none before).
TEST(KernelsTest, EmptyDimsListReducesEverything) {
  Tensor x = FromVector({0, 1, 2, 3, 4, 5}, {2, 3}, {.requires_grad = true});
  const Tensor s = Sum(x, {});
  EXPECT_EQ(s.shape(), Shape{});
  EXPECT_EQ(s.Item(), 15.0);
  EXPECT_EQ(Sum(x, {}, /*keepdim=*/true).shape(), (Shape{1, 1}));
  const Tensor m = Mean(x, {});
  EXPECT_EQ(m.shape(), Shape{});
  EXPECT_EQ(m.Item(), 2.5);
  EXPECT_EQ(Mean(x, {}, /*keepdim=*/true).shape(), (Shape{1, 1}));
  Backward(m);
  for (float g : x.grad().ToVector<float>()) EXPECT_FLOAT_EQ(g, 1.0f / 6);
  EXPECT_TRUE(std::isnan(Mean(Zeros({0, 2}), {}).Item()));
  EXPECT_EQ(Sum(Full({}, 3.0), {}).Item(), 3.0);
}

// A dim out of range names the op that was given it.
TEST(KernelsTest, DimOutOfRangeNamesTheOp) {
  const Tensor x = Zeros({2, 3});
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::out_of_range& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(message([&] { Sum(x, {2}); }), "Sum: dimension 2 out of range for a 2-d tensor of shape [2, 3]");
  EXPECT_EQ(message([&] { Mean(x, {-3}); }).rfind("Mean: dimension -3 out of range", 0), 0u);
  EXPECT_EQ(message([&] { LogSoftmax(x, 5); }).rfind("log_softmax: dimension 5 out of range", 0), 0u);
  EXPECT_EQ(message([&] { LogSoftmax(Full({}, 1.0), 1); }).rfind("log_softmax: dimension 1 out of range", 0), 0u);
  // Softmax is computed with log_softmax, but its errors name softmax.
  EXPECT_EQ(message([&] { Softmax(x, 5); }), "softmax: dimension 5 out of range for a 2-d tensor of shape [2, 3]");
  EXPECT_EQ(message([&] { Softmax(Full({}, 1.0), 1); }).rfind("softmax: dimension 1 out of range", 0), 0u);
  EXPECT_EQ(message([&] { Argmax(x, -3); }), "argmax: dimension -3 out of range for a 2-d tensor of shape [2, 3]");
  EXPECT_EQ(message([&] { Argmax(Full({}, 1.0), 1); }).rfind("argmax: dimension 1 out of range", 0), 0u);
}

// Large logits: each output is (x - max) - log(sum), as PyTorch computes
// it. Adding max and log(sum) first rounded their sum at max's magnitude
// (an f32 ulp of 1e4 is about 1e-3), so -log(2) came out -0.693359.
TEST(KernelsTest, LogSoftmaxOfLargeLogitsKeepsItsPrecision) {
  const Tensor x = FromVector({0, 1e4, 1e4}, {1, 3});
  const std::vector<float> y = LogSoftmax(x, 1).ToVector<float>();
  EXPECT_NEAR(y[1], -std::log(2.0), 1e-6);
  EXPECT_NEAR(y[2], -std::log(2.0), 1e-6);
  EXPECT_NEAR(y[0], -1e4 - std::log(2.0), 1e-3);
}

// An integral scalar keeps an integer tensor's dtype, as in PyTorch
// (labels + 1 is int64, u8 stays u8); a double scalar, or a floating
// tensor, computes in floating point as before. Before, every scalar
// operator turned an integer tensor into f32.
TEST(KernelsTest, IntegralScalarsKeepIntegerTensorsInteger) {
  const Tensor labels = FromVectorOf<int64_t>({3, -1, 7}, {3});
  const Tensor plus = labels + 2, minus = labels - 1, times = labels * 3, left = 2 * labels;
  for (const Tensor* t : {&plus, &minus, &times, &left}) EXPECT_EQ(t->dtype(), DType::kInt64);
  EXPECT_EQ(plus.ToVector<int64_t>(), (std::vector<int64_t>{5, 1, 9}));
  EXPECT_EQ(minus.ToVector<int64_t>(), (std::vector<int64_t>{2, -2, 6}));
  EXPECT_EQ(times.ToVector<int64_t>(), (std::vector<int64_t>{9, -3, 21}));
  EXPECT_EQ(left.ToVector<int64_t>(), (std::vector<int64_t>{6, -2, 14}));
  const Tensor big = FromVectorOf<int64_t>({int64_t{1} << 40}, {1}) + 1;
  EXPECT_EQ(big.ToVector<int64_t>()[0], (int64_t{1} << 40) + 1);  // exact, where f32 has 24 bits
  const Tensor bytes = FromVectorOf<uint8_t>({1, 200}, {2}) + 3;
  EXPECT_EQ(bytes.dtype(), DType::kUInt8);
  EXPECT_EQ(bytes.ToVector<int64_t>(), (std::vector<int64_t>{4, 203}));
  EXPECT_EQ((labels + 0.5).dtype(), DType::kFloat32);
  const Tensor x = FromVector({1.5, 2.5}, {2});
  EXPECT_EQ((x + 1).dtype(), DType::kFloat32);
  EXPECT_EQ((x * 2).ToVector<float>(), (std::vector<float>{3, 5}));
}

// An integral scalar enters an integer tensor's arithmetic modulo the
// tensor's width and exactly, as PyTorch casts its wrapped number: u8 + 300
// adds 44, u8 - (-1) adds 1, i32 * 2^32 gives 0, and i64 + (2^60 + 1) keeps
// the last bit. Before, the scalar went through a double and was saturated
// into the dtype: u8 + 300 added 255, u8 + (-1) added 0, and i64 lost the
// bits below 2^53's precision.
TEST(KernelsTest, IntegralScalarsWrapToTheTensorsWidthExactly) {
  const Tensor bytes = FromVectorOf<uint8_t>({1, 200}, {2});
  EXPECT_EQ((bytes + 300).ToVector<int64_t>(), (std::vector<int64_t>{45, 244}));
  EXPECT_EQ((bytes + (-1)).ToVector<int64_t>(), (std::vector<int64_t>{0, 199}));
  EXPECT_EQ((bytes - (-1)).ToVector<int64_t>(), (std::vector<int64_t>{2, 201}));
  EXPECT_EQ((bytes * -1).ToVector<int64_t>(), (std::vector<int64_t>{255, 56}));
  const Tensor ints = FromVectorOf<int32_t>({3, -5}, {2});
  EXPECT_EQ((ints * (int64_t{1} << 32)).ToVector<int64_t>(), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ((ints + ((int64_t{1} << 32) + 2)).ToVector<int64_t>(), (std::vector<int64_t>{5, -3}));
  const int64_t huge = (int64_t{1} << 60) + 1;  // not a double
  const Tensor longs = FromVectorOf<int64_t>({0, -1}, {2});
  EXPECT_EQ((longs + huge).ToVector<int64_t>(), (std::vector<int64_t>{huge, huge - 1}));
  EXPECT_EQ((longs - huge).ToVector<int64_t>(), (std::vector<int64_t>{-huge, -huge - 1}));
  EXPECT_EQ((huge * FromVectorOf<int64_t>({1}, {1})).ToVector<int64_t>(), (std::vector<int64_t>{huge}));
}

// -labels on an integer tensor, as torch.neg: the same dtype, wrapping
// (u8 -1 is 255), no gradient. Before, Neg refused every integer tensor
// ("needs a floating tensor").
TEST(KernelsTest, NegOfAnIntegerTensorKeepsItsDtypeAndWraps) {
  const Tensor longs = -FromVectorOf<int64_t>({3, -7, 0}, {3});
  EXPECT_EQ(longs.dtype(), DType::kInt64);
  EXPECT_EQ(longs.ToVector<int64_t>(), (std::vector<int64_t>{-3, 7, 0}));
  const Tensor ints = Neg(FromVectorOf<int32_t>({5, -2}, {2}));
  EXPECT_EQ(ints.dtype(), DType::kInt32);
  EXPECT_EQ(ints.ToVector<int64_t>(), (std::vector<int64_t>{-5, 2}));
  const Tensor bytes = Neg(FromVectorOf<uint8_t>({0, 1, 200}, {3}));
  EXPECT_EQ(bytes.dtype(), DType::kUInt8);
  EXPECT_EQ(bytes.ToVector<int64_t>(), (std::vector<int64_t>{0, 255, 56}));
  EXPECT_FALSE(bytes.requires_grad());
}

// i32 and i64 +, -, * and negation wrap in two's complement, as PyTorch:
//   torch.tensor([2**63 - 1]) + 1                             # [-2**63]
//   torch.tensor([65536], dtype=torch.int32) * 65536          # [0]
//   -torch.tensor([-2**63])                                   # [-2**63]
// Same-shape operands and a broadcast one (two loops of the kernel). Before,
// the kernel did signed arithmetic, whose overflow is undefined (UBSan
// stopped at it; an optimizer may assume it never happens).
TEST(KernelsTest, IntegerArithmeticWrapsAsPyTorch) {
  const int64_t lmax = std::numeric_limits<int64_t>::max(), lmin = std::numeric_limits<int64_t>::min();
  const int32_t imax = std::numeric_limits<int32_t>::max(), imin = std::numeric_limits<int32_t>::min();
  const Tensor longs = FromVectorOf<int64_t>({lmax, lmin, int64_t{1} << 32}, {3});
  EXPECT_EQ(Add(longs, FromVectorOf<int64_t>({1, -1, 0}, {3})).ToVector<int64_t>(),
            (std::vector<int64_t>{lmin, lmax, int64_t{1} << 32}));
  EXPECT_EQ(Sub(longs, FromVectorOf<int64_t>({-1}, {1})).ToVector<int64_t>(),
            (std::vector<int64_t>{lmin, lmin + 1, (int64_t{1} << 32) + 1}));
  EXPECT_EQ(Mul(longs, FromVectorOf<int64_t>({2}, {1})).ToVector<int64_t>(),
            (std::vector<int64_t>{-2, 0, int64_t{1} << 33}));
  EXPECT_EQ(Mul(longs, longs).ToVector<int64_t>(), (std::vector<int64_t>{1, 0, 0}));
  const Tensor ints = FromVectorOf<int32_t>({65536, imax, imin}, {3});
  const Tensor int_products = Mul(ints, FromVectorOf<int32_t>({65536}, {1}));
  EXPECT_EQ(int_products.dtype(), DType::kInt32);
  EXPECT_EQ(int_products.ToVector<int64_t>(), (std::vector<int64_t>{0, -65536, 0}));
  EXPECT_EQ(Add(ints, FromVectorOf<int32_t>({0, 1, -1}, {3})).ToVector<int64_t>(),
            (std::vector<int64_t>{65536, imin, imax}));
  EXPECT_EQ(Sub(FromVectorOf<int32_t>({imin}, {1}), ints).ToVector<int64_t>(),
            (std::vector<int64_t>{imax - 65535, 1, 0}));
  EXPECT_EQ(Neg(FromVectorOf<int64_t>({lmin, lmax}, {2})).ToVector<int64_t>(),
            (std::vector<int64_t>{lmin, -lmax}));
  EXPECT_EQ(Neg(FromVectorOf<int32_t>({imin, imax}, {2})).ToVector<int64_t>(),
            (std::vector<int64_t>{imin, -imax}));
}

// Abs and Relu of an integer tensor, as torch.abs and torch.relu: the same
// dtype, no gradient; abs of the most negative value wraps to itself. Read
// through a transposed view too. Before, both refused every integer tensor.
TEST(KernelsTest, AbsAndReluOfIntegerTensorsKeepTheirDtype) {
  const int64_t lowest = std::numeric_limits<int64_t>::min();
  const Tensor longs = FromVectorOf<int64_t>({-3, 7, 0, lowest}, {4});
  const Tensor abs = Abs(longs);
  EXPECT_EQ(abs.dtype(), DType::kInt64);
  EXPECT_EQ(abs.ToVector<int64_t>(), (std::vector<int64_t>{3, 7, 0, lowest}));
  EXPECT_FALSE(abs.requires_grad());
  const Tensor relu = Relu(longs);
  EXPECT_EQ(relu.dtype(), DType::kInt64);
  EXPECT_EQ(relu.ToVector<int64_t>(), (std::vector<int64_t>{0, 7, 0, 0}));
  const Tensor ints = FromVectorOf<int32_t>({-5, 2, std::numeric_limits<int32_t>::min(), -1}, {2, 2});
  const Tensor ints_abs = Abs(ints.Transpose(0, 1));
  EXPECT_EQ(ints_abs.dtype(), DType::kInt32);
  EXPECT_EQ(ints_abs.ToVector<int64_t>(), (std::vector<int64_t>{5, -2147483648LL, 2, 1}));
  EXPECT_EQ(ReluOwned(ints.Transpose(0, 1)).ToVector<int64_t>(), (std::vector<int64_t>{0, 0, 2, 0}));
  const Tensor bytes = FromVectorOf<uint8_t>({0, 1, 200}, {3});
  EXPECT_EQ(Abs(bytes).dtype(), DType::kUInt8);
  EXPECT_EQ(Abs(bytes).ToVector<int64_t>(), (std::vector<int64_t>{0, 1, 200}));
  EXPECT_EQ(Relu(bytes).ToVector<int64_t>(), (std::vector<int64_t>{0, 1, 200}));
}

// labels.clamp(0, C - 1): integral bounds keep an integer tensor's dtype and
// compare exactly in i64, also beyond 2^53 where a double would round the
// bound (2^53 + 1 would become 2^53). Before, Clamp refused integer tensors.
TEST(KernelsTest, ClampOfIntegerTensorsWithIntegralBoundsKeepsTheDtypeExactly) {
  const int64_t classes = 10;
  const Tensor labels = FromVectorOf<int64_t>({-1, 3, 12, 9}, {4});
  const Tensor clamped = Clamp(labels, 0, classes - 1);
  EXPECT_EQ(clamped.dtype(), DType::kInt64);
  EXPECT_EQ(clamped.ToVector<int64_t>(), (std::vector<int64_t>{0, 3, 9, 9}));
  EXPECT_FALSE(clamped.requires_grad());
  EXPECT_EQ(Clamp(labels, 0, std::nullopt).ToVector<int64_t>(), (std::vector<int64_t>{0, 3, 12, 9}));
  EXPECT_EQ(Clamp(labels, std::nullopt, 4).ToVector<int64_t>(), (std::vector<int64_t>{-1, 3, 4, 4}));
  // min > max gives max everywhere, as torch.clamp.
  EXPECT_EQ(Clamp(labels, 5, 2).ToVector<int64_t>(), (std::vector<int64_t>{2, 2, 2, 2}));
  const int64_t big = (int64_t{1} << 53) + 1;
  const Tensor huge = FromVectorOf<int64_t>({big + 1, big, big - 2}, {3});
  EXPECT_EQ(Clamp(huge, big - 1, big).ToVector<int64_t>(), (std::vector<int64_t>{big, big, big - 1}));
  const Tensor ints = Clamp(FromVectorOf<int32_t>({-7, 0, 7}, {3}), -2, 2);
  EXPECT_EQ(ints.dtype(), DType::kInt32);
  EXPECT_EQ(ints.ToVector<int64_t>(), (std::vector<int64_t>{-2, 0, 2}));
  const Tensor bytes = Clamp(FromVectorOf<uint8_t>({0, 100, 255}, {3}), 10, 200);
  EXPECT_EQ(bytes.dtype(), DType::kUInt8);
  EXPECT_EQ(bytes.ToVector<int64_t>(), (std::vector<int64_t>{10, 100, 200}));
  // A floating tensor takes integral bounds as the double overload.
  EXPECT_EQ(Clamp(FromVector({-1.5f, 0.5f, 7.0f}, {3}), 0, 1).ToVector<float>(), (std::vector<float>{0, 0.5f, 1}));
}

// A bound the dtype cannot hold is refused naming it (PyTorch wraps it for
// u8, which makes clamp(-10, 10) give 10 everywhere).
TEST(KernelsTest, ClampRefusesAnIntegralBoundOutsideTheDtype) {
  const auto error_of = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const Tensor bytes = FromVectorOf<uint8_t>({0, 100}, {2});
  EXPECT_EQ(error_of([&] { Clamp(bytes, -10, 10); }), "Clamp: min -10 is outside the range of u8 [0, 255]");
  EXPECT_EQ(error_of([&] { Clamp(bytes, std::nullopt, 300); }), "Clamp: max 300 is outside the range of u8 [0, 255]");
  EXPECT_EQ(error_of([&] { Clamp(FromVectorOf<int32_t>({1}, {1}), int64_t{1} << 40, std::nullopt); }),
            "Clamp: min 1099511627776 is outside the range of i32 [-2147483648, 2147483647]");
  EXPECT_EQ(error_of([&] { Clamp(bytes, std::numeric_limits<uint64_t>::max(), std::nullopt); }),
            "Clamp: min 18446744073709551615 is outside the range of i64");
  EXPECT_EQ(error_of([&] { Clamp(bytes, std::nullopt, std::nullopt); }),
            "Clamp: at least one of min and max must be given");
}

// Double bounds are float scalars: an integer tensor clamps as f32, as
// torch.clamp with float bounds (arange(5).clamp(0.5, 3.5)).
TEST(KernelsTest, ClampOfAnIntegerTensorWithDoubleBoundsGivesF32) {
  const Tensor y = Clamp(FromVectorOf<int64_t>({0, 1, 2, 3, 4}, {5}), 0.5, 3.5);
  EXPECT_EQ(y.dtype(), DType::kFloat32);
  EXPECT_EQ(y.ToVector<float>(), (std::vector<float>{0.5f, 1, 2, 3, 3.5f}));
}

// The device kernels take floating tensors alone: integer Abs, Relu and
// Clamp elsewhere are refused naming the op, the dtype and the device.
// Runs in the child: prints each op's error (or that it was accepted).
void TryIntegerOpsOnHostAsCuda() {
  nn::testing::RegisterHostAsCuda();
  ops::RegisterKernels(DeviceType::kCUDA, ops::KernelsFor(DeviceType::kCPU));
  const Tensor x = Zeros({2}, {.dtype = DType::kInt64}).To(Device(DeviceType::kCUDA, 0));
  const std::function<Tensor()> calls[] = {[&] { return Abs(x); }, [&] { return Relu(x); },
                                           [&] { return Clamp(x, 0, 1); }};
  for (const auto& call : calls) {
    try {
      call();
      std::fprintf(stderr, "accepted;");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[%s]", e.what());
    }
  }
}

TEST(KernelsTest, IntegerAbsReluAndClampOffTheCpuAreRefused) {
  EXPECT_EXIT(
      {
        TryIntegerOpsOnHostAsCuda();
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      "\\[Abs: an integer tensor \\(i64\\) is implemented on the CPU only, not on cuda:0\\]"
      "\\[Relu: an integer tensor \\(i64\\) is implemented on the CPU only, not on cuda:0\\]"
      "\\[Clamp: an integer tensor \\(i64\\) is implemented on the CPU only, not on cuda:0\\]");
}

// x * s keeps the sign of a zero, as PyTorch: -0 * 2 and -0 * 1 are -0, and
// so are the gradients of Sub and a scaled Mean at a -0 incoming gradient.
// Before, the scale added +0.0 and turned every -0 into +0.
TEST(KernelsTest, ScalingKeepsTheSignOfZero) {
  for (const DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    const Tensor zero = FromVector({-0.0f, 0.0f}, {2}).To(dt);
    for (const double s : {2.0, 1.0, -1.0}) {
      const std::vector<double> y = MulScalar(zero, s).ToVector<double>();
      EXPECT_EQ(std::signbit(y[0]), s > 0) << DTypeName(dt) << " * " << s;
      EXPECT_EQ(std::signbit(y[1]), s < 0) << DTypeName(dt) << " * " << s;
    }
  }
  Tensor a = FromVector({1.0f}, {1});
  a.set_requires_grad(true);
  Backward(Sum(Mean(a) * -0.0));  // d/da = 1 * -0 / 1 = -0
  EXPECT_TRUE(std::signbit(a.grad().ToVector<float>()[0]));
  Tensor b = FromVector({1.0f}, {1});
  b.set_requires_grad(true);
  Backward(Sum(Sub(Zeros({1}), b) * 0.0));  // d/db = -(+0) = -0
  EXPECT_TRUE(std::signbit(b.grad().ToVector<float>()[0]));
}

TEST(KernelsTest, SoftmaxOfAnIntegerTensorNamesSoftmax) {
  try {
    Softmax(Zeros({2, 3}, {.dtype = DType::kInt64}), 1);
    ADD_FAILURE() << "accepted an i64 tensor";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "softmax: needs a floating tensor, got i64");
  }
}

// Division is true division, as torch.div: integer operands give f32, so
// 7 / 2 = 3.5 and an integer divisor of 0 gives inf or NaN instead of a trap.
TEST(KernelsTest, IntegerDivisionIsTrueDivisionInF32) {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType t : {DType::kInt64, DType::kInt32, DType::kUInt8}) {
    SCOPED_TRACE(std::string(DTypeName(t)));
    const Tensor a = FromVector({7, 6, 1, 0}, {4}, {.dtype = t});
    const Tensor b = FromVector({2, 4, 0, 0}, {4}, {.dtype = t});
    const Tensor q = Div(a, b);
    EXPECT_EQ(q.dtype(), DType::kFloat32);
    const std::vector<double> v = q.ToVector<double>();
    EXPECT_EQ(v[0], 3.5);
    EXPECT_EQ(v[1], 1.5);
    EXPECT_EQ(v[2], inf);
    EXPECT_TRUE(std::isnan(v[3]));
    EXPECT_EQ((a / b).dtype(), DType::kFloat32);
  }
  const Tensor i = FromVector({-7}, {1}, {.dtype = DType::kInt64});
  EXPECT_EQ(Div(i, FromVector({2}, {1}, {.dtype = DType::kInt32})).ToVector<double>(),
            (std::vector<double>{-3.5}));
  // Mixed with a float, the float's dtype wins as before.
  EXPECT_EQ(Div(i, FromVector({2}, {1}, {.dtype = DType::kFloat64})).dtype(), DType::kFloat64);
  // The raw kernel refuses integer division rather than trapping.
  const Tensor z = FromVector({0}, {1}, {.dtype = DType::kInt64});
  EXPECT_THROW(KernelsFor(DeviceType::kCPU).binary(BinaryOp::kDiv, i, z, EmptyLike(i)), std::invalid_argument);
}

// in_features = 0: Linear gives the bias broadcast to [..., out] (zeros
// without one), as PyTorch.
TEST(KernelsTest, LinearWithNoInputFeatures) {
  const Tensor x = Zeros({4, 0}, {.requires_grad = true});
  const Tensor w = Zeros({3, 0}, {.requires_grad = true});
  const Tensor b = FromVector({1, 2, 3}, {3}, {.requires_grad = true});
  const Tensor y = Linear(x, w, b);
  ASSERT_EQ(y.shape(), (Shape{4, 3}));
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(y.Detach().Select(0, r).ToVector<float>(), (std::vector<float>{1, 2, 3}));
  }
  Backward(Sum(y));
  EXPECT_EQ(x.grad().shape(), (Shape{4, 0}));
  EXPECT_EQ(w.grad().shape(), (Shape{3, 0}));
  EXPECT_EQ(b.grad().ToVector<float>(), (std::vector<float>{4, 4, 4}));
  const Tensor y3 = Linear(Zeros({2, 5, 0}), Zeros({3, 0}), Tensor());
  ASSERT_EQ(y3.shape(), (Shape{2, 5, 3}));
  EXPECT_EQ(y3.ToVector<float>(), std::vector<float>(30, 0.0f));
}

// N-D @ 2-D with K = 0 gives zeros of shape [..., N], as PyTorch.
TEST(KernelsTest, MatmulWithNoInnerDimension) {
  const Tensor a = Zeros({2, 3, 0}, {.requires_grad = true});
  const Tensor m = Zeros({0, 5}, {.requires_grad = true});
  const Tensor p = Matmul(a, m);
  ASSERT_EQ(p.shape(), (Shape{2, 3, 5}));
  EXPECT_EQ(p.ToVector<float>(), std::vector<float>(30, 0.0f));
  Backward(Sum(p));
  EXPECT_EQ(a.grad().shape(), (Shape{2, 3, 0}));
  EXPECT_EQ(m.grad().shape(), (Shape{0, 5}));
  EXPECT_EQ(Matmul(Zeros({0, 3, 0}), Zeros({0, 5})).shape(), (Shape{0, 3, 5}));
}

TEST(KernelsTest, MissingCudaKernelIsNamed) {
  try {
    DDP_KERNEL(Device(DeviceType::kCUDA, 1), conv2d_forward);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("op `conv2d_forward` has no kernel for device cuda:1"), std::string::npos)
        << e.what();
  }
}

// volatile: the products must be computed at run time, under the mode.
float MultiplyAtRunTime(float a, float b) {
  volatile float x = a;
  volatile float y = b;
  return x * y;
}

TEST(KernelsTest, FlushDenormalAppliesToThisThreadAndThreadsStartedLater) {
  const float tiny = std::numeric_limits<float>::denorm_min() * 1024;  // subnormal
  ASSERT_FALSE(GetFlushDenormal());
  EXPECT_EQ(MultiplyAtRunTime(tiny, 1.0f), tiny);
  EXPECT_GT(MultiplyAtRunTime(1e-30f, 1e-9f), 0.0f);  // subnormal result kept
  ASSERT_TRUE(SetFlushDenormal(true));
  EXPECT_TRUE(GetFlushDenormal());
  EXPECT_EQ(MultiplyAtRunTime(tiny, 1.0f), 0.0f);     // subnormal input read as 0
  EXPECT_EQ(MultiplyAtRunTime(1e-30f, 1e-9f), 0.0f);  // subnormal result flushed
  EXPECT_NEAR(MultiplyAtRunTime(1e-20f, 1e-9f), 1e-29f, 1e-35f);  // normal numbers untouched
  float in_thread = -1;
  bool flag_in_thread = false;
  std::thread([&] {
    flag_in_thread = GetFlushDenormal();
    in_thread = MultiplyAtRunTime(tiny, 1.0f);
  }).join();
  EXPECT_TRUE(flag_in_thread);
  EXPECT_EQ(in_thread, 0.0f);
  ASSERT_TRUE(SetFlushDenormal(false));
  EXPECT_FALSE(GetFlushDenormal());
  EXPECT_EQ(MultiplyAtRunTime(tiny, 1.0f), tiny);
}

// The kernels' environment variables: a value the variable does not take
// kept the default without a word (DDP_NN_THREADS=four ran one thread,
// DDP_NN_CONV=onednnn the automatic choice); it still does, with a warning
// line naming the variable, the value and what it takes.
TEST(KernelsTest, EnvironmentValuesThatDoNotParseAreNamed) {
  std::string problem;
  EXPECT_EQ(internal::ThreadsFromEnvText(nullptr, &problem), 1);
  EXPECT_EQ(internal::ThreadsFromEnvText("4", &problem), 4);
  EXPECT_EQ(problem, "");
  for (const char* bad : {"four", "0", "-2", "4x", "", "4097", "99999999999999999999"}) {
    problem.clear();
    EXPECT_EQ(internal::ThreadsFromEnvText(bad, &problem), 1) << bad;
    EXPECT_EQ(problem, "DDP_NN_THREADS=" + std::string(bad) +
                           " is not a thread count in [1, 4096]; using 1 thread per GEMM and convolution");
  }
  problem.clear();
  EXPECT_EQ(internal::GemmFromEnvText("openblas", &problem), GemmBackend::kOpenBlas);
  EXPECT_EQ(internal::GemmFromEnvText("onednn", &problem), GemmBackend::kOneDnn);
  EXPECT_EQ(internal::GemmFromEnvText(nullptr, &problem), GemmBackend::kOneDnn);
  EXPECT_EQ(problem, "");
  EXPECT_EQ(internal::GemmFromEnvText("OpenBLAS", &problem), GemmBackend::kOneDnn);
  EXPECT_EQ(problem, "DDP_NN_GEMM=OpenBLAS is neither onednn nor openblas; using onednn");
  problem.clear();
  EXPECT_EQ(internal::ConvFromEnvText("im2col", &problem), ConvAlgorithm::kIm2col);
  EXPECT_EQ(internal::ConvFromEnvText("onednn", &problem), ConvAlgorithm::kOneDnn);
  EXPECT_EQ(internal::ConvFromEnvText("auto", &problem), ConvAlgorithm::kAuto);
  EXPECT_EQ(problem, "");
  EXPECT_EQ(internal::ConvFromEnvText("onednnn", &problem), ConvAlgorithm::kAuto);
  EXPECT_EQ(problem, "DDP_NN_CONV=onednnn is not im2col, onednn or auto; using auto");
  problem.clear();
  EXPECT_EQ(internal::Im2colBytesFromEnvText(nullptr, &problem), int64_t{1} << 20);
  EXPECT_EQ(internal::Im2colBytesFromEnvText("4096", &problem), 4096);
  EXPECT_EQ(problem, "");
  EXPECT_EQ(internal::Im2colBytesFromEnvText("1M", &problem), int64_t{1} << 20);
  EXPECT_EQ(problem, "DDP_NN_IM2COL_BYTES=1M is not a positive whole number of bytes; using 1048576");
}

TEST(KernelsTest, ThreadsSetting) {
  EXPECT_EQ(GetNumThreads(), 1);
  EXPECT_THROW(SetNumThreads(0), std::invalid_argument);
  // A count libgomp cannot make crashed the first GEMM (nn_bench --threads=100000).
  EXPECT_THROW(SetNumThreads(kMaxNumThreads + 1), std::invalid_argument);
  EXPECT_THROW(SetNumThreads(100000), std::invalid_argument);
  EXPECT_EQ(GetNumThreads(), 1);
}

// x / s is a true division, as torch.div with a scalar: x * (1 / s) was a
// last bit off (f32 7 / 3 gave 2.3333335), and the reciprocal of a tiny s
// overflowed (0 / 1e-39 in f32 gave NaN, 1e-300 / 1e-310 in f64 inf).
TEST(KernelsTest, ScalarDivisionIsTrueDivision) {
  const Tensor seven = FromVector({7}, Shape{1});
  EXPECT_EQ((seven / 3.0).ToVector<float>()[0], 7.0f / 3.0f);
  EXPECT_EQ((FromVector({0}, Shape{1}) / 1e-39).ToVector<float>()[0], 0.0f);
  EXPECT_EQ((FromVector({1e-300}, Shape{1}, {.dtype = DType::kFloat64}) / 1e-310).ToVector<double>()[0],
            1e-300 / 1e-310);
  // 16-bit tensors divide in f32 and round once.
  const Tensor b = FromVector({7}, Shape{1}).To(DType::kBFloat16) / 3.0;
  EXPECT_EQ(b.dtype(), DType::kBFloat16);
  EXPECT_EQ(b.ToVector<double>()[0], FromVector({7.0 / 3.0}, Shape{1}).To(DType::kBFloat16).ToVector<double>()[0]);
  // The gradient is g / s.
  Tensor x = FromVector({1, 2}, Shape{2});
  x.set_requires_grad(true);
  Backward(Sum(x / 3.0));
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{1.0f / 3.0f, 1.0f / 3.0f}));
}

// An integer tensor and a float scalar give f32, as in PyTorch (i64 / 2.0
// threw "MulScalar: needs a floating tensor", an op the caller never named).
TEST(KernelsTest, ScalarOpsPromoteIntegerTensorsToFloat32) {
  const Tensor i = FromVector({7, -3}, Shape{2}, {.dtype = DType::kInt64});
  const Tensor q = i / 2.0;
  EXPECT_EQ(q.dtype(), DType::kFloat32);
  EXPECT_EQ(q.ToVector<float>(), (std::vector<float>{3.5f, -1.5f}));
  EXPECT_EQ((i - 2.5).ToVector<float>(), (std::vector<float>{4.5f, -5.5f}));
  EXPECT_EQ((i + 0.5).ToVector<float>(), (std::vector<float>{7.5f, -2.5f}));
  EXPECT_EQ((i * 0.5).dtype(), DType::kFloat32);
  EXPECT_EQ((0.5 * i).ToVector<float>(), (std::vector<float>{3.5f, -1.5f}));
}

// ConvOutputSize is public: a stride of 0 was a division by zero (SIGFPE);
// each bad parameter is named.
TEST(KernelsTest, ConvOutputSizeRefusesBadGeometryByName) {
  const auto error = [](int64_t kernel, int64_t stride, int64_t pad, int64_t dilation) {
    try {
      ConvOutputSize(5, kernel, stride, pad, dilation);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error(3, 0, 0, 1), "ConvOutputSize: stride must be at least 1, got 0");
  EXPECT_EQ(error(3, -2, 0, 1), "ConvOutputSize: stride must be at least 1, got -2");
  EXPECT_EQ(error(3, 1, 0, 0), "ConvOutputSize: dilation must be at least 1, got 0");
  EXPECT_EQ(error(0, 1, 0, 1), "ConvOutputSize: kernel must be at least 1, got 0");
  EXPECT_EQ(error(3, 1, -1, 1), "ConvOutputSize: pad must be at least 0, got -1");
  EXPECT_EQ(ConvOutputSize(5, 3, 1, 0, 1), 3);
}

// What `f` throws (any std::exception), or "no error".
std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

// Conv2d's padding and Matmul's 0-d operands are refused naming the values
// (the messages were "negative padding" and "0-d operands are not supported").
TEST(KernelsTest, ConvPaddingAndMatmulRankErrorsNameTheValues) {
  Conv2dParams p;
  p.pad_h = 1;
  p.pad_w = -2;
  EXPECT_EQ(ErrorOf([&] { Conv2d(Zeros({1, 1, 4, 4}), Zeros({1, 1, 3, 3}), Tensor(), p); }),
            "conv2d: padding must be non-negative, got (1, -2)");
  EXPECT_EQ(ErrorOf([&] { Matmul(Zeros({}), Zeros({3})); }),
            "matmul: both operands need at least one dimension, got shapes [] and [3] (a is 0-d)");
  EXPECT_EQ(ErrorOf([&] { Matmul(Zeros({2, 3}), Zeros({})); }),
            "matmul: both operands need at least one dimension, got shapes [2, 3] and [] (b is 0-d)");
  EXPECT_EQ(ErrorOf([&] { Matmul(Zeros({}), Zeros({})); }),
            "matmul: both operands need at least one dimension, got shapes [] and [] (both are 0-d)");
}

// An undefined tensor passed to an op is reported with the op's name and
// the argument's (the accessors underneath could only say "shape on an
// undefined tensor", which named neither).
TEST(KernelsTest, UndefinedInputsNameTheOpAndArgument) {
  const Tensor none, x = Ones({2, 3}), img = Ones({1, 1, 4, 4});
  Pool2dParams pool;
  pool.kernel_h = pool.kernel_w = 2;
  EXPECT_EQ(ErrorOf([&] { Sum(none); }), "Sum: input is undefined");
  EXPECT_EQ(ErrorOf([&] { Sum(none, {0}); }), "Sum: input is undefined");
  EXPECT_EQ(ErrorOf([&] { Mean(none); }), "Mean: input is undefined");
  EXPECT_EQ(ErrorOf([&] { Mean(none, {0}, true); }), "Mean: input is undefined");
  EXPECT_EQ(ErrorOf([&] { Argmax(none, 0); }), "argmax: input is undefined");
  EXPECT_EQ(ErrorOf([&] { LogSoftmax(none, 0); }), "log_softmax: input is undefined");
  EXPECT_EQ(ErrorOf([&] { Softmax(none, 0); }), "softmax: input is undefined");
  EXPECT_EQ(ErrorOf([&] { Matmul(none, x); }), "matmul: operand a is undefined");
  EXPECT_EQ(ErrorOf([&] { Matmul(x, none); }), "matmul: operand b is undefined");
  EXPECT_EQ(ErrorOf([&] { Linear(none, x, Tensor()); }), "linear: input is undefined");
  EXPECT_EQ(ErrorOf([&] { Linear(Ones({3}), none, Tensor()); }), "linear: weight is undefined");
  EXPECT_EQ(ErrorOf([&] { Conv2d(img, none, Tensor()); }), "conv2d: weight is undefined");
  EXPECT_EQ(ErrorOf([&] { MaxPool2d(none, pool); }), "max_pool2d: input is undefined");
  EXPECT_EQ(ErrorOf([&] { AvgPool2d(none, pool); }), "avg_pool2d: input is undefined");
  EXPECT_EQ(ErrorOf([&] { AdaptiveAvgPool2d(none, 1, 1); }), "adaptive_avg_pool2d: input is undefined");
  EXPECT_EQ(ErrorOf([&] { BatchNorm(none, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5); }),
            "batch_norm: input is undefined");
}

// K = 0: C = beta * C without reading A or B, whose leading dimensions may
// then be 0; with beta 0, C = 0 even where it held NaN. oneDNN refused
// lda = 0 ("dnnl_sgemm failed with status 2", naming neither the op nor
// the shape).
TEST(KernelsTest, GemmWithNoInnerDimensionScalesC) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (GemmBackend backend : {GemmBackend::kOneDnn, GemmBackend::kOpenBlas}) {
    SetGemmBackend(backend);
    SCOPED_TRACE(static_cast<int>(backend));
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        // C is 2 x 3 in rows of 4 (ldc 4); the fourth column is not C's.
        std::vector<float> c = {nan, nan, nan, 7, nan, nan, nan, 7};
        cpu::Sgemm(ta, tb, 2, 3, 0, 1.0f, nullptr, 0, nullptr, 0, 0.0f, c.data(), 4);
        EXPECT_EQ(c, (std::vector<float>{0, 0, 0, 7, 0, 0, 0, 7}));
        std::vector<float> c2 = {1, 2, 3, 7, -4, 5, 6, 7};
        cpu::Sgemm(ta, tb, 2, 3, 0, 1.0f, nullptr, 0, nullptr, 0, 2.0f, c2.data(), 4);
        EXPECT_EQ(c2, (std::vector<float>{2, 4, 6, 7, -8, 10, 12, 7}));
      }
    }
  }
  SetGemmBackend(GemmBackend::kOneDnn);
  const double dnan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> d = {dnan, dnan, dnan, 7};
  cpu::Dgemm(false, false, 1, 3, 0, 1.0, nullptr, 0, nullptr, 0, 0.0, d.data(), 4);
  EXPECT_EQ(d, (std::vector<double>{0, 0, 0, 7}));
  std::vector<double> d2 = {1, -2, 3, 7};
  cpu::Dgemm(false, false, 1, 3, 0, 1.0, nullptr, 0, nullptr, 0, -0.5, d2.data(), 4);
  EXPECT_EQ(d2, (std::vector<double>{-0.5, 1, -1.5, 7}));
}

// Runs `body` for each dtype the convolutions take, under each GEMM backend
// and convolution algorithm, naming the setting in any failure (an
// exception included); puts the default backend and algorithm back after.
void ForEachConvSetting(const std::function<void(DType)>& body) {
  for (GemmBackend backend : {GemmBackend::kOneDnn, GemmBackend::kOpenBlas}) {
    SetGemmBackend(backend);
    for (ConvAlgorithm algo : {ConvAlgorithm::kIm2col, ConvAlgorithm::kOneDnn, ConvAlgorithm::kAuto}) {
      SetConvAlgorithm(algo);
      for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
        SCOPED_TRACE(std::string(DTypeName(dt)) + " algorithm " + std::to_string(static_cast<int>(algo)) +
                     " gemm " + std::to_string(static_cast<int>(backend)));
        try {
          body(dt);
        } catch (const std::exception& e) {
          ADD_FAILURE() << e.what();
        }
      }
    }
  }
  SetConvAlgorithm(ConvAlgorithm::kAuto);
  SetGemmBackend(GemmBackend::kOneDnn);
}

// Conv2d with 0 input channels gives the bias broadcast (zeros without
// one), with gradients of the operands' shapes, as PyTorch:
//   F.conv2d(torch.zeros(1, 0, 4, 4), torch.zeros(2, 0, 3, 3), torch.ones(2))  # ones [1, 2, 2, 2]
// The f32 im2col path passed lda = 0 to oneDNN's GEMM, which refused it.
// Buffers of NaN are freed just before each call, so that an output left
// unwritten (reusing their memory) would show.
TEST(KernelsTest, Conv2dWithNoInputChannelsGivesTheBias) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  ForEachConvSetting([&](DType dt) {
    for (int k = 0; k < 4; ++k) Full({1, 2, 2, 2}, nan, {.dtype = dt});
    const Tensor x = Zeros({1, 0, 4, 4}, {.dtype = dt, .requires_grad = true});
    const Tensor w = Zeros({2, 0, 3, 3}, {.dtype = dt, .requires_grad = true});
    const Tensor b = Ones({2}, {.dtype = dt, .requires_grad = true});
    const Tensor y = Conv2d(x, w, b);
    ASSERT_EQ(y.shape(), (Shape{1, 2, 2, 2}));
    EXPECT_EQ(y.ToVector<double>(), std::vector<double>(8, 1.0));
    Backward(Sum(y));
    EXPECT_EQ(x.grad().shape(), (Shape{1, 0, 4, 4}));
    EXPECT_EQ(w.grad().shape(), (Shape{2, 0, 3, 3}));
    EXPECT_EQ(b.grad().ToVector<double>(), (std::vector<double>{4, 4}));
    for (int k = 0; k < 4; ++k) Full({1, 2, 2, 2}, nan, {.dtype = dt});
    const Tensor y0 = Conv2d(Zeros({1, 0, 4, 4}, {.dtype = dt}), Zeros({2, 0, 3, 3}, {.dtype = dt}), Tensor(),
                             {.stride_h = 2, .stride_w = 1, .pad_h = 1, .pad_w = 0});
    ASSERT_EQ(y0.shape(), (Shape{1, 2, 2, 2}));
    EXPECT_EQ(y0.ToVector<double>(), std::vector<double>(8, 0.0));
  });
}

// 0 output channels: an empty output, and zero gradients of the operands'
// shapes (the input gradient's GEMM has K = O/G = 0). Buffers of NaN are
// freed before backward, so that a gradient left unwritten would show.
TEST(KernelsTest, Conv2dWithNoOutputChannelsGivesZeroGradients) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Generator gen(3);
  ForEachConvSetting([&](DType dt) {
    Tensor x = Rand({2, 3, 4, 4}, {.dtype = dt}, gen).Detach();
    x.set_requires_grad(true);
    const Tensor w = Zeros({0, 3, 3, 3}, {.dtype = dt, .requires_grad = true});
    const Tensor y = Conv2d(x, w, Zeros({0}, {.dtype = dt, .requires_grad = true}));
    ASSERT_EQ(y.shape(), (Shape{2, 0, 2, 2}));
    for (int k = 0; k < 4; ++k) {
      Full({2, 3, 4, 4}, nan, {.dtype = dt});
      Full({27, 4}, nan, {.dtype = dt});
    }
    Backward(Sum(y));
    EXPECT_EQ(x.grad().ToVector<double>(), std::vector<double>(96, 0.0));
    EXPECT_EQ(w.grad().shape(), (Shape{0, 3, 3, 3}));
  });
}

// An input with no rows or no columns is refused naming its shape, as
// PyTorch ("Only zero batch or zero channel inputs are supported"), even when
// padding would give an output; a zero batch or zero channels still run.
// Before, x [1, 1, 0, 4] with padding 1 gave a [1, 1, 2, 6] output holding
// only the bias.
TEST(KernelsTest, Conv2dRefusesAnInputWithNoRowsOrColumns) {
  ForEachConvSetting([&](DType dt) {
    const Conv2dParams p{.pad_h = 1, .pad_w = 1};
    EXPECT_EQ(ErrorOf([&] {
                Conv2d(Zeros({1, 1, 0, 4}, {.dtype = dt}), Zeros({1, 1, 1, 1}, {.dtype = dt}),
                       Ones({1}, {.dtype = dt}), p);
              }),
              "conv2d: only a zero batch or zero channels may be empty, got input [1, 1, 0, 4]");
    EXPECT_EQ(ErrorOf([&] {
                Conv2d(Zeros({2, 3, 5, 0}, {.dtype = dt}), Zeros({4, 3, 3, 3}, {.dtype = dt}), Tensor(),
                       {.pad_h = 1, .pad_w = 2});
              }),
              "conv2d: only a zero batch or zero channels may be empty, got input [2, 3, 5, 0]");
    EXPECT_EQ(ErrorOf([&] {
                Conv2d(Zeros({0, 1, 0, 4}, {.dtype = dt}), Zeros({1, 1, 1, 1}, {.dtype = dt}), Tensor(), p);
              }),
              "conv2d: only a zero batch or zero channels may be empty, got input [0, 1, 0, 4]");
    EXPECT_EQ(Conv2d(Zeros({0, 1, 3, 4}, {.dtype = dt}), Zeros({1, 1, 1, 1}, {.dtype = dt}), Tensor(), p).shape(),
              (Shape{0, 1, 5, 6}));
    EXPECT_EQ(Conv2d(Zeros({1, 0, 3, 4}, {.dtype = dt}), Zeros({1, 0, 1, 1}, {.dtype = dt}), Tensor(), p).shape(),
              (Shape{1, 1, 5, 6}));
  });
}

// A groups count whose product with the weight's C/groups overflows int64 is
// refused naming groups. Before, the product wrapped (undefined): a message
// "expected input [N, -9223372036854775808, H, W]", or, when it wrapped onto
// the input's channel count, an im2col loop over 2^62 groups.
TEST(KernelsTest, Conv2dRefusesGroupsThatOverflow) {
  const int64_t g62 = int64_t{1} << 62;
  EXPECT_EQ(ErrorOf([&] { Conv2d(Zeros({1, 4, 3, 3}), Zeros({4, 2, 1, 1}), Tensor(), {.groups = g62}); }),
            "conv2d: groups 4611686018427387904 times the weight's 2 channels per group overflows int64");
  EXPECT_EQ(ErrorOf([&] { Conv2d(Zeros({1, 8, 3, 3}), Zeros({0, 4, 1, 1}), Tensor(), {.groups = g62 + 2}); }),
            "conv2d: groups 4611686018427387906 times the weight's 4 channels per group overflows int64");
}

// Pooling refuses an input with no channels, rows or columns, naming its
// shape, as PyTorch's pool2d_shape_check; only the batch may be 0. Before,
// MaxPool2d of x [1, 1, 0, 4] with padding 1 gave a [1, 1, 1, 5] output of
// -inf, AvgPool2d one of zeros, and C = 0 gave an empty output.
TEST(KernelsTest, PoolingRefusesAnEmptyInputOtherThanAnEmptyBatch) {
  const Pool2dParams p{.kernel_h = 2, .kernel_w = 2, .pad_h = 1, .pad_w = 1};
  for (const Shape& shape : {Shape{1, 1, 0, 4}, Shape{1, 1, 4, 0}, Shape{1, 0, 4, 4}, Shape{0, 0, 4, 4}}) {
    const std::string got = ShapeToString(shape);
    EXPECT_EQ(ErrorOf([&] { MaxPool2d(Zeros(shape), p); }),
              "max_pool2d: only the batch may be empty, got input " + got);
    EXPECT_EQ(ErrorOf([&] { AvgPool2d(Zeros(shape), p); }),
              "avg_pool2d: only the batch may be empty, got input " + got);
    EXPECT_EQ(ErrorOf([&] { AdaptiveAvgPool2d(Zeros(shape), 2, 2); }),
              "adaptive_avg_pool2d: only the batch may be empty, got input " + got);
  }
  EXPECT_EQ(MaxPool2d(Zeros({0, 1, 4, 4}), p).shape(), (Shape{0, 1, 5, 5}));
  EXPECT_EQ(AvgPool2d(Zeros({0, 1, 4, 4}), p).shape(), (Shape{0, 1, 5, 5}));
  EXPECT_EQ(AdaptiveAvgPool2d(Zeros({0, 1, 4, 4}), 2, 2).shape(), (Shape{0, 1, 2, 2}));
}

// Adaptive pooling's window bounds are (o * H) / out_h and
// ((o + 1) * H + out_h - 1) / out_h: sizes whose product leaves int64
// (a broadcast view of 2^40 rows into 2^24 outputs) are refused naming the
// axis, before anything is allocated or read; the windows wrapped before.
TEST(KernelsTest, AdaptiveAvgPoolRefusesSizesWhoseWindowBoundsOverflowNamingTheAxis) {
  const int64_t huge = int64_t{1} << 40, many = int64_t{1} << 24;
  for (const int64_t batch : {0, 1}) {
    const Tensor tall = Expand(Ones({1, 1, 1, 1}), {batch, 1, huge, 1});
    EXPECT_EQ(ErrorOf([&] { AdaptiveAvgPool2d(tall, many, 1); }),
              "adaptive_avg_pool2d: output height 16777216 times the input's height 1099511627776 overflows "
              "the int64 window bounds; got input " + ShapeToString(tall.shape()));
    const Tensor wide = Expand(Ones({1, 1, 1, 1}), {batch, 1, 1, huge});
    EXPECT_EQ(ErrorOf([&] { AdaptiveAvgPool2d(wide, 1, many); }),
              "adaptive_avg_pool2d: output width 16777216 times the input's width 1099511627776 overflows "
              "the int64 window bounds; got input " + ShapeToString(wide.shape()));
  }
  // Large but within int64: the bounds are exact (an empty batch, nothing read).
  EXPECT_EQ(AdaptiveAvgPool2d(Expand(Ones({1, 1, 1, 1}), {0, 1, huge, 1}), int64_t{1} << 20, 1).shape(),
            (Shape{0, 1, int64_t{1} << 20, 1}));
}

// Average pooling has no dilation (torch's avg_pool2d takes none); one other
// than 1 is refused naming it. Before, it was ignored: a 2x2 window with
// dilation 2 on a 5x5 input gave the undilated [1, 1, 4, 4] average.
TEST(KernelsTest, AvgPoolRefusesADilation) {
  const Tensor x = Rand({1, 1, 5, 5});
  EXPECT_EQ(ErrorOf([&] { AvgPool2d(x, {.kernel_h = 2, .kernel_w = 2, .dilation_h = 2, .dilation_w = 2}); }),
            "avg_pool2d: average pooling has no dilation, got (2, 2)");
  EXPECT_EQ(ErrorOf([&] { AvgPool2d(x, {.kernel_h = 2, .kernel_w = 2, .dilation_h = 1, .dilation_w = 3}); }),
            "avg_pool2d: average pooling has no dilation, got (1, 3)");
  EXPECT_EQ(AvgPool2d(x, {.kernel_h = 2, .kernel_w = 2}).shape(), (Shape{1, 1, 4, 4}));
}

// More groups than output channels are refused naming both, as PyTorch
// ("expected weight to be at least G at dimension 0"); 0 output channels
// still run with one group. Before, a weight [0, 0, 1, 1] on x [1, 0, 3, 3]
// with 2^62 groups passed every check and the im2col loop stepped through
// 2^62 empty groups.
TEST(KernelsTest, Conv2dRefusesMoreGroupsThanOutputChannels) {
  EXPECT_EQ(ErrorOf([&] {
              Conv2d(Zeros({1, 0, 3, 3}), Zeros({0, 0, 1, 1}), Tensor(), {.groups = int64_t{1} << 62});
            }),
            "conv2d: groups 4611686018427387904 is more than the weight's 0 output channels [0, 0, 1, 1]");
  EXPECT_EQ(ErrorOf([&] { Conv2d(Zeros({1, 4, 3, 3}), Zeros({0, 2, 1, 1}), Tensor(), {.groups = 2}); }),
            "conv2d: groups 2 is more than the weight's 0 output channels [0, 2, 1, 1]");
  EXPECT_EQ(Conv2d(Zeros({1, 4, 3, 3}), Zeros({0, 4, 1, 1}), Tensor()).shape(), (Shape{1, 0, 3, 3}));
  EXPECT_EQ(Conv2d(Zeros({1, 4, 3, 3}), Zeros({2, 2, 1, 1}), Tensor(), {.groups = 2}).shape(), (Shape{1, 2, 3, 3}));
}

// Output sizes whose intermediate terms overflow int64 are refused naming
// the parameter; before, they wrapped (signed overflow, undefined): a
// dilation of 2^63 - 1 gave a [1, 1, 6, 2] convolution of a 4x4 input, and
// ConvOutputSize(4, 3, 1, 2^62 - 1, 1) returned INT64_MIN. Sizes near the
// limit that do not overflow are still computed.
TEST(KernelsTest, ConvOutputSizeRefusesOverflowByName) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(ErrorOf([&] { ConvOutputSize(4, 3, 1, max / 2, 1); }),
            "ConvOutputSize: pad 4611686018427387903 on both sides of an input of 4 overflows int64");
  EXPECT_EQ(ErrorOf([&] { ConvOutputSize(4, 3, 1, 0, max); }),
            "ConvOutputSize: dilation 9223372036854775807 times kernel - 1 (2) overflows int64");
  EXPECT_EQ(ErrorOf([&] { ConvOutputSize(-1, 3, 1, 0, 1); }), "ConvOutputSize: input size must be at least 0, got -1");
  EXPECT_EQ(ErrorOf([&] { Conv2d(Ones({1, 1, 4, 4}), Ones({1, 1, 3, 3}), Tensor(), {.dilation_h = max}); }),
            "conv2d: dilation_h 9223372036854775807 times kernel_h - 1 (2) overflows int64");
  EXPECT_EQ(ErrorOf([&] { Conv2d(Ones({1, 1, 4, 4}), Ones({1, 1, 3, 3}), Tensor(), {.pad_w = max / 2}); }),
            "conv2d: pad_w 4611686018427387903 on both sides of an input of 4 overflows int64");
  EXPECT_EQ(ErrorOf([&] {
              MaxPool2d(Zeros({1, 1, 4, 4}),
                        {.kernel_h = max, .kernel_w = 2, .stride_h = 1, .stride_w = 1, .pad_h = max / 2});
            }),
            "max_pool2d: pad_h 4611686018427387903 on both sides of an input of 4 overflows int64");
  // Twice this padding wrapped negative, passing the half-kernel check.
  EXPECT_EQ(ErrorOf([&] { AvgPool2d(Zeros({1, 1, 4, 4}), {.kernel_h = 3, .kernel_w = 2, .pad_h = max / 2 + 1}); }),
            "avg_pool2d: padding (4611686018427387904, 0) must be between 0 and half the kernel size (3, 2)");
  EXPECT_EQ(ConvOutputSize(4, 1, 1, max / 2 - 2, 1), max - 1);
  EXPECT_EQ(ConvOutputSize(4, 2, max, 0, 1), 1);
  // ceil_mode with a huge stride: one window (stride - 1 was added to the
  // numerator, which wrapped and gave 0).
  EXPECT_EQ(ConvOutputSize(4, 1, max, 0, 1, true), 1);
  EXPECT_EQ(ConvOutputSize(4, 3, 2, 1, 1, true), 3);
}

// A window far longer than the input (kernel 2^62 with padding 2^61 passes
// every check, as in PyTorch) visits only its taps inside the input. The
// kernel used to step through all 2^62 taps of each window and did not
// finish; the child process here has 20 s (of the test's 60) before
// SIGALRM ends it.
TEST(KernelsTest, MaxPoolVisitsOnlyTheTapsInsideTheInput) {
  const int64_t k = int64_t{1} << 62;
  const Pool2dParams p{.kernel_h = k, .kernel_w = 2, .stride_h = 1, .stride_w = 1, .pad_h = k / 2};
  const auto pool = [&](DType dt) {
    Tensor x = Arange(16, {.dtype = dt}).Reshape({1, 1, 4, 4}).Detach();
    x.set_requires_grad(true);
    const Tensor y = MaxPool2d(x, p);
    Backward(Sum(y));
    return std::make_pair(y.Detach(), x.grad());
  };
  // threadsafe: the child is a fresh process running this test alone, not a
  // fork of one holding other tests' BLAS and OpenMP threads.
  const std::string style = ::testing::GTEST_FLAG(death_test_style);
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  ASSERT_EXIT(
      {
        alarm(20);
        pool(DType::kFloat32);
        std::fprintf(stderr, "pooled\n");
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "pooled");
  ::testing::GTEST_FLAG(death_test_style) = style;
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    const auto [y, gx] = pool(dt);
    // Rows -2^61 + i .. 2^61 + i cover all four input rows: each window's
    // maximum is the last row's, x[3][j + 1].
    ASSERT_EQ(y.shape(), (Shape{1, 1, 5, 3})) << DTypeName(dt);
    for (int64_t i = 0; i < 5; ++i) {
      EXPECT_EQ(y.Select(2, i).ToVector<double>(), (std::vector<double>{13, 14, 15})) << DTypeName(dt);
    }
    EXPECT_EQ(gx.ToVector<double>(), (std::vector<double>{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 5, 5}))
        << DTypeName(dt);
  }
}

// Average pooling's divisor with count_include_pad is the product of the
// two padded window lengths: with kernel 2^62 and padding 2^61 on a 4x4
// input each length is 2^62, and the int64 product 2^124 wrapped to 0, so
// every output was 0 instead of 16 / 2^124 and no gradient flowed.
TEST(KernelsTest, AvgPoolDivisorOfHugeWindowsDoesNotWrap) {
  const int64_t k = int64_t{1} << 62;
  const Pool2dParams p{.kernel_h = k, .kernel_w = k, .stride_h = 1, .stride_w = 1, .pad_h = k / 2, .pad_w = k / 2};
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    const Tensor x = Ones({1, 1, 4, 4}, {.dtype = dt, .requires_grad = true});
    const Tensor y = AvgPool2d(x, p);
    ASSERT_EQ(y.shape(), (Shape{1, 1, 5, 5})) << DTypeName(dt);
    EXPECT_EQ(y.ToVector<double>(), std::vector<double>(25, std::ldexp(1.0, -120))) << DTypeName(dt);
    Backward(Sum(y));
    // 25 windows each give 1 / 2^124 to every cell.
    EXPECT_EQ(x.grad().ToVector<double>(), std::vector<double>(16, 25 * std::ldexp(1.0, -124))) << DTypeName(dt);
  }
}

// With ceil_mode, a 4-row input, kernel 2^63 - 3, padding 2^62 - 3 and
// stride 2^62 pass every check and give two windows; the second starts at row
// 3, and its end s + kernel (2^63) overflowed int64. The wrapped end emptied
// the window, so y[1] was 0 instead of x[3] (divided by 2^62 - 2 padded rows
// with count_include_pad). The first window covers all four rows.
TEST(KernelsTest, AvgPoolWindowEndPastInt64IsClippedToThePadding) {
  const int64_t pad = (int64_t{1} << 62) - 3;
  const int64_t kernel = 2 * pad + 3;  // 2^63 - 3
  for (const bool include_pad : {true, false}) {
    const Pool2dParams p{.kernel_h = kernel,
                         .stride_h = int64_t{1} << 62,
                         .pad_h = pad,
                         .ceil_mode = true,
                         .count_include_pad = include_pad};
    const Tensor x = FromVector(std::vector<double>{1, 2, 3, 4}, {1, 1, 4, 1}, {.dtype = DType::kFloat64});
    const Tensor y = AvgPool2d(x, p);
    ASSERT_EQ(y.shape(), (Shape{1, 1, 2, 1})) << include_pad;
    const std::vector<double> want =
        include_pad ? std::vector<double>{10 / static_cast<double>(kernel), 4 / std::ldexp(1.0, 62)}
                    : std::vector<double>{2.5, 4};
    EXPECT_EQ(y.ToVector<double>(), want) << "count_include_pad " << include_pad;
  }
}

// add_scaled_ is how a leaf's gradient is added into its .grad, so an
// operand that does not broadcast to the output (a .grad left stale by
// SetData) is refused and the output left as it was. Before, a wider
// operand was cut to the output's size, a narrower one was read past its
// end, and one of more dimensions than the output made BroadcastStrides
// write before the start of the strides it returns.
TEST(KernelsTest, AddScaledRefusesAnOperandThatDoesNotBroadcast) {
  const Tensor out = Zeros({2});
  EXPECT_EQ(ErrorOf([&] { cpu::AddScaled(out, Ones({4}), 1.0); }), "cannot broadcast shape [4] to [2]");
  EXPECT_EQ(ErrorOf([&] { cpu::AddScaled(out, Ones({2, 2}), 1.0); }), "cannot broadcast shape [2, 2] to [2]");
  EXPECT_EQ(out.ToVector<float>(), (std::vector<float>{0, 0}));
  const Tensor wide = Zeros({2, 3});
  EXPECT_EQ(ErrorOf([&] { cpu::AddScaled(wide, Ones({2}), 1.0); }), "cannot broadcast shape [2] to [2, 3]");
  // Operands that do broadcast: a row, a column and a scalar.
  cpu::AddScaled(wide, FromVector({1, 2, 3}, {3}), 2.0);
  cpu::AddScaled(wide, FromVector({10, 20}, {2, 1}), 1.0);
  cpu::AddScaled(wide, Full({}, 0.5), -2.0);
  EXPECT_EQ(wide.ToVector<float>(), (std::vector<float>{11, 13, 15, 21, 23, 25}));
}

// SumToShape takes a target that broadcasts to the gradient's shape, as
// torch's sum_to_size: sums as PyTorch 1.13 gives them, and a target with
// more dimensions, or a size neither 1 nor the gradient's, refused naming
// both shapes (a longer target made the padding count wrap to a huge size).
TEST(KernelsTest, SumToShapeSumsToABroadcastTargetAndRefusesAnyOther) {
  const Tensor g = FromVector({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(detail::SumToShape(g, {1, 3}).ToVector<float>(), (std::vector<float>{5, 7, 9}));
  EXPECT_EQ(detail::SumToShape(g, {3}).ToVector<float>(), (std::vector<float>{5, 7, 9}));
  EXPECT_EQ(detail::SumToShape(g, {2, 1}).ToVector<float>(), (std::vector<float>{6, 15}));
  EXPECT_EQ(detail::SumToShape(g, {}).shape(), Shape{});
  EXPECT_EQ(detail::SumToShape(g, {}).Item(), 21);
  EXPECT_EQ(detail::SumToShape(Empty({0, 3}), {1, 3}).ToVector<float>(), (std::vector<float>{0, 0, 0}));
  struct Bad {
    Shape target;
    std::string named;
  };
  for (const Bad& bad : {Bad{{1, 2, 3}, "[1, 2, 3]"}, Bad{{2}, "shape [2] ("}, Bad{{-1, 3}, "[-1, 3]"},
                         Bad{{0, 3}, "[0, 3]"}, Bad{{2, 3, 1, 1}, "[2, 3, 1, 1]"}}) {
    try {
      detail::SumToShape(g, bad.target);
      ADD_FAILURE() << "SumToShape to " << ShapeToString(bad.target) << " was accepted";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("SumToShape"), std::string::npos) << what;
      EXPECT_NE(what.find("[2, 3]"), std::string::npos) << what;
      EXPECT_NE(what.find(bad.named), std::string::npos) << what;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "SumToShape to " << ShapeToString(bad.target) << " threw an unclear " << e.what();
    }
  }
}

// Result dtypes of the binary and scalar ops for a table of operand pairs,
// as torch 1.13 gives them for a + b, a / b and b * a. A 0-d tensor does
// not raise the type of one with dimensions in its own category (f32 with
// a 0-d f64 stays f32, u8 with a 0-d i64 stays u8) but decides across
// categories (i64 with a 0-d f64 is f64: it is a tensor, not a Python
// number, which would give the default f32). A scalar op's double acts as a
// Python float: an integer tensor gives f32, a 16-bit one keeps its dtype.
TEST(KernelsTest, ResultDTypesMatchPyTorchForATableOfOperands) {
  using D = DType;
  struct Case {
    D a;
    bool a_0d;
    D b;
    bool b_0d;
    D add, div, mul;
  };
  const Case cases[] = {
      {D::kInt64, false, D::kFloat64, true, D::kFloat64, D::kFloat64, D::kFloat64},
      {D::kFloat32, false, D::kFloat64, true, D::kFloat32, D::kFloat32, D::kFloat32},
      {D::kInt32, false, D::kFloat16, true, D::kFloat16, D::kFloat16, D::kFloat16},
      {D::kUInt8, false, D::kInt64, true, D::kUInt8, D::kFloat32, D::kUInt8},
      {D::kUInt8, false, D::kInt32, true, D::kUInt8, D::kFloat32, D::kUInt8},
      {D::kBFloat16, false, D::kFloat64, true, D::kBFloat16, D::kBFloat16, D::kBFloat16},
      {D::kInt64, false, D::kBFloat16, true, D::kBFloat16, D::kBFloat16, D::kBFloat16},
      {D::kInt32, false, D::kUInt8, false, D::kInt32, D::kFloat32, D::kInt32},
      {D::kUInt8, false, D::kInt64, false, D::kInt64, D::kFloat32, D::kInt64},
      {D::kFloat16, false, D::kBFloat16, false, D::kFloat32, D::kFloat32, D::kFloat32},
      {D::kInt64, true, D::kFloat16, true, D::kFloat16, D::kFloat16, D::kFloat16},
      {D::kUInt8, true, D::kInt32, true, D::kInt32, D::kFloat32, D::kInt32},
      {D::kFloat32, true, D::kFloat64, false, D::kFloat64, D::kFloat64, D::kFloat64},
      {D::kInt32, false, D::kInt64, true, D::kInt32, D::kFloat32, D::kInt32},
  };
  for (const Case& c : cases) {
    const Tensor a = Ones(c.a_0d ? Shape{} : Shape{2}, {.dtype = c.a});
    const Tensor b = Ones(c.b_0d ? Shape{} : Shape{2}, {.dtype = c.b});
    const std::string what = std::string(DTypeName(c.a)) + (c.a_0d ? " 0-d" : "") + " with " +
                             std::string(DTypeName(c.b)) + (c.b_0d ? " 0-d" : "");
    EXPECT_EQ(Add(a, b).dtype(), c.add) << what;
    EXPECT_EQ(Div(a, b).dtype(), c.div) << what;
    EXPECT_EQ(Mul(b, a).dtype(), c.mul) << what;
  }
  const std::pair<D, D> scalar_cases[] = {{D::kInt64, D::kFloat32},   {D::kUInt8, D::kFloat32},
                                          {D::kInt32, D::kFloat32},   {D::kFloat16, D::kFloat16},
                                          {D::kBFloat16, D::kBFloat16}};
  for (const auto& [in, out] : scalar_cases) {
    const Tensor x = Ones({2}, {.dtype = in});
    EXPECT_EQ(AddScalar(x, 2.5).dtype(), out) << DTypeName(in);
    EXPECT_EQ(MulScalar(x, 2.5).dtype(), out) << DTypeName(in);
    EXPECT_EQ(DivScalar(x, 2.5).dtype(), out) << DTypeName(in);
  }
}

}  // namespace
}  // namespace ddp::nn::ops
