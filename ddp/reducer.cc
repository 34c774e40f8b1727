#include "ddp/reducer.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <unordered_map>

#include "nn/autograd/engine.h"
#include "nn/autograd/node.h"
#include "nn/ops/dispatch.h"

namespace ddp::dist::internal {

using std::chrono::duration;

namespace {

double Seconds(std::chrono::steady_clock::duration d) { return duration<double>(d).count(); }

std::atomic<bool> generic_copies{false};
std::atomic<bool> fail_next_bucket_allocation{false};
std::atomic<bool> damage_next_received_order{false};

// Whether `t` takes the host loops (memcpy, ScaleCopy) rather than the
// device-agnostic tensor operations a GPU bucket uses.
bool HostLoops(const nn::Tensor& t) {
  return t.device().is_cpu() && !generic_copies.load(std::memory_order_relaxed);
}

void ScaleInto(const nn::Tensor& dst, const nn::Tensor& src, double factor) {
  internal::ScaleTensor(dst, src, factor, HostLoops(dst));
}

void ZeroTensor(const nn::Tensor& t) {
  if (HostLoops(t) && t.is_contiguous()) {
    std::memset(t.data_ptr(), 0, t.nbytes());
    return;
  }
  nn::NoGradGuard guard;
  t.Zero();
}

// Copies the reduced gradient `reduced` into .grad `grad` (same shape).
void WriteBack(const nn::Tensor& grad, const nn::Tensor& reduced) {
  if (grad.is_contiguous() && grad.dtype() == reduced.dtype() && HostLoops(grad) && HostLoops(reduced)) {
    std::memcpy(grad.data_ptr(), reduced.data_ptr(), reduced.nbytes());
    grad.storage()->BumpVersion();
  } else {
    nn::NoGradGuard guard;
    grad.CopyFrom(reduced);
  }
}

// The label a hook's unlabelled collectives take for bucket `b`: its index
// and parameters, at most two names whatever its size ("bucket 3 of 4
// parameters `fc2.bias` ... `fc1.weight`"), so that the debug-mode
// fingerprint keeps room for the dtype and shape.
std::string HookLabel(size_t b, const std::vector<size_t>& params,
                      const std::vector<std::string>& names) {
  std::string label = "bucket " + std::to_string(b) + " of ";
  if (params.size() > 2) label += std::to_string(params.size()) + " parameters ";
  label += "`" + names[params.front()] + "`";
  if (params.size() == 2) label += ", `" + names[params.back()] + "`";
  if (params.size() > 2) label += " ... `" + names[params.back()] + "`";
  return label;
}

}  // namespace

void SetReducerDeviceCopiesForTesting(bool on) {
  generic_copies.store(on, std::memory_order_relaxed);
}

void FailNextBucketAllocationForTesting() { fail_next_bucket_allocation.store(true); }

void DamageNextReceivedBucketOrderForTesting() { damage_next_received_order.store(true); }

std::vector<std::vector<size_t>> AssignBuckets(const std::vector<nn::Tensor>& params,
                                               const std::vector<size_t>& order,
                                               size_t first_bucket_bytes, size_t bucket_bytes,
                                               size_t inplace_bytes) {
  struct Open {
    std::vector<size_t> members;
    size_t bytes = 0;
    size_t limit = 0;
  };
  using Key = std::tuple<int, int, int>;  // dtype, device type, device index
  std::map<Key, Open> open;
  std::vector<std::vector<size_t>> result;
  for (size_t i : order) {
    const nn::Tensor& p = params.at(i);
    const Key key{static_cast<int>(p.dtype()), static_cast<int>(p.device().type), p.device().index};
    auto [it, inserted] = open.try_emplace(key);
    Open& o = it->second;
    if (inserted) o.limit = first_bucket_bytes;
    if (inplace_bytes > 0 && p.nbytes() >= inplace_bytes) {
      result.push_back({i});
      continue;
    }
    o.members.push_back(i);
    o.bytes += p.nbytes();
    if (o.bytes >= o.limit) {
      result.push_back(std::move(o.members));
      o.members.clear();
      o.bytes = 0;
      o.limit = bucket_bytes;
    }
  }
  for (auto& [key, o] : open) {
    if (!o.members.empty()) result.push_back(std::move(o.members));
  }
  // Launch order = the order in which buckets become complete.
  std::vector<size_t> position(params.size(), 0);
  for (size_t k = 0; k < order.size(); ++k) position[order[k]] = k;
  std::stable_sort(result.begin(), result.end(), [&](const auto& a, const auto& b) {
    return position[a.back()] < position[b.back()];
  });
  return result;
}

Reducer::Reducer(std::vector<std::pair<std::string, nn::Tensor>> params,
                 std::shared_ptr<ProcessGroup> pg, ReducerOptions options,
                 std::shared_ptr<TraceRecorder> trace)
    : pg_(std::move(pg)), options_(options), trace_(std::move(trace)), hook_(hooks::AllReduceHook()) {
  for (auto& [name, p] : params) {
    names_.push_back(name);
    params_.push_back(p);
    shapes_.push_back(p.shape());
  }
  const size_t n = params_.size();
  ready_.assign(n, 0);
  arrivals_.assign(n, 0);
  static_arrivals_.assign(n, 0);
  is_unused_.assign(n, 0);
  reached_under_no_sync_.assign(n, 0);
  detached_.assign(n, 0);
  stale_.assign(n, nn::Tensor());
  used_ = nn::Zeros({static_cast<int64_t>(n)}, {.dtype = nn::DType::kInt32});
  if (!options_.bucket_order.empty()) {
    // An order agreed before (a resumed run's): as if already rebuilt.
    agreed_order_ = options_.bucket_order;
    rebuilt_ = true;
    BuildBuckets(agreed_order_);
  } else {
    std::vector<size_t> reverse(n);
    for (size_t i = 0; i < n; ++i) reverse[i] = n - 1 - i;
    BuildBuckets(reverse);
  }
  for (size_t i = 0; i < n; ++i) {
    hook_handles_.push_back(
        params_[i].RegisterPostAccumulateGradHook([this, i](const nn::Tensor&) { OnGradReady(i); }));
  }
}

Reducer::~Reducer() {
  for (nn::HookHandle& h : hook_handles_) h.Remove();
  // A synchronizing forward prepared an iteration that this rank will not
  // finish, and the peers may be waiting in its collectives: they are told
  // now rather than at the group's timeout. Not when an error was already
  // recorded (the group was aborted with it), nor after an eval-mode
  // forward that no backward followed, whose backward is optional (nothing
  // was launched, and the peers expect nothing). Forwards under no-grad or
  // NoSync never prepare an iteration.
  const bool optional_and_skipped = backward_optional_ && !finalize_queued_;
  if (unfinished_ && pending_error_.empty() && !optional_and_skipped) {
    std::string state;
    if (!finalize_queued_) {
      // Forward ran, backward never started (the loss computation threw, or
      // the caller skipped it): the peers wait in their bucket reductions.
      state = "a synchronizing forward ran but its backward never started (no parameter received a "
              "gradient), so none of the gradient buckets its peers wait for will come";
    } else if (const size_t had = GradientsIn(); had < params_.size()) {
      state = "its backward stopped partway (" + std::to_string(had) + " of " +
              std::to_string(params_.size()) +
              " parameters had their gradients), so the gradient buckets its peers wait for will not come";
    } else if (handles_unused() && !used_work_.valid()) {
      // Every bucket was launched, but the end of backward (Finalize) never
      // ran, as when a later hook on the last gradient threw: the peers wait
      // in the all-reduce of the unused-parameter map.
      state = "every parameter had its gradient but the end of its backward never ran (did an exception "
              "leave backward after the last gradient?), so the unused-parameter map its peers wait to "
              "all-reduce will not come";
    }
    // Otherwise every collective of the iteration was launched (a wait
    // that failed in Finalize): the peers are not left waiting for this rank.
    if (!state.empty()) {
      pg_->Abort(transport::FailedPreconditionError("DistributedDataParallel on rank " +
                                                    std::to_string(pg_->rank()) +
                                                    " was destroyed in the middle of an iteration: " + state));
    }
  }
  if (!WaitInFlight()) {
    // A hook's task still running may refer to its GradBucket: left in
    // memory, as the bucket's tensors are (the task holds them).
    for (Bucket& b : buckets_) {
      if (b.work.valid() && b.grad_bucket) KeepForever(std::move(b.grad_bucket));
    }
    std::fprintf(stderr,
                 "[ddp] rank %d: a gradient bucket's collective was still running when "
                 "DistributedDataParallel was destroyed (the group was aborted); it may still "
                 "write its bucket, and the .grad of its parameters where they share its memory, "
                 "until it returns\n",
                 pg_->rank());
  }
}

bool Reducer::WaitInFlight() {
  // Each wait is bounded by the group's timeout; failed collectives are
  // reported elsewhere. One still running after it may go on reading and
  // writing its bucket, so that memory must not be reused: the group is
  // aborted, which ends its own collectives within moments, and the wait
  // repeated once. A Work that still has not finished stays in place.
  bool aborted = false;
  // `bucket`: the bucket whose collective `work` is; -1 for the unused
  // parameter map's (named only when it is late).
  auto wait = [&](Work& work, int64_t bucket) {
    if (!work.valid()) return true;
    if (work.WaitFor(Clock::now() + pg_->options().timeout).code() == transport::StatusCode::kTimedOut &&
        !work.IsCompleted()) {
      if (!aborted) {
        aborted = true;
        pg_->Abort(transport::TimedOutError(
            "DistributedDataParallel on rank " + std::to_string(pg_->rank()) + ": " +
            (bucket < 0 ? std::string("the all-reduce of the unused parameter map")
                        : "the collective of gradient bucket " + std::to_string(bucket)) +
            " was still in flight after the group's timeout, when its memory was to be reused"));
      }
      (void)work.WaitFor(Clock::now() + pg_->options().timeout);
      if (!work.IsCompleted()) return false;
    }
    work = Work();
    return true;
  };
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!wait(buckets_[b].work, static_cast<int64_t>(b))) return false;
  }
  return wait(used_work_, -1);
}

