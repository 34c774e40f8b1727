#ifndef DDP_DDP_REDUCER_H_
#define DDP_DDP_REDUCER_H_

// The gradient reducer behind DistributedDataParallel (private to //ddp):
// buckets, the per-parameter hooks that fill them, the launch of each
// bucket's communication, the end-of-backward write-back, unused-parameter
// handling, the one-time bucket rebuild and the timing statistics.
//
// Everything here runs on the thread that runs forward and backward, except
// the collectives themselves (the process group's thread) and the timing of
// forwards run before a backward (ForwardStarted / ForwardEnded, which may
// run on another thread, and have a lock of their own). A bucket's
// memory is handed to the communication thread when it is launched and not
// touched by this thread again until its Work completed.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ddp/comm_hooks.h"
#include "ddp/process_group.h"
#include "ddp/trace.h"
#include "nn/tensor/tensor.h"

namespace ddp::dist::internal {

/// Groups parameters into buckets: walks `order` (parameter indices in the
/// order their gradients are expected), keeps one open bucket per
/// (dtype, device), and closes a bucket once it holds at least its limit
/// (first_bucket_bytes for the first bucket of each kind, bucket_bytes
/// after). A gradient of at least `inplace_bytes` (0: none) is a bucket of
/// its own, reduced in place in .grad with no copy: copying a large gradient
/// costs more than the one extra collective saves (Horovod fuses only
/// tensors below its threshold for the same reason); the small ones around
/// it keep filling the open bucket. Buckets come out in the order they
/// become complete (by their last parameter's position in `order`), which
/// is the order they are launched in.
std::vector<std::vector<size_t>> AssignBuckets(const std::vector<nn::Tensor>& params,
                                               const std::vector<size_t>& order,
                                               size_t first_bucket_bytes, size_t bucket_bytes,
                                               size_t inplace_bytes);

/// Makes CPU buckets take the copies GPU buckets take (tensor CopyFrom and
/// the kernel table's affine instead of memcpy and the host loop), so that
/// CPU tests cover their arithmetic. Process-wide; for tests.
void SetReducerDeviceCopiesForTesting(bool on);

/// Makes the next gradient bucket allocation of a Reducer in this process
/// (its buckets, at construction or rebuild, or the zero buckets a rank
/// that joined contributes) throw std::bad_alloc, as on a rank whose memory
/// ran out (after the ranks' models were compared, when nothing else fails
/// on one rank only). For tests.
void FailNextBucketAllocationForTesting();

/// Makes the next bucket order a Reducer in this process receives from
/// rank 0 at its rebuild arrive damaged (one index repeated in place of
/// another, as data corrupted on its way), on ranks other than 0. For tests.
void DamageNextReceivedBucketOrderForTesting();

struct ReducerOptions {
  size_t first_bucket_bytes = size_t{1} << 20;
  size_t bucket_bytes = size_t{25} << 20;
  size_t inplace_bytes = size_t{512} << 10;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  /// Parameter indices in the order the initial buckets are filled (a
  /// permutation, the same on every rank): the buckets are built from it
  /// and never rebuilt. Empty: reverse registration order, rebuilt once.
  std::vector<size_t> bucket_order;
  /// Every rank of the group runs its CPU collectives on the caller
  /// (ProcessGroup::collectives_on_caller), as agreed across the ranks when
  /// DDP was made. Only then are CPU buckets launched together at the end
  /// of backward: a rank's own setting may differ from its peers', and a
  /// local choice would move the buckets relative to other collectives
  /// issued during backward (SyncBatchNorm's) on this rank alone.
  bool all_ranks_on_caller = false;
};

/// Sums of per-iteration timings (seconds), reset by the owner.
struct ReducerTimes {
  int64_t iterations = 0;
  double backward_compute = 0;
  double backward_comm = 0;
  double overlap = 0;
  double exposed = 0;
};

/// The timestamps of one synchronizing backward, for AddIterationTimes.
struct IterationTiming {
  using TimePoint = std::chrono::steady_clock::time_point;
  struct Collective {
    TimePoint started, finished;  ///< Work::started / finished; TimePoint{}: not known
    bool on_caller = false;       ///< ran on the thread that runs backward
  };
  TimePoint prepared;   ///< forward's end (Prepare)
  TimePoint last_grad;  ///< the last gradient hook's end
  /// The wrapper's forwards run between `prepared` and the first gradient
  /// of an awaited backward (under NoSync or NoGradGuard, in either mode):
  /// forward's time, in forward_ms, not backward compute.
  std::chrono::steady_clock::duration joined_forwards{};
  TimePoint end;        ///< Finalize's end
  std::vector<Collective> buckets;  ///< in launch order
  Collective used_map;  ///< the unused-parameter map's all-reduce; TimePoint{} where none ran
};

/// Adds one iteration's timings to `times` (see DdpStats for the meaning).
void AddIterationTimes(const IterationTiming& timing, ReducerTimes& times);

class Reducer {
 public:
  /// `params`: the parameters that require grad, in registration order,
  /// with their names. Registers a post-accumulate-grad hook on each.
  Reducer(std::vector<std::pair<std::string, nn::Tensor>> params, std::shared_ptr<ProcessGroup> pg,
          ReducerOptions options, std::shared_ptr<TraceRecorder> trace);
  /// Removes the hooks; aborts the group when a synchronizing iteration is
  /// left unfinished in a way the peers would wait on (backward never
  /// started, stopped partway, or its end never ran while they all-reduce
  /// the unused-parameter map), but not after an eval-mode forward that no
  /// backward followed; then waits (bounded) for buckets still in flight,
  /// aborting the group for one that outlives the wait.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// What the wrapped model says of a tensor now: its name where it is one
  /// of the model's parameters ("" otherwise), and whether it became one
  /// after the model was wrapped.
  struct ModelParameter {
    std::string name;
    bool added = false;
  };
  /// One answer per tensor (one walk of the model).
  using ModelParameterNames = std::function<std::vector<ModelParameter>(const std::vector<nn::Tensor>&)>;
  /// Lets errors tell a parameter taken out of the model after wrapping
  /// (Module::ReplaceChild) from one that got no gradient, and lets the
  /// graph walk of find_unused_parameters refuse a parameter added after
  /// wrapping, whose gradient no bucket would take. Called on error paths
  /// and, in that walk, only for leaves that require grad and are not
  /// parameters of the buckets (none, unless an input requires grad).
  void SetModelParameterNames(ModelParameterNames names) { model_names_ = std::move(names); }

