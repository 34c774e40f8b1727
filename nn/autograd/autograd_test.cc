#include <gtest/gtest.h>

#include <algorithm>
#include <any>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nn/autograd/engine.h"
#include "nn/autograd/function.h"
#include "nn/autograd/node.h"
#include "nn/ops/functional.h"
#include "nn/ops/gradcheck.h"

namespace ddp::nn::autograd {
namespace {

template <typename Fn>
std::string ErrorOf(Fn fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

Tensor Param(const Shape& shape, double value) {
  return Full(shape, value, {.requires_grad = true});
}

TEST(AutogradTest, GradientsAccumulateAcrossBackwardCalls) {
  Tensor w = Param({3}, 2.0);
  Tensor x = FromVector({1, 2, 3}, {3});
  for (int i = 0; i < 2; ++i) Backward(ops::Sum(ops::Mul(w, x)));
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{2, 4, 6}));
}

TEST(AutogradTest, DiamondGraphSumsBothPaths) {
  Tensor x = Param({2}, 3.0);
  Tensor a = ops::MulScalar(x, 2.0);
  Tensor b = ops::Square(x);
  Backward(ops::Sum(ops::Add(a, b)));  // d/dx (2x + x^2) = 2 + 2x = 8
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{8, 8}));
}

TEST(AutogradTest, SharedGradientIsNotAliasedBetweenLeaves) {
  Tensor a = Param({2}, 1.0), b = Param({2}, 1.0);
  Backward(ops::Sum(ops::Add(a, b)));  // both receive the same incoming gradient tensor
  EXPECT_NE(a.grad().storage().get(), b.grad().storage().get());
  Backward(ops::Sum(ops::MulScalar(a, 3.0)));
  EXPECT_EQ(a.grad().ToVector<float>(), (std::vector<float>{4, 4}));
  EXPECT_EQ(b.grad().ToVector<float>(), (std::vector<float>{1, 1}));
}

TEST(AutogradTest, HooksFireInReadinessOrderAfterAccumulation) {
  // y = w3 * (w2 * (w1 * x)): w3's gradient is ready first.
  Tensor w1 = Param({2}, 1.0), w2 = Param({2}, 2.0), w3 = Param({2}, 3.0);
  Tensor x = FromVector({1, 1}, {2});
  std::vector<std::string> order;
  std::vector<float> seen;
  auto hook = [&](const char* name) {
    return [&, name](const Tensor& p) {
      order.push_back(name);
      seen.push_back(p.grad().ToVector<float>()[0]);
    };
  };
  w1.RegisterPostAccumulateGradHook(hook("w1"));
  w2.RegisterPostAccumulateGradHook(hook("w2"));
  HookHandle h3 = w3.RegisterPostAccumulateGradHook(hook("w3"));
  Backward(ops::Sum(ops::Mul(w3, ops::Mul(w2, ops::Mul(w1, x)))));
  EXPECT_EQ(order, (std::vector<std::string>{"w3", "w2", "w1"}));
  EXPECT_EQ(seen, (std::vector<float>{2, 3, 6}));  // .grad is already accumulated when the hook runs
  h3.Remove();
  order.clear();
  Backward(ops::Sum(ops::Mul(w3, ops::Mul(w2, ops::Mul(w1, x)))));
  EXPECT_EQ(order, (std::vector<std::string>{"w2", "w1"}));
}

// A hook that removes a later hook of the same gradient (say, it tears down
// the object that hook captured) keeps that hook from running in the same
// accumulation. Before, the loop ran a copy of the list and called it.
TEST(AutogradTest, AHookRemovedByAnEarlierHookDoesNotRun) {
  Tensor w = Param({2}, 1.0);
  int second_ran = 0;
  HookHandle second;
  w.RegisterPostAccumulateGradHook([&](const Tensor&) { second.Remove(); });
  second = w.RegisterPostAccumulateGradHook([&](const Tensor&) { ++second_ran; });
  Backward(ops::Sum(ops::MulScalar(w, 2.0)));
  EXPECT_EQ(second_ran, 0);
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{2, 2}));
}

// An error from inside backward names the node it came from. A standard
// exception keeps its type; any other type (a collective's DistributedError
// from a hook that waited on it) arrives unchanged, so that callers can
// catch it by type. Before, every error became a std::runtime_error.
struct CustomError : std::runtime_error {
  explicit CustomError(int c) : std::runtime_error("custom " + std::to_string(c)), code(c) {}
  int code;
};

TEST(AutogradTest, ErrorsFromBackwardKeepTheirType) {
  Tensor w = Param({2}, 1.0);
  HookHandle h = w.RegisterPostAccumulateGradHook([](const Tensor&) { throw CustomError(7); });
  try {
    Backward(ops::Sum(w));
    FAIL() << "no error";
  } catch (const CustomError& e) {
    EXPECT_EQ(e.code, 7);
    EXPECT_EQ(std::string(e.what()), "custom 7");
  }
  h.Remove();
  h = w.RegisterPostAccumulateGradHook([](const Tensor&) { throw std::invalid_argument("bad"); });
  try {
    Backward(ops::Sum(w));
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("in backward of ", 0), 0u) << what;
    EXPECT_NE(what.find(": bad"), std::string::npos) << what;
  }
}

// Freezing a parameter between forward and backward: as PyTorch's
// AccumulateGrad::apply, which returns at once for a variable that no longer
// requires grad, its .grad stays as it was and its post-accumulate hooks
// (DDP's reduction) do not fire. Before, the gradient was accumulated and
// the hook fired.
TEST(AutogradTest, LeafFrozenAfterForwardGetsNoGradientAndNoHook) {
  Tensor w1 = Param({2}, 1.0), w2 = Param({2}, 2.0);
  int w1_hooks = 0, w2_hooks = 0;
  w1.RegisterPostAccumulateGradHook([&](const Tensor&) { ++w1_hooks; });
  w2.RegisterPostAccumulateGradHook([&](const Tensor&) { ++w2_hooks; });
  Tensor y = ops::Sum(ops::Mul(w1, w2));
  w1.set_requires_grad(false);
  Backward(y);
  EXPECT_FALSE(w1.grad().defined());
  EXPECT_EQ(w1_hooks, 0);
  EXPECT_EQ(w2.grad().ToVector<float>(), (std::vector<float>{1, 1}));
  EXPECT_EQ(w2_hooks, 1);
  // An existing .grad is left as it is.
  w1.set_requires_grad(true);
  Backward(ops::Sum(ops::Mul(w1, w2)));
  ASSERT_EQ(w1.grad().ToVector<float>(), (std::vector<float>{2, 2}));
  EXPECT_EQ(w1_hooks, 1);
  y = ops::Sum(ops::Mul(w1, w2));
  w1.set_requires_grad(false);
  Backward(y);
  EXPECT_EQ(w1.grad().ToVector<float>(), (std::vector<float>{2, 2}));
  EXPECT_EQ(w1_hooks, 1);
  EXPECT_EQ(w2.grad().ToVector<float>(), (std::vector<float>{3, 3}));
}

TEST(AutogradTest, CallbacksRunOnceAtTheEndOfBackward) {
  Tensor w1 = Param({2}, 1.0), w2 = Param({2}, 2.0);
  std::vector<std::string> events;
  w1.RegisterPostAccumulateGradHook([&](const Tensor&) {
    events.push_back("hook w1");
    QueueCallback([&] {
      events.push_back("callback");
      QueueCallback([&] { events.push_back("nested callback"); });
    });
  });
  w2.RegisterPostAccumulateGradHook([&](const Tensor&) {
    EXPECT_TRUE(InBackward());
    events.push_back("hook w2");
  });
  Backward(ops::Sum(ops::Mul(w1, w2)));
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[2], "callback");
  EXPECT_EQ(events[3], "nested callback");
  EXPECT_FALSE(InBackward());
  EXPECT_NE(ErrorOf([] { QueueCallback([] {}); }).find("outside a backward pass"), std::string::npos);
}

// An empty callback is refused when it is queued, with a message naming
// QueueCallback, and the pass does not go on with it. Before, it was
// queued and the end of the pass threw a bare "bad_function_call".
TEST(AutogradTest, AnEmptyCallbackIsRefusedWhenQueued) {
  Tensor w = Param({2}, 1.0);
  HookHandle hook = w.RegisterPostAccumulateGradHook([](const Tensor&) { QueueCallback({}); });
  const std::string err = ErrorOf([&] { Backward(ops::Sum(w)); });
  EXPECT_NE(err.find("QueueCallback: the callback is empty"), std::string::npos) << err;
  hook.Remove();
  EXPECT_FALSE(InBackward());
  Backward(ops::Sum(w));
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{2, 2}));
}

TEST(AutogradTest, GradAsBucketViewAccumulatesInPlace) {
  Tensor w = Param({2, 3}, 1.0);
  Tensor bucket = Zeros({10});
  Tensor view = bucket.Narrow(0, 4, 6).View({2, 3});
  view.Fill(1.0);
  w.set_grad(view);
  const void* before = w.grad().data_ptr();
  Backward(ops::Sum(ops::MulScalar(w, 2.0)));
  EXPECT_EQ(w.grad().data_ptr(), before);
  const std::vector<float> b = bucket.ToVector<float>();
  EXPECT_EQ(b[3], 0.0f);
  for (int i = 4; i < 10; ++i) EXPECT_EQ(b[i], 3.0f);  // 1 (old) + 2 (new), written into the bucket
}

