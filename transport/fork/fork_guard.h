#ifndef DDP_TRANSPORT_FORK_FORK_GUARD_H_
#define DDP_TRANSPORT_FORK_FORK_GUARD_H_

// UCX (and ibverbs, CUDA) state is not usable in a child created by fork()
// after it was initialized: the child inherits mapped queues, the parent's
// shared-memory segments and locks held by threads that do not exist in it,
// and typically hangs (or acts as the parent's rank towards its peers). The
// guard marks such a child, and the transport's entry points (creating or
// using a Communicator, creating a UCX context) fail there at once with
// CheckNotForkedChild's explanation.
//
// A child that never enters the transport is unaffected: fork() then exec
// (system() and popen() of glibc before 2.29, Python's subprocess up to 3.9,
// preexec_fn), or a forked worker that only computes. posix_spawn (glibc's
// system() and popen() since 2.29) runs no fork handlers at all.

#include <string_view>

#include "transport/status.h"

namespace ddp::transport::fork {

/// Installs a pthread_atfork child handler that marks every process later
/// forked from this one (and their own forks) as a forked child; the handler
/// only sets a flag, so fork() and exec stay allowed. Idempotent and
/// thread-safe; cannot be removed.
void InstallForkGuard();

/// True once InstallForkGuard() ran in this process (or in the process it
/// was forked from).
bool ForkGuardInstalled();

/// True in a process created by fork(), at any depth and not followed by
/// exec, from one where the guard was installed; also where the child was
/// made without the atfork handlers (glibc's _Fork(), a fork or clone
/// system call), told by its pid differing from the installer's, or, for a
/// child cloned into a new pid namespace with the installer's pid number
/// (pid 1 under an installer that is a namespace's init), by its lacking a
/// timer the installer made (timers are not inherited), or, without one,
/// by its pid namespace.
bool InForkedChild();

/// OK, except in a forked child: FAILED_PRECONDITION saying that `what`
/// cannot be done there, why, and what to do instead. Called where the
/// child would enter the transport.
Status CheckNotForkedChild(std::string_view what);

}  // namespace ddp::transport::fork

#endif  // DDP_TRANSPORT_FORK_FORK_GUARD_H_
