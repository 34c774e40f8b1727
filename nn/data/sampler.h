#ifndef DDP_NN_DATA_SAMPLER_H_
#define DDP_NN_DATA_SAMPLER_H_

// Samplers decide which dataset indices an epoch visits and in what order.
// Shuffling reproduces PyTorch's torch.randperm on a CPU generator seeded
// with seed + epoch, which is what PyTorch's DistributedSampler does: with
// the same seed and options the indices match it (checked against index
// lists exported from PyTorch 1.13). PyTorch's RandomSampler does not reseed
// per epoch, so ours does not match it; it matches a one-rank
// DistributedSampler with shuffle.

#include <cstdint>
#include <optional>
#include <vector>

namespace ddp::nn::data {

/// torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
/// as PyTorch 1.13 computes it on the CPU (MT19937, forward swaps).
std::vector<int64_t> TorchRandperm(int64_t n, uint64_t seed);

/// A source of dataset indices, one list per epoch.
class Sampler {
 public:
  virtual ~Sampler() = default;
  /// Number of indices in one epoch.
  virtual int64_t Size() const = 0;
  /// Selects the epoch whose indices Indices() returns (reshuffles).
  virtual void SetEpoch(int64_t epoch) = 0;
  /// The current epoch's indices, in visiting order.
  virtual std::vector<int64_t> Indices() const = 0;
  /// The epoch last given to SetEpoch (0 before any call), so that a caller
  /// can set it back; nullopt where the sampler does not keep it (one whose
  /// indices do not depend on the epoch).
  virtual std::optional<int64_t> epoch() const { return std::nullopt; }
  /// Size() of an epoch taken whole: a sampler resumed part way through
  /// one epoch (DistributedSampler::set_start) counts every other epoch's
  /// indices here. Size() unless a subclass is resumed that way.
  virtual int64_t UnresumedSize() const { return Size(); }
};

/// 0, 1, ..., n-1 every epoch.
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t dataset_size);
  int64_t Size() const override { return n_; }
  void SetEpoch(int64_t) override {}
  std::vector<int64_t> Indices() const override;

 private:
  int64_t n_;
};

/// A fresh permutation each epoch: TorchRandperm(n, seed + epoch), the order
/// of PyTorch's DistributedSampler(num_replicas=1, shuffle=True, seed=seed)
/// (not of torch.utils.data.RandomSampler, which draws each epoch from one
/// generator that is never reseeded).
class RandomSampler : public Sampler {
 public:
  RandomSampler(int64_t dataset_size, uint64_t seed);
  int64_t Size() const override { return n_; }
  void SetEpoch(int64_t epoch) override { epoch_ = epoch; }
  std::vector<int64_t> Indices() const override;
  std::optional<int64_t> epoch() const override { return epoch_; }

 private:
  int64_t n_;
  uint64_t seed_;
  int64_t epoch_ = 0;
};

/// For evaluation across ranks: rank r takes r, r + num_replicas, ... of
/// 0..n-1, so every sample is seen exactly once over all ranks (no padding,
/// nothing dropped; DistributedSampler does one or the other). Ranks' sizes
/// differ by at most one, so it is for loops without per-batch collectives:
/// sum the counts across ranks at the end.
class StridedSampler : public Sampler {
 public:
  /// Throws std::invalid_argument for a negative size, num_replicas < 1 or
  /// rank outside [0, num_replicas).
  StridedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank);
  int64_t Size() const override;
  void SetEpoch(int64_t) override {}
  std::vector<int64_t> Indices() const override;

 private:
  int64_t n_, num_replicas_, rank_;
};

/// Options of DistributedSampler, named and defaulted as in PyTorch.
struct DistributedSamplerOptions {
  int64_t num_replicas = 1;  ///< Number of ranks sharing the dataset.
  int64_t rank = 0;          ///< This rank, in [0, num_replicas).
  bool shuffle = true;       ///< Permute with TorchRandperm(n, seed + epoch).
  uint64_t seed = 0;         ///< Must be the same on every rank.
  bool drop_last = false;    ///< Drop the tail instead of padding by wrap-around.
};

/// torch.utils.data.DistributedSampler: every rank sees Size() indices per
/// epoch and together they cover the dataset. Without drop_last the list is
/// padded by repeating its start until it divides evenly; with drop_last the
/// tail that does not divide evenly is dropped. Rank r takes positions
/// r, r + num_replicas, ... of the (shuffled) list.
///
/// set_start(s, e) makes epoch e begin after the list's first s positions
/// (not in PyTorch): a job that trained part of that epoch on another
/// number of ranks or another batch size took exactly those positions (each
/// of its ranks the first b * batch_size of its own), so the rest of the
/// epoch is split across the new ranks with no sample trained twice or left
/// out. Rank r then takes positions s + r, s + r + num_replicas, ...; the
/// padding still repeats the list's start (samples trained early in the
/// epoch, as in every epoch). Every other epoch is whole, as after a resume
/// from a PyTorch sampler's state, which skips samples in the resumed epoch
/// only: the start need not be cleared after it.
class DistributedSampler : public Sampler {
 public:
  /// Throws std::invalid_argument for a negative size, num_replicas < 1 or
  /// rank outside [0, num_replicas).
  DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options);
  /// This rank's indices in the current epoch: fewer in the epoch given
  /// to set_start.
  int64_t Size() const override { return epoch_ == start_epoch_ ? num_samples_ : whole_; }
  /// Must be called with the same epoch on every rank before each epoch,
  /// or every epoch uses the same order (as in PyTorch).
  void SetEpoch(int64_t epoch) override { epoch_ = epoch; }
  std::vector<int64_t> Indices() const override;
  std::optional<int64_t> epoch() const override { return epoch_; }
  /// Indices per epoch summed over all ranks (num_replicas * Size()).
  /// Throws std::overflow_error, naming both factors, where that product
  /// passes INT64_MAX (a dataset near 2^63 on 2 ranks pads it to 2^63).
  int64_t TotalSize() const;
  const DistributedSamplerOptions& options() const { return options_; }
  /// Resumes epoch `epoch` after `start` positions of its list (see above;
  /// no epoch is resumed by default); Size() and Indices() skip them while
  /// SetEpoch has selected that epoch, and no other. A later call replaces
  /// the earlier one; a start of 0 resumes nothing. Set the same on every
  /// rank, or the ranks' shards overlap. Throws std::invalid_argument for a
  /// negative start; one past the dataset leaves that epoch nothing.
  void set_start(int64_t start, int64_t epoch);
  /// The start and the epoch it applies to, as last given to set_start.
  int64_t start() const { return start_; }
  int64_t start_epoch() const { return start_epoch_; }
  /// Size() plus what the start skipped of this rank's share, where the
  /// current epoch is the resumed one: this rank's indices in an epoch
  /// taken whole, counted through Size(), so a subclass that changes it is
  /// counted by its own.
  int64_t UnresumedSize() const override;

 private:
  /// This rank's share of `left` positions of the list.
  int64_t PerRank(int64_t left) const;

  int64_t n_;
  DistributedSamplerOptions options_;
  int64_t start_ = 0;
  int64_t start_epoch_ = 0;
  int64_t num_samples_;  // this rank's share in the resumed epoch
  int64_t whole_;        // and in any other
  int64_t epoch_ = 0;
};

}  // namespace ddp::nn::data

#endif  // DDP_NN_DATA_SAMPLER_H_
