// Point-to-point ping-pong between ranks 0 and 1: ProcessGroup::Send/Recv
// against the transport's own Communicator::Send/Recv underneath it (what
// the process group's thread hop and header message cost), and against
// PyTorch gloo's send/recv (ddp/bench/torch_gloo_p2p.py, same output).
//
//   bazel run //ddp:p2p_bench -- --nproc_per_node=2 --mode=pg
//   bazel run //ddp:p2p_bench -- --nproc_per_node=2 --mode=comm
//
// Rank 0 sends a float32 tensor of `bytes` bytes, rank 1 sends it back; rank
// 0 prints one line per size: `bytes one_way_us GBps`, one-way = half the
// mean round trip, GBps = bytes / one-way time. Sizes 8 B to 16 MiB.

#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddp/process_group.h"
#include "transport/communicator.h"
#include "transport/launch/self_launch.h"

DEFINE_string(mode, "pg", "pg (ProcessGroup::Send/Recv) or comm (Communicator::Send/Recv)");
DEFINE_int32(timeout_ms, 60000, "deadline of every call");
DEFINE_bool(bind, false,
            "pin each rank's main thread and its communicator's thread to one core (local rank "
            "modulo the cores it may use), as mpirun does; off: in one run on the loaded 2-core "
            "machine it made --mode=comm's 16 MiB ping-pong 3x slower");

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "p2p_bench: %s\n", message.c_str());
  std::exit(2);
}

// Calls as many as the MPI and gloo peers make: 2e8 / bytes, 3 to 2000.
int Iterations(size_t bytes) {
  return static_cast<int>(std::clamp<size_t>(200000000 / std::max<size_t>(bytes, 1), 3, 2000));
}

// One round trip from rank 0's point of view (rank 1 mirrors it).
using RoundTrip = std::function<void(bool first_sends)>;

void Measure(int rank, const std::vector<size_t>& sizes,
             const std::function<RoundTrip(size_t bytes)>& prepare) {
  for (size_t bytes : sizes) {
    const RoundTrip trip = prepare(bytes);
    for (int i = 0; i < 5; ++i) trip(rank == 0);
    const int iters = Iterations(bytes);
    const auto start = Clock::now();
    for (int i = 0; i < iters; ++i) trip(rank == 0);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    const double one_way = seconds / iters / 2;
    if (rank == 0) {
      std::printf("%zu %.2f %.3f\n", bytes, one_way * 1e6, static_cast<double>(bytes) / one_way / 1e9);
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  ddp::transport::launch::SelfLaunchOrExit(argc, argv, {.prefix_output = false});
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  std::vector<size_t> sizes;
  for (size_t b = 8; b <= (size_t{16} << 20); b *= 8) sizes.push_back(b);
  const std::chrono::milliseconds timeout(FLAGS_timeout_ms);
  ddp::transport::CommunicatorOptions options;
  options.timeout = timeout;
  options.bind_to_core = FLAGS_bind;
  if (FLAGS_mode == "comm") {
    auto created = ddp::transport::Communicator::CreateFromEnvironment(options);
    if (!created.ok()) Fail(created.status().ToString());
    ddp::transport::Communicator& comm = **created;
    if (comm.size() != 2) Fail("needs 2 ranks, got " + std::to_string(comm.size()));
    const int peer = 1 - comm.rank();
    std::vector<float> buffer;
    Measure(comm.rank(), sizes, [&](size_t bytes) -> RoundTrip {
      buffer.assign(bytes / 4, 1.0f);
      return [&comm, &buffer, peer](bool first_sends) {
        for (int step = 0; step < 2; ++step) {
          const bool send = (step == 0) == first_sends;
          const auto s = send ? comm.Send(buffer.data(), buffer.size(), ddp::transport::DataType::kF32, peer, 1)
                              : comm.Recv(buffer.data(), buffer.size(), ddp::transport::DataType::kF32, peer, 1);
          if (!s.ok()) Fail(s.ToString());
        }
      };
    });
    return 0;
  }
  if (FLAGS_mode != "pg") Fail("--mode must be pg or comm, got " + FLAGS_mode);
  auto pg = ddp::dist::ProcessGroup::CreateFromEnvironment({.timeout = timeout}, options);
  if (pg->size() != 2) Fail("needs 2 ranks, got " + std::to_string(pg->size()));
  const int peer = 1 - pg->rank();
  ddp::nn::Tensor buffer;
  Measure(pg->rank(), sizes, [&](size_t bytes) -> RoundTrip {
    buffer = ddp::nn::Ones({static_cast<int64_t>(bytes / 4)});
    return [&pg, &buffer, peer](bool first_sends) {
      for (int step = 0; step < 2; ++step) {
        const bool send = (step == 0) == first_sends;
        (send ? pg->Send(buffer, peer, 1) : pg->Recv(buffer, peer, 1)).Wait();
      }
    };
  });
  return 0;
}
