// ddprun for tests: the same launcher, except that each worker group waits
// 10 s right after its first worker started (PauseAfterFirstWorkerForTesting),
// so that a test can kill it in that window.

#include <chrono>
#include <cstdio>

#include "transport/launch/ddprun.h"
#include "transport/launch/env.h"
#include "transport/launch/spawn.h"

int main(int argc, char** argv) {
  using namespace ddp::transport::launch;
  // Longer than a test takes to reach its kill; the kill ends it early.
  PauseAfterFirstWorkerForTesting(std::chrono::seconds(10));
  ddp::transport::StatusOr<DdprunOptions> options = ParseDdprunArgs(argc, argv, CurrentEnvironment());
  if (!options.ok()) {
    std::fprintf(stderr, "ddprun: %s\n", options.status().message().c_str());
    return 2;
  }
  const int code = RunDdprun(*options);
  DieOfInterruptSignal(code);
  return code;
}
