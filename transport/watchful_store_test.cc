#include "transport/watchful_store.h"

#include <chrono>
#include <thread>

#include "gtest/gtest.h"
#include "transport/fault/peer_monitor.h"
#include "transport/testing/forwarding_store.h"
#include "transport/testing/in_memory_store.h"
#include "transport/topology/discover.h"

namespace ddp::transport::internal {
namespace {

using namespace std::chrono_literals;
using testing::InMemoryStore;

// An in-memory store whose MultiGet takes `delay` to answer however soon
// the keys are there, as a busy server's reply to a read of many keys.
class SlowReadStore final : public testing::ForwardingStore {
 public:
  explicit SlowReadStore(std::chrono::milliseconds delay) : delay_(delay) {}
  StatusOr<std::vector<std::string>> MultiGet(std::span<const std::string> keys, Deadline d) override {
    if (Clock::now() + delay_ > d) {
      std::this_thread::sleep_until(d);
      return TimedOutError("multi-get timed out after " + std::to_string(delay_.count()) + " ms");
    }
    std::this_thread::sleep_for(delay_);
    return inner_.MultiGet(keys, d);
  }

 private:
  std::chrono::milliseconds delay_;
};

// An in-memory store that says whether its server was stopped after a
// clean end of the job as `stopped` says.
class StoppableStore final : public testing::ForwardingStore {
 public:
  bool StoppedCleanly() const override { return stopped; }
  bool stopped = false;
};

// Whether the store was stopped after a clean end of the job is the inner
// store's answer (it was always the base class's false).
TEST(WatchfulStore, ForwardsWhetherTheStoreWasStoppedCleanly) {
  StoppableStore inner;
  WatchfulStore store(inner, "job/abort");
  EXPECT_FALSE(store.StoppedCleanly());
  inner.stopped = true;
  EXPECT_TRUE(store.StoppedCleanly());
}

// A read of many keys that takes longer than a slice still finishes: the
// slices cut only the wait for the keys (it started over at every slice,
// so it never finished and ran to the deadline).
TEST(WatchfulStore, AReadLongerThanASliceFinishes) {
  SlowReadStore inner(300ms);
  ASSERT_TRUE(inner.Set("a", "1", DeadlineIn(1s)).ok());
  ASSERT_TRUE(inner.Set("b", "2", DeadlineIn(1s)).ok());
  WatchfulStore store(inner, "job/abort", 100ms);
  const std::vector<std::string> keys = {"a", "b"};
  auto got = store.MultiGet(keys, DeadlineIn(3s));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<std::string>{"1", "2"}));
}

// Waiting for a key that is never set ends at once when another rank posts
// its failure under the abort key, with that rank's reason.
TEST(WatchfulStore, AnAbortPostedMeanwhileEndsTheWait) {
  InMemoryStore inner;
  WatchfulStore store(inner, "job/abort", 50ms);
  std::thread poster([&] {
    std::this_thread::sleep_for(200ms);
    (void)inner.Set("job/abort", fault::PeerMonitor::EncodeAbort(3, UnavailableError("no GPU on node 2")),
                    DeadlineIn(1s));
  });
  const auto start = Clock::now();
  const std::vector<std::string> keys = {"present", "missing"};
  ASSERT_TRUE(inner.Set("present", "x", DeadlineIn(1s)).ok());
  auto got = store.MultiGet(keys, DeadlineIn(20s));
  poster.join();
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("no GPU on node 2"), std::string::npos) << got.status();
  EXPECT_LT(Clock::now() - start, 5s);
}

// A wait that runs out names the first key still missing.
TEST(WatchfulStore, ATimedOutReadNamesTheMissingKey) {
  InMemoryStore inner;
  WatchfulStore store(inner, "job/abort", 50ms);
  ASSERT_TRUE(inner.Set("rank/0", "x", DeadlineIn(1s)).ok());
  const std::vector<std::string> keys = {"rank/0", "rank/1"};
  auto got = store.MultiGet(keys, DeadlineIn(300ms));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kTimedOut);
  EXPECT_NE(got.status().message().find("key 'rank/1' is not set"), std::string::npos) << got.status();
}

