#include "nn/optim/optimizer.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <tuple>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "nn/optim/device_kernels.h"

namespace ddp::nn::optim {
namespace {

// A StateDict flag (i64 1): every parameter of the saving optimizer has a
// "state.<name>.step" entry, 0 when it was never updated.
const char* const kParamsListedKey = "group.params_listed";
// With several groups: their number (i64), and each group's entries under
// "param_groups.<k>." (see StateDict).
const char* const kGroupCountKey = "param_groups.count";

std::string GroupPrefix(size_t group) { return "param_groups." + std::to_string(group) + "."; }

// An infinite rate would make every updated parameter inf or NaN.
void CheckRate(double lr, const std::string& who) {
  if (!(lr >= 0.0) || !std::isfinite(lr)) {
    throw std::invalid_argument(who + ": learning rate " + internal::OptionValueText(lr) + " must be finite and >= 0");
  }
}

template <typename From, typename To>
void Convert(const void* src, To* dst, int64_t n) {
  const From* s = static_cast<const From*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<To>(static_cast<float>(s[i]));
}

// `src` (a floating dtype) converted into `dst`. `who` (the optimizer's
// Name()), `what` ("gradient", "parameter") and `name` name `src` in the
// message refusing another dtype; Step refuses such gradients before it
// updates anything, so this only guards a new caller.
template <typename To>
void ConvertTo(const Tensor& src, To* dst, const char* who, const char* what, const std::string& name) {
  const int64_t n = src.numel();
  switch (src.dtype()) {
    case DType::kFloat32: Convert<float>(src.data_ptr(), dst, n); break;
    case DType::kFloat64: {
      const double* s = static_cast<const double*>(src.data_ptr());
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<To>(s[i]);
      break;
    }
    case DType::kFloat16: Convert<Half>(src.data_ptr(), dst, n); break;
    case DType::kBFloat16: Convert<BFloat16>(src.data_ptr(), dst, n); break;
    default:
      throw std::invalid_argument(std::string(who) + ": " + what + " of `" + name + "` has dtype " +
                                  std::string(DTypeName(src.dtype())) + ", expected a floating type");
  }
}

}  // namespace

int ParameterOfStateKey(const std::string& key, const NamedParameters& params, std::string* slot) {
  int best = -1;
  size_t best_length = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string prefix = "state." + params[i].first + ".";
    if (key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0 &&
        prefix.size() > best_length) {
      best = static_cast<int>(i);
      best_length = prefix.size();
    }
  }
  if (slot != nullptr) *slot = best >= 0 ? key.substr(best_length) : std::string();
  return best;
}

NamedParameters NameByPosition(const std::vector<Tensor>& params) {
  NamedParameters out;
  for (size_t i = 0; i < params.size(); ++i) out.emplace_back(std::to_string(i), params[i]);
  return out;
}

void CheckParameters(const NamedParameters& params, const std::string& who) {
  std::set<std::string> names;
  for (const auto& [name, p] : params) {
    if (name.empty()) throw std::invalid_argument(who + ": a parameter has an empty name");
    // The state dict lists each param group's members one per line (a
    // format files already hold), so a newline would split one name in two
    // and the state would not load back.
    if (name.find('\n') != std::string::npos) {
      std::string shown;
      for (char c : name) shown += c == '\n' ? std::string("\\n") : std::string(1, c);
      throw std::invalid_argument(who + ": parameter `" + shown +
                                  "` has a newline in its name (the saved param group lists are one name a line)");
    }
    if (!names.insert(name).second) {
      throw std::invalid_argument(who + ": parameter `" + name + "` is listed twice");
    }
    if (!p.defined()) throw std::invalid_argument(who + ": parameter `" + name + "` is undefined");
    if (!IsFloating(p.dtype())) {
      throw std::invalid_argument(who + ": parameter `" + name + "` has dtype " +
                                  std::string(DTypeName(p.dtype())) + ", expected a floating type");
    }
    if (!p.is_contiguous()) {
      throw std::invalid_argument(who + ": parameter `" + name + "` is not contiguous");
    }
  }
  // A tensor listed twice (or two views sharing elements) would get two
  // states and be updated twice per step, and GradScaler would unscale its
  // gradient twice. Disjoint views of one buffer (ZeRO's pieces) are fine.
  // Sorted by storage and first byte, a piece overlaps an earlier one iff it
  // starts before the furthest end seen so far in its storage.
  struct Range {
    const Storage* storage;
    size_t begin, end;  // bytes, contiguous (checked above)
    const TensorImpl* impl;
    size_t index;
  };
  std::vector<Range> ranges;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i].second;
    const size_t begin = static_cast<size_t>(p.storage_offset()) * p.element_size();
    ranges.push_back({p.storage().get(), begin, begin + p.nbytes(), p.impl(), i});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return std::tie(a.storage, a.begin, a.end, a.impl) < std::tie(b.storage, b.begin, b.end, b.impl);
  });
  const auto refuse = [&](const Range& x, const Range& y) {
    const Range& a = x.index < y.index ? x : y;
    const Range& b = x.index < y.index ? y : x;
    const auto bytes = [](const Range& r) { return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")"; };
    throw std::invalid_argument(who + ": parameters `" + params[a.index].first + "` and `" + params[b.index].first +
                                "` share memory (bytes " + bytes(a) + " and " + bytes(b) +
                                " of one storage): elements listed twice would be updated twice per step");
  };
  for (size_t k = 1, furthest = 0; k < ranges.size(); ++k) {
    const Range& r = ranges[k];
    const Range& prev = ranges[k - 1];
    if (r.storage != prev.storage) {
      furthest = k;
      continue;
    }
    // An empty tensor shares no element, but listed twice it would still
    // get two states (the same tensor sorts next to itself).
    if (prev.impl == r.impl) refuse(prev, r);
    if (r.begin < r.end && r.begin < ranges[furthest].end) refuse(ranges[furthest], r);
    if (r.end > ranges[furthest].end) furthest = k;
  }
}

Optimizer::Optimizer(const char* who, std::vector<ParamGroup> groups, double lr, std::vector<std::string> slot_names,
                     SlotRules rules)
    : default_lr_(lr), slot_names_(std::move(slot_names)), slot_rules_(std::move(rules)) {
  CheckRate(lr, who);
  if (groups.empty()) {
    throw std::invalid_argument(std::string(who) +
                                ": no parameter group (a plain list of parameters makes one; a group may be empty)");
  }
  for (size_t k = 0; k < groups.size(); ++k) {
    auto it = groups[k].options.find("lr");
    const double group_lr = it == groups[k].options.end() ? lr : it->second;
    CheckRate(group_lr, std::string(who) + ": param group " + std::to_string(k));
    lrs_.push_back(group_lr);
  }
  // A parameter in two groups would be updated twice per step, with two
  // groups' options (PyTorch refuses it too). CheckParameters below refuses
  // it as well; this names the groups.
  if (groups.size() > 1) {
    std::map<std::string, size_t> by_name;
    std::map<const TensorImpl*, std::pair<size_t, std::string>> by_tensor;
    for (size_t k = 0; k < groups.size(); ++k) {
      for (const auto& [name, p] : groups[k].params) {
        auto [n, fresh_name] = by_name.emplace(name, k);
        if (!fresh_name && n->second != k) {
          throw std::invalid_argument(std::string(who) + ": parameter `" + name + "` is in param groups " +
                                      std::to_string(n->second) + " and " + std::to_string(k) +
                                      " (a parameter may be in one group only)");
        }
        if (!p.defined()) continue;
        auto [t, fresh_tensor] = by_tensor.emplace(p.impl(), std::make_pair(k, name));
        if (!fresh_tensor && t->second.first != k) {
          throw std::invalid_argument(std::string(who) + ": one tensor is in param groups " +
                                      std::to_string(t->second.first) + " (as `" + t->second.second + "`) and " +
                                      std::to_string(k) + " (as `" + name +
                                      "`) (a parameter may be in one group only)");
        }
      }
    }
  }
  for (size_t k = 0; k < groups.size(); ++k) {
    group_begin_.push_back(params_.size());
    for (auto& named : groups[k].params) {
      params_.push_back(std::move(named));
      group_of_.push_back(k);
    }
  }
  group_begin_.push_back(params_.size());
  maximize_.assign(groups.size(), false);
  CheckParameters(params_, who);
  CheckOneDevice(who);
  steps_.assign(params_.size(), 0);
  state_.resize(params_.size());
}

