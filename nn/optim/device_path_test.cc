// The device path of nn/optim (what CUDA parameters take) run on CPU
// tensors: the test registers CPU stand-ins for the device kernels
// (straightforward per-element loops of PyTorch's rules, written here
// independently of sgd.cc/adam.cc), so everything around the kernels is
// exercised without a GPU: state allocation on the parameter's device, f32
// master copies of 16-bit parameters, gradient conversion, the loss
// scaler's found-inf flag, ClipGradNorm (finite norms composed from the ops
// kernel table, the infinity norm through `max_abs`), state save and load.
// Results must match the host path (tolerances: 1e-6 relative in f32, 1e-12
// in f64; bf16 parameters identical up to one bf16 rounding, 1e-2 relative;
// the infinity norm exactly, as a maximum involves no rounding).
//
// The CUDA kernels themselves are tested against the host path by
// nn/cuda:optim_kernels_test and nn/cuda:optim_device_test (GPU).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "nn/ops/autocast_training.h"
#include "nn/optim/adadelta.h"
#include "nn/optim/adagrad.h"
#include "nn/optim/adam.h"
#include "nn/optim/clip_grad.h"
#include "nn/optim/device_kernels.h"
#include "nn/optim/grad_scaler.h"
#include "nn/optim/rmsprop.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/generator.h"

namespace ddp::nn::optim {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// One call of `sgd_step_multi`: its parameters' dtype, numels and args.
struct SgdMultiCall {
  DType dtype;
  std::vector<int64_t> numels;
  SgdStepArgs args;
};

struct Calls {
  int sgd = 0, adam = 0, adadelta = 0, unscale = 0, max_abs = 0, rmsprop = 0, adagrad = 0;
  size_t unscale_tensors = 0, max_abs_tensors = 0;
  AdadeltaStepArgs last_adadelta;
  RmspropStepArgs last_rmsprop;
  AdagradStepArgs last_adagrad;
  std::vector<SgdMultiCall> sgd_multi;
};
Calls g_calls;

template <typename T>
void SgdLoop(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdStepArgs& a) {
  T* pp = p.data<T>();
  const T* gp = g.data<T>();
  T* bp = a.momentum != 0 ? buf.data<T>() : nullptr;
  for (int64_t i = 0; i < p.numel(); ++i) {
    T d = gp[i] * static_cast<T>(a.grad_scale);
    d = d + static_cast<T>(a.weight_decay) * pp[i];
    if (a.momentum != 0) {
      const T b = a.step == 1 ? d : bp[i] * static_cast<T>(a.momentum) + static_cast<T>(1.0 - a.dampening) * d;
      bp[i] = b;
      d = a.nesterov ? d + static_cast<T>(a.momentum) * b : b;
    }
    pp[i] = pp[i] + static_cast<T>(-a.lr) * d;
  }
}

void TestSgdStep(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdStepArgs& a) {
  ++g_calls.sgd;
  ASSERT_EQ(p.dtype(), g.dtype());
  ASSERT_TRUE(p.is_contiguous() && g.is_contiguous());
  if (p.dtype() == DType::kFloat64) {
    SgdLoop<double>(p, g, buf, a);
  } else {
    SgdLoop<float>(p, g, buf, a);
  }
}

// The per-parameter stand-in applied to each parameter in turn, after
// checking what the CUDA kernel requires of a group: one length, one
// device, one dtype per call (the CUDA kernel would take several, but SGD's
// grouping promises one), buffers exactly when momentum is on.
void TestSgdStepMulti(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      const std::vector<Tensor>& buffers, const SgdStepArgs& a) {
  ASSERT_FALSE(params.empty());
  ASSERT_EQ(grads.size(), params.size());
  ASSERT_EQ(buffers.size(), params.size());
  SgdMultiCall call{.dtype = params.front().dtype(), .args = a};
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    ASSERT_EQ(p.dtype(), call.dtype);
    ASSERT_EQ(p.device(), params.front().device());
    ASSERT_EQ(grads[i].dtype(), p.dtype());
    ASSERT_EQ(grads[i].shape(), p.shape());
    ASSERT_TRUE(p.is_contiguous() && grads[i].is_contiguous());
    ASSERT_EQ(buffers[i].defined(), a.momentum != 0);
    if (a.momentum != 0) {
      ASSERT_EQ(buffers[i].shape(), p.shape());
    }
    call.numels.push_back(p.numel());
    if (p.dtype() == DType::kFloat64) {
      SgdLoop<double>(p, grads[i], buffers[i], a);
    } else {
      SgdLoop<float>(p, grads[i], buffers[i], a);
    }
  }
  g_calls.sgd_multi.push_back(call);
}

template <typename T>
void AdamLoop(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const Tensor& vmax,
              const AdamStepArgs& a) {
  const double bc1 = 1.0 - std::pow(a.beta1, static_cast<double>(a.step));
  const double bc2 = 1.0 - std::pow(a.beta2, static_cast<double>(a.step));
  T* pp = p.data<T>();
  const T* gp = g.data<T>();
  T* mp = m.data<T>();
  T* vp = v.data<T>();
  T* xp = a.amsgrad ? vmax.data<T>() : nullptr;
  for (int64_t i = 0; i < p.numel(); ++i) {
    T gi = gp[i] * static_cast<T>(a.grad_scale);
    T pi = pp[i];
    if (!a.decoupled) gi = gi + static_cast<T>(a.weight_decay) * pi;
    if (a.decoupled) pi = pi * static_cast<T>(1.0 - a.lr * a.weight_decay);
    mp[i] = mp[i] * static_cast<T>(a.beta1) + static_cast<T>(1.0 - a.beta1) * gi;
    vp[i] = vp[i] * static_cast<T>(a.beta2) + static_cast<T>(1.0 - a.beta2) * gi * gi;
    T s = vp[i];
    if (a.amsgrad) {
      s = (xp[i] > s || std::isnan(xp[i])) ? xp[i] : s;  // torch.maximum keeps a NaN of either side
      xp[i] = s;
    }
    const T denom = std::sqrt(s) / static_cast<T>(std::sqrt(bc2)) + static_cast<T>(a.eps);
    pp[i] = pi + static_cast<T>(-(a.lr / bc1)) * (mp[i] / denom);
  }
}

void TestAdamStep(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const Tensor& vmax,
                  const AdamStepArgs& a) {
  ++g_calls.adam;
  ASSERT_EQ(p.dtype(), g.dtype());
  if (p.dtype() == DType::kFloat64) {
    AdamLoop<double>(p, g, m, v, vmax, a);
  } else {
    AdamLoop<float>(p, g, m, v, vmax, a);
  }
}

template <typename T>
void AdadeltaLoop(const Tensor& p, const Tensor& g, const Tensor& sq, const Tensor& acc, const AdadeltaStepArgs& a) {
  T* pp = p.data<T>();
  const T* gp = g.data<T>();
  T* sp = sq.data<T>();
  T* ap = acc.data<T>();
  const T rho = static_cast<T>(a.rho), eps = static_cast<T>(a.eps);
  for (int64_t i = 0; i < p.numel(); ++i) {
    const T grad = gp[i] * static_cast<T>(a.grad_scale) + (a.weight_decay != 0 ? static_cast<T>(a.weight_decay) * pp[i] : T(0));
    sp[i] = sp[i] * rho + static_cast<T>(1.0 - a.rho) * grad * grad;
    const T delta = std::sqrt(ap[i] + eps) / std::sqrt(sp[i] + eps) * grad;
    ap[i] = ap[i] * rho + static_cast<T>(1.0 - a.rho) * delta * delta;
    pp[i] = pp[i] + static_cast<T>(-a.lr) * delta;
  }
}

void TestAdadeltaStep(const Tensor& p, const Tensor& g, const Tensor& sq, const Tensor& acc,
                      const AdadeltaStepArgs& a) {
  ++g_calls.adadelta;
  g_calls.last_adadelta = a;
  ASSERT_EQ(p.dtype(), g.dtype());
  ASSERT_EQ(sq.dtype(), p.dtype());
  ASSERT_EQ(acc.dtype(), p.dtype());
  ASSERT_EQ(sq.numel(), p.numel());
  ASSERT_EQ(acc.numel(), p.numel());
  if (p.dtype() == DType::kFloat64) {
    AdadeltaLoop<double>(p, g, sq, acc, a);
  } else {
    AdadeltaLoop<float>(p, g, sq, acc, a);
  }
}

