#include "ddp/zero_redundancy_optimizer.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>

#include "ddp/debug_mode.h"
#include "ddp/replicas.h"
#include "ddp/zero_groups.h"

namespace ddp::dist {
namespace {

using internal::Utf8PrefixBytes;
using nn::Tensor;
using nn::optim::NamedTensors;

// A list of (name, dtype, shape) as text, one tensor per line, and back:
// what a rank sends before the tensors of its shard's state. A name may
// hold tabs (only newlines are refused in parameter names), so a line is
// split at its last tab: the dtype and shape after it never hold one.
std::string DescribeTensors(const NamedTensors& tensors) {
  std::ostringstream out;
  for (const auto& [name, t] : tensors) {
    out << name << '\t' << static_cast<int>(t.dtype());
    for (int64_t d : t.shape()) out << ' ' << d;
    out << '\n';
  }
  return out.str();
}

NamedTensors EmptyTensorsFromDescription(const std::string& text) {
  NamedTensors out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t tab = line.rfind('\t');
    std::istringstream fields(line.substr(tab + 1));
    int dtype = 0;
    fields >> dtype;
    nn::Shape shape;
    for (int64_t d; fields >> d;) shape.push_back(d);
    out.emplace_back(line.substr(0, tab), nn::Empty(shape, {.dtype = static_cast<nn::DType>(dtype)}));
  }
  return out;
}

// Inside a catch handler: what the exception being handled says. A throw
// of a type not derived from std::exception must still reach the peers
// (they would otherwise wait for this rank until the group's timeout), so
// every handler that tells them catches everything.
std::string HandledExceptionText() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// What the exception `e` says, valid while `e` lives; nothing is
// allocated.
const char* WhatOf(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return "an exception that is not a std::exception";
}

// LoadStateDict's record of a rank's check of its shard, the same size on
// every rank: its verdict (byte 0), whether its reason was cut (byte 1),
// a 64-bit digest of the whole reason (bytes 8-15: ranks with the same
// reason are listed together), then the reason's first bytes,
// NUL-terminated. The message on the ranks that accept the state thus
// holds at most kMostListed reasons of about 1 KB each, whatever the
// number of ranks and the length of their reasons (a refusal lists every
// entry it refuses, with its key).
constexpr int64_t kOutcomeHead = 16;
constexpr int64_t kReasonBytes = 1024;
constexpr int64_t kOutcomeBytes = kOutcomeHead + kReasonBytes;
constexpr size_t kMostListed = 8;
constexpr char kLoadable = 0, kRefused = 'R', kFailed = 'F';

// Writes `verdict` and `reason` into `record` in place: nothing is
// allocated, since memory may be what ran out. The reason is cut before a
// UTF-8 character that would not fit whole.
void WriteOutcome(Tensor& record, char verdict, const char* reason) noexcept {
  char* out = static_cast<char*>(record.data_ptr());
  uint64_t digest = 1469598103934665603ull;
  size_t length = 0;
  for (; reason[length] != '\0'; ++length) {
    digest ^= static_cast<unsigned char>(reason[length]);
    digest *= 1099511628211ull;
  }
  size_t kept = std::min(length, static_cast<size_t>(kReasonBytes - 1));
  for (int step = 0; step < 3 && kept < length && kept > 0 &&
                     (static_cast<unsigned char>(reason[kept]) & 0xc0) == 0x80;
       ++step) {
    --kept;
  }
  out[0] = verdict;
  out[1] = kept < length ? 1 : 0;
  std::memcpy(out + 8, &digest, sizeof(digest));
  std::memcpy(out + kOutcomeHead, reason, kept);
  out[kOutcomeHead + kept] = '\0';
}

// "rank 1: <reason>; ranks 2-7: <reason>" for the ranks whose record in
// `all` has `verdict`, those with the same reason together, in the order
// of their first rank; at most kMostListed reasons, then how many more
// and on which ranks. Empty when no rank has it.
std::string ListOutcomes(const Tensor& all, int size, char verdict) {
  struct Group {
    uint64_t digest;
    std::string reason;
    std::vector<int> ranks;
  };
  std::vector<Group> groups;
  std::vector<int> rest;  // the ranks of the groups not shown
  for (int r = 0; r < size; ++r) {
    const char* record = static_cast<const char*>(all.data_ptr()) + r * kOutcomeBytes;
    if (record[0] != verdict) continue;
    uint64_t digest;
    std::memcpy(&digest, record + 8, sizeof(digest));
    const auto same = std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return g.digest == digest; });
    if (same != groups.end()) {
      same->ranks.push_back(r);
    } else if (groups.size() < kMostListed) {
      const char* reason = record + kOutcomeHead;
      groups.push_back({digest, std::string(reason, strnlen(reason, kReasonBytes - 1)) + (record[1] ? "..." : ""),
                        {r}});
    } else {
      rest.push_back(r);
    }
  }
  std::string out;
  for (const Group& g : groups) out += (out.empty() ? "" : "; ") + RankSet(g.ranks) + ": " + g.reason;
  if (!rest.empty()) {
    // The distinct reasons among them, counted once each.
    std::vector<uint64_t> more;
    for (const int r : rest) {
      uint64_t digest;
      std::memcpy(&digest, static_cast<const char*>(all.data_ptr()) + r * kOutcomeBytes + 8, sizeof(digest));
      if (std::find(more.begin(), more.end(), digest) == more.end()) more.push_back(digest);
    }
    out += "; and " + std::to_string(more.size()) + (more.size() == 1 ? " other reason on " : " other reasons on ") +
           RankSet(rest);
  }
  return out;
}

