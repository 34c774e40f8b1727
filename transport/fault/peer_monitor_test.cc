#include "transport/fault/peer_monitor.h"

#include <linux/sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "transport/fault/process.h"
#include "transport/store/tcp_store.h"
#include "transport/store/wire.h"
#include "transport/testing/descriptors_exhausted.h"
#include "transport/testing/forwarding_store.h"
#include "transport/testing/in_memory_store.h"

namespace ddp::transport::fault {
namespace {

using std::chrono::milliseconds;

// The deadline of a call with time to spare.
Deadline Soon() { return DeadlineIn(milliseconds(5000)); }

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

// Kills child `pid` and waits until it has exited and is reaped.
void KillAndReap(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

TEST(PeerMonitor, HealthyJobIsOk) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child, 0}, .key_prefix = "j/"}, &store);
  EXPECT_TRUE(monitor.Check(Soon()).ok());
  KillAndReap(child);
}

TEST(PeerMonitor, DeadLocalPeerIsPeerLostNamingIt) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), 0, child}, .key_prefix = "j/"}, &store);
  KillAndReap(child);
  Status s = monitor.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s;
  EXPECT_EQ(monitor.lost_peer(), 2);
}

// A peer that died between the exchange of pids and the monitor's start
// (pidfd_open finds no process) is lost from then on, whatever process
// takes its pid later (not reproducible here: the kernel picks pids).
TEST(PeerMonitor, PeerDeadBeforeTheMonitorStartsStaysLost) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  KillAndReap(child);
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child}, .key_prefix = "j/"}, &store);
  for (int i = 0; i < 2; ++i) {
    const Status s = monitor.Check(Soon());
    EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  }
  EXPECT_EQ(monitor.ExitedPeers(), std::vector<int>{1});
}

// Exited peers are listed whether or not they closed cleanly; this rank,
// live peers and peers on other hosts (pid 0) are not.
TEST(PeerMonitor, ExitedPeersListsEveryLocalRankThatExited) {
  testing::InMemoryStore store;
  const pid_t alive = SpawnSleeper();
  const pid_t killed = SpawnSleeper();
  const pid_t closed = SpawnSleeper();
  PeerMonitor monitor(
      {.rank = 1, .local_pids = {killed, getpid(), alive, 0, closed}, .key_prefix = "j/"}, &store);
  EXPECT_TRUE(monitor.ExitedPeers().empty());
  ASSERT_TRUE(store.Set("j/closed/4", "1", Soon()).ok());
  for (pid_t pid : {killed, closed}) {
    KillAndReap(pid);
  }
  EXPECT_EQ(monitor.ExitedPeers(), (std::vector<int>{0, 4}));
  KillAndReap(alive);
}

TEST(PeerMonitor, ZombieCountsAsDead) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 1, .local_pids = {child, getpid()}, .key_prefix = "j/"}, &store);
  kill(child, SIGKILL);
  // Block until it has exited, leaving it unreaped (a zombie): the pidfd
  // still reports the exit.
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);
  EXPECT_EQ(info.si_pid, child);
  EXPECT_EQ(monitor.Check(Soon()).code(), StatusCode::kPeerLost);
  waitpid(child, nullptr, 0);
}

// The same without a pidfd (here: every descriptor in use when the monitor
// starts, EMFILE): the fallback took a zombie for alive (kill(pid, 0)
// succeeds on it), so a crashed peer whose launcher had not reaped it yet
// was never reported and every wait ran to its deadline.
TEST(PeerMonitor, ZombieCountsAsDeadWithoutAPidfd) {
  testing::InMemoryStore store;
  const pid_t zombie = SpawnSleeper();
  const pid_t alive = SpawnSleeper();
  std::unique_ptr<PeerMonitor> monitor;
  int exhausted = 0;
  {
    testing::DescriptorsExhausted none_left;
    exhausted = none_left.error();
    monitor = std::make_unique<PeerMonitor>(
        PeerMonitorOptions{.rank = 1, .local_pids = {zombie, getpid(), alive}, .key_prefix = "j/"}, &store);
  }
  ASSERT_EQ(exhausted, EMFILE);
  EXPECT_TRUE(monitor->ExitedPeers().empty());
  kill(zombie, SIGKILL);
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(zombie), &info, WEXITED | WNOWAIT), 0);
  // The kernel may still be releasing its memory for a moment.
  const Deadline until = DeadlineIn(milliseconds(2000));
  while (monitor->ExitedPeers().empty() && Clock::now() < until) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(monitor->ExitedPeers(), std::vector<int>{0});
  EXPECT_EQ(monitor->Check(Soon()).code(), StatusCode::kPeerLost);
  for (pid_t pid : {zombie, alive}) {
    KillAndReap(pid);
  }
}

// A child that sleeps, made with the pid `pid` (clone3's set_tid; root
// may choose a free pid): -1 when that pid is taken meanwhile.
pid_t SpawnSleeperAs(pid_t pid) {
  clone_args args{};
  args.exit_signal = SIGCHLD;
  args.set_tid = reinterpret_cast<uint64_t>(&pid);
  args.set_tid_size = 1;
  const long got = syscall(SYS_clone3, &args, sizeof(args));
  if (got == 0) {
    execlp("sleep", "sleep", "30", static_cast<char*>(nullptr));
    _exit(127);
  }
  return static_cast<pid_t>(got);
}

// A monitor (rank 1) of a peer (rank 0) that was killed and reaped after
// the monitor started, and whose pid a sleeper took then.
struct PeerUnderAReusedPid {
  std::unique_ptr<PeerMonitor> monitor;
  pid_t peer = -1;
  pid_t reuser = -1;  // == peer: the sleeper under the peer's pid
};

