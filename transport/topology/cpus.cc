#include "transport/topology/cpus.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "transport/file_text.h"

namespace ddp::transport::topology {
namespace {

// The file's first line; nullopt when it cannot be read or is empty.
std::optional<std::string> FirstLine(const std::string& path) {
  std::optional<std::string> text = ReadWholeFile(path);
  if (!text || text->empty()) return std::nullopt;
  return text->substr(0, text->find('\n'));
}

// A whole non-negative decimal number, or nullopt.
std::optional<double> Number(const std::string& text) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  try {
    return std::stod(text);
  } catch (...) {
    return std::nullopt;
  }
}

// The folders from `path` (a cgroup's path, "/a/b") up to the root: "/a/b",
// "/a", "".
std::vector<std::string> SelfAndAncestors(std::string path) {
  std::vector<std::string> out;
  while (!path.empty() && path.back() == '/') path.pop_back();
  for (;;) {
    out.push_back(path);
    if (path.empty()) break;
    const size_t slash = path.rfind('/');
    path = slash == std::string::npos ? "" : path.substr(0, slash);
  }
  return out;
}

// v2: "max 100000" (no quota) or "<quota> <period>".
std::optional<double> QuotaV2(const std::string& folder) {
  const std::optional<std::string> line = FirstLine(folder + "/cpu.max");
  if (!line) return std::nullopt;
  std::istringstream in(*line);
  std::string quota, period;
  in >> quota >> period;
  const std::optional<double> q = Number(quota), p = Number(period);
  if (!q || !p || *p <= 0 || *q <= 0) return std::nullopt;
  return *q / *p;
}

// v1: cpu.cfs_quota_us is -1 without a quota.
std::optional<double> QuotaV1(const std::string& folder) {
  const std::optional<std::string> quota = FirstLine(folder + "/cpu.cfs_quota_us");
  const std::optional<std::string> period = FirstLine(folder + "/cpu.cfs_period_us");
  if (!quota || !period) return std::nullopt;
  const std::optional<double> q = Number(*quota), p = Number(*period);
  if (!q || !p || *p <= 0 || *q <= 0) return std::nullopt;
  return *q / *p;
}

// The least quota of the folders from `mount` + `path` up to `mount`.
std::optional<double> LeastQuota(const std::string& mount, const std::string& path, bool v2) {
  std::optional<double> least;
  for (const std::string& folder : SelfAndAncestors(path)) {
    const std::optional<double> q = v2 ? QuotaV2(mount + folder) : QuotaV1(mount + folder);
    if (q && (!least || *q < *least)) least = q;
  }
  return least;
}

// Linux builds for at most 8,192 CPUs; a mask of this many is far beyond.
constexpr int kMostCpus = 1 << 16;

// The CPUs of the calling thread's affinity mask, in increasing order;
// empty when it cannot be read. A fixed cpu_set_t holds 1,024 CPUs, and
// the kernel refuses (EINVAL) a mask smaller than its own: on a bigger
// host the mask grows until it fits.
std::vector<int> AllowedCpus() {
  std::vector<int> cpus;
  for (int size = CPU_SETSIZE; size <= kMostCpus; size *= 2) {
    cpu_set_t* set = CPU_ALLOC(size);
    if (set == nullptr) break;
    const size_t bytes = CPU_ALLOC_SIZE(size);
    const bool read = sched_getaffinity(0, bytes, set) == 0;
    const bool too_small = !read && errno == EINVAL;  // before free() may change errno
    if (read) {
      for (int c = 0; c < static_cast<int>(bytes) * 8; ++c) {
        if (CPU_ISSET_S(c, bytes, set)) cpus.push_back(c);
      }
    }
    CPU_FREE(set);
    if (!too_small) break;
  }
  return cpus;
}

}  // namespace

std::optional<double> CpuQuotaFrom(const std::string& proc_self_cgroup, const std::string& cgroup_root) {
  std::optional<double> least;
  const auto take = [&least](std::optional<double> q) {
    if (q && (!least || *q < *least)) least = q;
  };
  std::istringstream lines(proc_self_cgroup);
  std::string line;
  while (std::getline(lines, line)) {
    // "<id>:<controllers>:<path>"; v2's line is "0::<path>".
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? std::string::npos : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string id = line.substr(0, first);
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    if (id == "0" && controllers.empty()) {
      take(LeastQuota(cgroup_root, path, /*v2=*/true));
      take(LeastQuota(cgroup_root + "/unified", path, /*v2=*/true));
      continue;
    }
    std::vector<std::string> names;
    std::istringstream split(controllers);
    for (std::string name; std::getline(split, name, ',');) names.push_back(name);
    if (std::find(names.begin(), names.end(), "cpu") == names.end()) continue;
    for (const char* mount : {"/cpu", "/cpu,cpuacct", "/cpuacct,cpu"}) {
      take(LeastQuota(cgroup_root + mount, path, /*v2=*/false));
    }
  }
  return least;
}

std::optional<double> CpuQuota() {
  const std::optional<std::string> text = ReadWholeFile("/proc/self/cgroup");
  if (!text) return std::nullopt;
  return CpuQuotaFrom(*text, "/sys/fs/cgroup");
}

int UsableCpus() {
  // Only where the mask cannot be read is the online count taken, which
  // ignores a container's cpuset.
  long cpus = static_cast<long>(AllowedCpus().size());
  if (cpus == 0) cpus = sysconf(_SC_NPROCESSORS_ONLN);
  if (const std::optional<double> quota = CpuQuota()) {
    cpus = std::min(cpus, static_cast<long>(std::ceil(*quota)));
  }
  return static_cast<int>(std::max(1L, cpus));
}

bool BindToAllowedCpu(int index) {
  const std::vector<int> cpus = AllowedCpus();
  if (cpus.empty() || index < 0) return false;
  const int cpu = cpus[static_cast<size_t>(index) % cpus.size()];
  cpu_set_t* one = CPU_ALLOC(cpu + 1);
  if (one == nullptr) return false;
  const size_t bytes = CPU_ALLOC_SIZE(cpu + 1);
  CPU_ZERO_S(bytes, one);
  CPU_SET_S(cpu, bytes, one);
  const bool bound = sched_setaffinity(0, bytes, one) == 0;
  CPU_FREE(one);
  return bound;
}

}  // namespace ddp::transport::topology
