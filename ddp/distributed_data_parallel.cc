#include "ddp/distributed_data_parallel.h"

#include <algorithm>
#include <charconv>
#include <cinttypes>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include <unistd.h>

#include "ddp/debug_mode.h"
#include "ddp/reducer.h"
#include "ddp/replicas.h"
#include "ddp/sync_batch_norm.h"

namespace ddp::dist {

using Clock = std::chrono::steady_clock;

std::string DdpStats::ToString() const {
  // A window without communication (no iteration yet, one rank) overlapped
  // nothing: overlap_fraction's 1 there is no "100%" to print.
  char overlap[96];
  if (backward_comm_ms > 0) {
    std::snprintf(overlap, sizeof(overlap), "overlapped %.2f ms = %.0f%%", overlap_ms, 100.0 * overlap_fraction());
  } else {
    std::snprintf(overlap, sizeof(overlap), "no communication to overlap");
  }
  char line[512];
  std::snprintf(line, sizeof(line),
                "forward %.2f ms, backward compute %.2f ms, backward comm %.2f ms (%s, exposed %.2f ms), "
                "comm thread CPU %.2f ms, waiting for other ranks %.2f ms",
                forward_ms, backward_compute_ms, backward_comm_ms, overlap, exposed_ms, comm_thread_cpu_ms,
                peer_wait_ms);
  std::string s = line;
  s += ", " + std::to_string(bucket_bytes.size()) + " bucket(s) [";
  for (size_t i = 0; i < bucket_bytes.size(); ++i) {
    char b[32];
    std::snprintf(b, sizeof(b), "%s%.2f MiB", i ? ", " : "", bucket_bytes[i] / 1048576.0);
    s += b;
  }
  return s + "]";
}

// ------------------------------------------------------- trace files ----

namespace {

// The trace files the wrappers of this process write, by their absolute
// path. Two wrappers given the same trace_prefix (on one group, or on two
// groups of one rank) would write one file: the second is refused before it
// touches the file or the group (whose trace it would take over). The
// refusal is thrown only after the ranks' model comparison, which carries
// it, so that every rank fails with it, the ranks that do not trace too.
class TraceFileClaim {
 public:
  TraceFileClaim(const std::string& path, const std::string& prefix) : key_(Key(path)) {
    std::lock_guard lock(Mu());
    if (!Claimed().insert(key_).second) {
      throw std::invalid_argument(
          "DistributedDataParallel: DdpOptions::trace_prefix \"" + prefix + "\": the trace file " + path +
          " is already written by another DistributedDataParallel of this process (made with the same "
          "trace_prefix, on this group or another of this rank); give each wrapper its own trace_prefix, "
          "or, to wrap a model again, destroy the earlier wrapper first");
    }
  }
  ~TraceFileClaim() {
    std::lock_guard lock(Mu());
    Claimed().erase(key_);
  }
  TraceFileClaim(const TraceFileClaim&) = delete;
  TraceFileClaim& operator=(const TraceFileClaim&) = delete;

 private:
  // Links and "." or ".." in the folder resolved, so that two spellings
  // of one file meet (the file itself may not exist yet).
  static std::string Key(const std::string& path) {
    std::error_code error;
    std::filesystem::path key = std::filesystem::weakly_canonical(path, error);
    if (error) key = std::filesystem::absolute(path, error).lexically_normal();
    return error ? path : key.string();
  }
  static std::mutex& Mu() {
    static std::mutex mu;
    return mu;
  }
  static std::set<std::string>& Claimed() {
    static std::set<std::string> claimed;
    return claimed;
  }
  const std::string key_;
};

}  // namespace

// -------------------------------------------------------------- Impl ----

class DistributedDataParallel::Impl {
 public:
  // Null with nothing to train, and with one rank until a communication
  // hook is registered (RegisterCommHook builds it from `single_trainable`
  // then, so that the hook runs as on N ranks).
  std::unique_ptr<internal::Reducer> reducer;
  // A hook was registered on a wrapper with no reducer (no trainable
  // parameters): a second one is refused there as the reducer refuses it.
  bool hook_registered = false;
  std::vector<std::pair<std::string, nn::Tensor>> single_trainable;
  internal::ReducerOptions single_options;
  std::vector<nn::Tensor> buffers;
  // Parameters that did not require grad when the model was wrapped: no
  // bucket has them, so one that starts requiring grad later is refused.
  std::vector<std::pair<std::string, nn::Tensor>> left_out;
  std::shared_ptr<TraceRecorder> trace;
  std::unique_ptr<TraceFileClaim> trace_claim;  // while `trace` is written
  bool require_sync = true;
  // Every parameter of the model when it was wrapped (held, so that the
  // addresses stay theirs): a reached leaf that is a parameter now and
  // was none then was added after wrapping (ModelNames).
  std::vector<nn::Tensor> wrapped;
  std::unordered_set<const nn::TensorImpl*> wrapped_impls;
  // The tensors of `buffers`: a buffer of the model outside it was added
  // after wrapping.
  std::unordered_set<const nn::TensorImpl*> buffer_impls;
  // Module::StructureVersion() when the model was last seen to hold
  // nothing added after wrapping that the forwards refuse (at wrapping,
  // then at forwards).
  uint64_t structure_seen = 0;
  // Under find_unused_parameters without static_graph: the parameters
  // added after wrapping that required grad at that look, left to the
  // graph walk, which refuses one a forward reaches. The walk meets a
  // parameter only while it requires grad, so one frozen since sends the
  // next synchronizing forward back to the model's parameters (where it is
  // refused as an added frozen one, if still there).
  std::vector<nn::Tensor> added_trainable;

  // Join state.
  bool join_enabled = false;
  JoinOptions join_options;
  int64_t forwards = 0;  // training forwards with grad outside NoSync
  int64_t forwards_at_join = 0;  // `forwards` when the current Join began
  // Without a reducer (one rank, or nothing to train) no backward is seen:
  // iterations() counts the forwards that synchronize on several ranks
  // (eval-mode ones outside Join too), so that what it counts (the check of
  // OverlappedZeroOptimizer::Step, say) is the same on one rank as on N.
  int64_t sync_forwards = 0;

