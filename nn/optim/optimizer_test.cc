#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <tuple>

#include "nn/io/checkpoint.h"
#include "nn/ops/functional.h"
#include "nn/optim/adadelta.h"
#include "nn/optim/adagrad.h"
#include "nn/optim/adam.h"
#include "nn/optim/clip_grad.h"
#include "nn/optim/grad_scaler.h"
#include "nn/optim/kernel_util.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/rmsprop.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/generator.h"

// The next operator new of exactly this many bytes on this thread fails,
// once, as when memory has just run out (0: none). Replacing the global
// operator new is the seam; it reaches the library's std::vector too.
namespace {
thread_local std::size_t refuse_new_of_bytes = 0;
}  // namespace

void* operator new(std::size_t bytes) {
  if (refuse_new_of_bytes != 0 && bytes == refuse_new_of_bytes) {
    refuse_new_of_bytes = 0;
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
// Not inlined: GCC would take a free() of what a new expression returned
// for a mismatch.
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace ddp::nn::optim {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

std::string TmpPath(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return std::string(base ? base : "/tmp") + "/" + std::to_string(getpid()) + "_" + name;
}

using Factory = std::function<std::unique_ptr<Optimizer>(NamedParameters)>;

std::vector<std::pair<std::string, Factory>> AllOptimizers() {
  return {
      {"sgd", [](NamedParameters p) { return std::make_unique<Sgd>(p, SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true}); }},
      {"adam", [](NamedParameters p) { return std::make_unique<Adam>(p, AdamOptions{.lr = 1e-2, .amsgrad = true}); }},
      {"adamw", [](NamedParameters p) { return std::make_unique<AdamW>(p, AdamWOptions{.lr = 1e-2}); }},
      {"adadelta", [](NamedParameters p) { return std::make_unique<Adadelta>(p, AdadeltaOptions{}); }},
      {"rmsprop", [](NamedParameters p) {
         return std::make_unique<Rmsprop>(
             p, RmspropOptions{.weight_decay = 1e-3, .momentum = 0.9, .centered = true});
       }},
      {"adagrad", [](NamedParameters p) {
         return std::make_unique<Adagrad>(
             p, AdagradOptions{.lr = 0.1, .lr_decay = 0.01, .initial_accumulator_value = 0.1});
       }},
  };
}

NamedParameters MakeParams(DType dtype, uint64_t seed) {
  Generator gen(seed);
  NamedParameters params = {{"fc.weight", Randn({8, 5}, {.dtype = DType::kFloat32}, gen).To(dtype)},
                            {"fc.bias", Randn({8}, {.dtype = DType::kFloat32}, gen).To(dtype)}};
  return params;
}

// Gradients that depend on the parameters (grad of 0.5 * |p - 0.3|^2 plus a
// step-dependent term), so the trajectory feeds back on itself.
void SetGrads(const NamedParameters& params, int step) {
  for (const auto& [name, p] : params) {
    std::vector<double> v = p.ToVector<double>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = (v[i] - 0.3) + 0.1 * std::sin(step + 0.7 * i);
    p.set_grad(FromVector(v, p.shape(), {.dtype = p.dtype()}));
  }
}

// Steps `opt` through steps [from, to) with SetGrads's gradients.
void TrainSteps(const NamedParameters& params, Optimizer& opt, int from, int to) {
  for (int s = from; s < to; ++s) {
    SetGrads(params, s);
    opt.Step();
  }
}

std::vector<std::vector<uint8_t>> Bytes(const NamedParameters& params) {
  std::vector<std::vector<uint8_t>> out;
  for (const auto& [name, p] : params) {
    const auto* b = static_cast<const uint8_t*>(p.data_ptr());
    out.emplace_back(b, b + p.nbytes());
  }
  return out;
}

// Entries of a state dict under `prefix` ("state." for the per-parameter ones).
size_t EntriesUnder(const NamedTensors& state, const std::string& prefix) {
  size_t n = 0;
  for (const auto& [k, t] : state) n += k.rfind(prefix, 0) == 0;
  return n;
}

// `state` as saved before the options were: without its "group." keys.
NamedTensors WithoutOptions(NamedTensors state) {
  std::erase_if(state, [](const auto& e) { return e.first.rfind("group.", 0) == 0; });
  return state;
}

// Save after 5 steps (through a real checkpoint file), restore into a new
// optimizer and new parameters, continue: bit-identical to never stopping.
// The update loops have a baseline and an AVX2 build (kernel_util.h), which
// must agree bit for bit: the AVX2 one may not contract a multiply-add.
// Every option that picks another loop is stepped, on 1031 elements (a
// remainder for every vector width), in f32 and f64.
TEST(OptimizerKernels, WideAndBaselineLoopsGiveTheSameBits) {
  std::vector<std::pair<std::string, Factory>> cases = AllOptimizers();
  cases.push_back({"sgd plain", [](NamedParameters p) { return std::make_unique<Sgd>(p, SgdOptions{.lr = 0.05}); }});
  cases.push_back({"sgd momentum", [](NamedParameters p) {
                     return std::make_unique<Sgd>(p, SgdOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.1});
                   }});
  cases.push_back({"adam coupled wd", [](NamedParameters p) {
                     return std::make_unique<Adam>(p, AdamOptions{.lr = 1e-2, .weight_decay = 0.1});
                   }});
  cases.push_back({"adadelta wd", [](NamedParameters p) {
                     return std::make_unique<Adadelta>(p, AdadeltaOptions{.weight_decay = 0.1});
                   }});
  cases.push_back({"rmsprop plain", [](NamedParameters p) { return std::make_unique<Rmsprop>(p, RmspropOptions{}); }});
  cases.push_back({"rmsprop centered, lerp's large-weight form", [](NamedParameters p) {
                     return std::make_unique<Rmsprop>(p, RmspropOptions{.alpha = 0.3, .centered = true});
                   }});
  cases.push_back({"adagrad wd", [](NamedParameters p) {
                     return std::make_unique<Adagrad>(p, AdagradOptions{.weight_decay = 0.1});
                   }});
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    for (const auto& [name, make] : cases) {
      std::vector<Tensor> finals;
      for (bool baseline : {true, false}) {
        internal::baseline_loops_for_testing = baseline;
        Generator gen(17);
        NamedParameters params = {{"w", Randn({1031}, {.dtype = DType::kFloat32}, gen).To(dtype)}};
        std::unique_ptr<Optimizer> opt = make(params);
        for (int step = 1; step <= 4; ++step) {
          SetGrads(params, step);
          opt->Step();
        }
        finals.push_back(params[0].second);
      }
      internal::baseline_loops_for_testing = false;
      ASSERT_EQ(finals[0].nbytes(), finals[1].nbytes());
      EXPECT_EQ(std::memcmp(finals[0].data_ptr(), finals[1].data_ptr(), finals[0].nbytes()), 0)
          << name << " in " << DTypeName(dtype) << ": the AVX2 loop's parameters differ from the baseline's";
    }
  }
}

TEST(OptimizerState, RoundTripGivesIdenticalContinuedTrajectories) {
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    for (const auto& [name, make] : AllOptimizers()) {
      SCOPED_TRACE(name + " " + std::string(DTypeName(dtype)));
      NamedParameters a = MakeParams(dtype, 1);
      auto opt_a = make(a);
      LrScheduler sched_a(*opt_a, WarmupCosineSchedule(3, 12, 0.1));
      for (int s = 0; s < 5; ++s) {
        SetGrads(a, s);
        opt_a->Step();
        sched_a.Step();
      }
      io::Checkpoint ckpt;
      ckpt.model = {a.begin(), a.end()};
      ckpt.optimizer = opt_a->StateDict();
      for (auto& kv : sched_a.StateDict()) ckpt.optimizer.push_back(kv);
      const std::string path = TmpPath(name + "_opt.safetensors");
      io::SaveCheckpoint(path, ckpt);
      for (int s = 5; s < 10; ++s) {
        SetGrads(a, s);
        opt_a->Step();
        sched_a.Step();
      }

      io::Checkpoint loaded = io::LoadCheckpoint(path);
      NamedParameters b = MakeParams(dtype, 2);  // different values, overwritten below
      for (size_t i = 0; i < b.size(); ++i) {
        ASSERT_EQ(loaded.model[i].first, b[i].first);
        b[i].second.CopyFrom(loaded.model[i].second);
      }
      auto opt_b = make(b);
      LrScheduler sched_b(*opt_b, WarmupCosineSchedule(3, 12, 0.1));
      opt_b->LoadStateDict(loaded.optimizer);
      sched_b.LoadStateDict(loaded.optimizer);
      EXPECT_EQ(opt_b->lr(), sched_b.lr());
      EXPECT_EQ(sched_b.step_count(), 5);
      for (int s = 5; s < 10; ++s) {
        SetGrads(b, s);
        opt_b->Step();
        sched_b.Step();
      }
      EXPECT_EQ(Bytes(a), Bytes(b));
      EXPECT_EQ(opt_a->lr(), opt_b->lr());
    }
  }
}

TEST(OptimizerState, KeysAndShapes) {
  NamedParameters p = MakeParams(DType::kBFloat16, 1);
  Adam opt(p, {});
  // Before the first step: lr, the options and each parameter's step, 0.
  std::vector<std::string> keys;
  for (const auto& [k, t] : opt.StateDict()) {
    keys.push_back(k);
    if (k.rfind("state.", 0) == 0) {
      EXPECT_EQ(t.ToVector<int64_t>(), std::vector<int64_t>{0}) << k;
    }
  }
  EXPECT_EQ(keys, (std::vector<std::string>{"lr", "group.optimizer", "group.beta1", "group.beta2", "group.eps",
                                            "group.weight_decay", "group.amsgrad", "group.maximize",
                                            "group.params_listed", "state.fc.weight.step", "state.fc.bias.step"}));
  SetGrads(p, 0);
  opt.Step();
  keys.clear();
  for (const auto& [k, t] : opt.StateDict()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"lr", "group.optimizer", "group.beta1", "group.beta2", "group.eps",
                                            "group.weight_decay", "group.amsgrad", "group.maximize",
                                            "group.params_listed",
                                            "state.fc.weight.step", "state.fc.weight.exp_avg",
                                            "state.fc.weight.exp_avg_sq", "state.fc.weight.master",
                                            "state.fc.bias.step", "state.fc.bias.exp_avg",
                                            "state.fc.bias.exp_avg_sq", "state.fc.bias.master"}));
}

TEST(OptimizerState, BadStateListsEveryProblemAndChangesNothing) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd opt(p, {.lr = 0.1, .momentum = 0.9});
  SetGrads(p, 0);
  opt.Step();
  NamedTensors state = opt.StateDict();
  NamedTensors bad;
  for (auto& [k, t] : state) {
    if (k == "state.fc.bias.step") continue;  // missing
    if (k == "state.fc.weight.momentum_buffer") {
      bad.emplace_back(k, Zeros({5, 8}));  // wrong shape
      continue;
    }
    bad.emplace_back(k, t);
  }
  bad.emplace_back("state.fc.other.momentum_buffer", Zeros({1}));
  bad.emplace_back("scheduler.step", Zeros({1}));  // not the optimizer's: ignored
  const NamedTensors before = opt.StateDict();
  try {
    opt.LoadStateDict(bad);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("3 problem(s)"), HasSubstr("missing `state.fc.bias.step`"),
                                HasSubstr("`state.fc.weight.momentum_buffer` is f32 [5, 8], expected f32 [8, 5]"),
                                HasSubstr("unexpected `state.fc.other.momentum_buffer`")));
  }
  const NamedTensors after = opt.StateDict();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(before[i].second.ToVector<double>(), after[i].second.ToVector<double>());
  }
}

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// A step entry of the largest i64 loaded, and the next Step wrapped the
// count to the most negative one: Adam's bias corrections became inf, and
// a state saved after that was refused for its negative step. The load is
// refused naming the entry, and nothing changes.
TEST(OptimizerState, AStepCountTheNextStepWouldOverflowIsRefused) {
  Tensor w = Ones({2});
  Adam opt({{"w", w}}, {.lr = 0.1});
  w.set_grad(Ones({2}));
  opt.Step();
  NamedTensors state = opt.StateDict();
  for (auto& [k, t] : state) {
    if (k == "state.w.step") t = FromVectorOf<int64_t>({std::numeric_limits<int64_t>::max()}, {});
  }
  EXPECT_THAT(ErrorOf([&] { opt.LoadStateDict(state); }),
              HasSubstr("`state.w.step` is 9223372036854775807, the largest i64: the next step's count would "
                        "overflow"));
  EXPECT_EQ(opt.step_count(0), 1);
  for (auto& [k, t] : state) {
    if (k == "state.w.step") t = FromVectorOf<int64_t>({std::numeric_limits<int64_t>::max() - 1}, {});
  }
  opt.LoadStateDict(state);
  opt.Step();
  EXPECT_EQ(opt.step_count(0), std::numeric_limits<int64_t>::max());
}

// A step entry of 0 (a parameter held but never updated) skipped the
// checks every other step entry gets: one of another shape (i64 [1], say)
// loaded as if StateDict had written it. It is refused naming the key and
// both shapes, as a non-zero one is, and nothing changes.
TEST(OptimizerState, ANeverUpdatedStepOfAnotherShapeIsRefusedNamingIt) {
  NamedParameters p = {{"w", Ones({3})}, {"b", Ones({2})}};
  Adam opt(p, {.lr = 0.1});
  p[0].second.set_grad(Ones({3}));
  opt.Step();
  NamedTensors state = opt.StateDict();
  for (auto& [k, t] : state) {
    if (k == "state.b.step") t = FromVectorOf<int64_t>({0}, {1});
  }
  const NamedTensors before = opt.StateDict();
  EXPECT_THAT(ErrorOf([&] { opt.LoadStateDict(state); }),
              AllOf(HasSubstr("1 problem(s)"), HasSubstr("`state.b.step` is i64 [1], expected i64 []")));
  EXPECT_THAT(ErrorOf([&] { opt.CheckStateDict(state); }), HasSubstr("`state.b.step` is i64 [1], expected i64 []"));
  const NamedTensors after = opt.StateDict();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(before[i].second.ToVector<double>(), after[i].second.ToVector<double>()) << before[i].first;
  }
}

// The CPU backend with an allocator that refuses, once, the `nth` request
// of `bytes` bytes (1 the next), as when memory has just run out; every
// other request goes to the CPU allocator. Installed for the object's life.
class RefuseOneCpuAllocation : public Allocator {
 public:
  RefuseOneCpuAllocation(size_t bytes, int nth) : bytes_(bytes), left_(nth), saved_(GetDeviceBackend(kCPU)) {
    DeviceBackend cpu = saved_;
    cpu.allocator = this;
    RegisterDeviceBackend(DeviceType::kCPU, cpu);
  }
  ~RefuseOneCpuAllocation() override { RegisterDeviceBackend(DeviceType::kCPU, saved_); }
  void* Allocate(size_t nbytes, Device device) override {
    if (nbytes == bytes_ && left_ > 0 && --left_ == 0) {
      refused_ = true;
      throw std::bad_alloc();
    }
    return CpuAllocator().Allocate(nbytes, device);
  }
  void Deallocate(void* ptr, size_t nbytes, Device device) override { CpuAllocator().Deallocate(ptr, nbytes, device); }
  bool refused() const { return refused_; }

 private:
  size_t bytes_;
  int left_;
  bool refused_ = false;
  DeviceBackend saved_;
};

// A first step that ran out of memory between Adam's two slots (its second
// Zeros) left the parameter with one slot and step 0, and StateDict saved
// that slot: the state was then refused by every optimizer ("unexpected
// `state.w.exp_avg`: `state.w.step` is 0"). At step 0 only the slots an
// optimizer holds from the start (Adagrad's sum) are saved, and the failed
// step leaves no slot behind; the state loads, and the next step matches
// that of an optimizer that never failed.
TEST(OptimizerState, AFirstStepOutOfMemoryBetweenTwoSlotsLeavesAStateThatLoads) {
  Tensor w = FromVector({1.0f, -2.0f, 3.0f, 0.5f, -1.5f, 2.5f, 4.0f}, {7});
  Tensor twin = w.Clone();
  Adam opt({{"w", w}}, {.lr = 0.1});
  w.set_grad(FromVector({0.5f, 1.0f, -1.0f, 2.0f, 0.25f, -0.5f, 1.5f}, {7}));
  {
    RefuseOneCpuAllocation refuse(w.nbytes(), 2);
    EXPECT_THROW(opt.Step(), std::bad_alloc);
    ASSERT_TRUE(refuse.refused());
  }
  EXPECT_EQ(opt.step_count(0), 0);
  const NamedTensors state = opt.StateDict();
  for (const auto& [k, t] : state) EXPECT_NE(k, "state.w.exp_avg");
  Adam loaded({{"w", twin}}, {.lr = 0.1});
  loaded.LoadStateDict(state);
  twin.set_grad(w.grad().Clone());
  opt.Step();
  loaded.Step();
  EXPECT_EQ(w.ToVector<float>(), twin.ToVector<float>());
  EXPECT_EQ(loaded.step_count(0), 1);
}

// A 16-bit parameter's gradient is copied into f32 scratch for the host
// update. When that copy ran out of memory, the step had already been
// counted and the state made: the next step ran as the second (Adam's bias
// corrections) after an update that never happened. The failed step now
// leaves the count and the parameter as they were; the next one is the
// first, as a fresh optimizer's.
TEST(Optimizer, AGradientCopyOutOfMemoryCountsNoStep) {
  constexpr int64_t n = 1237;  // an f32 scratch of 4,948 bytes, a size nothing else here asks for
  Tensor w = Full({n}, 0.75, {.dtype = DType::kBFloat16}), twin = w.Clone();
  Adam failing({{"w", w}}, {.lr = 0.1}), fresh({{"w", twin}}, {.lr = 0.1});
  w.set_grad(Full({n}, 0.5, {.dtype = DType::kBFloat16}));
  twin.set_grad(Full({n}, 0.5, {.dtype = DType::kBFloat16}));
  refuse_new_of_bytes = n * sizeof(float);
  EXPECT_THROW(failing.Step(), std::bad_alloc);
  const bool refused = refuse_new_of_bytes == 0;
  refuse_new_of_bytes = 0;
  ASSERT_TRUE(refused);
  EXPECT_EQ(failing.step_count(0), 0);
  EXPECT_EQ(w.ToVector<float>(), twin.ToVector<float>());
  failing.Step();
  fresh.Step();
  EXPECT_EQ(failing.step_count(0), 1);
  EXPECT_EQ(w.ToVector<float>(), twin.ToVector<float>());
}

// Before, a parameter with no entries in a loaded state was taken as one
// never updated: Adam's state saved over {w} loaded into one over {w, b}
// (both trained 1000 steps) restarted b at step 1. PyTorch refuses param
// groups of another size; so does this, naming the parameter, changing nothing.
TEST(OptimizerState, StateSavedOverOtherParametersIsRefusedNamingThem) {
  auto trained = [](const std::vector<std::string>& names) {
    NamedParameters params;
    for (const std::string& n : names) params.emplace_back(n, Ones({3}));
    auto opt = std::make_unique<Adam>(params, AdamOptions{.lr = 1e-3});
    for (int s = 0; s < 1000; ++s) {
      for (const auto& [n, p] : params) p.set_grad(Full({3}, 0.5));
      opt->Step();
    }
    return std::make_pair(params, std::move(opt));
  };
  auto [w_params, w_only] = trained({"w"});
  auto [wb_params, wb] = trained({"w", "b"});
  const NamedTensors before = wb->StateDict();

  // Saved over {w}, loaded into {w, b}: b is missing.
  std::string err = ErrorOf([&] { wb->LoadStateDict(w_only->StateDict()); });
  EXPECT_THAT(err, AllOf(HasSubstr("Adam.LoadStateDict: 1 problem(s)"),
                         HasSubstr("parameter `b` is not in the state (no `state.b.step`)")));
  EXPECT_EQ(ErrorOf([&] { wb->CheckStateDict(w_only->StateDict()); }), err);
  EXPECT_EQ(wb->step_count(1), 1000);
  const NamedTensors after = wb->StateDict();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(before[i].second.ToVector<double>(), after[i].second.ToVector<double>()) << before[i].first;
  }

  // Saved over {w, b}, loaded into {w}: b is extra.
  err = ErrorOf([&] { w_only->LoadStateDict(wb->StateDict()); });
  EXPECT_THAT(err, HasSubstr("unexpected `state.b.step` (parameter `b` is not in this optimizer)"));
  EXPECT_EQ(w_only->step_count(0), 1000);

  // Another name in the same place: both are named.
  NamedParameters renamed = {{"w", Ones({3})}, {"c", Ones({3})}};
  renamed[1].second.set_requires_grad(true);  // trainable: it must be in the state
  Adam other(renamed, {.lr = 1e-3});
  err = ErrorOf([&] { other.LoadStateDict(wb->StateDict()); });
  EXPECT_THAT(err, AllOf(HasSubstr("parameter `c` is not in the state"),
                         HasSubstr("unexpected `state.b.step` (parameter `b` is not in this optimizer)")));
  EXPECT_EQ(other.step_count(0), 0);

  // A frozen parameter (requires_grad off, no gradient) may be absent: an
  // optimizer of the trained parameters alone saved the state.
  NamedParameters with_frozen = {{"w", Ones({3})}, {"b", Ones({3})}};
  Adam plain(with_frozen, {.lr = 1e-3});
  ASSERT_NO_THROW(plain.LoadStateDict(w_only->StateDict()));
  EXPECT_EQ(plain.step_count(0), 1000);
  EXPECT_EQ(plain.step_count(1), 0);
  with_frozen[1].second.set_requires_grad(true);
  EXPECT_THAT(ErrorOf([&] { plain.LoadStateDict(w_only->StateDict()); }),
              HasSubstr("parameter `b` is not in the state"));

  // A parameter the saving optimizer held but never updated is listed with
  // step 0 and loads as never updated, replacing a trained state.
  NamedParameters fresh_params = {{"w", Ones({3})}, {"b", Ones({3})}};
  Adam fresh(fresh_params, {.lr = 1e-3});
  fresh_params[0].second.set_grad(Full({3}, 0.5));
  fresh.Step();
  ASSERT_NO_THROW(wb->LoadStateDict(fresh.StateDict()));
  EXPECT_EQ(wb->step_count(0), 1);
  EXPECT_EQ(wb->step_count(1), 0);
  // A step-0 parameter with slots is malformed.
  NamedTensors slots_at_zero = fresh.StateDict();
  slots_at_zero.emplace_back("state.b.exp_avg", Zeros({3}));
  EXPECT_THAT(ErrorOf([&] { wb->LoadStateDict(slots_at_zero); }),
              HasSubstr("unexpected `state.b.exp_avg`: `state.b.step` is 0 (never updated)"));

  // A state saved before parameters were listed (no flag, no step-0 entries)
  // loads as it did: b, absent, starts afresh.
  NamedTensors old = w_only->StateDict();
  std::erase_if(old, [](const auto& e) { return e.first == "group.params_listed"; });
  ASSERT_NO_THROW(wb->LoadStateDict(old));
  EXPECT_EQ(wb->step_count(0), 1000);
  EXPECT_EQ(wb->step_count(1), 0);
  // A malformed flag is named.
  NamedTensors bad_flag = w_only->StateDict();
  for (auto& [k, t] : bad_flag) {
    if (k == "group.params_listed") t = FromVectorOf<int64_t>({2}, {});
  }
  EXPECT_THAT(ErrorOf([&] { w_only->LoadStateDict(bad_flag); }),
              HasSubstr("`group.params_listed` is 2, expected an i64 scalar 1"));

  // A parameter without elements need not be listed (a sharded optimizer's
  // consolidated state has no entries for one).
  NamedParameters with_empty = {{"w", Ones({3})}, {"e", Zeros({0})}};
  Adam with_empty_opt(with_empty, {.lr = 1e-3});
  ASSERT_NO_THROW(with_empty_opt.LoadStateDict(w_only->StateDict()));
  EXPECT_EQ(with_empty_opt.step_count(0), 1000);
}

