#include "nn/autograd/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

#include "nn/autograd/node.h"
#include "nn/ops/dispatch.h"

namespace ddp::nn::autograd {

namespace {

// State of one backward pass.
struct GraphTask {
  std::mutex mu;
  std::vector<std::function<void()>> callbacks;
};

thread_local GraphTask* current_task = nullptr;
// The first pass on this thread's stack (the one a nested pass runs inside).
thread_local GraphTask* outermost_task = nullptr;
// The nodes whose mutex this thread holds, innermost last: one per pass
// running on this thread (a pass nested in a backward function or a hook
// holds the enclosing pass's node while it runs).
thread_local std::vector<const Node*> held_nodes;
// The node observer: replaced under g_observer_mu, read by backward threads
// as a shared copy (so a replacement cannot destroy it mid-call). The flag
// keeps the unset case to one atomic load per node.
std::mutex g_observer_mu;
std::shared_ptr<const NodeObserver> g_observer;
std::atomic<bool> g_has_observer{false};

std::shared_ptr<const NodeObserver> CurrentObserver() {
  if (!g_has_observer.load(std::memory_order_acquire)) return nullptr;
  std::lock_guard<std::mutex> lock(g_observer_mu);
  return g_observer;
}

// Makes `task` this thread's current pass; a nested pass restores the
// enclosing one when it ends, so that InBackward and QueueCallback see it.
class TaskScope {
 public:
  explicit TaskScope(GraphTask* task) : enclosing_(current_task) {
    current_task = task;
    if (enclosing_ == nullptr) outermost_task = task;
  }
  ~TaskScope() {
    current_task = enclosing_;
    if (enclosing_ == nullptr) outermost_task = nullptr;
  }
  TaskScope(const TaskScope&) = delete;
  TaskScope& operator=(const TaskScope&) = delete;

 private:
  GraphTask* enclosing_;
};

std::string NestedPassRefusal(const Node& node) {
  return "Backward: a nested backward pass reached " + node.name() +
         ", which an enclosing backward pass on this thread is running (a Backward called from a backward "
         "function or hook must not go through the node that called it)";
}

std::atomic<int64_t> g_nested_lock_timeout_ms{300000};
// A week. The wait's deadline is steady_clock::now() plus the timeout in
// nanoseconds: far larger values (milliseconds::max() meant as "no
// deadline") overflow there, and the wait ended at once.
constexpr int64_t kMaxNestedLockTimeoutMs = int64_t{7} * 24 * 3600 * 1000;

// Takes `lock`'s mutex if it comes free within `timeout` (steady clock).
// Waits in slices of at most 100 ms timed against the system clock: that
// form of try_lock_until is pthread_mutex_timedlock, which ThreadSanitizer
// follows, while the steady-clock form (pthread_mutex_clocklock) is unseen
// by GCC 12's, which then reported every later unlock as the unlock of an
// unlocked mutex. The steady clock decides when to give up, so a jump of
// the system clock can only stretch or cut one slice.
bool LockWithin(std::unique_lock<std::timed_mutex>& lock, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero()) return lock.try_lock();
    const auto slice = std::min<std::chrono::steady_clock::duration>(left, std::chrono::milliseconds(100));
    if (lock.try_lock_until(std::chrono::system_clock::now() +
                            std::chrono::duration_cast<std::chrono::system_clock::duration>(slice))) {
      return true;
    }
  }
}

// Holds a node's mutex for one pass and records it in held_nodes. A pass
// nested in another holds the enclosing pass's node while it waits here: a
// nested pass on another thread that waits for that node in turn would
// wait forever, so a nested pass waits up to a deadline and then fails,
// naming both nodes. (A node this thread holds is refused before the pass
// starts, in Backward.)
class NodeLock {
 public:
  explicit NodeLock(Node& node) : lock_(node.mutex(), std::defer_lock) {
    if (held_nodes.empty()) {
      lock_.lock();
    } else if (const int64_t timeout_ms = g_nested_lock_timeout_ms.load();
               !LockWithin(lock_, std::chrono::milliseconds(timeout_ms))) {
      throw std::runtime_error(
          "Backward: a nested backward pass waited " + std::to_string(timeout_ms) +
          " ms for " + node.name() + ", which another thread's backward pass is running, while holding " +
          held_nodes.back()->name() +
          " (the node whose backward or hook started the nested pass). Nested passes on two threads that "
          "each reach the node the other's enclosing pass runs wait for each other: do not share those "
          "nodes between such passes");
    }
    held_nodes.push_back(&node);
  }
  ~NodeLock() { held_nodes.pop_back(); }
  NodeLock(const NodeLock&) = delete;
  NodeLock& operator=(const NodeLock&) = delete;

