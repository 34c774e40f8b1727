// Several ddprun launchers on this host, one per "node", meeting through
// node 0's store on 127.0.0.1.

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/launch/launch_test_util.h"
#include "transport/launch/test_spawn.h"
#include "transport/store/tcp_store.h"

namespace ddp::transport::launch {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;
using testing::CountLines;

std::string Ddprun() { return testing::Runfile("transport/launch/ddprun"); }
std::string Worker() { return testing::Runfile("transport/launch/test_worker"); }

constexpr char kToken[] = "multinode-test-token";

std::string Hostname() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

std::string ReadFile(const std::string& path) {
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  return text.str();
}

// Waits until the file at `path` holds `text`, up to `timeout`.
bool FileGets(const std::string& path, const std::string& text, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (ReadFile(path).find(text) == std::string::npos) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

class Job {
 public:
  // Starts `nodes` launchers with `flags` (plus --nnodes, --node_rank,
  // --master_addr, --master_port) running the test worker with
  // `worker_flags`. `node_flags` adds flags for one node. Node 0 starts
  // first, then the others (they retry until its store is up).
  Job(int nodes, std::vector<std::string> flags, std::vector<std::string> worker_flags,
      std::map<int, std::vector<std::string>> node_flags = {}) {
    StatusOr<int> port = testing::PickFreePort();
    EXPECT_TRUE(port.ok()) << port.status();
    port_ = *port;
    launchers_.resize(nodes);
    for (int node = 0; node < nodes; ++node) {
      std::vector<std::string> argv = {Ddprun(), "--nnodes=" + std::to_string(nodes),
                                       "--node_rank=" + std::to_string(node),
                                       "--master_addr=127.0.0.1",
                                       "--master_port=" + std::to_string(port_)};
      argv.insert(argv.end(), flags.begin(), flags.end());
      for (const std::string& f : node_flags[node]) argv.push_back(f);
      argv.push_back(Worker());
      argv.insert(argv.end(), worker_flags.begin(), worker_flags.end());
      auto group = testing::StartProgram(argv, {{"DDP_JOB_TOKEN", kToken}});
      EXPECT_TRUE(group.ok()) << group.status();
      launchers_[node] = std::move(group).value();
    }
  }

  pid_t launcher_pid(int node) const { return launchers_.at(node)->pids()[0]; }
  int port() const { return port_; }

  // Waits for every launcher; one result per node.
  std::vector<testing::ProgramRun> Wait(std::chrono::milliseconds timeout = 30s) {
    std::vector<testing::ProgramRun> runs;
    for (auto& launcher : launchers_) runs.push_back(testing::WaitProgram(*launcher, timeout));
    return runs;
  }

 private:
  int port_ = 0;
  std::vector<std::unique_ptr<WorkerGroup>> launchers_;
};

std::vector<pid_t> WorkerPids(const std::string& dir, int count) {
  std::vector<pid_t> pids;
  for (int r = 0; r < count; ++r) {
    pids.push_back(testing::ReadPidFile(dir + "/rank" + std::to_string(r) + ".restart0.pid", 10s));
  }
  return pids;
}

void ExpectAllGone(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) {
    ASSERT_GT(pid, 0);
    EXPECT_TRUE(testing::GoneWithin(pid, 5s)) << "worker " << pid << " is still running";
  }
}

TEST(DdprunMultinodeTest, TwoNodesFormOneJob) {
  Job job(2, {"--nproc_per_node=2"}, {"--store", "--print_env"});
  const auto runs = job.Wait();
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].exit_code, 0) << runs[0].output;
  EXPECT_EQ(runs[1].exit_code, 0) << runs[1].output;
  EXPECT_THAT(runs[0].output, HasSubstr("[0] rank 0/4 local 0/2 group 0 restart 0"));
  EXPECT_THAT(runs[0].output, HasSubstr("[1] rank 1/4 local 1/2 group 0 restart 0"));
  EXPECT_THAT(runs[1].output, HasSubstr("[2] rank 2/4 local 0/2 group 1 restart 0"));
  EXPECT_THAT(runs[1].output, HasSubstr("[3] rank 3/4 local 1/2 group 1 restart 0"));
  // Every worker met all four, through node 0's store.
  EXPECT_EQ(CountLines(runs[0].output + runs[1].output, "met 4 ranks"), 4);
  // One run id, node 0's, on both nodes.
  const size_t at = runs[0].output.find("rank 0 run_id ");
  ASSERT_NE(at, std::string::npos) << runs[0].output;
  const std::string id = runs[0].output.substr(at + 14, 16);
  EXPECT_EQ(CountLines(runs[0].output + runs[1].output, " run_id " + id), 4) << runs[0].output << runs[1].output;
  // On 127.0.0.1, which other hosts could not reach: node 0 says so.
  EXPECT_THAT(runs[0].output, HasSubstr("ddprun: warning: the rendezvous store listens on loopback addresses "
                                        "only (what 127.0.0.1 resolves to on this host)"));
  EXPECT_EQ(CountLines(runs[0].output + runs[1].output,
                       "store launcher token_len " + std::to_string(sizeof(kToken) - 1)),
            4);
}

// As under torchrun's static rendezvous, nodes may run different numbers of
// workers: node k's first rank is the sum of nodes 0 to k - 1's counts,
// WORLD_SIZE and ROLE_WORLD_SIZE are their sum, LOCAL_WORLD_SIZE is the
// node's own. The old code refused node 1 ("every node needs the same
// flags").
TEST(DdprunMultinodeTest, StaticNodesMayRunDifferentNumbersOfWorkers) {
  Job job(2, {}, {"--store", "--print_env", "--print_roles"},
          {{0, {"--nproc_per_node=1"}}, {1, {"--nproc_per_node=2"}}});
  const auto runs = job.Wait();
  ASSERT_EQ(runs.size(), 2u);
  const std::string all = runs[0].output + runs[1].output;
  EXPECT_EQ(runs[0].exit_code, 0) << all;
  EXPECT_EQ(runs[1].exit_code, 0) << all;
  EXPECT_EQ(CountLines(all, "met 3 ranks"), 3) << all;
  EXPECT_THAT(runs[0].output, HasSubstr("rank 0/3 local 0/1 group 0 restart 0")) << all;
  EXPECT_THAT(runs[0].output, HasSubstr("rank 0 role_rank 0 of 3 group_world_size 2")) << all;
  EXPECT_THAT(runs[1].output, HasSubstr("[1] rank 1/3 local 0/2 group 1 restart 0")) << all;
  EXPECT_THAT(runs[1].output, HasSubstr("[2] rank 2/3 local 1/2 group 1 restart 0")) << all;
  EXPECT_THAT(runs[1].output, HasSubstr("[1] rank 1 role_rank 1 of 3 group_world_size 2")) << all;
  EXPECT_THAT(runs[1].output, HasSubstr("[2] rank 2 role_rank 2 of 3 group_world_size 2")) << all;
}

// Node 0 picks the workers' MASTER_PORT, free for a PyTorch program's rank 0
// on node 0, and every node's workers reach it there; the restart gets one too.
TEST(DdprunMultinodeTest, EveryNodesWorkersReachMasterPortOnNodeZero) {
  Job job(2, {"--nproc_per_node=2", "--max_restarts=1"},
          {"--store", "--meet_on_master_port", "--fail_before_restart=1"});
  const auto runs = job.Wait();
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].exit_code, 0) << runs[0].output;
  EXPECT_EQ(runs[1].exit_code, 0) << runs[1].output;
  EXPECT_EQ(CountLines(runs[0].output, "[0] rank 0 met 4 ranks on MASTER_PORT"), 1) << runs[0].output;
}

TEST(DdprunMultinodeTest, FailureOnOneNodeStopsEveryNode) {
  const std::string dir = testing::MakeTempDir("multinode_failure");
  Job job(2, {"--nproc_per_node=2"},
          {"--store", "--exit_code=3:7", "--sleep_ms=30000", "--pid_dir=" + dir});
  const std::vector<pid_t> workers = WorkerPids(dir, 4);
  const auto start = Clock::now();
  const auto runs = job.Wait();
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_EQ(runs[1].exit_code, 1) << runs[1].output;  // as torchrun: not the worker's 7
  EXPECT_EQ(runs[0].exit_code, 1) << runs[0].output;
  const std::string reason = "ddprun: node 1: rank 3 \\(pid [0-9]+\\) exited with code 7";
  EXPECT_THAT(runs[0].output, ContainsRegex(reason));
  EXPECT_THAT(runs[1].output, ContainsRegex(reason));
  ExpectAllGone(workers);
}

TEST(DdprunMultinodeTest, RestartCoversEveryNode) {
  Job job(2, {"--nproc_per_node=2", "--max_restarts=1"},
          {"--store", "--print_env", "--fail_before_restart=1"});
  const auto runs = job.Wait();
  EXPECT_EQ(runs[0].exit_code, 0) << runs[0].output;
  EXPECT_EQ(runs[1].exit_code, 0) << runs[1].output;
  for (const auto& run : runs) {
    EXPECT_THAT(run.output, HasSubstr("restarting the job (restart 1 of 1)"));
    EXPECT_EQ(CountLines(run.output, "met 4 ranks"), 2) << run.output;
  }
  EXPECT_THAT(runs[1].output, HasSubstr("[3] rank 3/4 local 1/2 group 1 restart 1"));
}

TEST(DdprunMultinodeTest, KilledLauncherOfAnotherNodeIsNoticed) {
  const std::string dir = testing::MakeTempDir("multinode_kill_node1");
  // 3 s: a live launcher starved on a loaded machine still beats in time;
  // the job ends well before the workers' 30 s.
  Job job(2, {"--nproc_per_node=1", "--node_timeout=3"}, {"--sleep_ms=30000", "--pid_dir=" + dir});
  const std::vector<pid_t> workers = WorkerPids(dir, 2);
  const auto start = Clock::now();
  kill(job.launcher_pid(1), SIGKILL);
  const auto runs = job.Wait();
  EXPECT_LT(Clock::now() - start, 15s);
  EXPECT_EQ(runs[1].exit_code, 128 + SIGKILL);
  EXPECT_EQ(runs[0].exit_code, 1) << runs[0].output;
  EXPECT_THAT(runs[0].output, HasSubstr("node 1's launcher sent no heartbeat for"));
  ExpectAllGone(workers);
}

TEST(DdprunMultinodeTest, KilledNodeZeroStopsTheOthers) {
  const std::string dir = testing::MakeTempDir("multinode_kill_node0");
  Job job(2, {"--nproc_per_node=1"}, {"--sleep_ms=30000", "--pid_dir=" + dir});
  const std::vector<pid_t> workers = WorkerPids(dir, 2);
  const auto start = Clock::now();
  kill(job.launcher_pid(0), SIGKILL);
  const auto runs = job.Wait();
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_EQ(runs[1].exit_code, 1) << runs[1].output;
  EXPECT_THAT(runs[1].output, HasSubstr("the launcher of node 0 is gone"));
  ExpectAllGone(workers);
}

