#include "transport/launch/env.h"
#include "transport/topology/cpus.h"

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include <gtest/gtest.h>

namespace ddp::transport::launch {
namespace {


// Asserts that `env` is refused with INVALID_ARGUMENT and exactly `message`.
void ExpectInvalid(const EnvMap& env, const std::string& message) {
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(env);
  ASSERT_FALSE(parsed.ok()) << "accepted: " << parsed->ToString();
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parsed.status().message(), message);
}

TEST(ParseLaunchEnvTest, TorchrunVariables) {
  EnvMap env = {{"RANK", "5"},           {"WORLD_SIZE", "8"},         {"LOCAL_RANK", "1"},
                {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"},         {"MASTER_ADDR", "10.1.2.3"},
                {"MASTER_PORT", "1234"},   {"DDP_RESTART_COUNT", "2"}, {"DDP_JOB_TOKEN", "s3cret"},
                {"DDP_STORE_HOST", "launcher"}};
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->rank, 5);
  EXPECT_EQ(parsed->world_size, 8);
  EXPECT_EQ(parsed->local_rank, 1);
  EXPECT_EQ(parsed->local_world_size, 4);
  EXPECT_EQ(parsed->group_rank, 1);
  EXPECT_EQ(parsed->master_addr, "10.1.2.3");
  EXPECT_EQ(parsed->master_port, 1234);
  EXPECT_EQ(parsed->restart_count, 2);
  EXPECT_EQ(parsed->job_token, "s3cret");
  EXPECT_TRUE(parsed->store_hosted_by_launcher);
  EXPECT_FALSE(parsed->hosts_store());
  EXPECT_TRUE(parsed->multi_node());
  EXPECT_EQ(parsed->source, LaunchSource::kTorchrun);
  EXPECT_EQ(parsed->StoreKeyPrefix(), "r2/");
}

// Under torchrun: its restart count and rendezvous id, unless ddprun's own
// variables say otherwise; torchrun's default id "none" is no id.
TEST(ParseLaunchEnvTest, TorchrunRestartCountAndRunId) {
  EnvMap env = {{"RANK", "0"},
                {"WORLD_SIZE", "2"},
                {"TORCHELASTIC_RESTART_COUNT", "3"},
                {"TORCHELASTIC_RUN_ID", "job-7"}};
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->restart_count, 3);
  EXPECT_EQ(parsed->run_id, "job-7");
  EXPECT_EQ(parsed->StoreKeyPrefix(), "r3/");

  env["DDP_RESTART_COUNT"] = "1";
  env["DDP_RUN_ID"] = "0123abcd";
  parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->restart_count, 1);
  EXPECT_EQ(parsed->run_id, "0123abcd");

  parsed = ParseLaunchEnv({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "none"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->run_id, "");
  EXPECT_EQ(parsed->restart_count, 0);

  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"TORCHELASTIC_RESTART_COUNT", "x"}},
                "TORCHELASTIC_RESTART_COUNT=x is not an integer");
}

TEST(ParseLaunchEnvTest, DefaultsForOneNode) {
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv({{"RANK", "0"}, {"WORLD_SIZE", "3"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->local_rank, 0);
  EXPECT_EQ(parsed->local_world_size, 3);
  EXPECT_EQ(parsed->group_rank, 0);
  EXPECT_EQ(parsed->master_addr, "127.0.0.1");
  EXPECT_EQ(parsed->master_port, kDefaultMasterPort);
  EXPECT_EQ(parsed->restart_count, 0);
  EXPECT_EQ(parsed->job_token, "");
  EXPECT_FALSE(parsed->store_hosted_by_launcher);
  EXPECT_TRUE(parsed->hosts_store());
}

TEST(ParseLaunchEnvTest, RoundTripsThroughToEnvironment) {
  LaunchEnv env;
  env.rank = 3;
  env.world_size = 4;
  env.local_rank = 1;
  env.local_world_size = 2;
  env.group_rank = 1;
  env.master_addr = "node7";
  env.master_port = 40000;
  env.restart_count = 1;
  env.job_token = "abc";
  env.run_id = "run-9";
  env.store_hosted_by_launcher = true;
  EnvMap map;
  for (auto& [name, value] : ToEnvironment(env)) map[name] = value;
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(map);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->ToString(), env.ToString());
  EXPECT_EQ(parsed->job_token, "abc");
  EXPECT_EQ(parsed->run_id, "run-9");
  // A launcher may point MASTER_PORT elsewhere: the store stays where it is.
  map["MASTER_PORT"] = "41000";
  map["MASTER_ADDR"] = "elsewhere";
  parsed = ParseLaunchEnv(map);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->ToString(), env.ToString());
}

