#include "ddp/model_averaging.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace ddp::dist {

namespace {

// The mean over `group` of `t`, in place, as DDP with no hook averages a
// bucket (internal::AverageAsNoHook: f16 is divided first, since the
// ranks' sum may pass 65504 where no value does).
Work AverageInPlace(ProcessGroup& group, const nn::Tensor& t, const std::string& label) {
  return internal::AverageAsNoHook(group, t, static_cast<double>(group.size()), label);
}

void CheckPostLocalSgdOptions(const PostLocalSgdOptions& options) {
  if (options.start_iteration < 0) {
    throw std::invalid_argument("PostLocalSgdOptions::start_iteration must be at least 0, got " +
                                std::to_string(options.start_iteration));
  }
}

// Reads a checkpoint's i64 scalar counter `key` (the only key under
// `prefix`) for `who`'s LoadStateDict: the value it would load, or throws
// naming the key and what is wrong with it.
int64_t ReadCounter(const std::vector<std::pair<std::string, nn::Tensor>>& state, const std::string& who,
                    const std::string& prefix, const std::string& key) {
  const std::string where = who + ".LoadStateDict: ";
  const nn::Tensor* found = nullptr;
  for (const auto& [name, t] : state) {
    if (name == key) {
      if (found != nullptr) throw std::invalid_argument(where + "`" + name + "` appears twice");
      found = &t;
    } else if (name.rfind(prefix, 0) == 0) {
      throw std::invalid_argument(where + "unexpected `" + name + "` (the only key under `" + prefix + "` is `" +
                                  key + "`)");
    }
  }
  if (found == nullptr) throw std::invalid_argument(where + "missing i64 scalar `" + key + "`");
  // 0-d, as StateDict writes it and PyTorch keeps its counters: a [1] or
  // [1, 1] of i64 is not what was saved, and taking it would hide a state
  // built by hand wrong.
  if (!found->defined() || found->dtype() != nn::DType::kInt64 || found->shape() != nn::Shape{}) {
    throw std::invalid_argument(where + "`" + key + "` is " +
                                (found->defined() ? std::string(nn::DTypeName(found->dtype())) + " " +
                                                        nn::ShapeToString(found->shape())
                                                  : std::string("undefined")) +
                                ", expected an i64 scalar");
  }
  const int64_t value = found->To(nn::kCPU).data<int64_t>()[0];
  if (value < 0) throw std::invalid_argument(where + "`" + key + "` is " + std::to_string(value) + ", below 0");
  // Both counters go up by one per call after the load: the largest value
  // would overflow (undefined behaviour) at the next one.
  if (value == std::numeric_limits<int64_t>::max()) {
    throw std::invalid_argument(where + "`" + key + "` is the largest i64: the next count would overflow");
  }
  return value;
}

constexpr char kPostLocalSgdPrefix[] = "post_local_sgd.";
constexpr char kPostLocalSgdIterationKey[] = "post_local_sgd.iteration";

}  // namespace

PostLocalSgdState::PostLocalSgdState(PostLocalSgdOptions options) : options_(std::move(options)) {
  CheckPostLocalSgdOptions(options_);
}

PostLocalSgdState::NamedTensors PostLocalSgdState::StateDict() const {
  return {{kPostLocalSgdIterationKey, nn::FromVectorOf<int64_t>({iteration_}, {})}};
}

void PostLocalSgdState::CheckStateDict(const NamedTensors& state) const {
  ReadCounter(state, "PostLocalSgdState", kPostLocalSgdPrefix, kPostLocalSgdIterationKey);
}

void PostLocalSgdState::LoadStateDict(const NamedTensors& state) {
  iteration_ = ReadCounter(state, "PostLocalSgdState", kPostLocalSgdPrefix, kPostLocalSgdIterationKey);
}

