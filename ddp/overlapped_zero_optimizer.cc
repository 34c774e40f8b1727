#include "ddp/overlapped_zero_optimizer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "ddp/comm_hooks.h"
#include "ddp/process_group.h"
#include "ddp/replicas.h"
#include "ddp/zero_groups.h"

namespace ddp::dist {

using nn::Tensor;

// Shared by the object and its hook (which the wrapper keeps). Everything
// is built at construction on the training thread; the hook's tasks then
// run the optimizers on the communication thread. `mu` orders those steps
// with set_lr and the counters.
struct OverlappedZeroOptimizer::State {
  // One bucket: its parameters, moved into one flat buffer laid out as the
  // bucket (the reduction's all-gather writes into it directly), and the
  // optimizer of this rank's slice of it.
  struct Bucket {
    Tensor flat;
    std::vector<const nn::TensorImpl*> params;
    std::vector<int64_t> offsets;
    // The optimizer's parameters: 1-D views of the pieces of parameters in
    // this rank's slice, cut also where the transport's pieces begin, so
    // that each transport piece is a run of whole views.
    nn::optim::NamedParameters views;
    std::vector<int64_t> view_begin;  // each view's first element in the bucket
    std::vector<size_t> view_param;   // each view's parameter (index into params)
    std::vector<int64_t> view_offset; // each view's first element in its parameter
    // Transport piece offset -> [first view, end view) and its length.
    std::map<int64_t, std::pair<std::pair<size_t, size_t>, int64_t>> pieces;
    std::unique_ptr<nn::optim::Optimizer> optimizer;  // null for an empty slice
  };

  GroupFactory make;            // for LoadStateDict's probes
  std::vector<Bucket> buckets;  // by bucket index
  ProcessGroup* group = nullptr;  // DistributedDataParallel's (it outlives this)
  std::vector<Tensor> params;   // every trained parameter (ZeroGrad)
  std::vector<std::string> names;  // their names
  // The groups: each one's options, each parameter's group, the whole
  // list's order (the groups' lists one after another: the unsharded
  // optimizer's, and its state's) and each group's names in it.
  std::vector<std::map<std::string, double>> group_options;
  std::vector<size_t> group_of;
  std::vector<size_t> order;
  std::vector<std::vector<std::string>> whole_members;
  int64_t total_elements = 0;
  int64_t owned_elements = 0;
  // One rank: DDP runs no hook; Step() runs this optimizer of everything.
  std::unique_ptr<nn::optim::Optimizer> whole;

  mutable std::mutex mu;
  std::vector<double> lrs;  // per group
  // The optimizers' options ("group.*" entries of their StateDict, the same
  // in every one, and with several groups the "param_groups.*" ones with
  // the whole's sizes and members), for ConsolidatedStateDict on a rank
  // that may own none.
  nn::optim::NamedTensors options;
  int64_t steps = 0;
  // The wrapper (which outlives this), and its count of synchronizing
  // backwards, run or shadowed under Join, when Step() last returned:
  // Step() ends one step per such backward, read on the training thread
  // that runs them. A shadowed backward runs this rank's slices' steps in
  // the reduction as a backward of its own does, so the Step() a joined
  // rank runs in Join's shadow_step ends it alike.
  const DistributedDataParallel* ddp = nullptr;
  int64_t iterations_ended = 0;
  // Set by the destructor: the hook, which DDP keeps, then refuses to step.
  std::atomic<bool> destroyed{false};
  // Why the construction failed after this rank registered the hook (a
  // peer refused its own); written before `destroyed` is set.
  std::string refused;

  // Runs bucket `index`'s optimizer on the views of the transport piece at
  // `offset` (`count` elements; their reduced gradients, already the
  // average, at `reduced`), which updates the parameters in the flat buffer
  // that the all-gather then sends.
  void StepPiece(size_t index, const void* reduced, int64_t offset, int64_t count) {
    std::lock_guard<std::mutex> lock(mu);
    Bucket& bucket = buckets.at(index);
    if (count == 0) return;  // an empty slice
    auto it = bucket.pieces.find(offset);
    if (it == bucket.pieces.end() || it->second.second != count || bucket.optimizer == nullptr) {
      throw std::logic_error("bucket " + std::to_string(index) + ": piece [" + std::to_string(offset) +
                             ", +" + std::to_string(count) + ") is not one the optimizer was built for");
    }
    const auto [first, end] = it->second.first;
    const nn::DType dtype = bucket.flat.dtype();
    const size_t elem = nn::ElementSize(dtype);
    char* grads = static_cast<char*>(const_cast<void*>(reduced));
    for (size_t j = first; j < end; ++j) {
      const Tensor& view = bucket.views[j].second;
      view.set_grad(Tensor::FromBlob(grads + static_cast<size_t>(bucket.view_begin[j] - offset) * elem,
                                     {view.numel()}, dtype));
    }
    try {
      bucket.optimizer->Step();
    } catch (...) {
      // The gradients point into the call's scratch memory.
      for (size_t j = first; j < end; ++j) bucket.views[j].second.set_grad(Tensor());
      throw;
    }
    for (size_t j = first; j < end; ++j) bucket.views[j].second.set_grad(Tensor());
  }

