// The schedulers added after the first four (MultiStepLR, ExponentialLR,
// LambdaLR, OneCycleLR, CosineAnnealingWarmRestarts, ReduceLROnPlateau):
// step by step against PyTorch 1.13 (testdata/scheduler_golden.json, made by
// `tools/golden/optim_golden.py --schedulers`), argument checks, and resuming
// from a saved state mid-schedule. OneCycleLR with cycle_momentum (the
// golden file's "momentum_cycles"): the rates, the momenta and the
// parameters of SGD, Adam and AdamW trajectories, step by step.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <numbers>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "nn/optim/adadelta.h"
#include "nn/optim/adam.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/sgd.h"

namespace ddp::nn::optim {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

const nlohmann::json& Golden() {
  static const nlohmann::json golden = [] {
    std::ifstream in("nn/optim/testdata/scheduler_golden.json");
    std::stringstream ss;
    ss << in.rdbuf();
    return nlohmann::json::parse(ss.str());
  }();
  return golden;
}

// The same configurations as more_schedules() in optim_golden.py.
std::shared_ptr<Schedule> MakeSchedule(const std::string& name) {
  if (name == "multistep") return MultiStepSchedule({3, 7, 7, 20}, 0.5);
  if (name == "exponential") return ExponentialSchedule(0.9);
  if (name == "lambda_pow") {
    return LambdaSchedule([](int64_t e) { return std::pow(0.95, static_cast<double>(e)); }, "0.95^t");
  }
  if (name == "lambda_warmup") {
    return LambdaSchedule([](int64_t e) { return std::min(1.0, static_cast<double>(e + 1) / 8); }, "warmup8");
  }
  if (name == "onecycle_cos") return OneCycleSchedule({.max_lr = 1.0, .total_steps = 30, .cycle_momentum = false});
  if (name == "onecycle_linear") {
    return OneCycleSchedule({.max_lr = 0.5, .total_steps = 25, .pct_start = 0.4,
                             .anneal_strategy = AnnealStrategy::kLinear, .div_factor = 10, .final_div_factor = 100, .cycle_momentum = false});
  }
  if (name == "onecycle_three_phase") {
    return OneCycleSchedule({.max_lr = 2.0, .total_steps = 40, .pct_start = 0.25, .three_phase = true, .cycle_momentum = false});
  }
  if (name == "onecycle_three_phase_linear") {
    return OneCycleSchedule({.max_lr = 0.3, .total_steps = 17, .pct_start = 0.3,
                             .anneal_strategy = AnnealStrategy::kLinear, .three_phase = true, .cycle_momentum = false});
  }
  if (name == "warm_restarts") return CosineWarmRestartsSchedule(5, 1, 0.001);
  if (name == "warm_restarts_mult") return CosineWarmRestartsSchedule(3, 2, 0.0);
  if (name == "warm_restarts_mult3") return CosineWarmRestartsSchedule(1, 3, 0.01);
  throw std::runtime_error("no schedule " + name);
}

PlateauOptions PlateauOptionsOf(const nlohmann::json& o) {
  PlateauOptions p;
  if (o.contains("mode")) p.mode = o["mode"] == "max" ? PlateauOptions::Mode::kMax : PlateauOptions::Mode::kMin;
  if (o.contains("threshold_mode")) {
    p.threshold_mode =
        o["threshold_mode"] == "abs" ? PlateauOptions::ThresholdMode::kAbs : PlateauOptions::ThresholdMode::kRel;
  }
  p.factor = o.value("factor", p.factor);
  p.patience = o.value("patience", p.patience);
  p.threshold = o.value("threshold", p.threshold);
  p.cooldown = o.value("cooldown", p.cooldown);
  p.min_lr = o.value("min_lr", p.min_lr);
  p.eps = o.value("eps", p.eps);
  return p;
}

std::vector<double> MetricsOf(const nlohmann::json& c) {
  std::vector<double> out;
  for (const auto& m : c["metrics"]) out.push_back(m.is_null() ? std::nan("") : m.get<double>());
  return out;
}

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// Three phases with pct_start > 0.5: the second phase (max_lr back to the
// initial rate) would end at step 2 * pct_start * total_steps - 2, past the
// cycle, so the rate is still on its way down at total_steps and never
// reaches the third phase, as in PyTorch's OneCycleLR (documented at
// OneCycleOptions::three_phase).
TEST(OneCycle, ThreePhasesWithPctStartOverHalfNeverReachTheLastPhase) {
  const auto s = OneCycleSchedule({.max_lr = 1.0, .total_steps = 20, .pct_start = 0.75, .three_phase = true,
                                   .cycle_momentum = false});
  const double initial = 1.0 / 25, rise_end = 0.75 * 20 - 1, second_end = 2 * 0.75 * 20 - 2;
  EXPECT_DOUBLE_EQ(s->Lr(0, 14), 1.0);
  for (int64_t t = 15; t <= 20; ++t) {
    const double pct = (static_cast<double>(t) - rise_end) / (second_end - rise_end);
    EXPECT_NEAR(s->Lr(0, t), initial + (1.0 - initial) / 2 * (std::cos(std::numbers::pi * pct) + 1), 1e-12) << t;
    EXPECT_GT(s->Lr(0, t), initial) << t;
  }
}

TEST(SchedulerGolden, ClosedFormsMatchPyTorchStepByStep) {
  int checked = 0;
  for (const auto& c : Golden()["schedules"]) {
    Tensor p = Zeros({1});
    Sgd opt({{"p", p}}, {.lr = c["base_lr"]});
    LrScheduler sched(opt, MakeSchedule(c["name"]));
    const auto lrs = c["lrs"].get<std::vector<double>>();
    for (size_t t = 0; t < lrs.size(); ++t) {
      if (t > 0) sched.Step();
      // PyTorch updates ExponentialLR and MultiStepLR by multiplying the
      // previous rate; ours are closed forms: a few ulps apart.
      ASSERT_NEAR(opt.lr(), lrs[t], 1e-15 + 1e-12 * std::fabs(lrs[t])) << c["name"] << " t=" << t;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 11);
}

TEST(SchedulerGolden, ReduceLrOnPlateauMatchesPyTorchStepByStep) {
  int checked = 0;
  for (const auto& c : Golden()["plateau"]) {
    Tensor p = Zeros({1});
    Sgd opt({{"p", p}}, {.lr = c["base_lr"]});
    ReduceLrOnPlateau plateau(opt, PlateauOptionsOf(c["options"]));
    const auto metrics = MetricsOf(c);
    const auto lrs = c["lrs"].get<std::vector<double>>();
    ASSERT_EQ(metrics.size(), lrs.size());
    for (size_t i = 0; i < metrics.size(); ++i) {
      plateau.Step(metrics[i]);
      // The same multiplications in the same order: equal to the bit.
      ASSERT_EQ(opt.lr(), lrs[i]) << c["name"] << " step " << i;
    }
    EXPECT_EQ(plateau.step_count(), static_cast<int64_t>(metrics.size()));
    ++checked;
  }
  EXPECT_EQ(checked, 8);
}

// Saved after k steps and loaded into a fresh scheduler on a fresh
// optimizer, every schedule goes on with the same rates as the original.
TEST(SchedulerState, EveryNewScheduleResumesIdenticallyMidSchedule) {
  for (const auto& c : Golden()["schedules"]) {
    const std::string name = c["name"];
    const size_t steps = c["lrs"].size() - 1;
    for (size_t k : {size_t{1}, steps / 3, steps / 2 + 1}) {
      Tensor pa = Zeros({1}), pb = Zeros({1});
      Sgd a({{"p", pa}}, {.lr = 0.1}), b({{"p", pb}}, {.lr = 0.7});
      LrScheduler sa(a, MakeSchedule(name));
      for (size_t i = 0; i < k; ++i) sa.Step();
      const NamedTensors saved = sa.StateDict();
      LrScheduler sb(b, MakeSchedule(name));
      sb.LoadStateDict(saved);
      EXPECT_EQ(sb.step_count(), static_cast<int64_t>(k)) << name;
      EXPECT_EQ(b.lr(), a.lr()) << name << " k=" << k;
      for (size_t i = k; i < steps; ++i) {
        sa.Step();
        sb.Step();
        ASSERT_EQ(b.lr(), a.lr()) << name << " after " << i + 1 << " steps, resumed at " << k;
      }
    }
  }
}

TEST(SchedulerState, PlateauResumesIdenticallyWithTheOptimizersRate) {
  for (const auto& c : Golden()["plateau"]) {
    const auto metrics = MetricsOf(c);
    const PlateauOptions options = PlateauOptionsOf(c["options"]);
    for (size_t k : {size_t{3}, metrics.size() / 2, metrics.size() - 2}) {
      Tensor pa = Zeros({1}), pb = Zeros({1});
      Sgd a({{"p", pa}}, {.lr = c["base_lr"]}), b({{"p", pb}}, {.lr = 42.0});
      ReduceLrOnPlateau ra(a, options);
      for (size_t i = 0; i < k; ++i) ra.Step(metrics[i]);
      NamedTensors saved = a.StateDict();
      for (auto& kv : ra.StateDict()) saved.push_back(kv);
      // Both from one list, as a checkpoint holds them: each takes its keys.
      b.LoadStateDict(saved);
      ReduceLrOnPlateau rb(b, options);
      rb.LoadStateDict(saved);
      EXPECT_EQ(rb.best(), ra.best());
      EXPECT_EQ(rb.num_bad_steps(), ra.num_bad_steps());
      EXPECT_EQ(rb.cooldown_counter(), ra.cooldown_counter());
      EXPECT_EQ(rb.step_count(), ra.step_count());
      for (size_t i = k; i < metrics.size(); ++i) {
        ra.Step(metrics[i]);
        rb.Step(metrics[i]);
        ASSERT_EQ(b.lr(), a.lr()) << c["name"] << " step " << i << ", resumed at " << k;
      }
    }
  }
}

TEST(SchedulerState, ASavedScheduleOfAnotherKindOrParametersIsRefused) {
  Tensor p = Zeros({1});
  Sgd a({{"p", p}}, {.lr = 0.1}), b({{"p", p}}, {.lr = 0.1}), c({{"p", p}}, {.lr = 0.1});
  LrScheduler sa(a, OneCycleSchedule({.max_lr = 1.0, .total_steps = 30, .cycle_momentum = false}));
  sa.Step();
  LrScheduler sb(b, OneCycleSchedule({.max_lr = 1.0, .total_steps = 31, .cycle_momentum = false}));
  EXPECT_THAT(ErrorOf([&] { sb.LoadStateDict(sa.StateDict()); }),
              HasSubstr("saved with schedule OneCycleLR(max_lr=1, total_steps=30, pct_start=0.3, "
                        "anneal_strategy=cos, div_factor=25, final_div_factor=10000, three_phase=false), this "
                        "scheduler's is OneCycleLR(max_lr=1, total_steps=31,"));
  EXPECT_EQ(sb.step_count(), 0);
  // A LambdaLR without a description is unknown: nothing saved to compare.
  LrScheduler lambda(c, LambdaSchedule([](int64_t) { return 1.0; }));
  for (const auto& [k, t] : lambda.StateDict()) EXPECT_NE(k, "scheduler.schedule");
  EXPECT_EQ(MultiStepSchedule({2, 5}, 0.5)->Describe(), "MultiStepLR(milestones=[2, 5], gamma=0.5)");
  EXPECT_EQ(CosineWarmRestartsSchedule(4, 2, 0.5)->Describe(),
            "CosineAnnealingWarmRestarts(T_0=4, T_mult=2, eta_min=0.5)");
  EXPECT_EQ(ExponentialSchedule(0.25)->Describe(), "ExponentialLR(gamma=0.25)");
  EXPECT_EQ(LambdaSchedule([](int64_t) { return 1.0; }, "one")->Describe(), "LambdaLR(one)");
}

TEST(SchedulerState, PlateauStateErrors) {
  Tensor p = Zeros({1});
  Sgd opt({{"p", p}}, {.lr = 1.0});
  ReduceLrOnPlateau r(opt, {.patience = 1});
  r.Step(1.0);
  r.Step(2.0);
  ReduceLrOnPlateau other(opt, {.patience = 2});
  EXPECT_THAT(ErrorOf([&] { other.LoadStateDict(r.StateDict()); }),
              HasSubstr("saved with ReduceLROnPlateau(mode=min, factor=0.1, patience=1,"));
  EXPECT_EQ(other.step_count(), 0);
  EXPECT_EQ(ErrorOf([&] { other.CheckStateDict({}); }),
            "ReduceLROnPlateau.LoadStateDict: missing f64 scalar `plateau.best`");
  NamedTensors bad = r.StateDict();
  bad[1].second = FromVectorOf<int64_t>({-1}, {});
  ReduceLrOnPlateau same(opt, {.patience = 1});
  EXPECT_THAT(ErrorOf([&] { same.LoadStateDict(bad); }), HasSubstr("plateau.num_bad_steps -1"));
  EXPECT_EQ(same.num_bad_steps(), 0);
  bad = r.StateDict();
  bad.emplace_back("plateau.extra", Zeros({1}));
  EXPECT_THAT(ErrorOf([&] { same.LoadStateDict(bad); }), HasSubstr("unexpected `plateau.extra`"));
  same.LoadStateDict(r.StateDict());
  EXPECT_EQ(same.best(), 1.0);
  EXPECT_EQ(same.num_bad_steps(), 1);
}

// A saved count of the largest i64 loaded, and the next Step's count
// wrapped to the most negative one (signed overflow; StepLR then asked for
// the rate at a negative step). Each such count is refused naming it, and
// nothing changes; one less loads.
TEST(SchedulerState, ACountTheNextStepWouldOverflowIsRefused) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  Tensor p = Zeros({1});
  Sgd opt({{"p", p}}, {.lr = 1.0});
  {
    LrScheduler s(opt, StepSchedule(kMax, 0.5));
    NamedTensors state = s.StateDict();
    for (auto& [k, t] : state) {
      if (k == "scheduler.step") t = FromVectorOf<int64_t>({kMax}, {});
    }
    EXPECT_EQ(ErrorOf([&] { s.LoadStateDict(state); }),
              "LrScheduler.LoadStateDict: scheduler.step 9223372036854775807 is the largest i64: the next "
              "Step's count would overflow");
    EXPECT_EQ(s.step_count(), 0);
    for (auto& [k, t] : state) {
      if (k == "scheduler.step") t = FromVectorOf<int64_t>({kMax - 1}, {});
    }
    s.LoadStateDict(state);
    s.Step();
    EXPECT_EQ(s.step_count(), kMax);
    EXPECT_EQ(opt.lr(), 0.5);
  }
  ReduceLrOnPlateau r(opt, {.patience = 1});
  for (const std::string key : {"plateau.num_bad_steps", "plateau.step"}) {
    NamedTensors state = r.StateDict();
    for (auto& [k, t] : state) {
      if (k == key) t = FromVectorOf<int64_t>({kMax}, {});
    }
    EXPECT_EQ(ErrorOf([&] { r.LoadStateDict(state); }),
              "ReduceLROnPlateau.LoadStateDict: " + key +
                  " 9223372036854775807 is the largest i64: the next Step's count would overflow");
  }
  EXPECT_EQ(r.num_bad_steps(), 0);
  EXPECT_EQ(r.step_count(), 0);
}

// The plateau scheduler reduces whatever rate the optimizer has: one set by
// hand in between is the one multiplied by factor.
TEST(ReduceLrOnPlateau, ReducesTheRateSetWithSetLr) {
  Tensor p = Zeros({1});
  Sgd opt({{"p", p}}, {.lr = 1.0});
  ReduceLrOnPlateau r(opt, {.factor = 0.5, .patience = 0});
  r.Step(3.0);
  EXPECT_EQ(opt.lr(), 1.0);
  opt.set_lr(0.25);
  r.Step(3.0);  // no improvement, patience 0: reduced
  EXPECT_EQ(opt.lr(), 0.125);
  r.Step(1.0);  // better: kept
  EXPECT_EQ(opt.lr(), 0.125);
  EXPECT_EQ(r.best(), 1.0);
  // Under min_lr already: max(lr * factor, min_lr) is above it, not set.
  ReduceLrOnPlateau floor(opt, {.factor = 0.5, .patience = 0, .min_lr = 0.2});
  floor.Step(1.0);
  floor.Step(1.0);
  EXPECT_EQ(opt.lr(), 0.125);
}

// In min mode with a relative threshold, a metric counts as better only
// below best * (1 - threshold): from threshold 1 on that is NaN or -inf at
// the first step (best starts at +inf) and 0 or less after, so no metric
// would ever count and the rate would be cut every patience + 1 steps
// whatever the metric did (PyTorch accepts it so). It is refused, naming
// threshold; just below 1, and every threshold in the other modes, leaves
// improvement possible and is kept.
TEST(ReduceLrOnPlateau, ThresholdNoMetricCouldBeatIsRefused) {
  Tensor p = Zeros({1});
  Sgd opt({{"p", p}}, {.lr = 1.0});
  for (const auto& [threshold, text] : {std::pair{1.0, "1"}, std::pair{1.5, "1.5"}, std::pair{100.0, "100"}}) {
    EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.patience = 0, .threshold = threshold}); }),
              std::string("ReduceLROnPlateau: threshold ") + text +
                  " must be < 1 with mode=min and threshold_mode=rel: a metric counts as better only below "
                  "best * (1 - threshold), which no metric would ever be")
        << threshold;
  }
  EXPECT_EQ(opt.lr(), 1.0);
  // Just below 1: a falling loss is still an improvement, so the rate stays.
  ReduceLrOnPlateau r(opt, {.patience = 0, .threshold = 0.5});
  for (const double loss : {1.0, 0.4, 0.1}) r.Step(loss);
  EXPECT_EQ(r.best(), 0.1);
  EXPECT_EQ(opt.lr(), 1.0);
  // kMax (rel or abs) and kMin with kAbs: any finite threshold can be beaten.
  using M = PlateauOptions::Mode;
  using T = PlateauOptions::ThresholdMode;
  for (const auto& [mode, tmode] : {std::pair{M::kMax, T::kRel}, std::pair{M::kMax, T::kAbs},
                                    std::pair{M::kMin, T::kAbs}}) {
    Sgd o({{"p", p}}, {.lr = 1.0});
    ReduceLrOnPlateau s(o, {.mode = mode, .patience = 0, .threshold = 5.0, .threshold_mode = tmode});
    const double sign = mode == M::kMax ? 1.0 : -1.0;
    for (const double m : {1.0, 100.0, 1e4}) s.Step(sign * m);
    EXPECT_EQ(s.best(), sign * 1e4);
    EXPECT_EQ(o.lr(), 1.0);
  }
}

