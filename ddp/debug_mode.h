#ifndef DDP_DDP_DEBUG_MODE_H_
#define DDP_DDP_DEBUG_MODE_H_

// DDP_DEBUG: how much checking and logging //ddp does (PyTorch's
// TORCH_DISTRIBUTED_DEBUG levels). Private to //ddp.

#include <cstdint>
#include <string>

#include "transport/communicator.h"

namespace ddp::dist {

enum class DebugLevel : int {
  kOff = 0,     ///< Unset, "off": no extra work.
  kInfo = 1,    ///< "info": DDP logs its bucket layout and runtime statistics.
  kDetail = 2,  ///< "detail": also the cross-rank fingerprint before every collective.
};

/// Parses DDP_DEBUG (case-insensitive); throws std::invalid_argument naming
/// the variable and the accepted values for anything else.
DebugLevel DebugLevelFromEnvironment();

/// Collective: every rank passes its `sequence`-th collective's
/// `description`; OK when all agree, else INVALID_ARGUMENT saying what each
/// rank runs. Uses one fixed-size all-gather, so it cannot itself desync.
transport::Status CheckFingerprints(transport::Communicator& comm, int rank, int size,
                                    uint64_t sequence, const std::string& description,
                                    transport::Deadline deadline);

/// Collective, when a group is made: OK when every rank has the fingerprint
/// check (`detail`) on, or every rank off; else INVALID_ARGUMENT naming the
/// ranks with it on (a rank that checks runs an all-gather before each
/// collective that the others do not, which pairs with their collectives).
transport::Status CheckDebugModeAgrees(transport::Communicator& comm, bool detail,
                                       transport::Deadline deadline);

}  // namespace ddp::dist

#endif  // DDP_DDP_DEBUG_MODE_H_
