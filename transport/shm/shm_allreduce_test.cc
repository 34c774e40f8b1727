#include "transport/shm/shm_allreduce.h"

#include "transport/shm/segment.h"
#include "transport/shm/shareable.h"

#include <fcntl.h>
#include <linux/sched.h>
#include <pthread.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "transport/testing/descriptors_exhausted.h"
#include "transport/testing/expected_values.h"
#include "transport/testing/in_memory_store.h"

namespace ddp::transport::shm {
namespace {

using std::chrono::milliseconds;
using testing::CountWrong;
using testing::FillInput;

// Ranks are threads of this process: CMA works within one process too, so
// the protocol runs exactly as between processes (the communicator tests
// run it between real processes).
std::vector<std::unique_ptr<ShmAllReduce>> MakeGroup(int n, size_t staging_bytes,
                                                     size_t chunk_bytes) {
  testing::InMemoryStore store;
  std::vector<std::unique_ptr<ShmAllReduce>> group(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      ShmOptions options{.rank = r, .size = n, .pids = std::vector<int>(n, getpid()),
                         .staging_bytes = staging_bytes, .rooted_staging_bytes = staging_bytes,
                         .chunk_bytes = chunk_bytes,
                         .yield_when_idle = true};
      auto engine = ShmAllReduce::Create(store, "shm/", options, DeadlineIn(milliseconds(10000)));
      ASSERT_TRUE(engine.ok()) << engine.status();
      group[r] = std::move(*engine);
    });
  }
  for (auto& t : threads) t.join();
  return group;
}

// Waits until `flag` is set, or 10 s (a late rank that must arrive only
// after its peer's call returned; the bound keeps a hang from a peer that
// never returns out of the test).
void AwaitFlag(const std::atomic<bool>& flag) {
  const Deadline until = DeadlineIn(milliseconds(10000));
  while (!flag.load() && Clock::now() < until) std::this_thread::sleep_for(milliseconds(1));
}

void RunRanks(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
}

// Whether a peer has exited, also when no pidfd can be had (here: every
// descriptor in use, EMFILE): a killed, not yet reaped process is seen as
// exited (it was taken for alive, so a peer killed mid-copy was reported
// as a bad buffer), and a live one is not.
TEST(ProcessExitsWithin, SeesAnExitWithoutAPidfd) {
  const pid_t dead = fork();
  ASSERT_GE(dead, 0);
  if (dead == 0) {
    pause();
    _exit(0);
  }
  const pid_t alive = fork();
  ASSERT_GE(alive, 0);
  if (alive == 0) {
    pause();
    _exit(0);
  }
  ASSERT_EQ(kill(dead, SIGKILL), 0);
  // A zombie now (not reaped): give the kernel a moment to finish its exit.
  EXPECT_TRUE(internal::ProcessExitsWithin(dead, std::chrono::milliseconds(2000)));
  int exhausted = 0;
  bool dead_seen = false, alive_seen = false;
  std::chrono::steady_clock::duration took{};
  {
    testing::DescriptorsExhausted none_left;
    exhausted = none_left.error();
    dead_seen = internal::ProcessExitsWithin(dead, std::chrono::milliseconds(200));
    const auto start = std::chrono::steady_clock::now();
    alive_seen = internal::ProcessExitsWithin(alive, std::chrono::milliseconds(50));
    took = std::chrono::steady_clock::now() - start;
  }
  kill(alive, SIGKILL);
  waitpid(alive, nullptr, 0);
  waitpid(dead, nullptr, 0);
  ASSERT_EQ(exhausted, EMFILE);
  EXPECT_TRUE(dead_seen) << "a killed peer was taken for alive without a pidfd";
  EXPECT_FALSE(alive_seen);
  EXPECT_GE(took, std::chrono::milliseconds(40)) << "the wait for a live peer did not last";
}

std::atomic<int> signals_caught{0};
void CountSignal(int) { signals_caught.fetch_add(1); }

// Whether thread `tid` of this process sleeps (state S in its stat).
bool ThreadSleeps(pid_t tid) {
  std::ifstream stat("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() && text[close + 2] == 'S';
}

// Waits until `done` holds, or 10 s; whether it held.
bool AwaitCondition(const std::function<bool()>& done) {
  const Deadline until = DeadlineIn(milliseconds(10000));
  while (!done()) {
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

// A signal caught during the wait (a handler installed without SA_RESTART,
// as Python installs them; SIGCHLD from a data worker, a profiler's
// SIGPROF) ends poll with EINTR: the wait goes on for the time left, and
// sees the exit that comes after the signal (the EINTR was taken for "still
// alive", so a peer killed mid-copy was reported as a bad buffer).
TEST(ProcessExitsWithin, WaitsOnThroughACaughtSignal) {
  struct sigaction action {};
  action.sa_handler = CountSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;  // no SA_RESTART
  struct sigaction previous {};
  ASSERT_EQ(sigaction(SIGUSR1, &action, &previous), 0);
  int release[2];
  ASSERT_EQ(pipe2(release, O_CLOEXEC), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(release[1]);
    char byte = 0;
    (void)!read(release[0], &byte, 1);  // until the test lets it exit
    _exit(0);
  }
  close(release[0]);
  std::atomic<pid_t> waiter_tid{0};
  std::atomic<bool> returned{false};
  bool exited = false;
  std::thread waiter([&] {
    waiter_tid.store(static_cast<pid_t>(syscall(SYS_gettid)));
    exited = internal::ProcessExitsWithin(child, milliseconds(10000));
    returned.store(true);
  });
  const bool waiting = AwaitCondition([&] { return waiter_tid.load() != 0 && ThreadSleeps(waiter_tid.load()); });
  pthread_kill(waiter.native_handle(), SIGUSR1);
  const bool caught = AwaitCondition([&] { return signals_caught.load() > 0; });
  // Back in its wait, or given up on it (the old behaviour).
  const bool settled = AwaitCondition([&] { return returned.load() || ThreadSleeps(waiter_tid.load()); });
  const bool returned_before_exit = returned.load();
  close(release[1]);  // the child exits
  waiter.join();
  waitpid(child, nullptr, 0);
  sigaction(SIGUSR1, &previous, nullptr);
  ASSERT_TRUE(waiting && caught && settled) << waiting << caught << settled;
  EXPECT_FALSE(returned_before_exit) << "the wait ended at the signal";
  EXPECT_TRUE(exited) << "a signal during the wait was taken for the process being alive";
}

TEST(ShmAllReduce, SweepOfSizesDtypesOpsAndPlacement) {
  for (int n : {1, 2, 3, 4}) {
    // A 4 KiB staging limit and 1 KiB chunks so that modest sizes take both
    // paths and the direct path runs several chunks per slice.
    auto group = MakeGroup(n, 4096, 1024);
    for (DataType dtype : {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16,
                           DataType::kI32, DataType::kI64, DataType::kU8}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin,
                          ReduceOp::kProd}) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{3}, size_t{1001}, size_t{20000}}) {
          for (bool in_place : {true, false}) {
            RunRanks(n, [&](int r) {
              const size_t bytes = count * DataTypeSize(dtype);
              std::vector<char> send(bytes + 1), recv(bytes + 1, 0x5A);
              FillInput(dtype, send.data(), count, r, op);
              void* out = in_place ? send.data() : recv.data();
              Status s = group[r]->AllReduce(send.data(), out, count, dtype, op,
                                             DeadlineIn(milliseconds(10000)), nullptr);
              ASSERT_TRUE(s.ok()) << s;
              std::string first;
              EXPECT_EQ(CountWrong(dtype, out, count, n, op, 0, &first), 0u)
                  << n << " ranks " << DataTypeName(dtype) << " " << ReduceOpName(op) << " count "
                  << count << (in_place ? " in place: " : ": ") << first;
              // Nothing written past the end.
              EXPECT_EQ(static_cast<char*>(out)[bytes], in_place ? 0 : 0x5A);
            });
          }
        }
      }
    }
  }
}

// kAvg's last fold and division run in blocks inside each chunk: chunks of
// 64 KiB hold several blocks and an odd tail, in every rank position.
TEST(ShmAllReduce, AverageOverChunksOfSeveralBlocks) {
  for (int n : {2, 3}) {
    auto group = MakeGroup(n, 4096, 64 << 10);
    for (DataType dtype : {DataType::kF32, DataType::kF64, DataType::kBF16, DataType::kI32}) {
      const size_t count = 100003;
      RunRanks(n, [&](int r) {
        std::vector<char> buffer(count * DataTypeSize(dtype));
        FillInput(dtype, buffer.data(), count, r, ReduceOp::kAvg);
        Status s = group[r]->AllReduce(buffer.data(), buffer.data(), count, dtype, ReduceOp::kAvg,
                                       DeadlineIn(milliseconds(10000)), nullptr);
        ASSERT_TRUE(s.ok()) << s;
        std::string first;
        EXPECT_EQ(CountWrong(dtype, buffer.data(), count, n, ReduceOp::kAvg, 0, &first), 0u)
            << n << " ranks " << DataTypeName(dtype) << ": " << first;
      });
    }
  }
}

// Each rank's slice passes through the function once, between the
// reduction and the sharing: here it doubles the slice, so every rank ends
// with twice the sum, and the slices it saw tile the vector.
TEST(ShmAllReduce, ThroughPassesEachSliceOnceBeforeSharingIt) {
  for (int n : {1, 2, 3, 4}) {
    auto group = MakeGroup(n, 4096, 1024);
    for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{1001}, size_t{20000}}) {
      std::vector<std::vector<std::pair<size_t, size_t>>> seen(n);
      for (bool in_place : {true, false}) {
        RunRanks(n, [&](int r) {
          std::vector<double> send(count + 1), recv(count + 1, -7.0);
          FillInput(DataType::kF64, send.data(), count, r, ReduceOp::kSum);
          double* out = in_place ? send.data() : recv.data();
          seen[r].clear();
          Status s = group[r]->AllReduceThrough(
              send.data(), out, count, DataType::kF64, ReduceOp::kSum,
              [&](void* slice, size_t offset, size_t len) {
                EXPECT_EQ(slice, out + offset);
                for (size_t i = 0; i < len; ++i) static_cast<double*>(slice)[i] *= 2;
                seen[r].emplace_back(offset, len);
                return Status::Ok();
              },
              DeadlineIn(milliseconds(10000)), nullptr);
          ASSERT_TRUE(s.ok()) << s;
          size_t wrong = 0;
          for (size_t i = 0; i < count; ++i) {
            double sum = 0;
            for (int q = 0; q < n; ++q) sum += testing::InputValue(q, i, ReduceOp::kSum);
            wrong += out[i] != 2 * sum;
          }
          EXPECT_EQ(wrong, 0u) << n << " ranks, count " << count;
          EXPECT_EQ(out[count], in_place ? 0.0 : -7.0) << "wrote past the end";
        });
        size_t next = 0;
        for (int r = 0; r < n; ++r) {
          ASSERT_EQ(seen[r].size(), 1u) << "rank " << r;
          if (seen[r][0].second == 0) continue;
          EXPECT_EQ(seen[r][0].first, next) << "rank " << r;
          next = seen[r][0].first + seen[r][0].second;
        }
        EXPECT_EQ(next, count);
      }
    }
  }
}

// A failing slice function fails that rank's call with its status, and
// the others' with one naming that rank, at once (no deadline); the failing
// rank returns only after the others have written its output, so nothing
// is written into its buffer after it returned (here the buffer is freed
// right after the call).
TEST(ShmAllReduce, ThroughFailsEveryRankWhenOneSliceFunctionFails) {
  for (int n : {2, 3}) {
    auto group = MakeGroup(n, 4096, 1024);
    for (int round = 0; round < 20; ++round) {
      RunRanks(n, [&](int r) {
        auto data = std::make_unique<std::vector<float>>(20000, 1.0f);
        const auto start = Clock::now();
        Status s = group[r]->AllReduceThrough(
            data->data(), data->data(), data->size(), DataType::kF32, ReduceOp::kSum,
            [&](void*, size_t, size_t) {
              return r == 1 ? UnavailableError("host 1 unreachable") : Status::Ok();
            },
            DeadlineIn(milliseconds(10000)), nullptr);
        data.reset();
        EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
        EXPECT_NE(s.message().find("host 1 unreachable"), std::string::npos) << s;
        if (r != 1) {
          EXPECT_NE(s.message().find("rank 1 failed in this shared-memory call"), std::string::npos) << s;
        }
        EXPECT_LT(Clock::now() - start, milliseconds(5000));
      });
    }
  }
}

