#include "transport/fork/fork_guard.h"

#include <pthread.h>
#include <unistd.h>

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
  return owner != 0 && getpid() != owner;
}

Status CheckNotForkedChild(std::string_view what) {
  if (!InForkedChild()) return Status::Ok();
  // A child that the handler did not mark has no parent recorded: its
  // parent is asked now (the same unless it already exited).
  const pid_t from = parent.load() != 0 ? parent.load() : getppid();
  return FailedPreconditionError(
      std::string(what) + ": this process (pid " + std::to_string(getpid()) +
      ") was forked from pid " + std::to_string(from) +
      (from == installer.load() ? std::string()
                                : ", a descendant of pid " + std::to_string(installer.load())) +
      ", after the transport was initialized there; a forked child cannot use UCX or the "
      "communicator (their queues, threads and shared memory belong to the parent). Spawn "
      "workers (SelfLaunch, ddprun, posix_spawn) before creating a Communicator, use threads "
      "rather than forked processes for data loading, or exec a new program in the child");
}

}  // namespace ddp::transport::fork