// A param group added to the optimizer after the plateau scheduler was
// made is reduced with the others, as PyTorch's (which reads param_groups
// at each reduction); it was left at its rate.
TEST(ReduceLrOnPlateau, ReducesAParamGroupAddedAfterIt) {
  Tensor p = Zeros({1}), q = Zeros({1});
  Sgd opt({{"p", p}}, {.lr = 1.0});
  ReduceLrOnPlateau r(opt, {.factor = 0.5, .patience = 0});
  opt.AddParamGroup({.params = {{"q", q}}, .options = {{"lr", 0.4}}});
  r.Step(3.0);
  r.Step(3.0);  // no improvement, patience 0: both reduced
  EXPECT_EQ(opt.lr(0), 0.5);
  EXPECT_EQ(opt.lr(1), 0.2);
}

// Several targets are driven as the groups of one optimizer: each from its
// own base rate, the state a base rate per group, and a rate one target
// refuses puts back those already set.
TEST(LrTargets, SeveralTargetsFollowTheScheduleAsParamGroups) {
  Tensor a = Zeros({1}), b = Zeros({1});
  Sgd opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}, .options = {{"lr", 0.5}}}}, {.lr = 1.0});
  LrScheduler reference(opt, StepSchedule(2, 0.1));
  std::vector<double> rates = {1.0, 0.5};
  double refuse_above = 1e9;  // the second target throws for a rate above this
  std::vector<LrTarget> targets = {
      {[&] { return rates[0]; }, [&](double r) { rates[0] = r; }},
      {[&] { return rates[1]; },
       [&](double r) {
         if (r > refuse_above) throw std::invalid_argument("too high");
         rates[1] = r;
       }}};
  LrScheduler sched(targets, StepSchedule(2, 0.1));
  for (int i = 0; i < 5; ++i) {
    sched.Step();
    reference.Step();
    EXPECT_EQ(rates[0], opt.lr(0)) << "step " << i;
    EXPECT_EQ(rates[1], opt.lr(1)) << "step " << i;
  }
  const NamedTensors state = sched.StateDict(), want = reference.StateDict();
  ASSERT_EQ(state.size(), want.size());
  for (size_t i = 0; i < state.size(); ++i) {
    EXPECT_EQ(state[i].first, want[i].first);
    const Tensor x = state[i].second.To(DType::kFloat64), y = want[i].second.To(DType::kFloat64);
    ASSERT_EQ(x.shape(), y.shape()) << state[i].first;
    for (int64_t j = 0; j < x.numel(); ++j) EXPECT_EQ(x.data<double>()[j], y.data<double>()[j]) << state[i].first;
  }
  // A refused rate: both targets keep theirs.
  LrScheduler restarted(targets, StepSchedule(2, 0.1));  // bases 0.001 and 0.0005 now
  rates = {1.0, 0.5};
  refuse_above = 0.001;  // the restored step's rates are 0.01 and 0.005
  const std::vector<double> before = rates;
  EXPECT_THROW(restarted.LoadStateDict(state), std::invalid_argument);
  EXPECT_EQ(rates, before);
  // Plateau over targets reduces each.
  refuse_above = 1e9;
  ReduceLrOnPlateau plateau(targets, {.factor = 0.5, .patience = 0});
  plateau.Step(1.0);
  plateau.Step(1.0);
  EXPECT_EQ(rates, (std::vector<double>{0.5, 0.25}));
  // Refusals name what is wrong.
  EXPECT_EQ(ErrorOf([] { LrScheduler(std::vector<LrTarget>{}, StepSchedule(2)); }),
            "LrScheduler: no learning-rate targets");
  std::vector<LrTarget> half = targets;
  half[1].set = nullptr;
  EXPECT_EQ(ErrorOf([&] { LrScheduler(half, StepSchedule(2)); }), "LrScheduler: target 1 lacks get or set");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(half, {}); }), "ReduceLROnPlateau: target 1 lacks get or set");
  EXPECT_THAT(ErrorOf([&] { LrScheduler(targets, OneCycleSchedule({.max_lr = 1, .total_steps = 10})); }),
              HasSubstr("a bare learning-rate target does not have"));
}

