#include "transport/cuda/staging_pipeline.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

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
//   reduce:         slot[0, n e)           in from send+off; the host reduces
//                                          in place on the root; out there
//   gather:         slot[0, p n e)         as all-gather, out on the root only
//   scatter:        slot[0, p n e)         in on the root as reduce-scatter;
//                   slot[p n e, (p+1) n e) every rank's block out to recv+off
// Every rank uses the same layout (it depends on the kind and size only), so
// all ranks cut the same chunks.
size_t SlotElementsPerChunk(const StagedCall& call) {
  switch (call.kind) {
    case StagedKind::kAllReduce:
    case StagedKind::kBroadcast:
    case StagedKind::kReduce:
      return 1;
    case StagedKind::kAllGather:
    case StagedKind::kGather:
      return static_cast<size_t>(call.size);
    case StagedKind::kReduceScatter:
    case StagedKind::kScatter:
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
    // Broadcast and scatter read the root's input only.
    if (!is_root && (call.kind == StagedKind::kBroadcast || call.kind == StagedKind::kScatter)) {
      return engine.MarkIn(s);
    }
    switch (call.kind) {
      case StagedKind::kAllReduce:
      case StagedKind::kBroadcast:
      case StagedKind::kReduce:
        DDP_RETURN_IF_ERROR(engine.Copy2D(slot, n * e, send + off * e, n * e, n * e, 1));
        break;
      case StagedKind::kAllGather:
      case StagedKind::kGather:
        DDP_RETURN_IF_ERROR(
            engine.Copy2D(slot + call.rank * n * e, n * e, send + off * e, n * e, n * e, 1));
        break;
      case StagedKind::kReduceScatter:
      case StagedKind::kScatter:
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
      case StagedKind::kReduce:
        DDP_RETURN_IF_ERROR(host(slot, is_root ? slot : nullptr, n));
        if (!is_root) return Status::Ok();
        return engine.Copy2D(recv + off * e, n * e, slot, n * e, n * e, 1);
      case StagedKind::kGather:
        DDP_RETURN_IF_ERROR(host(slot + call.rank * n * e, is_root ? slot : nullptr, n));
        if (!is_root) return Status::Ok();
        return engine.Copy2D(recv + off * e, call.count * e, slot, n * e, n * e, p);
      case StagedKind::kScatter:
        DDP_RETURN_IF_ERROR(host(is_root ? slot : nullptr, slot + p * n * e, n));
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

StatusOr<int> CallDevice(std::span<const CallBuffer> buffers, const char* what) {
  const CallBuffer* host = nullptr;    // the first host buffer used
  const CallBuffer* device = nullptr;  // the first device buffer
  for (const CallBuffer& b : buffers) {
    if (b.p == nullptr) continue;
    if (!b.kind.device) {
      if (host == nullptr) host = &b;
      continue;
    }
    if (device != nullptr && b.kind.device_id != device->kind.device_id) {
      return InvalidArgumentError(std::string(what) + ": the " + device->name +
                                  " is on CUDA device " +
                                  std::to_string(device->kind.device_id) + " and the " + b.name +
                                  " on CUDA device " + std::to_string(b.kind.device_id) +
                                  "; one call uses one device");
    }
    if (device == nullptr) device = &b;
  }
  if (device == nullptr) return -1;
  if (host != nullptr) {
    return InvalidArgumentError(std::string(what) + ": the " + host->name +
                                " is host memory and the " + device->name + " is on CUDA device " +
                                std::to_string(device->kind.device_id) +
                                "; one call takes host buffers or device buffers, not both");
  }
  return device->kind.device_id;
}

size_t StagingSlotBytes(size_t chunk_bytes, int world_size) {
  size_t slot = std::max<size_t>(chunk_bytes, 8 * (static_cast<size_t>(world_size) + 1));
  // A larger request fails to allocate anyway; capped, the rounding below
  // and kSlots * slot cannot wrap around.
  constexpr size_t kCap = std::numeric_limits<size_t>::max() / CopyEngine::kSlots /
                          kStagingSlotAlign * kStagingSlotAlign;
  slot = std::min(slot, kCap);
  return (slot + kStagingSlotAlign - 1) / kStagingSlotAlign * kStagingSlotAlign;
}

StagedPlan ChooseStagedPlan(const StagedCall& call, bool prefer_device,
                            bool network_reads_device) {
  const bool reduces =
      call.kind == StagedKind::kAllReduce || call.kind == StagedKind::kReduceScatter;
  if (!reduces) return network_reads_device ? StagedPlan::kDirect : StagedPlan::kHostSlots;
  if (!prefer_device || call.size > kMaxDeviceReduceSources) return StagedPlan::kHostSlots;
  return network_reads_device ? StagedPlan::kDeviceReduceDirect : StagedPlan::kDeviceReduce;
}

namespace {

// Where rank q's segment of a chunk lives, for the device-reduce mode.
struct Segments {
  StagedKind kind;
  size_t n = 0;  // chunk elements
  int p = 1;
  // All-reduce: the chunk split like a ring splits it.
  size_t start(int q) const {
    if (kind == StagedKind::kReduceScatter) return 0;
    const size_t base = n / p, rem = n % p;
    return q * base + std::min<size_t>(q, rem);
  }
  size_t size(int q) const {
    if (kind == StagedKind::kReduceScatter) return n;
    return n / p + (static_cast<size_t>(q) < n % p ? 1 : 0);
  }
  // Offset of segment q in the host slot's out area: all-reduce keeps the
  // chunk's layout, reduce-scatter puts the blocks' chunks side by side.
  size_t host_offset(int q) const {
    return kind == StagedKind::kReduceScatter ? q * n : start(q);
  }
  size_t host_elements() const { return kind == StagedKind::kReduceScatter ? p * n : n; }
};

// Host slot per chunk, in elements: the out area (the segments sent, later
// the gathered result) and the in area (the p - 1 segments received). The
// device scratch holds a copy of the in area.
size_t DeviceReduceSlotElements(StagedKind kind, size_t n, int p) {
  const Segments seg{kind, n, p};
  return seg.host_elements() + (p - 1) * seg.size(0);
}

}  // namespace

size_t DeviceReduceChunkElements(const StagedCall& call, size_t slot_bytes) {
  const size_t slot = slot_bytes / DataTypeSize(call.dtype);
  const int p = call.size;
  // The slot grows by about 2 elements per chunk element (all-reduce) or
  // 2p - 1 (reduce-scatter): start from that estimate and step down past
  // the rounding of the segment sizes.
  size_t n = call.kind == StagedKind::kReduceScatter ? slot / (2 * p - 1)
                                                      : slot * p / (2 * p - 1);
  while (n > 0 && DeviceReduceSlotElements(call.kind, n, p) > slot) --n;
  return n;
}

Status RunStagedDeviceReduce(CopyEngine& engine, const StagedCall& call,
                             const HostExchange& exchange, bool network_reads_device,
                             Deadline deadline) {
  if (call.kind != StagedKind::kAllReduce && call.kind != StagedKind::kReduceScatter) {
    return InvalidArgumentError("the device-reduce mode runs all-reduce and reduce-scatter only");
  }
  if (call.size > kMaxDeviceReduceSources) {
    return InvalidArgumentError("the device-reduce mode takes at most " +
                                std::to_string(kMaxDeviceReduceSources) + " ranks, not " +
                                std::to_string(call.size));
  }
  if (call.count == 0) return Status::Ok();
  const size_t e = DataTypeSize(call.dtype);
  const size_t n_max = DeviceReduceChunkElements(call, engine.slot_bytes());
  if (n_max == 0) {
    return InvalidArgumentError("staging slots of " + std::to_string(engine.slot_bytes()) +
                                " bytes cannot hold one element per rank");
  }
  const size_t chunks = (call.count + n_max - 1) / n_max;
  const int p = call.size, me = call.rank;
  const bool all_reduce = call.kind == StagedKind::kAllReduce;
  const auto* send = static_cast<const std::byte*>(call.send);
  auto* recv = static_cast<std::byte*>(call.recv);
  // The received segments sit in rank order, without this rank's.
  auto index = [me](int q) { return q < me ? q : q - 1; };

  struct Chunk {
    int s;         // slot
    size_t off;    // element offset of the chunk in each rank block
    Segments seg;
  };
  auto chunk = [&](size_t k) {
    const size_t off = k * n_max;
    return Chunk{static_cast<int>(k % CopyEngine::kSlots), off,
                 Segments{call.kind, std::min(n_max, call.count - off), p}};
  };
  // Device address of this rank's input segment q of chunk c, and of its
  // output segment.
  auto input = [&](const Chunk& c, int q) {
    const size_t block = all_reduce ? 0 : q * call.count;
    return send + (block + c.off + c.seg.start(q)) * e;
  };
  auto output = [&](const Chunk& c) {
    return recv + (c.off + (all_reduce ? c.seg.start(me) : 0)) * e;
  };
  auto host_segment = [&](const Chunk& c, int q) {
    return engine.slot(c.s) + c.seg.host_offset(q) * e;
  };
  auto host_in = [&](const Chunk& c) { return engine.slot(c.s) + c.seg.host_elements() * e; };

  // Staged only: the segments this rank sends leave the device.
  auto start_out = [&](size_t k) -> Status {
    const Chunk c = chunk(k);
    for (int q = 0; q < p; ++q) {
      if (q == me) continue;
      const size_t bytes = c.seg.size(q) * e;
      DDP_RETURN_IF_ERROR(engine.Copy2D(host_segment(c, q), bytes, input(c, q), bytes, bytes, 1));
    }
    return engine.MarkIn(c.s);
  };

  // Every segment to its owner, then this rank's segment reduced on the
  // device (queued, not awaited).
  auto reduce = [&](size_t k) -> Status {
    const Chunk c = chunk(k);
    const size_t mine = c.seg.size(me) * e;
    std::byte* scratch = engine.scratch(c.s);
    std::vector<algorithms::ExchangeBlock> blocks(p);
    if (network_reads_device) {
      // The network writes the scratch directly: the reduction that read
      // this slot's scratch two chunks ago must be done.
      if (k >= CopyEngine::kSlots) DDP_RETURN_IF_ERROR(engine.WaitIn(c.s, deadline));
      for (int q = 0; q < p; ++q) {
        if (q == me) continue;
        blocks[q] = {input(c, q), c.seg.size(q) * e, scratch + index(q) * mine, mine};
      }
    } else {
      DDP_RETURN_IF_ERROR(engine.WaitIn(c.s, deadline));
      for (int q = 0; q < p; ++q) {
        if (q == me) continue;
        blocks[q] = {host_segment(c, q), c.seg.size(q) * e, host_in(c) + index(q) * mine, mine};
      }
    }
    DDP_RETURN_IF_ERROR(exchange(blocks, c.seg.n));
    if (!network_reads_device) {
      const size_t bytes = (p - 1) * mine;
      DDP_RETURN_IF_ERROR(engine.Copy2D(scratch, bytes, host_in(c), bytes, bytes, 1));
    }
    std::vector<const void*> sources(p);
    sources[0] = input(c, me);
    for (int q = 0; q < p; ++q) {
      if (q != me) sources[1 + index(q)] = scratch + index(q) * mine;
    }
    DDP_RETURN_IF_ERROR(
        engine.Reduce(output(c), sources.data(), p, c.seg.size(me), call.dtype, call.op));
    if (all_reduce && !network_reads_device) {
      DDP_RETURN_IF_ERROR(engine.Copy2D(host_segment(c, me), mine, output(c), mine, mine, 1));
    }
    return engine.MarkIn(c.s);
  };

  // All-reduce: every rank's reduced segment to every rank.
  auto gather = [&](size_t k) -> Status {
    const Chunk c = chunk(k);
    DDP_RETURN_IF_ERROR(engine.WaitIn(c.s, deadline));
    const size_t mine = c.seg.size(me) * e;
    std::vector<algorithms::ExchangeBlock> blocks(p);
    for (int q = 0; q < p; ++q) {
      if (q == me) continue;
      const size_t bytes = c.seg.size(q) * e;
      if (network_reads_device) {
        blocks[q] = {output(c), mine, recv + (c.off + c.seg.start(q)) * e, bytes};
      } else {
        blocks[q] = {host_segment(c, me), mine, host_segment(c, q), bytes};
      }
    }
    DDP_RETURN_IF_ERROR(exchange(blocks, c.seg.n));
    if (network_reads_device) return Status::Ok();
    for (int q = 0; q < p; ++q) {
      if (q == me) continue;
      const size_t bytes = c.seg.size(q) * e;
      DDP_RETURN_IF_ERROR(engine.Copy2D(recv + (c.off + c.seg.start(q)) * e, bytes,
                                        host_segment(c, q), bytes, bytes, 1));
    }
    return Status::Ok();
  };

  // Slot reuse is safe without further waits: chunk k + 2's copy out of the
  // device is queued after chunk k's copies from the same slot, and the
  // host writes a slot only after WaitIn on a mark queued after them.
  auto run = [&]() -> Status {
    // The network reads the user's buffer without the queue's ordering: the
    // engine's queue starts after the work the input waits for (the CUDA
    // engine's stream follows the legacy default stream), so draining it
    // first makes the input complete.
    if (network_reads_device) DDP_RETURN_IF_ERROR(engine.WaitAll(deadline));
    if (!network_reads_device) DDP_RETURN_IF_ERROR(start_out(0));
    for (size_t k = 0; k < chunks; ++k) {
      if (!network_reads_device && k + 1 < chunks) DDP_RETURN_IF_ERROR(start_out(k + 1));
      DDP_RETURN_IF_ERROR(reduce(k));
      if (all_reduce) DDP_RETURN_IF_ERROR(gather(k));
    }
    return engine.WaitAll(deadline);
  };

  Status status = run();
  if (!status.ok()) {
    // As in RunStaged: queued work still writes the user's buffers; let it
    // land, boundedly.
    engine.WaitAll(std::max(deadline, DeadlineIn(std::chrono::milliseconds(1000)))).IgnoreError();
  }
  return status;
}

}  // namespace ddp::transport::cuda
