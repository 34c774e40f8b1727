// Two hosts for real: two network namespaces joined by a veth pair, each
// with its own host name (UTS namespace), one ddprun per namespace with two
// workers each, all-reducing over UCX's TCP transport between them, then
// training with DDP the same way. Needs
// root (CAP_NET_ADMIN, CAP_SYS_ADMIN), as CI runs it.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/launch/launch_test_util.h"
#include "transport/launch/spawn.h"

namespace ddp::transport::launch {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;
namespace lt = testing;

constexpr char kPrefix[] = "ddpns";
constexpr char kAddrA[] = "10.231.0.1";
constexpr char kAddrB[] = "10.231.0.2";
constexpr char kDevice[] = "ddp0";
constexpr char kPort[] = "29555";
constexpr char kToken[] = "netns-test-token";

std::string Tool(const std::string& name) {
  StatusOr<std::string> path = ResolveProgram(name);
  return path.ok() ? *path : name;
}

// Runs a command to its end; returns its output, and its exit code in `code`.
std::string Run(std::vector<std::string> argv, int* code = nullptr) {
  lt::ProgramRun run = lt::RunProgram(std::move(argv), {}, 20s);
  if (code) *code = run.exit_code;
  return run.output;
}

// Kills whatever runs in namespace `ns` and deletes it.
void RemoveNamespace(const std::string& ns) {
  std::istringstream pids(Run({Tool("ip"), "netns", "pids", ns}));
  for (pid_t pid; pids >> pid;) kill(pid, SIGKILL);
  Run({Tool("ip"), "netns", "del", ns});
}

// Two namespaces A and B joined by a veth pair named kDevice on both sides.
// Removed on destruction, with everything running in them; namespaces left
// by an earlier run that died are removed first. Should this process die
// without running destructors (a crash, the test timeout's SIGKILL), a
// reaper removes them: a shell in a session of its own that waits for the
// end of a pipe only this process holds open.
class TwoHosts {
 public:
  TwoHosts() {
    std::istringstream list(Run({Tool("ip"), "netns", "list"}));
    for (std::string line; std::getline(list, line);) {
      const std::string name = line.substr(0, line.find(' '));
      if (name.rfind(kPrefix, 0) != 0 || name.size() < sizeof(kPrefix) + 1) continue;
      const std::string pid = name.substr(sizeof(kPrefix));  // after "ddpnsA"/"ddpnsB"
      if (access(("/proc/" + pid).c_str(), F_OK) != 0) RemoveNamespace(name);
    }
    const std::string pid = std::to_string(getpid());
    a_ = std::string(kPrefix) + "A" + pid;
    b_ = std::string(kPrefix) + "B" + pid;
    const std::string va = "dva" + pid, vb = "dvb" + pid;
    const std::string ip = Tool("ip");
    StartReaper(ip);
    for (std::vector<std::string> cmd : std::vector<std::vector<std::string>>{
             {ip, "netns", "add", a_},
             {ip, "netns", "add", b_},
             {ip, "link", "add", va, "type", "veth", "peer", "name", vb},
             {ip, "link", "set", va, "netns", a_},
             {ip, "link", "set", vb, "netns", b_},
             {ip, "-n", a_, "link", "set", va, "name", kDevice},
             {ip, "-n", b_, "link", "set", vb, "name", kDevice},
             {ip, "-n", a_, "addr", "add", std::string(kAddrA) + "/24", "dev", kDevice},
             {ip, "-n", b_, "addr", "add", std::string(kAddrB) + "/24", "dev", kDevice},
             {ip, "-n", a_, "link", "set", kDevice, "up"},
             {ip, "-n", b_, "link", "set", kDevice, "up"},
             {ip, "-n", a_, "link", "set", "lo", "up"},
             {ip, "-n", b_, "link", "set", "lo", "up"},
         }) {
      int code = 0;
      const std::string out = Run(cmd, &code);
      if (code != 0) {
        error_ = "setting up network namespaces failed (this test needs root): `";
        for (const std::string& part : cmd) error_ += part + " ";
        error_ += "`: " + out;
        return;
      }
    }
  }
  ~TwoHosts() {
    RemoveNamespace(a_);
    RemoveNamespace(b_);
    if (reaper_pipe_ >= 0) close(reaper_pipe_);  // the reaper finds nothing left and exits
    if (reaper_ > 0) WaitForReaper(60s);
  }

