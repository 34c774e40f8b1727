#ifndef DDP_TRANSPORT_FORK_FORK_GUARD_H_
#define DDP_TRANSPORT_FORK_FORK_GUARD_H_

// UCX (and ibverbs, CUDA) state is not usable in a child created by fork()
// after it was initialized: the child inherits mapped queues and locks held
// by threads that do not exist in it, and typically hangs. The guard turns
// that hang into an immediate, explained failure.
//
// posix_spawn (and system()/popen(), which glibc implements with it) does not
// run fork handlers, so spawning helper programs stays allowed.

namespace ddp::transport::fork {

/// Exit status of a child killed by the guard.
inline constexpr int kForkGuardExitCode = 86;

/// Installs a pthread_atfork child handler that prints why and _exit()s
/// with kForkGuardExitCode. Idempotent and thread-safe; cannot be removed.
void InstallForkGuard();

/// True once InstallForkGuard() ran in this process.
bool ForkGuardInstalled();

}  // namespace ddp::transport::fork

#endif  // DDP_TRANSPORT_FORK_FORK_GUARD_H_
