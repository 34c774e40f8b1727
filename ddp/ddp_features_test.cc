// DistributedDataParallel beyond the plain loop, over real processes:
// NoSync accumulation, Join with uneven inputs, unused parameters (with and
// without find_unused_parameters), models that differ across ranks, the
// bucket rebuild, communication hooks, statistics and the trace file.

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "transport/launch/test_spawn.h"

#include "ddp/distributed_data_parallel.h"
#include "ddp/reducer.h"
#include "ddp/replicas.h"
#include "ddp/sync_batch_norm.h"
#include "ddp/testing/ddp_test_util.h"
#include "nn/autograd/engine.h"
#include "nn/autograd/function.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"

namespace ddp::dist {
namespace {

using nn::Tensor;
using nn::modules::Module;
using testing::Branchy;
using testing::RunWorkers;

constexpr int64_t kBatch = 8;

std::shared_ptr<ProcessGroup> Borrow(ProcessGroup& pg) {
  return std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
}

std::shared_ptr<Module> Mlp(uint64_t seed) {
  nn::Generator gen(seed);
  return nn::modules::MakeMlp(gen);
}

// This rank's backwards in a step of `micro` micro-batches per rank, each
// of kBatch samples (rank r's micro-batch j starts at base + (r * micro +
// j) * kBatch), from micro-batch `first` on: all but the last under NoSync,
// each loss scaled by `scale`.
void MicroBatchBackwards(DistributedDataParallel& ddp, int64_t base, int rank, int micro,
                         double scale, int first = 0) {
  const auto& data = testing::FashionMnist();
  for (int j = first; j < micro; ++j) {
    auto [x, y] = testing::Batch(data, base + (rank * micro + j) * kBatch, kBatch);
    if (j < micro - 1) {
      auto guard = ddp.NoSync();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y) * scale);
    } else {
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y) * scale);
    }
  }
}

// One step of the one-process `reference` on the combined batch: `count`
// samples from `base`.
void ReferenceStep(Module& reference, nn::optim::Sgd& opt, int64_t base, int64_t count) {
  opt.ZeroGrad();
  auto [x, y] = testing::Batch(testing::FashionMnist(), base, count);
  nn::Backward(nn::loss::CrossEntropy(reference(x), y));
  opt.Step();
}

// ------------------------------------------------------------- NoSync ----

// Three micro-batches per rank, the first two under NoSync, each loss
// scaled by 1/3: one step equals one step on the combined batch of
// 3 * world * B samples.
void CheckNoSync(ProcessGroup& pg, bool view) {
  const int world = pg.size(), rank = pg.rank();
  constexpr int kMicro = 3, kOuter = 3;
  auto model = Mlp(rank == 0 ? 3 : 50 + rank);
  DistributedDataParallel ddp(model, {.gradient_as_bucket_view = view, .process_group = Borrow(pg)});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto reference = Mlp(3);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  for (int s = 0; s < kOuter; ++s) {
    const int64_t base = s * kMicro * world * kBatch;
    opt.ZeroGrad();
    MicroBatchBackwards(ddp, base, rank, kMicro, 1.0 / kMicro);
    opt.Step();
    ReferenceStep(*reference, ref_opt, base, kMicro * world * kBatch);
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  const std::string what = std::string("NoSync") + (view ? " (views)" : "");
  WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
  WORKER_EXPECT(testing::SameOnAllRanks(pg, testing::HashState(*model)), what + ": replicas differ");
  WORKER_EXPECT(ddp.iterations() == kOuter, what + ": synchronizing iterations " + std::to_string(ddp.iterations()));
}

DDP_TEST_WORKER(no_sync) {
  auto pg = testing::WorkerGroup();
  CheckNoSync(*pg, false);
  CheckNoSync(*pg, true);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, NoSyncAccumulationEqualsOneStepOnTheCombinedBatch) {
  auto run = RunWorkers("no_sync", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Where the group runs CPU collectives on the caller, no bucket is launched
// before every parameter's gradient is in (its all-reduce would hold
// backward until the peers reach it, overlapping nothing); with the
// communication thread the first bucket goes while backward still runs.
// Seen from a hook on every parameter, registered before the wrapper's
// (so it runs first), and a communication hook counting them at each call.
DDP_TEST_WORKER(bucket_launch_order) {
  auto pg = testing::WorkerGroup();
  const char* where = std::getenv("DDP_COLLECTIVE_THREAD");
  const bool together = where != nullptr && std::string(where) == "caller";
  WORKER_EXPECT(pg->collectives_on_caller() == together, "DDP_COLLECTIVE_THREAD was not taken");
  const auto& data = testing::FashionMnist();
  auto model = Mlp(23);
  const std::vector<Tensor> params = model->Parameters();
  size_t accumulated = 0;
  std::vector<nn::HookHandle> handles;
  for (const Tensor& p : params) {
    handles.push_back(p.RegisterPostAccumulateGradHook([&accumulated](const Tensor&) { ++accumulated; }));
  }
  // One bucket per parameter.
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6, .process_group = pg});
  std::vector<size_t> seen;
  ddp.RegisterCommHook([&](ProcessGroup& group, GradBucket& bucket) {
    seen.push_back(accumulated);
    return group.AllReduce(bucket.buffer(), transport::ReduceOp::kAvg, "counting hook");
  });
  for (int s = 0; s < 3; ++s) {  // before and after the buckets' rebuild
    auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
    accumulated = 0;
    seen.clear();
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    WORKER_EXPECT(seen.size() == params.size(), "step " + std::to_string(s) + ": " +
                                                    std::to_string(seen.size()) + " hook calls for " +
                                                    std::to_string(params.size()) + " buckets");
    if (seen.empty()) continue;
    if (together) {
      WORKER_EXPECT(seen.front() == params.size(),
                    "step " + std::to_string(s) + ": with collectives on the caller the first bucket was "
                    "launched when " + std::to_string(seen.front()) + " of " +
                    std::to_string(params.size()) + " gradients were in");
    } else {
      WORKER_EXPECT(seen.front() < params.size(),
                    "step " + std::to_string(s) + ": with the communication thread the first bucket "
                    "waited for every gradient");
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, BucketsLaunchTogetherWhereCollectivesRunOnTheCaller) {
  for (const char* where : {"caller", "comm"}) {
    auto run = RunWorkers("bucket_launch_order", 2, {{"DDP_COLLECTIVE_THREAD", where}});
    EXPECT_TRUE(run.AllSucceeded()) << where << "\n" << testing::AllOutput(run);
  }
}

// Ranks that choose different collective threads (rank 0 caller, rank 1
// the communication thread): SyncBatchNorm's backward all-reduce runs on
// the same group while the buckets of the layer after it are ready. Both
// ranks must issue the buckets at the same point relative to it, so the
// gradients equal those of BatchNorm on the combined batch in one process.
std::shared_ptr<nn::modules::Sequential> NormedMlp(uint64_t seed, std::shared_ptr<ProcessGroup> pg) {
  nn::Generator gen(seed);
  std::shared_ptr<Module> norm;
  if (pg != nullptr) {
    norm = std::make_shared<SyncBatchNorm>(16, nn::modules::BatchNormOptions{}, pg);
  } else {
    norm = std::make_shared<nn::modules::BatchNorm1d>(16);
  }
  return std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<nn::modules::Flatten>(), std::make_shared<nn::modules::Linear>(784, 16, true, gen), norm,
      std::make_shared<nn::modules::ReLU>(), std::make_shared<nn::modules::Linear>(16, 10, true, gen)});
}

DDP_TEST_WORKER(mixed_collective_threads_with_sync_batch_norm) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  WORKER_EXPECT(pg->collectives_on_caller() == (rank == 0), "DDP_COLLECTIVE_THREAD was not taken");
  auto model = NormedMlp(41, pg);
  // One bucket per parameter.
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6, .process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = NormedMlp(41, nullptr);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  for (int s = 0; s < 3; ++s) {  // before and after the buckets' rebuild
    auto [x, y] = testing::Batch(testing::FashionMnist(), (s * world + rank) * kBatch, kBatch);
    opt.ZeroGrad();
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    opt.Step();
    ReferenceStep(*reference, ref_opt, s * world * kBatch, world * kBatch);
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-4, "`" + worst + "` off by " + std::to_string(diff));
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, RanksOnDifferentCollectiveThreadsIssueBucketsInTheSameOrder) {
  transport::launch::testing::TestRunOptions options;
  options.world_size = 2;
  options.timeout = std::chrono::milliseconds(60000);
  options.env = {{"DDP_TEST_TIMEOUT_MS", "15000"}};
  options.rank_env[0] = {{"DDP_COLLECTIVE_THREAD", "caller"}};
  options.rank_env[1] = {{"DDP_COLLECTIVE_THREAD", "comm"}};
  options.echo_output = std::getenv("DDP_TEST_ECHO") != nullptr;
  auto run = transport::launch::testing::RunTestWorkers("mixed_collective_threads_with_sync_batch_norm", options);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << testing::AllOutput(*run);
}

// NoSync with find_unused_parameters: head `b` gets gradients only in the
// NoSync micro-batches, and the synchronizing one uses `a` on every rank.
// b's accumulated gradient still counts as used, so it is averaged like
// the others: each step equals one step on the combined batch, and `never`
// keeps no gradient.
void CheckNoSyncThenUnused(ProcessGroup& pg, bool view, double cap_mb) {
  const auto& data = testing::FashionMnist();
  const int world = pg.size(), rank = pg.rank();
  constexpr int kMicro = 3, kOuter = 2;
  auto model = std::make_shared<Branchy>(31, false);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = cap_mb, .first_bucket_mb = cap_mb,
                                      .find_unused_parameters = true, .gradient_as_bucket_view = view,
                                      .process_group = Borrow(pg)});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto reference = std::make_shared<Branchy>(31, false);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  const std::string what = std::string("NoSync, then unused") + (view ? " (views)" : "") + " cap " +
                           std::to_string(cap_mb);
  auto micro = [&](int s, int r, int j) {
    return testing::Batch(data, (s * kMicro * world + r * kMicro + j) * kBatch, kBatch);
  };
  for (int s = 0; s < kOuter; ++s) {
    opt.ZeroGrad();
    for (int j = 0; j < kMicro; ++j) {
      model->use_a_ = j == kMicro - 1;
      auto [x, y] = micro(s, rank, j);
      auto step = [&] { nn::Backward(nn::loss::CrossEntropy(ddp(x), y) * (1.0 / kMicro)); };
      if (j < kMicro - 1) {
        auto guard = ddp.NoSync();
        step();
      } else {
        step();
      }
    }
    for (const auto& [name, p] : model->NamedParameters()) {
      const bool never = name.rfind("never.", 0) == 0;
      WORKER_EXPECT(p.grad().defined() != never, what + ": `" + name + "` " + (never ? "has" : "lacks") + " a gradient");
    }
    opt.Step();
    ref_opt.ZeroGrad();
    Tensor total;
    for (int r = 0; r < world; ++r) {
      for (int j = 0; j < kMicro; ++j) {
        reference->use_a_ = j == kMicro - 1;
        auto [x, y] = micro(s, r, j);
        Tensor l = nn::loss::CrossEntropy((*reference)(x), y) * (1.0 / (kMicro * world));
        total = total.defined() ? total + l : l;
      }
    }
    nn::Backward(total);
    ref_opt.Step();
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
  WORKER_EXPECT(testing::SameOnAllRanks(pg, testing::HashState(*model)), what + ": replicas differ");
}

DDP_TEST_WORKER(no_sync_then_unused) {
  auto pg = testing::WorkerGroup();
  for (const bool view : {false, true}) {
    CheckNoSyncThenUnused(*pg, view, 25);
    CheckNoSyncThenUnused(*pg, view, 1e-9);  // one bucket per parameter
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, NoSyncGradientsOfAParameterUnusedInTheSynchronizingStepAreAveraged) {
  auto run = RunWorkers("no_sync_then_unused", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// --------------------------------------------------------------- Join ----

// The last rank holds 3 more batches than the others. Iterations where all
// ranks are active average over every rank; in the extra ones the others
// shadow with zeros, so the gradient is that rank's divided by the world
// size (or by 1 with divide_by_initial_world_size = false).
void CheckJoin(ProcessGroup& pg, bool divide_by_initial, bool view) {
  const auto& data = testing::FashionMnist();
  const int world = pg.size(), rank = pg.rank();
  constexpr int kCommon = 4, kExtra = 3;
  const int mine = kCommon + (rank == world - 1 ? kExtra : 0);
  auto model = Mlp(11);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 0.3, .first_bucket_mb = 0.1,
                                      .gradient_as_bucket_view = view, .process_group = Borrow(pg)});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto batch_of = [&](int r, int s) { return testing::Batch(data, (s * world + r) * kBatch, kBatch); };
  {
    Join join(ddp, {.divide_by_initial_world_size = divide_by_initial});
    for (int s = 0; s < mine; ++s) {
      auto [x, y] = batch_of(rank, s);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
    join.Wait();
  }
  auto reference = Mlp(11);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  for (int s = 0; s < kCommon + kExtra; ++s) {
    ref_opt.ZeroGrad();
    Tensor loss;
    if (s < kCommon) {
      auto [x, y] = testing::Batch(data, s * world * kBatch, world * kBatch);
      loss = nn::loss::CrossEntropy((*reference)(x), y);
    } else {
      auto [x, y] = batch_of(world - 1, s);
      loss = nn::loss::CrossEntropy((*reference)(x), y) * (divide_by_initial ? 1.0 / world : 1.0);
    }
    nn::Backward(loss);
    ref_opt.Step();
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  const std::string what = std::string("Join") + (divide_by_initial ? "" : " (divide by active ranks)") +
                           (view ? " (views)" : "");
  WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
  WORKER_EXPECT(testing::SameOnAllRanks(pg, testing::HashState(*model)), what + ": replicas differ");
}

// A model with BatchNorm: joined ranks also shadow the buffer broadcasts.
void CheckJoinWithBuffers(ProcessGroup& pg) {
  const auto& data = testing::FashionMnist();
  const int rank = pg.rank();
  nn::Generator gen(5);
  auto model = std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<nn::modules::Flatten>(), std::make_shared<nn::modules::Linear>(784, 32, true, gen),
      std::make_shared<nn::modules::BatchNorm1d>(32), std::make_shared<nn::modules::ReLU>(),
      std::make_shared<nn::modules::Linear>(32, 10, true, gen)});
  DistributedDataParallel ddp(model, {.process_group = Borrow(pg)});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  {
    Join join(ddp);
    for (int s = 0; s < 2 + 3 * rank; ++s) {
      auto [x, y] = testing::Batch(data, (s * pg.size() + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
    join.Wait();
  }
  WORKER_EXPECT(testing::SameOnAllRanks(pg, testing::HashState(*model)),
                "Join with buffers: replicas (parameters and running statistics) differ");
}

// Two Joins on one wrapper (one per epoch): rank 0 is active longest in the
// first, the last rank in the second. The final parameters of the second
// come from the last rank, whose step the others did not take: its own
// parameters do not change in Wait (they did when the source was chosen by
// forwards counted since construction, which made rank 0 the source).
void CheckJoinTwice(ProcessGroup& pg) {
  const auto& data = testing::FashionMnist();
  const int world = pg.size(), rank = pg.rank();
  auto model = Mlp(13);
  DistributedDataParallel ddp(model, {.process_group = Borrow(pg)});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto epoch = [&](int batches) {
    Join join(ddp);
    for (int s = 0; s < batches; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
    const uint64_t before = testing::HashState(*model);
    join.Wait();
    return before == testing::HashState(*model);
  };
  epoch(rank == 0 ? 6 : 4);
  const bool kept = epoch(rank == world - 1 ? 3 : 2);
  if (rank == world - 1) WORKER_EXPECT(kept, "Join twice: the last active rank's parameters were overwritten");
  WORKER_EXPECT(testing::SameOnAllRanks(pg, testing::HashState(*model)), "Join twice: replicas differ");
}

// A rank that ran out of inputs contributes zero buckets to the active
// ranks' backward: they are freed when Join::Wait returns, with a
// communication hook too (which is given them). They used to stay
// allocated, as much memory as the gradients, until the rank's next
// backward of its own.
DDP_TEST_WORKER(join_frees_its_zero_buckets) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank(), joined = pg->size() - 1;
  auto model = Mlp(17);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 0.3, .first_bucket_mb = 0.1, .process_group = pg});
  std::vector<std::weak_ptr<nn::TensorImpl>> given;
  const CommHook all_reduce = hooks::AllReduceHook();
  ddp.RegisterCommHook([&](ProcessGroup& group, GradBucket& bucket) {
    given.push_back(bucket.buffer().impl_ptr());
    return all_reduce(group, bucket);
  });
  {
    Join join(ddp);
    for (int s = 0; s < (rank == joined ? 1 : 3); ++s) {
      auto [x, y] = testing::Batch(data, (s * pg->size() + rank) * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    }
    given.clear();
    join.Wait();
  }
  if (rank == joined) {
    WORKER_EXPECT(given.size() >= 4, "the joined rank shadowed " + std::to_string(given.size()) + " buckets");
    for (size_t k = 0; k < given.size(); ++k) {
      WORKER_EXPECT(given[k].expired(), "zero bucket " + std::to_string(k) + " of " +
                                            std::to_string(given.size()) + " is still allocated after Join::Wait");
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AJoinedRankFreesTheZeroBucketsItContributedWhenWaitReturns) {
  auto run = RunWorkers("join_frees_its_zero_buckets", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

DDP_TEST_WORKER(join) {
  auto pg = testing::WorkerGroup();
  CheckJoinTwice(*pg);
  CheckJoin(*pg, true, false);
  CheckJoin(*pg, false, false);
  CheckJoin(*pg, true, true);
  CheckJoinWithBuffers(*pg);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, JoinWithOneRankHoldingThreeMoreBatches) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("join", n);
    EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  }
}

// broadcast_buffers = false under Join with uneven inputs (rank r runs
// 2 + 2r batches): the running statistics stay each rank's own, as in
// PyTorch, whose final sync after a Join leaves buffers alone unless the
// model broadcasts them. Only the parameters come from the last rank.
DDP_TEST_WORKER(join_own_buffers) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  nn::Generator gen(5);
  auto model = std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<nn::modules::Flatten>(), std::make_shared<nn::modules::Linear>(784, 32, true, gen),
      std::make_shared<nn::modules::BatchNorm1d>(32), std::make_shared<nn::modules::ReLU>(),
      std::make_shared<nn::modules::Linear>(32, 10, true, gen)});
  DistributedDataParallel ddp(model, {.broadcast_buffers = false, .process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  std::vector<std::pair<std::string, Tensor>> before;
  {
    Join join(ddp);
    for (int s = 0; s < 2 + 2 * rank; ++s) {
      auto [x, y] = testing::Batch(data, (s * pg->size() + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
    for (const auto& [name, b] : model->NamedBuffers()) before.emplace_back(name, b.Clone());
    join.Wait();
  }
  uint64_t params = 1469598103934665603ull, buffers = params;
  auto hash = [](uint64_t& h, const Tensor& t) {
    const Tensor c = t.Detach().Contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  };
  for (const auto& [name, p] : model->NamedParameters()) hash(params, p);
  const auto now = model->NamedBuffers();
  for (size_t i = 0; i < now.size(); ++i) {
    hash(buffers, now[i].second);
    WORKER_EXPECT(testing::RelativeDifference(now[i].second, before[i].second) == 0,
                  "rank " + std::to_string(rank) + ": buffer `" + now[i].first +
                      "` was overwritten by Join::Wait although broadcast_buffers is false");
  }
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, params), "Join without buffer broadcasts: parameters differ");
  // Each rank's statistics of its own batches: the test means something.
  WORKER_EXPECT(!testing::SameOnAllRanks(*pg, buffers), "the ranks' running statistics are the same");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, JoinWithoutBufferBroadcastsLeavesEveryRankItsOwnBuffers) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("join_own_buffers", n);
    EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  }
}

// A parameter of its own bucket (reduced in place), unused on every rank,
// with a stale .grad that differs between ranks: with find_unused_parameters
// its .grad stays as it was, as for a parameter of a shared bucket and as
// in PyTorch; the in-place reduction used to leave the ranks' average
// there. And a rank whose only backwards were shadowed under Join refuses
// a communication hook afterwards, as the ranks that ran backward do.
DDP_TEST_WORKER(unused_solo_stale_grad) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto model = std::make_shared<Branchy>(5, /*use_a=*/false);
  DistributedDataParallel ddp(model, {.inplace_gradient_mb = 1e-6, .find_unused_parameters = true,
                                      .process_group = pg});
  Tensor a_weight;
  for (const auto& [name, p] : model->NamedParameters()) {
    if (name == "a.weight") a_weight = p;
  }
  WORKER_EXPECT(a_weight.defined(), "no a.weight");
  a_weight.set_grad(nn::Full(a_weight.shape(), rank + 1.0));
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  const std::vector<float> g = a_weight.grad().ToVector<float>();
  WORKER_EXPECT(g.front() == rank + 1.0f && g.back() == rank + 1.0f,
                "a.weight's stale .grad became " + std::to_string(g.front()));

  // Join, a new wrapper: rank 0 has no batch at all, rank 1 one.
  auto model2 = std::make_shared<Branchy>(6, /*use_a=*/true);
  DistributedDataParallel ddp2(model2, {.find_unused_parameters = true, .process_group = pg});
  bool refused = false;
  {
    Join join(ddp2);
    if (rank == 1) {
      auto [x1, y1] = testing::Batch(data, 0, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp2(x1), y1));
    }
    join.Wait();
  }
  try {
    ddp2.RegisterCommHook(hooks::AllReduceHook());
  } catch (const std::logic_error&) {
    refused = true;
  }
  WORKER_EXPECT(refused, "a communication hook was accepted after backwards");
  return testing::WorkerExit();
}

// The same for a parameter of a shared bucket with gradient_as_bucket_view:
// its stale .grad is its bucket view, contributed and reduced in place with
// the bucket, and when no rank used the parameter it keeps that .grad bit
// for bit (it used to come back as the ranks' average: another value where
// the ranks' stale gradients differ, and changed in the last bit on 3 ranks
// even where they agree).
DDP_TEST_WORKER(unused_view_stale_grad) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  auto model = std::make_shared<Branchy>(8, /*use_a=*/false);
  DistributedDataParallel ddp(model, {.find_unused_parameters = true, .gradient_as_bucket_view = true,
                                      .process_group = pg});
  Tensor a_weight;
  for (const auto& [name, p] : model->NamedParameters()) {
    if (name == "a.weight") a_weight = p;
  }
  WORKER_EXPECT(a_weight.defined(), "no a.weight");
  // Iteration 0: a .grad of its own, set after wrapping (not yet a bucket
  // view), on a parameter no rank uses: it keeps its values too, as a
  // parameter of its own bucket does (it came back as the ranks' average).
  a_weight.set_grad(nn::Full(a_weight.shape(), rank + 1.0));
  {
    auto [x0, y0] = testing::Batch(data, rank * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x0), y0));
    const std::vector<float> g = a_weight.grad().ToVector<float>();
    size_t changed = 0;
    for (float v : g) changed += v != rank + 1.0f;
    WORKER_EXPECT(changed == 0, "a .grad set after wrapping: " + std::to_string(changed) +
                                    " elements changed, the first is " + std::to_string(g.front()));
  }
  // Iteration 1 uses head a: a.weight's .grad becomes its bucket view.
  model->use_a_ = true;
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  for (const bool same_on_every_rank : {true, false}) {
    // A stale gradient, the same on every rank or not, with values that a
    // sum of thirds does not return exactly.
    float* g = a_weight.grad().data<float>();
    for (int64_t k = 0; k < a_weight.numel(); ++k) {
      g[k] = 0.1f * static_cast<float>(k % 13 + 1) * (same_on_every_rank ? 1.0f : static_cast<float>(rank + 1));
    }
    const std::vector<float> before = a_weight.grad().ToVector<float>();
    // Head b on every rank: a is unused everywhere.
    model->use_a_ = false;
    auto [x2, y2] = testing::Batch(data, (world + rank) * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x2), y2));
    const std::vector<float> after = a_weight.grad().ToVector<float>();
    size_t changed = 0;
    for (size_t k = 0; k < before.size(); ++k) changed += std::memcmp(&before[k], &after[k], sizeof(float)) != 0;
    WORKER_EXPECT(changed == 0, std::string(same_on_every_rank ? "same" : "different") + " stale gradients: " +
                                    std::to_string(changed) + " elements of a.weight's .grad changed");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AnUnusedParameterWithABucketViewGradientKeepsItExactly) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("unused_view_stale_grad", n);
    EXPECT_TRUE(run.AllSucceeded()) << n << " ranks:\n" << testing::AllOutput(run);
  }
}