// From the handler of what threw on this rank alone while the others are
// in, or on their way to, the call's next exchange: aborts the group, so
// that they fail at once instead of waiting for this rank until the
// group's timeout, with "<call> failed on rank N<doing>: <what threw>"
// (its first 512 bytes or less, cut on a UTF-8 character boundary). Built
// in a fixed buffer, since memory may be what ran out (a string built from
// what() could throw again, and this rank would leave without telling
// them); when even the reason's Status cannot be made, the call's name
// alone. Nothing is done where the group was
// aborted already (a failed collective aborts it with its own reason).
void AbortForThisRank(ProcessGroup& pg, const char* call, const char* doing = "") noexcept {
  try {
    if (!pg.aborted_reason().ok()) return;
  } catch (...) {
    // Not known: abort it (an aborted group keeps its first reason).
  }
  char reason[768];
  const char* what = WhatOf(std::current_exception());
  std::snprintf(reason, sizeof(reason), "%.*s failed on rank %d%.*s: %.*s", Utf8PrefixBytes(call, 96), call,
                pg.rank(), Utf8PrefixBytes(doing, 96), doing, Utf8PrefixBytes(what, 512), what);
  try {
    pg.Abort(transport::AbortedError(reason));
    return;
  } catch (...) {
  }
  try {
    pg.Abort(transport::AbortedError(call));
  } catch (...) {
    // Nothing more can be done: the others wait until the group's timeout.
  }
}

// The size reserved beforehand for the text of a failure this rank sends
// its peers (ReserveFailureText), so that a short form of it can still be
// written when memory runs short.
constexpr size_t kShortFailureBytes = 320;

void ReserveFailureText(std::string& text) noexcept {
  try {
    text.reserve(kShortFailureBytes);
  } catch (...) {
    // DescribeFailure falls back to a text that fits any string.
  }
}

// Inside a catch handler, where this rank describes its failure to the
// peers before an exchange they wait in: `describe()`'s text into `out`.
// When describing throws (memory short, and the text holds the whole
// what()), "<call> failed on rank N: <what, cut>" written within the
// capacity ReserveFailureText gave `out`, or "out of memory" (within any
// string's own capacity) when even that failed: a throw here would take
// this rank out of the exchange and leave the others waiting for it until
// the group's timeout.
template <typename Describe>
void DescribeFailure(std::string& out, const char* call, int rank, Describe describe) noexcept {
  const std::exception_ptr thrown = std::current_exception();
  try {
    out = describe();
    return;
  } catch (...) {
  }
  char text[kShortFailureBytes];
  const char* what = WhatOf(thrown);
  std::snprintf(text, sizeof(text), "%.*s failed on rank %d: %.*s (cut: memory ran short)",
                Utf8PrefixBytes(call, 64), call, rank, Utf8PrefixBytes(what, 200), what);
  try {
    out.assign(text);
  } catch (...) {
    out.assign("out of memory");
  }
}

std::atomic<bool> fail_next_add_param_group{false};

// FailNextAddParamGroupForTesting's failure, where AddParamGroup makes its
// new lists.
void ThrowIfAddParamGroupFailureInjected() {
  if (fail_next_add_param_group.exchange(false)) throw std::bad_alloc();
}

// Broadcasts a string from `root` (its length, then its bytes).
std::string BroadcastString(ProcessGroup& pg, const std::string& text, int root, const char* label) {
  Tensor length = nn::FromVectorOf<int64_t>({static_cast<int64_t>(text.size())}, {1});
  pg.Broadcast(length, root, label).Wait();
  const int64_t n = length.data<int64_t>()[0];
  if (n == 0) return "";
  Tensor bytes = nn::Empty({n}, {.dtype = nn::DType::kUInt8});
  if (pg.rank() == root) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  pg.Broadcast(bytes, root, label).Wait();
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n));
}

}  // namespace

std::vector<std::vector<ZeroRedundancyOptimizer::Slice>> ZeroRedundancyOptimizer::Partition(
    const nn::optim::NamedParameters& params, int world_size) {
  if (world_size < 1) throw std::invalid_argument("ZeroRedundancyOptimizer: world size must be positive");
  std::vector<int64_t> start(params.size() + 1, 0);  // of each parameter, end to end
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].second.defined()) {
      throw std::invalid_argument("ZeroRedundancyOptimizer::Partition: parameter `" + params[i].first +
                                  "` is undefined");
    }
    start[i + 1] = start[i] + params[i].second.numel();
  }
  const int64_t total = start.back();
  // cut[r]: where rank r's run begins; cut[world_size] = total.
  std::vector<int64_t> cut(static_cast<size_t>(world_size) + 1, total);
  cut[0] = 0;
  for (int r = 1; r < world_size; ++r) {
    const int64_t target = total * r / world_size;
    // The parameter the target falls in (the last one starting at or before it).
    const size_t i = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), target) - start.begin()) - 1;
    cut[static_cast<size_t>(r)] = i >= params.size() ? total : start[i] + (target - start[i]) / kAlignment * kAlignment;
  }
  std::vector<std::vector<Slice>> shards(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    const int64_t lo = cut[static_cast<size_t>(r)], hi = cut[static_cast<size_t>(r) + 1];
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t a = std::max(lo, start[i]), b = std::min(hi, start[i + 1]);
      if (a < b) shards[static_cast<size_t>(r)].push_back({.param = i, .offset = a - start[i], .length = b - a});
    }
  }
  return shards;
}

