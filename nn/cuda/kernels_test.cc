// Every CUDA kernel against the CPU kernel of the same table entry, on random
// inputs (tag "gpu"). Tolerances, as |gpu - cpu| <= atol + rtol * |cpu|:
// - elementwise f32: rtol 1e-5, atol 1e-6 (CUDA's expf/erff/tanhf are within
//   2 ulp of the correctly rounded value, as glibc's are, and a few
//   derivatives such as the tanh-GELU's 1 - tanh^2 amplify that tenfold);
// - f64: rtol 1e-10 for the same reason;
// - f16 / bf16: one unit in the last place of the 16-bit result (rtol 1e-3 /
//   8e-3), since the f32 intermediate may round across a boundary;
// - reductions and softmax: the GPU sums in a tree, the CPU in a line, so f32
//   gets rtol 1e-5 and atol 1e-6 * row length;
// - GEMM f32 (TF32 off): rtol 1e-5, atol 1e-5 * sqrt(K) * |max input|^2;
//   TF32 on: rtol 5e-3.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "nn/cuda/cuda.h"
#include "nn/cuda/kernels.h"
#include "nn/ops/dispatch.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);
const ops::KernelTable& Cpu() { return ops::KernelsFor(DeviceType::kCPU); }
const ops::KernelTable& Gpu() { return ops::KernelsFor(DeviceType::kCUDA); }

struct Tol {
  double rtol, atol;
};

Tol ElementwiseTol(DType dt) {
  switch (dt) {
    case DType::kFloat64: return {1e-10, 1e-12};
    case DType::kFloat16: return {1e-3, 1e-4};
    case DType::kBFloat16: return {8e-3, 1e-3};
    default: return {1e-5, 1e-6};
  }
}

// Compares a GPU result with the CPU's, element by element, naming the first
// few mismatches and `what`.
void ExpectClose(const Tensor& cpu, const Tensor& gpu, Tol tol, const std::string& what) {
  ASSERT_EQ(cpu.shape(), gpu.shape()) << what;
  ASSERT_EQ(gpu.device(), kGpu) << what;
  const std::vector<double> want = cpu.ToVector<double>();
  const std::vector<double> got = gpu.To(kCPU).ToVector<double>();
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const bool both_nan = std::isnan(want[i]) && std::isnan(got[i]);
    const bool same_inf = std::isinf(want[i]) && want[i] == got[i];
    if (both_nan || same_inf) continue;
    if (!(std::abs(got[i] - want[i]) <= tol.atol + tol.rtol * std::abs(want[i]))) {
      if (++bad <= 5) ADD_FAILURE() << what << ": element " << i << ": cpu " << want[i] << ", gpu " << got[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " elements differ";
}

Tensor RandnOf(const Shape& shape, DType dt, double stddev = 1.0) {
  Tensor t = Empty(shape);
  NormalFill(t, 0.0, stddev);
  return t.To(dt);
}

Tensor UniformOf(const Shape& shape, DType dt, double lo, double hi) {
  Tensor t = Empty(shape);
  UniformFill(t, lo, hi);
  return t.To(dt);
}

std::string Name(DType dt) { return std::string(DTypeName(dt)); }

// The message of the exception of type E that `f` throws; "" if none.
template <typename E, typename F>
std::string MessageOf(F f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}
template <typename F>
std::string InvalidArgumentOf(F f) {
  return MessageOf<std::invalid_argument>(f);
}

const DType kFloats[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16};

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Init();
    ManualSeed(1234);
  }
};

// Ops whose derivative is written in terms of the output.
bool SavesOutput(ops::UnaryOp op) {
  return op == ops::UnaryOp::kSigmoid || op == ops::UnaryOp::kTanh || op == ops::UnaryOp::kExp ||
         op == ops::UnaryOp::kSqrt;
}
bool NeedsPositive(ops::UnaryOp op) {
  return op == ops::UnaryOp::kLog || op == ops::UnaryOp::kSqrt || op == ops::UnaryOp::kLog1p;
}

TEST_F(CudaKernelsTest, UnaryForwardAndBackwardMatchCpu) {
  for (int code = 0; code <= static_cast<int>(ops::UnaryOp::kLog1p); ++code) {
    const auto op = static_cast<ops::UnaryOp>(code);
    for (DType dt : kFloats) {
      const std::string what = "unary op " + std::to_string(code) + " " + Name(dt);
      const Tensor x = NeedsPositive(op) ? UniformOf({33, 47}, dt, 0.1, 4.0) : RandnOf({33, 47}, dt, 2.0);
      const Tensor y_cpu = Empty(x.shape(), {.dtype = dt});
      Cpu().unary(op, x, y_cpu);
      const Tensor xg = x.To(kGpu);
      const Tensor y_gpu = Empty(x.shape(), {.dtype = dt, .device = kGpu});
      Gpu().unary(op, xg, y_gpu);
      ExpectClose(y_cpu, y_gpu, ElementwiseTol(dt), what);

      const Tensor g = RandnOf(x.shape(), dt);
      const Tensor saved = SavesOutput(op) ? y_cpu : x;
      const Tensor gi_cpu = Empty(x.shape(), {.dtype = dt});
      Cpu().unary_backward(op, g, saved, gi_cpu);
      const Tensor gi_gpu = Empty(x.shape(), {.dtype = dt, .device = kGpu});
      Gpu().unary_backward(op, g.To(kGpu), saved.To(kGpu), gi_gpu);
      ExpectClose(gi_cpu, gi_gpu, ElementwiseTol(dt), what + " backward");
    }
  }
}

