// Bucket assignment, timing sums, and the reducer over a one-process group
// (no processes needed).

#include "ddp/reducer.h"

#include <gtest/gtest.h>

#include "nn/autograd/engine.h"
#include "nn/ops/functional.h"

namespace ddp::dist::internal {
namespace {

using nn::DType;
using nn::Tensor;

std::vector<size_t> Reverse(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  return order;
}

// The peers' MLP: 1.weight [512, 784], 1.bias, 3.weight [256, 512], 3.bias,
// 5.weight [10, 256], 5.bias.
std::vector<Tensor> MlpShapes() {
  return {nn::Empty({512, 784}), nn::Empty({512}), nn::Empty({256, 512}),
          nn::Empty({256}),      nn::Empty({10, 256}), nn::Empty({10})};
}

TEST(AssignBucketsTest, PyTorchRuleWithoutInPlaceBuckets) {
  // 1 MiB first bucket: it closes once 1.weight pushes it past the limit.
  const auto buckets = AssignBuckets(MlpShapes(), Reverse(6), 1 << 20, 25 << 20, 0);
  ASSERT_EQ(buckets.size(), 1u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{5, 4, 3, 2, 1, 0}));
}

TEST(AssignBucketsTest, LargeGradientGetsItsOwnBucket) {
  // 1.weight (1.5 MiB) and 3.weight (512 KiB) are at least 512 KiB: alone;
  // the small ones share a bucket, complete when 1.bias arrives.
  const auto buckets = AssignBuckets(MlpShapes(), Reverse(6), 1 << 20, 25 << 20, 512 << 10);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{5, 4, 3, 1}));
  EXPECT_EQ(buckets[2], (std::vector<size_t>{0}));
}

TEST(AssignBucketsTest, FirstBucketSmallThenCap) {
  // 100 KiB first bucket, then 600 KiB; nothing in place below 1 MiB.
  const auto buckets = AssignBuckets(MlpShapes(), Reverse(6), 100 << 10, 600 << 10, 1 << 20);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{5, 4, 3, 2}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{1}));  // complete before 1.weight arrives
  EXPECT_EQ(buckets[2], (std::vector<size_t>{0}));
}

TEST(AssignBucketsTest, TinyLimitMeansOneBucketPerParameter) {
  const auto buckets = AssignBuckets(MlpShapes(), Reverse(6), 1, 1, 0);
  ASSERT_EQ(buckets.size(), 6u);
  for (size_t b = 0; b < 6; ++b) EXPECT_EQ(buckets[b], std::vector<size_t>{5 - b});
}

TEST(AssignBucketsTest, OneDtypePerBucketInCompletionOrder) {
  std::vector<Tensor> params = {nn::Empty({4}), nn::Empty({4}, {.dtype = DType::kBFloat16}),
                                nn::Empty({4}), nn::Empty({4}, {.dtype = DType::kBFloat16})};
  const auto buckets = AssignBuckets(params, Reverse(4), 1 << 20, 1 << 20, 1 << 20);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{3, 1}));  // bf16, complete first
  EXPECT_EQ(buckets[1], (std::vector<size_t>{2, 0}));  // f32
}

TEST(AssignBucketsTest, FollowsTheGivenOrder) {
  // The order the MLP's gradients arrive in: weight before bias.
  const auto buckets = AssignBuckets(MlpShapes(), {4, 5, 2, 3, 0, 1}, 1 << 20, 25 << 20, 512 << 10);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{0}));
  EXPECT_EQ(buckets[2], (std::vector<size_t>{4, 5, 3, 1}));
}

// Backward statistics (AddIterationTimes). Times in ms after a fixed origin.
using TimePoint = IterationTiming::TimePoint;
TimePoint At(int ms) { return TimePoint{} + std::chrono::hours(1) + std::chrono::milliseconds(ms); }

IterationTiming::Collective Ran(int from_ms, int to_ms, bool on_caller) {
  return {.started = At(from_ms), .finished = At(to_ms), .on_caller = on_caller};
}