namespace {

// Elements [s.offset, s.offset + s.length) of `t` (row-major) as a 1-D
// tensor sharing t's storage; t is copied first if it is not contiguous.
Tensor PieceOf(const Tensor& t, const ZeroRedundancyOptimizer::Slice& s) {
  const Tensor flat = t.is_contiguous() ? t.View({t.numel()}) : t.Contiguous().View({t.numel()});
  return flat.Narrow(0, s.offset, s.length);
}

// A parameter's dtype and shape, as the ranks compare them.
std::string DescribeParameter(const Tensor& p) {
  return p.defined() ? std::string(nn::DTypeName(p.dtype())) + " " + nn::ShapeToString(p.shape()) : "undefined";
}

// "step" for "state.<name>.step": the part of a state key after its
// parameter's name.
std::string SlotOfKey(const std::string& key, const std::string& param_name) {
  return key.substr(std::string("state.").size() + param_name.size() + 1);
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(nn::optim::NamedParameters params,
                                                 std::shared_ptr<ProcessGroup> pg,
                                                 const Factory& make)
    : params_(std::move(params)), pg_(std::move(pg)) {
  if (pg_ == nullptr) throw std::invalid_argument("ZeroRedundancyOptimizer: the process group is null");
  if (!make) throw std::invalid_argument("ZeroRedundancyOptimizer: the optimizer factory is empty");
  Init(std::vector<size_t>(params_.size(), 0), {}, make);
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<nn::optim::ParamGroup> groups,
                                                 std::shared_ptr<ProcessGroup> pg, const GroupFactory& make)
    : pg_(std::move(pg)) {
  if (pg_ == nullptr) throw std::invalid_argument("ZeroRedundancyOptimizer: the process group is null");
  if (!make) throw std::invalid_argument("ZeroRedundancyOptimizer: the optimizer factory is empty");
  if (groups.empty()) throw std::invalid_argument("ZeroRedundancyOptimizer: no parameter group");
  std::vector<size_t> group_of;
  std::vector<std::string> options;
  for (size_t k = 0; k < groups.size(); ++k) {
    options.push_back(internal::GroupOptionsText(groups[k].options));
    for (auto& entry : groups[k].params) {
      params_.push_back(std::move(entry));
      group_of.push_back(k);
    }
  }
  // The shard's groups: each group's options, with the pieces of its
  // parameters in the order given.
  auto build = [&](nn::optim::NamedParameters shard) {
    std::vector<nn::optim::ParamGroup> shard_groups(groups.size());
    for (size_t k = 0; k < groups.size(); ++k) shard_groups[k].options = groups[k].options;
    const auto& mine = shards_[static_cast<size_t>(pg_->rank())];
    for (size_t j = 0; j < shard.size(); ++j) shard_groups[group_of_[mine[j].param]].params.push_back(std::move(shard[j]));
    return make(std::move(shard_groups));
  };
  Init(group_of, options, build);
}

void ZeroRedundancyOptimizer::Init(
    const std::vector<size_t>& group_of, const std::vector<std::string>& options,
    const std::function<std::unique_ptr<nn::optim::Optimizer>(nn::optim::NamedParameters)>& build) {
  group_of_ = group_of;
  num_groups_ = std::max<size_t>(options.size(), 1);
  // The partition, and so which rank steps and broadcasts which elements,
  // is computed from each rank's own list: lists that differ (two
  // same-shaped parameters swapped, say) would write one parameter's update
  // into another on the other ranks. Compared before the local checks, so
  // that a list only some ranks refuse fails every rank here alike. Groups
  // are compared too: a rank that stepped its pieces with another group's
  // rate or decay would broadcast them to every replica.
  std::vector<internal::ReplicaEntry> entries;
  for (size_t k = 0; k < options.size(); ++k) {
    entries.push_back({"option", "param group " + std::to_string(k), options[k]});
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    std::string value = DescribeParameter(p);
    if (!options.empty()) value += " in param group " + std::to_string(group_of_[i]);
    entries.push_back({"parameter", name, value});
  }
  internal::VerifyReplicas(*pg_, entries,
                           "ZeroRedundancyOptimizer: the ranks' parameter lists differ (every rank must pass the "
                           "same parameters, in the same order, with the same names, dtypes and shapes, and the "
                           "same groups with the same options).");
  // Built and checked on every rank, then agreed: a factory that fails on
  // one rank (one refusing an empty shard, say) fails them all here,
  // instead of leaving the others to wait in Step's broadcasts. The checks
  // every optimizer makes of its list come first and are agreed alike:
  // contiguity and memory shared between parameters are not compared
  // above, so a list may be refused on some ranks only, and the ranks that
  // passed would otherwise wait in the agreement until the group's timeout.
  std::string failure;
  ReserveFailureText(failure);
  bool listed = false;  // the list passed; a failure from here on is the factory's
  std::vector<internal::ReplicaEntry> built;  // the shard optimizer's kind, rates and options
  try {
    nn::optim::CheckParameters(params_, "ZeroRedundancyOptimizer (rank " + std::to_string(pg_->rank()) + ")");
    listed = true;
    for (const auto& [name, p] : params_) shapes_.push_back(p.shape());
    shards_ = Partition(params_, pg_->size());
    pieces_.resize(shards_.size());
    for (size_t r = 0; r < shards_.size(); ++r) {
      for (const Slice& s : shards_[r]) pieces_[r].push_back(PieceOf(params_[s.param].second.Detach(), s));
    }
    nn::optim::NamedParameters shard;
    const auto& mine = shards_[static_cast<size_t>(pg_->rank())];
    const std::vector<Tensor>& own = pieces_[static_cast<size_t>(pg_->rank())];
    for (size_t k = 0; k < mine.size(); ++k) shard.emplace_back(params_[mine[k].param].first, own[k]);
    local_ = build(std::move(shard));
    if (local_ == nullptr) throw std::invalid_argument("the factory returned null");
    // Step hands the k-th piece's gradient to the optimizer's k-th
    // parameter: it must hold exactly the pieces, in order.
    const nn::optim::NamedParameters& got = local_->params();
    bool same = got.size() == own.size();
    for (size_t k = 0; same && k < got.size(); ++k) same = got[k].second.impl() == own[k].impl();
    if (!same) {
      throw std::invalid_argument("the factory's optimizer holds " + std::to_string(got.size()) +
                                  " parameter(s), not the " + std::to_string(own.size()) +
                                  " piece(s) of its shard that it was given, in order (the factory must build the "
                                  "optimizer from its argument, not from the model)");
    }
    // Under the names given: the state is gathered and cut by them, so an
    // optimizer that renamed its pieces would save a state that names no
    // parameter (consolidated as if it had none) and refuse every load.
    for (size_t k = 0; k < got.size(); ++k) {
      const std::string& given = params_[mine[k].param].first;
      if (got[k].first != given) {
        throw std::invalid_argument("the factory's optimizer names piece " + std::to_string(k) + " `" +
                                    got[k].first + "`, not `" + given +
                                    "` as it was given (its state is saved and loaded under the given names)");
      }
    }
    // And each piece in its parameter's group, with that group's options.
    const std::vector<int64_t> sizes = ShardGroupSizes(pg_->rank());
    if (local_->num_groups() != num_groups_) {
      throw std::invalid_argument("the factory's optimizer has " + std::to_string(local_->num_groups()) +
                                  " param group(s), not the " + std::to_string(num_groups_) + " it was given");
    }
    for (size_t k = 0; k < num_groups_; ++k) {
      const int64_t got_size = static_cast<int64_t>(local_->group_params(k).size());
      if (got_size != sizes[k]) {
        throw std::invalid_argument("the factory's param group " + std::to_string(k) + " holds " +
                                    std::to_string(got_size) + " piece(s), not the " + std::to_string(sizes[k]) +
                                    " it was given");
      }
    }
    // Read here, where a failure (this rank's optimizer's state dict) is
    // agreed on like the factory's, not in the comparison below, which
    // the other ranks would wait in until the timeout.
    for (auto& [key, value] : internal::SharedOptimizerOptions(local_->StateDict())) {
      built.push_back({"option", key, value});
    }
  } catch (...) {
    DescribeFailure(failure, "ZeroRedundancyOptimizer", pg_->rank(), [&] {
      return listed ? "ZeroRedundancyOptimizer: building the optimizer of rank " + std::to_string(pg_->rank()) +
                          "'s shard failed: " + HandledExceptionText()
                    : HandledExceptionText();
    });
  }
  const std::vector<std::string> outcomes = pg_->AllGatherObject(failure);
  for (const std::string& outcome : outcomes) {
    if (!outcome.empty()) throw std::invalid_argument(outcome);
  }
  // Each rank's factory ran on its own: one that built another kind of
  // optimizer, or another rate, would step its shard unlike the others'
  // and broadcast the result into every replica.
  internal::VerifyReplicas(*pg_, built,
                           "ZeroRedundancyOptimizer: the ranks' shard optimizers differ (every rank's factory must "
                           "build the same kind of optimizer, with the same rates and options).");
}

const std::vector<ZeroRedundancyOptimizer::Slice>& ZeroRedundancyOptimizer::shard(int r) const {
  if (r < 0 || static_cast<size_t>(r) >= shards_.size()) {
    throw std::out_of_range("ZeroRedundancyOptimizer::shard: rank " + std::to_string(r) + " is not in a group of " +
                            std::to_string(shards_.size()));
  }
  return shards_[static_cast<size_t>(r)];
}

std::vector<int64_t> ZeroRedundancyOptimizer::ShardGroupSizes(int r) const {
  std::vector<int64_t> sizes(num_groups_, 0);
  for (const Slice& s : shards_[static_cast<size_t>(r)]) ++sizes[group_of_[s.param]];
  return sizes;
}

std::vector<std::vector<std::string>> ZeroRedundancyOptimizer::WholeGroupMembers() const {
  std::vector<std::vector<std::string>> names(num_groups_);
  for (size_t i = 0; i < params_.size(); ++i) names[group_of_[i]].push_back(params_[i].first);
  return names;
}

std::vector<std::vector<std::string>> ZeroRedundancyOptimizer::ShardGroupMembers(int r) const {
  std::vector<std::vector<std::string>> names(num_groups_);
  for (const Slice& s : shards_[static_cast<size_t>(r)]) names[group_of_[s.param]].push_back(params_[s.param].first);
  return names;
}

void ZeroRedundancyOptimizer::AddParamGroup(nn::optim::ParamGroup group) {
  const size_t k = num_groups_;  // the new group's index
  const std::string who = "ZeroRedundancyOptimizer::AddParamGroup";
  // This rank's optimizer may be unusable while the others' are not (a
  // group refused by some ranks only, local().AddParamGroup on one rank):
  // the ranks agree on it first, so that none waits for a rank that
  // refused alone in the comparison below until the group's timeout.
  std::string unusable;
  ReserveFailureText(unusable);
  try {
    CheckLocal("AddParamGroup");
  } catch (...) {
    DescribeFailure(unusable, who.c_str(), pg_->rank(),
                    [&] { return HandledExceptionText() + " (on rank " + std::to_string(pg_->rank()) + ")"; });
  }
  for (const std::string& outcome : pg_->AllGatherObject(unusable)) {
    if (!outcome.empty()) throw std::logic_error(outcome);
  }
  // Every rank cuts the new group alone, so the ranks must agree on it as
  // on the constructor's list (compared before the local checks, so that a
  // group only some ranks refuse fails every rank here alike).
  std::vector<internal::ReplicaEntry> entries;
  entries.push_back({"option", "param group " + std::to_string(k), internal::GroupOptionsText(group.options)});
  for (const auto& [name, p] : group.params) entries.push_back({"parameter", name, DescribeParameter(p)});
  internal::VerifyReplicas(*pg_, entries,
                           who + ": the ranks' new param groups differ (every rank must add the same parameters, "
                                 "in the same order, with the same names, dtypes and shapes, and the same options).");
  // The whole list is checked on every rank, and the outcome agreed, before
  // anything changes (contiguity and shared memory are not compared above,
  // so a list may be refused on some ranks only). The new parameters are
  // then cut among the ranks on their own, so that no piece of the old
  // ones, nor the state kept for it, moves.
  std::vector<std::vector<Slice>> added;
  std::vector<std::vector<Tensor>> added_pieces;
  // This object's lists as they are once the group is added, made here,
  // before the ranks agree: after the last agreement below they are only
  // swapped in (no allocation), so that no rank can fail there alone and
  // leave its lists unlike the others' while its optimizer holds the group.
  nn::optim::NamedParameters all;
  std::vector<size_t> all_group_of;
  std::vector<nn::Shape> all_shapes;
  std::vector<std::vector<Slice>> all_shards;
  std::vector<std::vector<Tensor>> all_pieces;
  std::string failure;
  ReserveFailureText(failure);
  try {
    all = params_;
    all.insert(all.end(), group.params.begin(), group.params.end());
    nn::optim::CheckParameters(all, who + " (rank " + std::to_string(pg_->rank()) + ")");
    added = Partition(group.params, pg_->size());
    added_pieces.resize(added.size());
    for (size_t r = 0; r < added.size(); ++r) {
      for (const Slice& s : added[r]) added_pieces[r].push_back(PieceOf(group.params[s.param].second.Detach(), s));
    }
    ThrowIfAddParamGroupFailureInjected();
    all_group_of = group_of_;
    all_group_of.resize(all.size(), k);
    all_shapes = shapes_;
    for (const auto& entry : group.params) all_shapes.push_back(entry.second.shape());
    all_shards = shards_;
    all_pieces = pieces_;
    for (size_t r = 0; r < added.size(); ++r) {
      for (size_t j = 0; j < added[r].size(); ++j) {
        Slice s = added[r][j];
        s.param += params_.size();
        all_shards[r].push_back(s);
        all_pieces[r].push_back(added_pieces[r][j]);
      }
    }
  } catch (...) {
    // The list's checks (std::invalid_argument) name the call and the rank.
    DescribeFailure(failure, who.c_str(), pg_->rank(), [&] {
      try {
        throw;
      } catch (const std::invalid_argument& e) {
        return std::string(e.what());
      } catch (...) {
        return who + " on rank " + std::to_string(pg_->rank()) + ": " + HandledExceptionText();
      }
    });
  }
  for (const std::string& outcome : pg_->AllGatherObject(failure)) {
    if (!outcome.empty()) throw std::invalid_argument(outcome);
  }
  // The shard's optimizer takes this rank's pieces as its new last group;
  // it checks the options, which the ranks agree on, so it refuses them on
  // every rank alike, changing nothing.
  try {
    nn::optim::ParamGroup shard{.params = {}, .options = group.options};
    const auto& mine = added[static_cast<size_t>(pg_->rank())];
    for (size_t j = 0; j < mine.size(); ++j) {
      shard.params.emplace_back(group.params[mine[j].param].first, added_pieces[static_cast<size_t>(pg_->rank())][j]);
    }
    local_->AddParamGroup(std::move(shard));
  } catch (...) {
    DescribeFailure(failure, who.c_str(), pg_->rank(),
                    [&] { return who + " on rank " + std::to_string(pg_->rank()) + ": " + HandledExceptionText(); });
  }
  const std::vector<std::string> outcomes = pg_->AllGatherObject(failure);
  std::string failed;  // the first rank that failed
  for (size_t r = 0; r < outcomes.size() && failed.empty(); ++r) {
    if (!outcomes[r].empty()) failed = outcomes[r];
  }
  // Refused here: nothing changed on this rank. Where another rank refused
  // it (an LrScheduler over local() on some ranks only), the group was
  // added here, and this rank is left unusable.
  if (!failure.empty()) throw std::invalid_argument(failure);
  if (!failed.empty()) {
    broken_ = failed + " (the group was added on rank " + std::to_string(pg_->rank()) +
              ", so the ranks' shards no longer match: build the optimizer again)";
    throw std::invalid_argument(broken_);
  }
  params_.swap(all);
  group_of_.swap(all_group_of);
  shapes_.swap(all_shapes);
  shards_.swap(all_shards);
  pieces_.swap(all_pieces);
  ++num_groups_;
}

void ZeroRedundancyOptimizer::CheckLocal(const char* what) const {
  if (!broken_.empty()) throw std::logic_error("ZeroRedundancyOptimizer::" + std::string(what) + ": " + broken_);
  // Step hands the k-th piece's gradient to the shard optimizer's k-th
  // parameter, and the consolidated state is read by the pieces: a group
  // added to that optimizer directly (local().AddParamGroup) would be
  // stepped by this rank alone, never broadcast, and left out of the state.
  const size_t own = pieces_[static_cast<size_t>(pg_->rank())].size();
  if (local_->num_groups() != num_groups_ || local_->params().size() != own) {
    throw std::logic_error("ZeroRedundancyOptimizer::" + std::string(what) + ": the shard's optimizer has " +
                           std::to_string(local_->num_groups()) + " param group(s) and " +
                           std::to_string(local_->params().size()) + " parameter(s), not the " +
                           std::to_string(num_groups_) + " and " + std::to_string(own) +
                           " it was given (was local().AddParamGroup called? Add groups with "
                           "ZeroRedundancyOptimizer::AddParamGroup, on every rank)");
  }
}

void ZeroRedundancyOptimizer::Step() {
  const nn::optim::NamedParameters& local = local_->params();
  // The pieces' gradients are cleared after the step; a parameter added to
  // the shard's optimizer directly (refused below) is not a piece, and its
  // gradient is left alone.
  const auto clear_pieces = [&] {
    const size_t own = std::min(local.size(), pieces_[static_cast<size_t>(pg_->rank())].size());
    for (size_t k = 0; k < own; ++k) local[k].second.set_grad(Tensor());
  };
  // A failure here is this rank's alone (its gradients, its memory, its
  // optimizer, a broadcast's buffers), while the others are about to
  // broadcast their shards and wait for this one's: end the group so that
  // they fail now, with the reason, rather than at the timeout.
  try {
    CheckLocal("Step");
    // The pieces are views of the parameters' memory as it was at
    // construction; Module::To gives a parameter new memory, and SetData
    // may give it other elements of the same memory (another offset,
    // shape or strides): the pieces would then update and broadcast
    // elements the model no longer uses.
    for (size_t r = 0; r < shards_.size(); ++r) {
      for (size_t k = 0; k < shards_[r].size(); ++k) {
        const Slice& s = shards_[r][k];
        const auto& [name, param] = params_[s.param];
        const bool same = pieces_[r][k].storage() == param.storage() && param.is_contiguous() &&
                          param.shape() == shapes_[s.param] &&
                          pieces_[r][k].data_ptr() ==
                              static_cast<const char*>(param.data_ptr()) +
                                  static_cast<size_t>(s.offset) * param.element_size();
        if (!same) {
          throw std::logic_error("ZeroRedundancyOptimizer::Step: parameter `" + name +
                                 "` has new memory since the optimizer was built (Module::To, or SetData, after "
                                 "it?); build the optimizer after moving or converting the model");
        }
      }
    }
    // Each piece of a gradient is read as the parameter's row-major
    // elements: one of another shape (SetData on the gradient) would be
    // read in the wrong order, or past its end. Checked on every rank for
    // every parameter, so that the ranks refuse it alike, before any rank
    // steps its shard; so are the gradient's device and dtype, which
    // handing its pieces to the shard's optimizer refuses too, but only on
    // the ranks holding a piece of it, after the others stepped theirs
    // (their parameters changed while the refusing rank's did not).
    for (const auto& [name, param] : params_) {
      const Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      if (grad.shape() != param.shape()) {
        throw std::invalid_argument("ZeroRedundancyOptimizer::Step: gradient of `" + name + "` has shape " +
                                    nn::ShapeToString(grad.shape()) + ", the parameter " +
                                    nn::ShapeToString(param.shape()));
      }
      if (grad.device() != param.device()) {
        throw std::invalid_argument("ZeroRedundancyOptimizer::Step: gradient of `" + name + "` is on " +
                                    grad.device().ToString() + ", the parameter on " + param.device().ToString());
      }
      // A piece's gradient must have its piece's dtype (set_grad), where
      // the unsharded optimizer converts a floating one.
      if (grad.dtype() != param.dtype()) {
        throw std::invalid_argument("ZeroRedundancyOptimizer::Step: gradient of `" + name + "` has dtype " +
                                    std::string(nn::DTypeName(grad.dtype())) + ", the parameter " +
                                    std::string(nn::DTypeName(param.dtype())));
      }
    }
    // The local optimizer's pieces take the matching pieces of the gradients
    // for this step only: holding them would keep the gradients' memory alive
    // after ZeroGrad lets go of it.
    const auto& mine = shards_[static_cast<size_t>(pg_->rank())];
    for (size_t k = 0; k < mine.size(); ++k) {
      const Tensor& grad = params_[mine[k].param].second.grad();
      local[k].second.set_grad(grad.defined() ? PieceOf(grad, mine[k]) : Tensor());
    }
    local_->Step();
    clear_pieces();
    // Each rank's pieces, per dtype and device in broadcasts of buckets of
    // at most kBroadcastBucketBytes (in place for a bucket of one piece).
    for (int r = 0; r < pg_->size(); ++r) {
      internal::BroadcastCoalesced(*pg_, pieces_[static_cast<size_t>(r)], r,
                                   "zero: parameters of rank " + std::to_string(r));
    }
  } catch (...) {
    clear_pieces();
    // A failed broadcast has aborted the group already, with its reason.
    AbortForThisRank(*pg_, "ZeroRedundancyOptimizer::Step");
    throw;
  }
}

void ZeroRedundancyOptimizer::ZeroGrad(bool set_to_none) {
  nn::optim::ZeroGrad(params_, set_to_none);
}

NamedTensors ZeroRedundancyOptimizer::ConsolidatedStateDict(int to) {
  // The ranks agree on `to` first, in one small collective: a rank whose
  // `to` is out of range threw alone and left the others waiting in the
  // broadcasts below until the group's timeout, and ranks that passed
  // different ranks each took the whole state, or none did. One rank has
  // nothing to agree with.
  const std::vector<std::string> targets =
      pg_->size() > 1 ? pg_->AllGatherObject(std::to_string(to)) : std::vector<std::string>{};
  for (size_t r = 1; r < targets.size(); ++r) {
    if (targets[r] == targets[0]) continue;
    throw std::invalid_argument("ZeroRedundancyOptimizer::ConsolidatedStateDict: rank 0 passed to = " + targets[0] +
                                " and rank " + std::to_string(r) + " passed to = " + targets[r] +
                                "; every rank must name the same receiving rank");
  }
  if (to < 0 || to >= pg_->size()) {
    throw std::invalid_argument("ZeroRedundancyOptimizer::ConsolidatedStateDict: rank " + std::to_string(to) +
                                " is not in a group of " + std::to_string(pg_->size()));
  }
  NamedTensors mine;
  // The options ("group.*", the same on every rank) come from this rank's
  // optimizer below; only the per-parameter state is gathered.
  NamedTensors options;
  std::vector<NamedTensors> by_rank(static_cast<size_t>(pg_->size()));
  try {
    CheckLocal("ConsolidatedStateDict");
    for (auto& [name, t] : local_->StateDict()) {
      if (name.rfind("state.", 0) == 0) {
        mine.emplace_back(name, t.To(nn::kCPU).Contiguous());
      } else if (name != "lr") {
        options.emplace_back(name, t);
      }
    }
    // Each rank in turn describes its shard's state and sends it.
    for (int r = 0; r < pg_->size(); ++r) {
      const std::string text =
          BroadcastString(*pg_, r == pg_->rank() ? DescribeTensors(mine) : std::string(), r, "zero: state list");
      NamedTensors tensors = r == pg_->rank() ? mine : EmptyTensorsFromDescription(text);
      std::vector<Work> works;
      for (const auto& [name, t] : tensors) works.push_back(pg_->Broadcast(t, r, "zero: " + name));
      for (Work& w : works) w.Wait();
      // Only the receiving rank keeps the shards: the others would hold the
      // whole optimizer state, which sharding exists to avoid.
      if (pg_->rank() == to) by_rank[static_cast<size_t>(r)] = std::move(tensors);
    }
  } catch (...) {
    // The peers wait for this rank's state list, or for it to receive
    // theirs (a peer's tensors it had no memory for): tell them, as Step
    // does, instead of letting them wait out the timeout. A failed
    // broadcast has aborted the group already, with its reason.
    AbortForThisRank(*pg_, "ZeroRedundancyOptimizer::ConsolidatedStateDict");
    throw;
  }
  if (pg_->rank() != to) return {};
  // The unsharded optimizer's order: "lr", the options, then parameter by parameter,
  // each parameter's entries in its first piece's order; the pieces of an
  // elementwise entry are put back in place in a tensor of the parameter's
  // shape, and "step" (the same in every piece) is taken from the first.
  std::vector<std::map<std::string, Tensor>> lookup(by_rank.size());
  for (size_t r = 0; r < by_rank.size(); ++r) {
    for (const auto& [name, t] : by_rank[r]) lookup[r].emplace(name, t);
  }
  NamedTensors out;
  // One group: "lr" apart, as the unsharded optimizer saves it; several:
  // each group's rate is among the options, with the whole's group sizes
  // in place of the shard's.
  if (local_->num_groups() == 1) {
    out.emplace_back("lr", nn::FromVector({local_->lr()}, {}, {.dtype = nn::DType::kFloat64}));
  }
  internal::RewriteGroups(options, num_groups_, ShardGroupMembers(pg_->rank()), WholeGroupMembers());
  for (auto& entry : options) out.push_back(std::move(entry));
  for (size_t i = 0; i < params_.size(); ++i) {
    std::vector<std::pair<size_t, Slice>> holders;  // (rank, piece) of parameter i
    for (size_t r = 0; r < shards_.size(); ++r) {
      for (const Slice& s : shards_[r]) {
        if (s.param == i) holders.emplace_back(r, s);
      }
    }
    if (holders.empty()) continue;
    const Tensor& param = params_[i].second;
    for (const auto& [name, first] : by_rank[holders.front().first]) {
      if (nn::optim::ParameterOfStateKey(name, params_) != static_cast<int>(i)) continue;
      if (SlotOfKey(name, params_[i].first) == "step") {
        out.emplace_back(name, first);
        continue;
      }
      Tensor whole = nn::Empty(param.shape(), {.dtype = first.dtype()});
      for (const auto& [r, s] : holders) {
        const auto it = lookup[r].find(name);
        if (it == lookup[r].end() || it->second.numel() != s.length) {
          throw std::runtime_error("ZeroRedundancyOptimizer::ConsolidatedStateDict: rank " + std::to_string(r) +
                                   " holds no piece of `" + name + "` of " + std::to_string(s.length) +
                                   " elements");
        }
        PieceOf(whole, s).CopyFrom(it->second);
      }
      out.emplace_back(name, whole);
    }
  }
  return out;
}

NamedTensors ZeroRedundancyOptimizer::ShardOf(const NamedTensors& state) const {
  const auto& mine = shards_[static_cast<size_t>(pg_->rank())];
  NamedTensors shard;
  bool listed = false;                          // the state lists every parameter it was saved with
  std::vector<bool> in_state(params_.size());   // per parameter: some "state." entry names it
  for (const auto& [key, t] : state) {
    if (key == "group.params_listed") {
      listed = t.defined() && t.dtype() == nn::DType::kInt64 && t.shape() == nn::Shape{} &&
               t.To(nn::kCPU).data<int64_t>()[0] == 1;
    }
    if (key == "lr" || key.rfind("group.", 0) == 0 || key.rfind("param_groups.", 0) == 0) {
      shard.emplace_back(key, t);
      continue;
    }
    if (key.rfind("state.", 0) != 0) continue;  // other components' entries
    const int i = nn::optim::ParameterOfStateKey(key, params_);
    if (i < 0) throw std::invalid_argument("state key `" + key + "` names no parameter of this optimizer");
    in_state[static_cast<size_t>(i)] = true;
    const std::string& name = params_[static_cast<size_t>(i)].first;
    const Tensor& param = params_[static_cast<size_t>(i)].second;
    if (param.numel() == 0) {
      // In no shard, so no shard's optimizer checks its entries: checked
      // here, on every rank, as the unsharded optimizer checks them (they
      // hold no value, and nothing of them is loaded).
      const bool step = SlotOfKey(key, name) == "step";
      const bool fits = t.defined() && (step ? t.dtype() == nn::DType::kInt64 && t.shape() == nn::Shape{} &&
                                                   t.To(nn::kCPU).data<int64_t>()[0] >= 0
                                             : t.shape() == param.shape());
      if (!fits) {
        throw std::invalid_argument(
            "state entry `" + key + "` is " +
            (t.defined() ? std::string(nn::DTypeName(t.dtype())) + " " + nn::ShapeToString(t.shape())
                         : std::string("undefined")) +
            (step ? ", expected an i64 [] step >= 0"
                  : "; parameter `" + name + "` is " + nn::ShapeToString(param.shape())));
      }
      continue;
    }
    const auto piece = std::find_if(mine.begin(), mine.end(),
                                    [&](const Slice& s) { return s.param == static_cast<size_t>(i); });
    if (piece == mine.end()) continue;
    if (SlotOfKey(key, name) == "step") {
      shard.emplace_back(key, t);
      continue;
    }
    // In the parameter's shape, as the unsharded optimizer takes it: one of
    // another shape with as many elements (a transposed momentum) would
    // otherwise be cut into pieces as if it were the parameter's.
    const nn::Shape& want = params_[static_cast<size_t>(i)].second.shape();
    if (!t.defined() || t.shape() != want) {
      throw std::invalid_argument("state entry `" + key + "` is " +
                                  (t.defined() ? nn::ShapeToString(t.shape()) : std::string("undefined")) +
                                  "; parameter `" + name + "` is " + nn::ShapeToString(want));
    }
    shard.emplace_back(key, PieceOf(t, *piece));
  }
  // The shard's optimizer cannot tell a parameter missing from a state that
  // lists every parameter (one saved by an optimizer over other
  // parameters): its pieces are detached views, without requires_grad or a
  // gradient outside Step, which it takes for frozen and lets through with
  // no state. The parameters themselves are looked at here instead, as the
  // unsharded optimizer looks at them: a frozen one (requires_grad off and
  // no gradient) may be absent.
  if (listed) {
    for (const Slice& s : mine) {
      const auto& [name, p] = params_[s.param];
      const bool frozen = !p.requires_grad() && !p.grad().defined();
      if (!in_state[s.param] && !frozen) {
        throw std::invalid_argument("parameter `" + name + "` is not in the state (no `state." + name +
                                    ".step`): it was saved by an optimizer over other parameters");
      }
    }
  }
  // The shard's optimizer holds only its pieces of each group, so it
  // cannot compare the whole's groups: they are compared here, then
  // replaced by the shard's.
  internal::RewriteGroups(shard, num_groups_, WholeGroupMembers(), ShardGroupMembers(pg_->rank()));
  return shard;
}

void ZeroRedundancyOptimizer::LoadStateDict(const NamedTensors& state) {
  // Every rank checks its shard first and loads only once all passed: a
  // state that only some shards refuse must leave every rank as it was.
  // Only a refusal of the state's content is std::invalid_argument; any
  // other failure here (out of memory, a broken optimizer) is this rank's
  // own and is rethrown as it came, once the peers have been told.
  //
  // The buffers of the exchange of verdicts are made before the check, and
  // the verdict is written into them in place: a check that failed for
  // lack of memory must not fail again while this rank tells the others,
  // which would leave them waiting for it until the group's timeout.
  Tensor record, all;
  try {
    record = nn::Zeros({kOutcomeBytes}, {.dtype = nn::DType::kUInt8});
    all = nn::Empty({kOutcomeBytes * pg_->size()}, {.dtype = nn::DType::kUInt8});
  } catch (...) {
    if (pg_->size() > 1) {
      AbortForThisRank(*pg_, "ZeroRedundancyOptimizer::LoadStateDict",
                       " (making the buffers to compare the ranks' checks of the state)");
    }
    throw;
  }
  char verdict = kLoadable;
  std::exception_ptr thrown;
  NamedTensors shard;
  try {
    CheckLocal("LoadStateDict");
    shard = ShardOf(state);
    local_->CheckStateDict(shard);
  } catch (const std::invalid_argument& e) {
    verdict = kRefused;
    thrown = std::current_exception();
    WriteOutcome(record, verdict, e.what());
  } catch (...) {
    verdict = kFailed;
    thrown = std::current_exception();
    WriteOutcome(record, verdict, WhatOf(thrown));
  }
  pg_->AllGather(all, record, "ZeroRedundancyOptimizer::LoadStateDict verdicts").Wait();
  if (verdict == kFailed) std::rethrow_exception(thrown);
  if (verdict == kRefused) {
    try {
      std::rethrow_exception(thrown);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("ZeroRedundancyOptimizer::LoadStateDict: ") + e.what());
    }
  }
  const std::string refused = ListOutcomes(all, pg_->size(), kRefused);
  const std::string failed = ListOutcomes(all, pg_->size(), kFailed);
  if (!failed.empty()) {
    throw DistributedError(transport::AbortedError(
        "ZeroRedundancyOptimizer::LoadStateDict failed on " + failed +
        " (not a refusal of the state: see that rank's error)" +
        (refused.empty() ? std::string() : "; the state was refused on " + refused)));
  }
  if (!refused.empty()) {
    throw std::invalid_argument("ZeroRedundancyOptimizer::LoadStateDict failed on " + refused);
  }
  try {
    local_->LoadStateDict(shard);
  } catch (...) {
    // Checked above, so only this rank's own failure (out of memory) gets
    // here, after the peers have loaded: end the group so that their next
    // collective fails at once with the reason, instead of waiting for
    // this rank until the timeout.
    AbortForThisRank(*pg_, "ZeroRedundancyOptimizer::LoadStateDict");
    throw;
  }
}

namespace internal {
void FailNextAddParamGroupForTesting() { fail_next_add_param_group.store(true); }
}  // namespace internal

}  // namespace ddp::dist
