#include "transport/p2p/loopback.h"

#include <atomic>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ddp::transport::p2p {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

Deadline Soon() { return DeadlineIn(5000ms); }

std::vector<std::unique_ptr<PointToPoint>> ConnectAll(LoopbackHub& hub) {
  std::vector<std::unique_ptr<PointToPoint>> eps;
  for (int r = 0; r < hub.size(); ++r) {
    auto ep = hub.Connect(r);
    EXPECT_TRUE(ep.ok()) << ep.status();
    eps.push_back(std::move(ep).value());
  }
  return eps;
}

TEST(LoopbackTest, ReceiveBeforeSendAndSendBeforeReceiveBothDeliver) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  int a = 0, b = 0;
  const int x = 41, y = 42;
  // Receive posted first.
  auto r1 = eps[1]->PostRecv(0, 7, &a, sizeof(a));
  ASSERT_TRUE(r1.ok());
  auto s1 = eps[0]->PostSend(1, 7, &x, sizeof(x));
  ASSERT_TRUE(s1.ok());
  // Send posted first (unexpected message).
  auto s2 = eps[0]->PostSend(1, 8, &y, sizeof(y));
  ASSERT_TRUE(s2.ok());
  auto r2 = eps[1]->PostRecv(0, 8, &b, sizeof(b));
  ASSERT_TRUE(r2.ok());
  EXPECT_TRUE(eps[1]->WaitAll(std::vector<RequestId>{*r1, *r2}, Soon()).ok());
  EXPECT_TRUE(eps[0]->WaitAll(std::vector<RequestId>{*s1, *s2}, Soon()).ok());
  EXPECT_EQ(a, 41);
  EXPECT_EQ(b, 42);
  EXPECT_EQ(hub.Stats(0).bytes_sent, 2 * sizeof(int));
  EXPECT_EQ(hub.Stats(1).messages_received, 2u);
  EXPECT_EQ(hub.BytesBetween(0, 1), 2 * sizeof(int));
  EXPECT_EQ(hub.BytesBetween(1, 0), 0u);
}

// A notice has no handle: the sender's endpoint going away (as its
// collective returns and cancels what it has outstanding) leaves it for a
// receive the peer posts afterwards.
TEST(LoopbackTest, NoticeReachesAReceivePostedAfterTheSenderLeft) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  int note = 17;
  ASSERT_TRUE(eps[0]->PostNotice(1, 9, &note, sizeof(note)).ok());
  note = 0;  // copied at the post
  eps[0].reset();
  int got = 0;
  auto r = eps[1]->PostRecv(0, 9, &got, sizeof(got));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(eps[1]->WaitAll(std::vector<RequestId>{*r}, Soon()).ok());
  EXPECT_EQ(got, 17);
}

// A notice posted after its receiver's endpoint went away is dropped, not
// kept for the rank's next endpoint: that one belongs to a fresh
// communicator, whose call numbers start again, so the old call's note
// could pass for one of its own.
TEST(LoopbackTest, NoticeToAClosedRankIsNotDeliveredToItsNextEndpoint) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  eps[1].reset();
  const int stale = 3;
  EXPECT_TRUE(eps[0]->PostNotice(1, 9, &stale, sizeof(stale)).ok());
  auto again = hub.Connect(1);
  ASSERT_TRUE(again.ok()) << again.status();
  eps[1] = std::move(again).value();
  int got = 0;
  auto r = eps[1]->PostRecv(0, 9, &got, sizeof(got));
  ASSERT_TRUE(r.ok()) << r.status();
  auto done = eps[1]->Test(*r);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(*done) << "the new endpoint took the notice sent to the closed one: " << got;
  // One sent to the new endpoint arrives.
  const int fresh = 4;
  ASSERT_TRUE(eps[0]->PostNotice(1, 9, &fresh, sizeof(fresh)).ok());
  EXPECT_TRUE(eps[1]->WaitAll(std::vector<RequestId>{*r}, Soon()).ok());
  EXPECT_EQ(got, 4);
}

