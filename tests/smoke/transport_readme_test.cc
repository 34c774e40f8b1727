// transport/README.md's getting-started path, run as a user from another
// team would run it: real processes, the launch environment, the public
// headers only. Each rank creates its communicator with
// Communicator::CreateFromEnvironment, then all-reduces (the README's
// snippet, value by value), broadcasts, all-gathers, reduce-scatters (out
// of place and in the in-place layouts the API table documents),
// all-reduces asynchronously, passes a count of 0, and meets a barrier.
// Other jobs pass mismatched counts, fail creation on one rank, and let a
// deadline pass, checking the documented INVALID_ARGUMENT, the creation
// error and TIMED_OUT, and their spread to the other ranks. If the README's calls or claims drift from the headers, this
// stops compiling or fails.
//
// World size 3: not a power of two, so over UCX the halving-doubling
// all-reduce takes its fold-in steps.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "transport/communicator.h"
#include "transport/launch/test_spawn.h"

namespace ddp::transport {
namespace {

using namespace std::chrono_literals;
namespace launch_testing = launch::testing;

// Failed checks in this worker process (no gtest there): each is printed
// with its line, and the worker exits non-zero when there were any.
int failures = 0;

void Expect(bool ok, int line, const std::string& what) {
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "FAIL transport_readme_test.cc:%d: %s\n", line, what.c_str());
}
#define EXPECT_IN_WORKER(cond, what) Expect((cond), __LINE__, (what))

// A topology file that rank 1 is told to read and that does not exist.
constexpr char kMissingTopology[] = "/nonexistent/transport_readme_test/topology.json";

std::string EnvOrEmpty(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

// The README's creation: the launch variables say who is who. A deadline a
// test can wait out, instead of the 5-minute default.
std::unique_ptr<Communicator> CreateOrExit() {
  CommunicatorOptions defaults;
  defaults.timeout = 20s;
  StatusOr<std::unique_ptr<Communicator>> comm = Communicator::CreateFromEnvironment(defaults);
  if (!comm.ok()) {
    std::fprintf(stderr, "creating the communicator: %s\n", comm.status().ToString().c_str());
    std::exit(3);
  }
  return std::move(comm).value();
}

// Every collective of the README's API table that a getting-started
// program uses, with closed-form results.
DDP_TEST_WORKER(readme_collectives) {
  std::unique_ptr<Communicator> comm = CreateOrExit();
  const int n = comm->size(), me = comm->rank();

  // The README's snippet, as written there.
  float value = comm->rank();
  Status s = comm->AllReduce(&value, 1, DataType::kF32, ReduceOp::kSum);
  EXPECT_IN_WORKER(s.ok(), "in-place all-reduce: " + s.ToString());
  EXPECT_IN_WORKER(value == n * (n - 1) / 2.0f,
                   "in-place all-reduce gave " + std::to_string(value));

  // Out of place, another dtype and op: recv[i] = max over ranks of send[i].
  {
    std::vector<int32_t> send(5), recv(5, -1);
    for (int i = 0; i < 5; ++i) send[i] = (me + i) % n;
    s = comm->AllReduce(send.data(), recv.data(), 5, DataType::kI32, ReduceOp::kMax);
    EXPECT_IN_WORKER(s.ok(), "all-reduce max: " + s.ToString());
    for (int i = 0; i < 5; ++i) {
      EXPECT_IN_WORKER(recv[i] == n - 1, "all-reduce max element " + std::to_string(i) + " is " +
                                             std::to_string(recv[i]));
    }
  }

  // Broadcast: the root's buffer on every rank.
  {
    const int root = n - 1;
    std::vector<double> buf(4, -1.0);
    if (me == root) buf = {0.5, 1.5, 2.5, 3.5};
    s = comm->Broadcast(buf.data(), buf.size(), DataType::kF64, root);
    EXPECT_IN_WORKER(s.ok(), "broadcast: " + s.ToString());
    EXPECT_IN_WORKER(buf == (std::vector<double>{0.5, 1.5, 2.5, 3.5}), "broadcast: wrong values");
  }

  // All-gather: rank r's block at r * count; then in place, with send at
  // recv + rank * count.
  {
    constexpr size_t kCount = 3;
    std::vector<int64_t> send(kCount), recv(n * kCount, -1), expected(n * kCount);
    for (size_t i = 0; i < kCount; ++i) send[i] = me * 100 + static_cast<int64_t>(i);
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < kCount; ++i) expected[r * kCount + i] = r * 100 + static_cast<int64_t>(i);
    }
    s = comm->AllGather(send.data(), recv.data(), kCount, DataType::kI64);
    EXPECT_IN_WORKER(s.ok(), "all-gather: " + s.ToString());
    EXPECT_IN_WORKER(recv == expected, "all-gather: wrong blocks");

    std::vector<int64_t> in_place(n * kCount, -1);
    std::copy(send.begin(), send.end(), in_place.begin() + me * kCount);
    s = comm->AllGather(in_place.data() + me * kCount, in_place.data(), kCount, DataType::kI64);
    EXPECT_IN_WORKER(s.ok(), "in-place all-gather: " + s.ToString());
    EXPECT_IN_WORKER(in_place == expected, "in-place all-gather: wrong blocks");
  }

