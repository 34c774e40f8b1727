#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>

#include "nn/autograd/engine.h"
#include "nn/loss/loss.h"
#include "nn/modules/init.h"
#include "nn/modules/layers.h"
#include "nn/modules/models.h"
#include "nn/ops/dispatch.h"
#include "nn/ops/functional.h"
#include "nn/ops/gradcheck.h"
#include "nn/tensor/testing/host_as_device.h"

namespace ddp::nn::modules {
namespace {

template <typename Fn>
std::string ErrorOf(Fn fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> Names(const NamedTensors& list) {
  std::vector<std::string> out;
  for (const auto& [n, t] : list) out.push_back(n);
  return out;
}

int64_t Count(const Module& m) {
  int64_t n = 0;
  for (const Tensor& p : m.Parameters()) n += p.numel();
  return n;
}

TEST(ModuleTest, CnnNamesMatchPyTorchSequential) {
  auto cnn = MakeCnn();
  EXPECT_EQ(Names(cnn->NamedParameters()),
            (std::vector<std::string>{"0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias", "9.weight",
                                      "9.bias"}));
  EXPECT_EQ(cnn->NamedParameters()[4].second.shape(), (Shape{128, 1600}));
  auto mlp = MakeMlp();
  EXPECT_EQ(Names(mlp->NamedParameters()),
            (std::vector<std::string>{"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}));
  EXPECT_EQ(Count(*mlp), 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10);
}

// Expected text from PyTorch 1.13's print(model).
TEST(ModuleTest, PrintsLikePyTorch) {
  EXPECT_EQ(MakeCnn()->ToString(),
            "Sequential(\n"
            "  (0): Conv2d(1, 32, kernel_size=(3, 3), stride=(1, 1))\n"
            "  (1): ReLU()\n"
            "  (2): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)\n"
            "  (3): Conv2d(32, 64, kernel_size=(3, 3), stride=(1, 1))\n"
            "  (4): ReLU()\n"
            "  (5): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)\n"
            "  (6): Flatten(start_dim=1, end_dim=-1)\n"
            "  (7): Linear(in_features=1600, out_features=128, bias=True)\n"
            "  (8): ReLU()\n"
            "  (9): Linear(in_features=128, out_features=10, bias=True)\n"
            ")");
  EXPECT_EQ(BatchNorm2d(64).ToString(), "BatchNorm2d(64, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)");
  EXPECT_EQ(GELU().ToString(), "GELU(approximate='none')");
  EXPECT_EQ(Dropout(0.25).ToString(), "Dropout(p=0.25, inplace=False)");
  EXPECT_EQ(AvgPool2d(2).ToString(), "AvgPool2d(kernel_size=2, stride=2, padding=0)");
  EXPECT_EQ(AdaptiveAvgPool2d(1, 1).ToString(), "AdaptiveAvgPool2d(output_size=(1, 1))");
  EXPECT_EQ(Conv2d(4, 8, 3, {.stride = 2, .padding = 1, .groups = 2, .bias = false}).ToString(),
            "Conv2d(4, 8, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), groups=2, bias=False)");
}

// Dropout refuses a probability outside [0, 1] at construction, NaN
// included. Before, NaN passed the check (p < 0 || p > 1).
TEST(ModuleTest, DropoutRefusesAProbabilityOutsideZeroToOne) {
  EXPECT_EQ(ErrorOf([] { Dropout(std::nan("")); }), "Dropout: probability must be in [0, 1], got nan");
  EXPECT_EQ(ErrorOf([] { Dropout(-0.5); }), "Dropout: probability must be in [0, 1], got -0.5");
  EXPECT_EQ(ErrorOf([] { Dropout(1.0); }), "");
}

// Each bad Linear size is named on its own, as Conv2d's channel counts.
// Before, both gave "Linear: negative size (-1, 3)", naming neither.
TEST(ModuleTest, LinearNamesEachBadArgument) {
  EXPECT_EQ(ErrorOf([] { Linear(-1, 3); }), "Linear(-1, 3): in_features must be >= 0, got -1");
  EXPECT_EQ(ErrorOf([] { Linear(4, -2); }), "Linear(4, -2): out_features must be >= 0, got -2");
  EXPECT_EQ(ErrorOf([] { Linear(0, 0); }), "");  // empty, as in PyTorch
}

// Each bad Conv2d argument is named on its own, with its value.
TEST(ModuleTest, Conv2dNamesEachBadArgument) {
  EXPECT_EQ(ErrorOf([] { Conv2d(-1, 8, 3); }), "Conv2d(-1, 8): in_channels must be >= 0, got -1");
  EXPECT_EQ(ErrorOf([] { Conv2d(4, -8, 3); }), "Conv2d(4, -8): out_channels must be >= 0, got -8");
  EXPECT_EQ(ErrorOf([] { Conv2d(4, 8, 3, {.groups = 0}); }), "Conv2d(4, 8): groups must be >= 1, got 0");
  EXPECT_EQ(ErrorOf([] { Conv2d(4, 6, 3, {.groups = 3}); }),
            "Conv2d(4, 6): in_channels (4) must be divisible by groups (3)");
  EXPECT_EQ(ErrorOf([] { Conv2d(6, 4, 3, {.groups = 3}); }),
            "Conv2d(6, 4): out_channels (4) must be divisible by groups (3)");
  EXPECT_EQ(ErrorOf([] { Conv2d(4, 8, 0); }), "Conv2d(4, 8): kernel_size must be >= 1, got 0");
  EXPECT_EQ(ErrorOf([] { Conv2d(4, 8, 3, {.stride = 0}); }), "Conv2d(4, 8): stride must be >= 1, got 0");
  EXPECT_EQ(ErrorOf([] { Conv2d(4, 8, 3, {.padding = -1}); }), "Conv2d(4, 8): padding must be >= 0, got -1");
  // Zero channels are allowed, as in PyTorch.
  EXPECT_EQ(ErrorOf([] { Conv2d(0, 0, 3); }), "");
}

// Bad pooling arguments fail at construction, naming the layer and the
// argument (before, only the first Forward reported them); an explicit
// stride 0 is refused rather than read as stride = kernel_size (PyTorch's
// None, here nullopt).
TEST(ModuleTest, PoolingNamesEachBadArgumentAtConstruction) {
  EXPECT_EQ(ErrorOf([] { MaxPool2d(2, 0); }), "MaxPool2d: stride must be >= 1, got 0");
  EXPECT_EQ(ErrorOf([] { AvgPool2d(2, 0); }), "AvgPool2d: stride must be >= 1, got 0");
  EXPECT_EQ(ErrorOf([] { MaxPool2d(0); }), "MaxPool2d: kernel_size must be >= 1, got 0");
  EXPECT_EQ(ErrorOf([] { AvgPool2d(-1, 1); }), "AvgPool2d: kernel_size must be >= 1, got -1");
  EXPECT_EQ(ErrorOf([] { MaxPool2d(3, 1, 1, 0); }), "MaxPool2d: dilation must be >= 1, got 0");
  EXPECT_EQ(ErrorOf([] { MaxPool2d(3, 1, 2); }), "MaxPool2d: padding must be between 0 and half of kernel_size (3), got 2");
  EXPECT_EQ(ErrorOf([] { AvgPool2d(4, 1, -1); }), "AvgPool2d: padding must be between 0 and half of kernel_size (4), got -1");
  EXPECT_EQ(ErrorOf([] { MaxPool2d(4, 1, 2); }), "");
  EXPECT_EQ(MaxPool2d(3).ToString(), "MaxPool2d(kernel_size=3, stride=3, padding=0, dilation=1, ceil_mode=False)");
  EXPECT_EQ(AvgPool2d(3, std::nullopt, 1).ToString(), "AvgPool2d(kernel_size=3, stride=3, padding=1)");
  EXPECT_EQ(AvgPool2d(3, 1).ToString(), "AvgPool2d(kernel_size=3, stride=1, padding=0)");
}

// A negative output size fails at construction, naming the layer and
// output_size, rather than at the first Forward naming the op.
TEST(ModuleTest, AdaptiveAvgPool2dRefusesANegativeOutputSizeAtConstruction) {
  EXPECT_EQ(ErrorOf([] { AdaptiveAvgPool2d(-1, 1); }), "AdaptiveAvgPool2d: output_size must be >= 0, got (-1, 1)");
  EXPECT_EQ(ErrorOf([] { AdaptiveAvgPool2d(2, -3); }), "AdaptiveAvgPool2d: output_size must be >= 0, got (2, -3)");
  EXPECT_EQ(ErrorOf([] { AdaptiveAvgPool2d(1, 1); }), "");
}

// An output size of 0, as PyTorch 1.13's nn.AdaptiveAvgPool2d takes it: an
// empty output, batched or not, and a zero gradient for the input. Before,
// the constructor refused it ("output_size must be >= 1").
TEST(ModuleTest, AdaptiveAvgPool2dToAnEmptyOutputRunsForwardAndBackward) {
  AdaptiveAvgPool2d pool(0, 2);
  EXPECT_EQ(pool.ToString(), "AdaptiveAvgPool2d(output_size=(0, 2))");
  Tensor x = Ones({2, 3, 4, 5});
  x.set_requires_grad(true);
  const Tensor y = pool.Forward(x);
  EXPECT_EQ(y.shape(), (Shape{2, 3, 0, 2}));
  Backward(ops::Sum(y));
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().shape(), x.shape());
  EXPECT_EQ(x.grad().ToVector<float>(), std::vector<float>(static_cast<size_t>(x.numel()), 0.0f));
  EXPECT_EQ(pool.Forward(Ones({3, 4, 5})).shape(), (Shape{3, 0, 2}));
  EXPECT_EQ(AdaptiveAvgPool2d(3, 0).Forward(Ones({1, 1, 4, 4})).shape(), (Shape{1, 1, 3, 0}));
}

// An unbatched [C, H, W] input (PyTorch 1.13 takes it in these layers)
// gives the batch-of-one result without its batch dimension, and the same
// gradients.
TEST(ModuleTest, ConvAndPoolingTakeAnUnbatchedInput) {
  std::vector<std::shared_ptr<Module>> layers{
      std::make_shared<Conv2d>(3, 4, 3, Conv2dOptions{.stride = 2, .padding = 1}), std::make_shared<MaxPool2d>(2),
      std::make_shared<AvgPool2d>(3, 2, 1), std::make_shared<AdaptiveAvgPool2d>(2, 3)};
  for (const auto& layer : layers) {
    SCOPED_TRACE(layer->TypeName());
    const Tensor data = Rand({3, 7, 6});
    Tensor x3 = data.Detach(), x4 = ops::Unsqueeze(data, 0).Detach();
    x3.set_requires_grad(true);
    x4.set_requires_grad(true);
    const Tensor y3 = layer->Forward(x3), y4 = layer->Forward(x4);
    ASSERT_EQ(y3.dim(), 3);
    EXPECT_EQ(ops::Unsqueeze(y3, 0).shape(), y4.shape());
    EXPECT_EQ(y3.ToVector<float>(), y4.ToVector<float>());
    const Tensor r = Rand(y3.shape());
    Backward(ops::Sum(ops::Mul(y3, r)));
    std::vector<float> param_grads;
    for (const Tensor& p : layer->Parameters()) {
      for (float g : p.grad().ToVector<float>()) param_grads.push_back(g);
    }
    layer->ZeroGrad();
    Backward(ops::Sum(ops::Mul(y4, ops::Unsqueeze(r, 0))));
    ASSERT_TRUE(x3.grad().defined());
    EXPECT_EQ(x3.grad().ToVector<float>(), x4.grad().ToVector<float>());
    std::vector<float> batched_grads;
    for (const Tensor& p : layer->Parameters()) {
      for (float g : p.grad().ToVector<float>()) batched_grads.push_back(g);
    }
    EXPECT_EQ(param_grads, batched_grads);
  }
  EXPECT_EQ(ErrorOf([] { Conv2d(3, 4, 3).Forward(Zeros({2, 7, 7})); }),
            "Conv2d(3->4, 3x3): expected input [N, 3, H, W] or [3, H, W], got [2, 7, 7]");
  EXPECT_EQ(ErrorOf([] { MaxPool2d(2).Forward(Zeros({7, 7})); }), "MaxPool2d: expected input [N, C, H, W] or [C, H, W], got [7, 7]");
}

// Every layer through the module API, in f64, against central finite
// differences: the input's gradient and each parameter's (the parameters
// are GradCheck inputs too, perturbed in place), with the options that
// change the arithmetic (groups, dilation, stride and padding; ceil_mode
// and count_include_pad; an unbatched input; batch norm in training and in
// eval with running statistics it has learnt). Dropout redraws its mask
// each call, so its generator is reseeded before every forward.
TEST(ModuleTest, LayersMatchFiniteDifferencesInF64) {
  struct Case {
    const char* what;
    std::shared_ptr<Module> layer;
    Shape x;
  };
  Generator init(5), dropout_gen(9);
  auto eval_bn = std::make_shared<BatchNorm2d>(3, BatchNormOptions{.momentum = 0.5});
  eval_bn->To(DType::kFloat64);
  eval_bn->Forward(testing::RandomLeaf({4, 3, 2, 2}, 40, false));  // running statistics away from 0 and 1
  eval_bn->Eval();
  // Weight and bias away from their ones and zeros, so that each enters the
  // arithmetic.
  auto layer_norm = std::make_shared<LayerNorm>(Shape{3, 4});
  for (const Tensor& p : layer_norm->Parameters()) Uniform(p, -1.5, 1.5, init);
  const Case cases[] = {
      {"Linear", std::make_shared<Linear>(4, 3, true, init), {2, 5, 4}},
      {"Linear without bias", std::make_shared<Linear>(4, 2, false, init), {3, 4}},
      {"Conv2d", std::make_shared<Conv2d>(4, 6, 3, Conv2dOptions{.stride = 2, .padding = 2, .dilation = 2, .groups = 2},
                                          init),
       {2, 4, 7, 6}},
      {"Conv2d unbatched", std::make_shared<Conv2d>(2, 3, 3, Conv2dOptions{.padding = 1}, init), {2, 5, 4}},
      {"BatchNorm1d", std::make_shared<BatchNorm1d>(3), {4, 3, 2}},
      {"BatchNorm2d", std::make_shared<BatchNorm2d>(3), {2, 3, 3, 2}},
      {"BatchNorm2d in eval", eval_bn, {2, 3, 3, 2}},
      {"BatchNorm2d without running statistics", std::make_shared<BatchNorm2d>(3, BatchNormOptions{
                                                     .affine = false, .track_running_stats = false}),
       {2, 3, 2, 2}},
      {"MaxPool2d", std::make_shared<MaxPool2d>(3, 2, 1, 1, true), {2, 2, 6, 7}},
      {"MaxPool2d dilated", std::make_shared<MaxPool2d>(2, 1, 1, 2), {1, 2, 5, 5}},
      {"AvgPool2d", std::make_shared<AvgPool2d>(3, 2, 1, true, false), {2, 2, 6, 7}},
      {"AvgPool2d counting padding", std::make_shared<AvgPool2d>(2, 2, 1, true, true), {1, 2, 5, 4}},
      {"AdaptiveAvgPool2d", std::make_shared<AdaptiveAvgPool2d>(4, 3), {2, 2, 7, 5}},
      {"ReLU", std::make_shared<ReLU>(), {3, 4}},
      {"GELU", std::make_shared<GELU>(), {3, 4}},
      {"GELU tanh", std::make_shared<GELU>(true), {3, 4}},
      {"Sigmoid", std::make_shared<Sigmoid>(), {3, 4}},
      {"Tanh", std::make_shared<Tanh>(), {3, 4}},
      {"Dropout", std::make_shared<Dropout>(0.4, dropout_gen), {3, 5}},
      {"Flatten", std::make_shared<Flatten>(1, 2), {2, 3, 2, 2}},
      {"LayerNorm over two dimensions", layer_norm, {2, 3, 4}},
      {"LayerNorm without affine", std::make_shared<LayerNorm>(5, 1e-3, false), {3, 5}},
      {"LayerNorm of a single row", std::make_shared<LayerNorm>(6), {6}},
      {"Conv1d", std::make_shared<Conv1d>(4, 6, 3, Conv1dOptions{.stride = 2, .padding = 2, .dilation = 2, .groups = 2},
                                          init),
       {2, 4, 9}},
      {"Conv1d unbatched without bias", std::make_shared<Conv1d>(2, 3, 2, Conv1dOptions{.bias = false}, init), {2, 5}},
  };
  uint64_t seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    c.layer->To(DType::kFloat64);
    std::vector<Tensor> inputs = {testing::RandomLeaf(c.x, seed++)};
    for (const Tensor& p : c.layer->Parameters()) inputs.push_back(p);
    Module& layer = *c.layer;
    EXPECT_TRUE(testing::GradCheck([&layer, &dropout_gen](const std::vector<Tensor>& in) {
      dropout_gen.Seed(9);
      return layer.Forward(in[0]);
    }, inputs));
  }
  // Embedding's input is a tensor of indices, not differentiable: its
  // weight alone is checked, with repeated indices and the padding row
  // among them (its gradient is zero, which the finite difference of a
  // lookup that reads it does not give: it is checked where it is not read).
  for (std::optional<int64_t> padding : {std::optional<int64_t>(), std::optional<int64_t>(4)}) {
    SCOPED_TRACE(padding.has_value() ? "Embedding with padding_idx" : "Embedding");
    Embedding embedding(5, 3, padding, init);
    embedding.To(DType::kFloat64);
    const Tensor indices = FromVectorOf<int64_t>({1, 0, 3, 1, 1, 2}, {2, 3});
    EXPECT_TRUE(testing::GradCheck([&embedding, &indices](const std::vector<Tensor>&) {
      return embedding.Forward(indices);
    }, {embedding.weight()}));
  }
}

// The reference: each row of x [M, D] normalized by its mean and biased
// variance, in f64 loops, then weight[d] * xhat + bias[d].
std::vector<double> LayerNormReference(const std::vector<double>& x, int64_t d, const std::vector<double>& w,
                                       const std::vector<double>& b, double eps) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r * d < x.size(); ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < d; ++i) mean += x[r * d + i] / static_cast<double>(d);
    for (int64_t i = 0; i < d; ++i) var += (x[r * d + i] - mean) * (x[r * d + i] - mean) / static_cast<double>(d);
    for (int64_t i = 0; i < d; ++i) y[r * d + i] = (x[r * d + i] - mean) / std::sqrt(var + eps) * w[i] + b[i];
  }
  return y;
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

// LayerNorm in f64 against the reference loops, over the last one and two
// dimensions, with learnt (non-trivial) weight and bias, a large common
// offset (which a one-pass variance would lose), and in f32.
TEST(ModuleTest, LayerNormMatchesAnF64Reference) {
  Generator gen(3);
  for (const Shape& normalized : {Shape{4}, Shape{3, 4}}) {
    LayerNorm ln(normalized, 1e-3);
    ln.To(DType::kFloat64);
    for (const Tensor& p : ln.Parameters()) Uniform(p, -2, 2, gen);
    Tensor x = testing::RandomLeaf({2, 3, 4}, 11, false);
    x = ops::AddScalar(x, 1e6);
    const int64_t d = NumElements(normalized);
    const std::vector<double> want = LayerNormReference(x.ToVector<double>(), d, ln.weight().ToVector<double>(),
                                                        ln.bias().ToVector<double>(), 1e-3);
    const Tensor y = ln.Forward(x);
    EXPECT_EQ(y.shape(), x.shape());
    ExpectNear(y.ToVector<double>(), want, 1e-9);
    ln.To(DType::kFloat32);
    ExpectNear(ln.Forward(ops::Cast(ops::AddScalar(x, -1e6), DType::kFloat32)).ToVector<double>(),
               LayerNormReference(ops::AddScalar(x, -1e6).ToVector<double>(), d, ln.weight().ToVector<double>(),
                                  ln.bias().ToVector<double>(), 1e-3),
               1e-5);
  }
  // Without affine parameters: zero mean and unit (biased) variance per row.
  LayerNorm plain(5, 1e-5, false);
  EXPECT_TRUE(plain.Parameters().empty());
  const Tensor y = plain.Forward(ops::Cast(testing::RandomLeaf({3, 5}, 4, false), DType::kFloat32));
  ExpectNear(ops::Mean(y, {1}).ToVector<double>(), {0, 0, 0}, 1e-6);
}

// PyTorch 1.13's defaults, names and printed form, and the refusals, each
// naming the layer and what is wrong.
TEST(ModuleTest, LayerNormConstructsPrintsAndRefusesLikePyTorch) {
  LayerNorm ln(Shape{3, 4});
  EXPECT_EQ(Names(ln.GetStateDict()), (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(ln.weight().ToVector<float>(), std::vector<float>(12, 1.0f));
  EXPECT_EQ(ln.bias().ToVector<float>(), std::vector<float>(12, 0.0f));
  EXPECT_EQ(ln.weight().shape(), (Shape{3, 4}));
  EXPECT_EQ(ln.ToString(), "LayerNorm((3, 4), eps=1e-05, elementwise_affine=True)");
  EXPECT_EQ(LayerNorm(5, 1e-3, false).ToString(), "LayerNorm((5,), eps=0.001, elementwise_affine=False)");
  EXPECT_EQ(ErrorOf([] { LayerNorm(Shape{}); }),
            "LayerNorm: normalized_shape must have at least one dimension, got ()");
  EXPECT_EQ(ErrorOf([] { LayerNorm(Shape{3, -1}); }), "LayerNorm: normalized_shape must have sizes >= 0, got (3, -1)");
  EXPECT_EQ(ErrorOf([] { LayerNorm(4, 0.0); }), "LayerNorm: eps must be finite and > 0, got 0");
  EXPECT_EQ(ErrorOf([] { LayerNorm(4, std::nan("")); }), "LayerNorm: eps must be finite and > 0, got nan");
  EXPECT_EQ(ErrorOf([&] { ln.Forward(Zeros({2, 4, 3})); }),
            "LayerNorm((3, 4)): expected input [*, 3, 4] (normalized_shape (3, 4)), got [2, 4, 3]");
  EXPECT_EQ(ErrorOf([&] { ln.Forward(Zeros({4})); }),
            "LayerNorm((3, 4)): expected input [*, 3, 4] (normalized_shape (3, 4)), got [4]");
  EXPECT_EQ(ErrorOf([&] { ln.Forward(Zeros({3, 4}, {.dtype = DType::kInt64})); }),
            "LayerNorm((3, 4)): layer_norm: input must be floating, got i64");
  EXPECT_EQ(ErrorOf([&] { ln.Forward(Tensor()); }), "LayerNorm((3, 4)): input is undefined");
  EXPECT_EXIT(
      {
        nn::testing::RegisterHostAsCuda();  // tensors "on cuda:0" without a GPU
        LayerNorm on_device(4);
        on_device.To(Device(DeviceType::kCUDA, 0));
        const Tensor x = Zeros({2, 4}).To(Device(DeviceType::kCUDA, 0));
        std::fprintf(stderr, "error: [%s]\n", ErrorOf([&] { on_device.Forward(x); }).c_str());
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      "error: \\[LayerNorm\\(\\(4,\\)\\): layer_norm: implemented on the CPU only, not on cuda:0\\]");
}

// Embedding picks rows; a repeated index accumulates its rows' gradients;
// the padding row starts at zero and its gradient stays zero even where it
// is looked up; the weight is N(0, 1) from the generator given.
TEST(ModuleTest, EmbeddingLooksUpAndAccumulates) {
  Generator gen(21), same(21);
  Embedding emb(6, 3, -2, gen);  // padding_idx -2 is row 4
  EXPECT_EQ(emb.padding_idx(), std::optional<int64_t>(4));
  Tensor expected_weight = Empty({6, 3});
  NormalFill(expected_weight, 0.0, 1.0, same);
  std::vector<float> want_w = expected_weight.ToVector<float>();
  for (int i = 0; i < 3; ++i) want_w[4 * 3 + i] = 0.0f;
  EXPECT_EQ(emb.weight().ToVector<float>(), want_w);
  EXPECT_EQ(Names(emb.GetStateDict()), (std::vector<std::string>{"weight"}));

  emb.To(DType::kFloat64);
  const std::vector<int64_t> idx = {2, 4, 2, 0, 2, 5};
  for (DType index_dtype : {DType::kInt64, DType::kInt32}) {
    SCOPED_TRACE(DTypeName(index_dtype));
    emb.ZeroGrad();
    const Tensor indices = FromVectorOf<int64_t>(idx, {3, 2}).To(index_dtype);
    const Tensor y = emb.Forward(indices);
    ASSERT_EQ(y.shape(), (Shape{3, 2, 3}));
    const std::vector<double> w = emb.weight().ToVector<double>(), got = y.ToVector<double>();
    for (size_t i = 0; i < idx.size(); ++i) {
      for (int k = 0; k < 3; ++k) EXPECT_EQ(got[i * 3 + k], w[idx[i] * 3 + k]) << "index " << i;
    }
    const Tensor r = testing::RandomLeaf({3, 2, 3}, 8, false);
    Backward(ops::Sum(ops::Mul(y, r)));
    std::vector<double> want(18, 0.0);
    const std::vector<double> rv = r.ToVector<double>();
    for (size_t i = 0; i < idx.size(); ++i) {
      if (idx[i] == 4) continue;
      for (int k = 0; k < 3; ++k) want[idx[i] * 3 + k] += rv[i * 3 + k];
    }
    ExpectNear(emb.weight().grad().ToVector<double>(), want, 1e-15);
    // Row 2 was looked up three times: the sum of three rows of r.
    EXPECT_NEAR(emb.weight().grad().ToVector<double>()[2 * 3], rv[0] + rv[6] + rv[12], 1e-15);
  }
  // A 0-d index gives one row.
  EXPECT_EQ(emb.Forward(FromVectorOf<int64_t>({3}, {})).shape(), (Shape{3}));
}

TEST(ModuleTest, EmbeddingPrintsAndRefusesLikePyTorch) {
  EXPECT_EQ(Embedding(10, 3).ToString(), "Embedding(10, 3)");
  EXPECT_EQ(Embedding(10, 3, -1).ToString(), "Embedding(10, 3, padding_idx=9)");
  EXPECT_EQ(Embedding(10, 3, 0).ToString(), "Embedding(10, 3, padding_idx=0)");
  EXPECT_EQ(ErrorOf([] { Embedding(10, 3, 10); }), "Embedding(10, 3): padding_idx must be in [-10, 10), got 10");
  EXPECT_EQ(ErrorOf([] { Embedding(10, 3, -11); }), "Embedding(10, 3): padding_idx must be in [-10, 10), got -11");
  EXPECT_EQ(ErrorOf([] { Embedding(-1, 3); }), "Embedding(-1, 3): num_embeddings must be >= 0, got -1");
  EXPECT_EQ(ErrorOf([] { Embedding(4, -3); }), "Embedding(4, -3): embedding_dim must be >= 0, got -3");
  Embedding emb(5, 2);
  const std::vector<float> before = emb.weight().ToVector<float>();
  bool out_of_range = false;
  try {
    emb.Forward(FromVectorOf<int64_t>({1, 5, 0}, {3}));
  } catch (const std::out_of_range& e) {
    out_of_range = true;
    EXPECT_STREQ(e.what(), "Embedding(5, 2): embedding: index 5 at position 1 is out of range [0, 5) of a table of 5 "
                           "embeddings");
  }
  EXPECT_TRUE(out_of_range);
  EXPECT_EQ(ErrorOf([&] { emb.Forward(FromVectorOf<int64_t>({-1}, {1})); }),
            "Embedding(5, 2): embedding: index -1 at position 0 is out of range [0, 5) of a table of 5 embeddings");
  EXPECT_EQ(ErrorOf([&] { emb.Forward(Zeros({2})); }),
            "Embedding(5, 2): embedding: indices must be i64 or i32, got f32");
  EXPECT_EQ(ErrorOf([&] { emb.Forward(Tensor()); }), "Embedding(5, 2): input is undefined");
  EXPECT_EQ(emb.weight().ToVector<float>(), before);
  EXPECT_EXIT(
      {
        nn::testing::RegisterHostAsCuda();  // tensors "on cuda:0" without a GPU
        Embedding on_device(5, 2);
        on_device.To(Device(DeviceType::kCUDA, 0));
        const Tensor idx = FromVectorOf<int64_t>({1}, {1}).To(Device(DeviceType::kCUDA, 0));
        std::fprintf(stderr, "error: [%s]\n", ErrorOf([&] { on_device.Forward(idx); }).c_str());
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      "error: \\[Embedding\\(5, 2\\): embedding: implemented on the CPU only, not on cuda:0\\]");
}

// Conv1d in f64 against a direct loop over [N, C, L] with stride, padding,
// dilation and groups; unbatched input; PyTorch's printed form and names.
TEST(ModuleTest, Conv1dMatchesAnF64Reference) {
  Generator gen(7);
  const int64_t n = 2, c = 4, l = 9, o = 6, k = 3, stride = 2, pad = 2, dil = 2, groups = 2;
  Conv1d conv(c, o, k, {.stride = stride, .padding = pad, .dilation = dil, .groups = groups}, gen);
  conv.To(DType::kFloat64);
  EXPECT_EQ(conv.weight().shape(), (Shape{o, c / groups, k}));
  const Tensor x = testing::RandomLeaf({n, c, l}, 13, false);
  const Tensor y = conv.Forward(x);
  const int64_t ol = (l + 2 * pad - dil * (k - 1) - 1) / stride + 1;
  ASSERT_EQ(y.shape(), (Shape{n, o, ol}));
  const std::vector<double> xv = x.ToVector<double>(), wv = conv.weight().ToVector<double>(),
                            bv = conv.bias().ToVector<double>();
  std::vector<double> want(n * o * ol);
  const int64_t cg = c / groups, og = o / groups;
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t oc = 0; oc < o; ++oc) {
      for (int64_t t = 0; t < ol; ++t) {
        double acc = bv[oc];
        for (int64_t ic = 0; ic < cg; ++ic) {
          for (int64_t j = 0; j < k; ++j) {
            const int64_t pos = t * stride - pad + j * dil;
            if (pos < 0 || pos >= l) continue;
            acc += wv[(oc * cg + ic) * k + j] * xv[(b * c + (oc / og) * cg + ic) * l + pos];
          }
        }
        want[(b * o + oc) * ol + t] = acc;
      }
    }
  }
  ExpectNear(y.ToVector<double>(), want, 1e-12);
  // Unbatched: the first sample's result.
  const Tensor y1 = conv.Forward(ops::Select(x, 0, 0));
  ASSERT_EQ(y1.shape(), (Shape{o, ol}));
  ExpectNear(y1.ToVector<double>(), std::vector<double>(want.begin(), want.begin() + o * ol), 1e-12);

  EXPECT_EQ(Names(conv.GetStateDict()), (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(Conv1d(4, 8, 3).ToString(), "Conv1d(4, 8, kernel_size=(3,), stride=(1,))");
  EXPECT_EQ(Conv1d(4, 8, 3, {.stride = 2, .padding = 1, .dilation = 2, .groups = 2, .bias = false}).ToString(),
            "Conv1d(4, 8, kernel_size=(3,), stride=(2,), padding=(1,), dilation=(2,), groups=2, bias=False)");
  // Default initialization as PyTorch's: weight within 1/sqrt(fan_in), fan_in = C/groups * K.
  Conv1d fresh(4, 8, 3);
  for (const Tensor& p : fresh.Parameters()) {
    for (float v : p.ToVector<float>()) EXPECT_LE(std::abs(v), 1.0 / std::sqrt(12.0));
  }
}

TEST(ModuleTest, Conv1dNamesEachBadArgument) {
  EXPECT_EQ(ErrorOf([] { Conv1d(-1, 8, 3); }), "Conv1d(-1, 8): in_channels must be >= 0, got -1");
  EXPECT_EQ(ErrorOf([] { Conv1d(4, 8, 3, {.groups = 0}); }), "Conv1d(4, 8): groups must be >= 1, got 0");
  EXPECT_EQ(ErrorOf([] { Conv1d(4, 6, 3, {.groups = 3}); }),
            "Conv1d(4, 6): in_channels (4) must be divisible by groups (3)");
  EXPECT_EQ(ErrorOf([] { Conv1d(4, 8, 0); }), "Conv1d(4, 8): kernel_size must be >= 1, got 0");
  EXPECT_EQ(ErrorOf([] { Conv1d(4, 8, 3, {.stride = 0}); }), "Conv1d(4, 8): stride must be >= 1, got 0");
  EXPECT_EQ(ErrorOf([] { Conv1d(4, 8, 3, {.padding = -1}); }), "Conv1d(4, 8): padding must be >= 0, got -1");
  EXPECT_EQ(ErrorOf([] { Conv1d(4, 8, 3, {.dilation = 0}); }), "Conv1d(4, 8): dilation must be >= 1, got 0");
  Conv1d conv(4, 8, 3);
  EXPECT_EQ(ErrorOf([&] { conv.Forward(Zeros({2, 3, 9})); }),
            "Conv1d(4->8, 3): expected input [N, 4, L] or [4, L], got [2, 3, 9]");
  EXPECT_EQ(ErrorOf([&] { conv.Forward(Zeros({2, 4, 2})); }),
            "Conv1d(4->8, 3): conv1d: input [2, 4, 2] is shorter than the kernel [8, 4, 3] with stride 1, padding 0, "
            "dilation 1");
  EXPECT_EQ(ErrorOf([&] { conv.Forward(Zeros({2, 4, 5}, {.dtype = DType::kInt64})); }),
            "Conv1d(4->8, 3): conv1d: input must be floating, got i64");
  // An unbatched input is shown as given, without the batch of one it runs
  // as (before: [1, 4, 2] and [1, 4, 0]).
  EXPECT_EQ(ErrorOf([&] { conv.Forward(Zeros({4, 2})); }),
            "Conv1d(4->8, 3): conv1d: input [4, 2] is shorter than the kernel [8, 4, 3] with stride 1, padding 0, "
            "dilation 1");
  EXPECT_EQ(ErrorOf([&] { conv.Forward(Zeros({4, 0})); }),
            "Conv1d(4->8, 3): conv1d: only a zero batch or zero channels may be empty, got input [4, 0]");
}

// A failure of the device's kernel, as nn/cuda's CudaError (a runtime_error
// with the library's status code), which needs the CUDA headers.
class KernelFailure : public std::runtime_error {
 public:
  KernelFailure(const std::string& message, int code) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

void FailingConv2d(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const ops::Conv2dParams&) {
  throw KernelFailure("conv kernel failed", 700);
}

// Conv1d and Conv2d on a device whose conv2d kernel fails, printing the
// type and code that reach the caller (in a child process: the device stays
// registered).
void TryConvsWithAFailingKernel() {
  nn::testing::RegisterHostAsCuda();  // tensors "on cuda:0" without a GPU
  ops::KernelTable table = ops::KernelsFor(DeviceType::kCPU);
  table.conv2d_forward = &FailingConv2d;
  ops::RegisterKernels(DeviceType::kCUDA, table);
  const Device cuda(DeviceType::kCUDA, 0);
  Conv1d conv1(4, 8, 3);
  conv1.To(cuda);
  Conv2d conv2(4, 8, 3);
  conv2.To(cuda);
  const std::pair<const char*, std::function<void()>> calls[] = {
      {"conv1d", [&] { conv1.Forward(Zeros({2, 4, 9}).To(cuda)); }},
      {"conv2d", [&] { conv2.Forward(Zeros({2, 4, 9, 9}).To(cuda)); }}};
  for (const auto& [name, call] : calls) {
    try {
      call();
      std::fprintf(stderr, "%s: no error\n", name);
    } catch (const KernelFailure& e) {
      std::fprintf(stderr, "%s: code %d [%s]\n", name, e.code(), e.what());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: another type [%s]\n", name, e.what());
    }
  }
}

// A kernel's own exception type reaches the caller of Conv1d as it reaches
// the caller of Conv2d (before, Conv1d rethrew every runtime_error as a
// plain one, and a CudaError's code was lost).
TEST(ModuleTest, Conv1dLetsAKernelsExceptionThroughWithItsType) {
  EXPECT_EXIT(
      {
        TryConvsWithAFailingKernel();
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      "conv1d: code 700 \\[conv kernel failed\\]\n"
      "conv2d: code 700 \\[conv kernel failed\\]");
}

TEST(ModuleTest, ResNetNamesCountsAndShapes) {
  auto r18 = MakeResNet18();
  EXPECT_EQ(Count(*r18), 11689512);
  const auto names = Names(r18->NamedParameters());
  EXPECT_EQ(names.front(), "conv1.weight");
  EXPECT_EQ(names[1], "bn1.weight");
  EXPECT_EQ(names[3], "layer1.0.conv1.weight");
  EXPECT_NE(std::find(names.begin(), names.end(), "layer2.0.downsample.0.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "layer2.0.downsample.1.bias"), names.end());
  EXPECT_EQ(names.back(), "fc.bias");
  const auto buffers = Names(r18->NamedBuffers());
  EXPECT_EQ(buffers[0], "bn1.running_mean");
  EXPECT_EQ(buffers[2], "bn1.num_batches_tracked");
  // State dict: each module's parameters, then its buffers, pre-order.
  const auto sd = Names(r18->GetStateDict());
  EXPECT_EQ(std::vector<std::string>(sd.begin(), sd.begin() + 6),
            (std::vector<std::string>{"conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var",
                                      "bn1.num_batches_tracked"}));
  EXPECT_EQ(Count(*MakeResNet34()), 21797672);
  EXPECT_EQ(Count(*MakeResNet50()), 25557032);
  auto cifar = MakeResNet18({.num_classes = 10, .stem = ResNetStem::kCifar});
  EXPECT_EQ(Count(*cifar), 11173962);
  EXPECT_FALSE(cifar->HasChild("maxpool"));
  Tensor y = cifar->Forward(Rand({2, 3, 32, 32}));
  EXPECT_EQ(y.shape(), (Shape{2, 10}));
  Backward(loss::CrossEntropy(y, FromVectorOf<int64_t>({1, 7}, {2})));
  for (const auto& [n, p] : cifar->NamedParameters()) EXPECT_TRUE(p.grad().defined()) << n;
  auto r50 = MakeResNet50({.num_classes = 5, .stem = ResNetStem::kImageNet});
  EXPECT_EQ(r50->Forward(Rand({1, 3, 64, 64})).shape(), (Shape{1, 5}));
}

// A block list that cannot make a working ResNet (not 4 stages, or an empty
// stage) is refused at construction, naming it, before anything is drawn
// from the generator. Before, it was taken, and Forward failed at fc (or
// extra stages were dropped).
TEST(ModuleTest, ResNetRefusesABadBlockList) {
  for (const std::vector<int64_t>& blocks :
       {std::vector<int64_t>{2, 2, 2}, std::vector<int64_t>{2, 2, 2, 2, 2}, std::vector<int64_t>{2, 0, 2, 2},
        std::vector<int64_t>{}, std::vector<int64_t>{1, 1, 1, -1}}) {
    Generator gen(3);
    EXPECT_EQ(ErrorOf([&] { ResNet(false, blocks, {}, gen); }),
              "ResNet: blocks " + ShapeToString(blocks) + " must give 4 stages of at least 1 block each");
    EXPECT_EQ(gen.NextU64(), Generator(3).NextU64());
  }
  Generator gen(3);
  EXPECT_EQ(ErrorOf([&] { ResNet(true, {1, 1, 1, 1}, {.num_classes = 3, .stem = ResNetStem::kCifar}, gen); }), "");
}

TEST(ModuleTest, BadInputShapesNameTheLayer) {
  auto mlp = MakeMlp();
  std::string err = ErrorOf([&] { mlp->Forward(Zeros({64, 785})); });
  EXPECT_EQ(err, "Linear(784->512) `1`: expected input [..., 784], got [64, 785]");
  Sequential seq{std::make_shared<Linear>(784, 512)};
  EXPECT_EQ(ErrorOf([&] { seq.Forward(Zeros({64, 785})); }), "Linear(784->512) `0`: expected input [..., 784], got [64, 785]");
  auto cnn = MakeCnn();
  err = ErrorOf([&] { cnn->Forward(Zeros({8, 3, 28, 28})); });
  EXPECT_EQ(err, "Conv2d(1->32, 3x3) `0`: expected input [N, 1, H, W] or [1, H, W], got [8, 3, 28, 28]");
  err = ErrorOf([&] { cnn->Forward(Zeros({8, 1, 2, 2})); });
  EXPECT_NE(err.find("Conv2d(1->32, 3x3) `0`: conv2d: input [8, 1, 2, 2] is smaller than the kernel"), std::string::npos)
      << err;
  auto r18 = MakeResNet18({.num_classes = 10, .stem = ResNetStem::kCifar});
  r18->ReplaceChild("layer1.0.bn1", std::make_shared<BatchNorm2d>(32));
  err = ErrorOf([&] { r18->Forward(Zeros({2, 3, 32, 32})); });
  EXPECT_EQ(err, "BatchNorm2d(32) `layer1.0.bn1`: expected input [N, 32, H, W], got [2, 64, 32, 32]");
  EXPECT_EQ(ErrorOf([] { BatchNorm1d(4).Forward(Zeros({2, 5})); }),
            "BatchNorm1d(4): expected input [N, 4] or [N, 4, L], got [2, 5]");
}

// An undefined input is refused by every layer with an invalid_argument
// naming the layer, its path and "undefined". Before, most read its shape
// first and Tensor threw a logic_error ("shape on an undefined tensor")
// naming neither; the activations named only their op.
TEST(ModuleTest, UndefinedInputNamesTheLayer) {
  Sequential seq{std::make_shared<Linear>(2, 3),
                 std::make_shared<Conv2d>(1, 2, 3),
                 std::make_shared<BatchNorm1d>(4),
                 std::make_shared<BatchNorm2d>(4),
                 std::make_shared<ReLU>(),
                 std::make_shared<GELU>(),
                 std::make_shared<Sigmoid>(),
                 std::make_shared<Tanh>(),
                 std::make_shared<MaxPool2d>(2),
                 std::make_shared<AvgPool2d>(2),
                 std::make_shared<AdaptiveAvgPool2d>(1, 1),
                 std::make_shared<Dropout>(0.5),
                 std::make_shared<Flatten>()};
  for (const auto& [name, layer] : seq.NamedChildren()) {
    SCOPED_TRACE(layer->TypeName());
    std::string what;
    try {
      layer->Forward(Tensor());
    } catch (const std::invalid_argument& e) {
      what = e.what();
    } catch (const std::exception& e) {
      what = std::string("not an invalid_argument: ") + e.what();
    }
    EXPECT_EQ(what, layer->Describe() + ": input is undefined");
  }
  const std::shared_ptr<ReLU> relu = seq.ChildAs<ReLU>("4");
  EXPECT_EQ(ErrorOf([&] { relu->ForwardOwned(Tensor()); }), "ReLU `4`: input is undefined");
  EXPECT_EQ(ErrorOf([&] { seq.Forward(Tensor()); }), "Linear(2->3) `0`: input is undefined");
}

// An error from the op inside Linear or Dropout is rethrown naming the layer
// and its path, as Conv2d, BatchNorm and the pooling layers do.
TEST(ModuleTest, OpErrorsInLinearAndDropoutNameTheLayer) {
  auto mlp = MakeMlp();
  const Tensor ints = Zeros({2, 784}, {.dtype = DType::kInt64});
  std::string err = ErrorOf([&] { mlp->Forward(ints); });
  EXPECT_EQ(err, "Linear(784->512) `1`: linear: input must be floating, got i64");
  Sequential seq{std::make_shared<Identity>(), std::make_shared<Dropout>(0.5)};
  seq.Train();
  err = ErrorOf([&] { seq.Forward(ints); });
  EXPECT_EQ(err, "Dropout `1`: Dropout: input must be floating, got i64");
}

// The activations rethrow their op's refusal naming the layer and its path,
// as Linear and Dropout do. Before, an integer input to Sequential's GELU,
// Sigmoid or Tanh gave "Sigmoid: needs a floating tensor, got i64" (the op's
// name, not the layer's path), and ReLU's integer path off the CPU likewise.
TEST(ModuleTest, OpErrorsInActivationsNameTheLayer) {
  Sequential seq{std::make_shared<Identity>(), std::make_shared<GELU>(), std::make_shared<Sigmoid>(),
                 std::make_shared<Tanh>()};
  const Tensor ints = Zeros({2, 3}, {.dtype = DType::kInt64});
  EXPECT_EQ(ErrorOf([&] { seq.Forward(ints); }), "GELU `1`: Gelu: needs a floating tensor, got i64");
  EXPECT_EQ(ErrorOf([&] { seq.at(2)->Forward(ints); }), "Sigmoid `2`: Sigmoid: needs a floating tensor, got i64");
  EXPECT_EQ(ErrorOf([&] { seq.at(3)->Forward(ints); }), "Tanh `3`: Tanh: needs a floating tensor, got i64");
  // ReLU keeps integer tensors on the CPU only; another device's refusal
  // names the layer too, in Forward and in ForwardOwned (Sequential's path).
  EXPECT_EXIT(
      {
        nn::testing::RegisterHostAsCuda();  // tensors "on cuda:0" without a GPU
        Sequential relus;
        relus.Push(std::make_shared<Identity>());
        relus.Push(std::make_shared<ReLU>());
        relus.Push(std::make_shared<ReLU>());
        const Tensor on_device = Zeros({2}, {.dtype = DType::kInt64}).To(Device(DeviceType::kCUDA, 0));
        std::fprintf(stderr, "forward: [%s]\n", ErrorOf([&] { relus.at(1)->Forward(on_device); }).c_str());
        std::fprintf(stderr, "owned: [%s]\n", ErrorOf([&] { relus.at(2)->ForwardOwned(on_device); }).c_str());
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      "forward: \\[ReLU `1`: Relu: an integer tensor \\(i64\\) is implemented on the CPU only, not on cuda:0\\]\n"
      "owned: \\[ReLU `2`: Relu: an integer tensor \\(i64\\) is implemented on the CPU only, not on cuda:0\\]");
}

TEST(ModuleTest, StateDictRoundTripAndStrictErrors) {
  ManualSeed(1);
  auto a = MakeCnn();
  ManualSeed(2);
  auto b = MakeCnn();
  EXPECT_NE(a->GetStateDict()[0].second.ToVector<float>(), b->GetStateDict()[0].second.ToVector<float>());
  b->LoadStateDict(a->GetStateDict());
  for (size_t i = 0; i < a->GetStateDict().size(); ++i) {
    EXPECT_EQ(a->GetStateDict()[i].second.ToVector<float>(), b->GetStateDict()[i].second.ToVector<float>());
  }
  StateDict bad = a->GetStateDict();
  bad.erase(bad.begin() + 1);                              // missing 0.bias
  bad.emplace_back("extra.weight", Zeros({2}));            // unexpected
  bad[1].second = Zeros({64, 32, 3, 2});                   // shape mismatch on 3.weight
  bad[2].second = Zeros({64}, {.dtype = DType::kInt64});   // integer values for 3.bias
  const std::vector<float> before = b->GetStateDict()[0].second.ToVector<float>();
  const std::string err = ErrorOf([&] { b->LoadStateDict(bad); });
  EXPECT_EQ(ErrorOf([&] { b->CheckStateDict(bad); }), err);  // the same checks, alone
  EXPECT_NE(err.find("missing keys (1): `0.bias`"), std::string::npos) << err;
  EXPECT_NE(err.find("unexpected keys (1): `extra.weight`"), std::string::npos) << err;
  EXPECT_NE(err.find("`3.weight`: expected [64, 32, 3, 3] f32, got [64, 32, 3, 2] f32"), std::string::npos) << err;
  EXPECT_NE(err.find("`3.bias`: expected [64] f32, got [64] i64 (floating and integer values are not converted into "
                     "each other)"),
            std::string::npos)
      << err;
  EXPECT_EQ(b->GetStateDict()[0].second.ToVector<float>(), before);  // nothing half-loaded
  ManualSeed(3);
  EXPECT_EQ(ErrorOf([&] { b->CheckStateDict(MakeCnn()->GetStateDict()); }), "");  // checked, not copied
  EXPECT_EQ(b->GetStateDict()[0].second.ToVector<float>(), before);
  // Not strict: missing and unexpected keys are skipped, the rest is loaded.
  StateDict partial = {{"0.weight", Zeros({32, 1, 3, 3})}, {"other", Zeros({1})}};
  b->LoadStateDict(partial, /*strict=*/false);
  EXPECT_EQ(b->GetStateDict()[0].second.ToVector<float>()[0], 0.0f);
}

// Keys are quoted whatever they hold: an empty key (before, std::string's
// front() on it, undefined behaviour, an abort under _GLIBCXX_ASSERTIONS)
// and one beginning with a backquote (before, printed unquoted).
TEST(ModuleTest, LoadStateDictErrorQuotesEmptyAndBackquotedKeys) {
  auto mlp = MakeMlp();
  StateDict sd = mlp->GetStateDict();
  sd.emplace_back("", Zeros({1}));
  std::string err = ErrorOf([&] { mlp->LoadStateDict(sd); });
  EXPECT_NE(err.find("unexpected keys (1): ``;"), std::string::npos) << err;
  sd.back().first = "`odd";
  err = ErrorOf([&] { mlp->LoadStateDict(sd); });
  EXPECT_NE(err.find("unexpected keys (1): ``odd`;"), std::string::npos) << err;
  // A missing key, and the already quoted mismatches, are printed as before.
  sd = mlp->GetStateDict();
  const std::string name = sd[0].first;
  sd[0].second = Zeros({1});
  err = ErrorOf([&] { mlp->LoadStateDict(sd); });
  EXPECT_NE(err.find("shape or dtype mismatches (1): `" + name + "`: expected"), std::string::npos) << err;
  EXPECT_EQ(err.find("``" + name), std::string::npos) << err;
}

// A key given twice is refused in both modes, naming it, and nothing is
// loaded (before, the first value was loaded and the second ignored).
TEST(ModuleTest, LoadStateDictRefusesADuplicateKey) {
  auto mlp = MakeMlp();
  StateDict sd = mlp->GetStateDict();
  ASSERT_EQ(sd[0].first, "1.weight");
  const std::vector<float> before = sd[0].second.ToVector<float>();
  sd.emplace_back("1.weight", Zeros({512, 784}));
  for (bool strict : {true, false}) {
    const std::string err = ErrorOf([&] { mlp->LoadStateDict(sd, strict); });
    EXPECT_NE(err.find("duplicate keys (1): `1.weight`"), std::string::npos) << strict << ": " << err;
    EXPECT_EQ(ErrorOf([&] { mlp->CheckStateDict(sd, strict); }), err);
  }
  EXPECT_EQ(mlp->GetStateDict()[0].second.ToVector<float>(), before);
}

// As PyTorch's load_state_dict, the missing and unexpected keys are returned
// (a checkpoint saved from a wrapper, every key prefixed with "module.",
// matches nothing here).
TEST(ModuleTest, LoadStateDictReturnsMissingAndUnexpectedKeys) {
  auto mlp = MakeMlp();
  StateDict prefixed;
  std::vector<std::string> mine, given;
  for (const auto& [name, t] : mlp->GetStateDict()) {
    mine.push_back(name);
    given.push_back("module." + name);
    prefixed.emplace_back("module." + name, t);
  }
  const IncompatibleKeys keys = mlp->LoadStateDict(prefixed, /*strict=*/false);
  EXPECT_EQ(keys.missing, mine);
  EXPECT_EQ(keys.unexpected, given);
  const IncompatibleKeys checked = mlp->CheckStateDict(prefixed, /*strict=*/false);
  EXPECT_EQ(checked.missing, mine);
  EXPECT_EQ(checked.unexpected, given);
  const IncompatibleKeys strict_ok = mlp->LoadStateDict(mlp->GetStateDict());
  EXPECT_TRUE(strict_ok.missing.empty());
  EXPECT_TRUE(strict_ok.unexpected.empty());
}

// As PyTorch's BatchNorm, a state without num_batches_tracked (saved before
// the buffer existed, or exported without it) loads strictly: the count is
// not reported missing and keeps its value, while every other missing entry
// still is an error.
TEST(ModuleTest, LoadStateDictTakesAStateWithoutNumBatchesTracked) {
  auto net = std::make_shared<Sequential>();
  net->Push(std::make_shared<Linear>(3, 4));
  net->Push(std::make_shared<BatchNorm1d>(4));
  net->Train();
  (void)net->Forward(Randn({5, 3}));
  (void)net->Forward(Randn({5, 3}));
  auto bn = net->ChildAs<BatchNorm1d>("1");
  ASSERT_EQ(bn->num_batches_tracked().Item(), 2.0);

  StateDict without;
  for (const auto& [name, t] : net->GetStateDict()) {
    if (name != "1.num_batches_tracked") without.emplace_back(name, t.Clone());
  }
  without[0].second.Fill(0.25f);  // 0.weight: proves the rest was loaded
  const IncompatibleKeys keys = net->LoadStateDict(without);
  EXPECT_TRUE(keys.missing.empty());
  EXPECT_EQ(bn->num_batches_tracked().Item(), 2.0);
  EXPECT_EQ(net->GetStateDict()[0].second.data<float>()[0], 0.25f);
  const IncompatibleKeys loose = net->LoadStateDict(without, /*strict=*/false);
  EXPECT_TRUE(loose.missing.empty());

  StateDict no_mean;
  for (const auto& [name, t] : without) {
    if (name != "1.running_mean") no_mean.emplace_back(name, t);
  }
  try {
    net->LoadStateDict(no_mean);
    FAIL() << "a missing running_mean loaded";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("missing keys (1): `1.running_mean`"), std::string::npos) << e.what();
  }
}

// As PyTorch's load_state_dict (which checks shapes only and copies with
// copy_), a floating value is converted to the parameter's floating dtype:
// an f32 checkpoint loads into a model converted to bf16, and an f64 one
// into f32. Before, any dtype difference was refused as a mismatch.
TEST(ModuleTest, LoadStateDictConvertsFloatingDtypes) {
  ManualSeed(1);
  auto a = MakeCnn();
  ManualSeed(2);
  auto b = MakeCnn();
  b->To(DType::kBFloat16);
  const Tensor handle = b->NamedParameters()[0].second;
  for (bool strict : {true, false}) {
    SCOPED_TRACE(strict ? "strict" : "not strict");
    ASSERT_NO_THROW(b->LoadStateDict(a->GetStateDict(), strict));
    const StateDict mine = b->GetStateDict(), given = a->GetStateDict();
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_EQ(mine[i].second.dtype(), DType::kBFloat16) << mine[i].first;
      EXPECT_EQ(mine[i].second.ToVector<float>(), given[i].second.Detach().To(DType::kBFloat16).ToVector<float>())
          << mine[i].first;
    }
  }
  EXPECT_TRUE(handle.is_same(b->NamedParameters()[0].second));  // written in place

  // f64 into f32, buffers included; an integer buffer takes another integer type.
  BatchNorm2d bn(3);
  StateDict sd = bn.GetStateDict();
  for (auto& [name, t] : sd) {
    t = name == "num_batches_tracked" ? FromVectorOf<int32_t>({7}, {})
                                      : Full({3}, 0.25, {.dtype = DType::kFloat64});
  }
  ASSERT_NO_THROW(bn.LoadStateDict(sd));
  for (const auto& [name, t] : bn.GetStateDict()) {
    if (name == "num_batches_tracked") {
      EXPECT_EQ(t.dtype(), DType::kInt64);
      EXPECT_EQ(t.Item(), 7.0);
    } else {
      EXPECT_EQ(t.dtype(), DType::kFloat32) << name;
      EXPECT_EQ(t.ToVector<float>(), std::vector<float>(3, 0.25f)) << name;
    }
  }
  // Floating values for an integer buffer are refused, strict or not, and
  // nothing is loaded.
  StateDict floating = bn.GetStateDict();
  for (auto& [name, t] : floating) t = name == "num_batches_tracked" ? Full({}, 2.0) : Zeros({3});
  for (bool strict : {true, false}) {
    const std::string err = ErrorOf([&] { bn.LoadStateDict(floating, strict); });
    EXPECT_NE(err.find("`num_batches_tracked`: expected [] i64, got [] f32 (floating and integer values are not "
                       "converted into each other)"),
              std::string::npos)
        << err;
  }
  EXPECT_EQ(bn.GetStateDict()[0].second.ToVector<float>(), std::vector<float>(3, 0.25f));
}

// Registers the tensor it is given, so that two of them can share one.
class Holder : public Module {
 public:
  explicit Holder(Tensor w) { RegisterParameter("weight", std::move(w)); }
  std::string TypeName() const override { return "Holder"; }
};

// A tensor that cannot be a parameter is refused naming the module and the
// parameter (before, the tensor layer's message named neither).
TEST(ModuleTest, ParameterThatCannotRequireGradIsNamed) {
  const std::string integer = ErrorOf([] { Holder h(Zeros({2}, {.dtype = DType::kInt64})); });
  EXPECT_EQ(integer.rfind("Holder: parameter `weight`: ", 0), 0u) << integer;
  EXPECT_NE(integer.find("i64"), std::string::npos) << integer;
  Tensor leaf = Ones({2});
  leaf.set_requires_grad(true);
  const std::string non_leaf = ErrorOf([&] { Holder h(ops::MulScalar(leaf, 2.0)); });
  EXPECT_EQ(non_leaf.rfind("Holder: parameter `weight`: ", 0), 0u) << non_leaf;
  EXPECT_NE(non_leaf.find("non-leaf"), std::string::npos) << non_leaf;
  EXPECT_NE(non_leaf.find("Detach()"), std::string::npos) << non_leaf;
}

// An embedding and an output layer with one weight (weight tying).
class Tied : public Module {
 public:
  Tied() {
    const Tensor w = Randn({3, 2});
    RegisterModule("embed", std::make_shared<Holder>(w));
    RegisterModule("head", std::make_shared<Holder>(w));
    RegisterBuffer("steps", Zeros({1}));
  }
  std::string TypeName() const override { return "Tied"; }
};

// As PyTorch's state_dict, the state lists a shared weight under every name
// it is registered under (it listed the first only); the parameter list
// still holds it once, as named_parameters does. Loading writes every name
// into the one tensor.
TEST(ModuleTest, StateDictListsATiedWeightUnderEachName) {
  ManualSeed(1);
  Tied a;
  const StateDict sd = a.GetStateDict();
  EXPECT_EQ(Names(sd), (std::vector<std::string>{"steps", "embed.weight", "head.weight"}));
  EXPECT_TRUE(sd[1].second.is_same(sd[2].second));
  EXPECT_EQ(Names(a.NamedParameters()), std::vector<std::string>{"embed.weight"});

  ManualSeed(2);
  Tied b;
  b.LoadStateDict(sd);
  const StateDict loaded = b.GetStateDict();
  EXPECT_EQ(loaded[1].second.ToVector<float>(), sd[1].second.ToVector<float>());
  EXPECT_TRUE(loaded[1].second.is_same(loaded[2].second));  // still tied
  // Strict loading wants every name, as PyTorch's load_state_dict does.
  const StateDict one_name = {sd[0], sd[1]};
  EXPECT_NE(ErrorOf([&] { b.LoadStateDict(one_name); }).find("missing keys (1): `head.weight`"), std::string::npos);
  EXPECT_NO_THROW(b.LoadStateDict(one_name, /*strict=*/false));
}

// Zeroing in place takes a gradient out of autograd first, as PyTorch's
// zero_grad and the optimizers' ZeroGrad: a recorded one becomes its
// detached alias (same memory), a leaf one stops requiring grad.
TEST(ModuleTest, ZeroGradInPlaceDetachesGradientsThatArePartOfAGraph) {
  auto mlp = MakeMlp();
  const std::vector<Tensor> params = mlp->Parameters();
  Tensor x = Ones(params[0].shape());
  x.set_requires_grad(true);
  const Tensor recorded = ops::MulScalar(x, 2.0);
  ASSERT_NE(recorded.grad_fn(), nullptr);
  params[0].set_grad(recorded);
  Tensor leaf = Ones(params[1].shape());
  leaf.set_requires_grad(true);
  params[1].set_grad(leaf);
  mlp->ZeroGrad(/*set_to_none=*/false);
  EXPECT_EQ(params[0].grad().grad_fn(), nullptr);
  EXPECT_FALSE(params[0].grad().requires_grad());
  EXPECT_EQ(params[0].grad().data_ptr(), recorded.data_ptr());
  EXPECT_EQ(recorded.ToVector<float>()[0], 0.0f);
  EXPECT_TRUE(params[1].grad().is_same(leaf));
  EXPECT_FALSE(leaf.requires_grad());
  EXPECT_EQ(leaf.ToVector<float>()[0], 0.0f);
}

TEST(ModuleTest, TrainEvalZeroGradApplyTo) {
  auto r = MakeResNet18({.num_classes = 10, .stem = ResNetStem::kCifar});
  r->Eval();
  int modules = 0, training = 0;
  r->Apply([&](Module& m) {
    ++modules;
    training += m.is_training();
  });
  EXPECT_GT(modules, 40);
  EXPECT_EQ(training, 0);
  r->Train();
  EXPECT_TRUE(r->Child("layer4")->is_training());

  auto mlp = MakeMlp();
  Backward(ops::Sum(mlp->Forward(Rand({2, 784}))));
  const Tensor w = mlp->NamedParameters()[0].second;
  ASSERT_TRUE(w.grad().defined());
  const void* grad_mem = w.grad().data_ptr();
  mlp->ZeroGrad(/*set_to_none=*/false);
  EXPECT_EQ(w.grad().data_ptr(), grad_mem);
  EXPECT_EQ(w.grad().ToVector<float>()[0], 0.0f);
  mlp->ZeroGrad();
  EXPECT_FALSE(w.grad().defined());

  Tensor handle = mlp->NamedParameters()[0].second;
  mlp->To(DType::kBFloat16);
  EXPECT_EQ(handle.dtype(), DType::kBFloat16);  // same object, converted in place
  EXPECT_TRUE(handle.requires_grad());
  EXPECT_EQ(mlp->Forward(Rand({2, 784})).dtype(), DType::kBFloat16);
  EXPECT_THROW(mlp->To(Device(DeviceType::kCUDA, 0)), std::runtime_error);
}

TEST(ModuleTest, MixedPrecisionModel) {
  // An f32 layer, then a bf16 layer, then f32 again: inputs follow each layer's dtype.
  Sequential seq{std::make_shared<Linear>(8, 16), std::make_shared<ReLU>(), std::make_shared<Linear>(16, 16),
                 std::make_shared<ReLU>(), std::make_shared<Linear>(16, 4)};
  seq.at(2)->To(DType::kBFloat16);
  Tensor y = seq.Forward(Rand({3, 8}));
  EXPECT_EQ(y.dtype(), DType::kFloat32);
  Backward(loss::CrossEntropy(y, FromVectorOf<int64_t>({0, 1, 3}, {3})));
  const auto params = seq.NamedParameters();
  EXPECT_EQ(params[2].second.grad().dtype(), DType::kBFloat16);
  EXPECT_EQ(params[0].second.grad().dtype(), DType::kFloat32);
  EXPECT_TRUE(params[0].second.grad().defined());
}

// A residual block ends with its "relu" child applied to out + identity:
// fused (AddRelu) for a plain ReLU, with the same values as the child's
// Forward on the sum, and through the child when it was swapped for
// another activation.
TEST(ModuleTest, ResidualBlocksEndWithTheirActivationChild) {
  Generator gen(5);
  const Tensor x = Randn({2, 16, 6, 6});
  for (std::shared_ptr<Module> block : std::vector<std::shared_ptr<Module>>{
           std::make_shared<BasicBlock>(16, 16, 1, gen), std::make_shared<Bottleneck>(16, 4, 1, gen)}) {
    SCOPED_TRACE(block->TypeName());
    const std::string last = block->TypeName() == "BasicBlock" ? "2" : "3";
    auto before_end = [&](const Tensor& in) {
      Tensor out = in;
      for (const std::string& i : block->TypeName() == "BasicBlock" ? std::vector<std::string>{"1"}
                                                                    : std::vector<std::string>{"1", "2"}) {
        out = block->Child("relu")->Forward(block->Child("bn" + i)->Forward(block->Child("conv" + i)->Forward(out)));
      }
      return ops::Add(block->Child("bn" + last)->Forward(block->Child("conv" + last)->Forward(out)), in);
    };
    EXPECT_EQ(block->Forward(x).ToVector<float>(), ops::Relu(before_end(x)).ToVector<float>());
    block->ReplaceChild("relu", std::make_shared<GELU>());
    EXPECT_EQ(block->Forward(x).ToVector<float>(), ops::Gelu(before_end(x)).ToVector<float>());
  }
}

TEST(ModuleTest, ReplaceChildTakesEffectInForward) {
  Sequential seq{std::make_shared<Linear>(4, 4), std::make_shared<ReLU>()};
  class Doubler : public Module {
   public:
    Tensor Forward(const Tensor& x) override { return ops::MulScalar(x, 2.0); }
    using Module::Forward;
    std::string TypeName() const override { return "Doubler"; }
  };
  seq.ReplaceChild("1", std::make_shared<Doubler>());
  Tensor x = Rand({2, 4});
  Tensor lin = seq.at(0)->Forward(x);
  EXPECT_EQ(seq.Forward(x).ToVector<float>(), ops::MulScalar(lin, 2.0).ToVector<float>());
  EXPECT_EQ(seq.at(1)->FullName(), "1");
  EXPECT_NE(ErrorOf([&] { seq.ReplaceChild("5", std::make_shared<ReLU>()); }).find("has no child `5`"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { seq.ChildAs<Linear>("1"); }).find("is a Doubler"), std::string::npos);
}

// A path with an empty segment names no child: it is refused, naming the
// path, instead of being read as the path without the empty segment.
TEST(ModuleTest, ReplaceChildRefusesMalformedPaths) {
  auto inner = std::make_shared<Sequential>();
  inner->Push(std::make_shared<ReLU>());
  auto outer = std::make_shared<Sequential>();
  outer->Push(inner);
  const std::shared_ptr<Module> kept = outer->at(0)->Child("0");
  for (const std::string path : {"0..0", ".0", "0.", ".", ""}) {
    EXPECT_EQ(ErrorOf([&] { outer->ReplaceChild(path, std::make_shared<Identity>()); }),
              "Sequential: child path `" + path + "` is malformed (expected dot-separated, non-empty names)")
        << path;
  }
  EXPECT_EQ(outer->at(0)->Child("0"), kept);
  outer->ReplaceChild("0.0", std::make_shared<Identity>());
  EXPECT_NE(outer->at(0)->Child("0"), kept);
}

// A stem value past the enumerators is refused, naming it, before anything
// is drawn from the generator; it used to build the CIFAR stem.
TEST(ModuleTest, ResNetRefusesAnUnknownStem) {
  Generator gen(3);
  for (int stem : {2, -1, 100}) {
    EXPECT_EQ(ErrorOf([&] { ResNet(false, {1, 1, 1, 1}, {.stem = static_cast<ResNetStem>(stem)}, gen); }),
              "ResNet: stem " + std::to_string(stem) + " is not a ResNetStem (0 = kImageNet, 1 = kCifar)");
  }
  EXPECT_EQ(gen.NextU64(), Generator(3).NextU64());
}

// The error names the layer as constructed (BatchNorm1d or BatchNorm2d), as
// every other layer's; before, both said "BatchNorm".
TEST(ModuleTest, BatchNormRefusesNonPositiveNumFeaturesShowingIt) {
  EXPECT_EQ(ErrorOf([] { BatchNorm2d bn(0); }), "BatchNorm2d: num_features must be positive, got 0");
  EXPECT_EQ(ErrorOf([] { BatchNorm1d bn(-3); }), "BatchNorm1d: num_features must be positive, got -3");
}

TEST(ModuleTest, BatchNormTracksRunningStatistics) {
  BatchNorm2d bn(3);
  Tensor x = Rand({4, 3, 5, 5});
  bn.Forward(x);
  EXPECT_EQ(bn.num_batches_tracked().Item(), 1.0);
  const std::vector<float> rm = bn.running_mean().ToVector<float>();
  for (float v : rm) EXPECT_NEAR(v, 0.05, 0.01);  // 0.9 * 0 + 0.1 * ~0.5
  bn.Eval();
  Tensor y = bn.Forward(x);
  EXPECT_EQ(bn.num_batches_tracked().Item(), 1.0);
  EXPECT_EQ(y.shape(), x.shape());
}

// Eval mode normalizes with the running statistics alone:
// y = (x - running_mean) / sqrt(running_var + eps) * weight + bias.
TEST(ModuleTest, BatchNormInEvalUsesTheRunningStatistics) {
  BatchNorm2d bn(3, {.eps = 1e-3});
  const std::vector<double> rm{0.5, -1.25, 2.0}, rv{0.25, 4.0, 1.5}, w{1.5, -0.75, 0.3}, b{0.1, 2.0, -3.0};
  bn.LoadStateDict({{"weight", FromVector(w, {3})},
                    {"bias", FromVector(b, {3})},
                    {"running_mean", FromVector(rm, {3})},
                    {"running_var", FromVector(rv, {3})},
                    {"num_batches_tracked", FromVectorOf<int64_t>({7}, {})}});
  bn.Eval();
  const Tensor x = ops::MulScalar(Rand({2, 3, 2, 3}), 4.0);
  const std::vector<float> xv = x.ToVector<float>(), yv = bn.Forward(x).ToVector<float>();
  ASSERT_EQ(yv.size(), xv.size());
  for (size_t i = 0; i < xv.size(); ++i) {
    const size_t c = (i / 6) % 3;
    const double want = (xv[i] - rm[c]) / std::sqrt(rv[c] + 1e-3) * w[c] + b[c];
    EXPECT_NEAR(yv[i], want, 1e-5 * (1 + std::fabs(want))) << i;
  }
  EXPECT_EQ(bn.num_batches_tracked().Item(), 7.0);
  EXPECT_EQ(bn.running_mean().ToVector<double>(), rm);
}

// Bad options fail at construction, naming the module and the option,
// before any batch (the functional op checks momentum only when training
// updates running statistics).
TEST(ModuleTest, BatchNormRefusesABadEpsOrMomentumAtConstruction) {
  auto error = [](const BatchNormOptions& options) {
    try {
      BatchNorm2d bn(3, options);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error({.momentum = 1.5}),
            "BatchNorm2d: BatchNormOptions::momentum must be in [0, 1] (or nullopt), got 1.5");
  EXPECT_EQ(error({.momentum = -0.1}),
            "BatchNorm2d: BatchNormOptions::momentum must be in [0, 1] (or nullopt), got -0.1");
  EXPECT_EQ(error({.eps = 0}), "BatchNorm2d: BatchNormOptions::eps must be finite and > 0, got 0");
  EXPECT_EQ(error({.eps = std::nan("")}), "BatchNorm2d: BatchNormOptions::eps must be finite and > 0, got nan");
  EXPECT_EQ(error({.eps = 1e-3, .momentum = std::nullopt}), "");
  EXPECT_EQ(error({.momentum = 1.0}), "");
}

// momentum = nullopt (PyTorch's None): the running statistics are the
// cumulative average of the batches' (1 / num_batches_tracked each time).
TEST(ModuleTest, BatchNormWithoutMomentumKeepsTheCumulativeAverage) {
  BatchNorm2d bn(3, {.momentum = std::nullopt});
  EXPECT_EQ(bn.ToString(), "BatchNorm2d(3, eps=1e-05, momentum=None, affine=True, track_running_stats=True)");
  // Random batches of 8 values per channel, so that the variances differ
  // and biased (/8) and unbiased (/7) ones tell apart by 14%.
  std::vector<double> mean_sum(3, 0.0), var_sum(3, 0.0);
  const int batches = 3;
  for (int k = 0; k < batches; ++k) {
    const Tensor x = ops::AddScalar(ops::MulScalar(Rand({2, 3, 2, 2}), 1.0 + k), 2.0 * k);
    const std::vector<float> v = x.ToVector<float>();
    for (int64_t c = 0; c < 3; ++c) {
      std::vector<double> e;
      for (int64_t n = 0; n < 2; ++n) {
        for (int64_t i = 0; i < 4; ++i) e.push_back(v[(n * 3 + c) * 4 + i]);
      }
      double mean = 0, sq = 0;
      for (double a : e) mean += a / static_cast<double>(e.size());
      for (double a : e) sq += (a - mean) * (a - mean);
      mean_sum[c] += mean;
      var_sum[c] += sq / static_cast<double>(e.size() - 1);
    }
    bn.Forward(x);
  }
  EXPECT_EQ(bn.num_batches_tracked().Item(), 3.0);
  const std::vector<float> rm = bn.running_mean().ToVector<float>(), rv = bn.running_var().ToVector<float>();
  for (int64_t c = 0; c < 3; ++c) {
    EXPECT_NEAR(rm[c], mean_sum[c] / batches, 1e-5) << c;
    EXPECT_NEAR(rv[c], var_sum[c] / batches, 1e-5) << c;
  }
}

// A graph recorded on the CPU, the module moved to another device before
// backward: the gradient reaching each leaf is refused naming both devices
// (before, it became .grad on the wrong device, or a later accumulation read
// device memory on the host).
TEST(ModuleTest, BackwardAfterMovingTheModuleNamesBothDevices) {
  EXPECT_EXIT(
      {
        nn::testing::RegisterHostAsCuda();  // tensors "on cuda:0" without a GPU
        Linear lin(4, 3);
        const Tensor loss = ops::Sum(lin.Forward(Ones({2, 4})));
        lin.To(Device(DeviceType::kCUDA, 0));
        std::fprintf(stderr, "error: [%s]\n", ErrorOf([&] { Backward(loss); }).c_str());
        std::fprintf(stderr, "grad defined: %d\n", lin.weight().grad().defined() ? 1 : 0);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      "error: \\[in backward of AccumulateGrad: gradient \\[[0-9, ]+\\] on cpu for a leaf on cuda:0 "
      "\\(was the leaf moved with To\\(\\) after the forward that recorded this graph\\?\\)\\]\n"
      "grad defined: 0");
}

// The forward counts batches from a host copy of what it last wrote (on a
// GPU, reading the buffer waits for all queued work) and reads the buffer
// again only when it changed: an in-place write (Fill, LoadStateDict) or
// another storage (To()). A write that bypasses the version counter (raw
// memory) is not seen, which shows the copy is used; before, every training
// forward read the buffer.
TEST(ModuleTest, BatchNormCountsBatchesWithoutReadingTheBufferBack) {
  BatchNorm2d bn(3, {.momentum = std::nullopt});
  const Tensor x = Full({2, 3, 2, 2}, 1.0);
  bn.Forward(x);
  bn.Forward(x);
  *static_cast<int64_t*>(bn.num_batches_tracked().data_ptr()) = 100;  // no version bump
  bn.Forward(x);
  EXPECT_EQ(bn.num_batches_tracked().Item(), 3.0) << "the forward read the buffer back";

  {
    NoGradGuard guard;
    bn.num_batches_tracked().Fill(10.0);  // bumps the version
  }
  bn.Forward(Full({2, 3, 2, 2}, 12.0));
  EXPECT_EQ(bn.num_batches_tracked().Item(), 11.0);
  // Without a momentum the factor is 1/11: 1 + (12 - 1) / 11 = 2.
  for (float m : bn.running_mean().ToVector<float>()) EXPECT_NEAR(m, 2.0, 1e-6);

  StateDict state = bn.GetStateDict();
  for (auto& [name, t] : state) {
    if (name == "num_batches_tracked") t = Full({}, 40.0, {.dtype = DType::kInt64});
  }
  bn.LoadStateDict(state);
  bn.Forward(x);
  EXPECT_EQ(bn.num_batches_tracked().Item(), 41.0);
  bn.Eval();
  bn.Forward(x);
  EXPECT_EQ(bn.num_batches_tracked().Item(), 41.0) << "eval counted a batch";
}

// An empty batch in training, as PyTorch: an empty output, the running
// statistics unchanged, zero gradients for weight and bias. One value per
// channel is still refused.
TEST(ModuleTest, BatchNormTrainsOnAnEmptyBatch) {
  BatchNorm2d bn(3);
  const std::vector<float> mean_before = bn.running_mean().ToVector<float>();
  const std::vector<float> var_before = bn.running_var().ToVector<float>();
  Tensor x = Zeros({0, 3, 4, 4}, {.requires_grad = true});
  Tensor y = bn.Forward(x);
  EXPECT_EQ(y.shape(), x.shape());
  EXPECT_EQ(bn.running_mean().ToVector<float>(), mean_before);
  EXPECT_EQ(bn.running_var().ToVector<float>(), var_before);
  Backward(ops::Sum(y));
  EXPECT_EQ(x.grad().shape(), x.shape());
  for (const Tensor& p : bn.Parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().ToVector<float>(), std::vector<float>(3, 0.0f));
  }
  EXPECT_THROW(bn.Forward(Rand({1, 3, 1, 1})), std::invalid_argument);
}

TEST(ModuleTest, SequentialReusesIntermediatesOnlyWhenUnshared) {
  // Linear -> ReLU (in place on the Linear's output) -> Linear, in f64: exact gradients.
  Sequential seq{std::make_shared<Linear>(4, 6), std::make_shared<ReLU>(), std::make_shared<Linear>(6, 3),
                 std::make_shared<Sigmoid>(), std::make_shared<ReLU>()};
  seq.To(DType::kFloat64);
  std::vector<Tensor> params = seq.Parameters();
  std::vector<Tensor> inputs = {testing::RandomLeaf({5, 4}, 1)};
  inputs.insert(inputs.end(), params.begin(), params.end());
  EXPECT_TRUE(testing::GradCheck([&seq](const std::vector<Tensor>& in) { return seq.Forward(in[0]); }, inputs));
  // The ReLU after Sigmoid must not overwrite the sigmoid output its backward saved:
  // the gradient above would be wrong if it did. A caller-held tensor is never reused.
  ReLU relu;
  Tensor a = ops::AddScalar(Rand({8}), -0.5);
  const std::vector<float> before = a.ToVector<float>();
  Tensor b = relu.ForwardOwned(a);
  EXPECT_EQ(a.ToVector<float>(), before);
  EXPECT_NE(a.storage().get(), b.storage().get());
  // An unshared temporary is rectified in place.
  Tensor c = ops::AddScalar(Rand({8}), -0.5);
  const void* mem = c.data_ptr();
  Tensor d = relu.ForwardOwned(std::move(c));
  EXPECT_EQ(d.data_ptr(), mem);
  for (float v : d.ToVector<float>()) EXPECT_GE(v, 0.0f);
}

TEST(ModuleTest, EmptyBatchRunsForwardAndBackward) {
  // A rank can run out of data (DDP's Join): zero samples must not crash.
  auto cnn = MakeCnn();
  const Tensor y = cnn->Forward(Zeros({0, 1, 28, 28}));
  EXPECT_EQ(y.shape(), (Shape{0, 10}));
  Backward(ops::Sum(y));
  for (const Tensor& p : cnn->Parameters()) {
    ASSERT_TRUE(p.grad().defined());
    for (float v : p.grad().ToVector<float>()) EXPECT_EQ(v, 0.0f);
  }
  // The same for the sequence layers: no rows, no indices.
  const std::pair<std::shared_ptr<Module>, Tensor> empty_batches[] = {
      {std::make_shared<LayerNorm>(Shape{3, 4}), Zeros({0, 3, 4})},
      {std::make_shared<Embedding>(5, 3, 1), Zeros({0, 7}, {.dtype = DType::kInt64})},
      {std::make_shared<Conv1d>(2, 4, 3), Zeros({0, 2, 5})},
  };
  for (const auto& [layer, x] : empty_batches) {
    SCOPED_TRACE(layer->TypeName());
    const Tensor out = layer->Forward(x);
    EXPECT_EQ(out.numel(), 0);
    Backward(ops::Sum(out));
    for (const Tensor& p : layer->Parameters()) {
      ASSERT_TRUE(p.grad().defined());
      for (float v : p.grad().ToVector<float>()) EXPECT_EQ(v, 0.0f);
    }
  }
}

// As PyTorch's state_dict, the entries are detached handles on the module's
// memory: writing into one changes the module without a NoGradGuard, and
// the entry neither requires grad nor carries the parameter's .grad.
TEST(ModuleTest, StateDictEntriesAreDetachedAndShareMemory) {
  Linear lin(2, 2);
  Backward(ops::Sum(lin.Forward(Ones({1, 2}))));
  ASSERT_TRUE(lin.weight().grad().defined());
  const StateDict sd = lin.GetStateDict();
  ASSERT_EQ(Names(sd), (std::vector<std::string>{"weight", "bias"}));
  const Tensor& w = sd[0].second;
  EXPECT_FALSE(w.is_same(lin.weight()));
  EXPECT_FALSE(w.requires_grad());
  EXPECT_FALSE(w.grad().defined());
  EXPECT_EQ(w.data_ptr(), lin.weight().data_ptr());
  EXPECT_EQ(ErrorOf([&] { w.CopyFrom(Zeros({2, 2})); }), "");
  EXPECT_EQ(lin.weight().ToVector<float>(), std::vector<float>(4, 0.0f));
  EXPECT_TRUE(lin.weight().requires_grad());  // the parameter is unchanged but for its values
  EXPECT_TRUE(lin.weight().grad().defined());
}

// A module registered twice (Sequential{l, relu, l}) is listed and visited
// once, under its first name, as PyTorch's named_modules and apply; the
// state dict still names it under both paths, as PyTorch's state_dict.
TEST(ModuleTest, ModuleRegisteredTwiceIsVisitedOnce) {
  auto l = std::make_shared<Linear>(2, 2);
  Sequential seq{l, std::make_shared<ReLU>(), l};
  std::vector<std::string> paths;
  for (const auto& [path, m] : seq.NamedModules()) paths.push_back(path);
  EXPECT_EQ(paths, (std::vector<std::string>{"", "0", "1"}));
  EXPECT_EQ(Names(seq.NamedParameters()), (std::vector<std::string>{"0.weight", "0.bias"}));
  EXPECT_EQ(Names(seq.GetStateDict()), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));

  std::vector<std::string> visited;
  const std::vector<float> before = l->weight().ToVector<float>();
  seq.Apply([&](Module& m) {
    visited.push_back(m.TypeName());
    if (auto* lin = dynamic_cast<Linear*>(&m)) {
      NoGradGuard guard;
      lin->weight().CopyFrom(ops::MulScalar(lin->weight(), 2.0));
    }
  });
  EXPECT_EQ(visited, (std::vector<std::string>{"Linear", "ReLU", "Sequential"}));
  const std::vector<float> after = l->weight().ToVector<float>();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_EQ(after[i], 2.0f * before[i]) << i;

  // Shared by two parents: PyTorch's named_modules lists it under the first.
  auto a = std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{l});
  auto b = std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{l});
  Sequential outer{a, b};
  paths.clear();
  for (const auto& [path, m] : outer.NamedModules()) paths.push_back(path);
  EXPECT_EQ(paths, (std::vector<std::string>{"", "0", "0.0", "1"}));
  int linears = 0;
  outer.Apply([&](Module& m) { linears += dynamic_cast<Linear*>(&m) != nullptr; });
  EXPECT_EQ(linears, 1);
}

// A training batch that batch norm refuses (one value per channel) leaves
// num_batches_tracked as it was: it updated no running statistic. Before,
// the count was raised first, so that without a momentum the next batch
// was averaged in with weight 1/2 instead of 1.
TEST(ModuleTest, BatchNormRefusedBatchIsNotCounted) {
  BatchNorm1d bn(2, {.momentum = std::nullopt});
  EXPECT_THROW(bn.Forward(Zeros({1, 2})), std::invalid_argument);
  EXPECT_EQ(bn.num_batches_tracked().ToVector<int64_t>(), std::vector<int64_t>{0});
  bn.Forward(FromVector({1.0, 10.0, 3.0, 30.0}, {2, 2}));
  EXPECT_EQ(bn.num_batches_tracked().ToVector<int64_t>(), std::vector<int64_t>{1});
  // The first batch counted replaces the initial running mean outright.
  EXPECT_EQ(bn.running_mean().ToVector<float>(), (std::vector<float>{2.0f, 20.0f}));
}

// NamedChildren lists a module registered twice by one parent once, under
// its first name, as PyTorch's named_children; the buffers and parameters
// are listed once too (named_buffers and named_parameters drop duplicates
// by default). The slots keep both registrations, and Forward runs both.
// Before, NamedChildren listed the module under "0" and again under "2".
TEST(ModuleTest, NamedChildrenListsAModuleRegisteredTwiceOnce) {
  auto bn = std::make_shared<BatchNorm1d>(2);
  auto relu = std::make_shared<ReLU>();
  Sequential seq{bn, relu, bn};
  std::vector<std::string> names;
  for (const auto& [name, child] : seq.NamedChildren()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"0", "1"}));
  EXPECT_EQ(seq.NamedChildren()[0].second.get(), bn.get());
  EXPECT_EQ(seq.NamedChildren()[1].second.get(), relu.get());
  // The registry's owners only: the list holds no copy of the pointer.
  EXPECT_EQ(seq.NamedChildren()[0].second.use_count(), bn.use_count());
  EXPECT_EQ(seq.ChildSlots().size(), 3u);
  EXPECT_EQ(seq.size(), 3u);
  EXPECT_EQ(Names(seq.NamedParameters()), (std::vector<std::string>{"0.weight", "0.bias"}));
  EXPECT_EQ(Names(seq.NamedBuffers()),
            (std::vector<std::string>{"0.running_mean", "0.running_var", "0.num_batches_tracked"}));

  // Forward still runs the layer at both slots: two batch-norm updates.
  seq.Forward(FromVector({0.0, 1.0, 2.0, 3.0}, {2, 2}));
  EXPECT_EQ(bn->NamedBuffers().back().second.ToVector<int64_t>(), std::vector<int64_t>{2});

  // Replacing the first slot lists the module under its other name.
  seq.ReplaceChild("0", std::make_shared<ReLU>());
  names.clear();
  for (const auto& [name, child] : seq.NamedChildren()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"0", "1", "2"}));
}

// A module registered more than once is named, in its path and errors,
// under its first registration, as NamedModules lists it; replacing that
// registration, or the death of its parent, moves it to the next one.
TEST(ModuleTest, ModuleRegisteredTwiceIsNamedUnderItsFirstPath) {
  auto l = std::make_shared<Linear>(2, 2);
  Sequential seq{l, std::make_shared<ReLU>(), l};
  EXPECT_EQ(l->FullName(), "0");
  EXPECT_EQ(ErrorOf([&] { seq.Forward(Zeros({1, 3})); }), "Linear(2->2) `0`: expected input [..., 2], got [1, 3]");
  seq.ReplaceChild("2", std::make_shared<Identity>());  // still registered as "0"
  EXPECT_EQ(l->FullName(), "0");
  seq.ReplaceChild("2", l);
  seq.ReplaceChild("0", std::make_shared<Identity>());  // still registered as "2"
  EXPECT_EQ(l->FullName(), "2");
  EXPECT_EQ(ErrorOf([&] { seq.Forward(Zeros({1, 3})); }), "Linear(2->2) `2`: expected input [..., 2], got [1, 3]");
  seq.ReplaceChild("2", std::make_shared<Identity>());  // registered nowhere now
  EXPECT_EQ(l->FullName(), "");
  EXPECT_EQ(l->name(), "");

  // Shared by two parents: named under the first, then under the second once the first dies.
  auto a = std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{l});
  auto b = std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{std::make_shared<ReLU>(), l});
  Sequential outer{a, b};
  EXPECT_EQ(l->FullName(), "0.0");
  EXPECT_EQ(outer.NamedModules()[2].first, "0.0");
  EXPECT_EQ(outer.NamedModules()[2].second, l.get());
  outer.ReplaceChild("0", std::make_shared<Identity>());
  a.reset();  // the first parent dies
  EXPECT_EQ(l->FullName(), "1.1");
  EXPECT_EQ(ErrorOf([&] { outer.Forward(Zeros({1, 3})); }), "Linear(2->2) `1.1`: expected input [..., 2], got [1, 3]");
}

// A module registered into its own subtree (itself, or an ancestor below
// one of its descendants) is refused, naming both, and nothing changes: the
// tree would be a cycle that Train, GetStateDict and ToString followed
// until the stack overflowed.
TEST(ModuleTest, RegisteringAModuleInsideItselfIsRefused) {
  auto outer = std::make_shared<Sequential>();
  auto inner = std::make_shared<Sequential>();
  auto leaf = std::make_shared<Linear>(2, 2);
  outer->Push(inner);
  inner->Push(leaf);
  EXPECT_EQ(ErrorOf([&] { outer->Push(outer); }),
            "Sequential: module `1` (Sequential) is this module or one of its ancestors; registered here it "
            "would contain itself");
  EXPECT_EQ(ErrorOf([&] { inner->Push(outer); }),
            "Sequential `0`: module `1` (Sequential) is this module or one of its ancestors; registered here "
            "it would contain itself");
  EXPECT_EQ(ErrorOf([&] { outer->ReplaceChild("0.0", inner); }),
            "Sequential `0`: module `0` (Sequential) is this module or one of its ancestors; registered here "
            "it would contain itself");
  EXPECT_EQ(ErrorOf([&] { outer->ReplaceChild("0", outer); }),
            "Sequential: module `0` (Sequential) is this module or one of its ancestors; registered here it "
            "would contain itself");
  EXPECT_EQ(outer->size(), 1u);
  EXPECT_EQ(inner->size(), 1u);
  EXPECT_EQ(inner->at(0), leaf);
  EXPECT_EQ(leaf->FullName(), "0.0");
  outer->Train(false);
  EXPECT_FALSE(leaf->is_training());
  EXPECT_EQ(Names(outer->GetStateDict()), (std::vector<std::string>{"0.0.weight", "0.0.bias"}));

  // A module under two parents is no cycle: still taken.
  outer->Push(leaf);
  EXPECT_EQ(Names(outer->GetStateDict()),
            (std::vector<std::string>{"0.0.weight", "0.0.bias", "1.weight", "1.bias"}));
}

// Registers the tensor it is given with the requires_grad it is given.
class Registrar : public Module {
 public:
  Registrar(Tensor w, bool requires_grad) { RegisterParameter("weight", std::move(w), requires_grad); }
  std::string TypeName() const override { return "Registrar"; }
};

// A tensor that is already a parameter keeps its requires_grad when
// registered again (as an existing nn.Parameter in PyTorch): tying a weight
// to a frozen embedding does not unfreeze it. A flag given explicitly
// applies.
TEST(ModuleTest, RegisteringAnExistingParameterKeepsItsRequiresGrad) {
  const Tensor w = Randn({3, 2});
  Holder embed(w);
  EXPECT_TRUE(w.requires_grad());
  w.set_requires_grad(false);  // frozen
  Holder head(w);
  EXPECT_FALSE(w.requires_grad());
  EXPECT_FALSE(head.NamedParameters()[0].second.requires_grad());

  const Tensor frozen = Randn({2});
  Registrar first(frozen, /*requires_grad=*/false);
  Holder second(frozen);
  EXPECT_FALSE(frozen.requires_grad());

  // A flag given explicitly applies, also to an existing parameter.
  const Tensor trained = Randn({2});
  Holder one(trained);
  Registrar other(trained, /*requires_grad=*/false);
  EXPECT_FALSE(trained.requires_grad());

  const Tensor fresh = Randn({2});
  Registrar fresh_frozen(fresh, /*requires_grad=*/false);
  EXPECT_FALSE(fresh.requires_grad());
  EXPECT_TRUE(Holder(Randn({2})).NamedParameters()[0].second.requires_grad());
}

// A module with a persistent and a non-persistent buffer.
class WithCache : public Module {
 public:
  WithCache() {
    RegisterParameter("weight", Ones({2}));
    RegisterBuffer("steps", Zeros({1}));
    RegisterBuffer("cache", Full({3}, 5.0), /*persistent=*/false);
  }
  std::string TypeName() const override { return "WithCache"; }
};

// Module::StructureVersion, the process-wide count of registry changes
// that DDP compares at each forward to tell whether a wrapped model may
// have changed: one more for each parameter, buffer and child registered
// and each ReplaceChild, in any module; reading a model or running it
// changes nothing, and a ReplaceChild that is refused counts nothing.
TEST(ModuleTest, StructureVersionCountsEveryRegistryChange) {
  uint64_t before = Module::StructureVersion();
  const WithCache cache;  // a parameter and two buffers
  EXPECT_EQ(Module::StructureVersion(), before + 3);

  auto seq = std::make_shared<Sequential>();
  auto linear = std::make_shared<Linear>(2, 2);  // weight and bias
  before = Module::StructureVersion();
  seq->Push(linear);
  EXPECT_EQ(Module::StructureVersion(), before + 1);

  before = Module::StructureVersion();
  (void)seq->NamedParameters();
  (void)seq->GetStateDict();
  (void)seq->Forward(Ones({1, 2}));
  EXPECT_EQ(Module::StructureVersion(), before);

  auto relu = std::make_shared<ReLU>();
  before = Module::StructureVersion();
  seq->ReplaceChild("0", relu);
  EXPECT_EQ(Module::StructureVersion(), before + 1);
  EXPECT_THROW(seq->ReplaceChild("no_such_child", std::make_shared<ReLU>()), std::out_of_range);
  EXPECT_EQ(Module::StructureVersion(), before + 1);
}

// As PyTorch's register_buffer(persistent=False): left out of the state
// dict and not expected by a strict load, but listed with the buffers and
// converted by To().
TEST(ModuleTest, NonPersistentBufferIsLeftOutOfTheStateDict) {
  Sequential seq{std::make_shared<WithCache>()};
  EXPECT_EQ(Names(seq.NamedBuffers()), (std::vector<std::string>{"0.steps", "0.cache"}));
  const StateDict sd = seq.GetStateDict();
  EXPECT_EQ(Names(sd), (std::vector<std::string>{"0.weight", "0.steps"}));
  EXPECT_NO_THROW(seq.LoadStateDict(sd));
  StateDict with_cache = sd;
  with_cache.emplace_back("0.cache", Zeros({3}));
  EXPECT_NE(ErrorOf([&] { seq.LoadStateDict(with_cache); }).find("unexpected keys (1): `0.cache`"),
            std::string::npos);
  const IncompatibleKeys keys = seq.LoadStateDict(with_cache, /*strict=*/false);
  EXPECT_EQ(keys.unexpected, std::vector<std::string>{"0.cache"});
  const Tensor cache = seq.NamedBuffers()[1].second;
  EXPECT_EQ(cache.ToVector<float>(), std::vector<float>(3, 5.0f));  // not loaded
  seq.To(DType::kFloat64);
  EXPECT_EQ(cache.dtype(), DType::kFloat64);
}

// PyTorch prints floats with Python's repr, the shortest text that reads
// back as the same double (the strings below are PyTorch 1.13's).
TEST(ModuleTest, FloatArgumentsPrintAsPythonRepr) {
  EXPECT_EQ(Dropout(0.1234567).ToString(), "Dropout(p=0.1234567, inplace=False)");
  EXPECT_EQ(Dropout(0.1).ToString(), "Dropout(p=0.1, inplace=False)");
  EXPECT_EQ(Dropout(1.0 / 3.0).ToString(), "Dropout(p=0.3333333333333333, inplace=False)");
  EXPECT_EQ(Dropout(1e-5).ToString(), "Dropout(p=1e-05, inplace=False)");
  EXPECT_EQ(Dropout(0.1 + 0.2).ToString(), "Dropout(p=0.30000000000000004, inplace=False)");
  EXPECT_EQ(Dropout(1e-20).ToString(), "Dropout(p=1e-20, inplace=False)");
  EXPECT_EQ(Dropout(0.0).ToString(), "Dropout(p=0.0, inplace=False)");
  EXPECT_EQ(Dropout(1.0).ToString(), "Dropout(p=1.0, inplace=False)");
  EXPECT_EQ(BatchNorm2d(3, {.eps = 1e-3, .momentum = 0.1234567}).ToString(),
            "BatchNorm2d(3, eps=0.001, momentum=0.1234567, affine=True, track_running_stats=True)");
  // Error messages show every digit too, without Python's ".0" on a whole number.
  EXPECT_EQ(ErrorOf([] { Dropout d(1.0000001); }), "Dropout: probability must be in [0, 1], got 1.0000001");
  EXPECT_EQ(ErrorOf([] { Dropout d(2.0); }), "Dropout: probability must be in [0, 1], got 2");
}

// Values from PyTorch's torch.nn.init.calculate_gain.
TEST(InitTest, GainMatchesPyTorch) {
  EXPECT_DOUBLE_EQ(Gain("leaky_relu"), std::sqrt(2.0 / (1.0 + 0.01 * 0.01)));  // default slope 0.01
  EXPECT_DOUBLE_EQ(Gain("leaky_relu", 0.0), std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(Gain("leaky_relu", std::sqrt(5.0)), std::sqrt(2.0 / 6.0));
  EXPECT_DOUBLE_EQ(Gain("selu"), 0.75);
  EXPECT_DOUBLE_EQ(Gain("tanh"), 5.0 / 3.0);
  EXPECT_DOUBLE_EQ(Gain("relu"), std::sqrt(2.0));
  for (const char* one : {"linear", "sigmoid", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                          "conv_transpose3d"}) {
    EXPECT_EQ(ErrorOf([&] { EXPECT_DOUBLE_EQ(Gain(one), 1.0) << one; }), "") << one;
  }
  EXPECT_EQ(ErrorOf([] { Gain("softmax"); }), "Gain: unknown nonlinearity `softmax`");
}

TEST(InitTest, LayersWithoutInputsConstructAsInPyTorch) {
  // Fan 0 gives Kaiming an infinite bound; an empty weight is left alone
  // and the bias bound is 0, as PyTorch does.
  Linear empty_in(0, 3);
  EXPECT_EQ(empty_in.weight().numel(), 0);
  for (float v : empty_in.bias().ToVector<float>()) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(empty_in.Forward(Zeros({2, 0})).shape(), (Shape{2, 3}));
}

TEST(InitTest, PyTorchBoundsAndSeededReproducibility) {
  Generator g1(7), g2(7);
  Linear a(100, 50, true, g1), b(100, 50, true, g2);
  EXPECT_EQ(a.weight().ToVector<float>(), b.weight().ToVector<float>());
  const double bound = 1.0 / std::sqrt(100.0);
  double mx = 0;
  for (float v : a.weight().ToVector<float>()) mx = std::max(mx, std::fabs(static_cast<double>(v)));
  EXPECT_LE(mx, bound);
  EXPECT_GT(mx, 0.95 * bound);
  for (float v : a.bias().ToVector<float>()) EXPECT_LE(std::fabs(v), bound);
  // Conv2d: weight and bias both within 1/sqrt(fan_in), fan_in = in_channels
  // / groups * kh * kw, the weight's largest value near it.
  for (const auto& [groups, fan_in] : {std::pair<int64_t, double>{1, 16.0 * 9}, {4, 4.0 * 9}}) {
    SCOPED_TRACE("groups " + std::to_string(groups));
    Generator gen(11);
    Conv2d c(16, 32, 3, {.groups = groups}, gen);
    const double cbound = 1.0 / std::sqrt(fan_in);
    double cmx = 0;
    for (float v : c.weight().ToVector<float>()) cmx = std::max(cmx, std::fabs(static_cast<double>(v)));
    EXPECT_LE(cmx, cbound);
    EXPECT_GT(cmx, 0.95 * cbound);
    double bmx = 0;
    for (float v : c.bias().ToVector<float>()) bmx = std::max(bmx, std::fabs(static_cast<double>(v)));
    EXPECT_LE(bmx, cbound);
    EXPECT_GT(bmx, 0.5 * cbound);  // 32 draws: all below half the bound has chance 2^-32
  }
}

// Mean and standard deviation of a tensor's values.
std::pair<double, double> MeanStd(const Tensor& t) {
  const std::vector<float> v = t.ToVector<float>();
  double sum = 0, sq = 0;
  for (float x : v) sum += x;
  const double mean = sum / static_cast<double>(v.size());
  for (float x : v) sq += (x - mean) * (x - mean);
  return {mean, std::sqrt(sq / static_cast<double>(v.size()))};
}

// Fans as PyTorch's _calculate_fan_in_and_fan_out: [out, in] for Linear,
// [out, in / groups, kh, kw] times the kernel's area for Conv2d.
TEST(InitTest, FanInOutOfLinearAndConvWeights) {
  EXPECT_EQ(FanInOut(Linear(784, 512).weight()), (std::pair<int64_t, int64_t>{784, 512}));
  EXPECT_EQ(FanInOut(Conv2d(3, 4, 5).weight()), (std::pair<int64_t, int64_t>{75, 100}));  // torch: (75, 100)
  EXPECT_EQ(FanInOut(Conv2d(16, 32, 3, {.groups = 4}).weight()), (std::pair<int64_t, int64_t>{36, 288}));
  EXPECT_NE(ErrorOf([] { XavierUniform(Zeros({5})); }).find("at least 2 dimensions"), std::string::npos);
  EXPECT_NE(ErrorOf([] { XavierNormal(Zeros({5})); }).find("at least 2 dimensions"), std::string::npos);
}

// Xavier-uniform draws from U(-a, a), a = gain * sqrt(6 / (fan_in + fan_out)):
// every value inside, the largest near a, the spread a / sqrt(3).
TEST(InitTest, XavierUniformBoundAndSpread) {
  Linear lin(200, 100);
  Generator g1(3), g2(3);
  XavierUniform(lin.weight(), Gain("relu"), g1);
  EXPECT_TRUE(lin.weight().requires_grad());
  const double bound = std::sqrt(2.0) * std::sqrt(6.0 / 300.0);
  double mx = 0;
  for (float v : lin.weight().ToVector<float>()) mx = std::max(mx, std::fabs(static_cast<double>(v)));
  EXPECT_LE(mx, bound * (1 + 1e-6));
  EXPECT_GT(mx, 0.99 * bound);
  const auto [mean, std] = MeanStd(lin.weight());
  EXPECT_NEAR(mean, 0.0, 0.02 * bound);  // 20,000 draws: the mean's standard error is 0.004 a
  EXPECT_NEAR(std, bound / std::sqrt(3.0), 0.03 * bound / std::sqrt(3.0));
  const Tensor again = Empty({100, 200});
  XavierUniform(again, Gain("relu"), g2);
  EXPECT_EQ(again.ToVector<float>(), lin.weight().ToVector<float>());  // seeded
  XavierUniform(Empty({0, 3}));                                         // nothing to draw
}

// A negative or non-finite gain is refused by name, before anything is
// drawn; it used to fail in the fill, naming its bounds or deviation.
TEST(InitTest, XavierRefusesANegativeOrNonFiniteGainNamingIt) {
  const Tensor w = Zeros({4, 3});
  for (const double gain : {-1.0, std::nan(""), HUGE_VAL}) {
    const std::string uniform = ErrorOf([&] { XavierUniform(w, gain); });
    EXPECT_EQ(uniform.rfind("XavierUniform: gain must be finite and not negative, got ", 0), 0u) << uniform;
    const std::string normal = ErrorOf([&] { XavierNormal(w, gain); });
    EXPECT_EQ(normal.rfind("XavierNormal: gain must be finite and not negative, got ", 0), 0u) << normal;
  }
  // The value as given: six decimals showed this one as "-0.000000".
  EXPECT_EQ(ErrorOf([&] { XavierUniform(w, -1e-9); }),
            "XavierUniform: gain must be finite and not negative, got -1e-09");
  EXPECT_EQ(ErrorOf([&] { XavierNormal(w, -1.5); }), "XavierNormal: gain must be finite and not negative, got -1.5");
  EXPECT_EQ(w.ToVector<float>(), std::vector<float>(12, 0.0f));
  XavierUniform(w, 0.0);  // a gain of 0 gives zeros, as PyTorch's
  EXPECT_EQ(w.ToVector<float>(), std::vector<float>(12, 0.0f));
}

// A bad mode, nonlinearity, slope or weight shape names the init function called,
// and nothing is drawn. Before, the errors named only the helper that found
// them: "unknown fan mode `fan_avg` (fan_in or fan_out)", "Gain: unknown
// nonlinearity `softmax`", "fan in/out needs a weight with at least 2
// dimensions, got [3]".
TEST(InitTest, KaimingAndXavierErrorsNameTheFunction) {
  const Tensor w = Ones({3, 3});
  EXPECT_EQ(ErrorOf([&] { KaimingUniform(w, 0.0, "fan_avg"); }),
            "KaimingUniform: mode must be fan_in or fan_out, got `fan_avg`");
  EXPECT_EQ(ErrorOf([&] { KaimingNormal(w, 0.0, "fan_in", "softmax"); }),
            "KaimingNormal: Gain: unknown nonlinearity `softmax`");
  EXPECT_EQ(ErrorOf([] { KaimingUniform(Ones({3}), 0.0); }),
            "KaimingUniform: fan in/out needs a weight with at least 2 dimensions, got [3]");
  EXPECT_EQ(ErrorOf([] { XavierNormal(Ones({5})); }),
            "XavierNormal: fan in/out needs a weight with at least 2 dimensions, got [5]");
  // A NaN slope; it was refused by the fill as "UniformFill: bounds must be
  // finite, got low -nan and high nan" or "NormalFill: std nan ...".
  EXPECT_EQ(ErrorOf([&] { KaimingUniform(w, std::nan("")); }),
            "KaimingUniform: a (the negative slope) must not be NaN");
  EXPECT_EQ(ErrorOf([&] { KaimingNormal(w, std::nan("")); }), "KaimingNormal: a (the negative slope) must not be NaN");
  EXPECT_EQ(w.ToVector<float>(), std::vector<float>(9, 1.0f));
  EXPECT_EQ(ErrorOf([&] { KaimingNormal(w, std::nan(""), "fan_out", "relu"); }), "");  // relu reads no slope
  EXPECT_EQ(ErrorOf([&] { KaimingNormal(w, 0.0, "fan_out", "relu"); }), "");
}

// Xavier-normal: N(0, std^2), std = gain * sqrt(2 / (fan_in + fan_out)); on a
// convolution the fans count the kernel's area (144 and 288 here).
TEST(InitTest, XavierNormalStdOnAConvWeight) {
  Conv2d conv(16, 32, 3);
  Generator gen(5);
  XavierNormal(conv.weight(), 1.5, gen);
  const double expected = 1.5 * std::sqrt(2.0 / (144.0 + 288.0));
  const auto [mean, std] = MeanStd(conv.weight());
  EXPECT_NEAR(mean, 0.0, 0.05 * expected);  // 4,608 draws: standard error 0.015 std
  EXPECT_NEAR(std, expected, 0.05 * expected);
  XavierNormal(Empty({3, 0}));
}

}  // namespace
}  // namespace ddp::nn::modules