// Spawns a sleeper as the peer, starts the monitor while every descriptor
// is in use (so without a pidfd), runs `before_the_kill` on it, kills and
// reaps the peer and spawns a sleeper under its pid. Tries again with a new
// peer where another process took that pid meanwhile, 5 times at most.
// Fails (fatally) unless the last try got the pid.
void MonitorAPeerWhosePidIsReused(store::Store* store,
                                  const std::function<void(PeerMonitor&)>& before_the_kill,
                                  PeerUnderAReusedPid* out) {
  for (int attempt = 0; attempt < 5 && out->reuser < 0; ++attempt) {
    out->peer = SpawnSleeper();
    // The child has started sleep once its start is what /proc says for it.
    std::this_thread::sleep_for(milliseconds(50));
    {
      testing::DescriptorsExhausted none_left;
      ASSERT_EQ(none_left.error(), EMFILE);
      out->monitor = std::make_unique<PeerMonitor>(
          PeerMonitorOptions{.rank = 1, .local_pids = {out->peer, getpid()}, .key_prefix = "j/"},
          store);
    }
    before_the_kill(*out->monitor);
    if (::testing::Test::HasFatalFailure()) return;
    KillAndReap(out->peer);
    // Start times count clock ticks: the new process must start in a later
    // one than the monitor.
    std::this_thread::sleep_for(milliseconds(30));
    out->reuser = SpawnSleeperAs(out->peer);
    ASSERT_TRUE(out->reuser >= 0 || errno == EEXIST)
        << "clone3 with set_tid: " << std::strerror(errno);
  }
  ASSERT_EQ(out->reuser, out->peer);
}

TEST(ProcessStartTime, TellsAProcessFromAnotherUnderItsPid) {
  const uint64_t mine = ProcessStartTime(getpid());
  ASSERT_GT(mine, 0u);
  EXPECT_FALSE(ProcessGoneNow(getpid(), mine));
  EXPECT_FALSE(ProcessGoneNow(getpid()));
  EXPECT_TRUE(ProcessGoneNow(getpid(), mine + 1));
}

// Without a pidfd the monitor looked at the pid alone: once the dead peer's
// launcher reaped it and another process took its pid, the peer looked
// alive again and every wait on it ran to its deadline.
TEST(PeerMonitor, APeerWhosePidWasReusedIsDeadWithoutAPidfd) {
  testing::InMemoryStore store;
  PeerUnderAReusedPid reused;
  ASSERT_NO_FATAL_FAILURE(MonitorAPeerWhosePidIsReused(
      &store, [](PeerMonitor& monitor) { ASSERT_TRUE(monitor.ExitedPeers().empty()); }, &reused));
  const pid_t reuser = reused.reuser;
  PeerMonitor* monitor = reused.monitor.get();
  EXPECT_EQ(kill(reuser, 0), 0);  // a live process has the peer's pid
  EXPECT_EQ(monitor->ExitedPeers(), std::vector<int>{0});
  EXPECT_EQ(monitor->Check(Soon()).code(), StatusCode::kPeerLost);
  KillAndReap(reuser);
}

// The same where the pid is reused before the monitor first looks at the
// peer: with no descriptor at the start it could not read the peer's start
// time then, and it took the one of whatever process it found under the
// pid at the first look, so it adopted the process that reused the pid and
// never reported the peer's death.
TEST(PeerMonitor, APeerWhosePidWasReusedBeforeTheFirstLookIsDeadWithoutAPidfd) {
  testing::InMemoryStore store;
  PeerUnderAReusedPid reused;
  ASSERT_NO_FATAL_FAILURE(MonitorAPeerWhosePidIsReused(&store, [](PeerMonitor&) {}, &reused));
  const pid_t reuser = reused.reuser;
  PeerMonitor* monitor = reused.monitor.get();
  EXPECT_EQ(kill(reuser, 0), 0);  // a live process has the peer's pid
  EXPECT_EQ(monitor->ExitedPeers(), std::vector<int>{0});
  EXPECT_EQ(monitor->ExitedPeers(), std::vector<int>{0});  // and stays gone
  EXPECT_EQ(monitor->Check(Soon()).code(), StatusCode::kPeerLost);
  KillAndReap(reuser);
}

// A peer whose start time could not be read at the start is still watched
// once it can be: it was running before the monitor started, so it is
// adopted, and its exit is reported.
TEST(PeerMonitor, APeerFirstSeenAfterTheStartIsAdoptedWhenItRanBefore) {
  testing::InMemoryStore store;
  const pid_t peer = SpawnSleeper();
  std::this_thread::sleep_for(milliseconds(50));
  std::unique_ptr<PeerMonitor> monitor;
  {
    testing::DescriptorsExhausted none_left;
    ASSERT_EQ(none_left.error(), EMFILE);
    monitor = std::make_unique<PeerMonitor>(
        PeerMonitorOptions{.rank = 1, .local_pids = {peer, getpid()}, .key_prefix = "j/"}, &store);
  }
  std::this_thread::sleep_for(milliseconds(30));
  EXPECT_TRUE(monitor->ExitedPeers().empty());
  EXPECT_TRUE(monitor->Check(Soon()).ok());
  KillAndReap(peer);
  EXPECT_EQ(monitor->ExitedPeers(), std::vector<int>{0});
}

TEST(PeerMonitor, CleanlyClosedPeerMayExit) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child}, .key_prefix = "j/"}, &store);
  PeerMonitor other({.rank = 1, .local_pids = {}, .key_prefix = "j/"}, &store);
  other.PostClosed(Soon());
  KillAndReap(child);
  EXPECT_TRUE(monitor.Check(Soon()).ok());
  EXPECT_TRUE(monitor.Check(Soon(), /*awaited_peer=*/0).ok());
}

