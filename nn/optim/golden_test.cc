// Optimizers, schedules and clipping against trajectories exported from
// PyTorch 1.13 by tools/golden/optim_golden.py.

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "nn/optim/adadelta.h"
#include "nn/optim/adam.h"
#include "nn/optim/clip_grad.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/sgd.h"

namespace ddp::nn::optim {
namespace {

const nlohmann::json& Golden() {
  static const nlohmann::json golden = [] {
    std::ifstream in("nn/optim/testdata/optim_golden.json");
    std::stringstream ss;
    ss << in.rdbuf();
    return nlohmann::json::parse(ss.str());
  }();
  return golden;
}

const nlohmann::json& Case(const std::string& name) {
  for (const auto& c : Golden()["optimizers"]) {
    if (c["name"] == name) return c;
  }
  throw std::runtime_error("no golden case " + name);
}

std::unique_ptr<Optimizer> Make(const std::string& name, const nlohmann::json& d, NamedParameters params) {
  const double lr = d["lr"];
  const bool maximize = d.value("maximize", false);
  if (name.rfind("sgd", 0) == 0) {
    return std::make_unique<Sgd>(params, SgdOptions{lr, d["momentum"], d["dampening"], d["weight_decay"],
                                                    d["nesterov"], maximize});
  }
  if (name.rfind("adamw", 0) == 0) {
    return std::make_unique<AdamW>(params, AdamWOptions{lr, d["betas"][0], d["betas"][1], d["eps"],
                                                        d["weight_decay"], d["amsgrad"], maximize});
  }
  if (name.rfind("adam", 0) == 0) {
    return std::make_unique<Adam>(params, AdamOptions{lr, d["betas"][0], d["betas"][1], d["eps"],
                                                      d["weight_decay"], d["amsgrad"], maximize});
  }
  return std::make_unique<Adadelta>(params, AdadeltaOptions{lr, d["rho"], d["eps"], d["weight_decay"], maximize});
}

// Runs one golden trajectory; tolerance is relative to max(1, |expected|):
// PyTorch's vectorized kernels fuse some multiply-adds, ours round each.
void RunCase(const std::string& name, double tol) {
  const nlohmann::json& c = Case(name);
  const DType dtype = c["dtype"] == "float64" ? DType::kFloat64 : DType::kFloat32;
  std::vector<Tensor> params;
  for (size_t i = 0; i < c["init"].size(); ++i) {
    params.push_back(FromVector(c["init"][i].get<std::vector<double>>(), c["shapes"][i].get<Shape>(),
                                {.dtype = dtype}));
  }
  auto opt = Make(name, c["defaults"], NameByPosition(params));
  for (size_t step = 0; step < c["grads"].size(); ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& g = c["grads"][step][i];
      params[i].set_grad(g.is_null() ? Tensor()
                                     : FromVector(g.get<std::vector<double>>(), params[i].shape(), {.dtype = dtype}));
    }
    opt->Step();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto expected = c["after"][step][i].get<std::vector<double>>();
      const auto got = params[i].ToVector<double>();
      for (size_t k = 0; k < expected.size(); ++k) {
        ASSERT_NEAR(got[k], expected[k], tol * std::max(1.0, std::fabs(expected[k])))
            << name << " step " << step << " param " << i << " element " << k;
      }
    }
  }
}

TEST(GoldenSgd, Plain) { RunCase("sgd", 1e-6); }
TEST(GoldenSgd, MomentumWithASkippedGradient) { RunCase("sgd_momentum", 1e-6); }
TEST(GoldenSgd, DampeningAndWeightDecay) { RunCase("sgd_dampening_wd", 1e-6); }
TEST(GoldenSgd, Nesterov) { RunCase("sgd_nesterov", 1e-6); }
TEST(GoldenAdam, Defaults) { RunCase("adam", 1e-6); }
TEST(GoldenAdam, WeightDecayAmsgradWithASkippedGradient) { RunCase("adam_wd_amsgrad", 1e-6); }
TEST(GoldenAdam, Float64) { RunCase("adam_f64", 1e-13); }
TEST(GoldenAdamW, Defaults) { RunCase("adamw", 1e-6); }
TEST(GoldenAdamW, Amsgrad) { RunCase("adamw_amsgrad", 1e-6); }
TEST(GoldenAdadelta, Defaults) { RunCase("adadelta", 1e-6); }
TEST(GoldenAdadelta, WeightDecay) { RunCase("adadelta_wd", 1e-6); }
// maximize: the gradient negated before weight decay, in each optimizer.
TEST(GoldenMaximize, SgdMomentumWeightDecayWithASkippedGradient) { RunCase("sgd_maximize", 1e-6); }
TEST(GoldenMaximize, AdamWeightDecayAmsgrad) { RunCase("adam_maximize", 1e-6); }
TEST(GoldenMaximize, AdamW) { RunCase("adamw_maximize", 1e-6); }
TEST(GoldenMaximize, AdadeltaWeightDecay) { RunCase("adadelta_maximize", 1e-6); }

std::shared_ptr<Schedule> MakeSchedule(const std::string& name) {
  if (name == "step") return StepSchedule(3, 0.5);
  if (name == "cosine") return CosineSchedule(10, 0.001);
  if (name == "linear") return LinearSchedule(0.1, 1.0, 5);
  if (name == "warmup_cosine") return WarmupCosineSchedule(5, 20, 0.1, 0.0);
  throw std::runtime_error("no schedule " + name);
}

TEST(GoldenSchedules, MatchPyTorch) {
  int checked = 0;
  for (const auto& c : Golden()["schedules"]) {
    Tensor p = Zeros({1});
    Sgd opt({{"p", p}}, {.lr = c["base_lr"]});
    LrScheduler sched(opt, MakeSchedule(c["name"]));
    const auto lrs = c["lrs"].get<std::vector<double>>();
    for (size_t t = 0; t < lrs.size(); ++t) {
      if (t > 0) sched.Step();
      // PyTorch updates chainable forms recursively; ours are closed forms.
      ASSERT_NEAR(opt.lr(), lrs[t], 1e-12 + 1e-9 * lrs[t]) << c["name"] << " t=" << t;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 4);
}

TEST(GoldenClipping, MatchesClipGradNorm) {
  for (const auto& c : Golden()["clipping"]) {
    std::vector<Tensor> params = {Zeros({3, 4}), Zeros({7})};
    for (size_t i = 0; i < 2; ++i) {
      params[i].set_grad(FromVector(c["grads"][i].get<std::vector<double>>(), params[i].shape()));
    }
    const double norm_type = c["norm_type"].is_string() ? kInfNorm : c["norm_type"].get<double>();
    const double total = ClipGradNorm(params, c["max_norm"], norm_type);
    EXPECT_NEAR(total, c["total_norm"].get<double>(), 1e-5 * c["total_norm"].get<double>());
    for (size_t i = 0; i < 2; ++i) {
      const auto expected = c["clipped"][i].get<std::vector<double>>();
      const auto got = params[i].grad().ToVector<double>();
      for (size_t k = 0; k < expected.size(); ++k) {
        EXPECT_NEAR(got[k], expected[k], 1e-6 * std::max(1.0, std::fabs(expected[k])));
      }
    }
  }
}

}  // namespace
}  // namespace ddp::nn::optim
