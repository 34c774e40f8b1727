#include "transport/shm/shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <immintrin.h>

#include "transport/fault/process.h"
#include "transport/reduce/reduce.h"

namespace ddp::transport::shm {

// One rank's mailbox in the segment. Only its owner writes it; the others
// poll the counters. Each on its own cache lines so that a rank polling one
// mailbox does not contend with writes to another.
struct alignas(128) ShmAllReduce::Control {
  std::atomic<uint64_t> arrived;
  std::atomic<uint64_t> reduced;
  std::atomic<uint64_t> finished;
  // The last call this rank failed after arriving, or before it (see
  // `unclaimed`) (set after the code and message, before it publishes
  // finished): peers then fail that call too,
  // with its code and the start of its message, which name the cause.
  // kRewriting while it rewrites them for a later call (see MarkFailed).
  std::atomic<uint64_t> failed;
  // The last call this rank returned from before every peer had finished
  // it (set after `failed`): peers no longer copy from or into its buffers
  // for that call, and fail it with its recorded error.
  std::atomic<uint64_t> abandoned;
  // The call this rank failed before it began (it could not claim its
  // slot; see FailUnclaimed): it published `arrived` for it with its
  // failure alone, its args[] slot still holding an earlier call's.
  std::atomic<uint64_t> unclaimed;
  // Touching(call, peer) while this rank writes into that peer's memory
  // for that call, else 0 (see CopyWithPeer and Abandon).
  std::atomic<uint64_t> touching;
  // The code and message (NUL-padded) of the call in `failed`, as words:
  // a peer may copy them while this rank rewrites them for a later call,
  // and finds out from `failed` afterwards (PeerFailure).
  std::atomic<int32_t> failed_code;
  std::atomic<uint64_t> failed_message[30];
  uint64_t probe;  // address of a word holding kProbeValue (CMA check)
  // The arguments of call s live in args[s % 2]: a rank may start call s+1
  // while a slower peer still reads its arguments of call s, but it cannot
  // start call s+2 before every peer arrived at s+1, i.e. finished call s.
  struct Args {
    uint64_t src;  // address of the input in the owner's address space
    uint64_t dst;  // address of the output
    uint64_t count;
    int32_t dtype;
    int32_t op;
    int32_t kind;     // ShmAllReduce::Kind (op holds the root of a broadcast)
    int32_t root;     // reduce, gather, scatter; -1 otherwise
    // 1: the call copies with peers' buffers, 0: through the staging
    // buffers. Alike on every rank unless their staging limits differ
    // (set_staging_bytes), which must fail the call: a staged rank would
    // fold a staging buffer its direct peer never filled.
    int32_t direct;
    // The shareable memory (shareable.h) holding src and dst, id 0 when
    // the buffer lies in none: peers then copy with it by mapping that
    // memory instead of by cross-memory attach.
    ShareableRegion src_region;
    ShareableRegion dst_region;
    // ShareableFreedCount() in the owner when it arrived: a peer that sees
    // it change drops its mappings of the regions the owner freed.
    uint64_t freed;
  } args[2];
};

// Segment header: a futex word that ranks sleep on once spinning stops
// paying, and the number of sleepers, so that publishers skip the wake
// system call when nobody sleeps.
struct alignas(128) ShmAllReduce::Shared {
  std::atomic<uint32_t> word;
  std::atomic<uint32_t> sleepers;
};

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHeader = 128;  // sizeof(Shared), rounded to its alignment
constexpr size_t kStagingCapacity = 1 << 20;
constexpr size_t kMostStagingBytes = size_t{1} << 30;
// Each rank allocates a landing buffer of this many bytes; more per CMA read
// gains nothing (the communicator's DDP_SHM_CHUNK_BYTES has the same bound).
constexpr size_t kMostChunkBytes = size_t{1} << 30;
// A barrier's count: none other can have it.
constexpr uint64_t kBarrierCount = ~uint64_t{0};
constexpr uint64_t kProbeValue = 0x6464702d636d6121ull;
// Control::failed while its owner rewrites the failure's code and message.
constexpr uint64_t kRewriting = ~uint64_t{0};
// A wait runs the watchdog once it has lasted this long.
constexpr auto kWatchdogAfter = std::chrono::milliseconds(1);
// How long a rank that gives up on a call waits for a peer to finish a
// write into its memory that it had already begun (at most kWritePiece
// bytes: a millisecond or two, unless the peer is stopped or starved).
constexpr auto kAbandonGrace = std::chrono::milliseconds(200);
// Writes into a peer's memory go in pieces of at most this many bytes, each
// checked against the peer having given up.
constexpr size_t kWritePiece = 4 << 20;
// Each peer's shareable regions kept mapped at once (see MapPeerBuffer).
// The mappings cost address space and page tables, not memory: the owner
// holds the pages anyway, and mappings of regions it freed go at its next
// call (ForgetFreedRegions).
constexpr size_t kMaxPeerMappings = 64;
constexpr uint64_t kMaxPeerMappedBytes = uint64_t{4} << 30;
// A full cache makes room only by evicting a region unused for this many
// calls; otherwise the new region goes through CMA.
constexpr uint64_t kMappingIdleCalls = 1000;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The watchdog period in the clock's unit, at most a century: a longer one
// (milliseconds::max() for "never") would overflow that conversion, and a
// clock reading plus it, into the past.
Clock::duration ClockPeriod(std::chrono::milliseconds period) {
  constexpr std::chrono::hours kLongest(24 * 365 * 100);
  return period >= kLongest ? Clock::duration(kLongest) : Clock::duration(period);
}

// Forks this process descends from since the first engine was made here,
// counted by a pthread_atfork child handler: an engine that finds more
// than when it was made runs in a forked child, whose mapping of the
// segment is still the parent's (MAP_SHARED), so a call would publish as
// the parent's rank and pair with the parent's peers. One relaxed load per
// call, where getpid() would be a system call.
std::atomic<uint64_t> forks_seen{0};
void CountForkInChild() { forks_seen.fetch_add(1, std::memory_order_relaxed); }
uint64_t ForksSeen() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, &CountForkInChild); });
  return forks_seen.load(std::memory_order_relaxed);
}

// Bytes of `blocks` blocks of `count` elements of `dtype`, or SIZE_MAX when
// that is more than an object can hold (more than PTRDIFF_MAX): such a
// call takes no staged path, and Arrive fails it on every rank
// (ArgumentsProblem) before anything is copied. Unchecked, a product that
// wrapped around to a few bytes took the staged path and folded `count`
// elements far past the staging buffers.
size_t BytesOf(size_t count, DataType dtype, size_t blocks = 1) {
  size_t bytes = 0;
  if (__builtin_mul_overflow(count, DataTypeSize(dtype), &bytes) ||
      __builtin_mul_overflow(bytes, blocks, &bytes) ||
      bytes > static_cast<size_t>(PTRDIFF_MAX)) {
    return SIZE_MAX;
  }
  return bytes;
}

// What is wrong with a call's arguments that every rank compared and found
// alike (so every rank fails it the same way); empty when nothing is.
// `blocks`: blocks of `count` elements per buffer (all-to-all, gather,
// scatter: the group's size). `reduces`: `op` is a ReduceOp.
std::string ArgumentsProblem(size_t count, DataType dtype, int32_t op, bool reduces,
                             size_t blocks) {
  const std::string prefix = "shared-memory call: ";
  if (DataTypeSize(dtype) == 0) {
    return prefix + "dtype " + std::to_string(static_cast<int>(dtype)) + " is not a DataType";
  }
  if (reduces && (op < static_cast<int32_t>(ReduceOp::kSum) ||
                  op > static_cast<int32_t>(ReduceOp::kProd))) {
    return prefix + "op " + std::to_string(op) + " is not a ReduceOp";
  }
  if (BytesOf(count, dtype, blocks) == SIZE_MAX) {
    return prefix + (blocks > 1 ? std::to_string(blocks) + " blocks of " : "") +
           std::to_string(count) + " elements of " + DataTypeName(dtype) +
           " overflow the address space";
  }
  return "";
}

// A rank's verdict on its own options in the store (Create) starts with
// this mark when it refused them, followed by its error message.
constexpr char kRefusedMark = '!';

// How messages about `options` name group rank `rank`: by its name (its
// rank in the job) when the names are usable, else by its rank in the
// group ("local rank" where a names list was given but cannot be used).
std::string NameOf(const ShmOptions& options, int rank) {
  if (rank >= 0 && rank < options.size &&
      static_cast<int>(options.names.size()) == options.size) {
    return "rank " + std::to_string(options.names[static_cast<size_t>(rank)]);
  }
  return (options.names.empty() ? "rank " : "local rank ") + std::to_string(rank);
}

