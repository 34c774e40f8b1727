// Every differentiable op's backward against central finite differences in
// f64, including broadcast, strided and non-contiguous inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "nn/autograd/engine.h"

#include "nn/ops/functional.h"
#include "nn/ops/gradcheck.h"
#include "nn/tensor/testing/host_as_device.h"

namespace ddp::nn::ops {
namespace {

using testing::GradCheck;
using testing::RandomLeaf;
using V = std::vector<Tensor>;

// The message of the std::invalid_argument fn throws, or "" when none.
template <typename Fn>
std::string ErrorOf(Fn fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// A non-contiguous leaf: the transpose of a random [cols, rows] tensor.
Tensor TransposedLeaf(int64_t rows, int64_t cols, uint64_t seed) {
  Tensor t = RandomLeaf({cols, rows}, seed, false).Transpose(0, 1);
  t.set_requires_grad(true);
  return t;
}

// A leaf whose last dimension has stride 2 (every other element of a wider tensor).
Tensor StridedLeaf(const Shape& shape, uint64_t seed) {
  Shape wide = shape;
  wide.back() *= 2;
  Tensor t = RandomLeaf(wide, seed, false).Slice(-1, 0, wide.back(), 2);
  t.set_requires_grad(true);
  return t;
}

// Entries pushed away from zero, for functions with a kink there.
Tensor AwayFromZero(const Shape& shape, uint64_t seed) {
  Tensor t = RandomLeaf(shape, seed, false);
  double* p = t.data<double>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] += p[i] >= 0 ? 0.1 : -0.1;
  t.set_requires_grad(true);
  return t;
}

Tensor Positive(const Shape& shape, uint64_t seed) {
  Tensor t = RandomLeaf(shape, seed, false);
  double* p = t.data<double>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = 0.5 + std::fabs(p[i]);
  t.set_requires_grad(true);
  return t;
}

TEST(GradCheckTest, BinaryOpsWithBroadcasting) {
  for (auto op : {&Add, &Sub, &Mul, &Div}) {
    auto f = [op](const V& in) { return op(in[0], in[1]); };
    EXPECT_TRUE(GradCheck(f, {RandomLeaf({3, 4}, 1), RandomLeaf({3, 4}, 2)}));
    EXPECT_TRUE(GradCheck(f, {RandomLeaf({3, 4}, 3), Positive({4}, 4)}));
    EXPECT_TRUE(GradCheck(f, {RandomLeaf({2, 1, 4}, 5), Positive({3, 1}, 6)}));
    EXPECT_TRUE(GradCheck(f, {TransposedLeaf(3, 4, 7), Positive({3, 4}, 8)}));
    EXPECT_TRUE(GradCheck(f, {StridedLeaf({2, 3}, 9), Positive({2, 3}, 10)}));
  }
}

// AddRelu's sums are kept away from 0, where ReLU has no derivative.
TEST(GradCheckTest, AddReluWithBroadcasting) {
  auto f = [](const V& in) { return AddRelu(in[0], in[1]); };
  auto small = [](const Shape& shape, uint64_t seed) {
    Tensor t = RandomLeaf(shape, seed, false);
    double* p = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] *= 0.01;
    t.set_requires_grad(true);
    return t;
  };
  EXPECT_TRUE(GradCheck(f, {AwayFromZero({3, 4}, 21), small({3, 4}, 22)}));
  EXPECT_TRUE(GradCheck(f, {AwayFromZero({3, 4}, 23), small({4}, 24)}));
  EXPECT_TRUE(GradCheck(f, {small({2, 1, 4}, 25), AwayFromZero({3, 4}, 26)}));
}

// AddRelu is Relu(Add) bit for bit, forward and backward, in every
// floating dtype (NaN kept, ties at 0 cut), and refuses integers.
TEST(GradCheckTest, AddReluMatchesReluOfAdd) {
  for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dt));
    const std::vector<double> av = {1.5, -2.0, 0.25, -0.25, NAN, 3.0, -1.0, 0.0};
    const std::vector<double> bv = {-0.5, 1.0, -0.25, 0.5, 1.0, -4.0, 1.0, -0.0};
    auto leaf = [&](const std::vector<double>& v) {
      Tensor t = FromVector(v, {2, 4}).To(dt);
      t.set_requires_grad(true);
      return t;
    };
    const Tensor a1 = leaf(av), b1 = leaf(bv), a2 = leaf(av), b2 = leaf(bv);
    const Tensor fused = AddRelu(a1, b1), plain = Relu(Add(a2, b2));
    const Tensor g = FromVector({1, 2, 3, 4, 5, 6, 7, 8}, {2, 4}).To(dt);
    Backward(Sum(Mul(fused, g)));
    Backward(Sum(Mul(plain, g)));
    for (const auto& [x, y, what] : {std::tuple{fused, plain, "output"}, std::tuple{a1.grad(), a2.grad(), "a.grad"},
                                     std::tuple{b1.grad(), b2.grad(), "b.grad"}}) {
      const Tensor xf = x.Detach().To(DType::kFloat64), yf = y.Detach().To(DType::kFloat64);
      for (int64_t i = 0; i < 8; ++i) {
        const double u = xf.data<double>()[i], v = yf.data<double>()[i];
        EXPECT_TRUE(u == v || (std::isnan(u) && std::isnan(v))) << what << "[" << i << "]: " << u << " vs " << v;
      }
    }
  }
  const Tensor i = FromVector({1, 2}, {2}).To(DType::kInt32);
  EXPECT_EQ(ErrorOf([&] { AddRelu(i, i); }), "AddRelu: needs floating tensors, got i32 and i32");
}

// Binary ops' errors name the op in full and the operands' shapes. Before,
// AddRelu's broadcast error said "Add:" and an undefined operand gave
// "binary op on an undefined tensor".
TEST(GradCheckTest, BinaryOpErrorsNameTheOpAndShapes) {
  const Tensor a = Ones({2, 3}), b = Ones({4});
  EXPECT_EQ(ErrorOf([&] { AddRelu(a, b); }),
            "AddRelu: shapes [2, 3] and [4] cannot be broadcast together (dimension 1: 3 vs 4)");
  EXPECT_EQ(ErrorOf([&] { Add(a, b); }),
            "Add: shapes [2, 3] and [4] cannot be broadcast together (dimension 1: 3 vs 4)");
  EXPECT_EQ(ErrorOf([&] { Div(b, a); }),
            "Div: shapes [4] and [2, 3] cannot be broadcast together (dimension 1: 4 vs 3)");
  EXPECT_EQ(ErrorOf([&] { AddRelu(Tensor(), a); }), "AddRelu: operand a is undefined (a: undefined, b: [2, 3])");
  EXPECT_EQ(ErrorOf([&] { Mul(a, Tensor()); }), "Mul: operand b is undefined (a: [2, 3], b: undefined)");
  EXPECT_EQ(ErrorOf([&] { Sub(Tensor(), Tensor()); }),
            "Sub: operands a and b are undefined (a: undefined, b: undefined)");
}

TEST(GradCheckTest, ScalarAndUnaryOps) {
  EXPECT_TRUE(GradCheck([](const V& in) { return AddScalar(in[0], 2.5); }, {RandomLeaf({5}, 1)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return MulScalar(in[0], -1.5); }, {TransposedLeaf(2, 3, 2)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Neg(in[0]); }, {RandomLeaf({4}, 3)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Relu(in[0]); }, {AwayFromZero({3, 4}, 4)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Relu(in[0]); }, {StridedLeaf({3, 4}, 5)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Gelu(in[0]); }, {TransposedLeaf(3, 4, 6)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Gelu(in[0], true); }, {RandomLeaf({3, 4}, 7)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Sigmoid(in[0]); }, {StridedLeaf({2, 5}, 8)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Tanh(in[0]); }, {TransposedLeaf(4, 2, 9)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Exp(in[0]); }, {RandomLeaf({6}, 10)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Log(in[0]); }, {Positive({6}, 11)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Sqrt(in[0]); }, {Positive({6}, 12)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Square(in[0]); }, {TransposedLeaf(3, 3, 13)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Abs(in[0]); }, {AwayFromZero({7}, 14)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Log1p(in[0]); }, {Positive({6}, 15)}));
  // (-0.5, 0.5): log1p's domain reaches below 0.
  Tensor half_range = MulScalar(RandomLeaf({2, 4}, 16, false), 0.5).Transpose(0, 1);
  half_range.set_requires_grad(true);
  EXPECT_TRUE(GradCheck([](const V& in) { return Log1p(in[0]); }, {half_range}));
}

