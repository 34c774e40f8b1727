// The recorded graph: each differentiable operation creates a Node that
// knows how to turn the gradients of its outputs into gradients of its
// inputs, and Edges to the nodes that produced those inputs. Leaves that
// require grad end in an AccumulateGrad node, which adds into .grad and
// then runs the tensor's post-accumulate-grad hooks (what DDP listens to).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "nn/tensor/tensor.h"

namespace ddp::nn::autograd {

class Node;

/// Where a gradient flows: input `input_nr` of node `fn` (fn null: nowhere).
struct Edge {
  std::shared_ptr<Node> fn;
  uint32_t input_nr = 0;
  bool valid() const { return fn != nullptr; }
};

/// One recorded operation. Subclasses save what their backward needs (and
/// nothing more) and implement Apply.
class Node {
 public:
  Node();
  /// Frees the chain of nodes only this one keeps alive with a loop rather
  /// than by recursion, so that dropping a graph hundreds of thousands of
  /// nodes deep (a long unrolled loop) does not overflow the stack.
  virtual ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  /// Gradients of the inputs (one per next edge; undefined = none) from the
  /// gradients of the outputs (one per output; undefined = zero). Runs with
  /// grad mode off.
  virtual std::vector<Tensor> Apply(std::vector<Tensor>&& grad_outputs) = 0;
  /// Name in messages, e.g. "LinearBackward".
  virtual std::string name() const = 0;
  /// Drops saved tensors after backward has run through the node (unless
  /// the graph is retained); a second backward then reports the release.
  /// Saved tensors are kept as SavedTensor: the engine counts the releases
  /// of those the backward read to know whether the node's gradient hooks
  /// go with them.
  virtual void ReleaseSaved() {}

  const std::vector<Edge>& next_edges() const { return next_edges_; }
  void set_next_edges(std::vector<Edge> edges) { next_edges_ = std::move(edges); }
  /// True when input i of the forward op needs a gradient.
  bool needs_input_grad(size_t i) const { return i < next_edges_.size() && next_edges_[i].valid(); }
  /// Creation order; the engine runs ready nodes latest-first.
  uint64_t sequence_nr() const { return sequence_nr_; }
  uint32_t num_outputs() const { return static_cast<uint32_t>(outputs_.size()); }

  /// Registers output `nr` (called when the op wires its outputs).
  void AddOutput(const Tensor& output);
  /// Output nr if it is still alive (for RetainGrad), else undefined.
  Tensor LiveOutput(uint32_t nr) const;
  /// The gradient hooks registered on this node's outputs (RegisterHook on
  /// a non-leaf), created on first use.
  std::shared_ptr<NodeGradHooks> MutableGradHooks();
  /// The same, or null when no hook was ever registered on an output.
  std::shared_ptr<NodeGradHooks> grad_hooks() const;
  /// Takes the hooks out of the list, remembering which outputs had one
  /// (see GradHooksReleased). The engine calls it where ReleaseSaved
  /// released a saved tensor the node's backward had read (a later pass
  /// through the node fails there anyway): a hook that holds a tensor
  /// computed from the hooked one (the loss) would otherwise keep the graph
  /// alive through the node for ever. A node that saved nothing, or nothing
  /// its backward reads, keeps its hooks, as in PyTorch. The caller
  /// destroys what it returns after letting go of mutex(): destroying what a
  /// hook captured may run any code.
  std::vector<NodeGradHooks::Entry> ReleaseGradHooks();
  /// True when ReleaseGradHooks took a hook of output `output_nr`: a later
  /// pass bringing that output a gradient would miss the hook, so the
  /// engine refuses it. After the release, RegisterHook refuses a hook on
  /// any output (NodeGradHooks::released).
  bool GradHooksReleased(uint32_t output_nr) const;
  /// True once ReleaseGradHooks ran (a backward without retain_graph
  /// released what this node's backward reads): RegisterHook on any of its
  /// outputs is refused, and a pass through it fails.
  bool HooksReleased() const;
  /// Held by the engine across this node's Apply and ReleaseSaved (and the
  /// update of its outputs' retained gradients), so that backward passes on
  /// several threads through a shared node run it one at a time.
  /// Timed, so that a nested pass can give up waiting (see engine.h).
  std::timed_mutex& mutex() { return mutex_; }

 protected:
  uint64_t sequence_nr_;