// DDP_STORE_ADDR and DDP_STORE_PORT place the store away from MASTER_ADDR and
// MASTER_PORT, which a launcher leaves to a PyTorch program.
TEST(ParseLaunchEnvTest, StoreAddressWinsOverMasterAddress) {
  StatusOr<LaunchEnv> parsed =
      ParseLaunchEnv({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"},
                      {"MASTER_PORT", "29500"}, {"DDP_STORE_ADDR", "10.0.0.1"}, {"DDP_STORE_PORT", "40001"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->master_addr, "10.0.0.1");
  EXPECT_EQ(parsed->master_port, 40001);
  // Without MASTER_ADDR, the store's address is enough across nodes.
  parsed = ParseLaunchEnv({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"},
                           {"DDP_STORE_ADDR", "10.0.0.1"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->master_addr, "10.0.0.1");
  EXPECT_EQ(parsed->master_port, kDefaultMasterPort);
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"DDP_STORE_PORT", "0"}},
                "DDP_STORE_PORT=0 is out of range [1, 65535]");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"DDP_STORE_ADDR", ""}}, "DDP_STORE_ADDR is set but empty");
}

// torchrun's agent serving MASTER_PORT itself: rank 0 serves the store on the
// next port, unless DDP_STORE_PORT says where or a launcher serves it.
TEST(ParseLaunchEnvTest, TorchrunAgentStoreMovesTheStoreToTheNextPort) {
  EnvMap env = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"},
                {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->master_port, 29501);
  EXPECT_TRUE(parsed->store_port_beside_torch_agent);
  EXPECT_TRUE(parsed->hosts_store());
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->master_port, 29500);
  EXPECT_FALSE(parsed->store_port_beside_torch_agent);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["DDP_STORE_PORT"] = "31000";
  parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->master_port, 31000);
  EXPECT_FALSE(parsed->store_port_beside_torch_agent);
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "65535"},
                 {"TORCHELASTIC_USE_AGENT_STORE", "True"}},
                "torchrun's agent serves MASTER_PORT=65535 (TORCHELASTIC_USE_AGENT_STORE=True) and there is "
                "no port after it for this job's store: set DDP_STORE_PORT to a free port on MASTER_ADDR");
}

TEST(ParseLaunchEnvTest, NoVariablesIsNotFound) {
  EXPECT_FALSE(HasLaunchVariables({{"PATH", "/bin"}}));
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv({{"PATH", "/bin"}});
  EXPECT_EQ(parsed.status().code(), StatusCode::kNotFound);
}

TEST(ParseLaunchEnvTest, RankNotBelowWorldSize) {
  ExpectInvalid({{"RANK", "4"}, {"WORLD_SIZE", "4"}}, "RANK=4 is not below WORLD_SIZE=4");
}

TEST(ParseLaunchEnvTest, NonNumericRank) {
  ExpectInvalid({{"RANK", "one"}, {"WORLD_SIZE", "4"}}, "RANK=one is not an integer");
  ExpectInvalid({{"RANK", "1x"}, {"WORLD_SIZE", "4"}}, "RANK=1x is not an integer");
  ExpectInvalid({{"RANK", ""}, {"WORLD_SIZE", "4"}}, "RANK= is not an integer");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "99999999999999999999"}},
                "WORLD_SIZE=99999999999999999999 is not an integer");
}

TEST(ParseLaunchEnvTest, NegativeAndZeroSizes) {
  ExpectInvalid({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}, "RANK=-1 is out of range [0, 2147483647]");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0 is out of range [1, 2147483647]");
}

TEST(ParseLaunchEnvTest, OnlyOneOfRankAndWorldSize) {
  ExpectInvalid({{"RANK", "0"}}, "RANK=0 is set but WORLD_SIZE is not");
  ExpectInvalid({{"WORLD_SIZE", "2"}}, "WORLD_SIZE=2 is set but RANK is not");
}

TEST(ParseLaunchEnvTest, LocalRankNotBelowLocalWorldSize) {
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"},
                 {"MASTER_ADDR", "h"}},
                "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}},
                "LOCAL_WORLD_SIZE=3 is larger than WORLD_SIZE=2");
}

