#include "transport/p2p/group_view.h"

#include <chrono>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/p2p/loopback.h"

namespace ddp::transport::p2p {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

TEST(GroupViewTest, MapsGroupRanksAndTagsToTheParent) {
  LoopbackHub hub(4);
  auto p1 = std::move(hub.Connect(1)).value();
  auto p3 = std::move(hub.Connect(3)).value();
  // Group {3, 1}: group rank 0 is parent 3, group rank 1 is parent 1.
  auto g3 = GroupView::Create(*p3, {3, 1}, /*tag_offset=*/1000);
  auto g1 = GroupView::Create(*p1, {3, 1}, 1000);
  ASSERT_TRUE(g3.ok()) << g3.status();
  ASSERT_TRUE(g1.ok()) << g1.status();
  EXPECT_EQ(g3->rank(), 0);
  EXPECT_EQ(g1->rank(), 1);
  EXPECT_EQ(g1->size(), 2);
  EXPECT_EQ(g1->ParentRank(0), 3);

  const int x = 77;
  int y = 0, raw = 0;
  auto s = *g3->PostSend(1, 5, &x, sizeof(x));
  // The parent sees parent rank 3 and tag 1005.
  auto r = *p1->PostRecv(3, 1005, &raw, sizeof(raw));
  ASSERT_TRUE(p1->WaitAll(std::vector<RequestId>{r}, DeadlineIn(5000ms)).ok());
  EXPECT_EQ(raw, 77);
  ASSERT_TRUE(g3->WaitAll(std::vector<RequestId>{s}, DeadlineIn(5000ms)).ok());

  // And the other direction through both views.
  auto s2 = *g1->PostSend(0, 6, &x, sizeof(x));
  auto r2 = *g3->PostRecv(1, 6, &y, sizeof(y));
  ASSERT_TRUE(g3->WaitAll(std::vector<RequestId>{r2}, DeadlineIn(5000ms)).ok());
  ASSERT_TRUE(g1->WaitAll(std::vector<RequestId>{s2}, DeadlineIn(5000ms)).ok());
  EXPECT_EQ(y, 77);
}

TEST(GroupViewTest, NoticeGoesToTheParentRankAndTag) {
  LoopbackHub hub(4);
  auto p1 = std::move(hub.Connect(1)).value();
  auto p3 = std::move(hub.Connect(3)).value();
  auto g3 = GroupView::Create(*p3, {3, 1}, /*tag_offset=*/1000);
  ASSERT_TRUE(g3.ok()) << g3.status();
  const int x = 78;
  ASSERT_TRUE(g3->PostNotice(1, 5, &x, sizeof(x)).ok());
  int raw = 0;
  auto r = *p1->PostRecv(3, 1005, &raw, sizeof(raw));
  ASSERT_TRUE(p1->WaitAll(std::vector<RequestId>{r}, DeadlineIn(5000ms)).ok());
  EXPECT_EQ(raw, 78);
  Status outside = g3->PostNotice(2, 5, &x, sizeof(x));
  EXPECT_EQ(outside.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(outside.message(), HasSubstr("peer 2"));
}

TEST(GroupViewTest, ViewsWithDifferentOffsetsDoNotSeeEachOthersMessages) {
  LoopbackHub hub(2);
  auto p0 = std::move(hub.Connect(0)).value();
  auto p1 = std::move(hub.Connect(1)).value();
  auto a0 = *GroupView::Create(*p0, {0, 1}, 0);
  auto b1 = *GroupView::Create(*p1, {0, 1}, 1 << 20);
  const int x = 1;
  int y = 0;
  auto s = *a0.PostSend(1, 3, &x, sizeof(x));
  auto r = *b1.PostRecv(0, 3, &y, sizeof(y));
  EXPECT_EQ(b1.WaitAll(std::vector<RequestId>{r}, DeadlineIn(30ms)).code(),
            StatusCode::kTimedOut);
  a0.Cancel(s);
  EXPECT_EQ(y, 0);
}

TEST(GroupViewTest, CancelAllReachesTheParent) {
  LoopbackHub hub(3);
  auto p0 = std::move(hub.Connect(0)).value();
  auto p2 = std::move(hub.Connect(2)).value();
  auto g0 = GroupView::Create(*p0, {0, 2});
  ASSERT_TRUE(g0.ok()) << g0.status();
  int y = 0;
  const int x = 5;
  auto r = *g0->PostRecv(1, 3, &y, sizeof(y));
  auto s = *g0->PostSend(1, 4, &x, sizeof(x));
  g0->CancelAll(std::vector<RequestId>{r, s});
  EXPECT_EQ(p0->Test(r).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p0->Test(s).status().code(), StatusCode::kInvalidArgument);
  // Parent rank 2's message finds no receive: the cancelled one is gone.
  auto late = *p2->PostSend(0, 3, &x, sizeof(x));
  EXPECT_EQ(p2->WaitAll(std::vector<RequestId>{late}, DeadlineIn(30ms)).code(),
            StatusCode::kTimedOut);
  EXPECT_EQ(y, 0);
}

TEST(GroupViewTest, BadMembersAndTagsAreNamed) {
  LoopbackHub hub(3);
  auto p0 = std::move(hub.Connect(0)).value();
  auto not_member = GroupView::Create(*p0, {1, 2});
  EXPECT_EQ(not_member.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(not_member.status().message(), HasSubstr("calling rank 0 is not among"));
  auto twice = GroupView::Create(*p0, {0, 1, 1});
  EXPECT_THAT(twice.status().message(), HasSubstr("rank 1 is listed twice"));
  auto outside = GroupView::Create(*p0, {0, 5});
  EXPECT_THAT(outside.status().message(), HasSubstr("rank 5, outside"));
  auto empty = GroupView::Create(*p0, {});
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);

  auto view = *GroupView::Create(*p0, {0, 2}, kMaxTag - 10);
  int x = 0;
  EXPECT_THAT(view.PostSend(1, 11, &x, sizeof(x)).status().message(),
              HasSubstr("does not fit"));
  EXPECT_THAT(view.PostSend(2, 1, &x, sizeof(x)).status().message(),
              HasSubstr("peer 2 is outside the group's [0, 2)"));
}

}  // namespace
}  // namespace ddp::transport::p2p
