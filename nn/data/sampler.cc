#include "nn/data/sampler.h"

#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

namespace ddp::nn::data {

std::vector<int64_t> TorchRandperm(int64_t n, uint64_t seed) {
  if (n < 0) throw std::invalid_argument("TorchRandperm: n = " + std::to_string(n) + " < 0");
  std::vector<int64_t> r(n);
  std::iota(r.begin(), r.end(), int64_t{0});
  // PyTorch's CPU generator is MT19937 seeded with the low 32 bits of the
  // seed; randperm swaps position i with i + (draw % (n - i)).
  std::mt19937 gen(static_cast<uint32_t>(seed));
  for (int64_t i = 0; i + 1 < n; ++i) {
    const int64_t z = static_cast<int64_t>(gen() % static_cast<uint64_t>(n - i));
    std::swap(r[i], r[i + z]);
  }
  return r;
}

SequentialSampler::SequentialSampler(int64_t dataset_size) : n_(dataset_size) {
  if (n_ < 0) throw std::invalid_argument("SequentialSampler: dataset size " + std::to_string(n_) + " < 0");
}

std::vector<int64_t> SequentialSampler::Indices() const {
  std::vector<int64_t> r(n_);
  std::iota(r.begin(), r.end(), int64_t{0});
  return r;
}

RandomSampler::RandomSampler(int64_t dataset_size, uint64_t seed) : n_(dataset_size), seed_(seed) {
  if (n_ < 0) throw std::invalid_argument("RandomSampler: dataset size " + std::to_string(n_) + " < 0");
}

std::vector<int64_t> RandomSampler::Indices() const {
  return TorchRandperm(n_, seed_ + static_cast<uint64_t>(epoch_));
}

StridedSampler::StridedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank)
    : n_(dataset_size), num_replicas_(num_replicas), rank_(rank) {
  if (n_ < 0) throw std::invalid_argument("StridedSampler: dataset size " + std::to_string(n_) + " < 0");
  if (num_replicas_ < 1) {
    throw std::invalid_argument("StridedSampler: num_replicas " + std::to_string(num_replicas_) + " must be >= 1");
  }
  if (rank_ < 0 || rank_ >= num_replicas_) {
    throw std::invalid_argument("StridedSampler: rank " + std::to_string(rank_) + " is outside [0, " +
                                std::to_string(num_replicas_ - 1) + "]");
  }
}

// ceil(left / r) written as left / r + (left % r != 0): left + r - 1
// overflows for sizes near INT64_MAX.
int64_t StridedSampler::Size() const {
  if (n_ <= rank_) return 0;
  const int64_t left = n_ - rank_;
  return left / num_replicas_ + (left % num_replicas_ != 0);
}

// Counted, not stepped until past n: the step after the last index
// (rank + Size() * num_replicas) can pass INT64_MAX, and the wrapped,
// negative position passed `< n`. rank + k * num_replicas for k < Size()
// is at most the last index, n - 1.
std::vector<int64_t> StridedSampler::Indices() const {
  const int64_t count = Size();
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) out.push_back(rank_ + k * num_replicas_);
  return out;
}

int64_t DistributedSampler::TotalSize() const {
  int64_t total = 0;
  if (__builtin_mul_overflow(num_samples_, options_.num_replicas, &total)) {
    throw std::overflow_error("DistributedSampler::TotalSize: " + std::to_string(options_.num_replicas) +
                              " ranks of " + std::to_string(num_samples_) +
                              " indices each make more indices than int64 holds");
  }
  return total;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options)
    : n_(dataset_size), options_(options) {
  if (n_ < 0) {
    throw std::invalid_argument("DistributedSampler: dataset size " + std::to_string(n_) + " < 0");
  }
  if (options_.num_replicas < 1) {
    throw std::invalid_argument("DistributedSampler: num_replicas " +
                                std::to_string(options_.num_replicas) + " must be >= 1");
  }
  if (options_.rank < 0 || options_.rank >= options_.num_replicas) {
    throw std::invalid_argument("DistributedSampler: rank " + std::to_string(options_.rank) +
                                " is outside [0, " + std::to_string(options_.num_replicas - 1) +
                                "]");
  }
  whole_ = PerRank(n_);
  set_start(0, 0);
}

void DistributedSampler::set_start(int64_t start, int64_t epoch) {
  if (start < 0) {
    throw std::invalid_argument("DistributedSampler: start " + std::to_string(start) + " < 0");
  }
  start_ = start;
  start_epoch_ = epoch;
  num_samples_ = PerRank(start_ < n_ ? n_ - start_ : 0);
}

int64_t DistributedSampler::UnresumedSize() const {
  // PerRank is non-decreasing, so what the start skipped is >= 0.
  const int64_t skipped = epoch_ == start_epoch_ ? whole_ - num_samples_ : 0;
  return Size() + skipped;
}

int64_t DistributedSampler::PerRank(int64_t left) const {
  const int64_t r = options_.num_replicas;
  // drop_last: floor(left / r), the largest per-rank count that needs no
  // padding; otherwise ceil(left / r), without the left + r - 1 that
  // overflows for sizes near INT64_MAX.
  return left / r + (!options_.drop_last && left % r != 0);
}

std::vector<int64_t> DistributedSampler::Indices() const {
  std::vector<int64_t> all;
  if (options_.shuffle) {
    all = TorchRandperm(n_, options_.seed + static_cast<uint64_t>(epoch_));
  } else {
    all.resize(n_);
    std::iota(all.begin(), all.end(), int64_t{0});
  }
  // Position p of the padded list is all[p % n]: past the end, the padding
  // repeats the list from its start (more than once if the dataset is
  // smaller than the padding). With drop_last no position reaches the end.
  // This rank's k-th position is start + rank + k * num_replicas. Counted
  // to Size(), not stepped until past the total: with a world far larger
  // than the dataset, the step after the last position (or start added to
  // it) can pass INT64_MAX, and the wrapped, negative position indexed
  // `all` out of bounds. rank + k * num_replicas stays below the total,
  // and start < n whenever Size() > 0, so the sum of remainders is < 2n.
  const int64_t r = options_.num_replicas;
  const bool resumed = epoch_ == start_epoch_;
  const int64_t start = resumed ? start_ : 0;
  const int64_t count = resumed ? num_samples_ : whole_;
  std::vector<int64_t> mine;
  mine.reserve(count);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t p = options_.rank + k * r;
    mine.push_back(all[(start + p % n_) % n_]);
  }
  return mine;
}

}  // namespace ddp::nn::data