TEST_F(CudaKernelsTest, UnaryReadsTransposedInputAndWritesInPlace) {
  const Tensor x = RandnOf({20, 30}, DType::kFloat32);
  const Tensor xt = x.Transpose(0, 1);
  const Tensor y_cpu = Empty({30, 20});
  Cpu().unary(ops::UnaryOp::kGelu, xt, y_cpu);
  const Tensor y_gpu = Empty({30, 20}, {.device = kGpu});
  Gpu().unary(ops::UnaryOp::kGelu, x.To(kGpu).Transpose(0, 1), y_gpu);
  ExpectClose(y_cpu, y_gpu, ElementwiseTol(DType::kFloat32), "gelu of a transposed view");

  const Tensor inplace = x.To(kGpu);
  Gpu().unary(ops::UnaryOp::kRelu, inplace, inplace);
  const Tensor relu_cpu = Empty({20, 30});
  Cpu().unary(ops::UnaryOp::kRelu, x, relu_cpu);
  ExpectClose(relu_cpu, inplace, {0, 0}, "relu in place");
}

// The vectorized path (SetVectorizedElementwise): 16 bytes per
// operand and load where every operand is contiguous and 16-byte aligned,
// the last n % (16 / element size) elements one by one, and the indexed path
// for an operand that is not aligned (a view starting one element in). Sizes
// below, at and above one pack, with a tail, and over a million elements;
// relu, gelu and sigmoid forward and backward, the four binary ops
// (integers without division), and relu and add in place.
// Sets the vectorized path for a scope, then restores the setting.
class Vectorized {
 public:
  explicit Vectorized(bool on) : was_(VectorizedElementwise()) { SetVectorizedElementwise(on); }
  ~Vectorized() { SetVectorizedElementwise(was_); }
  Vectorized(const Vectorized&) = delete;
  Vectorized& operator=(const Vectorized&) = delete;

 private:
  bool was_;
};

TEST_F(CudaKernelsTest, VectorizedElementwiseMatchesCpu) {
  const Vectorized setting(true);
  const int64_t sizes[] = {1, 3, 8, 4099, (int64_t{1} << 20) + 5};
  for (int64_t n : sizes) {
    for (int offset : {0, 1}) {
      // Aligned operands take the packed path for every launch below; an
      // operand one element in never does.
      const uint64_t launches_before = PackedElementwiseLaunches();
      for (DType dt : kFloats) {
        const std::string where = " n " + std::to_string(n) + " offset " + std::to_string(offset) + " " + Name(dt);
        // Operands start `offset` elements into a larger buffer.
        auto on_gpu = [&](const Tensor& t) {
          const Tensor big = Empty({n + offset}, {.dtype = dt, .device = kGpu});
          const Tensor view = big.Narrow(0, offset, n);
          view.CopyFrom(t.To(kGpu));
          return view;
        };
        const Tensor x = RandnOf({n}, dt, 2.0), g = RandnOf({n}, dt);
        const Tensor b = UniformOf({n}, dt, 0.5, 3.0);
        const Tensor xg = on_gpu(x), gg = on_gpu(g), bg = on_gpu(b);
        for (ops::UnaryOp op : {ops::UnaryOp::kRelu, ops::UnaryOp::kGelu, ops::UnaryOp::kSigmoid}) {
          const std::string what = "unary " + std::to_string(static_cast<int>(op)) + where;
          const Tensor y_cpu = Empty({n}, {.dtype = dt});
          Cpu().unary(op, x, y_cpu);
          const Tensor y_gpu = on_gpu(Zeros({n}, {.dtype = dt}));
          Gpu().unary(op, xg, y_gpu);
          ExpectClose(y_cpu, y_gpu, ElementwiseTol(dt), what);
          const Tensor saved = SavesOutput(op) ? y_cpu : x;
          const Tensor gi_cpu = Empty({n}, {.dtype = dt});
          Cpu().unary_backward(op, g, saved, gi_cpu);
          const Tensor gi_gpu = on_gpu(Zeros({n}, {.dtype = dt}));
          Gpu().unary_backward(op, gg, on_gpu(saved), gi_gpu);
          ExpectClose(gi_cpu, gi_gpu, ElementwiseTol(dt), what + " backward");
        }
        for (int code = 0; code <= 3; ++code) {
          const auto op = static_cast<ops::BinaryOp>(code);
          const Tensor out_cpu = Empty({n}, {.dtype = dt});
          Cpu().binary(op, x, b, out_cpu);
          const Tensor out_gpu = on_gpu(Zeros({n}, {.dtype = dt}));
          Gpu().binary(op, xg, bg, out_gpu);
          ExpectClose(out_cpu, out_gpu, ElementwiseTol(dt), "binary " + std::to_string(code) + where);
        }
        // In place: relu of x into x, then x + b into x.
        const Tensor inplace = on_gpu(x);
        Gpu().unary(ops::UnaryOp::kRelu, inplace, inplace);
        Gpu().binary(ops::BinaryOp::kAdd, inplace, bg, inplace);
        const Tensor relu_cpu = Empty({n}, {.dtype = dt}), sum_cpu = Empty({n}, {.dtype = dt});
        Cpu().unary(ops::UnaryOp::kRelu, x, relu_cpu);
        Cpu().binary(ops::BinaryOp::kAdd, relu_cpu, b, sum_cpu);
        ExpectClose(sum_cpu, inplace, ElementwiseTol(dt), "relu then add in place" + where);
      }
      for (DType dt : {DType::kInt64, DType::kInt32}) {
        const Tensor a = UniformOf({n}, DType::kFloat64, -50, 50).To(dt);
        const Tensor c = UniformOf({n}, DType::kFloat64, 1, 9).To(dt);
        for (int code = 0; code <= 2; ++code) {
          const auto op = static_cast<ops::BinaryOp>(code);
          const Tensor out_cpu = Empty({n}, {.dtype = dt});
          Cpu().binary(op, a, c, out_cpu);
          const Tensor big = Empty({n + offset}, {.dtype = dt, .device = kGpu});
          const Tensor out_gpu = big.Narrow(0, offset, n);
          Gpu().binary(op, a.To(kGpu), c.To(kGpu), out_gpu);
          ExpectClose(out_cpu, out_gpu, {0, 0}, "binary " + std::to_string(code) + " n " + std::to_string(n) +
                                                    " offset " + std::to_string(offset) + " " + Name(dt));
        }
      }
      const uint64_t packed = PackedElementwiseLaunches() - launches_before;
      if (offset == 0) {
        EXPECT_GT(packed, 0u) << "n " << n << ": aligned operands never took the packed path";
      } else {
        EXPECT_EQ(packed, 0u) << "n " << n << ": an operand one element in took the packed path";
      }
    }
  }
  // Off: nothing takes it.
  const Vectorized off(false);
  const uint64_t before = PackedElementwiseLaunches();
  const Tensor x = RandnOf({4096}, DType::kFloat32).To(kGpu), y = Empty({4096}, {.device = kGpu});
  Gpu().unary(ops::UnaryOp::kRelu, x, y);
  EXPECT_EQ(PackedElementwiseLaunches(), before);
}

