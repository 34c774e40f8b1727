#include "nn/optim/lr_scheduler.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <limits>
#include <numbers>
#include <stdexcept>
#include <string>

namespace ddp::nn::optim {
namespace {

// A parameter for a schedule's description: the shortest text that reads
// back as the same double, so that equal parameters describe alike and
// different ones differently.
std::string Number(double x) {
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof(buf), x);
  return std::string(buf, result.ptr);
}

class StepImpl : public Schedule {
 public:
  StepImpl(int64_t step_size, double gamma) : step_size_(step_size), gamma_(gamma) {}
  double Lr(double base, int64_t t) const override {
    return base * std::pow(gamma_, static_cast<double>(t / step_size_));
  }
  std::string Describe() const override {
    return "StepLR(step_size=" + std::to_string(step_size_) + ", gamma=" + Number(gamma_) + ")";
  }

 private:
  int64_t step_size_;
  double gamma_;
};

class CosineImpl : public Schedule {
 public:
  CosineImpl(int64_t t_max, double eta_min, CosineTail tail) : t_max_(t_max), eta_min_(eta_min), tail_(tail) {}
  double Lr(double base, int64_t t) const override {
    // Exactly eta_min, not the closed form's eta_min + rounding at t_max.
    if (tail_ == CosineTail::kHold && t >= t_max_) return eta_min_;
    return eta_min_ + (base - eta_min_) *
                          (1.0 + std::cos(std::numbers::pi * static_cast<double>(t) /
                                          static_cast<double>(t_max_))) / 2.0;
  }
  std::string Describe() const override {
    return "CosineAnnealingLR(T_max=" + std::to_string(t_max_) + ", eta_min=" + Number(eta_min_) +
           ", tail=" + (tail_ == CosineTail::kHold ? "hold" : "periodic") + ")";
  }

 private:
  int64_t t_max_;
  double eta_min_;
  CosineTail tail_;
};

class LinearImpl : public Schedule {
 public:
  LinearImpl(double start, double end, int64_t total) : start_(start), end_(end), total_(total) {}
  double Lr(double base, int64_t t) const override {
    const double frac = static_cast<double>(std::min(t, total_)) / static_cast<double>(total_);
    return base * (start_ + (end_ - start_) * frac);
  }
  std::string Describe() const override {
    return "LinearLR(start_factor=" + Number(start_) + ", end_factor=" + Number(end_) +
           ", total_iters=" + std::to_string(total_) + ")";
  }

 private:
  double start_, end_;
  int64_t total_;
};

class SequentialImpl : public Schedule {
 public:
  SequentialImpl(std::vector<std::shared_ptr<Schedule>> s, std::vector<int64_t> m)
      : schedules_(std::move(s)), milestones_(std::move(m)) {}
  double Lr(double base, int64_t t) const override {
    size_t k = 0;
    int64_t start = 0;
    while (k < milestones_.size() && t >= milestones_[k]) start = milestones_[k++];
    return schedules_[k]->Lr(base, t - start);
  }
  // Unknown when any part is.
  std::string Describe() const override {
    std::string parts, milestones;
    for (size_t k = 0; k < schedules_.size(); ++k) {
      const std::string part = schedules_[k]->Describe();
      if (part.empty()) return "";
      parts += (k ? ", " : "") + part;
    }
    for (size_t k = 0; k < milestones_.size(); ++k) milestones += (k ? ", " : "") + std::to_string(milestones_[k]);
    return "SequentialLR([" + parts + "], milestones=[" + milestones + "])";
  }

 private:
  std::vector<std::shared_ptr<Schedule>> schedules_;
  std::vector<int64_t> milestones_;
};


class MultiStepImpl : public Schedule {
 public:
  MultiStepImpl(std::vector<int64_t> milestones, double gamma) : milestones_(std::move(milestones)), gamma_(gamma) {}
  double Lr(double base, int64_t t) const override {
    // Milestones passed so far, repeats counted each time.
    const auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), t) - milestones_.begin();
    return base * std::pow(gamma_, static_cast<double>(passed));
  }
  std::string Describe() const override {
    std::string m;
    for (size_t k = 0; k < milestones_.size(); ++k) m += (k ? ", " : "") + std::to_string(milestones_[k]);
    return "MultiStepLR(milestones=[" + m + "], gamma=" + Number(gamma_) + ")";
  }

 private:
  std::vector<int64_t> milestones_;
  double gamma_;
};

class ExponentialImpl : public Schedule {
 public:
  explicit ExponentialImpl(double gamma) : gamma_(gamma) {}
  double Lr(double base, int64_t t) const override { return base * std::pow(gamma_, static_cast<double>(t)); }
  std::string Describe() const override { return "ExponentialLR(gamma=" + Number(gamma_) + ")"; }

 private:
  double gamma_;
};

class LambdaImpl : public Schedule {
 public:
  // `per_group`: factors[k] is group k's (else factors holds one, every
  // group's).
  LambdaImpl(std::vector<std::function<double(int64_t)>> factors, bool per_group, std::string description)
      : factors_(std::move(factors)), per_group_(per_group), description_(std::move(description)) {}
  double Lr(double base, int64_t t) const override { return base * factors_.front()(t); }
  size_t GroupCount() const override { return per_group_ ? factors_.size() : 0; }
  double GroupLr(size_t group, double base, int64_t t) const override {
    if (!per_group_) return Lr(base, t);
    if (group >= factors_.size()) {
      throw std::out_of_range("LambdaLR: param group " + std::to_string(group) + " of a schedule with factors for " +
                              std::to_string(factors_.size()) + " groups");
    }
    return base * factors_[group](t);
  }
  std::string Describe() const override { return description_.empty() ? "" : "LambdaLR(" + description_ + ")"; }

 private:
  std::vector<std::function<double(int64_t)>> factors_;
  bool per_group_;
  std::string description_;
};

class WarmRestartsImpl : public Schedule {
 public:
  WarmRestartsImpl(int64_t t_0, int64_t t_mult, double eta_min) : t_0_(t_0), t_mult_(t_mult), eta_min_(eta_min) {}
  double Lr(double base, int64_t t) const override {
    // Position t_cur inside the current cycle of length t_i, in integers so
    // that a restart falls exactly on its step.
    int64_t t_cur = t, t_i = t_0_;
    if (t_mult_ == 1) {
      t_cur = t % t_0_;
    } else {
      while (t_cur >= t_i) {
        t_cur -= t_i;
        // A cycle longer than any reachable step count ends the search.
        if (__builtin_mul_overflow(t_i, t_mult_, &t_i)) t_i = std::numeric_limits<int64_t>::max();
      }
    }
    return eta_min_ + (base - eta_min_) *
                          (1.0 + std::cos(std::numbers::pi * static_cast<double>(t_cur) / static_cast<double>(t_i))) /
                          2.0;
  }
  std::string Describe() const override {
    return "CosineAnnealingWarmRestarts(T_0=" + std::to_string(t_0_) + ", T_mult=" + std::to_string(t_mult_) +
           ", eta_min=" + Number(eta_min_) + ")";
  }

 private:
  int64_t t_0_, t_mult_;
  double eta_min_;
};

