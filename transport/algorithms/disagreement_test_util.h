#ifndef DDP_TRANSPORT_ALGORITHMS_DISAGREEMENT_TEST_UTIL_H_
#define DDP_TRANSPORT_ALGORITHMS_DISAGREEMENT_TEST_UTIL_H_

// What the broadcast, gather/scatter and tree reduce tests expect when one
// rank passes arguments the others do not (CheckEveryRank): every rank
// refuses the call, naming that rank and both values, before any data
// moves; and when one rank runs another collective at the same tag and
// call id, every rank fails at once, naming both.

#include <functional>
#include <string>
#include <vector>

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms::testing {

/// Records a gtest failure, labelled `what`, unless every rank's status is
/// INVALID_ARGUMENT saying the ranks disagree, that rank `odd` passed
/// something, and both `odd_value` (its value as the message shows it,
/// "root 3") and `rest_value` (the others', "root 0"); and unless no rank's
/// receive buffer was written (`written[r]`: elements rank r found changed).
void ExpectEveryRankNamesTheOddRank(const std::vector<Status>& statuses, int odd, const std::string& odd_value,
                                    const std::string& rest_value, const std::vector<int>& written,
                                    const std::string& what);

/// Runs one collective call on `world` loopback ranks, none killed when
/// another fails: rank `odd` runs `run_odd`, every other rank `run_rest`,
/// each given the tag CollectiveTag(3), call id 7 and a 30 s deadline (and
/// setting its own buffers and count). Records a gtest failure unless every
/// rank fails INVALID_ARGUMENT naming both `odd_name` and `rest_name`
/// within 15 s (room for a loaded host; a rank that waits out the deadline
/// still fails).
using CollectiveCall = std::function<Status(p2p::PointToPoint&, CollectiveArgs)>;
void ExpectOddCollectiveStopsEveryRank(int world, int odd, const CollectiveCall& run_odd,
                                       const std::string& odd_name, const CollectiveCall& run_rest,
                                       const std::string& rest_name);

}  // namespace ddp::transport::algorithms::testing

#endif  // DDP_TRANSPORT_ALGORITHMS_DISAGREEMENT_TEST_UTIL_H_