// SetData may give a leaf another shape, dtype or device after its .grad
// was made: the next backward refuses to add into that .grad, naming both,
// and leaves it as it was; once it is cleared, backward works again. Before,
// a [2] .grad of a [4] leaf took the first half of the gradient, a [4] .grad
// of a [2, 2] leaf made the CPU kernel write out of bounds, and the other
// two failed inside the kernel without naming the leaf's .grad.
TEST(AutogradTest, StaleGradOfAnotherShapeDtypeOrDeviceIsRefused) {
  const auto expect_refused = [](const Tensor& leaf, const std::string& grad, const std::string& data) {
    const std::string err = ErrorOf([&] { Backward(ops::Sum(ops::MulScalar(leaf, 2.0))); });
    EXPECT_NE(err.find("the leaf's .grad " + grad + " does not match its data " + data +
                       " (was the data replaced with SetData?); clear the .grad first (ZeroGradOf(leaf, "
                       "/*set_to_none=*/true) or set_grad(Tensor()))"),
              std::string::npos)
        << err;
  };
  Tensor w = Param({2}, 1.0);
  Backward(ops::Sum(w));
  w.SetData(Zeros({4}));
  expect_refused(w, "[2] f32 on cpu", "[4] f32 on cpu");
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{1, 1}));
  ZeroGradOf(w, /*set_to_none=*/true);
  Backward(ops::Sum(ops::MulScalar(w, 2.0)));
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{2, 2, 2, 2}));

  Tensor v = Param({4}, 1.0);
  Backward(ops::Sum(v));
  v.SetData(Zeros({2, 2}));
  expect_refused(v, "[4] f32 on cpu", "[2, 2] f32 on cpu");
  EXPECT_EQ(v.grad().ToVector<float>(), (std::vector<float>{1, 1, 1, 1}));

  Tensor d = Param({2}, 1.0);
  Backward(ops::Sum(d));
  d.SetData(Zeros({2}, {.dtype = DType::kFloat64}));
  expect_refused(d, "[2] f32 on cpu", "[2] f64 on cpu");

  // A leaf on cuda:0 with its .grad there, moved to the CPU by SetData
  // alone (the memory of the cuda tensors is never read).
  std::vector<float> data_backing(2), grad_backing(2);
  Tensor c = Tensor::FromBlob(data_backing.data(), {2}, DType::kFloat32, Device(DeviceType::kCUDA, 0));
  c.set_requires_grad(true);
  c.set_grad(Tensor::FromBlob(grad_backing.data(), {2}, DType::kFloat32, Device(DeviceType::kCUDA, 0)));
  c.SetData(Zeros({2}));
  expect_refused(c, "[2] f32 on cuda:0", "[2] f32 on cpu");
}

TEST(AutogradTest, NoGradGuardRecordsNothing) {
  Tensor w = Param({2}, 1.0);
  NoGradGuard guard;
  Tensor y = ops::MulScalar(w, 2.0);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(y.is_leaf());
}

TEST(AutogradTest, SecondBackwardNeedsRetainGraph) {
  Tensor w = Param({2}, 1.0);
  Tensor loss = ops::Sum(ops::Mul(w, w));
  Backward(loss);
  const std::string err = ErrorOf([&] { Backward(loss); });
  EXPECT_NE(err.find("second time"), std::string::npos) << err;
  EXPECT_NE(err.find("MulBackward"), std::string::npos) << err;
  Tensor loss2 = ops::Sum(ops::Mul(w, w));
  Backward(loss2, Tensor(), /*retain_graph=*/true);
  Backward(loss2);
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{6, 6}));
}

TEST(AutogradTest, InPlaceChangeOfASavedTensorIsReported) {
  Tensor w = Param({2}, 1.0);
  Tensor x = FromVector({1, 2}, {2});
  Tensor loss = ops::Sum(ops::Mul(w, x));
  x.Fill(5.0);
  const std::string err = ErrorOf([&] { Backward(loss); });
  EXPECT_NE(err.find("modified in place"), std::string::npos) << err;
}

// The in-place error says which saved tensor changed (shape, dtype, the
// node that made it or that it is a leaf) and both versions, as PyTorch's
// names the tensor. Before, it gave the shape alone.
TEST(AutogradTest, InPlaceErrorNamesTheTensorAndItsVersions) {
  Tensor w = Param({2}, 1.0);
  Tensor h = ops::MulScalar(w, 2.0);
  Tensor loss = ops::Sum(ops::Mul(h, w));
  ASSERT_EQ(h.storage()->version(), 0u);
  {
    NoGradGuard no_grad;
    h.Fill(5.0);
  }
  std::string err = ErrorOf([&] { Backward(loss, Tensor(), /*retain_graph=*/true); });
  EXPECT_NE(err.find("in backward of MulBackward: a tensor saved for backward ([2] f32 on cpu, output 0 of "
                     "MulScalarBackward) was modified in place after it was saved: its memory is at version 1, "
                     "it was at version 0 when saved"),
            std::string::npos)
      << err;
  Tensor v = Param({3}, 1.0);
  Tensor loss_v = ops::Sum(ops::Mul(v, v));
  const uint64_t saved_at = v.storage()->version();
  {
    NoGradGuard no_grad;
    v.Fill(2.0);
    v.Fill(3.0);
  }
  err = ErrorOf([&] { Backward(loss_v); });
  EXPECT_NE(err.find("([3] f32 on cpu, a leaf that requires grad) was modified in place after it was saved: "
                     "its memory is at version " +
                     std::to_string(saved_at + 2) + ", it was at version " + std::to_string(saved_at) +
                     " when saved"),
            std::string::npos)
      << err;
}

TEST(AutogradTest, RootErrors) {
  Tensor w = Param({2}, 1.0);
  EXPECT_NE(ErrorOf([&] { Backward(ops::MulScalar(w, 2.0)); }).find("one-element root"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { Backward(Zeros({1})); }).find("does not require grad"), std::string::npos);
  // An undefined root is named as such (before, it was said not to require
  // grad, as if it were a tensor).
  const std::string undefined = ErrorOf([&] { Backward({ops::Sum(w), Tensor()}); });
  EXPECT_NE(undefined.find("Backward: root 1 is an undefined tensor"), std::string::npos) << undefined;
  EXPECT_FALSE(w.grad().defined());  // refused before anything ran
  EXPECT_NE(ErrorOf([&] { Backward(ops::MulScalar(w, 2.0), Ones({3})); }).find("gradient of shape [3]"),
            std::string::npos);
}

// A seed of another dtype is converted to its root's, as PyTorch's engine
// does, so the nodes below (and a retained .grad) see the root's dtype; one
// on another device is refused. Before, the f64 seed reached the retained
// .grad as it was, and the device went unchecked.
TEST(AutogradTest, SeedTakesItsRootsDtypeAndMustBeOnItsDevice) {
  Tensor w = Param({2}, 3.0);
  Tensor h = ops::MulScalar(w, 2.0);
  h.RetainGrad();
  Backward(h, FromVector({1, 2}, {2}, {.dtype = DType::kFloat64}));
  EXPECT_EQ(h.grad().dtype(), DType::kFloat32);
  EXPECT_EQ(h.grad().ToVector<float>(), (std::vector<float>{1, 2}));
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{2, 4}));
  // A tensor that claims to live on cuda:0 (its memory is never read).
  std::vector<float> backing(2);
  const Tensor on_cuda = Tensor::FromBlob(backing.data(), {2}, DType::kFloat32, Device(DeviceType::kCUDA, 0));
  Tensor v = Param({2}, 1.0);
  const std::string err = ErrorOf([&] { Backward(ops::MulScalar(v, 2.0), on_cuda); });
  EXPECT_NE(err.find("Backward: gradient on cuda:0 for root 0 on cpu"), std::string::npos) << err;
  EXPECT_FALSE(v.grad().defined());
}

// A second backward adds into a new .grad of a retained non-leaf (PyTorch's
// grad = grad + new_grad): a .grad the caller kept from the first is left as
// it was. Before, the second pass added into it in place.
TEST(AutogradTest, RetainedGradientOfASecondBackwardIsANewTensor) {
  Tensor w = Param({2}, 3.0);
  Tensor h = ops::MulScalar(w, 2.0);
  h.RetainGrad();
  Tensor loss = ops::Sum(ops::Square(h));
  Backward(loss, Tensor(), /*retain_graph=*/true);
  const Tensor kept = h.grad();
  Backward(loss);
  EXPECT_EQ(kept.ToVector<float>(), (std::vector<float>{12, 12}));
  EXPECT_FALSE(h.grad().is_same(kept));
  EXPECT_EQ(h.grad().ToVector<float>(), (std::vector<float>{24, 24}));
}

TEST(AutogradTest, ReachableLeavesFindsUsedParametersOnly) {
  Tensor used = Param({2}, 1.0), unused = Param({2}, 1.0), also = Param({2}, 2.0);
  Tensor y = ops::Sum(ops::Add(ops::Mul(used, also), FromVector({1, 2}, {2})));
  std::vector<Tensor> leaves = ReachableLeaves({y});
  ASSERT_EQ(leaves.size(), 2u);
  auto has = [&](const Tensor& t) {
    return std::any_of(leaves.begin(), leaves.end(), [&](const Tensor& l) { return l.is_same(t); });
  };
  EXPECT_TRUE(has(used));
  EXPECT_TRUE(has(also));
  EXPECT_FALSE(has(unused));
}

// A leaf frozen after the forward (requires_grad turned off before
// backward) gets no gradient and no hook from this graph, so it is not
// listed as reached, as the header says (leaves that require grad): DDP
// then treats it as unused instead of waiting for a hook that never comes.
// Before, every leaf with an accumulator in the graph was listed.
TEST(AutogradTest, ReachableLeavesSkipsALeafFrozenAfterTheForward) {
  Tensor live = Param({2}, 1.0), frozen = Param({2}, 2.0);
  Tensor y = ops::Sum(ops::Mul(live, frozen));
  frozen.set_requires_grad(false);
  const std::vector<Tensor> leaves = ReachableLeaves({y});
  ASSERT_EQ(leaves.size(), 1u);
  EXPECT_TRUE(leaves[0].is_same(live));
  Backward(y);
  EXPECT_FALSE(frozen.grad().defined());
}

TEST(AutogradTest, PrintingNamesTheGradFn) {
  Tensor w = Param({2}, 1.0);
  EXPECT_EQ(ops::MulScalar(w, 2.0).ToString(), "tensor([2., 2.], grad_fn=<MulScalarBackward>)");
}

