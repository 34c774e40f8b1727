// The PowerSGD hook. Over real processes: full rank reproduces the plain
// average and low rank gives rank-r gradients (2 and 3 ranks); before
// start_iteration it is the default all-reduce bit for bit; low-rank
// training on Fashion-MNIST keeps up with uncompressed training and keeps
// the replicas identical; a gradient with an inf on one rank once reaches
// .grad on every rank and leaves the later iterations finite and identical;
// a peer late to the P all-reduce by most of the timeout leaves the Q
// all-reduce its own time. In one process: error feedback on a fixed gradient, a gradient (or a
// column of Q) that was zero once comes back, Q and residuals follow
// parameters that trade places in a bucket, a state that no longer fits
// its parameter or whose parameter was freed starts over, a subnormal gradient is
// compressed, an uncompressed (f16) bucket is noted once per hook, the
// traffic formula, option checks.

#include <cblas.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "ddp/distributed_data_parallel.h"
#include "ddp/powersgd_hook.h"
#include "ddp/testing/ddp_test_util.h"
#include "nn/autograd/engine.h"
#include "nn/loss/loss.h"
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

// Largest distance of a row of g [n, m] from the line of its longest row,
// relative to that row's length: 0 for a rank-1 matrix.
double RankOneError(const Tensor& g) {
  const int64_t n = g.size(0), m = g.numel() / n;
  const std::vector<double> v = g.ToVector<double>();
  int64_t longest = 0;
  double longest_sq = -1;
  for (int64_t i = 0; i < n; ++i) {
    double sq = 0;
    for (int64_t j = 0; j < m; ++j) sq += v[i * m + j] * v[i * m + j];
    if (sq > longest_sq) longest_sq = sq, longest = i;
  }
  if (longest_sq <= 0) return 0;
  const double* u = v.data() + longest * m;
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double* row = v.data() + i * m;
    double dot = 0;
    for (int64_t j = 0; j < m; ++j) dot += row[j] * u[j];
    double off = 0;
    for (int64_t j = 0; j < m; ++j) off += std::pow(row[j] - dot / longest_sq * u[j], 2);
    worst = std::max(worst, std::sqrt(off / longest_sq));
  }
  return worst;
}

// ------------------------------------------------- one step, all ranks ----

// One backward on this rank's 16 samples with `hook` (none: the default),
// from the same initial MLP on every call.
std::shared_ptr<Module> OneStep(const std::shared_ptr<ProcessGroup>& pg, CommHook hook) {
  const auto& data = testing::FashionMnist();
  auto model = Mlp(5);
  DistributedDataParallel ddp(model, {.process_group = pg});
  if (hook) ddp.RegisterCommHook(std::move(hook));
  auto [x, y] = testing::Batch(data, pg->rank() * 16, 16);
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  return model;
}