 private:
  std::unique_lock<std::timed_mutex> lock_;
};

struct LaterFirst {
  bool operator()(const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) const {
    return a->sequence_nr() < b->sequence_nr();
  }
};

// a + b in a new tensor of a's dtype (b converted to it), on a's device.
Tensor SumOf(const Tensor& a, Tensor b) {
  if (b.dtype() != a.dtype()) b = b.To(a.dtype());
  Tensor sum = Empty(a.shape(), {.dtype = a.dtype(), .device = a.device()});
  DDP_KERNEL(sum.device(), binary)(ops::BinaryOp::kAdd, a, b, sum);
  return sum;
}

// Sums gradient contributions arriving at one input of a node. A new tensor
// is made rather than adding in place: the first contribution may be shared
// with another consumer.
void Accumulate(std::vector<Tensor>& buffer, uint32_t index, Tensor grad) {
  if (buffer.size() <= index) buffer.resize(index + 1);
  Tensor& slot = buffer[index];
  if (!slot.defined()) {
    slot = std::move(grad);
    return;
  }
  slot = SumOf(slot, std::move(grad));
}

void RunCallbacks(GraphTask& task) {
  for (;;) {
    std::vector<std::function<void()>> batch;
    {
      std::lock_guard<std::mutex> lock(task.mu);
      batch.swap(task.callbacks);
    }
    if (batch.empty()) return;
    for (auto& fn : batch) fn();
  }
}

// An error raised inside a node (its backward, or a hook on a gradient it
// accumulated) names the node. The standard exception types are thrown
// again, with the same type, with the name in front; any other type (a
// DistributedError from a collective a hook waited on, bad_alloc) goes
// through unchanged, so that the caller can still catch it by its type.
[[noreturn]] void RethrowWithNodeName(const std::exception& e, const Node& node) {
  const std::type_info& type = typeid(e);
  const std::string what = "in backward of " + node.name() + ": " + e.what();
  if (type == typeid(std::runtime_error)) throw std::runtime_error(what);
  if (type == typeid(std::logic_error)) throw std::logic_error(what);
  if (type == typeid(std::invalid_argument)) throw std::invalid_argument(what);
  if (type == typeid(std::out_of_range)) throw std::out_of_range(what);
  if (type == typeid(std::domain_error)) throw std::domain_error(what);
  if (type == typeid(std::length_error)) throw std::length_error(what);
  if (type == typeid(std::overflow_error)) throw std::overflow_error(what);
  if (type == typeid(std::range_error)) throw std::range_error(what);
  throw;
}

}  // namespace

bool InBackward() { return current_task != nullptr; }

void SetNodeObserver(NodeObserver observer) {
  std::shared_ptr<const NodeObserver> next =
      observer ? std::make_shared<const NodeObserver>(std::move(observer)) : nullptr;
  std::shared_ptr<const NodeObserver> old;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(g_observer_mu);
  old = std::move(g_observer);
  g_observer = std::move(next);
  g_has_observer.store(g_observer != nullptr, std::memory_order_release);
}

void SetNestedPassLockTimeout(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) {
    throw std::invalid_argument("SetNestedPassLockTimeout: the timeout must be positive, got " +
                                std::to_string(timeout.count()) + " ms");
  }
  if (timeout.count() > kMaxNestedLockTimeoutMs) {
    throw std::invalid_argument("SetNestedPassLockTimeout: the timeout must be at most 7 days (" +
                                std::to_string(kMaxNestedLockTimeoutMs) + " ms), got " +
                                std::to_string(timeout.count()) + " ms");
  }
  g_nested_lock_timeout_ms.store(timeout.count());
}