TEST(AutogradTest, RetainGradKeepsNonLeafGradient) {
  Tensor w = Param({2}, 3.0);
  Tensor h = ops::MulScalar(w, 2.0);
  h.RetainGrad();
  Backward(ops::Sum(ops::Square(h)));
  EXPECT_EQ(h.grad().ToVector<float>(), (std::vector<float>{12, 12}));
}

// RetainGrad on a leaf does nothing, as retain_grad in PyTorch (a leaf
// gets .grad anyway), so retains_grad stays false there and true only on
// the non-leaf that asked. Before, RetainGrad marked the leaf as well.
TEST(AutogradTest, RetainGradOnALeafIsANoOp) {
  Tensor w = Param({2}, 3.0);
  w.RetainGrad();
  EXPECT_FALSE(w.retains_grad());
  Tensor h = ops::MulScalar(w, 2.0);
  h.RetainGrad();
  EXPECT_TRUE(h.retains_grad());
  Backward(ops::Sum(h));
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{2, 2}));
  EXPECT_EQ(h.grad().ToVector<float>(), (std::vector<float>{1, 1}));
}

// As PyTorch's requires_grad_(True) on a computed tensor: it already
// requires grad, so asking again changes nothing. This used to throw.
TEST(AutogradTest, RequiringGradOfANonLeafIsANoOp) {
  const Tensor x = Param({3}, 1.0);
  const Tensor h = ops::MulScalar(x, 2.0);
  EXPECT_EQ(&h.set_requires_grad(true), &h);
  EXPECT_TRUE(h.requires_grad());
  EXPECT_FALSE(h.is_leaf());
  Backward(ops::Sum(h));
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{2, 2, 2}));
}

// The calls that only a leaf (or only a tensor that requires grad) takes
// name the tensor they refuse and what is wrong with it. Before, the
// messages named neither the tensor nor which of the two conditions failed.
TEST(AutogradTest, LeafOnlyCallsNameTheTensorTheyRefuse) {
  const Tensor plain = Zeros({2, 3});
  const Tensor h = ops::MulScalar(Param({4}, 1.0), 2.0);
  std::string err = ErrorOf([&] { plain.RegisterPostAccumulateGradHook([](const Tensor&) {}); });
  EXPECT_NE(err.find("RegisterPostAccumulateGradHook: tensor [2, 3]"), std::string::npos) << err;
  EXPECT_NE(err.find("does not require grad"), std::string::npos) << err;
  err = ErrorOf([&] { h.RegisterPostAccumulateGradHook([](const Tensor&) {}); });
  EXPECT_NE(err.find("RegisterPostAccumulateGradHook: tensor [4]"), std::string::npos) << err;
  EXPECT_NE(err.find("is a non-leaf"), std::string::npos) << err;
  err = ErrorOf([&] { h.set_requires_grad(false); });
  EXPECT_NE(err.find("set_requires_grad: tensor [4]"), std::string::npos) << err;
  EXPECT_NE(err.find("is a non-leaf"), std::string::npos) << err;
  EXPECT_NE(err.find("Detach()"), std::string::npos) << err;
  err = ErrorOf([&] { plain.RetainGrad(); });
  EXPECT_NE(err.find("RetainGrad: tensor [2, 3]"), std::string::npos) << err;
  EXPECT_NE(err.find("does not require grad"), std::string::npos) << err;
}

// y = x * k with a hand-written backward; a second output carries x + 1.
struct ScaleAndShift : Function<ScaleAndShift> {
  static constexpr const char* kName = "ScaleAndShiftBackward";
  static std::vector<Tensor> Forward(AutogradContext* ctx, const std::vector<Tensor>& in, double k) {
    ctx->saved_data["k"] = k;
    ctx->SaveForBackward({in[0]});
    return {ops::MulScalar(in[0], k), ops::AddScalar(in[0], 1.0)};
  }
  static std::vector<Tensor> Backward(AutogradContext* ctx, const std::vector<Tensor>& g) {
    EXPECT_TRUE(ctx->NeedsInputGrad(0));
    EXPECT_EQ(ctx->GetSavedTensors().size(), 1u);
    const double k = std::any_cast<double>(ctx->saved_data["k"]);
    return {ops::Add(ops::MulScalar(g[0], k), g[1])};
  }
};

TEST(CustomFunctionTest, ForwardAndBackward) {
  Tensor x = Param({3}, 1.0);
  std::vector<Tensor> out = ScaleAndShift::Apply({x}, 4.0);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].grad_fn()->name(), "ScaleAndShiftBackward");
  // Only the first output is used: the second gradient arrives as zeros.
  Backward(ops::Sum(out[0]));
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{4, 4, 4}));
  EXPECT_TRUE(testing::GradCheck(
      [](const std::vector<Tensor>& in) {
        auto o = ScaleAndShift::Apply({in[0]}, -2.0);
        return ops::Add(ops::Square(o[0]), o[1]);
      },
      {testing::RandomLeaf({4}, 3)}));
  // No input requires grad: nothing recorded.
  EXPECT_FALSE(ScaleAndShift::Apply({Ones({2})}, 1.0)[0].requires_grad());
}

struct WrongCount : Function<WrongCount> {
  static std::vector<Tensor> Forward(AutogradContext*, const std::vector<Tensor>& in) { return {ops::Clone(in[0])}; }
  static std::vector<Tensor> Backward(AutogradContext*, const std::vector<Tensor>& g) { return {g[0], g[0]}; }
};

// Backward hands back the output's gradient transposed: [3, 2] for [2, 3].
struct TransposedGradient : Function<TransposedGradient> {
  static constexpr const char* kName = "TransposedGradientBackward";
  static std::vector<Tensor> Forward(AutogradContext*, const std::vector<Tensor>& in) { return {ops::Clone(in[0])}; }
  static std::vector<Tensor> Backward(AutogradContext*, const std::vector<Tensor>& g) {
    return {ops::Contiguous(ops::Transpose(g[0], 0, 1))};
  }
};

// A deliberately wrong backward (factor 3 instead of 2): GradCheck must notice.
struct WrongDerivative : Function<WrongDerivative> {
  static std::vector<Tensor> Forward(AutogradContext*, const std::vector<Tensor>& in) {
    return {ops::MulScalar(in[0], 2.0)};
  }
  static std::vector<Tensor> Backward(AutogradContext*, const std::vector<Tensor>& g) {
    return {ops::MulScalar(g[0], 3.0)};
  }
};

// Backward returns f64 gradients for an f32 input.
struct TripleInF64 : Function<TripleInF64> {
  static constexpr const char* kName = "TripleInF64Backward";
  static std::vector<Tensor> Forward(AutogradContext*, const std::vector<Tensor>& in) {
    return {ops::MulScalar(in[0], 3.0)};
  }
  static std::vector<Tensor> Backward(AutogradContext*, const std::vector<Tensor>& g) {
    return {ops::MulScalar(g[0], 3.0).To(DType::kFloat64)};
  }
};

// Backward returns a gradient that claims to live on cuda:0 for a CPU input
// (its memory is never read).
struct GradOnCuda : Function<GradOnCuda> {
  static constexpr const char* kName = "GradOnCudaBackward";
  static std::vector<Tensor> Forward(AutogradContext*, const std::vector<Tensor>& in) { return {ops::Clone(in[0])}; }
  static std::vector<Tensor> Backward(AutogradContext*, const std::vector<Tensor>& g) {
    static std::vector<float> backing(16);
    return {Tensor::FromBlob(backing.data(), g[0].shape(), DType::kFloat32, Device(DeviceType::kCUDA, 0))};
  }
};

// As PyTorch's engine (validate_outputs): a gradient of another dtype is
// converted to the input's, so the node below computes in its dtype (here
// the retained .grad of the non-leaf input shows it); one on another device
// is refused, naming the function. Before, only the shape was checked.
TEST(CustomFunctionTest, GradientTakesTheInputsDtypeAndMustBeOnItsDevice) {
  Tensor x = Param({2}, 1.0);
  Tensor h = ops::MulScalar(x, 2.0);
  h.RetainGrad();
  Backward(ops::Sum(TripleInF64::Apply({h})[0]));
  EXPECT_EQ(h.grad().dtype(), DType::kFloat32);
  EXPECT_EQ(h.grad().ToVector<float>(), (std::vector<float>{3, 3}));
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{6, 6}));
  Tensor y = Param({2}, 1.0);
  const std::string err = ErrorOf([&] { Backward(ops::Sum(GradOnCuda::Apply({y})[0])); });
  EXPECT_NE(err.find("GradOnCudaBackward: Backward returned a gradient on cuda:0 for input 0 on cpu"),
            std::string::npos)
      << err;
  EXPECT_FALSE(y.grad().defined());
}

// y = x + b with b broadcast over x's rows; the backward hands back the
// output's gradient for both inputs, leaving b's reduction to the engine.
struct AddBroadcastUnreduced : Function<AddBroadcastUnreduced> {
  static constexpr const char* kName = "AddBroadcastUnreducedBackward";
  static std::vector<Tensor> Forward(AutogradContext*, const std::vector<Tensor>& in) {
    return {ops::Add(in[0], in[1])};
  }
  static std::vector<Tensor> Backward(AutogradContext*, const std::vector<Tensor>& g) { return {g[0], g[0]}; }
};

