#include "transport/testing/process_group.h"

#include <dlfcn.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <string>
#include <vector>
#include <thread>

// The last pid this process sent SIGKILL to, through kill() (stood in for
// here, and passed on).
std::atomic<pid_t> last_killed{0};

extern "C" int kill(pid_t pid, int signal) {
  using RealKill = int (*)(pid_t, int);
  static const RealKill real = reinterpret_cast<RealKill>(dlsym(RTLD_NEXT, "kill"));
  if (signal == SIGKILL) last_killed.store(pid);
  return real(pid, signal);
}

// While set, waitid(P_PIDFD, ...) fails with EINVAL, as on Linux 5.3
// (pidfd_open, but no waitid on a pidfd before 5.4); every other waitid is
// passed on.
std::atomic<bool> pidfd_waits_refused{false};

extern "C" int waitid(idtype_t type, id_t id, siginfo_t* info, int options) {
  if (pidfd_waits_refused.load() && static_cast<int>(type) == 3 /* P_PIDFD */) {
    errno = EINVAL;
    return -1;
  }
  return static_cast<int>(syscall(SYS_waitid, type, id, info, options, nullptr));
}

namespace ddp::transport::testing {
namespace {

using std::chrono::milliseconds;

// The workers: "exit" ends with 40 + RANK, "hang" sleeps far past any
// deadline below (Wait kills it; its own bound keeps a leak short).
int RunScenario(const std::string& name) {
  if (name == "exit") return 40 + std::stoi(EnvOr("RANK", "0"));
  if (name == "say") {
    std::printf("said %s\n", EnvOr("SAY").c_str());
    return 0;
  }
  if (name == "hang") {
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  return 2;
}

// Ignores SIGCHLD, so that the kernel reaps ended children and waitpid
// fails with ECHILD, until Restore() or destruction puts the previous
// disposition back (also when an ASSERT returns early).
class SigchldIgnored {
 public:
  SigchldIgnored() {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ok_ = sigaction(SIGCHLD, &ignore, &previous_) == 0;
  }
  ~SigchldIgnored() { Restore(); }
  SigchldIgnored(const SigchldIgnored&) = delete;
  SigchldIgnored& operator=(const SigchldIgnored&) = delete;

  bool ok() const { return ok_; }
  void Restore() {
    if (ok_) sigaction(SIGCHLD, &previous_, nullptr);
    ok_ = false;
  }

 private:
  struct sigaction previous_ {};
  bool ok_ = false;
};

TEST(ProcessGroup, WaitReturnsEveryWorkersExitCode) {
  auto group = ProcessGroup::Spawn(3, {}, {{"DDP_TEST_SCENARIO", "exit"}}, FreePort());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<WorkerResult> results = (*group)->Wait(DeadlineIn(milliseconds(30000)));
  ASSERT_EQ(results.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].exit_code, 40 + r) << DescribeResults(results);
    EXPECT_FALSE(results[r].timed_out) << "rank " << r;
  }
}

// On a kernel with pidfds but no waitid on them (5.3), the waits go by pid:
// before, every wait failed with EINVAL, Wait gave up on each worker
// ("waitpid failed: Invalid argument", exit code -1) and left it a zombie.
TEST(ProcessGroup, WaitsByPidWhereTheKernelCannotWaitOnAPidfd) {
  pidfd_waits_refused.store(true);
  struct Restore {
    ~Restore() { pidfd_waits_refused.store(false); }
  } restore;
  auto group = ProcessGroup::Spawn(2, {}, {{"DDP_TEST_SCENARIO", "exit"}}, FreePort());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<WorkerResult> results = (*group)->Wait(DeadlineIn(milliseconds(30000)));
  ASSERT_EQ(results.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].exit_code, 40 + r) << DescribeResults(results);
    EXPECT_FALSE(results[r].timed_out) << "rank " << r;
    siginfo_t info{};
    EXPECT_NE(waitid(P_PID, static_cast<id_t>((*group)->pid(r)), &info, WEXITED | WNOHANG), 0)
        << "rank " << r << " was left unreaped";
  }
}