class OneCycleImpl : public Schedule {
 public:
  explicit OneCycleImpl(const OneCycleOptions& o) : o_(o) {
    size_t groups = 1;
    for (const auto* list : {&o.group_max_lr, &o.group_base_momentum, &o.group_max_momentum}) {
      groups = std::max(groups, list->size());
    }
    const auto value = [](const std::vector<double>& list, double scalar, size_t k) {
      return list.empty() ? scalar : list[k];
    };
    for (size_t k = 0; k < groups; ++k) {
      const double max_lr = value(o.group_max_lr, o.max_lr, k);
      const double initial = max_lr / o.div_factor;
      const double final_lr = initial / o.final_div_factor;
      const double hi = value(o.group_max_momentum, o.max_momentum, k);
      const double lo = value(o.group_base_momentum, o.base_momentum, k);
      // Phase k runs from the previous phase's end step (0 for the first) to
      // end_step, as PyTorch counts them: fractional ends are kept as they
      // are. The momentum moves against the rate (PyTorch's start/end_momentum).
      const double rise_end = o.pct_start * static_cast<double>(o.total_steps) - 1;
      const double last_end = static_cast<double>(o.total_steps) - 1;
      if (o.three_phase) {
        phases_.push_back({{rise_end, {initial, hi}, {max_lr, lo}},
                           {2 * o.pct_start * static_cast<double>(o.total_steps) - 2, {max_lr, lo}, {initial, hi}},
                           {last_end, {initial, hi}, {final_lr, hi}}});
      } else {
        phases_.push_back({{rise_end, {initial, hi}, {max_lr, lo}}, {last_end, {max_lr, lo}, {final_lr, hi}}});
      }
    }
  }
  double Lr(double /*base*/, int64_t t) const override { return At(0, t, 0); }
  bool CyclesMomentum() const override { return o_.cycle_momentum; }
  double Momentum(int64_t t) const override { return At(0, t, 1); }
  std::vector<double> MomentumBounds() const override {
    if (!o_.cycle_momentum) return {};
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (const auto& phases : phases_) {
      for (const Phase& p : phases) {
        lo = std::min({lo, p.start[1], p.end[1]});
        hi = std::max({hi, p.start[1], p.end[1]});
      }
    }
    return {lo, hi};
  }
  size_t GroupCount() const override { return PerGroup() ? phases_.size() : 0; }
  double GroupLr(size_t group, double /*base*/, int64_t t) const override { return At(Index(group), t, 0); }
  double GroupMomentum(size_t group, int64_t t) const override { return At(Index(group), t, 1); }
  std::string Describe() const override {
    // Rate-only schedules keep the description they had before
    // cycle_momentum existed, so that their saved states still load; lists
    // replace the scalars they stand for.
    const auto value = [](const std::vector<double>& list, double scalar) {
      if (list.empty()) return Number(scalar);
      std::string out = "[";
      for (size_t k = 0; k < list.size(); ++k) out += (k ? ", " : "") + Number(list[k]);
      return out + "]";
    };
    return "OneCycleLR(max_lr=" + value(o_.group_max_lr, o_.max_lr) +
           ", total_steps=" + std::to_string(o_.total_steps) + ", pct_start=" + Number(o_.pct_start) +
           ", anneal_strategy=" + (o_.anneal_strategy == AnnealStrategy::kLinear ? "linear" : "cos") +
           ", div_factor=" + Number(o_.div_factor) + ", final_div_factor=" + Number(o_.final_div_factor) +
           ", three_phase=" + (o_.three_phase ? "true" : "false") +
           (o_.cycle_momentum ? ", cycle_momentum=true, base_momentum=" +
                                    value(o_.group_base_momentum, o_.base_momentum) +
                                    ", max_momentum=" + value(o_.group_max_momentum, o_.max_momentum)
                              : std::string()) +
           ")";
  }

 private:
  bool PerGroup() const {
    return !o_.group_max_lr.empty() || !o_.group_base_momentum.empty() || !o_.group_max_momentum.empty();
  }
  // The phases of `group`: its own with lists, else the one set.
  size_t Index(size_t group) const {
    if (!PerGroup()) return 0;
    if (group >= phases_.size()) {
      throw std::out_of_range("OneCycleLR: param group " + std::to_string(group) + " of a schedule with values for " +
                              std::to_string(phases_.size()) + " groups");
    }
    return group;
  }
  // Value `which` (0: the rate, 1: the momentum) of group `g`'s phases at
  // step t, annealed within its phase as PyTorch's get_lr does.
  double At(size_t g, int64_t t, int which) const {
    if (t > o_.total_steps) {
      throw std::out_of_range("OneCycleLR: step " + std::to_string(t) + " is past total_steps " +
                              std::to_string(o_.total_steps) + ": the cycle has ended");
    }
    const std::vector<Phase>& phases = phases_[g];
    const double step = static_cast<double>(t);
    double start_step = 0;
    for (size_t k = 0; k < phases.size(); ++k) {
      const Phase& p = phases[k];
      if (step <= p.end_step || k + 1 == phases.size()) {
        const double start = p.start[which], end = p.end[which];
        // A last phase of no length (reachable only at t = total_steps) has
        // ended: its end value.
        if (p.end_step == start_step) return end;
        const double pct = (step - start_step) / (p.end_step - start_step);
        if (o_.anneal_strategy == AnnealStrategy::kLinear) return (end - start) * pct + start;
        return end + (start - end) / 2.0 * (std::cos(std::numbers::pi * pct) + 1);
      }
      start_step = p.end_step;
    }
    return phases.back().end[which];  // not reached: the last phase always answers
  }

  struct Phase {
    double end_step;
    // {rate, momentum} at the phase's start and end.
    double start[2], end[2];
  };
  OneCycleOptions o_;
  std::vector<std::vector<Phase>> phases_;  // per group (one set without lists)
};

}  // namespace

std::shared_ptr<Schedule> StepSchedule(int64_t step_size, double gamma) {
  if (step_size < 1) throw std::invalid_argument("StepLR: step_size " + std::to_string(step_size) + " must be >= 1");
  // A negative gamma gives negative rates every other period, and a NaN or
  // infinite one rates the optimizer refuses only when they come.
  if (!(gamma >= 0) || !std::isfinite(gamma)) {
    throw std::invalid_argument("StepLR: gamma " + internal::OptionValueText(gamma) + " must be finite and >= 0");
  }
  return std::make_shared<StepImpl>(step_size, gamma);
}

std::shared_ptr<Schedule> CosineSchedule(int64_t t_max, double eta_min, CosineTail tail) {
  if (t_max < 1) throw std::invalid_argument("CosineAnnealingLR: t_max " + std::to_string(t_max) + " must be >= 1");
  // eta_min is the rate reached at t_max: it must be one the optimizer takes.
  if (!(eta_min >= 0) || !std::isfinite(eta_min)) {
    throw std::invalid_argument("CosineAnnealingLR: eta_min " + internal::OptionValueText(eta_min) +
                                " must be finite and >= 0");
  }
  if (tail != CosineTail::kPeriodic && tail != CosineTail::kHold) {
    throw std::invalid_argument("CosineAnnealingLR: unknown tail " + std::to_string(static_cast<int>(tail)));
  }
  return std::make_shared<CosineImpl>(t_max, eta_min, tail);
}

