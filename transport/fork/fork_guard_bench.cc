// Cost of InForkedChild(), which Work::Test and every transport entry point
// pay: in an ordinary process, and in one that is pid 1 of its own pid
// namespace (a container's init), whose check once took three system
// calls. Needs the right to make a pid namespace (root, or a user
// namespace); without it only the first line is printed.
//
//   bazel run //transport/fork:fork_guard_bench

#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "transport/fork/fork_guard.h"

namespace {

constexpr int kCalls = 2'000'000;

// Nanoseconds per call, over kCalls calls after a warm-up.
double NanosecondsPerCall() {
  int forked = 0;
  for (int i = 0; i < 1000; ++i) forked += ddp::transport::fork::InForkedChild();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kCalls; ++i) forked += ddp::transport::fork::InForkedChild();
  const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
  if (forked != 0) std::fprintf(stderr, "InForkedChild() said true %d times in the installer\n", forked);
  return took.count() / kCalls;
}

}  // namespace

int main() {
  const pid_t child = fork();
  if (child == 0) {
    ddp::transport::fork::InstallForkGuard();
    std::printf("installer, pid %d:  %.1f ns per InForkedChild()\n", getpid(), NanosecondsPerCall());
    std::fflush(stdout);
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  const pid_t init = static_cast<pid_t>(syscall(SYS_clone, CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0));
  if (init < 0) {
    std::perror("clone(CLONE_NEWPID), so no pid-1 figure");
    return 0;
  }
  if (init == 0) {
    ddp::transport::fork::InstallForkGuard();
    std::printf("installer, pid %d of its own namespace:  %.1f ns per InForkedChild()\n", getpid(),
                NanosecondsPerCall());
    std::fflush(stdout);
    _exit(0);
  }
  waitpid(init, &status, 0);
  return 0;
}