  /// Sets the communication hook, once (a second call throws
  /// std::logic_error); throws after the first backward.
  void SetCommHook(CommHook hook);

  /// Throws (after aborting the group, so that peers stop waiting for this
  /// rank) when a previous backward ended with parameters that got no
  /// gradient (that backward threw first), and, before a
  /// `synchronizing` forward, when the last synchronizing forward's
  /// reduction never finished (no backward, none that reached a parameter,
  /// or one that threw); a forward that `communicates` otherwise (buffers,
  /// Join's flags) is refused too when that backward launched buckets. Once
  /// thrown, every later forward throws the same. `eval_forward_in_join`:
  /// the forward is an eval-mode one with grad enabled under Join (pass
  /// `synchronizing` too), and the message says so.
  void CheckPreviousIteration(bool synchronizing, bool communicates = false, bool eval_forward_in_join = false);

  /// Empty while every parameter has the dtype, device and shape its
  /// bucket was built for; otherwise a message naming the first
  /// (registration order) that does not, with both, as after Module::To()
  /// on the wrapped model, or Tensor::SetData with another shape (PyTorch's
  /// `p.data = ...`). Local and cheap (three comparisons per parameter):
  /// for every forward. The caller adds whether it aborted the group.
  std::string ParameterChange() const;

  /// Whether some parameter of the buckets requires grad now. A forward
  /// while none does (every one frozen after wrapping) records no path to
  /// them: its backward fires no gradient hook. Stops at the first that
  /// does (usually the first parameter).
  bool AnyParameterRequiresGrad() const;

  /// Whether a synchronizing training forward prepared an iteration whose
  /// backward has not started (no gradient hook fired since).
  bool awaiting_backward() const { return unfinished_ && !finalize_queued_ && !backward_optional_; }

  /// Whether the next synchronizing iteration starts with RebuildBuckets:
  /// after the group's first synchronizing iteration, the same on every
  /// rank (an iteration shadowed under Join counts).
  bool rebuild_pending() const { return rebuild_pending_; }
  /// Collective: rebuilds the buckets from rank 0's observed gradient order.
  /// When the new buckets cannot be made on this rank, aborts the group
  /// with the cause, rethrows, and every later forward throws that.
  void RebuildBuckets();
  /// The order the buckets were last built from when it was agreed (by the
  /// rebuild, or given as ReducerOptions::bucket_order); empty before.
  const std::vector<size_t>& agreed_order() const { return agreed_order_; }