template <typename T>
void RmspropLoop(const Tensor& p, const Tensor& g, const Tensor& sq, const Tensor& buf, const Tensor& ga,
                 const RmspropStepArgs& a) {
  T* pp = p.data<T>();
  const T* gp = g.data<T>();
  T* sp = sq.data<T>();
  const T alpha = static_cast<T>(a.alpha), w = static_cast<T>(1.0 - a.alpha);
  for (int64_t i = 0; i < p.numel(); ++i) {
    T gi = gp[i] * static_cast<T>(a.grad_scale);
    if (a.weight_decay != 0) gi = gi + static_cast<T>(a.weight_decay) * pp[i];
    sp[i] = sp[i] * alpha + w * gi * gi;
    T avg = sp[i];
    if (a.centered) {
      T& m = ga.data<T>()[i];
      m = std::abs(w) < T(0.5) ? m + w * (gi - m) : gi - (gi - m) * (T(1) - w);
      avg = avg - m * m;
    }
    avg = std::sqrt(avg) + static_cast<T>(a.eps);
    if (a.momentum != 0) {
      T& b = buf.data<T>()[i];
      b = b * static_cast<T>(a.momentum) + gi / avg;
      pp[i] = pp[i] + static_cast<T>(-a.lr) * b;
    } else {
      pp[i] = pp[i] + (static_cast<T>(-a.lr) * gi) / avg;
    }
  }
}

void TestRmspropStep(const Tensor& p, const Tensor& g, const Tensor& sq, const Tensor& buf, const Tensor& ga,
                     const RmspropStepArgs& a) {
  ++g_calls.rmsprop;
  g_calls.last_rmsprop = a;
  ASSERT_EQ(p.dtype(), g.dtype());
  ASSERT_EQ(sq.dtype(), p.dtype());
  ASSERT_EQ(sq.numel(), p.numel());
  // The optional slots come exactly when their options keep them.
  ASSERT_EQ(buf.defined(), a.momentum != 0);
  ASSERT_EQ(ga.defined(), a.centered);
  if (buf.defined()) {
    ASSERT_EQ(buf.numel(), p.numel());
  }
  if (ga.defined()) {
    ASSERT_EQ(ga.numel(), p.numel());
  }
  if (p.dtype() == DType::kFloat64) {
    RmspropLoop<double>(p, g, sq, buf, ga, a);
  } else {
    RmspropLoop<float>(p, g, sq, buf, ga, a);
  }
}

template <typename T>
void AdagradLoop(const Tensor& p, const Tensor& g, const Tensor& sum, const AdagradStepArgs& a) {
  T* pp = p.data<T>();
  const T* gp = g.data<T>();
  T* sp = sum.data<T>();
  for (int64_t i = 0; i < p.numel(); ++i) {
    T gi = gp[i] * static_cast<T>(a.grad_scale);
    if (a.weight_decay != 0) gi = gi + static_cast<T>(a.weight_decay) * pp[i];
    sp[i] = sp[i] + gi * gi;
    pp[i] = pp[i] + (static_cast<T>(-a.clr) * gi) / (std::sqrt(sp[i]) + static_cast<T>(a.eps));
  }
}

void TestAdagradStep(const Tensor& p, const Tensor& g, const Tensor& sum, const AdagradStepArgs& a) {
  ++g_calls.adagrad;
  g_calls.last_adagrad = a;
  ASSERT_EQ(p.dtype(), g.dtype());
  ASSERT_EQ(sum.dtype(), p.dtype());
  ASSERT_EQ(sum.numel(), p.numel());
  if (p.dtype() == DType::kFloat64) {
    AdagradLoop<double>(p, g, sum, a);
  } else {
    AdagradLoop<float>(p, g, sum, a);
  }
}

// Any NaN makes the result NaN; otherwise the largest magnitude.
void TestMaxAbs(const std::vector<Tensor>& tensors, const Tensor& out) {
  ++g_calls.max_abs;
  g_calls.max_abs_tensors += tensors.size();
  ASSERT_EQ(out.numel(), 1);
  ASSERT_EQ(out.dtype(), DType::kFloat64);
  double& m = out.data<double>()[0];
  for (const Tensor& t : tensors) {
    ASSERT_TRUE(t.is_contiguous());  // as CUDA's MaxAbs requires
    for (double x : t.ToVector<double>()) {
      if (std::isnan(x) || std::isnan(m)) {
        m = std::numeric_limits<double>::quiet_NaN();
      } else {
        m = std::max(m, std::abs(x));
      }
    }
  }
}

void TestUnscale(const std::vector<Tensor>& tensors, double inv_scale, const Tensor& found_inf) {
  ++g_calls.unscale;
  g_calls.unscale_tensors += tensors.size();
  ASSERT_EQ(found_inf.numel(), 1);
  ASSERT_EQ(found_inf.dtype(), DType::kFloat32);
  for (const Tensor& t : tensors) {
    ASSERT_TRUE(t.is_contiguous());  // as CUDA's UnscaleAndCheck requires
    std::vector<double> v = t.ToVector<double>();
    for (double& x : v) {
      if (!std::isfinite(x)) found_inf.data<float>()[0] = 1.0f;
      x = static_cast<double>(static_cast<float>(x) * static_cast<float>(inv_scale));
    }
    t.CopyFrom(FromVector(v, t.shape(), {.dtype = DType::kFloat64}));
  }
}

// Registers the stand-ins for the CPU while a test runs.
class DevicePathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_calls = Calls();
    RegisterDeviceOptimKernels(DeviceType::kCPU, DeviceOptimKernels{.sgd_step = &TestSgdStep,
                                                                    .adam_step = &TestAdamStep,
                                                                    .unscale_and_check = &TestUnscale,
                                                                    .adadelta_step = &TestAdadeltaStep,
                                                                    .max_abs = &TestMaxAbs,
                                                                    .rmsprop_step = &TestRmspropStep,
                                                                    .adagrad_step = &TestAdagradStep});
    ASSERT_TRUE(internal::UsesDevicePath(kCPU));
  }
  void TearDown() override {
    RegisterDeviceOptimKernels(DeviceType::kCPU, DeviceOptimKernels{});
    EXPECT_FALSE(internal::UsesDevicePath(kCPU));
  }
  // Runs f with the host path (stand-ins unregistered), then re-registers them.
  template <typename F>
  void OnHostPath(F&& f) {
    RegisterDeviceOptimKernels(DeviceType::kCPU, DeviceOptimKernels{});
    f();
    SetUp();
  }
};

using Factory = std::function<std::unique_ptr<Optimizer>(NamedParameters)>;

std::vector<std::pair<std::string, Factory>> AllOptimizers() {
  return {
      {"sgd", [](NamedParameters p) { return std::make_unique<Sgd>(p, SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true}); }},
      {"sgd_plain", [](NamedParameters p) { return std::make_unique<Sgd>(p, SgdOptions{.lr = 0.1}); }},
      {"adam", [](NamedParameters p) { return std::make_unique<Adam>(p, AdamOptions{.lr = 1e-2, .weight_decay = 1e-2, .amsgrad = true}); }},
      {"adamw", [](NamedParameters p) { return std::make_unique<AdamW>(p, AdamWOptions{.lr = 1e-2}); }},
      {"adadelta", [](NamedParameters p) { return std::make_unique<Adadelta>(p, AdadeltaOptions{.weight_decay = 1e-2}); }},
      {"rmsprop", [](NamedParameters p) {
         return std::make_unique<Rmsprop>(p, RmspropOptions{.weight_decay = 1e-2, .momentum = 0.9, .centered = true});
       }},
      {"rmsprop_plain", [](NamedParameters p) { return std::make_unique<Rmsprop>(p, RmspropOptions{}); }},
      {"adagrad", [](NamedParameters p) {
         return std::make_unique<Adagrad>(
             p, AdagradOptions{.lr = 0.1, .lr_decay = 0.5, .weight_decay = 1e-2, .initial_accumulator_value = 0.3});
       }},
  };
}

NamedParameters MakeParams(DType dtype, uint64_t seed) {
  Generator gen(seed);
  return {{"fc.weight", Randn({8, 5}, {}, gen).To(dtype)}, {"fc.bias", Randn({8}, {}, gen).To(dtype)}};
}

void SetGrads(const NamedParameters& params, int step, double scale = 1.0) {
  for (const auto& [name, p] : params) {
    std::vector<double> v = p.ToVector<double>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = scale * ((v[i] - 0.3) + 0.1 * std::sin(step + 0.7 * i));
    p.set_grad(FromVector(v, p.shape(), {.dtype = p.dtype()}));
  }
}

double Tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return 1e-12;
    case DType::kFloat32: return 1e-6;
    default: return 1e-2;
  }
}

void ExpectClose(const Tensor& a, const Tensor& b, double rel, const std::string& what) {
  const std::vector<double> va = a.ToVector<double>(), vb = b.ToVector<double>();
  ASSERT_EQ(va.size(), vb.size()) << what;
  for (size_t i = 0; i < va.size(); ++i) {
    EXPECT_NEAR(va[i], vb[i], rel * std::max(1.0, std::abs(vb[i]))) << what << " [" << i << "]";
  }
}

TEST_F(DevicePathTest, EveryOptimizerFollowsTheHostPath) {
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    for (const auto& [name, make] : AllOptimizers()) {
      SCOPED_TRACE(name + " " + std::string(DTypeName(dtype)));
      NamedParameters host = MakeParams(dtype, 1), dev = MakeParams(dtype, 1);
      std::unique_ptr<Optimizer> host_opt;
      NamedTensors host_state;
      OnHostPath([&] {
        host_opt = make(host);
        for (int s = 0; s < 3; ++s) {
          SetGrads(host, s);
          host_opt->Step();
        }
        host_state = host_opt->StateDict();
      });
      auto dev_opt = make(dev);
      g_calls = Calls();
      for (int s = 0; s < 3; ++s) {
        SetGrads(dev, s);
        dev_opt->Step();
      }
      // One fused kernel per parameter and step.
      EXPECT_EQ(g_calls.sgd, name.rfind("sgd", 0) == 0 ? 6 : 0);
      EXPECT_EQ(g_calls.adam, name.rfind("adam", 0) == 0 ? 6 : 0);
      EXPECT_EQ(g_calls.adadelta, name == "adadelta" ? 6 : 0);
      EXPECT_EQ(g_calls.rmsprop, name.rfind("rmsprop", 0) == 0 ? 6 : 0);
      EXPECT_EQ(g_calls.adagrad, name == "adagrad" ? 6 : 0);
      for (size_t i = 0; i < host.size(); ++i) {
        EXPECT_EQ(dev[i].second.dtype(), dtype);
        ExpectClose(dev[i].second, host[i].second, Tolerance(dtype), host[i].first);
      }
      const NamedTensors dev_state = dev_opt->StateDict();
      ASSERT_EQ(dev_state.size(), host_state.size());
      for (size_t i = 0; i < dev_state.size(); ++i) {
        EXPECT_EQ(dev_state[i].first, host_state[i].first);
        EXPECT_EQ(dev_state[i].second.dtype(), host_state[i].second.dtype()) << dev_state[i].first;
        EXPECT_EQ(dev_state[i].second.device(), kCPU);
        // Master copies and slots are f32/f64: compare at that precision.
        ExpectClose(dev_state[i].second, host_state[i].second,
                    dtype == DType::kFloat64 ? 1e-12 : 1e-5, dev_state[i].first);
      }
    }
  }
}

TEST_F(DevicePathTest, StateSavedOnOnePathContinuesOnTheOther) {
  for (const auto& [name, make] : AllOptimizers()) {
    SCOPED_TRACE(name);
    NamedParameters a = MakeParams(DType::kFloat32, 2), b = MakeParams(DType::kFloat32, 2);
    auto opt_a = make(a);
    for (int s = 0; s < 2; ++s) {
      SetGrads(a, s);
      opt_a->Step();
    }
    const NamedTensors state = opt_a->StateDict();
    for (size_t i = 0; i < a.size(); ++i) b[i].second.CopyFrom(a[i].second);
    auto opt_b = make(b);
    opt_b->LoadStateDict(state);
    // The loaded state is a copy: stepping b must not change a's saved tensors.
    const std::vector<double> saved = state.back().second.ToVector<double>();
    for (int s = 2; s < 4; ++s) {
      SetGrads(a, s);
      opt_a->Step();
      SetGrads(b, s);
      opt_b->Step();
    }
    EXPECT_EQ(state.back().second.ToVector<double>(), saved);
    for (size_t i = 0; i < a.size(); ++i) ExpectClose(b[i].second, a[i].second, 1e-6, a[i].first);
  }
}

// The CPU backend with an allocator that refuses, once, the next request
// of `bytes` bytes, as when memory has just run out; every other request
// goes to the CPU allocator. Installed for the object's life.
class RefuseOneCpuAllocation : public Allocator {
 public:
  explicit RefuseOneCpuAllocation(size_t bytes) : bytes_(bytes), saved_(GetDeviceBackend(kCPU)) {
    DeviceBackend cpu = saved_;
    cpu.allocator = this;
    RegisterDeviceBackend(DeviceType::kCPU, cpu);
  }
  ~RefuseOneCpuAllocation() override { RegisterDeviceBackend(DeviceType::kCPU, saved_); }
  void* Allocate(size_t nbytes, Device device) override {
    if (nbytes == bytes_ && !refused_) {
      refused_ = true;
      throw std::bad_alloc();
    }
    return CpuAllocator().Allocate(nbytes, device);
  }
  void Deallocate(void* ptr, size_t nbytes, Device device) override { CpuAllocator().Deallocate(ptr, nbytes, device); }
  bool refused() const { return refused_; }

 private:
  size_t bytes_;
  bool refused_ = false;
  DeviceBackend saved_;
};

// The device path prepares every parameter's update (its state, its step
// count) before it launches any. When a later parameter's preparation ran
// out of memory (its first slot), the earlier ones kept a step counted
// for an update never made: the next step ran Adam's bias corrections as
// its second. A failed step now leaves every count, parameter and
// state as it was; the next step is the first, as a fresh optimizer's.
TEST_F(DevicePathTest, AStepThatRanOutOfMemoryPreparingAParameterCountsNoStep) {
  const auto params = [] {
    return NamedParameters{{"w", FromVector({1.0f, -2.0f, 3.0f, 0.5f, -1.5f, 2.5f, 4.0f}, {7})},
                           {"v", FromVector({0.25f, -0.75f, 1.25f, 2.0f, -3.0f}, {5})}};
  };
  const auto grads = [](NamedParameters& p) {
    p[0].second.set_grad(FromVector({0.5f, 1.0f, -1.0f, 2.0f, 0.25f, -0.5f, 1.5f}, {7}));
    p[1].second.set_grad(FromVector({-1.0f, 0.5f, 2.0f, -0.25f, 1.0f}, {5}));
  };
  NamedParameters a = params(), b = params();
  grads(a);
  grads(b);
  Adam failing(a, {.lr = 0.1}), fresh(b, {.lr = 0.1});
  {
    RefuseOneCpuAllocation refuse(a[1].second.nbytes());
    EXPECT_THROW(failing.Step(), std::bad_alloc);
    ASSERT_TRUE(refuse.refused());
  }
  EXPECT_EQ(failing.step_count(0), 0);
  EXPECT_EQ(failing.step_count(1), 0);
  EXPECT_EQ(a[0].second.ToVector<float>(), b[0].second.ToVector<float>());
  failing.Step();
  fresh.Step();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].second.ToVector<float>(), b[i].second.ToVector<float>()) << a[i].first;
    EXPECT_EQ(failing.step_count(i), 1) << a[i].first;
  }
}

// As on the host path, SGD starts a momentum buffer (buf = d, the kernel's
// step 1) at the first step after loading a state without one, here one
// saved at momentum 0 without its options (as earlier versions saved it;
// with them, momentum 0 against 0.9 is refused). Before, the state held a
// zero buffer and the step made buf = 0.9 * 0 + 0.9 * d.
TEST_F(DevicePathTest, SgdStartsTheMomentumBufferAfterAStateWithoutOne) {
  Tensor w = Ones({4});
  Sgd plain({{"w", w}}, {.lr = 0.1});
  w.set_grad(Full({4}, 1.0));
  plain.Step();  // w = 0.9
  Sgd with_momentum({{"w", w}}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1});
  NamedTensors state = plain.StateDict();
  std::erase_if(state, [](const auto& e) { return e.first.rfind("group.", 0) == 0; });
  with_momentum.LoadStateDict(state);
  w.set_grad(Full({4}, 1.0));
  with_momentum.Step();  // buf = 1
  EXPECT_EQ(g_calls.sgd, 2);
  for (float x : w.ToVector<float>()) EXPECT_FLOAT_EQ(x, 0.8f);
}