Optimizer::Optimizer(const char* who, std::vector<ParamGroup> groups, double lr, std::vector<std::string> slot_names)
    : Optimizer(who, std::move(groups), lr, std::move(slot_names), SlotRules()) {}

namespace {
void CheckParameterIndex(const char* who, const char* what, size_t i, size_t count) {
  if (i >= count) {
    throw std::out_of_range(std::string(who) + ": " + what + " of parameter " + std::to_string(i) +
                            ", but it holds " + std::to_string(count));
  }
}
}  // namespace

uint64_t Optimizer::NextInstanceId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

int64_t Optimizer::step_count(size_t i) const {
  CheckParameterIndex(Name(), "step_count", i, steps_.size());
  return steps_[i];
}

size_t Optimizer::group_of(size_t param) const {
  CheckParameterIndex(Name(), "group_of", param, group_of_.size());
  return group_of_[param];
}

NamedParameters Optimizer::group_params(size_t group) const {
  if (group >= num_groups()) {
    throw std::out_of_range(std::string(Name()) + ": param group " + std::to_string(group) + " of " +
                            std::to_string(num_groups()));
  }
  return NamedParameters(params_.begin() + static_cast<std::ptrdiff_t>(group_begin_[group]),
                         params_.begin() + static_cast<std::ptrdiff_t>(group_begin_[group + 1]));
}

void Optimizer::AddParamGroup(ParamGroup group) {
  const size_t k = num_groups();
  const std::string who = std::string(Name()) + ".AddParamGroup";
  const std::string in_group = who + ": param group " + std::to_string(k) + ": ";
  if (!scheduler_.expired()) {
    throw std::logic_error(who + ": an LrScheduler drives this optimizer and holds one base rate per param "
                           "group, so it would not drive a new one; add param groups before making the "
                           "scheduler");
  }
  std::map<std::string, size_t> names;
  std::map<const TensorImpl*, size_t> tensors;
  for (size_t i = 0; i < params_.size(); ++i) {
    names.emplace(params_[i].first, i);
    tensors.emplace(params_[i].second.impl(), i);
  }
  // A parameter in two groups would be updated twice per step, with two
  // groups' options (PyTorch: "some parameters appear in more than one
  // parameter group").
  for (const auto& [name, p] : group.params) {
    if (name.empty()) throw std::invalid_argument(in_group + "a parameter has an empty name");
    if (!p.defined()) throw std::invalid_argument(in_group + "parameter `" + name + "` is undefined");
    if (auto it = names.find(name); it != names.end()) {
      throw std::invalid_argument(in_group + "parameter `" + name + "` is already in param group " +
                                  std::to_string(group_of_[it->second]) + " (a parameter may be in one group only)");
    }
    if (auto it = tensors.find(p.impl()); it != tensors.end()) {
      throw std::invalid_argument(in_group + "parameter `" + name + "` is the tensor `" + params_[it->second].first +
                                  "` of param group " + std::to_string(group_of_[it->second]) +
                                  " (a parameter may be in one group only)");
    }
  }
  // The rest of CheckParameters (a name twice within the group, dtype,
  // contiguity, shared memory) over every parameter, old and new.
  NamedParameters all = params_;
  all.insert(all.end(), group.params.begin(), group.params.end());
  CheckParameters(all, who);
  for (const auto& [name, p] : group.params) {
    if (p.device() != all.front().second.device()) {
      throw std::invalid_argument(in_group + "parameter `" + name + "` is on " + p.device().ToString() + ", `" +
                                  all.front().first + "` on " + all.front().second.device().ToString() +
                                  " (one optimizer updates one device's parameters)");
    }
  }
  auto lr_it = group.options.find("lr");
  const double group_lr = lr_it == group.options.end() ? default_lr_ : lr_it->second;
  CheckRate(group_lr, in_group.substr(0, in_group.size() - 2));
  const std::map<std::string, double> values = GroupOptionValues({group}, DefaultHyperparameters(), k).front();
  // Checks the values as the constructor does; the last step that may throw.
  AppendGroupOptions(values, group_lr);
  auto maximize = values.find("maximize");
  lrs_.push_back(group_lr);
  maximize_.push_back(maximize != values.end() && maximize->second != 0);
  for (auto& named : group.params) {
    params_.push_back(std::move(named));
    group_of_.push_back(k);
    steps_.push_back(0);
    state_.emplace_back();
  }
  group_begin_.push_back(params_.size());
}

std::vector<std::map<std::string, double>> Optimizer::GroupOptionValues(
    const std::vector<ParamGroup>& groups, const std::vector<Hyperparameter>& defaults, size_t first_group) const {
  std::string known = "lr";
  for (const Hyperparameter& h : defaults) known += ", " + h.name;
  std::vector<std::map<std::string, double>> out;
  for (size_t k = 0; k < groups.size(); ++k) {
    const std::string who = std::string(Name()) + ": param group " + std::to_string(first_group + k) + ": ";
    std::map<std::string, double> values;
    for (const Hyperparameter& h : defaults) values[h.name] = h.value;
    for (const auto& [name, value] : groups[k].options) {
      if (name == "lr") continue;  // the base's
      auto h = std::find_if(defaults.begin(), defaults.end(), [&](const Hyperparameter& d) { return d.name == name; });
      if (h == defaults.end()) {
        throw std::invalid_argument(who + "unknown option `" + name + "` (known: " + known + ")");
      }
      if (h->flag && value != 0 && value != 1) {
        throw std::invalid_argument(who + "option `" + name + "` is a flag, 0 or 1, got " +
                                    internal::OptionValueText(value));
      }
      // One slot layout for all groups: the state's slots are the
      // optimizer's, not a group's.
      if (h->structural && (value != 0) != (h->value != 0)) {
        throw std::invalid_argument(who + "option `" + name + "` " +
                                    (h->flag ? std::string("differs from the default's")
                                             : std::string("is zero or non-zero where the default's is not")) +
                                    " (" + internal::OptionValueText(value) + " against " +
                                    internal::OptionValueText(h->value) +
                                    "): it decides which state is kept, and per-group state layouts are not "
                                    "supported; give every group the same");
      }
      values[name] = value;
    }
    out.push_back(std::move(values));
  }
  return out;
}

void Optimizer::CheckOneDevice(const char* who) const {
  for (const auto& [name, p] : params_) {
    if (p.device() != params_.front().second.device()) {
      throw std::invalid_argument(std::string(who) + ": parameters on two devices: `" + params_.front().first +
                                  "` on " + params_.front().second.device().ToString() + ", `" + name + "` on " +
                                  p.device().ToString() + " (one optimizer updates one device's parameters)");
    }
  }
}

