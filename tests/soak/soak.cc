// Soak test of //transport: N ranks (default 4, self-launched) run many
// collectives with random kinds, sizes, dtypes, ops, algorithms (forced per
// call), roots, in-place or not, blocking or async, and check every element
// of every result against a closed form. Each rank samples its resident
// memory, open file descriptors and threads as it goes and reports their
// growth per 1000 operations after a warm-up; growth beyond the bounds (any
// thread more than after the warm-up) fails the run.
//
//   bazel run //tests/soak:soak -- --ops=50000           # minutes, by hand
//   bazel run //tests/soak:soak -- --duration_s=600
//   (CI: //tests/soak:soak_test runs a few thousand operations.)
//
// Every rank draws the same sequence from one seed, so all ranks agree on
// each call without talking about it; the data differ per rank, element and
// operation, so a stale or misplaced block cannot pass.

#include <dirent.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "transport/communicator.h"
#include "transport/launch/self_launch.h"

namespace {

using namespace ddp::transport;
using namespace std::chrono_literals;

// ASan and TSan allocators hold freed memory back (quarantine, shadow), so
// resident memory and malloc statistics say nothing about leaks there; the
// memory bounds are reported but not enforced, and LeakSanitizer checks for
// leaks at exit instead. File descriptors are checked in every build.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizerAllocator = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitizerAllocator = true;
#else
constexpr bool kSanitizerAllocator = false;
#endif
#else
constexpr bool kSanitizerAllocator = false;
#endif

struct Flags {
  long ops = 2000;            // operations to run (unless duration_s is set)
  double duration_s = 0;      // run for this long instead, when > 0
  uint64_t seed = 1;          // the sequence of operations
  long sample_every = 100;    // operations between memory/fd samples
  double warmup = 0.2;        // fraction of samples ignored for the growth
  // Bounds on growth per 1000 operations after the warm-up.
  double max_rss_kib_per_1000 = 1024;    // resident, shared-memory pages included
  double max_private_kib_per_1000 = 64;  // private resident, heap in use, address space
  double max_fds_per_1000 = 0.5;         // open file descriptors
  size_t max_count = 1 << 20;         // largest element count
  int timeout_s = 120;                // deadline of every call
  bool print_samples = false;         // print every sample (ops rss_kib fds)
  std::string kinds;                  // comma-separated subset of call kinds; "" all
  // Deliberate leaks, to show that the bounds catch them (soak_test does).
  size_t leak_bytes_per_op = 0;
  long leak_fd_every = 0;
  long leak_thread_every = 0;
  // After this many operations (0: never), one thread starts and stays, as
  // a helper started lazily mid-run does (a log writer on its first line, a
  // resolver on a reconnect): not a leak, and it must not fail the run.
  long helper_thread_at = 0;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    const auto value = [&](std::string_view name) -> const char* {
      if (arg.size() > name.size() + 2 && arg.substr(0, 2) == "--" &&
          arg.substr(2, name.size()) == name && arg[2 + name.size()] == '=') {
        return argv[i] + 3 + name.size();
      }
      return nullptr;
    };
    if (const char* v = value("ops")) f.ops = std::atol(v);
    else if (const char* v = value("duration_s")) f.duration_s = std::atof(v);
    else if (const char* v = value("seed")) f.seed = std::strtoull(v, nullptr, 10);
    else if (const char* v = value("sample_every")) f.sample_every = std::atol(v);
    else if (const char* v = value("warmup")) f.warmup = std::atof(v);
    else if (const char* v = value("max_rss_kib_per_1000")) f.max_rss_kib_per_1000 = std::atof(v);
    else if (const char* v = value("max_fds_per_1000")) f.max_fds_per_1000 = std::atof(v);
    else if (const char* v = value("max_private_kib_per_1000")) {
      f.max_private_kib_per_1000 = std::atof(v);
    }
    else if (const char* v = value("max_count")) f.max_count = std::strtoull(v, nullptr, 10);
    else if (const char* v = value("timeout_s")) f.timeout_s = std::atoi(v);
    else if (arg == "--print_samples") f.print_samples = true;
    else if (const char* v = value("kinds")) f.kinds = v;
    else if (const char* v = value("leak_bytes_per_op")) f.leak_bytes_per_op = std::strtoull(v, nullptr, 10);
    else if (const char* v = value("leak_fd_every")) f.leak_fd_every = std::atol(v);
    else if (const char* v = value("leak_thread_every")) f.leak_thread_every = std::atol(v);
    else if (const char* v = value("helper_thread_at")) f.helper_thread_at = std::atol(v);
    else {
      std::fprintf(stderr,
                   "soak: unknown argument %s\n"
                   "flags: --nproc_per_node=N --ops=N --duration_s=S --seed=S --sample_every=N "
                   "--warmup=F --max_rss_kib_per_1000=K --max_private_kib_per_1000=K "
                   "--max_fds_per_1000=F --max_count=N "
                   "--timeout_s=S --print_samples --kinds=all_reduce,broadcast,all_gather,reduce_scatter,"
                   "barrier,send_recv --leak_bytes_per_op=N --leak_fd_every=N --leak_thread_every=N "
                   "--helper_thread_at=N\n",
                   argv[i]);
      std::exit(2);
    }
  }
  if (f.sample_every < 1 || f.ops < 0 || f.warmup < 0 || f.warmup >= 1 || f.timeout_s < 1) {
    std::fprintf(stderr, "soak: bad flag values\n");
    std::exit(2);
  }
  return f;
}

