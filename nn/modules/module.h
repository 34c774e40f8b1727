// Module: the unit models are built from. A module creates its parameters,
// buffers and children in one place and registers each under a name
// (RegisterParameter / RegisterBuffer / RegisterModule); everything else
// derives from that registry in a deterministic order: pre-order over the
// module tree, each module's entries in registration order, dotted names
// ("layer1.0.conv1.weight"), as PyTorch names them. DDP's buckets and
// checkpoints depend on that order.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

#include "nn/tensor/tensor.h"

namespace ddp::nn::modules {

/// An ordered list of named tensors (parameters, buffers, a state dict).
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
/// Parameters then buffers of each module, pre-order, dotted names.
using StateDict = NamedTensors;

/// What LoadStateDict and CheckStateDict report, as PyTorch's
/// load_state_dict returns them: the module's keys absent from the state
/// (`missing`) and the state's keys the module lacks (`unexpected`), each in
/// order and once. Filled in both modes; after a strict call that returned
/// (rather than threw), both are empty.
struct IncompatibleKeys {
  std::vector<std::string> missing;
  std::vector<std::string> unexpected;
};

class Module;

/// A read-only list of (name, child) entries of a module's registry. The
/// entries are references into the registry, not copies: reading a child's
/// use_count through one counts the registry's owners only. Valid until
/// that module's next RegisterModule or ReplaceChild.
class ChildList {
 public:
  using Entry = std::pair<std::string, std::shared_ptr<Module>>;
  class Iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = Entry;
    using difference_type = std::ptrdiff_t;
    using pointer = const Entry*;
    using reference = const Entry&;
    explicit Iterator(const Entry* const* at) : at_(at) {}
    const Entry& operator*() const { return **at_; }
    const Entry* operator->() const { return *at_; }
    Iterator& operator++() {
      ++at_;
      return *this;
    }
    bool operator==(const Iterator& other) const { return at_ == other.at_; }
    bool operator!=(const Iterator& other) const { return at_ != other.at_; }

   private:
    const Entry* const* at_;
  };
  Iterator begin() const { return Iterator(entries_.data()); }
  Iterator end() const { return Iterator(entries_.data() + entries_.size()); }
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  const Entry& operator[](size_t i) const { return *entries_.at(i); }

 private:
  friend class Module;
  std::vector<const Entry*> entries_;
};

class Module {
 public:
  Module() = default;
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// The computation on one tensor (what Sequential chains). The default
  /// throws: modules with several inputs override the vector form instead.
  virtual Tensor Forward(const Tensor& input);
  /// Several tensors in and out; the default runs Forward on a single input.
  virtual std::vector<Tensor> Forward(const std::vector<Tensor>& inputs);
  /// Forward on an input the caller gives up (Sequential passes its
  /// intermediate results this way). A module may then reuse the input's
  /// memory when nothing else refers to it (ReLU does); the default calls Forward.
  virtual Tensor ForwardOwned(Tensor input) { return Forward(input); }
  Tensor operator()(const Tensor& input) { return Forward(input); }

  /// Class name as printed: "Linear", "BatchNorm2d".
  virtual std::string TypeName() const = 0;
  /// The part inside the parentheses of the printed form ("in_features=784, ...").
  virtual std::string ExtraRepr() const { return ""; }
  /// Short description for error messages: "Linear(784->512)".
  virtual std::string ShortRepr() const { return TypeName(); }
  /// ShortRepr plus the dotted path in the tree: "Linear(784->512) `0`" (no path for a root).
  std::string Describe() const;

  /// Name under the parent ("" for a root). A module registered under
  /// several names (Sequential{l, relu, l}, or shared by two parents) takes
  /// the earliest registration still in place, as NamedModules lists it
  /// under its first path; when that one is replaced or its parent dies, the
  /// next one.
  const std::string& name() const { return name_; }
  /// Dotted path from the root ("layer1.0.conv1"; "" for a root), along
  /// the registrations name() follows.
  std::string FullName() const;