TEST(DdprunMultinodeTest, InterruptedNodeStopsTheJobWithoutRestart) {
  const std::string dir = testing::MakeTempDir("multinode_sigterm");
  Job job(2, {"--nproc_per_node=1", "--max_restarts=3"}, {"--sleep_ms=30000", "--pid_dir=" + dir});
  const std::vector<pid_t> workers = WorkerPids(dir, 2);
  kill(job.launcher_pid(1), SIGTERM);
  const auto runs = job.Wait();
  EXPECT_EQ(runs[1].exit_code, 128 + SIGTERM) << runs[1].output;
  EXPECT_EQ(runs[0].exit_code, 1) << runs[0].output;
  EXPECT_THAT(runs[0].output, HasSubstr("node 1: interrupted by SIGTERM"));
  EXPECT_THAT(runs[0].output, ::testing::Not(HasSubstr("restarting")));
  ExpectAllGone(workers);
}

// Waits up to `timeout` until `key` is in the store of the job on `port`
// and has the value `value` (any value when empty).
bool StoreReaches(int port, const std::string& key, const std::string& value = "",
                  std::chrono::milliseconds timeout = 30s) {
  auto client = store::TcpStoreClient::Connect("127.0.0.1", port, kToken, DeadlineIn(timeout));
  if (!client.ok()) return false;
  const Deadline deadline = DeadlineIn(timeout);
  while (Clock::now() < deadline) {
    auto got = (*client)->TryGet(key, DeadlineIn(5s));
    if (got.ok() && got->has_value() && (value.empty() || **got == value)) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

// As in a real job, the workers fail within milliseconds once a peer's
// process is gone. Node 1's launcher is interrupted: the job must stop on
// every node without a restart, although nodes 0 and 2 see their own
// workers fail before node 1's are all gone (rank 3 ignores the signal and
// is killed only after the grace period). Before the fix node 1 told the
// others only then, too late: they had restarted and waited for it.
TEST(DdprunMultinodeTest, InterruptedNodeStopsAJobWhoseWorkersFailFast) {
  const std::string dir = testing::MakeTempDir("multinode_sigint_fail_fast");
  Job job(3, {"--nproc_per_node=2", "--max_restarts=3", "--grace_period=3", "--rdzv_timeout=120"},
          {"--exit_when_peer_gone", "--slow_to_stop=3", "--sleep_ms=60000", "--pid_dir=" + dir});
  const std::vector<pid_t> workers = WorkerPids(dir, 6);
  const auto start = Clock::now();
  ASSERT_EQ(kill(job.launcher_pid(1), SIGINT), 0);
  const auto runs = job.Wait(60s);
  // Node 1 takes the grace period (3 s) to kill rank 3; the others leave
  // with it, far sooner than --rdzv_timeout (120 s).
  EXPECT_LT(Clock::now() - start, 30s);
  std::string all;
  for (const auto& run : runs) all += run.output;
  EXPECT_EQ(runs[1].exit_code, 128 + SIGINT) << all;
  for (int node : {0, 2}) {
    EXPECT_THAT(runs[node].exit_code, ::testing::AnyOf(1, 3)) << all;
    EXPECT_THAT(runs[node].output, HasSubstr("node 1: interrupted by SIGINT")) << all;
    EXPECT_THAT(runs[node].output, HasSubstr("(the job stops without a restart)")) << all;
  }
  EXPECT_THAT(all, Not(HasSubstr("restarting"))) << all;
  ExpectAllGone(workers);
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(testing::ReadPidFile(dir + "/rank" + std::to_string(r) + ".restart1.pid", 10ms), -1)
        << "rank " << r << " was restarted";
  }
}

// A launcher interrupted while the others wait for it at the rendezvous
// ends the job there: node 0 does not wait out --rdzv_timeout for node 2.
TEST(DdprunMultinodeTest, InterruptedNodeStopsTheRendezvous) {
  Job job(2, {"--nproc_per_node=1", "--rdzv_timeout=120"}, {}, {{0, {"--nnodes=3"}}, {1, {"--nnodes=3"}}});
  ASSERT_TRUE(StoreReaches(job.port(), "ddprun/a0/node/1"));
  const auto start = Clock::now();
  ASSERT_EQ(kill(job.launcher_pid(1), SIGINT), 0);
  const auto runs = job.Wait(60s);
  EXPECT_LT(Clock::now() - start, 20s);
  EXPECT_EQ(runs[1].exit_code, 128 + SIGINT) << runs[1].output;
  EXPECT_THAT(runs[1].output, HasSubstr("ddprun: node 1: interrupted by SIGINT while waiting for the other "
                                        "nodes; the job stops"));
  EXPECT_EQ(runs[0].exit_code, 1) << runs[0].output;
  EXPECT_THAT(runs[0].output, HasSubstr("ddprun: node 1: interrupted by SIGINT while waiting for the other "
                                        "nodes; the job stops without starting"));
}

TEST(DdprunMultinodeTest, MissingNodeTimesOutTheRendezvous) {
  Job job(1, {"--nproc_per_node=1", "--rdzv_timeout=0.5"}, {}, {{0, {"--nnodes=3"}}});
  const auto runs = job.Wait();
  EXPECT_EQ(runs[0].exit_code, 1) << runs[0].output;
  EXPECT_THAT(runs[0].output, HasSubstr("not every node joined within --rdzv_timeout (500 ms); "
                                        "missing node(s): 1, 2"));
}

// More nodes than one store request can wait for (1024): the rendezvous
// waits for all of them (here it times out, naming the first missing ones).
TEST(DdprunMultinodeTest, RendezvousOfMoreThan1024Nodes) {
  Job job(1, {"--nproc_per_node=1", "--rdzv_timeout=1"}, {}, {{0, {"--nnodes=1100"}}});
  const auto runs = job.Wait();
  EXPECT_EQ(runs[0].exit_code, 1) << runs[0].output;
  EXPECT_THAT(runs[0].output, HasSubstr("not every node joined within --rdzv_timeout (1000 ms); "
                                        "missing node(s): 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 1089 more"));
}

// Two launchers given the same --node_rank (static backend): the second to
// register is refused at once; the first, and every other node, refuse the
// job when the rendezvous completes. Nobody starts a worker.
// One static launcher of `nnodes`, node 0's store on 127.0.0.1:`port`, with job token `token`.
// With `stderr_file`, its stderr goes there, where the test can read it while it runs.
std::unique_ptr<WorkerGroup> StartStaticNode(int nnodes, int node_rank, int port,
                                             const std::vector<std::string>& flags,
                                             const std::vector<std::string>& worker_flags,
                                             const std::string& token = kToken,
                                             const std::string& stderr_file = "") {
  std::vector<std::string> argv = {Ddprun(), "--nnodes=" + std::to_string(nnodes),
                                   "--node_rank=" + std::to_string(node_rank), "--master_addr=127.0.0.1",
                                   "--master_port=" + std::to_string(port)};
  if (!stderr_file.empty()) argv.insert(argv.begin(), {"/bin/sh", "-c", "exec \"$@\" 2>\"$0\"", stderr_file});
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(Worker());
  argv.insert(argv.end(), worker_flags.begin(), worker_flags.end());
  auto group = testing::StartProgram(argv, {{"DDP_JOB_TOKEN", token}});
  EXPECT_TRUE(group.ok()) << group.status();
  return std::move(group).value();
}

TEST(DdprunMultinodeTest, DuplicateNodeRankIsRefusedOnEveryNode) {
  StatusOr<int> port = testing::PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string dir = testing::MakeTempDir("ddprun_duplicate_rank");
  auto launch = [&](int node_rank) {
    return StartStaticNode(3, node_rank, *port, {"--rdzv_timeout=20"}, {"--pid_dir=" + dir});
  };
  auto node0 = launch(0);
  auto first = launch(1);
  auto store = store::TcpStoreClient::Connect("127.0.0.1", *port, kToken, DeadlineIn(20s));
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Get("ddprun/a0/node/1", DeadlineIn(20s)).ok());  // the first has node 1
  auto second = launch(1);
  const auto second_run = testing::WaitProgram(*second, 20s);
  const std::string line = "--node_rank=1 was given to two launchers (one on " + Hostname() + ", one on " +
                           Hostname() + "); every node needs its own --node_rank";
  EXPECT_EQ(second_run.exit_code, 2) << second_run.output;
  EXPECT_EQ(second_run.output, "ddprun: node 1: " + line + "\n");
  // Node 2 completes the rendezvous: everyone else finds the duplicate.
  auto node2 = launch(2);
  for (auto* launcher : {node0.get(), first.get(), node2.get()}) {
    const auto run = testing::WaitProgram(*launcher, 20s);
    EXPECT_EQ(run.exit_code, 2) << run.output;
    EXPECT_THAT(run.output, HasSubstr(line)) << run.output;
  }
  for (const char* name : {"/rank0.restart0.pid", "/rank1.restart0.pid", "/rank2.restart0.pid"}) {
    EXPECT_EQ(testing::ReadPidFile(dir + name, 10ms), -1) << "a worker started: " << name;
  }
}

// A static launcher that dies while it waits in the rendezvous, relaunched
// on the same host (a scheduler's retry), takes its node rank back instead
// of being refused as a duplicate (which also made every other launcher
// refuse the job).
TEST(DdprunMultinodeTest, RelaunchedLauncherTakesItsDeadPredecessorsNodeRank) {
  StatusOr<int> port = testing::PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  auto launch = [&](int node_rank) {
    return StartStaticNode(3, node_rank, *port, {"--rdzv_timeout=30"}, {"--store"});
  };
  auto node0 = launch(0);
  auto first = launch(1);
  auto store = store::TcpStoreClient::Connect("127.0.0.1", *port, kToken, DeadlineIn(20s));
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Get("ddprun/a0/node/1", DeadlineIn(20s)).ok());  // the first has node 1
  const pid_t first_pid = first->pids()[0];
  ASSERT_EQ(kill(first_pid, SIGKILL), 0);
  (void)testing::WaitProgram(*first, 10s);
  auto relaunched = launch(1);
  // Node 2 comes once the rank is taken over: had every node registered
  // first (the dead launcher's registration counts), the newcomer would
  // rightly wait for the restart of an attempt that runs without it.
  const std::string gone_holder = Hostname() + " " + std::to_string(first_pid);
  const Deadline until = DeadlineIn(20s);
  StatusOr<std::optional<std::string>> holder = std::optional<std::string>(gone_holder);
  while (holder.ok() && *holder == gone_holder && Clock::now() < until) {
    std::this_thread::sleep_for(10ms);
    holder = (*store)->TryGet("ddprun/a0/holder/1", DeadlineIn(5s));
  }
  ASSERT_TRUE(holder.ok()) << holder.status();
  ASSERT_NE(*holder, gone_holder) << "the relaunched launcher never took node rank 1 over";
  auto node2 = launch(2);
  const auto relaunched_run = testing::WaitProgram(*relaunched, 30s);
  EXPECT_EQ(relaunched_run.exit_code, 0) << relaunched_run.output;
  EXPECT_THAT(relaunched_run.output, HasSubstr("ddprun: node 1: takes --node_rank=1 over from launcher pid " +
                                               std::to_string(first_pid) + " on this host, which is gone"));
  for (auto* launcher : {node0.get(), node2.get()}) {
    const auto run = testing::WaitProgram(*launcher, 30s);
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_THAT(run.output, HasSubstr("met 3 ranks")) << run.output;
  }
}