// ...but not while this rank waits for it: what the wait needs will never
// come (seen when Ctrl-C reached one rank a step before the other).
TEST(PeerMonitor, CleanlyClosedPeerThatAWaitNeedsIsLost) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child}, .key_prefix = "j/"}, &store);
  PeerMonitor other({.rank = 1, .local_pids = {}, .key_prefix = "j/"}, &store);
  other.PostClosed(Soon());
  EXPECT_TRUE(monitor.Check(Soon(), /*awaited_peer=*/1).ok());  // still running
  KillAndReap(child);
  Status s = monitor.Check(Soon(), /*awaited_peer=*/1);
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;
  EXPECT_NE(s.message().find("left the job early"), std::string::npos) << s;
  EXPECT_EQ(monitor.lost_peer(), 1);
}

// A wait that needs several peers (WaitAny) names them all: a cleanly
// closed one that exited is lost to it wherever it is in the list.
TEST(PeerMonitor, CleanlyClosedPeerAmongSeveralAwaitedIsLost) {
  testing::InMemoryStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), 0, child}, .key_prefix = "j/"},
                      &store);
  PeerMonitor other({.rank = 2, .local_pids = {}, .key_prefix = "j/"}, &store);
  other.PostClosed(Soon());
  KillAndReap(child);
  const std::vector<int> others = {1}, both = {1, 2};
  EXPECT_TRUE(monitor.Check(Soon(), others).ok());
  Status s = monitor.Check(Soon(), both);
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s;
  EXPECT_EQ(monitor.lost_peer(), 2);
}

// A store whose reads of the "closed/" keys fail `failures` times (a
// connection that hiccups) before they go through.
class FlakyClosedStore final : public testing::ForwardingStore {
 public:
  explicit FlakyClosedStore(int failures) : failures_(failures) {}
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline d) override {
    if (key.find("closed/") != std::string_view::npos && failures_ > 0) {
      --failures_;
      return UnavailableError("connection reset while reading " + std::string(key));
    }
    return inner_.TryGet(key, d);
  }

 private:
  int failures_;
};

// A peer that closed cleanly and exited is not lost because one read of
// its "closed" mark failed: that round skips it, and the next one reads
// the mark (before, the failed read counted as "not closed": PEER_LOST).
TEST(PeerMonitor, CleanlyClosedPeerIsNotLostWhenReadingItsMarkFailsOnce) {
  FlakyClosedStore store(1);
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child}, .key_prefix = "j/"}, &store);
  PeerMonitor other({.rank = 1, .local_pids = {}, .key_prefix = "j/"}, &store);
  other.PostClosed(Soon());
  KillAndReap(child);
  Status first = monitor.Check(Soon());
  EXPECT_TRUE(first.ok()) << first;
  Status second = monitor.Check(Soon());
  EXPECT_TRUE(second.ok()) << second;
  EXPECT_EQ(monitor.lost_peer(), -1);
}

// A mark that cannot be read round after round is no proof of a clean
// close: the exited peer is lost at the second round.
TEST(PeerMonitor, ExitedPeerWhoseMarkCannotBeReadTwiceIsLost) {
  FlakyClosedStore store(1000);
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child}, .key_prefix = "j/"}, &store);
  KillAndReap(child);
  EXPECT_TRUE(monitor.Check(Soon()).ok());
  Status s = monitor.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;
  // A wait that needs the peer does not skip it.
  FlakyClosedStore store2(1000);
  const pid_t child2 = SpawnSleeper();
  PeerMonitor awaiting({.rank = 0, .local_pids = {getpid(), child2}, .key_prefix = "j/"}, &store2);
  KillAndReap(child2);
  EXPECT_EQ(awaiting.Check(Soon(), /*awaited_peer=*/1).code(), StatusCode::kPeerLost);
}

// A store whose reads of "closed/" keys go through the first time only,
// and then fail (a connection that keeps resetting under load).
class ClosedReadableOnceStore final : public testing::ForwardingStore {
 public:
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline d) override {
    if (key.find("closed/") != std::string_view::npos && reads_++ > 0) {
      return UnavailableError("connection reset while reading " + std::string(key));
    }
    return inner_.TryGet(key, d);
  }

 private:
  int reads_ = 0;
};

// A mark once read stays read: a peer that closed cleanly never reopens,
// so later rounds do not ask again, and reads that fail later (two rounds
// in a row used to count as "not closed") do not turn a clean exit into
// PEER_LOST. A wait that needs the peer still finds it lost.
TEST(PeerMonitor, AClosedMarkOnceReadIsNotAskedForAgain) {
  ClosedReadableOnceStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child}, .key_prefix = "j/"}, &store);
  PeerMonitor other({.rank = 1, .local_pids = {}, .key_prefix = "j/"}, &store);
  other.PostClosed(Soon());
  KillAndReap(child);
  for (int round = 0; round < 3; ++round) {
    Status s = monitor.Check(Soon());
    EXPECT_TRUE(s.ok()) << "round " << round << ": " << s;
  }
  EXPECT_EQ(monitor.lost_peer(), -1);
  Status awaited = monitor.Check(Soon(), /*awaited_peer=*/1);
  EXPECT_EQ(awaited.code(), StatusCode::kPeerLost) << awaited;
  EXPECT_NE(awaited.message().find("left the job early"), std::string::npos) << awaited;
}

