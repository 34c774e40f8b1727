// The device optimizer updates against nn/optim's CPU optimizers, the
// unscale/inf-check and the max-|x| reduction (tag "gpu"). Three steps with
// fresh random gradients (five for Adadelta); parameters (and Adadelta's
// state) compared after every step. Tolerance: f32 rtol 2e-6, atol 1e-7
// (nvcc may fuse a multiply-add that the CPU rounds twice; Adadelta's kernel
// rounds each operation alone and should agree to the bit with an x86-64
// CPU, the tolerance leaves room for hosts whose compilers contract); f64
// rtol 1e-13. max-|x| is exact: a maximum involves no rounding.
#include "nn/cuda/optim_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "nn/cuda/cuda.h"
#include "nn/optim/adadelta.h"
#include "nn/optim/adagrad.h"
#include "nn/optim/adam.h"
#include "nn/optim/rmsprop.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

void ExpectClose(const Tensor& cpu, const Tensor& gpu, double rtol, double atol, const std::string& what) {
  const std::vector<double> want = cpu.ToVector<double>(), got = gpu.To(kCPU).ToVector<double>();
  ASSERT_EQ(want.size(), got.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= atol + rtol * std::abs(want[i])) && ++bad <= 3) {
      ADD_FAILURE() << what << "[" << i << "]: cpu " << want[i] << ", gpu " << got[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

Tensor RandnOf(const Shape& shape, DType dt) {
  Tensor t = Empty(shape);
  NormalFill(t, 0.0, 1.0);
  return t.To(dt);
}

double Rtol(DType dt) { return dt == DType::kFloat64 ? 1e-13 : 2e-6; }
double Atol(DType dt) { return dt == DType::kFloat64 ? 1e-15 : 1e-7; }

class CudaOptimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Init();
    ManualSeed(11);
  }
};

TEST_F(CudaOptimTest, SgdMatchesTheCpuOptimizer) {
  const optim::SgdStepArgs configs[] = {{.lr = 0.1},
                               {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3},
                               {.lr = 0.05, .momentum = 0.9, .dampening = 0.2},
                               {.lr = 0.05, .momentum = 0.8, .weight_decay = 1e-2, .nesterov = true}};
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    for (const optim::SgdStepArgs& o : configs) {
      const std::string what = "sgd " + std::string(DTypeName(dt)) + " momentum " + std::to_string(o.momentum) +
                               (o.nesterov ? " nesterov" : "");
      const Tensor p_cpu = RandnOf({37, 29}, dt);
      const Tensor p_gpu = p_cpu.To(kGpu);
      const Tensor buf = Zeros({37, 29}, {.dtype = dt, .device = kGpu});
      optim::Sgd opt({{"w", p_cpu}}, {.lr = o.lr, .momentum = o.momentum, .dampening = o.dampening,
                                      .weight_decay = o.weight_decay, .nesterov = o.nesterov});
      for (int64_t step = 1; step <= 3; ++step) {
        const Tensor g = RandnOf({37, 29}, dt);
        p_cpu.set_grad(g);
        opt.Step();
        optim::SgdStepArgs a = o;
        a.step = step;
        SgdStep(p_gpu, g.To(kGpu), buf, a);
        ExpectClose(p_cpu, p_gpu, Rtol(dt), Atol(dt), what + " step " + std::to_string(step));
      }
    }
  }
}

