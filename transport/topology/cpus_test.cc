#include "transport/topology/cpus.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "transport/testing/reader_descriptor_flags.h"

namespace ddp::transport::topology {
namespace {

namespace fs = std::filesystem;

// A fake cgroup tree under a temporary folder.
class FakeCgroups {
 public:
  FakeCgroups() {
    char pattern[] = "/tmp/cpus_test_XXXXXX";
    root_ = mkdtemp(pattern);
  }
  ~FakeCgroups() { fs::remove_all(root_); }
  const std::string& root() const { return root_; }
  void Write(const std::string& relative, const std::string& text) {
    const fs::path path = fs::path(root_) / relative;
    fs::create_directories(path.parent_path());
    std::ofstream(path) << text << "\n";
  }

 private:
  std::string root_;
};

// The cgroup files are opened close-on-exec: a fork and exec on another
// thread of the host program meanwhile must not inherit them.
TEST(CpuQuota, OpensTheFilesCloseOnExec) {
  FakeCgroups cg;
  const int flags = testing::FlagsOfTheReadersDescriptor(cg.root() + "/cpu.max", [&] {
    static_cast<void>(CpuQuotaFrom("0::/\n", cg.root()));
  });
  ASSERT_GE(flags, 0) << "the reader's descriptor was not seen";
  EXPECT_NE(flags & O_CLOEXEC, 0) << std::oct << flags;
}

TEST(CpuQuota, CgroupV2TakesTheLeastQuotaOfTheCgroupAndItsAncestors) {
  FakeCgroups cg;
  cg.Write("cpu.max", "max 100000");
  cg.Write("kubepods/cpu.max", "600000 100000");      // 6 CPUs
  cg.Write("kubepods/pod1/cpu.max", "max 100000");    // none of its own
  cg.Write("kubepods/pod1/c1/cpu.max", "250000 100000");  // 2.5 CPUs
  EXPECT_EQ(CpuQuotaFrom("0::/kubepods/pod1/c1\n", cg.root()), 2.5);
  EXPECT_EQ(CpuQuotaFrom("0::/kubepods/pod1\n", cg.root()), 6.0);
  EXPECT_EQ(CpuQuotaFrom("0::/\n", cg.root()), std::nullopt);
  // A path that is not there (a host path seen from inside a container):
  // the folders that are (the root) still count.
  cg.Write("cpu.max", "150000 100000");
  EXPECT_EQ(CpuQuotaFrom("0::/docker/abc\n", cg.root()), 1.5);
}

TEST(CpuQuota, CgroupV2UnderUnifiedAndV1CpuControllerAreRead) {
  FakeCgroups cg;
  cg.Write("unified/job/cpu.max", "400000 100000");
  EXPECT_EQ(CpuQuotaFrom("0::/job\n", cg.root()), 4.0);
  FakeCgroups v1;
  v1.Write("cpu,cpuacct/cpu.cfs_quota_us", "-1");
  v1.Write("cpu,cpuacct/cpu.cfs_period_us", "100000");
  v1.Write("cpu,cpuacct/docker/x/cpu.cfs_quota_us", "300000");
  v1.Write("cpu,cpuacct/docker/x/cpu.cfs_period_us", "100000");
  const std::string self = "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n0::/\n";
  EXPECT_EQ(CpuQuotaFrom(self, v1.root()), 3.0);
  // Only the cpu controller's line counts.
  EXPECT_EQ(CpuQuotaFrom("12:memory:/docker/x\n", v1.root()), std::nullopt);
  // No quota anywhere (-1), and files that do not parse, mean none.
  v1.Write("cpu,cpuacct/docker/x/cpu.cfs_quota_us", "-1");
  EXPECT_EQ(CpuQuotaFrom(self, v1.root()), std::nullopt);
  v1.Write("cpu,cpuacct/docker/x/cpu.cfs_quota_us", "lots");
  EXPECT_EQ(CpuQuotaFrom(self, v1.root()), std::nullopt);
  FakeCgroups bad;
  bad.Write("cpu.max", "100000 0");
  EXPECT_EQ(CpuQuotaFrom("0::/\n", bad.root()), std::nullopt);
  EXPECT_EQ(CpuQuotaFrom("garbage\n\n", bad.root()), std::nullopt);
}

TEST(UsableCpus, IsTheAffinityMaskCappedByThisMachinesQuota) {
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  int want = CPU_COUNT(&set);
  if (const auto quota = CpuQuota()) want = std::min(want, static_cast<int>(std::ceil(*quota)));
  EXPECT_EQ(UsableCpus(), std::max(1, want));
}

}  // namespace
}  // namespace ddp::transport::topology
