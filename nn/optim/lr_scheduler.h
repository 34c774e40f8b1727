#ifndef DDP_NN_OPTIM_LR_SCHEDULER_H_
#define DDP_NN_OPTIM_LR_SCHEDULER_H_

// Learning-rate schedules as closed forms of the step count, so a resumed
// run only needs the count, and schedules compose (warm-up, then cosine).
// Values follow PyTorch's StepLR, MultiStepLR, ExponentialLR, LambdaLR,
// CosineAnnealingLR, CosineAnnealingWarmRestarts, LinearLR, OneCycleLR and
// SequentialLR. ReduceLROnPlateau depends on a metric rather than the step
// count, so it is a class of its own (ReduceLrOnPlateau, below).

#include <cstdint>
#include <functional>
#include <initializer_list>
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
  /// Whether the schedule also drives the optimizer's momentum (SGD's
  /// momentum, Adam's beta1): OneCycleSchedule with cycle_momentum.
  virtual bool CyclesMomentum() const { return false; }
  /// The momentum for step t; called only when CyclesMomentum().
  virtual double Momentum(int64_t /*t*/) const { return 0; }
  /// The least and the greatest momentum the schedule sets (empty unless
  /// CyclesMomentum()): checked against the optimizer when a scheduler is made.
  virtual std::vector<double> MomentumBounds() const { return {}; }
  /// How many param groups the schedule has values of its own for
  /// (OneCycleSchedule given per-group lists), which a scheduler's
  /// optimizer must have; 0 (the default): any number, every group
  /// following the same schedule from its own base rate.
  virtual size_t GroupCount() const { return 0; }
  /// Group `group`'s rate and momentum at step t (the defaults: Lr and
  /// Momentum, the same for every group).
  virtual double GroupLr(size_t /*group*/, double base_lr, int64_t t) const { return Lr(base_lr, t); }
  virtual double GroupMomentum(size_t /*group*/, int64_t t) const { return Momentum(t); }
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
/// (LinearLR; a linear warm-up with end_factor 1). Throws
/// std::invalid_argument, naming the one value at fault, unless
/// start_factor is in (0, 1], end_factor in [0, 1] and total_iters >= 1.
std::shared_ptr<Schedule> LinearSchedule(double start_factor, double end_factor, int64_t total_iters);
/// schedules[k] from milestone k-1 on, counting its steps from there
/// (SequentialLR); milestones ascending, one fewer than schedules. Throws
/// std::invalid_argument for a schedule that cycles momentum (OneCycle
/// with cycle_momentum): the momentum of the other phases would be no
/// one's; pass cycle_momentum = false.
std::shared_ptr<Schedule> SequentialSchedule(std::vector<std::shared_ptr<Schedule>> schedules,
                                             std::vector<int64_t> milestones);
/// base_lr * gamma^(number of milestones <= t)  (MultiStepLR; a milestone
/// given twice multiplies by gamma twice, as PyTorch's does). Throws
/// std::invalid_argument unless the milestones are ascending (repeats
/// allowed) and >= 0, and gamma is finite and >= 0.
std::shared_ptr<Schedule> MultiStepSchedule(std::vector<int64_t> milestones, double gamma = 0.1);
/// base_lr * gamma^t  (ExponentialLR). Throws std::invalid_argument unless
/// gamma is finite and >= 0.
std::shared_ptr<Schedule> ExponentialSchedule(double gamma);
/// base_lr * factor(t)  (LambdaLR). `description` names the function for the
/// saved state ("LambdaLR(<description>)"), so that a state saved with
/// another function is refused; left empty, the schedule is unknown and
/// nothing is compared. A factor that gives a negative or non-finite rate is
/// refused by the optimizer when it comes. Throws std::invalid_argument when
/// `factor` is empty.
std::shared_ptr<Schedule> LambdaSchedule(std::function<double(int64_t)> factor, std::string description = "");
/// One factor per param group (LambdaLR given a list of functions): group
/// k's rate is base_lr(k) * factors[k](t). An LrScheduler refuses an
/// optimizer (or targets) with another number of groups than factors,
/// naming both; Lr() answers for group 0. `description` as above, naming
/// the functions. Throws std::invalid_argument when `factors` is empty or
/// one of them is (naming its index).
std::shared_ptr<Schedule> LambdaSchedule(std::vector<std::function<double(int64_t)>> factors,
                                         std::string description = "");
