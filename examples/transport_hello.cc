// The smallest complete program on //transport: every rank contributes its
// rank number, all-reduces, and rank 0 prints the sum.
//
//   bazel run //examples:transport_hello -- --nproc_per_node=4
//
// Under ddprun, srun or mpirun, drop --nproc_per_node: the launch variables
// are already set and the binary runs as one rank.

#include <cstdio>
#include <cstring>
#include <string>

#include "transport/communicator.h"
#include "transport/launch/self_launch.h"

namespace {

constexpr char kUsage[] = "usage: transport_hello [--nproc_per_node=N]";

// Its one flag, --nproc_per_node, is gone from argv when this is called:
// anything left is a typo, refused rather than run as if it were not there.
std::string ArgumentProblem(int argc, char** argv) {
  if (argc <= 1) return "";
  return std::string("unknown argument '") + argv[1] + "'; " + kUsage;
}

}  // namespace

int main(int argc, char** argv) {
  // Before the launch, which would start every rank to print it.
  for (int i = 1; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("%s\n", kUsage);
      return 0;
    }
  }
  // Before anything touches UCX: spawn the ranks (fork-safe), once the
  // arguments are found fine.
  ddp::transport::launch::SelfLaunchOrExit(argc, argv, {.check_arguments = ArgumentProblem});
  // Under another launcher (ddprun, srun, mpirun) every rank checks.
  if (const std::string problem = ArgumentProblem(argc, argv); !problem.empty()) {
    std::fprintf(stderr, "transport_hello: %s\n", problem.c_str());
    return 2;
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
    // Every term up to three ranks ("0 + 1 = 1"), then the first two and
    // the last ("0 + 1 + ... + 3 = 6").
    std::string terms = "0";
    for (int r = 1; r < n; ++r) {
      if (n > 3 && r == 2) {
        terms += " + ...";
        r = n - 1;
      }
      terms += " + " + std::to_string(r);
    }
    std::printf("hello from %d rank%s: %s = %.0f\n", n, n == 1 ? "" : "s", terms.c_str(), value);
  }
  return value == n * (n - 1) / 2.0f ? 0 : 1;
}
