#ifndef DDP_NN_OPTIM_OPTIMIZER_H_
#define DDP_NN_OPTIM_OPTIMIZER_H_

// Optimizers update parameters in place from their .grad, one fused loop
// per parameter (each element is read and written once per step), with
// PyTorch's update rules and defaults.
//
// Mixed precision: for f16 and bf16 parameters the optimizer keeps an f32
// master copy (saved with its state), updates it in f32 and rounds it into
// the parameter; small updates then accumulate instead of vanishing in a
// 16-bit rounding. PyTorch's AMP gets the same effect by keeping the
// parameters themselves in f32. f32 and f64 parameters are updated in their
// own precision. A parameter whose dtype changes between steps (Module::To)
// keeps its state, converted: the slots take the new compute dtype, a
// parameter that is no longer 16-bit drops its master and is updated
// itself, and one that became 16-bit gets a master copied from it.
// Writes to a 16-bit parameter made outside the optimizer (a loaded state
// dict, a CopyFrom, parameter averaging) are taken into the master at the
// next step: an element whose master no longer rounds to the parameter's
// value takes that value, the others keep their extra precision. Without
// that, the master would write its old values back over them.
//
// Devices: all parameters of one optimizer live on one device. On a CUDA
// device (or any non-CPU device) the state and master copies live there
// too, and each parameter is updated by one fused device kernel registered
// by the backend (device_kernels.h; nn::cuda::Init() registers CUDA's),
// queued on the current stream with no host synchronization.

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nn/tensor/tensor.h"

namespace ddp::nn::optim {

class LrScheduler;

/// Parameters with the names their state is saved under (Module's
/// NamedParameters order).
using NamedParameters = std::vector<std::pair<std::string, Tensor>>;
/// Named state tensors, as a checkpoint holds them.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

/// Gives unnamed parameters the names "0", "1", ...
NamedParameters NameByPosition(const std::vector<Tensor>& params);

/// The parameter a "state.<name>.<slot>" key of StateDict belongs to: the
/// index of the longest name in `params` that prefixes it (names may hold
/// dots), or -1; with `slot`, also the part after that name.
int ParameterOfStateKey(const std::string& key, const NamedParameters& params,
                        std::string* slot = nullptr);

/// A parameter group (PyTorch's param_groups entry): parameters that share
/// options. `options` overrides the optimizer's defaults for this group,
/// keyed by the names StateDict saves them under: "lr" and each option of
/// the optimizer ("weight_decay", "momentum", "dampening", "beta1", "beta2",
/// "eps", "rho", "alpha", "lr_decay", ...; flags such as "nesterov",
/// "centered" or "maximize" as 0 or 1).
/// Options that decide which state is kept (SGD's nesterov and momentum zero
/// or not, Adam's amsgrad, RMSprop's centered and momentum zero or not) must
/// equal the defaults': per-group slot layouts
/// are not supported. A group may be empty.
struct ParamGroup {
  NamedParameters params;
  std::map<std::string, double> options;
};

/// Checks a list of parameters as one optimizer needs them.
/// Throws std::invalid_argument, its message starting with `who`, for an
/// empty or repeated name, an undefined, non-floating or non-contiguous
/// parameter, or two parameters that share memory (the same tensor under two
/// names, or overlapping views; disjoint views of one buffer are allowed). Every optimizer checks its list so; wrappers that split a
/// list among optimizers check the whole list.
void CheckParameters(const NamedParameters& params, const std::string& who);

/// Clears the gradients of `params`: undefined (set_to_none) or zeros. Zeroed
/// gradients are taken out of autograd first, as PyTorch's zero_grad: they
/// end with no grad_fn and requires_grad false.
/// Optimizer::ZeroGrad on its list; wrappers use it on theirs. The default,
/// set_to_none, is PyTorch 2.x's; PyTorch 1.13 zeroes by default.
void ZeroGrad(const NamedParameters& params, bool set_to_none = true);

/// Base of SGD, Adam, AdamW, Adadelta, RMSprop and Adagrad. The parameters come in one or
/// more groups (ParamGroup), each with its own learning rate and options;
/// the optimizer holds them flattened in group order.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// Updates every parameter that has a gradient; parameters whose .grad is
  /// undefined are skipped and their state is left as it is (as PyTorch).
  /// A gradient of the wrong shape or device, or of a non-floating dtype,
  /// throws std::invalid_argument naming its parameter, before any
  /// parameter is updated.
  void Step();
  /// Clears gradients: undefined (set_to_none, the default as in PyTorch 2.x;
  /// PyTorch 1.13's zero_grad() zeroes them instead) or zeros.
  void ZeroGrad(bool set_to_none = true);