TEST(ScheduleArguments, AreCheckedWithMessagesNamingThem) {
  EXPECT_EQ(ErrorOf([] { MultiStepSchedule({5, 3}); }),
            "MultiStepLR: milestones must be ascending and >= 0, milestone 1 is 3 after 5");
  EXPECT_THAT(ErrorOf([] { MultiStepSchedule({-1}); }), HasSubstr("milestone 0 is -1"));
  EXPECT_EQ(ErrorOf([] { MultiStepSchedule({1}, -0.5); }), "MultiStepLR: gamma -0.5 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([] { ExponentialSchedule(-1); }), "ExponentialLR: gamma -1 must be finite and >= 0");
  EXPECT_THAT(ErrorOf([] { ExponentialSchedule(std::nan("")); }), HasSubstr("ExponentialLR: gamma nan"));
  EXPECT_EQ(ErrorOf([] { LambdaSchedule(nullptr); }), "LambdaLR: factor is an empty function");
  EXPECT_EQ(ErrorOf([] { CosineWarmRestartsSchedule(0); }), "CosineAnnealingWarmRestarts: T_0 0 must be >= 1");
  EXPECT_EQ(ErrorOf([] { CosineWarmRestartsSchedule(2, 0); }), "CosineAnnealingWarmRestarts: T_mult 0 must be >= 1");
  EXPECT_EQ(ErrorOf([] { CosineWarmRestartsSchedule(2, 1, -1); }),
            "CosineAnnealingWarmRestarts: eta_min -1 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([] { OneCycleSchedule({.max_lr = 1, .total_steps = 0, .cycle_momentum = false}); }),
            "OneCycleLR: total_steps 0 must be >= 1");
  EXPECT_EQ(ErrorOf([] { OneCycleSchedule({.max_lr = 0, .total_steps = 10, .cycle_momentum = false}); }),
            "OneCycleLR: max_lr 0 must be finite and > 0");
  EXPECT_EQ(ErrorOf([] { OneCycleSchedule({.max_lr = 1, .total_steps = 10, .pct_start = 1.5, .cycle_momentum = false}); }),
            "OneCycleLR: pct_start 1.5 must be in [0, 1]");
  EXPECT_EQ(ErrorOf([] { OneCycleSchedule({.max_lr = 1, .total_steps = 10, .pct_start = -0.1, .cycle_momentum = false}); }),
            "OneCycleLR: pct_start -0.1 must be in [0, 1]");
  EXPECT_EQ(ErrorOf([] { OneCycleSchedule({.max_lr = 1, .total_steps = 10, .div_factor = 0, .cycle_momentum = false}); }),
            "OneCycleLR: div_factor 0 must be finite and > 0");
  EXPECT_EQ(ErrorOf([] { OneCycleSchedule({.max_lr = 1, .total_steps = 10, .final_div_factor = -1, .cycle_momentum = false}); }),
            "OneCycleLR: final_div_factor -1 must be finite and > 0");
  EXPECT_THAT(ErrorOf([] { OneCycleSchedule({.max_lr = 1, .total_steps = 10, .pct_start = 0.1, .cycle_momentum = false}); }),
              HasSubstr("leaves the rising phase no steps"));
  EXPECT_THAT(ErrorOf([] { OneCycleSchedule({.max_lr = 1, .total_steps = 10,
                                             .anneal_strategy = static_cast<AnnealStrategy>(7), .cycle_momentum = false}); }),
              HasSubstr("unknown anneal_strategy 7"));
  Tensor p = Zeros({1});
  Sgd opt({{"p", p}}, {.lr = 1.0});
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.factor = 1.0}); }), "ReduceLROnPlateau: factor 1 must be in [0, 1)");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.factor = -0.1}); }),
            "ReduceLROnPlateau: factor -0.1 must be in [0, 1)");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.patience = -1}); }), "ReduceLROnPlateau: patience -1 must be >= 0");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.cooldown = -2}); }), "ReduceLROnPlateau: cooldown -2 must be >= 0");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.threshold = -1}); }),
            "ReduceLROnPlateau: threshold -1 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.min_lr = -1}); }),
            "ReduceLROnPlateau: min_lr -1 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.eps = std::numeric_limits<double>::infinity()}); }),
            "ReduceLROnPlateau: eps inf must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(LrTarget{}, {}); }), "ReduceLROnPlateau: the target lacks get or set");
  EXPECT_EQ(opt.lr(), 1.0);
}

