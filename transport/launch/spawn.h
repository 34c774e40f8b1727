#ifndef DDP_TRANSPORT_LAUNCH_SPAWN_H_
#define DDP_TRANSPORT_LAUNCH_SPAWN_H_

// Starting, watching and stopping a group of worker processes.
//
// Fork safety: workers are started with vfork and exec, the way posix_spawn
// does it, so no pthread_atfork handler runs and nothing of the launcher's
// state (UCX, CUDA, threads) is duplicated. Before exec the child joins the
// group's process group and asks the kernel to SIGKILL it when the
// launcher's spawning thread dies (PR_SET_PDEATHSIG), so that a launcher
// killed by SIGKILL takes its workers with it. Call Start and Wait from a
// thread that lives as long as the workers (the main thread): the kernel ties
// the death signal to the spawning thread, not the process.
//
// Failure handling: when a worker exits non-zero or dies by a signal, the
// others get SIGTERM, then SIGKILL after a grace period; Wait names the rank
// that failed first and how. SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to the launcher
// are forwarded to every worker (a second one escalates to SIGKILL); one
// that arrives while the workers are being stopped for another reason still
// makes Wait report kInterrupted, so that the launcher ends instead of
// restarting them. When the workers are gone the whole process group gets
// SIGKILL, so a worker's own children do not outlive it (unless they left
// the group). The group is signalled only while its id is still the
// workers': a worker of it is still this process's child (running, or a
// zombie it keeps, see below), or, with every worker reaped by someone
// else (a SIGCHLD handler waiting for any child), no process has the
// leader's pid (the id is then held by the workers' children, or by none);
// a worker outside the group is signalled through its pidfd. A worker that
// ends is reaped at once (no zombie counts against RLIMIT_NPROC for the
// rest of the job), but for the group's leader, whose pid is the group's
// id: its zombie stays until the group is over (and so does every
// worker's, should someone else have reaped the leader).
//
// A launcher killed by SIGKILL has no chance to signal the group, and the
// death signal is not inherited across fork: for the workers' own children
// each group starts a watcher, a process in a group of its own (so that
// killing the launcher's group does not take it along) that holds the
// read end of a pipe only the launcher writes to. On end-of-file without
// the launcher's word that it ended the group itself, the watcher sends
// SIGKILL to the group. Only a child that left the group escapes.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::launch {

/// Sets of a worker's output streams, as bits (torchrun's Std codes).
inline constexpr int kNoStreams = 0;
inline constexpr int kStdoutStream = 1;
inline constexpr int kStderrStream = 2;
inline constexpr int kBothStreams = 3;

/// One worker process to start.
struct WorkerSpec {
  int rank = 0;                   ///< Names the worker in messages, prefixes, log files.
  std::string program;            ///< Path of the executable; no PATH search.
  std::vector<std::string> argv;  ///< Full argument vector, argv[0] included.
  /// Set on top of the launcher's own environment (later entries win).
  std::vector<std::pair<std::string, std::string>> env;
  /// With OutputOptions::prefix: what starts each of its terminal lines;
  /// empty: "[rank] ".
  std::string line_prefix;
  /// Its folder under OutputOptions::log_dir and log_name_prefix; empty:
  /// its rank. A launcher gives the local rank, as torchrun's layout.
  /// Compared lexically normalised ('./0' is '0'): two workers may not
  /// share one, nor may one lie outside log_dir ('..', a leading '/').
  std::string log_name;
  /// Of its streams (kStdoutStream, kStderrStream bits): those written to
  /// stdout.log / stderr.log, with OutputOptions::log_dir and log_files
  /// (no file for the others), and those copied to the terminal, with
  /// OutputOptions::to_terminal (torchrun's per-rank --tee and
  /// --redirects).
  int logged_streams = kBothStreams;
  int shown_streams = kBothStreams;
};

