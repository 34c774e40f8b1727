#include "transport/topology/cpus.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

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

// Reads the file at `path` (a FIFO made here) on another thread with
// `read`, and returns the flags (/proc/self/fdinfo, octal "flags:") of the
// descriptor it opened on it, or -1 when none showed within 10 s. The
// FIFO holds the reader's open until this side opens it for writing, and
// its read until this side closes it, so the descriptor is there to look at.
int FlagsOfTheReadersDescriptor(const std::string& path, const std::function<void()>& read) {
  if (mkfifo(path.c_str(), 0600) != 0) return -1;
  std::thread reader(read);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int writer = -1;
  // Non-blocking: ENXIO until the reader has it open.
  while ((writer = open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC)) < 0 &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  int flags = -1;
  const std::string target = std::filesystem::canonical(path).string();
  while (writer >= 0 && flags < 0 && std::chrono::steady_clock::now() < until) {
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code error;
      const int fd = std::stoi(entry.path().filename().string());
      if (fd == writer || std::filesystem::read_symlink(entry.path(), error).string() != target) continue;
      std::ifstream info("/proc/self/fdinfo/" + std::to_string(fd));
      for (std::string line; std::getline(info, line);) {
        if (line.rfind("flags:", 0) == 0) flags = static_cast<int>(std::stol(line.substr(6), nullptr, 8));
      }
    }
    if (flags < 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (writer >= 0) close(writer);  // the reader sees the end of the file
  reader.join();
  unlink(path.c_str());
  return flags;
}

// The cgroup files are opened close-on-exec: a fork and exec on another
// thread of the host program meanwhile must not inherit them.
TEST(CpuQuota, OpensTheFilesCloseOnExec) {
  FakeCgroups cg;
  const int flags = FlagsOfTheReadersDescriptor(cg.root() + "/cpu.max", [&] {
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