// A failure message longer than a rank's mailbox holds reaches the peers
// cut, ending in "..." (it read as complete).
TEST(ShmAllReduce, ACutFailureMessageSaysSo) {
  auto group = MakeGroup(2, 4096, 1024);
  const std::string long_reason = "host 1 unreachable: " + std::string(400, 'x');
  RunRanks(2, [&](int r) {
    std::vector<float> data(20000, 1.0f);
    Status s = group[r]->AllReduceThrough(
        data.data(), data.data(), data.size(), DataType::kF32, ReduceOp::kSum,
        [&](void*, size_t, size_t) { return r == 1 ? UnavailableError(long_reason) : Status::Ok(); },
        DeadlineIn(milliseconds(10000)), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    if (r == 0) {
      EXPECT_NE(s.message().find("host 1 unreachable: xxx"), std::string::npos) << s;
      EXPECT_EQ(s.message().substr(s.message().size() - 4), "x...") << s;
    }
  });
}

// Avg reduces as sum and the slice function divides; ranks passing avg and
// sum fail the argument check.
TEST(ShmAllReduce, ThroughAverageLeavesTheDivisionToTheSliceFunction) {
  auto group = MakeGroup(2, 4096, 1024);
  RunRanks(2, [&](int r) {
    std::vector<float> data(5000, static_cast<float>(r + 1));
    Status s = group[r]->AllReduceThrough(
        data.data(), data.data(), data.size(), DataType::kF32, ReduceOp::kAvg,
        [](void* slice, size_t, size_t n) {
          for (size_t i = 0; i < n; ++i) static_cast<float*>(slice)[i] /= 4;
          return Status::Ok();
        },
        DeadlineIn(milliseconds(10000)), nullptr);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(data[0], 0.75f);
    EXPECT_EQ(data[4999], 0.75f);
  });
  RunRanks(2, [&](int r) {
    std::vector<float> data(5000, 1.0f);
    Status s = group[r]->AllReduceThrough(
        data.data(), data.data(), data.size(), DataType::kF32, r == 0 ? ReduceOp::kAvg : ReduceOp::kSum,
        [](void*, size_t, size_t) { return Status::Ok(); }, DeadlineIn(milliseconds(5000)), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("avg (hierarchical)"), std::string::npos) << s;
  });
}

// One rank in AllReduceThrough and one in AllReduce: both fail naming it.
TEST(ShmAllReduce, ThroughAgainstPlainIsAMismatch) {
  auto group = MakeGroup(2, 4096, 1024);
  RunRanks(2, [&](int r) {
    std::vector<float> data(3000, 1.0f);
    const Deadline deadline = DeadlineIn(milliseconds(5000));
    Status s =
        r == 0 ? group[r]->AllReduceThrough(data.data(), data.data(), data.size(), DataType::kF32,
                                            ReduceOp::kSum,
                                            [](void*, size_t, size_t) { return Status::Ok(); },
                                            deadline, nullptr)
               : group[r]->AllReduce(data.data(), data.data(), data.size(), DataType::kF32,
                                     ReduceOp::kSum, deadline, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("(hierarchical)"), std::string::npos) << s;
  });
}

// Rank 0's fold fails (rank 1's half of rank 0's slice is unreadable), so
// it never calls the slice function. Rank 1's slice function stands for
// the step between hosts that cannot end until rank 0's failure is known
// there (a party waits for rank 0's counterpart, or for one of its host's
// ranks that waits in turn): rank 0 must say so through `failed` before it
// waits for rank 1, or both wait until the deadline.
TEST(ShmAllReduce, ThroughTellsOfAFailedFoldBeforeWaitingForThePeers) {
  auto group = MakeGroup(2, 4096, 1024);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t count = 2 * page / sizeof(float);  // rank 0's slice: page 0
  void* mapped = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  std::fill_n(static_cast<float*>(mapped), count, 1.0f);
  std::vector<float> input(count, 1.0f);
  std::vector<float> out[2] = {std::vector<float>(count), std::vector<float>(count)};
  std::atomic<bool> told{false};
  std::atomic<int> tellings[2] = {0, 0};
  Status told_error;
  Status status[2];
  milliseconds took[2];
  for (bool fail : {false, true}) {
    if (fail) {
      ASSERT_EQ(mprotect(mapped, page, PROT_NONE), 0);
    }
    RunRanks(2, [&](int r) {
      const auto start = Clock::now();
      status[r] = group[r]->AllReduceThrough(
          r == 0 ? input.data() : mapped, out[r].data(), count, DataType::kF32, ReduceOp::kSum,
          [&](void*, size_t, size_t) -> Status {
            if (r == 0 || !fail) return Status::Ok();
            AwaitFlag(told);
            return told ? AbortedError("the other host heard of rank 0's failure")
                        : TimedOutError("the other host waited for rank 0");
          },
          DeadlineIn(milliseconds(20000)), nullptr, std::nullopt,
          [&](const Status& error) {
            if (r == 0) told_error = error;
            ++tellings[r];
            told = true;
          });
      took[r] = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
    });
    if (!fail) {
      EXPECT_TRUE(status[0].ok() && status[1].ok()) << status[0] << "; " << status[1];
      EXPECT_EQ(out[0][0], 2.0f);
      EXPECT_EQ(tellings[0] + tellings[1], 0) << "told of a failure on success";
    }
  }
  munmap(mapped, 2 * page);
  EXPECT_EQ(status[0].code(), StatusCode::kInvalidArgument) << status[0];
  EXPECT_NE(status[0].message().find("rank 1's buffer is not readable"), std::string::npos)
      << status[0];
  EXPECT_EQ(told_error, status[0]);
  EXPECT_EQ(tellings[0], 1);
  // Rank 1 fails with its slice function's error, and tells of it too.
  EXPECT_EQ(status[1].code(), StatusCode::kAborted) << status[1];
  EXPECT_EQ(tellings[1], 1);
  for (int r : {0, 1}) EXPECT_LT(took[r], milliseconds(5000)) << "rank " << r;
}

// Every root, sizes on both sides of the staging limit (4 KiB here), and
// interleaved with all-reduces, which share the staging buffers.
TEST(ShmAllReduce, BroadcastFromEveryRoot) {
  for (int n : {1, 2, 3, 4}) {
    auto group = MakeGroup(n, 4096, 1024);
    for (size_t count : {size_t{0}, size_t{1}, size_t{1000}, size_t{1025}, size_t{50000}}) {
      for (int root = 0; root < n; ++root) {
        RunRanks(n, [&](int r) {
          std::vector<float> data(count + 1, -1.0f);
          for (size_t i = 0; i < count; ++i) data[i] = r == root ? static_cast<float>(i % 97 + root) : -2.0f;
          Status s = group[r]->Broadcast(data.data(), count, DataType::kF32, root,
                                         DeadlineIn(milliseconds(10000)), nullptr);
          ASSERT_TRUE(s.ok()) << s;
          size_t wrong = 0;
          for (size_t i = 0; i < count; ++i) wrong += data[i] != static_cast<float>(i % 97 + root);
          EXPECT_EQ(wrong, 0u) << n << " ranks, root " << root << ", count " << count;
          EXPECT_EQ(data[count], -1.0f) << "wrote past the end";
          std::vector<int32_t> v(count);
          FillInput(DataType::kI32, v.data(), v.size(), r, ReduceOp::kSum);
          ASSERT_TRUE(group[r]->AllReduce(v.data(), v.data(), v.size(), DataType::kI32, ReduceOp::kSum,
                                          DeadlineIn(milliseconds(10000)), nullptr).ok());
          EXPECT_EQ(CountWrong(DataType::kI32, v.data(), v.size(), n, ReduceOp::kSum), 0u);
        });
      }
    }
  }
}

// A rank whose own buffer is too short for the count (here its second page
// is read-only) is told so, instead of being told that the root's buffer
// is bad after a wait for the root's exit.
TEST(ShmAllReduce, ABadBufferOfThisRankIsNamedAsItsOwn) {
  auto group = MakeGroup(2, 4096, 1024);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t count = 2 * page / sizeof(float);  // past the staging: copied directly
  void* mapped = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  ASSERT_EQ(mprotect(static_cast<char*>(mapped) + page, page, PROT_READ), 0);
  std::vector<float> root_data(count, 1.0f);
  Status status[2];
  RunRanks(2, [&](int r) {
    status[r] = group[r]->Broadcast(r == 0 ? root_data.data() : mapped, count, DataType::kF32, 0,
                                    DeadlineIn(milliseconds(5000)), nullptr);
  });
  munmap(mapped, 2 * page);
  EXPECT_EQ(status[1].code(), StatusCode::kInvalidArgument) << status[1];
  EXPECT_NE(status[1].message().find("rank 1's own buffer is not writable for the call's " +
                                     std::to_string(count * sizeof(float)) + " bytes"),
            std::string::npos)
      << status[1];
  EXPECT_EQ(status[1].message().find("rank 0"), std::string::npos) << status[1];
}

// A copy that fails with EFAULT waits for the peer's exit (a peer being
// killed looks like a bad buffer for a moment) at most until the call's
// deadline, and a wait cut short so is the deadline's failure (TIMED_OUT,
// saying the root may be exiting), not the caller's bad argument: from
// that, a peer killed near the deadline cannot be told from a bad buffer.
// Rank 1 starts its call, with 150 ms left, only once the root has
// published its buffer and waits for it (its watchdog runs after 1 ms of
// waiting), so that the 150 ms cover the read and the wait after it, not
// the threads' start or the arrival.
TEST(ShmAllReduce, APeersBadBufferIsReportedByTheDeadline) {
  auto group = MakeGroup(2, 4096, 1024);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t count = 2 * page / sizeof(float);  // past the staging: read with CMA
  void* mapped = mmap(nullptr, 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  std::vector<float> data(count, 0.0f);
  Status status[2];
  milliseconds took{};
  std::promise<void> root_waits;
  std::future<void> root_waiting = root_waits.get_future();
  std::atomic<bool> told{false};
  RunRanks(2, [&](int r) {
    if (r == 0) {
      status[0] = group[0]->Broadcast(mapped, count, DataType::kF32, 0,
                                      DeadlineIn(milliseconds(10000)), [&](Deadline, int) {
                                        if (!told.exchange(true)) root_waits.set_value();
                                        return Status::Ok();
                                      });
      if (!told.exchange(true)) root_waits.set_value();  // no watchdog run: rank 1 goes on
      return;
    }
    ASSERT_EQ(root_waiting.wait_for(std::chrono::seconds(10)), std::future_status::ready);
    const auto start = Clock::now();
    status[1] = group[1]->Broadcast(data.data(), count, DataType::kF32, 0,
                                    DeadlineIn(milliseconds(150)), nullptr);
    took = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  });
  munmap(mapped, 2 * page);
  EXPECT_EQ(status[1].code(), StatusCode::kTimedOut) << status[1];
  EXPECT_NE(status[1].message().find("rank 0's buffer could not be read and the deadline left "),
            std::string::npos)
      << status[1];
  EXPECT_NE(status[1].message().find("its process may be exiting"), std::string::npos)
      << status[1];
  // A wait for the exit not cut by the deadline lasted 500 ms after the
  // read failed, so the call took longer than that; the 350 ms between
  // the deadline and that bound are room for a loaded machine.
  EXPECT_LT(took, milliseconds(500)) << status[1];
  EXPECT_FALSE(status[0].ok());
}

// A peer whose buffer is bad, with time enough left to wait the whole
// 500 ms for its exit, is alive: its buffer was freed or was never
// readable, and that is INVALID_ARGUMENT, as it was before waits were cut
// by the deadline.
TEST(ShmAllReduce, APeersBadBufferWithTimeLeftIsItsBadArgument) {
  auto group = MakeGroup(2, 4096, 1024);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t count = 2 * page / sizeof(float);  // past the staging: read with CMA
  void* mapped = mmap(nullptr, 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  std::vector<float> data(count, 0.0f);
  Status status[2];
  RunRanks(2, [&](int r) {
    status[r] = group[r]->Broadcast(r == 0 ? mapped : static_cast<void*>(data.data()), count,
                                    DataType::kF32, 0, DeadlineIn(milliseconds(10000)), nullptr);
  });
  munmap(mapped, 2 * page);
  EXPECT_EQ(status[1].code(), StatusCode::kInvalidArgument) << status[1];
  EXPECT_NE(status[1].message().find("rank 0's buffer is not readable (freed during the call?)"),
            std::string::npos)
      << status[1];
  EXPECT_FALSE(status[0].ok());
}

// A dtype that is none (a cast from a bad number) fails AllReduceApply on
// every rank with INVALID_ARGUMENT naming it, and asking for its piece
// size is no crash: that divided the chunk by the dtype's size, 0
// (SIGFPE).
TEST(ShmAllReduce, AnUnknownDtypeIsRefusedNamingIt) {
  auto group = MakeGroup(2, 4096, 1024);
  const DataType unknown = static_cast<DataType>(99);
  Status status[2];
  size_t piece[2] = {};
  RunRanks(2, [&](int r) {
    piece[r] = group[r]->apply_piece_elems(unknown);
    float x = 1;
    status[r] = group[r]->AllReduceApply(
        &x, &x, 1, unknown, ReduceOp::kSum,
        [](const void*, void*, size_t, size_t) { return Status::Ok(); },
        DeadlineIn(milliseconds(5000)), nullptr);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_GE(piece[r], 1u) << "rank " << r;
    EXPECT_EQ(status[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << status[r];
    EXPECT_NE(status[r].message().find("dtype 99 is not a DataType"), std::string::npos)
        << status[r];
  }
}

// A watchdog period too long to add to a clock reading (here the longest
// a duration in milliseconds holds: "never") still means what it says: the
// watchdog runs once, when the wait has lasted a millisecond, and the wait
// sleeps until its deadline. It overflowed into a time long past, so the
// watchdog ran at every look at the clock (a store round trip each) and
// the wait never slept.
TEST(ShmAllReduce, AWatchdogPeriodTooLongForTheClockMeansNever) {
  constexpr int kRanks = 2;
  testing::InMemoryStore store;
  std::vector<std::unique_ptr<ShmAllReduce>> group(kRanks);
  RunRanks(kRanks, [&](int r) {
    ShmOptions options{.rank = r, .size = kRanks, .pids = std::vector<int>(kRanks, getpid()),
                       .watchdog_period = milliseconds::max()};
    auto engine = ShmAllReduce::Create(store, "shm/", options, DeadlineIn(milliseconds(10000)));
    ASSERT_TRUE(engine.ok()) << engine.status();
    group[r] = std::move(*engine);
  });
  ASSERT_TRUE(group[0] != nullptr && group[1] != nullptr);
  int runs = 0;
  // Rank 1 never comes.
  Status s = group[0]->Barrier(DeadlineIn(milliseconds(200)), [&](Deadline, int) {
    ++runs;
    return Status::Ok();
  });
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_EQ(runs, 1);
}

// Counts on both sides of the 4 KiB staging limit (staged: 1 and 200
// elements per block; CMA: 1001).
TEST(ShmAllReduce, AllToAllEveryBlockToItsRank) {
  for (int n : {1, 2, 3, 4}) {
    auto group = MakeGroup(n, 4096, 1024);
    for (size_t count : {size_t{0}, size_t{1}, size_t{200}, size_t{1001}}) {
      RunRanks(n, [&](int r) {
        std::vector<int32_t> send(n * count), recv(n * count + 1, -1);
        for (int d = 0; d < n; ++d) {
          for (size_t i = 0; i < count; ++i) send[d * count + i] = r * 100000 + d * 1000 + static_cast<int32_t>(i);
        }
        Status s = group[r]->AllToAll(send.data(), recv.data(), count, DataType::kI32,
                                      DeadlineIn(milliseconds(10000)), nullptr);
        ASSERT_TRUE(s.ok()) << s;
        size_t wrong = 0;
        for (int q = 0; q < n; ++q) {
          for (size_t i = 0; i < count; ++i) wrong += recv[q * count + i] != q * 100000 + r * 1000 + static_cast<int32_t>(i);
        }
        EXPECT_EQ(wrong, 0u) << n << " ranks, count " << count;
        EXPECT_EQ(recv[n * count], -1) << "wrote past the end";
      });
    }
  }
  // Another count on one rank: every rank fails, naming both.
  auto group = MakeGroup(2, 4096, 1024);
  RunRanks(2, [&](int r) {
    std::vector<float> send(20, 1.0f), recv(20);
    Status s = group[r]->AllToAll(send.data(), recv.data(), r == 0 ? 10 : 5, DataType::kF32,
                                  DeadlineIn(milliseconds(5000)), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("all-to-all arguments differ"), std::string::npos) << s;
  });
}

// An all-to-all goes direct by its whole buffer (size blocks), not by one
// block: with blocks under the staging limit but a buffer over it, the
// ranks publish their shareable buffers, and peers copy through mappings.
TEST(ShmAllReduce, DirectAllToAllOfBlocksUnderTheStagingLimitUsesMappings) {
  auto group = MakeGroup(2, 4096, 1024);
  const size_t count = 1000;  // 4000-byte blocks, 8000 bytes in all
  std::vector<uint64_t> before = {group[0]->mapped_copies(), group[1]->mapped_copies()};
  RunRanks(2, [&](int r) {
    auto a = AllocateShareable(2 * count * sizeof(int32_t));
    auto b = AllocateShareable(2 * count * sizeof(int32_t));
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    auto* send = static_cast<int32_t*>(*a);
    auto* recv = static_cast<int32_t*>(*b);
    for (int d = 0; d < 2; ++d) {
      for (size_t i = 0; i < count; ++i) send[d * count + i] = r * 100000 + d * 1000 + static_cast<int32_t>(i);
    }
    Status s = group[r]->AllToAll(send, recv, count, DataType::kI32,
                                  DeadlineIn(milliseconds(10000)), nullptr);
    ASSERT_TRUE(s.ok()) << s;
    size_t wrong = 0;
    for (int q = 0; q < 2; ++q) {
      for (size_t i = 0; i < count; ++i) wrong += recv[q * count + i] != q * 100000 + r * 1000 + static_cast<int32_t>(i);
    }
    EXPECT_EQ(wrong, 0u);
    EXPECT_TRUE(FreeShareable(send).ok());
    EXPECT_TRUE(FreeShareable(recv).ok());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_GT(group[r]->mapped_copies(), before[r]) << "rank " << r << " copied with CMA";
  }
}

// Reduce, gather and scatter to and from every root, on both sides of the
// 4 KiB staging limit (the direct path with 1 KiB chunks, several per
// slice), in place on the root, with a null output (reduce, gather) or
// input (scatter) off the root; then every rank all-reduces, to show the
// sequence stayed in step.
TEST(ShmAllReduce, RootedCollectivesFromEveryRoot) {
  for (int n : {1, 2, 3, 4}) {
    auto group = MakeGroup(n, 4096, 1024);
    for (size_t count : {size_t{0}, size_t{1}, size_t{333}, size_t{1025}, size_t{20001}}) {
      for (int root = 0; root < n; ++root) {
        const bool in_place = (root + count) % 2 == 1;
        const std::string what = std::to_string(n) + " ranks, root " + std::to_string(root) +
                                 ", count " + std::to_string(count) + (in_place ? " in place" : "");
        RunRanks(n, [&](int r) {
          const bool is_root = r == root;
          const Deadline deadline = DeadlineIn(milliseconds(10000));
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
            for (DataType dtype : {DataType::kF32, DataType::kBF16, DataType::kI64}) {
              const size_t bytes = count * DataTypeSize(dtype);
              std::vector<char> send(bytes + 1, 0x11), recv(bytes + 1, 0x5A);
              FillInput(dtype, send.data(), count, r, op);
              const std::vector<char> input = send;
              void* out = is_root ? (in_place ? send.data() : recv.data()) : nullptr;
              Status s = group[r]->Reduce(send.data(), out, count, dtype, op, root, deadline, nullptr);
              ASSERT_TRUE(s.ok()) << what << ": " << s;
              if (is_root) {
                std::string first;
                EXPECT_EQ(CountWrong(dtype, out, count, n, op, 0, &first), 0u)
                    << "reduce " << what << " " << DataTypeName(dtype) << " "
                    << ReduceOpName(op) << ": " << first;
                EXPECT_EQ(static_cast<char*>(out)[bytes], in_place ? 0x11 : 0x5A) << what;
              } else {
                EXPECT_EQ(send, input) << "reduce " << what << ": changed a send buffer";
              }
            }
          }
          // Gather: rank q's block is FillInput of rank q.
          std::vector<int32_t> mine(count), all(n * count + 1, -1);
          FillInput(DataType::kI32, mine.data(), count, r, ReduceOp::kSum);
          const int32_t* gather_send = mine.data();
          if (is_root && in_place) {
            std::copy(mine.begin(), mine.end(), all.begin() + r * count);
            gather_send = all.data() + r * count;
          }
          Status s = group[r]->Gather(gather_send, is_root ? all.data() : nullptr, count,
                                      DataType::kI32, root, deadline, nullptr);
          ASSERT_TRUE(s.ok()) << "gather " << what << ": " << s;
          if (is_root) {
            size_t wrong = 0;
            for (int q = 0; q < n; ++q) {
              std::vector<int32_t> theirs(count);
              FillInput(DataType::kI32, theirs.data(), count, q, ReduceOp::kSum);
              for (size_t i = 0; i < count; ++i) wrong += all[q * count + i] != theirs[i];
            }
            EXPECT_EQ(wrong, 0u) << "gather " << what;
            EXPECT_EQ(all[n * count], -1) << "gather " << what << ": wrote past the end";
          }
          // Scatter: the root sends block q = q * 1000 + i.
          std::vector<int32_t> blocks(n * count), got(count + 1, -1);
          for (int q = 0; q < n; ++q) {
            for (size_t i = 0; i < count; ++i) blocks[q * count + i] = q * 1000 + static_cast<int32_t>(i);
          }
          int32_t* scatter_recv = is_root && in_place ? blocks.data() + r * count : got.data();
          s = group[r]->Scatter(is_root ? blocks.data() : nullptr, scatter_recv, count,
                                DataType::kI32, root, deadline, nullptr);
          ASSERT_TRUE(s.ok()) << "scatter " << what << ": " << s;
          size_t wrong = 0;
          for (size_t i = 0; i < count; ++i) wrong += scatter_recv[i] != r * 1000 + static_cast<int32_t>(i);
          EXPECT_EQ(wrong, 0u) << "scatter " << what;
          EXPECT_EQ(got[count], -1) << "scatter " << what << ": wrote past the end";
          std::vector<int32_t> v(100);
          FillInput(DataType::kI32, v.data(), v.size(), r, ReduceOp::kSum);
          ASSERT_TRUE(group[r]->AllReduce(v.data(), v.data(), v.size(), DataType::kI32,
                                          ReduceOp::kSum, deadline, nullptr).ok());
          EXPECT_EQ(CountWrong(DataType::kI32, v.data(), v.size(), n, ReduceOp::kSum), 0u);
        });
      }
    }
  }
}

// Ranks that disagree on the root, the count or the collective: the root
// (which compares everyone) and the rank that differs (which compares with
// its root) fail, naming both sides; on the direct path every rank does (all
// wait for all), staged a rank that agrees with the root may return first.
// A root outside the group is refused before anything is published.
TEST(ShmAllReduce, RootedDisagreementsFailTheRootAndTheRankThatDiffers) {
  for (size_t count : {size_t{10}, size_t{5000}}) {  // staged, direct
    const bool direct = count == 5000;
    auto group = MakeGroup(3, 4096, 1024);
    RunRanks(3, [&](int r) {
      std::vector<float> send(3 * count, 1.0f), recv(3 * count);
      const Deadline deadline = DeadlineIn(milliseconds(5000));
      // Rank 2 reduces to root 1, the others to root 0.
      Status s = group[r]->Reduce(send.data(), recv.data(), count, DataType::kF32, ReduceOp::kSum,
                                  r == 2 ? 1 : 0, deadline, nullptr);
      if (r != 1 || direct) {
        EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << r << ": " << s;
        EXPECT_NE(s.message().find("to root 1"), std::string::npos) << s;
      }
      // Rank 1 gathers one element less.
      s = group[r]->Gather(send.data(), recv.data(), r == 1 ? count - 1 : count, DataType::kF32, 0,
                           deadline, nullptr);
      if (r != 2 || direct) {
        EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << r << ": " << s;
        EXPECT_NE(s.message().find("gather arguments differ"), std::string::npos) << s;
      }
      // The root scatters, the others gather: every rank compares with it.
      s = r == 0 ? group[r]->Scatter(send.data(), recv.data(), count, DataType::kF32, 0, deadline, nullptr)
                 : group[r]->Gather(send.data(), recv.data(), count, DataType::kF32, 0, deadline, nullptr);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << r << ": " << s;
    });
    float x = 0;
    for (int root : {-1, 3}) {
      Status s = group[0]->Scatter(&x, &x, 1, DataType::kF32, root, DeadlineIn(milliseconds(100)), nullptr);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find("scatter: root " + std::to_string(root)), std::string::npos) << s;
    }
  }
}

// A rank that leaves staged calls as soon as the root arrived runs at most
// one call ahead: its second call waits until the slow root is done with
// the first (whose staging buffer it reuses), and every result is right.
TEST(ShmAllReduce, StagedRootedCallsRunAtMostOneCallAheadOfTheRoot) {
  auto group = MakeGroup(3, 4096, 1024);
  RunRanks(3, [&](int r) {
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    for (int call = 0; call < 50; ++call) {
      if (r == 0 && call % 7 == 0) std::this_thread::sleep_for(milliseconds(2));
      std::vector<int32_t> send(100), recv(100, -1);
      FillInput(DataType::kI32, send.data(), send.size(), r, ReduceOp::kSum, call);
      Status s = group[r]->Reduce(send.data(), recv.data(), send.size(), DataType::kI32,
                                  ReduceOp::kSum, 0, deadline, nullptr);
      ASSERT_TRUE(s.ok()) << s;
      if (r == 0) {
        EXPECT_EQ(CountWrong(DataType::kI32, recv.data(), recv.size(), 3, ReduceOp::kSum, call), 0u)
            << "call " << call;
      }
      // An all-reduce between them reuses the staging buffers too.
      if (call % 5 == 4) {
        ASSERT_TRUE(group[r]->AllReduce(send.data(), recv.data(), send.size(), DataType::kI32,
                                        ReduceOp::kSum, deadline, nullptr).ok());
        EXPECT_EQ(CountWrong(DataType::kI32, recv.data(), recv.size(), 3, ReduceOp::kSum, call), 0u);
      }
    }
  });
}

// Rank 2 runs a call ahead of the root of call 1 (rank 0, napping in its
// watchdog), and its call 3 times out waiting for rank 0 to finish call 1.
// It used to return without a trace: ranks 0 and 1 then waited for it in
// call 3 until their own deadline, and its next call took number 3 and
// paired with theirs. Now they fail call 3 at once with its error, and its
// later calls fail naming it.
TEST(ShmAllReduce, ACallThatCannotClaimItsSlotFailsThePeersAtOnceAndLaterCalls) {
  // Call 3 an all-reduce, or a barrier (which publishes its own arrival).
  for (bool barrier : {false, true}) {
    auto group = MakeGroup(3, 4096, 1024);
    std::atomic<bool> napping{false}, claim_failed{false};
    std::vector<Status> third(3), later(3);
    std::vector<Clock::duration> third_took(3);
    RunRanks(3, [&](int r) {
      const Deadline deadline = DeadlineIn(milliseconds(10000));
      std::vector<float> send(100, 1.0f), recv(300);
      std::function<Status(Deadline, int)> nap = [&](Deadline, int) {
        if (!napping.exchange(true)) AwaitFlag(claim_failed);
        return Status::Ok();
      };
      auto call = [&](Deadline until) {
        return barrier ? group[r]->Barrier(until, nullptr)
                       : group[r]->AllReduce(send.data(), recv.data(), send.size(), DataType::kF32,
                                             ReduceOp::kSum, until, nullptr);
      };
      if (r != 0) AwaitFlag(napping);
      ASSERT_TRUE(group[r]->Reduce(send.data(), recv.data(), send.size(), DataType::kF32,
                                   ReduceOp::kSum, 0, deadline,
                                   r == 0 ? nap : std::function<Status(Deadline, int)>()).ok());
      ASSERT_TRUE(group[r]->Reduce(send.data(), recv.data(), send.size(), DataType::kF32,
                                   ReduceOp::kSum, 1, deadline, nullptr).ok());
      const auto start = Clock::now();
      third[r] = call(r == 2 ? DeadlineIn(milliseconds(200)) : DeadlineIn(milliseconds(5000)));
      third_took[r] = Clock::now() - start;
      if (r != 2) return;
      claim_failed = true;
      later[r] = call(DeadlineIn(milliseconds(1000)));
    });
    const std::string what = barrier ? "barrier" : "all-reduce";
    EXPECT_EQ(third[2].code(), StatusCode::kTimedOut) << what << ": " << third[2];
    EXPECT_NE(third[2].message().find("finish an earlier call"), std::string::npos) << third[2];
    EXPECT_EQ(later[2].code(), StatusCode::kFailedPrecondition) << what << ": " << later[2];
    EXPECT_NE(later[2].message().find("finish an earlier call"), std::string::npos) << later[2];
    for (int r : {0, 1}) {
      EXPECT_EQ(third[r].code(), StatusCode::kTimedOut) << what << ", rank " << r << ": " << third[r];
      EXPECT_NE(third[r].message().find("rank 2 failed in this shared-memory call"),
                std::string::npos) << what << ", rank " << r << ": " << third[r];
      EXPECT_LT(third_took[r], milliseconds(2000)) << what << ", rank " << r;
    }
  }
}

// A rank that never comes: the others time out at their deadline naming
// it (the root of a reduce, and a rank of a scatter whose root is absent).
TEST(ShmAllReduce, RootedCallsWithAnAbsentPeerTimeOut) {
  auto group = MakeGroup(3, 4096, 1024);
  RunRanks(2, [&](int r) {
    std::vector<float> x(5000, 1.0f), y(3 * 5000);
    const auto start = Clock::now();
    Status s = group[r]->Reduce(x.data(), y.data(), x.size(), DataType::kF32, ReduceOp::kSum, 0,
                                DeadlineIn(milliseconds(200)), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
    EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s;
    EXPECT_LT(Clock::now() - start, milliseconds(2000));
  });
}

TEST(ShmAllReduce, BroadcastRootsThatDifferFailOnEveryRank) {
  auto group = MakeGroup(2, 4096, 1024);
  RunRanks(2, [&](int r) {
    std::vector<float> data(10, 1.0f);
    Status s = group[r]->Broadcast(data.data(), data.size(), DataType::kF32, r,
                                   DeadlineIn(milliseconds(5000)), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("broadcast count 10 f32 from root 0"), std::string::npos) << s;
    EXPECT_NE(s.message().find("from root 1"), std::string::npos) << s;
  });
  auto other = MakeGroup(2, 4096, 1024);
  RunRanks(2, [&](int r) {
    std::vector<float> data(10, 1.0f);
    const Deadline deadline = DeadlineIn(milliseconds(5000));
    Status s = r == 0 ? other[r]->Broadcast(data.data(), data.size(), DataType::kF32, 0, deadline, nullptr)
                      : other[r]->AllReduce(data.data(), data.data(), data.size(), DataType::kF32,
                                            ReduceOp::kSum, deadline, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  });
  float x = 0;
  EXPECT_EQ(group[0]->Broadcast(&x, 1, DataType::kF32, 2, DeadlineIn(milliseconds(100)), nullptr).code(),
            StatusCode::kInvalidArgument);
}

TEST(ShmAllReduce, MismatchedCountsFailOnEveryRank) {
  auto group = MakeGroup(2, 4096, 1024);
  RunRanks(2, [&](int r) {
    std::vector<float> data(100, 1.0f);
    const size_t count = r == 0 ? 100 : 50;
    Status s = group[r]->AllReduce(data.data(), data.data(), count, DataType::kF32, ReduceOp::kSum,
                                   DeadlineIn(milliseconds(5000)), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("count 100"), std::string::npos) << s;
    EXPECT_NE(s.message().find("count 50"), std::string::npos) << s;
  });
}

// Counts whose bytes overflow size_t, and dtype or op values outside their
// enums, fail on every rank with INVALID_ARGUMENT naming the value, and the
// group goes on. (A count whose bytes wrapped around to a few took the
// staged path and folded far past the staging buffers; a bad dtype counted
// zero bytes and returned OK with the output untouched; a bad op aborted.)
TEST(ShmAllReduce, CountsDtypesAndOpsOutsideTheirRangeAreRefusedOnEveryRank) {
  auto group = MakeGroup(2, 4096, 1024);
  // 4 * (2^62 + 1) wraps to 4 bytes; 2 ranks * 4 * (2^61 + 1) to 8.
  const size_t wraps = (size_t{1} << 62) + 1;
  const size_t wraps_twice = (size_t{1} << 61) + 1;
  RunRanks(2, [&](int r) {
    std::vector<float> send(64, 1.0f), recv(64, 0.0f);
    const Deadline deadline = DeadlineIn(milliseconds(5000));
    auto expect_refused = [&](const Status& s, const std::string& named, const char* call) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << call << ": " << s;
      EXPECT_NE(s.message().find(named), std::string::npos) << call << ": " << s;
    };
    const std::string overflow = std::to_string(wraps) + " elements of f32";
    expect_refused(group[r]->AllReduce(send.data(), recv.data(), wraps, DataType::kF32,
                                       ReduceOp::kSum, deadline, nullptr),
                   overflow, "all-reduce");
    expect_refused(group[r]->Reduce(send.data(), recv.data(), wraps, DataType::kF32,
                                    ReduceOp::kSum, 0, deadline, nullptr),
                   overflow, "reduce");
    expect_refused(group[r]->Broadcast(recv.data(), wraps, DataType::kF32, 0, deadline, nullptr),
                   overflow, "broadcast");
    const std::string blocks = "2 blocks of " + std::to_string(wraps_twice) + " elements of f32";
    expect_refused(group[r]->AllToAll(send.data(), recv.data(), wraps_twice, DataType::kF32,
                                      deadline, nullptr),
                   blocks, "all-to-all");
    expect_refused(group[r]->Gather(send.data(), recv.data(), wraps_twice, DataType::kF32, 0,
                                    deadline, nullptr),
                   blocks, "gather");
    expect_refused(group[r]->Scatter(send.data(), recv.data(), wraps_twice, DataType::kF32, 0,
                                     deadline, nullptr),
                   blocks, "scatter");
    expect_refused(group[r]->AllReduce(send.data(), recv.data(), 4, static_cast<DataType>(42),
                                       ReduceOp::kSum, deadline, nullptr),
                   "dtype 42", "all-reduce");
    expect_refused(group[r]->AllReduce(send.data(), recv.data(), 4, DataType::kF32,
                                       static_cast<ReduceOp>(17), deadline, nullptr),
                   "op 17", "all-reduce");
    // Nothing was left half-done: the next call pairs up and is right.
    std::vector<int32_t> v(100);
    FillInput(DataType::kI32, v.data(), v.size(), r, ReduceOp::kSum);
    Status s = group[r]->AllReduce(v.data(), v.data(), v.size(), DataType::kI32, ReduceOp::kSum,
                                   deadline, nullptr);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(CountWrong(DataType::kI32, v.data(), v.size(), 2, ReduceOp::kSum), 0u);
  });
}

// Ranks whose staging limits differ (set_staging_bytes on one rank only)
// take different paths for the same call: each fails, naming both paths,
// instead of a staged rank folding a staging buffer its direct peer never
// filled and returning while that peer still writes into its output.
TEST(ShmAllReduce, RanksOnDifferentPathsFailInsteadOfMixingThem) {
  auto group = MakeGroup(2, 4096, 1024);
  group[0]->set_staging_bytes(64);
  RunRanks(2, [&](int r) {
    const Deadline deadline = DeadlineIn(milliseconds(5000));
    std::vector<int32_t> v(500);  // 2000 bytes: direct on rank 0, staged on rank 1
    FillInput(DataType::kI32, v.data(), v.size(), r, ReduceOp::kSum);
    Status s = group[r]->AllReduce(v.data(), v.data(), v.size(), DataType::kI32, ReduceOp::kSum,
                                   deadline, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << r << ": " << s;
    EXPECT_NE(s.message().find("rank 0 takes the direct path"), std::string::npos) << s;
    EXPECT_NE(s.message().find("rank 1 the staged path"), std::string::npos) << s;
    s = group[r]->Broadcast(v.data(), v.size(), DataType::kI32, 1, deadline, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << r << ": " << s;
  });
  // With the limits alike again the group goes on, on either path.
  group[0]->set_staging_bytes(4096);
  RunRanks(2, [&](int r) {
    for (size_t count : {size_t{500}, size_t{5000}}) {
      std::vector<int32_t> v(count);
      FillInput(DataType::kI32, v.data(), v.size(), r, ReduceOp::kSum);
      Status s = group[r]->AllReduce(v.data(), v.data(), v.size(), DataType::kI32, ReduceOp::kSum,
                                     DeadlineIn(milliseconds(5000)), nullptr);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(CountWrong(DataType::kI32, v.data(), v.size(), 2, ReduceOp::kSum), 0u) << count;
    }
  });
}

TEST(ShmAllReduce, AbsentPeerTimesOutNamingIt) {
  auto group = MakeGroup(3, 4096, 1024);
  // Rank 2 never calls.
  RunRanks(2, [&](int r) {
    float x = 1;
    const auto start = Clock::now();
    Status s = group[r]->AllReduce(&x, &x, 1, DataType::kF32, ReduceOp::kSum,
                                   DeadlineIn(milliseconds(200)), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
    EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s;
    EXPECT_LT(Clock::now() - start, milliseconds(2000));
  });
}

// A rank whose deadline passes while a peer is late takes its buffer back
// when the call returns: the late peer, arriving afterwards, neither reads
// nor writes it, and fails at once with the first rank's error instead of
// waiting out its own deadline. (Before, the late rank wrote its slice into
// the buffer after the call had returned, then timed out.)
TEST(ShmAllReduce, LatePeerLeavesTheBufferOfARankThatGaveUp) {
  auto group = MakeGroup(2, 4096, 1024);
  const size_t count = 50000;  // the direct path
  std::vector<float> early(count, 1.0f);
  std::vector<float> late(count, 2.0f);
  Status late_status;
  Clock::duration late_took{};
  std::atomic<bool> gave_up{false};
  std::thread peer([&] {
    AwaitFlag(gave_up);
    const auto start = Clock::now();
    late_status = group[1]->AllReduce(late.data(), late.data(), count, DataType::kF32,
                                      ReduceOp::kSum, DeadlineIn(milliseconds(10000)), nullptr);
    late_took = Clock::now() - start;
  });
  Status s = group[0]->AllReduce(early.data(), early.data(), count, DataType::kF32, ReduceOp::kSum,
                                 DeadlineIn(milliseconds(200)), nullptr);
  std::fill(early.begin(), early.end(), 7.0f);  // the caller reuses its buffer
  gave_up = true;
  peer.join();
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_EQ(std::count(early.begin(), early.end(), 7.0f), static_cast<ptrdiff_t>(count))
      << "the late rank wrote into the buffer after the call returned";
  EXPECT_EQ(late_status.code(), StatusCode::kTimedOut) << late_status;
  EXPECT_NE(late_status.message().find("rank 0 failed in this shared-memory call"),
            std::string::npos) << late_status;
  EXPECT_NE(late_status.message().find("waiting for rank 1 to arrive"), std::string::npos)
      << late_status;
  EXPECT_LT(late_took, milliseconds(3000));
}

// The same with both ranks' buffers in shareable memory, where the late
// rank would read the first rank's input through its mapping: it checks
// that the first rank is still in the call before folding, and fails.
TEST(ShmAllReduce, LatePeerDoesNotFoldTheShareableInputOfARankThatGaveUp) {
  auto group = MakeGroup(2, 4096, 1024);
  const size_t count = 50000;
  const size_t bytes = count * sizeof(float);
  auto early_buffer = AllocateShareable(bytes);
  auto late_buffer = AllocateShareable(bytes);
  ASSERT_TRUE(early_buffer.ok() && late_buffer.ok());
  float* early = static_cast<float*>(*early_buffer);
  float* late = static_cast<float*>(*late_buffer);
  std::fill(early, early + count, 1.0f);
  std::fill(late, late + count, 2.0f);
  const uint64_t late_mapped_before = group[1]->mapped_copies();
  Status late_status;
  std::atomic<bool> gave_up{false};
  std::thread peer([&] {
    AwaitFlag(gave_up);
    late_status = group[1]->AllReduce(late, late, count, DataType::kF32, ReduceOp::kSum,
                                      DeadlineIn(milliseconds(10000)), nullptr);
  });
  Status s = group[0]->AllReduce(early, early, count, DataType::kF32, ReduceOp::kSum,
                                 DeadlineIn(milliseconds(200)), nullptr);
  std::fill(early, early + count, 7.0f);
  gave_up = true;
  peer.join();
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_EQ(std::count(early, early + count, 7.0f), static_cast<ptrdiff_t>(count))
      << "the late rank wrote into the buffer after the call returned";
  EXPECT_EQ(late_status.code(), StatusCode::kTimedOut) << late_status;
  EXPECT_NE(late_status.message().find("rank 0 failed in this shared-memory call"),
            std::string::npos) << late_status;
  EXPECT_EQ(group[1]->mapped_copies(), late_mapped_before + 1)
      << "the late rank should have mapped the first rank's input once, then stopped";
  EXPECT_TRUE(FreeShareable(early).ok());
  EXPECT_TRUE(FreeShareable(late).ok());
}

// The hierarchical form's slice function may be slow (the step between
// hosts): a peer that gave up meanwhile does not get that slice written
// into its output afterwards, and the slow rank fails with its error.
TEST(ShmAllReduce, SlowSliceFunctionDoesNotWriteIntoARankThatGaveUp) {
  auto group = MakeGroup(2, 4096, 1024);
  const size_t count = 50000;
  std::vector<float> fast(count, 1.0f);
  std::vector<float> slow(count, 2.0f);
  Status slow_status;
  std::atomic<bool> gave_up{false};
  std::thread peer([&] {
    slow_status = group[1]->AllReduceThrough(
        slow.data(), slow.data(), count, DataType::kF32, ReduceOp::kSum,
        [&](void*, size_t, size_t) {
          AwaitFlag(gave_up);  // slower than the other rank's deadline
          return Status::Ok();
        },
        DeadlineIn(milliseconds(10000)), nullptr);
  });
  Status s = group[0]->AllReduceThrough(fast.data(), fast.data(), count, DataType::kF32,
                                        ReduceOp::kSum,
                                        [](void*, size_t, size_t) { return Status::Ok(); },
                                        DeadlineIn(milliseconds(300)), nullptr);
  std::fill(fast.begin(), fast.end(), 7.0f);
  gave_up = true;
  peer.join();
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_NE(s.message().find("waiting for rank 1 to finish"), std::string::npos) << s;
  EXPECT_EQ(std::count(fast.begin(), fast.end(), 7.0f), static_cast<ptrdiff_t>(count))
      << "the slow rank wrote its slice after the call returned";
  EXPECT_EQ(slow_status.code(), StatusCode::kTimedOut) << slow_status;
  EXPECT_NE(slow_status.message().find("rank 0 failed in this shared-memory call"),
            std::string::npos) << slow_status;
}

// A broadcast root that gave up: a late rank does not read the root's
// buffer afterwards (it may hold anything by then) and return OK.
TEST(ShmAllReduce, LateRankFailsTheBroadcastOfARootThatGaveUp) {
  auto group = MakeGroup(2, 4096, 1024);
  const size_t count = 50000;  // read from the root's buffer
  std::vector<float> root(count, 5.0f);
  std::vector<float> late(count, 0.0f);
  Status late_status;
  std::atomic<bool> gave_up{false};
  std::thread peer([&] {
    AwaitFlag(gave_up);
    late_status = group[1]->Broadcast(late.data(), count, DataType::kF32, 0,
                                      DeadlineIn(milliseconds(10000)), nullptr);
  });
  Status s = group[0]->Broadcast(root.data(), count, DataType::kF32, 0,
                                 DeadlineIn(milliseconds(200)), nullptr);
  std::fill(root.begin(), root.end(), 7.0f);
  gave_up = true;
  peer.join();
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_EQ(late_status.code(), StatusCode::kTimedOut) << late_status;
  EXPECT_NE(late_status.message().find("rank 0 failed in this shared-memory call"),
            std::string::npos) << late_status;
  // Small buffers go through the root's staging buffer: the late rank fails
  // the same way (the root returned an error for this call).
  float small = 1.0f, small_late = 0.0f;
  gave_up = false;
  peer = std::thread([&] {
    AwaitFlag(gave_up);
    late_status = group[1]->Broadcast(&small_late, 1, DataType::kF32, 0,
                                      DeadlineIn(milliseconds(10000)), nullptr);
  });
  s = group[0]->Broadcast(&small, 1, DataType::kF32, 0, DeadlineIn(milliseconds(200)), nullptr);
  gave_up = true;
  peer.join();
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_EQ(late_status.code(), StatusCode::kTimedOut) << late_status;
}

// The root gives up while a rank reads its (large) buffer with CMA, and
// the caller frees the buffer at once, so the read fails: the reader fails
// the call with the root's error, at once. (It used to wait 500 ms for
// the root to exit, then report the buffer as freed during the call.)
TEST(ShmAllReduce, ReadThatFailsBecauseThePeerGaveUpReportsThePeersError) {
  auto group = MakeGroup(2, 4096, 1024);
  const size_t count = size_t{64} << 20;  // 256 MiB of f32: one CMA read of tens of ms
  const size_t bytes = count * sizeof(float);
  void* root = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  void* late = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(root, MAP_FAILED);
  ASSERT_NE(late, MAP_FAILED);
  std::memset(root, 1, bytes);
  Status late_status;
  Clock::time_point late_returned;
  std::thread reader([&] {
    late_status = group[1]->Broadcast(late, count, DataType::kF32, 0,
                                      DeadlineIn(milliseconds(10000)), nullptr);
    late_returned = Clock::now();
  });
  std::this_thread::sleep_for(milliseconds(50));  // the reader waits for the root
  // The reader starts reading once the root arrives; the root gives up 5 ms
  // later, long before the read of 256 MiB ends.
  Status s = group[0]->Broadcast(root, count, DataType::kF32, 0, DeadlineIn(milliseconds(5)),
                                 nullptr);
  const Clock::time_point root_returned = Clock::now();
  ASSERT_EQ(munmap(root, bytes), 0);
  reader.join();
  munmap(late, bytes);
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_EQ(late_status.code(), StatusCode::kTimedOut) << late_status;
  EXPECT_NE(late_status.message().find("rank 0 failed in this shared-memory call"),
            std::string::npos) << late_status;
  // Well before its own deadline (10 s); the bound leaves room for a
  // loaded machine (the message above tells the old path apart).
  EXPECT_LT(late_returned - root_returned, milliseconds(3000));
}

// A pair of engines whose rank 1 is a thread of this process but whose pid
// in the group is that of a child that is killed and reaped once the pair
// is made: a peer that died after set-up, its pid free for another process.
// The child is a copy of this process, so that the probe of cross-memory
// attach at set-up reads what it expects. `peer` is -1 where fork failed;
// a rank whose engine could not be made is null (the failure is reported).
struct PairWithDeadPeer {
  std::vector<std::unique_ptr<ShmAllReduce>> group;
  pid_t peer = -1;
};

PairWithDeadPeer MakePairWithDeadPeer(const std::string& key_prefix) {
  PairWithDeadPeer pair;
  pair.group.resize(2);
  pair.peer = fork();
  if (pair.peer < 0) return pair;
  if (pair.peer == 0) {
    while (true) pause();
  }
  testing::InMemoryStore store;
  RunRanks(2, [&](int r) {
    ShmOptions options{.rank = r, .size = 2, .pids = {getpid(), pair.peer}, .staging_bytes = 4096,
                       .rooted_staging_bytes = 4096, .chunk_bytes = 1024};
    auto engine = ShmAllReduce::Create(store, key_prefix, options, DeadlineIn(milliseconds(10000)));
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (engine.ok()) pair.group[r] = std::move(*engine);
  });
  kill(pair.peer, SIGKILL);
  waitpid(pair.peer, nullptr, 0);
  return pair;
}

// A child made by fork() inherits the engine, whose mailbox and staging
// buffers are the parent's shared memory: a call there published as the
// parent's rank (peers would pair with it) and returned OK. Now every
// collective fails there with FAILED_PRECONDITION, and the parent's
// engine goes on as before.
TEST(ShmAllReduce, AForkedChildCannotUseItsParentsEngine) {
  auto group = MakeGroup(1, 4096, 1024);
  const pid_t child = fork();
  ASSERT_GE(child, 0) << "fork: " << std::strerror(errno);
  if (child == 0) {
    float x = 1.0f;
    const Deadline deadline = DeadlineIn(milliseconds(1000));
    int wrong = 0;
    for (const Status& s :
         {group[0]->AllReduce(&x, &x, 1, DataType::kF32, ReduceOp::kSum, deadline, nullptr),
          group[0]->Broadcast(&x, 1, DataType::kF32, 0, deadline, nullptr),
          group[0]->Barrier(deadline, nullptr)}) {
      if (s.code() != StatusCode::kFailedPrecondition ||
          s.message().find("forked child") == std::string::npos) {
        std::fprintf(stderr, "in the child: %s\n", s.ToString().c_str());
        ++wrong;
      }
    }
    _exit(wrong == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  std::vector<int32_t> v(100);
  FillInput(DataType::kI32, v.data(), v.size(), 0, ReduceOp::kSum);
  Status s = group[0]->AllReduce(v.data(), v.data(), v.size(), DataType::kI32, ReduceOp::kSum,
                                 DeadlineIn(milliseconds(1000)), nullptr);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(CountWrong(DataType::kI32, v.data(), v.size(), 1, ReduceOp::kSum), 0u);
}

// A peer whose process exited while the others wait for it fails the wait
// with PEER_LOST naming it, soon, also where the caller passed no watchdog:
// the wait looks at the peer's pidfd while it sleeps. (It waited until its
// deadline and then reported TIMED_OUT.)
TEST(ShmAllReduce, AWaitForAPeerWhoseProcessExitedEndsWithoutAWatchdog) {
  PairWithDeadPeer pair = MakePairWithDeadPeer("exited/");
  ASSERT_GE(pair.peer, 0) << "fork: " << std::strerror(errno);
  ASSERT_NE(pair.group[0], nullptr);
  float x = 1.0f;
  const auto start = Clock::now();
  Status s = pair.group[0]->AllReduce(&x, &x, 1, DataType::kF32, ReduceOp::kSum,
                                      DeadlineIn(milliseconds(5000)), nullptr);
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_NE(s.message().find("rank 1 (pid " + std::to_string(pair.peer) + ") exited"),
            std::string::npos)
      << s;
  EXPECT_LT(Clock::now() - start, milliseconds(2000));
}

// With a watchdog, the watchdog alone judges a peer that exited: it may
// know why the peer left (the communicator's reads the reason a peer
// posted before exiting, and waits out a store hiccup before it calls a
// peer lost). Here it has no news at its first look and the reason at the
// next: the wait ends with the reason, not with the bare exit.
TEST(ShmAllReduce, AWatchdogsVerdictOnAnExitedPeerIsKept) {
  PairWithDeadPeer pair = MakePairWithDeadPeer("verdict/");
  ASSERT_GE(pair.peer, 0) << "fork: " << std::strerror(errno);
  ASSERT_NE(pair.group[0], nullptr);
  int looks = 0;
  float x = 1.0f;
  Status s = pair.group[0]->AllReduce(
      &x, &x, 1, DataType::kF32, ReduceOp::kSum, DeadlineIn(milliseconds(5000)),
      [&](Deadline, int) {
        return ++looks == 1 ? Status::Ok() : AbortedError("rank 1 posted: out of memory");
      });
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
  EXPECT_EQ(s.message(), "rank 1 posted: out of memory");
}

// Starts a copy of this process under the pid `pid` (clone3's set_tid; root
// may choose a free pid) that runs `body`, then waits to be killed. Returns
// the copy's pid, or -1 with errno kept from clone3 (EEXIST: the pid is
// taken). Call it while this process runs one thread only.
pid_t StartCopyAs(pid_t pid, const std::function<void()>& body) {
  clone_args args{};
  args.exit_signal = SIGCHLD;
  args.set_tid = reinterpret_cast<uint64_t>(&pid);
  args.set_tid_size = 1;
  const pid_t copy = static_cast<pid_t>(syscall(SYS_clone3, &args, sizeof(args)));
  if (copy == 0) {
    body();
    while (true) pause();
  }
  return copy;
}

// Kills and reaps the child `pid`; nothing where it is not a pid (<= 0).
void KillAndReap(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

// A peer died and another process took its pid at once: a read of the
// peer's buffer by that pid fails (the new process does not map it). The
// reader asked the pid whether the peer had exited, found the new process
// alive, and reported the buffer as freed during the call. It now asks a
// pidfd taken when the engine was made, which stays with the dead peer:
// PEER_LOST naming it. Rank 1 is a thread of this process whose pid in the
// group is that of a child (a copy of this process, so the probe of
// cross-memory attach at set-up reads what it expects); the child is
// killed before the call and its pid taken by a copy of this process that
// unmaps the root's buffer.
TEST(ShmAllReduce, AFailedReadFromAPeerWhosePidWasReusedIsPeerLost) {
  const size_t count = size_t{1} << 16;  // 256 KiB of f32: the direct path
  const size_t bytes = count * sizeof(float);
  void* root = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(root, MAP_FAILED);
  std::vector<float> received(count);
  PairWithDeadPeer pair = MakePairWithDeadPeer("reused/");
  ASSERT_GE(pair.peer, 0) << "fork: " << std::strerror(errno);
  auto& group = pair.group;
  const pid_t peer = pair.peer;
  // The same pid for a copy of this process without the root's buffer; it
  // says when it has unmapped it.
  int unmapped[2];
  ASSERT_EQ(pipe2(unmapped, O_CLOEXEC), 0) << std::strerror(errno);
  const pid_t reuser = StartCopyAs(peer, [&] {
    munmap(root, bytes);
    const char done = 1;
    if (write(unmapped[1], &done, 1) != 1) _exit(1);
  });
  const int reuse_error = errno;
  close(unmapped[1]);
  if (reuser > 0) {
    pollfd ready{unmapped[0], POLLIN, 0};
    EXPECT_EQ(poll(&ready, 1, 10000), 1) << "the copy under the peer's pid did not unmap the buffer";
  }
  close(unmapped[0]);
  Status read_status, root_status;
  if (group[0] != nullptr && group[1] != nullptr) {
    std::thread root_rank([&] {
      root_status = group[1]->Broadcast(root, count, DataType::kF32, 1,
                                        DeadlineIn(milliseconds(10000)), nullptr);
    });
    read_status = group[0]->Broadcast(received.data(), count, DataType::kF32, 1,
                                      DeadlineIn(milliseconds(10000)), nullptr);
    root_rank.join();
  }
  KillAndReap(reuser);
  munmap(root, bytes);
  ASSERT_EQ(reuser, peer) << "clone3 with set_tid: " << std::strerror(reuse_error);
  EXPECT_EQ(read_status.code(), StatusCode::kPeerLost) << read_status;
  EXPECT_NE(read_status.message().find("rank 1 (pid " + std::to_string(peer) + ") exited"),
            std::string::npos)
      << read_status;
}

// The same where the process under the dead peer's pid maps the buffer
// (a copy of this process made before the root's buffer changed): the
// read succeeded with that process's bytes, and the call returned OK with
// wrong data. A read by pid is now trusted only while the peer's pidfd
// shows it alive.
TEST(ShmAllReduce, AReadFromAPeerWhosePidWasReusedIsNotTrusted) {
  const size_t count = size_t{1} << 16;  // 256 KiB of f32: the direct path
  std::vector<float> root(count, 1.0f), received(count, 0.0f);
  PairWithDeadPeer pair = MakePairWithDeadPeer("trusted/");
  ASSERT_GE(pair.peer, 0) << "fork: " << std::strerror(errno);
  auto& group = pair.group;
  const pid_t peer = pair.peer;
  const pid_t reuser = StartCopyAs(peer, [] {});
  const int reuse_error = errno;
  // The copy under the peer's pid keeps the 1s.
  std::fill(root.begin(), root.end(), 2.0f);
  Status read_status;
  if (group[0] != nullptr && group[1] != nullptr) {
    std::thread root_rank([&] {
      group[1]->Broadcast(root.data(), count, DataType::kF32, 1, DeadlineIn(milliseconds(10000)),
                          nullptr).IgnoreError();
    });
    read_status = group[0]->Broadcast(received.data(), count, DataType::kF32, 1,
                                      DeadlineIn(milliseconds(10000)), nullptr);
    root_rank.join();
  }
  KillAndReap(reuser);
  ASSERT_EQ(reuser, peer) << "clone3 with set_tid: " << std::strerror(reuse_error);
  EXPECT_EQ(read_status.code(), StatusCode::kPeerLost)
      << read_status << " (received[0] = " << received[0] << ", the root sent 2)";
  EXPECT_NE(read_status.message().find("rank 1 (pid " + std::to_string(peer) + ") exited"),
            std::string::npos)
      << read_status;
}

// The same for a write: rank 0 gathers into the dead root's output by
// pid, and a copy of this process (made after the output was allocated, so
// it maps the same address) holds that pid now. The write went into the
// copy's memory and the call returned OK; a write by pid is now made only
// while the peer's pidfd shows it alive. The watchdog says nothing, as a
// communicator's does before the store hears of the exit, so the wait
// does not look at the pidfd itself.
TEST(ShmAllReduce, AWriteToAPeerWhosePidWasReusedIsNotMade) {
  const size_t count = 4096;  // 2 x 16 KiB at the root: above the rooted staging limit
  std::vector<float> mine(count, 3.0f), gathered(2 * count, 0.0f);
  PairWithDeadPeer pair = MakePairWithDeadPeer("write_reused/");
  ASSERT_GE(pair.peer, 0) << "fork: " << std::strerror(errno);
  auto& group = pair.group;
  const pid_t peer = pair.peer;
  const pid_t reuser = StartCopyAs(peer, [] {});
  const int reuse_error = errno;
  auto silent = [](Deadline, int) { return Status::Ok(); };
  Status write_status;
  if (group[0] != nullptr && group[1] != nullptr) {
    std::thread root_rank([&] {
      std::vector<float> own(count, 5.0f);
      group[1]->Gather(own.data(), gathered.data(), count, DataType::kF32, 1,
                       DeadlineIn(milliseconds(3000)), silent).IgnoreError();
    });
    write_status = group[0]->Gather(mine.data(), nullptr, count, DataType::kF32, 1,
                                    DeadlineIn(milliseconds(3000)), silent);
    root_rank.join();
  }
  KillAndReap(reuser);
  ASSERT_EQ(reuser, peer) << "clone3 with set_tid: " << std::strerror(reuse_error);
  EXPECT_EQ(write_status.code(), StatusCode::kPeerLost) << write_status;
  EXPECT_NE(write_status.message().find("rank 1 (pid " + std::to_string(peer) + ") exited"),
            std::string::npos)
      << write_status;
}

// The same for a root output in shareable memory, which rank 0 maps
// through /proc/PID/fd/N instead of writing by pid: the copy holding the
// dead root's pid has a memfd of AllocateShareable's of the same size under
// that number (it inherited this process's), as a restarted rank of the
// same program could. Rank 0 mapped it and wrote into it, and the call
// returned OK; a region is now mapped only while the owner's pidfd shows
// it alive after the open, and the call fails PEER_LOST.
TEST(ShmAllReduce, AShareableBufferOfAPeerWhosePidWasReusedIsNotMapped) {
  const size_t count = 4096;  // 2 x 16 KiB at the root: above the rooted staging limit
  std::vector<float> mine(count, 3.0f);
  auto gathered = AllocateShareable(2 * count * sizeof(float));
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  PairWithDeadPeer pair = MakePairWithDeadPeer("map_reused/");
  ASSERT_GE(pair.peer, 0) << "fork: " << std::strerror(errno);
  auto& group = pair.group;
  const pid_t peer = pair.peer;
  const pid_t reuser = StartCopyAs(peer, [] {});
  const int reuse_error = errno;
  auto silent = [](Deadline, int) { return Status::Ok(); };
  Status write_status;
  uint64_t mapped = 0;
  if (group[0] != nullptr && group[1] != nullptr) {
    std::thread root_rank([&] {
      std::vector<float> own(count, 5.0f);
      group[1]->Gather(own.data(), *gathered, count, DataType::kF32, 1,
                       DeadlineIn(milliseconds(3000)), silent).IgnoreError();
    });
    write_status = group[0]->Gather(mine.data(), nullptr, count, DataType::kF32, 1,
                                    DeadlineIn(milliseconds(3000)), silent);
    root_rank.join();
    mapped = group[0]->mapping_stats().maps;
  }
  KillAndReap(reuser);
  group.clear();
  EXPECT_TRUE(FreeShareable(*gathered).ok());
  ASSERT_EQ(reuser, peer) << "clone3 with set_tid: " << std::strerror(reuse_error);
  EXPECT_EQ(mapped, 0u) << "the reused pid's memfd was mapped";
  EXPECT_EQ(write_status.code(), StatusCode::kPeerLost) << write_status;
  EXPECT_NE(write_status.message().find("rank 1 (pid " + std::to_string(peer) + ") exited"),
            std::string::npos)
      << write_status;
}

// A group inside a larger job names its members by their job ranks.
TEST(ShmAllReduce, MessagesUseTheGivenRankNames) {
  testing::InMemoryStore store;
  std::vector<std::unique_ptr<ShmAllReduce>> group(2);
  RunRanks(2, [&](int r) {
    ShmOptions options{.rank = r, .size = 2, .pids = {getpid(), getpid()}, .names = {5, 7}};
    auto engine = ShmAllReduce::Create(store, "named/", options, DeadlineIn(milliseconds(10000)));
    ASSERT_TRUE(engine.ok()) << engine.status();
    group[r] = std::move(*engine);
  });
  float x = 1;
  Status s = group[0]->AllReduce(&x, &x, 1, DataType::kF32, ReduceOp::kSum,
                                 DeadlineIn(milliseconds(100)), nullptr);
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_NE(s.message().find("waiting for rank 7"), std::string::npos) << s;
}

// The store as rank `wrong_rank` sees it: the segment's name it reads is
// one that does not exist, so that its shm_open fails as where that rank's
// /dev/shm is another than rank 0's (a container of its own).
class WrongSegmentNameStore final : public store::Store {
 public:
  explicit WrongSegmentNameStore(store::Store& store) : store_(store) {}
  Status Set(std::string_view key, std::string_view value, Deadline deadline) override {
    return store_.Set(key, value, deadline);
  }
  StatusOr<std::string> Get(std::string_view key, Deadline deadline) override {
    auto value = store_.Get(key, deadline);
    if (value.ok() && key.ends_with("segment/name") && value->starts_with("/")) {
      return std::string("/ddp-no-such-segment");
    }
    return value;
  }
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline deadline) override {
    return store_.TryGet(key, deadline);
  }
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline deadline) override {
    return store_.Add(key, delta, deadline);
  }
  Status Wait(std::span<const std::string> keys, Deadline deadline) override {
    return store_.Wait(keys, deadline);
  }
  StatusOr<bool> Delete(std::string_view key, Deadline deadline) override {
    return store_.Delete(key, deadline);
  }
  StatusOr<std::optional<std::string>> CompareSet(std::string_view key, std::optional<std::string_view> expected,
                                                  std::string_view desired, Deadline deadline) override {
    return store_.CompareSet(key, expected, desired, deadline);
  }

 private:
  store::Store& store_;
};

// Creates a group of `n` whose rank `wrong_rank` reads a wrong segment
// name (see WrongSegmentNameStore); returns each rank's status.
std::vector<Status> CreateWithWrongSegmentName(int n, int wrong_rank, Deadline deadline) {
  testing::InMemoryStore store;
  WrongSegmentNameStore wrong(store);
  std::vector<Status> statuses(n);
  RunRanks(n, [&](int r) {
    ShmOptions options{.rank = r, .size = n, .pids = std::vector<int>(n, getpid())};
    auto engine = ShmAllReduce::Create(r == wrong_rank ? static_cast<store::Store&>(wrong) : store,
                                       "shm/", options, deadline);
    statuses[r] = engine.status();
  });
  return statuses;
}

// The creation deadline of the tests below, whose ranks must fail at once:
// long, so that half of it (the bound they check) is far beyond what a
// loaded machine adds, and waiting it out is not.
constexpr milliseconds kFailFastDeadline(20000);

// A rank that cannot open the segment fails creation on every rank at once
// with the same UNAVAILABLE, naming it and the cause, so that all of them
// go without shared memory. (The others used to wait for it to map the
// segment until the deadline, while it went on without.)
TEST(ShmAllReduce, RankThatCannotOpenTheSegmentFailsCreationOnEveryRankAtOnce) {
  for (int n : {2, 3, 4}) {
    for (int wrong_rank = 1; wrong_rank < n; ++wrong_rank) {
      const auto start = Clock::now();
      const std::vector<Status> statuses =
          CreateWithWrongSegmentName(n, wrong_rank, DeadlineIn(kFailFastDeadline));
      // (ASSERT: one case that waits out the deadline is enough to show.)
      ASSERT_LT(Clock::now() - start, kFailFastDeadline / 2) << n << " ranks, rank " << wrong_rank;
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(statuses[r].code(), StatusCode::kUnavailable) << statuses[r];
        EXPECT_EQ(statuses[r].message(), statuses[wrong_rank].message()) << "rank " << r;
      }
      EXPECT_NE(statuses[0].message().find("local rank " + std::to_string(wrong_rank) +
                                           ": opening /dev/shm/ddp-no-such-segment"),
                std::string::npos)
          << statuses[0];
      EXPECT_NE(statuses[0].message().find("No such file or directory"), std::string::npos)
          << statuses[0];
    }
  }
}

// Rank 0 cannot create the segment (this process has no file descriptor
// left): every rank fails creation at once with its reason. (The others
// used to wait for the segment's name until the deadline.)
TEST(ShmAllReduce, RankZeroThatCannotCreateTheSegmentFailsCreationOnEveryRankAtOnce) {
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  // The lowest free descriptor becomes the limit: every open fails.
  const int lowest_free = dup(0);
  ASSERT_GE(lowest_free, 0);
  close(lowest_free);
  rlimit none = saved;
  none.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &none), 0);
  testing::InMemoryStore store;
  std::vector<Status> statuses(3);
  const auto start = Clock::now();
  RunRanks(3, [&](int r) {
    ShmOptions options{.rank = r, .size = 3, .pids = std::vector<int>(3, getpid())};
    statuses[r] = ShmAllReduce::Create(store, "shm/", options, DeadlineIn(kFailFastDeadline))
                      .status();
  });
  const auto took = Clock::now() - start;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_LT(took, kFailFastDeadline / 2);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kUnavailable) << statuses[r];
    EXPECT_EQ(statuses[r].message(), statuses[0].message()) << "rank " << r;
  }
  EXPECT_NE(statuses[0].message().find("local rank 0: creating /dev/shm/ddp-"), std::string::npos)
      << statuses[0];
  EXPECT_NE(statuses[0].message().find(std::strerror(EMFILE)), std::string::npos) << statuses[0];
}

// A segment name left in /dev/shm by a job killed during set-up (its
// creator is dead) is removed when a later group creates its segment;
// fresh names (a creator in another pid namespace may look dead here)
// stay. (Live creators: StaleSegmentsOfReusedPidsAndZombiesGo below.)
TEST(ShmAllReduce, CreatingASegmentRemovesStaleNamesOfDeadCreators) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  const pid_t dead = child;
  auto make = [](pid_t pid, const char* suffix, bool old) {
    const std::string path = "/dev/shm/ddp-" + std::to_string(pid) + "-" + suffix;
    const int fd = open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << path << ": " << std::strerror(errno);
    if (fd < 0) return path;
    if (old) {
      const timespec times[2] = {{.tv_sec = std::time(nullptr) - 3600, .tv_nsec = 0},
                                 {.tv_sec = std::time(nullptr) - 3600, .tv_nsec = 0}};
      EXPECT_EQ(futimens(fd, times), 0) << std::strerror(errno);
    }
    close(fd);
    return path;
  };
  const std::string stale = make(dead, "4242", /*old=*/true);
  const std::string fresh = make(dead, "4343", /*old=*/false);
  const std::string other = "/dev/shm/ddp-" + std::to_string(dead) + "-x";  // not a segment name
  const int fd = open(other.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  const timespec times[2] = {{.tv_sec = 1, .tv_nsec = 0}, {.tv_sec = 1, .tv_nsec = 0}};
  futimens(fd, times);
  close(fd);
  auto group = MakeGroup(2, 4096, 1024);
  EXPECT_NE(access(stale.c_str(), F_OK), 0) << stale << " is still there";
  EXPECT_EQ(access(fresh.c_str(), F_OK), 0) << fresh << " was removed";
  EXPECT_EQ(access(other.c_str(), F_OK), 0) << other << " was removed";
  for (const std::string& path : {stale, fresh, other}) unlink(path.c_str());
}

// The creator's pid alone does not tell it is alive: a name whose pid now
// belongs to a process started after the name was last written (the pid
// was reused), or to a zombie, is stale too; a name written by a live
// process after it started stays. (Both went unremoved until that process
// exited: kill(pid, 0) succeeds for either.) Run in a folder of its own
// with a stale age of 0, so that names of live processes are candidates.
TEST(ShmAllReduce, StaleSegmentsOfReusedPidsAndZombiesGo) {
  char pattern[] = "/tmp/shm_stale_XXXXXX";
  const std::string dir = mkdtemp(pattern);
  auto make = [&dir](pid_t pid, const char* suffix, time_t modified) {
    const std::string path = dir + "/ddp-" + std::to_string(pid) + "-" + suffix;
    const int fd = open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << path << ": " << std::strerror(errno);
    const timespec times[2] = {{.tv_sec = modified, .tv_nsec = 0}, {.tv_sec = modified, .tv_nsec = 0}};
    EXPECT_EQ(futimens(fd, times), 0) << std::strerror(errno);
    close(fd);
    return path;
  };
  // A zombie (exited, not reaped) holds the pid of a name written after it
  // started (so that only its state tells it is gone).
  const pid_t zombie = fork();
  ASSERT_GE(zombie, 0);
  if (zombie == 0) _exit(0);
  // Wait for it to be a zombie before anything else is made: its exit is
  // asynchronous, and a loaded host may not run it for seconds (the case
  // checks what the scan does with a zombie, not how soon it exits, so the
  // wait is long). A 2 s poll of /proc used to give up and go on, and the
  // removal was then checked against a process that could still be running.
  const bool exited_in_time = internal::ProcessExitsWithin(zombie, std::chrono::milliseconds(60000));
  siginfo_t exited{};
  const int waited = waitid(P_PID, static_cast<id_t>(zombie), &exited, WEXITED | WNOWAIT | WNOHANG);
  if (!exited_in_time || waited != 0 || exited.si_pid != zombie) {
    kill(zombie, SIGKILL);
    waitpid(zombie, nullptr, 0);
    std::filesystem::remove_all(dir);
    FAIL() << "child " << zombie << " is not a zombie after 60 s (pidfd readable: " << exited_in_time
           << ", waitid: " << (waited == 0 ? "no exited child" : std::strerror(errno)) << ")";
  }
  const time_t now = std::time(nullptr);
  // A live process started now holds the pid of a name written 100 s ago.
  const pid_t sleeper = fork();
  ASSERT_GE(sleeper, 0);
  if (sleeper == 0) {
    sleep(60);
    _exit(0);
  }
  const std::string reused = make(sleeper, "1", now - 100);
  const std::string dead = make(zombie, "2", now);
  // This process wrote its name after it started.
  const std::string live = make(getpid(), "3", now);
  EXPECT_EQ(RemoveStaleSegments(dir, /*stale_after_s=*/0), 2);
  EXPECT_NE(access(reused.c_str(), F_OK), 0) << reused << " (a reused pid's) is still there";
  EXPECT_NE(access(dead.c_str(), F_OK), 0) << dead << " (a zombie's) is still there";
  EXPECT_EQ(access(live.c_str(), F_OK), 0) << live << " (this live process's) was removed";
  kill(sleeper, SIGKILL);
  waitpid(sleeper, nullptr, 0);
  waitpid(zombie, nullptr, 0);
  std::filesystem::remove_all(dir);
}

// A segment whose set-up runs past the stale age (10 minutes; a
// communicator's timeout may be raised to half an hour) while its creator
// looks gone here (it runs in another pid namespace sharing /dev/shm, or
// its pid names another process here) stays until the set-up deadline it
// was created with. Another group's rank 0 used to remove it at the stale
// age, and the late ranks then could not open it: the group went without
// shared memory. Here the creator looks gone because the name is made to
// look 20 minutes old, older than this process (so its pid looks reused).
TEST(ShmAllReduce, ASegmentStillBeingSetUpIsKeptPastTheStaleAgeUntilItsDeadline) {
  testing::InMemoryStore store;
  const Deadline deadline = DeadlineIn(milliseconds(30000));
  std::optional<StatusOr<std::unique_ptr<Segment>>> created;
  std::thread creator([&] { created = Segment::CreateShared(store, "late/", 0, 2, 4096, deadline); });
  auto name = store.Get("late/name", DeadlineIn(milliseconds(10000)));
  EXPECT_TRUE(name.ok()) << name.status();
  bool aged = false;
  if (name.ok()) {
    const int fd = shm_open(name->c_str(), O_RDWR, 0600);
    EXPECT_GE(fd, 0) << *name << ": " << std::strerror(errno);
    const time_t long_ago = std::time(nullptr) - 1200;
    const timespec times[2] = {{.tv_sec = long_ago, .tv_nsec = 0}, {.tv_sec = long_ago, .tv_nsec = 0}};
    aged = fd >= 0 && futimens(fd, times) == 0;
    EXPECT_TRUE(aged) << std::strerror(errno);
    if (fd >= 0) close(fd);
  }
  if (!aged) {
    // Lets the creator return instead of waiting for rank 1 until its deadline.
    store.Set("late/mapped/1", "!the test could not age the segment", deadline).IgnoreError();
    creator.join();
    return;
  }
  // What another group's rank 0 does before creating its own segment.
  RemoveStaleSegments();
  auto late = Segment::CreateShared(store, "late/", 1, 2, 4096, deadline);
  creator.join();
  EXPECT_TRUE(late.ok()) << late.status();
  ASSERT_TRUE(created.has_value());
  EXPECT_TRUE(created->ok()) << created->status();
}

// A rank whose local rank 0 never creates the segment times out saying
// what it waited for and from whom, as rank 0 does when a rank never maps
// it; it said only the store's words about its key.
TEST(ShmAllReduce, ARankWaitingForTheSegmentNamesLocalRankZero) {
  testing::InMemoryStore store;
  auto late = Segment::CreateShared(store, "absent/", 1, 2, 4096, DeadlineIn(milliseconds(100)));
  EXPECT_EQ(late.status().code(), StatusCode::kTimedOut) << late.status();
  EXPECT_NE(late.status().message().find(
                "shared-memory segment: waiting for local rank 0 to create it: "),
            std::string::npos)
      << late.status();
}

// A name that carries its set-up deadline goes once its creator is gone
// and the deadline is more than a minute past; before that it stays. Run
// in a folder of its own with a stale age of 0.
TEST(ShmAllReduce, StaleSegmentsGoOnlyPastTheDeadlineTheirNameCarries) {
  char pattern[] = "/tmp/shm_deadline_XXXXXX";
  const std::string dir = mkdtemp(pattern);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  const time_t now = std::time(nullptr);
  auto make = [&dir, child](const char* number, time_t deadline) {
    const std::string path =
        dir + "/ddp-" + std::to_string(child) + "-" + number + "-" + std::to_string(deadline);
    const int fd = open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << path << ": " << std::strerror(errno);
    if (fd >= 0) close(fd);
    return path;
  };
  const std::string past = make("1", now - 120);
  const std::string just_past = make("2", now - 5);
  const std::string ahead = make("3", now + 3600);
  EXPECT_EQ(RemoveStaleSegments(dir, /*stale_after_s=*/0), 1);
  EXPECT_NE(access(past.c_str(), F_OK), 0) << past << " is still there";
  EXPECT_EQ(access(just_past.c_str(), F_OK), 0) << just_past << " was removed";
  EXPECT_EQ(access(ahead.c_str(), F_OK), 0) << ahead << " was removed";
  std::filesystem::remove_all(dir);
}

// Staging limits and chunk sizes that differ between ranks (a rank with
// another DDP_SHM_STAGING_BYTES or chunk_bytes): rank 0's are in force on
// every rank, so that every call takes one path (staged or direct) on all
// ranks and the segment has one layout. Each rank's own used to give wrong
// results where one rank staged a call and another read it directly, and a
// rank whose staging area was larger than rank 0's mapped past the end of
// the segment (SIGBUS).
TEST(ShmAllReduce, RankZerosStagingAndChunkSizesAreInForceOnEveryRank) {
  struct Sizes {
    size_t staging_bytes;
    size_t chunk_bytes;
  };
  const std::vector<std::vector<Sizes>> groups = {
      {{4096, 1024}, {65536, 4096}},                    // one layout, other limits
      {{65536, 4096}, {4096, 1024}, {1024, 1024}},
      {{4096, 1024}, {2 << 20, 1024}, {4096, 1024}},   // rank 1: a larger staging area
      {{2 << 20, 64 << 10}, {4096, 1024}},              // rank 0: a larger staging area
  };
  for (const std::vector<Sizes>& sizes : groups) {
    const int n = static_cast<int>(sizes.size());
    testing::InMemoryStore store;
    std::vector<std::unique_ptr<ShmAllReduce>> group(n);
    RunRanks(n, [&](int r) {
      ShmOptions options{.rank = r, .size = n, .pids = std::vector<int>(n, getpid()),
                         .staging_bytes = sizes[r].staging_bytes,
                         .rooted_staging_bytes = sizes[r].staging_bytes,
                         .chunk_bytes = sizes[r].chunk_bytes, .yield_when_idle = true};
      auto engine = ShmAllReduce::Create(store, "shm/", options, DeadlineIn(milliseconds(10000)));
      ASSERT_TRUE(engine.ok()) << engine.status();
      group[r] = std::move(*engine);
    });
    ASSERT_TRUE(std::all_of(group.begin(), group.end(), [](const auto& g) { return g != nullptr; }));
    for (int r = 1; r < n; ++r) {
      EXPECT_EQ(group[r]->options().staging_bytes, group[0]->options().staging_bytes);
      EXPECT_EQ(group[r]->rooted_staging_bytes(), group[0]->rooted_staging_bytes());
      EXPECT_EQ(group[r]->options().chunk_bytes, group[0]->options().chunk_bytes);
      EXPECT_EQ(group[r]->max_staging_bytes(), group[0]->max_staging_bytes());
    }
    // Counts on either side of every rank's limits (floats).
    for (size_t count : {size_t{1}, size_t{1024}, size_t{1025}, size_t{16384}, size_t{16385},
                         size_t{262144}, size_t{262145}}) {
      const std::string what = std::to_string(n) + " ranks, rank 0 staging " +
                               std::to_string(sizes[0].staging_bytes) + ", count " +
                               std::to_string(count);
      RunRanks(n, [&](int r) {
        const Deadline deadline = DeadlineIn(milliseconds(10000));
        std::vector<float> data(count);
        FillInput(DataType::kF32, data.data(), count, r, ReduceOp::kSum);
        Status s = group[r]->AllReduce(data.data(), data.data(), count, DataType::kF32,
                                       ReduceOp::kSum, deadline, nullptr);
        ASSERT_TRUE(s.ok()) << what << ": " << s;
        std::string first;
        EXPECT_EQ(CountWrong(DataType::kF32, data.data(), count, n, ReduceOp::kSum, 0, &first), 0u)
            << "all-reduce, " << what << ": " << first;
        std::vector<float> root(count), out(count, -1.0f);
        FillInput(DataType::kF32, root.data(), count, r, ReduceOp::kSum);
        s = group[r]->Reduce(root.data(), out.data(), count, DataType::kF32, ReduceOp::kSum, 0,
                             deadline, nullptr);
        ASSERT_TRUE(s.ok()) << what << ": " << s;
        if (r == 0) {
          EXPECT_EQ(CountWrong(DataType::kF32, out.data(), count, n, ReduceOp::kSum, 0, &first), 0u)
              << "reduce, " << what << ": " << first;
        }
        FillInput(DataType::kF32, root.data(), count, r == 0 ? 0 : 9, ReduceOp::kMax);
        s = group[r]->Broadcast(root.data(), count, DataType::kF32, 0, deadline, nullptr);
        ASSERT_TRUE(s.ok()) << what << ": " << s;
        size_t wrong = 0;
        for (size_t i = 0; i < count; ++i) {
          wrong += root[i] != static_cast<float>(testing::InputValue(0, i, ReduceOp::kMax));
        }
        EXPECT_EQ(wrong, 0u) << "broadcast, " << what;
      });
    }
  }
}

TEST(ShmAllReduce, WatchdogEndsTheWait) {
  auto group = MakeGroup(2, 4096, 1024);
  float x = 1;
  int awaited = -1;
  Status s = group[0]->AllReduce(&x, &x, 1, DataType::kF32, ReduceOp::kSum,
                                 DeadlineIn(milliseconds(10000)), [&awaited](Deadline, int peer) {
                                   awaited = peer;
                                   return PeerLostError("rank 1 (pid 7) exited");
                                 });
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s;
  EXPECT_EQ(awaited, 1);
}

// A peer that did its part and then left (the watchdog reports it gone)
// does not fail a wait that has what it needs.
TEST(ShmAllReduce, WaitCompletesWhenTheGonePeerHadPublished) {
  auto group = MakeGroup(2, 4096, 1024);
  float x = 1;
  float y = 2;
  std::thread peer;
  // Rank 1 has arrived (published its part) once its own watchdog runs,
  // which happens only while it waits for rank 0, or once its call
  // returned (rank 0 is there already, so it need not wait: the flag used
  // to be set by the watchdog alone, and the test waited out AwaitFlag's
  // 10 s).
  std::atomic<bool> peer_arrived{false};
  Status s = group[0]->AllReduce(
      &x, &x, 1, DataType::kF32, ReduceOp::kSum, DeadlineIn(milliseconds(10000)),
      [&](Deadline, int) {
        if (!peer.joinable()) {
          peer = std::thread([&] {
            EXPECT_TRUE(group[1]->AllReduce(&y, &y, 1, DataType::kF32, ReduceOp::kSum,
                                            DeadlineIn(milliseconds(10000)),
                                            [&](Deadline, int) {
                                              peer_arrived = true;
                                              return Status::Ok();
                                            })
                            .ok());
            peer_arrived = true;
          });
          AwaitFlag(peer_arrived);  // it arrives meanwhile
        }
        return PeerLostError("rank 1 (pid 7) exited");
      });
  peer.join();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(x, 3.0f);
  EXPECT_EQ(y, 3.0f);
}

TEST(ShmAllReduce, BarrierThenAllReduce) {
  auto group = MakeGroup(3, 4096, 1024);
  RunRanks(3, [&](int r) {
    for (int round = 0; round < 20; ++round) {
      ASSERT_TRUE(group[r]->Barrier(DeadlineIn(milliseconds(5000)), nullptr).ok());
      std::vector<int32_t> v(round * 300);
      FillInput(DataType::kI32, v.data(), v.size(), r, ReduceOp::kSum);
      ASSERT_TRUE(group[r]->AllReduce(v.data(), v.data(), v.size(), DataType::kI32, ReduceOp::kSum,
                                      DeadlineIn(milliseconds(5000)), nullptr).ok());
      EXPECT_EQ(CountWrong(DataType::kI32, v.data(), v.size(), 3, ReduceOp::kSum), 0u);
    }
  });
}

// A rank slow to leave the barrier (here it naps in its watchdog while the
// others pass) still reads its peers' barrier arguments: a peer two calls
// on must wait for it before reusing that slot. It used to count as
// finished on entry, so rank 2's second reduce overwrote its arguments and
// rank 1 reported a barrier against a reduce.
TEST(ShmAllReduce, PeersTwoCallsOnWaitForARankStillLeavingTheBarrier) {
  auto group = MakeGroup(3, 4096, 1024);
  RunRanks(3, [&](int r) {
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    if (r != 1) std::this_thread::sleep_for(milliseconds(20));  // rank 1 arrives first
    bool napped = false;
    Status s = group[r]->Barrier(deadline, [&](Deadline, int) {
      if (r == 1 && !napped) {
        napped = true;
        std::this_thread::sleep_for(milliseconds(300));
      }
      return Status::Ok();
    });
    EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
    for (int call = 0; call < 2; ++call) {
      float x = 1, y = 0;
      s = group[r]->Reduce(&x, &y, 1, DataType::kF32, ReduceOp::kSum, 0, deadline, nullptr);
      EXPECT_TRUE(s.ok()) << "rank " << r << ", reduce " << call << ": " << s;
      if (r == 0) {
        EXPECT_EQ(y, 3.0f);
      }
    }
  });
}

TEST(ShmAllReduce, BarrierAgainstAllReduceIsAMismatch) {
  auto group = MakeGroup(2, 4096, 1024);
  RunRanks(2, [&](int r) {
    float x = 1;
    Status s = r == 0 ? group[r]->Barrier(DeadlineIn(milliseconds(300)), nullptr)
                      : group[r]->AllReduce(&x, &x, 1, DataType::kF32, ReduceOp::kSum,
                                            DeadlineIn(milliseconds(300)), nullptr);
    // Both ranks fail, the barrier too (it returned OK), naming both calls
    // (the all-reduce side used to be "passed count 1 f32 sum", unnamed).
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << s;
    EXPECT_NE(s.message().find("passed barrier"), std::string::npos) << s;
    EXPECT_NE(s.message().find("passed all-reduce count 1 f32 sum"), std::string::npos) << s;
  });
}

// Rank 0 refuses a staging size that would wrap the segment's size around
// (2^62 bytes gave a one-page segment that the first staged call overran).
TEST(ShmAllReduce, StagingBytesBeyondTheMostIsRefused) {
  testing::InMemoryStore store;
  ShmOptions options{.rank = 0, .size = 2, .pids = std::vector<int>(2, getpid()),
                     .staging_bytes = size_t{1} << 62};
  auto engine = ShmAllReduce::Create(store, "shm/", options, DeadlineIn(milliseconds(2000)));
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("DDP_SHM_STAGING_BYTES"), std::string::npos)
      << engine.status();
}

// Each bad group shape is named for what is wrong with it.
TEST(ShmAllReduce, BadGroupShapesAreNamed) {
  testing::InMemoryStore store;
  auto error = [&](int rank, int size, size_t pids) {
    ShmOptions options{.rank = rank, .size = size, .pids = std::vector<int>(pids, getpid())};
    auto engine = ShmAllReduce::Create(store, "shm/", options, DeadlineIn(milliseconds(2000)));
    return engine.ok() ? std::string("created") : engine.status().message();
  };
  EXPECT_EQ(error(0, 70000, 70000), "shared-memory group: rank 0: size 70000 is outside [1, 65534]");
  EXPECT_EQ(error(0, 0, 0), "shared-memory group: rank 0: size 0 is outside [1, 65534]");
  EXPECT_EQ(error(2, 2, 2), "shared-memory group: rank 2 is outside a group of 2");
  EXPECT_EQ(error(0, 2, 3), "shared-memory group: rank 0: 3 pids for a group of 2");
}

// A names list that is not one per rank is refused: it was taken as it
// came, and the ranks past its end were named by their group rank, the
// others by their job rank, so a message could name another process.
TEST(ShmAllReduce, NamesThatAreNotOnePerRankAreRefused) {
  testing::InMemoryStore store;
  auto error = [&](std::vector<int> names) {
    ShmOptions options{.rank = 0, .size = 3, .pids = std::vector<int>(3, getpid()),
                       .names = std::move(names)};
    auto engine = ShmAllReduce::Create(store, "names/", options, DeadlineIn(milliseconds(500)));
    return engine.ok() ? std::string("created") : engine.status().message();
  };
  EXPECT_EQ(error({4, 9}),
            "shared-memory group: local rank 0: 2 names for a group of 3 (one per rank, or none)");
  EXPECT_EQ(error({4, 9, 11, 12}),
            "shared-memory group: local rank 0: 4 names for a group of 3 (one per rank, or none)");
}

// One rank's bad options fail creation on every rank at once, with that
// rank's INVALID_ARGUMENT naming it and the option. (The bad rank returned
// at once while its peers waited for it in the segment's set-up until
// their deadline.)
TEST(ShmAllReduce, ABadOptionOfOneRankFailsCreationOnEveryRankAtOnce) {
  struct Bad {
    const char* what;
    std::function<void(ShmOptions&)> spoil;
    std::function<std::string(int)> message;  // of the bad rank, by its group rank
  };
  const std::vector<Bad> bads = {
      {"pids", [](ShmOptions& o) { o.pids.push_back(getpid()); },
       [](int b) { return "rank " + std::to_string(10 + b) + ": "; }},
      {"names", [](ShmOptions& o) { o.names.pop_back(); },
       [](int b) { return "local rank " + std::to_string(b) + ": "; }},
      {"staging_bytes", [](ShmOptions& o) { o.staging_bytes = size_t{1} << 62; },
       [](int b) {
         return "rank " + std::to_string(10 + b) + ": staging_bytes (DDP_SHM_STAGING_BYTES) of " +
                std::to_string(size_t{1} << 62) + " is more than the most";
       }},
      // Cross-memory attach to pid -5 failed with ESRCH, and creation said
      // UNAVAILABLE with "rank 1b (pid -5) exited": the caller fell back.
      {"pids", [](ShmOptions& o) { o.pids[static_cast<size_t>(o.rank)] = -5; },
       [](int b) {
         return "rank " + std::to_string(10 + b) + ": pids holds -5 for rank " +
                std::to_string(10 + b) + ", which is not a process id";
       }},
      // Each rank allocated a buffer of rank 0's chunk_bytes: std::length_error.
      {"chunk_bytes", [](ShmOptions& o) { o.chunk_bytes = SIZE_MAX; },
       [](int b) {
         return "rank " + std::to_string(10 + b) + ": chunk_bytes (DDP_SHM_CHUNK_BYTES) of " +
                std::to_string(SIZE_MAX) + " is more than the most";
       }},
      // Waits slept for no time between polls: a spin with a system call.
      {"watchdog_period", [](ShmOptions& o) { o.watchdog_period = milliseconds(0); },
       [](int b) {
         return "rank " + std::to_string(10 + b) + ": watchdog_period of 0 ms is not positive";
       }},
  };
  for (int n : {2, 3, 4}) {
    for (const Bad& bad : bads) {
      for (int b = 0; b < n; ++b) {
        testing::InMemoryStore store;
        std::vector<Status> statuses(n);
        const auto start = Clock::now();
        RunRanks(n, [&](int r) {
          ShmOptions options{.rank = r, .size = n, .pids = std::vector<int>(n, getpid())};
          for (int q = 0; q < n; ++q) options.names.push_back(10 + q);
          if (r == b) bad.spoil(options);
          statuses[r] =
              ShmAllReduce::Create(store, "shm/", options, DeadlineIn(kFailFastDeadline)).status();
        });
        const std::string where =
            std::to_string(n) + " ranks, bad " + bad.what + " on local rank " + std::to_string(b);
        // (ASSERT: one case that waits out the deadline is enough to show.)
        ASSERT_LT(Clock::now() - start, kFailFastDeadline / 2) << where;
        EXPECT_NE(statuses[b].message().find("shared-memory group: " + bad.message(b)),
                  std::string::npos)
            << where << ": " << statuses[b];
        EXPECT_NE(statuses[b].message().find(bad.what), std::string::npos)
            << where << ": " << statuses[b];
        for (int r = 0; r < n; ++r) {
          EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument)
              << where << ", rank " << r << ": " << statuses[r];
          EXPECT_EQ(statuses[r].message(), statuses[b].message()) << where << ", rank " << r;
        }
      }
    }
  }
}

// Ranks that disagree on the group's size fail at once on every rank: a
// rank outside its own group (rank 2 of 2) among ranks of a group of 3 is
// refused by all of them with its own message, and a rank that counts 2
// among ranks that count 3 fails with them, each naming both sizes.
TEST(ShmAllReduce, RanksThatDisagreeOnTheGroupSizeFailAtOnce) {
  auto create = [](const std::vector<int>& sizes) {
    testing::InMemoryStore store;
    const int n = static_cast<int>(sizes.size());
    std::vector<Status> statuses(n);
    RunRanks(n, [&](int r) {
      ShmOptions options{.rank = r, .size = sizes[r],
                         .pids = std::vector<int>(sizes[r], getpid())};
      statuses[r] =
          ShmAllReduce::Create(store, "shm/", options, DeadlineIn(kFailFastDeadline)).status();
    });
    return statuses;
  };
  auto start = Clock::now();
  std::vector<Status> outside = create({3, 3, 2});
  ASSERT_LT(Clock::now() - start, kFailFastDeadline / 2);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(outside[r].code(), StatusCode::kInvalidArgument) << outside[r];
    EXPECT_EQ(outside[r].message(), "shared-memory group: rank 2 is outside a group of 2")
        << "rank " << r;
  }
  start = Clock::now();
  std::vector<Status> fewer = create({2, 3, 3});
  ASSERT_LT(Clock::now() - start, kFailFastDeadline / 2);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(fewer[r].code(), StatusCode::kInvalidArgument) << fewer[r];
    EXPECT_NE(fewer[r].message().find("ranks disagree on the group's size"), std::string::npos)
        << fewer[r];
  }
  EXPECT_EQ(fewer[0].message(),
            "shared-memory group: ranks disagree on the group's size: rank 0 has 2, rank 1 has 3");
  EXPECT_EQ(fewer[1].message(),
            "shared-memory group: ranks disagree on the group's size: rank 1 has 3, rank 0 has 2");
}

// Buffers in shareable memory: peers copy with them through a mapping of
// the owner's memfd instead of CMA, with the same results; ranks whose
// buffers are not shareable mix with ones whose buffers are.
TEST(ShmAllReduce, ShareableBuffersAreCopiedThroughMappings) {
  for (int n : {2, 3}) {
    auto group = MakeGroup(n, 4096, 4096);
    for (DataType dtype : {DataType::kF32, DataType::kF64, DataType::kBF16, DataType::kI32}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        for (bool in_place : {true, false}) {
          // -1: every rank shareable; r: rank r's buffers are private.
          for (int private_rank : {-1, 0, n - 1}) {
            std::vector<uint64_t> before(n);
            for (int r = 0; r < n; ++r) before[r] = group[r]->mapped_copies();
            const size_t count = 50001;
            RunRanks(n, [&](int r) {
              const size_t bytes = count * DataTypeSize(dtype);
              const bool shareable = r != private_rank;
              std::vector<char> private_send(bytes), private_recv(bytes);
              void* send = private_send.data();
              void* recv = private_recv.data();
              if (shareable) {
                auto a = AllocateShareable(bytes);
                auto b = AllocateShareable(bytes);
                ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
                send = *a;
                recv = *b;
              }
              FillInput(dtype, send, count, r, op);
              void* out = in_place ? send : recv;
              Status st = group[r]->AllReduce(send, out, count, dtype, op,
                                              DeadlineIn(milliseconds(10000)), nullptr);
              ASSERT_TRUE(st.ok()) << st;
              std::string first;
              EXPECT_EQ(CountWrong(dtype, out, count, n, op, 0, &first), 0u)
                  << n << " ranks " << DataTypeName(dtype) << " " << ReduceOpName(op)
                  << (in_place ? " in place" : "") << ", private rank " << private_rank << ": "
                  << first;
              if (shareable) {
                EXPECT_TRUE(FreeShareable(send).ok());
                EXPECT_TRUE(FreeShareable(recv).ok());
              }
            });
            // A rank copies through mappings when some peer's buffers are
            // shareable (each rank copies with every peer).
            for (int r = 0; r < n; ++r) {
              const bool expect_mapped = private_rank == -1 || r == private_rank || n > 2;
              EXPECT_EQ(group[r]->mapped_copies() > before[r], expect_mapped)
                  << n << " ranks, rank " << r << ", private rank " << private_rank;
            }
          }
        }
      }
    }
  }
}