  /// Number of parameter groups (1 for an optimizer made from a plain list).
  size_t num_groups() const { return lrs_.size(); }
  /// The group of parameter i (an index into params()); throws as
  /// step_count for an i past params().
  size_t group_of(size_t param) const;
  /// The parameters of one group (a slice of params(), in its order).
  NamedParameters group_params(size_t group) const;
  /// Appends `group` as the last param group (PyTorch's add_param_group):
  /// options it lacks take the optimizer's defaults (those it was made
  /// with, "lr" included), and its parameters start with empty state and
  /// step 0, as fresh ones. Its parameters and options are checked as the
  /// group constructor checks them (std::invalid_argument naming the
  /// parameter or option, changing nothing): a parameter already in the
  /// optimizer (by name or tensor), an empty name, an undefined tensor, an
  /// unknown option, a value the constructor refuses, and a structural
  /// option unlike the defaults'. Throws std::logic_error while an
  /// LrScheduler drives the optimizer: it holds one base rate per group, so
  /// add groups before making it. A one-group optimizer saves the
  /// several-group StateDict layout afterwards.
  void AddParamGroup(ParamGroup group);

  /// Learning rate of the next Step (schedulers set it); group 0's with
  /// several groups.
  double lr() const { return lrs_.front(); }
  /// Learning rate of the next Step for the parameters of `group`. Throws
  /// std::out_of_range for a group the optimizer lacks.
  double lr(size_t group) const;
  /// Sets the rate of the only group. Throws std::invalid_argument, changing
  /// nothing, unless `lr` is finite and >= 0 (naming the optimizer, and the
  /// group when there are several), and std::logic_error with
  /// several groups: one rate for all would lose their ratios; set each
  /// with set_lr(group, lr) (LrScheduler does).
  void set_lr(double lr);
  /// Sets the rate of one group; throws as set_lr(lr) for a bad rate, and
  /// std::out_of_range for a group the optimizer lacks.
  void set_lr(size_t group, double lr);
  /// The momentum of `group` that a momentum schedule (OneCycleLR's
  /// cycle_momentum) drives: SGD's and RMSprop's "momentum", Adam's and
  /// AdamW's "beta1". Throws std::invalid_argument naming the optimizer when
  /// it has none (Adadelta, Adagrad), std::out_of_range for a group the
  /// optimizer lacks.
  double momentum(size_t group) const;
  /// Sets that momentum for the next Step of `group`. Throws, changing
  /// nothing, as momentum(group) does, and std::invalid_argument (naming
  /// the optimizer, the group and the value) for a value the optimizer's
  /// constructor would refuse (beta1 outside [0, 1), a negative momentum),
  /// and for SGD and RMSprop when the group's momentum or the new one is 0:
  /// whether a momentum buffer is kept depends on momentum being zero, so
  /// one made with momentum 0 cannot have its momentum driven (PyTorch's SGD starts
  /// a buffer on the first step with momentum; give it momentum > 0).
  void set_momentum(size_t group, double momentum);
  /// The checks of set_momentum alone: throws as it would, changes nothing.
  void CheckMomentum(size_t group, double momentum) const;
  /// Factor every gradient is multiplied by as Step reads it (GradScaler
  /// sets 1/scale for one step, so unscaling costs no extra pass). 1 by default.
  /// Throws std::invalid_argument naming the optimizer and the value,
  /// changing nothing, for a NaN or negative factor (every parameter updated
  /// would become NaN, or step against its gradient; `maximize` is the
  /// option for ascent). +inf is taken: it is 1/scale once GradScaler's
  /// scale has underflowed to 0, as PyTorch's inv_scale.
  void set_grad_scale(double scale);
  /// Whether Step ascends the gradient (the options' `maximize`); group 0's
  /// with several groups.
  bool maximize() const { return maximize_.front(); }
  /// Whether Step ascends the gradient of `group`'s parameters.
  bool maximize(size_t group) const { return maximize_.at(group); }
  /// Every parameter, the groups' lists one after another.
  const NamedParameters& params() const { return params_; }
  /// Steps taken by parameter i (0 before its first update). Throws
  /// std::out_of_range, naming i and the parameter count, for an i past
  /// params().
  int64_t step_count(size_t i) const;
  /// Unique among the optimizers of this process, never reused (an address
  /// is, once an optimizer is destroyed): what per-optimizer state held
  /// elsewhere (GradScaler's) is keyed by.
  uint64_t instance_id() const { return instance_id_; }
  /// The device the parameters live on (the first parameter's; the CPU for
  /// an empty list). Step checks that every parameter is still there.
  Device device() const { return params_.empty() ? kCPU : params_.front().second.device(); }

