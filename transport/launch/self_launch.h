#ifndef DDP_TRANSPORT_LAUNCH_SELF_LAUNCH_H_
#define DDP_TRANSPORT_LAUNCH_SELF_LAUNCH_H_

// Self-launch: lets any binary take `--nproc_per_node=N` and run as N worker
// processes of one job, so that
//
//     bazel run //examples:train -- --nproc_per_node=2
//
// just works. Call it first thing in main(), before anything initializes
// UCX, CUDA or threads that the workers should not inherit:
//
//     int main(int argc, char** argv) {
//       ddp::transport::launch::SelfLaunchOrExit(argc, argv);
//       // From here on this process is one worker: RANK, WORLD_SIZE, ... are set.
//       ...
//     }
//
// When the launch variables are already set (under ddprun, torchrun-style
// scripts, srun or mpirun; see env.h), the call returns at once: this process
// is that one worker. Otherwise this process becomes the launcher: it serves
// the rendezvous store on 127.0.0.1 (a free port), starts N copies of
// /proc/self/exe with the same arguments (minus --nproc_per_node) and RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK=0,
// MASTER_ADDR=127.0.0.1, MASTER_PORT, DDP_RESTART_COUNT=0, a fresh random
// DDP_JOB_TOKEN and DDP_STORE_HOST=launcher, waits for them and exits with
// their combined status (see GroupResult::ExitCode), after restarting them
// up to SelfLaunchOptions::max_restarts times when one fails. The launcher
// itself never
// touches UCX or CUDA.

#include <chrono>
#include <functional>
#include <string>

#include "transport/status.h"

namespace ddp::transport::launch {

/// How SelfLaunch behaves.
struct SelfLaunchOptions {
  /// Workers to start when --nproc_per_node is not given.
  int default_nproc_per_node = 1;
  /// Between SIGTERM and SIGKILL when stopping workers. Shorter than
  /// ddprun's 30 s (torchrun's shutdown timeout) on purpose: the programs
  /// that keep this default (the benchmarks, the hello examples) do no work
  /// on SIGTERM, so a longer wait would only hold up Ctrl-C or a failed
  /// job for a stuck rank; one that saves on SIGTERM sets its own
  /// (examples/train_main.cc: 30 s plus its save timeouts).
  std::chrono::milliseconds grace{5000};
  /// How long one worker's exec may take (SpawnOptions::exec_timeout): one
  /// not done by then (its file on a network file system that does not
  /// answer) is killed and the start fails TIMED_OUT. More than 0.
  std::chrono::milliseconds exec_timeout{60000};
  /// Stop the workers when they run longer than this; zero: no limit (the
  /// launcher still wakes for every worker exit and every signal).
  std::chrono::milliseconds max_run_time{0};
  /// When a worker fails (exits non-zero or dies by a signal), stop the
  /// others and start all of them again, up to this many times, with
  /// DDP_RESTART_COUNT counting the restarts (store keys of a restarted job
  /// are prefixed anew, see LaunchEnv::StoreKeyPrefix). A launcher that is
  /// interrupted (Ctrl-C) or runs past max_run_time does not restart. A
  /// restart whose workers cannot start (say, the program was replaced by
  /// one that does not run) ends the job with the failed worker's status,
  /// after a line saying so.
  int max_restarts = 0;
  /// With several workers, start each of their output lines with "[rank] ".
  /// Programs whose output comes from rank 0 alone (benchmarks with a fixed
  /// output format) turn it off.
  bool prefix_output = true;
  /// Called in the process that is to start the workers, before anything
  /// starts, with its arguments less --nproc_per_node (argv[0] first; a
  /// copy, which the callee may reorder as gflags' parser does): "" when
  /// they are fine, else one line naming what is wrong, which SelfLaunch
  /// returns as INVALID_ARGUMENT (SelfLaunchOrExit prints it and exits 2).
  /// A wrong flag is then refused once, instead of by every worker after
  /// they all started. Not called under a launcher, where each worker
  /// checks its own arguments.
  std::function<std::string(int argc, char** argv)> check_arguments;
};

/// What the caller does next.
struct SelfLaunchResult {
  bool run_as_worker = false;  ///< True: carry on as one worker.
  int exit_code = 0;           ///< Otherwise: exit with this.
};

/// Parses and removes `--nproc_per_node=N` (also `--nproc_per_node N` and
/// `--nproc-per-node`) from argc/argv, before any `--`, then either returns
/// run_as_worker or runs the workers as described above. INVALID_ARGUMENT for
/// a bad N, a malformed launch environment, or an N given under a launcher
/// that differs from its local world size (naming both and the variables),
/// before anything starts. While a launcher runs workers it catches SIGINT,
/// SIGTERM, SIGHUP and SIGQUIT (CatchInterrupts: forwarded to the workers,
/// they stop the job), and SIGUSR1 and SIGUSR2 (passed on to the workers
/// without stopping them; one that comes between two attempts, or before a
/// worker has set its handler up, is held for the workers, see
/// SpawnOptions::forward_signals), and puts the handlers it found back
/// before it returns.
StatusOr<SelfLaunchResult> SelfLaunch(int& argc, char** argv,
                                      const SelfLaunchOptions& options = {});

/// SelfLaunch, then: returns when this process is a worker; otherwise exits
/// the process with the workers' status (a launcher interrupted by SIGINT,
/// SIGTERM or SIGHUP, also between two attempts, where SelfLaunch catches
/// them and starts no further one, dies of that signal once its workers
/// are gone, see DieOfInterruptSignal), or with 2 after printing a one-line error for bad
/// input ("NAME: ...", NAME being argv[0] without its folder, as in the
/// launcher's other lines); with 1 after such a line for any other failure
/// (workers that could not start for lack of resources say so).
void SelfLaunchOrExit(int& argc, char** argv, const SelfLaunchOptions& options = {});

/// 32 hex characters from the kernel's random source; a fresh job token.
StatusOr<std::string> GenerateJobToken();

}  // namespace ddp::transport::launch

#endif  // DDP_TRANSPORT_LAUNCH_SELF_LAUNCH_H_
