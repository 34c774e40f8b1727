#include "transport/fork/fork_guard.h"

#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

namespace ddp::transport::fork {
namespace {

// Forks (with `make_child`); the child runs `child` (its result is the exit
// status) with its stderr going to a pipe. Returns the child's wait status
// and what it wrote.
std::pair<int, std::string> ForkAndCapture(const std::function<int()>& child,
                                           pid_t (*make_child)() = &::fork) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = make_child();
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], STDERR_FILENO);
    close(fds[1]);
    _exit(child());
  }
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

// What a child that enters the transport does: reports the check's error on
// stderr; exits 0 when it was refused.
int EnterTheTransport() {
  Status s = CheckNotForkedChild("creating a communicator");
  std::fputs(s.ToString().c_str(), stderr);
  return s.ok() ? 1 : 0;
}

// ForkBeforeInstallIsAllowed is in fork_guard_before_install_test.cc: the
// guard cannot be removed, so no test here may run before it is installed.

// The child (EnterTheTransport) exited 0 after its communicator was refused
// with the message naming this process as the one it was forked from.
void ExpectRefusedAsAChildOfThisProcess(int status, const std::string& text) {
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << text;
  EXPECT_EQ(text.rfind("FAILED_PRECONDITION: creating a communicator: this process (pid ", 0), 0)
      << text;
  EXPECT_NE(text.find("was forked from pid " + std::to_string(getpid()) +
                      ", after the transport was initialized there"),
            std::string::npos)
      << text;
}

TEST(ForkGuard, ForkedChildThatEntersTheTransportGetsAnExplanation) {
  InstallForkGuard();
  InstallForkGuard();  // idempotent
  ASSERT_TRUE(ForkGuardInstalled());
  EXPECT_FALSE(InForkedChild());
  EXPECT_TRUE(CheckNotForkedChild("creating a communicator").ok());  // the parent may
  auto [status, text] = ForkAndCapture(EnterTheTransport);
  ExpectRefusedAsAChildOfThisProcess(status, text);
  EXPECT_NE(text.find("Spawn workers"), std::string::npos) << text;
}

// The grandchild is refused too, and its message names the process it was
// forked from (its parent, not the one that initialized the transport).
TEST(ForkGuard, ChildOfAForkedChildIsMarkedToo) {
  InstallForkGuard();
  const pid_t top = getpid();
  auto [status, text] = ForkAndCapture([top] {
    auto [inner, inner_text] = ForkAndCapture(EnterTheTransport);
    if (!WIFEXITED(inner) || WEXITSTATUS(inner) != 0) return 2;
    const std::string want = "was forked from pid " + std::to_string(getpid()) + ", a descendant of pid " +
                             std::to_string(top) + ", after the transport was initialized there";
    if (inner_text.find(want) == std::string::npos) {
      std::fprintf(stderr, "expected \"%s\" in: %s", want.c_str(), inner_text.c_str());
      return 3;
    }
    return 0;
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << text;
}

// glibc's _Fork() copies the process without running the atfork handlers,
// as a fork or clone system call made directly does: the handler never
// marks such a child, and before the pid check it was let into the
// transport.
TEST(ForkGuard, ChildMadeWithoutTheAtforkHandlersIsRefusedToo) {
  InstallForkGuard();
  auto [status, text] = ForkAndCapture(EnterTheTransport, &::_Fork);
  ExpectRefusedAsAChildOfThisProcess(status, text);
}

// A forked child that never enters the transport (a data-loading worker)
// runs to its own end.
TEST(ForkGuard, ForkedChildThatOnlyComputesRuns) {
  InstallForkGuard();
  auto [status, text] = ForkAndCapture([] { return 7; });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 7) << text;
  EXPECT_EQ(text, "");
}

// fork() then exec: system() and popen() of glibc before 2.29, Python's
// subprocess up to 3.9 and its preexec_fn.
TEST(ForkGuard, ForkThenExecRunsTheProgram) {
  InstallForkGuard();
  auto [status, text] = ForkAndCapture([] {
    char* const argv[] = {const_cast<char*>("/bin/true"), nullptr};
    execv("/bin/true", argv);
    return 127;
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << text;
  EXPECT_EQ(text, "");
}

// An atfork child handler that ends the child (as the transport's guard
// once did): if system() forked, "exit 3" would come back as 99.
void ExitLikeAnOldForkGuard() { _exit(99); }

TEST(ForkGuard, PosixSpawnStillWorks) {
  InstallForkGuard();
  // In a child of its own, so that the handler, which cannot be removed,
  // stays out of the other tests' forks.
  auto [status, text] = ForkAndCapture([] {
    pthread_atfork(nullptr, nullptr, &ExitLikeAnOldForkGuard);
    // system() is posix_spawn in glibc: no fork handlers run.
    const int result = std::system("exit 3");
    std::fprintf(stderr, "system returned %d", result);
    return WIFEXITED(result) && WEXITSTATUS(result) == 3 ? 0 : 1;
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << text;
}

}  // namespace
}  // namespace ddp::transport::fork