TEST(LoopbackTest, NoticesBeyondTheLimitDropTheOldest) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  for (int v = 1; v <= kMaxNoticesPerPeer + 1; ++v) {
    ASSERT_TRUE(eps[0]->PostNotice(1, 9, &v, sizeof(v)).ok());
  }
  std::vector<int> got(kMaxNoticesPerPeer + 1, 0);
  for (int i = 0; i < kMaxNoticesPerPeer; ++i) {
    auto r = eps[1]->PostRecv(0, 9, &got[i], sizeof(int));
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(eps[1]->WaitAll(std::vector<RequestId>{*r}, Soon()).ok());
    EXPECT_EQ(got[i], i + 2) << "notice " << i;
  }
  auto last = eps[1]->PostRecv(0, 9, &got.back(), sizeof(int));
  ASSERT_TRUE(last.ok());
  auto pending = eps[1]->Test(*last);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_FALSE(*pending);  // the first one was dropped
  eps[1]->Cancel(*last);
}

TEST(LoopbackTest, KilledReceiverDropsItsNoticesAndRefusesNewOnes) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  const int v = 5;
  ASSERT_TRUE(eps[0]->PostNotice(1, 9, &v, sizeof(v)).ok());
  hub.Kill(1);
  Status refused = eps[0]->PostNotice(1, 9, &v, sizeof(v));
  EXPECT_EQ(refused.code(), StatusCode::kPeerLost);
  EXPECT_THAT(refused.message(), HasSubstr("rank 1 was lost"));
  EXPECT_EQ(hub.Stats(0).messages_sent, 0u);
}

TEST(LoopbackTest, OversizedNoticeIsRefusedNamingThePeer) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  std::vector<unsigned char> big(kMaxNoticeBytes + 1);
  Status refused = eps[0]->PostNotice(1, 9, big.data(), big.size());
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("to rank 1"));
}

TEST(LoopbackTest, SameSourceAndTagMatchInPostingOrder) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  const int v[3] = {1, 2, 3};
  std::vector<RequestId> sends;
  for (const int& x : v) sends.push_back(*eps[0]->PostSend(1, 5, &x, sizeof(x)));
  int got[3] = {};
  std::vector<RequestId> recvs;
  for (int& g : got) recvs.push_back(*eps[1]->PostRecv(0, 5, &g, sizeof(g)));
  ASSERT_TRUE(eps[1]->WaitAll(recvs, Soon()).ok());
  ASSERT_TRUE(eps[0]->WaitAll(sends, Soon()).ok());
  EXPECT_EQ(got[0], 1);
  EXPECT_EQ(got[1], 2);
  EXPECT_EQ(got[2], 3);
}

TEST(LoopbackTest, TagsAndSourcesKeepMessagesApart) {
  LoopbackHub hub(3);
  auto eps = ConnectAll(hub);
  const int from0 = 10, from1 = 11, tag9 = 99;
  auto s0 = *eps[0]->PostSend(2, 1, &from0, sizeof(int));
  auto s9 = *eps[0]->PostSend(2, 9, &tag9, sizeof(int));
  auto s1 = *eps[1]->PostSend(2, 1, &from1, sizeof(int));
  int g9 = 0, g1 = 0, g0 = 0;
  auto r9 = *eps[2]->PostRecv(0, 9, &g9, sizeof(int));
  auto r1 = *eps[2]->PostRecv(1, 1, &g1, sizeof(int));
  auto r0 = *eps[2]->PostRecv(0, 1, &g0, sizeof(int));
  ASSERT_TRUE(eps[2]->WaitAll(std::vector<RequestId>{r9, r1, r0}, Soon()).ok());
  EXPECT_EQ(g9, 99);
  EXPECT_EQ(g1, 11);
  EXPECT_EQ(g0, 10);
  EXPECT_TRUE(eps[0]->WaitAll(std::vector<RequestId>{s0, s9}, Soon()).ok());
  EXPECT_TRUE(eps[1]->WaitAll(std::vector<RequestId>{s1}, Soon()).ok());
}