// Integer add, sub and mul wrap in two's complement on the device as on the
// CPU (KernelsTest.IntegerArithmeticWrapsAsPyTorch): the kernels compute in
// the unsigned type, since signed overflow is undefined.
TEST_F(CudaKernelsTest, IntegerArithmeticWrapsAsOnTheCpu) {
  const int64_t lmax = std::numeric_limits<int64_t>::max(), lmin = std::numeric_limits<int64_t>::min();
  const int32_t imax = std::numeric_limits<int32_t>::max(), imin = std::numeric_limits<int32_t>::min();
  const Tensor longs = FromVectorOf<int64_t>({lmax, lmin, int64_t{1} << 32, lmax}, {4});
  const Tensor long_steps = FromVectorOf<int64_t>({1, -1, 1 << 16, lmax}, {4});
  const Tensor ints = FromVectorOf<int32_t>({65536, imax, imin, imin}, {4});
  const Tensor int_steps = FromVectorOf<int32_t>({65536, 1, -1, imin}, {4});
  for (int code = 0; code <= 2; ++code) {
    const auto op = static_cast<ops::BinaryOp>(code);
    for (const auto& [a, b] : {std::make_pair(longs, long_steps), std::make_pair(ints, int_steps)}) {
      const std::string what = "binary op " + std::to_string(code) + " " + Name(a.dtype());
      const Tensor out_cpu = Empty({4}, {.dtype = a.dtype()});
      const Tensor out_gpu = Empty({4}, {.dtype = a.dtype(), .device = kGpu});
      Cpu().binary(op, a, b, out_cpu);
      Gpu().binary(op, a.To(kGpu), b.To(kGpu), out_gpu);
      EXPECT_EQ(out_gpu.To(kCPU).ToVector<int64_t>(), out_cpu.ToVector<int64_t>()) << what;
    }
  }
}

TEST_F(CudaKernelsTest, BinaryWithBroadcastingMatchesCpu) {
  const DType types[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt64,
                         DType::kInt32};
  // add, sub, mul, div, add-relu.
  for (int code = 0; code <= 4; ++code) {
    const auto op = static_cast<ops::BinaryOp>(code);
    for (DType dt : types) {
      const std::string what = "binary op " + std::to_string(code) + " " + Name(dt);
      const bool is_int = !IsFloating(dt);
      // a [4, 1, 5] with b [3, 1] -> out [4, 3, 5]; divisors kept away from 0.
      const Tensor a = is_int ? UniformOf({4, 1, 5}, DType::kFloat64, -50, 50).To(dt) : RandnOf({4, 1, 5}, dt);
      const Tensor b = is_int ? UniformOf({3, 1}, DType::kFloat64, 1, 9).To(dt) : UniformOf({3, 1}, dt, 0.5, 3.0);
      const Tensor out_cpu = Empty({4, 3, 5}, {.dtype = dt});
      const Tensor out_gpu = Empty({4, 3, 5}, {.dtype = dt, .device = kGpu});
      if (is_int && op == ops::BinaryOp::kDiv) {
        // Both refuse to divide in an integer type (ops::Div divides
        // integers as f32), naming the dtype.
        const std::string want = "binary: division needs a floating dtype, got " + Name(dt);
        EXPECT_EQ(InvalidArgumentOf([&] { Cpu().binary(op, a, b, out_cpu); }), want);
        EXPECT_EQ(InvalidArgumentOf([&] { Gpu().binary(op, a.To(kGpu), b.To(kGpu), out_gpu); }), want);
        continue;
      }
      Cpu().binary(op, a, b, out_cpu);
      Gpu().binary(op, a.To(kGpu), b.To(kGpu), out_gpu);
      ExpectClose(out_cpu, out_gpu, is_int ? Tol{0, 0} : ElementwiseTol(dt), what);
      // Same shapes, contiguous: the packed (vectorized) path where it applies.
      const Tensor c = is_int ? UniformOf({4, 3, 5}, DType::kFloat64, 1, 9).To(dt) : UniformOf({4, 3, 5}, dt, 0.5, 3.0);
      const Tensor whole = a.Expand({4, 3, 5}).Contiguous();
      Cpu().binary(op, whole, c, out_cpu);
      Gpu().binary(op, whole.To(kGpu), c.To(kGpu), out_gpu);
      ExpectClose(out_cpu, out_gpu, is_int ? Tol{0, 0} : ElementwiseTol(dt), what + " (same shapes)");
    }
  }
}

