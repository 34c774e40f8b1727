#ifndef DDP_TRANSPORT_TESTING_THREAD_HARNESS_H_
#define DDP_TRANSPORT_TESTING_THREAD_HARNESS_H_

// Runs N ranks as N threads over one LoopbackHub, for collective tests.

#include <functional>
#include <vector>

#include "transport/p2p/loopback.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::testing {

struct HarnessOptions {
  /// Kill a rank whose body returns an error, the way a crashed process looks
  /// to its peers, so that they fail at once with PEER_LOST instead of
  /// waiting for their deadlines. Off: peers see only their deadline.
  bool kill_on_error = true;
};

/// The body of one rank; it gets its endpoint and returns its result.
using RankFn = std::function<Status(p2p::PointToPoint& p2p)>;

/// Runs `fn` on hub.size() threads, rank i over endpoint i, and returns each
/// rank's status once every thread has finished. The hub may be used from
/// inside `fn` (Kill, Stats).
std::vector<Status> RunRanks(p2p::LoopbackHub& hub, const RankFn& fn,
                             const HarnessOptions& options = {});

/// The same over a fresh hub of `world` ranks.
std::vector<Status> RunRanks(int world, const RankFn& fn, const HarnessOptions& options = {});

}  // namespace ddp::transport::testing

#endif  // DDP_TRANSPORT_TESTING_THREAD_HARNESS_H_