namespace hooks {

CommHook PostLocalSgdHook(PostLocalSgdOptions options) {
  return PostLocalSgdHook(std::make_shared<PostLocalSgdState>(std::move(options)));
}

CommHook PostLocalSgdHook(std::shared_ptr<PostLocalSgdState> state) {
  if (state == nullptr) throw std::invalid_argument("hooks::PostLocalSgdHook: the state is null");
  const CommHook noop = NoopHook();
  // On local gradients: the global phase averages as DDP's default does
  // (bit for bit, unless Join's divisor differs from the group's size).
  // The closure keeps `state` alive; `options` and `iteration` are its
  // members, taken here where the friend declaration grants access.
  const PostLocalSgdOptions* options = &state->options_;
  int64_t* iteration = &state->iteration_;
  internal::StateAttachment* attachment = &state->attachment_;
  return CommHook::OnLocalGradients([state = std::move(state), options, iteration, attachment, noop,
                                     copy = internal::HookCopy()](ProcessGroup& group, GradBucket& bucket) -> Work {
    internal::RequireUndividedBucket(bucket, "PostLocalSgdHook", *attachment);
    attachment->Attach(group, copy, "PostLocalSgdHook", "PostLocalSgdState", bucket.index());
    const int64_t now = *iteration;
    if (bucket.is_last()) ++*iteration;
    const std::string label = "bucket " + std::to_string(bucket.index());
    if (now < options->start_iteration) {
      return internal::AverageAsNoHook(group, bucket.buffer(), bucket.divisor(), label);
    }
    if (!options->subgroup) return noop(group, bucket);
    return AverageInPlace(*options->subgroup, bucket.buffer(), "local " + label);
  });
}

}  // namespace hooks

PeriodicModelAverager::PeriodicModelAverager(ModelAveragerOptions options) : options_(std::move(options)) {
  if (options_.period < 1) {
    throw std::invalid_argument("ModelAveragerOptions::period must be at least 1, got " +
                                std::to_string(options_.period));
  }
  if (options_.warmup_steps < 0) {
    throw std::invalid_argument("ModelAveragerOptions::warmup_steps must be at least 0, got " +
                                std::to_string(options_.warmup_steps));
  }
  // Unset and set-but-null differ: a rank outside a subgroup gets null from
  // NewGroup and must stay out of the average, where the default group
  // would have it all-reduce with ranks that are averaging over the
  // subgroup (a desync, then a timeout).
  if (!options_.process_group.has_value()) {
    options_.process_group = DefaultProcessGroup();
    if (*options_.process_group == nullptr) {
      throw std::logic_error(
          "PeriodicModelAverager: no process group given and no default one (InitProcessGroup)");
    }
  }
}

