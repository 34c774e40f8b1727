// DDP_DEBUG, DDP_COLLECTIVE_THREAD and the debug-mode exchanges over real
// processes: a bad value on one rank stops every rank at once with the
// reason, a group keeps the DDP_DEBUG level it was made with, and the
// fingerprint check refuses a rank or size that is not its communicator's.

#include "ddp/debug_mode.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

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

// Makes a group on this rank and reports how: "std::invalid_argument",
// "another exception" or "nothing", with the message, and the seconds it
// took from when the communicator existed (so rank start-up skew does not
// count).
struct Making {
  int rank = -1;
  std::string kind = "nothing";
  std::string message;
  double seconds = 0;
  std::shared_ptr<ProcessGroup> group;
};

Making MakeGroup() {
  auto comm = WorkerCommunicator();
  Making made;
  made.rank = comm->rank();
  ProcessGroupOptions options;
  options.timeout = kGroupTimeout;
  const auto start = std::chrono::steady_clock::now();
  try {
    made.group = std::make_shared<ProcessGroup>(std::move(comm), options);
  } catch (const std::invalid_argument& e) {
    made.kind = "std::invalid_argument";
    made.message = e.what();
  } catch (const std::exception& e) {
    made.kind = "another exception";
    made.message = e.what();
  }
  made.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "rank %d: %s after %.3f s: %s\n", made.rank, made.kind.c_str(),
               made.seconds, made.message.c_str());
  return made;
}

// Every rank gets the same refusal, well under the group's timeout: nobody
// waited for it to pass.
int ExpectRefusedAtOnce(const Making& made, const std::vector<std::string>& named,
                        const std::vector<std::string>& not_named) {
  WORKER_EXPECT(made.kind == "std::invalid_argument", made.kind + ": " + made.message);
  for (const std::string& s : named) {
    WORKER_EXPECT(made.message.find(s) != std::string::npos, "no '" + s + "' in: " + made.message);
  }
  for (const std::string& s : not_named) {
    WORKER_EXPECT(made.message.find(s) == std::string::npos, "'" + s + "' in: " + made.message);
  }
  WORKER_EXPECT(made.seconds < 10.0, "took " + std::to_string(made.seconds) + " s of a " +
                                         std::to_string(kGroupTimeout.count()) + " ms timeout");
  return testing::WorkerExit();
}

TestRunOptions TwoRanks() {
  TestRunOptions options;
  options.world_size = 2;
  options.timeout = std::chrono::milliseconds(120000);
  options.stop_all_on_failure = false;
  options.echo_output = std::getenv("DDP_TEST_ECHO") != nullptr;
  return options;
}

// Only rank 1 has DDP_DEBUG=bogus (TestRunOptions::rank_env).
DDP_TEST_WORKER(bad_debug_value_on_one_rank) {
  return ExpectRefusedAtOnce(MakeGroup(), {"DDP_DEBUG=bogus on rank 1"},
                             {"rank 0", "DDP_COLLECTIVE_THREAD"});
}

TEST(DebugModeTest, BadValueOnOneRankFailsEveryRankAtOnce) {
  TestRunOptions options = TwoRanks();
  options.rank_env[1] = {{"DDP_DEBUG", "bogus"}};
  auto run = RunTestWorkers("bad_debug_value_on_one_rank", options);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << testing::AllOutput(*run);
}

// Only rank 1 has DDP_COLLECTIVE_THREAD=sideways.
DDP_TEST_WORKER(bad_collective_thread_on_one_rank) {
  return ExpectRefusedAtOnce(
      MakeGroup(),
      {"DDP_COLLECTIVE_THREAD=sideways on rank 1 (of 2): expected auto, comm or caller"},
      {"rank 0", "DDP_DEBUG"});
}

// Rank 0 has a bad DDP_DEBUG and rank 1 a bad DDP_COLLECTIVE_THREAD: both
// ranks name both.
DDP_TEST_WORKER(bad_values_on_both_ranks) {
  return ExpectRefusedAtOnce(
      MakeGroup(), {"DDP_DEBUG=loud on rank 0", "DDP_COLLECTIVE_THREAD=sideways on rank 1"}, {});
}

