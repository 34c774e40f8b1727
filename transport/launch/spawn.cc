#include "transport/launch/spawn.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "transport/launch/error_file.h"
#include "transport/pipe_write.h"

extern char** environ;

namespace ddp::transport::launch {
namespace {

constexpr size_t kReadChunk = 64 * 1024;
// A line longer than this is written out in pieces.
constexpr size_t kMaxLineBytes = 64 * 1024;
// How long output may keep flowing after the last worker exited (a worker's
// child could hold the pipe open forever).
constexpr auto kDrainTime = std::chrono::milliseconds(1000);
// The most of a worker's error message that goes into a reason line.
constexpr size_t kMaxReportedError = 400;
// How long Wait and the destructor wait for SIGKILLed workers to be reaped.
constexpr auto kReapTime = std::chrono::milliseconds(5000);
// Poll period when the kernel has no pidfd_open (before Linux 5.3).
constexpr int kFallbackPollMs = 20;
// How long a write of worker output to the launcher's own stdout or stderr
// may make no progress before the output is dropped (see Terminal).
constexpr auto kTerminalStallTime = std::chrono::milliseconds(2000);
// Longest single wait of the monitor loop. Every event wakes it at once; the
// bound only matters when a signal handler's run is deferred (ThreadSanitizer
// delays handlers on threads that are not in a system call).
constexpr int kMaxPollMs = 1000;
// How long Wait waits for the terminal listener's answer (see
// StartListener), which it gives at once unless it is stopped.
constexpr auto kListenerAnswerTime = std::chrono::milliseconds(1000);
// How long a stop as a job waits for every worker to be stopped (one in
// uninterruptible sleep may take long) before it takes the terminal back.
constexpr auto kStopTime = std::chrono::milliseconds(1000);

std::string ErrnoText(int err) {
  char buf[256];
  return strerror_r(err, buf, sizeof(buf));
}

// Whether `err` says the machine or this process ran out of something
// (descriptors, processes, memory, disk) rather than that the input was
// wrong: such a start may succeed later, and a launcher must not report it
// as bad input.
bool OutOfResources(int err) {
  return err == EMFILE || err == ENFILE || err == EAGAIN || err == ENOMEM || err == ENOSPC || err == EDQUOT;
}

// INVALID_ARGUMENT for what the caller got wrong, RESOURCE_EXHAUSTED when
// `err` is a shortage (OutOfResources).
Status StartError(int err, std::string text) {
  return OutOfResources(err) ? ResourceExhaustedError(std::move(text)) : InvalidArgumentError(std::move(text));
}

// ": this process may open N descriptors (ulimit -n, at most M)", for a
// start that ran out of them (EMFILE); "" when there is no limit.
std::string DescriptorLimitText() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return "";
  std::string text = ": this process may open " + std::to_string(limit.rlim_cur) + " descriptors (ulimit -n";
  if (limit.rlim_max != RLIM_INFINITY) text += ", at most " + std::to_string(limit.rlim_max);
  return text + ")";
}

// A system call that sets up the group failed with `err`: RESOURCE_EXHAUSTED
// when something ran out (OutOfResources; the same start may succeed
// later), with the descriptor limit when it was that; INTERNAL otherwise.
Status SetupError(int err, std::string text) {
  if (err == EMFILE) text += DescriptorLimitText();
  return OutOfResources(err) ? ResourceExhaustedError(std::move(text)) : InternalError(std::move(text));
}

int MillisecondsUntil(Deadline deadline) {
  const auto now = Clock::now();
  if (deadline <= now) return 0;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
  return static_cast<int>(std::min<int64_t>(left, INT_MAX));
}

// ---- signal forwarding ----

std::atomic<int> g_signal_write_fd{-1};
std::atomic<bool> g_forwarding{false};
// The first forwarded signal this process received (0: none); see
// InterruptSignal. Never cleared: a launcher that was told to stop stays told.
std::atomic<int> g_interrupt_signal{0};
// A signal caught while no group forwarded (CatchInterrupts) that no group
// has seen yet: the next group starts with it (0: none). A launcher checks
// InterruptSignal() before it starts its workers, but one that comes just
// after that look would otherwise reach no worker.
std::atomic<int> g_unforwarded_signal{0};
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
// Passed on to the workers while a group forwards signals, without stopping
// them or the launcher: Slurm's `--signal=USR1@T`, a checkpoint hook. (By
// their default action they would end the launcher, and its workers with
// it.)
constexpr int kPassedOnSignals[] = {SIGUSR1, SIGUSR2};
// Of kPassedOnSignals, those caught that no running worker got yet, as
// bits (PassedOnBit): one that came while the workers were stopping, or
// after Wait's end and before the group was gone, is held for the next
// group that forwards signals, which takes it over when it starts.
std::atomic<int> g_held_passed_on{0};
// Reads of a worker's /proc/<pid>/status for its signal handlers
// (TakesSignal); SignalHandlerLooksForTesting.
std::atomic<int64_t> g_signal_handler_looks{0};
// A held signal's handlers are looked at no more often than this.
constexpr auto kHeldSignalLookEvery = std::chrono::seconds(1);

int PassedOnBit(int signo) { return signo == SIGUSR1 ? 1 : signo == SIGUSR2 ? 2 : 0; }

// Tells the forwarding group's loop of `signo` (async-signal-safe).
void WriteSignalByte(int fd, int signo) {
  const unsigned char byte = static_cast<unsigned char>(signo);
  ssize_t n = write(fd, &byte, 1);
  (void)n;
}

void RecordSignal(int signo) {
  const int saved_errno = errno;
  int none = 0;
  g_interrupt_signal.compare_exchange_strong(none, signo, std::memory_order_relaxed);
  const int fd = g_signal_write_fd.load(std::memory_order_relaxed);
  if (fd >= 0) {
    WriteSignalByte(fd, signo);
  } else {
    g_unforwarded_signal.store(signo, std::memory_order_relaxed);
  }
  errno = saved_errno;
}

// The handler of kPassedOnSignals: holds it (g_held_passed_on) and tells
// the forwarding group's loop (async-signal-safe).
void PassOnSignal(int signo) {
  const int saved_errno = errno;
  // Held until a running worker gets it (the forwarding loop clears it).
  g_held_passed_on.fetch_or(PassedOnBit(signo), std::memory_order_relaxed);
  const int fd = g_signal_write_fd.load(std::memory_order_relaxed);
  if (fd >= 0) WriteSignalByte(fd, signo);
  errno = saved_errno;
}

bool IsPassedOn(int signo) {
  return std::find(std::begin(kPassedOnSignals), std::end(kPassedOnSignals), signo) != std::end(kPassedOnSignals);
}

}  // namespace

void CatchInterrupts(bool catch_them) {
  // Whatever was caught before is the caller's to act on, not a later
  // group's.
  if (!catch_them) g_unforwarded_signal.store(0, std::memory_order_relaxed);
  for (int signo : kForwardedSignals) {
    struct sigaction current{};
    if (sigaction(signo, nullptr, &current) != 0 || current.sa_handler == SIG_IGN) continue;
    struct sigaction action{};
    action.sa_handler = catch_them ? RecordSignal : SIG_DFL;
    sigemptyset(&action.sa_mask);
    // SA_RESETHAND: a second signal ends the process, as it would have.
    action.sa_flags = catch_them ? SA_RESTART | SA_RESETHAND : 0;
    sigaction(signo, &action, nullptr);
  }
  // SIGUSR1 and SIGUSR2 (a checkpoint request) between two groups: held
  // for the next group's workers (PassOnSignal) rather than ending this
  // process by their default action, and the workers with it.
  if (!catch_them) g_held_passed_on.store(0, std::memory_order_relaxed);
  for (int signo : kPassedOnSignals) {
    struct sigaction current{};
    if (sigaction(signo, nullptr, &current) != 0 || current.sa_handler == SIG_IGN) continue;
    struct sigaction action{};
    action.sa_handler = catch_them ? PassOnSignal : SIG_DFL;
    sigemptyset(&action.sa_mask);
    action.sa_flags = catch_them ? SA_RESTART : 0;
    sigaction(signo, &action, nullptr);
  }
}

namespace {

// ---- the child side of vfork ----

// Everything the child needs, prepared by the parent: between vfork and exec
// the child runs on the parent's memory and stack and may only make raw
// system calls (no allocation, no locks, no libc state, no sanitizer
// interceptors). Under ThreadSanitizer the child is a copy (see StartOne);
// the same code is correct there too.
struct ChildArgs {
  const char* path = nullptr;
  char* const* argv = nullptr;
  char* const* envp = nullptr;
  pid_t pgid = 0;          // 0: lead a new process group
  pid_t parent = 0;
  int stdin_fd = -1;       // -1: inherit
  int stdout_fd = -1;
  int stderr_fd = -1;
  int report_fd = -1;      // close-on-exec pipe: a failed step is written here
  sigset_t mask{};         // set just before exec: the launcher's, SIGPIPE unblocked
  sigset_t sigpipe_only{};  // SIGPIPE alone, for discarding one raised here
  // Without close_range's CLOSE_RANGE_CLOEXEC (before Linux 5.11), every
  // descriptor from 3 below this is marked close-on-exec one by one.
  int fd_bound = 0;
  bool skip_close_range = false;  // ForceCloseRangeFallbackForTesting
  // The first worker of a group that shares the terminal (stdin, fd 0)
  // makes its group (new, or the listener's) the terminal's foreground
  // group.
  bool take_terminal = false;
  // The first worker of a group it leads (pgid 0) writes its pid, the
  // group's id, here: the write end of the watcher's pipe (see
  // StartWatcher). -1: not this worker.
  int watcher_fd = -1;
  bool ignored[_NSIG] = {};  // signals the parent ignores; they stay ignored
};

// What the child writes to report_fd when a step fails.
struct ChildFailure {
  int step = 0;  // a ChildStep
  int error = 0;
};
enum ChildStep : int { kStepSetpgid = 1, kStepDup = 2, kStepExec = 3 };

// Why exec of `program` (a file that is there: the launcher checked) failed
// with `err`, where errno alone misleads: ENOENT for a script whose #!
// interpreter is missing ("#!/usr/bin/python" on a host with python3 only),
// ENOEXEC for a file that is neither a binary nor a #! script.
std::string ExecFailureHint(const std::string& program, int err) {
  if (err != ENOENT && err != ENOEXEC) return "";
  const int fd = open(program.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    // "python": a name, taken as a file in the current folder.
    if (err == ENOENT && program.find('/') == std::string::npos) {
      return " (a program's name is not looked up in PATH; give its path, or resolve it with ResolveProgram)";
    }
    return "";
  }
  char head[256];
  ssize_t n;
  do {
    n = read(fd, head, sizeof(head));
  } while (n < 0 && errno == EINTR);
  close(fd);
  if (n <= 0) return err == ENOEXEC ? " (it is empty)" : "";
  const std::string_view text(head, static_cast<size_t>(n));
  if (text.substr(0, 2) == "#!") {
    std::string_view line = text.substr(2, text.find('\n') == std::string_view::npos ? std::string_view::npos
                                                                                   : text.find('\n') - 2);
    const size_t start = line.find_first_not_of(" \t");
    if (start == std::string_view::npos) return " (its #! line names no interpreter)";
    line = line.substr(start);
    const std::string interpreter(line.substr(0, line.find_first_of(" \t\r")));
    if (err == ENOENT) {
      return " (the interpreter '" + interpreter + "' named on its #! line does not exist)";
    }
    return " (its #! interpreter '" + interpreter + "' cannot be run)";
  }
  if (err == ENOEXEC) return " (it is neither a binary for this machine nor a script starting with #!)";
  return "";
}

// What the exec watch saw on a child's report pipe: the child's pid, then
// a ChildFailure if a step failed; `timed_out` when the exec had not
// finished by the deadline and the child was killed.
struct ExecWatchResult {
  std::string bytes;
  bool timed_out = false;
};

// Runs on a thread of its own while the spawning thread is held in vfork
// (which returns only once the child has exec'd or died): reads the report
// pipe `fd` until end-of-file (the child exec'd or died, and the parent
// closed its write end), until `done` (an eventfd; -1: none) is readable
// (vfork returned: what the child wrote is in the pipe, whoever else holds
// a copy of its write end, such as a child another thread forked
// meanwhile), or until `deadline`, when it kills the child (SIGKILL), which
// lets vfork return. The pid is the child's first word; it is this
// process's unreaped child while the parent waits in vfork, so the pid
// names no one else. A child that has not even written its pid by then
// (stopped before its first step) gets as long again to do so.
ExecWatchResult WatchExec(int fd, int done, Deadline deadline, std::chrono::milliseconds timeout) {
  ExecWatchResult result;
  Deadline until = deadline;
  bool extended = false;
  bool draining = false;  // vfork returned: take what is there, and end
  while (true) {
    pollfd p[2] = {{fd, POLLIN, 0}, {done, POLLIN, 0}};
    const int ready = poll(p, draining || done < 0 ? 1 : 2, draining ? 0 : MillisecondsUntil(until));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return result;  // cannot watch: vfork's own wait stands
    if (draining && (p[0].revents & (POLLIN | POLLHUP)) == 0) return result;
    if (!draining && (p[1].revents & POLLIN) != 0) {
      draining = true;
      continue;
    }
    // poll's timeout is clamped to INT_MAX ms (MillisecondsUntil): a
    // longer exec_timeout (milliseconds::max(): none) is not over yet.
    if (ready == 0 && Clock::now() < until) continue;
    if (ready == 0) {
      if (result.bytes.size() >= sizeof(pid_t)) {
        pid_t pid = 0;
        std::memcpy(&pid, result.bytes.data(), sizeof(pid));
        if (pid > 0) kill(pid, SIGKILL);
        result.timed_out = true;
        return result;
      }
      if (extended) return result;
      extended = true;
      until = DeadlineIn(timeout);
      continue;
    }
    char buffer[64];
    const ssize_t got = read(fd, buffer, sizeof(buffer));
    if (got > 0) {
      result.bytes.append(buffer, static_cast<size_t>(got));
    } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
      return result;
    }
  }
}

const char* ChildStepName(int step) {
  switch (step) {
    case kStepSetpgid: return "setpgid";
    case kStepDup: return "dup3";
    case kStepExec: return "exec";
  }
  return "start";
}

[[noreturn]] __attribute__((noinline, no_sanitize("address", "thread", "undefined"))) void
ChildFail(const ChildArgs* a, int step) {
  ChildFailure failure;
  failure.step = step;
  failure.error = errno;
  syscall(SYS_write, a->report_fd, &failure, sizeof(failure));
  syscall(SYS_exit_group, 127);
  __builtin_unreachable();
}