TEST(LoopbackTest, SendCompletesOnlyWhenReceived) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  const int x = 5;
  auto s = *eps[0]->PostSend(1, 1, &x, sizeof(x));
  auto t = eps[0]->Test(s);
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(*t);
  int y = 0;
  auto r = *eps[1]->PostRecv(0, 1, &y, sizeof(y));
  auto tr = eps[1]->Test(r);
  ASSERT_TRUE(tr.ok());
  EXPECT_TRUE(*tr);
  t = eps[0]->Test(s);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(*t);
  // A released handle is unknown afterwards.
  EXPECT_EQ(eps[0]->Test(s).status().code(), StatusCode::kInvalidArgument);
}

TEST(LoopbackTest, SizeMismatchFailsTheReceiveWithBothSizes) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  const int64_t big = 7;
  int32_t small = -1;
  auto s = *eps[0]->PostSend(1, 3, &big, sizeof(big));
  auto r = *eps[1]->PostRecv(0, 3, &small, sizeof(small));
  Status st = eps[1]->WaitAll(std::vector<RequestId>{r}, Soon());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("sent 8 bytes"));
  EXPECT_THAT(st.message(), HasSubstr("expected 4"));
  EXPECT_EQ(small, -1);  // nothing written
  EXPECT_TRUE(eps[0]->WaitAll(std::vector<RequestId>{s}, Soon()).ok());
}

TEST(LoopbackTest, WaitTimesOutAtTheDeadlineNamingThePeer) {
  LoopbackHub hub(3);
  auto eps = ConnectAll(hub);
  int y = 0;
  auto r = *eps[1]->PostRecv(2, 4, &y, sizeof(y));
  const auto start = Clock::now();
  Status st = eps[1]->WaitAll(std::vector<RequestId>{r}, DeadlineIn(100ms));
  const auto waited = Clock::now() - start;
  EXPECT_EQ(st.code(), StatusCode::kTimedOut);
  EXPECT_THAT(st.message(), HasSubstr("from rank 2"));
  EXPECT_GE(waited, 100ms);
  EXPECT_LT(waited, 2000ms);
  // The handle was released (cancelled): a late send does not land in y.
  const int x = 9;
  auto s = *eps[2]->PostSend(1, 4, &x, sizeof(x));
  EXPECT_FALSE(*eps[2]->Test(s));
  eps[2]->Cancel(s);
  EXPECT_EQ(y, 0);
}

TEST(LoopbackTest, WaitAnyReturnsTheCompletedIndexAndKeepsTheOthers) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  int a = 0, b = 0;
  auto ra = *eps[1]->PostRecv(0, 1, &a, sizeof(a));
  auto rb = *eps[1]->PostRecv(0, 2, &b, sizeof(b));
  const int x = 3;
  auto s = *eps[0]->PostSend(1, 2, &x, sizeof(x));
  auto idx = eps[1]->WaitAny(std::vector<RequestId>{ra, rb}, Soon());
  ASSERT_TRUE(idx.ok());
  EXPECT_EQ(*idx, 1u);
  EXPECT_EQ(b, 3);
  auto again = eps[1]->WaitAny(std::vector<RequestId>{ra}, DeadlineIn(20ms));
  EXPECT_EQ(again.status().code(), StatusCode::kTimedOut);
  eps[1]->Cancel(ra);
  EXPECT_TRUE(eps[0]->WaitAll(std::vector<RequestId>{s}, Soon()).ok());
}

TEST(LoopbackTest, CancelledReceiveLetsTheMessageGoToTheNextOne) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  int a = 0, b = 0;
  auto ra = *eps[1]->PostRecv(0, 1, &a, sizeof(a));
  eps[1]->Cancel(ra);
  auto rb = *eps[1]->PostRecv(0, 1, &b, sizeof(b));
  const int x = 8;
  auto s = *eps[0]->PostSend(1, 1, &x, sizeof(x));
  ASSERT_TRUE(eps[1]->WaitAll(std::vector<RequestId>{rb}, Soon()).ok());
  ASSERT_TRUE(eps[0]->WaitAll(std::vector<RequestId>{s}, Soon()).ok());
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 8);
}