// CheckStateDict: LoadStateDict's checks alone, so that a caller restoring
// several components can check them all before loading any.
TEST(OptimizerState, CheckStateDictThrowsAsLoadStateDictAndChangesNothing) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd opt(p, {.lr = 0.1, .momentum = 0.9});
  TrainSteps(p, opt, 0, 1);
  NamedTensors bad = opt.StateDict();
  bad.erase(bad.begin());                                     // "lr"
  bad.emplace_back("state.fc.bias.momentum_buffer", Zeros({3}));  // repeated, wrong shape
  const std::string checked = ErrorOf([&] { opt.CheckStateDict(bad); });
  EXPECT_THAT(checked, AllOf(HasSubstr("SGD.LoadStateDict: "), HasSubstr("missing `lr`"),
                             HasSubstr("`state.fc.bias.momentum_buffer` is f32 [3], expected f32 [8]")));
  EXPECT_EQ(checked, ErrorOf([&] { opt.LoadStateDict(bad); }));
  // A good state from elsewhere (two steps, another lr) is only checked.
  NamedParameters q = MakeParams(DType::kFloat32, 2);
  Sgd other(q, {.lr = 0.5, .momentum = 0.9});
  TrainSteps(q, other, 0, 2);
  const NamedTensors before = opt.StateDict();
  EXPECT_EQ(ErrorOf([&] { opt.CheckStateDict(other.StateDict()); }), "");
  EXPECT_EQ(opt.lr(), 0.1);
  EXPECT_EQ(opt.step_count(0), 1);
  const NamedTensors after = opt.StateDict();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(before[i].second.ToVector<double>(), after[i].second.ToVector<double>()) << before[i].first;
  }
}

TEST(Optimizer, SkipsParametersWithoutGradient) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd opt(p, {.lr = 0.1, .momentum = 0.9});
  const auto bias_before = p[1].second.ToVector<float>();
  p[0].second.set_grad(Ones({8, 5}));
  opt.Step();
  EXPECT_EQ(p[1].second.ToVector<float>(), bias_before);
  EXPECT_EQ(opt.step_count(0), 1);
  EXPECT_EQ(opt.step_count(1), 0);
  opt.ZeroGrad(false);
  EXPECT_EQ(p[0].second.grad().ToVector<float>(), std::vector<float>(40, 0.0f));
  opt.ZeroGrad();
  EXPECT_FALSE(p[0].second.grad().defined());
}

// A gradient that itself requires grad (set_grad takes any tensor of the
// parameter's shape, dtype and device) is zeroed in place, as
// Module::ZeroGrad zeroes it; the optimizer's ZeroGrad(false) threw Fill's
// "wrap parameter initialization in NoGradGuard".
TEST(Optimizer, ZeroGradInPlaceZeroesAGradientThatRequiresGrad) {
  Tensor p = Zeros({2});
  Tensor g = FromVector({1, 2}, {2});
  g.set_requires_grad(true);
  p.set_grad(g);
  Sgd opt({{"p", p}}, {.lr = 0.1});
  opt.ZeroGrad(false);
  EXPECT_TRUE(p.grad().is_same(g));
  EXPECT_EQ(g.ToVector<float>(), (std::vector<float>{0, 0}));
  // As PyTorch's zero_grad (requires_grad_(False) on a leaf gradient).
  EXPECT_FALSE(p.grad().requires_grad());
}

// A gradient produced by a recorded operation is detached before it is
// zeroed (PyTorch's grad.detach_()): the zeros have no grad_fn and do not
// require grad, and they live in the same storage as before.
TEST(Optimizer, ZeroGradInPlaceDetachesARecordedGradient) {
  Tensor p = Zeros({2});
  Tensor x = FromVector({1, 2}, {2});
  x.set_requires_grad(true);
  Tensor g = ops::MulScalar(x, 3.0);
  ASSERT_NE(g.grad_fn(), nullptr);
  p.set_grad(g);
  Sgd opt({{"p", p}}, {.lr = 0.1});
  opt.ZeroGrad(false);
  EXPECT_EQ(p.grad().grad_fn(), nullptr);
  EXPECT_FALSE(p.grad().requires_grad());
  EXPECT_EQ(p.grad().ToVector<float>(), (std::vector<float>{0, 0}));
  EXPECT_EQ(g.ToVector<float>(), (std::vector<float>{0, 0}));
  EXPECT_EQ(x.ToVector<float>(), (std::vector<float>{1, 2}));
}

// An index past the parameters is refused naming it and the count;
// step_count read past the end of its vector.
TEST(Optimizer, ParameterIndexPastTheEndIsRefused) {
  Sgd opt({{"a", Zeros({2})}, {"b", Zeros({1})}}, {.lr = 0.1});
  EXPECT_EQ(opt.step_count(1), 0);
  EXPECT_EQ(opt.group_of(1), 0u);
  try {
    opt.step_count(2);
    ADD_FAILURE() << "step_count(2) of 2 parameters was accepted";
  } catch (const std::out_of_range& e) {
    EXPECT_STREQ(e.what(), "SGD: step_count of parameter 2, but it holds 2");
  }
  try {
    opt.group_of(7);
    ADD_FAILURE() << "group_of(7) of 2 parameters was accepted";
  } catch (const std::out_of_range& e) {
    EXPECT_STREQ(e.what(), "SGD: group_of of parameter 7, but it holds 2");
  }
}

// Every gradient is checked before any parameter is updated. Before, the
// check ran inside the update loop: `fc.weight` was updated and its step
// counted before `fc.bias`'s gradient was refused.
TEST(Optimizer, BadGradientOfALaterParameterChangesNothing) {
  for (const auto& [name, make] : AllOptimizers()) {
    SCOPED_TRACE(name);
    NamedParameters p = MakeParams(DType::kFloat32, 1);
    std::unique_ptr<Optimizer> opt = make(p);
    SetGrads(p, 0);
    p[1].second.grad().SetData(Zeros({3}));  // set_grad checks shapes; this reshapes the gradient after
    const auto before = Bytes(p);
    // The steps (0), and Adagrad's sums, held from the start.
    const size_t entries = EntriesUnder(opt->StateDict(), "state.");
    EXPECT_THAT(ErrorOf([&] { opt->Step(); }), HasSubstr("gradient of `fc.bias` has shape [3], the parameter [8]"));
    EXPECT_EQ(Bytes(p), before);
    EXPECT_EQ(opt->step_count(0), 0);
    EXPECT_EQ(EntriesUnder(opt->StateDict(), "state."), entries);  // no state made
  }
}

// A gradient of an integer dtype (SetData can give one) is refused with the
// other checks, naming its parameter. Before, the host path threw from its
// conversion only after the parameters before it had been updated, with a
// message naming none; the device path converted it silently.
TEST(Optimizer, IntegerGradientIsRefusedNamingItsParameterBeforeAnyUpdate) {
  for (const auto& [name, make] : AllOptimizers()) {
    SCOPED_TRACE(name);
    NamedParameters p = MakeParams(DType::kFloat32, 1);
    std::unique_ptr<Optimizer> opt = make(p);
    SetGrads(p, 0);
    p[1].second.grad().SetData(Zeros({8}, {.dtype = DType::kInt64}));
    const auto before = Bytes(p);
    const size_t entries = EntriesUnder(opt->StateDict(), "state.");
    EXPECT_THAT(ErrorOf([&] { opt->Step(); }),
                HasSubstr("gradient of `fc.bias` has dtype i64, expected a floating type"));
    EXPECT_EQ(Bytes(p), before);
    EXPECT_EQ(opt->step_count(0), 0);
    EXPECT_EQ(EntriesUnder(opt->StateDict(), "state."), entries);  // no state made
  }
}

// SetData may give a parameter another shape after its state was made: the
// step refuses it, naming the parameter and both shapes, and changes
// nothing. Before, only the gradient was checked against the parameter, and
// the update ran over the parameter's elements through the old state (past
// its end when the parameter grew).
TEST(Optimizer, StateOfAnotherShapeIsRefused) {
  for (const auto& [name, make] : AllOptimizers()) {
    SCOPED_TRACE(name);
    for (int64_t n : {1, 1000}) {
      SCOPED_TRACE(n);
      Tensor w = Zeros({2});
      std::unique_ptr<Optimizer> opt = make({{"w", w}});
      w.set_grad(Ones({2}));
      opt->Step();
      w.SetData(Zeros({n}));
      w.set_grad(Ones({n}));
      EXPECT_THAT(ErrorOf([&] { opt->Step(); }),
                  AllOf(HasSubstr("of parameter `w` has shape [2], the parameter now [" + std::to_string(n) + "]"),
                        HasSubstr(": state `")));
      EXPECT_EQ(w.ToVector<float>(), std::vector<float>(n, 0.0f));
      EXPECT_EQ(opt->step_count(0), 1);
    }
  }
  // A 16-bit parameter's f32 master, here its only state (SGD without momentum).
  Tensor h = Zeros({2}, {.dtype = DType::kBFloat16});
  Sgd sgd({{"h", h}}, {.lr = 0.1});
  h.set_grad(Ones({2}, {.dtype = DType::kBFloat16}));
  sgd.Step();
  h.SetData(Zeros({3}, {.dtype = DType::kBFloat16}));
  h.set_grad(Ones({3}, {.dtype = DType::kBFloat16}));
  EXPECT_EQ(ErrorOf([&] { sgd.Step(); }),
            "SGD: state `master` of parameter `h` has shape [2], the parameter now [3] (its data was replaced "
            "with another shape)");
}

// A parameter made strided by SetData (a view of a wider buffer) is refused
// at the step, with state or without. Before, only the constructor checked,
// and the step updated the buffer's first elements in a row instead of the
// view's.
TEST(Optimizer, ParameterMadeNonContiguousIsRefused) {
  for (const auto& [name, make] : AllOptimizers()) {
    SCOPED_TRACE(name);
    for (bool stepped_before : {false, true}) {
      SCOPED_TRACE(stepped_before);
      Tensor w = Zeros({2, 2});
      std::unique_ptr<Optimizer> opt = make({{"w", w}});
      if (stepped_before) {
        w.set_grad(Ones({2, 2}));
        opt->Step();
      }
      const Tensor wide = Zeros({2, 4});
      w.SetData(wide.Narrow(1, 0, 2));
      w.set_grad(Ones({2, 2}));
      EXPECT_THAT(ErrorOf([&] { opt->Step(); }),
                  HasSubstr(": parameter `w` of shape [2, 2] is not contiguous (its data was replaced since the "
                            "optimizer took it)"));
      EXPECT_EQ(wide.ToVector<float>(), std::vector<float>(8, 0.0f));
    }
  }
}

// A negative, NaN or infinite "lr" is refused with the other problems, as
// set_lr refuses a negative one. Before, LoadStateDict took it.
TEST(OptimizerState, LearningRateMustBeFiniteAndNonNegative) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd opt(p, {.lr = 0.1, .momentum = 0.9});
  TrainSteps(p, opt, 0, 1);
  for (double lr : {-0.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(lr);
    NamedTensors state = opt.StateDict();
    ASSERT_EQ(state[0].first, "lr");
    state[0].second = FromVector({lr}, {}, {.dtype = DType::kFloat64});
    const std::string err = ErrorOf([&] { opt.LoadStateDict(state); });
    EXPECT_THAT(err, AllOf(HasSubstr("SGD.LoadStateDict: 1 problem(s): `lr` is "),
                           HasSubstr(", expected finite and >= 0")));
    EXPECT_EQ(err, ErrorOf([&] { opt.CheckStateDict(state); }));
    EXPECT_EQ(opt.lr(), 0.1);
  }
  NamedTensors zero = opt.StateDict();
  zero[0].second = FromVector({0.0}, {}, {.dtype = DType::kFloat64});
  opt.LoadStateDict(zero);
  EXPECT_EQ(opt.lr(), 0.0);
}

// bf16 parameters: updates of 1e-4 on values near 1 are below bf16's
// resolution (2^-7) but accumulate in the f32 master copy.
TEST(Optimizer, MasterCopyKeepsSmallUpdatesOfBf16Parameters) {
  Tensor w = Ones({4}, {.dtype = DType::kBFloat16});
  Sgd opt({{"w", w}}, {.lr = 1e-4});
  for (int s = 0; s < 200; ++s) {
    w.set_grad(Full({4}, -1.0, {.dtype = DType::kBFloat16}));
    opt.Step();
  }
  // 1 + 200 * 1e-4 = 1.02, to bf16: 1.0234375 (nearest of 1.015625, 1.0234375).
  for (float v : w.ToVector<float>()) EXPECT_EQ(v, 1.0234375f);
}

// A write to a 16-bit parameter from outside the optimizer (here CopyFrom,
// as Module::LoadStateDict does it) is what the next step starts from; the
// f32 master used to write its old values back over it.
TEST(Optimizer, OutsideWriteToA16BitParameterIsWhatTheNextStepUpdates) {
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(std::string(DTypeName(t)));
    Tensor w = Ones({4}, {.dtype = t});
    Sgd opt({{"w", w}}, {.lr = 0.1});
    w.set_grad(Full({4}, -1.0, {.dtype = t}));
    opt.Step();  // master 1.1
    {
      NoGradGuard guard;
      w.CopyFrom(Full({4}, 5.0, {.dtype = t}));
    }
    w.set_grad(Full({4}, -1.0, {.dtype = t}));
    opt.Step();  // from 5: 5.1 rounded (1.2 rounded before)
    const float expected = t == DType::kBFloat16 ? 5.09375f : 5.1015625f;
    for (float v : w.ToVector<float>()) EXPECT_EQ(v, expected);
    // The saved master holds the loaded value too.
    for (const auto& [k, st] : opt.StateDict()) {
      if (k == "state.w.master") {
        EXPECT_EQ(st.ToVector<float>(), std::vector<float>(4, 5.1f));
      }
    }
  }
  // Part of a parameter written: only those elements restart from the
  // written value, the others keep the updates below bf16's resolution.
  Tensor w = Ones({4}, {.dtype = DType::kBFloat16});
  Sgd opt({{"w", w}}, {.lr = 1e-4});
  for (int s = 0; s < 200; ++s) {
    if (s == 100) w.Narrow(0, 2, 1).Fill(3.0);
    w.set_grad(Full({4}, -1.0, {.dtype = DType::kBFloat16}));
    opt.Step();
  }
  // 1.02 and 3.01 to bf16.
  EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{1.0234375f, 1.0234375f, 3.015625f, 1.0234375f}));
}

// An outside write that lands where the master would round through the
// other 16-bit type (an average of 1.0 over an f16 master of 1 + 3 * 2^-10,
// which bf16 rounds to 1.0) is a write: it used to count as "agreeing", the
// master kept 1.0029296875, and the next step wrote that back, so a replica
// averaged to 1.0 drifted from the others. A parameter converted between
// the two types in place still keeps its master's precision.
TEST(Optimizer, AnOutsideWriteNearTheOtherTypesRoundingIsStillTaken) {
  Tensor w = Full({2}, 1.0029296875, {.dtype = DType::kFloat16});
  Sgd opt({{"w", w}}, {.lr = 0.1});
  w.set_grad(Zeros({2}, {.dtype = DType::kFloat16}));
  opt.Step();  // master 1.0029296875
  {
    NoGradGuard guard;
    w.CopyFrom(Ones({2}, {.dtype = DType::kFloat16}));  // as AverageParameters writes
  }
  w.set_grad(Zeros({2}, {.dtype = DType::kFloat16}));
  opt.Step();
  EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{1.0f, 1.0f}));
  for (const auto& [k, st] : opt.StateDict()) {
    if (k == "state.w.master") {
      EXPECT_EQ(st.ToVector<float>(), (std::vector<float>{1.0f, 1.0f}));
    }
  }
}

// The trainer's resume order: the optimizer's state first, then the model's
// values written into the parameters. The loaded master keeps its precision
// where the parameters hold its rounding, so the run continues exactly.
TEST(Optimizer, MasterLoadedBeforeTheParametersKeepsItsPrecision) {
  for (const auto& [name, make] : AllOptimizers()) {
    SCOPED_TRACE(name);
    NamedParameters a = MakeParams(DType::kBFloat16, 1);
    auto opt_a = make(a);
    for (int s = 0; s < 5; ++s) {
      SetGrads(a, s);
      opt_a->Step();
    }
    const NamedTensors state = opt_a->StateDict();
    NamedParameters b = MakeParams(DType::kBFloat16, 2);
    auto opt_b = make(b);
    opt_b->LoadStateDict(state);
    for (size_t i = 0; i < b.size(); ++i) b[i].second.CopyFrom(a[i].second);
    for (int s = 5; s < 10; ++s) {
      SetGrads(a, s);
      opt_a->Step();
      SetGrads(b, s);
      opt_b->Step();
    }
    EXPECT_EQ(Bytes(a), Bytes(b));
  }
}

// Parameters that are views of one buffer (as ZeRO's pieces are): one's
// update is not taken for an outside write to the others.
TEST(Optimizer, MastersOfViewsOfOneBufferKeepSmallUpdates) {
  const Tensor flat = Ones({8}, {.dtype = DType::kBFloat16});
  Sgd opt({{"a", flat.Narrow(0, 0, 4)}, {"b", flat.Narrow(0, 4, 4)}}, {.lr = 1e-4});
  for (int s = 0; s < 200; ++s) {
    for (const auto& [n, p] : opt.params()) p.set_grad(Full({4}, -1.0, {.dtype = DType::kBFloat16}));
    opt.Step();
  }
  for (float v : flat.ToVector<float>()) EXPECT_EQ(v, 1.0234375f);
}

// Module::To converts a parameter in place (the same tensor object) between
// steps. bf16 -> f32: the master is dropped and the parameter itself is
// updated from its converted value, the momentum carried over; before, the
// master kept absorbing the updates and the f32 parameter never changed.
TEST(Optimizer, Bf16ParameterConvertedToF32KeepsTraining) {
  Tensor w = Ones({4}, {.dtype = DType::kBFloat16});
  Sgd opt({{"w", w}}, {.lr = 0.1, .momentum = 0.9});
  w.set_grad(Full({4}, -1.0, {.dtype = DType::kBFloat16}));
  opt.Step();  // momentum 1, master 1.1, w = bf16(1.1) = 1.1015625
  w.SetData(w.Detach().To(DType::kFloat32));
  w.set_grad(Full({4}, -1.0));
  opt.Step();  // momentum 0.9 * 1 + 1 = 1.9, w = 1.1015625 + 0.19
  EXPECT_EQ(w.dtype(), DType::kFloat32);
  for (float v : w.ToVector<float>()) EXPECT_FLOAT_EQ(v, 1.1015625f + 0.19f);
  // The state no longer holds a master, and loads into an f32 parameter.
  for (const auto& [k, t] : opt.StateDict()) EXPECT_EQ(k.find("master"), std::string::npos) << k;
  Tensor w2 = w.Detach().Clone();
  Sgd opt2({{"w", w2}}, {.lr = 0.1, .momentum = 0.9});
  opt2.LoadStateDict(opt.StateDict());
  w.set_grad(Full({4}, -1.0));
  opt.Step();
  w2.set_grad(Full({4}, -1.0));
  opt2.Step();
  EXPECT_EQ(w.ToVector<float>(), w2.ToVector<float>());
}

// Every optimizer keeps training through any change of a parameter's dtype
// between steps (no stall, no dtype error), and its state dict afterwards
// loads into an optimizer over a parameter of the new dtype.
TEST(Optimizer, ParameterDtypeChangesBetweenStepsKeepTraining) {
  const std::pair<DType, DType> changes[] = {{DType::kBFloat16, DType::kFloat32}, {DType::kFloat16, DType::kFloat64},
                                             {DType::kFloat32, DType::kBFloat16}, {DType::kFloat32, DType::kFloat64},
                                             {DType::kFloat64, DType::kFloat32}, {DType::kFloat16, DType::kBFloat16}};
  for (const auto& [from, to] : changes) {
    for (const auto& [name, make] : AllOptimizers()) {
      SCOPED_TRACE(name + " " + std::string(DTypeName(from)) + " -> " + std::string(DTypeName(to)));
      NamedParameters p = MakeParams(from, 1);
      auto opt = make(p);
      for (int s = 0; s < 3; ++s) {
        SetGrads(p, s);
        opt->Step();
      }
      for (const auto& [n, t] : p) t.SetData(t.Detach().To(to));
      // Saved between the change and the next step: already in the new form.
      const NamedTensors saved = opt->StateDict();
      NamedParameters q = MakeParams(to, 1);
      for (size_t i = 0; i < p.size(); ++i) q[i].second.CopyFrom(p[i].second);
      auto restored = make(q);
      ASSERT_NO_THROW(restored->LoadStateDict(saved));
      for (int s = 3; s < 6; ++s) {
        const std::vector<std::vector<uint8_t>> before = Bytes(p);
        SetGrads(p, s);
        ASSERT_NO_THROW(opt->Step());
        EXPECT_NE(Bytes(p), before) << "step " << s;
        SetGrads(q, s);
        restored->Step();
      }
      EXPECT_EQ(Bytes(p), Bytes(q));
      for (const auto& [n, t] : p) EXPECT_EQ(t.dtype(), to);
    }
  }
}

// A state saved before a parameter's dtype changed loads after the change,
// as PyTorch's load_state_dict casts floating state to the parameter's
// dtype: the slots take the new compute dtype, a master saved for a
// parameter that is no longer 16-bit is dropped, and a parameter that
// became 16-bit gets a master from its values at the next step. The run
// continues as the optimizer that saw the change itself. Before, f64 slots
// did not load into an f32 optimizer, nor a state without a master into a
// bf16 one.
TEST(OptimizerState, StateSavedBeforeADtypeChangeLoadsAfterIt) {
  const std::pair<DType, DType> changes[] = {{DType::kFloat64, DType::kFloat32}, {DType::kFloat32, DType::kBFloat16},
                                             {DType::kFloat32, DType::kFloat16}, {DType::kBFloat16, DType::kFloat32},
                                             {DType::kFloat16, DType::kFloat64}, {DType::kFloat32, DType::kFloat64}};
  for (const auto& [from, to] : changes) {
    for (const auto& [name, make] : AllOptimizers()) {
      SCOPED_TRACE(name + " " + std::string(DTypeName(from)) + " -> " + std::string(DTypeName(to)));
      NamedParameters p = MakeParams(from, 1);
      auto opt = make(p);
      TrainSteps(p, *opt, 0, 3);
      const NamedTensors saved = opt->StateDict();
      for (const auto& [n, t] : p) t.SetData(t.Detach().To(to));
      NamedParameters q = MakeParams(to, 2);
      for (size_t i = 0; i < p.size(); ++i) q[i].second.CopyFrom(p[i].second);
      auto restored = make(q);
      ASSERT_NO_THROW(restored->LoadStateDict(saved));
      for (int s = 3; s < 6; ++s) {
        SetGrads(p, s);
        opt->Step();
        SetGrads(q, s);
        restored->Step();
      }
      EXPECT_EQ(Bytes(p), Bytes(q));
    }
  }
  // Only floating state converts.
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Adam opt(p, {});
  SetGrads(p, 0);
  opt.Step();
  NamedTensors state = opt.StateDict();
  for (auto& [k, t] : state) {
    if (k == "state.fc.bias.exp_avg") t = Zeros({8}, {.dtype = DType::kInt64});
  }
  try {
    opt.LoadStateDict(state);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("`state.fc.bias.exp_avg` is i64 [8], expected f32 [8]"));
  }
}

// As PyTorch's SGD, which keeps no momentum buffer (None) when momentum is
// 0 and starts one as buf = d at the first update that uses it. Before, a
// zero buffer was kept and saved, and a state from Sgd{momentum = 0} loaded
// into Sgd{momentum = 0.9, dampening = 0.1} made the next update
// buf = 0.9 * 0 + 0.9 * d instead of buf = d.
// RMSprop and Adagrad against their PyTorch rules: four steps of fixed
// gradients on three f64 elements. The expected values were computed by a
// Python transcription of torch.optim's single-tensor RMSprop and Adagrad
// (Python floats are f64; each operation in PyTorch's order, RMSprop's
// centered average as ATen's lerp), so f64 results agree to the last bits;
// f32 ones to 1e-5. torch itself is not installed here.
const std::vector<double> kGoldenP0 = {0.5, -1.25, 2.0};
const std::vector<std::vector<double>> kGoldenGrads = {
    {0.3, -0.7, 1.1}, {-0.2, 0.4, 0.9}, {0.6, -1.3, -0.5}, {0.05, 0.8, -0.25}};

// Steps `opt` (over `w`, made from kGoldenP0 in `dtype`) through kGoldenGrads.
void StepGolden(Optimizer& opt, const Tensor& w) {
  for (const std::vector<double>& g : kGoldenGrads) {
    w.set_grad(FromVector(g, {3}, {.dtype = w.dtype()}));
    opt.Step();
  }
}

// The state entry `key` of `state` as doubles.
std::vector<double> StateEntry(const NamedTensors& state, const std::string& key) {
  for (const auto& [k, t] : state) {
    if (k == key) return t.ToVector<double>();
  }
  ADD_FAILURE() << "no `" << key << "` in the state";
  return {};
}