[[noreturn]] __attribute__((noinline, no_sanitize("address", "thread", "undefined"))) void
RunChild(const ChildArgs* a) {
  // First, before any step that could wait: the parent's exec watch (see
  // WatchExec) learns whom to kill should the exec not finish in time.
  const pid_t self = static_cast<pid_t>(syscall(SYS_getpid));
  syscall(SYS_write, a->report_fd, &self, sizeof(self));
  // The parent's handlers live in memory the child shares until exec; reset
  // every signal the parent does not ignore so none of them runs here.
  // (SIGKILL and SIGSTOP fail, harmlessly.) A zeroed kernel sigaction is
  // SIG_DFL with no flags on every layout.
  unsigned long default_action[8] = {};
  for (int s = 1; s < _NSIG; ++s) {
    if (!a->ignored[s] || s == SIGPIPE || s == SIGCHLD) {
      syscall(SYS_rt_sigaction, s, default_action, nullptr, _NSIG / 8);
    }
  }
  if (syscall(SYS_setpgid, 0, a->pgid) != 0) ChildFail(a, kStepSetpgid);
  // Die with the launcher; if it already died, do not run at all.
  syscall(SYS_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
  if (syscall(SYS_getppid) != a->parent) syscall(SYS_exit_group, 127);
  // From here on it either dies with the launcher (its death signal) or
  // has told the watcher its group before it can start a child: a
  // launcher killed at any point leaves no child of the workers running.
  if (a->watcher_fd >= 0) {
    const pid_t group = static_cast<pid_t>(syscall(SYS_getpid));
    // (A watcher someone killed cannot be told; the worker runs without
    // it, as it would had the watcher been killed a moment later.) The
    // write to its reader-less pipe raised SIGPIPE, blocked here: taken
    // off again, or it would kill the child at the mask's restore (SIGPIPE
    // is at its default) or greet the program pending after its exec.
    if (syscall(SYS_write, a->watcher_fd, &group, sizeof(group)) < 0) {
      const timespec now{0, 0};
      syscall(SYS_rt_sigtimedwait, &a->sigpipe_only, nullptr, &now, _NSIG / 8);
    }
  }
  const int sources[3] = {a->stdin_fd, a->stdout_fd, a->stderr_fd};
  for (int target = 0; target < 3; ++target) {
    if (sources[target] >= 0 && syscall(SYS_dup3, sources[target], target, 0) < 0) {
      ChildFail(a, kStepDup);
    }
  }
  // Every signal is blocked here (StartOne), SIGTTOU too, which lets a
  // background group take the terminal. Before exec: no worker may read the
  // terminal while it is not yet theirs. A failure (the terminal changed
  // hands meanwhile) leaves it where it is; the parent checks.
  if (a->take_terminal) {
    const pid_t group = a->pgid != 0 ? a->pgid : static_cast<pid_t>(syscall(SYS_getpid));
    syscall(SYS_ioctl, 0, TIOCSPGRP, &group);
  }
  // Descriptors the host program opened without O_CLOEXEC stay out of the
  // workers. CLOSE_RANGE_CLOEXEC needs Linux 5.11 (ENOSYS before 5.9, EINVAL
  // for the flag on 5.9 and 5.10); there, one fcntl per descriptor up to the
  // bound the parent found. Marked, not closed: report_fd must stay open
  // until exec succeeds.
  if (a->skip_close_range ||
      syscall(SYS_close_range, 3, ~0u, 4 /* CLOSE_RANGE_CLOEXEC */) != 0) {
    for (int fd = 3; fd < a->fd_bound; ++fd) syscall(SYS_fcntl, fd, F_SETFD, FD_CLOEXEC);
  }
  syscall(SYS_rt_sigprocmask, SIG_SETMASK, &a->mask, nullptr, _NSIG / 8);
  syscall(SYS_execve, a->path, a->argv, a->envp);
  ChildFail(a, kStepExec);
}

// ---- helpers ----

std::atomic<bool> g_force_close_range_fallback{false};
// SetForwardingEndStepForTesting.
std::mutex g_forwarding_end_step_mu;
std::function<void()> g_forwarding_end_step;
std::atomic<int64_t> g_pause_after_first_worker_ms{0};  // PauseAfterFirstWorkerForTesting
// SetBeforeFirstWorkerStepForTesting.
std::mutex g_before_first_worker_step_mu;
std::function<void(pid_t)> g_before_first_worker_step;

// The most descriptors the fallbacks of close_range go through.
constexpr int kMostDescriptors = 1 << 20;

// One above the highest descriptor a child may inherit, for the fallbacks
// of close_range (which must not allocate or read /proc in the child): the
// highest open now (/proc/self/fd), with room for a few that other threads
// open before the clone (each takes the lowest free number); without /proc,
// the soft limit on descriptors (at most 2^20). Enough for the workers,
// which only mark descriptors close-on-exec: it has to cover those the host
// program opened without O_CLOEXEC, which are open by now, while what other
// threads of the launcher open meanwhile (the store server's accepted
// connections, the watcher thread's client) is close-on-exec already
// (SOCK_CLOEXEC, O_CLOEXEC). Not for the watcher, which closes everything
// and runs on without exec: it reads the soft limit itself (WatcherBound).
int DescriptorBound() {
  constexpr int kMost = kMostDescriptors;
  constexpr int kRoom = 64;
  int highest = -1;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (const dirent* entry = readdir(dir)) {
      if (entry->d_name[0] >= '0' && entry->d_name[0] <= '9') highest = std::max(highest, std::atoi(entry->d_name));
    }
    closedir(dir);
    if (highest >= 0) return std::min(highest + 1 + kRoom, kMost);
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return kMost;
  return static_cast<int>(std::min<rlim_t>(limit.rlim_cur, kMost));
}

// In the watcher, right after the clone (raw system calls only): one above
// every descriptor it can hold, which are those the launcher had at the
// clone. Every descriptor opened is below the soft limit of its time, so
// the soft limit now (at most kMostDescriptors) covers those other threads
// opened after DescriptorBound looked; `parent_bound` (DescriptorBound)
// covers any left above a limit lowered since. Not instrumented, as
// RunChild, and for the same reason: it runs in a raw clone's child.
__attribute__((noinline, no_sanitize("address", "thread", "undefined"))) int WatcherBound(int parent_bound) {
  rlimit limit{};
  if (syscall(SYS_prlimit64, 0, RLIMIT_NOFILE, nullptr, &limit) != 0 ||
      limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur > rlim_t{kMostDescriptors}) {
    return kMostDescriptors;
  }
  const int soft = static_cast<int>(limit.rlim_cur);
  return soft > parent_bound ? soft : parent_bound;
}

// In a child of a raw clone (the watcher, the terminal listener): closes
// every descriptor but `keep`, so that the child does not hold the
// launcher's sockets, files or pipes open after the launcher closed them.
// close_range needs Linux 5.9 (`skip_close_range` forces the fallback in
// tests); before, one close per descriptor up to WatcherBound. Not
// instrumented, as RunChild: the sanitizers' hooks may take a lock that
// another thread of the launcher held at the clone, which in the child
// nobody ever releases.
__attribute__((noinline, no_sanitize("address", "thread", "undefined"))) void CloseAllBut(int keep,
                                                                                          bool skip_close_range,
                                                                                          int parent_bound) {
  const unsigned fd = static_cast<unsigned>(keep);
  const bool closed = !skip_close_range && (fd == 0 || syscall(SYS_close_range, 0u, fd - 1, 0u) == 0) &&
                      syscall(SYS_close_range, fd + 1, ~0u, 0u) == 0;
  if (closed) return;
  const int bound = WatcherBound(parent_bound);
  for (int other = 0; other < bound; ++other) {
    if (other != keep) syscall(SYS_close, other);
  }
}

// Everything the watcher (WorkerGroup::Impl::StartWatcher) needs, prepared
// before the clone.
struct WatcherArgs {
  int read_fd = -1;        // its pipe's read end
  pid_t group = 0;         // the workers' group; 0: the first worker tells
  pid_t launcher_group = 0;  // share_terminal: the group to give the terminal back to
  int fd_bound = 0;        // DescriptorBound(), for CloseAllBut
  bool skip_close_range = false;
  // The group's folder of error files (SpawnOptions::error_files), which
  // the launcher removes when it ends the group; "": none (or a path too
  // long to hold here).
  char error_dir[PATH_MAX] = {};
};

// In the watcher, for a launcher that died without removing it: removes
// the group's folder of error files and what is in it, as the launcher's
// RemoveErrorDir does (entries unlinked, never followed). A worker killed
// just before may still have been finishing a write: a few tries, 10 ms
// apart. Raw system calls only, not instrumented (see CloseAllBut).
__attribute__((noinline, no_sanitize("address", "thread", "undefined"))) void RemoveErrorDirInWatcher(
    const char* path) {
  // The kernel's record for getdents64 (glibc declares none for the raw call).
  struct Entry {
    uint64_t ino;
    int64_t off;
    unsigned short reclen;
    unsigned char type;
    char name[1];
  };
  for (int attempt = 0; attempt < 5; ++attempt) {
    const long dir = syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dir < 0) return;  // gone, or never there
    alignas(8) char buffer[4096];
    long n;
    while ((n = syscall(SYS_getdents64, dir, buffer, sizeof(buffer))) > 0) {
      for (long at = 0; at < n;) {
        const Entry* entry = reinterpret_cast<const Entry*>(buffer + at);
        at += entry->reclen;
        const char* name = entry->name;
        if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0'))) continue;
        syscall(SYS_unlinkat, dir, name, 0);
      }
    }
    syscall(SYS_close, dir);
    if (syscall(SYS_unlinkat, AT_FDCWD, path, AT_REMOVEDIR) == 0 || errno != ENOTEMPTY) return;
    const timespec pause{0, 10 * 1000 * 1000};
    syscall(SYS_nanosleep, &pause, nullptr);
  }
}

// The watcher's whole life, in the child of a raw clone: raw system calls
// only, and not instrumented (see CloseAllBut). The pipe carries pid_t
// values: a group id (from the first worker, which leads the group), or 0
// from the launcher, which ended the group itself. On end-of-file it kills
// the group it knows.
[[noreturn]] __attribute__((noinline, no_sanitize("address", "thread", "undefined"))) void
RunWatcher(const WatcherArgs* a) {
  // Named for ps and top, which would show a second launcher.
  syscall(SYS_prctl, PR_SET_NAME, "ddp-watcher", 0, 0, 0);
  // A group of its own: whoever kills the launcher's group (a supervisor
  // that ends a dead launcher's group, `kill -9 -PGID`) must not take the
  // watcher along before it has killed the workers'.
  syscall(SYS_setpgid, 0, 0);
  CloseAllBut(a->read_fd, a->skip_close_range, a->fd_bound);  // all but the pipe's read end
  pid_t group = a->group;
  pid_t message = 0;
  size_t have = 0;  // bytes of `message` read so far (each write is whole)
  while (true) {
    const long n = syscall(SYS_read, a->read_fd, reinterpret_cast<char*>(&message) + have, sizeof(message) - have);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) syscall(SYS_exit_group, 0);
    if (n == 0) break;
    have += static_cast<size_t>(n);
    if (have < sizeof(message)) continue;
    have = 0;
    if (message == 0) syscall(SYS_exit_group, 0);  // disarmed
    group = message;
  }
  // The launcher is gone without having ended the group. No group yet:
  // no worker passed its start (one that had would have told).
  if (group > 0) {
    // The launcher could not give the terminal back itself. The watcher
    // shares its session, so /dev/tty is that terminal; every signal is
    // blocked here, SIGTTOU too. Only if the workers still hold it; a
    // launcher's group that is gone by now refuses it (EPERM), and its
    // shell takes the terminal back.
    if (a->launcher_group > 0) {
      const long tty = syscall(SYS_openat, AT_FDCWD, "/dev/tty", O_RDWR | O_NOCTTY | O_CLOEXEC);
      pid_t foreground = 0;
      if (tty >= 0 && syscall(SYS_ioctl, tty, TIOCGPGRP, &foreground) == 0 && foreground == group) {
        syscall(SYS_ioctl, tty, TIOCSPGRP, &a->launcher_group);
      }
    }
    syscall(SYS_kill, -group, SIGKILL);
  }
  if (a->error_dir[0] != '\0') RemoveErrorDirInWatcher(a->error_dir);
  syscall(SYS_exit_group, 0);
  __builtin_unreachable();
}

// Everything the terminal listener (WorkerGroup::Impl::StartListener)
// needs, prepared before the clone.
struct ListenerArgs {
  int write_fd = -1;  // its pipe's write end
  sigset_t wanted{};  // the terminal's signals and `query`
  int query = 0;      // the launcher's question
  unsigned char answer = 0;  // written for `query`
  pid_t parent = 0;
  int fd_bound = 0;  // DescriptorBound(), for CloseAllBut
  bool skip_close_range = false;
};

// The listener's whole life, in the child of a raw clone: raw system calls
// only, and not instrumented (see CloseAllBut).
[[noreturn]] __attribute__((noinline, no_sanitize("address", "thread", "undefined"))) void
RunListener(const ListenerArgs* a) {
  syscall(SYS_prctl, PR_SET_NAME, "ddp-listener", 0, 0, 0);
  syscall(SYS_setpgid, 0, 0);  // as the parent does too, whichever comes first
  syscall(SYS_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
  if (syscall(SYS_getppid) != a->parent) syscall(SYS_exit_group, 1);
  CloseAllBut(a->write_fd, a->skip_close_range, a->fd_bound);  // all but the pipe's write end
  while (true) {
    siginfo_t info;  // filled by the kernel; not zeroed (no memset here)
    const long signo = syscall(SYS_rt_sigtimedwait, &a->wanted, &info, nullptr, _NSIG / 8);
    if (signo < 0) {
      if (errno == EINTR) continue;
      syscall(SYS_exit_group, 1);
    }
    unsigned char byte = static_cast<unsigned char>(signo);
    if (signo == a->query) {
      if (info.si_pid != a->parent) continue;
      byte = a->answer;
    } else if (info.si_code != SI_KERNEL) {
      continue;
    }
    // The pipe's 64 KiB would take years of Ctrl-C; a full one (the
    // launcher stuck) drops the byte rather than block.
    syscall(SYS_write, a->write_fd, &byte, 1);
  }
}

Status MakeDirectories(const std::string& path) {
  std::string partial;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    partial = path.substr(0, pos);
    if (partial.empty()) continue;
    if (mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      const int err = errno;
      return StartError(err, "cannot create log directory '" + partial + "': " + ErrnoText(err));
    }
  }
  return Status::Ok();
}

// The folder of a worker's log files and error file under
// OutputOptions::log_dir: <log_dir>/<log_name_prefix><log name or rank>.
std::string LogFolder(const OutputOptions& out, const WorkerSpec& spec) {
  return out.log_dir + "/" + out.log_name_prefix + (spec.log_name.empty() ? std::to_string(spec.rank) : spec.log_name);
}

// `path` with its empty and '.' components dropped and each 'name/..'
// taken out, lexically (no symbolic link is looked at): './0', '0/' and
// 'x/../0' all give '0'. A '..' that climbs above a relative start stays
// at the front; '/..' is '/'. An empty result is ".".
std::string LexicallyNormal(const std::string& path) {
  const bool absolute = !path.empty() && path[0] == '/';
  std::vector<std::string> parts;
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find('/', begin);
    if (end == std::string::npos) end = path.size();
    const std::string part = path.substr(begin, end - begin);
    begin = end + 1;
    if (part.empty() || part == ".") continue;
    if (part == "..") {
      if (!parts.empty() && parts.back() != "..") {
        parts.pop_back();
      } else if (!absolute) {
        parts.push_back(part);
      }
      continue;
    }
    parts.push_back(part);
  }
  std::string normal = absolute ? "/" : "";
  for (size_t i = 0; i < parts.size(); ++i) normal += (i == 0 ? "" : "/") + parts[i];
  return normal.empty() ? "." : normal;
}

// What kind of file `mode` says, for messages.
std::string FileKind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a UNIX socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

// A spec's own TORCHELASTIC_ERROR_FILE (its last entry), if it names one.
std::optional<std::string> OwnErrorFile(const WorkerSpec& spec) {
  std::optional<std::string> own;
  for (const auto& [key, value] : spec.env) {
    if (key == kEnvErrorFile) own = value;
  }
  return own;
}

// Refuses an error file at `path` that is there and is not a regular file
// (a FIFO, a device, a link: /dev/null, say): the launcher removes a stale
// one before the worker starts and reads it after, and removing, or
// reading, such a thing would be wrong. `who` names the worker.
Status CheckErrorFileKind(const std::string& path, const std::string& who) {
  struct stat st{};
  if (lstat(path.c_str(), &st) != 0) return Status::Ok();  // none yet (or unreachable: the worker says)
  if (S_ISREG(st.st_mode)) return Status::Ok();
  return InvalidArgumentError(who + ": its error file '" + path + "' (" + std::string(kEnvErrorFile) + ") is " +
                              FileKind(st.st_mode) +
                              ", not a regular file; the launcher removes a stale one and reads it after the "
                              "worker ends, so it must name a regular file or none there yet");
}

// Bad input in `specs`, refused before any worker starts. Two workers with
// one rank (or, with a log_dir, one log folder) would write the same log
// files over each other and the same error file, whose message would then
// be blamed on either; a variable name with '=' would set another variable.
// Log folders are compared lexically normalised ('./0' is '0'), and one
// outside log_dir (a name with '..' or a leading '/') is refused. With
// `error_files`, two specs naming one TORCHELASTIC_ERROR_FILE of their own
// are refused, as is one that is there and not a regular file, or one that
// is another worker's error.json under log_dir.
// `path` made absolute and lexically normal. A relative one is the
// worker's, whose folder is this process's: 'err.json' and '<cwd>/err.json'
// are one file.
std::string AbsoluteNormal(const std::string& path) {
  std::string absolute = path;
  if (absolute.empty() || absolute[0] != '/') {
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof(cwd)) != nullptr) absolute = std::string(cwd) + "/" + absolute;
  }
  return LexicallyNormal(absolute);
}

