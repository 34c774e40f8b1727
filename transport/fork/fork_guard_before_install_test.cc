// In a binary of its own: the guard cannot be removed once installed, so
// this test must not share a process with one that installs it (the order
// of tests in a binary may be shuffled or filtered).

#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
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

// A child cloned into a new pid namespace (a raw clone: no atfork handler
// marks it) is pid 1 there. When the guard was installed by a process that
// is itself pid 1 (a container's init, here one made the same way), the
// child has the installer's pid number, and a check by pid alone let it
// into the transport.
TEST(ForkGuard, ChildInANewPidNamespaceWithTheInstallersPidIsRefused) {
  ASSERT_FALSE(ForkGuardInstalled());
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  // The installer, pid 1 of a namespace of its own; it is not this test's
  // process, where the guard must stay uninstalled.
  const pid_t installer = static_cast<pid_t>(syscall(SYS_clone, CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0));
  ASSERT_GE(installer, 0) << "clone(CLONE_NEWPID): " << errno;
  if (installer == 0) {
    close(fds[0]);
    if (getpid() != 1) _exit(10);
    InstallForkGuard();
    if (InForkedChild()) _exit(11);  // the installer itself may
    const pid_t child = static_cast<pid_t>(syscall(SYS_clone, CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0));
    if (child < 0) _exit(12);
    if (child == 0) {
      if (getpid() != 1) _exit(13);  // the installer's pid number, in another namespace
      const Status s = CheckNotForkedChild("creating a communicator");
      const std::string text = s.ToString();
      (void)!write(fds[1], text.data(), text.size());
      _exit(s.ok() ? 14 : 0);
    }
    int status = 0;
    if (waitpid(child, &status, 0) != child) _exit(15);
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 16);
  }
  close(fds[1]);
  std::string text;
  char buffer[1024];
  ssize_t n;
  while ((n = read(fds[0], buffer, sizeof(buffer))) > 0) text.append(buffer, n);
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(installer, &status, 0), installer);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << text;  // 14: the check let the child in
  EXPECT_EQ(text.rfind("FAILED_PRECONDITION: creating a communicator: this process (pid 1) was made from a "
                       "process outside its pid namespace, after the transport was initialized in pid 1 of "
                       "another namespace",
                       0),
            0)
      << text;
  EXPECT_FALSE(ForkGuardInstalled());
}

}  // namespace
}  // namespace ddp::transport::fork
