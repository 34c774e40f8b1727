// ProcessGroup over real processes (UCX / shared memory): collectives on
// tensors of every dtype, the communication thread's ordering and idleness,
// the versions of the tensors they write, argument errors, and the
// debug-mode desync report.

#include "ddp/process_group.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "ddp/testing/ddp_test_util.h"
#include "transport/shm/shareable.h"

// The next allocation on a thread fails while its flag is set, once, as
// when memory has just run out (replacing the global operator new is the
// seam; it reaches the library too).
namespace {
thread_local bool fail_next_allocation = false;
// While fail_next_allocation is set, this many allocations succeed first.
thread_local int allocations_before_failure = 0;
}  // namespace

void* operator new(std::size_t bytes) {
  if (fail_next_allocation && allocations_before_failure > 0) {
    --allocations_before_failure;
  } else if (fail_next_allocation) {
    fail_next_allocation = false;
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
// Not inlined: GCC would take a free() of what a new expression returned
// for a mismatch.
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace ddp::dist {
namespace {

using nn::DType;
using nn::Tensor;
using testing::RunWorkers;
using transport::ReduceOp;

DDP_TEST_WORKER(pg_collectives) {
  auto pg = testing::WorkerGroup();
  const int n = pg->size(), me = pg->rank();
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16,
                      DType::kInt64, DType::kInt32, DType::kUInt8}) {
    const std::string what = std::string(nn::DTypeName(dtype));
    // All-reduce sum of (rank + i) % 7.
    std::vector<double> v(1001);
    for (size_t i = 0; i < v.size(); ++i) v[i] = (me + i) % 7;
    Tensor t = nn::FromVector(v, {7, 11, 13}, {.dtype = dtype});
    pg->AllReduce(t).Wait();
    const std::vector<double> got = t.ToVector<double>();
    int wrong = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      double expected = 0;
      for (int r = 0; r < n; ++r) expected += (r + i) % 7;
      wrong += got[i] != expected;
    }
    WORKER_EXPECT(wrong == 0, what + " all-reduce: " + std::to_string(wrong) + " wrong");
    // Max.
    Tensor m = nn::FromVector({static_cast<double>(me), static_cast<double>(n - me)}, {2}, {.dtype = dtype});
    pg->AllReduce(m, ReduceOp::kMax).Wait();
    WORKER_EXPECT(m.ToVector<double>() == std::vector<double>({double(n - 1), double(n)}), what + " max");
    // Broadcast from the last rank.
    Tensor b = nn::Full({5}, me + 3, {.dtype = dtype});
    pg->Broadcast(b, n - 1).Wait();
    WORKER_EXPECT(b.ToVector<double>() == std::vector<double>(5, n - 1 + 3), what + " broadcast");
    // All-gather and reduce-scatter.
    Tensor in = nn::Full({3}, me, {.dtype = dtype});
    Tensor all = nn::Empty({3 * n}, {.dtype = dtype});
    pg->AllGather(all, in).Wait();
    std::vector<double> expected_all;
    for (int r = 0; r < n; ++r) expected_all.insert(expected_all.end(), 3, r);
    WORKER_EXPECT(all.ToVector<double>() == expected_all, what + " all-gather");
    Tensor scatter_in = nn::Ones({2 * n}, {.dtype = dtype});
    Tensor scatter_out = nn::Empty({2}, {.dtype = dtype});
    pg->ReduceScatter(scatter_out, scatter_in).Wait();
    WORKER_EXPECT(scatter_out.ToVector<double>() == std::vector<double>(2, n), what + " reduce-scatter");
  }
  // Many async collectives complete in issue order with the right values.
  std::vector<Tensor> tensors;
  std::vector<Work> works;
  for (int k = 0; k < 50; ++k) {
    tensors.push_back(nn::Full({64 + k}, k));
    works.push_back(pg->AllReduce(tensors.back()));
  }
  for (Work& w : works) w.Wait();
  for (int k = 0; k < 50; ++k) {
    WORKER_EXPECT(tensors[k].ToVector<double>() == std::vector<double>(64 + k, double(k) * n),
                  "async all-reduce " + std::to_string(k));
    WORKER_EXPECT(works[k].IsCompleted() && works[k].finished() >= works[k].started(), "times");
    if (k > 0) WORKER_EXPECT(works[k].started() >= works[k - 1].finished(), "issue order");
  }
  pg->Barrier().Wait();
  // Idle: the communication thread sleeps (no spinning) between collectives.
  const auto before = pg->CommThreadCpuTime();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double idle_ms = std::chrono::duration<double, std::milli>(pg->CommThreadCpuTime() - before).count();
  WORKER_EXPECT(idle_ms < 10, "communication thread used " + std::to_string(idle_ms) +
                                  " ms of CPU in 300 ms of idleness");
  pg->Barrier().Wait();
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, CollectivesOnTwoAndThreeRanks) {
  for (const char* where : {"comm", "caller"}) {
    for (int n : {2, 3}) {
      auto run = RunWorkers("pg_collectives", n, {{"DDP_COLLECTIVE_THREAD", where}});
      EXPECT_TRUE(run.AllSucceeded()) << where << "\n" << testing::AllOutput(run);
    }
  }
}

// Where collectives run. On the caller's thread a collective is complete
// when the call returns, no communication thread is started for it, and
// point-to-point messages and collectives still mix in issue order; on the
// communication thread the caller does not run them.
DDP_TEST_WORKER(pg_collective_thread) {
  const std::string where = std::getenv("DDP_COLLECTIVE_THREAD");
  auto pg = testing::WorkerGroup();
  const int n = pg->size(), me = pg->rank();
  WORKER_EXPECT(pg->collectives_on_caller() == (where == "caller"), "collectives_on_caller");
  Tensor t = nn::Full({100000}, me + 1.0);
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  int busy_threads = 0;
  Work w = pg->Run({.kind = "probe"}, [&](transport::Communicator* comm, transport::Deadline) {
    ran_on = std::this_thread::get_id();
    busy_threads = comm->info().busy_threads_per_rank;
    return transport::Status::Ok();
  });
  Work a = pg->AllReduce(t);
  if (where == "caller") {
    WORKER_EXPECT(w.IsCompleted() && a.IsCompleted(), "not complete on return");
    WORKER_EXPECT(ran_on == caller, "the task ran on another thread");
  }
  w.Wait();
  a.Wait();
  if (where == "comm") WORKER_EXPECT(ran_on != caller, "the task ran on the caller's thread");
  // The group counts two busy threads per rank (CreateFromEnvironment's
  // default); on the caller, its thread no longer is one.
  WORKER_EXPECT(busy_threads == (where == "caller" ? 1 : 2),
                "the communicator's waits were chosen for " + std::to_string(busy_threads) +
                    " busy threads per rank");
  WORKER_EXPECT(t.data<float>()[99999] == n * (n + 1) / 2.0f, "all-reduce value");
  if (where == "caller") {
    WORKER_EXPECT(pg->CommThreadCpuTime().count() == 0, "a communication thread ran");
  }
  // A message in flight (its polling starts the communication thread), then collectives, then the message's answer.
  const int peer = (me + 1) % n, from = (me + n - 1) % n;
  Tensor out = nn::Full({8}, me);
  Tensor in = nn::Empty({8});
  Work send = pg->Send(out, peer, 7);
  Work recv = pg->Recv(in, from, 7);
  Tensor s = nn::Ones({3});
  pg->AllReduce(s).Wait();
  pg->Barrier().Wait();
  send.Wait();
  recv.Wait();
  WORKER_EXPECT(in.data<float>()[7] == from, "message");
  WORKER_EXPECT(s.data<float>()[0] == n, "all-reduce after a message");
  return testing::WorkerExit();
}

// Waits up to 10 s for the forked `child` and returns whether it ended by
// then; `status` gets its wait status (after SIGKILL where it had not).
bool ChildEndsWithin10s(pid_t child, int* status) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  pid_t done = 0;
  while ((done = waitpid(child, status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done == 0) {
    kill(child, SIGKILL);
    waitpid(child, status, 0);
  }
  return done == child;
}

// A process forked from a rank (a data worker that computes, then returns)
// destroys its copy of the group without touching the communication thread,
// which does not exist in it: the child ends at once (it hung in the join),
// and the parent's group goes on.
DDP_TEST_WORKER(pg_forked_child) {
  auto pg = testing::WorkerGroup();
  Tensor t = nn::Ones({1000});
  pg->AllReduce(t).Wait();  // the communication thread runs
  const pid_t child = fork();
  if (child == 0) {
    pg.reset();  // the last reference in the child
    _exit(0);
  }
  int status = -1;
  const bool ended = ChildEndsWithin10s(child, &status);
  WORKER_EXPECT(ended && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                "the forked child did not end by itself within 10 s");
  pg->AllReduce(t).Wait();
  WORKER_EXPECT(t.data<float>()[0] == pg->size() * pg->size(), "all-reduce after the fork");
  return testing::WorkerExit();
}

// A collective issued in a process forked from a rank fails at once with
// the fork guard's FAILED_PRECONDITION (it waited out the whole timeout
// for a communication thread that does not exist in the child, then
// reported TIMED_OUT without naming the fork). Exit codes: 0 as expected,
// 1 nothing thrown, 2 another error, 3 later than 5 s (far from the
// budget, loose for a loaded host).
int CollectiveInForkedChild(const char* what, const std::function<void()>& call) {
  const auto start = std::chrono::steady_clock::now();
  try {
    call();
  } catch (const DistributedError& e) {
    const auto took = std::chrono::steady_clock::now() - start;
    if (e.code() != transport::StatusCode::kFailedPrecondition ||
        std::string(e.what()).find("was forked from pid") == std::string::npos) {
      std::fprintf(stderr, "%s in the forked child: %s\n", what, e.what());
      return 2;
    }
    return took < std::chrono::seconds(5) ? 0 : 3;
  }
  std::fprintf(stderr, "%s in the forked child did not throw\n", what);
  return 1;
}

DDP_TEST_WORKER(pg_forked_child_collective) {
  auto pg = testing::WorkerGroup();
  Tensor t = nn::Ones({1000});
  pg->AllReduce(t).Wait();  // the communication thread runs (DDP_COLLECTIVE_THREAD=comm)
  const pid_t child = fork();
  if (child == 0) {
    int code = CollectiveInForkedChild("AllReduce", [&] { pg->AllReduce(t).Wait(); });
    if (code == 0) code = CollectiveInForkedChild("Barrier", [&] { pg->Barrier().Wait(); });
    if (code == 0) {
      code = CollectiveInForkedChild("BroadcastObject", [&] {
        std::string object = "x";
        pg->BroadcastObject(&object, 0);
      });
    }
    std::fflush(stderr);
    _exit(code);
  }
  int status = -1;
  const bool ended = ChildEndsWithin10s(child, &status);
  WORKER_EXPECT(ended, "the forked child's collectives did not end within 10 s");
  WORKER_EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                "the forked child's collectives did not fail at once with FAILED_PRECONDITION "
                "naming the fork (exit " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) + ")");
  pg->AllReduce(t).Wait();
  WORKER_EXPECT(t.data<float>()[0] == pg->size() * pg->size(), "all-reduce after the fork");
  return testing::WorkerExit();
}

