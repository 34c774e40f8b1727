// Upper bound for a zero-copy all-reduce on one host: 2 processes whose
// buffers both live in one shared mapping, so that each rank folds its half
// of the vector with plain loads and stores into both buffers (no staging
// copy, no process_vm_readv/writev). ShmAllReduce's direct path cannot do
// that with a caller's private buffer; this probe measures what it would
// gain if the buffers were shareable (DDP's buckets, say). Compare with
// `allreduce_bench --nproc_per_node=2` in the same minute.
//
//   bazel run //transport/shm:shared_mapping_probe -- [ITERS]
//
// Prints one line per size: bytes, microseconds per all-reduce, algorithm
// bandwidth, and whether every element came out right.

#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

using Clock = std::chrono::steady_clock;

struct alignas(64) Counter {
  std::atomic<int64_t> value{0};
};

struct Control {
  Counter arrived[2];
  Counter done[2];
};

// Waits until both ranks' counters reach `target`; exits the process after
// 10 s (the peer died or hangs), so that the probe never blocks for good.
void WaitBoth(Counter* counters, int64_t target) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (counters[0].value.load(std::memory_order_acquire) < target ||
         counters[1].value.load(std::memory_order_acquire) < target) {
    if (Clock::now() > deadline) {
      std::fprintf(stderr, "shared_mapping_probe: the other rank did not arrive within 10 s\n");
      std::_Exit(2);
    }
    sched_yield();
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 400;
  if (iters <= 0) {
    std::fprintf(stderr, "shared_mapping_probe: ITERS must be a positive number, got '%s'\n", argv[1]);
    return 2;
  }
  constexpr int64_t kMaxFloats = int64_t{4} << 20;  // 16 MiB per rank
  const size_t bytes = 4096 + 2 * kMaxFloats * sizeof(float);
  void* mapping = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED) {
    std::perror("shared_mapping_probe: mmap");
    return 1;
  }
  auto* control = new (mapping) Control();
  float* buffers[2] = {reinterpret_cast<float*>(static_cast<char*>(mapping) + 4096),
                       reinterpret_cast<float*>(static_cast<char*>(mapping) + 4096) + kMaxFloats};
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) {
    std::perror("shared_mapping_probe: fork");
    return 1;
  }
  const int rank = child == 0 ? 1 : 0;
  if (rank == 1) {
    // No orphan if rank 0 dies, before this call too.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
  }
  float* own = buffers[rank];
  float* peer = buffers[1 - rank];
  int64_t call = 0;
  bool all_right = true;
  if (rank == 0) std::printf("bytes us_per_allreduce algbw_GB/s correct\n");
  for (int64_t n = int64_t{128} << 10; n <= kMaxFloats; n *= 2) {
    const int64_t lo = rank == 0 ? 0 : n / 2, hi = rank == 0 ? n / 2 : n;
    Clock::duration timed{};
    for (int it = -10; it < iters; ++it) {
      // Each call reduces fresh inputs (rank r holds r + 1), as gradients are.
      for (int64_t i = 0; i < n; ++i) own[i] = static_cast<float>(rank + 1);
      ++call;
      control->arrived[rank].value.store(call, std::memory_order_release);
      WaitBoth(control->arrived, call);
      const Clock::time_point start = Clock::now();
      for (int64_t i = lo; i < hi; ++i) {
        const float sum = own[i] + peer[i];
        own[i] = sum;
        peer[i] = sum;
      }
      control->done[rank].value.store(call, std::memory_order_release);
      WaitBoth(control->done, call);
      if (it >= 0) timed += Clock::now() - start;
    }
    const double seconds = std::chrono::duration<double>(timed).count();
    for (int64_t i = 0; i < n; ++i) all_right = all_right && own[i] == 3.0f;
    // Timed: from both ranks' arrival to both ranks' completion (the
    // refill before each call is not timed, as allreduce_bench does not
    // write its buffers between calls).
    if (rank == 0) {
      const double per_call = seconds / iters;
      std::printf("%lld %.1f %.2f %s\n", static_cast<long long>(n * sizeof(float)), per_call * 1e6,
                  static_cast<double>(n * sizeof(float)) / per_call / 1e9, all_right ? "yes" : "NO");
    }
  }
  if (rank == 1) std::_Exit(all_right ? 0 : 1);
  int status = 0;
  waitpid(child, &status, 0);
  return all_right && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