void ExpectGolden(const std::vector<double>& got, const std::vector<double>& want, DType dtype) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    if (dtype == DType::kFloat64) {
      EXPECT_DOUBLE_EQ(got[i], want[i]) << "element " << i;
    } else {
      EXPECT_NEAR(got[i], want[i], 1e-5 * std::max(1.0, std::abs(want[i]))) << "element " << i;
    }
  }
}

TEST(Rmsprop, MatchesPyTorchsRule) {
  struct Case {
    std::string name;
    RmspropOptions options;
    std::vector<double> p, square_avg, momentum_buffer, grad_avg;
  };
  const std::vector<Case> cases = {
      {"defaults (lr 0.01, alpha 0.99, eps 1e-8)",
       RmspropOptions{},
       {0.362580107472005, -1.1612258966620466, 1.8864737620181184},
       {0.004854309100000004, 0.029453625100000026, 0.022779427900000024},
       {},
       {}},
      {"weight decay, momentum, centered",
       RmspropOptions{.lr = 0.02, .weight_decay = 0.1, .momentum = 0.9, .centered = true},
       {-0.29030510705164636, -0.49977504847849463, 1.0510348235187887},
       {0.005305445117683989, 0.03206721472716978, 0.02920455868453345},
       {12.08180715696312, -8.167602335416273, 9.97692356743212},
       {0.008324115746848479, -0.011572320224251854, 0.01847229199549537}},
      {"centered with alpha 0.3 (lerp's large-weight form), maximize",
       RmspropOptions{.alpha = 0.3, .centered = true, .maximize = true},
       {0.532232033612504, -1.272033404711181, 2.0389477799544853},
       {0.081571, 0.8222409999999999, 0.170149},
       {},
       {-0.15407, -0.29896999999999996, 0.20250999999999997}},
  };
  for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name + (dtype == DType::kFloat64 ? " f64" : " f32"));
      Tensor w = FromVector(kGoldenP0, {3}, {.dtype = dtype});
      Rmsprop opt({{"w", w}}, c.options);
      StepGolden(opt, w);
      ExpectGolden(w.ToVector<double>(), c.p, dtype);
      const NamedTensors state = opt.StateDict();
      ExpectGolden(StateEntry(state, "state.w.square_avg"), c.square_avg, dtype);
      EXPECT_EQ(EntriesUnder(state, "state.w.momentum_buffer"), c.momentum_buffer.empty() ? 0u : 1u);
      EXPECT_EQ(EntriesUnder(state, "state.w.grad_avg"), c.grad_avg.empty() ? 0u : 1u);
      if (!c.momentum_buffer.empty()) {
        ExpectGolden(StateEntry(state, "state.w.momentum_buffer"), c.momentum_buffer, dtype);
      }
      if (!c.grad_avg.empty()) ExpectGolden(StateEntry(state, "state.w.grad_avg"), c.grad_avg, dtype);
    }
  }
}

TEST(Adagrad, MatchesPyTorchsRule) {
  struct Case {
    std::string name;
    AdagradOptions options;
    std::vector<double> p, sum;
  };
  const std::vector<Case> cases = {
      {"defaults (lr 0.01, eps 1e-10)",
       AdagradOptions{},
       {0.4862631028940655, -1.2410972990995885, 1.9886231651676336},
       {0.4925, 2.98, 2.3325000000000005}},
      {"lr decay, weight decay, initial accumulator, maximize",
       AdagradOptions{.lr = 0.1, .lr_decay = 0.5, .weight_decay = 0.1, .initial_accumulator_value = 0.2,
                      .maximize = true},
       {0.5534154823761153, -1.30783086754861, 2.089708790776978},
       {0.6278948711236935, 3.0562767027558673, 2.207323684715868}},
  };
  for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name + (dtype == DType::kFloat64 ? " f64" : " f32"));
      Tensor w = FromVector(kGoldenP0, {3}, {.dtype = dtype});
      Adagrad opt({{"w", w}}, c.options);
      StepGolden(opt, w);
      ExpectGolden(w.ToVector<double>(), c.p, dtype);
      ExpectGolden(StateEntry(opt.StateDict(), "state.w.sum"), c.sum, dtype);
    }
  }
}

// PyTorch's defaults, and each bad option refused naming it and its value.
TEST(RmspropAndAdagrad, DefaultsAndRefusedOptions) {
  const RmspropOptions r;
  EXPECT_EQ(r.lr, 0.01);
  EXPECT_EQ(r.alpha, 0.99);
  EXPECT_EQ(r.eps, 1e-8);
  EXPECT_EQ(r.weight_decay, 0.0);
  EXPECT_EQ(r.momentum, 0.0);
  EXPECT_FALSE(r.centered);
  const AdagradOptions a;
  EXPECT_EQ(a.lr, 0.01);
  EXPECT_EQ(a.lr_decay, 0.0);
  EXPECT_EQ(a.weight_decay, 0.0);
  EXPECT_EQ(a.initial_accumulator_value, 0.0);
  EXPECT_EQ(a.eps, 1e-10);

  const auto params = [] { return NamedParameters{{"w", Zeros({2})}}; };
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(ErrorOf([&] { Rmsprop(params(), {.lr = -1}); }), "RMSprop: learning rate -1 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Rmsprop(params(), {.alpha = -0.1}); }), "RMSprop: alpha -0.1 must be in [0, 1]");
  EXPECT_EQ(ErrorOf([&] { Rmsprop(params(), {.alpha = 1.5}); }), "RMSprop: alpha 1.5 must be in [0, 1]");
  EXPECT_EQ(ErrorOf([&] { Rmsprop(params(), {.eps = -1e-8}); }), "RMSprop: eps -1e-08 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Rmsprop(params(), {.weight_decay = inf}); }),
            "RMSprop: weight_decay inf must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Rmsprop(params(), {.momentum = std::nan("")}); }),
            "RMSprop: momentum nan must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Adagrad(params(), {.lr = inf}); }), "Adagrad: learning rate inf must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Adagrad(params(), {.lr_decay = -0.5}); }), "Adagrad: lr_decay -0.5 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Adagrad(params(), {.weight_decay = -1}); }),
            "Adagrad: weight_decay -1 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Adagrad(params(), {.initial_accumulator_value = -0.1}); }),
            "Adagrad: initial_accumulator_value -0.1 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Adagrad(params(), {.eps = std::nan("")}); }), "Adagrad: eps nan must be finite and >= 0");
  // In a group, and in a loaded state: named the same way.
  EXPECT_EQ(ErrorOf([&] { Rmsprop({ParamGroup{.params = params(), .options = {{"alpha", 2}}}}, {}); }),
            "RMSprop: param group 0: alpha 2 must be in [0, 1]");
  EXPECT_EQ(ErrorOf([&] { Rmsprop({ParamGroup{.params = params(), .options = {{"centered", 1}}}}, {}); }),
            "RMSprop: param group 0: option `centered` differs from the default's (1 against 0): it decides which "
            "state is kept, and per-group state layouts are not supported; give every group the same");
  Adagrad saver(params(), {});
  NamedTensors state = saver.StateDict();
  for (auto& [k, t] : state) {
    if (k == "group.lr_decay") t = FromVector({-2.0}, {}, {.dtype = DType::kFloat64});
  }
  Adagrad loader(params(), {});
  EXPECT_THAT(ErrorOf([&] { loader.LoadStateDict(state); }),
              HasSubstr("the state's options are refused: lr_decay -2 must be finite and >= 0"));
}

// The momentum buffer and the centered average are kept as the options
// say; a state of the other layout is refused naming the option.
TEST(Rmsprop, SlotsFollowMomentumAndCenteredAndOtherLayoutsAreRefused) {
  const auto params = [] { return NamedParameters{{"w", Zeros({2})}}; };
  Tensor w = Zeros({2});
  Rmsprop plain({{"w", w}}, {});
  w.set_grad(FromVector({1.0, -1.0}, {2}));
  plain.Step();
  const NamedTensors state = plain.StateDict();
  EXPECT_EQ(EntriesUnder(state, "state.w.square_avg"), 1u);
  EXPECT_EQ(EntriesUnder(state, "state.w.momentum_buffer"), 0u);
  EXPECT_EQ(EntriesUnder(state, "state.w.grad_avg"), 0u);
  Rmsprop centered(params(), {.centered = true});
  EXPECT_THAT(ErrorOf([&] { centered.LoadStateDict(state); }),
              HasSubstr("centered is false in the state and true in this optimizer"));
  Rmsprop with_momentum(params(), {.momentum = 0.5});
  EXPECT_THAT(ErrorOf([&] { with_momentum.LoadStateDict(state); }),
              HasSubstr("momentum is 0 in the state and 0.5 in this optimizer"));
  // A schedule may drive RMSprop's momentum (OneCycleLR's cycle_momentum).
  EXPECT_EQ(with_momentum.momentum(0), 0.5);
  with_momentum.set_momentum(0, 0.8);
  EXPECT_EQ(with_momentum.options().momentum, 0.8);
  EXPECT_THROW(plain.set_momentum(0, 0.5), std::invalid_argument);
}

// Adagrad's sum starts at initial_accumulator_value on the parameter's
// first update, also one that first steps after a state saved before its
// first update was loaded, and also in a param group with its own value.
TEST(Adagrad, AccumulatorStartsAtTheGroupsInitialValue) {
  Tensor a = Zeros({1});
  Tensor b = Zeros({1});
  Adagrad opt({ParamGroup{.params = {{"a", a}}}, ParamGroup{.params = {{"b", b}}, .options = {{"initial_accumulator_value", 3.0}}}},
              AdagradOptions{.lr = 1.0, .initial_accumulator_value = 1.0});
  Adagrad fresh({ParamGroup{.params = {{"a", Zeros({1})}}}, ParamGroup{.params = {{"b", Zeros({1})}}, .options = {{"initial_accumulator_value", 3.0}}}},
                AdagradOptions{.lr = 1.0, .initial_accumulator_value = 1.0});
  fresh.LoadStateDict(opt.StateDict());  // both never updated
  for (Adagrad* o : {&opt, &fresh}) {
    const NamedParameters& ps = o->params();
    ps[0].second.set_grad(FromVector({2.0}, {1}));
    ps[1].second.set_grad(FromVector({1.0}, {1}));
    o->Step();
    const NamedTensors state = o->StateDict();
    EXPECT_EQ(StateEntry(state, "state.a.sum"), std::vector<double>{5.0});  // 1 + 2 * 2
    EXPECT_EQ(StateEntry(state, "state.b.sum"), std::vector<double>{4.0});  // 3 + 1 * 1
    EXPECT_FLOAT_EQ(ps[0].second.Item(), -2.0f / (std::sqrt(5.0f) + 1e-10f));
    EXPECT_FLOAT_EQ(ps[1].second.Item(), -1.0f / 2.0f);
  }
}

// The only later change of a group's initial_accumulator_value is a
// LoadStateDict; one before the first update takes the saved value, and the
// first update starts from it, as PyTorch's loader ends with the saver's
// sum (made at the saver's construction). Filling the sum from the
// loader's own constructor value would lose the saver's.
TEST(Adagrad, AStateLoadedBeforeTheFirstUpdateStartsTheSumAtTheSaversValue) {
  Adagrad saver({{"w", Zeros({1})}}, AdagradOptions{.lr = 1.0, .initial_accumulator_value = 0.5});
  Tensor w = Zeros({1});
  Adagrad loader({{"w", w}}, AdagradOptions{.lr = 1.0, .initial_accumulator_value = 0.1});
  loader.LoadStateDict(saver.StateDict());
  EXPECT_EQ(loader.options().initial_accumulator_value, 0.5);
  w.set_grad(FromVector({2.0}, {1}));
  loader.Step();
  EXPECT_EQ(StateEntry(loader.StateDict(), "state.w.sum"), std::vector<double>{4.5});  // 0.5 + 2 * 2
}

// As PyTorch's, Adagrad's sum exists before the first step: saved with
// step 0 (also for a parameter AddParamGroup added, at its group's value),
// loaded back as saved, and checked as any slot; a state saved without it
// (an older file) still loads, the sum then starting at the loaded value.
TEST(Adagrad, TheSumIsInTheStateBeforeTheFirstStep) {
  Tensor a = Zeros({2});
  Adagrad saver({{"a", a}}, AdagradOptions{.lr = 1.0, .initial_accumulator_value = 0.5});
  saver.AddParamGroup({.params = {{"b", Zeros({1})}}, .options = {{"initial_accumulator_value", 2.0}}});
  NamedTensors state = saver.StateDict();
  EXPECT_EQ(StateEntry(state, "state.a.sum"), (std::vector<double>{0.5, 0.5}));
  EXPECT_EQ(StateEntry(state, "state.b.sum"), std::vector<double>{2.0});
  for (auto& [k, t] : state) {
    if (k == "state.a.sum") t = FromVector({1.5, 3.0}, {2});
  }
  Tensor w = Zeros({2});
  Adagrad loader({{"a", w}}, AdagradOptions{.lr = 1.0});
  loader.AddParamGroup({.params = {{"b", Zeros({1})}}});
  loader.LoadStateDict(state);
  EXPECT_EQ(StateEntry(loader.StateDict(), "state.a.sum"), (std::vector<double>{1.5, 3.0}));
  w.set_grad(FromVector({1.0, 1.0}, {2}));
  loader.Step();
  EXPECT_EQ(StateEntry(loader.StateDict(), "state.a.sum"), (std::vector<double>{2.5, 4.0}));
  EXPECT_EQ(StateEntry(loader.StateDict(), "state.b.sum"), std::vector<double>{2.0});

  NamedTensors wrong_shape = saver.StateDict();
  for (auto& [k, t] : wrong_shape) {
    if (k == "state.a.sum") t = Zeros({3});
  }
  Adagrad refuser({{"a", Zeros({2})}}, AdagradOptions{});
  refuser.AddParamGroup({.params = {{"b", Zeros({1})}}});
  EXPECT_THAT(ErrorOf([&] { refuser.LoadStateDict(wrong_shape); }), HasSubstr("state.a.sum"));

  NamedTensors older;
  for (const auto& [k, t] : saver.StateDict()) {
    if (k != "state.a.sum" && k != "state.b.sum") older.emplace_back(k, t);
  }
  Tensor v = Zeros({2});
  Adagrad from_older({{"a", v}}, AdagradOptions{.lr = 1.0});
  from_older.AddParamGroup({.params = {{"b", Zeros({1})}}});
  from_older.LoadStateDict(older);
  EXPECT_EQ(StateEntry(from_older.StateDict(), "state.a.sum"), (std::vector<double>{0.5, 0.5}));
  v.set_grad(FromVector({2.0, 0.0}, {2}));
  from_older.Step();
  EXPECT_EQ(StateEntry(from_older.StateDict(), "state.a.sum"), (std::vector<double>{4.5, 0.5}));
}

// torch.maximum keeps a NaN of either side: a NaN already in
// max_exp_avg_sq stays there and makes the update NaN, as in PyTorch 1.13.
// Before, max(vmax, v) took v whenever vmax was NaN. 40 elements, so that
// the vectorized part of the loop and its tail both see one.
TEST(Adam, AmsgradKeepsANanAlreadyInMaxExpAvgSq) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<int64_t> nan_at = {0, 17, 39};
  for (bool decoupled : {false, true}) {
    for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
      SCOPED_TRACE(std::string(decoupled ? "AdamW " : "Adam ") + std::string(DTypeName(dtype)));
      Tensor w = Ones({40}, {.dtype = dtype});
      std::unique_ptr<Optimizer> opt;
      if (decoupled) {
        opt = std::make_unique<AdamW>(NamedParameters{{"w", w}}, AdamWOptions{.lr = 0.1, .amsgrad = true});
      } else {
        opt = std::make_unique<Adam>(NamedParameters{{"w", w}}, AdamOptions{.lr = 0.1, .amsgrad = true});
      }
      w.set_grad(Full({40}, 0.5, {.dtype = dtype}));
      opt->Step();
      NamedTensors state = opt->StateDict();
      for (auto& [key, t] : state) {
        if (key != "state.w.max_exp_avg_sq") continue;
        std::vector<double> v = t.ToVector<double>();
        for (int64_t i : nan_at) v[i] = nan;
        t = FromVector(v, {40}, {.dtype = dtype});
      }
      opt->LoadStateDict(state);
      w.set_grad(Full({40}, 0.5, {.dtype = dtype}));
      opt->Step();
      const std::vector<double> p = w.ToVector<double>();
      const std::vector<double> vmax = StateEntry(opt->StateDict(), "state.w.max_exp_avg_sq");
      ASSERT_EQ(vmax.size(), 40u);
      for (int64_t i = 0; i < 40; ++i) {
        const bool want_nan = std::find(nan_at.begin(), nan_at.end(), i) != nan_at.end();
        EXPECT_EQ(std::isnan(vmax[i]), want_nan) << "max_exp_avg_sq[" << i << "] = " << vmax[i];
        EXPECT_EQ(std::isnan(p[i]), want_nan) << "w[" << i << "] = " << p[i];
      }
    }
  }
}

TEST(Sgd, KeepsNoMomentumBufferWithoutMomentum) {
  Tensor w = Ones({4});
  Sgd plain({{"w", w}}, {.lr = 0.1});
  w.set_grad(Full({4}, 1.0));
  plain.Step();  // w = 0.9
  std::vector<std::string> keys;
  for (const auto& [k, t] : plain.StateDict()) keys.push_back(k);
  EXPECT_EQ(EntriesUnder(plain.StateDict(), "state."), 1u);
  EXPECT_THAT(keys, ::testing::Contains("state.w.step"));

  // Saved with its options, the state is refused (momentum zero or not
  // differs); saved without them, as by earlier versions, it loads.
  Tensor v = w.Detach().Clone();
  Sgd with_momentum({{"w", v}}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1});
  EXPECT_THAT(ErrorOf([&] { with_momentum.LoadStateDict(plain.StateDict()); }), HasSubstr("momentum is 0 in the state"));
  ASSERT_NO_THROW(with_momentum.LoadStateDict(WithoutOptions(plain.StateDict())));
  EXPECT_EQ(with_momentum.step_count(0), 1);
  v.set_grad(Full({4}, 1.0));
  with_momentum.Step();  // buf = 1, v = 0.9 - 0.1
  for (float x : v.ToVector<float>()) EXPECT_FLOAT_EQ(x, 0.8f);
  EXPECT_EQ(with_momentum.step_count(0), 2);
  v.set_grad(Full({4}, 1.0));
  with_momentum.Step();  // buf = 0.9 * 1 + 0.9 * 1, v = 0.8 - 0.18
  for (float x : v.ToVector<float>()) EXPECT_FLOAT_EQ(x, 0.62f);

  // A state saved by earlier versions holds a zero buffer at momentum 0:
  // it still loads, and is not kept.
  NamedTensors older = plain.StateDict();
  older.emplace_back("state.w.momentum_buffer", Zeros({4}));
  Tensor u = w.Detach().Clone();
  Sgd again({{"w", u}}, {.lr = 0.1});
  ASSERT_NO_THROW(again.LoadStateDict(older));
  EXPECT_EQ(EntriesUnder(again.StateDict(), "state."), 1u);
  u.set_grad(Full({4}, 1.0));
  again.Step();
  for (float x : u.ToVector<float>()) EXPECT_FLOAT_EQ(x, 0.8f);
  // Its shape is still checked.
  older.back().second = Zeros({5});
  EXPECT_THROW(again.LoadStateDict(older), std::invalid_argument);
}

TEST(Optimizer, RejectsBadParametersAndOptions) {
  EXPECT_THROW(Sgd({{"a", Zeros({2})}, {"a", Zeros({2})}}, {}), std::invalid_argument);
  EXPECT_THROW(Sgd({{"i", Zeros({2}, {.dtype = DType::kInt64})}}, {}), std::invalid_argument);
  EXPECT_THROW(Sgd({{"t", Zeros({2, 3}).Transpose(0, 1)}}, {}), std::invalid_argument);
  EXPECT_THROW(Sgd({{"", Zeros({2})}}, {}), std::invalid_argument);
  EXPECT_THROW(Sgd({{"a", Zeros({2})}}, {.lr = -1}), std::invalid_argument);
  EXPECT_THROW(Sgd({{"a", Zeros({2})}}, {.nesterov = true}), std::invalid_argument);
  EXPECT_THROW(Adam({{"a", Zeros({2})}}, {.beta1 = 1.0}), std::invalid_argument);
  EXPECT_THROW(Adadelta({{"a", Zeros({2})}}, {.rho = 1.5}), std::invalid_argument);
}

// A tensor under two names (or two views sharing elements) is refused,
// naming both: it would get two states and two updates per step. Before,
// only repeated names were refused, and `b` moved twice as far as `a` alone.
TEST(Optimizer, RefusesATensorListedTwiceOrOverlappingViews) {
  const Tensor w = Zeros({4});
  EXPECT_EQ(ErrorOf([&] { Sgd({{"a", w}, {"x", Zeros({2})}, {"b", w}}, {}); }),
            "SGD: parameters `a` and `b` share memory (bytes [0, 16) and [0, 16) of one storage): "
            "elements listed twice would be updated twice per step");
  const Tensor flat = Zeros({8});
  EXPECT_THAT(ErrorOf([&] { Adam({{"hi", flat.Narrow(0, 4, 4)}, {"lo", flat.Narrow(0, 0, 5)}}, {}); }),
              HasSubstr("parameters `hi` and `lo` share memory (bytes [16, 32) and [0, 20)"));
  // Overlapping a piece that is not the one just before it in memory (an
  // empty view lies between them).
  EXPECT_THAT(ErrorOf([&] { Sgd({{"all", flat}, {"e", flat.Narrow(0, 2, 0)}, {"q", flat.Narrow(0, 6, 2)}}, {}); }),
              HasSubstr("parameters `all` and `q` share memory (bytes [0, 32) and [24, 32)"));
  const Tensor none = Zeros({0});
  EXPECT_THAT(ErrorOf([&] { Sgd({{"e", none}, {"f", none}}, {}); }), HasSubstr("parameters `e` and `f` share memory"));
  // Disjoint and empty views of one buffer are allowed (ZeRO's pieces).
  EXPECT_EQ(ErrorOf([&] {
              Sgd({{"c", flat.Narrow(0, 4, 4)}, {"d", flat.Narrow(0, 0, 4)}, {"z", flat.Narrow(0, 2, 0)}}, {});
            }),
            "");
  EXPECT_THAT(ErrorOf([&] { CheckParameters({{"a", w}, {"b", w}}, "ZeroRedundancyOptimizer"); }),
              HasSubstr("ZeroRedundancyOptimizer: parameters `a` and `b` share memory"));
}

// NaN momentum, dampening or weight_decay is refused as a negative one is.
// Before, NaN passed the check (x < 0) and made every updated parameter NaN.
TEST(Optimizer, SgdRefusesNanOptions) {
  const std::pair<SgdOptions, std::string> cases[] = {
      {{.momentum = std::nan("")}, "SGD: momentum nan must be finite and >= 0"},
      {{.dampening = std::nan("")}, "SGD: dampening nan must be finite"},
      {{.weight_decay = std::nan("")}, "SGD: weight_decay nan must be finite and >= 0"},
      {{.weight_decay = -1}, "SGD: weight_decay -1 must be finite and >= 0"}};
  for (const auto& [o, expected] : cases) EXPECT_EQ(ErrorOf([&] { Sgd({{"a", Zeros({2})}}, o); }), expected);
}

// A negative dampening is taken, as PyTorch's SGD takes it (it checks lr,
// momentum and weight_decay only): buf = momentum * buf + (1 - dampening) * d
// weights the new gradient by more than 1. Before, it was refused.
TEST(Sgd, TakesANegativeDampeningAsPyTorch) {
  const double lr = 0.1, momentum = 0.9, dampening = -0.5, weight_decay = 0.01;
  Tensor w = FromVector({1.0, -2.0}, {2}, {.dtype = DType::kFloat64});
  Sgd sgd({{"w", w}}, {.lr = lr, .momentum = momentum, .dampening = dampening, .weight_decay = weight_decay});
  EXPECT_EQ(sgd.options().dampening, -0.5);
  std::vector<double> want = {1.0, -2.0}, buf(2);
  const std::vector<std::vector<double>> grads = {{0.5, 0.25}, {-1.0, 2.0}, {0.125, -0.75}};
  for (size_t step = 0; step < grads.size(); ++step) {
    w.set_grad(FromVector(grads[step], {2}, {.dtype = DType::kFloat64}));
    sgd.Step();
    for (size_t i = 0; i < 2; ++i) {
      const double d = grads[step][i] + weight_decay * want[i];
      buf[i] = step == 0 ? d : momentum * buf[i] + (1 - dampening) * d;
      want[i] -= lr * buf[i];
    }
    const std::vector<double> got = w.ToVector<double>();
    for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(got[i], want[i], 1e-12) << "step " << step + 1 << ", element " << i;
  }
}