TEST(DdpFeaturesTest, AnUnusedParameterOfItsOwnBucketKeepsItsStaleGradient) {
  auto run = RunWorkers("unused_solo_stale_grad", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

DDP_TEST_WORKER(join_throw) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = Mlp(1);
  DistributedDataParallel ddp(model, {.process_group = pg});
  Join join(ddp, {.throw_on_early_termination = true});
  bool thrown = false;
  try {
    for (int s = 0; s < 2 + pg->rank(); ++s) {
      auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    }
    join.Wait();
  } catch (const DistributedError& e) {
    thrown = true;
    // Every rank names the rank that ran out (the joined one too, which
    // once named itself whichever rank had run out first).
    WORKER_EXPECT(std::string(e.what()).find("rank(s) 0 ran out of inputs") != std::string::npos, e.what());
  }
  WORKER_EXPECT(thrown, "no rank-exhaustion error");
  return testing::WorkerExit();
}

// Communication hooks with one process: they run as on N ranks (the
// wrapper used to have no buckets there and dropped the hook silently).
// Fp16CompressHook rounds each gradient to f16 and back, a user's hook is
// called for each bucket, and a hook registered after the first backward
// is refused as on N ranks.
DDP_TEST_WORKER(hooks_on_one_process) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  WORKER_EXPECT(pg->size() == 1, "world size " + std::to_string(pg->size()));
  auto [x, y] = testing::Batch(data, 0, kBatch);
  {
    auto model = Mlp(13);
    DistributedDataParallel ddp(model, {.process_group = pg});
    ddp.RegisterCommHook(hooks::Fp16CompressHook());
    auto reference = Mlp(13);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    nn::Backward(nn::loss::CrossEntropy((*reference)(x), y));
    const auto ref_params = reference->NamedParameters();
    size_t k = 0, rounded = 0;
    for (const auto& [name, p] : model->NamedParameters()) {
      const std::vector<float> exact = ref_params[k++].second.grad().ToVector<float>();
      std::vector<uint16_t> half(exact.size());
      std::vector<float> expected(exact.size());
      internal::FloatToHalf(exact.data(), half.data(), static_cast<int64_t>(exact.size()));
      internal::HalfToFloat(half.data(), expected.data(), static_cast<int64_t>(exact.size()));
      WORKER_EXPECT(p.grad().defined(), "fp16: `" + name + "` has no gradient");
      if (!p.grad().defined()) continue;
      const std::vector<float> got = p.grad().ToVector<float>();
      size_t mismatches = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        mismatches += got[i] != expected[i];
        rounded += expected[i] != exact[i];
      }
      WORKER_EXPECT(mismatches == 0, "fp16: `" + name + "`: " + std::to_string(mismatches) +
                                         " elements are not the f16 rounding of the gradient");
    }
    WORKER_EXPECT(rounded > 0, "fp16: no gradient element changes when rounded to f16");
    // Late: refused, as on N ranks.
    bool refused = false;
    try {
      ddp.RegisterCommHook(hooks::AllReduceHook());
    } catch (const std::logic_error&) {
      refused = true;
    }
    WORKER_EXPECT(refused, "a communication hook was accepted after the first backward on one process");
  }
  {
    auto model = Mlp(17);
    DistributedDataParallel ddp(model, {.process_group = pg});
    int calls = 0;
    ddp.RegisterCommHook([&calls](ProcessGroup& group, GradBucket& bucket) {
      ++calls;
      return group.AllReduce(bucket.buffer(), transport::ReduceOp::kSum, "user hook");
    });
    for (int s = 0; s < 2; ++s) nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    WORKER_EXPECT(calls >= 2, "the user's hook ran " + std::to_string(calls) + " time(s) in two backwards");
    WORKER_EXPECT(ddp.iterations() == 2, "iterations " + std::to_string(ddp.iterations()));
  }
  {
    // Without a hook nothing is built, and registering after a
    // synchronizing forward is refused too.
    auto model = Mlp(19);
    DistributedDataParallel ddp(model, {.process_group = pg});
    WORKER_EXPECT(ddp.BucketParameterNames().empty(), "buckets on one process without a hook");
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    bool refused = false;
    try {
      ddp.RegisterCommHook(hooks::Fp16CompressHook());
    } catch (const std::logic_error&) {
      refused = true;
    }
    WORKER_EXPECT(refused, "a communication hook was accepted after the first backward (no hook before)");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, CommunicationHooksRunWithOneProcessAndLateOnesAreRefused) {
  auto run = RunWorkers("hooks_on_one_process", 1);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A wrapper takes one communication hook, as PyTorch's reducer does
// (register_comm_hook a second time raises there). A second registration
// used to replace the first without a word: a PowerSGD state kept for a
// checkpoint, or a hook a library had registered, was silently no longer
// used. It throws naming the reason, and the first hook stays in effect.
DDP_TEST_WORKER(second_hook_refused) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  auto model = Mlp(23);
  DistributedDataParallel ddp(model, {.process_group = pg});
  int calls = 0;
  ddp.RegisterCommHook([&calls](ProcessGroup& group, GradBucket& bucket) {
    ++calls;
    return group.AllReduce(bucket.buffer(), transport::ReduceOp::kSum, "first hook");
  });
  std::string message;
  try {
    ddp.RegisterCommHook(hooks::Fp16CompressHook());
  } catch (const std::logic_error& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("already registered") != std::string::npos,
                "a second hook: got \"" + message + "\", expected a logic_error saying one is already registered");
  WORKER_EXPECT(message.find("RegisterCommHook") != std::string::npos, "a second hook: " + message);
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  WORKER_EXPECT(calls > 0, "the first hook did not run after a second one was refused (world " +
                               std::to_string(world) + ")");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ASecondCommunicationHookIsRefusedOnOneRank) {
  auto run = RunWorkers("second_hook_refused", 1);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, ASecondCommunicationHookIsRefusedOnTwoRanks) {
  auto run = RunWorkers("second_hook_refused", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// static_graph: an eval-mode forward with grad enabled prepares a backward
// and, learning nothing from it, walks its graph for the unused parameters;
// a NoSync forward's outputs that reach head b join that backward, and b's
// gradient fails it. The message named find_unused_parameters, which is not
// set: it now names static_graph's eval-mode walk and what to do.
TEST(DdpFeaturesTest, ANoSyncGradientAfterAnEvalForwardUnderStaticGraphNamesStaticGraph) {
  auto model = std::make_shared<Branchy>(43, /*use_a=*/true);
  DistributedDataParallel ddp(model, {.static_graph = true, .process_group = ProcessGroup::Single()});
  ddp.RegisterCommHook(hooks::AllReduceHook());  // one process synchronizes through it
  auto [xa, ya] = testing::Batch(testing::FashionMnist(), 0, kBatch);
  auto [xb, yb] = testing::Batch(testing::FashionMnist(), kBatch, kBatch);
  std::string message;
  try {
    ddp.Eval();
    const Tensor a = ddp(xa);
    Tensor b;
    {
      auto no_sync = ddp.NoSync();
      model->use_a_ = false;
      b = ddp(xb);
    }
    nn::Backward(nn::loss::CrossEntropy(a, ya) + nn::loss::CrossEntropy(b, yb));
  } catch (const std::exception& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("parameter `b."), std::string::npos) << message;
  EXPECT_NE(message.find("through the outputs of a forward run under NoSync"), std::string::npos) << message;
  EXPECT_EQ(message.find("find_unused_parameters"), std::string::npos) << message;
  EXPECT_NE(message.find("eval-mode forward"), std::string::npos) << message;
  EXPECT_NE(message.find("static_graph"), std::string::npos) << message;
  EXPECT_NE(message.find("NoGradGuard"), std::string::npos) << message;
}

// A wrapper with no trainable parameters has no reducer, and its hook never
// runs; a second one is still refused, as with parameters (it was ignored).
TEST(DdpFeaturesTest, ASecondCommunicationHookIsRefusedWithoutTrainableParameters) {
  auto model = nn::modules::MakeMlp();
  for (auto& [name, p] : model->NamedParameters()) p.set_requires_grad(false);
  DistributedDataParallel ddp(model, {.process_group = ProcessGroup::Single()});
  ddp.RegisterCommHook(hooks::AllReduceHook());
  try {
    ddp.RegisterCommHook(hooks::Fp16CompressHook());
    ADD_FAILURE() << "a second hook was taken";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("already registered"), std::string::npos) << e.what();
  }
}

// With one process a hook makes the wrapper build a Reducer, so the checks
// of N ranks apply there too: a model with parameters that get no gradient
// (Branchy's head b and `never`) trains with find_unused_parameters (equal
// to the bare model, those keeping no gradient), and without it the
// backward throws naming them, as on N ranks. Without a hook one process
// has no reducer and trains on.
DDP_TEST_WORKER(unused_parameters_one_process_hook) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  {
    auto model = std::make_shared<Branchy>(7, /*use_a=*/true);
    DistributedDataParallel ddp(model, {.find_unused_parameters = true, .process_group = pg});
    ddp.RegisterCommHook(hooks::AllReduceHook());
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    auto reference = std::make_shared<Branchy>(7, /*use_a=*/true);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
    try {
      for (int s = 0; s < 2; ++s) {
        auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
        opt.ZeroGrad();
        nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
        opt.Step();
        ref_opt.ZeroGrad();
        nn::Backward(nn::loss::CrossEntropy((*reference)(x), y));
        ref_opt.Step();
        for (const auto& [name, p] : model->NamedParameters()) {
          const bool used = name.rfind("a.", 0) == 0 || name.rfind("trunk.", 0) == 0;
          WORKER_EXPECT(p.grad().defined() == used,
                        "find unused: `" + name + "` " + (used ? "has no gradient" : "has a gradient"));
        }
      }
    } catch (const std::exception& e) {
      WORKER_EXPECT(false, std::string("find unused: ") + e.what());
    }
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-6, "find unused: `" + worst + "` off by " + std::to_string(diff));
    WORKER_EXPECT(ddp.iterations() == 2, "find unused: iterations " + std::to_string(ddp.iterations()));
  }
  {
    auto model = std::make_shared<Branchy>(7, /*use_a=*/true);
    DistributedDataParallel ddp(model, {.process_group = pg});
    ddp.RegisterCommHook(hooks::AllReduceHook());
    auto [x, y] = testing::Batch(data, 0, kBatch);
    std::string message;
    try {
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    } catch (const std::exception& e) {
      message = e.what();
    }
    std::fprintf(stderr, "without find_unused_parameters: %s\n", message.c_str());
    WORKER_EXPECT(message.find("received no gradient") != std::string::npos, "without: " + message);
    WORKER_EXPECT(message.find("`b.weight`") != std::string::npos, "without: " + message);
    WORKER_EXPECT(message.find("find_unused_parameters") != std::string::npos, "without: " + message);
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, OneProcessWithAHookChecksUnusedParametersAsNRanksDo) {
  auto run = RunWorkers("unused_parameters_one_process_hook", 1);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Construction that fails on one rank after the ranks' models were
// compared (its gradient buckets cannot be allocated): that rank throws the
// cause, and the others, whose wrappers are complete, fail at their first
// collective within moments with a message naming the rank and the cause.
// They used to wait in their first bucket all-reduce until the group's
// timeout (20 s here) and report only that.
DDP_TEST_WORKER(construction_fails_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank(), failing = pg->size() - 1;
  if (rank == failing) internal::FailNextBucketAllocationForTesting();
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    auto model = Mlp(9);
    DistributedDataParallel ddp(model, {.inplace_gradient_mb = 0, .process_group = pg});
    WORKER_EXPECT(rank != failing, "the wrapper was built where its buckets could not be allocated");
    for (int s = 0; s < 2; ++s) {
      auto [x, y] = testing::Batch(data, (s * pg->size() + rank) * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    }
  } catch (const std::bad_alloc& e) {
    message = e.what();
    WORKER_EXPECT(rank == failing, std::string("bad_alloc on a rank where nothing failed: ") + e.what());
    // A process that handles the error (logs it, tidies up) stays alive
    // for a while: the peers must not need its exit to stop waiting.
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
  } catch (const std::exception& e) {
    message = e.what();
    WORKER_EXPECT(message.find("DistributedDataParallel on rank " + std::to_string(failing) +
                               ": construction failed on this rank") != std::string::npos &&
                      message.find("std::bad_alloc") != std::string::npos,
                  message);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (rank != failing) testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(!message.empty(), "no error");
  WORKER_EXPECT(rank == failing || seconds < 5, "failed after " + std::to_string(seconds) + " s: " + message);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AConstructionThatFailsOnOneRankAfterTheComparisonAbortsTheGroupWithItsCause) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("construction_fails_on_one_rank", n, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << n << " ranks:\n" << testing::AllOutput(run);
  }
}

// A negative DdpOptions::log_stats_every (0 means never) on one rank: that
// rank throws naming the option and the value, and the others, which may
// log at another period (it is not compared across ranks), fail at their
// first collective within moments with that cause. It used to be taken
// silently as "never log", even under DDP_DEBUG=info.
DDP_TEST_WORKER(log_stats_every_negative_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank(), failing = pg->size() - 1;
  const std::string expected = "DdpOptions::log_stats_every must be at least 0 (0: never), got -5";
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    auto model = Mlp(9);
    DistributedDataParallel ddp(model, {.process_group = pg, .log_stats_every = rank == failing ? -5 : 0});
    WORKER_EXPECT(rank != failing, "a negative log_stats_every was accepted");
    auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::invalid_argument& e) {
    message = e.what();
    WORKER_EXPECT(rank == failing && message == expected, message);
    // Alive a while: the peers must not need its exit to stop waiting.
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
  } catch (const std::exception& e) {
    message = e.what();
    WORKER_EXPECT(rank != failing && message.find(expected) != std::string::npos, message);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (rank != failing) testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(!message.empty(), "no error");
  WORKER_EXPECT(rank == failing || seconds < 5, "failed after " + std::to_string(seconds) + " s: " + message);
  return testing::WorkerExit();
}

// A construction that fails after the trace was started (here rank 0's:
// its peer refused a negative log_stats_every and aborted the group, so the
// initial broadcast fails) leaves no partial trace of a run that never
// started, and leaves an earlier run's complete trace as it was. Before,
// the empty partial file stayed.
DDP_TEST_WORKER(failed_construction_leaves_the_traces) {
  auto pg = testing::WorkerGroup();
  const std::string prefix = std::getenv("DDP_TEST_TRACE_PREFIX");
  const std::string earlier = prefix + "rank0.json", partial = prefix + "rank0.partial.json";
  const std::string earlier_text = "{\"traceEvents\": []}\n";
  if (pg->rank() == 0) std::ofstream(earlier) << earlier_text;
  bool failed = false;
  try {
    DistributedDataParallel ddp(Mlp(9), {.process_group = pg, .log_stats_every = pg->rank() == 1 ? -5 : 0,
                                         .trace_prefix = pg->rank() == 0 ? prefix : ""});
  } catch (const std::exception&) {
    failed = true;
    if (pg->rank() == 1) testing::StayAliveUntilTheOtherRanksAreDone(*pg);
  }
  WORKER_EXPECT(failed, "rank " + std::to_string(pg->rank()) + " constructed");
  if (pg->rank() == 0) {
    testing::MarkThisRankDone(*pg);
    WORKER_EXPECT(!std::filesystem::exists(partial), partial + " is left behind");
    std::ifstream in(earlier);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    WORKER_EXPECT(text == earlier_text, earlier + " holds '" + text + "'");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AFailedConstructionLeavesNoPartialTraceAndTheEarlierOne) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string prefix = std::string(tmp != nullptr ? tmp : "/tmp") + "/failed_construction_" +
                             std::to_string(::getpid()) + "_";
  auto run = RunWorkers("failed_construction_leaves_the_traces", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_TEST_TRACE_PREFIX", prefix}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, ANegativeStatisticsPeriodIsRefusedNamingTheOption) {
  auto run = RunWorkers("log_stats_every_negative_on_one_rank", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// JoinOptions that differ between ranks (JOIN_OPTIONS_CASE picks which,
// always on the last rank): every rank throws, quickly, the same message
// naming the option and the ranks on each side. They used to be taken as
// they were: gradients divided by the world size on some ranks and by the
// active ranks on others, a rank throwing alone on early termination while
// the others waited in a bucket all-reduce until the timeout, or a shadowed
// optimizer step on one side only.
DDP_TEST_WORKER(join_options_differ) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank(), last = pg->size() - 1;
  const std::string which = std::getenv("JOIN_OPTIONS_CASE");
  JoinOptions options;
  std::string expected;
  if (which == "divide") {
    options.divide_by_initial_world_size = rank != last;
    expected = "divide_by_initial_world_size is true on rank(s) 0" + std::string(last > 1 ? ", 1" : "") +
               " and false on rank(s) " + std::to_string(last);
  } else if (which == "throw") {
    options.throw_on_early_termination = rank == last;
    expected = "throw_on_early_termination is true on rank(s) " + std::to_string(last) + " and false on rank(s) 0";
  } else {
    if (rank == last) options.shadow_step = [] {};
    expected = "shadow_step is set on rank(s) " + std::to_string(last) + " and empty on rank(s) 0";
  }
  auto model = Mlp(7);
  DistributedDataParallel ddp(model, {.process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    Join join(ddp, options);
    // Uneven inputs: rank r has r batches (rank 0 goes straight to Wait).
    for (int s = 0; s < rank; ++s) {
      auto [x, y] = testing::Batch(data, (s * pg->size() + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
    join.Wait();
  } catch (const DistributedError& e) {
    message = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(message.find("Join: the ranks passed different JoinOptions: " + expected) != std::string::npos,
                which + ": " + (message.empty() ? std::string("no error") : message));
  WORKER_EXPECT(seconds < 5, which + ": took " + std::to_string(seconds) + " s");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, JoinOptionsThatDifferAcrossRanksFailOnEveryRankNamingTheOption) {
  for (const char* which : {"divide", "throw", "shadow_step"}) {
    for (int n : {2, 3}) {
      auto run = RunWorkers("join_options_differ", n,
                            {{"JOIN_OPTIONS_CASE", which}, {"DDP_TEST_TIMEOUT_MS", "20000"}}, 40000);
      EXPECT_TRUE(run.AllSucceeded()) << which << " on " << n << " ranks:\n" << testing::AllOutput(run);
    }
  }
}

// A rank that ran out of inputs in the middle of a NoSync accumulation
// (it backpropagated through head b locally) contributes nothing of it to
// the iterations it shadows, and starts the next synchronizing iteration
// with nothing counted as used: with find_unused_parameters, b, unused on
// every rank there, keeps no gradient (its stale used flag made it count as
// used, and b got a zero gradient that momentum and weight decay step).
DDP_TEST_WORKER(join_after_no_sync) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto model = std::make_shared<testing::Branchy>(41, true);
  DistributedDataParallel ddp(model, {.find_unused_parameters = true, .process_group = pg});
  auto batch = [&](int s) { return testing::Batch(data, (s * pg->size() + rank) * kBatch, kBatch); };
  auto step = [&](int s, bool use_a) {
    model->use_a_ = use_a;
    auto [x, y] = batch(s);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  };
  {
    Join join(ddp);
    step(0, true);
    {
      auto no_sync = ddp.NoSync();
      step(1, false);
    }
    if (rank == 1) step(2, true);  // rank 0 has run out
    join.Wait();
  }
  nn::optim::ZeroGrad(model->NamedParameters());
  step(3, true);
  for (const auto& [name, p] : model->NamedParameters()) {
    const bool used = name.rfind("trunk.", 0) == 0 || name.rfind("a.", 0) == 0;
    WORKER_EXPECT(p.grad().defined() == used, "rank " + std::to_string(rank) + ": `" + name + "` " +
                                                  (used ? "has no gradient" : "has a gradient"));
  }
  return testing::WorkerExit();
}

// An evaluation as a training loop may run one between a forward and its
// backward: a no-grad forward in eval mode, then one in training mode.
void NoGradForwardsInBothModes(DistributedDataParallel& ddp, const Tensor& x) {
  nn::NoGradGuard no_grad;
  ddp.Eval();
  ddp(x);
  ddp.Train();
  ddp(x);
}

// Uneven inputs under Join (the last rank holds 3 more batches), with an
// evaluation between each training forward and its backward when
// `evaluate`: no-grad forwards in eval and in training mode, as
// non_sync_forwards runs them without Join. A rank that ran out starts
// shadowing the backward (its bucket all-reduces) once the training
// forward's flags say so; an evaluation that sent Join's flags all-reduce,
// or in training mode the buffer broadcast, paired them with those.
void TrainUnderJoin(ProcessGroup& pg, const std::shared_ptr<Module>& model, bool evaluate) {
  const auto& data = testing::FashionMnist();
  const int world = pg.size(), rank = pg.rank();
  const int mine = 4 + (rank == world - 1 ? 3 : 0);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 0.3, .first_bucket_mb = 0.1, .process_group = Borrow(pg)});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  const Tensor held_out = testing::Batch(data, 1000, kBatch).first;
  Join join(ddp);
  for (int s = 0; s < mine; ++s) {
    auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
    opt.ZeroGrad();
    const Tensor out = ddp(x);
    if (evaluate) NoGradForwardsInBothModes(ddp, held_out);
    nn::Backward(nn::loss::CrossEntropy(out, y));
    opt.Step();
  }
  join.Wait();
}

// The MLP equals one process on the combined batches (CheckJoin's
// reference); a model with BatchNorm, whose buffers the training-mode
// evaluation would broadcast, has the parameters of the same training
// without the evaluations (they only move running statistics, which a
// training forward does not read), and identical replicas.
DDP_TEST_WORKER(join_evaluation_before_backward) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size();
  try {
    auto model = Mlp(17);
    TrainUnderJoin(*pg, model, true);
    auto reference = Mlp(17);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    for (int s = 0; s < 7; ++s) {
      ref_opt.ZeroGrad();
      Tensor loss;
      if (s < 4) {
        auto [x, y] = testing::Batch(data, s * world * kBatch, world * kBatch);
        loss = nn::loss::CrossEntropy((*reference)(x), y);
      } else {
        auto [x, y] = testing::Batch(data, (s * world + world - 1) * kBatch, kBatch);
        loss = nn::loss::CrossEntropy((*reference)(x), y) * (1.0 / world);
      }
      nn::Backward(loss);
      ref_opt.Step();
    }
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-5, "MLP: `" + worst + "` off by " + std::to_string(diff));
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "MLP: replicas differ");

    auto with_batch_norm = [] {
      nn::Generator gen(5);
      return std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<Module>>{
          std::make_shared<nn::modules::Flatten>(), std::make_shared<nn::modules::Linear>(784, 32, true, gen),
          std::make_shared<nn::modules::BatchNorm1d>(32), std::make_shared<nn::modules::ReLU>(),
          std::make_shared<nn::modules::Linear>(32, 10, true, gen)});
    };
    auto evaluated = with_batch_norm(), plain = with_batch_norm();
    TrainUnderJoin(*pg, evaluated, true);
    TrainUnderJoin(*pg, plain, false);
    const auto [bn_diff, bn_worst] = testing::MaxRelativeDifference(*evaluated, *plain);
    WORKER_EXPECT(bn_diff <= 1e-6, "BatchNorm: `" + bn_worst + "` off by " + std::to_string(bn_diff));
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*evaluated)), "BatchNorm: replicas differ");
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, e.what());
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, JoinWithAnEvaluationBetweenForwardAndBackward) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("join_evaluation_before_backward", n, {{"DDP_TEST_TIMEOUT_MS", "5000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << n << " ranks\n" << testing::AllOutput(run);
  }
}

// join_evaluation_before_backward's evaluation without its NoGradGuard:
// an eval-mode forward with grad enabled between rank 0's training forward
// and its backward, while rank 1 has run out and shadows that backward in
// Join::Wait. Outside Join that forward is a second synchronizing forward
// and is refused; under Join it is refused too, at the forward, and the
// group is aborted, so rank 1 fails within moments (the deadline is 60 s;
// rank 0 stays alive meanwhile, so its exit cannot be what rank 1 notices).
DDP_TEST_WORKER(join_eval_with_grad_before_backward) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto model = Mlp(17);
  DistributedDataParallel ddp(model, {.process_group = pg});
  Join join(ddp);
  if (rank == 1) {
    std::string message;
    const auto start = std::chrono::steady_clock::now();
    try {
      join.Wait();
    } catch (const std::exception& e) {
      message = e.what();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    testing::MarkThisRankDone(*pg);
    std::fprintf(stderr, "rank 1 after %.2f s: %s\n", seconds, message.c_str());
    WORKER_EXPECT(message.find("eval-mode forward with grad enabled ran inside Join") != std::string::npos, message);
    WORKER_EXPECT(seconds < 5, "rank 1's Join::Wait failed after " + std::to_string(seconds) + " s");
    return testing::WorkerExit();
  }
  auto [x, y] = testing::Batch(data, 0, kBatch);
  const Tensor held_out = testing::Batch(data, 1000, kBatch).first;
  const Tensor out = ddp(x);
  std::string message = "no error";
  ddp.Eval();
  try {
    (void)ddp(held_out);
    ddp.Train();
    nn::Backward(nn::loss::CrossEntropy(out, y));
  } catch (const std::exception& e) {
    message = std::string(ddp.is_training() ? "backward" : "eval forward") + " threw: " + e.what();
  }
  std::fprintf(stderr, "rank 0: %s\n", message.c_str());
  WORKER_EXPECT(message.rfind("eval forward threw: DistributedDataParallel on rank 0", 0) == 0 &&
                    message.find("eval-mode forward with grad enabled ran inside Join") != std::string::npos &&
                    message.find("The process group was aborted") != std::string::npos,
                message);
  testing::StayAliveUntilTheOtherRanksAreDone(*pg);
  return testing::WorkerExit();
}

// A module whose forward throws on one rank (say, out of memory there):
// that rank gets the module's own exception, and the group is aborted with
// the reason, so the peer's backward fails within moments instead of
// waiting out the group timeout (60 s here) for buckets that never come.
// Before, nothing recorded the failed forward: the peer waited, and the
// failing rank's next collectives paired with the peer's buckets.
class ThrowsOnRankOne : public Module {
 public:
  ThrowsOnRankOne(std::shared_ptr<Module> inner, int rank) : rank_(rank) {
    inner_ = RegisterModule("inner", std::move(inner));
  }
  Tensor Forward(const Tensor& x) override {
    if (rank_ == 1) throw std::runtime_error("injected: out of memory on rank 1");
    return (*inner_)(x);
  }
  std::string TypeName() const override { return "ThrowsOnRankOne"; }

 private:
  std::shared_ptr<Module> inner_;
  int rank_;
};

DDP_TEST_WORKER(forward_throws_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto model = std::make_shared<ThrowsOnRankOne>(Mlp(17), rank);
  DistributedDataParallel ddp(model, {.process_group = pg});
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  std::string message = "no error";
  const auto start = std::chrono::steady_clock::now();
  try {
    const Tensor out = ddp(x);
    nn::Backward(nn::loss::CrossEntropy(out, y));
  } catch (const std::exception& e) {
    message = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "rank %d after %.2f s: %s\n", rank, seconds, message.c_str());
  if (rank == 1) {
    WORKER_EXPECT(message == "injected: out of memory on rank 1", message);
    WORKER_EXPECT(!pg->aborted_reason().ok(), "the group was not aborted");
    // Alive past rank 0's bound, as a training loop that caught the error
    // would be: rank 0 cannot learn of it from this process exiting.
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  } else {
    testing::MarkThisRankDone(*pg);
    WORKER_EXPECT(message.find("DistributedDataParallel on rank 1: the module's forward threw (injected: out of "
                               "memory on rank 1)") != std::string::npos,
                  message);
    WORKER_EXPECT(seconds < 10, "rank 0's backward failed after " + std::to_string(seconds) + " s");
  }
  WORKER_EXPECT(!pg->aborted_reason().ok(), "the group was not aborted");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ForwardThatThrowsOnOneRankAbortsTheGroup) {
  auto run = RunWorkers("forward_throws_on_one_rank", 2, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 40000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Join's shadowed optimizer step (JoinOptions::shadow_step) throws on the
// rank that ran out of inputs: the active ranks, whose step runs a
// collective it would have joined, fail within moments naming that rank
// and the cause. They used to wait in it until the group's timeout (20 s
// here) and report only that.
DDP_TEST_WORKER(join_shadow_step_throws) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto model = Mlp(23);
  DistributedDataParallel ddp(model, {.process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  // A step that is collective, as a sharded optimizer's is.
  auto step = [&] {
    opt.Step();
    Tensor token = nn::Ones({1});
    pg->AllReduce(token, transport::ReduceOp::kSum, "step").Wait();
  };
  JoinOptions options;
  options.shadow_step = [&] { throw std::runtime_error("the shadowed step failed on purpose"); };
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    Join join(ddp, options);
    // Rank 0 has one batch, the others three.
    for (int s = 0; s < (rank == 0 ? 1 : 3); ++s) {
      auto [x, y] = testing::Batch(data, (s * pg->size() + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      step();
    }
    join.Wait();
  } catch (const std::exception& e) {
    message = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (rank == 0) {
    WORKER_EXPECT(message == "the shadowed step failed on purpose", "rank 0: " + message);
    // Alive a while, as a process that handles the error: the peers must
    // not need its exit to stop waiting.
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
  } else {
    testing::MarkThisRankDone(*pg);
    WORKER_EXPECT(message.find("Join::Wait on rank 0: the shadowed optimizer step (JoinOptions::shadow_step) "
                               "threw (the shadowed step failed on purpose)") != std::string::npos,
                  message.empty() ? std::string("no error") : message);
    WORKER_EXPECT(seconds < 5, "failed after " + std::to_string(seconds) + " s: " + message);
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AShadowedStepThatThrowsOnTheJoinedRankAbortsTheGroupWithItsCause) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("join_shadow_step_throws", n, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << n << " ranks:\n" << testing::AllOutput(run);
  }
}

// Gradual unfreezing after wrapping: a parameter that did not require grad
// at construction has no bucket, so its gradient would stay local and the
// replicas would drift apart silently. The next forward outside NoSync
// refuses it on every rank, naming it. DDP_TEST_FREEZE=all freezes every
// parameter first (no reducer at all: the forward involves no peer, so the
// group is left usable), =some only the first layer (the group is aborted).
DDP_TEST_WORKER(unfrozen_after_wrap) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const bool all = std::string(std::getenv("DDP_TEST_FREEZE")) == "all";
  auto model = Mlp(17);
  const auto params = model->NamedParameters();
  for (size_t i = 0; i < params.size(); ++i) {
    if (all || i < 2) params[i].second.set_requires_grad(false);
  }
  DistributedDataParallel ddp(model, {.process_group = pg});
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  if (!all) nn::Backward(nn::loss::CrossEntropy(ddp(x), y));  // fine while frozen
  params[0].second.set_requires_grad(true);
  std::string message = "no error";
  try {
    (void)ddp(x);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("parameter `" + params[0].first +
                             "` did not require grad when the model was wrapped and requires it now") !=
                    std::string::npos,
                message);
  if (all) {
    WORKER_EXPECT(message.find("the process group was not aborted and stays usable") != std::string::npos, message);
    WORKER_EXPECT(pg->aborted_reason().ok(), "the group was aborted: " + pg->aborted_reason().ToString());
    Tensor one = nn::Ones({1});
    pg->AllReduce(one).Wait();
    WORKER_EXPECT(one.Item() == pg->size(), "the group's next all-reduce gave " + std::to_string(one.Item()));
  } else {
    WORKER_EXPECT(message.find("The process group was aborted.") != std::string::npos, message);
    WORKER_EXPECT(!pg->aborted_reason().ok(), "the group was not aborted");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ParameterUnfrozenAfterWrappingIsRefused) {
  for (const char* freeze : {"some", "all"}) {
    auto run = RunWorkers("unfrozen_after_wrap", 2, {{"DDP_TEST_FREEZE", freeze}});
    EXPECT_TRUE(run.AllSucceeded()) << freeze << "\n" << testing::AllOutput(run);
  }
}

// Module::To() after wrapping: the buckets keep the dtype they were built
// for, so f64 gradients were rounded through f32 shared buckets without a
// word, or refused in the middle of backward for buckets of their own. The
// next forward with grad enabled now refuses it on every rank, naming the
// first parameter and both dtypes, and aborts the group, well before the
// collective timeout. DDP_TEST_BUCKETS: "shared" (every gradient copied
// into a bucket), "view" (gradient_as_bucket_view), "solo" (every gradient
// a bucket of its own).
DDP_TEST_WORKER(to_after_wrap) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const std::string buckets = std::getenv("DDP_TEST_BUCKETS");
  auto model = Mlp(17);
  DistributedDataParallel ddp(model, {.inplace_gradient_mb = buckets == "solo" ? 1e-9 : 0.0,
                                      .gradient_as_bucket_view = buckets == "view",
                                      .process_group = pg});
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));  // fine before To()
  model->To(nn::DType::kFloat64);
  const Tensor x64 = x.To(nn::DType::kFloat64);
  std::string message = "no error";
  const auto start = std::chrono::steady_clock::now();
  try {
    nn::Backward(nn::loss::CrossEntropy(ddp(x64), y));
  } catch (const std::invalid_argument& e) {
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("not std::invalid_argument: ") + e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string first = model->NamedParameters()[0].first;
  WORKER_EXPECT(message.find("DistributedDataParallel on rank " + std::to_string(pg->rank()) + ": parameter `" +
                             first + "` is f64 on cpu now, but it was f32 on cpu when the model was wrapped") !=
                        std::string::npos &&
                    message.find("Call To() before wrapping the model") != std::string::npos,
                buckets + ": " + message);
  WORKER_EXPECT(seconds < 10, buckets + ": the error came after " + std::to_string(seconds) + " s");
  WORKER_EXPECT(!pg->aborted_reason().ok(), buckets + ": the group was not aborted");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ToAfterWrappingIsRefusedOnEveryRankAtTheNextForward) {
  for (const char* buckets : {"shared", "view", "solo"}) {
    auto run = RunWorkers("to_after_wrap", 2, {{"DDP_TEST_BUCKETS", buckets}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                          40000);
    EXPECT_TRUE(run.AllSucceeded()) << buckets << "\n" << testing::AllOutput(run);
  }
}

// The last layer's data replaced with a larger one after wrapping (10 -> 11
// outputs, PyTorch's `p.data = ...`), met by a forward under NoSync: the
// parameter's place in its bucket keeps 10 rows, so the synchronizing
// backward averaged only those and left the 11th row each rank's own,
// without a word (or, with bucket views, failed inside backward on a
// set_grad of the old shape). Now that NoSync forward refuses it on every
// rank, naming the parameter and both shapes. DDP_TEST_BUCKETS:
// "shared", "view" (gradient_as_bucket_view), "solo" (every gradient a
// bucket of its own: 1e-6 MiB is one byte).
DDP_TEST_WORKER(reshaped_after_wrap) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const std::string buckets = std::getenv("DDP_TEST_BUCKETS");
  auto model = Mlp(17);
  DistributedDataParallel ddp(model, {.inplace_gradient_mb = buckets == "solo" ? 1e-6 : 0.0,
                                      .gradient_as_bucket_view = buckets == "view",
                                      .process_group = pg});
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  for (int s = 0; s < 2; ++s) {  // fine before the change; the buckets are rebuilt at the second
    nn::optim::ZeroGrad(model->NamedParameters());
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  }
  nn::optim::ZeroGrad(model->NamedParameters());
  const auto named = model->NamedParameters();
  const auto& [weight_name, weight] = named[named.size() - 2];
  const Tensor& bias = named.back().second;
  nn::Generator gen(3);  // the same on every rank
  weight.SetData(nn::Randn({11, weight.shape()[1]}, {}, gen) * 0.05);
  bias.SetData(nn::Zeros({11}));
  std::string message = "no error";
  try {
    {
      auto no_sync = ddp.NoSync();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    }
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::invalid_argument& e) {
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("not std::invalid_argument: ") + e.what();
  }
  WORKER_EXPECT(message.find("parameter `" + weight_name + "` has shape [11, 256] now, but it had [10, 256] "
                             "when the model was wrapped") != std::string::npos &&
                    message.find("The process group was aborted.") != std::string::npos,
                buckets + ": " + message);
  if (message == "no error") {
    // What went on silently: part of the gradient was not averaged.
    const Tensor g = weight.grad().Contiguous();
    uint64_t h = 1469598103934665603ull;
    const auto* p = static_cast<const unsigned char*>(g.data_ptr());
    for (size_t i = 0; i < g.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, h),
                  buckets + ": .grad of `" + weight_name + "` " + nn::ShapeToString(g.shape()) +
                      " differs across ranks");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AParameterResizedAfterWrappingIsRefusedOnEveryRankAtTheNextForward) {
  for (const char* buckets : {"shared", "view", "solo"}) {
    auto run = RunWorkers("reshaped_after_wrap", 2, {{"DDP_TEST_BUCKETS", buckets}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                          40000);
    EXPECT_TRUE(run.AllSucceeded()) << buckets << "\n" << testing::AllOutput(run);
  }
}

// To() after wrapping on rank 0 alone, met by a forward under NoSync (the
// model has no buffers, so that forward runs no collective): the group is
// aborted all the same, so that rank 1, which goes on to its synchronizing
// backward, fails at once instead of waiting there for rank 0's buckets
// until the group's timeout.
DDP_TEST_WORKER(to_after_wrap_under_no_sync) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const auto& data = testing::FashionMnist();
  auto model = Mlp(17);
  DistributedDataParallel ddp(model, {.process_group = pg});
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));  // fine before To()
  const bool converts = pg->rank() == 0;
  if (converts) model->To(nn::DType::kFloat64);
  const Tensor input = converts ? x.To(nn::DType::kFloat64) : x;
  const std::string first = model->NamedParameters()[0].first;
  const auto start = std::chrono::steady_clock::now();
  std::string message = "no error";
  try {
    {
      auto no_sync = ddp.NoSync();
      nn::Backward(nn::loss::CrossEntropy(ddp(input), y));
    }
    nn::Backward(nn::loss::CrossEntropy(ddp(input), y));
  } catch (const std::exception& e) {
    message = e.what();
  }
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(20),
                "rank " + std::to_string(pg->rank()) + " waited for the timeout: " + message);
  if (converts) {
    WORKER_EXPECT(message.find("parameter `" + first + "` is f64 on cpu now") != std::string::npos &&
                      message.find("The process group was aborted.") != std::string::npos,
                  message);
  } else {
    WORKER_EXPECT(message != "no error", "rank 1's synchronizing backward went through");
  }
  WORKER_EXPECT(!pg->aborted_reason().ok(), "the group was not aborted");

  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ToAfterWrappingUnderNoSyncStillAbortsTheGroupSoThePeerFailsAtOnce) {
  auto run = RunWorkers("to_after_wrap_under_no_sync", 2, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 40000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, AnEvalForwardWithGradBeforeTheBackwardUnderJoinAbortsTheGroupAtThatForward) {
  auto run = RunWorkers("join_eval_with_grad_before_backward", 2, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 40000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, RankThatRanOutDuringNoSyncStartsAfresh) {
  auto run = RunWorkers("join_after_no_sync", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, JoinThrowsOnEveryRankOnEarlyTermination) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("join_throw", n);
    EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  }
}

// SyncBatchNorm layers given no group use the default one; where that has
// one rank (here each rank's own subgroup, while DDP runs over the world)
// they gather nothing, so Join runs to its end with uneven inputs (rank r
// runs 2 + 2r batches). Join used to let only a layer given a one-rank
// group explicitly through, and stopped every rank here.
DDP_TEST_WORKER(join_sync_batch_norm_default_solo_group) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  std::shared_ptr<ProcessGroup> solo;
  for (int r = 0; r < world; ++r) {
    if (auto group = pg->NewGroup({r})) solo = group;
  }
  WORKER_EXPECT(solo != nullptr && solo->size() == 1, "no one-rank group for rank " + std::to_string(rank));
  SetDefaultProcessGroup(solo);
  auto model = ConvertSyncBatchNorm(NormedMlp(7, nullptr));  // no group: the default one
  DistributedDataParallel ddp(model, {.process_group = pg});
  std::string message;
  try {
    Join join(ddp);
    for (int s = 0; s < 2 + 2 * rank; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    }
    join.Wait();
  } catch (const std::exception& e) {
    message = e.what();
  }
  DestroyProcessGroup();
  WORKER_EXPECT(message.empty(), "rank " + std::to_string(rank) + ": " + message);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, JoinRunsToItsEndWhenSyncBatchNormsDefaultGroupHasOneRank) {
  auto run = RunWorkers("join_sync_batch_norm_default_solo_group", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// JoinOptions::enable = false: the Join does nothing, as PyTorch's
// Join(enable=False). With the same inputs on every rank, training under it
// runs exactly the collectives plain DDP runs (no flags at the forwards,
// nothing in Wait) and ends with the same parameters, an eval-mode step with
// grad enabled included (it synchronizes, as outside Join; an enabled Join
// keeps it local). Then rank 0 runs out of inputs a batch early, with
// throw_on_early_termination set: its Wait returns at once, throwing and
// shadowing nothing, and the others' extra backward waits for rank 0 as
// without Join, until the group's timeout.
DDP_TEST_WORKER(join_disabled) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  constexpr int kSteps = 3;
  auto train = [&](DistributedDataParallel& ddp, Module& model) {
    nn::optim::Sgd opt(model.NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      model.Train(s != 1);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
  };
  auto plain_model = Mlp(23);
  DistributedDataParallel plain(plain_model, {.process_group = pg});
  uint64_t before = pg->collectives_run();
  train(plain, *plain_model);
  const uint64_t plain_collectives = pg->collectives_run() - before;

  auto model = Mlp(23);
  DistributedDataParallel ddp(model, {.process_group = pg});
  before = pg->collectives_run();
  {
    Join join(ddp, {.enable = false});
    train(ddp, *model);
    join.Wait();
  }
  const uint64_t join_collectives = pg->collectives_run() - before;
  WORKER_EXPECT(join_collectives == plain_collectives,
                "rank " + std::to_string(rank) + ": training under a disabled Join ran " +
                    std::to_string(join_collectives) + " collectives, plain DDP " +
                    std::to_string(plain_collectives));
  WORKER_EXPECT(testing::HashState(*model) == testing::HashState(*plain_model),
                "rank " + std::to_string(rank) + ": the parameters under a disabled Join differ from plain DDP's");
  WORKER_EXPECT(ddp.iterations() == plain.iterations(),
                "rank " + std::to_string(rank) + ": " + std::to_string(ddp.iterations()) +
                    " iterations under a disabled Join, plain DDP " + std::to_string(plain.iterations()));

  auto uneven_model = Mlp(29);
  DistributedDataParallel uneven(uneven_model, {.process_group = pg});
  Join join(uneven, {.throw_on_early_termination = true, .enable = false});
  const int mine = rank == 0 ? 1 : 2;
  std::string error;
  try {
    for (int s = 0; s < mine; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(uneven(x), y));
    }
    before = pg->collectives_run();
    join.Wait();
    WORKER_EXPECT(pg->collectives_run() == before,
                  "rank " + std::to_string(rank) + ": a disabled Join's Wait ran " +
                      std::to_string(pg->collectives_run() - before) + " collective(s)");
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (rank == 0) {
    WORKER_EXPECT(error.empty(), "rank 0 (out of inputs first) threw under a disabled Join: " + error);
    // Alive, so that the others' failure is their timeout, not this exit.
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
  } else {
    WORKER_EXPECT(error.find("TIMED_OUT") != std::string::npos &&
                      error.find("ran out of inputs") == std::string::npos,
                  "rank " + std::to_string(rank) + ": the extra backward under a disabled Join should time out "
                  "waiting for rank 0, as without Join; got: " + (error.empty() ? "no error" : error));
    testing::MarkThisRankDone(*pg);
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ADisabledJoinRunsNoCollectiveAndLeavesTrainingAsWithoutJoin) {
  // A short group timeout: the ranks with an extra batch wait it out.
  auto run = RunWorkers("join_disabled", 2, {{"DDP_TEST_TIMEOUT_MS", "3000"}}, 40000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ----------------------------------------------------- unused params ----


// static_graph: the same rank-dependent model, without the graph walk
// after the first iteration (the used set is learned once).
// collective_before_backward: each rank all-reduces a number between
// forward and backward (a loss for logging, say). Buckets of parameters a
// rank did not use must not be launched before it, or the ranks, which use
// different parameters, would pair that all-reduce with different buckets.
void CheckFindUnused(ProcessGroup& pg, bool view, double cap_mb, bool static_graph = false,
                     bool collective_before_backward = false) {
  const auto& data = testing::FashionMnist();
  const int world = pg.size(), rank = pg.rank();
  auto model = std::make_shared<Branchy>(21, rank % 2 == 0);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = cap_mb, .first_bucket_mb = cap_mb,
                                      .find_unused_parameters = !static_graph,
                                      .gradient_as_bucket_view = view, .static_graph = static_graph,
                                      .process_group = Borrow(pg)});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto reference = std::make_shared<Branchy>(21, true);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  const std::string what = std::string(static_graph ? "static_graph" : "find_unused_parameters") +
                           (view ? " (views)" : "") + " cap " + std::to_string(cap_mb) +
                           (collective_before_backward ? " (all-reduce before backward)" : "");
  for (int s = 0; s < 5; ++s) {
    auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
    opt.ZeroGrad();
    const Tensor loss = nn::loss::CrossEntropy(ddp(x), y);
    if (collective_before_backward) {
      Tensor n = nn::Full({1}, rank + 1);
      pg.AllReduce(n, transport::ReduceOp::kSum, "between forward and backward").Wait();
      WORKER_EXPECT(n.Item() == world * (world + 1) / 2,
                    what + ": the all-reduce between forward and backward gave " + std::to_string(n.Item()));
    }
    nn::Backward(loss);
    for (const auto& [name, p] : model->NamedParameters()) {
      const bool never = name.rfind("never.", 0) == 0;
      WORKER_EXPECT(p.grad().defined() != never,
                    what + ": `" + name + "` " + (never ? "has" : "lacks") + " a gradient");
    }
    opt.Step();
    // The reference: the mean of every rank's loss, each through its branch.
    ref_opt.ZeroGrad();
    Tensor total;
    for (int r = 0; r < world; ++r) {
      auto [xr, yr] = testing::Batch(data, (s * world + r) * kBatch, kBatch);
      reference->use_a_ = r % 2 == 0;
      Tensor l = nn::loss::CrossEntropy((*reference)(xr), yr) * (1.0 / world);
      total = total.defined() ? total + l : l;
    }
    nn::Backward(total);
    ref_opt.Step();
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
  WORKER_EXPECT(testing::SameOnAllRanks(pg, testing::HashState(*model)), what + ": replicas differ");
}

DDP_TEST_WORKER(find_unused) {
  auto pg = testing::WorkerGroup();
  CheckFindUnused(*pg, false, 25);
  CheckFindUnused(*pg, true, 25);
  CheckFindUnused(*pg, false, 1e-9);  // one bucket per parameter
  CheckFindUnused(*pg, true, 1e-9);
  CheckFindUnused(*pg, false, 25, /*static_graph=*/true);
  CheckFindUnused(*pg, true, 1e-9, /*static_graph=*/true);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, FindUnusedParametersWithRankDependentBranch) {
  auto run = RunWorkers("find_unused", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

DDP_TEST_WORKER(find_unused_collective) {
  auto pg = testing::WorkerGroup();
  CheckFindUnused(*pg, false, 1e-9, false, /*collective_before_backward=*/true);
  CheckFindUnused(*pg, true, 25, false, true);
  CheckFindUnused(*pg, true, 1e-9, /*static_graph=*/true, true);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, FindUnusedParametersWithACollectiveBetweenForwardAndBackward) {
  auto run = RunWorkers("find_unused_collective", 2, {{"DDP_TEST_TIMEOUT_MS", "5000"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Without the option: the next forward throws naming the parameter, on
// every rank, instead of hanging. DDP_TEST_CASE=same: `never` is unused
// everywhere; =rank: every rank misses a different branch too (one bucket
// per parameter, so some ranks launch buckets the others never will).
DDP_TEST_WORKER(unused_error) {
  auto pg = testing::WorkerGroup();
  const std::string which = std::getenv("DDP_TEST_CASE");
  const auto& data = testing::FashionMnist();
  auto model = std::make_shared<Branchy>(21, which == "same" ? true : pg->rank() % 2 == 0);
  const double cap = which == "same" ? 25 : 1e-9;
  DistributedDataParallel ddp(model, {.bucket_cap_mb = cap, .first_bucket_mb = cap, .process_group = pg});
  std::string message;
  const char* where = "nowhere";
  try {
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
      where = "forward";
      Tensor loss = nn::loss::CrossEntropy(ddp(x), y);
      where = "backward";
      nn::Backward(loss);
    }
  } catch (const std::exception& e) {
    message = e.what();
  }
  std::fprintf(stderr, "error in %s: %s\n", where, message.c_str());
  // From the backward itself: no optimizer step can take the gradients.
  WORKER_EXPECT(std::string(where) == "backward", std::string("thrown by the ") + where);
  WORKER_EXPECT(message.find("received no gradient") != std::string::npos, message);
  WORKER_EXPECT(message.find("find_unused_parameters") != std::string::npos, message);
  if (which == "same") {
    WORKER_EXPECT(message.find("`never.weight`") != std::string::npos, message);
    WORKER_EXPECT(message.find("`never.bias`") != std::string::npos, message);
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, UnusedParameterWithoutTheOptionIsNamed) {
  for (const char* which : {"same", "rank"}) {
    auto run = RunWorkers("unused_error", 2, {{"DDP_TEST_CASE", which}}, 30000);
    EXPECT_TRUE(run.AllSucceeded()) << which << "\n" << testing::AllOutput(run);
  }
}

// ------------------------------------------------- unfinished iteration ----

// The first step of `steps` that throws: its message, its index (-1: none
// threw) and how long it ran before throwing.
struct FirstFailure {
  std::string message;
  int step = -1;
  double seconds = 0;
};
FirstFailure RunUntilAStepThrows(int steps, const std::function<void(int)>& step) {
  FirstFailure f;
  for (int s = 0; s < steps && f.step < 0; ++s) {
    const auto start = std::chrono::steady_clock::now();
    try {
      step(s);
    } catch (const std::exception& e) {
      f = {e.what(), s, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
    }
  }
  std::fprintf(stderr, "step %d, after %.2f s: %s\n", f.step, f.seconds, f.message.c_str());
  return f;
}

// A hook on `p` that throws "on purpose" while `*now` is set, and the
// backward of callers that carry on past that failure (any other rethrown).
void ThrowFromGradientHookWhile(const Tensor& p, const bool* now) {
  p.RegisterPostAccumulateGradHook([now](const Tensor&) {
    if (*now) throw std::runtime_error("a failure inside backward, on purpose");
  });
}
void BackwardPastThePurposefulFailure(const Tensor& loss) {
  try {
    nn::Backward(loss);
  } catch (const std::runtime_error& e) {
    if (std::string(e.what()).find("on purpose") == std::string::npos) throw;
  }
}

// A synchronizing forward whose backward never finished: the next
// synchronizing forward on that rank throws, saying why, and aborts the
// group, so that the ranks waiting for its gradients fail within moments
// (the deadline is 60 s) instead of pairing collectives of different
// iterations. DDP_TEST_CASE=no_backward: rank 1 skips one backward (as for a
// NaN loss); =no_gradient: every rank backpropagates a loss that no output
// of forward contributes to; =backward_threw: a hook throws partway through
// rank 1's backward, and the caller carries on.
DDP_TEST_WORKER(unfinished_iteration) {
  auto pg = testing::WorkerGroup();
  const std::string which = std::getenv("DDP_TEST_CASE");
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto model = Mlp(7);
  DistributedDataParallel ddp(model, {.process_group = pg});
  bool throw_now = false;
  // The last layer's bias: among the first gradients of backward.
  if (which == "backward_threw" && rank == 1) {
    ThrowFromGradientHookWhile(model->NamedParameters().back().second, &throw_now);
  }
  const Tensor extra = nn::Zeros({1}).set_requires_grad(true);
  const auto [message, failed_at, waited] = RunUntilAStepThrows(4, [&](int s) {
    auto [x, y] = testing::Batch(data, (s * pg->size() + rank) * kBatch, kBatch);
    Tensor out = ddp(x);
    Tensor loss = nn::loss::CrossEntropy(out, y);
    if (s == 1 && which == "no_backward" && rank == 1) return;
    if (s == 1 && which == "no_gradient") loss = nn::loss::CrossEntropy(out.Detach(), y) + nn::ops::Sum(extra);
    throw_now = s == 1;
    BackwardPastThePurposefulFailure(loss);
  });
  WORKER_EXPECT(message.find("previous iteration's gradient reduction did not finish") != std::string::npos, message);
  const bool culprit = which == "no_gradient" || rank == 1;
  if (culprit) {
    WORKER_EXPECT(failed_at == 2, "failed at step " + std::to_string(failed_at));
    WORKER_EXPECT(message.find("on rank " + std::to_string(rank)) != std::string::npos, message);
    WORKER_EXPECT(message.find(which == "backward_threw" ? "stopped partway" : "no parameter received a gradient") !=
                      std::string::npos,
                  message);
  } else {
    WORKER_EXPECT(failed_at == 1 || failed_at == 2, "failed at step " + std::to_string(failed_at));
    WORKER_EXPECT(waited < 10, "waited " + std::to_string(waited) + " s for the rank that did not finish");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AnIterationThatDidNotFinishFailsTheNextForward) {
  for (const char* which : {"no_backward", "no_gradient", "backward_threw"}) {
    auto run = RunWorkers("unfinished_iteration", 2, {{"DDP_TEST_CASE", which}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                          30000);
    EXPECT_TRUE(run.AllSucceeded()) << which << "\n" << testing::AllOutput(run);
  }
}

// Rank 1's backward throws after launching some buckets, the caller carries
// on, and its next forward runs under NoSync on a model with buffers: that
// forward synchronizes no gradients but broadcasts the buffers, which would
// pair with the bucket reductions rank 0 still waits in. It is refused as
// the next synchronizing forward is, and rank 0 fails within moments.
DDP_TEST_WORKER(unfinished_then_buffers) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  nn::Generator gen(9);
  auto model = std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<nn::modules::Flatten>(), std::make_shared<nn::modules::Linear>(784, 32, true, gen),
      std::make_shared<nn::modules::BatchNorm1d>(32), std::make_shared<nn::modules::ReLU>(),
      std::make_shared<nn::modules::Linear>(32, 10, true, gen)});
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 0.01, .first_bucket_mb = 0.01, .process_group = pg});
  bool throw_now = false;
  // The first weight's gradient comes last: the buckets before it are out.
  if (rank == 1) ThrowFromGradientHookWhile(model->NamedParameters().front().second, &throw_now);
  const auto [message, failed_at, waited] = RunUntilAStepThrows(3, [&](int s) {
    auto [x, y] = testing::Batch(data, (s * pg->size() + rank) * kBatch, kBatch);
    if (s == 2) {
      auto no_sync = ddp.NoSync();
      (void)ddp(x);
      return;
    }
    Tensor loss = nn::loss::CrossEntropy(ddp(x), y);
    throw_now = s == 1;
    BackwardPastThePurposefulFailure(loss);
  });
  if (rank == 1) {
    WORKER_EXPECT(failed_at == 2, "failed at step " + std::to_string(failed_at));
    WORKER_EXPECT(message.find("stopped partway") != std::string::npos, message);
  } else {
    WORKER_EXPECT(failed_at == 1 || failed_at == 2, "failed at step " + std::to_string(failed_at));
    WORKER_EXPECT(message.find("stopped partway") != std::string::npos, message);
    WORKER_EXPECT(waited < 10, "waited " + std::to_string(waited) + " s for the rank that did not finish");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AForwardThatBroadcastsBuffersAfterAnUnfinishedBackwardIsRefused) {
  auto run = RunWorkers("unfinished_then_buffers", 2, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1 leaves a synchronizing iteration unfinished and the caller
// unwinds, destroying its DistributedDataParallel while rank 0 waits for it
// in that iteration's collectives. The destruction aborts the group, so
// rank 0 fails within moments naming it, not at the group's timeout (rank 1
// stays alive meanwhile, so its exit cannot be what rank 0 notices).
// DDP_TEST_CASE says how rank 1 leaves the iteration:
//   backward_stopped (the default): a hook throws partway through backward,
//     and rank 0 waits for the buckets rank 1 never launched;
//   no_backward: the loss computation throws after forward, before
//     backward, and rank 0 waits for every bucket;
//   end_never_ran: with find_unused_parameters, a hook that runs after the
//     last gradient throws, so every bucket is launched but the end of
//     backward is not reached, and rank 0 waits in the all-reduce of the
//     unused-parameter map.
DDP_TEST_WORKER(destroyed_mid_backward) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  const char* which_env = std::getenv("DDP_TEST_CASE");
  const std::string which = which_env != nullptr ? which_env : "backward_stopped";
  auto model = Mlp(7);
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  try {
    DistributedDataParallel ddp(model, {.bucket_cap_mb = 0.05, .first_bucket_mb = 0.05,
                                        .find_unused_parameters = which == "end_never_ran", .process_group = pg});
    if (rank == 1 && which == "backward_stopped") {
      // The first weight's gradient comes last: the buckets before it are
      // launched, the ones after it never are.
      model->NamedParameters().front().second.RegisterPostAccumulateGradHook(
          [](const Tensor&) { throw std::runtime_error("a failure inside backward, on purpose"); });
    }
    if (rank == 1 && which == "end_never_ran") {
      // Registered after the wrapper's hooks: the wrapper has taken every
      // gradient when the last of these throws.
      const auto params = model->NamedParameters();
      auto seen = std::make_shared<size_t>(0);
      for (const auto& [name, p] : params) {
        p.RegisterPostAccumulateGradHook([seen, n = params.size()](const Tensor&) {
          if (++*seen == n) throw std::runtime_error("a failure after the last gradient, on purpose");
        });
      }
    }
    const Tensor out = ddp(x);
    if (rank == 1 && which == "no_backward") throw std::runtime_error("a failure computing the loss, on purpose");
    nn::Backward(nn::loss::CrossEntropy(out, y));
  } catch (const std::exception& e) {
    message = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (rank == 1) {
    WORKER_EXPECT(message.find("on purpose") != std::string::npos, message);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
  } else {
    testing::MarkThisRankDone(*pg);
    std::fprintf(stderr, "%s: rank 0 after %.2f s: %s\n", which.c_str(), seconds, message.c_str());
    WORKER_EXPECT(message.find("DistributedDataParallel on rank 1 was destroyed in the middle of an iteration") !=
                      std::string::npos,
                  message);
    const char* state = which == "no_backward"   ? "its backward never started"
                        : which == "end_never_ran" ? "the end of its backward never ran"
                                                   : "its backward stopped partway";
    WORKER_EXPECT(message.find(state) != std::string::npos, message);
    WORKER_EXPECT(seconds < 8, "rank 0 failed after " + std::to_string(seconds) + " s");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, DestroyedInTheMiddleOfABackwardAbortsTheGroup) {
  auto run = RunWorkers("destroyed_mid_backward", 2, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The peers' deadline is 20 s: without the abort, rank 0 would wait past
// the 8 s it is given.
TEST(DdpFeaturesTest, DestroyedAfterForwardBeforeBackwardAbortsTheGroup) {
  auto run = RunWorkers("destroyed_mid_backward", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_TEST_CASE", "no_backward"}}, 40000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, DestroyedBeforeTheEndOfBackwardWithUnusedParametersAbortsTheGroup) {
  auto run = RunWorkers("destroyed_mid_backward", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_TEST_CASE", "end_never_ran"}}, 40000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Forwards that need no backward leave nothing for the peers to wait on:
// a wrapper destroyed after them (an eval-mode forward with grad enabled,
// a no-grad forward, a NoSync forward, an evaluation after a finished
// training iteration) aborts nothing, and the group goes on working.
DDP_TEST_WORKER(destroyed_after_forwards_that_need_no_backward) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto model = Mlp(7);
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  for (const bool unused : {false, true}) {
    for (const std::string which : {"eval", "no_grad", "no_sync", "eval_after_training"}) {
      const std::string what = which + (unused ? " (find_unused_parameters)" : "");
      try {
        {
          DistributedDataParallel ddp(model, {.find_unused_parameters = unused, .process_group = pg});
          ddp.Train();
          if (which == "eval") {
            ddp.Eval();
            (void)ddp(x);
          } else if (which == "no_grad") {
            nn::NoGradGuard no_grad;
            (void)ddp(x);
          } else if (which == "no_sync") {
            auto no_sync = ddp.NoSync();
            (void)ddp(x);
          } else {
            nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
            ddp.Eval();
            (void)ddp(x);
          }
        }
        Tensor one = nn::Ones({1});
        pg->AllReduce(one, transport::ReduceOp::kSum, "after " + what).Wait();
        WORKER_EXPECT(one.data<float>()[0] == static_cast<float>(pg->size()),
                      what + ": the all-reduce after the wrapper summed to " + std::to_string(one.data<float>()[0]));
      } catch (const std::exception& e) {
        WORKER_EXPECT(false, what + ": " + e.what());
        return testing::WorkerExit();
      }
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, DestroyedAfterForwardsThatNeedNoBackwardLeavesTheGroupWorking) {
  auto run = RunWorkers("destroyed_after_forwards_that_need_no_backward", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}},
                        40000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1's communication hook fails (throws a std::exception or an int, or
// returns an empty Work) and its caller goes on holding the wrapper: rank 0,
// waiting in that bucket's collective, is told within moments, not at the
// 60 s timeout.
DDP_TEST_WORKER(hook_fails_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  const std::string test_case = std::getenv("DDP_TEST_CASE");
  const bool empty = test_case == "empty", nonstd = test_case == "nonstd";
  auto model = Mlp(7);
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 0.05, .first_bucket_mb = 0.05, .process_group = pg});
  const CommHook plain = hooks::AllReduceHook();
  ddp.RegisterCommHook([&](ProcessGroup& group, GradBucket& bucket) -> Work {
    if (rank == 1 && bucket.index() == 1) {
      if (empty) return Work();
      if (nonstd) throw 42;
      throw std::runtime_error("a hook failure, on purpose");
    }
    return plain(group, bucket);
  });
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  try {
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::exception& e) {
    message = e.what();
  } catch (int value) {
    message = "threw int " + std::to_string(value);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (rank == 1) {
    const char* expected = empty ? "returned an empty Work" : nonstd ? "threw int 42" : "on purpose";
    WORKER_EXPECT(message.find(expected) != std::string::npos, message);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);  // alive, holding the wrapper
  } else {
    testing::MarkThisRankDone(*pg);
    std::fprintf(stderr, "rank 0 after %.2f s: %s\n", seconds, message.c_str());
    const char* expected =
        empty    ? "rank 1: DistributedDataParallel: the communication hook returned an empty Work for bucket 1"
        : nonstd ? "DistributedDataParallel on rank 1: the communication hook threw a non-standard exception "
                   "for bucket 1"
                 : "DistributedDataParallel on rank 1: the communication hook threw for bucket 1";
    WORKER_EXPECT(message.find(expected) != std::string::npos, message);
    if (!empty && !nonstd) WORKER_EXPECT(message.find(": a hook failure, on purpose") != std::string::npos, message);
    // The bucket's first and last parameters are named, as in the label its
    // collectives take ("bucket 1 of 3 parameters `x` ... `y`").
    const auto names = ddp.BucketParameterNames();
    WORKER_EXPECT(names.size() > 1 && message.find("bucket 1 of ") != std::string::npos &&
                      message.find("`" + names[1].front() + "`") != std::string::npos &&
                      message.find("`" + names[1].back() + "`") != std::string::npos,
                  "the bucket's parameters are not named: " + message);
    WORKER_EXPECT(seconds < 8, "rank 0 failed after " + std::to_string(seconds) + " s");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AHookThatThrowsOnOneRankAbortsTheGroup) {
  auto run = RunWorkers("hook_fails_on_one_rank", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "60000"}, {"DDP_TEST_CASE", "throw"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, AHookThatThrowsANonStandardExceptionOnOneRankAbortsTheGroup) {
  auto run = RunWorkers("hook_fails_on_one_rank", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "60000"}, {"DDP_TEST_CASE", "nonstd"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, AHookThatReturnsNoWorkOnOneRankAbortsTheGroup) {
  auto run = RunWorkers("hook_fails_on_one_rank", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "60000"}, {"DDP_TEST_CASE", "empty"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1's hook task fails on the communication side (Run's task throws)
// for bucket 1, with a description that names no bucket: both ranks'
// errors still say which bucket it was, from the reducer's label.
DDP_TEST_WORKER(hook_task_fails_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  auto model = Mlp(7);
  auto [x, y] = testing::Batch(testing::FashionMnist(), rank * kBatch, kBatch);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 0.05, .first_bucket_mb = 0.05, .process_group = pg});
  // DDP_TEST_CASE=named: the description names the bucket itself, as the
  // built-in hooks' do ("fp16_compress bucket 1"), and the label adds only
  // what it lacks.
  const char* test_case = std::getenv("DDP_TEST_CASE");
  const bool named = test_case != nullptr && std::string(test_case) == "named";
  ddp.RegisterCommHook([rank, named](ProcessGroup& group, GradBucket& bucket) -> Work {
    const Tensor buffer = bucket.buffer();
    const bool fail = rank == 1 && bucket.index() == 1;
    const std::string kind = named ? "my_hook bucket " + std::to_string(bucket.index()) : "my_hook";
    return group.Run({kind, buffer.dtype(), buffer.shape()},
                     [buffer, fail](transport::Communicator* comm, transport::Deadline deadline) {
                       if (fail) throw std::runtime_error("boom");
                       return comm->AllReduce(buffer.data_ptr(), static_cast<size_t>(buffer.numel()),
                                              transport::DataType::kF32, transport::ReduceOp::kAvg,
                                              internal::Within(deadline));
                     });
  });
  std::string message;
  try {
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::exception& e) {
    message = e.what();
  }
  std::fprintf(stderr, "rank %d: %s\n", rank, message.c_str());
  if (rank == 1) {
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);  // alive, so rank 0 learns it from the abort
  } else {
    testing::MarkThisRankDone(*pg);
  }
  WORKER_EXPECT(message.find("boom") != std::string::npos, message);
  WORKER_EXPECT(message.find("my_hook bucket 1 of") != std::string::npos, message);
  WORKER_EXPECT(message.find("bucket 1 bucket 1") == std::string::npos, message);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AHookTaskThatFailsOnOneRankNamesTheBucketOnEveryRank) {
  auto run = RunWorkers("hook_task_fails_on_one_rank", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, AHookTaskNamingItsBucketIsNotGivenTheBucketTwice) {
  auto run = RunWorkers("hook_task_fails_on_one_rank", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_TEST_CASE", "named"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A hook whose task refers to the GradBucket it was given, by reference
// (comm_hooks.h allows it until the hook's Work has completed): the object
// is still the same bucket while the task runs, and the steps equal steps
// on the combined batch.
DDP_TEST_WORKER(hook_task_refers_to_its_bucket) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  auto model = Mlp(19);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 0.05, .first_bucket_mb = 0.05, .process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = Mlp(19);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  int calls = 0;
  ddp.RegisterCommHook([&calls](ProcessGroup& group, GradBucket& bucket) -> Work {
    ++calls;
    // What the task checks the bucket against when it runs.
    const size_t index = bucket.index();
    const nn::TensorImpl* first_parameter = bucket.parameters().front().impl();
    const void* data = bucket.buffer().data_ptr();
    return group.Run({"by_reference", bucket.buffer().dtype(), bucket.buffer().shape()},
                     [&bucket, index, first_parameter, data](transport::Communicator* comm,
                                                            transport::Deadline deadline) {
                       const std::string what = "bucket " + std::to_string(index);
                       if (bucket.index() != index) {
                         return transport::FailedPreconditionError(what + ": the GradBucket now says " +
                                                                   std::to_string(bucket.index()));
                       }
                       if (bucket.parameters().empty() || bucket.parameters().front().impl() != first_parameter) {
                         return transport::FailedPreconditionError(what + ": the GradBucket's parameters changed");
                       }
                       const Tensor& buffer = bucket.buffer();
                       if (buffer.data_ptr() != data) {
                         return transport::FailedPreconditionError(what + ": the GradBucket's buffer changed");
                       }
                       return comm->AllReduce(buffer.data_ptr(), static_cast<size_t>(buffer.numel()),
                                              transport::DataType::kF32, transport::ReduceOp::kSum,
                                              internal::Within(deadline));
                     });
  });
  for (int s = 0; s < 3; ++s) {  // before and after the buckets' rebuild
    auto [x, y] = testing::Batch(testing::FashionMnist(), (s * world + rank) * kBatch, kBatch);
    opt.ZeroGrad();
    calls = 0;
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    WORKER_EXPECT(calls > 0, "the hook was not called");
    opt.Step();
    ReferenceStep(*reference, ref_opt, s * world * kBatch, world * kBatch);
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off by " + std::to_string(diff));
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AHookTaskMayReferToItsGradBucketUntilItsWorkCompletes) {
  for (const char* where : {"caller", "comm"}) {
    auto run = RunWorkers("hook_task_refers_to_its_bucket", 2,
                          {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_COLLECTIVE_THREAD", where}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << where << "\n" << testing::AllOutput(run);
  }
}

// With a hook, each solo bucket (here every gradient is one, reduced in
// place in its .grad) is handed to it in a GradBucket. Once backward has
// returned, nothing of DDP's may hold that memory: ZeroGrad(set_to_none)
// frees the gradients. The GradBucket kept past backward held each
// .grad's storage until the next step's launch.
DDP_TEST_WORKER(hook_solo_bucket_freed_after_backward) {
  auto pg = testing::WorkerGroup();
  auto model = Mlp(19);
  DistributedDataParallel ddp(model, {.inplace_gradient_mb = 1e-9, .process_group = pg});
  ddp.RegisterCommHook(hooks::AllReduceHook());
  for (int s = 0; s < 2; ++s) {  // before and after the buckets' rebuild
    auto [x, y] = testing::Batch(testing::FashionMnist(), (s * pg->size() + pg->rank()) * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    std::vector<std::pair<std::string, std::weak_ptr<nn::Storage>>> grads;
    for (const auto& [name, p] : model->NamedParameters()) {
      WORKER_EXPECT(p.grad().defined(), "step " + std::to_string(s) + ": `" + name + "` has no gradient");
      grads.emplace_back(name, p.grad().storage());
    }
    nn::optim::ZeroGrad(model->NamedParameters());
    for (const auto& [name, storage] : grads) {
      WORKER_EXPECT(storage.expired(), "step " + std::to_string(s) + ": the gradient of `" + name +
                                           "` is still held after ZeroGrad(set_to_none)");
    }
  }
  return testing::WorkerExit();
}

// On the caller's thread: on the communication thread, the finished
// all-reduce's task (and the buffer it captured) is destroyed just after its
// Work says done, so the check would race with that thread.
TEST(DdpFeaturesTest, AHookedSoloBucketsGradientIsFreedAfterBackward) {
  auto run = RunWorkers("hook_solo_bucket_freed_after_backward", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_COLLECTIVE_THREAD", "caller"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Forwards that do not synchronize are not unfinished iterations: no-grad
// and eval-mode forwards, NoSync forwards without a backward, and a no-grad
// evaluation between a training forward and its backward, which still
// synchronizes. Three steps equal three steps on the combined batch.
DDP_TEST_WORKER(non_sync_forwards) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  auto model = Mlp(13);
  DistributedDataParallel ddp(model, {.process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto reference = Mlp(13);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  const Tensor held_out = testing::Batch(data, 1000, kBatch).first;
  try {
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      const Tensor out = ddp(x);
      NoGradForwardsInBothModes(ddp, held_out);
      nn::Backward(nn::loss::CrossEntropy(out, y));
      opt.Step();
      ddp.Eval();
      ddp(held_out);  // grad enabled, eval mode
      ddp.Train();
      {
        auto no_sync = ddp.NoSync();
        ddp(held_out);
      }
      ref_opt.ZeroGrad();
      auto [xa, ya] = testing::Batch(data, s * world * kBatch, world * kBatch);
      nn::Backward(nn::loss::CrossEntropy((*reference)(xa), ya));
      ref_opt.Step();
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, e.what());
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off by " + std::to_string(diff));
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "replicas differ");
  WORKER_EXPECT(ddp.iterations() == 3, "synchronizing iterations " + std::to_string(ddp.iterations()));
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ForwardsThatDoNotSynchronizeAreNoUnfinishedIterations) {
  auto run = RunWorkers("non_sync_forwards", 2, {{"DDP_TEST_TIMEOUT_MS", "5000"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Eval mode synchronizes gradients when grad is enabled, as in PyTorch:
// three steps of a model trained with Eval() set (an evaluation forward
// with grad enabled and no backward between them) equal three steps on the
// combined batch; before, each rank stepped on its own gradients. Then two
// forwards and one backward, the first under NoSync (a GAN discriminator's
// real and fake batches): two steps equal the reference's on both combined
// batches. Last, inside Join a backward after an eval-mode forward throws,
// naming the parameter, and training goes on.
DDP_TEST_WORKER(eval_mode_and_two_forwards) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  const Tensor held_out = testing::Batch(data, 1000, kBatch).first;
  try {
    auto model = Mlp(23);
    DistributedDataParallel ddp(model, {.process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    auto reference = Mlp(23);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    ddp.Eval();
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      ddp(held_out);  // no backward follows
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
      ref_opt.ZeroGrad();
      auto [xa, ya] = testing::Batch(data, s * world * kBatch, world * kBatch);
      nn::Backward(nn::loss::CrossEntropy((*reference)(xa), ya));
      ref_opt.Step();
    }
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-5, "eval mode: `" + worst + "` off by " + std::to_string(diff));
    WORKER_EXPECT(ddp.iterations() == 3, "eval mode: synchronizing iterations " + std::to_string(ddp.iterations()));
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("eval mode: ") + e.what());
  }
  try {
    auto model = Mlp(29);
    DistributedDataParallel ddp(model, {.process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    auto reference = Mlp(29);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
    for (int s = 0; s < 2; ++s) {
      const int real = 2 * s, fake = 2 * s + 1;
      auto [xr, yr] = testing::Batch(data, (real * world + rank) * kBatch, kBatch);
      auto [xf, yf] = testing::Batch(data, (fake * world + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      Tensor first;
      {
        auto no_sync = ddp.NoSync();
        first = ddp(xr);
      }
      nn::Backward(nn::loss::CrossEntropy(first, yr) + nn::loss::CrossEntropy(ddp(xf), yf));
      opt.Step();
      ref_opt.ZeroGrad();
      auto [xra, yra] = testing::Batch(data, real * world * kBatch, world * kBatch);
      auto [xfa, yfa] = testing::Batch(data, fake * world * kBatch, world * kBatch);
      nn::Backward(nn::loss::CrossEntropy((*reference)(xra), yra) +
                   nn::loss::CrossEntropy((*reference)(xfa), yfa));
      ref_opt.Step();
    }
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-5, "two forwards: `" + worst + "` off by " + std::to_string(diff));
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "two forwards: replicas differ");
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("two forwards: ") + e.what());
  }
  try {
    auto model = Mlp(31);
    DistributedDataParallel ddp(model, {.process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    Join join(ddp);
    auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
    ddp.Eval();
    std::string message;
    try {
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    } catch (const std::exception& e) {
      message = e.what();
    }
    WORKER_EXPECT(message.find("after an eval-mode forward inside Join") != std::string::npos &&
                      message.find("parameter `") != std::string::npos,
                  "eval under Join: " + message);
    ddp.Train();
    opt.ZeroGrad();
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    opt.Step();
    join.Wait();
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "eval under Join: replicas differ");
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("eval under Join: ") + e.what());
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, EvalModeSynchronizesAndTwoForwardsTakeNoSyncOnTheFirst) {
  auto run = RunWorkers("eval_mode_and_two_forwards", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The other order of two forwards and one backward: the synchronizing
// forward first, then one under NoSync, and one backward through both. The
// backward is the first forward's, so it synchronizes everything (as in
// PyTorch); the NoSync forward used to disarm it, so each rank stepped its
// local gradients and the replicas drifted apart. Both forwards use every
// parameter (with find_unused_parameters too: a parameter only the NoSync
// forward reaches is MultiTaskNoSyncForward's case). Checked against one
// process on the combined batches.
void CheckSyncThenNoSyncForward(ProcessGroup& pg, bool find_unused, bool view) {
  const auto& data = testing::FashionMnist();
  const int world = pg.size(), rank = pg.rank();
  const std::string what = std::string("sync then NoSync forward") + (find_unused ? " (find unused)" : "") +
                           (view ? " (views)" : "");
  auto model = Mlp(rank == 0 ? 41 : 60 + rank);
  DistributedDataParallel ddp(model, {.find_unused_parameters = find_unused, .gradient_as_bucket_view = view,
                                      .process_group = Borrow(pg)});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = Mlp(41);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  for (int s = 0; s < 2; ++s) {
    const int first = 2 * s, second = 2 * s + 1;
    auto [x1, y1] = testing::Batch(data, (first * world + rank) * kBatch, kBatch);
    auto [x2, y2] = testing::Batch(data, (second * world + rank) * kBatch, kBatch);
    opt.ZeroGrad();
    Tensor a = ddp(x1);
    Tensor b;
    {
      auto no_sync = ddp.NoSync();
      b = ddp(x2);
    }
    nn::Backward(nn::loss::CrossEntropy(a, y1) + nn::loss::CrossEntropy(b, y2));
    ref_opt.ZeroGrad();
    auto [x1a, y1a] = testing::Batch(data, first * world * kBatch, world * kBatch);
    auto [x2a, y2a] = testing::Batch(data, second * world * kBatch, world * kBatch);
    Tensor ra = (*reference)(x1a);
    nn::Backward(nn::loss::CrossEntropy(ra, y1a) + nn::loss::CrossEntropy((*reference)(x2a), y2a));
    const auto ref_params = reference->NamedParameters();
    size_t k = 0;
    for (const auto& [name, p] : model->NamedParameters()) {
      const Tensor& expected = ref_params[k++].second.grad();
      if (!expected.defined()) {
        WORKER_EXPECT(!p.grad().defined(), what + ": `" + name + "` has a gradient, expected none");
        continue;
      }
      WORKER_EXPECT(p.grad().defined(), what + ": `" + name + "` has no gradient");
      if (!p.grad().defined()) continue;
      const double diff = testing::RelativeDifference(p.grad(), expected);
      WORKER_EXPECT(diff <= 1e-5, what + ": step " + std::to_string(s) + ": `" + name +
                                      "`'s gradient is off the averaged one by " + std::to_string(diff));
    }
    opt.Step();
    ref_opt.Step();
  }
  WORKER_EXPECT(testing::SameOnAllRanks(pg, testing::HashState(*model)), what + ": replicas differ");
  WORKER_EXPECT(ddp.iterations() == 2, what + ": synchronizing iterations " + std::to_string(ddp.iterations()));
}

DDP_TEST_WORKER(sync_then_no_sync_forward) {
  auto pg = testing::WorkerGroup();
  for (bool find_unused : {false, true}) {
    for (bool view : {false, true}) {
      try {
        CheckSyncThenNoSyncForward(*pg, find_unused, view);
      } catch (const std::exception& e) {
        WORKER_EXPECT(false, std::string("sync then NoSync forward: ") + e.what());
        return testing::WorkerExit();
      }
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ANoSyncForwardAfterASynchronizingOneLeavesItsBackwardSynchronizing) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("sync_then_no_sync_forward", n, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 90000);
    EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  }
}

// An eval-mode forward with grad enabled prepares a backward too (outside
// Join it synchronizes, as PyTorch's does): a forward under NoSync after it,
// in training mode, and one backward through that forward's outputs is the
// eval-mode forward's backward, so it averages every gradient, as in
// PyTorch, where the reducer stays prepared by the first forward. The
// NoSync forward used to disarm it, so each rank stepped its local
// gradients and the replicas drifted apart. Checked against one process on
// the combined batch, and that the replicas stay bitwise identical.
void CheckEvalThenNoSyncForward(ProcessGroup& pg, bool find_unused, bool view, bool static_graph) {
  const auto& data = testing::FashionMnist();
  const int world = pg.size(), rank = pg.rank();
  const std::string what = std::string("eval then NoSync forward") + (find_unused ? " (find unused)" : "") +
                           (view ? " (views)" : "") + (static_graph ? " (static graph)" : "");
  auto model = Mlp(rank == 0 ? 47 : 80 + rank);
  DistributedDataParallel ddp(model, {.find_unused_parameters = find_unused, .gradient_as_bucket_view = view,
                                      .static_graph = static_graph, .process_group = Borrow(pg)});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = Mlp(47);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  const Tensor held_out = testing::Batch(data, 1000, kBatch).first;
  for (int s = 0; s < 2; ++s) {
    auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
    opt.ZeroGrad();
    model->Eval();
    ddp(held_out);  // grad enabled, no backward of its own
    model->Train();
    Tensor b;
    {
      auto no_sync = ddp.NoSync();
      b = ddp(x);
    }
    nn::Backward(nn::loss::CrossEntropy(b, y));
    ref_opt.ZeroGrad();
    auto [xa, ya] = testing::Batch(data, s * world * kBatch, world * kBatch);
    nn::Backward(nn::loss::CrossEntropy((*reference)(xa), ya));
    const auto ref_params = reference->NamedParameters();
    size_t k = 0;
    for (const auto& [name, p] : model->NamedParameters()) {
      const Tensor& expected = ref_params[k++].second.grad();
      WORKER_EXPECT(p.grad().defined(), what + ": `" + name + "` has no gradient");
      if (!p.grad().defined()) continue;
      const double diff = testing::RelativeDifference(p.grad(), expected);
      WORKER_EXPECT(diff <= 1e-5, what + ": step " + std::to_string(s) + ": `" + name +
                                      "`'s gradient is off the averaged one by " + std::to_string(diff));
    }
    opt.Step();
    ref_opt.Step();
  }
  WORKER_EXPECT(testing::SameOnAllRanks(pg, testing::HashState(*model)), what + ": replicas differ");
  WORKER_EXPECT(ddp.iterations() == 2, what + ": synchronizing iterations " + std::to_string(ddp.iterations()));
}

DDP_TEST_WORKER(eval_then_no_sync_forward) {
  auto pg = testing::WorkerGroup();
  for (bool static_graph : {false, true}) {
    for (bool find_unused : {false, true}) {
      for (bool view : {false, true}) {
        try {
          CheckEvalThenNoSyncForward(*pg, find_unused, view, static_graph);
        } catch (const std::exception& e) {
          WORKER_EXPECT(false, std::string("eval then NoSync forward: ") + e.what());
          return testing::WorkerExit();
        }
      }
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ANoSyncForwardAfterAnEvalModeForwardLeavesItsBackwardSynchronizing) {
  auto run = RunWorkers("eval_then_no_sync_forward", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 90000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A backward that fails (here: head b and `never` get no gradient, without
// find_unused_parameters) throws and aborts the group; it used to keep its
// buckets' memory until the wrapper was destroyed: a gradient reduced in
// place (a bucket of its own) stayed referenced by that bucket, and by the
// GradBucket a communication hook was given, after ZeroGrad dropped .grad.
// Now they go at the failure: once ZeroGrad has dropped .grad, nothing holds
// any gradient's memory. With the default hook and with a registered one.
int FailedBackwardFreesItsBuckets(bool with_hook) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const std::string what = with_hook ? "with a hook" : "default hook";
  auto model = std::make_shared<Branchy>(53, /*use_a=*/true);
  // Every gradient a bucket of its own, reduced in place in .grad.
  DistributedDataParallel ddp(model, {.inplace_gradient_mb = 1e-6, .process_group = pg});
  if (with_hook) ddp.RegisterCommHook(hooks::AllReduceHook());
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  std::string message;
  try {
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::exception& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("received no gradient") != std::string::npos, what + ": " + message);
  std::vector<std::pair<std::string, std::weak_ptr<nn::Storage>>> grads;
  for (const auto& [name, p] : model->NamedParameters()) {
    if (p.grad().defined()) grads.emplace_back(name, p.grad().storage());
  }
  WORKER_EXPECT(!grads.empty(), what + ": no parameter has a gradient after the failed backward");
  opt.ZeroGrad();
  for (const auto& [name, storage] : grads) {
    WORKER_EXPECT(storage.expired(), what + ": the memory of `" + name + "`'s gradient is still held after "
                                            "the failed backward and ZeroGrad");
  }
  return testing::WorkerExit();
}

DDP_TEST_WORKER(failed_backward_frees_buckets) { return FailedBackwardFreesItsBuckets(false); }
DDP_TEST_WORKER(failed_backward_frees_hook_buckets) { return FailedBackwardFreesItsBuckets(true); }

TEST(DdpFeaturesTest, AFailedBackwardFreesItsBucketsAtTheFailure) {
  for (const char* worker : {"failed_backward_frees_buckets", "failed_backward_frees_hook_buckets"}) {
    auto run = RunWorkers(worker, 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << worker << "\n" << testing::AllOutput(run);
  }
}

// A shadowed backward that fails: rank 1 ran out of inputs and shadows rank
// 0's backward in Join::Wait, where rank 0's communication hook throws for
// bucket 1 and aborts the group. Rank 1's Wait throws, and what its buckets
// took for the shadowed backward (the zero gradients it contributed, held by
// the GradBucket each hook call was given) is dropped then; it used to stay
// until the wrapper was destroyed.
DDP_TEST_WORKER(failed_shadow_backward_frees_buckets) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto model = Mlp(7);
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 0.05, .first_bucket_mb = 0.05, .process_group = pg});
  const CommHook plain = hooks::AllReduceHook();
  std::vector<std::weak_ptr<nn::Storage>> given;
  ddp.RegisterCommHook([&](ProcessGroup& group, GradBucket& bucket) -> Work {
    if (rank == 0 && bucket.index() == 1) throw std::runtime_error("a hook failure, on purpose");
    if (rank == 1) given.push_back(bucket.buffer().storage());
    return plain(group, bucket);
  });
  std::string message;
  {
    Join join(ddp);
    try {
      if (rank == 0) nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      join.Wait();
    } catch (const std::exception& e) {
      message = e.what();
    }
  }
  WORKER_EXPECT(!message.empty(), "rank " + std::to_string(rank) + " did not fail");
  if (rank == 0) {
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  WORKER_EXPECT(given.size() > 1, "the hook was given " + std::to_string(given.size()) + " buckets");
  for (size_t b = 0; b < given.size(); ++b) {
    WORKER_EXPECT(given[b].expired(), "the zero gradients of shadowed bucket " + std::to_string(b) +
                                          " are still held after Join::Wait threw");
  }
  testing::MarkThisRankDone(*pg);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AFailedShadowedBackwardFreesItsBuckets) {
  auto run = RunWorkers("failed_shadow_backward_frees_buckets", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A multi-task step with find_unused_parameters: a = ddp(xa) takes head a,
// {NoSync; b = ddp(xb);} takes head b, and the backward is loss(a)'s only.
// As in PyTorch, the forward that prepared the backward alone decides the
// unused set, so head b (and `never`) get no gradient and the step equals
// one process's on the combined batch. The NoSync forward used to take head
// b off the unused set, so that backward aborted the group with "received
// no gradient". Last, loss(a) + loss(b): head b's gradient is an error on
// every rank, naming its parameter and the NoSync forward (PyTorch fails
// it too, "marked as ready twice").
// The advice of the error for a gradient through a NoSync forward's outputs
// (checked to work by multi_task_no_sync_first).
constexpr char kNoSyncRemedy[] = "run the NoSync forward and its backward before the synchronizing forward";

DDP_TEST_WORKER(multi_task_no_sync_forward) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  for (const bool view : {false, true}) {
    const std::string what = std::string("multi-task") + (view ? " (views)" : "");
    auto model = std::make_shared<Branchy>(rank == 0 ? 43 : 70 + rank, /*use_a=*/true);
    DistributedDataParallel ddp(model, {.find_unused_parameters = true, .gradient_as_bucket_view = view,
                                        .process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    auto reference = std::make_shared<Branchy>(43, /*use_a=*/true);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
    try {
      for (int s = 0; s < 2; ++s) {
        auto [xa, ya] = testing::Batch(data, (2 * s * world + rank) * kBatch, kBatch);
        auto [xb, yb] = testing::Batch(data, ((2 * s + 1) * world + rank) * kBatch, kBatch);
        opt.ZeroGrad();
        model->use_a_ = true;
        const Tensor a = ddp(xa);
        Tensor b;
        {
          auto no_sync = ddp.NoSync();
          model->use_a_ = false;
          b = ddp(xb);
        }
        nn::Backward(nn::loss::CrossEntropy(a, ya));
        for (const auto& [name, p] : model->NamedParameters()) {
          const bool head = name.rfind("a.", 0) == 0 || name.rfind("trunk.", 0) == 0;
          WORKER_EXPECT(p.grad().defined() == head, what + ": `" + name + "` " +
                                                        (head ? "has no gradient" : "has a gradient"));
        }
        opt.Step();
        ref_opt.ZeroGrad();
        auto [xr, yr] = testing::Batch(data, 2 * s * world * kBatch, world * kBatch);
        nn::Backward(nn::loss::CrossEntropy((*reference)(xr), yr));
        ref_opt.Step();
      }
    } catch (const std::exception& e) {
      WORKER_EXPECT(false, what + ": " + e.what());
      return testing::WorkerExit();
    }
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), what + ": replicas differ");
    WORKER_EXPECT(ddp.iterations() == 2, what + ": synchronizing iterations " + std::to_string(ddp.iterations()));
  }
  // Both losses in one backward: head b is unused for the forward that
  // prepared it. This aborts the group, so it comes last.
  auto model = std::make_shared<Branchy>(43, /*use_a=*/true);
  DistributedDataParallel ddp(model, {.find_unused_parameters = true, .process_group = pg});
  auto [xa, ya] = testing::Batch(data, rank * kBatch, kBatch);
  auto [xb, yb] = testing::Batch(data, (world + rank) * kBatch, kBatch);
  std::string message;
  try {
    const Tensor a = ddp(xa);
    Tensor b;
    {
      auto no_sync = ddp.NoSync();
      model->use_a_ = false;
      b = ddp(xb);
    }
    nn::Backward(nn::loss::CrossEntropy(a, ya) + nn::loss::CrossEntropy(b, yb));
  } catch (const std::exception& e) {
    message = e.what();
  }
  std::fprintf(stderr, "loss on both: %s\n", message.c_str());
  WORKER_EXPECT(message.find("parameter `b.") != std::string::npos, "loss on both: " + message);
  WORKER_EXPECT(message.find("through the outputs of a forward run under NoSync") != std::string::npos,
                "loss on both: " + message);
  WORKER_EXPECT(message.find(kNoSyncRemedy) != std::string::npos, "loss on both: " + message);
  return testing::WorkerExit();
}

// What the error above tells the user to do: the NoSync forward and its
// backward before the synchronizing forward. Head b's gradient then
// accumulates locally and the synchronizing backward averages it with head
// a's, so the step equals one process's on both batches. The message used
// to say to run that backward inside the NoSync scope, as it is: while the
// synchronizing forward's backward awaits, any backward is taken as that
// one, inside NoSync too, and head b's gradient failed the same way again.
DDP_TEST_WORKER(multi_task_no_sync_first) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  auto model = std::make_shared<Branchy>(rank == 0 ? 43 : 70 + rank, /*use_a=*/true);
  DistributedDataParallel ddp(model, {.find_unused_parameters = true, .process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = std::make_shared<Branchy>(43, /*use_a=*/true);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  try {
    for (int s = 0; s < 2; ++s) {
      auto [xa, ya] = testing::Batch(data, (2 * s * world + rank) * kBatch, kBatch);
      auto [xb, yb] = testing::Batch(data, ((2 * s + 1) * world + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      {
        auto no_sync = ddp.NoSync();
        model->use_a_ = false;
        nn::Backward(nn::loss::CrossEntropy(ddp(xb), yb));
      }
      model->use_a_ = true;
      nn::Backward(nn::loss::CrossEntropy(ddp(xa), ya));
      opt.Step();
      ref_opt.ZeroGrad();
      auto [xra, yra] = testing::Batch(data, 2 * s * world * kBatch, world * kBatch);
      auto [xrb, yrb] = testing::Batch(data, (2 * s + 1) * world * kBatch, world * kBatch);
      reference->use_a_ = true;
      const Tensor ra = nn::loss::CrossEntropy((*reference)(xra), yra);
      reference->use_a_ = false;
      nn::Backward(ra + nn::loss::CrossEntropy((*reference)(xrb), yrb));
      ref_opt.Step();
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, e.what());
    return testing::WorkerExit();
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off by " + std::to_string(diff));
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "replicas differ");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, TheRemedyTheMultiTaskErrorGivesTrains) {
  auto run = RunWorkers("multi_task_no_sync_first", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 90000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, MultiTaskNoSyncForwardLeavesTheUnusedSetOfTheSynchronizingOne) {
  auto run = RunWorkers("multi_task_no_sync_forward", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 90000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// f16 buckets are averaged by dividing before the sum: a gradient of 40000
// on each of two ranks (f16's largest value is 65504) averages to 40000,
// where summing first made it inf.
DDP_TEST_WORKER(f16_large_gradients) {
  auto pg = testing::WorkerGroup();
  nn::Generator gen(3);
  auto model = std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<nn::modules::Linear>(4, 2, false, gen)});
  model->To(nn::DType::kFloat16);
  for (bool view : {false, true}) {
    DistributedDataParallel ddp(model, {.gradient_as_bucket_view = view, .process_group = pg});
    for (const auto& [name, p] : model->NamedParameters()) p.set_grad(Tensor());
    const Tensor x = nn::Ones({1, 4}, {.dtype = nn::DType::kFloat16});
    nn::Backward(nn::ops::Sum(ddp(x)) * 40000.0);
    for (const auto& [name, p] : model->NamedParameters()) {
      for (double v : p.grad().ToVector<double>()) {
        WORKER_EXPECT(v == 40000, "`" + name + "`" + (view ? " (views)" : "") + ": averaged gradient " +
                                      std::to_string(v) + ", expected 40000");
      }
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, F16BucketsAreDividedBeforeTheSum) {
  auto run = RunWorkers("f16_large_gradients", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A communication hook whose first collective outlives the wait for it
// (it sleeps 3.5 s, past the 2.2 s that backward waits for the one bucket
// under a 2 s timeout and a wait margin of 0.2 s, and then writes 42 into
// the bucket): backward throws, and the next forward must not reuse the
// bucket memory that the collective still writes. It throws, naming the
// unfinished iteration, where it used to go ahead and let the late write
// land in the next iteration's gradients (the next bucket's collective
// queued behind the late one).
DDP_TEST_WORKER(slow_collective) {
  const char* timeout_ms = std::getenv("DDP_TEST_TIMEOUT_MS");
  auto pg = ProcessGroup::CreateFromEnvironment(
      {.timeout = std::chrono::milliseconds(timeout_ms != nullptr ? std::atoi(timeout_ms) : 20000),
       .wait_margin = std::chrono::milliseconds(200)});
  const auto& data = testing::FashionMnist();
  auto model = Mlp(19);
  DistributedDataParallel ddp(model, {.inplace_gradient_mb = 0, .process_group = pg});
  int calls = 0;
  ddp.RegisterCommHook([&calls](ProcessGroup& group, GradBucket& bucket) {
    const bool slow = calls++ == 0;
    const Tensor buffer = bucket.buffer();
    return group.Run({.kind = "late hook", .dtype = buffer.dtype(), .shape = buffer.shape()},
                     [buffer, slow](transport::Communicator*, transport::Deadline) {
                       if (slow) {
                         std::this_thread::sleep_for(std::chrono::milliseconds(3500));
                         float* p = buffer.data<float>();
                         for (int64_t i = 0; i < buffer.numel(); ++i) p[i] = 42;
                       }
                       return transport::Status::Ok();
                     });
  });
  std::string first, second;
  for (int s = 0; s < 2; ++s) {
    auto [x, y] = testing::Batch(data, (s * pg->size() + pg->rank()) * kBatch, kBatch);
    try {
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    } catch (const std::exception& e) {
      (s == 0 ? first : second) = e.what();
    }
  }
  std::fprintf(stderr, "first backward: %s\nsecond iteration: %s\n", first.c_str(), second.c_str());
  WORKER_EXPECT(first.find("TIMED_OUT") != std::string::npos, "first backward: " + first);
  WORKER_EXPECT(second.find("previous iteration's gradient reduction did not finish") != std::string::npos,
                "second iteration: " + second);
  for (const auto& [name, p] : model->NamedParameters()) {
    if (!p.grad().defined()) continue;
    for (double v : p.grad().ToVector<double>()) {
      if (v == 42) {
        WORKER_EXPECT(false, "`" + name + "` got the late collective's write");
        break;
      }
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, BucketMemoryIsNotReusedWhileALateCollectiveMayWriteIt) {
  auto run = RunWorkers("slow_collective", 2, {{"DDP_TEST_TIMEOUT_MS", "2000"}, {"DDP_COLLECTIVE_THREAD", "comm"}},
                        40000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------ unexpected gradients ----

// A second backward through the outputs of one forward: its gradients would
// be added to the averaged ones unsynchronized, so the first gradient to
// arrive is an error naming its parameter, on every rank. Under NoSync the
// same backward accumulates locally, with no error, and training goes on.
DDP_TEST_WORKER(second_backward) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  for (const bool view : {false, true}) {
    auto model = Mlp(17);
    DistributedDataParallel ddp(model, {.gradient_as_bucket_view = view, .process_group = pg});
    auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
    const std::string what = view ? " (views)" : "";
    std::string message;
    try {
      const Tensor out = ddp(x);
      nn::Backward(nn::loss::CrossEntropy(out, y), Tensor(), /*retain_graph=*/true);
      nn::Backward(nn::ops::Sum(out) * 0.01);
    } catch (const std::exception& e) {
      message = e.what();
    }
    std::fprintf(stderr, "second backward%s: %s\n", what.c_str(), message.c_str());
    WORKER_EXPECT(message.find("second backward through the outputs of one forward") != std::string::npos,
                  what + ": " + message);
    WORKER_EXPECT(message.find("parameter `5.") != std::string::npos, what + ": " + message);
    WORKER_EXPECT(message.find("NoSync") != std::string::npos, what + ": " + message);
    try {
      const Tensor out = ddp(x);
      nn::Backward(nn::loss::CrossEntropy(out, y), Tensor(), true);
      {
        auto no_sync = ddp.NoSync();
        nn::Backward(nn::ops::Sum(out) * 0.01);
      }
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    } catch (const std::exception& e) {
      WORKER_EXPECT(false, what + ": " + e.what());
    }
    WORKER_EXPECT(ddp.iterations() == 3, what + ": synchronizing iterations " + std::to_string(ddp.iterations()));
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ASecondBackwardOfOneForwardIsAnError) {
  auto run = RunWorkers("second_backward", 2, {{"DDP_TEST_TIMEOUT_MS", "5000"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// find_unused_parameters: `never` is not used by forward, so it is marked
// unused after forward, but the loss adds a penalty on it. Its gradient is
// an error saying that, on every rank; the group is aborted (the
// iteration cannot finish) and the next forward repeats the error.
// DDP_TEST_CASE=copy, view (gradient_as_bucket_view: never.weight's .grad,
// zeros before, is its part of the shared bucket), per_parameter (one
// bucket per parameter, launched when backward starts: an unused one's
// .grad is reduced from a copy, so that it stays as it was), static
// (static_graph: `b`, unused in the first iteration, is used in the
// second). The penalty is computed before forward, so its gradient arrives
// last, after the unused parameters were marked ready; in view mode the
// memory being reduced must not receive it.
DDP_TEST_WORKER(unreachable_in_loss) {
  auto pg = testing::WorkerGroup();
  const std::string which = std::getenv("DDP_TEST_CASE");
  const auto& data = testing::FashionMnist();
  const bool is_static = which == "static";
  const bool reduced_in_grad = which == "view";
  const double cap = which == "per_parameter" ? 1e-9 : 25;
  auto model = std::make_shared<Branchy>(23, true);
  Tensor never_weight;
  for (const auto& [name, p] : model->NamedParameters()) {
    if (name == "never.weight") never_weight = p;
  }
  never_weight.set_grad(nn::ZerosLike(never_weight));  // as ZeroGrad(set_to_none=false) leaves it
  DistributedDataParallel ddp(model, {.bucket_cap_mb = cap, .first_bucket_mb = cap,
                                      .find_unused_parameters = !is_static,
                                      .gradient_as_bucket_view = reduced_in_grad, .static_graph = is_static,
                                      .process_group = pg});
  const Tensor held = never_weight.grad();  // in view mode, the bucket's view now
  std::string message;
  int failed_at = -1;
  for (int s = 0; s < 3 && failed_at < 0; ++s) {
    auto [x, y] = testing::Batch(data, (s * pg->size() + pg->rank()) * kBatch, kBatch);
    try {
      Tensor loss;
      if (is_static) {
        model->use_a_ = s == 0;
        loss = nn::loss::CrossEntropy(ddp(x), y);
      } else {
        const Tensor penalty = nn::ops::Sum(never_weight * never_weight) * 1e-3;
        loss = nn::loss::CrossEntropy(ddp(x), y) + penalty;
      }
      nn::Backward(loss);
    } catch (const std::exception& e) {
      message = e.what();
      failed_at = s;
    }
  }
  std::fprintf(stderr, "%s, step %d: %s\n", which.c_str(), failed_at, message.c_str());
  WORKER_EXPECT(failed_at == (is_static ? 1 : 0), "failed at step " + std::to_string(failed_at));
  if (is_static) {
    WORKER_EXPECT(message.find("parameter `b.") != std::string::npos, message);
    WORKER_EXPECT(message.find("static_graph") != std::string::npos, message);
  } else {
    WORKER_EXPECT(message.find("parameter `never.weight`") != std::string::npos, message);
    WORKER_EXPECT(message.find("not reachable from the outputs of forward") != std::string::npos, message);
    WORKER_EXPECT(message.find("inside the module's forward") != std::string::npos, message);
    if (reduced_in_grad) {
      double most = 0;
      for (double v : held.ToVector<double>()) most = std::max(most, std::abs(v));
      WORKER_EXPECT(most == 0, "the memory being reduced received the gradient (" + std::to_string(most) + ")");
    }
  }
  // The next forward says the same (this rank's, or the peer's through the abort).
  std::string again;
  try {
    ddp(testing::Batch(data, 0, kBatch).first);
  } catch (const std::exception& e) {
    again = e.what();
  }
  WORKER_EXPECT(again.find(is_static ? "static_graph" : "not reachable from the outputs") != std::string::npos,
                "the next forward: " + again);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AGradientForAParameterForwardDidNotUseIsNamed) {
  for (const char* which : {"copy", "view", "per_parameter", "static"}) {
    auto run = RunWorkers("unreachable_in_loss", 2, {{"DDP_TEST_CASE", which}, {"DDP_TEST_TIMEOUT_MS", "5000"}},
                          30000);
    EXPECT_TRUE(run.AllSucceeded()) << which << "\n" << testing::AllOutput(run);
  }
}

// static_graph, an eval-mode forward with grad enabled (its unused
// parameters are found by walking its graph: static_graph learns only from
// training iterations), and a loss with a penalty on `never.weight`, which
// forward does not use: the error names it and says what found it unused.
// It used to blame find_unused_parameters (not set) and advise setting
// static_graph (set already).
DDP_TEST_WORKER(unreachable_in_loss_static_eval) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = std::make_shared<Branchy>(23, true);
  Tensor never_weight;
  for (const auto& [name, p] : model->NamedParameters()) {
    if (name == "never.weight") never_weight = p;
  }
  DistributedDataParallel ddp(model, {.static_graph = true, .process_group = pg});
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  model->Eval();
  std::string message;
  try {
    const Tensor penalty = nn::ops::Sum(never_weight * never_weight) * 1e-3;
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y) + penalty);
  } catch (const std::exception& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("parameter `never.weight`") != std::string::npos, message);
  WORKER_EXPECT(message.find("eval-mode forward") != std::string::npos, message);
  WORKER_EXPECT(message.find("static_graph") != std::string::npos, message);
  WORKER_EXPECT(message.find("find_unused_parameters") == std::string::npos, message);
  WORKER_EXPECT(message.find("inside the module's forward") != std::string::npos, message);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AGradientForAParameterAnEvalModeForwardDidNotUseUnderStaticGraphIsNamed) {
  auto run = RunWorkers("unreachable_in_loss_static_eval", 2, {{"DDP_TEST_TIMEOUT_MS", "5000"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// trunk -> (main, aux): two outputs; a loss of `main` alone leaves `aux`
// reachable from the outputs yet without a gradient.
class TwoHeads : public Module {
 public:
  explicit TwoHeads(uint64_t seed) {
    nn::Generator gen(seed);
    trunk_ = RegisterModule("trunk", std::make_shared<nn::modules::Linear>(784, 16, true, gen));
    aux_ = RegisterModule("aux", std::make_shared<nn::modules::Linear>(16, 10, true, gen));
    main_ = RegisterModule("main", std::make_shared<nn::modules::Linear>(16, 10, true, gen));
  }
  std::vector<Tensor> Forward(const std::vector<Tensor>& inputs) override {
    const Tensor h = nn::ops::Relu((*trunk_)(nn::ops::Flatten(inputs.at(0), 1)));
    return {(*main_)(h), (*aux_)(h)};
  }
  Tensor Forward(const Tensor& x) override { return Forward(std::vector<Tensor>{x}).at(0); }
  std::string TypeName() const override { return "TwoHeads"; }

 private:
  std::shared_ptr<nn::modules::Linear> trunk_, aux_, main_;
};

// static_graph learns the used set in the first iteration, as PyTorch's
// does, from the gradients that came: an output left out of the loss makes
// its head unused for good instead of failing that iteration (the walk from
// the outputs counts it used). The result matches one process on the whole
// batch, and `aux` never gets a gradient. DDP_TEST_CASE: copy, view.
DDP_TEST_WORKER(static_graph_unused_output) {
  auto pg = testing::WorkerGroup();
  const bool view = std::string(std::getenv("DDP_TEST_CASE")) == "view";
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  auto model = std::make_shared<TwoHeads>(31);
  auto reference = std::make_shared<TwoHeads>(31);
  DistributedDataParallel ddp(model, {.gradient_as_bucket_view = view, .static_graph = true,
                                      .process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  for (int s = 0; s < 4; ++s) {
    auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
    opt.ZeroGrad();
    nn::Backward(nn::loss::CrossEntropy(ddp.Forward(std::vector<Tensor>{x}).at(0), y));
    for (const auto& [name, p] : model->NamedParameters()) {
      const bool aux = name.rfind("aux.", 0) == 0;
      WORKER_EXPECT(p.grad().defined() != aux, "step " + std::to_string(s) + ": `" + name + "` " +
                                                   (aux ? "has" : "lacks") + " a gradient");
    }
    opt.Step();
    ref_opt.ZeroGrad();
    Tensor total;
    for (int r = 0; r < world; ++r) {
      auto [xr, yr] = testing::Batch(data, (s * world + r) * kBatch, kBatch);
      Tensor l = nn::loss::CrossEntropy((*reference)(xr), yr) * (1.0 / world);
      total = total.defined() ? total + l : l;
    }
    nn::Backward(total);
    ref_opt.Step();
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off by " + std::to_string(diff));
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "replicas differ");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, StaticGraphLearnsAnOutputLeftOutOfTheLossAsUnused) {
  for (const char* which : {"copy", "view"}) {
    auto run = RunWorkers("static_graph_unused_output", 2,
                          {{"DDP_TEST_CASE", which}, {"DDP_TEST_TIMEOUT_MS", "5000"}}, 30000);
    EXPECT_TRUE(run.AllSucceeded()) << which << "\n" << testing::AllOutput(run);
  }
}

// Returns, beside this forward's output, the output of the forward before
// it, whose graph that forward's backward released (a model keeping a
// tensor across iterations). The reducer used to hook every output that
// requires grad, and RegisterHook now refuses a hook on a released node,
// so the wrapped forward threw; PyTorch's forward ignores such an output.
class ReturnsItsLastOutput : public Module {
 public:
  explicit ReturnsItsLastOutput(uint64_t seed) {
    nn::Generator gen(seed);
    head_ = RegisterModule("head", std::make_shared<nn::modules::Linear>(784, 10, true, gen));
  }
  std::vector<Tensor> Forward(const std::vector<Tensor>& inputs) override {
    Tensor out = (*head_)(nn::ops::Flatten(inputs.at(0), 1));
    Tensor last = last_;
    last_ = out;
    return {out, last};
  }
  Tensor Forward(const Tensor& x) override { return Forward(std::vector<Tensor>{x}).at(0); }
  std::string TypeName() const override { return "ReturnsItsLastOutput"; }

 private:
  std::shared_ptr<nn::modules::Linear> head_;
  Tensor last_;
};

DDP_TEST_WORKER(output_of_a_released_graph) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  auto model = std::make_shared<ReturnsItsLastOutput>(37);
  DistributedDataParallel ddp(model, {.process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
    opt.ZeroGrad();
    std::vector<Tensor> outs;
    try {
      outs = ddp.Forward(std::vector<Tensor>{x});
    } catch (const std::exception& e) {
      WORKER_EXPECT(false, "step " + std::to_string(s) + ": the forward threw: " + e.what());
      return testing::WorkerExit();
    }
    WORKER_EXPECT(outs.at(1).defined() == (s > 0), "step " + std::to_string(s) + ": second output");
    nn::Backward(nn::loss::CrossEntropy(outs.at(0), y));
    opt.Step();
  }
  WORKER_EXPECT(ddp.iterations() == 3, "iterations: " + std::to_string(ddp.iterations()));
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "replicas differ");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AnOutputWhoseGraphAnEarlierBackwardReleasedIsLeftUnwatched) {
  auto run = RunWorkers("output_of_a_released_graph", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A parameter whose data is replaced by one of another size during the
// backward (here on rank 1, from a hook on a middle layer's gradient, after
// the replaced one was copied into the bucket) no longer fits its bucket, and
// the GradBucket given to a registered hook refuses it. That refusal used to
// leave rank 0 in the bucket's all-reduce until the group's timeout (60 s);
// now the group is aborted and rank 0 fails at once.
DDP_TEST_WORKER(bucket_refused_for_the_hook) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  nn::ManualSeed(41);
  auto model = std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<nn::modules::Flatten>(), std::make_shared<nn::modules::Linear>(784, 16),
      std::make_shared<nn::modules::ReLU>(), std::make_shared<nn::modules::Linear>(16, 16),
      std::make_shared<nn::modules::ReLU>(), std::make_shared<nn::modules::Linear>(16, 10)});
  DistributedDataParallel ddp(model, {.process_group = pg});
  ddp.RegisterCommHook(hooks::AllReduceHook());
  const auto params = model->NamedParameters();
  // The middle layer's weight is ready after the last layer's bias and
  // before the first layer's gradients, which launch the (single) bucket.
  const Tensor middle = params.at(2).second;
  const Tensor replaced = params.back().second;
  nn::HookHandle handle;
  if (pg->rank() == 1) {
    handle = middle.RegisterHook([replaced](const Tensor& g) {
      replaced.SetData(nn::Zeros({100000}));  // past the end of the bucket
      return g;
    });
  }
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::exception& e) {
    message = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(!message.empty(), "the backward did not fail");
  WORKER_EXPECT(seconds < 20, "the backward took " + std::to_string(seconds) + " s to fail: " + message);
  // Rank 1 stays alive until rank 0 has its answer (at most 30 s), as a
  // process that caught the error would: its exit would tell rank 0 anyway.
  const std::string done = std::string(std::getenv("TEST_TMPDIR")) + "/bucket_refused_rank0_done";
  if (pg->rank() == 0) {
    WORKER_EXPECT(message.find("could not hand") != std::string::npos, "rank 0's error: " + message);
    std::ofstream(done) << "done";
  } else {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!std::filesystem::exists(done) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ABucketTheHookCannotBeGivenAbortsTheGroup) {
  auto run = RunWorkers("bucket_refused_for_the_hook", 2, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 120000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}


// --------------------------------------------------- broadcast_buffers ----

// Records a hash of its BatchNorm's running mean as forward reaches it, that
// is after DistributedDataParallel's buffer broadcast.
class BufferSpy : public Module {
 public:
  BufferSpy() {
    nn::Generator gen(4);
    fc_ = RegisterModule("fc", std::make_shared<nn::modules::Linear>(784, 16, true, gen));
    bn_ = RegisterModule("bn", std::make_shared<nn::modules::BatchNorm1d>(16));
    out_ = RegisterModule("out", std::make_shared<nn::modules::Linear>(16, 10, true, gen));
  }
  Tensor Forward(const Tensor& x) override {
    Tensor h = (*fc_)(nn::ops::Flatten(x, 1));
    seen = 0;
    for (float v : bn_->running_mean().ToVector<float>()) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      seen = seen * 1099511628211ull + bits;
    }
    return (*out_)(nn::ops::Relu((*bn_)(h)));
  }
  using Module::Forward;
  std::string TypeName() const override { return "BufferSpy"; }
  uint64_t seen = 0;

 private:
  std::shared_ptr<nn::modules::Linear> fc_, out_;
  std::shared_ptr<nn::modules::BatchNorm1d> bn_;
};

DDP_TEST_WORKER(broadcast_buffers) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  for (bool broadcast : {true, false}) {
    auto model = std::make_shared<BufferSpy>();
    DistributedDataParallel ddp(model, {.broadcast_buffers = broadcast, .process_group = pg});
    for (int s = 0; s < 3; ++s) {
      // Different data per rank: local statistics drift apart.
      auto [x, y] = testing::Batch(data, (s * pg->size() + pg->rank()) * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      if (s == 0) continue;  // equal at construction either way
      const bool same = testing::SameOnAllRanks(*pg, model->seen);
      WORKER_EXPECT(same == broadcast, std::string("broadcast_buffers=") + (broadcast ? "true" : "false") +
                                           ": running statistics at forward are " +
                                           (same ? "equal" : "different") + " across ranks");
    }
    // Eval forwards broadcast nothing.
    ddp.Eval();
    const uint64_t before = pg->collectives_run();
    nn::NoGradGuard no_grad;
    ddp(testing::Batch(data, 0, kBatch).first);
    WORKER_EXPECT(pg->collectives_run() == before, "an eval forward ran a collective");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, BroadcastBuffersAtEveryTrainingForward) {
  auto run = RunWorkers("broadcast_buffers", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A parameter and two buffers whose values (and, for `sized`, shape) are
// the rank's own.
class RankBuffers : public Module {
 public:
  explicit RankBuffers(int rank) {
    weight_ = RegisterParameter("weight", nn::Full({4}, rank + 10.0));
    value_ = RegisterBuffer("value", nn::Full({3}, rank));
    sized_ = RegisterBuffer("sized", nn::Full({1 + rank}, rank));
  }
  Tensor Forward(const Tensor& x) override { return nn::ops::Mul(x, weight_); }
  using Module::Forward;
  std::string TypeName() const override { return "RankBuffers"; }
  Tensor weight_, value_, sized_;
};

// With broadcast_buffers = false the buffers are each rank's own from the
// start, as in PyTorch, whose wrapping broadcasts the parameters only and
// compares only their shapes: rank 0's buffers used to overwrite every
// rank's at wrapping, and a buffer shaped differently per rank was refused
// though nothing ever sends it. Parameters still come from rank 0. With
// broadcast_buffers = true the buffers still must match and are broadcast.
DDP_TEST_WORKER(own_buffers_at_wrapping) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  {
    auto model = std::make_shared<RankBuffers>(rank);
    DistributedDataParallel ddp(model, {.broadcast_buffers = false, .process_group = pg});
    WORKER_EXPECT(model->value_.ToVector<float>() == std::vector<float>(3, static_cast<float>(rank)),
                  "rank " + std::to_string(rank) + ": buffer `value` became " +
                      std::to_string(model->value_.ToVector<float>().front()) + " at wrapping");
    WORKER_EXPECT(model->sized_.numel() == 1 + rank, "buffer `sized` changed shape");
    WORKER_EXPECT(model->weight_.ToVector<float>() == std::vector<float>(4, 10.0f),
                  "the parameter was not rank 0's after wrapping");
  }
  bool refused = false;
  try {
    auto model = std::make_shared<RankBuffers>(rank);
    DistributedDataParallel ddp(model, {.broadcast_buffers = true, .process_group = pg});
  } catch (const std::invalid_argument& e) {
    refused = std::string(e.what()).find("sized") != std::string::npos;
  }
  WORKER_EXPECT(refused, "buffers of different shapes were accepted with broadcast_buffers = true");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, WithoutBufferBroadcastsWrappingLeavesEveryRankItsOwnBuffers) {
  auto run = RunWorkers("own_buffers_at_wrapping", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The broadcasts of wrapping and of the buffers, in buckets of at most
// bucket_bytes (PyTorch's 250 MiB; 64 bytes here) rather than one flat copy
// of all tensors of a dtype and device, which doubled a large model's
// memory at wrapping. Tensors larger than the bucket (a contiguous one, sent
// in place, and a transposed one), an empty one and two dtypes: every rank
// gets the root's values (root 1), in one broadcast per bucket.
DDP_TEST_WORKER(broadcast_in_buckets) {
  auto pg = testing::WorkerGroup();
  const int root = 1;
  // The tensors as the root has them (the others hold -1 everywhere).
  auto make = [&](bool as_root) {
    std::vector<Tensor> t;
    for (int64_t n : {3, 5, 10, 4, 40}) t.push_back(nn::Empty({n}));
    t.push_back(nn::Empty({8, 8}).Transpose(0, 1));
    for (int64_t n : {6, 0, 3}) t.push_back(nn::Empty({n}, {.dtype = nn::DType::kInt64}));
    int64_t v = 0;
    for (Tensor& x : t) {
      Tensor base = x.is_contiguous() ? x : x.Transpose(0, 1);
      for (int64_t i = 0; i < base.numel(); ++i, ++v) {
        if (base.dtype() == nn::DType::kInt64) {
          base.data<int64_t>()[i] = as_root ? v : -1;
        } else {
          base.data<float>()[i] = as_root ? static_cast<float>(v) + 0.5f : -1.0f;
        }
      }
    }
    return t;
  };
  const std::vector<Tensor> expected = make(true);
  const std::vector<Tensor> mine = make(pg->rank() == root);
  const uint64_t before = pg->collectives_run();
  internal::BroadcastCoalesced(*pg, mine, root, "bucketed", /*bucket_bytes=*/64);
  // f32: [3] + [5] (32 bytes), [10] + [4] (56), [40] alone (160, in place),
  // the transposed [8, 8] alone (256); i64: [6] (48), then [3] ([0] has no
  // elements). One flat buffer per dtype was 2 broadcasts.
  WORKER_EXPECT(pg->collectives_run() - before == 6,
                std::to_string(pg->collectives_run() - before) + " broadcasts for 6 buckets");
  for (size_t i = 0; i < mine.size(); ++i) {
    const bool same = mine[i].dtype() == nn::DType::kInt64
                          ? mine[i].ToVector<int64_t>() == expected[i].ToVector<int64_t>()
                          : mine[i].ToVector<float>() == expected[i].ToVector<float>();
    WORKER_EXPECT(same, "rank " + std::to_string(pg->rank()) + ": tensor " + std::to_string(i) +
                            " does not hold the root's values");
  }
  bool refused = false;
  try {
    internal::BroadcastCoalesced(*pg, mine, root, "bucketed", 0);
  } catch (const std::invalid_argument& e) {
    refused = std::string(e.what()).find("bucket_bytes") != std::string::npos;
  }
  WORKER_EXPECT(refused, "a bucket of 0 bytes was accepted");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, BroadcastsGoInBucketsOfBoundedSize) {
  auto run = RunWorkers("broadcast_in_buckets", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Models that differ, each described by 3000 entries with 1000-byte names
// (about 3 MB): the check's extra memory on each rank is about one
// description, whatever the number of ranks. Every rank gathered every
// rank's whole description and parsed all of them (8 ranks: about 50 MB
// on each), which at 1024 ranks needed gigabytes per rank.
DDP_TEST_WORKER(verify_replicas_memory) {
  auto pg = testing::WorkerGroup();
  const std::string prefix(1000, 'p');
  std::vector<internal::ReplicaEntry> entries;
  for (int i = 0; i < 3000; ++i) entries.push_back({"parameter", prefix + std::to_string(i), "f32 [8] strides [1]"});
  if (pg->rank() == 5) entries[2345].value = "f32 [9] strides [1]";
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  std::string message;
  try {
    internal::VerifyReplicas(*pg, entries, "Models differ.");
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  const long grown_mb = (after.ru_maxrss - before.ru_maxrss) / 1024;
  WORKER_EXPECT(grown_mb < 30, "the check took " + std::to_string(grown_mb) + " MB more on rank " +
                                   std::to_string(pg->rank()));
  WORKER_EXPECT(message.find("First difference at parameter #2345: ranks 0-4, 6-7 have `" + prefix +
                             "2345` f32 [8] strides [1]; rank 5 has `" + prefix +
                             "2345` f32 [9] strides [1]. They differ in shape.") != std::string::npos,
                message.substr(0, 3000));
  WORKER_EXPECT(message.size() < 8192, std::to_string(message.size()) + " bytes");
  // The group is still usable: every rank took part in every exchange.
  Tensor one = nn::Ones({1});
  pg->AllReduce(one).Wait();
  WORKER_EXPECT(one.data<float>()[0] == 8.0f, "all-reduce after the check");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, TheReplicaCheckNeedsMemoryForOneDescriptionNotOnePerRank) {
  auto run = RunWorkers("verify_replicas_memory", 8);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Names holding the bytes 0x1e and 0x1f, which once separated entries and
// fields in the description rank 0 broadcasts: rank 0's entries were
// parsed into other names and values, every rank then found its own model
// different from rank 0's at the first such name, and the message named an
// entry that is the same on every rank.
DDP_TEST_WORKER(verify_replicas_separator_bytes) {
  auto pg = testing::WorkerGroup();
  // And a NUL, at which the message was cut (what() ends there): control
  // bytes are shown as \xNN.
  const std::string first = std::string("w") + '\x1f' + "0", second = std::string("w") + '\x1e' + '\0' + "1";
  const std::string shown = "w\\x1e\\x001";
  std::vector<internal::ReplicaEntry> entries = {{"parameter", first, "f32 [2] strides [1]"},
                                                 {"parameter", second, "f32 [3] strides [1]"}};
  if (pg->rank() == 1) entries[1].value = "f32 [4] strides [1]";
  std::string message;
  try {
    internal::VerifyReplicas(*pg, entries, "Models differ.");
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  WORKER_EXPECT(message == "Models differ. First difference at parameter #1: rank 0 has `" + shown +
                               "` f32 [3] strides [1]; rank 1 has `" + shown +
                               "` f32 [4] strides [1]. They differ in shape.",
                message);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, TheReplicaCheckNamesTheDifferenceWhatBytesTheNamesHold) {
  auto run = RunWorkers("verify_replicas_separator_bytes", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------ mode set on the inner module ----

// The mode is the wrapped module's own: the user keeps the inner handle and
// switches it (model->Eval() / model->Train()), which does not reach the
// wrapper. (A) The wrapper put in eval mode for a validation, the model
// then put back in training through its own handle: training forwards
// broadcast the buffers (the running statistics stayed equal across ranks),
// the buckets are rebuilt, the statistics count the forwards, and under
// Join the backward synchronizes; the wrapper's flag follows the model's,
// and a BatchNorm kept in eval mode inside it stays so. Before, all of it
// went by the wrapper's stale eval flag.
DDP_TEST_WORKER(inner_train_after_wrapper_eval) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  const Tensor held_out = testing::Batch(data, 1000, kBatch).first;
  try {
    auto model = std::make_shared<BufferSpy>();
    DistributedDataParallel ddp(model, {.process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    for (int s = 0; s < 3; ++s) {
      ddp.Eval();
      {
        nn::NoGradGuard no_grad;
        ddp(held_out);  // validation
      }
      model->Train();
      // Different data per rank: local statistics drift apart unless broadcast.
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
      WORKER_EXPECT(ddp.is_training(), "step " + std::to_string(s) + ": the wrapper is still in eval mode");
      if (s == 0) continue;  // equal at construction either way
      WORKER_EXPECT(testing::SameOnAllRanks(*pg, model->seen),
                    "step " + std::to_string(s) + ": running statistics at forward differ across ranks");
    }
    WORKER_EXPECT(!ddp.BucketOrder().empty(), "the buckets were not rebuilt");
    WORKER_EXPECT(ddp.Stats().forward_ms > 0, "no training forward was counted: " + ddp.Stats().ToString());

    // A BatchNorm frozen inside a training model keeps its eval mode.
    ddp.Eval();
    model->Train();
    Module* bn = nullptr;
    for (const auto& [path, m] : model->NamedModules()) {
      if (path == "bn") bn = m;
    }
    bn->Eval();
    auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    WORKER_EXPECT(ddp.is_training() && model->is_training() && !bn->is_training(),
                  std::string("after a forward: wrapper ") + (ddp.is_training() ? "training" : "eval") +
                      ", model " + (model->is_training() ? "training" : "eval") + ", bn " +
                      (bn->is_training() ? "training" : "eval"));
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("train through the inner handle: ") + e.what());
  }
  try {
    // Under Join, uneven inputs: rank 0 runs one batch more.
    auto model = Mlp(37);
    DistributedDataParallel ddp(model, {.process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    ddp.Eval();
    model->Train();
    Join join(ddp);
    for (int s = 0; s < (rank == 0 ? 2 : 1); ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
    join.Wait();
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "under Join: replicas differ");
    WORKER_EXPECT(ddp.iterations() == (rank == 0 ? 2 : 1),
                  "under Join: synchronizing iterations " + std::to_string(ddp.iterations()));
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("under Join: ") + e.what());
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, TrainingModeSetOnTheWrappedModuleAfterTheWrapperWasPutInEvalModeCounts) {
  auto run = RunWorkers("inner_train_after_wrapper_eval", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// (B) A validation forward with grad enabled after model->Eval() on the
// inner handle, no backward, then model->Train(): it was an eval-mode
// forward, which need not be followed by a backward, so training goes on
// and each step equals one on the combined batch. Before, the wrapper took
// it for a training forward and the next one threw "no parameter received
// a gradient", aborting the group.
DDP_TEST_WORKER(inner_eval_forward_without_backward) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  const Tensor held_out = testing::Batch(data, 1000, kBatch).first;
  try {
    auto model = Mlp(41);
    DistributedDataParallel ddp(model, {.process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    auto reference = Mlp(41);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    for (int s = 0; s < 3; ++s) {
      model->Eval();
      ddp(held_out);  // grad enabled, no backward follows
      WORKER_EXPECT(!ddp.is_training(), "step " + std::to_string(s) + ": the wrapper is in training mode");
      model->Train();
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
      ref_opt.ZeroGrad();
      auto [xa, ya] = testing::Batch(data, s * world * kBatch, world * kBatch);
      nn::Backward(nn::loss::CrossEntropy((*reference)(xa), ya));
      ref_opt.Step();
    }
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off by " + std::to_string(diff));
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "replicas differ");
    WORKER_EXPECT(ddp.iterations() == 3, "synchronizing iterations " + std::to_string(ddp.iterations()));
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, e.what());
  }
  WORKER_EXPECT(pg->aborted_reason().ok(), "the group was aborted: " + pg->aborted_reason().ToString());
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AnEvalForwardSetOnTheWrappedModuleNeedsNoBackward) {
  auto run = RunWorkers("inner_eval_forward_without_backward", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------------- debug desync ----

// Rank 1 wrongly skips synchronization in the first iteration (NoSync on
// one rank only): from then on the ranks' collectives no longer pair up.
// With DDP_DEBUG=detail both ranks name the collectives that diverged.
DDP_TEST_WORKER(ddp_desync) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = std::make_shared<BufferSpy>();  // has buffers: broadcast at each forward
  DistributedDataParallel ddp(model, {.process_group = pg});
  std::string message;
  try {
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
      if (s == 0 && pg->rank() == 1) {
        auto no_sync = ddp.NoSync();
        nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      } else {
        nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      }
    }
  } catch (const DistributedError& e) {
    message = e.what();
  }
  std::fprintf(stderr, "reported: %s\n", message.c_str());
  WORKER_EXPECT(message.find("collective desync detected") != std::string::npos, message);
  WORKER_EXPECT(message.find("all_reduce bucket 0(avg, f32") != std::string::npos, message);
  WORKER_EXPECT(message.find("broadcast buffers f32(root 0, f32") != std::string::npos, message);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, DebugModeReportsRanksThatDiverge) {
  auto run = RunWorkers("ddp_desync", 2, {{"DDP_DEBUG", "detail"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A user's hook calling AllReduce without a label, on a part of the bucket
// that differs across ranks (rank 1 leaves the last element out): with
// DDP_DEBUG=detail both ranks name the bucket, by index and parameters
// (the first and last of more than two), which the reducer lends such
// calls while the hook runs.
DDP_TEST_WORKER(hook_desync) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = Mlp(3);
  // Nothing reduced alone in place: bucket 0 holds 4 parameters.
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 0.05, .first_bucket_mb = 0.05,
                                      .inplace_gradient_mb = 100, .process_group = pg});
  int64_t numel = 0;
  ddp.RegisterCommHook([&numel](ProcessGroup& group, GradBucket& bucket) {
    if (bucket.index() == 0) numel = bucket.buffer().numel();
    const int64_t n = bucket.buffer().numel() - (group.rank() == 1 ? 1 : 0);
    return group.AllReduce(bucket.buffer().Narrow(0, 0, n));
  });
  const std::vector<std::string> names = ddp.BucketParameterNames().at(0);
  WORKER_EXPECT(names.size() > 2, "bucket 0 has " + std::to_string(names.size()) + " parameters");
  std::string message;
  try {
    auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const DistributedError& e) {
    message = e.what();
  }
  std::fprintf(stderr, "reported: %s\n", message.c_str());
  WORKER_EXPECT(message.find("collective desync detected") != std::string::npos, message);
  const std::string bucket = "all_reduce bucket 0 of " + std::to_string(names.size()) + " parameters `" +
                             names.front() + "` ... `" + names.back() + "`(sum, f32 [";
  WORKER_EXPECT(message.find(bucket + std::to_string(numel) + "])") != std::string::npos, message);
  WORKER_EXPECT(message.find(bucket + std::to_string(numel - 1) + "])") != std::string::npos, message);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, DebugModeNamesTheBucketOfAHooksUnlabelledCollective) {
  auto run = RunWorkers("hook_desync", 2, {{"DDP_DEBUG", "detail"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Debug mode on one rank only: its fingerprint all-gathers would pair with
// the other rank's collectives; every rank fails when the group is made.
DDP_TEST_WORKER(debug_mode_on_one_rank) {
  ProcessGroupOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  options.debug_detail = std::getenv("RANK") != nullptr && std::string(std::getenv("RANK")) == "0";
  std::string message;
  try {
    auto pg = ProcessGroup::CreateFromEnvironment(options);
  } catch (const DistributedError& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("DDP_DEBUG=detail (ProcessGroupOptions::debug_detail) is on in "
                             "rank 0 of 2 and off in the others") != std::string::npos,
                "reported: " + message);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, DebugModeOnSomeRanksOnlyFailsEveryRankAtTheStart) {
  auto run = RunWorkers("debug_mode_on_one_rank", 2, {}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ---------------------------------------------------------- mismatch ----

// Registers its two layers in the order given.
class TwoLayers : public Module {
 public:
  TwoLayers(bool swapped, int64_t hidden, bool bias) {
    if (swapped) {
      second_ = RegisterModule("second", std::make_shared<nn::modules::Linear>(hidden, 10, bias));
      first_ = RegisterModule("first", std::make_shared<nn::modules::Linear>(784, hidden));
    } else {
      first_ = RegisterModule("first", std::make_shared<nn::modules::Linear>(784, hidden));
      second_ = RegisterModule("second", std::make_shared<nn::modules::Linear>(hidden, 10, bias));
    }
  }
  Tensor Forward(const Tensor& x) override { return (*second_)(nn::ops::Relu((*first_)(nn::ops::Flatten(x, 1)))); }
  using Module::Forward;
  std::string TypeName() const override { return "TwoLayers"; }

 private:
  std::shared_ptr<nn::modules::Linear> first_, second_;
};

// Without a process group (none passed, none initialized) a bad value is
// still the error reported. With one, it is reported after the replicas are
// compared (options_wrong_on_one_rank below).
TEST(DdpFeaturesTest, SizesOutOfRangeAreRefusedWithoutAProcessGroup) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  auto error = [](DdpOptions options) {
    try {
      DistributedDataParallel ddp(std::make_shared<TwoLayers>(false, 32, true), std::move(options));
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(error({.bucket_cap_mb = 0}), "DdpOptions::bucket_cap_mb must be positive and finite, got 0.000000");
  EXPECT_EQ(error({.bucket_cap_mb = nan}), "DdpOptions::bucket_cap_mb must be positive and finite, got nan");
  EXPECT_EQ(error({.bucket_cap_mb = inf}), "DdpOptions::bucket_cap_mb must be positive and finite, got inf");
  EXPECT_EQ(error({.first_bucket_mb = -1}),
            "DdpOptions::first_bucket_mb must be positive and finite, got -1.000000");
  EXPECT_EQ(error({.first_bucket_mb = 2e12}),
            "DdpOptions::first_bucket_mb must be positive and finite, got 2000000000000.000000");
  EXPECT_EQ(error({.inplace_gradient_mb = -0.5}),
            "DdpOptions::inplace_gradient_mb must be at least 0 and finite, got -0.500000");
  EXPECT_EQ(error({.inplace_gradient_mb = nan}),
            "DdpOptions::inplace_gradient_mb must be at least 0 and finite, got nan");
}

// A positive inplace_gradient_mb under one byte (1e-9 MiB) asks for every
// gradient in place, as one byte does; it was truncated to 0 bytes, which
// means "none in place", so every gradient went to a shared bucket.
DDP_TEST_WORKER(tiny_inplace_threshold) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  std::vector<size_t> buckets;
  for (const double mb : {1e-9, 1e-6}) {
    auto model = Mlp(17);
    DistributedDataParallel ddp(model, {.inplace_gradient_mb = mb, .process_group = pg});
    auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    buckets.push_back(ddp.Stats().bucket_bytes.size());
  }
  WORKER_EXPECT(buckets[1] > 1 && buckets[0] == buckets[1],
                "buckets with 1e-9 MiB: " + std::to_string(buckets[0]) + ", with 1 byte: " +
                    std::to_string(buckets[1]));
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AnInplaceThresholdUnderOneByteStillPutsEveryGradientInPlace) {
  auto run = RunWorkers("tiny_inplace_threshold", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A bucket order that is not a permutation of the 4 parameters' indices is
// refused likewise, naming the option and the entry.
TEST(DdpFeaturesTest, ABucketOrderThatIsNotAPermutationIsRefused) {
  auto error = [](std::vector<int64_t> order) {
    try {
      DistributedDataParallel ddp(std::make_shared<TwoLayers>(false, 32, true), {.bucket_order = std::move(order)});
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(error({3, 2, 1}),
            "DdpOptions::bucket_order must list each of the 4 parameters that require grad once, got 3 entries");
  EXPECT_EQ(error({3, 2, 1, 0, 4}),
            "DdpOptions::bucket_order must list each of the 4 parameters that require grad once, got 5 entries");
  EXPECT_EQ(error({3, 2, 4, 0}),
            "DdpOptions::bucket_order must be a permutation of [0, 4): entry 2 is 4, out of range");
  EXPECT_EQ(error({3, -1, 1, 0}),
            "DdpOptions::bucket_order must be a permutation of [0, 4): entry 1 is -1, out of range");
  EXPECT_EQ(error({3, 2, 3, 0}),
            "DdpOptions::bucket_order must be a permutation of [0, 4): entry 2 is 3, which appears before it");
}

std::string ConstructionError(ProcessGroup& pg, std::shared_ptr<Module> model) {
  try {
    DistributedDataParallel ddp(model, {.process_group = Borrow(pg)});
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

DDP_TEST_WORKER(mismatch) {
  auto pg = testing::WorkerGroup();
  const bool odd = pg->rank() == 1;
  // A different shape.
  std::string m = ConstructionError(*pg, std::make_shared<TwoLayers>(false, odd ? 33 : 32, true));
  std::fprintf(stderr, "shape: %s\n", m.c_str());
  WORKER_EXPECT(m.find("First difference at parameter #0: rank 0 has `first.weight` f32 [32, 784] "
                       "strides [784, 1]; rank 1 has `first.weight` f32 [33, 784] strides [784, 1]") !=
                    std::string::npos,
                m);
  // A missing parameter (no bias on rank 1).
  m = ConstructionError(*pg, std::make_shared<TwoLayers>(false, 32, !odd));
  std::fprintf(stderr, "missing: %s\n", m.c_str());
  WORKER_EXPECT(m.find("rank 1 has no parameter #3 (it has 3 parameters)") != std::string::npos, m);
  WORKER_EXPECT(m.find("Rank 1 has no parameter named `second.bias`") != std::string::npos, m);
  // A different order.
  m = ConstructionError(*pg, std::make_shared<TwoLayers>(odd, 32, true));
  std::fprintf(stderr, "order: %s\n", m.c_str());
  WORKER_EXPECT(m.find("parameter #0: rank 0 has `first.weight` f32 [32, 784] strides [784, 1]; rank 1 "
                       "has `second.weight` f32 [10, 32] strides [32, 1]") != std::string::npos,
                m);
  // A different option.
  try {
    DistributedDataParallel ddp(std::make_shared<TwoLayers>(false, 32, true),
                                {.bucket_cap_mb = odd ? 10.0 : 25.0, .process_group = pg});
    WORKER_EXPECT(false, "different bucket_cap_mb accepted");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("option #0: rank 0 has `bucket_cap_mb` 25; rank 1 has "
                                             "`bucket_cap_mb` 10") != std::string::npos,
                  e.what());
  }
  // After all that, the group still works and identical models pass.
  auto ok = ConstructionError(*pg, std::make_shared<TwoLayers>(false, 32, true));
  WORKER_EXPECT(ok.empty(), ok);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, MismatchedModelsFailOnEveryRankWithTheDifference) {
  auto run = RunWorkers("mismatch", 2, {}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Options that one rank alone gets wrong for its own model are checked
// after the replicas are compared, so that every rank throws the same
// message naming the difference instead of that rank throwing alone while
// the others wait in the comparison until the group's timeout (20 s here).
// DDP_TEST_CASE=frozen: rank 1 froze `first.bias`, and both pass the bucket
// order of the 4 trainable parameters (from a checkpoint, say), which is
// one too many for rank 1; =bad_size: rank 1 alone passes bucket_cap_mb 0;
// =bad_everywhere: both pass a bucket order one entry short, and both throw
// that; =close_sizes: bucket_cap_mb 25 and 25.00001, which six digits would
// show alike though their byte limits differ. Then the group still works.
DDP_TEST_WORKER(options_wrong_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const std::string which = std::getenv("DDP_TEST_CASE");
  const bool frozen = which == "frozen";
  const bool odd = pg->rank() == 1;
  auto model = std::make_shared<TwoLayers>(false, 32, true);
  DdpOptions options{.process_group = pg};
  if (frozen) {
    options.bucket_order = {3, 2, 1, 0};
    if (odd) model->NamedParameters().at(1).second.set_requires_grad(false);
  } else if (which == "bad_size") {
    options.bucket_cap_mb = odd ? 0.0 : 25.0;
  } else if (which == "close_sizes") {
    options.bucket_cap_mb = odd ? 25.00001 : 25.0;
  } else {
    options.bucket_order = {3, 2, 1};
  }
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  try {
    DistributedDataParallel ddp(model, options);
    message = "accepted";
  } catch (const std::exception& e) {
    message = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "rank %d after %.2f s: %s\n", pg->rank(), seconds, message.c_str());
  const std::string expected =
      frozen ? "First difference at parameter #1: rank 0 has `first.bias` f32 [32] strides [1]; rank 1 has "
               "`first.bias` f32 [32] strides [1] no-grad."
      : which == "bad_size"
          ? "First difference at option #0: rank 0 has `bucket_cap_mb` 25; rank 1 has `bucket_cap_mb` 0."
      : which == "close_sizes"
          ? "First difference at option #0: rank 0 has `bucket_cap_mb` 25; rank 1 has `bucket_cap_mb` 25.00001."
          : "DdpOptions::bucket_order must list each of the 4 parameters that require grad once, got 3 entries";
  if (which != "bad_everywhere") {
    WORKER_EXPECT(message.find("the ranks' models differ") != std::string::npos, message);
  }
  WORKER_EXPECT(message.find(expected) != std::string::npos, message);
  WORKER_EXPECT(seconds < 8, "construction failed after " + std::to_string(seconds) + " s");
  Tensor one = nn::Ones({1});
  pg->AllReduce(one, transport::ReduceOp::kSum, "after the failed construction").Wait();
  WORKER_EXPECT(one.data<float>()[0] == 2.0f, "the group's all-reduce summed to " + std::to_string(one.data<float>()[0]));
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AParameterFrozenOnOneRankWithABucketOrderIsNamedOnEveryRank) {
  auto run = RunWorkers("options_wrong_on_one_rank", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_TEST_CASE", "frozen"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, ABucketSizeOutOfRangeOnOneRankIsNamedOnEveryRank) {
  auto run = RunWorkers("options_wrong_on_one_rank", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_TEST_CASE", "bad_size"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, BucketSizesThatDifferInTheSeventhDigitAreNamedOnEveryRank) {
  auto run = RunWorkers("options_wrong_on_one_rank", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_TEST_CASE", "close_sizes"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, ABucketOrderBadOnEveryRankIsNamedOnEveryRank) {
  auto run = RunWorkers("options_wrong_on_one_rank", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_TEST_CASE", "bad_everywhere"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ----------------------------------------------------------- rebuild ----

// Registered output layer first: reverse registration order is the wrong
// guess, and the first iteration's order fixes it.
DDP_TEST_WORKER(rebuild) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = std::make_shared<TwoLayers>(true, 32, true);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 1e-9, .first_bucket_mb = 1e-9, .process_group = pg});
  const auto before = ddp.BucketParameterNames();
  WORKER_EXPECT(before.size() == 4 && before[0][0] == "first.bias", "initial first bucket " + before[0][0]);
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  }
  const auto after = ddp.BucketParameterNames();
  WORKER_EXPECT(after.size() == 4 && after[0][0].rfind("second.", 0) == 0 && after[3][0].rfind("first.", 0) == 0,
                "rebuilt order starts with " + after[0][0] + " and ends with " + after[3][0]);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, BucketsAreRebuiltFromTheObservedOrder) {
  auto run = RunWorkers("rebuild", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// gradient_as_bucket_view: first.weight shares its first bucket with
// first.bias at construction, and is alone in its bucket after the rebuild
// (limit 1400 bytes: second's 1320 bytes and first.bias close the first
// bucket). Its .grad, a view into the old bucket, gets storage of its own at
// the rebuild; it used to keep that view, and with it the old bucket's
// whole buffer, alive for as long as the .grad lived.
DDP_TEST_WORKER(rebuild_solo_grad_leaves_the_old_bucket) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = std::make_shared<TwoLayers>(true, 32, true);
  DistributedDataParallel ddp(model, {.first_bucket_mb = 1400.0 / 1048576, .inplace_gradient_mb = 0,
                                      .gradient_as_bucket_view = true, .process_group = pg});
  const std::vector<std::vector<std::string>> before = ddp.BucketParameterNames();
  WORKER_EXPECT((before == std::vector<std::vector<std::string>>{{"first.bias", "first.weight"},
                                                                 {"second.bias", "second.weight"}}),
                "initial buckets start with " + before[0][0]);
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  std::map<std::string, Tensor> params;
  for (const auto& [name, p] : model->NamedParameters()) params.emplace(name, p);
  const auto* old_bucket = params.at("first.weight").grad().storage().get();
  WORKER_EXPECT(old_bucket == params.at("first.bias").grad().storage().get(),
                "first.weight's .grad is not a view into its bucket");
  std::map<std::string, std::vector<float>> grads;
  for (const auto& [name, p] : params) grads.emplace(name, p.grad().ToVector<float>());
  const Tensor out = ddp(x);  // rebuilds the buckets
  const std::vector<std::vector<std::string>> after = ddp.BucketParameterNames();
  // One of first's parameters, whichever backward reached last.
  WORKER_EXPECT(after.size() == 2 && after[1].size() == 1 && after[1][0].rfind("first.", 0) == 0,
                "rebuilt buckets end with " + after.back()[0]);
  const Tensor& kept = params.at(after[1][0]).grad();
  WORKER_EXPECT(kept.storage().get() != old_bucket,
                "`" + after[1][0] + "`'s .grad still holds the old bucket's buffer");
  for (const auto& [name, p] : params) {
    WORKER_EXPECT(p.grad().ToVector<float>() == grads.at(name), "`" + name + "`'s .grad changed in the rebuild");
  }
  nn::Backward(nn::loss::CrossEntropy(out, y));
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AGradientAloneInItsRebuiltBucketLeavesTheOldBucket) {
  auto run = RunWorkers("rebuild_solo_grad_leaves_the_old_bucket", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Runs `body`, in which the bucket allocation of rank `failing` fails alone
// (std::bad_alloc) and the group is aborted, and checks what each rank
// sees. The failing rank gets the bad_alloc, runs `on_bad_alloc`, lives on
// a while (as a process that handles the error: the peers must not need
// its exit to stop waiting), and then has its next forward (`forward`)
// refused naming `cause`. The others fail within 5 s of `start` (which
// `body` may move) naming `cause` and std::bad_alloc.
void ExpectAllocationFailureOnOneRank(const ProcessGroup& pg, int failing, const std::string& cause,
                                      std::chrono::steady_clock::time_point& start,
                                      const std::function<void()>& body, const std::function<void()>& forward,
                                      const std::function<void()>& on_bad_alloc = {}) {
  const int rank = pg.rank();
  std::string message;
  try {
    body();
    WORKER_EXPECT(false, "rank " + std::to_string(rank) + ": nothing failed");
  } catch (const std::bad_alloc& e) {
    message = e.what();
    WORKER_EXPECT(rank == failing, std::string("bad_alloc on a rank where nothing failed: ") + e.what());
    if (on_bad_alloc) on_bad_alloc();
    testing::StayAliveUntilTheOtherRanksAreDone(pg);
    try {
      forward();
      WORKER_EXPECT(false, "a forward ran after the failure");
    } catch (const std::runtime_error& later) {
      WORKER_EXPECT(std::string(later.what()).find(cause) != std::string::npos, later.what());
    }
  } catch (const std::exception& e) {
    message = e.what();
    WORKER_EXPECT(rank != failing, std::string("the failing rank threw something else: ") + e.what());
    WORKER_EXPECT(message.find(cause) != std::string::npos && message.find("std::bad_alloc") != std::string::npos,
                  message);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (rank != failing) testing::MarkThisRankDone(pg);
  WORKER_EXPECT(!message.empty(), "no error");
  WORKER_EXPECT(rank == failing || seconds < 5, "failed after " + std::to_string(seconds) + " s: " + message);
}

// The rebuild fails on one rank (its new bucket cannot be allocated): that
// rank throws the cause and refuses every later forward, and its peers,
// which rebuilt theirs, fail within moments naming the rank and the cause.
// They used to wait in their bucket all-reduce until the group's timeout
// (20 s here), while the failing rank went on with its old buckets, whose
// order no longer matched theirs.
DDP_TEST_WORKER(rebuild_fails_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank(), failing = pg->size() - 1;
  const std::string cause = "DistributedDataParallel on rank " + std::to_string(failing) +
                            ": rebuilding the gradient buckets after the first iteration failed on this rank";
  // One bucket of all four parameters, which the rebuild reorders.
  auto model = std::make_shared<TwoLayers>(true, 32, true);
  DistributedDataParallel ddp(model, {.inplace_gradient_mb = 0, .process_group = pg});
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  const auto before = ddp.BucketParameterNames();
  if (rank == failing) internal::FailNextBucketAllocationForTesting();
  auto start = std::chrono::steady_clock::now();
  ExpectAllocationFailureOnOneRank(
      *pg, failing, cause, start, [&] { for (int s = 0; s < 2; ++s) nn::Backward(nn::loss::CrossEntropy(ddp(x), y)); },
      [&] { ddp(x); },
      [&] {
        WORKER_EXPECT(ddp.BucketParameterNames() == before && ddp.BucketOrder().empty(),
                      "the failed rebuild reports an agreed order");
      });
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ARebuildThatFailsOnOneRankAbortsTheGroupWithItsCause) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("rebuild_fails_on_one_rank", n, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << n << " ranks:\n" << testing::AllOutput(run);
  }
}

// Rank 0's bucket order arrives damaged on the other ranks at the rebuild
// (an index repeated): they throw naming the position and the value, and
// rank 0, whose order was sound and whose buckets were rebuilt, fails
// within moments with that cause instead of waiting in its bucket
// all-reduce until the group's timeout (20 s here). The receivers used to
// throw without stopping the group. Later forwards there throw the same.
DDP_TEST_WORKER(rebuild_order_damaged) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  const std::string cause = "the bucket order received from rank 0 at the rebuild after the first iteration is "
                            "not a permutation of the 4 parameter indices (position 1 holds ";
  auto model = std::make_shared<TwoLayers>(true, 32, true);
  DistributedDataParallel ddp(model, {.inplace_gradient_mb = 0, .process_group = pg});
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  if (rank != 0) internal::DamageNextReceivedBucketOrderForTesting();
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    for (int s = 0; s < 2; ++s) nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    WORKER_EXPECT(false, "rank " + std::to_string(rank) + ": nothing failed");
  } catch (const std::exception& e) {
    message = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(message.find(cause) != std::string::npos && message.find("which an earlier position holds too") != std::string::npos,
                "rank " + std::to_string(rank) + ": " + message);
  if (rank == 0) {
    testing::MarkThisRankDone(*pg);
    WORKER_EXPECT(seconds < 5, "failed after " + std::to_string(seconds) + " s: " + message);
  } else {
    // Alive until rank 0 has seen the failure: its error must not come
    // from this process's exit.
    testing::WaitUntilRanksAreDone(*pg, {0});
    try {
      ddp(x);
      WORKER_EXPECT(false, "a forward ran after the damaged order");
    } catch (const std::runtime_error& later) {
      WORKER_EXPECT(std::string(later.what()).find(cause) != std::string::npos, later.what());
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ABucketOrderThatArrivesDamagedAbortsTheGroupOnEveryRank) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("rebuild_order_damaged", n, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << n << " ranks:\n" << testing::AllOutput(run);
  }
}

// A rank that ran out of inputs under Join cannot allocate the zero buckets
// it contributes to the active ranks' backward: it throws the cause and
// refuses later forwards, and the active ranks fail within moments naming
// the rank and the cause. They used to wait in their bucket all-reduce
// until the group's timeout (20 s here).
DDP_TEST_WORKER(shadow_backward_fails_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank(), failing = pg->size() - 1;
  const std::string cause = "DistributedDataParallel on rank " + std::to_string(failing) +
                            ": allocating the zero gradient buckets";
  auto model = Mlp(21);
  DistributedDataParallel ddp(model, {.process_group = pg});
  auto start = std::chrono::steady_clock::now();
  ExpectAllocationFailureOnOneRank(
      *pg, failing, cause, start,
      [&] {
        Join join(ddp);
        // Two iterations everywhere (the second rebuilds the buckets), a
        // third on the active ranks only.
        for (int s = 0; s < (rank == failing ? 2 : 3); ++s) {
          if (s == 2) start = std::chrono::steady_clock::now();
          auto [x, y] = testing::Batch(data, (s * pg->size() + rank) * kBatch, kBatch);
          nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
        }
        if (rank == failing) {
          internal::FailNextBucketAllocationForTesting();
          start = std::chrono::steady_clock::now();
        }
        join.Wait();
      },
      [&] { ddp(testing::Batch(data, 0, kBatch).first); });
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AShadowBackwardThatFailsOnAJoinedRankAbortsTheGroupWithItsCause) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("shadow_backward_fails_on_one_rank", n, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << n << " ranks:\n" << testing::AllOutput(run);
  }
}

// On 3 ranks, where an element's sum depends on its place in the bucket:
// A rebuilds its buckets after its first iteration; B, given A's
// BucketOrder(), starts with A's rebuilt buckets and keeps them, and its
// first iteration's gradients are A's second's bit for bit (same
// parameters, same batches). A third wrapper in registration order (the
// default, which reduces the one bucket in another order) is the premise:
// its gradients differ from A's second in some bit. A registered hook,
// plain or with fixed buckets, keeps a given order too. Ranks whose orders
// differ are refused, naming the option.
DDP_TEST_WORKER(bucket_order) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto [x0, y0] = testing::Batch(data, rank * kBatch, kBatch);
  auto [x1, y1] = testing::Batch(data, (3 + rank) * kBatch, kBatch);
  auto model_a = std::make_shared<TwoLayers>(true, 32, true);
  auto grads = [](Module& m) {
    std::vector<Tensor> out;
    for (const auto& [name, p] : m.NamedParameters()) {
      out.push_back(p.grad().Clone());
      p.set_grad(Tensor());
    }
    return out;
  };
  auto same_bits = [](const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].nbytes() != b[i].nbytes() || std::memcmp(a[i].data_ptr(), b[i].data_ptr(), a[i].nbytes()) != 0) {
        return false;
      }
    }
    return true;
  };
  std::vector<int64_t> order;
  std::vector<std::vector<std::string>> rebuilt;
  std::vector<Tensor> second;
  {
    DistributedDataParallel a(model_a, {.process_group = pg});
    WORKER_EXPECT(a.BucketOrder().empty(), "an order before the rebuild");
    nn::Backward(nn::loss::CrossEntropy(a(x0), y0));
    grads(*model_a);
    nn::Backward(nn::loss::CrossEntropy(a(x1), y1));
    second = grads(*model_a);
    order = a.BucketOrder();
    rebuilt = a.BucketParameterNames();
  }
  std::string listed;
  for (int64_t i : order) listed += std::to_string(i) + " ";
  WORKER_EXPECT(order.size() == 4, "order of " + std::to_string(order.size()) + " entries: " + listed);
  WORKER_EXPECT(rebuilt.size() == 1 && rebuilt[0].size() == 4 && rebuilt[0][0] != "first.bias",
                "premise: one bucket, rebuilt out of registration order; order " + listed);

  auto model_b = std::make_shared<TwoLayers>(true, 32, true);
  model_b->LoadStateDict(model_a->GetStateDict());
  {
    DistributedDataParallel b(model_b, {.bucket_order = order, .process_group = pg});
    WORKER_EXPECT(b.BucketParameterNames() == rebuilt, "B's first buckets are not A's rebuilt ones");
    WORKER_EXPECT(b.BucketOrder() == order, "B's order is not the one given");
    nn::Backward(nn::loss::CrossEntropy(b(x1), y1));
    WORKER_EXPECT(same_bits(grads(*model_b), second), "B's first gradients differ from A's second");
    nn::Backward(nn::loss::CrossEntropy(b(x1), y1));
    WORKER_EXPECT(b.BucketParameterNames() == rebuilt, "B's buckets were rebuilt");
    WORKER_EXPECT(b.BucketOrder() == order, "B's order changed");
    grads(*model_b);
  }
  {
    DistributedDataParallel c(model_b, {.process_group = pg});
    nn::Backward(nn::loss::CrossEntropy(c(x1), y1));
    WORKER_EXPECT(!same_bits(grads(*model_b), second),
                  "premise: the default buckets sum the gradients as the rebuilt ones do");
  }

  // A hook registered later keeps the given order: a plain one does not
  // bring the rebuild back, and one with fixed buckets keeps these.
  const std::vector<int64_t> reversed(order.rbegin(), order.rend());
  for (const bool fixed : {false, true}) {
    DistributedDataParallel e(model_b, {.bucket_order = reversed, .process_group = pg});
    e.RegisterCommHook(fixed ? hooks::AllReduceHook().WithFixedBuckets() : hooks::AllReduceHook());
    const auto first = e.BucketParameterNames();
    WORKER_EXPECT(first != rebuilt, "premise: the reversed order gives other buckets");
    for (int s = 0; s < 2; ++s) nn::Backward(nn::loss::CrossEntropy(e(x1), y1));
    grads(*model_b);
    const std::string what = fixed ? "with fixed buckets" : "with a hook";
    WORKER_EXPECT(e.BucketParameterNames() == first, what + ": the given order's buckets were rebuilt");
    WORKER_EXPECT(e.BucketOrder() == reversed, what + ": the order is not the one given");
  }

  std::vector<int64_t> other = order;
  if (rank == 2) std::swap(other[0], other[1]);
  try {
    DistributedDataParallel d(model_b, {.bucket_order = other, .process_group = pg});
    WORKER_EXPECT(false, "different bucket orders accepted");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("`bucket_order`") != std::string::npos, e.what());
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ABucketOrderFromAnEarlierWrapperGivesItsRebuiltBucketsAndSums) {
  auto run = RunWorkers("bucket_order", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The bucket rebuild after the first iteration happens on every rank at
// once even when a rank shadowed that iteration: rank 1 joins at once, rank
// 0 runs one step, then both train (DDP_TEST_CASE=plain: without a Join;
// =join: inside a second one). The model registers its output layer first
// (one bucket per parameter), so the rebuild changes the buckets.
DDP_TEST_WORKER(join_then_rebuild) {
  auto pg = testing::WorkerGroup();
  const bool second_join = std::string(std::getenv("DDP_TEST_CASE")) == "join";
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  auto model = std::make_shared<TwoLayers>(true, 32, true);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 1e-9, .first_bucket_mb = 1e-9, .process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = std::make_shared<TwoLayers>(true, 32, true);
  reference->LoadStateDict(model->GetStateDict());
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  auto step = [&](int s) {
    auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
    opt.ZeroGrad();
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    opt.Step();
  };
  try {
    {
      Join join(ddp);
      if (rank == 0) step(0);
      join.Wait();
    }
    std::optional<Join> join;
    if (second_join) join.emplace(ddp);
    for (int s = 1; s < 4; ++s) step(s);
    if (join) join->Wait();
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, e.what());
  }
  // The reference: rank 0's batch alone (divided by the world size), then
  // the combined batches.
  for (int s = 0; s < 4; ++s) {
    ref_opt.ZeroGrad();
    auto [x, y] = testing::Batch(data, s * world * kBatch, (s == 0 ? 1 : world) * kBatch);
    nn::Backward(nn::loss::CrossEntropy((*reference)(x), y) * (s == 0 ? 1.0 / world : 1.0));
    ref_opt.Step();
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off by " + std::to_string(diff));
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "replicas differ");
  const auto buckets = ddp.BucketParameterNames();
  std::string layout;
  for (const auto& b : buckets) layout += b.at(0) + ";";
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, std::hash<std::string>{}(layout)), "bucket layouts differ: " + layout);
  WORKER_EXPECT(buckets.size() == 4 && buckets[0][0].rfind("second.", 0) == 0, "not rebuilt: " + layout);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, BucketsAreRebuiltOnEveryRankAfterAJoinInWhichOneRankRanNothing) {
  for (const char* which : {"plain", "join"}) {
    auto run = RunWorkers("join_then_rebuild", 2, {{"DDP_TEST_CASE", which}, {"DDP_TEST_TIMEOUT_MS", "5000"}}, 30000);
    EXPECT_TRUE(run.AllSucceeded()) << which << "\n" << testing::AllOutput(run);
  }
}

// ------------------------------------------------------------- hooks ----

DDP_TEST_WORKER(hooks) {
  auto pg = testing::WorkerGroup();
  // The bucket copies GPU buckets use (tensor copies and the affine kernel
  // that divides by the world size), here on CPU tensors.
  if (std::getenv("DDP_TEST_DEVICE_COPIES") != nullptr) internal::SetReducerDeviceCopiesForTesting(true);
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  for (const std::string kind : {"fp16", "bf16", "user"}) {
    auto model = Mlp(9);
    DistributedDataParallel ddp(model, {.process_group = pg});
    const size_t initial_buckets = ddp.BucketParameterNames().size();
    int calls = 0;
    if (kind == "fp16") ddp.RegisterCommHook(hooks::Fp16CompressHook());
    if (kind == "bf16") ddp.RegisterCommHook(hooks::Bf16CompressHook());
    if (kind == "user") {
      // A user hook: all-reduce through the group, counting its calls.
      ddp.RegisterCommHook([&calls](ProcessGroup& group, GradBucket& bucket) {
        ++calls;
        return group.AllReduce(bucket.buffer(), transport::ReduceOp::kSum, "user hook");
      });
    }
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    auto reference = Mlp(9);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
    for (int s = 0; s < 5; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
      auto [xa, ya] = testing::Batch(data, s * world * kBatch, world * kBatch);
      ref_opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy((*reference)(xa), ya));
      ref_opt.Step();
    }
    // 16-bit gradients: about 3 (f16) or 2 (bf16) significant digits.
    const double tolerance = kind == "user" ? 1e-5 : kind == "fp16" ? 1e-3 : 1e-2;
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    std::fprintf(stderr, "%s hook: max relative difference %.3g\n", kind.c_str(), diff);
    WORKER_EXPECT(diff <= tolerance, kind + " hook: `" + worst + "` off by " + std::to_string(diff));
    WORKER_EXPECT(diff > 0 || kind == "user", kind + " hook: no rounding at all, was it used?");
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), kind + " hook: replicas differ");
    // Once per bucket: the initial buckets in the first iteration, the
    // rebuilt ones after.
    const int expected = static_cast<int>(initial_buckets + 4 * ddp.BucketParameterNames().size());
    if (kind == "user") {
      WORKER_EXPECT(calls == expected, "user hook called " + std::to_string(calls) + " times, expected " +
                                           std::to_string(expected));
    }
    // Too late once training started.
    bool refused = false;
    try {
      ddp.RegisterCommHook(hooks::AllReduceHook());
    } catch (const std::logic_error&) {
      refused = true;
    }
    WORKER_EXPECT(refused, "RegisterCommHook after backward was accepted");
  }
  return testing::WorkerExit();
}

// An f64 bucket goes onto the 16-bit wire in one rounding. Each rank's
// value lies just past the midpoint of two f16 (bf16) neighbours; through
// f32 the excess was lost, the value sat on the midpoint and rounded down
// to the even neighbour, so the two ranks' sum came back as 1.0.
DDP_TEST_WORKER(hook_f64_rounding) {
  auto pg = testing::WorkerGroup();
  for (const std::string kind : {"fp16", "bf16"}) {
    const int mantissa_bits = kind == "fp16" ? 10 : 7;
    const double step = std::ldexp(1.0, -1 - mantissa_bits);  // between neighbours at 0.5
    const double value = 0.5 + step / 2 + std::ldexp(1.0, -31);
    nn::Tensor buffer = nn::Full({4}, value, {.dtype = nn::DType::kFloat64});
    GradBucket bucket(0, 1, buffer, {}, {});
    const CommHook hook = kind == "fp16" ? hooks::Fp16CompressHook() : hooks::Bf16CompressHook();
    hook(*pg, bucket).Wait();
    const double want = 2 * (0.5 + step);
    for (double got : buffer.ToVector<double>()) {
      WORKER_EXPECT(got == want, kind + " hook on an f64 bucket: " + std::to_string(got) + " instead of " +
                                     std::to_string(want));
    }
  }
  return testing::WorkerExit();
}

// With one process (no communicator) the compression hooks still round
// the bucket to 16 bits and back, as a group's does: they returned the
// gradients untouched, and a one-process baseline lacked the rounding.
// 1 + 2^-12 lies below the midpoint of 1 and its next f16 (1 + 2^-10) or
// bf16 (1 + 2^-7), so it becomes exactly 1; 1 + 3 * 2^-11 in f16 lies past
// the midpoint of 1 + 2^-10 and 1 + 2^-9, and goes to the even one, 1 + 2^-9.
TEST(DdpFeaturesTest, CompressionHooksRoundOnOneProcess) {
  auto pg = ProcessGroup::Single();
  for (const std::string kind : {"fp16", "bf16"}) {
    for (const nn::DType dtype : {nn::DType::kFloat32, nn::DType::kFloat64}) {
      SCOPED_TRACE(kind + " hook, " + std::string(nn::DTypeName(dtype)) + " bucket");
      const double odd = 1 + 3 * std::ldexp(1.0, -11);
      nn::Tensor buffer = nn::FromVector({1 + std::ldexp(1.0, -12), odd, -3.0}, {3}, {.dtype = dtype});
      GradBucket bucket(0, 1, buffer, {}, {});
      const CommHook hook = kind == "fp16" ? hooks::Fp16CompressHook() : hooks::Bf16CompressHook();
      hook(*pg, bucket).Wait();
      const std::vector<double> got = buffer.ToVector<double>();
      EXPECT_EQ(got[0], 1.0);
      EXPECT_EQ(got[1], kind == "fp16" ? 1 + std::ldexp(1.0, -9) : 1.0);
      EXPECT_EQ(got[2], -3.0);
    }
  }
}

TEST(DdpFeaturesTest, CompressionHooksRoundAnF64BucketOnce) {
  auto run = RunWorkers("hook_f64_rounding", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, CommunicationHooks) {
  auto run = RunWorkers("hooks", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, CommunicationHooksWithTheGpuBucketCopies) {
  auto run = RunWorkers("hooks", 2, {{"DDP_TEST_DEVICE_COPIES", "1"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A hook on local gradients that consumes its bucket: registered
// WithoutGradWriteBack, .grad keeps this rank's own gradient after
// backward; without it, the reducer copies the reduced bucket into .grad.
DDP_TEST_WORKER(grad_write_back) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  auto local = Mlp(9);
  nn::Backward(nn::loss::CrossEntropy((*local)(x), y));
  const auto local_params = local->NamedParameters();
  for (const bool write_back : {false, true}) {
    auto model = Mlp(9);
    // Every gradient copied into a bucket (one reduced in place is .grad).
    DistributedDataParallel ddp(model, {.inplace_gradient_mb = 0, .process_group = pg});
    const CommHook sum = CommHook::OnLocalGradients([](ProcessGroup& group, GradBucket& bucket) {
      return group.AllReduce(bucket.buffer(), transport::ReduceOp::kSum, "summing hook");
    });
    ddp.RegisterCommHook(write_back ? sum : sum.WithoutGradWriteBack());
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    const auto params = model->NamedParameters();
    size_t same = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const nn::Tensor& got = params[i].second.grad();
      const nn::Tensor& want = local_params[i].second.grad();
      WORKER_EXPECT(got.defined(), "`" + params[i].first + "` has no gradient");
      same += std::memcmp(got.data_ptr(), want.data_ptr(), want.nbytes()) == 0;
    }
    if (write_back) {
      WORKER_EXPECT(same == 0, std::to_string(same) + " gradients kept the local values although the "
                                                      "reduced buckets are written back");
    } else {
      WORKER_EXPECT(same == params.size(), std::to_string(params.size() - same) +
                                               " gradients changed although the hook asked for no write-back");
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, HooksWithoutGradWriteBackLeaveTheLocalGradients) {
  auto run = RunWorkers("grad_write_back", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A post-accumulate-grad hook registered after the wrapper runs after
// DDP's: it sees this rank's own gradient, and what it writes into .grad
// is local (the reduced gradient replaces it at the end of backward), as
// for a gradient copied into a bucket. The MLP's two large weights (1.5
// MiB and 512 KiB) are buckets of their own under the default
// inplace_gradient_mb, which were reduced in place in .grad: a hook that
// scaled .grad by a rank-dependent factor (per-parameter clipping) then
// scaled the reduced gradient (or, run while the collective was, one
// rank's input to it), and the replicas drifted apart. Every parameter
// gets a hook that records .grad and one that scales it by rank + 2;
// three steps must equal three steps on the combined batch, and the
// recorded gradients this rank's own. DDP_TEST_CASE=view: with
// gradient_as_bucket_view, where .grad of a small parameter is its bucket.
DDP_TEST_WORKER(user_hooks_after_ddp) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  const char* which = std::getenv("DDP_TEST_CASE");
  const bool view = which != nullptr && std::string(which) == "view";
  auto model = Mlp(31);
  DistributedDataParallel ddp(model, {.gradient_as_bucket_view = view, .process_group = pg});
  const auto params = model->NamedParameters();
  std::vector<Tensor> seen(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].second.RegisterPostAccumulateGradHook([&seen, i](const Tensor& p) { seen[i] = p.grad().Clone(); });
    params[i].second.RegisterPostAccumulateGradHook([rank](const Tensor& p) {
      float* g = p.grad().data<float>();
      for (int64_t k = 0; k < p.grad().numel(); ++k) g[k] *= static_cast<float>(rank + 2);
    });
  }
  nn::optim::Sgd opt(params, {.lr = 0.05, .momentum = 0.9});
  auto reference = Mlp(31);  // one process on the combined batch
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto local = Mlp(31);      // this rank's batch alone, from the model's parameters
  try {
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      {
        nn::NoGradGuard no_grad;
        const auto local_params = local->NamedParameters();
        for (size_t i = 0; i < params.size(); ++i) local_params[i].second.CopyFrom(params[i].second);
      }
      nn::optim::ZeroGrad(local->NamedParameters());
      nn::Backward(nn::loss::CrossEntropy((*local)(x), y));
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      ref_opt.ZeroGrad();
      auto [xa, ya] = testing::Batch(data, s * world * kBatch, world * kBatch);
      nn::Backward(nn::loss::CrossEntropy((*reference)(xa), ya));
      const auto local_params = local->NamedParameters();
      for (size_t i = 0; i < params.size(); ++i) {
        const double d = testing::RelativeDifference(seen[i], local_params[i].second.grad());
        WORKER_EXPECT(d <= 1e-6, "step " + std::to_string(s) + ": the hook saw a gradient of `" + params[i].first +
                                     "` off this rank's own by " + std::to_string(d));
      }
      const auto [diff, worst] = testing::MaxRelativeGradDifference(*model, *reference);
      WORKER_EXPECT(diff <= 1e-5, "step " + std::to_string(s) + ": gradient of `" + worst +
                                      "` off the combined batch's by " + std::to_string(diff));
      opt.Step();
      ref_opt.Step();
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, e.what());
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off by " + std::to_string(diff));
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "replicas differ");
  return testing::WorkerExit();
}

// Collectives on the training thread (inside DDP's hook, before the user's)
// and on the communication thread (while the user's hooks run).
TEST(DdpFeaturesTest, HooksRegisteredAfterTheWrapperActOnTheLocalGradient) {
  for (const char* thread : {"caller", "comm"}) {
    for (const char* which : {"copy", "view"}) {
      auto run = RunWorkers("user_hooks_after_ddp", 2, {{"DDP_COLLECTIVE_THREAD", thread}, {"DDP_TEST_CASE", which}});
      EXPECT_TRUE(run.AllSucceeded()) << thread << " " << which << "\n" << testing::AllOutput(run);
    }
  }
}

// --------------------------------------------------------- subgroups ----

// Four ranks in two groups, {0, 1} and {3, 2}, each training its own DDP
// replica on its own data: a group's ranks end identical and equal to one
// process trained on the group's combined batch (averaged over the group,
// not the job), and the two groups differ.
DDP_TEST_WORKER(new_group) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  try {
    pg->NewGroup({0, 0});
    WORKER_EXPECT(false, "a rank given twice was accepted");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("rank 0 given twice") != std::string::npos, e.what());
  }
  const std::vector<std::vector<int>> lists = {{0, 1}, {3, 2}};
  std::shared_ptr<ProcessGroup> sub;
  int group = -1;
  for (size_t g = 0; g < lists.size(); ++g) {
    auto made = pg->NewGroup(lists[g]);  // every rank calls both
    WORKER_EXPECT((made != nullptr) == (rank / 2 == static_cast<int>(g)), "membership of group " + std::to_string(g));
    if (made != nullptr) {
      sub = made;
      group = static_cast<int>(g);
    }
  }
  if (sub == nullptr) return testing::WorkerExit();
  const std::vector<int>& members = lists[group];
  WORKER_EXPECT(sub->size() == 2 && members[sub->rank()] == rank,
                "rank " + std::to_string(rank) + " is " + std::to_string(sub->rank()) + " of " +
                    std::to_string(sub->size()));

  const auto& data = testing::FashionMnist();
  auto model = Mlp(100 + rank);  // DDP broadcasts the group's rank 0 replica
  DistributedDataParallel ddp(model, {.process_group = sub});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto reference = Mlp(100 + members[0]);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  for (int s = 0; s < 3; ++s) {
    const int64_t base = (group * 3 + s) * 2 * kBatch;
    opt.ZeroGrad();
    auto [x, y] = testing::Batch(data, base + sub->rank() * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    opt.Step();
    ref_opt.ZeroGrad();
    auto [rx, ry] = testing::Batch(data, base, 2 * kBatch);
    nn::Backward(nn::loss::CrossEntropy((*reference)(rx), ry));
    ref_opt.Step();
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "group " + std::to_string(group) + ": `" + worst + "` off by " + std::to_string(diff));
  const uint64_t hash = testing::HashState(*model);
  WORKER_EXPECT(testing::SameOnAllRanks(*sub, hash), "replicas differ inside a group");
  WORKER_EXPECT(!testing::SameOnAllRanks(*pg, hash), "the two groups trained alike");
  sub.reset();  // before the job's group
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, SubgroupsTrainTheirOwnReplicas) {
  auto run = RunWorkers("new_group", 4);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A rank that aborts the job's group takes the groups made from it down
// too: its peer, waiting in such a group, fails within moments with the
// reason instead of waiting out the 20 s deadline.
DDP_TEST_WORKER(abort_reaches_subgroups) {
  auto pg = testing::WorkerGroup();
  std::shared_ptr<ProcessGroup> sub = pg->NewGroup({0, 1});
  WORKER_EXPECT(sub != nullptr, "no subgroup");
  if (pg->rank() == 0) {
    pg->Abort(transport::FailedPreconditionError("rank 0 gave up on purpose"));
    WORKER_EXPECT(!sub->aborted_reason().ok(), "the subgroup was not aborted here");
    // Alive (its store with it) until rank 1 has seen the error.
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    sub->AllReduce(nn::Ones({4})).Wait();
    WORKER_EXPECT(false, "the subgroup's all-reduce succeeded without rank 0");
  } catch (const DistributedError& e) {
    WORKER_EXPECT(std::string(e.what()).find("rank 0 gave up on purpose") != std::string::npos, e.what());
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(waited < 5, "waited " + std::to_string(waited) + " s for the aborted subgroup");
  testing::MarkThisRankDone(*pg);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AbortReachesTheGroupsMadeFromTheGroup) {
  auto run = RunWorkers("abort_reaches_subgroups", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------------ stats, trace ----

DDP_TEST_WORKER(stats_trace) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string prefix = std::string(tmp != nullptr ? tmp : "/tmp") + "/ddp_trace_" +
                             std::getenv("MASTER_PORT") + "_";
  // Rank 1 makes its wrapper (and trace) a second later: the files still
  // line up, as both count from the host's monotonic clock.
  if (pg->rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  {
    auto model = nn::modules::MakeCnn();
    DistributedDataParallel ddp(model, {.first_bucket_mb = 0.1, .process_group = pg,
                                        .log_stats_every = 2, .trace_prefix = prefix});
    for (int s = 0; s < 5; ++s) {
      auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    }
    const DdpStats stats = ddp.Stats();
    std::fprintf(stderr, "stats: %s\n", stats.ToString().c_str());
    // Rank 0 logged after iterations 2 and 4 without restarting the window
    // Stats() reports: both ranks count all 5.
    // fc1.weight alone (in place), then everything else (80 KB, one bucket).
    WORKER_EXPECT(stats.iterations == 5 && stats.bucket_bytes.size() == 2, stats.ToString());
    WORKER_EXPECT(stats.forward_ms > 0 && stats.backward_compute_ms > 0 && stats.backward_comm_ms > 0,
                  stats.ToString());
    WORKER_EXPECT(stats.overlap_ms >= 0 && stats.overlap_ms <= stats.backward_comm_ms + 1e-9, stats.ToString());
  }
  const std::string path = prefix + "rank" + std::to_string(pg->rank()) + ".json";
  std::ifstream in(path);
  WORKER_EXPECT(in.good(), "no trace at " + path);
  WORKER_EXPECT(!std::filesystem::exists(prefix + "rank" + std::to_string(pg->rank()) + ".partial.json"),
                "the streamed trace is left beside the complete one");
  nlohmann::json trace = nlohmann::json::parse(in);
  std::map<std::string, int> names;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "X") ++names[e["name"].get<std::string>()];
  }
  WORKER_EXPECT(names["forward"] == 5, "forward events: " + std::to_string(names["forward"]));
  WORKER_EXPECT(names["backward compute"] == 5, "backward events");
  int bucket0 = 0;
  for (const auto& [name, count] : names) {
    if (name.rfind("all_reduce bucket 0(", 0) == 0) bucket0 += count;
  }
  WORKER_EXPECT(bucket0 == 5, "bucket 0 events: " + std::to_string(bucket0));
  // The last bucket-0 all-reduce ends at about the same time on both ranks
  // (they finish it together); with per-recorder origins, 1 s apart.
  pg->AllReduce(nn::Ones({1})).Wait();  // both files written
  if (pg->rank() == 0) {
    auto last_end = [&](const std::string& file) {
      std::ifstream trace_in(file);
      const nlohmann::json t = nlohmann::json::parse(trace_in);
      int64_t end = -1;
      for (const auto& e : t["traceEvents"]) {
        if (e["ph"] == "X" && e["name"].get<std::string>().rfind("all_reduce bucket 0(", 0) == 0) {
          end = std::max(end, e["ts"].get<int64_t>() + e["dur"].get<int64_t>());
        }
      }
      return end;
    };
    const int64_t end0 = last_end(prefix + "rank0.json"), end1 = last_end(prefix + "rank1.json");
    WORKER_EXPECT(end0 > 0 && end1 > 0 && std::abs(end0 - end1) < 300000,
                  "the last bucket-0 all-reduce ends at " + std::to_string(end0) + " us on rank 0, " +
                      std::to_string(end1) + " us on rank 1");
  }
  return testing::WorkerExit();
}

// A run that dies without unwinding (here _Exit after the fourth forward)
// leaves the timeline streamed at each forward: the three iterations before
// it, in a file trace viewers and JSON readers open (the array form, closed
// after every flush). Before, the trace was written only by the destructor.
DDP_TEST_WORKER(trace_of_a_crash) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = nn::modules::MakeMlp();
  auto* ddp = new DistributedDataParallel(model, {.process_group = pg,
                                                  .trace_prefix = std::getenv("DDP_TEST_TRACE_PREFIX")});
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy((*ddp)(x), y));
  }
  auto [x, y] = testing::Batch(data, 0, kBatch);
  (*ddp)(x);
  pg->Barrier().Wait();
  std::fflush(nullptr);
  std::_Exit(0);
}

TEST(DdpFeaturesTest, ARunThatDiesLeavesItsStreamedTrace) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string prefix = std::string(tmp != nullptr ? tmp : "/tmp") + "/crash_trace_" +
                             std::to_string(::getpid()) + "_";
  auto run = RunWorkers("trace_of_a_crash", 2, {{"DDP_TEST_TRACE_PREFIX", prefix}});
  ASSERT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_FALSE(std::filesystem::exists(prefix + "rank" + std::to_string(rank) + ".json"));
    std::ifstream in(prefix + "rank" + std::to_string(rank) + ".partial.json");
    ASSERT_TRUE(in.good());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_FALSE(text.empty());
    nlohmann::json events;
    ASSERT_NO_THROW(events = nlohmann::json::parse(text)) << text;
    std::map<std::string, int> names;
    bool pid_is_rank = true;
    for (const auto& e : events) {
      pid_is_rank &= e["pid"] == rank;
      if (e["ph"] == "X") ++names[e["name"].get<std::string>()];
    }
    EXPECT_TRUE(pid_is_rank) << text;
    EXPECT_EQ(names["forward"], 3) << text;
    EXPECT_EQ(names["backward compute"], 3) << text;
  }
}

// A trace file that cannot be created fails construction, naming it, not
// the destructor at the end of a run.
TEST(DdpFeaturesTest, AnUnwritableTracePrefixFailsConstruction) {
  auto pg = ProcessGroup::Single();
  try {
    DistributedDataParallel ddp(nn::modules::MakeMlp(), {.process_group = pg,
                                                         .trace_prefix = "/nonexistent-dir/t_"});
    ADD_FAILURE() << "constructed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/t_rank0.partial.json"), std::string::npos)
        << e.what();
  }
}

// A fresh folder under the test's temporary one, for FIFOs of its own.
std::string FreshTraceFolder() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/ddp_trace_fifo_XXXXXX";
  return ::mkdtemp(pattern.data()) != nullptr ? pattern : "";
}

// Reads `fifo` as `cat fifo &` would, opened before the run (non-blocking,
// so that the open does not wait for a writer), until the writer closes it
// or `deadline` passes; `*ended` tells which.
std::thread ReadFifo(const std::string& fifo, std::chrono::seconds deadline, std::string* text, bool* ended) {
  const int fd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  return std::thread([fd, deadline, text, ended] {
    *ended = false;
    if (fd < 0) return;
    const auto until = std::chrono::steady_clock::now() + deadline;
    char buffer[4096];
    for (auto now = std::chrono::steady_clock::now(); now < until; now = std::chrono::steady_clock::now()) {
      // Until a writer has come, Linux reports nothing here (no POLLHUP).
      pollfd p{fd, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now);
      if (::poll(&p, 1, static_cast<int>(left.count()) + 1) <= 0) continue;
      const ssize_t n = ::read(fd, buffer, sizeof(buffer));
      if (n == 0) {
        *ended = true;
        break;
      }
      if (n > 0) text->append(buffer, static_cast<size_t>(n));
    }
    ::close(fd);
  });
}

// A trace path that is a FIFO (mkfifo t_rank0.json; cat t_rank0.json) is
// streamed: its reader gets one complete JSON document when the wrapper
// ends, with every iteration's events; no partial file is made, and the
// FIFO stays a FIFO. Before, nothing was written to the FIFO (the end's
// write refused to replace it, with a warning), and its reader waited.
TEST(DdpFeaturesTest, ATraceThatIsAFifoIsStreamedToItsReader) {
  const std::string dir = FreshTraceFolder();
  ASSERT_FALSE(dir.empty());
  const std::string fifo = dir + "/t_rank0.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string text;
  bool ended = false;
  std::thread reader = ReadFifo(fifo, std::chrono::seconds(60), &text, &ended);
  {
    DistributedDataParallel ddp(nn::modules::MakeMlp(), {.process_group = ProcessGroup::Single(),
                                                         .trace_prefix = dir + "/t_"});
    const auto& data = testing::FashionMnist();
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    }
  }
  reader.join();
  EXPECT_TRUE(ended) << "the stream was not ended: " << text;
  nlohmann::json doc;
  ASSERT_NO_THROW(doc = nlohmann::json::parse(text)) << text;
  std::map<std::string, int> names;
  for (const auto& e : doc["traceEvents"]) {
    EXPECT_EQ(e["pid"], 0) << e.dump();
    if (e["ph"] == "X") ++names[e["name"].get<std::string>()];
  }
  EXPECT_EQ(names["forward"], 3) << text;
  EXPECT_EQ(doc["otherData"]["dropped_events"], 0) << text;
  EXPECT_EQ(std::filesystem::status(fifo).type(), std::filesystem::file_type::fifo);
  EXPECT_FALSE(std::filesystem::exists(dir + "/t_rank0.partial.json"));
}

// Builds a DDP whose rank-0 trace (the options' trace_prefix, set here)
// is a FIFO that nothing reads, with `options` otherwise: construction must
// fail within 10 s naming the FIFO and the 300 ms it waited for a reader,
// leaving the FIFO and no partial trace.
void ExpectAnUnreadFifoTraceRefused(DdpOptions options) {
  const std::string dir = FreshTraceFolder();
  ASSERT_FALSE(dir.empty());
  const std::string fifo = dir + "/t_rank0.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  options.trace_prefix = dir + "/t_";
  const auto start = std::chrono::steady_clock::now();
  try {
    DistributedDataParallel ddp(nn::modules::MakeMlp(), options);
    ADD_FAILURE() << "constructed with a FIFO trace that nothing reads";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("trace: " + fifo + " is a FIFO, and nothing opened it for reading "
                                         "within 300 ms"),
              std::string::npos)
        << e.what();
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, 10.0);
  EXPECT_EQ(std::filesystem::status(fifo).type(), std::filesystem::file_type::fifo);
  EXPECT_FALSE(std::filesystem::exists(dir + "/t_rank0.partial.json"));
}

// A FIFO trace that nothing reads does not hang the run: construction
// waits trace_reader_wait for a reader, then fails naming the FIFO. Before,
// construction went on, and the trace was lost at the end with a warning.
TEST(DdpFeaturesTest, AFifoTraceThatNothingReadsFailsConstructionNamingIt) {
  ExpectAnUnreadFifoTraceRefused(
      {.process_group = ProcessGroup::Single(), .trace_reader_wait = std::chrono::milliseconds(300)});
}

// The FIFO's wait for a reader is at most half the group's timeout: the
// other ranks wait for this one meanwhile, and must hear why (through the
// abort) before their own timeout. Before, it waited trace_reader_wait
// (30 s here) whatever the group's timeout (600 ms here).
TEST(DdpFeaturesTest, AFifoTraceWaitsForItsReaderAtMostHalfTheGroupsTimeout) {
  ExpectAnUnreadFifoTraceRefused({.process_group = ProcessGroup::Single({.timeout = std::chrono::milliseconds(600)})});
}

// The forward events of the trace file at `path`, read as strict JSON (a
// document or a bare array of events); -1 when it is not JSON.
int ForwardEventsIn(const std::string& path) {
  std::ifstream in(path);
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    ADD_FAILURE() << path << ": " << e.what();
    return -1;
  }
  int forwards = 0;
  for (const auto& e : doc.is_array() ? doc : doc["traceEvents"]) {
    forwards += e["ph"] == "X" && e["name"] == "forward";
  }
  return forwards;
}

// Two wrappers of one process given the same trace_prefix would write one
// file (each truncating and overwriting the other's), and the second would
// take the group's trace over: the second is refused, naming the prefix and
// the file, whether on the same group or on another group of the same rank
// (a spelling of the prefix through "./" included), and the first's trace
// is whole. Once the first is gone the prefix is free again. Before, the
// second was made and both wrote into the same files.
TEST(DdpFeaturesTest, ASecondWrapperWithTheSameTracePrefixIsRefused) {
  const std::string dir = FreshTraceFolder();
  ASSERT_FALSE(dir.empty());
  const std::string prefix = dir + "/t_";
  auto pg = ProcessGroup::Single();
  const auto& data = testing::FashionMnist();
  {
    DistributedDataParallel first(nn::modules::MakeMlp(), {.process_group = pg, .trace_prefix = prefix});
    for (const bool same_group : {true, false}) {
      SCOPED_TRACE(same_group ? "the same group" : "another group");
      const std::string second_prefix = same_group ? prefix : dir + "/./t_";
      try {
        DistributedDataParallel second(nn::modules::MakeMlp(),
                                       {.process_group = same_group ? pg : ProcessGroup::Single(),
                                        .trace_prefix = second_prefix});
        ADD_FAILURE() << "a second wrapper with the same trace_prefix was made";
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()),
                  "DistributedDataParallel: DdpOptions::trace_prefix \"" + second_prefix + "\": the trace file " +
                      second_prefix + "rank0.json is already written by another DistributedDataParallel of this "
                      "process (made with the same trace_prefix, on this group or another of this rank); give "
                      "each wrapper its own trace_prefix, or, to wrap a model again, destroy the earlier "
                      "wrapper first");
      }
    }
    for (int s = 0; s < 2; ++s) {
      auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(first(x), y));
    }
  }
  EXPECT_EQ(ForwardEventsIn(prefix + "rank0.json"), 2);
  EXPECT_FALSE(std::filesystem::exists(prefix + "rank0.partial.json"));
  EXPECT_NO_THROW(DistributedDataParallel(nn::modules::MakeMlp(), {.process_group = pg, .trace_prefix = prefix}));
}

// The names of the complete events in the trace file at `path` that
// contain `part`.
std::vector<std::string> EventsNaming(const std::string& path, const std::string& part) {
  std::ifstream in(path);
  std::vector<std::string> names;
  try {
    const nlohmann::json doc = nlohmann::json::parse(in);
    for (const auto& e : doc["traceEvents"]) {
      const std::string name = e["name"].get<std::string>();
      if (e["ph"] == "X" && name.find(part) != std::string::npos) names.push_back(name);
    }
  } catch (const nlohmann::json::exception& e) {
    ADD_FAILURE() << path << ": " << e.what();
  }
  return names;
}

// Two wrappers on one group, each with a trace of its own: each trace gets
// the group's collectives while its wrapper lives, and the second's end
// does not stop the first's. Before, the second took the group's trace
// over, and after its end nothing was recorded (the first's trace lost
// every collective from the second's construction on).
TEST(DdpFeaturesTest, TwoWrappersOnOneGroupEachTraceItsCollectives) {
  const std::string dir = FreshTraceFolder();
  ASSERT_FALSE(dir.empty());
  auto pg = ProcessGroup::Single();
  {
    DistributedDataParallel first(nn::modules::MakeMlp(), {.process_group = pg, .trace_prefix = dir + "/a_"});
    {
      DistributedDataParallel second(nn::modules::MakeMlp(), {.process_group = pg, .trace_prefix = dir + "/b_"});
      pg->AllReduce(nn::Ones({1}), transport::ReduceOp::kSum, "while both live").Wait();
    }
    pg->AllReduce(nn::Ones({1}), transport::ReduceOp::kSum, "after the second").Wait();
  }
  auto text = [](const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(EventsNaming(dir + "/a_rank0.json", "while both live").size(), 1u) << text(dir + "/a_rank0.json");
  EXPECT_EQ(EventsNaming(dir + "/a_rank0.json", "after the second").size(), 1u);
  EXPECT_EQ(EventsNaming(dir + "/b_rank0.json", "while both live").size(), 1u);
  EXPECT_EQ(EventsNaming(dir + "/b_rank0.json", "after the second").size(), 0u);
}

// A complete trace of an earlier run with the same prefix is not left
// beside this run's partial one, where a reader would take the two for one
// run: it is gone once the wrapper is made, and this run's replaces it at
// the end. The partial file is JSON at every forward. Before, the earlier
// run's file stayed until this run's end (for good, if this run died).
TEST(DdpFeaturesTest, AnEarlierRunsTraceIsNotLeftBesideThisRunsPartialOne) {
  const std::string dir = FreshTraceFolder();
  ASSERT_FALSE(dir.empty());
  const std::string prefix = dir + "/t_";
  std::ofstream(prefix + "rank0.json") << "{\"traceEvents\": [{\"name\": \"forward\", \"ph\": \"X\"}]}\n";
  const auto& data = testing::FashionMnist();
  {
    DistributedDataParallel ddp(nn::modules::MakeMlp(), {.process_group = ProcessGroup::Single(),
                                                         .trace_prefix = prefix});
    EXPECT_FALSE(std::filesystem::exists(prefix + "rank0.json")) << "the earlier run's trace is still there";
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      // Each forward flushed the iterations before it.
      EXPECT_EQ(ForwardEventsIn(prefix + "rank0.partial.json"), s) << "after forward " << s;
    }
    EXPECT_FALSE(std::filesystem::exists(prefix + "rank0.json"));
  }
  EXPECT_EQ(ForwardEventsIn(prefix + "rank0.json"), 3);
  EXPECT_FALSE(std::filesystem::exists(prefix + "rank0.partial.json"));
}

// Two DDPs on disjoint one-rank subgroups, one per process: both are rank 0
// of their group, and each still writes its own trace file (named by the
// rank in the job), not one file both overwrite.
DDP_TEST_WORKER(subgroup_traces) {
  auto pg = testing::WorkerGroup();
  std::shared_ptr<ProcessGroup> mine;
  for (int r = 0; r < pg->size(); ++r) {
    auto g = pg->NewGroup({r});
    if (g != nullptr) mine = g;
  }
  WORKER_EXPECT(mine != nullptr && mine->rank() == 0 && mine->root_rank() == pg->rank(),
                "subgroup rank " + std::to_string(mine == nullptr ? -1 : mine->root_rank()));
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string prefix = std::string(tmp != nullptr ? tmp : "/tmp") + "/ddp_subtrace_" +
                             std::getenv("MASTER_PORT") + "_";
  {
    nn::Generator g(1);
    auto model = nn::modules::MakeMlp(g);
    DistributedDataParallel ddp(model, {.process_group = mine, .trace_prefix = prefix});
    const auto& data = testing::FashionMnist();
    auto [x, y] = testing::Batch(data, 0, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  }
  pg->AllReduce(nn::Ones({1})).Wait();  // both files written
  for (int r = 0; r < pg->size(); ++r) {
    const std::string path = prefix + "rank" + std::to_string(r) + ".json";
    std::ifstream in(path);
    WORKER_EXPECT(in.good(), "no trace at " + path);
    const nlohmann::json trace = nlohmann::json::parse(in);
    bool pid_is_rank = false;
    for (const auto& e : trace["traceEvents"]) pid_is_rank |= e.contains("pid") && e["pid"] == r;
    WORKER_EXPECT(pid_is_rank, path + " has no event of process " + std::to_string(r));
  }
  return testing::WorkerExit();
}

// A straggler shows in the statistics: rank 1 sleeps before each backward,
// so rank 0's collectives wait for it and rank 1's hardly wait. The
// lateness is large (a loaded machine delays either rank by tens of ms)
// and the bounds are fractions of it.
DDP_TEST_WORKER(peer_wait) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  // The group itself: rank 1 arrives 1 s late at an all-reduce.
  pg->AllReduce(nn::Ones({1})).Wait();  // start together
  const auto before = pg->PeerWaitTime();
  if (pg->rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  pg->AllReduce(nn::Ones({1 << 16})).Wait();
  const double waited_ms = std::chrono::duration<double, std::milli>(pg->PeerWaitTime() - before).count();
  if (pg->rank() == 0) {
    WORKER_EXPECT(waited_ms >= 500, "rank 0 waited " + std::to_string(waited_ms) + " ms for the late rank");
  } else {
    WORKER_EXPECT(waited_ms < 250, "the late rank waited " + std::to_string(waited_ms) + " ms");
  }
  // DDP's statistics: 600 ms late before every backward, 4 iterations. Rank
  // 0 must see at least half of it; the straggler may wait up to a third of
  // it (rank 0 descheduled for a while on a loaded 2-core machine) and
  // still stays well apart from rank 0.
  auto model = nn::modules::MakeMlp();
  DistributedDataParallel ddp(model, {.process_group = pg});
  ddp.ResetStats();
  for (int s = 0; s < 4; ++s) {
    auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
    const Tensor loss = nn::loss::CrossEntropy(ddp(x), y);
    if (pg->rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(600));
    nn::Backward(loss);
  }
  const DdpStats stats = ddp.Stats();
  std::fprintf(stderr, "rank %d stats: %s\n", pg->rank(), stats.ToString().c_str());
  WORKER_EXPECT(stats.ToString().find("waiting for other ranks") != std::string::npos, stats.ToString());
  if (pg->rank() == 0) {
    WORKER_EXPECT(stats.peer_wait_ms >= 300, "rank 0 waited " + std::to_string(stats.peer_wait_ms) + " ms per step");
  } else {
    WORKER_EXPECT(stats.peer_wait_ms < 200, "the straggler waited " + std::to_string(stats.peer_wait_ms) +
                                               " ms per step");
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, StatisticsShowWhoWaitsForAStraggler) {
  auto run = RunWorkers("peer_wait", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpFeaturesTest, DdpsOfSubgroupsWriteOneTraceEach) {
  auto run = RunWorkers("subgroup_traces", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A window with no communication (no synchronizing iteration yet, or one
// rank) is not printed as communication that overlapped 100%; one with
// communication prints its share. Before, DDP_DEBUG=info's line at
// construction and every one-rank Stats() said "overlapped 0.00 ms = 100%".
TEST(DdpFeaturesTest, StatisticsWithoutCommunicationClaimNoOverlap) {
  const std::string empty = DdpStats{}.ToString();
  EXPECT_EQ(empty.find('%'), std::string::npos) << empty;
  EXPECT_NE(empty.find("backward comm 0.00 ms (no communication to overlap, exposed 0.00 ms)"), std::string::npos)
      << empty;
  DistributedDataParallel ddp(nn::modules::MakeMlp(), {.process_group = ProcessGroup::Single()});
  const auto& data = testing::FashionMnist();
  for (int s = 0; s < 2; ++s) {
    auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  }
  const std::string one_rank = ddp.Stats().ToString();
  EXPECT_EQ(one_rank.find('%'), std::string::npos) << one_rank;
  const std::string some = DdpStats{.iterations = 1, .backward_comm_ms = 4, .overlap_ms = 1}.ToString();
  EXPECT_NE(some.find("backward comm 4.00 ms (overlapped 1.00 ms = 25%, exposed 0.00 ms)"), std::string::npos)
      << some;
}

TEST(DdpFeaturesTest, StatisticsAndTrace) {
  auto run = RunWorkers("stats_trace", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  EXPECT_NE(run.Output(0).find("[ddp] iterations 0-1:"), std::string::npos) << run.Output(0);
  EXPECT_NE(run.Output(0).find("[ddp] iterations 2-3:"), std::string::npos) << run.Output(0);
  EXPECT_EQ(run.Output(1).find("[ddp] iterations"), std::string::npos) << "only rank 0 logs";
}


// ---------------------------------------------- unusual parameters ----

// A zero-size parameter that forward uses, and a frozen layer beside a
// trained one.
class ZeroSizeAndFrozen : public Module {
 public:
  explicit ZeroSizeAndFrozen(uint64_t seed) {
    nn::Generator gen(seed);
    trained_ = RegisterModule("trained", std::make_shared<nn::modules::Linear>(784, 10, true, gen));
    frozen_ = RegisterModule("frozen", std::make_shared<nn::modules::Linear>(784, 10, true, gen));
    for (auto& [name, p] : frozen_->NamedParameters()) p.set_requires_grad(false);
    empty_ = RegisterParameter("empty", nn::Zeros({0}), true);
  }
  Tensor Forward(const Tensor& x) override {
    const Tensor flat = nn::ops::Flatten(x, 1);
    return (*trained_)(flat) + (*frozen_)(flat) * 0.1 + nn::ops::Sum(empty_);
  }
  using Module::Forward;
  std::string TypeName() const override { return "ZeroSizeAndFrozen"; }

 private:
  std::shared_ptr<nn::modules::Linear> trained_, frozen_;
  Tensor empty_;
};

// Three steps of ZeroSizeAndFrozen with `options`, each of two
// micro-batches per rank (the first under NoSync) when `no_sync`, else of
// one: they equal three steps on the combined batches.
void CheckZeroSizeAndFrozen(ProcessGroup& pg, DdpOptions options, bool no_sync) {
  const int world = pg.size(), rank = pg.rank();
  const int micro = no_sync ? 2 : 1;
  auto model = std::make_shared<ZeroSizeAndFrozen>(rank == 0 ? 3 : 40);
  options.process_group = Borrow(pg);
  DistributedDataParallel ddp(model, options);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = std::make_shared<ZeroSizeAndFrozen>(3);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  for (int s = 0; s < 3; ++s) {
    const int64_t base = s * micro * world * kBatch;
    opt.ZeroGrad();
    MicroBatchBackwards(ddp, base, rank, micro, 1.0 / micro);
    opt.Step();
    ReferenceStep(*reference, ref_opt, base, micro * world * kBatch);
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off by " + std::to_string(diff));
}

DDP_TEST_WORKER(zero_size_and_frozen) {
  auto pg = testing::WorkerGroup();
  for (const bool no_sync : {false, true}) {
    // 1e-9 MiB: every parameter a bucket of its own, the empty one too.
    for (const double cap : {25.0, 1e-9}) {
      for (int variant = 0; variant < 4; ++variant) {
        DdpOptions options{.bucket_cap_mb = cap, .first_bucket_mb = cap};
        options.find_unused_parameters = variant == 1;
        options.gradient_as_bucket_view = variant == 2;
        options.static_graph = variant == 3;
        std::fprintf(stderr, "no_sync %d, bucket_cap_mb %g, variant %d\n", no_sync, cap, variant);
        CheckZeroSizeAndFrozen(*pg, options, no_sync);
      }
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ZeroSizeAndFrozenParametersTrainAsOneProcess) {
  auto run = RunWorkers("zero_size_and_frozen", 2, {}, 120000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A hook registered before the wrapper that doubles each accumulated
// gradient runs before DDP's, so the doubled gradient is what is averaged:
// for gradients copied into buckets, bucket views and gradients reduced in
// place, with and without a NoSync micro-batch first (whose gradient the
// second backward's hook doubles again).
void CheckGradientDoubledBeforeTheWrapper(ProcessGroup& pg, DdpOptions options, bool no_sync) {
  const auto& data = testing::FashionMnist();
  const int world = pg.size(), rank = pg.rank();
  auto model = Mlp(rank == 0 ? 3 : 40);
  for (const auto& [name, p] : model->NamedParameters()) {
    p.RegisterPostAccumulateGradHook([](const Tensor& q) { q.grad().CopyFrom(nn::ops::MulScalar(q.grad(), 2.0)); });
  }
  options.process_group = Borrow(pg);
  DistributedDataParallel ddp(model, options);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = Mlp(3);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  const int first = no_sync ? 0 : 1;
  for (int s = 0; s < 3; ++s) {
    const int64_t base = s * 2 * world * kBatch;
    opt.ZeroGrad();
    MicroBatchBackwards(ddp, base, rank, 2, 0.5, first);
    opt.Step();
    ref_opt.ZeroGrad();
    for (int r = 0; r < world; ++r) {
      for (int j = first; j < 2; ++j) {
        auto [x, y] = testing::Batch(data, base + (r * 2 + j) * kBatch, kBatch);
        const double doubled = j == 0 ? 4.0 : 2.0;
        nn::Backward(nn::loss::CrossEntropy((*reference)(x), y) * (0.5 * doubled / world));
      }
    }
    ref_opt.Step();
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off by " + std::to_string(diff));
}

DDP_TEST_WORKER(gradient_doubled_before_the_wrapper) {
  auto pg = testing::WorkerGroup();
  for (const bool no_sync : {false, true}) {
    for (int variant = 0; variant < 3; ++variant) {
      DdpOptions options;
      options.gradient_as_bucket_view = variant == 1;
      options.inplace_gradient_mb = variant == 2 ? 1e-6 : 0.5;
      std::fprintf(stderr, "no_sync %d, variant %d\n", no_sync, variant);
      CheckGradientDoubledBeforeTheWrapper(*pg, options, no_sync);
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, AGradientChangedByAHookBeforeTheWrapperIsTheOneAveraged) {
  auto run = RunWorkers("gradient_doubled_before_the_wrapper", 2, {}, 120000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// static_graph whose first iteration starts with a NoSync micro-batch, on
// a model with a layer no iteration uses (Branchy's `never`): the used set
// is learned from the synchronizing backward, and four steps equal four on
// the combined batches, with and without find_unused_parameters and
// bucket views.
DDP_TEST_WORKER(static_graph_after_no_sync) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  for (int variant = 0; variant < 4; ++variant) {
    auto model = std::make_shared<Branchy>(rank == 0 ? 3 : 9, true);
    DdpOptions options{.process_group = pg};
    options.static_graph = true;
    options.find_unused_parameters = variant % 2 == 1;
    options.gradient_as_bucket_view = variant >= 2;
    DistributedDataParallel ddp(model, options);
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    auto reference = std::make_shared<Branchy>(3, true);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    try {
      for (int s = 0; s < 4; ++s) {
        const int64_t base = s * 2 * world * kBatch;
        opt.ZeroGrad();
        MicroBatchBackwards(ddp, base, rank, 2, 0.5);
        opt.Step();
        ReferenceStep(*reference, ref_opt, base, 2 * world * kBatch);
      }
    } catch (const std::exception& e) {
      WORKER_EXPECT(false, "variant " + std::to_string(variant) + " threw: " + e.what());
      return testing::WorkerExit();
    }
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-5, "variant " + std::to_string(variant) + ": `" + worst + "` off by " +
                                    std::to_string(diff));
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, StaticGraphWhoseFirstIterationStartsUnderNoSyncTrainsAsOneProcess) {
  auto run = RunWorkers("static_graph_after_no_sync", 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Linear, BatchNorm1d (buffers broadcast at each training forward), ReLU,
// Linear.
class LinearBatchNorm : public Module {
 public:
  explicit LinearBatchNorm(uint64_t seed) {
    nn::Generator gen(seed);
    first_ = RegisterModule("first", std::make_shared<nn::modules::Linear>(784, 16, true, gen));
    bn_ = RegisterModule("bn", std::make_shared<nn::modules::BatchNorm1d>(16));
    last_ = RegisterModule("last", std::make_shared<nn::modules::Linear>(16, 10, true, gen));
  }
  Tensor Forward(const Tensor& x) override {
    return (*last_)(nn::ops::Relu((*bn_)((*first_)(nn::ops::Flatten(x, 1)))));
  }
  using Module::Forward;
  std::string TypeName() const override { return "LinearBatchNorm"; }

 private:
  std::shared_ptr<nn::modules::Linear> first_, last_;
  std::shared_ptr<nn::modules::BatchNorm1d> bn_;
};

// Rank r runs 2 + 2r steps of LinearBatchNorm under Join (rank 0, the
// buffers' first root, runs out first), one bucket per parameter, with
// `hook`: 0 none, 1 AllReduceHook, 2 a hook on local gradients that
// divides by the bucket's divisor itself.
std::shared_ptr<Module> TrainUnderJoin(ProcessGroup& pg, int hook, bool divide_by_initial_world_size) {
  const auto& data = testing::FashionMnist();
  const int rank = pg.rank();
  auto model = std::make_shared<LinearBatchNorm>(3);
  DistributedDataParallel ddp(model, {.bucket_cap_mb = 1e-9, .first_bucket_mb = 1e-9, .process_group = Borrow(pg)});
  if (hook == 1) ddp.RegisterCommHook(hooks::AllReduceHook());
  if (hook == 2) {
    ddp.RegisterCommHook(CommHook::OnLocalGradients([](ProcessGroup& group, GradBucket& bucket) {
      bucket.buffer().CopyFrom(nn::ops::MulScalar(bucket.buffer(), 1.0 / bucket.divisor()));
      return group.AllReduce(bucket.buffer());
    }));
  }
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  Join join(ddp, {.divide_by_initial_world_size = divide_by_initial_world_size});
  for (int s = 0; s < 2 + 2 * rank; ++s) {
    opt.ZeroGrad();
    auto [x, y] = testing::Batch(data, (s * 4 + rank) * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    opt.Step();
  }
  join.Wait();
  return model;
}

// Under Join the ranks that ran out shadow the hook's collectives with
// zero gradients and the divisor the option gives: with either hook the
// replicas end where they do without one.
DDP_TEST_WORKER(join_with_hooks) {
  auto pg = testing::WorkerGroup();
  for (const bool initial : {true, false}) {
    auto plain = TrainUnderJoin(*pg, 0, initial);
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*plain)), "replicas differ");
    for (const int hook : {1, 2}) {
      auto hooked = TrainUnderJoin(*pg, hook, initial);
      const auto [diff, worst] = testing::MaxRelativeDifference(*hooked, *plain);
      WORKER_EXPECT(diff <= 1e-6, "hook " + std::to_string(hook) + ", divide_by_initial_world_size " +
                                      std::to_string(initial) + ": `" + worst + "` off by " + std::to_string(diff));
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, JoinWithCommunicationHooksAndBufferBroadcasts) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("join_with_hooks", n, {}, 120000);
    EXPECT_TRUE(run.AllSucceeded()) << n << " ranks\n" << testing::AllOutput(run);
  }
}

// Collectives on the caller, static_graph learning in its first iteration
// with an output left out of the loss: the buckets run from the end of
// backward, after the last gradient, and rank 0's wait there for rank 1
// (late by 400 ms) is communication that kept no compute waiting. Before,
// it was taken out of the compute time (which came out negative) and
// counted as exposed twice. Compute and exposed together span at most
// the iteration.
DDP_TEST_WORKER(static_graph_caller_stats) {
  auto pg = testing::WorkerGroup();
  WORKER_EXPECT(pg->collectives_on_caller(), "DDP_COLLECTIVE_THREAD was not taken");
  auto model = std::make_shared<TwoHeads>(31);
  DistributedDataParallel ddp(model, {.static_graph = true, .process_group = pg});
  auto [x, y] = testing::Batch(testing::FashionMnist(), pg->rank() * kBatch, kBatch);
  const auto start = std::chrono::steady_clock::now();
  const Tensor loss = nn::loss::CrossEntropy(ddp.Forward(std::vector<Tensor>{x}).at(0), y);
  if (pg->rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(400));
  nn::Backward(loss);
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const DdpStats stats = ddp.Stats();
  const std::string seen = stats.ToString() + " in " + std::to_string(wall_ms) + " ms";
  WORKER_EXPECT(stats.iterations == 1, seen);
  WORKER_EXPECT(stats.backward_compute_ms >= 0, seen);
  WORKER_EXPECT(stats.backward_compute_ms + stats.exposed_ms <= wall_ms, seen);
  WORKER_EXPECT(stats.backward_comm_ms > 0, seen);
  if (pg->rank() == 0) WORKER_EXPECT(stats.exposed_ms >= 200, "rank 0 waited for rank 1: " + seen);
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, StatisticsOfStaticGraphLearningWithCollectivesOnTheCaller) {
  auto run = RunWorkers("static_graph_caller_stats", 2, {{"DDP_COLLECTIVE_THREAD", "caller"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// log_stats_every = 2 over 3 iterations: the third is logged when the
// wrapper is destroyed. Before, the line for a window the run ended in
// (full or not) was never printed.
DDP_TEST_WORKER(stats_last_window) {
  auto pg = testing::WorkerGroup();
  {
    DistributedDataParallel ddp(nn::modules::MakeMlp(), {.process_group = pg, .log_stats_every = 2});
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = testing::Batch(testing::FashionMnist(), (s * pg->size() + pg->rank()) * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    }
  }
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, TheLastStatisticsWindowIsLoggedAtTheEnd) {
  auto run = RunWorkers("stats_last_window", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  EXPECT_NE(run.Output(0).find("[ddp] iterations 0-1: "), std::string::npos) << run.Output(0);
  EXPECT_NE(run.Output(0).find("[ddp] iterations 2-2 (end of run): forward "), std::string::npos) << run.Output(0);
  EXPECT_EQ(run.Output(1).find("[ddp] iterations"), std::string::npos) << "only rank 0 logs";
}

// A layer whose forward takes at least 300 ms on its third call (index 2),
// the time a slow step's compute would, and no time to speak of otherwise.
class SlowThirdForward : public Module {
 public:
  SlowThirdForward() {
    nn::Generator gen(5);
    fc_ = RegisterModule("fc", std::make_shared<nn::modules::Linear>(784, 4, true, gen));
  }
  Tensor Forward(const Tensor& x) override {
    if (calls_++ == 2) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return (*fc_)(nn::ops::Flatten(x, 1));
  }
  using Module::Forward;
  std::string TypeName() const override { return "SlowThirdForward"; }

 private:
  std::shared_ptr<nn::modules::Linear> fc_;
  int calls_ = 0;
};

// The logged window of iterations 0-1 holds their two forwards, and the
// third iteration's slow forward is in the line for iteration 2. Before,
// the line was printed at the end of the third forward, which its window
// took (three forwards averaged over iterations 0-1), and the window of
// iteration 2 had no forward (0 ms).
TEST(DdpFeaturesTest, TheLoggedStatisticsWindowHoldsItsOwnForwards) {
  // Wall time of iterations 0 and 1 together: their forwards fit in it.
  double first_two_ms = 0;
  ::testing::internal::CaptureStderr();
  {
    DistributedDataParallel ddp(std::make_shared<SlowThirdForward>(),
                                {.process_group = ProcessGroup::Single(), .log_stats_every = 2});
    ddp.RegisterCommHook(hooks::AllReduceHook());  // one process counts iterations through it
    auto [x, y] = testing::Batch(testing::FashionMnist(), 0, kBatch);
    const auto start = std::chrono::steady_clock::now();
    for (int s = 0; s < 2; ++s) nn::Backward(nn::ops::Sum(ddp(x)));
    first_two_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    nn::Backward(nn::ops::Sum(ddp(x)));
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  // The forward figure of the line that starts with `head`; -1 without one.
  const auto forward_ms = [&](const std::string& head) {
    const size_t at = err.find(head);
    return at == std::string::npos ? -1.0 : std::strtod(err.c_str() + at + head.size(), nullptr);
  };
  const double first = forward_ms("[ddp] iterations 0-1: forward ");
  const double last = forward_ms("[ddp] iterations 2-2 (end of run): forward ");
  EXPECT_GE(first, 0) << err;
  // The window's mean forward, over its two iterations, fits in their wall
  // time: relative, so that a slow first forward on a loaded machine does
  // not fail it. With the third (slow) forward counted in, the two
  // forwards came to 300 ms more than the iterations took.
  EXPECT_LE(2 * first, first_two_ms + 1) << err << "iterations 0-1 took " << first_two_ms << " ms";
  EXPECT_GE(last, 300) << err;
}

// A long chain of ops after the only layer: find_unused_parameters' walk
// from the outputs, which runs inside DDP's forward, takes a while. It
// counted in forward_ms and again in backward_compute_ms (timed from where
// the walk began), so forward, backward compute and exposed together came
// to more than the iterations took.
class LongChain : public Module {
 public:
  LongChain() {
    nn::Generator gen(5);
    fc_ = RegisterModule("fc", std::make_shared<nn::modules::Linear>(784, 4, true, gen));
  }
  Tensor Forward(const Tensor& x) override {
    Tensor h = (*fc_)(nn::ops::Flatten(x, 1));
    for (int i = 0; i < 10000; ++i) h = h * 1.0001;
    return h;
  }
  using Module::Forward;
  std::string TypeName() const override { return "LongChain"; }

 private:
  std::shared_ptr<nn::modules::Linear> fc_;
};

TEST(DdpFeaturesTest, TheUnusedParameterWalkCountsAsForwardOnly) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string prefix = std::string(tmp != nullptr ? tmp : "/tmp") + "/ddp_walk_trace_" +
                             std::to_string(getpid()) + "_";
  {
    DistributedDataParallel ddp(std::make_shared<LongChain>(), {.find_unused_parameters = true,
                                                                .process_group = ProcessGroup::Single(),
                                                                .trace_prefix = prefix});
    ddp.RegisterCommHook(hooks::AllReduceHook());  // one process synchronizes (and is timed) through it
    auto [x, y] = testing::Batch(testing::FashionMnist(), 0, kBatch);
    for (int s = 0; s < 3; ++s) nn::Backward(nn::ops::Sum(ddp(x)));
    ASSERT_EQ(ddp.Stats().iterations, 3) << ddp.Stats().ToString();
  }
  // Each backward's compute starts where its forward ended, not inside it.
  std::ifstream in(prefix + "rank0.json");
  ASSERT_TRUE(in.good()) << prefix << "rank0.json";
  const nlohmann::json trace = nlohmann::json::parse(in);
  int64_t forward_end = -1;
  int backwards = 0;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const int64_t ts = e["ts"].get<int64_t>(), dur = e["dur"].get<int64_t>();
    if (e["name"] == "forward") forward_end = ts + dur;
    if (e["name"] != "backward compute") continue;
    ++backwards;
    EXPECT_GE(ts, forward_end) << "backward " << backwards << " starts " << forward_end - ts
                               << " us before its forward ends";
  }
  EXPECT_EQ(backwards, 3);
}

// A layer whose forward takes at least 300 ms while `slow_` is set (the
// time a large model's forward would), and no time to speak of otherwise.
class SlowWhenAsked : public Module {
 public:
  SlowWhenAsked() {
    nn::Generator gen(5);
    fc_ = RegisterModule("fc", std::make_shared<nn::modules::Linear>(784, 4, true, gen));
  }
  Tensor Forward(const Tensor& x) override {
    if (slow_) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return (*fc_)(nn::ops::Flatten(x, 1));
  }
  using Module::Forward;
  std::string TypeName() const override { return "SlowWhenAsked"; }
  bool slow_ = false;

 private:
  std::shared_ptr<nn::modules::Linear> fc_;
};

// a = ddp(x); {NoSync; b = ddp(x);} Backward(a + b): the NoSync forward runs
// between the synchronizing forward and the backward that forward prepared
// (which it joins). Its 300 ms are forward time, in forward_ms; they were
// counted in backward_compute_ms as well (timed from the end of the first
// forward to the last gradient), so that backward compute of a layer that
// takes well under a millisecond came to over 300 ms.
TEST(DdpFeaturesTest, ANoSyncForwardBeforeThePreparedBackwardIsNotBackwardCompute) {
  auto model = std::make_shared<SlowWhenAsked>();
  DistributedDataParallel ddp(model, {.process_group = ProcessGroup::Single()});
  ddp.RegisterCommHook(hooks::AllReduceHook());  // one process synchronizes (and is timed) through it
  auto [x, y] = testing::Batch(testing::FashionMnist(), 0, kBatch);
  const Tensor a = ddp(x);
  Tensor b;
  {
    auto no_sync = ddp.NoSync();
    model->slow_ = true;
    b = ddp(x);
    model->slow_ = false;
  }
  nn::Backward(nn::ops::Sum(a) + nn::ops::Sum(b));
  const DdpStats stats = ddp.Stats();
  ASSERT_EQ(stats.iterations, 1) << stats.ToString();
  EXPECT_GE(stats.forward_ms, 150) << stats.ToString();  // (fast + 300 ms) / 2 forwards
  EXPECT_LT(stats.backward_compute_ms, 200) << stats.ToString();
}

// a = ddp(x); then, before Backward(a), a 300 ms forward of another mode or
// grad state: in eval mode under NoSync with grad enabled (it joins that
// backward), in training mode under NoGradGuard, in eval mode under
// NoGradGuard, or in training mode under NoSync. Each is forward time,
// counted once, in forward_ms (as one of two forwards), and neither in
// backward_compute_ms nor inside the trace's "backward compute" events.
// Before, the eval-mode NoSync forward was left out of backward compute and
// counted in no forward_ms (only training forwards were), and the forwards
// under NoGradGuard stayed in backward compute (the training one counted
// twice, the eval-mode one as backward compute only); the trace's backward
// compute spanned each of them.
TEST(DdpFeaturesTest, AForwardOfAnyModeBeforeThePreparedBackwardIsForwardTime) {
  struct Case {
    const char* name;
    bool eval;
    bool no_grad;  // else under NoSync
  };
  const Case cases[] = {{"eval-mode forward under NoSync", true, false},
                        {"training forward under NoGradGuard", false, true},
                        {"eval-mode forward under NoGradGuard", true, true},
                        {"training forward under NoSync", false, false}};
  const char* tmp = std::getenv("TEST_TMPDIR");
  int k = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string prefix = std::string(tmp != nullptr ? tmp : "/tmp") + "/ddp_gap_forward_" +
                               std::to_string(getpid()) + "_" + std::to_string(k++) + "_";
    auto model = std::make_shared<SlowWhenAsked>();
    {
      DistributedDataParallel ddp(model, {.process_group = ProcessGroup::Single(), .trace_prefix = prefix});
      ddp.RegisterCommHook(hooks::AllReduceHook());  // one process synchronizes (and is timed) through it
      auto [x, y] = testing::Batch(testing::FashionMnist(), 0, kBatch);
      // A first iteration, out of the window: the process's first backward
      // takes its time to warm up.
      nn::Backward(nn::ops::Sum(ddp(x)));
      ddp.ResetStats();
      Tensor loss = nn::ops::Sum(ddp(x));
      if (c.eval) model->Eval();
      model->slow_ = true;
      if (c.no_grad) {
        nn::NoGradGuard no_grad;
        (void)ddp(x);
      } else {
        auto no_sync = ddp.NoSync();
        loss = loss + nn::ops::Sum(ddp(x));
      }
      model->slow_ = false;
      model->Train();
      nn::Backward(loss);
      const DdpStats stats = ddp.Stats();
      ASSERT_EQ(stats.iterations, 1) << stats.ToString();
      EXPECT_GE(stats.forward_ms, 150) << stats.ToString();  // (fast + 300 ms) / 2 forwards
      EXPECT_LT(stats.backward_compute_ms, 200) << stats.ToString();
    }
    std::ifstream in(prefix + "rank0.json");
    ASSERT_TRUE(in.good()) << prefix << "rank0.json";
    const nlohmann::json trace = nlohmann::json::parse(in);
    int64_t slow_start = -1, slow_end = -1;
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] != "X" || e["name"] != "forward" || e["dur"].get<int64_t>() < 300000) continue;
      slow_start = e["ts"].get<int64_t>();
      slow_end = slow_start + e["dur"].get<int64_t>();
    }
    ASSERT_GE(slow_start, 0) << "no 300 ms forward event";
    int backwards = 0;
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] != "X" || e["name"] != "backward compute") continue;
      ++backwards;
      const int64_t ts = e["ts"].get<int64_t>(), end = ts + e["dur"].get<int64_t>();
      EXPECT_TRUE(end <= slow_start || ts >= slow_end)
          << "backward compute [" << ts << ", " << end << "] us overlaps the forward [" << slow_start << ", "
          << slow_end << "]";
    }
    EXPECT_GE(backwards, 1);
  }
}

// model->Eval(); ddp(x) with grad enabled prepares a backward that is
// optional, and an evaluation never runs it. The NoGradGuard forwards of the
// evaluation loop after it belong to no iteration: forward_ms counts none of
// them (no training forward ran in the window). They were taken as forwards
// run before a prepared backward: each was counted in forward_ms, over 0
// iterations, and kept its span until the next training forward.
TEST(DdpFeaturesTest, ForwardsAfterAnEvalModeForwardWhoseBackwardNeverComesAreNoIterationsTime) {
  auto model = std::make_shared<SlowWhenAsked>();
  DistributedDataParallel ddp(model, {.process_group = ProcessGroup::Single()});
  ddp.RegisterCommHook(hooks::AllReduceHook());  // one process synchronizes (and is timed) through it
  auto [x, y] = testing::Batch(testing::FashionMnist(), 0, kBatch);
  model->Eval();
  (void)ddp(x);  // grad enabled: its backward may come, and does not
  ddp.ResetStats();
  for (int i = 0; i < 1000; ++i) {
    nn::NoGradGuard no_grad;
    (void)ddp(x);
  }
  const DdpStats stats = ddp.Stats();
  EXPECT_EQ(stats.iterations, 0) << stats.ToString();
  EXPECT_EQ(stats.forward_ms, 0) << stats.ToString();
  // Training goes on as before.
  model->Train();
  nn::Backward(nn::ops::Sum(ddp(x)));
  EXPECT_EQ(ddp.Stats().iterations, 1);
}

// a = ddp(x); 1000 forwards under NoGradGuard; Backward(a). The trace cuts
// that backward's "backward compute" event around the first few forwards
// only (Reducer::kTracedGapForwards holes at most, the last covering the
// later forwards), so a loop of them neither grows the reducer's memory nor
// spends the trace's event cap; no piece overlaps a forward, and the
// statistics still leave every forward's time out of backward compute (the
// last, 300 ms, lies in the widened hole). Each forward cut a piece before.
TEST(DdpFeaturesTest, ALoopOfForwardsBeforeThePreparedBackwardCutsItsTraceEventAFewTimes) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string prefix =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/ddp_gap_loop_" + std::to_string(getpid()) + "_";
  constexpr int kLoop = 1000;
  auto model = std::make_shared<SlowWhenAsked>();
  {
    DistributedDataParallel ddp(model, {.process_group = ProcessGroup::Single(), .trace_prefix = prefix});
    ddp.RegisterCommHook(hooks::AllReduceHook());
    auto [x, y] = testing::Batch(testing::FashionMnist(), 0, kBatch);
    nn::Backward(nn::ops::Sum(ddp(x)));  // warm-up, out of the window
    ddp.ResetStats();
    const Tensor loss = nn::ops::Sum(ddp(x));
    for (int i = 0; i < kLoop; ++i) {
      model->slow_ = i == kLoop - 1;
      nn::NoGradGuard no_grad;
      (void)ddp(x);
    }
    model->slow_ = false;
    nn::Backward(loss);
    const DdpStats stats = ddp.Stats();
    ASSERT_EQ(stats.iterations, 1) << stats.ToString();
    EXPECT_LT(stats.backward_compute_ms, 200) << stats.ToString();
  }
  std::ifstream in(prefix + "rank0.json");
  ASSERT_TRUE(in.good()) << prefix << "rank0.json";
  const nlohmann::json trace = nlohmann::json::parse(in);
  std::vector<std::pair<int64_t, int64_t>> forwards, computes;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const int64_t ts = e["ts"].get<int64_t>(), end = ts + e["dur"].get<int64_t>();
    if (e["name"] == "forward") forwards.emplace_back(ts, end);
    if (e["name"] == "backward compute") computes.emplace_back(ts, end);
  }
  EXPECT_EQ(forwards.size(), static_cast<size_t>(kLoop + 2));
  // The warm-up's one, and this backward's pieces.
  EXPECT_GE(computes.size(), 2u);
  EXPECT_LE(computes.size(), 1 + internal::Reducer::kTracedGapForwards + 1);
  for (const auto& [ts, end] : computes) {
    for (const auto& [fs, fe] : forwards) {
      EXPECT_TRUE(end <= fs || ts >= fe) << "backward compute [" << ts << ", " << end
                                         << "] us overlaps a forward [" << fs << ", " << fe << "]";
    }
  }
}

// A layer whose forward, once `hold_` is set, says it has entered, waits
// (up to 10 s) until released, and then takes 300 ms.
class HeldWhenAsked : public Module {
 public:
  HeldWhenAsked() {
    nn::Generator gen(5);
    fc_ = RegisterModule("fc", std::make_shared<nn::modules::Linear>(784, 4, true, gen));
  }
  Tensor Forward(const Tensor& x) override {
    if (hold_.exchange(false)) {
      std::unique_lock lock(mu_);
      entered_ = true;
      cv_.notify_all();
      cv_.wait_for(lock, std::chrono::seconds(10), [&] { return released_; });
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    return (*fc_)(nn::ops::Flatten(x, 1));
  }
  using Module::Forward;
  std::string TypeName() const override { return "HeldWhenAsked"; }
  bool WaitEntered() {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return entered_; });
  }
  void Release() {
    std::lock_guard lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  std::atomic<bool> hold_{false};

 private:
  std::shared_ptr<nn::modules::Linear> fc_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool released_ = false;
};

// a = ddp(x); then, before Backward(a), an eval-mode NoGradGuard forward on
// another thread (300 ms) and, inside it, one on this thread: each is
// forward time, and neither is backward compute. The reducer kept one start
// for them: this thread's forward took the other's place, and the other's
// 300 ms went to backward compute, not to forward_ms.
TEST(DdpFeaturesTest, OverlappingForwardsBeforeThePreparedBackwardAreEachForwardTime) {
  auto model = std::make_shared<HeldWhenAsked>();
  DistributedDataParallel ddp(model, {.process_group = ProcessGroup::Single()});
  ddp.RegisterCommHook(hooks::AllReduceHook());
  auto [x, y] = testing::Batch(testing::FashionMnist(), 0, kBatch);
  nn::Backward(nn::ops::Sum(ddp(x)));  // warm-up, out of the window
  ddp.ResetStats();
  const Tensor loss = nn::ops::Sum(ddp(x));
  model->Eval();  // counted in forward_ms only as forwards before the backward
  model->hold_ = true;
  std::thread other([&ddp, &x] {
    nn::NoGradGuard no_grad;
    (void)ddp(x);
  });
  const bool entered = model->WaitEntered();
  if (entered) {
    nn::NoGradGuard no_grad;
    (void)ddp(x);
  }
  model->Release();
  other.join();
  ASSERT_TRUE(entered) << "the other thread's forward did not start within 10 s";
  model->Train();
  nn::Backward(loss);
  const DdpStats stats = ddp.Stats();
  ASSERT_EQ(stats.iterations, 1) << stats.ToString();
  EXPECT_GE(stats.forward_ms, 100) << stats.ToString();  // (fast + fast + 300 ms) / 3 forwards
  EXPECT_LT(stats.backward_compute_ms, 200) << stats.ToString();
}

// An earlier run's complete trace that cannot be removed (here a directory
// by its name; another user's file in a sticky /tmp does the same) is trace
// trouble only: the wrapper is made and trains, and the final write, which
// cannot replace a directory, is reported on stderr. Before, construction
// threw "cannot remove" and aborted the group.
TEST(DdpFeaturesTest, AnEarlierTraceThatCannotBeRemovedDoesNotFailConstruction) {
  const std::string dir = FreshTraceFolder();
  ASSERT_FALSE(dir.empty());
  const std::string prefix = dir + "/t_";
  ASSERT_TRUE(std::filesystem::create_directory(prefix + "rank0.json"));
  const auto& data = testing::FashionMnist();
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  ::testing::internal::CaptureStderr();
  try {
    DistributedDataParallel ddp(model, {.process_group = ProcessGroup::Single(), .trace_prefix = prefix});
    for (int s = 0; s < 2; ++s) {
      auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the wrapper failed: " << e.what();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("cannot remove " + prefix + "rank0.json"), std::string::npos) << err;
  EXPECT_TRUE(std::filesystem::is_directory(prefix + "rank0.json"));
}

// Only rank 0 traces, and wraps a second model with the same trace_prefix
// while its first wrapper lives: rank 0 refuses it, and rank 1 learns of it
// at once, naming rank 0's trace_prefix refusal, rather than waiting in the
// model comparison until the group's timeout with no cause. The group is
// not aborted: the first wrappers train on. Before, rank 1 timed out.
DDP_TEST_WORKER(trace_prefix_refused_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const std::string prefix = std::getenv("DDP_TEST_TRACE_PREFIX");
  const DdpOptions options{.process_group = pg, .trace_prefix = pg->rank() == 0 ? prefix : ""};
  auto model = Mlp(5);
  DistributedDataParallel first(model, options);
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    DistributedDataParallel second(Mlp(5), options);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("not std::invalid_argument: ") + e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string expected =
      pg->rank() == 0 ? "the trace file " + prefix + "rank0.json is already written by another "
                        "DistributedDataParallel of this process"
                      : "`trace_prefix`";
  WORKER_EXPECT(message.find(expected) != std::string::npos,
                "rank " + std::to_string(pg->rank()) + ": " + (message.empty() ? "no error" : message));
  WORKER_EXPECT(pg->rank() == 0 ||
                    message.find("rank 0 has `trace_prefix` refused: its trace file is already written") !=
                        std::string::npos,
                "rank 1 does not name rank 0's refusal: " + message);
  WORKER_EXPECT(seconds < 5, "took " + std::to_string(seconds) + " s");
  const auto& data = testing::FashionMnist();
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  nn::Backward(nn::loss::CrossEntropy(first(x), y));
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ATracePrefixRefusedOnOneRankFailsEveryRankPromptlyNamingIt) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string prefix = std::string(tmp != nullptr ? tmp : "/tmp") + "/refused_on_one_rank_" +
                             std::to_string(::getpid()) + "_";
  auto run = RunWorkers("trace_prefix_refused_on_one_rank", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_TEST_TRACE_PREFIX", prefix}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------- re-entrant checkpointing ----

// Runs a Linear without recording it and, in backward, records it again
// and runs a nested Backward through it (re-entrant activation
// checkpointing): the Linear's parameters get their gradients inside the
// nested pass. Input and output [N, in] -> [N, out].
struct CheckpointedLinear : nn::autograd::Function<CheckpointedLinear> {
  static constexpr const char* kName = "CheckpointedLinearBackward";
  static std::vector<Tensor> Forward(nn::autograd::AutogradContext* ctx, const std::vector<Tensor>& in,
                                     nn::modules::Linear* layer) {
    ctx->SaveForBackward({in[0]});
    ctx->saved_data["layer"] = layer;
    return {(*layer)(in[0])};
  }
  static std::vector<Tensor> Backward(nn::autograd::AutogradContext* ctx, const std::vector<Tensor>& grad) {
    Tensor x = ctx->GetSavedTensors()[0].Detach();
    x.set_requires_grad(true);
    nn::GradModeGuard enable(true);
    const Tensor y = (*std::any_cast<nn::modules::Linear*>(ctx->saved_data["layer"]))(x);
    nn::autograd::Backward({y}, {grad[0]});
    return {x.grad()};
  }
};

// Linear -> ReLU -> checkpointed Linear: the last layer's gradients, the
// first DDP sees, arrive in the nested pass.
class CheckpointedHead : public Module {
 public:
  explicit CheckpointedHead(uint64_t seed) {
    nn::Generator gen(seed);
    fc1_ = RegisterModule("fc1", std::make_shared<nn::modules::Linear>(784, 32, true, gen));
    fc2_ = RegisterModule("fc2", std::make_shared<nn::modules::Linear>(32, 10, true, gen));
  }
  Tensor Forward(const Tensor& x) override {
    const Tensor h = nn::ops::Relu((*fc1_)(nn::ops::Flatten(x, 1)));
    return CheckpointedLinear::Apply({h}, fc2_.get())[0];
  }
  using Module::Forward;
  std::string TypeName() const override { return "CheckpointedHead"; }

 private:
  std::shared_ptr<nn::modules::Linear> fc1_, fc2_;
};

// DDP ends its iteration when the user's backward ends, not when a pass
// nested in it does: before, the reducer's end-of-backward callback went
// to the nested pass, which finished before fc1 had a gradient, so DDP
// called fc1's parameters absent and aborted the group.
DDP_TEST_WORKER(checkpointed_last_layer) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  auto model = std::make_shared<CheckpointedHead>(rank == 0 ? 5 : 60 + rank);
  DistributedDataParallel ddp(model, {.process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = std::make_shared<CheckpointedHead>(5);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  const auto& data = testing::FashionMnist();
  for (int s = 0; s < 3; ++s) {
    const int64_t base = s * world * kBatch;
    opt.ZeroGrad();
    auto [x, y] = testing::Batch(data, base + rank * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    opt.Step();
    ReferenceStep(*reference, ref_opt, base, world * kBatch);
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "checkpointed: `" + worst + "` off by " + std::to_string(diff));
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "checkpointed: replicas differ");
  return testing::WorkerExit();
}

TEST(DdpFeaturesTest, ALastLayerCheckpointedWithANestedBackwardMatchesOneProcess) {
  auto run = RunWorkers("checkpointed_last_layer", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

}  // namespace
}  // namespace ddp::dist
