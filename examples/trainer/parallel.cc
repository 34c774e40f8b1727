#include "examples/trainer/parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ddp/checkpoint.h"
#include "ddp/comm_hooks.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/overlapped_zero_optimizer.h"
#include "ddp/powersgd_hook.h"
#include "ddp/process_group.h"
#include "ddp/sync_batch_norm.h"
#include "ddp/zero_redundancy_optimizer.h"
#include "nn/autograd/engine.h"

namespace ddp::examples::trainer {

double CommTotals::CommShare() const {
  const double busy = forward_ms + backward_compute_ms + exposed_ms;
  return iterations > 0 && busy > 0 ? backward_comm_ms / busy : NAN;
}

double CommTotals::Overlap() const {
  if (iterations == 0) return NAN;
  return backward_comm_ms > 0 ? overlap_ms / backward_comm_ms : 1.0;
}

namespace {

// Runs `f`, turning a failed collective into the trainer's JobError.
template <typename F>
auto Guarded(const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const dist::DistributedError& e) {
    throw JobError(std::string(what) + ": " + e.what());
  }
}

// --zero: ZeroRedundancyOptimizer, stepped after backward.
// One group without options is sharded as a plain list (the state layout
// of a run without groups); several as groups, each shard's optimizer
// holding this rank's pieces of each group.
class Zero : public Parallel::ShardedOptimizer {
 public:
  Zero(std::vector<nn::optim::ParamGroup> groups, std::shared_ptr<dist::ProcessGroup> pg,
       const Parallel::OptimizerFactory& make)
      : zero_(Build(std::move(groups), std::move(pg), make)) {}
  double lr() const override { return zero_.lr(); }
  // Every group takes the rate (they differ in weight decay only); a bad
  // rate is refused by group 0's before any changes.
  void set_lr(double lr) override {
    for (size_t k = 0; k < zero_.num_groups(); ++k) zero_.set_lr(k, lr);
  }
  void Step() override { Guarded("optimizer step", [&] { zero_.Step(); }); }
  void ZeroGrad() override { zero_.ZeroGrad(); }
  nn::optim::NamedTensors Consolidate() override {
    return Guarded("gathering the optimizer state", [&] { return zero_.ConsolidatedStateDict(0); });
  }
  // Collective: every shard is checked before any is loaded, so a state
  // that some rank's shard refuses fails every rank, naming it, instead of
  // leaving the others loaded and waiting in their next collective.
  void Load(const nn::optim::NamedTensors& whole) override {
    Guarded("loading the optimizer state", [&] { zero_.LoadStateDict(whole); });
  }

 private:
  static dist::ZeroRedundancyOptimizer Build(std::vector<nn::optim::ParamGroup> groups,
                                             std::shared_ptr<dist::ProcessGroup> pg,
                                             const Parallel::OptimizerFactory& make) {
    if (groups.size() == 1 && groups.front().options.empty()) {
      return dist::ZeroRedundancyOptimizer(
          std::move(groups.front().params), std::move(pg), [make](nn::optim::NamedParameters shard) {
            return make({nn::optim::ParamGroup{std::move(shard), {}}});
          });
    }
    return dist::ZeroRedundancyOptimizer(std::move(groups), std::move(pg), make);
  }

  dist::ZeroRedundancyOptimizer zero_;
};

// --zero --zero_overlap: OverlappedZeroOptimizer, which needs the DDP
// wrapper, made later (Attach): until Bind it holds the rate and a loaded
// state, checked at once against an optimizer of every parameter. Over the
// groups Shard was given (one without options keeps the state layout of a
// plain list, as the factory then builds a plain optimizer).
class Overlapped : public Parallel::ShardedOptimizer {
 public:
  // The factory's rate, read off an optimizer of the first parameter alone
  // in its group (cheaper than one of all).
  Overlapped(std::vector<nn::optim::ParamGroup> groups, Parallel::OptimizerFactory make)
      : groups_(std::move(groups)), make_(std::move(make)), lr_(make_(FirstParameterAlone())->lr()) {}

