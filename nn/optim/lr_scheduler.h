#ifndef DDP_NN_OPTIM_LR_SCHEDULER_H_
#define DDP_NN_OPTIM_LR_SCHEDULER_H_

// Learning-rate schedules as closed forms of the step count, so a resumed
// run only needs the count, and schedules compose (warm-up, then cosine).
// Values follow PyTorch's StepLR, CosineAnnealingLR, LinearLR and
// SequentialLR.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/optim/optimizer.h"

namespace ddp::nn::optim {

/// Learning rate as a function of the step count t (0 before the first
/// scheduler step) and the optimizer's initial learning rate.
class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual double Lr(double base_lr, int64_t t) const = 0;
  /// The schedule's kind and parameters as text, e.g.
  /// "CosineAnnealingLR(T_max=100, eta_min=0, tail=periodic)": saved with
  /// LrScheduler's state, and compared when a state is loaded, so that a
  /// state saved with another schedule is refused instead of making the
  /// rate jump. Empty (the default, for schedules defined elsewhere) means
  /// unknown: nothing is saved, and nothing compared.
  virtual std::string Describe() const { return ""; }
};

/// What a cosine schedule does once t passes its end. Values are stable.
enum class CosineTail : int8_t {
  /// The closed form keeps going: the rate climbs back to base_lr at 2 t_max
  /// and falls again, as PyTorch's CosineAnnealingLR (and SequentialLR over
  /// it) does when stepped past T_max.
  kPeriodic = 0,
  /// The rate stays at eta_min from the end on: a decay over a fixed number
  /// of steps that a longer run (or a resumed one) must not undo.
  kHold = 1,
};

/// base_lr * gamma^(t / step_size)  (StepLR). Throws std::invalid_argument
/// unless step_size >= 1 and gamma is finite and >= 0.
std::shared_ptr<Schedule> StepSchedule(int64_t step_size, double gamma = 0.1);
/// eta_min + (base_lr - eta_min) * (1 + cos(pi * t / t_max)) / 2
/// (CosineAnnealingLR). By default periodic past t_max, as PyTorch's; with
/// CosineTail::kHold, eta_min for every t >= t_max. Throws
/// std::invalid_argument unless t_max >= 1 and eta_min is finite and >= 0.
std::shared_ptr<Schedule> CosineSchedule(int64_t t_max, double eta_min = 0.0,
                                         CosineTail tail = CosineTail::kPeriodic);
/// base_lr * (start + (end - start) * min(t, total_iters) / total_iters)
/// (LinearLR; a linear warm-up with end_factor 1).
std::shared_ptr<Schedule> LinearSchedule(double start_factor, double end_factor, int64_t total_iters);
/// schedules[k] from milestone k-1 on, counting its steps from there
/// (SequentialLR); milestones ascending, one fewer than schedules.
std::shared_ptr<Schedule> SequentialSchedule(std::vector<std::shared_ptr<Schedule>> schedules,
                                             std::vector<int64_t> milestones);
/// Linear warm-up from start_factor * base_lr over warmup_steps, then cosine
/// annealing to eta_min at total_steps. Past total_steps the default
/// (kPeriodic) follows PyTorch's SequentialLR(LinearLR, CosineAnnealingLR)
/// and climbs back up; pass CosineTail::kHold to stay at eta_min.
std::shared_ptr<Schedule> WarmupCosineSchedule(int64_t warmup_steps, int64_t total_steps,
                                               double start_factor = 0.01, double eta_min = 0.0,
                                               CosineTail tail = CosineTail::kPeriodic);

/// A learning rate a scheduler drives: an Optimizer's, or one shared by
/// several (the slices of a sharded optimizer).
struct LrTarget {
  std::function<double()> get;
  std::function<void(double)> set;
};

/// Drives an optimizer's learning rate along a schedule. Construction sets
/// lr to Lr(base_lr, 0) where base_lr is the optimizer's lr at that time.
/// The optimizer (or the target's owner) must outlive the scheduler.
///
/// One scheduler per optimizer: each sets the rate outright (closed forms
/// of its own step count), so two would overwrite each other, the last to
/// step winning, where PyTorch's chained schedulers multiply their factors.
/// Phases one after another are one SequentialSchedule (a warm-up, then
/// cosine: WarmupCosineSchedule).
class LrScheduler {
 public:
  /// Throws std::invalid_argument, changing nothing, when another
  /// LrScheduler made this way drives `optimizer` (one destroyed since
  /// frees it).
  LrScheduler(Optimizer& optimizer, std::shared_ptr<Schedule> schedule);
  /// Throws std::invalid_argument when `target` lacks get or set. Nothing
  /// tracks what a target drives: the caller keeps to one scheduler per rate.
  LrScheduler(LrTarget target, std::shared_ptr<Schedule> schedule);
  /// Not copyable: a copy would be a second scheduler of the same rate.
  LrScheduler(const LrScheduler&) = delete;
  LrScheduler& operator=(const LrScheduler&) = delete;
  LrScheduler(LrScheduler&&) = default;
  LrScheduler& operator=(LrScheduler&&) = default;

  /// Advances one step (after optimizer.Step(), as in PyTorch) and sets the
  /// lr. When the target refuses the rate, throws and changes nothing.
  void Step();
  /// Steps taken.
  int64_t step_count() const { return t_; }
  /// The current learning rate.
  double lr() const { return target_.get(); }
  double base_lr() const { return base_lr_; }

  /// "scheduler.step" (i64) and "scheduler.base_lr" (f64) scalars, and
  /// "scheduler.schedule" (u8 text, the schedule's Describe()) unless the
  /// schedule does not describe itself.
  NamedTensors StateDict() const;
  /// Restores from a list that may hold other components' keys; sets the lr
  /// for the restored step. Throws std::invalid_argument naming a missing
  /// or malformed key (a negative or non-finite base_lr too, or a step and
  /// base_lr for which the schedule gives such a rate), or a saved schedule
  /// description that differs from this schedule's (naming both); changes
  /// nothing then, nor when the target refuses the restored rate. A state
  /// without "scheduler.schedule" (saved before it existed, or from a
  /// schedule that does not describe itself) is taken as from an unknown
  /// schedule and not compared.
  void LoadStateDict(const NamedTensors& state);
  /// The checks of LoadStateDict alone: throws as it would, changes nothing.
  void CheckStateDict(const NamedTensors& state) const;

 private:
  /// `optimizer`: the optimizer behind `target`, claimed for this scheduler
  /// (null for a bare target).
  LrScheduler(LrTarget target, std::shared_ptr<Schedule> schedule, Optimizer* optimizer);

  LrTarget target_;
  std::shared_ptr<Schedule> schedule_;
  // Held while this scheduler drives an optimizer; the optimizer keeps a
  // weak reference, which expires with this scheduler.
  std::shared_ptr<const void> claim_;
  double base_lr_ = 0;
  int64_t t_ = 0;
};

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_LR_SCHEDULER_H_