/// The same from a braced list, `LambdaSchedule({f}, "f")`: a list of one
/// function is a list (for one param group), as in PyTorch. Without this
/// overload a braced lambda converted as well to either form above and the
/// call did not compile.
std::shared_ptr<Schedule> LambdaSchedule(std::initializer_list<std::function<double(int64_t)>> factors,
                                         std::string description = "");
/// eta_min + (base_lr - eta_min) * (1 + cos(pi * t_cur / t_i)) / 2, where the
/// cycle restarts at base_lr after t_0 steps, each later cycle t_mult times
/// as long as the one before (CosineAnnealingWarmRestarts stepped without an
/// epoch argument). Throws std::invalid_argument unless t_0 >= 1, t_mult >= 1
/// and eta_min is finite and >= 0.
std::shared_ptr<Schedule> CosineWarmRestartsSchedule(int64_t t_0, int64_t t_mult = 1, double eta_min = 0.0);

/// How OneCycleSchedule moves between its phase ends. Values are stable.
enum class AnnealStrategy : int8_t { kCos = 0, kLinear = 1 };

/// OneCycleLR's parameters, with PyTorch's defaults.
struct OneCycleOptions {
  /// The peak rate, reached at step pct_start * total_steps - 1.
  double max_lr = 0;
  /// Steps of the whole cycle; the schedule is defined for t <= total_steps.
  int64_t total_steps = 0;
  /// Fraction of the steps spent rising to max_lr, in [0, 1].
  double pct_start = 0.3;
  AnnealStrategy anneal_strategy = AnnealStrategy::kCos;
  /// The rate at t = 0 is max_lr / div_factor.
  double div_factor = 25.0;
  /// The final rate is max_lr / div_factor / final_div_factor.
  double final_div_factor = 1e4;
  /// Three phases (up to max_lr, back down to the initial rate, then down to
  /// the final one) instead of two (up, then down to the final rate). The
  /// second phase ends at step 2 * pct_start * total_steps - 2, so with
  /// pct_start > 0.5 it outlasts the cycle: the rate is still falling toward
  /// the initial one at total_steps, and the third phase (and the final
  /// rate) is never reached. PyTorch's OneCycleLR does the same; kept so.
  bool three_phase = false;
  /// Cycle the optimizer's momentum (SGD's momentum, Adam's and AdamW's
  /// beta1) inversely to the rate: max_momentum at t = 0, base_momentum at
  /// the peak rate, back to max_momentum at the end of the cycle (three
  /// phases: at the end of the second phase, then held). PyTorch's default,
  /// true. The optimizer must have such a momentum (not Adadelta, nor an SGD
  /// made with momentum 0): LrScheduler refuses it otherwise. Set false for
  /// the rate alone (OneCycleLR's cycle_momentum=False), as this schedule
  /// was before this option existed.
  bool cycle_momentum = true;
  /// The momentum at the peak rate.
  double base_momentum = 0.85;
  /// The momentum at t = 0 and at the end of the cycle.
  double max_momentum = 0.95;
  /// Per param group, as PyTorch's list forms of max_lr, base_momentum and
  /// max_momentum: a list given (not empty) holds one value per group of
  /// the optimizer, group k taking element k, and replaces the scalar
  /// (max_lr is then left 0). Lists given must be of one length, and an
  /// LrScheduler refuses an optimizer with another number of groups. Lr()
  /// and Momentum() answer for group 0.
  std::vector<double> group_max_lr;
  std::vector<double> group_base_momentum;
  std::vector<double> group_max_momentum;
};

