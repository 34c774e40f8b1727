#ifndef DDP_TRANSPORT_UCX_REGISTRATION_CACHE_H_
#define DDP_TRANSPORT_UCX_REGISTRATION_CACHE_H_

// Memory registrations of the transport's own long-lived staging buffers.
//
// Why only those: a registration pins physical pages. For user buffers UCX's
// rcache already caches registrations and, unlike a cache of ours, watches
// munmap/free through its memory hooks, so a freed and reused address never
// meets a stale registration. Staging buffers belong to the communicator and
// live as long as it does, so registering them once is safe and saves the
// rcache lookup (and, on InfiniBand, the first-touch registration) per
// message. On shared memory and CMA registration is a no-op in cost; see
// docs/benchmarks.md for the measurement.

#include <cstddef>
#include <cstdint>
#include <map>

#include <ucp/api/ucp.h>

#include "transport/status.h"

namespace ddp::transport::ucx {

class RegistrationCache {
 public:
  RegistrationCache() = default;
  ~RegistrationCache() { Clear(); }
  RegistrationCache(const RegistrationCache&) = delete;
  RegistrationCache& operator=(const RegistrationCache&) = delete;

  /// Must be set before Register; the context must outlive the cache.
  void set_context(ucp_context_h context) { context_ = context; }

  /// Maps [data, data + bytes) for UCX. Overlapping an existing region is an
  /// INVALID_ARGUMENT error (the caller owns disjoint buffers).
  Status Register(void* data, size_t bytes);

  /// The handle of the region containing [data, data + bytes), or nullptr.
  ucp_mem_h Find(const void* data, size_t bytes) const;

  /// Unmaps every region.
  void Clear();

  size_t regions() const { return regions_.size(); }

 private:
  struct Region {
    size_t bytes;
    ucp_mem_h memh;
  };
  ucp_context_h context_ = nullptr;
  std::map<uintptr_t, Region> regions_;  // keyed by start address
};

}  // namespace ddp::transport::ucx

#endif  // DDP_TRANSPORT_UCX_REGISTRATION_CACHE_H_
