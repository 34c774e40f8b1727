// In a binary of its own: the guard cannot be removed once installed, so
// this test must not share a process with one that installs it (the order
// of tests in a binary may be shuffled or filtered).

#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "transport/fork/fork_guard.h"

namespace ddp::transport::fork {
namespace {

TEST(ForkGuard, ForkBeforeInstallIsAllowed) {
  ASSERT_FALSE(ForkGuardInstalled());
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    close(fds[0]);
    const Status s = CheckNotForkedChild("creating a communicator");
    const std::string text = s.ToString();
    (void)!write(fds[1], text.data(), text.size());
    _exit(s.ok() ? 0 : 1);
  }
  close(fds[1]);
  std::string text;
  char buffer[512];
  ssize_t n;
  while ((n = read(fds[0], buffer, sizeof(buffer))) > 0) text.append(buffer, n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << text;  // the check passed
  EXPECT_EQ(text, "OK");
  EXPECT_FALSE(InForkedChild());
}

}  // namespace
}  // namespace ddp::transport::fork