std::shared_ptr<Schedule> LinearSchedule(double start_factor, double end_factor, int64_t total_iters) {
  // Each factor is named alone when it is the one out of range.
  if (!(start_factor > 0 && start_factor <= 1)) {
    throw std::invalid_argument("LinearLR: start_factor " + internal::OptionValueText(start_factor) +
                                " must be in (0, 1]");
  }
  if (!(end_factor >= 0 && end_factor <= 1)) {
    throw std::invalid_argument("LinearLR: end_factor " + internal::OptionValueText(end_factor) +
                                " must be in [0, 1]");
  }
  if (total_iters < 1) {
    throw std::invalid_argument("LinearLR: total_iters " + std::to_string(total_iters) + " must be >= 1");
  }
  return std::make_shared<LinearImpl>(start_factor, end_factor, total_iters);
}

std::shared_ptr<Schedule> SequentialSchedule(std::vector<std::shared_ptr<Schedule>> schedules,
                                             std::vector<int64_t> milestones) {
  if (schedules.empty()) {
    throw std::invalid_argument("SequentialLR: got no schedules (and " + std::to_string(milestones.size()) +
                                " milestones), need at least one");
  }
  if (milestones.size() + 1 != schedules.size()) {
    throw std::invalid_argument("SequentialLR: " + std::to_string(schedules.size()) +
                                " schedules need " + std::to_string(schedules.size() - 1) +
                                " milestones, got " + std::to_string(milestones.size()));
  }
  for (size_t i = 0; i < milestones.size(); ++i) {
    if (milestones[i] < 0 || (i > 0 && milestones[i] < milestones[i - 1])) {
      throw std::invalid_argument("SequentialLR: milestones must be ascending and >= 0, milestone " +
                                  std::to_string(i) + " is " + std::to_string(milestones[i]) +
                                  (i > 0 ? " after " + std::to_string(milestones[i - 1]) : std::string()));
    }
  }
  for (size_t k = 0; k < schedules.size(); ++k) {
    if (!schedules[k]) {
      throw std::invalid_argument("SequentialLR: schedule " + std::to_string(k) + " of " +
                                  std::to_string(schedules.size()) + " is null");
    }
    if (schedules[k]->GroupCount() != 0) {
      throw std::invalid_argument("SequentialLR: schedule " + std::to_string(k) + " (" + schedules[k]->Describe() +
                                  ") has values per param group, which SequentialLR does not pass on; give it "
                                  "one value for every group");
    }
    if (schedules[k]->CyclesMomentum()) {
      throw std::invalid_argument("SequentialLR: schedule " + std::to_string(k) + " (" + schedules[k]->Describe() +
                                  ") cycles momentum, which the other schedules would leave where it ended; "
                                  "make it with cycle_momentum = false");
    }
  }
  return std::make_shared<SequentialImpl>(std::move(schedules), std::move(milestones));
}

namespace {

// Throws unless x is finite and >= 0: `who` and `name` make the message.
void CheckFiniteNonNegative(const char* who, const char* name, double x) {
  if (!(x >= 0) || !std::isfinite(x)) {
    throw std::invalid_argument(std::string(who) + ": " + name + " " + Number(x) + " must be finite and >= 0");
  }
}

}  // namespace

std::shared_ptr<Schedule> MultiStepSchedule(std::vector<int64_t> milestones, double gamma) {
  for (size_t i = 0; i < milestones.size(); ++i) {
    if (milestones[i] < 0 || (i > 0 && milestones[i] < milestones[i - 1])) {
      throw std::invalid_argument("MultiStepLR: milestones must be ascending and >= 0, milestone " +
                                  std::to_string(i) + " is " + std::to_string(milestones[i]) +
                                  (i > 0 ? " after " + std::to_string(milestones[i - 1]) : std::string()));
    }
  }
  CheckFiniteNonNegative("MultiStepLR", "gamma", gamma);
  return std::make_shared<MultiStepImpl>(std::move(milestones), gamma);
}

std::shared_ptr<Schedule> ExponentialSchedule(double gamma) {
  CheckFiniteNonNegative("ExponentialLR", "gamma", gamma);
  return std::make_shared<ExponentialImpl>(gamma);
}

std::shared_ptr<Schedule> LambdaSchedule(std::function<double(int64_t)> factor, std::string description) {
  if (!factor) throw std::invalid_argument("LambdaLR: factor is an empty function");
  return std::make_shared<LambdaImpl>(std::vector<std::function<double(int64_t)>>{std::move(factor)}, false,
                                      std::move(description));
}

std::shared_ptr<Schedule> LambdaSchedule(std::vector<std::function<double(int64_t)>> factors,
                                         std::string description) {
  if (factors.empty()) {
    throw std::invalid_argument("LambdaLR: no factors given; give one function per param group");
  }
  for (size_t k = 0; k < factors.size(); ++k) {
    if (!factors[k]) {
      throw std::invalid_argument("LambdaLR: factors[" + std::to_string(k) + "] (param group " + std::to_string(k) +
                                  "'s) is an empty function");
    }
  }
  return std::make_shared<LambdaImpl>(std::move(factors), true, std::move(description));
}

std::shared_ptr<Schedule> LambdaSchedule(std::initializer_list<std::function<double(int64_t)>> factors,
                                         std::string description) {
  return LambdaSchedule(std::vector<std::function<double(int64_t)>>(factors), std::move(description));
}

std::shared_ptr<Schedule> CosineWarmRestartsSchedule(int64_t t_0, int64_t t_mult, double eta_min) {
  if (t_0 < 1) throw std::invalid_argument("CosineAnnealingWarmRestarts: T_0 " + std::to_string(t_0) + " must be >= 1");
  if (t_mult < 1) {
    throw std::invalid_argument("CosineAnnealingWarmRestarts: T_mult " + std::to_string(t_mult) + " must be >= 1");
  }
  CheckFiniteNonNegative("CosineAnnealingWarmRestarts", "eta_min", eta_min);
  return std::make_shared<WarmRestartsImpl>(t_0, t_mult, eta_min);
}