  /// The state: "lr" (f64 scalar); the options PyTorch keeps in its
  /// param_groups as "group.<option>" ("group.momentum", "group.beta1", ...:
  /// f64 scalars, i64 0 or 1 for flags such as "group.nesterov") and the
  /// optimizer's Name() as "group.optimizer" (u8 text); "group.params_listed"
  /// (i64 1: every parameter has a step entry); per parameter
  /// "state.<name>.step" (i64 scalar, 0 before its first update), and per
  /// updated parameter "state.<name>.<slot>" (the
  /// parameter's shape, f32 or f64; "master" for 16-bit parameters). Slots
  /// a loaded state did not have are not saved until the next step makes them.
  /// Slots held from the start (StartSlotValues: Adagrad's "sum") are saved
  /// for every parameter, step 0 included, as PyTorch's state holds them.
  /// Tensors are copies, on the parameters' device ("lr", "group." keys and
  /// steps on the CPU).
  ///
  /// With several groups, "lr" and "group.<option>" give way to
  /// "param_groups.count" (i64 scalar, the number of groups) and per group
  /// k "param_groups.<k>.lr", "param_groups.<k>.<option>" (as above),
  /// "param_groups.<k>.size" (i64, its number of parameters) and
  /// "param_groups.<k>.params" (u8 text, their names one per line);
  /// "group.optimizer", "group.params_listed" and the "state." keys stay as
  /// they are. A one-group state has the layout above, unchanged.
  NamedTensors StateDict() const;
  /// Restores StateDict's output. Looks only at "lr", "group.",
  /// "param_groups." and "state." keys, so other components' state may share
  /// the list.
  ///
  /// Groups: a state with another number of groups than this optimizer (one
  /// without "param_groups.count" has one) is refused naming both counts,
  /// a group with another number of parameters naming the group and both
  /// sizes, and one holding other parameters (the groups built in another
  /// order, a parameter moved between them) naming the group and the first
  /// parameter that differs: its options would go to the wrong parameters. Each group's options are checked and taken as described
  /// below for the one group, against that group's options.
  ///
  /// The options, as PyTorch's load_state_dict restores param_groups: the
  /// saved lr and plain values (weight decay, dampening, betas, eps, rho,
  /// maximize, and momentum's value) replace this optimizer's, checked as
  /// its constructor checks them. Options that decide which state is kept
  /// must match, or the load is refused naming the option and both values:
  /// the optimizer kind, momentum zero or not (SGD's buffer), nesterov and
  /// amsgrad. A state without "group." keys (saved before they existed)
  /// keeps this optimizer's options and takes only "lr". Callers that want
  /// another rate than the saved one call set_lr after loading (the example
  /// trainer instead refuses a resume with another --lr before loading).
  ///
  /// The parameters: a state with "group.params_listed" must have a step
  /// entry for every parameter of this optimizer that has elements and is
  /// not frozen (requires_grad off and no gradient: an optimizer of the
  /// trained parameters alone holds none of it), or the load is refused
  /// naming the missing parameter (as PyTorch refuses param
  /// groups of another size): otherwise one the saving optimizer did not
  /// hold would silently restart. A step entry of a parameter this
  /// optimizer does not hold is refused naming it. A state without the flag
  /// (saved before it existed, or with it removed on purpose, to add
  /// parameters that start afresh) loads every parameter it has no entries
  /// for as never updated. Step 0 loads as never updated (with its slots,
  /// all or none, where they are held from the start).
  ///
  /// Everything is checked
  /// before anything changes; one error lists every missing, unexpected or
  /// mismatched key, and an "lr" that is negative or not finite. State
  /// tensors may come from any device: they are copied to the parameters'
  /// device. Slots of any floating dtype are converted to
  /// the parameter's compute dtype (a state saved before Module::To changed
  /// the parameter's dtype loads after it, as PyTorch casts its state); a
  /// "master" is optional: a 16-bit parameter without one gets one from its
  /// values at the next step, and one saved for a parameter that is now f32
  /// or f64 is dropped. Optimizers whose slots may be absent (SGD's momentum
  /// buffer) take a state without them, and one with slots their options do
  /// not keep (see SlotRules).
  void LoadStateDict(const NamedTensors& state);
  /// The checks of LoadStateDict alone: throws its std::invalid_argument
  /// for a state it would refuse, and changes nothing (to check every part
  /// of a checkpoint before loading any).
  void CheckStateDict(const NamedTensors& state) const;