// LOCAL_WORLD_SIZE without LOCAL_RANK: the rank within its node, ranks laid
// out node by node as torchrun does (it took RANK, which is past
// LOCAL_WORLD_SIZE on every node but the first: "LOCAL_RANK=5 is not below
// LOCAL_WORLD_SIZE=4", naming a variable nobody set).
TEST(ParseLaunchEnvTest, LocalRankWithoutTheVariableIsTheRankWithinItsNode) {
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(
      {{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "node0"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->local_rank, 1);
  EXPECT_EQ(parsed->local_world_size, 4);
  parsed = ParseLaunchEnv({{"RANK", "3"}, {"WORLD_SIZE", "4"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->local_rank, 3);
  EXPECT_EQ(parsed->local_world_size, 4);
  EXPECT_EQ(parsed->group_rank, 0);
}

// Without GROUP_RANK, the node's index follows the same layout: RANK=5 of
// 8, four to a node, is on node 1 (it said node 0, while LOCAL_RANK, from
// the same layout, said rank 1 of node 1). GROUP_RANK, when set, wins.
TEST(ParseLaunchEnvTest, GroupRankWithoutTheVariableIsTheNodeOfTheRank) {
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(
      {{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "node0"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->group_rank, 1);
  parsed = ParseLaunchEnv({{"RANK", "7"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                           {"MASTER_ADDR", "node0"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->local_rank, 1);
  EXPECT_EQ(parsed->group_rank, 3);
  parsed = ParseLaunchEnv({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "0"},
                           {"MASTER_ADDR", "node0"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->group_rank, 0);
}

// A GROUP_RANK that no node of the job can have is refused by name: every
// node holds at least one rank, so 8 ranks, 4 of them here, leave room for
// nodes 0..4; a job of one node has node 0 only.
TEST(ParseLaunchEnvTest, GroupRankBeyondTheJobsNodesIsRefused) {
  ExpectInvalid({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "5"},
                 {"MASTER_ADDR", "node0"}},
                "GROUP_RANK=5 is out of range: WORLD_SIZE=8 with LOCAL_WORLD_SIZE=4 on this node leaves "
                "room for node indices 0..4");
  ExpectInvalid({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"}},
                "GROUP_RANK=1 is out of range: WORLD_SIZE=2 with LOCAL_WORLD_SIZE=2 on this node leaves "
                "room for node indices 0..0");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"GROUP_RANK", "2147483647"}},
                "GROUP_RANK=2147483647 is out of range: WORLD_SIZE=2 with LOCAL_WORLD_SIZE unset (every rank on "
                "this node) leaves room for node indices 0..0");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"GROUP_RANK", "-1"}},
                "GROUP_RANK=-1 is out of range [0, 2147483647]");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"GROUP_RANK", "one"}}, "GROUP_RANK=one is not an integer");
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv({{"RANK", "7"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"},
                                               {"GROUP_RANK", "4"}, {"MASTER_ADDR", "node0"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->group_rank, 4);
}

TEST(ParseLaunchEnvTest, MissingMasterAddrAcrossNodes) {
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}},
                "MASTER_ADDR is not set but WORLD_SIZE=4 spans more than one node "
                "(LOCAL_WORLD_SIZE=2): set MASTER_ADDR to the host of the store");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", ""}},
                "MASTER_ADDR is set but empty");
}

TEST(ParseLaunchEnvTest, PortOutOfRange) {
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "65536"}},
                "MASTER_PORT=65536 is out of range [1, 65535]");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "0"}},
                "MASTER_PORT=0 is out of range [1, 65535]");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "http"}},
                "MASTER_PORT=http is not an integer");
}

TEST(ParseLaunchEnvTest, BadStoreHostAndRestartCountAndToken) {
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"DDP_STORE_HOST", "rank1"}},
                "DDP_STORE_HOST=rank1 is neither `launcher` nor `rank0`");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"DDP_RESTART_COUNT", "-2"}},
                "DDP_RESTART_COUNT=-2 is out of range [0, 2147483647]");
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"DDP_JOB_TOKEN", std::string(300, 'x')}},
                "DDP_JOB_TOKEN is 300 bytes long, more than the limit of 256");
}

