#ifndef DDP_DDP_ZERO_GROUPS_H_
#define DDP_DDP_ZERO_GROUPS_H_

// Parameter groups of a sharded optimizer (ZeroRedundancyOptimizer,
// OverlappedZeroOptimizer): a shard's optimizer holds the same groups as
// the whole, each with only the shard's pieces, so the groups' sizes and
// member lists in a several-group state differ between the whole and a
// shard. Internal to //ddp.

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "nn/optim/optimizer.h"

namespace ddp::dist::internal {

/// A group's options as text ("weight_decay=0, lr=0.01"; full precision),
/// for the "option" entries that VerifyReplicas compares across ranks: a
/// rank that stepped its pieces with another group's options would hand
/// every replica parameters the others did not compute.
std::string GroupOptionsText(const std::map<std::string, double>& options);

/// The entries of an optimizer's StateDict that every rank's shard
/// optimizer must share, as (key, value as text): its kind
/// ("group.optimizer"), rates and options ("lr", "group.*",
/// "param_groups.<k>.*"), without what differs between shards (a group's
/// size and members, the per-parameter state). For the "option" entries
/// that VerifyReplicas compares across ranks after the factory ran: a rank
/// whose factory built another optimizer would step its pieces unlike the
/// others and hand every replica the result.
std::vector<std::pair<std::string, std::string>> SharedOptimizerOptions(const nn::optim::NamedTensors& state);

/// Rewrites the "param_groups.<k>.size" and ".params" entries of a
/// several-group state with `num_groups` groups: each is checked against
/// `from` (each group's parameter names, as the state should hold them)
/// and replaced by `to`'s. Throws std::invalid_argument naming the key and
/// the group whose saved size or members are not `from`'s. Does nothing for
/// one group; a state with another group count (or none) and malformed
/// entries are left as they are, for the optimizer that loads them to
/// refuse naming both counts.
void RewriteGroups(nn::optim::NamedTensors& state, size_t num_groups,
                   const std::vector<std::vector<std::string>>& from,
                   const std::vector<std::vector<std::string>>& to);

}  // namespace ddp::dist::internal

#endif  // DDP_DDP_ZERO_GROUPS_H_
