#ifndef DDP_TRANSPORT_CUDA_STAGING_PIPELINE_H_
#define DDP_TRANSPORT_CUDA_STAGING_PIPELINE_H_

// Collectives on buffers the network cannot touch (device memory, when UCX
// has no CUDA support): the data goes through two host staging slots, chunk
// by chunk, so that copying chunk k+1 in and chunk k-1 out overlaps the host
// collective of chunk k.
//
//   copy queue:  in(0) in(1)        out(0) in(2)        out(1) in(3) ...
//   host:                 coll(0)               coll(1)
//
// The copy engine is an interface so that this logic is tested on the CPU
// (transport/cuda/staging_pipeline_test.cc) and the CUDA engine
// (device_staging.h) only has to copy and wait. No CUDA header here.

#include <cstddef>
#include <functional>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::cuda {

/// An in-order queue of asynchronous copies between user buffers and
/// `kSlots` host staging slots of slot_bytes() each.
class CopyEngine {
 public:
  static constexpr int kSlots = 2;
  virtual ~CopyEngine() = default;

  virtual size_t slot_bytes() const = 0;
  /// Host memory of slot `s`; the host collective reads and writes it.
  virtual std::byte* slot(int s) = 0;
  /// Enqueues rows x width bytes: row r of dst (at r * dst_pitch) gets row r
  /// of src (at r * src_pitch). Copies run in the order they were enqueued.
  virtual Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                        size_t width, size_t rows) = 0;
  /// Marks the end of slot `s`'s copy-in in the queue.
  virtual Status MarkIn(int s) = 0;
  /// Waits until every copy enqueued before MarkIn(s) is done.
  virtual Status WaitIn(int s, Deadline deadline) = 0;
  /// Waits until every enqueued copy is done.
  virtual Status WaitAll(Deadline deadline) = 0;
};

/// What a staged call computes; the layout of each is in staging_pipeline.cc.
enum class StagedKind { kAllReduce = 0, kBroadcast = 1, kAllGather = 2, kReduceScatter = 3 };

/// One collective over user buffers the host cannot read directly.
struct StagedCall {
  StagedKind kind = StagedKind::kAllReduce;
  const void* send = nullptr;  ///< Input (for broadcast: the buffer).
  void* recv = nullptr;        ///< Output (for broadcast: the buffer).
  /// Elements: per rank for all-gather (send) and reduce-scatter (recv),
  /// the whole vector for all-reduce and broadcast.
  size_t count = 0;
  DataType dtype = DataType::kF32;
  int rank = 0;
  int size = 1;
  int root = 0;  ///< Broadcast only.
};

/// The host collective of one chunk: the same collective as the call, on
/// `count` elements per the call's convention, over host memory.
using HostCollective = std::function<Status(const void* send, void* recv, size_t count)>;

/// Elements per chunk for `call` with slots of `slot_bytes` (0 when a slot
/// cannot hold a single element's worth for every rank).
size_t ChunkElements(const StagedCall& call, size_t slot_bytes);

/// Runs `call` chunk by chunk through `engine`'s slots, calling `host` once
/// per chunk (never for count 0); every rank must pass the same count and
/// slot size so that all ranks run the same chunks. On return (also on
/// error) no copy is pending unless the wait for it passed `deadline`.
Status RunStaged(CopyEngine& engine, const StagedCall& call, const HostCollective& host,
                 Deadline deadline);

}  // namespace ddp::transport::cuda

#endif  // DDP_TRANSPORT_CUDA_STAGING_PIPELINE_H_