TEST_F(CudaKernelsTest, AffineAddScaledAndMaskedScaleMatchCpu) {
  for (DType dt : kFloats) {
    const Tol tol = ElementwiseTol(dt);
    // affine with x [7] broadcast to out [5, 7].
    const Tensor x = RandnOf({7}, dt);
    const Tensor out_cpu = Empty({5, 7}, {.dtype = dt});
    Cpu().affine(x, 0.75, -2.0, out_cpu);
    const Tensor out_gpu = Empty({5, 7}, {.dtype = dt, .device = kGpu});
    Gpu().affine(x.To(kGpu), 0.75, -2.0, out_gpu);
    ExpectClose(out_cpu, out_gpu, tol, "affine " + Name(dt));

    // div_scalar, the same x and out; 3 is not a power of two, so a
    // reciprocal multiply would differ in the last bit.
    const Tensor q_cpu = Empty({5, 7}, {.dtype = dt});
    Cpu().div_scalar(x, 3.0, q_cpu);
    const Tensor q_gpu = Empty({5, 7}, {.dtype = dt, .device = kGpu});
    Gpu().div_scalar(x.To(kGpu), 3.0, q_gpu);
    ExpectClose(q_cpu, q_gpu, tol, "div_scalar " + Name(dt));

    // add_scaled_ into a transposed destination, x broadcast over rows.
    const Tensor base = RandnOf({6, 9}, dt);
    const Tensor row = RandnOf({6}, dt);
    const Tensor acc_cpu = base.Clone();
    Cpu().add_scaled_(acc_cpu.Transpose(0, 1), row, -1.5);
    const Tensor acc_gpu = base.To(kGpu);
    Gpu().add_scaled_(acc_gpu.Transpose(0, 1), row.To(kGpu), -1.5);
    ExpectClose(acc_cpu, acc_gpu, tol, "add_scaled_ " + Name(dt));

    // masked_scale with a random mask.
    const Tensor v = RandnOf({1000}, dt);
    const Tensor mask = UniformOf({1000}, DType::kFloat32, 0, 2).To(DType::kUInt8);
    const Tensor ms_cpu = Empty({1000}, {.dtype = dt});
    Cpu().masked_scale(v, mask, 1.25, ms_cpu);
    const Tensor ms_gpu = Empty({1000}, {.dtype = dt, .device = kGpu});
    Gpu().masked_scale(v.To(kGpu), mask.To(kGpu), 1.25, ms_gpu);
    ExpectClose(ms_cpu, ms_gpu, tol, "masked_scale " + Name(dt));
  }
}

// clamp and clamp_backward with both bounds, one, and lo > hi, on input with
// NaN and infinities (exact: a clamp only selects), x read transposed.
TEST_F(CudaKernelsTest, ClampForwardAndBackwardMatchCpu) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double bounds[][2] = {{-0.5, 0.75}, {-0.5, inf}, {-inf, 0.75}, {1.0, -1.0}, {0.25, 0.25}};
  for (DType dt : kFloats) {
    Tensor base = RandnOf({13, 9}, DType::kFloat64);
    double* p = base.data<double>();
    p[0] = nan;
    p[1] = inf;
    p[2] = -inf;
    p[3] = 0.75;
    p[4] = -0.5;
    const Tensor stored = base.To(dt);
    const Tensor x = stored.Transpose(0, 1);
    const Tensor x_gpu = stored.To(kGpu).Transpose(0, 1);
    for (const auto& b : bounds) {
      const std::string what = "clamp " + Name(dt) + " [" + std::to_string(b[0]) + ", " + std::to_string(b[1]) + "]";
      const Tensor y_cpu = Empty(x.shape(), {.dtype = dt});
      Cpu().clamp(x, b[0], b[1], y_cpu);
      const Tensor y_gpu = Empty(x.shape(), {.dtype = dt, .device = kGpu});
      Gpu().clamp(x_gpu, b[0], b[1], y_gpu);
      ExpectClose(y_cpu, y_gpu, Tol{0, 0}, what);

      const Tensor g = RandnOf(x.shape(), dt);
      const Tensor gi_cpu = Empty(x.shape(), {.dtype = dt});
      Cpu().clamp_backward(g, x, b[0], b[1], gi_cpu);
      const Tensor gi_gpu = Empty(x.shape(), {.dtype = dt, .device = kGpu});
      Gpu().clamp_backward(g.To(kGpu), x_gpu, b[0], b[1], gi_gpu);
      ExpectClose(gi_cpu, gi_gpu, Tol{0, 0}, what + " backward");
    }
  }
}

TEST_F(CudaKernelsTest, BernoulliMaskKeepsTheRequestedFractionReproducibly) {
  const int64_t n = int64_t{1} << 20;
  Generator gen(99);
  const Tensor m1 = Empty({n}, {.dtype = DType::kUInt8, .device = kGpu});
  Gpu().bernoulli_mask(m1, 0.7, gen);
  const std::vector<int64_t> v1 = m1.To(kCPU).ToVector<int64_t>();
  int64_t kept = 0;
  for (int64_t b : v1) {
    ASSERT_TRUE(b == 0 || b == 1) << b;
    kept += b;
  }
  // Standard deviation of the fraction: sqrt(0.7 * 0.3 / 2^20) = 4.5e-4; allow 7 sigma.
  EXPECT_NEAR(static_cast<double>(kept) / n, 0.7, 3.2e-3);
  Generator same(99);
  const Tensor m2 = Empty({n}, {.dtype = DType::kUInt8, .device = kGpu});
  Gpu().bernoulli_mask(m2, 0.7, same);
  EXPECT_EQ(m2.To(kCPU).ToVector<int64_t>(), v1);
  const Tensor m3 = Empty({n}, {.dtype = DType::kUInt8, .device = kGpu});
  Gpu().bernoulli_mask(m3, 0.7, gen);  // the generator moved on: another mask
  EXPECT_NE(m3.To(kCPU).ToVector<int64_t>(), v1);
}

