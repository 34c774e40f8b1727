// Checkpoints under failure, on 2 ranks:
// - a run killed (SIGKILL) in the middle and resumed with --resume ends with
//   exactly the parameters of a run that was never interrupted;
// - a rank killed under --max_restarts=1 is restarted with its peer, and
//   the run resumes from its own last checkpoint to the same end; killed
//   again with no restart left, the job ends and rank 0 says to --resume;
// - Ctrl-C (SIGINT to the self-launching parent), or a signal to one rank
//   only, stops every rank at the same step, and the checkpoint on disk is
//   that step's, complete and loadable.
// On 3 ranks, where DDP's sums depend on the bucket layout, a run stopped and
// resumed still ends bit for bit where the uninterrupted one does.

#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "examples/testing/checkpoint_step.h"
#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"
#include "nn/io/checkpoint.h"

namespace ddp::examples {
namespace {

using testing::CheckpointStep;
using testing::RunOutput;
using testing::Runfile;
using testing::Subprocess;
using Clock = std::chrono::steady_clock;

// 3 epochs of 32 steps of the CNN with momentum and a cosine schedule, so
// that optimizer, scheduler, epoch and position in the epoch all matter.
std::vector<std::string> Args(const std::string& checkpoint) {
  return {Runfile("examples/train"), "--dataset=synthetic", "--model=cnn",
          "--train_samples=1024",    "--test_samples=128",  "--batch_size=16",
          "--epochs=3",              "--scheduler=cosine",  "--workers=1",
          "--checkpoint_every=4",    "--checkpoint=" + checkpoint};
}

// Waits until the checkpoint at `path` records at least `step`; -1 when
// the run ends first or two minutes pass.
int64_t WaitForCheckpoint(const std::string& path, int64_t step, Subprocess& p) {
  return testing::WaitForCheckpointStep(
      path, [step](int64_t s) { return s >= step; },
      [&p] { return p.Wait(std::chrono::milliseconds(10)) == -1; }, std::chrono::seconds(120));
}

// Kills the launcher with no warning and waits until its ranks are gone
// too (they die with it, but a moment later): a run started right after
// must not find the last one's rank 0 still holding the checkpoint's claim.
void KillLauncherAndItsRanks(Subprocess& run) {
  const std::vector<pid_t> workers = run.Children();
  ASSERT_EQ(workers.size(), 2u) << run.Stdout() << run.Stderr();
  run.Signal(SIGKILL);
  ASSERT_EQ(run.Wait(std::chrono::seconds(30)), 128 + SIGKILL);
  for (pid_t w : workers) {
    const auto until = Clock::now() + std::chrono::seconds(10);
    while (!testing::ProcessGone(w) && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(testing::ProcessGone(w)) << "rank process " << w << " outlived the launcher";
  }
}

// The step of the last training row in `log_dir`/metrics.csv (a row with a
// training loss; evaluation rows leave it empty), or -1 while there is none.
// With --log_every=1 the trainer (rank 0) appends and flushes one such row
// at the end of every step, before that step's save and the next step's
// stop vote: a cheap per-step mark, where reading a checkpoint loads the
// whole model.
int64_t LastTrainingRow(const std::string& log_dir) {
  int64_t last = -1;
  for (const std::string& line : testing::Lines(testing::ReadFile(log_dir + "/metrics.csv"))) {
    const size_t first = line.find(',');
    const size_t second = line.find(',', first + 1);
    if (line.rfind("step,", 0) == 0 || first == std::string::npos || second == std::string::npos) {
      continue;
    }
    const size_t third = line.find(',', second + 1);
    if (third != std::string::npos && third > second + 1) last = std::stoll(line.substr(0, first));
  }
  return last;
}

// Waits until `log_dir`/metrics.csv has a training row of `step` or later;
// returns the last such row's step, or -1 when the run ended first or
// 120 s passed.
int64_t WaitForLoggedStep(const std::string& log_dir, int64_t step, Subprocess& p) {
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (Clock::now() < deadline) {
    const int64_t s = LastTrainingRow(log_dir);
    if (s >= step) return s;
    if (p.Wait(std::chrono::milliseconds(5)) != -1) return -1;  // ended early
  }
  return -1;
}

void ExpectSameModel(const std::string& a_path, const std::string& b_path) {
  const nn::io::Checkpoint a = nn::io::LoadCheckpoint(a_path);
  const nn::io::Checkpoint b = nn::io::LoadCheckpoint(b_path);
  EXPECT_EQ(a.metadata.at("step"), b.metadata.at("step"));
  ASSERT_EQ(a.model.size(), b.model.size());
  for (size_t i = 0; i < a.model.size(); ++i) {
    const nn::Tensor& x = a.model[i].second;
    const nn::Tensor& y = b.model[i].second;
    ASSERT_EQ(a.model[i].first, b.model[i].first);
    ASSERT_EQ(x.nbytes(), y.nbytes());
    EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0)
        << a.model[i].first << " differs bitwise";
  }
  ASSERT_EQ(a.optimizer.size(), b.optimizer.size());
  for (size_t i = 0; i < a.optimizer.size(); ++i) {
    const nn::Tensor& x = a.optimizer[i].second;
    const nn::Tensor& y = b.optimizer[i].second;
    EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0) << a.optimizer[i].first;
  }
}

// Runs the uninterrupted reference run into `dir`/reference; returns the
// path of its final checkpoint.
std::string RunReference(const std::string& dir, const std::vector<std::string>& flags = {}) {
  const std::string path = dir + "/reference/ckpt.safetensors";
  std::vector<std::string> args = Args(path);
  args.insert(args.end(), flags.begin(), flags.end());
  const RunOutput ref = testing::RunToEnd(args);
  EXPECT_EQ(ref.exit_code, 0) << ref.out << ref.err;
  return path;
}

// Files in `dir` that are not the checkpoint (temporaries of a killed write).
std::vector<std::string> StrayFiles(const std::string& dir, const std::string& keep) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().string() != keep) out.push_back(e.path().string());
  }
  return out;
}