  // Statistics. The totals only grow; a window is the difference from a
  // snapshot of them. The user's window (Stats, ResetStats) and the
  // logger's (log_stats_every) have a snapshot each, so that logging does
  // not restart the window the user reads.
  struct StatsSnapshot {
    int64_t forward_count = 0;
    double forward_seconds = 0;
    internal::ReducerTimes times;    // the reducer's totals then
    std::chrono::nanoseconds cpu{0};   // pg's CommThreadCpuTime then
    std::chrono::nanoseconds wait{0};  // pg's PeerWaitTime then
  };
  // Training forwards, and those of any mode that ran between a
  // synchronizing training forward and its backward (Reducer::ForwardEnded), ever.
  int64_t forward_count = 0;
  double forward_seconds = 0;
  StatsSnapshot user_since;
  StatsSnapshot log_since;
  int64_t log_every = 0;
  int64_t logged_at = 0;
};

// ------------------------------------------------------------ wrapper ----

namespace {

// The message of the exception being handled; call it inside a catch block.
std::string CurrentExceptionCause() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

using StatsSnapshot = DistributedDataParallel::Impl::StatsSnapshot;

StatsSnapshot TakeStatsSnapshot(const DistributedDataParallel::Impl& s, const ProcessGroup& pg) {
  StatsSnapshot snap;
  snap.forward_count = s.forward_count;
  snap.forward_seconds = s.forward_seconds;
  if (s.reducer != nullptr) snap.times = s.reducer->times();
  snap.cpu = pg.CommThreadCpuTime();
  snap.wait = pg.PeerWaitTime();
  return snap;
}

DdpStats StatsSince(const DistributedDataParallel::Impl& s, const ProcessGroup& pg, const StatsSnapshot& since) {
  DdpStats stats;
  const int64_t forwards = s.forward_count - since.forward_count;
  if (forwards > 0) stats.forward_ms = 1e3 * (s.forward_seconds - since.forward_seconds) / forwards;
  if (s.reducer != nullptr) {
    const internal::ReducerTimes& t = s.reducer->times();
    const int64_t iterations = t.iterations - since.times.iterations;
    stats.iterations = iterations;
    stats.bucket_bytes = s.reducer->BucketBytes();
    if (iterations > 0) {
      const double k = 1e3 / iterations;
      stats.backward_compute_ms = (t.backward_compute - since.times.backward_compute) * k;
      stats.backward_comm_ms = (t.backward_comm - since.times.backward_comm) * k;
      stats.overlap_ms = (t.overlap - since.times.overlap) * k;
      stats.exposed_ms = (t.exposed - since.times.exposed) * k;
      stats.comm_thread_cpu_ms =
          std::chrono::duration<double, std::milli>(pg.CommThreadCpuTime() - since.cpu).count() / iterations;
      stats.peer_wait_ms =
          std::chrono::duration<double, std::milli>(pg.PeerWaitTime() - since.wait).count() / iterations;
    }
  }
  return stats;
}

std::vector<internal::ReplicaEntry> DescribeReplica(const nn::modules::Module& module, const DdpOptions& o) {
  std::vector<internal::ReplicaEntry> entries;
  // Parameters, then buffers: the order BroadcastCoalesced gets them in.
  // The buffers only where they are broadcast (as PyTorch, which compares
  // the parameters only): with broadcast_buffers off no collective ever
  // sends them, and each rank's may differ, in value and in shape.
  internal::GpuOrder gpus;
  for (const auto& [name, p] : module.NamedParameters()) {
    entries.push_back({"parameter", name, internal::DescribeTensor(p, true, gpus)});
  }
  if (o.broadcast_buffers) {
    for (const auto& [name, b] : module.NamedBuffers()) {
      entries.push_back({"buffer", name, internal::DescribeTensor(b, false, gpus)});
    }
  }
  // Every module's path and type: a rank that skipped ConvertSyncBatchNorm
  // has the same parameters and buffers, but its BatchNorm runs no
  // collective while the others' SyncBatchNorm waits in one. TypeName is a
  // fixed string per class, the same on every rank.
  for (const auto& [path, m] : const_cast<nn::modules::Module&>(module).NamedModules()) {
    entries.push_back({"module", path.empty() ? "(root)" : path, m->TypeName()});
  }
  auto option = [&](const char* name, const std::string& value) {
    entries.push_back({"option", name, value});
  };
  // The shortest text that reads back as the same double: a stream's six
  // digits would show 25 and 25.00001 alike, yet their byte limits differ,
  // and so may the buckets built from them.
  auto number = [](double v) {
    char text[64];
    const auto [end, error] = std::to_chars(text, text + sizeof(text), v);
    return error == std::errc() ? std::string(text, end) : std::to_string(v);
  };
  option("bucket_cap_mb", number(o.bucket_cap_mb));
  option("first_bucket_mb", number(o.first_bucket_mb));
  option("inplace_gradient_mb", number(o.inplace_gradient_mb));
  option("broadcast_buffers", o.broadcast_buffers ? "true" : "false");
  option("find_unused_parameters", o.find_unused_parameters ? "true" : "false");
  option("gradient_as_bucket_view", o.gradient_as_bucket_view ? "true" : "false");
  option("static_graph", o.static_graph ? "true" : "false");
  std::string order;
  for (size_t i = 0; i < o.bucket_order.size(); ++i) {
    order += (i ? "," : "") + std::to_string(o.bucket_order[i]);
  }
  option("bucket_order", order.empty() ? "none" : order);
  return entries;
}

// The reducer's view of the wrapped model (Reducer::SetModelParameterNames):
// one walk of its parameters per call, on error paths and in the graph walk
// of find_unused_parameters for leaves that are no bucket's.
internal::Reducer::ModelParameterNames ModelNames(const nn::modules::Module* module,
                                                  const DistributedDataParallel::Impl* impl) {
  return [module, impl](const std::vector<nn::Tensor>& tensors) {
    std::unordered_map<const nn::TensorImpl*, std::string> now;
    for (const auto& [name, p] : module->NamedParameters()) now.emplace(p.impl(), name);
    std::vector<internal::Reducer::ModelParameter> out;
    for (const nn::Tensor& t : tensors) {
      internal::Reducer::ModelParameter found;
      if (auto it = now.find(t.impl()); it != now.end()) {
        found.name = it->second;
        found.added = impl->wrapped_impls.count(t.impl()) == 0;
      }
      out.push_back(std::move(found));
    }
    return out;
  };
}

// mb MiB in bytes. NaN, infinities and sizes past 2^40 MiB (whose byte
// count would not fit a size_t) are refused, as are 0 unless `zero_allowed`.
size_t MiB(double mb, const char* what, bool zero_allowed) {
  const bool in_range = zero_allowed ? mb >= 0 : mb > 0;
  if (!in_range || !(mb <= 1099511627776.0)) {
    throw std::invalid_argument(std::string("DdpOptions::") + what + " must be " +
                                (zero_allowed ? "at least 0" : "positive") + " and finite, got " +
                                std::to_string(mb));
  }
  // A positive size under one byte is one byte: for inplace_gradient_mb,
  // 0 means "no gradient in place", the opposite of what 1e-9 asks.
  return mb > 0 ? std::max<size_t>(1, static_cast<size_t>(mb * 1048576.0)) : 0;
}

// DdpOptions::bucket_order as the reducer's indices; empty when none was
// given. Throws unless it is a permutation of [0, n), naming the first
// entry that is out of range or repeated.
std::vector<size_t> CheckedBucketOrder(const std::vector<int64_t>& order, size_t n) {
  if (order.empty()) return {};
  if (order.size() != n) {
    throw std::invalid_argument("DdpOptions::bucket_order must list each of the " + std::to_string(n) +
                                " parameters that require grad once, got " +
                                std::to_string(order.size()) + " entries");
  }
  std::vector<size_t> out(n);
  std::vector<char> seen(n, 0);
  for (size_t k = 0; k < n; ++k) {
    const int64_t v = order[k];
    if (v < 0 || static_cast<uint64_t>(v) >= n || seen[static_cast<size_t>(v)]) {
      throw std::invalid_argument(
          "DdpOptions::bucket_order must be a permutation of [0, " + std::to_string(n) + "): entry " +
          std::to_string(k) + " is " + std::to_string(v) +
          (v >= 0 && static_cast<uint64_t>(v) < n ? ", which appears before it" : ", out of range"));
    }
    seen[static_cast<size_t>(v)] = 1;
    out[k] = static_cast<size_t>(v);
  }
  return out;
}

// Join's flags, all-reduced (sum) at every training forward under Join and
// at every round of Join::Wait: [0, size): rank r is active; size: this
// iteration synchronizes gradients, size + 1: rebuilds the buckets,
// size + 2: broadcasts buffers; then [size + 3, 2 * size + 3): rank r's
// JoinOptions (kJoin* bits), so that every rank sees every rank's options.
constexpr int kJoinFlagsFixed = 3;
constexpr int32_t kJoinDivideByInitial = 1;
constexpr int32_t kJoinThrowOnEarlyTermination = 2;
constexpr int32_t kJoinShadowStep = 4;

nn::Tensor JoinFlags(int size, int rank, const JoinOptions& o) {
  nn::Tensor flags = nn::Zeros({2 * size + kJoinFlagsFixed}, {.dtype = nn::DType::kInt32});
  flags.data<int32_t>()[size + kJoinFlagsFixed + rank] =
      (o.divide_by_initial_world_size ? kJoinDivideByInitial : 0) |
      (o.throw_on_early_termination ? kJoinThrowOnEarlyTermination : 0) |
      (o.shadow_step ? kJoinShadowStep : 0);
  return flags;
}

// After the flags' all-reduce: every rank has every rank's JoinOptions, so
// when they differ every rank aborts the group and throws the same message
// (run on, they would divide gradients differently, shadow nothing while
// the others throw, or leave a shadowed optimizer step's broadcasts
// unmatched).
void CheckJoinOptions(ProcessGroup& pg, const int32_t* f, int size) {
  const int32_t* bits = f + size + kJoinFlagsFixed;
  std::string differences;
  const std::pair<int32_t, const char*> options[] = {
      {kJoinDivideByInitial, "divide_by_initial_world_size"},
      {kJoinThrowOnEarlyTermination, "throw_on_early_termination"},
      {kJoinShadowStep, "shadow_step"}};
  for (const auto& [bit, name] : options) {
    std::string set, unset;
    for (int r = 0; r < size; ++r) {
      std::string& list = (bits[r] & bit) ? set : unset;
      list += (list.empty() ? "" : ", ") + std::to_string(r);
    }
    if (set.empty() || unset.empty()) continue;
    const bool is_function = bit == kJoinShadowStep;
    differences += std::string(differences.empty() ? "" : "; ") + name + " is " +
                   (is_function ? "set" : "true") + " on rank(s) " + set + " and " +
                   (is_function ? "empty" : "false") + " on rank(s) " + unset;
  }
  if (differences.empty()) return;
  const transport::Status error = transport::InvalidArgumentError(
      "Join: the ranks passed different JoinOptions: " + differences +
      ". Every rank must construct its Join with the same options. The process group was aborted.");
  pg.Abort(error);
  throw DistributedError(error);
}

// The process groups of this process that have a Join in progress (from
// its construction until its Wait returns or it is destroyed). A group
// outlives its Joins: each wrapper holds it.
std::mutex join_groups_mutex;
std::set<const ProcessGroup*>& JoinGroups() {
  static auto* groups = new std::set<const ProcessGroup*>();
  return *groups;
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::modules::Module> module,
                                                 DdpOptions options)
    : module_(std::move(module)), options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  if (module_ == nullptr) throw std::invalid_argument("DistributedDataParallel: module is null");
  if (dynamic_cast<DistributedDataParallel*>(module_.get()) != nullptr) {
    throw std::invalid_argument("DistributedDataParallel: the module is already wrapped");
  }
  // The options are checked here, but a bad value is reported only after
  // the replicas are compared (below): a rank whose options or trainable
  // parameters differ from the others' (one parameter frozen on it alone,
  // with a bucket_order saved from a run where it was not) would otherwise
  // throw alone, with a message about its own options, while the others
  // wait in the comparison until the group's timeout. After it, every rank
  // throws the same message naming the difference, or, when every rank
  // passed the same values, the same message about the bad value.
  internal::ReducerOptions reducer_options;
  std::string option_error;
  try {
    reducer_options.first_bucket_bytes = MiB(options_.first_bucket_mb, "first_bucket_mb", false);
    reducer_options.bucket_bytes = MiB(options_.bucket_cap_mb, "bucket_cap_mb", false);
    reducer_options.inplace_bytes = MiB(options_.inplace_gradient_mb, "inplace_gradient_mb", true);
    size_t trainable = 0;
    for (const auto& [name, p] : module_->NamedParameters()) trainable += p.requires_grad() ? 1 : 0;
    reducer_options.bucket_order = CheckedBucketOrder(options_.bucket_order, trainable);
  } catch (const std::invalid_argument& e) {
    option_error = e.what();
  }
  if (options_.process_group != nullptr) {
    pg_ = options_.process_group;
  } else {
    try {
      pg_ = DefaultProcessGroup();
    } catch (const std::logic_error&) {
      // No group to compare with: the bad value is the error to report.
      if (!option_error.empty()) throw std::invalid_argument(option_error);
      throw;
    }
  }
  RegisterModule("module", module_);
  reducer_options.find_unused_parameters = options_.find_unused_parameters;
  reducer_options.gradient_as_bucket_view = options_.gradient_as_bucket_view;
  reducer_options.static_graph = options_.static_graph;