// What is wrong with one rank's options, naming the rank and the option;
// empty when nothing is.
std::string OptionsProblem(const ShmOptions& options) {
  const std::string prefix = "shared-memory group: ";
  const std::string who = prefix + NameOf(options, options.rank) + ": ";
  if (options.size < 1 || options.size >= (1 << 16) - 1) {
    return who + "size " + std::to_string(options.size) + " is outside [1, " +
           std::to_string((1 << 16) - 2) + "]";
  }
  if (options.rank < 0 || options.rank >= options.size) {
    return prefix + "rank " + std::to_string(options.rank) + " is outside a group of " +
           std::to_string(options.size);
  }
  if (static_cast<int>(options.pids.size()) != options.size) {
    return who + std::to_string(options.pids.size()) + " pids for a group of " +
           std::to_string(options.size);
  }
  for (int q = 0; q < options.size; ++q) {
    const int pid = options.pids[static_cast<size_t>(q)];
    if (pid <= 0) {
      return who + "pids holds " + std::to_string(pid) + " for " + NameOf(options, q) +
             ", which is not a process id";
    }
  }
  // Names only go into messages, but a short list named some ranks by
  // their job rank and the rest by their group rank, so an error could
  // blame the wrong process.
  if (!options.names.empty() && static_cast<int>(options.names.size()) != options.size) {
    return who + std::to_string(options.names.size()) + " names for a group of " +
           std::to_string(options.size) + " (one per rank, or none)";
  }
  // Two areas of this per rank are mapped: a larger one would make the
  // segment's size wrap around (2^62 gave one page, and the first staged
  // call wrote past it).
  if (options.staging_bytes > kMostStagingBytes) {
    return who + "staging_bytes (DDP_SHM_STAGING_BYTES) of " +
           std::to_string(options.staging_bytes) + " is more than the most, " +
           std::to_string(kMostStagingBytes);
  }
  if (options.chunk_bytes > kMostChunkBytes) {
    return who + "chunk_bytes (DDP_SHM_CHUNK_BYTES) of " + std::to_string(options.chunk_bytes) +
           " is more than the most, " + std::to_string(kMostChunkBytes);
  }
  // A wait sleeps this long at most between looks at the deadline and the
  // watchdog: zero or less made it poll the futex without sleeping.
  if (options.watchdog_period <= std::chrono::milliseconds(0)) {
    return who + "watchdog_period of " + std::to_string(options.watchdog_period.count()) +
           " ms is not positive";
  }
  return "";
}

// Control::touching's value while writing into `peer`'s memory in `call`; group
// sizes stay below 2^16 (checked in Create).
uint64_t Touching(uint64_t call, int peer) { return (call << 16) | static_cast<uint64_t>(peer + 1); }

void Slice(size_t count, size_t elem, int size, int rank, size_t& begin, size_t& end) {
  const SliceRange range = SliceOf(count, elem, size, rank);
  begin = range.begin;
  end = range.end;
}

// Whether the process behind pidfd `fd` exits within `within`. A signal
// caught meanwhile (Ctrl-C, SIGCHLD from a data worker, a profiler's
// SIGPROF; poll is never restarted) ends poll with EINTR: the wait goes on
// for the time left, since taking the peer for alive would report one
// killed mid-copy as a bad buffer.
bool PidfdReadableWithin(int fd, std::chrono::milliseconds within) {
  const auto until = std::chrono::steady_clock::now() + within;
  while (true) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    if (ready > 0) return true;
    if (ready == 0 || errno != EINTR || left.count() <= 0) return false;
  }
}

}  // namespace