TEST_F(CudaOptimTest, AdamAndAdamWMatchTheCpuOptimizers) {
  const optim::AdamStepArgs configs[] = {{},
                                {.lr = 1e-2, .weight_decay = 1e-2, .amsgrad = true},
                                {.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 1e-2,
                                 .decoupled = true}};
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    for (const optim::AdamStepArgs& o : configs) {
      const std::string what = std::string(o.decoupled ? "adamw " : "adam ") + std::string(DTypeName(dt)) +
                               (o.amsgrad ? " amsgrad" : "");
      const Tensor p_cpu = RandnOf({1000}, dt);
      const Tensor p_gpu = p_cpu.To(kGpu);
      const TensorOptions z{.dtype = dt, .device = kGpu};
      const Tensor m = Zeros({1000}, z), v = Zeros({1000}, z), vmax = o.amsgrad ? Zeros({1000}, z) : Tensor();
      std::unique_ptr<optim::Optimizer> opt;
      if (o.decoupled) {
        opt = std::make_unique<optim::AdamW>(
            optim::NamedParameters{{"w", p_cpu}},
            optim::AdamWOptions{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.amsgrad});
      } else {
        opt = std::make_unique<optim::Adam>(optim::NamedParameters{{"w", p_cpu}},
                                            optim::AdamOptions{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay,
                                                               o.amsgrad});
      }
      for (int64_t step = 1; step <= 3; ++step) {
        const Tensor g = RandnOf({1000}, dt);
        p_cpu.set_grad(g);
        opt->Step();
        optim::AdamStepArgs a = o;
        a.step = step;
        AdamStep(p_gpu, g.To(kGpu), m, v, vmax, a);
        ExpectClose(p_cpu, p_gpu, Rtol(dt), Atol(dt), what + " step " + std::to_string(step));
      }
    }
  }
}

// Odd sizes: one element, a partial block, several blocks with a tail.
TEST_F(CudaOptimTest, AdadeltaMatchesTheCpuOptimizer) {
  struct Case {
    optim::AdadeltaOptions options;
    double grad_scale;
  };
  const Case cases[] = {{{}, 1.0},
                        {{.lr = 0.5, .rho = 0.8, .eps = 1e-5, .weight_decay = 3e-2}, 1.0},
                        {{.lr = 2.0, .rho = 0.95, .weight_decay = 1e-3}, 1.0 / 64.0}};
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    for (const Case& c : cases) {
      for (const Shape& shape : {Shape{1}, Shape{7, 3}, Shape{1000, 37}}) {
        const std::string what = "adadelta " + std::string(DTypeName(dt)) + " " + ShapeToString(shape) +
                                 " weight_decay " + std::to_string(c.options.weight_decay) + " grad_scale " +
                                 std::to_string(c.grad_scale);
        const Tensor p_cpu = RandnOf(shape, dt);
        const Tensor p_gpu = p_cpu.To(kGpu);
        const TensorOptions z{.dtype = dt, .device = kGpu};
        const Tensor sq = Zeros(shape, z), acc = Zeros(shape, z);
        optim::Adadelta opt({{"w", p_cpu}}, c.options);
        opt.set_grad_scale(c.grad_scale);
        for (int step = 1; step <= 5; ++step) {
          const Tensor g = RandnOf(shape, dt);
          p_cpu.set_grad(g);
          opt.Step();
          AdadeltaStep(p_gpu, g.To(kGpu), sq, acc,
                       {.lr = c.options.lr,
                        .rho = c.options.rho,
                        .eps = c.options.eps,
                        .weight_decay = c.options.weight_decay,
                        .grad_scale = c.grad_scale});
          const std::string at = what + " step " + std::to_string(step);
          ExpectClose(p_cpu, p_gpu, Rtol(dt), Atol(dt), at);
          for (const auto& [key, t] : opt.StateDict()) {
            if (key == "state.w.square_avg") ExpectClose(t, sq, Rtol(dt), Atol(dt), at + " square_avg");
            if (key == "state.w.acc_delta") ExpectClose(t, acc, Rtol(dt), Atol(dt), at + " acc_delta");
          }
        }
      }
    }
  }
}

// The state entry `key` of `opt`'s state, or an undefined tensor.
Tensor StateOf(const optim::Optimizer& opt, const std::string& key) {
  for (const auto& [k, t] : opt.StateDict()) {
    if (k == key) return t;
  }
  return Tensor();
}