// A look for the missing key that starts more than its window past the
// deadline (a caller whose deadline was long past, a read that overran it)
// still reads the keys and names the missing one: it read none and said
// "no key of 2 could be read", though no read was tried.
TEST(WatchfulStore, ALookBegunLongAfterTheDeadlineStillNamesTheMissingKey) {
  InMemoryStore inner;
  WatchfulStore store(inner, "job/abort", 50ms);
  ASSERT_TRUE(inner.Set("rank/0", "x", DeadlineIn(1s)).ok());
  const std::vector<std::string> keys = {"rank/0", "rank/1"};
  Status waited = store.Wait(keys, Clock::now() - 3s);
  EXPECT_EQ(waited.code(), StatusCode::kTimedOut) << waited;
  EXPECT_NE(waited.message().find("key 'rank/1' is not set"), std::string::npos) << waited;
}

// An in-memory store whose TryGet of a "rank/" key takes `delay`, as a
// look at one key of thousands from a busy server.
class SlowLookStore final : public testing::ForwardingStore {
 public:
  explicit SlowLookStore(std::chrono::milliseconds delay) : delay_(delay) {}
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline d) override {
    if (key.starts_with("rank/")) {
      if (Clock::now() + delay_ > d) {
        std::this_thread::sleep_until(d);
        return TimedOutError("try_get timed out after " + std::to_string(delay_.count()) + " ms");
      }
      std::this_thread::sleep_for(delay_);
    }
    return inner_.TryGet(key, d);
  }

 private:
  std::chrono::milliseconds delay_;
};

// The look for the missing key after a timed-out wait has one budget for
// all its keys (it gave each look a second of its own, so thousands of keys
// took that many round trips without bound), and says when it was cut short.
TEST(WatchfulStore, TheLookForTheMissingKeyHasOneBudget) {
  SlowLookStore inner(300ms);
  std::vector<std::string> keys;
  for (int i = 0; i < 20; ++i) {
    keys.push_back("rank/" + std::to_string(i));
    if (i < 19) {
      ASSERT_TRUE(inner.inner().Set(keys.back(), "x", DeadlineIn(1s)).ok());
    }
  }
  WatchfulStore store(inner, "job/abort", 50ms);
  const auto start = Clock::now();
  Status waited = store.Wait(keys, DeadlineIn(200ms));
  const auto took = Clock::now() - start;
  EXPECT_EQ(waited.code(), StatusCode::kTimedOut) << waited;
  // 200 ms of wait and 2 s of looking, not 20 looks of 300 ms.
  EXPECT_LT(took, 4s) << waited;
  EXPECT_NE(waited.message().find("cut short: "), std::string::npos) << waited;
  EXPECT_NE(waited.message().find("of 20 keys"), std::string::npos) << waited;
}

// A store that stops answering reads (a stalled server): every TryGet,
// Wait and MultiGet waits out its deadline and fails TIMED_OUT; writes go
// through.
class StalledStore final : public testing::ForwardingStore {
 public:
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline d) override {
    std::this_thread::sleep_until(d);
    return TimedOutError("try_get of " + std::string(key) + " timed out");
  }
  Status Wait(std::span<const std::string>, Deadline d) override {
    const auto start = Clock::now();
    std::this_thread::sleep_until(d);
    return TimedOutError("wait timed out after " +
                         std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()) +
                         " ms");
  }
  StatusOr<std::vector<std::string>> MultiGet(std::span<const std::string> keys, Deadline d) override {
    DDP_RETURN_IF_ERROR(Wait(keys, d));
    return inner_.MultiGet(keys, d);
  }
};

// A look for the missing key that no read answered says that no key was
// looked at (it said "cut short after 0 of 2 keys, all set").
TEST(WatchfulStore, ALookCutShortBeforeAnyKeySaysNoneWasLookedAt) {
  StalledStore inner;
  WatchfulStore store(inner, "job/abort", 50ms);
  const std::vector<std::string> keys = {"rank/0", "rank/1"};
  Status waited = store.Wait(keys, DeadlineIn(100ms));
  EXPECT_EQ(waited.code(), StatusCode::kTimedOut) << waited;
  EXPECT_EQ(waited.message().find("all set"), std::string::npos) << waited;
  EXPECT_NE(waited.message().find("no key of 2 could be read"), std::string::npos) << waited;
}