// Infinite options are refused like negative ones, naming the option and
// its value: momentum, dampening or weight_decay inf made SGD's update inf
// or NaN, eps inf stalled Adam at 0, Adadelta's eps inf made it NaN. Before,
// the checks (x >= 0) took infinity.
TEST(Optimizer, InfiniteOptionsAreRefused) {
  const double inf = std::numeric_limits<double>::infinity();
  const NamedParameters p = {{"a", Zeros({2})}};
  EXPECT_EQ(ErrorOf([&] { Sgd(p, {.momentum = inf}); }), "SGD: momentum inf must be finite and >= 0");
  EXPECT_THAT(ErrorOf([&] { Sgd(p, {.momentum = 0.9, .dampening = inf}); }), HasSubstr("dampening inf"));
  EXPECT_THAT(ErrorOf([&] { Sgd(p, {.weight_decay = inf}); }), HasSubstr("weight_decay inf"));
  EXPECT_EQ(ErrorOf([&] { Adam(p, {.eps = inf}); }), "Adam: eps inf must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { AdamW(p, {.weight_decay = inf}); }), "AdamW: weight_decay inf must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Adadelta(p, {.eps = inf}); }),
            "Adadelta: eps inf must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Adadelta(p, {.weight_decay = inf}); }), "Adadelta: weight_decay inf must be finite and >= 0");
}

// A refused option or rate is shown as given: std::to_string's six fixed
// decimals showed -1e-7 as "-0.000000", a value that looks allowed.
TEST(Optimizer, RefusedSmallValuesAreShownAsGiven) {
  const NamedParameters p = {{"a", Zeros({2})}};
  EXPECT_EQ(ErrorOf([&] { Sgd(p, {.weight_decay = -1e-7}); }), "SGD: weight_decay -1e-07 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Adam(p, {.eps = -1e-9}); }), "Adam: eps -1e-09 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { Adadelta(p, {.weight_decay = -2.5e-8}); }),
            "Adadelta: weight_decay -2.5e-08 must be finite and >= 0");
  Sgd opt(p, {.lr = 0.1});
  EXPECT_EQ(ErrorOf([&] { opt.set_lr(-3e-7); }), "SGD: learning rate -3e-07 must be finite and >= 0");
}

// A rate that is not finite would turn every parameter into inf or NaN at
// the first step: the constructor and set_lr refuse it as they refuse a
// negative one, and a refused rate changes nothing. Before, inf was taken.
TEST(Optimizer, SetLrRefusesANonFiniteRate) {
  const double inf = std::numeric_limits<double>::infinity();
  for (double lr : {inf, -inf, std::nan(""), -1.0}) {
    SCOPED_TRACE(lr);
    Sgd opt({{"a", Zeros({2})}}, {.lr = 0.1});
    EXPECT_THAT(ErrorOf([&] { opt.set_lr(lr); }),
                AllOf(HasSubstr("SGD: learning rate "), HasSubstr(" must be finite and >= 0")));
    EXPECT_EQ(opt.lr(), 0.1);
    EXPECT_THROW(Sgd({{"a", Zeros({2})}}, {.lr = lr}), std::invalid_argument);
    EXPECT_THROW(Adam({{"a", Zeros({2})}}, {.lr = lr}), std::invalid_argument);
  }
  Sgd opt({{"a", Zeros({2})}}, {.lr = 0.1});
  opt.set_lr(0.0);
  EXPECT_EQ(opt.lr(), 0.0);
}

// A NaN gradient factor made every parameter the step updated NaN, and a
// negative one stepped every parameter up its gradient, both silently;
// they are refused naming the optimizer and the value, and the factor in
// use stays. +inf (1/scale once a loss scale underflowed to 0) is taken.
TEST(Optimizer, SetGradScaleRefusesANanOrNegativeFactor) {
  Tensor w = FromVector({1.0, 2.0}, {2}, {.dtype = DType::kFloat64});
  Sgd sgd({{"w", w}}, {.lr = 0.5});
  sgd.set_grad_scale(0.25);
  EXPECT_THAT(ErrorOf([&] { sgd.set_grad_scale(std::nan("")); }), HasSubstr("SGD: grad scale nan must be >= 0"));
  EXPECT_THAT(ErrorOf([&] { sgd.set_grad_scale(-0.5); }), HasSubstr("SGD: grad scale -0.5 must be >= 0"));
  Adam adam({{"v", Zeros({2})}}, {});
  EXPECT_THAT(ErrorOf([&] { adam.set_grad_scale(-std::numeric_limits<double>::infinity()); }),
              HasSubstr("Adam: grad scale -inf must be >= 0"));
  // Still 0.25: w - 0.5 * 0.25 * 4.
  w.set_grad(FromVector({4.0, 4.0}, {2}, {.dtype = DType::kFloat64}));
  sgd.Step();
  EXPECT_EQ(w.ToVector<double>(), (std::vector<double>{0.5, 1.5}));
  EXPECT_NO_THROW(sgd.set_grad_scale(std::numeric_limits<double>::infinity()));
  EXPECT_NO_THROW(sgd.set_grad_scale(0.0));
}

TEST(ClipGradNorm, ClipsOnlyAboveTheLimit) {
  Tensor a = Zeros({2}), b = Zeros({1});
  a.set_grad(FromVector({3, 0}, {2}));
  b.set_grad(FromVector({4}, {1}));
  EXPECT_DOUBLE_EQ(ClipGradNorm({a, b}, 10.0), 5.0);
  EXPECT_EQ(a.grad().ToVector<float>(), (std::vector<float>{3, 0}));
  EXPECT_DOUBLE_EQ(ClipGradNorm({a, b}, 1.0), 5.0);
  EXPECT_NEAR(a.grad().ToVector<float>()[0], 0.6, 1e-6);
  EXPECT_NEAR(b.grad().ToVector<float>()[0], 0.8, 1e-6);
  b.set_grad(FromVector({std::numeric_limits<double>::infinity()}, {1}));
  EXPECT_THROW(ClipGradNorm({a, b}, 1.0, 2.0, true), std::runtime_error);
}

// The clip coefficient is rounded to the gradient's own compute type: f64
// gradients are scaled by the f64 coefficient, f32 ones by its f32
// rounding. Before, every gradient took the f32 rounding.
TEST(ClipGradNorm, CoefficientIsRoundedPerGradientDtype) {
  Tensor d = Zeros({2}, {.dtype = DType::kFloat64}), f = Zeros({2});
  d.set_grad(FromVector({3, 4}, {2}, {.dtype = DType::kFloat64}));
  f.set_grad(FromVector({3, 4}, {2}));
  const double coef = 1.0 / (5.0 + 1e-6);
  ASSERT_NE(coef, static_cast<double>(static_cast<float>(coef)));
  EXPECT_EQ(ClipGradNorm({d}, 1.0), 5.0);
  EXPECT_EQ(d.grad().ToVector<double>(), (std::vector<double>{3 * coef, 4 * coef}));
  EXPECT_EQ(ClipGradNorm({f}, 1.0), 5.0);
  const float fc = static_cast<float>(coef);
  EXPECT_EQ(f.grad().ToVector<float>(), (std::vector<float>{3 * fc, 4 * fc}));
}

// A NaN max_norm made every gradient NaN, a negative one flipped them.
TEST(ClipGradNorm, RefusesANanOrNegativeMaxNorm) {
  Tensor a = Zeros({2});
  a.set_grad(FromVector({3, 4}, {2}));
  for (double max_norm : {std::nan(""), -1.0}) {
    try {
      ClipGradNorm({a}, max_norm);
      ADD_FAILURE() << "max_norm " << max_norm << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("ClipGradNorm: max_norm must be >= 0, got ", 0), 0u) << e.what();
    }
  }
  EXPECT_EQ(a.grad().ToVector<float>(), (std::vector<float>{3, 4}));
}

// An integer gradient (set_grad takes one on an integer tensor) is refused
// naming its position, before any gradient is scaled; the error named no
// parameter ("unsupported dtype").
TEST(ClipGradNorm, IntegerGradientIsRefusedNamingItsPosition) {
  Tensor a = Zeros({2}), n = Zeros({2}, {.dtype = DType::kInt64});
  a.set_grad(FromVector({30, 40}, {2}));
  n.set_grad(Zeros({2}, {.dtype = DType::kInt64}));
  EXPECT_EQ(ErrorOf([&] { ClipGradNorm({a, Tensor(), n}, 1.0); }),
            "ClipGradNorm: the gradient of parameter 2 has dtype i64, expected a floating type");
  EXPECT_EQ(a.grad().ToVector<float>(), (std::vector<float>{30, 40}));
}

// The scale lives in f32: an init_scale past its range (or an infinite
// growth factor) would make every step's scale inf.
TEST(GradScaler, RefusesAScaleOrGrowthBeyondF32) {
  for (GradScalerOptions o : {GradScalerOptions{.init_scale = 1e39}, GradScalerOptions{.init_scale = INFINITY},
                              GradScalerOptions{.growth_factor = INFINITY}}) {
    try {
      GradScaler scaler(o);
      ADD_FAILURE() << "init_scale " << o.init_scale << " growth_factor " << o.growth_factor << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), ::testing::AnyOf(HasSubstr("GradScaler: init_scale "), HasSubstr("GradScaler: growth_factor ")));
    }
  }
  EXPECT_NO_THROW(GradScaler(GradScalerOptions{.init_scale = 3e38}));
}

// A refused option is named alone, with its value, as the optimizers and
// the scaler's LoadStateDict name theirs. Before, the message listed every
// condition and every value, the valid ones included, and left the reader
// to find the one at fault.
TEST(GradScaler, ARefusalNamesTheOneOptionAtFault) {
  EXPECT_EQ(ErrorOf([] { GradScaler({.init_scale = 0}); }),
            "GradScaler: init_scale 0 must be > 0 and finite in f32");
  EXPECT_EQ(ErrorOf([] { GradScaler({.init_scale = 1e39}); }),
            "GradScaler: init_scale 1e+39 must be > 0 and finite in f32");
  EXPECT_EQ(ErrorOf([] { GradScaler({.growth_factor = 0.5}); }), "GradScaler: growth_factor 0.5 must be finite and > 1");
  EXPECT_EQ(ErrorOf([] { GradScaler({.backoff_factor = 1}); }), "GradScaler: backoff_factor 1 must be in (0, 1)");
  EXPECT_EQ(ErrorOf([] { GradScaler({.growth_interval = 0}); }), "GradScaler: growth_interval 0 must be at least 1");
}

// torch.max propagates NaN; so does the infinity norm, wherever the NaN sits.
TEST(ClipGradNorm, InfinityNormIsNanWhenAnyGradientIsNan) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor a = Zeros({3}), b = Zeros({2});
  a.set_grad(FromVector({1, -7, 2}, {3}));
  b.set_grad(FromVector({3, 4}, {2}));
  EXPECT_EQ(ClipGradNorm({a, b}, 100.0, kInfNorm), 7.0);
  a.set_grad(FromVector({nan, 1, 2}, {3}));  // first element, larger values after it
  b.set_grad(FromVector({5, 4}, {2}));
  EXPECT_TRUE(std::isnan(ClipGradNorm({a, b}, 100.0, kInfNorm)));
  a.set_grad(FromVector({1, 1, 2}, {3}));
  b.set_grad(FromVector({nan, 9}, {2}));  // in the second tensor
  EXPECT_TRUE(std::isnan(ClipGradNorm({a, b}, 100.0, kInfNorm)));
}

// A gradient [2, 3] held transposed (strides [1, 2]): logical values
// [[a, c, e], [b, d, f]] for values {a, b, c, d, e, f}.
Tensor TransposedGrad(const std::vector<double>& values) {
  Tensor g = FromVector(values, {3, 2}).Transpose(0, 1);
  EXPECT_FALSE(g.is_contiguous());
  return g;
}

// set_grad accepts a gradient of any strides and Optimizer::Step reads one;
// so does clipping now, as PyTorch's, writing the clipped values back
// through the strides. Before, a non-contiguous gradient threw.
TEST(ClipGradNorm, ClipsANonContiguousGradientThroughItsStrides) {
  Tensor a = Zeros({2, 3}), b = Zeros({1});
  const Tensor g = TransposedGrad({1, 2, 3, 4, 5, 6});
  a.set_grad(g);
  b.set_grad(FromVector({2}, {1}));
  EXPECT_DOUBLE_EQ(ClipGradNorm({a, b}, 100.0, kInfNorm), 6.0);
  const double norm = std::sqrt(91.0 + 4.0);
  EXPECT_NEAR(ClipGradNorm({a, b}, 1.0), norm, 1e-5);
  EXPECT_TRUE(a.grad().is_same(g));  // in place, strides kept
  EXPECT_EQ(a.grad().strides(), (Shape{1, 2}));
  const std::vector<float> got = a.grad().ToVector<float>();
  const std::vector<double> logical = {1, 3, 5, 2, 4, 6};
  ASSERT_EQ(got.size(), logical.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], logical[i] / norm, 1e-6) << i;
  EXPECT_NEAR(b.grad().ToVector<float>()[0], 2.0 / norm, 1e-6);
}

// A gradient shared by two parameters counts twice in the norm and is
// scaled once per parameter, as in PyTorch (foreach_mul_ over the list of
// gradients), whether it is contiguous or not. A non-contiguous one was
// scaled once: each parameter scaled its own copy and both were written back.
TEST(ClipGradNorm, SharedGradientIsScaledOncePerParameterWhateverItsStrides) {
  const double norm = std::sqrt(2 * 91.0);
  const double coef = static_cast<float>(1.0 / (norm + 1e-6));
  const std::vector<double> logical = {1, 3, 5, 2, 4, 6};
  for (bool contiguous : {true, false}) {
    SCOPED_TRACE(contiguous ? "contiguous" : "transposed");
    Tensor a = Zeros({2, 3}), b = Zeros({2, 3});
    const Tensor g = contiguous ? FromVector(logical, {2, 3}) : TransposedGrad({1, 2, 3, 4, 5, 6});
    a.set_grad(g);
    b.set_grad(g);
    EXPECT_NEAR(ClipGradNorm({a, b}, 1.0), norm, 1e-4);
    const std::vector<float> got = g.ToVector<float>();
    ASSERT_EQ(got.size(), logical.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], logical[i] * coef * coef, 1e-6) << i;
  }
}

// torch.nn.utils.clip_grad_value_: each element clamped to [-c, c] in
// place, NaN kept, parameters without a gradient skipped.
TEST(ClipGradValue, ClampsEveryElementInPlaceAndKeepsNan) {
  const double nan = std::nan("");
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    Tensor a = Zeros({6}, {.dtype = dtype}), b = Zeros({2}, {.dtype = dtype}), none = Zeros({3});
    const Tensor ga = FromVector({-3.0, -0.5, 0.0, 0.25, 2.0, nan}, {6}, {.dtype = dtype});
    a.set_grad(ga);
    b.set_grad(FromVector({inf, -inf}, {2}, {.dtype = dtype}));
    ClipGradValue({a, none, b}, 1.0);
    EXPECT_TRUE(a.grad().is_same(ga));  // in place
    const std::vector<double> got = a.grad().ToVector<double>();
    EXPECT_EQ(std::vector<double>(got.begin(), got.end() - 1), (std::vector<double>{-1.0, -0.5, 0.0, 0.25, 1.0}));
    EXPECT_TRUE(std::isnan(got.back()));
    EXPECT_EQ(b.grad().ToVector<double>(), (std::vector<double>{1.0, -1.0}));
    EXPECT_FALSE(none.grad().defined());
  }
  // The bound is rounded to the gradient's dtype (0.1 is 0.0999755859375 in f16).
  Tensor h = Zeros({2}, {.dtype = DType::kFloat16});
  h.set_grad(FromVector({5.0, -5.0}, {2}, {.dtype = DType::kFloat16}));
  ClipGradValue({h}, 0.1);
  EXPECT_EQ(h.grad().ToVector<double>(), (std::vector<double>{0.0999755859375, -0.0999755859375}));
  // Zero clamps everything to zero; infinity changes nothing.
  Tensor z = Zeros({3});
  z.set_grad(FromVector({-2.0, 0.5, 7.0}, {3}));
  ClipGradValue({z}, inf);
  EXPECT_EQ(z.grad().ToVector<double>(), (std::vector<double>{-2.0, 0.5, 7.0}));
  ClipGradValue({z}, 0.0);
  EXPECT_EQ(z.grad().ToVector<double>(), (std::vector<double>{0.0, 0.0, 0.0}));
  // A non-contiguous gradient is clamped through its strides.
  Tensor t = Zeros({2, 3});
  const Tensor g = TransposedGrad({1, 2, 3, 4, 5, 6});
  t.set_grad(g);
  ClipGradValue({t}, 3.5);
  EXPECT_TRUE(t.grad().is_same(g));
  EXPECT_EQ(t.grad().strides(), (Shape{1, 2}));
  EXPECT_EQ(t.grad().ToVector<double>(), (std::vector<double>{1, 3, 3.5, 2, 3.5, 3.5}));
}

TEST(ClipGradValue, RefusesANegativeOrNanClipValueChangingNothing) {
  Tensor w = Zeros({2});
  w.set_grad(FromVector({-4.0, 4.0}, {2}));
  EXPECT_EQ(ErrorOf([&] { ClipGradValue({w}, -1.0); }), "ClipGradValue: clip_value must be >= 0, got -1");
  EXPECT_THAT(ErrorOf([&] { ClipGradValue({w}, std::nan("")); }),
              AllOf(HasSubstr("ClipGradValue: clip_value must be >= 0, got"), HasSubstr("nan")));
  // An integer gradient is named by its position, before any is clamped.
  Tensor i = Zeros({2});
  i.set_grad(Zeros({2}));
  i.grad().SetData(Zeros({2}, {.dtype = DType::kInt64}));
  EXPECT_EQ(ErrorOf([&] { ClipGradValue({w, i}, 1.0); }),
            "ClipGradValue: the gradient of parameter 1 has dtype i64, expected a floating type");
  EXPECT_EQ(w.grad().ToVector<double>(), (std::vector<double>{-4.0, 4.0}));
}

// The scaler, likewise: an explicit Unscale writes through the strides, and
// the fused path checks a strided gradient for inf and NaN. Before, both
// threw "not contiguous".
TEST(GradScaler, UnscalesAndChecksANonContiguousGradient) {
  Tensor w = Zeros({2, 3});
  Sgd opt({{"w", w}}, {.lr = 1.0});
  GradScaler scaler({.init_scale = 4});
  const Tensor g = TransposedGrad({4, 8, 12, 16, 20, 24});
  w.set_grad(g);
  scaler.Unscale(opt);
  EXPECT_TRUE(w.grad().is_same(g));
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{1, 3, 5, 2, 4, 6}));
  EXPECT_TRUE(scaler.Step(opt));
  scaler.Update();
  EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{-1, -3, -5, -2, -4, -6}));
  // Fused: an inf skips the step and halves the scale.
  w.set_grad(TransposedGrad({4, 8, 12, 16, std::numeric_limits<double>::infinity(), 24}));
  EXPECT_FALSE(scaler.Step(opt));
  scaler.Update();
  EXPECT_EQ(scaler.scale(), 2.0);
  EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{-1, -3, -5, -2, -4, -6}));
  w.set_grad(TransposedGrad({2, 4, 6, 8, 10, 12}));
  EXPECT_TRUE(scaler.Step(opt));  // unscaled as the optimizer reads it: .grad keeps the scaled values
  scaler.Update();
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{2, 6, 10, 4, 8, 12}));
  EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{-2, -6, -10, -4, -8, -12}));
}

// An f64 gradient beyond f32's range (3.4e38) is finite: the step is taken
// and the scale kept, on the explicit and the fused path. Before, each
// element was rounded to float before the check and read as inf.
TEST(GradScaler, AnF64GradientBeyondF32RangeIsFinite) {
  for (bool explicit_unscale : {true, false}) {
    SCOPED_TRACE(explicit_unscale);
    Tensor w = Zeros({2}, {.dtype = DType::kFloat64});
    Sgd opt({{"w", w}}, {.lr = 1.0});
    GradScaler scaler({.init_scale = 4});
    w.set_grad(FromVector({4e300, -8.0}, {2}, {.dtype = DType::kFloat64}));
    if (explicit_unscale) scaler.Unscale(opt);
    EXPECT_TRUE(scaler.Step(opt));
    scaler.Update();
    EXPECT_EQ(scaler.scale(), 4.0);
    EXPECT_EQ(w.ToVector<double>(), (std::vector<double>{-1e300, 2.0}));
  }
}

// An f16 gradient is refused by Unscale, naming the parameter, and left as
// it was; Step without Unscale takes it and unscales in f32. Before, Unscale
// wrote g / scale back in f16: 2^-10 scaled by 2^16 became 0.
TEST(GradScaler, UnscaleRefusesF16GradientsAndTheFusedStepTakesThem) {
  Tensor w = Zeros({2}, {.dtype = DType::kFloat16});
  Sgd opt({{"w", w}}, {.lr = 16384});  // 2^14: the step moves w by amounts f16 can hold
  GradScaler scaler({.init_scale = 65536});
  const std::vector<double> scaled = {std::ldexp(1.0, -14), 64.0};  // 2^-30 and 2^-10 unscaled
  w.set_grad(FromVector(scaled, {2}, {.dtype = DType::kFloat16}));
  EXPECT_EQ(ErrorOf([&] { scaler.Unscale(opt); }),
            "GradScaler: gradient of `w` is f16, which Unscale would flush towards zero (g / scale rounded to "
            "f16); keep f32 gradients, or call Step without Unscale (it unscales in f32 as the optimizer reads)");
  EXPECT_EQ(w.grad().ToVector<double>(), scaled);
  EXPECT_TRUE(scaler.Step(opt));
  scaler.Update();
  EXPECT_EQ(w.ToVector<double>(), (std::vector<double>{-std::ldexp(1.0, -16), -16.0}));
  // bf16 keeps f32's exponent range: its Unscale stays allowed.
  Tensor b = Zeros({2}, {.dtype = DType::kBFloat16});
  Sgd bopt({{"b", b}}, {.lr = 1.0});
  b.set_grad(FromVector(scaled, {2}, {.dtype = DType::kBFloat16}));
  scaler.Unscale(bopt);
  EXPECT_EQ(b.grad().ToVector<double>(), (std::vector<double>{std::ldexp(1.0, -30), std::ldexp(1.0, -10)}));
}

// An iteration that Unscale found an inf in and that then skipped its step
// is updated: the scale backs off (PyTorch's update accepts it). Before,
// Update threw "called without Step" and the scale never came down.
TEST(GradScaler, UpdateAfterUnscaleAloneBacksOff) {
  Tensor w = Zeros({2});
  Sgd opt({{"w", w}}, {.lr = 1.0});
  GradScaler scaler({.init_scale = 1024});
  w.set_grad(FromVector({std::numeric_limits<double>::infinity(), 1.0}, {2}));
  scaler.Unscale(opt);
  ASSERT_TRUE(scaler.found_inf());
  EXPECT_NO_THROW(scaler.Update());
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{0, 0}));
  // The next iteration starts afresh; nothing at all is still refused.
  w.set_grad(FromVector({512.0, 1024.0}, {2}));
  EXPECT_TRUE(scaler.Step(opt));
  scaler.Update();
  EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{-1, -2}));
  try {
    scaler.Update();
    ADD_FAILURE() << "Update with nothing done was accepted";
  } catch (const std::logic_error& e) {
    EXPECT_STREQ(e.what(), "GradScaler: Update called without Unscale or Step");
  }
}

// An optimizer made in the storage of one destroyed mid-iteration (same
// address) starts afresh: its Unscale is not refused as a second one, and
// its gradient is unscaled. Before, the state was keyed by the address and
// passed to the newcomer.
TEST(GradScaler, ANewOptimizerAtADestroyedOnesAddressStartsAfresh) {
  Tensor w = Zeros({2});
  GradScaler scaler({.init_scale = 4});
  std::optional<Sgd> opt;
  opt.emplace(NamedParameters{{"w", w}}, SgdOptions{.lr = 1.0});
  const Optimizer* first = &*opt;
  w.set_grad(FromVector({4.0, 8.0}, {2}));
  scaler.Unscale(*opt);
  opt.reset();
  opt.emplace(NamedParameters{{"w", w}}, SgdOptions{.lr = 1.0});
  ASSERT_EQ(&*opt, first);
  EXPECT_NE(opt->instance_id(), 0u);
  w.set_grad(FromVector({4.0, 8.0}, {2}));
  EXPECT_NO_THROW(scaler.Unscale(*opt));
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{1, 2}));
}