void Reducer::ReleaseFailedBuckets() {
  for (Bucket& b : buckets_) {
    // A hook's task still running may refer to its GradBucket.
    if (b.work.valid() && !b.work.IsCompleted()) continue;
    b.work = Work();
    b.grad_bucket.reset();
    b.solo = nn::Tensor();
    b.solo_copied = false;
  }
  ReleaseStaleCopies();
}

void Reducer::ReleaseStaleCopies() { std::fill(stale_.begin(), stale_.end(), nn::Tensor()); }

void Reducer::SetCommHook(CommHook hook) {
  if (comm_hook_locked_) {
    throw std::logic_error(
        "DistributedDataParallel::RegisterCommHook: call it before the first backward");
  }
  if (!hook) throw std::invalid_argument("DistributedDataParallel::RegisterCommHook: empty hook");
  // One hook per wrapper, as PyTorch's reducer: replaced, the first one's
  // state (a PowerSGD state kept for a checkpoint) or its bucket rule
  // (WithFixedBuckets) would stop applying with no sign.
  if (!default_hook_) {
    throw std::logic_error(
        "DistributedDataParallel::RegisterCommHook: a communication hook is already registered; a wrapper "
        "takes one (combine them in one hook)");
  }
  local_gradients_ = hook.on_local_gradients();
  grad_write_back_ = hook.grad_write_back();
  // Before the first backward no rebuild ran: whether one will is the
  // hook's to say, unless the buckets were built from a given order, which
  // a hook with fixed buckets keeps as well.
  rebuilt_ = hook.fixed_buckets() || !options_.bucket_order.empty();
  hook_ = std::move(hook);
  default_hook_ = false;
}

void Reducer::BuildBuckets(const std::vector<size_t>& order) {
  const std::vector<std::vector<size_t>> assignment =
      AssignBuckets(params_, order, options_.first_bucket_bytes, options_.bucket_bytes,
                    options_.inplace_bytes);
  std::vector<Bucket> buckets;
  std::vector<Slot> slots(params_.size());
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    const nn::Tensor& first = params_[assignment[b][0]];
    bucket.dtype = first.dtype();
    bucket.device = first.device();
    int64_t numel = 0;
    for (size_t i : assignment[b]) {
      bucket.params.push_back(i);
      bucket.offsets.push_back(numel);
      numel += params_[i].numel();
    }
    bucket.numel = numel;
    bucket.is_solo = bucket.params.size() == 1;
    bucket.hook_label = HookLabel(b, bucket.params, names_);
    if (!bucket.is_solo) {
      if (fail_next_bucket_allocation.exchange(false)) throw std::bad_alloc();
      bucket.buffer = pg_->CollectiveZeros({numel}, {.dtype = bucket.dtype, .device = bucket.device});
    }
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const size_t i = bucket.params[k];
      slots[i].bucket = b;
      if (!bucket.is_solo) {
        slots[i].view = bucket.buffer.Narrow(0, bucket.offsets[k], params_[i].numel()).View(params_[i].shape());
      }
    }
    buckets.push_back(std::move(bucket));
  }
  if (options_.gradient_as_bucket_view) {
    // Gradients that exist (accumulated ones included) move into the new views.
    // A parameter alone in its new bucket has no view: were its .grad a
    // view into an old bucket, it would keep that whole buffer in memory
    // for as long as the .grad lives, so it gets storage of its own.
    for (size_t i = 0; i < params_.size(); ++i) {
      const nn::Tensor& grad = params_[i].grad();
      if (!grad.defined()) continue;
      nn::NoGradGuard guard;
      if (!slots[i].view.defined()) {
        const bool in_old_bucket =
            !slots_.empty() && !buckets_[slots_[i].bucket].is_solo &&
            grad.storage() == buckets_[slots_[i].bucket].buffer.storage();
        if (in_old_bucket) params_[i].set_grad(grad.Clone());
        continue;
      }
      slots[i].view.CopyFrom(grad);
      params_[i].set_grad(slots[i].view);
    }
  }
  buckets_ = std::move(buckets);
  slots_ = std::move(slots);
  launch_together_ = options_.all_ranks_on_caller &&
                     std::all_of(buckets_.begin(), buckets_.end(), [](const Bucket& b) { return b.device.is_cpu(); });
}

std::vector<size_t> Reducer::BucketBytes() const {
  std::vector<size_t> bytes;
  for (const Bucket& b : buckets_) bytes.push_back(static_cast<size_t>(b.numel) * nn::ElementSize(b.dtype));
  return bytes;
}

std::vector<std::vector<std::string>> Reducer::BucketNames() const {
  std::vector<std::vector<std::string>> out;
  for (const Bucket& b : buckets_) {
    std::vector<std::string> names;
    for (size_t i : b.params) names.push_back(names_[i]);
    out.push_back(std::move(names));
  }
  return out;
}

std::string Reducer::ParameterChange() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const Bucket& b = buckets_[slots_[i].bucket];
    const nn::Tensor& p = params_[i];
    if (p.dtype() == b.dtype && p.device() == b.device) {
      if (p.shape() == shapes_[i]) continue;
      // Its slot in the bucket keeps the old size: a larger gradient would
      // be reduced in part and a smaller one read past its end, and the
      // write-back would give .grad the slot's size. PyTorch's reducer
      // refuses a gradient whose size is not its bucket view's.
      return "DistributedDataParallel on rank " + std::to_string(pg_->rank()) + ": parameter `" + names_[i] +
             "` has shape " + nn::ShapeToString(p.shape()) + " now, but it had " + nn::ShapeToString(shapes_[i]) +
             " when the model was wrapped, and its place in the gradient buckets was sized for that (a "
             "bucket's layout is fixed at construction). Was its data replaced after wrapping (Tensor::SetData "
             "with another shape)? Resize parameters before wrapping the model in DistributedDataParallel, or "
             "wrap it again after the change.";
    }
    const std::string now = std::string(nn::DTypeName(p.dtype())) + " on " + p.device().ToString();
    const std::string built = std::string(nn::DTypeName(b.dtype)) + " on " + b.device.ToString();
    return "DistributedDataParallel on rank " + std::to_string(pg_->rank()) + ": parameter `" + names_[i] +
           "` is " + now + " now, but it was " + built + " when the model was wrapped, and its gradient "
           "bucket was built for " + built + " (a bucket's dtype and device are fixed at construction: its "
           "gradients would be rounded to that dtype, or refused in the middle of backward). Was "
           "Module::To() called on the model after wrapping it? Call To() before wrapping the model in "
           "DistributedDataParallel, or wrap it again after To().";
  }
  return "";
}

bool Reducer::AnyParameterRequiresGrad() const {
  return std::any_of(params_.begin(), params_.end(), [](const nn::Tensor& p) { return p.requires_grad(); });
}

void Reducer::StartBackwardClock(Clock::time_point forward_end) {
  prepared_at_ = forward_end;
  last_grad_at_ = forward_end;
  if (!gap_open_.load(std::memory_order_relaxed)) return;
  std::lock_guard lock(gap_mu_);
  gap_from_ = forward_end;
}

Reducer::GapForward Reducer::ForwardStarted(Clock::time_point start) {
  if (!gap_open_.load(std::memory_order_relaxed)) return {};
  std::lock_guard lock(gap_mu_);
  if (!gap_open_.load(std::memory_order_relaxed)) return {};
  return {.backward = gap_backward_, .start = start};
}

