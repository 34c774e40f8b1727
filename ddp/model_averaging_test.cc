// Local SGD and model averaging over real processes: local steps averaged
// every step equal DDP (2 and 3 ranks); the post-local-SGD hook is DDP
// during its warm-up, then the replicas drift apart between averages and
// agree after each; subgroups agree within themselves (4 ranks), also
// after a warm-up that averaged over the whole group; the noop
// hook sends nothing; a bf16 model's f32 masters take the averages (large
// weights, averaged in place, too); f16 values whose sum passes f16's
// range average to themselves; every floating dtype, small and large,
// averages in one call; a parameter with a gradient on one rank only
// is averaged on every rank; a post-local-SGD hook resumed past its start
// steps locally at once; AverageParameters fails every rank at once for a
// bad tensor on one, and leaves f16 parameters as they were when its
// all-reduce fails. In one process: option checks, the averager's and
// the hook's state dicts.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ddp/distributed_data_parallel.h"
#include "ddp/model_averaging.h"
#include "ddp/testing/ddp_test_util.h"
#include "nn/autograd/engine.h"
#include "nn/loss/loss.h"
#include "nn/modules/layers.h"
#include "nn/modules/models.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"

namespace ddp::dist {
namespace {

using nn::Tensor;
using nn::modules::Module;
using testing::OneBackwardGrads;
using testing::RunWorkers;

std::shared_ptr<Module> Mlp(uint64_t seed) {
  nn::Generator gen(seed);
  return nn::modules::MakeMlp(gen);
}

// One SGD step of `ddp` on this rank's 16 samples of step `step`.
void Step(DistributedDataParallel& ddp, nn::optim::Optimizer& opt, int64_t step, int rank, int world) {
  const auto& data = testing::FashionMnist();
  auto [x, y] = testing::Batch(data, (step * world + rank) * 16, 16);
  opt.ZeroGrad();
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  opt.Step();
}

// Collective: whether every rank holds the same parameters, bit for bit.
bool Identical(ProcessGroup& pg, const Module& m) { return testing::SameOnAllRanks(pg, testing::HashState(m)); }

// ---------------------------------- local steps averaged every step ----

DDP_TEST_WORKER(average_every_step) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank(), world = pg->size();
  auto model = Mlp(3), reference = Mlp(3);
  DistributedDataParallel ddp(model, {.process_group = pg});
  DistributedDataParallel ref_ddp(reference, {.process_group = pg});
  ddp.RegisterCommHook(hooks::NoopHook());
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  PeriodicModelAverager averager({.period = 1, .process_group = pg});
  for (int64_t step = 0; step < 5; ++step) {
    Step(ddp, opt, step, rank, world);
    if (step == 0) {
      // Each rank stepped on its own gradient: the replicas differ, and the
      // noop hook's buckets only kept their place in the queue.
      WORKER_EXPECT(!Identical(*pg, *model), "the noop hook synchronized the replicas");
    }
    WORKER_EXPECT(averager.AverageParameters(model->Parameters()), "step " + std::to_string(step) + " not averaged");
    Step(ref_ddp, ref_opt, step, rank, world);
    WORKER_EXPECT(Identical(*pg, *model), "replicas differ after averaging step " + std::to_string(step));
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-5, "step " + std::to_string(step) + ": `" + worst + "` off DDP by " + std::to_string(diff));
  }
  WORKER_EXPECT(averager.step() == 5, "counted " + std::to_string(averager.step()) + " steps");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, LocalStepsAveragedEveryStepEqualDdpOnTwoRanks) {
  auto run = RunWorkers("average_every_step", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(ModelAveragingTest, LocalStepsAveragedEveryStepEqualDdpOnThreeRanks) {
  auto run = RunWorkers("average_every_step", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------- post-local SGD ----

DDP_TEST_WORKER(post_local_sgd) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank(), world = pg->size();
  constexpr int64_t kWarmup = 3, kPeriod = 4, kSteps = 12;
  auto model = Mlp(4), reference = Mlp(4);
  DistributedDataParallel ddp(model, {.process_group = pg});
  DistributedDataParallel ref_ddp(reference, {.process_group = pg});
  ddp.RegisterCommHook(hooks::PostLocalSgdHook({.start_iteration = kWarmup}));
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  PeriodicModelAverager averager({.period = kPeriod, .warmup_steps = kWarmup, .process_group = pg});
  for (int64_t step = 0; step < kSteps; ++step) {
    Step(ddp, opt, step, rank, world);
    if (step < kWarmup) {
      // The warm-up is DDP, bit for bit.
      Step(ref_ddp, ref_opt, step, rank, world);
      const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
      WORKER_EXPECT(diff == 0, "warm-up step " + std::to_string(step) + ": `" + worst + "` off DDP by " +
                                   std::to_string(diff));
    }
    const bool due = step >= kWarmup && (step - kWarmup) % kPeriod == 0;
    const bool averaged = averager.AverageParameters(model->Parameters());
    WORKER_EXPECT(averaged == due, "step " + std::to_string(step) + ": averaged " + std::to_string(averaged));
    // Identical during the warm-up and right after each average; apart on
    // the local steps in between.
    const bool together = step < kWarmup || due;
    WORKER_EXPECT(Identical(*pg, *model) == together,
                  "step " + std::to_string(step) + ": replicas " + (together ? "differ" : "agree"));
  }
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, PostLocalSgdIsDdpUntilItsStartThenAveragesEveryPeriod) {
  auto run = RunWorkers("post_local_sgd", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// PostLocalSgdHook takes local gradients and divides them itself. Called
// from a user's hook made with CommHook::OnLocalGradients, its global phase
// is the no-hook average bit for bit; from a plain user hook, which the
// reducer hands gradients already divided, it divided them again (halved on
// 2 ranks, silently). That call is now refused, naming the hook.
DDP_TEST_WORKER(post_local_sgd_inside_a_user_hook) {
  auto pg = testing::WorkerGroup();
  const auto reference = OneBackwardGrads(pg, nullptr);
  const CommHook inner = hooks::PostLocalSgdHook({.start_iteration = 100});
  const auto local = OneBackwardGrads(
      pg, CommHook::OnLocalGradients([inner](ProcessGroup& g, GradBucket& b) { return inner(g, b); }));
  WORKER_EXPECT(local == reference, "inside an OnLocalGradients hook: not the no-hook average");
  const CommHook inner_again = hooks::PostLocalSgdHook({.start_iteration = 100});
  testing::ExpectRefused(
      pg->rank(),
      [&] { OneBackwardGrads(pg, [inner_again](ProcessGroup& g, GradBucket& b) { return inner_again(g, b); }); },
      "PostLocalSgdHook inside a hook given divided gradients was accepted",
      {"PostLocalSgdHook: bucket", "already divided by 2", "CommHook::OnLocalGradients"});
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, PostLocalSgdInsideAHookGivenDividedGradientsIsRefusedNamingIt) {
  auto run = RunWorkers("post_local_sgd_inside_a_user_hook", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A user's hook on local gradients that clips the bucket in place (bounds
// wider than every value) and then calls PostLocalSgdHook: the no-hook
// average, over two steps, with one warning naming the bucket (the write
// could have been a division, which the hook would then repeat). Before,
// the call was refused and the group aborted.
DDP_TEST_WORKER(post_local_sgd_after_an_in_place_clip) {
  auto pg = testing::WorkerGroup();
  const auto reference = OneBackwardGrads(pg, nullptr);
  const CommHook inner = hooks::PostLocalSgdHook({.start_iteration = 100});
  const CommHook clipping = CommHook::OnLocalGradients([inner](ProcessGroup& g, GradBucket& b) {
    nn::NoGradGuard no_grad;
    b.buffer().CopyFrom(nn::ops::Clamp(b.buffer(), -1e30, 1e30));
    return inner(g, b);
  });
  for (int step = 0; step < 2; ++step) {
    WORKER_EXPECT(OneBackwardGrads(pg, clipping) == reference, "clipped in place: not the no-hook average");
  }
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, PostLocalSgdAfterAnInPlaceClipAveragesAndWarnsOnce) {
  auto run = RunWorkers("post_local_sgd_after_an_in_place_clip", 2);
  ASSERT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string& out = run.Output(rank);
    const std::string warning = "warning: PostLocalSgdHook: bucket";
    const size_t first = out.find(warning);
    EXPECT_NE(first, std::string::npos) << out;
    EXPECT_EQ(out.find(warning, first + 1), std::string::npos) << "warned more than once:\n" << out;
  }
}

// Two live wrappers on two groups with one PostLocalSgdState: both backward
// threads counted its iterations, unsynchronized (a data race, and the
// local phase began after half the first wrapper's iterations). The second
// is refused at its first backward, on every rank; the first goes on.
DDP_TEST_WORKER(post_local_sgd_state_on_two_groups) {
  auto pg = testing::WorkerGroup();
  std::shared_ptr<ProcessGroup> other = pg->NewGroup({0, 1});
  auto state = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = 100});
  testing::TwoWrappers wrappers(pg, other, hooks::PostLocalSgdHook(state), hooks::PostLocalSgdHook(state));
  wrappers.BackwardFirst();
  testing::ExpectRefused(
      pg->rank(), [&] { wrappers.BackwardSecond(); },
      "a second wrapper on another group shared the state",
      {"PostLocalSgdHook (bucket", "PostLocalSgdState already serves another process group"});
  wrappers.BackwardFirst();
  WORKER_EXPECT(state->iteration() == 2, "the first wrapper's iterations: " + std::to_string(state->iteration()));
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, APostLocalSgdStateServingOneGroupRefusesASecondWrapperOnAnother) {
  auto run = RunWorkers("post_local_sgd_state_on_two_groups", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Two live wrappers on one group with one PostLocalSgdState: both counted its
// iterations (each wrapper's backward bumped the one counter, from its own
// thread if it has one).
// The second is refused at its first backward, on every rank, and the
// count stays the first wrapper's. (The refusal aborts the group, as any
// hook that throws does, so the first wrapper does not go on here.)
DDP_TEST_WORKER(post_local_sgd_state_on_two_wrappers_of_one_group) {
  auto pg = testing::WorkerGroup();
  auto state = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = 100});
  testing::TwoWrappers wrappers(pg, pg, hooks::PostLocalSgdHook(state), hooks::PostLocalSgdHook(state));
  wrappers.BackwardFirst();
  testing::ExpectRefused(
      pg->rank(), [&] { wrappers.BackwardSecond(); },
      "a second wrapper on the same group shared the state",
      {"PostLocalSgdState already serves another wrapper on this process group"});
  WORKER_EXPECT(state->iteration() == 1, "iterations counted: " + std::to_string(state->iteration()));
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, APostLocalSgdStateServingOneWrapperRefusesASecondWrapperOnTheSameGroup) {
  auto run = RunWorkers("post_local_sgd_state_on_two_wrappers_of_one_group", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A run resumed past start_iteration: the hook's state, loaded from the
// saved iteration count, goes local from its first call. Seen from outside:
// after one step the replicas differ (each rank stepped on its own
// gradient), where a hook counting from 0 again all-reduces and keeps them
// identical. The fresh hook is run too, so that the observation is shown to
// tell the two paths apart.
DDP_TEST_WORKER(post_local_sgd_resumed) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank(), world = pg->size();
  constexpr int64_t kStart = 3;
  PostLocalSgdState::NamedTensors saved;
  {
    auto model = Mlp(5);
    DistributedDataParallel ddp(model, {.process_group = pg});
    auto state = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = kStart});
    ddp.RegisterCommHook(hooks::PostLocalSgdHook(state));
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    for (int64_t step = 0; step < kStart; ++step) {
      Step(ddp, opt, step, rank, world);
      WORKER_EXPECT(Identical(*pg, *model), "warm-up step " + std::to_string(step) + ": replicas differ");
    }
    WORKER_EXPECT(state->iteration() == kStart, "counted " + std::to_string(state->iteration()) + " iterations");
    saved = state->StateDict();
  }
  for (const bool resumed : {true, false}) {
    auto model = Mlp(5);  // DDP broadcasts rank 0's values: the same start everywhere
    DistributedDataParallel ddp(model, {.process_group = pg});
    auto state = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = kStart});
    if (resumed) state->LoadStateDict(saved);
    ddp.RegisterCommHook(hooks::PostLocalSgdHook(state));
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    Step(ddp, opt, kStart, rank, world);
    const std::string which = resumed ? "resumed hook" : "fresh hook";
    WORKER_EXPECT(Identical(*pg, *model) != resumed,
                  which + ": replicas " + (resumed ? "agree (the gradients were all-reduced globally)" : "differ"));
    const int64_t expected = resumed ? kStart + 1 : 1;
    WORKER_EXPECT(state->iteration() == expected,
                  which + " counted " + std::to_string(state->iteration()) + ", expected " + std::to_string(expected));
  }
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, PostLocalSgdResumedPastItsStartStepsLocallyFromItsFirstCall) {
  auto run = RunWorkers("post_local_sgd_resumed", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ----------------------------------------------------- f16 past 65504 ----

// Every rank holds 40000 in f16: the mean is 40000, though the sum of two
// is past f16's largest value (an average by sum-then-divide gave inf).
DDP_TEST_WORKER(f16_sums_past_f16_range) {
  auto pg = testing::WorkerGroup();
  constexpr double kValue = 40000;
  const nn::TensorOptions f16{.dtype = nn::DType::kFloat16};
  // One small tensor and one of 512 KiB (both through a flat buffer: f16
  // is not averaged in place).
  const Tensor small = nn::Full({5}, kValue, f16), large = nn::Full({1 << 18}, kValue, f16);
  AverageParameters({small, large}, *pg);
  for (const Tensor& t : {small, large}) {
    const std::vector<double> v = t.ToVector<double>();
    size_t wrong = 0;
    for (double x : v) wrong += x != kValue;
    WORKER_EXPECT(wrong == 0, "AverageParameters: " + std::to_string(wrong) + " of " +
                                  std::to_string(v.size()) + " elements are not 40000, e.g. " +
                                  std::to_string(v.front()));
  }
  // The post-local-SGD hook in its warm-up (DDP's average) and with a
  // subgroup: the gradient of w in sum(w * x) is x, 40000 on every rank.
  for (const bool warm_up : {true, false}) {
    auto model = std::make_shared<nn::modules::Linear>(1, 1, /*bias=*/false);
    model->To(nn::DType::kFloat16);
    DistributedDataParallel ddp(model, {.process_group = pg});
    PostLocalSgdOptions options{.start_iteration = warm_up ? 10 : 0};
    if (!warm_up) options.subgroup = pg;
    ddp.RegisterCommHook(hooks::PostLocalSgdHook(options));
    nn::Backward(nn::ops::Sum(ddp(nn::Full({1, 1}, kValue, f16))));
    const double grad = model->weight().grad().ToVector<double>()[0];
    WORKER_EXPECT(grad == kValue, std::string(warm_up ? "warm-up" : "subgroup") +
                                      ": the averaged gradient is " + std::to_string(grad));
  }
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, F16ValuesWhoseSumPassesF16sRangeAverageToThemselves) {
  auto run = RunWorkers("f16_sums_past_f16_range", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------------- subgroups ----

DDP_TEST_WORKER(subgroups) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank(), world = pg->size();
  // Ranks {0, 1} and {2, 3}; each rank gets its own pair.
  std::shared_ptr<ProcessGroup> low = pg->NewGroup({0, 1}), high = pg->NewGroup({2, 3});
  std::shared_ptr<ProcessGroup> pair = rank < 2 ? low : high;
  WORKER_EXPECT(pair && pair->size() == 2, "no pair group");
  auto model = Mlp(6);
  DistributedDataParallel ddp(model, {.process_group = pg});
  ddp.RegisterCommHook(hooks::PostLocalSgdHook({.subgroup = pair}));
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  // What each pair computes: DDP over the pair alone, on the same batches.
  auto reference = Mlp(6);
  DistributedDataParallel ref_ddp(reference, {.process_group = pair});
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  for (int64_t step = 0; step < 3; ++step) {
    Step(ddp, opt, step, rank, world);
    Step(ref_ddp, ref_opt, step, rank, world);
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off the pair's DDP by " + std::to_string(diff));
  const std::vector<std::string> hashes = pg->AllGatherObject(std::to_string(testing::HashState(*model)));
  WORKER_EXPECT(hashes[0] == hashes[1], "ranks 0 and 1 differ");
  WORKER_EXPECT(hashes[2] == hashes[3], "ranks 2 and 3 differ");
  WORKER_EXPECT(hashes[0] != hashes[2], "the pairs agree: gradients crossed the subgroups");
  AverageParameters(model->Parameters(), *pg);
  WORKER_EXPECT(Identical(*pg, *model), "replicas differ after AverageParameters");
  // One host: its group holds every rank.
  std::shared_ptr<ProcessGroup> host = NewSubgroupsByHost(*pg);
  WORKER_EXPECT(host && host->size() == world && host->rank() == rank, "host group of the wrong shape");
  try {
    AverageParameters({nn::Zeros({3}, {.dtype = nn::DType::kInt64})}, *pg);
    WORKER_EXPECT(false, "an integer tensor was averaged");
  } catch (const std::invalid_argument& e) {
    // Every rank passed it: named on the first.
    WORKER_EXPECT(std::string(e.what()).find("tensor 0 on rank 0 has dtype i64") != std::string::npos, e.what());
  }
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, SubgroupsAverageGradientsWithinThemselves) {
  auto run = RunWorkers("subgroups", 4);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Every rank builds its averager from the same NewGroup({0, 1}) call; on
// ranks 2 and 3 that group is null. Taken for "no group given", it became
// the default group (here the world): ranks 2 and 3 all-reduced over the
// world while 0 and 1 averaged over their pair, and the world's next
// collective met theirs (a desync, or a timeout). Now a non-member averages
// nothing, as PyTorch's, and the world stays in step; an averager given no
// group still uses the default one.
DDP_TEST_WORKER(outside_the_subgroup) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  const std::string on = " on rank " + std::to_string(rank);
  SetDefaultProcessGroup(pg);
  std::shared_ptr<ProcessGroup> low = pg->NewGroup({0, 1});
  WORKER_EXPECT((low != nullptr) == (rank < 2), "NewGroup({0, 1}) gave the wrong membership" + on);
  // Rank r holds r + 1 and 10 (r + 1).
  std::vector<Tensor> params = {nn::Full({3}, rank + 1.0), nn::Full({5}, 10.0 * (rank + 1))};
  for (const Tensor& p : params) p.set_grad(nn::Zeros(p.shape()));
  auto expect_values = [&](double first, double second, const std::string& when) {
    for (size_t i = 0; i < params.size(); ++i) {
      const double want = i == 0 ? first : second;
      for (double v : params[i].ToVector<double>()) {
        WORKER_EXPECT(v == want, when + ": tensor " + std::to_string(i) + " holds " + std::to_string(v) +
                                     ", expected " + std::to_string(want) + on);
      }
    }
  };
  PeriodicModelAverager pair({.period = 1, .process_group = low});
  for (int step = 0; step < 2; ++step) {
    const bool averaged = pair.AverageParameters(params);
    WORKER_EXPECT(averaged == (rank < 2), "step " + std::to_string(step) + ": averaged " +
                                              std::to_string(averaged) + on);
  }
  WORKER_EXPECT(pair.step() == 2, "counted " + std::to_string(pair.step()) + " steps" + on);
  if (rank < 2) {
    expect_values(1.5, 15, "after the pair's average");
  } else {
    expect_values(rank + 1.0, 10.0 * (rank + 1), "outside the pair");
  }
  // The world's collectives still pair up: an average over the default
  // group (no group given) of 1.5, 1.5, 3, 4 and of 15, 15, 30, 40.
  PeriodicModelAverager everyone({.period = 1});
  WORKER_EXPECT(everyone.AverageParameters(params), "the default group's average did not run" + on);
  expect_values(2.5, 25, "after the world's average");
  SetDefaultProcessGroup(nullptr);
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, AnAveragerOutsideItsSubgroupAveragesNothingAndKeepsTheWorldInStep) {
  auto run = RunWorkers("outside_the_subgroup", 4);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A subgroup and a warm-up together, as PyTorch's PostLocalSGDState with
// start_localSGD_iter > 0: before the start the hook all-reduces over the
// DDP group (the parent, all four ranks), bit for bit DDP's average; from
// the start on over the pair alone. A hook that used the pair during the
// warm-up leaves the pairs apart at step 0; one that kept the parent
// after it leaves all four together.
DDP_TEST_WORKER(subgroup_after_warmup) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank(), world = pg->size();
  constexpr int64_t kStart = 2, kSteps = 5;
  std::shared_ptr<ProcessGroup> low = pg->NewGroup({0, 1}), high = pg->NewGroup({2, 3});
  std::shared_ptr<ProcessGroup> pair = rank < 2 ? low : high;
  WORKER_EXPECT(pair && pair->size() == 2, "no pair group");
  auto model = Mlp(9), reference = Mlp(9);
  DistributedDataParallel ddp(model, {.process_group = pg});
  DistributedDataParallel ref_ddp(reference, {.process_group = pg});
  auto state = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = kStart, .subgroup = pair});
  ddp.RegisterCommHook(hooks::PostLocalSgdHook(state));
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  for (int64_t step = 0; step < kSteps; ++step) {
    const std::string at = "step " + std::to_string(step) + ": ";
    Step(ddp, opt, step, rank, world);
    const std::vector<std::string> hashes = pg->AllGatherObject(std::to_string(testing::HashState(*model)));
    WORKER_EXPECT(hashes[0] == hashes[1] && hashes[2] == hashes[3], at + "a pair's replicas differ");
    if (step < kStart) {
      Step(ref_ddp, ref_opt, step, rank, world);
      const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
      WORKER_EXPECT(diff == 0, at + "warm-up `" + worst + "` off DDP over the whole group by " + std::to_string(diff));
      WORKER_EXPECT(hashes[0] == hashes[2], at + "the pairs differ during the warm-up (averaged within the pair?)");
    } else {
      WORKER_EXPECT(hashes[0] != hashes[2], at + "the pairs agree after the start (still the whole group?)");
    }
  }
  WORKER_EXPECT(state->iteration() == kSteps, "counted " + std::to_string(state->iteration()) + " iterations");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, PostLocalSgdWarmsUpOverTheWholeGroupThenAveragesWithinTheSubgroup) {
  auto run = RunWorkers("subgroup_after_warmup", 4);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A periodic average skips parameters without a gradient (frozen ones),
// as PyTorch's.
DDP_TEST_WORKER(frozen) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank(), world = pg->size();
  auto model = Mlp(8);
  const auto params = model->NamedParameters();
  Tensor frozen = params.at(1).second;
  frozen.set_requires_grad(false);
  DistributedDataParallel ddp(model, {.process_group = pg});
  {
    // After DDP's broadcast from rank 0: different on every rank on purpose.
    nn::NoGradGuard no_grad;
    frozen.Fill(static_cast<double>(rank));
  }
  ddp.RegisterCommHook(hooks::NoopHook());
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  PeriodicModelAverager averager({.period = 1, .process_group = pg});
  Step(ddp, opt, 0, rank, world);
  WORKER_EXPECT(averager.AverageParameters(model->Parameters()), "not averaged");
  WORKER_EXPECT(frozen.ToVector<double>()[0] == static_cast<double>(rank), "a frozen parameter was averaged");
  // The trained ones agree: compare every value of the first weight.
  std::string values;
  for (double v : model->NamedParameters().at(0).second.ToVector<double>()) values += std::to_string(v) + ",";
  const std::vector<std::string> all = pg->AllGatherObject(values);
  WORKER_EXPECT(all[0] == all[1], "the trained weight differs after averaging");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, PeriodicAveragesSkipFrozenParameters) {
  auto run = RunWorkers("frozen", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Gradients on some ranks only: a parameter of a branch that rank 0 alone
// took, gradients set to none on the others. Deciding by its own
// gradients, rank 0 averaged four tensors and rank 1 two, and their
// all-reduces did not pair (an error or a timeout). Now every rank averages
// each tensor that has a gradient on any rank; one without a gradient
// anywhere keeps its value.
DDP_TEST_WORKER(gradient_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank(), world = pg->size();
  // Small ones go through the flat buffer; `large` (512 KiB) is averaged in
  // place.
  const std::vector<std::string> names = {"shared", "branch", "large", "other", "unused"};
  const std::vector<int64_t> sizes = {3, 4, 1 << 17, 2, 3};
  std::vector<Tensor> params;
  for (size_t i = 0; i < names.size(); ++i) {
    // Rank r holds (r + 1) (i + 1): the mean is (world + 1) / 2 (i + 1).
    params.push_back(nn::Full({sizes[i]}, (rank + 1.0) * (i + 1.0)));
    const bool has_grad = names[i] == "shared" || names[i] == "other" || (rank == 0 && names[i] != "unused");
    if (has_grad) params.back().set_grad(nn::Zeros({sizes[i]}));
  }
  PeriodicModelAverager averager({.period = 1, .process_group = pg});
  WORKER_EXPECT(averager.AverageParameters(params), "not averaged");
  for (size_t i = 0; i < names.size(); ++i) {
    const double expected = names[i] == "unused" ? (rank + 1.0) * (i + 1.0) : (world + 1) / 2.0 * (i + 1.0);
    size_t wrong = 0;
    const std::vector<double> v = params[i].ToVector<double>();
    for (double x : v) wrong += x != expected;
    WORKER_EXPECT(wrong == 0, "`" + names[i] + "`: " + std::to_string(wrong) + " of " + std::to_string(v.size()) +
                                  " elements are not " + std::to_string(expected) + " (first " +
                                  std::to_string(v[0]) + ")");
  }
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, PeriodicAveragesParametersWithAGradientOnSomeRanksOnly) {
  auto run = RunWorkers("gradient_on_one_rank", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(ModelAveragingTest, PeriodicAveragesParametersWithAGradientOnSomeRanksOnlyOnThreeRanks) {
  auto run = RunWorkers("gradient_on_one_rank", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// One call with every floating dtype, interleaved, small (through a flat
// buffer per dtype) and of 256 KiB or more (f32, f64 and bf16 in place;
// f16 always flat), and a transposed view: each comes back as its own
// mean, in its own dtype, whatever the others around it are.
DDP_TEST_WORKER(mixed_dtypes) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank(), world = pg->size();
  const std::vector<nn::DType> dtypes = {nn::DType::kFloat32, nn::DType::kFloat16, nn::DType::kFloat64,
                                         nn::DType::kBFloat16};
  std::vector<Tensor> params;
  std::vector<std::string> names;
  for (const int64_t numel : {int64_t{7}, int64_t{1} << 18}) {
    for (const nn::DType dtype : dtypes) {
      // Rank r holds (r + 1) (i + 1): the mean is (world + 1) / 2 (i + 1).
      const double value = (rank + 1.0) * (params.size() + 1.0);
      params.push_back(nn::Full({numel}, value, {.dtype = dtype}));
      names.push_back(std::string(nn::DTypeName(dtype)) + " [" + std::to_string(numel) + "]");
    }
  }
  params.push_back(nn::Full({6, 5}, (rank + 1.0) * (params.size() + 1.0)).Transpose(0, 1));
  names.push_back("a transposed f32 [5, 6]");
  AverageParameters(params, *pg);
  for (size_t i = 0; i < params.size(); ++i) {
    const double expected = (world + 1) / 2.0 * (i + 1.0);
    // 16-bit types are divided before the sum (f16) or summed in f32 and
    // rounded once: within a few of their ulps.
    const bool narrow = params[i].element_size() == 2;
    const double tolerance = narrow ? 1e-2 * expected : 0;
    size_t wrong = 0;
    const std::vector<double> v = params[i].ToVector<double>();
    for (double x : v) wrong += std::abs(x - expected) > tolerance;
    WORKER_EXPECT(params[i].dtype() == dtypes[i % 4] || i == params.size() - 1, names[i] + ": dtype changed");
    WORKER_EXPECT(wrong == 0, names[i] + ": " + std::to_string(wrong) + " of " + std::to_string(v.size()) +
                                  " elements are off " + std::to_string(expected) + " (first " +
                                  std::to_string(v[0]) + ")");
  }
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, AverageParametersOfEveryFloatingDtypeInOneCallOnTwoRanks) {
  auto run = RunWorkers("mixed_dtypes", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(ModelAveragingTest, AverageParametersOfEveryFloatingDtypeInOneCallOnThreeRanks) {
  auto run = RunWorkers("mixed_dtypes", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A large f32 tensor of the same shape, contiguous on rank 0 and a
// transposed view on rank 1, followed by a small one: before, rank 0
// averaged the large one in place and the small one through a flat buffer
// while rank 1 packed both into one buffer, the all-reduces did not pair
// and the transport aborted the group, naming neither tensor. Now both
// ranks average each tensor to its mean.
DDP_TEST_WORKER(view_on_one_rank_only) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank(), world = pg->size();
  // [512, 256] f32 (512 KiB): rank r holds r + 1 everywhere.
  const Tensor large = rank % 2 == 0 ? nn::Full({512, 256}, rank + 1.0)
                                     : nn::Full({256, 512}, rank + 1.0).Transpose(0, 1);
  const Tensor small = nn::Full({3}, 10.0 * (rank + 1));
  AverageParameters({large, small}, *pg);
  const double mean = (world + 1) / 2.0;
  size_t wrong = 0;
  for (double x : large.ToVector<double>()) wrong += x != mean;
  WORKER_EXPECT(wrong == 0, "the large tensor: " + std::to_string(wrong) + " elements are not " +
                                std::to_string(mean));
  WORKER_EXPECT(small.ToVector<double>() == std::vector<double>(3, 10.0 * mean), "the small tensor is off");
  WORKER_EXPECT(large.is_contiguous() == (rank % 2 == 0), "the large tensor was replaced, not written");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, ALargeTensorThatIsAViewOnOneRankOnlyIsAveraged) {
  auto run = RunWorkers("view_on_one_rank_only", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(ModelAveragingTest, ALargeTensorThatIsAViewOnSomeRanksOnlyIsAveragedOnThreeRanks) {
  auto run = RunWorkers("view_on_one_rank_only", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A tensor undefined on rank 1 while rank 0 has its gradient: before, rank
// 1 alone threw (AverageParameters refuses undefined tensors) and rank 0
// waited in its average until the group's timeout. Now both throw at once,
// naming the tensor, and count no step.
DDP_TEST_WORKER(undefined_on_one_rank) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int rank = pg->rank();
  std::vector<Tensor> params = {nn::Full({3}, 1.0), rank == 1 ? Tensor() : nn::Full({2}, 2.0)};
  for (const Tensor& p : params) {
    if (p.defined()) p.set_grad(nn::Zeros(p.shape()));
  }
  PeriodicModelAverager averager({.period = 1, .process_group = pg});
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    averager.AverageParameters(params);
  } catch (const std::invalid_argument& e) {
    error = e.what();
  }
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout");
  const std::string where = rank == 1 ? "rank 1" : "another rank";
  WORKER_EXPECT(error == "PeriodicModelAverager: tensor 1 has a gradient on some rank but is undefined on " +
                             where + "; every rank must pass the same tensors",
                "error: '" + error + "'");
  // The failed average left the step uncounted (it counted it): the same
  // step called again, with the same tensors on every rank, averages.
  WORKER_EXPECT(averager.step() == 0, "step " + std::to_string(averager.step()) + " after a failed average");
  const Tensor t = nn::Full({3}, static_cast<double>(rank));
  t.set_grad(nn::Zeros(t.shape()));
  WORKER_EXPECT(averager.AverageParameters({t}), "the retried step did not average");
  WORKER_EXPECT(t.ToVector<double>() == std::vector<double>(3, 0.5), "the retried average is off");
  WORKER_EXPECT(averager.step() == 1, "step " + std::to_string(averager.step()) + " after the retry");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, ATensorUndefinedOnOneRankFailsEveryRankAtOnce) {
  auto run = RunWorkers("undefined_on_one_rank", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Lists of different lengths: rank 1 passes one tensor more, then none.
// Before, the first made the per-tensor flags' all-reduce differ in size
// (the transport aborted the group, naming neither list), and in the second
// rank 1 returned at once while rank 0 waited in that all-reduce until the
// group's timeout. Both now fail every rank at once, naming both counts,
// count no step, and leave the group usable.
DDP_TEST_WORKER(averager_list_lengths_differ) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int rank = pg->rank();
  const auto with_grad = [](double value) {
    const Tensor t = nn::Full({3}, value);
    t.set_grad(nn::Zeros(t.shape()));
    return t;
  };
  const Tensor a = with_grad(rank), b = with_grad(2.0 * rank);
  PeriodicModelAverager averager({.period = 1, .process_group = pg});
  const std::vector<std::pair<std::vector<Tensor>, std::string>> cases = {
      {rank == 1 ? std::vector<Tensor>{a, b, with_grad(1.0)} : std::vector<Tensor>{a, b}, "3"},
      {rank == 1 ? std::vector<Tensor>{} : std::vector<Tensor>{a, b}, "0"}};
  for (const auto& [params, named] : cases) {
    const auto start = std::chrono::steady_clock::now();
    std::string error = "(nothing thrown)";
    try {
      averager.AverageParameters(params);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
    WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout");
    WORKER_EXPECT(error == "PeriodicModelAverager: rank 0 passes 2 tensors and rank 1 passes " + named +
                               "; every rank must pass the same tensors",
                  "error: " + error);
  }
  WORKER_EXPECT(averager.step() == 0, "step " + std::to_string(averager.step()) + " after failed averages");
  WORKER_EXPECT(averager.AverageParameters({a, b}), "the retried step did not average");
  WORKER_EXPECT(a.ToVector<double>() == std::vector<double>(3, 0.5), "the retried average is off");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, PeriodicAveragerGivenListsOfDifferentLengthsFailsEveryRankNamingThem) {
  auto run = RunWorkers("averager_list_lengths_differ", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// AverageParameters called directly with a tensor that cannot be averaged
// on rank 1 only (undefined, then an integer one): before, rank 1 threw
// before any collective and rank 0 waited in its average until the group's
// timeout. Now every rank throws at once, naming the tensor and the rank,
// and the group stays usable.
DDP_TEST_WORKER(average_parameters_bad_on_one_rank) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int rank = pg->rank();
  const std::vector<std::pair<Tensor, std::string>> cases = {
      {Tensor(), "AverageParameters: tensor 1 on rank 1 is undefined"},
      {nn::Full({2}, 2.0, {.dtype = nn::DType::kInt64}),
       "AverageParameters: tensor 1 on rank 1 has dtype i64; only floating tensors can be averaged"}};
  for (const auto& [bad, want] : cases) {
    const std::vector<Tensor> params = {nn::Full({3}, 1.0), rank == 1 ? bad : nn::Full({2}, 2.0)};
    const auto start = std::chrono::steady_clock::now();
    std::string error;
    try {
      AverageParameters(params, *pg);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = std::string("not invalid_argument: ") + e.what();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    WORKER_EXPECT(seconds < 5, "failed after " + std::to_string(seconds) + " s");
    WORKER_EXPECT(error == want, "error: '" + error + "'");
    WORKER_EXPECT(params[0].ToVector<double>() == std::vector<double>(3, 1.0), "tensor 0 changed");
  }
  // Nothing was left half-done: the next average pairs up.
  const Tensor t = nn::Full({3}, static_cast<double>(rank));
  AverageParameters({t}, *pg);
  WORKER_EXPECT(t.ToVector<double>() == std::vector<double>(3, 0.5), "the next average is off");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, AverageParametersWithABadTensorOnOneRankFailsEveryRankAtOnce) {
  auto run = RunWorkers("average_parameters_bad_on_one_rank", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// AverageParameters with tensors of different shapes or dtypes on two
// ranks: the ranks' collectives would not pair.
DDP_TEST_WORKER(average_parameters_shapes_differ) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int rank = pg->rank();
  const std::vector<std::pair<Tensor, std::string>> cases = {
      {nn::Full({4}, 2.0), "tensor 1 is f32 [4] on rank 1 and f32 [2] on rank 0"},
      {nn::Full({2}, 2.0, {.dtype = nn::DType::kFloat64}), "tensor 1 is f64 [2] on rank 1 and f32 [2] on rank 0"}};
  for (const auto& [odd, want] : cases) {
    const std::vector<Tensor> params = {nn::Full({3}, 1.0), rank == 1 ? odd : nn::Full({2}, 2.0)};
    const auto start = std::chrono::steady_clock::now();
    std::string error;
    try {
      AverageParameters(params, *pg);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = std::string("not invalid_argument: ") + e.what();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    WORKER_EXPECT(seconds < 5, "failed after " + std::to_string(seconds) + " s");
    WORKER_EXPECT(error.find(want) != std::string::npos, "error: '" + error + "'");
    WORKER_EXPECT(params[0].ToVector<double>() == std::vector<double>(3, 1.0), "tensor 0 changed");
  }
  // Nothing was left half-done: the next average pairs up.
  const Tensor t = nn::Full({3}, static_cast<double>(rank));
  AverageParameters({t}, *pg);
  WORKER_EXPECT(t.ToVector<double>() == std::vector<double>(3, 0.5), "the next average is off");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, AverageParametersWithShapesOrDtypesDifferingBetweenRanksFailsNamingTheTensor) {
  auto run = RunWorkers("average_parameters_shapes_differ", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Tensors that share memory. The same tensor passed twice (or an equal view
// of it) is averaged once and comes out as the average (an average taken
// twice is still the average, so this part held before too; the repeat
// cost traffic, and a large tensor averaged in place while a small view of
// it was copied into the flat buffer raced with that copy). Views that
// overlap in part are refused on every rank, naming both, before any
// average (they were accepted).
DDP_TEST_WORKER(average_parameters_shared_memory) {
  auto pg = testing::WorkerGroup();
  const double rank = pg->rank();
  // Repeats: a small tensor (through the flat copy), a large one (1 MiB of
  // f32, in place) and a view equal to the small one.
  const Tensor small = nn::Full({6}, rank), large = nn::Full({1 << 18}, rank), other = nn::Full({4}, 10 + rank);
  AverageParameters({small, large, small, other, small.View({2, 3}).View({6}), large}, *pg);
  WORKER_EXPECT(small.ToVector<double>() == std::vector<double>(6, 0.5), "the repeated small tensor is off");
  const std::vector<double> big = large.ToVector<double>();
  WORKER_EXPECT(std::all_of(big.begin(), big.end(), [](double v) { return v == 0.5; }),
                "the repeated large tensor is off: " + std::to_string(big[0]));
  WORKER_EXPECT(other.ToVector<double>() == std::vector<double>(4, 10.5), "the other tensor is off");

  // Partial overlap, on rank 1 only: every rank fails at once.
  const Tensor base = nn::Full({8}, rank);
  const std::vector<Tensor> params = {nn::Full({3}, 1.0), base.Narrow(0, 0, 5),
                                      rank == 1 ? base.Narrow(0, 3, 5) : nn::Full({5}, 1.0)};
  std::string error;
  try {
    AverageParameters(params, *pg);
  } catch (const std::invalid_argument& e) {
    error = e.what();
  }
  WORKER_EXPECT(error.find("AverageParameters: tensor 2 on rank 1 overlaps tensor 1 in memory") == 0,
                "error: '" + error + "'");
  WORKER_EXPECT(base.ToVector<double>() == std::vector<double>(8, rank), "the refused average changed a tensor");

  // A large tensor tied on rank 0 ({w, w}) and two separate ones on rank 1
  // ({w, w2}): rank 0 would run one in-place average where rank 1 runs
  // two. Refused on every rank before any average.
  const Tensor w = nn::Full({1 << 18}, rank), w2 = nn::Full({1 << 18}, rank);
  error.clear();
  try {
    AverageParameters({w, rank == 0 ? w : w2}, *pg);
  } catch (const std::invalid_argument& e) {
    error = e.what();
  }
  WORKER_EXPECT(error.find("rank 0 and rank 1 differ in which tensors are passed twice") != std::string::npos,
                "error: '" + error + "'");
  WORKER_EXPECT(w.ToVector<double>()[0] == rank, "the refused average changed a tensor");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, AverageParametersAveragesARepeatedTensorOnceAndRefusesPartialOverlaps) {
  auto run = RunWorkers("average_parameters_shared_memory", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// f16 is divided by the group's size before its sum. When the all-reduce
// fails, the parameters keep their values: before, a large f16 tensor,
// divided in place, was left halved, and a caller that caught the error and
// saved a checkpoint saved that. The ranks pass the same tensors; rank 1
// aborts its group once the ranks have agreed on them, just before its
// first average (SetAverageFaultForTesting): every average fails then, on
// both ranks. (Aborting from another thread once the first average had
// started raced the averages, which could finish first.)
DDP_TEST_WORKER(f16_kept_when_the_average_fails) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  const nn::TensorOptions f16{.dtype = nn::DType::kFloat16};
  // 512 KiB (in place, were f16 averaged in place) and a small one (a flat
  // buffer); before them an f32 one of 32 MiB.
  const Tensor f32 = nn::Full({4096, 2048}, 1.0);
  const Tensor large = nn::Full({512, 512}, 3.0, f16), small = nn::Full({5}, 3.0, f16);
  bool failed = false;
  const auto average = [&] {
    try {
      AverageParameters({f32, large, small}, *pg);
    } catch (const DistributedError&) {
      failed = true;
    }
  };
  if (rank == 1) {
    SetAverageFaultForTesting(
        [&] { pg->Abort(transport::FailedPreconditionError("rank 1 stops mid-average (test)")); });
  }
  average();
  SetAverageFaultForTesting(nullptr);
  WORKER_EXPECT(failed, "the average did not fail (test premise)");
  for (const Tensor& t : {large, small}) {
    const std::vector<double> v = t.ToVector<double>();
    size_t wrong = 0;
    for (double x : v) wrong += x != 3.0;
    WORKER_EXPECT(wrong == 0, std::to_string(wrong) + " of " + std::to_string(v.size()) +
                                  " elements changed, e.g. to " + std::to_string(v.front()));
  }
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, F16ParametersKeepTheirValuesWhenTheAverageFails) {
  auto run = RunWorkers("f16_kept_when_the_average_fails", 2, {{"DDP_TEST_TIMEOUT_MS", "5000"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A due step of PeriodicModelAverager, every tensor with a gradient (the
// usual case), costs one round more than AverageParameters on the same
// tensors: the one that checks the ranks' counts. The count's check was a
// round of its own, before the one of the flags of which tensors have a
// gradient; both now ride one message, and the flags' round is left out
// when every tensor has a gradient on every rank.
DDP_TEST_WORKER(averager_step_rounds) {
  auto pg = testing::WorkerGroup();
  nn::Generator gen(3);
  auto layer = std::make_shared<nn::modules::Linear>(4, 3, true, gen);
  for (const Tensor& p : layer->Parameters()) p.set_grad(nn::Full(p.shape(), 1.0));
  const uint64_t before_plain = pg->collectives_run();
  AverageParameters(layer->Parameters(), *pg);
  const uint64_t plain = pg->collectives_run() - before_plain;
  PeriodicModelAverager averager({.period = 1, .process_group = pg});
  const uint64_t before_step = pg->collectives_run();
  WORKER_EXPECT(averager.AverageParameters(layer->Parameters()), "not averaged");
  const uint64_t step = pg->collectives_run() - before_step;
  WORKER_EXPECT(step == plain + 1, "a due step ran " + std::to_string(step) + " collectives, AverageParameters " +
                                       std::to_string(plain) + ": expected one more");
  const uint64_t before_empty = pg->collectives_run();
  WORKER_EXPECT(averager.AverageParameters({}), "an empty list: not counted as averaged");
  const uint64_t empty = pg->collectives_run() - before_empty;
  WORKER_EXPECT(empty == 1, "an empty list ran " + std::to_string(empty) + " collectives, expected 1");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, AveragerStepCostsOneRoundMoreThanAverageParameters) {
  auto run = RunWorkers("averager_step_rounds", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A bf16 model whose weight is averaged in place (131072 elements: 256
// KiB, AverageParameters's in-place size) and whose bias goes through the
// flat buffer. The optimizer keeps f32 masters of both; after an average
// its next step must start from the averaged values, not write its own
// pre-averaging masters back (then the replicas would never agree).
DDP_TEST_WORKER(bf16_masters_take_the_average) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank(), world = pg->size();
  nn::Generator gen(1);
  auto layer = std::make_shared<nn::modules::Linear>(256, 512, true, gen);
  layer->To(nn::DType::kBFloat16);
  const auto params = layer->NamedParameters();
  WORKER_EXPECT(layer->weight().nbytes() >= (size_t{256} << 10), "the weight is not averaged in place");
  // Rank r holds r + 1 everywhere; the average (world + 1) / 2 and the
  // step below are exact in bf16 for 2 ranks.
  auto set_grads = [&](double g) {
    for (const auto& [name, p] : params) p.set_grad(nn::Full(p.shape(), g, {.dtype = nn::DType::kBFloat16}));
  };
  {
    nn::NoGradGuard no_grad;
    for (const auto& [name, p] : params) p.Fill(rank + 1.0);
  }
  nn::optim::Sgd opt(params, {.lr = 0.5});
  PeriodicModelAverager averager({.period = 1, .process_group = pg});
  set_grads(0);
  opt.Step();  // makes the masters: rank + 1
  WORKER_EXPECT(averager.AverageParameters(layer->Parameters()), "not averaged");
  const double average = (world + 1) / 2.0;
  for (const auto& [name, p] : params) {
    WORKER_EXPECT(p.ToVector<double>()[0] == average, "`" + name + "` is " + std::to_string(p.ToVector<double>()[0]) +
                                                          " after averaging, expected " + std::to_string(average));
  }
  set_grads(1);
  opt.Step();
  for (const auto& [name, p] : params) {
    const std::vector<double> v = p.ToVector<double>();
    size_t wrong = 0;
    for (double x : v) wrong += x != average - 0.5;
    WORKER_EXPECT(wrong == 0, "rank " + std::to_string(rank) + ": " + std::to_string(wrong) + " elements of `" + name +
                                  "` are not " + std::to_string(average - 0.5) + " after the step (first " +
                                  std::to_string(v[0]) + "): the step started from the pre-averaging master");
  }
  WORKER_EXPECT(Identical(*pg, *layer), "replicas differ after averaging and a step");
  return testing::WorkerExit();
}

TEST(ModelAveragingTest, SixteenBitMastersTakeTheAverageOfLargeWeights) {
  auto run = RunWorkers("bf16_masters_take_the_average", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ---------------------------------------------------- bad options ----

TEST(ModelAveragingTest, OptionsOutOfRangeAreRefusedNamingTheOption) {
  auto refused = [](auto make, const std::string& what) {
    try {
      make();
      ADD_FAILURE() << what << ": accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused([] { PeriodicModelAverager({.period = 0}); }, "ModelAveragerOptions::period must be at least 1, got 0");
  refused([] { PeriodicModelAverager({.warmup_steps = -1}); },
          "ModelAveragerOptions::warmup_steps must be at least 0, got -1");
  refused([] { hooks::PostLocalSgdHook({.start_iteration = -2}); },
          "PostLocalSgdOptions::start_iteration must be at least 0, got -2");
  refused([] { PostLocalSgdState({.start_iteration = -1}); },
          "PostLocalSgdOptions::start_iteration must be at least 0, got -1");
  refused([] { hooks::PostLocalSgdHook(std::shared_ptr<PostLocalSgdState>()); },
          "hooks::PostLocalSgdHook: the state is null");
  // No group given and none by default.
  EXPECT_THROW(PeriodicModelAverager({}), std::logic_error);
}

// ---------------------------------------------------- state dict ----

// Saved after four steps and loaded into a new averager (a resumed run),
// the step count goes on: the averages fall on the same steps as in the
// averager that was never interrupted.
TEST(ModelAveragingTest, AveragerStepCountSurvivesAStateDictRoundTrip) {
  auto pg = ProcessGroup::Single();
  const ModelAveragerOptions options{.period = 3, .warmup_steps = 2, .process_group = pg};
  PeriodicModelAverager original(options);
  std::vector<bool> due;
  for (int k = 0; k < 4; ++k) due.push_back(original.AverageParameters({}));
  EXPECT_EQ(due, (std::vector<bool>{false, false, true, false}));
  const PeriodicModelAverager::NamedTensors saved = original.StateDict();
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_EQ(saved[0].first, "averager.step");
  EXPECT_EQ(saved[0].second.ToVector<int64_t>(), std::vector<int64_t>{4});

  PeriodicModelAverager resumed(options);
  resumed.LoadStateDict(saved);
  EXPECT_EQ(resumed.step(), 4);
  for (int k = 4; k < 9; ++k) {
    // Due at steps 5 and 8.
    EXPECT_EQ(resumed.AverageParameters({}), original.AverageParameters({})) << "step " << k;
  }
  EXPECT_EQ(resumed.step(), 9);
}

TEST(ModelAveragingTest, AveragerLoadRefusesBadStateNamingItAndChangesNothing) {
  auto pg = ProcessGroup::Single();
  PeriodicModelAverager averager({.period = 2, .process_group = pg});
  averager.AverageParameters({});
  const std::vector<std::pair<PeriodicModelAverager::NamedTensors, std::string>> cases = {
      {{}, "missing i64 scalar `averager.step`"},
      {{{"averager.step", nn::FromVector({3.0}, {})}}, "`averager.step` is f32 [], expected an i64 scalar"},
      {{{"averager.step", nn::FromVectorOf<int64_t>({1, 2}, {2})}}, "`averager.step` is i64 [2], expected an i64 scalar"},
      // One element is not enough: a scalar entry is 0-d, as StateDict writes it.
      {{{"averager.step", nn::FromVectorOf<int64_t>({3}, {1})}}, "`averager.step` is i64 [1], expected an i64 scalar"},
      {{{"averager.step", nn::FromVectorOf<int64_t>({3}, {1, 1})}},
       "`averager.step` is i64 [1, 1], expected an i64 scalar"},
      {{{"averager.step", nn::FromVectorOf<int64_t>({-3}, {})}}, "`averager.step` is -3, below 0"},
      {{{"averager.step", nn::FromVectorOf<int64_t>({std::numeric_limits<int64_t>::max()}, {})}},
       "`averager.step` is the largest i64: the next count would overflow"},
      {{{"averager.step", nn::FromVectorOf<int64_t>({3}, {})}, {"averager.period", nn::FromVectorOf<int64_t>({2}, {})}},
       "unexpected `averager.period`"},
  };
  for (const auto& [bad, expected] : cases) {
    try {
      averager.LoadStateDict(bad);
      ADD_FAILURE() << "accepted; expected: " << expected;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    EXPECT_THROW(averager.CheckStateDict(bad), std::invalid_argument) << expected;
    EXPECT_EQ(averager.step(), 1) << expected;
  }
}

// One process: the hook is called here on buckets of a made-up gradient.
// Only calls on the last bucket count as iterations.
void CallHook(CommHook& hook, ProcessGroup& pg, size_t index, size_t count) {
  const Tensor param = nn::Zeros({4});
  GradBucket bucket(index, count, nn::Full({4}, 1.0), {param}, {0});
  hook(pg, bucket).Wait();
}

// Saved after five iterations and loaded into a new state (a resumed run),
// the count goes on from five.
TEST(ModelAveragingTest, PostLocalSgdIterationSurvivesAStateDictRoundTrip) {
  auto pg = ProcessGroup::Single();
  auto state = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = 2});
  CommHook hook = hooks::PostLocalSgdHook(state);
  for (int k = 0; k < 5; ++k) {
    CallHook(hook, *pg, 0, 2);
    CallHook(hook, *pg, 1, 2);
  }
  EXPECT_EQ(state->iteration(), 5);
  const PostLocalSgdState::NamedTensors saved = state->StateDict();
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_EQ(saved[0].first, "post_local_sgd.iteration");
  EXPECT_EQ(saved[0].second.dtype(), nn::DType::kInt64);
  EXPECT_EQ(saved[0].second.ToVector<int64_t>(), std::vector<int64_t>{5});

  auto resumed = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = 2});
  // Among other components' keys, as in a checkpoint's list.
  PostLocalSgdState::NamedTensors mixed = {{"averager.step", nn::FromVectorOf<int64_t>({7}, {})}};
  mixed.insert(mixed.end(), saved.begin(), saved.end());
  resumed->CheckStateDict(mixed);
  resumed->LoadStateDict(mixed);
  EXPECT_EQ(resumed->iteration(), 5);
  CommHook resumed_hook = hooks::PostLocalSgdHook(resumed);
  CallHook(resumed_hook, *pg, 0, 1);
  EXPECT_EQ(resumed->iteration(), 6);
  EXPECT_EQ(resumed->StateDict()[0].second.ToVector<int64_t>(), std::vector<int64_t>{6});
}

TEST(ModelAveragingTest, PostLocalSgdLoadRefusesBadStateNamingItAndChangesNothing) {
  auto pg = ProcessGroup::Single();
  auto state = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = 4});
  CommHook hook = hooks::PostLocalSgdHook(state);
  CallHook(hook, *pg, 0, 1);
  const Tensor two = nn::FromVectorOf<int64_t>({2}, {});
  const std::vector<std::pair<PostLocalSgdState::NamedTensors, std::string>> cases = {
      {{}, "PostLocalSgdState.LoadStateDict: missing i64 scalar `post_local_sgd.iteration`"},
      {{{"averager.step", two}}, "missing i64 scalar `post_local_sgd.iteration`"},
      {{{"post_local_sgd.iteration", nn::FromVector({3.0}, {})}},
       "`post_local_sgd.iteration` is f32 [], expected an i64 scalar"},
      {{{"post_local_sgd.iteration", nn::FromVectorOf<int64_t>({1, 2}, {2})}},
       "`post_local_sgd.iteration` is i64 [2], expected an i64 scalar"},
      {{{"post_local_sgd.iteration", nn::FromVectorOf<int64_t>({3}, {1})}},
       "`post_local_sgd.iteration` is i64 [1], expected an i64 scalar"},
      {{{"post_local_sgd.iteration", nn::FromVectorOf<int64_t>({3}, {1, 1})}},
       "`post_local_sgd.iteration` is i64 [1, 1], expected an i64 scalar"},
      {{{"post_local_sgd.iteration", nn::FromVectorOf<int64_t>({-3}, {})}}, "`post_local_sgd.iteration` is -3, below 0"},
      {{{"post_local_sgd.iteration", nn::FromVectorOf<int64_t>({std::numeric_limits<int64_t>::max()}, {})}},
       "`post_local_sgd.iteration` is the largest i64: the next count would overflow"},
      {{{"post_local_sgd.iteration", two}, {"post_local_sgd.start_iteration", two}},
       "unexpected `post_local_sgd.start_iteration`"},
      {{{"post_local_sgd.iteration", two}, {"post_local_sgd.iteration", two}},
       "`post_local_sgd.iteration` appears twice"},
  };
  for (const auto& [bad, expected] : cases) {
    try {
      state->LoadStateDict(bad);
      ADD_FAILURE() << "accepted; expected: " << expected;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    try {
      state->CheckStateDict(bad);
      ADD_FAILURE() << "CheckStateDict accepted; expected: " << expected;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    EXPECT_EQ(state->iteration(), 1) << expected;
  }
}

}  // namespace
}  // namespace ddp::dist
