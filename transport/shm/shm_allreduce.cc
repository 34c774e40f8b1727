#include "transport/shm/shm_allreduce.h"

#include <sched.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <immintrin.h>

#include "transport/reduce/reduce.h"

namespace ddp::transport::shm {

// One rank's mailbox in the segment. Only its owner writes it; the others
// poll the counters. Each on its own cache lines so that a rank polling one
// mailbox does not contend with writes to another.
struct alignas(128) ShmAllReduce::Control {
  std::atomic<uint64_t> arrived;
  std::atomic<uint64_t> reduced;
  std::atomic<uint64_t> finished;
  uint64_t src;    // address of the input in the owner's address space
  uint64_t dst;    // address of the output
  uint64_t count;
  int32_t dtype;
  int32_t op;
  uint64_t probe;  // address of a word holding kProbeValue (CMA check)
};

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kStagingCapacity = 1 << 20;
constexpr uint64_t kProbeValue = 0x6464702d636d6121ull;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Element range [begin, end) of `rank`'s slice: equal blocks rounded to
// whole cache lines, so that no two ranks write the same line.
void Slice(size_t count, size_t elem, int size, int rank, size_t& begin, size_t& end) {
  const size_t per_line = std::max<size_t>(1, 64 / elem);
  const size_t block = RoundUp((count + size - 1) / size, per_line);
  begin = std::min(count, block * rank);
  end = std::min(count, block * (rank + 1));
}

}  // namespace

ShmAllReduce::Control& ShmAllReduce::control(int rank) const {
  return static_cast<Control*>(segment_->data())[rank];
}

char* ShmAllReduce::staging(int rank) const {
  const size_t controls = RoundUp(sizeof(Control) * options_.size, kPage);
  return static_cast<char*>(segment_->data()) + controls + staging_capacity_ * rank;
}

ShmAllReduce::ShmAllReduce(std::unique_ptr<Segment> segment, const ShmOptions& options,
                           size_t staging_capacity)
    : segment_(std::move(segment)), options_(options), staging_capacity_(staging_capacity) {
  chunk_.resize(std::max<size_t>(options_.chunk_bytes, kPage));
}

ShmAllReduce::~ShmAllReduce() = default;

void ShmAllReduce::set_staging_bytes(size_t bytes) {
  options_.staging_bytes = std::min(bytes, staging_capacity_);
}

StatusOr<std::unique_ptr<ShmAllReduce>> ShmAllReduce::Create(store::Store& store,
                                                             const std::string& key_prefix,
                                                             const ShmOptions& options,
                                                             Deadline deadline) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size ||
      static_cast<int>(options.pids.size()) != options.size) {
    return InvalidArgumentError("shared-memory group: rank " + std::to_string(options.rank) +
                                " of " + std::to_string(options.size) + " with " +
                                std::to_string(options.pids.size()) + " pids");
  }
  const size_t staging_capacity = std::max(kStagingCapacity, RoundUp(options.staging_bytes, kPage));
  const size_t bytes = RoundUp(sizeof(Control) * options.size, kPage) +
                       staging_capacity * options.size;
  DDP_ASSIGN_OR_RETURN(std::unique_ptr<Segment> segment,
                       Segment::CreateShared(store, key_prefix + "segment/", options.rank,
                                             options.size, bytes, deadline));
  std::unique_ptr<ShmAllReduce> engine(new ShmAllReduce(std::move(segment), options,
                                                        staging_capacity));
  engine->options_.staging_bytes = std::min(options.staging_bytes, staging_capacity);

  // CMA needs ptrace permission between the ranks (Yama, containers and
  // seccomp may deny it). Every rank probes every peer and posts the
  // verdict; all ranks then take the same decision.
  static uint64_t probe_word = kProbeValue;
  Control& mine = engine->control(options.rank);
  mine.probe = reinterpret_cast<uint64_t>(&probe_word);
  DDP_RETURN_IF_ERROR(store.Set(key_prefix + "probe_ready/" + std::to_string(options.rank), "1",
                                deadline));
  std::string verdict = "ok";
  for (int peer = 0; peer < options.size; ++peer) {
    if (peer == options.rank) continue;
    DDP_RETURN_IF_ERROR(store.Get(key_prefix + "probe_ready/" + std::to_string(peer), deadline)
                            .status());
    uint64_t value = 0;
    Status read = engine->ReadFromPeer(peer, &value, engine->control(peer).probe, sizeof(value));
    if (!read.ok() || value != kProbeValue) {
      verdict = "rank " + std::to_string(options.rank) + " cannot read rank " +
                std::to_string(peer) + "'s memory: " +
                (read.ok() ? std::string("wrong value") : read.message());
      break;
    }
  }
  DDP_RETURN_IF_ERROR(store.Set(key_prefix + "probe/" + std::to_string(options.rank), verdict,
                                deadline));
  for (int peer = 0; peer < options.size; ++peer) {
    DDP_ASSIGN_OR_RETURN(std::string theirs,
                         store.Get(key_prefix + "probe/" + std::to_string(peer), deadline));
    if (theirs != "ok") return UnavailableError("cross-memory attach unavailable: " + theirs);
  }
  return engine;
}

