#include "transport/reduce/reduce.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "transport/reduce/half.h"

// Everything that names AVX2 (the target attribute, intrinsics, the
// kernels, the variables that pick them) stays inside
// `#if DDP_REDUCE_HAVE_X86`: other architectures (aarch64) reject the
// attribute's feature names and build the generic kernels only.
#if defined(__x86_64__)
#include <immintrin.h>
#define DDP_REDUCE_HAVE_X86 1
// The AVX2 kernels are ordinary C++ compiled for a wider ISA through the
// target attribute, so the build stays portable (no -mavx2 on the command
// line) and the choice is made at run time from CPUID. Helpers are forced
// inline into the attributed functions so that their loops are vectorized
// for AVX2 rather than emitted once for the baseline.
#define DDP_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define DDP_REDUCE_HAVE_X86 0
#endif

#define DDP_INLINE __attribute__((always_inline)) inline

namespace ddp::transport::reduce {
namespace {

[[noreturn]] void DieBadEnum(const char* what, int value) {
  std::fprintf(stderr, "fatal: reduce: invalid %s value %d\n", what, value);
  std::abort();
}

// ---- Scalar element operations -------------------------------------------

// Integer sum and product go through the unsigned type so that overflow
// wraps (defined) instead of being undefined behaviour; the loops still
// vectorize to plain vector adds and multiplies.
template <typename T>
DDP_INLINE T WrapAdd(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <typename T>
DDP_INLINE T WrapMul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    // uint8_t promotes to int, whose product of two bytes cannot overflow.
    using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned,
                                 std::make_unsigned_t<T>>;
    return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}

template <typename T>
struct SumOp {
  static DDP_INLINE T Apply(T a, T b) { return WrapAdd(a, b); }
};

template <typename T>
struct ProdOp {
  static DDP_INLINE T Apply(T a, T b) { return WrapMul(a, b); }
};

// The bits of two floats ANDed or ORed. Where a == b the two are either the
// same bits or +0 and -0: AND then gives +0 and OR gives -0, the IEEE
// 754-2019 maximum and minimum of the pair in either order.
template <typename T>
DDP_INLINE T SignedZeroMax(T a, T b) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  return std::bit_cast<T>(static_cast<U>(std::bit_cast<U>(a) & std::bit_cast<U>(b)));
}

template <typename T>
DDP_INLINE T SignedZeroMin(T a, T b) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  return std::bit_cast<T>(static_cast<U>(std::bit_cast<U>(a) | std::bit_cast<U>(b)));
}

// Floats follow IEEE 754-2019 maximum/minimum: a NaN in either operand wins
// (a's when both are NaN; `a != a` is the NaN test), and -0 < +0, so the
// sign of a zero result does not depend on which rank's value came first.
// Without NaN, `x > y ? x : y` in both orders (each one maxps) differ only
// on a tie, which SignedZeroMax settles; then a NaN is selected in, a's
// first. Selects, not branches, so the loops vectorize. Cost against the
// old single compare-and-select, which got the zero's sign wrong
// (reduce_bench, max, median of 3, one x86 core): AVX2 f32/f64 the same out
// of place and about 12% slower in place in L2 (256 KiB), the same from
// memory (16 MiB); generic SSE2 f32/f64 about a third slower in L2.
template <typename T>
struct MaxOp {
  static DDP_INLINE T Apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      const T ordered = SignedZeroMax(a > b ? a : b, b > a ? b : a);
      const T b_nan = b != b ? b : ordered;
      return a != a ? a : b_nan;
    } else {
      return a > b ? a : b;
    }
  }
};

template <typename T>
struct MinOp {
  static DDP_INLINE T Apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      const T ordered = SignedZeroMin(a < b ? a : b, b < a ? b : a);
      const T b_nan = b != b ? b : ordered;
      return a != a ? a : b_nan;
    } else {
      return a < b ? a : b;
    }
  }
};