namespace internal {

bool ProcessExitsWithin(int pid, std::chrono::milliseconds within) {
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd >= 0) {
    const bool exited = PidfdReadableWithin(fd, within);
    close(fd);
    return exited;
  }
  if (errno == ESRCH) return true;
  // No pidfd to be had (ENOSYS before Linux 5.3, EMFILE with every
  // descriptor in use): look at the process itself, every millisecond.
  // Taking it for alive would report a peer killed mid-copy as a bad
  // buffer, and make Abandon spin until its grace ran out.
  const auto until = std::chrono::steady_clock::now() + within;
  while (true) {
    if (fault::ProcessGoneNow(pid)) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace internal

SliceRange SliceOf(size_t count, size_t elem, int size, int rank) {
  const size_t per_line = std::max<size_t>(1, 64 / std::max<size_t>(1, elem));
  const size_t block = RoundUp((count + size - 1) / size, per_line);
  return {std::min(count, block * rank), std::min(count, block * (rank + 1))};
}

std::string ShmAllReduce::RankName(int rank) const {
  const bool named = static_cast<size_t>(rank) < options_.names.size();
  return "rank " + std::to_string(named ? options_.names[static_cast<size_t>(rank)] : rank);
}

ShmAllReduce::Shared& ShmAllReduce::shared() const {
  return *static_cast<Shared*>(segment_->data());
}

ShmAllReduce::Control& ShmAllReduce::control(int rank) const {
  return reinterpret_cast<Control*>(static_cast<char*>(segment_->data()) + kHeader)[rank];
}

// Each rank's staging area holds two buffers, for even and odd calls, by the
// same argument as Control::args.
char* ShmAllReduce::staging(int rank, uint64_t call) const {
  const size_t controls = RoundUp(kHeader + sizeof(Control) * options_.size, kPage);
  return static_cast<char*>(segment_->data()) + controls + staging_capacity_ * rank +
         (call % 2) * (staging_capacity_ / 2);
}

ShmAllReduce::ShmAllReduce(std::unique_ptr<Segment> segment, const ShmOptions& options,
                           size_t staging_capacity)
    : segment_(std::move(segment)), options_(options), staging_capacity_(staging_capacity) {
  owner_pid_ = static_cast<int>(getpid());
  forks_at_creation_ = ForksSeen();
  chunk_.resize(std::max<size_t>(options_.chunk_bytes, kPage));
  peer_mappings_.resize(static_cast<size_t>(options_.size));
  // A pidfd stays with the process it was opened on: once a peer died and
  // another process took its pid, the pid alone names that other one.
  peer_pidfds_.assign(static_cast<size_t>(options_.size), -1);
  pid_checked_in_call_.assign(static_cast<size_t>(options_.size), ~uint64_t{0});
  for (int peer = 0; peer < options_.size; ++peer) {
    const int pid = options_.pids[peer];
    if (peer == options_.rank || pid <= 0 || pid == getpid()) continue;
    peer_pidfds_[peer] = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  }
}

Status ShmAllReduce::PeerExited(int peer) const {
  return PeerLostError(RankName(peer) + " (pid " + std::to_string(options_.pids[peer]) + ") exited");
}

// A process being killed tears down its memory before it is reported as
// exited, and cross-memory attach in that window fails with EFAULT, as if
// the buffer were freed: hence the wait.
bool ShmAllReduce::PeerExitsWithin(int peer, std::chrono::milliseconds within) const {
  const int fd = peer_pidfds_[peer];
  if (fd < 0) return internal::ProcessExitsWithin(options_.pids[peer], within);
  return PidfdReadableWithin(fd, within);
}

ShmAllReduce::~ShmAllReduce() {
  for (int fd : peer_pidfds_) {
    if (fd >= 0) close(fd);
  }
  for (const PeerMappings& cache : peer_mappings_) {
    for (const PeerMapping& m : cache.lru) {
      if (m.local != nullptr) munmap(m.local, m.size);
    }
  }
}

ShmAllReduce::MappingStats ShmAllReduce::mapping_stats() const {
  MappingStats stats;
  for (const PeerMappings& cache : peer_mappings_) {
    for (const PeerMapping& m : cache.lru) {
      if (m.local == nullptr) continue;
      ++stats.regions;
      stats.bytes += m.size;
    }
  }
  stats.maps = maps_made_;
  return stats;
}

void ShmAllReduce::set_staging_bytes(size_t bytes) {
  options_.staging_bytes = std::min(bytes, staging_capacity_ / 2);
}

StatusOr<std::unique_ptr<ShmAllReduce>> ShmAllReduce::Create(store::Store& store,
                                                             const std::string& key_prefix,
                                                             const ShmOptions& options,
                                                             Deadline deadline) {
  // Every rank checks its own options and posts its verdict, then reads
  // every rank's before anything else: a rank that refused its options
  // alone used to return at once while its peers waited for it in the
  // segment's set-up until their deadline. Now they all fail together,
  // with the refusing rank's message (which names it and the option).
  // The verdict also carries the group's size, so ranks that disagree on
  // it fail at once too (each reads the verdicts of the ranks it counts).
  const std::string verdict_key = key_prefix + "options/";
  const std::string problem = OptionsProblem(options);
  if (!problem.empty()) {
    const Status error = InvalidArgumentError(problem);
    // Best effort, within the deadline: a store that fails here fails the
    // peers too. A negative rank has no slot that a peer reads.
    if (options.rank >= 0) {
      store.Set(verdict_key + std::to_string(options.rank), kRefusedMark + error.message(),
                deadline)
          .IgnoreError();
    }
    return error;
  }
  const std::string my_verdict = "ok " + std::to_string(options.size);
  DDP_RETURN_IF_ERROR(store.Set(verdict_key + std::to_string(options.rank), my_verdict, deadline));
  {
    std::vector<std::string> keys;
    keys.reserve(static_cast<size_t>(options.size));
    for (int r = 0; r < options.size; ++r) keys.push_back(verdict_key + std::to_string(r));
    DDP_ASSIGN_OR_RETURN(const std::vector<std::string> verdicts, store.MultiGet(keys, deadline));
    for (int r = 0; r < options.size; ++r) {
      const std::string& theirs = verdicts[static_cast<size_t>(r)];
      if (!theirs.empty() && theirs[0] == kRefusedMark) return InvalidArgumentError(theirs.substr(1));
      if (theirs != my_verdict) {
        return InvalidArgumentError("shared-memory group: ranks disagree on the group's size: " +
                                    NameOf(options, options.rank) + " has " +
                                    std::to_string(options.size) + ", " + NameOf(options, r) +
                                    " has " +
                                    (theirs.starts_with("ok ") ? theirs.substr(3) : "'" + theirs + "'"));
      }
    }
  }
  // The staging area's size (the segment's layout) and the limits that
  // choose each call's path must be the same on every rank: a call staged
  // on one rank and read directly on another gives wrong results, and a
  // rank that sizes the staging areas larger than rank 0 did maps past the
  // segment's end. So rank 0's are in force: it publishes them and the
  // others adopt them (with the chunk size, so that every rank cuts
  // AllReduceApply's pieces alike).
  ShmOptions agreed = options;
  size_t staging_capacity = 0;
  const std::string layout_key = key_prefix + "layout";
  if (options.rank == 0) {
    staging_capacity = std::max(kStagingCapacity, 2 * RoundUp(options.staging_bytes, kPage));
    agreed.staging_bytes = std::min(options.staging_bytes, staging_capacity / 2);
    DDP_RETURN_IF_ERROR(store.Set(layout_key,
                                  std::to_string(staging_capacity) + " " +
                                      std::to_string(agreed.staging_bytes) + " " +
                                      std::to_string(agreed.rooted_staging_bytes) + " " +
                                      std::to_string(agreed.chunk_bytes),
                                  deadline));
  } else {
    DDP_ASSIGN_OR_RETURN(const std::string layout, store.Get(layout_key, deadline));
    if (std::sscanf(layout.c_str(), "%zu %zu %zu %zu", &staging_capacity, &agreed.staging_bytes,
                    &agreed.rooted_staging_bytes, &agreed.chunk_bytes) != 4) {
      return InternalError("shared-memory group: rank 0 published the layout '" + layout + "'");
    }
  }
  static_assert(sizeof(Shared) <= kHeader);
  const size_t bytes = RoundUp(kHeader + sizeof(Control) * options.size, kPage) +
                       staging_capacity * options.size;
  DDP_ASSIGN_OR_RETURN(std::unique_ptr<Segment> segment,
                       Segment::CreateShared(store, key_prefix + "segment/", options.rank,
                                             options.size, bytes, deadline));
  std::unique_ptr<ShmAllReduce> engine(new ShmAllReduce(std::move(segment), agreed,
                                                        staging_capacity));

  // CMA needs ptrace permission between the ranks (Yama, containers and
  // seccomp may deny it). Every rank probes every peer and posts the
  // verdict; all ranks then take the same decision.
  engine->call_deadline_ = deadline;  // the probe's copies keep to set-up's deadline
  static uint64_t probe_word = kProbeValue;
  Control& mine = engine->control(options.rank);
  mine.probe = reinterpret_cast<uint64_t>(&probe_word);
  DDP_RETURN_IF_ERROR(store.Set(key_prefix + "probe_ready/" + std::to_string(options.rank), "1",
                                deadline));
  // One store round trip for all peers, here and for the verdicts below
  // (a Get per peer cost a round trip each).
  std::vector<std::string> ready_keys;
  for (int peer = 0; peer < options.size; ++peer) {
    if (peer != options.rank) ready_keys.push_back(key_prefix + "probe_ready/" + std::to_string(peer));
  }
  DDP_RETURN_IF_ERROR(store.Wait(ready_keys, deadline));
  std::string verdict = "ok";
  for (int peer = 0; peer < options.size; ++peer) {
    if (peer == options.rank) continue;
    uint64_t value = 0;
    Status read = engine->ReadFromPeer(peer, &value, engine->control(peer).probe, sizeof(value));
    if (!read.ok() || value != kProbeValue) {
      verdict = engine->RankName(options.rank) + " cannot read " + engine->RankName(peer) +
                "'s memory: " +
                (read.ok() ? std::string("wrong value") : read.message());
      break;
    }
  }
  DDP_RETURN_IF_ERROR(store.Set(key_prefix + "probe/" + std::to_string(options.rank), verdict,
                                deadline));
  std::vector<std::string> verdict_keys;
  for (int peer = 0; peer < options.size; ++peer) {
    verdict_keys.push_back(key_prefix + "probe/" + std::to_string(peer));
  }
  DDP_ASSIGN_OR_RETURN(const std::vector<std::string> verdicts, store.MultiGet(verdict_keys, deadline));
  for (const std::string& theirs : verdicts) {
    if (theirs != "ok") return UnavailableError("cross-memory attach unavailable: " + theirs);
  }
  return engine;
}

// Copies between this process and a peer's memory for the current call,
// unless the peer has left it (see Abandon). A read is checked before and
// after: a peer that gave up while it ran may have reused its buffer, so
// the read fails. A copy by pid (CMA) is trusted only while the peer's
// pidfd shows it alive: a read after, a write before and after. A write
// must not land after the peer returned at all:
// each piece is marked in `touching`, then the peer's `abandoned` word is
// checked; Abandon stores that word and then checks `touching`, both
// sequentially consistent, so either this rank sees the peer gone and does
// not write, or the peer sees the write and waits for it to end.
Status ShmAllReduce::CopyWithPeer(bool write, int peer, void* local, uint64_t remote,
                                  size_t bytes) const {
  const uint64_t s = sequence_;
  auto gone = [&] { return Abandoned(peer); };
  // The peer's buffer mapped here (shareable memory), else null: CMA.
  char* mapped = sequence_ > 0 ? MapPeerBuffer(peer, remote, bytes) : nullptr;
  if (mapped != nullptr) ++mapped_copies_;
  // A copy that failed because the peer gave up meanwhile (and took its
  // buffer back) fails with the peer's error, not as a bad buffer.
  auto failed = [&](int error) {
    return gone() ? PeerFailure(s, peer) : CopyError(write, peer, error, local, bytes);
  };
  if (!write) {
    if (gone()) return PeerFailure(s, peer);
    if (mapped != nullptr) {
      std::memcpy(local, mapped, bytes);
    } else if (const int error = CopyBytes(false, peer, local, remote, bytes); error != 0) {
      return failed(error);
    } else if (peer_pidfds_[peer] >= 0 && PeerExitsWithin(peer, std::chrono::milliseconds(0))) {
      // Read by pid: if the peer has exited, another process may have
      // taken its pid and the bytes be that one's.
      return PeerExited(peer);
    }
    return gone() ? PeerFailure(s, peer) : Status::Ok();
  }
  // A write by pid into a peer that has exited lands in whatever process
  // took its pid since. The pidfd is asked after the last piece, so that a
  // call whose write may have landed there fails, as a read does; and
  // before the call's first write to the peer, so that one gone already
  // is not written into (a later write's check before is the previous
  // one's after). A poll per piece (or per chunk) cost a system call each
  // and still left the window between the check and the write.
  const bool by_pid = mapped == nullptr && peer_pidfds_[peer] >= 0;
  if (by_pid && pid_checked_in_call_[peer] != s) {
    if (PeerExitsWithin(peer, std::chrono::milliseconds(0))) return PeerExited(peer);
    pid_checked_in_call_[peer] = s;
  }
  std::atomic<uint64_t>& touching = control(options_.rank).touching;
  char* here = static_cast<char*>(local);
  for (size_t done = 0; done < bytes;) {
    const size_t n = std::min(kWritePiece, bytes - done);
    touching.store(Touching(s, peer), std::memory_order_seq_cst);
    const bool left = gone();
    int error = 0;
    if (!left && mapped != nullptr) {
      std::memcpy(mapped + done, here + done, n);
    } else if (!left) {
      error = CopyBytes(true, peer, here + done, remote + done, n);
    }
    touching.store(0, std::memory_order_release);
    if (left) return PeerFailure(s, peer);
    if (error != 0) return failed(error);
    done += n;
  }
  if (by_pid && PeerExitsWithin(peer, std::chrono::milliseconds(0))) return PeerExited(peer);
  return Status::Ok();
}

bool ShmAllReduce::Abandoned(int peer) const {
  const uint64_t call = control(peer).abandoned.load(std::memory_order_seq_cst);
  return call != 0 && call >= sequence_;
}

namespace {

// Whether the fd link `link` (/proc/PID/fd/N) names a memfd that
// AllocateShareable made: it reads "/memfd:<name> (deleted)". Reading it
// opens nothing.
bool LinksToShareableMemfd(const std::string& link) {
  char target[128];
  const ssize_t n = readlink(link.c_str(), target, sizeof(target));
  if (n <= 0) return false;
  const std::string name = std::string("/memfd:") + kShareableMemfdName;
  const std::string_view found(target, static_cast<size_t>(n));
  return found == name || found.starts_with(name + " ");
}

}  // namespace

// Each peer's mapped regions are an LRU list of at most kMaxPeerMappings
// regions and kMaxPeerMappedBytes bytes. A full list makes room only by
// evicting a region unused for kMappingIdleCalls calls: a working set
// larger than the cap, visited in turn, then keeps the regions it has
// mapped and copies with the rest through CMA, instead of mapping and
// unmapping a region at every access (open, mmap, page faults, munmap and
// its TLB shootdown: slower than CMA).
char* ShmAllReduce::MapPeerBuffer(int peer, uint64_t remote, size_t bytes) const {
  const Control::Args& args = control(peer).args[sequence_ % 2];
  const ShareableRegion* region = nullptr;
  for (const ShareableRegion* r : {&args.src_region, &args.dst_region}) {
    if (r->id != 0 && remote >= r->base && remote - r->base <= r->size &&
        bytes <= r->size - (remote - r->base)) {
      region = r;
    }
  }
  if (region == nullptr) return nullptr;
  PeerMappings& cache = peer_mappings_[static_cast<size_t>(peer)];
  std::vector<PeerMapping>& lru = cache.lru;
  // Most recently used last: a call's lookups (one per chunk) hit at once.
  auto hit = std::find_if(lru.rbegin(), lru.rend(),
                          [&](const PeerMapping& m) { return m.id == region->id; });
  if (hit != lru.rend()) {
    auto it = std::prev(hit.base());
    std::rotate(it, it + 1, lru.end());
    PeerMapping& found = lru.back();
    found.last_call = sequence_;
    return found.local == nullptr ? nullptr : found.local + (remote - region->base);
  }
  if (region->size > kMaxPeerMappedBytes) return nullptr;
  while (!lru.empty() && (lru.size() >= kMaxPeerMappings ||
                          cache.bytes + region->size > kMaxPeerMappedBytes)) {
    const PeerMapping& oldest = lru.front();
    if (oldest.last_call + kMappingIdleCalls >= sequence_) return nullptr;  // CMA
    if (oldest.local != nullptr) {
      munmap(oldest.local, oldest.size);
      cache.bytes -= oldest.size;
    }
    lru.erase(lru.begin());
  }
  PeerMapping m{.id = region->id, .size = region->size, .fd = region->fd,
                .last_call = sequence_};
  // The owner's memfd, through its fd table: permitted where CMA is (the
  // same ptrace check). Failing that, this region goes through CMA. The
  // number may name another file by now, and an open acts on some files
  // whether or not it waits (it breaks a lease, signalling its holder; a
  // device's driver runs): so the link and the file's size are looked at
  // first (readlink and stat open nothing), and only a memfd of
  // AllocateShareable's of the region's size is opened. O_NONBLOCK and
  // O_NOCTTY for a file that replaced it in between: no wait for a lease's
  // break (45 s by default), no terminal becoming this process's.
  const std::string path = "/proc/" + std::to_string(options_.pids[peer]) + "/fd/" +
                           std::to_string(region->fd);
  struct stat seen {};
  const bool matches = LinksToShareableMemfd(path) && stat(path.c_str(), &seen) == 0 &&
                       S_ISREG(seen.st_mode) &&
                       static_cast<uint64_t>(seen.st_size) == region->size;
  const int fd = matches ? open(path.c_str(), O_RDWR | O_CLOEXEC | O_NONBLOCK | O_NOCTTY) : -1;
  if (fd >= 0) {
    struct stat st {};
    // What this process opened must be the file looked at (the peer may
    // have reused the number in between), and still a memfd of
    // AllocateShareable's (named so by its link here).
    // And the pid must still have been the peer's when it was opened: the
    // peer's pidfd shows it alive now. Another process that took the pid
    // of a peer that died (a restarted rank of the same program) may hold
    // such a memfd of that size under that number too.
    if (fstat(fd, &st) == 0 && st.st_dev == seen.st_dev && st.st_ino == seen.st_ino &&
        static_cast<uint64_t>(st.st_size) == region->size &&
        LinksToShareableMemfd("/proc/self/fd/" + std::to_string(fd)) &&
        !(peer_pidfds_[peer] >= 0 && PeerExitsWithin(peer, std::chrono::milliseconds(0)))) {
      m.device = st.st_dev;
      m.inode = st.st_ino;
      void* p = mmap(nullptr, region->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        m.local = static_cast<char*>(p);
        ++maps_made_;
      }
    }
    close(fd);
  }
  lru.push_back(m);
  if (m.local != nullptr) cache.bytes += m.size;
  return m.local == nullptr ? nullptr : m.local + (remote - region->base);
}

// A peer's mapping keeps the pages of a region alive after the owner freed
// it (DDP frees its old buckets when it rebuilds them), and a cache that
// evicted only to make room would keep them for the rest of the job. So
// each rank publishes how many regions it has freed with every call, and
// when that changes the peers check each mapping of its regions: one whose
// fd the owner closed (or reused for another file) is unmapped.
void ShmAllReduce::ForgetFreedRegions(uint64_t call, int only) const {
  for (int peer = 0; peer < options_.size; ++peer) {
    if (peer == options_.rank || (only >= 0 && peer != only)) continue;
    PeerMappings& cache = peer_mappings_[static_cast<size_t>(peer)];
    if (cache.lru.empty()) continue;
    const uint64_t freed = control(peer).args[call % 2].freed;
    if (freed == cache.freed_seen) continue;
    cache.freed_seen = freed;
    const std::string dir = "/proc/" + std::to_string(options_.pids[peer]) + "/fd/";
    std::erase_if(cache.lru, [&](const PeerMapping& m) {
      struct stat st {};
      const bool alive = m.inode != 0 && stat((dir + std::to_string(m.fd)).c_str(), &st) == 0 &&
                         st.st_dev == m.device && st.st_ino == m.inode;
      if (alive) return false;
      if (m.local != nullptr) {
        munmap(m.local, m.size);
        cache.bytes -= m.size;
      }
      return true;
    });
  }
}

// process_vm_readv / process_vm_writev, resuming after partial transfers.
int ShmAllReduce::CopyBytes(bool write, int peer, void* local, uint64_t remote,
                            size_t bytes) const {
  char* here = static_cast<char*>(local);
  while (bytes > 0) {
    iovec local_iov{here, bytes};
    iovec remote_iov{reinterpret_cast<void*>(remote), bytes};
    const ssize_t n = write ? process_vm_writev(options_.pids[peer], &local_iov, 1, &remote_iov, 1, 0)
                            : process_vm_readv(options_.pids[peer], &local_iov, 1, &remote_iov, 1, 0);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return n < 0 ? errno : EIO;
    }
    here += n;
    remote += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
  return 0;
}

namespace {

// Whether this process can read [local, local + bytes) (`need_write`:
// write it). CMA's EFAULT does not say whose range was bad; this one is
// probed by copying it within this process (onto itself to test writing,
// into a scratch buffer to test reading), which faults where it is bad.
bool LocalRangeUsable(void* local, size_t bytes, bool need_write) {
  const pid_t self = getpid();
  char* p = static_cast<char*>(local);
  std::vector<char> scratch(need_write ? 0 : std::min<size_t>(bytes, 64 << 10));
  for (size_t done = 0; done < bytes;) {
    const size_t n = need_write ? bytes - done : std::min(scratch.size(), bytes - done);
    iovec range{p + done, n};
    iovec into = need_write ? range : iovec{scratch.data(), n};
    const ssize_t moved = process_vm_readv(self, &into, 1, &range, 1, 0);
    if (moved < 0 && errno == EINTR) continue;
    if (moved <= 0) return false;
    done += static_cast<size_t>(moved);
  }
  return true;
}

}  // namespace

Status ShmAllReduce::CopyError(bool write, int peer, int error, void* local, size_t bytes) const {
  // This rank's own buffer first: a short or read-only one is this rank's
  // error, not the peer's (and needs no wait for the peer's exit).
  if (error == EFAULT && !LocalRangeUsable(local, bytes, /*need_write=*/!write)) {
    return InvalidArgumentError(RankName(options_.rank) + "'s own buffer is not " +
                                (write ? "readable" : "writable") + " for the call's " + std::to_string(bytes) +
                                " bytes (shorter than the count, or " + (write ? "unmapped" : "read-only") + "?)");
  }
  // A peer being killed fails copies with EFAULT before it is seen to
  // exit: up to 500 ms for that, never past the call's deadline.
  constexpr std::chrono::milliseconds kExitWait(500);
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::max<Clock::duration>(call_deadline_ - Clock::now(), Clock::duration::zero()));
  if (error == ESRCH || (error == EFAULT && PeerExitsWithin(peer, std::min(left, kExitWait)))) {
    return PeerExited(peer);
  }
  // A wait the deadline cut short tells a bad buffer from a dying peer no
  // more: the deadline's code, not the caller-error one (a peer killed near
  // the deadline is no bad argument of the caller's).
  if (error == EFAULT && left < kExitWait) {
    return TimedOutError(RankName(peer) + "'s buffer could not be " + (write ? "written" : "read") +
                         " and the deadline left " + std::to_string(left.count()) +
                         " ms to wait for its exit: its process may be exiting (or it freed the "
                         "buffer during the call)");
  }
  if (error == EFAULT) {
    return InvalidArgumentError(RankName(peer) + "'s buffer is not " +
                                (write ? "writable" : "readable") + " (freed during the call?)");
  }
  return UnavailableError(std::string(write ? "writing " : "reading ") + RankName(peer) +
                          "'s memory: " + std::strerror(error));
}

void ShmAllReduce::Publish(std::atomic<uint64_t> Control::*field, uint64_t value) {
  // Sequentially consistent store then load, paired with WaitFor's
  // increment then load: either a sleeper sees the new value before it
  // sleeps, or this rank sees the sleeper and wakes it.
  (control(options_.rank).*field).store(value, std::memory_order_seq_cst);
  Shared& shared_area = shared();
  if (shared_area.sleepers.load(std::memory_order_seq_cst) > 0) {
    shared_area.word.fetch_add(1, std::memory_order_release);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&shared_area.word), FUTEX_WAKE, INT32_MAX,
            nullptr, nullptr, 0);
  }
}

