#include "transport/algorithms/selection.h"

#include <cstdlib>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ddp::transport::algorithms {
namespace {

using ::testing::HasSubstr;

SelectionInput Input(size_t bytes, int world, int hosts = 1, bool uniform = true) {
  SelectionInput in;
  in.bytes = bytes;
  in.world_size = world;
  in.num_hosts = hosts;
  in.uniform_hosts = uniform;
  return in;
}

// Restores DDP_ALLREDUCE_ALGO when a test ends.
class EnvGuard {
 public:
  EnvGuard() {
    const char* v = std::getenv(kAllReduceAlgoEnv);
    had_ = v != nullptr;
    if (had_) old_ = v;
  }
  ~EnvGuard() {
    if (had_) {
      setenv(kAllReduceAlgoEnv, old_.c_str(), 1);
    } else {
      unsetenv(kAllReduceAlgoEnv);
    }
  }

 private:
  bool had_ = false;
  std::string old_;
};

TEST(SelectionTest, DefaultTableBySizeWorldAndTopology) {
  const auto rules = DefaultAllReduceRules();
  EXPECT_EQ(SelectFromRules(rules, Input(1 << 30, 1)), Algorithm::kRing);
  EXPECT_EQ(SelectFromRules(rules, Input(4096, 2)), Algorithm::kRhd);
  EXPECT_EQ(SelectFromRules(rules, Input(64 << 10, 16)), Algorithm::kRhd);
  EXPECT_EQ(SelectFromRules(rules, Input(1 << 20, 8)), Algorithm::kTree);
  EXPECT_EQ(SelectFromRules(rules, Input(1 << 20, 4)), Algorithm::kRhd);
  EXPECT_EQ(SelectFromRules(rules, Input(4 << 20, 2)), Algorithm::kRhd);
  EXPECT_EQ(SelectFromRules(rules, Input(1 << 20, 3)), Algorithm::kRing);
  EXPECT_EQ(SelectFromRules(rules, Input(16 << 20, 4)), Algorithm::kRing);
  EXPECT_EQ(SelectFromRules(rules, Input(64 << 20, 16)), Algorithm::kRing);
  EXPECT_EQ(SelectFromRules(rules, Input(64 << 20, 16, 4)), Algorithm::kHierarchical);
  EXPECT_EQ(SelectFromRules(rules, Input(4096, 16, 4)), Algorithm::kRhd);
  // Uneven hosts cannot use the hierarchical shards.
  EXPECT_EQ(SelectFromRules(rules, Input(64 << 20, 16, 4, false)), Algorithm::kRing);
}

TEST(SelectionTest, CustomRulesFirstMatchWinsAndEmptyMeansRing) {
  const std::vector<SelectionRule> rules = {
      {100, 1, 4, TopologyCondition::kSingleHost, Algorithm::kTree},
      {1000, 1, 1000, TopologyCondition::kAny, Algorithm::kRhd},
  };
  EXPECT_EQ(SelectFromRules(rules, Input(50, 3)), Algorithm::kTree);
  EXPECT_EQ(SelectFromRules(rules, Input(50, 3, 2)), Algorithm::kRhd);
  EXPECT_EQ(SelectFromRules(rules, Input(50, 5)), Algorithm::kRhd);
  EXPECT_EQ(SelectFromRules(rules, Input(5000, 5)), Algorithm::kRing);
  EXPECT_EQ(SelectFromRules({}, Input(5, 5)), Algorithm::kRing);
}

TEST(SelectionTest, ParsesEveryName) {
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree, Algorithm::kRhd,
                      Algorithm::kHierarchical, Algorithm::kSharedMemory}) {
    auto parsed = ParseAlgorithm(AlgorithmName(a));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, a);
  }
  auto bad = ParseAlgorithm("butterfly");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("\"butterfly\""));
  EXPECT_THAT(bad.status().message(), HasSubstr("ring, tree, rhd, hierarchical or shm"));
}

TEST(SelectionTest, ExplicitChoiceBeatsEnvironmentWhichBeatsTable) {
  EnvGuard guard;
  unsetenv(kAllReduceAlgoEnv);
  EXPECT_EQ(*ChooseAllReduceAlgorithm(Algorithm::kAuto, Input(4096, 4)), Algorithm::kRhd);
  setenv(kAllReduceAlgoEnv, "tree", 1);
  EXPECT_EQ(*ChooseAllReduceAlgorithm(Algorithm::kAuto, Input(4096, 4)), Algorithm::kTree);
  EXPECT_EQ(*ChooseAllReduceAlgorithm(Algorithm::kRing, Input(4096, 4)), Algorithm::kRing);
  setenv(kAllReduceAlgoEnv, "", 1);
  EXPECT_EQ(*ChooseAllReduceAlgorithm(Algorithm::kAuto, Input(4096, 4)), Algorithm::kRhd);
}

TEST(SelectionTest, UnknownEnvironmentValueNamesTheVariable) {
  EnvGuard guard;
  setenv(kAllReduceAlgoEnv, "rign", 1);
  auto chosen = ChooseAllReduceAlgorithm(Algorithm::kAuto, Input(4096, 4));
  EXPECT_EQ(chosen.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(chosen.status().message(), HasSubstr("DDP_ALLREDUCE_ALGO=rign"));
  // An explicit choice does not even read the variable.
  EXPECT_TRUE(ChooseAllReduceAlgorithm(Algorithm::kTree, Input(4096, 4)).ok());
  EXPECT_EQ(ChooseAllReduceAlgorithm(static_cast<Algorithm>(17), Input(1, 1)).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ddp::transport::algorithms