// Rank 1's input lies in shareable memory, but the fd number it publishes
// for it now holds a regular file of the same size (the owner closed the
// memfd and the number was reused). Rank 0 must not map that file as rank
// 1's input: it reads the input with CMA, and the sum is right.
TEST(ShmAllReduce, APublishedFdThatIsNoLongerAMemfdIsNotMapped) {
  auto group = MakeGroup(2, 4096, 4096);
  const size_t count = 5000;  // 20 KB of f32: the direct path
  const size_t bytes = count * sizeof(float);
  auto shareable = AllocateShareable(bytes);
  ASSERT_TRUE(shareable.ok()) << shareable.status();
  std::optional<ShareableRegion> region = FindShareable(*shareable, bytes);
  ASSERT_TRUE(region.has_value());
  const std::string path = std::string(std::getenv("TEST_TMPDIR") != nullptr
                                           ? std::getenv("TEST_TMPDIR") : "/tmp") +
                           "/not_a_memfd." + std::to_string(getpid());
  const int file = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(file, 0) << std::strerror(errno);
  unlink(path.c_str());
  ASSERT_EQ(ftruncate(file, static_cast<off_t>(region->size)), 0);
  // The memfd's number now names the file; the mapping keeps the memory.
  ASSERT_EQ(dup2(file, region->fd), region->fd) << std::strerror(errno);
  close(file);
  const uint64_t before = group[0]->mapped_copies();
  RunRanks(2, [&](int r) {
    std::vector<float> private_send(count);
    float* send = r == 1 ? static_cast<float*>(*shareable) : private_send.data();
    std::vector<float> recv(count);
    FillInput(DataType::kF32, send, count, r, ReduceOp::kSum);
    Status st = group[r]->AllReduce(send, recv.data(), count, DataType::kF32, ReduceOp::kSum,
                                    DeadlineIn(milliseconds(10000)), nullptr);
    ASSERT_TRUE(st.ok()) << st;
    std::string first;
    EXPECT_EQ(CountWrong(DataType::kF32, recv.data(), count, 2, ReduceOp::kSum, 0, &first), 0u)
        << "rank " << r << ": " << first;
  });
  EXPECT_EQ(group[0]->mapped_copies(), before) << "rank 0 mapped a file that is not a memfd";
  EXPECT_TRUE(FreeShareable(*shareable).ok());
}

