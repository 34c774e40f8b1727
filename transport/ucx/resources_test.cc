#include "transport/ucx/resources.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace ddp::transport::ucx {
namespace {

// The System V shared-memory segments this process created, by id, with
// their sizes in bytes (from /proc/sysvipc/shm: key shmid perms size cpid).
std::map<long, long> OwnSysvSegments() {
  std::map<long, long> segments;
  std::ifstream table("/proc/sysvipc/shm");
  std::string line;
  std::getline(table, line);  // the header
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    long key = 0, id = 0, perms = 0, size = 0, creator = 0;
    if (!(fields >> key >> id >> perms >> size >> creator)) continue;
    if (creator == getpid()) segments[id] = size;
  }
  return segments;
}

// The largest segment that creating a worker on `options` added, in bytes
// (0 when it added none), while the worker is alive.
long LargestSegmentOfNewWorker(const ContextOptions& options) {
  const std::map<long, long> before = OwnSysvSegments();
  auto context = Context::Create(options);
  EXPECT_TRUE(context.ok()) << context.status();
  if (!context.ok()) return 0;
  auto worker = Worker::Create(*context);
  EXPECT_TRUE(worker.ok()) << worker.status();
  long largest = 0;
  for (const auto& [id, size] : OwnSysvSegments()) {
    if (!before.contains(id)) largest = std::max(largest, size);
  }
  return largest;
}

// UCX's own pool (512 buffers of 8 KiB, 4 MiB and more) took most of a
// rank's start-up in page faults; the context asks for a quarter of it.
// Up to 2 MiB: the pool and FIFO rounded up to a huge page where the
// system has them.
TEST(Resources, WorkerStartsWithASmallSharedMemoryReceivePool) {
  const long largest = LargestSegmentOfNewWorker({.default_tls = "sm,self"});
  ASSERT_GT(largest, 0) << "the worker made no System V segment (sysv transport unavailable?)";
  EXPECT_LE(largest, 2L << 20);
}

// A user who sizes the pool keeps their size.
TEST(Resources, UserSetReceivePoolSizeWins) {
  ASSERT_EQ(setenv("UCX_MM_RX_BUFS_GROW", "512", 1), 0);
  const long largest = LargestSegmentOfNewWorker({.default_tls = "sm,self"});
  ASSERT_EQ(unsetenv("UCX_MM_RX_BUFS_GROW"), 0);
  EXPECT_GT(largest, 4L << 20);
}

// Only lists that open them get the setting: UCX warns about a setting no
// transport in use takes ("invalid configuration: MM_RX_BUFS_GROW").
TEST(Resources, FindsMemoryMappedTransportsInTheList) {
  for (const char* tls : {"all", "sm,self", "self,sm", "shm", "tcp,sysv", "posix", "xpmem,self", "mm"}) {
    EXPECT_TRUE(OpensMemoryMappedTransports(tls)) << tls;
  }
  for (const char* tls : {"", "tcp", "tcp,self", "self", "cma,self", "^tcp", "^sm", "rc,ud", "smx"}) {
    EXPECT_FALSE(OpensMemoryMappedTransports(tls)) << tls;
  }
}

// A null context is refused, naming it; it was dereferenced (a crash).
TEST(Resources, AWorkerWithoutAContextIsRefused) {
  auto worker = Worker::Create(nullptr);
  EXPECT_EQ(worker.status().code(), StatusCode::kInvalidArgument) << worker.status();
  EXPECT_NE(worker.status().message().find("no context"), std::string::npos) << worker.status();
}

}  // namespace
}  // namespace ddp::transport::ucx
