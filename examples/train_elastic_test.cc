// The trainer as an elastic job: two ddprun launchers (torchrun's c10d
// rendezvous, --nnodes=1:2) on this host train together; one is killed
// (SIGKILL) after a checkpoint in the middle of an epoch, and the other
// restarts the job on its own node, resumes from the job's last checkpoint
// with one rank, trains the rest of that epoch and finishes.

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <memory>
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
  // The first launcher serves the store (is_host=true): it is node 0 and
  // stays; the second joins it (is_host=false), however late it starts.
  // 5 s of silence (not 2) declare a node dead, so that a live launcher
  // starved on a loaded machine is not; the second has 5 s after node 0 is
  // up to join the first round.
  auto launcher = [&](bool host) {
    return std::vector<std::string>{
        Runfile("transport/launch/ddprun"), "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:" + std::to_string(port), "--rdzv_id=elastic_test",
        "--nnodes=1:2", "--nproc_per_node=1", "--max_restarts=1", "--node_timeout=5",
        "--grace_period=1", "--rdzv_conf=last_call_timeout=5",
        std::string("--rdzv_conf=is_host=") + (host ? "true" : "false"), Runfile("examples/train"),
        "--dataset=synthetic", "--model=mlp", "--train_samples=1024", "--test_samples=128",
        "--batch_size=16", "--epochs=40", "--workers=0", "--checkpoint_every=40",
        "--checkpoint=" + checkpoint};
  };
  const std::vector<std::pair<std::string, std::string>> env = {{"DDP_JOB_TOKEN", "elastic-test-token"}};
  Subprocess first(launcher(true), env);
  Subprocess second(launcher(false), env);

  // 32 steps per epoch on 2 ranks; --checkpoint_every=40 saves in the
  // middle of epochs too (step 80: 16 steps into epoch 3). The node is
  // killed after one of those.
  const auto is_mid_epoch = [](int64_t step) { return step >= 64 && step % 32 != 0; };
  const auto mid_epoch = [&] { return is_mid_epoch(CheckpointStep(checkpoint)); };
  testing::WaitForCheckpointStep(
      checkpoint, is_mid_epoch, [&] { return second.Wait(std::chrono::milliseconds(10)) == -1; },
      std::chrono::seconds(120));
  ASSERT_TRUE(mid_epoch()) << CheckpointStep(checkpoint) << first.Stdout() << first.Stderr()
                           << second.Stderr();
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
  EXPECT_NE(out.find("RESULT model=mlp ranks=1 epochs=40 "), std::string::npos) << out;
  // Resumed at step s of 2 ranks, k = s % 32 steps into epoch e = s / 32
  // (k is 0 only when the job got to an epoch end before it stopped): one
  // rank trains the rest of epoch e, 64 - 2k steps, then 64 per epoch.
  // Jumping to the next epoch instead ended 64 - 2k steps short.
  const std::string resumed_at = "resumed at epoch ";
  const size_t at = out.find(resumed_at);
  ASSERT_NE(at, std::string::npos) << out;
  const size_t step_at = out.find(", step ", at);
  ASSERT_NE(step_at, std::string::npos) << out;
  const int64_t s = std::atoll(out.c_str() + step_at + 7);
  const int64_t e = s / 32, k = s % 32;
  if (k != 0) {
    EXPECT_NE(out.find("this run trains the rest of that epoch"), std::string::npos) << out;
  }
  EXPECT_EQ(CheckpointStep(checkpoint), s + (64 - 2 * k) + (40 - e - 1) * 64) << out;
}