// ---- Plain loops (native element types) ----------------------------------

template <typename T, typename Op>
DDP_INLINE void OutOfPlaceLoop(T* __restrict dst, const T* __restrict a,
                               const T* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Op::Apply(a[i], b[i]);
}

template <typename T, typename Op>
DDP_INLINE void InPlaceLoop(T* __restrict inout, const T* __restrict in, size_t n) {
  for (size_t i = 0; i < n; ++i) inout[i] = Op::Apply(inout[i], in[i]);
}

template <typename T, typename Op>
DDP_INLINE void InPlaceLoopSecond(T* __restrict inout, const T* __restrict in, size_t n) {
  for (size_t i = 0; i < n; ++i) inout[i] = Op::Apply(in[i], inout[i]);
}

// a == b (dst may be a too): one input, so no two __restrict pointers can
// name the same buffer (which would be undefined behaviour).
template <typename T, typename Op>
DDP_INLINE void SelfInPlaceLoop(T* inout, size_t n) {
  for (size_t i = 0; i < n; ++i) inout[i] = Op::Apply(inout[i], inout[i]);
}

template <typename T, typename Op>
DDP_INLINE void SelfLoop(T* __restrict dst, const T* __restrict in, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Op::Apply(in[i], in[i]);
}

// Routes the aliasing cases to loops whose pointers are truly disjoint, so
// the vectorizer needs no run-time overlap checks. The operands keep their
// order: which of two NaNs comes out of max, min or sum depends on it.
template <typename T, typename Op>
DDP_INLINE void RunLoops(void* dst, const void* a, const void* b, size_t n) {
  T* d = static_cast<T*>(dst);
  if (a == b) {
    if (dst == a) {
      SelfInPlaceLoop<T, Op>(d, n);
    } else {
      SelfLoop<T, Op>(d, static_cast<const T*>(a), n);
    }
  } else if (dst == a) {
    InPlaceLoop<T, Op>(d, static_cast<const T*>(b), n);
  } else if (dst == b) {
    InPlaceLoopSecond<T, Op>(d, static_cast<const T*>(a), n);
  } else {
    OutOfPlaceLoop<T, Op>(d, static_cast<const T*>(a), static_cast<const T*>(b), n);
  }
}

template <typename T, typename Op>
struct GenericKernel {
  static void Run(void* dst, const void* a, const void* b, size_t n) {
    RunLoops<T, Op>(dst, a, b, n);
  }
};

// ---- 16-bit float formats -------------------------------------------------

struct F16Format {
  static DDP_INLINE float ToFloat(uint16_t v) { return HalfToFloat(v); }
  static DDP_INLINE uint16_t FromFloat(float f) { return FloatToHalf(f); }
};

struct BF16Format {
  static DDP_INLINE float ToFloat(uint16_t v) { return BFloat16ToFloat(v); }
  static DDP_INLINE uint16_t FromFloat(float f) { return FloatToBFloat16(f); }
};

// Widen, combine in f32, round back: one rounding per call.
template <typename Fmt, typename Op>
struct GenericHalfKernel {
  static void Run(void* dst, const void* a, const void* b, size_t n) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    const uint16_t* x = static_cast<const uint16_t*>(a);
    const uint16_t* y = static_cast<const uint16_t*>(b);
    for (size_t i = 0; i < n; ++i) {
      d[i] = Fmt::FromFloat(Op::Apply(Fmt::ToFloat(x[i]), Fmt::ToFloat(y[i])));
    }
  }
};

#if DDP_REDUCE_HAVE_X86

template <typename T, typename Op>
struct Avx2Kernel {
  DDP_AVX2 static void Run(void* dst, const void* a, const void* b, size_t n) {
    RunLoops<T, Op>(dst, a, b, n);
  }
};

