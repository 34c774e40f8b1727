#include "transport/fork/fork_guard.h"

#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstdint>

#include <atomic>
#include <mutex>
#include <string>

namespace ddp::transport::fork {
namespace {

std::atomic<bool> installed{false};
std::atomic<bool> forked_child{false};
// The process that installed the guard, named in the error of its children.
std::atomic<pid_t> installer{0};
// The process this one was forked from (set in the child).
std::atomic<pid_t> parent{0};
// The installer's pid namespace (device and inode of /proc/self/ns/pid);
// 0 and 0 when /proc could not tell.
std::atomic<uint64_t> installer_ns_dev{0};
std::atomic<uint64_t> installer_ns_ino{0};

// A POSIX timer of the installer that never fires (SIGEV_NONE, first
// expiry centuries away) and carries a distinctive interval: a timer
// belongs to its process and is not inherited by any child (fork, or clone
// without CLONE_THREAD), so finding it is a cheap proof of being the
// installer or one of its threads, one system call where a look at /proc
// costs tens of microseconds. -1: none could be made.
std::atomic<int> installer_timer{-1};
// Whether the installer's parent was outside its pid namespace (getppid()
// 0) when it installed the guard, as a container's init's is: then a
// process with the installer's pid is told apart by the timer alone.
std::atomic<bool> installer_parent_outside{false};
constexpr time_t kTimerMarkSeconds = 2718;
constexpr long kTimerMarkNanoseconds = 281828459;

void MakeInstallerTimer() {
  sigevent event{};
  event.sigev_notify = SIGEV_NONE;
  int id = -1;
  if (syscall(SYS_timer_create, CLOCK_MONOTONIC, &event, &id) != 0) return;
  itimerspec mark{};
  mark.it_value.tv_sec = time_t{1} << 40;
  mark.it_interval.tv_sec = kTimerMarkSeconds;
  mark.it_interval.tv_nsec = kTimerMarkNanoseconds;
  if (syscall(SYS_timer_settime, id, 0, &mark, nullptr) != 0) {
    syscall(SYS_timer_delete, id);
    return;
  }
  installer_timer.store(id);
}

bool HasTheInstallersTimer(int id) {
  itimerspec found{};
  return syscall(SYS_timer_gettime, id, &found) == 0 && found.it_interval.tv_sec == kTimerMarkSeconds &&
         found.it_interval.tv_nsec == kTimerMarkNanoseconds;
}

// Whether this process is in the installer's pid namespace; true when
// either cannot be told (no /proc).
bool InTheInstallersPidNamespace() {
  if (installer_ns_ino.load(std::memory_order_relaxed) == 0) return true;
  struct stat ns{};
  if (stat("/proc/self/ns/pid", &ns) != 0) return true;
  return static_cast<uint64_t>(ns.st_dev) == installer_ns_dev.load(std::memory_order_relaxed) &&
         static_cast<uint64_t>(ns.st_ino) == installer_ns_ino.load(std::memory_order_relaxed);
}

static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<pid_t>::is_always_lock_free,
              "the fork handler may only make async-signal-safe stores");

// Runs in the child right after fork(): only async-signal-safe calls. It
// only marks the child, which may still exec a program; the transport's
// entry points check the mark.
void ChildHandler() {
  parent.store(getppid());  // async-signal-safe
  forked_child.store(true);
}

}  // namespace

void InstallForkGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    installer.store(getpid());
    if (struct stat ns{}; stat("/proc/self/ns/pid", &ns) == 0) {
      installer_ns_dev.store(static_cast<uint64_t>(ns.st_dev));
      installer_ns_ino.store(static_cast<uint64_t>(ns.st_ino));
    }
    MakeInstallerTimer();
    installer_parent_outside.store(getppid() == 0);
    pthread_atfork(nullptr, nullptr, &ChildHandler);
    installed.store(true);
  });
}

bool ForkGuardInstalled() { return installed.load(); }

bool InForkedChild() {
  if (forked_child.load(std::memory_order_relaxed)) return true;
  // Not every way of making a child runs the atfork handlers: glibc's
  // _Fork(), and a fork or clone system call made directly, copy the
  // process without them. Such a child still carries the installer's pid,
  // which is not its own. (getpid is a system call, not cached, since
  // glibc 2.25; a child of the installer never has the installer's pid.)
  const pid_t owner = installer.load(std::memory_order_relaxed);
  if (owner == 0) return false;
  const int timer = installer_timer.load(std::memory_order_relaxed);
  // A container's init would pay getpid, getppid and the timer's look on
  // each call (Work::Test's path); the timer alone tells it from any child,
  // one system call (fork_guard_bench, in a sandbox with slow system calls:
  // 2.8 to 3.3 us a call down to 1.7 to 2.1 us).
  if (timer >= 0 && installer_parent_outside.load(std::memory_order_relaxed)) return !HasTheInstallersTimer(timer);
  if (getpid() != owner) return true;
  // The same pid number: the installer, or a child cloned into a new pid
  // namespace (clone(CLONE_NEWPID), unshare), which is pid 1 there, as a
  // container's init that installed the guard is in its own. Such a child's
  // parent is outside its namespace (getppid() is 0), as the installer's
  // is when it is a container's init; only then is the installer's timer
  // looked for (the namespace compared through /proc without one).
  if (getppid() != 0) return false;
  if (timer >= 0) return !HasTheInstallersTimer(timer);
  return !InTheInstallersPidNamespace();
}

Status CheckNotForkedChild(std::string_view what) {
  if (!InForkedChild()) return Status::Ok();
  // A child that the handler did not mark has no parent recorded: its
  // parent is asked now (the same unless it already exited).
  const pid_t from = parent.load() != 0 ? parent.load() : getppid();
  // 0: the parent is outside this process's pid namespace, and so is the
  // installer (an ancestor), whose pid is a number of its own namespace.
  const std::string origin =
      from == 0 ? "was made from a process outside its pid namespace, after the transport was initialized in pid " +
                      std::to_string(installer.load()) + " of another namespace"
                : "was forked from pid " + std::to_string(from) +
                      (from == installer.load() ? std::string()
                                                : ", a descendant of pid " + std::to_string(installer.load())) +
                      ", after the transport was initialized there";
  return FailedPreconditionError(
      std::string(what) + ": this process (pid " + std::to_string(getpid()) + ") " + origin +
      "; a forked child cannot use UCX or the "
      "communicator (their queues, threads and shared memory belong to the parent). Spawn "
      "workers (SelfLaunch, ddprun, posix_spawn) before creating a Communicator, use threads "
      "rather than forked processes for data loading, or exec a new program in the child");
}

}  // namespace ddp::transport::fork
