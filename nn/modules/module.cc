#include "nn/modules/module.h"

#include <algorithm>
#include <mutex>
#include <ostream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

namespace ddp::nn::modules {

std::atomic<uint64_t> Module::structure_version_{0};

Module::~Module() {
  for (auto& [name, child] : children_) {
    if (child) child->Unregister(this, nullptr);
  }
}

void Module::Unregister(const Module* parent, const std::string* name) {
  if (name != nullptr) {
    auto it = std::find_if(registrations_.begin(), registrations_.end(),
                           [&](const auto& r) { return r.first == parent && r.second == *name; });
    if (it != registrations_.end()) registrations_.erase(it);
  } else {
    registrations_.erase(std::remove_if(registrations_.begin(), registrations_.end(),
                                        [&](const auto& r) { return r.first == parent; }),
                         registrations_.end());
  }
  FollowFirstRegistration();
}

void Module::FollowFirstRegistration() {
  parent_ = registrations_.empty() ? nullptr : registrations_.front().first;
  name_ = registrations_.empty() ? std::string() : registrations_.front().second;
}

Tensor Module::Forward(const Tensor&) {
  throw std::logic_error(Describe() + " has no single-tensor Forward (call the vector form)");
}

std::vector<Tensor> Module::Forward(const std::vector<Tensor>& inputs) {
  if (inputs.size() != 1) {
    throw std::invalid_argument(Describe() + ": expected 1 input, got " + std::to_string(inputs.size()));
  }
  return {Forward(inputs[0])};
}

std::string Module::FullName() const {
  std::vector<const Module*> chain;
  for (const Module* m = this; m != nullptr && m->parent_ != nullptr; m = m->parent_) chain.push_back(m);
  std::string out;
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    if (!out.empty()) out += ".";
    out += (*it)->name_;
  }
  return out;
}

std::string Module::Describe() const {
  const std::string path = FullName();
  return path.empty() ? ShortRepr() : ShortRepr() + " `" + path + "`";
}

void Module::Fail(const std::string& message) const { throw std::invalid_argument(Describe() + ": " + message); }

void Module::CheckNewName(const std::string& name, const char* kind) const {
  if (name.empty() || name.find('.') != std::string::npos) {
    throw std::invalid_argument(Describe() + ": invalid " + kind + " name `" + name + "` (empty or contains '.')");
  }
  auto taken = [&](const auto& list) {
    return std::any_of(list.begin(), list.end(), [&](const auto& e) { return e.first == name; });
  };
  if (taken(params_) || taken(buffers_) || taken(children_)) {
    throw std::invalid_argument(Describe() + ": name `" + name + "` is already registered");
  }
}

namespace {

// Every tensor object that has been registered as a parameter, held weakly:
// what PyTorch's nn.Parameter type marks. The weak pointer tells a live
// entry from a dead tensor whose address was reused by a new one.
class ParameterMarks {
 public:
  static ParameterMarks& Get() {
    static ParameterMarks* marks = new ParameterMarks();  // never destroyed: modules may outlive statics
    return *marks;
  }
  bool IsMarked(const Tensor& t) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = marks_.find(t.impl());
    return it != marks_.end() && it->second.lock() == t.impl_ptr();
  }
  void Mark(const Tensor& t) {
    std::lock_guard<std::mutex> lock(mu_);
    marks_[t.impl()] = t.impl_ptr();
    // Sweep dead entries whenever the table has doubled since the last sweep.
    if (marks_.size() >= 2 * swept_size_) {
      for (auto e = marks_.begin(); e != marks_.end();) e = e->second.expired() ? marks_.erase(e) : std::next(e);
      swept_size_ = std::max<size_t>(marks_.size(), 64);
    }
  }

 private:
  std::mutex mu_;
  std::unordered_map<const TensorImpl*, std::weak_ptr<TensorImpl>> marks_;
  size_t swept_size_ = 64;
};

}  // namespace

