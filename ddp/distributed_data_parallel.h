#ifndef DDP_DDP_DISTRIBUTED_DATA_PARALLEL_H_
#define DDP_DDP_DISTRIBUTED_DATA_PARALLEL_H_

// DistributedDataParallel: wraps a module so that N ranks, each running
// forward and backward on its own shard of a batch, end every backward with
// the same averaged gradients in every parameter's .grad: training on N
// ranks with batch B each follows the same trajectory as one process with
// the concatenated batch of N*B.
//
//   auto pg = ddp::dist::InitProcessGroup();            // from RANK, WORLD_SIZE, ...
//   auto model = ddp::nn::modules::MakeCnn();
//   ddp::dist::DistributedDataParallel ddp_model(model); // checks and syncs the replicas
//   ddp::nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
//   for (...) {
//     opt.ZeroGrad();
//     Tensor loss = CrossEntropy(ddp_model(images), labels);
//     ddp::nn::Backward(loss);                           // all-reduce overlaps backward
//     opt.Step();
//   }
//
// How it works (PyTorch's design, in C++):
// - Construction (collective): every rank describes its parameters and
//   buffers (names, order, shapes, strides, dtypes); if any rank differs,
//   every rank throws the same message naming the first difference and each
//   rank's value. Then rank 0's values are broadcast to all.
// - Buckets: gradients are grouped into flat buffers in reverse
//   registration order (roughly the order backward produces them), one dtype
//   and device per bucket; the first bucket is small (1 MiB) so that
//   communication starts early, the others hold up to bucket_cap_mb. After
//   the first iteration the buckets are rebuilt once from the order in which
//   gradients actually became ready (rank 0's order, broadcast), unless the
//   communication hook keeps per-bucket state (CommHook::WithFixedBuckets).
// - Backward: each parameter's post-accumulate-grad hook copies its gradient
//   into its bucket, divided by the world size on the way; the hook that
//   completes a bucket hands it to the communication thread at once
//   (buckets are launched in bucket order on every rank). At the end of
//   backward (an autograd callback) the reduced buckets are written back to
//   .grad, unless the hook consumed them (CommHook::WithoutGradWriteBack).
//   With gradient_as_bucket_view, .grad is itself a view into the bucket
//   and neither copy happens.
//
// Threading: forward, backward and the hooks run on the calling thread;
// collectives run on the process group's communication thread. A
// DistributedDataParallel object is used from one thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddp/comm_hooks.h"
#include "ddp/process_group.h"
#include "nn/modules/module.h"

namespace ddp::dist {

/// Options, named and defaulted as PyTorch's DistributedDataParallel.
struct DdpOptions {
  /// Largest bucket in MiB (the first bucket is limited to
  /// first_bucket_mb).
  double bucket_cap_mb = 25.0;
  /// Limit of the first bucket, so that the first all-reduce starts early.
  double first_bucket_mb = 1.0;
  /// A gradient of at least this many MiB is not copied into a shared
  /// bucket: it is a bucket of its own, reduced in place in its .grad (no
  /// copy in or out). 0 copies every gradient, as PyTorch does.
  double inplace_gradient_mb = 0.5;
  /// Broadcast buffers (e.g. BatchNorm running statistics) from rank 0 at
  /// wrapping and at every forward in training. False: the buffers are
  /// neither compared across ranks nor broadcast; each rank keeps its own.
  bool broadcast_buffers = true;
  /// Allow parameters that get no gradient in an iteration (found by
  /// walking the autograd graph from the forward's outputs); a parameter
  /// unused on every rank keeps no gradient. A gradient accumulated under
  /// NoSync counts as a use in the next synchronizing backward, so it is
  /// averaged even where that backward does not reach the parameter.
  /// Without the option an unused parameter is an error naming it, thrown
  /// by that backward (and by every later forward).
  bool find_unused_parameters = false;
  /// .grad of every parameter is a view into its bucket: no copies in and
  /// out of the buckets, and no second copy of the gradients in memory.
  bool gradient_as_bucket_view = false;
  /// The set of used parameters and their order never change: unused ones
  /// are those that got no gradient in the first iteration (as in PyTorch:
  /// the head of an output left out of the loss is unused, a parameter used
  /// only inside a re-entrantly checkpointed segment, which forward's graph
  /// does not show, is used; no graph walk afterwards) and the buckets are
  /// rebuilt even with find_unused_parameters.
  /// A parameter may get several gradients in one backward (re-entrant
  /// activation checkpointing through a segment that uses it, used outside
  /// the segment too): the first iteration counts them and reduces every
  /// bucket at its end; later ones reduce the parameter after the last.
  bool static_graph = false;
  /// The order to fill the buckets in from the start, as indices into the
  /// parameters that require grad (registration order): an earlier
  /// wrapper's BucketOrder(), saved with a checkpoint, so that a resumed run
  /// reduces its first gradients in the buckets the interrupted run had
  /// reached (on 3 or more ranks a gradient's sum depends on its place in
  /// the bucket, in the last bit). Must be a permutation of
  /// [0, parameters that require grad), the same on every rank. The buckets
  /// are not rebuilt after the first iteration; a hook with fixed buckets
  /// (CommHook::WithFixedBuckets) keeps the ones built from this order.
  /// Empty: reverse registration order, rebuilt once as described above.
  std::vector<int64_t> bucket_order;
  /// Null: the default process group (InitProcessGroup).
  std::shared_ptr<ProcessGroup> process_group;