  /// End of a synchronizing forward: arms the hooks for one backward, with
  /// gradients divided by `divisor`; with find_unused_parameters, walks the
  /// graph from `outputs` for the unreachable parameters, which the first
  /// gradient hook of backward marks ready. `backward_optional` (an
  /// eval-mode forward): the next synchronizing forward does not count a
  /// missing backward as an unfinished iteration, as long as no gradient
  /// hook fired; static_graph does not learn from such a forward.
  void PrepareForBackward(const std::vector<nn::Tensor>& outputs, double divisor,
                          bool backward_optional = false);
  /// Backward's compute time is counted from `forward_end`, the end of the
  /// forward that called PrepareForBackward (whose graph walk is forward's
  /// time); call it before backward starts.
  void StartBackwardClock(std::chrono::steady_clock::time_point forward_end);
  /// Where a forward began, when a backward was awaited then (see
  /// ForwardStarted); `backward` is 0 otherwise.
  struct GapForward {
    uint64_t backward = 0;  ///< which awaited backward (PrepareForBackward's count)
    std::chrono::steady_clock::time_point start{};
  };
  /// The wrapper's forward begins at `start` (before anything else of it,
  /// on every forward). Returns what ForwardEnded takes: which awaited
  /// backward (see awaiting_backward(): a training forward's, not an
  /// eval-mode forward's optional one) was waiting for its first gradient
  /// then, if any. One relaxed atomic load when none was.
  GapForward ForwardStarted(std::chrono::steady_clock::time_point start);
  /// That forward returned at `end`. When it began while an awaited
  /// backward waited for its first gradient, and the same backward still
  /// does (the forward prepared none of its own), it is forward time
  /// whatever its mode and grad state (under NoSync, NoGradGuard, in eval
  /// mode): its span is left out of that backward's compute time and trace
  /// event, and true is returned, for the wrapper to count it in
  /// forward_ms. Memory stays bounded however many such forwards run: the
  /// spans are summed, and only the first kTracedGapForwards are kept for
  /// the trace (later ones widen the last kept one). A forward that throws
  /// gets no ForwardEnded: its time stays in backward compute. Both may be
  /// called on another thread than backward's (their state has a lock).
  bool ForwardEnded(const GapForward& forward, std::chrono::steady_clock::time_point end);
  /// Holes cut in a backward's "backward compute" trace event by forwards
  /// run before its first gradient: at most this many plus one pieces.
  static constexpr size_t kTracedGapForwards = 4;
  /// A forward that will not synchronize but may be backpropagated (NoSync):
  /// hooks only accumulate until the next PrepareForBackward. An iteration
  /// prepared before and not finalized stays unfinished. `reject_gradients`
  /// (an eval-mode forward under Join, which cannot be shadowed): a
  /// gradient before the next PrepareForBackward throws instead.
  /// Except while a synchronizing forward's iteration awaits its backward
  /// (no gradient hook fired since it prepared it): then the hooks stay
  /// armed, as in PyTorch, where the forward that prepared a backward
  /// decides whether it synchronizes, so that a = ddp(x1); {NoSync; b =
  /// ddp(x2);} Backward(f(a, b)) still averages every gradient. An
  /// eval-mode forward's (optional) backward counts too, but not under Join
  /// (`in_join`): there the ranks that ran out of inputs shadow only what a
  /// training forward's flags announced, so it accumulates locally as
  /// before. With find_unused_parameters the unused set
  /// stays the one that forward's walk found (as in PyTorch): a parameter
  /// reached only through `outputs` that then gets a gradient in that
  /// backward fails it on every rank, naming the parameter and NoSync.
  void Disarm(const std::vector<nn::Tensor>& outputs, bool reject_gradients = false, bool in_join = false);
  /// The graph walk of find_unused_parameters, for a forward with grad
  /// enabled that prepares no backward (under NoSync, or while every
  /// parameter of the buckets is frozen): throws, after aborting the group,
  /// as PrepareForBackward's walk does, when `outputs` reach a parameter
  /// added to the model after wrapping (its gradient would accumulate in
  /// .grad, no bucket's, and stay each rank's own). Walks the graph: the
  /// caller calls it only while the model holds such a parameter.
  void RefuseAddedParametersReachedFrom(const std::vector<nn::Tensor>& outputs);
  /// Whether a NoSync scope is open: a gradient that arrives after the
  /// last synchronizing backward finalized (a further backward through its
  /// graph) then accumulates locally instead of being an error.
  void SetNoSync(bool on) { no_sync_ = on; }