// ---- the random sequence shared by every rank ----

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t Below(uint64_t n) { return Next() % n; }

 private:
  uint64_t state_;
};

enum class Kind { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kBarrier, kSendRecv };

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kAllReduce: return "all_reduce";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kAllGather: return "all_gather";
    case Kind::kReduceScatter: return "reduce_scatter";
    case Kind::kBarrier: return "barrier";
    case Kind::kSendRecv: return "send_recv";
  }
  return "?";
}

constexpr DataType kDtypes[] = {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16,
                                DataType::kI32, DataType::kI64, DataType::kU8};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin,
                             ReduceOp::kProd};
// On one host every all-reduce algorithm applies, shared memory included.
constexpr Algorithm kAlgorithms[] = {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree,
                                     Algorithm::kRhd, Algorithm::kSharedMemory};

struct Call {
  Kind kind = Kind::kAllReduce;
  DataType dtype = DataType::kF32;
  ReduceOp op = ReduceOp::kSum;
  Algorithm algorithm = Algorithm::kAuto;
  size_t count = 0;
  int root = 0;
  bool in_place = false;
  bool async = false;
};

// Sizes spread over every regime: empty, tiny, fewer than the ranks, odd,
// several chunks, large.
size_t DrawCount(Rng& rng, size_t max_count) {
  const uint64_t bucket = rng.Below(100);
  size_t count;
  if (bucket < 10) count = rng.Below(8);
  else if (bucket < 45) count = 8 + rng.Below(1024);
  else if (bucket < 80) count = 1024 + rng.Below(32 * 1024);
  else if (bucket < 97) count = 32 * 1024 + rng.Below(256 * 1024);
  else count = 256 * 1024 + rng.Below(1 << 20);
  return std::min(count, max_count);
}

Call DrawCall(Rng& rng, int world, size_t max_count) {
  Call c;
  const uint64_t k = rng.Below(100);
  c.kind = k < 45 ? Kind::kAllReduce
           : k < 57 ? Kind::kBroadcast
           : k < 69 ? Kind::kAllGather
           : k < 81 ? Kind::kReduceScatter
           : k < 88 ? Kind::kBarrier
                    : Kind::kSendRecv;
  c.dtype = kDtypes[rng.Below(std::size(kDtypes))];
  c.op = kOps[rng.Below(std::size(kOps))];
  c.algorithm = kAlgorithms[rng.Below(std::size(kAlgorithms))];
  c.count = DrawCount(rng, max_count);
  if (c.kind == Kind::kAllGather || c.kind == Kind::kReduceScatter) {
    c.count = std::max<size_t>(c.count / world, c.count == 0 ? 0 : 1);
  }
  c.root = static_cast<int>(rng.Below(world));
  c.in_place = rng.Below(2) == 0;
  c.async = rng.Below(4) == 0;
  return c;
}

// ---- values: small integers, exact in every dtype ----

