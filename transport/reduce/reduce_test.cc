#include "transport/reduce/reduce.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/reduce/half.h"
#include "transport/types.h"

namespace ddp::transport::reduce {
namespace {

constexpr DataType kAllTypes[] = {DataType::kF32, DataType::kF64, DataType::kF16,
                                  DataType::kBF16, DataType::kI32, DataType::kI64,
                                  DataType::kU8};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax,
                                ReduceOp::kMin, ReduceOp::kProd};

std::vector<Isa> IsasToTest() {
  std::vector<Isa> isas = {Isa::kGeneric};
  if (DetectIsa() == Isa::kAvx2) isas.push_back(Isa::kAvx2);
  return isas;
}

// ---- Conversions ------------------------------------------------------------

TEST(HalfTest, KnownValuesRoundToNearestEven) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);  // below the halfway point
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // tie goes to even: infinity
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f), 0x3C00);                 // tie -> even (down)
  EXPECT_EQ(FloatToHalf(1.0f + 3 * 0x1p-11f), 0x3C02);             // tie -> even (up)
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);      // above tie
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);                        // smallest subnormal
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);                        // tie -> even (zero)
  EXPECT_EQ(FloatToHalf(1.5f * 0x1p-24f), 0x0002);                 // tie -> even (up)
  EXPECT_EQ(FloatToHalf(0x1p-14f - 0x1p-26f), 0x0400);             // rounds up to normal
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(FloatToHalf(1e-10f), 0x0000);
  const uint16_t nan = FloatToHalf(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7C00, 0x7C00);
  EXPECT_NE(nan & 0x3FF, 0);

  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x03FF), 1023 * 0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_TRUE(std::isinf(HalfToFloat(0xFC00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7C01)));
}

TEST(HalfTest, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    const uint16_t back = FloatToHalf(f);
    if (std::isnan(f)) {
      // Signalling NaNs come back quiet, payload kept.
      EXPECT_EQ(back, h | 0x200) << std::hex << h;
    } else {
      EXPECT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(BFloat16Test, KnownValuesRoundToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f), 0x3F80);              // tie -> even (down)
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * 0x1p-8f), 0x3F82);          // tie -> even (up)
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);   // above tie
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7F80);  // overflow -> inf
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xFF80);
  // A NaN whose payload lives only in the low bits must stay NaN.
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x7F800001u)), 0x7FC0);
  EXPECT_EQ(BFloat16ToFloat(0x4049), std::bit_cast<float>(0x40490000u));
}

// ---- Kernels against a scalar reference --------------------------------------

// A value of `dtype` from a small integer pattern; special values for floats
// are mixed in by the callers that want them.
void Store(DataType dtype, void* base, size_t i, double v) {
  switch (dtype) {
    case DataType::kF32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case DataType::kF64: static_cast<double*>(base)[i] = v; break;
    case DataType::kF16: static_cast<uint16_t*>(base)[i] = FloatToHalf(static_cast<float>(v)); break;
    case DataType::kBF16: static_cast<uint16_t*>(base)[i] = FloatToBFloat16(static_cast<float>(v)); break;
    case DataType::kI32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); break;
    case DataType::kI64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); break;
    case DataType::kU8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(static_cast<int64_t>(v)); break;
  }
}

// Scalar reference for one element, written independently of the kernels.
template <typename T>
T RefOp(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      if constexpr (std::is_integral_v<T>) {
        return static_cast<T>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
      } else {
        return a + b;
      }
    case ReduceOp::kProd:
      if constexpr (std::is_integral_v<T>) {
        return static_cast<T>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
      } else {
        return a * b;
      }
    // IEEE 754-2019 maximum and minimum: NaN wins, and -0 < +0.
    case ReduceOp::kMax:
      if constexpr (std::is_floating_point_v<T>) {
        if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<T>::quiet_NaN();
        if (a == 0 && b == 0) return std::signbit(a) && std::signbit(b) ? -T{0} : T{0};
      }
      return a >= b ? a : b;
    case ReduceOp::kMin:
      if constexpr (std::is_floating_point_v<T>) {
        if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<T>::quiet_NaN();
        if (a == 0 && b == 0) return std::signbit(a) || std::signbit(b) ? -T{0} : T{0};
      }
      return a <= b ? a : b;
  }
  return T{};
}

