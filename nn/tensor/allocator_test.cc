#include "nn/tensor/allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ddp::nn {
namespace {

TEST(CachingCpuAllocatorTest, ReusesFreedBlocksOfTheSameClass) {
  CachingCpuAllocator a;
  a.set_caching_enabled(true);
  void* p = a.Allocate(1000, kCPU);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kCpuAlignment, 0u);
  a.Deallocate(p, 1000, kCPU);
  void* q = a.Allocate(990, kCPU);  // same 1024-byte class
  EXPECT_EQ(p, q);
  AllocatorStats s = a.Stats();
  EXPECT_EQ(s.requests, 2u);
  EXPECT_EQ(s.system_allocations, 1u);
  EXPECT_EQ(s.in_use_bytes, 1024u);
  a.Deallocate(q, 990, kCPU);
  EXPECT_EQ(a.Stats().cached_bytes, 1024u);
  a.EmptyCache();
  EXPECT_EQ(a.Stats().cached_bytes, 0u);
}

TEST(CachingCpuAllocatorTest, SizeClasses) {
  EXPECT_EQ(CachingCpuAllocator::RoundSize(0), 64u);
  EXPECT_EQ(CachingCpuAllocator::RoundSize(65), 128u);
  EXPECT_EQ(CachingCpuAllocator::RoundSize(65536), 65536u);
  EXPECT_EQ(CachingCpuAllocator::RoundSize(65537), 65536u + 8192u);
  EXPECT_EQ(CachingCpuAllocator::RoundSize(1u << 20), 1u << 20);
  EXPECT_EQ(CachingCpuAllocator::RoundSize((1u << 20) + 1), (1u << 20) + (1u << 17));
}

TEST(CachingCpuAllocatorTest, BoundedCacheAndDisabledCaching) {
  CachingCpuAllocator a;
  a.set_caching_enabled(true);
  a.set_max_cached_bytes(4096);
  void* p = a.Allocate(8192, kCPU);
  a.Deallocate(p, 8192, kCPU);  // larger than the bound: released
  EXPECT_EQ(a.Stats().cached_bytes, 0u);
  a.set_caching_enabled(false);
  void* q = a.Allocate(64, kCPU);
  a.Deallocate(q, 64, kCPU);
  EXPECT_EQ(a.Stats().cached_bytes, 0u);
}

TEST(CachingCpuAllocatorTest, LargeMissTrimsOnlyBeyondThePeakDemand) {
  CachingCpuAllocator a;
  a.set_caching_enabled(true);
  const size_t mb = size_t{1} << 20;
  // Phase 1 (training): 20 MiB and 8 MiB blocks live together, then freed.
  void* p = a.Allocate(20 * mb, kCPU);
  void* q = a.Allocate(8 * mb, kCPU);
  a.Deallocate(p, 20 * mb, kCPU);
  a.Deallocate(q, 8 * mb, kCPU);
  EXPECT_EQ(a.Stats().cached_bytes, 28 * mb);
  // Within the peak (28 MiB) plus slack: a new size is simply added (1.5
  // MiB: no cached block is small enough to be borrowed for it).
  void* r = a.Allocate(3 * mb / 2, kCPU);
  EXPECT_EQ(a.Stats().cached_bytes, 28 * mb);
  a.Deallocate(r, 3 * mb / 2, kCPU);
  // Phase 2 (evaluation): a big new size would push the footprint past
  // peak + slack, so cached blocks of other classes go back first.
  void* s = a.Allocate(48 * mb, kCPU);
  const AllocatorStats st = a.Stats();
  EXPECT_LE(st.in_use_bytes + st.cached_bytes, st.peak_in_use_bytes + CachingCpuAllocator::kTrimSlack);
  a.Deallocate(s, 48 * mb, kCPU);
  // Steady state: the same size is served from the cache without trimming.
  const size_t cached = a.Stats().cached_bytes;
  void* t = a.Allocate(48 * mb, kCPU);
  EXPECT_EQ(t, s);
  EXPECT_EQ(a.Stats().cached_bytes, cached - 48 * mb);
  a.Deallocate(t, 48 * mb, kCPU);
}

