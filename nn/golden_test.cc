// nn/ against PyTorch: layer outputs and gradients, and a 5-step SGD run
// of the peers' CNN, from files exported by
// tools/golden/export_torch_golden.py. Tolerances are stated per check.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "nn/autograd/engine.h"
#include "nn/loss/loss.h"
#include "nn/modules/layers.h"
#include "nn/modules/models.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"

namespace ddp::nn {
namespace {

using json = nlohmann::json;
using modules::Module;

json Load(const std::string& name) {
  const std::string path = "nn/testdata/golden/" + name;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return json::parse(in);
}

Tensor Decode(const json& j) {
  Shape shape = j.at("shape").get<Shape>();
  return FromVector(j.at("data").get<std::vector<double>>(), shape);
}

// |a - b| <= atol + rtol * |b| elementwise, reporting the worst element.
::testing::AssertionResult Close(const Tensor& got, const json& want, double atol, double rtol) {
  const Tensor w = Decode(want);
  if (got.shape() != w.shape()) {
    return ::testing::AssertionFailure() << "shape " << ShapeToString(got.shape()) << " vs " << ShapeToString(w.shape());
  }
  const std::vector<double> a = got.ToVector<double>(), b = w.ToVector<double>();
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(std::fabs(a[i] - b[i]) <= atol + rtol * std::fabs(b[i]))) {
      return ::testing::AssertionFailure() << "element " << i << ": got " << a[i] << ", PyTorch " << b[i];
    }
  }
  return ::testing::AssertionSuccess();
}

class GoldenLayers : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { cases_ = new json(Load("layers.json")); }
  static void TearDownTestSuite() { delete cases_; }

  // Loads the case's parameters into m, runs it on x0, backpropagates
  // sum(y * r) and compares y, dx0, parameter gradients and buffers.
  void Check(const std::string& name, Module& m, double atol = 1e-5, double rtol = 1e-4) {
    SCOPED_TRACE(name);
    const json& c = cases_->at(name);
    modules::StateDict sd;
    for (const auto& [pname, p] : m.GetStateDict()) {
      if (c.contains(pname)) sd.emplace_back(pname, Decode(c.at(pname)));
    }
    m.LoadStateDict(sd, /*strict=*/false);
    Tensor x = Decode(c.at("x0"));
    x.set_requires_grad(true);
    const Tensor y = m.Forward(x);
    EXPECT_TRUE(Close(y, c.at("y"), atol, rtol)) << "output";
    Backward(ops::Sum(ops::Mul(y, Decode(c.at("r")))));
    EXPECT_TRUE(Close(x.grad(), c.at("dx0"), atol, rtol)) << "input gradient";
    for (const auto& [pname, p] : m.NamedParameters()) {
      EXPECT_TRUE(Close(p.grad(), c.at("d" + pname), atol, rtol)) << "gradient of " << pname;
    }
    for (const auto& [bname, b] : m.NamedBuffers()) {
      if (!c.contains("after_" + bname)) continue;
      // Counters (BatchNorm's num_batches_tracked) match exactly.
      const double tol = IsFloating(b.dtype()) ? 1 : 0;
      EXPECT_TRUE(Close(b, c.at("after_" + bname), tol * atol, tol * rtol)) << "buffer " << bname;
    }
  }

  static json* cases_;
};
json* GoldenLayers::cases_ = nullptr;

TEST_F(GoldenLayers, Linear) {
  modules::Linear m(5, 3);
  Check("linear", m);
}

TEST_F(GoldenLayers, Conv2d) {
  modules::Conv2d a(3, 4, 3, {.stride = 2, .padding = 1});
  Check("conv_s2p1", a);
  modules::Conv2d b(4, 6, 3, {.padding = 2, .dilation = 2, .groups = 2});
  Check("conv_dilated_grouped", b);
  modules::Conv2d c(8, 16, 3, {.padding = 1, .bias = false});
  Check("conv_wide", c);
}

TEST_F(GoldenLayers, BatchNorm) {
  // Normalization divides by a batch standard deviation: f32 gradients agree to ~1e-4.
  modules::BatchNorm2d bn(3);
  Check("batchnorm2d_train", bn, 1e-4, 1e-3);
  bn.Eval();
  Check("batchnorm2d_eval", bn, 1e-5, 1e-4);
  modules::BatchNorm1d bn1(6);
  Check("batchnorm1d_train", bn1, 1e-4, 1e-3);
  // Four values per channel: the running variance is the unbiased one (x 4/3).
  modules::BatchNorm2d small(3);
  Check("batchnorm2d_train_small", small, 1e-4, 1e-3);
}

TEST_F(GoldenLayers, Pooling) {
  modules::MaxPool2d a(2);
  Check("maxpool_2", a);
  modules::MaxPool2d b(3, 2, 1, 1, /*ceil_mode=*/true);
  Check("maxpool_3s2p1_ceil", b);
  modules::AvgPool2d c(3, 2, 1, false, /*count_include_pad=*/false);
  Check("avgpool_3s2p1_nopad", c);
  modules::AvgPool2d d(2);
  Check("avgpool_2", d);
  modules::AdaptiveAvgPool2d e(3, 2);
  Check("adaptive_avgpool_3x2", e);
}