/// Where worker output goes. With every option off but `to_terminal`, the
/// workers write straight to the launcher's stdout and stderr; otherwise
/// their output passes through pipes that the launcher reads.
struct OutputOptions {
  bool to_terminal = true;    ///< Copy worker stdout/stderr to the launcher's.
  bool prefix = true;         ///< Start every terminal line with "[rank] ".
  /// When set: each worker has a folder <log_dir>/<log_name_prefix><log
  /// name>/ (torchrun's layout) with its error file, error.json
  /// (SpawnOptions::error_files), and with log_files its stdout and stderr
  /// in stdout.log and stderr.log.
  std::string log_dir;
  bool log_files = true;      ///< With log_dir: write each worker's streams to its log files.
  std::string log_name_prefix;  ///< For instance "attempt_1/"; directories are created.
  /// With to_terminal: only these ranks' output reaches the terminal
  /// (torchrun's --local_ranks_filter); empty: every rank's. Log files and
  /// the capture still get everything. Each must be a worker's rank (Start
  /// refuses one that none has).
  std::vector<int> terminal_ranks;
  bool capture = false;       ///< Keep each worker's output in GroupResult::output.
  size_t capture_limit = size_t{1} << 20;  ///< Bytes kept per worker; the rest is dropped.
};

/// How a group is run.
struct SpawnOptions {
  OutputOptions output;
  /// Between SIGTERM and SIGKILL when stopping workers: 0 or more (Start
  /// refuses a negative one); milliseconds::max() waits as long as they take.
  std::chrono::milliseconds grace{5000};
  /// How long one worker may take from its fork to its exec: more than 0
  /// (Start refuses others); milliseconds::max() waits as long as it takes.
  /// An exec that has not finished by then (its file on a network file
  /// system that does not answer, a lease or delegation held on it) is
  /// killed (SIGKILL) and Start fails TIMED_OUT naming the rank and the
  /// program. An exec the kernel does not let SIGKILL end (uninterruptible
  /// sleep) still holds Start until it does.
  std::chrono::milliseconds exec_timeout{60000};
  /// Stop the others as soon as one worker fails (a launcher's behaviour).
  /// False lets every worker run to its own end, for tests that check how
  /// survivors report a dead peer.
  bool stop_all_on_failure = true;
  /// Forward SIGINT / SIGTERM / SIGHUP / SIGQUIT received by this process to the
  /// workers during Wait. One group at a time may do so. A signal this
  /// process ignores (SIGHUP under nohup) is left ignored, for the workers
  /// too. SIGUSR1 and SIGUSR2 (Slurm's `--signal=USR1@T` checkpoint hook)
  /// are caught while the group exists and passed on to the running
  /// workers during Wait, which goes on: they stop neither the workers
  /// nor this process (on_notice is told). One that comes while the
  /// workers are being stopped, or after Wait's end while the group still
  /// exists, is held for the next group that forwards signals (a
  /// launcher's restart). Held, or come within hold_signal_for of the
  /// group's start while a worker has no handler for it yet (a program
  /// still starting), it goes to the workers once each has a handler for
  /// it (or ignores it), looked at once a second: sent before, its default
  /// action would kill them. One of each is held at most; one still held
  /// hold_signal_for after the group's start is dropped (on_notice names
  /// it), and one the group's workers did not get before they ended is
  /// held for the next group. Between two groups, while none exists, they
  /// have this process's own disposition (by default they end it), unless
  /// CatchInterrupts holds them for the next group.
  bool forward_signals = true;
  /// With forward_signals: how long after the group's start a SIGUSR1 or
  /// SIGUSR2 is held for workers that have no handler for it yet (see
  /// forward_signals); 0 or more (Start refuses others); 0 passes it on at
  /// once; milliseconds::max() holds it until each worker has a handler.
  std::chrono::milliseconds hold_signal_for{60000};
  /// With forward_signals: called on Wait's thread when the first SIGINT,
  /// SIGTERM, SIGHUP or SIGQUIT reaches this group (also one that arrives while the
  /// workers are being stopped for another reason), before it is passed on
  /// to the workers. A multi-node launcher tells the other nodes here, so
  /// that its word is out before any of its workers ends. It holds up the
  /// forwarding: keep it short, with a deadline on anything that waits.
  std::function<void(int signal)> on_interrupt;
  /// Called on Wait's thread with a line for the user while the workers
  /// run: SIGUSR1 or SIGUSR2 passed on to them; a worker stopped by a signal other than the terminal's (SIGSTOP,
  /// SIGTSTP, a debugger), which the group leaves to whoever stopped it
  /// while its peers wait for it, and again when it continues. Empty:
  /// nothing is said.
  std::function<void(const std::string& line)> on_notice;
  /// Give every worker an error file of its own in TORCHELASTIC_ERROR_FILE
  /// (see error_file.h): <log_dir>/<log_name_prefix><log name>/error.json
  /// with a log_dir, else a file in a directory the group makes under
  /// $TMPDIR (or /tmp; none when it cannot) and removes when destroyed
  /// (its watcher does, should this process be killed first). A file left there by an
  /// earlier run is removed before the worker starts. What a failed worker
  /// wrote goes into its WorkerExit::error, and the earliest such message
  /// into GroupResult::reason. A spec's own TORCHELASTIC_ERROR_FILE wins:
  /// that file is the one read (and, left from before, removed first); two
  /// specs may not name the same one, nor one the error.json that another
  /// worker gets under log_dir, and one that is there must be a regular
  /// file (a FIFO or /dev/null is refused, never removed).
  /// A worker left without one (false here, or no folder for them) finds
  /// TORCHELASTIC_ERROR_FILE unset, not the launcher's own.
  bool error_files = true;
  /// Let the workers read the terminal, as torchrun's do (they share its
  /// process group there). When this process's stdin is its controlling
  /// terminal and this process's group is the terminal's foreground one,
  /// the workers' group is made the foreground group while they run (the
  /// first worker does it before exec, so that none reads too early), and
  /// the terminal goes back to this process's group when they are gone
  /// (end of Wait, destruction; the watcher does it for a launcher killed
  /// by SIGKILL). Meanwhile this process ignores SIGTTOU (its own writes
  /// under `stty tostop`; the workers get the disposition it had), and the
  /// terminal's signals reach the workers' group only, where a listener
  /// process hears them for Wait: the terminal's SIGINT, SIGQUIT or SIGHUP
  /// counts as this process interrupted by that signal (kInterrupted,
  /// InterruptSignal, on_interrupt: no restart), however the workers end
  /// (one that catches it and exits 1 too), which Wait also sends to this
  /// process's group, as the terminal would have (a script that runs the
  /// launcher gets it too); SIGTSTP (Ctrl-Z) at once stops the group,
  /// gives the terminal back and stops this process's group, as a shell
  /// stops a job; continued in the foreground (`fg`), it gives the
  /// terminal to the workers again and continues them; in the background
  /// (`bg`) the workers go on without it until a later `fg` (seen within
  /// a second), and one that reads the terminal meanwhile stops the job
  /// again, as a shell's background job is stopped. (Without the listener,
  /// should it fail to start, a worker killed by SIGINT, SIGQUIT or SIGHUP,
  /// or stopped by SIGTSTP, stands for the terminal's signal.) Otherwise
  /// (no terminal, a launcher in the background, forward_signals off)
  /// nothing changes.
  bool share_terminal = false;
};

