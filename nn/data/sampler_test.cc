#include "nn/data/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace ddp::nn::data {
namespace {

nlohmann::json Golden() {
  std::ifstream in("nn/data/testdata/sampler_golden.json");
  EXPECT_TRUE(in.good()) << "cannot open the golden file";
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

int64_t WeightedSum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (size_t i = 0; i < v.size(); ++i) s += static_cast<int64_t>(i + 1) * v[i];
  return s;
}

// Every case PyTorch 1.13's DistributedSampler produced, index for index.
TEST(DistributedSampler, MatchesPyTorch) {
  const nlohmann::json golden = Golden();
  int checked = 0;
  for (const auto& c : golden["distributed"]) {
    DistributedSamplerOptions o;
    o.num_replicas = c["num_replicas"];
    o.rank = c["rank"];
    o.shuffle = c["shuffle"];
    o.drop_last = c["drop_last"];
    o.seed = c["seed"];
    DistributedSampler s(c["n"].get<int64_t>(), o);
    s.SetEpoch(c["epoch"]);
    const std::vector<int64_t> got = s.Indices();
    const std::string where = c.dump().substr(0, 140);
    EXPECT_EQ(s.Size(), c["size"].get<int64_t>()) << where;
    ASSERT_EQ(static_cast<int64_t>(got.size()), s.Size()) << where;
    if (c.contains("indices")) {
      EXPECT_EQ(got, c["indices"].get<std::vector<int64_t>>()) << where;
    } else {
      const auto head = c["head"].get<std::vector<int64_t>>();
      const auto tail = c["tail"].get<std::vector<int64_t>>();
      EXPECT_EQ(std::vector<int64_t>(got.begin(), got.begin() + head.size()), head) << where;
      EXPECT_EQ(std::vector<int64_t>(got.end() - tail.size(), got.end()), tail) << where;
      EXPECT_EQ(WeightedSum(got), c["weighted_sum"].get<int64_t>()) << where;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 436);  // every case in the file
}

TEST(TorchRandperm, MatchesPyTorch) {
  const nlohmann::json golden = Golden();
  for (const auto& c : golden["randperm"]) {
    const auto p = TorchRandperm(c["n"], c["seed"]);
    const auto head = c["head"].get<std::vector<int64_t>>();
    ASSERT_GE(p.size(), head.size());
    EXPECT_EQ(std::vector<int64_t>(p.begin(), p.begin() + head.size()), head) << c["n"];
    EXPECT_EQ(WeightedSum(p), c["weighted_sum"].get<int64_t>()) << c["n"];
  }
}

TEST(DistributedSampler, RanksPartitionThePaddedEpoch) {
  const int64_t n = 103;
  for (int64_t replicas : {1, 2, 4, 5}) {
    std::multiset<int64_t> all;
    for (int64_t r = 0; r < replicas; ++r) {
      DistributedSampler s(n, {replicas, r, true, 11, false});
      s.SetEpoch(3);
      for (int64_t i : s.Indices()) all.insert(i);
    }
    EXPECT_EQ(static_cast<int64_t>(all.size()), (n + replicas - 1) / replicas * replicas);
    for (int64_t i = 0; i < n; ++i) EXPECT_GE(all.count(i), 1u) << i;
  }
}

// 4 ranks trained 3 batches of 5 each of epoch 2, positions [0, 60) of its
// list; starting at 60 on 1 to 5 ranks trains every other sample once, and
// repeats only the epoch's first samples as padding, in shards of one size.
TEST(DistributedSampler, StartContinuesAnEpochPartlyTrainedOnOtherRanks) {
  const int64_t n = 103, batch = 5, batches = 3, old_world = 4;
  std::vector<std::vector<int64_t>> old_shards;
  std::multiset<int64_t> trained;
  for (int64_t r = 0; r < old_world; ++r) {
    DistributedSampler s(n, {old_world, r, true, 11, false});
    s.SetEpoch(2);
    old_shards.push_back(s.Indices());
    trained.insert(old_shards[r].begin(), old_shards[r].begin() + batches * batch);
  }
  const int64_t start = batches * batch * old_world;
  const std::vector<int64_t> order = TorchRandperm(n, 11 + 2);
  EXPECT_EQ(trained, std::multiset<int64_t>(order.begin(), order.begin() + start));
  for (int64_t world : {1, 2, 3, 4, 5}) {
    std::multiset<int64_t> rest;
    const int64_t size = (n - start + world - 1) / world;
    for (int64_t r = 0; r < world; ++r) {
      DistributedSampler s(n, {world, r, true, 11, false});
      s.set_start(start, 2);
      s.SetEpoch(2);
      const std::vector<int64_t> mine = s.Indices();
      EXPECT_EQ(s.Size(), size) << "rank " << r << " of " << world;
      EXPECT_EQ(static_cast<int64_t>(mine.size()), size) << "rank " << r << " of " << world;
      rest.insert(mine.begin(), mine.end());
      if (world == old_world) {
        // The same ranks: each continues its own shard where it stopped.
        EXPECT_EQ(mine, std::vector<int64_t>(old_shards[r].begin() + batches * batch,
                                             old_shards[r].end()));
      }
    }
    std::multiset<int64_t> expected(order.begin() + start, order.end());
    for (int64_t i = 0; i < size * world - (n - start); ++i) expected.insert(order[i]);
    EXPECT_EQ(rest, expected) << world << " ranks";
  }
}

TEST(DistributedSampler, StartPastTheEndLeavesNothingAndNegativeIsRefused) {
  DistributedSampler s(10, {2, 1, true, 0, false});
  s.set_start(10, 0);
  EXPECT_EQ(s.Size(), 0);
  EXPECT_TRUE(s.Indices().empty());
  EXPECT_EQ(s.UnresumedSize(), 5) << "the epoch without its start";
  s.set_start(0, 0);
  EXPECT_EQ(s.Size(), 5);
  DistributedSampler dropping(11, {2, 1, true, 0, true});
  dropping.set_start(3, 0);
  EXPECT_EQ(dropping.Size(), 4);
  EXPECT_EQ(dropping.UnresumedSize(), 5);
  try {
    s.set_start(-1, 0);
    FAIL() << "a negative start was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "DistributedSampler: start -1 < 0");
  }
}

// set_start resumes the one epoch it names: every other epoch, before or
// after it, is whole and in the order of a sampler never resumed, and the
// resumed epoch selected again is resumed again (it used to apply to every
// epoch until set_start(0)).
TEST(DistributedSampler, StartAppliesToItsEpochOnly) {
  DistributedSampler s(10, {2, 1, true, 4, false});
  DistributedSampler whole(10, {2, 1, true, 4, false});
  s.set_start(4, 1);
  EXPECT_EQ(s.Size(), 5) << "epoch 0 is not the resumed one";
  for (int64_t epoch : {1, 2, 0, 1}) {
    s.SetEpoch(epoch);
    whole.SetEpoch(epoch);
    if (epoch == 1) {
      EXPECT_EQ(s.Size(), 3);
      EXPECT_EQ(s.UnresumedSize(), 5);
      const std::vector<int64_t> all = whole.Indices();
      EXPECT_EQ(s.Indices(), (std::vector<int64_t>{all[2], all[3], all[4]}));
    } else {
      EXPECT_EQ(s.Size(), 5) << "epoch " << epoch;
      EXPECT_EQ(s.Indices(), whole.Indices()) << "epoch " << epoch;
    }
  }
}

// Sizes near INT64_MAX: the per-rank counts are computed without n + r - 1
// (which overflowed and gave negative sizes). No indices are materialized.
TEST(Samplers, SizesNearInt64MaxDoNotOverflow) {
  const int64_t max = std::numeric_limits<int64_t>::max();  // 2^63 - 1, odd
  EXPECT_EQ(DistributedSampler(max, {2, 0, false, 0, false}).Size(), max / 2 + 1);
  EXPECT_EQ(DistributedSampler(max, {2, 1, false, 0, true}).Size(), max / 2);
  EXPECT_EQ(DistributedSampler(max, {3, 0, false, 0, false}).Size(), max / 3 + (max % 3 != 0));
  EXPECT_EQ(DistributedSampler(max, {1, 0, false, 0, false}).Size(), max);
  DistributedSampler started(max, {2, 0, false, 0, false});
  started.set_start(1, 0);  // max - 1 left, even
  EXPECT_EQ(started.Size(), max / 2);
  EXPECT_EQ(StridedSampler(max, 2, 0).Size(), max / 2 + 1);
  EXPECT_EQ(StridedSampler(max, 2, 1).Size(), max / 2);
  EXPECT_EQ(StridedSampler(max, 1, 0).Size(), max);
  EXPECT_EQ(StridedSampler(max, max, max - 1).Size(), 1);
  // The padded total, 2^63 on 2 ranks, does not fit: refused by name (it
  // wrapped to INT64_MIN).
  try {
    static_cast<void>(DistributedSampler(max, {2, 0, false, 0, false}).TotalSize());
    ADD_FAILURE() << "TotalSize of 2 x 2^62 indices returned";
  } catch (const std::overflow_error& e) {
    EXPECT_STREQ(e.what(), "DistributedSampler::TotalSize: 2 ranks of 4611686018427387904 indices each make "
                           "more indices than int64 holds");
  }
  EXPECT_EQ(DistributedSampler(max, {2, 0, false, 0, true}).TotalSize(), max - 1);
}

// A world far larger than the dataset: rank 5 of 2^63 - 1 ranks over 10
// samples takes sample 5 alone. Stepping by the world size past the last
// index overflowed int64 (5 + 2^63 - 1), and the wrapped, negative position
// passed the `< n` test: Indices() returned 7 indices, 4 of them negative,
// and over 2^63 - 1 samples it never stopped (it ran out of memory).
TEST(StridedSampler, AStepPastInt64MaxEndsTheIndices) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  const StridedSampler s(10, max, 5);
  EXPECT_EQ(s.Size(), 1);
  EXPECT_EQ(s.Indices(), (std::vector<int64_t>{5}));
  EXPECT_EQ(StridedSampler(max, max, max - 1).Size(), 1);
  EXPECT_EQ(StridedSampler(max, max, max - 1).Indices(), (std::vector<int64_t>{max - 1}));
  EXPECT_EQ(StridedSampler(max, max - 1, 0).Indices(), (std::vector<int64_t>{0, max - 1}));
}

// The padded list of a world far larger than the dataset: the last of
// 2^63 - 1 ranks over 10 samples takes position 2^63 - 2 of it, sample
// (2^63 - 2) % 10 = 6; after set_start(5), position 5 + 2^63 - 2, sample 1.
// Stepping by the world size past that position (or adding the start to it)
// overflowed int64, and the wrapped, negative position read outside the
// index list, without end.
TEST(DistributedSampler, PositionsPastInt64MaxStayInTheList) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  DistributedSampler s(10, {.num_replicas = max, .rank = max - 1, .shuffle = false});
  EXPECT_EQ(s.Size(), 1);
  EXPECT_EQ(s.Indices(), (std::vector<int64_t>{6}));
  s.set_start(5, 0);
  EXPECT_EQ(s.Size(), 1);
  EXPECT_EQ(s.Indices(), (std::vector<int64_t>{1}));
  DistributedSampler shuffled(10, {.num_replicas = max, .rank = max - 1, .shuffle = true, .seed = 3});
  EXPECT_EQ(shuffled.Indices(), (std::vector<int64_t>{TorchRandperm(10, 3)[6]}));
}