// As on the host path: a value written into a bf16 parameter between steps
// (as Module::LoadStateDict writes it) is what the next step updates, not
// the master's old value.
TEST_F(DevicePathTest, OutsideWriteToABf16ParameterIsWhatTheNextStepUpdates) {
  Tensor w = Ones({4}, {.dtype = DType::kBFloat16});
  Sgd opt({{"w", w}}, {.lr = 0.1});
  w.set_grad(Full({4}, -1.0, {.dtype = DType::kBFloat16}));
  opt.Step();
  w.CopyFrom(Full({4}, 5.0, {.dtype = DType::kBFloat16}));
  w.set_grad(Full({4}, -1.0, {.dtype = DType::kBFloat16}));
  opt.Step();
  EXPECT_EQ(g_calls.sgd, 2);
  EXPECT_EQ(w.ToVector<float>(), std::vector<float>(4, 5.09375f));  // 5.1 to bf16
}

TEST_F(DevicePathTest, GradScalerReadsOneFlagPerStep) {
  NamedParameters host = MakeParams(DType::kFloat32, 3), dev = MakeParams(DType::kFloat32, 3);
  OnHostPath([&] {
    Adam opt(host, {.lr = 1e-2});
    GradScaler scaler({.init_scale = 1024});
    for (int s = 0; s < 3; ++s) {
      SetGrads(host, s, 1024.0);
      ASSERT_TRUE(scaler.Step(opt));
      scaler.Update();
    }
  });
  Adam opt(dev, {.lr = 1e-2});
  GradScaler scaler({.init_scale = 1024});
  for (int s = 0; s < 3; ++s) {
    SetGrads(dev, s, 1024.0);
    g_calls = Calls();
    if (s == 1) {
      scaler.Unscale(opt);  // explicit unscale, then the step reads the same flag
    }
    ASSERT_TRUE(scaler.Step(opt));
    // One check over all gradients together, whichever way.
    EXPECT_EQ(g_calls.unscale, 1);
    EXPECT_EQ(g_calls.unscale_tensors, 2u);
    scaler.Update();
  }
  for (size_t i = 0; i < host.size(); ++i) ExpectClose(dev[i].second, host[i].second, 1e-6, host[i].first);

  // An inf found on the "device": no step, the scale backs off.
  const std::vector<double> before = dev[0].second.ToVector<double>();
  SetGrads(dev, 7, 1024.0);
  Tensor g = dev[0].second.grad();
  g.data<float>()[3] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(scaler.Step(opt));
  EXPECT_TRUE(scaler.found_inf());
  scaler.Update();
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(dev[0].second.ToVector<double>(), before);
  // A NaN found by an explicit Unscale is reported by the Step that follows.
  SetGrads(dev, 8, 512.0);
  dev[1].second.grad().data<float>()[0] = std::nanf("");
  scaler.Unscale(opt);
  EXPECT_FALSE(scaler.Step(opt));
  scaler.Update();
  EXPECT_EQ(scaler.scale(), 256.0);
  // The flag is reset for the next iteration (by a kernel, not a host copy).
  SetGrads(dev, 9, 256.0);
  EXPECT_TRUE(scaler.Step(opt));
  EXPECT_FALSE(scaler.found_inf());
  scaler.Update();
}

// Unscale on the device path leaves its verdict in the device flag; a Step
// that then finds the parameters on the host path must not step as if no
// inf had been found. Before, it stepped with the inf gradient.
TEST_F(DevicePathTest, GradScalerRefusesAStepOnTheHostAfterADeviceUnscale) {
  Tensor a = FromVector({1.0, 2.0}, {2});
  Sgd opt({{"a", a}}, {.lr = 0.5});
  GradScaler scaler({.init_scale = 1024});
  a.set_grad(FromVector({std::numeric_limits<double>::infinity(), 0.0}, {2}));
  scaler.Unscale(opt);
  OnHostPath([&] {
    EXPECT_THAT([&] { scaler.Step(opt); },
                ::testing::ThrowsMessage<std::logic_error>(
                    HasSubstr("Unscale ran on the device but Step finds the parameters on cpu")));
  });
  EXPECT_EQ(a.ToVector<float>(), (std::vector<float>{1.0f, 2.0f}));
}

// A Step whose optimizer throws can be retried on the device path too:
// after an explicit Unscale, the retry reads Unscale's verdict from the
// device flag again; fused, it checks again. Before, the retry was refused
// as a second Step.
TEST_F(DevicePathTest, GradScalerStepRetriedAfterAThrowSteps) {
  for (bool unscale_first : {false, true}) {
    SCOPED_TRACE(unscale_first ? "after Unscale" : "fused");
    Tensor a = Zeros({2});
    Sgd opt({{"a", a}}, {.lr = 1.0});
    GradScaler scaler({.init_scale = 1024});
    a.set_grad(FromVector({1024.0, 2048.0}, {2}));
    if (unscale_first) scaler.Unscale(opt);
    const Tensor good = a.grad().Clone();
    a.grad().SetData(Zeros({3}));  // set_grad checks shapes; this reshapes the gradient after
    EXPECT_THROW(scaler.Step(opt), std::invalid_argument);
    a.grad().SetData(good);
    EXPECT_TRUE(scaler.Step(opt));
    EXPECT_FALSE(scaler.found_inf());
    EXPECT_EQ(a.ToVector<float>(), (std::vector<float>{-1, -2}));
    scaler.Update();
    EXPECT_EQ(scaler.growth_tracker(), 1);
  }
}

// Two optimizers on the device path: each has its own flag, so the Unscale
// of the second does not reset the first's before its Step reads it, and
// each Step reads its own. Before, one flag and one stage served both.
TEST_F(DevicePathTest, GradScalerKeepsAFlagPerOptimizer) {
  Tensor a = FromVector({1.0, 2.0}, {2}), b = FromVector({1.0, 2.0}, {2});
  Sgd first({{"a", a}}, {.lr = 0.5}), second({{"b", b}}, {.lr = 0.5});
  GradScaler scaler({.init_scale = 1024});
  for (int iteration = 0; iteration < 2; ++iteration) {
    SCOPED_TRACE(iteration);
    g_calls = Calls();
    a.set_grad(FromVector({std::numeric_limits<double>::infinity(), 0.0}, {2}));
    b.set_grad(FromVector({1024.0, 2048.0}, {2}));
    scaler.Unscale(first);
    scaler.Unscale(second);
    EXPECT_FALSE(scaler.Step(first));
    EXPECT_TRUE(scaler.Step(second));
    EXPECT_EQ(g_calls.unscale, 2);
    EXPECT_EQ(g_calls.sgd, 1);
    scaler.Update();
  }
  EXPECT_EQ(a.ToVector<float>(), (std::vector<float>{1.0f, 2.0f}));
  // Scales 1024 then 512 (the first's inf backs off): b stepped by 0.5 * {1, 2}, then 0.5 * {2, 4}.
  EXPECT_EQ(b.ToVector<float>(), (std::vector<float>{-0.5f, -1.0f}));
  EXPECT_EQ(scaler.scale(), 256.0);
  // Fused: the second reads its own flag, not the first's.
  a.set_grad(FromVector({0.0, 0.0}, {2}));
  b.set_grad(FromVector({std::nan(""), 0.0}, {2}));
  EXPECT_TRUE(scaler.Step(first));
  EXPECT_FALSE(scaler.Step(second));
  scaler.Update();
  EXPECT_EQ(scaler.scale(), 128.0);
}

TEST_F(DevicePathTest, ClipGradNormMatchesTheHostPath) {
  for (double norm_type : {2.0, 1.0, 3.0}) {
    SCOPED_TRACE(norm_type);
    NamedParameters host = MakeParams(DType::kFloat32, 4), dev = MakeParams(DType::kFloat32, 4);
    SetGrads(host, 1);
    SetGrads(dev, 1);
    double host_norm = 0;
    OnHostPath([&] { host_norm = ClipGradNorm({host[0].second, host[1].second}, 0.5, norm_type); });
    const double dev_norm = ClipGradNorm({dev[0].second, dev[1].second}, 0.5, norm_type);
    EXPECT_NEAR(dev_norm, host_norm, 1e-6 * host_norm);
    EXPECT_GT(host_norm, 0.5);  // so the gradients were scaled
    for (size_t i = 0; i < host.size(); ++i) {
      ExpectClose(dev[i].second.grad(), host[i].second.grad(), 1e-6, host[i].first);
    }
  }
  NamedParameters p = MakeParams(DType::kBFloat16, 5);
  SetGrads(p, 1);
  EXPECT_GT(ClipGradNorm({p[0].second, p[1].second}, 1e9), 0.0);
}

