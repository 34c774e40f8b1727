#ifndef DDP_NN_OPTIM_KERNEL_UTIL_H_
#define DDP_NN_OPTIM_KERNEL_UTIL_H_

// Helpers for the update loops: options become template constants so each
// loop is branch-free and the compiler vectorizes it.

#include <atomic>
#include <type_traits>

// The update loops are compiled twice: for the baseline x86-64 (SSE2) and
// for AVX2, chosen at run time from CPUID, so that the build stays portable
// (no -mavx2 on the command line). AVX2 without FMA: no multiply-add can be
// contracted, so both give the same results bit for bit (every loop is
// element by element, with IEEE operations only). The loops and the lambdas
// that call them are forced inline into the attributed runners, where they
// are vectorized for the runner's ISA.
#define DDP_OPTIM_INLINE __attribute__((always_inline)) inline
#define DDP_OPTIM_LAMBDA_INLINE __attribute__((always_inline))

namespace ddp::nn::optim::internal {

/// For tests: when set, the loops run their baseline build on any CPU.
inline std::atomic<bool> baseline_loops_for_testing{false};

#if defined(__x86_64__)
inline bool CpuHasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

template <typename Loop>
__attribute__((target("avx2"), noinline)) void RunAvx2(const Loop& loop) {
  loop();
}

template <typename Loop>
__attribute__((noinline)) void RunBaseline(const Loop& loop) {
  loop();
}

/// Runs `loop` (a lambda marked DDP_OPTIM_LAMBDA_INLINE whose loop function
/// is DDP_OPTIM_INLINE) compiled for the widest ISA this CPU has.
template <typename Loop>
void RunVectorized(const Loop& loop) {
  if (CpuHasAvx2() && !baseline_loops_for_testing.load(std::memory_order_relaxed)) {
    RunAvx2(loop);
  } else {
    RunBaseline(loop);
  }
}
#else
template <typename Loop>
void RunVectorized(const Loop& loop) {
  loop();
}
#endif

/// Calls f(std::true_type) or f(std::false_type).
template <typename F>
void WithFlag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

}  // namespace ddp::nn::optim::internal

#endif  // DDP_NN_OPTIM_KERNEL_UTIL_H_