bool Reducer::ForwardEnded(const GapForward& forward, Clock::time_point end) {
  if (forward.backward == 0) return false;
  std::lock_guard lock(gap_mu_);
  // Still awaiting the same backward: PrepareForBackward counts a new one,
  // and its first gradient closes the gap.
  if (!gap_open_.load(std::memory_order_relaxed) || forward.backward != gap_backward_) return false;
  const Clock::time_point from = std::max(forward.start, gap_from_);
  const Clock::time_point to = std::max(end, from);
  // Forwards run one after another on the training thread: each adds its
  // span. One on another thread that overlaps an earlier one adds only
  // what ends past those, so that the sum never exceeds the wall time (the
  // compute left is then an upper bound, never negative).
  gap_forwards_ += to - std::clamp(gap_covered_, from, to);
  gap_covered_ = std::max(gap_covered_, to);
  if (gap_span_count_ < gap_spans_.size()) {
    gap_spans_[gap_span_count_++] = {from, to};
  } else {
    // The trace keeps a bounded number of pieces per backward: the last
    // kept span widens to this forward (the compute between them shows as
    // forward there; the statistics have the exact sum).
    auto& last = gap_spans_.back();
    last = {std::min(last.first, from), std::max(last.second, to)};
  }
  return true;
}

void Reducer::CheckPreviousIteration(bool synchronizing, bool communicates, bool eval_forward_in_join) {
  if (!pending_error_.empty()) {
    // What the failed iteration left in flight may have ended since.
    ReleaseFailedBuckets();
    throw std::runtime_error(pending_error_);
  }
  if (!unfinished_) return;
  // A forward that does not synchronize gradients may still run collectives
  // (buffers, Join's flags): once a backward launched buckets and stopped,
  // those would pair with the peers' bucket reductions.
  if (!synchronizing && !(communicates && finalize_queued_)) return;
  if (!finalize_queued_ && backward_optional_) {
    // An eval-mode forward that no backward followed (an evaluation with
    // grad enabled): nothing was launched, so nothing is left to pair.
    unfinished_ = false;
    return;
  }
  // The other ranks may be waiting in this iteration's collectives (or may
  // pair them with the next one's): the group is aborted, so that they fail
  // within moments with this message rather than at their deadline.
  std::string state;
  if (!finalize_queued_ && eval_forward_in_join) {
    state = "an eval-mode forward with grad enabled ran inside Join before that backward (outside Join "
            "such a forward synchronizes gradients, so this is a second synchronizing forward before "
            "the first one's backward; inside Join it cannot synchronize, and after it the training "
            "forward's backward could not either: run the evaluation under NoGradGuard, or after the "
            "backward)";
  } else if (!finalize_queued_) {
    state = "no parameter received a gradient after it (no backward ran, or its loss did not depend "
            "on the forward's outputs, or a second synchronizing forward ran before the first one's "
            "backward: for two forwards and one backward, such as a GAN discriminator's real and fake "
            "batches or a siamese pair, run all but the last under NoSync, or concatenate the inputs "
            "into one forward)";
  } else if (const size_t had = GradientsIn(); had < params_.size()) {
    state = "its backward stopped partway (" + std::to_string(had) + " of " +
            std::to_string(params_.size()) +
            " parameters had their gradients; did an exception leave backward?)";
  } else {
    state = "its backward ended before the gradient buckets were reduced (waiting for them failed "
            "with the error that backward threw)";
  }
  pending_error_ =
      "DistributedDataParallel on rank " + std::to_string(pg_->rank()) +
      ": the previous iteration's gradient reduction did not finish: a synchronizing forward "
      "(training mode, grad enabled, outside NoSync) ran, but " + state +
      ". Every synchronizing forward must be followed by one backward through its outputs on "
      "every rank. This usually means that a rank skipped the backward of a batch after its "
      "forward (on a NaN loss, say: run the backward anyway and skip the optimizer step on every "
      "rank, as GradScaler does, or run forwards whose backward may be skipped under NoGradGuard, "
      "Eval() or NoSync), that no output of forward took part in the loss (make every output "
      "contribute; set DdpOptions::find_unused_parameters when some parameters really are unused), "
      "or that an "
      "exception was thrown during backward. The process group was aborted.";
  pg_->Abort(transport::FailedPreconditionError(pending_error_));
  ReleaseFailedBuckets();
  throw std::runtime_error(pending_error_);
}

void Reducer::RebuildBuckets() {
  const size_t n = params_.size();
  nn::Tensor order = nn::Empty({static_cast<int64_t>(n)}, {.dtype = nn::DType::kInt64});
  int64_t* o = order.data<int64_t>();
  // The observed order, completed with any parameter that never fired (in
  // reverse registration order, as the initial buckets have them). A
  // parameter that got several gradients (static_graph) takes the place of
  // its last, when it becomes ready: at its first, it would hold back the
  // bucket of the parameters that follow until the end of backward.
  std::vector<char> seen(n, 0);
  std::vector<size_t> observed;
  for (auto it = ready_order_.rbegin(); it != ready_order_.rend(); ++it) {
    if (!seen[*it]) {
      seen[*it] = 1;
      observed.push_back(*it);
    }
  }
  size_t k = 0;
  for (auto it = observed.rbegin(); it != observed.rend(); ++it) o[k++] = static_cast<int64_t>(*it);
  for (size_t i = n; i-- > 0;) {
    if (!seen[i]) o[k++] = static_cast<int64_t>(i);
  }
  // Ranks may have seen different orders; rank 0's wins everywhere.
  pg_->Broadcast(order, 0, "bucket order").Wait();
  if (pg_->rank() != 0 && n >= 2 && damage_next_received_order.exchange(false)) o[0] = o[1];
  std::vector<size_t> agreed(n);
  std::vector<char> check(n, 0);
  for (size_t j = 0; j < n; ++j) {
    const int64_t v = o[j];
    if (v < 0 || static_cast<size_t>(v) >= n || check[v]) {
      // Rank 0 built the order, so the others find it damaged: rank 0
      // itself would go on to reduce its new buckets and wait for them
      // until the group's timeout. The group is stopped with this instead,
      // and this rank, whose buckets were not rebuilt, refuses later
      // forwards.
      pending_error_ = "DistributedDataParallel on rank " + std::to_string(pg_->rank()) +
                       ": the bucket order received from rank 0 at the rebuild after the first iteration is "
                       "not a permutation of the " + std::to_string(n) + " parameter indices (position " +
                       std::to_string(j) + " holds " + std::to_string(v) +
                       (v >= 0 && static_cast<size_t>(v) < n ? ", which an earlier position holds too"
                                                             : ", out of range") +
                       "): it was damaged on its way. The buckets cannot be rebuilt the same on every rank; "
                       "the process group was aborted.";
      pg_->Abort(transport::InternalError(pending_error_));
      throw std::runtime_error(pending_error_);
    }
    check[v] = 1;
    agreed[j] = static_cast<size_t>(v);
  }
  rebuild_pending_ = false;
  const std::vector<std::vector<size_t>> next =
      AssignBuckets(params_, agreed, options_.first_bucket_bytes, options_.bucket_bytes,
                    options_.inplace_bytes);
  bool same = next.size() == buckets_.size();
  for (size_t b = 0; same && b < next.size(); ++b) same = next[b] == buckets_[b].params;
  if (!same) {
    try {
      BuildBuckets(agreed);
    } catch (const std::exception& e) {
      // Only this rank failed (its new buckets could not be allocated): the
      // peers have rebuilt theirs and would wait for this rank's buckets
      // until the group's timeout, or pair them with its old ones, which
      // have other sizes. They are stopped now with the cause, and this
      // rank keeps refusing forwards.
      pending_error_ = "DistributedDataParallel on rank " + std::to_string(pg_->rank()) +
                       ": rebuilding the gradient buckets after the first iteration failed on this rank (" +
                       e.what() + "); its buckets no longer match the other ranks'. The process group "
                       "was aborted.";
      pg_->Abort(transport::FailedPreconditionError(pending_error_));
      throw;
    }
  }
  rebuilt_ = true;
  agreed_order_ = agreed;
}

std::vector<size_t> Reducer::UnreachableParameters(const std::vector<nn::Tensor>& outputs,
                                                   std::vector<nn::Tensor>* others) const {
  std::unordered_map<const nn::TensorImpl*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index.emplace(params_[i].impl(), i);
  std::vector<char> reached(params_.size(), 0);
  for (const nn::Tensor& leaf : nn::autograd::ReachableLeaves(outputs)) {
    if (auto it = index.find(leaf.impl()); it != index.end()) {
      reached[it->second] = 1;
    } else if (others != nullptr) {
      others->push_back(leaf);
    }
  }
  std::vector<size_t> unreachable;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!reached[i]) unreachable.push_back(i);
  }
  return unreachable;
}

void Reducer::RefuseAddedParameters(const std::vector<nn::Tensor>& leaves) {
  if (leaves.empty() || !model_names_) return;
  for (const ModelParameter& found : model_names_(leaves)) {
    // An input that requires grad, or a parameter frozen at wrapping (one
    // process keeps no list of those; several refuse it before this).
    if (found.name.empty() || !found.added) continue;
    const std::string& name = found.name;
    pending_error_ =
        "DistributedDataParallel on rank " + std::to_string(pg_->rank()) + ": parameter `" + name +
        "` of the model was reached by this forward but is not one the wrapper synchronizes: it was added "
        "after the model was wrapped (a submodule replaced with Module::ReplaceChild, say). Its gradient would "
        "stay local on each rank, and its values differ across ranks (no broadcast from rank 0 made them "
        "equal), so the replicas would drift apart without a word. The wrapper synchronizes the parameters "
        "the model had when it was wrapped: wrap the model again after changing it. The process group was "
        "aborted.";
    pg_->Abort(transport::FailedPreconditionError(pending_error_));
    throw std::invalid_argument(pending_error_);
  }
}