  /// Join: runs the collectives of one synchronizing backward with zero
  /// gradients, for ranks that have run out of inputs; `divisor` is the one
  /// the active ranks use. With `write_gradients` the reduced result (the
  /// active ranks' average) becomes this rank's .grad, as after a backward
  /// of its own, for an optimizer step that must be shadowed too (a
  /// sharded optimizer updating this rank's shard), and a parameter unused
  /// on every rank (find_unused_parameters) has none; otherwise .grad is
  /// left alone. Nothing is written when the hook consumes the buckets.
  void ShadowBackward(double divisor, bool write_gradients = false);

  /// Whether an unused-parameter map is all-reduced after each backward.
  bool handles_unused() const { return options_.find_unused_parameters || options_.static_graph; }

  const ReducerTimes& times() const { return times_; }
  void ResetTimes() { times_ = {}; }
  std::vector<size_t> BucketBytes() const;
  std::vector<std::vector<std::string>> BucketNames() const;
  int64_t iterations() const { return iterations_; }
  /// Parameters unused in this iteration whose .grad (their bucket view)
  /// is kept as a copy until its end (see MarkUnusedReady); none once it
  /// ended or failed. For tests.
  size_t stale_copies() const {
    return static_cast<size_t>(std::count_if(stale_.begin(), stale_.end(), [](const nn::Tensor& t) { return t.defined(); }));
  }
  /// iterations() and the ones this rank shadowed in Join::Wait.
  int64_t group_iterations() const { return group_iterations_; }

 private:
  struct Bucket {
    nn::DType dtype;
    nn::Device device;
    int64_t numel = 0;
    // One parameter: reduced in place in its .grad (buffer stays undefined
    // and `solo` holds the tensor being reduced this iteration), or in a
    // copy when another post-accumulate hook runs after DDP's on it.
    bool is_solo = false;
    nn::Tensor buffer;            // flat [numel], several parameters
    nn::Tensor solo;
    bool solo_copied = false;     // `solo` is a copy, written back into .grad by Finalize
    std::vector<size_t> params;   // indices into params_
    std::vector<int64_t> offsets; // element offset of each parameter
    // "bucket 3 of 4 parameters `fc2.bias` ... `fc1.weight`": the default
    // label of the collectives a communication hook issues without one.
    std::string hook_label;
    size_t pending = 0;           // gradients still missing this iteration
    Work work;
    // What the communication hook was given at this iteration's launch:
    // kept until Finalize has waited for every bucket's Work, so that a
    // hook's task may refer to it while it runs (comm_hooks.h), and no
    // longer: for a solo bucket it holds the gradient's memory.
    std::unique_ptr<GradBucket> grad_bucket;
  };
  struct Slot {
    size_t bucket = 0;
    nn::Tensor view;  // the parameter's part of the bucket, in its shape (not for solo buckets)
  };

