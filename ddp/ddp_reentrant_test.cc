// DistributedDataParallel with backward passes nested in others, over real
// processes: a parameter whose gradient arrives twice in one backward (used
// inside a re-entrantly checkpointed segment and outside it), with and
// without static_graph, and a DDP training step run from a hook of an
// unrelated backward pass.

#include <gtest/gtest.h>

#include <algorithm>
#include <any>
#include <memory>
#include <string>
#include <vector>

#include "transport/launch/test_spawn.h"

#include "ddp/distributed_data_parallel.h"
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
using testing::RunWorkers;

constexpr int64_t kBatch = 8;

// Runs a Linear without recording it and, in backward, records it again
// and runs a nested Backward through it (re-entrant activation
// checkpointing): the Linear's parameters get that gradient inside the
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

// fc1 -> ReLU -> fc2 (checkpointed) -> ReLU -> mid -> ReLU -> fc2 again
// (recorded) -> ReLU -> head: fc2's parameters get one gradient in the
// user's pass (its recorded use), then mid's theirs, then fc2's a second
// one in the pass nested in it (the checkpointed use). `checkpointed` false records both uses: one gradient,
// summed by the engine, for the one-process reference.
// Input [N, 1, 28, 28]; output [N, 10].
class TiedCheckpointed : public Module {
 public:
  TiedCheckpointed(uint64_t seed, bool checkpointed) : checkpointed(checkpointed) {
    nn::Generator gen(seed);
    fc1_ = RegisterModule("fc1", std::make_shared<nn::modules::Linear>(784, 32, true, gen));
    fc2_ = RegisterModule("fc2", std::make_shared<nn::modules::Linear>(32, 32, true, gen));
    mid_ = RegisterModule("mid", std::make_shared<nn::modules::Linear>(32, 32, true, gen));
    head_ = RegisterModule("head", std::make_shared<nn::modules::Linear>(32, 10, true, gen));
  }
  Tensor Forward(const Tensor& x) override {
    const Tensor h = nn::ops::Relu((*fc1_)(nn::ops::Flatten(x, 1)));
    const Tensor a = checkpointed ? CheckpointedLinear::Apply({h}, fc2_.get())[0] : (*fc2_)(h);
    const Tensor m = (*mid_)(nn::ops::Relu(a));
    const Tensor b = (*fc2_)(nn::ops::Relu(m));
    return (*head_)(nn::ops::Relu(b));
  }
  using Module::Forward;
  std::string TypeName() const override { return "TiedCheckpointed"; }

  bool checkpointed;  ///< may change between forwards

 private:
  std::shared_ptr<nn::modules::Linear> fc1_, fc2_, mid_, head_;
};

// fc1 -> ReLU -> fc2 checkpointed: the first gradient of backward, fc2's,
// arrives in the nested pass. Input [N, 1, 28, 28]; output [N, 10].
class CheckpointedLast : public Module {
 public:
  explicit CheckpointedLast(uint64_t seed) {
    nn::Generator gen(seed);
    fc1_ = RegisterModule("fc1", std::make_shared<nn::modules::Linear>(784, 32, true, gen));
    fc2_ = RegisterModule("fc2", std::make_shared<nn::modules::Linear>(32, 10, true, gen));
  }
  Tensor Forward(const Tensor& x) override {
    return CheckpointedLinear::Apply({nn::ops::Relu((*fc1_)(nn::ops::Flatten(x, 1)))}, fc2_.get())[0];
  }
  using Module::Forward;
  std::string TypeName() const override { return "CheckpointedLast"; }

 private:
  std::shared_ptr<nn::modules::Linear> fc1_, fc2_;
};

// " 7 6 3 ...": for messages.
std::string Listed(const std::vector<int64_t>& values) {
  std::string out;
  for (int64_t v : values) out += " " + std::to_string(v);
  return out;
}

