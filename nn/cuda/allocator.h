// Caching allocator for device memory. A training step asks for the same
// sizes every iteration; after the first step every request is served from a
// free list, so cudaMalloc (which synchronizes the device) and cudaFree are
// never called in steady state. Never managed (unified) memory.
//
// Blocks belong to the stream that was current when they were allocated.
// A freed block goes back to that stream's free list and is handed out again
// only to requests on the same stream: work queued later on that stream runs
// after the work that used the block, so reuse needs no host wait. A tensor
// also used on another stream (a communication stream reading a gradient
// bucket) must be declared with RecordStream: when it is freed, an event is
// recorded on each such stream and the block is reused only once they have
// all passed it.
//
// Streams are told apart by StreamId (stream.h), not by handle: CUDA may
// give a destroyed stream's handle to a new stream, which must not inherit
// the old one's free lists. Blocks freed on a destroyed Stream are never
// handed out again; EmptyCache (or the release before an out-of-memory
// retry) returns them to CUDA.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "nn/tensor/allocator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {

/// Caching device allocator: exact-size free lists over size classes, one
/// list per (device, stream, class). Classes: 512-byte steps below 1 MiB,
/// then eight per power of two (at most 12.5% rounding waste).
class CachingCudaAllocator final : public Allocator {
 public:
  CachingCudaAllocator();
  ~CachingCudaAllocator() override = default;
  /// At least nbytes on device (a CUDA device), on the current stream's free
  /// list. On cudaMalloc failure the device's cache is released and the call
  /// retried once; then throws CudaOutOfMemory (a std::bad_alloc), also when
  /// the release itself failed (its error is then part of the message).
  void* Allocate(size_t nbytes, Device device) override;
  /// Never throws (it runs in ~Storage): when a CUDA call on the way fails,
  /// the block is reported on stderr and leaked (never reused) instead.
  void Deallocate(void* ptr, size_t nbytes, Device device) noexcept override;
  /// Declares that the live block at `ptr` (a tensor's storage data) is also
  /// used by work queued on `stream`; freeing it then waits, on the device,
  /// for that stream. Throws if ptr is not a live block of this allocator.
  /// The stream must outlive the block: a block freed after a Stream it was
  /// recorded on has been destroyed is reported and leaked, since the work
  /// left on that stream can no longer be waited for.
  void RecordStream(void* ptr, cudaStream_t stream);

  /// Waits for each device that holds cached blocks, then cudaFrees them all.
  /// A block whose cudaFree fails leaves the cache all the same (leaked:
  /// its state is unknown); the first such failure is then thrown.
  void EmptyCache();
  /// Counters summed over every device.
  AllocatorStats Stats() const;
  /// Counters of one device.
  AllocatorStats Stats(Device device) const;
  /// Turns caching off (every Deallocate frees at once: for compute-sanitizer
  /// runs) or back on. DDP_NN_CUDA_CACHE=0 (or off, false, no, none) starts with caching off.
  void set_caching_enabled(bool enabled);

  /// The size class a request of nbytes is served from.
  static size_t RoundSize(size_t nbytes);

 private:
  struct UsedOn {
    cudaStream_t stream;
    uint64_t stream_id;
  };
  struct Block {
    size_t size;
    int device;
    uint64_t stream_id;           // StreamId of the stream it belongs to
    std::vector<UsedOn> used_on;  // other streams (RecordStream)
  };
  // A freed block waiting for the events of its other streams.
  struct Pending {
    void* ptr;
    Block block;
    std::vector<cudaEvent_t> events;
  };
  using FreeKey = std::tuple<int, uint64_t, size_t>;  // device, stream id, size

  bool HoldsCachedLocked(int device) const;
  // Takes mu_ itself: waits for the device without it, then calls
  // ReleaseCachedLocked.
  void ReleaseCached(int device);
  // Waits for the device, then cudaFrees its cached blocks. Throws when the
  // wait fails (nothing freed), or CudaError counting the blocks whose
  // cudaFree failed (they leave the cache all the same).
  void ReleaseCachedLocked(int device);
  // The three below never throw: they run inside Deallocate.
  void ProcessPendingLocked() noexcept;
  // A free block goes to its free list, or to cudaFree without the cache.
  void ReturnBlockLocked(void* ptr, const Block& b) noexcept;
  // A free block used on other streams waits (pending_) for events on them.
  void HoldUntilStreamsPassLocked(void* ptr, Block b) noexcept;
  AllocatorStats& StatsFor(int device);

  mutable std::mutex mu_;
  std::map<FreeKey, std::vector<void*>> free_;
  std::unordered_map<void*, Block> live_;
  std::vector<Pending> pending_;
  std::map<int, AllocatorStats> stats_;
  bool caching_;
};

/// The process-wide CUDA allocator (registered by Init()).
CachingCudaAllocator& CudaAllocator();

/// Declares that t's memory is used by work on `stream` too (see the header
/// comment); t must live in memory from CudaAllocator().
void RecordStream(const Tensor& t, cudaStream_t stream);

}  // namespace ddp::nn::cuda