  void Bind(dist::DistributedDataParallel& ddp) {
    zero_ = std::make_unique<dist::OverlappedZeroOptimizer>(ddp, groups_, make_);
    if (pending_) zero_->LoadStateDict(*pending_);
    pending_.reset();
    set_lr(lr_);  // the latest: loaded, or set by a scheduler since
  }
  double lr() const override { return zero_ ? zero_->lr() : lr_; }
  // Every group takes the rate (they differ in weight decay only); a bad
  // rate is refused by group 0's before any changes.
  void set_lr(double lr) override {
    if (zero_) {
      for (size_t k = 0; k < zero_->num_groups(); ++k) zero_->set_lr(k, lr);
    }
    lr_ = lr;
  }
  void Step() override { Guarded("optimizer step", [&] { Bound().Step(); }); }
  void ZeroGrad() override { Bound().ZeroGrad(); }
  nn::optim::NamedTensors Consolidate() override {
    return Guarded("gathering the optimizer state", [&] { return Bound().ConsolidatedStateDict(0); });
  }
  void Load(const nn::optim::NamedTensors& whole) override {
    if (zero_) {
      zero_->LoadStateDict(whole);
      return;
    }
    auto probe = make_(groups_);
    probe->LoadStateDict(whole);
    // The loaded rate is the one to continue with (a scheduler, if any,
    // sets its own after).
    lr_ = probe->lr();
    pending_ = whole;
  }

 private:
  dist::OverlappedZeroOptimizer& Bound() {
    if (!zero_) throw std::logic_error("--zero_overlap: the optimizer is used before the model was attached");
    return *zero_;
  }

  // The groups with their options, only the first parameter in its group.
  std::vector<nn::optim::ParamGroup> FirstParameterAlone() const {
    std::vector<nn::optim::ParamGroup> out;
    bool taken = false;
    for (const nn::optim::ParamGroup& g : groups_) {
      out.push_back({{}, g.options});
      if (!taken && !g.params.empty()) out.back().params.push_back(g.params.front());
      taken = taken || !g.params.empty();
    }
    return out;
  }

  std::vector<nn::optim::ParamGroup> groups_;
  Parallel::OptimizerFactory make_;
  double lr_;
  std::optional<nn::optim::NamedTensors> pending_;
  std::unique_ptr<dist::OverlappedZeroOptimizer> zero_;
};

class DdpParallel : public Parallel {
 public:
  DdpParallel(std::shared_ptr<dist::ProcessGroup> pg, std::string trace_dir)
      : pg_(std::move(pg)), trace_dir_(std::move(trace_dir)) {}

  ~DdpParallel() override {
    ddp_.reset();  // before the group: it waits for its collectives
  }

  int rank() const override { return pg_->rank(); }
  int world_size() const override { return pg_->size(); }

  void Prepare(std::shared_ptr<nn::modules::Module>& model, const TrainConfig& config) override {
    if (config.sync_bn) model = dist::ConvertSyncBatchNorm(model, pg_);
    // PyTorch's defaults (rank 1, warm-up of 1000 iterations unless
    // --powersgd_start_step says otherwise).
    if (config.comm_hook == "powersgd") {
      powersgd_ = std::make_shared<dist::PowerSgdState>(
          dist::PowerSgdOptions{.start_iteration = config.powersgd_start_step});
    }
  }

  void Attach(std::shared_ptr<nn::modules::Module> model, const TrainConfig& config,
              int64_t step, const std::vector<int64_t>& bucket_order) override {
    dist::DdpOptions o;
    o.bucket_cap_mb = config.bucket_cap_mb;
    // The resumed run's buckets, so that its first steps sum the gradients
    // as the interrupted run's did; an order for another model is dropped
    // (the checkpoint's model check reports a real mismatch).
    size_t trainable = 0;
    for (const auto& [name, p] : model->NamedParameters()) trainable += p.requires_grad() ? 1 : 0;
    std::vector<char> seen(trainable, 0);
    bool usable = bucket_order.size() == trainable;
    for (size_t k = 0; usable && k < bucket_order.size(); ++k) {
      const int64_t i = bucket_order[k];
      usable = i >= 0 && static_cast<uint64_t>(i) < trainable && !seen[static_cast<size_t>(i)];
      if (usable) seen[static_cast<size_t>(i)] = 1;
    }
    if (usable) o.bucket_order = bucket_order;
    o.find_unused_parameters = config.find_unused_parameters;
    o.process_group = pg_;
    // The folder was checked (and made) at the trainer's setup; DDP writes
    // the trace when it is destroyed.
    if (config.trace && !trace_dir_.empty()) o.trace_prefix = trace_dir_ + "/trace_";
    Guarded("DistributedDataParallel", [&] {
      ddp_ = std::make_unique<dist::DistributedDataParallel>(std::move(model), o);
    });
    if (config.comm_hook == "fp16") ddp_->RegisterCommHook(dist::hooks::Fp16CompressHook());
    if (config.comm_hook == "bf16") ddp_->RegisterCommHook(dist::hooks::Bf16CompressHook());
    if (powersgd_ != nullptr) {
      // A resumed run's checkpoint gave the state its iteration and Q's;
      // one without them (saved under another hook) leaves the iteration at
      // 0, and the warm-up is then counted from the run's first step.
      if (powersgd_->iteration() == 0 && step > 0) {
        powersgd_->LoadStateDict({{"powersgd.iteration", nn::FromVectorOf<int64_t>({step}, {})}},
                                 ddp_->module()->NamedParameters());
      }
      ddp_->RegisterCommHook(dist::hooks::PowerSgdHook(powersgd_));
    }
    if (overlapped_ != nullptr) {
      Guarded("the overlapped optimizer", [&] { overlapped_->Bind(*ddp_); });
      overlapped_ = nullptr;  // bound; Shard's caller owns it
    }
  }

