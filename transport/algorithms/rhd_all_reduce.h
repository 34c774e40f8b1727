#ifndef DDP_TRANSPORT_ALGORITHMS_RHD_ALL_REDUCE_H_
#define DDP_TRANSPORT_ALGORITHMS_RHD_ALL_REDUCE_H_

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms {

/// All-reduce by recursive halving then doubling (Rabenseifner): log2 p
/// exchanges that halve the data each rank is responsible for while
/// reducing (a reduce-scatter), then log2 p that double it back (an
/// all-gather). For small and medium messages: 2 log2 p steps instead of the
/// ring's 2 (p - 1), at the same 2 (p-1)/p bytes per rank. Messages up to
/// tuning.rhd_doubling_bytes (default 8 KiB, 64 KiB on 2 ranks) use
/// recursive doubling instead (log2 p steps, whole vector each time), the
/// latency-optimal choice for small messages. The mode is part of the
/// argument check: ranks whose tuning puts the same call in different
/// modes fail at once with INVALID_ARGUMENT naming both.
///
/// Any p works: with p2 the largest power of two <= p, the first
/// 2 (p - p2) ranks pair up, the even one of each pair hands its vector to
/// the odd one before the exchanges and gets the result back after.
/// args.count elements in args.send and args.recv (in-place when equal).
/// Uses phase 0 of the tag range.
Status RhdAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_RHD_ALL_REDUCE_H_