// Before, Step marked the optimizer as stepped before calling its Step:
// when that threw (here a gradient of the wrong shape), a retry was refused
// as "Step called twice", and Update counted the iteration as a clean step
// (the growth tracker advanced). Fused or after Unscale, the gradient is
// unscaled once either way.
TEST(GradScaler, StepThatThrowsCanBeRetriedAndIsNotCountedAsClean) {
  for (bool unscale_first : {false, true}) {
    SCOPED_TRACE(unscale_first ? "after Unscale" : "fused");
    Tensor w = Zeros({2});
    Sgd opt({{"w", w}}, {.lr = 1.0});
    GradScaler scaler({.init_scale = 1024, .growth_interval = 2});
    auto failed_step = [&] {
      w.set_grad(FromVector({1024.0, 2048.0}, {2}));
      if (unscale_first) scaler.Unscale(opt);
      const Tensor good = w.grad().Clone();
      w.grad().SetData(Zeros({3}));
      EXPECT_THAT(ErrorOf([&] { scaler.Step(opt); }), HasSubstr("gradient of `w` has shape [3]"));
      w.grad().SetData(good);
    };
    // Given up: Update neither counts a clean step nor changes the scale.
    failed_step();
    EXPECT_NO_THROW(scaler.Update());
    EXPECT_EQ(scaler.growth_tracker(), 0);
    EXPECT_EQ(scaler.scale(), 1024.0);
    EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{0, 0}));
    // Retried once the gradient is fixed: it steps, and Update counts it.
    failed_step();
    EXPECT_TRUE(scaler.Step(opt));
    EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{-1, -2}));
    scaler.Update();
    EXPECT_EQ(scaler.growth_tracker(), 1);
    EXPECT_EQ(scaler.scale(), 1024.0);
  }
}

TEST(GradScaler, SkipsBadStepsLowersAndRaisesTheScale) {
  Tensor w = FromVector({1.0, 2.0}, {2});
  Sgd opt({{"w", w}}, {.lr = 0.5});
  GradScaler scaler({.init_scale = 1024, .growth_interval = 3});
  EXPECT_EQ(scaler.scale(), 1024.0);
  // Gradient 1 scaled by 1024; the step must apply the unscaled 1.
  w.set_grad(FromVector({1024.0, 2048.0}, {2}));
  EXPECT_TRUE(scaler.Step(opt));
  scaler.Update();
  EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{0.5f, 1.0f}));
  // An inf: no step, scale halves, tracker resets.
  w.set_grad(FromVector({std::numeric_limits<double>::infinity(), 1.0}, {2}));
  EXPECT_FALSE(scaler.Step(opt));
  EXPECT_TRUE(scaler.found_inf());
  scaler.Update();
  EXPECT_EQ(w.ToVector<float>(), (std::vector<float>{0.5f, 1.0f}));
  EXPECT_EQ(scaler.scale(), 512.0);
  // A NaN found by an explicit Unscale.
  w.set_grad(FromVector({std::nan(""), 1.0}, {2}));
  scaler.Unscale(opt);
  EXPECT_FALSE(scaler.Step(opt));
  scaler.Update();
  EXPECT_EQ(scaler.scale(), 256.0);
  // Three good steps in a row double it.
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(scaler.growth_tracker(), i);
    w.set_grad(Zeros({2}));
    EXPECT_TRUE(scaler.Step(opt));
    scaler.Update();
  }
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, FusedAndExplicitUnscaleGiveTheSameParameters) {
  NamedParameters a = MakeParams(DType::kFloat32, 3), b = MakeParams(DType::kFloat32, 3);
  Adam oa(a, {.lr = 1e-2}), ob(b, {.lr = 1e-2});
  GradScaler sa, sb;
  for (int s = 0; s < 4; ++s) {
    SetGrads(a, s);
    SetGrads(b, s);
    for (auto* params : {&a, &b}) {
      for (auto& [n, p] : *params) {
        Tensor g = p.grad();
        float* d = g.data<float>();
        for (int64_t i = 0; i < g.numel(); ++i) d[i] *= 65536.0f;
      }
    }
    sa.Step(oa);
    sa.Update();
    sb.Unscale(ob);
    sb.Step(ob);
    sb.Update();
  }
  EXPECT_EQ(Bytes(a), Bytes(b));
}

TEST(GradScaler, StateRoundTripAndMisuse) {
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {});
  GradScaler s({.init_scale = 8, .growth_interval = 10});
  w.set_grad(Zeros({1}));
  s.Step(opt);
  s.Update();
  GradScaler t;
  t.LoadStateDict(s.StateDict());
  EXPECT_EQ(t.scale(), 8.0);
  EXPECT_EQ(t.growth_tracker(), 1);
  EXPECT_THROW(t.Update(), std::logic_error);
  t.Unscale(opt);
  EXPECT_THROW(t.Unscale(opt), std::logic_error);
  EXPECT_THROW(GradScaler({.backoff_factor = 1.5}), std::invalid_argument);
  GradScaler off({.enabled = false});
  EXPECT_EQ(off.scale(), 1.0);
  EXPECT_TRUE(off.Step(opt));
}

// A growth tracker of the largest i64 loaded, and the next clean Update's
// count wrapped (signed overflow). It is refused naming it, and nothing
// changes; one less grows the scale at the next clean step.
TEST(GradScaler, AGrowthTrackerTheNextUpdateWouldOverflowIsRefused) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {});
  GradScaler s({.init_scale = 8, .growth_interval = 10});
  NamedTensors state = s.StateDict();
  for (auto& [k, t] : state) {
    if (k == "scaler.growth_tracker") t = FromVectorOf<int64_t>({kMax}, {});
  }
  EXPECT_EQ(ErrorOf([&] { s.LoadStateDict(state); }),
            "GradScaler.LoadStateDict: scaler.growth_tracker 9223372036854775807 is the largest i64: the next "
            "Update's count would overflow");
  EXPECT_EQ(s.growth_tracker(), 0);
  for (auto& [k, t] : state) {
    if (k == "scaler.growth_tracker") t = FromVectorOf<int64_t>({kMax - 1}, {});
  }
  s.LoadStateDict(state);
  w.set_grad(Zeros({1}));
  s.Step(opt);
  s.Update();
  EXPECT_EQ(s.scale(), 16.0);
  EXPECT_EQ(s.growth_tracker(), 0);
}

// PyTorch's disabled GradScaler saves an empty state and ignores the one it
// is given. Before, a disabled scaler saved its unused scale and refused a
// state without "scaler." keys (or with malformed ones).
TEST(GradScaler, DisabledSavesNothingAndIgnoresTheState) {
  GradScaler off({.init_scale = 64, .enabled = false});
  EXPECT_TRUE(off.StateDict().empty());
  GradScaler on({.init_scale = 8, .growth_factor = 4});
  ASSERT_NO_THROW(off.LoadStateDict(on.StateDict()));
  ASSERT_NO_THROW(off.CheckStateDict({}));
  ASSERT_NO_THROW(off.LoadStateDict({}));
  const NamedTensors bad = {{"scaler.scale", Zeros({2})}, {"scaler.other", Zeros({})}};
  ASSERT_NO_THROW(off.CheckStateDict(bad));
  ASSERT_NO_THROW(off.LoadStateDict(bad));
  EXPECT_EQ(off.scale(), 1.0);
  EXPECT_EQ(off.growth_tracker(), 0);
  EXPECT_EQ(off.options().growth_factor, 2.0);
  EXPECT_TRUE(off.StateDict().empty());
  // An enabled scaler still refuses the disabled one's empty state.
  EXPECT_EQ(ErrorOf([&] { on.LoadStateDict(off.StateDict()); }),
            "GradScaler.LoadStateDict: missing f32 scalar `scaler.scale`");
}

void ExpectSameEntries(const NamedTensors& a, const NamedTensors& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_EQ(a[i].second.ToVector<double>(), b[i].second.ToVector<double>()) << a[i].first;
  }
}

// The options travel with the state, as in PyTorch's param_groups and
// GradScaler.state_dict. Before, only lr was saved: a resumed optimizer
// kept whatever options it was built with, and a scaler its own factors.
TEST(OptimizerState, OptionsRoundTripAndReplaceTheLoadersPlainOnes) {
  Tensor w = Ones({3});
  Sgd saved({{"w", w}}, {.lr = 0.05, .momentum = 0.9, .dampening = 0.25, .weight_decay = 1e-3, .maximize = true});
  Sgd loaded({{"w", w.Detach().Clone()}}, {.lr = 0.1, .momentum = 0.5});
  loaded.LoadStateDict(saved.StateDict());
  EXPECT_EQ(loaded.lr(), 0.05);
  EXPECT_EQ(loaded.options().momentum, 0.9);
  EXPECT_EQ(loaded.options().dampening, 0.25);
  EXPECT_EQ(loaded.options().weight_decay, 1e-3);
  EXPECT_TRUE(loaded.maximize());
  EXPECT_FALSE(loaded.options().nesterov);

  Adam adam({{"w", w}}, {.beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.5, .amsgrad = true});
  Adam adam_loaded({{"w", w.Detach().Clone()}}, {.amsgrad = true});
  adam_loaded.LoadStateDict(adam.StateDict());
  ExpectSameEntries(adam_loaded.StateDict(), adam.StateDict());

  Adadelta delta({{"w", w}}, {.rho = 0.5, .eps = 1e-4, .weight_decay = 0.25});
  Adadelta delta_loaded({{"w", w.Detach().Clone()}}, {});
  delta_loaded.LoadStateDict(delta.StateDict());
  ExpectSameEntries(delta_loaded.StateDict(), delta.StateDict());

  GradScaler scaler({.init_scale = 8, .growth_factor = 4, .backoff_factor = 0.25, .growth_interval = 3});
  GradScaler scaler_loaded;
  scaler_loaded.LoadStateDict(scaler.StateDict());
  EXPECT_EQ(scaler_loaded.scale(), 8.0);
  EXPECT_EQ(scaler_loaded.options().growth_factor, 4.0);
  EXPECT_EQ(scaler_loaded.options().backoff_factor, 0.25);
  EXPECT_EQ(scaler_loaded.options().growth_interval, 3);
}

// Options that decide which state is kept must match; the message names the
// option and both values. Before, a momentum 0.9 state loaded into
// momentum 0 and its buffers were dropped without a word.
TEST(OptimizerState, StructuralOptionMismatchIsRefusedNamingBothValues) {
  Tensor w = Ones({3});
  Sgd momentum({{"w", w}}, {.momentum = 0.9});
  w.set_grad(Ones({3}));
  momentum.Step();
  Tensor u = Ones({3});
  Sgd plain({{"w", u}}, {});
  const std::string error = ErrorOf([&] { plain.LoadStateDict(momentum.StateDict()); });
  EXPECT_THAT(error, HasSubstr("momentum is 0.9 in the state and 0 in this optimizer"));
  EXPECT_THAT(ErrorOf([&] { plain.CheckStateDict(momentum.StateDict()); }), HasSubstr("momentum is 0.9"));
  EXPECT_EQ(plain.step_count(0), 0);  // nothing changed

  Sgd nesterov({{"w", w}}, {.momentum = 0.9, .nesterov = true});
  EXPECT_THAT(ErrorOf([&] { momentum.LoadStateDict(nesterov.StateDict()); }),
              HasSubstr("nesterov is true in the state and false in this optimizer"));

  Adam amsgrad({{"w", w}}, {.amsgrad = true});
  Adam adam({{"w", u}}, {});
  EXPECT_THAT(ErrorOf([&] { adam.LoadStateDict(amsgrad.StateDict()); }),
              HasSubstr("amsgrad is true in the state and false in this optimizer"));
  AdamW adamw({{"w", u}}, {});
  EXPECT_THAT(ErrorOf([&] { adamw.LoadStateDict(adam.StateDict()); }),
              HasSubstr("the state was saved by Adam, this optimizer is AdamW"));
  EXPECT_THAT(ErrorOf([&] { plain.LoadStateDict(adam.StateDict()); }),
              HasSubstr("the state was saved by Adam, this optimizer is SGD"));

  // Plain values are checked as the constructor checks them.
  NamedTensors bad = adam.StateDict();
  for (auto& [k, t] : bad) {
    if (k == "group.beta1") t = FromVector({1.5}, {}, {.dtype = DType::kFloat64});
  }
  EXPECT_THAT(ErrorOf([&] { adam.LoadStateDict(bad); }), HasSubstr("beta1 1.5 must be in [0, 1)"));
  NamedTensors partial = momentum.StateDict();
  std::erase_if(partial, [](const auto& e) { return e.first == "group.dampening"; });
  EXPECT_THAT(ErrorOf([&] { momentum.LoadStateDict(partial); }), HasSubstr("missing `group.dampening`"));

  NamedTensors scaler_state = GradScaler({.growth_factor = 4}).StateDict();
  for (auto& [k, t] : scaler_state) {
    if (k == "scaler.backoff_factor") t = FromVector({1.0}, {}, {.dtype = DType::kFloat64});
  }
  GradScaler scaler;
  EXPECT_THAT(ErrorOf([&] { scaler.LoadStateDict(scaler_state); }),
              HasSubstr("scaler.backoff_factor 1 must be in (0, 1)"));
  EXPECT_EQ(scaler.options().growth_factor, 2.0);  // nothing changed
}

// A state saved before the options were (no "group." or scaler option
// keys) still loads and keeps the loader's options.
TEST(OptimizerState, StateWithoutOptionsKeepsTheLoadersOptions) {
  Tensor w = Ones({3});
  Sgd saved({{"w", w}}, {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3});
  w.set_grad(Ones({3}));
  saved.Step();
  Sgd loaded({{"w", w.Detach().Clone()}}, {.lr = 0.1, .momentum = 0.5});
  const NamedTensors old = WithoutOptions(saved.StateDict());
  ASSERT_EQ(EntriesUnder(old, "group."), 0u);
  ASSERT_NO_THROW(loaded.LoadStateDict(old));
  EXPECT_EQ(loaded.lr(), 0.05);
  EXPECT_EQ(loaded.step_count(0), 1);
  EXPECT_EQ(loaded.options().momentum, 0.5);
  EXPECT_EQ(loaded.options().weight_decay, 0.0);

  NamedTensors scaler_state = GradScaler({.init_scale = 8, .growth_factor = 4}).StateDict();
  std::erase_if(scaler_state, [](const auto& e) {
    return e.first != "scaler.scale" && e.first != "scaler.growth_tracker";
  });
  GradScaler scaler({.growth_interval = 7});
  ASSERT_NO_THROW(scaler.LoadStateDict(scaler_state));
  EXPECT_EQ(scaler.scale(), 8.0);
  EXPECT_EQ(scaler.options().growth_factor, 2.0);
  EXPECT_EQ(scaler.options().growth_interval, 7);
}

// Two optimizers, one scaler: each is unscaled once, by Unscale or by its
// own Step, and skipped for its own inf; Update lowers the scale when any
// had one. Before, one stage for all: after Unscale(first), Step(second)
// stepped with the still-scaled gradients, and a second iteration's
// Step(second) after Step(first) was refused as "Step called twice".
TEST(GradScaler, EachOptimizerIsUnscaledOnceAndSkippedForItsOwnInf) {
  Tensor a = FromVector({1.0, 2.0}, {2}), b = FromVector({1.0, 2.0}, {2});
  Sgd first({{"a", a}}, {.lr = 0.5}), second({{"b", b}}, {.lr = 0.5});
  GradScaler scaler({.init_scale = 1024});
  a.set_grad(FromVector({1024.0, 2048.0}, {2}));
  b.set_grad(FromVector({1024.0, 2048.0}, {2}));
  scaler.Unscale(first);
  EXPECT_THROW(scaler.Unscale(first), std::logic_error);
  EXPECT_TRUE(scaler.Step(first));
  EXPECT_TRUE(scaler.Step(second));  // unscaled as it reads, as a step of its own
  EXPECT_THROW(scaler.Step(second), std::logic_error);
  EXPECT_THROW(scaler.Unscale(second), std::logic_error);
  scaler.Update();
  EXPECT_EQ(a.ToVector<float>(), (std::vector<float>{0.5f, 1.0f}));
  EXPECT_EQ(b.ToVector<float>(), (std::vector<float>{0.5f, 1.0f}));
  EXPECT_EQ(a.grad().ToVector<float>(), (std::vector<float>{1.0f, 2.0f}));        // unscaled in place
  EXPECT_EQ(b.grad().ToVector<float>(), (std::vector<float>{1024.0f, 2048.0f}));  // fused: kept scaled
  EXPECT_EQ(scaler.scale(), 1024.0);
  // An inf in the second's gradients skips the second only; the scale backs off.
  a.set_grad(FromVector({1024.0, 1024.0}, {2}));
  b.set_grad(FromVector({std::numeric_limits<double>::infinity(), 0.0}, {2}));
  EXPECT_TRUE(scaler.Step(first));
  EXPECT_FALSE(scaler.found_inf());
  EXPECT_FALSE(scaler.Step(second));
  EXPECT_TRUE(scaler.found_inf());
  scaler.Update();
  EXPECT_EQ(a.ToVector<float>(), (std::vector<float>{0.0f, 0.5f}));
  EXPECT_EQ(b.ToVector<float>(), (std::vector<float>{0.5f, 1.0f}));
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  // An inf found by the Unscale of an optimizer that is then not stepped
  // counts too (PyTorch's update takes every optimizer's found_inf).
  a.set_grad(FromVector({std::nan(""), 0.0}, {2}));
  b.set_grad(FromVector({512.0, 512.0}, {2}));
  scaler.Unscale(first);
  EXPECT_TRUE(scaler.Step(second));
  scaler.Update();
  EXPECT_EQ(b.ToVector<float>(), (std::vector<float>{0.0f, 0.5f}));
  EXPECT_EQ(scaler.scale(), 256.0);
}

// A growth tracker at or past growth_interval would never grow the scale
// again (Update compared with ==); LoadStateDict refuses one outside
// [0, growth_interval). Before, it loaded, and the scale stayed put.
// A tracker saved by a scaler with a longer growth_interval loads, and the
// next clean step grows the scale (Update compares with >=; with == the
// scale never grew again). A negative one is refused.
TEST(GradScaler, LoadedGrowthTrackerAtOrPastTheIntervalGrowsAtTheNextStep) {
  for (int64_t tracker : {int64_t{9}, int64_t{10}, int64_t{2000}}) {
    SCOPED_TRACE(tracker);
    GradScaler s({.init_scale = 8, .growth_interval = 10});
    NamedTensors state = s.StateDict();
    ASSERT_EQ(state[1].first, "scaler.growth_tracker");
    state[1].second = FromVectorOf<int64_t>({tracker}, {});
    s.LoadStateDict(state);
    Tensor w = Zeros({1});
    Sgd opt({{"w", w}}, {});
    w.set_grad(Zeros({1}));
    EXPECT_TRUE(s.Step(opt));
    s.Update();
    EXPECT_EQ(s.scale(), 16.0);
    EXPECT_EQ(s.growth_tracker(), 0);
  }
  GradScaler s({.init_scale = 8, .growth_interval = 10});
  NamedTensors state = s.StateDict();
  state[1].second = FromVectorOf<int64_t>({-1}, {});
  state[0].second = FromVector({4.0}, {}, {.dtype = DType::kFloat32});
  const std::string err = ErrorOf([&] { s.LoadStateDict(state); });
  EXPECT_THAT(err, HasSubstr("scaler.growth_tracker -1 must be at least 0"));
  EXPECT_EQ(err, ErrorOf([&] { s.CheckStateDict(state); }));
  EXPECT_EQ(s.scale(), 8.0);
}

// No gradient at all (backward never ran): Step and Unscale refuse, naming
// a parameter, instead of stepping as if nothing were inf.
TEST(GradScaler, NoGradientsIsAnError) {
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {});
  GradScaler s;
  for (int fused = 0; fused < 2; ++fused) {
    try {
      fused ? s.Step(opt) : (s.Unscale(opt), true);
      ADD_FAILURE() << "no error";
    } catch (const std::logic_error& e) {
      EXPECT_THAT(e.what(), HasSubstr("no parameter of the optimizer has a gradient (its first is `w`)"));
    }
  }
}

TEST(LrScheduler, StepDecayAndStateErrors) {
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = 1.0});
  LrScheduler s(opt, StepSchedule(2, 0.5));
  std::vector<double> lrs = {opt.lr()};
  for (int i = 0; i < 5; ++i) {
    s.Step();
    lrs.push_back(opt.lr());
  }
  EXPECT_EQ(lrs, (std::vector<double>{1, 1, 0.5, 0.5, 0.25, 0.25}));
  EXPECT_THROW(s.LoadStateDict({}), std::invalid_argument);
  EXPECT_THROW(StepSchedule(0), std::invalid_argument);
  EXPECT_THROW(WarmupCosineSchedule(10, 5), std::invalid_argument);
}

// A state entry of the wrong dtype or shape is named with what was found.
// Before, the message said "missing" for a key that was there.
TEST(LrScheduler, MalformedStateEntrySaysWhatItHolds) {
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = 1.0});
  LrScheduler s(opt, StepSchedule(2, 0.5));
  NamedTensors state = s.StateDict();
  ASSERT_EQ(state[1].first, "scheduler.base_lr");
  state[1].second = FromVector({1.0, 2.0}, {2}, {.dtype = DType::kFloat32});
  EXPECT_EQ(ErrorOf([&] { s.LoadStateDict(state); }),
            "LrScheduler.LoadStateDict: `scheduler.base_lr` is f32 [2], expected an f64 scalar");
  state[1].second = Tensor();
  EXPECT_EQ(ErrorOf([&] { s.LoadStateDict(state); }),
            "LrScheduler.LoadStateDict: `scheduler.base_lr` is undefined, expected an f64 scalar");
  state.erase(state.begin() + 1);
  EXPECT_EQ(ErrorOf([&] { s.LoadStateDict(state); }), "LrScheduler.LoadStateDict: missing f64 scalar `scheduler.base_lr`");
  state = s.StateDict();
  ASSERT_EQ(state[0].first, "scheduler.step");
  state[0].second = FromVector({3.0}, {}, {.dtype = DType::kFloat64});
  EXPECT_EQ(ErrorOf([&] { s.CheckStateDict(state); }),
            "LrScheduler.LoadStateDict: `scheduler.step` is f64 [], expected an i64 scalar");
}

// The scaler's, likewise; and the clip's norm_type and SGD's nesterov
// options are refused with their values. Before, neither gave them.
TEST(GradScaler, MalformedStateEntrySaysWhatItHolds) {
  GradScaler s;
  NamedTensors state = s.StateDict();
  state[0].second = FromVector({8.0}, {}, {.dtype = DType::kFloat64});
  EXPECT_EQ(ErrorOf([&] { s.LoadStateDict(state); }),
            "GradScaler.LoadStateDict: `scaler.scale` is f64 [], expected an f32 scalar");
  state = s.StateDict();
  state[1].second = FromVectorOf<int64_t>({1, 2}, {2});
  EXPECT_EQ(ErrorOf([&] { s.CheckStateDict(state); }),
            "GradScaler.LoadStateDict: `scaler.growth_tracker` is i64 [2], expected an i64 scalar");
  EXPECT_EQ(ErrorOf([] { GradScaler().LoadStateDict({}); }), "GradScaler.LoadStateDict: missing f32 scalar `scaler.scale`");
  Tensor a = Zeros({2});
  a.set_grad(FromVector({3, 4}, {2}));
  EXPECT_EQ(ErrorOf([&] { ClipGradNorm({a}, 1.0, -1.0); }), "ClipGradNorm: norm_type must be > 0, got -1");
  EXPECT_EQ(ErrorOf([] { Sgd({{"a", Zeros({2})}}, {.momentum = 0.9, .dampening = 0.5, .nesterov = true}); }),
            "SGD: dampening 0.5 must be 0 with nesterov");
}