/// How one worker ended.
struct WorkerExit {
  int rank = 0;
  pid_t pid = -1;
  bool exited = false;    ///< Reaped (false if it could not be reaped in time).
  /// It ended, but another waiter of this process reaped it first (a
  /// SIGCHLD handler that waits for any child, SIGCHLD set to SIG_IGN
  /// after Start): how it ended is unknown, and it counts as failed.
  bool status_lost = false;
  bool signaled = false;  ///< Killed by a signal (else exited normally).
  int code = 0;           ///< Exit status, or the signal number when signaled.
  /// What it wrote to its error file before failing (SpawnOptions::
  /// error_files); empty when it succeeded or wrote none.
  std::string error;
  int64_t error_timestamp_us = 0;  ///< When it wrote it (unix time), 0 unknown.
  /// The whole error file (WorkerError::record), for a launcher that passes
  /// it up as torchrun does (CopyErrorRecord); empty with `error`.
  std::string error_record;

  bool ok() const { return exited && !signaled && code == 0; }
  /// "rank 1 (pid 4242) exited with code 3" / "... was killed by signal 9 (SIGKILL)".
  std::string Describe() const;
};

/// Why Wait returned. Values are stable: append only.
enum class GroupOutcome : int {
  kSucceeded = 0,     ///< Every worker exited with status 0.
  kWorkerFailed = 1,  ///< A worker exited non-zero or died by a signal.
  kInterrupted = 2,   ///< The launcher received SIGINT / SIGTERM / SIGHUP / SIGQUIT (at any point of Wait).
  kStopped = 3,       ///< RequestStop was called.
  kTimedOut = 4,      ///< The deadline given to Wait passed (no worker had failed: a failure stays the outcome).
  /// Wait could not watch the workers (poll failed); it killed them.
  kMonitorFailed = 5,
};