  // Reduce-scatter: send holds size() * count; rank r gets block r summed.
  // Rank q's element j is q + j, so block r's element i sums to
  // sum_q (q + r * count + i).
  {
    constexpr size_t kCount = 2;
    std::vector<float> send(n * kCount), recv(kCount, -1.0f), expected(kCount);
    for (size_t j = 0; j < send.size(); ++j) send[j] = static_cast<float>(me + j);
    for (size_t i = 0; i < kCount; ++i) {
      expected[i] = n * (n - 1) / 2.0f + n * static_cast<float>(me * kCount + i);
    }
    s = comm->ReduceScatter(send.data(), recv.data(), kCount, DataType::kF32, ReduceOp::kSum);
    EXPECT_IN_WORKER(s.ok(), "reduce-scatter: " + s.ToString());
    EXPECT_IN_WORKER(recv == expected, "reduce-scatter: wrong block");

    // In place (NCCL's layout): recv is this rank's block of send.
    s = comm->ReduceScatter(send.data(), send.data() + me * kCount, kCount, DataType::kF32,
                            ReduceOp::kSum);
    EXPECT_IN_WORKER(s.ok(), "in-place reduce-scatter: " + s.ToString());
    EXPECT_IN_WORKER(std::vector<float>(send.begin() + me * kCount,
                                        send.begin() + (me + 1) * kCount) == expected,
                     "in-place reduce-scatter: wrong block");
  }

  // The same through ...Async and its Work (README, API in brief).
  {
    double sum = me + 0.5;
    Work work = comm->AllReduceAsync(&sum, &sum, 1, DataType::kF64, ReduceOp::kSum);
    s = work.Wait();
    EXPECT_IN_WORKER(s.ok(), "async all-reduce: " + s.ToString());
    EXPECT_IN_WORKER(sum == n * (n - 1) / 2.0 + n * 0.5,
                     "async all-reduce gave " + std::to_string(sum));
    StatusOr<bool> done = work.Test();
    EXPECT_IN_WORKER(done.ok() && *done, "Test() after Wait(): " + done.status().ToString());
  }

  // A count of 0 moves nothing and succeeds (null buffers allowed).
  s = comm->AllReduce(nullptr, nullptr, 0, DataType::kF32, ReduceOp::kSum);
  EXPECT_IN_WORKER(s.ok(), "all-reduce of count 0: " + s.ToString());

  // An argument every rank passes alike is refused on every rank, and the
  // communicator stays usable (README, Error model).
  float unused = 0;
  s = comm->AllReduce(&unused, 1, static_cast<DataType>(42), ReduceOp::kSum);
  EXPECT_IN_WORKER(s.code() == StatusCode::kInvalidArgument &&
                       s.message().find("dtype 42") != std::string::npos,
                   "unknown dtype: " + s.ToString());

  s = comm->Barrier();
  EXPECT_IN_WORKER(s.ok(), "barrier: " + s.ToString());
  EXPECT_IN_WORKER(comm->aborted_reason().ok(), "aborted: " + comm->aborted_reason().ToString());
  return failures == 0 ? 0 : 1;
}

// A deadline that passes: rank 0 waits in a barrier with a short per-call
// timeout while the others wait in a receive rank 0 never sends. Rank 0
// gets TIMED_OUT naming a rank it waited for; the others learn it from the
// store (README: "rank R aborted the job: ...", the poster's code) long
// before their own deadline; every later call returns that first reason.
DDP_TEST_WORKER(readme_deadline) {
  std::unique_ptr<Communicator> comm = CreateOrExit();
  const int me = comm->rank();
  Status s;
  const auto started = std::chrono::steady_clock::now();
  if (me == 0) {
    CallOptions call;
    call.timeout = 300ms;
    s = comm->Barrier(call);
    EXPECT_IN_WORKER(s.code() == StatusCode::kTimedOut, "rank 0's barrier: " + s.ToString());
    EXPECT_IN_WORKER(s.message().find("rank 1") != std::string::npos ||
                         s.message().find("rank 2") != std::string::npos,
                     "rank 0's barrier names no pending rank: " + s.ToString());
  } else {
    uint8_t byte = 0;
    s = comm->Recv(&byte, 1, DataType::kU8, /*peer=*/0, /*tag=*/7);
    EXPECT_IN_WORKER(s.code() == StatusCode::kTimedOut,
                     "rank " + std::to_string(me) + "'s receive: " + s.ToString());
    EXPECT_IN_WORKER(s.message().find("rank 0 aborted the job") != std::string::npos,
                     "rank " + std::to_string(me) + "'s receive: " + s.ToString());
    // Well before its own 20 s deadline.
    EXPECT_IN_WORKER(std::chrono::steady_clock::now() - started < 10s,
                     "rank " + std::to_string(me) + " learned of the abort only at its deadline");
  }
  EXPECT_IN_WORKER(comm->aborted_reason() == s,
                   "aborted_reason() " + comm->aborted_reason().ToString() + " is not " +
                       s.ToString());
  const Status again = comm->Barrier();
  EXPECT_IN_WORKER(again == s, "the next call returned " + again.ToString());
  return failures == 0 ? 0 : 1;
}

