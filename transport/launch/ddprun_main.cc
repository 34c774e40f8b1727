// ddprun: see transport/launch/ddprun.h and transport/launch/README.md.

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "transport/launch/ddprun.h"
#include "transport/launch/env.h"
#include "transport/launch/error_file.h"
#include "transport/launch/spawn.h"

int main(int argc, char** argv) {
  using namespace ddp::transport::launch;
  using ddp::transport::StatusOr;
  // `bazel run` starts us in the runfiles folder: a relative PROGRAM,
  // --log_dir or program argument means the user's folder, which Bazel
  // passes here. The workers inherit it.
  if (const char* dir = std::getenv("BUILD_WORKING_DIRECTORY"); dir != nullptr && *dir) {
    if (chdir(dir) != 0) {
      std::fprintf(stderr, "ddprun: cannot enter BUILD_WORKING_DIRECTORY='%s': %s\n", dir,
                   std::strerror(errno));
      return 2;
    }
  }
  StatusOr<DdprunOptions> options = ParseDdprunArgs(argc, argv, CurrentEnvironment());
  if (!options.ok()) {
    std::fprintf(stderr, "ddprun: %s\n", options.status().message().c_str());
    // As torchrun's @record: the launcher's own error file, when its
    // launcher or scheduler gave it one, says why it failed.
    if (const char* path = std::getenv(kEnvErrorFile); path != nullptr && *path) {
      (void)WriteErrorFile(path, "ddprun: " + options.status().message());
    }
    return 2;
  }
  if (options->help) {
    std::fputs(DdprunUsage().c_str(), stdout);
    return 0;
  }
  const int code = RunDdprun(*options);
  // Interrupted (Ctrl-C, SIGTERM, SIGHUP): die of the signal, as the shell
  // that started us expects.
  DieOfInterruptSignal(code);
  return code;
}