// Collectives on the caller, static_graph learning: the bucket of an output
// left out of the loss runs from Finalize, after the last gradient (10 ms):
// 30 ms of communication that held nothing of the 10 ms compute up.
TEST(IterationTimesTest, CallerBucketAfterTheLastGradientIsExposedNotCompute) {
  IterationTiming t{.prepared = At(0), .last_grad = At(10), .end = At(45)};
  t.buckets = {Ran(12, 42, /*on_caller=*/true)};
  ReducerTimes times;
  AddIterationTimes(t, times);
  EXPECT_NEAR(times.backward_compute, 0.010, 1e-9);
  EXPECT_NEAR(times.exposed, 0.035, 1e-9);  // from the last gradient to the end, once
  EXPECT_NEAR(times.backward_comm, 0.030, 1e-9);
  EXPECT_EQ(times.overlap, 0);
}

// A forward under NoSync (8 ms) between the forward that prepared the
// backward (0) and that backward, which it joins: forward's time, so
// compute is the 20 ms to the last gradient less those 8.
TEST(IterationTimesTest, AForwardThatJoinedTheBackwardIsNotCompute) {
  IterationTiming t{.prepared = At(0), .last_grad = At(20), .joined_forwards = std::chrono::milliseconds(8),
                    .end = At(25)};
  ReducerTimes times;
  AddIterationTimes(t, times);
  EXPECT_NEAR(times.backward_compute, 0.012, 1e-9);
  EXPECT_NEAR(times.exposed, 0.005, 1e-9);
}

// A caller bucket inside the hooks (before the last gradient) held backward
// up: compute is the rest, and the bucket's time is exposed.
TEST(IterationTimesTest, CallerBucketInsideTheHooksIsExposed) {
  IterationTiming t{.prepared = At(0), .last_grad = At(20), .end = At(25)};
  t.buckets = {Ran(5, 13, /*on_caller=*/true)};
  ReducerTimes times;
  AddIterationTimes(t, times);
  EXPECT_NEAR(times.backward_compute, 0.012, 1e-9);
  EXPECT_NEAR(times.exposed, 0.013, 1e-9);
  EXPECT_NEAR(times.backward_comm, 0.008, 1e-9);
  EXPECT_EQ(times.overlap, 0);
}

// A CPU bucket on the caller beside a device bucket on the communication
// thread: both count as communication, and the device bucket's part before
// the last gradient overlapped.
TEST(IterationTimesTest, CallerAndCommunicationThreadBucketsBothCount) {
  IterationTiming t{.prepared = At(0), .last_grad = At(20), .end = At(30)};
  t.buckets = {Ran(4, 8, /*on_caller=*/false), Ran(10, 12, /*on_caller=*/true)};
  ReducerTimes times;
  AddIterationTimes(t, times);
  EXPECT_NEAR(times.backward_comm, 0.006, 1e-9);
  EXPECT_NEAR(times.overlap, 0.004, 1e-9);
  EXPECT_NEAR(times.backward_compute, 0.018, 1e-9);
  EXPECT_NEAR(times.exposed, 0.012, 1e-9);
}

// A Work with no start recorded (TimePoint{}, as in a forked child) is left
// out; before, it made the first start the clock's epoch, and the
// communication time the host's uptime.
TEST(IterationTimesTest, AnUnknownStartIsLeftOut) {
  IterationTiming t{.prepared = At(0), .last_grad = At(20), .end = At(30)};
  t.buckets = {{.started = TimePoint{}, .finished = At(15)}, Ran(16, 25, /*on_caller=*/false)};
  ReducerTimes times;
  AddIterationTimes(t, times);
  EXPECT_NEAR(times.backward_comm, 0.009, 1e-9);
  EXPECT_NEAR(times.overlap, 0.004, 1e-9);
  IterationTiming caller{.prepared = At(0), .last_grad = At(20), .end = At(30)};
  caller.buckets = {{.started = TimePoint{}, .finished = At(15), .on_caller = true}};
  ReducerTimes caller_times;
  AddIterationTimes(caller, caller_times);
  EXPECT_EQ(caller_times.backward_comm, 0);
  EXPECT_NEAR(caller_times.backward_compute, 0.020, 1e-9);
  EXPECT_NEAR(caller_times.exposed, 0.010, 1e-9);
}

