#ifndef DDP_TRANSPORT_TESTING_FORWARDING_STORE_H_
#define DDP_TRANSPORT_TESTING_FORWARDING_STORE_H_

// A store::Store that hands every call to an InMemoryStore it owns: tests
// derive from it and override only the calls whose behaviour they change
// (a read that fails once, one that is slow, a key never found). Check and
// StoppedCleanly are the exceptions: they are Store's defaults, Check
// asking this class's TryGet key by key, so that a TryGet overridden to
// fail or lag fails or lags Check alike (InMemoryStore has no Check of its
// own to forward to, and never stops).

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "transport/store/store.h"
#include "transport/testing/in_memory_store.h"

namespace ddp::transport::testing {

class ForwardingStore : public store::Store {
 public:
  Status Set(std::string_view key, std::string_view value, Deadline d) override { return inner_.Set(key, value, d); }
  StatusOr<std::string> Get(std::string_view key, Deadline d) override { return inner_.Get(key, d); }
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline d) override {
    return inner_.TryGet(key, d);
  }
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline d) override { return inner_.Add(key, delta, d); }
  Status Wait(std::span<const std::string> keys, Deadline d) override { return inner_.Wait(keys, d); }
  StatusOr<std::vector<std::string>> MultiGet(std::span<const std::string> keys, Deadline d) override {
    return inner_.MultiGet(keys, d);
  }
  StatusOr<bool> Delete(std::string_view key, Deadline d) override { return inner_.Delete(key, d); }
  StatusOr<int64_t> NumKeys(Deadline d) override { return inner_.NumKeys(d); }
  StatusOr<std::optional<std::string>> CompareSet(std::string_view key, std::optional<std::string_view> expected,
                                                  std::string_view desired, Deadline d) override {
    return inner_.CompareSet(key, expected, desired, d);
  }

  /// The store behind it, read without the overrides.
  InMemoryStore& inner() { return inner_; }

 protected:
  InMemoryStore inner_;
};

}  // namespace ddp::transport::testing

#endif  // DDP_TRANSPORT_TESTING_FORWARDING_STORE_H_