/// What Wait found.
struct GroupResult {
  GroupOutcome outcome = GroupOutcome::kSucceeded;
  std::vector<WorkerExit> workers;           ///< In the order of the specs.
  /// The first worker seen failing while the group ran (before a stop was
  /// requested, the launcher was interrupted or the deadline passed). Of
  /// several found dead at one look, one killed by a signal, else the first
  /// in the order of the specs: their order of death is not known.
  std::optional<WorkerExit> first_failure;
  int signal = 0;                            ///< The signal, for kInterrupted.
  /// Wait's deadline passed with workers still running, and they were
  /// stopped: set with kTimedOut, and also with kWorkerFailed when the
  /// failure had left the others running (stop_all_on_failure off) and they
  /// had not finished by then.
  bool deadline_passed = false;
  std::string reason;                        ///< One line; empty on success.
  std::vector<std::string> output;           ///< Captured output per worker.
  /// Bytes of worker output that the launcher's stdout or stderr did not
  /// take (nothing written for 2 s: a reader that stopped reading), dropped
  /// so that the launcher kept watching the workers. Log files get it all,
  /// but for those in log_failures.
  uint64_t output_dropped = 0;
  /// One line per worker whose log file stopped taking output (a full disk,
  /// an I/O error, a FIFO whose reader closed it, took nothing for 2 s or
  /// too little to finish one write in 2 s, or had not taken by the end of
  /// Wait what a write cut short by a deadline left; such a write does not
  /// stop the log, whose rest goes out as the reader takes it, and stops it
  /// only once the reader takes nothing for 2 s): "rank 3's
  /// log file '<path>' stopped after N bytes: <why>". Nothing more is
  /// written to that file; the terminal and the capture still get the
  /// output.
  std::vector<std::string> log_failures;

  /// The failed worker whose error file was written first (see
  /// SpawnOptions::error_files): the root cause, as torchrun reports it. A
  /// file that gives no usable time counts as written after all others.
  /// Its message is also in `reason` ("...; rank 1 reported: <message>").
  std::optional<WorkerExit> first_error;

  /// 0 on success; the failed worker's exit code, or 128 + its signal; 128 +
  /// the signal when interrupted; 1 when stopped, timed out or unwatchable.
  int ExitCode() const;
};

/// A started group of workers. Not copyable; destroying it kills (SIGKILL)
/// and reaps any worker still running.
class WorkerGroup {
 public:
  /// Starts every worker. If one cannot start, those already started are
  /// killed and the status names the rank, the program and the reason;
  /// nothing is left running. INVALID_ARGUMENT: the input is wrong (exec
  /// fails for the program, a log folder cannot be made; checked before
  /// any worker starts: a spec without program or argv, two specs with
  /// one rank or, with a log_dir, one log folder, an environment variable
  /// name that is empty or holds '=', a NUL byte in a program, argument or
  /// variable, a terminal rank that no worker has, a negative rank, a
  /// stream set outside 0..3);
  /// RESOURCE_EXHAUSTED: something ran out (descriptors, processes, memory,
  /// disk), for a worker or for the group's own setup, and the same start
  /// may succeed later; TIMED_OUT: a worker's exec did not finish within
  /// SpawnOptions::exec_timeout; FAILED_PRECONDITION: with forward_signals,
  /// another group forwards them already.
  static StatusOr<std::unique_ptr<WorkerGroup>> Start(std::vector<WorkerSpec> specs,
                                                      SpawnOptions options);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  /// Worker pids, in the order of the specs. A worker that ended was
  /// reaped when Wait saw it (all but the group's leader, see above): its
  /// pid may name another process by now.
  std::vector<pid_t> pids() const;
  /// The process group every worker belongs to.
  pid_t process_group() const;

  /// Watches the workers until every one has exited, one failed, a signal
  /// arrived, RequestStop was called or `deadline` passed; in the last four
  /// cases it stops the remaining workers (SIGTERM, grace, SIGKILL) before
  /// returning. Call once; a second call watches nothing and returns what
  /// the first one did.
  GroupResult Wait(Deadline deadline);

  /// Makes Wait stop the workers and return kStopped with `reason`. A
  /// worker that had failed by the time Wait sees the request still counts
  /// (first_failure); with SpawnOptions::stop_all_on_failure Wait then
  /// stops the others for that failure and returns kWorkerFailed.
  /// Thread-safe and callable before or during Wait.
  void RequestStop(std::string reason);

  class Impl;