// Writes the reference of a op b into out[i].
void RefElement(DataType dtype, ReduceOp op, const void* a, const void* b, void* out, size_t i) {
  switch (dtype) {
    case DataType::kF32: {
      auto* o = static_cast<float*>(out);
      o[i] = RefOp(op, static_cast<const float*>(a)[i], static_cast<const float*>(b)[i]);
      break;
    }
    case DataType::kF64: {
      auto* o = static_cast<double*>(out);
      o[i] = RefOp(op, static_cast<const double*>(a)[i], static_cast<const double*>(b)[i]);
      break;
    }
    case DataType::kF16: {
      const float x = HalfToFloat(static_cast<const uint16_t*>(a)[i]);
      const float y = HalfToFloat(static_cast<const uint16_t*>(b)[i]);
      static_cast<uint16_t*>(out)[i] = FloatToHalf(RefOp(op, x, y));
      break;
    }
    case DataType::kBF16: {
      const float x = BFloat16ToFloat(static_cast<const uint16_t*>(a)[i]);
      const float y = BFloat16ToFloat(static_cast<const uint16_t*>(b)[i]);
      static_cast<uint16_t*>(out)[i] = FloatToBFloat16(RefOp(op, x, y));
      break;
    }
    case DataType::kI32: {
      auto* o = static_cast<int32_t*>(out);
      o[i] = RefOp(op, static_cast<const int32_t*>(a)[i], static_cast<const int32_t*>(b)[i]);
      break;
    }
    case DataType::kI64: {
      auto* o = static_cast<int64_t*>(out);
      o[i] = RefOp(op, static_cast<const int64_t*>(a)[i], static_cast<const int64_t*>(b)[i]);
      break;
    }
    case DataType::kU8: {
      auto* o = static_cast<uint8_t*>(out);
      o[i] = RefOp(op, static_cast<const uint8_t*>(a)[i], static_cast<const uint8_t*>(b)[i]);
      break;
    }
  }
}

// Element i of `x` as a double, for messages and NaN-aware comparison.
double Load(DataType dtype, const void* base, size_t i) {
  switch (dtype) {
    case DataType::kF32: return static_cast<const float*>(base)[i];
    case DataType::kF64: return static_cast<const double*>(base)[i];
    case DataType::kF16: return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    case DataType::kBF16: return BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DataType::kI32: return static_cast<const int32_t*>(base)[i];
    case DataType::kI64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DataType::kU8: return static_cast<const uint8_t*>(base)[i];
  }
  return 0;
}

bool IsFloat(DataType dtype) {
  return dtype == DataType::kF32 || dtype == DataType::kF64 || dtype == DataType::kF16 ||
         dtype == DataType::kBF16;
}

// Same bits, or both NaN (NaN payloads are not part of the contract).
void ExpectSameElements(DataType dtype, const void* got, const void* want, size_t n,
                        const std::string& what) {
  const size_t es = DataTypeSize(dtype);
  for (size_t i = 0; i < n; ++i) {
    const auto* g = static_cast<const unsigned char*>(got) + i * es;
    const auto* w = static_cast<const unsigned char*>(want) + i * es;
    if (std::memcmp(g, w, es) == 0) continue;
    const double gv = Load(dtype, got, i), wv = Load(dtype, want, i);
    if (IsFloat(dtype) && std::isnan(gv) && std::isnan(wv)) continue;
    ADD_FAILURE() << what << " element " << i << ": got " << gv << ", want " << wv;
    return;
  }
}

// Random inputs of `dtype`: small signed values for arithmetic, plus (for
// floats) NaN, +-inf and +-0 sprinkled in.
std::vector<unsigned char> RandomBuffer(DataType dtype, size_t n, std::mt19937& rng,
                                        bool specials) {
  std::vector<unsigned char> buf(n * DataTypeSize(dtype) + 1);
  std::uniform_int_distribution<int> small(-300, 300);
  std::uniform_int_distribution<int> pick(0, 15);
  for (size_t i = 0; i < n; ++i) {
    double v = small(rng) / (IsFloat(dtype) ? 7.0 : 1.0);
    if (specials && IsFloat(dtype)) {
      switch (pick(rng)) {
        case 0: v = std::numeric_limits<double>::quiet_NaN(); break;
        case 1: v = std::numeric_limits<double>::infinity(); break;
        case 2: v = -std::numeric_limits<double>::infinity(); break;
        case 3: v = -0.0; break;
        default: break;
      }
    }
    if (dtype == DataType::kU8) v = std::abs(v);
    Store(dtype, buf.data(), i, v);
  }
  return buf;
}

