#include "transport/fault/process.h"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <climits>

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

}  // namespace
}  // namespace ddp::transport::fault