bool PeriodicModelAverager::AverageParameters(const std::vector<nn::Tensor>& params) {
  // Counted once this call has done its part: an average that throws (a
  // failed all-reduce, tensors refused) leaves the step uncounted, as
  // PyTorch's counts after its average, so a retry of the step averages.
  const int64_t step = step_;
  if (step < options_.warmup_steps || (step - options_.warmup_steps) % options_.period != 0) {
    ++step_;
    return false;
  }
  if (*options_.process_group == nullptr) {  // not a member of the group
    ++step_;
    return false;
  }
  // The ranks' lists must be as long as each other before the flags below
  // (one per tensor) are all-reduced: of different lengths, that all-reduce
  // did not pair and the transport aborted the group naming neither list,
  // and a rank with an empty list returned at once while the others waited
  // in it until the group's timeout. One all-reduce of a fixed size carries
  // each rank's count and whether it has a tensor without a gradient (or
  // undefined): when no rank has one, which is the usual case, the flags'
  // all-reduce is not needed, so a due step costs no more rounds than
  // before the count was checked.
  ProcessGroup& group = **options_.process_group;
  const int size = group.size();
  const int64_t count = static_cast<int64_t>(params.size());
  bool all_trained = true;
  for (const nn::Tensor& p : params) all_trained = all_trained && p.defined() && p.grad().defined();
  nn::Tensor counts = nn::Zeros({size + 1}, {.dtype = nn::DType::kInt64});
  counts.data<int64_t>()[group.rank()] = count;
  counts.data<int64_t>()[size] = all_trained ? 0 : 1;
  group.AllReduce(counts, transport::ReduceOp::kSum, "count of tensors to average").Wait();
  for (int r = 1; r < size; ++r) {
    const int64_t first = counts.data<int64_t>()[0], other = counts.data<int64_t>()[r];
    if (other == first) continue;
    throw std::invalid_argument("PeriodicModelAverager: rank 0 passes " + std::to_string(first) +
                                " tensors and rank " + std::to_string(r) + " passes " + std::to_string(other) +
                                "; every rank must pass the same tensors");
  }
  if (params.empty()) {
    ++step_;
    return true;
  }
  if (counts.data<int64_t>()[size] == 0) {
    dist::AverageParameters(params, group);
    ++step_;
    return true;
  }
  // Which tensors have a gradient may differ between ranks (a branch one
  // rank took alone, with ZeroGrad setting gradients to none); decided on
  // each rank by itself, the ranks then averaged different sets and their
  // all-reduces did not pair (a timeout, or values of different tensors
  // averaged together). One all-reduce of a flag per tensor, the largest
  // over the ranks, makes the set the same everywhere: the tensors with a
  // gradient on any rank.
  // The same all-reduce carries which tensors are undefined on each rank:
  // one with a gradient elsewhere cannot be averaged here, and every rank
  // must learn that together rather than this one alone failing while the
  // others wait in their averages.
  nn::Tensor marks = nn::Zeros({2 * count}, {.dtype = nn::DType::kUInt8});
  uint8_t* flags = marks.data<uint8_t>();
  uint8_t* undefined = flags + count;
  for (int64_t i = 0; i < count; ++i) {
    flags[i] = params[i].defined() && params[i].grad().defined();
    undefined[i] = !params[i].defined();
  }
  group.AllReduce(marks, transport::ReduceOp::kMax, "parameters with a gradient").Wait();
  std::vector<nn::Tensor> trained;
  for (int64_t i = 0; i < count; ++i) {
    if (flags[i] == 0) continue;
    if (undefined[i] != 0) {
      throw std::invalid_argument("PeriodicModelAverager: tensor " + std::to_string(i) +
                                  " has a gradient on some rank but is undefined on " +
                                  (params[i].defined() ? std::string("another rank")
                                                       : "rank " + std::to_string(group.rank())) +
                                  "; every rank must pass the same tensors");
    }
    trained.push_back(params[i]);
  }
  dist::AverageParameters(trained, group);
  ++step_;
  return true;
}

namespace {

constexpr char kAveragerStepKey[] = "averager.step";

// LoadStateDict's checks: the step it would load, or throws.
int64_t ReadAveragerStep(const PeriodicModelAverager::NamedTensors& state) {
  return ReadCounter(state, "PeriodicModelAverager", "averager.", kAveragerStepKey);
}

}  // namespace

PeriodicModelAverager::NamedTensors PeriodicModelAverager::StateDict() const {
  return {{kAveragerStepKey, nn::FromVectorOf<int64_t>({step_}, {})}};
}

void PeriodicModelAverager::CheckStateDict(const NamedTensors& state) const { ReadAveragerStep(state); }

void PeriodicModelAverager::LoadStateDict(const NamedTensors& state) { step_ = ReadAveragerStep(state); }

namespace {

// The memory of `params` (all defined), as the CheckParameters of
// nn/optim does it, extended to strided views: each tensor spans the bytes
// from its first element to its last. Sorted by storage and first byte, a
// tensor shares memory with an earlier one iff it starts before the
// furthest end seen so far in its storage. Marks in `repeated` each tensor
// that is the same view as an earlier one (the same storage, offset, shape
// and strides) and returns {0, 0}; for any other sharing, returns {earlier,
// later} by index, the pair found first. Two strided views that interleave
// without sharing an element (every other column, say) count as
// overlapping here.
std::pair<size_t, size_t> SharedMemory(const std::vector<nn::Tensor>& params, std::vector<bool>& repeated) {
  struct Range {
    const void* storage;
    size_t begin, end;
    size_t index;
  };
  std::vector<Range> ranges;
  for (size_t i = 0; i < params.size(); ++i) {
    const nn::Tensor& p = params[i];
    if (p.numel() == 0) continue;
    int64_t last = 0;
    for (size_t d = 0; d < p.shape().size(); ++d) last += (p.shape()[d] - 1) * p.strides()[d];
    const size_t elem = p.element_size();
    const size_t begin = static_cast<size_t>(p.storage_offset()) * elem;
    ranges.push_back({p.storage().get(), begin, begin + (static_cast<size_t>(last) + 1) * elem, i});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return std::tie(a.storage, a.begin, a.end, a.index) < std::tie(b.storage, b.begin, b.end, b.index);
  });
  const auto same_view = [&](size_t a, size_t b) {
    const nn::Tensor &x = params[a], &y = params[b];
    return x.storage_offset() == y.storage_offset() && x.shape() == y.shape() && x.strides() == y.strides() &&
           x.dtype() == y.dtype();
  };
  size_t furthest = 0, furthest_index = 0;
  const void* storage = nullptr;
  std::pair<size_t, size_t> found{0, 0};
  for (size_t k = 0; k < ranges.size(); ++k) {
    const Range& r = ranges[k];
    if (k == 0 || r.storage != storage) {
      storage = r.storage;
      furthest = r.end;
      furthest_index = r.index;
      continue;
    }
    if (r.begin < furthest) {
      // The same view as the one it follows in this order (equal begin and
      // end sort together, the first index first) is a repeat.
      const Range& prev = ranges[k - 1];
      if (prev.begin == r.begin && prev.end == r.end && same_view(prev.index, r.index)) {
        repeated[r.index] = true;
        continue;
      }
      const size_t a = std::min(furthest_index, r.index), b = std::max(furthest_index, r.index);
      if (found.first == found.second || b < found.second) found = {a, b};
    }
    if (r.end > furthest) {
      furthest = r.end;
      furthest_index = r.index;
    }
  }
  return found;
}