  /// Rank 0 logs runtime statistics every this many iterations (0: never;
  /// DDP_DEBUG=info or detail makes it 100), each line for the iterations since the
  /// last; the window Stats() reports is not restarted by it. A line is
  /// printed at the first training forward after its window is full; the
  /// wrapper's destruction prints the iterations not logged yet (marked
  /// "end of run"), where PyTorch logs only at its intervals. Stats()
  /// reads the figures at any time. A one-process wrapper without a
  /// communication hook reduces nothing and counts no iterations: it logs
  /// nothing, and Stats() has forward_ms only.
  /// Negative: std::invalid_argument (the group is aborted, as for a
  /// failure of this rank's alone after the replicas are compared).
  int64_t log_stats_every = 0;
  /// When set, each rank writes a Chrome-trace timeline to
  /// `<trace_prefix>rank<r>.json` when the wrapper is destroyed (and on
  /// WriteTrace()); r is the process's rank in the job
  /// (ProcessGroup::root_rank), also for a DDP of a subgroup. Meanwhile
  /// every forward appends the events so far to
  /// `<trace_prefix>rank<r>.partial.json` (the format's array form, a
  /// complete JSON array after every forward), removed once the complete
  /// file is written: a run that dies without unwinding leaves that one.
  /// Construction removes a `<trace_prefix>rank<r>.json` of an earlier
  /// run, so that it is never read beside this run's partial file (one it
  /// cannot remove is reported on stderr and construction goes on); one
  /// that fails leaves it, and removes its own partial file. A directory
  /// that cannot be written fails construction. One trace file
  /// takes one wrapper: a second wrapper of this process with the same
  /// prefix and rank (on any group) fails construction with
  /// std::invalid_argument naming the prefix and the file, at the ranks'
  /// model comparison (the other ranks, which may not trace, fail there
  /// too, naming this rank's refusal; the group is not aborted), and the
  /// first keeps its trace (to wrap a model again,
  /// destroy the earlier wrapper first); a trace file that another
  /// process streams to (locked) fails it with std::runtime_error.
  /// When `<trace_prefix>rank<r>.json` is a FIFO (named pipe) or a terminal,
  /// it is streamed instead, with no partial file and no rename (which
  /// would replace the pipe): construction opens it, every forward appends
  /// the events so far, and the wrapper's destruction ends the JSON
  /// document (WriteTrace appends without ending it). Such a path names one
  /// rank's trace: give each rank that streams its own FIFO; two ranks'
  /// links to one pipe are refused (the second fails construction, naming
  /// the path). A FIFO that nothing opens for reading within
  /// trace_reader_wait fails construction, naming it; a reader that goes
  /// away (or takes nothing for trace_reader_wait) later is a warning on
  /// stderr naming the path, and the run goes on without the trace.
  std::string trace_prefix;
  /// How long a streamed trace (above) waits for its FIFO's reader, at
  /// construction and at each write; at most half the process group's
  /// timeout, as the other ranks wait for this one meanwhile.
  std::chrono::milliseconds trace_reader_wait{30000};
};

/// Averages over the iterations of a statistics window, in milliseconds.
struct DdpStats {
  int64_t iterations = 0;           ///< Synchronizing iterations in the window.
  /// DDP forward (buffer broadcast included): training-mode forwards, and
  /// the forwards run between a synchronizing training forward and its
  /// backward's first gradient (under NoGradGuard or NoSync, in either
  /// mode). Not those after an eval-mode forward with grad enabled, whose
  /// backward may never come: an evaluation is no iteration's time.
  double forward_ms = 0;
  double backward_compute_ms = 0;   ///< End of forward to the last gradient, less the forwards run between.
  double backward_comm_ms = 0;      ///< First bucket launched to last bucket reduced.
  double overlap_ms = 0;            ///< Part of backward_comm_ms before the last gradient.
  double exposed_ms = 0;            ///< Backward waiting after its last gradient (and copying back).
  // With collectives on the caller's thread (ProcessGroup::collectives_on_caller)
  // the CPU buckets' all-reduces run inside backward and hold it up: their
  // summed durations count as backward_comm_ms, none as overlap_ms, and
  // those that ran before the last gradient as exposed_ms instead of
  // compute (those after it, as a static graph's first iteration runs the
  // buckets of outputs left out of the loss, are inside exposed_ms
  // already). Buckets on the communication thread beside them (device
  // buckets) add their span and its overlap as usual. A collective whose
  // start was not recorded (issued before a fork, read in the child) is
  // left out.
  double comm_thread_cpu_ms = 0;    ///< CPU time of the communication thread.
  /// Time the group's collectives waited for slower ranks
  /// (ProcessGroup::PeerWaitTime: host tensors through shared memory
  /// only): high on the ranks that wait, low on the rank they wait for,
  /// the straggler.
  double peer_wait_ms = 0;
  std::vector<size_t> bucket_bytes;  ///< Current bucket sizes, in launch order.
  /// Overlapped share of communication (0..1; 1 when there was none).
  double overlap_fraction() const {
    return backward_comm_ms > 0 ? overlap_ms / backward_comm_ms : 1.0;
  }
  /// One line: "forward 1.20 ms, backward compute 3.40 ms, ...".
  std::string ToString() const;
};

class DistributedDataParallel;

/// While alive, forward and backward do not synchronize: gradients
/// accumulate locally in .grad. The first backward after it ends
/// synchronizes everything accumulated (gradient accumulation). It also
/// lets a further backward through the graph of a forward that already
/// synchronized accumulate locally, which is an error outside it. A forward
/// under it that follows a synchronizing training forward whose backward
/// has not run yet does not change that backward: as in PyTorch, the
/// forward that prepared it decides, so a = ddp(x1); {NoSync; b = ddp(x2);}
/// Backward(f(a, b)) synchronizes every gradient of f. With
/// find_unused_parameters only the first forward's outputs decide the
/// unused set: a gradient of f for a parameter that only the NoSync
/// forward reached fails that backward on every rank, naming it. With
/// static_graph that backward reduces every gradient at its end (the NoSync
/// forward's checkpointed segments add gradients to those it counted).
class [[nodiscard]] NoSyncGuard {
 public:
  explicit NoSyncGuard(DistributedDataParallel& ddp);
  ~NoSyncGuard();
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  DistributedDataParallel& ddp_;
  bool previous_;
};

class DistributedDataParallel : public nn::modules::Module {
 public:
  /// Wraps `module` (registered as child "module", so names carry the
  /// "module." prefix in this wrapper's state dict, as in PyTorch).
  /// Collective. Throws std::invalid_argument when the replicas differ
  /// (every rank, same message), DistributedError when communication fails.
  /// Out-of-range options (bucket sizes, bucket_order) throw
  /// std::invalid_argument too, after the replicas are compared, so that a
  /// rank whose options or trainable parameters differ makes every rank
  /// throw the comparison's message instead of failing alone. A failure of
  /// this rank's alone after the comparison (allocating the gradient
  /// buckets, say) aborts the group with a reason naming the rank and the
  /// cause, so that the peers' first collective fails with it within
  /// moments instead of waiting until the group's timeout.
  /// The parameters that require grad now are the ones synchronized; one
  /// that starts requiring grad later (unfreezing) is refused, naming it, at
  /// the next forward with grad enabled outside NoSync: wrap again. The
  /// group is aborted then, as for To() below, unless that forward involves
  /// no peer (every parameter was frozen at wrapping).
  explicit DistributedDataParallel(std::shared_ptr<nn::modules::Module> module,
                                   DdpOptions options = {});
  /// Writes the trace (when asked for) and waits, bounded, for collectives
  /// still in flight. Destroyed in the middle of a synchronizing iteration
  /// (after its forward, before its backward finished), it aborts the group
  /// first, so that the peers waiting for this rank fail within moments;
  /// not after a forward that needs no backward (no-grad, NoSync, eval mode).
  ~DistributedDataParallel() override;