/// PyTorch 1.13's OneCycleLR. The optimizer's own lr (base_lr) is ignored:
/// the rate starts at max_lr / div_factor. With cycle_momentum (the
/// default, as PyTorch's), the scheduler also sets the momentum of every
/// param group (SGD's momentum, Adam's beta1) by the same phases and
/// annealing, from max_momentum to base_momentum and back, overwriting the
/// optimizer's own; with cycle_momentum false the optimizer keeps its
/// momentum throughout. Lr and Momentum throw std::out_of_range for t >
/// total_steps, as PyTorch's step raises past the end (so
/// LrScheduler::Step throws there, changing nothing). Throws
/// std::invalid_argument unless max_lr > 0, total_steps >= 1, pct_start is
/// in [0, 1], div_factor and final_div_factor are > 0 (all finite), the
/// rising phase has steps to take (pct_start * total_steps != 1, where
/// PyTorch divides by zero), and, with cycle_momentum, base_momentum and
/// max_momentum are finite and >= 0; with per-group lists, unless the lists
/// given have one length, max_lr is 0 beside group_max_lr, and each value
/// passes its scalar's check (the error names the list and index).
/// Describe() names the momentum
/// parameters only with cycle_momentum, so a rate-only schedule describes
/// itself as it did before the option existed (its saved states still
/// load), and a state saved with the other setting is refused.
std::shared_ptr<Schedule> OneCycleSchedule(const OneCycleOptions& options);

/// Linear warm-up from start_factor * base_lr over warmup_steps, then cosine
/// annealing to eta_min at total_steps. Past total_steps the default
/// (kPeriodic) follows PyTorch's SequentialLR(LinearLR, CosineAnnealingLR)
/// and climbs back up; pass CosineTail::kHold to stay at eta_min. Throws
/// std::invalid_argument naming WarmupCosineSchedule unless
/// 1 <= warmup_steps < total_steps, start_factor is in (0, 1] and eta_min
/// is finite and >= 0.
std::shared_ptr<Schedule> WarmupCosineSchedule(int64_t warmup_steps, int64_t total_steps,
                                               double start_factor = 0.01, double eta_min = 0.0,
                                               CosineTail tail = CosineTail::kPeriodic);

/// A learning rate a scheduler drives: an Optimizer's, or one shared by
/// several (the slices of a sharded optimizer).
struct LrTarget {
  std::function<double()> get;
  std::function<void(double)> set;
};

namespace internal {
/// The rates a scheduler drives: one per param group of an Optimizer, or
/// an LrTarget's one. `set` takes one rate per group and, when it throws,
/// leaves every rate as it was.
struct GroupRates {
  size_t count = 1;
  /// The number of rates now, where it may grow after the scheduler was
  /// made (an Optimizer's param groups, with AddParamGroup); null: `count`.
  std::function<size_t()> current_count;
  std::function<double(size_t)> get;
  std::function<void(const std::vector<double>&)> set;
};
}  // namespace internal

