#ifndef DDP_TRANSPORT_TESTING_IN_MEMORY_STORE_H_
#define DDP_TRANSPORT_TESTING_IN_MEMORY_STORE_H_

// A store::Store shared by threads of one process, for tests of layers that
// rendezvous through a store (topology exchange, communicator bootstrap).
// Honors deadlines like the TCP store does, and refuses what it refuses
// with the same codes: an empty key (INVALID_ARGUMENT), a key or value
// over store.h's bounds (RESOURCE_EXHAUSTED), an Add to a value that is
// not an integer or one that overflows (FAILED_PRECONDITION), each naming
// the call and the key.

#include <charconv>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "transport/store/store.h"

namespace ddp::transport::testing {

class InMemoryStore final : public store::Store {
 public:
  Status Set(std::string_view key, std::string_view value, Deadline) override {
    DDP_RETURN_IF_ERROR(CheckKey(key, "set"));
    DDP_RETURN_IF_ERROR(CheckValue(key, value.size(), "set"));
    std::lock_guard lock(mu_);
    data_[std::string(key)] = std::string(value);
    cv_.notify_all();
    return Status::Ok();
  }
  StatusOr<std::string> Get(std::string_view key, Deadline deadline) override {
    DDP_RETURN_IF_ERROR(CheckKey(key, "get"));
    std::unique_lock lock(mu_);
    const std::string k(key);
    if (!cv_.wait_until(lock, deadline, [&] { return data_.count(k) > 0; })) {
      return TimedOutError("store key '" + k + "' did not appear before the deadline");
    }
    return data_[k];
  }
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline) override {
    DDP_RETURN_IF_ERROR(CheckKey(key, "try_get"));
    std::lock_guard lock(mu_);
    auto it = data_.find(std::string(key));
    if (it == data_.end()) return std::optional<std::string>();
    return std::optional<std::string>(it->second);
  }
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline) override {
    DDP_RETURN_IF_ERROR(CheckKey(key, "add"));
    std::lock_guard lock(mu_);
    int64_t current = 0;
    auto it = data_.find(std::string(key));
    if (it != data_.end()) {
      // Exactly a decimal integer, as the TCP store reads it: std::stoll
      // threw on "alice" and took "12abc" or " 12" for 12.
      const std::string& text = it->second;
      const char* end = text.data() + text.size();
      auto [ptr, ec] = std::from_chars(text.data(), end, current);
      if (text.empty() || ec != std::errc() || ptr != end) {
        return FailedPreconditionError("key '" + std::string(key) + "' holds a value that is not an integer");
      }
    }
    int64_t next = 0;
    if (__builtin_add_overflow(current, delta, &next)) {
      return FailedPreconditionError("adding " + std::to_string(delta) + " to key '" + std::string(key) +
                                     "' overflows");
    }
    data_[std::string(key)] = std::to_string(next);
    cv_.notify_all();
    return next;
  }
  Status Wait(std::span<const std::string> keys, Deadline deadline) override {
    for (const std::string& key : keys) DDP_RETURN_IF_ERROR(CheckKey(key, "wait"));
    for (const std::string& key : keys) {
      StatusOr<std::string> value = Get(key, deadline);
      if (!value.ok()) return value.status();
    }
    return Status::Ok();
  }
  StatusOr<int64_t> NumKeys(Deadline) override {
    std::lock_guard lock(mu_);
    return static_cast<int64_t>(data_.size());
  }
  StatusOr<bool> Delete(std::string_view key, Deadline) override {
    DDP_RETURN_IF_ERROR(CheckKey(key, "delete"));
    std::lock_guard lock(mu_);
    return data_.erase(std::string(key)) > 0;
  }
  StatusOr<std::optional<std::string>> CompareSet(std::string_view key, std::optional<std::string_view> expected,
                                                  std::string_view desired, Deadline) override {
    DDP_RETURN_IF_ERROR(CheckKey(key, "compare_set"));
    DDP_RETURN_IF_ERROR(CheckValue(key, desired.size() + (expected ? expected->size() : 0), "compare_set"));
    std::lock_guard lock(mu_);
    auto it = data_.find(std::string(key));
    const bool matches = it == data_.end() ? !expected.has_value()
                                           : expected.has_value() && it->second == *expected;
    if (!matches) {
      return it == data_.end() ? std::optional<std::string>() : std::optional<std::string>(it->second);
    }
    data_[std::string(key)] = std::string(desired);
    cv_.notify_all();
    return std::optional<std::string>(std::string(desired));
  }

 private:
  static Status CheckKey(std::string_view key, const char* op) {
    if (key.empty()) return InvalidArgumentError(std::string("store ") + op + ": a key is empty");
    if (key.size() > store::kMaxKeyBytes) {
      return ResourceExhaustedError(std::string("store ") + op + ": key of " + std::to_string(key.size()) +
                                    " bytes, more than the limit of " + std::to_string(store::kMaxKeyBytes));
    }
    return Status::Ok();
  }
  static Status CheckValue(std::string_view key, size_t bytes, const char* op) {
    if (bytes <= store::kMaxValueBytes) return Status::Ok();
    return ResourceExhaustedError(std::string("store ") + op + " of key '" + std::string(key.substr(0, 80)) +
                                  "': " + std::to_string(bytes) + " bytes of values, more than the limit of " +
                                  std::to_string(store::kMaxValueBytes));
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> data_;
};

}  // namespace ddp::transport::testing

#endif  // DDP_TRANSPORT_TESTING_IN_MEMORY_STORE_H_
