// ZeroRedundancyOptimizer over real processes: with DDP it trains exactly
// as the unsharded optimizer (bit for bit, SGD with momentum and Adam, 2
// and 3 ranks; also under Join, with a parameter that no rank uses in the
// shadowed iterations), each rank keeps state for its shard only, the consolidated
// state equals the unsharded optimizer's, a run resumed from a checkpoint
// holding it equals an uninterrupted one, and a bad state fails every rank
// (one bad only for one rank's shard loads on none); a factory that does
// not build from the pieces it is given is refused, and so are parameter
// lists that differ across ranks. Over parameter groups it equals the
// unsharded optimizer too, under a scheduler, and its state round-trips.

#include "ddp/zero_redundancy_optimizer.h"

#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/checkpoint.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/replicas.h"
#include "ddp/testing/ddp_test_util.h"
#include "nn/autograd/engine.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/optim/adam.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/allocator.h"

// While a thread's flag is set, its allocations of kBigAllocation bytes or
// more fail, as when memory has run out for all but small blocks
// (replacing the global operator new is the seam; it reaches the library
// too).
namespace {
thread_local bool big_allocations_fail = false;
constexpr std::size_t kBigAllocation = 4096;
}  // namespace

void* operator new(std::size_t bytes) {
  if (big_allocations_fail && bytes >= kBigAllocation) throw std::bad_alloc();
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
// Not inlined: GCC would take a free() of what a new expression returned
// for a mismatch.
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace ddp::dist {
namespace {

using nn::Tensor;
using testing::DecayGroups;
using testing::MakeGroupedOptimizer;
using nn::optim::NamedParameters;
using nn::optim::NamedTensors;
using testing::RunWorkers;

constexpr int64_t kBatch = 8;

// The peers' MLP; with DDP_TEST_MODEL=mixed, a bf16 first layer (the one
// the flat partition splits between ranks) and an f32 second one.
std::shared_ptr<nn::modules::Module> Mlp(uint64_t seed) {
  nn::Generator gen(seed);
  const char* kind = std::getenv("DDP_TEST_MODEL");
  if (kind == nullptr || std::string(kind) != "mixed") return nn::modules::MakeMlp(gen);
  auto m = std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<nn::modules::Module>>{
      std::make_shared<nn::modules::Flatten>(), std::make_shared<nn::modules::Linear>(784, 64, true, gen),
      std::make_shared<nn::modules::ReLU>(), std::make_shared<nn::modules::Linear>(64, 10, true, gen)});
  m->at(1)->To(nn::DType::kBFloat16);
  return m;
}

// The optimizer named by DDP_TEST_OPTIM ("sgd" or "adam") over `params`.
std::unique_ptr<nn::optim::Optimizer> MakeOptimizer(NamedParameters params) {
  const char* which = std::getenv("DDP_TEST_OPTIM");
  if (which != nullptr && std::string(which) == "adam") {
    return std::make_unique<nn::optim::Adam>(std::move(params), nn::optim::AdamOptions{.lr = 1e-3});
  }
  return std::make_unique<nn::optim::Sgd>(std::move(params), nn::optim::SgdOptions{.lr = 0.05, .momentum = 0.9});
}

// One step on this rank's part of global batch `step`. Takes either
// optimizer (both have ZeroGrad and Step).
template <typename Opt>
void TrainStep(DistributedDataParallel& ddp, Opt& opt, ProcessGroup& pg, int step) {
  const auto& data = testing::FashionMnist();
  auto [x, y] = testing::Batch(data, (step * pg.size() + pg.rank()) * kBatch, kBatch);
  opt.ZeroGrad();
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  opt.Step();
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  const Tensor x = a.To(nn::kCPU).Contiguous(), y = b.To(nn::kCPU).Contiguous();
  return x.dtype() == y.dtype() && x.shape() == y.shape() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

// In a worker: the optimizer state `got` against `want`: the same names in
// the same order, with the same bytes. `what` names the state for the
// failure messages.
void WorkerExpectSameState(const NamedTensors& got, const NamedTensors& want, const std::string& what) {
  WORKER_EXPECT(got.size() == want.size(),
                what + " has " + std::to_string(got.size()) + " entries, want " + std::to_string(want.size()));
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    WORKER_EXPECT(got[i].first == want[i].first && SameBytes(got[i].second, want[i].second),
                  what + ": entry " + std::to_string(i) + ", `" + got[i].first + "`, differs from `" +
                      want[i].first + "`");
  }
}

std::string TempPath(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp != nullptr ? tmp : "/tmp") + "/zero_" + std::to_string(getpid()) + "_" + name;
}

// ------------------------------------------------------------ partition ----

NamedParameters Sized(const std::vector<int64_t>& sizes) {
  NamedParameters params;
  for (size_t i = 0; i < sizes.size(); ++i) params.emplace_back("p" + std::to_string(i), nn::Empty({sizes[i]}));
  return params;
}

using Slice = ZeroRedundancyOptimizer::Slice;
using Shards = std::vector<std::vector<Slice>>;

TEST(ZeroPartition, EqualRunsOfTheFlatElementsCutOnWholeVectors) {
  // One parameter cut in two: 500 moves down to 496.
  EXPECT_EQ(ZeroRedundancyOptimizer::Partition(Sized({1000}), 2),
            (Shards{{{0, 0, 496}}, {{0, 496, 504}}}));
  // Cuts at 341 and 682 of 1024 -> 336 and 672; the small parameter goes
  // whole with the last run.
  EXPECT_EQ(ZeroRedundancyOptimizer::Partition(Sized({1000, 24}), 3),
            (Shards{{{0, 0, 336}}, {{0, 336, 336}}, {{0, 672, 328}, {1, 0, 24}}}));
  // A cut inside a parameter of under 16 elements moves to its start.
  EXPECT_EQ(ZeroRedundancyOptimizer::Partition(Sized({100, 10, 10, 50, 40}), 2),
            (Shards{{{0, 0, 100}}, {{1, 0, 10}, {2, 0, 10}, {3, 0, 50}, {4, 0, 40}}}));
  // A cut on a parameter boundary; a parameter of no elements is nobody's.
  EXPECT_EQ(ZeroRedundancyOptimizer::Partition(Sized({64, 0, 64}), 2),
            (Shards{{{0, 0, 64}}, {{2, 0, 64}}}));
  EXPECT_EQ(ZeroRedundancyOptimizer::Partition(Sized({5, 5, 5}), 1),
            (Shards{{{0, 0, 5}, {1, 0, 5}, {2, 0, 5}}}));
  // More ranks than 16-element runs: the first ranks own nothing.
  EXPECT_EQ(ZeroRedundancyOptimizer::Partition(Sized({20}), 4), (Shards{{}, {}, {}, {{0, 0, 20}}}));
  EXPECT_THROW(ZeroRedundancyOptimizer::Partition(Sized({1}), 0), std::invalid_argument);
}

// However uneven the parameters, every rank gets its share of the elements
// within the 16-element rounding of its two cuts, and the shards cover
// every element once.
TEST(ZeroPartition, ShardsAreEvenAndCoverEveryElementOnce) {
  const std::vector<int64_t> sizes = {401408, 512, 131072, 256, 2560, 10, 3, 7777};
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  for (int world : {1, 2, 3, 4, 7, 8}) {
    const Shards shards = ZeroRedundancyOptimizer::Partition(Sized(sizes), world);
    ASSERT_EQ(shards.size(), static_cast<size_t>(world));
    std::vector<int64_t> covered(sizes.size(), 0);
    for (const auto& shard : shards) {
      int64_t mine = 0;
      for (const Slice& s : shard) {
        EXPECT_EQ(s.offset, covered[s.param]) << "world " << world << ": a gap or an overlap";
        covered[s.param] += s.length;
        mine += s.length;
      }
      EXPECT_LE(std::abs(mine - total / world), 2 * ZeroRedundancyOptimizer::kAlignment) << "world " << world;
    }
    EXPECT_EQ(covered, sizes) << "world " << world;
  }
}

TEST(ZeroPartition, BadArgumentsAreNamed) {
  auto pg = ProcessGroup::Single();
  auto make = [](NamedParameters p) { return MakeOptimizer(std::move(p)); };
  NamedParameters twice = {{"w", nn::Empty({2})}, {"w", nn::Empty({2})}};
  try {
    ZeroRedundancyOptimizer opt(twice, pg, make);
    FAIL() << "a repeated name was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("`w` is listed twice"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ZeroRedundancyOptimizer(Sized({2}), nullptr, make), std::invalid_argument);
  EXPECT_THROW(ZeroRedundancyOptimizer(Sized({2}), pg, nullptr), std::invalid_argument);
  try {
    ZeroRedundancyOptimizer::Partition({{"w", nn::Empty({2})}, {"ghost", Tensor()}}, 2);
    ADD_FAILURE() << "an undefined parameter was cut";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("parameter `ghost` is undefined"), std::string::npos) << e.what();
  }
}

// The shards are views of the parameters' memory: a model converted after
// the optimizer was built is an error naming a parameter, not a silent
// update of memory the model no longer uses.
TEST(ZeroPartition, ModelConvertedAfterConstructionIsAnError) {
  auto pg = ProcessGroup::Single();
  auto model = Mlp(1);
  ZeroRedundancyOptimizer zero(model->NamedParameters(), pg, MakeOptimizer);
  model->To(nn::DType::kFloat64);
  try {
    zero.Step();
    FAIL() << "a stale shard was stepped";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("has new memory since the optimizer was built"), std::string::npos)
        << e.what();
  }
}

// A parameter whose data was replaced by other elements of the same memory
// (SetData with a view of it): the pieces would update the old elements,
// so Step refuses it, naming the parameter, as it does new memory.
TEST(ZeroPartition, DataReplacedWithinTheSameMemoryIsAnError) {
  auto pg = ProcessGroup::Single();
  const Tensor w = nn::Zeros({4, 8}).set_requires_grad(true);
  ZeroRedundancyOptimizer zero({{"w", w}}, pg, MakeOptimizer);
  {
    nn::NoGradGuard guard;
    w.SetData(w.Detach().View({32}).Narrow(0, 16, 16).View({2, 8}));
  }
  w.set_grad(nn::Ones({2, 8}));
  try {
    zero.Step();
    FAIL() << "pieces of memory the parameter no longer uses were stepped";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter `w` has new memory since the optimizer was built"),
              std::string::npos)
        << e.what();
  }
}

// A gradient not of its parameter's shape is refused naming both shapes,
// as the unsharded optimizer refuses it; one of the same size with another
// shape would otherwise be read in the wrong order.
TEST(ZeroPartition, GradientOfAnotherShapeIsRefusedNamingTheParameter) {
  for (const nn::Shape& shape : {nn::Shape{8, 4}, nn::Shape{3}}) {
    auto pg = ProcessGroup::Single();
    const Tensor w = nn::Zeros({4, 8}).set_requires_grad(true);
    ZeroRedundancyOptimizer zero({{"w", w}}, pg, MakeOptimizer);
    // set_grad takes only the parameter's shape; a gradient whose data
    // was replaced (SetData) may have any.
    nn::NoGradGuard guard;
    w.set_grad(nn::Ones({4, 8}));
    w.grad().SetData(nn::Ones(shape));
    try {
      zero.Step();
      ADD_FAILURE() << "a gradient of shape " << nn::ShapeToString(shape) << " was taken";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("gradient of `w` has shape " + nn::ShapeToString(shape) +
                                           ", the parameter [4, 8]"),
                std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(SameBytes(w, nn::Zeros({4, 8}))) << "a refused step changed the parameter";
  }
}

// One step of `opt` over `model` on batch `step` of a single process.
// Takes either optimizer (both have ZeroGrad and Step).
template <typename Opt>
void OneProcessStep(nn::modules::Module& model, Opt& opt, int step) {
  auto [x, y] = testing::Batch(testing::FashionMnist(), step * kBatch, kBatch);
  opt.ZeroGrad();
  nn::Backward(nn::loss::CrossEntropy(model(x), y));
  opt.Step();
}

// A consolidated state dict against the plain optimizer's: the same names
// in the same order, with the same bytes. `what` names the optimizer.
void ExpectSameStateDict(const NamedTensors& whole, const NamedTensors& want, const std::string& what) {
  ASSERT_EQ(whole.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(whole[i].first, want[i].first) << what;
    EXPECT_TRUE(SameBytes(whole[i].second, want[i].second)) << what << ": " << want[i].first;
  }
}

// One process: the shard is everything, and the optimizer is the plain one.
TEST(ZeroPartition, OneProcessIsThePlainOptimizer) {
  auto pg = ProcessGroup::Single();
  auto sharded = Mlp(1), plain = Mlp(1);
  ZeroRedundancyOptimizer zero(sharded->NamedParameters(), pg, MakeOptimizer);
  auto opt = MakeOptimizer(plain->NamedParameters());
  for (int s = 0; s < 3; ++s) {
    OneProcessStep(*sharded, zero, s);
    OneProcessStep(*plain, *opt, s);
  }
  EXPECT_EQ(testing::HashState(*sharded), testing::HashState(*plain));
  ExpectSameStateDict(zero.ConsolidatedStateDict(0), opt->StateDict(), "");
  EXPECT_THROW(zero.ConsolidatedStateDict(1), std::invalid_argument);
  for (const int r : {-1, 1}) {
    try {
      zero.shard(r);
      ADD_FAILURE() << "rank " << r << "'s shard of a group of 1 was read";
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(r) + " is not in a group of 1"),
                std::string::npos)
          << e.what();
    }
  }
}