// Aliasing covered: out of place, dst == a, dst == b, a == b, dst == a == b
// (the last two run loops without two __restrict pointers on one buffer).
TEST(ReduceKernelTest, MatchesScalarReferenceForEveryTypeOpIsaAndAliasing) {
  std::mt19937 rng(1234);
  for (Isa isa : IsasToTest()) {
    for (DataType dtype : kAllTypes) {
      for (ReduceOp op : kAllOps) {
        // Lengths straddle the vector widths and unroll factors.
        for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{15}, size_t{16},
                         size_t{17}, size_t{33}, size_t{64}, size_t{1003}}) {
          const std::string what = std::string(IsaName(isa)) + " " + DataTypeName(dtype) +
                                   " " + ReduceOpName(op) + " n=" + std::to_string(n);
          const size_t es = DataTypeSize(dtype);
          auto a = RandomBuffer(dtype, n, rng, /*specials=*/true);
          auto b = RandomBuffer(dtype, n, rng, /*specials=*/true);
          std::vector<unsigned char> want(n * es + 1);
          for (size_t i = 0; i < n; ++i) RefElement(dtype, op, a.data(), b.data(), want.data(), i);
          const ReduceFn fn = GetReduceFn(dtype, op, isa);

          std::vector<unsigned char> dst(n * es + 1);
          fn(dst.data(), a.data(), b.data(), n);
          ExpectSameElements(dtype, dst.data(), want.data(), n, what + " out-of-place");

          auto inout = a;
          fn(inout.data(), inout.data(), b.data(), n);
          ExpectSameElements(dtype, inout.data(), want.data(), n, what + " dst==a");

          auto inout_b = b;
          fn(inout_b.data(), a.data(), inout_b.data(), n);
          ExpectSameElements(dtype, inout_b.data(), want.data(), n, what + " dst==b");

          // One buffer as both inputs, and also as the output.
          std::vector<unsigned char> want_self(n * es + 1);
          for (size_t i = 0; i < n; ++i) RefElement(dtype, op, a.data(), a.data(), want_self.data(), i);
          std::vector<unsigned char> self_out(n * es + 1);
          fn(self_out.data(), a.data(), a.data(), n);
          ExpectSameElements(dtype, self_out.data(), want_self.data(), n, what + " a==b");
          auto self = a;
          fn(self.data(), self.data(), self.data(), n);
          ExpectSameElements(dtype, self.data(), want_self.data(), n, what + " dst==a==b");

          // Off vector alignment by one element (element alignment is the
          // contract): the kernels must not assume more.
          std::vector<unsigned char> a1((n + 1) * es), b1((n + 1) * es), d1((n + 1) * es);
          if (n > 0) {
            std::memcpy(a1.data() + es, a.data(), n * es);
            std::memcpy(b1.data() + es, b.data(), n * es);
          }
          fn(d1.data() + es, a1.data() + es, b1.data() + es, n);
          ExpectSameElements(dtype, d1.data() + es, want.data(), n, what + " misaligned");
        }
      }
    }
  }
}

// max(+0, -0) = +0 and min(+0, -0) = -0 in either operand order (IEEE
// 754-2019), on every float type and ISA, in the vector body and the
// scalar tail, out of place and in place: an all-reduce's zero must not
// change sign with the algorithm that folded the ranks.
TEST(ReduceKernelTest, MaxAndMinOfSignedZerosDoNotDependOnTheOrder) {
  struct Format {
    DataType dtype;
    std::vector<unsigned char> plus, minus;  // +0 and -0, one element
  };
  auto bytes = [](auto v) {
    std::vector<unsigned char> out(sizeof(v));
    std::memcpy(out.data(), &v, sizeof(v));
    return out;
  };
  const Format formats[] = {
      {DataType::kF32, bytes(0.0f), bytes(-0.0f)},
      {DataType::kF64, bytes(0.0), bytes(-0.0)},
      {DataType::kF16, bytes(uint16_t{0x0000}), bytes(uint16_t{0x8000})},
      {DataType::kBF16, bytes(uint16_t{0x0000}), bytes(uint16_t{0x8000})},
  };
  const size_t n = 37;  // whole vectors and a scalar tail on every path
  for (Isa isa : IsasToTest()) {
    for (const Format& f : formats) {
      const size_t es = f.plus.size();
      for (bool plus_first : {true, false}) {
        std::vector<unsigned char> a(n * es), b(n * es);
        for (size_t i = 0; i < n; ++i) {
          std::memcpy(a.data() + i * es, (plus_first ? f.plus : f.minus).data(), es);
          std::memcpy(b.data() + i * es, (plus_first ? f.minus : f.plus).data(), es);
        }
        for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
          const std::vector<unsigned char>& want = op == ReduceOp::kMax ? f.plus : f.minus;
          const ReduceFn fn = GetReduceFn(f.dtype, op, isa);
          std::vector<unsigned char> out(n * es), in_a = a, in_b = b;
          fn(out.data(), a.data(), b.data(), n);
          fn(in_a.data(), in_a.data(), b.data(), n);
          fn(in_b.data(), a.data(), in_b.data(), n);
          for (size_t i = 0; i < n; ++i) {
            const std::string what = std::string(IsaName(isa)) + " " + DataTypeName(f.dtype) +
                                     " " + ReduceOpName(op) + (plus_first ? "(+0, -0)" : "(-0, +0)") +
                                     " element " + std::to_string(i);
            EXPECT_EQ(std::memcmp(out.data() + i * es, want.data(), es), 0) << what << " out-of-place";
            EXPECT_EQ(std::memcmp(in_a.data() + i * es, want.data(), es), 0) << what << " dst==a";
            EXPECT_EQ(std::memcmp(in_b.data() + i * es, want.data(), es), 0) << what << " dst==b";
          }
        }
      }
    }
  }
}

