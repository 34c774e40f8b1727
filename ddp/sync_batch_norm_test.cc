// SyncBatchNorm on N ranks against BatchNorm on the whole batch in one
// process: forward output, input gradient, weight and bias gradients and
// running statistics, for equal, unequal and empty local batches; eval mode
// runs locally and sends nothing; one rank is exactly BatchNorm; DDP with
// SyncBatchNorm matches one process on the concatenated batch; under Join,
// SyncBatchNorm stops every rank with one message; a refused batch (one
// value per channel in all) is not counted in num_batches_tracked; an input
// refused on one rank stops its peers at once with that rank's reason;
// BatchNorm's own errors name the module; the batch count comes from a host
// copy that an outside write (LoadStateDict, Fill, the BatchNorm sharing
// the buffer) refreshes; subgroups each follow BatchNorm on their own
// batch; f64 gradients match central differences; an undefined input and
// training with no group at all are refused naming the layer; converting
// again gives SyncBatchNorm layers already there the new group.

#include "ddp/sync_batch_norm.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <new>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>

#include "ddp/distributed_data_parallel.h"
#include "ddp/testing/ddp_test_util.h"
#include "nn/autograd/engine.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"

namespace ddp::dist {
namespace {

using nn::Tensor;
using testing::RunWorkers;

constexpr int64_t kC = 3, kH = 4, kW = 5;

std::vector<int64_t> ParseSizes(const std::string& text) {
  std::vector<int64_t> sizes;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) sizes.push_back(std::stoll(item));
  return sizes;
}

// Largest |a - b| relative to the largest |b| (absolute when b is all zero).
double RelDiff(const Tensor& a, const Tensor& b) {
  const auto x = a.ToVector<double>(), y = b.ToVector<double>();
  if (x.size() != y.size()) return 1e30;
  double d = 0, s = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    d = std::max(d, std::abs(x[i] - y[i]));
    s = std::max(s, std::abs(y[i]));
  }
  return s > 0 ? d / s : d;
}

// Rows [start, start + n) of dimension 0.
Tensor Rows(const Tensor& t, int64_t start, int64_t n) { return t.Narrow(0, start, n).Contiguous(); }

DDP_TEST_WORKER(sync_bn) {
  auto pg = testing::WorkerGroup();
  // The formulation CUDA inputs take (nn's building blocks), here on CPU
  // tensors.
  if (std::getenv("DDP_TEST_SBN_BLOCKS") != nullptr) internal::SetSyncBatchNormBuildingBlocks(true);
  const std::vector<int64_t> sizes = ParseSizes(std::getenv("DDP_TEST_SIZES"));
  const int rank = pg->rank();
  int64_t total = 0, offset = 0;
  for (int r = 0; r < pg->size(); ++r) {
    if (r == rank) offset = total;
    total += sizes[r];
  }
  const std::string what = "sizes " + std::string(std::getenv("DDP_TEST_SIZES")) + ", rank " +
                           std::to_string(rank);
  nn::Generator gen(42);
  // DDP_TEST_SBN_CUMULATIVE: momentum None (the cumulative average).
  nn::modules::BatchNormOptions options;
  if (std::getenv("DDP_TEST_SBN_CUMULATIVE") != nullptr) options.momentum = std::nullopt;
  auto sync = std::make_shared<SyncBatchNorm>(kC, options, pg);
  auto reference = std::make_shared<nn::modules::BatchNorm2d>(kC, options);
  {
    nn::NoGradGuard guard;
    Tensor w = nn::Randn({kC}, {}, gen), b = nn::Randn({kC}, {}, gen);
    sync->weight().CopyFrom(w);
    sync->bias().CopyFrom(b);
    reference->weight().CopyFrom(w);
    reference->bias().CopyFrom(b);
  }
  for (int iteration = 0; iteration < 2; ++iteration) {
    // The whole batch, the same on every rank; each rank takes its rows.
    // DDP_TEST_SBN_OFFSET: the channels' mean (5 unless given), against a
    // spread of 3; 1e7 makes sum(x^2) / n - mean^2 cancel.
    const char* offset_env = std::getenv("DDP_TEST_SBN_OFFSET");
    const double shift = offset_env != nullptr ? std::atof(offset_env) : 5.0;
    Tensor x_all = nn::Randn({total, kC, kH, kW}, {}, gen) * 3.0 + shift;
    Tensor g_all = nn::Randn({total, kC, kH, kW}, {}, gen);
    Tensor x = Rows(x_all, offset, sizes[rank]).Detach().set_requires_grad(true);
    Tensor y = (*sync)(x);
    // Sum, not mean: each rank's loss is its part of the whole batch's.
    nn::Backward(nn::ops::Sum(y * Rows(g_all, offset, sizes[rank])));

    Tensor xr = x_all.Detach().set_requires_grad(true);
    Tensor yr = (*reference)(xr);
    nn::Backward(nn::ops::Sum(yr * g_all));

    WORKER_EXPECT(RelDiff(y, Rows(yr.Detach(), offset, sizes[rank])) < 1e-5, what + ": forward differs");
    WORKER_EXPECT(RelDiff(x.grad(), Rows(xr.grad(), offset, sizes[rank])) < 1e-5,
                  what + ": input gradient differs by " +
                      std::to_string(RelDiff(x.grad(), Rows(xr.grad(), offset, sizes[rank]))));
    // Weight and bias gradients are per rank; their sum is the whole batch's.
    Tensor dw = sync->weight().grad().Clone(), db = sync->bias().grad().Clone();
    pg->AllReduce(dw).Wait();
    pg->AllReduce(db).Wait();
    WORKER_EXPECT(RelDiff(dw, reference->weight().grad()) < 1e-5, what + ": weight gradient differs");
    WORKER_EXPECT(RelDiff(db, reference->bias().grad()) < 1e-5, what + ": bias gradient differs");
    WORKER_EXPECT(RelDiff(sync->running_mean(), reference->running_mean()) < 1e-6, what + ": running mean");
    WORKER_EXPECT(RelDiff(sync->running_var(), reference->running_var()) < 1e-6, what + ": running var");
    WORKER_EXPECT(sync->num_batches_tracked().Item() == iteration + 1, what + ": batches tracked");
    sync->weight().set_grad(Tensor());
    sync->bias().set_grad(Tensor());
    reference->weight().set_grad(Tensor());
    reference->bias().set_grad(Tensor());
  }
  // Eval: the running statistics, locally; no collective at all.
  sync->Eval();
  reference->Eval();
  const uint64_t before = pg->collectives_run();
  Tensor x = nn::Randn({sizes[rank], kC, kH, kW}, {}, gen);
  Tensor y = (*sync)(x);
  WORKER_EXPECT(pg->collectives_run() == before, what + ": eval ran " +
                                                     std::to_string(pg->collectives_run() - before) +
                                                     " collective(s)");
  WORKER_EXPECT(RelDiff(y, (*reference)(x)) < 1e-6, what + ": eval output differs");
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, MatchesBatchNormOnTheWholeBatch) {
  for (const char* sizes : {"4,4", "3,6,1", "5,0", "0,2,7"}) {
    const int world = static_cast<int>(ParseSizes(sizes).size());
    auto run = RunWorkers("sync_bn", world, {{"DDP_TEST_SIZES", sizes}});
    EXPECT_TRUE(run.AllSucceeded()) << sizes << "\n" << testing::AllOutput(run);
  }
  auto run = RunWorkers("sync_bn", 3, {{"DDP_TEST_SIZES", "3,6,1"}, {"DDP_TEST_SBN_CUMULATIVE", "1"}});
  EXPECT_TRUE(run.AllSucceeded()) << "momentum None\n" << testing::AllOutput(run);
}

TEST(SyncBatchNormTest, DeviceFormulationMatchesBatchNormOnTheWholeBatch) {
  for (const char* sizes : {"4,4", "3,6,1", "5,0", "0,2,7"}) {
    const int world = static_cast<int>(ParseSizes(sizes).size());
    auto run = RunWorkers("sync_bn", world, {{"DDP_TEST_SIZES", sizes}, {"DDP_TEST_SBN_BLOCKS", "1"}});
    EXPECT_TRUE(run.AllSucceeded()) << sizes << "\n" << testing::AllOutput(run);
  }
}

// Channels whose mean is millions of times their spread: the statistics
// must not come from sums of x and x^2 (E[x^2] - E[x]^2 cancels), on the
// host path and on the device formulation alike.
TEST(SyncBatchNormTest, ALargeMeanDoesNotCancelTheVariance) {
  for (const char* blocks : {"", "1"}) {
    std::vector<std::pair<std::string, std::string>> env = {{"DDP_TEST_SIZES", "3,6,1"},
                                                             {"DDP_TEST_SBN_OFFSET", "1e7"}};
    if (*blocks != '\0') env.emplace_back("DDP_TEST_SBN_BLOCKS", blocks);
    auto run = RunWorkers("sync_bn", 3, env);
    EXPECT_TRUE(run.AllSucceeded()) << (*blocks ? "device formulation" : "host") << "\n" << testing::AllOutput(run);
  }
}