  /// Runs the wrapped module, with the synchronization described above.
  /// Training or eval mode is the wrapped module's own flag at this call
  /// (model->Eval() / model->Train() on the inner handle count; its
  /// submodules' flags do not decide it), as PyTorch reads
  /// module.training; this wrapper's is_training() is set to match.
  /// Throws std::invalid_argument when grad is enabled and a parameter's
  /// dtype or device is no longer the one its gradient bucket was built
  /// for (Module::To() after wrapping), or its shape is no longer the one
  /// it had then (Tensor::SetData with another shape), naming the first
  /// such parameter: call To() before wrapping. It aborts the group first: the peers would
  /// wait for this rank in a later synchronizing backward, even after a
  /// forward under NoSync.
  /// A synchronizing forward (training mode, grad enabled, outside NoSync,
  /// some synchronized parameter requiring grad: a forward while all are
  /// frozen records no path to them and needs no backward) throws
  /// std::runtime_error, after aborting the group, when the previous
  /// one's backward did not finish on this rank (none ran, none reached a
  /// parameter, or it threw). When the wrapped module's forward throws in a
  /// synchronizing forward, the group is aborted with that reason (the
  /// peers would wait for this rank's gradients) and the module's exception
  /// is rethrown: a batch that one rank cannot run is skipped by every rank
  /// deciding so before calling forward, not by catching its exception.
  nn::Tensor Forward(const nn::Tensor& input) override;
  std::vector<nn::Tensor> Forward(const std::vector<nn::Tensor>& inputs) override;
  using Module::operator();
  std::string TypeName() const override { return "DistributedDataParallel"; }

