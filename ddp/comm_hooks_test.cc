// The built-in hooks called directly on a bucket, over real processes (3
// ranks: a divisor that is not a power of two): AllReduceHook and the
// compression hooks leave the average whether the bucket came divided or
// undivided (from the body of a hook on local gradients); NoopHook leaves
// the bucket as given.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ddp/comm_hooks.h"
#include "ddp/testing/ddp_test_util.h"

namespace ddp::dist {
namespace {

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

}  // namespace
}  // namespace ddp::dist
