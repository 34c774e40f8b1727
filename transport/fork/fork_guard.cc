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

bool InForkedChild() { return forked_child.load(std::memory_order_relaxed); }

Status CheckNotForkedChild(std::string_view what) {
  if (!InForkedChild()) return Status::Ok();
  return FailedPreconditionError(
      std::string(what) + ": this process (pid " + std::to_string(getpid()) +
      ") was forked from pid " + std::to_string(parent.load()) +
      (parent.load() == installer.load() ? std::string()
                                         : ", a descendant of pid " + std::to_string(installer.load())) +
      ", after the transport was initialized there; a forked child cannot use UCX or the "
      "communicator (their queues, threads and shared memory belong to the parent). Spawn "
      "workers (SelfLaunch, ddprun, posix_spawn) before creating a Communicator, use threads "
      "rather than forked processes for data loading, or exec a new program in the child");
}

}  // namespace ddp::transport::fork