DDP_TEST_WORKER(one_step) {
  auto pg = testing::WorkerGroup();
  const auto reference = OneStep(pg, nullptr);

  // Rank >= min(n, m) everywhere: the orthonormal P spans the summed
  // gradient's columns, so P P^T M = M. Would fail without either
  // all-reduce (P or Q from one rank's gradient only).
  const auto full = OneStep(pg, hooks::PowerSgdHook({.matrix_approximation_rank = 1024,
                                                     .start_iteration = 0,
                                                     .min_compression_rate = 0}));
  const auto [diff, worst] = testing::MaxRelativeGradDifference(*full, *reference);
  std::fprintf(stderr, "full rank: max relative difference %.3g (`%s`)\n", diff, worst.c_str());
  WORKER_EXPECT(diff <= 1e-4, "full rank: `" + worst + "` off by " + std::to_string(diff));

  // Rank 1: every weight gradient becomes a rank-1 matrix, far from the
  // average (so a plain all-reduce fails here); biases stay exact.
  const auto low = OneStep(pg, hooks::PowerSgdHook({.matrix_approximation_rank = 1, .start_iteration = 0}));
  const auto low_params = low->NamedParameters(), ref_params = reference->NamedParameters();
  for (size_t i = 0; i < low_params.size(); ++i) {
    const auto& [name, p] = low_params[i];
    const Tensor& ref = ref_params[i].second.grad();
    double off = 0, scale = 0;
    const std::vector<double> a = p.grad().ToVector<double>(), b = ref.ToVector<double>();
    for (size_t k = 0; k < a.size(); ++k) {
      off = std::max(off, std::abs(a[k] - b[k]));
      scale = std::max(scale, std::abs(b[k]));
    }
    std::fprintf(stderr, "rank 1: `%s` relative difference %.3g\n", name.c_str(), off / scale);
    if (p.dim() == 1) {
      WORKER_EXPECT(off <= 1e-5 * scale, "rank 1: bias `" + name + "` off by " + std::to_string(off / scale));
    } else {
      const double err = RankOneError(p.grad());
      WORKER_EXPECT(err <= 1e-4, "rank 1: `" + name + "` is not rank 1 (" + std::to_string(err) + ")");
      WORKER_EXPECT(off >= 1e-2 * scale, "rank 1: `" + name + "` equals the average: not compressed?");
    }
  }
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, FullRankEqualsTheAverageAndRankOneIsRankOneOnTwoRanks) {
  auto run = RunWorkers("one_step", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(PowerSgdHookTest, FullRankEqualsTheAverageAndRankOneIsRankOneOnThreeRanks) {
  auto run = RunWorkers("one_step", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------ before the start ----

// Against a wrapper with no hook at all, whose all-reduce sums and then
// divides (kAvg). On 3 ranks dividing each gradient first and summing
// (what an explicit AllReduceHook does, and what PowerSGD did before its
// start) differs in the last bit; on 2 the division is exact, so only 3
// ranks tell the two apart.
DDP_TEST_WORKER(before_start) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  constexpr int kStart = 3;
  auto model = Mlp(7), reference = Mlp(7);
  DistributedDataParallel ddp(model, {.process_group = pg});
  DistributedDataParallel ref_ddp(reference, {.process_group = pg});
  ddp.RegisterCommHook(hooks::PowerSgdHook({.start_iteration = kStart}));
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  for (int s = 0; s <= kStart; ++s) {
    auto [x, y] = testing::Batch(data, (s * pg->size() + pg->rank()) * 8, 8);
    opt.ZeroGrad();
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    opt.Step();
    ref_opt.ZeroGrad();
    nn::Backward(nn::loss::CrossEntropy(ref_ddp(x), y));
    ref_opt.Step();
    const bool same = testing::HashState(*model) == testing::HashState(*reference);
    // Iterations 0 .. kStart-1 use the default all-reduce; kStart compresses.
    WORKER_EXPECT(same == (s < kStart), "iteration " + std::to_string(s) + ": models " +
                                            (same ? "equal" : "differ") + " after the step");
  }
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, BeforeStartIterationIsTheDefaultAllReduceBitForBit) {
  auto run = RunWorkers("before_start", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(PowerSgdHookTest, BeforeStartIterationIsTheDefaultAllReduceBitForBitOnThreeRanks) {
  auto run = RunWorkers("before_start", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The same under Join dividing by the ranks still active (3 ranks; ranks 1
// and 2 hold two more batches, so those steps divide by 2): the hook then
// multiplies its local gradients by 1 / 2 and sums, as the reducer with no
// hook does (internal::PlanNoHookAverage), bit for bit.
DDP_TEST_WORKER(before_start_under_join) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank(), world = pg->size();
  const int mine = 2 + (rank >= 1 ? 2 : 0);
  auto model = Mlp(7), reference = Mlp(7);
  DistributedDataParallel ddp(model, {.process_group = pg});
  DistributedDataParallel ref_ddp(reference, {.process_group = pg});
  ddp.RegisterCommHook(hooks::PowerSgdHook({.start_iteration = 100}));
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  for (auto [which, which_opt] : {std::pair{&ddp, &opt}, std::pair{&ref_ddp, &ref_opt}}) {
    Join join(*which, {.divide_by_initial_world_size = false});
    for (int s = 0; s < mine; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * 8, 8);
      which_opt->ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy((*which)(x), y));
      which_opt->Step();
    }
    join.Wait();
  }
  WORKER_EXPECT(testing::HashState(*model) == testing::HashState(*reference),
                "under Join by the active ranks: PowerSGD before its start differs from DDP with no hook");
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, BeforeStartIterationIsTheDefaultAllReduceBitForBitUnderJoin) {
  auto run = RunWorkers("before_start_under_join", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------- called from a user's hook ----

// PowerSgdHook divides the gradients itself (it takes local ones). Called
// from a user's hook made with CommHook::OnLocalGradients it is the no-hook
// average bit for bit; from a plain user hook, which the reducer hands
// gradients already divided, it divided them again and the gradients came
// out halved on 2 ranks, silently. That call is now refused, naming the
// hook and the remedy.
DDP_TEST_WORKER(inside_a_user_hook) {
  auto pg = testing::WorkerGroup();
  const auto reference = OneBackwardGrads(pg, nullptr);
  const CommHook inner = hooks::PowerSgdHook({.start_iteration = 100});
  const auto local = OneBackwardGrads(
      pg, CommHook::OnLocalGradients([inner](ProcessGroup& g, GradBucket& b) { return inner(g, b); }));
  WORKER_EXPECT(local == reference, "inside an OnLocalGradients hook: not the no-hook average");
  const CommHook inner_again = hooks::PowerSgdHook({.start_iteration = 100});
  testing::ExpectRefused(
      pg->rank(),
      [&] { OneBackwardGrads(pg, [inner_again](ProcessGroup& g, GradBucket& b) { return inner_again(g, b); }); },
      "PowerSgdHook inside a hook given divided gradients was accepted",
      {"PowerSgdHook: bucket", "already divided by 2", "CommHook::OnLocalGradients"});
  return testing::WorkerExit();
}

// A user's hook on local gradients that writes the bucket in place and then
// calls PowerSgdHook. Clipping (here, bounds wider than every value) is
// legitimate and must give the no-hook average; it was refused, aborting
// the group. Dividing makes PowerSgdHook divide again (gradients divided by
// 4 on 2 ranks); the write alone cannot tell the two apart, so each state
// warns once on stderr, naming the bucket and that risk, and goes on.
DDP_TEST_WORKER(inside_a_writing_local_hook) {
  auto pg = testing::WorkerGroup();
  const auto reference = OneBackwardGrads(pg, nullptr);
  const CommHook clipped_inner = hooks::PowerSgdHook({.start_iteration = 100});
  const auto clipped = OneBackwardGrads(pg, CommHook::OnLocalGradients([clipped_inner](ProcessGroup& g, GradBucket& b) {
                                          nn::NoGradGuard no_grad;
                                          b.buffer().CopyFrom(nn::ops::Clamp(b.buffer(), -1e30, 1e30));
                                          return clipped_inner(g, b);
                                        }));
  WORKER_EXPECT(clipped == reference, "clipped in place before PowerSgdHook: not the no-hook average");
  const CommHook inner = hooks::PowerSgdHook({.start_iteration = 100});
  const CommHook dividing = CommHook::OnLocalGradients([inner](ProcessGroup& g, GradBucket& b) {
    nn::NoGradGuard no_grad;
    b.buffer().CopyFrom(nn::ops::DivScalar(b.buffer(), b.divisor()));
    return inner(g, b);
  });
  for (int step = 0; step < 2; ++step) {
    const auto twice = OneBackwardGrads(pg, dividing);
    bool halved = twice.size() == reference.size();
    for (size_t i = 0; halved && i < twice.size(); ++i) {
      halved = twice[i].size() == reference[i].size();
      for (size_t j = 0; halved && j < twice[i].size(); ++j) {
        halved = std::abs(twice[i][j] - reference[i][j] / 2) <= 1e-6f * (1 + std::abs(reference[i][j]));
      }
    }
    WORKER_EXPECT(halved, "divided before PowerSgdHook: not the no-hook average divided by 2 again");
  }
  return testing::WorkerExit();
}

// Occurrences of `needle` in `text`.
size_t Count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(PowerSgdHookTest, InsideALocalHookThatWroteTheBucketWarnsOncePerState) {
  auto run = RunWorkers("inside_a_writing_local_hook", 2);
  ASSERT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string& out = run.Output(rank);
    // Two states each wrote a bucket (the clipping one and the dividing
    // one, the latter on two steps): one warning each.
    EXPECT_EQ(Count(out, "warning: PowerSgdHook: bucket"), 2u) << out;
    EXPECT_NE(out.find("written in place by the calling hook"), std::string::npos) << out;
    EXPECT_NE(out.find("end up divided by 4"), std::string::npos) << out;
  }
}

TEST(PowerSgdHookTest, InsideAHookGivenDividedGradientsIsRefusedNamingIt) {
  auto run = RunWorkers("inside_a_user_hook", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------- one state, two wrappers ----

// Two live wrappers on two groups with one PowerSgdState: the second one's
// tasks ran on another communication thread on the same bucket states, and
// both backward threads counted the same iteration, unsynchronized (a data
// race, and each model's state overwritten by the other's). The second is
// refused at its first backward, on every rank; the first goes on.
DDP_TEST_WORKER(state_on_two_groups) {
  auto pg = testing::WorkerGroup();
  std::shared_ptr<ProcessGroup> other = pg->NewGroup({0, 1});
  auto state = std::make_shared<PowerSgdState>(PowerSgdOptions{.start_iteration = 0});
  testing::TwoWrappers wrappers(pg, other, hooks::PowerSgdHook(state), hooks::PowerSgdHook(state));
  wrappers.BackwardFirst();
  testing::ExpectRefused(
      pg->rank(), [&] { wrappers.BackwardSecond(); },
      "a second wrapper on another group shared the state",
      {"PowerSgdState already serves another process group"});
  wrappers.BackwardFirst();
  WORKER_EXPECT(state->iteration() == 2, "the first wrapper's iterations: " + std::to_string(state->iteration()));
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, AStateServingOneGroupRefusesASecondWrapperOnAnother) {
  auto run = RunWorkers("state_on_two_groups", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Two live wrappers on one group with one PowerSgdState: both counted its
// iterations (each wrapper's backward bumped the one counter, from its own
// thread if it has one), and their buckets of one index overwrote each other's Q and residuals.
// The second is refused at its first backward, on every rank, and the
// count stays the first wrapper's. (The refusal aborts the group, as any
// hook that throws does, so the first wrapper does not go on here.)
DDP_TEST_WORKER(state_on_two_wrappers_of_one_group) {
  auto pg = testing::WorkerGroup();
  auto state = std::make_shared<PowerSgdState>(PowerSgdOptions{.start_iteration = 0});
  testing::TwoWrappers wrappers(pg, pg, hooks::PowerSgdHook(state), hooks::PowerSgdHook(state));
  wrappers.BackwardFirst();
  testing::ExpectRefused(
      pg->rank(), [&] { wrappers.BackwardSecond(); },
      "a second wrapper on the same group shared the state",
      {"PowerSgdState already serves another wrapper on this process group"});
  WORKER_EXPECT(state->iteration() == 1, "iterations counted: " + std::to_string(state->iteration()));
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, AStateServingOneWrapperRefusesASecondWrapperOnTheSameGroup) {
  auto run = RunWorkers("state_on_two_wrappers_of_one_group", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------------- training ----

constexpr int kTrainSteps = 200;
constexpr int kLossWindow = 50;
// Mean loss (over ranks) of the last kLossWindow steps: PowerSGD at rank 2
// may trail the uncompressed run by this much (measured: 0.614 vs 0.573).
constexpr double kLossMargin = 0.1;

struct TrainResult {
  double first_loss = 0;  // mean over the first kLossWindow steps
  double last_loss = 0;   // mean over the last kLossWindow steps
  std::shared_ptr<Module> model;
};

TrainResult Train(const std::shared_ptr<ProcessGroup>& pg, CommHook hook) {
  const auto& data = testing::FashionMnist(8192);
  TrainResult result;
  result.model = Mlp(11);
  DistributedDataParallel ddp(result.model, {.process_group = pg});
  if (hook) ddp.RegisterCommHook(std::move(hook));
  nn::optim::Sgd opt(result.model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  constexpr int64_t kBatchPerRank = 32;
  for (int s = 0; s < kTrainSteps; ++s) {
    auto [x, y] = testing::Batch(data, (s * pg->size() + pg->rank()) * kBatchPerRank, kBatchPerRank);
    opt.ZeroGrad();
    Tensor loss = nn::loss::CrossEntropy(ddp(x), y);
    nn::Backward(loss);
    opt.Step();
    if (s < kLossWindow) result.first_loss += loss.Item() / kLossWindow;
    if (s >= kTrainSteps - kLossWindow) result.last_loss += loss.Item() / kLossWindow;
  }
  // Averaged over the ranks (each rank's loss is on its own shard).
  Tensor losses = nn::FromVectorOf<double>({result.first_loss, result.last_loss}, {2});
  pg->AllReduce(losses, transport::ReduceOp::kAvg).Wait();
  result.first_loss = losses.data<double>()[0];
  result.last_loss = losses.data<double>()[1];
  return result;
}

DDP_TEST_WORKER(training) {
  auto pg = testing::WorkerGroup();
  const TrainResult plain = Train(pg, nullptr);
  const TrainResult low = Train(pg, hooks::PowerSgdHook({.matrix_approximation_rank = 2, .start_iteration = 10}));
  std::fprintf(stderr, "rank %d: loss %.4f -> %.4f uncompressed, %.4f -> %.4f PowerSGD rank 2\n", pg->rank(),
               plain.first_loss, plain.last_loss, low.first_loss, low.last_loss);
  WORKER_EXPECT(low.last_loss <= plain.last_loss + kLossMargin,
                "PowerSGD loss " + std::to_string(low.last_loss) + " vs " + std::to_string(plain.last_loss));
  WORKER_EXPECT(low.last_loss <= 0.7 * low.first_loss, "PowerSGD loss did not decrease: " +
                                                           std::to_string(low.first_loss) + " -> " +
                                                           std::to_string(low.last_loss));
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*low.model)), "PowerSGD replicas differ");
  WORKER_EXPECT(testing::HashState(*low.model) != testing::HashState(*plain.model),
                "PowerSGD run equals the uncompressed one: nothing was compressed");
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, LowRankTrainingKeepsUpAndReplicasStayIdentical) {
  // About 3 s in an optimized build; the sanitizer builds take minutes
  // (hangs still end after DDP_TEST_TIMEOUT_MS, at the first collective).
  auto run = RunWorkers("training", 2, {}, 300000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------- a gradient not finite ----

// Whether every element of `t` is finite.
bool AllFinite(const Tensor& t) {
  for (double v : t.ToVector<double>()) {
    if (!std::isfinite(v)) return false;
  }
  return true;
}

// This rank's gradient of step `k` for the hook-level check: a random
// [16, 12] matrix (compressed at rank 1) and a random [5] (sent exactly),
// as one bucket.
Tensor RankGradients(int rank, int k) {
  nn::Generator gen(1000 + 10 * k + rank);
  return nn::Randn({16 * 12 + 5}, {}, gen);
}

// The parameters of RankGradients' bucket: the hook tells parameters apart
// by their tensor objects, so every call passes these same two.
const std::vector<Tensor>& TwoParameters() {
  static const std::vector<Tensor> params = {nn::Zeros({16, 12}), nn::Zeros({5})};
  return params;
}

// One call of `hook` on the two-tensor bucket holding `flat`; the output.
Tensor CompressTwo(CommHook& hook, ProcessGroup& pg, const Tensor& flat) {
  const Tensor buffer = flat.Clone();
  GradBucket bucket(0, 1, buffer, TwoParameters(), {0, 16 * 12});
  hook(pg, bucket).Wait();
  return buffer;
}

// One rank's gradient holds an inf once. Compressed, P's row norm was NaN,
// Q and the residual became NaN and were kept, and every later gradient of
// the bucket was NaN, even though a GradScaler would have skipped the step.
// Now that iteration is all-reduced uncompressed (the inf reaches .grad on
// every rank), and the next ones are finite and identical on every rank.
DDP_TEST_WORKER(not_finite_once) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  constexpr int kBad = 3, kSteps = 7;

  // Through DDP: an inf in rank 1's input at step kBad makes its loss and
  // every gradient of it NaN; the step is skipped, as a GradScaler would.
  {
    const auto& data = testing::FashionMnist();
    auto model = Mlp(13);
    DistributedDataParallel ddp(model, {.process_group = pg});
    ddp.RegisterCommHook(hooks::PowerSgdHook({.matrix_approximation_rank = 1, .start_iteration = 1}));
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = testing::Batch(data, (s * pg->size() + rank) * 8, 8);
      if (s == kBad && rank == 1) x.data<float>()[0] = INFINITY;
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      const std::string step = "DDP step " + std::to_string(s) + ": ";
      uint64_t grads = 1469598103934665603ull;
      bool finite = true;
      for (const auto& [name, p] : model->NamedParameters()) {
        const bool all_finite = AllFinite(p.grad());
        finite = finite && all_finite;
        if (s == kBad) WORKER_EXPECT(!all_finite, step + "`" + name + "`'s gradient is all finite");
        for (double v : p.grad().ToVector<double>()) grads = grads * 1099511628211ull ^ std::hash<double>{}(v);
      }
      if (s == kBad) continue;  // skipped, as by a GradScaler
      WORKER_EXPECT(finite, step + "a gradient is not finite");
      WORKER_EXPECT(testing::SameOnAllRanks(*pg, grads), step + "the ranks' gradients differ");
      opt.Step();
    }
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "the replicas differ");
  }

  // The hook alone: after the bad step it gives, bit for bit, what a new
  // hook gives (zero residuals, the initial Q), and the bad step itself is
  // the plain sum (the exact tensor summed once, not twice).
  {
    const PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 0};
    CommHook hook = hooks::PowerSgdHook(options), fresh;
    for (int k = 0; k < kSteps; ++k) {
      Tensor mine = RankGradients(rank, k);
      if (k == kBad && rank == 1) mine.data<float>()[7] = INFINITY;
      const Tensor out = CompressTwo(hook, *pg, mine);
      const std::string step = "hook step " + std::to_string(k) + ": ";
      const std::vector<float> o = out.ToVector<float>();
      if (k == kBad) {
        // The plain sum of the ranks' gradients (the residuals of steps
        // 0 .. kBad-1 come in too, so only the exact tensor and the inf are
        // checked exactly).
        WORKER_EXPECT(std::isinf(o[7]), step + "element 7 is " + std::to_string(o[7]) + ", not inf");
        size_t other = 0;
        for (size_t i = 0; i < o.size(); ++i) other += i != 7 && !std::isfinite(o[i]);
        WORKER_EXPECT(other == 0, step + std::to_string(other) + " other elements are not finite");
        const std::vector<float> a = RankGradients(0, k).ToVector<float>(), b = RankGradients(1, k).ToVector<float>();
        for (size_t i = 16 * 12; i < o.size(); ++i) {
          WORKER_EXPECT(o[i] == a[i] + b[i], step + "exact element " + std::to_string(i) + " is " +
                                                  std::to_string(o[i]) + ", not the sum " +
                                                  std::to_string(a[i] + b[i]));
        }
        fresh = hooks::PowerSgdHook(options);
        continue;
      }
      WORKER_EXPECT(AllFinite(out), step + "the output is not finite");
      if (k > kBad) {
        const Tensor expected = CompressTwo(fresh, *pg, mine);
        const std::vector<float> e = expected.ToVector<float>();
        WORKER_EXPECT(o == e, step + "differs from a new hook's output (first element " + std::to_string(o[0]) +
                                  " vs " + std::to_string(e[0]) + ")");
      }
    }
  }
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, AGradientNotFiniteOnceReachesGradAndLeavesNoNaNBehind) {
  auto run = RunWorkers("not_finite_once", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------------ a late peer ----

// A gradient [rows, 64] of rank 64 for `rank`, the same on every call.
Tensor TallGradient(int rank, int64_t rows) {
  constexpr int64_t kCols = 64;
  std::vector<float> v(static_cast<size_t>(rows * kCols));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < kCols; ++j) {
      v[i * kCols + j] = static_cast<float>(std::sin(0.37 * i + 1.3 * j + rank) + 0.1 * std::cos(0.011 * i * j));
    }
  }
  return nn::FromVectorOf<float>(v, {rows, kCols});
}

// Collective: the largest of each rank's `seconds`.
double Slowest(ProcessGroup& pg, double seconds) {
  double most = 0;
  for (const std::string& s : pg.AllGatherObject(std::to_string(seconds))) most = std::max(most, std::stod(s));
  return most;
}

// Each of the hook's all-reduces waits for a late peer up to the group's
// timeout, as any collective does (PyTorch's hook issues its P and Q
// all-reduces as collectives of their own). Here rank 1 comes to the P
// all-reduce late, by most of the timeout but within it, and then both
// ranks spend a while making P orthonormal and forming Q. When one
// deadline, counted from rank 0's start, covered all the all-reduces of a
// bucket, the Q all-reduce found it passed and the step failed with
// TIMED_OUT, though no peer was ever later than the timeout.
//
// The gradient is tall, [rows, 64] at rank 64: the fixed-order
// Gram-Schmidt over P^T [64, rows] and the Q product take a large share
// of a call, the P product (BLAS) a small one. rows is scaled from a first
// call toward about 3 s a call, and rank 1 comes late by the timeout (10
// s) less 0.35 of a call: in time for the P all-reduce with about 1 s to
// spare, too late for a shared deadline to leave the Q all-reduce any
// time. The lateness is counted from rank 0's start, read on rank 0's
// clock (CLOCK_MONOTONIC, shared by the processes of one host), so that
// neither how far apart the ranks left the barrier nor a pause of rank 1
// before its sleep adds to it.
DDP_TEST_WORKER(late_peer) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  const double timeout = std::atof(std::getenv("DDP_TEST_TIMEOUT_MS")) / 1000;
  const PowerSgdOptions options{.matrix_approximation_rank = 64, .start_iteration = 0, .min_compression_rate = 0};
  // One call, with rank 1 starting `late` seconds after rank 0; its output
  // and the seconds from this rank's start until its Work completed.
  const auto call = [&](CommHook& hook, const Tensor& param, double late) {
    using Clock = std::chrono::steady_clock;
    const Tensor buffer = TallGradient(rank, param.size(0)).View({param.numel()});
    GradBucket bucket(0, 1, buffer, {param}, {0});
    pg->Barrier().Wait();
    // Rank 0 reads its clock before the exchange, so that rank 1's lateness
    // counts from no later than rank 0's start.
    const Clock::time_point now = Clock::now();
    const std::vector<std::string> starts = pg->AllGatherObject(std::to_string(now.time_since_epoch().count()));
    if (rank == 1) {
      const Clock::time_point rank0_start{Clock::duration(std::stoll(starts[0]))};
      std::this_thread::sleep_until(rank0_start + std::chrono::duration_cast<Clock::duration>(
                                                      std::chrono::duration<double>(late)));
    }
    const auto start = Clock::now();
    hook(*pg, bucket).Wait();
    return std::make_pair(buffer.View(param.shape()), std::chrono::duration<double>(Clock::now() - start).count());
  };
  constexpr int64_t kFirstRows = 4096;
  CommHook sizing = hooks::PowerSgdHook(options);
  const double first = Slowest(*pg, call(sizing, nn::Zeros({kFirstRows, 64}), 0).second);
  const int64_t rows = std::clamp<int64_t>(static_cast<int64_t>(kFirstRows * 3.0 / first) / 1024 * 1024,
                                           kFirstRows, int64_t{1} << 20);
  const Tensor param = nn::Zeros({rows, 64});
  CommHook hook = hooks::PowerSgdHook(options);
  const double on_time = Slowest(*pg, call(hook, param, 0).second);
  const double late = timeout - 0.35 * on_time;
  std::fprintf(stderr, "rows %lld: a call takes %.3f s; rank 1 comes %.3f s late (timeout %.3f s)\n",
               static_cast<long long>(rows), on_time, late, timeout);
  try {
    const Tensor out = call(hook, param, late).first;
    // Rank 64 of a [rows, 64] gradient: the sum itself.
    std::vector<float> sum = TallGradient(0, rows).ToVector<float>();
    const std::vector<float> other = TallGradient(1, rows).ToVector<float>();
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += other[i];
    const double diff = testing::RelativeDifference(out, nn::FromVectorOf<float>(sum, out.shape()));
    WORKER_EXPECT(diff <= 1e-3, "the late call's output is off the sum by " + std::to_string(diff));
  } catch (const DistributedError& e) {
    WORKER_EXPECT(false, std::string("the late call failed: ") + e.what());
  }
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, EachAllReduceWaitsForALatePeerUpToTheTimeout) {
  auto run = RunWorkers("late_peer", 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ---------------------------------------------------- one process ----

// Rank 3 gradient [16, 12] (three separable terms), compressed to rank 1.
Tensor FixedGradient(nn::DType dtype) {
  constexpr int64_t kRows = 16, kCols = 12;
  std::vector<double> v(kRows * kCols);
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < kCols; ++j) {
      v[i * kCols + j] = 3 * std::cos(0.5 * i) * std::sin(0.3 * j + 0.1) +
                         2 * std::sin(0.7 * i + 0.2) * std::cos(0.4 * j) +
                         1.5 * std::cos(1.1 * i + 0.3) * std::cos(0.9 * j + 0.5);
    }
  }
  return nn::FromVectorOf<double>(v, {kRows, kCols}).To(dtype);
}

// Feeds the same gradient to a rank-1 hook `steps` times in a one-process
// group; returns ||steps M - sum of outputs|| / ||steps M|| after each step.
std::vector<double> SumErrors(bool error_feedback, nn::DType dtype, int steps) {
  auto pg = ProcessGroup::Single();
  const Tensor m = FixedGradient(dtype);
  const std::vector<double> mv = m.ToVector<double>();
  CommHook hook = hooks::PowerSgdHook(
      {.matrix_approximation_rank = 1, .start_iteration = 0, .use_error_feedback = error_feedback});
  std::vector<double> sum(mv.size(), 0.0), errors;
  for (int k = 1; k <= steps; ++k) {
    const Tensor buffer = m.Clone().View({m.numel()});
    GradBucket bucket(0, 1, buffer, {m}, {0});
    hook(*pg, bucket).Wait();
    const std::vector<double> out = buffer.ToVector<double>();
    double diff_sq = 0, norm_sq = 0;
    for (size_t i = 0; i < mv.size(); ++i) {
      sum[i] += out[i];
      diff_sq += std::pow(k * mv[i] - sum[i], 2);
      norm_sq += std::pow(k * mv[i], 2);
    }
    errors.push_back(std::sqrt(diff_sq / norm_sq));
  }
  return errors;
}

TEST(PowerSgdHookTest, ErrorFeedbackMakesTheOutputsSumToTheGradients) {
  constexpr int kSteps = 200;
  for (nn::DType dtype : {nn::DType::kFloat32, nn::DType::kFloat64}) {
    SCOPED_TRACE(std::string(nn::DTypeName(dtype)));
    const std::vector<double> with = SumErrors(true, dtype, kSteps);
    const std::vector<double> without = SumErrors(false, dtype, kSteps);
    // With feedback the sum trails k M by the last residual alone, which
    // stays bounded (measured: at most 2.6 ||M|| here, from step 5 on
    // 1.5-2 ||M||), so the relative error falls as 1/k. Without feedback
    // the gap grows by 0.61 ||M|| a step.
    for (int k = 1; k <= kSteps; ++k) {
      ASSERT_LE(with[k - 1] * k, 4.0) << "step " << k << ": the residual grew";
    }
    EXPECT_LT(with.back(), 0.02);
    // Without it every output is the same rank-1 part of M: the sum misses
    // the other two terms for good.
    EXPECT_GT(without.back(), 0.3);
    EXPECT_NEAR(without.back(), without[kSteps / 2], 1e-3);
    std::printf("relative error after %d steps: %.4g with error feedback, %.4g without\n", kSteps, with.back(),
                without.back());
  }
}

// One call of `hook` on a one-tensor bucket holding `gradient` of
// `parameter` (a one-process group: the sum over ranks is this rank's); the
// output.
Tensor Compress(CommHook& hook, ProcessGroup& pg, const Tensor& parameter, const Tensor& gradient) {
  const Tensor buffer = gradient.Clone().View({gradient.numel()});
  GradBucket bucket(0, 1, buffer, {parameter}, {0});
  hook(pg, bucket).Wait();
  return buffer.View(gradient.shape());
}

double Norm(const Tensor& t) {
  double sq = 0;
  for (double v : t.ToVector<double>()) sq += v * v;
  return std::sqrt(sq);
}

// A gradient that is all zero once (an unused parameter) zeroes P and Q;
// kept as the warm start, that Q gave zero for every later gradient. Later
// gradients must be compressed again, and with error feedback the residual
// must stay bounded instead of growing by the whole gradient each step.
TEST(PowerSgdHookTest, GradientZeroOnceIsCompressedAgainLater) {
  auto pg = ProcessGroup::Single();
  for (nn::DType dtype : {nn::DType::kFloat32, nn::DType::kFloat64}) {
    for (bool feedback : {false, true}) {
      SCOPED_TRACE(std::string(nn::DTypeName(dtype)) + (feedback ? " with" : " without") + " error feedback");
      const Tensor m = FixedGradient(dtype);
      CommHook hook = hooks::PowerSgdHook(
          {.matrix_approximation_rank = 1, .start_iteration = 0, .use_error_feedback = feedback});
      EXPECT_EQ(Norm(Compress(hook, *pg, m, nn::Zeros(m.shape(), {.dtype = dtype}))), 0.0);
      const std::vector<double> mv = m.ToVector<double>();
      std::vector<double> sum(mv.size(), 0.0);
      constexpr int kSteps = 20;
      for (int k = 1; k <= kSteps; ++k) {
        const Tensor out = Compress(hook, *pg, m, m);
        // At least the line of M's first singular vector's share of a
        // random direction at first; the top rank-1 part (about 0.8 ||M||)
        // once power iteration has converged.
        ASSERT_GT(Norm(out), (k == 1 ? 0.05 : 0.5) * Norm(m)) << "step " << k << ": compressed to (nearly) zero";
        const std::vector<double> ov = out.ToVector<double>();
        for (size_t i = 0; i < mv.size(); ++i) sum[i] += ov[i];
      }
      if (feedback) {
        // The sum trails kSteps M by the last residual alone (bounded, as in
        // ErrorFeedbackMakesTheOutputsSumToTheGradients).
        double diff_sq = 0;
        for (size_t i = 0; i < mv.size(); ++i) diff_sq += std::pow(kSteps * mv[i] - sum[i], 2);
        EXPECT_LE(std::sqrt(diff_sq), 4.0 * Norm(m));
      }
    }
  }
}

// A gradient whose only nonzero row is the first (one row of an embedding
// used) has rank 1: at rank 2 Gram-Schmidt zeroes the second row of P^T,
// and so of Q^T. Kept, that row stayed zero, and every later output was
// rank 1 whatever the gradient's rank.
TEST(PowerSgdHookTest, ColumnOfQZeroOnceComesBack) {
  auto pg = ProcessGroup::Single();
  const Tensor m = FixedGradient(nn::DType::kFloat64);  // rank 3
  const int64_t n = m.size(0), cols = m.size(1);
  std::vector<double> one_row(n * cols, 0.0);
  for (int64_t j = 0; j < cols; ++j) one_row[j] = std::cos(0.3 * j);
  CommHook hook = hooks::PowerSgdHook(
      {.matrix_approximation_rank = 2, .start_iteration = 0, .use_error_feedback = false});
  const Tensor first = Compress(hook, *pg, m, nn::FromVectorOf<double>(one_row, {n, cols}));
  EXPECT_LE(RankOneError(first), 1e-6);
  Tensor out;
  for (int k = 0; k < 10; ++k) out = Compress(hook, *pg, m, m);
  // Rank 2 now: far from a line (M's second term has two thirds of the
  // first's size).
  EXPECT_GT(RankOneError(out), 0.1) << "the output stayed rank 1";
}

// One call of `hook` on a bucket of two [16, 12] parameters, `first` then
// `second`, with gradients `g_first` and `g_second`; the outputs in that
// order.
std::pair<Tensor, Tensor> CompressPair(CommHook& hook, ProcessGroup& pg, const Tensor& first, const Tensor& second,
                                       const Tensor& g_first, const Tensor& g_second) {
  const Tensor buffer = nn::Empty({2 * 16 * 12});
  buffer.Narrow(0, 0, 16 * 12).CopyFrom(g_first.View({16 * 12}));
  buffer.Narrow(0, 16 * 12, 16 * 12).CopyFrom(g_second.View({16 * 12}));
  GradBucket bucket(0, 1, buffer, {first, second}, {0, 16 * 12});
  hook(pg, bucket).Wait();
  return {buffer.Narrow(0, 0, 16 * 12).View({16, 12}).Clone(),
          buffer.Narrow(0, 16 * 12, 16 * 12).View({16, 12}).Clone()};
}

// DDP rebuilds its buckets once, in the order the gradients arrived: two
// parameters of one shape can trade places, which leaves the bucket's
// shapes and offsets as they were. Their residuals and Qs must follow them:
// kept by place, each got the other's, and its gradient came out wrong.
// A hook that sees the pair swapped after some steps gives, bit for bit,
// what a hook that never saw them swapped gives.
TEST(PowerSgdHookTest, StateFollowsParametersThatTradePlacesInTheBucket) {
  auto pg = ProcessGroup::Single();
  const Tensor a = nn::Zeros({16, 12}), b = nn::Zeros({16, 12});
  for (bool feedback : {false, true}) {
    SCOPED_TRACE(feedback ? "with error feedback" : "without error feedback");
    const PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 0,
                                  .use_error_feedback = feedback};
    CommHook swapped = hooks::PowerSgdHook(options), kept = hooks::PowerSgdHook(options);
    for (int k = 0; k < 6; ++k) {
      nn::Generator gen(77 + k);
      const Tensor ga = nn::Randn({16, 12}, {}, gen), gb = nn::Randn({16, 12}, {}, gen);
      const auto [ka, kb] = CompressPair(kept, *pg, a, b, ga, gb);
      // From step 3 on, b comes first.
      const bool swap = k >= 3;
      const auto [s1, s2] = swap ? CompressPair(swapped, *pg, b, a, gb, ga) : CompressPair(swapped, *pg, a, b, ga, gb);
      const Tensor& sa = swap ? s2 : s1;
      const Tensor& sb = swap ? s1 : s2;
      EXPECT_EQ(sa.ToVector<float>(), ka.ToVector<float>()) << "step " << k << ": parameter a's output differs";
      EXPECT_EQ(sb.ToVector<float>(), kb.ToVector<float>()) << "step " << k << ": parameter b's output differs";
    }
  }
}

// A parameter the old bucket did not hold makes the bucket draw a new Q:
// the new parameter's output is a new hook's. The parameter that stays
// keeps its residual (error feedback is on), so its output is not.
TEST(PowerSgdHookTest, NewParameterInTheBucketDrawsANewQ) {
  auto pg = ProcessGroup::Single();
  const Tensor a = nn::Zeros({16, 12}), b = nn::Zeros({16, 12}), c = nn::Zeros({16, 12});
  const PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 0};
  CommHook hook = hooks::PowerSgdHook(options), fresh = hooks::PowerSgdHook(options);
  nn::Generator gen(5);
  for (int k = 0; k < 3; ++k) CompressPair(hook, *pg, a, b, nn::Randn({16, 12}, {}, gen), nn::Randn({16, 12}, {}, gen));
  const Tensor ga = nn::Randn({16, 12}, {}, gen), gc = nn::Randn({16, 12}, {}, gen);
  const auto [oa, oc] = CompressPair(hook, *pg, a, c, ga, gc);
  const auto [fa, fc] = CompressPair(fresh, *pg, a, c, ga, gc);
  EXPECT_NE(oa.ToVector<float>(), fa.ToVector<float>()) << "a's residual was dropped";
  EXPECT_EQ(oc.ToVector<float>(), fc.ToVector<float>());
}

// DDP rebuilds its buckets after the first iteration, and a parameter can
// move to a bucket of another index. With start_iteration 0 or 1 the hook
// already holds its Q and residual then; they follow it (they were kept by
// bucket index alone, and such a bucket started over: a fresh Q, and the
// residuals, what the approximations had not yet delivered, dropped). The
// reference is a hook given the same state through StateDict and
// LoadStateDict, which places it by parameter.
TEST(PowerSgdHookTest, StateFollowsParametersIntoAnotherBucketAtTheRebuild) {
  auto pg = ProcessGroup::Single();
  const Tensor a = nn::Zeros({16, 12}), b = nn::Zeros({20, 10});
  const auto bucket_of = [&](CommHook& hook, size_t index, const Tensor& p, const Tensor& g) {
    const Tensor buffer = g.Clone().View({g.numel()});
    GradBucket bucket(index, 2, buffer, {p}, {0});
    hook(*pg, bucket).Wait();
    return buffer.ToVector<float>();
  };
  for (const bool feedback : {false, true}) {
    SCOPED_TRACE(feedback ? "with error feedback" : "without error feedback");
    const PowerSgdOptions options{.matrix_approximation_rank = 2, .start_iteration = 0,
                                  .use_error_feedback = feedback};
    auto state = std::make_shared<PowerSgdState>(options);
    CommHook hook = hooks::PowerSgdHook(state);
    nn::Generator gen(31);
    // Iterations 0 and 1: a in bucket 0, b in bucket 1.
    for (int k = 0; k < 2; ++k) {
      bucket_of(hook, 0, a, nn::Randn({16, 12}, {}, gen));
      bucket_of(hook, 1, b, nn::Randn({20, 10}, {}, gen));
    }
    auto loaded = std::make_shared<PowerSgdState>(options);
    loaded->LoadStateDict(state->StateDict({{"a", a}, {"b", b}}, true), {{"a", a}, {"b", b}});
    CommHook reference = hooks::PowerSgdHook(loaded);
    // Rebuilt: b in bucket 0, a in bucket 1.
    for (int k = 0; k < 3; ++k) {
      const Tensor gb = nn::Randn({20, 10}, {}, gen), ga = nn::Randn({16, 12}, {}, gen);
      EXPECT_EQ(bucket_of(hook, 0, b, gb), bucket_of(reference, 0, b, gb)) << "step " << k << ": b differs";
      EXPECT_EQ(bucket_of(hook, 1, a, ga), bucket_of(reference, 1, a, ga)) << "step " << k << ": a differs";
    }
    // Rebuilt into one bucket, b then a: bucket 1 is gone, and what it
    // held follows its parameter as well.
    auto reloaded = std::make_shared<PowerSgdState>(options);
    reloaded->LoadStateDict(state->StateDict({{"a", a}, {"b", b}}, true), {{"a", a}, {"b", b}});
    CommHook reference_again = hooks::PowerSgdHook(reloaded);
    const auto one_bucket = [&](CommHook& h, const Tensor& gb, const Tensor& ga) {
      const Tensor buffer = nn::Empty({b.numel() + a.numel()});
      buffer.Narrow(0, 0, b.numel()).CopyFrom(gb.View({b.numel()}));
      buffer.Narrow(0, b.numel(), a.numel()).CopyFrom(ga.View({a.numel()}));
      GradBucket bucket(0, 1, buffer, {b, a}, {0, b.numel()});
      h(*pg, bucket).Wait();
      return buffer.ToVector<float>();
    };
    for (int k = 0; k < 2; ++k) {
      const Tensor gb = nn::Randn({20, 10}, {}, gen), ga = nn::Randn({16, 12}, {}, gen);
      EXPECT_EQ(one_bucket(hook, gb, ga), one_bucket(reference_again, gb, ga)) << "one bucket, step " << k;
    }
  }
}

// A loaded state whose sizes no longer fit its parameter: the parameter
// was given data of another shape (Tensor::SetData keeps the object, so
// the state still finds it). Its Q [1, 8] and residual [8, 8] were copied
// by the new sizes, [1, 64] and [64, 64], reading past their ends into
// the bucket. The state is dropped: the output is a new hook's.
TEST(PowerSgdHookTest, LoadedStateOfAnotherShapeStartsOverAsANewHook) {
  auto pg = ProcessGroup::Single();
  const PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 0, .min_compression_rate = 0};
  const Tensor p = nn::Zeros({8, 8});
  auto state = std::make_shared<PowerSgdState>(options);
  CommHook hook = hooks::PowerSgdHook(state);
  nn::Generator gen(41);
  for (int k = 0; k < 2; ++k) Compress(hook, *pg, p, nn::Randn({8, 8}, {}, gen));
  const PowerSgdState::NamedTensors saved = state->StateDict({{"w", p}}, true);
  ASSERT_EQ(saved.size(), 3u) << "premise: the iteration, w's Q and w's residual";
  auto loaded = std::make_shared<PowerSgdState>(options);
  loaded->LoadStateDict(saved, {{"w", p}});
  p.SetData(nn::Zeros({64, 64}));
  CommHook resumed = hooks::PowerSgdHook(loaded), fresh = hooks::PowerSgdHook(options);
  const Tensor g = nn::Randn({64, 64}, {}, gen);
  EXPECT_EQ(Compress(resumed, *pg, p, g).ToVector<float>(), Compress(fresh, *pg, p, g).ToVector<float>());
  // What it keeps from now on is of the new shape.
  for (const auto& [key, t] : loaded->StateDict({{"w", p}}, true)) {
    if (key == "powersgd.q.w") {
      EXPECT_EQ(t.shape(), (nn::Shape{1, 64}));
    } else if (key == "powersgd.residual.w") {
      EXPECT_EQ(t.shape(), (nn::Shape{64, 64}));
    }
  }
}

// A loaded state whose parameter is freed before any backward (its model
// destroyed, and the state given to a wrapper of another model): no
// parameter can take it. Before, its Q and residual were held until the
// next LoadStateDict; the hook's next call drops them.
TEST(PowerSgdHookTest, ALoadedStateOfAFreedParameterIsDroppedAtTheNextCall) {
  auto pg = ProcessGroup::Single();
  const PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 0};
  auto loaded = std::make_shared<PowerSgdState>(options);
  nn::Generator gen(47);
  // Made before the freed one is freed, so that it cannot take its address.
  const Tensor kept = nn::Zeros({20, 10});
  {
    const Tensor freed = nn::Zeros({16, 12});
    auto state = std::make_shared<PowerSgdState>(options);
    CommHook hook = hooks::PowerSgdHook(state);
    for (int k = 0; k < 2; ++k) Compress(hook, *pg, freed, nn::Randn({16, 12}, {}, gen));
    loaded->LoadStateDict(state->StateDict({{"w", freed}}, true), {{"w", freed}});
    ASSERT_EQ(loaded->held_parameter_states(), 1u) << "premise: w's Q and residual are held";
  }
  CommHook resumed = hooks::PowerSgdHook(loaded);
  Compress(resumed, *pg, kept, nn::Randn({20, 10}, {}, gen));
  EXPECT_EQ(loaded->held_parameter_states(), 0u);
}

// The state of a parameter that was freed (its model destroyed while the
// state lives on, for a new wrapper) is not a new parameter's: kept by
// address alone, a new tensor that the allocator placed where the old one
// was took its Q and residual (the same shape here, so silently wrong
// gradients; another shape read out of bounds). The new parameter starts
// as under a new hook, at whatever address it lands.
TEST(PowerSgdHookTest, StateOfAFreedParameterIsNotANewParametersAtItsAddress) {
  auto pg = ProcessGroup::Single();
  const PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 0};
  auto state = std::make_shared<PowerSgdState>(options);
  CommHook hook = hooks::PowerSgdHook(state);
  nn::Generator gen(43);
  {
    const Tensor old = nn::Zeros({16, 12});
    for (int k = 0; k < 2; ++k) Compress(hook, *pg, old, nn::Randn({16, 12}, {}, gen));
  }
  const Tensor p = nn::Zeros({16, 12});
  CommHook fresh = hooks::PowerSgdHook(options);
  const Tensor g = nn::Randn({16, 12}, {}, gen);
  EXPECT_EQ(Compress(hook, *pg, p, g).ToVector<float>(), Compress(fresh, *pg, p, g).ToVector<float>());
  EXPECT_EQ(state->StateDict({{"p", p}}, true).size(), 3u) << "p's Q and residual, under its own name";
}

// A gradient of subnormal size (1e-40 in f32): the norm of P's row is
// below 1 / FLT_MAX, and 1 / norm overflowed to inf. P became inf and NaN,
// and the bucket was sent uncompressed at every step (the output was the
// gradient itself). It is compressed as the same gradient at normal size
// is, scaled down.
TEST(PowerSgdHookTest, SubnormalGradientIsCompressed) {
  auto pg = ProcessGroup::Single();
  constexpr double kTiny = 1e-40;
  const Tensor m = FixedGradient(nn::DType::kFloat32);
  const Tensor tiny = nn::FromVectorOf<double>([&] {
    std::vector<double> v = m.ToVector<double>();
    for (double& x : v) x *= kTiny;
    return v;
  }(), m.shape()).To(nn::DType::kFloat32);
  const PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 0, .use_error_feedback = false};
  CommHook normal_hook = hooks::PowerSgdHook(options), tiny_hook = hooks::PowerSgdHook(options);
  const std::vector<double> expected = Compress(normal_hook, *pg, m, m).ToVector<double>();
  const Tensor out = Compress(tiny_hook, *pg, m, tiny);
  const std::vector<double> got = out.ToVector<double>(), input = tiny.ToVector<double>();
  ASSERT_NE(got, input) << "sent uncompressed";
  double diff_sq = 0, norm_sq = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    diff_sq += std::pow(got[i] / kTiny - expected[i], 2);
    norm_sq += expected[i] * expected[i];
  }
  // Subnormal floats keep about 5 digits at 1e-40.
  EXPECT_LE(std::sqrt(diff_sq / norm_sq), 1e-3) << "not the scaled rank-1 approximation";
  // Later steps are compressed too (never the gradient itself).
  for (int k = 1; k < 6; ++k) {
    EXPECT_NE(Compress(tiny_hook, *pg, m, tiny).ToVector<double>(), input) << "step " << k << ": sent uncompressed";
  }
}