std::shared_ptr<Schedule> OneCycleSchedule(const OneCycleOptions& o) {
  // Per-group lists: of one length, and each value checked as its scalar.
  size_t groups = 0;
  const std::pair<const char*, const std::vector<double>*> lists[] = {{"group_max_lr", &o.group_max_lr},
                                                                      {"group_base_momentum", &o.group_base_momentum},
                                                                      {"group_max_momentum", &o.group_max_momentum}};
  const char* first_list = nullptr;
  for (const auto& [name, list] : lists) {
    if (list->empty()) continue;
    if (groups != 0 && list->size() != groups) {
      throw std::invalid_argument(std::string("OneCycleLR: ") + name + " has " + std::to_string(list->size()) +
                                  " values and " + first_list + " " + std::to_string(groups) +
                                  ": give one value per param group in each");
    }
    groups = list->size();
    first_list = name;
  }
  if (o.group_max_lr.empty()) {
    if (!(o.max_lr > 0) || !std::isfinite(o.max_lr)) {
      throw std::invalid_argument("OneCycleLR: max_lr " + Number(o.max_lr) + " must be finite and > 0");
    }
  } else {
    if (o.max_lr != 0) {
      throw std::invalid_argument("OneCycleLR: both max_lr " + Number(o.max_lr) +
                                  " and group_max_lr are given; leave max_lr 0 with the list");
    }
    for (size_t k = 0; k < o.group_max_lr.size(); ++k) {
      const double x = o.group_max_lr[k];
      if (!(x > 0) || !std::isfinite(x)) {
        throw std::invalid_argument("OneCycleLR: group_max_lr[" + std::to_string(k) + "] " + Number(x) +
                                    " must be finite and > 0");
      }
    }
  }
  if (o.total_steps < 1) {
    throw std::invalid_argument("OneCycleLR: total_steps " + std::to_string(o.total_steps) + " must be >= 1");
  }
  if (!(o.pct_start >= 0 && o.pct_start <= 1)) {
    throw std::invalid_argument("OneCycleLR: pct_start " + Number(o.pct_start) + " must be in [0, 1]");
  }
  if (o.anneal_strategy != AnnealStrategy::kCos && o.anneal_strategy != AnnealStrategy::kLinear) {
    throw std::invalid_argument("OneCycleLR: unknown anneal_strategy " +
                                std::to_string(static_cast<int>(o.anneal_strategy)) + ", expected kCos or kLinear");
  }
  if (!(o.div_factor > 0) || !std::isfinite(o.div_factor)) {
    throw std::invalid_argument("OneCycleLR: div_factor " + Number(o.div_factor) + " must be finite and > 0");
  }
  if (!(o.final_div_factor > 0) || !std::isfinite(o.final_div_factor)) {
    throw std::invalid_argument("OneCycleLR: final_div_factor " + Number(o.final_div_factor) +
                                " must be finite and > 0");
  }
  // The rising phase would run from step 0 to step 0: no rate for step 0.
  if (o.pct_start * static_cast<double>(o.total_steps) == 1) {
    throw std::invalid_argument("OneCycleLR: pct_start " + Number(o.pct_start) + " * total_steps " +
                                std::to_string(o.total_steps) +
                                " = 1 leaves the rising phase no steps; pick another pct_start");
  }
  if (o.cycle_momentum) {
    CheckFiniteNonNegative("OneCycleLR", "base_momentum", o.base_momentum);
    CheckFiniteNonNegative("OneCycleLR", "max_momentum", o.max_momentum);
    for (const auto& [name, list] : {lists[1], lists[2]}) {
      for (size_t k = 0; k < list->size(); ++k) {
        const std::string field = std::string(name) + "[" + std::to_string(k) + "]";
        CheckFiniteNonNegative("OneCycleLR", field.c_str(), (*list)[k]);
      }
    }
  }
  return std::make_shared<OneCycleImpl>(o);
}

std::shared_ptr<Schedule> WarmupCosineSchedule(int64_t warmup_steps, int64_t total_steps,
                                               double start_factor, double eta_min, CosineTail tail) {
  // Checked here, so that a refusal names the schedule the caller made, not
  // the LinearLR or CosineAnnealingLR it is built from.
  const char* const who = "WarmupCosineSchedule: ";
  if (warmup_steps < 1 || total_steps <= warmup_steps) {
    throw std::invalid_argument(std::string(who) + "need 1 <= warmup_steps (" + std::to_string(warmup_steps) +
                                ") < total_steps (" + std::to_string(total_steps) + ")");
  }
  if (!(start_factor > 0 && start_factor <= 1)) {
    throw std::invalid_argument(std::string(who) + "start_factor " + internal::OptionValueText(start_factor) +
                                " must be in (0, 1]");
  }
  if (!(eta_min >= 0) || !std::isfinite(eta_min)) {
    throw std::invalid_argument(std::string(who) + "eta_min " + internal::OptionValueText(eta_min) +
                                " must be finite and >= 0");
  }
  if (tail != CosineTail::kPeriodic && tail != CosineTail::kHold) {
    throw std::invalid_argument(std::string(who) + "unknown tail " + std::to_string(static_cast<int>(tail)));
  }
  return SequentialSchedule({LinearSchedule(start_factor, 1.0, warmup_steps),
                             CosineSchedule(total_steps - warmup_steps, eta_min, tail)},
                            {warmup_steps});
}

namespace {

// Every param group's rate. A refused rate (set_lr throws for a negative or
// non-finite one) puts back the groups already set, so that nothing changed.
internal::GroupRates RatesOf(Optimizer& optimizer) {
  return {.count = optimizer.num_groups(),
          .current_count = [&optimizer] { return optimizer.num_groups(); },
          .get = [&optimizer](size_t k) { return optimizer.lr(k); },
          .set =
              [&optimizer](const std::vector<double>& lrs) {
                std::vector<double> old;
                for (size_t k = 0; k < lrs.size(); ++k) old.push_back(optimizer.lr(k));
                try {
                  for (size_t k = 0; k < lrs.size(); ++k) optimizer.set_lr(k, lrs[k]);
                } catch (...) {
                  for (size_t k = 0; k < old.size(); ++k) optimizer.set_lr(k, old[k]);
                  throw;
                }
              }};
}

// A target's one rate; empty functions stay empty (the callers refuse them).
internal::GroupRates RatesOf(LrTarget target) {
  internal::GroupRates rates;
  if (target.get) rates.get = [get = target.get](size_t) { return get(); };
  if (target.set) rates.set = [set = target.set](const std::vector<double>& lrs) { set(lrs.front()); };
  return rates;
}

// One rate per target, as param groups; `who` names the caller in errors.
internal::GroupRates RatesOf(std::vector<LrTarget> targets, const char* who) {
  if (targets.empty()) throw std::invalid_argument(std::string(who) + ": no learning-rate targets");
  for (size_t k = 0; k < targets.size(); ++k) {
    if (!targets[k].get || !targets[k].set) {
      throw std::invalid_argument(std::string(who) + ": target " + std::to_string(k) + " lacks get or set");
    }
  }
  auto shared = std::make_shared<const std::vector<LrTarget>>(std::move(targets));
  return {.count = shared->size(),
          .get = [shared](size_t k) { return (*shared)[k].get(); },
          .set =
              [shared](const std::vector<double>& lrs) {
                std::vector<double> old;
                for (size_t k = 0; k < lrs.size(); ++k) old.push_back((*shared)[k].get());
                size_t done = 0;
                try {
                  for (; done < lrs.size(); ++done) (*shared)[done].set(lrs[done]);
                } catch (...) {
                  for (size_t k = 0; k < done; ++k) (*shared)[k].set(old[k]);
                  throw;
                }
              }};
}

}  // namespace

LrScheduler::LrScheduler(Optimizer& optimizer, std::shared_ptr<Schedule> schedule)
    : LrScheduler(RatesOf(optimizer), std::move(schedule), &optimizer) {}