// A scalar entry is 0-d, as StateDict writes it and as PyTorch keeps its
// step: a one-element tensor of another shape ([1], [1, 1]) is not one and
// is refused with its shape. Before, any one-element tensor was taken.
TEST(OptimizerState, AOneElementTensorIsNotAScalarEntry) {
  GradScaler scaler;
  NamedTensors state = scaler.StateDict();
  ASSERT_EQ(state[0].first, "scaler.scale");
  state[0].second = FromVector({8.0}, {1}, {.dtype = DType::kFloat32});
  EXPECT_EQ(ErrorOf([&] { scaler.LoadStateDict(state); }),
            "GradScaler.LoadStateDict: `scaler.scale` is f32 [1], expected an f32 scalar");
  state = scaler.StateDict();
  ASSERT_EQ(state[1].first, "scaler.growth_tracker");
  state[1].second = FromVectorOf<int64_t>({1}, {1, 1});
  EXPECT_EQ(ErrorOf([&] { scaler.CheckStateDict(state); }),
            "GradScaler.LoadStateDict: `scaler.growth_tracker` is i64 [1, 1], expected an i64 scalar");

  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = 1.0});
  {
    LrScheduler s(opt, StepSchedule(2, 0.5));
    state = s.StateDict();
    ASSERT_EQ(state[0].first, "scheduler.step");
    state[0].second = FromVectorOf<int64_t>({1}, {1});
    EXPECT_EQ(ErrorOf([&] { s.LoadStateDict(state); }),
              "LrScheduler.LoadStateDict: `scheduler.step` is i64 [1], expected an i64 scalar");
    state = s.StateDict();
    ASSERT_EQ(state[1].first, "scheduler.base_lr");
    state[1].second = FromVector({1.0}, {1}, {.dtype = DType::kFloat64});
    EXPECT_EQ(ErrorOf([&] { s.LoadStateDict(state); }),
              "LrScheduler.LoadStateDict: `scheduler.base_lr` is f64 [1], expected an f64 scalar");
  }
  ReduceLrOnPlateau plateau(opt, {.patience = 1});
  state = plateau.StateDict();
  ASSERT_EQ(state[0].first, "plateau.best");
  state[0].second = FromVector({1.0}, {1, 1}, {.dtype = DType::kFloat64});
  EXPECT_EQ(ErrorOf([&] { plateau.LoadStateDict(state); }),
            "ReduceLROnPlateau.LoadStateDict: `plateau.best` is f64 [1, 1], expected an f64 scalar");
}

TEST(LrScheduler, CheckStateDictThrowsAsLoadStateDictAndChangesNothing) {
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = 1.0});
  LrScheduler s(opt, StepSchedule(1, 0.5));
  s.Step();
  const NamedTensors saved = s.StateDict();
  NamedTensors bad = saved;
  bad[0].second = FromVectorOf<int64_t>({-1}, {});
  const std::string checked = ErrorOf([&] { s.CheckStateDict(bad); });
  EXPECT_THAT(checked, HasSubstr("scheduler.step -1 < 0"));
  EXPECT_EQ(checked, ErrorOf([&] { s.LoadStateDict(bad); }));
  EXPECT_THAT(ErrorOf([&] { s.CheckStateDict({}); }), HasSubstr("`scheduler.step`"));
  Sgd other({{"w", w}}, {.lr = 1.0});
  LrScheduler fresh(other, StepSchedule(1, 0.5));
  EXPECT_EQ(ErrorOf([&] { fresh.CheckStateDict(saved); }), "");
  EXPECT_EQ(fresh.step_count(), 0);
  EXPECT_EQ(other.lr(), 1.0);  // loading would set 0.5
}

// A negative or non-finite base_lr is refused before anything changes.
// Before, the step and base_lr were assigned first and the optimizer's
// set_lr threw after (a negative or NaN rate), leaving them changed; an
// infinite one loaded.
TEST(LrScheduler, BaseLrMustBeFiniteAndNonNegative) {
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = 1.0});
  LrScheduler s(opt, StepSchedule(1, 0.5));
  s.Step();
  for (double base : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(base);
    const NamedTensors bad = {{"scheduler.step", FromVectorOf<int64_t>({3}, {})},
                              {"scheduler.base_lr", FromVector({base}, {}, {.dtype = DType::kFloat64})}};
    const std::string err = ErrorOf([&] { s.LoadStateDict(bad); });
    EXPECT_THAT(err, AllOf(HasSubstr("LrScheduler.LoadStateDict: scheduler.base_lr "),
                           HasSubstr(" must be finite and >= 0")));
    EXPECT_EQ(err, ErrorOf([&] { s.CheckStateDict(bad); }));
    EXPECT_EQ(s.step_count(), 1);
    EXPECT_EQ(s.base_lr(), 1.0);
    EXPECT_EQ(opt.lr(), 0.5);
  }
}

// A schedule of its own that gives a rate the optimizer refuses at odd steps
// (the library's schedules refuse parameters that would).
class NegativeAtOddSteps : public Schedule {
 public:
  double Lr(double base, int64_t t) const override { return t % 2 == 1 ? -base / 2 : base; }
};

// A rate the target refuses leaves the scheduler as it was, from
// LoadStateDict and from Step. Before, Step counted the step first, so a
// refused rate left step_count advanced.
TEST(LrScheduler, RateTheTargetRefusesChangesNothing) {
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = 1.0});
  LrScheduler s(opt, std::make_shared<NegativeAtOddSteps>());
  const NamedTensors odd_step = {{"scheduler.step", FromVectorOf<int64_t>({1}, {})},
                                 {"scheduler.base_lr", FromVector({2.0}, {}, {.dtype = DType::kFloat64})}};
  // Refused by the state's checks, so that CheckStateDict (RestoreCheckpoint's
  // look before it loads anything) refuses it too, naming step and base_lr.
  const std::string refused =
      "the schedule gives learning rate -1 at scheduler.step 1 from scheduler.base_lr 2";
  EXPECT_THAT(ErrorOf([&] { s.CheckStateDict(odd_step); }), HasSubstr(refused));
  EXPECT_THAT(ErrorOf([&] { s.LoadStateDict(odd_step); }), HasSubstr(refused));
  EXPECT_EQ(s.step_count(), 0);
  EXPECT_EQ(s.base_lr(), 1.0);
  EXPECT_EQ(opt.lr(), 1.0);
  EXPECT_THAT(ErrorOf([&] { s.Step(); }), HasSubstr("learning rate -0.5 must be finite and >= 0"));
  EXPECT_EQ(s.step_count(), 0);
  EXPECT_EQ(opt.lr(), 1.0);
}

// Schedule parameters that would give rates the optimizer refuses (negative,
// NaN or infinite) are refused when the schedule is made, naming the
// parameter and its value. Before, StepLR's gamma and CosineAnnealingLR's
// eta_min were taken, and the optimizer refused a rate steps later.
TEST(LrScheduler, ScheduleParametersAreCheckedAtConstruction) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(ErrorOf([] { StepSchedule(2, -0.5); }), "StepLR: gamma -0.5 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([] { CosineSchedule(10, -0.1); }),
            "CosineAnnealingLR: eta_min -0.1 must be finite and >= 0");
  for (double bad : {std::nan(""), inf}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(ErrorOf([&] { StepSchedule(2, bad); }), HasSubstr("StepLR: gamma "));
    EXPECT_THAT(ErrorOf([&] { CosineSchedule(10, bad); }), HasSubstr("CosineAnnealingLR: eta_min "));
    EXPECT_THAT(ErrorOf([&] { WarmupCosineSchedule(2, 10, 0.1, bad); }),
                HasSubstr("WarmupCosineSchedule: eta_min "));
    EXPECT_THAT(ErrorOf([&] { LinearSchedule(bad, 1.0, 5); }), HasSubstr("LinearLR: start_factor "));
    EXPECT_THAT(ErrorOf([&] { LinearSchedule(0.5, bad, 5); }), HasSubstr("LinearLR: end_factor "));
  }
  // Only the factor out of range is named: the message quoted both, as if
  // the valid one were wrong too.
  EXPECT_EQ(ErrorOf([] { LinearSchedule(1.5, 0.5, 5); }), "LinearLR: start_factor 1.5 must be in (0, 1]");
  EXPECT_EQ(ErrorOf([] { LinearSchedule(0.0, 0.5, 5); }), "LinearLR: start_factor 0 must be in (0, 1]");
  EXPECT_EQ(ErrorOf([] { LinearSchedule(0.5, -0.25, 5); }), "LinearLR: end_factor -0.25 must be in [0, 1]");
  EXPECT_EQ(ErrorOf([] { LinearSchedule(0.5, 2.0, 5); }), "LinearLR: end_factor 2 must be in [0, 1]");
  EXPECT_EQ(ErrorOf([] { LinearSchedule(0.5, 1.0, 0); }), "LinearLR: total_iters 0 must be >= 1");
  EXPECT_EQ(ErrorOf([] { SequentialSchedule({StepSchedule(1), StepSchedule(1), StepSchedule(1)}, {5, 3}); }),
            "SequentialLR: milestones must be ascending and >= 0, milestone 1 is 3 after 5");
  // The edges stay allowed: a rate that drops to 0, and eta_min 0.
  EXPECT_EQ(ErrorOf([] { StepSchedule(1, 0.0); }), "");
  EXPECT_EQ(ErrorOf([] { StepSchedule(1, 2.0); }), "");
  EXPECT_EQ(ErrorOf([] { CosineSchedule(1, 0.0); }), "");
}

// No schedules: a message of its own. Before, it printed size() - 1
// underflowed ("0 schedules need 18446744073709551615 milestones").
// WarmupCosineSchedule's refusals name it, not the LinearLR and
// CosineAnnealingLR it is made of (which the caller never named). Before,
// a bad start_factor was reported as LinearLR's.
TEST(LrScheduler, WarmupCosineRefusalsNameIt) {
  EXPECT_EQ(ErrorOf([] { WarmupCosineSchedule(2, 10, 0.0); }),
            "WarmupCosineSchedule: start_factor 0 must be in (0, 1]");
  EXPECT_EQ(ErrorOf([] { WarmupCosineSchedule(2, 10, 1.5); }),
            "WarmupCosineSchedule: start_factor 1.5 must be in (0, 1]");
  EXPECT_EQ(ErrorOf([] { WarmupCosineSchedule(2, 10, std::nan("")); }),
            "WarmupCosineSchedule: start_factor nan must be in (0, 1]");
  EXPECT_EQ(ErrorOf([] { WarmupCosineSchedule(2, 10, 0.1, -0.5); }),
            "WarmupCosineSchedule: eta_min -0.5 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([] { WarmupCosineSchedule(0, 10); }),
            "WarmupCosineSchedule: need 1 <= warmup_steps (0) < total_steps (10)");
  EXPECT_EQ(ErrorOf([] { WarmupCosineSchedule(5, 5); }),
            "WarmupCosineSchedule: need 1 <= warmup_steps (5) < total_steps (5)");
}

// A null schedule among several is named by its position. Before, the
// message said only that one was.
TEST(LrScheduler, ANullScheduleInASequenceIsNamedByItsIndex) {
  EXPECT_EQ(ErrorOf([] { SequentialSchedule({StepSchedule(2), nullptr, StepSchedule(3)}, {4, 8}); }),
            "SequentialLR: schedule 1 of 3 is null");
}

TEST(LrScheduler, SequentialScheduleWithoutSchedulesSaysSo) {
  const std::string err = ErrorOf([] { SequentialSchedule({}, {}); });
  EXPECT_EQ(err, "SequentialLR: got no schedules (and 0 milestones), need at least one");
  EXPECT_THAT(ErrorOf([] { SequentialSchedule({StepSchedule(1)}, {5}); }),
              HasSubstr("1 schedules need 0 milestones, got 1"));
}

// Refused values are shown as given, in the shortest text that reads back
// as the same double. std::to_string's six decimals showed -1e-7 as
// "-0.000000" and 1e-9 as "0.000000", hiding the value that was wrong.
TEST(GradScaler, RefusedValuesInClippingScalingAndSchedulesAreShownAsGiven) {
  Tensor a = Zeros({2});
  a.set_grad(FromVector({3, 4}, {2}));
  EXPECT_EQ(ErrorOf([&] { ClipGradNorm({a}, -1e-7); }), "ClipGradNorm: max_norm must be >= 0, got -1e-07");
  EXPECT_EQ(ErrorOf([&] { ClipGradNorm({a}, 1.0, -2.5e-8); }), "ClipGradNorm: norm_type must be > 0, got -2.5e-08");
  EXPECT_EQ(ErrorOf([&] { ClipGradValue({a}, -1e-9); }), "ClipGradValue: clip_value must be >= 0, got -1e-09");
  EXPECT_EQ(ErrorOf([] { GradScaler({.init_scale = -1e-7}); }),
            "GradScaler: init_scale -1e-07 must be > 0 and finite in f32");
  EXPECT_EQ(ErrorOf([] { GradScaler({.backoff_factor = 1e-9 - 1}); }),
            "GradScaler: backoff_factor -0.999999999 must be in (0, 1)");
  NamedTensors scaler_state = GradScaler().StateDict();
  for (auto& [k, t] : scaler_state) {
    if (k == "scaler.growth_factor") t = FromVector({1e-7}, {}, {.dtype = DType::kFloat64});
  }
  EXPECT_THAT(ErrorOf([&] { GradScaler().LoadStateDict(scaler_state); }),
              HasSubstr("scaler.growth_factor 1e-07 must be finite and > 1"));
  EXPECT_EQ(ErrorOf([] { StepSchedule(2, -1e-7); }), "StepLR: gamma -1e-07 must be finite and >= 0");
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = 1.0});
  LrScheduler s(opt, StepSchedule(1, 0.5));
  const NamedTensors tiny = {{"scheduler.step", FromVectorOf<int64_t>({1}, {})},
                             {"scheduler.base_lr", FromVector({-1e-7}, {}, {.dtype = DType::kFloat64})}};
  EXPECT_THAT(ErrorOf([&] { s.LoadStateDict(tiny); }), HasSubstr("scheduler.base_lr -1e-07 must be finite and >= 0"));
}

TEST(GradScaler, CheckStateDictThrowsAsLoadStateDictAndChangesNothing) {
  GradScaler s({.init_scale = 8});
  NamedTensors bad = s.StateDict();
  bad[0].second = FromVector({0.0}, {}, {.dtype = DType::kFloat32});
  const std::string checked = ErrorOf([&] { s.CheckStateDict(bad); });
  EXPECT_THAT(checked, HasSubstr("scaler.scale 0 must be finite and > 0"));
  EXPECT_EQ(checked, ErrorOf([&] { s.LoadStateDict(bad); }));
  GradScaler other({.init_scale = 2});
  EXPECT_EQ(ErrorOf([&] { s.CheckStateDict(other.StateDict()); }), "");
  EXPECT_EQ(s.scale(), 8.0);
}

// A target other than one optimizer: a rate several optimizers share.
TEST(LrScheduler, DrivesASharedRateThroughATarget) {
  Tensor a = Zeros({1}), b = Zeros({1});
  Sgd first({{"a", a}}, {.lr = 2.0});
  Sgd second({{"b", b}}, {.lr = 2.0});
  double shared = 2.0;
  LrTarget target{[&] { return shared; }, [&](double lr) {
                    shared = lr;
                    first.set_lr(lr);
                    second.set_lr(lr);
                  }};
  LrScheduler s(target, StepSchedule(1, 0.5));
  s.Step();
  s.Step();
  EXPECT_EQ(s.lr(), 0.5);
  EXPECT_EQ(first.lr(), 0.5);
  EXPECT_EQ(second.lr(), 0.5);
  EXPECT_EQ(s.base_lr(), 2.0);
  // Restored at step 1: the rate follows.
  LrScheduler restored(target, StepSchedule(1, 0.5));
  restored.LoadStateDict({{"scheduler.step", FromVectorOf<int64_t>({1}, {})},
                          {"scheduler.base_lr", FromVector({2.0}, {}, {.dtype = DType::kFloat64})}});
  EXPECT_EQ(second.lr(), 1.0);
  EXPECT_THROW(LrScheduler(LrTarget{}, StepSchedule(1)), std::invalid_argument);
}

// The default cosine tail is PyTorch's (periodic, pinned by the golden
// test); kHold keeps eta_min from the end on: at the boundary step, the step
// after it, and steps where the periodic form is back at base_lr.
TEST(LrScheduler, CosineHoldStaysAtEtaMinPastTheEnd) {
  const double base = 0.1, eta_min = 0.001;
  auto periodic = CosineSchedule(10, eta_min);
  auto hold = CosineSchedule(10, eta_min, CosineTail::kHold);
  for (int64_t t = 0; t < 10; ++t) EXPECT_EQ(hold->Lr(base, t), periodic->Lr(base, t)) << "t=" << t;
  EXPECT_NEAR(periodic->Lr(base, 10), eta_min, 1e-15);
  EXPECT_GT(periodic->Lr(base, 11), eta_min + 1e-3);
  EXPECT_NEAR(periodic->Lr(base, 20), base, 1e-15);
  for (int64_t t : {10, 11, 15, 20, 35, 1000003}) EXPECT_EQ(hold->Lr(base, t), eta_min) << "t=" << t;

  auto warm_periodic = WarmupCosineSchedule(5, 20, 0.1, eta_min);
  auto warm_hold = WarmupCosineSchedule(5, 20, 0.1, eta_min, CosineTail::kHold);
  for (int64_t t = 0; t < 20; ++t) EXPECT_EQ(warm_hold->Lr(base, t), warm_periodic->Lr(base, t)) << "t=" << t;
  EXPECT_GT(warm_periodic->Lr(base, 21), eta_min + 1e-4);
  for (int64_t t : {20, 21, 35, 100}) EXPECT_EQ(warm_hold->Lr(base, t), eta_min) << "t=" << t;

  // Driven step by step through an optimizer, the rate never rises after it
  // reached eta_min.
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = base});
  LrScheduler s(opt, WarmupCosineSchedule(2, 6, 0.5, eta_min, CosineTail::kHold));
  for (int i = 0; i < 6; ++i) s.Step();
  EXPECT_EQ(opt.lr(), eta_min);
  for (int i = 0; i < 20; ++i) {
    s.Step();
    ASSERT_EQ(opt.lr(), eta_min) << "step " << s.step_count();
  }
}

// A checkpoint taken past the end of a held schedule restores the step count
// and eta_min, and further steps stay there.
TEST(LrScheduler, CosineHoldStateRoundTripsPastTheEnd) {
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = 0.2});
  LrScheduler s(opt, CosineSchedule(4, 0.01, CosineTail::kHold));
  for (int i = 0; i < 9; ++i) s.Step();
  const NamedTensors state = s.StateDict();

  Tensor w2 = Zeros({1});
  Sgd opt2({{"w", w2}}, {.lr = 0.2});
  LrScheduler restored(opt2, CosineSchedule(4, 0.01, CosineTail::kHold));
  EXPECT_EQ(opt2.lr(), 0.2);
  restored.LoadStateDict(state);
  EXPECT_EQ(restored.step_count(), 9);
  EXPECT_EQ(restored.base_lr(), 0.2);
  EXPECT_EQ(opt2.lr(), 0.01);
  restored.Step();
  EXPECT_EQ(opt2.lr(), 0.01);
  // A periodic schedule refuses it: the tail is part of the schedule, and
  // the rate would jump from eta_min. A state saved before schedules were
  // described loads, with the periodic rate at step 9.
  Tensor w3 = Zeros({1});
  Sgd opt3({{"w", w3}}, {.lr = 0.2});
  LrScheduler periodic(opt3, CosineSchedule(4, 0.01));
  EXPECT_THAT(ErrorOf([&] { periodic.LoadStateDict(state); }),
              AllOf(HasSubstr("saved with schedule CosineAnnealingLR(T_max=4, eta_min=0.01, tail=hold)"),
                    HasSubstr("this scheduler's is CosineAnnealingLR(T_max=4, eta_min=0.01, tail=periodic)")));
  EXPECT_EQ(periodic.step_count(), 0);
  NamedTensors undescribed = state;
  ASSERT_EQ(undescribed.back().first, "scheduler.schedule");
  undescribed.pop_back();
  periodic.LoadStateDict(undescribed);
  EXPECT_NEAR(opt3.lr(), CosineSchedule(4, 0.01)->Lr(0.2, 9), 1e-15);
  EXPECT_GT(opt3.lr(), 0.01 + 1e-3);
}

// Before, a second scheduler of one optimizer was accepted, and the two
// overwrote each other's rate at every step (the last to step won).
TEST(LrScheduler, SecondSchedulerOfAnOptimizerIsRefused) {
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = 1.0});
  auto first = std::make_unique<LrScheduler>(opt, LinearSchedule(0.5, 1.0, 4));
  EXPECT_EQ(opt.lr(), 0.5);
  EXPECT_THAT(ErrorOf([&] { LrScheduler second(opt, StepSchedule(1, 0.1)); }),
              AllOf(HasSubstr("LrScheduler: this SGD optimizer already has a scheduler"),
                    HasSubstr("SequentialSchedule")));
  EXPECT_EQ(opt.lr(), 0.5) << "the refused scheduler set the rate";
  first->Step();
  EXPECT_EQ(opt.lr(), 0.625);
  {
    // Moved, the scheduler still holds the optimizer.
    LrScheduler moved = std::move(*first);
    first.reset();
    EXPECT_THAT(ErrorOf([&] { LrScheduler second(opt, StepSchedule(1, 0.1)); }),
                HasSubstr("already has a scheduler"));
    moved.Step();
    EXPECT_EQ(opt.lr(), 0.75);
  }
  // Once it is gone, another may take over, from the rate it left.
  LrScheduler next(opt, StepSchedule(1, 0.5));
  EXPECT_EQ(next.base_lr(), 0.75);
  // A scheduler whose first rate the optimizer refuses leaves it free.
  Tensor v = Zeros({1});
  Sgd other({{"v", v}}, {.lr = 1.0});
  class Negative : public Schedule {
   public:
    double Lr(double, int64_t) const override { return -1.0; }
  };
  EXPECT_THROW(LrScheduler(other, std::make_shared<Negative>()), std::invalid_argument);
  LrScheduler after_refusal(other, StepSchedule(1, 0.5));
  EXPECT_EQ(other.lr(), 1.0);
}

// Before, the state held only the step count and base_lr: loaded into a
// scheduler with another schedule, it was taken silently and the rate
// jumped to the other schedule's value at that step. The schedule's
// description is saved now and compared; a state without one (saved
// before, or by a schedule that does not describe itself) still loads.
TEST(LrScheduler, StateOfAnotherScheduleIsRefusedNamingBoth) {
  Tensor w = Zeros({1});
  Sgd opt({{"w", w}}, {.lr = 0.1});
  LrScheduler s(opt, CosineSchedule(100));
  for (int i = 0; i < 10; ++i) s.Step();
  const NamedTensors saved = s.StateDict();
  ASSERT_EQ(saved.size(), 3u);
  EXPECT_EQ(saved[2].first, "scheduler.schedule");

  Tensor w2 = Zeros({1});
  Sgd opt2({{"w", w2}}, {.lr = 0.1});
  LrScheduler longer(opt2, CosineSchedule(200));
  const std::string err = ErrorOf([&] { longer.LoadStateDict(saved); });
  EXPECT_EQ(err,
            "LrScheduler.LoadStateDict: the state was saved with schedule "
            "CosineAnnealingLR(T_max=100, eta_min=0, tail=periodic), this scheduler's is "
            "CosineAnnealingLR(T_max=200, eta_min=0, tail=periodic) (its step count would give another "
            "rate): make the scheduler with the saved schedule");
  EXPECT_EQ(ErrorOf([&] { longer.CheckStateDict(saved); }), err);
  EXPECT_EQ(longer.step_count(), 0);
  EXPECT_EQ(opt2.lr(), 0.1);

  // The old format: no description, taken as from an unknown schedule.
  NamedTensors old_format = saved;
  old_format.pop_back();
  longer.LoadStateDict(old_format);
  EXPECT_EQ(longer.step_count(), 10);
  EXPECT_EQ(opt2.lr(), CosineSchedule(200)->Lr(0.1, 10));

  // The same schedule loads.
  Tensor w3 = Zeros({1});
  Sgd opt3({{"w", w3}}, {.lr = 0.1});
  LrScheduler same(opt3, CosineSchedule(100));
  same.LoadStateDict(saved);
  EXPECT_EQ(same.step_count(), 10);
  EXPECT_EQ(opt3.lr(), opt.lr());

  // Every parameter is part of the description, composites' parts too.
  EXPECT_EQ(StepSchedule(2, 0.5)->Describe(), "StepLR(step_size=2, gamma=0.5)");
  EXPECT_EQ(WarmupCosineSchedule(5, 20, 0.1, 0.001, CosineTail::kHold)->Describe(),
            "SequentialLR([LinearLR(start_factor=0.1, end_factor=1, total_iters=5), "
            "CosineAnnealingLR(T_max=15, eta_min=0.001, tail=hold)], milestones=[5])");
  EXPECT_NE(WarmupCosineSchedule(5, 20)->Describe(), WarmupCosineSchedule(5, 21)->Describe());
  EXPECT_NE(StepSchedule(2, 0.1)->Describe(), StepSchedule(2, 0.1 + 1e-17 * 8)->Describe());

  // A schedule that does not describe itself saves none and compares none.
  class Constant : public Schedule {
   public:
    double Lr(double base, int64_t) const override { return base; }
  };
  Tensor w4 = Zeros({1});
  Sgd opt4({{"w", w4}}, {.lr = 0.1});
  LrScheduler constant(opt4, std::make_shared<Constant>());
  EXPECT_EQ(constant.StateDict().size(), 2u);
  constant.LoadStateDict(saved);
  EXPECT_EQ(constant.step_count(), 10);
  EXPECT_EQ(SequentialSchedule({CosineSchedule(4), std::make_shared<Constant>()}, {4})->Describe(), "");

  // A malformed description is named with what it holds.
  NamedTensors bad = saved;
  bad[2].second = Zeros({2});
  EXPECT_EQ(ErrorOf([&] { same.LoadStateDict(bad); }),
            "LrScheduler.LoadStateDict: `scheduler.schedule` is f32 [2], expected u8 text");
}