// 16-bit inputs whose channel mean is large against their spread: the
// device formulation's statistics must agree with the host path's, which
// sums the inputs' exact values in f64 (it rounded each x - mean to the
// input's 16 bits first, a relative error of 2^-8 in every deviation).
DDP_TEST_WORKER(sync_bn_bf16_stats) {
  auto pg = testing::WorkerGroup();
  nn::Generator gen(7 + pg->rank());
  const Tensor x = (nn::Randn({6, kC, kH, kW}, {}, gen) * 0.7 + 100.0).To(nn::DType::kBFloat16);
  std::vector<Tensor> vars;
  for (bool blocks : {false, true}) {
    internal::SetSyncBatchNormBuildingBlocks(blocks);
    auto sync = std::make_shared<SyncBatchNorm>(kC, nn::modules::BatchNormOptions{.momentum = 1.0}, pg);
    nn::NoGradGuard guard;
    (void)(*sync)(x);
    vars.push_back(sync->running_var().To(nn::DType::kFloat64));
  }
  internal::SetSyncBatchNormBuildingBlocks(false);
  const double diff = RelDiff(vars[1], vars[0]);
  WORKER_EXPECT(diff < 1e-6, "the device formulation's running variance differs from the host path's by " +
                                 std::to_string(diff));
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, SixteenBitStatisticsOfTheDeviceFormulationMatchTheHostPath) {
  auto run = RunWorkers("sync_bn_bf16_stats", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A CNN with BatchNorm, converted and wrapped: N ranks with equal batches
// follow one process with BatchNorm on the concatenated batch. The
// convolution has no bias: BatchNorm cancels it, so its gradient would be
// pure rounding noise (the usual layout before BatchNorm, too).
std::shared_ptr<nn::modules::Sequential> BnCnn() {
  nn::Generator gen(8);
  using nn::modules::Module;
  return std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<nn::modules::Conv2d>(1, 8, 3, nn::modules::Conv2dOptions{.bias = false}, gen),
      std::make_shared<nn::modules::BatchNorm2d>(8), std::make_shared<nn::modules::ReLU>(),
      std::make_shared<nn::modules::MaxPool2d>(2), std::make_shared<nn::modules::Flatten>(),
      std::make_shared<nn::modules::Linear>(8 * 13 * 13, 10, true, gen)});
}