Tensor Module::RegisterParameter(std::string name, Tensor value, std::optional<bool> requires_grad) {
  CheckNewName(name, "parameter");
  if (!value.defined()) throw std::invalid_argument(Describe() + ": parameter `" + name + "` is undefined");
  if (!value.is_leaf()) {
    // set_requires_grad(true) accepts a non-leaf (as PyTorch's), but an
    // optimizer stepping the output of an op would update nothing upstream.
    throw std::invalid_argument(Describe() + ": parameter `" + name +
                                "`: a non-leaf (the output of a recorded operation) cannot be a parameter; "
                                "register its Detach() instead");
  }
  if (requires_grad.has_value() || !ParameterMarks::Get().IsMarked(value)) {
    try {
      value.set_requires_grad(requires_grad.value_or(true));
    } catch (const std::exception& e) {
      // An integer tensor.
      throw std::invalid_argument(Describe() + ": parameter `" + name + "`: " + e.what());
    }
    ParameterMarks::Get().Mark(value);
  }
  params_.emplace_back(std::move(name), value);
  StructureChanged();
  return value;
}

Tensor Module::RegisterBuffer(std::string name, Tensor value, bool persistent) {
  CheckNewName(name, "buffer");
  if (!persistent) non_persistent_.push_back(name);
  buffers_.emplace_back(std::move(name), value);
  StructureChanged();
  return value;
}

bool Module::IsPersistentBuffer(const std::string& name) const {
  return std::find(non_persistent_.begin(), non_persistent_.end(), name) == non_persistent_.end();
}

bool Module::IsWithin(const Module* other) const {
  // Upwards over every registration: the modules whose subtrees hold this one.
  std::vector<const Module*> todo = {this};
  std::unordered_set<const Module*> seen;
  while (!todo.empty()) {
    const Module* m = todo.back();
    todo.pop_back();
    if (m == other) return true;
    if (!seen.insert(m).second) continue;
    for (const auto& [parent, name] : m->registrations_) todo.push_back(parent);
  }
  return false;
}

namespace {
[[noreturn]] void ThrowCycle(const Module& parent, const std::string& name, const Module& module) {
  throw std::invalid_argument(parent.Describe() + ": module `" + name + "` (" + module.ShortRepr() +
                              ") is this module or one of its ancestors; registered here it would contain "
                              "itself");
}
}  // namespace

void Module::RegisterModuleImpl(std::string name, std::shared_ptr<Module> module) {
  CheckNewName(name, "module");
  if (!module) throw std::invalid_argument(Describe() + ": module `" + name + "` is null");
  if (IsWithin(module.get())) ThrowCycle(*this, name, *module);
  module->registrations_.emplace_back(this, name);
  module->FollowFirstRegistration();
  children_.emplace_back(std::move(name), std::move(module));
  StructureChanged();
}

namespace {
void Collect(const NamedTensors& own, const std::string& prefix, NamedTensors* out,
             std::unordered_set<const TensorImpl*>* seen) {
  for (const auto& [name, t] : own) {
    if (!t.defined() || !seen->insert(t.impl()).second) continue;
    out->emplace_back(prefix + name, t);
  }
}
}  // namespace

void Module::CollectModules(const std::string& prefix, std::vector<std::pair<std::string, Module*>>* out,
                            std::unordered_set<const Module*>* seen) {
  // A module reached again (registered twice) is skipped with its subtree,
  // as PyTorch's named_modules does, so that nothing walks it twice. With
  // no `seen`, every path is listed (the state dict's walk).
  if (seen != nullptr && !seen->insert(this).second) return;
  out->emplace_back(prefix, this);
  for (auto& [name, child] : children_) {
    child->CollectModules(prefix.empty() ? name : prefix + "." + name, out, seen);
  }
}

std::vector<std::pair<std::string, Module*>> Module::NamedModules() {
  std::vector<std::pair<std::string, Module*>> out;
  std::unordered_set<const Module*> seen;
  CollectModules("", &out, &seen);
  return out;
}

NamedTensors Module::NamedParameters(bool recurse) const {
  NamedTensors out;
  std::unordered_set<const TensorImpl*> seen;
  if (!recurse) {
    Collect(params_, "", &out, &seen);
    return out;
  }
  for (auto& [path, m] : const_cast<Module*>(this)->NamedModules()) {
    Collect(m->params_, path.empty() ? "" : path + ".", &out, &seen);
  }
  return out;
}