TEST(TrainResumeTest, KilledAndResumedEqualsUninterrupted) {
  const std::string dir = testing::MakeTempDir("resume");
  const std::string reference = dir + "/reference/ckpt.safetensors";
  const std::string resumed = dir + "/resumed/ckpt.safetensors";

  const RunOutput ref = testing::RunToEnd(Args(reference));
  ASSERT_EQ(ref.exit_code, 0) << ref.out << ref.err;
  ASSERT_EQ(CheckpointStep(reference), 96);

  int64_t killed_at = -1;
  {
    Subprocess run(Args(resumed));
    killed_at = WaitForCheckpoint(resumed, 8, run);
    ASSERT_GT(killed_at, 0) << "the run ended before its first checkpoints: " << run.Stdout()
                            << run.Stderr();
    ASSERT_NO_FATAL_FAILURE(KillLauncherAndItsRanks(run));
  }
  const int64_t on_disk = CheckpointStep(resumed);
  ASSERT_GE(on_disk, killed_at);
  ASSERT_LT(on_disk, 96) << "the run was not interrupted in the middle";

  std::vector<std::string> again = Args(resumed);
  again.push_back("--resume");
  const RunOutput res = testing::RunToEnd(again);
  ASSERT_EQ(res.exit_code, 0) << res.out << res.err;
  EXPECT_NE(res.out.find("resumed at epoch " + std::to_string(on_disk / 32 + 1) + ", step " +
                         std::to_string(on_disk)),
            std::string::npos)
      << res.out;
  ExpectSameModel(reference, resumed);
  // Same final evaluation too.
  const std::string ref_result = ref.out.substr(ref.out.find("RESULT"));
  const std::string res_result = res.out.substr(res.out.find("RESULT"));
  EXPECT_EQ(ref_result.substr(0, ref_result.find(" samples_per_s")),
            res_result.substr(0, res_result.find(" samples_per_s")));
  EXPECT_EQ(ref_result.substr(ref_result.find("test_acc"), 15),
            res_result.substr(res_result.find("test_acc"), 15));
}

// On 3 ranks, where the all-reduce's sum depends on where a gradient sits
// in its bucket: a run stopped after 5 of its 20 steps and resumed ends
// with the parameters and optimizer state of the uninterrupted run, bit for
// bit (no schedule: --max_steps would set its horizon). The resumed run's
// DDP starts from the bucket order the checkpoint saved; built in
// registration order instead, its first step summed the gradients in
// another order than the uninterrupted run's sixth, and the momentum
// buffers differed in their last bit.
TEST(TrainResumeTest, StoppedAndResumedOnThreeRanksEqualsUninterrupted) {
  const std::string dir = testing::MakeTempDir("resume3");
  auto args = [](const std::string& checkpoint) {
    return std::vector<std::string>{
        Runfile("examples/train"), "--dataset=synthetic", "--model=cnn", "--train_samples=480",
        "--test_samples=48",       "--batch_size=16",     "--epochs=2",  "--scheduler=none",
        "--workers=1",             "--nproc_per_node=3",  "--checkpoint=" + checkpoint};
  };
  const std::string reference = dir + "/reference/ckpt.safetensors";
  const std::string resumed = dir + "/resumed/ckpt.safetensors";
  const RunOutput ref = testing::RunToEnd(args(reference));
  ASSERT_EQ(ref.exit_code, 0) << ref.out << ref.err;
  ASSERT_EQ(CheckpointStep(reference), 20) << ref.out;

  std::vector<std::string> first = args(resumed);
  first.push_back("--max_steps=5");
  const RunOutput stopped = testing::RunToEnd(first);
  ASSERT_EQ(stopped.exit_code, 0) << stopped.out << stopped.err;
  ASSERT_EQ(CheckpointStep(resumed), 5);

  std::vector<std::string> again = args(resumed);
  again.push_back("--resume");
  const RunOutput res = testing::RunToEnd(again);
  ASSERT_EQ(res.exit_code, 0) << res.out << res.err;
  EXPECT_NE(res.out.find("resumed at epoch 1, step 5"), std::string::npos) << res.out;
  ExpectSameModel(reference, resumed);
}

// The lines in which the trainer says the plateau lowered the rate.
std::vector<std::string> PlateauLines(const std::string& out) {
  std::vector<std::string> lines;
  for (const std::string& line : testing::Lines(out)) {
    if (line.find("plateau: learning rate") != std::string::npos) lines.push_back(line);
  }
  return lines;
}