  /// The wrapped module.
  const std::shared_ptr<nn::modules::Module>& module() const { return module_; }
  ProcessGroup& process_group() const { return *pg_; }
  const DdpOptions& options() const { return options_; }

  /// Gradient accumulation without communication (see NoSyncGuard).
  NoSyncGuard NoSync() { return NoSyncGuard(*this); }
  /// Replaces the default all-reduce. Call before the first backward:
  /// later, it throws std::logic_error. On one process the hook runs too
  /// (its buckets are built at this call; without a hook one process has
  /// none), and it is refused from the first forward with grad enabled
  /// outside NoSync on, since no backward is seen before. Once per
  /// wrapper, as in PyTorch: a second call throws std::logic_error (also
  /// on a wrapper with no trainable parameters, whose hook never runs).
  void RegisterCommHook(CommHook hook);

  /// Statistics since the last ResetStats (or construction).
  DdpStats Stats() const;
  void ResetStats();
  /// Writes this rank's trace now (needs options.trace_prefix); a streamed
  /// one (a FIFO's, a terminal's) gets the events so far appended.
  void WriteTrace() const;

  /// Buckets in launch order, as parameter names (for tests and logs).
  std::vector<std::vector<std::string>> BucketParameterNames() const;
  /// The order the buckets are filled in, as indices into the parameters
  /// that require grad (registration order), once it is agreed: after the
  /// one-time rebuild (rank 0's observed gradient order), or from the start
  /// when DdpOptions::bucket_order gave it. Empty before that, on one rank
  /// without a communication hook, and when no rebuild happens (find_unused_parameters without
  /// static_graph, a hook with fixed buckets). Pass it as bucket_order to a
  /// later wrapper of the same model to start from the same buckets.
  std::vector<int64_t> BucketOrder() const;
  /// Synchronizing iterations run so far (on one rank without a
  /// communication hook, or with no trainable parameter: forwards with
  /// grad enabled outside NoSync, in training mode or outside Join, whether
  /// a backward followed or not).
  int64_t iterations() const;
  /// iterations() plus the synchronizing backwards this rank shadowed in
  /// Join::Wait (what a sharded optimizer's step follows).
  int64_t group_iterations() const;

  class Impl;