// Rank r's element i in operation `serial`: in [0, 4] for u8 (no negatives),
// in [-2, 2] otherwise; prod uses 1 and 2 so products of 9 ranks stay exact.
double InputValue(const Call& c, uint64_t serial, int rank, size_t i) {
  const uint64_t h = (serial * 0x9e3779b97f4a7c15ull) ^ (i * 0xbf58476d1ce4e5b9ull) ^
                     (static_cast<uint64_t>(rank + 1) * 0x94d049bb133111ebull);
  const uint64_t m = (h ^ (h >> 29)) % 5;
  if (c.kind == Kind::kAllReduce || c.kind == Kind::kReduceScatter) {
    if (c.op == ReduceOp::kProd) return m < 4 ? 1.0 : 2.0;
  }
  if (c.dtype == DataType::kU8) return static_cast<double>(m);
  return static_cast<double>(m) - 2.0;
}

bool IsInteger(DataType d) {
  return d == DataType::kI32 || d == DataType::kI64 || d == DataType::kU8;
}

double Reduce(const Call& c, uint64_t serial, int world, size_t i) {
  double acc = InputValue(c, serial, 0, i);
  for (int r = 1; r < world; ++r) {
    const double v = InputValue(c, serial, r, i);
    switch (c.op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc += v; break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kProd: acc *= v; break;
    }
  }
  if (c.op == ReduceOp::kAvg) acc = IsInteger(c.dtype) ? std::trunc(acc / world) : acc / world;
  return acc;
}

// Exact conversions for the values used here (small integers and quarters).
uint16_t ToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  if ((x & 0x7fffffff) == 0) return static_cast<uint16_t>(sign);
  return static_cast<uint16_t>(sign | (exp << 10) | ((x >> 13) & 0x3ff));
}

float FromHalf(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  uint32_t x;
  if (exp == 0 && mant == 0) {
    x = sign;
  } else if (exp == 0) {  // subnormal: not produced here, decoded for error messages
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  } else if (exp == 31) {
    x = sign | 0x7f800000u | (mant << 13);
  } else {
    x = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

void StoreValue(DataType d, void* data, size_t i, double v) {
  switch (d) {
    case DataType::kF32: static_cast<float*>(data)[i] = static_cast<float>(v); break;
    case DataType::kF64: static_cast<double*>(data)[i] = v; break;
    case DataType::kF16: static_cast<uint16_t*>(data)[i] = ToHalf(static_cast<float>(v)); break;
    case DataType::kBF16: {
      const float f = static_cast<float>(v);
      uint32_t x;
      std::memcpy(&x, &f, 4);
      static_cast<uint16_t*>(data)[i] = static_cast<uint16_t>(x >> 16);
      break;
    }
    case DataType::kI32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v); break;
    case DataType::kI64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v); break;
    case DataType::kU8: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(v); break;
  }
}

double LoadValue(DataType d, const void* data, size_t i) {
  switch (d) {
    case DataType::kF32: return static_cast<const float*>(data)[i];
    case DataType::kF64: return static_cast<const double*>(data)[i];
    case DataType::kF16: return FromHalf(static_cast<const uint16_t*>(data)[i]);
    case DataType::kBF16: {
      const uint32_t x = static_cast<uint32_t>(static_cast<const uint16_t*>(data)[i]) << 16;
      float f;
      std::memcpy(&f, &x, 4);
      return f;
    }
    case DataType::kI32: return static_cast<const int32_t*>(data)[i];
    case DataType::kI64: return static_cast<double>(static_cast<const int64_t*>(data)[i]);
    case DataType::kU8: return static_cast<const uint8_t*>(data)[i];
  }
  return NAN;
}

// A buffer of `count` elements of `dtype`, filled with a poison pattern so
// that an element nobody wrote cannot pass. Mapped and unmapped directly:
// the allocator's caching would hide the transport's own memory use, and a
// fresh mapping often lands where the last one was, which is where stale
// registrations in the transport would show up as wrong results.
class Buffer {
 public:
  Buffer(DataType d, size_t count) : bytes_(std::max<size_t>(count * DataTypeSize(d), 1)) {
    data_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data_ == MAP_FAILED) {
      std::perror("soak: mmap");
      std::abort();
    }
    std::memset(data_, 0xA5, bytes_);
  }
  ~Buffer() { munmap(data_, bytes_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* data() { return data_; }

 private:
  size_t bytes_;
  void* data_;
};

// ---- resources ----

long ResidentKiB() {
  std::ifstream in("/proc/self/statm");
  long size = 0, resident = 0;
  in >> size >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

int OpenFds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n - 1;  // the directory stream itself
}

// Bytes malloc has handed out and not had back: a leak grows this, where
// the allocator's own caching and pages touched late grow only the
// resident size.
long HeapInUseKiB() { return static_cast<long>(mallinfo2().uordblks / 1024); }

// One "Name:   123 kB" line of /proc/self/status, in KiB.
long StatusKiB(const char* name) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(name);
  while (std::getline(in, line)) {
    if (line.compare(0, n, name) == 0 && line.size() > n && line[n] == ':') {
      return std::atol(line.c_str() + n + 1);
    }
  }
  return -1;
}