/// Drives an optimizer's learning rate along a schedule. Construction sets
/// lr to Lr(base_lr, 0) where base_lr is the optimizer's lr at that time.
/// The optimizer (or the target's owner) must outlive the scheduler.
///
/// Momentum: a schedule that CyclesMomentum() also sets every group's
/// momentum (Optimizer::set_momentum) to GroupMomentum(k, t), at
/// construction, at each Step and at LoadStateDict (the same value for every
/// group unless the schedule has per-group values).
///
/// Param groups: each group of an Optimizer follows the schedule from its
/// own base rate (PyTorch's base_lrs), lr(k) = GroupLr(k, base_lr(k), t),
/// so their ratios stay as they were (OneCycleSchedule, which ignores
/// base_lr, gives every group the same rate, as PyTorch's OneCycleLR with
/// one max_lr, or each group its own with group_max_lr).
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
  /// With a schedule that cycles momentum, also throws std::invalid_argument,
  /// changing nothing, naming the optimizer when it has no momentum to drive
  /// (Adadelta, SGD made with momentum 0) or refuses the schedule's least or
  /// greatest momentum (Adam's beta1 must stay below 1).
  ///
  /// Throws std::invalid_argument when `target` lacks get or set, or when
  /// the schedule cycles momentum (a target has none). Nothing tracks what a
  /// target drives: the caller keeps to one scheduler per rate.
  LrScheduler(LrTarget target, std::shared_ptr<Schedule> schedule);
  /// Several rates as the param groups of one optimizer (the groups of
  /// ddp's OverlappedZeroOptimizer, OverlappedZeroOptimizer::LrTargets()):
  /// each follows the schedule from its own base rate, and when one target
  /// refuses its rate the ones already set are put back, so that nothing
  /// changed. Throws std::invalid_argument when `targets` is empty, when
  /// one lacks get or set (naming its index), or when the schedule cycles
  /// momentum.
  LrScheduler(std::vector<LrTarget> targets, std::shared_ptr<Schedule> schedule);
  /// Not copyable: a copy would be a second scheduler of the same rate.
  LrScheduler(const LrScheduler&) = delete;
  LrScheduler& operator=(const LrScheduler&) = delete;
  LrScheduler(LrScheduler&&) = default;
  LrScheduler& operator=(LrScheduler&&) = default;

  /// Advances one step (after optimizer.Step(), as in PyTorch) and sets the
  /// lr (and a cycled momentum) of every group. When the target refuses a
  /// rate, throws and changes nothing.
  void Step();
  /// Steps taken.
  int64_t step_count() const { return t_; }
  /// The current learning rate (group 0's with several groups).
  double lr() const { return rates_.get(0); }
  /// The rate schedules start from (group 0's with several groups).
  double base_lr() const { return base_lrs_.front(); }
  /// Per param group, the rate its schedule starts from (one for a target).
  const std::vector<double>& base_lrs() const { return base_lrs_; }

  /// "scheduler.step" (i64) and "scheduler.base_lr" (f64) scalars, and
  /// "scheduler.schedule" (u8 text, the schedule's Describe()) unless the
  /// schedule does not describe itself. With several param groups,
  /// "scheduler.base_lr" is a 1-D f64 tensor of one rate per group. A cycled
  /// momentum is a closed form of the step, so nothing more is saved; the
  /// description names cycle_momentum and the momenta.
  NamedTensors StateDict() const;
  /// Restores from a list that may hold other components' keys; sets the lr
  /// for the restored step. Throws std::invalid_argument naming a missing
  /// or malformed key (base rates of another number of param groups, naming
  /// both counts; a negative or non-finite base_lr too, or a step and
  /// base_lr for which the schedule gives such a rate), or a saved schedule
  /// description that differs from this schedule's (naming both); changes
  /// nothing then, nor when the target refuses the restored rate. A state
  /// without "scheduler.schedule" (saved before it existed, or from a
  /// schedule that does not describe itself) is taken as from an unknown
  /// schedule and not compared. Each group's rate (and cycled momentum) at
  /// the restored step is asked of the schedule once, and the value
  /// checked is the value set.
  void LoadStateDict(const NamedTensors& state);

  /// A state that CheckStateDict found loadable, with the rates (and
  /// cycled momenta) the schedule gives for its step; only CheckStateDict
  /// makes one.
  class CheckedState {
   private:
    friend class LrScheduler;
    CheckedState() = default;
    // The serial number of the scheduler that computed the values. Not its
    // schedule's address: a schedule destroyed with its scheduler may have
    // its memory reused by another scheduler's schedule, which would then
    // take values it did not compute.
    uint64_t scheduler_ = 0;
    int64_t step_ = 0;
    std::vector<double> base_lrs_;
    // Per param group, at step_.
    std::vector<double> lrs_;
    // Per param group of the optimizer whose momentum the schedule
    // cycles, at step_; empty when it cycles none.
    std::vector<double> momenta_;
  };
  /// The checks of LoadStateDict alone: throws as it would (a rate or a
  /// cycled momentum the optimizer would refuse included), changes
  /// nothing. Returns what it checked, for LoadChecked.
  CheckedState CheckStateDict(const NamedTensors& state) const;
  /// Loads a state this scheduler's CheckStateDict returned: sets the
  /// rates and momenta the check computed, without asking the schedule
  /// again (a restore that checks every component before loading any asks
  /// a LambdaSchedule's functions once per group). Throws
  /// std::invalid_argument, changing nothing, when `checked` came from
  /// another scheduler (even one since destroyed), and as
  /// LoadStateDict(state) does when the target refuses a rate.
  void LoadChecked(const CheckedState& checked);

  /// The scheduler as it is now, for RestoreSnapshot: its step and base
  /// rates, the rate of each group it drives (read from the optimizer or
  /// targets, which may differ from the schedule's after a set_lr) and
  /// the momenta it cycles. A few numbers per param group.
  class Snapshot {
   private:
    friend class LrScheduler;
    Snapshot() = default;
    uint64_t scheduler_ = 0;  // the serial number of the scheduler taken
    int64_t step_ = 0;
    std::vector<double> base_lrs_;
    std::vector<double> lrs_;
    std::vector<double> momenta_;
  };
  Snapshot TakeSnapshot() const;
  /// Puts back what TakeSnapshot took from this scheduler, without asking
  /// the schedule (to undo a load that another part of a restore made
  /// fail). Throws std::invalid_argument, changing nothing, for another
  /// scheduler's snapshot, and as Step does when the target refuses a rate
  /// (or the optimizer has gained a param group since).
  void RestoreSnapshot(const Snapshot& snapshot);

 private:
  /// `optimizer`: the optimizer behind `rates`, claimed for this scheduler
  /// (null for a bare target).
  LrScheduler(internal::GroupRates rates, std::shared_ptr<Schedule> schedule, Optimizer* optimizer);
  /// The schedule's rate for every group at step t.
  std::vector<double> RatesAt(const std::vector<double>& base_lrs, int64_t t) const;
  /// The schedule's momentum for every group of momentum_of_ at step t
  /// (empty without one).
  std::vector<double> MomentaAt(int64_t t) const;
  /// Sets the rates (and a cycled momentum) for step t; throws, changing
  /// nothing, when the optimizer refuses one.
  void SetAt(const std::vector<double>& base_lrs, int64_t t);
  /// The same with the values given (the schedule's for one step: a rate
  /// per group, a momentum per group of momentum_of_).
  void SetRates(const std::vector<double>& lrs, const std::vector<double>& momenta);

  internal::GroupRates rates_;
  std::shared_ptr<Schedule> schedule_;
  // Held while this scheduler drives an optimizer; the optimizer keeps a
  // weak reference, which expires with this scheduler.
  std::shared_ptr<const void> claim_;
  // The optimizer whose momentum the schedule cycles (null: none).
  Optimizer* momentum_of_ = nullptr;
  std::vector<double> base_lrs_;
  int64_t t_ = 0;
  // Unique among the schedulers of this process (a moved-to scheduler
  // takes its source's): what CheckedState and Snapshot are matched by.
  uint64_t serial_ = 0;
};

