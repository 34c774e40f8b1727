// The smallest complete program on //transport: every rank contributes its
// rank number, all-reduces, and rank 0 prints the sum.
//
//   bazel run //examples:transport_hello -- --nproc_per_node=4
//
// Under ddprun, srun or mpirun, drop --nproc_per_node: the launch variables
// are already set and the binary runs as one rank.

#include <cstdio>
#include <cstring>

#include "transport/communicator.h"
#include "transport/launch/self_launch.h"

int main(int argc, char** argv) {
  // Before anything touches UCX: spawn the ranks (fork-safe).
  ddp::transport::launch::SelfLaunchOrExit(argc, argv);
  // Its one flag, --nproc_per_node, is gone from argv by now: anything left
  // is a typo, refused rather than run as if it were not there.
  if (argc > 1) {
    const bool help = std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0;
    if (!help) std::fprintf(stderr, "transport_hello: unknown argument '%s'\n", argv[1]);
    std::fprintf(help ? stdout : stderr, "usage: transport_hello [--nproc_per_node=N]\n");
    return help ? 0 : 2;
  }

  using namespace ddp::transport;
  auto comm = Communicator::CreateFromEnvironment();
  if (!comm.ok()) {
    std::fprintf(stderr, "transport_hello: %s\n", comm.status().ToString().c_str());
    return 1;
  }
  float value = static_cast<float>((*comm)->rank());
  if (Status s = (*comm)->AllReduce(&value, 1, DataType::kF32, ReduceOp::kSum); !s.ok()) {
    std::fprintf(stderr, "transport_hello: rank %d: %s\n", (*comm)->rank(), s.ToString().c_str());
    return 1;
  }
  const int n = (*comm)->size();
  if ((*comm)->rank() == 0) {
    std::printf("hello from %d ranks: 0 + 1 + ... + %d = %.0f\n", n, n - 1, value);
  }
  return value == n * (n - 1) / 2.0f ? 0 : 1;
}