void Reducer::RefuseAddedParametersReachedFrom(const std::vector<nn::Tensor>& outputs) {
  std::vector<nn::Tensor> others;
  (void)UnreachableParameters(outputs, &others);
  RefuseAddedParameters(others);
}

void Reducer::PrepareForBackward(const std::vector<nn::Tensor>& outputs, double divisor,
                                 bool backward_optional) {
  // CheckPreviousIteration refuses a forward after an iteration that did
  // not finish, so nothing should be in flight; the wait is a safeguard
  // before the bucket memory is reused below.
  if (!WaitInFlight()) {
    pending_error_ = "DistributedDataParallel on rank " + std::to_string(pg_->rank()) +
                     ": a collective of an earlier iteration was still running after the group's "
                     "timeout, so its bucket memory cannot be reused; the process group was aborted.";
    throw std::runtime_error(pending_error_);
  }
  armed_ = true;
  unfinished_ = true;
  finalized_ = false;
  finalize_queued_ = false;
  backward_optional_ = backward_optional;
  reject_gradients_ = false;
  divisor_ = divisor;
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(arrivals_.begin(), arrivals_.end(), 0);
  ready_count_ = 0;
  next_launch_ = 0;
  finalize_moved_ = false;
  on_backward_pass_ = false;
  ++pass_end_token_;  // a callback left from an earlier iteration does nothing
  ReleaseOutputs();
  prepared_in_pass_ = nn::autograd::InBackward();
  // The pass that reaches these outputs is this iteration's backward,
  // whichever passes enclose it (a step run from a hook of an unrelated
  // backward, with forward there or at top level) or are nested in it
  // (checkpointing reaches parameters, never the outputs): their gradient
  // hook queues the end of the iteration there. A hook lives on its tensor,
  // so a training forward's outputs are kept until that end (the caller
  // may keep only the loss). An eval-mode forward's backward is optional:
  // its outputs, and the activations their graph saved, are not kept past
  // the caller's references (the first gradient decides then, see
  // OnGradReady).
  for (const nn::Tensor& out : outputs) {
    if (!out.defined() || !out.requires_grad() || out.grad_fn() == nullptr) continue;
    // An output whose graph an earlier backward released (a tensor the
    // model kept from an earlier iteration and returns again) can start no
    // pass: a backward through it fails in autograd, naming the node, and
    // RegisterHook refuses a hook on it. It is left unwatched, as PyTorch's
    // forward ignores it. Checked and registered under one lock: a
    // backward on another thread may release the node at any moment.
    std::optional<nn::HookHandle> hook =
        nn::autograd::RegisterHookIfLive(out, [this, alive = std::weak_ptr<char>(alive_)](const nn::Tensor&) {
          if (!alive.expired() && armed_ && !on_backward_pass_) {
            on_backward_pass_ = true;
            QueueOnPassEnd(/*outermost=*/false);
          }
          return nn::Tensor();
        });
    if (!hook) continue;
    if (!backward_optional) watched_outputs_.push_back(out);
    output_hooks_.push_back(std::move(*hook));
  }
  // Until static_graph has counted each parameter's gradients, none is
  // reduced before the end of backward: one that gets a second gradient (a
  // re-entrant pass) would have the first in a bucket already in flight.
  delay_ready_ = options_.static_graph && !static_counted_;
  no_sync_joined_ = false;
  // used_ is not cleared here: it already holds the parameters that got
  // gradients in backwards since the last synchronizing one (NoSync).
  for (Bucket& b : buckets_) b.pending = b.params.size();
  prepared_at_ = Clock::now();
  last_grad_at_ = prepared_at_;
  {
    std::lock_guard lock(gap_mu_);
    ++gap_backward_;
    gap_from_ = prepared_at_;
    gap_forwards_ = Clock::duration::zero();
    gap_covered_ = Clock::time_point{};
    gap_span_count_ = 0;
    // Only an awaited backward (a training forward's) makes a gap: an
    // eval-mode forward's may never come, and the evaluations after it are
    // no iteration's.
    gap_open_.store(!backward_optional, std::memory_order_relaxed);
  }

  for (size_t i : unused_) {
    is_unused_[i] = 0;
    reached_under_no_sync_[i] = 0;
    stale_[i] = nn::Tensor();  // left by a backward that failed
  }
  unused_.clear();
  if (!handles_unused()) return;
  // An eval-mode forward may take another path than training (an
  // auxiliary head used only in training): walked, and not learned from.
  unused_from_walk_ = !(options_.static_graph && static_known_) || backward_optional;
  static_learning_ = options_.static_graph && unused_from_walk_ && !backward_optional;
  if (!unused_from_walk_) {
    unused_ = static_unused_;
  } else {
    std::vector<nn::Tensor> others;
    unused_ = UnreachableParameters(outputs, &others);
    RefuseAddedParameters(others);
    if (options_.static_graph && !backward_optional) {
      // Learned from the gradients instead, at the end of this backward
      // (Finalize): the walk cannot see a parameter used only inside a
      // re-entrantly checkpointed segment, whose graph is recorded during
      // backward, and would take it as unused.
      unused_.clear();
      static_unused_.clear();
      static_known_ = true;
    }
  }
  for (size_t i : unused_) is_unused_[i] = 1;
  // They are marked ready when backward starts (OnGradReady), not here: a
  // bucket launched now would be issued before any collective that this
  // rank runs between forward and backward, and ranks that use different
  // parameters launch different buckets here, so that collective would
  // pair with different ones on different ranks. PyTorch waits for the
  // first hook likewise.
}

void Reducer::Disarm(const std::vector<nn::Tensor>& outputs, bool reject_gradients, bool in_join) {
  // An eval-mode forward's backward is optional, but when it comes (through
  // this forward's outputs) it is that forward's: outside Join it
  // synchronizes, as PyTorch's reducer stays prepared by that forward.
  if (armed_ && unfinished_ && !finalize_queued_ && (!backward_optional_ || !in_join)) {
    // A synchronizing forward prepared this backward and it has not
    // started: disarming would let it accumulate locally on this rank (the
    // optimizer would step local gradients and the replicas drift apart),
    // and the next forward would report a backward that did run. As in
    // PyTorch, only that forward's walk decides the unused set: widening
    // it from these outputs left a multi-task step's other head (reached
    // here, left out of the loss) without a gradient, and Finalize aborted
    // the group. Those reached here are noted for the error that a
    // gradient for one of them in this backward raises.
    if (handles_unused() && unused_from_walk_ && !unused_.empty()) {
      std::vector<char> unreachable(params_.size(), 0);
      for (size_t i : UnreachableParameters(outputs)) unreachable[i] = 1;
      for (size_t i : unused_) {
        if (!unreachable[i]) reached_under_no_sync_[i] = 1;
      }
    }
    if (options_.static_graph) {
      // Its re-entrant passes would add gradients to those static_graph
      // counted (a parameter reduced on its counted last would get one
      // after): this iteration reduces them all at its end. PyTorch lets
      // such a gradient land in .grad after its bucket was reduced.
      no_sync_joined_ = true;
      delay_ready_ = true;
    }
    return;
  }
  armed_ = false;
  finalized_ = false;
  reject_gradients_ = reject_gradients;
  ReleaseOutputs();  // no backward is armed for them any more
}

size_t Reducer::GradientsIn() const {
  size_t had = 0;
  for (size_t i = 0; i < params_.size(); ++i) had += ready_[i] || arrivals_[i] > 0 ? 1 : 0;
  return had;
}

std::string Reducer::CountedIn() const {
  if (counted_in_ <= 1) return "the first iteration";
  return "iteration " + std::to_string(counted_in_) +
         " (the first synchronizing backward of this rank that no forward under NoSync joined and no "
         "eval-mode forward prepared)";
}

bool Reducer::IsView(size_t index, const nn::Tensor& grad) const {
  const nn::Tensor& view = slots_[index].view;
  return view.defined() && grad.storage() == view.storage() &&
         grad.storage_offset() == view.storage_offset() && grad.is_contiguous();
}