 protected:
  /// What LoadStateDict accepts beyond the slots an optimizer keeps.
  struct SlotRules {
    /// A stepped parameter's state may lack every slot (PyTorch's SGD keeps
    /// its momentum buffer as None until momentum uses it): the slots are
    /// made at the parameter's next update, which gets `fresh` set.
    bool may_be_absent = false;
    /// Slots that other options of the same optimizer keep (SGD's momentum
    /// buffer at momentum 0, which earlier versions saved as zeros): checked
    /// as slots, then dropped.
    std::vector<std::string> dropped;
  };

  /// Throws std::invalid_argument for what CheckParameters refuses (over
  /// all groups' parameters together: a parameter in two groups is
  /// refused naming both), parameters on two devices (naming one of each),
  /// no group at all, or a bad `lr` (the default) or group "lr" (naming
  /// the group). Every message starts with `who`, the subclass's Name(),
  /// which a base constructor cannot call. The groups' other options are
  /// the subclass's to check (GroupOptionValues).
  Optimizer(const char* who, std::vector<ParamGroup> groups, double lr, std::vector<std::string> slot_names,
            SlotRules rules);
  Optimizer(const char* who, std::vector<ParamGroup> groups, double lr, std::vector<std::string> slot_names);
  /// The values the slots of a parameter of `group` start from, one per
  /// slot in slot_names order, for an optimizer whose PyTorch counterpart
  /// makes its state when it is built (Adagrad's "sum"); empty (the
  /// default) for one that makes zero slots at a parameter's first update
  /// (`fresh`). With values, a parameter holds its slots from the start, as
  /// PyTorch's: a state saved before its first step holds them (with step
  /// 0; StateDict makes them from these values) and loads them back, and
  /// its first update finds them (not `fresh`). Their memory is taken at
  /// that first update or load, not when the optimizer is built, so that
  /// building one allocates nothing on the device.
  virtual std::vector<double> StartSlotValues(size_t group) const {
    (void)group;
    return {};
  }

  /// `maximize` (PyTorch's option) of one group: the gradient is negated as
  /// Step reads it, before weight decay is added, as PyTorch negates it.
  void set_maximize(size_t group, bool maximize) { maximize_.at(group) = maximize; }