// Reads of "closed/" keys fail `failures` times, each failing one only once
// another is under way too (it waits up to 5 s for that): one hiccup met
// by two threads' Check rounds at once.
class SharedHiccupStore final : public testing::ForwardingStore {
 public:
  explicit SharedHiccupStore(int failures) : failures_(failures) {}
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline d) override {
    if (key.find("closed/") == std::string_view::npos) return inner_.TryGet(key, d);
    std::unique_lock lock(mu_);
    if (failures_ == 0) {
      lock.unlock();
      return inner_.TryGet(key, d);
    }
    --failures_;
    ++arrived_;
    arrived_cv_.notify_all();
    arrived_cv_.wait_for(lock, std::chrono::seconds(5), [this] { return arrived_ >= 2; });
    return UnavailableError("connection reset while reading " + std::string(key));
  }

 private:
  std::mutex mu_;
  std::condition_variable arrived_cv_;
  int failures_;
  int arrived_ = 0;
};

// Check may run on two threads (a wait's watchdog and an abort looking for
// the cause). When both meet the same store hiccup, that is one unreadable
// round, not two in a row: before, the second thread declared a peer that
// had closed cleanly lost.
TEST(PeerMonitor, OneHiccupMetByTwoThreadsAtOnceIsOneRound) {
  SharedHiccupStore store(2);
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child}, .key_prefix = "j/"}, &store);
  PeerMonitor other({.rank = 1, .local_pids = {}, .key_prefix = "j/"}, &store);
  other.PostClosed(Soon());
  KillAndReap(child);
  Status on_thread;
  std::thread checker([&] { on_thread = monitor.Check(Soon()); });
  Status here = monitor.Check(Soon());
  checker.join();
  EXPECT_TRUE(here.ok()) << here;
  EXPECT_TRUE(on_thread.ok()) << on_thread;
  EXPECT_EQ(monitor.lost_peer(), -1);
  // The next round reads the mark: the peer closed cleanly.
  Status next = monitor.Check(Soon());
  EXPECT_TRUE(next.ok()) << next;
}

TEST(PeerMonitor, PostedAbortReachesEveryRankWithItsCode) {
  testing::InMemoryStore store;
  PeerMonitor rank0({.rank = 0, .key_prefix = "j/"}, &store);
  PeerMonitor rank3({.rank = 3, .key_prefix = "j/"}, &store);
  EXPECT_TRUE(rank0.Check(Soon()).ok());
  rank3.PostAbort(PeerLostError("receive from rank 2: rank 2 exited"), Soon());
  rank0.PostAbort(TimedOutError("later reason"), Soon());  // the first one stays
  Status s = rank0.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 3 aborted the job"), std::string::npos) << s;
  EXPECT_NE(s.message().find("rank 2 exited"), std::string::npos) << s;
  // Another job (other prefix) is not affected.
  PeerMonitor stranger({.rank = 0, .key_prefix = "other/"}, &store);
  EXPECT_TRUE(stranger.Check(Soon()).ok());
}

// The store as two ranks that fail at the same moment see it: neither finds
// the other's reason when it looks. The first to post still wins: before,
// each looked, found none and set its own, and the second overwrote the
// first, so ranks that read the key at different times reported different
// first causes.
class RacingStore final : public testing::ForwardingStore {
 public:
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline d) override {
    if (key.ends_with("abort")) return std::optional<std::string>();  // not yet there when it looked
    return inner_.TryGet(key, d);
  }
};

TEST(PeerMonitor, OfTwoRanksPostingAtOnceTheFirstReasonStays) {
  RacingStore store;
  PeerMonitor rank1({.rank = 1, .key_prefix = "j/"}, &store);
  PeerMonitor rank2({.rank = 2, .key_prefix = "j/"}, &store);
  rank1.PostAbort(TimedOutError("rank 1's reason"), Soon());
  rank2.PostAbort(PeerLostError("rank 2's reason"), Soon());
  auto posted = store.inner().TryGet("j/abort", Soon());
  ASSERT_TRUE(posted.ok() && posted->has_value());
  const Status s = PeerMonitor::DecodeAbort(**posted);
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_EQ(s.message(), "rank 1 aborted the job: rank 1's reason");
}

// A reason longer than the store takes in one value (a failure listing
// every rank's state, say) still reaches the peers: its start, with a note
// that the rest was cut, at the store's limit. Before, the store refused
// the whole post and the peers learned nothing, waiting out their deadline.
TEST(PeerMonitor, AnAbortReasonPastTheStoresValueLimitIsPostedCut) {
  testing::InMemoryStore store;
  PeerMonitor rank0({.rank = 0, .key_prefix = "j/"}, &store);
  PeerMonitor rank2({.rank = 2, .key_prefix = "j/"}, &store);
  const std::string long_reason = "first words " + std::string(store::kMaxValueBytes + 100, 'x') + " last words";
  rank2.PostAbort(PeerLostError(long_reason), Soon());
  auto posted = store.TryGet("j/abort", Soon());
  ASSERT_TRUE(posted.ok()) << posted.status();
  ASSERT_TRUE(posted->has_value()) << "nothing was posted";
  EXPECT_LE((*posted)->size(), store::kMaxValueBytes);
  const Status s = rank0.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s.message().substr(0, 200);
  EXPECT_TRUE(s.message().starts_with("rank 2 aborted the job: first words xxx")) << s.message().substr(0, 200);
  EXPECT_EQ(s.message().find("last words"), std::string::npos);
  const std::string said = "cut: the reason had " + std::to_string(long_reason.size()) + " bytes";
  EXPECT_NE(s.message().find(said), std::string::npos) << s.message().substr(s.message().size() - 300);
  // A reason that fits is posted whole.
  EXPECT_EQ(PeerMonitor::EncodeAbort(1, TimedOutError("short")), "2\n1\nshort");
}

