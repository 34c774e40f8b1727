// The communication figures of Train's result cover the steps its
// samples_per_s counts: the first 5 steps of the process are warm-up and
// left out of both (before, comm_share and comm_overlap included them, so
// //examples:scaling_bench's comm and overlap columns mixed in the warm-up
// its samples/s excluded). Two ranks, worker processes of this test.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>

#include "examples/trainer/config.h"
#include "examples/trainer/parallel.h"
#include "examples/trainer/trainer.h"
#include "gtest/gtest.h"
#include "transport/launch/test_spawn.h"

namespace ddp::examples::trainer {
namespace {

namespace launch = transport::launch;

// Trains `c` in this worker's job, quietly and without evaluation, and
// hands the result to `print`. Returns the worker's exit status: 0, or 1
// after printing the error.
int TrainAndPrint(const TrainConfig& c, const std::function<void(const RunResult&)>& print) {
  RunOptions options;
  options.quiet = true;
  options.print_result = false;
  options.evaluate = false;
  try {
    ValidateConfig(c);
    std::unique_ptr<Parallel> parallel = JoinJob("", std::chrono::seconds(c.timeout_s));
    print(Train(c, *parallel, options));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::fflush(stdout);
  return 0;
}

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
  return TrainAndPrint(c, [](const RunResult& r) {
    std::printf("measured_steps=%lld comm_iterations=%lld\n", static_cast<long long>(r.measured_steps),
                static_cast<long long>(r.comm_iterations));
  });
}

// One epoch of the MLP on 80 generated samples (40 per rank), batches of
// BATCH_SIZE, at a learning rate so small that the model stays as it was
// (to about 1e-12): the epoch's mean loss is then that of the initial
// model over the 80 samples, whatever the batches. Prints
// "train_loss=L". Exit status 0, or 1 after printing the error.
DDP_TEST_WORKER(tiny_lr_epoch) {
  TrainConfig c;
  c.model = "mlp";
  c.dataset = "synthetic";
  c.train_samples = 80;
  c.test_samples = 32;
  c.batch_size = std::atoll(std::getenv("BATCH_SIZE"));
  c.lr = 1e-12;
  c.epochs = 1;
  c.workers = 0;
  c.timeout_s = 30;
  c.checkpoint.clear();
  return TrainAndPrint(c, [](const RunResult& r) { std::printf("train_loss=%.17g\n", r.train_loss); });
}

// Rank 0's train loss of tiny_lr_epoch with batches of `batch_size`.
double TinyLrEpochLoss(int batch_size) {
  auto run = launch::testing::RunTestWorkers(
      "tiny_lr_epoch", {.world_size = 2,
                        .timeout = std::chrono::seconds(90),
                        .env = {{"BATCH_SIZE", std::to_string(batch_size)}}});
  EXPECT_TRUE(run.ok()) << run.status();
  if (!run.ok()) return NAN;
  EXPECT_TRUE(run->AllSucceeded()) << run->Summary() << run->Output(0) << run->Output(1);
  const std::string out = run->Output(0);
  const size_t at = out.find("train_loss=");
  EXPECT_NE(at, std::string::npos) << out;
  return at == std::string::npos ? NAN : std::strtod(out.c_str() + at + 11, nullptr);
}

// The epoch's train loss is the mean over its samples, as PyTorch's
// examples average it (each batch's loss weighted by its size): a short
// last batch (8 of 16) counts for its 8 samples, not as much as a full
// batch. Before, each batch's mean counted once, and the same samples gave
// another loss with batches of 16 than with batches of 8 (all full).
TEST(TrainerTotalsTest, TrainLossWeighsAShortLastBatchByItsSamples) {
  const double full = TinyLrEpochLoss(8);    // 5 full batches per rank
  const double short_last = TinyLrEpochLoss(16);  // 16, 16 and 8 per rank
  ASSERT_TRUE(std::isfinite(full) && std::isfinite(short_last)) << full << " " << short_last;
  // 1e-5 relative: the batch means are f32, and batches of another size
  // sum in another order (a few ulps, about 1e-7 each); the weighting by
  // batches rather than samples moves the loss by far more.
  EXPECT_NEAR(short_last, full, 1e-5 * std::abs(full));
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
