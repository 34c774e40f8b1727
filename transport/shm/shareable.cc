#include "transport/shm/shareable.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

namespace ddp::transport::shm {
namespace {

struct Entry {
  ShareableRegion region;
  // False in a forked child once its mapping of the region is private: the
  // memfd then holds the parent's pages, not this process's, so peers must
  // not be sent to it (FindShareable hides the region; it is still freed).
  bool backed_by_memfd = true;
};

struct Registry {
  std::mutex mu;
  std::map<uint64_t, Entry> by_base;  // keyed by start address
  uint64_t next_id = 1;
};

Registry& registry() {
  static auto* r = new Registry();  // outlives every static destructor
  return *r;
}

std::atomic<uint64_t> freed_count{0};

// fork(): the child would write the parent's pages through the shared
// mappings (a DDP bucket or parameter changing under the parent). The
// registry is held across the fork, and the child maps every region
// MAP_PRIVATE over itself: copy-on-write, like the rest of its memory (it
// still sees the parent's later writes to a page until it writes that page
// itself). Its copies of the memfds stay open: FreeShareable closes them.
// A region this process already holds privately (it was itself forked) is
// left alone: fork has copied its pages like any other memory, where a new
// private mapping of the memfd would replace them with the first process's.
void LockBeforeFork() { registry().mu.lock(); }
void UnlockInParent() { registry().mu.unlock(); }
void PrivatizeInChild() {
  Registry& r = registry();
  for (auto& [base, entry] : r.by_base) {
    if (!entry.backed_by_memfd) continue;
    const ShareableRegion& region = entry.region;
    // On failure (out of mappings) the region stays shared: nothing in a
    // fork handler can report it.
    if (mmap(reinterpret_cast<void*>(region.base), region.size, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_FIXED, region.fd, 0) != MAP_FAILED) {
      entry.backed_by_memfd = false;
    }
  }
  r.mu.unlock();
}

void InstallForkHandlers() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(&LockBeforeFork, &UnlockInParent, &PrivatizeInChild); });
}

}  // namespace

StatusOr<void*> AllocateShareable(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  // Rounded up to whole pages it would wrap around (to 0, then one page).
  if (bytes > SIZE_MAX - (page - 1)) {
    return ResourceExhaustedError("shareable memory: " + std::to_string(bytes) +
                                  " bytes is more than whole pages of the address space hold");
  }
  const size_t size = std::max<size_t>(page, (bytes + page - 1) / page * page);
  InstallForkHandlers();
  // Close-on-exec: a worker the launcher execs must not inherit it.
  const int fd = memfd_create(kShareableMemfdName, MFD_CLOEXEC);
  if (fd < 0) {
    return ResourceExhaustedError(std::string("shareable memory: memfd_create: ") + std::strerror(errno));
  }
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int error = errno;
    close(fd);
    return ResourceExhaustedError("shareable memory: sizing a memfd to " + std::to_string(size) +
                                  " bytes: " + std::strerror(error));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int error = errno;
    close(fd);
    return ResourceExhaustedError("shareable memory: mapping " + std::to_string(size) +
                                  " bytes: " + std::strerror(error));
  }
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  const uint64_t base = reinterpret_cast<uint64_t>(p);
  r.by_base[base] = Entry{.region = {.id = r.next_id++, .base = base, .size = size, .fd = fd}};
  return p;
}

Status FreeShareable(void* ptr) {
  if (ptr == nullptr) return Status::Ok();
  ShareableRegion region;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mu);
    auto it = r.by_base.find(reinterpret_cast<uint64_t>(ptr));
    if (it == r.by_base.end()) {
      return InvalidArgumentError("FreeShareable: " + std::to_string(reinterpret_cast<uint64_t>(ptr)) +
                                  " was not returned by AllocateShareable (or was freed already)");
    }
    region = it->second.region;
    r.by_base.erase(it);
  }
  munmap(ptr, region.size);
  close(region.fd);
  // After the close: a peer that sees the new count finds the fd gone.
  freed_count.fetch_add(1, std::memory_order_release);
  return Status::Ok();
}

uint64_t ShareableFreedCount() { return freed_count.load(std::memory_order_acquire); }

std::optional<ShareableRegion> FindShareable(const void* ptr, size_t bytes) {
  const uint64_t p = reinterpret_cast<uint64_t>(ptr);
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  auto it = r.by_base.upper_bound(p);
  if (it == r.by_base.begin()) return std::nullopt;
  --it;
  if (!it->second.backed_by_memfd) return std::nullopt;
  const ShareableRegion& region = it->second.region;
  if (p - region.base > region.size || bytes > region.size - (p - region.base)) return std::nullopt;
  return region;
}

}  // namespace ddp::transport::shm