// True when `text` is well-formed UTF-8 (no cut or stray sequence).
bool IsUtf8(const std::string& text) {
  for (size_t i = 0; i < text.size();) {
    const unsigned char lead = static_cast<unsigned char>(text[i]);
    const size_t length = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 0;
    if (length == 0 || i + length > text.size()) return false;
    for (size_t k = 1; k < length; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return false;
    }
    i += length;
  }
  return true;
}

// A long reason in non-ASCII text (a path, a user's string) is cut between
// characters, never inside one: the peers print it and write it to their
// error files as JSON, which a strict reader refuses when it is not UTF-8.
// Each lead-in length moves the cut to another byte of the characters.
TEST(PeerMonitor, ALongReasonIsCutBetweenCharacters) {
  for (const std::string character : {"\u00e9", "\u20ac", "\U0001F600"}) {
    for (size_t lead_in = 0; lead_in < 4; ++lead_in) {
      SCOPED_TRACE(std::to_string(character.size()) + "-byte characters after " + std::to_string(lead_in) + " bytes");
      std::string reason(lead_in, 'a');
      while (reason.size() < store::kMaxValueBytes + 100) reason += character;
      const std::string posted = PeerMonitor::EncodeAbort(3, InternalError(reason));
      EXPECT_LE(posted.size(), store::kMaxValueBytes);
      const size_t note = posted.find(" [... cut: ");
      ASSERT_NE(note, std::string::npos);
      EXPECT_TRUE(IsUtf8(posted)) << "the cut ends in bytes " << std::hex
                                  << static_cast<int>(static_cast<unsigned char>(posted[note - 2])) << " "
                                  << static_cast<int>(static_cast<unsigned char>(posted[note - 1]));
      // No more than one character's bytes were left out for it.
      EXPECT_GT(posted.size() + character.size(), store::kMaxValueBytes);
    }
  }
}

TEST(PeerMonitor, GarbledAbortValueIsStillAnError) {
  EXPECT_EQ(PeerMonitor::DecodeAbort("garbage").code(), StatusCode::kInternal);
  EXPECT_EQ(PeerMonitor::DecodeAbort("99\n1\nx").code(), StatusCode::kInternal);
  Status round = PeerMonitor::DecodeAbort(PeerMonitor::EncodeAbort(5, TimedOutError("t")));
  EXPECT_EQ(round.code(), StatusCode::kTimedOut);
  EXPECT_EQ(round.message(), "rank 5 aborted the job: t");
}

// A store that cannot be reached, as when the rank serving it died; every
// call fails with UNAVAILABLE and `why`.
class DeadStore final : public store::Store {
 public:
  explicit DeadStore(std::string why = "connection reset") : why_(std::move(why)) {}
  Status Set(std::string_view, std::string_view, Deadline) override { return Down(); }
  StatusOr<std::string> Get(std::string_view, Deadline) override { return Down(); }
  StatusOr<std::optional<std::string>> TryGet(std::string_view, Deadline) override { return Down(); }
  StatusOr<int64_t> Add(std::string_view, int64_t, Deadline) override { return Down(); }
  Status Wait(std::span<const std::string>, Deadline) override { return Down(); }
  StatusOr<bool> Delete(std::string_view, Deadline) override { return Down(); }
  StatusOr<std::optional<std::string>> CompareSet(std::string_view, std::optional<std::string_view>,
                                                  std::string_view, Deadline) override {
    return Down();
  }

 private:
  Status Down() const { return UnavailableError(why_); }
  std::string why_;
};

// A store whose host was cut off: requests go out, no reply ever comes, so
// every call runs to its deadline. It records the latest deadline it was
// given: a store call that ignored the caller's deadline shows there
// whatever the machine's load, where its time alone is a matter of margins.
class SilentStore final : public store::Store {
 public:
  Status Set(std::string_view, std::string_view, Deadline d) override { return Silent(d); }
  StatusOr<std::string> Get(std::string_view, Deadline d) override { return Silent(d); }
  StatusOr<std::optional<std::string>> TryGet(std::string_view, Deadline d) override {
    return Silent(d);
  }
  StatusOr<int64_t> Add(std::string_view, int64_t, Deadline d) override { return Silent(d); }
  Status Wait(std::span<const std::string>, Deadline d) override { return Silent(d); }
  StatusOr<bool> Delete(std::string_view, Deadline d) override { return Silent(d); }
  StatusOr<std::optional<std::string>> CompareSet(std::string_view, std::optional<std::string_view>,
                                                  std::string_view, Deadline d) override {
    return Silent(d);
  }
  int calls() const { return calls_; }
  Deadline latest_deadline() const { return latest_deadline_; }

 private:
  Status Silent(Deadline deadline) {
    ++calls_;
    latest_deadline_ = std::max(latest_deadline_, deadline);
    std::this_thread::sleep_until(deadline);
    return TimedOutError("store request timed out");
  }
  int calls_ = 0;
  Deadline latest_deadline_{};
};

// How far past its deadline a call may return on a loaded machine. What
// catches a store call that ignores the caller's deadline is the deadline
// the store was given (checked exactly), not this bound, so it can be
// generous: it only catches a call that hangs.
constexpr milliseconds kLoadedSlack(3000);