TEST_F(CudaKernelsTest, SumToMatchesCpu) {
  struct Case {
    Shape x, out;
  };
  const Case cases[] = {{{64, 10}, {1, 10}},     {{8, 3, 5}, {8, 1, 1}},   {{2, 3, 4}, {1, 1, 1}},
                        {{1000, 7}, {1, 7}},      {{7, 1000}, {7, 1}},      {{5, 6}, {5, 6}},
                        {{0, 4}, {1, 4}},         {{3, 200, 2}, {1, 200, 1}}};
  for (const Case& c : cases) {
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
      const std::string what = "sum_to " + ShapeToString(c.x) + " -> " + ShapeToString(c.out) + " " + Name(dt);
      const Tensor x = RandnOf(c.x, dt);
      const Tensor out_cpu = Empty(c.out, {.dtype = dt});
      Cpu().sum_to(x, out_cpu, 1.0);
      const Tensor out_gpu = Empty(c.out, {.dtype = dt, .device = kGpu});
      Gpu().sum_to(x.To(kGpu), out_gpu, 1.0);
      // Both accumulate in f64: only the final rounding and the order differ.
      ExpectClose(out_cpu, out_gpu, dt == DType::kBFloat16 ? ElementwiseTol(dt) : Tol{1e-6, 1e-9}, what);
    }
  }
  // A transposed input, and an f16 input summed into f32.
  const Tensor x = RandnOf({40, 30}, DType::kFloat32);
  const Tensor out_cpu = Empty({30, 1});
  Cpu().sum_to(x.Transpose(0, 1), out_cpu, 1.0);
  const Tensor out_gpu = Empty({30, 1}, {.device = kGpu});
  Gpu().sum_to(x.To(kGpu).Transpose(0, 1), out_gpu, 1.0);
  ExpectClose(out_cpu, out_gpu, {1e-6, 1e-9}, "sum_to of a transposed view");
  const Tensor h = RandnOf({100, 3}, DType::kFloat16);
  const Tensor hs_cpu = Empty({1, 3});
  Cpu().sum_to(h, hs_cpu, 1.0);
  const Tensor hs_gpu = Empty({1, 3}, {.device = kGpu});
  Gpu().sum_to(h.To(kGpu), hs_gpu, 1.0);
  ExpectClose(hs_cpu, hs_gpu, {1e-6, 1e-9}, "sum_to f16 -> f32");
  // The scale applies before the rounding into f16: the mean of 100000 ones
  // is 1 although their sum overflows f16.
  const Tensor ones = Ones({100000}, {.dtype = DType::kFloat16});
  const Tensor mean_gpu = Empty({1}, {.dtype = DType::kFloat16, .device = kGpu});
  Gpu().sum_to(ones.To(kGpu), mean_gpu, 1e-5);
  EXPECT_EQ(mean_gpu.To(kCPU).ToVector<float>(), std::vector<float>{1.0f});
}

TEST_F(CudaKernelsTest, ArgmaxMatchesCpuIncludingTies) {
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kInt64}) {
    const Tensor x = IsFloating(dt) ? RandnOf({37, 10}, dt) : UniformOf({37, 10}, DType::kFloat64, -5, 5).To(dt);
    for (int64_t dim : {0, 1}) {
      Shape shape = x.shape();
      shape.erase(shape.begin() + dim);
      const Tensor out_cpu = Empty(shape, {.dtype = DType::kInt64});
      Cpu().argmax(x, dim, out_cpu);
      const Tensor out_gpu = Empty(shape, {.dtype = DType::kInt64, .device = kGpu});
      Gpu().argmax(x.To(kGpu), dim, out_gpu);
      ExpectClose(out_cpu, out_gpu, {0, 0}, "argmax dim " + std::to_string(dim) + " " + Name(dt));
    }
  }
  // Ties: the first maximum wins on both.
  const Tensor ties = FromVector({1, 3, 3, 0, 2, 2, 2, 2}, {2, 4});
  const Tensor out_gpu = Empty({2}, {.dtype = DType::kInt64, .device = kGpu});
  Gpu().argmax(ties.To(kGpu), 1, out_gpu);
  EXPECT_EQ(out_gpu.To(kCPU).ToVector<int64_t>(), (std::vector<int64_t>{1, 0}));
  // NaN: the first one wins wherever it stands, as in PyTorch.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const Tensor nans = FromVector({1, nan, 3, nan, nan, 5, 7, 1, 5, 2, 1, nan}, {3, 4}, {.dtype = dt});
    const Tensor out = Empty({3}, {.dtype = DType::kInt64, .device = kGpu});
    Gpu().argmax(nans.To(kGpu), 1, out);
    EXPECT_EQ(out.To(kCPU).ToVector<int64_t>(), (std::vector<int64_t>{1, 0, 3})) << Name(dt);
  }
}

TEST_F(CudaKernelsTest, LogSoftmaxForwardAndBackwardMatchCpu) {
  struct Case {
    Shape shape;
    int64_t dim;
  };
  const Case cases[] = {{{16, 10}, 1}, {{4, 6, 5}, 1}, {{9, 7}, 0}, {{3, 1000}, -1}, {{2, 3}, 1}};
  for (const Case& c : cases) {
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
      const std::string what = "log_softmax " + ShapeToString(c.shape) + " dim " + std::to_string(c.dim) + " " + Name(dt);
      const int64_t d = c.shape[c.dim < 0 ? c.shape.size() + c.dim : c.dim];
      const Tol tol = dt == DType::kBFloat16 ? ElementwiseTol(dt) : Tol{1e-5, 1e-6 * static_cast<double>(d)};
      const Tensor x = RandnOf(c.shape, dt, 3.0);
      const Tensor y_cpu = Empty(c.shape, {.dtype = dt});
      Cpu().log_softmax_forward(x, c.dim, y_cpu);
      const Tensor y_gpu = Empty(c.shape, {.dtype = dt, .device = kGpu});
      Gpu().log_softmax_forward(x.To(kGpu), c.dim, y_gpu);
      ExpectClose(y_cpu, y_gpu, tol, what);

      const Tensor dy = RandnOf(c.shape, dt);
      const Tensor dx_cpu = Empty(c.shape, {.dtype = dt});
      Cpu().log_softmax_backward(dy, y_cpu, c.dim, dx_cpu);
      const Tensor dx_gpu = Empty(c.shape, {.dtype = dt, .device = kGpu});
      Gpu().log_softmax_backward(dy.To(kGpu), y_cpu.To(kGpu), c.dim, dx_gpu);
      ExpectClose(dx_cpu, dx_gpu, tol, what + " backward");
    }
  }
  // A transposed (non-contiguous) input.
  const Tensor x = RandnOf({10, 16}, DType::kFloat32);
  const Tensor y_cpu = Empty({16, 10});
  Cpu().log_softmax_forward(x.Transpose(0, 1), 1, y_cpu);
  const Tensor y_gpu = Empty({16, 10}, {.device = kGpu});
  Gpu().log_softmax_forward(x.To(kGpu).Transpose(0, 1), 1, y_gpu);
  ExpectClose(y_cpu, y_gpu, {1e-5, 1e-5}, "log_softmax of a transposed view");
}

