#include "transport/launch/launch_test_util.h"

#include <sys/wait.h>

#include <chrono>

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

}  // namespace
}  // namespace ddp::transport::launch::testing
