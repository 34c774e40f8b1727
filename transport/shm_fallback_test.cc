// The shared-memory path is refused on every rank alike, and the job runs
// over UCX, when one rank cannot create or map the segment. Real processes
// (the test binary spawns copies of itself as the ranks of a one-host job,
// DDP_TEST_SCENARIO names what they run), some of them in a mount namespace
// of their own whose /dev/shm is another tmpfs (empty, read-only or
// small), as containers on one machine can have. Needs root
// (CAP_SYS_ADMIN), as CI runs it.

#include <sys/mount.h>
#include <sched.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "transport/communicator.h"
#include "transport/testing/expected_values.h"
#include "transport/testing/process_group.h"

namespace ddp::transport {
namespace {

using std::chrono::milliseconds;
using testing::CountWrong;
using testing::EnvOr;
using testing::FillInput;
using testing::Job;
using testing::RunJob;

// ------------------------------------------------------------ workers ----

// Gives this process a /dev/shm of its own: a fresh tmpfs mounted with
// `spec` ("ro" first: read-only; the rest, tmpfs options such as
// "size=16m"), in a mount namespace of its own, so nothing changes outside.
// Children spawned later share it.
std::string MountPrivateShm(std::string spec) {
  unsigned long flags = MS_NOSUID | MS_NODEV;
  if (spec.rfind("ro", 0) == 0) {
    flags |= MS_RDONLY;
    spec = spec.substr(spec.size() > 2 && spec[2] == ',' ? 3 : 2);
  }
  if (unshare(CLONE_NEWNS) != 0) {
    return std::string("unshare(CLONE_NEWNS): ") + std::strerror(errno) + " (this test needs root)";
  }
  // Mounts made here must not propagate to the namespace we came from.
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return std::string("making / private: ") + std::strerror(errno);
  }
  if (mount("tmpfs", "/dev/shm", "tmpfs", flags, spec.empty() ? nullptr : spec.c_str()) != 0) {
    return "mounting a tmpfs (" + spec + ") on /dev/shm: " + std::strerror(errno);
  }
  return "";
}

// DDP_TEST_PRIVATE_SHM: this rank's own /dev/shm (see MountPrivateShm).
// Creates the communicator, says whether it took shared memory, and runs
// all-reduces of 1, 1001, 65536 and DDP_TEST_BIG_COUNT floats (twice each,
// so that both staging buffers of a rank are used).
int ScenarioAllReduce() {
  if (const std::string spec = EnvOr("DDP_TEST_PRIVATE_SHM"); !spec.empty()) {
    if (const std::string error = MountPrivateShm(spec); !error.empty()) {
      std::printf("SETUP %s\n", error.c_str());
      return 4;
    }
  }
  CommunicatorOptions options;
  options.timeout = milliseconds(std::atoi(EnvOr("DDP_TEST_TIMEOUT_MS", "20000").c_str()));
  const auto start = Clock::now();
  auto comm = Communicator::CreateFromEnvironment(options);
  const long long ms =
      std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  if (!comm.ok()) {
    std::printf("CREATE %s ms=%lld\n", comm.status().ToString().c_str(), ms);
    return 2;
  }
  const CommunicatorInfo& info = (*comm)->info();
  std::printf("SHM %d ms=%lld\n", info.shared_memory ? 1 : 0, ms);
  std::printf("REASON %s\n", info.shared_memory_unavailable.c_str());
  std::fflush(stdout);
  const int n = (*comm)->size();
  std::vector<size_t> counts = {1, 1001, 65536};
  if (const size_t big = std::strtoull(EnvOr("DDP_TEST_BIG_COUNT", "0").c_str(), nullptr, 10)) {
    counts.push_back(big);
  }
  for (size_t count : counts) {
    for (int round = 0; round < 2; ++round) {
      std::vector<float> data(count);
      FillInput(DataType::kF32, data.data(), count, (*comm)->rank(), ReduceOp::kSum);
      const Status s = (*comm)->AllReduce(data.data(), count, DataType::kF32, ReduceOp::kSum);
      const std::string what = "all-reduce of " + std::to_string(count) + " floats";
      WORKER_CHECK(s.ok(), what + ": " + s.ToString());
      std::string first;
      WORKER_CHECK(s.ok() && CountWrong(DataType::kF32, data.data(), count, n, ReduceOp::kSum, 0,
                                        &first) == 0,
                   what + ": " + first);
    }
  }
  return testing::worker_failures == 0 ? 0 : 1;
}

// A machine whose /dev/shm is DDP_TEST_HOST_SHM (see MountPrivateShm) for
// a whole job: this process mounts it, runs DDP_TEST_INNER_RANKS ranks of
// ScenarioAllReduce under it, and prints how each ended.
int ScenarioHost() {
  if (const std::string error = MountPrivateShm(EnvOr("DDP_TEST_HOST_SHM")); !error.empty()) {
    std::printf("SETUP %s\n", error.c_str());
    return 4;
  }
  const int ranks = std::atoi(EnvOr("DDP_TEST_INNER_RANKS", "2").c_str());
  const Job job = RunJob(ranks, "allreduce", {}, milliseconds(60000));
  // For InnerJob: each rank's ending, then its output line by line.
  for (size_t r = 0; r < job.results.size(); ++r) {
    const testing::WorkerResult& result = job.results[r];
    std::printf("INNER %zu %d %d %d\n", r, result.exit_code, result.signal, result.timed_out ? 1 : 0);
    size_t begin = 0;
    while (begin < result.output.size()) {
      const size_t end = std::min(result.output.find('\n', begin), result.output.size());
      std::printf("[%zu] %s\n", r, result.output.substr(begin, end - begin).c_str());
      begin = end + 1;
    }
  }
  return 0;
}

int RunScenario(const std::string& name) {
  if (name == "allreduce") return ScenarioAllReduce();
  if (name == "host") return ScenarioHost();
  std::fprintf(stderr, "unknown scenario %s\n", name.c_str());
  return 2;
}

// ------------------------------------------------------------- parent ----

// The text after `key` up to the end of its line in `output`, or "<none>".
std::string LineAfter(const std::string& output, const std::string& key) {
  const size_t at = output.find(key);
  if (at == std::string::npos) return "<none>";
  const size_t end = output.find('\n', at);
  return output.substr(at + key.size(), end == std::string::npos ? std::string::npos
                                                                  : end - at - key.size());
}

// The job ScenarioHost ran, from its output.
Job InnerJob(const std::string& output) {
  Job job;
  size_t begin = 0;
  while (begin < output.size()) {
    const size_t end = std::min(output.find('\n', begin), output.size());
    const std::string line = output.substr(begin, end - begin);
    begin = end + 1;
    size_t r = 0;
    int exit_code = 0, signal = 0, timed_out = 0, skip = 0;
    if (std::sscanf(line.c_str(), "INNER %zu %d %d %d", &r, &exit_code, &signal, &timed_out) == 4) {
      job.results.resize(std::max(job.results.size(), r + 1));
      job.results[r].exit_code = exit_code;
      job.results[r].signal = signal;
      job.results[r].timed_out = timed_out != 0;
    } else if (std::sscanf(line.c_str(), "[%zu] %n", &r, &skip) == 1 && skip > 0 &&
               r < job.results.size()) {
      job.results[r].output += line.substr(static_cast<size_t>(skip)) + "\n";
    }
  }
  return job;
}

// The environment of every job here. UCX keeps its own shared memory in
// files of a directory every rank sees (peers open them through /proc), so
// that only the segment of the shared-memory path depends on /dev/shm.
testing::ProcessGroup::Env JobEnv() {
  return {{"DDP_TEST_TIMEOUT_MS", "20000"}, {"UCX_POSIX_DIR", ::testing::TempDir()}};
}

// Every rank created its communicator well before the 20 s deadline,
// without shared memory, for the same reason, which holds `cause`, and got
// every all-reduce right over UCX.
void ExpectEveryRankFellBack(const Job& job, const std::string& cause) {
  const std::string reason = LineAfter(job.results[0].output, "REASON ");
  EXPECT_NE(reason.find(cause), std::string::npos) << job.Describe();
  for (const auto& result : job.results) {
    EXPECT_EQ(result.exit_code, 0) << job.Describe();
    EXPECT_NE(result.output.find("SHM 0 "), std::string::npos) << job.Describe();
    EXPECT_LT(std::atoi(LineAfter(result.output, " ms=").c_str()), 10000) << job.Describe();
    EXPECT_EQ(LineAfter(result.output, "REASON "), reason) << job.Describe();
  }
}

// Local rank 0 cannot create the segment (its /dev/shm is read-only): the
// others, which used to wait for its name until the deadline and fail,
// learn it at once and go without shared memory as it does.
TEST(SharedMemoryFallback, RankZeroThatCannotCreateTheSegment) {
  Job job = RunJob(3, "allreduce", JobEnv(), milliseconds(60000),
                   nullptr, {{0, {{"DDP_TEST_PRIVATE_SHM", "ro"}}}});
  ASSERT_EQ(job.results.size(), 3u);
  ExpectEveryRankFellBack(job, "local rank 0: creating /dev/shm/ddp-");
  EXPECT_NE(job.results[0].output.find("Read-only file system"), std::string::npos)
      << job.Describe();
}

// Local rank 2 cannot open the segment rank 0 created (its /dev/shm is
// another, empty tmpfs): ranks 0 and 1, which used to wait for it to map
// the segment until the deadline, learn it at once and go without shared
// memory as it does.
TEST(SharedMemoryFallback, RankThatCannotOpenTheSegment) {
  Job job = RunJob(3, "allreduce", JobEnv(), milliseconds(60000),
                   nullptr, {{2, {{"DDP_TEST_PRIVATE_SHM", "size=1m"}}}});
  ASSERT_EQ(job.results.size(), 3u);
  ExpectEveryRankFellBack(job, "local rank 2: opening /dev/shm/ddp-");
  EXPECT_NE(job.results[0].output.find("No such file or directory"), std::string::npos)
      << job.Describe();
}

// A /dev/shm too small for the segment (Docker gives a container 64 MiB;
// here 16 MiB, for a segment of 32 MiB: two ranks of 8 MiB staging buffers,
// each rank has two): every rank goes without shared memory, naming
// /dev/shm and the cause, where the ranks used to die of SIGBUS at the
// first touch of a page the tmpfs had no room for.
TEST(SharedMemoryFallback, DevShmTooSmallForTheSegment) {
  testing::ProcessGroup::Env env = JobEnv();
  env["DDP_TEST_HOST_SHM"] = "size=16m";
  env["DDP_TEST_INNER_RANKS"] = "2";
  env["DDP_SHM_STAGING_BYTES"] = std::to_string(8 << 20);
  env["DDP_TEST_BIG_COUNT"] = std::to_string((8 << 20) / sizeof(float));  // staged
  const Job host = RunJob(1, "host", env, milliseconds(90000));
  ASSERT_EQ(host.results.size(), 1u);
  ASSERT_EQ(host.results[0].exit_code, 0) << host.Describe();
  const Job job = InnerJob(host.results[0].output);
  ASSERT_EQ(job.results.size(), 2u) << host.Describe();
  ExpectEveryRankFellBack(job, "local rank 0: reserving ");
  for (const char* cause : {"bytes for /dev/shm/ddp-", "No space left on device",
                            "/dev/shm is too small"}) {
    EXPECT_NE(job.results[0].output.find(cause), std::string::npos) << job.Describe();
  }
}

}  // namespace
}  // namespace ddp::transport

int main(int argc, char** argv) {
  return ddp::transport::testing::WorkerOrTestsMain(argc, argv, ddp::transport::RunScenario);
}