Status ShmAllReduce::ReadFromPeer(int peer, void* local, uint64_t remote, size_t bytes) const {
  char* out = static_cast<char*>(local);
  while (bytes > 0) {
    iovec local_iov{out, bytes};
    iovec remote_iov{reinterpret_cast<void*>(remote), bytes};
    const ssize_t n = process_vm_readv(options_.pids[peer], &local_iov, 1, &remote_iov, 1, 0);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      const int error = n < 0 ? errno : EIO;
      if (error == ESRCH) {
        return PeerLostError("rank " + std::to_string(peer) + " (pid " +
                             std::to_string(options_.pids[peer]) + ") exited");
      }
      if (error == EFAULT) {
        return InvalidArgumentError("rank " + std::to_string(peer) +
                                    "'s buffer is not readable (freed during the call?)");
      }
      return UnavailableError("reading rank " + std::to_string(peer) +
                              "'s memory (process_vm_readv): " + std::strerror(error));
    }
    out += n;
    remote += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status ShmAllReduce::WaitFor(std::atomic<uint64_t> Control::*field, uint64_t value, int only,
                             Deadline deadline, const std::function<Status()>& watchdog,
                             const char* phase) {
  Clock::time_point next_watchdog = Clock::time_point::min();
  for (int peer = 0; peer < options_.size; ++peer) {
    if (peer == options_.rank || (only >= 0 && peer != only)) continue;
    const std::atomic<uint64_t>& counter = control(peer).*field;
    uint32_t spins = 0;
    while (counter.load(std::memory_order_acquire) < value) {
      if ((++spins & 63) != 0) {
        _mm_pause();
        continue;
      }
      const Clock::time_point now = Clock::now();
      if (now >= deadline) {
        return TimedOutError(std::string("shared-memory all-reduce: waiting for rank ") +
                             std::to_string(peer) + " to " + phase + " (call " +
                             std::to_string(value) + "): deadline passed");
      }
      if (watchdog && now >= next_watchdog) {
        next_watchdog = now + options_.watchdog_period;
        DDP_RETURN_IF_ERROR(watchdog());
      }
      // Yield soon when ranks outnumber cores; otherwise after ~50 us of
      // spinning, so that a rank whose peer was descheduled (a busy machine)
      // gives its core back instead of burning the peer's turn.
      if (options_.yield_when_idle || spins > options_.spins_before_yield) sched_yield();
    }
  }
  return Status::Ok();
}

Status ShmAllReduce::CheckAgreement(size_t count, DataType dtype, ReduceOp op) const {
  for (int peer = 0; peer < options_.size; ++peer) {
    const Control& theirs = control(peer);
    if (theirs.count != count || theirs.dtype != static_cast<int32_t>(dtype) ||
        theirs.op != static_cast<int32_t>(op)) {
      return InvalidArgumentError(
          "all-reduce arguments differ across ranks: rank " + std::to_string(options_.rank) +
          " passed count " + std::to_string(count) + " " + DataTypeName(dtype) + " " +
          ReduceOpName(op) + ", rank " + std::to_string(peer) + " passed count " +
          std::to_string(theirs.count) + " " + DataTypeName(static_cast<DataType>(theirs.dtype)) +
          " " + ReduceOpName(static_cast<ReduceOp>(theirs.op)));
    }
  }
  return Status::Ok();
}

Status ShmAllReduce::AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                               ReduceOp op, Deadline deadline,
                               const std::function<Status()>& watchdog) {
  const size_t bytes = count * DataTypeSize(dtype);
  const uint64_t s = ++sequence_;
  // The peers may still copy out of this rank's staging area from the last
  // call; wait until they are done before overwriting it.
  DDP_RETURN_IF_ERROR(WaitFor(&Control::finished, s - 1, -1, deadline, watchdog,
                              "finish the previous call"));
  const bool staged = bytes <= options_.staging_bytes;
  if (staged && bytes > 0) std::memcpy(staging(options_.rank), send, bytes);
  Control& mine = control(options_.rank);
  mine.src = reinterpret_cast<uint64_t>(send);
  mine.dst = reinterpret_cast<uint64_t>(recv);
  mine.count = count;
  mine.dtype = static_cast<int32_t>(dtype);
  mine.op = static_cast<int32_t>(op);
  mine.arrived.store(s, std::memory_order_release);
  DDP_RETURN_IF_ERROR(WaitFor(&Control::arrived, s, -1, deadline, watchdog, "arrive"));
  DDP_RETURN_IF_ERROR(CheckAgreement(count, dtype, op));
  if (staged) return StagedAllReduce(send, recv, count, dtype, op, deadline, watchdog);
  return DirectAllReduce(send, recv, count, dtype, op, deadline, watchdog);
}