TEST(LoopbackTest, CancelAllReleasesEveryRequestAndSkipsUnknownOnes) {
  LoopbackHub hub(3);
  auto eps = ConnectAll(hub);
  int a = 0, b = 0;
  const int x = 4, z = 6;
  auto ra = *eps[0]->PostRecv(1, 1, &a, sizeof(a));
  auto rb = *eps[0]->PostRecv(2, 1, &b, sizeof(b));
  auto s1 = *eps[0]->PostSend(1, 2, &x, sizeof(x));
  auto s2 = *eps[0]->PostSend(2, 2, &x, sizeof(x));
  eps[0]->CancelAll(std::vector<RequestId>{ra, s1, rb, s2, ra, 12345});
  for (RequestId id : {ra, rb, s1, s2}) {
    EXPECT_EQ(eps[0]->Test(id).status().code(), StatusCode::kInvalidArgument);
  }
  // Nothing was delivered either way, and later messages go to new requests.
  auto s = *eps[1]->PostSend(0, 1, &z, sizeof(z));
  int got = 0, c = 0;
  auto r2 = *eps[2]->PostRecv(0, 2, &got, sizeof(got));
  EXPECT_EQ(eps[2]->WaitAll(std::vector<RequestId>{r2}, DeadlineIn(30ms)).code(),
            StatusCode::kTimedOut);
  auto rc = *eps[0]->PostRecv(1, 1, &c, sizeof(c));
  ASSERT_TRUE(eps[0]->WaitAll(std::vector<RequestId>{rc}, Soon()).ok());
  ASSERT_TRUE(eps[1]->WaitAll(std::vector<RequestId>{s}, Soon()).ok());
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 0);
  EXPECT_EQ(c, 6);
  eps[0]->CancelAll({});
}

TEST(LoopbackTest, SendToSelfAndEmptyMessagesWork) {
  LoopbackHub hub(1);
  auto eps = ConnectAll(hub);
  const int x = 12;
  int y = 0;
  auto s = *eps[0]->PostSend(0, 1, &x, sizeof(x));
  auto r = *eps[0]->PostRecv(0, 1, &y, sizeof(y));
  auto s0 = *eps[0]->PostSend(0, 2, nullptr, 0);
  auto r0 = *eps[0]->PostRecv(0, 2, nullptr, 0);
  ASSERT_TRUE(eps[0]->WaitAll(std::vector<RequestId>{s, r, s0, r0}, Soon()).ok());
  EXPECT_EQ(y, 12);
}

