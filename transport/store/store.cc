#include "transport/store/store.h"

namespace ddp::transport::store {

StatusOr<std::vector<std::string>> Store::MultiGet(std::span<const std::string> keys, Deadline deadline) {
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const std::string& key : keys) {
    DDP_ASSIGN_OR_RETURN(std::string value, Get(key, deadline));
    values.push_back(std::move(value));
  }
  return values;
}

StatusOr<bool> Store::Check(std::span<const std::string> keys, Deadline deadline) {
  for (const std::string& key : keys) {
    DDP_ASSIGN_OR_RETURN(std::optional<std::string> value, TryGet(key, deadline));
    if (!value) return false;
  }
  return true;
}

StatusOr<int64_t> Store::NumKeys(Deadline) {
  return FailedPreconditionError("num_keys: this store cannot count its keys");
}

}  // namespace ddp::transport::store