void QueueCallback(std::function<void()> fn, bool outermost) {
  if (current_task == nullptr) {
    throw std::logic_error("QueueCallback called outside a backward pass (call it from a hook during Backward)");
  }
  // Refused here, where the caller can be named: called at the end of the
  // pass, an empty function would throw a bare std::bad_function_call.
  if (!fn) throw std::invalid_argument("QueueCallback: the callback is empty");
  GraphTask* task = outermost ? outermost_task : current_task;
  std::lock_guard<std::mutex> lock(task->mu);
  task->callbacks.push_back(std::move(fn));
}

void Backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph) {
  if (!grads.empty() && grads.size() != roots.size()) {
    throw std::invalid_argument("Backward: " + std::to_string(roots.size()) + " roots but " +
                                std::to_string(grads.size()) + " gradients");
  }
  GraphTask task;
  TaskScope scope(&task);
  GradModeGuard no_grad(false);

  // Seeds.
  std::vector<std::pair<Edge, Tensor>> seeds;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    if (!root.defined()) {
      throw std::invalid_argument("Backward: root " + std::to_string(i) + " is an undefined tensor");
    }
    if (!root.requires_grad()) {
      throw std::invalid_argument("Backward: root " + std::to_string(i) +
                                  " does not require grad and has no grad_fn");
    }
    Tensor g = grads.empty() ? Tensor() : grads[i];
    if (!g.defined()) {
      if (root.numel() != 1) {
        throw std::invalid_argument("Backward: a gradient can be implied only for a one-element root, root " +
                                    std::to_string(i) + " has shape " + ShapeToString(root.shape()));
      }
      g = Ones(root.shape(), {.dtype = root.dtype(), .device = root.device()});
    } else if (g.shape() != root.shape()) {
      throw std::invalid_argument("Backward: gradient of shape " + ShapeToString(g.shape()) + " for root " +
                                  std::to_string(i) + " of shape " + ShapeToString(root.shape()));
    } else if (g.device() != root.device()) {
      throw std::invalid_argument("Backward: gradient on " + g.device().ToString() + " for root " +
                                  std::to_string(i) + " on " + root.device().ToString());
    } else if (g.dtype() != root.dtype()) {
      // Converted, as PyTorch's engine converts a seed (validate_outputs):
      // the nodes below compute in the root's dtype.
      g = g.To(root.dtype());
    }
    seeds.emplace_back(GradientEdge(root), g);
  }

  // Dependencies: how many edges point at each reachable node.
  std::unordered_map<Node*, int> deps;
  {
    std::unordered_set<Node*> seen;  // every reachable node
    std::vector<Node*> stack;
    for (auto& [edge, g] : seeds) {
      if (seen.insert(edge.fn.get()).second) stack.push_back(edge.fn.get());
    }
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      // Refused before any node runs, so that nothing is left half done
      // (other leaves' .grad, released saved tensors): reaching the node
      // would wait for the lock this thread holds.
      if (!held_nodes.empty() && std::find(held_nodes.begin(), held_nodes.end(), n) != held_nodes.end()) {
        throw std::logic_error(NestedPassRefusal(*n));
      }
      for (const Edge& e : n->next_edges()) {
        if (!e.valid()) continue;
        ++deps[e.fn.get()];
        if (seen.insert(e.fn.get()).second) stack.push_back(e.fn.get());
      }
    }
  }

  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, LaterFirst> ready;
  {
    std::unordered_set<Node*> queued;
    for (auto& [edge, g] : seeds) Accumulate(buffers[edge.fn.get()], edge.input_nr, g);
    for (auto& [edge, g] : seeds) {
      if (deps[edge.fn.get()] == 0 && queued.insert(edge.fn.get()).second) ready.push(edge.fn);
    }
  }

  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top();
    ready.pop();
    std::vector<Tensor> in;
    if (auto it = buffers.find(node.get()); it != buffers.end()) {
      in = std::move(it->second);
      buffers.erase(it);
    }
    in.resize(std::max<size_t>(in.size(), node->num_outputs()));
    bool any = false;
    for (const Tensor& t : in) any = any || t.defined();
    std::vector<Tensor> out_grads;
    // The observer (a profiler) runs after the node's mutex is released, so
    // a slow one does not hold up another pass through a shared node.
    const std::shared_ptr<const NodeObserver> observer = any ? CurrentObserver() : nullptr;
    double apply_seconds = 0;
    // Declared before the node's lock, so that the hooks a release takes
    // out are destroyed after it is let go.
    std::vector<NodeGradHooks::Entry> released_hooks;
    {
      // Backward passes on two threads may share part of a graph (two
      // heads on one trunk). As PyTorch's engine, each holds the node's
      // mutex across the retained-grad update, Apply and the release of
      // its saved tensors: the second finds them released and throws
      // "backward through the graph a second time" instead of reading them
      // while they are freed. A thread holds one node's mutex per pass it
      // runs (more than one when passes are nested).
      NodeLock lock(*node);
      // Gradient hooks of the node's outputs (Tensor::RegisterHook) see the
      // gradient summed over every use of the output, once per pass, and
      // may replace it before it is retained or reaches Apply (PyTorch's
      // tensor pre-hooks). The node keeps them, so they run whether or not
      // a handle to the output is alive. A leaf's run in its AccumulateGrad.
      // (A node that never had a hook has no list: it costs one lock.)
      if (const std::shared_ptr<NodeGradHooks> hooks = node->grad_hooks()) {
        for (uint32_t i = 0; i < in.size(); ++i) {
          if (!in[i].defined()) continue;
          // An earlier pass that did not retain the graph released this
          // output's hooks with the node's saved tensors: going on would
          // silently leave them out. Refused in the words Apply would
          // use, finding the saved tensors released (the same node, the
          // same cause, one message).
          if (node->GradHooksReleased(i)) {
            throw std::logic_error("in backward of " + node->name() +
                                   ": tried to run backward through the graph a second time (its saved "
                                   "tensors were released; pass retain_graph = true to the first Backward)");
          }
          try {
            in[i] = RunGradHooks(*hooks, i, std::move(in[i]),
                                 [&node, i] { return "output " + std::to_string(i) + " of " + node->name(); });
          } catch (const std::exception& e) {
            RethrowWithNodeName(e, *node);
          }
        }
      }
      // Non-leaf tensors that asked to keep their gradient. A second pass
      // sums into a new tensor (PyTorch's grad = grad + new_grad): the
      // .grad of the first pass may be held by the caller and must not
      // change.
      for (uint32_t i = 0; i < node->num_outputs(); ++i) {
        if (!in[i].defined()) continue;
        Tensor out = node->LiveOutput(i);
        if (out.defined() && out.retains_grad()) {
          AutogradMeta& meta = out.impl()->mutable_autograd();
          meta.grad = meta.grad.defined() ? SumOf(meta.grad, in[i]) : in[i].Clone();
        }
      }
      if (any) {
        try {
          if (observer) {
            const auto t0 = std::chrono::steady_clock::now();
            out_grads = node->Apply(std::move(in));
            apply_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          } else {
            out_grads = node->Apply(std::move(in));
          }
        } catch (const std::exception& e) {
          RethrowWithNodeName(e, *node);
        }
      }
      // The hooks go with the saved tensors: one holding a tensor computed
      // from its own (the loss) would keep the graph alive for ever. Only
      // where a saved tensor the backward read was released: a later pass
      // through this node then fails here anyway, while one through a node
      // that saved nothing, or nothing its backward reads, goes through
      // and runs its hooks again, as in PyTorch.
      if (!retain_graph) {
        const uint64_t released_before = SavedTensor::ReleasedAfterReadOnThisThread();
        node->ReleaseSaved();
        if (SavedTensor::ReleasedAfterReadOnThisThread() != released_before) {
          released_hooks = node->ReleaseGradHooks();
        }
      }
    }
    if (observer) (*observer)(*node, apply_seconds);
    const auto& edges = node->next_edges();
    if (any && out_grads.size() != edges.size()) {
      throw std::logic_error(node->name() + " returned " + std::to_string(out_grads.size()) +
                             " gradients for " + std::to_string(edges.size()) + " inputs");
    }
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.valid()) continue;
      if (any && out_grads[i].defined()) Accumulate(buffers[e.fn.get()], e.input_nr, std::move(out_grads[i]));
      if (--deps[e.fn.get()] == 0) ready.push(e.fn);
    }
  }
  RunCallbacks(task);
}

}  // namespace ddp::nn::autograd

namespace ddp::nn {
void Backward(const Tensor& root, const Tensor& grad, bool retain_graph) {
  autograd::Backward(std::vector<Tensor>{root},
                     grad.defined() ? std::vector<Tensor>{grad} : std::vector<Tensor>{}, retain_graph);
}
}  // namespace ddp::nn