// Entries of /dev/shm named for a segment this process created
// ("ddp-<pid>-...", transport/shm/segment.cc).
std::vector<std::string> SegmentsNamedForThisProcess() {
  std::vector<std::string> found;
  const std::string prefix = "ddp-" + std::to_string(getpid()) + "-";
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (std::string_view(e->d_name).substr(0, prefix.size()) == prefix) found.push_back(e->d_name);
    }
    closedir(d);
  }
  return found;
}

struct Sample {
  long ops;
  long rss_kib;
  int fds;
  long heap_kib;
  long anon_kib;   // private memory (heap, stacks, private mappings)
  long shmem_kib;  // shared memory segments (the intra-host path)
  long vm_kib;     // address space mapped
  int maps;        // number of mappings
  long threads;    // threads of the process
};

int Mappings() {
  std::ifstream in("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) ++n;
  return n;
}

Sample TakeSample(long ops) {
  return {ops,           ResidentKiB(),        OpenFds(),          HeapInUseKiB(),
          StatusKiB("RssAnon"), StatusKiB("RssShmem"), StatusKiB("VmSize"), Mappings(),
          StatusKiB("Threads")};
}

// Least-squares slope of field(sample) over operations, per 1000 operations.
template <typename Field>
double SlopePer1000(const std::vector<Sample>& s, size_t first, Field field) {
  const size_t n = s.size() - first;
  if (n < 2) return 0;
  double mx = 0, my = 0;
  for (size_t i = first; i < s.size(); ++i) {
    mx += s[i].ops;
    my += field(s[i]);
  }
  mx /= n;
  my /= n;
  double sxy = 0, sxx = 0;
  for (size_t i = first; i < s.size(); ++i) {
    const double dx = s[i].ops - mx;
    sxy += dx * (field(s[i]) - my);
    sxx += dx * dx;
  }
  return sxx == 0 ? 0 : 1000.0 * sxy / sxx;
}

// ---- one operation ----

class Soak {
 public:
  Soak(Communicator& comm, const Flags& flags) : comm_(comm), flags_(flags) {}

  // Runs call number `serial`; returns the number of wrong elements (and
  // describes the first in `error`), or -1 with `error` when a call failed.
  long Run(const Call& c, uint64_t serial, std::string& error) {
    const int world = comm_.size();
    const int rank = comm_.rank();
    CallOptions options;
    options.timeout = std::chrono::seconds(flags_.timeout_s);
    if (c.kind == Kind::kAllReduce) options.algorithm = c.algorithm;
    const size_t n = c.count;
    const auto fill = [&](Buffer& b, size_t offset_elems, size_t count, int as_rank,
                          size_t index_base) {
      for (size_t i = 0; i < count; ++i) {
        StoreValue(c.dtype, b.data(), offset_elems + i, InputValue(c, serial, as_rank, index_base + i));
      }
    };
    const auto finish = [&](Work work, Status blocking) -> Status {
      return c.async ? work.Wait() : blocking;
    };
    long wrong = 0;
    const auto check = [&](Buffer& b, size_t count, auto expected) {
      for (size_t i = 0; i < count; ++i) {
        const double want = expected(i);
        const double got = LoadValue(c.dtype, b.data(), i);
        if (got != want) {
          if (wrong == 0) {
            error = "element " + std::to_string(i) + " is " + std::to_string(got) +
                    ", expected " + std::to_string(want);
          }
          ++wrong;
        }
      }
    };

    Status status;
    switch (c.kind) {
      case Kind::kAllReduce: {
        Buffer send(c.dtype, n), recv(c.dtype, n);
        fill(send, 0, n, rank, 0);
        Buffer& out = c.in_place ? send : recv;
        Work w;
        Status s;
        if (c.async) {
          w = c.in_place ? comm_.AllReduceAsync(send.data(), send.data(), n, c.dtype, c.op, options)
                         : comm_.AllReduceAsync(send.data(), recv.data(), n, c.dtype, c.op, options);
        } else {
          s = c.in_place ? comm_.AllReduce(send.data(), n, c.dtype, c.op, options)
                         : comm_.AllReduce(send.data(), recv.data(), n, c.dtype, c.op, options);
        }
        status = finish(w, s);
        if (status.ok()) check(out, n, [&](size_t i) { return Reduce(c, serial, world, i); });
        break;
      }
      case Kind::kBroadcast: {
        Buffer b(c.dtype, n);
        if (rank == c.root) fill(b, 0, n, rank, 0);
        Work w;
        Status s;
        if (c.async) w = comm_.BroadcastAsync(b.data(), n, c.dtype, c.root, options);
        else s = comm_.Broadcast(b.data(), n, c.dtype, c.root, options);
        status = finish(w, s);
        if (status.ok()) check(b, n, [&](size_t i) { return InputValue(c, serial, c.root, i); });
        break;
      }
      case Kind::kAllGather: {
        Buffer recv(c.dtype, n * world), send(c.dtype, n);
        const void* src;
        if (c.in_place) {
          fill(recv, rank * n, n, rank, 0);
          src = static_cast<uint8_t*>(recv.data()) + rank * n * DataTypeSize(c.dtype);
        } else {
          fill(send, 0, n, rank, 0);
          src = send.data();
        }
        Work w;
        Status s;
        if (c.async) w = comm_.AllGatherAsync(src, recv.data(), n, c.dtype, options);
        else s = comm_.AllGather(src, recv.data(), n, c.dtype, options);
        status = finish(w, s);
        if (status.ok()) {
          check(recv, n * world,
                [&](size_t i) { return InputValue(c, serial, static_cast<int>(i / std::max<size_t>(n, 1)), i % std::max<size_t>(n, 1)); });
        }
        break;
      }
      case Kind::kReduceScatter: {
        // Element j of the full vector is indexed j on every rank, so block
        // r holds indices [r*n, (r+1)*n).
        Buffer send(c.dtype, n * world), recv(c.dtype, n);
        fill(send, 0, n * world, rank, 0);
        Work w;
        Status s;
        if (c.async) w = comm_.ReduceScatterAsync(send.data(), recv.data(), n, c.dtype, c.op, options);
        else s = comm_.ReduceScatter(send.data(), recv.data(), n, c.dtype, c.op, options);
        status = finish(w, s);
        if (status.ok()) {
          check(recv, n, [&](size_t i) { return Reduce(c, serial, world, rank * n + i); });
        }
        break;
      }
      case Kind::kBarrier: {
        status = c.async ? comm_.BarrierAsync(options).Wait() : comm_.Barrier(options);
        break;
      }
      case Kind::kSendRecv: {
        // A ring shift: send to the next rank, receive from the previous.
        const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
        Buffer send(c.dtype, n), recv(c.dtype, n);
        fill(send, 0, n, rank, 0);
        const uint32_t tag = static_cast<uint32_t>(serial & 0xffff);
        Work sw = comm_.SendAsync(send.data(), n, c.dtype, next, tag, options);
        Status rs = comm_.Recv(recv.data(), n, c.dtype, prev, tag, options);
        Status ss = sw.Wait();
        status = rs.ok() ? ss : rs;
        if (status.ok()) check(recv, n, [&](size_t i) { return InputValue(c, serial, prev, i); });
        break;
      }
    }
    if (!status.ok()) {
      error = status.ToString();
      return -1;
    }
    return wrong;
  }

 private:
  Communicator& comm_;
  const Flags& flags_;
};

std::string Describe(const Call& c, uint64_t serial) {
  std::string s = "op " + std::to_string(serial) + " " + KindName(c.kind) + " " +
                  DataTypeName(c.dtype) + " count " + std::to_string(c.count);
  if (c.kind == Kind::kAllReduce || c.kind == Kind::kReduceScatter) s += std::string(" ") + ReduceOpName(c.op);
  if (c.kind == Kind::kAllReduce) s += std::string(" algo ") + AlgorithmName(c.algorithm);
  if (c.kind == Kind::kBroadcast) s += " root " + std::to_string(c.root);
  s += c.in_place ? " in-place" : "";
  s += c.async ? " async" : "";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::transport::launch::SelfLaunchOptions launch;
  launch.default_nproc_per_node = 4;
  ddp::transport::launch::SelfLaunchOrExit(argc, argv, launch);
  const Flags flags = ParseFlags(argc, argv);

  CommunicatorOptions defaults;
  defaults.timeout = std::chrono::seconds(flags.timeout_s);
  auto created = Communicator::CreateFromEnvironment(defaults);
  if (!created.ok()) {
    std::fprintf(stderr, "soak: %s\n", created.status().ToString().c_str());
    return 1;
  }
  Communicator& comm = **created;
  const int rank = comm.rank();
  Soak soak(comm, flags);
  Rng rng(flags.seed);

  // Warm-up: every kind of call (and every all-reduce algorithm), blocking
  // and async, at the largest size in the widest dtype, so that whatever the
  // transport keeps for its largest message (scratch space, staging,
  // registrations) exists before the growth is measured.
  const long rss_before_warmup = ResidentKiB();
  {
    std::vector<Call> warmups;
    for (Kind kind : {Kind::kAllReduce, Kind::kBroadcast, Kind::kAllGather, Kind::kReduceScatter,
                      Kind::kBarrier, Kind::kSendRecv}) {
      const size_t n = kind == Kind::kAllGather || kind == Kind::kReduceScatter
                           ? std::max<size_t>(flags.max_count / comm.size(), 1)
                           : flags.max_count;
      for (Algorithm algo : kAlgorithms) {
        if (kind != Kind::kAllReduce && algo != Algorithm::kAuto) continue;
        for (int variant = 0; variant < 4; ++variant) {
          Call c;
          c.kind = kind;
          c.dtype = DataType::kF64;
          c.algorithm = algo;
          c.count = n;
          c.in_place = variant & 1;
          c.async = variant & 2;
          warmups.push_back(c);
        }
      }
    }
    for (size_t i = 0; i < warmups.size(); ++i) {
      std::string error;
      const uint64_t serial = (uint64_t{1} << 40) + i;  // apart from the measured ones
      const long wrong = soak.Run(warmups[i], serial, error);
      if (wrong != 0) {
        std::fprintf(stderr, "soak: rank %d: warm-up %s: %s\n", rank,
                     Describe(warmups[i], serial).c_str(), error.c_str());
        return 1;
      }
    }
  }
  std::vector<Sample> samples;
  samples.push_back(TakeSample(0));
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed_s = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  long done = 0, wrong_total = 0;
  long per_kind[6] = {};
  double seconds_per_kind[6] = {};
  for (uint64_t serial = 0;; ++serial) {
    if (flags.duration_s > 0) {
      // Every rank must stop at the same operation: rank 0 decides at each
      // sample point and broadcasts the decision.
      if (serial % flags.sample_every == 0) {
        int32_t stop = rank == 0 && elapsed_s() >= flags.duration_s;
        const Status s = comm.Broadcast(&stop, 1, DataType::kI32, 0);
        if (!s.ok()) {
          std::fprintf(stderr, "soak: rank %d: stop broadcast: %s\n", rank, s.ToString().c_str());
          return 1;
        }
        if (stop) break;
      }
    } else if (static_cast<long>(serial) >= flags.ops) {
      break;
    }
    Call call = DrawCall(rng, comm.size(), flags.max_count);
    while (!flags.kinds.empty() &&
           ("," + flags.kinds + ",").find(std::string(",") + KindName(call.kind) + ",") ==
               std::string::npos) {
      call = DrawCall(rng, comm.size(), flags.max_count);
    }
    std::string error;
    const auto op_start = std::chrono::steady_clock::now();
    const long wrong = soak.Run(call, serial, error);
    seconds_per_kind[static_cast<int>(call.kind)] +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - op_start).count();
    if (wrong != 0) {
      std::fprintf(stderr, "soak: rank %d: %s: %s%s\n", rank, Describe(call, serial).c_str(),
                   wrong < 0 ? "failed: " : (std::to_string(wrong) + " wrong elements, first: ").c_str(),
                   error.c_str());
      return 1;
    }
    wrong_total += wrong;
    ++per_kind[static_cast<int>(call.kind)];
    ++done;
    if (flags.leak_bytes_per_op > 0) {
      char* leaked = new char[flags.leak_bytes_per_op];
      std::memset(leaked, 1, flags.leak_bytes_per_op);
      asm volatile("" : : "r"(leaked) : "memory");  // kept, never freed
    }
    if (flags.leak_fd_every > 0 && done % flags.leak_fd_every == 0) {
      [[maybe_unused]] const int fd = open("/dev/null", O_RDONLY);
    }
    if (done == flags.helper_thread_at) {
      // A small stack, so that this short run's address-space slope shows
      // the thread count's bound alone, not an 8 MiB default stack.
      pthread_attr_t attr;
      pthread_attr_init(&attr);
      pthread_attr_setstacksize(&attr, 64 << 10);
      pthread_t helper;
      const int err = pthread_create(&helper, &attr, [](void*) -> void* { for (;;) pause(); }, nullptr);
      pthread_attr_destroy(&attr);
      if (err != 0) {
        std::fprintf(stderr, "soak: rank %d: cannot start the helper thread: %s\n", rank, std::strerror(err));
        return 1;
      }
      pthread_detach(helper);
    }
    if (flags.leak_thread_every > 0 && done % flags.leak_thread_every == 0) {
      std::thread([] { pause(); }).detach();  // blocked until the process ends
    }
    if (done % flags.sample_every == 0) samples.push_back(TakeSample(done));
  }
  const double seconds = elapsed_s();
  if (samples.back().ops != done) samples.push_back(TakeSample(done));

  const size_t first = std::min(static_cast<size_t>(flags.warmup * samples.size()),
                                samples.size() - 1);
  const auto slope = [&](auto field) { return SlopePer1000(samples, first, field); };
  const double rss_slope = slope([](const Sample& x) { return x.rss_kib; });
  const double private_slope = slope([](const Sample& x) { return x.anon_kib; });
  const double shared_slope = slope([](const Sample& x) { return x.shmem_kib; });
  const double heap_slope = slope([](const Sample& x) { return x.heap_kib; });
  const double vm_slope = slope([](const Sample& x) { return x.vm_kib; });
  const double fd_slope = slope([](const Sample& x) { return x.fds; });
  const Sample& warm = samples[first];
  const Sample& last = samples.back();

  std::printf(
      "soak rank %d: %ld ops in %.1f s (%.0f ops/s), every element checked, %ld wrong; "
      "all_reduce %ld broadcast %ld all_gather %ld reduce_scatter %ld barrier %ld send_recv %ld\n",
      rank, done, seconds, done / std::max(seconds, 1e-9), static_cast<long>(wrong_total), per_kind[0],
      per_kind[1], per_kind[2],
      per_kind[3], per_kind[4], per_kind[5]);
  std::printf("soak rank %d: mean ms per call:", rank);
  for (int k = 0; k < 6; ++k) {
    std::printf(" %s %.2f", KindName(static_cast<Kind>(k)),
                per_kind[k] ? 1000 * seconds_per_kind[k] / per_kind[k] : 0.0);
  }
  std::printf("\n");
  if (flags.print_samples) {
    for (const Sample& x : samples) {
      std::printf("soak rank %d: sample ops %ld rss_kib %ld fds %d heap_kib %ld anon_kib %ld "
                  "shmem_kib %ld vm_kib %ld maps %d\n",
                  rank, x.ops, x.rss_kib, x.fds, x.heap_kib, x.anon_kib, x.shmem_kib, x.vm_kib,
                  x.maps);
    }
  }
  // Growth is measured from op `warm.ops` (after the warm-up share of the
  // samples) to the end, as a least-squares slope per 1000 operations.
  std::printf(
      "soak rank %d: growth per 1000 ops from op %ld to %ld: resident %+.1f KiB (%ld -> %ld KiB; "
      "bound %.0f), of which private %+.1f KiB (bound %.0f) and shared-memory pages %+.1f KiB; "
      "malloc heap in use %+.1f KiB (%ld -> %ld KiB; bound %.0f); address space %+.1f KiB "
      "(%ld -> %ld KiB; bound %.0f); mappings %d -> %d; open fds %+.2f (%d -> %d; bound %.2f); "
      "threads %ld -> %ld\n",
      rank, warm.ops, last.ops, rss_slope, warm.rss_kib, last.rss_kib, flags.max_rss_kib_per_1000,
      private_slope, flags.max_private_kib_per_1000, shared_slope, heap_slope, warm.heap_kib,
      last.heap_kib, flags.max_private_kib_per_1000, vm_slope, warm.vm_kib, last.vm_kib,
      flags.max_private_kib_per_1000, warm.maps, last.maps, fd_slope, warm.fds, last.fds,
      flags.max_fds_per_1000, warm.threads, last.threads);
  std::printf("soak rank %d: resident %ld KiB before the warm-up calls, %ld KiB after them\n", rank,
              rss_before_warmup, samples.front().rss_kib);
  std::fflush(stdout);

  // Shared-memory pages fill in as the intra-host path first uses them; they
  // are bounded by the address space, which is held flat below. A leak shows
  // in private memory, the heap, the address space, mappings or fds.
  std::vector<std::string> problems;
  const auto bound = [&](bool ok, const std::string& what) {
    if (!ok) problems.push_back(what);
  };
  if (kSanitizerAllocator) {
    std::printf("soak rank %d: memory bounds not enforced under a sanitizer's allocator "
                "(LeakSanitizer checks leaks at exit)\n",
                rank);
  }
  const auto memory_bound = [&](bool ok, const std::string& what) {
    bound(ok || kSanitizerAllocator, what);
  };
  char buf[256];
  std::snprintf(buf, sizeof(buf), "resident memory grows %.1f KiB per 1000 ops (bound %.0f)",
                rss_slope, flags.max_rss_kib_per_1000);
  memory_bound(rss_slope <= flags.max_rss_kib_per_1000, buf);
  std::snprintf(buf, sizeof(buf), "private resident memory grows %.1f KiB per 1000 ops (bound %.0f)",
                private_slope, flags.max_private_kib_per_1000);
  memory_bound(private_slope <= flags.max_private_kib_per_1000, buf);
  std::snprintf(buf, sizeof(buf), "malloc heap in use grows %.1f KiB per 1000 ops (bound %.0f)",
                heap_slope, flags.max_private_kib_per_1000);
  memory_bound(heap_slope <= flags.max_private_kib_per_1000, buf);
  std::snprintf(buf, sizeof(buf), "address space grows %.1f KiB per 1000 ops (bound %.0f)",
                vm_slope, flags.max_private_kib_per_1000);
  memory_bound(vm_slope <= flags.max_private_kib_per_1000, buf);
  std::snprintf(buf, sizeof(buf), "mappings grow from %d to %d", warm.maps, last.maps);
  memory_bound(last.maps <= warm.maps + 2, buf);
  std::snprintf(buf, sizeof(buf), "open file descriptors grow from %d to %d (%.2f per 1000 ops)",
                warm.fds, last.fds, fd_slope);
  bound(fd_slope <= flags.max_fds_per_1000 && last.fds <= warm.fds + 1, buf);
  // The threads the transport needs per operation exist after the warm-up
  // calls. A helper may start later, once (the store's log writer on its
  // first line, a resolver on a reconnect): two are allowed, as for fds and
  // mappings; a thread left behind by operations grows past that.
  std::snprintf(buf, sizeof(buf), "threads grow from %ld to %ld (at most 2 more allowed)",
                warm.threads, last.threads);
  bound(last.threads <= warm.threads + 2, buf);
  // The intra-host segments are unlinked once every local rank mapped them:
  // a name of this process's left in /dev/shm outlives the job.
  const std::vector<std::string> left = SegmentsNamedForThisProcess();
  if (!left.empty()) {
    std::string names;
    for (const std::string& n : left) names += " " + n;
    bound(false, "shared-memory files left in /dev/shm:" + names);
  }
  for (const std::string& p : problems) std::fprintf(stderr, "soak: rank %d: %s\n", rank, p.c_str());
  const int failed = problems.empty() ? 0 : 1;
  // Everyone finishes together, so the report is complete before anyone exits.
  const Status s = comm.Barrier();
  if (!s.ok()) {
    std::fprintf(stderr, "soak: rank %d: final barrier: %s\n", rank, s.ToString().c_str());
    return 1;
  }
  return failed;
}