double Optimizer::lr(size_t group) const {
  if (group >= num_groups()) {
    throw std::out_of_range(std::string(Name()) + ": lr of param group " + std::to_string(group) +
                            ", but there are " + std::to_string(num_groups()));
  }
  return lrs_[group];
}

void Optimizer::set_lr(double lr) {
  if (num_groups() > 1) {
    throw std::logic_error(std::string(Name()) + ": set_lr(lr) with " + std::to_string(num_groups()) +
                           " param groups would give them one rate and lose their ratios; set each with "
                           "set_lr(group, lr)");
  }
  set_lr(0, lr);
}

void Optimizer::set_lr(size_t group, double lr) {
  if (group >= num_groups()) {
    throw std::out_of_range(std::string(Name()) + ": set_lr of param group " + std::to_string(group) +
                            ", but there are " + std::to_string(num_groups()));
  }
  CheckRate(lr, num_groups() > 1 ? std::string(Name()) + ": param group " + std::to_string(group) : Name());
  lrs_[group] = lr;
}

void Optimizer::set_grad_scale(double scale) {
  if (!(scale >= 0)) {
    throw std::invalid_argument(std::string(Name()) + ": grad scale " + internal::OptionValueText(scale) +
                                " must be >= 0 (the factor every gradient is read with; use the maximize option to "
                                "ascend)");
  }
  grad_scale_ = scale;
}

double Optimizer::momentum(size_t group) const {
  const char* option = MomentumOption();
  if (option == nullptr) {
    throw std::invalid_argument(std::string(Name()) +
                                " has no momentum (nor Adam's beta1) for a schedule to drive: use "
                                "cycle_momentum=false");
  }
  if (group >= num_groups()) {
    throw std::out_of_range(std::string(Name()) + ": momentum of param group " + std::to_string(group) +
                            ", but there are " + std::to_string(num_groups()));
  }
  for (const Hyperparameter& h : Hyperparameters(group)) {
    if (h.name == option) return h.value;
  }
  std::abort();  // MomentumOption names one of Hyperparameters()
}

std::string Optimizer::RefusalText(const std::exception& e) const {
  const std::string what = e.what();
  const std::string own = std::string(Name()) + ": ";
  return what.rfind(own, 0) == 0 ? what.substr(own.size()) : what;
}

void Optimizer::CheckMomentum(size_t group, double momentum) const {
  const double current = this->momentum(group);  // throws without momentum
  const char* option = MomentumOption();
  std::map<std::string, double> values;
  bool structural = false;
  for (const Hyperparameter& h : Hyperparameters(group)) {
    values[h.name] = h.value;
    if (h.name == option) structural = h.structural;
  }
  const std::string where = std::string(Name()) + ": param group " + std::to_string(group) + "'s " + option;
  if (!std::isfinite(momentum)) {
    throw std::invalid_argument(where + " " + internal::OptionValueText(momentum) + " must be finite");
  }
  // SGD keeps a momentum buffer only when momentum != 0 (Hyperparameter's
  // structural): a switch between zero and non-zero would change the state.
  if (structural && current == 0) {
    throw std::invalid_argument(where + " is 0: an " + Name() + " made without " + option +
                                " keeps no momentum buffer, so its " + option +
                                " cannot be driven (make it with " + option + " > 0)");
  }
  if (structural && momentum == 0) {
    throw std::invalid_argument(where + " cannot become 0: the " + Name() + " keeps a momentum buffer only while " +
                                option + " != 0");
  }
  values[option] = momentum;
  try {
    CheckHyperparameters(group, values);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + " " + internal::OptionValueText(momentum) + " refused: " + RefusalText(e));
  }
}

void Optimizer::set_momentum(size_t group, double momentum) {
  CheckMomentum(group, momentum);
  std::map<std::string, double> values;
  for (const Hyperparameter& h : Hyperparameters(group)) values[h.name] = h.value;
  values[MomentumOption()] = momentum;
  SetHyperparameters(group, values);
}

