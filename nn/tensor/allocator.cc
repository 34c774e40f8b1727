#include "nn/tensor/allocator.h"

#include <cstdlib>
#include <new>

namespace ddp::nn {

namespace {

bool CachingDefault() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return false;
#else
  const char* env = std::getenv("DDP_NN_CPU_CACHE");
  return !(env != nullptr && env[0] == '0');
#endif
}

}  // namespace

CachingCpuAllocator::CachingCpuAllocator()
    : max_cached_bytes_(size_t{1} << 30), caching_(CachingDefault()) {}

CachingCpuAllocator::~CachingCpuAllocator() { EmptyCache(); }

size_t CachingCpuAllocator::RoundSize(size_t nbytes) {
  if (nbytes == 0) nbytes = 1;
  if (nbytes <= 65536) return (nbytes + kCpuAlignment - 1) / kCpuAlignment * kCpuAlignment;
  // Eight classes per power of two: at most 12.5% rounding, and large blocks
  // are only resident where they are written, so the rounding costs little RSS.
  size_t power = size_t{1} << (63 - __builtin_clzll(nbytes));
  size_t step = power / 8;
  return (nbytes + step - 1) / step * step;
}

void* CachingCpuAllocator::Allocate(size_t nbytes, Device device) {
  (void)device;
  const size_t size = RoundSize(nbytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.requests;
    stats_.in_use_bytes += size;
    if (stats_.in_use_bytes > stats_.peak_in_use_bytes) stats_.peak_in_use_bytes = stats_.in_use_bytes;
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.cached_bytes -= size;
      return p;
    }
    ++stats_.system_allocations;
  }
  void* p = std::aligned_alloc(kCpuAlignment, size);
  if (p == nullptr) {
    EmptyCache();
    p = std::aligned_alloc(kCpuAlignment, size);
    if (p == nullptr) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.in_use_bytes -= size;
      throw std::bad_alloc();
    }
  }
  return p;
}

void CachingCpuAllocator::Deallocate(void* ptr, size_t nbytes, Device device) {
  (void)device;
  if (ptr == nullptr) return;
  const size_t size = RoundSize(nbytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.in_use_bytes -= size;
    if (caching_ && stats_.cached_bytes + size <= max_cached_bytes_) {
      free_[size].push_back(ptr);
      stats_.cached_bytes += size;
      return;
    }
  }
  std::free(ptr);
}

void CachingCpuAllocator::EmptyCache() {
  std::unordered_map<size_t, std::vector<void*>> blocks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    blocks.swap(free_);
    stats_.cached_bytes = 0;
  }
  for (auto& [size, list] : blocks) {
    for (void* p : list) std::free(p);
  }
}

AllocatorStats CachingCpuAllocator::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingCpuAllocator::set_max_cached_bytes(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    max_cached_bytes_ = bytes;
  }
  if (bytes == 0) EmptyCache();
}

void CachingCpuAllocator::set_caching_enabled(bool enabled) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    caching_ = enabled;
  }
  if (!enabled) EmptyCache();
}

CachingCpuAllocator& CpuAllocator() {
  // Never destroyed: tensors held by static objects may be freed after main returns.
  static CachingCpuAllocator* allocator = new CachingCpuAllocator();
  return *allocator;
}

}  // namespace ddp::nn
