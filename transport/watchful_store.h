#ifndef DDP_TRANSPORT_WATCHFUL_STORE_H_
#define DDP_TRANSPORT_WATCHFUL_STORE_H_

// The store as a communicator's creation uses it: a wait for another rank's
// key also watches the job's abort key, which a rank whose creation failed
// posts, so the others fail within moments with its reason instead of
// waiting out the creation deadline for a key that will never be written.
// A wait whose keys are all set by the time it sees the abort succeeds all
// the same (the abort ends the next wait), so that what it returns does not
// hang on when this rank looked.

#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "transport/status.h"
#include "transport/store/store.h"
#include "transport/types.h"

namespace ddp::transport::internal {

class WatchfulStore final : public store::Store {
 public:
  /// Waits in slices of `slice`, looking at `abort_key` between them.
  WatchfulStore(store::Store& inner, std::string abort_key,
                std::chrono::milliseconds slice = std::chrono::milliseconds(200))
      : inner_(inner), abort_key_(std::move(abort_key)), slice_(slice) {}

  Status Set(std::string_view key, std::string_view value, Deadline deadline) override {
    return inner_.Set(key, value, deadline);
  }
  StatusOr<std::string> Get(std::string_view key, Deadline deadline) override;
  /// Waits (sliced) until every key is set, then reads them all with one
  /// call given the whole deadline: a read of many keys may take longer
  /// than a slice (a thousand ranks' records from a busy store), and a
  /// sliced read would start over at each slice and never finish.
  StatusOr<std::vector<std::string>> MultiGet(std::span<const std::string> keys,
                                              Deadline deadline) override;
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline deadline) override {
    return inner_.TryGet(key, deadline);
  }
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline deadline) override {
    return inner_.Add(key, delta, deadline);
  }
  Status Wait(std::span<const std::string> keys, Deadline deadline) override;
  /// Asked of the inner store as it is (a look, not a wait): the TCP store
  /// answers many keys per round trip, and the base class's default would
  /// ask key by key.
  StatusOr<bool> Check(std::span<const std::string> keys, Deadline deadline) override {
    return inner_.Check(keys, deadline);
  }
  /// The inner store's count (the base class's default says it cannot count).
  StatusOr<int64_t> NumKeys(Deadline deadline) override { return inner_.NumKeys(deadline); }
  StatusOr<bool> Delete(std::string_view key, Deadline deadline) override {
    return inner_.Delete(key, deadline);
  }
  StatusOr<std::optional<std::string>> CompareSet(std::string_view key,
                                                  std::optional<std::string_view> expected,
                                                  std::string_view desired, Deadline deadline) override {
    return inner_.CompareSet(key, expected, desired, deadline);
  }
  /// The inner store's (the base class's default would always say false,
  /// and a peer monitor over this store would take a clean stop for a
  /// lost server).
  bool StoppedCleanly() const override { return inner_.StoppedCleanly(); }

 private:
  Deadline Slice(Deadline deadline) const { return std::min(deadline, Clock::now() + slice_); }
  // A wait for several keys that timed out at `deadline`, naming the first
  // key still missing (its rank, in creation's keys), found by one look at
  // each, all by `deadline` + kNameMissingBudget (the same window as
  // topology::kMissingRankLookBudget, which the topology exchange's look
  // after this one shares: a creation's timeout ends within its deadline
  // and 2 s, and a quick look of the exchange's, not 4 s); a look that
  // starts later than that gets kNameMissingQuickLook from its start
  // instead (one or a few reads of a store that answers, so the key is
  // still named). When that runs out (or a look fails) first, the message
  // says how many keys were read, all set, and how many were not.
  static constexpr std::chrono::milliseconds kNameMissingBudget{2000};
  static constexpr std::chrono::milliseconds kNameMissingQuickLook{200};
  Status NameMissing(const Status& timed_out, std::span<const std::string> keys, Deadline deadline);
  // The reason another rank posted, as an error; OK when none.
  Status Posted(Deadline deadline);

  store::Store& inner_;
  std::string abort_key_;
  std::chrono::milliseconds slice_;
};

}  // namespace ddp::transport::internal

#endif  // DDP_TRANSPORT_WATCHFUL_STORE_H_