// A source hands out blocks of its minimum size and more; the allocator
// returns them to it (also after another source replaced it), and smaller
// blocks never reach it.
TEST(CachingCpuAllocatorTest, LargeBlocksComeFromTheInstalledSource) {
  struct Counts {
    std::vector<void*> live;
    int allocated = 0, released = 0;
  };
  auto counts = std::make_shared<Counts>();
  auto make = [](std::shared_ptr<Counts> c, size_t min_bytes) {
    return LargeBlockSource{
        .min_bytes = min_bytes,
        .allocate = [c](size_t bytes) -> void* {
          void* p = std::aligned_alloc(kCpuAlignment, bytes);
          c->live.push_back(p);
          ++c->allocated;
          return p;
        },
        .release = [c](void* p, size_t) {
          auto it = std::find(c->live.begin(), c->live.end(), p);
          if (it == c->live.end()) return false;
          c->live.erase(it);
          std::free(p);
          ++c->released;
          return true;
        },
    };
  };
  CachingCpuAllocator a;
  a.set_caching_enabled(false);  // every Deallocate reaches the system
  SetCpuLargeBlockSource(make(counts, 1 << 18));
  void* small = a.Allocate(1000, kCPU);
  void* large = a.Allocate(300000, kCPU);
  EXPECT_EQ(counts->allocated, 1);
  ASSERT_EQ(counts->live.size(), 1u);
  EXPECT_EQ(counts->live[0], large);
  a.Deallocate(small, 1000, kCPU);
  EXPECT_EQ(counts->released, 0);
  // Replaced by a source that declines everything: new large blocks come
  // from the system, the old one still goes back to its source.
  SetCpuLargeBlockSource(LargeBlockSource{
      .min_bytes = 0,
      .allocate = [](size_t) -> void* { return nullptr; },
      .release = [](void*, size_t) { return false; }});
  void* other = a.Allocate(300000, kCPU);
  EXPECT_EQ(counts->allocated, 1);
  a.Deallocate(other, 300000, kCPU);
  a.Deallocate(large, 300000, kCPU);
  EXPECT_EQ(counts->released, 1);
  EXPECT_TRUE(counts->live.empty());
  SetCpuLargeBlockSource({});  // none: the system again
  void* again = a.Allocate(300000, kCPU);
  EXPECT_EQ(counts->allocated, 1);
  a.Deallocate(again, 300000, kCPU);
}

// A trim frees the least recently requested large classes first: after an
// "evaluation" block, the training step's own block stays cached (freeing
// it would fault its pages in again at every step), and a full cache makes
// room for a block being returned.
TEST(CachingCpuAllocatorTest, TrimFreesLeastRecentlyRequestedClassesFirst) {
  constexpr size_t kMiB = size_t{1} << 20;
  CachingCpuAllocator a;
  a.set_caching_enabled(true);
  void* eval = a.Allocate(60 * kMiB, kCPU);  // requested first
  a.Deallocate(eval, 60 * kMiB, kCPU);
  void* step = a.Allocate(3 * kMiB, kCPU);  // requested last
  a.Deallocate(step, 3 * kMiB, kCPU);
  // A new 14 MiB class (the 60 MiB block is too large to be borrowed for
  // it): the footprint (14 + 63 MiB) exceeds the peak (60 MiB) plus slack
  // (16 MiB), so 1 MiB must go: the 60 MiB block.
  void* other = a.Allocate(14 * kMiB, kCPU);
  a.Deallocate(other, 14 * kMiB, kCPU);
  const uint64_t before = a.Stats().system_allocations;
  void* again = a.Allocate(3 * kMiB, kCPU);
  EXPECT_EQ(again, step);
  EXPECT_EQ(a.Stats().system_allocations, before);
  a.Deallocate(again, 3 * kMiB, kCPU);
  EXPECT_EQ(a.Stats().cached_bytes, 17 * kMiB);

  // Full: returning a 3 MiB block frees the 14 MiB class to make room.
  a.set_max_cached_bytes(16 * kMiB);
  void* held = a.Allocate(3 * kMiB, kCPU);
  void* extra = a.Allocate(3 * kMiB, kCPU);  // a second block of the class
  a.Deallocate(held, 3 * kMiB, kCPU);
  a.Deallocate(extra, 3 * kMiB, kCPU);
  EXPECT_EQ(a.Stats().cached_bytes, 6 * kMiB);
  a.EmptyCache();
}