std::vector<Tensor> Module::Parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [name, t] : NamedParameters(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::NamedBuffers(bool recurse) const {
  NamedTensors out;
  std::unordered_set<const TensorImpl*> seen;
  if (!recurse) {
    Collect(buffers_, "", &out, &seen);
    return out;
  }
  for (auto& [path, m] : const_cast<Module*>(this)->NamedModules()) {
    Collect(m->buffers_, path.empty() ? "" : path + ".", &out, &seen);
  }
  return out;
}

ChildList Module::NamedChildren() const {
  ChildList out;
  std::unordered_set<const Module*> seen;
  for (const auto& entry : children_) {
    if (seen.insert(entry.second.get()).second) out.entries_.push_back(&entry);
  }
  return out;
}

bool Module::HasChild(std::string_view name) const {
  for (const auto& [n, c] : children_) {
    if (n == name) return true;
  }
  return false;
}

std::shared_ptr<Module> Module::Child(std::string_view name) const {
  for (const auto& [n, c] : children_) {
    if (n == name) return c;
  }
  std::string names;
  for (const auto& [n, c] : children_) names += (names.empty() ? "" : ", ") + n;
  throw std::out_of_range(Describe() + " has no child `" + std::string(name) + "` (children: " +
                          (names.empty() ? "none" : names) + ")");
}

void Module::ThrowWrongChildType(std::string_view name) const {
  throw std::invalid_argument(Describe() + ": child `" + std::string(name) + "` is a " +
                              Child(name)->TypeName() + ", not the requested type");
}

void Module::ReplaceChild(std::string_view path, std::shared_ptr<Module> replacement) {
  if (!replacement) throw std::invalid_argument(Describe() + ": replacement for `" + std::string(path) + "` is null");
  // An empty segment ("a..b", ".a", "a.") names no child; walking past it
  // would replace some other module than the one written.
  if (path.empty() || path.front() == '.' || path.back() == '.' || path.find("..") != std::string_view::npos) {
    throw std::invalid_argument(Describe() + ": child path `" + std::string(path) +
                                "` is malformed (expected dot-separated, non-empty names)");
  }
  const size_t dot = path.rfind('.');
  Module* parent = this;
  std::string_view leaf = path;
  if (dot != std::string_view::npos) {
    std::string_view rest = path.substr(0, dot);
    leaf = path.substr(dot + 1);
    while (!rest.empty()) {
      const size_t d = rest.find('.');
      parent = parent->Child(rest.substr(0, d)).get();
      rest = d == std::string_view::npos ? std::string_view() : rest.substr(d + 1);
    }
  }
  for (auto& [n, c] : parent->children_) {
    if (n == leaf) {
      if (parent->IsWithin(replacement.get())) ThrowCycle(*parent, n, *replacement);
      // The replaced module may still be registered elsewhere (another
      // index of a Sequential, another parent): it follows that registration.
      if (c) c->Unregister(parent, &n);
      replacement->registrations_.emplace_back(parent, n);
      replacement->FollowFirstRegistration();
      c = std::move(replacement);
      StructureChanged();
      return;
    }
  }
  parent->Child(leaf);  // throws, listing the children
}

bool Module::MayBeAbsentFromState(const std::string&) const { return false; }

StateDict Module::LiveState(std::vector<bool>* optional) const {
  // Unlike the parameter list, every name: a weight shared by two modules
  // (tied) appears under both, as in PyTorch's state_dict, so a checkpoint
  // names every entry a model has and loads strictly into either layout.
  // Likewise a module registered twice is listed under both paths.
  std::vector<std::pair<std::string, Module*>> modules;
  const_cast<Module*>(this)->CollectModules("", &modules, nullptr);
  StateDict out;
  for (auto& [path, m] : modules) {
    const std::string prefix = path.empty() ? "" : path + ".";
    for (const auto& [name, t] : m->params_) {
      if (!t.defined()) continue;
      out.emplace_back(prefix + name, t);
      if (optional != nullptr) optional->push_back(m->MayBeAbsentFromState(name));
    }
    for (const auto& [name, t] : m->buffers_) {
      if (!t.defined() || !m->IsPersistentBuffer(name)) continue;
      out.emplace_back(prefix + name, t);
      if (optional != nullptr) optional->push_back(m->MayBeAbsentFromState(name));
    }
  }
  return out;
}

StateDict Module::GetStateDict() const {
  // Detached, as PyTorch's state_dict: a caller writing into an entry (a
  // checkpoint loader, a test) needs no NoGradGuard and cannot reach the
  // parameter's .grad or graph. One handle per tensor, so the names of a
  // tied weight still hold the same object.
  StateDict out = LiveState();
  std::unordered_map<const TensorImpl*, Tensor> detached;
  for (auto& [name, t] : out) {
    auto [it, inserted] = detached.try_emplace(t.impl());
    if (inserted) it->second = t.Detach();
    t = it->second;
  }
  return out;
}

namespace {

// LoadStateDict's checks: the (destination, source) pairs it copies, or
// throws listing every offender. `keys` receives the missing and unexpected
// names in either mode (in strict mode they are also errors).
// `mine` is the module's live state (its parameters and persistent buffers),
// `optional` which of its entries may be absent (they keep their values).
std::vector<std::pair<Tensor, Tensor>> PlanLoad(const Module& module, const StateDict& mine,
                                                const std::vector<bool>& optional, const StateDict& state,
                                                bool strict, IncompatibleKeys& keys) {
  std::vector<std::string> missing, unexpected, mismatched, duplicated;
  std::vector<std::pair<Tensor, Tensor>> copies;  // (destination, source)
  // A key given twice is an error in either mode: only one of its values
  // could be loaded, and which one the caller meant cannot be known.
  std::set<std::string> given_names;
  for (const auto& [name, t] : state) {
    if (!given_names.insert(name).second &&
        std::find(duplicated.begin(), duplicated.end(), name) == duplicated.end()) {
      duplicated.push_back(name);
    }
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    const auto& [name, dst] = mine[i];
    auto it = std::find_if(state.begin(), state.end(), [&](const auto& e) { return e.first == name; });
    if (it == state.end()) {
      if (!optional[i]) keys.missing.push_back(name);
      continue;
    }
    const Tensor& src = it->second;
    // As PyTorch, which checks shapes only and copies with copy_: CopyFrom
    // converts the dtype (an f32 checkpoint into a model made bf16 by To).
    // Unlike PyTorch, floating values are not cast into an integer tensor nor
    // integers into a floating one: that pairing means a wrong checkpoint
    // far more often than a wanted conversion, and a cast would hide it.
    const bool kinds_differ = src.defined() && IsFloating(src.dtype()) != IsFloating(dst.dtype());
    if (!src.defined() || src.shape() != dst.shape() || kinds_differ) {
      mismatched.push_back("`" + name + "`: expected " + ShapeToString(dst.shape()) + " " +
                           std::string(DTypeName(dst.dtype())) + ", got " +
                           (src.defined() ? ShapeToString(src.shape()) + " " + std::string(DTypeName(src.dtype()))
                                          : std::string("undefined")) +
                           (kinds_differ ? " (floating and integer values are not converted into each other)" : ""));
      continue;
    }
    copies.emplace_back(dst, src);
  }
  std::set<std::string> mine_names;
  for (const auto& [name, t] : mine) mine_names.insert(name);
  for (const auto& [name, t] : state) {
    const bool listed = std::find(keys.unexpected.begin(), keys.unexpected.end(), name) != keys.unexpected.end();
    if (!mine_names.count(name) && !listed) keys.unexpected.push_back(name);
  }
  if (strict) {
    missing = keys.missing;
    unexpected = keys.unexpected;
  }
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty() || !duplicated.empty()) {
    std::string msg = "LoadStateDict into " + (module.FullName().empty() ? module.ShortRepr() : module.Describe()) +
                      " failed:";
    // Key lists are quoted here; the mismatches arrive quoted already. (Told
    // apart by the list, not by a leading '`': a key may be empty or begin
    // with one.)
    auto list = [&msg](const char* what, const std::vector<std::string>& v, bool quote) {
      if (v.empty()) return;
      msg += std::string("\n  ") + what + " (" + std::to_string(v.size()) + "):";
      for (const auto& s : v) msg += " " + (quote ? "`" + s + "`" : s) + ";";
    };
    list("missing keys", missing, true);
    list("unexpected keys", unexpected, true);
    list("shape or dtype mismatches", mismatched, false);
    list("duplicate keys", duplicated, true);
    throw std::invalid_argument(msg);
  }
  return copies;
}

}  // namespace