// Valid but different DDP_COLLECTIVE_THREAD values: each rank runs its
// collectives where it chose, and they still pair up.
DDP_TEST_WORKER(different_collective_threads) {
  Making made = MakeGroup();
  WORKER_EXPECT(made.group != nullptr, made.kind + ": " + made.message);
  ProcessGroup& pg = *made.group;
  WORKER_EXPECT(pg.collectives_on_caller() == (pg.rank() == 0), "collectives_on_caller");
  nn::Tensor t = nn::Full({1000}, pg.rank() + 1.0);
  pg.AllReduce(t).Wait();
  pg.Barrier().Wait();
  WORKER_EXPECT(t.data<float>()[999] == 3.0f, "all-reduce value");
  return testing::WorkerExit();
}

TEST(DebugModeTest, BadCollectiveThreadOnOneRankFailsEveryRankAtOnce) {
  {
    TestRunOptions options = TwoRanks();
    options.rank_env[1] = {{"DDP_COLLECTIVE_THREAD", "sideways"}};
    auto run = RunTestWorkers("bad_collective_thread_on_one_rank", options);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_TRUE(run->AllSucceeded()) << testing::AllOutput(*run);
  }
  {
    TestRunOptions options = TwoRanks();
    options.rank_env[0] = {{"DDP_DEBUG", "loud"}};
    options.rank_env[1] = {{"DDP_COLLECTIVE_THREAD", "sideways"}};
    auto run = RunTestWorkers("bad_values_on_both_ranks", options);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_TRUE(run->AllSucceeded()) << testing::AllOutput(*run);
  }
  // Ranks need not agree on a valid value.
  TestRunOptions options = TwoRanks();
  options.rank_env[0] = {{"DDP_COLLECTIVE_THREAD", "caller"}};
  options.rank_env[1] = {{"DDP_COLLECTIVE_THREAD", "comm"}};
  auto run = RunTestWorkers("different_collective_threads", options);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << testing::AllOutput(*run);
}

// DDP_DEBUG=info on both ranks when the group is made; then rank 1 sets it
// to a bad value. The group keeps the level it read (what DDP follows), on
// both ranks, and a collective still runs: nothing reads the variable again.
DDP_TEST_WORKER(debug_changed_after_making) {
  Making made = MakeGroup();
  WORKER_EXPECT(made.group != nullptr, made.kind + ": " + made.message);
  ProcessGroup& pg = *made.group;
  if (pg.rank() == 1) setenv("DDP_DEBUG", "bogus", 1);
  WORKER_EXPECT(pg.debug_level() == DebugLevel::kInfo,
                "debug_level " + std::to_string(static_cast<int>(pg.debug_level())));
  WORKER_EXPECT(!pg.debug_detail(), "debug_detail on");
  nn::Tensor t = nn::Ones({16});
  pg.AllReduce(t).Wait();
  WORKER_EXPECT(t.data<float>()[15] == 2.0f, "all-reduce value");
  return testing::WorkerExit();
}

TEST(DebugModeTest, GroupKeepsTheLevelItWasMadeWith) {
  TestRunOptions options = TwoRanks();
  options.env = {{"DDP_DEBUG", "info"}};
  auto run = RunTestWorkers("debug_changed_after_making", options);
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

// Descriptions that differ only in their shape after a label too long for
// the fingerprint's text: the whole description is compared, and the
// message still shows each rank's dtype and shape (the end of the text),
// with the start of the label, on every rank.
DDP_TEST_WORKER(fingerprints_long_label) {
  auto comm = WorkerCommunicator();
  const int rank = comm->rank(), size = comm->size();
  const std::string label = "all_reduce bucket of encoder." + std::string(300, 'x');
  const std::string mine = label + "(sum, f32 [" + std::to_string(4 + rank) + ", 3])";
  const transport::Status s = CheckFingerprints(*comm, rank, size, 7, mine,
                                                transport::Clock::now() + kGroupTimeout);
  WORKER_EXPECT(s.code() == transport::StatusCode::kInvalidArgument, s.ToString());
  for (const std::string& part :
       {std::string("rank 0 runs collective #7 all_reduce bucket of encoder.xxx"),
        std::string("rank 1 runs collective #7 all_reduce bucket of encoder.xxx"),
        std::string("xxx(sum, f32 [4, 3])"), std::string("xxx(sum, f32 [5, 3])")}) {
    WORKER_EXPECT(s.message().find(part) != std::string::npos, "no '" + part + "' in: " + s.ToString());
  }
  // Each rank's text is cut to the fingerprint's size: the message stays short.
  WORKER_EXPECT(s.message().size() < 700, s.ToString());
  return testing::WorkerExit();
}

TEST(DebugModeTest, FingerprintsOfLongDescriptionsKeepTheirShapes) {
  auto run = testing::RunWorkers("fingerprints_long_label", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

}  // namespace
}  // namespace ddp::dist
