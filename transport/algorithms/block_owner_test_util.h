#ifndef DDP_TRANSPORT_ALGORITHMS_BLOCK_OWNER_TEST_UTIL_H_
#define DDP_TRANSPORT_ALGORITHMS_BLOCK_OWNER_TEST_UTIL_H_

// What the all-gather and reduce-scatter tests share: about
// Tuning::block_owner, the ring view they run on and the owner lists that
// are not permutations, which both must refuse the same way; and the sweep
// of one rank passing another count or dtype, which neither may answer OK.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms::testing {

/// A collective that takes a block_owner (RingAllGather, RingReduceScatter).
using BlockCollectiveFn = std::function<Status(p2p::PointToPoint&, const CollectiveArgs&)>;

/// Four ranks on hosts {0, 1, 0, 1}, as a cyclic placement gives, and the
/// ring 0, 2, 1, 3 over them, which leaves each host once: half the bytes
/// that the ring in rank order sends between hosts.
inline constexpr int kRingViewWorld = 4;
const std::vector<int>& RingViewOrder();
const std::vector<int>& RingViewHosts();

/// Runs `fn` on a GroupView of `p2p` in RingViewOrder(), with block_owner
/// set to that order so that every block keeps its rank's place.
Status RunOnRingView(p2p::PointToPoint& p2p, CollectiveArgs args, const BlockCollectiveFn& fn);

/// Records a gtest failure unless the bytes between hosts on the ring view
/// (crossing[1]) are half of those in rank order (crossing[0], not 0).
void ExpectRingViewHalvesTheCrossing(const uint64_t crossing[2]);

/// Runs `fn` on 3 ranks with each block_owner that is not a permutation of
/// [0, 3) (a repeated rank, one outside the range, a short list) and records
/// a gtest failure unless every rank refuses it with INVALID_ARGUMENT naming
/// the entry at fault. Buffers: `send_blocks` and `recv_blocks` blocks of 4
/// f32 each.
void ExpectBlockOwnersThatAreNotPermutationsRefused(const BlockCollectiveFn& fn,
                                                    size_t send_blocks, size_t recv_blocks);

/// Runs `fn` on 5 and 6 ranks, in one chunk and in 8-byte chunks, with one
/// rank at every place passing another count (9 for 8) or a dtype of the
/// same size (i32 for f32), and records a gtest failure unless no rank
/// returns OK: within 2 s with the harness killing failed ranks, and by its
/// (300 ms) deadline plus 2 s without (chunked runs only, to keep it
/// short). The send buffer holds one block per rank when
/// `send_has_every_block` (reduce-scatter), else the receive buffer does
/// (all-gather).
void ExpectOneRankWithAnotherCountOrDtypeFailsEveryRank(const BlockCollectiveFn& fn, bool send_has_every_block);

/// Runs `fn` on 5 ranks, nobody killed, with one rank at every place
/// passing count 9 where the others pass 8 and entering 300 ms after them,
/// and records a gtest failure unless every rank fails with
/// INVALID_ARGUMENT naming both counts within 3 s of a 6 s deadline: the
/// rank that finds the difference stops the whole ring (a stop note,
/// Requests::RelayStops). Buffers as above.
void ExpectOneRankWithAnotherCountStopsTheRing(const BlockCollectiveFn& fn, bool send_has_every_block);

}  // namespace ddp::transport::algorithms::testing

#endif  // DDP_TRANSPORT_ALGORITHMS_BLOCK_OWNER_TEST_UTIL_H_