void Reducer::OnGradReady(size_t index) {
  // The gradient is already in .grad when this hook runs: the errors below
  // cannot undo that, only keep the reducer from using it.
  if (!armed_) {
    if (reject_gradients_) {
      throw std::logic_error(
          "DistributedDataParallel: parameter `" + names_[index] +
          "` received a gradient in a backward after an eval-mode forward inside Join. Outside "
          "Join such a backward synchronizes gradients as in training; inside it the ranks that "
          "ran out of inputs shadow training iterations only, so it cannot. Train in training mode "
          "(put the submodules to freeze, such as BatchNorm, in eval mode instead), or run that "
          "forward and backward under NoSync to accumulate gradients locally on purpose.");
    }
    if (finalized_ && !no_sync_) {
      // PyTorch ignores such a gradient; here it is an error, since it
      // silently makes the replicas differ.
      throw std::logic_error(
          "DistributedDataParallel on rank " + std::to_string(pg_->rank()) + ": parameter `" + names_[index] +
          "` received a gradient after this iteration's gradients were averaged (its backward had "
          "finished and no forward of the wrapper has run since). Such a gradient goes into .grad on "
          "top of the averaged one without being synchronized (this one already has, on this rank), so "
          "the replicas drift apart. It comes from a second backward through the outputs of one forward, "
          "from a loss term computed outside the wrapper's forward (a penalty on the parameters, "
          "backpropagated on its own), or from the wrapped module called directly instead of through "
          "DistributedDataParallel. Backpropagate the sum of the losses once, call the wrapper rather "
          "than the module it wraps, or run the further backward under NoSync to accumulate its "
          "gradients locally on purpose.");
    }
    // NoSync, or a backward this reducer did not prepare: the
    // gradient accumulates in .grad and is reduced by the next
    // synchronizing backward, so the parameter counts as used there even if
    // that backward does not reach it (as PyTorch's local_used_map). Not
    // while the map's all-reduce may still run (a backward whose wait
    // failed: that iteration is refused at the next forward anyway).
    if (!used_work_.valid()) used_.data<int32_t>()[index] = 1;
    return;
  }
  // Checked before anything is marked ready, so that when this is the
  // first gradient of backward no bucket has been touched.
  if (is_unused_[index]) FailUnusedParameterGradient(index);
  ++arrivals_[index];
  if (ready_[index]) {
    // Its gradient is in a bucket that may be in flight (and the engine
    // has already added this one into .grad, which may be that memory):
    // this iteration cannot finish, so the peers are stopped too.
    const std::string head = "DistributedDataParallel on rank " + std::to_string(pg_->rank()) + ": parameter `" +
                             names_[index] + "` received ";
    if (options_.static_graph) {
      pending_error_ =
          head + std::to_string(arrivals_[index]) + " gradients in one backward, but " +
          std::to_string(static_arrivals_[index]) + " in " + CountedIn() + ", which static_graph counted: "
          "its bucket was reduced after the last of those. Under static_graph every iteration must run the "
          "same backward passes through the same parameters. The process group was aborted.";
    } else {
      pending_error_ =
          head + "a second gradient in one backward, after its first one had gone into its gradient bucket "
          "(which may already be reduced). A parameter gets two gradients in one backward when a re-entrant "
          "backward pass (activation checkpointing that runs Backward again through a recomputed segment, or "
          "a hook or backward function calling Backward) reaches it as well as the pass around it: used both "
          "inside and outside a checkpointed segment, say. Set DdpOptions::static_graph when every iteration "
          "runs the same passes (DistributedDataParallel then counts each parameter's gradients in the first "
          "iteration and reduces it after the last one), or use the parameter on one side of the checkpoint "
          "only. The process group was aborted.";
    }
    pg_->Abort(transport::FailedPreconditionError(pending_error_));
    ReleaseStaleCopies();
    throw std::logic_error(pending_error_);
  }
  if (!finalize_queued_) {
    // The first gradient of backward.
    finalize_queued_ = true;
    if (gap_open_.load(std::memory_order_relaxed)) {
      std::lock_guard lock(gap_mu_);
      gap_open_.store(false, std::memory_order_relaxed);
    }
    comm_hook_locked_ = true;
    // Queued already on the pass that reached forward's outputs (their
    // gradient hook), this backward's. Otherwise (no output was reached, or
    // an eval-mode forward's were dropped) on the outermost pass, which ends
    // after every pass nested in it: a first gradient that arrives in a
    // nested pass (activation checkpointing recomputes a block and runs
    // Backward through it) must not end the iteration when that pass ends.
    // But when forward ran inside a pass, that outermost pass is the one
    // whose hook runs this step, which ends after the hook has stepped on
    // the gradients: then on the pass running now (see OnPassEnd).
    if (!on_backward_pass_) QueueOnPassEnd(/*outermost=*/!prepared_in_pass_);
    for (size_t i : unused_) {
      MarkUnusedReady(i);
      // Should this parameter get a gradient later in this backward (an
      // error), the engine adds it to .grad before the hook can object:
      // when .grad is the memory being reduced (its solo bucket, or its
      // view with gradient_as_bucket_view), it is detached, so that the
      // gradient lands in a tensor of its own instead of racing with the
      // collective. Finalize sets it back.
      const Bucket& b = buckets_[slots_[i].bucket];
      const nn::Tensor& grad = params_[i].grad();
      if (grad.defined() && grad.storage() == (b.is_solo ? b.solo : b.buffer).storage()) {
        params_[i].set_grad(nn::Tensor());
        detached_[i] = 1;
      }
    }
  }
  used_.data<int32_t>()[index] = 1;
  if (group_iterations_ == 0) ready_order_.push_back(index);
  // static_graph: not before the last of the gradients it counted (all are
  // marked at the end of the backward that counts them).
  if (!delay_ready_ && !(options_.static_graph && arrivals_[index] < static_arrivals_[index])) MarkReady(index);
  last_grad_at_ = Clock::now();
}

void Reducer::QueueOnPassEnd(bool outermost) {
  const uint64_t token = ++pass_end_token_;
  nn::autograd::QueueCallback(
      [this, alive = std::weak_ptr<char>(alive_), token] {
        if (!alive.expired() && token == pass_end_token_) OnPassEnd();
      },
      outermost);
}

void Reducer::ReleaseOutputs() {
  for (nn::HookHandle& h : output_hooks_) h.Remove();
  output_hooks_.clear();
  watched_outputs_.clear();
}

void Reducer::OnPassEnd() {
  if (!finalize_queued_) {
    // A pass reached forward's outputs but gave no parameter a gradient:
    // not this iteration's backward (the next forward reports one that
    // never came); a later pass through the outputs may still be.
    on_backward_pass_ = false;
    return;
  }
  if (ready_count_ < params_.size() && !delay_ready_ && !finalize_moved_ && !on_backward_pass_) {
    // Queued on the outermost pass, or on the pass of the first gradient
    // where forward ran inside a pass and no gradient reached its outputs
    // (none requires grad): that pass may be one nested in the backward
    // (activation checkpointing) that ended before the enclosing one
    // reached the other parameters, so the callback moves to the outermost
    // pass (where the pass ending now is that one, it runs again right
    // after). Not in static_graph's first iteration, which cannot tell a
    // missing gradient from one still to come: it ends here.
    finalize_moved_ = true;
    QueueOnPassEnd(/*outermost=*/true);
    return;
  }
  ReleaseOutputs();
  Finalize();
}

void Reducer::FailUnusedParameterGradient(size_t index) {
  const std::string head = "DistributedDataParallel on rank " + std::to_string(pg_->rank()) +
                           ": parameter `" + names_[index] + "` received a gradient";
  if (unused_from_walk_ && reached_under_no_sync_[index] && options_.static_graph) {
    // static_graph walks the graph only of an eval-mode forward, so that is
    // the forward that prepared this backward.
    pending_error_ =
        head + " through the outputs of a forward run under NoSync after the eval-mode forward (grad "
        "enabled) that prepared this backward. static_graph learns the used parameters from training "
        "iterations only, so an eval-mode forward's unused ones are found by walking its graph, and its "
        "outputs alone decide: this one was not reachable from them, so it was marked unused and its "
        "bucket is reduced without this gradient. An evaluation that needs no gradients belongs under "
        "NoGradGuard (it then prepares no backward); one whose backward should train belongs in training "
        "mode. To accumulate the NoSync forward's gradients, run it and its backward before the eval-mode "
        "forward; a backward run while that forward's backward is awaited is taken as that backward, "
        "inside NoSync too. The process group was aborted.";
  } else if (unused_from_walk_ && reached_under_no_sync_[index]) {
    pending_error_ =
        head + " through the outputs of a forward run under NoSync after the synchronizing forward "
        "that prepared this backward. That forward's outputs alone decide which parameters are "
        "unused (find_unused_parameters, as in PyTorch): this one was not reachable from them, so "
        "it was marked unused and its bucket is reduced without this gradient. To accumulate that "
        "loss's gradients, run the NoSync forward and its backward before the synchronizing forward "
        "(its gradients accumulate locally and the synchronizing backward averages them with its own); "
        "a backward run while the synchronizing forward's backward is awaited is taken as that "
        "backward, inside NoSync too. The process group was aborted.";
  } else if (unused_from_walk_ && options_.static_graph) {
    // static_graph walks the graph only of an eval-mode forward (it learns
    // the used set from training iterations' gradients).
    pending_error_ =
        head + " although it is not reachable from the outputs of the eval-mode forward that prepared this "
        "backward: static_graph learns the used parameters from training iterations only, so an eval-mode "
        "forward's unused ones are found by walking its graph, and this one was marked unused at the end of "
        "that forward; its bucket is reduced without this gradient. A parameter must be used inside the "
        "module's forward for its gradient to be synchronized; a loss term on it computed outside forward (a "
        "penalty such as wd * Sum(p * p) on a parameter that forward does not use) is not seen by "
        "DistributedDataParallel. Use it inside forward, or leave it out of the loss. The process group was "
        "aborted.";
  } else if (unused_from_walk_) {
    pending_error_ =
        head + " although it is not reachable from the outputs of forward: find_unused_parameters "
        "marked it unused at the end of forward, and its bucket is reduced without this gradient. "
        "A parameter must be used inside the module's forward for its gradient to be synchronized; "
        "a loss term on it computed outside forward (a penalty such as wd * Sum(p * p) on a "
        "parameter that forward does not use) is not seen by DistributedDataParallel. Use it inside "
        "forward, or leave it out of the loss. Or it is used only inside a segment that re-entrant "
        "activation checkpointing records again during backward, which forward's graph does not "
        "show: there, set DdpOptions::static_graph instead of find_unused_parameters (it learns the "
        "used parameters from the first iteration's gradients). The process group was aborted.";
  } else {
    pending_error_ =
        head + ", but it got none in the first iteration, and static_graph keeps the set of "
        "parameters used there for good: it is marked unused in every iteration and its bucket is "
        "reduced without this gradient. Under static_graph every iteration must use the same "
        "parameters; where the set changes, use find_unused_parameters instead. The process group "
        "was aborted.";
  }
  // This iteration cannot finish here, and its buckets may be in flight:
  // the peers fail within moments with this message instead of waiting.
  pg_->Abort(transport::FailedPreconditionError(pending_error_));
  ReleaseStaleCopies();
  throw std::logic_error(pending_error_);
}

