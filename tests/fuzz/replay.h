#ifndef DDP_TESTS_FUZZ_REPLAY_H_
#define DDP_TESTS_FUZZ_REPLAY_H_

// Running a fuzz target without libFuzzer: loading corpus files, running one
// input with a crash reporter armed, and running deterministic mutants.

#include <cstdint>
#include <string>
#include <vector>

namespace ddp::fuzz {

/// One input and where it came from (a path, or the mutant's description).
struct Input {
  std::string name;
  std::string bytes;
};

/// The regular files in `path` (sorted by name; not recursive), or `path`
/// itself when it is a file. Fills `error` and returns nothing on failure.
std::vector<Input> LoadInputs(const std::string& path, std::string* error);

/// Makes fatal signals and sanitizer reports say which input was running and
/// save its bytes (to $TEST_UNDECLARED_OUTPUTS_DIR, else the current folder)
/// as crash-<hash>, so the crash can be replayed by path. Idempotent.
void InstallCrashReporter();

/// Runs the fuzz target on one input.
void RunInput(const Input& input);

/// Runs `count` mutants of `corpus` from a mutator seeded with `seed`.
void RunMutants(const std::vector<Input>& corpus, uint64_t seed, int count);

}  // namespace ddp::fuzz

#endif  // DDP_TESTS_FUZZ_REPLAY_H_
