#include "examples/trainer/format.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "gtest/gtest.h"

namespace ddp::examples::trainer {
namespace {

TEST(FormatTest, CountsGetThousandsSeparators) {
  EXPECT_EQ(FormatCount(0), "0");
  EXPECT_EQ(FormatCount(999), "999");
  EXPECT_EQ(FormatCount(1000), "1,000");
  EXPECT_EQ(FormatCount(225034), "225,034");
  EXPECT_EQ(FormatCount(-1234567), "-1,234,567");
  // -INT64_MIN does not fit in an int64_t: its negation was undefined, and
  // gave "--9,223,...".
  EXPECT_EQ(FormatCount(INT64_MIN), "-9,223,372,036,854,775,808");
  EXPECT_EQ(FormatCount(INT64_MAX), "9,223,372,036,854,775,807");
}

TEST(FormatTest, ClockShowsMinutesAndHours) {
  EXPECT_EQ(FormatClock(9.7), "0:09");
  EXPECT_EQ(FormatClock(754), "12:34");
  EXPECT_EQ(FormatClock(3723), "1:02:03");
  EXPECT_EQ(FormatClock(NAN), "-");
  EXPECT_EQ(FormatClock(-1), "-");
}

TEST(FormatTest, SecondsReadNaturally) {
  EXPECT_EQ(FormatSeconds(0.84), "0.8s");
  EXPECT_EQ(FormatSeconds(23.44), "23.4s");
  EXPECT_EQ(FormatSeconds(125), "2m05s");
  EXPECT_EQ(FormatSeconds(7380), "2h03m");
  // Where one-decimal rounding would reach 100: minutes, as from 100 on.
  EXPECT_EQ(FormatSeconds(99.94), "99.9s");
  EXPECT_EQ(FormatSeconds(99.97), "1m40s");
}

// Values too large for an integer (a rate near zero gives a huge ETA) are
// shown in exponent form; converting them to int64_t was undefined
// behaviour. Non-finite and negative values show as "-".
TEST(FormatTest, HugeAndNonFiniteValuesAreShownWithoutAnIntegerConversion) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(FormatClock(1e300), "1e+300s");
  EXPECT_EQ(FormatClock(1e19), "1e+19s");
  EXPECT_EQ(FormatClock(1e15), "1e+15s");
  EXPECT_EQ(FormatClock(999999999999999.0), "277777777777:46:39");
  EXPECT_EQ(FormatClock(inf), "-");
  EXPECT_EQ(FormatClock(-inf), "-");
  EXPECT_EQ(FormatSeconds(1e300), "1e+300s");
  EXPECT_EQ(FormatSeconds(1e19), "1e+19s");
  EXPECT_EQ(FormatSeconds(999999999999999.0), "277777777777h46m");
  EXPECT_EQ(FormatSeconds(inf), "-");
  EXPECT_EQ(FormatSeconds(NAN), "-");
  EXPECT_EQ(FormatRate(1e300), "1e+300");
  EXPECT_EQ(FormatRate(1e19), "1e+19");
  EXPECT_EQ(FormatRate(999999999999999.0), "999,999,999,999,999");
  EXPECT_EQ(FormatRate(2612.6), "2,613");
  EXPECT_EQ(FormatRate(inf), "-");
  EXPECT_EQ(FormatRate(NAN), "-");
  EXPECT_EQ(FormatRate(-1), "-");
}

TEST(FormatTest, ExactDoubleRoundTrips) {
  for (double v : {0.0, 1.0 / 3.0, 1e-300, 123456.789, -2.5}) {
    EXPECT_EQ(ParseExactDouble(ExactDouble(v)), v);
  }
  EXPECT_THROW(ParseExactDouble("0x1.8p+1junk"), std::invalid_argument);
  EXPECT_THROW(ParseExactDouble(""), std::invalid_argument);
}

// strtod sets ERANGE for subnormal results too: a run saved with
// --weight_decay=1e-310 (or --lr) wrote it with ExactDouble, and its
// resume refused the checkpoint as having "no valid weight_decay". Only
// overflow is refused.
TEST(FormatTest, SubnormalsRoundTripAndOnlyOverflowIsRefused) {
  const double tiniest = std::numeric_limits<double>::denorm_min();
  for (double v : {1e-310, -1e-310, tiniest, std::numeric_limits<double>::min() / 2}) {
    EXPECT_EQ(ParseExactDouble(ExactDouble(v)), v) << ExactDouble(v);
  }
  EXPECT_EQ(ParseExactDouble("1e-310"), 1e-310);
  EXPECT_EQ(ParseExactDouble(ExactDouble(std::numeric_limits<double>::max())),
            std::numeric_limits<double>::max());
  EXPECT_THROW(ParseExactDouble("1e999"), std::invalid_argument);
  EXPECT_THROW(ParseExactDouble("-0x1p+2000"), std::invalid_argument);
}

// A number below half the smallest subnormal underflows to zero (strtod
// sets ERANGE and returns 0 or -0): it is refused, as overflow is, rather
// than read silently as a zero; the smallest subnormal itself, in decimal,
// reads back exactly, and a written zero is still zero.
TEST(FormatTest, ANumberThatUnderflowsToZeroIsRefused) {
  for (const char* text : {"1e-400", "-1e-400", "0x1p-1100", "2e-324"}) {
    EXPECT_THROW(ParseExactDouble(text), std::invalid_argument) << text;
  }
  try {
    ParseExactDouble("1e-400");
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'1e-400'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ParseExactDouble("4.9406564584124654e-324"), std::numeric_limits<double>::denorm_min());
  EXPECT_EQ(ParseExactDouble("-4.9406564584124654e-324"), -std::numeric_limits<double>::denorm_min());
  EXPECT_EQ(ParseExactDouble("0"), 0.0);
  EXPECT_TRUE(std::signbit(ParseExactDouble("-0x0p+0")));
}

// strtod skips leading white space and reads "inf" and "nan": a saved
// " 0.9" passed for ExactDouble's "0x1.ccccccccccccdp-1", and a saved lr of
// "nan" went on to advise "pass --lr=nan", which the flags refuse.
TEST(FormatTest, LeadingWhiteSpaceIsRefusedAndAFiniteNumberRefusesInfinitiesAndNan) {
  for (const char* text : {" 1", "\t0x1p+0", "\n2.5"}) {
    EXPECT_THROW(ParseExactDouble(text), std::invalid_argument) << text;
    EXPECT_THROW(ParseFiniteDouble(text), std::invalid_argument) << text;
  }
  for (const char* text : {"inf", "-inf", "nan", "-nan", "infinity"}) {
    try {
      ParseFiniteDouble(text);
      ADD_FAILURE() << text << " was taken";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), "not a finite number: '" + std::string(text) + "'");
    }
  }
  EXPECT_EQ(ParseFiniteDouble(ExactDouble(0.9)), 0.9);
  EXPECT_EQ(ParseFiniteDouble("1e-310"), 1e-310);
  EXPECT_TRUE(std::isnan(ParseExactDouble("nan")));  // a diverged run's loss sum reads back
}

}  // namespace
}  // namespace ddp::examples::trainer