// One process, SGD with Nesterov momentum and weight decay, Adam, and
// AdamW with AMSGrad: bit for bit the plain optimizer, state included.
TEST(ZeroPartition, OneProcessEqualsEachPlainOptimizerBitForBit) {
  const std::vector<std::pair<std::string, ZeroRedundancyOptimizer::Factory>> optimizers = {
      {"SGD",
       [](NamedParameters p) {
         return std::make_unique<nn::optim::Sgd>(
             std::move(p), nn::optim::SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
       }},
      {"Adam",
       [](NamedParameters p) {
         return std::make_unique<nn::optim::Adam>(std::move(p), nn::optim::AdamOptions{.lr = 1e-3});
       }},
      {"AdamW",
       [](NamedParameters p) {
         return std::make_unique<nn::optim::AdamW>(std::move(p), nn::optim::AdamWOptions{.lr = 1e-3, .amsgrad = true});
       }},
  };
  for (const auto& [what, make] : optimizers) {
    auto sharded = Mlp(1), plain = Mlp(1);
    ZeroRedundancyOptimizer zero(sharded->NamedParameters(), ProcessGroup::Single(), make);
    auto opt = make(plain->NamedParameters());
    for (int s = 0; s < 3; ++s) {
      OneProcessStep(*sharded, zero, s);
      OneProcessStep(*plain, *opt, s);
      EXPECT_EQ(testing::HashState(*sharded), testing::HashState(*plain)) << what << " step " << s;
    }
    ExpectSameStateDict(zero.ConsolidatedStateDict(0), opt->StateDict(), what);
  }
}

// ----------------------------------------------------------- equivalence ----

// The sharded and the unsharded optimizer, each behind its own DDP, from the
// same weights on the same batches: equal bytes after every step; each rank
// holds state for its own parameters only.
DDP_TEST_WORKER(equivalence) {
  auto pg = testing::WorkerGroup();
  auto sharded = Mlp(1), plain = Mlp(1);
  DistributedDataParallel ddp_sharded(sharded, {.process_group = pg});
  DistributedDataParallel ddp_plain(plain, {.process_group = pg});
  ZeroRedundancyOptimizer zero(sharded->NamedParameters(), pg, MakeOptimizer);
  auto opt = MakeOptimizer(plain->NamedParameters());
  for (int s = 0; s < 5; ++s) {
    TrainStep(ddp_sharded, zero, *pg, s);
    TrainStep(ddp_plain, *opt, *pg, s);
    WORKER_EXPECT(testing::HashState(*sharded) == testing::HashState(*plain),
                  "step " + std::to_string(s) + ": sharded and unsharded training differ");
  }
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*sharded)), "replicas differ");
  // The local optimizer holds this rank's pieces, about 1/N of the
  // elements, and state for nothing else: no entry of another piece's size.
  const NamedParameters params = sharded->NamedParameters();
  const auto& mine = zero.shard(pg->rank());
  int64_t total = 0, owned = 0;
  for (const auto& [name, p] : params) total += p.numel();
  for (const Slice& s : mine) owned += s.length;
  WORKER_EXPECT(zero.local().params().size() == mine.size(), "shard size");
  WORKER_EXPECT(std::abs(owned - total / pg->size()) <= 2 * ZeroRedundancyOptimizer::kAlignment,
                "rank " + std::to_string(pg->rank()) + " owns " + std::to_string(owned) + " of " +
                    std::to_string(total) + " elements");
  for (const auto& [key, t] : zero.local().StateDict()) {
    if (key.rfind("state.", 0) != 0 || (key.size() >= 5 && key.compare(key.size() - 5, 5, ".step") == 0)) continue;
    bool match = false;
    for (const Slice& s : mine) {
      match |= key.rfind("state." + params[s.param].first + ".", 0) == 0 && t.numel() == s.length;
    }
    WORKER_EXPECT(match, "rank " + std::to_string(pg->rank()) + " holds state " + key + " that is not its piece");
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, SgdOnTwoRanksEqualsTheUnshardedOptimizer) {
  auto run = RunWorkers("equivalence", 2, {{"DDP_TEST_OPTIM", "sgd"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// 16-bit parameters split between ranks: each piece keeps its f32 master.
TEST(ZeroRedundancyOptimizerTest, SplitBf16ParameterEqualsTheUnshardedOptimizer) {
  auto run = RunWorkers("equivalence", 3, {{"DDP_TEST_OPTIM", "sgd"}, {"DDP_TEST_MODEL", "mixed"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  auto state = RunWorkers("consolidate", 2,
                          {{"DDP_TEST_OPTIM", "adam"},
                           {"DDP_TEST_MODEL", "mixed"},
                           {"DDP_TEST_CKPT", TempPath("mixed.safetensors")}});
  EXPECT_TRUE(state.AllSucceeded()) << testing::AllOutput(state);
}

TEST(ZeroRedundancyOptimizerTest, AdamOnThreeRanksEqualsTheUnshardedOptimizer) {
  auto run = RunWorkers("equivalence", 3, {{"DDP_TEST_OPTIM", "adam"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------------------------ Join ----

// Uneven inputs: the last rank holds 3 more batches. Under Join with
// shadow_step, the ranks that ran out of data get the active ranks'
// averaged gradients and step their shards with them, so sharded training
// equals the unsharded optimizer's under Join, and the consolidated state
// equals that of the unsharded optimizer on the rank that never joined.
DDP_TEST_WORKER(join) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  const int mine = 4 + (rank == world - 1 ? 3 : 0);
  auto sharded = Mlp(4), plain = Mlp(4);
  {
    DistributedDataParallel ddp(sharded, {.bucket_cap_mb = 0.3, .first_bucket_mb = 0.1, .process_group = pg});
    ZeroRedundancyOptimizer zero(sharded->NamedParameters(), pg, MakeOptimizer);
    Join join(ddp, {.shadow_step = [&] { zero.Step(); }});
    for (int s = 0; s < mine; ++s) TrainStep(ddp, zero, *pg, s);
    join.Wait();
    NamedTensors state = zero.ConsolidatedStateDict(world - 1);
    DistributedDataParallel ddp_plain(plain, {.bucket_cap_mb = 0.3, .first_bucket_mb = 0.1, .process_group = pg});
    auto opt = MakeOptimizer(plain->NamedParameters());
    Join plain_join(ddp_plain);
    for (int s = 0; s < mine; ++s) TrainStep(ddp_plain, *opt, *pg, s);
    plain_join.Wait();
    if (rank == world - 1) {
      const NamedTensors expected = opt->StateDict();
      WORKER_EXPECT(state.size() == expected.size(), "consolidated state has " + std::to_string(state.size()) +
                                                         " entries, the unsharded " + std::to_string(expected.size()));
      for (const auto& [key, t] : expected) {
        bool same = false;
        for (const auto& [k, u] : state) same |= k == key && SameBytes(t, u);
        WORKER_EXPECT(same, "state entry " + key + " differs from the unsharded optimizer's");
      }
    }
  }
  WORKER_EXPECT(testing::HashState(*sharded) == testing::HashState(*plain),
                "sharded and unsharded training under Join differ");
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*sharded)), "replicas differ");
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, JoinWithOneRankHoldingThreeMoreBatches) {
  for (const char* optim : {"sgd", "adam"}) {
    auto run = RunWorkers("join", 3, {{"DDP_TEST_OPTIM", optim}});
    EXPECT_TRUE(run.AllSucceeded()) << optim << "\n" << testing::AllOutput(run);
  }
}

// find_unused_parameters under Join with shadow_step: every rank trains
// head b for 3 iterations, then rank 0 alone 3 more through head a, so that
// b is unused on every rank in the iterations the others shadow. There
// rank 0's b has no gradient (ZeroGrad) and is not stepped; a rank that ran
// out kept b's gradient from its own last iteration and stepped its pieces
// of b with it, then broadcast them. Sharded training must equal the
// unsharded optimizer's under Join, parameter for parameter.
DDP_TEST_WORKER(join_unused_everywhere) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  constexpr int kCommon = 3, kExtra = 3;
  const int mine = kCommon + (rank == 0 ? kExtra : 0);
  auto sharded = std::make_shared<testing::Branchy>(43, false);
  auto plain = std::make_shared<testing::Branchy>(43, false);
  try {
    {
      DistributedDataParallel ddp(sharded, {.find_unused_parameters = true, .process_group = pg});
      ZeroRedundancyOptimizer zero(sharded->NamedParameters(), pg, MakeOptimizer);
      // The test needs a rank that runs out to own pieces of b.
      const NamedParameters params = sharded->NamedParameters();
      bool joined_owns_b = false;
      for (int r = 1; r < world; ++r) {
        for (const Slice& s : zero.shard(r)) joined_owns_b |= params[s.param].first.rfind("b.", 0) == 0;
      }
      WORKER_EXPECT(joined_owns_b, "no rank that runs out owns a piece of head b");
      Join join(ddp, {.shadow_step = [&] { zero.Step(); }});
      for (int s = 0; s < mine; ++s) {
        sharded->use_a_ = s >= kCommon;
        TrainStep(ddp, zero, *pg, s);
      }
      join.Wait();
    }
    {
      DistributedDataParallel ddp(plain, {.find_unused_parameters = true, .process_group = pg});
      auto opt = MakeOptimizer(plain->NamedParameters());
      Join join(ddp);
      for (int s = 0; s < mine; ++s) {
        plain->use_a_ = s >= kCommon;
        TrainStep(ddp, *opt, *pg, s);
      }
      join.Wait();
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, e.what());
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*sharded, *plain);
  WORKER_EXPECT(testing::HashState(*sharded) == testing::HashState(*plain),
                "sharded and unsharded training under Join differ, most in `" + worst + "` (by " +
                    std::to_string(diff) + ")");
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*sharded)), "replicas differ");
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, JoinLeavesAParameterUnusedOnEveryRankWithoutAStep) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("join_unused_everywhere", n);
    EXPECT_TRUE(run.AllSucceeded()) << n << " ranks\n" << testing::AllOutput(run);
  }
}

// ----------------------------------------------------------- checkpoints ----

// The consolidated state equals the unsharded optimizer's; saved with the
// model and loaded on every rank into a fresh sharded optimizer, training
// resumes exactly; the plain optimizer loads the same file.
DDP_TEST_WORKER(consolidate) {
  auto pg = testing::WorkerGroup();
  const std::string path = std::getenv("DDP_TEST_CKPT");
  auto sharded = Mlp(1), plain = Mlp(1);
  DistributedDataParallel ddp_sharded(sharded, {.process_group = pg});
  DistributedDataParallel ddp_plain(plain, {.process_group = pg});
  ZeroRedundancyOptimizer zero(sharded->NamedParameters(), pg, MakeOptimizer);
  auto opt = MakeOptimizer(plain->NamedParameters());
  for (int s = 0; s < 3; ++s) {
    TrainStep(ddp_sharded, zero, *pg, s);
    TrainStep(ddp_plain, *opt, *pg, s);
  }
  const NamedTensors whole = zero.ConsolidatedStateDict(1);
  if (pg->rank() == 1) {
    const NamedTensors want = opt->StateDict();
    WorkerExpectSameState(whole, want, "the consolidated state");
  } else {
    WORKER_EXPECT(whole.empty(), "a rank other than `to` got the state");
  }
  const NamedTensors on_zero = zero.ConsolidatedStateDict(0);
  nn::io::Checkpoint c = MakeCheckpoint(ddp_sharded, nullptr, {{"step", "3"}});
  c.optimizer = on_zero;
  SaveCheckpoint(*pg, path, c);
  for (int s = 3; s < 6; ++s) TrainStep(ddp_sharded, zero, *pg, s);
  const uint64_t uninterrupted = testing::HashState(*sharded);

  // Resume: other initial weights, a fresh sharded optimizer.
  auto resumed = Mlp(99);
  ZeroRedundancyOptimizer zero2(resumed->NamedParameters(), pg, MakeOptimizer);
  nn::io::Checkpoint loaded = LoadCheckpoint(*pg, path);
  // The sharded optimizer loads its own state; RestoreCheckpoint, given no
  // optimizer, would refuse a checkpoint that holds some.
  nn::io::Checkpoint model_only = loaded;
  model_only.optimizer.clear();
  RestoreCheckpoint(model_only, *resumed, nullptr);
  zero2.LoadStateDict(loaded.optimizer);
  DistributedDataParallel ddp_resumed(resumed, {.process_group = pg});
  for (int s = 3; s < 6; ++s) TrainStep(ddp_resumed, zero2, *pg, s);
  WORKER_EXPECT(testing::HashState(*resumed) == uninterrupted, "the resumed run differs");

  // The unsharded optimizer takes the consolidated state as its own.
  auto other = Mlp(7);
  auto opt2 = MakeOptimizer(other->NamedParameters());
  opt2->LoadStateDict(loaded.optimizer);
  WORKER_EXPECT(opt2->StateDict().size() == opt->StateDict().size(), "plain optimizer load");
  return testing::WorkerExit();
}

// The ranks name different receiving ranks: rank r passes to = r, then
// rank 1 alone passes one outside the group. Before, the first returned the
// whole state on both ranks, and in the second rank 1 threw alone while
// rank 0 waited in the broadcasts until the group's timeout. Both now fail
// every rank at once, naming the values, and the group stays usable.
DDP_TEST_WORKER(consolidate_to_differs) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int rank = pg->rank();
  auto model = Mlp(1);
  ZeroRedundancyOptimizer zero(model->NamedParameters(), pg, MakeOptimizer);
  const std::vector<std::pair<int, std::string>> cases = {
      {rank, "rank 0 passed to = 0 and rank 1 passed to = 1; every rank must name the same receiving rank"},
      {rank == 1 ? 5 : 0, "rank 0 passed to = 0 and rank 1 passed to = 5; every rank must name the same "
                          "receiving rank"}};
  for (const auto& [to, expected] : cases) {
    const auto start = std::chrono::steady_clock::now();
    std::string error = "(nothing thrown)";
    try {
      zero.ConsolidatedStateDict(to);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
    WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout");
    WORKER_EXPECT(error == "ZeroRedundancyOptimizer::ConsolidatedStateDict: " + expected, "error: " + error);
  }
  WORKER_EXPECT(zero.ConsolidatedStateDict(1).empty() == (rank != 1), "the group is not usable after");
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, ConsolidatedStateDictWithADifferentToPerRankFailsEveryRankNamingThem) {
  auto run = RunWorkers("consolidate_to_differs", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(ZeroRedundancyOptimizerTest, ConsolidatedStateEqualsTheUnshardedOnesAndResumes) {
  auto run = RunWorkers("consolidate", 2,
                        {{"DDP_TEST_OPTIM", "adam"}, {"DDP_TEST_CKPT", TempPath("ckpt.safetensors")}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A key naming no parameter fails every rank; an entry only one rank's
// shard refuses fails that rank with the reason and the others naming it.
DDP_TEST_WORKER(bad_state) {
  auto pg = testing::WorkerGroup();
  auto model = Mlp(1);
  DistributedDataParallel ddp(model, {.process_group = pg});
  ZeroRedundancyOptimizer zero(model->NamedParameters(), pg, MakeOptimizer);
  TrainStep(ddp, zero, *pg, 0);
  NamedTensors state = zero.ConsolidatedStateDict(0);
  // Every rank needs the whole state: rank 0 has it; the others rebuild the
  // keys from rank 0's list through a checkpoint file.
  const std::string path = std::getenv("DDP_TEST_CKPT");
  nn::io::Checkpoint c;
  c.optimizer = state;
  SaveCheckpoint(*pg, path, c);
  state = LoadCheckpoint(*pg, path).optimizer;

  NamedTensors unknown = state;
  unknown.emplace_back("state.nope.momentum_buffer", nn::Empty({1}));
  try {
    zero.LoadStateDict(unknown);
    WORKER_EXPECT(false, "an unknown key was accepted");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("`state.nope.momentum_buffer` names no parameter") !=
                      std::string::npos,
                  e.what());
  }

  // A wrong shape for the last parameter, which only the last rank holds,
  // and for the first, which every rank holds a piece of (the MLP's first
  // weight is most of its elements).
  const NamedParameters params = model->NamedParameters();
  const int last = pg->size() - 1;
  for (size_t which : {params.size() - 1, size_t{0}}) {
    NamedTensors wrong;
    for (const auto& [key, t] : state) {
      const bool hit = key.rfind("state." + params[which].first + ".", 0) == 0 && t.dim() > 0;
      wrong.emplace_back(key, hit ? nn::Empty({3}) : t);
    }
    int holders = 0;
    bool mine = false;
    for (int r = 0; r < pg->size(); ++r) {
      for (const Slice& s : zero.shard(r)) {
        holders += s.param == which;
        mine |= s.param == which && r == pg->rank();
      }
    }
    WORKER_EXPECT(which == 0 ? holders == pg->size() : holders == 1 && zero.shard(last).back().param == which,
                  "parameter " + std::to_string(which) + " has " + std::to_string(holders) + " holders");
    try {
      zero.LoadStateDict(wrong);
      WORKER_EXPECT(false, "a wrong shape was accepted");
    } catch (const std::invalid_argument& e) {
      const std::string m = e.what();
      if (mine) {
        WORKER_EXPECT(m.find("`state." + params[which].first + ".") != std::string::npos &&
                          m.find("` is [3]; parameter `" + params[which].first + "` is " +
                                 nn::ShapeToString(params[which].second.shape())) != std::string::npos,
                      m);
      } else {
        // With the last rank's reason.
        WORKER_EXPECT(m.find("failed on rank " + std::to_string(last) + ": ") != std::string::npos &&
                          m.find("` is [3]; parameter `" + params[which].first + "`") != std::string::npos,
                      m);
      }
    }
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, BadStateFailsEveryRank) {
  auto run = RunWorkers("bad_state", 2, {{"DDP_TEST_CKPT", TempPath("bad.safetensors")}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A state whose only fault lies in the last rank's shard (a "step" of 0
// for the last parameter, which ShardOf passes on as it is) fails every
// rank, and no rank loads its part: the others' state, learning rate
// included, stays as it was.
DDP_TEST_WORKER(load_all_or_nothing) {
  auto pg = testing::WorkerGroup();
  auto model = Mlp(1);
  DistributedDataParallel ddp(model, {.process_group = pg});
  ZeroRedundancyOptimizer zero(model->NamedParameters(), pg, MakeOptimizer);
  TrainStep(ddp, zero, *pg, 0);
  nn::io::Checkpoint c;
  c.optimizer = zero.ConsolidatedStateDict(0);
  const std::string path = std::getenv("DDP_TEST_CKPT");
  SaveCheckpoint(*pg, path, c);
  const NamedTensors state = LoadCheckpoint(*pg, path).optimizer;
  TrainStep(ddp, zero, *pg, 1);  // the state moves on from the saved one
  const NamedTensors before = zero.local().StateDict();
  const double lr = zero.lr();

  const NamedParameters params = model->NamedParameters();
  const int last = pg->size() - 1;
  WORKER_EXPECT(zero.shard(last).back().param == params.size() - 1 &&
                    zero.shard(last - 1).back().param != params.size() - 1,
                "the last parameter is not the last rank's alone");
  const std::string bad_key = "state." + params.back().first + ".step";
  NamedTensors bad;
  for (const auto& [key, t] : state) {
    if (key == bad_key) {
      bad.emplace_back(key, t.Clone().Fill(0));
    } else if (key == "lr") {
      bad.emplace_back(key, nn::FromVector({0.125}, {}, {.dtype = nn::DType::kFloat64}));
    } else {
      bad.emplace_back(key, t);
    }
  }
  try {
    zero.LoadStateDict(bad);
    WORKER_EXPECT(false, "a step of 0 was accepted");
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    // The other ranks are told the reason the last rank gave, not only its number.
    WORKER_EXPECT(m.find("`" + bad_key + "` is 0") != std::string::npos &&
                      (pg->rank() == last || m.find("failed on rank " + std::to_string(last) + ": ") != std::string::npos),
                  m);
  }
  const std::string on = " on rank " + std::to_string(pg->rank());
  WORKER_EXPECT(zero.lr() == lr, "the learning rate changed to " + std::to_string(zero.lr()) + on);
  const NamedTensors after = zero.local().StateDict();
  WorkerExpectSameState(after, before, "the state" + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, StateBadForOneShardLoadsOnNoRank) {
  auto run = RunWorkers("load_all_or_nothing", 2, {{"DDP_TEST_CKPT", TempPath("half.safetensors")}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A state saved by an optimizer over fewer parameters (Adam over `a`
// alone) is refused, as the unsharded optimizer refuses it: it lists every
// parameter it was saved with, and `b`, trained here, is not among them.
// Rank 1 owns `b` alone; its pieces are detached views, which the shard's
// optimizer took for frozen parameters, so every rank loaded the state and
// `b`'s moments and step silently started from zero. Without the list
// entry (the way to add parameters) the same state loads.
DDP_TEST_WORKER(state_missing_a_parameter) {
  auto pg = testing::WorkerGroup();
  const std::string on = " on rank " + std::to_string(pg->rank());
  nn::Generator gen(7);
  const NamedParameters ab = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                              {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
  auto adam = [](NamedParameters p) {
    return std::make_unique<nn::optim::Adam>(std::move(p), nn::optim::AdamOptions{.lr = 0.01});
  };
  ZeroRedundancyOptimizer zero(ab, pg, adam);
  const std::vector<Slice> own_a = {{.param = 0, .offset = 0, .length = 32}};
  const std::vector<Slice> own_b = {{.param = 1, .offset = 0, .length = 32}};
  WORKER_EXPECT(zero.shard(0) == own_a && zero.shard(1) == own_b, "rank 0 does not own `a` alone and rank 1 `b` alone");
  NamedTensors saved;
  {
    const NamedParameters only_a = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
    only_a[0].second.set_grad(nn::Randn({32}, {}, gen));
    auto opt = adam(only_a);
    opt->Step();
    saved = opt->StateDict();
  }
  // The unsharded optimizer's refusal, which ZeRO's must match.
  try {
    adam(ab)->LoadStateDict(saved);
    WORKER_EXPECT(false, "the unsharded Adam accepted a state without `b`");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("`b` is not in the state") != std::string::npos, e.what());
  }
  const NamedTensors before = zero.local().StateDict();
  try {
    zero.LoadStateDict(saved);
    WORKER_EXPECT(false, "a state without `b` was loaded" + on);
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    WORKER_EXPECT(pg->rank() == 1 ? m.find("parameter `b` is not in the state") != std::string::npos
                                  : m.find("failed on rank 1") != std::string::npos,
                  m + on);
  }
  const NamedTensors after = zero.local().StateDict();
  WorkerExpectSameState(after, before, "the state" + on);
  // Without the list entry, `b` starts afresh and `a` keeps its state.
  NamedTensors unlisted = saved;
  std::erase_if(unlisted, [](const auto& e) { return e.first == "group.params_listed"; });
  zero.LoadStateDict(unlisted);
  if (pg->rank() == 0) {
    int64_t a_steps = -1;
    for (const auto& [key, t] : zero.local().StateDict()) {
      if (key == "state.a.step") a_steps = t.ToVector<int64_t>().at(0);
    }
    WORKER_EXPECT(a_steps == 1, "`a` holds " + std::to_string(a_steps) + " steps after the load, not 1");
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, StateMissingATrainedParameterIsRefusedOnEveryRank) {
  auto run = RunWorkers("state_missing_a_parameter", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A state entry with the parameter's element count but another shape (a
// transposed momentum buffer) is refused, as the unsharded optimizer
// refuses it, naming the key and both shapes; before, it was cut into
// pieces as if it were the parameter's and loaded. Rank 0 owns `w`
// alone; no rank loads anything.
DDP_TEST_WORKER(state_entry_of_another_shape) {
  auto pg = testing::WorkerGroup();
  const std::string on = " on rank " + std::to_string(pg->rank());
  nn::Generator gen(9);
  const NamedParameters params = {{"w", nn::Randn({4, 8}, {}, gen).set_requires_grad(true)},
                                  {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
  const nn::optim::SgdOptions options{.lr = 0.05, .momentum = 0.9};
  auto sgd = [&](NamedParameters p) { return std::make_unique<nn::optim::Sgd>(std::move(p), options); };
  ZeroRedundancyOptimizer zero(params, pg, sgd);
  const std::vector<Slice> own_w = {{.param = 0, .offset = 0, .length = 32}};
  WORKER_EXPECT(zero.shard(0) == own_w, "rank 0 does not own `w` alone");
  NamedTensors saved;
  {
    const NamedParameters copies = {{"w", nn::Randn({4, 8}, {}, gen).set_requires_grad(true)},
                                    {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
    for (const auto& [name, p] : copies) p.set_grad(nn::Randn(p.shape(), {}, gen));
    auto opt = sgd(copies);
    opt->Step();
    saved = opt->StateDict();
  }
  for (auto& [key, t] : saved) {
    if (key == "state.w.momentum_buffer") t = t.Contiguous().View({8, 4});
  }
  // The unsharded optimizer's refusal, which ZeRO's must match.
  try {
    sgd(params)->LoadStateDict(saved);
    WORKER_EXPECT(false, "the unsharded SGD accepted a [8, 4] momentum for a [4, 8] parameter");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("`state.w.momentum_buffer` is f32 [8, 4]") != std::string::npos,
                  e.what());
  }
  const NamedTensors before = zero.local().StateDict();
  std::string message = "loaded";
  try {
    zero.LoadStateDict(saved);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  WORKER_EXPECT(pg->rank() == 0 ? message.find("state entry `state.w.momentum_buffer` is [8, 4]; parameter `w` is "
                                               "[4, 8]") != std::string::npos
                                : message.find("failed on rank 0") != std::string::npos,
                message + on);
  WorkerExpectSameState(zero.local().StateDict(), before, "the state" + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AStateEntryOfAnotherShapeIsRefusedOnEveryRank) {
  auto run = RunWorkers("state_entry_of_another_shape", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A parameter of no elements is in no shard, so no shard's optimizer
// checked its entries: a state whose step for it is f32, or with a
// momentum of 3 elements for it, loaded on every rank, where the unsharded
// optimizer refuses it. Every rank now refuses it, naming the entry, and
// loads nothing.
DDP_TEST_WORKER(empty_parameter_entries) {
  auto pg = testing::WorkerGroup();
  const std::string on = " on rank " + std::to_string(pg->rank());
  nn::Generator gen(13);
  const NamedParameters params = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                                  {"e", nn::Zeros({0}).set_requires_grad(true)},
                                  {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
  const nn::optim::SgdOptions options{.lr = 0.05, .momentum = 0.9};
  auto sgd = [&](NamedParameters p) { return std::make_unique<nn::optim::Sgd>(std::move(p), options); };
  ZeroRedundancyOptimizer zero(params, pg, sgd);
  const NamedTensors saved = sgd(params)->StateDict();
  const std::vector<std::pair<NamedTensors, std::string>> cases = {
      {[&] {
         NamedTensors state = saved;
         for (auto& [key, t] : state) {
           if (key == "state.e.step") t = nn::Zeros({});
         }
         return state;
       }(),
       "state entry `state.e.step` is f32 [], expected an i64 [] step >= 0"},
      {[&] {
         NamedTensors state = saved;
         state.emplace_back("state.e.momentum_buffer", nn::Zeros({3}));
         return state;
       }(),
       "state entry `state.e.momentum_buffer` is f32 [3]; parameter `e` is [0]"},
  };
  const NamedTensors before = zero.local().StateDict();
  for (const auto& [state, want] : cases) {
    bool plain_refused = false;
    try {
      sgd(params)->LoadStateDict(state);
    } catch (const std::invalid_argument&) {
      plain_refused = true;
    }
    WORKER_EXPECT(plain_refused, "the unsharded SGD accepted the state that ZeRO must refuse with: " + want);
    std::string message = "loaded";
    try {
      zero.LoadStateDict(state);
    } catch (const std::invalid_argument& e) {
      message = e.what();
    }
    WORKER_EXPECT(message.find(want) != std::string::npos, message + on);
    WorkerExpectSameState(zero.local().StateDict(), before, "the state" + on);
  }
  zero.LoadStateDict(saved);  // its own step 0 loads
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, BadEntriesOfAParameterWithNoElementsAreRefusedOnEveryRank) {
  auto run = RunWorkers("empty_parameter_entries", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// An SGD whose Name() runs out of memory while `fail_name` is set: the
// shard's check of a state asks for it (the state names its optimizer).
// With `names_before_failure` >= 0, it runs out of memory once that many
// calls of Name() have passed (one per check of a state).
bool fail_name = false;
int names_before_failure = -1;
class SgdOutOfMemory : public nn::optim::Sgd {
 public:
  using nn::optim::Sgd::Sgd;
  const char* Name() const override {
    if (fail_name) throw std::bad_alloc();
    if (names_before_failure == 0) throw std::bad_alloc();
    if (names_before_failure > 0) --names_before_failure;
    return nn::optim::Sgd::Name();
  }
};

// Rank 1's check of its shard runs out of memory: that is rank 1's own
// failure, not a refusal of the state, so it reaches the caller as the
// std::bad_alloc it was, and rank 0 fails at once with a DistributedError
// naming rank 1. Before, both threw std::invalid_argument, which the
// trainer reports as a checkpoint it cannot use (exit status 2).
DDP_TEST_WORKER(shard_check_out_of_memory) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string on = " on rank " + std::to_string(pg->rank());
  nn::Generator gen(7);
  const NamedParameters ab = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                              {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
  const nn::optim::SgdOptions options{.lr = 0.05, .momentum = 0.9};
  ZeroRedundancyOptimizer zero(ab, pg, [&](NamedParameters p) {
    return std::make_unique<SgdOutOfMemory>(std::move(p), options);
  });
  const std::vector<Slice> own_b = {{.param = 1, .offset = 0, .length = 32}};
  WORKER_EXPECT(zero.shard(1) == own_b, "rank 1 does not own `b` alone");
  NamedTensors saved;
  {
    const NamedParameters copies = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                                    {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
    for (const auto& [name, p] : copies) p.set_grad(nn::Randn({32}, {}, gen));
    nn::optim::Sgd opt(copies, options);
    opt.Step();
    saved = opt.StateDict();
  }
  const NamedTensors before = zero.local().StateDict();
  fail_name = pg->rank() == 1;
  const auto start = std::chrono::steady_clock::now();
  std::string outcome = "loaded";
  try {
    zero.LoadStateDict(saved);
  } catch (const std::invalid_argument& e) {
    outcome = std::string("std::invalid_argument: ") + e.what();
  } catch (const std::bad_alloc&) {
    outcome = "std::bad_alloc";
  } catch (const DistributedError& e) {
    outcome = std::string("DistributedError: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  fail_name = false;
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout" + on);
  WORKER_EXPECT(pg->rank() == 1 ? outcome == "std::bad_alloc"
                                : outcome.rfind("DistributedError: ", 0) == 0 &&
                                      outcome.find("failed on rank 1") != std::string::npos,
                outcome + on);
  WorkerExpectSameState(zero.local().StateDict(), before, "the state" + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AShardCheckOutOfMemoryKeepsItsTypeAndFailsEveryRank) {
  auto run = RunWorkers("shard_check_out_of_memory", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1's check of its shard fails with a long reason (16 KB) while
// memory runs short: allocations of 4 KB or more fail from the throw on.
// Rank 1 still tells rank 0, which fails at once naming it, its reason
// cut to about 1 KB, and rank 1 gets its own exception as it came. Rank 1
// copied the reason into a string before the exchange, which threw a
// second std::bad_alloc there: rank 1 left without the exchange and rank 0
// waited for it until the timeout.
bool fail_name_at_length = false;
class SgdFailingLong : public nn::optim::Sgd {
 public:
  using nn::optim::Sgd::Sgd;
  const char* Name() const override {
    if (fail_name_at_length) {
      const std::runtime_error failure("device out of memory: " + std::string(16000, 'm'));
      big_allocations_fail = true;
      throw failure;
    }
    return nn::optim::Sgd::Name();
  }
};

DDP_TEST_WORKER(shard_check_fails_again_while_telling) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string on = " on rank " + std::to_string(pg->rank());
  nn::Generator gen(7);
  const NamedParameters ab = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                              {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
  const nn::optim::SgdOptions options{.lr = 0.05, .momentum = 0.9};
  ZeroRedundancyOptimizer zero(ab, pg, [&](NamedParameters p) {
    return std::make_unique<SgdFailingLong>(std::move(p), options);
  });
  const NamedTensors saved = nn::optim::Sgd(ab, options).StateDict();
  const NamedTensors before = zero.local().StateDict();
  fail_name_at_length = pg->rank() == 1;
  const auto start = std::chrono::steady_clock::now();
  std::exception_ptr thrown;
  try {
    zero.LoadStateDict(saved);
  } catch (...) {
    big_allocations_fail = false;
    thrown = std::current_exception();
  }
  big_allocations_fail = false;
  fail_name_at_length = false;
  std::string outcome = "loaded";
  try {
    if (thrown) std::rethrow_exception(thrown);
  } catch (const DistributedError& e) {
    outcome = std::string("DistributedError: ") + e.what();
  } catch (const std::bad_alloc&) {
    outcome = "std::bad_alloc";
  } catch (const std::runtime_error& e) {
    outcome = std::string("std::runtime_error: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  if (pg->rank() == 1) {
    WORKER_EXPECT(outcome.rfind("std::runtime_error: device out of memory: mmm", 0) == 0, outcome.substr(0, 200) + on);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout" + on);
  WORKER_EXPECT(outcome.rfind("DistributedError: ", 0) == 0 &&
                    outcome.find("failed on rank 1: device out of memory: mmm") != std::string::npos &&
                    outcome.find("m... (not a refusal of the state") != std::string::npos && outcome.size() < 2048,
                outcome.substr(0, 300) + on);
  WorkerExpectSameState(zero.local().StateDict(), before, "the state" + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AShardCheckFailingAgainWhileTellingThePeersStillTellsThem) {
  auto run = RunWorkers("shard_check_fails_again_while_telling", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Ranks 1 and 2, which hold a piece each of a parameter whose name is
// 100 KB long, refuse a state for a momentum of the wrong shape: rank 0,
// which accepts its shard, names them once, together, with the reason
// cut to about 1 KB. Its message held each refusing rank's whole reason,
// about 200 KB here, growing with the number of ranks that refused.
DDP_TEST_WORKER(long_refusals) {
  auto pg = testing::WorkerGroup();
  const std::string on = " on rank " + std::to_string(pg->rank());
  nn::Generator gen(11);
  const std::string long_name = "L" + std::string(100000, 'x');
  const NamedParameters params = {{"a", nn::Randn({64}, {}, gen).set_requires_grad(true)},
                                  {long_name, nn::Randn({128}, {}, gen).set_requires_grad(true)}};
  const nn::optim::SgdOptions options{.lr = 0.05, .momentum = 0.9};
  auto sgd = [&](NamedParameters p) { return std::make_unique<nn::optim::Sgd>(std::move(p), options); };
  ZeroRedundancyOptimizer zero(params, pg, sgd);
  WORKER_EXPECT(zero.shard(0).size() == 1 && zero.shard(0)[0].param == 0 && zero.shard(1).size() == 1 &&
                    zero.shard(1)[0].param == 1 && zero.shard(2).size() == 1 && zero.shard(2)[0].param == 1,
                "rank 0 does not own `a` alone, or ranks 1 and 2 not a piece each of the long name");
  NamedTensors saved;
  {
    const NamedParameters copies = {{"a", nn::Randn({64}, {}, gen).set_requires_grad(true)},
                                    {long_name, nn::Randn({128}, {}, gen).set_requires_grad(true)}};
    for (const auto& [name, p] : copies) p.set_grad(nn::Randn(p.shape(), {}, gen));
    auto opt = sgd(copies);
    opt->Step();
    saved = opt->StateDict();
  }
  const std::string key = "state." + long_name + ".momentum_buffer";
  bool replaced = false;
  for (auto& [k, t] : saved) {
    if (k == key) {
      t = nn::Zeros({3});
      replaced = true;
    }
  }
  WORKER_EXPECT(replaced, "the state has no momentum for the long name");
  std::string message = "loaded";
  try {
    zero.LoadStateDict(saved);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  const std::string reason = "state entry `" + key + "` is [3]; parameter `" + long_name + "` is [128]";
  if (pg->rank() == 0) {
    WORKER_EXPECT(message.rfind("ZeroRedundancyOptimizer::LoadStateDict failed on ranks 1-2: state entry "
                                "`state.Lxxx",
                                0) == 0 &&
                      message.size() < 1200 && message.compare(message.size() - 6, 6, "xxx...") == 0,
                  message.substr(0, 200) + " (" + std::to_string(message.size()) + " bytes)" + on);
  } else {
    WORKER_EXPECT(message == "ZeroRedundancyOptimizer::LoadStateDict: " + reason,
                  message.substr(0, 200) + " (" + std::to_string(message.size()) + " bytes)" + on);
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, RefusalsWithLongReasonsAreGroupedAndCut) {
  auto run = RunWorkers("long_refusals", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1 runs out of memory in the load itself, after every rank's check
// passed and rank 0 loaded its shard: rank 1 ends the group, so that rank
// 0's next Step fails at once with the reason instead of waiting for rank
// 1's shard in the broadcast until the timeout.
DDP_TEST_WORKER(shard_load_out_of_memory) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string on = " on rank " + std::to_string(pg->rank());
  nn::Generator gen(7);
  const NamedParameters ab = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                              {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
  const nn::optim::SgdOptions options{.lr = 0.05, .momentum = 0.9};
  ZeroRedundancyOptimizer zero(ab, pg, [&](NamedParameters p) {
    return std::make_unique<SgdOutOfMemory>(std::move(p), options);
  });
  nn::optim::Sgd plain(ab, options);
  const NamedTensors saved = plain.StateDict();
  names_before_failure = pg->rank() == 1 ? 1 : -1;  // the check passes, the load fails
  std::string outcome = "loaded";
  try {
    zero.LoadStateDict(saved);
  } catch (const std::bad_alloc&) {
    outcome = "std::bad_alloc";
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  names_before_failure = -1;
  WORKER_EXPECT(outcome == (pg->rank() == 1 ? "std::bad_alloc" : "loaded"), outcome + on);
  if (pg->rank() == 1) {
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  for (const auto& [name, p] : ab) p.set_grad(nn::Randn({32}, {}, gen));
  const auto start = std::chrono::steady_clock::now();
  outcome = "stepped";
  try {
    zero.Step();
  } catch (const std::exception& e) {
    outcome = e.what();
  }
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout" + on);
  WORKER_EXPECT(outcome.find("LoadStateDict failed on rank 1") != std::string::npos, outcome + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AShardLoadFailingOnOneRankFailsTheOthersNextStepAtOnce) {
  auto run = RunWorkers("shard_load_out_of_memory", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1 has no memory for rank 0's state as it arrives in
// ConsolidatedStateDict (its address space is capped a little above what
// it maps, and rank 0's momentum is 32 MiB; rank 1's own shard has no
// state yet): it ends the group, so that rank 0, sending, fails at once
// naming it. Before, rank 1 threw alone and rank 0 waited in the
// broadcast until the timeout.
DDP_TEST_WORKER(consolidate_receive_out_of_memory) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string on = " on rank " + std::to_string(pg->rank());
  constexpr int64_t kElements = int64_t{8} << 20;
  const NamedParameters ab = {{"a", nn::Zeros({kElements}).set_requires_grad(true)},
                              {"b", nn::Zeros({kElements}).set_requires_grad(true)}};
  ZeroRedundancyOptimizer zero(ab, pg, [](NamedParameters p) {
    return std::make_unique<nn::optim::Sgd>(std::move(p), nn::optim::SgdOptions{.lr = 0.05, .momentum = 0.9});
  });
  const std::vector<Slice> own_a = {{.param = 0, .offset = 0, .length = kElements}};
  WORKER_EXPECT(zero.shard(0) == own_a, "rank 0 does not own `a` alone");
  ab[0].second.set_grad(nn::Ones({kElements}));
  zero.Step();  // only `a` steps: rank 0 holds its momentum
  nn::CpuAllocator().EmptyCache();  // no cached block to take the 32 MiB from
  pg->Barrier().Wait();  // the communication thread runs before the limit
  std::optional<testing::AddressSpaceLimit> limit;
  if (pg->rank() == 1) {
    limit.emplace(8 << 20);
    WORKER_EXPECT(limit->ok(), "no VmSize in /proc/self/status");
  }
  const auto start = std::chrono::steady_clock::now();
  std::string outcome = "consolidated";
  try {
    zero.ConsolidatedStateDict(0);
  } catch (const std::bad_alloc&) {
    outcome = "std::bad_alloc";
  } catch (const DistributedError& e) {
    outcome = std::string("DistributedError: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  limit.reset();
  if (pg->rank() == 1) {
    WORKER_EXPECT(outcome == "std::bad_alloc", outcome + on);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout" + on);
  WORKER_EXPECT(outcome.rfind("DistributedError: ", 0) == 0 &&
                    outcome.find("ConsolidatedStateDict failed on rank 1") != std::string::npos,
                outcome + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, APeersStateWithoutMemoryToReceiveItFailsEveryRankAtOnce) {
  auto run = RunWorkers("consolidate_receive_out_of_memory", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Thrown by rank 1's optimizer below: not derived from std::exception.
struct NotAStdException {};
bool throw_not_std = false;
// An SGD that throws NotAStdException from its update and its Name() (the
// state dict names its optimizer) while `throw_not_std` is set.
class SgdThrowingNotStd : public nn::optim::Sgd {
 public:
  using nn::optim::Sgd::Sgd;
  const char* Name() const override {
    if (throw_not_std) throw NotAStdException{};
    return nn::optim::Sgd::Name();
  }

 protected:
  void Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool fresh,
              float grad_scale) override {
    if (throw_not_std) throw NotAStdException{};
    nn::optim::Sgd::Update(group, p, g, slots, n, step, fresh, grad_scale);
  }
  using nn::optim::Sgd::Update;
};

// Rank 1 throws something that is not a std::exception (per
// DDP_TEST_WHERE: from its factory, from its optimizer's state dict while
// the constructor compares the ranks' options, from its shard's step, or
// from its state dict in ConsolidatedStateDict):
// every rank fails at once, rank 0 naming rank 1, instead of rank 0
// waiting for rank 1 until the timeout (the handlers that tell the peers
// caught std::exception only). Rank 1's own exception reaches its caller
// as it came, except in the constructor, where every rank throws the
// agreed std::invalid_argument.
DDP_TEST_WORKER(not_std_exception) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string where = std::getenv("DDP_TEST_WHERE");
  const std::string on = " on rank " + std::to_string(pg->rank()) + " (" + where + ")";
  const bool failing = pg->rank() == 1;
  nn::Generator gen(5);
  const NamedParameters ab = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                              {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
  for (const auto& [name, p] : ab) p.set_grad(nn::Randn({32}, {}, gen));
  const auto make = [&](NamedParameters p) -> std::unique_ptr<nn::optim::Optimizer> {
    if (where == "factory" && failing) throw NotAStdException{};
    return std::make_unique<SgdThrowingNotStd>(std::move(p), nn::optim::SgdOptions{.lr = 0.05, .momentum = 0.9});
  };
  const auto start = std::chrono::steady_clock::now();
  std::string outcome = "no error";
  try {
    // "options": rank 1's shard optimizer throws when the constructor
    // reads its options, after the factory's outcome was agreed.
    throw_not_std = where == "options" && failing;
    ZeroRedundancyOptimizer zero(ab, pg, make);
    throw_not_std = failing;
    if (where == "step") zero.Step();
    if (where == "consolidate") zero.ConsolidatedStateDict(0);
  } catch (const NotAStdException&) {
    outcome = "NotAStdException";
  } catch (const std::exception& e) {
    outcome = e.what();
  }
  throw_not_std = false;
  const bool building = where == "factory" || where == "options";
  const std::string reason = building           ? "ZeroRedundancyOptimizer: building the optimizer of rank 1's "
                                                   "shard failed: an exception that is not a std::exception"
                             : where == "step" ? "ZeroRedundancyOptimizer::Step failed on rank 1: an exception "
                                                 "that is not a std::exception"
                                               : "ZeroRedundancyOptimizer::ConsolidatedStateDict failed on rank 1: "
                                                 "an exception that is not a std::exception";
  if (failing) {
    WORKER_EXPECT(outcome == (building ? reason : "NotAStdException"), outcome + on);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout" + on);
  WORKER_EXPECT(outcome.find(reason) != std::string::npos, outcome + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AThrowNotDerivedFromStdExceptionOnOneRankFailsEveryRankAtOnce) {
  for (const char* where : {"factory", "options", "step", "consolidate"}) {
    auto run = RunWorkers("not_std_exception", 2, {{"DDP_TEST_WHERE", where}});
    EXPECT_TRUE(run.AllSucceeded()) << where << "\n" << testing::AllOutput(run);
  }
}

// A parameter name may hold a tab (only newlines are refused): the list of
// state entries rank 1 sends before its tensors was split at the first tab
// of each line, so rank 0 read `state.w` with a garbled dtype and shape
// for `w\tone`'s entries and the consolidation failed. Rank 1 owns
// `w\tone` here; rank 0 gathers the state, which must equal the unsharded
// optimizer's.
DDP_TEST_WORKER(tab_in_a_name) {
  auto pg = testing::WorkerGroup();
  auto make_params = [] {
    nn::Generator gen(11);
    return NamedParameters{{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                           {"w\tone", nn::Randn({4, 8}, {}, gen).set_requires_grad(true)}};
  };
  auto adam = [](NamedParameters p) {
    return std::make_unique<nn::optim::Adam>(std::move(p), nn::optim::AdamOptions{.lr = 0.01});
  };
  const NamedParameters sharded = make_params(), plain = make_params();
  ZeroRedundancyOptimizer zero(sharded, pg, adam);
  const std::vector<Slice> owns_w = {{.param = 1, .offset = 0, .length = 32}};
  WORKER_EXPECT(zero.shard(1) == owns_w, "rank 1 does not own `w\\tone` alone");
  auto opt = adam(plain);
  nn::Generator gen(12);
  for (size_t i = 0; i < sharded.size(); ++i) {
    const Tensor grad = nn::Randn(sharded[i].second.shape(), {}, gen);
    sharded[i].second.set_grad(grad);
    plain[i].second.set_grad(grad.Clone());
  }
  zero.Step();
  opt->Step();
  const NamedTensors whole = zero.ConsolidatedStateDict(0);
  if (pg->rank() == 0) {
    const NamedTensors want = opt->StateDict();
    WorkerExpectSameState(whole, want, "the consolidated state");
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, ATabInAParameterNameSurvivesConsolidation) {
  auto run = RunWorkers("tab_in_a_name", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The partition comes from each rank's own list: rank 1 passing two
// same-shaped parameters swapped would have every rank step and broadcast
// the other's elements into them. Refused on both ranks at construction,
// naming the first difference.
DDP_TEST_WORKER(swapped_parameters) {
  auto pg = testing::WorkerGroup();
  NamedParameters params = {{"first.weight", nn::Zeros({4, 4})}, {"second.weight", nn::Zeros({4, 4})}};
  if (pg->rank() == 1) std::swap(params[0], params[1]);
  std::string message = "accepted";
  try {
    ZeroRedundancyOptimizer zero(params, pg, MakeOptimizer);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("ZeroRedundancyOptimizer: the ranks' parameter lists differ") != std::string::npos &&
                    message.find("First difference at parameter #0: rank 0 has `first.weight` f32 [4, 4]; rank 1 "
                                 "has `second.weight` f32 [4, 4].") != std::string::npos,
                "rank " + std::to_string(pg->rank()) + ": " + message);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, ParametersInADifferentOrderOnOneRankAreRefusedOnEveryRank) {
  auto run = RunWorkers("swapped_parameters", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A factory that fails on one rank only (here rank 1's) fails every rank
// at construction, naming the rank; before, rank 0 went on to Step and
// waited there for the timeout.
DDP_TEST_WORKER(factory_fails_on_one_rank) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  auto model = Mlp(1);
  const int rank = pg->rank();
  const auto start = std::chrono::steady_clock::now();
  std::string message = "accepted";
  try {
    ZeroRedundancyOptimizer zero(model->NamedParameters(), pg, [rank](NamedParameters shard) {
      if (rank == 1) throw std::runtime_error("no optimizer for this shard");
      return MakeOptimizer(std::move(shard));
    });
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  WORKER_EXPECT(message == "ZeroRedundancyOptimizer: building the optimizer of rank 1's shard failed: no "
                           "optimizer for this shard",
                "rank " + std::to_string(rank) + ": " + message);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout");
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AFactoryFailingOnOneRankFailsEveryRank) {
  auto run = RunWorkers("factory_fails_on_one_rank", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1's factory fails with a long reason (16 KB) while memory runs
// short: allocations of 4 KB or more fail from the throw on. Rank 1 still
// tells rank 0, with the reason's start, and every rank fails at once.
// Rank 1 built the text it sends from the whole what(), which threw a
// second std::bad_alloc before the exchange: rank 1 left the constructor
// alone and rank 0 waited for it until the timeout.
DDP_TEST_WORKER(factory_fails_again_while_telling) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string on = " on rank " + std::to_string(pg->rank());
  auto model = Mlp(1);
  const int rank = pg->rank();
  const auto start = std::chrono::steady_clock::now();
  std::exception_ptr thrown;
  try {
    ZeroRedundancyOptimizer zero(model->NamedParameters(), pg, [rank](NamedParameters shard) {
      if (rank == 1) {
        const std::runtime_error failure("device out of memory: " + std::string(16000, 'm'));
        big_allocations_fail = true;
        throw failure;
      }
      return MakeOptimizer(std::move(shard));
    });
  } catch (...) {
    big_allocations_fail = false;
    thrown = std::current_exception();
  }
  big_allocations_fail = false;
  std::string outcome = "built";
  try {
    if (thrown) std::rethrow_exception(thrown);
  } catch (const std::invalid_argument& e) {
    outcome = std::string("std::invalid_argument: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  const bool told = outcome.rfind("std::invalid_argument: ZeroRedundancyOptimizer failed on rank 1: device out of "
                                  "memory: mmm",
                                  0) == 0 &&
                    outcome.find("m (cut: memory ran short)") != std::string::npos;
  if (rank == 1) {
    WORKER_EXPECT(told, outcome.substr(0, 300) + on);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout" + on);
  WORKER_EXPECT(told, outcome.substr(0, 300) + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AFactoryFailingAgainWhileTellingThePeersStillFailsEveryRankAtOnce) {
  auto run = RunWorkers("factory_fails_again_while_telling", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Factories that build another optimizer on the last rank (another rate,
// another kind) would step its shard unlike the others' and hand every
// replica the result: refused on every rank, naming the option and each
// rank's value.
DDP_TEST_WORKER(factory_options_differ) {
  auto pg = testing::WorkerGroup();
  auto model = Mlp(1);
  const bool last = pg->rank() == pg->size() - 1;
  const std::vector<std::pair<ZeroRedundancyOptimizer::Factory, std::string>> cases = {
      {[last](NamedParameters shard) {
         return std::make_unique<nn::optim::Sgd>(std::move(shard), nn::optim::SgdOptions{.lr = last ? 0.1 : 0.05});
       },
       "`lr`"},
      {[last](NamedParameters shard) -> std::unique_ptr<nn::optim::Optimizer> {
         if (last) return std::make_unique<nn::optim::Adam>(std::move(shard), nn::optim::AdamOptions{.lr = 0.05});
         return std::make_unique<nn::optim::Sgd>(std::move(shard), nn::optim::SgdOptions{.lr = 0.05});
       },
       "`group.optimizer`"},
  };
  for (const auto& [make, named] : cases) {
    std::string message = "accepted";
    try {
      ZeroRedundancyOptimizer zero(model->NamedParameters(), pg, make);
    } catch (const std::invalid_argument& e) {
      message = e.what();
    }
    WORKER_EXPECT(message.find("the ranks' shard optimizers differ") != std::string::npos &&
                      message.find(named) != std::string::npos,
                  "rank " + std::to_string(pg->rank()) + ": " + message);
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, FactoriesBuildingOtherOptimizersOnOneRankAreRefusedOnEveryRank) {
  auto run = RunWorkers("factory_options_differ", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A list that only one rank's checks refuse (rank 1's `w` is a transposed,
// non-contiguous view; names, dtypes and shapes agree) fails every rank at
// construction, naming that rank; before, rank 1 threw alone and rank 0
// waited for it in the factory's agreement until the timeout.
DDP_TEST_WORKER(list_refused_on_one_rank) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int rank = pg->rank();
  NamedParameters params;
  params.emplace_back("b", nn::Zeros({4}));
  params.emplace_back("w", rank == 1 ? nn::Zeros({4, 4}).Transpose(0, 1) : nn::Zeros({4, 4}));
  const auto start = std::chrono::steady_clock::now();
  std::string message = "accepted";
  try {
    ZeroRedundancyOptimizer zero(params, pg, MakeOptimizer);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("not an invalid_argument: ") + e.what();
  }
  WORKER_EXPECT(message == "ZeroRedundancyOptimizer (rank 1): parameter `w` is not contiguous",
                "rank " + std::to_string(rank) + ": " + message);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout");
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AListRefusedOnOneRankFailsEveryRankAtOnce) {
  auto run = RunWorkers("list_refused_on_one_rank", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A Step that fails on one rank (rank 1 gave a parameter new memory) ends
// the group, so that rank 0 fails at once with the reason instead of
// waiting in the broadcast of rank 1's shard until the timeout.
DDP_TEST_WORKER(step_fails_on_one_rank) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  auto model = Mlp(1);
  DistributedDataParallel ddp(model, {.process_group = pg});
  ZeroRedundancyOptimizer zero(model->NamedParameters(), pg, MakeOptimizer);
  TrainStep(ddp, zero, *pg, 0);
  if (pg->rank() == 1) {
    const Tensor& first = model->NamedParameters()[0].second;
    first.SetData(nn::Zeros(first.shape()));
  }
  const auto start = std::chrono::steady_clock::now();
  std::string message = "no error";
  try {
    TrainStep(ddp, zero, *pg, 1);
  } catch (const std::exception& e) {
    message = e.what();
  }
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout");
  WORKER_EXPECT(message.find(pg->rank() == 1 ? "has new memory since the optimizer was built"
                                             : "ZeroRedundancyOptimizer::Step failed on rank 1") != std::string::npos,
                "rank " + std::to_string(pg->rank()) + ": " + message);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AStepFailingOnOneRankFailsTheOthersAtOnce) {
  auto run = RunWorkers("step_fails_on_one_rank", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1's shard optimizer fails in its update with a long reason (16 KB)
// while memory runs short: allocations of 4 KB or more fail from the
// throw on. Rank 1 still ends the group, so that rank 0 fails at once
// naming it, with the reason's start, and rank 1 gets its own exception as
// it came. Rank 1 built the abort's reason from the whole what(), which
// threw a second std::bad_alloc before the group was aborted: rank 0
// waited in the broadcast of rank 1's shard until the timeout.
bool fail_update_at_length = false;
std::string update_failure;  // when not empty, what Update throws, memory left as it is
class SgdUpdateFailingLong : public nn::optim::Sgd {
 public:
  using nn::optim::Sgd::Sgd;

 protected:
  void Update(size_t group, float* p, const float* g, float* const* slots, int64_t n, int64_t step, bool fresh,
              float grad_scale) override {
    if (!update_failure.empty()) throw std::runtime_error(update_failure);
    if (fail_update_at_length) {
      const std::runtime_error failure("device out of memory: " + std::string(16000, 'm'));
      big_allocations_fail = true;
      throw failure;
    }
    nn::optim::Sgd::Update(group, p, g, slots, n, step, fresh, grad_scale);
  }
  using nn::optim::Sgd::Update;
};

DDP_TEST_WORKER(step_fails_again_while_telling) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string on = " on rank " + std::to_string(pg->rank());
  nn::Generator gen(5);
  const NamedParameters ab = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                              {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
  for (const auto& [name, p] : ab) p.set_grad(nn::Randn({32}, {}, gen));
  ZeroRedundancyOptimizer zero(ab, pg, [](NamedParameters p) {
    return std::make_unique<SgdUpdateFailingLong>(std::move(p), nn::optim::SgdOptions{.lr = 0.05, .momentum = 0.9});
  });
  fail_update_at_length = pg->rank() == 1;
  const auto start = std::chrono::steady_clock::now();
  std::exception_ptr thrown;
  try {
    zero.Step();
  } catch (...) {
    big_allocations_fail = false;
    thrown = std::current_exception();
  }
  big_allocations_fail = false;
  fail_update_at_length = false;
  std::string outcome = "stepped";
  try {
    if (thrown) std::rethrow_exception(thrown);
  } catch (const DistributedError& e) {
    outcome = std::string("DistributedError: ") + e.what();
  } catch (const std::bad_alloc&) {
    outcome = "std::bad_alloc";
  } catch (const std::runtime_error& e) {
    outcome = std::string("std::runtime_error: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  if (pg->rank() == 1) {
    WORKER_EXPECT(outcome.rfind("std::runtime_error: device out of memory: mmm", 0) == 0, outcome.substr(0, 200) + on);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout" + on);
  WORKER_EXPECT(outcome.rfind("DistributedError: ", 0) == 0 &&
                    outcome.find("ZeroRedundancyOptimizer::Step failed on rank 1: device out of memory: mmm") !=
                        std::string::npos &&
                    outcome.size() < 2048,
                outcome.substr(0, 300) + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AStepFailingAgainWhileAbortingStillFailsTheOthersAtOnce) {
  auto run = RunWorkers("step_fails_again_while_telling", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Whether `text` is whole UTF-8 characters (none cut short at its end or
// elsewhere).
bool IsWholeUtf8(const std::string& text) {
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    const size_t n = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
    if (n == 0 || i + n > text.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) & 0xc0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

// Rank 1's shard optimizer fails with "x" then 300 two-byte characters
// (601 bytes): the reason rank 0 gets holds its first 512 bytes or less,
// ending on a character boundary. The cut at 512 bytes left half a
// character (a lone 0xC3) at its end.
DDP_TEST_WORKER(step_fails_with_a_long_accented_reason) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string on = " on rank " + std::to_string(pg->rank());
  nn::Generator gen(5);
  const NamedParameters ab = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                              {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
  for (const auto& [name, p] : ab) p.set_grad(nn::Randn({32}, {}, gen));
  ZeroRedundancyOptimizer zero(ab, pg, [](NamedParameters p) {
    return std::make_unique<SgdUpdateFailingLong>(std::move(p), nn::optim::SgdOptions{.lr = 0.05, .momentum = 0.9});
  });
  std::string accented = "x";
  for (int i = 0; i < 300; ++i) accented += "\xc3\xa9";
  if (pg->rank() == 1) update_failure = accented;
  std::string outcome = "stepped";
  try {
    zero.Step();
  } catch (const DistributedError& e) {
    outcome = std::string("DistributedError: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  update_failure.clear();
  if (pg->rank() == 1) {
    WORKER_EXPECT(outcome == "another exception: " + accented, outcome.substr(0, 200) + on);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  testing::MarkThisRankDone(*pg);
  const std::string told = "ZeroRedundancyOptimizer::Step failed on rank 1: x\xc3\xa9";
  WORKER_EXPECT(outcome.rfind("DistributedError: ", 0) == 0 && outcome.find(told) != std::string::npos, outcome + on);
  WORKER_EXPECT(IsWholeUtf8(outcome), "a character cut short in: " + outcome + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, TheAbortsReasonForAStepFailingOnOneRankEndsOnACharacterBoundary) {
  auto run = RunWorkers("step_fails_with_a_long_accented_reason", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A gradient of an integer dtype (SetData on the gradient) for `b`, which
// rank 1 owns alone, on every rank: every rank refuses the step naming it
// before any shard is stepped, so rank 0's `a` keeps its value. Only rank
// 1 refused it (handing its piece to its optimizer), after rank 0 had
// stepped `a`: rank 0 then failed in the broadcast with a changed `a`,
// rank 1's unchanged.
DDP_TEST_WORKER(gradient_of_another_dtype) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string on = " on rank " + std::to_string(pg->rank());
  nn::Generator gen(7);
  const NamedParameters ab = {{"a", nn::Randn({32}, {}, gen).set_requires_grad(true)},
                              {"b", nn::Randn({32}, {}, gen).set_requires_grad(true)}};
  ZeroRedundancyOptimizer zero(ab, pg, MakeOptimizer);
  const std::vector<Slice> own_b = {{.param = 1, .offset = 0, .length = 32}};
  WORKER_EXPECT(zero.shard(1) == own_b, "rank 1 does not own `b` alone");
  const Tensor a_before = ab[0].second.Detach().Clone();
  {
    nn::NoGradGuard guard;
    for (const auto& [name, p] : ab) p.set_grad(nn::Ones({32}));
    ab[1].second.grad().SetData(nn::Zeros({32}, {.dtype = nn::DType::kInt32}));
  }
  std::string outcome = "stepped";
  try {
    zero.Step();
  } catch (const std::invalid_argument& e) {
    outcome = std::string("std::invalid_argument: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  WORKER_EXPECT(outcome.find("std::invalid_argument: ") == 0 &&
                    outcome.find("gradient of `b` has dtype i32, the parameter f32") != std::string::npos,
                outcome + on);
  WORKER_EXPECT(SameBytes(ab[0].second.Detach(), a_before), "a refused step changed `a`" + on);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AGradientOfAnotherDtypeIsRefusedOnEveryRankBeforeAnyShardSteps) {
  auto run = RunWorkers("gradient_of_another_dtype", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A rank killed just before a collective call (Step, or
// ConsolidatedStateDict, per DDP_TEST_WHERE): the survivors fail with
// DistributedError naming the lost peer, well within the group's timeout,
// instead of waiting in a broadcast.
constexpr int kKilledTimeoutMs = 20000;
constexpr int kSurvivorExit = 42;

DDP_TEST_WORKER(killed_peer) {
  auto pg = testing::WorkerGroup();
  const std::string where = std::getenv("DDP_TEST_WHERE");
  auto model = Mlp(1);
  DistributedDataParallel ddp(model, {.process_group = pg});
  ZeroRedundancyOptimizer zero(model->NamedParameters(), pg, MakeOptimizer);
  TrainStep(ddp, zero, *pg, 0);
  const auto& data = testing::FashionMnist();
  auto [x, y] = testing::Batch(data, (pg->size() + pg->rank()) * kBatch, kBatch);
  zero.ZeroGrad();
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  // Killed only once every survivor's backward finished: one still in its
  // last bucket when the loss is detected would fail outside the try.
  if (pg->rank() != pg->size() - 1) {
    testing::MarkThisRankDone(*pg);
  } else {
    std::vector<int> survivors(static_cast<size_t>(pg->size() - 1));
    std::iota(survivors.begin(), survivors.end(), 0);
    testing::WaitUntilRanksAreDone(*pg, survivors);
    raise(SIGKILL);
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    if (where == "step") {
      zero.Step();
    } else {
      zero.ConsolidatedStateDict(0);
    }
    std::fprintf(stderr, "%s finished although a rank was killed\n", where.c_str());
    return 1;
  } catch (const DistributedError& e) {
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "survivor: failed after %.0f ms: %s\n", ms, e.what());
    WORKER_EXPECT(ms < kKilledTimeoutMs / 2, where + " took " + std::to_string(ms) + " ms");
    return testing::WorkerFailures() == 0 ? kSurvivorExit : 1;
  }
}

TEST(ZeroRedundancyOptimizerTest, APeerKilledFailsStepAndConsolidationWithinTheDeadline) {
  for (const char* where : {"step", "consolidate"}) {
    auto run = RunWorkers("killed_peer", 3,
                          {{"DDP_TEST_WHERE", where}, {"DDP_TEST_TIMEOUT_MS", std::to_string(kKilledTimeoutMs)}},
                          60000, /*stop_all_on_failure=*/false);
    const std::string out = testing::AllOutput(run);
    EXPECT_EQ(run.ExitCode(2), 128 + SIGKILL) << where << "\n" << out;
    for (int r : {0, 1}) {
      EXPECT_EQ(run.ExitCode(r), kSurvivorExit) << where << "\n" << out;
      EXPECT_NE(run.Output(r).find("rank 2"), std::string::npos) << where << "\n" << out;
    }
  }
}

// A peer lost while VerifyReplicas explains a difference (ZeRO's
// AddParamGroup and DDP's construction call it): the survivors fail naming
// the lost rank, and the group's abort reason is the transport's, not
// "comparing the ranks' models failed on rank <a survivor>" (a rank that
// was only waiting). Rank 1 plays its
// part in the exchanges until the survivors have all begun the comparison
// (their places reached it), then is killed.
DDP_TEST_WORKER(replicas_peer_lost) {
  auto pg = testing::WorkerGroup();
  const int64_t size = pg->size();
  if (pg->rank() == 1) {
    Tensor mine = nn::FromVectorOf<int64_t>({12345, 7}, {2});
    Tensor all = nn::Empty({2 * size}, {.dtype = nn::DType::kInt64});
    pg->AllGather(all, mine, "model fingerprint").Wait();
    Tensor reference = nn::Zeros({std::max<int64_t>(all.data<int64_t>()[1], 1)}, {.dtype = nn::DType::kUInt8});
    pg->Broadcast(reference, 0, "model description").Wait();
    Tensor place = nn::FromVectorOf<int64_t>({0, 0}, {2});
    Tensor places = nn::Empty({2 * size}, {.dtype = nn::DType::kInt64});
    pg->AllGather(places, place, "model difference").Wait();
    raise(SIGKILL);
  }
  std::string message = "no error";
  try {
    internal::VerifyReplicas(*pg, {{"parameter", "w", "f32 [2]"}}, "test: the models differ.");
  } catch (const DistributedError& e) {
    message = e.what();
  }
  std::fprintf(stderr, "survivor: %s\n", message.c_str());
  WORKER_EXPECT(message.find("rank 1") != std::string::npos, message);
  const std::string reason = pg->aborted_reason().ToString();
  WORKER_EXPECT(reason.find("comparing the ranks' models failed") == std::string::npos,
                "the group's abort reason blames a survivor: " + reason);
  return testing::WorkerFailures() == 0 ? kSurvivorExit : 1;
}

TEST(ZeroRedundancyOptimizerTest, APeerLostWhileComparingModelsIsNotBlamedOnASurvivor) {
  auto run = RunWorkers("replicas_peer_lost", 3, {{"DDP_TEST_TIMEOUT_MS", std::to_string(kKilledTimeoutMs)}},
                        60000, /*stop_all_on_failure=*/false);
  const std::string out = testing::AllOutput(run);
  EXPECT_EQ(run.ExitCode(1), 128 + SIGKILL) << out;
  for (int r : {0, 2}) EXPECT_EQ(run.ExitCode(r), kSurvivorExit) << out;
}

// ------------------------------------------------------ parameter groups ----

// Sharded over groups, with a scheduler driving each group from its own
// rate: bit for bit the unsharded optimizer; the consolidated state is the
// unsharded one's (the whole's group sizes, not a shard's), loads into a
// plain optimizer and into a sharded one on every rank; a state with other
// group sizes is refused naming the group.
DDP_TEST_WORKER(groups) {
  auto pg = testing::WorkerGroup();
  auto sharded = Mlp(3), plain = Mlp(3);
  DistributedDataParallel ddp_sharded(sharded, {.process_group = pg});
  DistributedDataParallel ddp_plain(plain, {.process_group = pg});
  ZeroRedundancyOptimizer zero(DecayGroups(sharded->NamedParameters()), pg, MakeGroupedOptimizer);
  auto opt = MakeGroupedOptimizer(DecayGroups(plain->NamedParameters()));
  nn::optim::LrScheduler sched_sharded(zero.local(), nn::optim::StepSchedule(2, 0.5));
  nn::optim::LrScheduler sched_plain(*opt, nn::optim::StepSchedule(2, 0.5));
  WORKER_EXPECT(zero.num_groups() == 2 && zero.local().num_groups() == 2, "groups of the shard's optimizer");
  for (int s = 0; s < 5; ++s) {
    TrainStep(ddp_sharded, zero, *pg, s);
    TrainStep(ddp_plain, *opt, *pg, s);
    sched_sharded.Step();
    sched_plain.Step();
    WORKER_EXPECT(testing::HashState(*sharded) == testing::HashState(*plain),
                  "step " + std::to_string(s) + ": sharded and unsharded training over groups differ");
  }
  WORKER_EXPECT(zero.lr(1) == opt->lr(1) && zero.lr(0) == opt->lr(0), "the groups' rates differ");
  try {
    zero.set_lr(0.1);
    WORKER_EXPECT(false, "one rate for two groups was accepted");
  } catch (const std::logic_error&) {
  }
  // Every rank gathers the whole state in turn, to compare it and load it.
  NamedTensors whole;
  for (int r = 0; r < pg->size(); ++r) {
    NamedTensors got = zero.ConsolidatedStateDict(r);
    if (r == pg->rank()) whole = std::move(got);
  }
  const NamedTensors expected = opt->StateDict();
  WorkerExpectSameState(whole, expected, "the consolidated state");
  auto other = Mlp(5);
  auto reloaded = MakeGroupedOptimizer(DecayGroups(other->NamedParameters()));
  reloaded->LoadStateDict(whole);
  ZeroRedundancyOptimizer zero2(DecayGroups(other->NamedParameters()), pg, MakeGroupedOptimizer);
  zero2.LoadStateDict(expected);
  for (int r = 0; r < pg->size(); ++r) {
    NamedTensors got = zero2.ConsolidatedStateDict(r);
    if (r != pg->rank()) continue;
    bool same = got.size() == expected.size();
    for (size_t i = 0; same && i < got.size(); ++i) {
      same = got[i].first == expected[i].first && SameBytes(got[i].second, expected[i].second);
    }
    WORKER_EXPECT(same, "the state loaded into another sharded optimizer is not the one saved");
  }
  // One bias moved into the weights' group: the sizes differ (the MLP's
  // three weights and three biases saved, 4 and 2 here).
  std::vector<nn::optim::ParamGroup> moved = DecayGroups(other->NamedParameters());
  moved[0].params.push_back(moved[1].params.back());
  moved[1].params.pop_back();
  ZeroRedundancyOptimizer zero3(moved, pg, MakeGroupedOptimizer);
  try {
    zero3.LoadStateDict(expected);
    WORKER_EXPECT(false, "a state with other group sizes was accepted");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("param group 0 has 3 parameter(s); this optimizer's has 4") !=
                      std::string::npos,
                  e.what());
  }
  // The groups in the other order: the same sizes (three each), other
  // parameters, so each group's options would go to the other's.
  std::vector<nn::optim::ParamGroup> swapped = DecayGroups(other->NamedParameters());
  std::swap(swapped[0], swapped[1]);
  ZeroRedundancyOptimizer zero4(swapped, pg, MakeGroupedOptimizer);
  try {
    zero4.LoadStateDict(expected);
    WORKER_EXPECT(false, "a state whose groups hold other parameters was accepted");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("param group 0 holds other parameters") != std::string::npos, e.what());
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, ParameterGroupsOnThreeRanksEqualTheUnshardedOptimizer) {
  auto run = RunWorkers("groups", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Ranks that put a parameter in different groups, or give a group other
// options, would step their pieces differently and broadcast them to every
// replica: refused on every rank at construction.
DDP_TEST_WORKER(groups_differ) {
  auto pg = testing::WorkerGroup();
  auto model = Mlp(1);
  const bool odd = pg->rank() == 1;
  for (const char* what : {"options", "membership"}) {
    std::vector<nn::optim::ParamGroup> groups = DecayGroups(model->NamedParameters(), odd ? 3e-3 : 2e-3);
    if (std::string(what) == "membership") {
      groups = DecayGroups(model->NamedParameters());
      if (odd) {
        groups[0].params.push_back(groups[1].params.front());
        groups[1].params.erase(groups[1].params.begin());
      }
    }
    try {
      ZeroRedundancyOptimizer zero(groups, pg, MakeGroupedOptimizer);
      WORKER_EXPECT(false, std::string(what) + " differing across ranks were accepted");
    } catch (const std::invalid_argument& e) {
      WORKER_EXPECT(std::string(e.what()).find("the ranks' parameter lists differ") != std::string::npos,
                    std::string(what) + ": " + e.what());
    }
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, GroupsDifferingAcrossRanksAreRefusedOnEveryRank) {
  auto run = RunWorkers("groups_differ", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A group factory must keep the groups it is given.
TEST(ZeroRedundancyOptimizerTest, GroupFactoryMustKeepTheGroups) {
  auto model = Mlp(1);
  try {
    ZeroRedundancyOptimizer zero(DecayGroups(model->NamedParameters()), ProcessGroup::Single(),
                                 [](std::vector<nn::optim::ParamGroup> groups) {
                                   NamedParameters all;
                                   for (auto& g : groups) all.insert(all.end(), g.params.begin(), g.params.end());
                                   return MakeOptimizer(std::move(all));
                                 });
    ADD_FAILURE() << "groups merged into one: accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("has 1 param group(s), not the 2 it was given"), std::string::npos)
        << e.what();
  }
}

// Step hands the k-th piece's gradient to the local optimizer's k-th
// parameter: a factory that builds from the model, or drops or reorders
// the pieces, is refused at construction, naming the mistake.
// Five ranks over 64 elements: a frozen parameter (requires_grad false,
// never a gradient), one left without a gradient in some steps, a large
// one split between ranks, a one-element one; the partition leaves rank 2
// with nothing. Against the unsharded Adam on the same gradients: equal
// bytes after every step, the consolidated state (gathered on the empty
// rank) equal to the unsharded one's, and that state loaded on every rank
// of a fresh optimizer continuing as the unsharded one does.
DDP_TEST_WORKER(sparse_shards) {
  auto pg = testing::WorkerGroup();
  auto make_params = [] {
    nn::Generator gen(5);
    NamedParameters params;
    params.emplace_back("frozen", nn::Randn({3}, {}, gen));
    params.emplace_back("sometimes", nn::Randn({4, 5}, {}, gen).set_requires_grad(true));
    params.emplace_back("big", nn::Randn({5, 8}, {}, gen).set_requires_grad(true));
    params.emplace_back("one", nn::Randn({1}, {}, gen).set_requires_grad(true));
    return params;
  };
  auto adam = [](NamedParameters p) {
    return std::make_unique<nn::optim::Adam>(std::move(p),
                                             nn::optim::AdamOptions{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true});
  };
  const NamedParameters sharded = make_params(), plain = make_params();
  // DDP_TEST_GROUPS: AdamW over two groups with their own rates and decays.
  const bool grouped = std::getenv("DDP_TEST_GROUPS") != nullptr;
  auto make_zero = [&] {
    return grouped ? std::make_unique<ZeroRedundancyOptimizer>(DecayGroups(sharded), pg, MakeGroupedOptimizer)
                   : std::make_unique<ZeroRedundancyOptimizer>(sharded, pg, adam);
  };
  std::unique_ptr<ZeroRedundancyOptimizer> zero_ptr = make_zero();
  ZeroRedundancyOptimizer& zero = *zero_ptr;
  auto opt = grouped ? MakeGroupedOptimizer(DecayGroups(plain)) : adam(plain);
  int empty = -1;
  for (int r = pg->size() - 1; r >= 0; --r) {
    if (zero.shard(r).empty()) empty = r;
  }
  WORKER_EXPECT(empty >= 0, "every rank owns a piece");
  if (empty < 0) return testing::WorkerExit();
  nn::Generator gen(9);
  // Gradients the same on every rank (what DDP would leave), from step s.
  auto set_grads = [&](const NamedParameters& params, int s) {
    nn::Generator g(100 + static_cast<uint64_t>(s));
    for (size_t i = 1; i < params.size(); ++i) {
      const Tensor grad = nn::Randn(params[i].second.shape(), {}, g);
      params[i].second.set_grad(i == 1 && s % 2 == 1 ? Tensor() : grad);
    }
  };
  auto same = [&](const NamedParameters& a, const NamedParameters& b, const std::string& when) {
    for (size_t i = 0; i < a.size(); ++i) {
      WORKER_EXPECT(SameBytes(a[i].second.Detach(), b[i].second.Detach()), when + ": `" + a[i].first + "` differs on rank " +
                                                             std::to_string(pg->rank()));
    }
  };
  for (int s = 0; s < 4; ++s) {
    set_grads(sharded, s);
    set_grads(plain, s);
    zero.Step();
    opt->Step();
    same(sharded, plain, "step " + std::to_string(s));
  }
  const NamedTensors whole = zero.ConsolidatedStateDict(empty);
  const NamedTensors want = opt->StateDict();
  if (pg->rank() == empty) {
    WorkerExpectSameState(whole, want, "the consolidated state");
  } else {
    WORKER_EXPECT(whole.empty(), "a rank other than the receiver got a state");
  }
  // A fresh optimizer over the same (now trained) parameters, loaded with
  // the unsharded state on every rank, continues as the unsharded one.
  std::unique_ptr<ZeroRedundancyOptimizer> resumed_ptr = make_zero();
  ZeroRedundancyOptimizer& resumed = *resumed_ptr;
  resumed.LoadStateDict(want);
  for (int s = 4; s < 7; ++s) {
    set_grads(sharded, s);
    set_grads(plain, s);
    resumed.Step();
    opt->Step();
    same(sharded, plain, "resumed step " + std::to_string(s));
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, FrozenGradlessAndEmptyShardsEqualTheUnshardedOptimizer) {
  auto run = RunWorkers("sparse_shards", 5);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  auto grouped = RunWorkers("sparse_shards", 5, {{"DDP_TEST_GROUPS", "1"}});
  EXPECT_TRUE(grouped.AllSucceeded()) << "param groups\n" << testing::AllOutput(grouped);
}

// AddParamGroup on three ranks, mid-training (a layer unfrozen), against
// the unsharded AdamW given the same group at the same step: equal bytes
// after every step, the new parameters cut among the ranks while the old
// pieces stay, and the consolidated state equal to the unsharded one's.
// A group that differs across ranks, or that names a parameter already
// held, is refused on every rank, changing nothing.
DDP_TEST_WORKER(add_param_group) {
  auto pg = testing::WorkerGroup();
  auto make_params = [] {
    nn::Generator gen(6);
    NamedParameters params;
    params.emplace_back("a", nn::Randn({5, 8}, {}, gen).set_requires_grad(true));
    params.emplace_back("b", nn::Randn({3}, {}, gen).set_requires_grad(true));
    params.emplace_back("c", nn::Randn({7, 9}, {}, gen));  // frozen at first
    params.emplace_back("d", nn::Randn({40}, {}, gen));
    return params;
  };
  auto adamw = [](NamedParameters p) {
    return std::make_unique<nn::optim::AdamW>(std::move(p), nn::optim::AdamWOptions{.lr = 0.01, .weight_decay = 0.1});
  };
  const NamedParameters sharded = make_params(), plain = make_params();
  ZeroRedundancyOptimizer zero({sharded[0], sharded[1]}, pg, adamw);
  auto opt = adamw({plain[0], plain[1]});
  auto set_grads = [&](const NamedParameters& params, int s) {
    nn::Generator g(200 + static_cast<uint64_t>(s));
    for (const auto& [name, p] : params) {
      const Tensor grad = nn::Randn(p.shape(), {}, g);
      if (p.requires_grad()) p.set_grad(grad);
    }
  };
  auto same = [&](const std::string& when) {
    for (size_t i = 0; i < sharded.size(); ++i) {
      WORKER_EXPECT(SameBytes(sharded[i].second.Detach(), plain[i].second.Detach()),
                    when + ": `" + sharded[i].first + "` differs on rank " + std::to_string(pg->rank()));
    }
  };
  auto step = [&](int s) {
    set_grads(sharded, s);
    set_grads(plain, s);
    zero.Step();
    opt->Step();
    same("step " + std::to_string(s));
  };
  for (int s = 0; s < 2; ++s) step(s);

  // Refused on every rank, changing nothing: options that differ on the
  // last rank, then a parameter the optimizer already holds.
  const nn::optim::ParamGroup bad{.params = {sharded[2]},
                                  .options = {{"lr", pg->rank() == pg->size() - 1 ? 0.03 : 0.02}}};
  try {
    zero.AddParamGroup(bad);
    WORKER_EXPECT(false, "groups differing across ranks were added");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("the ranks' new param groups differ") != std::string::npos, e.what());
  }
  try {
    zero.AddParamGroup({.params = {sharded[2], sharded[0]}});
    WORKER_EXPECT(false, "a parameter already held was added again");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("`a` is listed twice") != std::string::npos, e.what());
  }
  WORKER_EXPECT(zero.num_groups() == 1, "a refused group was added");

  const std::vector<Slice> before = zero.shard(pg->rank());
  for (const NamedParameters* params : {&sharded, &plain}) {
    (*params)[2].second.set_requires_grad(true);
    (*params)[3].second.set_requires_grad(true);
  }
  zero.AddParamGroup({.params = {sharded[2], sharded[3]}, .options = {{"lr", 0.02}, {"weight_decay", 0.0}}});
  opt->AddParamGroup({.params = {plain[2], plain[3]}, .options = {{"lr", 0.02}, {"weight_decay", 0.0}}});
  WORKER_EXPECT(zero.num_groups() == 2 && zero.lr(1) == 0.02, "the group's rate is not 0.02");
  // The old pieces stay; the new parameters' 103 elements are cut among
  // every rank, each element once.
  const std::vector<Slice>& after = zero.shard(pg->rank());
  WORKER_EXPECT(after.size() > before.size() && std::equal(before.begin(), before.end(), after.begin()),
                "the old pieces moved, or rank " + std::to_string(pg->rank()) + " got none of the new ones");
  int64_t covered = 0;
  for (int r = 0; r < pg->size(); ++r) {
    for (const Slice& s : zero.shard(r)) covered += s.param >= 2 ? s.length : 0;
  }
  WORKER_EXPECT(covered == 63 + 40, "the new parameters' pieces hold " + std::to_string(covered) + " elements");
  for (int s = 2; s < 5; ++s) step(s);

  const NamedTensors whole = zero.ConsolidatedStateDict(0);
  if (pg->rank() == 0) {
    const NamedTensors want = opt->StateDict();
    WorkerExpectSameState(whole, want, "the consolidated state");
  }
  // The unsharded state resumes into an optimizer built over the same two
  // groups on every rank (cut as one list), which goes on as the unsharded
  // one does.
  ZeroRedundancyOptimizer resumed(
      std::vector<nn::optim::ParamGroup>{{.params = {sharded[0], sharded[1]}},
                                         {.params = {sharded[2], sharded[3]},
                                          .options = {{"lr", 0.02}, {"weight_decay", 0.0}}}},
      pg, [](std::vector<nn::optim::ParamGroup> groups) {
        return std::make_unique<nn::optim::AdamW>(std::move(groups),
                                                  nn::optim::AdamWOptions{.lr = 0.01, .weight_decay = 0.1});
      });
  resumed.LoadStateDict(opt->StateDict());
  for (int s = 5; s < 7; ++s) {
    set_grads(sharded, s);
    set_grads(plain, s);
    resumed.Step();
    opt->Step();
    same("resumed step " + std::to_string(s));
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AddParamGroupOnThreeRanksEqualsTheUnshardedOptimizer) {
  auto run = RunWorkers("add_param_group", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// AddParamGroup refused on one rank only (an LrScheduler over its local()
// refuses the shard's new group; the others add it and are left unusable),
// then called again: every rank fails both calls at once. Before, the
// second call failed at once on ranks 0 and 2 (their optimizer broken)
// while rank 1 waited for them in the models' comparison until the group's
// timeout. Every rank stays alive until all are done, so that no failure
// can come from a peer's exit.
constexpr int kRefusedTimeoutMs = 10000;

DDP_TEST_WORKER(add_param_group_refused_on_one_rank) {
  auto pg = testing::WorkerGroup();
  const Tensor w = nn::Zeros({4, 8}).set_requires_grad(true);
  const Tensor c = nn::Zeros({6}).set_requires_grad(true);
  const Tensor d = nn::Zeros({5}).set_requires_grad(true);
  ZeroRedundancyOptimizer zero({{"w", w}}, pg, MakeOptimizer);
  std::optional<nn::optim::LrScheduler> scheduler;
  if (pg->rank() == 1) scheduler.emplace(zero.local(), nn::optim::StepSchedule(2, 0.5));
  const std::vector<std::pair<nn::optim::ParamGroup, std::string>> calls = {
      {{.params = {{"c", c}}}, pg->rank() == 1 ? "an LrScheduler drives this optimizer" : "on rank 1"},
      {{.params = {{"d", d}}}, "the ranks' shards no longer match"}};
  for (size_t i = 0; i < calls.size(); ++i) {
    const auto start = std::chrono::steady_clock::now();
    std::string message = "no error";
    try {
      zero.AddParamGroup(calls[i].first);
    } catch (const std::exception& e) {
      message = e.what();
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const std::string call = "call " + std::to_string(i) + " on rank " + std::to_string(pg->rank());
    WORKER_EXPECT(ms < kRefusedTimeoutMs / 2, call + " took " + std::to_string(ms) + " ms: " + message);
    WORKER_EXPECT(message.find(calls[i].second) != std::string::npos, call + ": " + message);
  }
  testing::MarkThisRankDone(*pg);
  testing::StayAliveUntilTheOtherRanksAreDone(*pg);
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AddParamGroupRefusedOnOneRankFailsEveryRankAtOnce) {
  auto run = RunWorkers("add_param_group_refused_on_one_rank", 3,
                        {{"DDP_TEST_TIMEOUT_MS", std::to_string(kRefusedTimeoutMs)}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// AddParamGroup whose new lists cannot be made on rank 1 (memory ran out
// there): they are made before the ranks agree, so every rank refuses the
// group naming rank 1, and every rank's optimizer goes on as it was (a
// step, then the group added again). Before, rank 1 failed after the last
// agreement, its shard optimizer holding the group while its lists did not.
DDP_TEST_WORKER(add_param_group_out_of_memory) {
  auto pg = testing::WorkerGroup();
  const std::string on = " on rank " + std::to_string(pg->rank());
  const Tensor w = nn::Ones({4, 8}).set_requires_grad(true);
  const Tensor c = nn::Ones({6}).set_requires_grad(true);
  ZeroRedundancyOptimizer zero({{"w", w}}, pg, MakeOptimizer);
  if (pg->rank() == 1) internal::FailNextAddParamGroupForTesting();
  std::string message = "no error";
  try {
    zero.AddParamGroup({.params = {{"c", c}}});
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("ZeroRedundancyOptimizer::AddParamGroup on rank 1: std::bad_alloc") != std::string::npos,
                message + on);
  WORKER_EXPECT(zero.num_groups() == 1, "the refused group was added" + on);
  w.set_grad(nn::Ones({4, 8}));
  zero.Step();
  zero.AddParamGroup({.params = {{"c", c}}});
  WORKER_EXPECT(zero.num_groups() == 2, "the group was not added the second time" + on);
  w.set_grad(nn::Ones({4, 8}));
  c.set_grad(nn::Ones({6}));
  zero.Step();
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, AddParamGroupOutOfMemoryOnOneRankChangesNothingAnywhere) {
  auto run = RunWorkers("add_param_group_out_of_memory", 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A group holding an undefined tensor is refused naming it, before its
// parameters are cut, and the optimizer keeps its one group.
TEST(ZeroPartition, AddParamGroupWithAnUndefinedParameterIsRefusedNamingIt) {
  const Tensor w = nn::Zeros({4, 8}).set_requires_grad(true);
  ZeroRedundancyOptimizer zero({{"w", w}}, ProcessGroup::Single(), MakeOptimizer);
  try {
    zero.AddParamGroup({.params = {{"ghost", Tensor()}}});
    ADD_FAILURE() << "an undefined parameter was added";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("parameter `ghost` is undefined"), std::string::npos) << e.what();
  }
  EXPECT_EQ(zero.num_groups(), 1u);
}

// A group added to the shard's optimizer directly would be stepped by one
// rank alone and left out of the state: refused, naming AddParamGroup.
TEST(ZeroPartition, AGroupAddedToTheLocalOptimizerIsRefused) {
  const Tensor w = nn::Zeros({4, 8}).set_requires_grad(true);
  const Tensor extra = nn::Zeros({3}).set_requires_grad(true);
  ZeroRedundancyOptimizer zero({{"w", w}}, ProcessGroup::Single(), MakeOptimizer);
  zero.local().AddParamGroup({.params = {{"extra", extra}}});
  extra.set_grad(nn::Ones({3}));
  for (const auto& call : std::vector<std::function<void()>>{[&] { zero.Step(); },
                                                             [&] { zero.ConsolidatedStateDict(0); }}) {
    try {
      call();
      ADD_FAILURE() << "a group added to local() was taken";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("was local().AddParamGroup called?"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(SameBytes(extra.Detach(), nn::Zeros({3}))) << "the added parameter was stepped";
  EXPECT_TRUE(extra.grad().defined()) << "the refused step cleared the gradient of a parameter it does not own";
}

// The consolidated state does not depend on the world size: saved by two
// ranks (parameters and state in one checkpoint), loaded by three, and by
// one plain optimizer, which then step alike, bit for bit.
NamedParameters ResizeParams() {
  nn::Generator gen(17);
  NamedParameters params;
  params.emplace_back("a", nn::Randn({9, 7}, {}, gen).set_requires_grad(true));
  params.emplace_back("b", nn::Randn({5}, {}, gen).set_requires_grad(true));
  params.emplace_back("c", nn::Randn({33}, {}, gen).set_requires_grad(true));
  return params;
}

std::unique_ptr<nn::optim::Optimizer> ResizeAdam(NamedParameters params) {
  return std::make_unique<nn::optim::Adam>(std::move(params), nn::optim::AdamOptions{.lr = 0.01, .amsgrad = true});
}

void ResizeGrads(const NamedParameters& params, int s) {
  nn::Generator g(300 + static_cast<uint64_t>(s));
  for (const auto& [name, p] : params) p.set_grad(nn::Randn(p.shape(), {}, g));
}

DDP_TEST_WORKER(resize) {
  auto pg = testing::WorkerGroup();
  const std::string path = std::getenv("DDP_TEST_CKPT");
  const NamedParameters params = ResizeParams();
  ZeroRedundancyOptimizer zero(params, pg, ResizeAdam);
  if (std::string(std::getenv("DDP_TEST_PHASE")) == "save") {
    for (int s = 0; s < 3; ++s) {
      ResizeGrads(params, s);
      zero.Step();
    }
    nn::io::Checkpoint c;
    for (const auto& [name, p] : params) c.model.emplace_back(name, p.Detach().Clone());
    c.optimizer = zero.ConsolidatedStateDict(0);
    SaveCheckpoint(*pg, path, c);
    return testing::WorkerExit();
  }
  const nn::io::Checkpoint c = LoadCheckpoint(*pg, path);
  const NamedParameters plain = ResizeParams();
  {
    nn::NoGradGuard guard;
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].second.CopyFrom(c.model[i].second);
      plain[i].second.CopyFrom(c.model[i].second);
    }
  }
  zero.LoadStateDict(c.optimizer);
  auto opt = ResizeAdam(plain);
  opt->LoadStateDict(c.optimizer);
  for (int s = 3; s < 6; ++s) {
    ResizeGrads(params, s);
    ResizeGrads(plain, s);
    zero.Step();
    opt->Step();
    for (size_t i = 0; i < params.size(); ++i) {
      WORKER_EXPECT(SameBytes(params[i].second.Detach(), plain[i].second.Detach()),
                    "step " + std::to_string(s) + ": `" + params[i].first + "` differs on rank " +
                        std::to_string(pg->rank()));
    }
  }
  return testing::WorkerExit();
}

TEST(ZeroRedundancyOptimizerTest, StateSavedOnTwoRanksResumesOnThree) {
  const std::string path = TempPath("resize.safetensors");
  auto saved = RunWorkers("resize", 2, {{"DDP_TEST_CKPT", path}, {"DDP_TEST_PHASE", "save"}});
  ASSERT_TRUE(saved.AllSucceeded()) << testing::AllOutput(saved);
  auto loaded = RunWorkers("resize", 3, {{"DDP_TEST_CKPT", path}, {"DDP_TEST_PHASE", "load"}});
  EXPECT_TRUE(loaded.AllSucceeded()) << testing::AllOutput(loaded);
  std::remove(path.c_str());
}

TEST(ZeroRedundancyOptimizerTest, FactoryMustHoldThePiecesItWasGiven) {
  auto model = Mlp(1);
  const NamedParameters params = model->NamedParameters();
  auto refused = [&](const ZeroRedundancyOptimizer::Factory& make, const std::string& what) {
    try {
      ZeroRedundancyOptimizer zero(params, ProcessGroup::Single(), make);
      ADD_FAILURE() << what << ": accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("build the optimizer from its argument, not from the model"),
                std::string::npos)
          << what << ": " << e.what();
    }
  };
  refused([&](NamedParameters) { return MakeOptimizer(params); }, "from the model");
  refused(
      [](NamedParameters shard) {
        shard.pop_back();
        return MakeOptimizer(std::move(shard));
      },
      "a piece dropped");
  refused(
      [](NamedParameters shard) {
        std::swap(shard.front(), shard.back());
        return MakeOptimizer(std::move(shard));
      },
      "pieces reordered");
  try {
    ZeroRedundancyOptimizer zero(params, ProcessGroup::Single(),
                                 [](NamedParameters shard) {
                                   shard.pop_back();
                                   return MakeOptimizer(std::move(shard));
                                 });
    ADD_FAILURE() << "a piece dropped: accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("holds " + std::to_string(params.size() - 1) + " parameter(s), not the " +
                                         std::to_string(params.size()) + " piece(s)"),
              std::string::npos)
        << e.what();
  }
  // Pieces renamed: the state, gathered and cut by the parameters' names,
  // would hold none of theirs.
  try {
    ZeroRedundancyOptimizer zero(params, ProcessGroup::Single(), [](NamedParameters shard) {
      for (auto& [name, p] : shard) name = "renamed." + name;
      return MakeOptimizer(std::move(shard));
    });
    ADD_FAILURE() << "pieces renamed: accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("the factory's optimizer names piece 0 `renamed." + params[0].first +
                                         "`, not `" + params[0].first + "` as it was given"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(ZeroRedundancyOptimizer(params, ProcessGroup::Single(), MakeOptimizer));
}

}  // namespace
}  // namespace ddp::dist