DType Optimizer::ComputeDType(size_t i) const {
  return params_[i].second.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

std::vector<Tensor> Optimizer::StartSlots(size_t i) const {
  const std::vector<double> values = StartSlotValues(group_of_[i]);
  std::vector<Tensor> slots;
  if (values.empty()) return slots;
  const Tensor& p = params_[i].second;
  for (double v : values) slots.push_back(Full(p.shape(), v, {.dtype = ComputeDType(i), .device = p.device()}));
  return slots;
}

namespace {

bool Is16Bit(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16; }

// An f32 copy of a 16-bit parameter, `name` of optimizer `who`.
Tensor MasterOf(const Tensor& p, const char* who, const std::string& name) {
  if (!p.device().is_cpu()) return p.Detach().To(DType::kFloat32);
  Tensor master = Empty(p.shape(), {.dtype = DType::kFloat32});
  ConvertTo(p, master.data<float>(), who, "parameter", name);
  return master;
}

bool SameStorage(const std::weak_ptr<Storage>& a, const std::shared_ptr<Storage>& b) {
  return !a.owner_before(b) && !b.owner_before(a);
}

// p [n] (P: Half or BFloat16) against its master m [n]: an element whose
// master does not round to p's bits was written from outside and takes p's
// value. With `via_other`, rounded through the other 16-bit type first also
// counts as agreeing: that is what a parameter converted between the two
// (Module::To) holds, and a checkpoint of the state does not say which type
// it had. Not otherwise: a write that happens to land on that rounding (an
// average within half a bf16 step of an f16 master) is a write, and a
// replica that kept its master would drift from the others.
template <typename P, typename Other>
void MergeElements(const Tensor& p, const Tensor& m, bool via_other) {
  const P* pp = static_cast<const P*>(p.data_ptr());
  float* mp = m.data<float>();
  for (int64_t k = 0; k < p.numel(); ++k) {
    if (P(mp[k]).bits == pp[k].bits) continue;
    if (via_other && P(static_cast<float>(Other(mp[k]))).bits == pp[k].bits) continue;
    mp[k] = static_cast<float>(pp[k]);
  }
}

// Takes the writes made to the 16-bit parameter p since it last agreed with
// its f32 master (contiguous, p's shape and device) into the master, in
// place. Only after such a write: on a device, p and the master make a trip
// through host memory, which waits for the device.
void MergeOutsideWrites(const Tensor& p, const Tensor& master, bool via_other) {
  const bool host = p.device().is_cpu();
  const Tensor pc = host ? p : p.Detach().To(kCPU);
  const Tensor mc = host ? master : master.To(kCPU);
  if (p.dtype() == DType::kFloat16) {
    MergeElements<Half, BFloat16>(pc, mc, via_other);
  } else {
    MergeElements<BFloat16, Half>(pc, mc, via_other);
  }
  if (!host) {
    NoGradGuard guard;
    master.CopyFrom(mc);
  }
}

}  // namespace

bool Optimizer::MasterSynced(const State& s, const Tensor& p) {
  return SameStorage(s.synced_storage, p.storage()) && s.synced_version == p.storage()->version();
}

void Optimizer::MarkSynced(State& s, const Tensor& p) {
  s.synced_storage = p.storage();
  s.synced_version = p.storage()->version();
  s.synced_dtype = p.dtype();
}

bool Optimizer::MayHaveChangedType(const State& s, const Tensor& p) {
  return !SameStorage(s.synced_storage, p.storage()) || s.synced_dtype != p.dtype();
}

void Optimizer::NoteOwnWrite(size_t i, uint64_t before) {
  const std::shared_ptr<Storage>& storage = params_[i].second.storage();
  const uint64_t after = storage->version();
  State& own = state_[i];
  if (own.master.defined() && own.synced_version == before && SameStorage(own.synced_storage, storage)) {
    own.synced_version = after;
  }
  // Other parameters viewing the same memory (ZeRO's pieces of one flat
  // buffer) saw the version move too, by this write alone; the memory has
  // no other user in the common case, and nothing to look for.
  if (storage.use_count() == 1) return;
  for (size_t j = 0; j < params_.size(); ++j) {
    State& t = state_[j];
    if (j != i && t.master.defined() && t.synced_version == before && SameStorage(t.synced_storage, storage)) {
      t.synced_version = after;
    }
  }
}

Optimizer::State Optimizer::CurrentState(size_t i) const {
  State s = state_[i];
  const Tensor& p = params_[i].second;
  // State made (or loaded) before the parameter moved follows it: to its
  // device, and to its dtype (Module::To converts parameters in place).
  // The slots' values carry over, converted to the new compute dtype (PyTorch
  // keeps its buffers and casts in the update); a parameter that is no
  // longer 16-bit drops its master and is updated itself, one that became
  // 16-bit gets a master copied from it.
  const DType compute = ComputeDType(i);
  for (Tensor& t : s.slots) {
    if (t.device() != p.device()) t = t.To(p.device());
    if (t.dtype() != compute) t = t.To(compute);
  }
  if (!Is16Bit(p.dtype())) {
    s.master = Tensor();
  } else if (!s.master.defined()) {
    s.master = MasterOf(p, Name(), params_[i].first);
    MarkSynced(s, p);
  } else if (!MasterSynced(s, p)) {
    // Written from outside since the master last agreed with it: merged
    // into a copy (the stored master changes only when a step takes this).
    s.master = s.master.device() == p.device() ? s.master.Clone() : s.master.To(p.device());
    MergeOutsideWrites(p, s.master, MayHaveChangedType(s, p));
    MarkSynced(s, p);
  } else if (s.master.device() != p.device()) {
    s.master = s.master.To(p.device());
  }
  return s;
}

bool Optimizer::InitState(size_t i) {
  State& s = state_[i];
  const Tensor& p = params_[i].second;
  // Every step comes here: the state is rebuilt only when the parameter
  // moved or changed dtype since it was made (or has no master yet, on its
  // first step), and the master takes in writes made to the parameter from
  // outside.
  const DType compute = ComputeDType(i);
  bool current = s.master.defined() == Is16Bit(p.dtype()) &&
                 (!s.master.defined() || s.master.device() == p.device());
  for (const Tensor& t : s.slots) current = current && t.device() == p.device() && t.dtype() == compute;
  if (!current) {
    s = CurrentState(i);
  } else if (s.master.defined() && !MasterSynced(s, p)) {
    MergeOutsideWrites(p, s.master, MayHaveChangedType(s, p));
    MarkSynced(s, p);
  }
  if (s.slots.size() == slot_names_.size()) return false;
  s.slots = StartSlots(i);
  if (!s.slots.empty()) return false;  // as if made with the optimizer: not fresh
  // Built aside and kept only whole: running out of memory at the second
  // slot must not leave the parameter with one.
  std::vector<Tensor> slots;
  for (size_t k = 0; k < slot_names_.size(); ++k) {
    slots.push_back(Zeros(p.shape(), {.dtype = compute, .device = p.device()}));
  }
  s.slots = std::move(slots);
  return true;
}

void Optimizer::Step() {
  std::vector<float> scratch_f;
  std::vector<double> scratch_d;
  // Parameters may have moved since construction (Module::To keeps the
  // tensor objects): check again, and take the state along below.
  CheckOneDevice(Name());
  const Device device = this->device();
  const bool device_path = internal::UsesDevicePath(device);
  if (device_path) CheckDeviceKernels(device);
  // Every gradient is checked before any parameter changes: a bad one at
  // parameter k must not leave 0..k-1 updated and their steps counted.
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    const Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    // SetData (p.data = ... in PyTorch) may have given the parameter other
    // strides or another shape since construction or its last step: the
    // loops below read it, its slots and its master as `numel` elements in
    // a row, so a strided parameter would update the wrong elements and a
    // larger one run past the end of its state.
    if (!p.is_contiguous()) {
      throw std::invalid_argument(std::string(Name()) + ": parameter `" + name + "` of shape " +
                                  ShapeToString(p.shape()) + " is not contiguous (its data was replaced "
                                  "since the optimizer took it)");
    }
    const State& s = state_[i];
    std::vector<std::pair<std::string, const Tensor*>> saved;
    for (size_t k = 0; k < s.slots.size(); ++k) saved.emplace_back(slot_names_[k], &s.slots[k]);
    if (s.master.defined()) saved.emplace_back("master", &s.master);
    for (const auto& [what, t] : saved) {
      if (t->shape() != p.shape()) {
        throw std::invalid_argument(std::string(Name()) + ": state `" + what + "` of parameter `" + name +
                                    "` has shape " + ShapeToString(t->shape()) + ", the parameter now " +
                                    ShapeToString(p.shape()) + " (its data was replaced with another shape)");
      }
    }
    if (grad.shape() != p.shape()) {
      throw std::invalid_argument(std::string(Name()) + ": gradient of `" + name + "` has shape " +
                                  ShapeToString(grad.shape()) + ", the parameter " +
                                  ShapeToString(p.shape()));
    }
    if (grad.device() != p.device()) {
      throw std::invalid_argument(std::string(Name()) + ": gradient of `" + name + "` is on " +
                                  grad.device().ToString() + ", the parameter on " + p.device().ToString());
    }
    // set_grad takes only the parameter's dtype, but SetData on the
    // gradient may give it any; an integer one would otherwise fail in the
    // host conversion after earlier parameters were updated, or be
    // converted silently on the device path.
    if (!IsFloating(grad.dtype())) {
      throw std::invalid_argument(std::string(Name()) + ": gradient of `" + name + "` has dtype " +
                                  std::string(DTypeName(grad.dtype())) + ", expected a floating type");
    }
  }
  if (!device_path) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const Tensor& grad = params_[i].second.grad();
      if (grad.defined()) HostStep(i, grad, scratch_f, scratch_d);
    }
    return;
  }
  // Every update of the step goes to DeviceUpdateAll at once, so that an
  // optimizer with a multi-tensor kernel can launch it once per group
  // instead of once per parameter. Converted gradients (of 16-bit or strided
  // ones) are all alive until then.
  std::vector<size_t> updated;
  std::vector<DeviceUpdateItem> items;
  updated.reserve(params_.size());
  items.reserve(params_.size());
  try {
    for (size_t i = 0; i < params_.size(); ++i) {
      const Tensor& grad = params_[i].second.grad();
      if (!grad.defined()) continue;
      items.push_back(PrepareDeviceStep(i, grad));
      updated.push_back(i);
    }
  } catch (...) {
    // Nothing was launched (a conversion or a state ran out of memory):
    // the steps counted so far are taken back, and slots made fresh for
    // them dropped, so that the next step is the first again for those
    // parameters, not a second after an update that never ran.
    for (size_t k = 0; k < updated.size(); ++k) {
      --steps_[updated[k]];
      if (items[k].fresh) state_[updated[k]].slots.clear();
    }
    throw;
  }
  if (items.empty()) return;
  DeviceUpdateAll(items);
  for (size_t i : updated) FinishDeviceStep(i);
}