Status ShmAllReduce::WaitFor(std::atomic<uint64_t> Control::*field, uint64_t value, int only,
                             Deadline deadline, const std::function<Status(Deadline, int)>& watchdog,
                             const char* phase) {
  // Spin while the peer is likely running (a core each: it publishes within
  // microseconds); then yield between polls, which on a busy machine lets
  // whoever must run have the core yet keeps this rank runnable (measured
  // better than sleeping: a woken rank waits out other tasks' slices); after
  // a millisecond, sleep on the futex so that a long wait (a slow rank)
  // costs no CPU that compute threads could use.
  //
  // A long spin (250 us) measured better than a short one (50 us) on the
  // busy 2-core machine: median 4 KiB all-reduce 2.3 us against 58 us over
  // 7 runs each (docs/benchmarks.md), since a rank that keeps its core stays
  // co-scheduled with its peer.
  const Clock::duration spin_for =
      options_.yield_when_idle ? Clock::duration(std::chrono::microseconds(2))
                               : Clock::duration(options_.spin_time);
  const Clock::duration period = ClockPeriod(options_.watchdog_period);
  const Clock::time_point started = Clock::now();
  Shared& shared_area = shared();
  // Adds the time waited to peer_wait_ns_ on every way out, if a peer was
  // not there at the first look (a wait that finds everyone there costs no
  // second clock read).
  struct Tally {
    std::atomic<uint64_t>& total;
    Clock::time_point started;
    bool waited = false;
    ~Tally() {
      if (!waited) return;
      total.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                Clock::now() - started).count()),
                      std::memory_order_relaxed);
    }
  } tally{peer_wait_ns_, started};
  for (int peer = 0; peer < options_.size; ++peer) {
    if (peer == options_.rank || (only >= 0 && peer != only)) continue;
    const std::atomic<uint64_t>& counter = control(peer).*field;
    uint32_t spins = 0;
    Clock::time_point next_exit_check = started + kWatchdogAfter;
    while (counter.load(std::memory_order_acquire) < value) {
      tally.waited = true;
      if ((++spins & 63) != 0) {
        _mm_pause();
        continue;
      }
      const Clock::time_point now = Clock::now();
      if (now >= deadline) {
        return TimedOutError("shared-memory collective: waiting for " + RankName(peer) + " to " +
                             phase + " (call " +
                             std::to_string(value) + "): deadline passed");
      }
      const Clock::duration waited = now - started;
      // The watchdog asks the store, a round trip to another process that
      // gives up this core; on a busy machine the core may then go to other
      // tasks for a whole time slice (seen: 8.8 ms inside a loop of 8 us
      // all-reduces). So it runs only in waits already long enough to sleep,
      // at most once per period across calls: a failed peer makes waits
      // long, and a call that completes quickly needs no news of failures.
      if (watchdog && waited >= kWatchdogAfter && now >= next_watchdog_) {
        next_watchdog_ = now + period;
        Status health = watchdog(deadline, peer);
        if (!health.ok()) {
          if (counter.load(std::memory_order_acquire) >= value) break;
          return health;
        }
      }
      if (waited < spin_for) continue;
      if (waited < std::chrono::milliseconds(1)) {
        sched_yield();
        continue;
      }
      // Without a watchdog, a peer whose process exited held the wait until
      // its deadline (TIMED_OUT): its pidfd (one poll) is looked at once
      // per period while the wait sleeps, and its exit is PEER_LOST; the
      // counter is read once more first, as a peer that published and then
      // exited did its part. A watchdog alone decides otherwise: it may
      // know why the peer left (the communicator's names the reason a peer
      // posted before it exited, where this would only say it exited).
      if (!watchdog && peer_pidfds_[peer] >= 0 && now >= next_exit_check) {
        next_exit_check = now + period;
        if (PeerExitsWithin(peer, std::chrono::milliseconds(0))) {
          if (counter.load(std::memory_order_acquire) >= value) break;
          return PeerExited(peer);
        }
      }
      const uint32_t seen = shared_area.word.load(std::memory_order_acquire);
      shared_area.sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (counter.load(std::memory_order_seq_cst) < value) {
        // Bounded sleep: the deadline and the watchdog still run.
        const auto left = std::min<Clock::duration>(deadline - now, period);
        timespec timeout{};
        timeout.tv_sec = std::chrono::duration_cast<std::chrono::seconds>(left).count();
        timeout.tv_nsec = (std::chrono::duration_cast<std::chrono::nanoseconds>(left) -
                           std::chrono::seconds(timeout.tv_sec)).count();
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&shared_area.word), FUTEX_WAIT, seen,
                &timeout, nullptr, 0);
      }
      shared_area.sleepers.fetch_sub(1, std::memory_order_relaxed);
    }
  }
  return Status::Ok();
}

