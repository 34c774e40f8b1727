#ifndef DDP_TRANSPORT_TESTING_PROCESS_GROUP_H_
#define DDP_TRANSPORT_TESTING_PROCESS_GROUP_H_

// Runs N copies of the current test binary as the ranks of a job (posix_spawn
// of /proc/self/exe with RANK, WORLD_SIZE, ... set), captures each one's
// output, and never leaves a process behind: the destructor kills and reaps
// whatever still runs.

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::testing {

/// A TCP port that was free a moment ago (bound to port 0, then released).
int FreePort();

struct WorkerResult {
  int exit_code = -1;   ///< Exit status, or -1 when killed by a signal.
  int signal = 0;       ///< Terminating signal, or 0.
  bool timed_out = false;
  std::string output;   ///< stdout and stderr together.
};

/// Every worker's exit code, signal, whether it timed out and its output,
/// rank by rank: what a failed multi-process test prints.
std::string DescribeResults(const std::vector<WorkerResult>& results);

class ProcessGroup {
 public:
  using Env = std::map<std::string, std::string>;
  /// Starts `size` workers running `args` (argv[1...]) with the launch
  /// variables of a one-host job on `port`, plus `env` for every rank and
  /// `rank_env[r]` for rank r (overriding).
  static StatusOr<std::unique_ptr<ProcessGroup>> Spawn(int size,
                                                       const std::vector<std::string>& args,
                                                       const Env& env, int port,
                                                       const std::map<int, Env>& rank_env = {});
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;  // owns its workers' pidfds
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  /// Waits for every worker; kills those still running at `deadline`.
  std::vector<WorkerResult> Wait(Deadline deadline);
  /// Sends `signal` to rank `rank`.
  void Kill(int rank, int signal);
  /// Waits until every worker has printed `text` (polling their output);
  /// false when the deadline passes first or a worker exits without it.
  bool WaitForOutput(const std::string& text, Deadline deadline);
  /// The same for the workers of `ranks` only (a stopped one never prints).
  bool WaitForOutput(const std::string& text, Deadline deadline, const std::vector<int>& ranks);
  pid_t pid(int rank) const { return pids_[rank]; }

 private:
  ProcessGroup() = default;
  // Sends `signal` to worker i through its pidfd (its pid, checked, without one).
  void Signal(size_t i, int signal);
  // waitid for worker i with WEXITED | `flags`, through EINTR; its result.
  int WaitWorker(size_t i, siginfo_t* info, int flags) const;
  // Whether worker i has exited, leaving it to be reaped by Wait.
  bool Exited(size_t i) const;
  std::vector<pid_t> pids_;
  std::vector<int> pidfds_;  ///< One per worker, -1 without pidfds; closed by the destructor.
  std::vector<std::string> logs_;
  std::vector<bool> reaped_;
  /// Per worker: why its exit is unknown without a wait (empty otherwise).
  std::vector<std::string> lost_;
};

/// A finished job: every worker's result, rank by rank.
struct Job {
  std::vector<WorkerResult> results;
  std::string Describe() const { return DescribeResults(results); }
};

/// Runs `size` copies of this test binary as a one-host job on a free port,
/// with DDP_TEST_SCENARIO=`scenario` and a job token (unless `env` names
/// one) besides `env`, and waits for them until `limit`; `during`, when
/// set, runs while they do. A failed spawn gives `size` results with exit
/// code -1 and the error as output, so that checks of the exit codes fail.
Job RunJob(int size, const std::string& scenario, ProcessGroup::Env env = {},
           std::chrono::milliseconds limit = std::chrono::milliseconds(60000),
           const std::function<void(ProcessGroup&, int port)>& during = nullptr,
           const std::map<int, ProcessGroup::Env>& rank_env = {});

// Worker side: a worker counts its failed checks and exits non-zero when
// there were any; each failure is printed with its place.

/// The value of environment variable `name`, or `fallback` when it is unset.
std::string EnvOr(const char* name, const char* fallback = "");

/// Marks by which one worker tells the others of its job that it reached a
/// point of its scenario, so that they wait just that long instead of a
/// fixed sleep: a file in TEST_TMPDIR named for the job and `mark`.
void SetMark(const std::string& mark);
/// Whether `mark` was set within `limit` (polled every 10 ms).
bool AwaitMark(const std::string& mark, std::chrono::milliseconds limit);

/// WORKER_CHECKs that failed in this process.
inline int worker_failures = 0;

/// The main() of a multi-process test binary: a copy spawned by RunJob
/// (DDP_TEST_SCENARIO set) runs `run_scenario` with the scenario's name and
/// exits with its result (1 where it returned 0 but a WORKER_CHECK failed);
/// otherwise the gtest tests run.
int WorkerOrTestsMain(int argc, char** argv, int (*run_scenario)(const std::string& name));

}  // namespace ddp::transport::testing

/// Counts and prints a failed check in a worker process (no gtest there).
#define WORKER_CHECK(cond, what)                                                       \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      ++::ddp::transport::testing::worker_failures;                                    \
      std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__,                      \
                   std::string(what).c_str());                                         \
    }                                                                                  \
  } while (0)

#endif  // DDP_TRANSPORT_TESTING_PROCESS_GROUP_H_