// The fd number rank 1 published for its shareable input now holds a
// file that an open blocks on: one under a write lease, whose break holds
// an open for /proc/sys/fs/lease-break-time (45 s by default). Rank 0
// opened it without O_NONBLOCK and waited that long inside the call, past
// both ranks' deadlines; now the file is not opened (it is no shareable
// memfd: see the next test) and the input is read with CMA.
TEST(ShmAllReduce, APublishedFdThatBlocksAnOpenIsNotWaitedFor) {
  auto group = MakeGroup(2, 4096, 4096);
  const size_t count = 5000;  // 20 KB of f32: the direct path
  const size_t bytes = count * sizeof(float);
  auto shareable = AllocateShareable(bytes);
  ASSERT_TRUE(shareable.ok()) << shareable.status();
  std::optional<ShareableRegion> region = FindShareable(*shareable, bytes);
  ASSERT_TRUE(region.has_value());
  const std::string path = std::string(std::getenv("TEST_TMPDIR") != nullptr
                                           ? std::getenv("TEST_TMPDIR") : "/tmp") +
                           "/leased." + std::to_string(getpid());
  const int file = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(file, 0) << std::strerror(errno);
  unlink(path.c_str());
  ASSERT_EQ(ftruncate(file, static_cast<off_t>(region->size)), 0);
  ASSERT_EQ(dup2(file, region->fd), region->fd) << std::strerror(errno);
  close(file);
  // The lease's break signals its holder, this process: SIGIO would end it.
  struct sigaction ignore {}, saved {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGIO, &ignore, &saved), 0);
  ASSERT_EQ(fcntl(region->fd, F_SETLEASE, F_WRLCK), 0) << "write lease: " << std::strerror(errno);
  const auto start = Clock::now();
  RunRanks(2, [&](int r) {
    std::vector<float> private_send(count);
    float* send = r == 1 ? static_cast<float*>(*shareable) : private_send.data();
    std::vector<float> recv(count);
    FillInput(DataType::kF32, send, count, r, ReduceOp::kSum);
    Status st = group[r]->AllReduce(send, recv.data(), count, DataType::kF32, ReduceOp::kSum,
                                    DeadlineIn(milliseconds(10000)), nullptr);
    ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st;
    std::string first;
    EXPECT_EQ(CountWrong(DataType::kF32, recv.data(), count, 2, ReduceOp::kSum, 0, &first), 0u)
        << "rank " << r << ": " << first;
  });
  EXPECT_LT(Clock::now() - start, milliseconds(5000)) << "the open waited for the lease's break";
  EXPECT_TRUE(FreeShareable(*shareable).ok());
  sigaction(SIGIO, &saved, nullptr);
}