EnvMap SlurmStep() {
  return {{"SLURM_PROCID", "5"},          {"SLURM_NTASKS", "6"},
          {"SLURM_STEP_ID", "0"},         {"SLURM_LOCALID", "1"},
          {"SLURM_NODEID", "2"},          {"SLURM_TASKS_PER_NODE", "2(x2),2"},
          {"SLURM_JOB_ID", "123456"},     {"SLURM_JOB_NODELIST", "gpu[07-09],cpu1"}};
}

TEST(ParseLaunchEnvTest, SlurmStep) {
  EnvMap env = SlurmStep();
  ASSERT_TRUE(HasLaunchVariables(env));
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->source, LaunchSource::kSlurm);
  EXPECT_EQ(parsed->rank, 5);
  EXPECT_EQ(parsed->world_size, 6);
  EXPECT_EQ(parsed->local_rank, 1);
  EXPECT_EQ(parsed->local_world_size, 2);
  EXPECT_EQ(parsed->group_rank, 2);
  EXPECT_EQ(parsed->master_addr, "gpu07");
  EXPECT_EQ(parsed->master_port, SlurmMasterPort(123456, 0));
  // Another step of the allocation, running at once: another port, and
  // every port below the ephemeral range.
  env["SLURM_STEP_ID"] = "1";
  parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->master_port, SlurmMasterPort(123456, 1));
  EXPECT_NE(SlurmMasterPort(123456, 1), SlurmMasterPort(123456, 0));
  for (int job : {0, 1, 19999, 123456, 2147483647}) {
    for (int step : {0, 1, 2147483647}) {
      EXPECT_GE(SlurmMasterPort(job, step), 20000);
      EXPECT_LT(SlurmMasterPort(job, step), 32768);
    }
  }
}

TEST(ParseLaunchEnvTest, SlurmPrefersStepNodelistAndExplicitOverrides) {
  EnvMap env = SlurmStep();
  env["SLURM_STEP_NODELIST"] = "gpu[08-09]";
  env["SLURM_NTASKS_PER_NODE"] = "3";
  env["SLURM_NTASKS"] = "9";
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->master_addr, "gpu08");
  EXPECT_EQ(parsed->local_world_size, 3);

  env["MASTER_ADDR"] = "login1";
  env["MASTER_PORT"] = "4000";
  env["LOCAL_RANK"] = "0";
  parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->master_addr, "login1");
  EXPECT_EQ(parsed->master_port, 4000);
  EXPECT_EQ(parsed->local_rank, 0);
}

// sbatch --ntasks-per-node=4 exports SLURM_NTASKS_PER_NODE=4 to every step;
// a step run with another layout (srun --ntasks-per-node=1) says its own in
// SLURM_STEP_TASKS_PER_NODE, which wins.
TEST(ParseLaunchEnvTest, SlurmStepLayoutWinsOverTheJobs) {
  EnvMap env = SlurmStep();
  env["SLURM_NTASKS_PER_NODE"] = "4";
  env["SLURM_NTASKS"] = "3";
  env["SLURM_PROCID"] = "2";
  env["SLURM_LOCALID"] = "0";
  env["SLURM_STEP_TASKS_PER_NODE"] = "1(x3)";
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->local_world_size, 1);
  EXPECT_EQ(parsed->world_size, 3);
}

// Slurm's layout variables are named when they disagree with the task id.
TEST(ParseLaunchEnvTest, SlurmLayoutErrorsNameTheVariableUsed) {
  EnvMap env = SlurmStep();
  env["SLURM_LOCALID"] = "3";
  ExpectInvalid(env, "SLURM_LOCALID=3 is not below SLURM_TASKS_PER_NODE=2");
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x3)";
  ExpectInvalid(env, "SLURM_LOCALID=3 is not below SLURM_STEP_TASKS_PER_NODE=2");
}

TEST(ParseLaunchEnvTest, SlurmBatchScriptIsNotARank) {
  EnvMap env = SlurmStep();
  env.erase("SLURM_STEP_ID");
  EXPECT_FALSE(HasLaunchVariables(env));
  EXPECT_EQ(ParseLaunchEnv(env).status().code(), StatusCode::kNotFound);
}

TEST(ParseLaunchEnvTest, TorchrunVariablesWinOverSlurm) {
  EnvMap env = SlurmStep();
  env["RANK"] = "1";
  env["WORLD_SIZE"] = "2";
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->source, LaunchSource::kTorchrun);
  EXPECT_EQ(parsed->rank, 1);
  EXPECT_EQ(parsed->world_size, 2);
  EXPECT_EQ(parsed->master_addr, "127.0.0.1");
  EXPECT_EQ(parsed->master_port, kDefaultMasterPort);
}

