#ifndef DDP_TRANSPORT_ALGORITHMS_STALE_SEND_TEST_UTIL_H_
#define DDP_TRANSPORT_ALGORITHMS_STALE_SEND_TEST_UTIL_H_

// A test endpoint that makes the loopback deliver what UCX delivers: a
// small send cancelled before its receive took it (UCX completes such a
// send as it is posted). Tests use it to show that a failed call's
// messages are not taken by the next call at the same tag.

#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "transport/algorithms/collective.h"
#include "transport/algorithms/pipeline.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::algorithms::testing {

/// Passes every call on to `inner`, except that a data send (a tag below
/// its phase's fingerprint tags) cancelled before it was taken, or still
/// pending when a WaitAll that lists it fails, is delivered all the same: its bytes, copied as it was posted, go to the
/// peer as a notice at its tag, where the peer's next receive at that tag
/// takes them. The argument check's messages are left out unless
/// `deliver_checks`: their tags are shared by every algorithm and repeat
/// on every call kCallDataSlots apart (a call with the same arguments takes
/// the old fingerprint as its own; on the loopback, where a send completes
/// only when taken, the new one would then hold its sender). At most
/// kMaxNoticesPerPeer of them per peer.
class CancelledSendDeliveringEndpoint final : public p2p::PointToPoint {
 public:
  explicit CancelledSendDeliveringEndpoint(p2p::PointToPoint& inner, bool deliver_checks = false)
      : inner_(inner), deliver_checks_(deliver_checks) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  StatusOr<p2p::RequestId> PostSend(int peer, p2p::Tag tag, const void* data,
                                    size_t bytes) override {
    StatusOr<p2p::RequestId> id = inner_.PostSend(peer, tag, data, bytes);
    if (id.ok() && (deliver_checks_ || (tag & (kTagsPerPhase - 1)) < internal::kDataSteps)) {
      const auto* begin = static_cast<const unsigned char*>(data);
      sends_[*id] = Send{peer, tag, std::vector<unsigned char>(begin, begin + bytes)};
    }
    return id;
  }
  StatusOr<p2p::RequestId> PostRecv(int peer, p2p::Tag tag, void* data, size_t bytes) override {
    return inner_.PostRecv(peer, tag, data, bytes);
  }
  Status PostNotice(int peer, p2p::Tag tag, const void* data, size_t bytes) override {
    return inner_.PostNotice(peer, tag, data, bytes);
  }
  StatusOr<bool> Test(p2p::RequestId request) override {
    StatusOr<bool> done = inner_.Test(request);
    if (!done.ok() || *done) sends_.erase(request);
    return done;
  }
  Status WaitAll(std::span<const p2p::RequestId> requests, Deadline deadline) override {
    bool tracked = false;
    for (p2p::RequestId id : requests) tracked = tracked || sends_.count(id) != 0;
    if (!tracked) return inner_.WaitAll(requests, deadline);
    // One at a time, so that what is still pending when the wait fails is
    // known and given up through CancelAll, which delivers the data sends
    // among it (UCX would have completed those as they were posted).
    std::vector<p2p::RequestId> pending(requests.begin(), requests.end());
    while (!pending.empty()) {
      StatusOr<size_t> done = WaitAny(pending, deadline);
      if (!done.ok()) {
        // A request that failed is released already; the rest are not.
        std::vector<p2p::RequestId> rest;
        for (p2p::RequestId id : pending) {
          StatusOr<bool> finished = inner_.Test(id);  // released when finished
          if (finished.ok() && !*finished) {
            rest.push_back(id);
          } else {
            sends_.erase(id);
          }
        }
        CancelAll(rest);
        return done.status();
      }
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(*done));
    }
    return Status();
  }
  StatusOr<size_t> WaitAny(std::span<const p2p::RequestId> requests, Deadline deadline) override {
    StatusOr<size_t> index = inner_.WaitAny(requests, deadline);
    if (index.ok()) sends_.erase(requests[*index]);
    return index;
  }
  void MarkWatched(p2p::RequestId request) override { inner_.MarkWatched(request); }
  void Cancel(p2p::RequestId request) override {
    CancelAll(std::span<const p2p::RequestId>(&request, 1));
  }
  void CancelAll(std::span<const p2p::RequestId> requests) override {
    std::vector<Send> undelivered;
    for (p2p::RequestId id : requests) {
      auto it = sends_.find(id);
      if (it == sends_.end()) continue;
      StatusOr<bool> done = inner_.Test(id);  // taken meanwhile: released, nothing to deliver
      if (done.ok() && !*done) undelivered.push_back(std::move(it->second));
      sends_.erase(it);
    }
    inner_.CancelAll(requests);
    for (const Send& send : undelivered) {
      inner_.PostNotice(send.peer, send.tag, send.bytes.data(), send.bytes.size()).IgnoreError();
      ++delivered_;
    }
  }
  uint64_t UnconfirmedReleases() const override { return inner_.UnconfirmedReleases(); }

  /// Cancelled sends delivered so far.
  int delivered() const { return delivered_; }

 private:
  static constexpr p2p::Tag kTagsPerPhase = p2p::Tag{1} << kStepTagBits;
  struct Send {
    int peer = 0;
    p2p::Tag tag = 0;
    std::vector<unsigned char> bytes;
  };
  p2p::PointToPoint& inner_;
  const bool deliver_checks_;
  std::unordered_map<p2p::RequestId, Send> sends_;
  int delivered_ = 0;
};

}  // namespace ddp::transport::algorithms::testing

#endif  // DDP_TRANSPORT_ALGORITHMS_STALE_SEND_TEST_UTIL_H_
