#include "transport/testing/reader_descriptor_flags.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace ddp::transport::testing {
namespace {

using namespace std::chrono_literals;

// Opens `path` read-only with `extra` flags and reads it to its end.
void ReadToEnd(const std::string& path, int extra) {
  const int fd = open(path.c_str(), O_RDONLY | extra);
  if (fd < 0) return;
  char buf[64];
  while (read(fd, buf, sizeof(buf)) > 0) {
  }
  close(fd);
}

// FlagsOfTheReadersDescriptor(path, read) within `limit`; a helper that
// does not return by then fails the test and ends the process, since its
// thread cannot be stopped.
int FlagsWithin(const std::string& path, const std::function<void()>& read, std::chrono::seconds limit) {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  int flags = -1;
  std::thread helper([&] {
    const int got = FlagsOfTheReadersDescriptor(path, read);
    std::lock_guard<std::mutex> lock(mu);
    flags = got;
    finished = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(mu);
  if (!cv.wait_for(lock, limit, [&] { return finished; })) {
    std::fprintf(stderr, "FlagsOfTheReadersDescriptor did not return within %lld s\n",
                 static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(1);
  }
  lock.unlock();
  helper.join();
  return flags;
}

TEST(ReaderDescriptorFlags, ReportsTheFlagsTheReaderOpenedWith) {
  const std::string path = ::testing::TempDir() + "/flags_fifo";
  const int with = FlagsWithin(path, [&] { ReadToEnd(path, O_CLOEXEC); }, 30s);
  ASSERT_GE(with, 0);
  EXPECT_NE(with & O_CLOEXEC, 0) << std::oct << with;
  const int without = FlagsWithin(path, [&] { ReadToEnd(path, 0); }, 30s);
  ASSERT_GE(without, 0);
  EXPECT_EQ(without & O_CLOEXEC, 0) << std::oct << without;
}

// A reader that opens the FIFO again once it has read it to the end (a
// second pass over a file) is not left waiting in open() for a writer that
// never comes: the helper returns.
TEST(ReaderDescriptorFlags, AReaderThatOpensTheFifoAgainIsNotLeftWaiting) {
  const std::string path = ::testing::TempDir() + "/twice_fifo";
  const int flags = FlagsWithin(path, [&] {
    ReadToEnd(path, O_CLOEXEC);
    ReadToEnd(path, O_CLOEXEC);
  }, 30s);
  EXPECT_GE(flags, 0);
}

// Code under test that never opens the FIFO gives -1 as soon as it returns,
// not after the 10 s the helper allows for an open.
TEST(ReaderDescriptorFlags, AReaderThatNeverOpensTheFifoGivesMinusOneOnceItReturns) {
  const std::string path = ::testing::TempDir() + "/unopened_fifo";
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(FlagsWithin(path, [] {}, 30s), -1);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

}  // namespace
}  // namespace ddp::transport::testing