// f32 gradients whose squares (or cubes) overflow f32: the norm is still
// the host path's finite one, and the clip scales the gradients down
// instead of zeroing them (the powers were taken in f32 on the device).
TEST_F(DevicePathTest, ClipGradNormOfHugeF32GradientsIsFinite) {
  auto make = [] {
    Tensor w = Zeros({3});
    w.set_grad(FromVector({3e19f, -4e19f, 1.0f}, {3}));
    return w;
  };
  for (double norm_type : {2.0, 3.0}) {
    SCOPED_TRACE(norm_type);
    Tensor host = make(), dev = make();
    double host_norm = 0;
    OnHostPath([&] { host_norm = ClipGradNorm({host}, 1.0, norm_type); });
    ASSERT_TRUE(std::isfinite(host_norm));
    EXPECT_NEAR(ClipGradNorm({dev}, 1.0, norm_type), host_norm, 1e-6 * host_norm);
    ExpectClose(dev.grad(), host.grad(), 1e-6, "w");
  }
}

// Gradients held transposed (set_grad accepts any strides): the scaler and
// clipping give the host path's results, written back through the strides,
// and hand the kernels contiguous tensors only. Before, they threw.
TEST_F(DevicePathTest, NonContiguousGradientsFollowTheHostPath) {
  auto make = [] {
    Tensor w = Zeros({4, 3});
    w.set_grad(FromVector({1, -2, 3, -4, 5, -6, 7, -8, 9, -10, 11, -12}, {3, 4}).Transpose(0, 1));
    return w;
  };
  for (double norm_type : {2.0, 3.0, kInfNorm}) {
    SCOPED_TRACE(norm_type);
    Tensor host = make(), dev = make();
    double host_norm = 0;
    OnHostPath([&] { host_norm = ClipGradNorm({host}, 1.0, norm_type); });
    EXPECT_NEAR(ClipGradNorm({dev}, 1.0, norm_type), host_norm, 1e-6 * host_norm);
    EXPECT_FALSE(dev.grad().is_contiguous());
    ExpectClose(dev.grad(), host.grad(), 1e-6, "w");
  }
  Tensor host = make(), dev = make();
  OnHostPath([&] {
    Sgd opt({{"w", host}}, {.lr = 0.5});
    GradScaler scaler({.init_scale = 4});
    scaler.Unscale(opt);
    scaler.Step(opt);
  });
  Sgd opt({{"w", dev}}, {.lr = 0.5});
  GradScaler scaler({.init_scale = 4});
  scaler.Unscale(opt);
  EXPECT_TRUE(scaler.Step(opt));
  EXPECT_EQ(g_calls.unscale, 1);
  EXPECT_FALSE(dev.grad().is_contiguous());
  ExpectClose(dev.grad(), host.grad(), 1e-6, "w.grad");
  ExpectClose(dev, host, 1e-6, "w");
  // Fused: the check finds an inf in a strided gradient.
  scaler.Update();
  dev.grad().Transpose(0, 1).data<float>()[5] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(scaler.Step(opt));
}

// Adadelta through `adadelta_step`, with and without weight decay, in f32
// and f64, on odd sizes, for several steps, and with a loss-scaler factor.
TEST_F(DevicePathTest, AdadeltaUsesItsFusedKernelAndFollowsTheHostPath) {
  struct Case {
    AdadeltaOptions options;
    double grad_scale;
  };
  const Case cases[] = {{{}, 1.0},
                        {{.lr = 0.5, .rho = 0.8, .eps = 1e-5, .weight_decay = 3e-2}, 1.0},
                        {{.lr = 2.0, .rho = 0.95, .weight_decay = 1e-3}, 0.125}};
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " weight_decay " + std::to_string(c.options.weight_decay) +
                   " grad_scale " + std::to_string(c.grad_scale));
      auto make = [&](uint64_t seed) {
        Generator gen(seed);
        return NamedParameters{{"a", Randn({1}, {}, gen).To(dtype)},
                               {"b", Randn({7, 3}, {}, gen).To(dtype)},
                               {"c", Randn({257}, {}, gen).To(dtype)}};
      };
      NamedParameters host = make(6), dev = make(6);
      OnHostPath([&] {
        Adadelta opt(host, c.options);
        opt.set_grad_scale(c.grad_scale);
        for (int s = 0; s < 5; ++s) {
          SetGrads(host, s, 1.0 / c.grad_scale);
          opt.Step();
        }
      });
      Adadelta opt(dev, c.options);
      opt.set_grad_scale(c.grad_scale);
      g_calls = Calls();
      for (int s = 0; s < 5; ++s) {
        SetGrads(dev, s, 1.0 / c.grad_scale);
        opt.Step();
      }
      EXPECT_EQ(g_calls.adadelta, 15);
      EXPECT_EQ(g_calls.last_adadelta.lr, c.options.lr);
      EXPECT_EQ(g_calls.last_adadelta.rho, c.options.rho);
      EXPECT_EQ(g_calls.last_adadelta.eps, c.options.eps);
      EXPECT_EQ(g_calls.last_adadelta.weight_decay, c.options.weight_decay);
      EXPECT_EQ(g_calls.last_adadelta.grad_scale, c.grad_scale);
      for (size_t i = 0; i < host.size(); ++i) {
        ExpectClose(dev[i].second, host[i].second, Tolerance(dtype), host[i].first);
      }
    }
  }
}

NamedParameters ThreeGradients(DType dtype) {
  NamedParameters p = {{"a", Zeros({5}, {.dtype = dtype})},
                       {"b", Zeros({3, 3}, {.dtype = dtype})},
                       {"c", Zeros({131}, {.dtype = dtype})}};
  SetGrads(p, 2);
  return p;
}

std::vector<Tensor> Params(const NamedParameters& p) {
  std::vector<Tensor> out;
  for (const auto& [name, t] : p) out.push_back(t);
  return out;
}

// The infinity norm through `max_abs`: one call for all gradients, the same
// norm and clipped gradients as the host path, whether max_norm is exceeded
// or not, and NaN and inf handled as on the host.
TEST_F(DevicePathTest, ClipGradNormInfinityNormMatchesTheHostPath) {
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    for (double max_norm : {0.1, 1e3}) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " max_norm " + std::to_string(max_norm));
      NamedParameters host = ThreeGradients(dtype), dev = ThreeGradients(dtype);
      double host_norm = 0;
      OnHostPath([&] { host_norm = ClipGradNorm(Params(host), max_norm, kInfNorm); });
      g_calls = Calls();
      const double dev_norm = ClipGradNorm(Params(dev), max_norm, kInfNorm);
      EXPECT_EQ(g_calls.max_abs, 1);
      EXPECT_EQ(g_calls.max_abs_tensors, 3u);
      EXPECT_EQ(dev_norm, host_norm);
      EXPECT_EQ(host_norm > max_norm, max_norm == 0.1) << host_norm;
      for (size_t i = 0; i < host.size(); ++i) {
        ExpectClose(dev[i].second.grad(), host[i].second.grad(), Tolerance(dtype), host[i].first);
      }
    }
  }
  const double kInf = std::numeric_limits<double>::infinity();
  for (double bad : {std::numeric_limits<double>::quiet_NaN(), kInf, -kInf}) {
    SCOPED_TRACE(bad);
    NamedParameters host = ThreeGradients(DType::kFloat32), dev = ThreeGradients(DType::kFloat32);
    host[1].second.grad().data<float>()[4] = static_cast<float>(bad);
    dev[1].second.grad().data<float>()[4] = static_cast<float>(bad);
    double host_norm = 0;
    OnHostPath([&] { host_norm = ClipGradNorm(Params(host), 1.0, kInfNorm); });
    const double dev_norm = ClipGradNorm(Params(dev), 1.0, kInfNorm);
    if (std::isnan(bad)) {
      EXPECT_TRUE(std::isnan(host_norm));
      EXPECT_TRUE(std::isnan(dev_norm));
    } else {
      EXPECT_EQ(host_norm, kInf);
      EXPECT_EQ(dev_norm, kInf);
    }
    // Both paths scale by the same (0 or NaN) coefficient.
    for (size_t i = 0; i < host.size(); ++i) {
      const std::vector<float> h = host[i].second.grad().ToVector<float>(),
                               d = dev[i].second.grad().ToVector<float>();
      ASSERT_EQ(h.size(), d.size());
      for (size_t k = 0; k < h.size(); ++k) {
        EXPECT_TRUE(h[k] == d[k] || (std::isnan(h[k]) && std::isnan(d[k]))) << host[i].first << "[" << k << "]";
      }
    }
    NamedParameters again = ThreeGradients(DType::kFloat32);
    again[2].second.grad().data<float>()[130] = static_cast<float>(bad);
    EXPECT_THAT([&] { ClipGradNorm(Params(again), 1.0, kInfNorm, /*error_if_nonfinite=*/true); },
                ::testing::ThrowsMessage<std::runtime_error>(HasSubstr("total norm")));
  }
  // A NaN in the first tensor is not hidden by larger values after it.
  NamedParameters p = ThreeGradients(DType::kFloat32);
  p[0].second.grad().data<float>()[0] = std::nanf("");
  p[2].second.grad().data<float>()[7] = 1e30f;
  EXPECT_TRUE(std::isnan(ClipGradNorm(Params(p), 1.0, kInfNorm)));
  // Parameters without gradients are ignored; no gradients at all: norm 0, no kernel.
  g_calls = Calls();
  EXPECT_EQ(ClipGradNorm({Zeros({3})}, 1.0, kInfNorm), 0.0);
  EXPECT_EQ(g_calls.max_abs, 0);
}