void Optimizer::DeviceUpdateAll(const std::vector<DeviceUpdateItem>& items) {
  for (const DeviceUpdateItem& item : items) {
    DeviceUpdate(item.group, item.p, item.g, item.slots, item.step, item.fresh, item.grad_scale);
  }
}

Optimizer::DeviceUpdateItem Optimizer::PrepareDeviceStep(size_t i, const Tensor& grad) {
  const Tensor& p = params_[i].second;
  const DType compute = ComputeDType(i);
  DeviceUpdateItem item;
  // A 16-bit or strided gradient becomes a contiguous one of the compute
  // dtype on the device (one conversion kernel; no host copy).
  item.g = grad.dtype() == compute && grad.is_contiguous() ? grad : grad.Detach().To(compute).Contiguous();
  item.fresh = InitState(i);
  const State& s = state_[i];
  item.step = ++steps_[i];
  item.p = s.master.defined() ? s.master : p;
  item.slots = s.slots;
  item.group = group_of_[i];
  item.grad_scale = StepScale(item.group);
  return item;
}

void Optimizer::FinishDeviceStep(size_t i) {
  const Tensor& p = params_[i].second;
  const State& s = state_[i];
  // Taken here, not before the update: only the master was written since,
  // and the steps of other views of p's memory finished before this one.
  const uint64_t before = p.storage()->version();
  if (s.master.defined()) {
    NoGradGuard guard;
    p.CopyFrom(s.master);  // rounds the f32 master into the 16-bit parameter on the device
  }
  p.storage()->BumpVersion();
  if (s.master.defined()) NoteOwnWrite(i, before);
}

void Optimizer::HostStep(size_t i, const Tensor& grad, std::vector<float>& scratch_f, std::vector<double>& scratch_d) {
  const Tensor& p = params_[i].second;
  const Tensor g = grad.is_contiguous() ? grad : grad.Detach().Contiguous();
  const int64_t n = p.numel();
  const bool f64 = ComputeDType(i) == DType::kFloat64;
  // The gradient in the compute dtype before the state and the step count
  // are touched: running out of memory for its copy must leave both as
  // they were, not a step counted (and fresh slots kept) for an update
  // that never ran.
  const double* gp_d = nullptr;
  const float* gp_f = nullptr;
  if (f64 && g.dtype() == DType::kFloat64) {
    gp_d = g.data<double>();
  } else if (f64) {
    scratch_d.resize(n);
    ConvertTo(g, scratch_d.data(), Name(), "gradient", params_[i].first);
    gp_d = scratch_d.data();
  } else if (g.dtype() == DType::kFloat32) {
    gp_f = g.data<float>();
  } else {
    scratch_f.resize(n);
    ConvertTo(g, scratch_f.data(), Name(), "gradient", params_[i].first);
    gp_f = scratch_f.data();
  }
  const bool fresh = InitState(i);
  State& s = state_[i];
  const size_t group = group_of_[i];
  const uint64_t before = p.storage()->version();
  if (f64) {
    std::vector<double*> slots;
    for (Tensor& t : s.slots) slots.push_back(t.data<double>());
    const int64_t step = ++steps_[i];
    Update(group, p.data<double>(), gp_d, slots.data(), n, step, fresh, StepScale(group));
  } else {
    std::vector<float*> slots;
    for (Tensor& t : s.slots) slots.push_back(t.data<float>());
    const int64_t step = ++steps_[i];
    float* target = s.master.defined() ? s.master.data<float>() : p.data<float>();
    Update(group, target, gp_f, slots.data(), n, step, fresh, static_cast<float>(StepScale(group)));
    if (p.dtype() == DType::kFloat16) {
      Half* out = p.data<Half>();
      for (int64_t k = 0; k < n; ++k) out[k] = Half(target[k]);
    } else if (p.dtype() == DType::kBFloat16) {
      BFloat16* out = p.data<BFloat16>();
      for (int64_t k = 0; k < n; ++k) out[k] = BFloat16(target[k]);
    }
  }
  p.storage()->BumpVersion();
  if (s.master.defined()) NoteOwnWrite(i, before);
}

void ZeroGrad(const NamedParameters& params, bool set_to_none) {
  for (const auto& [name, p] : params) ZeroGradOf(p, set_to_none);
}

void Optimizer::ZeroGrad(bool set_to_none) { optim::ZeroGrad(params_, set_to_none); }

NamedTensors Optimizer::StateDict() const {
  NamedTensors out;
  const auto f64 = [](double v) { return FromVector({v}, {}, {.dtype = DType::kFloat64}); };
  const auto option = [&f64](const Hyperparameter& h) {
    return h.flag ? FromVectorOf<int64_t>({h.value != 0 ? 1 : 0}, {}) : f64(h.value);
  };
  // One group keeps the layout of states saved before groups existed.
  const bool one_group = num_groups() == 1;
  if (one_group) out.emplace_back("lr", f64(lrs_[0]));
  const std::string kind = Name();
  out.emplace_back("group.optimizer", FromVectorOf<uint8_t>(std::vector<uint8_t>(kind.begin(), kind.end()),
                                                            {static_cast<int64_t>(kind.size())}));
  if (one_group) {
    for (const Hyperparameter& h : Hyperparameters(0)) out.emplace_back("group." + h.name, option(h));
  } else {
    out.emplace_back(kGroupCountKey, FromVectorOf<int64_t>({static_cast<int64_t>(num_groups())}, {}));
    for (size_t k = 0; k < num_groups(); ++k) {
      const std::string prefix = GroupPrefix(k);
      out.emplace_back(prefix + "lr", f64(lrs_[k]));
      for (const Hyperparameter& h : Hyperparameters(k)) out.emplace_back(prefix + h.name, option(h));
      out.emplace_back(prefix + "size",
                       FromVectorOf<int64_t>({static_cast<int64_t>(group_begin_[k + 1] - group_begin_[k])}, {}));
      std::vector<std::string> names;
      for (size_t i = group_begin_[k]; i < group_begin_[k + 1]; ++i) names.push_back(params_[i].first);
      out.emplace_back(prefix + "params", internal::GroupMembersTensor(names));
    }
  }
  // Every parameter gets a step entry, 0 before its first update, so that a
  // loader can tell a parameter the saving optimizer never updated from one
  // it did not hold. The flag says so (states saved before it list only the
  // updated parameters). Wrappers that split the list pass the flag on with
  // the options and each parameter's step with its state.
  out.emplace_back(kParamsListedKey, FromVectorOf<int64_t>({1}, {}));
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string prefix = "state." + params_[i].first + ".";
    out.emplace_back(prefix + "step", FromVectorOf<int64_t>({steps_[i]}, {}));
    if (steps_[i] == 0) {
      // Slots held from the start (StartSlotValues) are saved before the
      // first step too, as PyTorch's state holds them, and only those, all
      // of them (a load refuses any other at step 0: slots a first step
      // made before it failed are not the state); a master is made at the
      // first step, so there is none to save.
      if (StartSlotValues(group_of_[i]).empty()) continue;
      const std::vector<Tensor> slots =
          state_[i].slots.size() == slot_names_.size() ? state_[i].slots : StartSlots(i);
      for (size_t k = 0; k < slots.size(); ++k) {
        Tensor t = slots[k];
        if (t.device() != params_[i].second.device()) t = t.To(params_[i].second.device());
        out.emplace_back(prefix + slot_names_[k], t.dtype() == ComputeDType(i) ? t.Clone() : t.To(ComputeDType(i)));
      }
      continue;
    }
    // As the next step would see it, so LoadStateDict takes it back even
    // when the parameter changed dtype or device since its last step.
    const State s = CurrentState(i);
    for (size_t k = 0; k < s.slots.size(); ++k) out.emplace_back(prefix + slot_names_[k], s.slots[k].Clone());
    if (s.master.defined()) out.emplace_back(prefix + "master", s.master.Clone());
  }
  return out;
}