std::mutex average_fault_mu;
std::function<void()>& AverageFault() {
  static std::function<void()> fault;
  return fault;
}

// One line of the per-rank list AverageParameters compares: dtype, shape
// and, off the CPU, the kind of device (not its index, which differs
// between ranks by design).
std::string DescribeForAverage(const nn::Tensor& p) {
  if (!p.defined()) return "undefined";
  std::string out = std::string(nn::DTypeName(p.dtype())) + " " + nn::ShapeToString(p.shape());
  if (!p.device().is_cpu()) {
    const std::string device = p.device().ToString();
    out += " on " + device.substr(0, device.find(':'));
  }
  return out;
}

// Collective: every rank's list of descriptions (`described`, one line per
// tensor) compared with rank 0's; throws std::invalid_argument naming the
// first tensor that differs, on every rank alike.
[[noreturn]] void ThrowNamingTheFirstDifference(ProcessGroup& group, const std::string& described) {
  const std::vector<std::string> all = group.AllGatherObject(described);
  const auto lines = [](const std::string& text) {
    std::vector<std::string> out;
    size_t begin = 0;
    for (size_t end = text.find('\n'); end != std::string::npos; end = text.find('\n', begin)) {
      out.push_back(text.substr(begin, end - begin));
      begin = end + 1;
    }
    return out;
  };
  const std::vector<std::string> first = lines(all.at(0));
  for (size_t r = 1; r < all.size(); ++r) {
    const std::vector<std::string> other = lines(all[r]);
    for (size_t i = 0; i < std::max(first.size(), other.size()); ++i) {
      const std::string here = i < other.size() ? other[i] : "missing";
      const std::string there = i < first.size() ? first[i] : "missing";
      if (here == there) continue;
      throw std::invalid_argument("AverageParameters: tensor " + std::to_string(i) + " is " + here + " on rank " +
                                  std::to_string(r) + " and " + there +
                                  " on rank 0; every rank must pass the same tensors");
    }
  }
  throw std::invalid_argument("AverageParameters: the ranks' tensors differ in dtype or shape; every rank must "
                              "pass the same tensors");
}

}  // namespace

