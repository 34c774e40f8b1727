// The environment parsers that the CPU and CUDA settings share
// (DDP_NN_CPU_CACHE, DDP_NN_CUDA_CACHE, DDP_NN_CUDA_TF32,
// DDP_NN_CUDA_TIMEOUT_S): every spelling taken, and a warning naming the
// variable and the value for anything else.
#include "nn/tensor/env_value.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

namespace ddp::nn {
namespace {

TEST(EnvValueTest, OnOffTakesTheUsualSpellingsInAnyCase) {
  for (const char* off : {"0", "off", "OFF", "Off", "false", "False", "no", "NO", "none"}) {
    std::string problem;
    EXPECT_EQ(ParseOnOff("DDP_X", off, &problem), std::optional<bool>(false)) << off;
    EXPECT_EQ(problem, "") << off;
  }
  for (const char* on : {"1", "on", "ON", "true", "TRUE", "True", "yes", "Yes"}) {
    std::string problem;
    EXPECT_EQ(ParseOnOff("DDP_X", on, &problem), std::optional<bool>(true)) << on;
    EXPECT_EQ(problem, "") << on;
  }
}

TEST(EnvValueTest, OnOffUnsetOrEmptyIsNoValueAndNoProblem) {
  std::string problem;
  EXPECT_EQ(ParseOnOff("DDP_X", nullptr, &problem), std::nullopt);
  EXPECT_EQ(ParseOnOff("DDP_X", "", &problem), std::nullopt);
  EXPECT_EQ(problem, "");
}

TEST(EnvValueTest, OnOffNamesAValueItDoesNotTake) {
  for (const char* bad : {"2", "0x", "offf", "disabled", " on", "on "}) {
    std::string problem;
    EXPECT_EQ(ParseOnOff("DDP_NN_CUDA_TF32", bad, &problem), std::nullopt) << bad;
    EXPECT_EQ(problem, "DDP_NN_CUDA_TF32=" + std::string(bad) +
                           " is neither on (1, on, true, yes) nor off (0, off, false, no, none)")
        << bad;
  }
}

TEST(EnvValueTest, OnOffFromEnvWarnsAndKeepsTheFallback) {
  ::setenv("DDP_NN_ENV_VALUE_TEST", "maybe", 1);
  testing::internal::CaptureStderr();
  EXPECT_TRUE(OnOffFromEnv("DDP_NN_ENV_VALUE_TEST", true, "caching"));
  EXPECT_FALSE(OnOffFromEnv("DDP_NN_ENV_VALUE_TEST", false, "TF32 off"));
  EXPECT_EQ(testing::internal::GetCapturedStderr(),
            "[ddp] warning: DDP_NN_ENV_VALUE_TEST=maybe is neither on (1, on, true, yes) nor off (0, off, false, "
            "no, none); keeping caching\n"
            "[ddp] warning: DDP_NN_ENV_VALUE_TEST=maybe is neither on (1, on, true, yes) nor off (0, off, false, "
            "no, none); keeping TF32 off\n");
  ::setenv("DDP_NN_ENV_VALUE_TEST", "Off", 1);
  testing::internal::CaptureStderr();
  EXPECT_FALSE(OnOffFromEnv("DDP_NN_ENV_VALUE_TEST", true, "caching"));
  ::setenv("DDP_NN_ENV_VALUE_TEST", "true", 1);
  EXPECT_TRUE(OnOffFromEnv("DDP_NN_ENV_VALUE_TEST", false, "TF32 off"));
  ::unsetenv("DDP_NN_ENV_VALUE_TEST");
  EXPECT_TRUE(OnOffFromEnv("DDP_NN_ENV_VALUE_TEST", true, "caching"));
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

TEST(EnvValueTest, SecondsTakesWholePositiveNumbersUpToTheMost) {
  std::string problem;
  EXPECT_EQ(ParseSeconds("DDP_X", nullptr, 100, &problem), std::nullopt);
  EXPECT_EQ(ParseSeconds("DDP_X", "", 100, &problem), std::nullopt);
  EXPECT_EQ(ParseSeconds("DDP_X", "1", 100, &problem), std::optional<int64_t>(1));
  EXPECT_EQ(ParseSeconds("DDP_X", "30", 100, &problem), std::optional<int64_t>(30));
  EXPECT_EQ(ParseSeconds("DDP_X", "100", 100, &problem), std::optional<int64_t>(100));
  EXPECT_EQ(ParseSeconds("DDP_X", "0100", 100, &problem), std::optional<int64_t>(100));
  EXPECT_EQ(problem, "");
}

TEST(EnvValueTest, SecondsNamesAValueItDoesNotTake) {
  for (const char* bad : {"abc", "0", "-5", "+5", "12abc", "1.5", " 5", "5 ", "101", "99999999999999999999999"}) {
    std::string problem;
    EXPECT_EQ(ParseSeconds("DDP_NN_CUDA_TIMEOUT_S", bad, 100, &problem), std::nullopt) << bad;
    EXPECT_EQ(problem,
              "DDP_NN_CUDA_TIMEOUT_S=" + std::string(bad) + " is not a whole number of seconds in [1, 100]")
        << bad;
  }
}

}  // namespace
}  // namespace ddp::nn
