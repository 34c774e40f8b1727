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

std::atomic<bool> fail_privatizing_for_test{false};

// Appends the decimal or hex digits of `v` to `out` (async-signal-safe).
char* AppendNumber(char* out, uint64_t v, unsigned base) {
  char digits[20];
  int n = 0;
  do {
    digits[n++] = "0123456789abcdef"[v % base];
    v /= base;
  } while (v != 0);
  while (n > 0) *out++ = digits[--n];
  return out;
}

char* AppendText(char* out, const char* text) {
  while (*text != '\0') *out++ = *text++;
  return out;
}

// A region the child could not map privately would stay shared with the
// parent: the child's stores would land in the parent's block. It is made
// read-only in the child instead (still the parent's pages, as a private
// copy is until the child writes it): a store there faults at once, while
// a child that only reads it (a checkpoint writer) works. Failing that,
// inaccessible. stderr says which block and why, since a fork handler has
// no other way to report.
void FenceOffInChild(const ShareableRegion& region, int error) {
  void* start = reinterpret_cast<void*>(region.base);
  // The whole mapping at once: no split, so no new mapping is needed.
  const char* fence = "read-only";
  if (mprotect(start, region.size, PROT_READ) != 0) {
    fence = "inaccessible";
    if (mmap(start, region.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) {
      fence = nullptr;
    }
  }
  char line[512];
  char* out = AppendText(line, "shareable memory: forked child pid ");
  out = AppendNumber(out, static_cast<uint64_t>(getpid()), 10);
  out = AppendText(out, " could not map its copy of the block at 0x");
  out = AppendNumber(out, region.base, 16);
  out = AppendText(out, " (");
  out = AppendNumber(out, region.size, 10);
  out = AppendText(out, " bytes) privately (mmap: ");
  out = AppendText(out, strerrorname_np(error) != nullptr ? strerrorname_np(error) : "error");
  if (fence != nullptr) {
    out = AppendText(out, "); the block is ");
    out = AppendText(out, fence);
    out = AppendText(out, " in the child, whose writes there would change the parent's memory\n");
  } else {
    out = AppendText(out, "), nor fence it off; the child exits rather than write the parent's memory\n");
  }
  ssize_t ignored = write(STDERR_FILENO, line, static_cast<size_t>(out - line));
  (void)ignored;
  if (fence == nullptr) _exit(127);
}

void PrivatizeInChild() {
  Registry& r = registry();
  for (auto& [base, entry] : r.by_base) {
    if (!entry.backed_by_memfd) continue;
    const ShareableRegion& region = entry.region;
    const bool fail = fail_privatizing_for_test.load(std::memory_order_relaxed);
    if (fail || mmap(reinterpret_cast<void*>(region.base), region.size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_FIXED, region.fd, 0) == MAP_FAILED) {
      FenceOffInChild(region, fail ? ENOMEM : errno);
    }
    // Either way no peer may be sent to the memfd: it does not hold the
    // child's writes, or the child may not write (its peers would).
    entry.backed_by_memfd = false;
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

void FailPrivatizingInForkedChildrenForTest(bool fail) {
  fail_privatizing_for_test.store(fail, std::memory_order_relaxed);
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