TEST_F(CudaKernelsTest, CrossEntropyForwardAndBackwardMatchCpu) {
  const int64_t n = 32, c = 10;
  for (DType logits_dt : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    const DType compute = logits_dt == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
    for (double smoothing : {0.0, 0.1}) {
      for (bool scalar_grad : {false, true}) {
        const std::string what = "cross_entropy " + Name(logits_dt) + " smoothing " + std::to_string(smoothing) +
                                 (scalar_grad ? " scalar grad" : " per-sample grad");
        const Tensor logits = RandnOf({n, c}, logits_dt, 2.0);
        Tensor target = UniformOf({n}, DType::kFloat64, 0, c).To(DType::kInt64);
        target.Narrow(0, 3, 2).Fill(-100);  // two ignored samples
        const Tensor lp_cpu = Empty({n, c}, {.dtype = compute});
        const Tensor loss_cpu = Empty({n}, {.dtype = compute});
        Cpu().cross_entropy_forward(logits, target, smoothing, -100, lp_cpu, loss_cpu);
        const Tensor lp_gpu = Empty({n, c}, {.dtype = compute, .device = kGpu});
        const Tensor loss_gpu = Empty({n}, {.dtype = compute, .device = kGpu});
        const Tensor target_gpu = target.To(kGpu);
        Gpu().cross_entropy_forward(logits.To(kGpu), target_gpu, smoothing, -100, lp_gpu, loss_gpu);
        const Tol tol = compute == DType::kFloat64 ? Tol{1e-10, 1e-12} : Tol{1e-5, 1e-5};
        ExpectClose(lp_cpu, lp_gpu, tol, what + " log_probs");
        ExpectClose(loss_cpu, loss_gpu, tol, what + " loss");

        const Tensor grad = scalar_grad ? FromVector({0.03125}, {}, {.dtype = compute}) : RandnOf({n}, compute);
        const Tensor d_cpu = Empty({n, c}, {.dtype = logits_dt});
        Cpu().cross_entropy_backward(lp_cpu, target, grad, smoothing, -100, d_cpu);
        const Tensor d_gpu = Empty({n, c}, {.dtype = logits_dt, .device = kGpu});
        Gpu().cross_entropy_backward(lp_gpu, target_gpu, grad.To(kGpu), smoothing, -100, d_gpu);
        ExpectClose(d_cpu, d_gpu, logits_dt == DType::kBFloat16 ? ElementwiseTol(logits_dt) : tol,
                    what + " dlogits");
      }
    }
  }
}

TEST_F(CudaKernelsTest, CrossEntropyNamesAnOutOfRangeTargetLikeTheCpu) {
  const Tensor logits = RandnOf({4, 10}, DType::kFloat32);
  const Tensor target = FromVector({1, 2, 10, 3}, {4}, {.dtype = DType::kInt64});
  std::string cpu_msg, gpu_msg;
  try {
    Cpu().cross_entropy_forward(logits, target, 0.0, -100, Empty({4, 10}), Empty({4}));
  } catch (const std::out_of_range& e) {
    cpu_msg = e.what();
  }
  try {
    Gpu().cross_entropy_forward(logits.To(kGpu), target.To(kGpu), 0.0, -100, Empty({4, 10}, {.device = kGpu}),
                                Empty({4}, {.device = kGpu}));
  } catch (const std::out_of_range& e) {
    gpu_msg = e.what();
  }
  EXPECT_NE(cpu_msg.find("target 10 (sample 2)"), std::string::npos) << cpu_msg;
  EXPECT_EQ(gpu_msg, cpu_msg);
}

// Targets for log_probs of `shape` [N, C, S...]: classes (i * 3 + 1) % C,
// with elements 1 and numel - 2 ignored (-100).
Tensor NllTargets(const Shape& shape) {
  Shape target_shape = shape;
  target_shape.erase(target_shape.begin() + 1);
  const int64_t c = shape[1];
  std::vector<double> t(static_cast<size_t>(NumElements(target_shape)));
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<double>((static_cast<int64_t>(i) * 3 + 1) % c);
  t[1] = -100;
  t[t.size() - 2] = -100;
  return FromVector(t, target_shape, {.dtype = DType::kInt64});
}