// Eight f32 lanes per vector. The scalar Op is used for the tail, so both
// paths round identically.
struct VecSum {
  DDP_AVX2 static DDP_INLINE __m256 Apply(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
};
struct VecProd {
  DDP_AVX2 static DDP_INLINE __m256 Apply(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
};
// F16C converts eight halves per instruction, rounding to nearest-even.
struct F16Vec {
  DDP_AVX2 static DDP_INLINE __m256 Load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  DDP_AVX2 static DDP_INLINE void Store(uint16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  DDP_AVX2 static DDP_INLINE void Store2(uint16_t* p, __m256 lo, __m256 hi) {
    Store(p, lo);
    Store(p + 8, hi);
  }
};

// bf16 has no conversion instruction in AVX2: widen by shifting into the top
// half of each 32-bit lane; narrow with the same integer round-to-nearest-
// even as FloatToBFloat16 (add 0x7FFF plus the lowest kept bit), keeping
// NaNs quiet.
struct BF16Vec {
  DDP_AVX2 static DDP_INLINE __m256 Load(const uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  // Rounded bf16 bits in the low half of each 32-bit lane.
  DDP_AVX2 static DDP_INLINE __m256i Round(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i quiet_nan =
        _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  }
  DDP_AVX2 static DDP_INLINE void Store(uint16_t* p, __m256 v) {
    // packus works within 128-bit lanes: [r0..3 r0..3 | r4..7 r4..7]; the
    // permute gathers qwords 0 and 2 into the low half.
    const __m256i r = Round(v);
    const __m256i ordered = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(ordered));
  }
  // Sixteen at once: one pack and one permute for two vectors.
  // packus gives [lo0..3 hi0..3 | lo4..7 hi4..7]; qword order 0,2,1,3 fixes it.
  DDP_AVX2 static DDP_INLINE void Store2(uint16_t* p, __m256 lo, __m256 hi) {
    const __m256i packed = _mm256_packus_epi32(Round(lo), Round(hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
  }
};

template <typename Fmt, typename Vec, typename ScalarOp, typename VecOp>
struct Avx2HalfKernel {
  DDP_AVX2 static void Run(void* dst, const void* a, const void* b, size_t n) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    const uint16_t* x = static_cast<const uint16_t*>(a);
    const uint16_t* y = static_cast<const uint16_t*>(b);
    size_t i = 0;
    // Two vectors per iteration to keep two independent chains in flight.
    for (; i + 16 <= n; i += 16) {
      const __m256 r0 = VecOp::Apply(Vec::Load(x + i), Vec::Load(y + i));
      const __m256 r1 = VecOp::Apply(Vec::Load(x + i + 8), Vec::Load(y + i + 8));
      Vec::Store2(d + i, r0, r1);
    }
    for (; i + 8 <= n; i += 8) {
      Vec::Store(d + i, VecOp::Apply(Vec::Load(x + i), Vec::Load(y + i)));
    }
    for (; i < n; ++i) {
      d[i] = Fmt::FromFloat(ScalarOp::Apply(Fmt::ToFloat(x[i]), Fmt::ToFloat(y[i])));
    }
  }
};

#endif  // DDP_REDUCE_HAVE_X86

// ---- Kernel tables --------------------------------------------------------

template <template <typename, typename> class K, typename T>
ReduceFn NativeFor(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return &K<T, SumOp<T>>::Run;
    case ReduceOp::kMax:
      return &K<T, MaxOp<T>>::Run;
    case ReduceOp::kMin:
      return &K<T, MinOp<T>>::Run;
    case ReduceOp::kProd:
      return &K<T, ProdOp<T>>::Run;
  }
  DieBadEnum("ReduceOp", static_cast<int>(op));
}

template <typename Fmt>
ReduceFn GenericHalfFor(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return &GenericHalfKernel<Fmt, SumOp<float>>::Run;
    case ReduceOp::kMax:
      return &GenericHalfKernel<Fmt, MaxOp<float>>::Run;
    case ReduceOp::kMin:
      return &GenericHalfKernel<Fmt, MinOp<float>>::Run;
    case ReduceOp::kProd:
      return &GenericHalfKernel<Fmt, ProdOp<float>>::Run;
  }
  DieBadEnum("ReduceOp", static_cast<int>(op));
}

#if DDP_REDUCE_HAVE_X86
// Max and min of 16-bit floats without widening: the result is one of the
// inputs, so the bit patterns are compared as integers, sixteen lanes at a
// time. x ^ ((x >> 15) & 0x7FFF) (arithmetic shift) maps the patterns to
// signed integers in the order of their values, with -0 just below +0: the
// IEEE 754-2019 rule of MaxOp/MinOp. A NaN comes out as the f32 round trip
// of the generic kernel leaves it: a's if a is NaN, else b's, with kQuiet
// set. The tail runs the scalar op through f32, the same function.
// kInf: +infinity's bits (a larger magnitude is NaN); kQuiet: the bit that
// the round trip through f32 sets in a NaN.
template <typename Fmt>
struct HalfBits;
template <>
struct HalfBits<F16Format> {
  static constexpr uint16_t kInf = 0x7C00, kQuiet = 0x0200;
};
template <>
struct HalfBits<BF16Format> {
  static constexpr uint16_t kInf = 0x7F80, kQuiet = 0x0040;
};

template <typename Fmt, typename ScalarOp, bool kMax>
struct Avx2HalfMaxMinKernel {
  DDP_AVX2 static DDP_INLINE __m256i Key(__m256i x) {
    return _mm256_xor_si256(
        x, _mm256_and_si256(_mm256_srai_epi16(x, 15), _mm256_set1_epi16(0x7FFF)));
  }
  DDP_AVX2 static DDP_INLINE __m256i IsNan(__m256i x) {
    return _mm256_cmpgt_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7FFF)),
                              _mm256_set1_epi16(static_cast<short>(HalfBits<Fmt>::kInf)));
  }
  DDP_AVX2 static void Run(void* dst, const void* a, const void* b, size_t n) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    const uint16_t* x = static_cast<const uint16_t*>(a);
    const uint16_t* y = static_cast<const uint16_t*>(b);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + i));
      const __m256i a_wins =
          kMax ? _mm256_cmpgt_epi16(Key(va), Key(vb)) : _mm256_cmpgt_epi16(Key(vb), Key(va));
      const __m256i ordered = _mm256_blendv_epi8(vb, va, a_wins);
      const __m256i a_nan = IsNan(va);
      const __m256i nan = _mm256_or_si256(_mm256_blendv_epi8(vb, va, a_nan),
                                          _mm256_set1_epi16(static_cast<short>(HalfBits<Fmt>::kQuiet)));
      const __m256i any_nan = _mm256_or_si256(a_nan, IsNan(vb));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i),
                          _mm256_blendv_epi8(ordered, nan, any_nan));
    }
    for (; i < n; ++i) {
      d[i] = Fmt::FromFloat(ScalarOp::Apply(Fmt::ToFloat(x[i]), Fmt::ToFloat(y[i])));
    }
  }
};

