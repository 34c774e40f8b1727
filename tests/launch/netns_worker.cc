// A rank of the two-host test (netns_test.cc), started by ddprun inside a
// network namespace.
//
//   --mode=check   all-reduce, broadcast and all-gather of several sizes
//                  against closed-form values; prints what the topology saw
//   --mode=loop    all-reduces until a call fails (the test cuts the link),
//                  then prints how long the failing call took and its code
//   --call_timeout_ms=N  per-call deadline in loop mode
//   --marker_dir=DIR     loop mode: DIR/rank<R>.looping once it is looping
//   --store_wait_ms=N    the communicator's abort_store_time and
//                        store_call_cap (how long a store access may take
//                        when no call's deadline bounds it)

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "transport/communicator.h"

namespace {

using namespace ddp::transport;
using std::chrono::milliseconds;

int Check(Communicator& comm) {
  const int rank = comm.rank(), n = comm.size();
  // 1 element, fewer than ranks... and one large enough (1.2 MB) for the
  // hierarchical path.
  for (size_t count : {size_t{1}, size_t{3}, size_t{1000}, size_t{300000}}) {
    std::vector<float> data(count);
    for (size_t i = 0; i < count; ++i) data[i] = static_cast<float>((rank + 1) * (i % 7 + 1));
    if (Status s = comm.AllReduce(data.data(), count, DataType::kF32, ReduceOp::kSum); !s.ok()) {
      std::printf("rank %d all-reduce of %zu: %s\n", rank, count, s.ToString().c_str());
      return 1;
    }
    for (size_t i = 0; i < count; ++i) {
      const float want = static_cast<float>(n * (n + 1) / 2 * (i % 7 + 1));
      if (data[i] != want) {
        std::printf("rank %d all-reduce of %zu: [%zu] = %g, want %g\n", rank, count, i, data[i], want);
        return 1;
      }
    }
    std::vector<int64_t> bcast(count);
    for (size_t i = 0; i < count; ++i) bcast[i] = rank == n - 1 ? static_cast<int64_t>(i * 31 + 7) : -1;
    if (Status s = comm.Broadcast(bcast.data(), count, DataType::kI64, n - 1); !s.ok()) {
      std::printf("rank %d broadcast of %zu: %s\n", rank, count, s.ToString().c_str());
      return 1;
    }
    for (size_t i = 0; i < count; ++i) {
      if (bcast[i] != static_cast<int64_t>(i * 31 + 7)) {
        std::printf("rank %d broadcast of %zu: [%zu] = %lld\n", rank, count, i, static_cast<long long>(bcast[i]));
        return 1;
      }
    }
    std::vector<int32_t> mine(count, rank * 1000), all(count * n, -1);
    for (size_t i = 0; i < count; ++i) mine[i] += static_cast<int32_t>(i % 1000);
    if (Status s = comm.AllGather(mine.data(), all.data(), count, DataType::kI32); !s.ok()) {
      std::printf("rank %d all-gather of %zu: %s\n", rank, count, s.ToString().c_str());
      return 1;
    }
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < count; ++i) {
        if (all[r * count + i] != r * 1000 + static_cast<int32_t>(i % 1000)) {
          std::printf("rank %d all-gather of %zu: rank %d's [%zu] = %d\n", rank, count, r, i, all[r * count + i]);
          return 1;
        }
      }
    }
  }
  std::printf("rank %d ok\n", rank);
  return 0;
}

int Loop(Communicator& comm, milliseconds call_timeout, const std::string& marker_dir) {
  // Finish our own call when the launcher asks us to stop: the test wants
  // every rank's own report of the cut link, not a kill.
  signal(SIGTERM, SIG_IGN);
  std::vector<float> data(256 * 1024);
  CallOptions call;
  call.timeout = call_timeout;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (long iteration = 0; std::chrono::steady_clock::now() < give_up; ++iteration) {
    for (size_t i = 0; i < data.size(); ++i) data[i] = 1.0f;
    const auto start = std::chrono::steady_clock::now();
    Status s = comm.AllReduce(data.data(), data.size(), DataType::kF32, ReduceOp::kSum, call);
    const auto took = std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - start);
    if (!s.ok()) {
      std::printf("rank %d failed after %lld ms: %s\n", comm.rank(), static_cast<long long>(took.count()),
                  s.ToString().c_str());
      std::fflush(stdout);
      return 3;
    }
    if (data[0] != static_cast<float>(comm.size())) {
      std::printf("rank %d wrong sum %g\n", comm.rank(), data[0]);
      return 1;
    }
    if (iteration == 3 && !marker_dir.empty()) {
      const std::string path = marker_dir + "/rank" + std::to_string(comm.rank()) + ".looping";
      if (std::FILE* f = std::fopen(path.c_str(), "w")) std::fclose(f);
    }
  }
  std::printf("rank %d never saw a failure\n", comm.rank());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "check", marker_dir;
  milliseconds call_timeout{3000};
  milliseconds store_wait{0};
  for (int i = 1; i < argc; ++i) {
    std::string_view arg(argv[i]);
    if (arg.rfind("--mode=", 0) == 0) mode = arg.substr(7);
    else if (arg.rfind("--marker_dir=", 0) == 0) marker_dir = arg.substr(13);
    else if (arg.rfind("--call_timeout_ms=", 0) == 0) call_timeout = milliseconds(std::atoi(argv[i] + 18));
    else if (arg.rfind("--store_wait_ms=", 0) == 0) store_wait = milliseconds(std::atoi(argv[i] + 16));
    else {
      std::fprintf(stderr, "netns_worker: unknown argument %s\n", argv[i]);
      return 64;
    }
  }
  CommunicatorOptions defaults;
  defaults.timeout = std::chrono::seconds(30);
  if (store_wait.count() > 0) {
    defaults.abort_store_time = store_wait;
    defaults.store_call_cap = store_wait;
  }
  auto comm = Communicator::CreateFromEnvironment(defaults);
  if (!comm.ok()) {
    std::printf("netns_worker: %s\n", comm.status().ToString().c_str());
    return 1;
  }
  const CommunicatorInfo& info = (*comm)->info();
  std::printf("rank %d hosts %d host_shm %d tls %s ring %s algo_1MiB %s kernel_ranks %d yields %d at_once %d\n",
              (*comm)->rank(), info.num_hosts, info.host_shared_memory, info.ucx_tls.c_str(),
              info.ring_order.c_str(), AlgorithmName((*comm)->SelectedAlgorithm(1 << 20)),
              info.ranks_sharing_kernel, info.yields_when_idle, info.yields_at_once);
  std::fflush(stdout);
  return mode == "loop" ? Loop(**comm, call_timeout, marker_dir) : Check(**comm);
}
