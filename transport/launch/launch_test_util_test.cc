#include "transport/launch/launch_test_util.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <string>

#include <gtest/gtest.h>

#include "transport/launch/spawn.h"

namespace ddp::transport::launch::testing {
namespace {

using namespace std::chrono_literals;

// A program reaped from under its group (here by the test itself, before
// the group looked) ends without an exit status the group could see: its
// run says -1, not the 0 of a program that succeeded.
TEST(LaunchTestUtilTest, AProgramThatCouldNotBeReapedHasNoExitCode) {
  // As StartProgram, but with a short grace: the group waits that, then
  // kReapTime, for an exit it cannot see.
  WorkerSpec spec;
  spec.program = "/bin/sh";
  spec.argv = {"/bin/sh", "-c", "exit 0"};
  SpawnOptions options;
  options.output.capture = true;
  options.output.to_terminal = false;
  options.forward_signals = false;
  options.grace = 100ms;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start({spec}, options);
  ASSERT_TRUE(group.ok()) << group.status();
  const pid_t pid = (*group)->pids().at(0);
  int status = -1;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ProgramRun run = WaitProgram(**group, 200ms);
  EXPECT_FALSE(run.group.workers.at(0).exited);
  EXPECT_EQ(run.exit_code, -1) << run.group.reason;
}

TEST(LaunchTestUtilTest, ExitCodesAndSignalsAreReported) {
  EXPECT_EQ(RunProgram({"/bin/sh", "-c", "exit 0"}).exit_code, 0);
  EXPECT_EQ(RunProgram({"/bin/sh", "-c", "exit 7"}).exit_code, 7);
  EXPECT_EQ(RunProgram({"/bin/sh", "-c", "kill -9 $$"}).exit_code, 128 + 9);
}

TEST(LaunchTestUtilTest, CatchesSignalReadsTheHandlersOfAProcess) {
  struct sigaction old_action{};
  struct sigaction action{};
  action.sa_handler = [](int) {};
  sigemptyset(&action.sa_mask);
  ASSERT_EQ(sigaction(SIGUSR2, &action, &old_action), 0);
  EXPECT_TRUE(CatchesSignal(getpid(), SIGUSR2));
  action.sa_handler = SIG_DFL;
  ASSERT_EQ(sigaction(SIGUSR2, &action, nullptr), 0);
  EXPECT_FALSE(CatchesSignal(getpid(), SIGUSR2));
  ASSERT_EQ(sigaction(SIGUSR2, &old_action, nullptr), 0);
}

TEST(LaunchTestUtilTest, WithinGivesUpAtItsTimeout) {
  int calls = 0;
  EXPECT_TRUE(Within(1s, [&] { return ++calls == 3; }));
  EXPECT_EQ(calls, 3);
  EXPECT_FALSE(Within(20ms, [] { return false; }));
}

// A program started held writes nothing until the test reads: its stderr
// was full. What it wrote comes back without the filler, and its status
// with Reap.
TEST(LaunchTestUtilTest, AHeldLaunchersStderrWaitsForTheReader) {
  const std::string dir = MakeTempDir("launch_test_util_held");
  auto held = HeldLauncher::Start({"/bin/sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 3"}, dir + "/stdout");
  ASSERT_TRUE(held.ok()) << held.status();
  const std::string output = (*held)->ReadStderr(10s);
  EXPECT_EQ(output, "to-stderr\n");
  const int status = (*held)->Reap(10s);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 3);
  std::ifstream out(dir + "/stdout");
  const std::string written((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  EXPECT_EQ(written, "to-stdout\n");
}

TEST(LaunchTestUtilTest, AHeldLauncherThatCannotStartIsAnError) {
  const std::string dir = MakeTempDir("launch_test_util_held_missing");
  auto held = HeldLauncher::Start({dir + "/no_such_program"}, dir + "/stdout");
  ASSERT_FALSE(held.ok());
  EXPECT_NE(held.status().message().find("no_such_program"), std::string::npos) << held.status().message();
}

// Two calls with one name (two tests, two --gtest_repeat rounds, a run by
// hand after another) get two new, empty folders: one shared folder let a
// test read the pid files an earlier caller left there as its own.
TEST(LaunchTestUtilTest, EachTempDirIsNewAndEmpty) {
  const std::string first = MakeTempDir("launch_test_util_fresh");
  std::ofstream(first + "/rank0.pid") << "1\n";
  const std::string second = MakeTempDir("launch_test_util_fresh");
  EXPECT_NE(first, second);
  EXPECT_NE(second.find("/launch_test_util_fresh"), std::string::npos) << second;
  struct stat info{};
  ASSERT_EQ(stat(second.c_str(), &info), 0) << second;
  EXPECT_TRUE(S_ISDIR(info.st_mode));
  EXPECT_NE(access((second + "/rank0.pid").c_str(), F_OK), 0) << "the first caller's file is in " << second;
  // A name with folders in it: those are made as needed.
  const std::string nested = MakeTempDir("launch_test_util_nested/inner");
  ASSERT_EQ(stat(nested.c_str(), &info), 0) << nested;
  EXPECT_TRUE(S_ISDIR(info.st_mode));
}

}  // namespace
}  // namespace ddp::transport::launch::testing
