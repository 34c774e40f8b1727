// Segment::CreateShared when the name it drew is taken. This binary's
// shm_open stands in for the C library's: it can make creations fail with
// EEXIST, as a segment left under the same name by a killed job would.

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/shm/segment.h"
#include "transport/testing/in_memory_store.h"

namespace {

// Exclusive creations still to fail with EEXIST, and how many were tried.
std::atomic<int> clashes_left{0};
std::atomic<int> creations{0};

}  // namespace

extern "C" int shm_open(const char* name, int flags, mode_t mode) {
  using ShmOpenFn = int (*)(const char*, int, mode_t);
  static const ShmOpenFn real = reinterpret_cast<ShmOpenFn>(dlsym(RTLD_NEXT, "shm_open"));
  if ((flags & (O_CREAT | O_EXCL)) == (O_CREAT | O_EXCL)) {
    ++creations;
    if (clashes_left.fetch_sub(1) > 0) {
      errno = EEXIST;
      return -1;
    }
  }
  return real(name, flags, mode);
}

namespace ddp::transport::shm {
namespace {

using std::chrono::milliseconds;

// Both ranks of a group of two, on threads; each one's result.
std::vector<StatusOr<std::unique_ptr<Segment>>> CreateGroup() {
  testing::InMemoryStore store;
  std::vector<StatusOr<std::unique_ptr<Segment>>> results;
  for (int rank = 0; rank < 2; ++rank) results.emplace_back(InternalError("not run"));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      results[rank] = Segment::CreateShared(store, "clash/", rank, 2, 4096,
                                            DeadlineIn(milliseconds(10000)));
    });
  }
  for (auto& thread : threads) thread.join();
  return results;
}

// A name that is taken is not the group's failure: rank 0 draws another,
// and both ranks map the same segment.
TEST(Segment, ANameThatIsTakenIsDrawnAgain) {
  clashes_left = 2;
  creations = 0;
  auto results = CreateGroup();
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(results[rank].ok()) << "rank " << rank << ": " << results[rank].status();
  }
  EXPECT_EQ(creations.load(), 3);
  static_cast<int*>((*results[0])->data())[0] = 42;
  EXPECT_EQ(static_cast<int*>((*results[1])->data())[0], 42) << "not the same segment";
}

// Names taken every time: the group gives up after a few, on every rank
// alike, saying why.
TEST(Segment, NamesTakenEveryTimeFailTheGroupSayingSo) {
  clashes_left = 1000;
  creations = 0;
  auto results = CreateGroup();
  clashes_left = 0;
  EXPECT_EQ(creations.load(), 8);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(results[rank].status().code(), StatusCode::kUnavailable)
        << "rank " << rank << ": " << results[rank].status();
    EXPECT_NE(results[rank].status().message().find("8 names tried, all taken"),
              std::string::npos)
        << results[rank].status();
  }
}

}  // namespace
}  // namespace ddp::transport::shm