// An f16 bucket is sent uncompressed: from start_iteration on, the hook
// says so on stderr, naming the dtype and device, once per hook (it was
// silent, and a model converted to f16 trained at full traffic unnoticed).
TEST(PowerSgdHookTest, UncompressedBucketPastTheStartIsNotedOncePerHook) {
  auto pg = ProcessGroup::Single();
  const Tensor weight = nn::Full({4, 4}, 1.0), half = nn::Full({4, 4}, 1.0, {.dtype = nn::DType::kFloat16});
  // One iteration: an f32 bucket, then the last, f16 one.
  const auto iteration = [&](CommHook& hook) {
    GradBucket f32(0, 2, weight.Clone().View({16}), {weight}, {0});
    hook(*pg, f32).Wait();
    const Tensor buffer = half.Clone().View({16});
    GradBucket f16(1, 2, buffer, {half}, {0});
    hook(*pg, f16).Wait();
    EXPECT_EQ(buffer.ToVector<double>(), std::vector<double>(16, 1.0)) << "the f16 bucket changed";
  };
  const std::string note = "bucket 1, a bucket of f16 gradients on cpu, is all-reduced uncompressed";
  const auto count = [](const std::string& text, const std::string& needle) {
    size_t n = 0;
    for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
    return n;
  };
  CommHook hook = hooks::PowerSgdHook({.start_iteration = 1});
  ::testing::internal::CaptureStderr();
  iteration(hook);
  const std::string before = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(before, "PowerSgdHook"), 0u) << "before start_iteration: " << before;
  ::testing::internal::CaptureStderr();
  for (int k = 0; k < 3; ++k) iteration(hook);
  const std::string after = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(after, note), 1u) << after;
  EXPECT_EQ(count(after, "PowerSgdHook"), 1u) << after;
  // Another hook says it again.
  CommHook other = hooks::PowerSgdHook({.start_iteration = 0});
  ::testing::internal::CaptureStderr();
  iteration(other);
  EXPECT_EQ(count(::testing::internal::GetCapturedStderr(), note), 1u);
}

