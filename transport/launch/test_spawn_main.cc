// main() for tests that use RunTestWorkers: a process started as a test
// worker runs that worker and exits; otherwise the gtest suite runs.

#include <gtest/gtest.h>

#include "transport/launch/test_spawn.h"

int main(int argc, char** argv) {
  if (std::optional<int> code = ddp::transport::launch::testing::RunTestWorkerIfRequested()) {
    return *code;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