TEST_F(GoldenLayers, Activations) {
  modules::GELU gelu;
  Check("gelu", gelu);
  modules::GELU gelu_tanh(true);
  Check("gelu_tanh", gelu_tanh);
  modules::Sigmoid sigmoid;
  Check("sigmoid", sigmoid);
  modules::Tanh tanh;
  Check("tanh", tanh);
  class LogSoftmax1 : public Module {
   public:
    Tensor Forward(const Tensor& x) override { return ops::LogSoftmax(x, 1); }
    using Module::Forward;
    std::string TypeName() const override { return "LogSoftmax"; }
  } log_softmax;
  Check("log_softmax", log_softmax);
}

TEST_F(GoldenLayers, Losses) {
  for (const auto& [name, opts] : std::vector<std::pair<std::string, loss::CrossEntropyOptions>>{
           {"cross_entropy", {}},
           {"cross_entropy_smooth", {.label_smoothing = 0.1}},
           {"cross_entropy_sum", {.reduction = loss::Reduction::kSum}}}) {
    SCOPED_TRACE(name);
    const json& c = cases_->at(name);
    Tensor x = Decode(c.at("x0"));
    x.set_requires_grad(true);
    const Tensor target = FromVectorOf<int64_t>(c.at("target").get<std::vector<int64_t>>(), {x.size(0)});
    const Tensor l = loss::CrossEntropy(x, target, opts);
    EXPECT_TRUE(Close(l, c.at("y"), 1e-6, 1e-5));
    Backward(l);
    EXPECT_TRUE(Close(x.grad(), c.at("dx0"), 1e-6, 1e-5));
  }
  const json& c = cases_->at("mse");
  Tensor a = Decode(c.at("x0"));
  a.set_requires_grad(true);
  const Tensor l = loss::MseLoss(a, Decode(c.at("x1")));
  EXPECT_TRUE(Close(l, c.at("y"), 1e-6, 1e-5));
  Backward(l);
  EXPECT_TRUE(Close(a.grad(), c.at("dx0"), 1e-6, 1e-5));
}

// scale * sin(0.7 * i + salt) over the flat index, as the exporter builds it.
Tensor Formula(const Shape& shape, double salt, double scale) {
  std::vector<double> v(NumElements(shape));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(static_cast<float>(scale * std::sin(0.7 * i + salt)));
  return FromVector(v, shape);
}

TEST(GoldenTraining, CnnFiveSgdSteps) {
  const json g = Load("training.json");
  auto net = modules::MakeCnn();
  {
    NoGradGuard guard;
    int k = 0;
    for (const auto& [name, p] : net->NamedParameters()) {
      const int64_t fan_in = p.dim() > 1 ? p.numel() / p.size(0) : p.numel();
      p.CopyFrom(Formula(p.shape(), k++, 1.0 / std::sqrt(static_cast<double>(fan_in))));
    }
  }
  const int64_t n = g.at("batch").get<int64_t>();
  std::vector<double> xv(n * 784);
  for (size_t i = 0; i < xv.size(); ++i) xv[i] = static_cast<float>(0.5 + 0.5 * std::sin(0.013 * i));
  const Tensor x = FromVector(xv, {n, 1, 28, 28});
  std::vector<int64_t> yv(n);
  for (int64_t i = 0; i < n; ++i) yv[i] = i % 10;
  const Tensor y = FromVectorOf<int64_t>(yv, {n});
  optim::Sgd opt(net->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  const std::vector<double> want = g.at("losses").get<std::vector<double>>();
  for (size_t step = 0; step < want.size(); ++step) {
    opt.ZeroGrad();
    const Tensor l = loss::CrossEntropy(net->Forward(x), y);
    Backward(l);
    opt.Step();
    // f32 sums in a different order than PyTorch's: agreement to ~1e-6 relative per step.
    EXPECT_NEAR(l.Item(), want[step], 2e-5 * want[step]) << "step " << step;
  }
  for (const auto& [name, p] : net->NamedParameters()) {
    SCOPED_TRACE(name);
    const json& w = g.at("params").at(name);
    EXPECT_EQ(p.shape(), w.at("shape").get<Shape>());
    const std::vector<double> v = p.ToVector<double>();
    double sum = 0, sumsq = 0;
    for (double e : v) {
      sum += e;
      sumsq += e * e;
    }
    const double scale = std::sqrt(w.at("sumsq").get<double>() / static_cast<double>(v.size()));
    EXPECT_NEAR(sum, w.at("sum").get<double>(), 1e-4 * scale * std::sqrt(static_cast<double>(v.size())) + 1e-6);
    EXPECT_NEAR(sumsq, w.at("sumsq").get<double>(), 1e-4 * w.at("sumsq").get<double>());
    const auto idx = w.at("index").get<std::vector<int64_t>>();
    const auto vals = w.at("values").get<std::vector<double>>();
    for (size_t k = 0; k < idx.size(); ++k) EXPECT_NEAR(v[idx[k]], vals[k], 1e-5 + 1e-4 * std::fabs(vals[k])) << idx[k];
  }
}

}  // namespace
}  // namespace ddp::nn
