#include "transport/ucx/ucx_p2p.h"

#include <sys/resource.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <future>
#include <numeric>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ddp::transport::ucx {
namespace {

using std::chrono::milliseconds;

// N ranks in this process, each with its own context and worker, connected
// all-to-all over shared memory. Each rank is driven by its own thread.
std::vector<std::unique_ptr<UcxPointToPoint>> MakeRanks(int n, IdleMode idle = IdleMode::kSpin,
                                                        milliseconds recall_grace = P2pOptions{}.recall_grace,
                                                        milliseconds watchdog_period = P2pOptions{}.watchdog_period,
                                                        int polls_per_clock_read = P2pOptions{}.polls_per_clock_read) {
  std::vector<std::unique_ptr<UcxPointToPoint>> ranks;
  std::vector<std::string> addresses;
  for (int r = 0; r < n; ++r) {
    auto context = Context::Create({.default_tls = "sm,self", .wakeup = idle == IdleMode::kSleep});
    EXPECT_TRUE(context.ok()) << context.status();
    auto p2p = UcxPointToPoint::Create(*context, {.rank = r, .size = n, .idle_mode = idle,
                                                  .idle_polls_before_backoff = 64,
                                                  .polls_per_clock_read = polls_per_clock_read,
                                                  .watchdog_period = watchdog_period,
                                                  .recall_grace = recall_grace});
    EXPECT_TRUE(p2p.ok()) << p2p.status();
    addresses.push_back((*p2p)->address());
    ranks.push_back(std::move(*p2p));
  }
  for (auto& rank : ranks) EXPECT_TRUE(rank->Connect(addresses).ok());
  return ranks;
}

// Sets environment variables while in scope (UCX reads its configuration
// when a context and its worker are created), then restores them.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::vector<std::pair<std::string, std::string>>& vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name.c_str());
      saved_.emplace_back(name, old != nullptr ? std::optional<std::string>(old) : std::nullopt);
      setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, old] : saved_) {
      if (old.has_value()) {
        setenv(name.c_str(), old->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

void RunRanks(std::vector<std::unique_ptr<UcxPointToPoint>>& ranks,
              const std::function<void(UcxPointToPoint&)>& body) {
  std::vector<std::thread> threads;
  for (auto& rank : ranks) threads.emplace_back([&body, &rank] { body(*rank); });
  for (auto& t : threads) t.join();
}

// An idle sleep's epoll timeout stays a positive int however far the
// deadline and the watchdog period are: narrowed as it was, 30 days each
// became a negative timeout, which epoll_wait takes as none.
TEST(UcxPointToPoint, AnIdleSleepsTimeoutIsClampedToAnInt) {
  using std::chrono::hours;
  using std::chrono::milliseconds;
  EXPECT_EQ(UcxPointToPoint::SleepMilliseconds(hours(24 * 30), hours(24 * 30)), std::numeric_limits<int>::max());
  EXPECT_EQ(UcxPointToPoint::SleepMilliseconds(milliseconds::max(), milliseconds::max()),
            std::numeric_limits<int>::max());
  EXPECT_EQ(UcxPointToPoint::SleepMilliseconds(hours(24 * 30), milliseconds(7)), 7);
  EXPECT_EQ(UcxPointToPoint::SleepMilliseconds(milliseconds(3), hours(24 * 30)), 3);
  EXPECT_EQ(UcxPointToPoint::SleepMilliseconds(milliseconds(-5), milliseconds(100)), 0);
}

TEST(UcxPointToPoint, ExchangesMessagesOfEverySize) {
  for (IdleMode idle : {IdleMode::kSpin, IdleMode::kYield, IdleMode::kSleep}) {
    auto ranks = MakeRanks(2, idle);
    // 0 bytes, tiny, eager, and large enough for rendezvous.
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{4097}, size_t{3} << 20}) {
      RunRanks(ranks, [bytes](UcxPointToPoint& p2p) {
        const int peer = 1 - p2p.rank();
        std::vector<uint8_t> out(bytes), in(bytes, 0xEE);
        for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(i * 7 + p2p.rank());
        auto recv = p2p.PostRecv(peer, 5, in.data(), bytes);
        auto send = p2p.PostSend(peer, 5, out.data(), bytes);
        ASSERT_TRUE(recv.ok() && send.ok());
        p2p::RequestId ids[] = {*recv, *send};
        ASSERT_TRUE(p2p.WaitAll(ids, DeadlineIn(milliseconds(10000))).ok());
        for (size_t i = 0; i < bytes; ++i) {
          ASSERT_EQ(in[i], static_cast<uint8_t>(i * 7 + peer)) << "byte " << i;
        }
      });
    }
  }
}

TEST(UcxPointToPoint, SendToSelf) {
  auto ranks = MakeRanks(1);
  UcxPointToPoint& p2p = *ranks[0];
  int out = 42, in = 0;
  auto send = p2p.PostSend(0, 1, &out, sizeof(out));
  auto recv = p2p.PostRecv(0, 1, &in, sizeof(in));
  ASSERT_TRUE(send.ok() && recv.ok());
  p2p::RequestId ids[] = {*send, *recv};
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(5000)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(in, 42);
}

TEST(UcxPointToPoint, SameTagFromTwoPeersMatchesPerPeer) {
  auto ranks = MakeRanks(3);
  RunRanks(ranks, [](UcxPointToPoint& p2p) {
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    if (p2p.rank() == 2) {
      // Post the receive from rank 1 first; rank 0's message must not land in it.
      int from1 = 0, from0 = 0;
      auto r1 = p2p.PostRecv(1, 9, &from1, sizeof(int));
      auto r0 = p2p.PostRecv(0, 9, &from0, sizeof(int));
      ASSERT_TRUE(r1.ok() && r0.ok());
      p2p::RequestId ids[] = {*r1, *r0};
      ASSERT_TRUE(p2p.WaitAll(ids, deadline).ok());
      EXPECT_EQ(from1, 1001);
      EXPECT_EQ(from0, 1000);
    } else {
      if (p2p.rank() == 1) std::this_thread::sleep_for(milliseconds(50));
      int value = 1000 + p2p.rank();
      auto s = p2p.PostSend(2, 9, &value, sizeof(int));
      ASSERT_TRUE(s.ok());
      p2p::RequestId ids[] = {*s};
      ASSERT_TRUE(p2p.WaitAll(ids, deadline).ok());
    }
  });
}

TEST(UcxPointToPoint, ShorterMessageIsASizeMismatchNamingThePeer) {
  auto ranks = MakeRanks(2);
  RunRanks(ranks, [](UcxPointToPoint& p2p) {
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    std::vector<float> buffer(100);
    if (p2p.rank() == 0) {
      auto r = p2p.PostRecv(1, 3, buffer.data(), 100 * sizeof(float));
      ASSERT_TRUE(r.ok());
      p2p::RequestId ids[] = {*r};
      Status s = p2p.WaitAll(ids, deadline);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find("rank 1 sent 200 bytes"), std::string::npos) << s;
    } else {
      auto r = p2p.PostSend(0, 3, buffer.data(), 50 * sizeof(float));
      ASSERT_TRUE(r.ok());
      p2p::RequestId ids[] = {*r};
      ASSERT_TRUE(p2p.WaitAll(ids, deadline).ok());
    }
  });
}

TEST(UcxPointToPoint, LongerMessageIsASizeMismatch) {
  auto ranks = MakeRanks(2);
  RunRanks(ranks, [](UcxPointToPoint& p2p) {
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    std::vector<float> buffer(100);
    if (p2p.rank() == 0) {
      auto r = p2p.PostRecv(1, 3, buffer.data(), 10 * sizeof(float));
      ASSERT_TRUE(r.ok());
      p2p::RequestId ids[] = {*r};
      Status s = p2p.WaitAll(ids, deadline);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;
    } else {
      auto r = p2p.PostSend(0, 3, buffer.data(), 100 * sizeof(float));
      ASSERT_TRUE(r.ok());
      p2p::RequestId ids[] = {*r};
      p2p.WaitAll(ids, deadline).IgnoreError();  // eager: completes locally
    }
  });
}

// The first request finishes with an error while the second is still
// pending: the wait fails with that error at once, not at the deadline with
// the second one's time-out.
TEST(UcxPointToPoint, WaitAllFailsAtOnceWhenItsFirstRequestFails) {
  auto ranks = MakeRanks(3);
  RunRanks(ranks, [](UcxPointToPoint& p2p) {
    std::vector<float> buffer(100);
    if (p2p.rank() == 0) {
      int never_sent = 0;
      auto truncated = p2p.PostRecv(1, 3, buffer.data(), 10 * sizeof(float));
      auto pending = p2p.PostRecv(2, 4, &never_sent, sizeof(never_sent));
      ASSERT_TRUE(truncated.ok() && pending.ok());
      p2p::RequestId ids[] = {*truncated, *pending};
      const auto start = Clock::now();
      Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(10000)));
      const auto waited = Clock::now() - start;
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find("from rank 1 (tag 3)"), std::string::npos) << s;
      EXPECT_LT(waited, milliseconds(5000)) << s;
    } else if (p2p.rank() == 1) {
      auto r = p2p.PostSend(0, 3, buffer.data(), 100 * sizeof(float));
      ASSERT_TRUE(r.ok());
      p2p::RequestId ids[] = {*r};
      p2p.WaitAll(ids, DeadlineIn(milliseconds(10000))).IgnoreError();  // eager
    }
  });
}

TEST(UcxPointToPoint, MissingSenderTimesOutNamingThePeer) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  int value = 0;
  auto r = p2p.PostRecv(1, 77, &value, sizeof(value));
  ASSERT_TRUE(r.ok());
  p2p::RequestId ids[] = {*r};
  const auto start = Clock::now();
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(200)));
  const auto waited = Clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_NE(s.message().find("from rank 1"), std::string::npos) << s;
  EXPECT_GE(waited, milliseconds(200));
  EXPECT_LT(waited, milliseconds(1000));
  // The handle is released: using it again is an error, not a crash.
  EXPECT_EQ(p2p.Test(*r).status().code(), StatusCode::kInvalidArgument);
}