Status ShmAllReduce::CheckAgreement(uint64_t call, size_t count, DataType dtype, int32_t op,
                                    Kind kind, int32_t root, int only) const {
  auto describe = [](size_t n, DataType t, int32_t o, int32_t k, int32_t from) {
    const std::string what = "count " + std::to_string(n) + " " + DataTypeName(t);
    const std::string to_root = " to root " + std::to_string(from);
    if (k == static_cast<int32_t>(Kind::kBroadcast)) return "broadcast " + what + " from root " + std::to_string(o);
    if (k == static_cast<int32_t>(Kind::kBarrier)) return std::string("barrier");
    if (k == static_cast<int32_t>(Kind::kAllToAll)) return "all-to-all " + what;
    if (k == static_cast<int32_t>(Kind::kGather)) return "gather " + what + to_root;
    if (k == static_cast<int32_t>(Kind::kScatter)) return "scatter " + what + " from root " + std::to_string(from);
    if (k == static_cast<int32_t>(Kind::kReduce)) {
      return "reduce " + what + " " + ReduceOpName(static_cast<ReduceOp>(o)) + to_root;
    }
    return "all-reduce " + what + " " + ReduceOpName(static_cast<ReduceOp>(o)) +
           (k == static_cast<int32_t>(Kind::kThrough) ? " (hierarchical)"
            : k == static_cast<int32_t>(Kind::kApply) ? " (through a slice function)"
                                                       : "");
  };
  for (int peer = 0; peer < options_.size; ++peer) {
    if (only >= 0 && peer != only) continue;
    const Control::Args& theirs = control(peer).args[call % 2];
    if (theirs.count != count || theirs.dtype != static_cast<int32_t>(dtype) || theirs.op != op ||
        theirs.kind != static_cast<int32_t>(kind) || theirs.root != root) {
      const std::string collective = kind == Kind::kBroadcast  ? "broadcast"
                                     : kind == Kind::kBarrier  ? "barrier"
                                     : kind == Kind::kAllToAll ? "all-to-all"
                                     : kind == Kind::kReduce   ? "reduce"
                                     : kind == Kind::kGather   ? "gather"
                                     : kind == Kind::kScatter  ? "scatter"
                                                               : "all-reduce";
      return InvalidArgumentError(
          collective + " arguments differ across ranks: " + RankName(options_.rank) + " passed " +
          describe(count, dtype, op, static_cast<int32_t>(kind), root) + ", " + RankName(peer) +
          " passed " +
          describe(theirs.count, static_cast<DataType>(theirs.dtype), theirs.op, theirs.kind,
                   theirs.root));
    }
  }
  return Status::Ok();
}

StatusOr<uint64_t> ShmAllReduce::Arrive(const void* send, void* recv, size_t count,
                                        DataType dtype, int32_t op, Kind kind, int32_t root,
                                        bool direct, Deadline deadline,
                                        const std::function<Status(Deadline, int)>& watchdog,
                                        int wait_for) {
  const uint64_t s = ++sequence_;
  Control::Args& args = control(options_.rank).args[s % 2];
  args.src = reinterpret_cast<uint64_t>(send);
  args.dst = reinterpret_cast<uint64_t>(recv);
  args.count = count;
  args.dtype = static_cast<int32_t>(dtype);
  args.op = op;
  args.kind = static_cast<int32_t>(kind);
  args.root = root;
  args.direct = direct ? 1 : 0;
  // Staged calls never copy with a peer's buffers: no lookup (a lock) for
  // them. Without a region peers use CMA, so skipping is always safe.
  const size_t bytes = BytesOf(count, dtype);
  const bool lookup = direct && bytes != SIZE_MAX;
  args.src_region = lookup ? FindShareable(send, bytes).value_or(ShareableRegion{}) : ShareableRegion{};
  args.dst_region = lookup ? FindShareable(recv, bytes).value_or(ShareableRegion{}) : ShareableRegion{};
  args.freed = ShareableFreedCount();
  Publish(&Control::arrived, s);
  DDP_RETURN_IF_ERROR(WaitFor(&Control::arrived, s, wait_for, deadline, watchdog, "arrive"));
  DDP_RETURN_IF_ERROR(UnclaimedFailure(s, wait_for));
  DDP_RETURN_IF_ERROR(CheckAgreement(s, count, dtype, op, kind, root, wait_for));
  for (int peer = 0; peer < options_.size; ++peer) {
    if (wait_for >= 0 && peer != wait_for) continue;
    if (control(peer).args[s % 2].direct == args.direct) continue;
    const int first = std::min(peer, options_.rank);
    const int second = std::max(peer, options_.rank);
    auto path = [&](int rank) {
      return control(rank).args[s % 2].direct != 0 ? "direct" : "staged";
    };
    return InvalidArgumentError(
        "shared-memory call of " + std::to_string(count) + " elements of " + DataTypeName(dtype) +
        ": " + RankName(first) + " takes the " + path(first) + " path, " + RankName(second) +
        " the " + path(second) +
        " path: their staging limits differ (set_staging_bytes must be alike on every rank)");
  }
  // Checked once the ranks agree on them, so that every rank fails alike
  // (one rank refusing alone would leave its peers waiting for it).
  const bool blocks = kind == Kind::kAllToAll || kind == Kind::kGather || kind == Kind::kScatter;
  const bool reduces = kind == Kind::kAllReduce || kind == Kind::kThrough ||
                       kind == Kind::kApply || kind == Kind::kReduce;
  if (const std::string problem = ArgumentsProblem(
          count, dtype, op, reduces, blocks ? static_cast<size_t>(options_.size) : 1);
      !problem.empty()) {
    return InvalidArgumentError(problem);
  }
  ForgetFreedRegions(s, wait_for);
  return s;
}

// Call t = sequence_ + 1 writes the staging buffer and arguments that call
// t - 2 used, so every rank must be done with call t - 2 first. Where every
// rank of call t - 1 waited for all to arrive, that holds already (a rank
// arrives at t - 1 only once it finished t - 2); but the staged rooted
// calls' other ranks wait for the root alone, so one may start t while a
// peer still reads what it staged for t - 2.
Status ShmAllReduce::ClaimSlot(Deadline deadline,
                               const std::function<Status(Deadline, int)>& watchdog) {
  if (sequence_ < 2) return Status::Ok();
  return WaitFor(&Control::finished, sequence_ - 1, -1, deadline, watchdog,
                 "finish an earlier call");
}

Status ShmAllReduce::UnclaimedFailure(uint64_t call, int only) const {
  for (int peer = 0; peer < options_.size; ++peer) {
    if (peer == options_.rank || (only >= 0 && peer != only)) continue;
    if (control(peer).unclaimed.load(std::memory_order_acquire) == call) {
      return PeerFailure(call, peer);
    }
  }
  return Status::Ok();
}

// A call that cannot claim its slot fails before it arrives, but its peers
// may be in it already, waiting for this rank. So it takes its number all
// the same, marks it failed and abandoned, and publishes its arrival with
// that failure alone (`unclaimed`): the peers fail the call at once with its
// error instead of at their deadline. Its staging buffer and arguments stay
// untouched (a peer may still read them for the call before the last), so
// this engine cannot take part in later calls: they fail, naming this error,
// where the next one would otherwise take this call's number and pair with
// the peers' call, shifting every later call by one.
Status ShmAllReduce::FailUnclaimed(Status error) {
  const uint64_t s = ++sequence_;
  unusable_ = Status(error.code(), "shared-memory call " + std::to_string(s) +
                                       " failed before it began: " + error.message());
  Status result = Abandon(std::move(error));
  control(options_.rank).unclaimed.store(s, std::memory_order_release);
  Publish(&Control::arrived, s);
  return result;
}