// Every layout of the state (momentum, centered, both, neither), lerp's two
// forms (alpha 0.99: small weight; alpha 0.3: large), weight decay, maximize
// (a grad_scale of -1, as the optimizer passes it) and a loss scale; odd
// sizes. Each step's parameters and state against the CPU optimizer's.
TEST_F(CudaOptimTest, RmspropMatchesTheCpuOptimizer) {
  const optim::RmspropOptions cases[] = {
      {},
      {.lr = 0.02, .weight_decay = 0.1, .momentum = 0.9, .centered = true},
      {.alpha = 0.3, .centered = true, .maximize = true},
      {.lr = 0.05, .alpha = 0.9, .eps = 1e-6, .momentum = 0.5},
      {.alpha = 0.5, .weight_decay = 1e-2, .centered = true}};
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    for (const optim::RmspropOptions& o : cases) {
      for (const Shape& shape : {Shape{1}, Shape{7, 3}, Shape{1000, 37}}) {
        const std::string what = "rmsprop " + std::string(DTypeName(dt)) + " " + ShapeToString(shape) + " alpha " +
                                 std::to_string(o.alpha) + " momentum " + std::to_string(o.momentum) +
                                 (o.centered ? " centered" : "") + (o.maximize ? " maximize" : "");
        const double grad_scale = o.momentum != 0 ? 1.0 / 64.0 : 1.0;
        const Tensor p_cpu = RandnOf(shape, dt);
        const Tensor p_gpu = p_cpu.To(kGpu);
        const TensorOptions z{.dtype = dt, .device = kGpu};
        const Tensor sq = Zeros(shape, z);
        const Tensor buf = o.momentum != 0 ? Zeros(shape, z) : Tensor();
        const Tensor ga = o.centered ? Zeros(shape, z) : Tensor();
        optim::Rmsprop opt({{"w", p_cpu}}, o);
        opt.set_grad_scale(grad_scale);
        for (int step = 1; step <= 4; ++step) {
          const Tensor g = RandnOf(shape, dt);
          p_cpu.set_grad(g);
          opt.Step();
          RmspropStep(p_gpu, g.To(kGpu), sq, buf, ga,
                      {.lr = o.lr,
                       .alpha = o.alpha,
                       .eps = o.eps,
                       .weight_decay = o.weight_decay,
                       .momentum = o.momentum,
                       .centered = o.centered,
                       .grad_scale = o.maximize ? -grad_scale : grad_scale});
          const std::string at = what + " step " + std::to_string(step);
          ExpectClose(p_cpu, p_gpu, Rtol(dt), Atol(dt), at);
          ExpectClose(StateOf(opt, "state.w.square_avg"), sq, Rtol(dt), Atol(dt), at + " square_avg");
          if (o.momentum != 0) {
            ExpectClose(StateOf(opt, "state.w.momentum_buffer"), buf, Rtol(dt), Atol(dt), at + " momentum_buffer");
          }
          if (o.centered) ExpectClose(StateOf(opt, "state.w.grad_avg"), ga, Rtol(dt), Atol(dt), at + " grad_avg");
        }
      }
    }
  }
}

// The rate decays with the step (lr / (1 + (t - 1) * lr_decay), formed by
// the optimizer); the sum starts at the initial accumulator value.
TEST_F(CudaOptimTest, AdagradMatchesTheCpuOptimizer) {
  const optim::AdagradOptions cases[] = {
      {},
      {.lr = 0.1, .lr_decay = 0.5, .weight_decay = 0.1, .initial_accumulator_value = 0.2, .maximize = true},
      {.lr = 0.05, .lr_decay = 1e-2, .initial_accumulator_value = 1.5, .eps = 1e-6}};
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    for (const optim::AdagradOptions& o : cases) {
      for (const Shape& shape : {Shape{1}, Shape{7, 3}, Shape{1000, 37}}) {
        const std::string what = "adagrad " + std::string(DTypeName(dt)) + " " + ShapeToString(shape) +
                                 " lr_decay " + std::to_string(o.lr_decay) + (o.maximize ? " maximize" : "");
        const Tensor p_cpu = RandnOf(shape, dt);
        const Tensor p_gpu = p_cpu.To(kGpu);
        const Tensor sum = Full(shape, o.initial_accumulator_value, {.dtype = dt, .device = kGpu});
        optim::Adagrad opt({{"w", p_cpu}}, o);
        for (int step = 1; step <= 4; ++step) {
          const Tensor g = RandnOf(shape, dt);
          p_cpu.set_grad(g);
          opt.Step();
          AdagradStep(p_gpu, g.To(kGpu), sum,
                      {.clr = o.lr / (1.0 + (step - 1) * o.lr_decay),
                       .eps = o.eps,
                       .weight_decay = o.weight_decay,
                       .grad_scale = o.maximize ? -1.0 : 1.0});
          const std::string at = what + " step " + std::to_string(step);
          ExpectClose(p_cpu, p_gpu, Rtol(dt), Atol(dt), at);
          ExpectClose(StateOf(opt, "state.w.sum"), sum, Rtol(dt), Atol(dt), at + " sum");
        }
      }
    }
  }
}