// Ranks that pass different counts to one all-reduce (rank 1 one element
// more): INVALID_ARGUMENT on every rank, saying what each passed (README,
// Error model), instead of a wait until the deadline.
DDP_TEST_WORKER(readme_count_mismatch) {
  std::unique_ptr<Communicator> comm = CreateOrExit();
  const int me = comm->rank();
  const size_t count = me == 1 ? 5 : 4;
  std::vector<float> buf(count, 1.0f);
  const auto started = std::chrono::steady_clock::now();
  const Status s = comm->AllReduce(buf.data(), count, DataType::kF32, ReduceOp::kSum);
  const std::string who = "rank " + std::to_string(me) + ": ";
  EXPECT_IN_WORKER(s.code() == StatusCode::kInvalidArgument, who + s.ToString());
  EXPECT_IN_WORKER(s.message().find("count 4") != std::string::npos &&
                       s.message().find("count 5") != std::string::npos,
                   who + "does not name both counts: " + s.ToString());
  EXPECT_IN_WORKER(std::chrono::steady_clock::now() - started < 10s,
                   who + "the mismatch was found only near the deadline");
  return failures == 0 ? 0 : 1;
}

// A rank whose creation fails (here: a topology file that does not exist)
// names the cause; the ranks waiting for it fail within moments with "rank
// R aborted the job: creating its communicator: ..." (README, Error model)
// instead of at their creation deadline.
DDP_TEST_WORKER(readme_creation_failure) {
  CommunicatorOptions defaults;
  defaults.timeout = 20s;
  const auto started = std::chrono::steady_clock::now();
  StatusOr<std::unique_ptr<Communicator>> comm = Communicator::CreateFromEnvironment(defaults);
  const std::string me = EnvOrEmpty("RANK");
  const std::string what = "rank " + me + "'s creation: " + comm.status().ToString();
  EXPECT_IN_WORKER(!comm.ok(), "rank " + me + " created a communicator");
  if (me == "1") {
    EXPECT_IN_WORKER(comm.status().message().find(kMissingTopology) != std::string::npos,
                     what + " (the missing file is not named)");
  } else {
    EXPECT_IN_WORKER(comm.status().message().find("rank 1 aborted the job: creating its communicator") !=
                             std::string::npos &&
                         comm.status().message().find(kMissingTopology) != std::string::npos,
                     what);
  }
  EXPECT_IN_WORKER(std::chrono::steady_clock::now() - started < 10s,
                   "rank " + me + " failed only near its creation deadline");
  return failures == 0 ? 0 : 1;
}

void RunAndExpectSuccess(const char* worker, std::vector<std::pair<std::string, std::string>> env,
                         std::map<int, std::vector<std::pair<std::string, std::string>>> rank_env = {}) {
  launch_testing::TestRunOptions options;
  options.world_size = 3;
  options.timeout = 60s;
  options.env = std::move(env);
  options.rank_env = std::move(rank_env);
  StatusOr<launch_testing::TestRunResult> run = launch_testing::RunTestWorkers(worker, options);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << run->Summary();
}

// On one host the shared-memory engine runs the collectives (the default).
TEST(TransportReadme, GettingStartedCollectives) { RunAndExpectSuccess("readme_collectives", {}); }

// Across hosts everything goes over UCX: the same calls with shared memory
// off.
TEST(TransportReadme, GettingStartedCollectivesOverUcx) {
  RunAndExpectSuccess("readme_collectives", {{"DDP_SHARED_MEMORY", "0"}});
}

TEST(TransportReadme, MismatchedCountsAreInvalidArgumentOnEveryRank) {
  RunAndExpectSuccess("readme_count_mismatch", {});
}

TEST(TransportReadme, MismatchedCountsAreInvalidArgumentOnEveryRankOverUcx) {
  RunAndExpectSuccess("readme_count_mismatch", {{"DDP_SHARED_MEMORY", "0"}});
}

TEST(TransportReadme, FailedCreationOnOneRankFailsEveryRankAtOnce) {
  RunAndExpectSuccess("readme_creation_failure", {},
                      {{1, {{"DDP_TOPOLOGY_FILE", kMissingTopology}}}});
}

TEST(TransportReadme, ExpiredDeadlineIsTimedOutOnEveryRank) {
  RunAndExpectSuccess("readme_deadline", {});
}

}  // namespace
}  // namespace ddp::transport