// What a checked state loads: its "lr", "group.", "param_groups." and
// "state." entries by key, each parameter's step (0: no state), and per
// group the learning rate and the saved options (empty for a state saved
// without them).
struct Optimizer::LoadPlan {
  std::map<std::string, Tensor> given;
  std::vector<int64_t> steps;
  std::vector<double> lrs;
  std::vector<std::map<std::string, double>> options;
};

namespace {

// An option's value for messages: "true"/"false" for flags, else as %g.
std::string OptionText(double value, bool flag) {
  if (flag) return value != 0 ? "true" : "false";
  std::ostringstream os;
  os << value;
  return os.str();
}

}  // namespace

void Optimizer::CheckStateDict(const NamedTensors& state) const { PlanLoad(state); }

Optimizer::LoadPlan Optimizer::PlanLoad(const NamedTensors& state) const {
  LoadPlan plan;
  std::map<std::string, Tensor>& given = plan.given;
  for (const auto& [k, t] : state) {
    if (k == "lr" || k.rfind("state.", 0) == 0 || k.rfind("group.", 0) == 0 || k.rfind("param_groups.", 0) == 0) {
      given[k] = t;
    }
  }
  std::vector<std::string> problems;
  // `convertible`: any floating dtype is taken and converted to `dtype` (as
  // PyTorch casts floating state to its parameter's dtype), so a state saved
  // before Module::To changed a parameter's dtype loads after it.
  auto check = [&](const std::string& key, const Tensor& t, const Shape& shape, DType dtype, bool convertible) {
    if (!t.defined()) {
      problems.push_back("`" + key + "` is undefined");
    } else if (t.shape() != shape || (convertible ? !IsFloating(t.dtype()) : t.dtype() != dtype)) {
      problems.push_back("`" + key + "` is " + std::string(DTypeName(t.dtype())) + " " +
                         ShapeToString(t.shape()) + ", expected " + std::string(DTypeName(dtype)) +
                         " " + ShapeToString(shape));
    }
  };
  // A 0-d i64 tensor's value, or why it is not one.
  auto i64_scalar = [](const Tensor& t, int64_t* value) -> std::string {
    if (t.defined() && t.dtype() == DType::kInt64 && t.shape() == Shape{}) {
      *value = t.To(kCPU).data<int64_t>()[0];
      return "";
    }
    return t.defined() ? std::string(DTypeName(t.dtype())) + " " + ShapeToString(t.shape()) : std::string("undefined");
  };
  // The groups: a state without their count was saved by one group (or
  // before groups existed) and has the one-group layout.
  const size_t groups = num_groups();
  bool multi = false;
  bool groups_match = true;
  std::set<std::string> expected;
  if (auto it = given.find(kGroupCountKey); it != given.end()) {
    multi = true;
    expected.insert(kGroupCountKey);
    int64_t count = 0;
    const std::string why = i64_scalar(it->second, &count);
    if (!why.empty() || count < 1) {
      problems.push_back(std::string("`") + kGroupCountKey + "` is " + (why.empty() ? std::to_string(count) : why) +
                         ", expected an i64 scalar >= 1");
      groups_match = false;
    } else if (static_cast<size_t>(count) != groups) {
      problems.push_back("the state has " + std::to_string(count) + " param groups, this optimizer " +
                         std::to_string(groups) + ": make it with the saved groups");
      groups_match = false;
    }
  } else if (groups != 1) {
    problems.push_back("the state has 1 param group (no `" + std::string(kGroupCountKey) + "`), this optimizer " +
                       std::to_string(groups) + ": make it with the saved groups");
    groups_match = false;
  }
  const auto lr_key = [multi](size_t k) { return multi ? GroupPrefix(k) + "lr" : std::string("lr"); };
  const auto option_key = [multi](size_t k, const std::string& name) {
    return (multi ? GroupPrefix(k) : std::string("group.")) + name;
  };
  // Problems of one group's options name it when there are several.
  const auto in_group = [multi](size_t k) { return multi ? "param group " + std::to_string(k) + ": " : std::string(); };
  plan.lrs.assign(groups, 0);
  plan.options.assign(groups, {});
  if (groups_match) {
    for (size_t k = 0; k < groups; ++k) {
      const std::string key = lr_key(k);
      expected.insert(key);
      auto lr_it = given.find(key);
      if (lr_it == given.end()) {
        problems.push_back("missing `" + key + "`");
        continue;
      }
      const Tensor& t = lr_it->second;
      check(key, t, {}, DType::kFloat64, false);
      if (t.defined() && t.dtype() == DType::kFloat64 && t.numel() == 1) {
        const double lr = t.Item();
        plan.lrs[k] = lr;
        if (!(lr >= 0) || !std::isfinite(lr)) {
          problems.push_back("`" + key + "` is " + internal::OptionValueText(lr) + ", expected finite and >= 0");
        }
      }
    }
  } else {
    // The count said it all: the groups' entries (a one-group state's
    // "group.<option>" among them) are not looked at.
    for (const auto& [k, t] : given) {
      if (k == "lr" || k.rfind("param_groups.", 0) == 0 ||
          (k.rfind("group.", 0) == 0 && k != "group.optimizer" && k != kParamsListedKey)) {
        expected.insert(k);
      }
    }
  }
  // The options, all or none ("group." keys absent: a state saved before
  // they were, which keeps this optimizer's options). A state with several
  // groups always has them.
  bool has_options = multi;
  for (const auto& [k, t] : given) has_options = has_options || k.rfind("group.", 0) == 0;
  // Whether the state lists every parameter of the optimizer that saved it
  // (kParamsListedKey): then one of ours without a step entry was not held
  // by that optimizer, and loading would silently restart its state.
  bool listed = false;
  if (auto it = given.find(kParamsListedKey); it != given.end()) {
    expected.insert(kParamsListedKey);
    const Tensor& t = it->second;
    if (!t.defined() || t.dtype() != DType::kInt64 || t.shape() != Shape{} || t.To(kCPU).data<int64_t>()[0] != 1) {
      problems.push_back(std::string("`") + kParamsListedKey + "` is " +
                         (t.defined() && t.dtype() == DType::kInt64 && t.numel() == 1
                              ? std::to_string(t.To(kCPU).data<int64_t>()[0])
                              : (t.defined() ? std::string(DTypeName(t.dtype())) + " " + ShapeToString(t.shape())
                                             : std::string("undefined"))) +
                         ", expected an i64 scalar 1");
    } else {
      listed = true;
    }
  }
  if (has_options) {
    expected.insert("group.optimizer");
    std::string saved_kind;
    auto kind = given.find("group.optimizer");
    if (kind == given.end()) {
      problems.push_back("missing `group.optimizer`");
    } else if (!kind->second.defined() || kind->second.dtype() != DType::kUInt8 || kind->second.dim() != 1) {
      const Tensor& t = kind->second;
      problems.push_back("`group.optimizer` is " +
                         (t.defined() ? std::string(DTypeName(t.dtype())) + " " + ShapeToString(t.shape())
                                      : std::string("undefined")) +
                         ", expected u8 text");
    } else {
      const Tensor text = kind->second.To(kCPU).Contiguous();
      saved_kind.assign(text.data<uint8_t>(), text.data<uint8_t>() + text.numel());
      if (saved_kind.empty()) problems.push_back("`group.optimizer` is empty, expected the optimizer's name");
    }
    if (!saved_kind.empty() && saved_kind != Name()) {
      // Its options are another optimizer's: one problem says it all.
      problems.push_back("the state was saved by " + saved_kind + ", this optimizer is " + Name());
      for (const auto& [k, t] : given) {
        if (k.rfind("group.", 0) == 0 || k.rfind("param_groups.", 0) == 0) expected.insert(k);
      }
    } else if (groups_match) {
      for (size_t g = 0; g < groups; ++g) {
        const std::vector<Hyperparameter> options = Hyperparameters(g);
        bool usable = !saved_kind.empty();
        for (const Hyperparameter& h : options) {
          const std::string key = option_key(g, h.name);
          expected.insert(key);
          auto it = given.find(key);
          const DType dtype = h.flag ? DType::kInt64 : DType::kFloat64;
          if (it == given.end()) {
            problems.push_back("missing `" + key + "`");
            usable = false;
            continue;
          }
          const Tensor& t = it->second;
          if (!t.defined() || t.dtype() != dtype || t.shape() != Shape{}) {
            check(key, t, {}, dtype, false);
            usable = false;
            continue;
          }
          const Tensor host = t.To(kCPU);
          const double v = h.flag ? static_cast<double>(host.data<int64_t>()[0]) : host.data<double>()[0];
          if (h.flag && v != 0 && v != 1) {
            problems.push_back("`" + key + "` is " + std::to_string(host.data<int64_t>()[0]) + ", expected 0 or 1");
            usable = false;
          } else if (h.structural && (v != 0) != (h.value != 0)) {
            problems.push_back(in_group(g) + h.name + " is " + OptionText(v, h.flag) + " in the state and " +
                               OptionText(h.value, h.flag) + " in this optimizer" +
                               (h.flag ? "" : " (zero and non-zero keep different state)") +
                               ": construct it with the saved " + h.name);
            usable = false;
          }
          plan.options[g][h.name] = v;
        }
        if (multi) {
          // The group's parameter count, as PyTorch compares param groups'
          // lengths: a parameter moved between groups would take another
          // group's options.
          const std::string key = GroupPrefix(g) + "size";
          expected.insert(key);
          const size_t size = group_begin_[g + 1] - group_begin_[g];
          auto it = given.find(key);
          int64_t saved = 0;
          if (it == given.end()) {
            problems.push_back("missing `" + key + "`");
          } else if (const std::string why = i64_scalar(it->second, &saved); !why.empty()) {
            problems.push_back("`" + key + "` is " + why + ", expected an i64 scalar");
          } else if (saved != static_cast<int64_t>(size)) {
            problems.push_back("param group " + std::to_string(g) + " has " + std::to_string(saved) +
                               " parameters in the state and " + std::to_string(size) + " in this optimizer");
          }
          // And the same parameters: groups built in another order, or of
          // equal sizes with parameters swapped between them, would give
          // each group's options (and rate) to the other's parameters.
          const std::string members_key = GroupPrefix(g) + "params";
          expected.insert(members_key);
          std::vector<std::string> members;
          auto members_it = given.find(members_key);
          if (members_it == given.end()) {
            problems.push_back("missing `" + members_key + "`");
          } else if (!internal::GroupMembersOf(members_it->second, &members)) {
            const Tensor& t = members_it->second;
            problems.push_back("`" + members_key + "` is " +
                               (t.defined() ? std::string(DTypeName(t.dtype())) + " " + ShapeToString(t.shape())
                                            : std::string("undefined")) +
                               ", expected u8 text");
          } else if (saved == static_cast<int64_t>(size) && members.size() != size) {
            // The list is read apart from `size`: one longer than the group
            // would be compared past the group's parameters.
            problems.push_back("`" + members_key + "` lists " + std::to_string(members.size()) + " parameters and `" +
                               key + "` says " + std::to_string(saved));
          } else if (saved == static_cast<int64_t>(size)) {
            for (size_t j = 0; j < members.size(); ++j) {
              const std::string& mine = params_[group_begin_[g] + j].first;
              if (members[j] != mine) {
                problems.push_back("param group " + std::to_string(g) + " holds other parameters in the state: `" +
                                   members[j] + "` where this optimizer has `" + mine +
                                   "` (make the groups as they were saved, in the same order)");
                break;
              }
            }
          }
        }
        if (usable) {
          try {
            CheckHyperparameters(g, plan.options[g]);
          } catch (const std::invalid_argument& e) {
            problems.push_back(in_group(g) + "the state's options are refused: " + RefusalText(e));
          }
        }
      }
    }
  }
  std::vector<int64_t>& new_steps = plan.steps;
  new_steps.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i].second;
    const std::string prefix = "state." + params_[i].first + ".";
    std::vector<std::string> keys = {prefix + "step"};
    int slots_given = 0;
    for (const std::string& s : slot_names_) {
      keys.push_back(prefix + s);
      slots_given += given.count(prefix + s);
    }
    // Absent together (SlotRules::may_be_absent): made at the next step.
    const bool slots_absent = slot_rules_.may_be_absent && slots_given == 0;
    // Kept by other options: checked below like slots, then dropped.
    std::vector<std::string> optional;
    for (const std::string& s : slot_rules_.dropped) optional.push_back(prefix + s);
    // The master is optional either way: saved while the parameter was f32
    // or f64, a 16-bit parameter gets one from its values at the next step;
    // saved while it was 16-bit, an f32 or f64 parameter drops it.
    const std::string master_key = prefix + "master";
    optional.push_back(master_key);
    int present = 0;
    for (const std::vector<std::string>* list : {&keys, &optional}) {
      for (const std::string& k : *list) {
        expected.insert(k);
        present += given.count(k);
      }
    }
    if (present == 0) {
      // In a state that lists every parameter, a missing one was not held
      // by the saving optimizer (PyTorch refuses param groups of other
      // sizes). One without elements is exempt: a sharded optimizer's
      // consolidated state has none of its entries, and its state holds no
      // value. So is a frozen one (requires_grad off and no gradient): an
      // optimizer of the trained parameters alone (OverlappedZeroOptimizer)
      // saves none of its entries, and it takes no step.
      const bool frozen = !p.requires_grad() && !p.grad().defined();
      if (listed && p.numel() > 0 && !frozen) {
        problems.push_back("parameter `" + params_[i].first + "` is not in the state (no `" + prefix +
                           "step`): it was saved by an optimizer over other parameters");
      }
      continue;  // never updated when saved (a state from before the list)
    }
    if (auto it = given.find(prefix + "step"); it != given.end() && it->second.defined() &&
                                               it->second.dtype() == DType::kInt64 && it->second.numel() == 1 &&
                                               it->second.To(kCPU).data<int64_t>()[0] == 0) {
      // Held but never updated when saved: no other entry belongs to it.
      // The entry itself is checked as any step is (a 0 in an i64 [1] is
      // not a step entry StateDict writes).
      // The exception: slots an optimizer makes when it is built
      // (StartSlotValues) are saved before the first step, all of them (or,
      // from a file older than that, none).
      check(prefix + "step", it->second, {}, DType::kInt64, false);
      const bool start_slots = !StartSlotValues(group_of_[i]).empty();
      for (const std::vector<std::string>* list : {&keys, &optional}) {
        for (const std::string& k : *list) {
          if (k == prefix + "step") continue;
          const bool slot = list == &keys;
          if (slot && start_slots) {
            auto slot_it = given.find(k);
            if (slot_it != given.end()) {
              check(k, slot_it->second, p.shape(), ComputeDType(i), true);
            } else if (slots_given > 0) {
              problems.push_back("missing `" + k + "`");
            }
          } else if (given.count(k)) {
            problems.push_back("unexpected `" + k + "`: `" + prefix + "step` is 0 (never updated)");
          }
        }
      }
      continue;
    }
    for (const std::string& k : keys) {
      auto it = given.find(k);
      if (it == given.end()) {
        if (!slots_absent || k == prefix + "step") problems.push_back("missing `" + k + "`");
      } else if (k == prefix + "step") {
        check(k, it->second, {}, DType::kInt64, false);
        if (it->second.defined() && it->second.dtype() == DType::kInt64 && it->second.numel() == 1) {
          new_steps[i] = it->second.To(kCPU).data<int64_t>()[0];
          if (new_steps[i] < 0) problems.push_back("`" + k + "` is " + std::to_string(new_steps[i]) + ", expected >= 0");
          // The next Step counts one more: past the largest i64 the count
          // would wrap to a negative one (Adam's bias corrections then
          // inf), and a state saved after it would be refused.
          if (new_steps[i] == std::numeric_limits<int64_t>::max()) {
            problems.push_back("`" + k + "` is " + std::to_string(new_steps[i]) +
                               ", the largest i64: the next step's count would overflow");
          }
        }
      } else {
        check(k, it->second, p.shape(), ComputeDType(i), true);
      }
    }
    for (const std::string& k : optional) {
      auto it = given.find(k);
      const DType dtype = k == master_key ? DType::kFloat32 : ComputeDType(i);
      if (it != given.end()) check(k, it->second, p.shape(), dtype, true);
    }
  }
  for (const auto& [k, t] : given) {
    if (expected.count(k)) continue;
    // A step entry names a parameter of the saving optimizer.
    const bool names_param = k.rfind("state.", 0) == 0 && k.size() > 11 && k.compare(k.size() - 5, 5, ".step") == 0;
    problems.push_back("unexpected `" + k + "`" +
                       (names_param ? " (parameter `" + k.substr(6, k.size() - 11) + "` is not in this optimizer)"
                                    : std::string()));
  }
  if (!problems.empty()) {
    std::ostringstream os;
    os << Name() << ".LoadStateDict: " << problems.size() << " problem(s): ";
    for (size_t i = 0; i < problems.size(); ++i) os << (i ? "; " : "") << problems[i];
    throw std::invalid_argument(os.str());
  }
  return plan;
}