// One step of the one-process `reference` on `count` samples from `base`.
void ReferenceStep(Module& reference, nn::optim::Sgd& opt, int64_t base, int64_t count) {
  opt.ZeroGrad();
  auto [x, y] = testing::Batch(testing::FashionMnist(), base, count);
  nn::Backward(nn::loss::CrossEntropy(reference(x), y));
  opt.Step();
}

// ------------------------------------ a gradient twice in one backward ----

// static_graph counts each parameter's gradients in the first iteration
// and reduces it on its last one from then on (PyTorch's static_graph
// supports re-entrant checkpointing the same way): three steps equal one
// process's on the combined batch, with copied buckets and with
// gradient_as_bucket_view, one bucket per parameter (launched during
// backward) and one for all. The second gradient used to abort the group
// ("received its gradient twice").
DDP_TEST_WORKER(static_graph_gradient_twice) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  const auto& data = testing::FashionMnist();
  for (const bool view : {false, true}) {
    for (const double cap_mb : {25.0, 1e-9}) {
      const std::string what = std::string("static_graph") + (view ? " (views)" : "") +
                               (cap_mb < 1 ? " (a bucket per parameter)" : "");
      auto model = std::make_shared<TiedCheckpointed>(rank == 0 ? 5 : 60 + rank, /*checkpointed=*/true);
      DistributedDataParallel ddp(model, {.bucket_cap_mb = cap_mb, .first_bucket_mb = cap_mb,
                                          .gradient_as_bucket_view = view, .static_graph = true,
                                          .process_group = pg});
      nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
      auto reference = std::make_shared<TiedCheckpointed>(5, /*checkpointed=*/false);
      nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
      try {
        for (int s = 0; s < 3; ++s) {
          const int64_t base = s * world * kBatch;
          opt.ZeroGrad();
          auto [x, y] = testing::Batch(data, base + rank * kBatch, kBatch);
          nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
          opt.Step();
          ReferenceStep(*reference, ref_opt, base, world * kBatch);
        }
      } catch (const std::exception& e) {
        WORKER_EXPECT(false, what + ": " + e.what());
        return testing::WorkerExit();
      }
      const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
      WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
      WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), what + ": replicas differ");
      WORKER_EXPECT(ddp.iterations() == 3, what + ": iterations " + std::to_string(ddp.iterations()));
      // The buckets were rebuilt with fc2 where its last gradient arrives,
      // after mid's: at its first, its bucket would wait for the nested
      // pass with mid's gradients in it. Indices: fc1 0-1, fc2 2-3, mid
      // 4-5, head 6-7.
      const std::vector<int64_t> order = ddp.BucketOrder();
      auto position = [&](int64_t index) { return std::find(order.begin(), order.end(), index) - order.begin(); };
      WORKER_EXPECT(order.size() == 8 && position(2) > position(4) && position(3) > position(5),
                    what + ": fc2 is before mid in the rebuilt bucket order" + Listed(order));
    }
  }
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, StaticGraphReducesAGradientThatArrivesTwiceOnItsLastArrival) {
  auto run = RunWorkers("static_graph_gradient_twice", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 90000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Re-entrant checkpointing of the last layer under static_graph: fc2's
// parameters are used only inside the checkpointed segment, so the graph
// that forward records does not reach them (the segment is recorded again
// during backward). static_graph learns the used set from the first
// iteration's gradients, as PyTorch's: three steps equal one process's.
// Its graph walk used to take fc2 as unused, and fc2's gradient then
// aborted the group ("not reachable from the outputs of forward").
DDP_TEST_WORKER(static_graph_checkpointed_only) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  const auto& data = testing::FashionMnist();
  for (const bool find_unused : {false, true}) {
    const std::string what = std::string("static_graph, last layer checkpointed") +
                             (find_unused ? " (find_unused_parameters)" : "");
    auto model = std::make_shared<CheckpointedLast>(rank == 0 ? 5 : 60 + rank);
    DistributedDataParallel ddp(model, {.find_unused_parameters = find_unused, .static_graph = true,
                                        .process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    auto reference = std::make_shared<CheckpointedLast>(5);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
    try {
      for (int s = 0; s < 3; ++s) {
        const int64_t base = s * world * kBatch;
        opt.ZeroGrad();
        auto [x, y] = testing::Batch(data, base + rank * kBatch, kBatch);
        nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
        opt.Step();
        ReferenceStep(*reference, ref_opt, base, world * kBatch);
      }
    } catch (const std::exception& e) {
      WORKER_EXPECT(false, what + ": " + e.what());
      return testing::WorkerExit();
    }
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), what + ": replicas differ");
  }
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, StaticGraphLearnsParametersUsedOnlyInsideACheckpointedSegment) {
  auto run = RunWorkers("static_graph_checkpointed_only", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 90000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Without static_graph the first gradient is already in a bucket that may
// be in flight when the second arrives: the backward fails on every rank
// (the group is aborted) with an error naming the parameter, the cause and
// static_graph, as PyTorch's "Expected to mark a variable ready only once".
DDP_TEST_WORKER(gradient_twice_without_static_graph) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  auto model = std::make_shared<TiedCheckpointed>(5, /*checkpointed=*/true);
  DistributedDataParallel ddp(model, {.process_group = pg});
  auto [x, y] = testing::Batch(testing::FashionMnist(), rank * kBatch, kBatch);
  testing::ExpectRefused(
      rank, [&] { nn::Backward(nn::loss::CrossEntropy(ddp(x), y)); }, "a second gradient of fc2",
      {"parameter `fc2.", "a second gradient in one backward", "static_graph"});
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, AGradientThatArrivesTwiceWithoutStaticGraphFailsNamingTheParameter) {
  auto run = RunWorkers("gradient_twice_without_static_graph", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// static_graph counted the gradients of the first iteration; a later
// backward with fewer (the checkpoint dropped) or more (a checkpoint added)
// fails on every rank naming the parameter and both counts. Each aborts
// the group: one worker each.
void CheckGradientCountChange(bool first_checkpointed) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  auto model = std::make_shared<TiedCheckpointed>(5, first_checkpointed);
  DistributedDataParallel ddp(model, {.static_graph = true, .process_group = pg});
  auto [x, y] = testing::Batch(testing::FashionMnist(), rank * kBatch, kBatch);
  try {
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("first iteration: ") + e.what());
    return;
  }
  model->checkpointed = !first_checkpointed;
  if (first_checkpointed) {
    testing::ExpectRefused(
        rank, [&] { nn::Backward(nn::loss::CrossEntropy(ddp(x), y)); }, "one gradient of fc2 where 2 were counted",
        {"`fc2.", "only 1 of the 2 gradients static_graph counted in the first iteration"});
  } else {
    testing::ExpectRefused(
        rank, [&] { nn::Backward(nn::loss::CrossEntropy(ddp(x), y)); }, "two gradients of fc2 where 1 was counted",
        {"parameter `fc2.", "received 2 gradients in one backward, but 1 in the first iteration"});
  }
}

DDP_TEST_WORKER(static_graph_fewer_gradients) {
  CheckGradientCountChange(/*first_checkpointed=*/true);
  return testing::WorkerExit();
}

DDP_TEST_WORKER(static_graph_more_gradients) {
  CheckGradientCountChange(/*first_checkpointed=*/false);
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, StaticGraphRefusesFewerGradientsThanItCounted) {
  auto run = RunWorkers("static_graph_fewer_gradients", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpReentrantTest, StaticGraphRefusesMoreGradientsThanItCounted) {
  auto run = RunWorkers("static_graph_more_gradients", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Under static_graph, a forward under NoSync run after a synchronizing
// forward whose backward is pending joins that backward (as without
// static_graph), and its checkpointed segment adds a nested pass: fc2
// gets one more gradient than static_graph counted. The iteration reduces
// every gradient at the end of backward instead, and a = ddp(x1); {NoSync;
// b = ddp(x2);} Backward(CE(a) + CE(b)) equals one process on both
// combined batches; in the first iteration too, which then counts
// nothing, the next one counting instead. It used to fail on every rank
// ("received 3 gradients in one backward, but 2 in the first iteration");
// PyTorch lets the extra gradient land in .grad after its bucket was
// reduced, and the replicas drift apart.
DDP_TEST_WORKER(static_graph_no_sync_forward_joins_the_backward) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  const auto& data = testing::FashionMnist();
  for (const int joined_at : {0, 1}) {
    for (const bool view : {false, true}) {
      const std::string what = "static_graph, a NoSync forward joins the backward of iteration " +
                               std::to_string(joined_at) + (view ? " (views)" : "");
      auto model = std::make_shared<TiedCheckpointed>(rank == 0 ? 5 : 60 + rank, /*checkpointed=*/true);
      DistributedDataParallel ddp(model, {.bucket_cap_mb = 1e-9, .first_bucket_mb = 1e-9,
                                          .gradient_as_bucket_view = view, .static_graph = true,
                                          .process_group = pg});
      nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
      auto reference = std::make_shared<TiedCheckpointed>(5, /*checkpointed=*/false);
      nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
      try {
        for (int s = 0; s < 4; ++s) {
          // Batches: 2 * world per step, this step's first half for a, the
          // second for b.
          const int64_t base = s * 2 * world * kBatch;
          opt.ZeroGrad();
          auto [x, y] = testing::Batch(data, base + rank * kBatch, kBatch);
          Tensor loss = nn::loss::CrossEntropy(ddp(x), y);
          if (s == joined_at || s == 2) {
            auto [x2, y2] = testing::Batch(data, base + (world + rank) * kBatch, kBatch);
            NoSyncGuard no_sync(ddp);
            loss = loss + nn::loss::CrossEntropy(ddp(x2), y2);
          }
          nn::Backward(loss);
          opt.Step();
          ref_opt.ZeroGrad();
          auto [rx, ry] = testing::Batch(data, base, world * kBatch);
          Tensor ref_loss = nn::loss::CrossEntropy((*reference)(rx), ry);
          if (s == joined_at || s == 2) {
            auto [rx2, ry2] = testing::Batch(data, base + world * kBatch, world * kBatch);
            ref_loss = ref_loss + nn::loss::CrossEntropy((*reference)(rx2), ry2);
          }
          nn::Backward(ref_loss);
          ref_opt.Step();
        }
      } catch (const std::exception& e) {
        WORKER_EXPECT(false, what + ": " + e.what());
        return testing::WorkerExit();
      }
      const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
      WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
      WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), what + ": replicas differ");
      WORKER_EXPECT(ddp.iterations() == 4, what + ": iterations " + std::to_string(ddp.iterations()));
    }
  }
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, StaticGraphTakesTheGradientsOfANoSyncForwardThatJoinsThePendingBackward) {
  auto run = RunWorkers("static_graph_no_sync_forward_joins_the_backward", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}},
                        120000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A first iteration that a NoSync forward joined counts nothing; the
// second counts fc2's 2 gradients, and a third that gives it 1 (the
// checkpoint dropped) fails on every rank naming the iteration that
// counted. The joined first iteration used to count 3, and the second
// failed with "only 2 of the 3 gradients static_graph counted".
DDP_TEST_WORKER(static_graph_counts_after_a_joined_first_iteration) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  const auto& data = testing::FashionMnist();
  auto model = std::make_shared<TiedCheckpointed>(5, /*checkpointed=*/true);
  DistributedDataParallel ddp(model, {.static_graph = true, .process_group = pg});
  auto [x, y] = testing::Batch(data, rank * kBatch, kBatch);
  try {
    Tensor loss = nn::loss::CrossEntropy(ddp(x), y);
    {
      auto [x2, y2] = testing::Batch(data, (world + rank) * kBatch, kBatch);
      NoSyncGuard no_sync(ddp);
      loss = loss + nn::loss::CrossEntropy(ddp(x2), y2);
    }
    nn::Backward(loss);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("the first two iterations: ") + e.what());
    return testing::WorkerExit();
  }
  model->checkpointed = false;
  testing::ExpectRefused(
      rank, [&] { nn::Backward(nn::loss::CrossEntropy(ddp(x), y)); }, "one gradient of fc2 where 2 were counted",
      {"`fc2.", "only 1 of the 2 gradients static_graph counted in iteration 2 (the first synchronizing backward "
                "of this rank that no forward under NoSync joined"});
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, StaticGraphCountsInTheFirstIterationNoNoSyncForwardJoinedAndSaysWhich) {
  auto run = RunWorkers("static_graph_counts_after_a_joined_first_iteration", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// static_graph's first iteration reduces nothing before the end of
// backward: one that an exception leaves partway (a hook of the user's on
// mid.weight throws) is reported at the next forward with the parameters
// that did get their gradients. It used to say none had ("0 of 8"), since
// none was marked ready yet.
DDP_TEST_WORKER(static_graph_backward_stopped_partway) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  auto model = std::make_shared<TiedCheckpointed>(5, /*checkpointed=*/false);
  DistributedDataParallel ddp(model, {.static_graph = true, .process_group = pg});
  int arrived = 0;
  std::vector<nn::HookHandle> hooks;
  for (const auto& [name, p] : model->NamedParameters()) {
    const bool throws = name == "mid.weight";
    hooks.push_back(p.RegisterPostAccumulateGradHook([&arrived, throws](const Tensor&) {
      ++arrived;
      if (throws) throw std::runtime_error("the user's hook on mid.weight threw");
    }));
  }
  auto [x, y] = testing::Batch(testing::FashionMnist(), rank * kBatch, kBatch);
  try {
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    WORKER_EXPECT(false, "the backward did not throw");
  } catch (const std::runtime_error& e) {
    WORKER_EXPECT(std::string(e.what()).find("the user's hook on mid.weight threw") != std::string::npos, e.what());
  }
  for (nn::HookHandle& h : hooks) h.Remove();
  WORKER_EXPECT(arrived > 0 && arrived < 8, "gradients before the throw: " + std::to_string(arrived));
  testing::ExpectRefused(
      rank, [&] { ddp(x); }, "a forward after a backward that stopped partway",
      {"its backward stopped partway (" + std::to_string(arrived) + " of 8 parameters had their gradients"});
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, StaticGraphsFirstBackwardStoppedPartwayCountsTheGradientsThatArrived) {
  auto run = RunWorkers("static_graph_backward_stopped_partway", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// find_unused_parameters without static_graph cannot see fc2 inside the
// checkpointed last layer (forward's graph does not reach it): its
// gradient fails the backward on every rank, and the message names the
// checkpoint as a cause and static_graph as the remedy (it used to name a
// loss term computed outside forward only).
DDP_TEST_WORKER(find_unused_checkpointed_only) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  auto model = std::make_shared<CheckpointedLast>(5);
  DistributedDataParallel ddp(model, {.find_unused_parameters = true, .process_group = pg});
  auto [x, y] = testing::Batch(testing::FashionMnist(), rank * kBatch, kBatch);
  testing::ExpectRefused(
      rank, [&] { nn::Backward(nn::loss::CrossEntropy(ddp(x), y)); }, "a gradient of the checkpointed fc2",
      {"parameter `fc2.", "re-entrant activation checkpointing", "set DdpOptions::static_graph"});
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, FindUnusedParametersNamesCheckpointingForAParameterForwardsGraphDoesNotShow) {
  auto run = RunWorkers("find_unused_checkpointed_only", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// -------------------------------- DDP run from an unrelated pass's hook ----

// The user's backward of an unrelated loss runs, from a hook on its leaf,
// two DDP training steps (forward, backward, step each). Each step's
// backward is a pass nested in the user's: DDP must average the gradients
// when that pass ends, before the hook steps the optimizer. It used to
// finalize at the end of the user's outer pass: the first step took this
// rank's own gradients and the second forward was refused ("the previous
// iteration's gradient reduction did not finish"). Also with a last layer
// checkpointed, whose gradient, the first, arrives in a pass nested in
// that step's backward: the iteration must still end with that backward
// (it moved to the user's outer pass after the first fix; with
// static_graph, fc1 was taken as unused).
DDP_TEST_WORKER(ddp_step_in_an_unrelated_hook) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  const auto& data = testing::FashionMnist();
  for (const bool checkpointed_last : {false, true}) {
  for (const bool static_graph : {false, true}) {
    const std::string what = std::string("DDP steps in a hook") + (static_graph ? " (static_graph)" : "") +
                             (checkpointed_last ? " (last layer checkpointed)" : "");
    auto make = [&](uint64_t seed) -> std::shared_ptr<Module> {
      if (checkpointed_last) return std::make_shared<CheckpointedLast>(seed);
      return std::make_shared<TiedCheckpointed>(seed, /*checkpointed=*/false);
    };
    auto model = make(rank == 0 ? 5 : 60 + rank);
    DistributedDataParallel ddp(model, {.static_graph = static_graph, .process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    auto reference = make(5);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
    Tensor w = nn::Ones({1});
    w.set_requires_grad(true);
    int steps = 0;
    std::string error;
    nn::HookHandle hook = w.RegisterPostAccumulateGradHook([&](const Tensor&) {
      nn::GradModeGuard record(true);  // backward runs its hooks with grad mode off
      try {
        for (int s = 0; s < 2; ++s, ++steps) {
          opt.ZeroGrad();
          auto [x, y] = testing::Batch(data, (steps * world + rank) * kBatch, kBatch);
          nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
          opt.Step();
        }
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
    nn::Backward(nn::ops::Sum(w * 2.0));
    hook.Remove();
    WORKER_EXPECT(error.empty(), what + ": " + error);
    for (int s = 0; s < steps; ++s) ReferenceStep(*reference, ref_opt, s * world * kBatch, world * kBatch);
    WORKER_EXPECT(steps == 2, what + ": steps " + std::to_string(steps));
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), what + ": replicas differ");
    if (!error.empty()) return testing::WorkerExit();  // the group may be aborted
  }
  }
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, ADdpStepRunFromAnUnrelatedPasssHookAveragesBeforeTheHookSteps) {
  auto run = RunWorkers("ddp_step_in_an_unrelated_hook", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 90000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Forward at top level, its backward and the optimizer step from a hook of
// an unrelated pass (the loss is computed at top level, the outputs are
// dropped): that backward is a pass nested in the unrelated one, and DDP
// must average when it ends, before the hook steps. Only a forward that
// ran inside a pass used to be followed to its backward's pass; this one
// queued the end of the iteration on the unrelated outer pass, so the hook
// stepped on this rank's own gradients and the replicas drifted apart with
// no error.
DDP_TEST_WORKER(ddp_backward_in_an_unrelated_hook) {
  auto pg = testing::WorkerGroup();
  const int world = pg->size(), rank = pg->rank();
  const auto& data = testing::FashionMnist();
  for (const bool checkpointed_last : {false, true}) {
  for (const bool static_graph : {false, true}) {
    const std::string what = std::string("backward and step in a hook, forward at top level") +
                             (static_graph ? " (static_graph)" : "") +
                             (checkpointed_last ? " (last layer checkpointed)" : "");
    auto make = [&](uint64_t seed) -> std::shared_ptr<Module> {
      if (checkpointed_last) return std::make_shared<CheckpointedLast>(seed);
      return std::make_shared<TiedCheckpointed>(seed, /*checkpointed=*/false);
    };
    auto model = make(rank == 0 ? 5 : 60 + rank);
    DistributedDataParallel ddp(model, {.static_graph = static_graph, .process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    auto reference = make(5);
    nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
    std::string error;
    int steps = 0;
    for (; steps < 2 && error.empty(); ++steps) {
      Tensor w = nn::Ones({1});
      w.set_requires_grad(true);
      Tensor loss;
      nn::HookHandle hook = w.RegisterPostAccumulateGradHook([&](const Tensor&) {
        try {
          nn::Backward(loss);
          opt.Step();
        } catch (const std::exception& e) {
          error = e.what();
        }
      });
      try {
        opt.ZeroGrad();
        auto [x, y] = testing::Batch(data, (steps * world + rank) * kBatch, kBatch);
        loss = nn::loss::CrossEntropy(ddp(x), y);
        nn::Backward(nn::ops::Sum(w * 2.0));
      } catch (const std::exception& e) {
        error = e.what();
      }
      hook.Remove();
    }
    WORKER_EXPECT(error.empty(), what + ": " + error);
    if (!error.empty()) return testing::WorkerExit();  // the group may be aborted
    for (int s = 0; s < steps; ++s) ReferenceStep(*reference, ref_opt, s * world * kBatch, world * kBatch);
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
    WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
    WORKER_EXPECT(testing::SameOnAllRanks(*pg, testing::HashState(*model)), what + ": replicas differ");
    WORKER_EXPECT(ddp.iterations() == 2, what + ": iterations " + std::to_string(ddp.iterations()));
  }
  }
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, ABackwardRunFromAnUnrelatedPasssHookAfterATopLevelForwardAveragesBeforeTheStep) {
  auto run = RunWorkers("ddp_backward_in_an_unrelated_hook", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 90000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// What the wrapper keeps of forward's outputs (and, through their graph,
// the activations saved for backward). An eval-mode forward with grad
// enabled that no backward follows, run inside an unrelated pass's hook or
// at top level: nothing once the caller drops the outputs (the reducer
// used to keep them, with the graph, until the next forward). A training
// forward: nothing after its backward.
DDP_TEST_WORKER(outputs_not_kept) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  auto model = std::make_shared<CheckpointedLast>(5);
  DistributedDataParallel ddp(model, {.process_group = pg});
  auto [x, y] = testing::Batch(testing::FashionMnist(), rank * kBatch, kBatch);
  for (const bool in_hook : {true, false}) {
    const std::string what = std::string("eval-mode forward with grad enabled") +
                             (in_hook ? " in an unrelated pass's hook" : " at top level");
    ddp.Eval();
    std::weak_ptr<nn::TensorImpl> output;
    std::weak_ptr<nn::autograd::Node> node;
    bool recorded = false;
    auto evaluate = [&] {
      nn::GradModeGuard record(true);  // backward runs its hooks with grad mode off
      const Tensor out = ddp(x);
      output = out.impl_ptr();
      node = out.grad_fn();
      recorded = out.grad_fn() != nullptr;
    };
    if (in_hook) {
      Tensor w = nn::Ones({1});
      w.set_requires_grad(true);
      nn::HookHandle hook = w.RegisterPostAccumulateGradHook([&](const Tensor&) { evaluate(); });
      nn::Backward(nn::ops::Sum(w * 2.0));
      hook.Remove();
    } else {
      evaluate();
    }
    WORKER_EXPECT(recorded, what + ": the forward recorded no graph");
    WORKER_EXPECT(output.expired(), what + ": the output is still held after the caller dropped it");
    WORKER_EXPECT(node.expired(), what + ": its graph is still held after the caller dropped the output");
  }
  ddp.Train();
  std::weak_ptr<nn::TensorImpl> output;
  {
    const Tensor out = ddp(x);
    output = out.impl_ptr();
    nn::Backward(nn::loss::CrossEntropy(out, y));
  }
  WORKER_EXPECT(output.expired(), "training forward: the output is still held after its backward");
  WORKER_EXPECT(ddp.iterations() == 1, "iterations " + std::to_string(ddp.iterations()));
  return testing::WorkerExit();
}

TEST(DdpReentrantTest, TheWrapperKeepsNoOutputsOfAForwardNoBackwardFollowsNorAfterBackward) {
  auto run = RunWorkers("outputs_not_kept", 2, {{"DDP_TEST_TIMEOUT_MS", "20000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

}  // namespace
}  // namespace ddp::dist
