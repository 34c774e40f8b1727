// The communication figures of Train's result cover the steps its
// samples_per_s counts: the first 5 steps of the process are warm-up and
// left out of both (before, comm_share and comm_overlap included them, so
// //examples:scaling_bench's comm and overlap columns mixed in the warm-up
// its samples/s excluded). Two ranks, worker processes of this test.

#include <cstdio>
#include <exception>
#include <string>

#include "examples/trainer/config.h"
#include "examples/trainer/parallel.h"
#include "examples/trainer/trainer.h"
#include "gtest/gtest.h"
#include "transport/launch/test_spawn.h"

namespace ddp::examples::trainer {
namespace {

namespace launch = transport::launch;

// The MLP on generated samples for 8 steps of 16 per rank, no checkpoint;
// prints "measured_steps=M comm_iterations=C". Exit status 0, or 1 after
// printing the error.
DDP_TEST_WORKER(eight_steps) {
  TrainConfig c;
  c.model = "mlp";
  c.dataset = "synthetic";
  c.train_samples = 512;
  c.test_samples = 32;
  c.batch_size = 16;
  c.epochs = 1;
  c.max_steps = 8;
  c.workers = 0;
  c.timeout_s = 30;
  c.checkpoint.clear();
  RunOptions options;
  options.quiet = true;
  options.print_result = false;
  options.evaluate = false;
  try {
    ValidateConfig(c);
    std::unique_ptr<Parallel> parallel = JoinJob("", std::chrono::seconds(c.timeout_s));
    const RunResult r = Train(c, *parallel, options);
    std::printf("measured_steps=%lld comm_iterations=%lld\n", static_cast<long long>(r.measured_steps),
                static_cast<long long>(r.comm_iterations));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::fflush(stdout);
  return 0;
}

TEST(TrainerTotalsTest, CommunicationFiguresLeaveOutTheWarmUpSteps) {
  auto run = launch::testing::RunTestWorkers(
      "eight_steps", {.world_size = 2, .timeout = std::chrono::seconds(90)});
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(run->AllSucceeded()) << run->Summary() << run->Output(0) << run->Output(1);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(run->Output(rank).find("measured_steps=3 comm_iterations=3\n"), std::string::npos)
        << "rank " << rank << ": " << run->Output(rank);
  }
}

}  // namespace
}  // namespace ddp::examples::trainer