// Parameters of several shapes (numels all different, so a call's numels
// name its parameters) and dtypes: f32, f64 and bf16 (updated through its
// f32 master, so grouped with the f32 ones).
NamedParameters MixedParams() {
  Generator gen(11);
  const std::pair<Shape, DType> specs[] = {
      {{3, 5}, DType::kFloat32}, {{7}, DType::kFloat64},     {{2, 2}, DType::kBFloat16}, {{1}, DType::kFloat32},
      {{4, 3}, DType::kFloat64}, {{33}, DType::kFloat32},    {{9}, DType::kBFloat16},    {{2, 3, 3}, DType::kFloat32},
      {{6}, DType::kFloat64},    {{257}, DType::kFloat32}};
  NamedParameters params;
  for (const auto& [shape, dtype] : specs) {
    params.emplace_back("p" + std::to_string(params.size()), Randn(shape, {}, gen).To(dtype));
  }
  return params;
}

// Which parameters get a gradient at step s: all, but p1 and p3 skip step
// 0 and p6 skips step 2, so their step counts fall behind the others'.
bool HasGradAt(size_t i, int s) { return !((s == 0 && (i == 1 || i == 3)) || (s == 2 && i == 6)); }

// `sgd_step_multi` is called once per group of parameters with one dtype
// and equal args (args.step is 1 where the momentum buffer starts, else 2
// whatever the step count, so counts that drifted apart after skipped steps
// split no group), each group in parameter order, and gives bit for bit what
// `sgd_step` per parameter gives, for SGD with and without momentum,
// dampening, nesterov, weight decay, maximize and a loss-scaler factor.
TEST_F(DevicePathTest, SgdStepMultiGroupsParametersAndMatchesPerParameterSteps) {
  const SgdOptions cases[] = {{.lr = 0.1},
                              {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true},
                              {.lr = 0.02, .momentum = 0.8, .dampening = 0.25, .weight_decay = 1e-2},
                              {.lr = 0.03, .momentum = 0.5, .maximize = true}};
  constexpr int kSteps = 4;
  for (const SgdOptions& o : cases) {
    SCOPED_TRACE("momentum " + std::to_string(o.momentum) + " dampening " + std::to_string(o.dampening) +
                 " weight_decay " + std::to_string(o.weight_decay) + (o.nesterov ? " nesterov" : "") +
                 (o.maximize ? " maximize" : ""));
    auto run = [&](const DeviceOptimKernels& kernels, NamedParameters& params) {
      RegisterDeviceOptimKernels(DeviceType::kCPU, kernels);
      Sgd opt(params, o);
      opt.set_grad_scale(0.5);
      for (int s = 0; s < kSteps; ++s) {
        SetGrads(params, s, 2.0);
        for (size_t i = 0; i < params.size(); ++i) {
          if (!HasGradAt(i, s)) params[i].second.set_grad(Tensor());
        }
        opt.Step();
      }
      return opt.StateDict();
    };
    NamedParameters single = MixedParams(), grouped = MixedParams();
    g_calls = Calls();
    const NamedTensors single_state = run({.sgd_step = &TestSgdStep}, single);
    EXPECT_EQ(g_calls.sgd, 37);  // 10 parameters, 4 steps, 3 updates skipped
    EXPECT_TRUE(g_calls.sgd_multi.empty());
    g_calls = Calls();
    const NamedTensors grouped_state =
        run({.sgd_step = &TestSgdStep, .sgd_step_multi = &TestSgdStepMulti}, grouped);
    EXPECT_EQ(g_calls.sgd, 0);

    // The expected groups: by compute dtype and whether the buffer starts
    // (step 1), in order of first appearance, parameters in order.
    std::vector<SgdMultiCall> want;
    std::vector<int64_t> steps(single.size(), 0);
    for (int s = 0; s < kSteps; ++s) {
      const size_t first_of_step = want.size();
      for (size_t i = 0; i < single.size(); ++i) {
        if (!HasGradAt(i, s)) continue;
        const DType compute = single[i].second.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
        // Without momentum no buffer starts, so every update passes 2.
        const bool first = ++steps[i] == 1;
        const int64_t step = first && o.momentum != 0 ? 1 : 2;
        auto it = std::find_if(want.begin() + first_of_step, want.end(), [&](const SgdMultiCall& c) {
          return c.dtype == compute && c.args.step == step;
        });
        if (it == want.end()) {
          want.push_back({.dtype = compute, .args = {.step = step}});
          it = std::prev(want.end());
        }
        it->numels.push_back(single[i].second.numel());
      }
    }
    ASSERT_EQ(g_calls.sgd_multi.size(), want.size());
    for (size_t c = 0; c < want.size(); ++c) {
      SCOPED_TRACE("call " + std::to_string(c));
      const SgdMultiCall& got = g_calls.sgd_multi[c];
      EXPECT_EQ(got.dtype, want[c].dtype);
      EXPECT_EQ(got.numels, want[c].numels);
      EXPECT_EQ(got.args.step, want[c].args.step);
      EXPECT_EQ(got.args.lr, o.lr);
      EXPECT_EQ(got.args.momentum, o.momentum);
      EXPECT_EQ(got.args.dampening, o.dampening);
      EXPECT_EQ(got.args.weight_decay, o.weight_decay);
      EXPECT_EQ(got.args.nesterov, o.nesterov);
      EXPECT_EQ(got.args.grad_scale, o.maximize ? -0.5 : 0.5);
    }

    for (size_t i = 0; i < single.size(); ++i) {
      EXPECT_EQ(grouped[i].second.dtype(), single[i].second.dtype());
      EXPECT_EQ(grouped[i].second.ToVector<double>(), single[i].second.ToVector<double>()) << single[i].first;
    }
    ASSERT_EQ(grouped_state.size(), single_state.size());
    for (size_t k = 0; k < single_state.size(); ++k) {
      EXPECT_EQ(grouped_state[k].first, single_state[k].first);
      EXPECT_EQ(grouped_state[k].second.ToVector<double>(), single_state[k].second.ToVector<double>())
          << single_state[k].first;
    }
  }
}

// Before, SGD grouped parameters by their step counts although the kernel
// reads only whether the step is the first: one parameter that got no
// gradient once fell a count behind and took a launch of its own from then
// on. Its buffer started at its own first step, so it groups with the
// others again; the real counts are still kept and saved.
TEST_F(DevicePathTest, SgdGroupsParametersWhoseStepCountsDrifted) {
  RegisterDeviceOptimKernels(DeviceType::kCPU,
                             DeviceOptimKernels{.sgd_step = &TestSgdStep, .sgd_step_multi = &TestSgdStepMulti});
  Tensor a = Ones({4}), b = Ones({3}), c = Ones({2});
  Sgd opt({{"a", a}, {"b", b}, {"c", c}}, {.lr = 0.5, .momentum = 0.9});
  const NamedParameters params = opt.params();
  SetGrads(params, 0);
  b.set_grad(Tensor());  // b skips the first step
  opt.Step();
  SetGrads(params, 1);
  opt.Step();  // b's buffer starts here, the others' continue: two calls
  ASSERT_EQ(g_calls.sgd_multi.size(), 3u);
  g_calls = Calls();
  SetGrads(params, 2);
  opt.Step();
  EXPECT_EQ(opt.step_count(0), 3);
  EXPECT_EQ(opt.step_count(1), 2);
  EXPECT_EQ(opt.step_count(2), 3);
  ASSERT_EQ(g_calls.sgd_multi.size(), 1u) << "parameters at steps 3, 2 and 3 were split";
  EXPECT_EQ(g_calls.sgd_multi[0].numels, (std::vector<int64_t>{4, 3, 2}));
  EXPECT_EQ(g_calls.sgd_multi[0].args.step, 2);
  EXPECT_EQ(g_calls.sgd, 0);
  const NamedTensors state = opt.StateDict();
  const auto b_step = std::find_if(state.begin(), state.end(), [](const auto& e) { return e.first == "state.b.step"; });
  ASSERT_NE(b_step, state.end());
  EXPECT_EQ(b_step->second.ToVector<int64_t>(), std::vector<int64_t>{2});
}