// One gather and one product per element, in f32 for 16-bit (exact there)
// and in the dtype otherwise, on both devices: ElementwiseTol is ample.
TEST_F(CudaKernelsTest, NllLossForwardAndBackwardMatchCpu) {
  for (const Shape& shape : {Shape{8, 5}, Shape{3, 5, 4}}) {
    Shape target_shape = shape;
    target_shape.erase(target_shape.begin() + 1);
    const Tensor target = NllTargets(shape);
    const Tensor target_gpu = target.To(kGpu);
    for (DType dt : kFloats) {
      for (bool weighted : {false, true}) {
        for (bool scalar_grad : {false, true}) {
          const std::string what = "nll_loss " + ShapeToString(shape) + " " + Name(dt) +
                                   (weighted ? " weighted" : "") + (scalar_grad ? " scalar grad" : " per-element grad");
          // f32 weights and gradients: both sides convert them to dt.
          const Tensor weight = weighted ? UniformOf({shape[1]}, DType::kFloat32, 0.5, 2.0) : Tensor();
          const Tensor weight_gpu = weighted ? weight.To(kGpu) : Tensor();
          const Tensor lp = RandnOf(shape, dt, 2.0);
          const Tensor loss_cpu = Empty(target_shape, {.dtype = dt});
          Cpu().nll_loss_forward(lp, target, weight, -100, loss_cpu);
          // NaN first: an element the kernel does not write fails the comparison.
          const Tensor loss_gpu = Full(target_shape, std::nan(""), {.dtype = dt}).To(kGpu);
          Gpu().nll_loss_forward(lp.To(kGpu), target_gpu, weight_gpu, -100, loss_gpu);
          ExpectClose(loss_cpu, loss_gpu, ElementwiseTol(dt), what + " loss");

          const Tensor grad = scalar_grad ? FromVector({0.25}, {}) : RandnOf(target_shape, DType::kFloat32);
          const Tensor d_cpu = Empty(shape, {.dtype = dt});
          Cpu().nll_loss_backward(target, weight, grad, -100, d_cpu);
          const Tensor d_gpu = Full(shape, std::nan(""), {.dtype = dt}).To(kGpu);
          Gpu().nll_loss_backward(target_gpu, weight_gpu, grad.To(kGpu), -100, d_gpu);
          ExpectClose(d_cpu, d_gpu, ElementwiseTol(dt), what + " dlog_probs");
        }
      }
    }
  }
  // Strided operands: log_probs and dlog_probs as transposed views.
  const Tensor target = NllTargets({8, 5});
  const Tensor weight = UniformOf({5}, DType::kFloat32, 0.5, 2.0);
  const Tensor lp_t = RandnOf({5, 8}, DType::kFloat32);
  const Tensor loss_cpu = Empty({8});
  Cpu().nll_loss_forward(lp_t.Transpose(0, 1), target, weight, -100, loss_cpu);
  const Tensor loss_gpu = Empty({8}, {.device = kGpu});
  Gpu().nll_loss_forward(lp_t.To(kGpu).Transpose(0, 1), target.To(kGpu), weight.To(kGpu), -100, loss_gpu);
  ExpectClose(loss_cpu, loss_gpu, ElementwiseTol(DType::kFloat32), "nll_loss of a transposed view");
  const Tensor grad = RandnOf({8}, DType::kFloat32);
  const Tensor d_cpu = Empty({5, 8});
  Cpu().nll_loss_backward(target, weight, grad, -100, d_cpu.Transpose(0, 1));
  const Tensor d_gpu = Full({5, 8}, std::nan("")).To(kGpu);
  Gpu().nll_loss_backward(target.To(kGpu), weight.To(kGpu), grad.To(kGpu), -100, d_gpu.Transpose(0, 1));
  ExpectClose(d_cpu, d_gpu, ElementwiseTol(DType::kFloat32), "nll_loss_backward into a transposed view");
}

// No samples, and no classes with every target ignored: nothing to read.
TEST_F(CudaKernelsTest, NllLossOnEmptyTensorsMatchesCpu) {
  Gpu().nll_loss_forward(Empty({0, 5}, {.device = kGpu}), Empty({0}, {.dtype = DType::kInt64, .device = kGpu}),
                         Tensor(), -100, Empty({0}, {.device = kGpu}));
  Gpu().nll_loss_backward(Empty({0}, {.dtype = DType::kInt64, .device = kGpu}), Tensor(),
                          FromVector({1.0}, {}).To(kGpu), -100, Empty({0, 5}, {.device = kGpu}));
  const Tensor ignored = Full({2, 3}, -100, {.dtype = DType::kInt64});
  const Tensor loss_cpu = Empty({2, 3});
  Cpu().nll_loss_forward(Empty({2, 0, 3}), ignored, Tensor(), -100, loss_cpu);
  const Tensor loss_gpu = Full({2, 3}, std::nan("")).To(kGpu);
  Gpu().nll_loss_forward(Empty({2, 0, 3}, {.device = kGpu}), ignored.To(kGpu), Tensor(), -100, loss_gpu);
  ExpectClose(loss_cpu, loss_gpu, {0.0, 0.0}, "nll_loss with no classes");
  Gpu().nll_loss_backward(ignored.To(kGpu), Tensor(), FromVector({1.0}, {}).To(kGpu), -100,
                          Empty({2, 0, 3}, {.device = kGpu}));
}

template <typename F>
std::string OutOfRangeOf(F f) {
  return MessageOf<std::out_of_range>(f);
}

TEST_F(CudaKernelsTest, NllLossNamesAnOutOfRangeTargetLikeTheCpu) {
  struct Case {
    Shape shape;
    std::vector<double> target;
    std::string named;
  };
  const Case cases[] = {
      {{3, 5}, {1, 4, -1}, "nll_loss: target -1 (sample 2) is out of range for 5 classes [0, 4]"},
      {{3, 5, 4}, {0, 1, 2, 3, 4, -100, 0, 1, 2, 5, 0, 1}, "nll_loss: target 5 (sample 2, position 1) is out of range"},
  };
  for (const Case& c : cases) {
    Shape target_shape = c.shape;
    target_shape.erase(target_shape.begin() + 1);
    const Tensor target = FromVector(c.target, target_shape, {.dtype = DType::kInt64});
    const Tensor lp = RandnOf(c.shape, DType::kFloat32);
    const Tensor grad = FromVector({1.0}, {});
    const std::string cpu_fwd = OutOfRangeOf(
        [&] { Cpu().nll_loss_forward(lp, target, Tensor(), -100, Empty(target_shape)); });
    const std::string gpu_fwd = OutOfRangeOf([&] {
      Gpu().nll_loss_forward(lp.To(kGpu), target.To(kGpu), Tensor(), -100, Empty(target_shape, {.device = kGpu}));
    });
    EXPECT_NE(cpu_fwd.find(c.named), std::string::npos) << cpu_fwd;
    EXPECT_EQ(gpu_fwd, cpu_fwd);
    const std::string cpu_bwd =
        OutOfRangeOf([&] { Cpu().nll_loss_backward(target, Tensor(), grad, -100, Empty(c.shape)); });
    const std::string gpu_bwd = OutOfRangeOf([&] {
      Gpu().nll_loss_backward(target.To(kGpu), Tensor(), grad.To(kGpu), -100, Empty(c.shape, {.device = kGpu}));
    });
    EXPECT_EQ(cpu_bwd, cpu_fwd);
    EXPECT_EQ(gpu_bwd, cpu_bwd);
  }
}

