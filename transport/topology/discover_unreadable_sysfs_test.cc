// ReadNetDevices where a sysfs folder's listing fails part way (a device
// unplugged or its driver unbound while the folder is read, which the
// kernel answers with an error such as ENODEV or EIO): this binary's
// readdir plays that kernel for folders whose path has a marker in it.

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>

#include "transport/topology/discover.h"

namespace {
// Folders whose path ends with one of these fail (EIO) once one entry
// other than "." and ".." has been listed.
const char* const kFailingFolders[] = {"/fail_sys/class/infiniband", "/fail_sys/class/infiniband/mlx5_0/ports"};
std::mutex listed_mutex;
std::map<DIR*, int> listed;  // entries listed so far per failing folder
std::atomic<int> failures{0};
// Only while the code under test lists (the test's own set-up and clean-up
// list the same folders).
std::atomic<bool> failing_on{false};

bool Failing(DIR* dir) {
  char link[64];
  char path[PATH_MAX] = {};
  std::snprintf(link, sizeof(link), "/proc/self/fd/%d", dirfd(dir));
  const ssize_t n = readlink(link, path, sizeof(path) - 1);
  if (n <= 0) return false;
  const std::string text(path, static_cast<size_t>(n));
  for (const char* end : kFailingFolders) {
    const size_t len = std::strlen(end);
    if (text.size() >= len && text.compare(text.size() - len, len, end) == 0) return true;
  }
  return false;
}
}  // namespace

extern "C" struct dirent* readdir(DIR* dir) {
  using Readdir = struct dirent* (*)(DIR*);
  static const Readdir real = reinterpret_cast<Readdir>(dlsym(RTLD_NEXT, "readdir"));
  if (!failing_on.load() || !Failing(dir)) return real(dir);
  std::lock_guard<std::mutex> lock(listed_mutex);
  if (listed[dir] >= 1) {
    ++failures;
    errno = EIO;
    return nullptr;
  }
  struct dirent* entry = real(dir);
  if (entry != nullptr && std::strcmp(entry->d_name, ".") != 0 && std::strcmp(entry->d_name, "..") != 0) {
    ++listed[dir];
  }
  return entry;
}

namespace ddp::transport::topology {
namespace {

namespace fs = std::filesystem;

void Write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text << "\n";
}

// A listing that fails part way ended discovery (and so the communicator's
// creation) with a filesystem_error thrown out of ReadNetDevices. What was
// listed before the failure is kept; the rest of that folder is skipped,
// and a warning names the folder and its error (the list was cut short
// without a word).
// A sysfs root of its own (the warning is given once per folder, and the
// tests may run again in this process), with two ports of mlx5_0 and one
// of mlx5_1, all active.
fs::path FailingRoot() {
  static int count = 0;
  const fs::path root = fs::path(::testing::TempDir()) / ("run" + std::to_string(count++)) / "fail_sys";
  fs::remove_all(root);
  const fs::path ib = root / "class" / "infiniband";
  for (const char* port : {"1", "2"}) {
    Write(ib / "mlx5_0" / "ports" / port / "state", "4: ACTIVE");
  }
  Write(ib / "mlx5_1" / "ports" / "1" / "state", "4: ACTIVE");
  return root;
}

// ReadNetDevices(root) with the listings failing; what it wrote to stderr.
std::string ReadFailing(const fs::path& root, std::vector<NetDevice>* devices) {
  {
    // A DIR* of an earlier call may be handed out again for another folder.
    std::lock_guard<std::mutex> lock(listed_mutex);
    listed.clear();
  }
  failures = 0;
  failing_on = true;
  ::testing::internal::CaptureStderr();
  try {
    *devices = ReadNetDevices(root.string());
  } catch (const std::exception& e) {
    ADD_FAILURE() << "ReadNetDevices threw: " << e.what();
  }
  const std::string warned = ::testing::internal::GetCapturedStderr();
  failing_on = false;
  return warned;
}

TEST(ReadNetDevices, AFolderWhoseListingFailsPartWayIsSkippedFromThere) {
  const fs::path root = FailingRoot();
  const fs::path ib = root / "class" / "infiniband";
  std::vector<NetDevice> devices;
  const std::string warned = ReadFailing(root, &devices);
  const std::string eio = std::string("(") + std::strerror(EIO) + ", errno " + std::to_string(EIO) + ")";
  EXPECT_NE(warned.find("warning: RDMA port discovery: the listing of " + ib.string()), std::string::npos)
      << warned;
  EXPECT_NE(warned.find(eio), std::string::npos) << warned;
  // The interposed readdir failed the listings (else this test tests nothing).
  EXPECT_GE(failures.load(), 1);
  // One device was listed before its folder's listing failed, and one of
  // its ports (mlx5_0's: whichever device came first, only mlx5_0's ports
  // fail part way).
  ASSERT_GE(devices.size(), 1u);
  EXPECT_LE(devices.size(), 2u);
  for (const NetDevice& d : devices) EXPECT_TRUE(d.active) << d.UcxName();
  fs::remove_all(root.parent_path());
}

// The warning is given once per folder, not once per process: a failure
// in another folder after the first was told is told too (the first one
// hid every later one), while the same folder failing again is not
// repeated.
TEST(ReadNetDevices, EachFailingFolderIsWarnedOfOnce) {
  const fs::path first = FailingRoot();
  const fs::path second = FailingRoot();
  const std::string told = "warning: RDMA port discovery: the listing of ";
  std::vector<NetDevice> devices;
  const std::string warned_first = ReadFailing(first, &devices);
  EXPECT_NE(warned_first.find(told + (first / "class" / "infiniband").string()), std::string::npos)
      << warned_first;
  const std::string warned_second = ReadFailing(second, &devices);
  EXPECT_NE(warned_second.find(told + (second / "class" / "infiniband").string()), std::string::npos)
      << warned_second;
  const std::string warned_again = ReadFailing(first, &devices);
  EXPECT_EQ(warned_again, "");
  fs::remove_all(first.parent_path());
  fs::remove_all(second.parent_path());
}

}  // namespace
}  // namespace ddp::transport::topology
