// The helpers that tests of the example binaries use to watch processes.

#include "examples/testing/subprocess.h"

#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

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

}  // namespace
}  // namespace ddp::examples::testing