// Param groups on the device path: each `sgd_step_multi` launch takes one
// group's rate, options and sign (maximize), and every optimizer follows
// its host path.
TEST_F(DevicePathTest, EachGroupIsUpdatedWithItsOwnOptionsOnTheDevicePath) {
  RegisterDeviceOptimKernels(DeviceType::kCPU, DeviceOptimKernels{.sgd_step = &TestSgdStep,
                                                                  .adam_step = &TestAdamStep,
                                                                  .adadelta_step = &TestAdadeltaStep,
                                                                  .sgd_step_multi = &TestSgdStepMulti});
  const std::vector<std::pair<std::string, std::function<std::unique_ptr<Optimizer>(std::vector<ParamGroup>)>>>
      makers = {
          {"sgd",
           [](std::vector<ParamGroup> g) {
             return std::make_unique<Sgd>(std::move(g), SgdOptions{.lr = 0.1, .momentum = 0.9});
           }},
          {"adamw", [](std::vector<ParamGroup> g) { return std::make_unique<AdamW>(std::move(g), AdamWOptions{}); }},
          {"adadelta",
           [](std::vector<ParamGroup> g) { return std::make_unique<Adadelta>(std::move(g), AdadeltaOptions{}); }},
      };
  for (const auto& [name, make] : makers) {
    SCOPED_TRACE(name);
    auto groups = [&](const NamedParameters& p) {
      return std::vector<ParamGroup>{
          {.params = {p[0]}},
          {.params = {p[1]}, .options = {{"lr", 0.02}, {"weight_decay", 0.5}, {"maximize", 1}}}};
    };
    g_calls = Calls();
    NamedParameters device = MakeParams(DType::kFloat32, 3);
    auto opt = make(groups(device));
    for (int s = 0; s < 3; ++s) {
      SetGrads(device, s);
      opt->Step();
    }
    if (name == "sgd") {
      // One launch per group and step (the first step starts the buffers).
      ASSERT_EQ(g_calls.sgd_multi.size(), 6u);
      for (size_t c = 0; c < 6; c += 2) {
        EXPECT_EQ(g_calls.sgd_multi[c].args.lr, 0.1);
        EXPECT_EQ(g_calls.sgd_multi[c].args.weight_decay, 0.0);
        EXPECT_EQ(g_calls.sgd_multi[c].args.grad_scale, 1.0);
        EXPECT_EQ(g_calls.sgd_multi[c + 1].args.lr, 0.02);
        EXPECT_EQ(g_calls.sgd_multi[c + 1].args.weight_decay, 0.5);
        EXPECT_EQ(g_calls.sgd_multi[c + 1].args.grad_scale, -1.0);
      }
    }
    NamedParameters host = MakeParams(DType::kFloat32, 3);
    OnHostPath([&] {
      auto host_opt = make(groups(host));
      for (int s = 0; s < 3; ++s) {
        SetGrads(host, s);
        host_opt->Step();
      }
    });
    for (size_t i = 0; i < host.size(); ++i) {
      const auto want = host[i].second.ToVector<double>();
      const auto got = device[i].second.ToVector<double>();
      for (size_t k = 0; k < want.size(); ++k) ASSERT_NEAR(got[k], want[k], 1e-6) << host[i].first << " " << k;
    }
  }
}

// A group added by AddParamGroup after some steps gets its own launches
// with its own options, its buffer started at its first step there, and
// follows the host path of an optimizer made with both groups whose second
// group had no gradient until then.
TEST_F(DevicePathTest, AddedGroupGetsItsOwnLaunchesAndFollowsTheHostPath) {
  RegisterDeviceOptimKernels(DeviceType::kCPU, DeviceOptimKernels{.sgd_step = &TestSgdStep,
                                                                  .adam_step = &TestAdamStep,
                                                                  .sgd_step_multi = &TestSgdStepMulti});
  const SgdOptions defaults{.lr = 0.1, .momentum = 0.9};
  const std::map<std::string, double> second = {{"lr", 0.02}, {"weight_decay", 0.5}, {"maximize", 1}};
  NamedParameters device = MakeParams(DType::kFloat32, 3);
  Sgd opt({device[0]}, defaults);
  for (int s = 0; s < 2; ++s) {
    SetGrads({device[0]}, s);
    opt.Step();
  }
  opt.AddParamGroup({.params = {device[1]}, .options = second});
  g_calls = Calls();
  for (int s = 2; s < 4; ++s) {
    SetGrads(device, s);
    opt.Step();
  }
  // One launch per group and step; the added group's buffer starts at its
  // first step (step 1), group 0's does not.
  ASSERT_EQ(g_calls.sgd_multi.size(), 4u);
  for (size_t c = 0; c < 4; c += 2) {
    EXPECT_EQ(g_calls.sgd_multi[c].args.lr, 0.1);
    EXPECT_EQ(g_calls.sgd_multi[c].args.step, 2);
    EXPECT_EQ(g_calls.sgd_multi[c].args.grad_scale, 1.0);
    EXPECT_EQ(g_calls.sgd_multi[c + 1].args.lr, 0.02);
    EXPECT_EQ(g_calls.sgd_multi[c + 1].args.weight_decay, 0.5);
    EXPECT_EQ(g_calls.sgd_multi[c + 1].args.grad_scale, -1.0);
    EXPECT_EQ(g_calls.sgd_multi[c + 1].args.step, c == 0 ? 1 : 2);
  }
  EXPECT_EQ(opt.step_count(1), 2);
  NamedParameters host = MakeParams(DType::kFloat32, 3);
  OnHostPath([&] {
    Sgd host_opt({{.params = {host[0]}}, {.params = {host[1]}, .options = second}}, defaults);
    for (int s = 0; s < 4; ++s) {
      SetGrads(s < 2 ? NamedParameters{host[0]} : host, s);
      host_opt.Step();
    }
  });
  for (size_t i = 0; i < host.size(); ++i) {
    const auto want = host[i].second.ToVector<double>();
    const auto got = device[i].second.ToVector<double>();
    for (size_t k = 0; k < want.size(); ++k) ASSERT_NEAR(got[k], want[k], 1e-6) << host[i].first << " " << k;
  }
}

// Without `sgd_step_multi`, or with it alone, SGD still steps.
TEST_F(DevicePathTest, SgdTakesEitherKernelAlone) {
  for (bool multi : {false, true}) {
    SCOPED_TRACE(multi ? "sgd_step_multi alone" : "sgd_step alone");
    RegisterDeviceOptimKernels(DeviceType::kCPU, multi ? DeviceOptimKernels{.sgd_step_multi = &TestSgdStepMulti}
                                                       : DeviceOptimKernels{.sgd_step = &TestSgdStep});
    ASSERT_TRUE(internal::UsesDevicePath(kCPU));
    g_calls = Calls();
    Tensor w = Ones({4}), b = Ones({2});
    Sgd opt({{"w", w}, {"b", b}}, {.lr = 0.5, .momentum = 0.9});
    w.set_grad(Full({4}, 1.0));
    b.set_grad(Full({2}, 2.0));
    opt.Step();
    EXPECT_EQ(g_calls.sgd, multi ? 0 : 2);
    EXPECT_EQ(g_calls.sgd_multi.size(), multi ? 1u : 0u);
    EXPECT_EQ(w.ToVector<float>(), std::vector<float>(4, 0.5f));
    EXPECT_EQ(b.ToVector<float>(), std::vector<float>(2, 0.0f));
  }
}

TEST(DeviceKernelRegistry, AnyCpuEntryTurnsTheDevicePathOn) {
  EXPECT_FALSE(internal::UsesDevicePath(kCPU));
  RegisterDeviceOptimKernels(DeviceType::kCPU, DeviceOptimKernels{.adadelta_step = &TestAdadeltaStep});
  EXPECT_TRUE(internal::UsesDevicePath(kCPU));
  RegisterDeviceOptimKernels(DeviceType::kCPU, DeviceOptimKernels{.max_abs = &TestMaxAbs});
  EXPECT_TRUE(internal::UsesDevicePath(kCPU));
  RegisterDeviceOptimKernels(DeviceType::kCPU, DeviceOptimKernels{.sgd_step_multi = &TestSgdStepMulti});
  EXPECT_TRUE(internal::UsesDevicePath(kCPU));
  EXPECT_EQ(DeviceOptimKernelsFor(DeviceType::kCPU).adadelta_step, nullptr);
  RegisterDeviceOptimKernels(DeviceType::kCPU, DeviceOptimKernels{});
  EXPECT_FALSE(internal::UsesDevicePath(kCPU));
}