/// ReduceLROnPlateau's parameters, with PyTorch's defaults.
struct PlateauOptions {
  enum class Mode : int8_t { kMin = 0, kMax = 1 };
  enum class ThresholdMode : int8_t { kRel = 0, kAbs = 1 };
  /// kMin: a lower metric is better (a loss); kMax: a higher one (accuracy).
  Mode mode = Mode::kMin;
  /// The rate is multiplied by factor on a plateau; in [0, 1).
  double factor = 0.1;
  /// Steps without improvement tolerated; the rate drops at the next one.
  int64_t patience = 10;
  /// How much better than the best a metric must be to count: relative
  /// (best * (1 -/+ threshold)) or absolute (best -/+ threshold). Must be
  /// < 1 for kMin with kRel (else no metric could ever count as better).
  double threshold = 1e-4;
  ThresholdMode threshold_mode = ThresholdMode::kRel;
  /// Steps after a reduction during which bad steps are not counted.
  int64_t cooldown = 0;
  /// The rate is never reduced below min_lr.
  double min_lr = 0;
  /// A reduction smaller than eps is not made.
  double eps = 1e-8;
  /// Per param group, as PyTorch's list form of min_lr: given (not empty),
  /// one floor per group of the optimizer (or per target), group k's rate
  /// never reduced below element k; it replaces min_lr (left 0). A list of
  /// another length than the number of groups is refused at construction,
  /// naming both; a group added to the optimizer afterwards has no floor,
  /// and Step refuses it (see ReduceLrOnPlateau::Step).
  std::vector<double> group_min_lr;
};