  /// One fused update of n elements of a parameter of `group` (whose
  /// options and lr(group) apply). `p` is the parameter (or its master
  /// copy), `g` the gradient to be multiplied by `grad_scale`, `slots` the
  /// state in slot_names order; `step` counts this update (1 on the first).
  /// `fresh`: the slots were just made, zero: on the first update, and on
  /// the first after LoadStateDict gave the parameter none (SlotRules).
  virtual void Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step,
                      bool fresh, float grad_scale) = 0;
  virtual void Update(size_t group, double* p, const double* g, double* const* slots, int64_t n, int64_t step,
                      bool fresh, double grad_scale) = 0;

  /// The device path's update of one parameter of `group`: `p` is the parameter (or its
  /// f32 master copy), `g` its contiguous gradient in p's dtype (to be
  /// multiplied by grad_scale), `slots` the state in slot_names order on p's
  /// device; `step` and `fresh` as for Update. Must queue work without
  /// waiting for the device.
  virtual void DeviceUpdate(size_t group, const Tensor& p, const Tensor& g, const std::vector<Tensor>& slots,
                            int64_t step, bool fresh, double grad_scale) = 0;

  /// One parameter's device update: DeviceUpdate's arguments.
  struct DeviceUpdateItem {
    Tensor p;
    Tensor g;
    std::vector<Tensor> slots;
    int64_t step = 0;
    bool fresh = false;
    size_t group = 0;
    /// The gradient's factor: the grad scale, negated under the group's
    /// maximize (groups may differ in it).
    double grad_scale = 1.0;
  };
  /// The device path's updates of one Step, in parameter order (parameters
  /// with a gradient only; all on one device; a group's items next to each
  /// other); called once per Step. By default DeviceUpdate for each; an
  /// optimizer with a multi-tensor kernel overrides it to update many
  /// parameters per launch, each launch with one group's options.
  virtual void DeviceUpdateAll(const std::vector<DeviceUpdateItem>& items);

  /// Throws naming the device when the device path has no kernel for it
  /// (called once per Step, before anything is allocated or changed).
  virtual void CheckDeviceKernels(Device device) const = 0;

  /// Name of the optimizer for messages ("SGD"); saved as "group.optimizer".
  virtual const char* Name() const = 0;
  /// The Hyperparameters() name set_momentum drives ("momentum", "beta1"),
  /// or null (the default) for an optimizer without momentum.
  virtual const char* MomentumOption() const { return nullptr; }

  /// An option saved under "group.<name>" (see StateDict), and a
  /// ParamGroup's options key.
  struct Hyperparameter {
    std::string name;
    double value = 0;
    /// Saved as i64 0 or 1 instead of f64.
    bool flag = false;
    /// Decides the state kept: a flag must match the saved one, a value
    /// must be zero or non-zero as the saved one is (and then takes it).
    bool structural = false;
  };
  /// The options of `group` to save, in a fixed order (lr is saved apart).
  virtual std::vector<Hyperparameter> Hyperparameters(size_t group) const = 0;
  /// Throws std::invalid_argument for saved values, one per
  /// Hyperparameters() name (flags 0 or 1), that the constructor would
  /// refuse for `group`.
  virtual void CheckHyperparameters(size_t group, const std::map<std::string, double>& values) const = 0;
  /// Takes saved values that CheckHyperparameters accepted for `group`.
  virtual void SetHyperparameters(size_t group, const std::map<std::string, double>& values) = 0;

  /// The options of each group: `defaults` (the optimizer's
  /// Hyperparameters() for its default options) with the group's own
  /// values in place, by name ("lr" excluded: the base takes it). Throws
  /// std::invalid_argument naming the group for an unknown name (listing
  /// the known ones), a flag other than 0 or 1, or a structural option that
  /// differs from the default (zero or not, for a value). Values the
  /// optimizer refuses are for its constructor to check.
  /// `first_group` is the index messages give groups[0].
  std::vector<std::map<std::string, double>> GroupOptionValues(const std::vector<ParamGroup>& groups,
                                                               const std::vector<Hyperparameter>& defaults,
                                                               size_t first_group = 0) const;
  /// The defaults' options, as Hyperparameters() lists them, for groups
  /// that AddParamGroup appends.
  virtual std::vector<Hyperparameter> DefaultHyperparameters() const = 0;
  /// Appends the options of a new last group, num_groups() (AddParamGroup,
  /// before the base counts the group): `values` as GroupOptionValues made
  /// them from DefaultHyperparameters(), `lr` its checked rate. Throws
  /// std::invalid_argument naming the group, changing nothing, for values
  /// the constructor would refuse.
  virtual void AppendGroupOptions(const std::map<std::string, double>& values, double lr) = 0;
  /// Rethrows a refusal of group `group`'s options naming the group (for
  /// subclass constructors: `check` builds and checks the group's options).
  template <typename F>
  auto ForGroup(size_t group, F&& check) const {
    try {
      return check();
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string(Name()) + ": param group " + std::to_string(group) +
                                  ": " + RefusalText(e));
    }
  }
  /// The message of a refusal by this optimizer's own checks, without the
  /// leading "<Name()>: ", for a message that already names the optimizer
  /// (which read "Adam: param group 1: Adam: betas ...").
  std::string RefusalText(const std::exception& e) const;

 private:
  struct State {
    // Empty until the first step, and after LoadStateDict gave none
    // (SlotRules::may_be_absent).
    std::vector<Tensor> slots;
    Tensor master;              // f32 copy of a 16-bit parameter
    // Where the master last agreed with the parameter: its memory and that
    // memory's version. A version bumped since means someone else wrote the
    // parameter (Module::LoadStateDict, a CopyFrom, an averaging), and the
    // next step merges that write into the master first. Empty after
    // LoadStateDict: the first step merges.
    std::weak_ptr<Storage> synced_storage;
    uint64_t synced_version = 0;
    // The parameter's dtype then: a merge into a master synced with the
    // same memory and dtype takes every element that differs from the
    // master's rounding (see MergeElements).
    DType synced_dtype = DType::kFloat32;
  };

  struct LoadPlan;
  /// LoadStateDict's checks; what it loads, or throws listing every problem.
  LoadPlan PlanLoad(const NamedTensors& state) const;

  DType ComputeDType(size_t i) const;
  /// Parameter i's slots from StartSlotValues (none when it gives none).
  std::vector<Tensor> StartSlots(size_t i) const;
  /// The state of parameter i as its current device and dtype need it (a
  /// copy only where something changed since the state was made).
  State CurrentState(size_t i) const;
  /// Brings parameter i's state up to date for a step; true when it made
  /// the slots (the update's `fresh`).
  bool InitState(size_t i);
  /// True when nothing but this optimizer wrote p since s's master last agreed with it.
  static bool MasterSynced(const State& s, const Tensor& p);
  static void MarkSynced(State& s, const Tensor& p);
  // Whether p may have been converted between 16-bit types since the master
  // last agreed with it (other memory, or another dtype).
  static bool MayHaveChangedType(const State& s, const Tensor& p);
  /// After this optimizer wrote parameter i (its memory's version went from
  /// `before` to now): every master that agreed with that memory at `before`
  /// still does, parameter i's and those of other views of the same memory.
  void NoteOwnWrite(size_t i, uint64_t before);
  void HostStep(size_t i, const Tensor& grad, std::vector<float>& scratch_f, std::vector<double>& scratch_d);
  /// Parameter i's device step, in two halves around DeviceUpdateAll: the
  /// update's arguments (state made or brought up to date, the step
  /// counted), then the master rounded into a 16-bit parameter and the
  /// version bookkeeping.
  DeviceUpdateItem PrepareDeviceStep(size_t i, const Tensor& grad);
  void FinishDeviceStep(size_t i);

  /// `who`: the optimizer's name (the constructor's `who`, then Name()).
  void CheckOneDevice(const char* who) const;

  // The LrScheduler that drives this optimizer's lr (expired: none); it
  // refuses a second one, which would fight the first over the rate.
  friend class LrScheduler;
  friend class ReduceLrOnPlateau;  // names the optimizer (Name()) in its messages
  std::weak_ptr<const void> scheduler_;

  static uint64_t NextInstanceId();
  const uint64_t instance_id_ = NextInstanceId();

  NamedParameters params_;
  // Per parameter, its group; per group, its first parameter (and the end).
  std::vector<size_t> group_of_;
  std::vector<size_t> group_begin_;
  // Per group.
  std::vector<double> lrs_;
  // The rate of groups made or added without their own "lr".
  double default_lr_ = 0;
  std::vector<bool> maximize_;
  double grad_scale_ = 1.0;
  // The factor Update multiplies each gradient of `group` by: the gradient
  // scale, negated under the group's maximize.
  double StepScale(size_t group) const { return maximize_[group] ? -grad_scale_ : grad_scale_; }
  std::vector<std::string> slot_names_;
  SlotRules slot_rules_;
  std::vector<int64_t> steps_;
  std::vector<State> state_;
};