// dst == b must still compute a op b, not b op a: which of two NaNs comes
// out of max and min depends on the order (the RHD all-reduce relies on it
// to give every rank the same bits).
TEST(ReduceKernelTest, AliasingKeepsTheOperandOrderBitForBit) {
  for (Isa isa : IsasToTest()) {
    for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
      const std::string what = std::string(IsaName(isa)) + " " + ReduceOpName(op);
      const float nan1 = std::bit_cast<float>(0x7FC00001u), nan2 = std::bit_cast<float>(0x7FC00002u);
      std::vector<float> a(37, nan1), b(37, nan2), out(37);
      GetReduceFn(DataType::kF32, op, isa)(out.data(), a.data(), b.data(), a.size());
      std::vector<float> inout_b = b;
      GetReduceFn(DataType::kF32, op, isa)(inout_b.data(), a.data(), inout_b.data(), a.size());
      EXPECT_EQ(std::memcmp(out.data(), inout_b.data(), out.size() * sizeof(float)), 0) << what << " f32";
      const double dnan1 = std::bit_cast<double>(0x7FF8000000000001ull);
      const double dnan2 = std::bit_cast<double>(0x7FF8000000000002ull);
      std::vector<double> da(37, dnan1), db(37, dnan2), dout(37);
      GetReduceFn(DataType::kF64, op, isa)(dout.data(), da.data(), db.data(), da.size());
      std::vector<double> dinout_b = db;
      GetReduceFn(DataType::kF64, op, isa)(dinout_b.data(), da.data(), dinout_b.data(), da.size());
      EXPECT_EQ(std::memcmp(dout.data(), dinout_b.data(), dout.size() * sizeof(double)), 0) << what << " f64";
    }
  }
}

TEST(ReduceKernelTest, InPlaceEntryPointUsesDetectedIsa) {
  std::vector<float> a = {1, 2, 3}, b = {10, 20, 30};
  Reduce(DataType::kF32, ReduceOp::kSum, a.data(), b.data(), a.size());
  EXPECT_EQ(a, (std::vector<float>{11, 22, 33}));
  std::vector<float> d(3);
  Reduce(DataType::kF32, ReduceOp::kMax, d.data(), a.data(), b.data(), 3);
  EXPECT_EQ(d, (std::vector<float>{11, 22, 33}));
}

template <typename T>
void ExpectMaxMinPropagateNanAndInf(Isa isa, DataType dtype, T (*enc)(float), float (*dec)(T)) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  //                      a      b     max    min
  const float cases[][4] = {{nan, 1.0f, nan, nan},  {1.0f, nan, nan, nan},
                            {nan, -inf, nan, nan},  {inf, 1.0f, inf, 1.0f},
                            {-inf, 1.0f, 1.0f, -inf}, {inf, -inf, inf, -inf},
                            {-2.0f, -3.0f, -2.0f, -3.0f}};
  const size_t n = std::size(cases);
  // Repeat so the vector body, not only the scalar tail, sees each case.
  const size_t reps = 5;
  std::vector<T> a(n * reps), b(n * reps), mx(n * reps), mn(n * reps);
  for (size_t r = 0; r < reps; ++r) {
    for (size_t i = 0; i < n; ++i) {
      a[r * n + i] = enc(cases[i][0]);
      b[r * n + i] = enc(cases[i][1]);
    }
  }
  GetReduceFn(dtype, ReduceOp::kMax, isa)(mx.data(), a.data(), b.data(), n * reps);
  GetReduceFn(dtype, ReduceOp::kMin, isa)(mn.data(), a.data(), b.data(), n * reps);
  for (size_t k = 0; k < n * reps; ++k) {
    const float* c = cases[k % n];
    const std::string what = std::string(IsaName(isa)) + " " + DataTypeName(dtype) +
                             " case " + std::to_string(k % n);
    if (std::isnan(c[2])) {
      EXPECT_TRUE(std::isnan(dec(mx[k]))) << what << " max";
    } else {
      EXPECT_EQ(dec(mx[k]), c[2]) << what << " max";
    }
    if (std::isnan(c[3])) {
      EXPECT_TRUE(std::isnan(dec(mn[k]))) << what << " min";
    } else {
      EXPECT_EQ(dec(mn[k]), c[3]) << what << " min";
    }
  }
  // inf + -inf is NaN for sum.
  T s;
  T pinf = enc(inf), ninf = enc(-inf);
  GetReduceFn(dtype, ReduceOp::kSum, isa)(&s, &pinf, &ninf, 1);
  EXPECT_TRUE(std::isnan(dec(s))) << IsaName(isa) << " " << DataTypeName(dtype);
}

TEST(ReduceKernelTest, MaxMinPropagateNanAndInfinity) {
  for (Isa isa : IsasToTest()) {
    ExpectMaxMinPropagateNanAndInf<float>(
        isa, DataType::kF32, [](float f) { return f; }, [](float f) { return f; });
    ExpectMaxMinPropagateNanAndInf<double>(
        isa, DataType::kF64, [](float f) { return static_cast<double>(f); },
        [](double d) { return static_cast<float>(d); });
    ExpectMaxMinPropagateNanAndInf<uint16_t>(isa, DataType::kF16, &FloatToHalf, &HalfToFloat);
    ExpectMaxMinPropagateNanAndInf<uint16_t>(isa, DataType::kBF16, &FloatToBFloat16,
                                             &BFloat16ToFloat);
  }
}