  std::vector<int64_t> BucketOrder() const override {
    return ddp_ != nullptr ? ddp_->BucketOrder() : std::vector<int64_t>{};
  }

  dist::PowerSgdState* PowerSgd() const override { return powersgd_.get(); }

  nn::Tensor Forward(const nn::Tensor& input) override {
    return Guarded("forward", [&] { return ddp_->Forward(input); });
  }

  void Backward(const nn::Tensor& loss) override {
    Guarded("backward", [&] { nn::Backward(loss); });
  }

  void BroadcastBuffers() override {
    if (pg_->size() == 1) return;
    // A few small tensors per BatchNorm layer, at evaluations only: one
    // broadcast each is cheap enough.
    Guarded("broadcasting the buffers", [&] {
      for (const auto& [name, b] : ddp_->module()->NamedBuffers()) pg_->Broadcast(b, 0, name).Wait();
    });
  }

  std::unique_ptr<ShardedOptimizer> Shard(std::vector<nn::optim::ParamGroup> groups,
                                          const OptimizerFactory& make, bool overlap) override {
    overlapped_ = nullptr;
    if (overlap) {
      auto fused = std::make_unique<Overlapped>(std::move(groups), make);
      overlapped_ = fused.get();
      return fused;
    }
    return std::make_unique<Zero>(std::move(groups), pg_, make);
  }
  std::unique_ptr<NoSyncScope> NoSync() override {
    struct Scope : NoSyncScope {
      explicit Scope(dist::DistributedDataParallel& ddp) : guard(ddp) {}
      dist::NoSyncGuard guard;
    };
    return std::make_unique<Scope>(*ddp_);
  }

  void SumAcrossRanks(std::vector<double>& values) override {
    if (pg_->size() == 1 || values.empty()) return;
    nn::Tensor t = nn::FromVector(values, {static_cast<int64_t>(values.size())},
                                  {.dtype = nn::DType::kFloat64});
    Guarded("metric all-reduce", [&] { pg_->AllReduce(t).Wait(); });
    values = t.ToVector<double>();
  }

  std::string ShareFromLead(std::string value) override {
    if (pg_->size() > 1) Guarded("sharing rank 0's data", [&] { pg_->BroadcastObject(&value, 0); });
    return value;
  }

  std::vector<std::string> GatherFromEveryRank(const std::string& value) override {
    if (pg_->size() == 1) return {value};
    return Guarded("gathering every rank's data", [&] { return pg_->AllGatherObject(value); });
  }

  std::string RunOnLead(const std::function<void(const std::atomic<bool>& stop)>& work,
                        std::chrono::milliseconds timeout, const std::string& late,
                        std::chrono::milliseconds stop_grace, bool discardable) override {
    // The library words the deadline's outcome as "<task> did not finish
    // within <option> (N ms)"; `task` is this one's own, so that outcome
    // is told from an error of `work`.
    static const std::string kTask = "rank 0's part";
    const std::string outcome = Guarded("waiting for rank 0", [&] {
      return dist::internal::RunOnRootWhileOthersWait(*pg_, 0, work, timeout, std::chrono::seconds(1),
                                                      "the trainer's wait for rank 0", kTask, "its deadline",
                                                      "rank 0 did not finish its part", stop_grace,
                                                      discardable ? dist::internal::IfTheGroupFails::kStopTheWork
                                                                  : dist::internal::IfTheGroupFails::kLetTheWorkFinish);
    });
    if (outcome.rfind(kTask + " did not finish within its deadline", 0) == 0) throw JobError(late);
    return outcome;
  }

