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
#include <optional>
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
  return ExpectRefusedAtOnce(MakeGroup(), {"DDP_DEBUG=\"bogus\" on rank 1"},
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
      {"DDP_COLLECTIVE_THREAD=\"sideways\" on rank 1 (of 2): expected auto, comm or caller"},
      {"rank 0", "DDP_DEBUG"});
}

// Rank 0 has a bad DDP_DEBUG and rank 1 a bad DDP_COLLECTIVE_THREAD: both
// ranks name both.
DDP_TEST_WORKER(bad_values_on_both_ranks) {
  return ExpectRefusedAtOnce(
      MakeGroup(), {"DDP_DEBUG=\"loud\" on rank 0", "DDP_COLLECTIVE_THREAD=\"sideways\" on rank 1"}, {});
}

// A value with a trailing CR (a CRLF env file) or space is refused with the
// value quoted and escaped, so the reader sees what was wrong with it; it
// was printed bare ("DDP_DEBUG=detail\r on rank 1"), and read as a refusal
// of "detail" itself. Every rank with the same bad value is named once, as
// a range.
DDP_TEST_WORKER(whitespace_in_bad_values) {
  return ExpectRefusedAtOnce(MakeGroup(),
                             {"DDP_DEBUG=\"detail\\r\" (whitespace around a value is not trimmed) on ranks 1-2 (of 3)",
                              "DDP_COLLECTIVE_THREAD=\"comm \" (whitespace around a value is not trimmed) on rank 0 "
                              "(of 3)"},
                             {"rank 1,", "\r"});
}

TEST(DebugModeTest, BadValuesAreQuotedAndTheirRanksGrouped) {
  TestRunOptions options = TwoRanks();
  options.world_size = 3;
  options.rank_env[0] = {{"DDP_COLLECTIVE_THREAD", "comm "}};
  options.rank_env[1] = {{"DDP_DEBUG", "detail\r"}};
  options.rank_env[2] = {{"DDP_DEBUG", "detail\r"}};
  auto run = RunTestWorkers("whitespace_in_bad_values", options);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << testing::AllOutput(*run);
}

// A group of one rank refuses a bad value at once, quoted as well.
DDP_TEST_WORKER(whitespace_in_bad_value_alone) {
  return ExpectRefusedAtOnce(MakeGroup(), {"DDP_DEBUG=\"info \" (whitespace around a value is not trimmed): "}, {});
}