// As PyTorch: a gradient of a shape the input broadcasts to ([2, 3] for a
// [3] or a [1, 3] input) is summed to the input's shape; one the input does
// not broadcast to is refused with both shapes. Before, any other shape was
// refused.
TEST(CustomFunctionTest, ABroadcastGradientIsSummedToTheInputsShape) {
  Tensor x = Param({2, 3}, 1.0);
  Tensor b = Param({3}, 0.0);
  Backward(ops::Sum(ops::Mul(AddBroadcastUnreduced::Apply({x, b})[0], FromVector({1, 2, 3, 4, 5, 6}, {2, 3}))));
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(b.grad().shape(), (Shape{3}));
  EXPECT_EQ(b.grad().ToVector<float>(), (std::vector<float>{5, 7, 9}));
  Tensor row = Param({1, 3}, 0.0);
  Backward(ops::Sum(AddBroadcastUnreduced::Apply({x, row})[0]));
  EXPECT_EQ(row.grad().ToVector<float>(), (std::vector<float>{2, 2, 2}));
  Tensor z = Param({2, 3}, 0.0);
  const std::string err = ErrorOf([&] { Backward(ops::Sum(TransposedGradient::Apply({z})[0])); });
  EXPECT_NE(err.find("TransposedGradientBackward: Backward returned a gradient of shape [3, 2] for input 0 "
                     "of shape [2, 3]"),
            std::string::npos)
      << err;
  EXPECT_FALSE(z.grad().defined());
}

// Forward keeps its output in saved_data rather than through
// SaveForBackward.
struct KeepsOutputInSavedData : Function<KeepsOutputInSavedData> {
  static constexpr const char* kName = "KeepsOutputBackward";
  static std::vector<Tensor> Forward(AutogradContext* ctx, const std::vector<Tensor>& in, bool in_a_vector) {
    Tensor y = ops::MulScalar(in[0], 2.0);
    if (in_a_vector) {
      ctx->saved_data["all"] = std::vector<Tensor>{in[0], y};
    } else {
      ctx->saved_data["y"] = y;
    }
    return {y};
  }
  static std::vector<Tensor> Backward(AutogradContext*, const std::vector<Tensor>& g) {
    return {ops::MulScalar(g[0], 2.0)};
  }
};

// An output kept in saved_data would hold its own node alive for ever
// (output -> node -> saved_data -> output): Apply refuses it, naming the
// key, and leaks nothing. Before, it was accepted and the graph was never
// freed.
TEST(CustomFunctionTest, AnOutputKeptInSavedDataIsRefused) {
  for (const bool in_a_vector : {false, true}) {
    Tensor x = Param({2}, 1.0);
    std::weak_ptr<TensorImpl> x_impl = x.impl_ptr();
    const std::string err = ErrorOf([&] { KeepsOutputInSavedData::Apply({x}, in_a_vector); });
    EXPECT_NE(err.find(std::string("KeepsOutputBackward: saved_data[\"") + (in_a_vector ? "all" : "y") +
                       "\"] holds output 0 of Forward"),
              std::string::npos)
        << err;
    x = Tensor();
    EXPECT_TRUE(x_impl.expired()) << "the refused function's node still holds its input";
  }
}

TEST(CustomFunctionTest, BadBackwardsAreReported) {
  Tensor x = Param({2}, 1.0);
  const std::string err = ErrorOf([&] { Backward(ops::Sum(WrongCount::Apply({x})[0])); });
  EXPECT_NE(err.find("returned 2 gradients, expected 1"), std::string::npos) << err;
  EXPECT_FALSE(testing::GradCheck([](const std::vector<Tensor>& in) { return WrongDerivative::Apply({in[0]})[0]; },
                                  {testing::RandomLeaf({3}, 1)}));
}

// Two threads run forwards and backwards on one shared weight. Every graph
// must end in the same AccumulateGrad node for the weight (the one its
// AutogradMeta points to while a graph holds it), and no gradient may be
// lost when both accumulate at once. Before, both threads could create and
// store the accumulator unsynchronized (a data race; two nodes for one
// leaf), and accumulation into .grad was unsynchronized. Run under
// --config=tsan to catch the race itself.
TEST(AutogradTest, ThreadsSharingALeafShareItsAccumulator) {
  constexpr int kIters = 1000;
  Tensor w = Param({3, 4}, 0.5);
  std::atomic<int> ready{0};
  std::atomic<int> mismatches{0};
  auto run = [&](double value) {
    const Tensor x = Full({2, 4}, value);
    ready.fetch_add(1);
    while (ready.load() < 2) {
    }
    for (int i = 0; i < kIters; ++i) {
      Tensor y = ops::Linear(x, w, Tensor());
      std::shared_ptr<Node> acc;
      for (const Edge& e : y.grad_fn()->next_edges()) {
        if (dynamic_cast<AccumulateGrad*>(e.fn.get()) != nullptr) acc = e.fn;
      }
      // While y holds its accumulator, the weight's edge is that same node.
      if (acc == nullptr || GradientEdge(w).fn != acc) mismatches.fetch_add(1);
      Backward(ops::Sum(y));
    }
  };
  std::thread a(run, 1.0), b(run, 2.0);
  a.join();
  b.join();
  EXPECT_EQ(mismatches.load(), 0);
  // d sum(x w^T) / dw[o, i] = sum_n x[n, i]: 2 * 1 and 2 * 2 per iteration (exact in f32).
  EXPECT_EQ(w.grad().ToVector<float>(), std::vector<float>(12, kIters * (2.0f * 1 + 2.0f * 2)));
}

// Runs a and b on two threads that start together; returns what each threw
// ("" for nothing).
std::pair<std::string, std::string> RaceTwo(const std::function<void()>& a, const std::function<void()>& b) {
  std::atomic<int> ready{0};
  std::string error_a, error_b;
  auto run = [&ready](const std::function<void()>& fn, std::string& error) {
    ready.fetch_add(1);
    while (ready.load() < 2) {
    }
    error = ErrorOf(fn);
  };
  std::thread ta(run, std::cref(a), std::ref(error_a)), tb(run, std::cref(b), std::ref(error_b));
  ta.join();
  tb.join();
  return {error_a, error_b};
}

// Two heads on one trunk h = x * x, each backward on a thread of its own
// without retain_graph: both reach MulBackward. As in PyTorch, one pass
// runs it and releases its saved tensors, the other then finds them
// released and gets the "second time" error. Before, nothing ordered one
// pass's release against the other's read of the saved tensors: both
// passes could go through (one reading tensors while they were freed), or
// the process crashed.
TEST(AutogradTest, TwoPassesThroughASharedNodeOneGetsTheSecondTimeError) {
  constexpr int kIters = 200;
  constexpr int64_t kSize = 4096;
  Tensor x = Param({kSize}, 1.0);
  float expected = 0;
  for (int i = 0; i < kIters; ++i) {
    Tensor h = ops::Mul(x, x);
    Tensor loss2 = ops::Sum(ops::MulScalar(h, 2.0)), loss3 = ops::Sum(ops::MulScalar(h, 3.0));
    const auto [e2, e3] = RaceTwo([&] { Backward(loss2); }, [&] { Backward(loss3); });
    ASSERT_NE(e2.empty(), e3.empty()) << "iteration " << i << ": exactly one pass must fail, got [" << e2
                                      << "] and [" << e3 << "]";
    const std::string& err = e2.empty() ? e3 : e2;
    ASSERT_NE(err.find("in backward of MulBackward: tried to run backward through the graph a second time"),
              std::string::npos)
        << err;
    expected += e2.empty() ? 2 * 2.0f : 2 * 3.0f;  // d(k x^2)/dx at x = 1, from the pass that went through
  }
  EXPECT_EQ(x.grad().ToVector<float>(), std::vector<float>(kSize, expected));
}

// y = 2 x; its backward keeps the saved input a while and counts its calls
// in saved_data (read, pause, write), so that two passes inside it at once
// are seen.
struct SlowDouble : Function<SlowDouble> {
  static constexpr const char* kName = "SlowDoubleBackward";
  static std::vector<Tensor> Forward(AutogradContext* ctx, const std::vector<Tensor>& in) {
    ctx->saved_data["calls"] = 0;
    ctx->SaveForBackward({in[0]});
    return {ops::MulScalar(in[0], 2.0)};
  }
  static std::vector<Tensor> Backward(AutogradContext* ctx, const std::vector<Tensor>& g) {
    const int calls = std::any_cast<int>(ctx->saved_data["calls"]);
    const Tensor x = ctx->GetSavedTensors()[0];
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    ctx->saved_data["calls"] = calls + 1;
    return {ops::MulScalar(g[0], 2.0)};
  }
};

int CallsOf(const Tensor& out) {
  auto* node = dynamic_cast<CustomFunctionNode*>(out.grad_fn().get());
  return std::any_cast<int>(node->ctx().saved_data["calls"]);
}

// A custom function shared by two passes on two threads runs one pass at a
// time: without retain_graph the second gets the "second time" error; with
// it both go through, neither loses the other's update of saved_data or of
// the retained gradient of the function's output. Before, both passes ran
// its backward at once: both went through without retain_graph, and one
// update of saved_data was lost with it.
TEST(CustomFunctionTest, TwoPassesRunASharedFunctionOneAtATime) {
  constexpr int kIters = 50;
  Tensor x = Param({3}, 1.0);
  for (int i = 0; i < kIters; ++i) {
    Tensor h = SlowDouble::Apply({x})[0];
    Tensor loss2 = ops::Sum(ops::MulScalar(h, 2.0)), loss3 = ops::Sum(ops::MulScalar(h, 3.0));
    const auto [e2, e3] = RaceTwo([&] { Backward(loss2); }, [&] { Backward(loss3); });
    ASSERT_NE(e2.empty(), e3.empty()) << "iteration " << i << ": exactly one pass must fail, got [" << e2
                                      << "] and [" << e3 << "]";
    const std::string& err = e2.empty() ? e3 : e2;
    ASSERT_NE(err.find("in backward of SlowDoubleBackward: tried to run backward through the graph a second time"),
              std::string::npos)
        << err;
    EXPECT_EQ(CallsOf(h), 1);
  }
  x.set_grad(Tensor());
  float expected = 0;
  for (int i = 0; i < kIters; ++i) {
    Tensor h = SlowDouble::Apply({x})[0];
    h.RetainGrad();
    Tensor loss2 = ops::Sum(ops::MulScalar(h, 2.0)), loss3 = ops::Sum(ops::MulScalar(h, 3.0));
    const auto [e2, e3] = RaceTwo([&] { Backward(loss2, Tensor(), /*retain_graph=*/true); },
                                  [&] { Backward(loss3, Tensor(), /*retain_graph=*/true); });
    ASSERT_EQ(e2 + e3, "") << "iteration " << i;
    EXPECT_EQ(CallsOf(h), 2) << "iteration " << i;
    EXPECT_EQ(h.grad().ToVector<float>(), std::vector<float>(3, 5.0f)) << "iteration " << i;
    expected += 2 * 5.0f;
  }
  EXPECT_EQ(x.grad().ToVector<float>(), std::vector<float>(3, expected));
}