TEST(LoopbackTest, BadArgumentsAreNamed) {
  LoopbackHub hub(2);
  auto eps = ConnectAll(hub);
  int x = 0;
  auto bad_peer = eps[0]->PostSend(2, 1, &x, sizeof(x));
  EXPECT_EQ(bad_peer.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_peer.status().message(), HasSubstr("peer 2 is outside [0, 2)"));
  auto bad_tag = eps[0]->PostRecv(1, kMaxTag + 1, &x, sizeof(x));
  EXPECT_EQ(bad_tag.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_tag.status().message(), HasSubstr("tag"));
  auto null_buf = eps[0]->PostRecv(1, 1, nullptr, 4);
  EXPECT_EQ(null_buf.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(null_buf.status().message(), HasSubstr("null buffer"));
  auto twice = hub.Connect(1);
  EXPECT_EQ(twice.status().code(), StatusCode::kFailedPrecondition);
  auto outside = hub.Connect(-1);
  EXPECT_EQ(outside.status().code(), StatusCode::kInvalidArgument);
}

// As UCX does: a request listed twice is a caller bug, refused before any
// wait, and every request listed is released.
TEST(LoopbackTest, WaitAllRefusesARequestListedTwice) {
  LoopbackHub hub(1);
  auto eps = ConnectAll(hub);
  const int a = 5;
  int b = 0;
  auto s = eps[0]->PostSend(0, 1, &a, sizeof(a));
  auto r = eps[0]->PostRecv(0, 1, &b, sizeof(b));
  ASSERT_TRUE(s.ok() && r.ok());
  Status waited = eps[0]->WaitAll(std::vector<RequestId>{*s, *r, *r}, Soon());
  EXPECT_EQ(waited.code(), StatusCode::kInvalidArgument) << waited;
  EXPECT_THAT(waited.message(), HasSubstr("listed twice"));
  EXPECT_EQ(eps[0]->Test(*s).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(eps[0]->Test(*r).status().code(), StatusCode::kInvalidArgument);
}

// The test hooks return no Status: a rank outside the hub was ignored (Kill
// did nothing, Stats gave zeros, BytesBetween 0), so a test that named the
// wrong rank passed on nothing. Now the process stops, naming the hook and
// the rank.
TEST(LoopbackDeathTest, TestHooksRefuseARankOutsideTheHub) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  LoopbackHub hub(3);
  EXPECT_DEATH(hub.Kill(3), "LoopbackHub::Kill: rank 3 is outside \\[0, 3\\)");
  EXPECT_DEATH(hub.Kill(-1), "LoopbackHub::Kill: rank -1 is outside \\[0, 3\\)");
  EXPECT_DEATH(hub.IsKilled(5), "LoopbackHub::IsKilled: rank 5 is outside \\[0, 3\\)");
  EXPECT_DEATH(hub.Stats(3), "LoopbackHub::Stats: rank 3 is outside \\[0, 3\\)");
  EXPECT_DEATH(hub.BytesBetween(0, 7), "LoopbackHub::BytesBetween: to 7 is outside \\[0, 3\\)");
  EXPECT_DEATH(hub.BytesBetween(-2, 1), "LoopbackHub::BytesBetween: from -2 is outside \\[0, 3\\)");
  // Ranks inside still answer.
  EXPECT_FALSE(hub.IsKilled(2));
  EXPECT_EQ(hub.Stats(0).messages_sent, 0u);
  EXPECT_EQ(hub.BytesBetween(2, 0), 0u);
}

// A hub's size is checked against its limit: a huge one went on to
// allocate a counter per pair of ranks and died of std::bad_alloc, which
// named neither the size nor the limit.
TEST(LoopbackDeathTest, SizeOutsideTheLimitsIsNamed) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(LoopbackHub(LoopbackHub::kMaxSize + 1),
               "LoopbackHub: size 4097 is outside \\[1, 4096\\] \\(the hub keeps a byte counter "
               "per pair of ranks\\)");
  EXPECT_DEATH(LoopbackHub(1 << 20), "LoopbackHub: size 1048576 is outside \\[1, 4096\\]");
  EXPECT_DEATH(LoopbackHub(0), "LoopbackHub: size 0 is outside \\[1, 4096\\]");
  EXPECT_DEATH(LoopbackHub(-1), "LoopbackHub: size -1 is outside \\[1, 4096\\]");
  // The limit itself is a hub whose farthest ranks still talk.
  LoopbackHub hub(LoopbackHub::kMaxSize);
  auto first = hub.Connect(0);
  auto last = hub.Connect(LoopbackHub::kMaxSize - 1);
  ASSERT_TRUE(first.ok() && last.ok());
  const int value = 3;
  int got = 0;
  auto recv = (*last)->PostRecv(0, 1, &got, sizeof(got));
  auto send = (*first)->PostSend(LoopbackHub::kMaxSize - 1, 1, &value, sizeof(value));
  ASSERT_TRUE(recv.ok() && send.ok());
  ASSERT_TRUE((*first)->WaitAll(std::vector<RequestId>{*send}, Soon()).ok());
  ASSERT_TRUE((*last)->WaitAll(std::vector<RequestId>{*recv}, Soon()).ok());
  EXPECT_EQ(got, 3);
  EXPECT_EQ(hub.BytesBetween(0, LoopbackHub::kMaxSize - 1), sizeof(int));
}

