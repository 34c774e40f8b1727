#include "transport/fault/process.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <climits>
#include <thread>

#include "transport/testing/descriptors_exhausted.h"

// This binary's kill(): counts the calls that name a process group or every
// process (pid 0 or below), then passes each call to the kernel. It takes
// the place of the C library's for process.cc, linked into this binary.
namespace {
std::atomic<int> group_kills{0};
}  // namespace

extern "C" int kill(pid_t pid, int sig) noexcept {
  if (pid <= 0) group_kills.fetch_add(1);
  return static_cast<int>(syscall(SYS_kill, pid, sig));
}

namespace ddp::transport::fault {
namespace {

// A pid of 0 or below names no process. kill(0, 0) asks about this
// process's group and kill(-1, 0) about every process it may signal, so
// the answer came from /proc by chance (no /proc/0 or /proc/-1): the pid is
// refused before any such question is asked.
TEST(ProcessGoneNow, APidOfZeroOrBelowIsGoneWithoutAskingAboutAProcessGroup) {
  for (const int pid : {0, -1, -getpgrp(), INT_MIN}) {
    group_kills = 0;
    EXPECT_TRUE(ProcessGoneNow(pid)) << "pid " << pid;
    EXPECT_TRUE(ProcessGoneNow(pid, ProcessStartTime(getpid()))) << "pid " << pid;
    EXPECT_EQ(group_kills.load(), 0) << "pid " << pid << ": kill() was asked about a process group";
  }
  EXPECT_EQ(ProcessStartTime(0), 0u);
  EXPECT_EQ(ProcessState(-1), 0);
}

// The interposer above does reach the kernel: a live process is not gone,
// and no group was asked about for it.
TEST(ProcessGoneNow, ThisProcessIsNotGone) {
  group_kills = 0;
  EXPECT_FALSE(ProcessGoneNow(getpid()));
  EXPECT_FALSE(ProcessGoneNow(getpid(), ProcessStartTime(getpid())));
  EXPECT_EQ(group_kills.load(), 0);
}

// Blocks on `fd` until it is readable (a byte, or its writer's end).
void* ReadOne(void* fd) {
  char c;
  return reinterpret_cast<void*>(read(static_cast<int>(reinterpret_cast<intptr_t>(fd)), &c, 1));
}

// A rank whose main thread exited (pthread_exit, or the exit system call) while its other
// threads work on: the kernel shows the main thread as a zombie (state Z,
// no /proc/PID/exe), and kill(pid, 0) succeeds, yet the process runs. It
// was reported gone, so a peer's fallback check (no pidfd) declared a live
// rank lost. Once its last thread ends it is gone.
TEST(ProcessGoneNow, AProcessWhoseMainThreadExitedWhileOthersRunIsNotGone) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(fds[1]);
    pthread_t worker;
    if (pthread_create(&worker, nullptr, &ReadOne, reinterpret_cast<void*>(static_cast<intptr_t>(fds[0]))) != 0) {
      _exit(2);
    }
    // The exit system call ends this thread alone (pthread_exit would
    // unwind through the test framework's handlers).
    syscall(SYS_exit, 0);
  }
  close(fds[0]);
  const uint64_t started = ProcessStartTime(pid);
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  ASSERT_GE(pidfd, 0) << "pidfd_open: " << errno;
  // No event tells when the main thread is done: its state is looked at.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ProcessState(pid) != 'Z' && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(ProcessState(pid), 'Z') << "the child's main thread did not exit within 10 s";
  EXPECT_FALSE(ProcessGoneNow(pid));
  EXPECT_FALSE(ProcessGoneNow(pid, started));
  {
    // The fallback is for when no pidfd can be had, every descriptor in use
    // among the reasons: it needs none.
    testing::DescriptorsExhausted none;
    ASSERT_EQ(none.error(), EMFILE);
    EXPECT_FALSE(ProcessGoneNow(pid)) << "with no descriptor left";
  }
  close(fds[1]);  // the worker's read returns, and the process ends
  pollfd exited{pidfd, POLLIN, 0};
  ASSERT_EQ(poll(&exited, 1, 10'000), 1) << "the child did not exit within 10 s of its worker's release";
  EXPECT_TRUE(ProcessGoneNow(pid));
  EXPECT_TRUE(ProcessGoneNow(pid, started));
  close(pidfd);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "wait status " << status;
}

}  // namespace
}  // namespace ddp::transport::fault