// A launcher whose pid tells this host nothing (one on another host; here,
// one stopped by SIGSTOP, whose pid still runs) holds node 1 and goes
// silent while the others wait for node 2. A launcher relaunched with
// --node_rank=1 was refused as a duplicate (and every node then refused the
// job); it now takes the rank over once the holder's heartbeat stood still
// for --node_timeout (3 s). The holder, resumed, finds the rank taken and
// leaves without starting a worker.
TEST(DdprunMultinodeTest, RelaunchedLauncherTakesOverFromAHolderSilentForNodeTimeout) {
  StatusOr<int> port = testing::PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  auto launch = [&](int node_rank) {
    return StartStaticNode(3, node_rank, *port, {"--rdzv_timeout=60", "--node_timeout=3"}, {"--store"});
  };
  auto node0 = launch(0);
  auto first = launch(1);
  const pid_t first_pid = first->pids()[0];
  ASSERT_TRUE(StoreReaches(*port, "ddprun/a0/heartbeat/1"));  // it holds node 1 and beats
  ASSERT_EQ(kill(first_pid, SIGSTOP), 0);
  auto relaunched = launch(1);
  const pid_t relaunched_pid = relaunched->pids()[0];
  ASSERT_TRUE(StoreReaches(*port, "ddprun/a0/holder/1", Hostname() + " " + std::to_string(relaunched_pid)));
  ASSERT_EQ(kill(first_pid, SIGCONT), 0);
  const testing::ProgramRun first_run = testing::WaitProgram(*first, 30s);
  EXPECT_EQ(first_run.exit_code, 1) << first_run.output;
  EXPECT_THAT(first_run.output, HasSubstr("ddprun: node 1: --node_rank=1 was taken over by the launcher on " +
                                          Hostname() + " (pid " + std::to_string(relaunched_pid) +
                                          ") while this launcher sent no heartbeat for --node_timeout"));
  EXPECT_THAT(first_run.output, Not(HasSubstr("met 3 ranks")));
  auto node2 = launch(2);
  const testing::ProgramRun relaunched_run = testing::WaitProgram(*relaunched, 30s);
  EXPECT_EQ(relaunched_run.exit_code, 0) << relaunched_run.output;
  EXPECT_THAT(relaunched_run.output,
              ContainsRegex("ddprun: node 1: takes --node_rank=1 over from the launcher on " + Hostname() +
                            " \\(pid " + std::to_string(first_pid) +
                            "\\), which sent no heartbeat for [0-9]+ ms \\(--node_timeout\\)"));
  EXPECT_THAT(relaunched_run.output, HasSubstr("rank 1 met 3 ranks"));
  for (auto* launcher : {node0.get(), node2.get()}) {
    const testing::ProgramRun run = testing::WaitProgram(*launcher, 30s);
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_THAT(run.output, HasSubstr("met 3 ranks")) << run.output;
  }
}

// Two nodes, one restart, dead after 3 s of silence; workers that run 30 s
// at attempt 0 only, writing their pids into `dir`. With `stderr_file`, the
// launcher's stderr goes there.
std::unique_ptr<WorkerGroup> StartRestartableNode(int node_rank, int port, const std::string& dir,
                                                  std::vector<std::string> extra_worker_flags = {},
                                                  const std::string& stderr_file = "") {
  std::vector<std::string> worker_flags = {"--store", "--print_env", "--sleep_ms=30000",
                                           "--sleep_before_restart=1", "--pid_dir=" + dir};
  worker_flags.insert(worker_flags.end(), extra_worker_flags.begin(), extra_worker_flags.end());
  return StartStaticNode(2, node_rank, port, {"--max_restarts=1", "--node_timeout=3", "--rdzv_timeout=30"},
                         worker_flags, kToken, stderr_file);
}

// Node 1's launcher goes silent while the workers run (SIGSTOP: to the
// others, what a launcher on another host that died looks like); node 0
// declares it dead and waits for node 1 at restart 1. A launcher relaunched
// with --node_rank=1 went to attempt 0, found the rank held there by a pid
// that still runs, and was refused as a duplicate; it now joins the job at
// restart 1, where nobody holds the rank.
TEST(DdprunMultinodeTest, LauncherRelaunchedDuringARestartJoinsIt) {
  StatusOr<int> port = testing::PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string dir = testing::MakeTempDir("static_relaunch_at_restart");
  auto node0 = StartRestartableNode(0, *port, dir);
  auto first = StartRestartableNode(1, *port, dir);
  const pid_t stale_worker = testing::ReadPidFile(dir + "/rank1.restart0.pid", 30s);
  ASSERT_GT(stale_worker, 0);  // the job runs
  ASSERT_EQ(kill(first->pids()[0], SIGSTOP), 0);
  ASSERT_TRUE(StoreReaches(*port, "ddprun/a1/node/0"));  // node 0 waits at restart 1
  auto relaunched = StartRestartableNode(1, *port, dir);
  const testing::ProgramRun relaunched_run = testing::WaitProgram(*relaunched, 30s);
  const testing::ProgramRun node0_run = testing::WaitProgram(*node0, 30s);
  ASSERT_EQ(kill(first->pids()[0], SIGKILL), 0);
  EXPECT_EQ(testing::WaitProgram(*first, 10s).exit_code, 128 + SIGKILL);
  const std::string all = node0_run.output + relaunched_run.output;
  EXPECT_EQ(relaunched_run.exit_code, 0) << all;
  EXPECT_EQ(node0_run.exit_code, 0) << all;
  EXPECT_THAT(relaunched_run.output,
              HasSubstr("ddprun: node 1: the job is at restart 1; this launcher joins it there"));
  EXPECT_THAT(relaunched_run.output, Not(HasSubstr("takes --node_rank=1 over"))) << all;
  EXPECT_THAT(relaunched_run.output, HasSubstr("rank 1/2 local 0/1 group 1 restart 1"));
  EXPECT_THAT(relaunched_run.output, HasSubstr("rank 1 met 2 ranks"));
  EXPECT_THAT(node0_run.output, HasSubstr("node 1's launcher sent no heartbeat for"));
  EXPECT_THAT(node0_run.output, HasSubstr("restarting the job (restart 1 of 1)"));
  EXPECT_TRUE(testing::GoneWithin(stale_worker, 5s));
}

// As above, but relaunched at once, while node 0 has yet to notice: the
// attempt it finds node 1 held in already runs (every node had joined), so
// it does not take the rank over there; it waits for that attempt to fail,
// which it does once node 0 misses the heartbeat, and joins restart 1.
// Rank 0 ignores SIGTERM: node 0, which declared node 1 dead, opens restart
// 1 only once rank 0 is gone, after the relaunched launcher looked at which
// attempt the job is in (the test kills rank 0 once the launcher says what
// it found there; node 0 itself would after --grace_period, 30 s, which the
// test would wait out).
TEST(DdprunMultinodeTest, LauncherRelaunchedWhileTheJobRunsJoinsTheRestart) {
  StatusOr<int> port = testing::PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string dir = testing::MakeTempDir("static_relaunch_while_running");
  const std::string relaunched_stderr = dir + "/relaunched.stderr";
  auto node0 = StartRestartableNode(0, *port, dir, {"--ignore_sigterm"});
  auto first = StartRestartableNode(1, *port, dir);
  const pid_t stale_worker = testing::ReadPidFile(dir + "/rank1.restart0.pid", 30s);
  ASSERT_GT(stale_worker, 0);  // the job runs
  const pid_t rank0 = testing::ReadPidFile(dir + "/rank0.restart0.pid", 30s);
  ASSERT_GT(rank0, 0);
  ASSERT_EQ(kill(first->pids()[0], SIGSTOP), 0);
  auto relaunched = StartRestartableNode(1, *port, dir, {}, relaunched_stderr);
  // Node 0 declared node 1 dead and stops rank 0, which ignores it ...
  EXPECT_GT(testing::ReadPidFile(dir + "/rank0.restart0.got_term", 30s), 0);
  // ... and the relaunched launcher has looked (at the attempt first).
  EXPECT_TRUE(FileGets(relaunched_stderr, "this launcher joins the restart that follows", 30s))
      << ReadFile(relaunched_stderr);
  // Unless node 0's grace period ran out first (and rank 0 is gone).
  if (testing::ParentPid(rank0) == node0->pids()[0]) kill(rank0, SIGKILL);
  testing::ProgramRun relaunched_run = testing::WaitProgram(*relaunched, 60s);
  relaunched_run.output += ReadFile(relaunched_stderr);
  const testing::ProgramRun node0_run = testing::WaitProgram(*node0, 60s);
  ASSERT_EQ(kill(first->pids()[0], SIGKILL), 0);
  EXPECT_EQ(testing::WaitProgram(*first, 10s).exit_code, 128 + SIGKILL);
  const std::string all = node0_run.output + relaunched_run.output;
  EXPECT_EQ(relaunched_run.exit_code, 0) << all;
  EXPECT_EQ(node0_run.exit_code, 0) << all;
  EXPECT_THAT(relaunched_run.output,
              ContainsRegex("ddprun: node 1: --node_rank=1 was held by the launcher on .* \\(pid " +
                            std::to_string(first->pids()[0]) +
                            "\\), which sent no heartbeat for [0-9]+ ms \\(--node_timeout\\), in the job's first "
                            "attempt, which every node had joined; this launcher joins the restart that follows"))
      << all;
  EXPECT_THAT(relaunched_run.output, HasSubstr("rank 1/2 local 0/1 group 1 restart 1"));
  EXPECT_THAT(relaunched_run.output, HasSubstr("rank 1 met 2 ranks"));
  EXPECT_THAT(node0_run.output, HasSubstr("restarting the job (restart 1 of 1)"));
  EXPECT_TRUE(testing::GoneWithin(stale_worker, 5s));
}

