#include "nn/tensor/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

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