  void BuildBuckets(const std::vector<size_t>& order);
  void OnGradReady(size_t index);
  // `used_here`: this rank's backward produced the gradient (else the
  // parameter is unused here, and a .grad it holds is stale: contributed,
  // but never reduced in place).
  void MarkReady(size_t index, bool used_here = true);
  // MarkReady for a parameter unused here. A stale .grad that is its bucket
  // view is contributed (as PyTorch does) and reduced in place, so a copy
  // is kept first: when no rank used the parameter it gets that .grad back
  // bit for bit (the reduction changes it, in the last bit on 3+ ranks even
  // where every rank held the same). Likewise a .grad of its own that
  // gradient_as_bucket_view is about to replace by the view.
  void MarkUnusedReady(size_t index);
  // A gradient for a parameter this iteration took as unused: records the
  // error for the next forward, aborts the group and throws.
  [[noreturn]] void FailUnusedParameterGradient(size_t index);
  void LaunchReadyBuckets();
  Work Launch(size_t b, const nn::Tensor& buffer);
  // Whether the average is taken inside the all-reduce (kAvg) instead of
  // by scaling the gradients first: the default hook, dividing by the
  // world size. Saves a pass over every gradient in view mode.
  // Not for f16 buckets: the sum of the ranks' gradients may pass f16's
  // largest value (65504) where each gradient does not, so they are divided
  // first (as PyTorch's default hook divides before the sum) and summed.
  bool FusedAverage(double divisor, nn::DType dtype) const {
    return default_hook_ && internal::PlanNoHookAverage(divisor, pg_->size(), dtype).op == transport::ReduceOp::kAvg;
  }
  void Finalize();
  // The end-of-backward callback, queued by the gradient hook of forward's
  // outputs on the pass that reaches them, or (none reached) by the first
  // gradient: Finalize, unless it was queued by the first gradient on the
  // pass running then and a parameter is still missing: that pass may be
  // one nested in the backward (activation checkpointing), so it moves
  // once to the outermost pass on this thread, which ends after them all.
  // Nothing before any parameter received a gradient.
  void OnPassEnd();
  // Queues OnPassEnd on the pass running now, or on the outermost one; a
  // callback queued before it (or before the last PrepareForBackward) then
  // does nothing.
  void QueueOnPassEnd(bool outermost);
  void ReleaseOutputs();
  // The end of a synchronizing iteration, run or shadowed: the rebuild is
  // decided from the group's count, the same on every rank.
  void CountGroupIteration();
  // Waits for the collectives still in flight (bounded); false when one
  // still runs after the group was aborted for it: its memory is not free.
  bool WaitInFlight();
  // After an iteration failed: drops what its buckets took for it (a solo
  // bucket's gradient, the GradBucket given to the hook), for each bucket
  // whose collective has ended, so that a failed backward does not keep
  // them until the wrapper is destroyed (no later iteration reuses them);
  // and the copies of stale gradients (ReleaseStaleCopies).
  void ReleaseFailedBuckets();
  // After an iteration failed: drops the copies of stale gradients that
  // its end would have given back (stale_). Copies of their own, which no
  // collective touches: safe at any point of the failure.
  void ReleaseStaleCopies();
  bool IsView(size_t index, const nn::Tensor& grad) const;
  // The parameters that had their gradient in this backward, or were
  // marked ready without one (unused): ready_count_, and under
  // static_graph's delay_ready_ those that got a gradient not yet marked.
  size_t GradientsIn() const;
  // Where static_graph counted the gradients, for messages: "the first
  // iteration", or the later one that did (after a first one that a NoSync
  // forward joined, or an eval-mode one).
  std::string CountedIn() const;
  // `others`, when given, receives the reached leaves that require grad and
  // are not parameters of the buckets.
  std::vector<size_t> UnreachableParameters(const std::vector<nn::Tensor>& outputs,
                                            std::vector<nn::Tensor>* others = nullptr) const;
  // Throws (after aborting the group) when one of `leaves` is a parameter
  // of the model now: added after wrapping, no bucket has it.
  void RefuseAddedParameters(const std::vector<nn::Tensor>& leaves);

  std::vector<std::string> names_;
  std::vector<nn::Tensor> params_;
  std::vector<nn::Shape> shapes_;  // each parameter's shape at construction: its bucket slot's
  std::shared_ptr<ProcessGroup> pg_;
  ReducerOptions options_;
  std::shared_ptr<TraceRecorder> trace_;
  CommHook hook_;
  bool default_hook_ = true;
  bool local_gradients_ = false;  // the hook takes undivided gradients
  bool grad_write_back_ = true;   // buckets are copied back into .grad after backward
  std::vector<nn::HookHandle> hook_handles_;
  ModelParameterNames model_names_;

  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;