/// An optimizer with an options struct `Options` (its `lr` and `maximize`
/// members read by the base): the per-group copies of it and the options
/// hooks of Optimizer, written once. A subclass lists its options
/// (HyperparametersOf), reads saved values into the struct (ReadValues),
/// checks a struct as its constructor does (CheckOptions), and calls
/// TakeGroupOptions in its constructor's body.
template <typename Options>
class OptimizerWithOptions : public Optimizer {
 public:
  /// The options of `group` (its lr the one it was made with; lr(group) is
  /// the current one). Throws std::out_of_range for a group it lacks.
  const Options& options(size_t group = 0) const { return options_.at(group); }

 protected:
  OptimizerWithOptions(const char* who, std::vector<ParamGroup> groups, const Options& defaults,
                       std::vector<std::string> slot_names, SlotRules rules = SlotRules())
      : Optimizer(who, std::move(groups), defaults.lr, std::move(slot_names), std::move(rules)),
        defaults_(defaults) {}

  /// Checks the defaults, then takes each group's options (the defaults
  /// with the group's own values in place), refusing them naming the
  /// group. For the subclass constructor's body: the hooks below are the
  /// subclass's only once its own construction has begun.
  void TakeGroupOptions(const std::vector<ParamGroup>& groups) {
    CheckOptions(defaults_);
    const std::vector<std::map<std::string, double>> values = GroupOptionValues(groups, HyperparametersOf(defaults_));
    for (size_t k = 0; k < values.size(); ++k) {
      options_.push_back(ForGroup(k, [&] { return WithSaved(defaults_, values[k]); }));
      options_.back().lr = lr(k);
      set_maximize(k, options_.back().maximize);
    }
  }