// The node observer may be set and cleared while another thread runs
// backward: the engine reads it safely (before, the std::function was read
// and replaced unsynchronized).
TEST(AutogradTest, NodeObserverCanBeSetDuringBackward) {
  std::atomic<bool> done{false};
  std::atomic<int64_t> observed{0};
  std::thread setter([&] {
    while (!done.load()) {
      SetNodeObserver([&](const Node&, double) { observed.fetch_add(1); });
      SetNodeObserver(nullptr);
    }
  });
  Tensor w = Param({8}, 1.0);
  for (int i = 0; i < 1000; ++i) Backward(ops::Sum(ops::Mul(ops::Square(w), w)));
  done.store(true);
  setter.join();
  SetNodeObserver(nullptr);
  EXPECT_EQ(w.grad().ToVector<float>(), std::vector<float>(8, 3000.0f));
}

// Dropping a graph frees its nodes with a loop: a chain 300k nodes deep
// (an unrolled loop) is freed without running out of stack, and nothing
// keeps it alive once its last tensor is gone. Before, each node's
// destructor freed its inputs' nodes by recursion, and the test crashed
// with a stack overflow when y was dropped.
TEST(AutogradTest, DroppingAVeryDeepGraphDoesNotOverflowTheStack) {
  constexpr int kDepth = 300000;
  Tensor x = Param({1}, 1.0);
  Tensor y = ops::AddScalar(x, 1.0);
  const std::weak_ptr<Node> first = y.grad_fn();
  for (int i = 1; i < kDepth; ++i) y = ops::AddScalar(y, 1.0);
  Backward(y);
  EXPECT_EQ(x.grad().ToVector<float>(), std::vector<float>{1});
  EXPECT_FALSE(first.expired());
  y = Tensor();
  EXPECT_TRUE(first.expired());
}

// y = x^2 without a recorded graph; its backward records the forward again
// and runs a nested Backward through it (what activation checkpointing
// does), as PyTorch allows a re-entrant backward.
struct RecomputedSquare : Function<RecomputedSquare> {
  static constexpr const char* kName = "RecomputedSquareBackward";
  static std::vector<Tensor> Forward(AutogradContext* ctx, const std::vector<Tensor>& in) {
    ctx->SaveForBackward({in[0]});
    return {ops::Square(in[0])};
  }
  static std::vector<Tensor> Backward(AutogradContext* ctx, const std::vector<Tensor>& g) {
    const Tensor x = ctx->GetSavedTensors()[0].Clone();
    x.set_requires_grad(true);
    bool callback_ran = false;
    {
      GradModeGuard enable(true);
      const Tensor y = ops::Square(x);
      x.RegisterPostAccumulateGradHook([&](const Tensor&) { QueueCallback([&] { callback_ran = true; }); });
      autograd::Backward({y}, {g[0]});
    }
    // The nested pass ran its own callbacks before it returned, and the
    // enclosing pass is still running.
    if (!callback_ran || !InBackward()) throw std::logic_error("nested pass left the wrong state");
    return {x.grad()};
  }
};

// A custom function's backward and a hook may run Backward on the same
// thread (nested in the running pass), as in PyTorch; afterwards the
// enclosing pass goes on and finishes. Before, the nested Backward threw
// "Backward called from inside a backward pass on the same thread".
TEST(AutogradTest, BackwardCanBeNestedInABackwardFunctionOrAHook) {
  Tensor x = Param({2}, 3.0);
  Backward(ops::Sum(ops::MulScalar(RecomputedSquare::Apply({x})[0], 5.0)));
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{30, 30}));  // 5 * 2x

  Tensor w = Param({2}, 1.0), v = Param({2}, 2.0);
  Tensor loss_v = ops::Sum(ops::Mul(v, v));
  int hook_calls = 0;
  w.RegisterPostAccumulateGradHook([&](const Tensor&) {
    ++hook_calls;
    Backward(loss_v);
  });
  Backward(ops::Sum(ops::MulScalar(w, 4.0)));
  EXPECT_EQ(hook_calls, 1);
  EXPECT_FALSE(InBackward());
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{4, 4}));
  EXPECT_EQ(v.grad().ToVector<float>(), (std::vector<float>{4, 4}));  // 2v
}

// A nested pass that reaches a node the enclosing pass on this thread is
// running (a hook on w calling Backward through w again) would wait for
// that node's lock forever; it is refused with an error naming the node,
// and the engine is usable afterwards.
TEST(AutogradTest, ANestedBackwardThroughTheRunningNodeIsRefused) {
  Tensor w = Param({2}, 1.0);
  Tensor again = ops::Sum(ops::MulScalar(w, 3.0));
  w.RegisterPostAccumulateGradHook([&](const Tensor&) {
    if (again.defined()) {
      Tensor root = again;
      again = Tensor();
      Backward(root);
    }
  });
  const std::string err = ErrorOf([&] { Backward(ops::Sum(ops::MulScalar(w, 2.0))); });
  EXPECT_NE(err.find("AccumulateGrad"), std::string::npos) << err;
  EXPECT_NE(err.find("enclosing backward pass on this thread is running"), std::string::npos) << err;
  EXPECT_FALSE(InBackward());
  EXPECT_TRUE(GradMode::IsEnabled());
  Backward(ops::Sum(ops::MulScalar(w, 2.0)));  // the hook has nothing left to run
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{4, 4}));
}

// Tensor::RegisterHook, against what torch.Tensor.register_hook gives.

// y = x * x (x = 3), loss = sum(y * 5): dloss/dy = 5, dloss/dx = 2x * 5 = 30.
// A hook doubling dloss/dy doubles the gradient of every leaf below y.
TEST(GradHookTest, AHookOnAnIntermediateScalesEveryLeafBelowIt) {
  Tensor x = Param({2}, 3.0);
  Tensor w = Param({2}, 2.0);
  Tensor y = ops::Mul(ops::Square(x), w);  // dy/dx = 2xw = 12, dy/dw = x^2 = 9
  std::vector<float> seen;
  y.RegisterHook([&](const Tensor& g) {
    seen = g.ToVector<float>();
    return ops::MulScalar(g, 2.0);
  });
  Backward(ops::Sum(ops::MulScalar(y, 5.0)));
  EXPECT_EQ(seen, (std::vector<float>{5, 5}));
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{120, 120}));
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{90, 90}));
}

// Hooks run in registration order, each on the previous one's result; one
// returning nothing keeps the gradient; a retained .grad sees the result.
TEST(GradHookTest, HooksChainInRegistrationOrder) {
  Tensor x = Param({2}, 1.0);
  Tensor y = ops::MulScalar(x, 1.0);
  y.RetainGrad();
  std::vector<std::string> order;
  y.RegisterHook([&](const Tensor& g) {
    order.push_back("add");
    return ops::AddScalar(g, 1.0);
  });
  y.RegisterHook([&](const Tensor& g) {
    order.push_back("look");
    EXPECT_EQ(g.ToVector<float>(), (std::vector<float>{2, 2}));
    return Tensor();
  });
  y.RegisterHook([&](const Tensor& g) {
    order.push_back("triple");
    return ops::MulScalar(g, 3.0);
  });
  Backward(ops::Sum(y));
  EXPECT_EQ(order, (std::vector<std::string>{"add", "look", "triple"}));
  EXPECT_EQ(y.grad().ToVector<float>(), (std::vector<float>{6, 6}));
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{6, 6}));
}

// On a leaf the hook runs before accumulation, so it changes .grad, and
// before the post-accumulate hooks, which see the changed .grad.
TEST(GradHookTest, ALeafHookChangesWhatIsAccumulated) {
  Tensor w = Param({2}, 1.0);
  w.set_grad(Full({2}, 100.0));
  std::vector<float> after;
  w.RegisterPostAccumulateGradHook([&](const Tensor& p) { after = p.grad().ToVector<float>(); });
  w.RegisterHook([](const Tensor& g) { return ops::MulScalar(g, -1.0); });
  Backward(ops::Sum(ops::MulScalar(w, 4.0)));
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{96, 96}));
  EXPECT_EQ(after, (std::vector<float>{96, 96}));
}

// A leaf hook that turns grad mode back on and returns a gradient with a
// history (it multiplies by a tensor that requires grad): the leaf's first
// .grad is taken without that history, as PyTorch's accumulation detaches
// what it steals, so .grad records nothing when used and does not keep the
// hook's graph (and w) alive. Before, .grad was the hook's result itself,
// grad_fn and all.
TEST(GradHookTest, ALeafsFirstGradIsTakenWithoutTheHooksHistory) {
  Tensor x = Param({2}, 1.0);
  const Tensor w = Param({2}, 3.0);
  x.RegisterHook([w](const Tensor& g) {
    GradModeGuard grad_mode(true);
    return ops::Mul(g, w);
  });
  Backward(ops::Sum(ops::MulScalar(x, 2.0)));
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{6, 6}));
  EXPECT_EQ(x.grad().grad_fn(), nullptr);
  EXPECT_FALSE(x.grad().requires_grad());
  EXPECT_FALSE(w.grad().defined());
}