  // --- registry views (pre-order, registration order, shared tensors listed once) ---
  NamedTensors NamedParameters(bool recurse = true) const;
  std::vector<Tensor> Parameters(bool recurse = true) const;
  NamedTensors NamedBuffers(bool recurse = true) const;
  /// The direct children, each module once, under the first name this
  /// module registers it by, in registration order: as PyTorch's
  /// named_children, a module registered twice (Sequential{l, relu, l})
  /// is listed once ("0" and "1"). The list is returned by value, and its
  /// iterators live only as long as it does: use it in a range-for, or keep
  /// it in a variable first (begin() and end() of two NamedChildren() calls,
  /// or an iterator kept past the full expression, dangle).
  ChildList NamedChildren() const;
  /// Every registration of a child, repeats included ("0", "1" and "2" of
  /// Sequential{l, relu, l}), in registration order: the slots a Forward
  /// runs through and ReplaceChild replaces (PyTorch's _modules).
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& ChildSlots() const { return children_; }
  /// Every module of the tree with its dotted path, this one first (path ""),
  /// pre-order. A module registered under several names (Sequential{l, relu,
  /// l}) is listed once, under the first, as PyTorch's named_modules.
  std::vector<std::pair<std::string, Module*>> NamedModules();
  /// True when a direct child is registered under `name`.
  bool HasChild(std::string_view name) const;
  /// The direct child `name`; throws listing the children when absent.
  std::shared_ptr<Module> Child(std::string_view name) const;
  /// Child(name) cast to M; throws when it is of another type.
  template <class M>
  std::shared_ptr<M> ChildAs(std::string_view name) const {
    auto m = std::dynamic_pointer_cast<M>(Child(name));
    if (!m) ThrowWrongChildType(name);
    return m;
  }
  /// Replaces the module at dotted `path` (e.g. "layer1.0.bn1") by
  /// `replacement`; the parent's Forward uses the new one from then on.
  /// Throws std::invalid_argument, changing nothing, when `replacement` is
  /// the parent of that path or one of its ancestors (the tree would become
  /// a cycle, as RegisterModule refuses).
  void ReplaceChild(std::string_view path, std::shared_ptr<Module> replacement);
  /// A process-wide count of registry changes, in any module: one more at
  /// every RegisterParameter, RegisterBuffer, RegisterModule and
  /// ReplaceChild. Unchanged since a reading, no module of the process got
  /// a parameter, buffer or child since (DDP compares it at each forward,
  /// so that it walks the model only after a change).
  static uint64_t StructureVersion() { return structure_version_.load(std::memory_order_relaxed); }

  // --- state ---
  /// Parameters and persistent buffers in state-dict order. As PyTorch's
  /// state_dict, each entry is a detached handle on the module's memory: it
  /// requires no grad and has no .grad, so writing into it (CopyFrom, Fill)
  /// changes the module, and it is not the parameter object itself. A tensor
  /// registered under several names (a tied weight) is listed under each,
  /// all names holding one handle; NamedParameters and NamedBuffers list it
  /// once.
  StateDict GetStateDict() const;
  /// Copies values into the module's parameters and buffers. Strict: every
  /// key of the module must be present and no other; shapes must match.
  /// Values are converted to the tensor's dtype, as PyTorch's copy_ (an f32
  /// checkpoint loads into a bf16 model), except between floating and
  /// integer types, which is an error. All offenders are listed in one
  /// error, and nothing is changed unless everything matches. Not strict:
  /// only matching names are copied, and shape or floating/integer
  /// mismatches are still errors. A key given more than once is an error in
  /// both modes. Returns the missing and unexpected keys (skipped when not
  /// strict).
  IncompatibleKeys LoadStateDict(const StateDict& state, bool strict = true);
  /// The checks of LoadStateDict alone: throws its error for a state it
  /// would refuse, and copies nothing (to check every part of a checkpoint
  /// before loading any).
  /// Returns what LoadStateDict would return.
  IncompatibleKeys CheckStateDict(const StateDict& state, bool strict = true) const;

  /// Sets training mode on this module and every descendant.
  void Train(bool on = true);
  void Eval() { Train(false); }
  bool is_training() const { return training_; }
  /// Drops every parameter's .grad (set_to_none, the default as in PyTorch
  /// 2.x; PyTorch 1.13 zeroes by default) or zeroes it in place (keeping the
  /// memory, e.g. a DDP bucket view).
  void ZeroGrad(bool set_to_none = true);
  /// Calls fn on every descendant (children first, depth first), then on
  /// this module; a module registered more than once is visited once, where
  /// it is first reached.
  void Apply(const std::function<void(Module&)>& fn);
  /// Moves parameters, their gradients and buffers to `device` in place (handles stay valid).
  void To(Device device);
  /// Converts floating parameters, gradients and buffers to `dtype` in place.
  void To(DType dtype);