// Static nodes with different counts (node 0 one worker, node 1 two): node
// 1's launcher goes silent while the workers run, and node 0 waits for it at
// restart 1. A launcher relaunched for node 1 with another --nproc_per_node
// would move the ranks and WORLD_SIZE of the job under the others: it is
// refused (exit 2), naming both counts, and the job waits on; relaunched
// with node 1's count, it joins restart 1 with node 1's ranks.
TEST(DdprunMultinodeTest, StaticRelaunchedNodeKeepsItsNumberOfWorkers) {
  StatusOr<int> port = testing::PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string dir = testing::MakeTempDir("static_relaunch_count");
  auto launch = [&](int node_rank, int nproc) {
    return StartStaticNode(2, node_rank, *port,
                           {"--max_restarts=1", "--node_timeout=3", "--rdzv_timeout=30",
                            "--nproc_per_node=" + std::to_string(nproc)},
                           {"--store", "--print_env", "--sleep_ms=30000", "--sleep_before_restart=1",
                            "--pid_dir=" + dir});
  };
  auto node0 = launch(0, 1);
  auto first = launch(1, 2);
  const pid_t stale_worker = testing::ReadPidFile(dir + "/rank2.restart0.pid", 30s);
  ASSERT_GT(stale_worker, 0);  // the job runs, ranks 1 and 2 on node 1
  ASSERT_EQ(kill(first->pids()[0], SIGSTOP), 0);
  ASSERT_TRUE(StoreReaches(*port, "ddprun/a1/node/0"));  // node 0 waits at restart 1
  auto wrong = launch(1, 3);
  const testing::ProgramRun wrong_run = testing::WaitProgram(*wrong, 30s);
  EXPECT_EQ(wrong_run.exit_code, 2) << wrong_run.output;
  EXPECT_THAT(wrong_run.output,
              HasSubstr("ddprun: node 1: --nproc_per_node=3 differs from node 1's --nproc_per_node=2, recorded by "
                        "its first launcher in this job; a node keeps its number of workers for the whole job"));
  EXPECT_THAT(wrong_run.output, Not(HasSubstr(" local "))) << "no worker started";
  auto relaunched = launch(1, 2);
  const testing::ProgramRun relaunched_run = testing::WaitProgram(*relaunched, 30s);
  const testing::ProgramRun node0_run = testing::WaitProgram(*node0, 30s);
  ASSERT_EQ(kill(first->pids()[0], SIGKILL), 0);
  EXPECT_EQ(testing::WaitProgram(*first, 10s).exit_code, 128 + SIGKILL);
  const std::string all = node0_run.output + relaunched_run.output;
  EXPECT_EQ(relaunched_run.exit_code, 0) << all;
  EXPECT_EQ(node0_run.exit_code, 0) << all;
  EXPECT_THAT(node0_run.output, HasSubstr("rank 0/3 local 0/1 group 0 restart 1")) << all;
  EXPECT_THAT(relaunched_run.output, HasSubstr("[1] rank 1/3 local 0/2 group 1 restart 1")) << all;
  EXPECT_THAT(relaunched_run.output, HasSubstr("[2] rank 2/3 local 1/2 group 1 restart 1")) << all;
  EXPECT_EQ(CountLines(node0_run.output, "rank 0 met 3 ranks"), 2) << all;  // at the start and restart 1
  EXPECT_THAT(relaunched_run.output, HasSubstr("[1] rank 1 met 3 ranks")) << all;
  EXPECT_THAT(relaunched_run.output, HasSubstr("[2] rank 2 met 3 ranks")) << all;
  EXPECT_TRUE(testing::GoneWithin(stale_worker, 5s));
}

// The failure notice used to be two writes: a count of notices, then the
// first one's text. A launcher that died between them left the count
// without the notice, and every later notice of the attempt was dropped as
// not the first: node 1's failure never reached node 0 (which ran on), and
// node 1 restarted alone. The test leaves such a count in the store before
// node 1 starts; the notice is now one write, and both nodes report node
// 1's failure and restart together, long before rank 0 gives up waiting
// for rank 1 in the store (30 s).
TEST(DdprunMultinodeTest, FailureNoticeReachesEveryNodeDespiteAHalfPostedOne) {
  StatusOr<int> port = testing::PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  const std::vector<std::string> flags = {"--max_restarts=1", "--rdzv_timeout=30"};
  const std::vector<std::string> worker_flags = {"--store", "--fail_before_restart=1"};
  auto node0 = StartStaticNode(2, 0, *port, flags, worker_flags);
  {
    auto store = store::TcpStoreClient::Connect("127.0.0.1", *port, kToken, DeadlineIn(20s));
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Get("ddprun/a0/node/0", DeadlineIn(20s)).ok());
    ASSERT_TRUE((*store)->Add("ddprun/a0/failure_count", 1, DeadlineIn(5s)).ok());
  }
  const auto start = Clock::now();
  auto node1 = StartStaticNode(2, 1, *port, flags, worker_flags);
  const testing::ProgramRun run1 = testing::WaitProgram(*node1, 60s);
  const testing::ProgramRun run0 = testing::WaitProgram(*node0, 60s);
  EXPECT_LT(Clock::now() - start, 20s);
  const std::string all = run0.output + run1.output;
  EXPECT_EQ(run0.exit_code, 0) << all;
  EXPECT_EQ(run1.exit_code, 0) << all;
  const std::string reason =
      "ddprun: node 1: rank 1 \\(pid [0-9]+\\) exited with code 1; restarting the job \\(restart 1 of 1\\)";
  EXPECT_THAT(run0.output, ContainsRegex(reason)) << all;
  EXPECT_THAT(run1.output, ContainsRegex(reason)) << all;
  EXPECT_EQ(CountLines(all, "met 2 ranks"), 2) << all;
}

// Launchers for node 1 started with other flags than node 0, or with
// another job token, are refused as soon as node 0's store is up, each
// naming the flags that differ, and only those; node 0, which refused them
// all, times out missing node 1. --rdzv_timeout differs alone: refused as
// the other flags are (it was not compared, and the launchers gave up on
// each other at different times). The last call and the grace period count
// in how long node 0 may take to form a round, which the others wait for.
// One node 0 serves all four refusals (each had a node 0 of its own, whose
// 5 s the test waited out four times): a launcher is refused before it
// takes a node rank, so the others do not see it. --nnodes spelled
// otherwise (+2, 2:2: the same 2 nodes) is no difference; it was named as
// one, and such a node refused.
TEST(DdprunMultinodeTest, NodesWithOtherFlagsOrAnotherTokenAreRefused) {
  StatusOr<int> port = testing::PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  auto launch = [&](int node_rank, std::vector<std::string> flags, const std::string& token) {
    flags.push_back("--nproc_per_node=1");
    return StartStaticNode(2, node_rank, *port, flags, {}, token);
  };
  struct Refused {
    std::vector<std::string> flags;
    std::string token;
    std::string says;
  };
  const std::string node0_with = "but node 0 with ";
  const std::vector<Refused> refused = {
      {{"--max_restarts=3", "--rdzv_timeout=30", "--rdzv_conf=last_call_timeout=0.5", "--nnodes=+2"},
       kToken,
       "ddprun: node 1 was started with --max_restarts=3 --rdzv_timeout=30 " + node0_with +
           "--max_restarts=2 --rdzv_timeout=5; every node needs the same flags"},
      {{"--max_restarts=2", "--rdzv_timeout=30.25", "--rdzv_conf=last_call_timeout=0.5"},
       kToken,
       "ddprun: node 1 was started with --rdzv_timeout=30.25 " + node0_with +
           "--rdzv_timeout=5; every node needs the same flags"},
      {{"--max_restarts=2", "--rdzv_timeout=5", "--grace_period=7", "--nnodes=2:2"},
       kToken,
       "ddprun: node 1 was started with --rdzv_conf=last_call_timeout=30 --grace_period=7 " + node0_with +
           "--rdzv_conf=last_call_timeout=0.5 --grace_period=30; every node needs the same flags"},
      {{"--max_restarts=2", "--rdzv_timeout=30", "--rdzv_conf=last_call_timeout=0.5"},
       "not-the-token",
       "refused this process's job token"},
  };
  // The node 1 launchers start first and wait for node 0's store (up to
  // their --rdzv_timeout).
  std::vector<std::unique_ptr<WorkerGroup>> node1s;
  for (const Refused& r : refused) node1s.push_back(launch(1, r.flags, r.token));
  auto node0 = launch(0, {"--max_restarts=2", "--rdzv_timeout=5", "--rdzv_conf=last_call_timeout=0.5"}, kToken);
  for (size_t i = 0; i < refused.size(); ++i) {
    const testing::ProgramRun run = testing::WaitProgram(*node1s[i], 30s);
    EXPECT_EQ(run.exit_code, 2) << refused[i].says << ": " << run.output;
    EXPECT_THAT(run.output, HasSubstr(refused[i].says));
  }
  const testing::ProgramRun run0 = testing::WaitProgram(*node0, 30s);
  EXPECT_EQ(run0.exit_code, 1) << run0.output;
  EXPECT_THAT(run0.output, HasSubstr("missing node(s): 1"));
}

TEST(DdprunMultinodeTest, ANodeBeatsByNodeZerosShorterTimeout) {
  // Node 0 declares a node dead after 3 s of silence; node 1 was given the
  // default 30 s: it takes node 0's timeout, and the job (5 s of work)
  // succeeds. (At 1 s, where node 1's own beat of once a second would be
  // too seldom, a live launcher starved on a loaded machine was dropped.)
  Job job(2, {"--nproc_per_node=1"}, {"--store", "--sleep_ms=5000"}, {{0, {"--node_timeout=3"}}});
  const auto runs = job.Wait();
  EXPECT_EQ(runs[0].exit_code, 0) << runs[0].output << runs[1].output;
  EXPECT_EQ(runs[1].exit_code, 0) << runs[1].output;
  EXPECT_THAT(runs[1].output, HasSubstr("ddprun: node 1: beating by node 0's --node_timeout of 3000 ms "
                                        "instead of this launcher's 30000 ms"));
  EXPECT_THAT(runs[0].output + runs[1].output, Not(HasSubstr("sent no heartbeat")));
}

// torchrun's dynamic form: every launcher gets the same line, without
// --node_rank, and the same endpoint.
class C10dJob {
 public:
  C10dJob() {
    StatusOr<int> port = testing::PickFreePort();
    EXPECT_TRUE(port.ok()) << port.status();
    port_ = *port;
  }

  // Starts one launcher; returns its index. With `stderr_file`, its
  // stderr goes there, where the test can read it while it runs.
  int Start(std::vector<std::string> flags, const std::vector<std::string>& worker_flags,
            const std::string& stderr_file = "") {
    std::vector<std::string> argv = {Ddprun(), "--rdzv_backend=c10d",
                                     "--rdzv_endpoint=127.0.0.1:" + std::to_string(port_)};
    if (!stderr_file.empty()) argv.insert(argv.begin(), {"/bin/sh", "-c", "exec \"$@\" 2>\"$0\"", stderr_file});
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back(Worker());
    argv.insert(argv.end(), worker_flags.begin(), worker_flags.end());
    auto group = testing::StartProgram(argv, {{"DDP_JOB_TOKEN", kToken}});
    EXPECT_TRUE(group.ok()) << group.status();
    launchers_.push_back(std::move(group).value());
    return static_cast<int>(launchers_.size()) - 1;
  }