/// PyTorch's ReduceLROnPlateau: Step(metric) multiplies the optimizer's
/// current rate by `factor` when the metric has not improved for more than
/// `patience` steps. With param groups, each group's rate is reduced so
/// (floored at min_lr, or at its own group_min_lr, and left as it is where
/// the reduction would be eps or less, group by group, as PyTorch's); a
/// group added to the optimizer (AddParamGroup) after this was made is
/// reduced too (floored at min_lr), as PyTorch's reads param_groups at each
/// reduction. It reads the rate from the optimizer at each reduction, so a
/// rate set with set_lr in between (or one restored with the optimizer's
/// state) is the one reduced. It does not drive the rate along
/// a schedule: pairing it with an LrScheduler on the same optimizer would
/// have the scheduler overwrite every reduction at its next step.
class ReduceLrOnPlateau {
 public:
  /// Throws std::invalid_argument naming the option unless factor is in
  /// [0, 1), patience and cooldown >= 0, threshold, min_lr and eps finite
  /// and >= 0 (threshold < 1 in kMin with kRel), and the modes known; with group_min_lr, unless it has one
  /// value per param group (naming both counts), each finite and >= 0
  /// (naming the index), and min_lr is 0. The optimizer must outlive this.
  ReduceLrOnPlateau(Optimizer& optimizer, PlateauOptions options = {});
  /// Throws std::invalid_argument when `target` lacks get or set.
  ReduceLrOnPlateau(LrTarget target, PlateauOptions options = {});
  /// Several rates reduced as param groups (LrScheduler's constructor over
  /// targets says what is refused).
  ReduceLrOnPlateau(std::vector<LrTarget> targets, PlateauOptions options = {});

  /// Takes one metric (after the epoch's validation, say) and reduces the
  /// rate on a plateau. A NaN metric counts as no improvement, as in
  /// PyTorch. When the target refuses the rate, throws and changes nothing.
  /// With group_min_lr, throws std::logic_error, changing nothing, naming
  /// the optimizer and the group when it has more param groups than the list
  /// (one added with AddParamGroup since), whose floor would be unknown.
  void Step(double metric);
  /// The current learning rate (group 0's with several groups).
  double lr() const { return rates_.get(0); }
  /// The best metric seen (+inf in kMin mode, -inf in kMax, before any).
  double best() const { return best_; }
  int64_t num_bad_steps() const { return num_bad_; }
  int64_t cooldown_counter() const { return cooldown_counter_; }
  /// Steps taken.
  int64_t step_count() const { return steps_; }

  /// "plateau.best" (f64), "plateau.num_bad_steps", "plateau.cooldown_counter",
  /// "plateau.step" (i64) scalars and "plateau.options" (u8 text, the options
  /// as text). The rate itself is the optimizer's, saved in its state.
  NamedTensors StateDict() const;
  /// Restores from a list that may hold other components' keys; the rate is
  /// left as it is (the optimizer's LoadStateDict restores it). Throws
  /// std::invalid_argument, changing nothing, naming a missing or malformed
  /// key, a negative count, or options that differ from this one's (naming
  /// both).
  void LoadStateDict(const NamedTensors& state);
  /// The checks of LoadStateDict alone: throws as it would, changes nothing.
  void CheckStateDict(const NamedTensors& state) const;

 private:
  bool IsBetter(double metric) const;
  std::string Describe() const;

  /// `groups` names what the rates are, for errors ("param groups of the
  /// SGD optimizer", "targets").
  ReduceLrOnPlateau(internal::GroupRates rates, PlateauOptions options, const std::string& groups);
  /// Group k's floor.
  double MinLr(size_t group) const;

  internal::GroupRates rates_;
  PlateauOptions options_;
  /// The driven optimizer's Name(), for Step's refusals; empty over targets
  /// (whose number cannot change).
  std::string optimizer_name_;
  double best_ = 0;
  int64_t num_bad_ = 0;
  int64_t cooldown_counter_ = 0;
  int64_t steps_ = 0;
};

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_LR_SCHEDULER_H_
