#include "nn/optim/lr_scheduler.h"

#include <algorithm>
#include <charconv>
#include <cmath>
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

}  // namespace

std::shared_ptr<Schedule> StepSchedule(int64_t step_size, double gamma) {
  if (step_size < 1) throw std::invalid_argument("StepLR: step_size " + std::to_string(step_size) + " must be >= 1");
  // A negative gamma gives negative rates every other period, and a NaN or
  // infinite one rates the optimizer refuses only when they come.
  if (!(gamma >= 0) || !std::isfinite(gamma)) {
    throw std::invalid_argument("StepLR: gamma " + std::to_string(gamma) + " must be finite and >= 0");
  }
  return std::make_shared<StepImpl>(step_size, gamma);
}

std::shared_ptr<Schedule> CosineSchedule(int64_t t_max, double eta_min, CosineTail tail) {
  if (t_max < 1) throw std::invalid_argument("CosineAnnealingLR: t_max " + std::to_string(t_max) + " must be >= 1");
  // eta_min is the rate reached at t_max: it must be one the optimizer takes.
  if (!(eta_min >= 0) || !std::isfinite(eta_min)) {
    throw std::invalid_argument("CosineAnnealingLR: eta_min " + std::to_string(eta_min) + " must be finite and >= 0");
  }
  if (tail != CosineTail::kPeriodic && tail != CosineTail::kHold) {
    throw std::invalid_argument("CosineAnnealingLR: unknown tail " + std::to_string(static_cast<int>(tail)));
  }
  return std::make_shared<CosineImpl>(t_max, eta_min, tail);
}

std::shared_ptr<Schedule> LinearSchedule(double start_factor, double end_factor, int64_t total_iters) {
  if (!(start_factor > 0 && start_factor <= 1 && end_factor >= 0 && end_factor <= 1)) {
    throw std::invalid_argument("LinearLR: start_factor " + std::to_string(start_factor) +
                                " must be in (0, 1] and end_factor " + std::to_string(end_factor) +
                                " in [0, 1]");
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
  for (const auto& s : schedules) {
    if (!s) throw std::invalid_argument("SequentialLR: a schedule is null");
  }
  return std::make_shared<SequentialImpl>(std::move(schedules), std::move(milestones));
}

std::shared_ptr<Schedule> WarmupCosineSchedule(int64_t warmup_steps, int64_t total_steps,
                                               double start_factor, double eta_min, CosineTail tail) {
  if (warmup_steps < 1 || total_steps <= warmup_steps) {
    throw std::invalid_argument("warm-up cosine: need 1 <= warmup_steps (" + std::to_string(warmup_steps) +
                                ") < total_steps (" + std::to_string(total_steps) + ")");
  }
  return SequentialSchedule({LinearSchedule(start_factor, 1.0, warmup_steps),
                             CosineSchedule(total_steps - warmup_steps, eta_min, tail)},
                            {warmup_steps});
}

LrScheduler::LrScheduler(Optimizer& optimizer, std::shared_ptr<Schedule> schedule)
    : LrScheduler(LrTarget{[&optimizer] { return optimizer.lr(); },
                           [&optimizer](double lr) { optimizer.set_lr(lr); }},
                  std::move(schedule), &optimizer) {}

LrScheduler::LrScheduler(LrTarget target, std::shared_ptr<Schedule> schedule)
    : LrScheduler(std::move(target), std::move(schedule), nullptr) {}

LrScheduler::LrScheduler(LrTarget target, std::shared_ptr<Schedule> schedule, Optimizer* optimizer)
    : target_(std::move(target)), schedule_(std::move(schedule)) {
  if (!target_.get || !target_.set) throw std::invalid_argument("LrScheduler: the target lacks get or set");
  if (!schedule_) throw std::invalid_argument("LrScheduler: no schedule");
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
  base_lr_ = target_.get();
  target_.set(schedule_->Lr(base_lr_, 0));
  // Claimed once nothing can throw: a refused rate leaves the optimizer free.
  if (optimizer != nullptr) optimizer->scheduler_ = claim_;
}

void LrScheduler::Step() {
  // Counted only once the target took the rate: a refused one changes nothing.
  target_.set(schedule_->Lr(base_lr_, t_ + 1));
  ++t_;
}

NamedTensors LrScheduler::StateDict() const {
  NamedTensors out = {{"scheduler.step", FromVectorOf<int64_t>({t_}, {})},
                      {"scheduler.base_lr", FromVector({base_lr_}, {}, {.dtype = DType::kFloat64})}};
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
  double base_lr;
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
// after many periods, say) fails here, before any component was changed.
SchedulerState ReadSchedulerState(const NamedTensors& state, const Schedule& schedule) {
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
  internal::CheckStateScalar("LrScheduler.LoadStateDict", "scheduler.base_lr", base, DType::kFloat64);
  const int64_t t = step->To(kCPU).data<int64_t>()[0];
  if (t < 0) throw std::invalid_argument("LrScheduler.LoadStateDict: scheduler.step " + std::to_string(t) + " < 0");
  const double base_lr = base->Item();
  if (!(base_lr >= 0) || !std::isfinite(base_lr)) {
    throw std::invalid_argument("LrScheduler.LoadStateDict: scheduler.base_lr " + std::to_string(base_lr) +
                                " must be finite and >= 0");
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
  const double lr = schedule.Lr(base_lr, t);
  if (!(lr >= 0) || !std::isfinite(lr)) {
    problems.push_back("the schedule gives learning rate " + std::to_string(lr) + " at scheduler.step " +
                       std::to_string(t) + " from scheduler.base_lr " + std::to_string(base_lr) +
                       ", expected a finite rate >= 0");
  }
  if (!problems.empty()) {
    std::string message = "LrScheduler.LoadStateDict: ";
    for (size_t i = 0; i < problems.size(); ++i) message += (i ? "; " : "") + problems[i];
    throw std::invalid_argument(message);
  }
  return {t, base_lr};
}

}  // namespace

void LrScheduler::CheckStateDict(const NamedTensors& state) const { ReadSchedulerState(state, *schedule_); }

void LrScheduler::LoadStateDict(const NamedTensors& state) {
  const SchedulerState s = ReadSchedulerState(state, *schedule_);
  // The rate is set first: if the target refuses it (a schedule may still
  // compute a rate the optimizer takes as invalid), nothing has changed.
  target_.set(schedule_->Lr(s.base_lr, s.step));
  t_ = s.step;
  base_lr_ = s.base_lr;
}

}  // namespace ddp::nn::optim
