#ifndef DDP_TRANSPORT_TOPOLOGY_CPUS_H_
#define DDP_TRANSPORT_TOPOLOGY_CPUS_H_

// How many CPUs this process can keep busy: the CPUs of its affinity mask,
// capped by a CPU quota of its cgroup (a container started with --cpus=N,
// a Kubernetes CPU limit). The quota is what a container's scheduler
// enforces: a job that counts only the affinity mask (every core of the
// host) spins and runs as many ranks as cores while it is given a few.

#include <optional>
#include <string>

namespace ddp::transport::topology {

/// The CPUs of the calling thread's affinity mask, of any size (the online
/// count when the mask cannot be read), capped by CpuQuota() rounded up; at
/// least 1. A thread that BindToAllowedCpu pinned counts 1: count first.
int UsableCpus();

/// Pins the calling thread to the `index`-th CPU (modulo their count) of
/// its affinity mask, a mask of any size; false, leaving the thread as it
/// was, when `index` is negative or the mask cannot be read or set.
bool BindToAllowedCpu(int index);

/// The CPU quota of this process's cgroup and its ancestors, in CPUs (the
/// least of those that set one), read from cgroup v2's cpu.max or v1's
/// cpu.cfs_quota_us / cpu.cfs_period_us; nullopt when none sets a quota or
/// the files cannot be read.
std::optional<double> CpuQuota();

/// CpuQuota() from `proc_self_cgroup` (the text of /proc/self/cgroup) and
/// the cgroup file systems mounted under `cgroup_root` (/sys/fs/cgroup):
/// v2's hierarchy at the root itself or at `unified/`, v1's cpu controller
/// at `cpu/`, `cpu,cpuacct/` or `cpuacct,cpu/`. For tests.
std::optional<double> CpuQuotaFrom(const std::string& proc_self_cgroup, const std::string& cgroup_root);

}  // namespace ddp::transport::topology

#endif  // DDP_TRANSPORT_TOPOLOGY_CPUS_H_
