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
// All-reduce and reduce-scatter have a second mode, RunStagedDeviceReduce,
// in which the host only moves bytes and the device reduces: each chunk is
// split into one segment per rank, every rank sends the segments it does
// not own straight to their owners (algorithms/exchange.h), copies what it
// received to device scratch, reduces it there with its own segment, and
// (all-reduce) exchanges the reduced segments back.
//
// The copy engine is an interface so that this logic is tested on the CPU
// (transport/cuda/staging_pipeline_test.cc) and the CUDA engine
// (device_staging.h) only has to copy, reduce and wait. No CUDA header here.

#include <cstddef>
#include <functional>
#include <span>

#include "transport/algorithms/exchange.h"
#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::cuda {

/// Where a buffer lives (ClassifyPointer in device_staging.h).
struct PointerKind {
  bool device = false;  ///< Device (or managed) memory: the host must not touch it.
  int device_id = -1;   ///< The CUDA device owning it, when `device`.
};

/// One buffer of a call, as classified.
struct CallBuffer {
  const char* name;  ///< "send buffer", for messages.
  const void* p;     ///< nullptr: a buffer this rank does not use (skipped).
  PointerKind kind;
};

/// The CUDA device of a call's buffers, -1 when every buffer used is host
/// memory. INVALID_ARGUMENT (`what`: the call) for buffers on two devices,
/// or host memory next to device memory: a plan is for one kind of memory,
/// and a device plan would hand the host buffer to a kernel or a copy that
/// blocks in the driver.
StatusOr<int> CallDevice(std::span<const CallBuffer> buffers, const char* what);

/// Slot starts (slot 1 and scratch 1 start slot_bytes after slot 0) are
/// multiples of this: aligned for every dtype and for the copies.
inline constexpr size_t kStagingSlotAlign = 256;

/// Bytes of each staging slot (and of device scratch) for chunks of
/// `chunk_bytes` among `world_size` ranks: at least one element of the
/// widest dtype per rank and one more (the reduce-scatter layout), rounded
/// up to kStagingSlotAlign (a chunk of 4 MiB + 1 bytes would misalign
/// every element of slot 1), and not so large that kSlots of them overflow.
size_t StagingSlotBytes(size_t chunk_bytes, int world_size);

/// Most sources one CopyEngine::Reduce takes (the CUDA kernel passes them in
/// its arguments; transport/cuda/reduce_kernels.h has the same limit).
inline constexpr int kMaxDeviceReduceSources = 16;

/// An in-order queue of asynchronous copies between user buffers and
/// `kSlots` host staging slots of slot_bytes() each, and of reductions on
/// the device.
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
  /// Device scratch of slot `s`, slot_bytes() long: only queued work (copies
  /// and reductions) reads or writes it, or a network that reads device
  /// memory.
  virtual std::byte* scratch(int s) = 0;
  /// Enqueues dst[i] = op over k < num_sources of sources[k][i], i < count,
  /// all device memory (dst may equal one source); 16-bit floats reduce in
  /// f32, kAvg divides by num_sources. num_sources is 1 to
  /// kMaxDeviceReduceSources.
  virtual Status Reduce(void* dst, const void* const* sources, int num_sources, size_t count,
                        DataType dtype, ReduceOp op) = 0;
  /// Marks slot `s`'s point in the queue: the end of a chunk's copy-in, or
  /// in the device-reduce mode the end of its reduction.
  virtual Status MarkIn(int s) = 0;
  /// Waits until everything enqueued before MarkIn(s) is done.
  virtual Status WaitIn(int s, Deadline deadline) = 0;
  /// Waits until every enqueued copy is done.
  virtual Status WaitAll(Deadline deadline) = 0;
};

/// What a staged call computes; the layout of each is in staging_pipeline.cc.
enum class StagedKind {
  kAllReduce = 0,
  kBroadcast = 1,
  kAllGather = 2,
  kReduceScatter = 3,
  kReduce = 4,   ///< To call.root; the host collective reduces.
  kGather = 5,   ///< To call.root.
  kScatter = 6,  ///< From call.root.
};