// The poll that finds a wait's deadline passed may itself complete what the
// wait needs; the wait then succeeded (it was reported TIMED_OUT). Made
// deterministic: the clock is read at every poll, the deadline has passed
// before the wait begins, and the message already sits in rank 0's
// shared-memory queue, so the wait's first poll both receives it and
// finds the deadline passed. For WaitAll and WaitAny.
TEST(UcxPointToPoint, ARequestThatThePollMeetingTheDeadlineCompletesSucceeds) {
  for (bool any : {false, true}) {
    auto ranks = MakeRanks(2, IdleMode::kSpin, P2pOptions{}.recall_grace,
                           P2pOptions{}.watchdog_period, /*polls_per_clock_read=*/1);
    int in = 0;
    const int out = 42;
    auto recv = ranks[0]->PostRecv(1, 7, &in, sizeof(in));
    ASSERT_TRUE(recv.ok()) << recv.status();
    // An eager send completes without the receiver's progress.
    auto send = ranks[1]->PostSend(0, 7, &out, sizeof(out));
    ASSERT_TRUE(send.ok()) << send.status();
    p2p::RequestId sent[] = {*send};
    ASSERT_TRUE(ranks[1]->WaitAll(sent, DeadlineIn(milliseconds(10000))).ok());
    ASSERT_EQ(in, 0) << "received before rank 0's wait polled";
    p2p::RequestId ids[] = {*recv};
    const Deadline passed = Clock::now() - milliseconds(1);
    Status s = any ? ranks[0]->WaitAny(ids, passed).status() : ranks[0]->WaitAll(ids, passed);
    EXPECT_TRUE(s.ok()) << (any ? "WaitAny: " : "WaitAll: ") << s;
    EXPECT_EQ(in, 42);
  }
}

// Past the deadline, a WaitAll whose first request completed names the one
// still pending, not the first.
TEST(UcxPointToPoint, TimeoutNamesTheRequestStillPending) {
  auto ranks = MakeRanks(2, IdleMode::kSpin, P2pOptions{}.recall_grace,
                         P2pOptions{}.watchdog_period, /*polls_per_clock_read=*/1);
  int first = 0, second = 0;
  const int out = 5;
  auto r1 = ranks[0]->PostRecv(1, 30, &first, sizeof(first));
  auto r2 = ranks[0]->PostRecv(1, 31, &second, sizeof(second));
  ASSERT_TRUE(r1.ok() && r2.ok());
  auto send = ranks[1]->PostSend(0, 30, &out, sizeof(out));
  ASSERT_TRUE(send.ok()) << send.status();
  p2p::RequestId sent[] = {*send};
  ASSERT_TRUE(ranks[1]->WaitAll(sent, DeadlineIn(milliseconds(10000))).ok());
  p2p::RequestId ids[] = {*r1, *r2};
  Status s = ranks[0]->WaitAll(ids, Clock::now() - milliseconds(1));
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_NE(s.message().find("(tag 31)"), std::string::npos) << s;
  EXPECT_EQ(first, 5);
}

// The poll that finds the deadline passed may also be the one in which a
// request fails: that failure is the cause, reported instead of the time-out
// of another request still pending. Made deterministic as above: rank 1's
// eager message, longer than the receive (a truncation), already sits in
// rank 0's queue when a wait whose deadline has passed polls once.
TEST(UcxPointToPoint, AFailureInThePollMeetingTheDeadlineWinsOverTheTimeOut) {
  for (bool any : {false, true}) {
    auto ranks = MakeRanks(2, IdleMode::kSpin, P2pOptions{}.recall_grace,
                           P2pOptions{}.watchdog_period, /*polls_per_clock_read=*/1);
    std::vector<float> small(10), large(100, 1.0f);
    int never_sent = 0;
    auto truncated = ranks[0]->PostRecv(1, 40, small.data(), small.size() * sizeof(float));
    auto pending = ranks[0]->PostRecv(1, 41, &never_sent, sizeof(never_sent));
    ASSERT_TRUE(truncated.ok() && pending.ok());
    auto send = ranks[1]->PostSend(0, 40, large.data(), large.size() * sizeof(float));
    ASSERT_TRUE(send.ok()) << send.status();
    p2p::RequestId sent[] = {*send};
    ranks[1]->WaitAll(sent, DeadlineIn(milliseconds(10000))).IgnoreError();  // eager
    p2p::RequestId ids[] = {*pending, *truncated};
    const Deadline passed = Clock::now() - milliseconds(1);
    Status s = any ? ranks[0]->WaitAny(ids, passed).status() : ranks[0]->WaitAll(ids, passed);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << (any ? "WaitAny: " : "WaitAll: ") << s;
    EXPECT_NE(s.message().find("from rank 1 (tag 40)"), std::string::npos) << s;
    if (any) ranks[0]->Cancel(*pending);
  }
}

// What rank 0's wait in WaitDuringAFlood returned.
struct FloodedWait {
  Status status;
  Clock::duration waited{};
  bool flood_ran_throughout = false;
};

// Rank 1 floods rank 0 with messages on a tag nobody receives while rank 0
// waits, with a 1 s deadline and `watchdog`, for a message that never comes.
// Every poll of rank 0's worker then finds work.
//
// The flood has to stay ahead of rank 0 for the whole wait, also while rank
// 1 is off the core on a loaded machine, without piling up gigabytes of
// unexpected messages at rank 0. So rank 0 first posts receives whose tags
// share the flood's bucket in UCX's table of posted receives (UCX 1.13
// hashes the tag's low and high 32 bits, each modulo 1021): each flood
// message then costs rank 0 a scan of 20000 receives (~0.1-1 ms), and rank
// 0's shared-memory queue, enlarged to 8192 messages, holds rank 1's
// backlog of a second or more. The flood lasts until the wait ends, or
// 10 s.
//
// Rank 0 reads the clock once in `polls_per_clock_read` polls. Each poll
// here takes up to 16 messages at up to 1 ms each, so with the default (16)
// reads come up to ~250 ms of CPU time apart: enough for the deadline, but
// on a loaded 2-core host (rank 0 on a core a tenth of the time) a 1 s wait
// saw only 1 to 4 watchdog calls. The tests that count watchdog calls read
// the clock at every poll.
FloodedWait WaitDuringAFlood(std::function<Status(Deadline, std::span<const int>)> watchdog,
                             int polls_per_clock_read = P2pOptions{}.polls_per_clock_read) {
  constexpr p2p::Tag kFlood = 7, kNeverSent = 3, kDone = 4;
  constexpr int kDecoys = 20000;
  std::vector<std::unique_ptr<UcxPointToPoint>> ranks;
  {
    ScopedEnv fifo({{"UCX_POSIX_FIFO_SIZE", "8192"}, {"UCX_SYSV_FIFO_SIZE", "8192"}});
    ranks = MakeRanks(2, IdleMode::kSpin, P2pOptions{}.recall_grace, P2pOptions{}.watchdog_period,
                      polls_per_clock_read);
  }
  ranks[0]->SetWatchdog(std::move(watchdog));
  FloodedWait result;
  std::atomic<bool> flooding{false}, stop{false};
  RunRanks(ranks, [&](UcxPointToPoint& p2p) {
    const Deadline deadline = DeadlineIn(milliseconds(30000));
    if (p2p.rank() == 0) {
      uint64_t sink = 0;
      std::vector<p2p::RequestId> decoys;
      for (int i = 1; i <= kDecoys && decoys.size() == static_cast<size_t>(i - 1); ++i) {
        auto r = p2p.PostRecv(1, kFlood + p2p::Tag{1021} * i, &sink, sizeof(sink));
        EXPECT_TRUE(r.ok()) << r.status();
        if (r.ok()) decoys.push_back(*r);
      }
      int value = 0;
      auto r = p2p.PostRecv(1, kNeverSent, &value, sizeof(value));
      EXPECT_TRUE(r.ok()) << r.status();
      flooding = true;
      if (r.ok()) {
        p2p::RequestId ids[] = {*r};
        const auto start = Clock::now();
        result.status = p2p.WaitAll(ids, DeadlineIn(milliseconds(1000)));
        result.waited = Clock::now() - start;
        result.flood_ran_throughout = !stop.exchange(true);
      }
      stop = true;
      p2p.SetWatchdog(nullptr);
      // In posting order: UCX finds each at the head of its bucket.
      for (p2p::RequestId id : decoys) p2p.Cancel(id);
      // Takes in the rest of the flood until rank 1 is done.
      int done = 0;
      auto d = p2p.PostRecv(1, kDone, &done, sizeof(done));
      ASSERT_TRUE(d.ok()) << d.status();
      p2p::RequestId last[] = {*d};
      EXPECT_TRUE(p2p.WaitAll(last, deadline).ok());
    } else {
      while (!flooding && Clock::now() < deadline) std::this_thread::yield();
      const Deadline flood_until = DeadlineIn(milliseconds(10000));
      uint64_t payload = 0;
      std::vector<p2p::RequestId> in_flight;
      Status s;
      while (s.ok() && !stop && Clock::now() < flood_until) {
        auto id = p2p.PostSend(0, kFlood, &payload, sizeof(payload));
        s = id.status();
        if (id.ok()) in_flight.push_back(*id);
        if (in_flight.size() >= 512) {
          s = p2p.WaitAll(std::span(in_flight).first(256), deadline);
          in_flight.erase(in_flight.begin(), in_flight.begin() + 256);
        }
      }
      stop = true;
      EXPECT_TRUE(s.ok()) << s;
      Status flushed = p2p.WaitAll(in_flight, deadline);
      EXPECT_TRUE(flushed.ok()) << flushed;
      int done = 1;
      auto d = p2p.PostSend(0, kDone, &done, sizeof(done));
      ASSERT_TRUE(d.ok()) << d.status();
      p2p::RequestId last[] = {*d};
      EXPECT_TRUE(p2p.WaitAll(last, deadline).ok());
    }
  });
  return result;
}

TEST(UcxPointToPoint, DeadlinePassesWhileAPeerFloodsAnotherTag) {
  FloodedWait wait = WaitDuringAFlood([](Deadline, std::span<const int>) { return Status::Ok(); });
  EXPECT_EQ(wait.status.code(), StatusCode::kTimedOut) << wait.status;
  EXPECT_GE(wait.waited, milliseconds(1000));
  EXPECT_LT(wait.waited, milliseconds(4000));
  EXPECT_TRUE(wait.flood_ran_throughout) << "the flood ended before the wait did";
}

TEST(UcxPointToPoint, WatchdogRunsEveryPeriodWhileAPeerFloodsAnotherTag) {
  std::atomic<int> watchdog_calls{0};
  FloodedWait wait = WaitDuringAFlood(
      [&watchdog_calls](Deadline, std::span<const int>) {
        ++watchdog_calls;
        return Status::Ok();
      },
      /*polls_per_clock_read=*/1);
  EXPECT_EQ(wait.status.code(), StatusCode::kTimedOut) << wait.status;
  EXPECT_GE(wait.waited, milliseconds(1000));
  // Every 100 ms once the wait has lasted a millisecond.
  EXPECT_GE(watchdog_calls.load(), 5)
      << "in a wait of " << std::chrono::duration_cast<milliseconds>(wait.waited).count() << " ms";
  EXPECT_TRUE(wait.flood_ran_throughout) << "the flood ended before the wait did";
}