TEST(DistributedSampler, EpochChangesOrderAndSameEpochRepeats) {
  DistributedSampler s(50, {2, 1, true, 5, false});
  s.SetEpoch(0);
  auto e0 = s.Indices();
  s.SetEpoch(1);
  auto e1 = s.Indices();
  s.SetEpoch(0);
  EXPECT_EQ(s.Indices(), e0);
  EXPECT_NE(e0, e1);
}

TEST(DistributedSampler, RejectsBadRank) {
  EXPECT_THROW(DistributedSampler(10, {2, 2, true, 0, false}), std::invalid_argument);
  EXPECT_THROW(DistributedSampler(10, {2, -1, true, 0, false}), std::invalid_argument);
  EXPECT_THROW(DistributedSampler(10, {0, 0, true, 0, false}), std::invalid_argument);
}

TEST(RandomSampler, PermutationPerEpoch) {
  RandomSampler s(1000, 42);
  s.SetEpoch(2);
  auto p = s.Indices();
  EXPECT_EQ(p, TorchRandperm(1000, 44));
  std::sort(p.begin(), p.end());
  for (int64_t i = 0; i < 1000; ++i) EXPECT_EQ(p[i], i);
}

TEST(SequentialSampler, InOrder) {
  SequentialSampler s(4);
  s.SetEpoch(9);
  EXPECT_EQ(s.Indices(), (std::vector<int64_t>{0, 1, 2, 3}));
}

