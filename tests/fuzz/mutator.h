#ifndef DDP_TESTS_FUZZ_MUTATOR_H_
#define DDP_TESTS_FUZZ_MUTATOR_H_

// A small deterministic mutator for replaying fuzz targets without libFuzzer
// (in CI, built by gcc): every run of a test produces the same mutants, so a
// failure reproduces by rerunning the test. It knows no format; it applies
// the edits that find most parser bugs: flipped bits, boundary values in
// 1-, 2-, 4- and 8-byte fields (both byte orders), inserted, removed and
// duplicated ranges, truncation, and splices of two corpus entries.

#include <cstdint>
#include <string>
#include <vector>

namespace ddp::fuzz {

/// splitmix64: a tiny, well-mixed generator with a 64-bit state.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next();
  /// Uniform in [0, n); n > 0.
  uint64_t Below(uint64_t n) { return Next() % n; }

 private:
  uint64_t state_;
};

class Mutator {
 public:
  /// `corpus` supplies the bases and the splice partners; must not be empty.
  /// `max_size` bounds every mutant.
  Mutator(std::vector<std::string> corpus, uint64_t seed, size_t max_size = 1 << 16);

  /// The next mutant: a corpus entry (taken in turn) with 1 to 8 edits.
  std::string Next();

 private:
  void MutateOnce(std::string& s);

  std::vector<std::string> corpus_;
  Rng rng_;
  size_t max_size_;
  size_t turn_ = 0;
};

/// A 64-bit FNV-1a hash of `text`, to derive seeds from names.
uint64_t HashName(const std::string& text);

}  // namespace ddp::fuzz

#endif  // DDP_TESTS_FUZZ_MUTATOR_H_
