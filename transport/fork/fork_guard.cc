#include "transport/fork/fork_guard.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace ddp::transport::fork {
namespace {

std::atomic<bool> installed{false};

// Runs in the child right after fork(): only async-signal-safe calls.
void ChildHandler() {
  static const char kMessage[] =
      "ddp transport: fork() after the transport was initialized; the child "
      "cannot use UCX and would hang. Spawn workers (SelfLaunch, ddprun, "
      "posix_spawn) before creating a Communicator, and use threads rather "
      "than forked processes for data loading.\n";
  ssize_t unused = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
  (void)unused;
  _exit(kForkGuardExitCode);
}

}  // namespace

void InstallForkGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork(nullptr, nullptr, &ChildHandler);
    installed.store(true);
  });
}

bool ForkGuardInstalled() { return installed.load(); }

}  // namespace ddp::transport::fork