// Every sample exactly once over the ranks, in stride order, sizes within
// one of each other; bad arguments named.
TEST(StridedSampler, CoversEverySampleOnceOverTheRanks) {
  for (int64_t n : {0, 1, 7, 10000}) {
    for (int64_t world : {1, 3, 8}) {
      std::vector<int> seen(static_cast<size_t>(n), 0);
      for (int64_t rank = 0; rank < world; ++rank) {
        StridedSampler s(n, world, rank);
        const std::vector<int64_t> indices = s.Indices();
        EXPECT_EQ(static_cast<int64_t>(indices.size()), s.Size());
        EXPECT_LE(s.Size(), (n + world - 1) / world);
        EXPECT_GE(s.Size(), n / world);
        for (size_t k = 0; k < indices.size(); ++k) {
          EXPECT_EQ(indices[k], rank + static_cast<int64_t>(k) * world);
          ++seen[static_cast<size_t>(indices[k])];
        }
      }
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)], 1) << "n " << n << " world " << world;
    }
  }
  EXPECT_THROW(StridedSampler(-1, 1, 0), std::invalid_argument);
  EXPECT_THROW(StridedSampler(5, 0, 0), std::invalid_argument);
  EXPECT_THROW(StridedSampler(5, 2, 2), std::invalid_argument);
}

}  // namespace
}  // namespace ddp::nn::data