TEST(UcxPointToPoint, WatchdogFailureEndsAWaitWhileAPeerFloodsAnotherTag) {
  // The wait drains what already arrived before giving up, but not for as
  // long as the flood goes on.
  std::atomic<int> watchdog_calls{0};
  FloodedWait wait = WaitDuringAFlood(
      [&watchdog_calls](Deadline, std::span<const int>) -> Status {
        if (++watchdog_calls >= 2) return AbortedError("rank 1 posted: PEER_LOST rank 1 died");
        return Status::Ok();
      },
      /*polls_per_clock_read=*/1);
  EXPECT_EQ(wait.status.code(), StatusCode::kAborted) << wait.status;
  EXPECT_LT(wait.waited, milliseconds(4000));
  EXPECT_TRUE(wait.flood_ran_throughout) << "the flood ended before the wait did";
}

TEST(UcxPointToPoint, WatchdogEndsAWait) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  std::atomic<int> calls{0};
  Deadline seen{};
  p2p.SetWatchdog([&calls, &seen](Deadline deadline, std::span<const int>) -> Status {
    seen = deadline;
    if (++calls >= 2) return AbortedError("rank 1 posted: PEER_LOST rank 1 died");
    return Status::Ok();
  });
  int value = 0;
  auto r = p2p.PostRecv(1, 1, &value, sizeof(value));
  ASSERT_TRUE(r.ok());
  p2p::RequestId ids[] = {*r};
  const Deadline deadline = DeadlineIn(milliseconds(10000));
  Status s = p2p.WaitAll(ids, deadline);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
  EXPECT_GE(calls.load(), 2);
  // The watchdog is told the wait's deadline, so that it returns by then.
  EXPECT_EQ(seen, deadline);
}

// In sleep mode, a request that the drain after a failed watchdog completed
// is returned at once, not after a sleep on the event fd (the drain took the
// events, so nothing would wake it before the next watchdog period).
TEST(UcxPointToPoint, SleepingWaitAnyReturnsWhatTheWatchdogDrainCompletedAtOnce) {
  auto ranks = MakeRanks(2, IdleMode::kSleep, P2pOptions{}.recall_grace, milliseconds(2000));
  UcxPointToPoint& p2p = *ranks[0];
  UcxPointToPoint& peer = *ranks[1];
  int got = 0, sent = 5;
  Status send_status;
  Clock::time_point watchdog_returned{};
  p2p.SetWatchdog([&](Deadline deadline, std::span<const int>) -> Status {
    if (watchdog_returned == Clock::time_point{}) {
      // Rank 1 sends now (on this thread: nothing else drives it), and the
      // message reaches rank 0 in the drain.
      auto id = peer.PostSend(0, 1, &sent, sizeof(sent));
      send_status = id.status();
      if (id.ok()) {
        p2p::RequestId ids[] = {*id};
        send_status = peer.WaitAll(ids, deadline);
      }
    }
    watchdog_returned = Clock::now();
    return AbortedError("rank 1 posted: PEER_LOST rank 1 died");
  });
  auto r = p2p.PostRecv(1, 1, &got, sizeof(got));
  ASSERT_TRUE(r.ok());
  p2p::RequestId ids[] = {*r};
  auto index = p2p.WaitAny(ids, DeadlineIn(milliseconds(20000)));
  const auto after_watchdog = Clock::now() - watchdog_returned;
  ASSERT_TRUE(send_status.ok()) << send_status;
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(got, 5);
  // A sleep would last the watchdog period (2 s).
  EXPECT_LT(after_watchdog, milliseconds(1000));
  p2p.SetWatchdog(nullptr);
}

// In sleep mode too the watchdog first runs once the wait has lasted a
// millisecond: a sleep on the event fd ends when the watchdog is due. It
// used to sleep a whole period first (here 10 s, past the wait's 5 s
// deadline: TIMED_OUT instead of the abort the watchdog reports).
TEST(UcxPointToPoint, SleepingWaitRunsTheWatchdogAfterAMillisecondNotAPeriod) {
  auto ranks = MakeRanks(2, IdleMode::kSleep, P2pOptions{}.recall_grace, milliseconds(10000));
  UcxPointToPoint& p2p = *ranks[0];
  std::atomic<int> calls{0};
  p2p.SetWatchdog([&calls](Deadline, std::span<const int>) -> Status {
    ++calls;
    return AbortedError("rank 1 posted: PEER_LOST rank 1 died");
  });
  int value = 0;
  auto r = p2p.PostRecv(1, 1, &value, sizeof(value));
  ASSERT_TRUE(r.ok()) << r.status();
  p2p::RequestId ids[] = {*r};
  const auto start = Clock::now();
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(5000)));
  const auto waited = Clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
  EXPECT_EQ(calls.load(), 1);
  // About a millisecond, with room for a loaded host.
  EXPECT_LT(waited, milliseconds(2500));
  p2p.SetWatchdog(nullptr);
}

// The watchdog's first failure comes while the drain takes in the request
// waited for; the wait then needs another. It used to drop the report and
// run the watchdog again only a period later, past this wait's deadline.
TEST(UcxPointToPoint, WatchdogFailureIsCheckedAgainWhenTheDrainFinishesTheAwaitedRequest) {
  auto ranks = MakeRanks(2, IdleMode::kSpin, P2pOptions{}.recall_grace, milliseconds(5000));
  UcxPointToPoint& p2p = *ranks[0];
  UcxPointToPoint& peer = *ranks[1];
  int first = 0, second = 0, sent = 5;
  std::atomic<int> calls{0};
  Status send_status;
  p2p.SetWatchdog([&](Deadline deadline, std::span<const int>) -> Status {
    if (++calls == 1) {
      // Rank 1 sends the first message now (on this thread: nothing else
      // drives it), so that it reaches rank 0 in the drain.
      auto id = peer.PostSend(0, 1, &sent, sizeof(sent));
      send_status = id.status();
      if (id.ok()) {
        p2p::RequestId ids[] = {*id};
        send_status = peer.WaitAll(ids, deadline);
      }
    }
    return AbortedError("rank 1 posted: PEER_LOST rank 1 died");
  });
  auto r1 = p2p.PostRecv(1, 1, &first, sizeof(first));
  auto r2 = p2p.PostRecv(1, 2, &second, sizeof(second));
  ASSERT_TRUE(r1.ok() && r2.ok());
  p2p::RequestId ids[] = {*r1, *r2};
  const auto start = Clock::now();
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(2000)));
  const auto waited = Clock::now() - start;
  ASSERT_TRUE(send_status.ok()) << send_status;
  EXPECT_EQ(first, 5);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
  EXPECT_GE(calls.load(), 2);
  EXPECT_LT(waited, milliseconds(2000));
  p2p.SetWatchdog(nullptr);
}

TEST(UcxPointToPoint, PeerMarkedLostFailsPendingAndLaterOperations) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  int value = 0;
  auto r = p2p.PostRecv(1, 1, &value, sizeof(value));
  ASSERT_TRUE(r.ok());
  std::thread marker([&p2p] {
    std::this_thread::sleep_for(milliseconds(50));
  });
  marker.join();
  p2p.MarkPeerLost(1, PeerLostError("rank 1 exited"));
  p2p::RequestId ids[] = {*r};
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(5000)));
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;
  EXPECT_EQ(p2p.PostSend(1, 1, &value, 4).status().code(), StatusCode::kPeerLost);
}

// Two ranks over TCP, as on two hosts (peer error mode), connected, with a
// message each way already exchanged.
std::vector<std::unique_ptr<UcxPointToPoint>> MakeTcpPair() {
  std::vector<std::unique_ptr<UcxPointToPoint>> ranks;
  std::vector<std::string> addresses;
  for (int r = 0; r < 2; ++r) {
    auto context = Context::Create({.default_tls = "tcp,self"});
    EXPECT_TRUE(context.ok()) << context.status();
    if (!context.ok()) return {};
    auto p2p = UcxPointToPoint::Create(*context, {.rank = r, .size = 2});
    EXPECT_TRUE(p2p.ok()) << p2p.status();
    if (!p2p.ok()) return {};
    addresses.push_back((*p2p)->address());
    ranks.push_back(std::move(*p2p));
  }
  for (int r = 0; r < 2; ++r) {
    std::vector<bool> same_host(2, false);
    same_host[r] = true;
    EXPECT_TRUE(ranks[r]->Connect(addresses, same_host).ok()) << "rank " << r;
  }
  // Several rounds, small and large: UCX 1.13 asserts when an endpoint
  // fails while its wireup messages are still going, which the first round
  // may leave, and a peer torn down while the lanes of large messages
  // (wired on their first use) still had a wireup reply queued aborted in
  // ucp_worker_destroy (the tests below send 1 and 4 MiB).
  RunRanks(ranks, [](UcxPointToPoint& p2p) {
    for (int round = 0; round < 4; ++round) {
      const size_t bytes = round % 2 == 0 ? sizeof(int) : size_t{4} << 20;
      std::vector<uint8_t> out(bytes, static_cast<uint8_t>(p2p.rank())), in(bytes);
      auto recv = p2p.PostRecv(1 - p2p.rank(), 3, in.data(), bytes);
      auto send = p2p.PostSend(1 - p2p.rank(), 3, out.data(), bytes);
      ASSERT_TRUE(recv.ok() && send.ok());
      p2p::RequestId ids[] = {*recv, *send};
      ASSERT_TRUE(p2p.WaitAll(ids, DeadlineIn(milliseconds(10000))).ok())
          << "rank " << p2p.rank();
      ASSERT_EQ(in[bytes - 1], static_cast<uint8_t>(1 - p2p.rank()));
    }
  });
  return ranks;
}

// A post to a lost peer names this post (its peer and tag), then the reason
// the peer was lost.
TEST(UcxPointToPoint, PostToALostPeerNamesThePostAndTheReason) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  p2p.MarkPeerLost(1, PeerLostError("rank 1 exited"));
  int v = 0;
  Status send = p2p.PostSend(1, 7, &v, sizeof(v)).status();
  EXPECT_EQ(send.code(), StatusCode::kPeerLost) << send;
  EXPECT_NE(send.message().find("send to rank 1 (tag 7)"), std::string::npos) << send;
  EXPECT_NE(send.message().find("rank 1 exited"), std::string::npos) << send;
  Status recv = p2p.PostUserRecv(1, 8, &v, sizeof(v)).status();
  EXPECT_NE(recv.message().find("receive from rank 1 (tag 8)"), std::string::npos) << recv;
  Status notice = p2p.PostNotice(1, 9, &v, sizeof(v));
  EXPECT_NE(notice.message().find("notice to rank 1 (tag 9)"), std::string::npos) << notice;
}