std::atomic<int> sigio_seen{0};

// The same file under a write lease whose holder takes SIGIO (counted
// here; its default action ends the process): O_NONBLOCK kept rank 0's
// open from waiting, but the open still broke the lease and signalled the
// holder. Now the published number's link and size are looked at first
// (neither opens the file), and a file that is not a shareable memfd of
// the region's size is not opened at all: the lease stands, no signal.
TEST(ShmAllReduce, APublishedFdThatNamesAnotherFileIsNotOpened) {
  auto group = MakeGroup(2, 4096, 4096);
  const size_t count = 5000;  // 20 KB of f32: the direct path
  const size_t bytes = count * sizeof(float);
  auto shareable = AllocateShareable(bytes);
  ASSERT_TRUE(shareable.ok()) << shareable.status();
  std::optional<ShareableRegion> region = FindShareable(*shareable, bytes);
  ASSERT_TRUE(region.has_value());
  const std::string path = std::string(std::getenv("TEST_TMPDIR") != nullptr
                                           ? std::getenv("TEST_TMPDIR") : "/tmp") +
                           "/leased_unopened." + std::to_string(getpid());
  const int file = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(file, 0) << std::strerror(errno);
  unlink(path.c_str());
  ASSERT_EQ(ftruncate(file, static_cast<off_t>(region->size)), 0);
  ASSERT_EQ(dup2(file, region->fd), region->fd) << std::strerror(errno);
  close(file);
  struct sigaction count_it {}, saved {};
  count_it.sa_handler = [](int) { sigio_seen.fetch_add(1); };
  ASSERT_EQ(sigaction(SIGIO, &count_it, &saved), 0);
  sigio_seen = 0;
  ASSERT_EQ(fcntl(region->fd, F_SETLEASE, F_WRLCK), 0) << "write lease: " << std::strerror(errno);
  RunRanks(2, [&](int r) {
    std::vector<float> private_send(count);
    float* send = r == 1 ? static_cast<float*>(*shareable) : private_send.data();
    std::vector<float> recv(count);
    FillInput(DataType::kF32, send, count, r, ReduceOp::kSum);
    Status st = group[r]->AllReduce(send, recv.data(), count, DataType::kF32, ReduceOp::kSum,
                                    DeadlineIn(milliseconds(10000)), nullptr);
    ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st;
    std::string first;
    EXPECT_EQ(CountWrong(DataType::kF32, recv.data(), count, 2, ReduceOp::kSum, 0, &first), 0u)
        << "rank " << r << ": " << first;
  });
  // A lease being broken reads as the type it is broken to (F_UNLCK).
  EXPECT_EQ(fcntl(region->fd, F_GETLEASE), F_WRLCK) << "the open broke the lease";
  EXPECT_EQ(sigio_seen.load(), 0) << "the lease's holder was signalled";
  fcntl(region->fd, F_SETLEASE, F_UNLCK);
  sigaction(SIGIO, &saved, nullptr);
  EXPECT_TRUE(FreeShareable(*shareable).ok());
}

