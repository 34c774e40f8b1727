// UsableCpus on a host with more CPUs than a fixed cpu_set_t holds (1,024):
// the kernel refuses a mask smaller than its own (EINVAL), as it does on
// such hosts. This binary's sched_getaffinity plays that kernel.

#include <dlfcn.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

#include "transport/topology/cpus.h"

namespace {
// The CPU count of the kernel played (0: pass calls to the real one's
// figures) and how many of its CPUs this process may run on, the highest
// numbered ones (a container's cpuset at the end of a big host).
std::atomic<int> kernel_cpus{0};
std::atomic<int> allowed_cpus{0};
// Whether /proc/self/cgroup reads as missing, so that no CPU quota of the
// machine running the test caps the count compared.
std::atomic<bool> hide_cgroups{false};
std::atomic<int> hidden_reads{0};
}  // namespace

namespace {
// The mask last given to the interposed sched_setaffinity while a kernel
// is played, as CPU numbers (the real kernel is not asked: it has no such
// CPUs).
std::atomic<int> set_calls{0};
std::vector<int> set_cpus;
}  // namespace

extern "C" int sched_setaffinity(pid_t pid, size_t size, const cpu_set_t* mask) noexcept {
  const int cpus = kernel_cpus.load();
  if (cpus == 0) return static_cast<int>(syscall(SYS_sched_setaffinity, pid, size, mask));
  set_cpus.clear();
  for (int c = 0; c < static_cast<int>(size) * 8; ++c) {
    if (CPU_ISSET_S(c, size, mask)) set_cpus.push_back(c);
  }
  ++set_calls;
  return 0;
}

extern "C" FILE* fopen(const char* path, const char* mode) {
  if (hide_cgroups.load() && std::string_view(path) == "/proc/self/cgroup") {
    ++hidden_reads;
    errno = ENOENT;
    return nullptr;
  }
  using Fopen = FILE* (*)(const char*, const char*);
  static const Fopen real = reinterpret_cast<Fopen>(dlsym(RTLD_NEXT, "fopen"));
  return real(path, mode);
}

extern "C" int sched_getaffinity(pid_t, size_t size, cpu_set_t* mask) noexcept {
  const int cpus = kernel_cpus.load();
  if (cpus == 0) {
    // The real kernel's answer, as the C library gives it: 0, and the mask
    // past the kernel's own size cleared.
    const long got = syscall(SYS_sched_getaffinity, 0, size, mask);
    if (got < 0) return -1;
    std::memset(reinterpret_cast<char*>(mask) + got, 0, size - static_cast<size_t>(got));
    return 0;
  }
  const size_t needed = static_cast<size_t>(cpus + 7) / 8;
  if (size < needed) {
    errno = EINVAL;
    return -1;
  }
  std::memset(mask, 0, size);
  for (int c = cpus - allowed_cpus.load(); c < cpus; ++c) CPU_SET_S(c, size, mask);
  return 0;
}

namespace ddp::transport::topology {
namespace {

// A container given a few CPUs of a 2,048-CPU host counted every CPU the
// host has online (the fallback for a mask that could not be read), not
// the few it may run on, so ranks and threads were sized for the host.
TEST(UsableCpus, FollowsTheAffinityMaskOnAHostOfMoreThan1024Cpus) {
  // One more than this machine has online, so that the online count (the
  // old fallback) cannot give the same answer.
  const int allowed = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)) + 1;
  // A quota caps both this answer and the old fallback (often to the same
  // count), so the cgroup files are hidden.
  hide_cgroups = true;
  ASSERT_EQ(CpuQuota(), std::nullopt);
  ASSERT_GT(hidden_reads.load(), 0) << "CpuQuota read /proc/self/cgroup past the interposed fopen";
  kernel_cpus = 2048;
  allowed_cpus = allowed;
  const int usable = UsableCpus();
  kernel_cpus = 0;
  hide_cgroups = false;
  EXPECT_EQ(usable, allowed);
}

// BindToCore (communicator option bind_to_core) read the mask into a fixed
// 1,024-CPU cpu_set_t: on a bigger host the read failed (EINVAL) and the
// thread was silently left unbound, and a CPU numbered 1,024 or above could
// never be chosen.
TEST(BindToAllowedCpu, PinsToTheIndexedAllowedCpuOnAHostOfMoreThan1024Cpus) {
  kernel_cpus = 2048;
  allowed_cpus = 3;  // CPUs 2045, 2046 and 2047
  set_calls = 0;
  const bool first = BindToAllowedCpu(0);
  const int first_calls = set_calls.load();
  const std::vector<int> first_cpus = set_cpus;
  const bool fifth = BindToAllowedCpu(4);  // modulo the 3 allowed
  const std::vector<int> fifth_cpus = set_cpus;
  kernel_cpus = 0;
  EXPECT_TRUE(first);
  ASSERT_EQ(first_calls, 1) << "the thread's affinity was not set";
  EXPECT_EQ(first_cpus, std::vector<int>{2045});
  EXPECT_TRUE(fifth);
  EXPECT_EQ(fifth_cpus, std::vector<int>{2046});
}

TEST(BindToAllowedCpu, ANegativeIndexLeavesTheThreadAsItWas) {
  kernel_cpus = 2048;
  allowed_cpus = 3;
  set_calls = 0;
  const bool bound = BindToAllowedCpu(-1);
  kernel_cpus = 0;
  EXPECT_FALSE(bound);
  EXPECT_EQ(set_calls.load(), 0);
}

}  // namespace
}  // namespace ddp::transport::topology
