#include "transport/launch/self_launch.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/launch/launch_test_util.h"

namespace ddp::transport::launch {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;
using testing::CountLines;
using testing::RunProgram;

std::string Worker() { return testing::Runfile("transport/launch/test_worker"); }

TEST(SelfLaunchTest, FourWorkersRendezvousAndComplete) {
  const auto run = RunProgram({Worker(), "--nproc_per_node=4", "--store", "--print_env"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  for (int r = 0; r < 4; ++r) {
    const std::string p = "[" + std::to_string(r) + "] ";
    EXPECT_THAT(run.output, HasSubstr(p + "rank " + std::to_string(r) + "/4 local " +
                                      std::to_string(r) + "/4 group 0 restart 0 master 127.0.0.1:"));
    EXPECT_THAT(run.output, HasSubstr(p + "rank " + std::to_string(r) + " met 4 ranks"));
    EXPECT_THAT(run.output, HasSubstr(p + "rank " + std::to_string(r) + " done"));
  }
  // A store hosted by the launcher, and a fresh 32-character token.
  EXPECT_EQ(CountLines(run.output, "store launcher token_len 32"), 4) << run.output;
}

TEST(SelfLaunchTest, SpaceSeparatedFlagAndDefault) {
  auto run = RunProgram({Worker(), "--nproc_per_node", "2", "--print_env"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(CountLines(run.output, "/2 local"), 2) << run.output;
  // Without the flag: the caller's default (1), output not prefixed.
  run = RunProgram({Worker(), "--print_env"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("rank 0/1 local 0/1"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("[0]")));
}

TEST(SelfLaunchTest, BadProcessCountIsRefusedBeforeAnythingStarts) {
  auto run = RunProgram({Worker(), "--nproc_per_node=0"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--nproc_per_node=0 must be in [1, 4096]"));
  EXPECT_EQ(CountLines(run.output, ""), 1) << "expected one line: " << run.output;
  run = RunProgram({Worker(), "--nproc_per_node=two"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--nproc_per_node=two is not an integer, gpu, cpu or auto"));
  run = RunProgram({Worker(), "--nproc_per_node"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--nproc_per_node needs a value"));
}

// SelfLaunchOptions::check_arguments: the launcher refuses what the
// program's own check refuses, once, with exit 2 and nothing started
// (test_worker refuses an unknown argument); every worker used to start and
// refuse it (exit 64), then the launcher named the first. The line names
// the program without its folder. Under a launcher the check is the
// worker's own.
// Workers that cannot start for lack of descriptors (`ulimit -n` too low
// for 64 workers' pipes) are no bad input: exit 1, with a line that says so.
TEST(SelfLaunchTest, AStartThatRunsOutOfDescriptorsIsNoBadInput) {
  const auto run = RunProgram({"/bin/sh", "-c", "ulimit -n 48 && exec \"$0\" \"$@\"", Worker(),
                               "--nproc_per_node=64"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, ContainsRegex("test_worker: the workers could not start for lack of resources "
                                        "\\(not bad input\\): cannot start rank [0-9]+: [^\n]*Too many "
                                        "open files"))
      << run.output;
}

// A store that cannot start for lack of descriptors (`ulimit -n 4`: none
// left past the listening socket) is named as the store, not as workers
// that could not start (none was started), and is no bad input: exit 1.
TEST(SelfLaunchTest, AStoreThatRunsOutOfDescriptorsIsNamedAsTheStore) {
  const auto run = RunProgram({"/bin/sh", "-c", "ulimit -n 4 && exec \"$0\" \"$@\"", Worker(), "--nproc_per_node=2"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, ContainsRegex("^test_worker: lack of resources \\(not bad input\\): cannot serve the "
                                        "workers' rendezvous store: [^\n]*Too many open files"))
      << run.output;
  EXPECT_THAT(run.output, Not(HasSubstr("the workers could not start"))) << run.output;
}

TEST(SelfLaunchTest, TheProgramsOwnCheckRefusesArgumentsBeforeAnythingStarts) {
  auto run = RunProgram({Worker(), "--nproc_per_node=3", "--bogus", "--print_env"});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_EQ(run.output, "test_worker: unknown argument --bogus\n");
  run = RunProgram({Worker(), "--bogus"}, {{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(run.exit_code, 64) << run.output;
  EXPECT_EQ(run.output, "test_worker: unknown argument --bogus\n");
}

TEST(SelfLaunchTest, WorkerFailureGivesItsExitCodeAndNamesTheRank) {
  const auto run = RunProgram({Worker(), "--nproc_per_node=3", "--exit_code=2:5", "--sleep_ms=20000"});
  EXPECT_EQ(run.exit_code, 5) << run.output;
  EXPECT_THAT(run.output, ::testing::ContainsRegex(
                              "rank 2 \\(pid [0-9]+\\) exited with code 5; stopping the other workers"));
}

// Rank 1 fails on the first two attempts: the launcher restarts every
// worker twice, with DDP_RESTART_COUNT counting, and the third attempt
// meets through the store (fresh keys) and succeeds.
// SelfLaunchOptions::exec_timeout reaches the workers' start: 0 is
// refused there, naming it (it was not passed on: the 60 s default stood).
TEST(SelfLaunchTest, ExecTimeoutReachesTheStart) {
  auto run = RunProgram({Worker(), "--nproc_per_node=2", "--self_launch_exec_timeout_ms=0"});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("the time a worker may take to exec (exec_timeout) is 0 ms; it must be more "
                                    "than 0"));
  run = RunProgram({Worker(), "--nproc_per_node=2", "--self_launch_exec_timeout_ms=30000"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
}

// Workers stopped at SelfLaunchOptions::max_run_time: the line names it,
// not only "the deadline", and the job does not restart.
TEST(SelfLaunchTest, MaxRunTimeIsNamedWhenItStopsTheWorkers) {
  const auto run = RunProgram({Worker(), "--nproc_per_node=2", "--self_launch_max_run_time_ms=500",
                               "--self_launch_restarts=2", "--sleep_ms=20000"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("max_run_time (500 ms) ran out: the workers were still running after "))
      << run.output;
  EXPECT_THAT(run.output, Not(HasSubstr("restarting"))) << run.output;
}

// A failure whose stop outlasts max_run_time (rank 0 ignores SIGTERM for
// the 7 s grace) is not restarted: the restart's workers would only be
// stopped at once, and the job would end with the time limit's 1 instead
// of the failed worker's 5. Rank 1 fails right after the rendezvous (so
// rank 0 already ignores SIGTERM); the 5 s max_run_time leaves a loaded
// host room to start both workers first, and the grace outlasts it. A
// restart would add a second grace (over 14 s in all).
TEST(SelfLaunchTest, NoRestartOnceMaxRunTimeIsOver) {
  const auto start = std::chrono::steady_clock::now();
  const auto run = RunProgram({Worker(), "--nproc_per_node=2", "--self_launch_max_run_time_ms=5000",
                               "--self_launch_grace_ms=7000", "--self_launch_restarts=2", "--store",
                               "--exit_code=1:5", "--slow_to_stop=0", "--sleep_ms=30000"});
  EXPECT_EQ(run.exit_code, 5) << run.output;
  EXPECT_THAT(run.output, HasSubstr("exited with code 5; stopping the other workers; no restart: max_run_time "
                                    "(5000 ms) ran out"))
      << run.output;
  EXPECT_THAT(run.output, Not(HasSubstr("restarting"))) << run.output;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 13s) << run.output;
}

TEST(SelfLaunchTest, FailedWorkerRestartsTheJob) {
  const auto run = RunProgram({Worker(), "--nproc_per_node=2", "--self_launch_restarts=2",
                               "--fail_before_restart=2", "--print_env", "--store"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  // Rank 1 prints before it fails; rank 0 may be stopped before it prints.
  for (int attempt = 0; attempt <= 2; ++attempt) {
    EXPECT_EQ(CountLines(run.output, "rank 1/2 local 1/2 group 0 restart " +
                                         std::to_string(attempt) + " master"),
              1)
        << run.output;
  }
  EXPECT_EQ(CountLines(run.output, "restart 2 master"), 2) << run.output;
  EXPECT_THAT(run.output, ::testing::ContainsRegex(
                              "rank 1 \\(pid [0-9]+\\) exited with code 1.*; restarting the "
                              "workers \\(restart 1 of 2\\)"));
  EXPECT_THAT(run.output, HasSubstr("(restart 2 of 2)"));
  EXPECT_EQ(CountLines(run.output, "met 2 ranks"), 2) << run.output;
  EXPECT_EQ(CountLines(run.output, " done"), 2) << run.output;
}

// Out of restarts: the last failure's status, and no further attempt.
TEST(SelfLaunchTest, RestartsStopAtTheLimit) {
  const auto run = RunProgram({Worker(), "--nproc_per_node=2", "--self_launch_restarts=1",
                               "--fail_before_restart=5", "--print_env"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("(restart 1 of 1)"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("restart 2")));
  EXPECT_EQ(CountLines(run.output, "rank 1 fails on attempt"), 2) << run.output;
}

// A restart that cannot start its workers (here the program lost its
// execute permission after the first start) ends the job with the status
// of the failure that asked for the restart, and says why; it used to exit
// 2, which stands for bad input.
TEST(SelfLaunchTest, RestartThatCannotStartKeepsTheFailuresStatus) {
  const std::string dir = testing::MakeTempDir("self_launch_restart_cannot_start");
  const std::string program = dir + "/test_worker";
  std::filesystem::copy_file(Worker(), program);
  std::filesystem::permissions(program, std::filesystem::perms::owner_all);
  auto group = testing::StartProgram({program, "--nproc_per_node=2", "--self_launch_restarts=2",
                                      "--sleep_ms=30000", "--pid_dir=" + dir});
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<pid_t> workers;
  for (int r = 0; r < 2; ++r) {
    workers.push_back(testing::ReadPidFile(dir + "/rank" + std::to_string(r) + ".restart0.pid", 10s));
    ASSERT_GT(workers.back(), 0);
  }
  std::filesystem::permissions(program, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  kill(workers[1], SIGKILL);
  const auto run = testing::WaitProgram(**group, 20s);
  EXPECT_EQ(run.exit_code, 128 + SIGKILL) << run.output;
  EXPECT_THAT(run.output, ::testing::ContainsRegex("rank 1 \\(pid [0-9]+\\) was killed by signal 9 \\(SIGKILL\\)"));
  EXPECT_THAT(run.output, ::testing::ContainsRegex("test_worker: restart 1 could not start the workers: .*rank 0"))
      << run.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/rank0.restart1.pid"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("restart 2")));
}

TEST(SelfLaunchTest, UnderALauncherItRunsAsThatWorker) {
  // --nproc_per_node agrees with the environment (3 workers on one node).
  auto run = RunProgram({Worker(), "--nproc_per_node=3", "--print_env"},
                        {{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"MASTER_PORT", "4567"}});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("rank 1/3 local 1/3 group 0 restart 0 master 127.0.0.1:4567 store rank0"));
  EXPECT_EQ(CountLines(run.output, "rank 1/3"), 1) << run.output;
  // Without the flag the environment alone counts.
  run = RunProgram({Worker(), "--print_env"}, {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "1"},
                                               {"MASTER_ADDR", "127.0.0.1"}});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("rank 0/2 local 0/1"));
}

// Inside `srun --pty bash` (an srun step of one task) an explicit
// --nproc_per_node=4 cannot be met: refused, instead of one worker of a
// job of 1 running without a word.
TEST(SelfLaunchTest, ProcessCountTheLaunchEnvironmentContradictsIsRefused) {
  const std::vector<std::pair<std::string, std::string>> srun_pty = {
      {"SLURM_PROCID", "0"},   {"SLURM_NTASKS", "1"},  {"SLURM_STEP_ID", "0"},
      {"SLURM_LOCALID", "0"},  {"SLURM_NODEID", "0"},  {"SLURM_STEP_TASKS_PER_NODE", "1"},
      {"SLURM_JOB_NODELIST", "node01"}};
  auto run = RunProgram({Worker(), "--nproc_per_node=4", "--print_env"}, srun_pty);
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output,
              HasSubstr(": --nproc_per_node=4 asks for 4 workers on this node, but this process already is "
                        "one worker of a launched job with 1 on this node (an srun step: SLURM_PROCID=0, "
                        "SLURM_NTASKS=1, SLURM_STEP_ID=0, SLURM_STEP_TASKS_PER_NODE=1); drop "
                        "--nproc_per_node, or start the job with 4 workers per node (e.g. ddprun "
                        "--nproc_per_node=4)\n"));
  EXPECT_EQ(CountLines(run.output, ""), 1) << "expected one line: " << run.output;
  // The same step with the count it has runs as its one worker.
  run = RunProgram({Worker(), "--nproc_per_node=1", "--print_env"}, srun_pty);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("rank 0/1 local 0/1"));
  // torchrun's variables: one node of WORLD_SIZE workers unless
  // LOCAL_WORLD_SIZE says otherwise.
  run = RunProgram({Worker(), "--nproc_per_node=4"}, {{"RANK", "1"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("with 3 on this node (RANK=1, WORLD_SIZE=3, LOCAL_WORLD_SIZE unset (one "
                                    "node)); drop --nproc_per_node"));
  run = RunProgram({Worker(), "--nproc_per_node", "gpu"},
                   {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
                    {"CUDA_VISIBLE_DEVICES", "0,1,2"}});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("--nproc_per_node=gpu asks for 3 workers on this node, but this process "
                                    "already is one worker of a launched job with 2 on this node (RANK=1, "
                                    "WORLD_SIZE=4, LOCAL_WORLD_SIZE=2)"));
}

TEST(SelfLaunchTest, BrokenLaunchEnvironmentIsRefused) {
  const auto run = RunProgram({Worker()}, {{"RANK", "3"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("RANK=3 is not below WORLD_SIZE=2"));
}

// Also with restarts allowed: an interrupted launcher does not restart.
TEST(SelfLaunchTest, SigtermToTheLauncherReachesEveryWorker) {
  const std::string dir = testing::MakeTempDir("self_launch_sigterm");
  auto group = testing::StartProgram({Worker(), "--nproc_per_node=3", "--self_launch_restarts=2",
                                      "--sleep_ms=30000", "--pid_dir=" + dir});
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<pid_t> workers;
  for (int r = 0; r < 3; ++r) {
    workers.push_back(testing::ReadPidFile(dir + "/rank" + std::to_string(r) + ".restart0.pid", 10s));
    ASSERT_GT(workers.back(), 0);
  }
  kill((*group)->pids()[0], SIGTERM);
  const auto run = testing::WaitProgram(**group, 20s);
  EXPECT_EQ(run.exit_code, 128 + SIGTERM) << run.output;
  EXPECT_THAT(run.output, HasSubstr("interrupted by SIGTERM; forwarded it to every worker"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("restarting")));
  for (pid_t pid : workers) EXPECT_TRUE(testing::GoneWithin(pid, 5s)) << pid;
  EXPECT_FALSE(std::filesystem::exists(dir + "/rank0.restart1.pid"));
}

// A signal that comes between two attempts, where no group forwards it, is
// reported and starts no restart; the launcher used to die of it there
// without a word. To hold the launcher in that gap, its stderr is a full
// pipe: its line about the restart waits there (up to 2 s, see
// WriteLauncherLine). The group is gone once its watcher (a child named
// ddp-watcher) is.
TEST(SelfLaunchTest, InterruptBetweenAttemptsIsReportedAndStartsNoRestart) {
  const std::string dir = testing::MakeTempDir("self_launch_interrupt_between");
  auto launcher = testing::HeldLauncher::Start({Worker(), "--nproc_per_node=2", "--self_launch_restarts=2",
                                                "--sleep_ms=30000", "--pid_dir=" + dir},
                                               dir + "/stdout");
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  const pid_t pid = (*launcher)->pid();
  std::vector<pid_t> workers;
  for (int r = 0; r < 2; ++r) {
    workers.push_back(testing::ReadPidFile(dir + "/rank" + std::to_string(r) + ".restart0.pid", 10s));
    ASSERT_GT(workers.back(), 0);
  }
  ASSERT_TRUE(testing::Within(10s, [&] { return testing::HasChildNamed(pid, "ddp-watcher"); }));
  kill(workers[1], SIGKILL);
  ASSERT_TRUE(testing::Within(10s, [&] { return !testing::HasChildNamed(pid, "ddp-watcher"); }));
  // The group's end is not yet the gap: the launcher still looks for a
  // signal caught meanwhile before its line about the restart, which it
  // then writes into the full pipe, where it is held.
  const Status held = (*launcher)->AwaitHeldAtStderr(10s);
  ASSERT_TRUE(held.ok()) << held;
  kill(pid, SIGTERM);

  const std::string output = (*launcher)->ReadStderr(20s);
  const int status = (*launcher)->Reap(20s);
  ASSERT_NE(status, -1) << "the launcher did not end\n" << output;
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status << "\n" << output;
  EXPECT_THAT(output, HasSubstr("test_worker: interrupted by SIGTERM before restart 1 started\n"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/rank0.restart1.pid"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/rank1.restart1.pid"));
}

// A self-launching program's launcher, interrupted, dies of the signal
// after stopping its workers, as ddprun does.
TEST(SelfLaunchTest, InterruptedLauncherDiesOfTheSignal) {
  for (int signo : {SIGINT, SIGTERM}) {
    const std::string dir = testing::MakeTempDir("self_launch_dies_of_" + std::to_string(signo));
    auto group = testing::StartProgram({Worker(), "--nproc_per_node=2", "--sleep_ms=30000", "--pid_dir=" + dir});
    ASSERT_TRUE(group.ok()) << group.status();
    std::vector<pid_t> workers;
    for (int r = 0; r < 2; ++r) {
      workers.push_back(testing::ReadPidFile(dir + "/rank" + std::to_string(r) + ".restart0.pid", 10s));
      ASSERT_GT(workers.back(), 0);
    }
    kill((*group)->pids()[0], signo);
    const auto run = testing::WaitProgram(**group, 20s);
    const WorkerExit& launcher = run.group.workers.at(0);
    EXPECT_TRUE(launcher.signaled) << launcher.Describe() << "\n" << run.output;
    EXPECT_EQ(launcher.code, signo) << run.output;
    EXPECT_THAT(run.output, HasSubstr("interrupted by " + SignalName(signo) + "; forwarded it to every worker"));
    for (pid_t pid : workers) EXPECT_TRUE(testing::GoneWithin(pid, 5s)) << pid;
  }
}

// Its workers go, and so does the folder it made for their error files
// (in its $TMPDIR), which the watcher removes: every launcher killed so
// left one behind.
TEST(SelfLaunchTest, LauncherKilledBySigkillTakesItsWorkers) {
  const std::string dir = testing::MakeTempDir("self_launch_sigkill");
  const std::string tmp = testing::MakeTempDir("self_launch_sigkill_tmp");
  auto group = testing::StartProgram(
      {Worker(), "--nproc_per_node=2", "--sleep_ms=30000", "--pid_dir=" + dir}, {{"TMPDIR", tmp}});
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<pid_t> workers;
  for (int r = 0; r < 2; ++r) {
    workers.push_back(testing::ReadPidFile(dir + "/rank" + std::to_string(r) + ".restart0.pid", 10s));
    ASSERT_GT(workers.back(), 0);
  }
  ASSERT_FALSE(std::filesystem::is_empty(tmp)) << "no folder for the error files in " << tmp;
  kill((*group)->pids()[0], SIGKILL);
  const auto run = testing::WaitProgram(**group, 20s);
  EXPECT_EQ(run.exit_code, 128 + SIGKILL);
  for (pid_t pid : workers) EXPECT_TRUE(testing::GoneWithin(pid, 5s)) << pid;
  const auto give_up = std::chrono::steady_clock::now() + 5s;
  while (!std::filesystem::is_empty(tmp) && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(std::filesystem::is_empty(tmp)) << std::filesystem::directory_iterator(tmp)->path();
}

}  // namespace
}  // namespace ddp::transport::launch