// Waiting in a forked child for a collective issued before the fork, and
// not finished then, fails at once the same way (it waited out the whole
// budget for a communication thread that does not exist in the child).
// IsCompleted there is true (Wait reports why). Rank 1 joins the
// all-reduce only after rank 0's child is done.
DDP_TEST_WORKER(pg_forked_child_waits_for_an_earlier_call) {
  auto pg = testing::WorkerGroup();
  Tensor t = nn::Ones({1000});
  if (pg->rank() != 0) {
    testing::WaitUntilRanksAreDone(*pg, {0});
    pg->AllReduce(t).Wait();
    WORKER_EXPECT(t.data<float>()[0] == pg->size(), "the all-reduce");
    return testing::WorkerExit();
  }
  Work pending = pg->AllReduce(t);
  const pid_t child = fork();
  if (child == 0) {
    if (!pending.IsCompleted()) {
      std::fprintf(stderr, "IsCompleted in the forked child: false for a call nothing can finish\n");
      std::fflush(stderr);
      _exit(4);
    }
    const int code = CollectiveInForkedChild("Wait on an all-reduce issued before the fork",
                                             [&] { pending.Wait(); });
    std::fflush(stderr);
    _exit(code);
  }
  int status = -1;
  const bool ended = ChildEndsWithin10s(child, &status);
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(ended, "the forked child's wait did not end within 10 s");
  WORKER_EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                "the forked child's wait did not fail at once with FAILED_PRECONDITION naming the fork "
                "(exit " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) + ")");
  pending.Wait();
  WORKER_EXPECT(t.data<float>()[0] == pg->size(), "the all-reduce");
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, WaitInForkedChildForAnEarlierCallFailsAtOnce) {
  // With the communication thread only: on the caller, the all-reduce
  // would run (and wait for rank 1) inside AllReduce itself.
  auto run = RunWorkers("pg_forked_child_waits_for_an_earlier_call", 2, {{"DDP_COLLECTIVE_THREAD", "comm"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(ProcessGroupTest, CollectiveInForkedChildFailsAtOnceNamingTheFork) {
  for (const char* where : {"comm", "caller"}) {
    auto run = RunWorkers("pg_forked_child_collective", 2, {{"DDP_COLLECTIVE_THREAD", where}});
    EXPECT_TRUE(run.AllSucceeded()) << where << "\n" << testing::AllOutput(run);
  }
}

TEST(ProcessGroupTest, ForkedChildLeavesItsCopyOfTheGroupAlone) {
  // With a communication thread (the case that hung), and without.
  for (const char* where : {"comm", "caller"}) {
    auto run = RunWorkers("pg_forked_child", 2, {{"DDP_COLLECTIVE_THREAD", where}});
    EXPECT_TRUE(run.AllSucceeded()) << where << "\n" << testing::AllOutput(run);
  }
}

// The fork checks are per group: in a child forked from a rank, a group
// made in the child (one process, no transport) works, while the rank's
// group, made before the fork, is still refused. Before, every group was
// refused in any child of a process that had made a communicator.
DDP_TEST_WORKER(pg_forked_child_own_group) {
  auto pg = testing::WorkerGroup();
  Tensor t = nn::Ones({1000});
  pg->AllReduce(t).Wait();  // the communication thread runs (DDP_COLLECTIVE_THREAD=comm)
  const pid_t child = fork();
  if (child == 0) {
    int code = 0;
    try {
      auto own = ProcessGroup::Single();
      Tensor x = nn::Ones({4});
      Work w = own->AllReduce(x);
      w.Wait();
      if (x.data<float>()[3] != 1.0f || w.finished() == std::chrono::steady_clock::time_point{}) {
        std::fprintf(stderr, "the child's own group: wrong result or no finish time\n");
        code = 5;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "the child's own group in the forked child: %s\n", e.what());
      code = 6;
    }
    if (code == 0) code = CollectiveInForkedChild("AllReduce on the parent's group", [&] { pg->AllReduce(t).Wait(); });
    std::fflush(stderr);
    _exit(code);
  }
  int status = -1;
  const bool ended = ChildEndsWithin10s(child, &status);
  WORKER_EXPECT(ended, "the forked child did not end within 10 s");
  WORKER_EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                "the forked child's own group failed, or the parent's group was not refused (exit " +
                    std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) + ")");
  pg->AllReduce(t).Wait();
  WORKER_EXPECT(t.data<float>()[0] == pg->size() * pg->size(), "all-reduce after the fork");
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, AGroupMadeInAForkedChildWorksWhereTheParentsIsRefused) {
  for (const char* where : {"comm", "caller"}) {
    auto run = RunWorkers("pg_forked_child_own_group", 2, {{"DDP_COLLECTIVE_THREAD", where}});
    EXPECT_TRUE(run.AllSucceeded()) << where << "\n" << testing::AllOutput(run);
  }
}

TEST(ProcessGroupTest, CollectivesRunOnTheChosenThread) {
  for (const char* where : {"comm", "caller"}) {
    auto run = RunWorkers("pg_collective_thread", 2, {{"DDP_COLLECTIVE_THREAD", where}});
    EXPECT_TRUE(run.AllSucceeded()) << where << "\n" << testing::AllOutput(run);
  }
  auto bad = RunWorkers("pg_collective_thread", 2, {{"DDP_COLLECTIVE_THREAD", "sideways"}});
  EXPECT_FALSE(bad.AllSucceeded());
  EXPECT_NE(testing::AllOutput(bad).find("DDP_COLLECTIVE_THREAD=\"sideways\" on ranks 0-1 (of 2): expected auto, comm or "
                                         "caller"),
            std::string::npos)
      << testing::AllOutput(bad);
}

// Ranks on one host: large CPU tensors and CollectiveZeros lie in shareable
// memory, small ones do not, and all-reduces over them are right (the
// host's ranks copy with them through mappings).
DDP_TEST_WORKER(pg_shareable) {
  auto pg = testing::WorkerGroup();
  const Tensor large = nn::Full({1 << 17}, static_cast<double>(pg->rank() + 1));  // 512 KiB
  const Tensor small = nn::Full({1000}, static_cast<double>(pg->rank() + 1));
  const Tensor bucket = pg->CollectiveZeros({3000});
  WORKER_EXPECT(transport::shm::FindShareable(large.data_ptr(), large.nbytes()).has_value(),
                "a 512 KiB tensor is not in shareable memory");
  WORKER_EXPECT(!transport::shm::FindShareable(small.data_ptr(), small.nbytes()).has_value(),
                "a 4 KB tensor is in shareable memory");
  WORKER_EXPECT(transport::shm::FindShareable(bucket.data_ptr(), bucket.nbytes()).has_value(),
                "CollectiveZeros is not in shareable memory");
  WORKER_EXPECT(bucket.data<float>()[2999] == 0.0f, "CollectiveZeros is not zero");
  pg->AllReduce(large).Wait();
  const float want = static_cast<float>(pg->size() * (pg->size() + 1) / 2);
  const float* v = large.data<float>();
  for (int64_t i = 0; i < large.numel(); ++i) {
    if (v[i] != want) {
      WORKER_EXPECT(false, "element " + std::to_string(i) + " is " + std::to_string(v[i]) +
                               ", not " + std::to_string(want));
      break;
    }
  }
  pg->Barrier().Wait();
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, LargeCpuTensorsAreShareableOnOneHost) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("pg_shareable", n);
    EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  }
}

