// A worker program for the launcher tests, driven by flags. It calls
// SelfLaunchOrExit first, so `test_worker --nproc_per_node=N ...` self-launches.
//
//   --store               rendezvous through the store of the launch env
//   --print_env           print what the launch env says
//   --print_roles         print torchrun's ROLE_RANK, ROLE_WORLD_SIZE and GROUP_WORLD_SIZE
//   --exit_code=R:C       rank R exits with code C (after the rendezvous)
//   --signal=R:S          rank R raises signal S
//   --fail_before_restart=K  rank 1 exits 1 while DDP_RESTART_COUNT < K
//   --sleep_ms=N          sleep N ms before finishing
//   --until_file=PATH     finish that sleep early once PATH exists (a test
//                         lets the job end when its steps are done)
//   --sleep_before_restart=K  sleep only while DDP_RESTART_COUNT < K
//   --pid_dir=DIR         write DIR/rank<R>.restart<C>.pid
//   --ignore_sigterm      ignore SIGTERM; with --pid_dir, each one that arrives
//                         (re)writes DIR/rank<R>.restart<C>.got_term with the pid
//   --self_launch_restarts=K  self-launch with SelfLaunchOptions::max_restarts = K
//   --self_launch_max_run_time_ms=N  self-launch with SelfLaunchOptions::max_run_time = N ms
//   --self_launch_grace_ms=N  self-launch with SelfLaunchOptions::grace = N ms
//   --self_launch_exec_timeout_ms=N  self-launch with SelfLaunchOptions::exec_timeout = N ms
//   --exit_when_peer_gone with --pid_dir: once every rank of this attempt
//                         wrote its pid, exit 3 as soon as another rank's
//                         process is gone (what a real worker does when a
//                         collective loses a peer); else finish after --sleep_ms
//   --slow_to_stop=R      rank R ignores SIGINT and SIGTERM (its launcher's
//                         SIGKILL after --grace_period ends it) and lost peers
//   --meet_on_master_port rank 0 listens on MASTER_PORT, as PyTorch's rank 0
//                         does for its own store, and the others connect to
//                         MASTER_ADDR:MASTER_PORT (after --store, if given)

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "transport/launch/env.h"
#include "transport/launch/self_launch.h"
#include "transport/store/tcp_store.h"

namespace {

using namespace std::chrono_literals;
using ddp::transport::Clock;
using ddp::transport::Deadline;
using ddp::transport::DeadlineIn;
using ddp::transport::Status;
using ddp::transport::StatusOr;
namespace store = ddp::transport::store;
namespace launch = ddp::transport::launch;

struct Flags {
  bool store = false;
  bool print_env = false;
  bool print_roles = false;
  int exit_rank = -1, exit_code = 0;
  int signal_rank = -1, signal = 0;
  int fail_before_restart = 0;
  int sleep_ms = 0;
  int sleep_before_restart = -1;  // -1: at every restart
  std::string until_file;
  std::string pid_dir;
  bool ignore_sigterm = false;
  bool exit_when_peer_gone = false;
  bool meet_on_master_port = false;
  int slow_to_stop_rank = -1;
};

bool ParsePair(std::string_view text, int& a, int& b) {
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos) return false;
  a = std::atoi(std::string(text.substr(0, colon)).c_str());
  b = std::atoi(std::string(text.substr(colon + 1)).c_str());
  return true;
}