  // The groups given at construction, each with the parameters (views, or
  // whole ones) of `params` in it, in their order; `group` gives each
  // one's group.
  std::vector<nn::optim::ParamGroup> GroupsOf(const nn::optim::NamedParameters& params,
                                              const std::vector<size_t>& group) const {
    std::vector<nn::optim::ParamGroup> out(group_options.size());
    for (size_t k = 0; k < out.size(); ++k) out[k].options = group_options[k];
    for (size_t j = 0; j < params.size(); ++j) out[group[j]].params.push_back(params[j]);
    return out;
  }
};

namespace {

// Inside a catch handler: what the exception being handled says. A throw
// of a type not derived from std::exception must reach the peers too
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

// Each group's parameter names in an optimizer.
std::vector<std::vector<std::string>> MembersOf(const nn::optim::Optimizer& optimizer) {
  std::vector<std::vector<std::string>> out(optimizer.num_groups());
  for (size_t k = 0; k < out.size(); ++k) {
    for (const auto& [name, p] : optimizer.group_params(k)) out[k].push_back(name);
  }
  return out;
}

// The options of an optimizer of some of the parameters: the "group.*"
// entries of its StateDict and, with several groups, the "param_groups.*"
// ones with the whole's group sizes and members (`whole`) in place of its
// own.
nn::optim::NamedTensors OptionsOf(const nn::optim::Optimizer& optimizer,
                                  const std::vector<std::vector<std::string>>& whole) {
  nn::optim::NamedTensors out;
  for (auto& [key, value] : optimizer.StateDict()) {
    if (key.rfind("group.", 0) == 0 || key.rfind("param_groups.", 0) == 0) out.emplace_back(key, value);
  }
  internal::RewriteGroups(out, optimizer.num_groups(), MembersOf(optimizer), whole);
  return out;
}

// Whether `optimizer` holds `groups`' parameters (the same tensors) in
// their groups and order; else why not.
std::string HoldsGroups(const nn::optim::Optimizer& optimizer, const std::vector<nn::optim::ParamGroup>& groups,
                        const std::string& hint) {
  if (optimizer.num_groups() != groups.size()) {
    return "the factory's optimizer has " + std::to_string(optimizer.num_groups()) + " param group(s), not the " +
           std::to_string(groups.size()) + " it was given" + hint;
  }
  for (size_t k = 0; k < groups.size(); ++k) {
    const nn::optim::NamedParameters got = optimizer.group_params(k);
    bool same = got.size() == groups[k].params.size();
    for (size_t j = 0; same && j < got.size(); ++j) same = got[j].second.impl() == groups[k].params[j].second.impl();
    if (!same) {
      return "the factory's optimizer does not hold the pieces it was given" +
             (groups.size() > 1 ? " in param group " + std::to_string(k) : std::string()) +
             " (it must build the optimizer from its argument, not from the model)";
    }
    // Under the names given: the state is gathered and cut by them, so an
    // optimizer that renamed its pieces would save a state without them
    // and refuse every load.
    for (size_t j = 0; j < got.size(); ++j) {
      if (got[j].first != groups[k].params[j].first) {
        return "the factory's optimizer names " +
               (groups.size() > 1 ? "param group " + std::to_string(k) + "'s " : std::string()) + "parameter " +
               std::to_string(j) + " `" + got[j].first + "`, not `" + groups[k].params[j].first +
               "` as it was given (its state is saved and loaded under the given names)";
      }
    }
  }
  return "";
}

}  // namespace

namespace {

// One group without options of the module's trained parameters.
std::vector<nn::optim::ParamGroup> TrainedParameters(DistributedDataParallel& ddp) {
  nn::optim::ParamGroup all;
  for (auto& [name, p] : ddp.module()->NamedParameters()) {
    if (p.requires_grad()) all.params.emplace_back(name, p);
  }
  return {std::move(all)};
}

}  // namespace

OverlappedZeroOptimizer::OverlappedZeroOptimizer(DistributedDataParallel& ddp, Factory make)
    : OverlappedZeroOptimizer(ddp, TrainedParameters(ddp),
                              make ? GroupFactory([make](std::vector<nn::optim::ParamGroup> shard) {
                                return make(std::move(shard.front().params));
                              })
                                   : GroupFactory(),
                              /*grouped=*/false) {}

OverlappedZeroOptimizer::OverlappedZeroOptimizer(DistributedDataParallel& ddp,
                                                 std::vector<nn::optim::ParamGroup> groups, GroupFactory make)
    : OverlappedZeroOptimizer(ddp, std::move(groups), std::move(make), /*grouped=*/true) {}

OverlappedZeroOptimizer::OverlappedZeroOptimizer(DistributedDataParallel& ddp,
                                                 std::vector<nn::optim::ParamGroup> groups, GroupFactory make,
                                                 bool grouped)
    : state_(std::make_shared<State>()) {
  if (!make) throw std::invalid_argument("OverlappedZeroOptimizer: null factory");
  if (groups.empty()) throw std::invalid_argument("OverlappedZeroOptimizer: no parameter group");
  if (ddp.options().find_unused_parameters || ddp.options().static_graph) {
    throw std::invalid_argument(
        std::string("OverlappedZeroOptimizer: DdpOptions::") +
        (ddp.options().find_unused_parameters ? "find_unused_parameters" : "static_graph") +
        " is set; a parameter unused on every rank would still take a step (with a zero gradient) "
        "inside the reduction, where the unsharded optimizer skips it");
  }
  ProcessGroup& group = ddp.process_group();
  // The checks below look at this rank's own module, which may differ from
  // the others' (requires_grad changed on one rank after the wrapper was
  // built, a parameter made non-contiguous on one rank): a rank that threw
  // here alone would leave the others waiting for it in the agreement
  // further down until the group's timeout. So a refusal is kept in
  // `failure`, nothing is built after it, and the ranks learn it together,
  // each naming the rank that refused.
  std::string failure;
  std::unordered_map<std::string, Tensor> by_name;
  try {
    for (const auto& [name, p] : ddp.module()->NamedParameters()) {
      if (!p.requires_grad()) continue;
      if (!p.device().is_cpu() || !p.is_contiguous()) {
        throw std::invalid_argument("parameter `" + name + "` is " +
                                    (p.device().is_cpu() ? "not contiguous" : "on " + p.device().ToString()) +
                                    "; the fused step runs on contiguous CPU parameters");
      }
      by_name.emplace(name, p);
      state_->params.push_back(p);
      state_->names.push_back(name);
      state_->total_elements += p.numel();
    }
  } catch (...) {
    failure = HandledExceptionText();
  }
  if (grouped && group.size() > 1) {
    // Each rank builds its slices' groups from its own list: a rank that
    // stepped its pieces with another group's rate or decay would
    // all-gather them into every replica. Compared before the checks
    // below, so that groups only some ranks refuse fail every rank here.
    std::vector<internal::ReplicaEntry> entries;
    for (size_t k = 0; k < groups.size(); ++k) {
      entries.push_back({"option", "param group " + std::to_string(k), internal::GroupOptionsText(groups[k].options)});
      for (const auto& [name, p] : groups[k].params) {
        entries.push_back({"parameter", name, "in param group " + std::to_string(k)});
      }
    }
    internal::VerifyReplicas(group, entries,
                             "OverlappedZeroOptimizer: the ranks' parameter groups differ (every rank must pass "
                             "the same groups, with the same parameters in the same order and the same options).");
  }
  // Every trained parameter in exactly one group, as the module's tensor.
  const size_t none = groups.size();
  if (failure.empty()) {
    try {
      state_->group_of.assign(state_->params.size(), none);
      state_->whole_members.resize(groups.size());
      for (size_t k = 0; k < groups.size(); ++k) {
        state_->group_options.push_back(groups[k].options);
        for (const auto& [name, p] : groups[k].params) {
          const size_t i = static_cast<size_t>(std::find(state_->names.begin(), state_->names.end(), name) -
                                               state_->names.begin());
          const std::string which = "param group " + std::to_string(k) + "'s `" + name + "` ";
          if (i == state_->names.size()) {
            throw std::invalid_argument(which + "is not a trained parameter of the module");
          }
          if (p.impl() != state_->params[i].impl()) {
            throw std::invalid_argument(which + "is not the module's parameter of that name");
          }
          if (state_->group_of[i] != none) {
            throw std::invalid_argument(which + "is in param group " + std::to_string(state_->group_of[i]) + " too");
          }
          state_->group_of[i] = k;
          state_->order.push_back(i);
          state_->whole_members[k].push_back(name);
        }
      }
      for (size_t i = 0; i < state_->params.size(); ++i) {
        if (state_->group_of[i] == none) {
          throw std::invalid_argument("trained parameter `" + state_->names[i] + "` is in no param group");
        }
      }
    } catch (...) {
      failure = HandledExceptionText();
    }
  }
  const std::string hint = grouped ? "" : " (pass parameter groups to the constructor that takes them)";
  state_->group = &group;
  state_->make = make;
  state_->ddp = &ddp;
  state_->iterations_ended = ddp.group_iterations();
  if (group.size() == 1) {
    if (!failure.empty()) throw std::invalid_argument("OverlappedZeroOptimizer: " + failure);
    state_->whole = make(groups);
    if (state_->whole == nullptr) throw std::invalid_argument("OverlappedZeroOptimizer: the factory returned null");
    if (const std::string wrong = HoldsGroups(*state_->whole, groups, hint); !wrong.empty()) {
      throw std::invalid_argument("OverlappedZeroOptimizer: " + wrong);
    }
    for (size_t k = 0; k < groups.size(); ++k) state_->lrs.push_back(state_->whole->lr(k));
    state_->owned_elements = state_->total_elements;
    return;
  }

  // DDP's buckets must hold exactly this rank's trained parameters, each
  // once: checked before anything moves.
  const std::vector<std::vector<std::string>> bucket_names = ddp.BucketParameterNames();
  if (failure.empty()) {
    std::unordered_map<std::string, int> in_buckets;
    for (const std::vector<std::string>& names : bucket_names) {
      for (const std::string& name : names) {
        if (by_name.count(name) == 0) {
          failure = "DDP's bucket parameter `" + name +
                    "` is not a trained parameter of the module (did requires_grad change after the wrapper was "
                    "built?)";
          break;
        }
        if (++in_buckets[name] > 1) {
          failure = "DDP's bucket parameter `" + name + "` is in its buckets twice";
          break;
        }
      }
      if (!failure.empty()) break;
    }
    for (const std::string& name : state_->names) {
      if (!failure.empty()) break;
      if (in_buckets.count(name) == 0) {
        failure = "trained parameter `" + name +
                  "` is in none of DDP's buckets (did requires_grad change after the wrapper was built?)";
      }
    }
  }
  // The buckets as the reducer built them, which the fixed-bucket hook
  // keeps: each one's parameters move into one flat buffer in shareable
  // memory, at their gradients' offsets, and this rank's slice of it gets
  // its optimizer.
  std::vector<std::pair<Tensor, Tensor>> moves;  // (parameter, its view of a flat buffer)
  // The flat buffers are this rank's own allocations (as large as the
  // model): one it has no memory for fails every rank at the agreement
  // below, as a factory's failure does.
  try {
    for (const std::vector<std::string>& names : bucket_names) {
      if (!failure.empty()) break;
      State::Bucket bucket;
      std::vector<Tensor> members;
      std::vector<size_t> indices;  // into state_->params
      int64_t numel = 0;
      for (const std::string& name : names) {
        const auto found = by_name.find(name);
        members.push_back(found->second);
        by_name.erase(found);  // each parameter in one bucket
        indices.push_back(static_cast<size_t>(
            std::find(state_->names.begin(), state_->names.end(), name) - state_->names.begin()));
        bucket.offsets.push_back(numel);
        numel += members.back().numel();
      }
      bucket.flat = group.CollectiveZeros({numel}, {.dtype = members.front().dtype()});
      for (size_t k = 0; k < members.size(); ++k) {
        const Tensor& p = members[k];
        const Tensor view = bucket.flat.Narrow(0, bucket.offsets[k], p.numel()).View(p.shape());
        {
          nn::NoGradGuard guard;
          view.CopyFrom(p);
        }
        // The parameter moves into the view once the hook is registered
        // (below): a construction refused before then leaves the module as
        // it was, and with it an optimizer built on it earlier, whose hook
        // finds the parameters in its own flat buffers.
        moves.emplace_back(p, view);
        bucket.params.push_back(p.impl());
      }
      const Tensor flat = bucket.flat.Detach();
      for (const auto& [offset, count] : group.ThroughPieces(numel, bucket.flat.dtype())) {
        const size_t first = bucket.views.size();
        for (size_t k = 0; k < members.size(); ++k) {
          const int64_t lo = std::max(bucket.offsets[k], offset);
          const int64_t hi = std::min(bucket.offsets[k] + members[k].numel(), offset + count);
          if (lo >= hi) continue;
          // A parameter cut into several views names each by its range.
          const bool whole = lo == bucket.offsets[k] && hi == bucket.offsets[k] + members[k].numel();
          bucket.views.emplace_back(
              whole ? names[k]
                    : names[k] + "[" + std::to_string(lo - bucket.offsets[k]) + ":" +
                          std::to_string(hi - bucket.offsets[k]) + "]",
              flat.Narrow(0, lo, hi - lo));
          bucket.view_begin.push_back(lo);
          bucket.view_param.push_back(indices[k]);
          bucket.view_offset.push_back(lo - bucket.offsets[k]);
        }
        bucket.pieces[offset] = {{first, bucket.views.size()}, count};
        state_->owned_elements += count;
      }
      state_->buckets.push_back(std::move(bucket));
    }
  } catch (...) {
    failure = "building rank " + std::to_string(group.rank()) + "'s flat buffers failed: " + HandledExceptionText();
  }
  // The optimizers differ per rank (each gets its own pieces), so a factory
  // may fail on some ranks only: the ranks agree on the outcome before any
  // of them registers the hook, and all fail alike.
  std::vector<internal::ReplicaEntry> built;  // the slices' kind, rates and options
  if (failure.empty()) {
    try {
      const nn::optim::Optimizer* first = nullptr;
      for (State::Bucket& bucket : state_->buckets) {
        if (bucket.views.empty()) continue;
        // Each slice's optimizer over the same groups, holding its views
        // (a group may be empty); the view order within a group is the
        // bucket's, which StepPiece does not depend on.
        std::vector<size_t> view_group;
        for (size_t view_param : bucket.view_param) view_group.push_back(state_->group_of[view_param]);
        const std::vector<nn::optim::ParamGroup> shard = state_->GroupsOf(bucket.views, view_group);
        bucket.optimizer = make(shard);
        if (bucket.optimizer == nullptr) throw std::invalid_argument("the factory returned null");
        if (const std::string wrong = HoldsGroups(*bucket.optimizer, shard, hint); !wrong.empty()) {
          throw std::invalid_argument(wrong);
        }
        if (first == nullptr) first = bucket.optimizer.get();
      }
      // The rates and options, the same in every slice (set_lr, the
      // consolidated keys); a rank that owns no element (more ranks than
      // cache lines of parameters) reads them off an optimizer of everything.
      std::unique_ptr<nn::optim::Optimizer> probe;
      if (first == nullptr) {
        probe = make(groups);
        if (probe == nullptr) throw std::invalid_argument("the factory returned null");
        if (const std::string wrong = HoldsGroups(*probe, groups, hint); !wrong.empty()) {
          throw std::invalid_argument(wrong);
        }
        first = probe.get();
      }
      for (size_t k = 0; k < groups.size(); ++k) state_->lrs.push_back(first->lr(k));
      state_->options = OptionsOf(*first, state_->whole_members);
      for (auto& [key, value] : internal::SharedOptimizerOptions(first->StateDict())) {
        built.push_back({"option", key, value});
      }
    } catch (...) {
      failure = "building the optimizer of rank " + std::to_string(group.rank()) + "'s slices failed: " +
                HandledExceptionText();
    }
  }
  const std::vector<std::string> outcomes = group.AllGatherObject(failure);
  for (size_t r = 0; r < outcomes.size(); ++r) {
    if (!outcomes[r].empty()) {
      throw std::invalid_argument("OverlappedZeroOptimizer on rank " + std::to_string(r) + ": " + outcomes[r]);
    }
  }
  // Each rank's factory ran on its own: one that built another kind of
  // optimizer, or another rate, would step its slices unlike the others'
  // and all-gather the result into every replica.
  internal::VerifyReplicas(group, built,
                           "OverlappedZeroOptimizer: the ranks' slice optimizers differ (every rank's factory must "
                           "build the same kind of optimizer, with the same rates and options).");

  std::shared_ptr<State> state = state_;
  CommHook hook = CommHook::OnLocalGradients([state](ProcessGroup& pg, GradBucket& grad_bucket) {
    const size_t index = grad_bucket.index();
    const std::vector<Tensor>& params = grad_bucket.parameters();
    // The flat buffer must still be the parameters' memory.
    std::string wrong;
    if (state->destroyed.load() && !state->refused.empty()) {
      wrong = "this optimizer's construction failed after the hook was registered (" + state->refused +
              "), and DistributedDataParallel keeps its hook; build a new wrapper for another optimizer";
    } else if (state->destroyed.load()) {
      // DDP keeps a hook from its first backward on: without this the
      // slices would go on stepping inside each backward (and .grad would
      // keep this rank's own gradient), under an optimizer built to replace
      // this one too.
      wrong = "the optimizer whose step this hook runs was destroyed, and DistributedDataParallel keeps its hook "
              "after the first backward; keep the optimizer alive while the wrapper trains, or build a new "
              "wrapper for another optimizer";
    } else if (index >= state->buckets.size()) {
      wrong = "bucket " + std::to_string(index) + " did not exist when the optimizer was built";
    } else {
      const State::Bucket& bucket = state->buckets[index];
      const char* flat = static_cast<const char*>(bucket.flat.data_ptr());
      const size_t elem = nn::ElementSize(bucket.flat.dtype());
      bool same = bucket.params.size() == params.size() && bucket.offsets == grad_bucket.offsets();
      for (size_t k = 0; same && k < params.size(); ++k) {
        same = bucket.params[k] == params[k].impl() &&
               params[k].data_ptr() == flat + static_cast<size_t>(bucket.offsets[k]) * elem;
      }
      if (!same) {
        wrong = "the parameters of bucket " + std::to_string(index) +
                " no longer lie in the optimizer's flat buffer (did Module::To, or something else, give "
                "them new memory after it was built?); build the optimizer after moving the model";
      }
    }
    if (!wrong.empty()) {
      // The peers may already wait in this bucket's reduction: stop them.
      const std::string message = "OverlappedZeroOptimizer on rank " + std::to_string(pg.rank()) + ": " + wrong;
      pg.Abort(transport::FailedPreconditionError(message));
      throw std::logic_error(message);
    }
    const Tensor grads = grad_bucket.buffer();
    const Tensor out = state->buckets[index].flat;
    // Averaged as DDP with no hook averages (internal::PlanNoHookAverage):
    // inside the reduction's last fold, or, in f16 (whose ranks' sum can
    // pass 65504 where each gradient and the average do not) and under
    // Join (the ranks still active), each rank's gradients divided first
    // and summed.
    const internal::NoHookAverage plan = internal::PlanNoHookAverage(grad_bucket.divisor(), pg.size(), grads.dtype());
    const transport::ReduceOp op = plan.op;
    const double pre_scale = plan.pre_scale;
    CollectiveDescription d{"zero_step bucket " + std::to_string(index), grads.dtype(),
                            grads.shape(), -1, op, true};
    return pg.Run(d, [state, grads, out, params, index, last = grad_bucket.is_last(), op,
                      pre_scale](transport::Communicator* comm, transport::Deadline deadline) {
      Tensor send = grads;
      if (pre_scale != 1.0) {
        // A copy: the bucket may be .grad itself, which keeps this rank's
        // own gradient until Step.
        send = nn::Empty(grads.shape(), {.dtype = grads.dtype(), .device = grads.device()});
        internal::ScaleTensor(send, grads, pre_scale);
      }
      const transport::Communicator::SliceFn apply = [&](const void* reduced, void*, size_t offset,
                                                         size_t count) {
        state->StepPiece(index, reduced, static_cast<int64_t>(offset), static_cast<int64_t>(count));
        return transport::Status::Ok();
      };
      // The group has more than one rank here (one rank runs no hook).
      const transport::Status status = comm->AllReduceThrough(
          send.data_ptr(), out.data_ptr(), static_cast<size_t>(grads.numel()),
          ToTransportType(grads.dtype()), op, apply, internal::Within(deadline));
      if (!status.ok()) return status;
      for (const Tensor& p : params) p.storage()->BumpVersion();
      if (last) {
        std::lock_guard<std::mutex> lock(state->mu);
        ++state->steps;
      }
      return transport::Status::Ok();
    });
  });
  // DDP may refuse the hook on this rank alone (one registered on it
  // before, a backward only it ran): the ranks agree on the registration
  // too, so that none trains with the hook while a peer has none. A rank
  // that registered it before learning of a peer's refusal keeps a hook
  // that refuses to run, naming the refusal.
  std::string registering;
  try {
    ddp.RegisterCommHook(hook.WithFixedBuckets().WithoutGradWriteBack());
  } catch (...) {
    registering = "registering the communication hook failed: " + HandledExceptionText();
  }
  try {
    const std::vector<std::string> registered = group.AllGatherObject(registering);
    for (size_t r = 0; r < registered.size(); ++r) {
      if (!registered[r].empty()) {
        throw std::logic_error("OverlappedZeroOptimizer on rank " + std::to_string(r) + ": " + registered[r]);
      }
    }
  } catch (...) {
    state_->refused = HandledExceptionText();
    state_->destroyed = true;
    throw;
  }
  for (const auto& [p, view] : moves) p.SetData(view);
}

OverlappedZeroOptimizer::~OverlappedZeroOptimizer() {
  if (state_ != nullptr) state_->destroyed = true;
}

void OverlappedZeroOptimizer::Step() {
  // Checked on one rank too (where DDP counts synchronizing forwards), so
  // that a loop this refuses on N ranks is refused on one, and the reverse.
  if (state_->ddp->group_iterations() == state_->iterations_ended) {
    // A backward that failed (the group aborted; say why) or ran under
    // NoSync, or none: clearing the gradients now would drop what NoSync
    // accumulated.
    if (const transport::Status reason = state_->group->aborted_reason(); !reason.ok()) {
      throw DistributedError(reason);
    }
    throw std::logic_error(
        "OverlappedZeroOptimizer::Step: no synchronizing backward ran since the last Step() (the update "
        "runs inside that backward; after a backward under NoSync, run the synchronizing one first); the "
        "gradients are left as they are");
  }
  if (state_->whole != nullptr) {
    state_->whole->Step();
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->steps;
  }
  ZeroGrad();
  state_->iterations_ended = state_->ddp->group_iterations();
}

void OverlappedZeroOptimizer::ZeroGrad() {
  for (const Tensor& p : state_->params) p.set_grad(Tensor());
}

size_t OverlappedZeroOptimizer::num_groups() const { return state_->group_options.size(); }

std::vector<nn::optim::LrTarget> OverlappedZeroOptimizer::LrTargets() {
  std::vector<nn::optim::LrTarget> targets;
  for (size_t k = 0; k < num_groups(); ++k) {
    targets.push_back({.get = [this, k] { return lr(k); }, .set = [this, k](double rate) { set_lr(k, rate); }});
  }
  return targets;
}

double OverlappedZeroOptimizer::lr() const { return lr(0); }

double OverlappedZeroOptimizer::lr(size_t group) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (group >= state_->lrs.size()) {
    throw std::out_of_range("OverlappedZeroOptimizer::lr: no param group " + std::to_string(group) + " of " +
                            std::to_string(state_->lrs.size()));
  }
  return state_->lrs[group];
}