DDP_TEST_WORKER(sync_bn_ddp) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  constexpr int64_t kB = 6;
  auto model = ConvertSyncBatchNorm(BnCnn(), pg);
  DistributedDataParallel ddp(model, {.process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto reference = BnCnn();
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  for (int s = 0; s < 5; ++s) {
    auto [x, y] = testing::Batch(data, (s * world + rank) * kB, kB);
    opt.ZeroGrad();
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    opt.Step();
    auto [xa, ya] = testing::Batch(data, s * world * kB, world * kB);
    ref_opt.ZeroGrad();
    nn::Backward(nn::loss::CrossEntropy((*reference)(xa), ya));
    ref_opt.Step();
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff < 1e-5, "`" + worst + "` differs by " + std::to_string(diff));
  const auto a = model->NamedBuffers(), b = reference->NamedBuffers();
  for (size_t i = 0; i < a.size(); ++i) {
    WORKER_EXPECT(RelDiff(a[i].second, b[i].second) < 1e-5, "buffer `" + a[i].first + "` differs");
  }
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), "replicas differ");
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, DdpWithSyncBatchNormMatchesOneProcess) {
  auto run = RunWorkers("sync_bn_ddp", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Join with SyncBatchNorm: once rank 0 runs out of batches, rank 1's next
// forward would gather statistics while rank 0 shadows a bucket
// reduction. Every rank stops with one message naming the module and the
// rank that ran out, and nothing waits out a deadline.
DDP_TEST_WORKER(sync_bn_join) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  constexpr int64_t kB = 6;
  // DDP_TEST_CASE=eval_wrapper: the wrapper in eval mode (forwards without
  // grad) while the SyncBatchNorm modules are put back in training mode;
  // they still gather in forward. solo_groups: each rank's SyncBatchNorm
  // layers have a group of that rank alone, so they gather nothing and
  // Join runs to its end.
  const char* which = std::getenv("DDP_TEST_CASE");
  const bool eval_wrapper = which != nullptr && std::string(which) == "eval_wrapper";
  const bool solo_groups = which != nullptr && std::string(which) == "solo_groups";
  std::shared_ptr<ProcessGroup> mine = pg;
  if (solo_groups) {
    for (int r = 0; r < world; ++r) {
      if (auto group = pg->NewGroup({r})) mine = group;
    }
  }
  auto model = ConvertSyncBatchNorm(BnCnn(), mine);
  DistributedDataParallel ddp(model, {.process_group = pg});
  if (eval_wrapper) {
    ddp.Eval();
    model->Apply([](nn::modules::Module& m) {
      if (m.TypeName() == "SyncBatchNorm") m.Train();
    });
  }
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  try {
    Join join(ddp);
    for (int s = 0; s < 2 + 2 * rank; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kB, kB);
      if (eval_wrapper) {
        nn::NoGradGuard no_grad;
        ddp(x);
      } else {
        nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      }
    }
    join.Wait();
  } catch (const std::exception& e) {
    message = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (solo_groups) {
    WORKER_EXPECT(message.empty(), "rank " + std::to_string(rank) + ": " + message);
  } else {
    WORKER_EXPECT(message.find("Join: rank(s) 0 ran out of inputs, and module `") != std::string::npos &&
                      message.find("(SyncBatchNorm, in training mode)") != std::string::npos,
                  "rank " + std::to_string(rank) + ": " + message);
  }
  WORKER_EXPECT(seconds < 20, "took " + std::to_string(seconds) + " s");
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, JoinStopsEveryRankNamingTheModule) {
  for (const char* which : {"train", "eval_wrapper"}) {
    auto run = RunWorkers("sync_bn_join", 2, {{"DDP_TEST_TIMEOUT_MS", "60000"}, {"DDP_TEST_CASE", which}});
    EXPECT_TRUE(run.AllSucceeded()) << which << "\n" << testing::AllOutput(run);
  }
}

// SyncBatchNorm layers over a group of one rank gather nothing, so Join
// does not stop for them (it did: the guard looked at the type only).
TEST(SyncBatchNormTest, JoinRunsToItsEndWhenTheLayersHaveOneRankGroups) {
  auto run = RunWorkers("sync_bn_join", 2, {{"DDP_TEST_TIMEOUT_MS", "60000"}, {"DDP_TEST_CASE", "solo_groups"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(SyncBatchNormTest, OneRankIsBatchNorm) {
  auto pg = ProcessGroup::Single();
  nn::Generator gen(3);
  auto bn = std::make_shared<nn::modules::BatchNorm2d>(kC);
  auto sync = SyncBatchNorm::FromBatchNorm(*std::make_shared<nn::modules::BatchNorm2d>(kC), pg);
  Tensor x = nn::Randn({6, kC, kH, kW}, {}, gen);
  Tensor g = nn::Randn({6, kC, kH, kW}, {}, gen);
  Tensor x1 = x.Clone().set_requires_grad(true), x2 = x.Clone().set_requires_grad(true);
  Tensor y1 = (*bn)(x1), y2 = (*sync)(x2);
  nn::Backward(nn::ops::Sum(y1 * g));
  nn::Backward(nn::ops::Sum(y2 * g));
  EXPECT_EQ(y1.ToVector<float>(), y2.ToVector<float>());
  EXPECT_EQ(x1.grad().ToVector<float>(), x2.grad().ToVector<float>());
  EXPECT_EQ(bn->weight().grad().ToVector<float>(), sync->weight().grad().ToVector<float>());
  EXPECT_EQ(bn->running_var().ToVector<float>(), sync->running_var().ToVector<float>());
  EXPECT_EQ(sync->num_batches_tracked().Item(), 1);
}

// A global batch of one value per channel is refused on every rank, and
// leaves num_batches_tracked (and the running statistics) as they were:
// the batch was not counted. Rank 0 holds the one sample, rank 1 none.
DDP_TEST_WORKER(sync_bn_one_value) {
  auto pg = testing::WorkerGroup();
  if (std::getenv("DDP_TEST_SBN_BLOCKS") != nullptr) internal::SetSyncBatchNormBuildingBlocks(true);
  SyncBatchNorm sync(kC, {}, pg);
  const Tensor x = nn::Ones({pg->rank() == 0 ? 1 : 0, kC});
  try {
    sync(x);
    WORKER_EXPECT(false, "a global batch of one value was accepted on rank " + std::to_string(pg->rank()));
  } catch (const std::invalid_argument& e) {
    // Named once ("SyncBatchNorm(3): SyncBatchNorm: expected ..." before).
    WORKER_EXPECT(std::string(e.what()).rfind("SyncBatchNorm(3): expected more than 1 value per channel across all "
                                              "ranks when training, got 1 (input [",
                                              0) == 0,
                  e.what());
  }
  WORKER_EXPECT(sync.num_batches_tracked().Item() == 0,
                "num_batches_tracked is " + std::to_string(sync.num_batches_tracked().Item()) + " on rank " +
                    std::to_string(pg->rank()));
  WORKER_EXPECT(sync.running_mean().ToVector<double>() == std::vector<double>(kC, 0.0), "running mean moved");
  // A good batch afterwards counts as the first.
  sync(nn::Ones({2, kC}));
  WORKER_EXPECT(sync.num_batches_tracked().Item() == 1, "the next batch was not counted once");
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, RefusedBatchIsNotCounted) {
  for (bool blocks : {false, true}) {
    std::vector<std::pair<std::string, std::string>> env;
    if (blocks) env.emplace_back("DDP_TEST_SBN_BLOCKS", "1");
    auto run = RunWorkers("sync_bn_one_value", 2, env);
    EXPECT_TRUE(run.AllSucceeded()) << (blocks ? "building blocks\n" : "") << testing::AllOutput(run);
  }
  // One rank: BatchNorm's own check.
  SyncBatchNorm sync(kC, {}, ProcessGroup::Single());
  EXPECT_THROW(sync(nn::Ones({1, kC})), std::invalid_argument);
  EXPECT_EQ(sync.num_batches_tracked().Item(), 0);
}

// As BatchNorm's: the refused feature count is shown.
TEST(SyncBatchNormTest, ANonPositiveFeatureCountIsShown) {
  try {
    SyncBatchNorm sync(-3, {}, ProcessGroup::Single());
    ADD_FAILURE() << "constructed";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "SyncBatchNorm: num_features must be positive, got -3");
  }
}

// The batch count in num_batches_tracked, on one rank (BatchNorm's path)
// and on two (the host formulation or the building blocks). With momentum
// None the factor is 1 / count, so the running mean shows which count a
// forward used; every batch is constant, its mean its value.
// DDP_TEST_SBN_RAW_WRITE: the forward counts from the layer's host copy (on
// a GPU, reading the buffer waits for all queued work): a write that
// bypasses the storage's version (raw memory) is not seen. Otherwise: the
// copy is read again after every write that bumps the version:
// LoadStateDict, Fill, and a forward of the BatchNorm the layer was
// converted from, which shares the buffer.
DDP_TEST_WORKER(sync_bn_count) {
  auto pg = testing::WorkerGroup();
  if (std::getenv("DDP_TEST_SBN_BLOCKS") != nullptr) internal::SetSyncBatchNormBuildingBlocks(true);
  const std::string where = "world " + std::to_string(pg->size()) + ", rank " + std::to_string(pg->rank());
  auto bn = std::make_shared<nn::modules::BatchNorm2d>(kC, nn::modules::BatchNormOptions{.momentum = std::nullopt});
  const auto sync = SyncBatchNorm::FromBatchNorm(*bn, pg);
  const auto batch = [](double v) { return nn::Full({2, kC, 2, 2}, v); };
  const auto expect = [&](double count, double mean, const std::string& step) {
    const double got = sync->num_batches_tracked().Item();
    WORKER_EXPECT(got == count, where + ", " + step + ": num_batches_tracked is " + std::to_string(got) +
                                    ", expected " + std::to_string(count));
    for (float m : sync->running_mean().ToVector<float>()) {
      WORKER_EXPECT(std::abs(m - mean) < 1e-5, where + ", " + step + ": running mean " + std::to_string(m) +
                                                   ", expected " + std::to_string(mean));
    }
  };
  (*sync)(batch(1.0));
  (*sync)(batch(1.0));
  expect(2, 1.0, "two batches");
  if (std::getenv("DDP_TEST_SBN_RAW_WRITE") != nullptr) {
    *static_cast<int64_t*>(sync->num_batches_tracked().data_ptr()) = 100;  // no version bump
    // Counted from the copy: 3, factor 1/3: 1 + (4 - 1) / 3 = 2.
    (*sync)(batch(4.0));
    expect(3, 2.0, "after a raw write (the forward read the buffer back)");
    return testing::WorkerExit();
  }
  // LoadStateDict: 10, so this batch is the 11th: 1 + (12 - 1) / 11 = 2.
  nn::modules::StateDict state = sync->GetStateDict();
  for (auto& [name, t] : state) {
    if (name == "num_batches_tracked") t = nn::Full({}, 10.0, {.dtype = nn::DType::kInt64});
  }
  sync->LoadStateDict(state);
  (*sync)(batch(12.0));
  expect(11, 2.0, "after LoadStateDict");
  // The BatchNorm, on the shared buffers: the 12th, 2 + (14 - 2) / 12 = 3;
  // then the layer the 13th, 3 + (16 - 3) / 13 = 4.
  (*bn)(batch(14.0));
  expect(12, 3.0, "after the BatchNorm's forward");
  (*sync)(batch(16.0));
  expect(13, 4.0, "after the BatchNorm's forward and the layer's");
  // Fill: 19, so the 20th: 4 + (24 - 4) / 20 = 5.
  {
    nn::NoGradGuard guard;
    sync->num_batches_tracked().Fill(19.0);
  }
  (*sync)(batch(24.0));
  expect(20, 5.0, "after Fill");
  sync->Eval();
  (*sync)(batch(0.0));
  expect(20, 5.0, "after an eval forward");
  return testing::WorkerExit();
}

// Guards the behaviour before the host copy (each forward read the
// buffer): a count written from outside is the one the next batch follows.
TEST(SyncBatchNormTest, CountIsReadAgainAfterAnOutsideWrite) {
  for (const auto& [world, blocks] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
    std::vector<std::pair<std::string, std::string>> env;
    if (blocks) env.emplace_back("DDP_TEST_SBN_BLOCKS", "1");
    auto run = RunWorkers("sync_bn_count", world, env);
    EXPECT_TRUE(run.AllSucceeded()) << "world " << world << (blocks ? ", building blocks\n" : "\n")
                                    << testing::AllOutput(run);
  }
}

TEST(SyncBatchNormTest, CountsBatchesWithoutReadingTheBufferBack) {
  for (const auto& [world, blocks] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
    std::vector<std::pair<std::string, std::string>> env = {{"DDP_TEST_SBN_RAW_WRITE", "1"}};
    if (blocks) env.emplace_back("DDP_TEST_SBN_BLOCKS", "1");
    auto run = RunWorkers("sync_bn_count", world, env);
    EXPECT_TRUE(run.AllSucceeded()) << "world " << world << (blocks ? ", building blocks\n" : "\n")
                                    << testing::AllOutput(run);
  }
}

TEST(SyncBatchNormTest, ConvertReplacesEveryBatchNormKeepingTensors) {
  auto model = nn::modules::MakeResNet18({.num_classes = 10, .stem = nn::modules::ResNetStem::kCifar});
  const auto before = model->GetStateDict();
  int batch_norms = 0;
  for (auto& [path, m] : model->NamedModules()) batch_norms += dynamic_cast<nn::modules::BatchNorm*>(m) != nullptr;
  ASSERT_GT(batch_norms, 10);
  model->Eval();
  auto converted = ConvertSyncBatchNorm(model, ProcessGroup::Single());
  EXPECT_EQ(converted.get(), model.get());
  int left = 0, synced = 0;
  for (auto& [path, m] : converted->NamedModules()) {
    left += dynamic_cast<nn::modules::BatchNorm*>(m) != nullptr;
    if (auto* s = dynamic_cast<SyncBatchNorm*>(m)) {
      ++synced;
      EXPECT_FALSE(s->is_training()) << path;
    }
  }
  EXPECT_EQ(left, 0);
  EXPECT_EQ(synced, batch_norms);
  const auto after = converted->GetStateDict();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(before[i].first, after[i].first);
    // State-dict entries are detached handles (as PyTorch's), a new object
    // each call: the same memory means the same tensor was kept.
    EXPECT_EQ(before[i].second.data_ptr(), after[i].second.data_ptr()) << before[i].first << " is a new tensor";
  }
  // As BatchNorm, the converted layers load a state without their
  // num_batches_tracked (a checkpoint of older code, exported weights).
  nn::modules::StateDict without_counts;
  for (const auto& [name, t] : after) {
    if (name.find("num_batches_tracked") == std::string::npos) without_counts.emplace_back(name, t);
  }
  ASSERT_EQ(without_counts.size() + batch_norms, after.size());
  EXPECT_TRUE(converted->LoadStateDict(without_counts).missing.empty());
  // A BatchNorm root becomes a SyncBatchNorm.
  auto root = ConvertSyncBatchNorm(std::make_shared<nn::modules::BatchNorm1d>(4));
  EXPECT_NE(dynamic_cast<SyncBatchNorm*>(root.get()), nullptr);
}

// Rank 0 converts and rank 1 does not: the parameters and buffers agree,
// so only the modules' types tell the replicas apart. Both ranks refuse at
// construction naming the layer (unchecked, rank 0's all-gather waited for
// rank 1 until the group's timeout).
DDP_TEST_WORKER(sync_bn_converted_on_one_rank) {
  auto pg = testing::WorkerGroup();
  std::shared_ptr<nn::modules::Module> model = BnCnn();
  if (pg->rank() == 0) model = ConvertSyncBatchNorm(model, pg);
  std::string message = "no error";
  try {
    DistributedDataParallel ddp(model, {.process_group = pg});
    const auto& data = testing::FashionMnist();
    auto [x, y] = testing::Batch(data, 0, 8);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::exception& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("the ranks' models differ") != std::string::npos, message);
  WORKER_EXPECT(message.find("rank 0 has `1` SyncBatchNorm; rank 1 has `1` BatchNorm2d") != std::string::npos,
                message);
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, ConvertingOnOneRankIsRefusedAtConstruction) {
  auto run = RunWorkers("sync_bn_converted_on_one_rank", 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Two layers of one width, rank r running layer r: their collectives have
// the same shapes, so only their labels tell them apart. With
// DDP_DEBUG=detail both ranks stop with a desync naming both layers
// (unlabelled, the two all-gathers paired and both ranks went on).
DDP_TEST_WORKER(sync_bn_layers_desync) {
  auto pg = testing::WorkerGroup();
  auto model = std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<nn::modules::Module>>{
      std::make_shared<SyncBatchNorm>(kC, nn::modules::BatchNormOptions{}, pg),
      std::make_shared<SyncBatchNorm>(kC, nn::modules::BatchNormOptions{}, pg)});
  std::string message = "no error";
  try {
    model->at(pg->rank())->Forward(nn::Randn({4, kC}));
  } catch (const DistributedError& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("desync") != std::string::npos, message);
  WORKER_EXPECT(message.find("SyncBatchNorm(3) `0`") != std::string::npos, message);
  WORKER_EXPECT(message.find("SyncBatchNorm(3) `1`") != std::string::npos, message);
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, DetailModeTellsLayersOfOneWidthApart) {
  auto run = RunWorkers("sync_bn_layers_desync", 2, {{"DDP_DEBUG", "detail"}, {"DDP_TEST_TIMEOUT_MS", "10000"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A parent that keeps the BatchNorm RegisterModule returned and calls it
// from a member would keep running the local layer after conversion: the
// conversion refuses it, naming the path, and changes nothing.
class HoldsItsBatchNorm : public nn::modules::Module {
 public:
  HoldsItsBatchNorm() { bn_ = RegisterModule("bn", std::make_shared<nn::modules::BatchNorm1d>(kC)); }
  Tensor Forward(const Tensor& x) override { return bn_->Forward(x); }
  using Module::Forward;
  std::string TypeName() const override { return "HoldsItsBatchNorm"; }

 private:
  std::shared_ptr<nn::modules::BatchNorm1d> bn_;
};

// The same layer, looked up by name at each forward.
class LooksItsBatchNormUp : public nn::modules::Module {
 public:
  LooksItsBatchNormUp() { RegisterModule("bn", std::make_shared<nn::modules::BatchNorm1d>(kC)); }
  Tensor Forward(const Tensor& x) override { return Child("bn")->Forward(x); }
  using Module::Forward;
  std::string TypeName() const override { return "LooksItsBatchNormUp"; }
};

TEST(SyncBatchNormTest, ConvertRefusesABatchNormHeldOutsideTheRegistry) {
  auto model = std::make_shared<nn::modules::Sequential>(
      std::initializer_list<std::shared_ptr<nn::modules::Module>>{
          std::make_shared<LooksItsBatchNormUp>(), std::make_shared<HoldsItsBatchNorm>()});
  try {
    ConvertSyncBatchNorm(model, ProcessGroup::Single());
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("`1.bn`"), std::string::npos) << message;
    EXPECT_EQ(message.find("`0.bn`"), std::string::npos) << message;
    EXPECT_NE(message.find("look the child up by name"), std::string::npos) << message;
  }
  // Nothing was replaced, the by-name layer included.
  for (auto& [path, m] : model->NamedModules()) {
    EXPECT_EQ(dynamic_cast<SyncBatchNorm*>(m), nullptr) << path;
  }

  // The by-name module alone converts, and its forward uses the new layer.
  auto by_name = std::make_shared<LooksItsBatchNormUp>();
  ConvertSyncBatchNorm(by_name, ProcessGroup::Single());
  EXPECT_NE(dynamic_cast<SyncBatchNorm*>(by_name->Child("bn").get()), nullptr);
  EXPECT_EQ(by_name->Forward(nn::Ones({4, kC})).shape(), (std::vector<int64_t>{4, kC}));
}

// A BatchNorm registered at two paths (shared) becomes one SyncBatchNorm
// registered at both.
TEST(SyncBatchNormTest, ConvertKeepsASharedBatchNormShared) {
  auto bn = std::make_shared<nn::modules::BatchNorm1d>(kC);
  auto model = std::make_shared<nn::modules::Sequential>(
      std::initializer_list<std::shared_ptr<nn::modules::Module>>{bn, std::make_shared<nn::modules::ReLU>(), bn});
  bn.reset();
  ConvertSyncBatchNorm(model, ProcessGroup::Single());
  auto first = model->at(0), last = model->at(2);
  EXPECT_NE(dynamic_cast<SyncBatchNorm*>(first.get()), nullptr);
  EXPECT_EQ(first.get(), last.get());
}

// A SyncBatchNorm already in the tree (built as one, or converted before)
// takes the group of the new conversion, as PyTorch's
// convert_sync_batchnorm makes every batch-norm layer, SyncBatchNorm
// included, use its process_group (it kept its old group, so the layer
// went on synchronizing over ranks the caller had left out). A refused
// conversion changes no layer's group either.
TEST(SyncBatchNormTest, ConvertGivesExistingSyncBatchNormsTheNewGroup) {
  const auto old_group = ProcessGroup::Single(), new_group = ProcessGroup::Single();
  auto model = std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<nn::modules::Module>>{
      std::make_shared<SyncBatchNorm>(kC, nn::modules::BatchNormOptions{}, old_group),
      std::make_shared<nn::modules::BatchNorm1d>(kC)});
  const nn::Tensor weight = dynamic_cast<SyncBatchNorm&>(*model->at(0)).weight();
  ConvertSyncBatchNorm(model, new_group);
  for (int i = 0; i < 2; ++i) {
    auto* sync = dynamic_cast<SyncBatchNorm*>(model->at(i).get());
    ASSERT_NE(sync, nullptr) << i;
    EXPECT_EQ(sync->group().get(), new_group.get()) << "layer " << i << " kept another group";
  }
  EXPECT_EQ(dynamic_cast<SyncBatchNorm&>(*model->at(0)).weight().data_ptr(), weight.data_ptr());
  // Null: the default group, for the layers already synchronized too.
  ConvertSyncBatchNorm(model);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(dynamic_cast<SyncBatchNorm&>(*model->at(i)).group().get(), nullptr) << i;

  // A SyncBatchNorm root.
  auto root = std::make_shared<SyncBatchNorm>(kC, nn::modules::BatchNormOptions{}, old_group);
  EXPECT_EQ(dynamic_cast<SyncBatchNorm&>(*ConvertSyncBatchNorm(root, new_group)).group().get(), new_group.get());

  // Refused (a BatchNorm held outside the registry): the SyncBatchNorm keeps its group.
  auto refused = std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<nn::modules::Module>>{
      std::make_shared<SyncBatchNorm>(kC, nn::modules::BatchNormOptions{}, old_group),
      std::make_shared<HoldsItsBatchNorm>()});
  EXPECT_THROW(ConvertSyncBatchNorm(refused, new_group), std::invalid_argument);
  EXPECT_EQ(dynamic_cast<SyncBatchNorm&>(*refused->at(0)).group().get(), old_group.get());
}

// Its own running-statistics update takes the momentum unchecked: a bad
// one fails at construction, as BatchNorm's does.
TEST(SyncBatchNormTest, BadEpsOrMomentumIsNamedAtConstruction) {
  auto error = [](const nn::modules::BatchNormOptions& options) {
    try {
      SyncBatchNorm sync(4, options, ProcessGroup::Single());
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error({.momentum = 2.0}),
            "SyncBatchNorm: BatchNormOptions::momentum must be in [0, 1] (or nullopt), got 2");
  EXPECT_EQ(error({.eps = -1e-5}), "SyncBatchNorm: BatchNormOptions::eps must be finite and > 0, got -1e-05");
  EXPECT_EQ(error({.momentum = std::nullopt}), "");
}

// One forward of `sync`: its error message ("" when none) and its seconds.
std::pair<std::string, double> TimedForward(SyncBatchNorm& sync, const Tensor& x) {
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  try {
    sync(x);
  } catch (const std::exception& e) {
    message = e.what();
  }
  return {message, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

// Rank 0 writes DDP_TEST_SBN_DONE_FILE; the others wait for it (at most
// `seconds`), so that no other rank's exit is what ends rank 0's wait.
void MeetAtDoneFile(int rank, int seconds) {
  const std::string done_file = std::getenv("DDP_TEST_SBN_DONE_FILE");
  if (rank == 0) {
    std::ofstream(done_file) << "done\n";
    return;
  }
  for (int i = 0; i < 10 * seconds && !std::ifstream(done_file).good(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// A path for MeetAtDoneFile, unique to this test process and `tag`, not there yet.
std::string FreshDoneFile(const std::string& tag) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/sync_bn_" + tag + "_" + std::to_string(::getpid());
  std::remove(path.c_str());
  return path;
}

// Rank 1's input is refused (DDP_TEST_SBN_BAD: "channels", a wrong channel
// count; "dtype", an integer input; "undefined", no tensor at all) before
// the statistics' collective,
// which rank 0 has already entered. Rank 1 throws naming the problem, and
// rank 0 stops at once with rank 1's reason instead of waiting out the
// group's timeout (20 s here). Rank 1 stays up after its error until rank
// 0 has its own (it writes DDP_TEST_SBN_DONE_FILE), at most 15 s, as a
// trainer that catches the error would: its exit alone would have told
// rank 0 (PEER_LOST), without the reason.
DDP_TEST_WORKER(sync_bn_refused_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const std::string bad = std::getenv("DDP_TEST_SBN_BAD");
  if (std::getenv("DDP_TEST_SBN_BLOCKS") != nullptr) internal::SetSyncBatchNormBuildingBlocks(true);
  const int rank = pg->rank();
  SyncBatchNorm sync(kC, {}, pg);
  Tensor x = nn::Ones({4, kC, kH});
  if (rank == 1) {
    x = bad == "channels" ? nn::Ones({4, kC + 1, kH})
        : bad == "dtype"  ? nn::Ones({4, kC, kH}, {.dtype = nn::DType::kInt64})
                          : Tensor();
  }
  const std::string problem = bad == "channels" ? "expected input [N, 3, ...], got [4, 4, 4]"
                              : bad == "dtype"  ? "expected a floating-point input, got dtype i64"
                                                : "input is undefined";
  const auto [message, seconds] = TimedForward(sync, x);
  MeetAtDoneFile(rank, 15);
  const std::string what = bad + ", rank " + std::to_string(rank) + ": ";
  WORKER_EXPECT(!message.empty(), what + "no error");
  WORKER_EXPECT(message.find(problem) != std::string::npos, what + message);
  WORKER_EXPECT(message.find("SyncBatchNorm") != std::string::npos, what + "the module is not named: " + message);
  if (rank == 0) {
    WORKER_EXPECT(message.find("on rank 1") != std::string::npos, what + "rank 1 is not named: " + message);
  }
  WORKER_EXPECT(seconds < 10, what + "took " + std::to_string(seconds) + " s");
  return testing::WorkerExit();
}

// A forward that fails on one rank while it computes its local statistics
// (device memory ran out, say), before it joins the gather: the rank aborts
// the group with the cause, so the peer, already waiting in the gather,
// fails at once naming it instead of at the group's timeout (20 s here).
DDP_TEST_WORKER(sync_bn_forward_fails_on_one_rank) {
  auto pg = testing::WorkerGroup();
  if (std::getenv("DDP_TEST_SBN_BLOCKS") != nullptr) internal::SetSyncBatchNormBuildingBlocks(true);
  const int rank = pg->rank();
  SyncBatchNorm sync(kC, {}, pg);
  const Tensor x = nn::Randn({4, kC, kH});
  (void)sync(x);  // one good forward first: the failure is not the connections'
  if (rank == 1) internal::FailNextSyncBatchNormForwardForTesting();
  const auto [message, seconds] = TimedForward(sync, x);
  // Rank 1 stays alive (as a trainer handling the error would) until rank 0
  // is done: its exit must not be what stops rank 0.
  MeetAtDoneFile(rank, 30);
  const std::string what = "rank " + std::to_string(rank) + ": ";
  WORKER_EXPECT(!message.empty(), what + "no error");
  if (rank == 0) {
    WORKER_EXPECT(message.find("forward on rank 1 failed: std::bad_alloc") != std::string::npos, what + message);
  }
  WORKER_EXPECT(seconds < 10, what + "took " + std::to_string(seconds) + " s: " + message);
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, AForwardThatFailsOnOneRankStopsThePeersAtOnce) {
  for (bool blocks : {false, true}) {
    const std::string done_file = FreshDoneFile(blocks ? "forward_fails_blocks" : "forward_fails");
    std::vector<std::pair<std::string, std::string>> env = {{"DDP_TEST_TIMEOUT_MS", "20000"},
                                                            {"DDP_TEST_SBN_DONE_FILE", done_file}};
    if (blocks) env.emplace_back("DDP_TEST_SBN_BLOCKS", "1");
    auto run = RunWorkers("sync_bn_forward_fails_on_one_rank", 2, env);
    EXPECT_TRUE(run.AllSucceeded()) << (blocks ? "building blocks\n" : "") << testing::AllOutput(run);
  }
}

// Rank 1's training forward runs out of memory for its output (its
// address space capped below the output's 12 MiB) after the statistics
// were gathered: the running statistics and the count, written last, stay
// as they were there.
DDP_TEST_WORKER(sync_bn_output_out_of_memory) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  const std::string on = " on rank " + std::to_string(rank);
  SyncBatchNorm sync(kC, {}, pg);
  (void)sync(nn::Randn({4, kC, kH}));  // one good forward: the statistics moved once
  const std::vector<double> mean = sync.running_mean().ToVector<double>();
  const std::vector<double> var = sync.running_var().ToVector<double>();
  const Tensor x = nn::Randn({1 << 20, kC});
  pg->Barrier().Wait();  // the communication thread runs before the limit
  std::optional<testing::AddressSpaceLimit> limit;
  if (rank == 1) {
    limit.emplace(4 << 20);
    WORKER_EXPECT(limit->ok(), "no VmSize in /proc/self/status");
  }
  std::string outcome = "succeeded";
  try {
    (void)sync(x);
  } catch (const std::bad_alloc&) {
    outcome = "std::bad_alloc";
  } catch (const std::exception& e) {
    outcome = e.what();
  }
  limit.reset();
  if (rank != 1) {
    // Its own forward had what it needed; rank 1's abort may reach it first.
    testing::MarkThisRankDone(*pg);
    return testing::WorkerExit();
  }
  WORKER_EXPECT(outcome == "std::bad_alloc", outcome + on);
  WORKER_EXPECT(sync.num_batches_tracked().Item() == 1,
                "num_batches_tracked is " + std::to_string(sync.num_batches_tracked().Item()) + on);
  WORKER_EXPECT(sync.running_mean().ToVector<double>() == mean, "the running mean moved" + on);
  WORKER_EXPECT(sync.running_var().ToVector<double>() == var, "the running variance moved" + on);
  testing::StayAliveUntilTheOtherRanksAreDone(*pg);
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, NoMemoryForTheOutputLeavesTheRunningStatisticsAsTheyWere) {
  auto run = RunWorkers("sync_bn_output_out_of_memory", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(SyncBatchNormTest, InputRefusedOnOneRankStopsThePeersAtOnce) {
  for (const char* bad : {"channels", "dtype", "undefined"}) {
    for (bool blocks : {false, true}) {
      const std::string done_file = FreshDoneFile(std::string("refused_") + bad + (blocks ? "_blocks" : ""));
      std::vector<std::pair<std::string, std::string>> env = {
          {"DDP_TEST_SBN_BAD", bad}, {"DDP_TEST_TIMEOUT_MS", "20000"}, {"DDP_TEST_SBN_DONE_FILE", done_file}};
      if (blocks) env.emplace_back("DDP_TEST_SBN_BLOCKS", "1");
      auto run = RunWorkers("sync_bn_refused_on_one_rank", 2, env);
      EXPECT_TRUE(run.AllSucceeded()) << bad << (blocks ? ", building blocks" : "") << "\n" << testing::AllOutput(run);
    }
  }
}

// Outside the collective path (eval, and training on one rank) BatchNorm's
// own errors name the module too.
TEST(SyncBatchNormTest, BatchNormErrorsNameTheModule) {
  auto error = [](SyncBatchNorm& sync, const Tensor& x) {
    try {
      sync(x);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  SyncBatchNorm training(kC, {}, ProcessGroup::Single());
  const std::string one_value = error(training, nn::Ones({1, kC}));
  EXPECT_EQ(one_value.rfind("SyncBatchNorm(3): ", 0), 0u) << one_value;
  EXPECT_NE(one_value.find("expected more than 1 value per channel"), std::string::npos) << one_value;
  // Eval without running statistics normalizes with the batch's own.
  SyncBatchNorm eval(kC, {.track_running_stats = false}, ProcessGroup::Single());
  eval.Eval();
  const std::string eval_one_value = error(eval, nn::Ones({1, kC}));
  EXPECT_EQ(eval_one_value.rfind("SyncBatchNorm(3): ", 0), 0u) << eval_one_value;
  EXPECT_NE(eval_one_value.find("expected more than 1 value per channel"), std::string::npos) << eval_one_value;
}

// Inputs of 2, 3 and 5 dimensions, without affine parameters or running
// statistics, and in 16-bit dtypes, on 3 ranks (one with an empty batch):
// output, input gradient and running statistics against one BatchNorm on
// the whole batch (16-bit inputs against the f32 whole batch).
DDP_TEST_WORKER(sync_bn_variants) {
  auto pg = testing::WorkerGroup();
  if (std::getenv("DDP_TEST_SBN_BLOCKS") != nullptr) internal::SetSyncBatchNormBuildingBlocks(true);
  const std::vector<int64_t> sizes = {3, 0, 5};
  const int rank = pg->rank();
  const int64_t offset = rank == 0 ? 0 : 3, total = 8;
  nn::Generator gen(11);
  const std::vector<nn::Shape> trailing = {{}, {4}, {2, 3, 2}};
  for (const nn::Shape& tail : trailing) {
    for (int variant = 0; variant < 5; ++variant) {
      nn::modules::BatchNormOptions options;
      options.affine = variant != 1;
      options.track_running_stats = variant != 2;
      const nn::DType dtype =
          variant == 3 ? nn::DType::kFloat16 : variant == 4 ? nn::DType::kBFloat16 : nn::DType::kFloat32;
      const double tol = dtype == nn::DType::kFloat32 ? 1e-5 : 2e-2;
      const std::string what = "input [N, C" + std::string(tail.empty() ? "" : ", ...") + "] of " +
                               std::to_string(2 + tail.size()) + " dims, variant " + std::to_string(variant) +
                               ", rank " + std::to_string(rank);
      SyncBatchNorm sync(kC, options, pg);
      Tensor rm = nn::Zeros({kC}), rv = nn::Ones({kC});
      nn::Shape shape = {total, kC};
      shape.insert(shape.end(), tail.begin(), tail.end());
      for (int iteration = 0; iteration < 2; ++iteration) {
        const Tensor x_all = (nn::Randn(shape, {}, gen) * 2.0 + 3.0).To(dtype).To(nn::DType::kFloat32);
        const Tensor g_all = nn::Randn(shape, {}, gen).To(dtype).To(nn::DType::kFloat32);
        Tensor x = Rows(x_all, offset, sizes[rank]).To(dtype).Detach().set_requires_grad(true);
        Tensor y = sync(x);
        nn::Backward(nn::ops::Sum(nn::ops::Cast(y, nn::DType::kFloat32) * Rows(g_all, offset, sizes[rank])));
        Tensor xr = x_all.Detach().set_requires_grad(true);
        Tensor w, b;
        if (options.affine) {
          w = sync.weight().Detach();
          b = sync.bias().Detach();
        }
        Tensor yr = options.track_running_stats ? nn::ops::BatchNorm(xr, rm, rv, w, b, true, 0.1, 1e-5)
                                                : nn::ops::BatchNorm(xr, Tensor(), Tensor(), w, b, true, 0.1, 1e-5);
        nn::Backward(nn::ops::Sum(yr * g_all));
        WORKER_EXPECT(y.dtype() == dtype, what + ": output dtype");
        WORKER_EXPECT(RelDiff(y.Detach().To(nn::DType::kFloat32), Rows(yr.Detach(), offset, sizes[rank])) < tol,
                      what + ": forward differs");
        WORKER_EXPECT(x.grad().defined() &&
                          RelDiff(x.grad().To(nn::DType::kFloat32), Rows(xr.grad(), offset, sizes[rank])) < tol,
                      what + ": input gradient differs");
        if (options.affine) {
          // This rank's terms; their sum over the ranks is the whole batch's.
          Tensor dw = sync.weight().grad().Clone(), db = sync.bias().grad().Clone();
          pg->AllReduce(dw).Wait();
          pg->AllReduce(db).Wait();
          Tensor xw = x_all.Detach(), ww = sync.weight().Detach().Clone().set_requires_grad(true);
          Tensor bw = sync.bias().Detach().Clone().set_requires_grad(true);
          nn::Backward(nn::ops::Sum(nn::ops::BatchNorm(xw, Tensor(), Tensor(), ww, bw, true, 0.1, 1e-5) * g_all));
          WORKER_EXPECT(RelDiff(dw, ww.grad()) < tol, what + ": weight gradient differs");
          WORKER_EXPECT(RelDiff(db, bw.grad()) < tol, what + ": bias gradient differs");
          sync.weight().set_grad(Tensor());
          sync.bias().set_grad(Tensor());
        }
        if (options.track_running_stats) {
          WORKER_EXPECT(RelDiff(sync.running_mean(), rm) < tol, what + ": running mean");
          WORKER_EXPECT(RelDiff(sync.running_var(), rv) < tol, what + ": running var");
        }
      }
      // Eval: local, with the running statistics when tracked, else the batch's.
      sync.Eval();
      const Tensor xe = (nn::Randn(shape, {}, gen) + 1.0).To(dtype);
      const Tensor ye = sync(xe);
      const Tensor w = options.affine ? sync.weight().Detach() : Tensor();
      const Tensor b = options.affine ? sync.bias().Detach() : Tensor();
      const Tensor xe32 = xe.To(nn::DType::kFloat32);
      const Tensor want = options.track_running_stats
                              ? nn::ops::BatchNorm(xe32, rm, rv, w, b, false, 0.1, 1e-5)
                              : nn::ops::BatchNorm(xe32, Tensor(), Tensor(), w, b, true, 0.1, 1e-5);
      WORKER_EXPECT(RelDiff(ye.Detach().To(nn::DType::kFloat32), want.Detach()) < tol, what + ": eval differs");
    }
  }
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, EveryInputRankAndOptionMatchesBatchNorm) {
  for (bool blocks : {false, true}) {
    std::vector<std::pair<std::string, std::string>> env;
    if (blocks) env.emplace_back("DDP_TEST_SBN_BLOCKS", "1");
    auto run = RunWorkers("sync_bn_variants", 3, env);
    EXPECT_TRUE(run.AllSucceeded()) << (blocks ? "device formulation" : "host") << "\n" << testing::AllOutput(run);
  }
}

// An undefined input is named, with the module, in training and in eval
// (it threw "shape on an undefined tensor", naming neither).
TEST(SyncBatchNormTest, UndefinedInputIsNamed) {
  SyncBatchNorm sync(kC, {}, ProcessGroup::Single());
  for (bool training : {true, false}) {
    sync.Train(training);
    try {
      sync(Tensor());
      ADD_FAILURE() << "no error";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), "SyncBatchNorm(3): input is undefined") << (training ? "training" : "eval");
    }
  }
}

// A layer without a group, trained with no default group set: the error
// names the layer (it was the group lookup's alone, which said nothing of
// which layer wanted a group). Eval needs no group.
TEST(SyncBatchNormTest, TrainingWithoutAnyGroupNamesTheLayer) {
  auto model = std::make_shared<nn::modules::Sequential>(
      std::initializer_list<std::shared_ptr<nn::modules::Module>>{std::make_shared<SyncBatchNorm>(kC)});
  try {
    model->Forward(nn::Ones({2, kC}));
    ADD_FAILURE() << "no error";
  } catch (const std::logic_error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("SyncBatchNorm(3) `0`: ", 0), 0u) << message;
    EXPECT_NE(message.find("no default process group"), std::string::npos) << message;
  }
  model->Eval();
  EXPECT_EQ(model->Forward(nn::Ones({2, kC})).shape(), (std::vector<int64_t>{2, kC}));
}

// Four ranks in two subgroups, {0, 2} and {1, 3} (members not adjacent in
// the world, rank 2's batch empty): each subgroup's layers follow BatchNorm
// on that subgroup's batch alone, forward, input gradient, summed weight
// and bias gradients and running statistics, with DDP_TEST_SBN_BLOCKS the
// device formulation. The world's batch is laid out by subgroup, so each
// subgroup's batch is one run of rows.
DDP_TEST_WORKER(sync_bn_subgroups) {
  auto pg = testing::WorkerGroup();
  if (std::getenv("DDP_TEST_SBN_BLOCKS") != nullptr) internal::SetSyncBatchNormBuildingBlocks(true);
  const int rank = pg->rank();
  std::shared_ptr<ProcessGroup> sub;
  for (const std::vector<int>& members : {std::vector<int>{0, 2}, std::vector<int>{1, 3}}) {
    if (auto g = pg->NewGroup(members)) sub = g;
  }
  // Rows of the world's batch: rank 0 [0, 3), rank 2 none, rank 1 [3, 8), rank 3 [8, 12).
  const int64_t sizes[4] = {3, 5, 0, 4}, offsets[4] = {0, 3, 3, 8};
  const int64_t group_start = rank % 2 == 0 ? 0 : 3, group_rows = rank % 2 == 0 ? 3 : 9;
  const std::string what = "rank " + std::to_string(rank);
  nn::Generator gen(13);
  nn::modules::BatchNormOptions options{.momentum = std::nullopt};
  SyncBatchNorm sync(kC, options, sub);
  nn::modules::BatchNorm2d reference(kC, options);
  for (int iteration = 0; iteration < 2; ++iteration) {
    const Tensor x_all = nn::Randn({12, kC, kH, kW}, {}, gen) * 2.0 + 4.0;
    const Tensor g_all = nn::Randn({12, kC, kH, kW}, {}, gen);
    Tensor x = Rows(x_all, offsets[rank], sizes[rank]).Detach().set_requires_grad(true);
    nn::Backward(nn::ops::Sum(sync(x) * Rows(g_all, offsets[rank], sizes[rank])));
    Tensor xr = Rows(x_all, group_start, group_rows).Detach().set_requires_grad(true);
    Tensor yr = reference(xr);
    nn::Backward(nn::ops::Sum(yr * Rows(g_all, group_start, group_rows)));
    const int64_t mine = offsets[rank] - group_start;
    WORKER_EXPECT(RelDiff(x.grad(), Rows(xr.grad(), mine, sizes[rank])) < 1e-5, what + ": input gradient differs");
    Tensor dw = sync.weight().grad().Clone(), db = sync.bias().grad().Clone();
    sub->AllReduce(dw).Wait();
    sub->AllReduce(db).Wait();
    WORKER_EXPECT(RelDiff(dw, reference.weight().grad()) < 1e-5, what + ": weight gradient differs");
    WORKER_EXPECT(RelDiff(db, reference.bias().grad()) < 1e-5, what + ": bias gradient differs");
    WORKER_EXPECT(RelDiff(sync.running_mean(), reference.running_mean()) < 1e-6, what + ": running mean");
    WORKER_EXPECT(RelDiff(sync.running_var(), reference.running_var()) < 1e-6, what + ": running var");
    for (const Tensor& t : {sync.weight(), sync.bias(), reference.weight(), reference.bias()}) t.set_grad(Tensor());
  }
  WORKER_EXPECT(sync.num_batches_tracked().Item() == 2, what + ": batches tracked");
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, SubgroupsEachMatchBatchNormOnTheirOwnBatch) {
  for (bool blocks : {false, true}) {
    std::vector<std::pair<std::string, std::string>> env;
    if (blocks) env.emplace_back("DDP_TEST_SBN_BLOCKS", "1");
    auto run = RunWorkers("sync_bn_subgroups", 4, env);
    EXPECT_TRUE(run.AllSucceeded()) << (blocks ? "device formulation\n" : "host\n") << testing::AllOutput(run);
  }
}

// f64 on 3 ranks (batches of 3, 0 and 6): the input, weight and bias
// gradients against central differences of the global loss
// sum over ranks of sum(y * g) (each perturbed forward is collective: one
// rank's x moves every rank's y), and against BatchNorm on the whole batch.
// The layer tracks no running statistics, so the perturbed forwards change
// nothing. DDP_TEST_SBN_BLOCKS: the device formulation.
DDP_TEST_WORKER(sync_bn_f64_gradients) {
  auto pg = testing::WorkerGroup();
  if (std::getenv("DDP_TEST_SBN_BLOCKS") != nullptr) internal::SetSyncBatchNormBuildingBlocks(true);
  const int rank = pg->rank();
  const int64_t sizes[3] = {3, 0, 6}, offsets[3] = {0, 3, 3}, total = 9;
  const nn::TensorOptions f64{.dtype = nn::DType::kFloat64};
  nn::Generator gen(17);
  SyncBatchNorm sync(kC, {.track_running_stats = false}, pg);
  sync.To(nn::DType::kFloat64);
  {
    nn::NoGradGuard guard;
    sync.weight().CopyFrom(nn::Randn({kC}, f64, gen));
    sync.bias().CopyFrom(nn::Randn({kC}, f64, gen));
  }
  const Tensor x_all = nn::Randn({total, kC, 2, 3}, f64, gen) * 2.0 + 3.0;
  const Tensor g_all = nn::Randn({total, kC, 2, 3}, f64, gen);
  const Tensor g = Rows(g_all, offsets[rank], sizes[rank]);
  Tensor x = Rows(x_all, offsets[rank], sizes[rank]).set_requires_grad(true);
  nn::Backward(nn::ops::Sum(sync(x) * g));
  const Tensor dw = sync.weight().grad().Clone(), db = sync.bias().grad().Clone();
  pg->AllReduce(dw).Wait();
  pg->AllReduce(db).Wait();

  // The same on one process.
  Tensor xr = x_all.Detach().set_requires_grad(true);
  Tensor w = sync.weight().Detach().Clone().set_requires_grad(true);
  Tensor b = sync.bias().Detach().Clone().set_requires_grad(true);
  nn::Backward(nn::ops::Sum(nn::ops::BatchNorm(xr, Tensor(), Tensor(), w, b, true, 0.1, 1e-5) * g_all));
  const std::string what = "rank " + std::to_string(rank);
  if (sizes[rank] > 0) {
    WORKER_EXPECT(RelDiff(x.grad(), Rows(xr.grad(), offsets[rank], sizes[rank])) < 1e-12,
                  what + ": input gradient differs from BatchNorm's by " +
                      std::to_string(RelDiff(x.grad(), Rows(xr.grad(), offsets[rank], sizes[rank]))));
  }
  WORKER_EXPECT(RelDiff(dw, w.grad()) < 1e-12, what + ": weight gradient differs from BatchNorm's");
  WORKER_EXPECT(RelDiff(db, b.grad()) < 1e-12, what + ": bias gradient differs from BatchNorm's");

  // Central differences; every rank runs every perturbed forward.
  const double h = 1e-6;
  const auto global_loss = [&](const Tensor& xin) {
    nn::NoGradGuard guard;
    Tensor loss = nn::ops::Sum(sync(xin) * g).Detach().Clone();
    pg->AllReduce(loss).Wait();
    return loss.Item();
  };
  const auto nudge = [](const Tensor& t, int64_t i, double by) {
    nn::NoGradGuard guard;
    Tensor v = t.Detach().Clone();
    v.data<double>()[i] += by;
    return v;
  };
  const Tensor x0 = x.Detach();
  for (int r = 0; r < 3; ++r) {
    for (int64_t i = 0; i < std::min<int64_t>(sizes[r] * kC * 6, 5); ++i) {
      const double up = global_loss(r == rank ? nudge(x0, i * 7, h) : x0);
      const double down = global_loss(r == rank ? nudge(x0, i * 7, -h) : x0);
      if (r != rank) continue;
      const double want = (up - down) / (2 * h), got = x.grad().data<double>()[i * 7];
      WORKER_EXPECT(std::abs(got - want) < 1e-6 * std::max(1.0, std::abs(want)),
                    what + ": dx[" + std::to_string(i * 7) + "] is " + std::to_string(got) +
                        ", central difference " + std::to_string(want));
    }
  }
  for (int64_t c = 0; c < kC; ++c) {
    for (const auto& [param, grad, name] : {std::tuple{sync.weight(), dw, "weight"}, std::tuple{sync.bias(), db, "bias"}}) {
      const Tensor kept = param.Detach().Clone();
      double diff[2];
      for (int side = 0; side < 2; ++side) {
        {
          nn::NoGradGuard guard;
          param.CopyFrom(nudge(kept, c, side == 0 ? h : -h));
        }
        diff[side] = global_loss(x0);
      }
      {
        nn::NoGradGuard guard;
        param.CopyFrom(kept);
      }
      const double want = (diff[0] - diff[1]) / (2 * h), got = grad.data<double>()[c];
      WORKER_EXPECT(std::abs(got - want) < 1e-6 * std::max(1.0, std::abs(want)),
                    what + ": d" + name + "[" + std::to_string(c) + "] is " + std::to_string(got) +
                        ", central difference " + std::to_string(want));
    }
  }
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, Float64GradientsMatchCentralDifferencesAndBatchNorm) {
  for (bool blocks : {false, true}) {
    std::vector<std::pair<std::string, std::string>> env;
    if (blocks) env.emplace_back("DDP_TEST_SBN_BLOCKS", "1");
    auto run = RunWorkers("sync_bn_f64_gradients", 3, env);
    EXPECT_TRUE(run.AllSucceeded()) << (blocks ? "device formulation\n" : "host\n") << testing::AllOutput(run);
  }
}

// Printed as BatchNorm (and PyTorch) prints its options: floats in
// Python's shortest round-trip form ("1.0", not "1"; every digit of an eps
// or momentum, not six).
TEST(SyncBatchNormTest, OptionsPrintAsBatchNormPrintsThem) {
  for (const nn::modules::BatchNormOptions& options :
       {nn::modules::BatchNormOptions{}, nn::modules::BatchNormOptions{.momentum = 1.0},
        nn::modules::BatchNormOptions{.eps = 1.2345678e-5, .momentum = 0.123456789},
        nn::modules::BatchNormOptions{.eps = 1e-3, .momentum = std::nullopt, .affine = false,
                                      .track_running_stats = false}}) {
    EXPECT_EQ(SyncBatchNorm(kC, options, ProcessGroup::Single()).ExtraRepr(),
              nn::modules::BatchNorm2d(kC, options).ExtraRepr());
  }
}

TEST(SyncBatchNormTest, WrongChannelCountIsNamed) {
  SyncBatchNorm sync(4, {}, ProcessGroup::Single());
  try {
    sync(nn::Zeros({2, 3, 5}));
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expected input [N, 4, ...], got [2, 3, 5]"), std::string::npos)
        << e.what();
  }
}

// Every rank's batch empty: the global batch is empty, which BatchNorm on
// one process accepts in training (an empty output, the running statistics
// unchanged, the batch counted, zero weight and bias gradients), so the
// layer does the same on every rank (it refused it as "more than 1 value
// per channel ... got 0"). The next batch then follows BatchNorm, whose
// count (momentum None) includes the empty batches.
DDP_TEST_WORKER(sync_bn_all_empty) {
  auto pg = testing::WorkerGroup();
  if (std::getenv("DDP_TEST_SBN_BLOCKS") != nullptr) internal::SetSyncBatchNormBuildingBlocks(true);
  const int rank = pg->rank();
  const std::string what = "rank " + std::to_string(rank);
  const nn::modules::BatchNormOptions options{.momentum = std::nullopt};
  SyncBatchNorm sync(kC, options, pg);
  nn::modules::BatchNorm2d reference(kC, options);
  for (int iteration = 0; iteration < 2; ++iteration) {
    Tensor x = nn::Zeros({0, kC, kH, kW}).set_requires_grad(true);
    Tensor xr = nn::Zeros({0, kC, kH, kW}).set_requires_grad(true);
    Tensor y;
    try {
      y = sync(x);
    } catch (const std::exception& e) {
      WORKER_EXPECT(false, what + ": an empty global batch was refused: " + e.what());
      return testing::WorkerExit();
    }
    nn::Backward(nn::ops::Sum(y));
    nn::Backward(nn::ops::Sum(reference(xr)));
    WORKER_EXPECT(y.shape() == x.shape(), what + ": output " + nn::ShapeToString(y.shape()));
    WORKER_EXPECT(sync.weight().grad().defined() && sync.weight().grad().ToVector<float>() ==
                                                         reference.weight().grad().ToVector<float>(),
                  what + ": weight gradient");
    WORKER_EXPECT(sync.bias().grad().defined() &&
                      sync.bias().grad().ToVector<float>() == reference.bias().grad().ToVector<float>(),
                  what + ": bias gradient");
    WORKER_EXPECT(sync.running_mean().ToVector<float>() == reference.running_mean().ToVector<float>() &&
                      sync.running_var().ToVector<float>() == reference.running_var().ToVector<float>(),
                  what + ": running statistics moved");
    WORKER_EXPECT(sync.num_batches_tracked().Item() == reference.num_batches_tracked().Item(),
                  what + ": num_batches_tracked is " + std::to_string(sync.num_batches_tracked().Item()) +
                      ", BatchNorm's " + std::to_string(reference.num_batches_tracked().Item()));
  }
  // A batch with values: the running average's factor counts the empty batches.
  nn::Generator gen(5);
  const int64_t rows = 2;
  const Tensor x_all = nn::Randn({rows * pg->size(), kC, kH, kW}, {}, gen) + 2.0;
  sync(Rows(x_all, rank * rows, rows));
  reference(x_all);
  WORKER_EXPECT(sync.num_batches_tracked().Item() == 3, what + ": batches tracked");
  WORKER_EXPECT(RelDiff(sync.running_mean(), reference.running_mean()) < 1e-6, what + ": running mean");
  WORKER_EXPECT(RelDiff(sync.running_var(), reference.running_var()) < 1e-6, what + ": running var");
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, AnEmptyGlobalBatchIsBatchNormsEmptyBatch) {
  for (bool blocks : {false, true}) {
    std::vector<std::pair<std::string, std::string>> env;
    if (blocks) env.emplace_back("DDP_TEST_SBN_BLOCKS", "1");
    auto run = RunWorkers("sync_bn_all_empty", 2, env);
    EXPECT_TRUE(run.AllSucceeded()) << (blocks ? "device formulation\n" : "host\n") << testing::AllOutput(run);
  }
}

// Against PyTorch itself rather than this project's BatchNorm: 3 ranks
// with batches of 3, 0 and 2 samples of x [N, 2, 2], eps 1e-3, weight
// (1.5, -0.5), bias (0.25, 2), two training steps then eval, in f64 and f32,
// on the host path and the device formulation, momentum 0.1 and None.
// x[i] = 3 sin(0.37 i + t) + 5 + t and g[i] = cos(0.23 i + 2 t) over the
// flat index i of the whole batch at step t; each rank's loss is
// sum(y * g) over its rows. The values are those of torch 1.13's
// BatchNorm1d in f64 on the whole batch (SyncBatchNorm's definition), from:
//   bn = torch.nn.BatchNorm1d(2, eps=1e-3, momentum=m).double()
//   y = bn(x); (y * g).sum().backward()   # per step; then bn.eval(); bn(x_0)
struct PyTorchGolden {
  // Step 0: output and input gradient, flat over the whole batch.
  const std::vector<double> y0 = {0.24877588141136697, 1.0897903117500642, 1.5897314864889391, 1.430294301874843, 2.5649108887115997, 2.4844280294295413, 1.5016798092916968, 1.697921396850428, 0.6687913285925025, -0.18681812493146807, 2.4568173348838034, 2.6518416065607098, -1.991192160096831, -2.065868298930851, 2.7180767541455606, 2.5572015016326572, -0.5774426479131416, 0.2646247919772229, 1.8103168604555853, 1.586118947815777};
  const std::vector<double> dx0 = {0.8725602515328608, 0.6116781406332167, -0.16730679209195154, -0.09551534692394892, -0.0952646346012932, -0.22523243504523216, 0.025358200598914558, 0.028795081528659377, -0.22895650534351356, -0.14925790399955102, -0.01980752967796416, -0.03438392000445613, 0.01830788562753505, -0.007210537996646725, -0.008990906382567587, 0.022632579917566644, -0.3320039078097923, -0.4646203529975849, 0.11990800857493655, 0.12931062446081087};
  // Whole-batch weight and bias gradients per step.
  const std::vector<double> dw[2] = {{5.532336464560066, 5.465611369388905}, {0.9618228048910415, 2.312005862976386}};
  const std::vector<double> db[2] = {{-1.2508658529362173, -2.4943909941557685}, {-2.292769280644655, -0.9778927341134991}};
  // Running statistics after each step, momentum 0.1.
  const std::vector<double> rm[2] = {{0.5001579022272044, 0.5313641334247985}, {1.0892224724773096, 1.1238808560363982}};
  const std::vector<double> rv[2] = {{1.3158660957058042, 1.38201236080703}, {1.7028430605151874, 1.799824858841081}};
  // The same, momentum None (the cumulative average).
  const std::vector<double> rm_cumulative[2] = {{5.001579022272043, 5.3136413342479845}, {5.696191313500149, 5.88508634689439}};
  const std::vector<double> rv_cumulative[2] = {{4.158660957058041, 4.8201236080703005}, {4.672148350428839, 5.19013047460892}};
  // Eval on step 0's x after both steps, momentum 0.1.
  const std::vector<double> y_eval = {4.744067333892799, 5.990717716422778, -0.19791757362156273, -0.4454056446699375, 8.177314717863464, 8.058013569522076, -0.33459672908247173, -0.029978630851908765, 5.366663568877722, 4.0983787285066, 1.1480256865532408, 1.4507541932172032, 1.4237235739450265, 1.3130298287665978, 1.5535684077999277, 1.3038480805111166, 3.5193491739190788, 4.767560450903467, 0.1444884268144425, -0.20352517532359082};
};

DDP_TEST_WORKER(sync_bn_pytorch_golden) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  const int64_t sizes[3] = {3, 0, 2}, offsets[3] = {0, 3, 3}, kN = 5, kGC = 2, kL = 2;
  const PyTorchGolden golden;
  const nn::TensorOptions f64{.dtype = nn::DType::kFloat64};
  const auto whole = [&](const std::vector<double>& v) { return nn::FromVector(v, {kN, kGC, kL}, f64); };
  const auto mine = [&](const Tensor& t) { return Rows(t, offsets[rank], sizes[rank]); };
  const auto per_channel = [&](const std::vector<double>& v) { return nn::FromVector(v, {kGC}, f64); };
  const auto step_input = [&](int t, bool gradient) {
    std::vector<double> v(kN * kGC * kL);
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = gradient ? std::cos(0.23 * static_cast<double>(i) + 2 * t)
                      : 3 * std::sin(0.37 * static_cast<double>(i) + t) + 5 + t;
    }
    return whole(v);
  };
  for (bool blocks : {false, true}) {
    internal::SetSyncBatchNormBuildingBlocks(blocks);
    for (nn::DType dtype : {nn::DType::kFloat64, nn::DType::kFloat32}) {
      const double tol = dtype == nn::DType::kFloat64 ? 1e-12 : 1e-5;
      for (bool cumulative : {false, true}) {
        const std::string what = std::string(blocks ? "device formulation" : "host") + ", " +
                                 std::string(nn::DTypeName(dtype)) + (cumulative ? ", momentum None" : ", momentum 0.1") +
                                 ", rank " + std::to_string(rank);
        nn::modules::BatchNormOptions options{.eps = 1e-3};
        if (cumulative) options.momentum = std::nullopt;
        SyncBatchNorm sync(kGC, options, pg);
        sync.To(dtype);
        {
          nn::NoGradGuard guard;
          sync.weight().CopyFrom(nn::FromVector(std::vector<double>{1.5, -0.5}, {kGC}, f64));
          sync.bias().CopyFrom(nn::FromVector(std::vector<double>{0.25, 2.0}, {kGC}, f64));
        }
        for (int t = 0; t < 2; ++t) {
          Tensor x = mine(step_input(t, false)).To(dtype).Detach().set_requires_grad(true);
          Tensor y = sync(x);
          nn::Backward(nn::ops::Sum(y * mine(step_input(t, true)).To(dtype)));
          if (t == 0 && sizes[rank] > 0) {
            WORKER_EXPECT(RelDiff(y, mine(whole(golden.y0))) < tol,
                          what + ": output differs from PyTorch's by " + std::to_string(RelDiff(y, mine(whole(golden.y0)))));
            WORKER_EXPECT(RelDiff(x.grad(), mine(whole(golden.dx0))) < tol,
                          what + ": input gradient differs from PyTorch's by " +
                              std::to_string(RelDiff(x.grad(), mine(whole(golden.dx0)))));
          }
          Tensor dw = sync.weight().grad().Clone(), db = sync.bias().grad().Clone();
          pg->AllReduce(dw).Wait();
          pg->AllReduce(db).Wait();
          const std::string step = what + ", step " + std::to_string(t);
          WORKER_EXPECT(RelDiff(dw, per_channel(golden.dw[t])) < tol, step + ": weight gradient differs from PyTorch's");
          WORKER_EXPECT(RelDiff(db, per_channel(golden.db[t])) < tol, step + ": bias gradient differs from PyTorch's");
          const Tensor want_mean = per_channel(cumulative ? golden.rm_cumulative[t] : golden.rm[t]);
          const Tensor want_var = per_channel(cumulative ? golden.rv_cumulative[t] : golden.rv[t]);
          WORKER_EXPECT(RelDiff(sync.running_mean(), want_mean) < tol, step + ": running mean differs from PyTorch's");
          WORKER_EXPECT(RelDiff(sync.running_var(), want_var) < tol,
                        step + ": running var differs from PyTorch's by " +
                            std::to_string(RelDiff(sync.running_var(), want_var)));
          sync.weight().set_grad(Tensor());
          sync.bias().set_grad(Tensor());
        }
        if (!cumulative) {
          sync.Eval();
          const Tensor y = sync(mine(step_input(0, false)).To(dtype));
          if (sizes[rank] > 0) {
            WORKER_EXPECT(RelDiff(y, mine(whole(golden.y_eval))) < tol, what + ": eval output differs from PyTorch's");
          }
        }
      }
    }
  }
  return testing::WorkerExit();
}

TEST(SyncBatchNormTest, MatchesPyTorchGoldenValues) {
  auto run = RunWorkers("sync_bn_pytorch_golden", 3, {});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

}  // namespace
}  // namespace ddp::dist
