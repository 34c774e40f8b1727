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

}  // namespace ddp::transport::store