  testing::ProgramRun Wait(int launcher, std::chrono::milliseconds timeout = 30s) {
    return testing::WaitProgram(*launchers_.at(launcher), timeout);
  }

  pid_t launcher_pid(int launcher) const { return launchers_.at(launcher)->pids()[0]; }
  int port() const { return port_; }

  // Starts the first launcher and waits until it serves the store (so it
  // is node 0, whatever starts next); store() then reads the store.
  int StartNodeZero(const std::vector<std::string>& flags, const std::vector<std::string>& worker_flags,
                    const std::string& stderr_file = "") {
    const int first = Start(flags, worker_flags, stderr_file);
    auto client = store::TcpStoreClient::Connect("127.0.0.1", port_, kToken, DeadlineIn(20s));
    EXPECT_TRUE(client.ok()) << client.status();
    if (client.ok()) {
      store_ = std::move(client).value();
      EXPECT_TRUE(store_->Get("ddprun/config", DeadlineIn(20s)).ok());
    }
    return first;
  }
  // Waits until `key` is set (a launcher took its slot, say).
  bool Reached(const std::string& key) { return store_ != nullptr && store_->Get(key, DeadlineIn(20s)).ok(); }
  store::TcpStoreClient* store() { return store_.get(); }

  std::vector<testing::ProgramRun> WaitAll(std::chrono::milliseconds timeout = 30s) {
    std::vector<testing::ProgramRun> runs;
    for (size_t i = 0; i < launchers_.size(); ++i) runs.push_back(Wait(static_cast<int>(i), timeout));
    return runs;
  }

 private:
  int port_ = 0;
  std::vector<std::unique_ptr<WorkerGroup>> launchers_;
  std::unique_ptr<store::TcpStoreClient> store_;
};

// `launchers` launchers with --nnodes=`nnodes` (0: given in `flags`);
// `extra` adds flags for one launcher.
std::vector<testing::ProgramRun> RunC10dJob(int launchers, int nnodes, std::vector<std::string> flags,
                                            std::vector<std::string> worker_flags,
                                            std::map<int, std::vector<std::string>> extra = {}) {
  C10dJob job;
  for (int i = 0; i < launchers; ++i) {
    std::vector<std::string> all = flags;
    if (nnodes > 0) all.push_back("--nnodes=" + std::to_string(nnodes));
    for (const std::string& f : extra[i]) all.push_back(f);
    job.Start(all, worker_flags);
  }
  return job.WaitAll();
}

TEST(DdprunMultinodeTest, C10dRendezvousNumbersTheNodesAsTheyJoin) {
  const auto runs = RunC10dJob(2, 2, {"--nproc_per_node=2", "--rdzv_id=job7"}, {"--store", "--print_env"});
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].exit_code, 0) << runs[0].output;
  EXPECT_EQ(runs[1].exit_code, 0) << runs[1].output;
  const std::string all = runs[0].output + runs[1].output;
  // One launcher served the store (node 0); the other joined as node 1.
  EXPECT_EQ(CountLines(all, "ddprun: joined as node 1 of 2"), 1) << all;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_THAT(all, HasSubstr("rank " + std::to_string(rank) + "/4 local " + std::to_string(rank % 2) +
                               "/2 group " + std::to_string(rank / 2) + " restart 0"));
  }
  EXPECT_EQ(CountLines(all, "met 4 ranks"), 4);
  // Each launcher ran the two ranks of its own node.
  const bool first_is_node0 = runs[0].output.find("rank 0/4") != std::string::npos;
  EXPECT_THAT(runs[first_is_node0 ? 0 : 1].output, HasSubstr("rank 1/4 local 1/2 group 0"));
  EXPECT_THAT(runs[first_is_node0 ? 1 : 0].output, HasSubstr("rank 3/4 local 1/2 group 1"));
}

// As under torchrun's c10d rendezvous, nodes may run different numbers of
// workers: ranks follow the node order, WORLD_SIZE is their sum, and
// LOCAL_WORLD_SIZE is each node's own. The old code refused the second
// launcher ("every node needs the same flags").
TEST(DdprunMultinodeTest, C10dNodesMayRunDifferentNumbersOfWorkers) {
  const auto runs = RunC10dJob(2, 2, {"--rdzv_timeout=20"}, {"--store", "--print_env"},
                               {{0, {"--nproc_per_node=1"}}, {1, {"--nproc_per_node=2"}}});
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].exit_code, 0) << runs[0].output;
  EXPECT_EQ(runs[1].exit_code, 0) << runs[1].output;
  const std::string all = runs[0].output + runs[1].output;
  EXPECT_EQ(CountLines(all, "met 3 ranks"), 3) << all;
  // Whichever launcher serves the store is node 0, with ranks 0..n0-1.
  const bool one_is_node0 = runs[0].output.find("group 0 ") != std::string::npos;
  const std::string& one = runs[0].output;  // --nproc_per_node=1
  const std::string& two = runs[1].output;  // --nproc_per_node=2
  if (one_is_node0) {
    EXPECT_THAT(one, HasSubstr("rank 0/3 local 0/1 group 0 restart 0")) << all;
    EXPECT_THAT(two, HasSubstr("rank 1/3 local 0/2 group 1 restart 0")) << all;
    EXPECT_THAT(two, HasSubstr("rank 2/3 local 1/2 group 1 restart 0")) << all;
  } else {
    EXPECT_THAT(two, HasSubstr("rank 0/3 local 0/2 group 0 restart 0")) << all;
    EXPECT_THAT(two, HasSubstr("rank 1/3 local 1/2 group 0 restart 0")) << all;
    EXPECT_THAT(one, HasSubstr("rank 2/3 local 0/1 group 1 restart 0")) << all;
  }
}

TEST(DdprunMultinodeTest, C10dLauncherBeyondNnodesWaitsAsASpare) {
  // The workers stay until the third launcher waits as a spare, beating in
  // its slot of the next round (they stayed a fixed 6 s, which the test
  // waited out); it waits for a restart that never comes and leaves with
  // the job's status.
  const std::string done = testing::MakeTempDir("c10d_beyond_nnodes") + "/done";
  const std::vector<std::string> flags = {"--nnodes=2", "--nproc_per_node=1", "--rdzv_timeout=20"};
  const std::vector<std::string> worker_flags = {"--store", "--sleep_ms=60000", "--until_file=" + done};
  C10dJob job;
  job.StartNodeZero(flags, worker_flags);
  job.Start(flags, worker_flags);
  job.Start(flags, worker_flags);
  EXPECT_TRUE(job.Reached("ddprun/a1/alive/1"));
  std::ofstream(done) << "done\n";
  const std::vector<testing::ProgramRun> runs = job.WaitAll(60s);
  int ran = 0, spare = 0;
  for (const auto& run : runs) {
    EXPECT_EQ(run.exit_code, 0) << run.output;
    if (run.output.find("rank") != std::string::npos) ++ran;
    if (run.output.find("waits as a spare") != std::string::npos) {
      ++spare;
      EXPECT_THAT(run.output, HasSubstr("ddprun: launcher: the job already runs on 2 nodes (--nnodes=2); "
                                        "this launcher waits as a spare for a restart"));
      EXPECT_THAT(run.output, HasSubstr("ddprun: launcher: the job ended (exit status 0 on node 0) before "
                                        "this launcher got a place in it"));
    }
  }
  EXPECT_EQ(ran, 2) << runs[0].output << runs[1].output << runs[2].output;
  EXPECT_EQ(spare, 1) << runs[0].output << runs[1].output << runs[2].output;
}

// A spare rides out a store that does not answer for a while: node 0's
// launcher, which serves the store, is stopped (SIGSTOP) for 3 s, six times
// --rdzv_conf=read_timeout, while the spare waits for a restart. The spare
// used to give up on the first call that timed out (exit 1, "store try_get
// of key 'ddprun/round' timed out after 500 ms"); it now calls again until
// its deadline, and leaves with the job's status when the job ends. The
// nodes that run the job ride it out too (--node_timeout=10).
TEST(DdprunMultinodeTest, C10dSpareRidesOutAStoreThatIsSlowToAnswer) {
  C10dJob job;
  const std::vector<std::string> flags = {"--nnodes=2", "--nproc_per_node=1", "--rdzv_conf=read_timeout=0.5",
                                          "--node_timeout=10", "--rdzv_timeout=20"};
  // Workers that run until the steps below are done (they ran a fixed 10 s,
  // which the test waited out), at most 60 s.
  const std::string done = testing::MakeTempDir("c10d_spare_slow_store") + "/done";
  const std::vector<std::string> worker_flags = {"--store", "--sleep_ms=60000", "--until_file=" + done};
  const int first = job.StartNodeZero(flags, worker_flags);
  const int second = job.Start(flags, worker_flags);
  ASSERT_TRUE(job.Reached("ddprun/a0/members"));
  const int spare = job.Start(flags, worker_flags);
  // The spare was left out of round 0 and beats in its slot of round 1.
  ASSERT_TRUE(job.Reached("ddprun/a1/alive/1"));
  ASSERT_EQ(kill(job.launcher_pid(first), SIGSTOP), 0);
  std::this_thread::sleep_for(3s);  // the length of the fault, not a wait for anything
  ASSERT_EQ(kill(job.launcher_pid(first), SIGCONT), 0);
  std::ofstream(done) << "done\n";
  const std::vector<testing::ProgramRun> runs = job.WaitAll(60s);
  std::string all;
  for (const auto& run : runs) all += run.output;
  EXPECT_EQ(runs[first].exit_code, 0) << all;
  EXPECT_EQ(runs[second].exit_code, 0) << all;
  EXPECT_EQ(runs[spare].exit_code, 0) << all;
  EXPECT_THAT(runs[spare].output, HasSubstr("ddprun: launcher: the job already runs on 2 nodes (--nnodes=2); "
                                            "this launcher waits as a spare for a restart"));
  EXPECT_THAT(runs[spare].output, HasSubstr("ddprun: launcher: the job ended (exit status 0 on node 0) before "
                                            "this launcher got a place in it"));
  EXPECT_EQ(CountLines(all, "met 2 ranks"), 2) << all;
}