template <typename Fmt, typename Vec>
ReduceFn Avx2HalfFor(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return &Avx2HalfKernel<Fmt, Vec, SumOp<float>, VecSum>::Run;
    case ReduceOp::kMax:
      return &Avx2HalfMaxMinKernel<Fmt, MaxOp<float>, true>::Run;
    case ReduceOp::kMin:
      return &Avx2HalfMaxMinKernel<Fmt, MinOp<float>, false>::Run;
    case ReduceOp::kProd:
      return &Avx2HalfKernel<Fmt, Vec, ProdOp<float>, VecProd>::Run;
  }
  DieBadEnum("ReduceOp", static_cast<int>(op));
}
#endif

template <template <typename, typename> class K>
ReduceFn NativeTable(DataType dtype, ReduceOp op) {
  switch (dtype) {
    case DataType::kF32: return NativeFor<K, float>(op);
    case DataType::kF64: return NativeFor<K, double>(op);
    case DataType::kI32: return NativeFor<K, int32_t>(op);
    case DataType::kI64: return NativeFor<K, int64_t>(op);
    case DataType::kU8: return NativeFor<K, uint8_t>(op);
    case DataType::kF16:
    case DataType::kBF16:
      break;
  }
  DieBadEnum("DataType", static_cast<int>(dtype));
}

