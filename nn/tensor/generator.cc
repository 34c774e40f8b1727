#include "nn/tensor/generator.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace ddp::nn {

namespace {
inline uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

void Generator::Seed(uint64_t seed) {
  seed_ = seed;
  uint64_t x = seed;
  for (uint64_t& s : state_) {
    // splitmix64 spreads one seed over the 256-bit state.
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    s = z ^ (z >> 31);
  }
  has_spare_ = false;
}

uint64_t Generator::NextU64() {
  const uint64_t result = Rotl(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = Rotl(state_[3], 45);
  return result;
}

double Generator::NextNormal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  // Marsaglia's polar method: a point uniform in the unit disc gives two
  // independent normals with one log and one square root, no trigonometry.
  double u, v, s;
  do {
    u = 2.0 * NextDouble() - 1.0;
    v = 2.0 * NextDouble() - 1.0;
    s = u * u + v * v;
  } while (s >= 1.0 || s == 0.0);
  const double f = std::sqrt(-2.0 * std::log(s) / s);
  spare_ = v * f;
  has_spare_ = true;
  return u * f;
}

uint64_t Generator::NextBelow(uint64_t n) {
  if (n == 0) throw std::invalid_argument("NextBelow(0)");
  // Rejection keeps the distribution exactly uniform.
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do {
    x = NextU64();
  } while (x >= limit);
  return x % n;
}

Generator& DefaultGenerator() {
  static Generator* gen = new Generator(0);
  return *gen;
}

void ManualSeed(uint64_t seed) {
  Generator& gen = DefaultGenerator();
  auto lock = gen.Lock();
  gen.Seed(seed);
}

namespace {

// The next value of T below `v` (finite).
template <typename T>
T NextDown(T v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    const uint16_t magnitude = v.bits & 0x7fff;
    if (magnitude == 0) return T::FromBits(0x8001);  // +-0: the smallest negative
    return T::FromBits(v.bits & 0x8000 ? v.bits + 1 : v.bits - 1);
  } else {
    return std::nextafter(v, -std::numeric_limits<T>::infinity());
  }
}

// Fills `t` with draw(), rounded to its dtype; with `below`, a value that
// rounds up to `below` or past it (a draw just under 1.0 is 1.0 in bf16
// about once in 500) is taken down to the largest value under it.
// `draw` reads `gen`, which is held for the whole tensor: the tensor gets
// consecutive draws even when other threads share the generator.
template <typename Draw>
void FillWith(const Tensor& t, const char* what, Generator& gen, Draw draw,
              std::optional<double> below = std::nullopt) {
  if (!t.device().is_cpu()) {
    Tensor host = Empty(t.shape(), {.dtype = t.dtype()});
    FillWith(host, what, gen, draw, below);
    NoGradGuard guard;
    t.CopyFrom(host);
    return;
  }
  Tensor c = t.is_contiguous() ? t : Empty(t.shape(), {.dtype = t.dtype()});
  auto lock = gen.Lock();
  DDP_DISPATCH_FLOATING(t.dtype(), what, {
    scalar_t* p = static_cast<scalar_t*>(c.data_ptr());
    for (int64_t i = 0; i < c.numel(); ++i) {
      p[i] = static_cast<scalar_t>(draw());  // one rounding from the f64 draw
      if (below) {
        while (static_cast<double>(static_cast<acc_t<scalar_t>>(p[i])) >= *below) p[i] = NextDown(p[i]);
      }
    }
  });
  lock.unlock();
  t.storage()->BumpVersion();
  if (!c.is_same(t)) {
    NoGradGuard guard;
    t.CopyFrom(c);
  }
}

// A bound as messages show it (printf's %g: "0.5", "-inf", "nan").
std::string BoundString(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace

void UniformFill(const Tensor& t, double low, double high, Generator& gen) {
  // As torch's uniform_: finite bounds, low <= high (low == high fills low).
  if (!std::isfinite(low) || !std::isfinite(high)) {
    throw std::invalid_argument("UniformFill: bounds must be finite, got low " + BoundString(low) + " and high " +
                                BoundString(high));
  }
  if (low > high) {
    throw std::invalid_argument("UniformFill: low " + BoundString(low) + " is greater than high " +
                                BoundString(high));
  }
  FillWith(t, "UniformFill", gen, [&] { return low + (high - low) * gen.NextDouble(); },
           high > low ? std::optional<double>(high) : std::nullopt);
}

void NormalFill(const Tensor& t, double mean, double std, Generator& gen) {
  // As torch's normal_: std >= 0 (0 fills the mean); NaN and inf are refused too.
  if (!std::isfinite(mean)) {
    throw std::invalid_argument("NormalFill: mean " + BoundString(mean) + " must be finite");
  }
  if (!(std >= 0) || !std::isfinite(std)) {
    throw std::invalid_argument("NormalFill: std " + BoundString(std) + " must be finite and >= 0");
  }
  FillWith(t, "NormalFill", gen, [&] { return mean + std * gen.NextNormal(); });
}

Tensor Rand(const Shape& shape, TensorOptions options, Generator& gen) {
  TensorOptions plain = options;
  plain.requires_grad = false;
  Tensor t = Empty(shape, plain);
  UniformFill(t, 0.0, 1.0, gen);
  if (options.requires_grad) t.set_requires_grad(true);
  return t;
}

Tensor Randn(const Shape& shape, TensorOptions options, Generator& gen) {
  TensorOptions plain = options;
  plain.requires_grad = false;
  Tensor t = Empty(shape, plain);
  NormalFill(t, 0.0, 1.0, gen);
  if (options.requires_grad) t.set_requires_grad(true);
  return t;
}

Tensor RandPerm(int64_t n, Generator& gen) {
  Tensor t = Empty({n}, {.dtype = DType::kInt64});
  int64_t* p = t.data<int64_t>();
  std::iota(p, p + n, int64_t{0});
  auto lock = gen.Lock();
  for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates
    const int64_t j = static_cast<int64_t>(gen.NextBelow(static_cast<uint64_t>(i + 1)));
    std::swap(p[i], p[j]);
  }
  return t;
}

}  // namespace ddp::nn
