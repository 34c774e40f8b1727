// The store between real processes: ranks started by RunTestWorkers find the
// store through the launch environment, as the communicator does.

#include <cstdio>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/launch/env.h"
#include "transport/launch/test_spawn.h"
#include "transport/store/tcp_store.h"

namespace ddp::transport::store {
namespace {

using namespace std::chrono_literals;

// Every rank publishes a value, counts itself in, waits for everyone and
// reads every other rank's value. Rank 0 serves the store itself unless a
// launcher does, and then stays up until every rank is done with it.
DDP_TEST_WORKER(rendezvous) {
  StatusOr<launch::LaunchEnv> env = launch::LaunchEnvFromProcess();
  if (!env.ok()) {
    std::fprintf(stderr, "%s\n", env.status().ToString().c_str());
    return 10;
  }
  std::unique_ptr<TcpStoreServer> server;
  if (env->hosts_store()) {
    TcpStoreServerOptions options;
    options.bind_address = env->master_addr;
    options.port = env->master_port;
    options.job_token = env->job_token;
    StatusOr<std::unique_ptr<TcpStoreServer>> started = TcpStoreServer::Start(options);
    if (!started.ok()) {
      std::fprintf(stderr, "%s\n", started.status().ToString().c_str());
      return 11;
    }
    server = std::move(started).value();
  }
  const Deadline deadline = DeadlineIn(20s);
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect(env->master_addr, env->master_port, env->job_token, deadline);
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
    return 12;
  }
  auto check = [&](const Status& s) {
    if (!s.ok()) std::fprintf(stderr, "rank %d: %s\n", env->rank, s.ToString().c_str());
    return s.ok();
  };
  const std::string prefix = env->StoreKeyPrefix();
  // Count in first: once every address is there, every rank has counted.
  StatusOr<int64_t> joined = (*client)->Add(prefix + "joined", 1, deadline);
  if (!check(joined.status())) return 14;
  if (!check((*client)->Set(prefix + "addr/" + std::to_string(env->rank),
                            "worker-address-" + std::to_string(env->rank), deadline))) {
    return 13;
  }
  std::vector<std::string> keys;
  for (int r = 0; r < env->world_size; ++r) keys.push_back(prefix + "addr/" + std::to_string(r));
  if (!check((*client)->Wait(keys, deadline))) return 15;
  for (int r = 0; r < env->world_size; ++r) {
    StatusOr<std::string> v = (*client)->Get(keys[r], deadline);
    if (!check(v.status())) return 16;
    if (*v != "worker-address-" + std::to_string(r)) return 17;
  }
  StatusOr<std::optional<std::string>> count = (*client)->TryGet(prefix + "joined", deadline);
  if (!check(count.status()) || count->value() != std::to_string(env->world_size)) return 18;
  if (!check((*client)->Set(prefix + "done/" + std::to_string(env->rank), "1", deadline))) {
    return 19;
  }
  if (server) {
    std::vector<std::string> done;
    for (int r = 0; r < env->world_size; ++r) done.push_back(prefix + "done/" + std::to_string(r));
    if (!check((*client)->Wait(done, deadline))) return 20;
  }
  std::printf("rank %d saw %d ranks\n", env->rank, env->world_size);
  return 0;
}

DDP_TEST_WORKER(intruder) {
  StatusOr<launch::LaunchEnv> env = launch::LaunchEnvFromProcess();
  if (!env.ok()) return 10;
  StatusOr<std::unique_ptr<TcpStoreClient>> client = TcpStoreClient::Connect(
      env->master_addr, env->master_port, env->job_token + "-not", DeadlineIn(10s));
  if (client.status().code() != StatusCode::kPermissionDenied) {
    std::fprintf(stderr, "expected PERMISSION_DENIED, got %s\n",
                 client.status().ToString().c_str());
    return 1;
  }
  return 0;
}

TEST(TcpStoreMultiprocessTest, RanksRendezvousThroughALauncherHostedStore) {
  StatusOr<launch::testing::TestRunResult> run =
      launch::testing::RunTestWorkers("rendezvous", {.world_size = 4, .timeout = 30s});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << run->Summary();
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(run->Output(r), ::testing::HasSubstr("rank " + std::to_string(r) + " saw 4 ranks"));
  }
}

TEST(TcpStoreMultiprocessTest, RanksRendezvousThroughARank0HostedStore) {
  StatusOr<launch::testing::TestRunResult> run = launch::testing::RunTestWorkers(
      "rendezvous", {.world_size = 5, .timeout = 30s, .host_store = false});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << run->Summary();
}

TEST(TcpStoreMultiprocessTest, WrongTokenFromAnotherProcessIsRefused) {
  StatusOr<launch::testing::TestRunResult> run =
      launch::testing::RunTestWorkers("intruder", {.world_size = 2, .timeout = 30s});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << run->Summary();
}

}  // namespace
}  // namespace ddp::transport::store