double HostMaxAbs(const std::vector<Tensor>& tensors, double start) {
  double m = start;
  for (const Tensor& t : tensors) {
    for (double x : t.ToVector<double>()) m = std::isnan(x) || std::isnan(m) ? x + m : std::max(m, std::abs(x));
  }
  return m;
}

double DeviceMaxAbs(const std::vector<Tensor>& cpu_tensors, double start = 0.0) {
  std::vector<Tensor> gpu;
  for (const Tensor& t : cpu_tensors) gpu.push_back(t.To(kGpu));
  const Tensor out = FromVector({start}, {1}, {.dtype = DType::kFloat64}).To(kGpu);
  MaxAbs(gpu, out);
  return out.Item();
}

// 300000 elements take more than the kernel's 1024 blocks of 256 threads,
// so each thread's grid-stride loop runs more than once.
TEST_F(CudaOptimTest, MaxAbsIsTheLargestMagnitudeInEveryDtype) {
  for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    for (int64_t n : {1, 255, 257, 5000, 300000}) {
      for (int64_t where : {int64_t{0}, n / 2, n - 1}) {
        const std::string what = std::string(DTypeName(dt)) + " n " + std::to_string(n) + " max at " +
                                 std::to_string(where);
        Tensor t = RandnOf({n}, dt);
        t.Narrow(0, where, 1).Fill(-9.5);  // negative: the magnitude counts
        const Tensor other = RandnOf({33}, dt);
        EXPECT_EQ(DeviceMaxAbs({t}), 9.5) << what;
        EXPECT_EQ(DeviceMaxAbs({other, t, Zeros({0}, {.dtype = dt})}), 9.5) << what;
        EXPECT_EQ(DeviceMaxAbs({other}), HostMaxAbs({other}, 0.0)) << what;
      }
    }
  }
  // out is only raised: a larger starting value stays.
  EXPECT_EQ(DeviceMaxAbs({RandnOf({100}, DType::kFloat32)}, 1e6), 1e6);
  EXPECT_EQ(DeviceMaxAbs({Zeros({10})}), 0.0);
  EXPECT_EQ(DeviceMaxAbs({}), 0.0);
}

TEST_F(CudaOptimTest, MaxAbsIsNanForAnyNanAndInfForAnyInf) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    for (int64_t where : {0, 4321, 299999}) {
      const std::string what = std::string(DTypeName(dt)) + " at " + std::to_string(where);
      Tensor t = RandnOf({300000}, dt);
      t.Narrow(0, where, 1).Fill(nan);
      const Tensor big = FromVector({1e4, -3e4}, {2}).To(dt);
      EXPECT_TRUE(std::isnan(DeviceMaxAbs({t}))) << what;
      EXPECT_TRUE(std::isnan(DeviceMaxAbs({t, big}))) << what;   // larger values after it
      EXPECT_TRUE(std::isnan(DeviceMaxAbs({big, t}))) << what;   // in the second tensor
      EXPECT_TRUE(std::isnan(DeviceMaxAbs({big}, nan))) << what;  // already NaN stays NaN
      t.Narrow(0, where, 1).Fill(-inf);
      EXPECT_EQ(DeviceMaxAbs({big, t}), inf) << what;
      t.Narrow(0, where, 1).Fill(inf);
      t.Narrow(0, (where + 17) % 300000, 1).Fill(nan);
      EXPECT_TRUE(std::isnan(DeviceMaxAbs({t}))) << what << " with inf";
    }
  }
}