// find_unused_parameters with gradient_as_bucket_view: a parameter unused
// in an iteration whose .grad is its bucket view has that .grad copied, to
// be given back at the iteration's end when no rank used it. A backward
// that fails (a parameter forward reached got no gradient) never reaches
// that end, and every later forward throws, so no later iteration drops
// the copy either: it stayed until the reducer was destroyed. It goes at
// the failure now.
TEST(ReducerTest, AFailedBackwardDropsItsCopiesOfStaleGradients) {
  const Tensor w0 = nn::Full({4}, 1.0, {.requires_grad = true});
  const Tensor w1 = nn::Full({4}, 2.0, {.requires_grad = true});
  const Tensor w2 = nn::Full({4}, 3.0, {.requires_grad = true});
  Reducer reducer({{"w0", w0}, {"w1", w1}, {"w2", w2}}, ProcessGroup::Single(),
                  {.inplace_bytes = 0, .find_unused_parameters = true, .gradient_as_bucket_view = true},
                  nullptr);
  const Tensor x = nn::Full({4}, 2.0);
  const auto out = [&](const Tensor& w) { return nn::ops::Sum(nn::ops::Mul(w, x)); };
  // Every parameter used: each .grad becomes its bucket view.
  reducer.CheckPreviousIteration(true);
  std::vector<Tensor> outputs{out(w0), out(w1), out(w2)};
  reducer.PrepareForBackward(outputs, 1.0);
  nn::Backward(outputs[0] + outputs[1] + outputs[2]);
  ASSERT_EQ(reducer.iterations(), 1);
  EXPECT_EQ(reducer.stale_copies(), 0u);
  // w2 unused (its .grad copied), w1 reached by forward but left out of the loss.
  reducer.CheckPreviousIteration(true);
  outputs = {out(w0), out(w1)};
  reducer.PrepareForBackward(outputs, 1.0);
  try {
    nn::Backward(outputs[0]);
    ADD_FAILURE() << "a backward that left `w1` without a gradient went through";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("`w1`"), std::string::npos) << e.what();
  }
  EXPECT_EQ(reducer.stale_copies(), 0u);
}

