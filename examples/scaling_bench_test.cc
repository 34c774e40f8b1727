// //examples:scaling_bench runs its jobs and prints its table (a functional
// check with tiny runs; the figures themselves are taken on a quiet machine,
// see docs/benchmarks.md), and checks its --chart path before the runs.

#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <regex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "examples/scaling_median.h"
#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"

namespace ddp::examples {
namespace {

// The benchmark's first workers (the launcher's children), once there are
// some; none when 60 s pass first or the benchmark ends before (a failure).
std::vector<pid_t> FirstWorkersWithin60s(testing::Subprocess& run) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::vector<pid_t> workers;
  while (workers.empty() && std::chrono::steady_clock::now() < deadline) {
    if (run.Wait(std::chrono::milliseconds(0)) != -1) {
      ADD_FAILURE() << "the benchmark ended before it started a worker\n" << run.Stdout() << run.Stderr();
      return {};
    }
    workers = run.Children();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return workers;
}

// The counts given largest first: they are measured from the smallest,
// whose rate is the baseline of every speed-up (before, the 2-rank row came
// first as its own baseline, 2.00x, and the 1-rank row replaced it). A
// relative --chart is the user's (under `bazel run`, from
// $BUILD_WORKING_DIRECTORY), not the runfiles folder's.
// --help printed the flags of every linked library, gflags' own among them,
// and exited 1.
TEST(ScalingBenchTest, HelpListsItsOwnFlags) {
  const testing::RunOutput r = testing::RunToEnd({testing::Runfile("examples/scaling_bench"), "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("-ranks ("), std::string::npos) << all;
  EXPECT_EQ(all.find("tab_completion"), std::string::npos) << all;
}

TEST(ScalingBenchTest, PrintsOneRowPerRankCountFromTheSmallestAndTheChart) {
  const std::string dir = testing::MakeTempDir("scaling");
  const testing::RunOutput r = testing::RunToEnd(
      {testing::Runfile("examples/scaling_bench"), "--model=mlp", "--ranks=2,1", "--steps=3",
       "--batch_size=16", "--workers=0", "--chart=charts/../scaling.svg"},
      // A communication thread, so that the overlap column is a percentage
      // on any number of cores (see the next test for the other case).
      {{"BUILD_WORKING_DIRECTORY", dir}, {"DDP_COLLECTIVE_THREAD", "comm"}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> lines = testing::Lines(r.out);
  ASSERT_EQ(lines.size(), 5u) << r.out;
  EXPECT_EQ(lines[0].rfind("# scaling_bench: mlp on synthetic, batch 16 per rank, 3 timed steps", 0),
            0u)
      << lines[0];
  // The other flags that change the figures are in the header too.
  EXPECT_NE(lines[0].find(", buckets of 25 MiB, 0 loader threads per rank; "), std::string::npos) << lines[0];
  EXPECT_EQ(lines[1], "ranks   samples/s speed-up efficiency       comm  overlap  step_ms");
  EXPECT_TRUE(std::regex_match(lines[2], std::regex(R"( +1 +[0-9,]+ +1\.00x +100% +- +- +[0-9.]+)")))
      << lines[2];
  EXPECT_TRUE(std::regex_match(
      lines[3], std::regex(R"( +2 +[0-9,]+ +[0-9.]+x +\d+% +\d+% +\d+% +[0-9.]+)")))
      << lines[3];
  EXPECT_EQ(lines[4], "# chart: " + dir + "/scaling.svg");
  const std::string svg = testing::ReadFile(dir + "/scaling.svg");
  EXPECT_NE(svg.find("scaling efficiency"), std::string::npos);
}

// With the collectives on the training thread (DDP_COLLECTIVE_THREAD=caller;
// kAuto picks it on few cores) backward hides none of them: the overlap
// column says "caller" (before, it read 0%, as if overlap had failed), and
// the header says what that means.
TEST(ScalingBenchTest, OverlapReadsCallerWhenCollectivesRunOnTheTrainingThread) {
  const testing::RunOutput r = testing::RunToEnd(
      {testing::Runfile("examples/scaling_bench"), "--model=mlp", "--ranks=2", "--steps=3",
       "--batch_size=16", "--workers=0"},
      {{"DDP_COLLECTIVE_THREAD", "caller"}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> lines = testing::Lines(r.out);
  ASSERT_EQ(lines.size(), 3u) << r.out;
  EXPECT_NE(lines[0].find("; overlap \"caller\": collectives ran on the training thread, so none "
                          "of them hid behind backward"),
            std::string::npos)
      << lines[0];
  EXPECT_TRUE(std::regex_match(
      lines[2], std::regex(R"( +2 +[0-9,]+ +[0-9.]+x +\d+% +\d+% +caller +[0-9.]+)")))
      << lines[2];
}

// A misspelt flag got gflags' "ERROR: unknown command line flag 'rank'"
// and exit status 1.
TEST(ScalingBenchTest, AMisspeltFlagIsOneLineWithTheNearestFlag) {
  const testing::RunOutput r =
      testing::RunToEnd({testing::Runfile("examples/scaling_bench"), "--model=mlp", "--rank=1"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err, "scaling_bench: unknown flag --rank; did you mean --ranks? (--help lists the flags)\n");
  EXPECT_EQ(r.out, "");
}

// A chart that could not be written is found out before the runs, not
// after them (before, the benchmark ran to the end and then died in
// std::terminate).
TEST(ScalingBenchTest, AChartPathThatCannotBeWrittenIsRefusedBeforeAnyRun) {
  const std::string dir = testing::MakeTempDir("scaling_bad_chart");
  const std::string bench = testing::Runfile("examples/scaling_bench");
  const testing::RunOutput missing = testing::RunToEnd(
      {bench, "--model=mlp", "--ranks=1", "--steps=1", "--chart=" + dir + "/no/such/s.svg"});
  EXPECT_EQ(missing.exit_code, 2) << missing.out << missing.err;
  EXPECT_EQ(missing.err, "scaling_bench: --chart=" + dir + "/no/such/s.svg: the folder " + dir +
                             "/no/such does not exist\n");
  EXPECT_EQ(missing.out, "");
  const testing::RunOutput folder =
      testing::RunToEnd({bench, "--model=mlp", "--ranks=1", "--steps=1", "--chart=" + dir});
  EXPECT_EQ(folder.exit_code, 2) << folder.out << folder.err;
  EXPECT_EQ(folder.err, "scaling_bench: --chart=" + dir + " is a folder; give the path of an .svg file\n");
  EXPECT_EQ(folder.out, "");
  // A FIFO was found only after every run, by the chart's atomic write.
  const std::string fifo = dir + "/fifo.svg";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const testing::RunOutput special =
      testing::RunToEnd({bench, "--model=mlp", "--ranks=1", "--steps=1", "--chart=" + fifo});
  EXPECT_EQ(special.exit_code, 2) << special.out << special.err;
  EXPECT_EQ(special.err, "scaling_bench: --chart=" + fifo + " is a FIFO, not a regular file, and the chart "
                         "would replace it; give the path of an .svg file\n");
  EXPECT_EQ(special.out, "");
}

// The chart's folder vanishes while the runs go on: the write fails at the
// end, and the benchmark says so with the table already printed (exit 1).
TEST(ScalingBenchTest, AChartThatFailsToWriteAtTheEndIsReported) {
  const std::string dir = testing::MakeTempDir("scaling_vanishing_chart") + "/charts";
  std::filesystem::create_directories(dir);
  testing::Subprocess run({testing::Runfile("examples/scaling_bench"), "--model=mlp", "--ranks=1",
                           "--steps=200", "--batch_size=16", "--workers=0",
                           "--chart=" + dir + "/s.svg"});
  // The header is printed after the checks and before the first run.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (run.Stdout().find("ranks   samples/s") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    ASSERT_EQ(run.Wait(std::chrono::milliseconds(0)), -1) << run.Stdout() << run.Stderr();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::filesystem::remove_all(dir);
  EXPECT_EQ(run.Wait(std::chrono::seconds(120)), 1) << run.Stdout() << run.Stderr();
  const std::vector<std::string> lines = testing::Lines(run.Stdout());
  ASSERT_EQ(lines.size(), 3u) << run.Stdout();
  EXPECT_TRUE(std::regex_match(lines[2], std::regex(R"( +1 +[0-9,]+ +1\.00x +100% .*)"))) << lines[2];
  EXPECT_EQ(run.Stderr().rfind("scaling_bench: cannot write --chart=" + dir + "/s.svg: ", 0), 0u)
      << run.Stderr();
}

// One of three runs is killed: the row is the median of the two that
// finished and says that one failed; the exit status is 1. (Before, the
// failed run was sorted last and counted: the faster success was shown, as
// if it were the median, and nothing said a run had failed.)
TEST(ScalingBenchTest, TheMedianIsOverTheRunsThatFinishedAndFailedRunsAreCounted) {
  testing::Subprocess run({testing::Runfile("examples/scaling_bench"), "--model=mlp", "--ranks=1",
                           "--repeat=3", "--steps=300", "--batch_size=16", "--workers=0"});
  const std::vector<pid_t> workers = FirstWorkersWithin60s(run);
  ASSERT_EQ(workers.size(), 1u) << run.Stdout() << run.Stderr();
  ASSERT_EQ(kill(workers[0], SIGKILL), 0);
  EXPECT_EQ(run.Wait(std::chrono::seconds(120)), 1) << run.Stdout() << run.Stderr();
  const std::vector<std::string> lines = testing::Lines(run.Stdout());
  ASSERT_EQ(lines.size(), 3u) << run.Stdout();
  EXPECT_TRUE(std::regex_match(
      lines[2], std::regex(R"( +1 +[0-9,]+ +1\.00x +100% +- +- +[0-9.]+  \(median of 2; 1 of 3 runs failed\))")))
      << lines[2];
  EXPECT_NE(run.Stderr().find("scaling_bench: the 1-rank run failed"), std::string::npos)
      << run.Stderr();
}

// A hang-up (the terminal gone) or SIGQUIT (Ctrl-\) reaches the workers through the
// launcher, as Ctrl-C does, and stops the benchmark with 128 + the signal
// (before, only SIGINT and SIGTERM did: the run counted as failed and the
// next one started).
// Its runs' result files are in $TMPDIR (they were always in /tmp), and
// gone after the stop.
TEST(ScalingBenchTest, AHangUpStopsTheBenchmarkLikeCtrlC) {
  const std::string tmpdir = testing::MakeTempDir("scaling_tmpdir");
  testing::Subprocess run({testing::Runfile("examples/scaling_bench"), "--model=mlp", "--ranks=1",
                           "--repeat=3", "--steps=1000000", "--batch_size=16", "--workers=0"},
                          {{"TMPDIR", tmpdir}});
  const std::vector<pid_t> workers = FirstWorkersWithin60s(run);
  ASSERT_EQ(workers.size(), 1u) << run.Stdout() << run.Stderr();
  // (the workers may keep files of their own there too)
  auto results_folders = [&tmpdir] {
    int found = 0;
    for (const auto& entry : std::filesystem::directory_iterator(tmpdir)) {
      found += entry.path().filename().string().rfind("scaling_bench.", 0) == 0;
    }
    return found;
  };
  EXPECT_EQ(results_folders(), 1);
  run.Signal(SIGHUP);
  // A million steps per run: only a stop ends it within the minute.
  EXPECT_EQ(run.Wait(std::chrono::seconds(60)), 128 + SIGHUP) << run.Stdout() << run.Stderr();
  EXPECT_EQ(run.Stderr().find("run failed"), std::string::npos) << run.Stderr();
  EXPECT_EQ(results_folders(), 0);
}

ScalingRun Finished(double samples_per_s, double comm_share) {
  // 1000 samples per step: step_ms * samples_per_s = 1e6.
  return {.ranks = 2, .samples_per_s = samples_per_s, .step_ms = 1e6 / samples_per_s,
          .comm_share = comm_share, .overlap = 0.5, .on_caller = false, .ok = true};
}

// Of two runs the median is their mean (before, the lower middle of the
// ascending order: the slower run); the row's other figures agree with it.
// A share just below zero (timing noise in the overlap, or the mean of two
// runs around zero) prints 0%: the row's "-0%" failed its own format check.
TEST(ScalingMedianTest, PercentRoundsNoiseBelowZeroToZero) {
  EXPECT_EQ(Percent(-0.001), "0%");
  EXPECT_EQ(Percent(0.0), "0%");
  EXPECT_EQ(Percent(0.474), "47%");
  EXPECT_EQ(Percent(2.89), "289%");
  EXPECT_EQ(Percent(NAN), "-");
}

TEST(ScalingMedianTest, AnEvenNumberOfRunsGivesTheMeanOfTheMiddleTwo) {
  const ScalingRun two = MedianRun({Finished(300, 0.2), Finished(100, 0.4)});
  EXPECT_DOUBLE_EQ(two.samples_per_s, 200);
  EXPECT_DOUBLE_EQ(two.step_ms, 1e6 / 200) << "the step time of the median rate";
  EXPECT_DOUBLE_EQ(two.comm_share, 0.3);
  EXPECT_DOUBLE_EQ(two.overlap, 0.5);
  EXPECT_EQ(two.ranks, 2);
  EXPECT_TRUE(two.ok);
  const ScalingRun four =
      MedianRun({Finished(400, 0.1), Finished(100, 0.1), Finished(300, 0.1), Finished(200, 0.1)});
  EXPECT_DOUBLE_EQ(four.samples_per_s, 250);
  EXPECT_DOUBLE_EQ(four.step_ms, 1e6 / 250);
  // One rank has no communication: NaN stays NaN.
  ScalingRun a = Finished(100, NAN), b = Finished(200, NAN);
  a.on_caller = true;
  const ScalingRun one_rank = MedianRun({a, b});
  EXPECT_TRUE(std::isnan(one_rank.comm_share));
  EXPECT_TRUE(one_rank.on_caller);
}

TEST(ScalingMedianTest, AnOddNumberOfRunsGivesTheMiddleRunAsItWas) {
  const ScalingRun three = MedianRun({Finished(300, 0.1), Finished(100, 0.2), Finished(200, 0.3)});
  EXPECT_DOUBLE_EQ(three.samples_per_s, 200);
  EXPECT_DOUBLE_EQ(three.comm_share, 0.3);
  EXPECT_DOUBLE_EQ(MedianRun({Finished(300, 0.1)}).samples_per_s, 300);
}

// Each count is a whole number on its own (before, atoi read "1 2 4" as 1,
// "1;2;4" as 1 and "2x" as 2, and the run went on).
TEST(ScalingBenchTest, BadRankCountsAreRefused) {
  for (const char* ranks : {"1,0", "1 2 4", "1;2;4", "2x", "1,,2", "", "+2", " 2", "1,257",
                            "99999999999999999999"}) {
    const testing::RunOutput r = testing::RunToEnd(
        {testing::Runfile("examples/scaling_bench"), std::string("--ranks=") + ranks});
    EXPECT_EQ(r.exit_code, 2) << ranks << "\n" << r.out << r.err;
    EXPECT_EQ(r.err, std::string("scaling_bench: --ranks=") + ranks +
                         ": each count must be a whole number in [1, 256], comma-separated\n");
    EXPECT_EQ(r.out, "") << ranks;
  }
}

// --steps=0 and --repeat=-1 were refused together as "--steps and --repeat
// must be at least 1", naming neither value nor which of the two.
TEST(ScalingBenchTest, StepsOrRepeatBelowOneIsRefusedNamingTheFlag) {
  for (const auto& [flag, message] : std::vector<std::pair<std::string, std::string>>{
           {"--steps=0", "scaling_bench: --steps=0 must be at least 1\n"},
           {"--repeat=-1", "scaling_bench: --repeat=-1 must be at least 1\n"}}) {
    const testing::RunOutput r =
        testing::RunToEnd({testing::Runfile("examples/scaling_bench"), "--ranks=1", flag});
    EXPECT_EQ(r.exit_code, 2) << flag << "\n" << r.out << r.err;
    EXPECT_EQ(r.err, message);
    EXPECT_EQ(r.out, "") << flag;
  }
}

// A --steps so large that the warm-up steps added to it wrap past INT64_MAX
// is refused by name (before, the message named --max_steps, a flag
// scaling_bench does not have, with a negative value).
TEST(ScalingBenchTest, StepsThatWouldWrapWithTheWarmUpAreRefused) {
  const testing::RunOutput r = testing::RunToEnd({testing::Runfile("examples/scaling_bench"),
                                                  "--ranks=1", "--steps=9223372036854775807"});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_EQ(r.err,
            "scaling_bench: --steps=9223372036854775807 must be at most 9223372036854775802 (5 "
            "warm-up steps come first)\n");
  EXPECT_EQ(r.out, "");
}

// Started under a launcher (srun, mpirun, torchrun, or RANK exported) the
// coordinator refuses (before, it ran as one worker of that job, printed
// nothing and exited 0). Its own workers still run: they get --result_file
// (the first test).
TEST(ScalingBenchTest, RunningUnderALauncherIsRefused) {
  const std::vector<std::vector<std::pair<std::string, std::string>>> envs = {
      {{"RANK", "0"}, {"WORLD_SIZE", "1"}},
      {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_STEP_ID", "0"}},
      {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}},
  };
  for (const auto& env : envs) {
    const testing::RunOutput r = testing::RunToEnd(
        {testing::Runfile("examples/scaling_bench"), "--model=mlp", "--ranks=1", "--steps=1",
         "--batch_size=16", "--workers=0"},
        env, std::chrono::seconds(60));
    EXPECT_EQ(r.exit_code, 2) << env[0].first << "\n" << r.out << r.err;
    EXPECT_EQ(r.err,
              "scaling_bench: launch variables are set (RANK, WORLD_SIZE, an srun step or "
              "mpirun); scaling_bench starts its own jobs: run it outside "
              "srun/mpirun/torchrun/ddprun\n")
        << env[0].first;
    EXPECT_EQ(r.out, "") << env[0].first;
  }
}

}  // namespace
}  // namespace ddp::examples