// PyTorch raises past total_steps; so does Step here, counting nothing.
TEST(OneCycle, SteppingPastTotalStepsThrowsAndChangesNothing) {
  Tensor p = Zeros({1});
  Sgd opt({{"p", p}}, {.lr = 123.0});
  LrScheduler s(opt, OneCycleSchedule({.max_lr = 1.0, .total_steps = 4, .pct_start = 0.5, .cycle_momentum = false}));
  EXPECT_NEAR(opt.lr(), 1.0 / 25, 1e-15);  // the optimizer's own rate is not used
  for (int i = 0; i < 4; ++i) s.Step();
  const double last = opt.lr();
  EXPECT_THROW(s.Step(), std::out_of_range);
  EXPECT_EQ(s.step_count(), 4);
  EXPECT_EQ(opt.lr(), last);
  // Linear annealing at t = total_steps goes below zero, as PyTorch's does
  // (-0.0328 for the golden onecycle_linear case): the optimizer refuses it.
  Sgd lin_opt({{"p", p}}, {.lr = 1.0});
  LrScheduler lin(lin_opt, OneCycleSchedule({.max_lr = 0.5, .total_steps = 25, .pct_start = 0.4,
                                             .anneal_strategy = AnnealStrategy::kLinear, .div_factor = 10,
                                             .final_div_factor = 100, .cycle_momentum = false}));
  for (int i = 0; i < 24; ++i) lin.Step();
  EXPECT_DOUBLE_EQ(lin_opt.lr(), 0.5 / 10 / 100);
  EXPECT_THAT(ErrorOf([&] { lin.Step(); }), HasSubstr("learning rate -0.03279999999999994 "));
  EXPECT_EQ(lin.step_count(), 24);
}

// A state saved past the end of a shorter cycle: refused as invalid_argument
// naming both schedules and the step, not an out_of_range escaping the
// check (checkpoint restores collect invalid_argument problems).
TEST(OneCycle, AStateSavedPastTheCycleIsRefusedNamingTheStep) {
  Tensor p = Zeros({1});
  Sgd long_opt({{"p", p}}, {.lr = 1.0}), short_opt({{"p", p}}, {.lr = 1.0});
  LrScheduler long_cycle(long_opt, OneCycleSchedule({.max_lr = 1.0, .total_steps = 10, .cycle_momentum = false}));
  for (int i = 0; i < 8; ++i) long_cycle.Step();
  LrScheduler short_cycle(short_opt, OneCycleSchedule({.max_lr = 1.0, .total_steps = 5, .cycle_momentum = false}));
  const NamedTensors saved = long_cycle.StateDict();
  std::string error;
  try {
    short_cycle.CheckStateDict(saved);
  } catch (const std::invalid_argument& e) {
    error = e.what();
  } catch (const std::exception& e) {
    error = std::string("another kind of error: ") + e.what();
  }
  EXPECT_THAT(error, HasSubstr("LrScheduler.LoadStateDict: the state was saved with schedule"));
  EXPECT_THAT(error, HasSubstr("scheduler.step 8 is outside the schedule"));
  EXPECT_EQ(short_cycle.step_count(), 0);
}

// Long runs: the restart search and the milestone count stay exact.
TEST(WarmRestarts, RestartsFallExactlyOnTheirSteps) {
  const auto s = CosineWarmRestartsSchedule(3, 2, 0.0);
  // Cycles of 3, 6, 12, 24, ...: restarts at 3, 9, 21, 45, ..., 3 * (2^k - 1).
  for (int k = 1; k < 40; ++k) {
    const int64_t restart = 3 * ((int64_t{1} << k) - 1);
    EXPECT_EQ(s->Lr(2.0, restart), 2.0) << restart;
    EXPECT_LT(s->Lr(2.0, restart - 1), 2.0) << restart;
  }
  EXPECT_TRUE(std::isfinite(s->Lr(1.0, std::numeric_limits<int64_t>::max())));
}

// The same configurations as momentum_cycles() in optim_golden.py.
std::shared_ptr<Schedule> MomentumCycle(const std::string& name) {
  if (name == "sgd_momentum_two_groups") return OneCycleSchedule({.max_lr = 0.2, .total_steps = 20});
  if (name == "adamw_beta1") {
    return OneCycleSchedule(
        {.max_lr = 0.05, .total_steps = 16, .pct_start = 0.4, .base_momentum = 0.8, .max_momentum = 0.9});
  }
  if (name == "sgd_nesterov_three_phase_linear") {
    return OneCycleSchedule({.max_lr = 0.3, .total_steps = 24, .pct_start = 0.25,
                             .anneal_strategy = AnnealStrategy::kLinear, .three_phase = true,
                             .base_momentum = 0.75, .max_momentum = 0.92});
  }
  if (name == "adam_three_phase") {
    return OneCycleSchedule({.max_lr = 0.02, .total_steps = 30, .pct_start = 0.2, .three_phase = true});
  }
  if (name == "sgd_per_group_lists") {
    return OneCycleSchedule({.total_steps = 18,
                             .pct_start = 0.4,
                             .group_max_lr = {0.2, 0.05},
                             .group_base_momentum = {0.8, 0.7},
                             .group_max_momentum = {0.9, 0.95}});
  }
  if (name == "adamw_per_group_max_lr_three_phase") {
    return OneCycleSchedule({.total_steps = 21,
                             .anneal_strategy = AnnealStrategy::kLinear,
                             .three_phase = true,
                             .group_max_lr = {0.01, 0.04},
                             .group_max_momentum = {0.93, 0.9}});
  }
  throw std::runtime_error("no momentum cycle " + name);
}

// The case's optimizer over its param groups (PyTorch's defaults as saved).
std::unique_ptr<Optimizer> MakeOptimizer(const nlohmann::json& c, const std::vector<Tensor>& params) {
  std::vector<ParamGroup> groups;
  for (const auto& g : c["groups"]) {
    ParamGroup group;
    for (size_t i : g["params"].get<std::vector<size_t>>()) group.params.emplace_back(std::to_string(i), params[i]);
    group.options = g["options"].get<std::map<std::string, double>>();
    groups.push_back(std::move(group));
  }
  const std::string name = c["name"];
  const auto& d = c["defaults"];
  if (name.rfind("sgd", 0) == 0) {
    return std::make_unique<Sgd>(groups, SgdOptions{d["lr"], d["momentum"], d["dampening"], d["weight_decay"],
                                                    d["nesterov"], d["maximize"]});
  }
  if (name.rfind("adamw", 0) == 0) {
    return std::make_unique<AdamW>(groups, AdamWOptions{d["lr"], d["betas"][0], d["betas"][1], d["eps"],
                                                        d["weight_decay"], d["amsgrad"], d["maximize"]});
  }
  return std::make_unique<Adam>(groups, AdamOptions{d["lr"], d["betas"][0], d["betas"][1], d["eps"],
                                                    d["weight_decay"], d["amsgrad"], d["maximize"]});
}

std::vector<Tensor> InitialParams(const nlohmann::json& c) {
  std::vector<Tensor> params;
  for (size_t i = 0; i < c["init"].size(); ++i) {
    params.push_back(FromVector(c["init"][i].get<std::vector<double>>(), c["shapes"][i].get<Shape>()));
  }
  return params;
}

// Rates and momenta are the same closed forms in f64 as PyTorch's: equal to
// the bit. Parameters are f32 updates: the golden optimizer tests' 1e-6.
TEST(OneCycleMomentum, RatesMomentaAndParametersFollowPyTorch) {
  int checked = 0;
  for (const auto& c : Golden()["momentum_cycles"]) {
    const std::string name = c["name"];
    std::vector<Tensor> params = InitialParams(c);
    auto opt = MakeOptimizer(c, params);
    LrScheduler sched(*opt, MomentumCycle(name));
    const auto lrs = c["lrs"].get<std::vector<std::vector<double>>>();
    const auto momenta = c["momenta"].get<std::vector<std::vector<double>>>();
    ASSERT_EQ(opt->num_groups(), lrs[0].size());
    for (size_t t = 0; t < lrs.size(); ++t) {
      if (t > 0) {
        for (size_t i = 0; i < params.size(); ++i) {
          params[i].set_grad(FromVector(c["grads"][t - 1][i].get<std::vector<double>>(), params[i].shape()));
        }
        opt->Step();
        for (size_t i = 0; i < params.size(); ++i) {
          const auto expected = c["after"][t - 1][i].get<std::vector<double>>();
          const auto got = params[i].ToVector<double>();
          for (size_t e = 0; e < expected.size(); ++e) {
            ASSERT_NEAR(got[e], expected[e], 1e-6 * std::max(1.0, std::fabs(expected[e])))
                << name << " step " << t << " param " << i << " element " << e;
          }
        }
        sched.Step();
      }
      for (size_t k = 0; k < opt->num_groups(); ++k) {
        ASSERT_EQ(opt->lr(k), lrs[t][k]) << name << " t=" << t << " group " << k;
        ASSERT_EQ(opt->momentum(k), momenta[t][k]) << name << " t=" << t << " group " << k;
      }
    }
    ++checked;
  }
  EXPECT_EQ(checked, 6);
}