// --scheduler=plateau: a run stopped by --max_steps at the end of its second
// epoch and resumed lowers the rate at the same epochs, and ends with the
// rate, plateau state and parameters of the uninterrupted run. The
// checkpoint is saved before the epoch's evaluation, whose test loss the
// plateau takes: the resumed run evaluates again and gives it that loss
// (without, the plateau is one metric behind and the state differs).
TEST(TrainResumeTest, PlateauRateAfterResumeEqualsUninterrupted) {
  const std::string dir = testing::MakeTempDir("plateau");
  // 2 ranks, batch 32 of 256 samples: 4 steps per epoch, 20 in all.
  auto args = [](const std::string& checkpoint) {
    return std::vector<std::string>{
        Runfile("examples/train"), "--dataset=synthetic", "--model=mlp",  "--train_samples=256",
        "--test_samples=64",       "--batch_size=32",     "--epochs=5",   "--scheduler=plateau",
        "--lr_patience=0",         "--lr_gamma=0.5",      "--lr=0.5",     "--workers=0",
        "--checkpoint=" + checkpoint};
  };
  const std::string reference = dir + "/reference/ckpt.safetensors";
  const std::string resumed = dir + "/resumed/ckpt.safetensors";
  const RunOutput ref = testing::RunToEnd(args(reference));
  ASSERT_EQ(ref.exit_code, 0) << ref.out << ref.err;
  ASSERT_EQ(CheckpointStep(reference), 20) << ref.out;

  std::vector<std::string> first = args(resumed);
  first.push_back("--max_steps=8");
  const RunOutput stopped = testing::RunToEnd(first);
  ASSERT_EQ(stopped.exit_code, 0) << stopped.out << stopped.err;
  ASSERT_EQ(CheckpointStep(resumed), 8);

  std::vector<std::string> again = args(resumed);
  again.push_back("--resume");
  const RunOutput res = testing::RunToEnd(again);
  ASSERT_EQ(res.exit_code, 0) << res.out << res.err;
  EXPECT_NE(res.out.find("resumed at epoch 3, step 8"), std::string::npos) << res.out;

  // The reductions, at the same epochs and to the same rates.
  const std::vector<std::string> uninterrupted = PlateauLines(ref.out);
  std::vector<std::string> in_parts = PlateauLines(stopped.out);
  const std::vector<std::string> after = PlateauLines(res.out);
  in_parts.insert(in_parts.end(), after.begin(), after.end());
  EXPECT_EQ(in_parts, uninterrupted) << ref.out << "\n---\n" << stopped.out << "\n---\n" << res.out;
  ASSERT_FALSE(after.empty()) << "the rate never dropped after the resume, so the test shows nothing: "
                              << ref.out;
  // The rate itself (the optimizer's "lr", which the plateau set) and the
  // plateau's state, among the whole state compared bit for bit.
  const nn::io::Checkpoint a = nn::io::LoadCheckpoint(reference);
  double rate = 0;
  bool has_plateau = false;
  for (const auto& [name, t] : a.optimizer) {
    if (name == "lr") rate = t.Item();
    has_plateau = has_plateau || name == "plateau.step";
  }
  EXPECT_LT(rate, 0.5);
  EXPECT_TRUE(has_plateau);
  ExpectSameModel(reference, resumed);
}

// With the optimizer state sharded (`flags`: --zero, with or without
// --zero_overlap), training is the unsharded training bit for bit, the
// checkpoints hold the whole state in the same format, and a run killed in
// the middle resumes to the same end. The plan line says `plan_says`.
// `common`: flags of both runs.
void ExpectShardedTrainsAndResumesLikeTheUnsharded(const std::string& name, const std::vector<std::string>& flags,
                                                   const std::string& plan_says,
                                                   const std::vector<std::string>& common = {}) {
  const std::string dir = testing::MakeTempDir(name);
  const std::string reference = RunReference(dir, common);
  const std::string sharded = dir + "/sharded/ckpt.safetensors";

  std::vector<std::string> args = Args(sharded);
  args.insert(args.end(), common.begin(), common.end());
  args.insert(args.end(), flags.begin(), flags.end());
  int64_t killed_at = -1;
  {
    Subprocess run(args);
    killed_at = WaitForCheckpoint(sharded, 8, run);
    ASSERT_GT(killed_at, 0) << "the run ended before its first checkpoints: " << run.Stdout()
                            << run.Stderr();
    ASSERT_NO_FATAL_FAILURE(KillLauncherAndItsRanks(run));
  }
  const int64_t on_disk = CheckpointStep(sharded);
  ASSERT_GE(on_disk, killed_at);
  ASSERT_LT(on_disk, 96) << "the run was not interrupted in the middle";
  args.push_back("--resume");
  const RunOutput res = testing::RunToEnd(args);
  ASSERT_EQ(res.exit_code, 0) << res.out << res.err;
  EXPECT_NE(res.out.find(plan_says), std::string::npos) << res.out;
  ExpectSameModel(reference, sharded);
}

TEST(TrainResumeTest, ShardedOptimizerStateTrainsAndResumesLikeTheUnsharded) {
  ExpectShardedTrainsAndResumesLikeTheUnsharded("resume_zero", {"--zero"}, "optimizer state sharded");
}

// The step inside backward (OverlappedZeroOptimizer) too.
TEST(TrainResumeTest, OverlappedShardedStepTrainsAndResumesLikeTheUnsharded) {
  ExpectShardedTrainsAndResumesLikeTheUnsharded("resume_zero_overlap", {"--zero", "--zero_overlap"},
                                                 "optimizer state sharded, stepped inside backward");
}

// And over two parameter groups (no weight decay on biases and norms),
// which --zero_overlap refused before OverlappedZeroOptimizer took groups.
TEST(TrainResumeTest, OverlappedShardedStepWithDecayGroupsTrainsAndResumesLikeTheUnsharded) {
  ExpectShardedTrainsAndResumesLikeTheUnsharded(
      "resume_zero_overlap_groups", {"--zero", "--zero_overlap"}, "optimizer state sharded, stepped inside backward",
      {"--optimizer=adamw", "--weight_decay=0.05", "--decay_norm_and_bias=false"});
}