  /// The tree as PyTorch prints it.
  std::string ToString() const;

 protected:
  /// Sets this module's own training flag, leaving its descendants' modes
  /// as they are (a wrapper that follows the mode of the module it wraps).
  void SetOwnTrainingFlag(bool on) { training_ = on; }
  /// Registers a parameter and returns its handle, with requires_grad as
  /// given. Left out, a tensor registered as a parameter for the first time
  /// gets true, and one that has been a parameter before (of any module,
  /// still alive or not: a tied weight) keeps its own flag, as registering
  /// an existing nn.Parameter in PyTorch does: tying a weight to a frozen
  /// one does not unfreeze it.
  Tensor RegisterParameter(std::string name, Tensor value, std::optional<bool> requires_grad = std::nullopt);
  /// Registers a buffer (state that is not trained, e.g. running
  /// statistics). A persistent buffer is part of GetStateDict and
  /// LoadStateDict; a non-persistent one (PyTorch's persistent=False) is
  /// not, but is listed by NamedBuffers, so To() moves it and DDP
  /// broadcasts it.
  Tensor RegisterBuffer(std::string name, Tensor value, bool persistent = true);
  /// Registers a child module and returns it. Throws std::invalid_argument
  /// when `module` is this module or one of its ancestors: every walk of the
  /// tree (Train, GetStateDict, ToString) would follow the cycle without end.
  template <class M>
  std::shared_ptr<M> RegisterModule(std::string name, std::shared_ptr<M> module) {
    RegisterModuleImpl(std::move(name), module);
    return module;
  }
  /// Throws "<Describe()>: <message>" (for shape errors in Forward).
  [[noreturn]] void Fail(const std::string& message) const;
  /// Whether the state entry `name` of this module (a parameter or buffer
  /// name, without the module's path) may be absent from a state that
  /// LoadStateDict takes: it then keeps its value and is not reported as
  /// missing. False by default; BatchNorm's num_batches_tracked, which older
  /// checkpoints and many exported weight files lack, as in PyTorch.
  virtual bool MayBeAbsentFromState(const std::string& name) const;

 private:
  void RegisterModuleImpl(std::string name, std::shared_ptr<Module> module);
  // Drops this module's registration under `name` in `parent` (every one of
  // `parent`'s when name is null) and follows the earliest one left.
  void Unregister(const Module* parent, const std::string* name);
  void FollowFirstRegistration();
  void CheckNewName(const std::string& name, const char* kind) const;
  // Whether this module is `other` or lies below it along any registration:
  // registering `other` under this module would then make the tree a cycle.
  bool IsWithin(const Module* other) const;
  void CollectModules(const std::string& prefix, std::vector<std::pair<std::string, Module*>>* out,
                      std::unordered_set<const Module*>* seen);
  void ApplyOnce(const std::function<void(Module&)>& fn, std::unordered_set<const Module*>* seen);
  // The live (parameter, persistent buffer) entries of the state dict, in
  // its order; `optional`, when given, gets whether each entry's module lets
  // it be absent from a loaded state (MayBeAbsentFromState).
  StateDict LiveState(std::vector<bool>* optional = nullptr) const;
  bool IsPersistentBuffer(const std::string& name) const;
  [[noreturn]] void ThrowWrongChildType(std::string_view name) const;

  static void StructureChanged() { structure_version_.fetch_add(1, std::memory_order_relaxed); }
  static std::atomic<uint64_t> structure_version_;

  // name_ and parent_ follow registrations_.front() (""/null when empty).
  std::string name_;
  Module* parent_ = nullptr;
  // Every (parent, name) this module is registered under, oldest first;
  // entries are dropped when replaced or when the parent dies.
  std::vector<std::pair<Module*, std::string>> registrations_;
  bool training_ = true;
  NamedTensors params_;
  NamedTensors buffers_;
  std::vector<std::string> non_persistent_;  // names of buffers_ left out of the state dict
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

std::ostream& operator<<(std::ostream& os, const Module& m);

}  // namespace ddp::nn::modules