IncompatibleKeys Module::CheckStateDict(const StateDict& state, bool strict) const {
  IncompatibleKeys keys;
  std::vector<bool> optional;
  const StateDict mine = LiveState(&optional);
  PlanLoad(*this, mine, optional, state, strict, keys);
  return keys;
}

IncompatibleKeys Module::LoadStateDict(const StateDict& state, bool strict) {
  IncompatibleKeys keys;
  std::vector<bool> optional;
  const StateDict mine = LiveState(&optional);
  std::vector<std::pair<Tensor, Tensor>> copies = PlanLoad(*this, mine, optional, state, strict, keys);
  NoGradGuard guard;
  for (auto& [dst, src] : copies) dst.CopyFrom(src);
  return keys;
}

void Module::Train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->Train(on);
}

void Module::ZeroGrad(bool set_to_none) {
  for (const Tensor& p : Parameters()) ZeroGradOf(p, set_to_none);
}

void Module::Apply(const std::function<void(Module&)>& fn) {
  std::unordered_set<const Module*> seen;
  ApplyOnce(fn, &seen);
}

void Module::ApplyOnce(const std::function<void(Module&)>& fn, std::unordered_set<const Module*>* seen) {
  // Once per module over the whole tree: an in-place initialization applied
  // to a layer registered twice must not run twice. (PyTorch's apply skips a
  // child listed twice by one parent only, and would visit a module shared by
  // two different parents twice.)
  if (!seen->insert(this).second) return;
  for (auto& [name, child] : children_) child->ApplyOnce(fn, seen);
  fn(*this);
}

