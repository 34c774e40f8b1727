// The backward engine: runs the recorded graph from the roots in dependency
// order, on the calling thread. Among nodes whose inputs are complete, the
// most recently created runs first, and leaf accumulation runs as soon as it
// is ready, so parameters' hooks fire in the order their gradients become
// final (roughly reverse registration order for a sequential model).
//
// Gradient hooks (Tensor::RegisterHook) run on gradients that reach their
// tensor, as PyTorch's register_hook documentation describes them (they
// run when the tensor's gradient is computed): an output of a node that runs but gets no
// gradient from this pass is not hooked. (PyTorch's engine calls that
// output's hooks with an undefined gradient, None in Python; here a hook
// never sees one.)
//
// Threading: backward, the accumulation into .grad and every hook run on the
// thread that called Backward. Passes on several threads may run at once,
// also through a shared part of one graph (two heads on one trunk): the
// engine holds each node's mutex (Node::mutex) across its Apply, the
// release of its saved tensors and the update of its outputs' retained
// gradients. A shared node therefore runs one pass at a time; a leaf's
// accumulation into .grad and its post-accumulate hooks are serialized
// with the other passes' accumulation into that leaf; and a pass that
// reaches a node another pass already released gets the usual "backward
// through the graph a second time" error. That lock covers the engine's
// own writes only: code that reads or writes .grad while a pass may be
// accumulating into it (DDP's communication thread reading buckets, an
// optimizer step, ZeroGrad) must synchronize with that pass on its own.
// Hooks may be registered or removed on a tensor while a pass runs them
// (AutogradMeta::hooks_mu guards a leaf's lists, NodeGradHooks::mu those
// its grad_fn keeps for a non-leaf; a pass runs a copy, skipping hooks
// removed before their turn; a hook already running finishes after
// Remove returns). Recording forwards on shared leaves from several threads is
// safe as far as the accumulator goes: its creation is locked
// (AutogradMeta::grad_accumulator_mu), so every graph finds the same
// AccumulateGrad node for a leaf; nothing else in a leaf's autograd
// metadata is locked (changing requires_grad during another thread's
// forward is a race).
//
// Re-entrant backward: a custom function's Backward or a hook may call
// Backward on its own thread (activation checkpointing records the forward
// again and runs a nested pass through it, as PyTorch allows). The nested
// pass runs to the end, with its own callbacks, before the call returns;
// the enclosing pass then goes on. A nested pass that would reach the node
// whose backward or hook called it (a leaf's hook running Backward into
// that leaf again) is refused before any of its nodes runs, with an error
// naming the node, since it would wait for the lock its own thread holds.
// A nested pass holds its enclosing pass's node while it waits for others:
// nested passes on two threads where each reaches the node the other's
// enclosing pass is running would wait for each other, so a nested pass
// waits for a node at most SetNestedPassLockTimeout (5 minutes unless set)
// and then fails, naming the node it waited for and the one it holds.
// Such passes must not share the nodes that call them.
//
// What the per-node lock implies for code that runs inside a backward (a
// custom function's Backward, a hook): it must not wait for another
// thread's pass that reaches the same node (say, a backward run on a
// worker thread and joined; call Backward on the same thread instead):
// that pass waits for the node's mutex, which the waiting code holds, and
// neither returns.
// Nodes that issue collectives (SyncBatchNorm's backward) must not be
// shared by concurrent passes with retain_graph: each pass issues the
// collective in whatever order its thread won the node, and ranks may pair
// different passes' data. And the lock is per node: state shared across
// several leaves' hooks (DDP's reducer counts ready gradients across
// parameters) is not covered; DDP runs one backward at a time per model.
#pragma once

#include <chrono>
#include <functional>
#include <vector>

#include "nn/tensor/tensor.h"

namespace ddp::nn::autograd {

/// Computes the gradients of `roots` with respect to every leaf that requires
/// grad and is reachable, accumulating into .grad. grads[i] seeds root i; an
/// empty or undefined entry means 1 and needs a one-element root. The saved
/// tensors of the nodes the pass runs, and the gradient hooks a node whose
/// backward read saved tensors keeps for its non-leaf outputs, are released unless
/// retain_graph (a failed pass leaves the nodes it did not run as they
/// were). Callbacks queued during
/// the pass run before this returns. A seed of another dtype than its root
/// is converted to the root's (as PyTorch). Throws on misuse (a root that
/// does not require grad, a seed of the wrong shape or on another device
/// than its root, a second backward through a node whose saved tensors
/// were released, a saved
/// tensor modified in place); an exception inside a node names the node.
/// May be called from inside a running pass on the same thread (see above).
void Backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads = {},
              bool retain_graph = false);

/// Queues `fn` to run once when the backward pass running on this thread
/// has processed every node, before Backward returns (callbacks may queue
/// more). When passes are nested, that is the innermost pass, or with
/// `outermost` the first pass on this thread's stack (what needs every
/// gradient of the user's backward, as DDP's end of iteration). Throws
/// when no backward pass is running on this thread.
void QueueCallback(std::function<void()> fn, bool outermost = false);

/// How long a nested backward pass waits for a node another thread's pass
/// is running before it fails (see above); positive. Default 5 minutes.
void SetNestedPassLockTimeout(std::chrono::milliseconds timeout);

/// True while a backward pass runs on this thread (e.g. inside a hook).
bool InBackward();

class Node;
/// Observes each node the engine runs (profiling): the node and the wall
/// time its Apply took, on the backward thread. Empty by default; costs one
/// atomic load per node when unset. May be changed while backward passes
/// run: a pass already inside a node finishes with the observer it read.
using NodeObserver = std::function<void(const Node& node, double seconds)>;
void SetNodeObserver(NodeObserver observer);

}  // namespace ddp::nn::autograd

namespace ddp::nn {
/// Backward from one root (PyTorch's loss.backward()): nn::Backward(loss).
/// Lives in ddp::nn so that it is found next to Tensor by argument lookup.
void Backward(const Tensor& root, const Tensor& grad = Tensor(), bool retain_graph = false);
}  // namespace ddp::nn