Status CheckSpecs(const std::vector<WorkerSpec>& specs, const OutputOptions& out, bool error_files) {
  for (const auto& [field, text] : {std::pair<const char*, const std::string&>{"log_dir", out.log_dir},
                                    std::pair<const char*, const std::string&>{"log_name_prefix",
                                                                               out.log_name_prefix}}) {
    if (text.find('\0') != std::string::npos) return InvalidArgumentError(std::string(field) + " holds a NUL byte");
  }
  std::vector<std::string> folders(specs.size());  // each one's, under log_dir, normalised
  std::vector<std::optional<std::string>> error_paths(specs.size());  // each one's own, normalised
  for (size_t i = 0; i < specs.size(); ++i) {
    const WorkerSpec& spec = specs[i];
    const std::string who = "rank " + std::to_string(spec.rank);
    // RANK, its log folder and its error file's name take it as given.
    if (spec.rank < 0) return InvalidArgumentError(who + " (spec " + std::to_string(i) + "): a rank is 0 or more");
    // Bits beyond the two streams were taken silently (as both, or as one).
    for (const auto& [field, value] : {std::pair<const char*, int>{"logged_streams", spec.logged_streams},
                                       std::pair<const char*, int>{"shown_streams", spec.shown_streams}}) {
      if (value < kNoStreams || value > kBothStreams) {
        return InvalidArgumentError(who + ": its " + field + " is " + std::to_string(value) +
                                    "; it takes 0 (no stream), 1 (stdout), 2 (stderr) or 3 (both)");
      }
    }
    if (spec.program.empty()) return InvalidArgumentError(who + ": no program given");
    if (spec.argv.empty()) {
      return InvalidArgumentError(who + ": no argument vector given (it holds argv[0] at least)");
    }
    // The kernel takes C strings: a NUL byte would cut the text short.
    const auto has_nul = [](const std::string& text) { return text.find('\0') != std::string::npos; };
    if (has_nul(spec.program)) return InvalidArgumentError(who + ": its program's path holds a NUL byte");
    // Two names that differ after a NUL byte would be one folder.
    if (!out.log_dir.empty() && has_nul(spec.log_name)) {
      return InvalidArgumentError(who + ": its log name holds a NUL byte");
    }
    for (size_t a = 0; a < spec.argv.size(); ++a) {
      if (has_nul(spec.argv[a])) return InvalidArgumentError(who + ": argv[" + std::to_string(a) + "] holds a NUL byte");
    }
    for (const auto& [name, value] : spec.env) {
      if (name.empty() || name.find('=') != std::string::npos || has_nul(name)) {
        return InvalidArgumentError(who + ": environment variable name '" + name +
                                    "' is empty or holds '=' or a NUL byte");
      }
      if (has_nul(value)) return InvalidArgumentError(who + ": the value of " + name + " holds a NUL byte");
    }
    if (!out.log_dir.empty()) {
      const std::string name = out.log_name_prefix + (spec.log_name.empty() ? std::to_string(spec.rank) : spec.log_name);
      folders[i] = LexicallyNormal(name);
      if (folders[i][0] == '/' || folders[i] == ".." || folders[i].rfind("../", 0) == 0 || folders[i] == ".") {
        return InvalidArgumentError(who + ": its log folder '" + name + "' (log_name_prefix and log name) is not a "
                                    "folder inside log_dir '" + out.log_dir +
                                    "'; give it a relative name without '..'");
      }
    }
    if (error_files) {
      if (const std::optional<std::string> own = OwnErrorFile(spec)) {
        DDP_RETURN_IF_ERROR(CheckErrorFileKind(*own, who));
        error_paths[i] = AbsoluteNormal(*own);
      }
    }
    for (size_t j = 0; j < i; ++j) {
      if (error_paths[i] && error_paths[j] == error_paths[i]) {
        // Both spellings when they differ: the user looks for each in its spec.
        const std::string earlier = *OwnErrorFile(specs[j]);
        const std::string later = *OwnErrorFile(spec);
        const std::string named = earlier == later ? "'" + later + "'" : "'" + earlier + "' and '" + later + "'";
        return InvalidArgumentError("ranks " + std::to_string(specs[j].rank) + " and " + std::to_string(spec.rank) +
                                    " name one error file of their own, " + named + " (" +
                                    std::string(kEnvErrorFile) +
                                    "), whose message would be blamed on either; give each its own");
      }
      if (specs[j].rank == spec.rank) {
        return InvalidArgumentError(who + " is given to two workers (specs " + std::to_string(j) + " and " +
                                    std::to_string(i) + "); each worker needs a rank of its own");
      }
      if (!out.log_dir.empty() && folders[j] == folders[i]) {
        return InvalidArgumentError("ranks " + std::to_string(specs[j].rank) + " and " + std::to_string(spec.rank) +
                                    " would share the log folder '" + LogFolder(out, spec) +
                                    "'; give them different log names");
      }
    }
  }
  // A worker without an error file of its own gets <its log folder>/
  // error.json: another's own file there would be written by both and read
  // as either's.
  if (error_files && !out.log_dir.empty()) {
    for (size_t i = 0; i < specs.size(); ++i) {
      if (!error_paths[i]) continue;
      for (size_t j = 0; j < specs.size(); ++j) {
        if (j == i || error_paths[j]) continue;
        const std::string given = LogFolder(out, specs[j]) + "/error.json";
        if (AbsoluteNormal(given) != *error_paths[i]) continue;
        return InvalidArgumentError("rank " + std::to_string(specs[i].rank) + "'s own error file '" +
                                    *OwnErrorFile(specs[i]) + "' (" + std::string(kEnvErrorFile) + ") is rank " +
                                    std::to_string(specs[j].rank) + "'s default one, '" + given +
                                    "', whose message would be blamed on either; give it another");
      }
    }
  }
  // A rank in the terminal filter that no worker has is a mistake (a
  // global rank given for a local one, say): taken as given, it would show
  // nothing of that worker, and the terminal could stay silent.
  for (const int rank : out.terminal_ranks) {
    const bool found = std::any_of(specs.begin(), specs.end(), [rank](const WorkerSpec& s) { return s.rank == rank; });
    if (found) continue;
    std::string ranks;
    for (const WorkerSpec& s : specs) ranks += (ranks.empty() ? "" : ", ") + std::to_string(s.rank);
    return InvalidArgumentError("terminal_ranks names rank " + std::to_string(rank) +
                                ", which no worker has (their ranks: " + ranks + ")");
  }
  return Status::Ok();
}

// Writes `data` to a log file: "" when it took all of it, or when
// `wait_deadline` came first (*taken says how much went; the caller keeps
// the rest for later), else why it failed. Log files are opened
// non-blocking: one that is a FIFO (or a device) whose reader stops
// reading, or reads a few bytes at a time, holds the loop that watches the
// workers up for at most kTerminalStallTime in all (`stall_limit`: that
// long after the write began; what a deadline cut short goes on through
// WritePending), and never past `wait_deadline` (the watch's next
// deadline: Wait's own, the grace's end), so that a deadline, a kill or a
// forwarded Ctrl-C is not put off. A FIFO whose reader closed gives EPIPE,
// without SIGPIPE (whose default action would end the launcher).
std::string WriteAll(int fd, std::string_view data, Deadline stall_limit, Deadline wait_deadline,
                     size_t* taken_out) {
  const Deadline give_up = std::min(stall_limit, wait_deadline);
  const size_t total = data.size();
  *taken_out = 0;
  while (!data.empty()) {
    const ssize_t n = WriteWithoutSigpipe(fd, data);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const int wait_ms = MillisecondsUntil(give_up);
      if (wait_ms == 0) {
        const size_t taken = total - data.size();
        *taken_out = taken;
        // Cut short by the watch, not by the reader: the log goes on.
        if (give_up < stall_limit) return "";
        if (taken == 0) {
          return "nothing was taken for " + std::to_string(kTerminalStallTime.count()) +
                 " ms (a reader that stopped reading)";
        }
        return "only " + std::to_string(taken) + " of " + std::to_string(total) + " bytes were taken in " +
               std::to_string(kTerminalStallTime.count()) + " ms (a reader that stopped reading or reads too slowly)";
      }
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, wait_ms);
      continue;
    }
    if (n < 0) {
      const int err = errno;
      *taken_out = total - data.size();
      return ErrnoText(err);
    }
    if (n == 0) {
      *taken_out = total - data.size();
      return "the write took nothing";
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  *taken_out = total;
  return "";
}

// Writes the rest of a log write that a deadline cut short (WriteLog). It
// waits for the reader as WriteAll does, until `hold_until` (the write's
// first try plus kTerminalStallTime, or the watch's next deadline if
// sooner: the watch is held up no longer in all than by one write), then
// leaves the rest for the log's turn in the watch's poll. The reader's
// stall is counted from the last time it took bytes (`*last_progress`,
// moved on by every byte taken), not from the first try: a reader that
// keeps taking bytes keeps the log; one that took nothing for
// kTerminalStallTime stops it.
std::string WritePending(int fd, std::string_view data, Deadline hold_until, Deadline* last_progress,
                         size_t* taken_out) {
  const size_t total = data.size();
  *taken_out = 0;
  while (!data.empty()) {
    const ssize_t n = WriteWithoutSigpipe(fd, data);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      *taken_out = total - data.size();
      const Deadline stalled = *last_progress + kTerminalStallTime;
      if (Clock::now() >= stalled) {
        return "nothing was taken for " + std::to_string(kTerminalStallTime.count()) +
               " ms (a reader that stopped reading)";
      }
      const int wait_ms = MillisecondsUntil(std::min(stalled, hold_until));
      if (wait_ms == 0) return "";  // the rest waits for the log's turn
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, wait_ms);
      continue;
    }
    if (n < 0) {
      const int err = errno;
      *taken_out = total - data.size();
      return ErrnoText(err);
    }
    if (n == 0) {
      *taken_out = total - data.size();
      return "the write took nothing";
    }
    data.remove_prefix(static_cast<size_t>(n));
    *last_progress = Clock::now();
  }
  *taken_out = total;
  return "";
}

}  // namespace

std::string SignalName(int signal) {
  switch (signal) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGSYS: return "SIGSYS";
    case SIGSTOP: return "SIGSTOP";
    case SIGTSTP: return "SIGTSTP";
    case SIGTTIN: return "SIGTTIN";
    case SIGTTOU: return "SIGTTOU";
    case SIGSTKFLT: return "SIGSTKFLT";
    case SIGCHLD: return "SIGCHLD";
    case SIGCONT: return "SIGCONT";
    case SIGURG: return "SIGURG";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGVTALRM: return "SIGVTALRM";
    case SIGPROF: return "SIGPROF";
    case SIGWINCH: return "SIGWINCH";
    case SIGIO: return "SIGIO";
    case SIGPWR: return "SIGPWR";
  }
  if (signal >= SIGRTMIN && signal <= SIGRTMAX) return "SIGRTMIN+" + std::to_string(signal - SIGRTMIN);
  return "signal " + std::to_string(signal);
}

int InterruptSignal() { return g_interrupt_signal.load(std::memory_order_relaxed); }

void ForceCloseRangeFallbackForTesting(bool force) {
  g_force_close_range_fallback.store(force, std::memory_order_relaxed);
}

int64_t SignalHandlerLooksForTesting() { return g_signal_handler_looks.load(); }

void SetForwardingEndStepForTesting(std::function<void()> step) {
  std::lock_guard<std::mutex> lock(g_forwarding_end_step_mu);
  g_forwarding_end_step = std::move(step);
}

void PauseAfterFirstWorkerForTesting(std::chrono::milliseconds pause) {
  g_pause_after_first_worker_ms.store(pause.count(), std::memory_order_relaxed);
}

void SetBeforeFirstWorkerStepForTesting(std::function<void(pid_t watcher)> step) {
  std::lock_guard<std::mutex> lock(g_before_first_worker_step_mu);
  g_before_first_worker_step = std::move(step);
}

void DieOfInterruptSignal(int exit_code) {
  const int signo = InterruptSignal();
  if ((signo != SIGINT && signo != SIGTERM && signo != SIGHUP) || exit_code != 128 + signo) return;
  std::fflush(nullptr);
  struct sigaction action{};
  action.sa_handler = SIG_DFL;
  sigemptyset(&action.sa_mask);
  if (sigaction(signo, &action, nullptr) != 0) return;
  sigset_t only;
  sigemptyset(&only);
  sigaddset(&only, signo);
  pthread_sigmask(SIG_UNBLOCK, &only, nullptr);
  // Sent to this thread, in which it is unblocked: delivered before raise
  // returns.
  raise(signo);
}

std::string WorkerExit::Describe() const {
  std::string who = "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ")";
  if (status_lost) {
    return who + " ended, but something else in this process reaped it first (a SIGCHLD handler or a wait "
                 "for any child?), so how it ended is unknown";
  }
  if (!exited) return who + " could not be reaped";
  if (signaled) {
    return who + " was killed by signal " + std::to_string(code) + " (" + SignalName(code) + ")";
  }
  return who + " exited with code " + std::to_string(code);
}

int GroupResult::ExitCode() const {
  switch (outcome) {
    case GroupOutcome::kSucceeded: return 0;
    case GroupOutcome::kWorkerFailed:
      if (!first_failure || !first_failure->exited) return 1;
      return first_failure->signaled ? 128 + first_failure->code : first_failure->code;
    case GroupOutcome::kInterrupted: return 128 + signal;
    case GroupOutcome::kStopped:
    case GroupOutcome::kTimedOut:
    case GroupOutcome::kMonitorFailed: return 1;
  }
  return 1;
}

StatusOr<std::string> ResolveProgram(const std::string& program) {
  if (program.empty()) return InvalidArgumentError("no program given");
  auto check = [](const std::string& path) -> Status {
    struct stat st{};
    if (stat(path.c_str(), &st) != 0) {
      return InvalidArgumentError("program '" + path + "': " + ErrnoText(errno));
    }
    if (!S_ISREG(st.st_mode)) return InvalidArgumentError("program '" + path + "' is not a file");
    if (access(path.c_str(), X_OK) != 0) {
      return InvalidArgumentError("program '" + path + "' is not executable");
    }
    return Status::Ok();
  };
  if (program.find('/') != std::string::npos) {
    DDP_RETURN_IF_ERROR(check(program));
    return program;
  }
  const char* path_env = getenv("PATH");
  std::string path = path_env != nullptr ? path_env : "/usr/local/bin:/usr/bin:/bin";
  // The first entry of that name that exists but cannot be run (a script
  // without its x bit, a folder): "not found" would send the user looking
  // for a file that is there.
  std::string unusable;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(start, end - start);
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + program;
    start = end + 1;
    struct stat st{};
    if (stat(candidate.c_str(), &st) != 0) continue;
    if (check(candidate).ok()) return candidate;
    if (unusable.empty()) {
      unusable = "'" + candidate + (S_ISREG(st.st_mode) ? "' is not executable" : "' is not a file");
    }
  }
  if (!unusable.empty()) {
    return InvalidArgumentError("program '" + program + "' not found in PATH as an executable file: " +
                                unusable);
  }
  return InvalidArgumentError("program '" + program + "' not found in PATH");
}

// ---- the group ----

namespace {

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) Reset(std::exchange(o.fd_, -1));
    return *this;
  }
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// One output stream (stdout or stderr) of one worker, read through a pipe.
struct Stream {
  Fd pipe;
  std::string partial;  // an incomplete line waiting for its newline
  Fd log;               // its log file (stdout.log or stderr.log), if any
  std::string log_path;
  // What a log write cut short by the watch's deadline left (see
  // WriteLog): written before anything newer; the log stops when its
  // reader takes nothing for kTerminalStallTime after `log_pending_since`,
  // the last time it took bytes (WritePending). Writes of it wait for the
  // reader only until kTerminalStallTime after `log_pending_began`, the
  // first try.
  std::string log_pending;
  Deadline log_pending_began{};
  Deadline log_pending_since{};
  bool to_terminal = false;  // copied to the launcher's stdout or stderr
  uint64_t log_bytes = 0;   // written to the log so far
};