// ---- Element-wise maps (divide, scale) ------------------------------------

// Integers: result truncated toward zero and clamped to the type's range
// (only ScaleInPlace with a large factor can leave it).
template <typename T>
T FromDoubleSaturating(double v) {
  if (!(v == v)) return 0;
  if (v <= static_cast<double>(std::numeric_limits<T>::lowest())) {
    return std::numeric_limits<T>::lowest();
  }
  if (v >= static_cast<double>(std::numeric_limits<T>::max())) {
    return std::numeric_limits<T>::max();
  }
  return static_cast<T>(v);
}

template <typename T>
DDP_INLINE void DivideNative(T* __restrict p, size_t n, int64_t divisor) {
  if constexpr (std::is_floating_point_v<T>) {
    // A power of two has an exact reciprocal, and x * 2^-k rounds the same
    // exact value x / 2^k does: the same bits for a fraction of a divide's
    // cost (2 and 4 ranks, the common cases).
    if ((divisor & (divisor - 1)) == 0) {
      const T r = T{1} / static_cast<T>(divisor);
      for (size_t i = 0; i < n; ++i) p[i] = p[i] * r;
      return;
    }
    const T d = static_cast<T>(divisor);
    for (size_t i = 0; i < n; ++i) p[i] = p[i] / d;
  } else {
    // C++ integer division truncates toward zero, as kAvg promises.
    for (size_t i = 0; i < n; ++i) {
      p[i] = static_cast<T>(static_cast<int64_t>(p[i]) / divisor);
    }
  }
}

// f32 and f64: each sum rounds to T and is then divided, exactly as a sum
// pass followed by DivideNative's pass (no fused multiply-add can form:
// the product's operand is the rounded sum). No __restrict: dst may be a.
template <typename T>
DDP_INLINE void SumDivideFloat(T* d, const T* a, const T* b, size_t n, int64_t divisor) {
  if ((divisor & (divisor - 1)) == 0) {
    const T r = T{1} / static_cast<T>(divisor);
    for (size_t i = 0; i < n; ++i) d[i] = (a[i] + b[i]) * r;
    return;
  }
  const T q = static_cast<T>(divisor);
  for (size_t i = 0; i < n; ++i) d[i] = (a[i] + b[i]) / q;
}

// Floats: the product is taken in double and rounded once to T, as C++'s
// `x *= factor` does for a float x (rounding the factor to float first
// would round twice: 5.0f * (1.0 / 3) gave 0x3FD55556, not 0x3FD55555).
template <typename T>
DDP_INLINE void ScaleNative(T* __restrict p, size_t n, double factor) {
  if constexpr (std::is_floating_point_v<T>) {
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(static_cast<double>(p[i]) * factor);
  } else {
    for (size_t i = 0; i < n; ++i) {
      p[i] = FromDoubleSaturating<T>(static_cast<double>(p[i]) * factor);
    }
  }
}

// A unary f32 map applied to 16-bit floats: x -> x / d or x -> x * f.
struct DivideBy {
  float d;
  DDP_INLINE float operator()(float x) const { return x / d; }
#if DDP_REDUCE_HAVE_X86
  DDP_AVX2 DDP_INLINE __m256 Vec(__m256 x) const { return _mm256_div_ps(x, _mm256_set1_ps(d)); }
#endif
};