TEST(PowerSgdHookTest, ElementsPerStepFollowTheCompressionRule) {
  // The peers' MLP: [512, 784], [512], [256, 512], [256], [10, 256], [10].
  const std::vector<nn::Shape> mlp = {{512, 784}, {512}, {256, 512}, {256}, {10, 256}, {10}};
  EXPECT_EQ(PowerSgdElementsPerStep(mlp, {}), (512 + 784) + 512 + (256 + 512) + 256 + (10 + 256) + 10);
  EXPECT_EQ(PowerSgdElementsPerStep(mlp, {.matrix_approximation_rank = 4}),
            4 * (512 + 784) + 512 + 4 * (256 + 512) + 256 + 4 * (10 + 256) + 10);
  // [10, 256] at rank 8: 2560 is not more than 2 * 8 * 266, sent exactly.
  EXPECT_EQ(PowerSgdElementsPerStep(mlp, {.matrix_approximation_rank = 8}),
            8 * (512 + 784) + 512 + 8 * (256 + 512) + 256 + 2560 + 10);
  // A convolution [32, 1, 3, 3] is a [32, 9] matrix: 288 vs 2 * 41 at rank 1.
  EXPECT_EQ(PowerSgdElementsPerStep({{32, 1, 3, 3}}, {}), 41);
  EXPECT_EQ(PowerSgdElementsPerStep({{32, 1, 3, 3}}, {.matrix_approximation_rank = 4}), 288);
  // A matrix whose row blocks (32 rows at a time) pass 2^31 elements is sent
  // exactly: Debian's OpenBLAS counts lengths in 32-bit ints, which wrapped.
  if (sizeof(blasint) < 8) {
    const int64_t wide = int64_t{INT32_MAX} / 32 + 1;  // 32 rows of it: 2^31 elements
    EXPECT_EQ(PowerSgdElementsPerStep({{64, wide}}, {}), 64 * wide);
    EXPECT_EQ(PowerSgdElementsPerStep({{64, wide - 1}}, {}), 64 + (wide - 1));
  }
}