// Ranks run different collectives: with DDP_DEBUG=detail every rank reports
// which rank runs what, with dtypes and shapes, instead of hanging.
DDP_TEST_WORKER(pg_desync) {
  auto pg = testing::WorkerGroup();
  pg->AllReduce(nn::Ones({4})).Wait();  // agreed
  Work w = pg->rank() == 0 ? pg->AllReduce(nn::Ones({10, 3})) : pg->Broadcast(nn::Ones({12}), 0);
  try {
    w.Wait();
    WORKER_EXPECT(false, "the desync was not reported");
  } catch (const DistributedError& e) {
    const std::string m = e.what();
    std::fprintf(stderr, "reported: %s\n", m.c_str());
    WORKER_EXPECT(m.find("desync") != std::string::npos, m);
    WORKER_EXPECT(m.find("rank 0 runs collective #1 all_reduce(sum, f32 [10, 3])") != std::string::npos, m);
    WORKER_EXPECT(m.find("rank 1 runs collective #1 broadcast(root 0, f32 [12])") != std::string::npos, m);
  }
  // The group is aborted: later collectives fail at once with the reason.
  try {
    pg->Barrier().Wait();
    WORKER_EXPECT(false, "barrier after a desync succeeded");
  } catch (const DistributedError& e) {
    WORKER_EXPECT(std::string(e.what()).find("desync") != std::string::npos, e.what());
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, DebugModeReportsDesync) {
  auto run = RunWorkers("pg_desync", 2, {{"DDP_DEBUG", "detail"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The same shapes with a different count of elements: the fingerprints name
// both shapes.
DDP_TEST_WORKER(pg_shape_desync) {
  auto pg = testing::WorkerGroup();
  try {
    pg->AllReduce(nn::Ones({pg->rank() == 0 ? 8 : 9})).Wait();
    WORKER_EXPECT(false, "not reported");
  } catch (const DistributedError& e) {
    const std::string m = e.what();
    WORKER_EXPECT(m.find("f32 [8]") != std::string::npos && m.find("f32 [9]") != std::string::npos, m);
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, DebugModeNamesBothShapes) {
  auto run = RunWorkers("pg_shape_desync", 2, {{"DDP_DEBUG", "detail"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rows exchanged between ranks: equal parts, then rank a sending rank b
// (a + 2 * b) % 3 rows; each row holds (sender, receiver, row) codes.
DDP_TEST_WORKER(pg_all_to_all) {
  auto pg = testing::WorkerGroup();
  const int n = pg->size(), me = pg->rank();
  auto code = [](int from, int to, int64_t row, int64_t col) {
    return static_cast<double>(from * 1000 + to * 100 + row * 4 + col);
  };
  auto rows_of = [&](const std::vector<int64_t>& counts, bool sending) {
    std::vector<double> v;
    for (int q = 0; q < n; ++q) {
      for (int64_t r = 0; r < counts[q]; ++r) {
        for (int64_t c = 0; c < 4; ++c) v.push_back(sending ? code(me, q, r, c) : code(q, me, r, c));
      }
    }
    return v;
  };
  for (bool uneven : {false, true}) {
    std::vector<int64_t> in_splits(n), out_splits(n);
    for (int q = 0; q < n; ++q) {
      in_splits[q] = uneven ? (me + 2 * q) % 3 : 2;
      out_splits[q] = uneven ? (q + 2 * me) % 3 : 2;
    }
    const std::vector<double> send = rows_of(in_splits, true), expected = rows_of(out_splits, false);
    Tensor input = nn::FromVector(send, {static_cast<int64_t>(send.size() / 4), 4});
    Tensor output = nn::Full({static_cast<int64_t>(expected.size() / 4), 4}, -1);
    if (uneven) {
      pg->AllToAll(output, input, out_splits, in_splits).Wait();
    } else {
      pg->AllToAll(output, input).Wait();
    }
    WORKER_EXPECT(output.ToVector<double>() == expected,
                  std::string(uneven ? "uneven" : "equal") + " all-to-all: wrong rows");
  }
  try {
    pg->AllToAll(nn::Zeros({3 * n, 4}), nn::Zeros({3 * n, 4}), {1});
    WORKER_EXPECT(false, "a split list of the wrong length was accepted");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("1 output split sizes adding up to 1") != std::string::npos, e.what());
  }
  return testing::WorkerExit();
}

// Empty tensors still take part in the collective: every rank passing one
// is a call that does nothing, and one rank passing one where the others
// pass data is a mismatch every rank reports, instead of that rank
// skipping the call and its next collective pairing with the wrong one.
DDP_TEST_WORKER(pg_empty) {
  auto pg = testing::WorkerGroup();
  const int n = pg->size(), me = pg->rank();
  Tensor empty = nn::Empty({0});
  pg->AllReduce(empty).Wait();
  pg->Broadcast(empty, n - 1).Wait();
  pg->AllGather(nn::Empty({0}), empty).Wait();
  pg->ReduceScatter(empty, nn::Empty({0})).Wait();
  pg->Reduce(empty, 0).Wait();
  pg->Gather(me == 0 ? nn::Empty({0}) : Tensor(), empty, 0).Wait();
  pg->Scatter(empty, me == 0 ? nn::Empty({0}) : Tensor(), 0).Wait();
  pg->AllToAll(nn::Empty({0, 2}), nn::Empty({0, 2})).Wait();
  Tensor t = nn::Full({5}, me + 1);
  pg->AllReduce(t).Wait();
  WORKER_EXPECT(t.ToVector<double>() == std::vector<double>(5, n * (n + 1) / 2.0),
                "all-reduce after the empty calls");
  // Rank 0 passes nothing where the others pass 4 elements.
  Tensor mine = me == 0 ? nn::Empty({0}) : nn::Ones({4});
  try {
    pg->AllReduce(mine).Wait();
    WORKER_EXPECT(false, "an empty all-reduce against data passed on rank " + std::to_string(me));
  } catch (const DistributedError& e) {
    WORKER_EXPECT(std::string(e.what()).find("INVALID_ARGUMENT") != std::string::npos ||
                      std::string(e.what()).find("count") != std::string::npos,
                  e.what());
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, EmptyTensorsTakePartInCollectives) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("pg_empty", n);
    EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  }
}

// A collective or receive that writes into a caller's tensor bumps its
// storage version, as an in-place op does (what an optimizer's f32 master
// of a 16-bit parameter watches for); tensors it only reads keep theirs.
DDP_TEST_WORKER(pg_versions) {
  auto pg = testing::WorkerGroup();
  const int n = pg->size(), me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  auto version = [](const Tensor& t) { return t.storage()->version(); };
  // Whether each tensor's version moved during `call`, against `want`.
  auto expect = [&](const char* what, std::vector<std::pair<Tensor, bool>> tensors, auto call) {
    std::vector<uint64_t> before;
    for (const auto& [t, want] : tensors) before.push_back(version(t));
    call();
    for (size_t i = 0; i < tensors.size(); ++i) {
      const bool moved = version(tensors[i].first) != before[i];
      WORKER_EXPECT(moved == tensors[i].second, std::string(what) + ": tensor " + std::to_string(i) + "'s version " +
                                                    (moved ? "moved" : "did not move") + on);
    }
  };
  const Tensor t = nn::Ones({8});
  expect("AllReduce", {{t, true}}, [&] { pg->AllReduce(t).Wait(); });
  expect("Broadcast", {{t, me != 0}}, [&] { pg->Broadcast(t, 0).Wait(); });
  const Tensor in = nn::Ones({2 * n}), out = nn::Empty({2 * n * n}), part = nn::Empty({2});
  expect("AllGather", {{out, true}, {in, false}}, [&] { pg->AllGather(out, in).Wait(); });
  expect("ReduceScatter", {{part, true}, {in, false}}, [&] { pg->ReduceScatter(part, in).Wait(); });
  const Tensor rows = nn::Empty({2 * n});
  expect("AllToAll", {{rows, true}, {in, false}}, [&] { pg->AllToAll(rows, in).Wait(); });
  expect("Reduce", {{t, me == 0}}, [&] { pg->Reduce(t, 0).Wait(); });
  const Tensor gathered = me == 0 ? nn::Empty({2 * n}) : nn::Empty({1});
  expect("Gather", {{gathered, me == 0}, {part, false}},
         [&] { pg->Gather(me == 0 ? gathered : Tensor(), part, 0).Wait(); });
  expect("Scatter", {{part, true}, {in, false}}, [&] { pg->Scatter(part, me == 0 ? in : Tensor(), 0).Wait(); });
  // Rank 0 sends to rank 1.
  const Tensor message = nn::Full({4}, me);
  expect("Send/Recv", {{message, me == 1}}, [&] {
    if (me == 0) pg->Send(message, 1).Wait();
    if (me == 1) pg->Recv(message, 0).Wait();
  });
  WORKER_EXPECT(me != 1 || message.ToVector<double>() == std::vector<double>(4, 0), "received" + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, WritesIntoATensorBumpItsVersion) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("pg_versions", n);
    EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  }
}

TEST(ProcessGroupTest, AllToAllEqualAndUnevenRows) {
  for (int n : {2, 3}) {
    auto run = RunWorkers("pg_all_to_all", n);
    EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
  }
}

TEST(ProcessGroupTest, SingleProcessGroupIsLocal) {
  auto pg = ProcessGroup::Single();
  EXPECT_EQ(pg->rank(), 0);
  EXPECT_EQ(pg->size(), 1);
  Tensor t = nn::FromVector({1, 2, 3}, {3});
  pg->AllReduce(t, ReduceOp::kAvg).Wait();
  EXPECT_EQ(t.ToVector<double>(), std::vector<double>({1, 2, 3}));
  Tensor out = nn::Empty({3});
  pg->AllGather(out, t).Wait();
  EXPECT_EQ(out.ToVector<double>(), std::vector<double>({1, 2, 3}));
  Tensor rows = nn::FromVector({1, 2, 3, 4}, {2, 2});
  Tensor moved = nn::Empty({2, 2});
  pg->AllToAll(moved, rows).Wait();
  EXPECT_EQ(moved.ToVector<double>(), std::vector<double>({1, 2, 3, 4}));
  pg->Barrier().Wait();
  // A rank sends itself what it receives from itself: 3 rows in, 2 out.
  try {
    pg->AllToAll(nn::Empty({2, 2}), nn::Zeros({3, 2}), {2}, {3});
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 sends itself 3 rows (input split 0) but receives 2"),
              std::string::npos)
        << e.what();
  }
}

// ThroughPieces refuses a negative element count by name (a group with a
// transport took it as a count near 2^64); before, a one-process group
// returned the piece {0, -1}.
TEST(ProcessGroupTest, ThroughPiecesRefusesANegativeCount) {
  auto pg = ProcessGroup::Single();
  try {
    pg->ThroughPieces(-1, DType::kFloat32);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ProcessGroup::ThroughPieces: numel -1 is negative"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(pg->ThroughPieces(0, DType::kFloat32), (std::vector<std::pair<int64_t, int64_t>>{{0, 0}}));
}

// Abort with an OK status stops a one-process group too, as it does a
// group with a communicator (which takes it as "no reason given"); before,
// the group went on as if nothing had been asked.
TEST(ProcessGroupTest, AbortWithAnOkStatusStopsAOneProcessGroup) {
  auto pg = ProcessGroup::Single();
  pg->Abort(transport::Status::Ok());
  EXPECT_EQ(pg->aborted_reason().code(), transport::StatusCode::kAborted);
  Tensor t = nn::Ones({2});
  try {
    pg->AllReduce(t).Wait();
    FAIL() << "an all-reduce ran after the abort";
  } catch (const DistributedError& e) {
    EXPECT_NE(std::string(e.what()).find("not run: the group was aborted: ProcessGroup::Abort was called with an OK "
                                         "status (no reason given)"),
              std::string::npos)
        << e.what();
  }
}

// AllGatherObject's two ways, on every rank alike: objects of a few bytes
// from every rank (the trainer's stats line, "0.00"), an empty one, one
// holding zero bytes, gathered by default (one padded all-gather: 2
// transport calls, where a broadcast per rank cost 1 + the ranks with a
// non-empty object), with every size forced onto the broadcasts (limit 0)
// and onto the padded all-gather (no limit). Each way gives every rank the
// same objects.
DDP_TEST_WORKER(pg_all_gather_object_paths) {
  auto pg = testing::WorkerGroup();
  const int n = pg->size(), me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  std::vector<std::string> expected;
  int non_empty = 0;
  for (int r = 0; r < n; ++r) {
    std::string object = r == 1 ? "" : std::to_string(r) + ".00";
    if (r == 2) object = std::string("zero\0byte and a longer tail", 27);
    non_empty += object.empty() ? 0 : 1;
    expected.push_back(object);
  }
  struct Way {
    const char* name;
    size_t limit;
    uint64_t calls;
  };
  for (const Way& way : {Way{"default", internal::kObjectAllGatherPaddedBytes, 2},
                         Way{"broadcasts", 0, 1 + static_cast<uint64_t>(non_empty)},
                         Way{"padded", std::numeric_limits<size_t>::max(), 2}}) {
    internal::SetObjectAllGatherPaddedBytesForTesting(way.limit);
    const uint64_t before = internal::ObjectAllGatherCallsForTesting();
    const std::vector<std::string> all = pg->AllGatherObject(expected[static_cast<size_t>(me)]);
    const uint64_t calls = internal::ObjectAllGatherCallsForTesting() - before;
    WORKER_EXPECT(all == expected, std::string(way.name) + ": wrong objects (" + std::to_string(all.size()) + ")" + on);
    WORKER_EXPECT(calls == way.calls, std::string(way.name) + ": " + std::to_string(calls) +
                                          " transport calls, expected " + std::to_string(way.calls) + on);
  }
  internal::SetObjectAllGatherPaddedBytesForTesting(internal::kObjectAllGatherPaddedBytes);
  // Every object empty: the lengths alone.
  const uint64_t before = internal::ObjectAllGatherCallsForTesting();
  WORKER_EXPECT(pg->AllGatherObject("") == std::vector<std::string>(static_cast<size_t>(n)), "empty objects" + on);
  WORKER_EXPECT(internal::ObjectAllGatherCallsForTesting() - before == 1, "empty objects: not one call" + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, AllGatherObjectOfSmallObjectsIsOneAllGatherAndBothWaysAgree) {
  for (int n : {2, 3, 4}) {
    auto run = RunWorkers("pg_all_gather_object_paths", n, {}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << n << " ranks\n" << testing::AllOutput(run);
  }
}

// ISSUE_CASE: a call whose first allocation on rank 1 fails (std::bad_alloc
// before its collective, or message, is queued: the call's description,
// its task, the Work's state); run_late: Run's second allocation, past the
// task's wrapping, in the part it shares with RunFenced; new_group: the
// rank list's check. Rank 1 gets the bad_alloc; rank 0, already in the
// collective (or waiting for the message), must fail at once naming rank 1
// and the call the user made, not wait out the 20 s timeout.
DDP_TEST_WORKER(pg_issue_out_of_memory) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  const std::string c = std::getenv("ISSUE_CASE");
  Tensor t = nn::Full({4}, me + 1);
  const CollectiveDescription run_description{"custom", DType::kFloat32, {4}};
  std::vector<Tensor> outputs;
  if (me == 0) outputs = {nn::Zeros({4}), nn::Zeros({4})};
  const std::vector<int> pair_ranks = {0, 1};  // made before the failure is armed
  // Made before the failure is armed (moved into Run, not copied): the
  // failure is then Run's own.
  ProcessGroup::Task task = [t](transport::Communicator* comm, transport::Deadline deadline) {
    return comm->AllReduce(t.data_ptr(), 4, transport::DataType::kF32, ReduceOp::kSum, internal::Within(deadline));
  };
  pg->Barrier().Wait();
  const auto start = std::chrono::steady_clock::now();
  std::string outcome = "succeeded";
  try {
    fail_next_allocation = me == 1;
    allocations_before_failure = c == "run_late" ? 1 : 0;
    Work work;
    if (c == "all_reduce") {
      work = pg->AllReduce(t);
    } else if (c == "barrier") {
      work = pg->Barrier();
    } else if (c == "gather_list") {
      work = pg->GatherList(outputs, t, 0);
    } else if (c == "run" || c == "run_late") {
      work = pg->Run(run_description, std::move(task));
    } else if (c == "new_group") {
      const std::shared_ptr<ProcessGroup> group = pg->NewGroup(pair_ranks);
      WORKER_EXPECT(false, "NewGroup formed a group" + on);
    } else if (c == "send_recv") {
      work = me == 1 ? pg->Send(t, 0) : pg->Recv(t, 1);
    } else {
      WORKER_EXPECT(false, "unknown ISSUE_CASE " + c);
    }
    fail_next_allocation = false;
    work.Wait();
  } catch (const DistributedError& e) {
    outcome = std::string("DistributedError: ") + e.what();
  } catch (const std::bad_alloc&) {
    outcome = "std::bad_alloc";
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  fail_next_allocation = false;
  allocations_before_failure = 0;
  if (me == 1) {
    WORKER_EXPECT(outcome == "std::bad_alloc", c + ": " + outcome + on);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10),
                c + ": waited for the timeout" + on);
  const std::string call = c == "all_reduce"    ? "AllReduce"
                           : c == "barrier"     ? "Barrier"
                           : c == "gather_list" ? "GatherList"
                           : c == "send_recv"   ? "Send"
                           : c == "new_group"   ? "NewGroup"
                                                : "Run";
  WORKER_EXPECT(outcome.rfind("DistributedError: ", 0) == 0 &&
                    outcome.find("ProcessGroup::" + call + " failed on rank 1 before it was issued: std::bad_alloc") !=
                        std::string::npos,
                c + ": " + outcome + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, NoMemoryToIssueACallOnOneRankFailsEveryRankAtOnce) {
  for (const char* c : {"all_reduce", "barrier", "gather_list", "run", "run_late", "send_recv", "new_group"}) {
    auto run = RunWorkers("pg_issue_out_of_memory", 2, {{"ISSUE_CASE", c}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << c << "\n" << testing::AllOutput(run);
  }
}

// A collective whose bookkeeping after its task (its trace event) runs out
// of memory on rank 1, on the communication thread
// (DDP_COLLECTIVE_THREAD=comm) or the caller's (caller): the task arms
// internal::FailNextBookkeepingForTesting as it returns, which fails that
// bookkeeping and nothing else (a one-shot failing operator new armed there
// took whatever allocation came next, perhaps outside Run). The item
// fails on rank 1 with RESOURCE_EXHAUSTED naming it, and the group is
// aborted: rank 0's next collective fails at once with that reason, and so
// does rank 1's. Before, the exception ended rank 1 (out of the
// communication thread), or left the call counted as running, so that the
// next collective never started and waited out its budget.
DDP_TEST_WORKER(pg_run_bookkeeping_out_of_memory) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  const std::string want = "could not run custom_bookkeeping(f32 [4]) on rank 1: its bookkeeping failed: std::bad_alloc";
  pg->Barrier().Wait();
  std::string ran = "succeeded";
  try {
    pg->Run({"custom_bookkeeping", DType::kFloat32, {4}}, [me](transport::Communicator*, transport::Deadline) {
        if (me == 1) internal::FailNextBookkeepingForTesting();
        return transport::Status::Ok();
      }).Wait();
  } catch (const DistributedError& e) {
    ran = std::string("DistributedError: ") + e.what();
  } catch (const std::exception& e) {
    ran = std::string("another exception: ") + e.what();
  }
  WORKER_EXPECT(me == 1 ? ran.rfind("DistributedError: RESOURCE_EXHAUSTED: " + want, 0) == 0 : ran == "succeeded",
                "the task's call: " + ran + on);
  const auto start = std::chrono::steady_clock::now();
  std::string next = "succeeded";
  try {
    Tensor t = nn::Full({4}, me + 1);
    pg->AllReduce(t).Wait();
  } catch (const DistributedError& e) {
    next = e.what();
  }
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10),
                "the next collective waited for its budget" + on);
  WORKER_EXPECT(next.find(want) != std::string::npos, "the next collective: " + next + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, NoMemoryForACallsBookkeepingFailsItAndAbortsTheGroup) {
  for (const char* thread : {"comm", "caller"}) {
    auto run = RunWorkers("pg_run_bookkeeping_out_of_memory", 2, {{"DDP_COLLECTIVE_THREAD", thread}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << thread << "\n" << testing::AllOutput(run);
  }
}

// The same, where the memory runs out again while the failure's reason is
// being written (the test's operator new fails the next allocation of the
// thread that runs the task, armed inside it: the reason's text is that
// allocation). The item fails, and the group is aborted, with
// RESOURCE_EXHAUSTED "out of memory", which takes no allocation; before,
// the reason was empty, and rank 0 learnt only that rank 1 had aborted.
DDP_TEST_WORKER(pg_run_bookkeeping_and_its_reason_out_of_memory) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  pg->Barrier().Wait();
  std::string ran = "succeeded";
  try {
    pg->Run({"custom_bookkeeping", DType::kFloat32, {4}}, [me](transport::Communicator*, transport::Deadline) {
        if (me == 1) {
          internal::FailNextBookkeepingForTesting();
          fail_next_allocation = true;
        }
        return transport::Status::Ok();
      }).Wait();
  } catch (const DistributedError& e) {
    ran = std::string("DistributedError: ") + e.what();
  } catch (const std::exception& e) {
    ran = std::string("another exception: ") + e.what();
  }
  WORKER_EXPECT(me == 1 ? ran == "DistributedError: RESOURCE_EXHAUSTED: out of memory" : ran == "succeeded",
                "the task's call: " + ran + on);
  const auto start = std::chrono::steady_clock::now();
  std::string next = "succeeded";
  try {
    Tensor t = nn::Full({4}, me + 1);
    pg->AllReduce(t).Wait();
  } catch (const DistributedError& e) {
    next = e.what();
  }
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10),
                "the next collective waited for its budget" + on);
  WORKER_EXPECT(next.rfind("RESOURCE_EXHAUSTED: ", 0) == 0 && next.find("out of memory") != std::string::npos,
                "the next collective: " + next + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, NoMemoryForABookkeepingFailuresReasonStillTellsThePeers) {
  for (const char* thread : {"comm", "caller"}) {
    auto run = RunWorkers("pg_run_bookkeeping_and_its_reason_out_of_memory", 2, {{"DDP_COLLECTIVE_THREAD", thread}},
                          60000);
    EXPECT_TRUE(run.AllSucceeded()) << thread << "\n" << testing::AllOutput(run);
  }
}

// A Send whose messages are posted in the call (nothing queued or running
// ahead: DDP_COLLECTIVE_THREAD=caller ran the barrier before it on this
// thread) and whose bookkeeping after the post runs out of memory on rank 1
// (internal::FailNextBookkeepingForTesting). The call returns the Work of
// the messages it posted, which fails with RESOURCE_EXHAUSTED naming it, and
// the group is aborted: the next collective fails at once on both ranks
// with that reason. Before, nothing there was guarded: a std::bad_alloc
// after the post left Send throwing, with its message in flight and no
// Work, and the abort said that it failed before it was issued. The
// message was listed for the communication thread to poll before its
// bookkeeping ran, so that thread could finish it first, OK or with the
// abort's text (about one run in twenty of this test as it was); it is
// listed only once its bookkeeping succeeded. Here that thread polls (a
// receive never matched is in flight) while the abort takes milliseconds
// (it aborts 48 subgroups too): the old listing failed every run.
DDP_TEST_WORKER(pg_posted_here_bookkeeping_out_of_memory) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  const std::string want =
      "could not post send to rank 0 tag 0(f32 [4]) on rank 1: its bookkeeping failed: std::bad_alloc";
  Tensor t = nn::Full({4}, me + 1);
  std::vector<std::shared_ptr<ProcessGroup>> subgroups;
  for (int k = 0; k < 48; ++k) subgroups.push_back(pg->NewGroup({0, 1}));
  pg->Barrier().Wait();
  if (me == 1) {
    // Never sent: it keeps the communication thread polling what is listed.
    Tensor never = nn::Zeros({1});
    const Work pending = pg->Recv(never, 0, 7);
    std::string sent = "succeeded";
    try {
      internal::FailNextBookkeepingForTesting();
      Work work = pg->Send(t, 0);
      WORKER_EXPECT(work.IsCompleted(), "the Send's Work is not complete after a failed post" + on);
      work.Wait();
    } catch (const DistributedError& e) {
      sent = std::string("DistributedError: ") + e.what();
    } catch (const std::exception& e) {
      sent = std::string("another exception: ") + e.what();
    }
    WORKER_EXPECT(sent.rfind("DistributedError: RESOURCE_EXHAUSTED: " + want, 0) == 0, "the Send: " + sent + on);
  } else {
    // The message was posted before the abort: it may arrive or fail.
    const transport::Status received = pg->Recv(t, 1).WaitFor(std::chrono::steady_clock::now() + std::chrono::seconds(10));
    WORKER_EXPECT(received.ok() || received.message().find(want) != std::string::npos,
                  "the Recv: " + received.ToString() + on);
  }
  const auto start = std::chrono::steady_clock::now();
  std::string next = "succeeded";
  try {
    pg->AllReduce(t).Wait();
  } catch (const DistributedError& e) {
    next = e.what();
  }
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10),
                "the next collective waited for its budget" + on);
  WORKER_EXPECT(next.find(want) != std::string::npos, "the next collective: " + next + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, NoMemoryAfterPostingAMessageFailsItsWorkAndAbortsTheGroup) {
  auto run = RunWorkers("pg_posted_here_bookkeeping_out_of_memory", 2, {{"DDP_COLLECTIVE_THREAD", "caller"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A message posted in the call after the group was aborted (it says "not
// run: the group was aborted: ...") whose bookkeeping then runs out of
// memory keeps that first reason, with a note of the bookkeeping's failure;
// before, the note replaced it ("could not post ...: its bookkeeping
// failed"), naming the wrong problem.
DDP_TEST_WORKER(pg_posted_after_abort_bookkeeping_out_of_memory) {
  auto pg = testing::WorkerGroup();
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  Tensor t = nn::Ones({4});
  pg->Barrier().Wait();
  if (me == 0) {
    pg->Abort(transport::AbortedError("stopped by the test"));
    internal::FailNextBookkeepingForTesting();
  }
  std::string what = "succeeded";
  try {
    (me == 0 ? pg->Send(t, 1) : pg->Recv(t, 0)).Wait();
  } catch (const DistributedError& e) {
    what = e.what();
  }
  if (me == 0) {
    const std::string want =
        "send to rank 1 tag 0(f32 [4]) on rank 0: not run: the group was aborted: stopped by the test (and its "
        "bookkeeping failed: std::bad_alloc)";
    WORKER_EXPECT(what.find(want) != std::string::npos, "the Send: " + what + on);
  } else {
    WORKER_EXPECT(what.find("stopped by the test") != std::string::npos, "the Recv: " + what + on);
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, ABookkeepingFailureAfterAFailedPostKeepsThePostsReason) {
  auto run = RunWorkers("pg_posted_after_abort_bookkeeping_out_of_memory", 2, {{"DDP_COLLECTIVE_THREAD", "caller"}},
                        30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A post in the call that runs out of memory before its messages go
// (internal::FailNextPostForTesting) fails its Work and aborts the group
// with a reason that names the rank; the peers were told a bare
// "RESOURCE_EXHAUSTED: " (an empty reason).
DDP_TEST_WORKER(pg_post_out_of_memory) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  const std::string reason = "rank 1 ran out of memory while posting a point-to-point message";
  Tensor t = nn::Ones({4});
  pg->Barrier().Wait();
  if (me == 1) {
    internal::FailNextPostForTesting();
    const transport::Status sent = pg->Send(t, 0).WaitFor(std::chrono::steady_clock::now() + std::chrono::seconds(10));
    WORKER_EXPECT(sent.code() == transport::StatusCode::kResourceExhausted &&
                      sent.message() == "send to rank 0 tag 0(f32 [4]) on rank 1: " + reason,
                  "the Send: " + sent.ToString() + on);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  const transport::Status received = pg->Recv(t, 1).WaitFor(std::chrono::steady_clock::now() + std::chrono::seconds(10));
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(received.code() == transport::StatusCode::kResourceExhausted &&
                    received.message().find(reason) != std::string::npos,
                "the Recv: " + received.ToString() + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, NoMemoryToPostAMessageTellsThePeersWhichRank) {
  auto run = RunWorkers("pg_post_out_of_memory", 2, {{"DDP_COLLECTIVE_THREAD", "caller"}}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A message posted in the call on a group aborted already reports the
// abort's code and reason ("not run: the group was aborted: ..."), even when
// memory runs out as it is posted (internal::FailNextPostForTesting): the
// abort is looked at first. Before, the injected failure came first and the
// Work said RESOURCE_EXHAUSTED "rank 0 ran out of memory while posting".
DDP_TEST_WORKER(pg_post_out_of_memory_after_abort) {
  auto pg = testing::WorkerGroup();
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  Tensor t = nn::Ones({4});
  pg->Barrier().Wait();
  if (me == 0) {
    pg->Abort(transport::AbortedError("stopped by the test"));
    internal::FailNextPostForTesting();
    const transport::Status sent = pg->Send(t, 1).WaitFor(std::chrono::steady_clock::now() + std::chrono::seconds(10));
    WORKER_EXPECT(sent.code() == transport::StatusCode::kAborted &&
                      sent.message() ==
                          "send to rank 1 tag 0(f32 [4]) on rank 0: not run: the group was aborted: stopped by the test",
                  "the Send: " + sent.ToString() + on);
  } else {
    const transport::Status received =
        pg->Recv(t, 0).WaitFor(std::chrono::steady_clock::now() + std::chrono::seconds(10));
    WORKER_EXPECT(received.message().find("stopped by the test") != std::string::npos,
                  "the Recv: " + received.ToString() + on);
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, APostOnAnAbortedGroupReportsTheAbortEvenWhenMemoryRunsOut) {
  auto run = RunWorkers("pg_post_out_of_memory_after_abort", 2, {{"DDP_COLLECTIVE_THREAD", "caller"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(ProcessGroupTest, BadArgumentsNameTheProblem) {
  auto pg = ProcessGroup::Single();
  Tensor m = nn::Zeros({4, 3});
  try {
    pg->AllReduce(m.Transpose(0, 1));
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("not contiguous (shape [3, 4], strides [1, 3])"), std::string::npos)
        << e.what();
  }
  try {
    pg->AllReduce(Tensor());
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("undefined"), std::string::npos) << e.what();
  }
  try {
    pg->Broadcast(m, 1);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("root 1 is outside a group of size 1"), std::string::npos) << e.what();
  }
  try {
    pg->AllGather(nn::Zeros({5}), nn::Zeros({4}));
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("input f32 [4], output f32 [5]"), std::string::npos) << e.what();
  }
}

// A timeout so long that its clock arithmetic would overflow (every
// collective then timed out at once) is refused, naming the bound.
TEST(ProcessGroupTest, TimeoutBeyondThirtyDaysIsRefused) {
  try {
    ProcessGroup::Single({.timeout = std::chrono::milliseconds::max()});
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ProcessGroupOptions::timeout is at most 30 days"), std::string::npos)
        << e.what();
  }
  auto pg = ProcessGroup::Single({.timeout = kMostTimeout});
  Tensor t = nn::FromVector({1, 2}, {2});
  pg->AllReduce(t).Wait();
  EXPECT_EQ(t.ToVector<double>(), std::vector<double>({1, 2}));
}

// ProcessGroupOptions::wait_margin: a Wait for a task that ignores its
// deadline gives up at the timeout plus the margin (it was 5 s past the
// timeout whatever the options), and leaves the task running. A margin
// out of range is refused, naming the option.
TEST(ProcessGroupTest, AWaitGivesUpAtTheTimeoutPlusTheWaitMargin) {
  for (const int64_t bad : {int64_t{-1}, kMostTimeout.count() + 1}) {
    try {
      ProcessGroup::Single({.wait_margin = std::chrono::milliseconds(bad)});
      ADD_FAILURE() << "wait_margin " << bad << " ms was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("ProcessGroupOptions::wait_margin must be in [0, "), std::string::npos)
          << e.what();
    }
  }
  auto pg = ProcessGroup::Single({.timeout = std::chrono::milliseconds(500),
                                  .collective_thread = CollectiveThread::kCommThread,
                                  .wait_margin = std::chrono::milliseconds(200)});
  // The task holds the communication thread until the test releases it
  // (30 s at most), whatever its deadline says.
  auto release = std::make_shared<std::promise<void>>();
  std::shared_future<void> released = release->get_future().share();
  auto finished = std::make_shared<std::atomic<bool>>(false);
  CollectiveDescription d{"ignores_its_deadline", nn::DType::kFloat32, {0}, -1, ReduceOp::kSum, false};
  const auto start = std::chrono::steady_clock::now();
  Work w = pg->Run(d, [released, finished](transport::Communicator*, transport::Deadline) {
    released.wait_for(std::chrono::seconds(30));
    finished->store(true);
    return transport::Status::Ok();
  });
  std::string error;
  try {
    w.Wait();
  } catch (const DistributedError& e) {
    error = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool finished_first = finished->load();
  release->set_value();
  EXPECT_NE(error.find("not finished by the waiter's deadline"), std::string::npos) << error;
  EXPECT_FALSE(finished_first) << "the task ended before the wait gave up";
  EXPECT_GE(seconds, 0.7) << "the wait gave up before the timeout (0.5 s) plus the margin (0.2 s)";
  // 5.5 s with the margin fixed at 5 s; far less than that on a loaded machine.
  EXPECT_LT(seconds, 4.0) << "the wait did not give up at the timeout plus the margin";
}

// Destroying a group whose task ignores its deadline and the abort: the
// destructor gives up on the task one wait margin after the abort (the
// timeout plus the margin from the start, plus one more margin), fails the
// collective queued behind it, and returns; the task, released later,
// finishes on its own thread. `stuck` outlives the group: its Work too.
TEST(ProcessGroupTest, DestructionGivesUpOnATaskThatIgnoresTheAbort) {
  auto pg = ProcessGroup::Single({.timeout = std::chrono::milliseconds(500),
                                  .collective_thread = CollectiveThread::kCommThread,
                                  .wait_margin = std::chrono::milliseconds(200)});
  auto release = std::make_shared<std::promise<void>>();
  std::shared_future<void> released = release->get_future().share();
  auto finished = std::make_shared<std::atomic<bool>>(false);
  auto started = std::make_shared<std::promise<void>>();
  auto ended = std::make_shared<std::promise<void>>();
  std::future<void> ended_future = ended->get_future();
  CollectiveDescription d{"ignores_the_abort", nn::DType::kFloat32, {0}, -1, ReduceOp::kSum, false};
  Work stuck = pg->Run(d, [released, finished, started, ended](transport::Communicator*, transport::Deadline) {
    started->set_value();
    released.wait_for(std::chrono::seconds(30));
    finished->store(true);
    ended->set_value();
    return transport::Status::Ok();
  });
  ASSERT_EQ(started->get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  Work queued = pg->Run({"queued_behind", nn::DType::kFloat32, {0}, -1, ReduceOp::kSum, false},
                        [](transport::Communicator*, transport::Deadline) { return transport::Status::Ok(); });
  const auto start = std::chrono::steady_clock::now();
  std::future<void> destroyed = std::async(std::launch::async, [&pg] { pg.reset(); });
  const bool returned = destroyed.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool finished_first = finished->load();
  // The queued collective failed with the abort, by the time the destructor returned.
  std::string error;
  if (returned) {
    try {
      queued.Wait();
    } catch (const DistributedError& e) {
      error = e.what();
    }
  }
  release->set_value();
  destroyed.wait();
  EXPECT_TRUE(returned) << "the destructor was still waiting for the task after 5 s";
  EXPECT_FALSE(finished_first) << "the task ended before the destructor gave up";
  EXPECT_GE(seconds, 0.8) << "gave up before the timeout (0.5 s) plus two margins (0.2 s each)";
  EXPECT_NE(error.find("unfinished past their deadlines"), std::string::npos) << error;
  // The task, released, runs to its end on the thread left to it.
  EXPECT_EQ(ended_future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
}

// The same with a message in flight (a receive that no send matches, on
// each of two ranks): when the destructor gives up on the task, the
// message's Work fails too, by the time the destructor returns (it is
// finished in the list, which is not copied there).
DDP_TEST_WORKER(pg_destroyed_with_a_stuck_task_and_a_message_in_flight) {
  auto pg = ProcessGroup::CreateFromEnvironment({.timeout = std::chrono::milliseconds(500),
                                                 .collective_thread = CollectiveThread::kCommThread,
                                                 .wait_margin = std::chrono::milliseconds(200)});
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  Tensor never = nn::Zeros({4});
  const Work message = pg->Recv(never, 1 - me, 9);
  auto release = std::make_shared<std::promise<void>>();
  std::shared_future<void> released = release->get_future().share();
  auto started = std::make_shared<std::promise<void>>();
  auto ended = std::make_shared<std::promise<void>>();
  std::future<void> ended_future = ended->get_future();
  const Work stuck = pg->Run({"ignores_the_abort", DType::kFloat32, {0}},
                             [released, started, ended](transport::Communicator*, transport::Deadline) {
                               started->set_value();
                               released.wait_for(std::chrono::seconds(30));
                               ended->set_value();
                               return transport::Status::Ok();
                             });
  WORKER_EXPECT(started->get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready,
                "the task did not start" + on);
  std::future<void> destroyed = std::async(std::launch::async, [&pg] { pg.reset(); });
  const bool returned = destroyed.wait_for(std::chrono::seconds(8)) == std::future_status::ready;
  const bool completed = returned && message.IsCompleted();
  release->set_value();
  if (destroyed.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    // The future's destructor would wait for it: the worker ends here.
    WORKER_EXPECT(false, "the destructor did not return 30 s after the task was released" + on);
    std::_Exit(testing::WorkerExit());
  }
  WORKER_EXPECT(returned, "the destructor was still waiting for the task after 8 s" + on);
  WORKER_EXPECT(completed, "the message in flight was not finished by the destructor" + on);
  Work waited = message;
  const transport::Status status = waited.WaitFor(std::chrono::steady_clock::now() + std::chrono::seconds(1));
  // Failed with the abort, or with its own deadline, which has passed.
  WORKER_EXPECT(!status.ok() && status.message().find("waiter's deadline") == std::string::npos,
                "the message in flight: " + status.ToString() + on);
  WORKER_EXPECT(ended_future.wait_for(std::chrono::seconds(10)) == std::future_status::ready,
                "the task did not end on the thread left to it" + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, DestructionGivesUpOnATaskAndFailsTheMessagesInFlight) {
  auto run = RunWorkers("pg_destroyed_with_a_stuck_task_and_a_message_in_flight", 2, {}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(ProcessGroupTest, DefaultGroupMustBeInitialized) {
  DestroyProcessGroup();
  EXPECT_THROW(DefaultProcessGroup(), std::logic_error);
  SetDefaultProcessGroup(ProcessGroup::Single());
  EXPECT_EQ(DefaultProcessGroup()->size(), 1);
  DestroyProcessGroup();
}

// The list forms stage through a buffer of their own on the communication
// thread, where grad mode is on: tensors that require grad (parameters) are
// scattered from and gathered into all the same.
DDP_TEST_WORKER(pg_list_forms_with_grad) {
  auto pg = testing::WorkerGroup();
  const int n = pg->size(), me = pg->rank();
  std::vector<Tensor> inputs, outputs;
  if (me == 0) {
    for (int r = 0; r < n; ++r) {
      inputs.push_back(nn::Full({3}, 10.0 * (r + 1)));
      inputs.back().set_requires_grad(true);
      outputs.push_back(nn::Zeros({3}));
      outputs.back().set_requires_grad(true);
    }
  }
  const Tensor out = nn::Zeros({3});
  try {
    pg->ScatterList(out, inputs, 0).Wait();
    WORKER_EXPECT(out.ToVector<double>() == std::vector<double>(3, 10.0 * (me + 1)),
                  "ScatterList delivered the wrong values on rank " + std::to_string(me));
    const Tensor mine = nn::Full({3}, 5.0 + me);
    pg->GatherList(outputs, mine, 0).Wait();
    for (int r = 0; me == 0 && r < n; ++r) {
      WORKER_EXPECT(outputs[r].ToVector<double>() == std::vector<double>(3, 5.0 + r),
                    "GatherList: rank " + std::to_string(r) + "'s block is wrong");
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("rank ") + std::to_string(me) + ": " + e.what());
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, ListFormsTakeTensorsThatRequireGrad) {
  for (const char* where : {"comm", "caller"}) {
    auto run = RunWorkers("pg_list_forms_with_grad", 2, {{"DDP_COLLECTIVE_THREAD", where}}, 30000);
    EXPECT_TRUE(run.AllSucceeded()) << where << "\n" << testing::AllOutput(run);
  }
}

// Ranks that pass NewGroup different lists all throw, naming the rank
// whose list differs from rank 0's, and the parent group stays usable.
DDP_TEST_WORKER(pg_new_group_lists_differ) {
  auto pg = testing::WorkerGroup();
  const int me = pg->rank();
  const std::vector<std::vector<int>> rank2_lists = {{0, 1, 2}, {1, 0}};
  for (const std::vector<int>& other : rank2_lists) {
    const std::vector<int> list = me == 2 ? other : std::vector<int>{0, 1};
    try {
      auto group = pg->NewGroup(list);
      WORKER_EXPECT(false, "rank " + std::to_string(me) + ": NewGroup with differing lists did not throw");
    } catch (const std::invalid_argument& e) {
      WORKER_EXPECT(std::string(e.what()).find("rank 2") != std::string::npos,
                    std::string("the error does not name rank 2: ") + e.what());
    } catch (const std::exception& e) {
      WORKER_EXPECT(false, std::string("not invalid_argument: ") + e.what());
    }
  }
  // A list only rank 2 finds invalid: every rank fails at once (before,
  // rank 2 threw alone and the others waited for it until their deadline).
  {
    const std::vector<int> list = me == 2 ? std::vector<int>{0, 1, 1} : std::vector<int>{0, 1};
    const std::string want = me == 2 ? "ProcessGroup::NewGroup: rank 1 given twice"
                                     : "ProcessGroup::NewGroup: rank 2 passed an invalid rank list";
    try {
      auto group = pg->NewGroup(list);
      WORKER_EXPECT(false, "rank " + std::to_string(me) + ": NewGroup with an invalid list did not throw");
    } catch (const std::invalid_argument& e) {
      WORKER_EXPECT(std::string(e.what()).find(want) != std::string::npos,
                    "rank " + std::to_string(me) + ": expected '" + want + "', got: " + e.what());
    } catch (const std::exception& e) {
      WORKER_EXPECT(false, std::string("not invalid_argument: ") + e.what());
    }
  }
  Tensor t = nn::Ones({4});
  pg->AllReduce(t).Wait();
  WORKER_EXPECT(t.ToVector<double>() == std::vector<double>(4, 3.0), "the group is not usable after");
  auto pair = pg->NewGroup({0, 1});
  WORKER_EXPECT((pair != nullptr) == (me != 2), "NewGroup({0, 1}) after the refusal");
  if (pair != nullptr) {
    Tensor u = nn::Ones({2});
    pair->AllReduce(u).Wait();
    WORKER_EXPECT(u.ToVector<double>() == std::vector<double>(2, 2.0), "the pair's all-reduce");
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, NewGroupRefusesDifferingLists) {
  auto run = RunWorkers("pg_new_group_lists_differ", 3, {}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// NewGroup({0, 1}) on 3 ranks that fails on rank 1 once every member holds
// the new group's communicator (no memory for its part of the new group).
// The call was issued and done on every rank, so the group it was made from
// stays usable (its all-reduce gives 3 everywhere); the new group is
// aborted instead, so that rank 0's first collective in it fails at once,
// naming rank 1 and saying when. Before, the parent was aborted with "failed
// on rank 1 before it was issued", and rank 0 waited in the new group.
DDP_TEST_WORKER(pg_new_group_fails_after_split) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  if (me == 1) internal::FailNextNewGroupAfterSplitForTesting();
  std::shared_ptr<ProcessGroup> pair;
  std::string made = "succeeded";
  try {
    pair = pg->NewGroup({0, 1});
  } catch (const std::bad_alloc&) {
    made = "std::bad_alloc";
  } catch (const std::exception& e) {
    made = std::string("another exception: ") + e.what();
  }
  WORKER_EXPECT(made == (me == 1 ? "std::bad_alloc" : "succeeded"), "NewGroup: " + made + on);
  WORKER_EXPECT((pair != nullptr) == (me == 0), "NewGroup's result" + on);
  if (pair != nullptr) {
    const auto start = std::chrono::steady_clock::now();
    std::string outcome = "succeeded";
    try {
      Tensor u = nn::Ones({2});
      pair->AllReduce(u).Wait();
    } catch (const DistributedError& e) {
      outcome = e.what();
    }
    WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10),
                  "the new group's all-reduce waited for its timeout" + on);
    WORKER_EXPECT(outcome.find("ProcessGroup::NewGroup failed on rank 1 after every member had formed the new "
                               "group's communicator") != std::string::npos,
                  "the new group's all-reduce: " + outcome + on);
  }
  Tensor t = nn::Ones({4});
  std::string parent = "succeeded";
  try {
    pg->AllReduce(t).Wait();
  } catch (const DistributedError& e) {
    parent = e.what();
  }
  WORKER_EXPECT(parent == "succeeded" && t.ToVector<double>() == std::vector<double>(4, 3.0),
                "the group NewGroup was called on: " + parent + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, NewGroupThatFailsOnOneRankAfterItFormedAbortsOnlyTheNewGroup) {
  auto run = RunWorkers("pg_new_group_fails_after_split", 3, {}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A subgroup takes its parent's debug settings: DDP_DEBUG changed on some
// ranks after the parent was made (to detail on one, to a bad value on
// another) is not read again. Before, NewGroup built the child through the
// public constructor, which read the variable again and failed the new
// group on every rank when the ranks' values no longer agreed.
DDP_TEST_WORKER(pg_new_group_keeps_the_parents_debug_level) {
  auto pg = testing::WorkerGroup();
  const int me = pg->rank();
  if (me == 1) setenv("DDP_DEBUG", "detail", 1);
  if (me == 2) setenv("DDP_DEBUG", "loud", 1);
  try {
    auto all = pg->NewGroup({0, 1, 2});
    auto pair = pg->NewGroup({2, 0});
    WORKER_EXPECT(all != nullptr && all->debug_level() == pg->debug_level(), "the subgroup's debug level");
    Tensor t = nn::Ones({3});
    all->AllReduce(t).Wait();
    WORKER_EXPECT(t.ToVector<double>() == std::vector<double>(3, 3.0), "the subgroup's all-reduce");
    WORKER_EXPECT((pair != nullptr) == (me != 1), "membership of {2, 0}");
    if (pair != nullptr) {
      Tensor u = nn::Ones({2});
      pair->AllReduce(u).Wait();
      WORKER_EXPECT(u.ToVector<double>() == std::vector<double>(2, 2.0), "the pair's all-reduce");
    }
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, "rank " + std::to_string(me) + ": " + e.what());
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, NewGroupDoesNotReadTheEnvironmentAgain) {
  auto run = RunWorkers("pg_new_group_keeps_the_parents_debug_level", 3, {}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A monitored barrier with the longest timeout there is (its doubled wait
// overflowed) completes when every rank arrives.
DDP_TEST_WORKER(pg_monitored_barrier_longest) {
  auto pg = testing::WorkerGroup();
  try {
    pg->MonitoredBarrier(std::chrono::milliseconds::max());
    Tensor t = nn::Ones({2});
    pg->AllReduce(t).Wait();
    WORKER_EXPECT(t.ToVector<double>() == std::vector<double>(2, 2.0), "all-reduce after");
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("rank ") + std::to_string(pg->rank()) + ": " + e.what());
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, MonitoredBarrierWithTheLongestTimeout) {
  auto run = RunWorkers("pg_monitored_barrier_longest", 2, {}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A task that issues work on its own group would wait for itself (nothing
// else runs until it returns): refused at once, naming the call, instead of
// stalling until the wait budget and then aborting the group. The bound is
// half the budget: a loaded machine delays "at once" by far less, and a
// stall lasts the whole budget.
TEST(ProcessGroupTest, WorkIssuedFromInsideATaskOfTheSameGroupIsRefusedAtOnce) {
  auto pg = ProcessGroup::Single({.timeout = std::chrono::milliseconds(10000)});
  std::weak_ptr<ProcessGroup> weak = pg;
  CollectiveDescription d{"nests", nn::DType::kFloat32, {0}, -1, ReduceOp::kSum, false};
  const auto start = std::chrono::steady_clock::now();
  Work w = pg->Run(d, [weak](transport::Communicator*, transport::Deadline) {
    Tensor t = nn::Ones({2});
    if (auto group = weak.lock()) group->AllReduce(t).Wait();
    return transport::Status::Ok();
  });
  std::string error;
  try {
    w.Wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(error.find("all_reduce(sum, f32 [2]) was issued on rank 0 from inside a task of the same process group"),
            std::string::npos)
      << error;
  EXPECT_LT(seconds, 5.0) << "the nested call waited for the group's wait budget";
}

// BroadcastObject refused before it is issued (here: called from inside a
// task of the same group) leaves the caller's object as it was, as the
// header says; before, the object had been moved into the call's buffer
// already and was left empty.
TEST(ProcessGroupTest, ABroadcastObjectRefusedBeforeItIsIssuedLeavesTheObject) {
  auto pg = ProcessGroup::Single({.timeout = std::chrono::milliseconds(10000)});
  ProcessGroup* group = pg.get();  // outlives the task, which the test waits for
  auto object = std::make_shared<std::string>("the caller's object, long enough to live on the heap");
  auto error = std::make_shared<std::string>();
  pg->Run({"broadcasts_an_object", nn::DType::kUInt8, {0}},
          [group, object, error](transport::Communicator*, transport::Deadline) {
            try {
              group->BroadcastObject(object.get(), 0);
            } catch (const std::logic_error& e) {
              *error = e.what();
            }
            return transport::Status::Ok();
          })
      .Wait();
  EXPECT_NE(error->find("broadcast_object(root 0, u8"), std::string::npos) << *error;
  EXPECT_EQ(*object, "the caller's object, long enough to live on the heap");
}

// On two ranks, an object collective called from inside a task of the same
// group is refused on that rank (std::logic_error) and leaves the group as
// it is, as AllReduce in the same place does: the header says such a rank
// does not take part. The object collectives aborted the group ("...
// failed on rank R before it was issued"), which a one-rank group, where
// nobody waits, never showed.
DDP_TEST_WORKER(pg_object_collective_inside_a_task) {
  auto pg = testing::WorkerGroup();
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  ProcessGroup* group = pg.get();  // outlives the task, which is waited for
  for (const std::string call : {"all_reduce", "broadcast_object", "all_gather_object", "gather_object",
                                 "scatter_object"}) {
    auto refused = std::make_shared<std::string>("not refused");
    pg->Run({"calls_" + call, DType::kFloat32, {0}},
            [group, call, refused](transport::Communicator*, transport::Deadline) {
              try {
                if (call == "all_reduce") {
                  Tensor t = nn::Ones({2});
                  group->AllReduce(t).Wait();
                } else if (call == "broadcast_object") {
                  std::string object = "an object";
                  group->BroadcastObject(&object, 0);
                } else if (call == "all_gather_object") {
                  (void)group->AllGatherObject("an object");
                } else if (call == "gather_object") {
                  (void)group->GatherObject("an object", 0);
                } else {
                  (void)group->ScatterObject(std::vector<std::string>(2, "an object"), 0);
                }
              } catch (const std::logic_error& e) {
                *refused = e.what();
              }
              return transport::Status::Ok();
            })
        .Wait();
    WORKER_EXPECT(refused->find(call + "(") != std::string::npos &&
                      refused->find("from inside a task of the same process group") != std::string::npos,
                  call + ": " + *refused + on);
    WORKER_EXPECT(pg->aborted_reason().ok(), call + ": the group was aborted: " + pg->aborted_reason().ToString() + on);
  }
  // The group still runs collectives.
  Tensor t = nn::Ones({2});
  pg->AllReduce(t).Wait();
  WORKER_EXPECT(t.ToVector<float>() == std::vector<float>(2, 2.0f), "the all-reduce after" + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, AnObjectCollectiveInsideATaskIsRefusedAndLeavesTheGroup) {
  auto run = RunWorkers("pg_object_collective_inside_a_task", 2, {}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(ProcessGroupTest, NewGroupOfAnEmptyListIsRefused) {
  auto pg = ProcessGroup::Single();
  std::string error;
  try {
    pg->NewGroup({});
  } catch (const std::invalid_argument& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("ProcessGroup::NewGroup: the rank list is empty"), std::string::npos) << error;
}

// A task that throws something other than a std::exception fails its Work
// (before, it escaped the communication thread: std::terminate).
TEST(ProcessGroupTest, ATaskThrowingANonStandardExceptionFailsItsWork) {
  auto pg = ProcessGroup::Single();
  CollectiveDescription d{"throws_an_int", nn::DType::kFloat32, {0}, -1, ReduceOp::kSum, false};
  Work w = pg->Run(d, [](transport::Communicator*, transport::Deadline) -> transport::Status { throw 42; });
  std::string error;
  try {
    w.Wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("throws_an_int(f32 [0]) threw an exception that is not a std::exception"), std::string::npos)
      << error;
}

// Replacing the default group releases the old one outside the lock: a task
// of the old group that reads the default while the old group drains
// deadlocked (the replacing thread held the lock while it waited for the task).
TEST(ProcessGroupTest, ReplacingTheDefaultGroupWhileItsTaskReadsTheDefaultFinishes) {
  const auto replace_twice = [] {
    alarm(20);  // a deadlock ends here, as a signal
    auto started = std::make_shared<std::promise<void>>();
    std::future<void> running = started->get_future();
    {
      auto old = ProcessGroup::Single();
      CollectiveDescription d{"reads_the_default", nn::DType::kFloat32, {0}, -1, ReduceOp::kSum, false};
      old->Run(d, [started](transport::Communicator*, transport::Deadline) {
        started->set_value();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        return DefaultProcessGroup() != nullptr ? transport::Status::Ok()
                                                : transport::InternalError("no default group");
      });
      SetDefaultProcessGroup(std::move(old));
    }
    running.wait();
    SetDefaultProcessGroup(ProcessGroup::Single());
    std::exit(0);
  };
  // Other tests left threads behind: the child runs from a fresh start.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(replace_twice(), ::testing::ExitedWithCode(0), "");
}

// A task that holds the last reference to its group: the group is
// destroyed on its own communication thread once the task is dropped.
TEST(ProcessGroupTest, TaskHoldingTheLastReferenceDestroysTheGroup) {
  auto destroyed = std::make_shared<std::promise<void>>();
  std::future<void> done = destroyed->get_future();
  auto released = std::make_shared<std::atomic<bool>>(false);
  struct Holder {
    std::shared_ptr<ProcessGroup> pg;
    std::shared_ptr<std::promise<void>> destroyed;
    ~Holder() {
      pg.reset();
      if (destroyed != nullptr) destroyed->set_value();
    }
  };
  auto pg = ProcessGroup::Single();
  auto holder = std::make_shared<Holder>();
  holder->pg = pg;
  holder->destroyed = std::move(destroyed);
  CollectiveDescription d{"holds_its_group", nn::DType::kFloat32, {0}, -1, ReduceOp::kSum, false};
  Work w = pg->Run(d, [holder, released](transport::Communicator*, transport::Deadline) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!released->load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return transport::Status::Ok();
  });
  holder.reset();
  pg.reset();
  released->store(true);
  w.Wait();
  ASSERT_EQ(done.wait_for(std::chrono::seconds(15)), std::future_status::ready)
      << "the group was not destroyed on its communication thread";
}

// The same with a collective queued behind the task: once the task is
// dropped (and the group with it) on the communication thread, the queued
// barrier fails with the destruction's reason instead of running on a
// group being destroyed; the task's own Work keeps its result.
TEST(ProcessGroupTest, TaskHoldingTheLastReferenceFailsWhatIsQueuedBehindIt) {
  auto released = std::make_shared<std::atomic<bool>>(false);
  struct Holder {
    std::shared_ptr<ProcessGroup> pg;
  };
  auto pg = ProcessGroup::Single();
  auto holder = std::make_shared<Holder>();
  holder->pg = pg;
  CollectiveDescription d{"holds_its_group", nn::DType::kFloat32, {0}, -1, ReduceOp::kSum, false};
  Work w = pg->Run(d, [holder, released](transport::Communicator*, transport::Deadline) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!released->load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return transport::Status::Ok();
  });
  Work queued = pg->Barrier();
  holder.reset();
  pg.reset();
  released->store(true);
  w.Wait();  // the task succeeded
  std::string error = "no error";
  try {
    queued.Wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("process group of rank 0 destroyed by a task of its own on its communication thread "
                       "with 1 collective(s) unfinished"),
            std::string::npos)
      << error;
}

// A task that drops the last reference to its group while it runs, then
// fails: the group is destroyed inside the task, and the task's failure
// must not touch it afterwards (Run aborted the freed group: a
// use-after-free that ASan reports). The task's Work fails with its own
// error; the collective queued behind it fails with the destruction's.
TEST(ProcessGroupTest, TaskDroppingTheLastReferenceAndFailingLeavesTheGroupAlone) {
  struct Holder {
    std::shared_ptr<ProcessGroup> pg;
  };
  auto holder = std::make_shared<Holder>();
  auto released = std::make_shared<std::atomic<bool>>(false);
  holder->pg = ProcessGroup::Single();
  CollectiveDescription d{"drops_its_group", nn::DType::kFloat32, {0}, -1, ReduceOp::kSum, false};
  Work failing = holder->pg->Run(d, [holder, released](transport::Communicator*, transport::Deadline) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!released->load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    holder->pg.reset();  // the last reference: the group is destroyed here
    return transport::InternalError("the task failed after dropping its group");
  });
  Work queued = holder->pg->Barrier();
  released->store(true);
  auto error_of = [](Work& w) {
    try {
      w.Wait();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string task_error = error_of(failing);
  EXPECT_NE(task_error.find("drops_its_group(f32 [0]) (collective #0 on rank 0): the task failed after "
                            "dropping its group"),
            std::string::npos)
      << task_error;
  const std::string queued_error = error_of(queued);
  EXPECT_NE(queued_error.find("process group of rank 0 destroyed by a task of its own on its communication "
                              "thread with 2 collective(s) unfinished"),
            std::string::npos)
      << queued_error;
}

// The same with a peer: rank 0's task drops its group and fails with a
// barrier queued behind it; rank 1's barrier fails at once with the
// destruction's reason (the communicator was aborted) instead of waiting
// out its deadline. DDP_COLLECTIVE_THREAD chooses the thread that runs the
// task (comm: the communication thread; caller: the thread calling Run).
DDP_TEST_WORKER(pg_task_drops_its_group) {
  const auto start = std::chrono::steady_clock::now();
  const bool on_caller = std::string(std::getenv("DDP_COLLECTIVE_THREAD")) == "caller";
  auto error_of = [](Work& w) {
    try {
      w.Wait();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string destroyed = std::string("process group of rank 0 destroyed by a task of its own on ") +
                                (on_caller ? "the caller's thread" : "its communication thread");
  std::shared_ptr<ProcessGroup> pg = testing::WorkerGroup();
  if (pg->rank() == 1) {
    Work barrier = pg->Barrier();
    const std::string error = error_of(barrier);
    WORKER_EXPECT(error.find(destroyed) != std::string::npos, "rank 1's barrier: " + error);
  } else {
    struct Holder {
      std::shared_ptr<ProcessGroup> pg;
    };
    auto holder = std::make_shared<Holder>();
    holder->pg = std::move(pg);
    auto released = std::make_shared<std::atomic<bool>>(on_caller);
    CollectiveDescription d{"drops_its_group", nn::DType::kFloat32, {0}, -1, ReduceOp::kSum, false};
    Work failing = holder->pg->Run(d, [holder, released](transport::Communicator*, transport::Deadline) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!released->load() && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      holder->pg.reset();
      return transport::InternalError("the task failed after dropping its group");
    });
    // On the caller's thread the task has run already: nothing to queue.
    Work queued = on_caller ? Work() : holder->pg->Barrier();
    released->store(true);
    const std::string task_error = error_of(failing);
    WORKER_EXPECT(task_error.find("the task failed after dropping its group") != std::string::npos,
                  "the task's Work: " + task_error);
    if (queued.valid()) {
      const std::string queued_error = error_of(queued);
      WORKER_EXPECT(queued_error.find(destroyed) != std::string::npos, "the queued barrier: " + queued_error);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(seconds < 8, "took " + std::to_string(seconds) + " s (the group's timeout is 20 s)");
  std::_Exit(testing::WorkerExit());
}

TEST(ProcessGroupTest, TaskDroppingTheLastReferenceAbortsThePeers) {
  for (const char* thread : {"comm", "caller"}) {
    auto run = RunWorkers("pg_task_drops_its_group", 2, {{"DDP_COLLECTIVE_THREAD", thread}}, 30000,
                          /*stop_all_on_failure=*/false);
    EXPECT_TRUE(run.AllSucceeded()) << thread << "\n" << testing::AllOutput(run);
  }
}

// ~ProcessGroup with collectives unfinished waits for them within their own
// deadlines (group timeout 5 s): rank 0 issues two barriers and destroys
// its group at once; rank 1 comes to the first 2.5 s after that and to the
// second 3.5 s later, 6 s after it, within the second's deadline (it
// started when the first ended). Both succeed on both ranks; rank 0 said on
// stderr what it waited for, 2 s into its wait, with both barriers still
// unfinished. (The destructor used to abort after min(timeout, 10 s): 5 s
// here, so rank 1's second barrier failed.) The 2.5 s are counted on rank
// 0's clock, from its destructor's start (a mark rank 1 waits for), not from
// each rank's group creation: ranks that came out of it 0.5 s apart on a
// busy host made the first barrier end before that print.
DDP_TEST_WORKER(pg_destroyed_with_collectives_unfinished) {
  std::shared_ptr<ProcessGroup> pg = testing::WorkerGroup();
  auto error_of = [](Work& w) {
    try {
      w.Wait();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  if (pg->rank() == 0) {
    Work first = pg->Barrier();
    Work second = pg->Barrier();
    // Lets rank 1 in 2.5 s from now: the destructor's print comes at 2 s.
    std::thread let_in([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      testing::MarkThisRankDone(0);
    });
    pg.reset();
    let_in.join();
    const std::string e1 = error_of(first), e2 = error_of(second);
    WORKER_EXPECT(e1.empty(), "rank 0's first barrier: " + e1);
    WORKER_EXPECT(e2.empty(), "rank 0's second barrier: " + e2);
  } else {
    testing::WaitUntilRanksAreDone(*pg, {0}, std::chrono::seconds(20));
    Work first = pg->Barrier();
    const std::string e1 = error_of(first);
    WORKER_EXPECT(e1.empty(), "rank 1's first barrier: " + e1);
    std::this_thread::sleep_for(std::chrono::milliseconds(3500));
    Work second = pg->Barrier();
    const std::string e2 = error_of(second);
    WORKER_EXPECT(e2.empty(), "rank 1's second barrier: " + e2);
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, DestroyingAGroupWaitsForItsCollectivesWithinTheirDeadlines) {
  auto run = RunWorkers("pg_destroyed_with_collectives_unfinished", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "5000"}, {"DDP_COLLECTIVE_THREAD", "comm"}}, 30000);
  const std::string output = testing::AllOutput(run);
  EXPECT_TRUE(run.AllSucceeded()) << output;
  EXPECT_NE(output.find("[ddp] process group of rank 0 destroyed with 2 collective(s) unfinished (1 queued, "
                        "1 running, 0 point-to-point in flight): waiting up to "),
            std::string::npos)
      << output;
}

// A peer that comes after the deadline: rank 0's barrier times out during
// the destructor's wait (group timeout 2 s), which aborts the group; rank
// 1, arriving once rank 0 has seen that (a mark, not a fixed 4 s sleep),
// fails at once with rank 0's reason instead of waiting out its own
// deadline.
DDP_TEST_WORKER(pg_destroyed_peer_too_late) {
  std::shared_ptr<ProcessGroup> pg = testing::WorkerGroup();
  if (pg->rank() == 0) {
    Work barrier = pg->Barrier();
    const auto start = std::chrono::steady_clock::now();
    pg.reset();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    WORKER_EXPECT(seconds < 3.5, "the destructor took " + std::to_string(seconds) + " s");
    try {
      barrier.Wait();
      WORKER_EXPECT(false, "rank 0's barrier succeeded alone");
    } catch (const DistributedError& e) {
      WORKER_EXPECT(e.code() == transport::StatusCode::kTimedOut, e.what());
    }
    // Rank 1 must hear the abort from this process before it exits.
    testing::MarkThisRankDone(0);
    testing::WaitUntilRanksAreDone(0, {1});
  } else {
    testing::WaitUntilRanksAreDone(*pg, {0});
    const auto start = std::chrono::steady_clock::now();
    try {
      pg->Barrier().Wait();
      WORKER_EXPECT(false, "rank 1's barrier succeeded without rank 0");
    } catch (const DistributedError& e) {
      std::fprintf(stderr, "rank 1: %s\n", e.what());
      WORKER_EXPECT(std::string(e.what()).find("rank 0 aborted the job") != std::string::npos, e.what());
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    testing::MarkThisRankDone(*pg);
    WORKER_EXPECT(seconds < 1, "rank 1's barrier failed after " + std::to_string(seconds) + " s");
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, DestroyingAGroupWhoseCollectiveTimesOutFailsThePeers) {
  auto run = RunWorkers("pg_destroyed_peer_too_late", 2,
                        {{"DDP_TEST_TIMEOUT_MS", "2000"}, {"DDP_COLLECTIVE_THREAD", "comm"}}, 30000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The communication thread is started before the first item is queued: when
// it cannot start (here: no address space left for its stack), the call
// throws having queued nothing, instead of leaving an item that ran once a
// later call started the thread (one collective more than the peers run).
TEST(ProcessGroupTest, ACommunicationThreadThatCannotStartLeavesNothingQueued) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers' runtimes map address space of their own";
#endif
  const auto child = [] {
    auto pg = ProcessGroup::Single();
    bool threw = false;
    {
      testing::AddressSpaceLimit limit(2 << 20);
      if (!limit.ok()) std::_Exit(4);
      try {
        pg->Barrier();
      } catch (const std::exception&) {
        threw = true;
      }
    }
    if (!threw) {
      std::fprintf(stderr, "the barrier did not throw\n");
      std::_Exit(2);
    }
    pg->Barrier().Wait();
    if (pg->collectives_run() != 1) {
      std::fprintf(stderr, "%llu collectives ran, 1 expected\n",
                   static_cast<unsigned long long>(pg->collectives_run()));
      std::_Exit(3);
    }
    std::_Exit(0);
  };
  // Other tests left threads behind: the child runs from a fresh start.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "");
}

// Buffers that overlap other than in a collective's in-place layout are
// this rank's argument error: std::invalid_argument at the call (the
// transport would abort the communicator for every rank), and the group
// stays usable. The in-place layouts still work.
DDP_TEST_WORKER(pg_overlapping_buffers) {
  auto pg = testing::WorkerGroup();
  const int n = pg->size(), me = pg->rank();
  auto refused = [&](const char* what, const std::string& want, auto call) {
    try {
      call();
      WORKER_EXPECT(false, std::string(what) + " was not refused on rank " + std::to_string(me));
    } catch (const std::invalid_argument& e) {
      WORKER_EXPECT(std::string(e.what()).find(want) != std::string::npos,
                    std::string(what) + ": the error does not say '" + want + "': " + e.what());
    } catch (const std::exception& e) {
      WORKER_EXPECT(false, std::string(what) + " failed otherwise: " + e.what());
    }
  };
  try {
    const Tensor x = nn::Ones({2 * n});
    refused("AllToAll(x, x)", "ProcessGroup::AllToAll: output (f32 [" + std::to_string(2 * n) +
                                  "]) and input", [&] { pg->AllToAll(x, x).Wait(); });
    const Tensor whole = nn::Zeros({2 * n + 1});
    refused("AllGather into a shifted block", "ProcessGroup::AllGather", [&] {
      pg->AllGather(whole.Narrow(0, 0, 2 * n), whole.Narrow(0, 2 * me + 1, 2)).Wait();
    });
    refused("ReduceScatter from a shifted block", "ProcessGroup::ReduceScatter", [&] {
      pg->ReduceScatter(whole.Narrow(0, 2 * me + 1, 2), whole.Narrow(0, 0, 2 * n)).Wait();
    });
    // Only the root of a rooted collective has both buffers; the other
    // ranks would wait for it in the collective, so a one-rank group here.
    auto single = ProcessGroup::Single();
    refused("Scatter on the root", "other than in place (output may only be input's block root)", [&] {
      single->Scatter(whole.Narrow(0, 1, 2), whole.Narrow(0, 0, 2), 0).Wait();
    });
    refused("Gather on the root", "ProcessGroup::Gather: the root's output", [&] {
      single->Gather(whole.Narrow(0, 0, 2), whole.Narrow(0, 1, 2), 0).Wait();
    });
    // The group is usable, and the in-place layouts are taken.
    Tensor t = nn::Ones({3});
    pg->AllReduce(t, ReduceOp::kSum, "after the refusals").Wait();
    WORKER_EXPECT(t.ToVector<double>() == std::vector<double>(3, n), "all-reduce after the refusals");
    const Tensor gathered = nn::Full({2 * n}, -1);
    gathered.Narrow(0, 2 * me, 2).Fill(me);
    pg->AllGather(gathered, gathered.Narrow(0, 2 * me, 2)).Wait();
    std::vector<double> want;
    for (int r = 0; r < n; ++r) want.insert(want.end(), 2, r);
    WORKER_EXPECT(gathered.ToVector<double>() == want, "in-place all-gather");
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("rank ") + std::to_string(me) + ": " + e.what());
  }
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, OverlappingBuffersAreArgumentErrors) {
  auto run = RunWorkers("pg_overlapping_buffers", 2, {}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A failed collective's error names it (kind, label, dtype and shape), its
// number and the rank; collectives after the abort say that they did not run.
DDP_TEST_WORKER(pg_errors_name_the_collective) {
  auto pg = testing::WorkerGroup();
  pg->Barrier().Wait();
  if (pg->rank() == 1) std::_Exit(0);  // gone before the all-reduce
  const Tensor t = nn::Ones({4});
  try {
    pg->AllReduce(t, ReduceOp::kSum, "bucket 3").Wait();
    WORKER_EXPECT(false, "the all-reduce without rank 1 succeeded");
  } catch (const DistributedError& e) {
    const std::string what = e.what();
    WORKER_EXPECT(what.find("all_reduce bucket 3(sum, f32 [4]) (collective #1 on rank 0): ") !=
                      std::string::npos,
                  "the error does not name the collective: " + what);
  }
  try {
    pg->Broadcast(t, 0, "after").Wait();
    WORKER_EXPECT(false, "the broadcast after the abort succeeded");
  } catch (const DistributedError& e) {
    const std::string what = e.what();
    WORKER_EXPECT(what.find("broadcast after(root 0, f32 [4]) (collective #2 on rank 0): not run: "
                            "the group was aborted: ") != std::string::npos,
                  "the error does not say the broadcast did not run: " + what);
  }
  std::_Exit(testing::WorkerExit());
}

// A message issued after the group was aborted says that it did not run,
// with the reason, as a collective does, also when it is posted in the call
// (DDP_COLLECTIVE_THREAD=caller ran the barrier before it on this thread,
// so nothing is queued ahead); before, that path gave the bare reason.
DDP_TEST_WORKER(pg_message_after_abort) {
  auto pg = testing::WorkerGroup();
  const int me = pg->rank();
  const std::string on = " on rank " + std::to_string(me);
  Tensor t = nn::Ones({4});
  pg->Barrier().Wait();
  if (me == 0) pg->Abort(transport::AbortedError("stopped by the test"));
  std::string what = "succeeded";
  try {
    (me == 0 ? pg->Send(t, 1) : pg->Recv(t, 0)).Wait();
  } catch (const DistributedError& e) {
    what = e.what();
  }
  // Rank 1 may post its receive before the abort reaches it.
  const std::string want = me == 0 ? "send to rank 1 tag 0(f32 [4]) on rank 0: not run: the group was aborted: "
                                     "stopped by the test"
                                   : "stopped by the test";
  WORKER_EXPECT(what.find(want) != std::string::npos, "the message: " + what + on);
  return testing::WorkerExit();
}

TEST(ProcessGroupTest, AMessageAfterTheAbortSaysItDidNotRun) {
  auto run = RunWorkers("pg_message_after_abort", 2, {{"DDP_COLLECTIVE_THREAD", "caller"}}, 30000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(ProcessGroupTest, ErrorsNameTheCollective) {
  auto run = RunWorkers("pg_errors_name_the_collective", 2, {{"DDP_TEST_TIMEOUT_MS", "5000"}}, 30000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

}  // namespace
}  // namespace ddp::dist