  const std::string& error() const { return error_; }
  const std::string& ns(int node) const { return node == 0 ? a_ : b_; }

  // Starts ddprun for `node` in its namespace, under its own host name,
  // running `program` (a runfile) with `worker_flags` and `env` added.
  // With `c10d`, the launcher gets torchrun's dynamic rendezvous flags
  // instead of its node rank and node 0's address.
  std::unique_ptr<WorkerGroup> StartNode(
      int node, std::vector<std::string> ddprun_flags, std::vector<std::string> worker_flags,
      const std::string& program = "tests/launch/netns_worker",
      std::vector<std::pair<std::string, std::string>> env = {}, bool c10d = false) {
    std::vector<std::string> argv = {Tool("ip"), "netns", "exec", ns(node), Tool("unshare"), "--uts",
                                     Tool("sh"), "-c", "hostname \"$0\" && exec \"$@\"",
                                     "ddp-node" + std::to_string(node),
                                     lt::Runfile("transport/launch/ddprun"),
                                     "--nnodes=2",
                                     "--nproc_per_node=2"};
    if (c10d) {
      argv.push_back("--rdzv_backend=c10d");
      argv.push_back(std::string("--rdzv_endpoint=") + kAddrA + ":" + kPort);
    } else {
      argv.push_back("--node_rank=" + std::to_string(node));
      argv.push_back(std::string("--master_addr=") + kAddrA);
      argv.push_back(std::string("--master_port=") + kPort);
    }
    argv.insert(argv.end(), ddprun_flags.begin(), ddprun_flags.end());
    argv.push_back(lt::Runfile(program));
    argv.insert(argv.end(), worker_flags.begin(), worker_flags.end());
    env.emplace_back("DDP_JOB_TOKEN", kToken);
    env.emplace_back("UCX_NET_DEVICES", kDevice);
    auto group = lt::StartProgram(argv, env);
    EXPECT_TRUE(group.ok()) << group.status();
    return group.ok() ? std::move(group).value() : nullptr;
  }

  // Runs `program` on both hosts (StartNode) to its end, up to `limit`;
  // expects both launchers to exit 0 and returns everything they printed.
  std::string RunOnBoth(std::vector<std::string> worker_flags, const std::string& program,
                        std::vector<std::pair<std::string, std::string>> env,
                        std::chrono::seconds limit) {
    auto node0 = StartNode(0, {}, worker_flags, program, env);
    auto node1 = StartNode(1, {}, worker_flags, program, env);
    if (!node0 || !node1) return "";
    const lt::ProgramRun run0 = lt::WaitProgram(*node0, limit);
    const lt::ProgramRun run1 = lt::WaitProgram(*node1, limit);
    EXPECT_EQ(run0.exit_code, 0) << run0.output;
    EXPECT_EQ(run1.exit_code, 0) << run1.output;
    return run0.output + run1.output;
  }
  // Takes the link down on both sides.
  void CutLink() {
    Run({Tool("ip"), "-n", a_, "link", "set", kDevice, "down"});
    Run({Tool("ip"), "-n", b_, "link", "set", kDevice, "down"});
  }

  // True when nothing runs in either namespace any more.
  bool Empty() {
    return Run({Tool("ip"), "netns", "pids", a_}).empty() &&
           Run({Tool("ip"), "netns", "pids", b_}).empty();
  }

