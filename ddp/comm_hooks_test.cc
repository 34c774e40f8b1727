// The built-in hooks called directly on a bucket, over real processes (3
// ranks: a divisor that is not a power of two): AllReduceHook and the
// compression hooks leave the average whether the bucket came divided or
// undivided (from the body of a hook on local gradients), also inside DDP
// (the no-hook average); NoopHook leaves the bucket as given.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "ddp/comm_hooks.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/testing/ddp_test_util.h"
#include "nn/autograd/engine.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"

namespace ddp::dist {
namespace {

using testing::OneBackwardGrads;
using testing::RunWorkers;

// Rank r's gradient is 3 (r + 1) in every element: over 3 ranks the
// average is 6, and every value here (3, 6, 9; divided 1, 2, 3; their
// sum) is exact in f16 and bf16.
double Gradient(int rank) { return 3.0 * (rank + 1); }

DDP_TEST_WORKER(hooks_leave_the_average) {
  auto pg = testing::WorkerGroup();
  const int rank = pg->rank();
  const double divisor = pg->size();
  double average = 0;
  for (int r = 0; r < pg->size(); ++r) average += Gradient(r) / divisor;
  const std::vector<std::pair<std::string, CommHook>> cases = {{"AllReduceHook", hooks::AllReduceHook()},
                                                              {"Fp16CompressHook", hooks::Fp16CompressHook()},
                                                              {"Bf16CompressHook", hooks::Bf16CompressHook()}};
  for (const auto& [name, hook] : cases) {
    for (const bool divided : {false, true}) {
      const nn::Tensor buffer = nn::Full({5}, divided ? Gradient(rank) / divisor : Gradient(rank));
      GradBucket bucket(0, 1, buffer, {}, {}, divisor, divided);
      hook(*pg, bucket).Wait();
      for (double got : buffer.ToVector<double>()) {
        WORKER_EXPECT(got == average, name + " on " + (divided ? "a divided" : "an undivided") + " bucket: " +
                                          std::to_string(got) + " instead of the average " +
                                          std::to_string(average));
      }
    }
  }
  // NoopHook: the bucket as it was given, divided or not.
  for (const bool divided : {false, true}) {
    const double given = divided ? Gradient(rank) / divisor : Gradient(rank);
    const nn::Tensor buffer = nn::Full({5}, given);
    GradBucket bucket(0, 1, buffer, {}, {}, divisor, divided);
    hooks::NoopHook()(*pg, bucket).Wait();
    for (double got : buffer.ToVector<double>()) {
      WORKER_EXPECT(got == given, std::string("NoopHook on ") + (divided ? "a divided" : "an undivided") +
                                      " bucket: " + std::to_string(got) + " instead of " + std::to_string(given));
    }
  }
  return testing::WorkerExit();
}

// A hook on local gradients that hands its bucket to AllReduceHook or a
// compression hook (as PyTorch users wrap allreduce_hook) gets the average:
// it got the sum, the world size times the average.
TEST(CommHooksTest, BuiltInHooksLeaveTheAverageOnDividedAndUndividedBuckets) {
  auto run = RunWorkers("hooks_leave_the_average", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A divisor the hooks cannot divide by is refused when the bucket is made,
// naming it: AllReduceHook on an undivided bucket divided by 0 and left
// infinities.
TEST(CommHooksTest, ABucketWithADivisorThatIsNotPositiveAndFiniteIsRefused) {
  for (const double divisor : {0.0, -2.0, std::nan(""), static_cast<double>(INFINITY)}) {
    try {
      GradBucket bucket(3, 4, nn::Full({2}, 1.0), {}, {}, divisor, false);
      ADD_FAILURE() << "divisor " << divisor << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("GradBucket (bucket 3): divisor must be a positive finite number"),
                std::string::npos)
          << e.what();
    }
  }
}

// A bucket whose parameters do not fit its buffer is refused when it is
// made, naming the bucket and the parameter: PowerSgdHook reads and writes
// each parameter's gradient at its offset, so an offset missing (fewer
// offsets than parameters) or past the buffer's end made it read and write
// outside the buffer. An index past the count is refused too: the bucket
// was never the last, so hooks that count iterations on the last bucket
// never counted.
TEST(CommHooksTest, ABucketWhoseParametersDoNotFitItsBufferIsRefused) {
  const nn::Tensor weight = nn::Zeros({3, 4});
  const nn::Tensor bias = nn::Zeros({3});
  struct Case {
    std::string what;
    size_t index;
    std::vector<nn::Tensor> parameters;
    std::vector<int64_t> offsets;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"an offset missing", 1, {weight, bias}, {0}, "GradBucket (bucket 1): 2 parameters and 1 offsets"},
      {"an offset too many", 1, {weight}, {0, 12}, "GradBucket (bucket 1): 1 parameters and 2 offsets"},
      {"past the end", 1, {weight, bias}, {0, 13},
       "GradBucket (bucket 1): parameter 1 ([3], 3 elements) at offset 13 lies outside the buffer's 15 elements"},
      {"a negative offset", 1, {weight, bias}, {-1, 12},
       "GradBucket (bucket 1): parameter 0 ([3, 4], 12 elements) at offset -1 lies outside the buffer's 15 elements"},
      {"an undefined parameter", 1, {weight, nn::Tensor()}, {0, 12},
       "GradBucket (bucket 1): parameter 1 is undefined"},
      {"an index past the count", 4, {weight, bias}, {0, 12}, "GradBucket (bucket 4): the index is not below the "
                                                               "count of buckets, 4"},
  };
  for (const Case& c : cases) {
    try {
      GradBucket bucket(c.index, 4, nn::Zeros({15}), c.parameters, c.offsets);
      ADD_FAILURE() << c.what << ": accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(c.expected), std::string::npos) << c.what << ": " << e.what();
    }
  }
  // A buffer that is not flat memory: hooks write from its data pointer.
  for (const nn::Tensor& buffer : {nn::Zeros({1}).Expand({15}), nn::Zeros({3, 5}), nn::Zeros({30}).Slice(0, 0, 30, 2)}) {
    try {
      GradBucket bucket(1, 4, buffer, {weight, bias}, {0, 12});
      ADD_FAILURE() << nn::ShapeToString(buffer.shape()) << ": accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("is not one-dimensional and contiguous"), std::string::npos) << e.what();
    }
  }
  // Laid out right, with a bucket of its own that holds the parameters
  // back to back, it is taken.
  GradBucket fits(3, 4, nn::Zeros({15}), {weight, bias}, {0, 12});
  EXPECT_TRUE(fits.is_last());
}

// A bucket scaled in place by the host loop (CPU, contiguous) counts as
// written, as it does through the device kernel: buffer_written() is how
// PowerSgdHook and PostLocalSgdHook see that a calling hook divided the
// gradients already. The host loop wrote through a raw pointer without
// bumping the storage's version, so such a division went unseen and the
// gradients were divided twice.
TEST(CommHooksTest, AHostLoopScaleCountsAsAWriteOfTheBucket) {
  for (const double factor : {0.5, 1.0}) {
    SCOPED_TRACE("factor " + std::to_string(factor));
    const nn::Tensor buffer = nn::Full({4}, 6.0);
    GradBucket bucket(0, 1, buffer, {}, {}, 2.0, false);
    ASSERT_FALSE(bucket.buffer_written());
    // From another tensor (factor 1 is a plain copy, which writes too).
    internal::ScaleTensor(buffer, nn::Full({4}, 2.0), factor);
    EXPECT_TRUE(bucket.buffer_written());
    EXPECT_EQ(buffer.ToVector<double>(), std::vector<double>(4, 2.0 * factor));
  }
  const nn::Tensor buffer = nn::Full({4}, 6.0);
  GradBucket bucket(0, 1, buffer, {}, {}, 2.0, false);
  internal::ScaleTensor(buffer, buffer, 0.5);
  EXPECT_TRUE(bucket.buffer_written());
  EXPECT_EQ(buffer.ToVector<double>(), std::vector<double>(4, 3.0));
  // Scaling in place by 1 changes nothing and is no write.
  const nn::Tensor same = nn::Full({4}, 6.0);
  GradBucket untouched(0, 1, same, {}, {}, 2.0, false);
  internal::ScaleTensor(same, same, 1.0);
  EXPECT_FALSE(untouched.buffer_written());
}

// A compression hook given an integer bucket (from a user's hook on local
// gradients, undivided) names itself, the bucket and the dtype, and leaves
// the bucket as it was. Before, an undivided bucket failed in the division
// first, with an error naming neither hook nor bucket ("gradient
// averaging").
TEST(CommHooksTest, ACompressionHookGivenAnIntegerBucketNamesItselfAndTheDtype) {
  const std::shared_ptr<ProcessGroup> pg = ProcessGroup::Single();
  const std::vector<std::pair<std::string, CommHook>> cases = {{"Fp16CompressHook", hooks::Fp16CompressHook()},
                                                              {"Bf16CompressHook", hooks::Bf16CompressHook()}};
  for (const auto& [name, hook] : cases) {
    for (const bool divided : {false, true}) {
      SCOPED_TRACE(name + (divided ? " on a divided bucket" : " on an undivided bucket"));
      const nn::Tensor buffer = nn::Full({4}, 6.0, {.dtype = nn::DType::kInt64});
      GradBucket bucket(2, 3, buffer, {}, {}, 2.0, divided);
      try {
        hook(*pg, bucket).Wait();
        ADD_FAILURE() << "an i64 bucket was compressed";
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()), name + ": bucket 2 has dtype i64, which cannot be compressed (f32 and "
                                                "f64 buckets are sent as 16-bit floats, f16 and bf16 ones as "
                                                "they are)");
      }
      EXPECT_EQ(buffer.ToVector<double>(), std::vector<double>(4, 6.0));
    }
  }
}