TEST(PeerMonitor, SilentStoreEndsACheckAtTheCallsDeadline) {
  SilentStore store;
  PeerMonitor monitor({.rank = 2, .key_prefix = "j/", .store_rank = -1}, &store);
  const auto start = Clock::now();
  Status s = monitor.Check(start + milliseconds(300));
  const auto took = Clock::now() - start;
  // Not the loss of the store's host: the call merely ran out of time.
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_NE(s.message().find("deadline passed"), std::string::npos) << s;
  EXPECT_GE(took, milliseconds(300));
  // The store was asked to answer by the call's deadline, not by the cap.
  EXPECT_EQ(store.calls(), 1);
  EXPECT_LE(store.latest_deadline() - start, milliseconds(300));
  EXPECT_LT(took, milliseconds(300) + kLoadedSlack);
}

TEST(PeerMonitor, CheckWithNoTimeLeftDoesNotAskTheStore) {
  SilentStore store;
  PeerMonitor monitor({.rank = 2, .key_prefix = "j/"}, &store);
  const auto start = Clock::now();
  EXPECT_TRUE(monitor.Check(start - milliseconds(1)).ok());
  EXPECT_EQ(store.calls(), 0);
  EXPECT_LT(Clock::now() - start, kLoadedSlack);
}

// The first round that runs into the cap learns nothing (one slow answer
// is a stall); the second in a row reports the server lost.
TEST(PeerMonitor, SilentStoreWithTimeToSpareIsPeerLostAfterTheCapTwice) {
  SilentStore store;
  PeerMonitor monitor({.rank = 2, .key_prefix = "j/", .store_rank = -1}, &store);
  const auto start = Clock::now();
  Status first = monitor.Check(start + std::chrono::seconds(30));
  EXPECT_TRUE(first.ok()) << first;
  Status s = monitor.Check(start + std::chrono::seconds(30));
  const auto took = Clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("the launcher serves it"), std::string::npos) << s;
  EXPECT_GE(took, 2 * kStoreCallCap);
  // One capped call a round.
  EXPECT_EQ(store.calls(), 2);
  EXPECT_LT(took, 2 * kStoreCallCap + kLoadedSlack);
}

// A store whose first read of the abort key answers only after the
// caller's deadline (its server stalled once), then answers at once.
class StallsOnceStore final : public testing::ForwardingStore {
 public:
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline d) override {
    if (key.ends_with("abort") && !stalled_) {
      stalled_ = true;
      std::this_thread::sleep_until(d);
      return TimedOutError("store try-get timed out");
    }
    return inner_.TryGet(key, d);
  }

 private:
  bool stalled_ = false;
};

// One read of the abort key slower than the cap does not abort a healthy
// job (it was PEER_LOST, "has died or stopped serving it", at once); the
// next round reads the key, and a reason posted meanwhile is seen.
TEST(PeerMonitor, OneSlowStoreAnswerIsNotTheLossOfItsServer) {
  StallsOnceStore store;
  PeerMonitor monitor({.rank = 1, .key_prefix = "j/", .store_rank = 0,
                       .store_call_cap = milliseconds(200)}, &store);
  Status s = monitor.Check(DeadlineIn(std::chrono::seconds(30)));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(monitor.Check(DeadlineIn(std::chrono::seconds(30))).ok());
  PeerMonitor reporter({.rank = 0, .key_prefix = "j/"}, &store);
  reporter.PostAbort(PeerLostError("rank 3 died"), Soon());
  s = monitor.Check(DeadlineIn(std::chrono::seconds(30)));
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 3 died"), std::string::npos) << s;
}

// A store that answers every read with an error of its own.
class RefusingStore final : public testing::ForwardingStore {
 public:
  StatusOr<std::optional<std::string>> TryGet(std::string_view, Deadline) override {
    return PermissionDeniedError("the job token does not match");
  }
};

// An error the store answers with is told with its own code and words, not
// as the death of its server.
TEST(PeerMonitor, AStoreErrorKeepsItsCode) {
  RefusingStore store;
  PeerMonitor monitor({.rank = 1, .key_prefix = "j/", .store_rank = 0}, &store);
  Status s = monitor.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("the job token does not match"), std::string::npos) << s;
  EXPECT_NE(s.message().find("reading the job's abort state"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("died"), std::string::npos) << s;
}

TEST(PeerMonitor, DeadLocalPeerWithSilentStoreIsReportedByTheDeadline) {
  SilentStore store;
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), child}, .key_prefix = "j/"}, &store);
  KillAndReap(child);
  const auto start = Clock::now();
  Status s = monitor.Check(start + milliseconds(300));
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  // The store was asked to answer by the call's deadline, not by the cap.
  EXPECT_LE(store.latest_deadline() - start, milliseconds(300));
  EXPECT_LT(Clock::now() - start, milliseconds(300) + kLoadedSlack);
  // With no time left the local check still runs, without the store.
  const int calls = store.calls();
  EXPECT_EQ(monitor.Check(Clock::now()).code(), StatusCode::kPeerLost);
  EXPECT_EQ(store.calls(), calls);
}

TEST(PeerMonitor, PostingToASilentStoreEndsAtTheDeadline) {
  SilentStore store;
  PeerMonitor monitor({.rank = 1, .key_prefix = "j/"}, &store);
  const auto start = Clock::now();
  // Each call asks the store to answer by its own deadline.
  monitor.PostAbort(TimedOutError("t"), start + milliseconds(200));
  EXPECT_LE(store.latest_deadline() - start, milliseconds(200));
  EXPECT_TRUE(monitor.PostedAbort(start + milliseconds(300)).ok());
  EXPECT_LE(store.latest_deadline() - start, milliseconds(300));
  monitor.PostClosed(start + milliseconds(400));
  EXPECT_LE(store.latest_deadline() - start, milliseconds(400));
  const auto took = Clock::now() - start;
  EXPECT_GE(took, milliseconds(400));
  EXPECT_LT(took, milliseconds(400) + kLoadedSlack);
}

