#include "transport/ucx/ucx_p2p.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <numeric>
#include <thread>
#include <vector>

namespace ddp::transport::ucx {
namespace {

using std::chrono::milliseconds;

// N ranks in this process, each with its own context and worker, connected
// all-to-all over shared memory. Each rank is driven by its own thread.
std::vector<std::unique_ptr<UcxPointToPoint>> MakeRanks(int n, IdleMode idle = IdleMode::kSpin) {
  std::vector<std::unique_ptr<UcxPointToPoint>> ranks;
  std::vector<std::string> addresses;
  for (int r = 0; r < n; ++r) {
    auto context = Context::Create({.default_tls = "sm,self", .wakeup = idle == IdleMode::kSleep});
    EXPECT_TRUE(context.ok()) << context.status();
    auto p2p = UcxPointToPoint::Create(*context, {.rank = r, .size = n, .idle_mode = idle,
                                                  .idle_polls_before_backoff = 64});
    EXPECT_TRUE(p2p.ok()) << p2p.status();
    addresses.push_back((*p2p)->address());
    ranks.push_back(std::move(*p2p));
  }
  for (auto& rank : ranks) EXPECT_TRUE(rank->Connect(addresses).ok());
  return ranks;
}

void RunRanks(std::vector<std::unique_ptr<UcxPointToPoint>>& ranks,
              const std::function<void(UcxPointToPoint&)>& body) {
  std::vector<std::thread> threads;
  for (auto& rank : ranks) threads.emplace_back([&body, &rank] { body(*rank); });
  for (auto& t : threads) t.join();
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

TEST(UcxPointToPoint, WatchdogEndsAWait) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  std::atomic<int> calls{0};
  Deadline seen{};
  p2p.SetWatchdog([&calls, &seen](Deadline deadline, int) -> Status {
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

TEST(UcxPointToPoint, RegisteredStagingBufferCarriesLargeMessages) {
  auto ranks = MakeRanks(2);
  RunRanks(ranks, [](UcxPointToPoint& p2p) {
    const size_t bytes = 2 << 20;
    std::vector<uint8_t> staging(bytes), in(bytes);
    ASSERT_TRUE(p2p.RegisterStagingBuffer(staging.data(), bytes).ok());
    std::iota(staging.begin(), staging.end(), static_cast<uint8_t>(p2p.rank()));
    const int peer = 1 - p2p.rank();
    auto r = p2p.PostRecv(peer, 1, in.data(), bytes);
    auto s = p2p.PostSend(peer, 1, staging.data(), bytes);
    ASSERT_TRUE(r.ok() && s.ok());
    p2p::RequestId ids[] = {*r, *s};
    ASSERT_TRUE(p2p.WaitAll(ids, DeadlineIn(milliseconds(10000))).ok());
    EXPECT_EQ(in[0], static_cast<uint8_t>(peer));
    EXPECT_EQ(in[bytes - 1], static_cast<uint8_t>(bytes - 1 + peer));
  });
}

TEST(UcxPointToPoint, BadArgumentsAreRejected) {
  auto ranks = MakeRanks(2);
  UcxPointToPoint& p2p = *ranks[0];
  int v = 0;
  Status s = p2p.PostSend(2, 1, &v, 4).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s;
  EXPECT_EQ(p2p.PostSend(1, p2p::kMaxTag + 1, &v, 4).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(p2p.Test(12345).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(UcxPointToPoint::Create(*Context::Create({}), {.rank = 3, .size = 2}).ok());
}

TEST(UcxPointToPoint, OperationsAfterCloseFail) {
  auto ranks = MakeRanks(2);
  ASSERT_TRUE(ranks[0]->Close(DeadlineIn(milliseconds(2000))).ok());
  int v = 0;
  EXPECT_EQ(ranks[0]->PostSend(1, 1, &v, 4).status().code(), StatusCode::kFailedPrecondition);
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
