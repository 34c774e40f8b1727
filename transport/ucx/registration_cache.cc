#include "transport/ucx/registration_cache.h"

#include <cstring>
#include <string>

#include "transport/ucx/ucx_status.h"

namespace ddp::transport::ucx {

Status RegistrationCache::Register(void* data, size_t bytes) {
  if (context_ == nullptr) return FailedPreconditionError("registration cache has no UCX context");
  if (data == nullptr || bytes == 0) {
    return InvalidArgumentError("cannot register an empty buffer");
  }
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  auto next = regions_.lower_bound(start);
  if (next != regions_.end() && next->first < start + bytes) {
    return InvalidArgumentError("buffer overlaps a registered region");
  }
  if (next != regions_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.bytes > start) {
      return InvalidArgumentError("buffer overlaps a registered region");
    }
  }
  ucp_mem_map_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = data;
  params.length = bytes;
  ucp_mem_h memh = nullptr;
  DDP_RETURN_IF_ERROR(FromUcs(ucp_mem_map(context_, &params, &memh),
                              "registering " + std::to_string(bytes) + " bytes"));
  regions_.emplace(start, Region{bytes, memh});
  return Status::Ok();
}

ucp_mem_h RegistrationCache::Find(const void* data, size_t bytes) const {
  if (regions_.empty()) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  auto it = regions_.upper_bound(start);
  if (it == regions_.begin()) return nullptr;
  --it;
  if (start + bytes <= it->first + it->second.bytes) return it->second.memh;
  return nullptr;
}

void RegistrationCache::Clear() {
  for (auto& [start, region] : regions_) ucp_mem_unmap(context_, region.memh);
  regions_.clear();
}

}  // namespace ddp::transport::ucx