// Clamp's gradient is 1 inside the bounds and 0 outside; entries are kept
// 0.05 or more from each bound, where the finite difference steps over none.
TEST(GradCheckTest, Clamp) {
  const auto leaf = [](const std::vector<double>& v, const Shape& shape) {
    return FromVector(v, shape, {.dtype = DType::kFloat64, .requires_grad = true});
  };
  const Tensor x = leaf({-0.9, -0.35, -0.2, 0.1, 0.35, 0.45, 0.8, -0.6}, {2, 4});
  EXPECT_TRUE(GradCheck([](const V& in) { return Clamp(in[0], -0.3, 0.4); }, {x}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Clamp(in[0], -0.3, std::nullopt); }, {x}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Clamp(in[0], std::nullopt, 0.4); }, {x}));
  // min > max: max everywhere, no gradient.
  EXPECT_TRUE(GradCheck([](const V& in) { return Clamp(in[0], 0.5, -0.5); }, {x}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Clamp(in[0], -0.3, 0.4); }, {StridedLeaf({3, 4}, 17)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Clamp(in[0], -0.25, 0.25); }, {TransposedLeaf(3, 5, 18)}));
}

// A clamp needs a bound, and a NaN bound (PyTorch returns NaN everywhere) is
// refused rather than passed on.
TEST(GradCheckTest, ClampRefusesNoBoundAndANaNBound) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor x = Ones({3});
  EXPECT_EQ(ErrorOf([&] { Clamp(x, std::nullopt, std::nullopt); }),
            "Clamp: at least one of min and max must be given");
  EXPECT_EQ(ErrorOf([&] { Clamp(x, nan, 1.0); }),
            "Clamp: min is NaN (PyTorch would make every element NaN; pass no bound instead)");
  EXPECT_EQ(ErrorOf([&] { Clamp(x, std::nullopt, nan); }),
            "Clamp: max is NaN (PyTorch would make every element NaN; pass no bound instead)");
  EXPECT_EQ(ErrorOf([&] { Clamp(Tensor(), 0.0, 1.0); }), "Clamp: undefined input");
  EXPECT_EQ(ErrorOf([&] { Log1p(Ones({3}, {.dtype = DType::kInt64})); }), "Log1p: needs a floating tensor, got i64");
}

// On a device whose table has no clamp kernel, the error names the op and
// the device (host memory stands in for cuda:0, in a child process).
TEST(GradCheckTest, ClampOnADeviceWithoutTheKernelIsNamed) {
  EXPECT_EXIT(
      {
        nn::testing::RegisterHostAsCuda();
        ops::KernelTable table = ops::KernelsFor(DeviceType::kCPU);
        table.clamp = nullptr;
        ops::RegisterKernels(DeviceType::kCUDA, table);
        const Tensor x = Ones({3}).To(Device(DeviceType::kCUDA, 0));
        std::string error;
        try {
          Clamp(x, 0.0, 0.5);
        } catch (const std::exception& e) {
          error = e.what();
        }
        std::fprintf(stderr, "error: [%s]\n", error.c_str());
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "error: \\[op `clamp` has no kernel for device cuda:0");
}

// ops::Slice, the differentiable x[..., start:end:step] that Tensor::Slice
// sends a tensor with history to: values and gradients (of sum(y * w), w
// counting up from 0 over y) as PyTorch 1.13 gives them, and the same
// refusals as Tensor::Slice.
TEST(GradCheckTest, SliceMatchesPyTorchSlicingWithItsGradient) {
  struct Case {
    int64_t dim, start, end, step;
    Shape shape;
    std::vector<double> values, grad;
  };
  const Case cases[] = {
      // x[:, 1::2]
      {1, 1, 4, 2, {3, 2}, {1, 3, 5, 7, 9, 11}, {0, 0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5}},
      // x[-2:]
      {0, -2, 3, 1, {2, 4}, {4, 5, 6, 7, 8, 9, 10, 11}, {0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7}},
      // x[:, -10:100:3]: both ends clamped to the dimension
      {-1, -10, 100, 3, {3, 2}, {0, 3, 4, 7, 8, 11}, {0, 0, 0, 1, 2, 0, 0, 3, 4, 0, 0, 5}},
      // x[1:1]: empty
      {0, 1, 1, 1, {0, 4}, {}, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
  };
  for (const Case& c : cases) {
    Tensor x = Arange(12, {.dtype = DType::kFloat64}).View({3, 4}).Detach();
    x.set_requires_grad(true);
    const Tensor y = Slice(x, c.dim, c.start, c.end, c.step);
    EXPECT_EQ(y.shape(), c.shape);
    EXPECT_EQ(y.ToVector<double>(), c.values);
    const Tensor w = Arange(y.numel(), {.dtype = DType::kFloat64}).View(y.shape());
    Backward(Sum(Mul(y, w)));
    EXPECT_EQ(x.grad().ToVector<double>(), c.grad);
  }
  Tensor x = Ones({3, 4}, {.requires_grad = true});
  EXPECT_THROW(Slice(x, 1, 0, 4, 0), std::invalid_argument);
  EXPECT_THROW(Slice(x, 1, 0, 4, -1), std::invalid_argument);
  EXPECT_THROW(Slice(x, 2, 0, 4), std::out_of_range);
  EXPECT_THROW(Slice(Tensor(), 0, 0, 1), std::invalid_argument);
}

// A dimension or index out of range, or a shape that does not fit, in a
// view op names the op (the tensor member only said "dimension -3 out of
// range for a 2-d tensor ..." or "shape [5, -1] is invalid for 12
// elements"), and so does an undefined input; the ranges are PyTorch's
// ([-2, 1] for a dim of a 2-d tensor, [-3, 2] for Unsqueeze's).
TEST(GradCheckTest, ViewOpsNameThemselvesInARangeError) {
  const Tensor x = Ones({3, 4}, {.requires_grad = true});
  const std::pair<const char*, std::function<Tensor()>> calls[] = {
      {"Squeeze", [&] { return Squeeze(x, -3); }},
      {"Unsqueeze", [&] { return Unsqueeze(x, -4); }},
      {"Transpose", [&] { return Transpose(x, 0, 2); }},
      {"Permute", [&] { return Permute(x, {0, -3}); }},
      {"Flatten", [&] { return Flatten(x, 2); }},
      {"Narrow", [&] { return Narrow(x, 2, 0, 1); }},
      {"Narrow", [&] { return Narrow(x, 0, -4, 1); }},
      {"Select", [&] { return Select(x, -3, 0); }},
      {"Select", [&] { return Select(x, 0, 3); }},
      {"Slice", [&] { return Slice(x, 2, 0, 1); }},
  };
  for (const auto& [op, call] : calls) {
    try {
      call();
      ADD_FAILURE() << op << " accepted an out-of-range argument";
    } catch (const std::out_of_range& e) {
      EXPECT_EQ(std::string(e.what()).rfind(std::string(op) + ": ", 0), 0u) << e.what();
    }
  }
  // A shape that does not fit, or a -1 that cannot be inferred (PyTorch
  // refuses [-1, 0] for 0 elements as ambiguous), also names the op.
  const Tensor empty = Ones({0, 3}, {.requires_grad = true});
  const std::pair<const char*, std::function<Tensor()>> shapes[] = {
      {"Reshape", [&] { return Reshape(x, {5, -1}); }},
      {"Reshape", [&] { return Reshape(empty, {-1, 0}); }},
      {"Reshape", [&] { return Reshape(x, {-1, -1}); }},
      {"View", [&] { return View(x, {13}); }},
      {"Expand", [&] { return Expand(x, {-1, 3, 4}); }},
  };
  for (const auto& [op, call] : shapes) {
    try {
      call();
      ADD_FAILURE() << op << " accepted a shape that does not fit";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind(std::string(op) + ": ", 0), 0u) << e.what();
    }
  }
  // An undefined input is refused naming the op (Detach named only itself).
  const Tensor none;
  const std::pair<const char*, std::function<Tensor()>> undefined[] = {
      {"View", [&] { return View(none, {1}); }},
      {"Reshape", [&] { return Reshape(none, {1}); }},
      {"Flatten", [&] { return Flatten(none); }},
      {"Unsqueeze", [&] { return Unsqueeze(none, 0); }},
      {"Squeeze", [&] { return Squeeze(none, 0); }},
      {"Transpose", [&] { return Transpose(none, 0, 1); }},
      {"Permute", [&] { return Permute(none, {0}); }},
      {"Narrow", [&] { return Narrow(none, 0, 0, 1); }},
      {"Slice", [&] { return Slice(none, 0, 0, 1); }},
      {"Select", [&] { return Select(none, 0, 0); }},
      {"Expand", [&] { return Expand(none, {2}); }},
      {"Contiguous", [&] { return Contiguous(none); }},
      {"Clone", [&] { return Clone(none); }},
  };
  for (const auto& [op, call] : undefined) {
    try {
      call();
      ADD_FAILURE() << op << " accepted an undefined input";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), std::string(op) + ": input is undefined");
    } catch (const std::exception& e) {
      ADD_FAILURE() << op << " threw an unclear " << e.what();
    }
  }
  EXPECT_EQ(Reshape(empty, {-1}).shape(), (Shape{0}));
  EXPECT_EQ(Reshape(x, {2, -1}).shape(), (Shape{2, 6}));
  // In range, negative ones included, as PyTorch takes them.
  EXPECT_EQ(Squeeze(Unsqueeze(x, -3), -3).shape(), (Shape{3, 4}));
  EXPECT_EQ(Transpose(x, -1, -2).shape(), (Shape{4, 3}));
  EXPECT_EQ(Select(x, -1, -4).shape(), (Shape{3}));
  EXPECT_EQ(Narrow(x, -1, -1, 1).shape(), (Shape{3, 1}));
}