// More regions than the mapping cache holds (64), each used once and then
// freed, while one long-lived region is used every call: the freed ones
// are unmapped at their owner's next call, without wrong results.
TEST(ShmAllReduce, ShareableMappingsAreEvictedAndRemapped) {
  auto group = MakeGroup(2, 4096, 4096);
  const size_t count = 5000;  // 20 KB of f32: the direct path
  RunRanks(2, [&](int r) {
    auto kept = AllocateShareable(count * sizeof(float));
    ASSERT_TRUE(kept.ok()) << kept.status();
    for (int round = 0; round < 80; ++round) {
      auto fresh = AllocateShareable(count * sizeof(float));
      ASSERT_TRUE(fresh.ok()) << fresh.status();
      for (void* buffer : {*fresh, *kept}) {
        FillInput(DataType::kF32, buffer, count, r, ReduceOp::kSum);
        Status st = group[r]->AllReduce(buffer, buffer, count, DataType::kF32, ReduceOp::kSum,
                                        DeadlineIn(milliseconds(10000)), nullptr);
        ASSERT_TRUE(st.ok()) << st;
        std::string first;
        ASSERT_EQ(CountWrong(DataType::kF32, buffer, count, 2, ReduceOp::kSum, 0, &first), 0u)
            << "round " << round << ": " << first;
      }
      // The peer may still copy with it until both finished the call.
      ASSERT_TRUE(group[r]->Barrier(DeadlineIn(milliseconds(10000)), nullptr).ok());
      ASSERT_TRUE(FreeShareable(*fresh).ok());
    }
    ASSERT_TRUE(FreeShareable(*kept).ok());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_GE(group[r]->mapped_copies(), 160u);
    // The last round's two regions (freed, but no call since told it).
    EXPECT_LE(group[r]->mapping_stats().regions, 2u);
  }
}

// Mappings of this process's shareable memory (the owners' and the peers').
int ShareableMappingsInThisProcess() {
  std::FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return -1;
  int n = 0;
  char line[4096];
  while (std::fgets(line, sizeof(line), maps) != nullptr) {
    n += std::strstr(line, "/memfd:ddp-shareable") != nullptr;
  }
  std::fclose(maps);
  return n;
}

// DDP's bucket rebuild: each rank frees the buffers it all-reduced so far
// and all-reduces new ones. The peers' mappings of the old buffers go at
// the owners' next call, so no rank keeps the dead buckets' pages alive.
// (They used to stay mapped for the rest of the job: the cache evicted only
// on a miss, and after the first calls on the new buffers every lookup hit.)
TEST(ShmAllReduce, MappingsOfFreedBuffersGoAtTheOwnersNextCall) {
  for (int n : {2, 3}) {
    auto group = MakeGroup(n, 4096, 4096);
    const size_t count = 5000;  // 20 KB of f32: the direct path
    const size_t buckets = 4;
    const int before = ShareableMappingsInThisProcess();
    std::vector<std::vector<void*>> owned(n);
    auto all_reduce_buckets = [&](int r) {
      for (int round = 0; round < 3; ++round) {
        for (void* bucket : owned[r]) {
          FillInput(DataType::kF32, bucket, count, r, ReduceOp::kSum);
          Status st = group[r]->AllReduce(bucket, bucket, count, DataType::kF32, ReduceOp::kSum,
                                          DeadlineIn(milliseconds(10000)), nullptr);
          ASSERT_TRUE(st.ok()) << st;
          std::string first;
          ASSERT_EQ(CountWrong(DataType::kF32, bucket, count, n, ReduceOp::kSum, 0, &first), 0u)
              << first;
        }
      }
    };
    auto allocate = [&](int r) {
      for (size_t b = 0; b < buckets; ++b) {
        auto p = AllocateShareable(count * sizeof(float));
        ASSERT_TRUE(p.ok()) << p.status();
        owned[r].push_back(*p);
      }
    };
    RunRanks(n, [&](int r) {
      allocate(r);
      all_reduce_buckets(r);
    });
    // Each rank: its own buckets, and every peer's.
    const int expected = static_cast<int>(n * buckets + n * (n - 1) * buckets);
    EXPECT_EQ(ShareableMappingsInThisProcess() - before, expected) << n << " ranks";
    const uint64_t region_bytes = group[0]->mapping_stats().bytes / ((n - 1) * buckets);
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(group[r]->mapping_stats().regions, (n - 1) * buckets) << "rank " << r;
    }
    // The rebuild.
    RunRanks(n, [&](int r) {
      for (void* bucket : owned[r]) ASSERT_TRUE(FreeShareable(bucket).ok());
      owned[r].clear();
      allocate(r);
      all_reduce_buckets(r);
    });
    EXPECT_EQ(ShareableMappingsInThisProcess() - before, expected)
        << n << " ranks: the old buckets are still mapped";
    for (int r = 0; r < n; ++r) {
      const ShmAllReduce::MappingStats stats = group[r]->mapping_stats();
      EXPECT_EQ(stats.regions, (n - 1) * buckets) << "rank " << r;
      EXPECT_EQ(stats.bytes, (n - 1) * buckets * region_bytes) << "rank " << r;
      EXPECT_EQ(stats.maps, 2 * (n - 1) * buckets) << "rank " << r;
    }
    RunRanks(n, [&](int r) {
      for (void* bucket : owned[r]) ASSERT_TRUE(FreeShareable(bucket).ok());
    });
  }
}