template <typename Body>
Status ShmAllReduce::InCall(Deadline deadline,
                            const std::function<Status(Deadline, int)>& watchdog, Body body) {
  if (forks_seen.load(std::memory_order_relaxed) != forks_at_creation_) {
    return FailedPreconditionError(
        "shared-memory group of pid " + std::to_string(owner_pid_) + " used in a forked child (pid " +
        std::to_string(getpid()) + "): its mailbox and staging buffers are the parent's, and a "
        "call here would take part in the parent's collectives (a forked child needs a group "
        "of its own, made in it)");
  }
  if (!unusable_.ok()) {
    return FailedPreconditionError("the shared-memory engine is unusable: " + unusable_.message());
  }
  call_deadline_ = deadline;
  if (Status claimed = ClaimSlot(deadline, watchdog); !claimed.ok()) {
    return FailUnclaimed(std::move(claimed));
  }
  const uint64_t before = sequence_;
  Status status = body();
  if (status.ok() || sequence_ == before) return status;
  return Abandon(std::move(status));
}

Status ShmAllReduce::AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                               ReduceOp op, Deadline deadline,
                               const std::function<Status(Deadline, int)>& watchdog,
                               std::optional<ReduceOp> checked_op) {
  return InCall(deadline, watchdog, [&]() -> Status {
    const size_t bytes = BytesOf(count, dtype);
    const bool staged = bytes <= options_.staging_bytes;
    // The staging buffer of call s is written before the call is announced.
    if (staged && bytes > 0) std::memcpy(staging(options_.rank, sequence_ + 1), send, bytes);
    DDP_RETURN_IF_ERROR(Arrive(send, recv, count, dtype, static_cast<int32_t>(checked_op.value_or(op)),
                               Kind::kAllReduce, -1, /*direct=*/!staged, deadline, watchdog)
                            .status());
    if (staged) return StagedAllReduce(recv, count, dtype, op);
    size_t begin, end;
    Slice(count, DataTypeSize(dtype), options_.size, options_.rank, begin, end);
    Status status = ReduceSlice(send, recv, begin, end, dtype, op, /*share=*/true);
    if (!status.ok()) return FailAfterArrival(std::move(status), deadline, watchdog);
    return Finish(deadline, watchdog);
  });
}

Status ShmAllReduce::AllReduceThrough(const void* send, void* recv, size_t count, DataType dtype,
                                      ReduceOp op, const SliceFn& across, Deadline deadline,
                                      const std::function<Status(Deadline, int)>& watchdog,
                                      std::optional<ReduceOp> checked_op, const FailFn& failed) {
  return InCall(deadline, watchdog, [&]() -> Status {
    // The ranks compare the op they were given; avg reduces as sum here,
    // and the slice function divides (only it knows by how many).
    DDP_RETURN_IF_ERROR(Arrive(send, recv, count, dtype, static_cast<int32_t>(checked_op.value_or(op)),
                               Kind::kThrough, -1, /*direct=*/true, deadline, watchdog)
                            .status());
    const ReduceOp fold = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    const size_t elem = DataTypeSize(dtype);
    size_t begin, end;
    Slice(count, elem, options_.size, options_.rank, begin, end);
    Status status = ReduceSlice(send, recv, begin, end, dtype, fold, /*share=*/false);
    if (status.ok()) status = across(static_cast<char*>(recv) + begin * elem, begin, end - begin);
    if (status.ok()) status = ShareSlice(recv, begin, end, elem);
    // `failed` before the wait for the peers: one of them may be in
    // `across`, waiting for a party elsewhere that is held up, directly or
    // through its own group, by this rank (a failed fold on each of two
    // hosts: each failed rank waits for a host peer that waits between
    // hosts for the other). Until the parties hear of the failure, such a
    // cycle holds every rank until the deadline.
    if (!status.ok()) return FailAfterArrival(std::move(status), deadline, watchdog, failed);
    return Finish(deadline, watchdog);
  });
}

Status ShmAllReduce::AllReduceApply(const void* send, void* recv, size_t count, DataType dtype,
                                    ReduceOp op, const ApplyFn& apply, Deadline deadline,
                                    const std::function<Status(Deadline, int)>& watchdog,
                                    std::optional<ReduceOp> checked_op) {
  return InCall(deadline, watchdog, [&]() -> Status {
    DDP_RETURN_IF_ERROR(Arrive(send, recv, count, dtype, static_cast<int32_t>(checked_op.value_or(op)), Kind::kApply,
                               -1, /*direct=*/true, deadline, watchdog)
                            .status());
    const size_t elem = DataTypeSize(dtype);
    size_t begin, end;
    Slice(count, elem, options_.size, options_.rank, begin, end);
    const size_t piece = apply_piece_elems(dtype);
    if (applied_.size() < piece * elem) applied_.resize(piece * elem);
    Status status = Status::Ok();
    char* out = static_cast<char*>(recv);
    if (begin == end) status = apply(applied_.data(), out + begin * elem, begin, 0);
    for (size_t a = begin; status.ok() && a < end; a += piece) {
      const size_t n = std::min(piece, end - a);
      status = ReduceSlice(send, recv, a, a + n, dtype, op, /*share=*/false, -1, applied_.data());
      if (status.ok()) status = apply(applied_.data(), out + a * elem, a, n);
      if (status.ok()) status = ShareSlice(recv, a, a + n, elem);
    }
    if (!status.ok()) return FailAfterArrival(std::move(status), deadline, watchdog);
    return Finish(deadline, watchdog);
  });
}

// Shapes: rank r's input is staging(r, s)[0, count) of `dtype`; every rank
// folds all of them, in rank order, into its own output.
//
// Why every rank reduces the whole vector instead of a slice: then one
// rendezvous (all arrived) completes the call, where reduce-scatter plus
// all-gather needs three. On a machine whose cores also run other work,
// each rendezvous waits for the peer to be scheduled, and that wait, not
// the arithmetic, dominates small and medium vectors. Folding in rank order
// gives every rank bit-identical results.
Status ShmAllReduce::StagedAllReduce(void* recv, size_t count, DataType dtype, ReduceOp op,
                                     const void* own) {
  const uint64_t s = sequence_;
  const size_t bytes = count * DataTypeSize(dtype);
  if (bytes > 0 && recv != nullptr) {
    const reduce::ReduceFn fn = reduce::GetReduceFn(dtype, op);
    if (own != nullptr) {
      // Own input first: recv may be it (in place), and is overwritten by
      // the first fold.
      const void* first = own;
      for (int peer = 0; peer < options_.size; ++peer) {
        if (peer == options_.rank) continue;
        fn(recv, first, staging(peer, s), count);
        first = recv;
      }
      if (first != recv) std::memcpy(recv, first, bytes);
    } else if (options_.size == 1) {
      std::memcpy(recv, staging(0, s), bytes);
    } else {
      fn(recv, staging(0, s), staging(1, s), count);
      for (int peer = 2; peer < options_.size; ++peer) fn(recv, recv, staging(peer, s), count);
    }
    if (op == ReduceOp::kAvg) reduce::DivideInPlace(dtype, recv, count, options_.size);
  }
  Publish(&Control::reduced, s);
  Publish(&Control::finished, s);
  // The inputs were complete, but a peer that gave up on the call has
  // failed it: say so, as the direct path would.
  return PeerFailure(s);
}

// Shapes: every rank holds [count] elements of `dtype`; rank r owns the
// slice [begin_r, end_r). Per chunk of its slice, rank r reads the chunk
// from every peer's input into a cache-resident buffer (or, for an input in
// shareable memory, reads it where it lies through a mapping) and folds it
// into its output; AllReduce then writes the reduced chunk into every peer's
// output while it is still in cache. Two rendezvous per call: all arrived
// (inputs readable), all finished (every slice written everywhere, every
// input read).
Status ShmAllReduce::ReduceSlice(const void* send, void* recv, size_t begin, size_t end,
                                 DataType dtype, ReduceOp op, bool share, int to_root,
                                 char* into) {
  const int me = options_.rank;
  const uint64_t s = sequence_;
  const size_t elem = DataTypeSize(dtype);
  const reduce::ReduceFn fn = reduce::GetReduceFn(dtype, op);
  char* out = static_cast<char*>(recv);
  const char* in = static_cast<const char*>(send);
  const size_t chunk_elems = std::max<size_t>(1, chunk_.size() / elem);
  // A reduce's ranks other than the root fold each chunk here, then write
  // it into the root's output.
  const bool to_peer = to_root >= 0 && to_root != me;
  if (to_peer && folded_.size() < chunk_.size()) folded_.resize(chunk_.size());
  for (size_t a = begin; a < end; a += chunk_elems) {
    const size_t n = std::min(chunk_elems, end - a);
    char* here = to_peer            ? folded_.data()
                 : into != nullptr ? into + (a - begin) * elem
                                   : out + a * elem;
    const char* first = in + a * elem;
    // Peers in rank order, so that every chunk is folded in one fixed order.
    const int last_peer = me == options_.size - 1 ? options_.size - 2 : options_.size - 1;
    for (int peer = 0; peer < options_.size; ++peer) {
      if (peer == me) continue;
      const uint64_t remote = control(peer).args[s % 2].src + a * elem;
      // A peer's input in shareable memory is folded where it lies, through
      // this rank's mapping of it; any other is first copied here.
      const char* theirs = MapPeerBuffer(peer, remote, n * elem);
      if (theirs != nullptr) {
        ++mapped_copies_;
        if (Abandoned(peer)) return PeerFailure(s, peer);
      } else {
        DDP_RETURN_IF_ERROR(ReadFromPeer(peer, chunk_.data(), remote, n * elem));
        theirs = chunk_.data();
      }
      if (op == ReduceOp::kAvg && peer == last_peer) {
        // The last fold and the division in one pass over the chunk.
        reduce::SumDivide(dtype, here, first, theirs, n, options_.size);
      } else {
        fn(here, first, theirs, n);
      }
      // A peer that gave up on the call while this rank read its input may
      // have reused that memory: the fold is void.
      if (theirs != chunk_.data() && Abandoned(peer)) return PeerFailure(s, peer);
      first = here;
    }
    if (options_.size == 1 && first != here) std::memcpy(here, first, n * elem);
    if (share) DDP_RETURN_IF_ERROR(ShareSlice(recv, a, a + n, elem));
    if (to_peer) {
      DDP_RETURN_IF_ERROR(
          WriteToPeer(to_root, here, control(to_root).args[s % 2].dst + a * elem, n * elem));
    }
  }
  return Status::Ok();
}