// Per-group lists: their lengths, their values and the optimizer's groups
// are checked, naming the field; the lists are part of the description, so
// a state saved with other lists is refused; SequentialSchedule refuses a
// part with lists; and without momentum cycling the rate alone follows the
// list (a bare target with one group included).
TEST(OneCycleGroups, ListsAreCheckedAndFollowedPerGroup) {
  EXPECT_EQ(ErrorOf([] {
              OneCycleSchedule({.total_steps = 10, .group_max_lr = {0.1, 0.2}, .group_base_momentum = {0.8}});
            }),
            "OneCycleLR: group_base_momentum has 1 values and group_max_lr 2: give one value per param group in "
            "each");
  EXPECT_EQ(ErrorOf([] { OneCycleSchedule({.max_lr = 1, .total_steps = 10, .group_max_lr = {0.1, 0.2}}); }),
            "OneCycleLR: both max_lr 1 and group_max_lr are given; leave max_lr 0 with the list");
  EXPECT_EQ(ErrorOf([] { OneCycleSchedule({.total_steps = 10, .group_max_lr = {0.1, -0.2}}); }),
            "OneCycleLR: group_max_lr[1] -0.2 must be finite and > 0");
  EXPECT_EQ(ErrorOf([] {
              OneCycleSchedule({.max_lr = 1, .total_steps = 10, .group_max_momentum = {0.9, std::nan("")}});
            }),
            "OneCycleLR: group_max_momentum[1] nan must be finite and >= 0");
  Tensor a = Zeros({1}), b = Zeros({1}), c = Zeros({1});
  Sgd three({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}, ParamGroup{.params = {{"c", c}}}},
            {.lr = 0.1, .momentum = 0.9});
  const OneCycleOptions two = {.total_steps = 10, .group_max_lr = {0.1, 0.2}, .group_max_momentum = {0.9, 0.97}};
  EXPECT_THAT(ErrorOf([&] { LrScheduler(three, OneCycleSchedule(two)); }),
              AllOf(HasSubstr("LrScheduler: OneCycleLR(max_lr=[0.1, 0.2], total_steps=10,"),
                    HasSubstr("max_momentum=[0.9, 0.97]) has values for 2 param group(s), and the SGD optimizer "
                              "has 3")));
  EXPECT_EQ(three.lr(0), 0.1);
  EXPECT_THAT(ErrorOf([&] { SequentialSchedule({OneCycleSchedule(two), StepSchedule(2)}, {5}); }),
              HasSubstr("has values per param group, which SequentialLR does not pass on"));

  Sgd pair({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}}, {.lr = 0.1, .momentum = 0.9});
  LrScheduler sched(pair, OneCycleSchedule(two));
  EXPECT_DOUBLE_EQ(pair.lr(0), 0.1 / 25);
  EXPECT_DOUBLE_EQ(pair.lr(1), 0.2 / 25);
  EXPECT_EQ(pair.momentum(0), 0.9);
  EXPECT_EQ(pair.momentum(1), 0.97);
  for (int i = 0; i < 2; ++i) sched.Step();  // the peak: step 0.3 * 10 - 1
  EXPECT_DOUBLE_EQ(pair.lr(0), 0.1);
  EXPECT_DOUBLE_EQ(pair.lr(1), 0.2);
  EXPECT_DOUBLE_EQ(pair.momentum(0), 0.85);
  EXPECT_DOUBLE_EQ(pair.momentum(1), 0.85);
  const NamedTensors state = sched.StateDict();
  Sgd other({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}}, {.lr = 0.1, .momentum = 0.9});
  OneCycleOptions swapped = two;
  swapped.group_max_lr = {0.2, 0.1};
  {
    LrScheduler other_sched(other, OneCycleSchedule(swapped));
    EXPECT_THAT(ErrorOf([&] { other_sched.LoadStateDict(state); }),
                HasSubstr("the state was saved with schedule OneCycleLR(max_lr=[0.1, 0.2]"));
  }
  LrScheduler same_sched(other, OneCycleSchedule(two));
  same_sched.LoadStateDict(state);  // the state of its own lists loads
  EXPECT_DOUBLE_EQ(other.lr(1), 0.2);
  EXPECT_DOUBLE_EQ(other.momentum(1), 0.85);

  double rate = 0;
  LrScheduler one(LrTarget{[&] { return rate; }, [&](double r) { rate = r; }},
                  OneCycleSchedule({.total_steps = 10, .cycle_momentum = false, .group_max_lr = {0.5}}));
  EXPECT_NEAR(rate, 0.5 / 25, 1e-15);
}

TEST(OneCycleMomentum, AdadeltaIsRefusedNamingItAndLeftAsItWas) {
  Tensor p = Zeros({1});
  Adadelta opt({{"p", p}}, {.lr = 0.5});
  EXPECT_THAT(ErrorOf([&] { LrScheduler(opt, OneCycleSchedule({.max_lr = 1.0, .total_steps = 10})); }),
              AllOf(HasSubstr("LrScheduler: OneCycleLR(max_lr=1, total_steps=10,"),
                    HasSubstr("cycle_momentum=true, base_momentum=0.85, max_momentum=0.95) cycles momentum: "
                              "Adadelta has no momentum"),
                    HasSubstr("cycle_momentum=false")));
  EXPECT_EQ(opt.lr(), 0.5);
  // Not claimed: a rate-only OneCycle may drive it.
  LrScheduler rate_only(opt, OneCycleSchedule({.max_lr = 1.0, .total_steps = 10, .cycle_momentum = false}));
  EXPECT_NEAR(opt.lr(), 1.0 / 25, 1e-15);
}

TEST(OneCycleMomentum, SgdWithoutMomentumIsRefusedNamingTheGroup) {
  Tensor p = Zeros({1}), q = Zeros({1});
  Sgd opt({{.params = {{"p", p}}}, {.params = {{"q", q}}, .options = {{"lr", 0.2}}}}, {.lr = 0.1});
  EXPECT_THAT(ErrorOf([&] { LrScheduler(opt, OneCycleSchedule({.max_lr = 1.0, .total_steps = 10})); }),
              AllOf(HasSubstr("cycles momentum: SGD: param group 0's momentum is 0"),
                    HasSubstr("keeps no momentum buffer"),
                    HasSubstr("for the rate alone, make the schedule with cycle_momentum = false")));
  EXPECT_EQ(opt.lr(0), 0.1);
  EXPECT_EQ(opt.lr(1), 0.2);
  EXPECT_EQ(opt.momentum(1), 0.0);
}

TEST(OneCycleMomentum, MomentaTheOptimizerRefusesAreRefusedAtConstruction) {
  Tensor p = Zeros({1});
  Adam opt({{"p", p}}, {.lr = 0.5});
  EXPECT_THAT(ErrorOf([&] {
                LrScheduler(opt, OneCycleSchedule({.max_lr = 1.0, .total_steps = 10, .max_momentum = 1.0}));
              }),
              HasSubstr("Adam: param group 0's beta1 1 refused"));
  EXPECT_EQ(opt.lr(), 0.5);
  EXPECT_EQ(opt.momentum(0), 0.9);
  EXPECT_EQ(ErrorOf([] { OneCycleSchedule({.max_lr = 1.0, .total_steps = 10, .base_momentum = -0.1}); }),
            "OneCycleLR: base_momentum -0.1 must be finite and >= 0");
  // Not checked when not cycled, as PyTorch ignores them then.
  EXPECT_NO_THROW(OneCycleSchedule({.max_lr = 1.0, .total_steps = 10, .cycle_momentum = false, .max_momentum = -1}));
  // A bare rate has no momentum; SequentialLR would leave it where it ended.
  double rate = 0.1;
  EXPECT_THAT(ErrorOf([&] {
                LrScheduler(LrTarget{[&] { return rate; }, [&](double r) { rate = r; }},
                            OneCycleSchedule({.max_lr = 1.0, .total_steps = 10}));
              }),
              HasSubstr("cycles momentum, which a bare learning-rate target does not have"));
  EXPECT_THAT(ErrorOf([] {
                SequentialSchedule({OneCycleSchedule({.max_lr = 1.0, .total_steps = 10}), ExponentialSchedule(0.5)},
                                   {10});
              }),
              HasSubstr("SequentialLR: schedule 0 (OneCycleLR("));
}

// Stepping past the cycle throws and changes neither the rate nor the momentum.
TEST(OneCycleMomentum, ARefusedStepChangesNoMomentum) {
  Tensor p = Zeros({1});
  Sgd opt({{"p", p}}, {.lr = 0.1, .momentum = 0.9});
  LrScheduler s(opt, OneCycleSchedule({.max_lr = 1.0, .total_steps = 4, .pct_start = 0.5}));
  EXPECT_EQ(opt.momentum(0), 0.95);
  for (int i = 0; i < 4; ++i) s.Step();
  const double lr = opt.lr(), momentum = opt.momentum(0);
  EXPECT_THROW(s.Step(), std::out_of_range);
  EXPECT_EQ(opt.lr(), lr);
  EXPECT_EQ(opt.momentum(0), momentum);
}

