// //examples:scaling_bench runs its jobs and prints its table (a functional
// check with tiny runs; the figures themselves are taken on a quiet machine,
// see docs/benchmarks.md).

#include <regex>
#include <string>

#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"

namespace ddp::examples {
namespace {

TEST(ScalingBenchTest, PrintsOneRowPerRankCountAndTheChart) {
  const std::string dir = testing::MakeTempDir("scaling");
  const testing::RunOutput r = testing::RunToEnd(
      {testing::Runfile("examples/scaling_bench"), "--model=mlp", "--ranks=1,2", "--steps=3",
       "--batch_size=16", "--workers=0", "--chart=" + dir + "/scaling.svg"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> lines = testing::Lines(r.out);
  ASSERT_EQ(lines.size(), 5u) << r.out;
  EXPECT_EQ(lines[0].rfind("# scaling_bench: mlp on synthetic, batch 16 per rank, 3 timed steps", 0),
            0u)
      << lines[0];
  EXPECT_EQ(lines[1], "ranks   samples/s speed-up efficiency       comm  overlap  step_ms");
  EXPECT_TRUE(std::regex_match(lines[2], std::regex(R"( +1 +[0-9,]+ +1\.00x +100% +- +- +[0-9.]+)")))
      << lines[2];
  EXPECT_TRUE(std::regex_match(
      lines[3], std::regex(R"( +2 +[0-9,]+ +[0-9.]+x +\d+% +\d+% +\d+% +[0-9.]+)")))
      << lines[3];
  EXPECT_EQ(lines[4], "# chart: " + dir + "/scaling.svg");
  const std::string svg = testing::ReadFile(dir + "/scaling.svg");
  EXPECT_NE(svg.find("scaling efficiency"), std::string::npos);
}

TEST(ScalingBenchTest, BadRankCountsAreRefused) {
  const testing::RunOutput r =
      testing::RunToEnd({testing::Runfile("examples/scaling_bench"), "--ranks=1,0"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, "scaling_bench: --ranks=1,0: each count must be in [1, 256]\n");
}

}  // namespace
}  // namespace ddp::examples
