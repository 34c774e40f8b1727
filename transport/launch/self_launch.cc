#include "transport/launch/self_launch.h"

#include <signal.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "transport/launch/env.h"
#include "transport/launch/spawn.h"
#include "transport/store/tcp_store.h"

namespace ddp::transport::launch {
namespace {

// --nproc_per_node as given and as resolved ("gpu": 3).
struct NprocFlag {
  std::string text;
  int value = 0;
};

// Finds and removes the --nproc_per_node flag; nullopt when absent.
StatusOr<std::optional<NprocFlag>> TakeNprocFlag(int& argc, char** argv) {
  std::optional<NprocFlag> flag;
  int out = 1;
  bool past_separator = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg(argv[i]);
    if (past_separator || arg == "--") {
      past_separator = true;
      argv[out++] = argv[i];
      continue;
    }
    std::string_view text;
    bool matched = false;
    for (std::string_view name : {"--nproc_per_node", "--nproc-per-node"}) {
      if (arg == name) {
        if (i + 1 >= argc) {
          return InvalidArgumentError(std::string(name) + " needs a value");
        }
        text = argv[++i];
        matched = true;
      } else if (arg.size() > name.size() && arg.substr(0, name.size()) == name &&
                 arg[name.size()] == '=') {
        text = arg.substr(name.size() + 1);
        matched = true;
      }
      if (matched) break;
    }
    if (!matched) {
      argv[out++] = argv[i];
      continue;
    }
    DDP_ASSIGN_OR_RETURN(int value, ParseNprocPerNode(text, CurrentEnvironment()));
    flag = NprocFlag{std::string(text), value};
  }
  argc = out;
  argv[argc] = nullptr;
  return flag;
}

// What the launcher calls itself in its lines: argv[0] without its folder
// (`bazel run` gives a long runfiles path), as command-line tools do.
std::string ProgramName(int argc, char** argv) {
  if (argc < 1 || argv[0] == nullptr || argv[0][0] == '\0') return "self-launch";
  const std::string_view path = argv[0];
  const size_t slash = path.rfind('/');
  return std::string(slash == std::string_view::npos ? path : path.substr(slash + 1));
}

// "NAME=VALUE" for a variable of `env` ("NAME unset" when absent).
std::string Named(const EnvMap& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? name + " unset" : name + "=" + it->second;
}

// The variables that say who this process is and how many workers share its
// node (`parsed` came from them), for a message.
std::string LaunchVariables(const EnvMap& env, const LaunchEnv& parsed) {
  std::vector<std::string> names;
  std::string prefix;
  std::string suffix;
  switch (parsed.source) {
    case LaunchSource::kTorchrun:
      names = {kEnvRank, kEnvWorldSize, kEnvLocalWorldSize};
      if (!env.count(kEnvLocalWorldSize)) suffix = " (one node)";
      break;
    case LaunchSource::kSlurm:
      names = {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"};
      if (env.count(kEnvLocalWorldSize)) {
        names.push_back(kEnvLocalWorldSize);
      } else {
        // The one FromSlurm (env.cc) took the node's task count from.
        for (const char* name : {"SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
          if (env.count(name)) {
            names.push_back(name);
            break;
          }
        }
      }
      prefix = "an srun step: ";
      break;
    case LaunchSource::kOpenMpi:
      names = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               env.count(kEnvLocalWorldSize) ? kEnvLocalWorldSize : "OMPI_COMM_WORLD_LOCAL_SIZE"};
      prefix = "mpirun: ";
      break;
  }
  std::string out = prefix;
  for (size_t i = 0; i < names.size(); ++i) out += (i > 0 ? ", " : "") + Named(env, names[i]);
  return out + suffix;
}

// While the launcher runs its workers: SIGINT, SIGTERM, SIGHUP and SIGQUIT
// are recorded (CatchInterrupts) also between two attempts, where no group
// forwards them, so that one arriving there is reported and starts no new
// attempt instead of ending the launcher without a word; SIGUSR1 and
// SIGUSR2 there are held for the next attempt's workers. Puts back the
// handlers it found when it goes.
class InterruptsCaught {
 public:
  InterruptsCaught() {
    for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], nullptr, &old_[i]);
    CatchInterrupts(true);
  }
  ~InterruptsCaught() {
    CatchInterrupts(false);
    for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &old_[i], nullptr);
  }
  InterruptsCaught(const InterruptsCaught&) = delete;
  InterruptsCaught& operator=(const InterruptsCaught&) = delete;

 private:
  static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
  struct sigaction old_[std::size(kSignals)] = {};
};

}  // namespace