// A real loop (the CNN under f16 autocast with the loss scaler, SGD with
// momentum) through the device path: the losses follow the host path's.
TEST_F(DevicePathTest, AutocastTrainingThroughTheDevicePathFollowsTheHostPath) {
  const std::vector<data::Batch> batches = nn::testing::SyntheticBatches(8);
  nn::testing::Trajectory host;
  OnHostPath([&] { host = nn::testing::TrainCnn(kCPU, DType::kFloat16, true, batches, 0.01); });
  g_calls = Calls();
  const nn::testing::Trajectory dev = nn::testing::TrainCnn(kCPU, DType::kFloat16, true, batches, 0.01);
  EXPECT_EQ(g_calls.sgd, 8 * 8);      // 8 parameters, 8 steps
  EXPECT_EQ(g_calls.unscale, 8);      // one check per step
  EXPECT_EQ(dev.steps_taken, host.steps_taken);
  ASSERT_EQ(dev.losses.size(), host.losses.size());
  for (size_t i = 0; i < host.losses.size(); ++i) EXPECT_NEAR(dev.losses[i], host.losses[i], 1e-5) << "step " << i;
}

// A tensor that claims to live on cuda:0 (no memory is ever touched: every
// check below must fire before that).
Tensor FakeCuda(std::vector<float>& backing, const Shape& shape) {
  return Tensor::FromBlob(backing.data(), shape, DType::kFloat32, Device(DeviceType::kCUDA, 0));
}

TEST(DeviceErrors, MixedDeviceParameterListNamesBoth) {
  std::vector<float> backing(4);
  EXPECT_THAT([&] { Sgd({{"fc.weight", Zeros({4})}, {"fc.bias", FakeCuda(backing, {4})}}, {}); },
              ::testing::ThrowsMessage<std::invalid_argument>(
                  AllOf(HasSubstr("`fc.weight` on cpu"), HasSubstr("`fc.bias` on cuda:0"))));
}

TEST(DeviceErrors, ParameterMovedAloneAfterConstructionIsNamedAtStep) {
  std::vector<float> backing(4);
  Tensor w = Zeros({4}), b = Zeros({4});
  Sgd opt({{"fc.weight", w}, {"fc.bias", b}}, {.lr = 0.1});
  b.SetData(FakeCuda(backing, {4}));  // as Module::To would, for one parameter only
  EXPECT_THAT([&] { opt.Step(); }, ::testing::ThrowsMessage<std::invalid_argument>(
                                       AllOf(HasSubstr("`fc.weight` on cpu"), HasSubstr("`fc.bias` on cuda:0"))));
}

TEST(DeviceErrors, GradientOnAnotherDeviceNamesTheParameter) {
  std::vector<float> backing(4);
  Tensor w = Zeros({4});
  w.impl()->mutable_autograd().grad = FakeCuda(backing, {4});  // set_grad would refuse it
  Sgd opt({{"fc.weight", w}}, {.lr = 0.1});
  EXPECT_THAT([&] { opt.Step(); }, ::testing::ThrowsMessage<std::invalid_argument>(AllOf(
                                       HasSubstr("`fc.weight`"), HasSubstr("is on cuda:0, the parameter on cpu"))));
  GradScaler scaler;
  EXPECT_THAT([&] { scaler.Step(opt); }, ::testing::ThrowsMessage<std::invalid_argument>(
                                             AllOf(HasSubstr("`fc.weight`"), HasSubstr("cuda:0"))));
}

// A parameter moved alone after construction, its gradient with it: the
// scaler's message gives the parameter's device and the optimizer's apart.
// Before, it printed the optimizer's device as the parameter's ("is on
// cuda:0, the parameter on cpu").
TEST(DeviceErrors, GradScalerNamesTheParametersDeviceAndTheOptimizers) {
  std::vector<float> wb(4), gb(4);
  Tensor w = Zeros({4}), b = Zeros({4});
  Sgd opt({{"fc.weight", w}, {"fc.bias", b}}, {.lr = 0.1});
  b.SetData(FakeCuda(wb, {4}));  // as Module::To would, for one parameter only
  b.set_grad(FakeCuda(gb, {4}));
  GradScaler scaler;
  EXPECT_THAT([&] { scaler.Unscale(opt); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr(
                  "GradScaler: gradient of `fc.bias` is on cuda:0, the parameter on cuda:0, the optimizer on cpu")));
}

// A CUDA table that is registered but lacks the entry (this one has no
// rmsprop_step) is not sent to nn::cuda::Init(), which already ran.
// Before, the message said to call it in a CUDA build.
TEST(DeviceErrors, AnEntryMissingFromARegisteredTableIsNotSentToInit) {
  ASSERT_EQ(DeviceOptimKernelsFor(DeviceType::kCUDA).sgd_step, nullptr);
  RegisterDeviceOptimKernels(DeviceType::kCUDA, DeviceOptimKernels{.sgd_step = &TestSgdStep});
  std::vector<float> wb(4), gb(4);
  Tensor w = FakeCuda(wb, {4});
  w.set_grad(FakeCuda(gb, {4}));
  Rmsprop rmsprop({{"w", w}}, {});
  const std::string error = [&] {
    try {
      rmsprop.Step();
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  }();
  RegisterDeviceOptimKernels(DeviceType::kCUDA, DeviceOptimKernels{});
  EXPECT_EQ(error,
            "RMSprop: no device kernel `rmsprop_step` for cuda:0 (its backend registered kernels without this "
            "entry)");
}

TEST(DeviceErrors, NoRegisteredKernelNamesTheDevice) {
  // In the plain build nothing is registered for CUDA.
  ASSERT_EQ(DeviceOptimKernelsFor(DeviceType::kCUDA).sgd_step, nullptr);
  std::vector<float> wb(4), gb(4);
  Tensor w = FakeCuda(wb, {4});
  w.set_grad(FakeCuda(gb, {4}));
  Sgd sgd({{"w", w}}, {.lr = 0.1});
  EXPECT_THAT([&] { sgd.Step(); }, ::testing::ThrowsMessage<std::runtime_error>(AllOf(
                                       HasSubstr("sgd_step"), HasSubstr("cuda:0"), HasSubstr("nn::cuda::Init"))));
  Adam adam({{"w", w}}, {});
  EXPECT_THAT([&] { adam.Step(); }, ::testing::ThrowsMessage<std::runtime_error>(HasSubstr("adam_step")));
  GradScaler scaler;
  EXPECT_THAT([&] { scaler.Unscale(adam); },
              ::testing::ThrowsMessage<std::runtime_error>(HasSubstr("unscale_and_check")));
  Adadelta adadelta({{"w", w}}, {});
  EXPECT_THAT([&] { adadelta.Step(); }, ::testing::ThrowsMessage<std::runtime_error>(
                                            AllOf(HasSubstr("adadelta_step"), HasSubstr("cuda:0"))));
  Rmsprop rmsprop({{"w", w}}, {});
  EXPECT_THAT([&] { rmsprop.Step(); }, ::testing::ThrowsMessage<std::runtime_error>(
                                           HasSubstr("RMSprop: no device kernel `rmsprop_step` for cuda:0")));
  EXPECT_EQ(rmsprop.step_count(0), 0);
  Adagrad adagrad({{"w", w}}, {});
  EXPECT_THAT([&] { adagrad.Step(); }, ::testing::ThrowsMessage<std::runtime_error>(
                                           HasSubstr("Adagrad: no device kernel `adagrad_step` for cuda:0")));
  EXPECT_EQ(adagrad.step_count(0), 0);
  EXPECT_THAT([&] { ClipGradNorm({w}, 1.0, kInfNorm); },
              ::testing::ThrowsMessage<std::runtime_error>(AllOf(HasSubstr("max_abs"), HasSubstr("cuda:0"))));
  EXPECT_EQ(wb, std::vector<float>(4, 0.0f));
  EXPECT_EQ(gb, std::vector<float>(4, 0.0f));
}

}  // namespace
}  // namespace ddp::nn::optim