// Hosts without a shared filesystem: rank 0 saves the checkpoint on its own
// disk, so the other nodes cannot read it. In these tests node 1 runs in a
// mount namespace of its own where the checkpoint's folder is an empty
// tmpfs. Need root (CAP_SYS_ADMIN), as CI runs them.
class PrivateDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(access("/usr/bin/unshare", X_OK), 0) << "needs /usr/bin/unshare (util-linux)";
    dir_ = testing::MakeTempDir("private_disk");
    checkpoint_ = dir_ + "/ckpt.safetensors";
  }

  std::vector<std::string> Train() const {
    return {Runfile("examples/train"), "--dataset=synthetic", "--model=mlp",
            "--train_samples=1024",    "--test_samples=128",  "--batch_size=16",
            "--workers=0",             "--checkpoint=" + checkpoint_};
  }

  // Two ddprun launchers of one rank each, on `port`, allowing
  // `max_restarts`, running the trainer with `flags` added; node 1's sees
  // an empty folder instead of dir_. The roles are given (is_host), not
  // left to whichever launcher listens first; 5 s of silence declare a
  // node dead, so that a live launcher starved on a loaded machine is not.
  void Start(int port, int max_restarts, const std::vector<std::string>& flags) {
    auto launcher = [&](bool host) {
      std::vector<std::string> argv = {
          Runfile("transport/launch/ddprun"), "--rdzv_backend=c10d",
          "--rdzv_endpoint=127.0.0.1:" + std::to_string(port), "--rdzv_id=private_disk_test",
          "--nnodes=2", "--nproc_per_node=1", "--node_timeout=5", "--grace_period=1",
          std::string("--rdzv_conf=is_host=") + (host ? "true" : "false"),
          "--max_restarts=" + std::to_string(max_restarts)};
      const std::vector<std::string> train = Train();
      argv.insert(argv.end(), train.begin(), train.end());
      argv.insert(argv.end(), flags.begin(), flags.end());
      return argv;
    };
    const std::vector<std::pair<std::string, std::string>> env = {{"DDP_JOB_TOKEN", "private-disk-token"}};
    node0_ = std::make_unique<Subprocess>(launcher(true), env);
    std::vector<std::string> private_disk = {"/usr/bin/unshare", "--mount", "/bin/sh", "-c",
                                             "mount -t tmpfs tmpfs \"$0\" && exec \"$@\"", dir_};
    const std::vector<std::string> node1 = launcher(false);
    private_disk.insert(private_disk.end(), node1.begin(), node1.end());
    node1_ = std::make_unique<Subprocess>(private_disk, env);
  }

  std::string dir_, checkpoint_;
  std::unique_ptr<Subprocess> node0_, node1_;
};

// --resume: every rank resumes from the bytes rank 0 read.
TEST_F(PrivateDiskTest, ResumeWorksWhenOnlyNodeZeroSeesTheCheckpoint) {
  // One epoch on one rank: 64 steps, saved at the end. Without a schedule,
  // which a run longer than the saved one could not continue.
  std::vector<std::string> first_run = Train();
  first_run.insert(first_run.end(), {"--epochs=1", "--nproc_per_node=1", "--scheduler=none"});
  const testing::RunOutput before = testing::RunToEnd(first_run);
  ASSERT_EQ(before.exit_code, 0) << before.out << before.err;
  ASSERT_EQ(CheckpointStep(checkpoint_), 64);

  const int port = FreePort();
  ASSERT_GT(port, 0);
  Start(port, 0, {"--epochs=2", "--resume", "--scheduler=none"});
  EXPECT_EQ(node1_->Wait(std::chrono::seconds(120)), 0) << node1_->Stderr();
  ASSERT_EQ(node0_->Wait(std::chrono::seconds(120)), 0) << node0_->Stdout() << node0_->Stderr();
  const std::string out = node0_->Stdout();
  EXPECT_NE(out.find("resumed at epoch 2, step 64"), std::string::npos) << out;
  EXPECT_NE(out.find("RESULT model=mlp ranks=2 "), std::string::npos) << out;
  // The second epoch, 32 steps of 2 ranks, ran on both from there.
  EXPECT_EQ(CheckpointStep(checkpoint_), 96);
}

// A restart: rank 0 decides to resume from the job's checkpoint, and node
// 1's rank follows although it sees no file (before, it started over from
// step 0 while rank 0 resumed, and their collectives no longer matched).
TEST_F(PrivateDiskTest, RestartResumesEveryRankWhenOnlyNodeZeroSeesTheCheckpoint) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  Start(port, 1, {"--epochs=3", "--checkpoint_every=16"});
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (CheckpointStep(checkpoint_) < 32 && Clock::now() < deadline &&
         node1_->Wait(std::chrono::milliseconds(0)) == -1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(CheckpointStep(checkpoint_), 32) << node0_->Stdout() << node0_->Stderr() << node1_->Stderr();
  const std::vector<pid_t> workers = node1_->Children();
  ASSERT_EQ(workers.size(), 1u);
  ASSERT_EQ(kill(workers[0], SIGKILL), 0);

  EXPECT_EQ(node1_->Wait(std::chrono::seconds(120)), 0) << node1_->Stderr();
  ASSERT_EQ(node0_->Wait(std::chrono::seconds(120)), 0) << node0_->Stdout() << node0_->Stderr();
  const std::string out = node0_->Stdout(), err = node0_->Stderr();
  EXPECT_NE(err.find("restarting the job (restart 1 of 1)"), std::string::npos) << err;
  EXPECT_NE(out.find("resuming from this run's checkpoint " + checkpoint_), std::string::npos) << out;
  EXPECT_NE(out.find("RESULT model=mlp ranks=2 "), std::string::npos) << out;
  EXPECT_EQ(CheckpointStep(checkpoint_), 96);
}

}  // namespace
}  // namespace ddp::examples