// Reads argv into `f`; "" when every argument is known, else which is not.
std::string ParseFlags(int argc, char** argv, Flags& f) {
  for (int i = 1; i < argc; ++i) {
    std::string_view arg(argv[i]);
    auto value = [&](std::string_view name) -> std::optional<std::string_view> {
      if (arg.size() > name.size() && arg.substr(0, name.size()) == name &&
          arg[name.size()] == '=') {
        return arg.substr(name.size() + 1);
      }
      return std::nullopt;
    };
    if (arg == "--store") f.store = true;
    else if (arg == "--print_env") f.print_env = true;
    else if (arg == "--print_roles") f.print_roles = true;
    else if (arg == "--ignore_sigterm") f.ignore_sigterm = true;
    else if (arg == "--exit_when_peer_gone") f.exit_when_peer_gone = true;
    else if (arg == "--meet_on_master_port") f.meet_on_master_port = true;
    else if (auto v = value("--slow_to_stop")) f.slow_to_stop_rank = std::atoi(std::string(*v).c_str());
    else if (auto v = value("--exit_code")) ParsePair(*v, f.exit_rank, f.exit_code);
    else if (auto v = value("--signal")) ParsePair(*v, f.signal_rank, f.signal);
    else if (auto v = value("--fail_before_restart")) f.fail_before_restart = std::atoi(std::string(*v).c_str());
    else if (auto v = value("--sleep_ms")) f.sleep_ms = std::atoi(std::string(*v).c_str());
    else if (auto v = value("--sleep_before_restart")) f.sleep_before_restart = std::atoi(std::string(*v).c_str());
    else if (auto v = value("--pid_dir")) f.pid_dir = std::string(*v);
    else if (auto v = value("--until_file")) f.until_file = std::string(*v);
    else if (value("--self_launch_restarts")) continue;  // read by main
    else if (value("--self_launch_max_run_time_ms")) continue;  // read by main
    else if (value("--self_launch_grace_ms")) continue;  // read by main
    else if (value("--self_launch_exec_timeout_ms")) continue;  // read by main
    else return "unknown argument " + std::string(arg);
  }
  return "";
}

// --ignore_sigterm --pid_dir: the marker's path and contents, set before
// the handler is installed (it may only make async-signal-safe calls).
char g_term_mark[4096];
char g_term_pid[32];
size_t g_term_pid_len = 0;

void MarkSigterm(int) {
  const int saved = errno;
  const int fd = open(g_term_mark, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) {
    (void)!write(fd, g_term_pid, g_term_pid_len);
    close(fd);
  }
  errno = saved;
}

int Fail(const char* what, const Status& status) {
  std::fprintf(stderr, "test_worker: %s: %s\n", what, status.ToString().c_str());
  return 20;
}

int Rendezvous(const launch::LaunchEnv& env) {
  std::unique_ptr<store::TcpStoreServer> server;
  if (env.hosts_store()) {
    store::TcpStoreServerOptions options;
    options.bind_address = env.master_addr;
    options.port = env.master_port;
    options.job_token = env.job_token;
    auto started = store::TcpStoreServer::Start(options);
    if (!started.ok()) return Fail("store server", started.status());
    server = std::move(started).value();
  }
  const Deadline deadline = DeadlineIn(30s);
  auto client = store::TcpStoreClient::Connect(env.master_addr, env.master_port, env.job_token,
                                               deadline);
  if (!client.ok()) return Fail("connect", client.status());
  const std::string prefix = "test/" + env.StoreKeyPrefix();
  Status s = (*client)->Set(prefix + "rank/" + std::to_string(env.rank), "up", deadline);
  if (!s.ok()) return Fail("set", s);
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back(prefix + "rank/" + std::to_string(r));
  s = (*client)->Wait(keys, deadline);
  if (!s.ok()) return Fail("wait", s);
  std::printf("rank %d met %d ranks\n", env.rank, env.world_size);
  std::fflush(stdout);
  s = (*client)->Set(prefix + "finished/" + std::to_string(env.rank), "1", deadline);
  if (!s.ok()) return Fail("set finished", s);
  if (server) {
    // Keep serving until every rank has finished with the store.
    std::vector<std::string> finished;
    for (int r = 0; r < env.world_size; ++r) finished.push_back(prefix + "finished/" + std::to_string(r));
    s = (*client)->Wait(finished, deadline);
    if (!s.ok()) return Fail("wait finished", s);
  }
  return 0;
}