LrScheduler::LrScheduler(LrTarget target, std::shared_ptr<Schedule> schedule)
    : LrScheduler(RatesOf(std::move(target)), std::move(schedule), nullptr) {}

LrScheduler::LrScheduler(std::vector<LrTarget> targets, std::shared_ptr<Schedule> schedule)
    : LrScheduler(RatesOf(std::move(targets), "LrScheduler"), std::move(schedule), nullptr) {}

namespace {

// Throws unless `optimizer` takes every momentum `schedule` sets, in each group.
void CheckCycledMomentum(const Optimizer& optimizer, const Schedule& schedule) {
  for (size_t k = 0; k < optimizer.num_groups(); ++k) {
    for (double m : schedule.MomentumBounds()) {
      try {
        optimizer.CheckMomentum(k, m);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("LrScheduler: " + schedule.Describe() + " cycles momentum: " + e.what() +
                                    "; for the rate alone, make the schedule with cycle_momentum = false");
      }
    }
  }
}

}  // namespace

LrScheduler::LrScheduler(internal::GroupRates rates, std::shared_ptr<Schedule> schedule, Optimizer* optimizer)
    : rates_(std::move(rates)), schedule_(std::move(schedule)) {
  static std::atomic<uint64_t> next_serial{1};
  serial_ = next_serial.fetch_add(1);
  if (!rates_.get || !rates_.set) throw std::invalid_argument("LrScheduler: the target lacks get or set");
  if (!schedule_) throw std::invalid_argument("LrScheduler: no schedule");
  if (schedule_->GroupCount() != 0 && schedule_->GroupCount() != rates_.count) {
    const std::string described = schedule_->Describe();
    throw std::invalid_argument("LrScheduler: " + (described.empty() ? std::string("the schedule") : described) +
                                " has values for " + std::to_string(schedule_->GroupCount()) +
                                " param group(s), and the " +
                                (optimizer != nullptr ? std::string(optimizer->Name()) + " optimizer" : "target") +
                                " has " + std::to_string(rates_.count));
  }
  if (schedule_->CyclesMomentum()) {
    if (optimizer == nullptr) {
      throw std::invalid_argument("LrScheduler: " + schedule_->Describe() +
                                  " cycles momentum, which a bare learning-rate target does not have: make it "
                                  "with cycle_momentum = false, or drive the optimizer itself");
    }
    CheckCycledMomentum(*optimizer, *schedule_);
    momentum_of_ = optimizer;
  }
  if (optimizer != nullptr) {
    // Each scheduler sets the rate outright: a second one would overwrite
    // the first's at every step (PyTorch's chained schedulers multiply
    // instead, which closed forms of one step count cannot).
    if (!optimizer->scheduler_.expired()) {
      throw std::invalid_argument(std::string("LrScheduler: this ") + optimizer->Name() +
                                  " optimizer already has a scheduler, and two would overwrite each other's "
                                  "learning rate; make one schedule of both (SequentialSchedule runs "
                                  "schedules one after another, as WarmupCosineSchedule does), or destroy "
                                  "the first scheduler before making another");
    }
    claim_ = std::make_shared<char>(0);
  }
  for (size_t k = 0; k < rates_.count; ++k) base_lrs_.push_back(rates_.get(k));
  SetAt(base_lrs_, 0);
  // Claimed once nothing can throw: a refused rate leaves the optimizer free.
  if (optimizer != nullptr) optimizer->scheduler_ = claim_;
}

std::vector<double> LrScheduler::RatesAt(const std::vector<double>& base_lrs, int64_t t) const {
  std::vector<double> lrs;
  for (size_t k = 0; k < base_lrs.size(); ++k) lrs.push_back(schedule_->GroupLr(k, base_lrs[k], t));
  return lrs;
}

std::vector<double> LrScheduler::MomentaAt(int64_t t) const {
  std::vector<double> momenta;
  if (momentum_of_ == nullptr) return momenta;
  for (size_t k = 0; k < momentum_of_->num_groups(); ++k) momenta.push_back(schedule_->GroupMomentum(k, t));
  return momenta;
}

void LrScheduler::SetAt(const std::vector<double>& base_lrs, int64_t t) {
  SetRates(RatesAt(base_lrs, t), MomentaAt(t));
}

void LrScheduler::SetRates(const std::vector<double>& lrs, const std::vector<double>& momenta) {
  if (momentum_of_ == nullptr) {
    rates_.set(lrs);
    return;
  }
  // Every momentum checked before any rate is set; the rates set all or
  // none; the momenta, checked, then cannot fail.
  if (momenta.size() != momentum_of_->num_groups()) {
    throw std::invalid_argument("LrScheduler: " + std::to_string(momenta.size()) + " momenta for the " +
                                std::to_string(momentum_of_->num_groups()) + " param group(s) of the " +
                                momentum_of_->Name() + " optimizer (a group was added since they were computed)");
  }
  for (size_t k = 0; k < momenta.size(); ++k) momentum_of_->CheckMomentum(k, momenta[k]);
  rates_.set(lrs);
  for (size_t k = 0; k < momenta.size(); ++k) momentum_of_->set_momentum(k, momenta[k]);
}

void LrScheduler::Step() {
  // Counted only once the target took the rates: a refused one changes nothing.
  SetAt(base_lrs_, t_ + 1);
  ++t_;
}

NamedTensors LrScheduler::StateDict() const {
  // One group keeps the scalar of states saved before groups existed.
  const Shape shape = base_lrs_.size() == 1 ? Shape{} : Shape{static_cast<int64_t>(base_lrs_.size())};
  NamedTensors out = {{"scheduler.step", FromVectorOf<int64_t>({t_}, {})},
                      {"scheduler.base_lr", FromVector(base_lrs_, shape, {.dtype = DType::kFloat64})}};
  const std::string schedule = schedule_->Describe();
  if (!schedule.empty()) {
    out.emplace_back("scheduler.schedule", FromVectorOf<uint8_t>(std::vector<uint8_t>(schedule.begin(), schedule.end()),
                                                                 {static_cast<int64_t>(schedule.size())}));
  }
  return out;
}