// A cycle (an evaluation batch) whose distinct large sizes add up to more
// than its peak demand plus slack: after its first pass every block stays
// cached, so later passes allocate nothing. When the other workload
// (training) comes back, its misses give back only classes older than its
// own last use, not the evaluation's; two blocks of one class requested
// at once count as one use. (Sizes differ by more than kBorrowFactor, so
// that no block is borrowed for another class.)
TEST(CachingCpuAllocatorTest, RecurringCycleKeepsItsClassesCached) {
  constexpr size_t kMiB = size_t{1} << 20;
  CachingCpuAllocator a;
  a.set_caching_enabled(true);
  auto train = [&] {
    void* t1 = a.Allocate(20 * kMiB, kCPU);
    void* t2 = a.Allocate(20 * kMiB, kCPU);
    a.Deallocate(t1, 20 * kMiB, kCPU);
    a.Deallocate(t2, 20 * kMiB, kCPU);
  };
  // Peak in use 100 MiB; the classes of one pass add up to 108 MiB.
  auto pass = [&] {
    void* x = a.Allocate(100 * kMiB, kCPU);
    a.Deallocate(x, 100 * kMiB, kCPU);
    void* z1 = a.Allocate(4 * kMiB, kCPU);
    void* z2 = a.Allocate(4 * kMiB, kCPU);
    a.Deallocate(z1, 4 * kMiB, kCPU);
    a.Deallocate(z2, 4 * kMiB, kCPU);
  };
  train();
  for (int i = 0; i < 3; ++i) pass();
  const uint64_t settled = a.Stats().system_allocations;
  for (int i = 0; i < 5; ++i) pass();
  EXPECT_EQ(a.Stats().system_allocations, settled) << "a recurring pass allocated fresh blocks";
  // The evaluation gave the training blocks back; they come back now
  // without the evaluation's going.
  train();
  EXPECT_EQ(a.Stats().system_allocations, settled + 2);
  pass();
  EXPECT_EQ(a.Stats().system_allocations, settled + 2) << "training evicted the evaluation's blocks";
  a.EmptyCache();
}

// A large request that misses its class takes a cached block of a larger
// class (at most kBorrowFactor times larger) instead of fresh pages, and
// the block returns to its own class.
TEST(CachingCpuAllocatorTest, LargeMissBorrowsALargerCachedBlock) {
  constexpr size_t kMiB = size_t{1} << 20;
  CachingCpuAllocator a;
  a.set_caching_enabled(true);
  void* big = a.Allocate(32 * kMiB, kCPU);
  a.Deallocate(big, 32 * kMiB, kCPU);
  const uint64_t before = a.Stats().system_allocations;
  void* small = a.Allocate(10 * kMiB, kCPU);
  EXPECT_EQ(small, big);
  EXPECT_EQ(a.Stats().system_allocations, before);
  EXPECT_EQ(a.Stats().in_use_bytes, 32 * kMiB);
  EXPECT_EQ(a.Stats().cached_bytes, 0u);
  // Too small to borrow the 32 MiB block while it is free again: fresh.
  a.Deallocate(small, 10 * kMiB, kCPU);
  EXPECT_EQ(a.Stats().in_use_bytes, 0u);
  EXPECT_EQ(a.Stats().cached_bytes, 32 * kMiB);
  void* tiny = a.Allocate(6 * kMiB, kCPU);
  EXPECT_NE(tiny, big);
  EXPECT_EQ(a.Stats().system_allocations, before + 1);
  // The big block is back in its own class.
  void* again = a.Allocate(32 * kMiB, kCPU);
  EXPECT_EQ(again, big);
  a.Deallocate(again, 32 * kMiB, kCPU);
  a.Deallocate(tiny, 6 * kMiB, kCPU);
  // Small classes never borrow.
  void* small_block = a.Allocate(64 * 1024, kCPU);
  a.Deallocate(small_block, 64 * 1024, kCPU);
  const uint64_t b2 = a.Stats().system_allocations;
  void* smaller = a.Allocate(32 * 1024, kCPU);
  EXPECT_EQ(a.Stats().system_allocations, b2 + 1);
  a.Deallocate(smaller, 32 * 1024, kCPU);
  a.EmptyCache();
}