 private:
  void StartReaper(const std::string& ip) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[0], 0);  // stdin; the copy is not close-on-exec
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID);
    // Twice: a launcher killed in the first pass may have started a worker.
    const std::string script =
        "read _; for pass in 1 2; do for ns in \"$1\" \"$2\"; do "
        "\"$0\" netns pids \"$ns\" | xargs -r kill -9; done; done; "
        "for ns in \"$1\" \"$2\"; do \"$0\" netns del \"$ns\"; done";
    const std::string sh = Tool("sh");
    std::vector<std::string> args = {sh, "-c", script, ip, a_, b_};
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    if (posix_spawn(&reaper_, sh.c_str(), &actions, &attr, argv.data(), environ) != 0) reaper_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    close(fds[0]);
    reaper_pipe_ = fds[1];
  }

  // Waits for the reaper to end, up to `timeout` (its `ip` commands could
  // hang); past it, kills its session and fails the test.
  void WaitForReaper(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    for (;;) {
      const pid_t r = waitpid(reaper_, nullptr, WNOHANG);
      if (r == reaper_ || r < 0) return;
      if (Clock::now() >= until) break;
      std::this_thread::sleep_for(5ms);
    }
    ADD_FAILURE() << "the namespace reaper (pid " << reaper_ << ") did not end within "
                  << timeout.count() << " ms; killed";
    kill(-reaper_, SIGKILL);  // its session's group: the shell and what it runs
    kill(reaper_, SIGKILL);
    waitpid(reaper_, nullptr, 0);  // SIGKILL ends it
  }

  std::string a_, b_, error_;
  pid_t reaper_ = -1;
  int reaper_pipe_ = -1;  // write end; closing it (or dying) starts the reaper
};

TEST(NetnsTest, FourRanksOnTwoHostsAllReduceBroadcastAllGather) {
  TwoHosts hosts;
  ASSERT_EQ(hosts.error(), "");
  const std::string all = hosts.RunOnBoth({"--mode=check"}, "tests/launch/netns_worker", {}, 60s);
  for (int r = 0; r < 4; ++r) {
    const std::string rs = std::to_string(r);
    // The topology sees two hosts and picks the hierarchical all-reduce,
    // whose steps inside each host go through shared memory. The two hosts
    // share one kernel (and this machine's cores) and talk over TCP, so
    // every rank counts all four and its waits yield at once.
    EXPECT_THAT(all, ContainsRegex("\\[" + rs + "\\] rank " + rs +
                                   " hosts 2 host_shm 1 tls [^ ]+ ring [0-9 ]+ algo_1MiB "
                                   "hierarchical kernel_ranks 4 yields 1 at_once 1\n"));
    EXPECT_THAT(all, HasSubstr("[" + rs + "] rank " + rs + " ok"));
  }
  EXPECT_TRUE(hosts.Empty());
}

// torchrun's dynamic rendezvous across hosts: the launcher on host B starts
// first and cannot listen on host A's address, so it waits for A's store
// and joins as node 1; A's launcher serves the store and is node 0.
TEST(NetnsTest, C10dRendezvousMakesTheEndpointsHostNodeZero) {
  TwoHosts hosts;
  ASSERT_EQ(hosts.error(), "");
  auto node_b = hosts.StartNode(1, {}, {"--mode=check"}, "tests/launch/netns_worker", {}, /*c10d=*/true);
  std::this_thread::sleep_for(300ms);
  auto node_a = hosts.StartNode(0, {}, {"--mode=check"}, "tests/launch/netns_worker", {}, /*c10d=*/true);
  ASSERT_TRUE(node_a && node_b);
  const lt::ProgramRun run_a = lt::WaitProgram(*node_a, 60s);
  const lt::ProgramRun run_b = lt::WaitProgram(*node_b, 60s);
  ASSERT_EQ(run_a.exit_code, 0) << run_a.output;
  ASSERT_EQ(run_b.exit_code, 0) << run_b.output;
  EXPECT_THAT(run_b.output, HasSubstr("ddprun: joined as node 1 of 2"));
  EXPECT_THAT(run_a.output, Not(HasSubstr("joined as node")));
  for (int r = 0; r < 4; ++r) {
    const std::string rs = std::to_string(r);
    EXPECT_THAT(r < 2 ? run_a.output : run_b.output, HasSubstr("[" + rs + "] rank " + rs + " ok"));
  }
  EXPECT_TRUE(hosts.Empty());
}