TEST(GradCheckTest, ShapeOps) {
  EXPECT_TRUE(GradCheck([](const V& in) { return View(in[0], {4, 3}); }, {RandomLeaf({2, 6}, 1)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Reshape(in[0], {12}); }, {TransposedLeaf(3, 4, 2)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Flatten(in[0], 1); }, {RandomLeaf({2, 3, 4}, 3)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Mul(Transpose(in[0], 0, 1), in[1]); },
                        {RandomLeaf({3, 4}, 4), RandomLeaf({4, 3}, 5)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Square(Permute(in[0], {2, 0, 1})); }, {RandomLeaf({2, 3, 4}, 6)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Square(Narrow(in[0], 1, 1, 2)); }, {TransposedLeaf(3, 4, 7)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Square(Select(in[0], 0, 1)); }, {RandomLeaf({3, 4}, 8)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Square(Slice(in[0], -1, 1, 4, 2)); }, {TransposedLeaf(3, 4, 15)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Unsqueeze(in[0], 1); }, {RandomLeaf({3, 4}, 9)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Squeeze(in[0], 1); }, {RandomLeaf({3, 1, 4}, 10)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Mul(Expand(in[0], {2, 3, 4}), in[1]); },
                        {RandomLeaf({3, 1}, 11), RandomLeaf({2, 3, 4}, 12)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Square(Contiguous(in[0])); }, {TransposedLeaf(3, 4, 13)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Clone(in[0]); }, {StridedLeaf({3, 2}, 14)}));
}

TEST(GradCheckTest, Reductions) {
  EXPECT_TRUE(GradCheck([](const V& in) { return Sum(in[0]); }, {TransposedLeaf(3, 4, 1)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Sum(in[0], {0, 2}); }, {RandomLeaf({2, 3, 4}, 2)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Sum(in[0], {-1}, true); }, {StridedLeaf({3, 4}, 3)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Mean(in[0]); }, {RandomLeaf({5, 2}, 4)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return Mean(in[0], {1}); }, {TransposedLeaf(3, 4, 5)}));
}

TEST(GradCheckTest, MatmulAndLinear) {
  auto mm = [](const V& in) { return Matmul(in[0], in[1]); };
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({3, 4}, 1), RandomLeaf({4, 5}, 2)}));
  EXPECT_TRUE(GradCheck(mm, {TransposedLeaf(3, 4, 3), TransposedLeaf(4, 2, 4)}));
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({2, 3, 4}, 5), RandomLeaf({4, 2}, 6)}));
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({2, 3, 4}, 7), RandomLeaf({2, 4, 5}, 8)}));
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({4}, 9), RandomLeaf({4, 3}, 10)}));
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({3, 4}, 11), RandomLeaf({4}, 12)}));
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({4}, 13), RandomLeaf({4}, 14)}));
  EXPECT_TRUE(GradCheck(mm, {StridedLeaf({3, 4}, 15), RandomLeaf({4, 2}, 16)}));
  // Broadcast batch dimensions, as torch.matmul (attention's 4-D products).
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({2, 3, 2, 4}, 28), RandomLeaf({2, 3, 4, 2}, 29)}));
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({1, 3, 4}, 30), RandomLeaf({2, 4, 5}, 31)}));
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({3, 4}, 32), RandomLeaf({2, 4, 5}, 33)}));
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({4}, 34), RandomLeaf({2, 4, 5}, 35)}));
  EXPECT_TRUE(GradCheck(mm, {RandomLeaf({2, 1, 3, 4}, 36), RandomLeaf({3, 4, 2}, 37)}));
  auto lin = [](const V& in) { return Linear(in[0], in[1], in[2]); };
  EXPECT_TRUE(GradCheck(lin, {RandomLeaf({5, 4}, 17), RandomLeaf({3, 4}, 18), RandomLeaf({3}, 19)}));
  EXPECT_TRUE(GradCheck(lin, {RandomLeaf({2, 5, 4}, 20), RandomLeaf({3, 4}, 21), RandomLeaf({3}, 22)}));
  EXPECT_TRUE(GradCheck(lin, {TransposedLeaf(5, 4, 23), TransposedLeaf(3, 4, 24), Tensor()}));
  EXPECT_TRUE(GradCheck(lin, {StridedLeaf({5, 4}, 25), RandomLeaf({3, 4}, 26), RandomLeaf({3}, 27, false)}));
}