// Each rank all-reduces, in turn, more live buffers than the cache holds
// per peer (64). The cache keeps the first 64 of each peer mapped and
// copies with the rest through CMA, instead of mapping and unmapping a
// region at every access (it used to, FIFO with 64 regions for all peers
// together: every access missed). Regions unused for 1000 calls make room
// for new ones.
TEST(ShmAllReduce, WorkingSetOverTheMappingCapDoesNotThrash) {
  const int n = 3;
  auto group = MakeGroup(n, 4096, 4096);
  const size_t count = 2048;  // 8 KB of f32: the direct path
  const size_t buffers = 70;
  std::vector<std::vector<void*>> owned(n);
  auto all_reduce = [&](int r, void* buffer) {
    FillInput(DataType::kF32, buffer, count, r, ReduceOp::kSum);
    Status st = group[r]->AllReduce(buffer, buffer, count, DataType::kF32, ReduceOp::kSum,
                                    DeadlineIn(milliseconds(10000)), nullptr);
    ASSERT_TRUE(st.ok()) << st;
    std::string first;
    ASSERT_EQ(CountWrong(DataType::kF32, buffer, count, n, ReduceOp::kSum, 0, &first), 0u) << first;
  };
  RunRanks(n, [&](int r) {
    for (size_t b = 0; b < buffers; ++b) {
      auto p = AllocateShareable(count * sizeof(float));
      ASSERT_TRUE(p.ok()) << p.status();
      owned[r].push_back(*p);
    }
    for (int round = 0; round < 3; ++round) {
      for (void* buffer : owned[r]) all_reduce(r, buffer);
    }
  });
  for (int r = 0; r < n; ++r) {
    const ShmAllReduce::MappingStats stats = group[r]->mapping_stats();
    EXPECT_EQ(stats.regions, (n - 1) * 64u) << "rank " << r;
    EXPECT_EQ(stats.maps, (n - 1) * 64u) << "rank " << r << ": regions were mapped again";
  }
  // 1000 calls later the mapped regions are idle: new ones take their place.
  RunRanks(n, [&](int r) {
    for (int i = 0; i < 1001; ++i) {
      ASSERT_TRUE(group[r]->Barrier(DeadlineIn(milliseconds(10000)), nullptr).ok());
    }
    auto p = AllocateShareable(count * sizeof(float));
    ASSERT_TRUE(p.ok()) << p.status();
    all_reduce(r, *p);
    owned[r].push_back(*p);
  });
  for (int r = 0; r < n; ++r) {
    const ShmAllReduce::MappingStats stats = group[r]->mapping_stats();
    EXPECT_EQ(stats.regions, (n - 1) * 64u) << "rank " << r;
    EXPECT_EQ(stats.maps, (n - 1) * 65u) << "rank " << r;
  }
  RunRanks(n, [&](int r) {
    for (void* buffer : owned[r]) ASSERT_TRUE(FreeShareable(buffer).ok());
  });
}