// Resumed mid-cycle into an optimizer made with another momentum: the
// scheduler's state alone restores it (a closed form of the step), and the
// run goes on as the uninterrupted one, to the bit.
TEST(OneCycleMomentum, StateRoundTripRestoresTheMomentumMidCycle) {
  for (const auto& c : Golden()["momentum_cycles"]) {
    const std::string name = c["name"];
    const size_t steps = c["grads"].size();
    for (size_t k : {size_t{1}, steps / 2}) {
      std::vector<Tensor> pa = InitialParams(c), pb = InitialParams(c);
      auto a = MakeOptimizer(c, pa);
      auto b = MakeOptimizer(c, pb);
      LrScheduler sa(*a, MomentumCycle(name));
      auto step = [&](Optimizer& opt, std::vector<Tensor>& params, size_t t) {
        for (size_t i = 0; i < params.size(); ++i) {
          params[i].set_grad(FromVector(c["grads"][t][i].get<std::vector<double>>(), params[i].shape()));
        }
        opt.Step();
      };
      for (size_t t = 0; t < k; ++t) {
        step(*a, pa, t);
        sa.Step();
      }
      NamedTensors saved = a->StateDict();
      for (auto& kv : sa.StateDict()) saved.push_back(kv);
      // The scheduler's momentum overwrites b's own at construction and at load.
      for (size_t g = 0; g < b->num_groups(); ++g) b->set_momentum(g, 0.5);
      LrScheduler sb(*b, MomentumCycle(name));
      for (size_t g = 0; g < b->num_groups(); ++g) b->set_momentum(g, 0.5);
      sb.LoadStateDict(saved);
      for (size_t g = 0; g < b->num_groups(); ++g) {
        EXPECT_EQ(b->momentum(g), a->momentum(g)) << name << " resumed at " << k << " group " << g;
      }
      b->LoadStateDict(saved);
      for (size_t i = 0; i < pb.size(); ++i) pb[i].CopyFrom(pa[i]);
      for (size_t t = k; t < steps; ++t) {
        step(*a, pa, t);
        step(*b, pb, t);
        sa.Step();
        sb.Step();
        for (size_t g = 0; g < a->num_groups(); ++g) {
          ASSERT_EQ(b->momentum(g), a->momentum(g)) << name << " step " << t << ", resumed at " << k;
          ASSERT_EQ(b->lr(g), a->lr(g)) << name << " step " << t << ", resumed at " << k;
        }
        for (size_t i = 0; i < pa.size(); ++i) {
          ASSERT_EQ(pb[i].ToVector<double>(), pa[i].ToVector<double>()) << name << " step " << t;
        }
      }
    }
  }
}

// The description names the momenta: a state saved with cycling is refused
// by a rate-only schedule (and the other way), or by other momenta.
TEST(OneCycleMomentum, AStateSavedWithOtherMomentumSettingsIsRefused) {
  Tensor p = Zeros({1});
  Sgd a({{"p", p}}, {.lr = 0.1, .momentum = 0.9}), b({{"p", p}}, {.lr = 0.1, .momentum = 0.9}),
      c({{"p", p}}, {.lr = 0.1, .momentum = 0.9});
  LrScheduler cycled(a, OneCycleSchedule({.max_lr = 1.0, .total_steps = 10}));
  cycled.Step();
  LrScheduler rate_only(b, OneCycleSchedule({.max_lr = 1.0, .total_steps = 10, .cycle_momentum = false}));
  EXPECT_THAT(ErrorOf([&] { rate_only.LoadStateDict(cycled.StateDict()); }),
              HasSubstr("saved with schedule OneCycleLR(max_lr=1, total_steps=10, pct_start=0.3, "
                        "anneal_strategy=cos, div_factor=25, final_div_factor=10000, three_phase=false, "
                        "cycle_momentum=true, base_momentum=0.85, max_momentum=0.95), this scheduler's is "
                        "OneCycleLR(max_lr=1, total_steps=10, pct_start=0.3, anneal_strategy=cos, div_factor=25, "
                        "final_div_factor=10000, three_phase=false)"));
  EXPECT_EQ(rate_only.step_count(), 0);
  LrScheduler other(c, OneCycleSchedule({.max_lr = 1.0, .total_steps = 10, .base_momentum = 0.8}));
  const double momentum = c.momentum(0);
  EXPECT_THAT(ErrorOf([&] { other.LoadStateDict(cycled.StateDict()); }),
              HasSubstr("this scheduler's is OneCycleLR(max_lr=1, total_steps=10, pct_start=0.3, "
                        "anneal_strategy=cos, div_factor=25, final_div_factor=10000, three_phase=false, "
                        "cycle_momentum=true, base_momentum=0.8, max_momentum=0.95)"));
  EXPECT_EQ(c.momentum(0), momentum);
  EXPECT_THAT(ErrorOf([&] { cycled.LoadStateDict(rate_only.StateDict()); }),
              HasSubstr("three_phase=false), this scheduler's is"));
}

// PyTorch's min_lr given as a list: each group has its own floor. The
// expected rates follow PyTorch 1.13's _reduce_lr, worked by hand:
// new_lr(k) = max(old_lr(k) * factor, min_lrs[k]), set only when
// old_lr(k) - new_lr(k) > eps. With factor 0.5 and a constant metric, the
// first step sets best and every later one reduces.
TEST(ReduceLrOnPlateau, GroupMinLrFloorsEachGroupAtItsOwn) {
  Tensor a = Zeros({1}), b = Zeros({1});
  Sgd opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}, .options = {{"lr", 0.5}}}}, {.lr = 1.0});
  ReduceLrOnPlateau r(opt, {.factor = 0.5, .patience = 0, .group_min_lr = {0.3, 0.01}});
  const std::vector<std::vector<double>> want = {
      {1.0, 0.5},  {0.5, 0.25},   {0.3, 0.125},     {0.3, 0.0625},
      {0.3, 0.03125}, {0.3, 0.015625}, {0.3, 0.01}, {0.3, 0.01}};
  for (size_t i = 0; i < want.size(); ++i) {
    r.Step(1.0);
    EXPECT_EQ(opt.lr(0), want[i][0]) << "step " << i;
    EXPECT_EQ(opt.lr(1), want[i][1]) << "step " << i;
  }
  // The options' text names the list, and a state saved with another list
  // is refused; one saved with the same loads.
  ReduceLrOnPlateau other(opt, {.factor = 0.5, .patience = 0, .group_min_lr = {0.3, 0.02}});
  EXPECT_THAT(ErrorOf([&] { other.LoadStateDict(r.StateDict()); }),
              AllOf(HasSubstr("saved with ReduceLROnPlateau(mode=min, factor=0.5, patience=0, threshold=1e-04, "
                              "threshold_mode=rel, cooldown=0, min_lr=[0.3, 0.01], eps=1e-08)"),
                    HasSubstr("this one is ReduceLROnPlateau(mode=min, factor=0.5, patience=0, threshold=1e-04, "
                              "threshold_mode=rel, cooldown=0, min_lr=[0.3, 0.02], eps=1e-08)")));
  ReduceLrOnPlateau same(opt, {.factor = 0.5, .patience = 0, .group_min_lr = {0.3, 0.01}});
  same.LoadStateDict(r.StateDict());
  EXPECT_EQ(same.step_count(), 8);
  // Over targets: one floor per target.
  std::vector<double> rates = {1.0, 1.0};
  std::vector<LrTarget> targets = {{[&] { return rates[0]; }, [&](double x) { rates[0] = x; }},
                                   {[&] { return rates[1]; }, [&](double x) { rates[1] = x; }}};
  ReduceLrOnPlateau over_targets(targets, {.factor = 0.1, .patience = 0, .group_min_lr = {0.5, 0.0}});
  over_targets.Step(1.0);
  over_targets.Step(1.0);
  EXPECT_EQ(rates, (std::vector<double>{0.5, 0.1}));
}

// A list of another length than the optimizer's groups is refused naming
// both counts (PyTorch: "expected 2 min_lrs, got 3"), and each value is
// checked as min_lr is, naming its index.
TEST(ReduceLrOnPlateau, GroupMinLrIsCheckedNamingWhatIsWrong) {
  Tensor a = Zeros({1}), b = Zeros({1});
  Sgd opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}}, {.lr = 1.0});
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.group_min_lr = {0.1, 0.2, 0.3}}); }),
            "ReduceLROnPlateau: group_min_lr has 3 values for 2 param group(s) of the SGD optimizer: give one "
            "min_lr per param group");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.group_min_lr = {0.1}}); }),
            "ReduceLROnPlateau: group_min_lr has 1 values for 2 param group(s) of the SGD optimizer: give one "
            "min_lr per param group");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.group_min_lr = {0.1, -1}}); }),
            "ReduceLROnPlateau: group_min_lr[1] -1 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.group_min_lr = {std::nan(""), 0}}); }),
            "ReduceLROnPlateau: group_min_lr[0] nan must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { ReduceLrOnPlateau(opt, {.min_lr = 0.1, .group_min_lr = {0.1, 0.2}}); }),
            "ReduceLROnPlateau: both min_lr 0.1 and group_min_lr are given; leave min_lr 0 with the list");
  double rate = 1.0;
  EXPECT_EQ(ErrorOf([&] {
              ReduceLrOnPlateau(LrTarget{[&] { return rate; }, [&](double x) { rate = x; }},
                                {.group_min_lr = {0.1, 0.2}});
            }),
            "ReduceLROnPlateau: group_min_lr has 2 values for 1 target: give one min_lr per param group");
}