// BytesBetweenGroups took min(list size, hub size) ranks into account, so a
// short list silently left ranks out of the count and a long one was cut.
TEST(LoopbackDeathTest, BytesBetweenGroupsRefusesAListOfTheWrongSize) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  LoopbackHub hub(3);
  EXPECT_DEATH(hub.BytesBetweenGroups({0, 1}),
               "LoopbackHub::BytesBetweenGroups: group_of_rank has 2 entries, expected one per "
               "rank \\(3\\)");
  EXPECT_DEATH(hub.BytesBetweenGroups({0, 1, 0, 1}),
               "LoopbackHub::BytesBetweenGroups: group_of_rank has 4 entries, expected one per "
               "rank \\(3\\)");
  EXPECT_DEATH(hub.BytesBetweenGroups({}), "group_of_rank has 0 entries");
  auto eps = ConnectAll(hub);
  const int value = 7;
  int got = 0;
  auto recv = eps[2]->PostRecv(0, 1, &got, sizeof(got));
  ASSERT_TRUE(recv.ok()) << recv.status();
  auto send = eps[0]->PostSend(2, 1, &value, sizeof(value));
  ASSERT_TRUE(send.ok()) << send.status();
  ASSERT_TRUE(eps[0]->WaitAll({&send.value(), 1}, Soon()).ok());
  ASSERT_TRUE(eps[2]->WaitAll({&recv.value(), 1}, Soon()).ok());
  // Rank 2 alone in group 1: its bytes cross; all in one group: none do.
  EXPECT_EQ(hub.BytesBetweenGroups({0, 0, 1}), sizeof(int));
  EXPECT_EQ(hub.BytesBetweenGroups({0, 1, 0}), 0u);
}

TEST(LoopbackTest, KillFailsPeersWithPeerLostAndTheVictimWithAborted) {
  LoopbackHub hub(3);
  auto eps = ConnectAll(hub);
  int y = 0;
  auto r = *eps[0]->PostRecv(1, 1, &y, sizeof(y));
  const int x = 1;
  auto queued_from_victim = *eps[1]->PostSend(2, 1, &x, sizeof(x));
  auto victim_recv = *eps[1]->PostRecv(0, 1, &y, sizeof(y));

  // A waiter blocked in another thread is woken by the kill.
  Status blocked;
  std::thread waiter([&] { blocked = eps[0]->WaitAll(std::vector<RequestId>{r}, Soon()); });
  std::this_thread::sleep_for(20ms);
  const auto start = Clock::now();
  hub.Kill(1);
  waiter.join();
  EXPECT_LT(Clock::now() - start, 1000ms);
  EXPECT_EQ(blocked.code(), StatusCode::kPeerLost);
  EXPECT_THAT(blocked.message(), HasSubstr("rank 1 was lost"));
  EXPECT_TRUE(hub.IsKilled(1));

  // The dead rank's queued message is dropped, not delivered.
  int z = 0;
  auto late = eps[2]->PostRecv(1, 1, &z, sizeof(z));
  EXPECT_EQ(late.status().code(), StatusCode::kPeerLost);
  EXPECT_EQ(z, 0);
  // The victim's own operations report that it was killed.
  EXPECT_EQ(eps[1]->WaitAll(std::vector<RequestId>{queued_from_victim}, Soon()).code(),
            StatusCode::kAborted);
  EXPECT_EQ(eps[1]->WaitAll(std::vector<RequestId>{victim_recv}, Soon()).code(),
            StatusCode::kAborted);
  EXPECT_EQ(eps[1]->PostSend(0, 1, &x, sizeof(x)).status().code(), StatusCode::kAborted);
  EXPECT_EQ(eps[0]->PostSend(1, 1, &x, sizeof(x)).status().code(), StatusCode::kPeerLost);
  // Ranks that do not involve the dead one keep working.
  auto s = *eps[0]->PostSend(2, 5, &x, sizeof(x));
  auto r2 = *eps[2]->PostRecv(0, 5, &z, sizeof(z));
  EXPECT_TRUE(eps[2]->WaitAll(std::vector<RequestId>{r2}, Soon()).ok());
  EXPECT_TRUE(eps[0]->WaitAll(std::vector<RequestId>{s}, Soon()).ok());
}