// The launcher's own stdout or stderr, to which worker output is copied.
// The loop that watches the workers writes there, so a reader that stops
// reading (a pipe nobody drains, a terminal on hold) must not stop it:
// writes do not block, a write that makes no progress for
// kTerminalStallTime gives up, and from then on output that cannot be
// written at once is dropped and counted, until a write goes through again.
// The descriptor is shared with the launcher's parent (a shell), so its
// O_NONBLOCK flag is left alone: a pipe or terminal is opened anew through
// /proc (a description of our own), a socket is written with MSG_DONTWAIT.
// A regular file is written as before; it does not stall.
struct Terminal {
  int fd = -1;
  Fd reopened;          // valid: fd is this non-blocking description
  bool socket = false;  // send(MSG_DONTWAIT) instead of write
  bool stalled = false;
  uint64_t dropped = 0;

  void Open(int target) {
    fd = target;
    struct stat st{};
    if (fstat(target, &st) != 0) return;
    if (S_ISSOCK(st.st_mode)) {
      socket = true;
    } else if (S_ISFIFO(st.st_mode) || S_ISCHR(st.st_mode)) {
      const std::string path = "/proc/self/fd/" + std::to_string(target);
      reopened.Reset(open(path.c_str(), O_WRONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
      if (reopened.valid()) fd = reopened.get();
    }
  }

  void Write(std::string_view data) {
    Deadline give_up = stalled ? Clock::now() : Clock::now() + kTerminalStallTime;
    while (!data.empty()) {
      const ssize_t n = socket ? send(fd, data.data(), data.size(), MSG_DONTWAIT | MSG_NOSIGNAL)
                               : WriteWithoutSigpipe(fd, data);
      if (n > 0) {
        data.remove_prefix(static_cast<size_t>(n));
        give_up = Clock::now() + kTerminalStallTime;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        const int wait_ms = MillisecondsUntil(give_up);
        if (wait_ms > 0) {
          pollfd p{fd, POLLOUT, 0};
          poll(&p, 1, wait_ms);
          continue;
        }
        stalled = true;
      }
      dropped += data.size();  // stalled, or the output is gone (EPIPE, EIO)
      return;
    }
    stalled = false;
  }
};

}  // namespace

void WriteLauncherLine(std::string_view text) {
  static std::mutex mu;
  static Terminal* terminal = nullptr;  // never destroyed: callable at exit
  std::lock_guard lock(mu);
  if (terminal == nullptr) {
    terminal = new Terminal();
    terminal->Open(STDERR_FILENO);
  }
  terminal->Write(text);
}

namespace {

struct Worker {
  int rank = 0;
  std::string line_prefix;  // "[rank] " unless the spec gives one
  pid_t pid = -1;
  Fd pidfd;
  bool running = false;
  bool zombie = false;  // exited, observed, not yet reaped (see Observe)
  WorkerExit exit;
  Stream streams[2];
  std::string error_path;   // its TORCHELASTIC_ERROR_FILE; empty: none
  // One line per log file a write failed to; that file is closed then.
  std::vector<std::string> log_failures;
  std::string captured;
  bool capture_truncated = false;
  bool stop_told = false;  // a stop was reported through on_notice
};

// The pipe from the signal handler to the group that forwards signals: one
// for the process, made once and never closed. A handler running on
// another thread may load the write end just as a group ends; were it
// closed, the handler's byte could land in whatever took the number next
// (a store connection).
StatusOr<std::pair<int, int>> ProcessSignalPipe() {
  static std::mutex mu;
  static int fds[2] = {-1, -1};
  std::lock_guard<std::mutex> lock(mu);
  if (fds[0] < 0 && pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    fds[0] = fds[1] = -1;
    const int err = errno;
    return SetupError(err, "cannot make the pipe that signals are forwarded through (pipe2: " + ErrnoText(err) + ")");
  }
  return std::make_pair(fds[0], fds[1]);
}

// SIGCHLD as the groups alive found it (see WaitForChildren): how many
// there are, and the ignoring disposition the latest of them replaced, if
// any did.
struct SigchldState {
  std::mutex mu;
  int groups = 0;
  bool changed = false;
  struct sigaction saved {};
};
SigchldState g_sigchld;

}  // namespace

class WorkerGroup::Impl {
 public:
  explicit Impl(SpawnOptions options) : options_(std::move(options)) {}

  ~Impl() {
    KillAndReap();
    ReleaseChildren();
    if (!error_dir_.empty()) RemoveErrorDir();
    if (forwarding_) {
      // First no longer the signals' recipient, then the earlier handlers
      // back: a signal between the two is recorded by this group's handler
      // for the next group (g_unforwarded_signal). The other way round, the
      // launcher's own handler (CatchInterrupts) would write it into the
      // pipe, whose stale bytes the next group throws away.
      g_signal_write_fd.store(-1);
      RunForwardingEndStep();
      for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
        if (installed_[i]) sigaction(kForwardedSignals[i], &old_actions_[i], nullptr);
      }
      for (size_t i = 0; i < std::size(kPassedOnSignals); ++i) {
        if (passed_on_installed_[i]) sigaction(kPassedOnSignals[i], &passed_on_old_[i], nullptr);
      }
      // Held signals no worker of this group got (they ended first): the
      // next group's.
      if (held_ != 0) g_held_passed_on.fetch_or(held_, std::memory_order_relaxed);
      g_forwarding.store(false);
    }
  }

  static void RunForwardingEndStep() {
    std::function<void()> step;
    {
      std::lock_guard<std::mutex> lock(g_forwarding_end_step_mu);
      step = g_forwarding_end_step;
    }
    if (step) step();
  }

  Status Start(std::vector<WorkerSpec> specs) {
    if (specs.empty()) return InvalidArgumentError("no workers to start");
    if (options_.exec_timeout.count() <= 0) {
      return InvalidArgumentError("the time a worker may take to exec (exec_timeout) is " +
                                  std::to_string(options_.exec_timeout.count()) + " ms; it must be more than 0");
    }
    if (options_.hold_signal_for.count() < 0) {
      return InvalidArgumentError("the time a SIGUSR1 or SIGUSR2 is held for workers without a handler "
                                  "(hold_signal_for) is " +
                                  std::to_string(options_.hold_signal_for.count()) + " ms; it must be 0 or more");
    }
    if (options_.grace.count() < 0) {
      return InvalidArgumentError("the grace period between SIGTERM and SIGKILL is " +
                                  std::to_string(options_.grace.count()) + " ms; it must be 0 or more");
    }
    DDP_RETURN_IF_ERROR(CheckSpecs(specs, options_.output, options_.error_files));
    const OutputOptions& out = options_.output;
    use_pipes_ = out.prefix || out.capture || (!out.log_dir.empty() && out.log_files) || !out.to_terminal ||
                 !out.terminal_ranks.empty();
    // A stream kept off the terminal is read and dropped.
    for (const WorkerSpec& spec : specs) use_pipes_ = use_pipes_ || spec.shown_streams != kBothStreams;
    // Before anything here opens a descriptor, which could take number 0.
    DDP_RETURN_IF_ERROR(ChooseWorkersStdin());
    // SpawnOptions::share_terminal: only for a launcher in the foreground
    // of the terminal its stdin is (the workers' too), with the signals
    // forwarded (the terminal's then come off the workers, see Wait).
    if (options_.share_terminal && options_.forward_signals && !dev_null_.valid() && isatty(STDIN_FILENO) &&
        tcgetpgrp(STDIN_FILENO) == getpgrp()) {
      launcher_pgrp_ = getpgrp();
      // Its own writes to the terminal from the background (under `stty
      // tostop`) and taking the terminal back would stop this process.
      struct sigaction ignore{};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      ttou_ignored_ = sigaction(SIGTTOU, &ignore, &ttou_old_) == 0;
    }
    stop_event_.Reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!stop_event_.valid()) {
      const int err = errno;
      return SetupError(err, "cannot make the group's stop event (eventfd: " + ErrnoText(err) + ")");
    }
    if (options_.forward_signals) DDP_RETURN_IF_ERROR(InstallSignalForwarding());
    WaitForChildren();
    if (options_.error_files && out.log_dir.empty()) {
      const char* tmp = getenv("TMPDIR");
      std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                            "/ddp_worker_errors_XXXXXX";
      // Without a writable temporary folder the workers run all the same,
      // without error files (their reasons are in their output).
      if (mkdtemp(pattern.data()) != nullptr) error_dir_ = pattern;
    }
    if (use_pipes_ && out.to_terminal) {
      terminals_[0].Open(STDOUT_FILENO);
      terminals_[1].Open(STDERR_FILENO);
    }