// Broadcast batches give each pair's product: c[i][j] = a[i][0] @ b[j].
TEST(MatmulTest, BroadcastBatchesGiveEachPairsProduct) {
  Generator gen(5);
  const Tensor a = Randn({2, 1, 3, 4}, {}, gen), b = Randn({3, 4, 2}, {}, gen);
  const Tensor c = Matmul(a, b);
  ASSERT_EQ(c.shape(), (Shape{2, 3, 3, 2}));
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_EQ(c.Select(0, i).Select(0, j).Contiguous().ToVector<float>(),
                Matmul(a.Select(0, i).Select(0, 0), b.Select(0, j)).ToVector<float>());
    }
  }
  EXPECT_EQ(Matmul(Randn({4}, {}, gen), Randn({2, 4, 5}, {}, gen)).shape(), (Shape{2, 5}));
  EXPECT_THROW(Matmul(Randn({2, 3, 4}), Randn({3, 4, 5})), std::invalid_argument);
  EXPECT_THROW(Matmul(Randn({2, 3, 4}), Randn({2, 3, 5})), std::invalid_argument);
  // A vector operand is named as given, not with the dimension matmul adds.
  auto message = [](const Tensor& x, const Tensor& y) -> std::string {
    try {
      Matmul(x, y);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(message(Randn({3}), Randn({2, 4, 5})), "matmul: shapes [3] and [2, 4, 5] do not match (3 against 4)");
  EXPECT_EQ(message(Randn({2, 4, 5}), Randn({3})), "matmul: shapes [2, 4, 5] and [3] do not match (5 against 3)");
  EXPECT_EQ(message(Randn({3}), Randn({4, 5})), "matmul: shapes [3] and [4, 5] do not match (3 against 4)");
  // A batch against a matrix is named as given, not with its batch folded into the rows.
  EXPECT_EQ(message(Randn({2, 3, 4}), Randn({5, 6})), "matmul: shapes [2, 3, 4] and [5, 6] do not match (4 against 5)");
  EXPECT_EQ(message(Randn({3, 4}), Randn({5, 6})), "matmul: shapes [3, 4] and [5, 6] do not match (4 against 5)");
}

struct ConvCase {
  Shape x, w;
  Conv2dParams p;
  bool bias;
};

TEST(GradCheckTest, Conv2dGeometries) {
  const ConvCase cases[] = {
      {{2, 3, 6, 6}, {4, 3, 3, 3}, {}, true},
      {{1, 2, 7, 6}, {3, 2, 3, 2}, {.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1}, true},
      {{2, 2, 7, 7}, {2, 2, 3, 3}, {.pad_h = 2, .pad_w = 2, .dilation_h = 2, .dilation_w = 2}, false},
      {{2, 4, 5, 5}, {6, 2, 3, 3}, {.pad_h = 1, .pad_w = 1, .groups = 2}, true},
      {{2, 4, 4, 4}, {4, 1, 3, 3}, {.stride_h = 1, .stride_w = 2, .pad_h = 1, .pad_w = 0, .groups = 4}, true},
      {{3, 4, 3, 3}, {5, 4, 1, 1}, {}, true},                             // pointwise
      {{2, 4, 5, 5}, {3, 4, 1, 1}, {.stride_h = 2, .stride_w = 2}, false},  // strided pointwise
  };
  for (const ConvCase& c : cases) {
    auto f = [&c](const V& in) { return Conv2d(in[0], in[1], in[2], c.p); };
    EXPECT_TRUE(GradCheck(f, {RandomLeaf(c.x, 1), RandomLeaf(c.w, 2), c.bias ? RandomLeaf({c.w[0]}, 3) : Tensor()}))
        << ShapeToString(c.x) << " * " << ShapeToString(c.w);
  }
  // A non-contiguous input (channels-last memory seen as NCHW).
  Tensor x = RandomLeaf({2, 5, 5, 3}, 4, false).Permute({0, 3, 1, 2});
  x.set_requires_grad(true);
  EXPECT_TRUE(GradCheck([](const V& in) { return Conv2d(in[0], in[1], in[2], {.pad_h = 1, .pad_w = 1}); },
                        {x, RandomLeaf({2, 3, 3, 3}, 5), RandomLeaf({2}, 6)}));
}

TEST(GradCheckTest, Pooling) {
  const Pool2dParams cases[] = {
      {.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2},
      {.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1},
      {.kernel_h = 2, .kernel_w = 3, .stride_h = 2, .stride_w = 1, .ceil_mode = true},
      {.kernel_h = 2, .kernel_w = 2, .stride_h = 1, .stride_w = 1, .dilation_h = 2, .dilation_w = 2},
  };
  for (const Pool2dParams& p : cases) {
    // Distinct values so that the max is unique and the gradient well defined.
    Tensor x = RandomLeaf({2, 3, 7, 6}, 1, false);
    double* d = x.data<double>();
    for (int64_t i = 0; i < x.numel(); ++i) d[i] = d[i] + 0.01 * static_cast<double>(i % 37);
    x.set_requires_grad(true);
    EXPECT_TRUE(GradCheck([&p](const V& in) { return MaxPool2d(in[0], p); }, {x}));
    if (p.dilation_h == 1) {
      Pool2dParams q = p;
      EXPECT_TRUE(GradCheck([&q](const V& in) { return AvgPool2d(in[0], q); }, {RandomLeaf({2, 3, 7, 6}, 2)}));
      q.count_include_pad = false;
      EXPECT_TRUE(GradCheck([&q](const V& in) { return AvgPool2d(in[0], q); }, {RandomLeaf({2, 3, 7, 6}, 3)}));
    }
  }
  Tensor strided = RandomLeaf({2, 3, 7, 12}, 4, false).Slice(3, 0, 12, 2);
  strided.set_requires_grad(true);
  EXPECT_TRUE(GradCheck([](const V& in) {
    return AvgPool2d(in[0], {.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1});
  }, {strided}));
  EXPECT_TRUE(GradCheck([](const V& in) { return AdaptiveAvgPool2d(in[0], 3, 2); }, {RandomLeaf({2, 3, 7, 5}, 5)}));
  EXPECT_TRUE(GradCheck([](const V& in) { return AdaptiveAvgPool2d(in[0], 1, 1); }, {RandomLeaf({2, 3, 4, 4}, 6)}));
}

// PyTorch 1.13 takes an output size of 0 in either axis: an empty output,
// and a backward that gives the input a zero gradient (an empty batch too).
// A negative size is refused naming it. Before, 0 was refused as well
// ("output size must be positive").
TEST(GradCheckTest, AdaptiveAvgPool2dToAnEmptyOutputGivesAZeroGradient) {
  for (const auto& [oh, ow] : {std::pair<int64_t, int64_t>{0, 0}, {0, 3}, {2, 0}}) {
    SCOPED_TRACE(std::to_string(oh) + "x" + std::to_string(ow));
    const Tensor x = RandomLeaf({2, 3, 5, 4}, 7);
    const Tensor y = AdaptiveAvgPool2d(x, oh, ow);
    EXPECT_EQ(y.shape(), (Shape{2, 3, oh, ow}));
    Backward(Sum(y));
    ASSERT_TRUE(x.grad().defined());
    EXPECT_EQ(x.grad().shape(), x.shape());
    EXPECT_EQ(x.grad().ToVector<double>(), std::vector<double>(static_cast<size_t>(x.numel()), 0.0));
    const Tensor empty_batch = Zeros({0, 3, 5, 4});
    EXPECT_EQ(AdaptiveAvgPool2d(empty_batch, oh, ow).shape(), (Shape{0, 3, oh, ow}));
  }
  const Tensor x = Zeros({1, 1, 4, 4});
  EXPECT_EQ(ErrorOf([&] { AdaptiveAvgPool2d(x, -1, 2); }),
            "adaptive_avg_pool2d: output size must not be negative, got (-1, 2)");
  EXPECT_EQ(ErrorOf([&] { AdaptiveAvgPool2d(x, 0, -3); }),
            "adaptive_avg_pool2d: output size must not be negative, got (0, -3)");
}

TEST(GradCheckTest, BatchNormTrainingAndEval) {
  for (bool training : {true, false}) {
    for (const Shape& shape : {Shape{6, 3}, Shape{4, 3, 5}, Shape{2, 3, 4, 3}}) {
      auto f = [training](const V& in) {
        Tensor rm = Zeros({3}, {.dtype = DType::kFloat64}), rv = Ones({3}, {.dtype = DType::kFloat64});
        rm.Fill(0.1);
        rv.Fill(1.5);
        return BatchNorm(in[0], rm, rv, in[1], in[2], training, 0.1, 1e-5);
      };
      EXPECT_TRUE(GradCheck(f, {RandomLeaf(shape, 1), RandomLeaf({3}, 2), RandomLeaf({3}, 3)}))
          << ShapeToString(shape) << " training " << training;
    }
  }
  // No affine parameters, no running statistics, non-contiguous input.
  Tensor x = RandomLeaf({3, 4, 5}, 4, false).Permute({1, 0, 2});
  x.set_requires_grad(true);
  EXPECT_TRUE(GradCheck([](const V& in) { return BatchNorm(in[0], Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5); },
                        {x}));
}

// LayerNorm over one and two trailing dimensions, with weight and bias,
// weight alone, neither, and a non-contiguous input.
TEST(GradCheckTest, LayerNorm) {
  for (const Shape& normalized : {Shape{5}, Shape{3, 5}}) {
    EXPECT_TRUE(GradCheck([&normalized](const V& in) { return LayerNorm(in[0], normalized, in[1], in[2], 1e-4); },
                          {RandomLeaf({2, 3, 5}, 1), RandomLeaf(normalized, 2), RandomLeaf(normalized, 3)}))
        << ShapeToString(normalized);
  }
  EXPECT_TRUE(GradCheck([](const V& in) { return LayerNorm(in[0], {4}, in[1], Tensor()); },
                        {RandomLeaf({3, 4}, 4), RandomLeaf({4}, 5)}));
  Tensor x = RandomLeaf({4, 3, 2}, 6, false).Permute({2, 1, 0});
  x.set_requires_grad(true);
  EXPECT_TRUE(GradCheck([](const V& in) { return LayerNorm(in[0], {3, 4}, Tensor(), Tensor()); }, {x}));
}

// Embedding's weight gradient, with a non-contiguous i32 index tensor
// (with a padding row that is not looked up: where one is, its gradient is
// zero by definition, not the lookup's derivative).
TEST(GradCheckTest, Embedding) {
  const Tensor idx = FromVectorOf<int64_t>({0, 2, 2, 1, 3, 2}, {2, 3}).To(DType::kInt32).Transpose(0, 1);
  EXPECT_TRUE(GradCheck([&idx](const V& in) { return Embedding(in[0], idx); }, {RandomLeaf({4, 3}, 1)}));
  EXPECT_TRUE(GradCheck([&idx](const V& in) { return Embedding(in[0], idx, 4); }, {RandomLeaf({5, 3}, 2)}));
}

// A negative padding_idx counts from the table's end, as in
// torch.nn.functional.embedding and the Embedding module: -1 is the last
// row, whose gradient stays zero (before, the op refused it as out of
// range).
TEST(GradCheckTest, EmbeddingsNegativePaddingIdxCountsFromTheEnd) {
  const Tensor weight = FromVector({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {5, 2}, {.dtype = DType::kFloat64, .requires_grad = true});
  const Tensor idx = FromVectorOf<int64_t>({4, 1, 4}, {3});
  const Tensor out = Embedding(weight, idx, -1);
  EXPECT_EQ(out.ToVector<double>(), (std::vector<double>{8, 9, 2, 3, 8, 9}));
  Backward(Sum(out));
  EXPECT_EQ(weight.grad().ToVector<double>(), (std::vector<double>{0, 0, 1, 1, 0, 0, 0, 0, 0, 0}));
}

TEST(GradCheckTest, Conv1dGeometries) {
  const Conv1dParams geometries[] = {{}, {.stride = 2, .pad = 1}, {.stride = 1, .pad = 2, .dilation = 2},
                                     {.stride = 3, .pad = 0, .dilation = 1, .groups = 2}};
  for (const Conv1dParams& p : geometries) {
    EXPECT_TRUE(GradCheck([&p](const V& in) { return Conv1d(in[0], in[1], in[2], p); },
                          {RandomLeaf({2, 4, 9}, 1), RandomLeaf({6, 4 / p.groups, 3}, 2), RandomLeaf({6}, 3)}))
        << "stride " << p.stride << " pad " << p.pad << " dilation " << p.dilation << " groups " << p.groups;
  }
}

// An unbatched [C, L] input, which PyTorch 1.13's F.conv1d takes: the
// values of a batch of one without its batch dimension, and its gradients
// (before, the op refused a 2-D input).
TEST(GradCheckTest, Conv1dOfAnUnbatchedInput) {
  const Conv1dParams p{.stride = 2, .pad = 1, .dilation = 1, .groups = 2};
  const Tensor x = RandomLeaf({4, 9}, 1), w = RandomLeaf({6, 2, 3}, 2), b = RandomLeaf({6}, 3);
  const Tensor y = Conv1d(x, w, b, p);
  EXPECT_EQ(y.shape(), (Shape{6, 5}));
  EXPECT_EQ(y.ToVector<double>(), Conv1d(Unsqueeze(x, 0), w, b, p).ToVector<double>());
  EXPECT_TRUE(GradCheck([&p](const V& in) { return Conv1d(in[0], in[1], in[2], p); }, {x, w, b}));
}

// The functional forms' refusals, each naming the op and what is wrong.
TEST(GradCheckTest, LayerNormEmbeddingAndConv1dRefusalsNameTheOp) {
  const Tensor x = Zeros({2, 3, 4});
  EXPECT_EQ(ErrorOf([&] { LayerNorm(x, {4, 3}, Tensor(), Tensor()); }),
            "layer_norm: expected input [*, 4, 3] (normalized_shape [4, 3]), got [2, 3, 4]");
  EXPECT_EQ(ErrorOf([&] { LayerNorm(x, {}, Tensor(), Tensor()); }),
            "layer_norm: normalized_shape must have at least one dimension, got []");
  EXPECT_EQ(ErrorOf([&] { LayerNorm(x, {4}, Ones({3}), Tensor()); }),
            "layer_norm: weight of shape [3] for normalized_shape [4]");
  EXPECT_EQ(ErrorOf([&] { LayerNorm(x, {4}, Tensor(), Ones({4, 1})); }),
            "layer_norm: bias of shape [4, 1] for normalized_shape [4]");
  EXPECT_EQ(ErrorOf([&] { LayerNorm(x, {4}, Tensor(), Tensor(), -1.0); }),
            "layer_norm: eps must be finite and > 0, got -1");
  EXPECT_EQ(ErrorOf([&] { LayerNorm(x, {4}, Tensor(), Tensor(), -1e-9); }),
            "layer_norm: eps must be finite and > 0, got -1e-09");
  EXPECT_EQ(ErrorOf([&] { LayerNorm(x, {4}, Tensor(), Tensor(), std::nan("")); }),
            "layer_norm: eps must be finite and > 0, got nan");
  const Tensor table = Zeros({5, 2}), idx = FromVectorOf<int64_t>({1}, {1});
  EXPECT_EQ(ErrorOf([&] { Embedding(table, idx, 5); }), "embedding: padding_idx must be in [-5, 5), got 5");
  EXPECT_EQ(ErrorOf([&] { Embedding(table, idx, -6); }), "embedding: padding_idx must be in [-5, 5), got -6");
  EXPECT_EQ(ErrorOf([&] { Embedding(Zeros({5}), idx); }),
            "embedding: weight must be [num_embeddings, embedding_dim], got [5]");
  EXPECT_EQ(ErrorOf([&] { Embedding(Zeros({5, 2}, {.dtype = DType::kInt64}), idx); }),
            "embedding: weight must be floating, got i64");
  const Tensor seq = Zeros({2, 4, 6});
  EXPECT_EQ(ErrorOf([&] { Conv1d(seq, Zeros({8, 4, 3, 1}), Tensor()); }),
            "conv1d: weight must be [O, C/groups, K], got [8, 4, 3, 1]");
  EXPECT_EQ(ErrorOf([&] { Conv1d(seq, Zeros({8, 3, 3}), Tensor()); }),
            "conv1d: expected input [N, 3, L] or [3, L], got [2, 4, 6]");
  EXPECT_EQ(ErrorOf([&] { Conv1d(Zeros({6}), Zeros({8, 4, 3}), Tensor()); }),
            "conv1d: expected input [N, 4, L] or [4, L], got [6]");
  EXPECT_EQ(ErrorOf([&] { Conv1d(Zeros({4, 2}), Zeros({8, 4, 3}), Tensor()); }),
            "conv1d: input [4, 2] is shorter than the kernel [8, 4, 3] with stride 1, padding 0, dilation 1");
  EXPECT_EQ(ErrorOf([&] { Conv1d(seq, Zeros({8, 4, 3}), Zeros({7})); }),
            "conv1d: bias of shape [7] for 8 output channels");
  EXPECT_EQ(ErrorOf([&] { Conv1d(Zeros({2, 4, 6}), Zeros({0, 2, 3}), Tensor(), {.groups = 2}); }),
            "conv1d: groups 2 is more than the weight's 0 output channels [0, 2, 3]");
  EXPECT_EQ(ErrorOf([&] { Conv1d(Zeros({2, 4, 6}), Zeros({3, 2, 3}), Tensor(), {.groups = 2}); }),
            "conv1d: 3 output channels are not divisible by 2 groups");
  EXPECT_EQ(ErrorOf([&] { Conv1d(seq, Zeros({8, 4, 3}), Tensor(), {.pad = -1}); }),
            "conv1d: pad must be at least 0, got -1");
}

// A channel of tiny variance (invstd near 1/sqrt(eps), about 316) in f32:
// y is (x - mean) * scale + b, so f32 stays within a few f32 ulps of the
// same inputs in f64. The form x * scale + (b - mean * scale) added two terms
// hundreds of times larger than y and was off by up to 7e-5 here; at a
// variance of 0 it did not even return the bias.
TEST(BatchNormPartsTest, F32StaysExactWhenAChannelsVarianceIsTiny) {
  const int64_t c = 4096;
  const Tensor x64 = Empty({2, c}, {.dtype = DType::kFloat64});
  NormalFill(x64, 1.5, 2.0);
  const Tensor x = x64.To(DType::kFloat32);
  Tensor w = Empty({c}, {.dtype = DType::kFloat64}), b = Empty({c}, {.dtype = DType::kFloat64});
  NormalFill(w, 0.0, 1.0);
  NormalFill(b, 0.0, 1.0);
  w = w.To(DType::kFloat32);
  b = b.To(DType::kFloat32);
  const std::vector<double> y32 = BatchNorm(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5).ToVector<double>();
  const std::vector<double> y64 =
      BatchNorm(x.To(DType::kFloat64), Tensor(), Tensor(), w.To(DType::kFloat64), b.To(DType::kFloat64), true, 0.1,
                1e-5)
          .ToVector<double>();
  double worst = 0;
  for (size_t i = 0; i < y32.size(); ++i) worst = std::max(worst, std::abs(y32[i] - y64[i]) / (1 + std::abs(y64[i])));
  EXPECT_LT(worst, 2e-6);

  // Each channel at its own mean (variance 0, as one sample per channel on
  // one rank of SyncBatchNorm): y is the bias exactly.
  const Tensor row = x.Narrow(0, 0, 1);
  const Tensor mean = row.Reshape({c}).To(DType::kFloat64);
  const Tensor invstd = Full({c}, 1 / std::sqrt(1e-5), {.dtype = DType::kFloat64});
  EXPECT_EQ(BatchNormElementwise(row, mean, invstd, w, b).ToVector<double>(), b.ToVector<double>());

  // An infinite mean (eval mode with an infinite running mean) gives
  // -inf * scale + b, as before the mean was split into hi + lo, not NaN.
  const Tensor rm = Full({c}, HUGE_VAL), rv = Full({c}, 1.0);
  const std::vector<double> y = BatchNorm(x, rm, rv, w, b, false, 0.1, 1e-5).ToVector<double>();
  const std::vector<double> wv = w.ToVector<double>();
  for (int64_t i = 0; i < c; ++i) {
    if (wv[i] == 0) continue;
    ASSERT_EQ(y[i], wv[i] > 0 ? -HUGE_VAL : HUGE_VAL) << "channel " << i;
  }
}

// The blocks SyncBatchNorm composes name an undefined statistic (or input)
// they cannot do without; it failed inside the kernel's read, naming none.
TEST(BatchNormPartsTest, AnUndefinedStatisticIsNamed) {
  const Tensor x = Randn({4, 3}), dy = Randn({4, 3});
  const Tensor mean = Zeros({3}, {.dtype = DType::kFloat64}), invstd = Ones({3}, {.dtype = DType::kFloat64});
  auto message = [](auto call) -> std::string {
    try {
      call();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no std::invalid_argument";
  };
  EXPECT_EQ(message([&] { BatchNormElementwise(x, Tensor(), invstd, Tensor(), Tensor()); }),
            "batch_norm_elementwise: mean is undefined");
  EXPECT_EQ(message([&] { BatchNormElementwise(x, mean, Tensor(), Tensor(), Tensor()); }),
            "batch_norm_elementwise: invstd is undefined");
  EXPECT_EQ(message([&] { BatchNormBackwardReduce(dy, x, mean, Tensor()); }),
            "batch_norm_backward_reduce: invstd is undefined");
  EXPECT_EQ(message([&] { BatchNormBackwardReduce(Tensor(), x, mean, invstd); }),
            "batch_norm_backward_reduce: dy is undefined");
  EXPECT_EQ(message([&] { BatchNormBackwardElementwise(dy, x, mean, invstd, Tensor(), mean, Tensor()); }),
            "batch_norm_backward_elementwise: mean_dy_xhat is undefined");
  EXPECT_EQ(message([&] { BatchNormStats(Tensor()); }), "batch_norm_stats: x is undefined");
  // Without weight and bias (affine off) the blocks still run.
  EXPECT_EQ(BatchNormElementwise(x, mean, invstd, Tensor(), Tensor()).shape(), x.shape());
}

// A channel mean large against its spread (1e7 and 3): f32 dx and dweight
// stay close to the same inputs in f64, through BatchNorm's backward and
// through the backward blocks SyncBatchNorm composes. Both kernels rounded
// the mean to f32 before x - mean (f32's step at 1e7 is 1, so x - mean
// moved by up to 0.5) where the forward already split it into hi + lo; dx
// was then off by 2e-3 of its largest value here, 6e-8 with the split.
TEST(BatchNormPartsTest, F32BackwardFollowsF64AtALargeChannelMean) {
  const int64_t n = 64, c = 8, s = 3;
  Generator gen(17);
  const Tensor x64 = Empty({n, c, s}, {.dtype = DType::kFloat64});
  const Tensor dy64 = Empty({n, c, s}, {.dtype = DType::kFloat64});
  const Tensor w64 = Empty({c}, {.dtype = DType::kFloat64}), b64 = Empty({c}, {.dtype = DType::kFloat64});
  NormalFill(x64, 1e7, 3.0, gen);
  NormalFill(dy64, 0.0, 1.0, gen);
  NormalFill(w64, 1.0, 0.5, gen);
  NormalFill(b64, 0.0, 1.0, gen);
  // The f32 values, and exactly the same values in f64.
  const Tensor x32 = x64.To(DType::kFloat32), dy32 = dy64.To(DType::kFloat32);
  const Tensor w32 = w64.To(DType::kFloat32), b32 = b64.To(DType::kFloat32);
  // Largest |a - b| against the largest |b|.
  auto rel = [](const Tensor& a, const Tensor& b) {
    const std::vector<double> u = a.ToVector<double>(), v = b.ToVector<double>();
    double d = 0, m = 0;
    for (size_t i = 0; i < u.size(); ++i) {
      d = std::max(d, std::abs(u[i] - v[i]));
      m = std::max(m, std::abs(v[i]));
    }
    return d / m;
  };
  // BatchNorm's own backward: dx and dweight of x and w in dtype dt.
  auto grads = [&](DType dt) {
    const Tensor x = x32.To(dt).Clone().set_requires_grad(true), w = w32.To(dt).Clone().set_requires_grad(true);
    Backward(BatchNorm(x, Tensor(), Tensor(), w, b32.To(dt), true, 0.1, 1e-5), dy32.To(dt));
    return std::make_pair(x.grad(), w.grad());
  };
  const auto [dx32, dw32] = grads(DType::kFloat32);
  const auto [dx64, dw64] = grads(DType::kFloat64);
  EXPECT_LT(rel(dx32, dx64), 1e-6);
  EXPECT_LT(rel(dw32, dw64), 1e-6);

  // The blocks, with the f64 statistics of the whole batch (one rank's).
  const BatchNormSums stats = BatchNormStats(x32.To(DType::kFloat64));
  const double count = n * s;
  std::vector<double> mean(c), invstd(c);
  const std::vector<double> sum = stats.sum.ToVector<double>(), xv = x32.ToVector<double>();
  for (int64_t ch = 0; ch < c; ++ch) mean[ch] = sum[ch] / count;
  std::vector<double> m2(c, 0.0);
  for (int64_t i = 0; i < n * c * s; ++i) {
    const int64_t ch = (i / s) % c;
    m2[ch] += (xv[i] - mean[ch]) * (xv[i] - mean[ch]);
  }
  for (int64_t ch = 0; ch < c; ++ch) invstd[ch] = 1 / std::sqrt(m2[ch] / count + 1e-5);
  const Tensor mt = FromVector(mean, {c}, {.dtype = DType::kFloat64});
  const Tensor it = FromVector(invstd, {c}, {.dtype = DType::kFloat64});
  auto block_dx = [&](DType dt) {
    const Tensor x = x32.To(dt), dy = dy32.To(dt);
    const BatchNormSums g = BatchNormBackwardReduce(dy, x, mt, it);
    const Tensor mean_dy = MulScalar(g.sum, 1 / count), mean_dy_xhat = MulScalar(g.sum_sq, 1 / count);
    return std::make_pair(BatchNormBackwardElementwise(dy, x, mt, it, w32.To(dt), mean_dy, mean_dy_xhat), g.sum_sq);
  };
  const auto [bdx32, bdw32] = block_dx(DType::kFloat32);
  const auto [bdx64, bdw64] = block_dx(DType::kFloat64);
  EXPECT_LT(rel(bdx32, bdx64), 1e-6);
  EXPECT_LT(rel(bdw32, bdw64), 1e-6);
}

// One running statistic without the other is refused, in training and in
// eval, and the given one is left as it was. Before, training took it and
// updated neither.
TEST(GradCheckTest, BatchNormRefusesOneRunningStatisticWithoutTheOther) {
  const Tensor x = RandomLeaf({4, 3}, 1, false);
  const Tensor rm = Zeros({3}, {.dtype = DType::kFloat64}), rv = Ones({3}, {.dtype = DType::kFloat64});
  for (bool training : {true, false}) {
    SCOPED_TRACE(training);
    EXPECT_EQ(ErrorOf([&] { BatchNorm(x, rm, Tensor(), Tensor(), Tensor(), training, 0.1, 1e-5); }),
              "batch_norm: running_mean [3] is given without running_var: pass both running statistics or neither");
    EXPECT_EQ(ErrorOf([&] { BatchNorm(x, Tensor(), rv, Tensor(), Tensor(), training, 0.1, 1e-5); }),
              "batch_norm: running_var [3] is given without running_mean: pass both running statistics or neither");
  }
  EXPECT_EQ(rm.ToVector<double>(), std::vector<double>(3, 0.0));
  EXPECT_EQ(rv.ToVector<double>(), std::vector<double>(3, 1.0));
}

// eps must keep 1/sqrt(var + eps) finite, and momentum weigh an update:
// NaN, zero or negative eps and momentum outside [0, 1] are refused, naming
// the value, before the running statistics change.
TEST(GradCheckTest, BatchNormRefusesABadEpsOrMomentum) {
  const Tensor x = RandomLeaf({4, 3}, 1, false);
  const Tensor rm = Zeros({3}, {.dtype = DType::kFloat64}), rv = Ones({3}, {.dtype = DType::kFloat64});
  for (double eps : {0.0, -1e-5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    const std::string error = ErrorOf([&] { BatchNorm(x, rm, rv, Tensor(), Tensor(), true, 0.1, eps); });
    EXPECT_EQ(error.rfind("batch_norm: eps must be finite and > 0, got ", 0), 0u) << eps << ": " << error;
  }
  for (double momentum : {-0.1, 1.5, std::nan("")}) {
    const std::string error = ErrorOf([&] { BatchNorm(x, rm, rv, Tensor(), Tensor(), true, momentum, 1e-5); });
    EXPECT_EQ(error.rfind("batch_norm: momentum must be in [0, 1], got ", 0), 0u) << momentum << ": " << error;
  }
  // The refused value is shown with the digits that tell it apart:
  // std::to_string's six decimals showed an eps of -1e-9 as "-0.000000" and
  // a momentum of 1.0000001 as "1.000000", a value the check accepts.
  EXPECT_EQ(ErrorOf([&] { BatchNorm(x, rm, rv, Tensor(), Tensor(), true, 0.1, -1e-9); }),
            "batch_norm: eps must be finite and > 0, got -1e-09");
  EXPECT_EQ(ErrorOf([&] { BatchNorm(x, rm, rv, Tensor(), Tensor(), true, 0.1, std::nan("")); }),
            "batch_norm: eps must be finite and > 0, got nan");
  EXPECT_EQ(ErrorOf([&] { BatchNorm(x, rm, rv, Tensor(), Tensor(), true, 1.0000001, 1e-5); }),
            "batch_norm: momentum must be in [0, 1], got 1.0000001");
  EXPECT_EQ(ErrorOf([&] { BatchNorm(x, rm, rv, Tensor(), Tensor(), true, -0.5, 1e-5); }),
            "batch_norm: momentum must be in [0, 1], got -0.5");
  EXPECT_EQ(rm.ToVector<double>(), std::vector<double>(3, 0.0));
  EXPECT_EQ(rv.ToVector<double>(), std::vector<double>(3, 1.0));
  EXPECT_EQ(ErrorOf([&] { BatchNorm(x, rm, rv, Tensor(), Tensor(), true, 1.0, 1e-5); }), "");
  // Nothing weighs an update in eval, or without running statistics: the
  // momentum is unused there, and not checked.
  EXPECT_EQ(ErrorOf([&] { BatchNorm(x, rm, rv, Tensor(), Tensor(), false, std::nan(""), 1e-5); }), "");
  EXPECT_EQ(ErrorOf([&] { BatchNorm(x, Tensor(), Tensor(), Tensor(), Tensor(), true, 2.0, 1e-5); }), "");
}

// dy of another dtype or shape than x is refused by both backward blocks,
// naming both. Before, only the reduce checked the shape: a smaller dy or an
// f32 dy for f64 x was read past its end.
TEST(BatchNormPartsTest, BackwardBlocksRefuseADyUnlikeX) {
  const Tensor x = RandomLeaf({4, 3, 2}, 1, false);
  const Tensor stat = Ones({3}, {.dtype = DType::kFloat64});
  const Tensor f32_dy = Ones({4, 3, 2}, {.dtype = DType::kFloat32});
  const Tensor short_dy = Ones({2, 3, 2}, {.dtype = DType::kFloat64});
  EXPECT_EQ(ErrorOf([&] { BatchNormBackwardReduce(f32_dy, x, stat, stat); }),
            "batch_norm_backward_reduce: dy has dtype f32, x f64 (expected the same dtype)");
  EXPECT_EQ(ErrorOf([&] { BatchNormBackwardElementwise(f32_dy, x, stat, stat, stat, stat, stat); }),
            "batch_norm_backward_elementwise: dy has dtype f32, x f64 (expected the same dtype)");
  EXPECT_EQ(ErrorOf([&] { BatchNormBackwardElementwise(short_dy, x, stat, stat, stat, stat, stat); }),
            "batch_norm_backward_elementwise: dy [2, 3, 2] vs x [4, 3, 2] (expected the same shape)");
  EXPECT_EQ(ErrorOf([&] { BatchNormBackwardReduce(short_dy, x, stat, stat); }),
            "batch_norm_backward_reduce: dy [2, 3, 2] vs x [4, 3, 2] (expected the same shape)");
}

// SyncBatchNorm's recipe on two simulated ranks (halves of the batch):
// local sums, combined; elementwise parts with the global statistics. It
// must equal BatchNorm on the whole batch, forward and backward.
TEST(BatchNormPartsTest, TwoHalvesComposeToWholeBatch) {
  Tensor x = RandomLeaf({6, 3, 4, 2}, 1, false);
  Tensor w = RandomLeaf({3}, 2, false), b = RandomLeaf({3}, 3, false);
  Tensor dy = RandomLeaf({6, 3, 4, 2}, 4, false);
  const double eps = 1e-5;
  // Reference: BatchNorm on all 6 samples.
  Tensor xr = x.Clone(), wr = w.Clone(), br = b.Clone();
  for (Tensor* t : {&xr, &wr, &br}) t->set_requires_grad(true);
  Tensor yr = BatchNorm(xr, Tensor(), Tensor(), wr, br, true, 0.1, eps);
  Backward(yr, dy);
  // Two ranks with 2 and 4 samples (unequal local batches).
  const Tensor parts[2] = {x.Narrow(0, 0, 2), x.Narrow(0, 2, 4)};
  const Tensor dparts[2] = {dy.Narrow(0, 0, 2), dy.Narrow(0, 2, 4)};
  std::vector<double> sum(3, 0), sq(3, 0);
  for (const Tensor& p : parts) {
    const BatchNormSums s = BatchNormStats(p);
    for (int c = 0; c < 3; ++c) {
      sum[c] += s.sum.ToVector<double>()[c];
      sq[c] += s.sum_sq.ToVector<double>()[c];
    }
  }
  const double count = 6 * 4 * 2;
  std::vector<double> mean(3), invstd(3);
  for (int c = 0; c < 3; ++c) {
    mean[c] = sum[c] / count;
    invstd[c] = 1 / std::sqrt(sq[c] / count - mean[c] * mean[c] + eps);
  }
  const Tensor mt = FromVector(mean, {3}, {.dtype = DType::kFloat64});
  const Tensor it = FromVector(invstd, {3}, {.dtype = DType::kFloat64});
  std::vector<double> sdy(3, 0), sdx(3, 0);
  for (int r = 0; r < 2; ++r) {
    const Tensor y = BatchNormElementwise(parts[r], mt, it, w, b);
    EXPECT_LT(Sum(Abs(Sub(y, yr.Detach().Narrow(0, r == 0 ? 0 : 2, r == 0 ? 2 : 4)))).Item(), 1e-10);
    const BatchNormSums g = BatchNormBackwardReduce(dparts[r], parts[r], mt, it);
    for (int c = 0; c < 3; ++c) {
      sdy[c] += g.sum.ToVector<double>()[c];
      sdx[c] += g.sum_sq.ToVector<double>()[c];
    }
  }
  EXPECT_NEAR(sdy[1], br.grad().ToVector<double>()[1], 1e-10);  // db = sum(dy)
  EXPECT_NEAR(sdx[2], wr.grad().ToVector<double>()[2], 1e-10);  // dw = sum(dy * xhat)
  std::vector<double> mdy(3), mdx(3);
  for (int c = 0; c < 3; ++c) {
    mdy[c] = sdy[c] / count;
    mdx[c] = sdx[c] / count;
  }
  for (int r = 0; r < 2; ++r) {
    const Tensor dx = BatchNormBackwardElementwise(dparts[r], parts[r], mt, it, w,
                                                   FromVector(mdy, {3}, {.dtype = DType::kFloat64}),
                                                   FromVector(mdx, {3}, {.dtype = DType::kFloat64}));
    EXPECT_LT(Sum(Abs(Sub(dx, xr.grad().Narrow(0, r == 0 ? 0 : 2, r == 0 ? 2 : 4)))).Item(), 1e-10);
  }
}

TEST(GradCheckTest, Softmax) {
  for (int64_t dim : {0, 1, -1}) {
    EXPECT_TRUE(GradCheck([dim](const V& in) { return LogSoftmax(in[0], dim); }, {RandomLeaf({3, 4, 2}, 1)}));
    EXPECT_TRUE(GradCheck([dim](const V& in) { return Softmax(in[0], dim); }, {TransposedLeaf(3, 4, 2)}));
  }
}

TEST(GradCheckTest, DropoutUsesItsMask) {
  Tensor x = RandomLeaf({200}, 1);
  Generator gen(5);
  Tensor y = Dropout(x, 0.3, true, gen);
  Backward(Sum(y));
  const std::vector<double> xv = x.ToVector<double>(), yv = y.ToVector<double>(), g = x.grad().ToVector<double>();
  int kept = 0;
  for (size_t i = 0; i < xv.size(); ++i) {
    if (yv[i] != 0) {
      ++kept;
      EXPECT_NEAR(yv[i], xv[i] / 0.7, 1e-12);
      EXPECT_NEAR(g[i], 1 / 0.7, 1e-12);
    } else {
      EXPECT_EQ(g[i], 0.0);
    }
  }
  EXPECT_GT(kept, 110);
  EXPECT_LT(kept, 170);
  EXPECT_TRUE(Dropout(x, 0.3, false).is_same(x));  // eval: identity
}

// A probability outside [0, 1] is refused, NaN included. Before, NaN passed
// the check (p < 0 || p > 1) and scaled the kept elements by NaN.
TEST(GradCheckTest, DropoutRefusesAProbabilityOutsideZeroToOne) {
  const Tensor x = Ones({8});
  EXPECT_EQ(ErrorOf([&] { Dropout(x, std::nan(""), true); }), "Dropout: probability must be in [0, 1], got nan");
  EXPECT_EQ(ErrorOf([&] { Dropout(x, -0.1, true); }), "Dropout: probability must be in [0, 1], got -0.1");
  EXPECT_EQ(ErrorOf([&] { Dropout(x, 1.5, false); }), "Dropout: probability must be in [0, 1], got 1.5");
  // std::to_string showed these as "-0.000000" and "1.000000".
  EXPECT_EQ(ErrorOf([&] { Dropout(x, -1e-9, true); }), "Dropout: probability must be in [0, 1], got -1e-09");
  EXPECT_EQ(ErrorOf([&] { Dropout(x, 1.0000001, true); }),
            "Dropout: probability must be in [0, 1], got 1.0000001");
  EXPECT_EQ(ErrorOf([&] { Dropout(x, 1.0, true); }), "");
}

// A bias of another dtype than the weight, made by an op (a bf16 product for
// an f32 layer), gets its gradient in its own dtype. Before, Linear and
// Conv2d handed back an f32 gradient and MulBackward refused it
// ("binary: dtypes bf16 and f32 differ").
TEST(GradCheckTest, BiasOfAnotherDtypeGetsItsGradientInThatDtype) {
  const TensorOptions bf16 = {.dtype = DType::kBFloat16};
  Tensor b16 = Ones({3}, {.dtype = DType::kBFloat16, .requires_grad = true});
  const Tensor s16 = FromVector({1, 2, 3}, {3}, bf16);
  Tensor w = Ones({3, 4}, {.requires_grad = true});
  Backward(Sum(Linear(Ones({2, 4}), w, Mul(b16, s16))));
  ASSERT_TRUE(b16.grad().defined());
  EXPECT_EQ(b16.grad().dtype(), DType::kBFloat16);
  EXPECT_EQ(b16.grad().ToVector<float>(), (std::vector<float>{2, 4, 6}));  // two rows, times s16
  EXPECT_EQ(w.grad().dtype(), DType::kFloat32);

  Tensor c16 = Ones({3}, {.dtype = DType::kBFloat16, .requires_grad = true});
  Tensor cw = Ones({3, 2, 1, 1}, {.requires_grad = true});
  Backward(Sum(Conv2d(Ones({1, 2, 2, 2}), cw, Mul(c16, s16))));
  ASSERT_TRUE(c16.grad().defined());
  EXPECT_EQ(c16.grad().dtype(), DType::kBFloat16);
  EXPECT_EQ(c16.grad().ToVector<float>(), (std::vector<float>{4, 8, 12}));  // four positions, times s16
}

// Integer operands are refused by name. Before, Conv2d with an i64 weight
// returned an i64 output, and Linear converted an i64 input or bias to the
// weight's dtype without a word.
TEST(GradCheckTest, LinearAndConv2dRefuseIntegerOperands) {
  const TensorOptions i64 = {.dtype = DType::kInt64};
  EXPECT_EQ(ErrorOf([&] { Linear(Ones({2, 4}, i64), Ones({3, 4}), Tensor()); }),
            "linear: input must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { Linear(Ones({2, 4}), Ones({3, 4}, i64), Tensor()); }),
            "linear: weight must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { Linear(Ones({2, 4}), Ones({3, 4}), Ones({3}, i64)); }),
            "linear: bias must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { Conv2d(Ones({1, 2, 3, 3}, i64), Ones({3, 2, 1, 1}), Tensor()); }),
            "conv2d: input must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { Conv2d(Ones({1, 2, 3, 3}), Ones({3, 2, 1, 1}, i64), Tensor()); }),
            "conv2d: weight must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { Conv2d(Ones({1, 2, 3, 3}), Ones({3, 2, 1, 1}), Ones({3}, i64)); }),
            "conv2d: bias must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { Linear(Ones({2, 4}), Ones({3, 4}), Ones({3}, {.dtype = DType::kBFloat16})); }), "");
}

// A bias on another device than the weight is refused, naming the bias.
// Before, Linear copied it into the output across devices. Run in a child
// process, so that the fake cuda backend reaches no other test.
TEST(GradCheckTest, LinearRefusesABiasOnAnotherDevice) {
  EXPECT_EXIT(
      {
        nn::testing::RegisterHostAsCuda();  // tensors "on cuda:0" without a GPU
        const Tensor bias = Ones({3}).To(Device(DeviceType::kCUDA, 0));
        std::fprintf(stderr, "error: [%s]\n", ErrorOf([&] { Linear(Ones({2, 4}), Ones({3, 4}), bias); }).c_str());
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "error: \\[linear: bias is on cuda:0, weight on cpu \\(expected one device\\)\\]");
}

// An integer tensor is refused with its dtype named, by Dropout before any
// mask is drawn. Before, log_softmax gave no dtype and Dropout drew a mask
// (advancing the generator) before masked_scale refused the tensor.
TEST(GradCheckTest, IntegerTensorsAreRefusedWithTheirDtype) {
  const Tensor x = Ones({2, 3}, {.dtype = DType::kInt64});
  EXPECT_EQ(ErrorOf([&] { LogSoftmax(x, 1); }), "log_softmax: needs a floating tensor, got i64");
  Generator gen(5), fresh(5);
  EXPECT_EQ(ErrorOf([&] { Dropout(x, 0.5, true, gen); }), "Dropout: input must be floating, got i64");
  EXPECT_TRUE(Dropout(x, 0.5, false, gen).is_same(x));  // eval: the identity, any dtype
  EXPECT_EQ(Dropout(Ones({64}), 0.5, true, gen).ToVector<double>(),
            Dropout(Ones({64}), 0.5, true, fresh).ToVector<double>());  // gen was not advanced
}

TEST(GradCheckTest, MixedPrecisionCastFlowsGradientBack) {
  Tensor w = Ones({4}, {.dtype = DType::kBFloat16, .requires_grad = true});
  Tensor x = FromVector({1, 2, 3, 4}, {4});
  Tensor y = Mul(w, x);  // bf16 * f32 -> f32
  EXPECT_EQ(y.dtype(), DType::kFloat32);
  Backward(Sum(y));
  EXPECT_EQ(w.grad().dtype(), DType::kBFloat16);
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{1, 2, 3, 4}));
}

// GradCheck perturbs an input's elements in place, so an input whose
// elements alias (an expanded view) or alias another input's would move
// several at once: it is refused by index, not reported as a wrong gradient.
TEST(GradCheckTest, AliasedInputsAreRefusedByIndex) {
  Tensor expanded = RandomLeaf({1, 3}, 41, false).Expand({4, 3});
  expanded.set_requires_grad(true);
  const auto square = [](const V& in) { return Mul(in[0], in[0]); };
  const ::testing::AssertionResult r = GradCheck(square, {expanded});
  EXPECT_FALSE(r);
  EXPECT_NE(std::string(r.message()).find("input 0 (shape [4, 3], strides [0, 1]) has elements that share memory"),
            std::string::npos)
      << r.message();

  const Tensor base = RandomLeaf({2, 3}, 42, false);
  Tensor whole = base.Narrow(0, 0, 2), row = base.Narrow(0, 1, 1);
  whole.set_requires_grad(true);
  row.set_requires_grad(true);
  const auto add = [](const V& in) { return Add(in[0], in[1]); };
  const ::testing::AssertionResult shared = GradCheck(add, {whole, row});
  EXPECT_FALSE(shared);
  EXPECT_NE(std::string(shared.message()).find("input 0 shares memory with input 1"), std::string::npos)
      << shared.message();

  // Disjoint parts of one storage are fine.
  Tensor top = base.Narrow(0, 0, 1);
  top.set_requires_grad(true);
  row.set_grad(Tensor());
  EXPECT_TRUE(GradCheck([](const V& in) { return Mul(in[0], in[1]); }, {top, row}));
}

}  // namespace
}  // namespace ddp::nn::ops