TEST(ProcessGroup, WaitKillsAWorkerStillRunningAtItsDeadline) {
  auto group = ProcessGroup::Spawn(2, {}, {{"DDP_TEST_SCENARIO", "exit"}}, FreePort(),
                                   {{1, {{"DDP_TEST_SCENARIO", "hang"}}}});
  ASSERT_TRUE(group.ok()) << group.status();
  const auto start = Clock::now();
  const std::vector<WorkerResult> results = (*group)->Wait(DeadlineIn(milliseconds(500)));
  const auto took = Clock::now() - start;
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].exit_code, 40) << DescribeResults(results);
  EXPECT_FALSE(results[0].timed_out);
  EXPECT_TRUE(results[1].timed_out) << DescribeResults(results);
  EXPECT_EQ(results[1].signal, SIGKILL);
  // Well before the hanging worker's own 60 s.
  EXPECT_LT(took, milliseconds(20000));
}

// Two groups on one port (a second job aimed at the first one's store)
// keep their outputs apart: each result holds its own worker's words only.
TEST(ProcessGroup, TwoGroupsOnOnePortKeepTheirOutputsApart) {
  const int port = FreePort();
  auto first = ProcessGroup::Spawn(1, {}, {{"DDP_TEST_SCENARIO", "say"}, {"SAY", "alpha"}}, port);
  auto second = ProcessGroup::Spawn(1, {}, {{"DDP_TEST_SCENARIO", "say"}, {"SAY", "beta"}}, port);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  const std::vector<WorkerResult> a = (*first)->Wait(DeadlineIn(milliseconds(30000)));
  const std::vector<WorkerResult> b = (*second)->Wait(DeadlineIn(milliseconds(30000)));
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_NE(a[0].output.find("said alpha"), std::string::npos) << DescribeResults(a);
  EXPECT_EQ(a[0].output.find("said beta"), std::string::npos) << DescribeResults(a);
  EXPECT_NE(b[0].output.find("said beta"), std::string::npos) << DescribeResults(b);
  EXPECT_EQ(b[0].output.find("said alpha"), std::string::npos) << DescribeResults(b);
}

// A worker the harness cannot wait for (SIGCHLD ignored: the kernel reaps
// it, and waitpid fails with ECHILD) is no success: its exit code stays
// unknown, -1, and its output says why (a status never filled in read as
// exit 0, so a crashed worker could pass).
TEST(ProcessGroup, AWorkerThatCannotBeWaitedForIsNoSuccess) {
  SigchldIgnored ignored;
  ASSERT_TRUE(ignored.ok()) << "sigaction(SIGCHLD) failed";
  auto group = ProcessGroup::Spawn(1, {}, {{"DDP_TEST_SCENARIO", "exit"}}, FreePort());
  std::vector<WorkerResult> results;
  if (group.ok()) results = (*group)->Wait(DeadlineIn(milliseconds(30000)));
  ignored.Restore();
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].exit_code, -1) << DescribeResults(results);
  EXPECT_FALSE(results[0].timed_out);
  // "waitpid failed", or, where it ended before Spawn took its pidfd, that.
  EXPECT_NE(results[0].output.find("[harness] "), std::string::npos) << DescribeResults(results);
}

// WaitForOutput sees a worker that ended without printing the text even
// when the kernel reaped it (SIGCHLD ignored): false at once, not at the
// deadline.
TEST(ProcessGroup, WaitForOutputSeesAWorkerReapedByTheKernelEnd) {
  SigchldIgnored ignored;
  ASSERT_TRUE(ignored.ok()) << "sigaction(SIGCHLD) failed";
  auto group = ProcessGroup::Spawn(1, {}, {{"DDP_TEST_SCENARIO", "exit"}}, FreePort());
  const auto start = Clock::now();
  bool printed = true;
  if (group.ok()) printed = (*group)->WaitForOutput("never printed", DeadlineIn(milliseconds(30000)));
  const auto took = Clock::now() - start;
  // Marks it reaped while SIGCHLD is still ignored, so that the destructor
  // does not signal its pid, which another process may have by then.
  if (group.ok()) (*group)->Wait(DeadlineIn(milliseconds(30000)));
  ignored.Restore();
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_FALSE(printed);
  // The worker exits within milliseconds; the deadline is 30 s away.
  EXPECT_LT(took, milliseconds(15000));
}

// A group destroyed after the kernel reaped its worker (SIGCHLD ignored)
// does not signal the worker's pid, which may be another process's by then.
TEST(ProcessGroup, ADestroyedGroupDoesNotSignalAWorkerTheKernelReaped) {
  SigchldIgnored ignored;
  ASSERT_TRUE(ignored.ok()) << "sigaction(SIGCHLD) failed";
  pid_t worker = 0;
  {
    auto group = ProcessGroup::Spawn(1, {}, {{"DDP_TEST_SCENARIO", "exit"}}, FreePort());
    if (group.ok()) {
      worker = (*group)->pid(0);
      // Returns once the worker is gone (see the test above).
      (*group)->WaitForOutput("never printed", DeadlineIn(milliseconds(30000)));
      last_killed.store(0);
      (*group)->Kill(0, SIGKILL);
    }
  }  // the destructor
  ignored.Restore();
  ASSERT_NE(worker, 0);
  EXPECT_NE(last_killed.load(), worker);
}

