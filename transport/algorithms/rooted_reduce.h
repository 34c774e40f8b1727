#ifndef DDP_TRANSPORT_ALGORITHMS_ROOTED_REDUCE_H_
#define DDP_TRANSPORT_ALGORITHMS_ROOTED_REDUCE_H_

// Reduce to one rank (MPI_Reduce, ncclReduce): args.recv on args.root gets
// op over ranks of args.send (args.count elements; kAvg divided by size()).
// args.recv is ignored elsewhere (it may be null); on the root send may
// equal recv (in place). Two algorithms:
//
//   TreeReduce: a binomial tree towards the root, pipelined in chunks. Depth
//     ceil(log2 p), so few message latencies for short vectors; but the root
//     receives the whole vector from each of its log2 p children.
//   RingReduce: a ring reduce-scatter (every rank ends with one reduced
//     block), then every rank sends its block to the root. Each link carries
//     about 2N(p-1)/p and every rank reduces only (p-1)/p of a block per
//     step, so long vectors go at link speed; but 2(p-1)ish latencies.
//
// Both check the arguments (count, dtype, op, root, algorithm) independent
// of the root, so ranks that disagree on the root fail too: the tree before
// any data moves, the ring before any rank uses data it received (its first
// sends are posted with the check). The tree proves that every rank agrees (CheckEveryRank, count 0
// included), so one rank that differs fails every rank at once, naming it.
// The ring checks each rank against its ring predecessor (count 0: against
// every rank); ranks not next to the one that differs fail as the stop note
// of the rank that found it reaches them (Requests::RelayStops), or, when
// they entered the call after it passed, at their deadline. Ring ranks also send the tree's later
// check rounds (PostEveryRankRounds), so that ranks whose count took them
// to the other algorithm fail at once instead of at their deadline.

#include <cstddef>

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::algorithms {

/// Reduce messages up to this many bytes go up the binomial tree, longer
/// ones around the ring (ChooseReduce). Measured over UCX on one host
/// (docs/benchmarks.md, Rooted collectives): the tree was 1.3-1.9x faster
/// up to 256 KiB on 2 ranks, 1.3-2.0x up to 64 KiB and about even at
/// 256 KiB on 4; the ring 1.0-1.7x faster from 1 MiB on both (its ranks
/// share the arithmetic, where the tree's root folds the whole vector).
inline constexpr size_t kTreeReduceMaxBytes = 256 << 10;

/// kTree or kRing for a reduce of `bytes` bytes.
Algorithm ChooseReduce(size_t bytes);

/// Binomial tree reduce. Uses phase 0 of the tag range.
Status TreeReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args);

/// Ring reduce-scatter, then each rank's block to the root. Uses phases 0
/// and 1 of the tag range.
Status RingReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args);

/// kTree or kRing as asked; kAuto (or any other value) as ChooseReduce.
/// Equal on every rank.
Status Reduce(p2p::PointToPoint& p2p, const CollectiveArgs& args, Algorithm algorithm);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_ROOTED_REDUCE_H_