// DDP across the two hosts: //ddp:ddp_equivalence_test's worker on four
// ranks (two per host) trains the MLP 20 steps under each bucket layout and
// checks the parameters against one process on the concatenated batches
// (1e-5 relative) and that every replica is bitwise identical.
TEST(NetnsTest, DdpAcrossHostsMatchesOneProcess) {
  TwoHosts hosts;
  ASSERT_EQ(hosts.error(), "");
  const std::vector<std::pair<std::string, std::string>> env = {
      {"DDP_TEST_WORKER", "equivalence"}, {"DDP_TEST_MODEL", "mlp"}, {"DDP_TEST_TIMEOUT_MS", "60000"}};
  const std::string all = hosts.RunOnBoth({}, "ddp/ddp_equivalence_test", env, 240s);
  // Every rank reports each layout's difference (and none failed).
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(all, ContainsRegex("\\[" + std::to_string(r) +
                                   "\\] mlp \\[one bucket per parameter\\] on 4 ranks: max "
                                   "relative difference"))
        << all;
  }
  EXPECT_THAT(all, Not(HasSubstr("FAIL"))) << all;
  EXPECT_TRUE(hosts.Empty());
}

TEST(NetnsTest, CutLinkFailsEveryRankWithinTheDeadline) {
  TwoHosts hosts;
  ASSERT_EQ(hosts.error(), "");
  const std::string markers = lt::MakeTempDir("netns_markers");
  constexpr int kCallTimeoutMs = 3000;
  // How far past its deadline a rank may report on a busy machine.
  constexpr int kSlackMs = 2000;
  // How long a store access may take when no call's deadline bounds it
  // (1-2 s by default): long here, so that a failing call that waits on
  // the cut-off store past its deadline (posting or reading the abort
  // reason, or a watchdog read capped by this instead of the deadline)
  // overruns the slack by seconds. Leaving after the failure may wait on
  // the store as long, twice: the grace period covers that.
  constexpr int kStoreWaitMs = 3 * kSlackMs;
  const std::vector<std::string> ddprun_flags = {"--node_timeout=2", "--grace_period=30"};
  const std::vector<std::string> worker_flags = {
      "--mode=loop", "--call_timeout_ms=" + std::to_string(kCallTimeoutMs),
      "--store_wait_ms=" + std::to_string(kStoreWaitMs), "--marker_dir=" + markers};
  auto node0 = hosts.StartNode(0, ddprun_flags, worker_flags);
  auto node1 = hosts.StartNode(1, ddprun_flags, worker_flags);
  ASSERT_TRUE(node0 && node1);
  // Wait until all four ranks are looping, then cut the link.
  for (int r = 0; r < 4; ++r) {
    const std::string path = markers + "/rank" + std::to_string(r) + ".looping";
    const auto deadline = Clock::now() + 60s;
    while (access(path.c_str(), F_OK) != 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(20ms);
    }
    ASSERT_EQ(access(path.c_str(), F_OK), 0) << "rank " << r << " never started looping";
  }
  const auto cut_at = Clock::now();
  hosts.CutLink();
  const lt::ProgramRun run0 = lt::WaitProgram(*node0, 60s);
  const lt::ProgramRun run1 = lt::WaitProgram(*node1, 60s);
  const auto took = Clock::now() - cut_at;

  // Both launchers exit non-zero, every rank reports the cut itself, within
  // the call deadline (plus scheduling slack on a busy machine, well short
  // of kStoreWaitMs, so that a store wait after the deadline fails this
  // test), and no rank crashes on its way out (UCX asserts when a worker is
  // destroyed while an endpoint to the silent host holds sends).
  EXPECT_NE(run0.exit_code, 0) << run0.output;
  EXPECT_NE(run1.exit_code, 0) << run1.output;
  const std::string all = run0.output + run1.output;
  for (int r = 0; r < 4; ++r) {
    const std::string rs = std::to_string(r);
    std::smatch m;
    const std::regex line("\\[" + rs + "\\] rank " + rs +
                          " failed after ([0-9]+) ms: (PEER_LOST|TIMED_OUT): ");
    ASSERT_TRUE(std::regex_search(all, m, line)) << "rank " << r << ":\n" << all;
    EXPECT_LE(std::stoi(m[1]), kCallTimeoutMs + kSlackMs) << m[0] << "\n" << all;
  }
  EXPECT_THAT(all, Not(HasSubstr("Assertion"))) << all;
  EXPECT_THAT(all, Not(HasSubstr("killed by signal"))) << all;
  EXPECT_LT(took, 45s);
  EXPECT_TRUE(hosts.Empty()) << "processes left in the namespaces";
}

}  // namespace
}  // namespace ddp::transport::launch