// A look cut short after some keys says how many were read, all set, and
// how many were not read.
TEST(WatchfulStore, ALookCutShortSaysWhatWasAndWasNotRead) {
  SlowLookStore inner(300ms);
  std::vector<std::string> keys;
  for (int i = 0; i < 20; ++i) {
    keys.push_back("rank/" + std::to_string(i));
    ASSERT_TRUE(inner.inner().Set(keys.back(), "x", DeadlineIn(1s)).ok());
  }
  keys.push_back("rank/missing");
  WatchfulStore store(inner, "job/abort", 50ms);
  Status waited = store.Wait(keys, DeadlineIn(100ms));
  EXPECT_EQ(waited.code(), StatusCode::kTimedOut) << waited;
  const std::string& m = waited.message();
  const size_t read = m.find(" of 21 keys were read, all set; the other ");
  ASSERT_NE(read, std::string::npos) << waited;
  EXPECT_NE(m.find(" were not read", read), std::string::npos) << waited;
}

// A communicator's creation that times out on a stalled store looks for the
// missing rank twice, in the creation store's wait and in the topology
// exchange: the two looks share one window of kMissingRankLookBudget past
// the deadline (the second, begun after it, has only its quick look),
// instead of running one after the other (4 s past it).
TEST(WatchfulStore, TheTwoLooksForAMissingRankShareOneWindowPastTheDeadline) {
  StalledStore inner;
  WatchfulStore store(inner, "job/abort", 50ms);
  topology::LocalView view;
  view.host.name = "a";
  const auto start = Clock::now();
  auto result = topology::ExchangeTopology(store, "job/", 0, 3, view, DeadlineIn(300ms));
  const auto took = Clock::now() - start;
  EXPECT_EQ(result.status().code(), StatusCode::kTimedOut) << result.status();
  // The exchange's look starts after the window and gets its quick look.
  EXPECT_LT(took, 300ms + topology::kMissingRankLookBudget + topology::kMissingRankQuickLook + 500ms)
      << result.status();
}

// Get waits in slices until the key is set, and returns its value.
TEST(WatchfulStore, GetReturnsAValueSetAfterSeveralSlices) {
  InMemoryStore inner;
  WatchfulStore store(inner, "job/abort", 50ms);
  std::thread setter([&] {
    std::this_thread::sleep_for(300ms);
    (void)inner.Set("rank/1", "ready", DeadlineIn(1s));
  });
  StatusOr<std::string> got = store.Get("rank/1", DeadlineIn(10s));
  setter.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "ready");
}

// A Get ends with another rank's posted reason, well before its deadline;
// one never answered ends TIMED_OUT at its deadline.
TEST(WatchfulStore, GetEndsOnAnAbortAndAtItsDeadline) {
  InMemoryStore inner;
  WatchfulStore store(inner, "job/abort", 50ms);
  const auto start = Clock::now();
  StatusOr<std::string> timed_out = store.Get("never", DeadlineIn(300ms));
  EXPECT_EQ(timed_out.status().code(), StatusCode::kTimedOut) << timed_out.status();
  EXPECT_GE(Clock::now() - start, 300ms);
  EXPECT_LT(Clock::now() - start, 3s);

  std::thread poster([&] {
    std::this_thread::sleep_for(200ms);
    (void)inner.Set("job/abort", fault::PeerMonitor::EncodeAbort(2, UnavailableError("rank 2 ran out of memory")),
                    DeadlineIn(1s));
  });
  const auto posted_from = Clock::now();
  StatusOr<std::string> aborted = store.Get("never", DeadlineIn(20s));
  poster.join();
  ASSERT_FALSE(aborted.ok());
  EXPECT_NE(aborted.status().message().find("rank 2 ran out of memory"), std::string::npos) << aborted.status();
  EXPECT_LT(Clock::now() - posted_from, 5s);
}