// A send that UCX completed with its endpoint's error names the send, as
// one still pending when its peer was lost does.
TEST(UcxPointToPoint, SendFailedByItsEndpointNamesTheSend) {
  auto ranks = MakeTcpPair();
  ASSERT_EQ(ranks.size(), 2u);
  // Rank 1 never receives it: the send waits for it until rank 1 goes.
  std::vector<uint8_t> big(size_t{1} << 20, 1);
  auto id = ranks[0]->PostSend(1, 5, big.data(), big.size());
  ASSERT_TRUE(id.ok()) << id.status();
  ranks[1]->Close(DeadlineIn(milliseconds(2000)), /*force_remote=*/true).IgnoreError();
  ranks[1].reset();
  p2p::RequestId ids[] = {*id};
  Status s = ranks[0]->WaitAll(ids, DeadlineIn(milliseconds(10000)));
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("send of 1048576 bytes to rank 1 (tag 5)"), std::string::npos) << s;
  ranks[0]->Close(DeadlineIn(milliseconds(2000)), /*force_remote=*/true).IgnoreError();
}

// Close with its deadline already passed still closes a remote endpoint by
// force and waits for UCX to confirm it (a bound of its own), instead of
// leaving it closing when the worker goes.
TEST(UcxPointToPoint, CloseAfterItsDeadlineStillConfirmsForcedCloses) {
  auto ranks = MakeTcpPair();
  ASSERT_EQ(ranks.size(), 2u);
  std::vector<uint8_t> big(size_t{4} << 20, 1);
  auto id = ranks[0]->PostSend(1, 5, big.data(), big.size());
  ASSERT_TRUE(id.ok()) << id.status();
  Status closed = ranks[0]->Close(Clock::now() - milliseconds(1), /*force_remote=*/true);
  EXPECT_TRUE(closed.ok()) << closed;
  ranks[1]->Close(DeadlineIn(milliseconds(2000)), /*force_remote=*/true).IgnoreError();
}

// UCX 1.13 refuses to force an endpoint without peer error mode (those to
// ranks on this host): Close says so, naming the rank, instead of calling
// the endpoint closed.
TEST(UcxPointToPoint, CloseReportsAnEndpointUcxRefusedToClose) {
  auto ranks = MakeRanks(2);
  ranks[0]->MarkPeerLost(1, PeerLostError("rank 1 exited"));
  Status s = ranks[0]->Close(DeadlineIn(milliseconds(2000)));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("forced close of the endpoint to rank 1 was refused"),
            std::string::npos)
      << s;
  EXPECT_TRUE(ranks[1]->Close(DeadlineIn(milliseconds(2000))).ok());
}

// With several such endpoints, Close names every one left open, not only
// the first.
TEST(UcxPointToPoint, CloseNamesEveryEndpointUcxRefusedToClose) {
  auto ranks = MakeRanks(3);
  ranks[0]->MarkPeerLost(1, PeerLostError("rank 1 exited"));
  ranks[0]->MarkPeerLost(2, PeerLostError("rank 2 exited"));
  Status s = ranks[0]->Close(DeadlineIn(milliseconds(2000)));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("forced close of the endpoint to rank 1 was refused"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("so was the close of the endpoint(s) to rank(s) 2"),
            std::string::npos)
      << s;
  for (int r : {1, 2}) EXPECT_TRUE(ranks[r]->Close(DeadlineIn(milliseconds(2000))).ok());
}

// Three ranks over TCP, as on three hosts (peer error mode). Rank 1 goes
// away (its endpoints closed by force, its worker destroyed): rank 0 lists
// it among the peers with failed endpoints once UCX has seen its connection
// break. Rank 2, only marked lost by rank 0, is not listed: it may be well.
TEST(UcxPointToPoint, PeersWithFailedEndpointsListsAPeerThatWentAwayNotOneOnlyMarkedLost) {
  constexpr int kRanks = 3;
  std::vector<std::unique_ptr<UcxPointToPoint>> ranks;
  std::vector<std::string> addresses;
  for (int r = 0; r < kRanks; ++r) {
    auto context = Context::Create({.default_tls = "tcp,self"});
    ASSERT_TRUE(context.ok()) << context.status();
    auto p2p = UcxPointToPoint::Create(*context, {.rank = r, .size = kRanks});
    ASSERT_TRUE(p2p.ok()) << p2p.status();
    addresses.push_back((*p2p)->address());
    ranks.push_back(std::move(*p2p));
  }
  for (int r = 0; r < kRanks; ++r) {
    std::vector<bool> same_host(kRanks, false);
    same_host[r] = true;
    ASSERT_TRUE(ranks[r]->Connect(addresses, same_host).ok()) << "rank " << r;
  }
  // A message each way between every pair, so that every connection is up.
  RunRanks(ranks, [](UcxPointToPoint& p2p) {
    std::vector<int> out(kRanks, p2p.rank()), in(kRanks, -1);
    std::vector<p2p::RequestId> ids;
    for (int peer = 0; peer < kRanks; ++peer) {
      if (peer == p2p.rank()) continue;
      auto recv = p2p.PostRecv(peer, 3, &in[peer], sizeof(int));
      auto send = p2p.PostSend(peer, 3, &out[peer], sizeof(int));
      ASSERT_TRUE(recv.ok() && send.ok());
      ids.push_back(*recv);
      ids.push_back(*send);
    }
    ASSERT_TRUE(p2p.WaitAll(ids, DeadlineIn(milliseconds(10000))).ok()) << "rank " << p2p.rank();
  });
  EXPECT_TRUE(ranks[0]->PeersWithFailedEndpoints().empty());
  ranks[0]->MarkPeerLost(2, PeerLostError("rank 2 given up by the test"));
  ranks[1]->Close(DeadlineIn(milliseconds(2000)), /*force_remote=*/true).IgnoreError();
  ranks[1].reset();
  std::vector<int> failed;
  const Deadline deadline = DeadlineIn(milliseconds(10000));
  while (failed.empty() && Clock::now() < deadline) {
    failed = ranks[0]->PeersWithFailedEndpoints();
    std::this_thread::sleep_for(milliseconds(1));
  }
  EXPECT_EQ(failed, std::vector<int>{1});
  ranks[0]->Close(DeadlineIn(milliseconds(2000)), /*force_remote=*/true).IgnoreError();
  ranks[2]->Close(DeadlineIn(milliseconds(2000)), /*force_remote=*/true).IgnoreError();
}

// Rank 1, as on another host, sends its last messages (one on each
// channel) and leaves cleanly: its sends complete, it closes and its worker
// goes, so rank 0's endpoint to it fails. Rank 0 posts its receives only
// then (it was busy elsewhere): they still take what rank 1 sent before it
// left, which UCX holds, where they used to fail PEER_LOST at the post. A
// receive of what rank 1 never sent still fails, naming the post.
TEST(UcxPointToPoint, AReceivePostedAfterItsPeerLeftTakesWhatThePeerSentBefore) {
  auto ranks = MakeTcpPair();
  ASSERT_EQ(ranks.size(), 2u);
  const int sent[2] = {1234, 5678};
  auto collective = ranks[1]->PostSend(0, 11, &sent[0], sizeof(int));
  auto user = ranks[1]->PostUserSend(0, 12, &sent[1], sizeof(int));
  ASSERT_TRUE(collective.ok() && user.ok()) << collective.status() << user.status();
  p2p::RequestId sends[] = {*collective, *user};
  ASSERT_TRUE(ranks[1]->WaitAll(sends, DeadlineIn(milliseconds(10000))).ok());
  // Rank 0 keeps its worker going meanwhile: rank 1's flush needs its
  // answers.
  Status closed;
  std::thread leaver([&] {
    closed = ranks[1]->Close(DeadlineIn(milliseconds(5000)));
    ranks[1].reset();
  });
  std::vector<int> failed;
  const Deadline deadline = DeadlineIn(milliseconds(10000));
  while (failed.empty() && Clock::now() < deadline) {
    failed = ranks[0]->PeersWithFailedEndpoints();
    std::this_thread::sleep_for(milliseconds(1));
  }
  leaver.join();
  EXPECT_TRUE(closed.ok()) << closed;
  ASSERT_EQ(failed, std::vector<int>{1});
  int got[2] = {0, 0};
  auto recv = ranks[0]->PostRecv(1, 11, &got[0], sizeof(int));
  auto user_recv = ranks[0]->PostUserRecv(1, 12, &got[1], sizeof(int));
  ASSERT_TRUE(recv.ok()) << recv.status();
  ASSERT_TRUE(user_recv.ok()) << user_recv.status();
  p2p::RequestId recvs[] = {*recv, *user_recv};
  Status received = ranks[0]->WaitAll(recvs, DeadlineIn(milliseconds(2000)));
  EXPECT_TRUE(received.ok()) << received;
  EXPECT_EQ(got[0], 1234);
  EXPECT_EQ(got[1], 5678);
  Status never = ranks[0]->PostRecv(1, 13, &got[0], sizeof(int)).status();
  EXPECT_EQ(never.code(), StatusCode::kPeerLost) << never;
  EXPECT_NE(never.message().find("receive from rank 1 (tag 13)"), std::string::npos) << never;
  ranks[0]->Close(DeadlineIn(milliseconds(2000)), /*force_remote=*/true).IgnoreError();
}

// A watched receive (MarkWatched) that its peer failed mid-message is done
// with PEER_LOST; while an unwatched request of the WaitAny is pending the
// wait passes over it, and still times out at its deadline. It spun past
// it for good: the deadline check counted the failed receive as what the
// wait was waiting for and returned OK, and the WaitAny passed over it again.
TEST(UcxPointToPoint, WaitAnyPastAWatchedReceiveItsPeerFailedTimesOutAtItsDeadline) {
  auto ranks = MakeTcpPair();
  ASSERT_EQ(ranks.size(), 2u);
  // Rendezvous, in fragments that rank 1 sends as it progresses.
  constexpr size_t kBytes = size_t{16} << 20;
  std::vector<uint8_t> out(kBytes, 1), in(kBytes, 0);
  auto send = ranks[1]->PostSend(0, 7, out.data(), kBytes);
  auto watched = ranks[0]->PostRecv(1, 7, in.data(), kBytes);
  ASSERT_TRUE(send.ok() && watched.ok()) << send.status() << watched.status();
  ranks[0]->MarkWatched(*watched);
  // Until the message has begun to arrive: the receive is matched.
  const Deadline started = DeadlineIn(milliseconds(10000));
  while (in[0] == 0 && Clock::now() < started) {
    ASSERT_TRUE(ranks[1]->Test(*send).ok());
    auto done = ranks[0]->Test(*watched);
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_FALSE(*done) << "the whole message arrived at once";
  }
  ASSERT_EQ(in[0], 1) << "nothing arrived from rank 1";
  // Rank 1 goes mid-message: rank 0's endpoint fails, and so does the receive.
  ranks[1]->Close(DeadlineIn(milliseconds(2000)), /*force_remote=*/true).IgnoreError();
  ranks[1].reset();
  std::vector<int> failed;
  const Deadline deadline = DeadlineIn(milliseconds(10000));
  while (failed.empty() && Clock::now() < deadline) {
    failed = ranks[0]->PeersWithFailedEndpoints();
    std::this_thread::sleep_for(milliseconds(1));
  }
  ASSERT_EQ(failed, std::vector<int>{1});
  int never = 0;
  auto needed = ranks[0]->PostRecv(0, 8, &never, sizeof(never));
  ASSERT_TRUE(needed.ok()) << needed.status();
  p2p::RequestId ids[] = {*needed, *watched};
  // On a thread, so that a wait that never ends fails the test here
  // instead of at bazel's timeout.
  std::promise<Status> result;
  std::future<Status> waited = result.get_future();
  const auto start = Clock::now();
  std::thread waiter(
      [&] { result.set_value(ranks[0]->WaitAny(ids, DeadlineIn(milliseconds(300))).status()); });
  if (waited.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    std::fprintf(stderr, "WaitAny with a 300 ms deadline still running after 10 s\n");
    std::abort();
  }
  waiter.join();
  const Status s = waited.get();
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_NE(s.message().find("receive of 4 bytes from rank 0 (tag 8)"), std::string::npos) << s;
  EXPECT_LT(Clock::now() - start, milliseconds(5000));
  // Alone, the failed watched receive fails the wait as any other.
  p2p::RequestId watched_only[] = {*watched};
  StatusOr<size_t> alone = ranks[0]->WaitAny(watched_only, DeadlineIn(milliseconds(1000)));
  EXPECT_EQ(alone.status().code(), StatusCode::kPeerLost) << alone.status();
  ranks[0]->CancelAll(ids);
  ranks[0]->Close(DeadlineIn(milliseconds(2000)), /*force_remote=*/true).IgnoreError();
}

