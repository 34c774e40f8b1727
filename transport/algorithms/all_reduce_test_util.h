#ifndef DDP_TRANSPORT_ALGORITHMS_ALL_REDUCE_TEST_UTIL_H_
#define DDP_TRANSPORT_ALGORITHMS_ALL_REDUCE_TEST_UTIL_H_

// The checks every all-reduce algorithm's test runs, over N threads on the
// loopback: results against closed forms for many world sizes, counts,
// dtypes and ops, in-place and out-of-place; and the failure behaviour
// (mismatched counts, a dead rank, a deadline, bad arguments); and the
// endpoints and counters tests use to order ranks by what they observed
// rather than by sleeps.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "transport/algorithms/collective.h"
#include "transport/p2p/point_to_point.h"
#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::algorithms::testing {

using AllReduceFn = std::function<Status(p2p::PointToPoint&, const CollectiveArgs&)>;

struct AllReduceCase {
  int world = 1;
  size_t count = 0;
  DataType dtype = DataType::kF32;
  ReduceOp op = ReduceOp::kSum;
  bool in_place = false;
  size_t chunk_bytes = 0;  ///< 0: the algorithm's default
  int depth = 0;
};

std::string ToString(const AllReduceCase& c);

/// Runs one case and records a gtest failure (naming the case and rank) for
/// any rank that fails or ends with a wrong result or a write past its
/// buffer.
void CheckAllReduce(const AllReduceFn& fn, const AllReduceCase& c);

/// f32 sum and avg, in-place and out-of-place, for counts 0, 1, world - 1,
/// an odd count, and several chunks (tiny chunks, several depths).
void SweepCounts(const AllReduceFn& fn, int world);

/// Every dtype and op, in-place and out-of-place, at `count` elements with
/// chunks of `chunk_bytes`.
void SweepTypesAndOps(const AllReduceFn& fn, int world, size_t count, size_t chunk_bytes);

/// Random non-integer f32, f16 and bf16 inputs (and, in the first
/// elements, +0 against -0, -0 alone and NaNs with payloads that differ per
/// rank), every op: every rank's output must equal rank 0's bit for bit, and
/// be close to the exact (f64) result. The closed-form sweeps use small
/// integers, exact in any order, so they cannot see an algorithm whose ranks
/// reduce in different orders; this can.
void SweepRandomValues(const AllReduceFn& fn, int world, size_t count = 301,
                       size_t chunk_bytes = 64);

/// One rank passes a different count: every rank must fail (none returns
/// OK with a wrong result). Run twice: with the harness killing each rank
/// that fails, as a crashed process looks to its peers, every rank must fail
/// well before the deadline; with nobody killed, every rank must still fail,
/// by its deadline at the latest. Only the ranks that check the odd one's
/// fingerprint, and the ring ranks a stop note reaches (RelayStops), fail
/// at once then: the others wait for data from ranks that have given up,
/// as nothing tells them (a known limitation).
void CheckMismatchedCountsFailEverywhere(const AllReduceFn& fn, int world);

/// The ranks in `empty_ranks` (default: world / 2) pass count 0 to
/// `empty_fn` (another algorithm, as the automatic choice for 0 bytes may
/// be) while the others pass more to `fn`: every rank must fail, before the
/// deadline, where an empty call used to return at once and leave the
/// others waiting for it.
void CheckEmptyAgainstNonEmptyFailsEverywhere(const AllReduceFn& fn, const AllReduceFn& empty_fn,
                                              int world, std::vector<int> empty_ranks = {});

/// One rank is killed while stuck inside the collective: every survivor fails
/// with PEER_LOST or TIMED_OUT, well before its deadline.
void CheckKilledRankFailsSurvivors(const AllReduceFn& fn, int world);

/// One rank never arrives and nobody is killed: every other rank returns
/// TIMED_OUT at its deadline, not later.
void CheckAbsentRankTimesOut(const AllReduceFn& fn, int world);

/// No rank sends or receives more than `factor` times the vector's bytes
/// (plus a little for fingerprints): nothing funnels through one rank.
void CheckTraffic(const AllReduceFn& fn, int world, size_t count, double factor);

/// Null buffers, unset deadline, bad enums, partial overlap: INVALID_ARGUMENT
/// naming the argument, on every rank.
void CheckBadArguments(const AllReduceFn& fn, const std::string& name);

/// A PointToPoint that passes every call on to `inner` and calls
/// BeforeWait and AfterWait around each blocking wait (WaitAll, WaitAny):
/// tests derive from it to see when their rank blocks.
class WaitObservingEndpoint : public p2p::PointToPoint {
 public:
  explicit WaitObservingEndpoint(p2p::PointToPoint& inner) : inner_(inner) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  StatusOr<p2p::RequestId> PostSend(int peer, p2p::Tag tag, const void* data,
                                    size_t bytes) override {
    return inner_.PostSend(peer, tag, data, bytes);
  }
  StatusOr<p2p::RequestId> PostRecv(int peer, p2p::Tag tag, void* data, size_t bytes) override {
    return inner_.PostRecv(peer, tag, data, bytes);
  }
  Status PostNotice(int peer, p2p::Tag tag, const void* data, size_t bytes) override {
    return inner_.PostNotice(peer, tag, data, bytes);
  }
  StatusOr<bool> Test(p2p::RequestId request) override { return inner_.Test(request); }
  Status WaitAll(std::span<const p2p::RequestId> requests, Deadline deadline) override {
    BeforeWait();
    Status status = inner_.WaitAll(requests, deadline);
    AfterWait();
    return status;
  }
  StatusOr<size_t> WaitAny(std::span<const p2p::RequestId> requests, Deadline deadline) override {
    BeforeWait();
    StatusOr<size_t> index = inner_.WaitAny(requests, deadline);
    AfterWait();
    return index;
  }
  void MarkWatched(p2p::RequestId request) override { inner_.MarkWatched(request); }
  void Cancel(p2p::RequestId request) override { inner_.Cancel(request); }
  void CancelAll(std::span<const p2p::RequestId> requests) override { inner_.CancelAll(requests); }
  uint64_t UnconfirmedReleases() const override { return inner_.UnconfirmedReleases(); }

 protected:
  virtual void BeforeWait() {}
  virtual void AfterWait() {}

 private:
  p2p::PointToPoint& inner_;
};

/// Counts arrivals at a point (ranks past it, waits entered), for tests
/// that hold a rank back until others have got somewhere. Thread-safe.
class Arrivals {
 public:
  void Arrive() {
    std::lock_guard<std::mutex> lock(mu_);
    ++arrived_;
    cv_.notify_all();
  }
  /// True once there have been `n` arrivals; false if `within` passed first.
  bool AwaitAtLeast(int n, std::chrono::milliseconds within = std::chrono::seconds(20)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, within, [&] { return arrived_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
};

/// An endpoint that counts in `waits` the waits its rank enters, or
/// (`returns`) those it comes back from, and passes every call on.
class WaitCountingEndpoint final : public WaitObservingEndpoint {
 public:
  WaitCountingEndpoint(p2p::PointToPoint& inner, Arrivals& waits, bool returns = false)
      : WaitObservingEndpoint(inner), waits_(waits), returns_(returns) {}

 private:
  void BeforeWait() override {
    if (!returns_) waits_.Arrive();
  }
  void AfterWait() override {
    if (returns_) waits_.Arrive();
  }

  Arrivals& waits_;
  bool returns_;
};

}  // namespace ddp::transport::algorithms::testing

#endif  // DDP_TRANSPORT_ALGORITHMS_ALL_REDUCE_TEST_UTIL_H_