namespace {

struct SchedulerState {
  int64_t step;
  std::vector<double> base_lrs;
  // The schedule's rate of each group at `step`, as the checks computed
  // it: the load sets these rather than asking the schedule again, so that
  // a user's function (LambdaSchedule's) is called once per group and the
  // rates set are the ones checked.
  std::vector<double> lrs;
  // The same for a cycled momentum: one per param group of the optimizer
  // whose momentum the schedule drives, checked against it; empty when
  // the schedule cycles none.
  std::vector<double> momenta;
};

// The saved schedule description ("scheduler.schedule", null: absent);
// empty when absent. Throws for one that is not u8 text.
std::string SavedScheduleOf(const Tensor* t) {
  if (t == nullptr) return "";
  if (!t->defined() || t->dtype() != DType::kUInt8 || t->dim() != 1) {
    const std::string found = t->defined() ? std::string(DTypeName(t->dtype())) + " " + ShapeToString(t->shape())
                                           : std::string("undefined");
    throw std::invalid_argument("LrScheduler.LoadStateDict: `scheduler.schedule` is " + found +
                                ", expected u8 text");
  }
  const Tensor text = t->To(kCPU).Contiguous();
  return std::string(text.data<uint8_t>(), text.data<uint8_t>() + text.numel());
}

// The checks of LoadStateDict: the state it would load, or throws. The
// rate `schedule` gives for the loaded step is checked too, so that a
// restore which would end in a refused rate (StepLR's gamma^k overflowing
// after many periods, say) fails here, before any component was changed;
// and so is the momentum it gives each group of `momentum_of` (null: none
// cycled), which a schedule defined elsewhere may give outside the bounds
// it declared.
SchedulerState ReadSchedulerState(const NamedTensors& state, const Schedule& schedule, size_t groups,
                                  const Optimizer* momentum_of) {
  const Tensor* step = nullptr;
  const Tensor* base = nullptr;
  const Tensor* described = nullptr;
  for (const auto& [k, t] : state) {
    if (k == "scheduler.step") step = &t;
    else if (k == "scheduler.base_lr") base = &t;
    else if (k == "scheduler.schedule") described = &t;
    else if (k.rfind("scheduler.", 0) == 0) throw std::invalid_argument("LrScheduler.LoadStateDict: unexpected `" + k + "`");
  }
  internal::CheckStateScalar("LrScheduler.LoadStateDict", "scheduler.step", step, DType::kInt64);
  // One base rate per param group: a scalar for one group (as saved
  // before groups existed), a 1-D tensor for several.
  if (base != nullptr && base->defined() && base->dtype() == DType::kFloat64 && base->dim() <= 1) {
    const size_t saved = base->dim() == 0 ? 1 : static_cast<size_t>(base->numel());
    if (saved != groups) {
      throw std::invalid_argument("LrScheduler.LoadStateDict: `scheduler.base_lr` holds the base rates of " +
                                  std::to_string(saved) + " param group(s), this scheduler drives " +
                                  std::to_string(groups) + ": make it over an optimizer with the saved groups");
    }
  }
  if (groups == 1) {
    internal::CheckStateScalar("LrScheduler.LoadStateDict", "scheduler.base_lr", base, DType::kFloat64);
  } else if (base == nullptr || !base->defined() || base->dtype() != DType::kFloat64 || base->dim() != 1) {
    const std::string found = base == nullptr ? std::string("missing")
                              : base->defined() ? "is " + std::string(DTypeName(base->dtype())) + " " +
                                                      ShapeToString(base->shape())
                                                : std::string("is undefined");
    throw std::invalid_argument("LrScheduler.LoadStateDict: `scheduler.base_lr` " + found + ", expected f64 [" +
                                std::to_string(groups) + "] (one base rate per param group)");
  }
  const int64_t t = step->To(kCPU).data<int64_t>()[0];
  if (t < 0) throw std::invalid_argument("LrScheduler.LoadStateDict: scheduler.step " + std::to_string(t) + " < 0");
  // Step counts one more: past the largest i64 the count would wrap.
  if (t == std::numeric_limits<int64_t>::max()) {
    throw std::invalid_argument("LrScheduler.LoadStateDict: scheduler.step " + std::to_string(t) +
                                " is the largest i64: the next Step's count would overflow");
  }
  const std::vector<double> base_lrs = base->To(kCPU).Contiguous().ToVector<double>();
  for (size_t k = 0; k < base_lrs.size(); ++k) {
    const double base_lr = base_lrs[k];
    if (!(base_lr >= 0) || !std::isfinite(base_lr)) {
      throw std::invalid_argument("LrScheduler.LoadStateDict: scheduler.base_lr " +
                                  (groups == 1 ? std::string() : "of param group " + std::to_string(k) + " ") +
                                  internal::OptionValueText(base_lr) + " must be finite and >= 0");
    }
  }
  // Both problems are reported when both occur: the rate is the one this
  // scheduler would set, whichever schedule the state came from.
  std::vector<std::string> problems;
  const std::string saved = SavedScheduleOf(described);
  const std::string current = schedule.Describe();
  if (!saved.empty() && !current.empty() && saved != current) {
    problems.push_back("the state was saved with schedule " + saved + ", this scheduler's is " + current +
                       " (its step count would give another rate): make the scheduler with the saved schedule");
  }
  std::vector<double> lrs;
  bool outside = false;
  for (size_t k = 0; k < base_lrs.size(); ++k) {
    const double base_lr = base_lrs[k];
    double lr = 0;
    try {
      lr = schedule.GroupLr(k, base_lr, t);
      lrs.push_back(lr);
    } catch (const std::out_of_range& e) {
      // A step past the schedule's end (OneCycle's total_steps): one more
      // problem, not another kind of error. The same for every group.
      problems.push_back(std::string("scheduler.step ") + std::to_string(t) + " is outside the schedule: " +
                         e.what());
      outside = true;
      break;
    }
    if (!(lr >= 0) || !std::isfinite(lr)) {
      problems.push_back("the schedule gives learning rate " + internal::OptionValueText(lr) + " at scheduler.step " +
                         std::to_string(t) + " from scheduler.base_lr " +
                         (groups == 1 ? std::string() : "of param group " + std::to_string(k) + " ") +
                         internal::OptionValueText(base_lr) + ", expected a finite rate >= 0");
    }
  }
  std::vector<double> momenta;
  for (size_t k = 0; momentum_of != nullptr && !outside && k < momentum_of->num_groups(); ++k) {
    double momentum = 0;
    try {
      momentum = schedule.GroupMomentum(k, t);
    } catch (const std::out_of_range& e) {
      problems.push_back(std::string("scheduler.step ") + std::to_string(t) + " is outside the schedule: " +
                         e.what());
      break;
    }
    momenta.push_back(momentum);
    try {
      momentum_of->CheckMomentum(k, momentum);
    } catch (const std::invalid_argument& e) {
      problems.push_back("the schedule gives param group " + std::to_string(k) + " momentum " +
                         internal::OptionValueText(momentum) + " at scheduler.step " + std::to_string(t) +
                         ", which the optimizer refuses: " + e.what());
    }
  }
  if (!problems.empty()) {
    std::string message = "LrScheduler.LoadStateDict: ";
    for (size_t i = 0; i < problems.size(); ++i) message += (i ? "; " : "") + problems[i];
    throw std::invalid_argument(message);
  }
  return {t, base_lrs, lrs, momenta};
}

}  // namespace

LrScheduler::CheckedState LrScheduler::CheckStateDict(const NamedTensors& state) const {
  SchedulerState s = ReadSchedulerState(state, *schedule_, rates_.count, momentum_of_);
  CheckedState checked;
  checked.scheduler_ = serial_;
  checked.step_ = s.step;
  checked.base_lrs_ = std::move(s.base_lrs);
  checked.lrs_ = std::move(s.lrs);
  checked.momenta_ = std::move(s.momenta);
  return checked;
}

void LrScheduler::LoadStateDict(const NamedTensors& state) { LoadChecked(CheckStateDict(state)); }

