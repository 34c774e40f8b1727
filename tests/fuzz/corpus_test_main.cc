// The CI form of a fuzz target (any compiler, any config): replays the seed
// corpus, then a fixed number of deterministic mutants of it. Flags (after
// gtest's): --corpus=DIR (relative to the runfiles root) --mutations=N.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "tests/fuzz/mutator.h"
#include "tests/fuzz/replay.h"

namespace ddp::fuzz {
namespace {

std::string g_corpus;
int g_mutations = 0;

std::vector<Input> Corpus() {
  std::string error;
  std::vector<Input> inputs = LoadInputs(g_corpus, &error);
  EXPECT_TRUE(error.empty()) << error;
  EXPECT_FALSE(inputs.empty()) << "the seed corpus " << g_corpus << " is empty";
  return inputs;
}

TEST(FuzzTarget, ReplaysTheSeedCorpus) {
  const std::vector<Input> corpus = Corpus();
  for (const Input& input : corpus) RunInput(input);
  std::printf("replayed %zu seed inputs from %s\n", corpus.size(), g_corpus.c_str());
}

// The seed is the corpus path, so every run makes the same mutants and a
// failure reproduces by running the test again.
TEST(FuzzTarget, SurvivesDeterministicMutants) {
  const std::vector<Input> corpus = Corpus();
  ASSERT_FALSE(corpus.empty());
  const auto start = std::chrono::steady_clock::now();
  RunMutants(corpus, HashName(g_corpus), g_mutations);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("ran %d mutants in %.2f s\n", g_mutations, seconds);
}

}  // namespace
}  // namespace ddp::fuzz

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.rfind("--corpus=", 0) == 0) {
      ddp::fuzz::g_corpus = std::string(arg.substr(9));
    } else if (arg.rfind("--mutations=", 0) == 0) {
      ddp::fuzz::g_mutations = std::atoi(std::string(arg.substr(12)).c_str());
    } else {
      std::fprintf(stderr, "unknown argument %s (expected --corpus=DIR --mutations=N)\n",
                   argv[i]);
      return 2;
    }
  }
  if (ddp::fuzz::g_corpus.empty()) {
    std::fprintf(stderr, "--corpus=DIR is required\n");
    return 2;
  }
  ddp::fuzz::InstallCrashReporter();
  return RUN_ALL_TESTS();
}