void ExpectRefused(const PowerSgdOptions& options, const std::string& option) {
  try {
    hooks::PowerSgdHook(options);
    ADD_FAILURE() << option << ": accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("PowerSgdOptions::" + option), std::string::npos) << e.what();
  }
}

TEST(PowerSgdHookTest, OptionsOutOfRangeAreRefusedNamingTheOption) {
  ExpectRefused({.matrix_approximation_rank = 0}, "matrix_approximation_rank");
  ExpectRefused({.matrix_approximation_rank = -2}, "matrix_approximation_rank");
  ExpectRefused({.start_iteration = -1}, "start_iteration");
  ExpectRefused({.min_compression_rate = -0.5}, "min_compression_rate");
  ExpectRefused({.min_compression_rate = std::nan("")}, "min_compression_rate");
  ExpectRefused({.orthogonalization_epsilon = -1e-8}, "orthogonalization_epsilon");
  // Finite in f64 but inf once an f32 bucket converts it.
  ExpectRefused({.orthogonalization_epsilon = 1e39}, "orthogonalization_epsilon");
  ExpectRefused({.orthogonalization_epsilon = std::numeric_limits<double>::infinity()}, "orthogonalization_epsilon");
  try {
    hooks::PowerSgdHook({.matrix_approximation_rank = 0});
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "PowerSgdOptions::matrix_approximation_rank must be at least 1, got 0");
  }
  EXPECT_NO_THROW(hooks::PowerSgdHook({.min_compression_rate = 0, .orthogonalization_epsilon = 1e-8}));
  EXPECT_NO_THROW(hooks::PowerSgdHook({.orthogonalization_epsilon = std::numeric_limits<float>::max()}));
}