// A watchdog may cancel (Cancel is made to keep the running wait's
// deadline there), also a request that the running wait holds: the wait
// then fails (ABORTED) naming it, and each of its slots is free once. The slot was
// released twice (by the Cancel and at the wait's end), and the next two
// posts shared it: one id, and rank 1's message landed in the wrong one.
TEST(UcxPointToPoint, ARequestTheWatchdogCancelsEndsTheWaitHoldingIt) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  for (bool any : {false, true}) {
    SCOPED_TRACE(any ? "WaitAny" : "WaitAll");
    int unused = 0;
    auto id = p2p.PostRecv(1, 3, &unused, sizeof(unused));
    ASSERT_TRUE(id.ok()) << id.status();
    p2p.SetWatchdog([&](Deadline, std::span<const int>) {
      p2p.Cancel(*id);
      return Status::Ok();
    });
    p2p::RequestId ids[] = {*id};
    const Status s = any ? p2p.WaitAny(ids, DeadlineIn(milliseconds(2000))).status()
                         : p2p.WaitAll(ids, DeadlineIn(milliseconds(2000)));
    p2p.SetWatchdog(nullptr);
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
    EXPECT_NE(s.message().find(
                  "receive of 4 bytes from rank 1 (tag 3): given up inside the watchdog"),
              std::string::npos)
        << s;
    EXPECT_EQ(p2p.Test(*id).status().code(), StatusCode::kInvalidArgument);
    int got[2] = {0, 0};
    auto first = p2p.PostRecv(1, 4, &got[0], sizeof(int));
    auto second = p2p.PostRecv(1, 5, &got[1], sizeof(int));
    ASSERT_TRUE(first.ok() && second.ok()) << first.status() << second.status();
    EXPECT_NE(*first, *second);
    const int sent[2] = {44, 55};
    auto s4 = ranks[1]->PostSend(0, 4, &sent[0], sizeof(int));
    auto s5 = ranks[1]->PostSend(0, 5, &sent[1], sizeof(int));
    ASSERT_TRUE(s4.ok() && s5.ok());
    p2p::RequestId sends[] = {*s4, *s5};
    p2p::RequestId recvs[] = {*first, *second};
    RunRanks(ranks, [&](UcxPointToPoint& rank) {
      Status done = rank.WaitAll(rank.rank() == 0 ? std::span<const p2p::RequestId>(recvs)
                                                  : std::span<const p2p::RequestId>(sends),
                                 DeadlineIn(milliseconds(5000)));
      EXPECT_TRUE(done.ok()) << "rank " << rank.rank() << ": " << done;
    });
    EXPECT_EQ(got[0], 44);
    EXPECT_EQ(got[1], 55);
  }
}

// A done request of a WaitAll that the watchdog gives up ends the wait
// ABORTED naming it, whether it comes before or after the request still
// pending. Before, one listed first (the wait had moved past it) was not
// looked at again: the wait went on to its deadline and ended TIMED_OUT
// for the other, or OK had that one come.
TEST(UcxPointToPoint, ADoneRequestTheWatchdogCancelsEndsTheWaitInEitherOrder) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  for (bool done_first : {true, false}) {
    SCOPED_TRACE(done_first ? "done request first" : "done request second");
    int got = 0;
    int never = 0;
    auto done = p2p.PostRecv(1, 6, &got, sizeof(got));
    auto pending = p2p.PostRecv(1, 7, &never, sizeof(never));
    ASSERT_TRUE(done.ok() && pending.ok()) << done.status() << pending.status();
    const int sent = 66;
    auto send = ranks[1]->PostSend(0, 6, &sent, sizeof(sent));
    ASSERT_TRUE(send.ok()) << send.status();
    p2p::RequestId sends[] = {*send};
    ASSERT_TRUE(ranks[1]->WaitAll(sends, DeadlineIn(milliseconds(5000))).ok());
    // Cancels the done request once it is done (the wait's own polls
    // complete it).
    bool cancelled = false;
    p2p.SetWatchdog([&](Deadline, std::span<const int>) {
      if (!cancelled && got == sent) {
        p2p.Cancel(*done);
        cancelled = true;
      }
      return Status::Ok();
    });
    p2p::RequestId first_done[] = {*done, *pending};
    p2p::RequestId second_done[] = {*pending, *done};
    const auto start = Clock::now();
    const Status s = p2p.WaitAll(done_first ? first_done : second_done, DeadlineIn(milliseconds(3000)));
    p2p.SetWatchdog(nullptr);
    EXPECT_TRUE(cancelled);
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
    EXPECT_NE(s.message().find("receive of 4 bytes from rank 1 (tag 6): given up inside the watchdog"),
              std::string::npos)
        << s;
    EXPECT_LT(Clock::now() - start, milliseconds(2000)) << s;
    EXPECT_EQ(p2p.Test(*done).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(p2p.Test(*pending).status().code(), StatusCode::kInvalidArgument);
  }
}

// A wait run inside the watchdog refuses a request of the wait that runs
// the watchdog, naming it, and leaves it to that wait, which takes the
// message. The inner wait took it and released its slot, the outer wait
// released it again, and the next two posts shared the slot (one id).
TEST(UcxPointToPoint, AWaitInsideTheWatchdogLeavesTheOuterWaitsRequestsToIt) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  for (bool any : {false, true}) {
    SCOPED_TRACE(any ? "inner WaitAny" : "inner WaitAll");
    int got = 0;
    const int sent = 77;
    auto id = p2p.PostRecv(1, 3, &got, sizeof(got));
    ASSERT_TRUE(id.ok()) << id.status();
    p2p::RequestId ids[] = {*id};
    Status inner;
    bool ran = false;
    p2p.SetWatchdog([&](Deadline, std::span<const int>) {
      if (ran) return Status::Ok();
      ran = true;
      // Rank 1 sends only now: the inner wait would take the message.
      auto send = ranks[1]->PostSend(0, 3, &sent, sizeof(sent));
      EXPECT_TRUE(send.ok()) << send.status();
      if (!send.ok()) return send.status();
      p2p::RequestId sends[] = {*send};
      EXPECT_TRUE(ranks[1]->WaitAll(sends, DeadlineIn(milliseconds(5000))).ok());
      inner = any ? p2p.WaitAny(ids, DeadlineIn(milliseconds(2000))).status()
                  : p2p.WaitAll(ids, DeadlineIn(milliseconds(2000)));
      return Status::Ok();
    });
    Status outer = p2p.WaitAll(ids, DeadlineIn(milliseconds(5000)));
    p2p.SetWatchdog(nullptr);
    ASSERT_TRUE(ran);
    EXPECT_EQ(inner.code(), StatusCode::kInvalidArgument) << inner;
    EXPECT_NE(inner.message().find(std::to_string(*id) +
                                   " held by the wait whose watchdog runs this one"),
              std::string::npos)
        << inner;
    EXPECT_TRUE(outer.ok()) << outer;
    EXPECT_EQ(got, 77);
    int a = 0, b = 0;
    auto first = p2p.PostRecv(1, 4, &a, sizeof(a));
    auto second = p2p.PostRecv(1, 5, &b, sizeof(b));
    ASSERT_TRUE(first.ok() && second.ok()) << first.status() << second.status();
    EXPECT_NE(*first, *second);
    p2p::RequestId both[] = {*first, *second};
    p2p.CancelAll(both);
  }
}

// A watchdog that throws ends the wait with its exception; the wait's
// request stays the caller's, and a later wait on it takes the message.
TEST(UcxPointToPoint, AWaitLeftByAThrowingWatchdogLeavesItsRequestUsable) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  int got = 0;
  auto id = p2p.PostRecv(1, 3, &got, sizeof(got));
  ASSERT_TRUE(id.ok()) << id.status();
  p2p::RequestId ids[] = {*id};
  p2p.SetWatchdog([](Deadline, std::span<const int>) -> Status {
    throw std::runtime_error("watchdog failed");
  });
  EXPECT_THROW(p2p.WaitAll(ids, DeadlineIn(milliseconds(2000))).IgnoreError(), std::runtime_error);
  p2p.SetWatchdog(nullptr);
  const int sent = 9;
  auto send = ranks[1]->PostSend(0, 3, &sent, sizeof(sent));
  ASSERT_TRUE(send.ok()) << send.status();
  p2p::RequestId sends[] = {*send};
  ASSERT_TRUE(ranks[1]->WaitAll(sends, DeadlineIn(milliseconds(5000))).ok());
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(5000)));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(got, 9);
}

TEST(UcxPointToPoint, SendStillRunningWhenItsWaitFailsGivesUpThePeer) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  // Rendezvous: the send waits for a receive that rank 1 never posts, and
  // UCX cannot cancel it. Over shared memory its endpoint cannot be closed
  // by force either (UCX 1.13 needs peer error mode for that), so rank 1 is
  // given up after a 100 ms grace and nothing more is waited for.
  std::vector<uint8_t> out(size_t{3} << 20, 1);
  auto send = p2p.PostSend(1, 6, out.data(), out.size());
  ASSERT_TRUE(send.ok()) << send.status();
  p2p::RequestId ids[] = {*send};
  const auto start = Clock::now();
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(200)));
  const auto waited = Clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_LT(waited, milliseconds(1000));
  int v = 0;
  Status later = p2p.PostSend(1, 7, &v, sizeof(v)).status();
  EXPECT_EQ(later.code(), StatusCode::kPeerLost) << later;
  EXPECT_NE(later.message().find("rank 1 given up: send of 3145728 bytes to rank 1 (tag 6)"),
            std::string::npos)
      << later;
  const auto close_start = Clock::now();
  p2p.Close(DeadlineIn(milliseconds(2000))).IgnoreError();
  EXPECT_LT(Clock::now() - close_start, milliseconds(3000));
}

