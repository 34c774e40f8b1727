#include "nn/autograd/node.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "nn/ops/dispatch.h"

namespace ddp::nn::autograd {

namespace {
std::atomic<uint64_t> g_next_sequence_nr{0};
std::string NodeName(const Node& n) { return n.name(); }
std::shared_ptr<NodeGradHooks> MutableGradHooksOf(Node& n) { return n.MutableGradHooks(); }
// "[2, 3] f32 on cpu", for messages about a leaf and its .grad.
std::string Describe(const Tensor& t) {
  return ShapeToString(t.shape()) + " " + std::string(DTypeName(t.dtype())) + " on " + t.device().ToString();
}
}  // namespace

Node::Node() : sequence_nr_(g_next_sequence_nr.fetch_add(1, std::memory_order_relaxed)) {
  // Every graph starts with a node, so this is the place to let printing
  // name grad_fn and RegisterHook reach a node's hook list (the tensor
  // library cannot see Node).
  static const bool registered =
      (detail::SetGradFnNamer(&NodeName), detail::SetNodeGradHooksGetter(&MutableGradHooksOf), true);
  (void)registered;
}

namespace {
// The nodes a ~Node running further up this thread's stack will free (null
// when none is running).
thread_local std::vector<std::shared_ptr<Node>>* g_nodes_to_free = nullptr;
}  // namespace

Node::~Node() {
  // Each node owns its inputs' nodes through next_edges_, so the default
  // destructor frees a chain by recursion, one set of frames per node: a
  // graph of ~100k nodes overflows an 8 MiB stack. Instead, the outermost
  // ~Node on a thread frees the chain from a loop, and a ~Node it causes
  // hands its edges to that loop rather than freeing them itself. Every
  // node still dies through its shared_ptr, when its last owner lets go.
  if (g_nodes_to_free != nullptr) {
    for (Edge& e : next_edges_) {
      if (e.fn) g_nodes_to_free->push_back(std::move(e.fn));
    }
    return;
  }
  std::vector<std::shared_ptr<Node>> pending;
  for (Edge& e : next_edges_) {
    if (e.fn) pending.push_back(std::move(e.fn));
  }
  g_nodes_to_free = &pending;
  while (!pending.empty()) {
    std::shared_ptr<Node> n = std::move(pending.back());
    pending.pop_back();
    n.reset();  // when it was the last owner, its ~Node adds its edges to pending
  }
  g_nodes_to_free = nullptr;
}

void Node::AddOutput(const Tensor& output) { outputs_.push_back(output.impl_ptr()); }

Tensor Node::LiveOutput(uint32_t nr) const {
  if (nr >= outputs_.size()) return Tensor();
  return Tensor(outputs_[nr].lock());
}

std::shared_ptr<NodeGradHooks> Node::MutableGradHooks() {
  std::lock_guard<std::mutex> lock(grad_hooks_mu_);
  if (!grad_hooks_) {
    grad_hooks_ = std::make_shared<NodeGradHooks>();
    // Made after the release (no hook was registered before it): marked
    // so that RegisterHook refuses, as for a list the release emptied.
    grad_hooks_->released = hooks_released_;
  }
  return grad_hooks_;
}

bool Node::HooksReleased() const {
  std::lock_guard<std::mutex> lock(grad_hooks_mu_);
  return hooks_released_;
}

std::shared_ptr<NodeGradHooks> Node::grad_hooks() const {
  std::lock_guard<std::mutex> lock(grad_hooks_mu_);
  return grad_hooks_;
}

std::vector<NodeGradHooks::Entry> Node::ReleaseGradHooks() {
  std::lock_guard<std::mutex> lock(grad_hooks_mu_);
  hooks_released_ = true;
  std::vector<NodeGradHooks::Entry> released;
  if (!grad_hooks_) return released;
  {
    std::lock_guard<std::mutex> list_lock(grad_hooks_->mu);
    released.swap(grad_hooks_->hooks);
    grad_hooks_->released = true;
  }
  for (const NodeGradHooks::Entry& e : released) {
    if (std::find(released_hook_outputs_.begin(), released_hook_outputs_.end(), e.output_nr) ==
        released_hook_outputs_.end()) {
      released_hook_outputs_.push_back(e.output_nr);
    }
  }
  return released;
}

std::optional<HookHandle> RegisterHookIfLive(const Tensor& tensor, GradHook fn) {
  if (!tensor.defined() || tensor.grad_fn() == nullptr) {
    throw std::invalid_argument(std::string("RegisterHookIfLive: the tensor is ") +
                                (tensor.defined() ? "a leaf (" + Describe(tensor) + ")" : "undefined") +
                                ", not the output of a recorded node: use Tensor::RegisterHook");
  }
  if (!fn) throw std::invalid_argument("RegisterHookIfLive: the hook for " + Describe(tensor) + " is empty");
  const std::shared_ptr<NodeGradHooks> list = tensor.grad_fn()->MutableGradHooks();
  std::lock_guard<std::mutex> lock(list->mu);
  // ReleaseGradHooks sets `released` under this lock (and a list made after
  // the release starts with it set): a hook is either released with the
  // others or never registered.
  if (list->released) return std::nullopt;
  const uint64_t id = list->next_id++;
  list->hooks.push_back({id, tensor.output_nr(), std::move(fn)});
  return HookHandle(std::weak_ptr<NodeGradHooks>(list), id);
}

bool Node::GradHooksReleased(uint32_t output_nr) const {
  std::lock_guard<std::mutex> lock(grad_hooks_mu_);
  return std::find(released_hook_outputs_.begin(), released_hook_outputs_.end(), output_nr) !=
         released_hook_outputs_.end();
}

AccumulateGrad::AccumulateGrad(std::shared_ptr<TensorImpl> variable) : variable_(std::move(variable)) {
  // Leaf accumulation runs the moment it is ready, before any other ready node.
  sequence_nr_ = std::numeric_limits<uint64_t>::max();
}

std::vector<Tensor> AccumulateGrad::Apply(std::vector<Tensor>&& grad_outputs) {
  Tensor g = std::move(grad_outputs[0]);
  if (!g.defined()) return {};
  // The engine holds mutex() here: backward passes on two threads that
  // reach this leaf update .grad and run its hooks one at a time.
  const Tensor var(variable_);
  // Frozen after the forward (requires_grad turned off before backward):
  // no gradient and no post-accumulate hooks, so DDP does not reduce it, as
  // PyTorch's AccumulateGrad::apply returns early.
  if (!var.requires_grad()) return {};
  g = RunGradHooks(var, std::move(g), [&var] { return "the leaf " + Describe(var); });
  if (g.shape() != var.shape()) {
    throw std::logic_error("gradient of shape " + ShapeToString(g.shape()) + " for a leaf of shape " +
                           ShapeToString(var.shape()));
  }
  // A graph recorded on one device and a leaf moved to another since (To()
  // after the forward): PyTorch refuses this in its engine's output checks.
  // Taking the gradient would put .grad on the wrong device, and adding it
  // to an existing .grad would read device memory on the host.
  if (g.device() != var.device()) {
    throw std::invalid_argument("gradient " + ShapeToString(g.shape()) + " on " + g.device().ToString() +
                                " for a leaf on " + var.device().ToString() +
                                " (was the leaf moved with To() after the forward that recorded this graph?)");
  }
  if (g.dtype() != var.dtype()) g = g.To(var.dtype());
  AutogradMeta& meta = variable_->mutable_autograd();
  if (!meta.grad.defined()) {
    // Take the incoming buffer when nobody else can see it; otherwise copy,
    // so that a later in-place accumulation cannot write into someone else's tensor.
    // Taken detached: a hook that ran with grad mode on may have returned
    // a gradient with a history, which .grad must not record into or keep
    // alive (the copy, made with grad mode off, has none).
    const bool exclusive = g.is_contiguous() && g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 &&
                           g.storage_offset() == 0;
    meta.grad = exclusive ? (g.requires_grad() ? g.Detach() : g) : g.Clone();
  } else {
    // SetData may have given the leaf another shape, dtype or device since
    // .grad was made. Adding into that .grad would then cover only part of
    // the gradient, write past the end of its buffer, or read device memory
    // on the host, so it is refused, as PyTorch refuses it.
    if (meta.grad.shape() != g.shape() || meta.grad.dtype() != g.dtype() || meta.grad.device() != g.device()) {
      throw std::invalid_argument("the leaf's .grad " + Describe(meta.grad) + " does not match its data " +
                                  Describe(var) +
                                  " (was the data replaced with SetData?); clear the .grad first "
                                  "(ZeroGradOf(leaf, /*set_to_none=*/true) or set_grad(Tensor()))");
    }
    DDP_KERNEL(meta.grad.device(), add_scaled_)(meta.grad, g, 1.0);
    meta.grad.storage()->BumpVersion();
  }
  // Copied under hooks_mu and run without it: a hook may remove itself (or
  // others), and another thread may register or remove hooks meanwhile. One
  // removed before its turn does not run (what it captured may be gone with
  // its owner).
  std::vector<std::pair<uint64_t, PostAccumulateGradHook>> hooks;
  {
    std::lock_guard<std::mutex> lock(meta.hooks_mu);
    hooks = meta.post_accumulate_hooks;
  }
  for (const auto& [id, hook] : hooks) {
    bool removed;
    {
      std::lock_guard<std::mutex> lock(meta.hooks_mu);
      const auto& live = meta.post_accumulate_hooks;
      removed = std::none_of(live.begin(), live.end(), [id = id](const auto& h) { return h.first == id; });
    }
    if (!removed) hook(var);
  }
  return {};
}

SavedTensor::SavedTensor(const Tensor& t) {
  if (!t.defined()) return;
  data_ = t.Detach();
  if (t.grad_fn()) {
    origin_node_ = t.grad_fn();
    origin_nr_ = t.output_nr();
  } else if (t.requires_grad()) {
    origin_leaf_ = true;
  }
  version_ = t.storage()->version();
  was_defined_ = true;
}

Tensor SavedTensor::Get() const {
  if (!was_defined_) return Tensor();
  if (released_) {
    throw std::logic_error("tried to run backward through the graph a second time (its saved tensors were "
                           "released; pass retain_graph = true to the first Backward)");
  }
  const uint64_t now = data_.storage()->version();
  if (now != version_) {
    std::string origin;
    if (const std::shared_ptr<Node> node = origin_node_.lock()) {
      origin = ", output " + std::to_string(origin_nr_) + " of " + node->name();
    } else if (origin_leaf_) {
      origin = ", a leaf that requires grad";
    }
    throw std::logic_error("a tensor saved for backward (" + Describe(data_) + origin +
                           ") was modified in place after it was saved: its memory is at version " +
                           std::to_string(now) + ", it was at version " + std::to_string(version_) +
                           " when saved");
  }
  read_ = true;
  return data_;
}

namespace {
thread_local uint64_t g_saved_tensors_released = 0;
}  // namespace

uint64_t SavedTensor::ReleasedAfterReadOnThisThread() { return g_saved_tensors_released; }

void SavedTensor::Release() {
  if (!was_defined_) return;
  if (!released_ && read_) ++g_saved_tensors_released;
  data_ = Tensor();
  origin_node_.reset();
  released_ = true;
}

namespace {

// Runs `hooks` (a copy of a list taken under its lock) in order on grad,
// skipping those `still_registered` (which takes the lock) says were removed
// since the copy: what a removed hook captured may be gone with its owner.
Tensor ChainGradHooks(const std::vector<std::pair<uint64_t, GradHook>>& hooks,
                      const std::function<bool(uint64_t)>& still_registered, Tensor grad,
                      const std::function<std::string()>& what) {
  for (const auto& [id, hook] : hooks) {
    if (!still_registered(id)) continue;
    Tensor replacement = hook(grad);
    if (!replacement.defined()) continue;
    if (replacement.shape() != grad.shape() || replacement.dtype() != grad.dtype() ||
        replacement.device() != grad.device()) {
      throw std::invalid_argument("a gradient hook on " + what() + " returned a gradient " + Describe(replacement) +
                                  " for a gradient " + Describe(grad) +
                                  " (a hook must keep the gradient's shape, dtype and device)");
    }
    grad = std::move(replacement);
  }
  return grad;
}

}  // namespace

Tensor RunGradHooks(const Tensor& tensor, Tensor grad, const std::function<std::string()>& what) {
  AutogradMeta* meta = tensor.impl()->autograd();
  if (meta == nullptr) return grad;
  // Copied under hooks_mu and run without it, as the post-accumulate hooks.
  std::vector<std::pair<uint64_t, GradHook>> hooks;
  {
    std::lock_guard<std::mutex> lock(meta->hooks_mu);
    if (meta->grad_hooks.empty()) return grad;
    hooks = meta->grad_hooks;
  }
  const auto still_registered = [meta](uint64_t id) {
    std::lock_guard<std::mutex> lock(meta->hooks_mu);
    const auto& live = meta->grad_hooks;
    return std::any_of(live.begin(), live.end(), [id](const auto& h) { return h.first == id; });
  };
  return ChainGradHooks(hooks, still_registered, std::move(grad), what);
}

Tensor RunGradHooks(NodeGradHooks& list, uint32_t output_nr, Tensor grad,
                    const std::function<std::string()>& what) {
  std::vector<std::pair<uint64_t, GradHook>> hooks;
  {
    std::lock_guard<std::mutex> lock(list.mu);
    for (const NodeGradHooks::Entry& e : list.hooks) {
      if (e.output_nr == output_nr) hooks.emplace_back(e.id, e.fn);
    }
  }
  if (hooks.empty()) return grad;
  const auto still_registered = [&list](uint64_t id) {
    std::lock_guard<std::mutex> lock(list.mu);
    const auto& live = list.hooks;
    return std::any_of(live.begin(), live.end(), [id](const NodeGradHooks::Entry& e) { return e.id == id; });
  };
  return ChainGradHooks(hooks, still_registered, std::move(grad), what);
}

Edge GradientEdge(const Tensor& t) {
  if (!t.defined()) return {};
  if (t.grad_fn()) return {t.grad_fn(), t.output_nr()};
  if (!t.requires_grad()) return {};
  // A leaf that requires grad has its metadata already (set_requires_grad
  // made it), so only the accumulator needs guarding here.
  AutogradMeta& meta = t.impl()->mutable_autograd();
  std::lock_guard<std::mutex> lock(meta.grad_accumulator_mu);
  std::shared_ptr<Node> acc = meta.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    meta.grad_accumulator = acc;
  }
  return {acc, 0};
}