TEST(ReduceKernelTest, IntegerSumAndProdWrapAround) {
  for (Isa isa : IsasToTest()) {
    int32_t a32[] = {std::numeric_limits<int32_t>::max(), -5}, b32[] = {1, 3};
    GetReduceFn(DataType::kI32, ReduceOp::kSum, isa)(a32, a32, b32, 2);
    EXPECT_EQ(a32[0], std::numeric_limits<int32_t>::min());
    EXPECT_EQ(a32[1], -2);
    int64_t a64[] = {std::numeric_limits<int64_t>::max()}, b64[] = {2};
    GetReduceFn(DataType::kI64, ReduceOp::kProd, isa)(a64, a64, b64, 1);
    EXPECT_EQ(a64[0], -2);
    uint8_t a8[] = {200, 16, 3}, b8[] = {100, 16, 250};
    uint8_t s8[3], p8[3], m8[3];
    GetReduceFn(DataType::kU8, ReduceOp::kSum, isa)(s8, a8, b8, 3);
    GetReduceFn(DataType::kU8, ReduceOp::kProd, isa)(p8, a8, b8, 3);
    GetReduceFn(DataType::kU8, ReduceOp::kMax, isa)(m8, a8, b8, 3);
    EXPECT_EQ(s8[0], 44);
    EXPECT_EQ(p8[1], 0);  // 256 wraps to 0
    EXPECT_EQ(m8[2], 250);
  }
}

// The AVX2 path converts with F16C and an integer bf16 rounding; both must
// agree bit for bit with the scalar conversions on every 16-bit input.
TEST(ReduceKernelTest, VectorAndScalarHalfPathsAgreeOnEveryInput) {
  if (DetectIsa() != Isa::kAvx2) return;  // Nothing to compare on this CPU.
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  for (DataType dtype : {DataType::kF16, DataType::kBF16}) {
    // 0x8000 is -0; 0x7D01 and 0x7F81 are signalling NaNs (f16, bf16) and
    // 0xFE00 a negative quiet NaN in both, for max/min's NaN choice.
    for (uint16_t other : {uint16_t{0x0000}, uint16_t{0x0001}, uint16_t{0x3C00},
                           uint16_t{0x8400}, uint16_t{0x3555}, uint16_t{0x7BFF},
                           uint16_t{0x4049}, uint16_t{0x8000}, uint16_t{0x7D01},
                           uint16_t{0x7F81}, uint16_t{0xFE00}}) {
      std::vector<uint16_t> b(65536, other);
      for (ReduceOp op : kAllOps) {
        std::vector<uint16_t> generic(65536), avx2(65536);
        GetReduceFn(dtype, op, Isa::kGeneric)(generic.data(), all.data(), b.data(), 65536);
        GetReduceFn(dtype, op, Isa::kAvx2)(avx2.data(), all.data(), b.data(), 65536);
        ExpectSameElements(dtype, avx2.data(), generic.data(), 65536,
                           std::string(DataTypeName(dtype)) + " " + ReduceOpName(op));
        // NaN outputs must also have identical bits: the two paths are the
        // same function, so a difference there is a rounding bug. Except
        // arithmetic on two NaNs, whose surviving payload is the
        // compiler's choice of operand order (see below); max and min
        // choose by rule.
        const bool both_may_be_nan = std::isnan(Load(dtype, b.data(), 0));
        if (both_may_be_nan && op != ReduceOp::kMax && op != ReduceOp::kMin) continue;
        EXPECT_EQ(avx2, generic) << DataTypeName(dtype) << " " << ReduceOpName(op)
                                 << " other=" << other;
      }
    }
  }
  // Random f32 sums land on every rounding case of the bf16 narrowing.
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFF);
  std::vector<uint16_t> a(1 << 16), b(1 << 16), g(1 << 16), v(1 << 16);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<uint16_t>(bits(rng));
    b[i] = static_cast<uint16_t>(bits(rng));
  }
  for (DataType dtype : {DataType::kF16, DataType::kBF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProd}) {
      GetReduceFn(dtype, op, Isa::kGeneric)(g.data(), a.data(), b.data(), a.size());
      GetReduceFn(dtype, op, Isa::kAvx2)(v.data(), a.data(), b.data(), a.size());
      // Both inputs may be NaN here, and which payload survives depends on
      // the operand order the compiler picked for the generic loop (it
      // differs under -fsanitize=thread): NaN only has to stay NaN.
      ExpectSameElements(dtype, v.data(), g.data(), a.size(),
                         std::string(DataTypeName(dtype)) + " " + ReduceOpName(op) + " random");
    }
  }
}