// ---- Parameter groups ----

// MakeParams split in two groups: the weight with the defaults, the bias
// with its own rate, weight decay and momentum.
std::vector<ParamGroup> TwoGroups(const NamedParameters& p, std::map<std::string, double> second = {
                                                                 {"lr", 0.01}, {"weight_decay", 0.0}, {"momentum", 0.5}}) {
  return {{.params = {p[0]}}, {.params = {p[1]}, .options = std::move(second)}};
}

// Throws std::invalid_argument whose message contains every part.
template <typename F>
void ExpectRefused(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "not refused";
  } catch (const std::invalid_argument& e) {
    for (const std::string& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
  }
}

TEST(ParamGroups, GroupsTakeTheirOwnOptionsOverTheDefaults) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd opt(TwoGroups(p), {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3});
  ASSERT_EQ(opt.num_groups(), 2u);
  EXPECT_EQ(opt.params().size(), 2u);
  EXPECT_EQ(opt.group_of(0), 0u);
  EXPECT_EQ(opt.group_of(1), 1u);
  EXPECT_EQ(opt.group_params(1).front().first, "fc.bias");
  EXPECT_EQ(opt.lr(), 0.1);
  EXPECT_EQ(opt.lr(0), 0.1);
  EXPECT_EQ(opt.lr(1), 0.01);
  EXPECT_EQ(opt.options(0).momentum, 0.9);
  EXPECT_EQ(opt.options(0).weight_decay, 1e-3);
  EXPECT_EQ(opt.options(1).momentum, 0.5);
  EXPECT_EQ(opt.options(1).weight_decay, 0.0);
  EXPECT_EQ(opt.options(1).lr, 0.01);

  // Each group's update is its own optimizer's: the same as two optimizers
  // over one parameter each, bit for bit.
  NamedParameters q = MakeParams(DType::kFloat32, 1);
  Sgd weight({q[0]}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3});
  Sgd bias({q[1]}, {.lr = 0.01, .momentum = 0.5, .weight_decay = 0.0});
  for (int s = 0; s < 4; ++s) {
    SetGrads(p, s);
    SetGrads(q, s);
    opt.Step();
    weight.Step();
    bias.Step();
  }
  EXPECT_EQ(Bytes(p), Bytes(q));
}

TEST(ParamGroups, EmptyGroupsAreAllowed) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Adam opt({{.params = {}}, {.params = p, .options = {{"lr", 0.5}}}, {.params = {}}}, {});
  EXPECT_EQ(opt.num_groups(), 3u);
  EXPECT_EQ(opt.group_of(0), 1u);
  EXPECT_TRUE(opt.group_params(0).empty());
  SetGrads(p, 0);
  opt.Step();
  Adam loaded({{.params = {}}, {.params = MakeParams(DType::kFloat32, 2)}, {.params = {}}}, {});
  loaded.LoadStateDict(opt.StateDict());
  EXPECT_EQ(loaded.lr(1), 0.5);
}

TEST(ParamGroups, UnknownOptionIsRefusedNamingTheGroupAndTheKnownNames) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  ExpectRefused([&] { Sgd(TwoGroups(p, {{"betas", 0.9}}), {}); },
                {"SGD: param group 1: unknown option `betas`",
                 "known: lr, momentum, dampening, weight_decay, nesterov, maximize"});
  ExpectRefused([&] { Adam(TwoGroups(p, {{"momentum", 0.9}}), {}); },
                {"Adam: param group 1", "`momentum`", "beta1, beta2, eps, weight_decay, amsgrad, maximize"});
  ExpectRefused([&] { Adadelta(TwoGroups(p, {{"beta1", 0.9}}), {}); }, {"Adadelta: param group 1", "`beta1`"});
}

TEST(ParamGroups, BadValueIsRefusedNamingTheGroup) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  ExpectRefused([&] { Sgd(TwoGroups(p, {{"weight_decay", -1}}), {.momentum = 0.9}); },
                {"SGD: param group 1", "weight_decay"});
  ExpectRefused([&] { AdamW(TwoGroups(p, {{"beta2", 1.0}}), {}); }, {"AdamW: param group 1", "beta2"});
  ExpectRefused([&] { Adadelta(TwoGroups(p, {{"rho", 2.0}}), {}); }, {"Adadelta: param group 1", "rho"});
  ExpectRefused([&] { Sgd(TwoGroups(p, {{"lr", -0.1}}), {}); }, {"param group 1", "learning rate"});
  ExpectRefused([&] { Sgd(TwoGroups(p, {{"lr", std::nan("")}}), {}); }, {"param group 1", "learning rate"});
  ExpectRefused([&] { Sgd(TwoGroups(p, {{"maximize", 2}}), {}); }, {"param group 1", "`maximize`", "0 or 1"});
  // nesterov needs dampening 0, group by group.
  ExpectRefused([&] { Sgd(TwoGroups(p, {{"dampening", 0.5}}), {.momentum = 0.9, .nesterov = true}); },
                {"SGD: param group 1", "nesterov"});
}

// A value the optimizer's own check refuses is reported with the
// optimizer's name once: the group's prefix came on top of the check's,
// "AdamW: param group 1: AdamW: betas ...", as did set_momentum's and a
// loaded state's.
TEST(ParamGroups, ARefusedValueNamesTheOptimizerOnce) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  EXPECT_EQ(ErrorOf([&] { AdamW(TwoGroups(p, {{"beta2", 1.0}}), {}); }),
            "AdamW: param group 1: beta2 1 must be in [0, 1)");
  EXPECT_EQ(ErrorOf([&] { Sgd(TwoGroups(p, {{"weight_decay", -1}}), {}); }),
            "SGD: param group 1: weight_decay -1 must be finite and >= 0");
  Adadelta adadelta(TwoGroups(p, {}), {});
  EXPECT_EQ(ErrorOf([&] {
              adadelta.AddParamGroup({.params = {{"extra", Zeros({2})}}, .options = {{"rho", 2.0}}});
            }),
            "Adadelta: param group 2: rho 2 must be in [0, 1]");
  Adam adam(p, {});
  EXPECT_EQ(ErrorOf([&] { adam.set_momentum(0, 1.0); }),
            "Adam: param group 0's beta1 1 refused: beta1 1 must be in [0, 1)");
  NamedTensors bad = adam.StateDict();
  for (auto& [k, t] : bad) {
    if (k == "group.beta1") t = FromVector({1.5}, {}, {.dtype = DType::kFloat64});
  }
  EXPECT_THAT(ErrorOf([&] { adam.LoadStateDict(bad); }),
              AllOf(HasSubstr("the state's options are refused: beta1 1.5 must be in [0, 1)"),
                    Not(HasSubstr("Adam: beta1"))));
}

// A refused option names the optimizer and the one option at fault, with
// its value as given, and no other option. Before, a check listed every
// option it covered with its value ("SGD: momentum 0, dampening 0 and
// weight_decay -1 must be finite and >= 0", "Adam: betas (0.9, 1) ..."),
// leaving the reader to find the bad one, and a refused learning rate said
// "optimizer:" instead of which optimizer.
TEST(OptimizerOptions, ARefusalNamesTheOptimizerAndOnlyTheBadOption) {
  const NamedParameters p = {{"a", Zeros({2})}};
  const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::function<void()> make;
    std::string option;  // as the message names it
    std::string expected;
  };
  const Case cases[] = {
      {[&] { Sgd(p, {.lr = -1}); }, "learning rate", "SGD: learning rate -1 must be finite and >= 0"},
      {[&] { Sgd(p, {.momentum = nan}); }, "momentum", "SGD: momentum nan must be finite and >= 0"},
      {[&] { Sgd(p, {.momentum = 0.9, .dampening = nan}); }, "dampening", "SGD: dampening nan must be finite"},
      {[&] { Sgd(p, {.momentum = 0.9, .weight_decay = inf}); }, "weight_decay",
       "SGD: weight_decay inf must be finite and >= 0"},
      {[&] { Sgd(p, {.nesterov = true}); }, "momentum", "SGD: momentum 0 must be > 0 with nesterov"},
      {[&] { Sgd(p, {.momentum = 0.9, .dampening = 0.1, .nesterov = true}); }, "dampening",
       "SGD: dampening 0.1 must be 0 with nesterov"},
      {[&] { Adam(p, {.lr = nan}); }, "learning rate", "Adam: learning rate nan must be finite and >= 0"},
      {[&] { Adam(p, {.beta1 = 1}); }, "beta1", "Adam: beta1 1 must be in [0, 1)"},
      {[&] { Adam(p, {.beta2 = -1e-9}); }, "beta2", "Adam: beta2 -1e-09 must be in [0, 1)"},
      {[&] { Adam(p, {.eps = -1}); }, "eps", "Adam: eps -1 must be finite and >= 0"},
      {[&] { Adam(p, {.weight_decay = nan}); }, "weight_decay", "Adam: weight_decay nan must be finite and >= 0"},
      {[&] { AdamW(p, {.lr = -2}); }, "learning rate", "AdamW: learning rate -2 must be finite and >= 0"},
      {[&] { AdamW(p, {.beta1 = nan}); }, "beta1", "AdamW: beta1 nan must be in [0, 1)"},
      {[&] { AdamW(p, {.beta2 = 1.5}); }, "beta2", "AdamW: beta2 1.5 must be in [0, 1)"},
      {[&] { AdamW(p, {.eps = inf}); }, "eps", "AdamW: eps inf must be finite and >= 0"},
      {[&] { AdamW(p, {.weight_decay = -0.01}); }, "weight_decay",
       "AdamW: weight_decay -0.01 must be finite and >= 0"},
      {[&] { Adadelta(p, {.lr = inf}); }, "learning rate", "Adadelta: learning rate inf must be finite and >= 0"},
      {[&] { Adadelta(p, {.rho = 1.5}); }, "rho", "Adadelta: rho 1.5 must be in [0, 1]"},
      {[&] { Adadelta(p, {.eps = -1}); }, "eps", "Adadelta: eps -1 must be finite and >= 0"},
      {[&] { Adadelta(p, {.weight_decay = nan}); }, "weight_decay",
       "Adadelta: weight_decay nan must be finite and >= 0"},
  };
  const std::string options[] = {"learning rate", "momentum", "dampening", "weight_decay", "beta1", "beta2",
                                 "eps",           "rho"};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.expected);
    const std::string error = ErrorOf(c.make);
    EXPECT_EQ(error, c.expected);
    EXPECT_THAT(error, HasSubstr(c.option));
    for (const std::string& other : options) {
      if (other != c.option) {
        EXPECT_THAT(error, Not(HasSubstr(other)));
      }
    }
  }
}

// A refused learning rate names the optimizer, and the group when there
// are several, from the constructor and from set_lr alike; before, both
// said "optimizer:".
TEST(OptimizerOptions, ARefusedRateNamesTheOptimizerAndTheGroup) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  EXPECT_EQ(ErrorOf([&] { Sgd(TwoGroups(p, {{"lr", -0.1}}), {}); }),
            "SGD: param group 1: learning rate -0.1 must be finite and >= 0");
  EXPECT_EQ(ErrorOf([&] { AdamW(TwoGroups(p, {{"lr", std::nan("")}}), {}); }),
            "AdamW: param group 1: learning rate nan must be finite and >= 0");
  Adam adam(TwoGroups(p, {}), {.lr = 0.1});
  EXPECT_EQ(ErrorOf([&] { adam.set_lr(1, -1); }), "Adam: param group 1: learning rate -1 must be finite and >= 0");
  EXPECT_EQ(adam.lr(1), 0.1);
  Adadelta adadelta(p, {});
  EXPECT_EQ(ErrorOf([&] { adadelta.set_lr(-1e-7); }), "Adadelta: learning rate -1e-07 must be finite and >= 0");
  EXPECT_EQ(adadelta.lr(), 1.0);
}

// The base's own refusals name the optimizer too, from the constructor
// (which cannot call Name(): the subclass passes it) and after; they said
// "optimizer:", which of several optimizers in a program it was unknown.
TEST(OptimizerOptions, TheBasesRefusalsNameTheOptimizer) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  const Tensor w = Zeros({2});
  EXPECT_EQ(ErrorOf([] { Adadelta(std::vector<ParamGroup>{}, {}); }),
            "Adadelta: no parameter group (a plain list of parameters makes one; a group may be empty)");
  EXPECT_EQ(ErrorOf([&] { Adam({{"a", w}, {"a", Zeros({1})}}, {}); }), "Adam: parameter `a` is listed twice");
  EXPECT_EQ(ErrorOf([&] { AdamW(std::vector<ParamGroup>{{.params = {p[0]}}, {.params = {p[0]}}}, {}); }),
            "AdamW: parameter `" + p[0].first + "` is in param groups 0 and 1 (a parameter may be in one group only)");
  EXPECT_THAT(ErrorOf([&] { Sgd({{"a", w}, {"b", w}}, {}); }), HasSubstr("SGD: parameters `a` and `b` share memory"));
  Sgd sgd(TwoGroups(p, {}), {.lr = 0.1});
  auto what = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(what([&] { sgd.lr(2); }), "SGD: lr of param group 2, but there are 2");
  EXPECT_EQ(what([&] { sgd.set_lr(2, 0.1); }), "SGD: set_lr of param group 2, but there are 2");
  EXPECT_THAT(what([&] { sgd.set_lr(0.1); }), HasSubstr("SGD: set_lr(lr) with 2 param groups"));
  EXPECT_EQ(what([&] { sgd.group_params(3); }), "SGD: param group 3 of 2");
}

// Group options and loaded rates in refusals are shown as given, as the
// constructors' checks show theirs: std::to_string showed a flag of 1e-9 as
// "0.000000" (a value that looks allowed), a momentum of 1e-9 against 0 as
// "(0.000000 against 0.000000)" and a loaded rate of -1e-7 as "-0.000000".
TEST(ParamGroups, RefusedGroupAndStateValuesAreShownAsGiven) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  EXPECT_THAT(ErrorOf([&] { Sgd(TwoGroups(p, {{"maximize", 1e-9}}), {}); }),
              HasSubstr("SGD: param group 1: option `maximize` is a flag, 0 or 1, got 1e-09"));
  EXPECT_THAT(ErrorOf([&] { Sgd(TwoGroups(p, {{"momentum", 1e-9}}), {}); }),
              HasSubstr("SGD: param group 1: option `momentum` is zero or non-zero where the default's is not "
                        "(1e-09 against 0)"));
  Sgd one(p, {.lr = 0.1});
  NamedTensors state = one.StateDict();
  for (auto& [k, t] : state) {
    if (k == "lr") t = FromVector({-1e-7}, {}, {.dtype = DType::kFloat64});
  }
  EXPECT_THAT(ErrorOf([&] { one.LoadStateDict(state); }), HasSubstr("`lr` is -1e-07, expected finite and >= 0"));
  Sgd two(TwoGroups(p, {}), {.lr = 0.1});
  state = two.StateDict();
  for (auto& [k, t] : state) {
    if (k == "param_groups.1.lr") t = FromVector({-1e-7}, {}, {.dtype = DType::kFloat64});
  }
  EXPECT_THAT(ErrorOf([&] { two.LoadStateDict(state); }),
              HasSubstr("`param_groups.1.lr` is -1e-07, expected finite and >= 0"));
  EXPECT_EQ(two.lr(1), 0.1);
}

TEST(ParamGroups, StructuralOptionDifferingFromTheDefaultsIsRefused) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  ExpectRefused([&] { Sgd(TwoGroups(p, {{"momentum", 0}}), {.momentum = 0.9}); },
                {"SGD: param group 1", "`momentum`", "per-group state layouts are not supported"});
  ExpectRefused([&] { Sgd(TwoGroups(p, {{"momentum", 0.9}}), {}); }, {"param group 1", "`momentum`"});
  ExpectRefused([&] { Sgd(TwoGroups(p, {{"nesterov", 0}}), {.momentum = 0.9, .nesterov = true}); },
                {"param group 1", "`nesterov`", "per-group state layouts"});
  ExpectRefused([&] { Adam(TwoGroups(p, {{"amsgrad", 1}}), {}); }, {"Adam: param group 1", "`amsgrad`"});
  // Equal to the defaults, or another non-zero momentum: accepted.
  Sgd same(TwoGroups(p, {{"momentum", 0.5}, {"nesterov", 1}}), {.momentum = 0.9, .nesterov = true});
  EXPECT_EQ(same.options(1).momentum, 0.5);
}

TEST(ParamGroups, AParameterInTwoGroupsIsRefused) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  ExpectRefused([&] { Sgd({{.params = p}, {.params = {p[1]}}}, {}); },
                {"`fc.bias` is in param groups 0 and 1"});
  ExpectRefused([&] { Sgd({{.params = p}, {.params = {{"other", p[1].second}}}}, {}); },
                {"param groups 0 (as `fc.bias`) and 1 (as `other`)"});
  // Overlapping views across groups: CheckParameters over all groups.
  Tensor flat = Zeros({10});
  ExpectRefused([&] { Sgd({{.params = {{"a", flat.Slice(0, 0, 6)}}}, {.params = {{"b", flat.Slice(0, 4, 10)}}}}, {}); },
                {"share memory"});
  ExpectRefused([&] { Sgd(std::vector<ParamGroup>{}, {}); }, {"no parameter group"});
}

TEST(ParamGroups, SetLrWithOneRateIsRefusedWithSeveralGroups) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd opt(TwoGroups(p), {.lr = 0.1, .momentum = 0.9});
  try {
    opt.set_lr(0.5);
    ADD_FAILURE() << "not refused";
  } catch (const std::logic_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("2 param groups"), HasSubstr("set_lr(group, lr)")));
  }
  EXPECT_EQ(opt.lr(0), 0.1);
  EXPECT_EQ(opt.lr(1), 0.01);
  opt.set_lr(1, 0.02);
  EXPECT_EQ(opt.lr(1), 0.02);
  EXPECT_EQ(opt.lr(0), 0.1);
  EXPECT_THROW(opt.set_lr(1, -1.0), std::invalid_argument);
  EXPECT_THROW(opt.set_lr(2, 0.1), std::out_of_range);
  EXPECT_THROW(opt.lr(2), std::out_of_range);
  // One group: set_lr(lr) as ever.
  Sgd one(p, {.lr = 0.1});
  one.set_lr(0.5);
  EXPECT_EQ(one.lr(), 0.5);
  EXPECT_EQ(one.lr(0), 0.5);
}

TEST(ParamGroups, StateKeysWithSeveralGroups) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd opt(TwoGroups(p), {.lr = 0.1, .momentum = 0.9});
  std::vector<std::string> keys;
  const NamedTensors state = opt.StateDict();
  for (const auto& [k, t] : state) keys.push_back(k);
  const std::vector<std::string> group = {"lr",       "momentum", "dampening", "weight_decay",
                                          "nesterov", "maximize", "size",      "params"};
  std::vector<std::string> want = {"group.optimizer", "param_groups.count"};
  for (int k = 0; k < 2; ++k) {
    for (const std::string& name : group) want.push_back("param_groups." + std::to_string(k) + "." + name);
  }
  for (const char* k : {"group.params_listed", "state.fc.weight.step", "state.fc.bias.step"}) want.push_back(k);
  EXPECT_EQ(keys, want);
  auto value = [&](const std::string& key) {
    for (const auto& [k, t] : state) {
      if (k == key) return t;
    }
    return Tensor();
  };
  EXPECT_EQ(value("param_groups.count").dtype(), DType::kInt64);
  EXPECT_EQ(value("param_groups.count").ToVector<int64_t>(), std::vector<int64_t>{2});
  EXPECT_EQ(value("param_groups.1.lr").ToVector<double>(), std::vector<double>{0.01});
  EXPECT_EQ(value("param_groups.1.momentum").ToVector<double>(), std::vector<double>{0.5});
  EXPECT_EQ(value("param_groups.1.nesterov").dtype(), DType::kInt64);
  EXPECT_EQ(value("param_groups.0.size").ToVector<int64_t>(), std::vector<int64_t>{1});
  const std::vector<uint8_t> members = value("param_groups.1.params").ToVector<uint8_t>();
  EXPECT_EQ(std::string(members.begin(), members.end()), "fc.bias");
}

// Groups of the same sizes holding other parameters (built in another
// order) would give each group's options to the other's parameters.
TEST(ParamGroups, GroupsHoldingOtherParametersAreRefusedNamingTheFirst) {
  Tensor a = Ones({2}), b = Ones({3});
  Sgd saved({{.params = {{"a", a}}}, {.params = {{"b", b}}, .options = {{"weight_decay", 0.0}}}},
            {.lr = 0.1, .weight_decay = 0.01});
  Sgd swapped({{.params = {{"b", b}}, .options = {{"weight_decay", 0.0}}}, {.params = {{"a", a}}}},
              {.lr = 0.1, .weight_decay = 0.01});
  ExpectRefused([&] { swapped.LoadStateDict(saved.StateDict()); },
                {"param group 0 holds other parameters in the state: `a` where this optimizer has `b`",
                 "param group 1 holds other parameters in the state: `b` where this optimizer has `a`"});
  EXPECT_EQ(swapped.options(0).weight_decay, 0.0);
  // Missing or malformed member lists are named.
  NamedTensors state = saved.StateDict();
  for (auto& [k, t] : state) {
    if (k == "param_groups.1.params") t = Zeros({1});
  }
  std::erase_if(state, [](const auto& e) { return e.first == "param_groups.0.params"; });
  Sgd same({{.params = {{"a", a}}}, {.params = {{"b", b}}}}, {.lr = 0.1});
  ExpectRefused([&] { same.LoadStateDict(state); },
                {"missing `param_groups.0.params`", "`param_groups.1.params` is f32 [1], expected u8 text"});
  same.LoadStateDict(saved.StateDict());
  EXPECT_EQ(same.options(1).weight_decay, 0.0);
  EXPECT_EQ(same.options(0).weight_decay, 0.01);
}

// The saved member lists hold one name a line: a name with a newline would
// be split in two and the state would not load back into the optimizer that
// saved it, so such a name is refused when the optimizer is made or a group
// added, naming it. Before, both were taken.
TEST(ParamGroups, NameWithANewlineIsRefusedNamingIt) {
  Tensor a = Ones({2}), b = Ones({3}), c = Ones({1});
  ExpectRefused([&] { Sgd({{.params = {{"a", a}}}, {.params = {{"fc\nweight", b}}}}, {.lr = 0.1}); },
                {"parameter `fc\\nweight` has a newline in its name"});
  ExpectRefused([&] { Sgd({{"x\n", a}}, {.lr = 0.1}); }, {"parameter `x\\n` has a newline in its name"});
  Sgd opt({{"a", a}}, {.lr = 0.1});
  ExpectRefused([&] { opt.AddParamGroup({.params = {{"\nb", b}}}); },
                {"SGD.AddParamGroup: parameter `\\nb` has a newline in its name"});
  EXPECT_EQ(opt.num_groups(), 1u);
  opt.AddParamGroup({.params = {{"b", b}}});
  Sgd same({{.params = {{"a", a}}}, {.params = {{"b", b}}}}, {.lr = 0.1});
  same.LoadStateDict(opt.StateDict());
  // A member list longer than its group (and its size) is refused. It was
  // compared past the group's parameters: into the next group's (taken
  // here), or past the last parameter.
  Sgd three({{.params = {{"a", a}}}, {.params = {{"b", b}, {"c", c}}}}, {.lr = 0.1});
  NamedTensors state = three.StateDict();
  for (auto& [k, t] : state) {
    if (k == "param_groups.0.params") t = FromVectorOf<uint8_t>({'a', '\n', 'b'}, {3});
  }
  ExpectRefused([&] { three.LoadStateDict(state); },
                {"`param_groups.0.params` lists 2 parameters and `param_groups.0.size` says 1"});
}