TEST(DebugModeTest, ABadValueOnAGroupOfOneIsQuoted) {
  TestRunOptions options = TwoRanks();
  options.world_size = 1;
  options.env = {{"DDP_DEBUG", "info "}};
  auto run = RunTestWorkers("whitespace_in_bad_value_alone", options);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << testing::AllOutput(*run);
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

// DDP_COLLECTIVE_THREAD is read in any case, as DDP_DEBUG is: "Caller" used
// to be refused and stop every rank of the group.
TEST(DebugModeTest, CollectiveThreadIsReadInAnyCase) {
  TestRunOptions options = TwoRanks();
  options.rank_env[0] = {{"DDP_COLLECTIVE_THREAD", "Caller"}};
  options.rank_env[1] = {{"DDP_COLLECTIVE_THREAD", "COMM"}};
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

// Three ranks, two running one collective and the third another: the two
// are named as one range.
DDP_TEST_WORKER(fingerprints_grouped) {
  auto comm = WorkerCommunicator();
  const int rank = comm->rank(), size = comm->size();
  const transport::Status s = CheckFingerprints(*comm, rank, size, rank == 2 ? 8 : 7, "barrier()",
                                                transport::Clock::now() + kGroupTimeout);
  WORKER_EXPECT(s.code() == transport::StatusCode::kInvalidArgument, s.ToString());
  WORKER_EXPECT(s.message().find("ranks 0-1 run collective #7 barrier(); rank 2 runs collective #8 barrier()") !=
                    std::string::npos,
                s.ToString());
  return testing::WorkerExit();
}

TEST(DebugModeTest, FingerprintsNameRanksAsRanges) {
  auto run = testing::RunWorkers("fingerprints_grouped", 3);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ----------------------------------------- messages over many ranks ----

TEST(RankSetTest, ConsecutiveRanksAreRangesAndTheListIsCapped) {
  EXPECT_EQ(RankSet({5}), "rank 5");
  EXPECT_EQ(RankSet({0, 1, 2, 3, 7, 9, 10}), "ranks 0-3, 7, 9-10");
  std::vector<int> even;
  for (int r = 0; r < 4096; r += 2) even.push_back(r);
  const std::string m = RankSet(even, 4);
  EXPECT_EQ(m, "ranks 0, 2, 4, 6, ... (2044 more)");
}

TEST(QuotedEnvValueTest, ControlCharactersAndBytesPastAsciiAreEscaped) {
  EXPECT_EQ(QuotedEnvValue("info"), "\"info\"");
  EXPECT_EQ(QuotedEnvValue("a\"b\\c\td\n\x01\xff"), "\"a\\\"b\\\\c\\td\\n\\x01\\xff\"");
  EXPECT_EQ(QuotedEnvValue(" info"), "\" info\" (whitespace around a value is not trimmed)");
}

// The same typo on all 4096 ranks is one clause; 4096 different values are
// 8 and a count. The message used to name every rank (about 35 bytes each).
TEST(DescribeBadValuesTest, ManyRanksGiveABoundedMessage) {
  std::vector<std::optional<std::string>> same(4096, QuotedEnvValue("verbose"));
  EXPECT_EQ(DescribeBadValues("DDP_DEBUG", same, kDebugAccepted),
            "DDP_DEBUG=\"verbose\" on ranks 0-4095 (of 4096): expected off, info or detail");
  std::vector<std::optional<std::string>> each(4096);
  for (int r = 0; r < 4096; ++r) each[r] = QuotedEnvValue(std::string(61, 'a') + std::to_string(r));
  const std::string m = DescribeBadValues("DDP_DEBUG", each, kDebugAccepted);
  EXPECT_LT(m.size(), 1024u) << m;
  EXPECT_NE(m.find("DDP_DEBUG=\"" + std::string(61, 'a') + "7\" on rank 7, and 4088 more values on 4088 more ranks "
                   "(of 4096)"),
            std::string::npos)
      << m;
  std::vector<std::optional<std::string>> none(4);
  EXPECT_EQ(DescribeBadValues("DDP_DEBUG", none, kDebugAccepted), "");
}

// The usual desync: every rank at another sequence number, so every rank a
// group of its own. The message lists 8 groups and the ranks of the rest
// as ranges (it had a clause for each of 4096 ranks, about 1 MB).
TEST(ExplainDesyncTest, EveryRankApartGivesABoundedMessage) {
  std::vector<CollectiveFingerprint> all(4096);
  for (int r = 0; r < 4096; ++r) all[r] = {static_cast<uint64_t>(r), 1, "all_reduce " + std::string(200, 'x')};
  const std::string m = ExplainDesync(3, all);
  EXPECT_LT(m.size(), 4096u) << m;
  EXPECT_EQ(m.rfind("collective desync detected (DDP_DEBUG=detail) on rank 3: rank 0 runs collective #0 all_reduce", 0),
            0u)
      << m;
  EXPECT_NE(m.find("; rank 7 runs collective #7 "), std::string::npos) << m;
  EXPECT_NE(m.find("; and 4088 more groups: ranks 8-4095"), std::string::npos) << m;
  // Most ranks together and one apart: two clauses, whatever the size.
  for (CollectiveFingerprint& f : all) f = {9, 1, "barrier()"};
  all[1023].sequence = 8;
  EXPECT_EQ(ExplainDesync(0, all),
            "collective desync detected (DDP_DEBUG=detail) on rank 0: rank 1023 runs collective #8 barrier(); "
            "ranks 0-1022, 1024-4095 run collective #9 barrier()");
}

}  // namespace
}  // namespace ddp::dist
