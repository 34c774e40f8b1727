#include "transport/env_value.h"

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include <gtest/gtest.h>

namespace ddp::transport {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// The error's code and text, for one comparison.
std::string Error(const Status& status) { return status.ToString(); }

TEST(ParseEnvBoolTest, AcceptsEverySpellingInAnyCase) {
  for (const char* on : {"1", "true", "TRUE", "True", "on", "ON", "yes", "Yes"}) {
    StatusOr<bool> v = ParseEnvBool("DDP_X", on);
    ASSERT_TRUE(v.ok()) << on << ": " << v.status();
    EXPECT_TRUE(*v) << on;
  }
  for (const char* off : {"0", "false", "FALSE", "off", "Off", "no", "NO"}) {
    StatusOr<bool> v = ParseEnvBool("DDP_X", off);
    ASSERT_TRUE(v.ok()) << off << ": " << v.status();
    EXPECT_FALSE(*v) << off;
  }
}

TEST(ParseEnvBoolTest, AnythingElseNamesTheVariableTheValueAndTheSpellings) {
  for (const char* bad : {"", "2", "maybe", "y", "n", " 1", "1 ", "truee", "-1", "enabled"}) {
    StatusOr<bool> v = ParseEnvBool("DDP_SHARED_MEMORY", bad);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(Error(v.status()), std::string("INVALID_ARGUMENT: DDP_SHARED_MEMORY=") + bad +
                                     ": expected 1, true, on, yes or 0, false, off, no (any case)");
  }
}

TEST(ParseEnvBytesTest, DigitsWithAnOptionalPowerOf1024Suffix) {
  const std::pair<const char*, uint64_t> cases[] = {
      {"0", 0},          {"8192", 8192},        {"1K", 1024},    {"1k", 1024},
      {"8K", 8 << 10},   {"3M", 3 << 20},       {"3m", 3 << 20}, {"1G", kGiB},
      {"1g", kGiB},      {"0G", 0},             {"1073741824", kGiB},
      {"007", 7},
  };
  for (const auto& [text, want] : cases) {
    StatusOr<uint64_t> v = ParseEnvBytes("DDP_X", text, kGiB);
    ASSERT_TRUE(v.ok()) << text << ": " << v.status();
    EXPECT_EQ(*v, want) << text;
  }
}

TEST(ParseEnvBytesTest, MalformedValuesNameTheVariableTheValueAndTheForm) {
  for (const char* bad : {"", "K", "1X", "abc", "1KB", "1KiB", "1.5M", "-1", "+1", " 1", "1 ", "1T",
                          "0x10", "1e3", "1MK"}) {
    StatusOr<uint64_t> v = ParseEnvBytes("DDP_SHM_STAGING_BYTES", bad, kGiB);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(Error(v.status()),
              std::string("INVALID_ARGUMENT: DDP_SHM_STAGING_BYTES=") + bad +
                  ": expected a byte count: digits, optionally followed by K, M or G (KiB, MiB, GiB)");
  }
}

TEST(ParseEnvBytesTest, MoreThanTheLimitIsRefusedWithTheLimit) {
  for (const char* big : {"1073741825", "2G", "1025M", "99999999999999999999", "18014398509481984K",
                          "17179869184G"}) {
    StatusOr<uint64_t> v = ParseEnvBytes("DDP_SHM_STAGING_BYTES", big, kGiB);
    ASSERT_FALSE(v.ok()) << big;
    EXPECT_EQ(Error(v.status()), std::string("INVALID_ARGUMENT: DDP_SHM_STAGING_BYTES=") + big +
                                     ": expected at most 1073741824 (1G) bytes");
  }
  StatusOr<uint64_t> v = ParseEnvBytes("DDP_X", "5000", 4096);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(Error(v.status()), "INVALID_ARGUMENT: DDP_X=5000: expected at most 4096 (4K) bytes");
  v = ParseEnvBytes("DDP_X", "1001", 1000);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(Error(v.status()), "INVALID_ARGUMENT: DDP_X=1001: expected at most 1000 bytes");
}

TEST(ParseEnvCountTest, DigitsOnlyUpToTheLimit) {
  StatusOr<uint64_t> v = ParseEnvCount("DDP_SHM_SPIN_US", "250", 1000);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 250u);
  v = ParseEnvCount("DDP_SHM_SPIN_US", "1000", 1000);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 1000u);
  for (const char* bad : {"", "abc", "1K", "-5", "2.5", " 7", "12us"}) {
    v = ParseEnvCount("DDP_SHM_SPIN_US", bad, 1000);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(Error(v.status()),
              std::string("INVALID_ARGUMENT: DDP_SHM_SPIN_US=") + bad + ": expected digits (a whole number)");
  }
  v = ParseEnvCount("DDP_SHM_SPIN_US", "1001", 1000);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(Error(v.status()), "INVALID_ARGUMENT: DDP_SHM_SPIN_US=1001: expected at most 1000");
}

// The environment readers: unset or empty is "not given"; a value parses as
// above.
TEST(EnvValueTest, UnsetOrEmptyIsNotGivenAndAValueIsParsed) {
  unsetenv("DDP_ENV_VALUE_TEST");
  StatusOr<std::optional<bool>> b = EnvBool("DDP_ENV_VALUE_TEST");
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->has_value());
  setenv("DDP_ENV_VALUE_TEST", "", 1);
  StatusOr<std::optional<uint64_t>> n = EnvBytes("DDP_ENV_VALUE_TEST", kGiB);
  ASSERT_TRUE(n.ok());
  EXPECT_FALSE(n->has_value());
  setenv("DDP_ENV_VALUE_TEST", "off", 1);
  b = EnvBool("DDP_ENV_VALUE_TEST");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, std::optional<bool>(false));
  setenv("DDP_ENV_VALUE_TEST", "2M", 1);
  n = EnvBytes("DDP_ENV_VALUE_TEST", kGiB);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, std::optional<uint64_t>(2 << 20));
  n = EnvCount("DDP_ENV_VALUE_TEST", 100);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(Error(n.status()), "INVALID_ARGUMENT: DDP_ENV_VALUE_TEST=2M: expected digits (a whole number)");
  unsetenv("DDP_ENV_VALUE_TEST");
}

}  // namespace
}  // namespace ddp::transport