// A group added after the scheduler was made has no floor in the list:
// Step refuses it, naming the optimizer and the group, and changes nothing
// (PyTorch fails with an IndexError at the next reduction).
TEST(ReduceLrOnPlateau, GroupMinLrRefusesAGroupAddedAfterIt) {
  Tensor a = Zeros({1}), b = Zeros({1});
  Sgd opt({{"a", a}}, {.lr = 1.0});
  ReduceLrOnPlateau r(opt, {.factor = 0.5, .patience = 0, .group_min_lr = {0.1}});
  r.Step(1.0);
  opt.AddParamGroup({.params = {{"b", b}}});
  std::string error;
  try {
    r.Step(1.0);
  } catch (const std::logic_error& e) {
    error = e.what();
  }
  EXPECT_EQ(error,
            "ReduceLROnPlateau: the SGD optimizer has 2 param groups and group_min_lr 1 values: param group 1 was "
            "added after this scheduler was made and has no min_lr; make the scheduler after adding the groups");
  EXPECT_EQ(r.step_count(), 1);
  EXPECT_EQ(r.num_bad_steps(), 0);
  EXPECT_EQ(opt.lr(0), 1.0);
  EXPECT_EQ(opt.lr(1), 1.0);
}

// PyTorch's LambdaLR given a list: group k's rate is
// base_lrs[k] * lr_lambdas[k](last_epoch) (LambdaLR.get_lr), computed here
// from that formula.
TEST(LambdaGroups, EachGroupFollowsItsOwnFactor) {
  Tensor a = Zeros({1}), b = Zeros({1});
  Sgd opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}, .options = {{"lr", 0.5}}}}, {.lr = 1.0});
  const std::function<double(int64_t)> decay = [](int64_t e) { return std::pow(0.9, static_cast<double>(e)); };
  const std::function<double(int64_t)> inverse = [](int64_t e) { return 1.0 / static_cast<double>(e + 1); };
  LrScheduler sched(opt, LambdaSchedule(std::vector{decay, inverse}, "[0.9^t, 1/(t+1)]"));
  for (int64_t t = 0; t <= 6; ++t) {
    if (t > 0) sched.Step();
    EXPECT_DOUBLE_EQ(opt.lr(0), 1.0 * std::pow(0.9, static_cast<double>(t))) << "step " << t;
    EXPECT_DOUBLE_EQ(opt.lr(1), 0.5 / static_cast<double>(t + 1)) << "step " << t;
  }
  EXPECT_EQ(sched.lr(), opt.lr(0));
  // Resumed mid-schedule into another optimizer, each group's rate is its own.
  Sgd other({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}, .options = {{"lr", 0.5}}}},
            {.lr = 1.0});
  LrScheduler resumed(other, LambdaSchedule(std::vector{decay, inverse}, "[0.9^t, 1/(t+1)]"));
  resumed.LoadStateDict(sched.StateDict());
  EXPECT_EQ(other.lr(0), opt.lr(0));
  EXPECT_EQ(other.lr(1), opt.lr(1));
  resumed.Step();
  EXPECT_DOUBLE_EQ(other.lr(1), 0.5 / 8);
}

// A list of another length than the groups is refused naming both counts
// (PyTorch: "Expected 3 lr_lambdas, but got 2"); so are an empty list and
// an empty function, naming its index.
TEST(LambdaGroups, ListsAreCheckedNamingWhatIsWrong) {
  Tensor a = Zeros({1}), b = Zeros({1}), c = Zeros({1});
  Sgd three({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}, ParamGroup{.params = {{"c", c}}}},
            {.lr = 0.1});
  const std::function<double(int64_t)> one = [](int64_t) { return 1.0; };
  const std::function<double(int64_t)> half = [](int64_t) { return 0.5; };
  EXPECT_EQ(ErrorOf([&] { LrScheduler(three, LambdaSchedule(std::vector{one, half}, "pair")); }),
            "LrScheduler: LambdaLR(pair) has values for 2 param group(s), and the SGD optimizer has 3");
  EXPECT_EQ(ErrorOf([&] { LrScheduler(three, LambdaSchedule(std::vector{one, half})); }),
            "LrScheduler: the schedule has values for 2 param group(s), and the SGD optimizer has 3");
  EXPECT_EQ(three.lr(1), 0.1);
  EXPECT_EQ(ErrorOf([] { LambdaSchedule(std::vector<std::function<double(int64_t)>>{}); }),
            "LambdaLR: no factors given; give one function per param group");
  EXPECT_EQ(ErrorOf([&] { LambdaSchedule(std::vector<std::function<double(int64_t)>>{one, nullptr}); }),
            "LambdaLR: factors[1] (param group 1's) is an empty function");
  EXPECT_THAT(ErrorOf([&] {
                SequentialSchedule({LambdaSchedule(std::vector{one, half}, "pair"), StepSchedule(2)}, {5});
              }),
              HasSubstr("has values per param group, which SequentialLR does not pass on"));
  // One function in a list of one drives a bare target as a group.
  double rate = 2.0;
  LrScheduler target(LrTarget{[&] { return rate; }, [&](double x) { rate = x; }}, LambdaSchedule(std::vector{half}));
  EXPECT_EQ(rate, 1.0);
}

// LoadStateDict asks each group's function for the saved step once: its
// check computes the rates (to refuse one the optimizer would not take)
// and the load sets those. It asked twice, so a function with side
// effects ran twice, and one that answers differently the second time
// (here: a rate the optimizer refuses) made the load throw after its check
// had passed.
TEST(LambdaGroups, LoadStateDictCallsEachFunctionOncePerGroup) {
  Tensor a = Zeros({1}), b = Zeros({1});
  Sgd saved_opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}}, {.lr = 1.0});
  const std::function<double(int64_t)> half = [](int64_t) { return 0.5; };
  LrScheduler saved(saved_opt, LambdaSchedule(std::vector{half, half}, "counted"));
  for (int i = 0; i < 3; ++i) saved.Step();
  const NamedTensors state = saved.StateDict();

  std::vector<int> calls(2, 0);
  // Answers 0.5 the first time each group asks, -1 (refused) after.
  auto counted = [&calls](size_t group) {
    return std::function<double(int64_t)>([&calls, group](int64_t) { return ++calls[group] == 1 ? 0.5 : -1.0; });
  };
  Sgd opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}}, {.lr = 1.0});
  LrScheduler sched(opt, LambdaSchedule(std::vector{counted(0), counted(1)}, "counted"));
  calls = {0, 0};  // the constructor's own calls are not the load's
  opt.set_lr(0, 1.0);
  opt.set_lr(1, 1.0);
  EXPECT_NO_THROW(sched.LoadStateDict(state));
  EXPECT_EQ(calls, (std::vector<int>{1, 1}));
  EXPECT_EQ(sched.step_count(), 3);
  EXPECT_EQ(opt.lr(0), 0.5);
  EXPECT_EQ(opt.lr(1), 0.5);
}

// A schedule defined elsewhere that cycles momentum and, from step 3 on,
// gives a momentum outside the bounds it declared (which the scheduler's
// constructor checked): -0.5, which SGD refuses.
class StrayMomentumSchedule : public Schedule {
 public:
  double Lr(double base_lr, int64_t /*t*/) const override { return base_lr; }
  std::string Describe() const override { return "StrayMomentum"; }
  bool CyclesMomentum() const override { return true; }
  double Momentum(int64_t t) const override { return t < 3 ? 0.9 : -0.5; }
  std::vector<double> MomentumBounds() const override { return {0.85, 0.95}; }
};