struct GemmCase {
  int64_t m, k, n;
  bool trans_a, trans_b, strided_c;
  double alpha, beta;
};

// a [M,K] (or a transposed [K,M] buffer), b [K,N] (likewise), c [M,N] (or a
// transposed [N,M] buffer when strided_c).
void CheckGemm(const GemmCase& g, DType dt, Tol tol) {
  const std::string what = "gemm " + std::to_string(g.m) + "x" + std::to_string(g.k) + "x" + std::to_string(g.n) +
                           (g.trans_a ? " aT" : "") + (g.trans_b ? " bT" : "") + (g.strided_c ? " cT" : "") +
                           " " + Name(dt);
  const Tensor a_buf = g.trans_a ? UniformOf({g.k, g.m}, dt, -1, 1) : UniformOf({g.m, g.k}, dt, -1, 1);
  const Tensor b_buf = g.trans_b ? UniformOf({g.n, g.k}, dt, -1, 1) : UniformOf({g.k, g.n}, dt, -1, 1);
  const Tensor c_buf = g.strided_c ? UniformOf({g.n, g.m}, dt, -1, 1) : UniformOf({g.m, g.n}, dt, -1, 1);
  auto view = [](const Tensor& t, bool trans) { return trans ? t.Transpose(0, 1) : t; };
  const Tensor c_cpu = c_buf.Clone();
  Cpu().gemm(view(a_buf, g.trans_a), view(b_buf, g.trans_b), view(c_cpu, g.strided_c), g.alpha, g.beta);
  const Tensor c_gpu = c_buf.To(kGpu);
  Gpu().gemm(view(a_buf.To(kGpu), g.trans_a), view(b_buf.To(kGpu), g.trans_b), view(c_gpu, g.strided_c), g.alpha,
             g.beta);
  ExpectClose(c_cpu, c_gpu, tol, what);
}

TEST_F(CudaKernelsTest, GemmMatchesCpu) {
  const GemmCase cases[] = {
      {1, 1, 1, false, false, false, 1.0, 0.0},      {17, 33, 9, false, false, false, 1.0, 0.0},
      {17, 33, 9, true, false, false, 0.5, 1.0},     {17, 33, 9, false, true, false, 1.0, 1.0},
      {17, 33, 9, true, true, true, -2.0, 0.25},     {64, 784, 512, false, true, false, 1.0, 1.0},
      {512, 64, 784, true, false, false, 1.0, 0.0},  {5, 0, 4, false, false, false, 1.0, 0.5},
      {1, 300, 7, false, false, false, 1.0, 0.0},    {7, 300, 1, false, true, false, 1.0, 0.0}};
  for (const GemmCase& g : cases) {
    // |inputs| <= 1, so each dot product's rounding error is about sqrt(K) * 6e-8.
    const double k_scale = std::sqrt(static_cast<double>(std::max<int64_t>(g.k, 1)));
    CheckGemm(g, DType::kFloat32, {1e-5, 1e-5 * k_scale});
    CheckGemm(g, DType::kFloat64, {1e-12, 1e-12 * k_scale});
  }
  // 16-bit: same 16-bit inputs on both sides, f32 accumulation, one final rounding.
  for (const GemmCase& g : {GemmCase{33, 64, 17, false, true, false, 1.0, 0.0},
                            GemmCase{33, 64, 17, true, false, false, 1.0, 1.0}}) {
    CheckGemm(g, DType::kFloat16, {2e-3, 2e-3});
    CheckGemm(g, DType::kBFloat16, {1e-2, 1e-2});
  }
}

// K = 0 with beta = 0 writes zeros without reading c, as BLAS and the CPU
// do: a NaN already in c (as Empty may leave one) must not come out as
// beta * NaN. c is contiguous, the first 3 columns of a [4, 5] buffer (rows
// 5 apart: the last 2 columns must keep their NaN), or the transpose of a
// [3, 4] buffer (computed in a temporary, then copied in).
TEST_F(CudaKernelsTest, GemmWithEmptyKAndZeroBetaWritesZerosOverNaN) {
  const char* layouts[] = {"contiguous c", "c a column slice", "c transposed"};
  for (DType dt : kFloats) {
    for (int layout = 0; layout < 3; ++layout) {
      const std::string what = "gemm 4x0x3 beta 0 over NaN, " + std::string(layouts[layout]) + " " + Name(dt);
      const Shape buf_shape = layout == 0 ? Shape{4, 3} : layout == 1 ? Shape{4, 5} : Shape{3, 4};
      auto view = [&](const Tensor& buf) {
        return layout == 0 ? buf : layout == 1 ? buf.Narrow(1, 0, 3) : buf.Transpose(0, 1);
      };
      const Tensor c_buf = Full(buf_shape, std::nan(""), {.dtype = dt});
      const Tensor c_cpu = c_buf.Clone(), c_gpu = c_buf.To(kGpu);
      Cpu().gemm(Empty({4, 0}, {.dtype = dt}), Empty({0, 3}, {.dtype = dt}), view(c_cpu), 1.0, 0.0);
      for (double v : view(c_cpu).ToVector<double>()) ASSERT_EQ(v, 0.0) << what << ": the CPU's reference changed";
      Gpu().gemm(Empty({4, 0}, {.dtype = dt, .device = kGpu}), Empty({0, 3}, {.dtype = dt, .device = kGpu}),
                 view(c_gpu), 1.0, 0.0);
      // Exact: zeros where c is, NaN (matched as NaN) outside it.
      ExpectClose(c_cpu, c_gpu, {0.0, 0.0}, what);
    }
  }
}

TEST_F(CudaKernelsTest, GemmWithTf32AllowedStaysClose) {
  SetAllowTf32(true);
  // TF32 keeps 10 mantissa bits: relative error per product about 1e-3.
  CheckGemm({128, 256, 64, false, true, false, 1.0, 0.0}, DType::kFloat32, {5e-3, 5e-3 * 16});
  SetAllowTf32(false);
  EXPECT_FALSE(AllowTf32());
}

}  // namespace
}  // namespace ddp::nn::cuda
