#ifndef DDP_EXAMPLES_TESTING_SUBPROCESS_H_
#define DDP_EXAMPLES_TESTING_SUBPROCESS_H_

// Running the example binaries from tests: start a program with its output
// in files, signal it, wait with a deadline, find its children. Test-only.

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ddp::examples::testing {

/// Path of a runfile of this workspace ("examples/train").
std::string Runfile(const std::string& path);

/// A fresh, empty directory under TEST_TMPDIR.
std::string MakeTempDir(const std::string& name);

/// A started program. Destroying it kills (SIGKILL) its process group and
/// every process it started, then reaps it.
class Subprocess {
 public:
  /// Starts `argv` (argv[0] is the program path) in its own process group
  /// with `env` added to this process's environment; stdout and stderr go to
  /// files in a fresh directory. Aborts the test on failure to start.
  Subprocess(std::vector<std::string> argv,
             std::vector<std::pair<std::string, std::string>> env = {});
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  /// Sends `signal` to the program itself (not its group), as a terminal's
  /// Ctrl-C reaches a launcher that put its workers in their own group.
  void Signal(int signal) const;
  /// Waits until the program exits or `timeout` passes. Returns the exit
  /// code (128 + signal when killed by one), or -1 on timeout.
  int Wait(std::chrono::milliseconds timeout);
  /// Output so far.
  std::string Stdout() const;
  std::string Stderr() const;
  /// Processes whose parent is this program and that left its process
  /// group (its workers, which run in a group of their own), now, less the
  /// launcher's helper (the group's watcher process, named ddp-watcher).
  std::vector<pid_t> Children() const;

 private:
  // Adds the children not seen before to seen_children_.
  void RememberChildren();

  pid_t pid_ = -1;
  bool reaped_ = false;
  int exit_code_ = -1;
  std::string dir_;
  // Every child seen while the program ran, with its start time (clock
  // ticks since boot): a child that ended and was reaped may have left its
  // pid to an unrelated process, which the destructor must not kill.
  std::vector<std::pair<pid_t, uint64_t>> seen_children_;
};

/// Result of RunToEnd.
struct RunOutput {
  int exit_code = -1;  ///< -1: it did not finish in time (it was killed).
  std::string out;
  std::string err;
};

/// Starts a program, waits up to `timeout` for it, and returns its output.
RunOutput RunToEnd(std::vector<std::string> argv,
                   std::vector<std::pair<std::string, std::string>> env = {},
                   std::chrono::milliseconds timeout = std::chrono::seconds(120));

/// Reads a FIFO as `cat fifo &` would, from before the program under test
/// opens it for writing: opened at once without waiting for a writer, then
/// read on a thread of its own until the writer closes it, or until Finish
/// was called and nothing came for 100 ms, or until `deadline`.
class FifoReader {
 public:
  /// Aborts the test if `path` cannot be opened.
  explicit FifoReader(const std::string& path,
                      std::chrono::milliseconds deadline = std::chrono::seconds(150));
  ~FifoReader();
  FifoReader(const FifoReader&) = delete;
  FifoReader& operator=(const FifoReader&) = delete;

  /// After the writer's program ended: stops reading once the pipe is
  /// quiet, and returns what was read.
  std::string Finish();
  /// What was read so far, while the writer still writes (a mark of its
  /// progress to wait for).
  std::string Text() const;
  /// Whether the writer closed the pipe (read saw its end), after Finish.
  bool ended() const { return ended_; }

 private:
  int fd_ = -1;
  mutable std::mutex mu_;  // guards text_ while the thread reads
  std::string text_;
  bool ended_ = false;
  std::atomic<bool> finishing_{false};
  std::thread thread_;
};

/// Opens the FIFO `path` for writing, into *writer, once `running` has it
/// open for reading (before that, opening it without waiting fails with
/// ENXIO). A fatal test failure when `running` ends first or `timeout`
/// passes: call it under ASSERT_NO_FATAL_FAILURE.
void OpenFifoOnceRead(const std::string& path, Subprocess& running, int* writer,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60));

/// True when `pid` no longer runs (gone, or a zombie with no thread left
/// running, so that everything it had open is closed).
bool ProcessGone(pid_t pid);

/// Reads a whole file ("" when it cannot be read).
std::string ReadFile(const std::string& path);

/// Lines of `text` (without their newlines; no empty last line).
std::vector<std::string> Lines(const std::string& text);

}  // namespace ddp::examples::testing

#endif  // DDP_EXAMPLES_TESTING_SUBPROCESS_H_