struct MultiplyBy {
  float f;
  DDP_INLINE float operator()(float x) const { return x * f; }
#if DDP_REDUCE_HAVE_X86
  DDP_AVX2 DDP_INLINE __m256 Vec(__m256 x) const { return _mm256_mul_ps(x, _mm256_set1_ps(f)); }
#endif
};

// d rounded to f32 toward zero, with the last bit set when that dropped
// anything ("round to odd"). Rounding that float to nearest-even again, to a
// format with at least two fewer significand bits (f16: 11, bf16: 8, against
// f32's 24), gives the same bits as rounding d there directly: the odd bit
// stands for everything that was dropped, so no tie is made or lost.
inline float RoundToOddFloat(double d) {
  float f = static_cast<float>(d);
  if (d != d || static_cast<double>(f) == d) return f;  // NaN, or exact
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) {
    f = std::nextafter(f, 0.0f);  // rounded away from zero (also to inf)
  }
  return std::bit_cast<float>(std::bit_cast<uint32_t>(f) | 1u);
}

// data[i] *= factor for 16-bit floats: the double product rounded once to
// 16 bits. Scalar on every ISA: nothing on a collective's path scales.
template <typename Fmt>
void ScaleHalf(uint16_t* p, size_t n, double factor) {
  for (size_t i = 0; i < n; ++i) {
    p[i] = Fmt::FromFloat(RoundToOddFloat(static_cast<double>(Fmt::ToFloat(p[i])) * factor));
  }
}

template <typename Fmt, typename Fn>
void GenericHalfMap(uint16_t* p, size_t n, Fn fn) {
  for (size_t i = 0; i < n; ++i) p[i] = Fmt::FromFloat(fn(Fmt::ToFloat(p[i])));
}

#if DDP_REDUCE_HAVE_X86
template <typename Fmt, typename Vec, typename Fn>
DDP_AVX2 void Avx2HalfMap(uint16_t* p, size_t n, Fn fn) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) Vec::Store(p + i, fn.Vec(Vec::Load(p + i)));
  for (; i < n; ++i) p[i] = Fmt::FromFloat(fn(Fmt::ToFloat(p[i])));
}

template <typename T>
DDP_AVX2 void DivideNativeAvx2(T* p, size_t n, int64_t divisor) {
  DivideNative<T>(p, n, divisor);
}

template <typename T>
DDP_AVX2 void ScaleNativeAvx2(T* p, size_t n, double factor) {
  ScaleNative<T>(p, n, factor);
}

template <typename T>
DDP_AVX2 void SumDivideFloatAvx2(T* d, const T* a, const T* b, size_t n, int64_t divisor) {
  SumDivideFloat<T>(d, a, b, n, divisor);
}
#endif

template <typename T>
void DivideNativeGeneric(T* p, size_t n, int64_t divisor) {
  DivideNative<T>(p, n, divisor);
}

template <typename T>
void ScaleNativeGeneric(T* p, size_t n, double factor) {
  ScaleNative<T>(p, n, factor);
}

// Applies `native(T*)` for native types and `half(Fmt, Vec)` for 16-bit
// floats; shared by DivideInPlace and ScaleInPlace.
template <typename Native, typename Half>
void MapByType(DataType dtype, void* data, Native native, Half half) {
  switch (dtype) {
    case DataType::kF32: native(static_cast<float*>(data)); return;
    case DataType::kF64: native(static_cast<double*>(data)); return;
    case DataType::kI32: native(static_cast<int32_t*>(data)); return;
    case DataType::kI64: native(static_cast<int64_t*>(data)); return;
    case DataType::kU8: native(static_cast<uint8_t*>(data)); return;
    case DataType::kF16: half(F16Format{}, static_cast<uint16_t*>(data), /*is_f16=*/true); return;
    case DataType::kBF16: half(BF16Format{}, static_cast<uint16_t*>(data), false); return;
  }
  DieBadEnum("DataType", static_cast<int>(dtype));
}

bool CpuHasAvx2() {
#if DDP_REDUCE_HAVE_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

}  // namespace