    workers_.resize(specs.size());
    // Before the workers, so that it hears the terminal from the moment
    // they hold it; it leads their group. Without it, Wait falls back to
    // reading the terminal's signals off the workers' ends.
    if (launcher_pgrp_ > 0) StartListener();
    // The watcher covers a launcher that dies before it ended the group,
    // from before the first worker: that worker takes the terminal before
    // its exec, and may start children of its own right after it. A
    // launcher killed before a watcher that started after that worker
    // left the terminal to the dead group (its shell stopped for reading
    // it; seen under ThreadSanitizer, which widens that window), and the
    // worker's children running. The group's id is the listener's when it
    // leads the group; otherwise the first worker, which leads it, tells
    // the watcher before its exec (ChildArgs::watcher_fd).
    if (Status watching = StartWatcher(); !watching.ok()) {
      KillAndReap();
      return watching;
    }
    {
      std::lock_guard<std::mutex> lock(g_before_first_worker_step_mu);
      if (g_before_first_worker_step) g_before_first_worker_step(watcher_);
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      Status started = StartOne(specs[i], workers_[i]);
      if (started.ok() && i == 0) {
        if (const int64_t pause = g_pause_after_first_worker_ms.load(std::memory_order_relaxed); pause > 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(pause));
        }
      }
      if (!started.ok()) {
        KillAndReap();
        return started;
      }
    }
    return Status::Ok();
  }

  std::vector<pid_t> pids() const {
    std::vector<pid_t> out;
    for (const Worker& w : workers_) out.push_back(w.pid);
    return out;
  }

  pid_t process_group() const { return pgid_; }

  void RequestStop(std::string reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_reason_.empty()) stop_reason_ = std::move(reason);
    }
    const uint64_t one = 1;
    ssize_t n = write(stop_event_.get(), &one, sizeof(one));
    (void)n;
  }

  GroupResult Wait(Deadline deadline) {
    // The workers are gone and reaped after the first call: another would
    // find nothing running and report success whatever they did.
    if (waited_) return *waited_;
    GroupResult result;
    enum class Phase { kRunning, kStopping, kKilling, kDraining };
    Phase phase = Phase::kRunning;
    Deadline phase_deadline = Deadline::max();
    const Deadline start = Clock::now();
    // Whether the interruption came first (then every worker should end by
    // the forwarded signal; see below).
    bool interrupted_while_running = false;
    bool interrupt_reported = false;  // on_interrupt was called
    // A terminal's signal this Wait sent to this process's own group (see
    // below), whose byte from the handler is not a second interruption.
    int echo_signal = 0;

    auto stop_workers = [&](int signal) {
      SignalRunning(signal);
      phase = Phase::kStopping;
      phase_deadline = DeadlineIn(options_.grace);  // saturates: milliseconds::max() waits for good
    };
    // SIGINT, SIGTERM, SIGHUP or SIGQUIT for this process (`how` says how
    // it came, when not to this process itself).
    auto interrupt = [&](int signo, const std::string& how) {
      if (!interrupt_reported && options_.on_interrupt) {
        interrupt_reported = true;
        options_.on_interrupt(signo);
      }
      if (phase == Phase::kRunning) {
        result.outcome = GroupOutcome::kInterrupted;
        result.signal = signo;
        result.reason = "interrupted by " + SignalName(signo) + how + "; forwarded it to every worker";
        interrupted_while_running = true;
        stop_workers(signo);
      } else if (result.outcome != GroupOutcome::kInterrupted) {
        // The workers are already being stopped (one failed, a stop
        // was requested, the deadline passed) or are gone. The signal
        // still counts: the caller must end rather than restart them.
        // Those still running get it too; the grace goes on.
        result.outcome = GroupOutcome::kInterrupted;
        result.signal = signo;
        result.reason = (result.reason.empty() ? "every worker had ended" : result.reason) +
                        "; then interrupted by " + SignalName(signo) + how;
        if (phase == Phase::kStopping) SignalRunning(signo);
      } else if (phase == Phase::kStopping) {
        // Asked twice: no more grace.
        SignalRunning(SIGKILL);
        phase = Phase::kKilling;
        phase_deadline = Clock::now() + kReapTime;
      }
    };
    // The terminal's SIGINT, SIGQUIT or SIGHUP to the workers, who hold it:
    // as if it had reached this process, as it does under torchrun, whose
    // workers share its group: the job stops, and stays stopped (no
    // restart), however the workers end.
    auto interrupt_from_terminal = [&](int signo) {
      // A second one (an impatient Ctrl-C) only ends the grace: the first
      // was passed on, and this process's handler is reset by now.
      const bool first = result.outcome != GroupOutcome::kInterrupted;
      int none = 0;
      g_interrupt_signal.compare_exchange_strong(none, signo, std::memory_order_relaxed);
      interrupt(signo, " from the terminal (the workers hold it)");
      if (!first) return;
      // And to the group the terminal had before the workers, as the
      // terminal would have sent it: whoever runs this process in its group
      // (a script that loops over launches stops at Ctrl-C, as under
      // torchrun) and this process, whose handler's byte is skipped above.
      if (Catches(signo)) echo_signal = signo;
      kill(-launcher_pgrp_, signo);
    };

    while (true) {
      // Move on when every worker is gone: reap leftovers of the group,
      // then drain what is left in the pipes for a bounded time.
      if (phase != Phase::kDraining && RunningCount() == 0) {
        if (pgid_ > 0) SignalGroup(SIGKILL);
        phase = Phase::kDraining;
        phase_deadline = Clock::now() + kDrainTime;
      }
      if (phase == Phase::kDraining && OpenPipes() == 0) break;

      std::vector<pollfd> fds;
      std::vector<std::pair<int, int>> owners;  // (worker index, stream index or -1 for pidfd)
      if (signal_read_ >= 0) {
        fds.push_back({signal_read_, POLLIN, 0});
        owners.emplace_back(-1, 0);
      }
      fds.push_back({stop_event_.get(), POLLIN, 0});
      owners.emplace_back(-2, 0);
      if (listener_read_.valid()) {
        fds.push_back({listener_read_.get(), POLLIN, 0});
        owners.emplace_back(-3, 0);
      }
      bool need_fallback_poll = false;
      for (size_t i = 0; i < workers_.size(); ++i) {
        Worker& w = workers_[i];
        if (w.running) {
          if (w.pidfd.valid()) {
            fds.push_back({w.pidfd.get(), POLLIN, 0});
            owners.emplace_back(static_cast<int>(i), -1);
          } else {
            need_fallback_poll = true;
          }
        }
        for (int s = 0; s < 2; ++s) {
          if (w.streams[s].pipe.valid()) {
            fds.push_back({w.streams[s].pipe.get(), POLLIN, 0});
            owners.emplace_back(static_cast<int>(i), s);
          }
          // A log write cut short by a deadline: on when its reader takes more.
          if (w.streams[s].log.valid() && !w.streams[s].log_pending.empty()) {
            fds.push_back({w.streams[s].log.get(), POLLOUT, 0});
            owners.emplace_back(static_cast<int>(i), 2 + s);
          }
        }
      }
      if (held_ != 0 && phase == Phase::kRunning && Clock::now() >= next_held_look_) {
        PassOnHeldOnceCaught();
        next_held_look_ = Clock::now() + kHeldSignalLookEvery;
      }
      Deadline wake = phase == Phase::kRunning ? deadline : phase_deadline;
      if (held_ != 0 && phase == Phase::kRunning) wake = std::min(wake, next_held_look_);
      int timeout = std::min(MillisecondsUntil(wake), kMaxPollMs);
      if (need_fallback_poll) timeout = std::min(timeout, kFallbackPollMs);
      // EINTR needs nothing special: the next round computes its timeout
      // from the same absolute deadlines.
      const int n = poll(fds.data(), fds.size(), timeout);
      if (n < 0 && errno != EINTR) {
        // Cannot watch anything any more: stop the workers rather than hang,
        // and say so (this is no success, whatever the workers did so far).
        const std::string why = "cannot watch the workers (poll: " + ErrnoText(errno) +
                                "); killed every worker still running";
        if (result.outcome == GroupOutcome::kSucceeded) {
          result.outcome = GroupOutcome::kMonitorFailed;
          result.reason = why;
        } else {
          result.reason += "; " + why;
        }
        KillAndReap();
        break;
      }

      bool stop_requested = false;  // RequestStop was called (the stop event is readable)
      bool exits_to_read = need_fallback_poll;  // a pidfd is readable
      std::vector<int> heard;  // the terminal's signals to the workers' group (the listener's)
      for (size_t k = 0; n > 0 && k < fds.size(); ++k) {
        if (fds[k].revents == 0) continue;
        const auto [owner, stream] = owners[k];
        if (owner == -1) {
          unsigned char signals[16];
          const ssize_t got = read(signal_read_, signals, sizeof(signals));
          for (ssize_t j = 0; j < got; ++j) {
            const int signo = signals[j];
            if (signo == echo_signal) {
              echo_signal = 0;
              continue;
            }
            if (IsPassedOn(signo)) {
              // A checkpoint request, say: to the workers while they run;
              // nothing else changes. Workers being stopped would not act
              // on it: it is held for the next group (a restart). One that
              // comes within hold_signal_for of the group's start, while a
              // worker has no handler for it yet, is held for this group's
              // workers (PassOnHeldOnceCaught).
              if (phase == Phase::kRunning && RunningCount() > 0) {
                const int bit = PassedOnBit(signo);
                g_held_passed_on.fetch_and(~bit, std::memory_order_relaxed);
                if ((held_ & bit) != 0) continue;  // one held already: one is enough
                if (Clock::now() < hold_until_ && !EveryRunningWorkerTakes(signo)) {
                  held_ |= bit;
                  next_held_look_ = Clock::now() + kHeldSignalLookEvery;
                  if (options_.on_notice) {
                    options_.on_notice("holding " + SignalName(signo) +
                                       " until every worker has a handler for it: some have none yet");
                  }
                  continue;
                }
                PassOnToRunning(signo);
                if (options_.on_notice) options_.on_notice("passed " + SignalName(signo) + " on to the workers");
              } else if (options_.on_notice) {
                options_.on_notice("holding " + SignalName(signo) +
                                   " for the workers started next: these are stopping or gone");
              }
              continue;
            }
            interrupt(signo, "");
          }
        } else if (owner == -2) {
          uint64_t value;
          ssize_t got = read(stop_event_.get(), &value, sizeof(value));
          (void)got;
          stop_requested = true;  // acted on once the exits are in, below
        } else if (owner == -3) {
          ReadListener(heard, /*until_answer=*/false);
        } else if (stream == -1) {
          exits_to_read = true;
        } else if (stream >= 2) {
          // What the reader takes now, without waiting: the round goes on.
          WriteLog(workers_[owner], workers_[owner].streams[stream - 2], "", Clock::now());
        } else if (stream >= 0) {
          ReadStream(workers_[owner], stream, wake);
        }
      }

      // Reap whoever exited (pidfd readable, or anyone in fallback mode),
      // before a stop request seen in the same round: a worker that had
      // already failed by then is this group's failure, with its exit
      // status, not a worker stopped on request. (A signal to the launcher
      // is acted on first, above: it stops the job whatever the workers
      // did, and must be passed on, on_interrupt first, at once.)
      //
      // Workers found dead in one pass died in an order that nothing here
      // tells: neither waitid nor a pidfd gives the time of a death (error
      // files do, when written: see ReadErrorFiles, which names the
      // earliest). The first failure is then one killed by a signal (a
      // crash, the OOM killer: most likely the cause), over one that
      // exited with a code (often a peer that noticed the crash and gave
      // up), and among those alike, the first in the group's order.
      //
      // A worker that caught the terminal's Ctrl-C and exited may be seen
      // before the listener's word of it: before exits are read, the
      // listener is asked, and says what it heard first.
      if (exits_to_read && listener_read_.valid()) ReadListener(heard, /*until_answer=*/true);
      // Before the exits: those it ended are the interruption's, however
      // they exited (a worker that caught SIGINT and exited 1, say).
      bool ctrl_z = false;  // the terminal's SIGTSTP, heard by the listener
      for (int signo : heard) {
        if (signo == SIGTSTP) {
          ctrl_z = true;
        } else {
          interrupt_from_terminal(signo);
        }
      }
      Worker* failed = nullptr;
      int terminal_signal = 0;  // a worker killed by the terminal's Ctrl-C, say (no listener)
      for (Worker& w : workers_) {
        if (!w.running || !Observe(w)) continue;
        if (w.exit.ok() || phase != Phase::kRunning || result.first_failure) continue;
        // Without a listener, a worker killed by one of the terminal's
        // signals is the best sign of them.
        if (terminal_shared_ && !listener_read_.valid() && w.exit.signaled && IsTerminalSignal(w.exit.code)) {
          if (terminal_signal == 0) terminal_signal = w.exit.code;
          continue;
        }
        if (failed == nullptr || (w.exit.signaled && !failed->exit.signaled)) failed = &w;
      }
      if (terminal_signal != 0) {
        interrupt_from_terminal(terminal_signal);
      } else if (failed != nullptr) {
        result.first_failure = failed->exit;
        result.outcome = GroupOutcome::kWorkerFailed;
        result.reason = failed->exit.Describe();
        if (options_.stop_all_on_failure && RunningCount() > 0) {
          result.reason += "; stopping the other workers";
          stop_workers(SIGTERM);
        }
      }
      if (stop_requested && phase == Phase::kRunning) {
        // (A failure recorded above, with the others left running, stays
        // the outcome; the stop still stops them.)
        if (!result.first_failure) {
          result.outcome = GroupOutcome::kStopped;
          std::lock_guard<std::mutex> lock(mu_);
          result.reason = stop_reason_.empty() ? "a stop was requested (RequestStop, no reason given)" : stop_reason_;
        }
        stop_workers(SIGTERM);
      }

      if (phase == Phase::kRunning && result.outcome == GroupOutcome::kSucceeded && lent_back_) {
        if (tcgetpgrp(STDIN_FILENO) == launcher_pgrp_) {
          // `fg` of the running job: a shell sends no SIGCONT then, and
          // this round is the first to see it (within kMaxPollMs).
          ResumeWithTheTerminal();
        } else if (const int stop = TerminalStopOfAny()) {
          // A worker read from (or wrote to) the terminal in the
          // background: as a shell's job, the job stops until `fg`.
          StopLikeAJob(stop);
        }
      }
      if (phase == Phase::kRunning && result.outcome == GroupOutcome::kSucceeded && terminal_shared_ &&
          (ctrl_z || (!listener_read_.valid() && AnyStoppedBy(SIGTSTP)))) {
        StopLikeAJob(SIGTSTP);
      }
      if (phase == Phase::kRunning && result.outcome == GroupOutcome::kSucceeded) {
        // While the terminal is lent back, a worker stopped for touching it
        // (perhaps since the look above) stops the job in the next round.
        if (std::optional<std::string> stopped = lent_back_ ? std::nullopt : StoppedByTheTerminal()) {
          result.outcome = GroupOutcome::kWorkerFailed;
          result.reason = *stopped + "; stopping the workers";
          stop_workers(SIGTERM);
        } else {
          TellStops(/*terminal_stops_too=*/!lent_back_);
        }
      }

      const Deadline now = Clock::now();
      if (phase == Phase::kRunning && now >= deadline) {
        const std::string after = " still running after " +
                                  std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                     now - start).count()) +
                                  " ms (the deadline); stopped them";
        result.deadline_passed = true;
        if (result.first_failure) {
          // A failure that left the others running (stop_all_on_failure
          // off) stays the outcome, as with a stop requested after it.
          result.reason += "; the others were" + after;
        } else {
          result.outcome = GroupOutcome::kTimedOut;
          result.reason = "the workers were" + after;
        }
        stop_workers(SIGTERM);
      } else if (phase == Phase::kStopping && now >= phase_deadline) {
        SignalRunning(SIGKILL);
        phase = Phase::kKilling;
        phase_deadline = now + kReapTime;
      } else if (phase == Phase::kKilling && now >= phase_deadline) {
        break;  // unreapable (uninterruptible sleep): give up, say so below
      } else if (phase == Phase::kDraining && now >= phase_deadline) {
        break;
      }
    }

    // Before the leader is reaped: its pid is the id the terminal is
    // compared with.
    TakeTerminalBack();
    // The group was killed whole once the workers were gone: the watcher
    // has nothing left to do (told so before the leader, whose pid is the
    // group id, is reaped and that id becomes free).
    if (RunningCount() == 0) StopWatcher();
    StopListener();
    // With a worker left unreapable the watcher stays armed with the group's
    // id: the leader stays a zombie, holding that id, until the destructor
    // has killed the group and disarmed the watcher.
    if (RunningCount() == 0) ReapZombies();
    ReadErrorFiles(result);
    FinishLogs();
    for (Worker& w : workers_) {
      for (int s = 0; s < 2; ++s) FlushPartial(w, s);
      result.workers.push_back(w.exit);
      if (options_.output.capture) {
        if (w.capture_truncated) w.captured += "\n[output truncated]\n";
        result.output.push_back(w.captured);
      }
    }
    result.output_dropped = terminals_[0].dropped + terminals_[1].dropped;
    for (const Worker& w : workers_) {
      result.log_failures.insert(result.log_failures.end(), w.log_failures.begin(), w.log_failures.end());
    }
    if (interrupted_while_running) {
      // A worker ends as asked by dying of the forwarded signal, or by
      // handling it and exiting 0 or 128 + it; any other end (killed after
      // the grace, a crash) is worth naming.
      for (const WorkerExit& e : result.workers) {
        const bool as_asked = e.exited && (e.signaled ? e.code == result.signal
                                                      : e.code == 0 || e.code == 128 + result.signal);
        if (!as_asked) result.reason += "; " + e.Describe();
      }
    }
    waited_ = result;
    return result;
  }

 private:
  // What the failed workers wrote to their error files: into their exits,
  // and the earliest (the root cause, as torchrun has it; the first
  // failure on a tie) into the reason, on one line.
  void ReadErrorFiles(GroupResult& result) {
    Worker* earliest = nullptr;
    for (Worker& w : workers_) {
      // One whose status was lost still failed, and may have said why.
      if (w.error_path.empty() || (!w.exit.exited && !w.exit.status_lost) || w.exit.ok()) continue;
      StatusOr<WorkerError> error = ReadErrorFile(w.error_path);
      if (!error.ok()) {
        // A file the worker got wrong is worth saying; one this launcher
        // could not read (no descriptors left) is not the worker's word.
        if (error.status().code() == StatusCode::kInvalidArgument) {
          result.reason += "; rank " + std::to_string(w.rank) + "'s " + error.status().message();
        }
        continue;
      }
      w.exit.error = std::move(error->message);
      w.exit.error_timestamp_us = error->timestamp_us;
      w.exit.error_record = std::move(error->record);
      if (result.first_failure && result.first_failure->pid == w.exit.pid) {
        result.first_failure->error = w.exit.error;
        result.first_failure->error_timestamp_us = w.exit.error_timestamp_us;
        result.first_failure->error_record = w.exit.error_record;
      }
      const bool first = result.first_failure && result.first_failure->pid == w.exit.pid;
      // A file that gave no time (0) tells nothing of when it was written:
      // it comes after every one that did, or it would always be named
      // the root cause over them.
      auto when = [](const Worker& x) {
        return x.exit.error_timestamp_us > 0 ? x.exit.error_timestamp_us : std::numeric_limits<int64_t>::max();
      };
      if (earliest == nullptr || when(w) < when(*earliest) || (when(w) == when(*earliest) && first)) {
        earliest = &w;
      }
    }
    if (earliest == nullptr) return;
    result.first_error = earliest->exit;
    std::string line;
    for (char c : earliest->exit.error) {
      if (line.size() >= kMaxReportedError) {
        // Cut at a character's start: a UTF-8 character's lead byte and
        // continuation bytes (10xxxxxx) at the end go with it.
        const auto byte = [](char b) { return static_cast<unsigned char>(b); };
        size_t end = line.size();
        while (end > 0 && (byte(line[end - 1]) & 0xC0) == 0x80) --end;
        if (end > 0 && byte(line[end - 1]) >= 0xC0) {
          const unsigned char lead = byte(line[end - 1]);
          const size_t length = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
          if (line.size() - (end - 1) < length) line.resize(end - 1);
        }
        line += "...";
        break;
      }
      if (c == '\n' || c == '\r') {
        if (!line.empty() && line.back() != ' ') line += " | ";
        continue;
      }
      line += c;
    }
    while (!line.empty() && (line.back() == ' ' || line.back() == '|')) line.pop_back();
    result.reason += "; rank " + std::to_string(earliest->rank) + " reported: " + line;
  }

  // Removes the folder of the workers' error files and what is in it: the
  // error files, and what a writer killed before its rename left there (a
  // WriteErrorFile temporary, "<file>.tmp.XXXXXX"), which kept the folder
  // from going. Entries are unlinked, never followed; a folder a worker
  // made there is left, and with it the group's folder.
  void RemoveErrorDir() {
    if (DIR* dir = opendir(error_dir_.c_str())) {
      while (const dirent* entry = readdir(dir)) {
        const std::string_view name = entry->d_name;
        if (name == "." || name == "..") continue;
        unlinkat(dirfd(dir), entry->d_name, 0);
      }
      closedir(dir);
    }
    rmdir(error_dir_.c_str());
  }

  // With SIGCHLD ignored (SIG_IGN or SA_NOCLDWAIT, inherited from a parent
  // that set it) the kernel reaps exited children itself, so waitid cannot
  // observe the workers' exits and the group would wait for them forever.
  // A launcher must see them: back to the default, which also ignores the
  // signal but keeps exited children to be waited for. Every group looks
  // at its start, not only the first alive: the host program may have set
  // the ignoring while an earlier group ran, and this group's workers
  // would then be reaped by the kernel. The ignoring found last is the
  // host program's latest choice: it comes back when the last group alive
  // ends (ReleaseChildren; one ended earlier would have the kernel reap
  // another's workers), unless someone set another meanwhile.
  void WaitForChildren() {
    std::lock_guard<std::mutex> lock(g_sigchld.mu);
    waits_for_children_ = true;
    if (g_sigchld.groups++ == 0) g_sigchld.changed = false;
    struct sigaction current{};
    if (sigaction(SIGCHLD, nullptr, &current) != 0) return;
    if (current.sa_handler != SIG_IGN && (current.sa_flags & SA_NOCLDWAIT) == 0) return;
    struct sigaction action{};
    action.sa_handler = SIG_DFL;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGCHLD, &action, nullptr) != 0) return;
    g_sigchld.saved = current;
    g_sigchld.changed = true;
  }

  // The end of a group that called WaitForChildren, its children reaped:
  // the last one alive puts back the SIGCHLD disposition the first found,
  // if it is still the default set then.
  void ReleaseChildren() {
    if (!waits_for_children_) return;
    waits_for_children_ = false;
    std::lock_guard<std::mutex> lock(g_sigchld.mu);
    if (--g_sigchld.groups > 0 || !g_sigchld.changed) return;
    g_sigchld.changed = false;
    struct sigaction current{};
    if (sigaction(SIGCHLD, nullptr, &current) != 0 || current.sa_handler != SIG_DFL ||
        (current.sa_flags & SA_NOCLDWAIT) != 0) {
      return;  // the host program chose another since: its choice stands
    }
    sigaction(SIGCHLD, &g_sigchld.saved, nullptr);
  }

  Status InstallSignalForwarding() {
    bool expected = false;
    if (!g_forwarding.compare_exchange_strong(expected, true)) {
      return FailedPreconditionError("another WorkerGroup already forwards signals");
    }
    StatusOr<std::pair<int, int>> pipe = ProcessSignalPipe();
    if (!pipe.ok()) {
      g_forwarding.store(false);
      return pipe.status();
    }
    // What an earlier group's handler wrote after that group ended.
    char stale[64];
    while (read(pipe->first, stale, sizeof(stale)) > 0) {
    }
    signal_read_ = pipe->first;
    g_signal_write_fd.store(pipe->second);
    // One caught since the launcher last looked, before this group could
    // forward it: the group acts on it as if it came now.
    if (const int signo = g_unforwarded_signal.exchange(0, std::memory_order_relaxed); signo != 0) {
      WriteSignalByte(pipe->second, signo);
    }
    struct sigaction action{};
    action.sa_handler = RecordSignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      // A signal this process ignores stays ignored, as shells and torchrun
      // leave it: under nohup (SIGHUP) or as a background job of a script
      // (SIGINT) the launcher and, through exec, its workers ignore it.
      struct sigaction current{};
      sigaction(kForwardedSignals[i], nullptr, &current);
      if (current.sa_handler == SIG_IGN) continue;
      sigaction(kForwardedSignals[i], &action, &old_actions_[i]);
      installed_[i] = true;
    }
    struct sigaction pass_on{};
    pass_on.sa_handler = PassOnSignal;
    sigemptyset(&pass_on.sa_mask);
    pass_on.sa_flags = SA_RESTART;
    for (size_t i = 0; i < std::size(kPassedOnSignals); ++i) {
      // Ignored stays ignored, as above.
      struct sigaction current{};
      sigaction(kPassedOnSignals[i], nullptr, &current);
      if (current.sa_handler == SIG_IGN) continue;
      sigaction(kPassedOnSignals[i], &pass_on, &passed_on_old_[i]);
      passed_on_installed_[i] = true;
    }
    // Held since a group before this one (they came while its workers
    // were stopping, or after its Wait): this group's workers get them once
    // they catch them (PassOnHeldOnceCaught).
    held_ = g_held_passed_on.exchange(0, std::memory_order_relaxed);
    const auto now = Clock::now();
    hold_until_ = options_.hold_signal_for >= std::chrono::duration_cast<std::chrono::milliseconds>(
                                                  Deadline::max() - now)
                      ? Deadline::max()
                      : now + options_.hold_signal_for;
    next_held_look_ = now;
    forwarding_ = true;
    return Status::Ok();
  }

  // Workers read this process's stdin, as torchrun's do (it starts them
  // without redirecting it): input piped into the launcher reaches them,
  // and a debugger in a lone worker takes its commands from the pipe. All
  // workers share the one descriptor; who reads which bytes is up to them.
  // None of it holds the launcher up: it never reads stdin itself, a worker
  // blocked in a read ends on SIGTERM (or SIGKILL after the grace) like any
  // other, and one that reads the terminal from its background process group
  // is stopped by SIGTTIN, which Wait reports (StoppedByTheTerminal).
  // Only when stdin is closed here, or close-on-exec (some descriptor of
  // the host program that took number 0), do the workers get /dev/null
  // instead: else the first file a worker opened would become its stdin.
  Status ChooseWorkersStdin() {
    const int flags = fcntl(STDIN_FILENO, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) == 0) return Status::Ok();
    const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      return SetupError(err, "cannot open /dev/null for the workers' stdin: " + ErrnoText(err));
    }
    if (fd > STDERR_FILENO) {
      dev_null_.Reset(fd);
      return Status::Ok();
    }
    // It took a free standard number (0, stdin being closed): the child's
    // dup3 onto the same number would fail, so move it above them.
    dev_null_.Reset(fcntl(fd, F_DUPFD_CLOEXEC, STDERR_FILENO + 1));
    const int dup_errno = errno;
    close(fd);
    if (!dev_null_.valid()) {
      return SetupError(dup_errno, "cannot move /dev/null above stderr for the workers' stdin (fcntl F_DUPFD_CLOEXEC: " +
                                       ErrnoText(dup_errno) + ")");
    }
    return Status::Ok();
  }

  // Why rank `rank` could not start: no `what` (pipe2 failed with `err`).
  // Out of descriptors, with the limit that ran out: each worker holds a
  // few while it runs (its output pipes, its pidfd, its log files), so a
  // large group meets `ulimit -n` halfway through its start.
  static Status PipeError(int rank, const std::string& what, int err) {
    std::string text = "cannot start rank " + std::to_string(rank) + ": cannot make " + what + " (pipe2: " +
                       ErrnoText(err) + ")";
    if (err == EMFILE) {
      text += DescriptorLimitText();
      text += ", and each running worker holds a few (its output pipes, its pidfd, its log files); raise "
              "the limit or start fewer workers";
    }
    return err == EMFILE || err == ENFILE ? ResourceExhaustedError(text) : InternalError(text);
  }

  Status StartOne(const WorkerSpec& spec, Worker& w) {
    w.rank = spec.rank;
    w.line_prefix = spec.line_prefix.empty() ? "[" + std::to_string(spec.rank) + "] " : spec.line_prefix;
    const OutputOptions& out = options_.output;
    const bool to_terminal = out.to_terminal &&
                             (out.terminal_ranks.empty() ||
                              std::find(out.terminal_ranks.begin(), out.terminal_ranks.end(), spec.rank) !=
                                  out.terminal_ranks.end());
    for (int s = 0; s < 2; ++s) w.streams[s].to_terminal = to_terminal && (spec.shown_streams & (1 << s)) != 0;
    // torchrun's layout: a folder per worker, its streams in files of their own.
    const std::string folder = LogFolder(out, spec);
    if (!out.log_dir.empty()) DDP_RETURN_IF_ERROR(MakeDirectories(folder));
    if (!out.log_dir.empty() && out.log_files) {
      for (int s = 0; s < 2; ++s) {
        if ((spec.logged_streams & (1 << s)) == 0) continue;  // as torchrun: no file for it
        const std::string path = folder + (s == 0 ? "/stdout.log" : "/stderr.log");
        // Non-blocking: a FIFO there with no reader would hold the open
        // up for good (ENXIO instead), one whose reader stops would hold
        // the writes up (see WriteAll).
        w.streams[s].log.Reset(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK, 0644));
        if (!w.streams[s].log.valid()) {
          const int err = errno;
          std::string why;  // ENXIO: a FIFO without a reader, a socket, a device without a driver
          struct stat st{};
          if (err == ENXIO && stat(path.c_str(), &st) == 0) {
            why = S_ISFIFO(st.st_mode) ? " (a FIFO that nobody reads)"
                  : S_ISSOCK(st.st_mode) ? " (a UNIX socket, which cannot be opened as a file)"
                  : (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) ? " (a device with no driver behind it)"
                                                                  : "";
          }
          return StartError(err, "cannot write log file '" + path + "': " + ErrnoText(err) + why);
        }
        w.streams[s].log_path = path;
      }
    }
    // A spec's own TORCHELASTIC_ERROR_FILE (its last entry) is where the
    // worker writes, so it is read there too; empty: the worker has none.
    const std::optional<std::string> own_error_file = OwnErrorFile(spec);
    if (options_.error_files && own_error_file) {
      w.error_path = *own_error_file;
    } else if (options_.error_files && (!out.log_dir.empty() || !error_dir_.empty())) {
      w.error_path = out.log_dir.empty() ? error_dir_ + "/rank_" + std::to_string(spec.rank) + ".error.json"
                                         : folder + "/error.json";
    }
    if (!w.error_path.empty()) {
      // One left by an earlier run would be taken for this worker's. Only
      // a regular file is removed (checked again here: CheckSpecs looked
      // at a spec's own one a moment ago, not at the group's).
      DDP_RETURN_IF_ERROR(CheckErrorFileKind(w.error_path, "rank " + std::to_string(spec.rank)));
      if (unlink(w.error_path.c_str()) != 0 && errno != ENOENT) {
        const int err = errno;
        return InvalidArgumentError("cannot remove the old error file '" + w.error_path + "': " + ErrnoText(err));
      }
    }
    Fd child_out, child_err;
    if (use_pipes_) {
      for (int s = 0; s < 2; ++s) {
        int p[2];
        if (pipe2(p, O_CLOEXEC) != 0) return PipeError(spec.rank, "a pipe for its output", errno);
        fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK);
        w.streams[s].pipe.Reset(p[0]);
        (s == 0 ? child_out : child_err).Reset(p[1]);
      }
    }

    // Argument and environment vectors, built before vfork: the child may
    // not allocate.
    std::vector<char*> argv;
    for (const std::string& arg : spec.argv) argv.push_back(const_cast<char*>(arg.c_str()));
    argv.push_back(nullptr);
    std::vector<std::pair<std::string, std::string>> spec_env;
    if (!w.error_path.empty()) spec_env.emplace_back(kEnvErrorFile, w.error_path);
    spec_env.insert(spec_env.end(), spec.env.begin(), spec.env.end());
    std::vector<std::string> env_strings;
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      std::string_view entry(*e);
      const std::string_view name = entry.substr(0, entry.find('='));
      // Without an error file of its own, a worker gets none: the
      // launcher's own (from whoever started the launcher) is not the
      // workers' to write, and each would overwrite the others' there.
      bool overridden = w.error_path.empty() && name == kEnvErrorFile;
      for (const auto& [key, value] : spec_env) overridden = overridden || key == name;
      if (!overridden) env_strings.emplace_back(entry);
    }
    for (size_t i = 0; i < spec_env.size(); ++i) {
      bool later = false;  // a later entry with the same name wins
      for (size_t j = i + 1; j < spec_env.size(); ++j) later = later || spec_env[j].first == spec_env[i].first;
      if (!later) env_strings.push_back(spec_env[i].first + "=" + spec_env[i].second);
    }
    std::vector<char*> envp;
    for (std::string& entry : env_strings) envp.push_back(entry.data());
    envp.push_back(nullptr);

    ChildArgs args;
    args.path = spec.program.c_str();
    args.argv = argv.data();
    args.envp = envp.data();
    args.pgid = pgid_;
    args.parent = getpid();
    args.stdin_fd = dev_null_.get();  // -1 (inherit) unless ChooseWorkersStdin opened it
    args.stdout_fd = child_out.get();
    args.stderr_fd = child_err.get();
    args.fd_bound = DescriptorBound();
    args.skip_close_range = g_force_close_range_fallback.load(std::memory_order_relaxed);
    for (int s = 1; s < _NSIG; ++s) {
      struct sigaction current{};
      if (sigaction(s, nullptr, &current) == 0) args.ignored[s] = current.sa_handler == SIG_IGN;
    }
    // Ignored here only while the workers hold the terminal: theirs is what
    // this process had.
    if (ttou_ignored_) args.ignored[SIGTTOU] = ttou_old_.sa_handler == SIG_IGN;
    const bool first = &w == &workers_[0];
    args.take_terminal = launcher_pgrp_ > 0 && first;
    if (first && pgid_ == 0) args.watcher_fd = watcher_write_.get();

    int report[2];
    if (pipe2(report, O_CLOEXEC) != 0) return PipeError(spec.rank, "a pipe to hear its start", errno);
    Fd report_read(report[0]);
    Fd report_write(report[1]);
    args.report_fd = report_write.get();
    // Started before vfork holds this thread: the exec's deadline.
    // A process that may start no more threads (RLIMIT_NPROC, which counts
    // them) could not start the worker either: the same shortage.
    ExecWatchResult watched;
    std::thread watch;
    // Told when vfork returned (without one, the watch waits for the end of
    // the pipe as well).
    Fd vfork_returned(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    try {
      watch = std::thread([&watched, fd = report_read.get(), done = vfork_returned.get(),
                           timeout = options_.exec_timeout] {
        watched = WatchExec(fd, done, DeadlineIn(timeout), timeout);
      });
    } catch (const std::system_error& e) {
      const int err = e.code().value();
      const std::string text = "cannot start rank " + std::to_string(spec.rank) +
                               ": cannot start the thread that watches its exec: " + e.what();
      return OutOfResources(err) ? ResourceExhaustedError(text) : InternalError(text);
    }
    // Block every signal so that no handler runs in the child while it
    // shares our memory; the child restores the mask right before exec.
    sigset_t all;
    sigfillset(&all);
    sigset_t launcher_mask;
    pthread_sigmask(SIG_SETMASK, &all, &launcher_mask);
    // A worker starts with SIGPIPE at its default and unblocked, as from a
    // shell, whatever this thread blocks: blocked, `train | head` would
    // leave it writing into a closed pipe instead of ending.
    args.mask = launcher_mask;
    sigdelset(&args.mask, SIGPIPE);
    sigemptyset(&args.sigpipe_only);
    sigaddset(&args.sigpipe_only, SIGPIPE);
    // vfork, not fork: the parent waits until the child has exec'd, nothing
    // is copied, and no pthread_atfork handler runs (a transport fork guard
    // would otherwise fire in every worker). ThreadSanitizer turns vfork into
    // a fork that runs those handlers; there a raw clone without CLONE_VM
    // (a fork that bypasses libc and the sanitizer) does the same job.
#if defined(__SANITIZE_THREAD__)
    const pid_t pid = static_cast<pid_t>(syscall(SYS_clone, SIGCHLD, 0, nullptr, nullptr, 0));
#else
    const pid_t pid = vfork();
#endif
    if (pid == 0) RunChild(&args);
    const int vfork_errno = errno;
    pthread_sigmask(SIG_SETMASK, &launcher_mask, nullptr);
    // Our write end closed, the watch ends at the child's exec or death
    // (or at once, without a child).
    report_write.Reset();
    if (vfork_returned.valid()) {
      const uint64_t one = 1;
      ssize_t put = write(vfork_returned.get(), &one, sizeof(one));
      (void)put;
    }
    watch.join();
    if (pid < 0) {
      const std::string text = "cannot start rank " + std::to_string(spec.rank) + ": vfork: " + ErrnoText(vfork_errno);
      return OutOfResources(vfork_errno) ? ResourceExhaustedError(text) : InternalError(text);
    }
    w.pid = pid;
    w.running = true;
    w.exit.rank = w.rank;
    w.exit.pid = pid;
    ChildFailure failure;
    // A child's own report of a failed step wins over the deadline that
    // came as it failed.
    const bool step_failed = watched.bytes.size() >= sizeof(pid_t) + sizeof(failure);
    if (step_failed) std::memcpy(&failure, watched.bytes.data() + sizeof(pid_t), sizeof(failure));
    if (step_failed || watched.timed_out) {
      // A first worker that took the terminal before its exec failed: back
      // to this process's group (SIGTTOU is ignored), before its pid, the
      // terminal's group id, is reaped.
      if (args.take_terminal && tcgetpgrp(STDIN_FILENO) == (pgid_ != 0 ? pgid_ : pid)) {
        tcsetpgrp(STDIN_FILENO, launcher_pgrp_);
      }
      // It may have told the watcher its pid as the group's id, which the
      // reap below frees for reuse: the watcher leaves first (Start fails
      // now, and nothing else runs yet).
      if (args.watcher_fd >= 0) StopWatcher();
      // The child is dead (exit 127) or dying (killed by the watch, which
      // vfork's return shows); reap it here.
      int status = 0;
      waitpid(pid, &status, 0);
      w.running = false;
      w.exit.exited = true;
      w.exit.code = 127;
      if (!step_failed) {
        return TimedOutError("cannot start rank " + std::to_string(spec.rank) + ": exec '" + spec.program +
                             "' did not finish within " + std::to_string(options_.exec_timeout.count()) +
                             " ms (a file system that does not answer, such as a hung network mount, or a "
                             "lease or delegation held on the file), so it was killed");
      }
      return StartError(failure.error, "cannot start rank " + std::to_string(spec.rank) + ": " +
                                           ChildStepName(failure.step) + " '" + spec.program +
                                           "': " + ErrnoText(failure.error) +
                                           (failure.step == kStepExec ? ExecFailureHint(spec.program, failure.error)
                                                                      : ""));
    }
    if (first) {
      if (pgid_ == 0) pgid_ = pid;
      if (launcher_pgrp_ > 0) {
        terminal_shared_ = tcgetpgrp(STDIN_FILENO) == pgid_;
        if (!terminal_shared_) TakeTerminalBack();  // not handed over: nothing to undo but SIGTTOU
      }
    }
    w.pidfd.Reset(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
    if (w.pidfd.valid()) fcntl(w.pidfd.get(), F_SETFD, FD_CLOEXEC);
    return Status::Ok();
  }

  size_t RunningCount() const {
    size_t n = 0;
    for (const Worker& w : workers_) n += w.running ? 1 : 0;
    return n;
  }

  size_t OpenPipes() const {
    size_t n = 0;
    for (const Worker& w : workers_) {
      for (const Stream& s : w.streams) n += s.pipe.valid() ? 1 : 0;
    }
    return n;
  }

  // To the whole process group, as torchrun's killpg: a worker that is a
  // script (`sh run.sh` running python without exec) or has children of its
  // own (data loaders) gets the signal in every process, so each may end
  // cleanly within the grace period, while the id is still the workers'
  // group (GroupIdHeld; the leader's zombie is reaped last, see Observe). A
  // worker that moved to a group of its own (setsid) gets the signal
  // through its pidfd (SignalWorker); no process gets it twice.
  void SignalRunning(int signal) {
    if (pgid_ > 0) {
      SignalGroup(signal);
      // A stopped process acts on the signal only once continued.
      if (signal != SIGKILL) SignalGroup(SIGCONT);
    }
    for (Worker& w : workers_) {
      if (!w.running || (pgid_ > 0 && getpgid(w.pid) == pgid_)) continue;
      SignalWorker(w, signal);
      if (signal != SIGKILL) SignalWorker(w, SIGCONT);
    }
  }

  // As SignalRunning, for a signal that asks the workers for something
  // (kPassedOnSignals) rather than to end: a stopped worker is left stopped.
  // A held SIGUSR1 or SIGUSR2 (held_) goes to the workers once every
  // running one has a handler for it (or ignores it): sent at their start,
  // before a program set its handler up, its default action would kill
  // them. Looked at once a second at most (kHeldSignalLookEvery); one still
  // held hold_signal_for after the group's start is dropped, and on_notice
  // is told. One the workers did not get before they ended goes back to
  // the next group (~Impl).
  void PassOnHeldOnceCaught() {
    for (const int signo : kPassedOnSignals) {
      const int bit = PassedOnBit(signo);
      if ((held_ & bit) == 0 || RunningCount() == 0) continue;
      if (!EveryRunningWorkerTakes(signo)) {
        if (Clock::now() < hold_until_) continue;
        held_ &= ~bit;
        if (options_.on_notice) {
          options_.on_notice("dropped " + SignalName(signo) + ": a worker had no handler for it " +
                             std::to_string(options_.hold_signal_for.count()) +
                             " ms after the workers' start (hold_signal_for), and its default action would "
                             "end it");
        }
        continue;
      }
      held_ &= ~bit;
      PassOnToRunning(signo);
      if (options_.on_notice) {
        options_.on_notice("passed " + SignalName(signo) +
                           " on to the workers (held until each had a handler for it)");
      }
    }
  }

  bool EveryRunningWorkerTakes(int signo) const {
    for (const Worker& w : workers_) {
      if (w.running && !TakesSignal(w.pid, signo)) return false;
    }
    return true;
  }

  // Whether `pid` catches or ignores `signo` (SigCgt, SigIgn in
  // /proc/<pid>/status); true when that cannot be read (no /proc): then it
  // goes as it would have at once.
  static bool TakesSignal(pid_t pid, int signo) {
    g_signal_handler_looks.fetch_add(1, std::memory_order_relaxed);
    std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/status").c_str(), "re");
    if (f == nullptr) return true;
    unsigned long long caught = 0, ignored = 0;
    bool found = false;
    char line[256];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      if (std::sscanf(line, "SigCgt: %llx", &caught) == 1) found = true;
      std::sscanf(line, "SigIgn: %llx", &ignored);
    }
    std::fclose(f);
    if (!found) return true;
    const unsigned long long bit = 1ULL << (signo - 1);
    return ((caught | ignored) & bit) != 0;
  }

  void PassOnToRunning(int signal) {
    if (pgid_ > 0) SignalGroup(signal);
    for (Worker& w : workers_) {
      if (!w.running || (pgid_ > 0 && getpgid(w.pid) == pgid_)) continue;
      SignalWorker(w, signal);
    }
  }

  // To worker `w` alone, through its pidfd where there is one: a worker
  // reaped by someone else since the last look may have left its pid to a
  // stranger, whom kill(pid) would hit; the pidfd names the worker only
  // (ESRCH once it is gone). kill where the kernel has no pidfd (before
  // Linux 5.3 for pidfd_open, 5.1 for pidfd_send_signal).
  static void SignalWorker(const Worker& w, int signal) {
    if (w.pidfd.valid()) {
      if (syscall(SYS_pidfd_send_signal, w.pidfd.get(), signal, nullptr, 0) == 0 || errno != ENOSYS) return;
    }
    kill(w.pid, signal);
  }

  // SpawnOptions::share_terminal: the terminal back to this process's group
  // if the workers' group still has it (not if someone else took it since),
  // and SIGTTOU back to what it was. Idempotent.
  void TakeTerminalBack() {
    if (terminal_shared_ && pgid_ > 0 && tcgetpgrp(STDIN_FILENO) == pgid_) {
      tcsetpgrp(STDIN_FILENO, launcher_pgrp_);  // SIGTTOU is still ignored here
    }
    terminal_shared_ = false;
    lent_back_ = false;
    if (ttou_ignored_) sigaction(SIGTTOU, &ttou_old_, nullptr);
    ttou_ignored_ = false;
  }

  // Ctrl-C, Ctrl-\ and a hangup reach the foreground group only: while the
  // workers hold the terminal, a worker killed by one of them is this
  // process's interruption.
  static bool IsTerminalSignal(int signal) { return signal == SIGINT || signal == SIGQUIT || signal == SIGHUP; }

  // Ctrl-Z reached the workers only (they hold the terminal), and whoever
  // runs this process (a shell) waits on this process's group. As a shell
  // does with a job: stop every worker (one that ignores SIGTSTP too), take
  // the terminal back and stop this process's group by `signal`, so that
  // the shell sees the job stopped and gets its terminal. kill returns once
  // this process is continued, or at once where the signal is ignored or
  // the group is orphaned (no job control could continue it; the kernel
  // drops the signal). Continued in the foreground (`fg`), the workers get
  // the terminal again; in the background (`bg`) they run on without it
  // until a later `fg` (lent_back_). Also for a worker stopped by SIGTTIN
  // or SIGTTOU meanwhile, as a shell's background job is stopped by them.
  void StopLikeAJob(int signal) {
    SignalGroup(SIGSTOP);
    // Before the terminal goes: a worker woken inside a read of it, not
    // yet stopped, would still take what is typed next into the shell.
    const Deadline give_up = Clock::now() + kStopTime;
    while (Clock::now() < give_up &&
           !std::all_of(workers_.begin(), workers_.end(), [](const Worker& w) { return StoppedOrGone(w); })) {
      usleep(1000);
    }
    if (tcgetpgrp(STDIN_FILENO) == pgid_) tcsetpgrp(STDIN_FILENO, launcher_pgrp_);
    terminal_shared_ = false;
    lent_back_ = true;
    kill(0, signal);
    if (tcgetpgrp(STDIN_FILENO) == launcher_pgrp_) {
      ResumeWithTheTerminal();
    } else {
      SignalGroup(SIGCONT);
    }
  }

  // This process's group is the terminal's foreground one again, while the
  // terminal was lent back to it (StopLikeAJob): the workers get it again,
  // and go on (one stopped for touching it meanwhile too). SIGTTOU is still
  // ignored here.
  void ResumeWithTheTerminal() {
    if (tcsetpgrp(STDIN_FILENO, pgid_) == 0) {
      terminal_shared_ = true;
      lent_back_ = false;
    }
    SignalGroup(SIGCONT);
  }

  // SIGTTIN or SIGTTOU when a running worker is stopped by one (it touched
  // the terminal from the background), else 0.
  int TerminalStopOfAny() const {
    for (const Worker& w : workers_) {
      if (!w.running) continue;
      const int signal = StopSignalOf(w);
      if (signal == SIGTTIN || signal == SIGTTOU) return signal;
    }
    return 0;
  }

  // Whether this group's handler records `signal` (SIGINT, SIGTERM, SIGHUP
  // or SIGQUIT that this process did not ignore).
  bool Catches(int signal) const {
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      if (kForwardedSignals[i] == signal) return forwarding_ && installed_[i];
    }
    return false;
  }

  bool AnyStoppedBy(int signal) const {
    for (const Worker& w : workers_) {
      if (w.running && StopSignalOf(w) == signal) return true;
    }
    return false;
  }

  // Whether worker `w` is stopped, has exited (its exit left to Observe),
  // or was observed to have exited.
  static bool StoppedOrGone(const Worker& w) {
    if (!w.running || StopSignalOf(w) != 0) return true;
    siginfo_t info{};
    return waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == w.pid;
  }

  // The signal that stopped running worker `w`, or 0 when it is not stopped.
  static int StopSignalOf(const Worker& w) {
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(w.pid), &info, WSTOPPED | WNOHANG | WNOWAIT) != 0 ||
        info.si_pid != w.pid || info.si_code != CLD_STOPPED) {
      return 0;
    }
    return info.si_status;
  }

  // Tells on_notice of workers stopped otherwise than by the terminal, once
  // per stop, and of their continuing: the launcher says nothing else
  // while the peers wait for a stopped rank until their timeout. Without
  // `terminal_stops_too`, those stopped by SIGTTIN or SIGTTOU are left out
  // (the terminal lent back: they stop the job instead).
  void TellStops(bool terminal_stops_too) {
    if (!options_.on_notice) return;
    for (Worker& w : workers_) {
      if (!w.running) continue;
      const int signal = StopSignalOf(w);
      if (!terminal_stops_too && (signal == SIGTTIN || signal == SIGTTOU)) continue;
      const std::string who = "rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ")";
      if (signal != 0 && !w.stop_told) {
        w.stop_told = true;
        options_.on_notice(who + " is stopped (" + SignalName(signal) +
                           "); the other ranks wait for it until their timeout; SIGCONT continues it");
      } else if (signal == 0 && w.stop_told) {
        w.stop_told = false;
        options_.on_notice(who + " continues");
      }
    }
  }

  // A running worker stopped by SIGTTOU or SIGTTIN: it touched the terminal
  // from its background process group, and would wait there forever (a
  // stop wakes no pidfd). Stopped otherwise (SIGSTOP, a debugger), it is
  // left to whoever stopped it.
  std::optional<std::string> StoppedByTheTerminal() const {
    for (const Worker& w : workers_) {
      if (!w.running) continue;
      const int signal = StopSignalOf(w);
      if (signal != SIGTTOU && signal != SIGTTIN) continue;
      // Reading is the one a user can mend: workers read the launcher's
      // stdin (ChooseWorkersStdin), which may be a pipe or a file.
      return "rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") was stopped by " +
             SignalName(signal) + ": it " + (signal == SIGTTOU ? "wrote to or changed" : "read from") +
             " the terminal, which workers (in a process group of their own) may not do" +
             (signal == SIGTTIN ? " (give the launcher its input from a pipe or a file instead)" : "");
    }
    return std::nullopt;
  }

  // Appends to one stream's log file, after what an earlier write left; the
  // first write that fails (a full disk, a reader that stopped) closes it
  // and is reported in the result, naming the file. A write cut short by
  // the watch's deadline (`wait_deadline`) keeps the rest for the next
  // write, or for the log's turn in the poll: the log goes on taking what
  // the workers say while they are stopped, which tells how the job ended.
  static void WriteLog(Worker& w, Stream& stream, std::string_view data, Deadline wait_deadline) {
    if (!stream.log.valid()) return;
    size_t taken = 0;
    std::string failure;
    if (!stream.log_pending.empty()) {
      stream.log_pending.append(data);
      const Deadline hold_until = std::min(stream.log_pending_began + kTerminalStallTime, wait_deadline);
      failure = WritePending(stream.log.get(), stream.log_pending, hold_until, &stream.log_pending_since, &taken);
      stream.log_pending.erase(0, taken);
    } else {
      const Deadline began = Clock::now();
      failure = WriteAll(stream.log.get(), data, began + kTerminalStallTime, wait_deadline, &taken);
      if (failure.empty() && taken < data.size()) {
        stream.log_pending.assign(data.substr(taken));
        stream.log_pending_began = began;
        // The reader's stall is counted from when it last took bytes.
        stream.log_pending_since = taken > 0 ? Clock::now() : began;
      }
    }
    stream.log_bytes += taken;
    if (!failure.empty()) StopLog(w, stream, failure);
  }

  static void StopLog(Worker& w, Stream& stream, const std::string& why) {
    w.log_failures.push_back("rank " + std::to_string(w.rank) + "'s log file '" + stream.log_path +
                             "' stopped after " + std::to_string(stream.log_bytes) + " bytes: " + why);
    stream.log.Reset();
    stream.log_pending.clear();
  }

  // At the end of Wait: what the logs' readers have not taken of what the
  // watch's deadlines cut short gets one more try, without waiting (Wait
  // has had its time); a log left with some is reported.
  void FinishLogs() {
    for (Worker& w : workers_) {
      for (Stream& stream : w.streams) {
        if (!stream.log.valid() || stream.log_pending.empty()) continue;
        WriteLog(w, stream, "", Clock::now());
        if (stream.log.valid() && !stream.log_pending.empty()) {
          StopLog(w, stream, "Wait ended with " + std::to_string(stream.log_pending.size()) +
                                 " bytes its reader had not taken (a reader that reads too slowly)");
        }
      }
    }
  }

  // `wait_deadline`: the watch's next deadline, which a log write may not
  // pass (see WriteAll).
  void ReadStream(Worker& w, int s, Deadline wait_deadline) {
    Stream& stream = w.streams[s];
    char buf[kReadChunk];
    const ssize_t n = read(stream.pipe.get(), buf, sizeof(buf));
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n <= 0) {
      FlushPartial(w, s);
      stream.pipe.Reset();
      return;
    }
    const std::string_view data(buf, static_cast<size_t>(n));
    WriteLog(w, stream, data, wait_deadline);
    if (options_.output.capture) {
      const size_t room = options_.output.capture_limit - std::min(options_.output.capture_limit,
                                                                  w.captured.size());
      w.captured.append(data.substr(0, room));
      if (data.size() > room) w.capture_truncated = true;
    }
    if (!stream.to_terminal) return;
    if (!options_.output.prefix) {
      terminals_[s].Write(data);
      return;
    }
    stream.partial.append(data);
    size_t begin = 0;
    while (true) {
      const size_t newline = stream.partial.find('\n', begin);
      if (newline == std::string::npos) break;
      WriteLine(w, s, std::string_view(stream.partial).substr(begin, newline + 1 - begin));
      begin = newline + 1;
    }
    stream.partial.erase(0, begin);
    if (stream.partial.size() >= kMaxLineBytes) {
      WriteLine(w, s, stream.partial + "\n");
      stream.partial.clear();
    }
  }

  void FlushPartial(Worker& w, int s) {
    Stream& stream = w.streams[s];
    if (stream.partial.empty()) return;
    if (stream.to_terminal && options_.output.prefix) WriteLine(w, s, stream.partial + "\n");
    stream.partial.clear();
  }

  // One whole line with its prefix in a single write, so that lines of
  // different workers never interleave mid-line.
  void WriteLine(const Worker& w, int s, std::string_view line) {
    std::string text = w.line_prefix;
    text.append(line);
    terminals_[s].Write(text);
  }

  // SIGKILLs everything still running and reaps it, within kReapTime.
  void KillAndReap() {
    // While the leader, whose pid the terminal's group is compared with,
    // is not yet reaped.
    TakeTerminalBack();
    StopListener();
    if (RunningCount() == 0) {
      StopWatcher();
      ReapZombies();
      return;
    }
    SignalRunning(SIGKILL);
    const Deadline give_up = Clock::now() + kReapTime;
    while (RunningCount() > 0 && Clock::now() < give_up) {
      for (Worker& w : workers_) {
        if (w.running) Observe(w);
      }
      if (RunningCount() > 0) usleep(5000);
    }
    if (pgid_ > 0) SignalGroup(SIGKILL);
    StopWatcher();
    ReapZombies();
  }

  // The watcher: a small process outside the group that kills the whole
  // group when this launcher dies without having ended it (SIGKILL, a
  // crash). The workers die of their death signal anyway, but their own
  // children do not have it; the watcher reads a pipe whose only writers
  // are this process and, until its exec, the first worker (which writes
  // the group's id when it leads the group), and on end-of-file, which the
  // kernel delivers however the launcher died, sends SIGKILL to the group.
  // A launcher that ends the group itself writes a 0 first, and the
  // watcher leaves without killing anything (the group id may be a
  // stranger's by then). Started before any worker (see Start).
  //
  // Started with a bare clone, as the workers are under ThreadSanitizer: no
  // pthread_atfork handler runs, and the child makes raw system calls only
  // (the parent may have other threads holding locks). It blocks every
  // signal, so that a Ctrl-C to the launcher's terminal leaves it alone
  // (the launcher handles that), and holds no descriptor but the pipe.
  // It runs in a process group of its own, neither the launcher's nor the
  // workers'.
  Status StartWatcher() {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
      const int err = errno;
      return SetupError(err, "cannot make the pipe to the process that watches the workers' process group (pipe2: " +
                                 ErrnoText(err) + ")");
    }
    Fd read_end(p[0]);
    watcher_write_.Reset(p[1]);
    sigset_t all, old_mask;
    sigfillset(&all);
    WatcherArgs args;
    args.read_fd = read_end.get();
    args.group = pgid_;  // 0 until the first worker leads the group: it tells
    // share_terminal: the group to give the terminal back to, should the
    // workers' group hold it (it runs before the first worker took it; one
    // that did not take it leaves it elsewhere).
    args.launcher_group = launcher_pgrp_;
    // Made before the watcher (Start): the watcher removes it should this
    // process die without doing so.
    if (error_dir_.size() < sizeof(args.error_dir)) {
      std::memcpy(args.error_dir, error_dir_.c_str(), error_dir_.size() + 1);
    }
    args.fd_bound = DescriptorBound();
    args.skip_close_range = g_force_close_range_fallback.load(std::memory_order_relaxed);
    // Every signal blocked across the clone, as in StartOne: a signal that
    // came between the clone and the child's own mask would run this
    // process's handler in the copy, which writes the signal's byte into
    // the signal pipe it shares with us (one Ctrl-C counted twice: SIGKILL
    // for the workers without their grace period). The child keeps the
    // full mask.
    pthread_sigmask(SIG_SETMASK, &all, &old_mask);
    const pid_t pid = static_cast<pid_t>(syscall(SYS_clone, SIGCHLD, 0, nullptr, nullptr, 0));
    if (pid == 0) RunWatcher(&args);
    const int clone_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    if (pid < 0) {
      const int err = clone_errno;
      watcher_write_.Reset();
      return SetupError(err, "cannot start the process that watches the workers' process group: clone: " +
                                 ErrnoText(err));
    }
    watcher_ = pid;
    return Status::Ok();
  }

  // The listener (SpawnOptions::share_terminal): a small process that
  // leads the workers' group (made before them, so that no worker holds
  // the terminal before it listens), where the terminal sends its signals
  // while the workers hold it. It tells this process of each SIGINT, SIGQUIT, SIGHUP and
  // SIGTSTP the terminal sent (one byte each on a pipe), whatever the
  // workers do with them: a worker that catches Ctrl-C and exits 1 is
  // still an interrupted job (no restart, as under torchrun, where the
  // terminal's signal reaches the launcher itself), and Ctrl-Z wakes Wait
  // at once (a stop wakes no pidfd). Signals sent by a process (SI_USER:
  // those this process forwards to the group, say) are not the terminal's
  // and are dropped. Every signal stays blocked there; it takes them with
  // rt_sigtimedwait, so none ever acts on it but SIGKILL and SIGSTOP.
  //
  // ListenerQuerySignal() from this process asks it to answer (a kListenerAnswer
  // byte) once it has told all it heard before: the terminal's signal is
  // pending in the listener before any worker can have died of it (the
  // kernel signals the group in one pass, which an exit waits for), and
  // rt_sigtimedwait takes lower signals first, so the answer comes after
  // the news of it. Started like the watcher (a bare clone, raw system
  // calls only); killed with the group, or by SIGKILL when this process
  // dies. Where it cannot start, the first worker leads the group.
  void StartListener() {
    int p[2];
    if (pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) return;
    Fd read_end(p[0]);
    Fd write_end(p[1]);
    sigset_t all, old_mask;
    sigfillset(&all);
    ListenerArgs args;
    args.write_fd = write_end.get();
    sigemptyset(&args.wanted);
    for (int signo : {SIGINT, SIGQUIT, SIGHUP, SIGTSTP, ListenerQuerySignal()}) sigaddset(&args.wanted, signo);
    args.query = ListenerQuerySignal();
    args.answer = kListenerAnswer;
    args.parent = getpid();
    args.fd_bound = DescriptorBound();
    args.skip_close_range = g_force_close_range_fallback.load(std::memory_order_relaxed);
    pthread_sigmask(SIG_SETMASK, &all, &old_mask);  // as in StartWatcher; the child keeps it
    const pid_t pid = static_cast<pid_t>(syscall(SYS_clone, SIGCHLD, 0, nullptr, nullptr, 0));
    if (pid == 0) RunListener(&args);
    pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    if (pid < 0) return;
    listener_ = pid;
    if (setpgid(pid, pid) != 0 && getpgid(pid) != pid) {
      StopListener();  // workers lead their own group then
      return;
    }
    // The workers join its group, whose id it keeps while it is unreaped
    // (StopListener, last), as the first worker's zombie keeps it without.
    pgid_ = pid;
    listener_read_ = std::move(read_end);
  }

  // The signal the listener answers (a real-time one: after every standard
  // signal it may have pending), and its answer.
  static int ListenerQuerySignal() { return SIGRTMIN + 1; }
  static constexpr unsigned char kListenerAnswer = 0;

  // Appends what the listener told to `heard`. With `until_answer`, asks it
  // first and waits for the answer (at most kListenerAnswerTime: a
  // listener that does not answer, stopped by someone, is left out).
  // A listener that is gone (killed with the group) is no longer read.
  void ReadListener(std::vector<int>& heard, bool until_answer) {
    if (until_answer && kill(listener_, ListenerQuerySignal()) != 0) until_answer = false;
    const Deadline give_up = Clock::now() + kListenerAnswerTime;
    while (listener_read_.valid()) {
      unsigned char bytes[64];
      const ssize_t got = read(listener_read_.get(), bytes, sizeof(bytes));
      if (got == 0) {
        listener_read_.Reset();
        return;
      }
      bool answered = false;
      for (ssize_t j = 0; j < got; ++j) {
        if (bytes[j] == kListenerAnswer) {
          answered = true;
        } else {
          heard.push_back(bytes[j]);
        }
      }
      if (!until_answer || answered) return;
      if (got < 0 && errno != EAGAIN && errno != EINTR) return;
      const int left = MillisecondsUntil(give_up);
      if (left == 0) return;
      pollfd p{listener_read_.get(), POLLIN, 0};
      poll(&p, 1, left);
    }
  }

  // Kills the listener (it may still run, its group alive) and reaps it
  // (bounded).
  void StopListener() {
    listener_read_.Reset();
    if (listener_ <= 0) return;
    kill(listener_, SIGKILL);
    const Deadline give_up = Clock::now() + kReapTime;
    pid_t reaped = 0;
    while ((reaped = waitpid(listener_, nullptr, WNOHANG)) == 0 && Clock::now() < give_up) usleep(1000);
    // Reaped (or no longer ours: ECHILD), its pid is free; should it lead
    // the group, LeaderUnreaped must not ask waitid about that pid again.
    if (listener_ == pgid_ && (reaped == listener_ || (reaped < 0 && errno == ECHILD))) leader_reaped_ = true;
    listener_ = -1;
  }

  // Tells the watcher to leave without killing, and reaps it (bounded).
  void StopWatcher() {
    if (watcher_ <= 0) return;
    const pid_t disarm = 0;  // see RunWatcher
    // A watcher someone killed left the pipe without a reader: EPIPE, not
    // SIGPIPE, whose default action would end this process.
    ssize_t n;
    do {
      n = WriteWithoutSigpipe(watcher_write_.get(),
                              std::string_view(reinterpret_cast<const char*>(&disarm), sizeof(disarm)));
    } while (n < 0 && errno == EINTR);
    watcher_write_.Reset();
    const Deadline give_up = Clock::now() + kReapTime;
    while (waitpid(watcher_, nullptr, WNOHANG) == 0) {
      if (Clock::now() >= give_up) {
        kill(watcher_, SIGKILL);
        waitpid(watcher_, nullptr, 0);
        break;
      }
      usleep(1000);
    }
    watcher_ = -1;
  }

  // Records the exit of `w` if it has exited, and reaps it at once, as
  // torchrun does: a zombie would count against RLIMIT_NPROC and show in
  // ps for the rest of the job. The one zombie kept is the group's leader
  // (its pid is the group's id): while it is unreaped, that id cannot be
  // given to another group, so signalling the group never hits a stranger
  // (GroupIdHeld). Should the leader no longer be this process's to reap
  // (someone else reaped it), every worker is left a zombie instead, as
  // each one that was in the group holds the id too; ReapZombies reaps
  // those kept at the very end.
  //
  // ECHILD: the worker is no longer this process's child to wait for;
  // someone else here reaped it. Its pidfd stays readable, so waiting on
  // would spin until the deadline (forever without one): it is recorded
  // as ended, its status lost.
  bool Observe(Worker& w) {
    siginfo_t info{};
    const int flags = WEXITED | WNOHANG | WNOWAIT;
    if (waitid(P_PID, static_cast<id_t>(w.pid), &info, flags) != 0) {
      if (errno != ECHILD) return false;
      if (w.pid == pgid_) leader_reaped_ = true;
      w.running = false;
      w.pidfd.Reset();
      w.exit.status_lost = true;
      return true;
    }
    if (info.si_pid != w.pid) return false;
    w.running = false;
    w.pidfd.Reset();
    w.exit.exited = true;
    w.exit.signaled = info.si_code == CLD_KILLED || info.si_code == CLD_DUMPED;
    w.exit.code = info.si_status;
    w.zombie = true;
    if (w.pid != pgid_ && LeaderUnreaped()) Reap(w);
    return true;
  }

  // Whether the group's leader (a worker, or the listener) is still this
  // process's child, running or a zombie: its pid, the group's id, is
  // then nobody else's, whatever becomes of the other workers. Once this
  // process reaped it (leader_reaped_), its pid may be another child's of
  // this process, which waitid would answer for: it is not asked then.
  bool LeaderUnreaped() const {
    siginfo_t info{};
    return pgid_ > 0 && !leader_reaped_ &&
           waitid(P_PID, static_cast<id_t>(pgid_), &info, WEXITED | WNOHANG | WNOWAIT) == 0;
  }

  // Reaps `w`, a zombie whose exit Observe recorded.
  void Reap(Worker& w) {
    waitpid(w.pid, nullptr, WNOHANG);
    w.zombie = false;
    if (w.pid == pgid_) leader_reaped_ = true;
  }

  void ReapZombies() {
    for (Worker& w : workers_) {
      if (w.zombie) Reap(w);
    }
  }

  // Whether the group's id is still the workers' group. Surely while a
  // process that is this process's child, not yet reaped (a worker,
  // running or a zombie; the listener that leads the group), is in it.
  // Otherwise (every worker reaped by someone else: a SIGCHLD handler that
  // waits for any child) the leader's pid is free: a live process with that
  // pid means the number was given out again, and the id may name a
  // stranger's group; without one, the id is held by the workers' own
  // children (the id of a group with members is not given out) or by
  // nobody, and a signal to it reaches only those children.
  bool GroupIdHeld() const {
    if (pgid_ <= 0) return false;
    auto ours_in_group = [this](pid_t pid) {
      siginfo_t info{};
      return pid > 0 && waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
             getpgid(pid) == pgid_;
    };
    if (listener_ > 0 && ours_in_group(listener_)) return true;
    for (const Worker& w : workers_) {
      if ((w.running || w.zombie) && ours_in_group(w.pid)) return true;
    }
    return kill(pgid_, 0) != 0 && errno == ESRCH;
  }

  // kill(-pgid_, signal), while the id is the workers' group (GroupIdHeld).
  void SignalGroup(int signal) {
    if (GroupIdHeld()) kill(-pgid_, signal);
  }

  SpawnOptions options_;
  bool use_pipes_ = false;
  std::string error_dir_;  // made by Start when there is no log_dir; removed at the end
  std::vector<Worker> workers_;
  Terminal terminals_[2];  // the launcher's stdout and stderr
  pid_t pgid_ = 0;
  pid_t watcher_ = -1;   // the group's watcher process (StartWatcher)
  Fd watcher_write_;     // its pipe; closing it unannounced kills the group
  Fd stop_event_;
  Fd dev_null_;  // the workers' stdin when this process has none to pass on (ChooseWorkersStdin)
  int signal_read_ = -1;  // ProcessSignalPipe's read end, while forwarding
  // SpawnOptions::share_terminal: this process's group, when it was the
  // terminal's foreground group at Start (0: not sharing); whether the
  // workers' group holds the terminal; SIGTTOU's disposition before it was
  // ignored for that time.
  pid_t launcher_pgrp_ = 0;
  bool terminal_shared_ = false;
  // The terminal was taken back from the workers when this process was
  // stopped as a job, and it was continued in the background (`bg`): a
  // later `fg` gives it to them again (see StopLikeAJob).
  bool lent_back_ = false;
  pid_t listener_ = -1;   // hears the terminal's signals to the workers (StartListener)
  bool leader_reaped_ = false;  // this process reaped the group's leader (or lost it: ECHILD)
  Fd listener_read_;      // its pipe
  bool ttou_ignored_ = false;
  struct sigaction ttou_old_ = {};
  bool forwarding_ = false;
  // Of kPassedOnSignals (PassedOnBit), those held for this group's workers
  // until each catches them (PassOnHeldOnceCaught): from a group before
  // this one, or come before a worker set its handler up.
  int held_ = 0;
  Deadline hold_until_{};  // held_ is dropped from then on (hold_signal_for)
  Deadline next_held_look_{};  // when held_'s handlers are looked at next
  struct sigaction old_actions_[std::size(kForwardedSignals)] = {};
  bool installed_[std::size(kForwardedSignals)] = {};  // false: was ignored, left so
  struct sigaction passed_on_old_[std::size(kPassedOnSignals)] = {};
  bool passed_on_installed_[std::size(kPassedOnSignals)] = {};
  bool waits_for_children_ = false;  // counted in g_sigchld (WaitForChildren)
  std::mutex mu_;
  std::string stop_reason_;
  std::optional<GroupResult> waited_;  // what the first Wait returned
};

StatusOr<std::unique_ptr<WorkerGroup>> WorkerGroup::Start(std::vector<WorkerSpec> specs,
                                                          SpawnOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  DDP_RETURN_IF_ERROR(impl->Start(std::move(specs)));
  return std::unique_ptr<WorkerGroup>(new WorkerGroup(std::move(impl)));
}

WorkerGroup::WorkerGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
WorkerGroup::~WorkerGroup() = default;
std::vector<pid_t> WorkerGroup::pids() const { return impl_->pids(); }
pid_t WorkerGroup::process_group() const { return impl_->process_group(); }
GroupResult WorkerGroup::Wait(Deadline deadline) { return impl_->Wait(deadline); }
void WorkerGroup::RequestStop(std::string reason) { impl_->RequestStop(std::move(reason)); }

}  // namespace ddp::transport::launch