// AllReduceHook given an undivided integer bucket (which it would have to
// average) names itself, the bucket and the dtype, and leaves the bucket as
// it was. Before, it failed in the division with "gradient averaging: dtype
// i64 is not supported".
TEST(CommHooksTest, AllReduceHookGivenAnUndividedIntegerBucketNamesItselfAndTheDtype) {
  const std::shared_ptr<ProcessGroup> pg = ProcessGroup::Single();
  const nn::Tensor buffer = nn::Full({4}, 6.0, {.dtype = nn::DType::kInt64});
  GradBucket bucket(1, 3, buffer, {}, {}, 2.0, /*divided=*/false);
  try {
    hooks::AllReduceHook()(*pg, bucket).Wait();
    ADD_FAILURE() << "an undivided i64 bucket was averaged";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "AllReduceHook: bucket 1 has dtype i64 and came undivided, so it would be "
                                     "averaged here; only floating buckets can be (a divided one is summed as "
                                     "it is)");
  }
  EXPECT_EQ(buffer.ToVector<double>(), std::vector<double>(4, 6.0));
}

// The largest |a - b| over every gradient, divided by the largest |b|.
double RelativeDifference(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double diff = 0, scale = 0;
  for (size_t t = 0; t < b.size(); ++t) {
    for (size_t i = 0; i < b[t].size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(a[t][i] - b[t][i])));
      scale = std::max(scale, static_cast<double>(std::fabs(b[t][i])));
    }
  }
  return scale == 0 ? diff : diff / scale;
}