namespace {

// A loaded state tensor as `p`'s state holds it: on p's device in `dtype`,
// never aliasing the caller's tensor.
Tensor CopyForParameter(const Tensor& t, const Tensor& p, DType dtype) {
  Tensor moved = t.Detach().To(p.device());
  if (moved.dtype() != dtype) moved = moved.To(dtype);
  return moved.storage() == t.storage() ? moved.Clone() : moved.Contiguous();
}

}  // namespace

void Optimizer::LoadStateDict(const NamedTensors& state) {
  const LoadPlan plan = PlanLoad(state);
  const std::map<std::string, Tensor>& given = plan.given;
  const std::vector<int64_t>& new_steps = plan.steps;
  // Everything checked: now replace the options and the state.
  for (size_t k = 0; k < num_groups(); ++k) {
    if (!plan.options[k].empty()) SetHyperparameters(k, plan.options[k]);
    lrs_[k] = plan.lrs[k];
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    steps_[i] = new_steps[i];
    state_[i] = State();
    const std::string prefix = "state." + params_[i].first + ".";
    if (new_steps[i] == 0) {
      // Slots held from the start (StartSlotValues) as saved; from a state
      // without them, made from the loaded options when first needed.
      for (const std::string& s : slot_names_) {
        auto it = given.find(prefix + s);
        if (it != given.end()) state_[i].slots.push_back(CopyForParameter(it->second, params_[i].second, ComputeDType(i)));
      }
      continue;
    }
    // Copies on the parameter's device in the dtype the step computes in,
    // never aliasing the caller's tensors.
    const Tensor& p = params_[i].second;
    auto copy_to_device = [&p](const Tensor& t, DType dtype) { return CopyForParameter(t, p, dtype); };
    for (const std::string& s : slot_names_) {
      auto it = given.find(prefix + s);
      if (it != given.end()) state_[i].slots.push_back(copy_to_device(it->second, ComputeDType(i)));
    }
    auto m = given.find(prefix + "master");
    // Not known to agree with the parameter (which may be loaded before or
    // after this): the next step merges the two. Without one, that step
    // copies a master from the parameter.
    if (m != given.end() && Is16Bit(p.dtype())) state_[i].master = copy_to_device(m->second, DType::kFloat32);
  }
}