// A size that does not fit in whole pages fails, naming it, instead of
// wrapping around to a one-page region (it used to: SIZE_MAX rounded up to
// a page is 0, and the minimum made that one page).
TEST(Shareable, SizeThatOverflowsWholePagesFails) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (size_t bytes : {SIZE_MAX, SIZE_MAX - page + 2}) {
    auto p = AllocateShareable(bytes);
    EXPECT_FALSE(p.ok()) << bytes << " bytes gave a region";
    if (p.ok()) {
      EXPECT_TRUE(FreeShareable(*p).ok());
      continue;
    }
    EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted) << p.status();
    EXPECT_NE(p.status().message().find("shareable memory: " + std::to_string(bytes) + " bytes"),
              std::string::npos)
        << p.status();
  }
}

TEST(Shareable, FindsTheRegionHoldingARangeAndFreesIt) {
  auto p = AllocateShareable(10000);
  ASSERT_TRUE(p.ok()) << p.status();
  char* base = static_cast<char*>(*p);
  const auto whole = FindShareable(base, 10000);
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->base, reinterpret_cast<uint64_t>(base));
  EXPECT_EQ(whole->size % 4096, 0u);
  EXPECT_GE(whole->size, 10000u);
  EXPECT_GE(whole->fd, 0);
  EXPECT_NE(whole->id, 0u);
  EXPECT_TRUE(FindShareable(base + 100, 50).has_value());
  // Straddling the end, or outside: none.
  EXPECT_FALSE(FindShareable(base + whole->size - 8, 16).has_value());
  int local = 0;
  EXPECT_FALSE(FindShareable(&local, sizeof(local)).has_value());
  // Zero-filled, writable.
  EXPECT_EQ(base[9999], 0);
  base[9999] = 7;
  auto q = AllocateShareable(1);
  ASSERT_TRUE(q.ok());
  EXPECT_NE(FindShareable(*q, 1)->id, whole->id);
  EXPECT_TRUE(FreeShareable(base).ok());
  EXPECT_FALSE(FindShareable(base, 1).has_value());
  const Status again = FreeShareable(base);
  EXPECT_EQ(again.code(), StatusCode::kInvalidArgument) << again;
  EXPECT_NE(again.message().find("AllocateShareable"), std::string::npos) << again;
  EXPECT_TRUE(FreeShareable(*q).ok());
  EXPECT_TRUE(FreeShareable(nullptr).ok());
}

}  // namespace
}  // namespace ddp::transport::shm
