// Optimizers, schedules and clipping against trajectories exported from
// PyTorch 1.13 by tools/golden/optim_golden.py.

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>

#include "nn/optim/adadelta.h"
#include "nn/optim/adagrad.h"
#include "nn/optim/adam.h"
#include "nn/optim/clip_grad.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/rmsprop.h"
#include "nn/optim/sgd.h"

namespace ddp::nn::optim {
namespace {

const nlohmann::json& Golden() {
  static const nlohmann::json golden = [] {
    const char* path = "nn/optim/testdata/optim_golden.json";
    std::ifstream in(path);
    // A missing file would read as JSON's "unexpected end of input".
    if (!in) throw std::runtime_error(std::string("cannot open ") + path + " (the test's data dependency)");
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

// `params`: NamedParameters (one group) or std::vector<ParamGroup>.
template <typename Params>
std::unique_ptr<Optimizer> Make(const std::string& name, const nlohmann::json& d, Params params) {
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
  if (name.rfind("rmsprop", 0) == 0) {
    return std::make_unique<Rmsprop>(params, RmspropOptions{lr, d["alpha"], d["eps"], d["weight_decay"],
                                                            d["momentum"], d["centered"], maximize});
  }
  if (name.rfind("adagrad", 0) == 0) {
    return std::make_unique<Adagrad>(params, AdagradOptions{lr, d["lr_decay"], d["weight_decay"],
                                                            d["initial_accumulator_value"], d["eps"], maximize});
  }
  if (name.rfind("adam", 0) == 0) {
    return std::make_unique<Adam>(params, AdamOptions{lr, d["betas"][0], d["betas"][1], d["eps"],
                                                      d["weight_decay"], d["amsgrad"], maximize});
  }
  return std::make_unique<Adadelta>(params, AdadeltaOptions{lr, d["rho"], d["eps"], d["weight_decay"], maximize});
}

// Steps `opt` with the case's gradients (null: none that step) and compares
// the parameters after each step with the case's; tolerance is relative to
// max(1, |expected|).
void Follow(const nlohmann::json& c, Optimizer& opt, const std::vector<Tensor>& params, DType dtype,
            const std::string& name, double tol) {
  for (size_t step = 0; step < c["grads"].size(); ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& g = c["grads"][step][i];
      params[i].set_grad(g.is_null() ? Tensor()
                                     : FromVector(g.get<std::vector<double>>(), params[i].shape(), {.dtype = dtype}));
    }
    opt.Step();
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
  Follow(c, *opt, params, dtype, name, tol);
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
TEST(GoldenRmsprop, Defaults) { RunCase("rmsprop", 1e-6); }
TEST(GoldenRmsprop, MomentumAndWeightDecayWithASkippedGradient) { RunCase("rmsprop_momentum_wd", 1e-6); }
TEST(GoldenRmsprop, Centered) { RunCase("rmsprop_centered", 1e-6); }
TEST(GoldenRmsprop, CenteredMomentumWeightDecayMaximize) { RunCase("rmsprop_centered_momentum_maximize", 1e-6); }
TEST(GoldenRmsprop, CenteredMomentumFloat64) { RunCase("rmsprop_f64", 1e-13); }
TEST(GoldenAdagrad, Defaults) { RunCase("adagrad", 1e-6); }
TEST(GoldenAdagrad, LrDecayWeightDecayInitialAccumulatorWithASkippedGradient) {
  RunCase("adagrad_lr_decay_wd_init", 1e-6);
}
TEST(GoldenAdagrad, Maximize) { RunCase("adagrad_maximize", 1e-6); }
TEST(GoldenAdagrad, LrDecayFloat64) { RunCase("adagrad_f64", 1e-13); }

// torch's Adagrad makes its sum when it is built: a state saved before the
// first step holds it (step 0), and another Adagrad, made with another
// initial_accumulator_value, that loads that state steps from the saved sum.
TEST(GoldenAdagrad, TheStateBeforeTheFirstStepHoldsTheSum) {
  const nlohmann::json& c = Case("adagrad_state_at_start");
  std::vector<Tensor> params;
  for (size_t i = 0; i < c["init"].size(); ++i) {
    params.push_back(FromVector(c["init"][i].get<std::vector<double>>(), c["shapes"][i].get<Shape>()));
  }
  auto saver = Make("adagrad", c["defaults"], NameByPosition(params));
  NamedTensors state = saver->StateDict();
  const nlohmann::json& torch_state = c["state_before_first_step"];
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string prefix = "state." + std::to_string(i) + ".";
    const Tensor* step = nullptr;
    Tensor* sum = nullptr;
    for (auto& [key, t] : state) {
      if (key == prefix + "step") step = &t;
      if (key == prefix + "sum") sum = &t;
    }
    ASSERT_NE(step, nullptr) << prefix;
    EXPECT_EQ(step->Item(), torch_state[i]["step"].get<double>()) << prefix;
    ASSERT_NE(sum, nullptr) << prefix << "sum is not in the state";
    EXPECT_EQ(sum->ToVector<double>(), torch_state[i]["sum"].get<std::vector<double>>()) << prefix;
    // Loaded as torch's: its values, not the loader's fresh ones.
    *sum = FromVector(torch_state[i]["sum"].get<std::vector<double>>(), params[i].shape());
  }
  nlohmann::json loader_options = c["defaults"];
  loader_options["initial_accumulator_value"] = 0.0;
  auto loader = Make("adagrad", loader_options, NameByPosition(params));
  loader->LoadStateDict(state);
  Follow(c, *loader, params, DType::kFloat32, "adagrad_state_at_start", 1e-6);
}

std::shared_ptr<Schedule> MakeSchedule(const std::string& name) {
  if (name == "step") return StepSchedule(3, 0.5);
  if (name == "cosine") return CosineSchedule(10, 0.001);
  if (name == "linear") return LinearSchedule(0.1, 1.0, 5);
  if (name == "warmup_cosine") return WarmupCosineSchedule(5, 20, 0.1, 0.0);
  throw std::runtime_error("no schedule " + name);
}

// A trajectory over param groups (the golden file's "param_groups"): three
// parameters, split into groups with their own options.
void RunGroupCase(const std::string& name, double tol) {
  const nlohmann::json* found = nullptr;
  for (const auto& c : Golden()["param_groups"]) {
    if (c["name"] == name) found = &c;
  }
  ASSERT_NE(found, nullptr) << "no golden case " << name;
  const nlohmann::json& c = *found;
  std::vector<Tensor> params;
  for (size_t i = 0; i < c["init"].size(); ++i) {
    params.push_back(FromVector(c["init"][i].get<std::vector<double>>(), c["shapes"][i].get<Shape>()));
  }
  std::vector<ParamGroup> groups;
  for (const auto& g : c["groups"]) {
    ParamGroup group;
    for (size_t i : g["params"].get<std::vector<size_t>>()) group.params.emplace_back(std::to_string(i), params[i]);
    group.options = g["options"].get<std::map<std::string, double>>();
    groups.push_back(std::move(group));
  }
  auto opt = Make(name, c["defaults"], groups);
  ASSERT_EQ(opt->num_groups(), c["groups"].size());
  Follow(c, *opt, params, DType::kFloat32, name, tol);
}

TEST(GoldenParamGroups, SgdLrWeightDecayAndMomentumPerGroup) { RunGroupCase("sgd_momentum_groups", 1e-6); }
TEST(GoldenParamGroups, SgdMaximizeInOneGroup) { RunGroupCase("sgd_maximize_group", 1e-6); }
TEST(GoldenParamGroups, AdamWWithANoDecayGroup) { RunGroupCase("adamw_no_decay_group", 1e-6); }
TEST(GoldenParamGroups, AdamBetasEpsAndLrPerGroup) { RunGroupCase("adam_groups", 1e-6); }
TEST(GoldenParamGroups, AdadeltaRhoAndWeightDecayPerGroup) { RunGroupCase("adadelta_groups", 1e-6); }
TEST(GoldenParamGroups, SgdWithAnEmptyGroup) { RunGroupCase("sgd_empty_group", 1e-6); }
TEST(GoldenParamGroups, RmspropAlphaEpsMomentumAndMaximizePerGroup) { RunGroupCase("rmsprop_groups", 1e-6); }
TEST(GoldenParamGroups, AdagradLrDecayWeightDecayAndEpsPerGroup) { RunGroupCase("adagrad_groups", 1e-6); }

TEST(GoldenParamGroups, SchedulesDriveEachGroupFromItsOwnBaseRate) {
  int checked = 0;
  for (const auto& c : Golden()["group_schedules"]["schedules"]) {
    const std::string name = c["name"];
    const auto base = c["base_lrs"].get<std::vector<double>>();
    Sgd opt({{.params = {{"p", Zeros({1})}}}, {.params = {{"q", Zeros({1})}}, .options = {{"lr", base[1]}}}},
            {.lr = base[0]});
    LrScheduler sched(opt, name == "onecycle_cos" ? OneCycleSchedule({.max_lr = 1.0, .total_steps = 30, .cycle_momentum = false})
                                                  : MakeSchedule(name));
    EXPECT_EQ(sched.base_lrs(), base);
    const auto lrs = c["lrs"].get<std::vector<std::vector<double>>>();
    for (size_t t = 0; t < lrs.size(); ++t) {
      if (t > 0) sched.Step();
      for (size_t k = 0; k < 2; ++k) {
        ASSERT_NEAR(opt.lr(k), lrs[t][k], 1e-12 + 1e-9 * lrs[t][k]) << name << " t=" << t << " group " << k;
      }
    }
    ++checked;
  }
  EXPECT_EQ(checked, 3);
}

TEST(GoldenParamGroups, PlateauReducesEachGroupWithItsOwnFloorAndEps) {
  const auto& c = Golden()["group_schedules"]["plateau"][0];
  const auto base = c["base_lrs"].get<std::vector<double>>();
  Sgd opt({{.params = {{"p", Zeros({1})}}}, {.params = {{"q", Zeros({1})}}, .options = {{"lr", base[1]}}}},
          {.lr = base[0]});
  const auto& o = c["options"];
  ReduceLrOnPlateau plateau(opt, {.factor = o["factor"], .patience = o["patience"], .min_lr = o["min_lr"],
                                  .eps = o["eps"]});
  const auto metrics = c["metrics"].get<std::vector<double>>();
  const auto lrs = c["lrs"].get<std::vector<std::vector<double>>>();
  for (size_t t = 0; t < metrics.size(); ++t) {
    plateau.Step(metrics[t]);
    for (size_t k = 0; k < 2; ++k) {
      ASSERT_NEAR(opt.lr(k), lrs[t][k], 1e-15 + 1e-12 * lrs[t][k]) << "t=" << t << " group " << k;
    }
  }
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