namespace internal {

Tensor GroupMembersTensor(const std::vector<std::string>& names) {
  std::string text;
  for (size_t i = 0; i < names.size(); ++i) text += (i ? "\n" : "") + names[i];
  return FromVectorOf<uint8_t>(std::vector<uint8_t>(text.begin(), text.end()), {static_cast<int64_t>(text.size())});
}

bool GroupMembersOf(const Tensor& t, std::vector<std::string>* names) {
  names->clear();
  if (!t.defined() || t.dtype() != DType::kUInt8 || t.dim() != 1) return false;
  const Tensor host = t.To(kCPU).Contiguous();
  const std::string text(host.data<uint8_t>(), host.data<uint8_t>() + host.numel());
  if (text.empty()) return true;
  size_t start = 0;
  while (true) {
    const size_t end = text.find('\n', start);
    names->push_back(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return true;
    start = end + 1;
  }
}

void CheckFiniteNonNegative(const char* who, std::initializer_list<std::pair<const char*, double>> options) {
  for (const auto& [name, x] : options) {
    // Written so that NaN fails it too.
    if (!(x >= 0) || !std::isfinite(x)) {
      throw std::invalid_argument(std::string(who) + ": " + name + " " + OptionValueText(x) +
                                  " must be finite and >= 0");
    }
  }
}

std::string OptionValueText(double value) {
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof(buf), value);
  return std::string(buf, result.ptr);
}

void CheckStateScalar(const char* who, const std::string& key, const Tensor* t, DType dtype) {
  // 0-d, as every StateDict writes it: a [1] or [1, 1] of the right dtype is
  // not what was saved, and taking it would hide a state built by hand wrong.
  if (t != nullptr && t->defined() && t->dtype() == dtype && t->shape() == Shape{}) return;
  const std::string type(DTypeName(dtype));
  if (t == nullptr) throw std::invalid_argument(std::string(who) + ": missing " + type + " scalar `" + key + "`");
  const std::string found = t->defined() ? std::string(DTypeName(t->dtype())) + " " + ShapeToString(t->shape())
                                         : std::string("undefined");
  throw std::invalid_argument(std::string(who) + ": `" + key + "` is " + found + ", expected an " + type + " scalar");
}

}  // namespace internal

}  // namespace ddp::nn::optim
