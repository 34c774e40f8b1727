#ifndef DDP_NN_DATA_HASH_H_
#define DDP_NN_DATA_HASH_H_

// Counter-based randomness: a value is a pure function of its coordinates
// (seed, epoch, sample, ...), so what a sample gets never depends on which
// loader thread made it or in what order.

#include <cstdint>

namespace ddp::nn::data::internal {

/// SplitMix64's finalizer: a bijective 64-bit mix with full avalanche.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Hash of a tuple of coordinates.
inline uint64_t HashOf(uint64_t a, uint64_t b) { return Mix64(Mix64(a) ^ b); }
inline uint64_t HashOf(uint64_t a, uint64_t b, uint64_t c) { return Mix64(HashOf(a, b) ^ c); }
inline uint64_t HashOf(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return Mix64(HashOf(a, b, c) ^ d);
}

}  // namespace ddp::nn::data::internal

#endif  // DDP_NN_DATA_HASH_H_
