// The helpers that tests of the example binaries use to watch processes.

#include "examples/testing/subprocess.h"

#include <linux/sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace ddp::examples::testing {
namespace {

using Clock = std::chrono::steady_clock;

char StateOf(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() ? line[close + 2] : 0;
}

// A killed multi-threaded process can show its main thread as a zombie
// while another thread still exits and still holds the files they share
// (the trainer's checkpoint claim, a socket). The child here makes that
// state on purpose: its main thread exits alone, and a second thread lives
// on until the test closes a pipe. The process is not gone until then.
TEST(ProcessGoneTest, AZombieMainThreadWithAThreadStillRunningIsNotGone) {
  int release[2];
  ASSERT_EQ(pipe(release), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(release[1]);
    std::thread([fd = release[0]] {
      char c;
      while (read(fd, &c, 1) > 0) {
      }
      _exit(0);
    }).detach();
    syscall(SYS_exit, 0);  // ends the main thread only
  }
  close(release[0]);
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (StateOf(child) != 'Z' && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(StateOf(child), 'Z') << "the child's main thread did not exit";
  EXPECT_FALSE(ProcessGone(child)) << "a thread of the process still runs";

  close(release[1]);  // the second thread reads EOF and ends the process
  while (!ProcessGone(child) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(ProcessGone(child));
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(ProcessGone(child));
}

TEST(ProcessGoneTest, AnEndedAndReapedProcessIsGoneAndARunningOneIsNot) {
  EXPECT_FALSE(ProcessGone(getpid()));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(ProcessGone(child));
}

// A copy of this process under the pid `pid` (clone3's set_tid: root may
// choose a free pid) that waits to be signalled. Returns its pid, or -1
// with errno from clone3 (EEXIST: the pid is taken). This process must run
// one thread only.
pid_t StartStandInAs(pid_t pid) {
  clone_args args{};
  args.exit_signal = SIGCHLD;
  args.set_tid = reinterpret_cast<uint64_t>(&pid);
  args.set_tid_size = 1;
  const pid_t copy = static_cast<pid_t>(syscall(SYS_clone3, &args, sizeof(args)));
  if (copy == 0) {
    while (true) pause();
  }
  return copy;
}

// A worker of the program ends and its parent reaps it; an unrelated
// process gets its pid (likely on a busy host: pid_max is often 32768).
// Destroying the Subprocess kills the workers it saw that are still there,
// and must not take that process for one: it did (SIGKILL to whatever held
// the number), which could end another test's process on a shared host.
TEST(SubprocessTest, DestroyingItSparesAProcessThatGotAReapedWorkersPid) {
  pid_t stand_in = -1;
  {
    // The worker runs in a session (and group) of its own, as ranks do.
    Subprocess run({"/bin/sh", "-c", "setsid sleep 60 & wait; exec sleep 60"});
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    std::vector<pid_t> workers;
    while ((workers = run.Children()).empty() && Clock::now() < deadline) {
      ASSERT_EQ(run.Wait(std::chrono::milliseconds(5)), -1) << run.Stderr();
    }
    ASSERT_EQ(workers.size(), 1u) << run.Stderr();
    ASSERT_EQ(run.Wait(std::chrono::milliseconds(0)), -1) << run.Stderr();  // seen by Wait
    const pid_t worker = workers[0];
    ASSERT_EQ(kill(worker, SIGKILL), 0);
    const std::string proc = "/proc/" + std::to_string(worker);
    while (std::filesystem::exists(proc) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_FALSE(std::filesystem::exists(proc)) << "the shell did not reap its worker";
    // The kernel may hold the freed number a moment longer.
    while ((stand_in = StartStandInAs(worker)) < 0 && errno == EEXIST && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(stand_in, worker) << "clone3 with set_tid: " << std::strerror(errno)
                                << " (choosing a pid needs root)";
  }
  // A SIGKILL sent by the destructor came first and decides the status.
  ASSERT_EQ(kill(stand_in, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(waitpid(stand_in, &status, 0), stand_in);
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_EQ(WTERMSIG(status), SIGTERM) << "the process with the reaped worker's pid was killed";
}

}  // namespace
}  // namespace ddp::examples::testing