void LrScheduler::LoadChecked(const CheckedState& checked) {
  // The values are this scheduler's schedule's, checked against its
  // optimizer: another scheduler's could have given or refused others.
  if (checked.scheduler_ != serial_ || checked.base_lrs_.size() != rates_.count) {
    throw std::invalid_argument(
        "LrScheduler.LoadChecked: the checked state (" + std::to_string(checked.base_lrs_.size()) +
        " param group(s)) was not checked by this scheduler (" + std::to_string(rates_.count) +
        " param group(s)): load what this scheduler's CheckStateDict returned");
  }
  // The rates are set first: if the target refuses one (a schedule may
  // still compute a rate the optimizer takes as invalid), nothing has
  // changed.
  SetRates(checked.lrs_, checked.momenta_);
  t_ = checked.step_;
  base_lrs_ = checked.base_lrs_;
}

LrScheduler::Snapshot LrScheduler::TakeSnapshot() const {
  Snapshot snapshot;
  snapshot.scheduler_ = serial_;
  snapshot.step_ = t_;
  snapshot.base_lrs_ = base_lrs_;
  for (size_t k = 0; k < rates_.count; ++k) snapshot.lrs_.push_back(rates_.get(k));
  if (momentum_of_ != nullptr) {
    for (size_t k = 0; k < momentum_of_->num_groups(); ++k) snapshot.momenta_.push_back(momentum_of_->momentum(k));
  }
  return snapshot;
}

void LrScheduler::RestoreSnapshot(const Snapshot& snapshot) {
  if (snapshot.scheduler_ != serial_) {
    throw std::invalid_argument(
        "LrScheduler.RestoreSnapshot: the snapshot was taken of another scheduler: restore what this "
        "scheduler's TakeSnapshot returned");
  }
  // All or nothing, as a load: the rates first.
  SetRates(snapshot.lrs_, snapshot.momenta_);
  t_ = snapshot.step_;
  base_lrs_ = snapshot.base_lrs_;
}

ReduceLrOnPlateau::ReduceLrOnPlateau(Optimizer& optimizer, PlateauOptions options)
    : ReduceLrOnPlateau(RatesOf(optimizer), std::move(options),
                        "param group(s) of the " + std::string(optimizer.Name()) + " optimizer") {
  optimizer_name_ = optimizer.Name();
}

ReduceLrOnPlateau::ReduceLrOnPlateau(LrTarget target, PlateauOptions options)
    : ReduceLrOnPlateau(RatesOf(std::move(target)), std::move(options), "target") {}

ReduceLrOnPlateau::ReduceLrOnPlateau(std::vector<LrTarget> targets, PlateauOptions options)
    : ReduceLrOnPlateau(RatesOf(std::move(targets), "ReduceLROnPlateau"), std::move(options), "targets") {}

ReduceLrOnPlateau::ReduceLrOnPlateau(internal::GroupRates rates, PlateauOptions options, const std::string& groups)
    : rates_(std::move(rates)), options_(std::move(options)) {
  constexpr const char* kWho = "ReduceLROnPlateau";
  if (!rates_.get || !rates_.set) throw std::invalid_argument("ReduceLROnPlateau: the target lacks get or set");
  if (options_.mode != PlateauOptions::Mode::kMin && options_.mode != PlateauOptions::Mode::kMax) {
    throw std::invalid_argument("ReduceLROnPlateau: unknown mode " + std::to_string(static_cast<int>(options_.mode)) +
                                ", expected kMin or kMax");
  }
  if (options_.threshold_mode != PlateauOptions::ThresholdMode::kRel &&
      options_.threshold_mode != PlateauOptions::ThresholdMode::kAbs) {
    throw std::invalid_argument("ReduceLROnPlateau: unknown threshold_mode " +
                                std::to_string(static_cast<int>(options_.threshold_mode)) + ", expected kRel or kAbs");
  }
  // factor 1 or more would never reduce (or would raise) the rate.
  if (!(options_.factor >= 0 && options_.factor < 1)) {
    throw std::invalid_argument("ReduceLROnPlateau: factor " + Number(options_.factor) + " must be in [0, 1)");
  }
  if (options_.patience < 0) {
    throw std::invalid_argument("ReduceLROnPlateau: patience " + std::to_string(options_.patience) + " must be >= 0");
  }
  if (options_.cooldown < 0) {
    throw std::invalid_argument("ReduceLROnPlateau: cooldown " + std::to_string(options_.cooldown) + " must be >= 0");
  }
  CheckFiniteNonNegative(kWho, "threshold", options_.threshold);
  // In min mode a relative threshold of 1 or more asks for a metric below
  // best * (1 - threshold): NaN or -inf against the initial best (+inf), 0
  // or less after, so nothing would ever improve and the rate would be cut
  // every patience + 1 steps. Max mode (best * (1 + threshold)) and absolute
  // thresholds can always be beaten by a larger (smaller) metric.
  if (options_.mode == PlateauOptions::Mode::kMin && options_.threshold_mode == PlateauOptions::ThresholdMode::kRel &&
      options_.threshold >= 1) {
    throw std::invalid_argument("ReduceLROnPlateau: threshold " + Number(options_.threshold) +
                                " must be < 1 with mode=min and threshold_mode=rel: a metric counts as better only "
                                "below best * (1 - threshold), which no metric would ever be");
  }
  CheckFiniteNonNegative(kWho, "min_lr", options_.min_lr);
  CheckFiniteNonNegative(kWho, "eps", options_.eps);
  const std::vector<double>& floors = options_.group_min_lr;
  if (!floors.empty()) {
    if (options_.min_lr != 0) {
      throw std::invalid_argument("ReduceLROnPlateau: both min_lr " + Number(options_.min_lr) +
                                  " and group_min_lr are given; leave min_lr 0 with the list");
    }
    if (floors.size() != rates_.count) {
      throw std::invalid_argument("ReduceLROnPlateau: group_min_lr has " + std::to_string(floors.size()) +
                                  " values for " + std::to_string(rates_.count) + " " + groups +
                                  ": give one min_lr per param group");
    }
    for (size_t k = 0; k < floors.size(); ++k) {
      const std::string field = "group_min_lr[" + std::to_string(k) + "]";
      CheckFiniteNonNegative(kWho, field.c_str(), floors[k]);
    }
  }
  best_ = options_.mode == PlateauOptions::Mode::kMin ? std::numeric_limits<double>::infinity()
                                                      : -std::numeric_limits<double>::infinity();
}

bool ReduceLrOnPlateau::IsBetter(double metric) const {
  const bool rel = options_.threshold_mode == PlateauOptions::ThresholdMode::kRel;
  // NaN compares false: no improvement.
  if (options_.mode == PlateauOptions::Mode::kMin) {
    return rel ? metric < best_ * (1.0 - options_.threshold) : metric < best_ - options_.threshold;
  }
  return rel ? metric > best_ * (options_.threshold + 1.0) : metric > best_ + options_.threshold;
}

double ReduceLrOnPlateau::MinLr(size_t group) const {
  return options_.group_min_lr.empty() ? options_.min_lr : options_.group_min_lr[group];
}