// A store that stays silent: the spare gives up only at its deadline, 7 s
// (--rdzv_timeout=2, no last call, --grace_period=0, + 5 s) after it last
// saw the job running, naming the store and the call it got no answer to.
TEST(DdprunMultinodeTest, C10dSpareGivesUpOnASilentStoreAtItsDeadline) {
  C10dJob job;
  const std::vector<std::string> flags = {"--nnodes=2", "--nproc_per_node=1",
                                          "--rdzv_conf=read_timeout=0.5,last_call_timeout=0", "--node_timeout=10",
                                          "--rdzv_timeout=2", "--grace_period=0"};
  const std::vector<std::string> worker_flags = {"--store", "--sleep_ms=60000"};
  const int first = job.StartNodeZero(flags, worker_flags);
  const int second = job.Start(flags, worker_flags);
  ASSERT_TRUE(job.Reached("ddprun/a0/members"));
  const int spare = job.Start(flags, worker_flags);
  ASSERT_TRUE(job.Reached("ddprun/a1/alive/1"));
  ASSERT_EQ(kill(job.launcher_pid(first), SIGSTOP), 0);
  const auto stopped = Clock::now();
  const testing::ProgramRun spare_run = job.Wait(spare, 60s);
  const auto waited = Clock::now() - stopped;
  // Node 0 and its worker go; node 1 then finds the store gone.
  ASSERT_EQ(kill(job.launcher_pid(first), SIGKILL), 0);
  const testing::ProgramRun second_run = job.Wait(second, 60s);
  EXPECT_EQ(job.Wait(first, 10s).exit_code, 128 + SIGKILL);
  EXPECT_EQ(spare_run.exit_code, 1) << spare_run.output;
  // The deadline is 7 s after its last look at the running job, about a
  // monitor slice (1 s) before the stop (the old code gave up within 1.5 s).
  EXPECT_GE(waited, 4s) << spare_run.output;
  EXPECT_THAT(spare_run.output,
              ContainsRegex("ddprun: launcher: node 0 did not form the job's restart 1 within 7000 ms "
                            "\\(--rdzv_timeout, the last call and --grace_period \\+ 5 s for the previous "
                            "round's nodes\\); the last call to the store got no answer: store [a-z_]+ (of|to) "
                            "key '[a-z0-9/]+' timed out after [0-9]+ ms \\(store at 127.0.0.1:" +
                            std::to_string(job.port()) + "\\)"));
  EXPECT_EQ(second_run.exit_code, 1) << second_run.output;
}

TEST(DdprunMultinodeTest, C10dRestartKeepsItsNodesBeforeASpare) {
  // Rank 1 fails at once; at the restart node 0 waits for node 1 to come
  // back before it would give the place to the spare.
  const auto runs = RunC10dJob(3, 2, {"--nproc_per_node=1", "--max_restarts=1", "--rdzv_timeout=20"},
                               {"--store", "--print_env", "--fail_before_restart=1"});
  std::string all;
  for (const auto& run : runs) all += run.output;
  int node1 = 0, spare = 0;
  for (const auto& run : runs) {
    EXPECT_EQ(run.exit_code, 0) << all;
    if (run.output.find("ddprun: joined as node 1 of 2") != std::string::npos) {
      ++node1;
      EXPECT_THAT(run.output, HasSubstr("rank 1 fails on attempt 0"));
      EXPECT_THAT(run.output, HasSubstr("ddprun: restart 1: joined as node 1 of 2"));
      EXPECT_THAT(run.output, HasSubstr("rank 1/2 local 0/1 group 1 restart 1"));
    }
    if (run.output.find("waits as a spare") != std::string::npos) {
      ++spare;
      EXPECT_THAT(run.output, ::testing::Not(HasSubstr("rank ")));
      EXPECT_THAT(run.output, HasSubstr("before this launcher got a place in it"));
    }
  }
  EXPECT_EQ(node1, 1) << all;
  EXPECT_EQ(spare, 1) << all;
  EXPECT_EQ(CountLines(all, "met 2 ranks"), 2) << all;
}

// Kills (SIGKILL) the launcher running `rank` (its parent), once that
// worker wrote its pid under `dir`; returns the worker's pid.
pid_t KillLauncherOf(const std::string& dir, int rank) {
  const pid_t worker = testing::ReadPidFile(dir + "/rank" + std::to_string(rank) + ".restart0.pid", 10s);
  EXPECT_GT(worker, 0);
  const pid_t launcher = worker > 0 ? testing::ParentPid(worker) : -1;
  EXPECT_GT(launcher, 0);
  if (launcher > 0) kill(launcher, SIGKILL);
  return worker;
}

// Every launcher's output, after checking that exactly one was killed and
// the others succeeded.
std::string OneKilledOthersSucceeded(const std::vector<testing::ProgramRun>& runs) {
  int killed = 0;
  std::string all;
  for (const auto& run : runs) all += run.output;
  for (const auto& run : runs) {
    if (run.exit_code == 128 + SIGKILL) {
      ++killed;
    } else {
      EXPECT_EQ(run.exit_code, 0) << all;
    }
  }
  EXPECT_EQ(killed, 1) << all;
  return all;
}

// Two nodes, one restart, dead after 3 s of silence (at 1 s, a live
// launcher starved on a loaded machine was dropped).
const std::vector<std::string> kRestartableTwoNodes = {"--nnodes=2", "--nproc_per_node=1", "--max_restarts=1",
                                                       "--node_timeout=3", "--rdzv_timeout=20"};
// Workers that stay until stopped (30 s) and write their pids into `dir`.
std::vector<std::string> LastingWorkers(const std::string& dir) {
  return {"--store", "--print_env", "--sleep_ms=30000", "--sleep_before_restart=1", "--pid_dir=" + dir};
}

TEST(DdprunMultinodeTest, C10dRelaunchedNodeTakesTheDeadOnesPlace) {
  // Node 1's launcher is killed; node 0 declares it dead after 3 s and
  // restarts the job, in which a launcher started by hand takes its place.
  const std::string dir = testing::MakeTempDir("c10d_relaunch");
  C10dJob job;
  const std::vector<std::string>& flags = kRestartableTwoNodes;
  const std::vector<std::string> worker_flags = LastingWorkers(dir);
  const int first = job.Start(flags, worker_flags);
  const int second = job.Start(flags, worker_flags);
  // Node 1 runs rank 1.
  const pid_t worker = KillLauncherOf(dir, 1);
  const int relaunched = job.Start(flags, worker_flags);
  const auto start = Clock::now();
  std::vector<testing::ProgramRun> runs = {job.Wait(first), job.Wait(second), job.Wait(relaunched)};
  EXPECT_LT(Clock::now() - start, 25s);  // well before the first workers' 30 s
  const std::string all = OneKilledOthersSucceeded(runs);
  EXPECT_THAT(all, HasSubstr("node 1's launcher sent no heartbeat for"));
  EXPECT_THAT(all, HasSubstr("restarting the job (restart 1 of 1)"));
  EXPECT_EQ(CountLines(all, "ddprun: restart 1: joined as node 1 of 2"), 1) << all;
  // The relaunched launcher ran rank 1 of the restart to the end.
  EXPECT_THAT(runs[2].output, HasSubstr("rank 1/2 local 0/1 group 1 restart 1"));
  EXPECT_THAT(runs[2].output, HasSubstr("rank 1 met 2 ranks"));
  EXPECT_THAT(runs[2].output, HasSubstr("rank 1 done"));
  EXPECT_TRUE(testing::GoneWithin(worker, 5s));
}

TEST(DdprunMultinodeTest, C10dLauncherThatDiesBeforeTheRoundClosesGetsNoPlace) {
  // Four nodes. The second launcher takes a slot and is killed; a third
  // waits beside it (its heartbeat keeps its slot), and two more come
  // after node 0 heard nothing from the dead slot for --node_timeout. The
  // job runs on the four live launchers at once, without spending its
  // restart on the dead one.
  C10dJob job;
  const std::vector<std::string> flags = {"--nnodes=4", "--nproc_per_node=1", "--node_timeout=3",
                                          "--max_restarts=1", "--rdzv_timeout=30"};
  const std::vector<std::string> worker_flags = {"--store", "--print_env"};
  const std::string node0_stderr = testing::MakeTempDir("c10d_dies_before_close") + "/node0.stderr";
  const int first = job.StartNodeZero(flags, worker_flags, node0_stderr);
  const int doomed = job.Start(flags, worker_flags);
  // It holds slot 1 of the first round once it wrote its entry there.
  ASSERT_TRUE(job.Reached("ddprun/a0/join/1"));
  const int waiting = job.Start(flags, worker_flags);
  ASSERT_TRUE(job.Reached("ddprun/a0/join/2"));
  ASSERT_EQ(kill(job.launcher_pid(doomed), SIGKILL), 0);
  // Node 0 judges the slot silent once --node_timeout (3 s) has passed;
  // the other two must come after that, or they would close the round on
  // the dead slot. The test waits for node 0 to say so (it slept a fixed
  // 9 s, three times the timeout, for a node 0 starved on a loaded
  // machine).
  ASSERT_TRUE(FileGets(node0_stderr, "in slot 1 sent no heartbeat", 30s)) << ReadFile(node0_stderr);
  const int third = job.Start(flags, worker_flags);
  const int fourth = job.Start(flags, worker_flags);
  const testing::ProgramRun killed = job.Wait(doomed);
  EXPECT_EQ(killed.exit_code, 128 + SIGKILL) << killed.output;
  std::string all;
  for (int launcher : {first, waiting, third, fourth}) {
    const testing::ProgramRun run = job.Wait(launcher);
    EXPECT_EQ(run.exit_code, 0) << run.output;
    all += run.output;
  }
  all += ReadFile(node0_stderr);
  EXPECT_THAT(all, ContainsRegex("ddprun: node 0: the launcher that joined the job in slot 1 sent no "
                                 "heartbeat for [0-9]+ ms \\(--node_timeout\\) and gets no place"));
  EXPECT_THAT(all, Not(HasSubstr("in slot 2 sent no heartbeat"))) << all;
  EXPECT_THAT(all, Not(HasSubstr("restarting the job"))) << all;
  EXPECT_EQ(CountLines(all, "met 4 ranks"), 4) << all;
  for (int node = 1; node < 4; ++node) {
    EXPECT_EQ(CountLines(all, "ddprun: joined as node " + std::to_string(node) + " of 4"), 1) << all;
  }
}