// A tensor used twice gets one call per pass, on the sum of both uses.
TEST(GradHookTest, ATensorUsedTwiceIsHookedOnceOnTheSummedGradient) {
  Tensor x = Param({2}, 1.0);
  Tensor y = ops::MulScalar(x, 1.0);
  int calls = 0;
  std::vector<float> seen;
  y.RegisterHook([&](const Tensor& g) {
    ++calls;
    seen = g.ToVector<float>();
    return Tensor();
  });
  int leaf_calls = 0;
  x.RegisterHook([&](const Tensor&) {
    ++leaf_calls;
    return Tensor();
  });
  Backward(ops::Sum(ops::Add(ops::MulScalar(y, 2.0), ops::MulScalar(y, 3.0))));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, (std::vector<float>{5, 5}));
  Backward(ops::Sum(ops::Add(x, ops::MulScalar(x, 2.0))));  // x used twice
  EXPECT_EQ(leaf_calls, 2);  // once per pass
}

TEST(GradHookTest, ARemovedHookNoLongerRuns) {
  Tensor w = Param({2}, 1.0);
  int calls = 0;
  HookHandle h = w.RegisterHook([&](const Tensor& g) {
    ++calls;
    return ops::MulScalar(g, 10.0);
  });
  Backward(ops::Sum(w));
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{10, 10}));
  h.Remove();
  h.Remove();  // idempotent
  Backward(ops::Sum(w));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{11, 11}));
}

TEST(GradHookTest, RegisteringOnATensorThatNeedsNoGradientIsRefused) {
  const Tensor plain = Zeros({2, 3});
  const std::string err = ErrorOf([&] { plain.RegisterHook([](const Tensor& g) { return g; }); });
  EXPECT_NE(err.find("RegisterHook: tensor [2, 3]"), std::string::npos) << err;
  EXPECT_NE(err.find("does not require grad"), std::string::npos) << err;
  const std::string empty = ErrorOf([] { Param({4}, 1.0).RegisterHook(GradHook()); });
  EXPECT_NE(empty.find("the hook for tensor [4]"), std::string::npos) << empty;
  EXPECT_NE(empty.find("is empty"), std::string::npos) << empty;
}

TEST(GradHookTest, AReplacementOfAnotherShapeOrDtypeIsRefused) {
  Tensor x = Param({2, 3}, 1.0);
  Tensor y = ops::MulScalar(x, 2.0);
  y.RegisterHook([](const Tensor&) { return Zeros({3, 2}); });
  std::string err = ErrorOf([&] { Backward(ops::Sum(y)); });
  EXPECT_NE(err.find("MulScalarBackward"), std::string::npos) << err;
  EXPECT_NE(err.find("a gradient hook on output 0 of"), std::string::npos) << err;
  EXPECT_NE(err.find("returned a gradient [3, 2]"), std::string::npos) << err;
  EXPECT_NE(err.find("for a gradient [2, 3]"), std::string::npos) << err;
  EXPECT_FALSE(x.grad().defined());

  Tensor w = Param({2}, 1.0);
  w.RegisterHook([](const Tensor& g) { return g.To(DType::kFloat64); });
  err = ErrorOf([&] { Backward(ops::Sum(w)); });
  EXPECT_NE(err.find("a gradient hook on the leaf [2]"), std::string::npos) << err;
  EXPECT_NE(err.find("returned a gradient [2] " + std::string(DTypeName(DType::kFloat64))), std::string::npos)
      << err;
  EXPECT_FALSE(w.grad().defined());
}

TEST(GradHookTest, AnEmptyPostAccumulateHookIsRefusedWhenRegistered) {
  Tensor w = Param({5}, 1.0);
  const std::string err = ErrorOf([&] { w.RegisterPostAccumulateGradHook(PostAccumulateGradHook()); });
  EXPECT_NE(err.find("RegisterPostAccumulateGradHook: the hook for tensor [5]"), std::string::npos) << err;
  EXPECT_NE(err.find("is empty"), std::string::npos) << err;
  Backward(ops::Sum(w));  // nothing half-registered
  EXPECT_EQ(w.grad().ToVector<float>(), std::vector<float>(5, 1));
}

// y = x * 2 with a hook on y, z = sum(y), y's handle dropped, then backward:
// PyTorch keeps the hook on y's grad_fn (by output number), so it still
// runs. Before, the hook lived in y's own metadata and went with it.
TEST(GradHookTest, AHookOnANonLeafRunsAfterItsLastHandleIsDropped) {
  Tensor x = Param({2}, 3.0);
  int calls = 0;
  std::vector<float> seen;
  Tensor z;
  {
    Tensor y = ops::MulScalar(x, 2.0);
    y.RegisterHook([&](const Tensor& g) {
      ++calls;
      seen = g.ToVector<float>();
      return ops::MulScalar(g, 10.0);
    });
    z = ops::Sum(y);
  }
  Backward(z);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, (std::vector<float>{1, 1}));
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{20, 20}));
}

// On a node with two outputs, a hook follows the output it was registered
// on, after both handles are gone: output 1's hook sees and changes output
// 1's gradient only, and the hooks of one output chain in registration order.
TEST(GradHookTest, ANonLeafHookIsKeptByItsOutputNumber) {
  Tensor x = Param({2}, 1.0);
  std::vector<std::string> order;
  Tensor loss;
  {
    std::vector<Tensor> out = ScaleAndShift::Apply({x}, 4.0);  // x * 4, x + 1
    out[1].RegisterHook([&](const Tensor& g) {
      order.push_back("first on 1: " + std::to_string(g.ToVector<float>()[0]));
      return ops::MulScalar(g, 100.0);
    });
    out[1].RegisterHook([&](const Tensor& g) {
      order.push_back("second on 1: " + std::to_string(g.ToVector<float>()[0]));
      return Tensor();
    });
    // d loss / d out[0] = 2, d loss / d out[1] = 3.
    loss = ops::Sum(ops::Add(ops::MulScalar(out[0], 2.0), ops::MulScalar(out[1], 3.0)));
  }
  Backward(loss);
  EXPECT_EQ(order, (std::vector<std::string>{"first on 1: " + std::to_string(3.0f),
                                             "second on 1: " + std::to_string(300.0f)}));
  // 2 * 4 through output 0, 300 through output 1.
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{308, 308}));
}

// The handle still removes a non-leaf's hook once the tensor is gone, and
// Remove is harmless once the graph itself is gone.
TEST(GradHookTest, ANonLeafHookIsRemovedThroughItsHandleAfterTheTensorIsGone) {
  Tensor x = Param({2}, 1.0);
  int removed_calls = 0, kept_calls = 0;
  HookHandle removed, kept;
  Tensor loss;
  {
    Tensor y = ops::MulScalar(x, 2.0);
    removed = y.RegisterHook([&](const Tensor& g) {
      ++removed_calls;
      return ops::MulScalar(g, 10.0);
    });
    kept = y.RegisterHook([&](const Tensor&) {
      ++kept_calls;
      return Tensor();
    });
    loss = ops::Sum(y);
  }
  removed.Remove();
  Backward(loss);
  EXPECT_EQ(removed_calls, 0);
  EXPECT_EQ(kept_calls, 1);
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{2, 2}));
  EXPECT_FALSE(kept.IsLast());  // a gradient hook, not a post-accumulate one
  loss = Tensor();
  kept.Remove();
  kept.Remove();
}

// A hook on y that holds the loss makes a cycle: y's node keeps the hook,
// the hook the loss, the loss its graph and so y's node. A backward that
// does not retain the graph releases the node's hooks with its saved
// tensors, so the graph goes once the caller drops it (before, it stayed
// alive for ever, with every tensor it saved).
TEST(GradHookTest, AHookHoldingTheLossDoesNotKeepTheGraphAliveAfterBackward) {
  Tensor x = Param({2}, 1.0);
  int calls = 0;
  std::weak_ptr<Node> root_node, hooked_node;
  {
    Tensor y = ops::Mul(x, x);
    Tensor loss = ops::Sum(y);
    y.RegisterHook([loss, &calls](const Tensor&) {
      ++calls;
      return Tensor();
    });
    root_node = loss.grad_fn();
    hooked_node = y.grad_fn();
    Backward(loss);
  }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{2, 2}));
  EXPECT_TRUE(root_node.expired());
  EXPECT_TRUE(hooked_node.expired());
}

// With retain_graph the hooks stay and run on every pass; the first pass
// that does not retain the graph runs them a last time and releases them.
TEST(GradHookTest, RetainedGraphKeepsItsHooksUntilAPassReleasesIt) {
  Tensor x = Param({2}, 1.0);
  int calls = 0;
  std::weak_ptr<Node> hooked_node;
  {
    Tensor y = ops::Mul(x, x);
    Tensor loss = ops::Sum(y);
    y.RegisterHook([loss, &calls](const Tensor& g) {
      ++calls;
      return ops::MulScalar(g, 10.0);
    });
    hooked_node = y.grad_fn();
    Backward(loss, Tensor(), /*retain_graph=*/true);
    Backward(loss, Tensor(), /*retain_graph=*/true);
    EXPECT_EQ(calls, 2);
    Backward(loss);
  }
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{60, 60}));  // 3 passes of 10 * 2x
  EXPECT_TRUE(hooked_node.expired());
}

// y = 2x saves nothing, so a second backward through it is allowed, and
// its hook stays to run again, as in PyTorch: a pass releases a node's
// hooks only where it releases saved tensors of that node. (Before, the
// first pass released it and the second was refused.)
TEST(GradHookTest, AHookOnANodeThatSavedNothingRunsOnEveryPass) {
  Tensor x = Param({2}, 1.0);
  int calls = 0;
  Tensor y = ops::MulScalar(x, 2.0);
  y.RegisterHook([&calls](const Tensor& g) {
    ++calls;
    return ops::MulScalar(g, 10.0);
  });
  const Tensor loss = ops::Sum(y);
  Backward(loss);
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{20, 20}));
  Backward(loss);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{40, 40}));
}

