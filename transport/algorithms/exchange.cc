#include "transport/algorithms/exchange.h"

#include <algorithm>
#include <cstdint>
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
  DDP_RETURN_IF_ERROR(check.Post(requests, tag, check_to, check_from));
  // Receives first, so that no message waits unexpected; then the sends,
  // starting with the next rank so that not every rank sends to rank 0
  // first.
  std::vector<p2p::RequestId> receives;
  std::vector<int> from;
  for (int i = 1; i < p; ++i) {
    const int q = (r + p - i) % p;
    if (blocks[q].recv_bytes == 0 && !empty_messages) continue;
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, false, q};
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId id,
                         requests.Recv(where, internal::StepTag(tag, 0), blocks[q].recv,
                                       blocks[q].recv_bytes));
    receives.push_back(id);
    from.push_back(q);
  }
  for (int i = 1; i < p; ++i) {
    const int q = (r + i) % p;
    if (blocks[q].send_bytes == 0 && !empty_messages) continue;
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, true, q};
    DDP_RETURN_IF_ERROR(requests.Send(where, internal::StepTag(tag, 0), blocks[q].send,
                                      blocks[q].send_bytes)
                            .status());
  }
  // As they arrive: a peer running another collective may never send one
  // here, while another's mismatch is already in.
  DDP_RETURN_IF_ERROR(check.VerifyAsTheyArrive(requests));
  for (size_t i = 0; i < receives.size(); ++i) {
    internal::Where where{kWhat, 0, 0, internal::Where::kNoChunk, false, from[i]};
    DDP_RETURN_IF_ERROR(requests.Wait(receives[i], where));
  }
  return requests.WaitAll(kWhat);
}

}  // namespace ddp::transport::algorithms