  int VoteStop(int signal, bool slow) override {
    const int previous = FinishStopVote();
    if (pg_->size() == 1) {
      slow_ = slow;
      return previous != 0 ? previous : signal;
    }
    // [signal, rank 0's slow]: the largest of each over the ranks.
    vote_ = nn::FromVectorOf(std::vector<int32_t>{signal, rank() == 0 && slow ? 1 : 0}, {2});
    vote_work_ = Guarded("stop vote", [&] { return pg_->AllReduce(vote_, transport::ReduceOp::kMax); });
    return previous;
  }

  int FinishStopVote() override {
    if (!vote_work_.valid()) return 0;
    dist::Work work = std::move(vote_work_);
    vote_work_ = dist::Work();
    Guarded("stop vote", [&] { work.Wait(); });
    const std::vector<int32_t> outcome = vote_.ToVector<int32_t>();
    slow_ = outcome.at(1) != 0;
    return outcome.at(0);
  }

  bool SlowSteps() const override { return slow_; }

  std::string TakeStatsLine(bool every_rank) override {
    if (ddp_ == nullptr) return "";
    const dist::DdpStats s = ddp_->Stats();
    ddp_->ResetStats();
    Add(s);
    // Every rank's wait for the others, so that the line shows the
    // straggler (the rank that waits least) and not only rank 0's view.
    std::vector<std::string> waits;
    if (every_rank && pg_->size() > 1) {
      char mine[32];
      std::snprintf(mine, sizeof(mine), "%.2f", s.peer_wait_ms);
      waits = Guarded("gathering the ranks' statistics", [&] { return pg_->AllGatherObject(mine); });
    }
    if (s.iterations == 0) return "";
    std::string line = s.ToString();
    if (!waits.empty()) {
      line += "; each rank's wait for the others (ms per iteration):";
      for (size_t r = 0; r < waits.size(); ++r) line += " " + std::to_string(r) + ":" + waits[r];
    }
    return line;
  }

  bool CollectivesOnCaller() const override { return pg_ != nullptr && pg_->collectives_on_caller(); }

  CommTotals Totals() override {
    // Leaves DDP's window alone, so that asking mid-run (the trainer does at
    // the end of its warm-up) does not cut the next stats line short.
    CommTotals totals = totals_;
    if (ddp_ != nullptr) AddTo(totals, ddp_->Stats());
    return totals;
  }

  std::string TraceFolder() const override { return trace_dir_; }

 private:
  // Stats are averages over a window; totals are sums.
  void Add(const dist::DdpStats& s) { AddTo(totals_, s); }
  static void AddTo(CommTotals& totals, const dist::DdpStats& s) {
    const double n = static_cast<double>(s.iterations);
    totals.iterations += s.iterations;
    totals.forward_ms += s.forward_ms * n;
    totals.backward_compute_ms += s.backward_compute_ms * n;
    totals.backward_comm_ms += s.backward_comm_ms * n;
    totals.overlap_ms += s.overlap_ms * n;
    totals.exposed_ms += s.exposed_ms * n;
  }

  std::shared_ptr<dist::ProcessGroup> pg_;
  std::string trace_dir_;
  std::unique_ptr<dist::DistributedDataParallel> ddp_;
  std::shared_ptr<dist::PowerSgdState> powersgd_;  // --comm_hook=powersgd
  Overlapped* overlapped_ = nullptr;  // Shard's, until Attach binds it to ddp_
  CommTotals totals_;
  nn::Tensor vote_;     // the stop vote in flight (VoteStop)
  dist::Work vote_work_;
  bool slow_ = false;   // rank 0's `slow` in the last vote that finished
};

}  // namespace

std::unique_ptr<Parallel> JoinJob(const std::string& trace_dir, std::chrono::milliseconds timeout) {
  std::shared_ptr<dist::ProcessGroup> pg = Guarded("cannot join the job", [timeout] {
    dist::ProcessGroupOptions options;
    options.timeout = timeout;
    transport::CommunicatorOptions comm_options;
    comm_options.timeout = timeout;
    return dist::ProcessGroup::CreateFromEnvironment(options, comm_options);
  });
  return std::make_unique<DdpParallel>(std::move(pg), trace_dir);
}

}  // namespace ddp::examples::trainer