 private:
  std::vector<Edge> next_edges_;
  std::vector<std::weak_ptr<TensorImpl>> outputs_;
  std::timed_mutex mutex_;
  // Guards the pointer, released_hook_outputs_ and hooks_released_ (the list has its own
  // lock, taken after this one): a hook may be registered while another
  // thread's pass runs this node.
  mutable std::mutex grad_hooks_mu_;
  std::shared_ptr<NodeGradHooks> grad_hooks_;
  std::vector<uint32_t> released_hook_outputs_;
  // Set by ReleaseGradHooks; a list made after it is marked released.
  bool hooks_released_ = false;
};

/// Runs the leaf's gradient hooks (RegisterHook) on the incoming gradient,
/// adds the result into its .grad (in place when .grad exists,
/// so a .grad that views a bucket is written directly), then runs the
/// leaf's post-accumulate-grad hooks in registration order. A leaf whose
/// requires_grad was turned off after the forward gets neither (PyTorch).
/// Backward passes on two threads that reach one leaf's node run it one at
/// a time, under the node's mutex(), as PyTorch's.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> variable);
  std::vector<Tensor> Apply(std::vector<Tensor>&& grad_outputs) override;
  std::string name() const override { return "AccumulateGrad"; }
  Tensor variable() const { return Tensor(variable_); }

 private:
  std::shared_ptr<TensorImpl> variable_;
};

/// A tensor kept for backward: an alias with no autograd history (so a node
/// never owns its own outputs' graph) plus the storage version at save time,
/// so an in-place write before backward is reported instead of silently
/// producing a wrong gradient. Not synchronized: Get and Release are
/// called from the owning node's Apply and ReleaseSaved, which the engine
/// runs under the node's mutex.
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& t);
  /// The saved tensor; throws if it was released or modified in place since
  /// (naming the tensor's shape, dtype, origin and both versions).
  Tensor Get() const;
  void Release();
  bool defined() const { return was_defined_; }
  /// How many Release calls on this thread have dropped a tensor that Get
  /// had returned (saved, read by a backward and not yet released). The
  /// engine reads it around a node's ReleaseSaved: only a node whose
  /// backward reads a released tensor fails a later pass, so only such a
  /// node loses its gradient hooks with them (one that saved nothing, or
  /// saved a tensor its backward never read, runs again, as in PyTorch).
  static uint64_t ReleasedAfterReadOnThisThread();

 private:
  Tensor data_;
  // What the tensor was when saved (output origin_nr_ of origin_node_, a
  // leaf that requires grad, or neither), for the in-place error: data_ is
  // detached and cannot say. The text is built only for that error.
  std::weak_ptr<Node> origin_node_;
  uint32_t origin_nr_ = 0;
  bool origin_leaf_ = false;
  uint64_t version_ = 0;
  bool was_defined_ = false;
  bool released_ = false;
  // Set by the first Get that returns the tensor.
  mutable bool read_ = false;
};

/// Runs the leaf `tensor`'s gradient hooks (Tensor::RegisterHook) on grad
/// in registration order and returns the result; `what` names the tensor in
/// the error for a replacement of another shape, dtype or device (called
/// only then). Called by AccumulateGrad.
Tensor RunGradHooks(const Tensor& tensor, Tensor grad, const std::function<std::string()>& what);
/// The same for the hooks of output `output_nr` of a node (a non-leaf's
/// hooks, kept by the node that produced it). Called by the engine.
Tensor RunGradHooks(NodeGradHooks& hooks, uint32_t output_nr, Tensor grad,
                    const std::function<std::string()>& what);

/// Tensor::RegisterHook for `tensor`, an output of a recorded node, unless
/// a backward without retain_graph already released that node's hooks:
/// then it registers nothing and returns nullopt instead of throwing. The
/// check and the registration hold the node's hook-list lock, which the
/// release takes too, so a backward on another thread that releases the
/// node between them cannot make it throw (DDP watches a forward's outputs
/// this way: one whose graph is gone can start no pass). Throws
/// std::invalid_argument for a tensor that is undefined or not a node's
/// output, and for an empty `fn`.
std::optional<HookHandle> RegisterHookIfLive(const Tensor& tensor, GradHook fn);

/// The edge a gradient of t should flow into: its grad_fn, its leaf
/// accumulator (created on first use), or nothing.
Edge GradientEdge(const Tensor& t);

/// The leaves that require grad and are reachable from `roots` through the
/// recorded graph (each once, in discovery order). DDP's find_unused_parameters
/// compares them with the model's parameters after the forward pass.
std::vector<Tensor> ReachableLeaves(const std::vector<Tensor>& roots);

/// True when grad mode is on and any defined tensor in the list requires grad.
bool AnyRequiresGrad(std::initializer_list<const Tensor*> tensors);
bool AnyRequiresGrad(const std::vector<Tensor>& tensors);

/// Wires a new node: its next edges come from `inputs` (undefined inputs get
/// no edge) and each output becomes output i of the node, requiring grad.
void ConnectNode(const std::shared_ptr<Node>& node, const std::vector<const Tensor*>& inputs,
                 const std::vector<Tensor*>& outputs);

}  // namespace ddp::nn::autograd