// Rank 0 gives up a rendezvous send to, and a receive from, each of many
// peers on this host that never run (hung ranks; their workers are never
// progressed). A send UCX cannot cancel gets a grace (1 s here), once for
// all of them; a loop of Cancel waited that long for each peer in turn (12 s
// here). Endpoints to this host cannot be closed by force in UCX 1.13, so
// the sends stay with UCX (their buffers must outlive the transport); the
// receives, never matched, are cancelled at once.
TEST(UcxPointToPoint, CancelAllGivesUpManyHungPeersInOneGrace) {
  constexpr int kPeers = 12;
  constexpr milliseconds kGrace(1000);
  auto ranks = MakeRanks(kPeers + 1, IdleMode::kSpin, kGrace);
  UcxPointToPoint& p2p = *ranks[0];
  std::vector<std::vector<uint8_t>> out(kPeers, std::vector<uint8_t>(size_t{3} << 20, 1));
  std::vector<int> in(kPeers, 0);
  std::vector<p2p::RequestId> ids;
  for (int peer = 1; peer <= kPeers; ++peer) {
    auto send = p2p.PostSend(peer, 6, out[peer - 1].data(), out[peer - 1].size());
    auto recv = p2p.PostRecv(peer, 7, &in[peer - 1], sizeof(int));
    ASSERT_TRUE(send.ok() && recv.ok()) << send.status() << " " << recv.status();
    ids.push_back(*send);
    ids.push_back(*recv);
  }
  // The sends are under way (their rendezvous requests sent) before the
  // cancel; none can complete.
  for (int i = 0; i < 100; ++i) {
    auto done = p2p.Test(ids[0]);
    ASSERT_TRUE(done.ok() && !*done) << done.status();
  }
  // An id twice and one already released are skipped.
  ids.push_back(ids[1]);
  ids.push_back(12345);
  const auto start = Clock::now();
  p2p.CancelAll(ids);
  const auto took = Clock::now() - start;
  EXPECT_GE(took, kGrace) << "no grace for the sends?";
  // A third of a grace per peer: a loaded machine delays one grace by far
  // less than the 3 s this leaves.
  EXPECT_LT(took, kPeers * kGrace / 3) << "the peers were waited for one at a time";
  for (p2p::RequestId id : ids) {
    EXPECT_EQ(p2p.Test(id).status().code(), StatusCode::kInvalidArgument) << "not released";
  }
  for (int peer = 1; peer <= kPeers; ++peer) {
    int v = 0;
    Status later = p2p.PostSend(peer, 8, &v, sizeof(v)).status();
    EXPECT_EQ(later.code(), StatusCode::kPeerLost) << later;
    EXPECT_NE(later.message().find("rank " + std::to_string(peer) + " given up"),
              std::string::npos)
        << later;
  }
  EXPECT_EQ(std::count(in.begin(), in.end(), 0), kPeers);
  const auto close_start = Clock::now();
  p2p.Close(DeadlineIn(milliseconds(2000))).IgnoreError();
  EXPECT_LT(Clock::now() - close_start, milliseconds(3000));
}

// Cancel alone still gives up a send to a hung peer (the grace, then the
// peer is lost), and CancelAll of nothing, or of released ids, waits for
// nothing. The grace is long (2 s), so that waiting for nothing and
// waiting one grace are far apart on a loaded machine.
TEST(UcxPointToPoint, CancelOfOneSendAndCancelAllOfNothing) {
  constexpr milliseconds kGrace(2000);
  auto ranks = MakeRanks(3, IdleMode::kSpin, kGrace);
  UcxPointToPoint& p2p = *ranks[0];
  std::vector<uint8_t> out(size_t{3} << 20, 1);
  auto send = p2p.PostSend(1, 6, out.data(), out.size());
  ASSERT_TRUE(send.ok()) << send.status();
  auto start = Clock::now();
  p2p.Cancel(*send);
  const auto cancel_took = Clock::now() - start;
  EXPECT_GE(cancel_took, kGrace) << "no grace for the send?";
  EXPECT_LT(cancel_took, 2 * kGrace) << "more than the grace";
  EXPECT_EQ(p2p.Test(*send).status().code(), StatusCode::kInvalidArgument);
  int v = 0;
  EXPECT_EQ(p2p.PostSend(1, 8, &v, sizeof(v)).status().code(), StatusCode::kPeerLost);
  // Rank 2 is untouched.
  auto recv = p2p.PostRecv(2, 9, &v, sizeof(v));
  ASSERT_TRUE(recv.ok()) << recv.status();
  start = Clock::now();
  p2p.CancelAll({});
  const p2p::RequestId released[] = {*send, *send};
  p2p.CancelAll(released);
  EXPECT_LT(Clock::now() - start, kGrace / 2) << "a grace for nothing";
  const p2p::RequestId one[] = {*recv};
  p2p.CancelAll(one);
  EXPECT_EQ(p2p.Test(*recv).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(p2p.PostSend(2, 8, &v, sizeof(v)).ok());
}

TEST(UcxPointToPoint, WaitAnyReturnsTheCompletedOne) {
  auto ranks = MakeRanks(2);
  RunRanks(ranks, [](UcxPointToPoint& p2p) {
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    if (p2p.rank() == 0) {
      int a = 0, b = 0;
      auto ra = p2p.PostRecv(1, 10, &a, 4);
      auto rb = p2p.PostRecv(1, 11, &b, 4);
      ASSERT_TRUE(ra.ok() && rb.ok());
      p2p::RequestId ids[] = {*ra, *rb};
      auto first = p2p.WaitAny(ids, deadline);
      ASSERT_TRUE(first.ok()) << first.status();
      EXPECT_EQ(*first, 1u);
      EXPECT_EQ(b, 11);
      // Tell rank 1 to send the other one.
      int go = 1;
      auto g = p2p.PostSend(1, 12, &go, 4);
      ASSERT_TRUE(g.ok());
      p2p::RequestId rest[] = {*ra, *g};
      ASSERT_TRUE(p2p.WaitAll(rest, deadline).ok());
      EXPECT_EQ(a, 10);
    } else {
      int b = 11, go = 0, a = 10;
      auto sb = p2p.PostSend(0, 11, &b, 4);
      auto rg = p2p.PostRecv(0, 12, &go, 4);
      ASSERT_TRUE(sb.ok() && rg.ok());
      p2p::RequestId ids[] = {*sb, *rg};
      ASSERT_TRUE(p2p.WaitAll(ids, deadline).ok());
      auto sa = p2p.PostSend(0, 10, &a, 4);
      ASSERT_TRUE(sa.ok());
      p2p::RequestId last[] = {*sa};
      ASSERT_TRUE(p2p.WaitAll(last, deadline).ok());
    }
  });
}

// A WaitAny that times out names each request it waited on (it named only
// the first), up to four, and counts the rest.
TEST(UcxPointToPoint, WaitAnyTimeoutNamesEveryRequest) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  int in[6] = {};
  std::vector<p2p::RequestId> ids;
  for (int i = 0; i < 6; ++i) {
    auto r = p2p.PostRecv(1, 20 + i, &in[i], sizeof(in[i]));
    ASSERT_TRUE(r.ok()) << r.status();
    ids.push_back(*r);
  }
  Status s = p2p.WaitAny(std::span(ids).first(2), DeadlineIn(milliseconds(100))).status();
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_NE(s.message().find("each of 2 requests"), std::string::npos) << s;
  EXPECT_NE(s.message().find("(tag 20)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("(tag 21)"), std::string::npos) << s;
  s = p2p.WaitAny(ids, DeadlineIn(milliseconds(100))).status();
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_NE(s.message().find("each of 6 requests"), std::string::npos) << s;
  EXPECT_NE(s.message().find("(tag 23); and 2 more)"), std::string::npos) << s;
  p2p.CancelAll(ids);
}

TEST(UcxPointToPoint, CancelledReceiveDoesNotTakeALaterMessage) {
  auto ranks = MakeRanks(2);
  RunRanks(ranks, [](UcxPointToPoint& p2p) {
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    if (p2p.rank() == 0) {
      int stale = 0, fresh = 0;
      auto r = p2p.PostRecv(1, 4, &stale, 4);
      ASSERT_TRUE(r.ok());
      p2p.Cancel(*r);
      auto r2 = p2p.PostRecv(1, 4, &fresh, 4);
      int go = 1;
      auto g = p2p.PostSend(1, 5, &go, 4);
      ASSERT_TRUE(r2.ok() && g.ok());
      p2p::RequestId ids[] = {*r2, *g};
      ASSERT_TRUE(p2p.WaitAll(ids, deadline).ok());
      EXPECT_EQ(fresh, 99);
      EXPECT_EQ(stale, 0);
    } else {
      int go = 0, value = 99;
      auto g = p2p.PostRecv(0, 5, &go, 4);
      ASSERT_TRUE(g.ok());
      p2p::RequestId ids[] = {*g};
      ASSERT_TRUE(p2p.WaitAll(ids, deadline).ok());
      auto s = p2p.PostSend(0, 4, &value, 4);
      ASSERT_TRUE(s.ok());
      p2p::RequestId ids2[] = {*s};
      ASSERT_TRUE(p2p.WaitAll(ids2, deadline).ok());
    }
  });
}

TEST(UcxPointToPoint, BadArgumentsAreRejected) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  int v = 0;
  Status s = p2p.PostSend(2, 1, &v, 4).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s;
  // A tag too wide names the post and its peer, as every other refusal does.
  s = p2p.PostSend(1, p2p::kMaxTag + 1, &v, 4).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("send to rank 1: tag " + std::to_string(p2p::kMaxTag + 1) +
                             " exceeds 40 bits"),
            std::string::npos)
      << s;
  s = p2p.PostUserRecv(1, p2p::kMaxTag + 1, &v, 4).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("receive from rank 1: tag"), std::string::npos) << s;
  s = p2p.Test(12345).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("request id 12345 unknown or released"), std::string::npos) << s;
  p2p::RequestId unknown[] = {12346};
  s = p2p.WaitAny(unknown, DeadlineIn(milliseconds(1000))).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("request id 12346 unknown or released"), std::string::npos) << s;
  EXPECT_FALSE(UcxPointToPoint::Create(*Context::Create({}), {.rank = 3, .size = 2}).ok());
  auto uneven = UcxPointToPoint::Create(*Context::Create({}), {.polls_per_clock_read = 3});
  EXPECT_EQ(uneven.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(uneven.status().message().find("polls_per_clock_read 3 is not a power of two"),
            std::string::npos)
      << uneven.status();
}

