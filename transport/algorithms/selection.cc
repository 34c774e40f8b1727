#include "transport/algorithms/selection.h"

#include <cstdlib>
#include <string>

namespace ddp::transport::algorithms {
namespace {

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * kKiB;
constexpr int kAnyWorld = std::numeric_limits<int>::max();

// First match wins, so each size band lists its special cases first.
//  - Small messages are latency-bound: halving-doubling (recursive doubling
//    below 8 KiB) takes 2 log2 p steps (or log2 p) against the ring's
//    2 (p - 1).
//  - Across hosts, beyond small sizes, keep the network traffic to one shard
//    per rank: hierarchical.
//  - On 2 and 4 ranks (powers of two: no extra fold-in steps) halving-
//    doubling stays ahead up to 4 MiB: measured on one host over UCX
//    (transport/bench/compare_algorithms.sh, docs/benchmarks.md), 4 ranks,
//    1 MiB: rhd 955 us, ring 1320 us, tree 1676 us; at 16 MiB the ring
//    wins. On 3 ranks rhd led only up to 64 KiB.
//  - Medium messages on many ranks: the double binary tree's log depth
//    pipeline fills faster than a long ring.
//  - Large messages: the ring, bandwidth-optimal and the simplest pipeline.
constexpr SelectionRule kDefaultRules[] = {
    {std::numeric_limits<size_t>::max(), 1, 1, TopologyCondition::kAny, Algorithm::kRing},
    {64 * kKiB, 2, kAnyWorld, TopologyCondition::kAny, Algorithm::kRhd},
    {std::numeric_limits<size_t>::max(), 2, kAnyWorld, TopologyCondition::kMultiHost,
     Algorithm::kHierarchical},
    {4 * kMiB, 2, 2, TopologyCondition::kAny, Algorithm::kRhd},
    {4 * kMiB, 4, 4, TopologyCondition::kAny, Algorithm::kRhd},
    {2 * kMiB, 8, kAnyWorld, TopologyCondition::kAny, Algorithm::kTree},
    {std::numeric_limits<size_t>::max(), 1, kAnyWorld, TopologyCondition::kAny, Algorithm::kRing},
};

bool Matches(TopologyCondition condition, const SelectionInput& input) {
  switch (condition) {
    case TopologyCondition::kAny: return true;
    case TopologyCondition::kSingleHost: return input.num_hosts <= 1;
    case TopologyCondition::kMultiHost: return input.num_hosts > 1 && input.uniform_hosts;
  }
  return false;
}

}  // namespace

std::span<const SelectionRule> DefaultAllReduceRules() { return kDefaultRules; }

Algorithm SelectFromRules(std::span<const SelectionRule> rules, const SelectionInput& input) {
  for (const SelectionRule& rule : rules) {
    if (input.bytes <= rule.max_bytes && input.world_size >= rule.min_world &&
        input.world_size <= rule.max_world && Matches(rule.topology, input)) {
      return rule.algorithm;
    }
  }
  return Algorithm::kRing;
}

StatusOr<Algorithm> ParseAlgorithm(std::string_view name) {
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree, Algorithm::kRhd,
                      Algorithm::kHierarchical, Algorithm::kSharedMemory}) {
    if (name == AlgorithmName(a)) return a;
  }
  return InvalidArgumentError("unknown all-reduce algorithm \"" + std::string(name) +
                              "\": expected auto, ring, tree, rhd, hierarchical or shm");
}

StatusOr<Algorithm> AlgorithmFromEnv() {
  const char* value = std::getenv(kAllReduceAlgoEnv);
  if (value == nullptr || *value == '\0') return Algorithm::kAuto;
  auto parsed = ParseAlgorithm(value);
  if (!parsed.ok()) {
    return InvalidArgumentError(std::string(kAllReduceAlgoEnv) + "=" + value + ": " +
                                parsed.status().message());
  }
  return *parsed;
}

StatusOr<Algorithm> ChooseAllReduceAlgorithm(Algorithm requested, const SelectionInput& input,
                                             std::span<const SelectionRule> rules) {
  if (std::string_view(AlgorithmName(requested)) == "unknown") {
    return InvalidArgumentError("algorithm " + std::to_string(static_cast<int>(requested)) +
                                " is not a valid Algorithm");
  }
  if (requested != Algorithm::kAuto) return requested;
  DDP_ASSIGN_OR_RETURN(const Algorithm forced, AlgorithmFromEnv());
  if (forced != Algorithm::kAuto) return forced;
  return SelectFromRules(rules, input);
}

}  // namespace ddp::transport::algorithms