void Reducer::MarkUnusedReady(size_t index) {
  const nn::Tensor& grad = params_[index].grad();
  // With gradient_as_bucket_view a .grad of its own (set after wrapping) is
  // copied into the bucket and .grad becomes the view: kept as well, or it
  // would come back as the ranks' average where a solo bucket's stays.
  const bool becomes_view = options_.gradient_as_bucket_view && !buckets_[slots_[index].bucket].is_solo;
  if (grad.defined() && (becomes_view || IsView(index, grad))) stale_[index] = grad.Clone();
  MarkReady(index, /*used_here=*/false);
}

void Reducer::MarkReady(size_t index, bool used_here) {
  ready_[index] = 1;
  ++ready_count_;
  const Slot& slot = slots_[index];
  Bucket& bucket = buckets_[slot.bucket];
  const nn::Tensor& grad = params_[index].grad();
  // Average while copying (one pass over the gradient), or inside the
  // all-reduce (default hook dividing by the world size), or in the hook.
  const double factor = FusedAverage(divisor_, bucket.dtype) || local_gradients_ ? 1.0 : 1.0 / divisor_;
  // Same dtype and contiguous: used as it is (any device).
  const bool plain = grad.defined() && grad.is_contiguous() && grad.dtype() == bucket.dtype &&
                     grad.device() == bucket.device;
  // .grad may be the memory being reduced (a solo bucket, or a bucket view)
  // only when no post-accumulate hook runs after this one: a user's hook
  // registered after the wrapper would read a half-reduced gradient, or
  // change this rank's input while the collective reads it. Otherwise
  // .grad stays this rank's own for those hooks, and the reduced gradient
  // replaces it at the end of backward, as for a gradient copied into a
  // bucket.
  const bool last_hook = hook_handles_[index].IsLast();
  if (bucket.is_solo) {
    bucket.solo_copied = false;
    if (!grad.defined()) {
      // Unused here: contribute zeros (kept in case another rank used it).
      bucket.solo = nn::Zeros(params_[index].shape(), {.dtype = bucket.dtype, .device = bucket.device});
    } else if (plain && last_hook && used_here) {
      bucket.solo = grad;  // reduced in place: .grad itself is the bucket
    } else if (!used_here) {
      // A stale .grad of a parameter unused here: contributed as PyTorch
      // does, but from a copy, so that .grad stays as it was when no rank
      // used the parameter (Finalize writes the result back otherwise).
      bucket.solo = nn::Empty(params_[index].shape(), {.dtype = bucket.dtype, .device = bucket.device});
      nn::NoGradGuard guard;
      bucket.solo.CopyFrom(grad);
      bucket.solo_copied = true;
    } else {
      bucket.solo = nn::Empty(params_[index].shape(), {.dtype = bucket.dtype, .device = bucket.device});
      nn::NoGradGuard guard;
      bucket.solo.CopyFrom(grad);
      if (last_hook) {
        params_[index].set_grad(bucket.solo);
      } else {
        bucket.solo_copied = true;  // Finalize writes it back
      }
    }
    if (factor != 1.0) ScaleInto(bucket.solo, bucket.solo, factor);
  } else {
    const nn::Tensor& view = slot.view;
    if (!grad.defined()) {
      ZeroTensor(view);
    } else if (IsView(index, grad)) {
      // Accumulated straight into the bucket (gradient_as_bucket_view).
      if (!last_hook) {
        params_[index].set_grad(grad.Clone());
        detached_[index] = 1;
      }
      if (factor != 1.0) ScaleInto(view, view, factor);
    } else {
      if (plain) {
        ScaleInto(view, grad, factor);  // copy and average in one pass
      } else {
        nn::NoGradGuard guard;
        view.CopyFrom(grad);
        if (factor != 1.0) ScaleInto(view, view, factor);
      }
      // The fresh gradient tensor is dropped: from now on the bucket is .grad
      // (after the later hooks, in Finalize).
      if (options_.gradient_as_bucket_view) {
        if (last_hook) {
          params_[index].set_grad(view);
        } else {
          detached_[index] = 1;
        }
      }
    }
  }
  if (--bucket.pending == 0) LaunchReadyBuckets();
}

void Reducer::LaunchReadyBuckets() {
  // Where the group runs CPU collectives on the caller (its ranks' threads
  // oversubscribe the cores), a bucket launched while backward still runs
  // overlaps nothing: its all-reduce runs there and then, holding backward
  // until every peer reaches the same bucket, and each such meeting waits
  // out whatever the ranks drifted apart since the last. Launched together
  // once the last is ready, the buckets cost one meeting per backward (the
  // next all-reduces start in step) instead of one per bucket.
  if (launch_together_) {
    for (const Bucket& b : buckets_) {
      if (b.pending != 0) return;
    }
  }
  // Buckets are launched in index order on every rank, so that the
  // collectives match even when gradients arrive in different orders.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_];
    try {
      b.work = Launch(next_launch_, b.is_solo ? b.solo.View({b.numel}) : b.buffer);
    } catch (...) {
      // Launch aborted the group: this iteration cannot end, so the copies
      // its end would have given back go now, not at the next forward.
      ReleaseStaleCopies();
      throw;
    }
    ++next_launch_;
  }
}

Work Reducer::Launch(size_t b, const nn::Tensor& buffer) {
  Bucket& bucket = buckets_[b];
  if (FusedAverage(divisor_, bucket.dtype)) {
    return pg_->AllReduce(buffer, transport::ReduceOp::kAvg, "bucket " + std::to_string(b));
  }
  // Kept until Finalize has waited for this bucket's Work. GradBucket
  // refuses a parameter whose size no longer fits the bucket (its data
  // replaced since the forward) and may run out of memory: either leaves
  // the peers in this bucket's collective, so they are told at once.
  try {
    std::vector<nn::Tensor> params;
    params.reserve(bucket.params.size());
    for (size_t i : bucket.params) params.push_back(params_[i]);
    bucket.grad_bucket = std::make_unique<GradBucket>(b, buckets_.size(), buffer, std::move(params),
                                                      bucket.offsets, divisor_, /*divided=*/!local_gradients_);
  } catch (const std::exception& e) {
    pg_->Abort(transport::FailedPreconditionError("DistributedDataParallel on rank " + std::to_string(pg_->rank()) +
                                                  ": could not hand " + bucket.hook_label +
                                                  " to the communication hook: " + e.what()));
    throw;
  }
  GradBucket& grad_bucket = *bucket.grad_bucket;
  // A hook that fails on this rank only leaves the peers in this bucket's
  // collective: they are told at once, as for the reducer's own errors.
  Work work;
  try {
    ScopedDefaultLabel label(bucket.hook_label);
    work = hook_(*pg_, grad_bucket);
  } catch (const std::exception& e) {
    pg_->Abort(transport::FailedPreconditionError(
        "DistributedDataParallel on rank " + std::to_string(pg_->rank()) +
        ": the communication hook threw for " + bucket.hook_label + ": " + e.what()));
    throw;
  } catch (...) {
    // Not a std::exception (an int, a library's own type): the peers must
    // still be told, or they wait in this bucket's collective until the
    // group's timeout with a reason that names neither hook nor rank.
    pg_->Abort(transport::FailedPreconditionError(
        "DistributedDataParallel on rank " + std::to_string(pg_->rank()) +
        ": the communication hook threw a non-standard exception for " + bucket.hook_label));
    throw;
  }
  if (!work.valid()) {
    const std::string message =
        "DistributedDataParallel: the communication hook returned an empty Work for " + bucket.hook_label;
    pg_->Abort(transport::FailedPreconditionError("rank " + std::to_string(pg_->rank()) + ": " + message));
    throw std::logic_error(message);
  }
  return work;
}