void ReduceLrOnPlateau::Step(double metric) {
  // Every group the optimizer has now, those added since this was made included.
  const size_t groups = rates_.current_count ? rates_.current_count() : rates_.count;
  // Checked at every step, not only at a reduction, so that the mistake
  // shows at once rather than epochs later.
  if (!options_.group_min_lr.empty() && groups > options_.group_min_lr.size()) {
    throw std::logic_error("ReduceLROnPlateau: the " + optimizer_name_ + " optimizer has " + std::to_string(groups) +
                           " param groups and group_min_lr " + std::to_string(options_.group_min_lr.size()) +
                           " values: param group " + std::to_string(options_.group_min_lr.size()) +
                           " was added after this scheduler was made and has no min_lr; make the scheduler "
                           "after adding the groups");
  }
  // Worked on copies, stored only once the target took any new rate.
  double best = best_;
  int64_t bad = num_bad_, cooldown = cooldown_counter_;
  if (IsBetter(metric)) {
    best = metric;
    bad = 0;
  } else {
    ++bad;
  }
  if (cooldown > 0) {
    --cooldown;
    bad = 0;
  }
  if (bad > options_.patience) {
    std::vector<double> lrs;
    bool reduced = false;
    for (size_t k = 0; k < groups; ++k) {
      const double old_lr = rates_.get(k);
      const double new_lr = std::max(old_lr * options_.factor, MinLr(k));
      // Reductions smaller than eps are not worth making (PyTorch's rule,
      // group by group).
      const bool worth_it = old_lr - new_lr > options_.eps;
      lrs.push_back(worth_it ? new_lr : old_lr);
      reduced = reduced || worth_it;
    }
    if (reduced) rates_.set(lrs);
    cooldown = options_.cooldown;
    bad = 0;
  }
  best_ = best;
  num_bad_ = bad;
  cooldown_counter_ = cooldown;
  ++steps_;
}

std::string ReduceLrOnPlateau::Describe() const {
  const PlateauOptions& o = options_;
  // A list replaces the scalar it stands for; without one, the text is as
  // before lists existed, so that saved states still load.
  std::string min_lr = Number(o.min_lr);
  if (!o.group_min_lr.empty()) {
    min_lr = "[";
    for (size_t k = 0; k < o.group_min_lr.size(); ++k) min_lr += (k ? ", " : "") + Number(o.group_min_lr[k]);
    min_lr += "]";
  }
  return std::string("ReduceLROnPlateau(mode=") + (o.mode == PlateauOptions::Mode::kMin ? "min" : "max") +
         ", factor=" + Number(o.factor) + ", patience=" + std::to_string(o.patience) +
         ", threshold=" + Number(o.threshold) +
         ", threshold_mode=" + (o.threshold_mode == PlateauOptions::ThresholdMode::kRel ? "rel" : "abs") +
         ", cooldown=" + std::to_string(o.cooldown) + ", min_lr=" + min_lr + ", eps=" + Number(o.eps) + ")";
}

NamedTensors ReduceLrOnPlateau::StateDict() const {
  const std::string options = Describe();
  return {{"plateau.best", FromVector({best_}, {}, {.dtype = DType::kFloat64})},
          {"plateau.num_bad_steps", FromVectorOf<int64_t>({num_bad_}, {})},
          {"plateau.cooldown_counter", FromVectorOf<int64_t>({cooldown_counter_}, {})},
          {"plateau.step", FromVectorOf<int64_t>({steps_}, {})},
          {"plateau.options", FromVectorOf<uint8_t>(std::vector<uint8_t>(options.begin(), options.end()),
                                                    {static_cast<int64_t>(options.size())})}};
}

namespace {

struct PlateauState {
  double best;
  int64_t num_bad, cooldown_counter, steps;
};

PlateauState ReadPlateauState(const NamedTensors& state, const std::string& current) {
  constexpr const char* kWho = "ReduceLROnPlateau.LoadStateDict";
  const Tensor *best = nullptr, *bad = nullptr, *cooldown = nullptr, *step = nullptr, *options = nullptr;
  for (const auto& [k, t] : state) {
    if (k == "plateau.best") best = &t;
    else if (k == "plateau.num_bad_steps") bad = &t;
    else if (k == "plateau.cooldown_counter") cooldown = &t;
    else if (k == "plateau.step") step = &t;
    else if (k == "plateau.options") options = &t;
    else if (k.rfind("plateau.", 0) == 0) throw std::invalid_argument(std::string(kWho) + ": unexpected `" + k + "`");
  }
  internal::CheckStateScalar(kWho, "plateau.best", best, DType::kFloat64);
  internal::CheckStateScalar(kWho, "plateau.num_bad_steps", bad, DType::kInt64);
  internal::CheckStateScalar(kWho, "plateau.cooldown_counter", cooldown, DType::kInt64);
  internal::CheckStateScalar(kWho, "plateau.step", step, DType::kInt64);
  if (options == nullptr) throw std::invalid_argument(std::string(kWho) + ": missing u8 text `plateau.options`");
  if (!options->defined() || options->dtype() != DType::kUInt8 || options->dim() != 1) {
    throw std::invalid_argument(std::string(kWho) + ": `plateau.options` is not u8 text");
  }
  const Tensor text = options->To(kCPU).Contiguous();
  const std::string saved(text.data<uint8_t>(), text.data<uint8_t>() + text.numel());
  if (saved != current) {
    throw std::invalid_argument(std::string(kWho) + ": the state was saved with " + saved + ", this one is " +
                                current + ": make it with the saved options");
  }
  const PlateauState s{best->Item(), bad->To(kCPU).data<int64_t>()[0], cooldown->To(kCPU).data<int64_t>()[0],
                       step->To(kCPU).data<int64_t>()[0]};
  if (s.num_bad < 0 || s.cooldown_counter < 0 || s.steps < 0) {
    throw std::invalid_argument(std::string(kWho) + ": plateau.num_bad_steps " + std::to_string(s.num_bad) +
                                ", plateau.cooldown_counter " + std::to_string(s.cooldown_counter) +
                                " and plateau.step " + std::to_string(s.steps) + " must all be >= 0");
  }
  // Step counts one more of each: past the largest i64 they would wrap.
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"plateau.num_bad_steps", s.num_bad},
                                    std::pair<const char*, int64_t>{"plateau.step", s.steps}}) {
    if (value == std::numeric_limits<int64_t>::max()) {
      throw std::invalid_argument(std::string(kWho) + ": " + name + " " + std::to_string(value) +
                                  " is the largest i64: the next Step's count would overflow");
    }
  }
  // A NaN best would make every later metric a non-improvement.
  if (std::isnan(s.best)) throw std::invalid_argument(std::string(kWho) + ": plateau.best is NaN");
  return s;
}

}  // namespace

void ReduceLrOnPlateau::CheckStateDict(const NamedTensors& state) const { ReadPlateauState(state, Describe()); }

void ReduceLrOnPlateau::LoadStateDict(const NamedTensors& state) {
  const PlateauState s = ReadPlateauState(state, Describe());
  best_ = s.best;
  num_bad_ = s.num_bad;
  cooldown_counter_ = s.cooldown_counter;
  steps_ = s.steps;
}

}  // namespace ddp::nn::optim