Isa DetectIsa() {
  static const Isa isa = CpuHasAvx2() ? Isa::kAvx2 : Isa::kGeneric;
  return isa;
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kGeneric: return "generic";
    case Isa::kAvx2: return "avx2";
  }
  return "unknown";
}

namespace {

// The overloads that take an Isa run exactly what they are given, so they
// check it first: an unknown value would silently run the generic kernels,
// and AVX2 on a CPU without it would die of SIGILL mid-collective.
void CheckIsa(Isa isa, const char* caller) {
  switch (isa) {
    case Isa::kGeneric:
      return;
    case Isa::kAvx2:
      if (DetectIsa() == Isa::kAvx2) return;
      std::fprintf(stderr,
                   "fatal: reduce: %s: Isa::kAvx2 (AVX2 + FMA + F16C) requested, but this "
                   "CPU does not support it (DetectIsa() is %s)\n",
                   caller, IsaName(DetectIsa()));
      std::abort();
  }
  std::fprintf(stderr, "fatal: reduce: %s: invalid Isa value %d (kGeneric = 0, kAvx2 = 1)\n",
               caller, static_cast<int>(isa));
  std::abort();
}

// For the maps that return early (count 0, divisor 1) before the type
// switch: an invalid DataType is refused there too, not only when there is
// work to do.
void CheckDataType(DataType dtype, const char* caller) {
  if (DataTypeSize(dtype) != 0) return;
  std::fprintf(stderr, "fatal: reduce: %s: invalid DataType value %d\n", caller,
               static_cast<int>(dtype));
  std::abort();
}

}  // namespace

ReduceFn GetReduceFn(DataType dtype, ReduceOp op) {
  return GetReduceFn(dtype, op, DetectIsa());
}

ReduceFn GetReduceFn(DataType dtype, ReduceOp op, Isa isa) {
  CheckIsa(isa, "GetReduceFn");
#if DDP_REDUCE_HAVE_X86
  const bool avx2 = isa == Isa::kAvx2;
#endif
  if (dtype == DataType::kF16) {
#if DDP_REDUCE_HAVE_X86
    if (avx2) return Avx2HalfFor<F16Format, F16Vec>(op);
#endif
    return GenericHalfFor<F16Format>(op);
  }
  if (dtype == DataType::kBF16) {
#if DDP_REDUCE_HAVE_X86
    if (avx2) return Avx2HalfFor<BF16Format, BF16Vec>(op);
#endif
    return GenericHalfFor<BF16Format>(op);
  }
#if DDP_REDUCE_HAVE_X86
  if (avx2) return NativeTable<Avx2Kernel>(dtype, op);
#endif
  return NativeTable<GenericKernel>(dtype, op);
}

void Reduce(DataType dtype, ReduceOp op, void* inout, const void* in, size_t count) {
  GetReduceFn(dtype, op)(inout, inout, in, count);
}

void Reduce(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b,
            size_t count) {
  GetReduceFn(dtype, op)(dst, a, b, count);
}

void DivideInPlace(DataType dtype, void* data, size_t count, int64_t divisor) {
  DivideInPlace(dtype, data, count, divisor, DetectIsa());
}

