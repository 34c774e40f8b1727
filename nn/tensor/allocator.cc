#include "nn/tensor/allocator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "nn/tensor/env_value.h"

namespace ddp::nn {

namespace {

// Every source ever installed, newest last (never destroyed: blocks of a
// replaced source are still released through it).
struct Sources {
  std::mutex mu;
  std::vector<const LargeBlockSource*> all;
  const LargeBlockSource* current = nullptr;
};

Sources& sources() {
  static auto* s = new Sources();
  return *s;
}

// Large blocks come straight from mmap: freeing them (EmptyCache, trimming)
// then returns the pages to the system at once, which glibc's heap does not
// guarantee below its adaptive 32 MiB mmap threshold.
void* SystemAlloc(size_t size) {
  {
    Sources& s = sources();
    std::lock_guard lock(s.mu);
    if (s.current != nullptr && size >= s.current->min_bytes) {
      if (void* p = s.current->allocate(size)) return p;
    }
  }
  if (size >= CachingCpuAllocator::kTrimThreshold) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  return std::aligned_alloc(kCpuAlignment, size);
}

void SystemFree(void* p, size_t size) {
  {
    Sources& s = sources();
    std::lock_guard lock(s.mu);
    for (auto it = s.all.rbegin(); it != s.all.rend(); ++it) {
      if (size >= (*it)->min_bytes && (*it)->release(p, size)) return;
    }
  }
  if (size >= CachingCpuAllocator::kTrimThreshold) {
    munmap(p, size);
  } else {
    std::free(p);
  }
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kCanCache = false;  // so that the sanitizer sees use-after-free
#else
constexpr bool kCanCache = true;
#endif

// DDP_NN_CPU_CACHE, read with the spellings DDP_DATA_CACHE takes for off
// (and their opposites), in any case: a leading '0' alone used to turn the
// cache off, so `off` or `false` left it on without a word.
bool CachingDefault() {
  return OnOffFromEnv("DDP_NN_CPU_CACHE", kCanCache,
                      std::string("the CPU allocator's default (") +
                          (kCanCache ? "caching" : "no caching under a sanitizer") + ")") &&
         kCanCache;
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
  // What this request changed, for undoing it if the system refuses the block.
  uint64_t request = 0;
  ClassUse use_before;
  size_t peak_before = 0, peak_raised = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.requests;
    // The class's last request before the blocks of it now in use were
    // requested (0: none), for the trim below.
    uint64_t previous = 0;
    request = stats_.requests;
    if (size >= kTrimThreshold) {
      ClassUse& use = use_[size];
      use_before = use;
      if (use.in_use++ == 0) use.before_burst = use.last;
      use.last = request;
      previous = use.before_burst;
    }
    peak_before = stats_.peak_in_use_bytes;
    stats_.in_use_bytes += size;
    if (stats_.in_use_bytes > stats_.peak_in_use_bytes) stats_.peak_in_use_bytes = stats_.in_use_bytes;
    peak_raised = stats_.peak_in_use_bytes;
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.cached_bytes -= size;
      return p;
    }
    if (size >= kTrimThreshold) {
      if (void* p = BorrowLocked(size)) return p;
    }
    ++stats_.system_allocations;
    // A large miss while the footprint already exceeds the peak demand
    // (plus slack): the workload changed (evaluation after training, a
    // smaller last batch), so blocks of other large sizes go back first.
    // Steady-state steps hit the cache and never get here.
    //
    // A class requested before, though, marks a cycle (one step or one
    // evaluation batch ago; blocks of it requested while others of it are
    // in use belong to the same cycle): the classes requested since then
    // belong to the running workload and stay, only older ones go. A cycle's
    // distinct sizes may add up to more than its peak demand (a batch of
    // 1000 through the CNN: 210 MB of classes, 113 MB in use at most);
    // trimming them by recency alone freed and faulted in every block of
    // every evaluation batch again (53,000 page faults, 1.3-1.8 s per batch
    // on a 2-core VM instead of 0.07 s).
    const size_t footprint = stats_.in_use_bytes + stats_.cached_bytes;
    const size_t limit = stats_.peak_in_use_bytes + kTrimSlack;
    if (size >= kTrimThreshold && footprint > limit) {
      TrimLocked(footprint - limit, 0, previous > 0 ? previous : UINT64_MAX);
    }
  }
  void* p = SystemAlloc(size);
  if (p == nullptr) {
    EmptyCache();
    p = SystemAlloc(size);
    if (p == nullptr) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.in_use_bytes -= size;
      // A block that never existed must not stay in the peak (it would lift
      // the trim limit below for good) nor count as in use in its class (the
      // class's next burst would never start).
      if (stats_.peak_in_use_bytes == peak_raised) {
        stats_.peak_in_use_bytes = std::max(peak_before, stats_.in_use_bytes);
      }
      if (size >= kTrimThreshold) {
        ClassUse& use = use_[size];
        --use.in_use;
        // Unless another request of the class came in meanwhile, the class
        // looks as if this one had never been made.
        if (use.last == request) {
          use.last = use_before.last;
          use.before_burst = use_before.before_burst;
        }
        if (use.in_use == 0 && use.last == 0) use_.erase(size);
      }
      throw std::bad_alloc();
    }
  }
  return p;
}