// Outputs x and 2x, with a backward that saves nothing.
struct CopyAndDouble : Function<CopyAndDouble> {
  static constexpr const char* kName = "CopyAndDoubleBackward";
  static std::vector<Tensor> Forward(AutogradContext*, const std::vector<Tensor>& in) {
    return {ops::MulScalar(in[0], 1.0), ops::MulScalar(in[0], 2.0)};
  }
  static std::vector<Tensor> Backward(AutogradContext*, const std::vector<Tensor>& g) {
    return {ops::Add(g[0], ops::MulScalar(g[1], 2.0))};
  }
};

// The first pass runs the function's node for output 0 only; output 1's
// hook must still be there for the second pass (PyTorch: one call, x.grad
// 1 + 2). Before, the first pass released it and the second was refused
// as 'released by an earlier Backward'.
TEST(GradHookTest, AHookOnAnotherOutputOfANodeThatSavedNothingSurvivesAPass) {
  Tensor x = Param({2}, 1.0);
  std::vector<Tensor> o = CopyAndDouble::Apply({x});
  int calls = 0;
  o[1].RegisterHook([&calls](const Tensor&) {
    ++calls;
    return Tensor();
  });
  Backward(ops::Sum(o[0]));
  EXPECT_EQ(calls, 0);
  Backward(ops::Sum(o[1]));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{3, 3}));
}

// y = x * x saves its inputs: a pass without retain_graph releases them
// and y's hook, and a second pass through y is refused at y's node with
// the words of the saved-tensor refusal (where PyTorch refuses it too),
// before its hook or anything below it runs.
TEST(GradHookTest, ASecondPassThroughANodeThatSavedTensorsIsRefusedThere) {
  Tensor x = Param({2}, 1.0);
  int calls = 0;
  Tensor y = ops::Mul(x, x);
  y.RegisterHook([&calls](const Tensor& g) {
    ++calls;
    return ops::MulScalar(g, 10.0);
  });
  const Tensor loss = ops::Sum(y);
  Backward(loss);
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{20, 20}));
  const std::string err = ErrorOf([&] { Backward(loss); });
  // The same text as a second pass through a node without hooks.
  Tensor plain = ops::Sum(ops::Mul(x, x));
  Backward(plain);
  EXPECT_EQ(err, ErrorOf([&] { Backward(plain); }));
  EXPECT_NE(err.find("in backward of MulBackward: tried to run backward through the graph a second time"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("retain_graph"), std::string::npos) << err;
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{22, 22}));
}

// Saves its input but computes the gradient without it (3 g).
struct TripleSavingUnread : Function<TripleSavingUnread> {
  static constexpr const char* kName = "TripleSavingUnreadBackward";
  static std::vector<Tensor> Forward(AutogradContext* ctx, const std::vector<Tensor>& in) {
    ctx->SaveForBackward({in[0]});
    return {ops::MulScalar(in[0], 3.0)};
  }
  static std::vector<Tensor> Backward(AutogradContext*, const std::vector<Tensor>& g) {
    return {ops::MulScalar(g[0], 3.0)};
  }
};

// A saved tensor that the backward never read does not make a later pass
// fail, so its release does not take the hooks either: the second pass
// runs the hook again, as PyTorch's would (it refuses only a read of a
// released saved tensor). Before, the first pass released the hook with the
// unread tensor and the second was refused at the hooked output.
TEST(GradHookTest, AHookOnACustomFunctionThatNeverReadsWhatItSavedRunsOnEveryPass) {
  Tensor x = Param({2}, 1.0);
  int calls = 0;
  Tensor y = TripleSavingUnread::Apply({x})[0];
  y.RegisterHook([&calls](const Tensor& g) {
    ++calls;
    return ops::MulScalar(g, 10.0);
  });
  const Tensor loss = ops::Sum(y);
  Backward(loss);
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{30, 30}));
  EXPECT_EQ(ErrorOf([&] { Backward(loss); }), "");
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{60, 60}));
}

// A backward without retain_graph released y's saved tensors (and the
// hooks y's node kept): a hook registered on y afterwards could never run,
// since the next pass through y fails first, so it is refused at once,
// naming y and its node, whether or not y had a hook before. With
// retain_graph, or on a node whose backward read nothing it saved, the
// registration goes through and the hook runs. (Before, it was accepted
// and silently never ran.)
TEST(GradHookTest, AHookOnAnOutputWhoseNodeWasReleasedIsRefusedWhenRegistered) {
  const auto keep = [](const Tensor&) { return Tensor(); };
  Tensor x = Param({2}, 1.0);
  for (const bool hooked_before : {false, true}) {
    Tensor y = ops::Mul(x, x);
    if (hooked_before) y.RegisterHook(keep);
    Backward(ops::Sum(y));
    const std::string err = ErrorOf([&] { y.RegisterHook(keep); });
    EXPECT_NE(err.find("RegisterHook: tensor [2] f32 on cpu is output 0 of MulBackward, whose saved tensors and "
                       "hooks an earlier Backward released"),
              std::string::npos)
        << err;
    EXPECT_NE(err.find("retain_graph = true"), std::string::npos) << err;
  }

  int calls = 0;
  const auto count = [&calls](const Tensor&) {
    ++calls;
    return Tensor();
  };
  Tensor retained = ops::Mul(x, x);
  Backward(ops::Sum(retained), Tensor(), /*retain_graph=*/true);
  retained.RegisterHook(count);
  Tensor unread = TripleSavingUnread::Apply({x})[0];
  Tensor unread_loss = ops::Sum(unread);
  Backward(unread_loss);
  unread.RegisterHook(count);
  Backward(ops::Sum(retained));
  Backward(unread_loss);
  EXPECT_EQ(calls, 2);
}

// RegisterHookIfLive: on an output whose node a backward released, it
// registers nothing and says so (no throw), whether or not the output had a
// hook before; on a live one it registers a hook that runs like
// RegisterHook's, and Remove takes it out. A leaf and an empty hook are
// refused, naming them.
TEST(GradHookTest, RegisterHookIfLiveDeclinesAReleasedNodeWithoutThrowing) {
  int calls = 0;
  const auto count = [&calls](const Tensor&) {
    ++calls;
    return Tensor();
  };
  Tensor x = Param({2}, 1.0);
  for (const bool hooked_before : {false, true}) {
    Tensor y = ops::Mul(x, x);
    if (hooked_before) y.RegisterHook(count);
    Backward(ops::Sum(y));
    calls = 0;
    std::optional<HookHandle> handle;
    EXPECT_NO_THROW(handle = RegisterHookIfLive(y, count));
    EXPECT_FALSE(handle.has_value());
  }
  Tensor live = ops::Mul(x, x);
  Tensor loss = ops::Sum(live);
  std::optional<HookHandle> kept = RegisterHookIfLive(live, count);
  std::optional<HookHandle> removed = RegisterHookIfLive(live, count);
  ASSERT_TRUE(kept.has_value());
  ASSERT_TRUE(removed.has_value());
  removed->Remove();
  Backward(loss);
  EXPECT_EQ(calls, 1);

  const std::string leaf = ErrorOf([&] { (void)RegisterHookIfLive(x, count); });
  EXPECT_NE(leaf.find("RegisterHookIfLive: the tensor is a leaf ([2] f32 on cpu)"), std::string::npos) << leaf;
  const std::string empty = ErrorOf([&] { (void)RegisterHookIfLive(ops::Mul(x, x), GradHook()); });
  EXPECT_NE(empty.find("RegisterHookIfLive: the hook for [2] f32 on cpu is empty"), std::string::npos) << empty;
}

// A backward on another thread releases the node while this thread
// registers on its output: no registration throws, and once that backward
// has returned, registration is declined. A smoke test of the locking
// (ThreadSanitizer checks it further): it cannot be relied on to catch an
// implementation that checks for the release and then registers under
// separate locks, whose window for the release is a few instructions wide,
// and no deterministic test can widen it without a pause inside
// RegisterHookIfLive, where the correct code holds the lock the release
// needs.
TEST(GradHookTest, RegisterHookIfLiveNeverThrowsBesideABackwardOnAnotherThread) {
  Tensor x = Param({64}, 1.0);
  for (int round = 0; round < 200; ++round) {
    Tensor y = ops::Mul(x, x);
    Tensor loss = ops::Sum(y);
    std::atomic<bool> go{false};
    std::thread backward([&] {
      while (!go.load()) std::this_thread::yield();
      Backward(loss);
    });
    go.store(true);
    bool declined = false;
    for (int k = 0; k < 50 && !declined; ++k) {
      std::optional<HookHandle> handle;
      ASSERT_NO_THROW(handle = RegisterHookIfLive(y, [](const Tensor&) { return Tensor(); }))
          << "round " << round << ", registration " << k;
      declined = !handle.has_value();
    }
    backward.join();
    EXPECT_FALSE(RegisterHookIfLive(y, [](const Tensor&) { return Tensor(); }).has_value());
  }
}

struct FailingBackward : Function<FailingBackward> {
  static constexpr const char* kName = "FailingBackward";
  static std::vector<Tensor> Forward(AutogradContext*, const std::vector<Tensor>& in) {
    return {ops::MulScalar(in[0], 1.0)};
  }
  static std::vector<Tensor> Backward(AutogradContext*, const std::vector<Tensor>&) {
    throw std::runtime_error("backward failed on purpose");
  }
};

