// DistributedDataParallel under the habits of a training script ported
// from PyTorch, over real processes: parameters frozen and unfrozen after
// wrapping, a submodule replaced or added after wrapping (with parameters,
// frozen ones, buffers, or none; an unused one frozen later, or added on
// one rank under Join), a GAN's discriminator frozen for the generator's
// step, two models' Joins on one group, a model with no parameters under
// Join, an exception inside nested NoSync scopes, and gradients from
// outside the wrapper (the wrapped module called directly, a penalty of its
// own).

#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

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
using nn::modules::Module;
using testing::RunWorkers;

constexpr int64_t kBatch = 8;

std::shared_ptr<Module> Mlp(uint64_t seed) {
  nn::Generator gen(seed);
  return nn::modules::MakeMlp(gen);
}

void SetFrozen(Module& model, const std::string& prefix, bool frozen) {
  for (const auto& [name, p] : model.NamedParameters()) {
    if (name.rfind(prefix, 0) == 0) p.set_requires_grad(!frozen);
  }
}

// One training step of `ddp` on (x, y) that must fail: every one of
// `parts` is in its error (`what` says which case, in the failure).
void ExpectStepRefused(DistributedDataParallel& ddp, const Tensor& x, const Tensor& y,
                       const std::vector<std::string>& parts, const std::string& what) {
  std::string error;
  try {
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::exception& e) {
    error = e.what();
  }
  for (const std::string& part : parts) {
    WORKER_EXPECT(error.find(part) != std::string::npos, what + ": no \"" + part + "\" in: " + error);
  }
}

// ------------------------------------------------- freeze and unfreeze ----

// The first Linear is frozen (requires_grad off) for steps 1 and 2 and
// trains again from step 3, as a fine-tuning script does with a backbone.
// With find_unused_parameters each step equals one step on the combined
// batch: a frozen parameter is unused, its stale gradient (ZeroGrad keeps
// it at zero when set_to_none is false) is not averaged into anything.
void CheckFreezeAndUnfreeze(ProcessGroup& pg, DdpOptions options, bool set_to_none, const std::string& what) {
  const auto& data = testing::FashionMnist();
  const int world = pg.size(), rank = pg.rank();
  auto model = Mlp(rank == 0 ? 3 : 70 + rank);
  options.find_unused_parameters = true;
  options.process_group = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
  DistributedDataParallel ddp(model, options);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto reference = Mlp(3);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  try {
    for (int s = 0; s < 5; ++s) {
      const bool frozen = s == 1 || s == 2;
      SetFrozen(*model, "1.", frozen);
      SetFrozen(*reference, "1.", frozen);
      opt.ZeroGrad(set_to_none);
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
      ref_opt.ZeroGrad(set_to_none);
      auto [xr, yr] = testing::Batch(data, s * world * kBatch, world * kBatch);
      nn::Backward(nn::loss::CrossEntropy((*reference)(xr), yr));
      ref_opt.Step();
      const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
      WORKER_EXPECT(diff <= 1e-5, what + ": step " + std::to_string(s) + ": `" + worst + "` off by " +
                                      std::to_string(diff));
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, what + " threw: " + e.what());
  }
  WORKER_EXPECT(testing::SameOnAllRanks(pg, testing::HashState(*model)), what + ": replicas differ");
}

DDP_TEST_WORKER(freeze_and_unfreeze) {
  auto pg = testing::WorkerGroup();
  for (const bool set_to_none : {true, false}) {
    const std::string zero = set_to_none ? " (set_to_none)" : " (zeroed)";
    CheckFreezeAndUnfreeze(*pg, {}, set_to_none, "buckets" + zero);
    CheckFreezeAndUnfreeze(*pg, {.gradient_as_bucket_view = true}, set_to_none, "views" + zero);
    CheckFreezeAndUnfreeze(*pg, {.inplace_gradient_mb = 0}, set_to_none, "no solo buckets" + zero);
    CheckFreezeAndUnfreeze(*pg, {.bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6}, set_to_none,
                           "one bucket per parameter" + zero);
  }
  return testing::WorkerExit();
}

