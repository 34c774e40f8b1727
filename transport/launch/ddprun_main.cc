// ddprun: see transport/launch/ddprun.h and transport/launch/README.md.

#include <cstdio>

#include "transport/launch/ddprun.h"
#include "transport/launch/env.h"

int main(int argc, char** argv) {
  using namespace ddp::transport::launch;
  using ddp::transport::StatusOr;
  StatusOr<DdprunOptions> options = ParseDdprunArgs(argc, argv, CurrentEnvironment());
  if (!options.ok()) {
    std::fprintf(stderr, "ddprun: %s\n", options.status().message().c_str());
    return 2;
  }
  if (options->help) {
    std::fputs(DdprunUsage().c_str(), stdout);
    return 0;
  }
  return RunDdprun(*options);
}