// The overloads that take an Isa refuse one that is not an Isa value, and
// AVX2 on a CPU without it, naming the function and the Isa, instead of
// running the generic kernels or dying of SIGILL.
TEST(IsaTest, ExplicitIsaOverloadsRefuseAnInvalidValue) {
  const Isa bad = static_cast<Isa>(7);
  float x[4] = {1, 2, 3, 4}, y[4] = {1, 1, 1, 1};
  EXPECT_DEATH(GetReduceFn(DataType::kF32, ReduceOp::kSum, bad),
               "GetReduceFn: invalid Isa value 7");
  EXPECT_DEATH(DivideInPlace(DataType::kF32, x, 4, 3, bad), "DivideInPlace: invalid Isa value 7");
  EXPECT_DEATH(SumDivide(DataType::kF32, x, x, y, 4, 3, bad), "SumDivide: invalid Isa value 7");
  EXPECT_DEATH(ScaleInPlace(DataType::kF32, x, 4, 0.5, bad), "ScaleInPlace: invalid Isa value 7");
}

// Also when there is nothing to do (count 0, divisor 1): a bad type is a
// caller's bug whatever the count.
TEST(DataTypeTest, MapsRefuseAnInvalidDataTypeEvenWithNothingToDo) {
  const DataType bad = static_cast<DataType>(9);
  float x[1] = {1};
  EXPECT_DEATH(DivideInPlace(bad, nullptr, 0, 3), "DivideInPlace: invalid DataType value 9");
  EXPECT_DEATH(DivideInPlace(bad, x, 1, 1), "DivideInPlace: invalid DataType value 9");
  EXPECT_DEATH(SumDivide(bad, nullptr, nullptr, nullptr, 0, 3), "SumDivide: invalid DataType value 9");
  EXPECT_DEATH(ScaleInPlace(bad, nullptr, 0, 2.0), "ScaleInPlace: invalid DataType value 9");
}

TEST(IsaTest, Avx2IsRefusedExactlyWhereTheCpuLacksIt) {
  uint16_t h[16] = {}, g[16] = {};
  if (DetectIsa() == Isa::kAvx2) {
    EXPECT_NE(GetReduceFn(DataType::kF16, ReduceOp::kSum, Isa::kAvx2), nullptr);
    DivideInPlace(DataType::kF16, h, 16, 3, Isa::kAvx2);
    SumDivide(DataType::kF16, h, h, g, 16, 3, Isa::kAvx2);
    ScaleInPlace(DataType::kF16, h, 16, 0.5, Isa::kAvx2);
  } else {
    const char* want = "Isa::kAvx2 .*requested, but this CPU does not support it";
    EXPECT_DEATH(GetReduceFn(DataType::kF16, ReduceOp::kSum, Isa::kAvx2), want);
    EXPECT_DEATH(DivideInPlace(DataType::kF16, h, 16, 3, Isa::kAvx2), want);
    EXPECT_DEATH(SumDivide(DataType::kF16, h, h, g, 16, 3, Isa::kAvx2), want);
    EXPECT_DEATH(ScaleInPlace(DataType::kF16, h, 16, 0.5, Isa::kAvx2), want);
  }
}

TEST(DivideInPlaceTest, IntegersTruncateTowardZero) {
  for (Isa isa : IsasToTest()) {
    int32_t i32[] = {-7, 7, -1, 9};
    DivideInPlace(DataType::kI32, i32, 4, 2, isa);
    EXPECT_EQ(i32[0], -3);
    EXPECT_EQ(i32[1], 3);
    EXPECT_EQ(i32[2], 0);
    EXPECT_EQ(i32[3], 4);
    int64_t i64[] = {-9, std::numeric_limits<int64_t>::min()};
    DivideInPlace(DataType::kI64, i64, 2, 4, isa);
    EXPECT_EQ(i64[0], -2);
    EXPECT_EQ(i64[1], std::numeric_limits<int64_t>::min() / 4);
    uint8_t u8[] = {255, 5};
    DivideInPlace(DataType::kU8, u8, 2, 300, isa);  // divisor wider than the type
    EXPECT_EQ(u8[0], 0);
    uint8_t u8b[] = {255, 5};
    DivideInPlace(DataType::kU8, u8b, 2, 2, isa);
    EXPECT_EQ(u8b[0], 127);
    EXPECT_EQ(u8b[1], 2);
  }
}

TEST(DivideInPlaceTest, FloatsDivideAndHalvesRoundToNearestEven) {
  for (Isa isa : IsasToTest()) {
    std::vector<float> f(19);
    std::vector<double> d(19);
    std::vector<uint16_t> h(19), bf(19);
    for (size_t i = 0; i < f.size(); ++i) {
      f[i] = static_cast<float>(i) - 5;
      d[i] = static_cast<double>(i) - 5;
      h[i] = FloatToHalf(static_cast<float>(i) - 5);
      bf[i] = FloatToBFloat16(static_cast<float>(i) - 5);
    }
    DivideInPlace(DataType::kF32, f.data(), f.size(), 3, isa);
    DivideInPlace(DataType::kF64, d.data(), d.size(), 3, isa);
    DivideInPlace(DataType::kF16, h.data(), h.size(), 3, isa);
    DivideInPlace(DataType::kBF16, bf.data(), bf.size(), 3, isa);
    for (size_t i = 0; i < f.size(); ++i) {
      const float x = static_cast<float>(i) - 5;
      EXPECT_EQ(f[i], x / 3.0f) << i;
      EXPECT_EQ(d[i], (static_cast<double>(i) - 5) / 3.0) << i;
      EXPECT_EQ(h[i], FloatToHalf(x / 3.0f)) << i;
      EXPECT_EQ(bf[i], FloatToBFloat16(x / 3.0f)) << i;
    }
  }
}