  /// The options of `o` to save, in a fixed order (lr is saved apart).
  virtual std::vector<Hyperparameter> HyperparametersOf(const Options& o) const = 0;
  /// Sets `o`'s members from `values`, one per HyperparametersOf name
  /// (flags as 0 or 1); CheckOptions checks the result.
  virtual void ReadValues(const std::map<std::string, double>& values, Options& o) const = 0;
  /// Throws std::invalid_argument, naming the optimizer and the one option
  /// at fault with its value, for options the constructor refuses (lr
  /// aside: the base checks it).
  virtual void CheckOptions(const Options& o) const = 0;

  std::vector<Hyperparameter> Hyperparameters(size_t group) const override {
    return HyperparametersOf(options_[group]);
  }
  std::vector<Hyperparameter> DefaultHyperparameters() const override { return HyperparametersOf(defaults_); }
  void AppendGroupOptions(const std::map<std::string, double>& values, double lr) override {
    Options o = ForGroup(num_groups(), [&] { return WithSaved(defaults_, values); });
    o.lr = lr;
    options_.push_back(o);
  }
  void CheckHyperparameters(size_t group, const std::map<std::string, double>& values) const override {
    WithSaved(options_[group], values);
  }
  void SetHyperparameters(size_t group, const std::map<std::string, double>& values) override {
    options_[group] = WithSaved(options_[group], values);
    set_maximize(group, options_[group].maximize);
  }

  std::vector<Options> options_;  // per group
  Options defaults_;              // for groups AddParamGroup appends

 private:
  /// `base` with `values` in place; throws as the constructor does.
  Options WithSaved(Options base, const std::map<std::string, double>& values) const {
    ReadValues(values, base);
    CheckOptions(base);
    return base;
  }
};

namespace internal {

/// Throws std::invalid_argument "<who>: <name> <value> must be finite and
/// >= 0" for the first option of `options` that is negative, NaN or
/// infinite (each makes an update inf or NaN, or stalls it).
void CheckFiniteNonNegative(const char* who, std::initializer_list<std::pair<const char*, double>> options);

/// A several-group state's "param_groups.<k>.params": the group's
/// parameter names, one per line, as u8 text (empty for an empty group).
Tensor GroupMembersTensor(const std::vector<std::string>& names);
/// The names GroupMembersTensor wrote, or false for a tensor that is not
/// u8 text (undefined, another dtype, not 1-D).
bool GroupMembersOf(const Tensor& t, std::vector<std::string>* names);

/// Throws std::invalid_argument unless `t` (null: the key is absent from
/// the state dict) is a 0-d tensor of `dtype` (a [1] is refused), naming `who` and `key` and
/// saying what was found instead. For the scaler's and schedulers' states.
void CheckStateScalar(const char* who, const std::string& key, const Tensor* t, DType dtype);

/// An option's value for an error message: the shortest text that reads
/// back as the same double ("-1e-07", "0.9", "inf", "nan"), where
/// std::to_string's six fixed decimals show -1e-7 as "-0.000000".
std::string OptionValueText(double value);

}  // namespace internal

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_OPTIMIZER_H_
