// Relative path flags are the user's: under `bazel run` from
// $BUILD_WORKING_DIRECTORY, else from the current directory.

#include "examples/user_path.h"

#include <stdlib.h>

#include <filesystem>

#include "gtest/gtest.h"

namespace ddp::examples {
namespace {

TEST(UserPathTest, RelativePathsAreResolvedAgainstBuildWorkingDirectory) {
  setenv("BUILD_WORKING_DIRECTORY", "/home/someone/project", 1);
  EXPECT_EQ(UserWorkingDirectory(), "/home/someone/project");
  EXPECT_EQ(UserPath("chart.svg"), "/home/someone/project/chart.svg");
  EXPECT_EQ(UserPath("../data/fmnist"), "/home/someone/data/fmnist");
  EXPECT_EQ(UserPath("./traces/run_"), "/home/someone/project/traces/run_");
  EXPECT_EQ(UserPath("/abs//x/../y.svg"), "/abs/y.svg");
  EXPECT_EQ(UserPath(""), "");
  unsetenv("BUILD_WORKING_DIRECTORY");
}

TEST(UserPathTest, WithoutBazelRunTheCurrentDirectoryIsTheUsers) {
  unsetenv("BUILD_WORKING_DIRECTORY");
  const std::string cwd = std::filesystem::current_path().string();
  EXPECT_EQ(UserWorkingDirectory(), cwd);
  EXPECT_EQ(UserPath("a/b.svg"), (std::filesystem::path(cwd) / "a/b.svg").string());
  // An empty variable (set but blank) is not a directory.
  setenv("BUILD_WORKING_DIRECTORY", "", 1);
  EXPECT_EQ(UserWorkingDirectory(), cwd);
  unsetenv("BUILD_WORKING_DIRECTORY");
}

}  // namespace
}  // namespace ddp::examples