 private:
  explicit WorkerGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// The first SIGINT, SIGTERM, SIGHUP or SIGQUIT that reached this process while a
/// WorkerGroup forwarded signals; 0 when none did. It stays set. A launcher
/// checks it before it restarts workers: a signal that arrives after Wait's
/// last look, while the group is being destroyed, is recorded only here.
int InterruptSignal();

/// `true`: SIGINT, SIGTERM, SIGHUP and SIGQUIT (those this process does not ignore)
/// no longer end this process while no WorkerGroup forwards them; the
/// first one is recorded in InterruptSignal() instead, for a launcher that
/// must tell others before it leaves (ddprun between two starts of its
/// workers) and checks InterruptSignal() in its waits. One-shot: the handler
/// resets itself, so a second signal has its default effect. A WorkerGroup
/// takes the signals over while it exists and puts this back when
/// destroyed; a signal caught here that no group has seen yet reaches the
/// next group that forwards signals as soon as it starts (one that came
/// after the launcher's last look at InterruptSignal()). SIGUSR1 and
/// SIGUSR2 (those not ignored) are caught too, every time, and held for
/// the next group's workers (see SpawnOptions::forward_signals) instead of
/// ending this process. `false`: the default effect again for all six,
/// and a caught signal no longer reaches a group.
void CatchInterrupts(bool catch_them);

/// For a launcher about to exit with `exit_code`: when a SIGINT, SIGTERM or
/// SIGHUP interrupted it (InterruptSignal) and `exit_code` is 128 + that
/// signal, flushes stdio and dies of the signal itself (its default action,
/// unblocked), so that its parent sees it killed by the signal, as a shell
/// expects of a program that was interrupted (a loop over launches stops at
/// Ctrl-C). Returns otherwise: no such signal, another exit status (a
/// failure the launcher reports as such), or SIGQUIT (whose default action
/// would dump core), and, should the signal not end the process, then too.
void DieOfInterruptSignal(int exit_code);

/// Writes `text` to this process's stderr the way worker output is copied
/// there: a reader that stopped reading (a full pipe nobody drains) holds it
/// up for at most 2 s without progress, and once it has, text that cannot
/// be written at once is dropped until the reader takes some again. For a
/// launcher's own messages, so that reporting a failure cannot hang it.
/// Thread-safe.
void WriteLauncherLine(std::string_view text);

/// For tests: `true` makes the groups started from now on act as if the
/// kernel had no close_range (before Linux 5.9; CLOSE_RANGE_CLOEXEC before
/// 5.11), so that the fallbacks that keep the launcher's descriptors out of
/// the workers and the watcher run: each worker's child marks every
/// descriptor close-on-exec one by one, the watcher closes them one by one.
void ForceCloseRangeFallbackForTesting(bool force);

/// For tests: each group started from now on waits `pause` (0: not at all)
/// right after its first worker started, which may already hold the
/// terminal: a launcher killed meanwhile is a case its watcher must cover.
void PauseAfterFirstWorkerForTesting(std::chrono::milliseconds pause);

/// For tests: `step` (empty: none) runs in each group's Start once the
/// group's watcher runs and before its first worker starts, given the
/// watcher's pid, so that a test can end the watcher there.
void SetBeforeFirstWorkerStepForTesting(std::function<void(pid_t watcher)> step);

/// For tests: `step` (empty: none) runs on the destroying thread while a
/// group that forwarded signals gives them up, between its ceasing to take
/// them and the earlier handlers coming back, so that a test can send a
/// signal into that moment.
void SetForwardingEndStepForTesting(std::function<void()> step);

/// For tests: how many times, in all, a group read a worker's signal
/// handlers (/proc/<pid>/status) to decide whether a held SIGUSR1 or
/// SIGUSR2 may go to it.
int64_t SignalHandlerLooksForTesting();

/// "SIGKILL", "SIGTERM", ..., "SIGRTMIN+3" or "signal 32".
std::string SignalName(int signal);

/// Resolves `program` the way execvp would (PATH search when it has no
/// slash) and checks that it is an executable regular file. INVALID_ARGUMENT
/// says which: "program 'x' not found in PATH", "'/a/b' is not executable",
/// and for a name that PATH has only as something that cannot run, where
/// and why ("... not found in PATH as an executable file: '/d/x' is not
/// executable").
StatusOr<std::string> ResolveProgram(const std::string& program);

}  // namespace ddp::transport::launch

#endif  // DDP_TRANSPORT_LAUNCH_SPAWN_H_