// ---------------------------------------------------------- state dict ----

using Named = PowerSgdState::NamedTensors;

// The tensor under `key`, or an undefined one.
Tensor Find(const Named& state, const std::string& key) {
  for (const auto& [k, t] : state) {
    if (k == key) return t;
  }
  return Tensor();
}

// Saved after five steps and loaded into a new state for new parameter
// objects (a restarted process), the state continues bit for bit as the
// one that was never interrupted.
TEST(PowerSgdHookTest, StateRoundTripsAndAResumedHookContinuesBitForBit) {
  auto pg = ProcessGroup::Single();
  for (bool feedback : {false, true}) {
    SCOPED_TRACE(feedback ? "with error feedback" : "without error feedback");
    const PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 2,
                                  .use_error_feedback = feedback};
    const Tensor a = nn::Zeros({16, 12}), restarted = nn::Zeros({16, 12});
    auto state = std::make_shared<PowerSgdState>(options);
    CommHook hook = hooks::PowerSgdHook(state);
    nn::Generator gen(11);
    for (int k = 0; k < 5; ++k) Compress(hook, *pg, a, nn::Randn({16, 12}, {}, gen));
    const Named saved = state->StateDict({{"w", a}}, /*with_residuals=*/true);
    ASSERT_EQ(saved.size(), feedback ? 3u : 2u);
    EXPECT_EQ(Find(saved, "powersgd.iteration").ToVector<int64_t>(), std::vector<int64_t>{5});
    ASSERT_TRUE(Find(saved, "powersgd.q.w").defined());
    EXPECT_EQ(Find(saved, "powersgd.q.w").shape(), (nn::Shape{1, 12}));
    EXPECT_EQ(Find(saved, "powersgd.residual.w").defined(), feedback);
    // Without residuals: the iteration and Q alone.
    EXPECT_EQ(state->StateDict({{"w", a}}).size(), 2u);

    auto resumed_state = std::make_shared<PowerSgdState>(options);
    resumed_state->LoadStateDict(saved, {{"w", restarted}});
    EXPECT_EQ(resumed_state->iteration(), 5);
    // Saved again before any step: the same state.
    const Named again = resumed_state->StateDict({{"w", restarted}}, true);
    ASSERT_EQ(again.size(), saved.size());
    for (const auto& [key, t] : saved) {
      ASSERT_TRUE(Find(again, key).defined()) << key;
      EXPECT_EQ(Find(again, key).ToVector<float>(), t.ToVector<float>()) << key;
    }
    CommHook resumed = hooks::PowerSgdHook(resumed_state);
    for (int k = 0; k < 3; ++k) {
      const Tensor g = nn::Randn({16, 12}, {}, gen);
      EXPECT_EQ(Compress(resumed, *pg, restarted, g).ToVector<float>(), Compress(hook, *pg, a, g).ToVector<float>())
          << "step " << k << " after the resume";
    }
    EXPECT_EQ(resumed_state->iteration(), 8);
  }
}

