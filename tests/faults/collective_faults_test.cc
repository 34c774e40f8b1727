// Every collective meets a peer that dies (SIGKILL), one that stops
// (SIGSTOP, a hang) and one that is merely slow: with three ranks on one
// host, rank 2 is the faulty one, right after a barrier that formed the
// job. The other ranks' call must fail (PEER_LOST or TIMED_OUT) within the
// call's deadline plus a margin when the peer died or hangs, and
// succeed with the right result when it is only late.

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "transport/communicator.h"
#include "transport/testing/expected_values.h"
#include "transport/testing/process_group.h"

namespace ddp::transport {
namespace {

using namespace std::chrono_literals;
using testing::EnvOr;

constexpr int kRanks = 3;
constexpr int kVictim = 2;
// The faulty call's deadline. Only that call has it: creating the job and
// the first barrier run under kSetupTimeout, so a loaded machine that is
// slow to start three processes and bring up UCX does not fail the test.
constexpr auto kTimeout = 3000ms;
constexpr auto kSetupTimeout = 20000ms;
// Past the deadline: a rank may notice a death only at it, then leaves.
constexpr auto kMargin = 5000ms;
constexpr size_t kCount = 1000;
const char* const kKinds[] = {"all_reduce", "broadcast", "all_gather",
                              "reduce_scatter", "barrier", "send_recv"};

// One call of `kind` on every rank (send_recv: every survivor receives from
// the victim, which sends to each); returns its status and, for the
// all-reduce, counts wrong elements into `wrong`.
Status Collective(Communicator& comm, const std::string& kind, size_t* wrong) {
  const int me = comm.rank();
  const CallOptions call{.timeout = kTimeout};
  std::vector<float> in(kCount * kRanks), out(kCount * kRanks);
  testing::FillInput(DataType::kF32, in.data(), in.size(), me, ReduceOp::kSum);
  if (kind == "all_reduce") {
    Status s = comm.AllReduce(in.data(), out.data(), kCount, DataType::kF32, ReduceOp::kSum, call);
    if (s.ok()) *wrong = testing::CountWrong(DataType::kF32, out.data(), kCount, kRanks, ReduceOp::kSum);
    return s;
  }
  if (kind == "broadcast") return comm.Broadcast(in.data(), kCount, DataType::kF32, kVictim, call);
  if (kind == "all_gather") return comm.AllGather(in.data(), out.data(), kCount, DataType::kF32, call);
  if (kind == "reduce_scatter") {
    return comm.ReduceScatter(in.data(), out.data(), kCount, DataType::kF32, ReduceOp::kSum, call);
  }
  if (kind == "barrier") return comm.Barrier(call);
  if (me == kVictim) {
    for (int peer = 0; peer < kRanks; ++peer) {
      if (peer == kVictim) continue;
      DDP_RETURN_IF_ERROR(comm.Send(in.data(), kCount, DataType::kF32, peer, 7, call));
    }
    return Status::Ok();
  }
  return comm.Recv(out.data(), kCount, DataType::kF32, kVictim, 7, call);
}

// DDP_TEST_SCENARIO is "<fault>:<kind>", the fault one of kill, stop, slow.
int RunScenario(const std::string& name) {
  const size_t colon = name.find(':');
  if (colon == std::string::npos) return 2;
  const std::string fault = name.substr(0, colon), kind = name.substr(colon + 1);
  CommunicatorOptions defaults;
  defaults.timeout = kSetupTimeout;
  auto comm = Communicator::CreateFromEnvironment(defaults);
  if (!comm.ok()) {
    std::fprintf(stderr, "create: %s\n", comm.status().ToString().c_str());
    return 3;
  }
  const int me = (*comm)->rank();
  if (Status s = (*comm)->Barrier(); !s.ok()) {
    std::fprintf(stderr, "rank %d: first barrier: %s\n", me, s.ToString().c_str());
    return 4;
  }
  if (me == kVictim && fault == "kill") kill(getpid(), SIGKILL);
  if (me == kVictim && fault == "stop") raise(SIGSTOP);  // the test kills it later
  if (me == kVictim && fault == "slow") std::this_thread::sleep_for(500ms);
  const auto start = std::chrono::steady_clock::now();
  size_t wrong = 0;
  const Status s = Collective(**comm, kind, &wrong);
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  std::printf("rank %d %s after %s: %s in %lld ms\n", me, kind.c_str(), fault.c_str(),
              s.ToString().c_str(), static_cast<long long>(took.count()));
  std::fflush(stdout);
  if (fault == "slow") {
    WORKER_CHECK(s.ok(), "a late peer failed the call: " + s.ToString());
    WORKER_CHECK(wrong == 0, std::to_string(wrong) + " wrong elements");
  } else {
    WORKER_CHECK(s.code() == StatusCode::kPeerLost || s.code() == StatusCode::kTimedOut,
                 "expected PEER_LOST or TIMED_OUT, got " + s.ToString());
    WORKER_CHECK(took <= kTimeout + kMargin, "the call took " + std::to_string(took.count()) + " ms");
  }
  std::printf("rank %d done\n", me);
  std::fflush(stdout);
  return 0;
}

class CollectiveFaults : public ::testing::TestWithParam<const char*> {};

TEST_P(CollectiveFaults, ADeadPeerFailsTheCallOnEveryOtherRankWithinTheDeadline) {
  const testing::Job job = testing::RunJob(kRanks, std::string("kill:") + GetParam(), {}, 60000ms);
  for (int r = 0; r < kRanks; ++r) {
    if (r == kVictim) {
      EXPECT_EQ(job.results[r].signal, SIGKILL) << job.Describe();
    } else {
      EXPECT_EQ(job.results[r].exit_code, 0) << job.Describe();
      EXPECT_FALSE(job.results[r].timed_out) << job.Describe();
    }
  }
}

TEST_P(CollectiveFaults, AStoppedPeerFailsTheCallOnEveryOtherRankWithinTheDeadline) {
  const testing::Job job = testing::RunJob(
      kRanks, std::string("stop:") + GetParam(), {}, 60000ms, [](testing::ProcessGroup& group, int) {
        // Once the others are through their call, the stopped rank goes.
        group.WaitForOutput("done", DeadlineIn(60000ms), {0, 1});
        group.Kill(kVictim, SIGKILL);
      });
  for (int r = 0; r < kRanks; ++r) {
    if (r == kVictim) continue;
    EXPECT_EQ(job.results[r].exit_code, 0) << job.Describe();
    EXPECT_FALSE(job.results[r].timed_out) << job.Describe();
  }
}

TEST_P(CollectiveFaults, ASlowPeerIsWaitedFor) {
  const testing::Job job = testing::RunJob(kRanks, std::string("slow:") + GetParam(), {}, 60000ms);
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(job.results[r].exit_code, 0) << job.Describe();
}

INSTANTIATE_TEST_SUITE_P(EveryCollective, CollectiveFaults, ::testing::ValuesIn(kKinds),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace ddp::transport

int main(int argc, char** argv) {
  return ddp::transport::testing::WorkerOrTestsMain(argc, argv, ddp::transport::RunScenario);
}
