#include "transport/cuda/staging_pipeline.h"

#include <algorithm>
#include <string>

namespace ddp::transport::cuda {
namespace {

// Slot layouts for a chunk of n elements at element offset `off` (e: bytes
// per element, p: ranks):
//   all-reduce:     slot[0, n e)           in from send+off, out to recv+off
//   broadcast:      slot[0, n e)           in on the root, out elsewhere
//   all-gather:     slot[0, p n e)         in: own block at rank n e; the
//                                          host gathers in place; out: row r
//                                          to recv + (r count + off) e
//   reduce-scatter: slot[0, p n e)         in: row r from send + (r count +
//                   slot[p n e, (p+1) n e) off) e; result out to recv + off e
size_t SlotElementsPerChunk(const StagedCall& call) {
  switch (call.kind) {
    case StagedKind::kAllReduce:
    case StagedKind::kBroadcast:
      return 1;
    case StagedKind::kAllGather:
      return static_cast<size_t>(call.size);
    case StagedKind::kReduceScatter:
      return static_cast<size_t>(call.size) + 1;
  }
  return 1;
}

}  // namespace

size_t ChunkElements(const StagedCall& call, size_t slot_bytes) {
  return slot_bytes / (DataTypeSize(call.dtype) * SlotElementsPerChunk(call));
}

Status RunStaged(CopyEngine& engine, const StagedCall& call, const HostCollective& host,
                 Deadline deadline) {
  if (call.count == 0) return Status::Ok();
  const size_t e = DataTypeSize(call.dtype);
  const size_t n_max = ChunkElements(call, engine.slot_bytes());
  if (n_max == 0) {
    return InvalidArgumentError("staging slots of " + std::to_string(engine.slot_bytes()) +
                                " bytes cannot hold one element per rank");
  }
  const size_t chunks = (call.count + n_max - 1) / n_max;
  const size_t p = static_cast<size_t>(call.size);
  const auto* send = static_cast<const std::byte*>(call.send);
  auto* recv = static_cast<std::byte*>(call.recv);
  const bool is_root = call.rank == call.root;

  auto chunk_size = [&](size_t k) { return std::min(n_max, call.count - k * n_max); };

  // Enqueues chunk k's copy into its slot (k mod kSlots). Safe without a
  // wait: the slot's previous chunk (k - kSlots) had its host collective
  // finished and its copy-out enqueued before this, and the queue is in
  // order.
  auto start_in = [&](size_t k) -> Status {
    const int s = static_cast<int>(k % CopyEngine::kSlots);
    const size_t off = k * n_max, n = chunk_size(k);
    std::byte* slot = engine.slot(s);
    switch (call.kind) {
      case StagedKind::kAllReduce:
        DDP_RETURN_IF_ERROR(engine.Copy2D(slot, n * e, send + off * e, n * e, n * e, 1));
        break;
      case StagedKind::kBroadcast:
        if (is_root) {
          DDP_RETURN_IF_ERROR(engine.Copy2D(slot, n * e, send + off * e, n * e, n * e, 1));
        }
        break;
      case StagedKind::kAllGather:
        DDP_RETURN_IF_ERROR(
            engine.Copy2D(slot + call.rank * n * e, n * e, send + off * e, n * e, n * e, 1));
        break;
      case StagedKind::kReduceScatter:
        DDP_RETURN_IF_ERROR(
            engine.Copy2D(slot, n * e, send + off * e, call.count * e, n * e, p));
        break;
    }
    return engine.MarkIn(s);
  };

  auto host_and_out = [&](size_t k) -> Status {
    const int s = static_cast<int>(k % CopyEngine::kSlots);
    const size_t off = k * n_max, n = chunk_size(k);
    std::byte* slot = engine.slot(s);
    switch (call.kind) {
      case StagedKind::kAllReduce:
        DDP_RETURN_IF_ERROR(host(slot, slot, n));
        return engine.Copy2D(recv + off * e, n * e, slot, n * e, n * e, 1);
      case StagedKind::kBroadcast:
        DDP_RETURN_IF_ERROR(host(slot, slot, n));
        if (is_root) return Status::Ok();
        return engine.Copy2D(recv + off * e, n * e, slot, n * e, n * e, 1);
      case StagedKind::kAllGather:
        DDP_RETURN_IF_ERROR(host(slot + call.rank * n * e, slot, n));
        return engine.Copy2D(recv + off * e, call.count * e, slot, n * e, n * e, p);
      case StagedKind::kReduceScatter:
        DDP_RETURN_IF_ERROR(host(slot, slot + p * n * e, n));
        return engine.Copy2D(recv + off * e, n * e, slot + p * n * e, n * e, n * e, 1);
    }
    return InternalError("unknown staged collective");
  };

  auto run = [&]() -> Status {
    DDP_RETURN_IF_ERROR(start_in(0));
    for (size_t k = 0; k < chunks; ++k) {
      if (k + 1 < chunks) DDP_RETURN_IF_ERROR(start_in(k + 1));
      DDP_RETURN_IF_ERROR(engine.WaitIn(static_cast<int>(k % CopyEngine::kSlots), deadline));
      DDP_RETURN_IF_ERROR(host_and_out(k));
    }
    return engine.WaitAll(deadline);
  };

  Status status = run();
  if (!status.ok()) {
    // Copies already queued still write into the slots and the user's
    // buffers; let them land (they take microseconds) so that nothing
    // writes after the call returned. Bounded: a wedged device must not
    // turn a failed call into a hang.
    engine.WaitAll(std::max(deadline, DeadlineIn(std::chrono::milliseconds(1000)))).IgnoreError();
  }
  return status;
}

}  // namespace ddp::transport::cuda