// A state loaded at an iteration past start_iteration compresses at its
// first call; a new hook with the same options would still be warming up
// (the all-reduce, here on one process the gradient itself).
TEST(PowerSgdHookTest, ResumedPastTheStartCompressesFromTheFirstStep) {
  auto pg = ProcessGroup::Single();
  const PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 1000};
  const Tensor w = nn::Zeros({16, 12});
  const Tensor m = FixedGradient(nn::DType::kFloat32);
  auto fresh_state = std::make_shared<PowerSgdState>(options);
  CommHook fresh = hooks::PowerSgdHook(fresh_state);
  EXPECT_EQ(Compress(fresh, *pg, w, m).ToVector<float>(), m.ToVector<float>());

  auto state = std::make_shared<PowerSgdState>(options);
  state->LoadStateDict({{"powersgd.iteration", nn::FromVectorOf<int64_t>({1005}, {})}}, {{"w", w}});
  CommHook hook = hooks::PowerSgdHook(state);
  const Tensor out = Compress(hook, *pg, w, m);
  EXPECT_LE(RankOneError(out), 1e-5) << "not compressed at the first step after the resume";
  EXPECT_GT(RankOneError(m), 0.1);
  EXPECT_EQ(state->iteration(), 1006);
}

// Each bad input names what is wrong, and a refused load leaves the state
// as it was (its iteration, Q and residuals).
TEST(PowerSgdHookTest, LoadRefusesMismatchesNamingThemAndChangesNothing) {
  auto pg = ProcessGroup::Single();
  const PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 0};
  const Tensor w = nn::Zeros({16, 12}), b = nn::Zeros({16});
  const Named params{{"w", w}, {"b", b}};
  auto state = std::make_shared<PowerSgdState>(options);
  CommHook hook = hooks::PowerSgdHook(state);
  nn::Generator gen(3);
  for (int k = 0; k < 3; ++k) Compress(hook, *pg, w, nn::Randn({16, 12}, {}, gen));
  const Named good = state->StateDict(params, true);
  auto with = [&](const std::string& key, const Tensor& t) {
    Named changed;
    bool replaced = false;
    for (const auto& [k, v] : good) {
      changed.emplace_back(k, k == key ? t : v);
      replaced |= k == key;
    }
    if (!replaced) changed.emplace_back(key, t);
    return changed;
  };
  auto without = [&](const std::string& key) {
    Named changed;
    for (const auto& [k, v] : good) {
      if (k != key) changed.emplace_back(k, v);
    }
    return changed;
  };
  std::vector<double> nan_q(12, 0.1);
  nan_q[4] = std::nan("");
  const std::vector<std::pair<Named, std::string>> cases = {
      {without("powersgd.iteration"), "missing i64 scalar `powersgd.iteration`"},
      {with("powersgd.iteration", nn::FromVector({3.0}, {})), "`powersgd.iteration` is f32 [], expected an i64 scalar"},
      // A scalar entry is 0-d, as StateDict writes it: one element is not enough.
      {with("powersgd.iteration", nn::FromVectorOf<int64_t>({3}, {1})), "`powersgd.iteration` is i64 [1], expected an i64 scalar"},
      {with("powersgd.iteration", nn::FromVectorOf<int64_t>({3}, {1, 1})),
       "`powersgd.iteration` is i64 [1, 1], expected an i64 scalar"},
      {with("powersgd.iteration", nn::FromVectorOf<int64_t>({-1}, {})), "`powersgd.iteration` is -1, below 0"},
      {with("powersgd.iteration", nn::FromVectorOf<int64_t>({std::numeric_limits<int64_t>::max()}, {})),
       "`powersgd.iteration` is the largest i64"},
      {with("powersgd.q.fc.weight", nn::Zeros({1, 12})), "parameter `fc.weight`, which this model does not have"},
      {with("powersgd.q.w", nn::Zeros({2, 12})), "`powersgd.q.w` is [2, 12], parameter `w` [16, 12] needs Q^T [1, 12]"},
      {with("powersgd.q.w", nn::Zeros({1, 12}, {.dtype = nn::DType::kFloat64})), "`powersgd.q.w` is f64, parameter `w` is f32"},
      {with("powersgd.q.w", nn::FromVector(nan_q, {1, 12})), "`powersgd.q.w` holds a value that is not finite"},
      {with("powersgd.q.b", nn::Zeros({1, 1})), "parameter `b` [16] is not compressed under these options"},
      {with("powersgd.residual.w", nn::Zeros({12, 16})), "`powersgd.residual.w` is [12, 16], parameter `w` is [16, 12]"},
      {with("powersgd.p.w", nn::Zeros({1, 16})), "unexpected `powersgd.p.w`"},
  };
  const Named before = state->StateDict(params, true);
  for (const auto& [bad, expected] : cases) {
    try {
      state->LoadStateDict(bad, params);
      ADD_FAILURE() << "accepted; expected: " << expected;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    EXPECT_THROW(state->CheckStateDict(bad, params), std::invalid_argument) << expected;
    EXPECT_EQ(state->iteration(), 3) << expected;
    const Named after = state->StateDict(params, true);
    ASSERT_EQ(after.size(), before.size()) << expected;
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_EQ(after[i].first, before[i].first) << expected;
      EXPECT_EQ(after[i].second.ToVector<double>(), before[i].second.ToVector<double>()) << expected;
    }
  }
  // Settings that keep no Q or no residual refuse them.
  PowerSgdState cold({.matrix_approximation_rank = 1, .warm_start = false});
  EXPECT_THROW(
      {
        try {
          cold.LoadStateDict(good, params);
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("warm_start off"), std::string::npos) << e.what();
          throw;
        }
      },
      std::invalid_argument);
  PowerSgdState plain({.matrix_approximation_rank = 1, .use_error_feedback = false});
  EXPECT_THROW(
      {
        try {
          plain.LoadStateDict(good, params);
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("use_error_feedback off"), std::string::npos) << e.what();
          throw;
        }
      },
      std::invalid_argument);
  EXPECT_EQ(plain.iteration(), 0);
  // A bucket whose parameter the caller does not name cannot be saved.
  EXPECT_THROW(state->StateDict({{"b", b}}), std::invalid_argument);
  EXPECT_THROW(hooks::PowerSgdHook(std::shared_ptr<PowerSgdState>()), std::invalid_argument);
}