TEST(DdpPortingTest, ParametersFrozenAndUnfrozenAfterWrappingTrainAsOneProcess) {
  auto run = RunWorkers("freeze_and_unfreeze", 2, {}, 120000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A parameter frozen after wrapping gets no gradient. Without
// find_unused_parameters, or frozen between forward and backward (the
// forward reached it), that backward fails on every rank naming it and
// saying that it no longer requires grad, rather than blaming the loss.
void CheckFrozenIsNamed(ProcessGroup& pg, bool find_unused, const std::string& what) {
  const auto& data = testing::FashionMnist();
  auto model = Mlp(3);
  DistributedDataParallel ddp(model, {.find_unused_parameters = find_unused,
                                      .process_group = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {})});
  auto [x, y] = testing::Batch(data, pg.rank() * kBatch, kBatch);
  if (!find_unused) SetFrozen(*model, "1.", true);
  std::string error;
  try {
    const Tensor loss = nn::loss::CrossEntropy(ddp(x), y);
    if (find_unused) SetFrozen(*model, "1.", true);
    nn::Backward(loss);
  } catch (const std::exception& e) {
    error = e.what();
  }
  WORKER_EXPECT(error.find("`1.weight` (index 0, requires_grad is false now)") != std::string::npos &&
                    error.find("frozen after wrapping") != std::string::npos,
                what + ": " + error);
}

DDP_TEST_WORKER(frozen_after_wrapping_is_named) {
  auto pg = testing::WorkerGroup();
  CheckFrozenIsNamed(*pg, false, "without find_unused_parameters");
  return testing::WorkerExit();
}

DDP_TEST_WORKER(frozen_before_backward_is_named) {
  auto pg = testing::WorkerGroup();
  CheckFrozenIsNamed(*pg, true, "find_unused_parameters, frozen between forward and backward");
  return testing::WorkerExit();
}

TEST(DdpPortingTest, AParameterFrozenAfterWrappingThatGetsNoGradientIsNamedAsFrozen) {
  // The failure aborts the group: one group per case.
  for (const char* worker : {"frozen_after_wrapping_is_named", "frozen_before_backward_is_named"}) {
    auto run = RunWorkers(worker, 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << worker << "\n" << testing::AllOutput(run);
  }
}

// ------------------------------------- a discriminator frozen for G ----

// A GAN step as PyTorch scripts write it (pix2pix, CycleGAN): the
// discriminator, a model wrapped of its own, is frozen (every parameter's
// requires_grad off) while the generator's loss goes through it, and
// unfrozen for its own step. Its forward then records no path to its
// parameters, so there is nothing to synchronize, and the discriminator's
// next step must not take it for an iteration whose backward never came.
// Both models follow the one-process run on the combined batch (plain,
// find_unused_parameters, static_graph), and the
// frozen forwards are no iterations (on one rank, which has no reducer,
// as on two).
void CheckFrozenDiscriminator(ProcessGroup& pg, DdpOptions options, const std::string& what) {
  const auto& data = testing::FashionMnist();
  const int world = pg.size(), rank = pg.rank();
  auto borrow = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
  auto g = Mlp(rank == 0 ? 5 : 30 + rank);
  nn::Generator gen(rank == 0 ? 6 : 40 + rank);
  std::shared_ptr<Module> d = std::make_shared<nn::modules::Linear>(10, 1, true, gen);
  options.process_group = borrow;
  DistributedDataParallel ddp_g(g, options);
  DistributedDataParallel ddp_d(d, options);
  nn::optim::Sgd opt_g(g->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  nn::optim::Sgd opt_d(d->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto ref_g = Mlp(5);
  nn::Generator ref_gen(6);
  std::shared_ptr<Module> ref_d = std::make_shared<nn::modules::Linear>(10, 1, true, ref_gen);
  nn::optim::Sgd ref_opt_g(ref_g->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  nn::optim::Sgd ref_opt_d(ref_d->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  try {
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      const Tensor fake = ddp_g(x);
      // Discriminator step on the generated batch, detached.
      SetFrozen(*d, "", false);
      opt_d.ZeroGrad();
      nn::Backward(nn::ops::Mean(ddp_d(fake.Detach())));
      opt_d.Step();
      // Generator step through the frozen discriminator.
      SetFrozen(*d, "", true);
      opt_g.ZeroGrad();
      nn::Backward(nn::ops::Mean(ddp_d(fake)) * -1.0);
      opt_g.Step();

      auto [xr, yr] = testing::Batch(data, s * world * kBatch, world * kBatch);
      const Tensor ref_fake = (*ref_g)(xr);
      SetFrozen(*ref_d, "", false);
      ref_opt_d.ZeroGrad();
      nn::Backward(nn::ops::Mean((*ref_d)(ref_fake.Detach())));
      ref_opt_d.Step();
      SetFrozen(*ref_d, "", true);
      ref_opt_g.ZeroGrad();
      nn::Backward(nn::ops::Mean((*ref_d)(ref_fake)) * -1.0);
      ref_opt_g.Step();
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, what + " threw: " + e.what());
    return;
  }
  for (const auto& [model, ref] : {std::pair{g, ref_g}, std::pair{d, ref_d}}) {
    const auto [diff, worst] = testing::MaxRelativeDifference(*model, *ref);
    WORKER_EXPECT(diff <= 1e-5, what + ": `" + worst + "` off by " + std::to_string(diff));
  }
  // The discriminator's own steps only, on one rank as on N.
  WORKER_EXPECT(ddp_d.iterations() == 3 && ddp_g.iterations() == 3,
                what + ": iterations " + std::to_string(ddp_g.iterations()) + " and " +
                    std::to_string(ddp_d.iterations()));
}

DDP_TEST_WORKER(frozen_discriminator) {
  auto pg = testing::WorkerGroup();
  CheckFrozenDiscriminator(*pg, {}, "plain");
  return testing::WorkerExit();
}

DDP_TEST_WORKER(frozen_discriminator_find_unused) {
  auto pg = testing::WorkerGroup();
  CheckFrozenDiscriminator(*pg, {.find_unused_parameters = true}, "find_unused_parameters");
  return testing::WorkerExit();
}

DDP_TEST_WORKER(frozen_discriminator_static_graph) {
  auto pg = testing::WorkerGroup();
  CheckFrozenDiscriminator(*pg, {.static_graph = true}, "static_graph");
  return testing::WorkerExit();
}

TEST(DdpPortingTest, AModelFrozenWholeForAnotherModelsStepTrainsAsOneProcess) {
  // A failure aborts the group: one group per case.
  for (const char* worker : {"frozen_discriminator", "frozen_discriminator_find_unused",
                             "frozen_discriminator_static_graph"}) {
    for (const int world : {1, 2}) {
      auto run = RunWorkers(worker, world, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 120000);
      EXPECT_TRUE(run.AllSucceeded()) << worker << " on " << world << " rank(s)\n" << testing::AllOutput(run);
    }
  }
}

// ---------------------------------------- a submodule replaced later ----

// The head replaced after wrapping (Module::ReplaceChild, as a fine-tuning
// script swaps the classifier): the wrapper synchronizes the parameters the
// model had when it was wrapped, so the new head's gradients would stay
// local and its values differ across ranks. Without find_unused_parameters
// the next forward is refused naming the new head (a parameter added after
// wrapping), rather than its backward suggesting find_unused_parameters,
// which would let the replicas drift silently; with it, the forward that
// reaches the new head is refused naming it.
void CheckReplacedHead(ProcessGroup& pg, bool find_unused, const std::vector<std::string>& expected,
                       const std::string& what) {
  const auto& data = testing::FashionMnist();
  auto model = Mlp(3);
  DistributedDataParallel ddp(model, {.find_unused_parameters = find_unused,
                                      .process_group = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {})});
  nn::Generator gen(100 + pg.rank());
  model->ReplaceChild("5", std::make_shared<nn::modules::Linear>(256, 10, true, gen));
  auto [x, y] = testing::Batch(data, pg.rank() * kBatch, kBatch);
  ExpectStepRefused(ddp, x, y, expected, what);
}

DDP_TEST_WORKER(replaced_head) {
  auto pg = testing::WorkerGroup();
  CheckReplacedHead(*pg, false,
                    {"parameter `5.weight` was added to the model after it was wrapped",
                     "the model again after changing it"},
                    "without find_unused_parameters");
  return testing::WorkerExit();
}

DDP_TEST_WORKER(replaced_head_find_unused) {
  auto pg = testing::WorkerGroup();
  // The new head's weight or bias, whichever the walk meets first.
  CheckReplacedHead(*pg, true,
                    {"parameter `5.", "` of the model was reached by this forward but is not one the wrapper synchronizes",
                     "the model again after changing it"},
                    "find_unused_parameters");
  return testing::WorkerExit();
}

TEST(DdpPortingTest, ASubmoduleReplacedAfterWrappingIsNamed) {
  // The failure aborts the group: one group per case.
  for (const char* worker : {"replaced_head", "replaced_head_find_unused"}) {
    auto run = RunWorkers(worker, 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << worker << "\n" << testing::AllOutput(run);
  }
}

// ------------------------------------------ a submodule added later ----

// A Linear appended to the wrapped model after wrapping and used by its
// forward (Sequential::Push, RegisterModule underneath): no bucket has its
// parameters, so without find_unused_parameters its gradient would stay
// local and its values (never broadcast) differ across ranks. The first
// step, before the change, trains; the next forward is refused on every
// rank, naming the new parameter. With find_unused_parameters and
// static_graph the graph walk stops after the first iteration, so the
// second forward is refused the same way.
void CheckAddedLayer(DdpOptions options, const std::string& what) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  nn::Generator init(3);
  auto model = nn::modules::MakeMlp(init);
  options.process_group = pg;
  DistributedDataParallel ddp(model, options);
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  try {
    for (int s = 0; s < 2; ++s) nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, what + ": a step before the change threw: " + e.what());
  }
  nn::Generator gen(100 + pg->rank());
  model->Push(std::make_shared<nn::modules::Linear>(10, 10, true, gen));
  ExpectStepRefused(ddp, x, y, {"rank " + std::to_string(pg->rank()) + ": parameter `6.weight`",
                                std::string("added to the model after it was wrapped"),
                                std::string("the model again after changing it")}, what);
}

DDP_TEST_WORKER(added_layer) {
  CheckAddedLayer({}, "default options");
  return testing::WorkerExit();
}

DDP_TEST_WORKER(added_layer_static_graph) {
  CheckAddedLayer({.find_unused_parameters = true, .static_graph = true}, "find_unused_parameters, static_graph");
  return testing::WorkerExit();
}

// Modules built after wrapping elsewhere in the process (another model, a
// Sequential grown with Push) change nothing the wrapper synchronizes:
// training goes on, each step still equal to one step on the combined batch.
DDP_TEST_WORKER(unrelated_module_added) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  auto model = Mlp(3);
  DistributedDataParallel ddp(model, {.process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = Mlp(3);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  std::vector<std::shared_ptr<Module>> others;
  try {
    for (int s = 0; s < 3; ++s) {
      nn::Generator gen(200 + s);
      auto other = nn::modules::MakeMlp(gen);
      other->Push(std::make_shared<nn::modules::Linear>(10, 10, true, gen));
      others.push_back(other);
      opt.ZeroGrad();
      auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
      ref_opt.ZeroGrad();
      auto [xr, yr] = testing::Batch(data, s * world * kBatch, world * kBatch);
      nn::Backward(nn::loss::CrossEntropy((*reference)(xr), yr));
      ref_opt.Step();
      const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
      WORKER_EXPECT(diff <= 1e-5, "step " + std::to_string(s) + ": `" + worst + "` off by " + std::to_string(diff));
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("threw: ") + e.what());
  }
  return testing::WorkerExit();
}

TEST(DdpPortingTest, ASubmoduleAddedAfterWrappingIsNamedAtTheNextForward) {
  for (const char* worker : {"added_layer", "added_layer_static_graph", "unrelated_module_added"}) {
    auto run = RunWorkers(worker, 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << worker << "\n" << testing::AllOutput(run);
  }
}

// ------------------------- a buffer or frozen parameter added later ----

// FNV-1a over the bytes of `tensors`, to compare them across ranks.
uint64_t HashTensors(const std::vector<Tensor>& tensors) {
  uint64_t h = 1469598103934665603ull;
  for (const Tensor& t : tensors) {
    const Tensor c = t.Detach().Contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  }
  return h;
}

// The MLP with a BatchNorm1d (statistics only, no parameters) on its
// output: `6.running_mean`, `6.running_var`, `6.num_batches_tracked`.
std::shared_ptr<nn::modules::Sequential> MlpWithNorm() {
  nn::Generator init(3);
  auto model = nn::modules::MakeMlp(init);
  model->Push(std::make_shared<nn::modules::BatchNorm1d>(10, nn::modules::BatchNormOptions{.affine = false}));
  return model;
}

// The BatchNorm swapped for a fresh one after wrapping (ReplaceChild, as a
// script converting or resetting its normalization layers does): the
// buffer broadcast was fixed at wrapping, so with broadcast_buffers the new
// statistics would differ across ranks without a word. The model's own
// buffers and a BatchNorm built elsewhere in the process pass; the forward
// after the swap is refused on every rank, naming the new buffer.
DDP_TEST_WORKER(added_buffer) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = MlpWithNorm();
  DistributedDataParallel ddp(model, {.process_group = pg});
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  std::vector<std::shared_ptr<Module>> others;
  try {
    for (int s = 0; s < 2; ++s) {
      others.push_back(std::make_shared<nn::modules::BatchNorm1d>(10));
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("a step before the swap threw: ") + e.what());
  }
  model->ReplaceChild("6", std::make_shared<nn::modules::BatchNorm1d>(
                               10, nn::modules::BatchNormOptions{.affine = false}));
  ExpectStepRefused(ddp, x, y, {"rank " + std::to_string(pg->rank()) + ": buffer `6.running_mean`",
                                std::string("added to the model after it was wrapped"),
                                std::string("the model again after changing it"),
                                std::string("broadcast_buffers = false")}, "added_buffer");
  return testing::WorkerExit();
}

// Without broadcast_buffers every buffer is each rank's own after wrapping,
// so the swapped-in BatchNorm's are too: training goes on, the parameters
// equal on every rank.
DDP_TEST_WORKER(added_buffer_not_broadcast) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = MlpWithNorm();
  DistributedDataParallel ddp(model, {.broadcast_buffers = false, .process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  model->ReplaceChild("6", std::make_shared<nn::modules::BatchNorm1d>(
                               10, nn::modules::BatchNormOptions{.affine = false}));
  try {
    for (int s = 0; s < 2; ++s) {
      opt.ZeroGrad();
      auto [x, y] = testing::Batch(data, (s * pg->size() + pg->rank()) * kBatch, kBatch);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("threw: ") + e.what());
  }
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, HashTensors(model->Parameters())), "the parameters differ");
  return testing::WorkerExit();
}

// A frozen head appended after wrapping, each rank's initialized
// differently (PyTorch broadcasts frozen parameters at wrapping too): no
// gradient of it is synchronized, nor can a graph walk meet it, yet its
// values differ across ranks and reach the outputs. The next forward is
// refused on every rank, naming it, with or without find_unused_parameters.
void CheckAddedFrozen(DdpOptions options, const std::string& what) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  nn::Generator init(3);
  auto model = nn::modules::MakeMlp(init);
  options.process_group = pg;
  DistributedDataParallel ddp(model, options);
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  try {
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, what + ": a step before the change threw: " + e.what());
  }
  nn::Generator gen(100 + pg->rank());
  auto head = std::make_shared<nn::modules::Linear>(10, 10, true, gen);
  for (const Tensor& p : head->Parameters()) p.set_requires_grad(false);
  model->Push(head);
  ExpectStepRefused(ddp, x, y, {"rank " + std::to_string(pg->rank()) + ": parameter `6.weight`",
                                std::string("added to the model after it was wrapped"),
                                std::string("does not require grad (frozen)"),
                                std::string("the model again after changing it")}, what);
}

DDP_TEST_WORKER(added_frozen) {
  CheckAddedFrozen({}, "default options");
  return testing::WorkerExit();
}

DDP_TEST_WORKER(added_frozen_find_unused) {
  CheckAddedFrozen({.find_unused_parameters = true}, "find_unused_parameters");
  return testing::WorkerExit();
}

TEST(DdpPortingTest, ABufferOrFrozenParameterAddedAfterWrappingIsNamedAtTheNextForward) {
  // A refusal aborts the group: one group per case.
  for (const char* worker :
       {"added_buffer", "added_buffer_not_broadcast", "added_frozen", "added_frozen_find_unused"}) {
    auto run = RunWorkers(worker, 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << worker << "\n" << testing::AllOutput(run);
  }
}

// -------------------------------- a head replaced by no parameters ----

// The head replaced between forward and backward by a module without
// parameters: that backward still reaches the old head (the graph holds
// it), so its gradients are synchronized. The next forward adds nothing to
// refuse, but its backward gives the old head no gradient: it fails on
// every rank naming those parameters as no longer in the model.
DDP_TEST_WORKER(head_removed) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = Mlp(3);
  DistributedDataParallel ddp(model, {.process_group = pg});
  const std::shared_ptr<Module> old_head = model->Child("5");
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  try {
    const Tensor loss = nn::loss::CrossEntropy(ddp(x), y);
    model->ReplaceChild("5", std::make_shared<nn::modules::Identity>());
    nn::Backward(loss);
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("the backward of the forward before the change threw: ") + e.what());
  }
  std::vector<Tensor> grads;
  for (const Tensor& p : old_head->Parameters()) grads.push_back(p.grad());
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, HashTensors(grads)), "the old head's gradients differ");
  ExpectStepRefused(ddp, x, y, {"on rank " + std::to_string(pg->rank()) + ": 2 parameter(s) received no gradient",
                                std::string("`5.weight` (index 4, no longer a parameter of the model)"),
                                std::string("no forward reaches them now"),
                                std::string("wrap the model again after changing it")}, "head_removed");
  return testing::WorkerExit();
}