// An in-memory store whose first wait (Wait or Get) runs out its slice
// while the last rank posts its key and then, having read every key and
// found a fault (a setting that differs), the job's abort: what a rank
// descheduled between its slice and its look at the abort key meets.
class LastKeyAndAbortAfterTheSliceStore final : public testing::ForwardingStore {
 public:
  Status Wait(std::span<const std::string> keys, Deadline d) override {
    if (First()) return TimedOutError("wait timed out after 50 ms");
    return inner_.Wait(keys, d);
  }
  StatusOr<std::string> Get(std::string_view key, Deadline d) override {
    if (First()) return TimedOutError("get timed out after 50 ms");
    return inner_.Get(key, d);
  }

 private:
  bool First() {
    if (posted_) return false;
    posted_ = true;
    (void)inner_.Set("rank/1", "theirs", DeadlineIn(1s));
    (void)inner_.Set("job/abort",
                     fault::PeerMonitor::EncodeAbort(1, InvalidArgumentError("rank 1's own view")),
                     DeadlineIn(1s));
    return true;
  }
  bool posted_ = false;
};

// A wait whose keys were all set by the time it saw another rank's abort
// succeeds, as one that saw them within its slice does: this rank then
// checks what it read itself (naming the setting that differs from its
// own view) and meets the abort at its next wait. It used to fail with
// the other rank's reason, so which of the two a rank reported depended
// on how late it was scheduled (communicator_test's
// SettingThatDiffersBetweenRanksFailsCreationOnEveryRank, under load).
TEST(WatchfulStore, AWaitWhoseKeysAreAllSetWhenItSeesAnAbortSucceeds) {
  {
    LastKeyAndAbortAfterTheSliceStore inner;
    ASSERT_TRUE(inner.inner().Set("rank/0", "mine", DeadlineIn(1s)).ok());
    WatchfulStore store(inner, "job/abort", 50ms);
    const std::vector<std::string> keys = {"rank/0", "rank/1"};
    auto got = store.MultiGet(keys, DeadlineIn(10s));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, (std::vector<std::string>{"mine", "theirs"}));
    // The next wait, for a key nobody sets, ends with the abort.
    auto next = store.Get("never", DeadlineIn(10s));
    ASSERT_FALSE(next.ok());
    EXPECT_NE(next.status().message().find("rank 1's own view"), std::string::npos) << next.status();
  }
  {
    LastKeyAndAbortAfterTheSliceStore inner;
    WatchfulStore store(inner, "job/abort", 50ms);
    StatusOr<std::string> got = store.Get("rank/1", DeadlineIn(10s));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, "theirs");
  }
}

// A store that counts the Check calls it is asked, answering them itself.
class CheckCountingStore final : public testing::ForwardingStore {
 public:
  StatusOr<bool> Check(std::span<const std::string> keys, Deadline d) override {
    ++checks_;
    return inner_.Check(keys, d);
  }
  int checks() const { return checks_; }

 private:
  int checks_ = 0;
};

// Check and NumKeys reach the inner store: NumKeys answered
// FAILED_PRECONDITION ("cannot count") and Check went key by key through
// TryGet instead of the inner store's one call.
TEST(WatchfulStore, CheckAndNumKeysAreTheInnerStores) {
  CheckCountingStore inner;
  ASSERT_TRUE(inner.Set("a", "1", DeadlineIn(1s)).ok());
  ASSERT_TRUE(inner.Set("b", "2", DeadlineIn(1s)).ok());
  WatchfulStore store(inner, "job/abort", 50ms);
  auto count = store.NumKeys(DeadlineIn(1s));
  ASSERT_TRUE(count.ok()) << count.status();
  EXPECT_EQ(*count, 2);
  const std::vector<std::string> present = {"a", "b"};
  const std::vector<std::string> one_missing = {"a", "c"};
  auto all = store.Check(present, DeadlineIn(1s));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_TRUE(*all);
  auto some = store.Check(one_missing, DeadlineIn(1s));
  ASSERT_TRUE(some.ok()) << some.status();
  EXPECT_FALSE(*some);
  EXPECT_EQ(inner.checks(), 2);
}

}  // namespace
}  // namespace ddp::transport::internal