void OverlappedZeroOptimizer::set_lr(double lr) {
  if (num_groups() != 1) {
    throw std::logic_error("OverlappedZeroOptimizer::set_lr: " + std::to_string(num_groups()) +
                           " param groups; one rate for all would lose their ratios: set each group's with "
                           "set_lr(group, lr)");
  }
  set_lr(0, lr);
}

void OverlappedZeroOptimizer::set_lr(size_t group, double lr) {
  if (group >= num_groups()) {
    throw std::out_of_range("OverlappedZeroOptimizer::set_lr: no param group " + std::to_string(group) + " of " +
                            std::to_string(num_groups()));
  }
  if (!(lr >= 0) || !std::isfinite(lr)) {
    throw std::invalid_argument("OverlappedZeroOptimizer::set_lr: rate " + std::to_string(lr) +
                                " must be finite and >= 0");
  }
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->lrs[group] = lr;
  if (state_->whole != nullptr) state_->whole->set_lr(group, lr);
  for (State::Bucket& bucket : state_->buckets) {
    if (bucket.optimizer != nullptr) bucket.optimizer->set_lr(group, lr);
  }
}

int64_t OverlappedZeroOptimizer::steps() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->steps;
}

int64_t OverlappedZeroOptimizer::owned_elements() const { return state_->owned_elements; }