TEST(DdprunMultinodeTest, C10dLauncherThatDiesJustBeforeTheRoundClosesGetsNoPlace) {
  // --nnodes=2:4: node 0 and a second launcher make the minimum, and the
  // round closes at the end of a 5 s last call. A third launcher joins,
  // beats, and is killed, less than --node_timeout (10 s) before the close:
  // it still counts then, but misses the beat that node 0 asks of every
  // launcher it seats after the close. The job runs on the two live nodes
  // at once, instead of seating the dead one and failing when its workers
  // never come.
  C10dJob job;
  const std::vector<std::string> flags = {"--nnodes=2:4", "--rdzv_conf=last_call_timeout=5", "--nproc_per_node=1",
                                          "--node_timeout=10", "--rdzv_timeout=20"};
  const std::vector<std::string> worker_flags = {"--store", "--print_env"};
  const int first = job.StartNodeZero(flags, worker_flags);
  const int second = job.Start(flags, worker_flags);
  ASSERT_TRUE(job.Reached("ddprun/a0/join/1"));
  const int doomed = job.Start(flags, worker_flags);
  ASSERT_TRUE(job.Reached("ddprun/a0/alive/2"));  // took slot 2 and beat there
  ASSERT_EQ(kill(job.launcher_pid(doomed), SIGKILL), 0);
  auto members = job.store()->TryGet("ddprun/a0/members", DeadlineIn(5s));
  ASSERT_TRUE(members.ok() && !members->has_value()) << "the round closed before the kill; too slow a machine";
  const testing::ProgramRun killed = job.Wait(doomed);
  EXPECT_EQ(killed.exit_code, 128 + SIGKILL) << killed.output;
  std::string all;
  for (int launcher : {first, second}) {
    const testing::ProgramRun run = job.Wait(launcher);
    EXPECT_EQ(run.exit_code, 0) << run.output;
    all += run.output;
  }
  EXPECT_THAT(all, ContainsRegex("ddprun: node 0: the launcher in slot 2 of the job sent no heartbeat for "
                                 "[0-9]+ ms after the round closed and gets no place"));
  EXPECT_EQ(CountLines(all, "ddprun: the job runs on 2 nodes (--nnodes=2:4)"), 1) << all;
  EXPECT_EQ(CountLines(all, "met 2 ranks"), 2) << all;
  EXPECT_THAT(all, Not(HasSubstr("restarting"))) << all;
}

TEST(DdprunMultinodeTest, C10dSpareThatDiedGetsNoPlaceAtTheRestart) {
  // A spare takes its slot in the next round while the job runs, and is
  // killed there; then node 1's launcher is killed too. At the restart
  // node 0 finds the spare's slot, hears no heartbeat from it, and gives
  // node 1's place to a launcher started afterwards instead.
  const std::string dir = testing::MakeTempDir("c10d_dead_spare");
  const std::string node0_stderr = dir + "/node0.stderr";
  C10dJob job;
  const std::vector<std::string>& flags = kRestartableTwoNodes;
  const std::vector<std::string> worker_flags = LastingWorkers(dir);
  const int first = job.StartNodeZero(flags, worker_flags, node0_stderr);
  const int second = job.Start(flags, worker_flags);
  testing::ReadPidFile(dir + "/rank1.restart0.pid", 10s);  // the job runs
  const int spare = job.Start(flags, worker_flags);
  ASSERT_TRUE(job.Reached("ddprun/a1/join/1"));
  ASSERT_EQ(kill(job.launcher_pid(spare), SIGKILL), 0);
  const pid_t worker = KillLauncherOf(dir, 1);
  // Node 0 opens the restart's round once it declared node 1 dead.
  const auto opened = Clock::now() + 20s;
  while (Clock::now() < opened) {
    auto round = job.store()->TryGet("ddprun/round", DeadlineIn(5s));
    if (round.ok() && round->value_or("") == "1") break;
    std::this_thread::sleep_for(20ms);
  }
  // Node 0 leaves out the spare's slot, which it found taken at its first
  // look and never heard beat, after two monitor slices and a half second
  // (2 s at --node_timeout=3), and says so; the relaunched launcher must
  // come after that. The test waits for that line (it slept a fixed 6 s,
  // three times the time, for a node 0 starved on a loaded machine).
  ASSERT_TRUE(FileGets(node0_stderr, "joined restart 1 in slot 1 sent no heartbeat", 30s))
      << ReadFile(node0_stderr);
  const int relaunched = job.Start(flags, worker_flags);
  const testing::ProgramRun first_run = job.Wait(first);
  const testing::ProgramRun relaunched_run = job.Wait(relaunched);
  const std::string all = first_run.output + ReadFile(node0_stderr) + job.Wait(second).output +
                          job.Wait(spare).output + relaunched_run.output;
  EXPECT_EQ(first_run.exit_code, 0) << all;
  EXPECT_EQ(relaunched_run.exit_code, 0) << all;
  EXPECT_THAT(all, ContainsRegex("ddprun: node 0: the launcher that joined restart 1 in slot 1 sent no "
                                 "heartbeat for [0-9]+ ms and gets no place"));
  EXPECT_THAT(all, HasSubstr("restarting the job (restart 1 of 1)"));
  EXPECT_EQ(CountLines(all, "ddprun: restart 1: joined as node 1 of 2"), 1) << all;
  EXPECT_THAT(relaunched_run.output, HasSubstr("rank 1/2 local 0/1 group 1 restart 1"));
  EXPECT_THAT(relaunched_run.output, HasSubstr("rank 1 done"));
  EXPECT_TRUE(testing::GoneWithin(worker, 5s));
}

// Node 1's launcher is stopped (SIGSTOP) while the job runs; node 0
// declares it dead and restarts the job with the spare as node 1. The old
// launcher, continued, joins restart 1, finds itself left out and waits as
// a spare for restart 2; then it is interrupted (SIGTERM). It is no longer
// a member of the job and leaves alone: it used to count itself one still
// (its node rank of the first round) and stopped the running restart 1,
// whose nodes then exited 1.
TEST(DdprunMultinodeTest, C10dInterruptedLauncherLeftOutOfTheRestartLeavesTheJobRunning) {
  const std::string dir = testing::MakeTempDir("c10d_left_out_interrupted");
  C10dJob job;
  const std::vector<std::string>& flags = kRestartableTwoNodes;
  // Workers that run until the steps below are done, at every restart (they
  // ran a fixed 8 s, which the test waited out), at most 60 s.
  const std::string done = dir + "/done";
  const std::vector<std::string> worker_flags = {"--store", "--print_env", "--sleep_ms=60000",
                                                 "--until_file=" + done, "--pid_dir=" + dir};
  const int first = job.StartNodeZero(flags, worker_flags);
  const int second = job.Start(flags, worker_flags);
  ASSERT_GT(testing::ReadPidFile(dir + "/rank1.restart0.pid", 20s), 0);  // the job runs
  const int spare = job.Start(flags, worker_flags);
  ASSERT_TRUE(job.Reached("ddprun/a1/join/1"));  // left out of the first round
  ASSERT_EQ(kill(job.launcher_pid(second), SIGSTOP), 0);
  // Restart 1 runs with the spare as node 1.
  const pid_t restarted = testing::ReadPidFile(dir + "/rank1.restart1.pid", 30s);
  ASSERT_EQ(kill(job.launcher_pid(second), SIGCONT), 0);
  ASSERT_GT(restarted, 0);
  // The old node 1 found itself left out of restart 1 and waits in restart 2.
  ASSERT_TRUE(job.Reached("ddprun/a2/join/1"));
  ASSERT_EQ(kill(job.launcher_pid(second), SIGTERM), 0);
  const testing::ProgramRun left = job.Wait(second, 30s);
  std::ofstream(done) << "done\n";
  const testing::ProgramRun first_run = job.Wait(first, 60s);
  const testing::ProgramRun spare_run = job.Wait(spare, 60s);
  const std::string all = first_run.output + left.output + spare_run.output;
  EXPECT_EQ(left.exit_code, 128 + SIGTERM) << all;
  EXPECT_THAT(left.output, HasSubstr("ddprun: node 1: the job already runs on 2 nodes (--nnodes=2); this "
                                     "launcher waits as a spare for a restart"))
      << all;
  EXPECT_THAT(left.output, HasSubstr("interrupted by SIGTERM while waiting for the nodes of restart 2\n"))
      << all;
  EXPECT_THAT(all, Not(HasSubstr("the job stops"))) << all;
  EXPECT_EQ(first_run.exit_code, 0) << all;
  EXPECT_EQ(spare_run.exit_code, 0) << all;
  EXPECT_THAT(first_run.output, HasSubstr("node 1's launcher sent no heartbeat for"));
  EXPECT_THAT(spare_run.output, HasSubstr("ddprun: restart 1: joined as node 1 of 2"));
  EXPECT_THAT(spare_run.output, HasSubstr("rank 1 done"));
  EXPECT_THAT(first_run.output, HasSubstr("rank 0 done"));
}

// Node 0 is interrupted after it formed the first round but before its
// workers start: here while it waits for the beat that confirms node 1's
// place (node 1 and a spare are played by the test, through the store). It
// used to leave at once and take the store with it: the spare, waiting for
// the next round, got no answer (and exited 1). It now tells the spare that
// the job ended (exit status 130), and waits for node 1 to say goodbye, as
// when it is interrupted while its workers run.
TEST(DdprunMultinodeTest, C10dNodeZeroInterruptedBeforeItsWorkersStartTellsTheSpares) {
  C10dJob job;
  const std::vector<std::string> flags = {"--nnodes=2", "--nproc_per_node=1", "--node_timeout=4",
                                          "--rdzv_timeout=20"};
  const int first = job.StartNodeZero(flags, {"--sleep_ms=30000"});
  ASSERT_TRUE(job.Reached("ddprun/round"));  // node 0 forms the first round
  // Past node 0's first look, after which a slot counts as soon as it is seen.
  std::this_thread::sleep_for(300ms);
  store::TcpStoreClient& store = *job.store();
  // A spare waits in the next round.
  StatusOr<int64_t> slot = store.Add("ddprun/a1/joined", 1, DeadlineIn(5s));
  ASSERT_TRUE(slot.ok() && *slot == 1) << slot.status();
  // A join entry: the previous round's node rank (none), --nproc_per_node.
  ASSERT_TRUE(store.Set("ddprun/a1/join/1", "-1 1", DeadlineIn(5s)).ok());
  // Node 1 takes slot 1 and beats, then counts (its entry written): the
  // round closes.
  slot = store.Add("ddprun/a0/joined", 1, DeadlineIn(5s));
  ASSERT_TRUE(slot.ok() && *slot == 1) << slot.status();
  ASSERT_TRUE(store.Add("ddprun/a0/alive/1", 1, DeadlineIn(5s)).ok());
  ASSERT_TRUE(store.Set("ddprun/a0/join/1", "-1 1", DeadlineIn(5s)).ok());
  // Node 0 now waits up to 2.5 s (two monitor slices and a half second)
  // for node 1's confirming beat; it is interrupted meanwhile, and the beat
  // comes after the signal.
  std::this_thread::sleep_for(1s);
  ASSERT_EQ(kill(job.launcher_pid(first), SIGINT), 0);
  std::this_thread::sleep_for(200ms);
  ASSERT_TRUE(store.Add("ddprun/a0/alive/1", 1, DeadlineIn(5s)).ok());
  StatusOr<std::string> members = store.Get("ddprun/a0/members", DeadlineIn(10s));
  ASSERT_TRUE(members.ok()) << members.status();
  ASSERT_EQ(*members, "0 1") << "the signal came before the round closed; too slow a machine";
  // The spare learns how the job ended.
  StatusOr<std::string> next = store.Get("ddprun/a1/members", DeadlineIn(10s));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(*next, "end 130");
  EXPECT_TRUE(store.Set("ddprun/a1/left/1", "1", DeadlineIn(5s)).ok());
  // Node 1 (it would have seen the stop) says goodbye.
  StatusOr<std::string> stop = store.Get("ddprun/a0/stop", DeadlineIn(5s));
  EXPECT_TRUE(stop.ok()) << stop.status();
  EXPECT_TRUE(store.Set("ddprun/a0/exit/1", "1", DeadlineIn(5s)).ok());
  const testing::ProgramRun run = job.Wait(first, 30s);
  EXPECT_EQ(run.exit_code, 128 + SIGINT) << run.output;
  EXPECT_THAT(run.output, HasSubstr("ddprun: node 0: interrupted by SIGINT while waiting for the other nodes; "
                                    "the job stops\n"));
  EXPECT_THAT(run.output, Not(HasSubstr("rank 0"))) << "its workers started";
}