StatusOr<std::string> GenerateJobToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return InternalError(std::string("getrandom: ") + std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token.push_back(kHex[b >> 4]);
    token.push_back(kHex[b & 15]);
  }
  return token;
}

StatusOr<SelfLaunchResult> SelfLaunch(int& argc, char** argv, const SelfLaunchOptions& options) {
  DDP_ASSIGN_OR_RETURN(std::optional<NprocFlag> nproc, TakeNprocFlag(argc, argv));
  const EnvMap env = CurrentEnvironment();
  if (HasLaunchVariables(env)) {
    // Already one worker of a launched job; refuse a broken environment now
    // rather than deep inside the communicator.
    DDP_ASSIGN_OR_RETURN(LaunchEnv parsed, ParseLaunchEnv(env));
    // An explicit --nproc_per_node that the environment contradicts (say,
    // 4 inside `srun --pty bash`, a step of one task) would otherwise be
    // dropped without a word, leaving a job of another size than asked for.
    if (nproc && nproc->value != parsed.local_world_size) {
      const std::string n = std::to_string(nproc->value);
      return InvalidArgumentError(
          "--nproc_per_node=" + nproc->text + " asks for " + n +
          " workers on this node, but this process already is one worker of a launched job with " +
          std::to_string(parsed.local_world_size) + " on this node (" + LaunchVariables(env, parsed) +
          "); drop --nproc_per_node, or start the job with " + n +
          " workers per node (e.g. ddprun --nproc_per_node=" + n + ")");
    }
    return SelfLaunchResult{.run_as_worker = true, .exit_code = 0};
  }
  const int n = nproc ? nproc->value : options.default_nproc_per_node;
  if (n < 1) {
    return InvalidArgumentError("--nproc_per_node=" + std::to_string(n) + " must be at least 1");
  }
  if (options.max_restarts < 0) {
    return InvalidArgumentError("max_restarts=" + std::to_string(options.max_restarts) +
                                " must not be negative");
  }
  if (options.check_arguments) {
    std::vector<char*> copy(argv, argv + argc);
    copy.push_back(nullptr);
    if (std::string problem = options.check_arguments(argc, copy.data()); !problem.empty()) {
      return InvalidArgumentError(problem);
    }
  }

  DDP_ASSIGN_OR_RETURN(std::string token, GenerateJobToken());
  store::TcpStoreServerOptions server_options;
  server_options.bind_address = "127.0.0.1";
  server_options.port = 0;
  server_options.job_token = token;
  StatusOr<std::unique_ptr<store::TcpStoreServer>> started_server = store::TcpStoreServer::Start(server_options);
  if (!started_server.ok()) {
    // Named as the store's, so that SelfLaunchOrExit does not blame the
    // workers, which never started.
    return Status(started_server.status().code(),
                  "cannot serve the workers' rendezvous store: " + started_server.status().message());
  }
  std::unique_ptr<store::TcpStoreServer> server = std::move(started_server).value();

  const std::string program = ProgramName(argc, argv);
  // One deadline for the whole run, restarts included.
  const Deadline deadline = options.max_run_time.count() > 0
                                ? Clock::now() + options.max_run_time
                                : Deadline::max();
  GroupResult result;
  const InterruptsCaught interrupts_caught;
  for (int attempt = 0;; ++attempt) {
    if (const int signo = InterruptSignal(); signo != 0) {
      // Caught before this attempt could start: end the job instead.
      result.reason = "interrupted by " + SignalName(signo) +
                      (attempt == 0 ? std::string(" before the workers started")
                                    : " before restart " + std::to_string(attempt) + " started");
      result.outcome = GroupOutcome::kInterrupted;
      result.signal = signo;
      WriteLauncherLine(std::string(program) + ": " + result.reason + "\n");
      break;
    }
    std::vector<WorkerSpec> specs;
    for (int rank = 0; rank < n; ++rank) {
      LaunchEnv worker;
      worker.rank = rank;
      worker.world_size = n;
      worker.local_rank = rank;
      worker.local_world_size = n;
      worker.group_rank = 0;
      worker.master_addr = "127.0.0.1";
      worker.master_port = server->port();
      worker.restart_count = attempt;
      worker.job_token = token;
      worker.store_hosted_by_launcher = true;
      WorkerSpec spec;
      spec.rank = rank;
      spec.program = "/proc/self/exe";
      spec.argv.assign(argv, argv + argc);
      spec.env = ToEnvironment(worker);
      specs.push_back(std::move(spec));
    }
    SpawnOptions spawn;
    spawn.grace = options.grace;
    spawn.exec_timeout = options.exec_timeout;
    spawn.output.prefix = n > 1 && options.prefix_output;
    spawn.on_notice = [program](const std::string& line) {
      WriteLauncherLine(std::string(program) + ": " + line + "\n");
    };
    StatusOr<std::unique_ptr<WorkerGroup>> started = WorkerGroup::Start(std::move(specs), spawn);
    if (!started.ok()) {
      // The first start failing is returned (SelfLaunchOrExit: exit 2 for
      // a program that cannot run here, 1 for a lack of resources). A
      // restart failing ends a job whose workers already
      // failed: that failure is its status, not the start's.
      if (attempt == 0) return started.status();
      WriteLauncherLine(std::string(program) + ": restart " + std::to_string(attempt) +
                        " could not start the workers: " + started.status().message() + "\n");
      break;
    }
    std::unique_ptr<WorkerGroup> group = std::move(*started);
    result = group->Wait(deadline);
    group.reset();  // every worker of this attempt is gone
    if (result.outcome == GroupOutcome::kTimedOut) {
      // Wait's own words say "the deadline": name the option that set it.
      result.reason = "max_run_time (" + std::to_string(options.max_run_time.count()) + " ms) ran out: " +
                      result.reason;
    }
    if (result.output_dropped > 0) {
      WriteLauncherLine(std::string(program) + ": dropped " + std::to_string(result.output_dropped) +
                        " bytes of worker output: stdout or stderr took nothing for 2 s\n");
    }
    for (const std::string& line : result.log_failures) WriteLauncherLine(std::string(program) + ": " + line + "\n");
    if (const int signo = InterruptSignal(); signo != 0 && result.outcome != GroupOutcome::kInterrupted) {
      // Arrived after Wait's last look: still no restart.
      result.reason = (result.reason.empty() ? "" : result.reason + "; ") + "interrupted by " +
                      SignalName(signo);
      result.outcome = GroupOutcome::kInterrupted;
      result.signal = signo;
    }
    // Only a failing worker restarts the job: not Ctrl-C, not the time limit.
    // Nor a failure once max_run_time is over (stopping the failed attempt
    // may outlast it): the restart's workers would only be stopped at once,
    // and the time limit would hide the failure's status.
    const bool restartable = result.outcome == GroupOutcome::kWorkerFailed && attempt < options.max_restarts;
    const bool out_of_time = restartable && Clock::now() >= deadline;
    const bool restart = restartable && !out_of_time;
    if (result.outcome != GroupOutcome::kSucceeded) {
      const std::string next = restart ? "; restarting the workers (restart " +
                                             std::to_string(attempt + 1) + " of " +
                                             std::to_string(options.max_restarts) + ")"
                               : out_of_time ? "; no restart: max_run_time (" +
                                                   std::to_string(options.max_run_time.count()) + " ms) ran out"
                                             : "";
      WriteLauncherLine(std::string(program) + ": " + result.reason + next + "\n");
    }
    if (!restart) break;
  }
  server->Stop();
  return SelfLaunchResult{.run_as_worker = false, .exit_code = result.ExitCode()};
}

void SelfLaunchOrExit(int& argc, char** argv, const SelfLaunchOptions& options) {
  StatusOr<SelfLaunchResult> result = SelfLaunch(argc, argv, options);
  if (!result.ok()) {
    // Bad input exits 2; workers that could not start for lack of
    // descriptors, processes or memory are a failure of the run (exit 1).
    const bool bad_input = result.status().code() == StatusCode::kInvalidArgument;
    const bool store = result.status().message().starts_with("cannot serve the workers' rendezvous store: ");
    const char* shortage = result.status().code() != StatusCode::kResourceExhausted ? ""
                           : store ? "lack of resources (not bad input): "
                                   : "the workers could not start for lack of resources (not bad input): ";
    std::fprintf(stderr, "%s: %s%s\n", ProgramName(argc, argv).c_str(), shortage,
                 result.status().message().c_str());
    std::fflush(stderr);
    std::exit(bad_input ? 2 : 1);
  }
  if (result->run_as_worker) return;
  std::fflush(stdout);
  std::fflush(stderr);
  // An interrupted launcher dies of the signal, as ddprun's does.
  DieOfInterruptSignal(result->exit_code);
  std::exit(result->exit_code);
}

}  // namespace ddp::transport::launch
