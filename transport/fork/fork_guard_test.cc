#include "transport/fork/fork_guard.h"

#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <string>

namespace ddp::transport::fork {
namespace {

// Forks with the child's stderr going to a pipe; returns the child's wait
// status and what it wrote.
std::pair<int, std::string> ForkAndCapture() {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const int saved_stderr = dup(STDERR_FILENO);
  dup2(fds[1], STDERR_FILENO);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Reached only without a guard: the handler exits before this.
    _exit(0);
  }
  dup2(saved_stderr, STDERR_FILENO);
  close(saved_stderr);
  close(fds[1]);
  std::string text;
  char buffer[512];
  ssize_t n;
  while ((n = read(fds[0], buffer, sizeof(buffer))) > 0) text.append(buffer, n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return {status, text};
}

TEST(ForkGuard, ForkBeforeInstallIsAllowed) {
  ASSERT_FALSE(ForkGuardInstalled());
  auto [status, text] = ForkAndCapture();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(text, "");
}

TEST(ForkGuard, ForkAfterInstallKillsTheChildWithAnExplanation) {
  InstallForkGuard();
  InstallForkGuard();  // idempotent: one handler, one message
  ASSERT_TRUE(ForkGuardInstalled());
  auto [status, text] = ForkAndCapture();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), kForkGuardExitCode);
  EXPECT_NE(text.find("fork() after the transport was initialized"), std::string::npos) << text;
  EXPECT_NE(text.find("Spawn workers"), std::string::npos) << text;
  EXPECT_EQ(text.find("fork()"), text.rfind("fork() after"));  // printed once
}

TEST(ForkGuard, PosixSpawnStillWorks) {
  InstallForkGuard();
  // system() is posix_spawn in glibc: no fork handlers run.
  EXPECT_EQ(std::system("exit 3") >> 8, 3);
}

}  // namespace
}  // namespace ddp::transport::fork
