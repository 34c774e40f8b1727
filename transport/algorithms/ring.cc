#include "transport/algorithms/ring.h"

#include <cstring>
#include <memory>
#include <vector>

#include "transport/reduce/reduce.h"

namespace ddp::transport::algorithms::internal {
namespace {

int Mod(int a, int p) { return ((a % p) + p) % p; }

// Elements of chunk c of a block of `block_size` elements (0 past its end:
// blocks differ by one element, so the last chunk of a short block may be
// empty; both ends of a message compute the same sizes and skip it).
size_t ChunkSize(size_t block_size, size_t c, size_t chunk_elems) {
  const size_t begin = c * chunk_elems;
  return begin < block_size ? std::min(chunk_elems, block_size - begin) : 0;
}

// Chunks that move together through every step of the reduce-scatter before
// the next group starts. It bounds scratch memory to (group + depth + 1)
// chunks whatever the vector size, while a step still streams `group` chunks
// back to back.
constexpr size_t kReduceScatterGroupChunks = 8;

}  // namespace

// Message order, at every rank: groups of G chunks; inside a group, step by
// step; inside a step, chunk by chunk. Message m (same index at sender and
// receiver, which with the call's CallDataBase gives its tag) of step s carries chunk c of block
// (r - s - 1) from rank r to r + 1, where it is reduced with the receiver's
// own contribution and forwarded as message m + G, or, at the last step,
// written to `out`: rank r receives block (r - s - 2), which is r at
// s = p - 2.
//
// Scratch: slot m % S holds message m from its arrival until its forward has
// been sent. S = G + depth + 1 makes the slot's next user, m + S, later than
// both the forward (m + G) and the receives posted ahead (m + depth), so every
// wait is on an earlier message and the ring cannot deadlock.
Status RingReduceScatterBlocks(p2p::PointToPoint& p2p, const void* send, void* out,
                               const BlockLayout& layout, const RingParams& params) {
  const int p = p2p.size(), r = p2p.rank();
  const size_t es = DataTypeSize(params.dtype);
  const auto* in = static_cast<const unsigned char*>(send);
  auto* dst = static_cast<unsigned char*>(out);
  if (p == 1) {
    if (dst != in) std::memmove(dst, in, layout.size(0) * es);
    return Status();
  }
  const size_t ce = params.chunk_elems;
  const size_t k = ChunkCount(layout.size(0), ce);  // chunks per block; block 0 is largest
  if (k == 0) return Status();

  const int steps = p - 1;
  const size_t total = static_cast<size_t>(steps) * k;
  const size_t group = std::min(k, kReduceScatterGroupChunks);
  const size_t depth = static_cast<size_t>(params.depth);
  // Never more slots than messages: one big chunk needs one slot.
  const size_t slots = std::min(group + depth + 1, total);
  const size_t slot_elems = std::min(ce, layout.size(0));
  Scratch scratch(slots * slot_elems * es);
  std::vector<p2p::RequestId> slot_send(slots, 0);  // forward still reading the slot
  std::vector<p2p::RequestId> slot_recv(slots, 0);  // receive posted into the slot
  const reduce::ReduceFn reduce_fn = reduce::GetReduceFn(params.dtype, params.op);
  const int next = Mod(r + 1, p), prev = Mod(r - 1, p);
  const uint64_t base = CallDataBase(params.call_id);

  struct Msg {
    int step;
    size_t chunk;
    size_t group_size;  // chunks in this message's group
  };
  auto decode = [&](size_t m) {
    const size_t per_group = group * steps;
    const size_t g = m / per_group;
    const size_t within = m - g * per_group;
    const size_t gsize = std::min(group, k - g * group);
    return Msg{static_cast<int>(within / gsize), g * group + within % gsize, gsize};
  };
  auto slot_ptr = [&](size_t m) { return scratch.data() + (m % slots) * slot_elems * es; };

  Requests requests(p2p, params.deadline);
  Where where{params.what, 0, steps, 0, false, 0};
  PeerCheck check(params.what, params.fingerprint ? *params.fingerprint : Fingerprint{});
  if (params.fingerprint != nullptr) {
    // A disagreement stops the whole ring, not only the rank that checks
    // the one that differs.
    DDP_RETURN_IF_ERROR(requests.RelayStops(params.what, params.call_id, params.tag, prev, next));
    const std::vector<int> to =
        params.fingerprint_sent ? std::vector<int>{} : std::vector<int>{next};
    DDP_RETURN_IF_ERROR(check.Post(requests, params.tag, params.call_id, to, {prev}));
  }
  // On every return, error paths included. A stop note counts as the
  // check's finding: the rank that differs may run CheckEveryRank and wait
  // for this rank's rounds (the ring reduce).
  struct ReportDifferingKind {
    const PeerCheck& check;
    const Requests& requests;
    int32_t* out;
    ~ReportDifferingKind() {
      if (out == nullptr) return;
      *out = check.differing_kind() != 0 ? check.differing_kind() : requests.stopped_by_kind();
    }
  } report_differing_kind{check, requests, params.differing_kind};

  // Posts the receive of message m and, at step 0, the matching raw send of
  // this rank's own contribution, which needs no reduction.
  auto post = [&](size_t m) -> Status {
    const Msg msg = decode(m);
    const int recv_block = Mod(r - msg.step - 2, p);
    const size_t n = ChunkSize(layout.size(recv_block), msg.chunk, ce);
    where.step = msg.step;
    where.chunk = msg.chunk;
    const size_t slot = m % slots;
    slot_recv[slot] = 0;
    if (n > 0) {
      if (slot_send[slot] != 0) {
        where.is_send = true;
        where.peer = next;
        DDP_RETURN_IF_ERROR(requests.Wait(slot_send[slot], where));
        slot_send[slot] = 0;
      }
      where.is_send = false;
      where.peer = prev;
      DDP_ASSIGN_OR_RETURN(
          slot_recv[slot], requests.Recv(where, CallStepTag(params.tag, base, m), slot_ptr(m), n * es));
    }
    if (msg.step == 0) {
      const int send_block = Mod(r - 1, p);
      const size_t sn = ChunkSize(layout.size(send_block), msg.chunk, ce);
      if (sn > 0) {
        where.is_send = true;
        where.peer = next;
        const unsigned char* src = in + (layout.offset(send_block) + msg.chunk * ce) * es;
        DDP_RETURN_IF_ERROR(
            requests.Send(where, CallStepTag(params.tag, base, m), src, sn * es).status());
      }
    }
    return Status();
  };

  size_t posted = 0;
  for (size_t m = 0; m < total; ++m) {
    while (posted < total && posted < m + depth) DDP_RETURN_IF_ERROR(post(posted++));
    const size_t slot = m % slots;
    if (slot_recv[slot] == 0) continue;  // empty chunk: no message
    const Msg msg = decode(m);
    const int block = Mod(r - msg.step - 2, p);
    const size_t n = ChunkSize(layout.size(block), msg.chunk, ce);
    where = Where{params.what, msg.step, steps, msg.chunk, false, prev};
    DDP_RETURN_IF_ERROR(requests.Wait(slot_recv[slot], where));
    slot_recv[slot] = 0;
    const unsigned char* mine = in + (layout.offset(block) + msg.chunk * ce) * es;
    if (msg.step == steps - 1) {
      // block == r: the fully reduced chunk goes to its final place.
      reduce_fn(dst + msg.chunk * ce * es, slot_ptr(m), mine, n);
    } else {
      reduce_fn(slot_ptr(m), slot_ptr(m), mine, n);
      where.step = msg.step + 1;
      where.is_send = true;
      where.peer = next;
      DDP_ASSIGN_OR_RETURN(
          slot_send[slot],
          requests.Send(where, CallStepTag(params.tag, base, m + msg.group_size), slot_ptr(m), n * es));
    }
  }
  return requests.WaitAll(params.what);
}

// Message m = t * k + c of step t carries chunk c of block (r - t) from rank
// r to r + 1, straight into its final place; it is forwarded from there as
// message m + k. Nothing is reduced and nothing is copied twice.
Status RingAllGatherBlocks(p2p::PointToPoint& p2p, void* buf, const BlockLayout& layout,
                           const RingParams& params) {
  const int p = p2p.size(), r = p2p.rank();
  if (p == 1) return Status();
  const size_t es = DataTypeSize(params.dtype);
  auto* data = static_cast<unsigned char*>(buf);
  const size_t ce = params.chunk_elems;
  const size_t k = ChunkCount(layout.size(0), ce);
  if (k == 0) return Status();
  const int steps = p - 1;
  const size_t total = static_cast<size_t>(steps) * k;
  const size_t depth = static_cast<size_t>(params.depth);
  const int next = Mod(r + 1, p), prev = Mod(r - 1, p);
  const uint64_t base = CallDataBase(params.call_id);
  auto chunk_ptr = [&](int block, size_t c) {
    return data + (layout.offset(block) + c * ce) * es;
  };

  Requests requests(p2p, params.deadline);
  std::vector<p2p::RequestId> recv_ids(depth + 1, 0);
  Where where{params.what, 0, steps, 0, false, 0};
  PeerCheck check(params.what, params.fingerprint ? *params.fingerprint : Fingerprint{});
  if (params.fingerprint != nullptr) {
    // A disagreement stops the whole ring, not only the rank that checks
    // the one that differs.
    DDP_RETURN_IF_ERROR(requests.RelayStops(params.what, params.call_id, params.tag, prev, next));
    const std::vector<int> to =
        params.fingerprint_sent ? std::vector<int>{} : std::vector<int>{next};
    DDP_RETURN_IF_ERROR(check.Post(requests, params.tag, params.call_id, to, {prev}));
  }

  auto post = [&](size_t m) -> Status {
    const int t = static_cast<int>(m / k);
    const size_t c = m % k;
    where.step = t;
    where.chunk = c;
    const int recv_block = Mod(r - t - 1, p);
    const size_t n = ChunkSize(layout.size(recv_block), c, ce);
    recv_ids[m % (depth + 1)] = 0;
    if (n > 0) {
      where.is_send = false;
      where.peer = prev;
      DDP_ASSIGN_OR_RETURN(recv_ids[m % (depth + 1)],
                           requests.Recv(where, CallStepTag(params.tag, base, m), chunk_ptr(recv_block, c),
                                         n * es));
    }
    if (t == 0) {
      const size_t sn = ChunkSize(layout.size(r), c, ce);
      if (sn > 0) {
        where.is_send = true;
        where.peer = next;
        DDP_RETURN_IF_ERROR(
            requests.Send(where, CallStepTag(params.tag, base, m), chunk_ptr(r, c), sn * es).status());
      }
    }
    return Status();
  };

  size_t posted = 0;
  for (size_t m = 0; m < total; ++m) {
    while (posted < total && posted < m + depth) DDP_RETURN_IF_ERROR(post(posted++));
    const p2p::RequestId id = recv_ids[m % (depth + 1)];
    if (id == 0) continue;
    const int t = static_cast<int>(m / k);
    const size_t c = m % k;
    where = Where{params.what, t, steps, c, false, prev};
    DDP_RETURN_IF_ERROR(requests.Wait(id, where));
    if (t < steps - 1) {
      const int block = Mod(r - t - 1, p);
      const size_t n = ChunkSize(layout.size(block), c, ce);
      where.step = t + 1;
      where.is_send = true;
      where.peer = next;
      DDP_RETURN_IF_ERROR(requests
                              .Send(where, CallStepTag(params.tag, base, m + k), chunk_ptr(block, c),
                                    n * es)
                              .status());
    }
  }
  return requests.WaitAll(params.what);
}

}  // namespace ddp::transport::algorithms::internal