// --meet_on_master_port: what a PyTorch program's env:// rendezvous needs
// from MASTER_ADDR:MASTER_PORT: rank 0 can listen there and the others
// reach it. Each other rank sends one byte; rank 0 counts them.
int MeetOnMasterPort(const launch::LaunchEnv& env) {
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  if (addr == nullptr || port == nullptr) {
    std::fprintf(stderr, "test_worker: MASTER_ADDR or MASTER_PORT is not set\n");
    return 22;
  }
  const Deadline deadline = DeadlineIn(30s);
  if (env.rank == 0) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in any{};
    any.sin_family = AF_INET;
    any.sin_addr.s_addr = htonl(INADDR_ANY);
    any.sin_port = htons(static_cast<uint16_t>(std::atoi(port)));
    if (bind(fd, reinterpret_cast<sockaddr*>(&any), sizeof(any)) != 0 || listen(fd, 64) != 0) {
      std::fprintf(stderr, "test_worker: rank 0 cannot listen on MASTER_PORT=%s: %s\n", port, std::strerror(errno));
      return 23;
    }
    int met = 0;
    while (met < env.world_size - 1) {
      pollfd p = {fd, POLLIN, 0};
      if (Clock::now() >= deadline || poll(&p, 1, 100) < 0) break;
      if (!(p.revents & POLLIN)) continue;
      const int peer = accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
      char byte = 0;
      if (peer >= 0 && read(peer, &byte, 1) == 1) ++met;
      if (peer >= 0) close(peer);
    }
    close(fd);
    std::printf("rank 0 met %d ranks on MASTER_PORT\n", met + 1);
    std::fflush(stdout);
    return met == env.world_size - 1 ? 0 : 24;
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(addr, port, &hints, &found) != 0 || found == nullptr) {
    std::fprintf(stderr, "test_worker: cannot resolve MASTER_ADDR=%s\n", addr);
    return 22;
  }
  bool sent = false;
  while (!sent && Clock::now() < deadline) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(fd, found->ai_addr, found->ai_addrlen) == 0) sent = write(fd, "x", 1) == 1;
    close(fd);
    if (!sent) std::this_thread::sleep_for(20ms);
  }
  freeaddrinfo(found);
  if (!sent) {
    std::fprintf(stderr, "test_worker: rank %d never reached MASTER_ADDR:MASTER_PORT=%s:%s\n", env.rank, addr, port);
    return 25;
  }
  return 0;
}

// True when `pid` no longer runs: no such process, or a zombie not yet
// reaped by its launcher.
bool ProcessGone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] == 'Z';
}

pid_t ReadPid(const std::string& path) {
  std::ifstream in(path);
  long pid = -1;
  if (!(in >> pid)) return -1;
  return static_cast<pid_t>(pid);
}