namespace {

// Records of a rank's state pieces, for GatherObject: per entry its
// parameter, slot, offset in the parameter, dtype, element count and bytes.
void Put(std::string& out, const void* data, size_t bytes) {
  out.append(static_cast<const char*>(data), bytes);
}
template <typename T>
void PutValue(std::string& out, T value) {
  Put(out, &value, sizeof(value));
}
void PutString(std::string& out, const std::string& s) {
  PutValue<uint64_t>(out, s.size());
  out += s;
}
struct Reader {
  const std::string& in;
  size_t at = 0;
  void Get(void* data, size_t bytes) {
    if (at + bytes > in.size()) throw std::runtime_error("OverlappedZeroOptimizer: a truncated state record");
    std::memcpy(data, in.data() + at, bytes);
    at += bytes;
  }
  template <typename T>
  T Value() {
    T value;
    Get(&value, sizeof(value));
    return value;
  }
  std::string String() {
    const uint64_t n = Value<uint64_t>();
    std::string s(n, '\0');
    Get(s.data(), n);
    return s;
  }
};

// "state.<name>.<slot>" -> slot, for a key of parameter `name`; else "".
std::string SlotOf(const std::string& key, const std::string& name) {
  const std::string prefix = "state." + name + ".";
  if (key.size() <= prefix.size() || key.compare(0, prefix.size(), prefix) != 0) return "";
  return key.substr(prefix.size());
}

}  // namespace

