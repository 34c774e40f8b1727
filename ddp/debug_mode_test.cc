// DDP_DEBUG and the debug-mode exchanges over real processes: a bad value
// on one rank stops every rank at once with the reason, and the fingerprint
// check refuses a rank or size that is not its communicator's.

#include "ddp/debug_mode.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "ddp/process_group.h"
#include "ddp/testing/ddp_test_util.h"
#include "transport/launch/test_spawn.h"

namespace ddp::dist {
namespace {

using transport::launch::testing::RunTestWorkers;
using transport::launch::testing::TestRunOptions;

constexpr std::chrono::milliseconds kGroupTimeout{30000};

std::unique_ptr<transport::Communicator> WorkerCommunicator() {
  transport::CommunicatorOptions options;
  options.timeout = kGroupTimeout;
  auto comm = transport::Communicator::CreateFromEnvironment(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "no communicator: %s\n", comm.status().ToString().c_str());
    std::exit(3);
  }
  return std::move(*comm);
}

// Only rank 1 has DDP_DEBUG=bogus (TestRunOptions::rank_env). Making the
// group is timed from when the communicator exists, so rank start-up skew
// does not count.
DDP_TEST_WORKER(bad_debug_value_on_one_rank) {
  auto comm = WorkerCommunicator();
  const int rank = comm->rank();
  ProcessGroupOptions options;
  options.timeout = kGroupTimeout;
  std::string kind = "nothing";
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  try {
    auto pg = std::make_shared<ProcessGroup>(std::move(comm), options);
  } catch (const std::invalid_argument& e) {
    kind = "std::invalid_argument";
    message = e.what();
  } catch (const std::exception& e) {
    kind = "another exception";
    message = e.what();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "rank %d: %s after %.3f s: %s\n", rank, kind.c_str(), seconds,
               message.c_str());
  WORKER_EXPECT(kind == "std::invalid_argument", kind + ": " + message);
  WORKER_EXPECT(message.find("DDP_DEBUG=bogus on rank 1") != std::string::npos, message);
  WORKER_EXPECT(message.find("rank 0") == std::string::npos, message);
  // Well under the group's timeout: nobody waited for it to pass.
  WORKER_EXPECT(seconds < 10.0, "took " + std::to_string(seconds) + " s of a " +
                                    std::to_string(kGroupTimeout.count()) + " ms timeout");
  return testing::WorkerExit();
}

TEST(DebugModeTest, BadValueOnOneRankFailsEveryRankAtOnce) {
  TestRunOptions options;
  options.world_size = 2;
  options.timeout = std::chrono::milliseconds(120000);
  options.stop_all_on_failure = false;
  options.rank_env[1] = {{"DDP_DEBUG", "bogus"}};
  options.echo_output = std::getenv("DDP_TEST_ECHO") != nullptr;
  auto run = RunTestWorkers("bad_debug_value_on_one_rank", options);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << testing::AllOutput(*run);
}

// CheckFingerprints given a size (or rank) that is not the communicator's:
// INVALID_ARGUMENT saying so, after the all-gather (which is sized by the
// communicator), so the ranks stay paired and a correct call then agrees.
DDP_TEST_WORKER(fingerprints_wrong_size) {
  auto comm = WorkerCommunicator();
  const int rank = comm->rank(), size = comm->size();
  auto deadline = [] { return transport::Clock::now() + kGroupTimeout; };
  for (int wrong : {size - 1, size + 1}) {
    const transport::Status s =
        CheckFingerprints(*comm, rank, wrong, 0, "all_reduce(sum, f32 [4])", deadline());
    WORKER_EXPECT(s.code() == transport::StatusCode::kInvalidArgument,
                  "size " + std::to_string(wrong) + ": " + s.ToString());
    WORKER_EXPECT(s.message().find("given rank " + std::to_string(rank) + " of " +
                                   std::to_string(wrong) + ", but the communicator is rank " +
                                   std::to_string(rank) + " of " + std::to_string(size)) !=
                      std::string::npos,
                  s.ToString());
  }
  const transport::Status wrong_rank =
      CheckFingerprints(*comm, size - 1 - rank, size, 1, "barrier()", deadline());
  WORKER_EXPECT(wrong_rank.code() == transport::StatusCode::kInvalidArgument, wrong_rank.ToString());
  const transport::Status right =
      CheckFingerprints(*comm, rank, size, 2, "all_reduce(sum, f32 [4])", deadline());
  WORKER_EXPECT(right.ok(), right.ToString());
  return testing::WorkerExit();
}

TEST(DebugModeTest, FingerprintsRefuseASizeThatIsNotTheCommunicators) {
  auto run = testing::RunWorkers("fingerprints_wrong_size", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

}  // namespace
}  // namespace ddp::dist