// A request the system refuses leaves the statistics as they were: a peak
// holding the refused size would keep every later large miss from trimming.
TEST(CachingCpuAllocatorTest, RefusedRequestLeavesPeakAndInUseAsBefore) {
  CachingCpuAllocator a;
  a.set_caching_enabled(true);
  const size_t mb = size_t{1} << 20;
  void* p = a.Allocate(20 * mb, kCPU);
  const AllocatorStats before = a.Stats();
  EXPECT_THROW(a.Allocate(size_t{1} << 60, kCPU), std::bad_alloc);
  const AllocatorStats after = a.Stats();
  EXPECT_EQ(after.in_use_bytes, before.in_use_bytes);
  EXPECT_EQ(after.peak_in_use_bytes, before.peak_in_use_bytes);
  a.Deallocate(p, 20 * mb, kCPU);
  // Trimming still works: a new large size beyond peak + slack sends the
  // cached 20 MiB block back first.
  void* q = a.Allocate(48 * mb, kCPU);
  EXPECT_EQ(a.Stats().cached_bytes, 0u);
  a.Deallocate(q, 48 * mb, kCPU);
}

TEST(CachingCpuAllocatorTest, ThreadsAllocateConcurrently) {
  CachingCpuAllocator a;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&a, t] {
      for (int i = 0; i < 2000; ++i) {
        const size_t n = 64 * (1 + (i + t) % 17);
        void* p = a.Allocate(n, kCPU);
        static_cast<char*>(p)[0] = 1;
        a.Deallocate(p, n, kCPU);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(a.Stats().in_use_bytes, 0u);
}

// Whether a fresh allocator caches freed blocks, and what it printed on
// stderr, with DDP_NN_CPU_CACHE set to `value`.
std::pair<bool, std::string> CachingWith(const char* value) {
  ::setenv("DDP_NN_CPU_CACHE", value, 1);
  testing::internal::CaptureStderr();
  bool caches = false;
  {
    CachingCpuAllocator a;
    void* p = a.Allocate(64, kCPU);
    a.Deallocate(p, 64, kCPU);
    caches = a.Stats().cached_bytes > 0;
  }
  std::string err = testing::internal::GetCapturedStderr();
  ::unsetenv("DDP_NN_CPU_CACHE");
  return {caches, err};
}

// DDP_NN_CPU_CACHE turned the cache off only on a leading '0': off, false
// and no left it on without a word. It takes the spellings DDP_DATA_CACHE
// takes, in any case, and names a value it does not take.
TEST(CachingCpuAllocatorTest, CacheVariableTakesTheUsualSpellings) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  const bool can_cache = false;  // off under the sanitizers whatever the value
#else
  const bool can_cache = true;
#endif
  for (const char* off : {"0", "off", "OFF", "false", "False", "no", "none"}) {
    const auto [caches, err] = CachingWith(off);
    EXPECT_FALSE(caches) << off;
    EXPECT_EQ(err, "") << off;
  }
  for (const char* on : {"1", "on", "true", "TRUE", "yes"}) {
    const auto [caches, err] = CachingWith(on);
    EXPECT_EQ(caches, can_cache) << on;
    EXPECT_EQ(err, "") << on;
  }
  for (const char* bad : {"2", "0x", "offf", "disabled"}) {
    const auto [caches, err] = CachingWith(bad);
    EXPECT_EQ(caches, can_cache) << bad;
    EXPECT_EQ(err, "[ddp] warning: DDP_NN_CPU_CACHE=" + std::string(bad) +
                       " is neither on (1, on, true, yes) nor off (0, off, false, no, none); keeping "
                       "the CPU allocator's default (" +
                       (can_cache ? "caching" : "no caching under a sanitizer") + ")\n")
        << bad;
  }
}

}  // namespace
}  // namespace ddp::nn