Status ShmAllReduce::ShareSlice(const void* recv, size_t begin, size_t end, size_t elem) {
  if (begin == end) return Status::Ok();
  const uint64_t s = sequence_;
  const char* here = static_cast<const char*>(recv) + begin * elem;
  // No peer touches this range of its own output: it is this rank's slice.
  for (int k = 1; k < options_.size; ++k) {
    const int peer = (options_.rank + k) % options_.size;
    DDP_RETURN_IF_ERROR(WriteToPeer(peer, here, control(peer).args[s % 2].dst + begin * elem,
                                    (end - begin) * elem));
  }
  return Status::Ok();
}

Status ShmAllReduce::Finish(Deadline deadline,
                            const std::function<Status(Deadline, int)>& watchdog) {
  const uint64_t s = sequence_;
  Publish(&Control::reduced, s);
  Publish(&Control::finished, s);
  // Until every peer finished, its slice of this rank's output may be
  // unwritten and it may still read this rank's input.
  DDP_RETURN_IF_ERROR(WaitFor(&Control::finished, s, -1, deadline, watchdog, "finish"));
  return PeerFailure(s);
}

Status ShmAllReduce::PeerFailure(uint64_t call, int only) const {
  for (int peer = 0; peer < options_.size; ++peer) {
    if (peer == options_.rank || (only >= 0 && peer != only)) continue;
    const Control& theirs = control(peer);
    if (theirs.failed.load(std::memory_order_acquire) == call) {
      // Acquire loads, pairing with MarkFailed's release stores (standing
      // in for fences, which ThreadSanitizer does not model): if the peer
      // began to rewrite code or text for a later call while they were
      // copied, `failed` no longer holds this call below, and the copy may
      // be torn.
      const int32_t code = theirs.failed_code.load(std::memory_order_acquire);
      char text[sizeof(theirs.failed_message)];
      for (size_t w = 0; w < std::size(theirs.failed_message); ++w) {
        const uint64_t word = theirs.failed_message[w].load(std::memory_order_acquire);
        std::memcpy(text + w * sizeof(word), &word, sizeof(word));
      }
      const std::string what = RankName(peer) + " failed in this shared-memory call (" +
                               std::to_string(call) + ")";
      if (theirs.failed.load(std::memory_order_relaxed) != call) {
        return AbortedError(what + "; its error was overwritten by a later call's before it "
                                   "could be read");
      }
      return Status(static_cast<StatusCode>(code),
                    what + ": " + std::string(text, strnlen(text, sizeof(text))));
    }
    if (only >= 0) {
      return AbortedError(RankName(peer) + " left shared-memory call " + std::to_string(call));
    }
  }
  return Status::Ok();
}

void ShmAllReduce::MarkFailed(uint64_t call, const Status& error) {
  Control& mine = control(options_.rank);
  // A seqlock on `failed`: it leaves the earlier call before the code and
  // message change, so that a peer still copying that call's error sees
  // the change afterwards and drops the copy (PeerFailure).
  mine.failed.store(kRewriting, std::memory_order_relaxed);
  // Release stores: a reader whose acquire load sees one of them also sees
  // `failed` left the earlier call.
  mine.failed_code.store(static_cast<int32_t>(error.code()), std::memory_order_release);
  char text[sizeof(mine.failed_message)] = {};
  std::memcpy(text, error.message().data(), std::min(error.message().size(), sizeof(text) - 1));
  // A message the mailbox cannot hold whole ends in "..." (the peers would
  // otherwise read a cut one as complete).
  if (error.message().size() > sizeof(text) - 1) std::memcpy(text + sizeof(text) - 4, "...", 3);
  for (size_t w = 0; w < std::size(mine.failed_message); ++w) {
    uint64_t word;
    std::memcpy(&word, text + w * sizeof(word), sizeof(word));
    mine.failed_message[w].store(word, std::memory_order_release);
  }
  mine.failed.store(call, std::memory_order_release);
  Publish(&Control::reduced, call);
  Publish(&Control::finished, call);
}

// A rank returning from a call with an error may leave peers that still
// mean to copy from its input or into its output (a late peer that has not
// arrived yet, one still running its slice function). Those buffers are the
// caller's again once the call returns, so it records the error as its
// failure of the call, marks the call abandoned, and waits (briefly) for
// any peer already inside a write into them to finish it; peers check the
// mark around each copy (CopyWithPeer) and fail the call with this rank's
// error instead.
Status ShmAllReduce::Abandon(Status error) {
  const uint64_t s = sequence_;
  Control& mine = control(options_.rank);
  if (mine.failed.load(std::memory_order_relaxed) != s) MarkFailed(s, error);
  mine.abandoned.store(s, std::memory_order_seq_cst);
  const uint64_t mark = Touching(s, options_.rank);
  const Clock::time_point started = Clock::now();
  for (int peer = 0; peer < options_.size; ++peer) {
    if (peer == options_.rank) continue;
    while (control(peer).touching.load(std::memory_order_seq_cst) == mark) {
      const Clock::duration waited = Clock::now() - started;
      if (waited >= kAbandonGrace) {
        return Status(error.code(), error.message() + "; and " + RankName(peer) +
                                        " was still writing into this rank's buffers " +
                                        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(kAbandonGrace).count()) +
                                        " ms later, so they may still change");
      }
      if (waited < std::chrono::milliseconds(1)) {
        sched_yield();
      } else if (PeerExitsWithin(peer, std::chrono::milliseconds(1))) {
        break;  // a process that exited copies nothing more
      }
    }
  }
  return error;
}

// Once this rank has arrived, its peers read its input and write its output
// until they finish the call. So a rank that fails after arriving marks the
// call as failed and waits, within the deadline, for each peer still alive
// to finish: no peer writes into its buffers after it returns, and the
// peers fail the call too instead of returning a result without this rank's
// slice.
Status ShmAllReduce::FailAfterArrival(Status error, Deadline deadline,
                                      const std::function<Status(Deadline, int)>& watchdog,
                                      const FailFn& failed) {
  const uint64_t s = sequence_;
  MarkFailed(s, error);
  if (failed) failed(error);
  for (int peer = 0; peer < options_.size; ++peer) {
    if (peer == options_.rank) continue;
    WaitFor(&Control::finished, s, peer, deadline, watchdog, "finish").IgnoreError();
  }
  return error;
}

// Shapes: buffer [count] of `dtype` on every rank. Small buffers: the root
// copies into its staging buffer before announcing the call, the others
// copy out of it; nobody waits after arriving (the staging buffers
// alternate between calls, as for the staged all-reduce). Larger ones: the
// others read the root's buffer with CMA, and the root waits until every
// rank has read it.
Status ShmAllReduce::Broadcast(void* buffer, size_t count, DataType dtype, int root,
                               Deadline deadline,
                               const std::function<Status(Deadline, int)>& watchdog) {
  if (root < 0 || root >= options_.size) {
    return InvalidArgumentError("shared-memory broadcast: root " + std::to_string(root) +
                                " is not a rank of a group of " + std::to_string(options_.size));
  }
  return InCall(deadline, watchdog, [&]() -> Status {
    const size_t bytes = BytesOf(count, dtype);
    const bool staged = bytes <= options_.staging_bytes;
    const bool is_root = options_.rank == root;
    if (staged && is_root && bytes > 0) std::memcpy(staging(root, sequence_ + 1), buffer, bytes);
    DDP_ASSIGN_OR_RETURN(const uint64_t s, Arrive(buffer, buffer, count, dtype, root,
                                                  Kind::kBroadcast, -1, /*direct=*/!staged,
                                                  deadline, watchdog));
    if (!is_root && bytes > 0) {
      if (staged) {
        std::memcpy(buffer, staging(root, s), bytes);
      } else {
        // Nobody writes into this rank's buffer: on failure it leaves at
        // once (InCall tells the root).
        DDP_RETURN_IF_ERROR(ReadFromPeer(root, buffer, control(root).args[s % 2].src, bytes));
      }
    }
    Publish(&Control::reduced, s);
    Publish(&Control::finished, s);
    // A root that gave up before this rank arrived has failed the call,
    // even if its staged data was there to copy.
    if (staged || !is_root) return PeerFailure(s);
    // Until every rank has read it, the root's buffer must stay as it is.
    DDP_RETURN_IF_ERROR(
        WaitFor(&Control::finished, s, -1, deadline, watchdog, "read the broadcast"));
    return PeerFailure(s);
  });
}