TEST(ParseLaunchEnvTest, SlurmErrorsNameTheVariable) {
  EnvMap env = SlurmStep();
  env["SLURM_PROCID"] = "6";
  ExpectInvalid(env, "SLURM_PROCID=6 is not below SLURM_NTASKS=6");
  env = SlurmStep();
  env["SLURM_TASKS_PER_NODE"] = "2(x2";
  ExpectInvalid(env, "SLURM_TASKS_PER_NODE=2(x2 has a malformed repeat `2(x2`");
  env = SlurmStep();
  env["SLURM_TASKS_PER_NODE"] = "2(x2)";
  ExpectInvalid(env, "SLURM_TASKS_PER_NODE=2(x2) has no entry for SLURM_NODEID=2");
  env = SlurmStep();
  env["SLURM_JOB_NODELIST"] = "gpu[07-09";
  ExpectInvalid(env, "SLURM_JOB_NODELIST=gpu[07-09 has a `[` without a matching `]`");
  env = SlurmStep();
  env.erase("SLURM_JOB_NODELIST");
  ExpectInvalid(env,
                "MASTER_ADDR is not set but SLURM_NTASKS=6 spans more than one node "
                "(SLURM_TASKS_PER_NODE=2): set MASTER_ADDR to the host of the store");
  env = SlurmStep();
  env.erase("SLURM_TASKS_PER_NODE");
  ExpectInvalid(env,
                "SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE are not set: cannot tell how many "
                "tasks share this node (set LOCAL_WORLD_SIZE)");
}

TEST(ParseLaunchEnvTest, OpenMpi) {
  EnvMap env = {{"OMPI_COMM_WORLD_RANK", "3"},
                {"OMPI_COMM_WORLD_SIZE", "4"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                {"MASTER_ADDR", "head"}};
  ASSERT_TRUE(HasLaunchVariables(env));
  StatusOr<LaunchEnv> parsed = ParseLaunchEnv(env);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->source, LaunchSource::kOpenMpi);
  EXPECT_EQ(parsed->rank, 3);
  EXPECT_EQ(parsed->world_size, 4);
  EXPECT_EQ(parsed->local_rank, 1);
  EXPECT_EQ(parsed->local_world_size, 2);
  EXPECT_EQ(parsed->group_rank, 1);
  EXPECT_EQ(parsed->master_addr, "head");
  EXPECT_EQ(parsed->master_port, kDefaultMasterPort);

  env.erase("MASTER_ADDR");
  ExpectInvalid(env,
                "MASTER_ADDR is not set but OMPI_COMM_WORLD_SIZE=4 spans more than one node "
                "(OMPI_COMM_WORLD_LOCAL_SIZE=2): set MASTER_ADDR to the host of the store");
  env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "4";
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "4";
  ExpectInvalid(env, "OMPI_COMM_WORLD_LOCAL_RANK=4 is not below OMPI_COMM_WORLD_LOCAL_SIZE=4");
  env["OMPI_COMM_WORLD_RANK"] = "x";
  ExpectInvalid(env, "OMPI_COMM_WORLD_RANK=x is not an integer");
}

TEST(SlurmNodelistTest, FirstHost) {
  EXPECT_EQ(*FirstHostOfSlurmNodelist("node1"), "node1");
  EXPECT_EQ(*FirstHostOfSlurmNodelist("a,b,c"), "a");
  EXPECT_EQ(*FirstHostOfSlurmNodelist("node[01-04,07]"), "node01");
  EXPECT_EQ(*FirstHostOfSlurmNodelist("node[7,1-3],x"), "node7");
  EXPECT_EQ(*FirstHostOfSlurmNodelist("rack[2-3]-n[010-012]"), "rack2-n010");
  EXPECT_EQ(*FirstHostOfSlurmNodelist("gpu-a100[3]"), "gpu-a1003");
  EXPECT_EQ(*FirstHostOfSlurmNodelist("host.example.org"), "host.example.org");
}