// ------------------------------------------ options differ across ranks ----

// One compressed bucket: a [16, 12] weight of values that depend on the
// rank and the step, through `hook`, waited for.
void CompressOnce(ProcessGroup& pg, CommHook& hook, const Tensor& weight, int step) {
  std::vector<double> values(16 * 12);
  for (size_t i = 0; i < values.size(); ++i) values[i] = std::sin(0.37 * i + pg.rank() + 0.11 * step);
  const Tensor buffer = nn::FromVector(values, {16 * 12});
  GradBucket bucket(0, 1, buffer, {weight}, {0});
  hook(pg, bucket).Wait();
}

// Each rank seeds PowerSGD by its rank: the hook's first call compares the
// options and fails on every rank naming the seed (it summed the products
// of unrelated Q's without a word).
DDP_TEST_WORKER(seeds_differ) {
  auto pg = testing::WorkerGroup();
  const Tensor weight = nn::Zeros({16, 12});
  CommHook hook = hooks::PowerSgdHook({.matrix_approximation_rank = 2,
                                       .start_iteration = 0,
                                       .seed = static_cast<uint64_t>(pg->rank())});
  try {
    for (int step = 0; step < 3; ++step) CompressOnce(*pg, hook, weight, step);
    WORKER_EXPECT(false, "seeds 0 and 1 were accepted");
  } catch (const DistributedError& e) {
    const std::string what = e.what();
    std::fprintf(stderr, "rank %d: %s\n", pg->rank(), what.c_str());
    WORKER_EXPECT(what.find("PowerSgdOptions differ: seed differs (0 and 1") != std::string::npos, what);
    WORKER_EXPECT(e.code() == transport::StatusCode::kInvalidArgument, what);
  }
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, RanksWithDifferentSeedsFailNamingTheSeed) {
  auto run = RunWorkers("seeds_differ", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The same for a setting that only matters later (warm_start), and with
// equal options the check passes.
DDP_TEST_WORKER(warm_start_differs) {
  auto pg = testing::WorkerGroup();
  const Tensor weight = nn::Zeros({16, 12});
  CommHook same = hooks::PowerSgdHook({.start_iteration = 0, .seed = 7});
  CompressOnce(*pg, same, weight, 0);
  CommHook hook = hooks::PowerSgdHook({.start_iteration = 5, .warm_start = pg->rank() == 0});
  try {
    for (int step = 0; step < 3; ++step) CompressOnce(*pg, hook, weight, step);
    WORKER_EXPECT(false, "warm_start on one rank alone was accepted");
  } catch (const DistributedError& e) {
    const std::string what = e.what();
    WORKER_EXPECT(what.find("warm_start differs (0 and 1") != std::string::npos, what);
    WORKER_EXPECT(what.find("seed") == std::string::npos, what);
  }
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, RanksWithDifferentWarmStartFailNamingIt) {
  auto run = RunWorkers("warm_start_differs", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// -0.0 and 0.0 are the same setting (both pass the range check, and the
// hook computes alike with either): a rank that wrote its rate or epsilon
// as -0.0 (a negated zero from a config) is not a mismatch. The ranks'
// bit patterns were compared, and the first call failed on every rank
// with "min_compression_rate differs (-0 and 0 among others)".
DDP_TEST_WORKER(signed_zeros_agree) {
  auto pg = testing::WorkerGroup();
  const Tensor weight = nn::Zeros({16, 12});
  const double zero = pg->rank() == 0 ? 0.0 : -0.0;
  CommHook hook = hooks::PowerSgdHook(
      {.start_iteration = 0, .min_compression_rate = zero, .orthogonalization_epsilon = zero});
  try {
    for (int step = 0; step < 3; ++step) CompressOnce(*pg, hook, weight, step);
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("0.0 and -0.0 were taken for different options: ") + e.what());
  }
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, ZeroAndNegativeZeroOptionsAreTheSameOnEveryRank) {
  auto run = RunWorkers("signed_zeros_agree", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ---------------------------------------- rounding the same on every rank ----

// FNV-1a over a tensor's bytes.
uint64_t HashBytes(const Tensor& t) {
  const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < static_cast<size_t>(t.numel()) * nn::ElementSize(t.dtype()); ++i) {
    h = (h ^ bytes[i]) * 1099511628211ull;
  }
  return h;
}

// The ranks run OpenBLAS with 1 and 2 threads (as OPENBLAS_NUM_THREADS
// set per rank would): what the hook computes from the all-reduced P and Q
// (P made orthonormal, P Q^T) must still come out bit for bit the same on
// both, with and without error feedback, or the replicas drift apart.
DDP_TEST_WORKER(blas_threads_differ) {
  auto pg = testing::WorkerGroup();
  openblas_set_num_threads(pg->rank() == 0 ? 1 : 2);
  for (const bool feedback : {true, false}) {
    const Tensor weight = nn::Zeros({384, 640}), second = nn::Zeros({96, 200});
    CommHook hook = hooks::PowerSgdHook(
        {.matrix_approximation_rank = 8, .start_iteration = 0, .use_error_feedback = feedback});
    for (int step = 0; step < 4; ++step) {
      const int64_t a = weight.numel(), b = second.numel();
      std::vector<double> values(static_cast<size_t>(a + b));
      nn::Generator gen(1000 * step + pg->rank() + (feedback ? 0 : 77));
      for (double& v : values) v = gen.NextNormal() * 1e-2;
      const Tensor buffer = nn::FromVector(values, {a + b});
      GradBucket bucket(0, 1, buffer, {weight, second}, {0, a});
      hook(*pg, bucket).Wait();
      WORKER_EXPECT(testing::SameOnAllRanks(*pg, HashBytes(buffer)),
                    std::string("feedback ") + (feedback ? "on" : "off") + ", step " + std::to_string(step) +
                        ": the reduced gradients differ between the ranks");
    }
  }
  return testing::WorkerExit();
}

TEST(PowerSgdHookTest, ReducedGradientsAreBitwiseEqualUnderDifferentBlasThreads) {
  auto run = RunWorkers("blas_threads_differ", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

}  // namespace
}  // namespace ddp::dist