TEST(DdprunMultinodeTest, C10dRefusesADifferentRdzvId) {
  // 3 s: node 0 must still wait when the other launcher arrives.
  const auto runs = RunC10dJob(2, 2, {"--nproc_per_node=1", "--rdzv_timeout=3"}, {},
                               {{0, {"--rdzv_id=a"}}, {1, {"--rdzv_id=b"}}});
  // Whichever launcher joined second is refused before it takes a node
  // rank; node 0 then misses node 1.
  const int refused = runs[0].exit_code == 2 ? 0 : 1;
  EXPECT_EQ(runs[refused].exit_code, 2) << runs[refused].output;
  EXPECT_THAT(runs[refused].output,
              ContainsRegex("ddprun: launcher was started with --rdzv_id=[ab] but node 0 with "
                            "--rdzv_id=[ab]; every node needs the same flags"));
  EXPECT_EQ(runs[1 - refused].exit_code, 1) << runs[1 - refused].output;
  EXPECT_THAT(runs[1 - refused].output,
              HasSubstr("ddprun: node 0: only 1 of 2 nodes joined within --rdzv_timeout (3000 ms)"));
}

// Node 0 already decided to restart (rank 0 failed) and waits for node 1
// at the next rendezvous, while node 1 still stops a worker that ignores
// SIGTERM (--grace_period=30). Node 1 is then interrupted: node 0 stops
// waiting at once instead of for the grace period and --rdzv_timeout.
void InterruptWhileTheOthersWaitForTheRestart(bool c10d) {
  const std::string dir = testing::MakeTempDir(c10d ? "c10d_stop_restart" : "static_stop_restart");
  const std::vector<std::string> flags = {"--nproc_per_node=1", "--max_restarts=1", "--grace_period=30",
                                          "--rdzv_timeout=120"};
  const std::vector<std::string> worker_flags = {"--store", "--exit_code=0:5", "--ignore_sigterm",
                                                 "--sleep_ms=60000", "--pid_dir=" + dir};
  std::unique_ptr<Job> static_job;
  std::unique_ptr<C10dJob> c10d_job;
  int port = 0;
  pid_t node1 = -1;
  if (c10d) {
    c10d_job = std::make_unique<C10dJob>();
    std::vector<std::string> all = flags;
    all.push_back("--nnodes=2");
    c10d_job->StartNodeZero(all, worker_flags);
    node1 = c10d_job->launcher_pid(c10d_job->Start(all, worker_flags));
    port = c10d_job->port();
  } else {
    static_job = std::make_unique<Job>(2, flags, worker_flags);
    node1 = static_job->launcher_pid(1);
    port = static_job->port();
  }
  // Node 1 began to stop its worker (SIGTERM, ignored) ...
  ASSERT_GT(testing::ReadPidFile(dir + "/rank1.restart0.got_term", 30s), 0);
  // ... and node 0 waits for it at the restart's rendezvous.
  ASSERT_TRUE(c10d ? StoreReaches(port, "ddprun/round", "1") : StoreReaches(port, "ddprun/a1/node/0"));
  const auto start = Clock::now();
  ASSERT_EQ(kill(node1, SIGINT), 0);
  std::vector<testing::ProgramRun> runs =
      c10d ? c10d_job->WaitAll(60s) : static_job->Wait(60s);
  EXPECT_LT(Clock::now() - start, 20s);
  const std::string all = runs[0].output + runs[1].output;
  EXPECT_EQ(runs[0].exit_code, 1) << all;
  EXPECT_THAT(runs[0].output, HasSubstr("restarting the job (restart 1 of 1)")) << all;
  EXPECT_THAT(runs[0].output, HasSubstr("node 1: interrupted by SIGINT; the job stops without restart 1")) << all;
  EXPECT_EQ(runs[1].exit_code, 128 + SIGINT) << all;
  EXPECT_EQ(testing::ReadPidFile(dir + "/rank0.restart1.pid", 10ms), -1) << all;
}

TEST(DdprunMultinodeTest, InterruptWhileTheOthersWaitForTheRestartStopsThem) {
  InterruptWhileTheOthersWaitForTheRestart(/*c10d=*/false);
}

TEST(DdprunMultinodeTest, C10dInterruptWhileTheOthersWaitForTheRestartStopsThem) {
  InterruptWhileTheOthersWaitForTheRestart(/*c10d=*/true);
}

TEST(DdprunMultinodeTest, ElasticStartRunsOnTheNodesThatJoined) {
  // --nnodes=1:3: node 0 waits 5 s after the first node for more; two come
  // (the second is started once node 0 serves the store, and has the 5 s
  // to start and join: ample on a loaded machine).
  C10dJob job;
  const std::vector<std::string> flags = {"--nnodes=1:3", "--rdzv_conf=last_call_timeout=5",
                                          "--nproc_per_node=2"};
  const std::vector<std::string> worker_flags = {"--store", "--print_env"};
  job.StartNodeZero(flags, worker_flags);
  job.Start(flags, worker_flags);
  const auto runs = job.WaitAll();
  EXPECT_EQ(runs[0].exit_code, 0) << runs[0].output;
  EXPECT_EQ(runs[1].exit_code, 0) << runs[1].output;
  const std::string all = runs[0].output + runs[1].output;
  EXPECT_EQ(CountLines(all, "ddprun: the job runs on 2 nodes (--nnodes=1:3)"), 1) << all;
  EXPECT_EQ(CountLines(all, "ddprun: joined as node 1 of 2"), 1) << all;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_THAT(all, HasSubstr("rank " + std::to_string(rank) + "/4 local " + std::to_string(rank % 2) + "/2"));
  }
  EXPECT_EQ(CountLines(all, "met 4 ranks"), 4);
}

TEST(DdprunMultinodeTest, ElasticJobTakesInALateLauncher) {
  // The first launcher starts the job on 1 node after 0.2 s; its worker
  // would stay 60 s, but the second launcher arrives once it runs, and the
  // job restarts on 2 nodes (--max_restarts=0: such a restart is not
  // counted).
  const std::string dir = testing::MakeTempDir("elastic_late_launcher");
  C10dJob job;
  const std::vector<std::string> flags = {"--nnodes=1:2", "--rdzv_conf=last_call_timeout=0.2",
                                          "--nproc_per_node=1"};
  const std::vector<std::string> worker_flags = {"--store", "--print_env", "--sleep_ms=60000",
                                                 "--sleep_before_restart=1", "--pid_dir=" + dir};
  const int first = job.Start(flags, worker_flags);
  ASSERT_GT(testing::ReadPidFile(dir + "/rank0.restart0.pid", 30s), 0);  // the 1-node job runs
  const int late = job.Start(flags, worker_flags);
  const auto start = Clock::now();
  const testing::ProgramRun late_run = job.Wait(late, 90s);
  const testing::ProgramRun first_run = job.Wait(first, 90s);
  EXPECT_LT(Clock::now() - start, 40s);  // the first worker's 60 s were cut short
  EXPECT_EQ(first_run.exit_code, 0) << first_run.output;
  EXPECT_EQ(late_run.exit_code, 0) << late_run.output;
  EXPECT_THAT(first_run.output, HasSubstr("ddprun: the job runs on 1 node (--nnodes=1:2)\n"));
  EXPECT_THAT(first_run.output, HasSubstr("ddprun: 1 launcher waits to join the job; restarting the "
                                          "workers to take them in (not counted against --max_restarts)"));
  EXPECT_THAT(first_run.output, HasSubstr("ddprun: the job runs on 2 nodes (--nnodes=1:2) from restart 1"));
  EXPECT_THAT(late_run.output, HasSubstr("ddprun: launcher: the job runs on 1 node (--nnodes=1:2); this "
                                         "launcher joins when node 0 restarts the workers"));
  EXPECT_THAT(late_run.output, HasSubstr("ddprun: restart 1: joined as node 1 of 2"));
  EXPECT_THAT(first_run.output, HasSubstr("rank 0/1 local 0/1 group 0 restart 0"));
  EXPECT_THAT(first_run.output, HasSubstr("rank 0/2 local 0/1 group 0 restart 1"));
  EXPECT_THAT(late_run.output, HasSubstr("rank 1/2 local 0/1 group 1 restart 1"));
  EXPECT_EQ(CountLines(first_run.output + late_run.output, "met 2 ranks"), 2);
}

TEST(DdprunMultinodeTest, ElasticJobGoesOnWithoutADeadNode) {
  // Three nodes of --nnodes=2:3 (the round closes as soon as all three
  // are in); one launcher is killed. Node 0 declares it dead after 3 s, and
  // the restart runs on the two that are left after the 3 s last call.
  const std::string dir = testing::MakeTempDir("elastic_dead_node");
  C10dJob job;
  const std::vector<std::string> flags = {"--nnodes=2:3", "--rdzv_conf=last_call_timeout=3",
                                          "--nproc_per_node=1", "--max_restarts=1", "--node_timeout=3"};
  const std::vector<std::string> worker_flags = {"--store", "--print_env", "--sleep_ms=30000",
                                                 "--sleep_before_restart=1", "--pid_dir=" + dir};
  for (int i = 0; i < 3; ++i) job.Start(flags, worker_flags);
  const pid_t worker = KillLauncherOf(dir, 2);
  const std::string all = OneKilledOthersSucceeded(job.WaitAll());
  EXPECT_THAT(all, HasSubstr("ddprun: the job runs on 3 nodes (--nnodes=2:3)\n"));
  EXPECT_THAT(all, HasSubstr("node 2's launcher sent no heartbeat for"));
  EXPECT_THAT(all, HasSubstr("ddprun: the job runs on 2 nodes (--nnodes=2:3) from restart 1"));
  // The survivor keeps its node rank.
  EXPECT_EQ(CountLines(all, "ddprun: restart 1: joined as node 1 of 2"), 1) << all;
  // (The first round's workers may not have met before the kill.)
  EXPECT_EQ(CountLines(all, "met 2 ranks"), 2) << all;
  EXPECT_EQ(CountLines(all, " done"), 2) << all;
  EXPECT_TRUE(testing::GoneWithin(worker, 5s));
}

}  // namespace
}  // namespace ddp::transport::launch