void CachingCpuAllocator::Deallocate(void* ptr, size_t nbytes, Device device) {
  (void)device;
  if (ptr == nullptr) return;
  size_t size = RoundSize(nbytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (size >= kTrimThreshold) {
      --use_[size].in_use;
      // A borrowed block goes back to its own class.
      if (auto it = borrowed_.find(ptr); it != borrowed_.end()) {
        size = it->second;
        borrowed_.erase(it);
      }
    }
    stats_.in_use_bytes -= size;
    if (caching_ && stats_.cached_bytes + size > max_cached_bytes_ && size <= max_cached_bytes_) {
      // Full, typically of another workload's sizes (evaluation's larger
      // batches): blocks of other large sizes make room, so that the running
      // workload keeps hitting the cache instead of faulting in fresh pages
      // every step.
      TrimLocked(stats_.cached_bytes + size - max_cached_bytes_, size);
    }
    if (caching_ && stats_.cached_bytes + size <= max_cached_bytes_) {
      free_[size].push_back(ptr);
      stats_.cached_bytes += size;
      return;
    }
  }
  SystemFree(ptr, size);
}

void* CachingCpuAllocator::BorrowLocked(size_t size) {
  // The smallest cached block of a larger class, at most kBorrowFactor
  // times the size: its pages are resident already (a fresh block faults
  // each one in), and the cycle that freed it usually wants it back only
  // after this block returns.
  size_t best = 0;
  for (const auto& [cls, list] : free_) {
    if (cls > size && cls <= kBorrowFactor * size && !list.empty() && (best == 0 || cls < best)) {
      best = cls;
    }
  }
  if (best == 0) return nullptr;
  std::vector<void*>& list = free_[best];
  void* p = list.back();
  list.pop_back();
  stats_.cached_bytes -= best;
  stats_.in_use_bytes += best - size;
  if (stats_.in_use_bytes > stats_.peak_in_use_bytes) stats_.peak_in_use_bytes = stats_.in_use_bytes;
  borrowed_.emplace(p, best);
  return p;
}

void CachingCpuAllocator::TrimLocked(size_t want, size_t keep, uint64_t before) {
  // Least recently requested classes first: after an evaluation, its sizes
  // go back before those of the training steps that run now (freeing
  // those would fault their pages in again at the next step).
  std::vector<std::pair<uint64_t, size_t>> classes;  // (last request, size)
  for (const auto& [size, list] : free_) {
    if (size < kTrimThreshold || size == keep || list.empty()) continue;
    const uint64_t last = use_[size].last;
    if (last < before) classes.emplace_back(last, size);
  }
  std::sort(classes.begin(), classes.end());
  size_t freed = 0;
  for (const auto& [tick, size] : classes) {
    if (freed >= want) break;
    std::vector<void*>& list = free_[size];
    while (!list.empty() && freed < want) {
      SystemFree(list.back(), size);
      list.pop_back();
      freed += size;
      stats_.cached_bytes -= size;
    }
    if (list.empty()) free_.erase(size);
  }
}

void CachingCpuAllocator::EmptyCache() {
  std::unordered_map<size_t, std::vector<void*>> blocks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    blocks.swap(free_);
    stats_.cached_bytes = 0;
  }
  for (auto& [size, list] : blocks) {
    for (void* p : list) SystemFree(p, size);
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

void SetCpuLargeBlockSource(LargeBlockSource source) {
  Sources& s = sources();
  std::lock_guard lock(s.mu);
  if (!source.allocate || !source.release) {
    s.current = nullptr;
    return;
  }
  s.all.push_back(new LargeBlockSource(std::move(source)));
  s.current = s.all.back();
}

CachingCpuAllocator& CpuAllocator() {
  // Never destroyed: tensors held by static objects may be freed after main returns.
  static CachingCpuAllocator* allocator = new CachingCpuAllocator();
  return *allocator;
}

}  // namespace ddp::nn