// Shapes: every rank holds [count] elements of `dtype`; rank r reduces
// elements [begin_r, end_r) (its slice) and every rank ends with all slices.
Status ShmAllReduce::StagedAllReduce(const void*, void* recv, size_t count, DataType dtype,
                                     ReduceOp op, Deadline deadline,
                                     const std::function<Status()>& watchdog) {
  const int me = options_.rank;
  const uint64_t s = sequence_;
  const size_t elem = DataTypeSize(dtype);
  const reduce::ReduceFn fn = reduce::GetReduceFn(dtype, op);
  size_t begin, end;
  Slice(count, elem, options_.size, me, begin, end);
  if (end > begin) {
    char* mine = staging(me) + begin * elem;
    for (int peer = 0; peer < options_.size; ++peer) {
      if (peer != me) fn(mine, mine, staging(peer) + begin * elem, end - begin);
    }
    if (op == ReduceOp::kAvg) reduce::DivideInPlace(dtype, mine, end - begin, options_.size);
  }
  control(me).reduced.store(s, std::memory_order_release);
  for (int k = 0; k < options_.size; ++k) {
    const int q = (me + k) % options_.size;
    if (q != me) DDP_RETURN_IF_ERROR(WaitFor(&Control::reduced, s, q, deadline, watchdog, "reduce"));
    size_t qb, qe;
    Slice(count, elem, options_.size, q, qb, qe);
    if (qe > qb) std::memcpy(static_cast<char*>(recv) + qb * elem, staging(q) + qb * elem, (qe - qb) * elem);
  }
  control(me).finished.store(s, std::memory_order_release);
  return Status::Ok();
}

Status ShmAllReduce::DirectAllReduce(const void* send, void* recv, size_t count, DataType dtype,
                                     ReduceOp op, Deadline deadline,
                                     const std::function<Status()>& watchdog) {
  const int me = options_.rank;
  const uint64_t s = sequence_;
  const size_t elem = DataTypeSize(dtype);
  const reduce::ReduceFn fn = reduce::GetReduceFn(dtype, op);
  char* out = static_cast<char*>(recv);
  const char* in = static_cast<const char*>(send);
  size_t begin, end;
  Slice(count, elem, options_.size, me, begin, end);
  // Reduce-scatter: pull this slice's chunks from every peer's input and
  // fold each into the output while it is in cache.
  const size_t chunk_elems = std::max<size_t>(1, chunk_.size() / elem);
  for (size_t a = begin; a < end; a += chunk_elems) {
    const size_t n = std::min(chunk_elems, end - a);
    const char* first = in + a * elem;
    for (int peer = 0; peer < options_.size; ++peer) {
      if (peer == me) continue;
      DDP_RETURN_IF_ERROR(ReadFromPeer(peer, chunk_.data(), control(peer).src + a * elem, n * elem));
      fn(out + a * elem, first, chunk_.data(), n);
      first = out + a * elem;
    }
    if (options_.size == 1 && first != out + a * elem) std::memcpy(out + a * elem, first, n * elem);
    if (op == ReduceOp::kAvg) reduce::DivideInPlace(dtype, out + a * elem, n, options_.size);
  }
  control(me).reduced.store(s, std::memory_order_release);
  // All-gather: read every other slice straight into the output.
  for (int k = 1; k < options_.size; ++k) {
    const int q = (me + k) % options_.size;
    DDP_RETURN_IF_ERROR(WaitFor(&Control::reduced, s, q, deadline, watchdog, "reduce"));
    size_t qb, qe;
    Slice(count, elem, options_.size, q, qb, qe);
    if (qe > qb) {
      DDP_RETURN_IF_ERROR(ReadFromPeer(q, out + qb * elem, control(q).dst + qb * elem,
                                       (qe - qb) * elem));
    }
  }
  control(me).finished.store(s, std::memory_order_release);
  // Peers read this rank's output slice until they finish.
  return WaitFor(&Control::finished, s, -1, deadline, watchdog, "finish reading");
}

Status ShmAllReduce::Barrier(Deadline deadline, const std::function<Status()>& watchdog) {
  const uint64_t s = ++sequence_;
  Control& mine = control(options_.rank);
  // Keeps the staging reuse rule of AllReduce: a barrier counts as a call.
  DDP_RETURN_IF_ERROR(WaitFor(&Control::finished, s - 1, -1, deadline, watchdog,
                              "finish the previous call"));
  // Arguments no all-reduce can have, so that a rank in an all-reduce while
  // another is in a barrier reports the mismatch.
  mine.count = ~uint64_t{0};
  mine.dtype = -1;
  mine.op = -1;
  mine.arrived.store(s, std::memory_order_release);
  mine.reduced.store(s, std::memory_order_release);
  DDP_RETURN_IF_ERROR(WaitFor(&Control::arrived, s, -1, deadline, watchdog, "reach the barrier"));
  mine.finished.store(s, std::memory_order_release);
  return Status::Ok();
}

}  // namespace ddp::transport::shm