// An empty optimizer name is a problem of its own, so that the options
// (not checked against an unknown kind) are never half taken.
TEST(ParamGroups, EmptyOptimizerNameIsRefusedAndChangesNothing) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd saved(TwoGroups(p), {.lr = 0.1, .momentum = 0.9});
  NamedTensors state = saved.StateDict();
  for (auto& [k, t] : state) {
    if (k == "group.optimizer") t = Empty({0}, {.dtype = DType::kUInt8});
    if (k == "param_groups.1.weight_decay") t = FromVector({-1.0}, {}, {.dtype = DType::kFloat64});
  }
  Sgd loader(TwoGroups(MakeParams(DType::kFloat32, 2), {{"lr", 0.02}, {"momentum", 0.3}}), {.lr = 0.2, .momentum = 0.8});
  ExpectRefused([&] { loader.LoadStateDict(state); }, {"`group.optimizer` is empty"});
  EXPECT_EQ(loader.lr(0), 0.2);
  EXPECT_EQ(loader.options(0).momentum, 0.8);
  EXPECT_EQ(loader.options(1).momentum, 0.3);
}

// Save mid-run (through a checkpoint file) with a scheduler over two
// groups, restore into optimizers made with other rates and plain options,
// continue: bit-identical to never stopping, for every optimizer.
TEST(ParamGroups, StateRoundTripGivesIdenticalContinuedTrajectories) {
  using GroupFactory = std::function<std::unique_ptr<Optimizer>(std::vector<ParamGroup>, bool)>;
  const std::vector<std::pair<std::string, GroupFactory>> makers = {
      {"sgd",
       [](std::vector<ParamGroup> g, bool other) {
         return std::make_unique<Sgd>(std::move(g), SgdOptions{.lr = other ? 1.0 : 0.05, .momentum = 0.9});
       }},
      {"adam",
       [](std::vector<ParamGroup> g, bool other) {
         return std::make_unique<Adam>(std::move(g), AdamOptions{.lr = other ? 1.0 : 1e-2, .amsgrad = true});
       }},
      {"adamw",
       [](std::vector<ParamGroup> g, bool other) {
         return std::make_unique<AdamW>(std::move(g), AdamWOptions{.lr = other ? 1.0 : 1e-2});
       }},
      {"adadelta",
       [](std::vector<ParamGroup> g, bool other) {
         return std::make_unique<Adadelta>(std::move(g), AdadeltaOptions{.lr = other ? 0.1 : 1.0});
       }},
  };
  for (const auto& [name, make] : makers) {
    SCOPED_TRACE(name);
    const std::map<std::string, double> second = {{"lr", 0.003}, {"weight_decay", 0.25}};
    NamedParameters a = MakeParams(DType::kFloat32, 1);
    auto opt_a = make(TwoGroups(a, second), false);
    LrScheduler sched_a(*opt_a, CosineSchedule(12));
    TrainSteps(a, *opt_a, 0, 1);
    sched_a.Step();
    TrainSteps(a, *opt_a, 1, 4);
    io::Checkpoint ckpt;
    ckpt.model = {a.begin(), a.end()};
    ckpt.optimizer = opt_a->StateDict();
    for (auto& kv : sched_a.StateDict()) ckpt.optimizer.push_back(kv);
    const std::string path = TmpPath(name + "_groups.safetensors");
    io::SaveCheckpoint(path, ckpt);
    for (int s = 4; s < 8; ++s) {
      TrainSteps(a, *opt_a, s, s + 1);
      sched_a.Step();
    }

    io::Checkpoint loaded = io::LoadCheckpoint(path);
    NamedParameters b = MakeParams(DType::kFloat32, 2);
    for (size_t i = 0; i < b.size(); ++i) b[i].second.CopyFrom(loaded.model[i].second);
    auto opt_b = make(TwoGroups(b, {{"lr", 0.5}}), true);
    LrScheduler sched_b(*opt_b, CosineSchedule(12));
    opt_b->LoadStateDict(loaded.optimizer);
    sched_b.LoadStateDict(loaded.optimizer);
    EXPECT_EQ(sched_b.base_lrs(), sched_a.base_lrs());
    for (int s = 4; s < 8; ++s) {
      TrainSteps(b, *opt_b, s, s + 1);
      sched_b.Step();
    }
    EXPECT_EQ(Bytes(a), Bytes(b));
    EXPECT_EQ(opt_a->lr(0), opt_b->lr(0));
    EXPECT_EQ(opt_a->lr(1), opt_b->lr(1));
    ExpectSameEntries(opt_b->StateDict(), opt_a->StateDict());
  }
}

TEST(ParamGroups, LoadOfAnotherGroupCountIsRefusedNamingBoth) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd two(TwoGroups(p), {.lr = 0.1, .momentum = 0.9});
  Sgd one(MakeParams(DType::kFloat32, 2), {.lr = 0.1, .momentum = 0.9});
  Sgd three({{.params = {p[0]}}, {.params = {p[1]}}, {.params = {}}}, {.lr = 0.1, .momentum = 0.9});
  ExpectRefused([&] { one.LoadStateDict(two.StateDict()); }, {"the state has 2 param groups, this optimizer 1"});
  ExpectRefused([&] { two.LoadStateDict(one.StateDict()); }, {"the state has 1 param group", "this optimizer 2"});
  ExpectRefused([&] { three.LoadStateDict(two.StateDict()); }, {"the state has 2 param groups, this optimizer 3"});
  // A state without options (saved before they existed) counts as one group.
  ExpectRefused([&] { two.LoadStateDict(WithoutOptions(one.StateDict())); }, {"1 param group", "this optimizer 2"});
  // The count is the one problem: a one-group state's options are not
  // listed as unexpected keys.
  try {
    two.LoadStateDict(one.StateDict());
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("1 problem(s)"));
    EXPECT_THAT(e.what(), Not(HasSubstr("group.momentum")));
  }
  EXPECT_EQ(one.lr(), 0.1);
  EXPECT_EQ(two.lr(1), 0.01);
}

TEST(ParamGroups, GroupOfAnotherSizeIsRefusedNamingTheGroupAndBothSizes) {
  Tensor a = Ones({2}), b = Ones({3}), c = Ones({4});
  Sgd saved({{.params = {{"a", a}, {"b", b}}}, {.params = {{"c", c}}}}, {.lr = 0.1});
  Sgd loader({{.params = {{"a", a}}}, {.params = {{"b", b}, {"c", c}}}}, {.lr = 0.2});
  ExpectRefused([&] { loader.LoadStateDict(saved.StateDict()); },
                {"param group 0 has 2 parameters in the state and 1 in this optimizer",
                 "param group 1 has 1 parameters in the state and 2 in this optimizer"});
  EXPECT_EQ(loader.lr(0), 0.2);
}

// Every problem of a several-group state in one error, and nothing changed.
TEST(ParamGroups, BadStateListsEveryProblemPerGroupAndChangesNothing) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd saved(TwoGroups(p), {.lr = 0.1, .momentum = 0.9, .nesterov = true});
  NamedParameters q = MakeParams(DType::kFloat32, 2);
  Sgd loader(TwoGroups(q, {{"lr", 0.02}}), {.lr = 0.2, .momentum = 0.9, .nesterov = true});
  NamedTensors state = saved.StateDict();
  for (auto& [k, t] : state) {
    if (k == "param_groups.1.lr") t = FromVector({-1.0}, {}, {.dtype = DType::kFloat64});
    if (k == "param_groups.0.weight_decay") t = FromVector({-2.0}, {}, {.dtype = DType::kFloat64});
  }
  std::erase_if(state, [](const auto& e) { return e.first == "param_groups.1.dampening"; });
  ExpectRefused([&] { loader.LoadStateDict(state); },
                {"3 problem(s)", "`param_groups.1.lr` is -1", "missing `param_groups.1.dampening`",
                 "param group 0: the state's options are refused: weight_decay -2 must be finite and >= 0"});
  // Structural options must match group by group.
  Sgd plain(TwoGroups(MakeParams(DType::kFloat32, 3)), {.lr = 0.2, .momentum = 0.9});
  ExpectRefused([&] { plain.LoadStateDict(saved.StateDict()); },
                {"param group 0: nesterov is true in the state and false in this optimizer",
                 "param group 1: nesterov is true in the state and false in this optimizer"});
  EXPECT_FALSE(plain.options(1).nesterov);
  EXPECT_EQ(loader.lr(0), 0.2);
  EXPECT_EQ(loader.lr(1), 0.02);
  EXPECT_EQ(loader.options(1).momentum, 0.9);
  EXPECT_THROW(loader.CheckStateDict(state), std::invalid_argument);
  // Plain values are taken per group.
  Sgd nesterov(TwoGroups(q, {{"momentum", 0.1}}), {.lr = 0.2, .momentum = 0.9, .nesterov = true});
  nesterov.LoadStateDict(saved.StateDict());
  EXPECT_EQ(nesterov.lr(1), 0.01);
  EXPECT_EQ(nesterov.options(1).momentum, 0.5);
  EXPECT_EQ(nesterov.options(0).momentum, 0.9);
}

TEST(ParamGroups, SchedulerStateHasOneBaseRatePerGroup) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd two(TwoGroups(p), {.lr = 0.1, .momentum = 0.9});
  LrScheduler sched(two, StepSchedule(2, 0.5));
  sched.Step();
  sched.Step();
  EXPECT_EQ(two.lr(0), 0.05);
  EXPECT_EQ(two.lr(1), 0.005);
  const NamedTensors state = sched.StateDict();
  ASSERT_EQ(state[1].first, "scheduler.base_lr");
  EXPECT_EQ(state[1].second.shape(), (Shape{2}));
  EXPECT_EQ(state[1].second.ToVector<double>(), (std::vector<double>{0.1, 0.01}));

  Sgd one(MakeParams(DType::kFloat32, 2), {.lr = 0.1});
  LrScheduler one_sched(one, StepSchedule(2, 0.5));
  EXPECT_EQ(one_sched.StateDict()[1].second.shape(), Shape{});
  ExpectRefused([&] { one_sched.LoadStateDict(state); },
                {"base rates of 2 param group(s), this scheduler drives 1"});
  ExpectRefused([&] { sched.LoadStateDict(one_sched.StateDict()); },
                {"base rates of 1 param group(s), this scheduler drives 2"});
  EXPECT_EQ(one.lr(), 0.1);
  EXPECT_EQ(two.lr(1), 0.005);

  // A rate refused for one group changes no group.
  NamedTensors bad = state;
  bad[1].second = FromVector({0.1, -0.1}, {2}, {.dtype = DType::kFloat64});
  ExpectRefused([&] { sched.LoadStateDict(bad); }, {"param group 1", "must be finite and >= 0"});
  EXPECT_EQ(two.lr(0), 0.05);
  EXPECT_EQ(sched.base_lrs(), (std::vector<double>{0.1, 0.01}));
}

// A schedule that halves the rate at t = 1 and then gives small base rates
// a negative one, which the optimizer refuses.
class RefusedForSmallRates : public Schedule {
 public:
  double Lr(double base, int64_t t) const override { return t >= 2 && base < 0.05 ? -1.0 : (t ? base / 2 : base); }
};

TEST(ParamGroups, ARateOneGroupRefusesLeavesEveryGroupAsItWas) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd opt(TwoGroups(p), {.lr = 0.1, .momentum = 0.9});
  LrScheduler sched(opt, std::make_shared<RefusedForSmallRates>());
  sched.Step();
  // Group 0 takes its rate before group 1 refuses its own: put back.
  EXPECT_THROW(sched.Step(), std::invalid_argument);
  EXPECT_EQ(opt.lr(0), 0.05);
  EXPECT_EQ(opt.lr(1), 0.005);
  EXPECT_EQ(sched.step_count(), 1);
}

// The momentum a schedule drives: SGD's momentum, Adam's and AdamW's beta1,
// per group; set_momentum then changes that group's options alone.
TEST(Momentum, SgdMomentumAndAdamBeta1PerGroup) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd sgd(TwoGroups(p), {.lr = 0.1, .momentum = 0.9});
  EXPECT_EQ(sgd.momentum(0), 0.9);
  sgd.set_momentum(1, 0.8);
  EXPECT_EQ(sgd.momentum(1), 0.8);
  EXPECT_EQ(sgd.options(1).momentum, 0.8);
  EXPECT_EQ(sgd.options(0).momentum, 0.9);
  EXPECT_THROW(sgd.momentum(2), std::out_of_range);
  EXPECT_THROW(sgd.set_momentum(2, 0.5), std::out_of_range);
  AdamW adamw(p, {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.99});
  adamw.set_momentum(0, 0.85);
  EXPECT_EQ(adamw.momentum(0), 0.85);
  EXPECT_EQ(adamw.options(0).beta1, 0.85);
  EXPECT_EQ(adamw.options(0).beta2, 0.99);
  // Saved as the option it is.
  bool saved = false;
  for (const auto& [k, t] : adamw.StateDict()) {
    if (k == "group.beta1") saved = t.To(kCPU).ToVector<double>() == std::vector<double>{0.85};
  }
  EXPECT_TRUE(saved);
}

TEST(Momentum, AnOptimizerWithoutMomentumIsRefusedNamingIt) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Adadelta adadelta(p, {});
  EXPECT_THAT(ErrorOf([&] { adadelta.momentum(0); }), HasSubstr("Adadelta has no momentum"));
  EXPECT_THAT(ErrorOf([&] { adadelta.set_momentum(0, 0.9); }), HasSubstr("Adadelta has no momentum"));
}

// SGD keeps a momentum buffer only with momentum != 0: neither way across.
TEST(Momentum, SgdMomentumZeroOrBecomingZeroIsRefused) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd plain(p, {.lr = 0.1});
  EXPECT_EQ(plain.momentum(0), 0.0);
  EXPECT_THAT(ErrorOf([&] { plain.set_momentum(0, 0.9); }),
              AllOf(HasSubstr("SGD: param group 0's momentum is 0"), HasSubstr("keeps no momentum buffer")));
  EXPECT_EQ(plain.options().momentum, 0.0);
  Sgd with(p, {.lr = 0.1, .momentum = 0.9});
  EXPECT_THAT(ErrorOf([&] { with.set_momentum(0, 0.0); }), HasSubstr("momentum cannot become 0"));
  EXPECT_THAT(ErrorOf([&] { with.set_momentum(0, -0.5); }), HasSubstr("momentum -0.5 refused"));
  EXPECT_THAT(ErrorOf([&] { with.set_momentum(0, std::nan("")); }), HasSubstr("must be finite"));
  EXPECT_EQ(with.momentum(0), 0.9);
  Adam adam(p, {});
  EXPECT_THAT(ErrorOf([&] { adam.set_momentum(0, 1.0); }),
              AllOf(HasSubstr("Adam: param group 0's beta1 1 refused"), HasSubstr("must be in [0, 1)")));
  EXPECT_EQ(adam.momentum(0), 0.9);
}


// ---- AddParamGroup ----

// A group added after some steps trains as if it had been there from the
// start with no gradient until then: its parameters start with empty state
// and step 0, and take the defaults for options the group lacks.
TEST(AddParamGroup, AddedGroupTrainsAsOneThatWasThereWithoutGradients) {
  using GroupFactory = std::function<std::unique_ptr<Optimizer>(std::vector<ParamGroup>)>;
  const std::vector<std::tuple<std::string, GroupFactory, std::map<std::string, double>>> cases = {
      {"sgd",
       [](std::vector<ParamGroup> g) {
         return std::make_unique<Sgd>(std::move(g), SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3});
       },
       {{"lr", 0.01}, {"momentum", 0.5}, {"dampening", 0.25}}},
      {"adamw",
       [](std::vector<ParamGroup> g) { return std::make_unique<AdamW>(std::move(g), AdamWOptions{.lr = 1e-2}); },
       {{"lr", 0.003}, {"weight_decay", 0.25}, {"beta1", 0.8}}},
  };
  for (const auto& [name, make, second] : cases) {
    SCOPED_TRACE(name);
    NamedParameters a = MakeParams(DType::kFloat32, 1);
    NamedParameters b = MakeParams(DType::kFloat32, 1);
    auto added = make({{.params = {a[0]}}});
    auto whole = make(TwoGroups(b, second));
    for (int s = 0; s < 3; ++s) {
      SetGrads({a[0]}, s);
      SetGrads({b[0]}, s);
      added->Step();
      whole->Step();
    }
    added->AddParamGroup({.params = {a[1]}, .options = second});
    ASSERT_EQ(added->num_groups(), 2u);
    EXPECT_EQ(added->group_of(1), 1u);
    EXPECT_EQ(added->group_params(1).front().first, "fc.bias");
    EXPECT_EQ(added->lr(1), second.at("lr"));
    EXPECT_EQ(added->step_count(1), 0);
    for (int s = 3; s < 8; ++s) {
      SetGrads(a, s);
      SetGrads(b, s);
      added->Step();
      whole->Step();
    }
    EXPECT_EQ(Bytes(a), Bytes(b));
    EXPECT_EQ(added->step_count(1), 5);
    ExpectSameEntries(added->StateDict(), whole->StateDict());
  }
}

TEST(AddParamGroup, MissingOptionsTakeTheDefaults) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd sgd({{.params = {p[0]}, .options = {{"lr", 0.5}, {"momentum", 0.5}}}}, {.lr = 0.1, .momentum = 0.9});
  sgd.AddParamGroup({.params = {p[1]}, .options = {{"weight_decay", 0.125}}});
  EXPECT_EQ(sgd.lr(1), 0.1);
  EXPECT_EQ(sgd.options(1).lr, 0.1);
  EXPECT_EQ(sgd.options(1).momentum, 0.9);
  EXPECT_EQ(sgd.options(1).weight_decay, 0.125);
  EXPECT_EQ(sgd.momentum(1), 0.9);
  NamedParameters q = MakeParams(DType::kFloat32, 2);
  AdamW adamw({q[0]}, {.lr = 0.02, .weight_decay = 0.5, .maximize = true});
  adamw.AddParamGroup({.params = {q[1]}});
  EXPECT_EQ(adamw.lr(1), 0.02);
  EXPECT_EQ(adamw.options(1).weight_decay, 0.5);
  EXPECT_TRUE(adamw.maximize(1));
  // An empty group, as in the constructor.
  adamw.AddParamGroup({});
  EXPECT_EQ(adamw.num_groups(), 3u);
  EXPECT_TRUE(adamw.group_params(2).empty());
}

// Each refusal names the parameter or option and changes nothing: a valid
// group added afterwards is still group 1.
TEST(AddParamGroup, BadGroupIsRefusedNamingWhatAndChangesNothing) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd opt({p[0]}, {.lr = 0.1, .momentum = 0.9});
  SetGrads({p[0]}, 0);
  opt.Step();
  const NamedTensors before = opt.StateDict();
  const auto refused = [&](ParamGroup group, const std::vector<std::string>& parts) {
    ExpectRefused([&] { opt.AddParamGroup(std::move(group)); }, parts);
    EXPECT_EQ(opt.num_groups(), 1u);
    EXPECT_EQ(opt.params().size(), 1u);
  };
  // PyTorch: "some parameters appear in more than one parameter group".
  refused({.params = {p[1], p[0]}},
          {"SGD.AddParamGroup: param group 1: parameter `fc.weight` is already in param group 0"});
  refused({.params = {{"alias", p[0].second}}}, {"param group 1: parameter `alias` is the tensor `fc.weight` of param group 0"});
  refused({.params = {{"", p[1].second}}}, {"param group 1: a parameter has an empty name"});
  refused({.params = {{"ghost", Tensor()}}}, {"param group 1: parameter `ghost` is undefined"});
  refused({.params = {p[1], p[1]}}, {"SGD.AddParamGroup: parameter `fc.bias` is listed twice"});
  refused({.params = {p[1]}, .options = {{"betas", 0.9}}},
          {"SGD: param group 1: unknown option `betas`", "known: lr, momentum"});
  refused({.params = {p[1]}, .options = {{"weight_decay", -1}}}, {"SGD: param group 1", "weight_decay"});
  refused({.params = {p[1]}, .options = {{"lr", -0.5}}}, {"param group 1", "learning rate"});
  refused({.params = {p[1]}, .options = {{"maximize", 2}}}, {"param group 1", "`maximize`", "0 or 1"});
  refused({.params = {p[1]}, .options = {{"momentum", 0}}},
          {"SGD: param group 1", "`momentum`", "per-group state layouts are not supported"});
  refused({.params = {p[1]}, .options = {{"nesterov", 1}}}, {"param group 1", "`nesterov`"});
  Tensor flat = Zeros({10});
  Sgd views({{"a", flat.Slice(0, 0, 6)}}, {});
  ExpectRefused([&] { views.AddParamGroup({.params = {{"b", flat.Slice(0, 4, 10)}}}); }, {"share memory"});
  EXPECT_EQ(views.num_groups(), 1u);
  ExpectSameEntries(opt.StateDict(), before);

  opt.AddParamGroup({.params = {p[1]}});
  EXPECT_EQ(opt.num_groups(), 2u);
  EXPECT_EQ(opt.group_of(1), 1u);
}

// The scheduler holds one base rate per group: it would not drive the new one.
TEST(AddParamGroup, RefusedWhileASchedulerDrivesTheOptimizer) {
  NamedParameters p = MakeParams(DType::kFloat32, 1);
  Sgd opt({p[0]}, {.lr = 0.1});
  {
    LrScheduler scheduler(opt, StepSchedule(1, 0.5));
    try {
      opt.AddParamGroup({.params = {p[1]}});
      ADD_FAILURE() << "not refused";
    } catch (const std::logic_error& e) {
      EXPECT_THAT(e.what(), AllOf(HasSubstr("SGD.AddParamGroup: an LrScheduler drives this optimizer"),
                                  HasSubstr("add param groups before making the scheduler")));
    }
    EXPECT_EQ(opt.num_groups(), 1u);
  }
  opt.AddParamGroup({.params = {p[1]}, .options = {{"lr", 0.2}}});
  LrScheduler scheduler(opt, StepSchedule(1, 0.5));
  EXPECT_EQ(scheduler.base_lrs(), (std::vector<double>{0.1, 0.2}));
}

// A one-group optimizer that gained a group saves the several-group layout,
// which loads into an optimizer with the same groups (made either way).
TEST(AddParamGroup, StateRoundTripAfterAdding) {
  NamedParameters a = MakeParams(DType::kFloat32, 1);
  Adam opt({a[0]}, {.lr = 1e-2, .amsgrad = true});
  TrainSteps({a[0]}, opt, 0, 2);
  opt.AddParamGroup({.params = {a[1]}, .options = {{"lr", 0.003}, {"eps", 1e-6}}});
  TrainSteps(a, opt, 2, 4);
  const NamedTensors state = opt.StateDict();
  EXPECT_EQ(EntriesUnder(state, "lr"), 0u);
  EXPECT_EQ(EntriesUnder(state, "group.beta1"), 0u);
  EXPECT_EQ(EntriesUnder(state, "param_groups.count"), 1u);
  EXPECT_EQ(EntriesUnder(state, "param_groups.1."), 9u);  // lr, 6 options, size, params
  Adam one(MakeParams(DType::kFloat32, 2), {.lr = 1e-2, .amsgrad = true});
  ExpectRefused([&] { one.LoadStateDict(state); }, {"the state has 2 param groups, this optimizer 1"});

  NamedParameters at_save = MakeParams(DType::kFloat32, 3);
  for (size_t i = 0; i < a.size(); ++i) at_save[i].second.CopyFrom(a[i].second);
  TrainSteps(a, opt, 4, 7);
  for (bool add : {true, false}) {
    SCOPED_TRACE(add ? "group added" : "groups constructed");
    NamedParameters b = MakeParams(DType::kFloat32, 2);
    for (size_t i = 0; i < b.size(); ++i) b[i].second.CopyFrom(at_save[i].second);
    std::unique_ptr<Adam> loaded;
    if (add) {
      loaded = std::make_unique<Adam>(NamedParameters{b[0]}, AdamOptions{.amsgrad = true});
      loaded->AddParamGroup({.params = {b[1]}});
    } else {
      loaded = std::make_unique<Adam>(std::vector<ParamGroup>{{.params = {b[0]}}, {.params = {b[1]}}},
                                      AdamOptions{.amsgrad = true});
    }
    loaded->LoadStateDict(state);
    EXPECT_EQ(loaded->lr(1), 0.003);
    EXPECT_EQ(loaded->options(1).eps, 1e-6);
    TrainSteps(b, *loaded, 4, 7);
    EXPECT_EQ(Bytes(a), Bytes(b));
    ExpectSameEntries(loaded->StateDict(), opt.StateDict());
  }
}

}  // namespace
}  // namespace ddp::nn::optim
