#ifndef DDP_TRANSPORT_SHM_SHAREABLE_H_
#define DDP_TRANSPORT_SHM_SHAREABLE_H_

// Host memory that the other processes of a host can map: buffers the
// shared-memory collectives reach with plain loads and stores instead of
// cross-memory attach (process_vm_readv/writev, which pins pages and makes
// a system call per copy). Each allocation is its own memfd; ShmAllReduce
// publishes where a collective's buffers lie in one, and a peer maps it
// through /proc/<pid>/fd/<fd> (allowed exactly where CMA is).
//
// Buffers that are not shareable work as before (CMA), so this is only an
// optimization: allocate the buffers a program all-reduces repeatedly
// (DDP's gradient buckets, say) here.
//
// Thread-safe. A region stays valid until FreeShareable; peers that mapped
// it keep their mapping (and its pages) until they evict it, so memory
// freed here is not reused under them. ShmAllReduce publishes
// ShareableFreedCount with each call, and peers drop their mappings of
// freed regions when it changes.
//
// A child made by fork() gets the regions copy-on-write, as the rest of its
// memory: its writes never reach the parent (it does see the parent's later
// writes to a page until it writes that page itself). Its inherited regions
// are then no longer shareable: FindShareable does not return them, since
// their memfds hold the parent's pages (FreeShareable still frees them).
// Should the child be unable to map a region privately (out of memory or
// of mappings), the region is made read-only in the child (inaccessible
// where even that fails), with a line on stderr naming it: the child may
// read it, and its first write faults instead of changing the parent's
// block.

#include <cstddef>
#include <cstdint>
#include <optional>

#include "transport/status.h"

namespace ddp::transport::shm {

/// Where a buffer lies in shareable memory, as another process needs it.
struct ShareableRegion {
  uint64_t id = 0;    ///< Unique within the process (never reused); 0: none.
  uint64_t base = 0;  ///< Start address in the owner's address space.
  uint64_t size = 0;  ///< Bytes (whole pages).
  int32_t fd = -1;    ///< The memfd in the owner's process.
};

/// The name of every memfd AllocateShareable makes (a peer checks it,
/// through /proc, before it maps one).
inline constexpr char kShareableMemfdName[] = "ddp-shareable";

/// `bytes` (rounded up to whole pages) of zero-filled shareable memory.
/// RESOURCE_EXHAUSTED when the system refuses a memfd or the mapping, or
/// when `bytes` rounded up to whole pages exceeds SIZE_MAX.
StatusOr<void*> AllocateShareable(size_t bytes);

/// Frees memory from AllocateShareable; null is ignored. INVALID_ARGUMENT
/// for a pointer that AllocateShareable did not return.
Status FreeShareable(void* ptr);

/// Regions FreeShareable freed in this process so far (each counted once
/// its memfd is closed).
uint64_t ShareableFreedCount();

/// The shareable region holding all of [ptr, ptr + bytes), if any.
std::optional<ShareableRegion> FindShareable(const void* ptr, size_t bytes);

/// Test hook: while set, every later fork's child fails to map its regions
/// privately, as if out of memory. Only for tests.
void FailPrivatizingInForkedChildrenForTest(bool fail);

}  // namespace ddp::transport::shm

#endif  // DDP_TRANSPORT_SHM_SHAREABLE_H_
