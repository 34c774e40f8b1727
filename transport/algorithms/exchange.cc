#include "transport/algorithms/exchange.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "transport/algorithms/pipeline.h"

namespace ddp::transport::algorithms {

Status DirectExchange(p2p::PointToPoint& p2p, std::span<const ExchangeBlock> blocks,
                      const CollectiveArgs& args, bool empty_messages) {
  const int p = p2p.size(), r = p2p.rank();
  constexpr const char* kWhat = "direct exchange";
  internal::BufferShape shape;  // the blocks carry the buffers
  shape.needs_send = false;
  DDP_RETURN_IF_ERROR(internal::CheckArgs(kWhat, p2p, args, shape));
  if (blocks.size() != static_cast<size_t>(p)) {
    return InvalidArgumentError(std::string(kWhat) + ": " + std::to_string(blocks.size()) +
                                " blocks for " + std::to_string(p) + " ranks");
  }
  for (int q = 0; q < p; ++q) {
    if (q == r) continue;
    const ExchangeBlock& b = blocks[q];
    if ((b.send_bytes > 0 && b.send == nullptr) || (b.recv_bytes > 0 && b.recv == nullptr)) {
      return InvalidArgumentError(std::string(kWhat) + ": the block for rank " +
                                  std::to_string(q) + " has a null buffer");
    }
  }
  // A receive lands while the other transfers still run: a block that lands
  // on bytes another receive writes or a send reads leaves either of them
  // unspecified. Sends may share bytes (one block to every peer).
  struct Span {
    uintptr_t begin, end;
    int peer;
  };
  std::vector<Span> landing;
  for (int q = 0; q < p; ++q) {
    if (q == r || blocks[q].recv_bytes == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(blocks[q].recv);
    landing.push_back({begin, begin + blocks[q].recv_bytes, q});
  }
  std::sort(landing.begin(), landing.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < landing.size(); ++i) {
    if (landing[i].begin < landing[i - 1].end) {
      return InvalidArgumentError(std::string(kWhat) + ": the recv blocks for ranks " +
                                  std::to_string(std::min(landing[i - 1].peer, landing[i].peer)) +
                                  " and " +
                                  std::to_string(std::max(landing[i - 1].peer, landing[i].peer)) +
                                  " overlap");
    }
  }
  for (int q = 0; q < p; ++q) {
    if (q == r || blocks[q].send_bytes == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(blocks[q].send);
    const uintptr_t end = begin + blocks[q].send_bytes;
    // The first landing span that ends after this send begins.
    auto it = std::upper_bound(landing.begin(), landing.end(), begin,
                               [](uintptr_t at, const Span& s) { return at < s.end; });
    if (it != landing.end() && it->begin < end) {
      return InvalidArgumentError(std::string(kWhat) + ": the send block for rank " +
                                  std::to_string(q) + " overlaps the recv block for rank " +
                                  std::to_string(it->peer));
    }
  }
  if (p == 1) return Status();
  const p2p::Tag tag = PhaseTag(args.tag, 0);
  // With empty messages every pair trades a message both ways, so each
  // rank also tells each peer the sizes it has for the pair's two blocks
  // (what it sends the peer, what it expects back) and compares the peer's
  // before awaiting any data: a pair that disagrees on a block's size fails
  // on both sides, naming both ranks and both sizes. Only the receiver
  // failed before (its receive was the wrong size), while the sender's
  // block went out and it returned OK. One 16-byte message more per peer,
  // in the same round as the fingerprints, on the fingerprint range's third
  // tag (CheckEveryRank, run by other collectives, takes the first two).
  constexpr const char* kSizeWhat = "direct exchange, block size check";
  const p2p::Tag size_tag = internal::FingerprintTag(tag, args.call_id) + 2;
  // Declared before `requests`, so that it outlives the cancellations (and
  // is quarantined with it when a release is unconfirmed): [2q] is what
  // this rank sends q and [2q + 1] what it expects from q; the received
  // pairs follow, with q's view.
  std::optional<internal::Scratch> size_scratch;
  uint64_t* sizes_sent = nullptr;
  uint64_t* sizes_got = nullptr;
  if (empty_messages) {
    size_scratch.emplace(4 * static_cast<size_t>(p) * sizeof(uint64_t));
    sizes_sent = reinterpret_cast<uint64_t*>(size_scratch->data());
    sizes_got = sizes_sent + 2 * p;
  }

  internal::Requests requests(p2p, args.deadline);
  // Each rank checks its ring predecessor, so that a rank running another
  // collective (or another chunk size) fails at once instead of at the
  // deadline, and every rank it takes a block from: the sends go out before
  // the first wait, and a rank that checked its predecessor only took the
  // block of a rank elsewhere that passed another dtype of the same size
  // (i32 for f32) and returned OK (the staged device reduce then folds
  // those bytes). One small message more per block, in the same round.
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  std::vector<int> check_to = {next}, check_from = {prev};
  for (int q = 0; q < p; ++q) {
    if (q == r) continue;
    if (q != next && (blocks[q].send_bytes > 0 || empty_messages)) check_to.push_back(q);
    if (q != prev && (blocks[q].recv_bytes > 0 || empty_messages)) check_from.push_back(q);
  }
  internal::PeerCheck check(kWhat, internal::MakeFingerprint(args, internal::kDirectExchangeKind,
                                                             /*uses_op=*/false,
                                                             /*uses_root=*/false));
  DDP_RETURN_IF_ERROR(check.Post(requests, tag, args.call_id, check_to, check_from));
  std::vector<p2p::RequestId> size_ids(empty_messages ? p : 0, 0);
  if (empty_messages) {
    for (int q = 0; q < p; ++q) {
      if (q == r) continue;
      internal::Where where{kSizeWhat, 0, 0, internal::Where::kNoChunk, false, q};
      DDP_ASSIGN_OR_RETURN(size_ids[q], requests.Recv(where, size_tag, sizes_got + 2 * q,
                                                      2 * sizeof(uint64_t)));
    }
    for (int i = 1; i < p; ++i) {
      const int q = (r + i) % p;
      sizes_sent[2 * q] = blocks[q].send_bytes;
      sizes_sent[2 * q + 1] = blocks[q].recv_bytes;
      internal::Where where{kSizeWhat, 0, 0, internal::Where::kNoChunk, true, q};
      DDP_RETURN_IF_ERROR(
          requests.Send(where, size_tag, sizes_sent + 2 * q, 2 * sizeof(uint64_t)).status());
    }
  }
  // Receives first, so that no message waits unexpected; then the sends,
  // starting with the next rank so that not every rank sends to rank 0
  // first. At this call's own data tag (CallDataBase): a block a failed
  // call at this tag sent, delivered although cancelled, is not taken as
  // this one's.
  const p2p::Tag data_tag = internal::StepTag(tag, internal::CallDataBase(args.call_id));
  std::vector<p2p::RequestId> receives;
  std::vector<int> from;
  for (int i = 1; i < p; ++i) {
    const int q = (r + p - i) % p;
    if (blocks[q].recv_bytes == 0 && !empty_messages) continue;
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, false, q};
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId id,
                         requests.Recv(where, data_tag, blocks[q].recv,
                                       blocks[q].recv_bytes));
    receives.push_back(id);
    from.push_back(q);
  }
  for (int i = 1; i < p; ++i) {
    const int q = (r + i) % p;
    if (blocks[q].send_bytes == 0 && !empty_messages) continue;
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, true, q};
    DDP_RETURN_IF_ERROR(requests.Send(where, data_tag, blocks[q].send,
                                      blocks[q].send_bytes)
                            .status());
  }
  // As they arrive: a peer running another collective may never send one
  // here, while another's mismatch is already in.
  DDP_RETURN_IF_ERROR(check.VerifyAsTheyArrive(requests));
  // Every peer now runs this exchange, so each sends its sizes at once.
  for (int i = 1; i < p && empty_messages; ++i) {
    const int q = (r + p - i) % p;
    internal::Where where{kSizeWhat, 0, 0, internal::Where::kNoChunk, false, q};
    DDP_RETURN_IF_ERROR(requests.Wait(size_ids[q], where));
    const uint64_t q_sends = sizes_got[2 * q], q_expects = sizes_got[2 * q + 1];
    auto differ = [&](int from, int to, uint64_t sent, uint64_t expected) {
      return InvalidArgumentError(std::string(kSizeWhat) + ": ranks disagree on a block's size: " +
                                  internal::DescribePeer(p2p, from) + " sends " +
                                  internal::DescribePeer(p2p, to) + " " + std::to_string(sent) +
                                  " bytes but " + internal::DescribePeer(p2p, to) + " expects " +
                                  std::to_string(expected));
    };
    if (q_sends != blocks[q].recv_bytes) return differ(q, r, q_sends, blocks[q].recv_bytes);
    if (q_expects != blocks[q].send_bytes) return differ(r, q, blocks[q].send_bytes, q_expects);
  }
  for (size_t i = 0; i < receives.size(); ++i) {
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, false, from[i]};
    DDP_RETURN_IF_ERROR(requests.Wait(receives[i], where));
  }
  return requests.WaitAll(kWhat);
}

}  // namespace ddp::transport::algorithms