TEST(PeerMonitor, UnreachableStoreIsPeerLostOfItsServer) {
  DeadStore store;
  PeerMonitor monitor({.rank = 1, .key_prefix = "j/", .store_rank = 0}, &store);
  Status s = monitor.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 0 serves it"), std::string::npos) << s;
}

// When the server ended the connection (the TCP client's words), what the
// caller knows of the rank serving the store goes ahead of the store's
// words; other failures (here a bare reset) are told as they are, without
// asking.
TEST(PeerMonitor, AServerThatEndedTheConnectionIsDescribedByTheCaller) {
  int asked = 0;
  std::vector<bool> told;
  const auto describe = [&asked, &told](bool told_why) {
    ++asked;
    told.push_back(told_why);
    return std::string("rank 0, which serves the store (pid 7 on this host), has exited");
  };
  DeadStore ended("lost the connection to the store at h:1: connection reset (during the try-get of j/abort)");
  PeerMonitor monitor({.rank = 1, .key_prefix = "j/", .store_rank = 0, .describe_server = describe}, &ended);
  Status s = monitor.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 0 serves it, and has died or stopped serving it): UNAVAILABLE: rank 0, "
                             "which serves the store (pid 7 on this host), has exited; lost the connection "
                             "to the store at h:1"),
            std::string::npos)
      << s;
  EXPECT_EQ(asked, 1);

  DeadStore reset;
  PeerMonitor other({.rank = 1, .key_prefix = "j/", .store_rank = 0, .describe_server = describe}, &reset);
  s = other.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_EQ(s.message().find("has exited"), std::string::npos) << s;
  EXPECT_EQ(asked, 1);
  EXPECT_EQ(told, std::vector<bool>{false});
}

// The caller learns whether the server sent its stop notice before it went
// (its owner stopped it, and the store's words say why: a clean shutdown
// too, where the stop is not a clean one for the monitor because a split
// was aborted), so that it does not guess why the serving rank left.
TEST(PeerMonitor, TheCallerLearnsWhetherTheServerSaidWhyItStopped) {
  std::vector<bool> told;
  const auto describe = [&told](bool told_why) {
    told.push_back(told_why);
    return std::string("rank 0 is described");
  };
  for (const std::string& why :
       {std::string("lost the connection to the store at h:1: ") + std::string(store::wire::kStopNotice) +
            ": rank 0 of communicator 'x', which served the rendezvous store, was destroyed and stopped the store",
        std::string("lost the connection to the store at h:1: ") + std::string(store::wire::kStopNotice),
        std::string("lost the connection to the store at h:1: the server closed the connection"),
        // The notice's words inside other text (a communicator named so)
        // do not count: only right after the client's words.
        std::string("lost the connection to the store at h:1: the server closed the connection (during the "
                    "get of key 'r0/x: ") +
            std::string(store::wire::kStopNotice) + "/abort')"}) {
    DeadStore ended(why);
    PeerMonitor monitor({.rank = 1, .key_prefix = "j/", .store_rank = 0, .describe_server = describe}, &ended);
    const Status s = monitor.Check(Soon());
    EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
    EXPECT_NE(s.message().find("rank 0 is described; " + why), std::string::npos) << s;
  }
  EXPECT_EQ(told, (std::vector<bool>{true, true, false, false}));
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
  reporter.PostAbort(PeerLostError("rank 3 died"), Soon());
  kill(child, SIGKILL);  // rank 1 leaves after reporting
  waitpid(child, nullptr, 0);
  Status s = monitor.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kPeerLost);
  EXPECT_NE(s.message().find("rank 3 died"), std::string::npos) << s;
}

// A real store, served here, and a client of it for the monitor.
struct ServedStore {
  std::unique_ptr<store::TcpStoreServer> server;
  std::unique_ptr<store::TcpStoreClient> client;
};

ServedStore Serve() {
  ServedStore served;
  auto server = store::TcpStoreServer::Start({.job_token = "token"});
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return served;
  served.server = std::move(*server);
  auto client = store::TcpStoreClient::Connect("127.0.0.1", served.server->port(), "token", Soon());
  EXPECT_TRUE(client.ok()) << client.status();
  if (client.ok()) served.client = std::move(*client);
  return served;
}

// The same over the TCP store: the cut reason fits one request and one
// answer of the store's protocol.
TEST(PeerMonitor, AnAbortReasonPastTheStoresValueLimitReachesThePeersOverTcp) {
  ServedStore served = Serve();
  ASSERT_NE(served.client, nullptr);
  auto other = store::TcpStoreClient::Connect("127.0.0.1", served.server->port(), "token", Soon());
  ASSERT_TRUE(other.ok()) << other.status();
  PeerMonitor rank0({.rank = 0, .key_prefix = "j/"}, other->get());
  PeerMonitor rank1({.rank = 1, .key_prefix = "j/"}, served.client.get());
  rank1.PostAbort(TimedOutError("start " + std::string(2 * store::kMaxValueBytes, 'y')), Soon());
  const Status s = rank0.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s.message().substr(0, 200);
  EXPECT_TRUE(s.message().starts_with("rank 1 aborted the job: start yyy")) << s.message().substr(0, 200);
  EXPECT_TRUE(s.message().ends_with("value limit of " + std::to_string(store::kMaxValueBytes) + "]"))
      << s.message().substr(s.message().size() - 300);
}