void AverageParameters(const std::vector<nn::Tensor>& params, ProcessGroup& group) {
  // Large contiguous tensors are averaged in place (no copy in and out);
  // the others through one flat buffer per dtype and device, in the order
  // of first appearance. Both ways bump the tensors' versions (the
  // all-reduce, or CopyFrom), so that an optimizer's f32 masters of 16-bit
  // parameters take the averages at its next step.
  constexpr size_t kInPlaceBytes = size_t{256} << 10;
  // A bad tensor on one rank is every rank's error, found before any
  // collective: one all-reduce of each rank's first bad tensor (index + 1,
  // 0 for none) and what is wrong with it (0: undefined, else its dtype +
  // 1), so that the peers do not wait in averages this rank will not run
  // until the group's timeout.
  const int size = group.size();
  // [first bad index + 1, what] per rank, then per rank a digest of which
  // tensors it found repeated (below), then per rank a digest of the
  // tensors' dtypes and shapes (below).
  nn::Tensor bad = nn::Zeros({4 * size}, {.dtype = nn::DType::kInt64});
  for (size_t i = 0; i < params.size(); ++i) {
    const nn::Tensor& p = params[i];
    if (p.defined() && nn::IsFloating(p.dtype())) continue;
    bad.data<int64_t>()[group.rank()] = static_cast<int64_t>(i) + 1;
    bad.data<int64_t>()[size + group.rank()] = p.defined() ? static_cast<int64_t>(p.dtype()) + 1 : 0;
    break;
  }
  // Tensors that share memory: the same one passed twice (or two views of
  // one storage with the same offset, shape and strides) is averaged once,
  // under its first index; views that overlap otherwise would be averaged
  // twice in part, and are refused (what: -(index of the other + 1)).
  std::vector<bool> repeated(params.size(), false);
  if (bad.data<int64_t>()[group.rank()] == 0) {
    const std::pair<size_t, size_t> overlap = SharedMemory(params, repeated);
    if (overlap.first != overlap.second) {
      bad.data<int64_t>()[group.rank()] = static_cast<int64_t>(overlap.second) + 1;
      bad.data<int64_t>()[size + group.rank()] = -static_cast<int64_t>(overlap.first) - 1;
    }
  }
  // Which tensors are skipped as repeats decides the collectives that
  // follow (the in-place ones, the flat buffers' sizes): a rank with a
  // tensor tied where another has two would pair them wrongly. Each rank's
  // set of repeats, as a digest, is compared.
  uint64_t digest = 1469598103934665603ull;
  for (size_t i = 0; i < repeated.size(); ++i) {
    if (!repeated[i]) continue;
    digest = (digest ^ static_cast<uint64_t>(i)) * 1099511628211ull;
  }
  bad.data<int64_t>()[2 * size + group.rank()] = static_cast<int64_t>(digest);
  // Tensors that differ in dtype, shape or kind of device between ranks
  // would make collectives that do not pair (the transport then aborts
  // the group, naming neither tensor): each rank's list, as a digest, is
  // compared, and on a difference the lists themselves.
  std::string described;
  for (const nn::Tensor& p : params) described += DescribeForAverage(p) + "\n";
  uint64_t shapes = 1469598103934665603ull;
  for (const char c : described) shapes = (shapes ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  bad.data<int64_t>()[3 * size + group.rank()] = static_cast<int64_t>(shapes);
  group.AllReduce(bad, transport::ReduceOp::kSum, "tensors to average").Wait();
  for (int r = 1; r < size; ++r) {
    if (bad.data<int64_t>()[2 * size + r] != bad.data<int64_t>()[2 * size]) {
      throw std::invalid_argument("AverageParameters: rank 0 and rank " + std::to_string(r) +
                                  " differ in which tensors are passed twice (the same tensor on one, separate "
                                  "ones on the other: weights tied on some ranks only?); every rank must pass "
                                  "the same tensors");
    }
  }
  for (int r = 0; r < size; ++r) {
    const int64_t index = bad.data<int64_t>()[r] - 1, what = bad.data<int64_t>()[size + r];
    if (index < 0) continue;
    const std::string where = "AverageParameters: tensor " + std::to_string(index) + " on rank " + std::to_string(r);
    if (what < 0) {
      throw std::invalid_argument(where + " overlaps tensor " + std::to_string(-what - 1) +
                                  " in memory without being the same view: the shared elements would be "
                                  "averaged twice; pass each piece of memory once");
    }
    if (what == 0) throw std::invalid_argument(where + " is undefined");
    throw std::invalid_argument(where + " has dtype " +
                                std::string(nn::DTypeName(static_cast<nn::DType>(what - 1))) +
                                "; only floating tensors can be averaged");
  }
  bool shapes_differ = false;
  for (int r = 1; r < size; ++r) shapes_differ |= bad.data<int64_t>()[3 * size + r] != bad.data<int64_t>()[3 * size];
  if (shapes_differ) ThrowNamingTheFirstDifference(group, described);
  std::vector<size_t> whole;
  std::map<std::tuple<int, int, int>, std::vector<size_t>> groups;
  std::vector<std::tuple<int, int, int>> order;
  for (size_t i = 0; i < params.size(); ++i) {
    if (repeated[i]) continue;
    const nn::Tensor& p = params[i];
    // Not f16, at any size: it is divided before the sum (AverageInPlace),
    // and divided in place it would stay divided by the group's size when
    // the all-reduce fails; the flat copy reaches the parameters only once
    // the average succeeded.
    // Contiguity does not take part in the choice: the same tensor may be a
    // view on one rank and contiguous on another, and the choice decides
    // the collectives, which must pair. A large view is averaged through a
    // contiguous copy of its own (below), with the same all-reduce.
    if (p.nbytes() >= kInPlaceBytes && p.dtype() != nn::DType::kFloat16) {
      whole.push_back(i);
      continue;
    }
    const std::tuple<int, int, int> key{static_cast<int>(p.dtype()), static_cast<int>(p.device().type),
                                        p.device().index};
    if (!groups.count(key)) order.push_back(key);
    groups[key].push_back(i);
  }
  // Everything checked: now the collectives, the same on every rank.
  {
    std::function<void()> fault;
    {
      std::lock_guard<std::mutex> lock(average_fault_mu);
      fault = AverageFault();
    }
    if (fault) fault();
  }
  std::vector<Work> in_place;
  // For each tensor of `whole` that is not contiguous: its index and the
  // contiguous copy averaged for it, copied back once every average is in.
  std::vector<std::pair<size_t, nn::Tensor>> copied;
  std::exception_ptr error;
  try {
    for (size_t i : whole) {
      nn::Tensor target = params[i].Detach();
      if (!target.is_contiguous()) {
        target = target.Contiguous();
        copied.emplace_back(i, target);
      }
      in_place.push_back(AverageInPlace(group, target.View({target.numel()}), "average parameters"));
    }
    nn::NoGradGuard no_grad;
    for (const auto& key : order) {
      const std::vector<size_t>& members = groups[key];
      const nn::Tensor& first = params[members[0]];
      int64_t total = 0;
      for (size_t i : members) total += params[i].numel();
      nn::Tensor flat = nn::Empty({total}, {.dtype = first.dtype(), .device = first.device()});
      std::vector<nn::Tensor> views;
      int64_t offset = 0;
      for (size_t i : members) {
        const nn::Tensor& p = params[i];
        views.push_back(flat.Narrow(0, offset, p.numel()).View(p.shape()));
        views.back().CopyFrom(p);
        offset += p.numel();
      }
      AverageInPlace(group, flat, "average parameters").Wait();
      for (size_t k = 0; k < members.size(); ++k) params[members[k]].CopyFrom(views[k]);
    }
  } catch (...) {
    error = std::current_exception();
  }
  // An in-place all-reduce writes into its parameter until it completes:
  // every one issued is waited for, even after an error, so that none
  // writes after this function has returned or thrown. The first error is
  // thrown.
  for (Work& work : in_place) {
    try {
      work.Wait();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  nn::NoGradGuard no_grad;
  for (const auto& [i, average] : copied) params[i].CopyFrom(average);
}

void SetAverageFaultForTesting(std::function<void()> fault) {
  std::lock_guard<std::mutex> lock(average_fault_mu);
  AverageFault() = std::move(fault);
}

std::shared_ptr<ProcessGroup> NewSubgroupsByHost(ProcessGroup& group) {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  const std::vector<std::string> hosts = group.AllGatherObject(name);
  // Hosts in the order of their lowest rank; every rank forms every group
  // in that order (NewGroup is collective over `group`).
  std::vector<std::string> distinct;
  std::map<std::string, std::vector<int>> ranks;
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    if (!ranks.count(hosts[r])) distinct.push_back(hosts[r]);
    ranks[hosts[r]].push_back(r);
  }
  std::shared_ptr<ProcessGroup> mine;
  for (const std::string& host : distinct) {
    std::shared_ptr<ProcessGroup> formed = group.NewGroup(ranks[host]);
    if (formed) mine = std::move(formed);
  }
  return mine;
}

}  // namespace ddp::dist
