#include "transport/testing/process_group.h"

#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

namespace ddp::transport::testing {
namespace {

using std::chrono::milliseconds;

// The workers: "exit" ends with 40 + RANK, "hang" sleeps far past any
// deadline below (Wait kills it; its own bound keeps a leak short).
int RunScenario(const std::string& name) {
  if (name == "exit") return 40 + std::stoi(EnvOr("RANK", "0"));
  if (name == "hang") {
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  return 2;
}

TEST(ProcessGroup, WaitReturnsEveryWorkersExitCode) {
  auto group = ProcessGroup::Spawn(3, {}, {{"DDP_TEST_SCENARIO", "exit"}}, FreePort());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<WorkerResult> results = (*group)->Wait(DeadlineIn(milliseconds(30000)));
  ASSERT_EQ(results.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].exit_code, 40 + r) << DescribeResults(results);
    EXPECT_FALSE(results[r].timed_out) << "rank " << r;
  }
}

TEST(ProcessGroup, WaitKillsAWorkerStillRunningAtItsDeadline) {
  auto group = ProcessGroup::Spawn(2, {}, {{"DDP_TEST_SCENARIO", "exit"}}, FreePort(),
                                   {{1, {{"DDP_TEST_SCENARIO", "hang"}}}});
  ASSERT_TRUE(group.ok()) << group.status();
  const auto start = Clock::now();
  const std::vector<WorkerResult> results = (*group)->Wait(DeadlineIn(milliseconds(500)));
  const auto took = Clock::now() - start;
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].exit_code, 40) << DescribeResults(results);
  EXPECT_FALSE(results[0].timed_out);
  EXPECT_TRUE(results[1].timed_out) << DescribeResults(results);
  EXPECT_EQ(results[1].signal, SIGKILL);
  // Well before the hanging worker's own 60 s.
  EXPECT_LT(took, milliseconds(20000));
}

}  // namespace
}  // namespace ddp::transport::testing

int main(int argc, char** argv) {
  return ddp::transport::testing::WorkerOrTestsMain(argc, argv,
                                                    ddp::transport::testing::RunScenario);
}