// Options a wait cannot work with are refused by Create, naming the
// option: a negative watchdog_period made a sleeping wait block in
// epoll_wait with no timeout (past its deadline), zero made it spin, a
// negative grace or threshold were taken silently, and a million polls
// between clock reads let a wait overrun its deadline by that many polls. Zero grace and zero
// threshold are valid (force at once, back off at once).
TEST(UcxPointToPoint, CreateRefusesBadTimingOptionsNamingThem) {
  auto context = Context::Create({.default_tls = "sm,self", .wakeup = true});
  ASSERT_TRUE(context.ok()) << context.status();
  struct Case {
    P2pOptions options;
    std::string text;
  };
  const Case cases[] = {
      {{.idle_mode = IdleMode::kSleep, .watchdog_period = milliseconds(-1)},
       "watchdog_period of -1 ms is not positive"},
      {{.watchdog_period = milliseconds(0)}, "watchdog_period of 0 ms is not positive"},
      {{.recall_grace = milliseconds(-5)}, "recall_grace of -5 ms is negative"},
      {{.idle_polls_before_backoff = -1}, "idle_polls_before_backoff -1 is negative"},
      {{.polls_per_clock_read = 1 << 20},
       "polls_per_clock_read 1048576 is more than the most, 256"},
  };
  for (const Case& c : cases) {
    auto p2p = UcxPointToPoint::Create(*context, c.options);
    EXPECT_EQ(p2p.status().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(p2p.status().message().find(c.text), std::string::npos) << p2p.status();
  }
  auto zeros = UcxPointToPoint::Create(
      *context, {.idle_polls_before_backoff = 0, .recall_grace = milliseconds(0)});
  EXPECT_TRUE(zeros.ok()) << zeros.status();
}

// set_idle_mode(kSleep) on a context without wakeup sleeps in short steps
// between polls: a wait gives up the core (voluntary context switches; a
// yield is not one) and still times out at its deadline. It became kYield,
// which kept a core busy however long the wait, where every wait had failed
// FAILED_PRECONDITION before that (no event fd to sleep on). With wakeup it
// sleeps on the event fd.
TEST(UcxPointToPoint, SleepModeSetOnAContextWithoutWakeupSleepsInSteps) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  p2p.set_idle_mode(IdleMode::kSleep, 1);
  EXPECT_EQ(p2p.options().idle_mode, IdleMode::kSleep);
  EXPECT_EQ(p2p.options().idle_polls_before_backoff, 1);
  int v = 0;
  auto id = p2p.PostRecv(1, 4, &v, sizeof(v));
  ASSERT_TRUE(id.ok()) << id.status();
  p2p::RequestId ids[] = {*id};
  rusage before{}, after{};
  ASSERT_EQ(getrusage(RUSAGE_THREAD, &before), 0);
  const auto start = Clock::now();
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(200)));
  const auto took = Clock::now() - start;
  ASSERT_EQ(getrusage(RUSAGE_THREAD, &after), 0);
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_LT(took, milliseconds(1000));
  EXPECT_GE(after.ru_nvcsw - before.ru_nvcsw, 10) << "the wait did not sleep";
  // A message sent meanwhile is still taken.
  const int sent = 42;
  auto recv = p2p.PostRecv(1, 5, &v, sizeof(v));
  auto send = ranks[1]->PostSend(0, 5, &sent, sizeof(sent));
  ASSERT_TRUE(recv.ok() && send.ok()) << recv.status() << send.status();
  RunRanks(ranks, [&](UcxPointToPoint& rank) {
    p2p::RequestId mine[] = {rank.rank() == 0 ? *recv : *send};
    EXPECT_TRUE(rank.WaitAll(mine, DeadlineIn(milliseconds(5000))).ok()) << "rank " << rank.rank();
  });
  EXPECT_EQ(v, 42);
  p2p.set_idle_mode(IdleMode::kSpin, -3);
  EXPECT_EQ(p2p.options().idle_polls_before_backoff, 0);

  auto sleeping = MakeRanks(1, IdleMode::kSleep);
  sleeping[0]->set_idle_mode(IdleMode::kSleep, 8);
  EXPECT_EQ(sleeping[0]->options().idle_mode, IdleMode::kSleep);
}

// The same with a watchdog period too long for the clock (the longest a
// duration in milliseconds holds: "never"), which bounds each sleep when
// no watchdog is set: converted to the clock's nanoseconds it overflowed,
// and the wait never slept.
TEST(UcxPointToPoint, SleepStepsWithoutWakeupTakeAWatchdogPeriodTooLongForTheClock) {
  auto ranks = MakeRanks(2, IdleMode::kSpin, P2pOptions{}.recall_grace, milliseconds::max());
  UcxPointToPoint& p2p = *ranks[0];
  p2p.set_idle_mode(IdleMode::kSleep, 1);
  int v = 0;
  auto id = p2p.PostRecv(1, 4, &v, sizeof(v));
  ASSERT_TRUE(id.ok()) << id.status();
  p2p::RequestId ids[] = {*id};
  rusage before{}, after{};
  ASSERT_EQ(getrusage(RUSAGE_THREAD, &before), 0);
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(200)));
  ASSERT_EQ(getrusage(RUSAGE_THREAD, &after), 0);
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_GE(after.ru_nvcsw - before.ru_nvcsw, 10) << "the wait did not sleep";
}

// kSleep given to Create on a context without wakeup is the same as
// set_idle_mode(kSleep) after it: accepted, and a wait sleeps in short
// steps and times out at its deadline. Create refused it (INVALID_ARGUMENT)
// while set_idle_mode took it, so the option's validity hung on when it
// was set.
TEST(UcxPointToPoint, CreateTakesSleepModeWithoutWakeupAsSetIdleModeDoes) {
  auto context = Context::Create({.default_tls = "sm,self", .wakeup = false});
  ASSERT_TRUE(context.ok()) << context.status();
  auto created = UcxPointToPoint::Create(
      *context, {.idle_mode = IdleMode::kSleep, .idle_polls_before_backoff = 1});
  ASSERT_TRUE(created.ok()) << created.status();
  UcxPointToPoint& p2p = **created;
  EXPECT_EQ(p2p.options().idle_mode, IdleMode::kSleep);
  const std::string address = p2p.address();
  ASSERT_TRUE(p2p.Connect(std::span<const std::string>(&address, 1)).ok());
  int v = 0;
  auto id = p2p.PostRecv(0, 4, &v, sizeof(v));
  ASSERT_TRUE(id.ok()) << id.status();
  p2p::RequestId ids[] = {*id};
  rusage before{}, after{};
  ASSERT_EQ(getrusage(RUSAGE_THREAD, &before), 0);
  const auto start = Clock::now();
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(200)));
  const auto took = Clock::now() - start;
  ASSERT_EQ(getrusage(RUSAGE_THREAD, &after), 0);
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_LT(took, milliseconds(1000));
  EXPECT_GE(after.ru_nvcsw - before.ru_nvcsw, 10) << "the wait did not sleep";
  // A message sent to itself is still taken.
  const int sent = 42;
  auto recv = p2p.PostRecv(0, 5, &v, sizeof(v));
  auto send = p2p.PostSend(0, 5, &sent, sizeof(sent));
  ASSERT_TRUE(recv.ok() && send.ok()) << recv.status() << send.status();
  p2p::RequestId both[] = {*recv, *send};
  EXPECT_TRUE(p2p.WaitAll(both, DeadlineIn(milliseconds(5000))).ok());
  EXPECT_EQ(v, 42);
}

// A null context is refused, naming it; Create dereferenced it (a crash).
TEST(UcxPointToPoint, CreateRefusesANullContext) {
  auto p2p = UcxPointToPoint::Create(nullptr, {});
  EXPECT_EQ(p2p.status().code(), StatusCode::kInvalidArgument) << p2p.status();
  EXPECT_NE(p2p.status().message().find("no context"), std::string::npos) << p2p.status();
}

// A null buffer with bytes is refused before UCX reads or writes through
// it (the send crashed inside UCX, and the receive was posted), as the
// loopback refuses it; with no bytes it is a valid empty message.
TEST(UcxPointToPoint, NullBufferWithBytesIsRejectedNamingThePost) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  Status s = p2p.PostRecv(1, 3, nullptr, 16).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("receive from rank 1 (tag 3): null buffer for 16 bytes"),
            std::string::npos)
      << s;
  s = p2p.PostUserSend(0, 4, nullptr, 8).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("send to rank 0 (tag 4): null buffer for 8 bytes"), std::string::npos)
      << s;
  // With no bytes a null buffer is fine: an empty message to self.
  auto recv = p2p.PostRecv(0, 5, nullptr, 0);
  auto send = p2p.PostSend(0, 5, nullptr, 0);
  ASSERT_TRUE(recv.ok() && send.ok()) << recv.status() << send.status();
  p2p::RequestId ids[] = {*recv, *send};
  EXPECT_TRUE(p2p.WaitAll(ids, DeadlineIn(milliseconds(5000))).ok());
}