// A pass that fails before it reaches y's node leaves that node as it was,
// saved tensors and hook, as PyTorch: a later pass through y runs it and
// its hook once (before, the failed pass released the hooks of every node
// it could reach and the later pass was refused). The cost, documented in
// the README: a hook holding the loss keeps the graph alive after such a
// failure until it is removed.
TEST(GradHookTest, APassThatFailsLeavesTheNodesItDidNotRunAsTheyWere) {
  Tensor x = Param({2}, 1.0);
  int calls = 0;
  std::weak_ptr<Node> hooked_node;
  {
    Tensor y = ops::Mul(x, x);
    Tensor loss = ops::Sum(FailingBackward::Apply({y})[0]);
    y.RegisterHook([loss, &calls](const Tensor&) {
      ++calls;
      return Tensor();
    });
    hooked_node = y.grad_fn();
    const std::string err = ErrorOf([&] { Backward(loss); });
    EXPECT_NE(err.find("backward failed on purpose"), std::string::npos) << err;
    EXPECT_EQ(calls, 0);
    EXPECT_FALSE(x.grad().defined());
    Backward(ops::Sum(y));
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{2, 2}));
  }
  // The pass that ran y's node released its hook with its saved tensors.
  EXPECT_TRUE(hooked_node.expired());

  // After a failed pass alone, the hook holding the loss keeps the graph
  // until it is removed.
  HookHandle handle;
  {
    Tensor y = ops::Mul(x, x);
    Tensor loss = ops::Sum(FailingBackward::Apply({y})[0]);
    handle = y.RegisterHook([loss](const Tensor&) { return Tensor(); });
    hooked_node = y.grad_fn();
    EXPECT_NE(ErrorOf([&] { Backward(loss); }).find("backward failed on purpose"), std::string::npos);
  }
  EXPECT_FALSE(hooked_node.expired());
  handle.Remove();
  EXPECT_TRUE(hooked_node.expired());
}

// Hooks run on gradients that flow, as PyTorch's documentation describes
// them (run when the tensor's gradient is computed): an output of a
// node that runs but gets no gradient is not hooked (PyTorch's engine calls
// its hooks with an undefined gradient then, which a hook here would have
// to test for) and its retained .grad stays undefined.
TEST(GradHookTest, AHookOnAnOutputThatGetsNoGradientDoesNotRun) {
  Tensor x = Param({2}, 1.0);
  std::vector<Tensor> out = ScaleAndShift::Apply({x}, 4.0);  // x * 4, x + 1
  int used_calls = 0, unused_calls = 0;
  out[0].RegisterHook([&](const Tensor&) {
    ++used_calls;
    return Tensor();
  });
  out[1].RegisterHook([&](const Tensor&) {
    ++unused_calls;
    return Tensor();
  });
  out[1].RetainGrad();
  Backward(ops::Sum(out[0]));
  EXPECT_EQ(used_calls, 1);
  EXPECT_EQ(unused_calls, 0);
  EXPECT_FALSE(out[1].grad().defined());
  EXPECT_EQ(x.grad().ToVector<float>(), (std::vector<float>{4, 4}));
}

// Hooks registered and removed on one thread while backward passes on
// another run that leaf's hooks: the hook lists are locked, so this is
// race-free (run under --config=tsan to see it; before, it was a data race
// on the vectors). Every pass runs the hooks it was given, which add
// nothing, so the gradient is exact.
TEST(GradHookTest, HooksMayBeRegisteredAndRemovedDuringABackwardOnAnotherThread) {
  constexpr int kIters = 300;
  Tensor w = Param({4}, 1.0);
  std::atomic<int> post_calls{0};
  std::atomic<bool> backward_done{false};
  std::thread backward([&] {
    for (int i = 0; i < kIters; ++i) Backward(ops::Sum(ops::MulScalar(w, 1.0)));
    backward_done = true;
  });
  int churns = 0;
  // Churns until the passes end; the passes' count bounds the loop.
  while (!backward_done.load() || churns == 0) {
    HookHandle a = w.RegisterHook([](const Tensor&) { return Tensor(); });
    HookHandle b = w.RegisterPostAccumulateGradHook([&](const Tensor&) { post_calls.fetch_add(1); });
    (void)b.IsLast();
    a.Remove();
    b.Remove();
    ++churns;
  }
  backward.join();
  EXPECT_EQ(w.grad().ToVector<float>(), std::vector<float>(4, kIters));
  EXPECT_LE(post_calls.load(), kIters);
}

// The refusal comes before the nested pass runs anything: before, it came
// when the pass reached w, after v's accumulation had run (v.grad was 4)
// and the graph's saved tensors were released.
TEST(AutogradTest, ANestedBackwardThroughTheRunningNodeIsRefusedBeforeAnythingRuns) {
  Tensor w = Param({2}, 1.0), v = Param({2}, 2.0);
  // v's branch recorded last, so that a pass runs it before w's.
  const Tensor through_w = ops::MulScalar(w, 3.0);
  const Tensor through_v = ops::Mul(v, v);
  const Tensor root = ops::Sum(ops::Add(through_w, through_v));
  bool nest = true;
  w.RegisterPostAccumulateGradHook([&](const Tensor&) {
    if (nest) Backward(root);
  });
  const std::string err = ErrorOf([&] { Backward(ops::Sum(ops::MulScalar(w, 2.0))); });
  EXPECT_NE(err.find("a nested backward pass reached AccumulateGrad"), std::string::npos) << err;
  EXPECT_FALSE(v.grad().defined());
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{2, 2}));
  nest = false;
  Backward(root);  // nothing of its graph was run or released
  EXPECT_EQ(v.grad().ToVector<float>(), (std::vector<float>{4, 4}));  // 2v
  EXPECT_EQ(w.grad().ToVector<float>(), (std::vector<float>{5, 5}));
}

// A callback queued on the outermost pass from a nested one runs when the
// user's Backward ends, not when the nested pass does (DDP's end of
// iteration needs every gradient of the outer pass).
TEST(AutogradTest, ACallbackForTheOutermostPassWaitsForTheEnclosingPass) {
  Tensor w = Param({2}, 1.0), v = Param({2}, 2.0);
  const Tensor loss_v = ops::Sum(ops::Mul(v, v));
  std::vector<std::string> events;
  v.RegisterPostAccumulateGradHook([&](const Tensor&) {
    QueueCallback([&] { events.push_back("inner"); });
    QueueCallback([&] { events.push_back("outermost"); }, /*outermost=*/true);
  });
  w.RegisterPostAccumulateGradHook([&](const Tensor&) {
    Backward(loss_v);
    events.push_back("nested returned");
  });
  Backward(ops::Sum(ops::MulScalar(w, 4.0)));
  EXPECT_EQ(events, (std::vector<std::string>{"inner", "nested returned", "outermost"}));
  EXPECT_THROW(QueueCallback([] {}, /*outermost=*/true), std::logic_error);
}

// Nested passes on two threads, each reaching the leaf whose hook started
// the other: each holds the node the other waits for. A nested pass waits
// up to its deadline and then fails naming both nodes, so at least one
// thread gets that error and neither hangs (before, both waited forever).
TEST(AutogradTest, NestedPassesWaitingForEachOtherAcrossThreadsFailAtTheDeadline) {
  SetNestedPassLockTimeout(std::chrono::milliseconds(200));
  Tensor w1 = Param({2}, 1.0), w2 = Param({2}, 1.0);
  const Tensor into_w1 = ops::Sum(ops::MulScalar(w1, 3.0)), into_w2 = ops::Sum(ops::MulScalar(w2, 3.0));
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0, finished = 0;
  // Each hook nests once, after both threads are inside their hooks.
  auto nest_once = [&](std::atomic<bool>& done, const Tensor& root) {
    if (done.exchange(true)) return;
    {
      std::unique_lock<std::mutex> lock(mu);
      ++arrived;
      cv.notify_all();
      if (!cv.wait_for(lock, std::chrono::seconds(30), [&] { return arrived == 2; })) {
        throw std::runtime_error("the other thread never reached its hook");
      }
    }
    Backward(root);
  };
  std::atomic<bool> done1{false}, done2{false};
  w1.RegisterPostAccumulateGradHook([&](const Tensor&) { nest_once(done1, into_w2); });
  w2.RegisterPostAccumulateGradHook([&](const Tensor&) { nest_once(done2, into_w1); });
  std::string err1, err2;
  auto run = [&](const Tensor& w, std::string& err) {
    err = ErrorOf([&] { Backward(ops::Sum(ops::MulScalar(w, 2.0))); });
    std::lock_guard<std::mutex> lock(mu);
    ++finished;
    cv.notify_all();
  };
  std::thread t1(run, w1, std::ref(err1)), t2(run, w2, std::ref(err2));
  {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return finished == 2; })) {
      std::fprintf(stderr, "nested passes on two threads still waiting for each other after 60 s\n");
      std::abort();  // the threads cannot be joined
    }
  }
  t1.join();
  t2.join();
  SetNestedPassLockTimeout(std::chrono::minutes(5));
  EXPECT_TRUE(!err1.empty() || !err2.empty());
  for (const std::string& err : {err1, err2}) {
    if (err.empty()) continue;
    EXPECT_NE(err.find("waited 200 ms for AccumulateGrad, which another thread's backward pass is running, "
                       "while holding AccumulateGrad"),
              std::string::npos)
        << err;
  }
  EXPECT_THROW(SetNestedPassLockTimeout(std::chrono::milliseconds(0)), std::invalid_argument);
}

// A timeout too large for try_lock_for (milliseconds::max() as "no
// deadline") overflowed when converted to a deadline, and a nested pass
// waiting for a busy node failed at once, claiming it had waited that long.
// It is refused with the bound, and the timeout in force is kept.
TEST(AutogradTest, ANestedPassTimeoutTooLargeForADeadlineIsRefused) {
  for (const std::chrono::milliseconds too_long :
       {std::chrono::milliseconds::max(), std::chrono::milliseconds(int64_t{7} * 24 * 3600 * 1000 + 1)}) {
    const std::string err = ErrorOf([&] { SetNestedPassLockTimeout(too_long); });
    EXPECT_NE(err.find("SetNestedPassLockTimeout: the timeout must be at most 7 days (604800000 ms), got " +
                       std::to_string(too_long.count()) + " ms"),
              std::string::npos)
        << err;
  }
  SetNestedPassLockTimeout(std::chrono::hours(24 * 7));  // the bound itself is accepted
  SetNestedPassLockTimeout(std::chrono::minutes(5));
}

}  // namespace
}  // namespace ddp::nn::autograd
