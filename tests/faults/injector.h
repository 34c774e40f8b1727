#ifndef DDP_TESTS_FAULTS_INJECTOR_H_
#define DDP_TESTS_FAULTS_INJECTOR_H_

// Fault injection into an unmodified running process: stop it at the entry
// of a named function (a software breakpoint set through ptrace) and, right
// there, kill it, stop it, or make it exit with status 0. The program under
// test needs no hooks: "kill rank 1 during backward" is a breakpoint on
// ddp::nn::Backward in rank 1's process.
//
// Linux on x86-64 only. The caller must be allowed to ptrace the target
// (root) and must not be its parent: a tracer that is also the parent reaps
// the exit status it waits for, and its own wait would never see it (the
// ranks of a job are children of their launcher, which is what this is
// for). Every call, from attach to detach, happens on the calling thread
// (ptrace ties tracees to the thread that attached).

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "transport/status.h"

namespace ddp::faults {

/// What happens at the breakpoint.
enum class FaultAction : int {
  kKill = 0,      ///< SIGKILL: the process dies at once.
  kStop = 1,      ///< SIGSTOP: the process hangs there (alive, not running).
  kExitZero = 2,  ///< exit_group(0) from inside the function: a silent, clean exit.
};

/// "kill", "stop", "exit0".
const char* FaultActionName(FaultAction action);

/// A function's address in a running process.
struct FunctionAddress {
  std::string name;   ///< The demangled name that matched.
  uint64_t address;   ///< Run-time address of its first instruction.
};

/// Finds the function whose demangled name starts with `prefix` (for
/// example "ddp::nn::Backward(") in the executable of `pid`: its symbol
/// table, relocated by the load address. NOT_FOUND when no function
/// matches, INVALID_ARGUMENT naming the candidates when several do.
transport::StatusOr<FunctionAddress> FindFunction(pid_t pid, const std::string& prefix);

/// What an injection did.
struct Injection {
  FunctionAddress function;
  /// When the breakpoint was hit and the action taken.
  std::chrono::steady_clock::time_point at;
  pid_t thread = 0;  ///< The thread that hit it.
  int hits = 0;      ///< Times the breakpoint was reached, this one included.
};

/// Attaches to every thread of `pid`, sets a breakpoint at the function
/// named by `prefix` (see FindFunction), lets the process run until a thread
/// reaches it, then applies `action` and detaches. TIMED_OUT when no thread
/// reached it by `timeout` (the process is then left running, unharmed);
/// UNAVAILABLE when the process ended first. With `hit_number` > 1, the
/// action comes at the `hit_number`th time a thread reaches the function
/// (counted from the attach); the earlier calls run on (the breakpoint is
/// stepped over; while one thread steps over it, another may pass the
/// function uncounted).
transport::StatusOr<Injection> InjectAtFunction(pid_t pid, const std::string& prefix,
                                                FaultAction action,
                                                std::chrono::milliseconds timeout,
                                                int hit_number = 1);

}  // namespace ddp::faults

#endif  // DDP_TESTS_FAULTS_INJECTOR_H_