void DivideInPlace(DataType dtype, void* data, size_t count, int64_t divisor, Isa isa) {
  CheckIsa(isa, "DivideInPlace");
  CheckDataType(dtype, "DivideInPlace");
  if (divisor <= 0) {
    std::fprintf(stderr, "fatal: reduce: DivideInPlace by non-positive divisor %lld\n",
                 static_cast<long long>(divisor));
    std::abort();
  }
  if (divisor == 1 || count == 0) return;
#if DDP_REDUCE_HAVE_X86
  const bool avx2 = isa == Isa::kAvx2;
#endif
  MapByType(
      dtype, data,
      [&](auto* p) {
#if DDP_REDUCE_HAVE_X86
        if (avx2) return DivideNativeAvx2(p, count, divisor);
#endif
        DivideNativeGeneric(p, count, divisor);
      },
      [&](auto fmt, uint16_t* p, bool is_f16) {
        using Fmt = decltype(fmt);
        auto map = [&](auto fn) {
#if DDP_REDUCE_HAVE_X86
          if (avx2) {
            if (is_f16) return Avx2HalfMap<F16Format, F16Vec>(p, count, fn);
            return Avx2HalfMap<BF16Format, BF16Vec>(p, count, fn);
          }
#endif
          (void)is_f16;
          GenericHalfMap<Fmt>(p, count, fn);
        };
        // Exact reciprocal of a power of two: the same result in f32 (see
        // DivideNative), then the same rounding to 16 bits.
        if ((divisor & (divisor - 1)) == 0) return map(MultiplyBy{1.0f / static_cast<float>(divisor)});
        map(DivideBy{static_cast<float>(divisor)});
      });
}

void SumDivide(DataType dtype, void* dst, const void* a, const void* b, size_t count,
               int64_t divisor) {
  SumDivide(dtype, dst, a, b, count, divisor, DetectIsa());
}

void SumDivide(DataType dtype, void* dst, const void* a, const void* b, size_t count,
               int64_t divisor, Isa isa) {
  CheckIsa(isa, "SumDivide");
  CheckDataType(dtype, "SumDivide");
  if (divisor <= 0) {
    std::fprintf(stderr, "fatal: reduce: SumDivide by non-positive divisor %lld\n",
                 static_cast<long long>(divisor));
    std::abort();
  }
#if DDP_REDUCE_HAVE_X86
  const bool avx2 = isa == Isa::kAvx2;
#endif
  auto fused = [&](auto* d) {
    using T = std::remove_pointer_t<decltype(d)>;
    const T* x = static_cast<const T*>(a);
    const T* y = static_cast<const T*>(b);
#if DDP_REDUCE_HAVE_X86
    if (avx2) return SumDivideFloatAvx2<T>(d, x, y, count, divisor);
#endif
    SumDivideFloat<T>(d, x, y, count, divisor);
  };
  if (dtype == DataType::kF32) return fused(static_cast<float*>(dst));
  if (dtype == DataType::kF64) return fused(static_cast<double*>(dst));
  // Other types: the two passes, in blocks that stay in L1 between them.
  constexpr size_t kBlock = 4096;
  const ReduceFn sum = GetReduceFn(dtype, ReduceOp::kSum, isa);
  const size_t elem = DataTypeSize(dtype);
  for (size_t i = 0; i < count; i += kBlock) {
    const size_t m = std::min(kBlock, count - i);
    char* d = static_cast<char*>(dst) + i * elem;
    sum(d, static_cast<const char*>(a) + i * elem, static_cast<const char*>(b) + i * elem, m);
    DivideInPlace(dtype, d, m, divisor, isa);
  }
}

void ScaleInPlace(DataType dtype, void* data, size_t count, double factor) {
  ScaleInPlace(dtype, data, count, factor, DetectIsa());
}

void ScaleInPlace(DataType dtype, void* data, size_t count, double factor, Isa isa) {
  CheckIsa(isa, "ScaleInPlace");
  CheckDataType(dtype, "ScaleInPlace");
  if (count == 0) return;
#if DDP_REDUCE_HAVE_X86
  const bool avx2 = isa == Isa::kAvx2;
#endif
  MapByType(
      dtype, data,
      [&](auto* p) {
#if DDP_REDUCE_HAVE_X86
        if (avx2) return ScaleNativeAvx2(p, count, factor);
#endif
        ScaleNativeGeneric(p, count, factor);
      },
      [&](auto fmt, uint16_t* p, bool /*is_f16*/) { ScaleHalf<decltype(fmt)>(p, count, factor); });
}

}  // namespace ddp::transport::reduce