// The same when the backward fails in a gradient hook: a parameter the
// forward left unused gets a gradient (a loss term on it computed outside
// forward), after another parameter's first gradient had copied its stale
// .grad.
TEST(ReducerTest, AGradientForAnUnusedParameterDropsTheCopiesOfStaleGradients) {
  const Tensor w0 = nn::Full({4}, 1.0, {.requires_grad = true});
  const Tensor w1 = nn::Full({4}, 3.0, {.requires_grad = true});
  Reducer reducer({{"w0", w0}, {"w1", w1}}, ProcessGroup::Single(),
                  {.inplace_bytes = 0, .find_unused_parameters = true, .gradient_as_bucket_view = true},
                  nullptr);
  const Tensor x = nn::Full({4}, 2.0);
  const auto out = [&](const Tensor& w) { return nn::ops::Sum(nn::ops::Mul(w, x)); };
  reducer.CheckPreviousIteration(true);
  std::vector<Tensor> outputs{out(w0), out(w1)};
  reducer.PrepareForBackward(outputs, 1.0);
  nn::Backward(outputs[0] + outputs[1]);
  ASSERT_EQ(reducer.iterations(), 1);
  // Recorded before the forward's outputs, so that backward reaches w0
  // first (the engine runs the latest ready node first).
  const Tensor penalty = out(w1);
  reducer.CheckPreviousIteration(true);
  outputs = {out(w0)};
  reducer.PrepareForBackward(outputs, 1.0);
  try {
    nn::Backward(outputs[0] + penalty);
    ADD_FAILURE() << "a gradient for the unused `w1` went through";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("`w1` received a gradient although it is not reachable"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(reducer.stale_copies(), 0u);
}

// The same when the backward fails on a second gradient for one parameter:
// a hook on an output runs a backward of its own through w0 (a re-entrant
// pass, as activation checkpointing runs), and the enclosing pass then
// brings w0 its gradient again, after its first went into its bucket.
TEST(ReducerTest, ASecondGradientInOneBackwardDropsTheCopiesOfStaleGradients) {
  const Tensor w0 = nn::Full({4}, 1.0, {.requires_grad = true});
  const Tensor w1 = nn::Full({4}, 2.0, {.requires_grad = true});
  const Tensor w2 = nn::Full({4}, 3.0, {.requires_grad = true});
  Reducer reducer({{"w0", w0}, {"w1", w1}, {"w2", w2}}, ProcessGroup::Single(),
                  {.inplace_bytes = 0, .find_unused_parameters = true, .gradient_as_bucket_view = true},
                  nullptr);
  const Tensor x = nn::Full({4}, 2.0);
  const auto out = [&](const Tensor& w) { return nn::ops::Sum(nn::ops::Mul(w, x)); };
  reducer.CheckPreviousIteration(true);
  std::vector<Tensor> outputs{out(w0), out(w1), out(w2)};
  reducer.PrepareForBackward(outputs, 1.0);
  nn::Backward(outputs[0] + outputs[1] + outputs[2]);
  ASSERT_EQ(reducer.iterations(), 1);
  // w2 unused (its .grad copied at the first gradient).
  reducer.CheckPreviousIteration(true);
  outputs = {out(w0), out(w1)};
  outputs[1].RegisterHook([&](const Tensor&) {
    nn::GradModeGuard grad(true);  // hooks run with grad mode off
    nn::Backward(out(w0));
    return Tensor();
  });
  reducer.PrepareForBackward(outputs, 1.0);
  try {
    nn::Backward(outputs[0] + outputs[1]);
    ADD_FAILURE() << "a second gradient for `w0` went through";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("`w0` received a second gradient in one backward"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(reducer.stale_copies(), 0u);
}

// The same when the bucket's communication fails: the communication hook
// throws, returns an empty Work, or returns a Work that fails (the end of
// backward waits for it and throws). These kept the copies until the next
// forward.
TEST(ReducerTest, AFailedBucketCommunicationDropsTheCopiesOfStaleGradients) {
  enum class Failure { kHookThrows, kEmptyWork, kWorkFails };
  for (const Failure failure : {Failure::kHookThrows, Failure::kEmptyWork, Failure::kWorkFails}) {
    SCOPED_TRACE("failure " + std::to_string(static_cast<int>(failure)));
    const Tensor w0 = nn::Full({4}, 1.0, {.requires_grad = true});
    const Tensor w1 = nn::Full({4}, 2.0, {.requires_grad = true});
    const Tensor w2 = nn::Full({4}, 3.0, {.requires_grad = true});
    Reducer reducer({{"w0", w0}, {"w1", w1}, {"w2", w2}}, ProcessGroup::Single(),
                    {.inplace_bytes = 0, .find_unused_parameters = true, .gradient_as_bucket_view = true},
                    nullptr);
    bool fail = false;
    reducer.SetCommHook([&](ProcessGroup& group, GradBucket& bucket) -> Work {
      if (!fail) return group.AllReduce(bucket.buffer());
      switch (failure) {
        case Failure::kHookThrows:
          throw std::runtime_error("hook failed on purpose");
        case Failure::kEmptyWork:
          return Work();
        case Failure::kWorkFails:
          return group.Run({.kind = "failing hook", .dtype = bucket.buffer().dtype(), .shape = bucket.buffer().shape()},
                           [](transport::Communicator*, transport::Deadline) {
                             return transport::UnavailableError("the hook's collective failed on purpose");
                           });
      }
      return Work();
    });
    const Tensor x = nn::Full({4}, 2.0);
    const auto out = [&](const Tensor& w) { return nn::ops::Sum(nn::ops::Mul(w, x)); };
    reducer.CheckPreviousIteration(true);
    std::vector<Tensor> outputs{out(w0), out(w1), out(w2)};
    reducer.PrepareForBackward(outputs, 1.0);
    nn::Backward(outputs[0] + outputs[1] + outputs[2]);
    ASSERT_EQ(reducer.iterations(), 1);
    // w2 unused (its .grad, its bucket view, copied at the first gradient);
    // the one bucket fails once the last gradient is in.
    fail = true;
    reducer.CheckPreviousIteration(true);
    outputs = {out(w0), out(w1)};
    reducer.PrepareForBackward(outputs, 1.0);
    try {
      nn::Backward(outputs[0] + outputs[1]);
      ADD_FAILURE() << "the failed bucket went through";
    } catch (const std::exception& e) {
      const std::string expected = failure == Failure::kHookThrows  ? "hook failed on purpose"
                                   : failure == Failure::kEmptyWork ? "returned an empty Work"
                                                                    : "the hook's collective failed on purpose";
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    EXPECT_EQ(reducer.stale_copies(), 0u);
  }
}

}  // namespace
}  // namespace ddp::dist::internal