TEST_F(CudaOptimTest, UnscaleAndCheckFindsInfAndNanWithoutTouchingTheFlagOtherwise) {
  const Tensor a = RandnOf({300}, DType::kFloat32), b = RandnOf({7, 9}, DType::kBFloat16);
  const Tensor ag = a.To(kGpu), bg = b.To(kGpu);
  const Tensor found = Zeros({1}, {.device = kGpu});
  UnscaleAndCheck({ag, bg}, 1.0 / 1024.0, found);  // a power of two: exact
  EXPECT_EQ(found.Item(), 0.0);
  const std::vector<float> av = a.ToVector<float>(), got = ag.To(kCPU).ToVector<float>();
  for (size_t i = 0; i < av.size(); ++i) ASSERT_EQ(got[i], av[i] / 1024.0f) << i;
  const std::vector<float> bv = b.ToVector<float>(), bgot = bg.To(kCPU).ToVector<float>();
  for (size_t i = 0; i < bv.size(); ++i) ASSERT_EQ(bgot[i], bv[i] / 1024.0f) << i;

  for (double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    Tensor c = RandnOf({5000}, DType::kFloat32);
    c.Narrow(0, 4321, 1).Fill(bad);
    const Tensor flag = Zeros({1}, {.device = kGpu});
    UnscaleAndCheck({RandnOf({10}, DType::kFloat32).To(kGpu), c.To(kGpu)}, 0.5, flag);
    EXPECT_EQ(flag.Item(), 1.0) << bad;
  }
}

// torch.maximum keeps a NaN already in max_exp_avg_sq; so does the kernel.
TEST_F(CudaOptimTest, AmsgradKeepsANanAlreadyInMaxExpAvgSq) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    const TensorOptions z{.dtype = dt, .device = kGpu};
    const Tensor p = Ones({1000}, z), m = Zeros({1000}, z), v = Zeros({1000}, z), vmax = Zeros({1000}, z);
    vmax.Narrow(0, 17, 1).Fill(nan);
    AdamStep(p, Full({1000}, 0.5, z), m, v, vmax, {.lr = 0.1, .amsgrad = true});
    const std::vector<double> got_max = vmax.To(kCPU).ToVector<double>(), got_p = p.To(kCPU).ToVector<double>();
    for (int64_t i = 0; i < 1000; ++i) {
      EXPECT_EQ(std::isnan(got_max[i]), i == 17) << DTypeName(dt) << " max_exp_avg_sq[" << i << "]";
      EXPECT_EQ(std::isnan(got_p[i]), i == 17) << DTypeName(dt) << " p[" << i << "]";
    }
  }
}

TEST_F(CudaOptimTest, MismatchedStateIsNamed) {
  const Tensor p = Zeros({4}, {.device = kGpu});
  try {
    SgdStep(p, Zeros({5}, {.device = kGpu}), Tensor(), {});
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("grad [5]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(SgdStep(p, Zeros({4}, {.device = kGpu}), Tensor(), {.step = 0}), std::invalid_argument);
  EXPECT_THROW(AdadeltaStep(p, Zeros({4}, {.device = kGpu}), Zeros({4}, {.device = kGpu}), Zeros({3}, {.device = kGpu}),
                            {}),
               std::invalid_argument);
  EXPECT_THROW(MaxAbs({p}, Zeros({1}, {.device = kGpu})), std::invalid_argument);  // out must be f64
  const Tensor g = Zeros({4}, {.device = kGpu});
  try {
    RmspropStep(p, g, Zeros({4}, {.device = kGpu}), Tensor(), Tensor(), {.centered = true});
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("grad_avg is undefined"), std::string::npos) << e.what();
  }
  EXPECT_THROW(RmspropStep(p, g, Zeros({4}, {.device = kGpu}), Zeros({4}, {.dtype = DType::kFloat64, .device = kGpu}),
                           Tensor(), {.momentum = 0.9}),
               std::invalid_argument);
  try {
    AdagradStep(p, g, Zeros({2, 2}, {.device = kGpu}), {});
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("sum [2, 2]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ddp::nn::cuda