TEST(SlurmNodelistTest, Malformed) {
  EXPECT_EQ(FirstHostOfSlurmNodelist("").status().message(), "names no host");
  EXPECT_EQ(FirstHostOfSlurmNodelist("n[]").status().message(), "has an empty `[]` range");
  EXPECT_EQ(FirstHostOfSlurmNodelist("n[1-2").status().message(),
            "has a `[` without a matching `]`");
  EXPECT_EQ(FirstHostOfSlurmNodelist("n1-2]").status().message(),
            "has a `]` without a matching `[`");
  EXPECT_EQ(FirstHostOfSlurmNodelist("n[a-b]").status().message(),
            "has a non-digit inside `[...]`");
  EXPECT_EQ(FirstHostOfSlurmNodelist("n[[1]]").status().message(), "has nested `[`");
}

TEST(SlurmTasksPerNodeTest, Expand) {
  EXPECT_EQ(*ExpandSlurmTasksPerNode("4"), std::vector<int>({4}));
  EXPECT_EQ(*ExpandSlurmTasksPerNode("2(x3),1"), std::vector<int>({2, 2, 2, 1}));
  EXPECT_EQ(*ExpandSlurmTasksPerNode("1,3(x2)"), std::vector<int>({1, 3, 3}));
  EXPECT_FALSE(ExpandSlurmTasksPerNode("").ok());
  EXPECT_FALSE(ExpandSlurmTasksPerNode("2,").ok());
  EXPECT_FALSE(ExpandSlurmTasksPerNode("0").ok());
  EXPECT_FALSE(ExpandSlurmTasksPerNode("2(x0)").ok());
  EXPECT_FALSE(ExpandSlurmTasksPerNode("2(y3)").ok());
  EXPECT_EQ(ExpandSlurmTasksPerNode("1(x99999999999)").status().message(),
            "describes more than 1048576 nodes");
}

TEST(CurrentEnvironmentTest, SeesVariablesOfThisProcess) {
  ASSERT_EQ(setenv("DDP_ENV_TEST_PROBE", "a=b", 1), 0);
  EnvMap env = CurrentEnvironment();
  ASSERT_TRUE(env.count("DDP_ENV_TEST_PROBE"));
  EXPECT_EQ(env["DDP_ENV_TEST_PROBE"], "a=b");
  unsetenv("DDP_ENV_TEST_PROBE");
}

TEST(NprocPerNodeTest, NumbersGpuCpuAndAuto) {
  // A stand-in for the driver's listing: one entry per GPU.
  const std::string dir = ::testing::TempDir() + "/nvidia_gpus_" + std::to_string(getpid());
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  for (const char* gpu : {"0000:19:00.0", "0000:3b:00.0", "0000:4c:00.0"}) {
    ASSERT_EQ(mkdir((dir + "/" + gpu).c_str(), 0755), 0);
  }
  const std::string none = dir + "/absent";
  EXPECT_EQ(VisibleGpuCount({}, dir), 3);
  EXPECT_EQ(VisibleGpuCount({}, none), 0);
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "2,0"}}, dir), 2);  // the variable wins
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", ""}}, dir), 0);
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "GPU-8f2a,MIG-1c"}}, dir), 2);
  // CUDA stops at the first entry that names no device.
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "-1"}}, dir), 0);
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "0,1,-1,2"}}, dir), 2);
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "0,,1"}}, dir), 1);
  // As torch.cuda.device_count(): an index beyond the GPUs the driver lists
  // ends the list (three here: "0,1,2,3" made ddprun start a fourth worker
  // with no GPU), blanks around an entry are dropped, and a repeated entry
  // leaves no GPU at all. Without the driver's listing, indexes are taken
  // as they are.
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "0,1,2,3"}}, dir), 3);
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "5,0"}}, dir), 0);
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "99999999999999999999"}}, dir), 0);
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "0,1,2,3"}}, none), 4);
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", " 0, 2 "}}, dir), 2);
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "0,1,0"}}, dir), 0);
  EXPECT_EQ(VisibleGpuCount({{"CUDA_VISIBLE_DEVICES", "GPU-8f2a,GPU-8f2a"}}, dir), 0);

  // The affinity mask capped by a cgroup quota (cpus_test checks both).
  const int cpus = topology::UsableCpus();

  EXPECT_EQ(ParseNprocPerNode("4", {}, none).value(), 4);
  EXPECT_EQ(ParseNprocPerNode("gpu", {}, dir).value(), 3);
  EXPECT_EQ(ParseNprocPerNode("auto", {}, dir).value(), 3);
  EXPECT_EQ(ParseNprocPerNode("auto", {}, none).value(), cpus);
  EXPECT_EQ(ParseNprocPerNode("cpu", {}, dir).value(), cpus);
  auto error = [](StatusOr<int> r) { return r.ok() ? std::string("ok") : r.status().message(); };
  EXPECT_EQ(error(ParseNprocPerNode("gpu", {}, none)),
            "--nproc_per_node=gpu: no GPU is visible (" + none + " lists none)");
  EXPECT_EQ(error(ParseNprocPerNode("gpu", {{"CUDA_VISIBLE_DEVICES", ""}}, dir)),
            "--nproc_per_node=gpu: no GPU is visible (CUDA_VISIBLE_DEVICES='' names none)");
  EXPECT_EQ(error(ParseNprocPerNode("0", {}, dir)), "--nproc_per_node=0 must be in [1, 4096]");
  EXPECT_EQ(error(ParseNprocPerNode("GPU", {}, dir)), "--nproc_per_node=GPU is not an integer, gpu, cpu or auto");
  EXPECT_EQ(error(ParseNprocPerNode("", {}, dir)), "--nproc_per_node= is not an integer, gpu, cpu or auto");
}