// Powers of two take a multiply by the exact reciprocal; the bits must be
// those of a true division, also where the result is subnormal or rounds.
TEST(DivideInPlaceTest, PowerOfTwoDivisorsGiveTheBitsOfADivision) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-140, 40);
  std::vector<float> base(1003);
  for (float& x : base) x = std::ldexp(mantissa(gen), exponent(gen));
  base[0] = std::numeric_limits<float>::denorm_min();
  base[1] = -std::numeric_limits<float>::min();
  base[2] = std::numeric_limits<float>::max();
  base[3] = std::numeric_limits<float>::infinity();
  for (Isa isa : IsasToTest()) {
    for (int64_t divisor : {int64_t{2}, int64_t{4}, int64_t{8}, int64_t{64}, int64_t{1} << 40}) {
      std::vector<float> f = base;
      std::vector<double> d(base.begin(), base.end());
      std::vector<uint16_t> h(base.size()), bf(base.size());
      for (size_t i = 0; i < base.size(); ++i) {
        h[i] = FloatToHalf(base[i]);
        bf[i] = FloatToBFloat16(base[i]);
      }
      const std::vector<uint16_t> h0 = h, bf0 = bf;
      DivideInPlace(DataType::kF32, f.data(), f.size(), divisor, isa);
      DivideInPlace(DataType::kF64, d.data(), d.size(), divisor, isa);
      DivideInPlace(DataType::kF16, h.data(), h.size(), divisor, isa);
      DivideInPlace(DataType::kBF16, bf.data(), bf.size(), divisor, isa);
      for (size_t i = 0; i < base.size(); ++i) {
        const float want = base[i] / static_cast<float>(divisor);
        ASSERT_EQ(std::bit_cast<uint32_t>(f[i]), std::bit_cast<uint32_t>(want))
            << base[i] << " / " << divisor << " on " << IsaName(isa);
        ASSERT_EQ(d[i], static_cast<double>(base[i]) / static_cast<double>(divisor));
        ASSERT_EQ(h[i], FloatToHalf(HalfToFloat(h0[i]) / static_cast<float>(divisor))) << i;
        ASSERT_EQ(bf[i], FloatToBFloat16(BFloat16ToFloat(bf0[i]) / static_cast<float>(divisor)))
            << i;
      }
    }
  }
}

// The fused last fold of kAvg gives the bits of a sum pass followed by a
// division pass, for every type, divisor, ISA and aliasing (dst = a, dst =
// b, separate), on random inputs with NaN, infinities, signed zeros and
// (for the power-of-two divisors) results that become subnormal.
TEST(SumDivideTest, SameBitsAsASumThenADivision) {
  std::mt19937 rng(11);
  const size_t n = 10007;  // odd, and more than one of the fallback's blocks
  for (Isa isa : IsasToTest()) {
    for (DataType dtype : kAllTypes) {
      for (int64_t divisor : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{6}, int64_t{1} << 40}) {
        std::vector<unsigned char> a = RandomBuffer(dtype, n, rng, /*specials=*/true);
        std::vector<unsigned char> b = RandomBuffer(dtype, n, rng, /*specials=*/true);
        if (dtype == DataType::kF32) {
          // Tiny values: their sums divided by 2^k are subnormal.
          for (size_t i = 0; i < n; i += 5) {
            Store(dtype, a.data(), i, std::ldexp(1.0, -125) * static_cast<double>(i % 7));
          }
        }
        std::vector<unsigned char> want(a.size());
        Reduce(dtype, ReduceOp::kSum, want.data(), a.data(), b.data(), n);
        DivideInPlace(dtype, want.data(), n, divisor, isa);
        const std::string what = std::string(DataTypeName(dtype)) + " / " + std::to_string(divisor) +
                                 " on " + IsaName(isa);
        std::vector<unsigned char> out(a.size());
        SumDivide(dtype, out.data(), a.data(), b.data(), n, divisor, isa);
        ExpectSameElements(dtype, out.data(), want.data(), n, what + ", separate output");
        std::vector<unsigned char> in_a = a;
        SumDivide(dtype, in_a.data(), in_a.data(), b.data(), n, divisor, isa);
        ExpectSameElements(dtype, in_a.data(), want.data(), n, what + ", into a");
        std::vector<unsigned char> in_b = b;
        SumDivide(dtype, in_b.data(), a.data(), in_b.data(), n, divisor, isa);
        ExpectSameElements(dtype, in_b.data(), want.data(), n, what + ", into b");
      }
    }
  }
}