// In a pid namespace of its own (pid 1 there): a worker the kernel reaped
// (SIGCHLD ignored) has its number handed to a stand-in child, through
// ns_last_pid; Kill and the destructor must leave the stand-in alone. The
// stand-in's exit code, or 10 + a step that failed; 0 when it survived.
int KillAfterPidReuse() {
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  if (sigaction(SIGCHLD, &ignore, nullptr) != 0) return 10;
  auto group = ProcessGroup::Spawn(1, {}, {{"DDP_TEST_SCENARIO", "exit"}}, 0);
  if (!group.ok()) return 11;
  const pid_t worker = (*group)->pid(0);
  // Returns once the worker is gone (see WaitForOutputSeesAWorkerReapedByTheKernelEnd).
  (*group)->WaitForOutput("never printed", DeadlineIn(milliseconds(30000)));
  if (kill(worker, 0) == 0 || errno != ESRCH) return 12;
  // The kernel frees the number a little after kill() stops finding the
  // worker (since Linux 6.15, after it drops tasklist_lock, so a preempted
  // exit holds it for a while): a stand-in that got another number is
  // ended, and the fork is tried again, for up to 10 s.
  pid_t stand_in = -1;
  int stand_in_fd = -1;
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (true) {
    FILE* last = std::fopen("/proc/sys/kernel/ns_last_pid", "w");
    if (last == nullptr) return 13;
    std::fprintf(last, "%d", worker - 1);
    if (std::fclose(last) != 0) return 14;
    stand_in = fork();
    if (stand_in == 0) {
      std::this_thread::sleep_for(std::chrono::seconds(30));
      _exit(0);
    }
    if (stand_in < 0) return 15;
    stand_in_fd = static_cast<int>(syscall(SYS_pidfd_open, stand_in, 0));
    if (stand_in_fd < 0) return 16;
    if (stand_in == worker) break;
    syscall(SYS_pidfd_send_signal, stand_in_fd, SIGKILL, nullptr, 0);
    close(stand_in_fd);
    if (Clock::now() >= give_up) return 17;
    std::this_thread::sleep_for(milliseconds(20));
  }
  (*group)->Kill(0, SIGKILL);
  group->reset();  // the destructor
  // A SIGKILL sent to it would end it within milliseconds.
  pollfd ended{stand_in_fd, POLLIN, 0};
  const bool killed = poll(&ended, 1, 1000) == 1;
  syscall(SYS_pidfd_send_signal, stand_in_fd, SIGKILL, nullptr, 0);
  return killed ? 1 : 0;
}

// Kill and the destructor reach the worker only, never a process that got
// its number after the kernel reaped it (a kill(pid) after a check that
// the pid was still a child could, between the two).
TEST(ProcessGroup, KillDoesNotSignalAProcessThatGotAReapedWorkersNumber) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // A user namespace makes this work without root; as root the pid
    // namespace alone will do where user namespaces are turned off.
    if (unshare(CLONE_NEWUSER | CLONE_NEWPID) != 0 && unshare(CLONE_NEWPID) != 0) _exit(20);
    const pid_t init = fork();
    if (init < 0) _exit(21);
    if (init == 0) _exit(KillAfterPidReuse());
    int status = 0;
    if (waitpid(init, &status, 0) != init) _exit(22);
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 23);
  }
  const int child_fd = static_cast<int>(syscall(SYS_pidfd_open, child, 0));
  pollfd ended{child_fd, POLLIN, 0};
  if (child_fd < 0 || poll(&ended, 1, 60000) != 1) kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  if (child_fd >= 0) close(child_fd);
  ASSERT_TRUE(WIFEXITED(status)) << "the namespace's child ended by signal " << WTERMSIG(status);
  EXPECT_NE(WEXITSTATUS(status), 20) << "no pid namespace could be made (unshare)";
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "1: the process that got the reaped worker's number was killed; 1x/2x: a step failed";
}

}  // namespace
}  // namespace ddp::transport::testing

int main(int argc, char** argv) {
  return ddp::transport::testing::WorkerOrTestsMain(argc, argv,
                                                    ddp::transport::testing::RunScenario);
}