void Reducer::Finalize() {
  armed_ = false;
  const Clock::time_point compute_end = Clock::now();
  if (delay_ready_) {
    // Every gradient has arrived: the buckets launch now, in index order.
    delay_ready_ = false;
    // A NoSync forward that joined adds passes, never removes them: fewer
    // than counted is still a missing gradient.
    for (size_t i = 0; i < params_.size(); ++i) {
      if (arrivals_[i] > 0 && !ready_[i] && arrivals_[i] >= static_arrivals_[i]) MarkReady(i);
    }
    if (!static_counted_ && !no_sync_joined_ && !backward_optional_) {
      static_arrivals_ = arrivals_;
      static_counted_ = true;
      counted_in_ = iterations_ + 1;  // this backward's, counted below
    }
  }
  if (static_learning_ && ready_count_ < params_.size()) {
    // static_graph learns the used set from its first iteration. The walk
    // from the outputs cannot see an output left out of the loss (an
    // auxiliary head): its parameters are reachable yet get no gradient.
    // As PyTorch's static graph, they are unused from now on, contributing
    // zeros here (a rank that did use them still counts, through the used
    // map); their buckets launch now, in index order as always.
    for (size_t i = 0; i < params_.size(); ++i) {
      if (ready_[i]) continue;
      is_unused_[i] = 1;
      unused_.push_back(i);
      static_unused_.push_back(i);
      MarkUnusedReady(i);
    }
    std::sort(static_unused_.begin(), static_unused_.end());
  }
  static_learning_ = false;
  if (ready_count_ < params_.size()) {
    std::vector<size_t> absent;
    std::vector<nn::Tensor> absent_tensors;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (ready_[i]) continue;
      absent.push_back(i);
      absent_tensors.push_back(params_[i]);
    }
    // Which of them the model still has (one walk of the model).
    std::vector<ModelParameter> in_model;
    if (model_names_) in_model = model_names_(absent_tensors);
    std::string names;
    size_t listed = 0, missing = 0, frozen = 0, removed = 0;
    for (size_t k = 0; k < absent.size(); ++k) {
      const size_t i = absent[k];
      ++missing;
      // Frozen after wrapping: backward gives it no gradient by design.
      const bool now_frozen = !params_[i].requires_grad();
      // Taken out of the model after wrapping (its submodule replaced).
      const bool now_removed = k < in_model.size() && in_model[k].name.empty();
      frozen += now_frozen ? 1 : 0;
      removed += now_removed ? 1 : 0;
      if (listed++ < 8) {
        names += (names.empty() ? "`" : ", `") + names_[i] + "` (index " + std::to_string(i) +
                 (now_removed ? ", no longer a parameter of the model" : "") +
                 (now_frozen ? ", requires_grad is false now" : "") +
                 // static_graph: fewer than it counted in the first iteration.
                 (arrivals_[i] > 0 ? ", only " + std::to_string(arrivals_[i]) + " of the " +
                                         std::to_string(static_arrivals_[i]) +
                                         " gradients static_graph counted in " + CountedIn()
                                   : "") +
                 ")";
      }
    }
    if (missing > listed) names += " and " + std::to_string(missing - listed) + " more";
    std::string advice;
    if (removed > 0) {
      // A parameter added in their place is refused at the forward
      // (DistributedDataParallel::Forward), so here the replacement added
      // none. find_unused_parameters (without static_graph) would take
      // these as unused, but the buckets would carry them for good:
      // wrapping again is the advice.
      advice = std::to_string(removed) + " of them are no longer parameters of the model: it was changed after "
               "wrapping (a submodule replaced with Module::ReplaceChild, say), and no forward reaches them "
               "now. The wrapper synchronizes the parameters the model had when it was wrapped: wrap the model "
               "again after changing it.";
    } else if (frozen > 0) {
      // The walk of find_unused_parameters takes a parameter frozen before
      // the forward as unused; one frozen between forward and backward was
      // reached by that forward, and is missing here however it is set.
      advice = std::to_string(frozen) + " of them required grad when the model was wrapped and no longer do "
               "(frozen after wrapping), so backward gives them no gradient. To freeze and unfreeze parameters "
               "of a wrapped model, set DdpOptions::find_unused_parameters = true and change requires_grad "
               "before the forward, never between forward and backward; or freeze them before wrapping." +
               (options_.static_graph ? " DdpOptions::static_graph keeps the parameters used in the first "
                                        "iteration for good, so it cannot follow such a change."
                                      : "");
    } else if (options_.static_graph) {
      advice = "DdpOptions::static_graph is set, and these parameters had gradients in the first "
               "iteration: every iteration must use the same parameters (use find_unused_parameters "
               "where the set changes).";
    } else if (options_.find_unused_parameters) {
      advice = "find_unused_parameters is on, but these are reachable from the outputs of forward, "
               "so an output that reaches them did not take part in the loss: make every output of "
               "forward contribute to the loss (an unused head can be added times zero).";
    } else {
      advice = "If parts of the model are unused in some iterations, set "
               "DdpOptions::find_unused_parameters = true; otherwise make every output of forward "
               "contribute to the loss.";
    }
    pending_error_ =
        "DistributedDataParallel on rank " + std::to_string(pg_->rank()) + ": " +
        std::to_string(missing) + " parameter(s) received no gradient in this backward: " + names +
        ". Their buckets could not be reduced, so gradients were not synchronized. " + advice;
    // Peers may wait in a bucket's all-reduce that this rank will never run,
    // and this rank's launched buckets may wait for peers: the abort ends
    // both within ~100 ms, and peers report this message.
    pg_->Abort(transport::FailedPreconditionError(pending_error_));
    // Whether or not they all end, pending_error_ keeps the buckets from
    // being reused; what those that ended took for this iteration goes now.
    (void)WaitInFlight();
    ReleaseFailedBuckets();
    unfinished_ = false;
    // Out of this backward, so that no optimizer step takes the gradients
    // that were not synchronized (and again at the next forward).
    throw std::runtime_error(pending_error_);
  }
  if (handles_unused()) {
    used_work_ = pg_->AllReduce(used_, transport::ReduceOp::kSum, "unused parameter map");
  }

  IterationTiming timing{.prepared = prepared_at_, .last_grad = last_grad_at_};
  // The gap closed at the first gradient: no forward adds to these now.
  std::array<std::pair<Clock::time_point, Clock::time_point>, kTracedGapForwards> gap_spans;
  size_t gap_span_count = 0;
  {
    std::lock_guard lock(gap_mu_);
    timing.joined_forwards = gap_forwards_;
    gap_spans = gap_spans_;
    gap_span_count = gap_span_count_;
  }
  // One thread runs the collectives in launch order: once the last bucket
  // is done the others are too, so waiting on it first sleeps once. A
  // failed wait throws out of backward, and the iteration cannot end: the
  // copies of stale gradients its end would have given back go with it
  // (the next forward refuses to run and drops the rest).
  try {
    for (auto b = buckets_.rbegin(); b != buckets_.rend(); ++b) b->work.Wait();
    if (used_work_.valid()) used_work_.Wait();
  } catch (...) {
    ReleaseStaleCopies();
    throw;
  }
  for (Bucket& b : buckets_) {
    timing.buckets.push_back({.started = b.work.started(), .finished = b.work.finished(),
                              .on_caller = pg_->collectives_on_caller() && b.device.is_cpu()});
  }
  std::vector<char> globally_used(params_.size(), 1);
  if (used_work_.valid()) {
    // The map is a host tensor.
    timing.used_map = {.started = used_work_.started(), .finished = used_work_.finished(),
                       .on_caller = pg_->collectives_on_caller()};
    const int32_t* u = used_.data<int32_t>();
    for (size_t i = 0; i < params_.size(); ++i) globally_used[i] = u[i] > 0;
  }
  // Every collective has finished. Until here a failed wait (which throws
  // out of backward) may leave one running on the bucket memory, so the
  // iteration counts as unfinished: the next forward refuses to reuse it.
  unfinished_ = false;
  // The next accumulation starts here.
  std::memset(used_.data_ptr(), 0, used_.nbytes());
  for (Bucket& b : buckets_) {
    b.work = Work();
    // Its Work has completed: the hook's promise ends here (a solo
    // bucket's GradBucket would otherwise keep its gradient alive).
    b.grad_bucket.reset();
    for (size_t i : b.params) {
      if (!detached_[i]) continue;
      detached_[i] = 0;
      params_[i].set_grad(b.is_solo ? b.solo : slots_[i].view);
    }
    if (b.is_solo) {
      // Reduced in place (or copied, then written back as below); a
      // gradient this rank lacked arrives now, unless no rank had one.
      const size_t i = b.params[0];
      const nn::Tensor& grad = params_[i].grad();
      if (globally_used[i] && !grad.defined()) {
        params_[i].set_grad(b.solo);
      } else if (globally_used[i] && b.solo_copied && grad_write_back_) {
        WriteBack(grad, b.solo);
      }
      b.solo = nn::Tensor();
      b.solo_copied = false;
      continue;
    }
    for (size_t i : b.params) {
      const nn::Tensor& view = slots_[i].view;
      const nn::Tensor& grad = params_[i].grad();
      // Unused on every rank: keeps no gradient, or the one it had (a
      // bucket view's, reduced in place with the bucket, from its copy).
      if (!globally_used[i]) {
        if (stale_[i].defined() && grad.defined()) WriteBack(grad, stale_[i]);
        stale_[i] = nn::Tensor();
        continue;
      }
      stale_[i] = nn::Tensor();
      if (options_.gradient_as_bucket_view) {
        if (!grad.defined()) params_[i].set_grad(view);
        continue;  // .grad is the bucket
      }
      if (!grad_write_back_) continue;  // the hook consumed the bucket
      if (!grad.defined()) {
        params_[i].set_grad(view.Clone());
      } else {
        WriteBack(grad, view);
      }
    }
  }
  used_work_ = Work();
  const Clock::time_point end = Clock::now();

  ++iterations_;
  CountGroupIteration();
  finalized_ = true;
  // Statistics: see DdpStats for the definitions.
  timing.end = end;
  AddIterationTimes(timing, times_);
  if (trace_ != nullptr) {
    // Around the forwards that ran before the first gradient (each has its
    // own "forward" event): their time is not this backward's compute.
    Clock::time_point from = prepared_at_;
    // In start order (forwards on two threads may end out of it): an
    // insertion sort of the few kept.
    for (size_t i = 1; i < gap_span_count; ++i) {
      for (size_t j = i; j > 0 && gap_spans[j].first < gap_spans[j - 1].first; --j) {
        std::swap(gap_spans[j], gap_spans[j - 1]);
      }
    }
    for (size_t i = 0; i < gap_span_count; ++i) {
      const auto& [start, forward_end] = gap_spans[i];
      if (start > from) trace_->Complete("backward compute", "compute", from, start);
      from = std::max(from, forward_end);
    }
    trace_->Complete("backward compute", "compute", from, std::max(from, last_grad_at_));
    trace_->Complete("backward wait + write-back", "compute", compute_end, end);
  }
}