// The reason rank 0's communicator gives when it stops the store it served
// at the end of a job that ended cleanly, with ranks still at their last
// collectives (a split of theirs running on).
const char kCleanStop[] =
    "rank 0 of communicator 'j', which served the rendezvous store, was destroyed after a clean "
    "shutdown and stopped the store after waiting 2000 ms for every rank to leave; ranks 1, 2 of "
    "communicator 'j' had not left (destroy every communicator on every rank before rank 0's)";

// A store stopped by its owner at the end of a job that ended cleanly is
// the end of abort information, not the loss of the rank serving it: the
// ranks of a split without it, finishing their last collectives, go on (it
// was PEER_LOST, "the rendezvous store cannot be reached"). A peer that
// exits after it is still lost to a wait for that very peer, which the
// store is not needed to tell, with a word that it may have closed first
// (its mark, if posted before the stop, cannot be read any more); one not
// awaited may have closed cleanly, its mark now unreadable.
TEST(PeerMonitor, AStoreStoppedAfterACleanShutdownIsNoLostPeer) {
  ServedStore served = Serve();
  ASSERT_NE(served.client, nullptr);
  const pid_t child = SpawnSleeper();
  PeerMonitor monitor({.rank = 1, .local_pids = {0, getpid(), child}, .key_prefix = "j/", .store_rank = -2},
                      served.client.get());
  Status s = monitor.Check(Soon());
  ASSERT_TRUE(s.ok()) << s;
  served.server->Stop(kCleanStop);
  for (int round = 0; round < 3; ++round) {
    s = monitor.Check(Soon());
    EXPECT_TRUE(s.ok()) << "round " << round << ": " << s;
  }
  KillAndReap(child);
  for (int round = 0; round < 3; ++round) {
    s = monitor.Check(Soon());
    EXPECT_TRUE(s.ok()) << "round " << round << ", rank 2 not awaited: " << s;
  }
  s = monitor.Check(Soon(), 2);
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 2 (pid " + std::to_string(child) + " on this host) exited while this rank "
                             "waited for it; it may have closed its communicator and left the job early"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("the rendezvous store was stopped after a clean shutdown"), std::string::npos) << s;
  EXPECT_EQ(monitor.lost_peer(), 2);
}

// Where the store's rank is a member of this communicator, it stopped the
// store only after destroying its communicators, this one included: a wait
// for it, or one that does not say whom it waits for, would never end, and
// is PEER_LOST naming that rank with the stop's reason (it waited on). A
// wait for other ranks only goes on.
TEST(PeerMonitor, AStoreStoppedAfterACleanShutdownLosesItsRankToAWaitForIt) {
  ServedStore served = Serve();
  ASSERT_NE(served.client, nullptr);
  PeerMonitor monitor({.rank = 1, .key_prefix = "j/", .store_rank = 0}, served.client.get());
  ASSERT_TRUE(monitor.Check(Soon(), 0).ok());
  served.server->Stop(kCleanStop);
  const std::vector<int> others = {2, 3};
  const std::vector<int> with_it = {2, 0};
  for (int round = 0; round < 2; ++round) {
    Status s = monitor.Check(Soon(), others);
    EXPECT_TRUE(s.ok()) << "round " << round << ": " << s;
    for (const Status& lost : {monitor.Check(Soon(), 0), monitor.Check(Soon(), with_it), monitor.Check(Soon())}) {
      EXPECT_EQ(lost.code(), StatusCode::kPeerLost) << "round " << round << ": " << lost;
      EXPECT_NE(lost.message().find("rank 0, which served the rendezvous store, left this communicator"),
                std::string::npos)
          << lost;
      EXPECT_NE(lost.message().find(kCleanStop), std::string::npos) << lost;
    }
  }
}

// Stopped after an abort (whose reason went with the store), or without a
// word, the store's end is still told as the loss of its server, with the
// reason its owner gave: a rank that had not read the abort must not wait on.
TEST(PeerMonitor, AStoreStoppedAfterAnAbortOrWithoutAReasonIsStillLost) {
  for (const std::string& why :
       {std::string("rank 0 of communicator 'j', which served the rendezvous store, was destroyed after the job "
                    "was aborted and stopped the store"),
        std::string()}) {
    ServedStore served = Serve();
    ASSERT_NE(served.client, nullptr);
    PeerMonitor monitor({.rank = 1, .key_prefix = "j/", .store_rank = 0}, served.client.get());
    ASSERT_TRUE(monitor.Check(Soon()).ok());
    if (why.empty()) {
      served.server->Stop();
    } else {
      served.server->Stop(why);
    }
    for (int round = 0; round < 2; ++round) {
      Status s = monitor.Check(Soon());
      EXPECT_EQ(s.code(), StatusCode::kPeerLost) << "round " << round << ": " << s;
      EXPECT_NE(s.message().find("the rendezvous store cannot be reached (rank 0 serves it"), std::string::npos) << s;
      EXPECT_NE(s.message().find("the store server is shutting down" + (why.empty() ? "" : ": " + why)),
                std::string::npos)
          << s;
    }
  }
}

TEST(PeerMonitor, UnreachableStoreServedOutsideTheGroupOrByALauncherSaysWho) {
  DeadStore store;
  PeerMonitor split_off({.rank = 1, .key_prefix = "j/", .store_rank = -2}, &store);
  Status s = split_off.Check(Soon());
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 0 of the communicator this one was split from"), std::string::npos) << s;
  PeerMonitor launched({.rank = 1, .key_prefix = "j/", .store_rank = -1}, &store);
  s = launched.Check(Soon());
  EXPECT_NE(s.message().find("the launcher serves it"), std::string::npos) << s;
}

}  // namespace
}  // namespace ddp::transport::fault
