#ifndef DDP_TRANSPORT_LAUNCH_LAUNCH_TEST_UTIL_H_
#define DDP_TRANSPORT_LAUNCH_LAUNCH_TEST_UTIL_H_

// Helpers for tests that run launchers (ddprun, self-launching binaries) as
// child processes and check what they leave behind. Test-only.

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/launch/spawn.h"
#include "transport/status.h"

namespace ddp::transport::launch::testing {

/// Path of a runfile of this workspace, e.g. "transport/launch/test_worker".
std::string Runfile(const std::string& path);

/// A new, empty directory under TEST_TMPDIR (/tmp without it) for each call,
/// named `name` and a unique suffix ("name_AbC123"), so that no two callers,
/// runs or --gtest_repeat rounds share one. Aborts when it cannot be made.
std::string MakeTempDir(const std::string& name);

/// Starts `argv` (argv[0] is the program) as one process with output
/// captured (not echoed) and extra `env`; signals are not forwarded.
StatusOr<std::unique_ptr<WorkerGroup>> StartProgram(
    std::vector<std::string> argv, std::vector<std::pair<std::string, std::string>> env = {});

struct ProgramRun {
  int exit_code = -1;  ///< 128 + signal when killed; -1 when not reaped.
  std::string output;  ///< stdout and stderr, in arrival order.
  GroupResult group;
};

/// Waits for a program started by StartProgram (deadline `timeout`).
ProgramRun WaitProgram(WorkerGroup& group, std::chrono::milliseconds timeout);

/// StartProgram then WaitProgram.
ProgramRun RunProgram(std::vector<std::string> argv,
                      std::vector<std::pair<std::string, std::string>> env = {},
                      std::chrono::milliseconds timeout = std::chrono::seconds(30));

/// True when `pid` no longer runs (no such process, or a zombie).
bool ProcessGone(pid_t pid);
/// Waits up to `timeout` for ProcessGone(pid).
bool GoneWithin(pid_t pid, std::chrono::milliseconds timeout);

/// The parent of `pid` (from /proc/<pid>/stat); -1 when it is gone.
pid_t ParentPid(pid_t pid);

/// Reads a pid written to `path`, waiting up to `timeout` for the file; -1
/// when it does not appear.
pid_t ReadPidFile(const std::string& path, std::chrono::milliseconds timeout);

/// Number of lines of `text` that contain `needle`.
int CountLines(const std::string& text, const std::string& needle);

/// Whether `pid` has a handler for `signo` (SigCgt in /proc/<pid>/status);
/// false when it is gone.
bool CatchesSignal(pid_t pid, int signo);

/// Whether `parent` has a child process named `name` (the comm field of
/// /proc/<pid>/stat), a zombie included: "ddp-watcher" while a group of
/// workers exists.
bool HasChildNamed(pid_t parent, const std::string& name);

/// Polls `condition` every millisecond until it holds (true) or `timeout`
/// passes (false).
bool Within(std::chrono::milliseconds timeout, const std::function<bool()>& condition);

/// A launcher whose stderr is a pipe that was full when it started: its own
/// next line waits there (up to 2 s, see WriteLauncherLine) until the test
/// reads, which holds it at that point, e.g. between two attempts. Killed
/// (SIGKILL) and reaped when destroyed, unless Reap reaped it.
class HeldLauncher {
 public:
  /// Starts `argv` (argv[0] is the program's path) with stdout to the file
  /// `stdout_path`.
  static StatusOr<std::unique_ptr<HeldLauncher>> Start(std::vector<std::string> argv,
                                                       const std::string& stdout_path);
  ~HeldLauncher();
  HeldLauncher(const HeldLauncher&) = delete;
  HeldLauncher& operator=(const HeldLauncher&) = delete;

  pid_t pid() const { return pid_; }
  /// What it writes to stderr until that closes or `timeout` passes, without
  /// the filler the pipe held.
  std::string ReadStderr(std::chrono::milliseconds timeout);
  /// Its wait status once it ends, waiting up to `timeout`; -1 when it does
  /// not.
  int Reap(std::chrono::milliseconds timeout);
  /// Whether its main thread waits now for room in the full stderr pipe
  /// (poll for POLLOUT on that pipe alone): a line of its own is held
  /// there. Reads /proc/<pid>/syscall and /proc/<pid>/mem, which need
  /// ptrace access to it: FAILED_PRECONDITION naming the file and the reason
  /// where either cannot be read (Yama ptrace_scope 2 or 3, a launcher that
  /// is not dumpable, gVisor), or once its stderr was read to its end.
  StatusOr<bool> HeldAtStderr() const;
  /// Polls HeldAtStderr every millisecond: OK once it holds, its error at
  /// once, TIMED_OUT when `timeout` passes first.
  Status AwaitHeldAtStderr(std::chrono::milliseconds timeout) const;

 private:
  HeldLauncher(pid_t pid, int stderr_fd) : pid_(pid), stderr_fd_(stderr_fd) {}
  pid_t pid_;
  int stderr_fd_;  // the read end; -1 once read to its end
  bool reaped_ = false;
};

}  // namespace ddp::transport::launch::testing

#endif  // DDP_TRANSPORT_LAUNCH_LAUNCH_TEST_UTIL_H_