  // Iteration state.
  bool armed_ = false;          // hooks act (between prepare and finalize)
  bool unfinished_ = false;     // prepared, and Finalize has not completed since
  bool finalized_ = false;      // Finalize succeeded and no forward ran since
  bool no_sync_ = false;        // a NoSync scope is open
  bool finalize_queued_ = false;
  bool backward_optional_ = false; // prepared by an eval-mode forward
  bool reject_gradients_ = false;  // disarmed by an eval-mode forward under Join
  double divisor_ = 1;
  std::vector<char> ready_;
  bool finalize_moved_ = false;  // OnPassEnd moved the callback to the outermost pass
  bool prepared_in_pass_ = false;  // the forward that prepared this backward ran inside a backward pass
  // Forward's outputs, with a gradient hook that queues the end-of-backward
  // callback on the pass that goes through them (the backward of this
  // iteration, whatever passes enclose it or are nested in it). A training
  // forward's are kept until the end of the iteration (or until no backward
  // is armed for them); an eval-mode forward's only hooked, not kept.
  std::vector<nn::Tensor> watched_outputs_;
  std::vector<nn::HookHandle> output_hooks_;
  uint64_t pass_end_token_ = 0;  // the OnPassEnd callback queued last; earlier ones do nothing
  bool on_backward_pass_ = false;  // that hook queued the callback
  // Expires with the reducer: a callback queued on a pass that outlives it
  // (one enclosing the forward) then does nothing.
  std::shared_ptr<char> alive_ = std::make_shared<char>(0);
  std::vector<int> arrivals_;    // gradients each parameter received in this backward
  // static_graph: no parameter is marked ready before the end of backward
  // (its gradients are being counted, see static_arrivals_).
  bool delay_ready_ = false;
  std::vector<size_t> unused_;  // found unused by this iteration's forward
  std::vector<char> is_unused_; // the same, per parameter
  bool unused_from_walk_ = false; // found by this forward's graph walk (not static_graph's)
  std::vector<char> reached_under_no_sync_;  // an unused parameter reachable from a NoSync forward's
                                             // outputs run while this backward awaited (for the error)
  std::vector<char> detached_;  // .grad was moved off the memory being reduced (the parameter is
                                // unused, or a hook runs after DDP's): Finalize sets it back
  std::vector<nn::Tensor> stale_; // a parameter unused here whose .grad is its bucket view: that
                                  // .grad as it was, restored by Finalize when no rank used it
  size_t ready_count_ = 0;
  size_t next_launch_ = 0;
  // Every bucket launches once the last is ready (set by BuildBuckets): the
  // group runs CPU collectives on the caller, where one launched early
  // overlaps nothing (see LaunchReadyBuckets).
  bool launch_together_ = false;
  nn::Tensor used_;             // i32 [n]: 1 where a hook fired since the last synchronizing
                                // backward ended (NoSync backwards included)
  Work used_work_;
  std::string pending_error_;   // thrown by every later forward
  int64_t iterations_ = 0;       // synchronizing backwards this rank ran
  int64_t group_iterations_ = 0; // the same, and those it shadowed (Join)
  bool comm_hook_locked_ = false;

  // Bucket rebuild and static graph.
  std::vector<size_t> ready_order_;  // group's first iteration, as hooks fired
  bool rebuild_pending_ = false;
  bool rebuilt_ = false;
  std::vector<size_t> agreed_order_;  // see agreed_order()
  std::vector<size_t> static_unused_;  // static graph: learned in iteration 1
  // static graph: the gradients each parameter received in iteration 1 (a
  // parameter used both inside and outside a re-entrantly checkpointed
  // segment gets two); from then on it is marked ready on its last one.
  std::vector<int> static_arrivals_;
  bool static_known_ = false;
  // static_arrivals_ hold a count: from the first iteration that prepared
  // a backward no NoSync forward joined (one that did counts its passes
  // too, which later iterations need not run).
  bool static_counted_ = false;
  // A forward under NoSync ran while this iteration's backward was
  // awaited: its gradients join that backward (Disarm), with passes of
  // their own where it checkpoints re-entrantly, so that the counts of
  // static_arrivals_ may not hold; the iteration reduces every gradient at
  // the end of backward instead (delay_ready_).
  bool no_sync_joined_ = false;
  int64_t counted_in_ = 0;  // iterations() of the backward that counted static_arrivals_
  bool static_learning_ = false;  // this backward's forward set static_unused_

  // Timing of the current iteration.
  using Clock = std::chrono::steady_clock;
  Clock::time_point prepared_at_{};
  Clock::time_point last_grad_at_{};
  // Forwards run while an awaited backward waits for its first gradient
  // (ForwardStarted / ForwardEnded). Those may run on another thread than
  // backward, which closes the gap at its first gradient and reads the
  // spans in Finalize: gap_mu_ guards the fields below it; gap_open_ is
  // also read without it, so that a forward outside a gap takes no lock.
  std::atomic<bool> gap_open_{false};  // awaiting_backward(), as of the last change under gap_mu_
  std::mutex gap_mu_;
  uint64_t gap_backward_ = 0;          // PrepareForBackward calls so far
  Clock::time_point gap_from_{};       // the awaited backward's prepared_at_
  Clock::duration gap_forwards_{};     // see IterationTiming::joined_forwards
  Clock::time_point gap_covered_{};    // the latest end of a span summed into gap_forwards_
  // The first kTracedGapForwards spans (start, end) for the trace; a later
  // forward widens the last one.
  std::array<std::pair<Clock::time_point, Clock::time_point>, kTracedGapForwards> gap_spans_{};
  size_t gap_span_count_ = 0;
  ReducerTimes times_;
};

}  // namespace ddp::dist::internal

#endif  // DDP_DDP_REDUCER_H_