TEST(DdpPortingTest, AHeadReplacedByAModuleWithoutParametersIsNamedAsNoLongerInTheModel) {
  auto run = RunWorkers("head_removed", 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------- an unused added parameter, later ----

// A Linear body (784 -> 10) and, once AddSpare registered it, a spare head
// (10 -> 10) applied after the body while set_use_spare(true): a
// parameter added after wrapping that the forward can leave unused.
class WithSpare : public Module {
 public:
  WithSpare() {
    nn::Generator gen(3);
    body_ = RegisterModule("body", std::make_shared<nn::modules::Linear>(784, 10, true, gen));
  }
  void AddSpare(uint64_t seed) {
    nn::Generator gen(seed);
    spare_ = RegisterModule("spare", std::make_shared<nn::modules::Linear>(10, 10, true, gen));
  }
  void set_use_spare(bool use) { use_spare_ = use; }
  Tensor Forward(const Tensor& x) override {
    const Tensor h = (*body_)(nn::ops::Flatten(x, 1));
    return use_spare_ ? (*spare_)(h) : h;
  }
  using Module::Forward;
  std::string TypeName() const override { return "WithSpare"; }

 private:
  std::shared_ptr<nn::modules::Linear> body_, spare_;
  bool use_spare_ = false;
};

// Under find_unused_parameters a trainable parameter added after wrapping
// is left to the graph walk, and one the forward does not reach is merely
// unused: training goes on. Frozen later and used by the forward, no walk
// meets it, yet its values (each rank's own initialization) reach the
// outputs: the forward after the freeze is refused on every rank, naming
// it, as a frozen parameter added after wrapping is.
DDP_TEST_WORKER(added_unused_then_frozen) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = std::make_shared<WithSpare>();
  DistributedDataParallel ddp(model, {.find_unused_parameters = true, .process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  try {
    for (int s = 0; s < 3; ++s) {
      if (s == 1) model->AddSpare(100 + pg->rank());
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("a step with the spare head unused threw: ") + e.what());
  }
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, HashTensors(model->Child("body")->Parameters())),
                "the body's parameters differ");
  for (const Tensor& p : model->Child("spare")->Parameters()) p.set_requires_grad(false);
  model->set_use_spare(true);
  ExpectStepRefused(ddp, x, y, {"rank " + std::to_string(pg->rank()) + ": parameter `spare.weight`",
                                std::string("added to the model after it was wrapped"),
                                std::string("does not require grad (frozen)"),
                                std::string("the model again after changing it")}, "added_unused_then_frozen");
  return testing::WorkerExit();
}

TEST(DdpPortingTest, AnUnusedParameterAddedAfterWrappingAndFrozenLaterIsNamedAtTheNextForward) {
  auto run = RunWorkers("added_unused_then_frozen", 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The same spare head, added after wrapping under find_unused_parameters
// and used only by forwards under NoSync (an auxiliary loss accumulated
// between synchronizing steps), each rank's initialized differently. The
// graph walk that refuses an added parameter ran at synchronizing forwards
// only, and those leave the head unused: its gradients accumulated in .grad
// each rank's own, never averaged nor refused. Now the NoSync forward that
// reaches it is refused on every rank, naming it. DDP_TEST_BROADCAST=false:
// no buffer broadcast either, so that NoSync forward synchronizes nothing
// at all (it used not to look at the model's structure).
DDP_TEST_WORKER(added_reached_under_no_sync) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const bool broadcast = std::string(std::getenv("DDP_TEST_BROADCAST")) == "true";
  auto model = std::make_shared<WithSpare>();
  DistributedDataParallel ddp(model, {.broadcast_buffers = broadcast, .find_unused_parameters = true,
                                      .process_group = pg});
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  std::string error = "no error";
  try {
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    model->AddSpare(100 + pg->rank());
    for (int s = 0; s < 2; ++s) {
      {
        auto no_sync = ddp.NoSync();
        model->set_use_spare(true);
        nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      }
      model->set_use_spare(false);
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::string what = std::string("broadcast_buffers ") + (broadcast ? "true" : "false");
  for (const std::string& part :
       {"rank " + std::to_string(pg->rank()) + ": parameter `spare.",
        std::string("was reached by this forward but is not one the wrapper synchronizes"),
        std::string("The process group was aborted.")}) {
    WORKER_EXPECT(error.find(part) != std::string::npos, what + ": no \"" + part + "\" in: " + error);
  }
  return testing::WorkerExit();
}

TEST(DdpPortingTest, AParameterAddedAfterWrappingAndReachedUnderNoSyncIsNamedThere) {
  for (const char* broadcast : {"true", "false"}) {
    auto run = RunWorkers("added_reached_under_no_sync", 2,
                          {{"DDP_TEST_BROADCAST", broadcast}, {"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << broadcast << "\n" << testing::AllOutput(run);
  }
}

// Under Join, rank 1 alone added a spare head after wrapping and leaves it
// unused (find_unused_parameters lets it): the ranks' models now list
// different parameters. Join::Wait's final broadcast takes the parameters
// every rank had at wrapping, so it lines up across ranks (the model's
// current lists differ in length) and the body ends equal on both ranks,
// rank 1's (it ran the most iterations).
DDP_TEST_WORKER(join_after_added_unused) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto model = std::make_shared<WithSpare>();
  DistributedDataParallel ddp(model, {.find_unused_parameters = true, .process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  if (rank == 1) model->AddSpare(100);
  uint64_t last = 0;
  try {
    Join join(ddp);
    for (int s = 0; s < 2 + 2 * rank; ++s) {
      auto [x, y] = testing::Batch(data, (s * pg->size() + rank) * kBatch, kBatch);
      opt.ZeroGrad();
      nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
      opt.Step();
    }
    last = HashTensors(model->Child("body")->Parameters());
    join.Wait();
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("threw: ") + e.what());
  }
  const uint64_t body = HashTensors(model->Child("body")->Parameters());
  if (rank == 1) WORKER_EXPECT(body == last, "the last active rank's body was overwritten");
  WORKER_EXPECT(testing::SameOnAllRanks(*pg, body), "the body's parameters differ after Join::Wait");
  return testing::WorkerExit();
}

TEST(DdpPortingTest, JoinWaitBroadcastsTheParametersOfWrappingWhenOneRankAddedAnUnusedOne) {
  auto run = RunWorkers("join_after_added_unused", 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------- two Joins, one group ----

// Two models trained together (a GAN), each in a Join of its own on one
// group: a rank in the generator's Join::Wait would pair its collectives
// with the discriminator's on the ranks still training, and fail on
// arguments that differ. The second Join is refused on every rank, naming
// the cause; one Join after the other's Wait returned is fine.
DDP_TEST_WORKER(two_joins) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int rank = pg->rank();
  auto g = Mlp(5);
  nn::Generator gen(6);
  std::shared_ptr<Module> d = std::make_shared<nn::modules::Linear>(10, 1, true, gen);
  DistributedDataParallel ddp_g(g, {.process_group = pg});
  DistributedDataParallel ddp_d(d, {.process_group = pg});
  std::string error;
  try {
    Join join_g(ddp_g);
    Join join_d(ddp_d);
    for (int s = 0; s < 1 + (rank == 0 ? 2 : 0); ++s) {
      auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
      nn::Backward(nn::ops::Mean(ddp_d(ddp_g(x))));
    }
    join_g.Wait();
    join_d.Wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  WORKER_EXPECT(error.find("Join on rank " + std::to_string(rank) + ": another DistributedDataParallel model on "
                           "this process group is in a Join") != std::string::npos,
                "error: " + error);
  // Neither Join is left in progress: one model's Join, then the other's.
  try {
    for (DistributedDataParallel* ddp : {&ddp_g, &ddp_d}) {
      Join join(*ddp);
      join.Wait();
      Join again(ddp == &ddp_g ? ddp_d : ddp_g);
      again.Wait();
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("sequential Joins threw: ") + e.what());
  }
  return testing::WorkerExit();
}

TEST(DdpPortingTest, ASecondModelsJoinOnOneGroupIsRefused) {
  auto run = RunWorkers("two_joins", 2, {{"DDP_TEST_TIMEOUT_MS", "5000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------ no parameters, Join ----

// A wrapper of a module without parameters (nothing to reduce) under Join
// with uneven inputs: every rank's Wait returns.
DDP_TEST_WORKER(no_parameters_join) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = std::make_shared<nn::modules::Flatten>();
  DistributedDataParallel ddp(model, {.process_group = pg});
  {
    Join join(ddp);
    for (int s = 0; s < 2 + pg->rank(); ++s) {
      auto [x, y] = testing::Batch(data, s * kBatch, kBatch);
      Tensor out = ddp(x);
      WORKER_EXPECT(out.dim() == 2, "flattened");
    }
    join.Wait();
  }
  return testing::WorkerExit();
}

TEST(DdpPortingTest, AModelWithoutParametersRunsUnderJoin) {
  auto run = RunWorkers("no_parameters_join", 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------- NoSync and an exception ----

// The module throws inside nested NoSync scopes (a batch of the wrong
// width, caught by the script): the guards restore synchronization on the
// way out, and the next steps train as one process.
DDP_TEST_WORKER(no_sync_exception) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  const int world = pg->size(), rank = pg->rank();
  auto model = Mlp(rank == 0 ? 3 : 11);
  DistributedDataParallel ddp(model, {.process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  auto reference = Mlp(3);
  nn::optim::Sgd ref_opt(reference->NamedParameters(), {.lr = 0.05});
  bool threw = false;
  try {
    auto guard = ddp.NoSync();
    auto inner = ddp.NoSync();
    (void)ddp(nn::Zeros({2, 5}));  // wrong width: the module throws
  } catch (const std::exception&) {
    threw = true;
  }
  WORKER_EXPECT(threw, "the forward of a batch of the wrong width did not throw");
  for (int s = 0; s < 2; ++s) {
    opt.ZeroGrad();
    auto [x, y] = testing::Batch(data, (s * world + rank) * kBatch, kBatch);
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    opt.Step();
    ref_opt.ZeroGrad();
    auto [xr, yr] = testing::Batch(data, s * world * kBatch, world * kBatch);
    nn::Backward(nn::loss::CrossEntropy((*reference)(xr), yr));
    ref_opt.Step();
  }
  const auto [diff, worst] = testing::MaxRelativeDifference(*model, *reference);
  WORKER_EXPECT(diff <= 1e-5, "`" + worst + "` off by " + std::to_string(diff));
  return testing::WorkerExit();
}

TEST(DdpPortingTest, NoSyncLeftByAnExceptionSynchronizesTheNextStep) {
  auto run = RunWorkers("no_sync_exception", 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------- the wrapped module called alone ----

// After a synchronizing backward, a gradient from the wrapped module called
// directly (as a port calling ddp.module for an auxiliary loss does), or
// from a penalty on the parameters backpropagated on its own, would go into
// .grad unsynchronized: the error names the rank, the parameter and these
// causes, not only a second backward of one forward.
DDP_TEST_WORKER(gradient_from_outside_the_wrapper) {
  auto pg = testing::WorkerGroup();
  const auto& data = testing::FashionMnist();
  auto model = Mlp(3);
  DistributedDataParallel ddp(model, {.process_group = pg});
  auto [x, y] = testing::Batch(data, pg->rank() * kBatch, kBatch);
  for (const bool penalty : {false, true}) {
    const std::string what = penalty ? "penalty" : "module called directly";
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    std::string error;
    try {
      if (penalty) {
        const Tensor w = model->NamedParameters().at(4).second;
        nn::Backward(nn::ops::Sum(w * w) * 1e-4);
      } else {
        nn::Backward(nn::loss::CrossEntropy((*model)(x), y));
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    // The last layer's gradients come first; which of its two is the engine's choice.
    const std::string first = penalty ? "`5.weight`" : "`5.";
    WORKER_EXPECT(error.find("on rank " + std::to_string(pg->rank()) + ": parameter " + first) != std::string::npos,
                  what + ": " + error);
    WORKER_EXPECT(error.find("the wrapped module called directly") != std::string::npos, what + ": " + error);
    WORKER_EXPECT(error.find("a loss term computed outside the wrapper's forward") != std::string::npos,
                  what + ": " + error);
  }
  return testing::WorkerExit();
}

TEST(DdpPortingTest, AGradientFromOutsideTheWrapperAfterItsBackwardNamesTheCauses) {
  auto run = RunWorkers("gradient_from_outside_the_wrapper", 2, {{"DDP_TEST_TIMEOUT_MS", "10000"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

}  // namespace
}  // namespace ddp::dist