TEST(UcxPointToPoint, WaitAllRejectsARequestListedTwice) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  int out = 5, in = 0;
  auto send = p2p.PostSend(1, 1, &out, sizeof(out));  // eager: already complete
  auto recv = p2p.PostRecv(1, 2, &in, sizeof(in));     // never sent
  ASSERT_TRUE(send.ok() && recv.ok());
  p2p::RequestId ids[] = {*send, *recv, *send};
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(200)));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("request id " + std::to_string(*send) + " listed twice"),
            std::string::npos)
      << s;
  // Both were released, once: the next requests get distinct handles.
  EXPECT_EQ(p2p.Test(*send).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p2p.Test(*recv).status().code(), StatusCode::kInvalidArgument);
  int got[3] = {0, 0, 0};
  std::vector<p2p::RequestId> next;
  for (int i = 0; i < 3; ++i) {
    auto r = p2p.PostRecv(1, 10 + i, &got[i], sizeof(int));
    ASSERT_TRUE(r.ok()) << r.status();
    for (p2p::RequestId earlier : next) EXPECT_NE(*r, earlier);
    next.push_back(*r);
  }
  for (int i = 0; i < 3; ++i) {
    int value = 100 + i;  // eager sends complete before PostSend returns
    auto sent = ranks[1]->PostSend(0, 10 + i, &value, sizeof(value));
    ASSERT_TRUE(sent.ok()) << sent.status();
    p2p::RequestId one[] = {*sent};
    ASSERT_TRUE(ranks[1]->WaitAll(one, DeadlineIn(milliseconds(5000))).ok());
  }
  s = p2p.WaitAll(next, DeadlineIn(milliseconds(5000)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(got[0], 100);
  EXPECT_EQ(got[1], 101);
  EXPECT_EQ(got[2], 102);
}

TEST(UcxPointToPoint, WaitAllWithAnUnknownIdReleasesEveryValidOne) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  int before = 0, after = 0, fresh = 0;
  auto r1 = p2p.PostRecv(1, 5, &before, sizeof(int));
  auto r2 = p2p.PostRecv(1, 6, &after, sizeof(int));
  ASSERT_TRUE(r1.ok() && r2.ok());
  const p2p::RequestId unknown = 12345;
  p2p::RequestId ids[] = {*r1, unknown, *r2};
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(5000)));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("request id 12345"), std::string::npos) << s;
  // The ids on both sides of the unknown one are released and cancelled:
  // the message rank 1 sends on the second's tag goes to a new receive.
  EXPECT_EQ(p2p.Test(*r1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p2p.Test(*r2).status().code(), StatusCode::kInvalidArgument);
  auto r3 = p2p.PostRecv(1, 6, &fresh, sizeof(int));
  ASSERT_TRUE(r3.ok()) << r3.status();
  int value = 66;
  auto sent = ranks[1]->PostSend(0, 6, &value, sizeof(value));
  ASSERT_TRUE(sent.ok()) << sent.status();
  p2p::RequestId one[] = {*sent};
  ASSERT_TRUE(ranks[1]->WaitAll(one, DeadlineIn(milliseconds(5000))).ok());
  p2p::RequestId last[] = {*r3};
  s = p2p.WaitAll(last, DeadlineIn(milliseconds(5000)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(fresh, 66);
  EXPECT_EQ(after, 0);
}

TEST(UcxPointToPoint, ConnectWithABadAddressLeavesNothingHalfConnected) {
  std::vector<std::unique_ptr<UcxPointToPoint>> ranks;
  std::vector<std::string> addresses;
  for (int r = 0; r < 3; ++r) {
    auto context = Context::Create({.default_tls = "sm,self"});
    ASSERT_TRUE(context.ok()) << context.status();
    auto p2p = UcxPointToPoint::Create(*context, {.rank = r, .size = 3});
    ASSERT_TRUE(p2p.ok()) << p2p.status();
    addresses.push_back((*p2p)->address());
    ranks.push_back(std::move(*p2p));
  }
  UcxPointToPoint& p2p = *ranks[0];
  int v = 0;
  // Rank 1's address empty, or not a UCX worker address at all (UCX 1.13
  // aborts on the format version this one's first byte would name).
  for (const std::string& bad : {std::string(), std::string("garbage")}) {
    std::vector<std::string> wrong = addresses;
    wrong[1] = bad;
    Status s = p2p.Connect(wrong);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("address for rank 1"), std::string::npos) << s;
    // No endpoint was left behind, nor a missing peer to dereference.
    EXPECT_EQ(p2p.PostSend(0, 1, &v, 4).status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(p2p.PostSend(2, 1, &v, 4).status().code(), StatusCode::kFailedPrecondition);
    p2p.MarkPeerLost(2, PeerLostError("rank 2 exited"));
  }
  // A well-formed address that no transport of rank 0 reaches (TCP only):
  // UCX fails on it after the endpoints to ranks 0 and 1 exist, and those
  // are closed again.
  auto tcp_context = Context::Create({.default_tls = "tcp"});
  ASSERT_TRUE(tcp_context.ok()) << tcp_context.status();
  auto tcp_rank = UcxPointToPoint::Create(*tcp_context, {.rank = 2, .size = 3});
  ASSERT_TRUE(tcp_rank.ok()) << tcp_rank.status();
  std::vector<std::string> unreachable = addresses;
  unreachable[2] = (*tcp_rank)->address();
  Status s = p2p.Connect(unreachable);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s;
  EXPECT_EQ(p2p.PostSend(1, 1, &v, 4).status().code(), StatusCode::kFailedPrecondition);
  // Connecting again with the right addresses works.
  for (auto& rank : ranks) {
    Status connected = rank->Connect(addresses);
    ASSERT_TRUE(connected.ok()) << connected;
  }
  int out = 42, in = 0;
  auto recv = ranks[2]->PostRecv(0, 8, &in, sizeof(in));
  auto send = p2p.PostSend(2, 8, &out, sizeof(out));
  ASSERT_TRUE(recv.ok() && send.ok());
  p2p::RequestId sent[] = {*send};
  ASSERT_TRUE(p2p.WaitAll(sent, DeadlineIn(milliseconds(5000))).ok());
  p2p::RequestId received[] = {*recv};
  s = ranks[2]->WaitAll(received, DeadlineIn(milliseconds(5000)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(in, 42);
}

// A notice outlives the sender's requests: it reaches a receive posted
// only after the sender went on (here: to wait for the reply), as a stop
// note must reach a rank that enters a failed collective late.
TEST(UcxPointToPoint, NoticeReachesAReceivePostedAfterItWasSent) {
  auto ranks = MakeRanks(2);
  std::atomic<bool> posted{false};
  RunRanks(ranks, [&](UcxPointToPoint& p2p) {
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    if (p2p.rank() == 0) {
      int note = 77;
      ASSERT_TRUE(p2p.PostNotice(1, 5, &note, sizeof(note)).ok());
      note = 0;  // copied at the post
      posted = true;
      // Waiting on the reply keeps this worker progressing the notice.
      int reply = 0;
      auto r = p2p.PostRecv(1, 6, &reply, sizeof(reply));
      ASSERT_TRUE(r.ok());
      p2p::RequestId ids[] = {*r};
      ASSERT_TRUE(p2p.WaitAll(ids, deadline).ok());
      EXPECT_EQ(reply, 78);
    } else {
      while (!posted && Clock::now() < deadline) std::this_thread::yield();
      ASSERT_TRUE(posted) << "rank 0 did not post its notice within 10 s";
      int got = 0;
      auto r = p2p.PostRecv(0, 5, &got, sizeof(got));
      ASSERT_TRUE(r.ok());
      p2p::RequestId ids[] = {*r};
      ASSERT_TRUE(p2p.WaitAll(ids, deadline).ok());
      EXPECT_EQ(got, 77);
      int reply = got + 1;
      auto s = p2p.PostSend(0, 6, &reply, sizeof(reply));
      ASSERT_TRUE(s.ok());
      p2p::RequestId sends[] = {*s};
      ASSERT_TRUE(p2p.WaitAll(sends, deadline).ok());
    }
  });
}

// Notices nobody receives end with the transport: Close and the destructor
// complete or drop them, without a crash or a request left with UCX.
TEST(UcxPointToPoint, CloseWithUndeliveredNotices) {
  auto ranks = MakeRanks(2);
  std::vector<unsigned char> note(p2p::kMaxNoticeBytes, 3);
  for (int i = 0; i < p2p::kMaxNoticesPerPeer; ++i) {
    ASSERT_TRUE(ranks[0]->PostNotice(1, 5, note.data(), note.size()).ok());
  }
  EXPECT_TRUE(ranks[0]->Close(DeadlineIn(milliseconds(2000))).ok());
  EXPECT_EQ(ranks[0]->PostNotice(1, 5, note.data(), 1).code(), StatusCode::kFailedPrecondition);
  ranks.clear();
}

// Posts after Close, and before Connect, fail naming the post (its peer
// and tag) and why; they read "send to after the transport was closed",
// naming neither.
TEST(UcxPointToPoint, OperationsAfterCloseFail) {
  auto ranks = MakeRanks(2);
  ASSERT_TRUE(ranks[0]->Close(DeadlineIn(milliseconds(2000))).ok());
  int v = 0;
  Status send = ranks[0]->PostSend(1, 1, &v, 4).status();
  EXPECT_EQ(send.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(send.message().find("send to rank 1 (tag 1): the transport was closed"),
            std::string::npos)
      << send;
  Status recv = ranks[0]->PostUserRecv(1, 2, &v, 4).status();
  EXPECT_NE(recv.message().find("receive from rank 1 (tag 2): the transport was closed"),
            std::string::npos)
      << recv;
  Status notice = ranks[0]->PostNotice(1, 3, &v, 4);
  EXPECT_NE(notice.message().find("notice to rank 1 (tag 3): the transport was closed"),
            std::string::npos)
      << notice;

  auto context = Context::Create({.default_tls = "sm,self"});
  ASSERT_TRUE(context.ok()) << context.status();
  auto unconnected = UcxPointToPoint::Create(*context, {.rank = 0, .size = 2});
  ASSERT_TRUE(unconnected.ok()) << unconnected.status();
  Status early = (*unconnected)->PostSend(1, 4, &v, 4).status();
  EXPECT_EQ(early.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(early.message().find("send to rank 1 (tag 4): not connected (Connect() not called"),
            std::string::npos)
      << early;
}

// Connect after Close is refused, saying so: a transport closed before it
// connected used to make endpoints that nothing closed, and one closed
// after it was told it was "already connected".
TEST(UcxPointToPoint, ConnectAfterCloseIsRefused) {
  auto context = Context::Create({.default_tls = "sm,self"});
  ASSERT_TRUE(context.ok()) << context.status();
  auto p2p = UcxPointToPoint::Create(*context, {.rank = 0, .size = 1});
  ASSERT_TRUE(p2p.ok()) << p2p.status();
  ASSERT_TRUE((*p2p)->Close(DeadlineIn(milliseconds(2000))).ok());
  const std::string addresses[] = {(*p2p)->address()};
  Status s = (*p2p)->Connect(addresses);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("Connect after the transport was closed"), std::string::npos) << s;

  auto ranks = MakeRanks(2);
  ASSERT_TRUE(ranks[0]->Close(DeadlineIn(milliseconds(2000))).ok());
  const std::string both[] = {ranks[0]->address(), ranks[1]->address()};
  s = ranks[0]->Connect(both);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("Connect after the transport was closed"), std::string::npos) << s;
}

}  // namespace
}  // namespace ddp::transport::ucx

namespace ddp::transport::ucx {
namespace {

TEST(UcxPointToPoint, UserChannelNeverMatchesCollectiveMessages) {
  auto ranks = MakeRanks(2);
  RunRanks(ranks, [](UcxPointToPoint& p2p) {
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    if (p2p.rank() == 0) {
      int user = 0, collective = 0;
      auto u = p2p.PostUserRecv(1, 7, &user, 4);
      auto c = p2p.PostRecv(1, 7, &collective, 4);
      ASSERT_TRUE(u.ok() && c.ok());
      p2p::RequestId ids[] = {*u, *c};
      ASSERT_TRUE(p2p.WaitAll(ids, deadline).ok());
      EXPECT_EQ(user, 111);
      EXPECT_EQ(collective, 222);
    } else {
      int collective = 222, user = 111;
      auto c = p2p.PostSend(0, 7, &collective, 4);  // sent first, same tag
      auto u = p2p.PostUserSend(0, 7, &user, 4);
      ASSERT_TRUE(u.ok() && c.ok());
      p2p::RequestId ids[] = {*c, *u};
      ASSERT_TRUE(p2p.WaitAll(ids, deadline).ok());
    }
  });
}

}  // namespace
}  // namespace ddp::transport::ucx
