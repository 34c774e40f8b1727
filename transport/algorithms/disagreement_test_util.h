#ifndef DDP_TRANSPORT_ALGORITHMS_DISAGREEMENT_TEST_UTIL_H_
#define DDP_TRANSPORT_ALGORITHMS_DISAGREEMENT_TEST_UTIL_H_

// What the broadcast, gather/scatter and tree reduce tests expect when one
// rank passes arguments the others do not (CheckEveryRank): every rank
// refuses the call, naming that rank and both values, before any data
// moves.

#include <string>
#include <vector>

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

}  // namespace ddp::transport::algorithms::testing

#endif  // DDP_TRANSPORT_ALGORITHMS_DISAGREEMENT_TEST_UTIL_H_