// torchrun reads --nproc_per_node with int() before it looks at its words,
// so a sign, whitespace around the number and underscores between digits
// are a number there; they were refused here as "not an integer". The
// words stay exact, and the range check sees the number.
TEST(NprocPerNodeTest, NumbersAsPythonsIntReadsThem) {
  const std::string none = ::testing::TempDir() + "/no_nvidia_gpus_" + std::to_string(getpid());
  auto error = [](StatusOr<int> r) { return r.ok() ? std::string("ok") : r.status().message(); };
  EXPECT_EQ(error(ParseNprocPerNode("+2", {}, none)), "ok");
  EXPECT_EQ(ParseNprocPerNode("+2", {}, none).value(), 2);
  EXPECT_EQ(ParseNprocPerNode(" 4\n", {}, none).value(), 4);
  EXPECT_EQ(ParseNprocPerNode("1_0", {}, none).value(), 10);
  EXPECT_EQ(ParseNprocPerNode("0_08", {}, none).value(), 8);
  EXPECT_EQ(error(ParseNprocPerNode("-0", {}, none)), "--nproc_per_node=-0 must be in [1, 4096]");
  EXPECT_EQ(error(ParseNprocPerNode("4_097", {}, none)), "--nproc_per_node=4_097 must be in [1, 4096]");
  EXPECT_EQ(error(ParseNprocPerNode("99999999999999999999", {}, none)),
            "--nproc_per_node=99999999999999999999 must be in [1, 4096]");
  for (const std::string bad : {"1__0", "_1", "1_", "+", "0x2", "2.0", "1 0", " gpu", "cpu ", "+auto"}) {
    EXPECT_EQ(error(ParseNprocPerNode(bad, {}, none)),
              "--nproc_per_node=" + bad + " is not an integer, gpu, cpu or auto");
  }
}

TEST(PythonIntTest, ReadsWhatPythonsIntReads) {
  EXPECT_EQ(ParsePythonInt("29_500"), 29500);
  EXPECT_EQ(ParsePythonInt(" +7\t"), 7);
  EXPECT_EQ(ParsePythonInt("\x1f-007\v"), -7);
  EXPECT_EQ(ParsePythonInt("-0"), 0);
  EXPECT_EQ(ParsePythonInt("99999999999999999999"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(ParsePythonInt("-99999999999999999999"), std::numeric_limits<int64_t>::min());
  for (std::string_view bad : {"", " ", "+", "-", "+-1", "1__0", "_1", "1_", "_", "1 0", "0x10", "1.0", "1e3"}) {
    EXPECT_EQ(ParsePythonInt(bad), std::nullopt) << "'" << bad << "'";
  }
  EXPECT_EQ(PythonIntDigits(" -1_000 "), "-1000");
}

TEST(PythonIntTest, StripsWhatPythonsStripStrips) {
  EXPECT_EQ(StripPythonSpace("\t\n\v\f\r\x1c\x1d\x1e\x1f h:1 \x1f\n"), "h:1");
  EXPECT_EQ(StripPythonSpace(" a b "), "a b");
  EXPECT_EQ(StripPythonSpace(" \t"), "");
  EXPECT_EQ(StripPythonSpace("\x1b" "1\x7f"), "\x1b" "1\x7f");  // not whitespace in Python either
}

}  // namespace
}  // namespace ddp::transport::launch
