// The default-config form of a fuzz binary (no libFuzzer): runs the given
// files and every file in the given folders, then --mutations=N mutants of
// them. Build with --config=fuzz for the real fuzzer.

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "tests/fuzz/mutator.h"
#include "tests/fuzz/replay.h"

int main(int argc, char** argv) {
  std::vector<ddp::fuzz::Input> inputs;
  int mutations = 0;
  uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.rfind("--mutations=", 0) == 0) {
      mutations = std::atoi(std::string(arg.substr(12)).c_str());
    } else if (arg.rfind("--seed=", 0) == 0) {
      seed = std::strtoull(std::string(arg.substr(7)).c_str(), nullptr, 10);
    } else if (!arg.empty() && arg[0] == '-') {
      std::fprintf(stderr,
                   "%s: unknown option %s. This binary was built without --config=fuzz and "
                   "only replays inputs: %s [--mutations=N] [--seed=S] FILE|DIR...\n"
                   "For libFuzzer options, build with: bazel run --config=fuzz <target> -- ...\n",
                   argv[0], argv[i], argv[0]);
      return 2;
    } else {
      std::string error;
      std::vector<ddp::fuzz::Input> loaded = ddp::fuzz::LoadInputs(argv[i], &error);
      if (!error.empty()) {
        std::fprintf(stderr, "%s: %s\n", argv[0], error.c_str());
        return 2;
      }
      inputs.insert(inputs.end(), loaded.begin(), loaded.end());
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "usage: %s [--mutations=N] [--seed=S] FILE|DIR...\n", argv[0]);
    return 2;
  }
  ddp::fuzz::InstallCrashReporter();
  for (const ddp::fuzz::Input& input : inputs) ddp::fuzz::RunInput(input);
  ddp::fuzz::RunMutants(inputs, seed, mutations);
  std::printf("ran %zu inputs and %d mutants: no crash\n", inputs.size(), mutations);
  return 0;
}
