// The soak binary for a few seconds: 4 ranks, 1000 random collectives, every
// result checked. The growth bounds are wider than a long run's defaults
// (a one-off allocation of a few hundred KiB is a large slope over 1000
// operations) but still fail a leak of half a KiB per operation, which the
// second test shows with a deliberate one.

#include <regex>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/launch/launch_test_util.h"

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr const char* kSanitizer = "asan";
#elif defined(__SANITIZE_THREAD__)
constexpr const char* kSanitizer = "tsan";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr const char* kSanitizer = "asan";
#elif __has_feature(thread_sanitizer)
constexpr const char* kSanitizer = "tsan";
#else
constexpr const char* kSanitizer = "";
#endif
#else
constexpr const char* kSanitizer = "";
#endif

using ::testing::HasSubstr;
using namespace std::chrono_literals;
namespace lt = ddp::transport::launch::testing;

std::vector<std::string> SoakCommand(std::vector<std::string> extra) {
  std::vector<std::string> argv = {lt::Runfile("tests/soak/soak"), "--nproc_per_node=4",
                                   "--max_count=65536", "--seed=20240601",
                                   "--max_rss_kib_per_1000=2048",
                                   "--max_private_kib_per_1000=512", "--timeout_s=60"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

TEST(SoakTest, FourRanksRandomCollectivesCheckedAndFlat) {
  const auto run = lt::RunProgram(SoakCommand({"--ops=1000"}), {}, 240s);
  std::printf("%s", run.output.c_str());
  EXPECT_EQ(run.exit_code, 0);
  for (int rank = 0; rank < 4; ++rank) {
    const std::string prefix = "soak rank " + std::to_string(rank) + ": ";
    EXPECT_THAT(run.output, HasSubstr(prefix + "1000 ops in"));
    EXPECT_THAT(run.output, HasSubstr(prefix + "growth per 1000 ops"));
  }
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("left in /dev/shm")));
  // The count each rank found (a rank with wrong elements also exits 1).
  EXPECT_EQ(lt::CountLines(run.output, "every element checked, 0 wrong;"), 4);
}

// A helper thread that starts once mid-run, after the warm-up (as the
// store's log writer does on its first line), is not a leak. Before, any
// thread more than after the warm-up failed the run.
TEST(SoakTest, AHelperThreadStartedOnceMidRunPasses) {
  const auto run = lt::RunProgram(
      SoakCommand({"--ops=400", "--kinds=barrier", "--helper_thread_at=250"}), {}, 240s);
  std::printf("%s", run.output.c_str());
  EXPECT_EQ(run.exit_code, 0);
  // Every rank saw the one more thread.
  const std::regex counts("threads ([0-9]+) -> ([0-9]+)");
  int grown_by_one = 0;
  for (std::sregex_iterator it(run.output.begin(), run.output.end(), counts), end; it != end; ++it) {
    grown_by_one += std::stol((*it)[2]) == std::stol((*it)[1]) + 1;
  }
  EXPECT_EQ(grown_by_one, 4);
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("threads grow from")));
}

// 2 KiB per operation, and a file descriptor and a thread leaked every few
// operations, must fail the run, naming what grew. Under ASan the memory is caught by LeakSanitizer at exit
// instead (the soak does not enforce memory bounds there), under TSan only
// the descriptors are.
TEST(SoakTest, DeliberateLeaksFailTheBounds) {
  const auto run = lt::RunProgram(
      SoakCommand({"--ops=400", "--kinds=barrier", "--leak_bytes_per_op=2048",
                   "--leak_fd_every=20", "--leak_thread_every=50"}),
      {}, 240s);
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("open file descriptors grow"));
  EXPECT_THAT(run.output, HasSubstr("threads grow from"));
  const std::string sanitizer = kSanitizer;
  if (sanitizer.empty()) {
    EXPECT_THAT(run.output, HasSubstr("private resident memory grows"));
    EXPECT_THAT(run.output, HasSubstr("malloc heap in use grows"));
  } else if (sanitizer == "asan") {
    EXPECT_THAT(run.output, HasSubstr("LeakSanitizer: detected memory leaks"));
  }
}

}  // namespace
