#ifndef DDP_TRANSPORT_ALGORITHMS_SELECTION_H_
#define DDP_TRANSPORT_ALGORITHMS_SELECTION_H_

// Which all-reduce algorithm runs, as data: an ordered table of rules, the
// first that matches wins. A caller's explicit choice overrides the table,
// and so does DDP_ALLREDUCE_ALGO=ring|tree|rhd|hierarchical (for tests and
// tuning). The inputs are identical on every rank, so every rank picks the
// same algorithm; a rank that picks another (say, the variable is set on one
// rank only) fails fast on the argument fingerprint. kSharedMemory ("shm")
// is parsed and may be chosen, but runs outside PointToPoint (transport/shm).

#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::algorithms {

/// The environment variable that forces an all-reduce algorithm.
inline constexpr const char* kAllReduceAlgoEnv = "DDP_ALLREDUCE_ALGO";

/// What a rule may require of the placement of ranks on hosts.
enum class TopologyCondition : int {
  kAny = 0,
  kSingleHost = 1,  ///< every rank on one host
  kMultiHost = 2,   ///< several hosts, each with the same number of ranks
};

/// One row: applies to messages of at most max_bytes, world sizes in
/// [min_world, max_world], and placements meeting `topology`.
struct SelectionRule {
  size_t max_bytes = std::numeric_limits<size_t>::max();
  int min_world = 1;
  int max_world = std::numeric_limits<int>::max();
  TopologyCondition topology = TopologyCondition::kAny;
  Algorithm algorithm = Algorithm::kRing;
};

/// The facts a choice depends on.
struct SelectionInput {
  size_t bytes = 0;      ///< count * element size
  int world_size = 1;
  int num_hosts = 1;
  bool uniform_hosts = true;  ///< every host holds the same number of ranks
};

/// The built-in table (ends with a catch-all ring rule). The thresholds are
/// starting points to be tuned against the benchmark.
std::span<const SelectionRule> DefaultAllReduceRules();

/// The algorithm of the first rule matching `input`; kRing if none does.
Algorithm SelectFromRules(std::span<const SelectionRule> rules, const SelectionInput& input);

/// "ring", "tree", "rhd", "hierarchical", "shm" or "auto" -> the Algorithm;
/// INVALID_ARGUMENT listing the accepted names otherwise.
StatusOr<Algorithm> ParseAlgorithm(std::string_view name);

/// The algorithm DDP_ALLREDUCE_ALGO forces: kAuto when unset or empty;
/// INVALID_ARGUMENT naming the variable and its value when unknown.
StatusOr<Algorithm> AlgorithmFromEnv();

/// The algorithm to run: `requested` unless it is kAuto, then the
/// environment, then the table.
StatusOr<Algorithm> ChooseAllReduceAlgorithm(
    Algorithm requested, const SelectionInput& input,
    std::span<const SelectionRule> rules = DefaultAllReduceRules());

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_SELECTION_H_
