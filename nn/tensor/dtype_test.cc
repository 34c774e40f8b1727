#include "nn/tensor/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

namespace ddp::nn {
namespace {

TEST(HalfTest, KnownValues) {
  EXPECT_EQ(Half(1.0f).bits, 0x3c00);
  EXPECT_EQ(Half(-2.0f).bits, 0xc000);
  EXPECT_EQ(Half(65504.0f).bits, 0x7bff);        // largest finite
  EXPECT_EQ(Half(65519.0f).bits, 0x7bff);        // rounds down
  EXPECT_EQ(Half(65520.0f).bits, 0x7c00);        // halfway to 2^16 rounds to even = inf
  EXPECT_EQ(Half(1e6f).bits, 0x7c00);
  EXPECT_EQ(Half(5.9604645e-8f).bits, 0x0001);   // smallest subnormal
  EXPECT_EQ(Half(2.9802322e-8f).bits, 0x0000);   // half of it rounds to even (0)
  EXPECT_EQ(Half(4.4703484e-8f).bits, 0x0001);   // 0.75 of it rounds up
  EXPECT_EQ(Half(6.1035156e-5f).bits, 0x0400);   // smallest normal
  EXPECT_EQ(Half(1.0f + 1.0f / 2048).bits, 0x3c00);  // tie, even mantissa stays
  EXPECT_EQ(Half(1.0f + 3.0f / 2048).bits, 0x3c02);  // tie, odd mantissa rounds up
  EXPECT_TRUE(std::isnan(static_cast<float>(Half(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(static_cast<float>(Half::FromBits(0x7c00)), std::numeric_limits<float>::infinity());
}

TEST(HalfTest, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const Half h = Half::FromBits(static_cast<uint16_t>(b));
    const float f = h;
    if (std::isnan(f)) continue;
    EXPECT_EQ(Half(f).bits, b) << "bits " << b;
  }
}

TEST(BFloat16Test, RoundsToNearestEven) {
  EXPECT_EQ(BFloat16(1.0f).bits, 0x3f80);
  EXPECT_EQ(BFloat16(1.0f + 1.0f / 256).bits, 0x3f80);   // tie to even
  EXPECT_EQ(BFloat16(1.0f + 3.0f / 256).bits, 0x3f82);   // tie, odd rounds up
  EXPECT_EQ(BFloat16(1.0f + 1.5f / 256).bits, 0x3f81);
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(static_cast<float>(BFloat16(-3.5f)), -3.5f);
}

// A double converts to f16 and bf16 in one rounding. Through f32 it rounded
// twice: a double a hair above the midpoint of two neighbours became the
// midpoint in f32, whose tie then went to the even neighbour, below.
TEST(HalfTest, DoubleRoundsOnceToNearestEven) {
  EXPECT_EQ(Half(1.0 + 0x1p-11 + 0x1p-30).bits, 0x3c01);      // above the tie: up (through f32: 0x3c00)
  EXPECT_EQ(Half(1.0 + 3 * 0x1p-11 - 0x1p-30).bits, 0x3c01);  // below the tie: down (through f32: 0x3c02)
  EXPECT_EQ(Half(1.0 + 0x1p-11).bits, 0x3c00);                // the tie itself: even
  EXPECT_EQ(Half(65520.0 - 0x1p-20).bits, 0x7bff);            // largest finite (through f32: inf)
  EXPECT_EQ(Half(65520.0).bits, 0x7c00);                      // tie with 2^16: inf
  EXPECT_EQ(Half(-1e300).bits, 0xfc00);
  EXPECT_EQ(Half(std::numeric_limits<double>::infinity()).bits, 0x7c00);
  EXPECT_EQ(Half(0x1p-25 + 0x1p-70).bits, 0x0001);            // subnormal (through f32: 0)
  EXPECT_EQ(Half(0x1p-25).bits, 0x0000);                      // half the smallest: even, 0
  EXPECT_EQ(Half(2.5 * 0x1p-24 + 0x1p-70).bits, 0x0003);      // (through f32: 0x0002)
  EXPECT_EQ(Half(0x1p-14 - 0x1p-40).bits, 0x0400);            // up into the normals
  EXPECT_EQ(Half(-1e-300).bits, 0x8000);
  EXPECT_EQ(Half(-0.0).bits, 0x8000);
  const Half nan(-std::numeric_limits<double>::quiet_NaN());
  EXPECT_TRUE(std::isnan(static_cast<float>(nan))) << nan.bits;
  EXPECT_EQ(nan.bits & 0x8000, 0x8000);

  EXPECT_EQ(BFloat16(1.0 + 0x1p-8 + 0x1p-40).bits, 0x3f81);   // (through f32: 0x3f80)
  EXPECT_EQ(BFloat16(1.0 + 3 * 0x1p-8 - 0x1p-40).bits, 0x3f81);
  EXPECT_EQ(BFloat16(0x1p127 * (2 - 0x1p-8) - 0x1p90).bits, 0x7f7f);  // largest finite (through f32: inf)
  EXPECT_EQ(BFloat16(0x1p127 * (2 - 0x1p-8)).bits, 0x7f80);
  EXPECT_EQ(BFloat16(0x1p-134 + 0x1p-180).bits, 0x0001);      // subnormal (through f32: 0)
  EXPECT_EQ(BFloat16(1e-300).bits, 0x0000);
  EXPECT_EQ(BFloat16(-std::numeric_limits<double>::infinity()).bits, 0xff80);
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(std::numeric_limits<double>::quiet_NaN()))));
}

// For every pair of neighbours of either sign, up to the largest finite
// value and 2^16 (2^128 for bf16): each value itself, the midpoint (to
// even) and a hair either side of it.
template <typename T>
int CountDoubleRoundingErrors(uint16_t inf_bits, double past_largest, std::string* first) {
  int wrong = 0;
  for (uint32_t b = 0; b < inf_bits; ++b) {
    const double lo = static_cast<float>(T::FromBits(static_cast<uint16_t>(b)));
    const double hi = b + 1 == inf_bits ? past_largest : static_cast<float>(T::FromBits(static_cast<uint16_t>(b + 1)));
    const double mid = (lo + hi) / 2, hair = (hi - lo) * 0x1p-30;
    const uint32_t even = b % 2 == 0 ? b : b + 1;
    const std::pair<double, uint32_t> cases[] = {{lo, b}, {mid - hair, b}, {mid, even}, {mid + hair, b + 1}};
    for (const auto& [value, expected] : cases) {
      for (const uint32_t sign : {0u, 0x8000u}) {
        const uint16_t got = T(sign ? -value : value).bits;
        if (got == (expected | sign)) continue;
        if (wrong++ == 0) {
          char text[128];
          std::snprintf(text, sizeof text, "%a gave 0x%04x, expected 0x%04x", sign ? -value : value, got,
                        expected | sign);
          *first = text;
        }
      }
    }
  }
  return wrong;
}

TEST(HalfTest, EveryMidpointFromDoubleRoundsToNearestEven) {
  std::string first;
  EXPECT_EQ(CountDoubleRoundingErrors<Half>(0x7c00, 0x1p16, &first), 0) << "first: " << first;
  EXPECT_EQ(CountDoubleRoundingErrors<BFloat16>(0x7f80, 0x1p128, &first), 0) << "first: " << first;
}

TEST(DTypeTest, NamesSizesAndPromotion) {
  EXPECT_EQ(ElementSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeName(DType::kFloat16), "f16");
  EXPECT_EQ(ParseDType("bfloat16"), DType::kBFloat16);
  EXPECT_THROW(ParseDType("f8"), std::invalid_argument);
  EXPECT_EQ(PromoteTypes(DType::kBFloat16, DType::kFloat32), DType::kFloat32);
  EXPECT_EQ(PromoteTypes(DType::kFloat16, DType::kBFloat16), DType::kFloat32);
  EXPECT_EQ(PromoteTypes(DType::kFloat64, DType::kFloat16), DType::kFloat64);
  EXPECT_EQ(PromoteTypes(DType::kInt64, DType::kFloat16), DType::kFloat16);
  EXPECT_EQ(PromoteTypes(DType::kUInt8, DType::kInt64), DType::kInt64);
}

// torch.result_type when one operand is 0-d: it decides only when its
// category (integer < floating) is above the other's; two 0-d operands, or
// two with dimensions, promote as usual. Expected values from PyTorch 1.13.
TEST(DTypeTest, ZeroDimOperandDecidesOnlyAcrossCategories) {
  using D = DType;
  struct Case {
    D dimensioned, zero_dim, expected;
  };
  const Case cases[] = {
      {D::kBFloat16, D::kFloat32, D::kBFloat16}, {D::kFloat32, D::kFloat64, D::kFloat32},
      {D::kFloat16, D::kFloat64, D::kFloat16},   {D::kFloat16, D::kBFloat16, D::kFloat16},
      {D::kInt64, D::kFloat32, D::kFloat32},     {D::kInt64, D::kFloat64, D::kFloat64},
      {D::kInt64, D::kBFloat16, D::kBFloat16},   {D::kUInt8, D::kFloat16, D::kFloat16},
      {D::kUInt8, D::kInt64, D::kUInt8},         {D::kInt32, D::kInt64, D::kInt32},
      {D::kUInt8, D::kInt32, D::kUInt8},         {D::kInt32, D::kUInt8, D::kInt32},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(DTypeName(c.dimensioned)) + " with a 0-d " + std::string(DTypeName(c.zero_dim)));
    EXPECT_EQ(ResultType(c.dimensioned, false, c.zero_dim, true), c.expected);
    EXPECT_EQ(ResultType(c.zero_dim, true, c.dimensioned, false), c.expected);
    // Both 0-d or both with dimensions: the usual promotion.
    EXPECT_EQ(ResultType(c.dimensioned, true, c.zero_dim, true), PromoteTypes(c.dimensioned, c.zero_dim));
    EXPECT_EQ(ResultType(c.dimensioned, false, c.zero_dim, false), PromoteTypes(c.dimensioned, c.zero_dim));
  }
  EXPECT_EQ(ResultType(D::kFloat64, true, D::kFloat32, true), D::kFloat64);
  EXPECT_EQ(ResultType(D::kInt64, true, D::kBFloat16, true), D::kBFloat16);
  EXPECT_EQ(ResultType(D::kBFloat16, true, D::kFloat16, true), D::kFloat32);
}

}  // namespace
}  // namespace ddp::nn