// CheckStateDict refuses a state whose step gives a momentum the optimizer
// would refuse, as LoadStateDict does. It checked the rates alone, so a
// load (a checkpoint restore, which checks every part before loading any)
// threw after its check had passed.
TEST(SchedulerState, CheckStateDictRefusesACycledMomentumTheOptimizerRefuses) {
  Tensor p = Zeros({1});
  Sgd saved_opt({{"p", p}}, {.lr = 1.0, .momentum = 0.9});
  LrScheduler saved(saved_opt, std::make_shared<StrayMomentumSchedule>());
  for (int i = 0; i < 2; ++i) saved.Step();
  NamedTensors state = saved.StateDict();
  ASSERT_EQ(state[0].first, "scheduler.step");
  state[0].second = FromVectorOf<int64_t>({3}, {});

  Sgd opt({{"p", p}}, {.lr = 1.0, .momentum = 0.9});
  LrScheduler sched(opt, std::make_shared<StrayMomentumSchedule>());
  const auto refused = AllOf(HasSubstr("LrScheduler.LoadStateDict: "), HasSubstr("momentum -0.5"),
                             HasSubstr("scheduler.step 3"), HasSubstr("param group 0"));
  EXPECT_THAT(ErrorOf([&] { sched.CheckStateDict(state); }), refused);
  EXPECT_THAT(ErrorOf([&] { sched.LoadStateDict(state); }), refused);
  EXPECT_EQ(sched.step_count(), 0);
  EXPECT_EQ(opt.momentum(0), 0.9);
}

// CheckStateDict returns what it checked, and LoadStateDict of that sets
// the rates the check computed: a caller that checks every part before
// loading any (a checkpoint restore) asks each group's function once. A
// checked state is refused, changing nothing, by a scheduler of another
// schedule, whose functions would have given other rates.
TEST(LambdaGroups, ACheckedStateLoadsWithoutAskingTheFunctionsAgain) {
  Tensor a = Zeros({1}), b = Zeros({1});
  Sgd saved_opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}}, {.lr = 1.0});
  const std::function<double(int64_t)> half = [](int64_t) { return 0.5; };
  LrScheduler saved(saved_opt, LambdaSchedule(std::vector{half, half}, "counted"));
  for (int i = 0; i < 3; ++i) saved.Step();
  const NamedTensors state = saved.StateDict();

  std::vector<int> calls(2, 0);
  auto counted = [&calls](size_t group) {
    return std::function<double(int64_t)>([&calls, group](int64_t) {
      ++calls[group];
      return 0.5;
    });
  };
  Sgd opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}}, {.lr = 1.0});
  LrScheduler sched(opt, LambdaSchedule(std::vector{counted(0), counted(1)}, "counted"));
  calls = {0, 0};  // the constructor's own calls are not the load's
  const LrScheduler::CheckedState checked = sched.CheckStateDict(state);
  EXPECT_EQ(calls, (std::vector<int>{1, 1}));
  opt.set_lr(0, 1.0);
  opt.set_lr(1, 1.0);

  Sgd other_opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}}, {.lr = 1.0});
  LrScheduler other(other_opt, LambdaSchedule(std::vector{half, half}, "counted"));
  other_opt.set_lr(0, 1.0);
  EXPECT_THAT(ErrorOf([&] { other.LoadChecked(checked); }),
              HasSubstr("LrScheduler.LoadChecked: the checked state (2 param group(s)) was not checked by this "
                        "scheduler"));
  EXPECT_EQ(other.step_count(), 0);
  EXPECT_EQ(other_opt.lr(0), 1.0);

  sched.LoadChecked(checked);
  EXPECT_EQ(calls, (std::vector<int>{1, 1}));
  EXPECT_EQ(sched.step_count(), 3);
  EXPECT_EQ(opt.lr(0), 0.5);
  EXPECT_EQ(opt.lr(1), 0.5);
}

// base_lr * factor, describing itself as nothing: a state loads whatever
// the factor it was saved with.
class ScaledSchedule : public Schedule {
 public:
  explicit ScaledSchedule(double factor) : factor_(factor) {}
  double Lr(double base_lr, int64_t /*t*/) const override { return base_lr * factor_; }

 private:
  double factor_;
};

// A checked state belongs to the scheduler that checked it. Before, it was
// matched by its schedule's address: a scheduler destroyed with its
// schedule, and another made whose schedule took the same memory (as an
// allocator reuses a freed block; a buffer here, so that it always does),
// took the first one's rate, 0.5 where its own schedule gives 0.25.
TEST(SchedulerState, ACheckedStateIsRefusedByALaterSchedulerWhoseScheduleTookTheSameAddress) {
  Tensor p = Zeros({1});
  Sgd saved_opt({{"p", p}}, {.lr = 1.0});
  LrScheduler saved(saved_opt, std::make_shared<ScaledSchedule>(1.0));
  saved.Step();
  const NamedTensors state = saved.StateDict();

  alignas(ScaledSchedule) unsigned char storage[sizeof(ScaledSchedule)];
  auto placed = [&storage](double factor) {
    return std::shared_ptr<Schedule>(new (storage) ScaledSchedule(factor), [](Schedule* s) { s->~Schedule(); });
  };
  Sgd opt({{"p", p}}, {.lr = 1.0});
  std::optional<LrScheduler::CheckedState> checked;
  {
    LrScheduler first(opt, placed(0.5));
    checked.emplace(first.CheckStateDict(state));
  }
  LrScheduler second(opt, placed(0.25));
  ASSERT_EQ(opt.lr(), 0.125);  // 0.25 of the 0.5 the first left
  EXPECT_THAT(ErrorOf([&] { second.LoadChecked(*checked); }),
              HasSubstr("LrScheduler.LoadChecked: the checked state (1 param group(s)) was not checked by this "
                        "scheduler (1 param group(s))"));
  EXPECT_EQ(opt.lr(), 0.125);
  EXPECT_EQ(second.step_count(), 0);
  second.LoadChecked(second.CheckStateDict(state));
  EXPECT_EQ(opt.lr(), 0.25);
  EXPECT_EQ(second.step_count(), 1);
}

// A snapshot puts back the step, the base rates and the rates as they
// were, a rate set by hand included, without asking the schedule; another
// scheduler's snapshot is refused, changing nothing.
TEST(SchedulerState, ASnapshotPutsBackStepBaseRatesAndRatesAsTheyWere) {
  Tensor a = Zeros({1}), b = Zeros({1});
  Sgd opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}, .options = {{"lr", 2.0}}}}, {.lr = 1.0});
  int calls = 0;
  LrScheduler sched(opt, LambdaSchedule([&calls](int64_t t) {
                      ++calls;
                      return 1.0 / static_cast<double>(t + 1);
                    }));
  sched.Step();
  opt.set_lr(1, 0.3);  // by hand: not the schedule's 1.0
  const LrScheduler::Snapshot snapshot = sched.TakeSnapshot();
  for (int i = 0; i < 3; ++i) sched.Step();
  Sgd other_opt({{"a", a}}, {.lr = 1.0});
  LrScheduler other(other_opt, StepSchedule(2));
  EXPECT_THAT(ErrorOf([&] { other.RestoreSnapshot(snapshot); }),
              HasSubstr("LrScheduler.RestoreSnapshot: the snapshot was taken of another scheduler"));
  EXPECT_EQ(other.step_count(), 0);
  calls = 0;
  sched.RestoreSnapshot(snapshot);
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(sched.step_count(), 1);
  EXPECT_EQ(sched.base_lrs(), (std::vector<double>{1.0, 2.0}));
  EXPECT_EQ(opt.lr(0), 0.5);
  EXPECT_EQ(opt.lr(1), 0.3);
}

// A braced list of functions is PyTorch's list of lr_lambdas, one per
// param group, as a std::vector is: `LambdaSchedule({f}, ...)` with one
// lambda did not compile (both overloads took it equally well), and one
// std::function in braces meant the single-function form.
TEST(LambdaGroups, ABracedListOfFunctionsIsAListOfFactors) {
  Tensor a = Zeros({1}), b = Zeros({1});
  Sgd one({ParamGroup{.params = {{"a", a}}}}, {.lr = 1.0});
  LrScheduler sched(one, LambdaSchedule({[](int64_t e) { return 1.0 / static_cast<double>(e + 1); }}, "1/(t+1)"));
  sched.Step();
  EXPECT_DOUBLE_EQ(one.lr(0), 0.5);
  Sgd two({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}}, {.lr = 1.0});
  const std::function<double(int64_t)> same = [](int64_t) { return 1.0; };
  EXPECT_EQ(ErrorOf([&] { LrScheduler(two, LambdaSchedule({[](int64_t) { return 1.0; }}, "one")); }),
            "LrScheduler: LambdaLR(one) has values for 1 param group(s), and the SGD optimizer has 2");
  EXPECT_EQ(ErrorOf([&] { LrScheduler(two, LambdaSchedule({same}, "same")); }),
            "LrScheduler: LambdaLR(same) has values for 1 param group(s), and the SGD optimizer has 2");
  EXPECT_EQ(ErrorOf([] { LambdaSchedule({}); }), "LambdaLR: no factors given; give one function per param group");
  LrScheduler pair(two, LambdaSchedule({same, [](int64_t) { return 0.5; }}));
  EXPECT_EQ(two.lr(0), 1.0);
  EXPECT_EQ(two.lr(1), 0.5);
  // Unbraced, one function is still the factor of every group.
  Sgd other({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}}}, {.lr = 1.0});
  LrScheduler every(other, LambdaSchedule([](int64_t) { return 0.25; }));
  EXPECT_EQ(other.lr(0), 0.25);
  EXPECT_EQ(other.lr(1), 0.25);
}

}  // namespace
}  // namespace ddp::nn::optim