// A watched receive (MarkWatched) whose peer is killed fails no wait that
// still needs another request: WaitAny and WaitAll go on for that one, and
// report the watched receive's loss only once nothing else is pending; a
// wait on the watched receive alone fails at once. Sends are never watched.
TEST(LoopbackTest, AWatchedReceiveFromALostPeerFailsOnlyAWaitLeftWithIt) {
  LoopbackHub hub(3);
  auto eps = ConnectAll(hub);
  int needed = 0, note = 0, late = 0;
  auto need = *eps[0]->PostRecv(1, 1, &needed, sizeof(needed));
  auto watch = *eps[0]->PostRecv(2, 1, &note, sizeof(note));
  auto watch_alone = *eps[0]->PostRecv(2, 2, &late, sizeof(late));
  eps[0]->MarkWatched(watch);
  eps[0]->MarkWatched(watch_alone);
  const int x = 7;
  auto to2 = *eps[0]->PostSend(2, 3, &x, sizeof(x));
  eps[0]->MarkWatched(to2);
  hub.Kill(2);
  std::thread sender([&] {
    std::this_thread::sleep_for(50ms);
    auto s = *eps[1]->PostSend(0, 1, &x, sizeof(x));
    EXPECT_TRUE(eps[1]->WaitAll(std::vector<RequestId>{s}, Soon()).ok());
  });
  auto index = eps[0]->WaitAny(std::vector<RequestId>{watch, need}, Soon());
  sender.join();
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(*index, 1u);
  EXPECT_EQ(needed, 7);
  auto alone = eps[0]->WaitAny(std::vector<RequestId>{watch}, Soon());
  EXPECT_EQ(alone.status().code(), StatusCode::kPeerLost) << alone.status();
  // WaitAll: the needed receive completes first, then the watched one's
  // loss is the result.
  auto need2 = *eps[0]->PostRecv(1, 4, &needed, sizeof(needed));
  auto s2 = *eps[1]->PostSend(0, 4, &x, sizeof(x));
  Status all = eps[0]->WaitAll(std::vector<RequestId>{watch_alone, need2}, Soon());
  EXPECT_EQ(all.code(), StatusCode::kPeerLost) << all;
  EXPECT_TRUE(eps[1]->WaitAll(std::vector<RequestId>{s2}, Soon()).ok());
  // The send to the lost rank was not watched: it fails as any send.
  EXPECT_EQ(eps[0]->WaitAll(std::vector<RequestId>{to2}, Soon()).code(), StatusCode::kPeerLost);
}

// Many threads pass large and small messages around a ring concurrently.
TEST(LoopbackTest, ThreadsExchangeConcurrentlyAroundARing) {
  constexpr int kRanks = 8;
  constexpr int kRounds = 200;
  LoopbackHub hub(kRanks);
  auto eps = ConnectAll(hub);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      PointToPoint& ep = *eps[r];
      const int next = (r + 1) % kRanks, prev = (r + kRanks - 1) % kRanks;
      std::vector<int> out(1000), in(1000);
      for (int round = 0; round < kRounds; ++round) {
        std::iota(out.begin(), out.end(), r * 1000000 + round);
        auto rr = ep.PostRecv(prev, round, in.data(), in.size() * sizeof(int));
        auto ss = ep.PostSend(next, round, out.data(), out.size() * sizeof(int));
        if (!rr.ok() || !ss.ok() ||
            !ep.WaitAll(std::vector<RequestId>{*rr, *ss}, Soon()).ok() ||
            in[999] != prev * 1000000 + round + 999) {
          ++failures;
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace ddp::transport::p2p
