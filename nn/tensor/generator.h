// Seeded random numbers for initialization, dropout and tests. The draws
// themselves (Next*) are not synchronized; the tensor fills below hold the
// generator's lock for a whole tensor, so threads may share a generator
// (the default one) through them. Give a thread its own for speed.
#pragma once

#include <cstdint>
#include <mutex>

#include "nn/tensor/tensor.h"

namespace ddp::nn {

/// xoshiro256** seeded through splitmix64: fast, 2^256 period, reproducible
/// across platforms for a given seed.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0) { Seed(seed); }
  /// Restarts the sequence from seed.
  void Seed(uint64_t seed);
  uint64_t seed() const { return seed_; }
  /// Uniform 64-bit integer.
  uint64_t NextU64();
  /// Uniform in [0, 1) with 53 random bits.
  double NextDouble() { return static_cast<double>(NextU64() >> 11) * 0x1.0p-53; }
  /// Uniform in [0, 1) with 24 random bits.
  float NextFloat() { return static_cast<float>(NextU64() >> 40) * 0x1.0p-24f; }
  /// Standard normal (polar method; caches the second value).
  double NextNormal();
  /// Uniform integer in [0, n).
  uint64_t NextBelow(uint64_t n);
  /// Holds the generator for a run of draws that other threads may share it
  /// for. Taken once per tensor, not per draw: a lock per element would cost
  /// more than the draw itself.
  [[nodiscard]] std::unique_lock<std::mutex> Lock() { return std::unique_lock<std::mutex>(mutex_); }

 private:
  std::mutex mutex_;
  uint64_t state_[4];
  uint64_t seed_ = 0;
  bool has_spare_ = false;
  double spare_ = 0;
};

/// The process-wide generator used when none is passed (seed 0 at start).
/// Shared by every thread: draw from it directly only under its Lock().
Generator& DefaultGenerator();
/// Reseeds the default generator (under its lock).
void ManualSeed(uint64_t seed);

/// Fills t (any floating dtype, CPU) in place with U[low, high).
void UniformFill(const Tensor& t, double low, double high, Generator& gen = DefaultGenerator());
/// Fills t in place with N(mean, std^2).
void NormalFill(const Tensor& t, double mean, double std, Generator& gen = DefaultGenerator());
/// New tensor with U[0, 1) entries.
Tensor Rand(const Shape& shape, TensorOptions options = {}, Generator& gen = DefaultGenerator());
/// New tensor with N(0, 1) entries.
Tensor Randn(const Shape& shape, TensorOptions options = {}, Generator& gen = DefaultGenerator());
/// A random permutation of 0..n-1 (i64).
Tensor RandPerm(int64_t n, Generator& gen = DefaultGenerator());

}  // namespace ddp::nn