std::vector<Tensor> ReachableLeaves(const std::vector<Tensor>& roots) {
  std::vector<Tensor> leaves;
  std::unordered_set<const Node*> seen;
  std::unordered_set<const TensorImpl*> seen_leaves;
  std::vector<const Node*> stack;
  for (const Tensor& r : roots) {
    if (!r.defined()) continue;
    if (r.grad_fn()) {
      if (seen.insert(r.grad_fn().get()).second) stack.push_back(r.grad_fn().get());
    } else if (r.requires_grad() && seen_leaves.insert(r.impl()).second) {
      leaves.push_back(r);
    }
  }
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    if (const auto* acc = dynamic_cast<const AccumulateGrad*>(n)) {
      const Tensor v = acc->variable();
      // Frozen since the forward: its accumulator gives it no gradient and
      // runs no hook, so it counts as unreached.
      if (v.requires_grad() && seen_leaves.insert(v.impl()).second) leaves.push_back(v);
      continue;
    }
    for (const Edge& e : n->next_edges()) {
      if (e.valid() && seen.insert(e.fn.get()).second) stack.push_back(e.fn.get());
    }
  }
  return leaves;
}

bool AnyRequiresGrad(std::initializer_list<const Tensor*> tensors) {
  if (!GradMode::IsEnabled()) return false;
  for (const Tensor* t : tensors) {
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  }
  return false;
}

bool AnyRequiresGrad(const std::vector<Tensor>& tensors) {
  if (!GradMode::IsEnabled()) return false;
  for (const Tensor& t : tensors) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

void ConnectNode(const std::shared_ptr<Node>& node, const std::vector<const Tensor*>& inputs,
                 const std::vector<Tensor*>& outputs) {
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Tensor* in : inputs) edges.push_back(in != nullptr ? GradientEdge(*in) : Edge{});
  node->set_next_edges(std::move(edges));
  for (size_t i = 0; i < outputs.size(); ++i) {
    AutogradMeta& meta = outputs[i]->impl()->mutable_autograd();
    meta.requires_grad = true;
    meta.grad_fn = node;
    meta.output_nr = static_cast<uint32_t>(i);
    node->AddOutput(*outputs[i]);
  }
}

}  // namespace ddp::nn::autograd
