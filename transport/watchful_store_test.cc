#include "transport/watchful_store.h"

#include <chrono>
#include <thread>

#include "gtest/gtest.h"
#include "transport/fault/peer_monitor.h"
#include "transport/testing/in_memory_store.h"

namespace ddp::transport::internal {
namespace {

using namespace std::chrono_literals;
using testing::InMemoryStore;

// An in-memory store whose MultiGet takes `delay` to answer however soon
// the keys are there, as a busy server's reply to a read of many keys.
class SlowReadStore final : public store::Store {
 public:
  explicit SlowReadStore(std::chrono::milliseconds delay) : delay_(delay) {}
  Status Set(std::string_view key, std::string_view value, Deadline d) override { return inner_.Set(key, value, d); }
  StatusOr<std::string> Get(std::string_view key, Deadline d) override { return inner_.Get(key, d); }
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline d) override {
    return inner_.TryGet(key, d);
  }
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline d) override { return inner_.Add(key, delta, d); }
  Status Wait(std::span<const std::string> keys, Deadline d) override { return inner_.Wait(keys, d); }
  StatusOr<std::vector<std::string>> MultiGet(std::span<const std::string> keys, Deadline d) override {
    if (Clock::now() + delay_ > d) {
      std::this_thread::sleep_until(d);
      return TimedOutError("multi-get timed out after " + std::to_string(delay_.count()) + " ms");
    }
    std::this_thread::sleep_for(delay_);
    return inner_.MultiGet(keys, d);
  }
  StatusOr<bool> Delete(std::string_view key, Deadline d) override { return inner_.Delete(key, d); }
  StatusOr<std::optional<std::string>> CompareSet(std::string_view key, std::optional<std::string_view> expected,
                                                  std::string_view desired, Deadline d) override {
    return inner_.CompareSet(key, expected, desired, d);
  }

 private:
  InMemoryStore inner_;
  std::chrono::milliseconds delay_;
};

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

}  // namespace
}  // namespace ddp::transport::internal