// One rank killed in the middle of a run started with --max_restarts=1: the
// launcher restarts both ranks, they continue from the run's last
// checkpoint, and the run ends exactly like one never interrupted.
TEST(TrainResumeTest, KilledRankRestartsAndResumesToTheSameEnd) {
  const std::string dir = testing::MakeTempDir("restart");
  const std::string reference = RunReference(dir);
  const std::string restarted = dir + "/restarted/ckpt.safetensors";

  std::vector<std::string> args = Args(restarted);
  args.push_back("--max_restarts=1");
  Subprocess run(args);
  ASSERT_GT(WaitForCheckpoint(restarted, 8, run), 0)
      << "the run ended before its first checkpoints: " << run.Stdout() << run.Stderr();
  const std::vector<pid_t> workers = run.Children();
  ASSERT_EQ(workers.size(), 2u);
  ASSERT_EQ(kill(workers[1], SIGKILL), 0);
  ASSERT_EQ(run.Wait(std::chrono::seconds(120)), 0) << run.Stdout() << run.Stderr();
  EXPECT_NE(run.Stderr().find("; restarting the workers (restart 1 of 1)"), std::string::npos)
      << run.Stderr();
  EXPECT_NE(run.Stdout().find("restart 1 of the job: resuming from this run's checkpoint " +
                              restarted),
            std::string::npos)
      << run.Stdout();
  EXPECT_NE(run.Stdout().find("resumed at epoch"), std::string::npos) << run.Stdout();
  // Rank 0, stopped by the launcher's TERM, does not send the user to
  // --resume: the launcher, with its one restart left, resumes itself.
  EXPECT_NE(run.Stdout().find(" in " + restarted +
                              " (if a rank failed, the launcher restarts the job from it: restart "
                              "1 of 1; otherwise continue with --resume)"),
            std::string::npos)
      << run.Stdout();
  EXPECT_EQ(run.Stdout().find("(continue with --resume)"), std::string::npos) << run.Stdout();
  ExpectSameModel(reference, restarted);
}