namespace {
void Convert(const Tensor& t, const std::function<Tensor(const Tensor&)>& f) {
  if (!t.defined()) return;
  NoGradGuard guard;
  const Tensor converted = f(t.Detach());
  if (!converted.is_same(t)) t.SetData(converted);
  if (t.grad().defined()) {
    const Tensor g = f(t.grad().Detach());
    t.grad().SetData(g);
  }
}
}  // namespace

void Module::To(Device device) {
  for (auto& [path, m] : NamedModules()) {
    for (auto& [n, t] : m->params_) Convert(t, [&](const Tensor& x) { return x.To(device); });
    for (auto& [n, t] : m->buffers_) Convert(t, [&](const Tensor& x) { return x.To(device); });
  }
}

void Module::To(DType dtype) {
  if (!IsFloating(dtype)) throw std::invalid_argument(Describe() + ": To() needs a floating dtype");
  auto f = [dtype](const Tensor& x) { return IsFloating(x.dtype()) ? x.To(dtype) : x; };
  for (auto& [path, m] : NamedModules()) {
    for (auto& [n, t] : m->params_) Convert(t, f);
    for (auto& [n, t] : m->buffers_) Convert(t, f);
  }
}

namespace {
// Indents every line but the first by `spaces` (PyTorch's _addindent).
std::string AddIndent(const std::string& s, int spaces) {
  std::string out;
  for (char c : s) {
    out += c;
    if (c == '\n') out += std::string(spaces, ' ');
  }
  return out;
}
}  // namespace

std::string Module::ToString() const {
  std::vector<std::string> lines;
  const std::string extra = ExtraRepr();
  size_t extra_lines = 0;
  if (!extra.empty()) {
    std::stringstream ss(extra);
    std::string line;
    while (std::getline(ss, line)) {
      lines.push_back(line);
      ++extra_lines;
    }
  }
  for (const auto& [name, child] : children_) lines.push_back("(" + name + "): " + AddIndent(child->ToString(), 2));
  std::string out = TypeName() + "(";
  if (!lines.empty()) {
    if (extra_lines == 1 && children_.empty()) {
      out += lines[0];
    } else {
      out += "\n";
      for (const auto& l : lines) out += "  " + l + "\n";
    }
  }
  return out + ")";
}

std::ostream& operator<<(std::ostream& os, const Module& m) { return os << m.ToString(); }

}  // namespace ddp::nn::modules
