#ifndef DDP_TRANSPORT_LAUNCH_TEST_SPAWN_H_
#define DDP_TRANSPORT_LAUNCH_TEST_SPAWN_H_

// Multi-process tests in one binary: the test process starts N copies of its
// own executable as the ranks of a job, each running a function picked by
// name, and collects their exit codes and output. Test-only.
//
//   #include "transport/launch/test_spawn.h"
//   DDP_TEST_WORKER(exchange) {        // runs in each worker process
//     auto env = ddp::transport::launch::LaunchEnvFromProcess();
//     ...connect to env->master_addr:env->master_port with env->job_token...
//     return 0;                        // the worker's exit code
//   }
//   TEST(MyTest, Exchange) {
//     auto run = ddp::transport::launch::testing::RunTestWorkers(
//         "exchange", {.world_size = 4});
//     ASSERT_TRUE(run.ok()) << run.status();
//     EXPECT_TRUE(run->AllSucceeded()) << run->Summary();
//   }
//
// BUILD: ddp_cc_test(..., main = False,
//                    deps = ["//transport/launch:test_spawn_main", ...])
// That main runs the selected worker when the process was started as one,
// and the gtest suite otherwise. Workers start from a fresh exec, so nothing
// the test process initialized (UCX, threads) leaks into them.

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "transport/launch/spawn.h"
#include "transport/status.h"

namespace ddp::transport::launch::testing {

using WorkerFunction = int (*)();

/// Registers `fn` under `name`; use DDP_TEST_WORKER instead.
bool RegisterTestWorker(const char* name, WorkerFunction fn);

/// Defines a worker body `name` returning the process's exit code.
#define DDP_TEST_WORKER(name)                                                    \
  static int DdpTestWorker_##name();                                             \
  [[maybe_unused]] static const bool ddp_test_worker_registered_##name =         \
      ::ddp::transport::launch::testing::RegisterTestWorker(#name,               \
                                                            &DdpTestWorker_##name); \
  static int DdpTestWorker_##name()

/// Environment variable that selects the worker function in a child.
inline constexpr char kTestWorkerEnv[] = "DDP_TEST_WORKER";

struct TestRunOptions {
  int world_size = 2;
  /// The whole run: workers still running then are stopped and
  /// group.deadline_passed is set. The outcome is kTimedOut, unless a worker
  /// had failed before (stop_all_on_failure off): that failure stays the
  /// outcome (kWorkerFailed).
  std::chrono::milliseconds timeout{30000};
  /// True: the test process serves the store and the workers see
  /// DDP_STORE_HOST=launcher. False: rank 0 serves it on MASTER_PORT, a port
  /// that was free a moment before.
  bool host_store = true;
  /// Workers for LOCAL_WORLD_SIZE; GROUP_RANK = rank / local_world_size.
  /// 0 means world_size (one node).
  int local_world_size = 0;
  /// Stop the others when one fails (false: let survivors finish, to check
  /// how they report a dead peer).
  bool stop_all_on_failure = true;
  /// Between SIGTERM and SIGKILL.
  std::chrono::milliseconds grace{2000};
  /// Extra environment for every worker, then for one rank.
  std::vector<std::pair<std::string, std::string>> env;
  std::map<int, std::vector<std::pair<std::string, std::string>>> rank_env;
  /// Copy worker output, prefixed "[rank] ", to the test's stderr as well.
  bool echo_output = true;
};

struct TestRunResult {
  GroupResult group;
  int port = 0;           ///< MASTER_PORT the workers saw.
  std::string job_token;  ///< DDP_JOB_TOKEN the workers saw.

  /// Every worker exited with status 0.
  bool AllSucceeded() const { return group.outcome == GroupOutcome::kSucceeded; }
  /// Exit code of `rank` (128 + signal when killed); -1 when it was never
  /// reaped (still unkillable at the end) or its status was lost, which no
  /// exit code stands for (0 would read as success).
  int ExitCode(int rank) const;
  /// Everything `rank` wrote to stdout and stderr.
  const std::string& Output(int rank) const { return group.output.at(rank); }
  /// One line per rank with its exit, then the group's reason.
  std::string Summary() const;
};

/// Runs `worker` (a DDP_TEST_WORKER name) in options.world_size processes.
/// Errors only when the run could not be set up; worker failures are in the
/// result.
StatusOr<TestRunResult> RunTestWorkers(std::string_view worker, const TestRunOptions& options);

/// In main(): when this process was started as a test worker, runs it and
/// returns its exit code; nullopt otherwise.
std::optional<int> RunTestWorkerIfRequested();

/// A TCP port that was free when asked (bind to port 0, read it back, close).
StatusOr<int> PickFreePort();

}  // namespace ddp::transport::launch::testing

#endif  // DDP_TRANSPORT_LAUNCH_TEST_SPAWN_H_