// --exit_when_peer_gone: the other ranks' pids from --pid_dir (waiting up
// to 30 s for them), then a look every 10 ms until one is gone (exit 3) or
// --sleep_ms passed.
int WatchPeers(const Flags& flags, const launch::LaunchEnv& env) {
  std::vector<std::pair<int, pid_t>> peers;
  const Deadline deadline = DeadlineIn(30s);
  for (int r = 0; r < env.world_size; ++r) {
    if (r == env.rank) continue;
    const std::string path =
        flags.pid_dir + "/rank" + std::to_string(r) + ".restart" + std::to_string(env.restart_count) + ".pid";
    pid_t pid = ReadPid(path);
    for (; pid <= 0; pid = ReadPid(path)) {
      if (Clock::now() >= deadline) {
        std::fprintf(stderr, "test_worker: rank %d: no pid of rank %d in %s\n", env.rank, r, path.c_str());
        return 21;
      }
      std::this_thread::sleep_for(10ms);
    }
    peers.emplace_back(r, pid);
  }
  const Deadline end = DeadlineIn(std::chrono::milliseconds(flags.sleep_ms));
  while (Clock::now() < end) {
    for (const auto& [r, pid] : peers) {
      if (ProcessGone(pid)) {
        std::printf("rank %d: rank %d (pid %d) is gone\n", env.rank, r, static_cast<int>(pid));
        std::fflush(stdout);
        return 3;
      }
    }
    std::this_thread::sleep_for(10ms);
  }
  std::printf("rank %d done\n", env.rank);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  launch::SelfLaunchOptions self_launch;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg(argv[i]);
    const std::string_view flag = "--self_launch_restarts=";
    if (arg.substr(0, flag.size()) == flag) {
      self_launch.max_restarts = std::atoi(argv[i] + flag.size());
    }
    const std::string_view run_time = "--self_launch_max_run_time_ms=";
    if (arg.substr(0, run_time.size()) == run_time) {
      self_launch.max_run_time = std::chrono::milliseconds(std::atoi(argv[i] + run_time.size()));
    }
    const std::string_view grace = "--self_launch_grace_ms=";
    if (arg.substr(0, grace.size()) == grace) {
      self_launch.grace = std::chrono::milliseconds(std::atoi(argv[i] + grace.size()));
    }
    const std::string_view exec_timeout = "--self_launch_exec_timeout_ms=";
    if (arg.substr(0, exec_timeout.size()) == exec_timeout) {
      self_launch.exec_timeout = std::chrono::milliseconds(std::atoi(argv[i] + exec_timeout.size()));
    }
  }
  // The launcher refuses an unknown argument once, before any worker starts.
  self_launch.check_arguments = [](int argc, char** argv) {
    Flags unused;
    return ParseFlags(argc, argv, unused);
  };
  launch::SelfLaunchOrExit(argc, argv, self_launch);
  Flags flags;
  if (const std::string problem = ParseFlags(argc, argv, flags); !problem.empty()) {
    std::fprintf(stderr, "test_worker: %s\n", problem.c_str());
    return 64;
  }
  if (flags.ignore_sigterm) signal(SIGTERM, SIG_IGN);
  StatusOr<launch::LaunchEnv> env = launch::LaunchEnvFromProcess();
  if (!env.ok()) return Fail("launch env", env.status());
  if (env->rank == flags.slow_to_stop_rank) {
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
  }
  if (flags.ignore_sigterm && !flags.pid_dir.empty()) {
    // Still ignored, but a test can tell that the launcher began to stop
    // this worker.
    std::snprintf(g_term_mark, sizeof(g_term_mark), "%s/rank%d.restart%d.got_term", flags.pid_dir.c_str(),
                  env->rank, env->restart_count);
    g_term_pid_len = static_cast<size_t>(std::snprintf(g_term_pid, sizeof(g_term_pid), "%d\n", getpid()));
    struct sigaction action = {};
    action.sa_handler = MarkSigterm;
    action.sa_flags = SA_RESTART;
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, nullptr);
  }
  if (!flags.pid_dir.empty()) {
    const std::string path = flags.pid_dir + "/rank" + std::to_string(env->rank) + ".restart" +
                             std::to_string(env->restart_count) + ".pid";
    const std::string tmp = path + ".tmp";
    if (std::FILE* f = std::fopen(tmp.c_str(), "w")) {
      std::fprintf(f, "%d\n", getpid());
      std::fclose(f);
      std::rename(tmp.c_str(), path.c_str());
    }
  }
  if (flags.print_env) {
    std::printf("rank %d/%d local %d/%d group %d restart %d master %s:%d store %s token_len %zu\n",
                env->rank, env->world_size, env->local_rank, env->local_world_size,
                env->group_rank, env->restart_count, env->master_addr.c_str(), env->master_port,
                env->store_hosted_by_launcher ? "launcher" : "rank0", env->job_token.size());
    const char* run_id = std::getenv(launch::kEnvRunId);
    std::printf("rank %d run_id %s\n", env->rank, run_id != nullptr ? run_id : "-");
    std::fflush(stdout);
  }
  if (flags.print_roles) {
    // torchrun's variables that LaunchEnv does not read.
    auto var = [](const char* name) {
      const char* value = std::getenv(name);
      return value != nullptr ? value : "-";
    };
    std::printf("rank %d role_rank %s of %s group_world_size %s\n", env->rank, var("ROLE_RANK"),
                var("ROLE_WORLD_SIZE"), var("GROUP_WORLD_SIZE"));
    std::fflush(stdout);
  }
  if (env->rank == 1 && env->restart_count < flags.fail_before_restart) {
    std::fprintf(stderr, "rank 1 fails on attempt %d\n", env->restart_count);
    return 1;
  }
  if (flags.store) {
    const int rc = Rendezvous(*env);
    if (rc != 0) return rc;
  }
  if (flags.meet_on_master_port) {
    const int rc = MeetOnMasterPort(*env);
    if (rc != 0) return rc;
  }
  if (env->rank == flags.signal_rank) raise(flags.signal);
  if (env->rank == flags.exit_rank) return flags.exit_code;
  // A slow rank is stuck elsewhere (say, in a long kernel): it notices nothing.
  if (flags.exit_when_peer_gone && env->rank != flags.slow_to_stop_rank) return WatchPeers(flags, *env);
  const bool sleeps = flags.sleep_before_restart < 0 || env->restart_count < flags.sleep_before_restart;
  for (int slept = 0; sleeps && slept < flags.sleep_ms; slept += 10) {
    if (!flags.until_file.empty() && access(flags.until_file.c_str(), F_OK) == 0) break;
    std::this_thread::sleep_for(10ms);
  }
  std::printf("rank %d done\n", env->rank);
  return 0;
}