 private:
  friend class NoSyncGuard;
  friend class Join;
  std::string PartialTracePath() const;
  std::string TracePath() const;
  std::shared_ptr<nn::modules::Module> module_;
  DdpOptions options_;
  std::shared_ptr<ProcessGroup> pg_;
  std::unique_ptr<Impl> impl_;
};

/// Options of Join, as PyTorch's DistributedDataParallel.join(). The same
/// on every rank: they are compared with Join's first exchange of flags (at
/// the first training forward under it, or in Wait), and where they differ
/// every rank aborts the group and throws DistributedError naming each
/// option that differs and the ranks on each side (shadow_step: whether it
/// is set). `enable` is not compared: a disabled Join exchanges nothing.
struct JoinOptions {
  /// Gradients of iterations where some ranks have joined are divided by
  /// the initial world size (true) or by the number of ranks still active.
  bool divide_by_initial_world_size = true;
  /// Throw on every rank as soon as one rank runs out of inputs, instead of
  /// shadowing.
  bool throw_on_early_termination = false;
  /// The optimizer step to shadow, for an optimizer whose Step is itself
  /// collective (ZeroRedundancyOptimizer: `[&] { zero.Step(); }`), as
  /// PyTorch's Join([model, zero]). A joined rank calls it after each
  /// shadowed synchronizing backward, with the active ranks' averaged
  /// gradients in its .grad, so that it updates its own shard as the
  /// others expect and joins their broadcasts. The active ranks must step
  /// exactly once after each synchronizing backward, before the next
  /// forward. When it throws, Join::Wait aborts the group with that cause
  /// (the active ranks wait in their step's collectives) and rethrows.
  /// Empty: the optimizer is local (plain SGD, Adam, ...), and a joined
  /// rank's .grad is left as it was.
  std::function<void()> shadow_step;
  /// False: the Join does nothing, as PyTorch's Join(..., enable=False), so
  /// that uneven-input support is switched off in one place. The forwards
  /// send no flags and synchronize as outside Join (eval-mode ones with
  /// grad enabled included), Wait() returns at once with no collective (no
  /// shadowing, no final broadcast), and the other options have no effect
  /// (throw_on_early_termination throws nothing). A rank that runs out of
  /// inputs early is then as without Join: the others wait for it in their
  /// next synchronizing collective until the group's timeout. Must be the
  /// same on every rank; a disabled Join sends nothing to compare it with,
  /// so ranks that differ run different collectives (DDP_DEBUG=detail names
  /// the first one that differs). A disabled Join neither holds the process
  /// group nor puts the model in a Join: it refuses none of the other Joins
  /// that the class comment lists.
  bool enable = true;
};

/// Training with uneven inputs across ranks:
///
///   dist::Join join(ddp_model);
///   while (auto batch = loader.Next()) { ...forward, backward, step... }
///   join.Wait();  // this rank is out of data: shadow the others until all are
///
/// While a Join exists, every training forward tells the other ranks that
/// this rank is still active (one small all-reduce); a forward that does not
/// synchronize between a training forward and its backward (an evaluation)
/// sends nothing, not even its buffers. Wait() runs on a rank
/// that has no more inputs: it performs the collectives the active ranks
/// run (buffer broadcasts, all-reduces of zero gradients) until every rank
/// has called Wait(); then the parameters and buffers of the rank that ran
/// the most iterations are broadcast to all, so replicas end identical
/// (those the model had when it was wrapped, the same list on every rank;
/// the buffers only with DdpOptions::broadcast_buffers, as PyTorch: without
/// it they stay each rank's own).
/// Collective: every rank constructs a Join and calls Wait().
/// One model per process group: a Join shadows the collectives of its own
/// model only, so while one is in progress (constructed, Wait not returned)
/// a Join of another model on the same group throws std::logic_error
/// (PyTorch's Join([model_a, model_b]) has no counterpart here).
class Join {
 public:
  explicit Join(DistributedDataParallel& ddp, JoinOptions options = {});
  /// Leaves join mode (no communication; call Wait() for the protocol).
  ~Join();
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  /// See the class comment. Throws DistributedError when communication
  /// fails, or when throw_on_early_termination is set and a rank ran out of
  /// inputs first; std::runtime_error, as a synchronizing forward does,
  /// when this rank's last backward did not finish. Disabled
  /// (JoinOptions::enable false): returns at once, communicating nothing.
  void Wait();

 private:
  DistributedDataParallel& ddp_;
  JoinOptions options_;
  bool waited_ = false;
  // This Join is the one its process group has in progress (see Join::Join).
  bool holds_group_ = false;
};

}  // namespace ddp::dist

#endif  // DDP_DDP_DISTRIBUTED_DATA_PARALLEL_H_