/// One collective over user buffers the host cannot read directly.
struct StagedCall {
  StagedKind kind = StagedKind::kAllReduce;
  const void* send = nullptr;  ///< Input (for broadcast: the buffer).
  void* recv = nullptr;        ///< Output (for broadcast: the buffer).
  /// Elements: per rank for all-gather and gather (send) and
  /// reduce-scatter and scatter (recv), the whole vector for all-reduce,
  /// broadcast and reduce.
  size_t count = 0;
  DataType dtype = DataType::kF32;
  int rank = 0;
  int size = 1;
  int root = 0;  ///< Broadcast, reduce, gather and scatter.
  ReduceOp op = ReduceOp::kSum;  ///< RunStagedDeviceReduce only.
};

/// The host collective of one chunk: the same collective as the call, on
/// `count` elements per the call's convention, over host memory. For the
/// rooted kinds the buffers a rank does not use are null (recv off the root
/// for reduce and gather, send off the root for scatter).
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

/// The host step of the device-reduce mode: algorithms::DirectExchange of
/// `blocks` (one per rank) with `chunk_elements` as the count every rank
/// passes alike.
using HostExchange =
    std::function<Status(std::span<const algorithms::ExchangeBlock> blocks, size_t chunk_elements)>;

/// How a collective on device buffers runs.
enum class StagedPlan {
  /// RunStaged: through the host slots, where the host collective runs (and
  /// reduces).
  kHostSlots = 0,
  kDeviceReduce = 1,  ///< RunStagedDeviceReduce through the host slots.
  /// RunStagedDeviceReduce with the network reading and writing device
  /// memory (a CUDA-aware UCX): no host copies at all.
  kDeviceReduceDirect = 2,
  /// Broadcast and all-gather over a network that reads device memory: the
  /// host collective runs on the device buffers themselves (it only moves
  /// bytes).
  kDirect = 3,
};

/// The plan for `call` given the network (`network_reads_device`: a
/// CUDA-aware UCX). Broadcast and all-gather go direct when the network
/// reads device memory, else through the slots. All-reduce and
/// reduce-scatter reduce on the device when `prefer_device` and one kernel
/// takes every rank's segment (size <= kMaxDeviceReduceSources), without
/// host copies when the network reads device memory; else on the host in
/// the slots. Depends only on values equal on every rank.
StagedPlan ChooseStagedPlan(const StagedCall& call, bool prefer_device, bool network_reads_device);

/// Elements per chunk of RunStagedDeviceReduce for `call` with slots (and
/// scratch) of `slot_bytes` (0 when too small for one element per rank).
size_t DeviceReduceChunkElements(const StagedCall& call, size_t slot_bytes);

/// All-reduce or reduce-scatter (call.kind) chunk by chunk, reducing with
/// engine.Reduce, never on the host. Per chunk of n elements, rank r owns
/// segment r (all-reduce: the r-th of p nearly equal parts of the chunk;
/// reduce-scatter: the chunk of block r); `exchange` hands every segment to
/// its owner, the owner reduces the p copies on the device, and an
/// all-reduce exchanges the reduced segments back. With
/// `network_reads_device` the exchanges read the user's device buffers and
/// write device scratch directly; otherwise the segments go through the
/// host slots, chunk k+1's copy out of the device overlapping chunk k's
/// exchanges. Every rank must pass the same count, kind, op and slot size.
/// On return (also on error) no work is pending unless the wait for it
/// passed `deadline`.
Status RunStagedDeviceReduce(CopyEngine& engine, const StagedCall& call,
                             const HostExchange& exchange, bool network_reads_device,
                             Deadline deadline);

}  // namespace ddp::transport::cuda

#endif  // DDP_TRANSPORT_CUDA_STAGING_PIPELINE_H_
