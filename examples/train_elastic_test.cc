// The trainer as an elastic job: two ddprun launchers (torchrun's c10d
// rendezvous, --nnodes=1:2) on this host train together; one is killed
// (SIGKILL) after the first checkpoints, and the other restarts the job on
// its own node, resumes from the job's last checkpoint with one rank and
// finishes.

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "examples/testing/checkpoint_step.h"
#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"

namespace ddp::examples {
namespace {

using testing::CheckpointStep;
using testing::Runfile;
using testing::Subprocess;
using Clock = std::chrono::steady_clock;

// A port nobody listens on right now (bound once, then released).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(TrainElasticTest, JobLosesANodeAndFinishesOnTheOther) {
  const std::string dir = testing::MakeTempDir("elastic");
  const std::string checkpoint = dir + "/ckpt.safetensors";
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto launcher = [&] {
    return std::vector<std::string>{
        Runfile("transport/launch/ddprun"), "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:" + std::to_string(port), "--rdzv_id=elastic_test",
        "--nnodes=1:2", "--nproc_per_node=1", "--max_restarts=1", "--node_timeout=2",
        "--grace_period=1", "--rdzv_conf=last_call_timeout=2", Runfile("examples/train"),
        "--dataset=synthetic", "--model=mlp", "--train_samples=1024", "--test_samples=128",
        "--batch_size=16", "--epochs=40", "--workers=0", "--checkpoint_every=32",
        "--checkpoint=" + checkpoint};
  };
  const std::vector<std::pair<std::string, std::string>> env = {{"DDP_JOB_TOKEN", "elastic-test-token"}};
  // The first launcher can listen on the endpoint: it is node 0 and stays.
  Subprocess first(launcher(), env);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  Subprocess second(launcher(), env);

  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (CheckpointStep(checkpoint) < 64 && Clock::now() < deadline &&
         second.Wait(std::chrono::milliseconds(0)) == -1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(CheckpointStep(checkpoint), 64) << first.Stdout() << first.Stderr() << second.Stderr();
  ASSERT_EQ(kill(second.pid(), SIGKILL), 0);

  EXPECT_EQ(second.Wait(std::chrono::seconds(30)), 128 + SIGKILL) << second.Stderr();
  ASSERT_EQ(first.Wait(std::chrono::seconds(120)), 0) << first.Stdout() << first.Stderr();
  const std::string err = first.Stderr(), out = first.Stdout();
  EXPECT_NE(err.find("ddprun: the job runs on 2 nodes (--nnodes=1:2)\n"), std::string::npos) << err;
  EXPECT_NE(err.find("restarting the job (restart 1 of 1)"), std::string::npos) << err;
  EXPECT_NE(err.find("ddprun: the job runs on 1 node (--nnodes=1:2) from restart 1"), std::string::npos)
      << err;
  // The trainer picked up the job's checkpoint with the world it now has.
  EXPECT_NE(out.find("resuming from this run's checkpoint " + checkpoint), std::string::npos) << out;
  EXPECT_NE(out.find("RESULT model=mlp ranks=1 "), std::string::npos) << out;
  EXPECT_GT(CheckpointStep(checkpoint), 64);
}

}  // namespace
}  // namespace ddp::examples
