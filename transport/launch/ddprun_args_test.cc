#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/launch/ddprun.h"

namespace ddp::transport::launch {
namespace {

using namespace std::chrono_literals;

StatusOr<DdprunOptions> Parse(std::vector<std::string> args, EnvMap env = {}) {
  std::vector<const char*> argv = {"ddprun"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  return ParseDdprunArgs(static_cast<int>(argv.size()), argv.data(), env);
}

void ExpectRefused(std::vector<std::string> args, const std::string& message, EnvMap env = {}) {
  StatusOr<DdprunOptions> o = Parse(args, env);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(o.status().message(), message);
}

TEST(DdprunArgsTest, TorchrunSpellings) {
  StatusOr<DdprunOptions> o =
      Parse({"--nproc-per-node=4", "--nnodes", "2", "--node_rank=1", "--master_addr=10.0.0.1",
             "--master-port", "1234", "--max_restarts=3", "--log_dir=/tmp/x", "--tee",
             "--no_prefix", "--rdzv_timeout=2.5", "--node_timeout=1", "--grace_period=0",
             "--max_run_time=60", "train", "--lr=0.1"},
            {{"DDP_JOB_TOKEN", "secret"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nproc_per_node, 4);
  EXPECT_EQ(o->nnodes, 2);
  EXPECT_EQ(o->node_rank, 1);
  EXPECT_EQ(o->master_addr, "10.0.0.1");
  EXPECT_EQ(o->master_port, 1234);
  EXPECT_EQ(o->max_restarts, 3);
  EXPECT_EQ(o->log_dir, "/tmp/x");
  EXPECT_EQ(o->tee.For(0), 3);
  EXPECT_FALSE(o->prefix);
  EXPECT_EQ(o->job_token, "secret");
  EXPECT_EQ(o->rdzv_timeout, 2500ms);
  EXPECT_EQ(o->node_timeout, 1000ms);
  EXPECT_EQ(o->grace, 0ms);
  EXPECT_EQ(o->max_run_time, 60000ms);
  EXPECT_EQ(o->command, (std::vector<std::string>{"train", "--lr=0.1"}));
}

// As under torchrun, whose argparse takes any unique start of a long flag:
// `--nproc=4`, `--max-restart 3`, `--standalon` are the flags they start,
// on the command line (so a PET_ variable does not override them); a start
// of several is refused, naming them. All were unknown flags.
TEST(DdprunArgsTest, AUniqueStartOfAFlagIsTheFlag) {
  StatusOr<DdprunOptions> o = Parse({"--nproc=4", "--max-restart", "3", "--standalon", "--rdzv_i=job7", "train"},
                                    {{"PET_NPROC_PER_NODE", "2"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nproc_per_node, 4);
  EXPECT_EQ(o->max_restarts, 3);
  EXPECT_TRUE(o->standalone);
  // --standalone makes up its own run id over --rdzv_id's (see below).
  EXPECT_EQ(o->rdzv_id, "");
  EXPECT_EQ(o->notes, std::vector<std::string>{"--rdzv_id=job7 is ignored: --standalone makes up a run id for "
                                               "each run, as torchrun's does"});
  EXPECT_EQ(o->command, (std::vector<std::string>{"train"}));
  ExpectRefused({"--no=1", "p"},
                "--no is ambiguous: it starts --no_prefix, --no_python, --node_rank and --node_timeout "
                "(give more of the name; see ddprun --help)");
  ExpectRefused({"--rdzv=c10d", "p"},
                "--rdzv is ambiguous: it starts --rdzv_backend, --rdzv_conf, --rdzv_endpoint, --rdzv_id "
                "and --rdzv_timeout (give more of the name; see ddprun --help)");
  // Messages name the whole flag.
  ExpectRefused({"--nproc", "p"}, "--nproc_per_node=p is not an integer, gpu, cpu or auto");
}

TEST(DdprunArgsTest, ProgramFlagsAreLeftAlone) {
  StatusOr<DdprunOptions> o = Parse({"--nproc_per_node=2", "--", "prog", "--nproc_per_node=5"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nproc_per_node, 2);
  EXPECT_EQ(o->command, (std::vector<std::string>{"prog", "--nproc_per_node=5"}));
  o = Parse({"prog", "--nnodes=9"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nnodes, 1);
  EXPECT_EQ(o->command, (std::vector<std::string>{"prog", "--nnodes=9"}));
}

TEST(DdprunArgsTest, Defaults) {
  StatusOr<DdprunOptions> o = Parse({"prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nproc_per_node, 1);
  EXPECT_EQ(o->master_addr, "127.0.0.1");
  EXPECT_EQ(o->master_port, 29500);
  EXPECT_EQ(o->job_token, "");
  // torchrun's join timeout (rdzv_conf join_timeout, or timeout for the
  // static backend), which --rdzv_timeout stands for.
  EXPECT_EQ(o->rdzv_timeout, 600000ms);
  o = Parse({"--standalone", "--master_port=1234", "prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_port, 0);
  EXPECT_EQ(o->master_addr, "127.0.0.1");
}

TEST(DdprunArgsTest, TokenFlagWinsOverEnvironment) {
  StatusOr<DdprunOptions> o = Parse({"--job_token=flag", "prog"}, {{"DDP_JOB_TOKEN", "env"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->job_token, "flag");
}

TEST(DdprunArgsTest, HelpNeedsNoProgram) {
  StatusOr<DdprunOptions> o = Parse({"--help"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->help);
  EXPECT_THAT(DdprunUsage(), ::testing::HasSubstr("--nproc_per_node=N"));
}

// argparse (torchrun) takes any unique start of --help too: --h, --he and
// --hel print the help, as -h does; they were unknown flags. --help after
// a bad flag is not reached, as under argparse, and takes no value.
TEST(DdprunArgsTest, AStartOfHelpIsHelp) {
  for (const char* start : {"--h", "--he", "--hel", "--help", "-h"}) {
    StatusOr<DdprunOptions> o = Parse({"--nproc_per_node=2", start, "--frob"});
    ASSERT_TRUE(o.ok()) << start << ": " << o.status();
    EXPECT_TRUE(o->help) << start;
  }
  ExpectRefused({"--he=1"}, "--help takes no value");
  ExpectRefused({"--frob", "--help"}, "unknown flag --frob (see ddprun --help)");
  // A start of help and of nothing else; --n starts several flags, help
  // not among them.
  ExpectRefused({"--n=1", "p"},
                "--n is ambiguous: it starts --nnodes, --no_prefix, --no_python, --node_rank, "
                "--node_timeout, --nproc_per_node and --numa_binding (give more of the name; see ddprun "
                "--help)");
}

// torchrun's c10d rendezvous with no --rdzv_endpoint is at localhost:29400
// and ignores --master_addr and --master_port (and their PET_ variables),
// which are the static backend's. ddprun used them, 127.0.0.1:29500 by
// default; the static backend keeps them.
TEST(DdprunArgsTest, C10dWithoutAnEndpointIsAtLocalhost29400AsTorchrun) {
  StatusOr<DdprunOptions> o = Parse({"--rdzv_backend=c10d", "--nnodes=1:2", "p"}, {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "localhost");
  EXPECT_EQ(o->master_port, 29400);
  EXPECT_TRUE(o->notes.empty());
  o = Parse({"--rdzv_backend=c10d", "--master_addr=10.0.0.9", "--master_port=1234", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "localhost");
  EXPECT_EQ(o->master_port, 29400);
  EXPECT_EQ(o->notes, std::vector<std::string>{"--master_addr and --master_port are ignored with "
                                               "--rdzv_backend=c10d, as under torchrun: give the store as "
                                               "--rdzv_endpoint=HOST:PORT (without one it is at "
                                               "localhost:29400)"});
  o = Parse({"p"}, {{"PET_RDZV_BACKEND", "c10d"}, {"PET_MASTER_PORT", "1234"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "localhost");
  EXPECT_EQ(o->master_port, 29400);
  // The note names the variable it came from (it said --master_port).
  EXPECT_EQ(o->notes, std::vector<std::string>{"PET_MASTER_PORT is ignored with --rdzv_backend=c10d, as under "
                                               "torchrun: give the store as --rdzv_endpoint=HOST:PORT (without "
                                               "one it is at localhost:29400)"});
  // An endpoint without a port is on 29400 too; --standalone is still on
  // 127.0.0.1 with a free port.
  o = Parse({"--rdzv_backend=c10d", "--rdzv_endpoint=head", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "head");
  EXPECT_EQ(o->master_port, 29400);
  o = Parse({"--rdzv_backend=c10d", "--standalone", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "127.0.0.1");
  EXPECT_EQ(o->master_port, 0);
  // The static backend still reads them.
  o = Parse({"--rdzv_backend=static", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "127.0.0.1");
  EXPECT_EQ(o->master_port, 29500);
  o = Parse({"--master_addr=10.0.0.9", "--master_port=1234", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "10.0.0.9");
  EXPECT_EQ(o->master_port, 1234);
}

TEST(DdprunArgsTest, TorchrunRendezvousFlags) {
  // torchrun's usual multi-node line: no --node_rank with c10d.
  StatusOr<DdprunOptions> o =
      Parse({"--nnodes=2", "--nproc_per_node=8", "--rdzv_id=job42", "--rdzv_backend=c10d",
             "--rdzv_endpoint=head.example:29400", "train"},
            {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "head.example");
  EXPECT_EQ(o->master_port, 29400);
  EXPECT_EQ(o->rdzv_backend, "c10d");
  EXPECT_EQ(o->rdzv_id, "job42");
  EXPECT_TRUE(o->assign_node_rank);
  // The static backend with an endpoint: its port, the node rank given.
  o = Parse({"--nnodes=2", "--node_rank=1", "--rdzv_backend=static", "--rdzv_endpoint=10.1.2.3:2345", "p"},
            {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "10.1.2.3");
  EXPECT_EQ(o->master_port, 2345);
  EXPECT_EQ(o->node_rank, 1);
  EXPECT_FALSE(o->assign_node_rank);
  o = Parse({"--rdzv_endpoint=[fe80::1]:1234", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "fe80::1");
  EXPECT_EQ(o->master_port, 1234);
  // One node with c10d: node 0, nothing to assign.
  o = Parse({"--rdzv_backend=c10d", "--rdzv_endpoint=localhost:1234", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->node_rank, 0);
  EXPECT_FALSE(o->assign_node_rank);

  // torchrun's stream codes, with or without '='.
  o = Parse({"--log_dir=/tmp/x", "--redirects", "3", "--tee", "3", "./prog", "3"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tee.For(0), 3);
  EXPECT_EQ(o->redirects.For(0), 3);
  EXPECT_EQ(o->command, (std::vector<std::string>{"./prog", "3"}));
  o = Parse({"--log_dir=/tmp/x", "--tee=0", "./prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tee.For(0), 0);
  o = Parse({"--log_dir=/tmp/x", "--tee", "./prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tee.For(0), 3);
  EXPECT_EQ(o->command, std::vector<std::string>{"./prog"});
  o = Parse({"--no-python", "--nproc_per_node=2", "./prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->command, std::vector<std::string>{"./prog"});
  ExpectRefused({"-m", "mypkg.train"},
                "-m runs a Python module under torchrun; ddprun starts programs: give the program "
                "(e.g. python3 -m MODULE)");
  ExpectRefused({"--run_path", "x.py"},
                "--run_path runs a Python script inside torchrun's own interpreter; ddprun starts programs: "
                "give the interpreter and the script (e.g. python3 /abs/path/script.py)");
  ExpectRefused({"--no_python=1", "p"}, "--no_python takes no value");
  // torchrun's worker counts by device; CUDA_VISIBLE_DEVICES decides here.
  o = Parse({"--nproc_per_node=gpu", "p"}, {{"CUDA_VISIBLE_DEVICES", "0,1,2,3"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nproc_per_node, 4);
  ExpectRefused({"--nproc_per_node=gpu", "p"},
                "--nproc_per_node=gpu: no GPU is visible (CUDA_VISIBLE_DEVICES='' names none)",
                {{"CUDA_VISIBLE_DEVICES", ""}});
  // An elastic start: MIN:MAX nodes, with torchrun's last call.
  o = Parse({"--nnodes=2:4", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1",
             "--rdzv_conf=last_call_timeout=2.5,join_timeout=60", "p"},
            {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->min_nodes, 2);
  EXPECT_EQ(o->nnodes, 4);
  EXPECT_EQ(o->nnodes_spec, "2:4");
  EXPECT_EQ(o->last_call, 2500ms);
  EXPECT_EQ(o->rdzv_timeout, 60000ms);
  EXPECT_TRUE(o->assign_node_rank);
  o = Parse({"--nnodes=3:3", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "p"}, {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->min_nodes, 0);  // a fixed count
  EXPECT_EQ(o->nnodes, 3);
  for (const char* bad : {"--nnodes=3:2", "--nnodes=0:2", "--nnodes=1:", "--nnodes=:4", "--nnodes=1:99999"}) {
    ExpectRefused({bad, "--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "p"},
                  std::string(bad) + ": expected MIN:MAX with 1 <= MIN <= MAX <= 65536", {{"DDP_JOB_TOKEN", "t"}});
  }
  ExpectRefused({"--rdzv_conf=frob=5", "p"},
                "--rdzv_conf=frob=5: 'frob=5': not one of last_call_timeout, join_timeout (or timeout), "
                "read_timeout, close_timeout, keep_alive_interval (SEC), keep_alive_max_attempt=N, "
                "is_host=BOOL, use_libuv=BOOL, store_connect_wait_seconds=N");
  ExpectRefused({"--rdzv_conf=join_timeout=0", "p"},
                "--rdzv_conf=join_timeout=0: 'join_timeout=0': join_timeout is not a positive number of "
                "seconds");
  // torchrun's keep-alives are the node timeout: interval times attempts,
  // with its defaults (5 s, 3) for the one not given.
  o = Parse({"--rdzv_conf=keep_alive_interval=2,keep_alive_max_attempt=4", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->node_timeout, 8000ms);
  o = Parse({"--rdzv_conf=keep_alive_interval=0.5", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->node_timeout, 1500ms);
  o = Parse({"--rdzv_conf=keep_alive_max_attempt=2", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->node_timeout, 10000ms);
  ExpectRefused({"--rdzv_conf=keep_alive_max_attempt=0", "p"},
                "--rdzv_conf=keep_alive_max_attempt=0: 'keep_alive_max_attempt=0': keep_alive_max_attempt "
                "takes a count from 1 to 1000");
  ExpectRefused({"--rdzv_conf=keep_alive_interval=0", "p"},
                "--rdzv_conf=keep_alive_interval=0: 'keep_alive_interval=0': keep_alive_interval is not a "
                "positive number of seconds");
  // Each within its bounds, the product beyond 1e9 s: refused, not a
  // timeout that overflows and declares every node dead at once.
  o = Parse({"--rdzv_conf=keep_alive_interval=10000000,keep_alive_max_attempt=100", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->node_timeout, std::chrono::milliseconds(int64_t{1000000000} * 1000));
  ExpectRefused({"--rdzv_conf=keep_alive_interval=100000000,keep_alive_max_attempt=100", "p"},
                "--rdzv_conf keep_alive_interval x keep_alive_max_attempt (100000000000 ms x 100) is beyond "
                "1000000000 s");
  ExpectRefused({"--node_timeout=4", "--rdzv_conf=keep_alive_interval=1", "p"},
                "--node_timeout and --rdzv_conf's keep_alive_interval/keep_alive_max_attempt both say when a "
                "silent node is dead; give one of them");
  // Likewise --rdzv_timeout and rdzv_conf's join timeout on the command
  // line: the one given last won. With one of them from the environment
  // the command line's wins, with a note (PET_RDZV_CONF's used to win).
  const std::string both_joins = " both say how long to wait for every node to join; give one of them";
  ExpectRefused({"--rdzv_timeout=20", "--rdzv_conf=join_timeout=900", "p"},
                "--rdzv_timeout and --rdzv_conf's join_timeout" + both_joins);
  ExpectRefused({"--rdzv_conf=timeout=900", "--rdzv_timeout=20", "p"},
                "--rdzv_timeout and --rdzv_conf's timeout" + both_joins);
  StatusOr<DdprunOptions> flag_wins = Parse({"--rdzv_timeout=20", "p"}, {{"PET_RDZV_CONF", "join_timeout=900"}});
  ASSERT_TRUE(flag_wins.ok()) << flag_wins.status();
  EXPECT_EQ(flag_wins->rdzv_timeout, 20000ms);
  EXPECT_EQ(flag_wins->notes, std::vector<std::string>{
                                  "join_timeout in PET_RDZV_CONF is overridden by --rdzv_timeout on the command line"});
  ExpectRefused({"--rdzv_backend=etcd", "p"}, "--rdzv_backend=etcd is not supported; use static or c10d");
  ExpectRefused({"--rdzv_endpoint=h:", "p"}, "--rdzv_endpoint=h:: empty port");
  ExpectRefused({"--rdzv_endpoint=h:99999", "p"}, "--rdzv_endpoint=h:99999: the port must be in [0, 65535]");
  // A port that is no number is said to be one: it was "must be in [0, 65535]".
  ExpectRefused({"--rdzv_endpoint=h:abc", "p"},
                "--rdzv_endpoint=h:abc: 'abc' is not a port number (digits, 0 to 65535)");
  ExpectRefused({"--rdzv_endpoint=[::1]:-5", "p"},
                "--rdzv_endpoint=[::1]:-5: '-5' is not a port number (digits, 0 to 65535)");
  ExpectRefused({"--rdzv_endpoint=fe80::1", "p"},
                "--rdzv_endpoint=fe80::1: an IPv6 address needs brackets: [ADDRESS]:PORT");
  ExpectRefused({"--rdzv_endpoint=[fe80::1", "p"}, "--rdzv_endpoint=[fe80::1: no ']' after the IPv6 address");
  ExpectRefused({"--rdzv_endpoint=:80", "p"}, "--rdzv_endpoint=:80: no host");
  ExpectRefused({"--rdzv_id=a b", "p"}, "--rdzv_id=a b must be non-empty without spaces");
  ExpectRefused({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=[::0]:5", "p"},
                "the store's address ::0 is a wildcard address; with --rdzv_backend=c10d it must be "
                "the address of one node, which then serves the store",
                {{"DDP_JOB_TOKEN", "t"}});
  ExpectRefused({"--nnodes=3", "--rdzv_backend=c10d", "--rdzv_endpoint=0.0.0.0:5", "p"},
                "the store's address 0.0.0.0 is a wildcard address; with --rdzv_backend=c10d it must be "
                "the address of one node, which then serves the store",
                {{"DDP_JOB_TOKEN", "t"}});
}

// torchrun 1.13 (get_rdzv_endpoint, run): an endpoint wins over
// --master_addr and --master_port, and --standalone over the endpoint;
// what is overridden gets a note, not a refusal.
TEST(DdprunArgsTest, EndpointWinsOverMasterAddrAndPortWithANote) {
  StatusOr<DdprunOptions> o = Parse({"--master_addr=a", "--rdzv_endpoint=h:1", "--master_port=2", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "h");
  EXPECT_EQ(o->master_port, 1);
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--master_addr and --master_port are ignored: --rdzv_endpoint=h:1 names the store, "
                          "as under torchrun"});
  o = Parse({"--rdzv_backend=c10d", "--rdzv_endpoint=h", "--master_port=2", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "h");
  EXPECT_EQ(o->master_port, 29400);
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--master_port is ignored: --rdzv_endpoint=h names the store, as under torchrun"});
}

// torchrun's static backend refuses an endpoint without a port ("port is
// missing in endpoint"); ddprun took c10d's 29400 for it, a port that no
// flag named. c10d keeps its default port.
TEST(DdprunArgsTest, StaticEndpointWithoutPortIsRefusedNamingIt) {
  const std::string how =
      ": the port is missing; with --rdzv_backend=static give HOST:PORT (or --master_addr and "
      "--master_port instead of an endpoint), as torchrun requires";
  ExpectRefused({"--rdzv_endpoint=head", "p"}, "--rdzv_endpoint=head" + how);
  ExpectRefused({"--rdzv_backend=static", "--rdzv_endpoint=[fe80::1]", "--master_port=2", "p"},
                "--rdzv_endpoint=[fe80::1]" + how);
  ExpectRefused({"p"}, "PET_RDZV_ENDPOINT='head'" + how, {{"PET_RDZV_ENDPOINT", "head"}});
  // The backend, given after the endpoint or in the environment, decides.
  StatusOr<DdprunOptions> o = Parse({"--rdzv_endpoint=head", "p"}, {{"PET_RDZV_BACKEND", "c10d"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "head");
  EXPECT_EQ(o->master_port, 29400);
  o = Parse({"--rdzv_endpoint=[fe80::1]", "--rdzv_backend=c10d", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "fe80::1");
  EXPECT_EQ(o->master_port, 29400);
  // --standalone replaces the endpoint: nothing to refuse.
  o = Parse({"--standalone", "--rdzv_endpoint=head", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "127.0.0.1");
}

TEST(DdprunArgsTest, StandaloneOverridesTheEndpointWithANote) {
  StatusOr<DdprunOptions> o = Parse({"--standalone", "--rdzv_endpoint=h:1", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->standalone);
  EXPECT_EQ(o->master_addr, "127.0.0.1");
  EXPECT_EQ(o->master_port, 0);
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--rdzv_endpoint=h:1 is ignored: --standalone runs the store on 127.0.0.1 with a "
                          "free port"});
  // So are --master_addr and --master_port, which were dropped silently.
  o = Parse({"--standalone", "--master_addr=10.0.0.1", "--master_port=1234", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "127.0.0.1");
  EXPECT_EQ(o->master_port, 0);
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--master_addr and --master_port are ignored: --standalone runs the store on 127.0.0.1 "
                          "with a free port"});
  // Set by PET_STANDALONE, the note names it (it named --standalone, which
  // the command line did not give).
  o = Parse({"--master_port=1234", "p"}, {{"PET_STANDALONE", "1"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_port, 0);
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--master_port is ignored: PET_STANDALONE runs the store on 127.0.0.1 with a free port"});
  o = Parse({"--rdzv_endpoint=h:1", "p"}, {{"PET_STANDALONE", "1"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--rdzv_endpoint=h:1 is ignored: PET_STANDALONE runs the store on 127.0.0.1 with a "
                          "free port"});
}

// torchrun's --standalone replaces --rdzv_id (from the command line or
// PET_RDZV_ID) with a uuid4 of its own, and logs it; ddprun drops it with a
// note, and its run id (DDP_RUN_ID) names the run instead.
TEST(DdprunArgsTest, StandaloneOverridesTheRdzvIdWithANote) {
  struct Case {
    std::vector<std::string> args;
    EnvMap env;
    std::string ignored;  // how the note names the run id
    std::string standalone;  // and --standalone
  };
  for (const Case& c : std::vector<Case>{
           {{"--standalone", "--rdzv_id=job7", "p"}, {}, "--rdzv_id=job7", "--standalone"},
           {{"--standalone", "p"}, {{"PET_RDZV_ID", "job7"}}, "PET_RDZV_ID='job7'", "--standalone"},
           {{"p"}, {{"PET_STANDALONE", "1"}, {"PET_RDZV_ID", "job7"}}, "PET_RDZV_ID='job7'", "PET_STANDALONE"},
           {{"--rdzv_id=job7", "p"}, {{"PET_STANDALONE", "1"}}, "--rdzv_id=job7", "PET_STANDALONE"}}) {
    StatusOr<DdprunOptions> o = Parse(c.args, c.env);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_TRUE(o->standalone);
    EXPECT_EQ(o->rdzv_id, "");
    EXPECT_EQ(o->notes, std::vector<std::string>{c.ignored + " is ignored: " + c.standalone +
                                                 " makes up a run id for each run, as torchrun's does"});
  }
  // Without --standalone it is kept.
  StatusOr<DdprunOptions> o = Parse({"--rdzv_id=job7", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rdzv_id, "job7");
  EXPECT_TRUE(o->notes.empty());
}

// --standalone with a range of nodes is refused as --standalone with
// several nodes, naming the range as given; it was refused for wanting
// --rdzv_backend=c10d, which would not have helped.
TEST(DdprunArgsTest, StandaloneWithARangeOfNodesNamesStandalone) {
  ExpectRefused({"--standalone", "--nnodes=1:2", "p"},
                "--standalone runs one node; it cannot be combined with --nnodes=1:2");
  ExpectRefused({"--standalone", "--nnodes=1:2", "--rdzv_backend=c10d", "p"},
                "--standalone runs one node; it cannot be combined with --nnodes=1:2");
  StatusOr<DdprunOptions> o = Parse({"--standalone", "--nnodes=1:1", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nnodes, 1);
}

// torchrun's help asks for an IPv6 --master_addr in brackets
// ([0:0:0:0:0:0:0:1]); it names the address inside them, as in
// --rdzv_endpoint. The brackets were kept, and no resolver knows "[::1]".
TEST(DdprunArgsTest, MasterAddrInBracketsIsTheAddressInside) {
  StatusOr<DdprunOptions> o = Parse({"--master_addr=[0:0:0:0:0:0:0:1]", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "0:0:0:0:0:0:0:1");
  o = Parse({"--master_addr", "::1", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "::1");
  ExpectRefused({"--master_addr=[::1", "p"}, "--master_addr=[::1: no ']' after the IPv6 address");
  ExpectRefused({"--master_addr=[::1]:80", "p"},
                "--master_addr=[::1]:80: the port goes in --master_port, not after the ']'");
  ExpectRefused({"--master_addr=[]", "p"}, "--master_addr=[]: no address inside the brackets");
}

// Several --rdzv_conf flags add up, key by key (a deliberate widening:
// torchrun's argparse keeps only the last; examples/train_elastic_test
// gives last_call_timeout and is_host in two flags), notes included, and
// the join timeout of any of them still clashes with --rdzv_timeout.
TEST(DdprunArgsTest, RdzvConfFlagsAddUp) {
  StatusOr<DdprunOptions> o =
      Parse({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1",
             "--rdzv_conf=join_timeout=60,read_timeout=7,close_timeout=3", "--rdzv_conf=is_host=false",
             "--rdzv_conf=last_call_timeout=2", "p"},
            {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rdzv_timeout, 60000ms);
  EXPECT_EQ(o->store_call_time, 7000ms);
  EXPECT_EQ(o->is_host, std::optional<bool>(false));
  EXPECT_EQ(o->last_call, 2000ms);
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--rdzv_conf=close_timeout=3 is ignored: when the job ends, node 0 tells the "
                          "waiting launchers and keeps the store up for them for up to 10 s"});
  ExpectRefused({"--rdzv_conf=join_timeout=60", "--rdzv_timeout=20", "--rdzv_conf=read_timeout=1", "p"},
                "--rdzv_timeout and --rdzv_conf's join_timeout both say how long to wait for every node to "
                "join; give one of them");
}

// An ignored torchrun flag given twice: as under torchrun's argparse the
// last value is the setting, so one note names it (there was a note for
// each, the first naming a value torchrun would not have used).
TEST(DdprunArgsTest, IgnoredFlagGivenTwiceGetsOneNoteForTheLast) {
  StatusOr<DdprunOptions> o =
      Parse({"--local_addr=10.0.0.1", "--numa_binding=node", "--local_addr=10.0.0.2", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes, (std::vector<std::string>{
                          "--numa_binding=node is ignored: ddprun leaves the workers' CPU and memory placement "
                          "to them",
                          "--local_addr=10.0.0.2 is ignored: launchers other than node 0 need no address of "
                          "their own (they connect to node 0's store)"}));
  // The last one is torchrun's default, which needs no note.
  o = Parse({"--signals_to_handle=SIGUSR1", "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->notes.empty()) << o->notes[0];
}

// HOST:PORT in --master_addr (one ':', so no IPv6 address) is refused naming
// the flag; it was taken for a host name, and the store then failed with
// "cannot resolve [127.0.0.1:29500]:29500", naming no flag.
TEST(DdprunArgsTest, MasterAddrWithAPortIsRefusedNamingIt) {
  const std::string why = ": the port goes in --master_port (an IPv6 address, which has two or more ':', "
                          "may stand bare or in brackets)";
  ExpectRefused({"--master_addr=127.0.0.1:29500", "p"}, "--master_addr=127.0.0.1:29500" + why);
  ExpectRefused({"--master_addr", "head:", "--master_port=1", "p"}, "--master_addr=head:" + why);
  ExpectRefused({"p"}, "PET_MASTER_ADDR='head:29500' (from the environment): --master_addr=head:29500" + why,
                {{"PET_MASTER_ADDR", "head:29500"}});
  StatusOr<DdprunOptions> o = Parse({"--master_addr=fe80::1", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "fe80::1");
}

// torchrun's --standalone is c10d on one node, where --node_rank means
// nothing: a node rank other than 0 is ignored with a note, as with c10d.
// It was refused as not below --nnodes=1.
TEST(DdprunArgsTest, StandaloneIgnoresTheNodeRankWithANote) {
  StatusOr<DdprunOptions> o = Parse({"--standalone", "--node_rank=1", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->node_rank, 0);
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--node_rank=1 is ignored with --standalone: it runs one node, node 0"});
  o = Parse({"--standalone", "--node_rank=0", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->notes.empty());
  // A node rank from the environment is named as such (the note said
  // --node_rank=1, which the command line did not give).
  o = Parse({"p"}, {{"PET_STANDALONE", "1"}, {"PET_NODE_RANK", "1"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "PET_NODE_RANK=1 is ignored with PET_STANDALONE: it runs one node, node 0"});
  o = Parse({"--node_rank=2", "p"}, {{"PET_STANDALONE", "1"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--node_rank=2 is ignored with PET_STANDALONE: it runs one node, node 0"});
  o = Parse({"p"}, {{"PET_NNODES", "2"}, {"PET_NODE_RANK", "1"}, {"PET_RDZV_BACKEND", "c10d"},
                    {"PET_RDZV_ENDPOINT", "h:1"}, {"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "PET_NODE_RANK=1 is ignored with --rdzv_backend=c10d: nodes are numbered as they join"});
  // Without --standalone it is still checked against --nnodes.
  ExpectRefused({"--node_rank=1", "p"}, "--node_rank=1 is not below --nnodes=1");
}

TEST(DdprunArgsTest, MonitorIntervalZeroIsAccepted) {
  StatusOr<DdprunOptions> o = Parse({"--monitor_interval=0", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->notes.empty());
}

// torchrun's other flags: those with a meaning here take effect, the rest
// are accepted with a note (printed when ddprun runs).
TEST(DdprunArgsTest, TorchrunsOtherFlagsAreAccepted) {
  StatusOr<DdprunOptions> o = Parse({"--monitor_interval=0.5", "--start_method", "fork", "--role=trainer",
                                     "--local-addr=10.0.0.2", "--logs_specs=mine", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->role, "trainer");
  EXPECT_EQ(o->command, std::vector<std::string>{"p"});
  EXPECT_EQ(o->notes, (std::vector<std::string>{
                          "--local_addr=10.0.0.2 is ignored: launchers other than node 0 need no "
                          "address of their own (they connect to node 0's store)",
                          "--logs_specs=mine is ignored: ddprun writes torchrun's default layout, "
                          "--log_dir/<rdzv_id>_<random>/attempt_K/LOCAL_RANK/stdout.log, stderr.log and "
                          "error.json"}));
  for (const char* method : {"spawn", "fork", "forkserver"}) {
    EXPECT_TRUE(Parse({std::string("--start_method=") + method, "p"}).ok()) << method;
  }
  o = Parse({"p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->role, "default");
  EXPECT_TRUE(o->notes.empty());
  EXPECT_EQ(o->store_call_time, 10000ms);
  EXPECT_FALSE(o->is_host.has_value());

  // --node_rank with c10d: ignored, as torchrun ignores it.
  o = Parse({"--nnodes=2", "--node_rank=1", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "p"},
            {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->node_rank, 0);
  EXPECT_TRUE(o->assign_node_rank);
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--node_rank=1 is ignored with --rdzv_backend=c10d: nodes are numbered as they join"});

  // rdzv_conf: timeout is the join timeout, read_timeout the deadline of a
  // store call, is_host whether a c10d launcher serves the store.
  o = Parse({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1",
             "--rdzv_conf=timeout=42,read_timeout=7,is_host=False,close_timeout=3", "p"},
            {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rdzv_timeout, 42000ms);
  EXPECT_EQ(o->store_call_time, 7000ms);
  EXPECT_EQ(o->is_host, std::optional<bool>(false));
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--rdzv_conf=close_timeout=3 is ignored: when the job ends, node 0 tells the "
                          "waiting launchers and keeps the store up for them for up to 10 s"});
  o = Parse({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "--rdzv_conf=is_host=1", "p"},
            {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->is_host, std::optional<bool>(true));
  // is_host means nothing where node 0 serves anyway.
  o = Parse({"--nnodes=2", "--node_rank=1", "--master_addr=h", "--rdzv_conf=is_host=yes", "p"},
            {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->is_host.has_value());
  EXPECT_EQ(o->notes, std::vector<std::string>{
                          "--rdzv_conf is_host=true is ignored: with --rdzv_backend=static node 0 serves the "
                          "store"});

  ExpectRefused({"--start_method=thread", "p"}, "--start_method=thread: expected spawn, fork or forkserver");
  ExpectRefused({"--monitor_interval=-1", "p"}, "--monitor_interval=-1 is not a number of seconds");
  ExpectRefused({"--monitor_interval=nan", "p"}, "--monitor_interval=nan is not a number of seconds");
  ExpectRefused({"--role=", "p"}, "--role= must be non-empty without spaces or '='");
  ExpectRefused({"--local_addr"}, "--local_addr needs a value");
  ExpectRefused({"--rdzv_conf=is_host=maybe", "p"},
                "--rdzv_conf=is_host=maybe: 'is_host=maybe': is_host takes true or false (1/0, yes/no)");
  ExpectRefused({"--rdzv_conf=read_timeout=0", "p"},
                "--rdzv_conf=read_timeout=0: 'read_timeout=0': read_timeout is not a positive number of "
                "seconds");
}

// torchrun's documented single-node line: --rdzv-endpoint=localhost:0, a
// free port. Several nodes must agree on the port, so there it is refused.
TEST(DdprunArgsTest, EndpointPortZeroMeansAFreePortOnOneNode) {
  StatusOr<DdprunOptions> o =
      Parse({"--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1", "--nproc-per-node=2", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "localhost");
  EXPECT_EQ(o->master_port, 0);
  EXPECT_EQ(o->nnodes, 1);
  o = Parse({"--rdzv_endpoint=[::1]:0", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_port, 0);
  const std::string several =
      "port 0 in --rdzv_endpoint (any free port) works on one node only (--nnodes=1): every node must "
      "know the port";
  ExpectRefused({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "p"}, several,
                {{"DDP_JOB_TOKEN", "t"}});
  ExpectRefused({"--nnodes=1:2", "--rdzv_backend=c10d", "--rdzv_endpoint=h:0", "p"}, several,
                {{"DDP_JOB_TOKEN", "t"}});
  ExpectRefused({"--nnodes=2", "--node_rank=1", "--rdzv_endpoint=h:0", "p"}, several, {{"DDP_JOB_TOKEN", "t"}});
}

// torchrun's -t CODE and -r CODE are --tee and --redirects (they used to be
// taken for the program "-t"); other short flags are refused by name.
TEST(DdprunArgsTest, TorchrunShortFlagsForTeeAndRedirects) {
  StatusOr<DdprunOptions> o = Parse({"--log_dir=/tmp/x", "-r", "3", "-t", "3", "./prog", "-t", "3"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tee.For(0), 3);
  EXPECT_EQ(o->redirects.For(0), 3);
  EXPECT_EQ(o->command, (std::vector<std::string>{"./prog", "-t", "3"}));
  o = Parse({"--log_dir=/tmp/x", "-r3", "-t3", "./prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tee.For(0), 3);
  EXPECT_EQ(o->command, std::vector<std::string>{"./prog"});
  o = Parse({"--log_dir=/tmp/x", "-t=0", "./prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tee.For(0), 0);
  EXPECT_EQ(o->redirects.For(0), 0);
  o = Parse({"--log_dir=/tmp/x", "-t", "./prog"});  // bare, as --tee: 3
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tee.For(0), 3);
  EXPECT_EQ(o->command, std::vector<std::string>{"./prog"});
  o = Parse({"--", "-t", "3"});  // after --, a program named -t
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->command, (std::vector<std::string>{"-t", "3"}));
  ExpectRefused({"-r", "p"}, "--redirects needs a value");
  // An empty value (--tee=$UNSET) is not a bare --tee: it teed both streams
  // of every rank into a temporary folder; torchrun refuses it.
  const std::string empty_tee = " is empty: give a code (0 to 3, or LOCAL_RANK:CODE,...), or --tee alone for 3";
  ExpectRefused({"--tee=", "p"}, "--tee=" + empty_tee);
  ExpectRefused({"-t=", "p"}, "--tee=" + empty_tee);
  ExpectRefused({"-x", "p"},
                "unknown flag -x (ddprun's short flags are torchrun's -t for --tee and -r for --redirects; "
                "see ddprun --help)");
}

// torchrun's codes for one stream (1 stdout, 2 stderr) and its per-rank
// maps (local ranks not named: 0; the last code of a rank named twice),
// which ddprun refused; a map's local rank beyond --nproc_per_node is
// passed over with a note, as torchrun passes over it.
TEST(DdprunArgsTest, TorchrunStreamCodesForOneStreamAndPerRankMaps) {
  StatusOr<DdprunOptions> o =
      Parse({"--nproc_per_node=3", "--log_dir=/tmp/x", "-t", "1", "-r", "0:2,1:3,1:1", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  for (int local = 0; local < 3; ++local) EXPECT_EQ(o->tee.For(local), 1) << local;
  EXPECT_EQ(o->redirects.For(0), 2);
  EXPECT_EQ(o->redirects.For(1), 1);
  EXPECT_EQ(o->redirects.For(2), 0);
  EXPECT_TRUE(o->notes.empty());
  o = Parse({"--nproc_per_node=2", "--tee=1:3,4:1", "--redirects=2", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tee.For(0), 0);
  EXPECT_EQ(o->tee.For(1), 3);
  EXPECT_EQ(o->redirects.For(1), 2);
  EXPECT_TRUE(o->temp_log_dir);
  EXPECT_EQ(o->notes, std::vector<std::string>{"--tee names local rank 4, which is ignored: --nproc_per_node=2 "
                                               "gives local ranks 0 to 1"});
  // From the environment too; a map that gives this node's ranks nothing
  // asks for no log folder.
  o = Parse({"--nproc_per_node=2", "p"}, {{"PET_TEE", "0:0,7:3"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tee.For(7), 3);
  EXPECT_FALSE(o->temp_log_dir);
  // Wider than torchrun's map, which takes one digit a local rank: ranks
  // of several digits, also as the next argument.
  o = Parse({"--nproc_per_node=12", "-r", "0:1,10:2,11:3", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->redirects.For(0), 1);
  EXPECT_EQ(o->redirects.For(1), 0);
  EXPECT_EQ(o->redirects.For(10), 2);
  EXPECT_EQ(o->redirects.For(11), 3);
  EXPECT_TRUE(o->notes.empty());
  EXPECT_EQ(o->command, std::vector<std::string>{"p"});
}

// torchrun takes --tee 3 and --redirects 3 without --log_dir (it logs into
// a tempfile.mkdtemp(prefix="torchelastic_") folder): torchtitan's and
// torchchat's launch lines, "--local-ranks-filter 0 --role rank --tee 3",
// were refused with "--tee needs --log_dir".
TEST(DdprunArgsTest, TeeOrRedirectsWithoutLogDirLogIntoATemporaryFolder) {
  StatusOr<DdprunOptions> o = Parse({"--nproc-per-node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
                                     "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "train"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tee.For(1), 3);
  EXPECT_TRUE(o->temp_log_dir);
  EXPECT_EQ(o->log_dir, "");
  EXPECT_EQ(o->command, std::vector<std::string>{"train"});
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"-t", "3", "p"}, {"--tee", "p"}, {"--redirects=3", "p"}, {"-r3", "p"}}) {
    o = Parse(args);
    ASSERT_TRUE(o.ok()) << o.status() << " " << args[0];
    EXPECT_TRUE(o->temp_log_dir) << args[0];
  }
  o = Parse({"--tee=3", "p"}, {{"PET_REDIRECTS", "3"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->temp_log_dir);
  // Nothing asked for logs, or a folder given: no temporary one.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"p"}, {"--tee=0", "--redirects=0", "p"}, {"--log_dir=/tmp/x", "--tee", "p"}}) {
    o = Parse(args);
    ASSERT_TRUE(o.ok()) << o.status() << " " << args[0];
    EXPECT_FALSE(o->temp_log_dir) << args[0];
  }
}

// Newer torchrun flags and rendezvous settings that mean nothing to ddprun
// are accepted with a note, as --logs_specs is; bad values are still refused.
TEST(DdprunArgsTest, NewerTorchrunFlagsAreAcceptedWithANote) {
  StatusOr<DdprunOptions> o =
      Parse({"--event-log-handler=console", "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1",
             "--rdzv-conf=use_libuv=False,store_connect_wait_seconds=5", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes,
            (std::vector<std::string>{
                "--event_log_handler=console is ignored: ddprun records no torchelastic events (its lines on "
                "stderr and the error files say what happened)",
                "--signals_to_handle=SIGTERM,SIGINT,SIGUSR1 is ignored: ddprun always forwards SIGTERM, "
                "SIGINT, SIGHUP and SIGQUIT to the workers and stops the job, and passes SIGUSR1 and SIGUSR2 "
                "on to them without stopping it",
                "--rdzv_conf=use_libuv=False is ignored: it sets PyTorch's TCPStore, and ddprun's launchers "
                "meet in a store of their own",
                "--rdzv_conf=store_connect_wait_seconds=5 is ignored: it sets PyTorch's TCPStore, and "
                "ddprun's launchers meet in a store of their own"}));
  // torchrun's defaults are what ddprun does: nothing to say.
  o = Parse({"--event_log_handler=null", "--signals_to_handle=SIGINT, SIGTERM,SIGHUP,SIGQUIT", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->notes.empty());
  o = Parse({"p"}, {{"PET_SIGNALS_TO_HANDLE", "SIGTERM"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes.size(), 1u);
  ExpectRefused({"--signals_to_handle=SIGTERM,SIGKILL", "p"},
                "--signals_to_handle=SIGTERM,SIGKILL: 'SIGKILL' is not one of SIGTERM, SIGINT, SIGHUP, SIGQUIT, "
                "SIGUSR1, SIGUSR2 (the signals ddprun passes on to the workers)");
  ExpectRefused({"--rdzv_conf=use_libuv=perhaps", "p"},
                "--rdzv_conf=use_libuv=perhaps: 'use_libuv=perhaps': use_libuv takes true or false (1/0, "
                "yes/no)");
  ExpectRefused({"--rdzv_conf=store_connect_wait_seconds=-1", "p"},
                "--rdzv_conf=store_connect_wait_seconds=-1: 'store_connect_wait_seconds=-1': "
                "store_connect_wait_seconds takes a whole number of seconds");
}

// torchrun's --numa-binding (2.8) is accepted with a note, its modes
// checked; it was an unknown flag.
TEST(DdprunArgsTest, NumaBindingIsAcceptedWithANote) {
  for (const char* mode : {"node", "socket", "exclusive", "core-complex"}) {
    StatusOr<DdprunOptions> o = Parse({"--numa-binding", mode, "p"});
    ASSERT_TRUE(o.ok()) << mode << ": " << o.status();
    EXPECT_EQ(o->notes, std::vector<std::string>{
                            "--numa_binding=" + std::string(mode) +
                            " is ignored: ddprun leaves the workers' CPU and memory placement to them"});
  }
  ExpectRefused({"--numa_binding=core", "p"},
                "--numa_binding=core: expected node, socket, exclusive or core-complex");
  // Unique starts still work around the new name.
  StatusOr<DdprunOptions> o = Parse({"--nu=node", "--npro=2", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nproc_per_node, 2);
}

// A note on a setting that a PET_ variable gave names the variable: it
// named the flag, which was on no command line.
TEST(DdprunArgsTest, NotesNameThePetVariableASettingCameFrom) {
  StatusOr<DdprunOptions> o = Parse({"--nproc_per_node=2", "p"}, {{"PET_TEE", "0:0,7:3"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes, std::vector<std::string>{"PET_TEE names local rank 7, which is ignored: --nproc_per_node=2 "
                                               "gives local ranks 0 to 1"});
  o = Parse({"-r", "5:1", "p"}, {{"PET_NPROC_PER_NODE", "2"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes, std::vector<std::string>{"--redirects names local rank 5, which is ignored: "
                                               "PET_NPROC_PER_NODE=2 gives local ranks 0 to 1"});
  o = Parse({"p"}, {{"PET_RDZV_CONF", "use_libuv=0,close_timeout=5,is_host=1"},
                    {"PET_LOCAL_ADDR", "10.0.0.2"},
                    {"PET_EVENT_LOG_HANDLER", "console"},
                    {"PET_SIGNALS_TO_HANDLE", "SIGTERM"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes,
            (std::vector<std::string>{
                "use_libuv=0 in PET_RDZV_CONF is ignored: it sets PyTorch's TCPStore, and ddprun's launchers "
                "meet in a store of their own",
                "close_timeout=5 in PET_RDZV_CONF is ignored: when the job ends, node 0 tells the waiting "
                "launchers and keeps the store up for them for up to 10 s",
                "PET_LOCAL_ADDR='10.0.0.2' is ignored: launchers other than node 0 need no address of their "
                "own (they connect to node 0's store)",
                "PET_EVENT_LOG_HANDLER='console' is ignored: ddprun records no torchelastic events (its lines "
                "on stderr and the error files say what happened)",
                "PET_SIGNALS_TO_HANDLE='SIGTERM' is ignored: ddprun always forwards SIGTERM, SIGINT, SIGHUP "
                "and SIGQUIT to the workers and stops the job",
                "PET_RDZV_CONF is_host=true is ignored: with --rdzv_backend=static node 0 serves the store"}));
  // The same settings on the command line are named as flags.
  o = Parse({"--rdzv_conf=use_libuv=0,is_host=1", "--local_addr=10.0.0.2", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->notes,
            (std::vector<std::string>{
                "--rdzv_conf=use_libuv=0 is ignored: it sets PyTorch's TCPStore, and ddprun's launchers meet "
                "in a store of their own",
                "--local_addr=10.0.0.2 is ignored: launchers other than node 0 need no address of their own "
                "(they connect to node 0's store)",
                "--rdzv_conf is_host=true is ignored: with --rdzv_backend=static node 0 serves the store"}));
}

// torchrun reads --master_port, --node_rank, --nnodes and --max_restarts
// with Python's int(), which takes a sign, whitespace around the number
// and single underscores between digits; they were refused as "not an
// integer". What int() refuses still is.
TEST(DdprunArgsTest, IntegerFlagsTakeWhatPythonsIntTakes) {
  StatusOr<DdprunOptions> o = Parse({"--master_port=29_500", "--nnodes= 2\n", "--node_rank=+1", "--master_addr=h",
                                     "--max_restarts=\t0_3 ", "p"},
                                    {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_port, 29500);
  EXPECT_EQ(o->nnodes, 2);
  EXPECT_EQ(o->node_rank, 1);
  EXPECT_EQ(o->max_restarts, 3);
  // Compared with node 0's as a value: it was the text, and a node that
  // spelled the same count otherwise was refused.
  EXPECT_EQ(o->nnodes_spec, "2");
  o = Parse({"--nnodes=+1: 1_0", "--node-rank=-0", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "p"},
            {{"DDP_JOB_TOKEN", "t"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->min_nodes, 1);
  EXPECT_EQ(o->nnodes, 10);
  EXPECT_EQ(o->nnodes_spec, "1:10");
  for (const std::string two : {"+2", "2:2", "0_2: +2"}) {
    o = Parse({"--nnodes=" + two, "--master_addr=h", "p"}, {{"DDP_JOB_TOKEN", "t"}});
    ASSERT_TRUE(o.ok()) << two << ": " << o.status();
    EXPECT_EQ(o->min_nodes, 0) << two;
    EXPECT_EQ(o->nnodes_spec, "2") << two;
  }
  o = Parse({"p"}, {{"PET_MASTER_PORT", " 1_234"}, {"PET_MAX_RESTARTS", "+2"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_port, 1234);
  EXPECT_EQ(o->max_restarts, 2);
  for (const std::string bad : {"1__0", "_1", "1_", "+", "-", " ", "+-1", "1 0", "0x10", "1.0", "1e3", "_"}) {
    ExpectRefused({"--master_port=" + bad, "p"}, "--master_port=" + bad + " is not an integer");
  }
  ExpectRefused({"--nnodes=1:_2", "p"}, "--nnodes=1:_2: expected MIN:MAX with 1 <= MIN <= MAX <= 65536");
  ExpectRefused({"--node_rank=1_", "p"}, "--node_rank=1_ is not an integer");
  ExpectRefused({"--max_restarts=- 1", "p"}, "--max_restarts=- 1 is not an integer");
  // Beyond int64 is out of range, not "not an integer".
  ExpectRefused({"--master_port=99_999_999_999_999_999_999", "p"},
                "--master_port=99_999_999_999_999_999_999 must be in [0, 65535]");
  ExpectRefused({"--max_restarts=-99999999999999999999", "p"},
                "--max_restarts=-99999999999999999999 must be in [0, 1000000]");
}

// torchrun reads its time values with int() (--shutdown_timeout,
// PET_SHUTDOWN_TIMEOUT, TORCH_ELASTIC_SHUTDOWN_TIMEOUT, --rdzv_conf's
// timeouts and store_connect_wait_seconds) and --monitor_interval with
// float(): a sign, underscores and spaces around were refused as "not a
// number of seconds". ddprun's fractions stay; negative values and those
// beyond the limit are refused naming the flag, variable or key.
TEST(DdprunArgsTest, TimeValuesTakeWhatTorchrunsIntAndFloatTake) {
  StatusOr<DdprunOptions> o =
      Parse({"--rdzv_conf=join_timeout=+900,read_timeout=6_0,last_call_timeout=\v2\f,keep_alive_interval=+1,"
             "close_timeout=0_1,store_connect_wait_seconds=+5",
             "--shutdown_timeout= 4\n", "--monitor_interval=1e-1", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rdzv_timeout, 900000ms);
  EXPECT_EQ(o->store_call_time, 60000ms);
  EXPECT_EQ(o->last_call, 2000ms);
  EXPECT_EQ(o->node_timeout, 3000ms);  // a beat every 1 s, dead after 3 missed
  EXPECT_EQ(o->grace, 4000ms);
  o = Parse({"p"}, {{"PET_SHUTDOWN_TIMEOUT", " 30"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->grace, 30000ms);
  o = Parse({"p"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "1_20"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->grace, 120000ms);
  o = Parse({"--grace_period=-0", "--node_timeout=\t2_5 ", "--max_run_time=+7", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->grace, 0ms);
  EXPECT_EQ(o->node_timeout, 25000ms);
  EXPECT_EQ(o->max_run_time, 7000ms);
  // The fractions, with spaces around them too.
  o = Parse({"--grace_period= 0.5\n", "--rdzv_conf=read_timeout=.25", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->grace, 500ms);
  EXPECT_EQ(o->store_call_time, 250ms);
  for (const std::string interval : {"+0.5", " 5\n", "1e-1", "1_0.5", "-0", "5.", ".5E+1_0", "0"}) {
    o = Parse({"--monitor_interval=" + interval, "p"});
    EXPECT_TRUE(o.ok()) << "'" << interval << "': " << o.status();
  }

  for (const std::string bad : {"0x10", "1__0", ".", "inf", "nan", "-1", "1e", "e1", "_1", "1_", "1e999", "- 1", ""}) {
    ExpectRefused({"--monitor_interval=" + bad, "p"}, "--monitor_interval=" + bad + " is not a number of seconds");
  }
  ExpectRefused({"--shutdown_timeout=-5", "p"}, "--shutdown_timeout=-5 is not a number of seconds");
  ExpectRefused({"--grace_period=1__0", "p"}, "--grace_period=1__0 is not a number of seconds");
  // How long an exec may take (SpawnOptions::exec_timeout): 60 s unless given.
  o = Parse({"p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->exec_timeout, 60000ms);
  o = Parse({"--exec_timeout=300", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->exec_timeout, 300000ms);
  ExpectRefused({"--exec_timeout=0", "p"}, "--exec_timeout=0 is not a positive number of seconds");
  ExpectRefused({"--rdzv_timeout=-0", "p"}, "--rdzv_timeout=-0 is not a positive number of seconds");
  ExpectRefused({"--rdzv_timeout=1_000_000_001", "p"}, "--rdzv_timeout=1_000_000_001 is more than 1000000000 seconds");
  ExpectRefused({"--node_timeout=99999999999999999999", "p"},
                "--node_timeout=99999999999999999999 is more than 1000000000 seconds");
  ExpectRefused({"--grace_period=1000000000.5", "p"}, "--grace_period=1000000000.5 is more than 1000000000 seconds");
  ExpectRefused({"p"}, "PET_SHUTDOWN_TIMEOUT='+-1' (from the environment): --shutdown_timeout=+-1 is not a number "
                "of seconds", {{"PET_SHUTDOWN_TIMEOUT", "+-1"}});
  ExpectRefused({"p"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='-1' (from the environment) is not a number of seconds",
                {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "-1"}});
  ExpectRefused({"p"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='2000000000' (from the environment) is more than 1000000000 "
                "seconds", {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "2000000000"}});
  ExpectRefused({"--rdzv_conf=join_timeout=-0", "p"},
                "--rdzv_conf=join_timeout=-0: 'join_timeout=-0': join_timeout is not a positive number of seconds");
  ExpectRefused({"--rdzv_conf=read_timeout=2_000_000_000", "p"},
                "--rdzv_conf=read_timeout=2_000_000_000: 'read_timeout=2_000_000_000': read_timeout is more than "
                "1000000000 seconds");
  ExpectRefused({"--rdzv_conf=last_call_timeout=-1", "p"},
                "--rdzv_conf=last_call_timeout=-1: 'last_call_timeout=-1': last_call_timeout is not a number of "
                "seconds");
  ExpectRefused({"--rdzv_conf=store_connect_wait_seconds=1__0", "p"},
                "--rdzv_conf=store_connect_wait_seconds=1__0: 'store_connect_wait_seconds=1__0': "
                "store_connect_wait_seconds takes a whole number of seconds");
}

// torchrun strips --rdzv_endpoint and takes an empty one for none, its
// default (the static backend then uses --master_addr and --master_port),
// as PET_RDZV_ENDPOINT='' was here already. An empty flag was refused as
// "no host", and spaces around it were kept in the host name.
TEST(DdprunArgsTest, EmptyRdzvEndpointIsNoneAndSpacesAroundItDoNotCount) {
  StatusOr<DdprunOptions> o = Parse({"--rdzv_endpoint=", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "127.0.0.1");
  EXPECT_EQ(o->master_port, 29500);
  EXPECT_TRUE(o->notes.empty());
  o = Parse({"--rdzv_endpoint", " \t", "--master_addr=m", "--master_port=7", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "m");
  EXPECT_EQ(o->master_port, 7);
  EXPECT_TRUE(o->notes.empty());  // nothing overridden
  // The last value wins: an empty one drops the one before it.
  o = Parse({"--rdzv_endpoint=e:1", "--rdzv_endpoint=", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "127.0.0.1");
  EXPECT_EQ(o->master_port, 29500);
  // c10d without an endpoint: localhost on its default port.
  o = Parse({"--rdzv_backend=c10d", "--rdzv_endpoint=", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "localhost");
  EXPECT_EQ(o->master_port, 29400);
  // The empty flag replaces PET_RDZV_ENDPOINT (the flag's default under
  // torchrun), not PET_MASTER_ADDR and PET_MASTER_PORT.
  o = Parse({"--rdzv_endpoint=", "p"},
            {{"PET_RDZV_ENDPOINT", "e:1"}, {"PET_MASTER_ADDR", "m"}, {"PET_MASTER_PORT", "7"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "m");
  EXPECT_EQ(o->master_port, 7);
  o = Parse({"p"}, {{"PET_RDZV_ENDPOINT", " \n"}, {"PET_MASTER_ADDR", "m"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "m");
  // Spaces around an endpoint do not count.
  o = Parse({"--rdzv_endpoint= h:1\n", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "h");
  EXPECT_EQ(o->master_port, 1);
  o = Parse({"--rdzv_endpoint=\t[::1]:5 ", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "::1");
  EXPECT_EQ(o->master_port, 5);
  o = Parse({"--rdzv_backend=c10d", "--rdzv_endpoint= h ", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "h");
  EXPECT_EQ(o->master_port, 29400);
  ExpectRefused({"--rdzv_endpoint= :1", "p"}, "--rdzv_endpoint= :1: no host");
  ExpectRefused({"p"}, "PET_RDZV_ENDPOINT=' h: ' (from the environment): --rdzv_endpoint= h: : empty port",
                {{"PET_RDZV_ENDPOINT", " h: "}});
}

// torchrun's --nproc_per_node is int() too before its words (gpu, cpu,
// auto): "+2" and "1_0" were refused as "not an integer, gpu, cpu or auto".
TEST(DdprunArgsTest, NprocPerNodeTakesWhatPythonsIntTakes) {
  StatusOr<DdprunOptions> o = Parse({"--nproc_per_node=+2", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nproc_per_node, 2);
  o = Parse({"--nproc-per-node", "1_0", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nproc_per_node, 10);
  o = Parse({"p"}, {{"PET_NPROC_PER_NODE", " 3\n"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nproc_per_node, 3);
  ExpectRefused({"--nproc_per_node=2__0", "p"}, "--nproc_per_node=2__0 is not an integer, gpu, cpu or auto");
  ExpectRefused({"--nproc_per_node=-1", "p"}, "--nproc_per_node=-1 must be in [1, 4096]");
  ExpectRefused({"p"}, "PET_NPROC_PER_NODE='+0' (from the environment): --nproc_per_node=+0 must be in [1, 4096]",
                {{"PET_NPROC_PER_NODE", "+0"}});
}

// torchrun's --logs_specs and --numa_binding have no `env` action: no
// PET_ variable sets them there, and none does here (a PET_LOGS_SPECS
// made a note that it was ignored).
TEST(DdprunArgsTest, FlagsWithoutAnEnvActionReadNoPetVariable) {
  StatusOr<DdprunOptions> o = Parse({"p"}, {{"PET_NUMA_BINDING", "node"}, {"PET_LOGS_SPECS", "mine"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->notes.empty()) << o->notes[0];
}

TEST(DdprunArgsTest, LocalRanksFilter) {
  StatusOr<DdprunOptions> o = Parse({"--nproc_per_node=4", "--local-ranks-filter", "2,0", "./prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->local_ranks_filter, (std::vector<int>{0, 2}));
  o = Parse({"--local_ranks_filter=1,1,0", "--nproc_per_node=2", "./prog"});  // order of flags free
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->local_ranks_filter, (std::vector<int>{0, 1}));
  EXPECT_TRUE(Parse({"./prog"})->local_ranks_filter.empty());
  // As torchrun's: an empty value is no filter (it was refused as "'' is
  // not a local rank"), also after an earlier one; spaces around a rank do
  // not count (Python's int() skips them).
  o = Parse({"--nproc_per_node=4", "--local_ranks_filter=0", "--local_ranks_filter", "", "./prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->local_ranks_filter.empty());
  EXPECT_EQ(o->command, std::vector<std::string>{"./prog"});
  o = Parse({"--nproc_per_node=4", "--local_ranks_filter=3, 1", "./prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->local_ranks_filter, (std::vector<int>{1, 3}));
  const std::string list = "' is not a local rank (a comma-separated list such as 0,1)";
  ExpectRefused({"--local_ranks_filter=0,", "p"}, "--local_ranks_filter=0,: '" + list);
  ExpectRefused({"--local_ranks_filter=a", "p"}, "--local_ranks_filter=a: 'a" + list);
  ExpectRefused({"--local_ranks_filter=-1", "p"}, "--local_ranks_filter=-1: '-1" + list);
  ExpectRefused({"--nproc_per_node=2", "--local_ranks_filter=0,2", "p"},
                "--local_ranks_filter names local rank 2, but --nproc_per_node=2 gives local ranks 0 to 1");
}

// torchrun reads --rdzv_conf's keep_alive_max_attempt with int()
// (get_as_int): "+4" and "1_0" were refused as no count.
TEST(DdprunArgsTest, KeepAliveMaxAttemptTakesWhatPythonsIntTakes) {
  StatusOr<DdprunOptions> o = Parse({"--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=+4", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->node_timeout, 4000ms);
  o = Parse({"p"}, {{"PET_RDZV_CONF", "keep_alive_interval=2, keep_alive_max_attempt=1_0"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->node_timeout, 20000ms);
  for (const std::string bad : {"1__0", "4.0", "0x4", "_4", "1_001"}) {
    ExpectRefused({"--rdzv_conf=keep_alive_max_attempt=" + bad, "p"},
                  "--rdzv_conf=keep_alive_max_attempt=" + bad + ": 'keep_alive_max_attempt=" + bad +
                      "': keep_alive_max_attempt takes a count from 1 to 1000");
  }
}

// torchrun reads each rank of --local_ranks_filter with int(): a sign and
// underscores between digits were refused as "not a local rank".
TEST(DdprunArgsTest, LocalRanksFilterTakesWhatPythonsIntTakes) {
  StatusOr<DdprunOptions> o = Parse({"--nproc_per_node=12", "--local_ranks_filter=+1,1_1, -0\n", "./prog"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->local_ranks_filter, (std::vector<int>{0, 1, 11}));
  const std::string list = "' is not a local rank (a comma-separated list such as 0,1)";
  ExpectRefused({"--local_ranks_filter=1__0", "p"}, "--local_ranks_filter=1__0: '1__0" + list);
  ExpectRefused({"--local_ranks_filter=0,_1", "p"}, "--local_ranks_filter=0,_1: '_1" + list);
  ExpectRefused({"--local_ranks_filter=0x1", "p"}, "--local_ranks_filter=0x1: '0x1" + list);
}

// torchrun reads a flag that is not on the command line from PET_<FLAG>
// (Kubeflow's PyTorchJob sets only these); the command line wins.
TEST(DdprunArgsTest, PetVariablesAreDefaultsForTorchrunFlags) {
  const EnvMap kubeflow = {{"PET_NNODES", "4"},         {"PET_NODE_RANK", "2"},
                           {"PET_MASTER_ADDR", "head"}, {"PET_MASTER_PORT", "23456"},
                           {"PET_NPROC_PER_NODE", "3"}, {"PET_MAX_RESTARTS", "5"},
                           {"PET_RDZV_ID", "job7"},     {"DDP_JOB_TOKEN", "t"}};
  StatusOr<DdprunOptions> o = Parse({"train"}, kubeflow);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nnodes, 4);
  EXPECT_EQ(o->node_rank, 2);
  EXPECT_EQ(o->master_addr, "head");
  EXPECT_EQ(o->master_port, 23456);
  EXPECT_EQ(o->nproc_per_node, 3);
  EXPECT_EQ(o->max_restarts, 5);
  EXPECT_EQ(o->rdzv_id, "job7");

  // The command line wins, in any spelling.
  o = Parse({"--nnodes", "2", "--node-rank=1", "--nproc_per_node=1", "train"}, kubeflow);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nnodes, 2);
  EXPECT_EQ(o->node_rank, 1);
  EXPECT_EQ(o->nproc_per_node, 1);
  EXPECT_EQ(o->master_addr, "head");

  // The endpoint, from either place, takes the place of PET_MASTER_ADDR and
  // PET_MASTER_PORT (as torchrun: the endpoint, when given, is used).
  EnvMap elastic = kubeflow;
  elastic["PET_RDZV_ENDPOINT"] = "rdzv:29400";
  elastic["PET_RDZV_BACKEND"] = "c10d";
  elastic["PET_NNODES"] = "2:4";
  o = Parse({"train"}, elastic);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "rdzv");
  EXPECT_EQ(o->master_port, 29400);
  EXPECT_EQ(o->rdzv_backend, "c10d");
  EXPECT_EQ(o->min_nodes, 2);
  EXPECT_EQ(o->nnodes, 4);
  o = Parse({"--rdzv_endpoint=other:1", "train"}, kubeflow);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "other");
  EXPECT_EQ(o->master_port, 1);
  // PET_RDZV_ENDPOINT is torchrun's default of --rdzv_endpoint, which
  // get_rdzv_endpoint prefers to --master_addr and --master_port with
  // either backend: the command line's --master_addr does not hold it back
  // (it did with the static backend, and such a node met elsewhere than
  // the torchrun nodes beside it).
  EnvMap endpoint_set = kubeflow;
  endpoint_set["PET_RDZV_ENDPOINT"] = "rdzv:29400";
  o = Parse({"--master_addr=mine", "--master_port=7", "train"}, endpoint_set);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rdzv_backend, "static");
  EXPECT_EQ(o->master_addr, "rdzv");
  EXPECT_EQ(o->master_port, 29400);
  EXPECT_THAT(o->notes, ::testing::Contains("--master_addr and --master_port are ignored: "
                                             "PET_RDZV_ENDPOINT='rdzv:29400' names the store, as under torchrun"));
  o = Parse({"--master_addr=mine", "train"}, elastic);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "rdzv");
  EXPECT_EQ(o->master_port, 29400);
  EXPECT_THAT(o->notes, ::testing::Contains("--master_addr is ignored: PET_RDZV_ENDPOINT='rdzv:29400' names the "
                                             "store, as under torchrun"));

  // torchrun's switches take 0 or 1 (and any integer: see below).
  o = Parse({"train"}, {{"PET_STANDALONE", "1"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->standalone);
  EXPECT_EQ(o->master_port, 0);
  o = Parse({"train"}, {{"PET_STANDALONE", "0"}, {"PET_NO_PYTHON", "1"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->standalone);
  // --standalone picks its own endpoint over the environment's.
  o = Parse({"--standalone", "train"}, {{"PET_MASTER_ADDR", "head"}, {"PET_RDZV_ENDPOINT", "h:1"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->master_addr, "127.0.0.1");
  // An empty variable counts as unset.
  o = Parse({"train"}, {{"PET_NNODES", ""}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nnodes, 1);
  // So does an empty switch, where torchrun's int('') fails.
  o = Parse({"train"}, {{"PET_STANDALONE", ""}, {"PET_VIRTUAL_LOCAL_RANK", ""}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->standalone);
  EXPECT_TRUE(o->virtual_devices.empty());
  // ddprun's own flags have no PET_ variable.
  o = Parse({"train"}, {{"PET_RDZV_TIMEOUT", "1"}, {"PET_GRACE_PERIOD", "1"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->grace, 30000ms);  // the default, torchrun's

  // A bad value names the variable.
  ExpectRefused({"train"}, "PET_NNODES='two' (from the environment): --nnodes=two is not an integer",
                {{"PET_NNODES", "two"}});
  ExpectRefused({"train"},
                "PET_STANDALONE='yes' (from the environment): expected an integer, as torchrun reads it "
                "(0: off, any other: on)",
                {{"PET_STANDALONE", "yes"}});
  ExpectRefused({"train"},
                "PET_RDZV_BACKEND='etcd' (from the environment): --rdzv_backend=etcd is not supported; use "
                "static or c10d",
                {{"PET_RDZV_BACKEND", "etcd"}});
  // So does one that only clashes with another setting.
  ExpectRefused({"train"},
                "--node_rank=4 is not below --nnodes=4 (taken from the environment: PET_NNODES='4', "
                "PET_NODE_RANK='4', PET_MASTER_ADDR='h')",
                {{"PET_NNODES", "4"}, {"PET_NODE_RANK", "4"}, {"PET_MASTER_ADDR", "h"}, {"DDP_JOB_TOKEN", "t"}});
}

// torchrun reads a PET_ switch as bool(int(value)): any integer Python's
// int() takes, nonzero for on. Only 0 and 1 were taken ("2" and "00" were
// refused); what int() refuses still is, naming the variable and value.
TEST(DdprunArgsTest, PetSwitchesTakeAnyIntegerAsTorchrun) {
  for (const char* on : {"1", "2", "-1", "+1", "007", "1_0", " 1", "1\n", "\t10 "}) {
    StatusOr<DdprunOptions> o = Parse({"train"}, {{"PET_STANDALONE", on}});
    ASSERT_TRUE(o.ok()) << "PET_STANDALONE='" << on << "': " << o.status();
    EXPECT_TRUE(o->standalone) << "PET_STANDALONE='" << on << "'";
    EXPECT_EQ(o->master_port, 0) << "PET_STANDALONE='" << on << "'";
  }
  for (const char* off : {"0", "00", "-0", "+0", "0_0", " 0 "}) {
    StatusOr<DdprunOptions> o = Parse({"train"}, {{"PET_STANDALONE", off}});
    ASSERT_TRUE(o.ok()) << "PET_STANDALONE='" << off << "': " << o.status();
    EXPECT_FALSE(o->standalone) << "PET_STANDALONE='" << off << "'";
  }
  // Every switch reads its value the same way.
  StatusOr<DdprunOptions> o = Parse({"--nproc_per_node=2", "train"}, {{"PET_VIRTUAL_LOCAL_RANK", "2"},
                                                                     {"PET_NO_PYTHON", "00"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->virtual_devices, (std::vector<std::string>{"0", "1"}));
  for (const char* bad : {"true", "yes", "on", "1.0", "0x1", "1e0", "_1", "1_", "1__0", "+", "1 0", "--1"}) {
    ExpectRefused({"train"},
                  std::string("PET_NO_PYTHON='") + bad +
                      "' (from the environment): expected an integer, as torchrun reads it (0: off, any other: on)",
                  {{"PET_NO_PYTHON", bad}});
  }
}

// torchrun's --shutdown_timeout is --grace_period; PET_SHUTDOWN_TIMEOUT and
// then TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torchrun's launcher reads it) stand
// in when neither flag is given. The flag was an unknown one, and both
// variables were ignored.
TEST(DdprunArgsTest, ShutdownTimeoutIsTheGracePeriod) {
  StatusOr<DdprunOptions> o = Parse({"--shutdown-timeout", "30", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->grace, 30000ms);
  o = Parse({"p"}, {{"PET_SHUTDOWN_TIMEOUT", "40"}, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "50"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->grace, 40000ms);
  o = Parse({"p"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "50"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->grace, 50000ms);
  // The command line wins, in either spelling.
  o = Parse({"--grace_period=2", "p"}, {{"PET_SHUTDOWN_TIMEOUT", "40"}, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "50"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->grace, 2000ms);
  ExpectRefused({"--shutdown_timeout=soon", "p"}, "--shutdown_timeout=soon is not a number of seconds");
  ExpectRefused({"p"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='30s' (from the environment) is not a number of seconds",
                {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30s"}});
}

// torchrun's --virtual_local_rank (and PET_VIRTUAL_LOCAL_RANK=1): one device
// per worker, from CUDA_VISIBLE_DEVICES when set. It was an unknown flag.
TEST(DdprunArgsTest, VirtualLocalRankTakesOneDeviceEach) {
  StatusOr<DdprunOptions> o = Parse({"--nproc_per_node=3", "--virtual_local_rank", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->virtual_devices, (std::vector<std::string>{"0", "1", "2"}));
  o = Parse({"--nproc_per_node=2", "p"}, {{"PET_VIRTUAL_LOCAL_RANK", "1"}, {"CUDA_VISIBLE_DEVICES", "GPU-a, GPU-b,2"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->virtual_devices, (std::vector<std::string>{"GPU-a", "GPU-b"}));
  o = Parse({"--nproc_per_node=2", "p"}, {{"CUDA_VISIBLE_DEVICES", "1"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->virtual_devices.empty());
  ExpectRefused({"--nproc_per_node=2", "--virtual_local_rank", "p"},
                "--virtual_local_rank: CUDA_VISIBLE_DEVICES='0,,1' has an empty entry (each worker is given one "
                "device of it)",
                {{"CUDA_VISIBLE_DEVICES", "0,,1"}});
  ExpectRefused({"--nproc_per_node=2", "--virtual_local_rank", "p"},
                "--virtual_local_rank gives each worker one device of CUDA_VISIBLE_DEVICES='', which names 0, "
                "fewer than --nproc_per_node=2",
                {{"CUDA_VISIBLE_DEVICES", ""}});
  ExpectRefused({"--virtual_local_rank=1", "p"}, "--virtual_local_rank takes no value");
}

// Spaces around --rdzv_conf's keys and values do not count, as under
// torchrun; they made the key unknown.
TEST(DdprunArgsTest, RdzvConfTakesSpacesAroundItsItems) {
  StatusOr<DdprunOptions> o = Parse({"--rdzv_conf= join_timeout =900, read_timeout= 5 ,last_call_timeout=\t2", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rdzv_timeout, 900000ms);
  EXPECT_EQ(o->store_call_time, 5000ms);
  EXPECT_EQ(o->last_call, 2000ms);
  ExpectRefused({"--rdzv_conf=read_timeout= ", "p"},
                "--rdzv_conf=read_timeout= : 'read_timeout= ': read_timeout is not a positive number of seconds");
}

// Seconds are digits with an optional fraction; a positive value too small
// for a millisecond counts as one rather than as zero.
TEST(DdprunArgsTest, SecondsAreDigitsWithAnOptionalFraction) {
  StatusOr<DdprunOptions> o =
      Parse({"--rdzv_timeout=0.0004", "--node_timeout=.25", "--grace_period=3.", "--max_run_time=0.0015", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rdzv_timeout, 1ms);
  EXPECT_EQ(o->node_timeout, 250ms);
  EXPECT_EQ(o->grace, 3000ms);
  EXPECT_EQ(o->max_run_time, 2ms);
  o = Parse({"--grace_period=0.000", "--rdzv_conf=last_call_timeout=0.0001", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->grace, 0ms);
  EXPECT_EQ(o->last_call, 1ms);
  // (Integers take what Python's int() does: see TimeValuesTakeWhatTorchrunsIntAndFloatTake.)
  for (const std::string bad : {"0x10", "1e2", "-1", "+0.5", "1_0.5", "inf", "nan", ".", "1.2.3", "5s", ""}) {
    ExpectRefused({"--grace_period=" + bad, "p"}, "--grace_period=" + bad + " is not a number of seconds");
  }
  ExpectRefused({"--rdzv_timeout=0.0", "p"}, "--rdzv_timeout=0.0 is not a positive number of seconds");
  ExpectRefused({"--rdzv_conf=join_timeout=1e3", "p"},
                "--rdzv_conf=join_timeout=1e3: 'join_timeout=1e3': join_timeout is not a positive number of "
                "seconds");
}

// A flag's value given as the next argument is not another flag.
TEST(DdprunArgsTest, NextFlagIsNotAValue) {
  ExpectRefused({"--log_dir", "--tee", "p"},
                "--log_dir needs a value, not the flag '--tee' after it (a value that starts with -- is "
                "given as --log_dir=VALUE)");
  ExpectRefused({"--master_addr", "--nnodes=2", "p"},
                "--master_addr needs a value, not the flag '--nnodes=2' after it (a value that starts with "
                "-- is given as --master_addr=VALUE)");
  ExpectRefused({"--rdzv_timeout", "--", "p"},
                "--rdzv_timeout needs a value, not the flag '--' after it (a value that starts with -- is "
                "given as --rdzv_timeout=VALUE)");
  StatusOr<DdprunOptions> o = Parse({"--log_dir=--odd", "--role", "-x", "p"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->log_dir, "--odd");
  EXPECT_EQ(o->role, "-x");
}

TEST(DdprunArgsTest, BadInputIsRefusedWithOneLine) {
  ExpectRefused({"--nproc_per_node=0", "p"}, "--nproc_per_node=0 must be in [1, 4096]");
  ExpectRefused({"--nproc_per_node=x", "p"}, "--nproc_per_node=x is not an integer, gpu, cpu or auto");
  ExpectRefused({"--nproc_per_node"}, "--nproc_per_node needs a value");
  ExpectRefused({"--nnodes=2", "--node_rank=2", "--master_addr=h", "p"},
                "--node_rank=2 is not below --nnodes=2");
  ExpectRefused({"--nnodes=2", "p"},
                "--master_addr (or --rdzv_endpoint) is required with --nnodes=2 (the address of "
                "node 0, where the store listens)");
  ExpectRefused({"--nnodes=2", "--master_addr=h", "p"},
                "several nodes need a shared job token: set DDP_JOB_TOKEN (or --job_token) to "
                "the same secret on every node");
  ExpectRefused({"--nnodes=2", "--master_addr=h", "--master_port=0", "p"},
                "--master_port=0 (any free port) works on one node only (--nnodes=1): every node "
                "must know the port",
                {{"DDP_JOB_TOKEN", "t"}});
  ExpectRefused({"--nnodes=1:4", "--master_addr=h", "p"},
                "--nnodes=1:4: a range of nodes needs --rdzv_backend=c10d (nodes numbered as they join)",
                {{"DDP_JOB_TOKEN", "t"}});
  ExpectRefused({"--nnodes=0", "p"}, "--nnodes=0 must be in [1, 65536]");
  ExpectRefused({"--standalone", "--nnodes=2", "p"},
                "--standalone runs one node; it cannot be combined with --nnodes=2");
  ExpectRefused({"--master_port=65536", "p"}, "--master_port=65536 must be in [0, 65535]");
  ExpectRefused({"--max_restarts=-1", "p"}, "--max_restarts=-1 must be in [0, 1000000]");
  ExpectRefused({"--node_timeout=0", "p"}, "--node_timeout=0 is not a positive number of seconds");
  ExpectRefused({"--grace_period=soon", "p"}, "--grace_period=soon is not a number of seconds");
  auto codes = [](const std::string& flag, const std::string& item) {
    return flag + ": '" + item +
           "' is not one of torchrun's stream codes 0 (none), 1 (stdout), 2 (stderr), 3 (both), nor "
           "LOCAL_RANK:CODE,... (e.g. 0:3,1:2)";
  };
  ExpectRefused({"--tee=yes", "p"}, codes("--tee=yes", "yes"));
  ExpectRefused({"--log_dir=/tmp/x", "--redirects=4", "p"}, codes("--redirects=4", "4"));
  ExpectRefused({"--log_dir=/tmp/x", "--tee=03", "p"}, codes("--tee=03", "03"));
  ExpectRefused({"--log_dir=/tmp/x", "--tee=0:1,1:", "p"}, codes("--tee=0:1,1:", "1:"));
  ExpectRefused({"--tee=0:1,", "p"}, codes("--tee=0:1,", ""));
  ExpectRefused({"--tee=0:1:2", "p"}, codes("--tee=0:1:2", "0:1:2"));
  ExpectRefused({"--tee=a:1", "p"}, codes("--tee=a:1", "a:1"));
  // Also given as the next argument, which was taken for the program.
  ExpectRefused({"--log_dir=/tmp/x", "--tee", "0:1,1:5", "p"}, codes("--tee=0:1,1:5", "1:5"));
  ExpectRefused({"-r", "9", "p"}, codes("--redirects=9", "9"));
  ExpectRefused({"--frobnicate", "p"}, "unknown flag --frobnicate (see ddprun --help)");
  ExpectRefused({"--nproc_per_node=2"}, "no program given: ddprun [flags] [--] PROGRAM [ARGS...]");
  ExpectRefused({"--job_token=" + std::string(300, 't'), "p"},
                "the job token is 300 bytes long, more than the limit of 256");
}

}  // namespace
}  // namespace ddp::transport::launch
