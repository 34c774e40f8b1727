#include "transport/fault/peer_monitor.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <thread>

#include "transport/testing/in_memory_store.h"

namespace ddp::transport::fault {
namespace {

// A child process that sleeps until killed; spawned (not forked into test
// logic) so that it is a real, separate process.
pid_t SpawnSleeper() {
  const pid_t pid = fork();
  if (pid == 0) {
    execlp("sleep", "sleep", "30", static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

TEST(PeerMonitor, HealthyJobIsOk) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child, 0}, .key_prefix = "j/"}, &store);
  EXPECT_TRUE(monitor.Check().ok());
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
}

TEST(PeerMonitor, DeadLocalPeerIsPeerLostNamingIt) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), 0, child}, .key_prefix = "j/"}, &store);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  Status s = monitor.Check();
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s;
  EXPECT_EQ(monitor.lost_peer(), 2);
}

TEST(PeerMonitor, ZombieCountsAsDead) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 1, .local_pids = {child, getpid()}, .key_prefix = "j/"}, &store);
  kill(child, SIGKILL);
  // Not reaped yet: the pidfd still reports the exit.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(monitor.Check().code(), StatusCode::kPeerLost);
  waitpid(child, nullptr, 0);
}

TEST(PeerMonitor, CleanlyClosedPeerMayExit) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child}, .key_prefix = "j/"}, &store);
  PeerMonitor other({.rank = 1, .local_pids = {}, .key_prefix = "j/"}, &store);
  other.PostClosed();
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_TRUE(monitor.Check().ok());
}

TEST(PeerMonitor, PostedAbortReachesEveryRankWithItsCode) {
  testing::InMemoryStore store;
  PeerMonitor rank0({.rank = 0, .key_prefix = "j/"}, &store);
  PeerMonitor rank3({.rank = 3, .key_prefix = "j/"}, &store);
  EXPECT_TRUE(rank0.Check().ok());
  rank3.PostAbort(PeerLostError("receive from rank 2: rank 2 exited"));
  rank0.PostAbort(TimedOutError("later reason"));  // the first one stays
  Status s = rank0.Check();
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 3 aborted the job"), std::string::npos) << s;
  EXPECT_NE(s.message().find("rank 2 exited"), std::string::npos) << s;
  // Another job (other prefix) is not affected.
  PeerMonitor stranger({.rank = 0, .key_prefix = "other/"}, &store);
  EXPECT_TRUE(stranger.Check().ok());
}

TEST(PeerMonitor, GarbledAbortValueIsStillAnError) {
  EXPECT_EQ(PeerMonitor::DecodeAbort("garbage").code(), StatusCode::kInternal);
  EXPECT_EQ(PeerMonitor::DecodeAbort("99\n1\nx").code(), StatusCode::kInternal);
  Status round = PeerMonitor::DecodeAbort(PeerMonitor::EncodeAbort(5, TimedOutError("t")));
  EXPECT_EQ(round.code(), StatusCode::kTimedOut);
  EXPECT_EQ(round.message(), "rank 5 aborted the job: t");
}

// A store that cannot be reached, as when the rank serving it died.
class DeadStore final : public store::Store {
 public:
  Status Set(std::string_view, std::string_view, Deadline) override { return Down(); }
  StatusOr<std::string> Get(std::string_view, Deadline) override { return Down(); }
  StatusOr<std::optional<std::string>> TryGet(std::string_view, Deadline) override { return Down(); }
  StatusOr<int64_t> Add(std::string_view, int64_t, Deadline) override { return Down(); }
  Status Wait(std::span<const std::string>, Deadline) override { return Down(); }
  StatusOr<bool> Delete(std::string_view, Deadline) override { return Down(); }

 private:
  static Status Down() { return UnavailableError("connection reset"); }
};

TEST(PeerMonitor, UnreachableStoreIsPeerLostOfItsServer) {
  DeadStore store;
  PeerMonitor monitor({.rank = 1, .key_prefix = "j/", .store_rank = 0}, &store);
  Status s = monitor.Check();
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 0 serves it"), std::string::npos) << s;
}

}  // namespace
}  // namespace ddp::transport::fault

namespace ddp::transport::fault {
namespace {

TEST(PeerMonitor, PostedReasonWinsOverAReporterThatExited) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child}, .key_prefix = "j/"}, &store);
  PeerMonitor reporter({.rank = 1, .key_prefix = "j/"}, &store);
  reporter.PostAbort(PeerLostError("rank 3 died"));
  kill(child, SIGKILL);  // rank 1 leaves after reporting
  waitpid(child, nullptr, 0);
  Status s = monitor.Check();
  EXPECT_EQ(s.code(), StatusCode::kPeerLost);
  EXPECT_NE(s.message().find("rank 3 died"), std::string::npos) << s;
}

}  // namespace
}  // namespace ddp::transport::fault