// The same kill once more after the one restart: with none left, the
// launcher ends the job, and rank 0's "stopped by TERM" line sends the user
// to --resume without promising a restart.
TEST(TrainResumeTest, KilledRankWithNoRestartLeftSaysContinueWithResume) {
  const std::string dir = testing::MakeTempDir("restart_spent");
  const std::string ckpt = dir + "/ckpt.safetensors";
  // The MLP for speed; 384 steps leave room for both kills.
  Subprocess run({Runfile("examples/train"), "--dataset=synthetic", "--model=mlp",
                  "--train_samples=2048", "--test_samples=64", "--batch_size=16", "--epochs=3",
                  "--workers=1", "--checkpoint_every=4", "--max_restarts=1",
                  "--checkpoint=" + ckpt});
  ASSERT_GT(WaitForCheckpoint(ckpt, 8, run), 0) << run.Stdout() << run.Stderr();
  const std::vector<pid_t> first = run.Children();
  ASSERT_EQ(first.size(), 2u);
  ASSERT_EQ(kill(first[1], SIGKILL), 0);

  // The restarted ranks: new processes, past their first save of their own.
  const std::string resuming = "restart 1 of the job: resuming";
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (run.Stdout().find(resuming) == std::string::npos && Clock::now() < deadline &&
         run.Wait(std::chrono::milliseconds(0)) == -1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_NE(run.Stdout().find(resuming), std::string::npos) << run.Stdout() << run.Stderr();
  // Past the restarted run's second save: rank 0 counts a save as made only
  // once every rank has heard it succeeded, which is after the file is in
  // place, so a kill as soon as the first save's file appears could leave
  // rank 0 with no save of its own to name. The second save starts after
  // the first one's exchange ended.
  ASSERT_GT(WaitForCheckpoint(ckpt, CheckpointStep(ckpt) + 5, run), 0)
      << run.Stdout() << run.Stderr();
  const std::vector<pid_t> second = run.Children();
  ASSERT_EQ(second.size(), 2u);
  ASSERT_TRUE(std::find(first.begin(), first.end(), second[1]) == first.end());
  ASSERT_EQ(kill(second[1], SIGKILL), 0);

  EXPECT_NE(run.Wait(std::chrono::seconds(120)), 0) << run.Stdout() << run.Stderr();
  EXPECT_EQ(run.Stderr().find("restart 2 of 1"), std::string::npos) << run.Stderr();
  const std::string after = run.Stdout().substr(run.Stdout().find(resuming));
  EXPECT_NE(after.find(" in " + ckpt + " (continue with --resume)"), std::string::npos) << after;
  EXPECT_EQ(after.find("the launcher restarts"), std::string::npos) << after;
}

TEST(TrainResumeTest, CtrlCStopsEveryRankAndLeavesAValidCheckpoint) {
  const std::string dir = testing::MakeTempDir("sigint");
  const std::string ckpt = dir + "/ckpt.safetensors";
  Subprocess run(Args(ckpt));
  ASSERT_GT(WaitForCheckpoint(ckpt, 4, run), 0) << run.Stdout() << run.Stderr();
  const std::vector<pid_t> workers = run.Children();
  ASSERT_EQ(workers.size(), 2u);

  const auto t0 = Clock::now();
  run.Signal(SIGINT);
  const int code = run.Wait(std::chrono::seconds(20));
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(code, 128 + SIGINT) << run.Stdout() << run.Stderr();
  EXPECT_LT(took, 10.0) << "Ctrl-C took " << took << " s to stop the ranks";
  for (pid_t w : workers) EXPECT_TRUE(testing::ProcessGone(w)) << "rank process " << w;

  // Rank 0 saved its last complete step: loadable, and nothing else left.
  const int64_t step = CheckpointStep(ckpt);
  EXPECT_GT(step, 0);
  EXPECT_LT(step, 96);
  EXPECT_TRUE(StrayFiles(dir, ckpt).empty()) << StrayFiles(dir, ckpt)[0];
  EXPECT_NE(run.Stdout().find("stopped by Ctrl-C at epoch "), std::string::npos)
      << run.Stdout() << run.Stderr();
  EXPECT_NE(run.Stdout().find("; checkpoint of step " + std::to_string(step) + " in " + ckpt +
                             " (continue with --resume)"),
            std::string::npos)
      << run.Stdout() << run.Stderr();
}

// Slow steps (ResNet-18 on the CPU, seconds each): a stop vote one
// step behind would make the ranks train a whole further step after
// Ctrl-C, and with the save that can outlast a launcher's grace (ddprun's
// is 30 s unless --grace_period says otherwise) before its SIGKILL. Past 0.25 s per step every vote is finished
// at once, so the ranks stop at the end of the step the signal came in.
TEST(TrainResumeTest, CtrlCWithSlowStepsStopsAtTheEndOfTheStepItCameIn) {
  const std::string dir = testing::MakeTempDir("sigint_slow");
  const std::string ckpt = dir + "/ckpt.safetensors";
  // Batches of 32: steps well over the 0.25 s (and over the test's own
  // latency in signalling), also on a fast host: 1.2 s of CPU per rank and
  // step on a 2-core EPYC. Batches of 128 (4.6 s each) were more than
  // the 120 s below allows for three steps on a loaded host: two such
  // runs beside two busy loops never got past step 1 (4 runs of 4 failed).
  // Without scheduled saves the checkpoint on disk is the stop's alone.
  // (It was a save every step, each a whole ResNet-18, found by loading
  // the checkpoint every 2 ms: both took the CPUs the ranks train on,
  // 135 s for this test under load 12.)
  // The mark of a step's start is rank 0's --trace, streamed into a FIFO:
  // DDP appends the events recorded so far at the start of each forward,
  // after that step's stop vote, so the trace holds step k's "forward"
  // event once step k + 1 has voted and begun.
  const std::string log_dir = dir + "/log";
  std::filesystem::create_directory(log_dir);
  const std::string trace = log_dir + "/trace_rank0.json";
  ASSERT_EQ(::mkfifo(trace.c_str(), 0600), 0) << trace << ": " << std::strerror(errno);
  testing::FifoReader reader(trace, std::chrono::seconds(280));
  Subprocess run({Runfile("examples/train"), "--dataset=synthetic", "--model=resnet18", "--train_samples=4096",
                  "--test_samples=64", "--batch_size=32", "--epochs=1", "--workers=1", "--trace",
                  "--log_dir=" + log_dir, "--checkpoint=" + ckpt});
  const auto forwards = [&reader] {
    const std::string text = reader.Text();
    int64_t n = 0;
    for (size_t at = text.find("\"name\": \"forward\""); at != std::string::npos;
         at = text.find("\"name\": \"forward\"", at + 1)) {
      ++n;
    }
    return n;
  };
  // From the third step's on, the votes are finished at once (rank 0's
  // `slow`, taken at the second step's vote, counts once that vote has
  // finished, at the third's): a signal in the third step is acted on at
  // its end, where a vote one step behind would stop at the fourth.
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  int64_t traced = forwards();
  while (traced < 2 && Clock::now() < deadline && run.Wait(std::chrono::milliseconds(2)) == -1) {
    traced = forwards();
  }
  ASSERT_GE(traced, 2) << "no trace of the second step's forward within 120 s: " << run.Stdout() << run.Stderr();
  // Inside step `traced` + 1, after its vote.
  run.Signal(SIGINT);
  EXPECT_EQ(run.Wait(std::chrono::seconds(60)), 128 + SIGINT) << run.Stdout() << run.Stderr();
  EXPECT_EQ(CheckpointStep(ckpt), traced + 1) << run.Stdout() << run.Stderr();
  reader.Finish();
}

// A fresh run at another run's checkpoint path (the default path, without
// --resume), stopped before its first save: that checkpoint is left as it
// was, not replaced by a few steps of the new run.
TEST(TrainResumeTest, CtrlCBeforeAFreshRunsFirstSaveKeepsAnotherRunsCheckpoint) {
  const std::string dir = testing::MakeTempDir("sigint_keep");
  const std::string ckpt = dir + "/ckpt.safetensors";
  const std::vector<std::string> args = {Runfile("examples/train"), "--dataset=synthetic", "--model=resnet18",
                                         "--train_samples=2048",    "--test_samples=64",   "--batch_size=32",
                                         "--epochs=1",              "--workers=1",         "--checkpoint=" + ckpt};
  std::vector<std::string> first = args;
  first.push_back("--max_steps=1");
  const RunOutput saved = testing::RunToEnd(first);
  ASSERT_EQ(saved.exit_code, 0) << saved.out << saved.err;
  ASSERT_EQ(CheckpointStep(ckpt), 1);
  const std::string before = testing::ReadFile(ckpt);

  // Its metrics rows (one per step) say when it trains: signalled after
  // the first step, far from the epoch's end (step 32) and its save.
  const std::string log_dir = dir + "/log";
  std::vector<std::string> logged = args;
  logged.push_back("--log_dir=" + log_dir);
  logged.push_back("--log_every=1");
  Subprocess run(logged);
  ASSERT_GT(WaitForLoggedStep(log_dir, 1, run), 0) << run.Stdout() << run.Stderr();
  run.Signal(SIGINT);
  EXPECT_EQ(run.Wait(std::chrono::seconds(60)), 128 + SIGINT) << run.Stdout() << run.Stderr();
  EXPECT_NE(run.Stdout().find("the checkpoint at " + ckpt +
                              ", another run's, was left as it was (this run had saved nothing yet)"),
            std::string::npos)
      << run.Stdout() << run.Stderr();
  EXPECT_TRUE(testing::ReadFile(ckpt) == before) << "the other run's checkpoint was replaced";
}

// Ctrl-C between two metrics rows (--log_every=1000, a checkpoint every 7
// steps): the losses of the steps since the last row still count. The
// checkpoint's epoch loss covers every micro-batch of the epoch so far, and
// metrics.csv ends with a row at the step the ranks stopped at. (Before, the
// stop saved without gathering them: up to log_every - 1 steps of losses
// were missing from both.)
TEST(TrainResumeTest, CtrlCBetweenLogRowsKeepsTheLossesOfEveryStep) {
  const std::string dir = testing::MakeTempDir("sigint_metrics");
  const std::string ckpt = dir + "/ckpt.safetensors";
  const std::string log_dir = dir + "/log";
  std::vector<std::string> args = Args(ckpt);
  *std::find(args.begin(), args.end(), "--checkpoint_every=4") = "--checkpoint_every=7";
  args.push_back("--log_every=1000");
  args.push_back("--log_dir=" + log_dir);
  Subprocess run(args);
  // Signalled just after the save of step 7: the ranks stop there or
  // later, between two rows.
  ASSERT_GT(WaitForCheckpoint(ckpt, 7, run), 0) << run.Stdout() << run.Stderr();
  run.Signal(SIGINT);
  EXPECT_EQ(run.Wait(std::chrono::seconds(40)), 128 + SIGINT) << run.Stdout() << run.Stderr();

  const nn::io::Checkpoint checkpoint = nn::io::LoadCheckpoint(ckpt);
  const int64_t step = std::stoll(checkpoint.metadata.at("step"));
  const int64_t batch_in_epoch = std::stoll(checkpoint.metadata.at("batch_in_epoch"));
  // Step 7 itself when the signal came before step 8 ended (the save was
  // seen at once): the stop then keeps the save of step 7.
  ASSERT_GE(step, 7);
  ASSERT_LT(step, 96) << "the run was not interrupted in the middle";
  // One loss per sample of every rank's batches of the epoch (2 ranks,
  // full batches of 16, no accumulation).
  EXPECT_EQ(std::stoll(checkpoint.metadata.at("epoch_loss_count")), 2 * 16 * batch_in_epoch)
      << "stopped at step " << step;
  EXPECT_EQ(LastTrainingRow(log_dir), step) << testing::ReadFile(log_dir + "/metrics.csv");
}

// With --zero the ranks, which stop at the same step, gather the sharded
// state there: the checkpoint holds the whole state at the stop, and an
// unsharded run resumes from it to the end of an uninterrupted run.
TEST(TrainResumeTest, CtrlCWithShardedStateSavesTheWholeStateWhereTheRanksStopped) {
  const std::string dir = testing::MakeTempDir("sigint_zero");
  const std::string reference = RunReference(dir);
  const std::string ckpt = dir + "/ckpt.safetensors";
  std::vector<std::string> args = Args(ckpt);
  args.push_back("--zero");
  Subprocess run(args);
  ASSERT_GT(WaitForCheckpoint(ckpt, 4, run), 0) << run.Stdout() << run.Stderr();
  run.Signal(SIGINT);
  EXPECT_EQ(run.Wait(std::chrono::seconds(40)), 128 + SIGINT) << run.Stdout() << run.Stderr();
  const int64_t step = CheckpointStep(ckpt);
  EXPECT_GT(step, 0);
  EXPECT_LT(step, 96);
  EXPECT_TRUE(StrayFiles(dir, ckpt).size() == 1) << "besides reference/";
  EXPECT_NE(run.Stdout().find("step " + std::to_string(step) + "; checkpoint of step " +
                              std::to_string(step) + " in " + ckpt),
            std::string::npos)
      << run.Stdout() << run.Stderr();

  std::vector<std::string> plain = Args(ckpt);
  plain.push_back("--resume");
  const RunOutput res = testing::RunToEnd(plain);
  ASSERT_EQ(res.exit_code, 0) << res.out << res.err;
  EXPECT_NE(res.out.find("resumed at epoch"), std::string::npos) << res.out;
  ExpectSameModel(reference, ckpt);
}

// A signal that reaches one rank only (srun and mpirun deliver it to each
// rank separately, and a batch system may signal one process): the ranks
// still stop at the same step, rank 0 saves that step, and the run resumes
// from it to exactly the end of an uninterrupted run.
TEST(TrainResumeTest, SignalToOneRankStopsEveryRankAtTheSameStep) {
  const std::string dir = testing::MakeTempDir("sigterm_one");
  const std::string reference = RunReference(dir);
  const std::string ckpt = dir + "/ckpt.safetensors";
  // Without scheduled checkpoints: the one on disk is the stop's.
  std::vector<std::string> args = Args(ckpt);
  args.erase(std::find(args.begin(), args.end(), "--checkpoint_every=4"));
  Subprocess run(args);
  // The end of the first epoch saves one.
  ASSERT_EQ(WaitForCheckpoint(ckpt, 32, run), 32) << run.Stdout() << run.Stderr();
  const std::vector<pid_t> workers = run.Children();
  ASSERT_EQ(workers.size(), 2u) << run.Stdout() << run.Stderr();
  ASSERT_EQ(kill(workers[1], SIGTERM), 0);
  run.Wait(std::chrono::seconds(60));
  for (pid_t w : workers) EXPECT_TRUE(testing::ProcessGone(w)) << "rank process " << w;

  const int64_t step = CheckpointStep(ckpt);
  ASSERT_GT(step, 0) << run.Stdout() << run.Stderr();
  ASSERT_LT(step, 96) << "the run was not interrupted in the middle";
  // Rank 0, which got no signal, reports rank 1's and saved the common step.
  EXPECT_NE(run.Stdout().find("stopped by TERM at epoch " + std::to_string(step / 32 + 1) +
                              ", step " + std::to_string(step) + "; checkpoint of step " +
                              std::to_string(step)),
            std::string::npos)
      << run.Stdout() << run.Stderr();

  args.push_back("--resume");
  const RunOutput res = testing::RunToEnd(args);
  ASSERT_EQ(res.exit_code, 0) << res.out << res.err;
  ExpectSameModel(reference, ckpt);
}

// Waits until process `pid` has taken pending `signo` (its shared pending
// set, /proc/<pid>/status ShdPnd, no longer has it), so that the same
// signal sent next is a second delivery rather than merged with the first.
// A process that has ended (no ShdPnd line: gone, or exiting) counts as
// having taken it: nothing is left for the next one to merge with. False
// only when the signal is still pending after 10 s.
bool WaitUntilTaken(pid_t pid, int signo) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    std::string pending;
    for (const std::string& line :
         testing::Lines(testing::ReadFile("/proc/" + std::to_string(pid) + "/status"))) {
      if (line.rfind("ShdPnd:", 0) == 0) pending = line.substr(7);
    }
    if (pending.empty()) return true;  // ended
    if ((std::stoull(pending, nullptr, 16) & (1ull << (signo - 1))) == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

// SLURM's scancel and systemd's stop send SIGTERM to every process of the
// job, and the launcher forwards the one it gets: each rank has it twice
// within milliseconds, here three times (once more straight from another
// process). That is one request to stop, not a second one that ends the
// rank at once: rank 0 saves the step the ranks stopped at, and the run
// ends with 128 + SIGTERM. (Each repeat used to kill its rank unsaved.)
TEST(TrainResumeTest, SigtermToEveryProcessTwiceAtOnceStillSaves) {
  const std::string ckpt = testing::MakeTempDir("sigterm_twice") + "/ckpt.safetensors";
  std::vector<std::string> args = Args(ckpt);
  args.erase(std::find(args.begin(), args.end(), "--checkpoint_every=4"));
  Subprocess run(args);
  // The end of the first epoch saves one; the stop's comes later.
  ASSERT_EQ(WaitForCheckpoint(ckpt, 32, run), 32) << run.Stdout() << run.Stderr();
  const std::vector<pid_t> workers = run.Children();
  ASSERT_EQ(workers.size(), 2u) << run.Stdout() << run.Stderr();
  // The first signal goes to every rank before the test waits on any: a
  // rank's first SIGTERM stops the whole run within a few steps (a few
  // milliseconds here), and signalled one at a time, the second rank could
  // have stopped with the first and ended, even been reaped, before its
  // own first signal was sent (the test was seen failing that way, 1 run
  // in 15 on a loaded host). A rank gone that soon had stopped the way the
  // run should; the exit status and the checkpoint below still decide.
  for (pid_t w : workers) {
    ASSERT_TRUE(kill(w, SIGTERM) == 0 || errno == ESRCH) << "rank process " << w << ": "
                                                        << std::strerror(errno);
  }
  for (pid_t w : workers) ASSERT_TRUE(WaitUntilTaken(w, SIGTERM)) << "rank process " << w;
  run.Signal(SIGTERM);
  for (pid_t w : workers) kill(w, SIGTERM);
  EXPECT_EQ(run.Wait(std::chrono::seconds(60)), 128 + SIGTERM) << run.Stdout() << run.Stderr();

  // Step 32 itself is a stop step too: the signals can come before step 33
  // ends (the ranks were quick to be found), and the line below then names
  // the checkpoint of step 32 as the stop's.
  const int64_t step = CheckpointStep(ckpt);
  ASSERT_GE(step, 32) << "no checkpoint of the stop: " << run.Stdout() << run.Stderr();
  ASSERT_LT(step, 96) << "the run was not interrupted in the middle";
  EXPECT_NE(run.Stdout().find("stopped by TERM at epoch " + std::to_string(step / 32 + 1) + ", step " +
                              std::to_string(step) + "; checkpoint of step " + std::to_string(step)),
            std::string::npos)
      << run.Stdout() << run.Stderr();
}

// The elastic case: a run on 2 ranks stops in the middle of its last
// epoch (step 5 of 16: 160 of its 512 samples trained) and is resumed on 1
// rank. That rank trains the other 352 samples, 22 steps of 16, and the
// run ends at step 27 with the epoch done; it used to skip to "epoch 2",
// train nothing, and still report the epoch done.
TEST(TrainResumeTest, MidEpochCheckpointResumedOnOneRankTrainsTheRestOfTheEpoch) {
  const std::string ckpt = testing::MakeTempDir("other_ranks") + "/ckpt.safetensors";
  const std::vector<std::string> args = {
      Runfile("examples/train"), "--dataset=synthetic", "--model=cnn", "--train_samples=512",
      "--test_samples=64",       "--batch_size=16",     "--epochs=1",  "--scheduler=none",
      "--workers=1",             "--checkpoint=" + ckpt};
  std::vector<std::string> first = args;
  first.push_back("--nproc_per_node=2");
  first.push_back("--max_steps=5");
  const RunOutput stopped = testing::RunToEnd(first);
  ASSERT_EQ(stopped.exit_code, 0) << stopped.out << stopped.err;
  ASSERT_EQ(CheckpointStep(ckpt), 5);

  std::vector<std::string> second = args;
  second.push_back("--nproc_per_node=1");
  second.push_back("--resume");
  const RunOutput resumed = testing::RunToEnd(second);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  EXPECT_NE(resumed.out.find("by a run on 2 ranks, batch 16, after 160 samples of the epoch's "
                             "order; this run trains the rest of that epoch"),
            std::string::npos)
      << resumed.out;
  EXPECT_NE(resumed.out.find("resumed at epoch 1, step 5 (10 of the epoch's 32 steps done)"),
            std::string::npos)
      << resumed.out;
  EXPECT_EQ(CheckpointStep(ckpt), 5 + 22) << resumed.out;
  EXPECT_NE(resumed.out.find("RESULT model=cnn ranks=1 epochs=1 "), std::string::npos)
      << resumed.out;
}

// Saved mid-epoch and resumed with another --seed, the epoch is abandoned
// (its order is another one) and the run continues at the next epoch's
// start. That start is no epoch end: no test pass is made for it and the
// chart marks no end of epoch 1. (Before, the resume evaluated as at an
// epoch end, where no log said it was done, and the chart drew the mark.)
TEST(TrainResumeTest, AnAbandonedEpochIsNeitherEvaluatedNorMarkedAsEnded) {
  const std::string dir = testing::MakeTempDir("abandoned_epoch");
  const std::string ckpt = dir + "/ckpt.safetensors";
  const std::string copy = dir + "/copy.safetensors";
  const std::vector<std::string> args = {
      Runfile("examples/train"), "--dataset=synthetic", "--model=mlp",  "--train_samples=256",
      "--test_samples=64",       "--batch_size=16",     "--epochs=2",   "--scheduler=none",
      "--workers=0",             "--nproc_per_node=1"};
  std::vector<std::string> first = args;
  first.push_back("--checkpoint=" + ckpt);
  first.push_back("--log_dir=" + dir + "/logs");
  first.push_back("--log_every=1");
  first.push_back("--max_steps=5");
  const RunOutput stopped = testing::RunToEnd(first);
  ASSERT_EQ(stopped.exit_code, 0) << stopped.out << stopped.err;
  ASSERT_EQ(CheckpointStep(ckpt), 5);
  std::filesystem::copy_file(ckpt, copy);

  // With the log of the run before.
  std::vector<std::string> logged = args;
  logged.push_back("--checkpoint=" + ckpt);
  logged.push_back("--log_dir=" + dir + "/logs");
  logged.push_back("--log_every=1");
  logged.push_back("--resume");
  logged.push_back("--seed=1");
  const RunOutput resumed = testing::RunToEnd(logged);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  EXPECT_NE(resumed.out.find("continuing with epoch 2; epoch 1 does not count as done"),
            std::string::npos)
      << resumed.out;
  EXPECT_EQ(resumed.out.find("evaluated at step 5 "), std::string::npos) << resumed.out;
  const std::string chart = testing::ReadFile(dir + "/logs/chart.svg");
  EXPECT_EQ(chart.find(">epoch 1<"), std::string::npos) << "epoch 1 never ended";
  EXPECT_NE(chart.find(">epoch 2<"), std::string::npos) << chart;

  // Without a log, nothing could tell whether a due evaluation was made;
  // none was due.
  std::vector<std::string> unlogged = args;
  unlogged.push_back("--checkpoint=" + copy);
  unlogged.push_back("--resume");
  unlogged.push_back("--seed=1");
  const RunOutput bare = testing::RunToEnd(unlogged);
  ASSERT_EQ(bare.exit_code, 0) << bare.out << bare.err;
  EXPECT_EQ(bare.out.find("evaluated at step 5 "), std::string::npos) << bare.out;
  EXPECT_EQ(CheckpointStep(copy), 5 + 16) << bare.out;
}

// A --zero resume whose optimizer state has an entry of the wrong length
// for a parameter of rank 1's shard (the model's last, at the end of the
// flat partition): rank 1 refuses its shard, and its own line names the
// entry. Before, every rank's refusal of a resume was taken for rank 0's:
// rank 1 said only that it stopped with rank 0, and rank 0 that the load
// failed on rank 1, so that no rank's output named the entry.
TEST(TrainResumeTest, ShardedResumeRefusedOnRankOneSaysWhyOnRankOne) {
  const std::string dir = testing::MakeTempDir("zero_refused");
  const std::string ckpt = dir + "/ckpt.safetensors";
  std::vector<std::string> args = {Runfile("examples/train"), "--dataset=synthetic", "--model=mlp",
                                   "--train_samples=128",      "--test_samples=32",   "--batch_size=16",
                                   "--epochs=1",               "--workers=1",         "--nproc_per_node=2",
                                   "--optimizer=adamw",        "--zero",              "--checkpoint=" + ckpt};
  const RunOutput saved = testing::RunToEnd(args);
  ASSERT_EQ(saved.exit_code, 0) << saved.out << saved.err;
  nn::io::Checkpoint c = nn::io::LoadCheckpoint(ckpt);
  // The last parameter with optimizer state, and one of its per-element
  // entries, made one element short.
  std::string entry;
  for (auto m = c.model.rbegin(); m != c.model.rend() && entry.empty(); ++m) {
    for (auto& [key, t] : c.optimizer) {
      if (key.rfind("state." + m->first + ".", 0) != 0 || t.numel() != m->second.numel() || t.numel() < 2) continue;
      entry = key;
      t = nn::Zeros({t.numel() - 1}, {.dtype = t.dtype()});
      break;
    }
  }
  ASSERT_FALSE(entry.empty()) << "no per-element optimizer state in " << ckpt;
  nn::io::SaveCheckpoint(ckpt, c);
  args.push_back("--resume");
  const RunOutput res = testing::RunToEnd(args);
  EXPECT_EQ(res.exit_code, 2) << res.out << res.err;
  // Rank 1's own line (not the launcher's summary) names the entry.
  bool named = false;
  size_t begin = 0;
  while (!named && begin < res.err.size()) {
    size_t end = res.err.find('\n', begin);
    if (end == std::string::npos) end = res.err.size();
    const std::string line = res.err.substr(begin, end - begin);
    named = line.find("rank 1: ") != std::string::npos && line.find("`" + entry + "`") != std::string::npos;
    begin = end + 1;
  }
  EXPECT_TRUE(named) << "no line of rank 1 names `" << entry << "`:\n" << res.err;
}

}  // namespace
}  // namespace ddp::examples
