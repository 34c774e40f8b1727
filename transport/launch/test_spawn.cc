#include "transport/launch/test_spawn.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "transport/launch/env.h"
#include "transport/launch/self_launch.h"
#include "transport/store/socket.h"
#include "transport/store/tcp_store.h"

namespace ddp::transport::launch::testing {
namespace {

std::map<std::string, WorkerFunction, std::less<>>& Registry() {
  static auto* registry = new std::map<std::string, WorkerFunction, std::less<>>();
  return *registry;
}

}  // namespace

bool RegisterTestWorker(const char* name, WorkerFunction fn) {
  Registry()[name] = fn;
  return true;
}

std::optional<int> RunTestWorkerIfRequested() {
  const char* name = std::getenv(kTestWorkerEnv);
  if (name == nullptr) return std::nullopt;
  auto it = Registry().find(std::string_view(name));
  if (it == Registry().end()) {
    std::fprintf(stderr, "test worker '%s' is not registered in this binary\n", name);
    return 97;
  }
  const int code = it->second();
  std::fflush(stdout);
  std::fflush(stderr);
  return code;
}

StatusOr<int> PickFreePort() { return store::FreeTcpPort(); }

int TestRunResult::ExitCode(int rank) const {
  const WorkerExit& w = group.workers.at(rank);
  if (!w.exited) return -1;
  return w.signaled ? 128 + w.code : w.code;
}

std::string TestRunResult::Summary() const {
  std::string out;
  for (size_t r = 0; r < group.workers.size(); ++r) {
    const WorkerExit& w = group.workers[r];
    out += w.ok() ? "rank " + std::to_string(r) + " (pid " + std::to_string(w.pid) + ") succeeded"
                  : w.Describe();
    out += "\n";
  }
  out += "group: " + (group.reason.empty() ? std::string("succeeded") : group.reason) + "\n";
  return out;
}

StatusOr<TestRunResult> RunTestWorkers(std::string_view worker, const TestRunOptions& options) {
  if (options.world_size < 1) return InvalidArgumentError("world_size must be at least 1");
  const int local = options.local_world_size > 0 ? options.local_world_size : options.world_size;
  TestRunResult result;
  DDP_ASSIGN_OR_RETURN(result.job_token, GenerateJobToken());
  std::unique_ptr<store::TcpStoreServer> server;
  if (options.host_store) {
    store::TcpStoreServerOptions server_options;
    server_options.job_token = result.job_token;
    DDP_ASSIGN_OR_RETURN(server, store::TcpStoreServer::Start(server_options));
    result.port = server->port();
  } else {
    DDP_ASSIGN_OR_RETURN(result.port, PickFreePort());
  }
  std::vector<WorkerSpec> specs;
  for (int rank = 0; rank < options.world_size; ++rank) {
    LaunchEnv env;
    env.rank = rank;
    env.world_size = options.world_size;
    env.local_rank = rank % local;
    env.local_world_size = local;
    env.group_rank = rank / local;
    env.master_addr = "127.0.0.1";
    env.master_port = result.port;
    env.job_token = result.job_token;
    env.store_hosted_by_launcher = options.host_store;
    WorkerSpec spec;
    spec.rank = rank;
    spec.program = "/proc/self/exe";
    spec.argv = {"test_worker_" + std::string(worker)};
    spec.env = ToEnvironment(env);
    spec.env.emplace_back(kTestWorkerEnv, std::string(worker));
    for (const auto& kv : options.env) spec.env.push_back(kv);
    if (auto it = options.rank_env.find(rank); it != options.rank_env.end()) {
      for (const auto& kv : it->second) spec.env.push_back(kv);
    }
    specs.push_back(std::move(spec));
  }
  SpawnOptions spawn;
  spawn.grace = options.grace;
  spawn.stop_all_on_failure = options.stop_all_on_failure;
  spawn.forward_signals = false;
  spawn.output.capture = true;
  spawn.output.prefix = true;
  spawn.output.to_terminal = options.echo_output;
  DDP_ASSIGN_OR_RETURN(std::unique_ptr<WorkerGroup> group,
                       WorkerGroup::Start(std::move(specs), spawn));
  result.group = group->Wait(Clock::now() + options.timeout);
  return result;
}

}  // namespace ddp::transport::launch::testing