nn::optim::NamedTensors OverlappedZeroOptimizer::ConsolidatedStateDict(int to) {
  State& s = *state_;
  if (s.whole != nullptr) {
    if (to != 0) {
      throw std::invalid_argument("OverlappedZeroOptimizer::ConsolidatedStateDict: rank " + std::to_string(to) +
                                  " is not in a group of 1");
    }
    return s.whole->StateDict();
  }
  ProcessGroup& pg = *s.group;
  // The ranks agree on `to` first: a rank whose `to` was out of range threw
  // alone and left the others waiting in the gather until the group's
  // timeout, and gathers to different roots did not pair.
  const std::vector<std::string> targets = pg.AllGatherObject(std::to_string(to));
  for (size_t r = 1; r < targets.size(); ++r) {
    if (targets[r] == targets[0]) continue;
    throw std::invalid_argument("OverlappedZeroOptimizer::ConsolidatedStateDict: rank 0 passed to = " + targets[0] +
                                " and rank " + std::to_string(r) + " passed to = " + targets[r] +
                                "; every rank must name the same receiving rank");
  }
  if (to < 0 || to >= pg.size()) {
    throw std::invalid_argument("OverlappedZeroOptimizer::ConsolidatedStateDict: rank " + std::to_string(to) +
                                " is not in a group of " + std::to_string(pg.size()));
  }
  std::string mine;
  try {
    std::lock_guard<std::mutex> lock(s.mu);
    for (const State::Bucket& bucket : s.buckets) {
      if (bucket.optimizer == nullptr) continue;
      for (const auto& [key, value] : bucket.optimizer->StateDict()) {
        for (size_t j = 0; j < bucket.views.size(); ++j) {
          const std::string slot = SlotOf(key, bucket.views[j].first);
          if (slot.empty() || slot.find('.') != std::string::npos) continue;
          const Tensor t = value.To(nn::kCPU).Contiguous();
          PutString(mine, s.names[bucket.view_param[j]]);
          PutString(mine, slot);
          PutValue<int64_t>(mine, bucket.view_offset[j]);
          PutValue<int32_t>(mine, static_cast<int32_t>(t.dtype()));
          PutValue<int64_t>(mine, t.numel());
          Put(mine, t.data_ptr(), t.nbytes());
        }
      }
    }
  } catch (...) {
    // The peers are about to wait for this rank's record in the gather:
    // tell them instead of letting them wait out the timeout.
    pg.Abort(transport::AbortedError("OverlappedZeroOptimizer::ConsolidatedStateDict failed on rank " +
                                     std::to_string(pg.rank()) + ": " + HandledExceptionText()));
    throw;
  }
  const std::vector<std::string> all = pg.GatherObject(mine, to);
  if (pg.rank() != to) return {};
  // Per parameter and slot, the pieces put back in place ("step", the same
  // in every piece, taken once); in the unsharded optimizer's order.
  // Slots in the order the optimizer lists them (the first record's).
  struct Entry {
    std::string slot;
    Tensor whole;
    int64_t filled = 0;
  };
  std::vector<std::vector<Entry>> entries(s.params.size());
  for (const std::string& blob : all) {
    Reader in{blob};
    while (in.at < blob.size()) {
      const std::string name = in.String(), slot = in.String();
      const int64_t offset = in.Value<int64_t>();
      const auto dtype = static_cast<nn::DType>(in.Value<int32_t>());
      const int64_t numel = in.Value<int64_t>();
      const size_t i = static_cast<size_t>(std::find(s.names.begin(), s.names.end(), name) - s.names.begin());
      if (i == s.names.size()) throw std::runtime_error("OverlappedZeroOptimizer: state of unknown parameter `" + name + "`");
      auto it = std::find_if(entries[i].begin(), entries[i].end(),
                             [&](const Entry& e) { return e.slot == slot; });
      if (it == entries[i].end()) it = entries[i].insert(entries[i].end(), Entry{slot, Tensor(), 0});
      Tensor& whole = it->whole;
      const size_t bytes = static_cast<size_t>(numel) * nn::ElementSize(dtype);
      if (slot == "step") {
        whole = nn::Empty({}, {.dtype = dtype});
        in.Get(whole.data_ptr(), bytes);
        continue;
      }
      if (!whole.defined()) whole = nn::Empty(s.params[i].shape(), {.dtype = dtype});
      if (offset < 0 || offset + numel > whole.numel() || whole.dtype() != dtype) {
        throw std::runtime_error("OverlappedZeroOptimizer: a piece of `state." + name + "." + slot +
                                 "` does not fit its parameter");
      }
      in.Get(static_cast<char*>(whole.data_ptr()) + static_cast<size_t>(offset) * nn::ElementSize(dtype), bytes);
      it->filled += numel;
    }
  }
  nn::optim::NamedTensors out;
  {
    // One group: "lr" apart, as the unsharded optimizer saves it; several:
    // each group's rate among its options.
    std::lock_guard<std::mutex> lock(s.mu);
    const auto rate = [](double lr) { return nn::FromVector({lr}, {}, {.dtype = nn::DType::kFloat64}); };
    if (s.lrs.size() == 1) out.emplace_back("lr", rate(s.lrs[0]));
    for (const auto& [key, value] : s.options) {
      Tensor entry = value.Clone();
      for (size_t k = 0; k < s.lrs.size(); ++k) {
        if (key == "param_groups." + std::to_string(k) + ".lr") entry = rate(s.lrs[k]);
      }
      out.emplace_back(key, entry);
    }
  }
  for (const size_t i : s.order) {
    for (const auto& [slot, whole, filled] : entries[i]) {
      if (slot != "step" && filled != s.params[i].numel()) {
        throw std::runtime_error("OverlappedZeroOptimizer::ConsolidatedStateDict: the ranks hold " +
                                 std::to_string(filled) + " of the " +
                                 std::to_string(s.params[i].numel()) + " elements of `state." +
                                 s.names[i] + "." + slot + "`");
      }
      out.emplace_back("state." + s.names[i] + "." + slot, whole);
    }
  }
  return out;
}

