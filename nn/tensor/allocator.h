// Memory for tensors. Each device type has one Allocator; the CPU's is a
// caching allocator so that a training step, which asks for the same sizes
// every iteration, reaches a steady state with no system allocation at all
// (and no page faults on fresh pages, which cost more than the malloc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "nn/tensor/device.h"

namespace ddp::nn {

/// Every CPU allocation is aligned to this many bytes (one cache line, one AVX-512 vector).
inline constexpr size_t kCpuAlignment = 64;

/// Hands out device memory. Implementations must be thread-safe: data
/// loader threads allocate while the main thread trains.
class Allocator {
 public:
  virtual ~Allocator() = default;
  /// Returns at least `nbytes` bytes on `device`; throws std::bad_alloc when out of memory.
  virtual void* Allocate(size_t nbytes, Device device) = 0;
  /// Returns memory obtained from Allocate with the same size and device.
  virtual void Deallocate(void* ptr, size_t nbytes, Device device) = 0;
};

/// Counters of a caching allocator, in bytes unless named otherwise.
struct AllocatorStats {
  size_t in_use_bytes = 0;         ///< held by live tensors (rounded sizes)
  size_t peak_in_use_bytes = 0;    ///< maximum of in_use_bytes
  size_t cached_bytes = 0;         ///< freed blocks kept for reuse
  uint64_t requests = 0;           ///< Allocate calls
  uint64_t system_allocations = 0; ///< Allocate calls that reached the system allocator
};

/// CPU allocator with exact-size free lists over size classes (64-byte steps
/// up to 64 KiB, then eight classes per power of two). Blocks are 64-byte
/// aligned. The cache is bounded (max_cached_bytes); beyond it freed blocks
/// go back to the system. Blocks of 1 MiB and more are mapped directly
/// (mmap), so returning them really frees their pages. A large request that
/// misses its class takes a cached block of a larger class (at most
/// kBorrowFactor times larger) before asking the system: its pages are
/// resident already, where fresh ones fault in one by one. When a large
/// request still misses while the cached and used memory together exceed
/// the peak demand seen so far (plus 16 MiB), cached blocks of other large
/// classes are returned first, least recently requested first, and never
/// those requested since this class's previous use (its cycle: a training
/// step, an evaluation batch): switching workloads (training, then
/// evaluation) does not add the two footprints up, a cycle keeps its own
/// blocks, and a steady training loop, which always hits the cache, never
/// trims. Caching is off under AddressSanitizer or when the environment
/// sets DDP_NN_CPU_CACHE=0 (or off, false, no, none), so that
/// use-after-free is caught.
class CachingCpuAllocator final : public Allocator {
 public:
  CachingCpuAllocator();
  ~CachingCpuAllocator() override;
  void* Allocate(size_t nbytes, Device device) override;
  void Deallocate(void* ptr, size_t nbytes, Device device) override;

  /// Returns every cached block to the system.
  void EmptyCache();
  /// Current counters.
  AllocatorStats Stats() const;
  /// Upper bound on cached bytes (default 1 GiB).
  void set_max_cached_bytes(size_t bytes);
  /// Turns caching on or off (off returns blocks to the system at once).
  void set_caching_enabled(bool enabled);

  /// The size class a request of nbytes is served from.
  static size_t RoundSize(size_t nbytes);

  /// Requests at least this large trim other cached classes on a miss.
  static constexpr size_t kTrimThreshold = size_t{1} << 20;
  /// Footprint allowed above the peak demand before trimming.
  static constexpr size_t kTrimSlack = size_t{16} << 20;
  /// A large request that misses its class may take a cached block up to
  /// this many times larger.
  static constexpr size_t kBorrowFactor = 4;

 private:
  // Returns cached blocks of the large classes other than `keep`, and last
  // requested before request number `before`, until `want` bytes are freed
  // (or none is left), least recently requested first.
  void TrimLocked(size_t want, size_t keep = 0, uint64_t before = UINT64_MAX);
  // A cached block of a larger large class for a request of `size` bytes
  // that missed its own (recorded in borrowed_), or null.
  void* BorrowLocked(size_t size);
  mutable std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  // A large class's requests, counted in stats_.requests.
  struct ClassUse {
    uint64_t last = 0;          // the last request (trim order)
    uint64_t before_burst = 0;  // the last one before its blocks now in use
    int64_t in_use = 0;         // its blocks handed out and not returned
  };
  std::unordered_map<size_t, ClassUse> use_;
  // Blocks handed out for smaller requests: their own class.
  std::unordered_map<void*, size_t> borrowed_;
  AllocatorStats stats_;
  size_t max_cached_bytes_;
  bool caching_;
};

/// The process-wide CPU allocator.
CachingCpuAllocator& CpuAllocator();

/// Where the CPU allocator gets blocks of at least `min_bytes` from the
/// system, instead of mmap or aligned_alloc. A DDP process group whose ranks
/// share a host installs shareable memory here (transport/shm/shareable.h),
/// so that large gradients are buffers the other ranks can map.
struct LargeBlockSource {
  size_t min_bytes = 0;
  /// A block of exactly `bytes` (64-byte aligned, zero or not), or null to
  /// decline (the allocator then uses the system).
  std::function<void*(size_t bytes)> allocate;
  /// Frees a block; false when the block is not one `allocate` returned.
  std::function<bool(void* block, size_t bytes)> release;
};

/// Installs `source` (empty functions: none). Blocks handed out by an
/// earlier source are still released through it, so a source may be
/// replaced while its blocks live; sources are never destroyed.
void SetCpuLargeBlockSource(LargeBlockSource source);

}  // namespace ddp::nn