TEST(ScaleInPlaceTest, ScalesFloatsAndSaturatesIntegers) {
  for (Isa isa : IsasToTest()) {
    std::vector<float> f = {1, -2, 3, 4, 5, 6, 7, 8, 9};
    ScaleInPlace(DataType::kF32, f.data(), f.size(), 0.5, isa);
    EXPECT_EQ(f[1], -1.0f);
    EXPECT_EQ(f[8], 4.5f);
    std::vector<uint16_t> h(9, FloatToHalf(3.0f));
    ScaleInPlace(DataType::kF16, h.data(), h.size(), 0.25, isa);
    EXPECT_EQ(h[8], FloatToHalf(0.75f));
    int32_t i32[] = {-7, 1 << 30};
    ScaleInPlace(DataType::kI32, i32, 2, 4.0, isa);
    EXPECT_EQ(i32[0], -28);
    EXPECT_EQ(i32[1], std::numeric_limits<int32_t>::max());
    uint8_t u8[] = {7, 200};
    ScaleInPlace(DataType::kU8, u8, 2, 0.5, isa);
    EXPECT_EQ(u8[0], 3);
    EXPECT_EQ(u8[1], 100);
  }
}

// The 16-bit float nearest to d, ties to the even bit pattern, found by a
// search over the format's bit patterns (independent of the kernels'
// rounding code). `dec` decodes; `inf_bits` is +infinity's pattern.
uint16_t NearestSixteenBit(double d, float (*dec)(uint16_t), uint16_t inf_bits) {
  const uint16_t sign = std::signbit(d) ? 0x8000 : 0;
  const long double m = std::fabs(static_cast<long double>(d));
  auto value = [&](uint32_t bits) -> long double {
    if (bits < inf_bits) return dec(static_cast<uint16_t>(bits));
    // Infinity counts as the next step after the largest finite value.
    return 2.0L * dec(static_cast<uint16_t>(inf_bits - 1)) - dec(static_cast<uint16_t>(inf_bits - 2));
  };
  if (m >= value(inf_bits)) return sign | inf_bits;
  uint32_t lo = 0, hi = inf_bits;  // value(lo) <= m < value(hi)
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    (value(mid) <= m ? lo : hi) = mid;
  }
  const long double below = m - value(lo), above = value(hi) - m;
  const uint32_t pick = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
  return static_cast<uint16_t>(sign | pick);
}

// ScaleInPlace rounds the double product once, as `x *= factor` does for a
// float x: the factor is not rounded to float first, and f16/bf16 are not
// rounded to f32 on the way.
TEST(ScaleInPlaceTest, RoundsTheDoubleProductOnce) {
  // The last two were found by a search: through f32 they round f16 0x04E5
  // to 0x1096 (want 0x1095) and bf16 0x00A5 to 0x0142 (want 0x0141).
  const double factors[] = {1.0 / 3, 0.1, 1.0 / 7, 3.7, -2.0 / 3, 7.4924179072348736,
                            2.3454544634733936};
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> value(-1000.0f, 1000.0f);
  std::vector<float> base(1003);
  for (float& x : base) x = value(rng);
  base[0] = 5.0f;
  for (Isa isa : IsasToTest()) {
    for (double factor : factors) {
      const std::string what = std::string(IsaName(isa)) + " factor " + std::to_string(factor);
      std::vector<float> f = base;
      ScaleInPlace(DataType::kF32, f.data(), f.size(), factor, isa);
      for (size_t i = 0; i < f.size(); ++i) {
        float want = base[i];
        want *= factor;  // C++: computed in double, rounded once
        ASSERT_EQ(std::bit_cast<uint32_t>(f[i]), std::bit_cast<uint32_t>(want))
            << what << ": f32 " << base[i] << " * factor";
      }
      for (DataType dtype : {DataType::kF16, DataType::kBF16}) {
        const bool is_f16 = dtype == DataType::kF16;
        float (*dec)(uint16_t) = is_f16 ? &HalfToFloat : &BFloat16ToFloat;
        const uint16_t inf_bits = is_f16 ? 0x7C00 : 0x7F80;
        std::vector<uint16_t> h(65536);
        for (uint32_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i);
        ScaleInPlace(dtype, h.data(), h.size(), factor, isa);
        int wrong = 0;
        for (uint32_t i = 0; i < h.size(); ++i) {
          const float x = dec(static_cast<uint16_t>(i));
          if (std::isnan(x)) {
            EXPECT_TRUE(std::isnan(dec(h[i]))) << what << " " << DataTypeName(dtype) << " " << i;
            continue;
          }
          const uint16_t want = NearestSixteenBit(static_cast<double>(x) * factor, dec, inf_bits);
          if (h[i] != want && ++wrong <= 3) {
            ADD_FAILURE() << what << " " << DataTypeName(dtype) << ": " << x << " (0x" << std::hex
                          << i << ") gave 0x" << h[i] << ", want 0x" << want << std::dec;
          }
        }
        EXPECT_EQ(wrong, 0) << what << " " << DataTypeName(dtype) << " inputs rounded wrongly";
      }
    }
  }
}

}  // namespace
}  // namespace ddp::transport::reduce