// Shapes: send and recv [size * count] of `dtype` on every rank. Small
// buffers: each rank stages its whole send buffer before it arrives and
// copies its blocks out of the peers' staging buffers, with no wait after
// arriving (as the staged all-reduce). Larger ones: rank r reads block r of
// each peer's send into block q of its recv with CMA, starting with the
// next rank so that the ranks do not all read rank 0 first; then it waits
// until every rank finished, as they read its send buffer.
Status ShmAllReduce::AllToAll(const void* send, void* recv, size_t count, DataType dtype,
                              Deadline deadline,
                              const std::function<Status(Deadline, int)>& watchdog) {
  return InCall(deadline, watchdog, [&]() -> Status {
    const size_t block = count * DataTypeSize(dtype);  // used once Arrive checked it
    const bool staged = BytesOf(count, dtype, options_.size) <= options_.staging_bytes;
    if (staged && block > 0) {
      std::memcpy(staging(options_.rank, sequence_ + 1), send, block * options_.size);
    }
    DDP_ASSIGN_OR_RETURN(const uint64_t s, Arrive(send, recv, count, dtype, 0, Kind::kAllToAll,
                                                  -1, /*direct=*/!staged, deadline, watchdog));
    const int me = options_.rank;
    if (block > 0) {
      std::memcpy(static_cast<char*>(recv) + me * block,
                  static_cast<const char*>(send) + me * block, block);
    }
    if (staged) {
      for (int peer = 0; peer < options_.size; ++peer) {
        if (peer == me || block == 0) continue;
        std::memcpy(static_cast<char*>(recv) + peer * block, staging(peer, s) + me * block, block);
      }
      Publish(&Control::reduced, s);
      Publish(&Control::finished, s);
      return PeerFailure(s);
    }
    Status status;
    for (int k = 1; k < options_.size && status.ok() && block > 0; ++k) {
      const int peer = (me + k) % options_.size;
      status = ReadFromPeer(peer, static_cast<char*>(recv) + peer * block,
                            control(peer).args[s % 2].src + me * block, block);
    }
    if (!status.ok()) return FailAfterArrival(std::move(status), deadline, watchdog);
    return Finish(deadline, watchdog);
  });
}

Status ShmAllReduce::CheckRoot(const char* what, int root) const {
  if (root >= 0 && root < options_.size) return Status::Ok();
  return InvalidArgumentError(std::string("shared-memory ") + what + ": root " +
                              std::to_string(root) + " is not a rank of a group of " +
                              std::to_string(options_.size));
}

// Shapes: send [count] of `dtype` on every rank, recv [count] on the root.
// Small vectors: every rank stages its input before it arrives, the root
// folds the staged inputs in rank order, and nobody waits after arriving
// (staged all-reduce, with one output). Larger ones: rank r folds its
// slice of every input, chunk by chunk, and writes each folded chunk into
// the root's output (the root folds straight into it); then every rank
// waits until all finished, as AllReduce's direct path: the root's output
// is complete, and no peer still reads an input.
Status ShmAllReduce::Reduce(const void* send, void* recv, size_t count, DataType dtype,
                            ReduceOp op, int root, Deadline deadline,
                            const std::function<Status(Deadline, int)>& watchdog,
                            std::optional<ReduceOp> checked_op) {
  DDP_RETURN_IF_ERROR(CheckRoot("reduce", root));
  return InCall(deadline, watchdog, [&]() -> Status {
    const size_t bytes = BytesOf(count, dtype);
    const bool staged = bytes <= rooted_staging_bytes();
    const bool is_root = options_.rank == root;
    // The root folds its own input from where it is.
    if (staged && !is_root && bytes > 0) {
      std::memcpy(staging(options_.rank, sequence_ + 1), send, bytes);
    }
    // Staged, a rank other than the root waits for the root alone: its
    // input is in its staging buffer, and it need only know that the root
    // agrees (the root compares everyone).
    DDP_RETURN_IF_ERROR(Arrive(send, is_root ? recv : nullptr, count, dtype,
                               static_cast<int32_t>(checked_op.value_or(op)), Kind::kReduce, root,
                               /*direct=*/!staged,
                               deadline, watchdog,
                               staged && !is_root ? root : -1)
                            .status());
    if (staged) return StagedAllReduce(is_root ? recv : nullptr, count, dtype, op, send);
    size_t begin, end;
    Slice(count, DataTypeSize(dtype), options_.size, options_.rank, begin, end);
    Status status = ReduceSlice(send, recv, begin, end, dtype, op, /*share=*/false, root);
    if (!status.ok()) return FailAfterArrival(std::move(status), deadline, watchdog);
    return Finish(deadline, watchdog);
  });
}

// Shapes: send [count] of `dtype` on every rank, recv [size * count] on the
// root. Small blocks: each rank stages its block before it arrives and the
// root copies them out, with no wait after arriving. Larger ones: each rank
// writes its block into the root's output with CMA (the ranks copy at
// once, instead of the root copying p - 1 blocks in turn) and leaves; the
// root waits until every rank has written.
Status ShmAllReduce::Gather(const void* send, void* recv, size_t count, DataType dtype, int root,
                            Deadline deadline,
                            const std::function<Status(Deadline, int)>& watchdog) {
  DDP_RETURN_IF_ERROR(CheckRoot("gather", root));
  return InCall(deadline, watchdog, [&]() -> Status {
    const size_t block = count * DataTypeSize(dtype);  // used once Arrive checked it
    const bool staged = BytesOf(count, dtype, options_.size) <= rooted_staging_bytes();
    const int me = options_.rank;
    const bool is_root = me == root;
    if (staged && !is_root && block > 0) std::memcpy(staging(me, sequence_ + 1), send, block);
    // Staged, as the reduce: the others wait for the root alone.
    DDP_ASSIGN_OR_RETURN(const uint64_t s,
                         Arrive(send, is_root ? recv : nullptr, count, dtype, 0, Kind::kGather,
                                root, /*direct=*/!staged, deadline, watchdog,
                                staged && !is_root ? root : -1));
    char* out = static_cast<char*>(recv);
    if (is_root && block > 0 && out + me * block != send) {
      std::memcpy(out + me * block, send, block);
    }
    if (staged) {
      for (int peer = 0; peer < options_.size && is_root && block > 0; ++peer) {
        if (peer != me) std::memcpy(out + peer * block, staging(peer, s), block);
      }
      Publish(&Control::reduced, s);
      Publish(&Control::finished, s);
      return PeerFailure(s);
    }
    if (!is_root) {
      // Nobody touches this rank's buffers: on failure it leaves at once
      // (InCall tells the root).
      if (block > 0) {
        DDP_RETURN_IF_ERROR(WriteToPeer(root, send, control(root).args[s % 2].dst + me * block, block));
      }
      Publish(&Control::reduced, s);
      Publish(&Control::finished, s);
      return PeerFailure(s);
    }
    return Finish(deadline, watchdog);
  });
}

// Shapes: send [size * count] of `dtype` on the root, recv [count] on
// every rank: Broadcast's protocol with a block per rank. Small buffers
// through the root's staging buffer (no wait after arriving); larger ones
// read by each rank from the root's input with CMA, the root waiting until
// every rank has read.
Status ShmAllReduce::Scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
                             Deadline deadline,
                             const std::function<Status(Deadline, int)>& watchdog) {
  DDP_RETURN_IF_ERROR(CheckRoot("scatter", root));
  return InCall(deadline, watchdog, [&]() -> Status {
    const size_t block = count * DataTypeSize(dtype);  // used once Arrive checked it
    const bool staged = BytesOf(count, dtype, options_.size) <= rooted_staging_bytes();
    const int me = options_.rank;
    const bool is_root = me == root;
    if (staged && is_root && block > 0) {
      std::memcpy(staging(me, sequence_ + 1), send, block * options_.size);
    }
    // A rank other than the root needs the root's arrival alone (its
    // block is staged, or readable, from then on); the root compares
    // everyone.
    DDP_ASSIGN_OR_RETURN(const uint64_t s,
                         Arrive(is_root ? send : nullptr, recv, count, dtype, 0, Kind::kScatter,
                                root, /*direct=*/!staged, deadline, watchdog, is_root ? -1 : root));
    const char* in = static_cast<const char*>(send);
    if (block > 0) {
      if (is_root) {
        if (static_cast<char*>(recv) != in + me * block) std::memcpy(recv, in + me * block, block);
      } else if (staged) {
        std::memcpy(recv, staging(root, s) + me * block, block);
      } else {
        DDP_RETURN_IF_ERROR(ReadFromPeer(root, recv, control(root).args[s % 2].src + me * block, block));
      }
    }
    Publish(&Control::reduced, s);
    Publish(&Control::finished, s);
    if (staged || !is_root) return PeerFailure(s);
    // Until every rank has read its block, the root's input must stay.
    DDP_RETURN_IF_ERROR(WaitFor(&Control::finished, s, -1, deadline, watchdog, "read the scatter"));
    return PeerFailure(s);
  });
}

Status ShmAllReduce::Barrier(Deadline deadline, const std::function<Status(Deadline, int)>& watchdog) {
  return InCall(deadline, watchdog, [&]() -> Status {
    const uint64_t s = ++sequence_;
    Control& mine = control(options_.rank);
    // Arguments no other collective can have, so that a rank in another
    // collective while this one is in a barrier reports the mismatch, and
    // this rank too.
    Control::Args& args = mine.args[s % 2];
    args.count = kBarrierCount;
    args.dtype = -1;
    args.op = -1;
    args.kind = static_cast<int32_t>(Kind::kBarrier);
    args.root = -1;
    Publish(&Control::arrived, s);
    DDP_RETURN_IF_ERROR(WaitFor(&Control::arrived, s, -1, deadline, watchdog, "reach the barrier"));
    DDP_RETURN_IF_ERROR(UnclaimedFailure(s, -1));
    DDP_RETURN_IF_ERROR(CheckAgreement(s, kBarrierCount, static_cast<DataType>(-1), -1,
                                       Kind::kBarrier, -1));
    // Finished only once the peers' arguments were read: a peer two calls
    // on (ClaimSlot) overwrites them.
    Publish(&Control::reduced, s);
    Publish(&Control::finished, s);
    return PeerFailure(s);
  });
}

}  // namespace ddp::transport::shm
