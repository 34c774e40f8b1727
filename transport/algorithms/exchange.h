#ifndef DDP_TRANSPORT_ALGORITHMS_EXCHANGE_H_
#define DDP_TRANSPORT_ALGORITHMS_EXCHANGE_H_

// A direct exchange (all-to-all with a size per pair): every rank sends one
// block to every other rank and receives one from each, all posted at once.
// It moves bytes and never reduces, so the buffers may be any memory the
// point-to-point transport can read and write (device memory included, with
// a CUDA-aware UCX). The staged device collectives use it to hand each rank
// the segments it reduces on its GPU.

#include <span>

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms {

/// What this rank sends to one peer and receives from it.
struct ExchangeBlock {
  const void* send = nullptr;  ///< Bytes for the peer (unread when send_bytes is 0).
  size_t send_bytes = 0;
  void* recv = nullptr;  ///< Where the peer's bytes land (untouched when recv_bytes is 0).
  size_t recv_bytes = 0;  ///< Exactly what the peer sends; another size is INVALID_ARGUMENT.
};

/// Sends blocks[q].send to rank q and receives rank q's block into
/// blocks[q].recv, for every q != rank(); blocks[rank()] is ignored and
/// blocks has size() entries. Must be called on every rank with the same
/// args.count and args.dtype (they are only compared between ranks, so a
/// rank running another collective fails at once) and args.tag; the block
/// sizes must agree pairwise. Returns when every block arrived and every
/// send completed; on error nothing stays posted. Uses phase 0 of the tag
/// range. With `empty_messages`, blocks of 0 bytes are sent and received
/// too, and each pair compares the sizes of both its blocks (one small
/// message more per peer) before any data is awaited, so that a pair that
/// disagrees on a block's size fails on both its ranks (INVALID_ARGUMENT
/// naming both ranks and both sizes) instead of one side waiting for a
/// block the other never sends, or the sender returning OK. Without it,
/// the sizes must agree by construction (the staged device collectives
/// compute them alike on every rank). A recv block must not overlap
/// another recv block or any send block (INVALID_ARGUMENT naming both
/// ranks); send blocks may share bytes.
Status DirectExchange(p2p::PointToPoint& p2p, std::span<const ExchangeBlock> blocks,
                      const CollectiveArgs& args, bool empty_messages = false);

}  // namespace ddp::transport::algorithms

#endif  // DDP_TRANSPORT_ALGORITHMS_EXCHANGE_H_