// A hook on local gradients that hands every bucket to a built-in hook, as
// PyTorch users wrap allreduce_hook: DDP's no-hook average (bit for bit for
// AllReduceHook, within 16-bit rounding for the compression hooks), where
// the gradients came out the world size times too large.
DDP_TEST_WORKER(built_in_hooks_inside_a_local_hook) {
  auto pg = testing::WorkerGroup();
  const auto reference = OneBackwardGrads(pg, nullptr);
  const std::vector<std::tuple<std::string, CommHook, double>> cases = {
      {"AllReduceHook", hooks::AllReduceHook(), 0.0},
      {"Fp16CompressHook", hooks::Fp16CompressHook(), 2e-3},
      {"Bf16CompressHook", hooks::Bf16CompressHook(), 1.6e-2}};
  for (const auto& [name, inner, tolerance] : cases) {
    const auto got = OneBackwardGrads(
        pg, CommHook::OnLocalGradients([inner = inner](ProcessGroup& g, GradBucket& b) { return inner(g, b); }));
    const double diff = RelativeDifference(got, reference);
    WORKER_EXPECT(diff <= tolerance, name + " inside a hook on local gradients: off DDP's average by " +
                                         std::to_string(diff) + " (tolerance " + std::to_string(tolerance) + ")");
  }
  return testing::WorkerExit();
}

TEST(CommHooksTest, BuiltInHooksInsideAHookOnLocalGradientsGiveDdpsAverage) {
  auto run = RunWorkers("built_in_hooks_inside_a_local_hook", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

}  // namespace
}  // namespace ddp::dist