void AddIterationTimes(const IterationTiming& timing, ReducerTimes& times) {
  using Clock = std::chrono::steady_clock;
  // Collectives on the communication thread: the span from the first start
  // to the last finish, overlapped up to the last gradient.
  Clock::time_point comm_start = Clock::time_point::max(), comm_end{};
  // Collectives on this thread, inside the gradient hooks (before the last
  // gradient), held backward up for their whole duration: that is not
  // compute, and none of it overlapped. Those that ran after the last
  // gradient (a static graph's first iteration launches every bucket from
  // Finalize) are already inside the exposed time.
  Clock::duration on_caller{}, held_up{};
  auto add = [&](const IterationTiming::Collective& c) {
    // A Work that recorded no start or finish (one issued before a fork, read
    // in the child) is left out: its zero time point would make the span
    // reach back to the clock's epoch.
    if (c.started == Clock::time_point{} || c.finished < c.started) return;
    if (c.on_caller) {
      on_caller += c.finished - c.started;
      if (c.finished <= timing.last_grad) held_up += c.finished - c.started;
      return;
    }
    comm_start = std::min(comm_start, c.started);
    comm_end = std::max(comm_end, c.finished);
  };
  for (const IterationTiming::Collective& c : timing.buckets) add(c);
  add(timing.used_map);
  ++times.iterations;
  times.backward_compute += Seconds(timing.last_grad - timing.prepared - held_up - timing.joined_forwards);
  times.exposed += Seconds(timing.end - timing.last_grad + held_up);
  times.backward_comm += Seconds(on_caller);
  if (comm_start != Clock::time_point::max()) {
    times.backward_comm += Seconds(comm_end - comm_start);
    times.overlap += std::max(0.0, Seconds(std::min(timing.last_grad, comm_end) - comm_start));
  }
}

void Reducer::CountGroupIteration() {
  // A rank that shadowed the first iteration sets the flag as the ranks
  // that ran it do; deciding from iterations_ would leave it out, and the
  // others would broadcast the bucket order while it runs something else.
  ++group_iterations_;
  if (group_iterations_ == 1 && (!options_.find_unused_parameters || options_.static_graph)) {
    rebuild_pending_ = !rebuilt_;
  }
}

void Reducer::ShadowBackward(double divisor, bool write_gradients) {
  // The same collectives as the active ranks: same hook, same reduction;
  // and a hook registered now would differ from theirs, which refuse one
  // after their first backward.
  comm_hook_locked_ = true;
  divisor_ = divisor;
  std::vector<Work> works;
  std::vector<nn::Tensor> results;
  // Zeros of each bucket's kind: this rank contributes nothing, and its own
  // gradients (a view in gradient_as_bucket_view mode) are not reduced.
  // All are allocated before the first launch. Should an allocation fail,
  // only this rank knows: the active ranks would wait in their bucket
  // reductions until the group's timeout, so they are stopped now with the
  // cause, and this rank refuses later forwards.
  try {
    for (const Bucket& bucket : buckets_) {
      if (fail_next_bucket_allocation.exchange(false)) throw std::bad_alloc();
      results.push_back(nn::Zeros({bucket.numel}, {.dtype = bucket.dtype, .device = bucket.device}));
    }
  } catch (const std::exception& e) {
    pending_error_ = "DistributedDataParallel on rank " + std::to_string(pg_->rank()) +
                     ": allocating the zero gradient buckets that this rank, which ran out of inputs under "
                     "Join, contributes to the active ranks' backward failed (" + e.what() +
                     "). The process group was aborted.";
    pg_->Abort(transport::FailedPreconditionError(pending_error_));
    throw;
  }
  nn::Tensor used;
  try {
    for (size_t b = 0; b < buckets_.size(); ++b) works.push_back(Launch(b, results[b]));
    if (handles_unused()) {
      used = nn::ZerosLike(used_);
      works.push_back(pg_->AllReduce(used, transport::ReduceOp::kSum, "unused parameter map"));
    }
    for (Work& w : works) w.Wait();
  } catch (...) {
    // A hook threw, or a collective failed (the group aborted, a peer
    // lost): the others end within moments. What this shadowed backward's
    // buckets took (the zeros, held by the GradBucket each hook call was
    // given) goes once they have, not with the wrapper; one whose
    // collective still runs after the group's timeout keeps it, since its
    // hook's task may refer to it.
    const transport::Deadline deadline = Clock::now() + pg_->options().timeout;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (b < works.size()) {
        (void)works[b].WaitFor(deadline);
        if (!works[b].IsCompleted()) continue;
      }
      buckets_[b].grad_bucket.reset();
    }
    throw;
  }
  // Every Work has completed: the zero buckets go now, not with the next
  // backward of this rank's own (Finalize), which may come an epoch later
  // or never; until then they doubled the gradients' memory.
  for (Bucket& bucket : buckets_) bucket.grad_bucket.reset();
  // Gradients this rank accumulated under NoSync before it ran out were
  // not contributed (it sent zeros): its used map starts afresh, as after a
  // synchronizing backward of its own.
  std::memset(used_.data_ptr(), 0, used_.nbytes());
  if (write_gradients && grad_write_back_) {
    const int32_t* u = used.defined() ? used.data<int32_t>() : nullptr;
    nn::NoGradGuard guard;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& bucket = buckets_[b];
      for (size_t k = 0; k < bucket.params.size(); ++k) {
        const size_t i = bucket.params[k];
        if (u != nullptr && u[i] == 0) {
          // Unused on every rank: no gradient, as an active rank has after
          // ZeroGrad (set_to_none, the default). The one left from this
          // rank's own last iteration would be stepped by its shard.
          params_[i].set_grad(nn::Tensor());
          continue;
        }
        const nn::Tensor average =
            results[b].Narrow(0, bucket.offsets[k], params_[i].numel()).View(params_[i].shape());
        const nn::Tensor& grad = params_[i].grad();
        if (grad.defined()) {
          grad.CopyFrom(average);
        } else if (options_.gradient_as_bucket_view && slots_[i].view.defined()) {
          slots_[i].view.CopyFrom(average);
          params_[i].set_grad(slots_[i].view);
        } else {
          params_[i].set_grad(average.Clone());
        }
      }
    }
  }
  CountGroupIteration();
}

}  // namespace ddp::dist::internal