  // The level the group read when it was made, not the environment now: a
  // DDP_DEBUG set since (on some ranks only) would make this rank throw or
  // log alone.
  const DebugLevel level = pg_->debug_level();
  impl_->log_every = options_.log_stats_every;
  if (impl_->log_every == 0 && level != DebugLevel::kOff) impl_->log_every = 100;
  // A trace file taken by another wrapper of this process is refused, but
  // not before the comparison below: the ranks may trace differently (only
  // rank 0, say), and a rank that threw here alone would leave the others
  // waiting in it until the group's timeout.
  std::string trace_refusal;
  if (!options_.trace_prefix.empty()) {
    try {
      impl_->trace_claim = std::make_unique<TraceFileClaim>(TracePath(), options_.trace_prefix);
      impl_->trace = std::make_shared<TraceRecorder>();
      pg_->set_trace(impl_->trace);
    } catch (const std::invalid_argument& e) {
      trace_refusal = e.what();
    }
  }
  // Set once the ranks agree: a failure after it is this rank's alone.
  bool compared = false;
  try {
    // 1. Same model on every rank, or the same error on every rank. The
    // trace refusal goes with the model's description, so that the ranks
    // all learn of one rank's, naming it; when every rank refused, the
    // descriptions agree and each throws its own refusal.
    std::vector<internal::ReplicaEntry> described = DescribeReplica(*module_, options_);
    described.push_back({"option", "trace_prefix",
                         trace_refusal.empty() ? "accepted (or not set)"
                                               : "refused: its trace file is already written by another "
                                                 "DistributedDataParallel of this process"});
    try {
      internal::VerifyReplicas(*pg_, described,
                               "DistributedDataParallel: the ranks' models differ (every rank must register the "
                               "same parameters, and buffers unless broadcast_buffers is false, in the same "
                               "order, with the same shapes, dtypes and strides, the same modules (paths and "
                               "types), and pass the same options).");
    } catch (const std::invalid_argument&) {
      // The peers got the comparison's message; this rank its own cause.
      if (!trace_refusal.empty()) throw std::invalid_argument(trace_refusal);
      throw;
    }
    if (!trace_refusal.empty()) throw std::invalid_argument(trace_refusal);
    // Past the comparison every rank has the same options and the same
    // trainable parameters, so a bad value is bad on all of them, and they
    // all throw this.
    if (!option_error.empty()) throw std::invalid_argument(option_error);
    compared = true;
    // Not compared across ranks (only rank 0 logs, so the ranks may pass
    // different values): a bad one is this rank's failure, which the peers
    // learn through the abort below.
    if (options_.log_stats_every < 0) {
      throw std::invalid_argument("DdpOptions::log_stats_every must be at least 0 (0: never), got " +
                                  std::to_string(options_.log_stats_every));
    }
    // The timeline so far, appended at every forward: what a run that dies
    // without unwinding leaves (the complete file is written at the end).
    // A FIFO or a terminal is the stream itself: it cannot be renamed over.
    if (impl_->trace != nullptr) {
      if (TraceRecorder::IsStreamTarget(TracePath())) {
        // The other ranks wait for this one meanwhile, up to the group's
        // timeout: they must hear of a reader that never came (through the
        // abort below) before they time out without the cause.
        const auto wait = std::min(options_.trace_reader_wait, pg_->options().timeout / 2);
        impl_->trace->StreamDocumentTo(TracePath(), pg_->root_rank(), wait);
      } else {
        impl_->trace->StreamTo(PartialTracePath(), pg_->root_rank());
      }
    }

    // 2. Rank 0's values everywhere.
    // Read before the walk: a registration during it is walked again.
    impl_->structure_seen = nn::modules::Module::StructureVersion();
    std::vector<nn::Tensor> state;
    for (const auto& [name, p] : module_->NamedParameters()) {
      state.push_back(p);
      impl_->wrapped.push_back(p);
      impl_->wrapped_impls.insert(p.impl());
    }
    // The buffers only when the forwards broadcast them, as PyTorch's
    // wrapping and this file's Join final sync: with broadcast_buffers off
    // they are each rank's own (running statistics restored from each
    // rank's checkpoint, say), and rank 0's would overwrite them.
    for (const auto& [name, b] : module_->NamedBuffers()) {
      if (options_.broadcast_buffers) state.push_back(b);
      impl_->buffers.push_back(b);
      impl_->buffer_impls.insert(b.impl());
    }
    internal::BroadcastCoalesced(*pg_, state, 0,
                                 options_.broadcast_buffers ? "initial parameters and buffers" : "initial parameters");

    // 3. Buckets and hooks. One rank has nothing to reduce: no buckets (no
    // copies, no memory) unless a communication hook is registered.
    if (pg_->size() > 1) {
      // Whether to launch the CPU buckets together at the end of backward
      // (Reducer::LaunchReadyBuckets) must be the same on every rank, or
      // the buckets and the collectives issued during backward (SyncBatchNorm's)
      // would pair up in different orders. Each rank's own choice of thread
      // may differ (DDP_COLLECTIVE_THREAD, or auto on hosts with other core
      // counts): they launch together only when every rank runs on the caller.
      nn::Tensor on_caller = nn::Full({1}, pg_->collectives_on_caller() ? 1.0 : 0.0, {.dtype = nn::DType::kInt32});
      pg_->AllReduce(on_caller, transport::ReduceOp::kMin, "collective threads of the ranks").Wait();
      reducer_options.all_ranks_on_caller = on_caller.data<int32_t>()[0] == 1;
      std::vector<std::pair<std::string, nn::Tensor>> trainable;
      for (const auto& [name, p] : module_->NamedParameters()) {
        if (p.requires_grad()) {
          trainable.emplace_back(name, p);
        } else {
          impl_->left_out.emplace_back(name, p);
        }
      }
      if (!trainable.empty()) {
        impl_->reducer = std::make_unique<internal::Reducer>(std::move(trainable), pg_, reducer_options,
                                                             impl_->trace);
        impl_->reducer->SetModelParameterNames(ModelNames(module_.get(), impl_.get()));
      }
    } else {
      for (const auto& [name, p] : module_->NamedParameters()) {
        if (p.requires_grad()) impl_->single_trainable.emplace_back(name, p);
      }
      impl_->single_options = reducer_options;
    }
    // The complete file of an earlier run would be read beside this run's
    // partial one as one run: this run's replaces it at the end, and until
    // then there is none. Removed only now, so that a construction that
    // fails leaves it. One that cannot be removed (a directory by that name,
    // another user's file in a sticky folder) is trouble of the trace only,
    // as the final write's failure is: a warning, and the training goes on.
    if (impl_->trace != nullptr && !impl_->trace->streams_document() && ::unlink(TracePath().c_str()) != 0 &&
        errno != ENOENT) {
      const int error = errno;
      std::fprintf(stderr, "[ddp] warning: trace: cannot remove %s, an earlier run's trace: %s\n",
                   TracePath().c_str(), std::strerror(error));
    }
    impl_->user_since = TakeStatsSnapshot(*impl_, *pg_);
    impl_->log_since = impl_->user_since;
    if (level != DebugLevel::kOff && pg_->rank() == 0) {
      std::fprintf(stderr, "[ddp] DistributedDataParallel over %d rank(s): %s\n", pg_->size(),
                   Stats().ToString().c_str());
    }
  } catch (...) {
    // The group outlives a wrapper that failed to construct; the partial
    // trace of a run that never started is not left behind.
    if (impl_->trace != nullptr) {
      pg_->StopTrace(impl_->trace.get());
      impl_->trace->EndStream(/*remove=*/true);
    }
    if (compared && pg_->size() > 1) {
      // A failure here (bucket allocation out of memory, say) is this
      // rank's alone: the peers finish constructing and would wait for this
      // rank in their first collective until the group's timeout, without
      // the cause. The abort reaches them within moments, with it.
      const std::string cause = CurrentExceptionCause();
      pg_->Abort(transport::FailedPreconditionError(
          "DistributedDataParallel on rank " + std::to_string(pg_->rank()) +
          ": construction failed on this rank after the ranks' models were compared (" + cause +
          "); the other ranks' wrappers would wait for it in their first collective. The process group "
          "was aborted."));
    }
    throw;
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  Impl& s = *impl_;
  // The iterations since the last line (a window log_stats_every did not
  // fill, or one filled by the last backward, which the next forward would
  // have logged) would otherwise never be seen.
  if (s.log_every > 0 && pg_->rank() == 0 && s.reducer != nullptr && s.reducer->iterations() > s.logged_at) {
    try {
      std::fprintf(stderr, "[ddp] iterations %" PRId64 "-%" PRId64 " (end of run): %s\n", s.logged_at,
                   s.reducer->iterations() - 1, StatsSince(s, *pg_, s.log_since).ToString().c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[ddp] rank %d: the last statistics window could not be logged: %s\n", pg_->rank(),
                   e.what());
    }
  }
  impl_->reducer.reset();
  if (impl_->trace != nullptr) {
    bool written = false;
    try {
      if (impl_->trace->streams_document()) {
        impl_->trace->EndDocument();
      } else {
        WriteTrace();
      }
      written = true;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[ddp] rank %d: writing the trace failed: %s\n", pg_->rank(), e.what());
    }
    pg_->StopTrace(impl_->trace.get());
    // The streamed file is kept when the complete one could not be written.
    if (!written) impl_->trace->Flush();
    impl_->trace->EndStream(/*remove=*/written);
  }
}

nn::Tensor DistributedDataParallel::Forward(const nn::Tensor& input) {
  return Forward(std::vector<nn::Tensor>{input}).at(0);
}

std::vector<nn::Tensor> DistributedDataParallel::Forward(const std::vector<nn::Tensor>& inputs) {
  Impl& s = *impl_;
  if (s.trace != nullptr) s.trace->Flush();  // the last iteration's events
  if (s.log_every > 0 && pg_->rank() == 0 && s.reducer != nullptr &&
      s.reducer->iterations() >= s.logged_at + s.log_every) {
    // The logger's own window: the user's (Stats) is left as it is. Logged
    // before this forward is timed: logged after it, the window took the
    // next iteration's forward, and the next window lacked it.
    std::fprintf(stderr, "[ddp] iterations %" PRId64 "-%" PRId64 ": %s\n", s.logged_at,
                 s.reducer->iterations() - 1, StatsSince(s, *pg_, s.log_since).ToString().c_str());
    s.logged_at = s.reducer->iterations();
    s.log_since = TakeStatsSnapshot(s, *pg_);
  }
  const Clock::time_point start = Clock::now();
  const internal::Reducer::GapForward gap =
      s.reducer != nullptr ? s.reducer->ForwardStarted(start) : internal::Reducer::GapForward{};
  const int size = pg_->size();
  // The mode is the wrapped module's, as PyTorch reads self.module.training:
  // users keep the inner handle and call model->Eval() / model->Train() on
  // it, which does not reach this wrapper (modes propagate down only). The
  // wrapped module's own flag decides even where its submodules differ (a
  // BatchNorm kept in eval mode inside a training model); this wrapper's
  // flag follows it, so that is_training() reads the same.
  const bool training = module_->is_training();
  SetOwnTrainingFlag(training);
  // Gradients are synchronized whenever grad is enabled outside NoSync, in
  // eval mode too, as PyTorch does (training with the model in eval mode
  // must not let the replicas drift apart); an eval-mode forward need not
  // be followed by a backward. Under Join the joined ranks shadow training
  // iterations only, so there an eval-mode forward does not synchronize
  // and a backward through it is refused.
  // A forward while every synchronized parameter is frozen (a GAN's
  // discriminator during the generator's step, frozen with requires_grad
  // as PyTorch scripts do) records no path to them: its backward fires no
  // gradient hook and reduces nothing, so it does not synchronize, as under
  // NoSync. Prepared, it was an iteration whose backward never came, and
  // the model's next forward threw and aborted the group; PyTorch lets it
  // pass.
  // One rank without a hook has no reducer, and counts such a forward out
  // of iterations() likewise.
  bool all_frozen = false;
  if (nn::GradMode::IsEnabled() && s.require_sync) {
    all_frozen = s.reducer != nullptr
                     ? !s.reducer->AnyParameterRequiresGrad()
                     : !s.single_trainable.empty() &&
                           std::none_of(s.single_trainable.begin(), s.single_trainable.end(),
                                        [](const auto& entry) { return entry.second.requires_grad(); });
  }
  const bool grad_sync = s.reducer != nullptr && nn::GradMode::IsEnabled() && s.require_sync && !all_frozen;
  const bool sync = grad_sync && (training || !s.join_enabled);
  // Under Join, a forward that does not synchronize between a training
  // forward and its backward (an evaluation) sends neither Join's flags nor
  // the buffers: the ranks that ran out of inputs shadow that backward from
  // the training forward's flags on, and its bucket all-reduces would pair
  // with these. Nothing in it needs shadowing (its buffers stay local until
  // the next training forward broadcasts them).
  const bool before_backward =
      s.join_enabled && !sync && s.reducer != nullptr && s.reducer->awaiting_backward();
  const bool sync_buffers =
      training && options_.broadcast_buffers && size > 1 && !s.buffers.empty() && !before_backward;
  const bool join_flags = s.join_enabled && size > 1 && !before_backward;
  // An eval-mode forward with grad enabled there is refused as it is outside
  // Join, where it synchronizes and so is a second synchronizing forward
  // before the first one's backward: the group is aborted and this forward
  // throws. Run, it would leave the training forward's backward unable to
  // synchronize, which then throws on this rank alone while the peers (in
  // that backward, or shadowing it in Join::Wait) wait for its buckets
  // until the group's timeout.
  const bool eval_before_backward = before_backward && grad_sync;
  // Whether a forward refused for the model's state must abort the group:
  // with peers and anything synchronized (a reducer: even a forward under
  // NoSync, whose own backward reduces nothing, is followed by a
  // synchronizing one the peers would wait in for this rank until the
  // group's timeout), or buffers broadcast, or Join's flags sent. Only
  // where nothing of the model is ever synchronized (every parameter
  // frozen at wrapping, no buffers broadcast) does the forward throw here
  // alone and leave the group usable.
  const bool involves_peers = size > 1 && (s.reducer != nullptr || sync_buffers || join_flags);
  auto refuse = [&](const std::string& error) {
    if (involves_peers) {
      const std::string message = error + " The process group was aborted.";
      pg_->Abort(transport::FailedPreconditionError(message));
      throw std::invalid_argument(message);
    }
    throw std::invalid_argument(error + " This forward runs no collective, so the process group was not "
                                        "aborted and stays usable.");
  };
  if (size > 1 && nn::GradMode::IsEnabled() && s.require_sync) {
    // Unfrozen after wrapping: its gradient would stay local on every rank
    // and the replicas would drift apart without a word. Refused as To()
    // is below: the group is aborted when this forward involves the peers
    // (whenever some parameter is synchronized, or buffers are broadcast),
    // not when nothing of the model is (every parameter was frozen).
    for (const auto& [name, p] : s.left_out) {
      if (!p.requires_grad()) continue;
      refuse("DistributedDataParallel on rank " + std::to_string(pg_->rank()) + ": parameter `" + name +
             "` did not require grad when the model was wrapped and requires it now; only the parameters that "
             "required grad then are synchronized (the buckets are fixed at construction), so its gradient "
             "would stay local and the replicas would drift apart. Wrap the model again after changing "
             "requires_grad.");
    }
  }
  // Added after wrapping (RegisterParameter, RegisterBuffer or
  // RegisterModule on the model or a child, ReplaceChild): rank 0's values
  // were broadcast at wrapping, not the new tensor's, so its values may
  // differ across ranks; and no bucket has a new parameter, nor does the
  // buffer broadcast have a new buffer. Refused at the next forward that
  // records gradients (under NoSync too) or broadcasts buffers, naming it. No
  // collective: whether the version moved is this process's own view
  // (another model's registrations move it too), so a rank that changed
  // its model refuses alone and the abort stops the others. One integer
  // comparison per forward; the model is walked only after some module of
  // the process changed (another model's registrations then pass).
  // - A parameter that requires grad: with find_unused_parameters the
  //   graph walk refuses it where a forward reaches it (Reducer::
  //   RefuseAddedParameters; a NoSync forward's outputs are walked for
  //   it too), and one no forward reaches is simply unused
  //   (kept in `added_trainable`, and refused as a frozen one below once
  //   it stops requiring grad); but under static_graph that walk runs in
  //   the first iteration only.
  // - A frozen one: no graph walk meets it, yet its values reach the
  //   outputs. PyTorch broadcasts frozen parameters at wrapping too. Proving
  //   it equal across ranks would take a collective on a path that only
  //   some ranks may take, so it is refused like a trainable one.
  // - A buffer, while broadcast_buffers is set; without it every buffer is
  //   each rank's own after wrapping (running statistics of the local
  //   batches), so a new one is too.
  // Under NoSync too: its gradients accumulate in .grad, which the next
  // synchronizing backward averages (those of a parameter no bucket has
  // would stay local), and with find_unused_parameters a parameter reached
  // only by NoSync forwards was refused by no graph walk.
  const bool records_gradients = nn::GradMode::IsEnabled();
  const bool syncs_buffers = training && options_.broadcast_buffers && !before_backward;
  const uint64_t version = nn::modules::Module::StructureVersion();
  const bool checks_structure = size > 1 && (records_gradients || syncs_buffers);
  // A parameter left to the graph walk (added, trainable) and frozen since:
  // no walk meets it now, yet its values (never broadcast) reach the
  // outputs. Empty unless one was added: no cost otherwise.
  const bool added_frozen_since =
      checks_structure && std::any_of(s.added_trainable.begin(), s.added_trainable.end(),
                                      [](const nn::Tensor& p) { return !p.requires_grad(); });
  if (checks_structure && (version != s.structure_seen || added_frozen_since)) {
    const std::string on_rank = "DistributedDataParallel on rank " + std::to_string(pg_->rank()) + ": ";
    const std::string how = " was added to the model after it was wrapped (with Module::RegisterParameter, "
                            "RegisterBuffer, RegisterModule or ReplaceChild)";
    const bool graph_walked = options_.find_unused_parameters && !options_.static_graph;
    // Taken again from the model: one no longer in it is dropped.
    s.added_trainable.clear();
    for (const auto& [name, p] : module_->NamedParameters()) {
      if (s.wrapped_impls.count(p.impl()) != 0) continue;
      if (graph_walked && p.requires_grad()) {
        s.added_trainable.push_back(p);
        continue;
      }
      if (p.requires_grad()) {
        refuse(on_rank + "parameter `" + name + "`" + how + " and requires grad, but is not one the wrapper "
               "synchronizes: its gradient would stay local on each rank, and its values differ across ranks "
               "(no broadcast from rank 0 made them equal), so the replicas would drift apart without a word. "
               "The wrapper synchronizes the parameters the model had when it was wrapped: wrap the model "
               "again after changing it.");
      }
      refuse(on_rank + "parameter `" + name + "`" + how + " and does not require grad (frozen), but the "
             "wrapper broadcast rank 0's values of the parameters the model had when it was wrapped, not of "
             "this one: its values may differ across ranks, and so would the outputs, without a word. Wrap the "
             "model again after changing it (frozen parameters are broadcast at wrapping too).");
    }
    if (options_.broadcast_buffers) {
      for (const auto& [name, b] : module_->NamedBuffers()) {
        if (s.buffer_impls.count(b.impl()) != 0) continue;
        refuse(on_rank + "buffer `" + name + "`" + how + ", but DdpOptions::broadcast_buffers broadcasts "
               "the buffers the model had when it was wrapped at every training forward, not this one: its "
               "values would differ across ranks without a word. Wrap the model again after changing it, or set "
               "broadcast_buffers = false to keep every buffer each rank's own.");
      }
    }
    s.structure_seen = version;
  }
  if (s.reducer != nullptr && nn::GradMode::IsEnabled()) {
    // Module::To() after wrapping, or a parameter's data replaced with
    // another shape: the buckets keep the dtype, device and sizes they
    // were built with. Checked before any collective of this forward,
    // so every rank that called To() throws this here (and, when the
    // forward involves the peers, the abort stops a rank that did not,
    // instead of leaving it waiting).
    const std::string error = s.reducer->ParameterChange();
    if (!error.empty()) refuse(error);
  }
  if (s.reducer != nullptr) {
    s.reducer->CheckPreviousIteration(sync || eval_before_backward,
                                      /*communicates=*/sync_buffers || join_flags,
                                      /*eval_forward_in_join=*/eval_before_backward);
  }
  bool rebuild = sync && training && s.reducer->rebuild_pending();

  double divisor = size;
  int buffer_root = 0;
  if (join_flags) {
    // flags[r]: rank r is active; then: this iteration synchronizes
    // gradients, rebuilds buckets, broadcasts buffers. Joined ranks read
    // them to shadow exactly what the active ranks do.
    nn::Tensor flags = JoinFlags(size, pg_->rank(), s.join_options);
    int32_t* f = flags.data<int32_t>();
    f[pg_->rank()] = 1;
    f[size] = sync;
    f[size + 1] = rebuild;
    f[size + 2] = sync_buffers;
    pg_->AllReduce(flags, transport::ReduceOp::kSum, "join flags").Wait();
    CheckJoinOptions(*pg_, f, size);
    int active = 0;
    for (int r = 0; r < size; ++r) {
      if (f[r] > 0) {
        ++active;
        buffer_root = r;  // the highest active rank, as PyTorch picks it
      }
    }
    if (active < size && s.join_options.throw_on_early_termination) {
      std::string joined;
      for (int r = 0; r < size; ++r) {
        if (f[r] == 0) joined += (joined.empty() ? "" : ", ") + std::to_string(r);
      }
      throw DistributedError(transport::AbortedError(
          "rank(s) " + joined + " ran out of inputs (Join with throw_on_early_termination)"));
    }
    if (active < size) {
      // (Whatever the wrapper's mode: a SyncBatchNorm put back in training
      // mode under an eval-mode wrapper gathers too.)
      // SyncBatchNorm gathers statistics inside forward, a collective the
      // joined ranks cannot shadow (PyTorch's Join does not support it
      // either): stop every rank with that, rather than let the gather pair
      // with a joined rank's shadowed bucket reduction.
      for (const auto& [name, m] : module_->NamedModules()) {
        if (m->TypeName() != "SyncBatchNorm" || !m->is_training()) continue;
        // Over a group of one rank it gathers nothing: plain BatchNorm. The
        // group is the one its forward will use: its own, else the default
        // one (none set: its forward throws, so Join stops here as well).
        if (const auto* sync = dynamic_cast<const SyncBatchNorm*>(m); sync != nullptr) {
          std::shared_ptr<ProcessGroup> group = sync->group();
          if (group == nullptr) {
            try {
              group = DefaultProcessGroup();
            } catch (const std::logic_error&) {
              // None set: group stays null.
            }
          }
          if (group != nullptr && group->size() == 1) continue;
        }
        std::string joined;
        for (int r = 0; r < size; ++r) {
          if (f[r] == 0) joined += (joined.empty() ? "" : ", ") + std::to_string(r);
        }
        const transport::Status error = transport::FailedPreconditionError(
            "Join: rank(s) " + joined + " ran out of inputs, and module `" + name +
            "` (SyncBatchNorm, in training mode) runs a collective inside forward, which the ranks "
            "that ran out cannot shadow. Give every rank the same number of batches (a "
            "DistributedSampler with drop_last), or put the SyncBatchNorm modules in eval mode. The "
            "process group was aborted.");
        pg_->Abort(error);
        throw DistributedError(error);
      }
    }
    if (!s.join_options.divide_by_initial_world_size) divisor = active;
    // What the joined ranks follow, the active ones follow too.
    if (sync) rebuild = f[size + 1] > 0;
  }
  if (rebuild) s.reducer->RebuildBuckets();
  // The buffers of wrapping, also those of a module replaced since: dropped
  // on the ranks that replaced it, the lists would differ across ranks.
  if (sync_buffers) internal::BroadcastCoalesced(*pg_, s.buffers, buffer_root, "buffers");

  std::vector<nn::Tensor> outputs;
  try {
    outputs = module_->Forward(inputs);
  } catch (const std::exception& e) {
    if (sync) {
      // The peers go on to this iteration's backward and wait for this
      // rank's buckets, and this rank's next collectives would pair with
      // theirs: stop the group with the reason instead. The caller gets
      // the module's own exception.
      pg_->Abort(transport::FailedPreconditionError(
          "DistributedDataParallel on rank " + std::to_string(pg_->rank()) + ": the module's forward threw (" +
          e.what() + "); the other ranks would wait for this rank's gradients. The process group was aborted."));
    }
    throw;
  }

  if (sync) {
    s.reducer->PrepareForBackward(outputs, divisor, /*backward_optional=*/!training);
  } else if (s.reducer != nullptr && nn::GradMode::IsEnabled()) {
    // No PrepareForBackward, so no graph walk: one for the added parameters
    // left to it (none is the usual case, and costs nothing).
    if (!s.added_trainable.empty()) s.reducer->RefuseAddedParametersReachedFrom(outputs);
    // A forward under no-grad records no graph, so it leaves a prepared
    // iteration armed: an evaluation between a training forward and its
    // backward does not keep that backward from synchronizing. Nor does a
    // forward under NoSync there: the backward the training forward (or,
    // outside Join, an eval-mode one with grad enabled) prepared
    // synchronizes, through this forward's outputs too (Disarm).
    s.reducer->Disarm(outputs, /*reject_gradients=*/grad_sync, /*in_join=*/s.join_enabled);
  }
  if (training && nn::GradMode::IsEnabled() && s.require_sync) ++s.forwards;
  if (nn::GradMode::IsEnabled() && s.require_sync && !all_frozen && (training || !s.join_enabled)) {
    ++s.sync_forwards;
  }
  const Clock::time_point end = Clock::now();
  // Forward's time ends here, and backward's compute starts: the graph walk
  // in PrepareForBackward is counted once, as forward.
  if (sync) s.reducer->StartBackwardClock(end);
  // A forward between a synchronizing training forward and its backward
  // (an evaluation there under NoGradGuard; one under NoSync, which joins
  // that backward), in either mode, is forward time: counted here, and
  // left out of that backward's compute. Not after an eval-mode forward,
  // whose backward may never come.
  const bool before_prepared_backward = s.reducer != nullptr && s.reducer->ForwardEnded(gap, end);
  if (training || before_prepared_backward) {
    ++s.forward_count;
    s.forward_seconds += std::chrono::duration<double>(end - start).count();
  }
  if (s.trace != nullptr) s.trace->Complete("forward", "compute", start, end);
  return outputs;
}

void DistributedDataParallel::RegisterCommHook(CommHook hook) {
  if (!hook) throw std::invalid_argument("DistributedDataParallel::RegisterCommHook: empty hook");
  Impl& s = *impl_;
  if (s.reducer == nullptr && !s.single_trainable.empty()) {
    // One rank: the hook runs as on N ranks (Fp16CompressHook still rounds
    // through f16, a user's hook is called per bucket), from a reducer built
    // now. No backward is observed before it exists, so registration is
    // refused from the first forward that would synchronize on N ranks on,
    // never later than N ranks refuse it (at their first backward).
    if (s.sync_forwards > 0) {
      throw std::logic_error(
          "DistributedDataParallel::RegisterCommHook: call it before the first backward (on one process, "
          "before the first forward with grad enabled outside NoSync)");
    }
    s.reducer = std::make_unique<internal::Reducer>(std::move(s.single_trainable), pg_, s.single_options, s.trace);
    s.reducer->SetModelParameterNames(ModelNames(module_.get(), impl_.get()));
    s.single_trainable.clear();
  }
  if (s.reducer != nullptr) {
    s.reducer->SetCommHook(std::move(hook));
    return;
  }
  if (s.hook_registered) {
    throw std::logic_error(
        "DistributedDataParallel::RegisterCommHook: a communication hook is already registered; a wrapper "
        "takes one (combine them in one hook)");
  }
  s.hook_registered = true;  // never run: no parameter gets a gradient to reduce
}

DdpStats DistributedDataParallel::Stats() const { return StatsSince(*impl_, *pg_, impl_->user_since); }

void DistributedDataParallel::ResetStats() { impl_->user_since = TakeStatsSnapshot(*impl_, *pg_); }

std::string DistributedDataParallel::PartialTracePath() const {
  return options_.trace_prefix + "rank" + std::to_string(pg_->root_rank()) + ".partial.json";
}

void DistributedDataParallel::WriteTrace() const {
  if (impl_->trace == nullptr) {
    throw std::logic_error("DistributedDataParallel::WriteTrace: DdpOptions::trace_prefix is empty");
  }
  if (impl_->trace->streams_document()) {
    impl_->trace->Flush();  // the document ends with the wrapper
    return;
  }
  impl_->trace->Write(TracePath(), pg_->root_rank());
}

// Named by the rank in the job: two subgroups' DDPs share group ranks.
std::string DistributedDataParallel::TracePath() const {
  return options_.trace_prefix + "rank" + std::to_string(pg_->root_rank()) + ".json";
}

std::vector<std::vector<std::string>> DistributedDataParallel::BucketParameterNames() const {
  if (impl_->reducer == nullptr) return {};
  return impl_->reducer->BucketNames();
}

std::vector<int64_t> DistributedDataParallel::BucketOrder() const {
  if (impl_->reducer == nullptr) return {};
  const std::vector<size_t>& order = impl_->reducer->agreed_order();
  return std::vector<int64_t>(order.begin(), order.end());
}

int64_t DistributedDataParallel::iterations() const {
  return impl_->reducer != nullptr ? impl_->reducer->iterations() : impl_->sync_forwards;
}

int64_t DistributedDataParallel::group_iterations() const {
  return impl_->reducer != nullptr ? impl_->reducer->group_iterations() : impl_->sync_forwards;
}

// ------------------------------------------------------------- NoSync ----

NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp), previous_(ddp.impl_->require_sync) {
  ddp_.impl_->require_sync = false;
  if (ddp_.impl_->reducer != nullptr) ddp_.impl_->reducer->SetNoSync(true);
}

NoSyncGuard::~NoSyncGuard() {
  ddp_.impl_->require_sync = previous_;
  if (ddp_.impl_->reducer != nullptr) ddp_.impl_->reducer->SetNoSync(!previous_);
}

// --------------------------------------------------------------- Join ----

Join::Join(DistributedDataParallel& ddp, JoinOptions options) : ddp_(ddp), options_(options) {
  // Disabled: nothing is set up, so the forwards run as outside Join.
  if (!options_.enable) return;
  if (ddp_.impl_->join_enabled) throw std::logic_error("Join: this model is already in a Join");
  {
    // A rank in one model's Wait shadows that model's collectives only:
    // the other model's (its Join's flags, its buckets) would pair with
    // them, and the ranks fail later on arguments that differ, or not at
    // all where the sizes happen to match. Every rank refuses it here.
    std::lock_guard lock(join_groups_mutex);
    if (!JoinGroups().insert(ddp_.pg_.get()).second) {
      throw std::logic_error(
          "Join on rank " + std::to_string(ddp_.pg_->rank()) + ": another DistributedDataParallel model on this "
          "process group is in a Join that has not finished (its Wait has not returned). A Join shadows the "
          "collectives of its own model only: a rank waiting in one model's Join::Wait would pair them with the "
          "other model's, so two models trained together (a GAN's generator and discriminator) cannot both be "
          "in a Join. Give every rank the same number of batches (a DistributedSampler with drop_last), or "
          "finish one model's Join before starting the next.");
    }
  }
  holds_group_ = true;
  ddp_.impl_->join_enabled = true;
  ddp_.impl_->join_options = options_;
  ddp_.impl_->forwards_at_join = ddp_.impl_->forwards;
}

namespace {

void ReleaseJoinGroup(const ProcessGroup* pg, bool& holds) {
  if (!holds) return;
  std::lock_guard lock(join_groups_mutex);
  JoinGroups().erase(pg);
  holds = false;
}

}  // namespace

Join::~Join() {
  // A disabled Join set nothing up, and must not end another one's.
  if (options_.enable) ddp_.impl_->join_enabled = false;
  ReleaseJoinGroup(ddp_.pg_.get(), holds_group_);
}

void Join::Wait() {
  if (waited_) throw std::logic_error("Join::Wait called twice");
  waited_ = true;
  // Disabled: no shadowing and no final broadcast, as without Join.
  if (!options_.enable) return;
  DistributedDataParallel::Impl& s = *ddp_.impl_;
  ProcessGroup& pg = *ddp_.pg_;
  const int size = pg.size();
  // The active ranks may still wait for this rank's last gradients.
  if (s.reducer != nullptr) s.reducer->CheckPreviousIteration(true);
  if (size > 1) {
    // Shadow the active ranks' forwards (and backwards) until none is left.
    while (true) {
      nn::Tensor flags = JoinFlags(size, pg.rank(), options_);
      const int32_t* f = flags.data<int32_t>();
      pg.AllReduce(flags, transport::ReduceOp::kSum, "join flags").Wait();
      CheckJoinOptions(pg, f, size);
      int active = 0, buffer_root = 0;
      for (int r = 0; r < size; ++r) {
        if (f[r] > 0) {
          ++active;
          buffer_root = r;
        }
      }
      if (active == 0) break;
      if (options_.throw_on_early_termination) {
        std::string joined;
        for (int r = 0; r < size; ++r) {
          if (f[r] == 0) joined += (joined.empty() ? "" : ", ") + std::to_string(r);
        }
        throw DistributedError(transport::AbortedError(
            "rank(s) " + joined + " ran out of inputs (Join with throw_on_early_termination)"));
      }
      if (f[size + 1] > 0 && s.reducer != nullptr) s.reducer->RebuildBuckets();
      if (f[size + 2] > 0) internal::BroadcastCoalesced(pg, s.buffers, buffer_root, "buffers");
      if (f[size] > 0 && s.reducer != nullptr) {
        s.reducer->ShadowBackward(options_.divide_by_initial_world_size ? size : active,
                                  /*write_gradients=*/static_cast<bool>(options_.shadow_step));
        if (options_.shadow_step) {
          // The active ranks step too, and their step's collectives wait for
          // this rank's: a step that fails here alone stops them now, with
          // the cause, instead of at the group's timeout.
          try {
            options_.shadow_step();
          } catch (...) {
            const std::string cause = CurrentExceptionCause();
            pg.Abort(transport::FailedPreconditionError(
                "Join::Wait on rank " + std::to_string(pg.rank()) + ": the shadowed optimizer step "
                "(JoinOptions::shadow_step) threw (" + cause + "); the active ranks would wait for this "
                "rank in their step's collectives. The process group was aborted."));
            throw;
          }
        }
      }
    }
    // Every rank is done. The ranks that ran the most iterations in this Join
    // were active last and hold the final parameters (they are identical);
    // the highest of them is the source. (Counted from the Join's start: in
    // an earlier epoch another rank may have run more.)
    nn::Tensor source =
        nn::FromVectorOf<int64_t>({(s.forwards - s.forwards_at_join) * size + pg.rank()}, {1});
    pg.AllReduce(source, transport::ReduceOp::kMax, "join source").Wait();
    const int root = static_cast<int>(source.data<int64_t>()[0] % size);
    // The parameters and buffers the model had at wrapping, which every
    // rank agreed on (PyTorch takes the module's parameters now): a model
    // changed since on some ranks only (a parameter added there and left
    // unused under find_unused_parameters, or one removed) would make the
    // lists differ: the broadcast failed on every rank on counts that
    // differ, or, where the counts happened to match, wrote one rank's
    // tensors into another's.
    // The buffers only where the forwards broadcast them, as PyTorch's
    // final sync does: with broadcast_buffers off they are each rank's own
    // (running statistics of its batches), and the root's would overwrite
    // them.
    std::vector<nn::Tensor> state = s.wrapped;
    if (ddp_.options_.broadcast_buffers) {
      for (const nn::Tensor& b : s.buffers) state.push_back(b);
    }
    internal::BroadcastCoalesced(pg, state, root, "final parameters after join");
  }
  s.join_enabled = false;
  ReleaseJoinGroup(ddp_.pg_.get(), holds_group_);
}

}  // namespace ddp::dist
