#include "transport/launch/launch_test_util.h"

#include <fcntl.h>
#include <linux/capability.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

#include <gtest/gtest.h>

#include "transport/launch/spawn.h"

namespace ddp::transport::launch::testing {
namespace {

using namespace std::chrono_literals;

// Started with DDP_TEST_NOT_DUMPABLE set, this test binary makes itself not
// dumpable and waits to be killed: a launcher whose /proc/<pid>/syscall
// and mem only a process with CAP_SYS_PTRACE may read.
const bool kRunsAsNotDumpableProgram = [] {
  if (std::getenv("DDP_TEST_NOT_DUMPABLE") == nullptr) return false;
  prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  while (true) pause();
}();

// Where /proc/<pid>/syscall cannot be read (no ptrace access: here a
// launcher that is not dumpable, read by a process without CAP_SYS_PTRACE,
// as under Yama ptrace_scope 2), HeldAtStderr says so, naming the file and
// the reason, at once. Before, it answered "not held" every time, and the
// interrupt tests failed 10 s later at a bare ASSERT_TRUE(Within(...)).
TEST(LaunchTestUtilTest, HeldAtStderrNamesAProcFileItCannotRead) {
  char self[PATH_MAX] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0) << std::strerror(errno);
  const std::string stdout_path = std::string(std::getenv("TEST_TMPDIR")) + "/not_dumpable_stdout";
  int out[2];
  ASSERT_EQ(pipe2(out, O_CLOEXEC), 0) << std::strerror(errno);
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    close(out[0]);
    setenv("DDP_TEST_NOT_DUMPABLE", "1", 1);
    auto launcher = HeldLauncher::Start({self}, stdout_path);
    std::string said;
    if (!launcher.ok()) {
      said = "start: " + launcher.status().ToString();
    } else {
      __user_cap_header_struct header{.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
      __user_cap_data_struct none[2] = {};
      if (syscall(SYS_capset, &header, none) != 0) {
        said = std::string("capset: ") + std::strerror(errno);
      } else {
        const auto start = Clock::now();
        const Status held = (*launcher)->AwaitHeldAtStderr(10s);
        said = held.ToString() + (Clock::now() - start < 5s ? "" : " (after 5 s or more)") + "\npid " +
               std::to_string((*launcher)->pid());
      }
    }
    const bool sent = write(out[1], said.data(), said.size()) == static_cast<ssize_t>(said.size());
    launcher = InternalError("killed and reaped");
    _exit(sent ? 0 : 1);
  }
  close(out[1]);
  std::string said;
  pollfd readable{.fd = out[0], .events = POLLIN, .revents = 0};
  char buffer[1024];
  const auto give_up = Clock::now() + 30s;
  ssize_t n = 1;
  while (n > 0 && Clock::now() < give_up && poll(&readable, 1, 1000) >= 0) {
    if (readable.revents == 0) continue;
    n = read(out[0], buffer, sizeof(buffer));
    if (n > 0) said.append(buffer, static_cast<size_t>(n));
  }
  close(out[0]);
  if (n != 0) kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_EQ(n, 0) << "the child did not finish within 30 s: " << said;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  const std::string pid = said.substr(said.rfind("pid ") + 4);
  EXPECT_EQ(said.find("FAILED_PRECONDITION: cannot read /proc/" + pid + "/syscall: "), 0u) << said;
  EXPECT_NE(said.find("(HeldAtStderr needs ptrace access to the launcher"), std::string::npos) << said;
  EXPECT_EQ(said.find("after 5 s"), std::string::npos) << said;
}

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