// A refusal of the state (std::invalid_argument, from checks every rank
// makes alike on the whole state) changes nothing anywhere. Any other
// failure is this rank's own (out of memory in a copy, a check or a
// slice's load): its peers, which loaded, would wait for it at the next
// backward until the timeout, so on more than one rank it ends the group
// with the reason and goes on as it came.
void OverlappedZeroOptimizer::LoadStateDict(const nn::optim::NamedTensors& state) try {
  State& s = *state_;
  // With several groups, the probes and each slice's optimizer below hold
  // only some of each group's parameters, so they cannot compare the
  // state's groups with the whole's: that is done here, naming the group
  // (on one rank too, for the same message), and each of them gets the
  // state's groups with its own members in them.
  const size_t num_groups = s.group_options.size();
  try {
    nn::optim::NamedTensors checked;
    for (const auto& [key, value] : state) {
      if (key.rfind("param_groups.", 0) == 0) checked.emplace_back(key, value);
    }
    internal::RewriteGroups(checked, num_groups, s.whole_members, s.whole_members);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("OverlappedZeroOptimizer::LoadStateDict: ") + e.what());
  }
  // Every "state." key must name a trained parameter and fit its size.
  nn::optim::NamedParameters all;
  for (size_t i = 0; i < s.params.size(); ++i) all.emplace_back(s.names[i], s.params[i]);
  std::vector<std::vector<std::pair<std::string, Tensor>>> by_param(s.params.size());
  const Tensor* lr = nullptr;
  nn::optim::NamedTensors kept;  // `state` without the frozen parameters' entries (for one rank)
  // The module's parameters this optimizer does not train, and whether the
  // state holds each one's step as an i64 0 (never updated): the only case
  // in which its other entries (slots an optimizer holds from the start,
  // Adagrad's sum) are let through.
  nn::optim::NamedParameters untrained;
  const std::set<std::string> trained(s.names.begin(), s.names.end());
  for (auto& [name, p] : s.ddp->module()->NamedParameters()) {
    if (trained.count(name) == 0) untrained.emplace_back(name, p);
  }
  const auto never_updated = [&state](const std::string& step_key) {
    for (const auto& [key, value] : state) {
      if (key == step_key) {
        return value.defined() && value.dtype() == nn::DType::kInt64 && value.numel() == 1 &&
               value.To(nn::kCPU).data<int64_t>()[0] == 0;
      }
    }
    return false;
  };
  for (const auto& [key, value] : state) {
    if (key.compare(0, 6, "state.") != 0 || nn::optim::ParameterOfStateKey(key, all) >= 0) {
      kept.emplace_back(key, value);
    }
    if (key == "lr") {
      lr = &value;
      continue;
    }
    if (key.compare(0, 6, "state.") != 0) continue;
    if (!value.defined()) {
      throw std::invalid_argument("OverlappedZeroOptimizer::LoadStateDict: `" + key + "` is undefined");
    }
    std::string slot;
    const int found = nn::optim::ParameterOfStateKey(key, all, &slot);
    const size_t best = found < 0 ? s.params.size() : static_cast<size_t>(found);
    if (best == s.params.size()) {
      // A frozen parameter in a plain optimizer's state: held there, never
      // updated (its step is 0, an i64 scalar as StateDict writes it, and
      // PyTorch's 0-d tensor), nothing to load here.
      const bool is_step = key.size() > 5 && key.compare(key.size() - 5, 5, ".step") == 0;
      if (is_step && value.defined() && value.dtype() == nn::DType::kInt64 && value.numel() == 1 &&
          value.To(nn::kCPU).data<int64_t>()[0] == 0) {
        if (value.shape() == nn::Shape{}) continue;
        throw std::invalid_argument("OverlappedZeroOptimizer::LoadStateDict: `" + key + "` is i64 " +
                                    nn::ShapeToString(value.shape()) +
                                    ", expected i64 [] (the step of a parameter this optimizer does not train)");
      }
      // A slot held from the start (Adagrad's sum), which a plain
      // optimizer saves for a parameter it never updated: nothing to load
      // either, but it must fit that parameter as the plain one checks it.
      std::string frozen_slot;
      const int frozen = nn::optim::ParameterOfStateKey(key, untrained, &frozen_slot);
      if (!is_step && frozen >= 0 && frozen_slot.find('.') == std::string::npos &&
          never_updated("state." + untrained[frozen].first + ".step")) {
        const Tensor& p = untrained[frozen].second;
        if (value.shape() == p.shape() && nn::IsFloating(value.dtype())) continue;
        throw std::invalid_argument("OverlappedZeroOptimizer::LoadStateDict: `" + key + "` is " +
                                    std::string(nn::DTypeName(value.dtype())) + " " + nn::ShapeToString(value.shape()) +
                                    ", its parameter " + nn::ShapeToString(p.shape()) +
                                    " (a slot of a parameter this optimizer does not train, never updated)");
      }
      throw std::invalid_argument("OverlappedZeroOptimizer::LoadStateDict: `" + key +
                                  "` names no trained parameter");
    }
    if (slot != "step" && value.numel() != s.params[best].numel()) {
      throw std::invalid_argument("OverlappedZeroOptimizer::LoadStateDict: `" + key + "` holds " +
                                  std::to_string(value.numel()) + " elements, its parameter " +
                                  std::to_string(s.params[best].numel()));
    }
    // Contiguous once here: the slices' pieces below are views of it, all
    // alive until every slice has checked them (one copy per entry that
    // is not contiguous, not one per view).
    by_param[best].emplace_back(slot, slot == "step" ? value : value.Contiguous());
  }
  if (s.whole != nullptr) {
    // One rank: the optimizer of the trained parameters loads the state as
    // it is, less a frozen parameter's untouched step (which the loop above
    // let through, as the slices' optimizers skip it on N ranks).
    s.whole->LoadStateDict(kept);
    std::lock_guard<std::mutex> lock(s.mu);
    for (size_t k = 0; k < s.lrs.size(); ++k) s.lrs[k] = s.whole->lr(k);
    return;
  }
  // Every rank checks the whole state the way the unsharded optimizer
  // would, so that a bad state fails on every rank alike before any slice
  // changes; each slice's load then only cuts. One parameter at a time (a
  // probe optimizer of that parameter, given the entries that are not
  // per-parameter and that parameter's), so that the check holds one
  // parameter's state at most, not a second copy of the whole.
  nn::optim::NamedTensors shared_entries, options;
  for (const auto& [key, value] : state) {
    if (key.compare(0, 6, "state.") != 0) shared_entries.emplace_back(key, value);
    if (key.rfind("group.", 0) == 0 || key.rfind("param_groups.", 0) == 0) options.emplace_back(key, value);
  }
  std::unique_ptr<nn::optim::Optimizer> probe;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const std::vector<nn::optim::ParamGroup> groups = s.GroupsOf({all[i]}, {s.group_of[i]});
    std::vector<std::vector<std::string>> members(num_groups);
    members[s.group_of[i]].push_back(s.names[i]);
    nn::optim::NamedTensors entries = shared_entries;
    internal::RewriteGroups(entries, num_groups, s.whole_members, members);
    for (const auto& [slot, value] : by_param[i]) entries.emplace_back("state." + s.names[i] + "." + slot, value);
    probe = s.make(groups);
    // The factory's fault, not the state's: not a refusal of the state.
    if (probe == nullptr) throw std::logic_error("OverlappedZeroOptimizer::LoadStateDict: the factory returned null");
    // Only the probe's refusal of the state is std::invalid_argument; any
    // other failure (std::bad_alloc, say) goes on as it came.
    try {
      probe->LoadStateDict(entries);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("OverlappedZeroOptimizer::LoadStateDict: ") + e.what());
    }
  }
  // Each slice's entries, checked by its optimizer for every slice before
  // any loads (a check the probes above did not make, or one that fails,
  // as out of memory, then leaves every slice as it was).
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<nn::optim::NamedTensors> by_bucket(s.buckets.size());
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    State::Bucket& bucket = s.buckets[b];
    if (bucket.optimizer == nullptr) continue;
    nn::optim::NamedTensors& pieces = by_bucket[b];
    if (lr != nullptr) pieces.emplace_back("lr", *lr);
    // The options ("group.*", "param_groups.*"), checked above with the
    // probes.
    nn::optim::NamedTensors bucket_options = options;
    internal::RewriteGroups(bucket_options, num_groups, s.whole_members, MembersOf(*bucket.optimizer));
    for (auto& entry : bucket_options) pieces.push_back(std::move(entry));
    for (size_t j = 0; j < bucket.views.size(); ++j) {
      for (const auto& [slot, value] : by_param[bucket.view_param[j]]) {
        const std::string key = "state." + bucket.views[j].first + "." + slot;
        if (slot == "step") {
          pieces.emplace_back(key, value);
        } else {
          const Tensor flat = value.View({value.numel()});
          pieces.emplace_back(key, flat.Narrow(0, bucket.view_offset[j], bucket.views[j].second.numel()));
        }
      }
    }
    try {
      bucket.optimizer->CheckStateDict(pieces);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("OverlappedZeroOptimizer::LoadStateDict: bucket " + std::to_string(b) +
                                  "'s slice: " + e.what());
    }
  }
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    if (s.buckets[b].optimizer != nullptr) s.buckets[b].optimizer->LoadStateDict(by_bucket[b]);
  }
  // The rates and options as loaded (a state saved without options keeps
  // the factory's, and one without "lr" the current rate).
  if (probe != nullptr) {
    if (num_groups > 1 || lr != nullptr) {
      for (size_t k = 0; k < num_groups; ++k) s.lrs[k] = probe->lr(k);
    }
    if (!options.empty()) s.options = OptionsOf(*probe, s.whole_members);
  }
} catch (const std::invalid_argument&) {
  throw;
} catch (...) {
  if (state_->whole == nullptr) {
    state_->group->Abort(transport::AbortedError("OverlappedZeroOptimizer::LoadStateDict failed on rank " +
                                                 std::to_string(state_->group->rank()) + ": " +
                                                 HandledExceptionText()));
  }
  throw;
}

}  // namespace ddp::dist
