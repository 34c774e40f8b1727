// The trainer's ranks under ddprun --max_restarts, stopped by SIGTERM as a
// user or a scheduler sends it. Rank 0 reads ddprun's
// TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS to say in its
// "stopped by TERM" line whether the launcher restarts the job:
// - TERM to one rank: ddprun counts the rank's exit as a failure and
//   restarts the job, which resumes from the checkpoint saved at the stop;
//   the line says "restart 1 of 1". Once more with no restart left, the job
//   ends and the line sends the user to --resume.
// - TERM to the launcher and its ranks (scancel, systemd): ddprun stops the
//   job without a restart, whatever restarts are left.

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "examples/testing/checkpoint_step.h"
#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"

namespace ddp::examples {
namespace {

using testing::CheckpointStep;
using testing::Runfile;
using testing::Subprocess;
using Clock = std::chrono::steady_clock;

// ddprun with two ranks of the trainer: the MLP, 3 epochs of 64 steps,
// a checkpoint every 4 steps.
std::vector<std::string> Launch(int max_restarts, const std::string& checkpoint) {
  return {Runfile("transport/launch/ddprun"),
          "--standalone",
          "--nproc_per_node=2",
          "--max_restarts=" + std::to_string(max_restarts),
          Runfile("examples/train"),
          "--dataset=synthetic",
          "--model=mlp",
          "--train_samples=2048",
          "--test_samples=64",
          "--batch_size=16",
          "--epochs=3",
          "--workers=1",
          "--checkpoint_every=4",
          "--checkpoint=" + checkpoint};
}

// Waits until the checkpoint at `path` records at least `step`; -1 when
// the run ends first or two minutes pass.
int64_t WaitForCheckpoint(const std::string& path, int64_t step, Subprocess& p) {
  return testing::WaitForCheckpointStep(
      path, [step](int64_t s) { return s >= step; },
      [&p] { return p.Wait(std::chrono::milliseconds(10)) == -1; }, std::chrono::seconds(120));
}

// Waits up to a minute for `text` in the launcher's stdout.
bool WaitForOutput(const std::string& text, Subprocess& p) {
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < deadline) {
    if (p.Stdout().find(text) != std::string::npos) return true;
    if (p.Wait(std::chrono::milliseconds(0)) != -1) return p.Stdout().find(text) != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// The step of the checkpoint named in the first "stopped by TERM" line of
// `out` ("...; checkpoint of step S in ..."), or -1.
int64_t StoppedCheckpointStep(const std::string& out) {
  const size_t line = out.find("stopped by TERM at epoch ");
  if (line == std::string::npos) return -1;
  const std::string marker = "; checkpoint of step ";
  const size_t at = out.find(marker, line);
  if (at == std::string::npos || at > out.find('\n', line)) return -1;
  return std::atoll(out.c_str() + at + marker.size());
}

TEST(TrainDdprunTest, TermToOneRankRestartsFromTheCheckpointUntilNoRestartIsLeft) {
  const std::string ckpt = testing::MakeTempDir("ddprun_term_rank") + "/ckpt.safetensors";
  Subprocess run(Launch(1, ckpt));
  ASSERT_GT(WaitForCheckpoint(ckpt, 8, run), 0) << run.Stdout() << run.Stderr();
  const std::vector<pid_t> first = run.Children();
  ASSERT_EQ(first.size(), 2u) << run.Stdout() << run.Stderr();
  ASSERT_EQ(kill(first[1], SIGTERM), 0);

  const std::string resuming = "restart 1 of the job: resuming from this run's checkpoint " + ckpt;
  ASSERT_TRUE(WaitForOutput(resuming, run)) << run.Stdout() << run.Stderr();
  EXPECT_NE(run.Stderr().find("restarting the job (restart 1 of 1)"), std::string::npos)
      << run.Stderr();
  const std::string before = run.Stdout().substr(0, run.Stdout().find(resuming));
  // Rank 0 knew the launcher had its one restart left.
  EXPECT_NE(before.find(" in " + ckpt +
                        " (if a rank failed, the launcher restarts the job from it: restart 1 of "
                        "1; otherwise continue with --resume)"),
            std::string::npos)
      << before;
  EXPECT_EQ(before.find("(continue with --resume)"), std::string::npos) << before;
  // The restarted ranks continue from the step saved at the stop.
  const int64_t stopped = StoppedCheckpointStep(before);
  ASSERT_GT(stopped, 0) << before;
  ASSERT_TRUE(WaitForOutput("resumed at epoch", run)) << run.Stdout() << run.Stderr();
  const std::string after = run.Stdout().substr(run.Stdout().find(resuming));
  EXPECT_NE(after.find(", step " + std::to_string(stopped)), std::string::npos)
      << "stopped at step " << stopped << ": " << after;

  // Past a save of the restarted job's own, TERM to one of its ranks: no
  // restart is left, and the job ends.
  ASSERT_GT(WaitForCheckpoint(ckpt, stopped + 1, run), 0) << run.Stdout() << run.Stderr();
  const std::vector<pid_t> second = run.Children();
  ASSERT_EQ(second.size(), 2u) << run.Stdout() << run.Stderr();
  ASSERT_TRUE(std::find(first.begin(), first.end(), second[1]) == first.end());
  ASSERT_EQ(kill(second[1], SIGTERM), 0);
  EXPECT_EQ(run.Wait(std::chrono::seconds(120)), 1) << run.Stdout() << run.Stderr();
  EXPECT_EQ(run.Stderr().find("restart 2 of 1"), std::string::npos) << run.Stderr();
  const std::string last = run.Stdout().substr(run.Stdout().find(resuming));
  EXPECT_NE(last.find("stopped by TERM at epoch "), std::string::npos) << last;
  EXPECT_NE(last.find(" in " + ckpt + " (continue with --resume)"), std::string::npos) << last;
  EXPECT_EQ(last.find("the launcher restarts"), std::string::npos) << last;
  EXPECT_GT(CheckpointStep(ckpt), stopped);
}

// scancel sends TERM to every process of the job step: the launcher stops
// the job and does not restart it, although it has restarts left.
TEST(TrainDdprunTest, TermToTheLauncherAndItsRanksStopsWithoutARestart) {
  const std::string ckpt = testing::MakeTempDir("ddprun_term_all") + "/ckpt.safetensors";
  Subprocess run(Launch(2, ckpt));
  ASSERT_GT(WaitForCheckpoint(ckpt, 8, run), 0) << run.Stdout() << run.Stderr();
  const std::vector<pid_t> workers = run.Children();
  ASSERT_EQ(workers.size(), 2u) << run.Stdout() << run.Stderr();
  run.Signal(SIGTERM);
  for (pid_t w : workers) kill(w, SIGTERM);
  EXPECT_EQ(run.Wait(std::chrono::seconds(60)), 128 + SIGTERM) << run.Stdout() << run.Stderr();

  const std::string out = run.Stdout();
  const int64_t stopped = StoppedCheckpointStep(out);
  ASSERT_GT(stopped, 0) << out << run.Stderr();
  EXPECT_EQ(CheckpointStep(ckpt), stopped);
  // The rank cannot tell this TERM from the one a launcher sends before a
  // restart: its line gives both ways on.
  EXPECT_NE(out.find(" in " + ckpt +
                     " (if a rank failed, the launcher restarts the job from it: restart 1 of 2; "
                     "otherwise continue with --resume)"),
            std::string::npos)
      << out;
  EXPECT_EQ(run.Stderr().find("restarting the job"), std::string::npos) << run.Stderr();
  EXPECT_EQ(out.find("resuming"), std::string::npos) << out;
}

}  // namespace
}  // namespace ddp::examples
