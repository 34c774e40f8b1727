#include "transport/algorithms/pipeline.h"

#include <chrono>
#include <cstddef>
#include <cstring>
#include <new>
#include <span>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/p2p/group_view.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/thread_harness.h"

// Array allocations fail on demand, as when memory runs out: Scratch's
// arena allocates with new[]. (Replacing the global operator new[] is the
// seam; it reaches the library too.)
namespace {
thread_local bool fail_next_array_new = false;
}  // namespace

void* operator new[](std::size_t bytes) {
  if (fail_next_array_new) {
    fail_next_array_new = false;
    throw std::bad_alloc();
  }
  return ::operator new(bytes);
}
void operator delete[](void* p) noexcept { ::operator delete(p); }
void operator delete[](void* p, std::size_t) noexcept { ::operator delete(p); }

namespace ddp::transport::algorithms::internal {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

// The arena keeps its largest block and hands it out again; a nested
// Scratch gets a block of its own.
// What rides in front of data must give back every field exactly: a
// difference lost in packing would let two disagreeing ranks pass, and a
// changed value would name the wrong arguments.
TEST(PackedFingerprintTest, GivesBackEveryField) {
  Fingerprint f;
  f.count = (uint64_t{1} << 40) + 3;
  f.dtype = static_cast<int32_t>(DataType::kBF16);
  f.op = -1;
  f.root = kMaxWorldSize - 1;
  f.kind = kScatterKind;
  f.whole_count = ~uint64_t{0} - 5;
  EXPECT_EQ(PackedFingerprint::Pack(f).Unpack(), f);
  f.op = static_cast<int32_t>(ReduceOp::kAvg);
  f.root = -1;
  EXPECT_EQ(PackedFingerprint::Pack(f).Unpack(), f);
}

TEST(ScratchTest, ReusesTheArenaAndGivesANestedOneItsOwnBlock) {
  unsigned char* first = nullptr;
  {
    Scratch a(4096);
    first = a.data();
    ASSERT_NE(first, nullptr);
    std::memset(a.data(), 1, 4096);
    Scratch nested(100);
    ASSERT_NE(nested.data(), nullptr);
    EXPECT_NE(nested.data(), first);
  }
  Scratch again(1000);
  EXPECT_EQ(again.data(), first);
}

// When growing the arena throws, the next Scratch still gets memory. (The
// arena used to keep its old size with no block, and a smaller Scratch
// then got a null pointer.)
TEST(ScratchTest, FailedGrowthLeavesNoBlocklessArena) {
  { Scratch warm(1024); }
  fail_next_array_new = true;
  EXPECT_THROW(Scratch(1 << 20), std::bad_alloc);
  fail_next_array_new = false;
  Scratch small(512);
  ASSERT_NE(small.data(), nullptr);
  std::memset(small.data(), 7, 512);
  EXPECT_EQ(small.data()[511], 7);
}

// Blocks above kScratchRetainBytes are the call's own: the arena holds no
// more afterwards than before. (It used to keep its largest block forever,
// so a tree reduce of a 4 GiB vector left 4 GiB on each inner rank's
// thread.) Small blocks are still kept and handed out again.
TEST(ScratchTest, LargeBlocksAreNotRetained) {
  { Scratch warm(1 << 20); }
  const size_t before = ScratchRetainedBytes();
  EXPECT_GE(before, size_t{1} << 20);
  EXPECT_LE(before, 2 * kScratchRetainBytes);
  {
    Scratch big(kScratchRetainBytes + 1);
    ASSERT_NE(big.data(), nullptr);
    std::memset(big.data(), 3, kScratchRetainBytes + 1);
    Scratch nested_big(2 * kScratchRetainBytes);
    ASSERT_NE(nested_big.data(), nullptr);
  }
  EXPECT_EQ(ScratchRetainedBytes(), before);
}

// Two nested Scratches both come from the arena, and both are reused.
TEST(ScratchTest, TwoNestedBlocksAreBothReused) {
  unsigned char *outer = nullptr, *inner = nullptr;
  {
    Scratch a(2048), b(2048);
    outer = a.data();
    inner = b.data();
    EXPECT_NE(outer, inner);
  }
  Scratch a(1024), b(1024);
  EXPECT_EQ(a.data(), outer);
  EXPECT_EQ(b.data(), inner);
}

// A PointToPoint whose requests never complete, recording how they are
// cancelled.
class Recorder final : public p2p::PointToPoint {
 public:
  int rank() const override { return 0; }
  int size() const override { return 9; }
  StatusOr<p2p::RequestId> PostSend(int, p2p::Tag, const void*, size_t) override {
    return ++last_;
  }
  StatusOr<p2p::RequestId> PostRecv(int, p2p::Tag, void*, size_t) override { return ++last_; }
  // A notice has no handle, so nothing to record about its cancellation.
  Status PostNotice(int, p2p::Tag, const void*, size_t) override { return Status(); }
  StatusOr<bool> Test(p2p::RequestId) override { return false; }
  Status WaitAll(std::span<const p2p::RequestId>, Deadline) override {
    return TimedOutError("never");
  }
  StatusOr<size_t> WaitAny(std::span<const p2p::RequestId>, Deadline) override {
    return TimedOutError("never");
  }
  void MarkWatched(p2p::RequestId id) override { watched.push_back(id); }
  void Cancel(p2p::RequestId id) override { cancelled_one_by_one.push_back(id); }
  void CancelAll(std::span<const p2p::RequestId> ids) override {
    cancelled_together.emplace_back(ids.begin(), ids.end());
    if (cancel_unconfirmed) unconfirmed_ += ids.size();
  }
  uint64_t UnconfirmedReleases() const override { return unconfirmed_; }

  // Cancels as UCX does for a same-host peer whose request does not finish
  // within its grace: the buffer may still be written later.
  bool cancel_unconfirmed = false;
  std::vector<p2p::RequestId> watched;  // MarkWatched's ids, in order
  std::vector<p2p::RequestId> cancelled_one_by_one;
  std::vector<std::vector<p2p::RequestId>> cancelled_together;

 private:
  p2p::RequestId last_ = 0;
  uint64_t unconfirmed_ = 0;
};

// A collective that gives up with requests to many peers outstanding
// cancels them in one call, so that the transport waits for all of them
// together (UCX: one grace and one round of forced closes, not one per peer).
TEST(RequestsTest, DestructorCancelsEverythingOutstandingInOneCall) {
  Recorder p2p;
  std::vector<p2p::RequestId> expected;
  {
    Requests requests(p2p, DeadlineIn(std::chrono::milliseconds(1000)));
    int buffer[8] = {};
    for (int peer = 1; peer < 9; ++peer) {
      auto send = requests.Send(Where{"test", 0, 0, Where::kNoChunk, true, peer}, 1,
                                &buffer[peer - 1], sizeof(int));
      auto recv = requests.Recv(Where{"test", 0, 0, Where::kNoChunk, false, peer}, 2,
                                &buffer[peer - 1], sizeof(int));
      ASSERT_TRUE(send.ok() && recv.ok());
      expected.push_back(*send);
      expected.push_back(*recv);
    }
    // A request the collective waited for is released by the wait and not
    // cancelled again.
    EXPECT_FALSE(requests.Wait(expected.front(), Where{"test", 0, 0, Where::kNoChunk, true, 1})
                     .ok());
    expected.erase(expected.begin());
  }
  EXPECT_TRUE(p2p.cancelled_one_by_one.empty());
  ASSERT_EQ(p2p.cancelled_together.size(), 1u);
  EXPECT_THAT(p2p.cancelled_together[0], ::testing::UnorderedElementsAreArray(expected));
}

TEST(RequestsTest, DestructorWithNothingOutstandingCancelsNothing) {
  Recorder p2p;
  { Requests requests(p2p, DeadlineIn(std::chrono::milliseconds(1000))); }
  EXPECT_TRUE(p2p.cancelled_one_by_one.empty());
  EXPECT_TRUE(p2p.cancelled_together.empty());
}

// What the scripted endpoints below share: rank `rank` of `size`; a
// request completes only through their WaitAll or WaitAny, and watching,
// cancelling and releasing do nothing.
class ScriptedEndpoint : public p2p::PointToPoint {
 public:
  ScriptedEndpoint(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  StatusOr<bool> Test(p2p::RequestId) override { return false; }
  void MarkWatched(p2p::RequestId) override {}
  void Cancel(p2p::RequestId) override {}
  void CancelAll(std::span<const p2p::RequestId>) override {}
  uint64_t UnconfirmedReleases() const override { return 0; }

 private:
  const int rank_;
  const int size_;
};

// Rank 1 of 3, its stop notes from rank 0 (RelayStops), waiting for data
// from rank 2. The note's receive first takes a note of another call (one
// left at the same tag, kStopNoteTags calls away); by then rank 0 has left,
// so posting that receive again fails PEER_LOST. Its data from rank 2
// completes once asked for alone.
class NoteSenderLeftEndpoint final : public ScriptedEndpoint {
 public:
  NoteSenderLeftEndpoint() : ScriptedEndpoint(/*rank=*/1, /*size=*/3) {}
  StatusOr<p2p::RequestId> PostSend(int, p2p::Tag, const void*, size_t) override {
    return ++last_;
  }
  StatusOr<p2p::RequestId> PostRecv(int peer, p2p::Tag, void* data, size_t bytes) override {
    if (peer != 0) return data_recv_ = ++last_;
    if (note_posts_++ > 0) return PeerLostError("rank 0 has left");
    note_data_ = data;
    note_bytes_ = bytes;
    return note_recv_ = ++last_;
  }
  Status PostNotice(int, p2p::Tag, const void*, size_t) override { return Status(); }
  Status WaitAll(std::span<const p2p::RequestId> ids, Deadline) override {
    if (ids.size() == 1 && ids[0] == data_recv_) return Status();
    return TimedOutError("not the data receive alone");
  }
  StatusOr<size_t> WaitAny(std::span<const p2p::RequestId> ids, Deadline) override {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] != note_recv_ || note_delivered_) continue;
      // The note's call_id, its last field (no padding after a uint64_t
      // that follows 8-byte-aligned fields): another call's.
      const uint64_t other_call = 1 + kStopNoteTags;
      std::memcpy(static_cast<char*>(note_data_) + note_bytes_ - sizeof(other_call), &other_call,
                  sizeof(other_call));
      note_delivered_ = true;
      return i;
    }
    return TimedOutError("the data is asked for with a watched receive (rank 0's) still listed");
  }

 private:
  p2p::RequestId last_ = 0;
  p2p::RequestId data_recv_ = 0;
  p2p::RequestId note_recv_ = 0;
  int note_posts_ = 0;
  void* note_data_ = nullptr;
  size_t note_bytes_ = 0;
  bool note_delivered_ = false;
};

// A note of another call taken after its sender left: no note of this call
// can come, and the wait goes on for its own request. It failed with
// PEER_LOST from re-posting the note's receive, although the data's own
// peer was alive.
TEST(RequestsTest, ANoteOfAnotherCallFromAPeerThatLeftDoesNotFailTheWait) {
  NoteSenderLeftEndpoint p2p;
  Requests requests(p2p, DeadlineIn(std::chrono::milliseconds(1000)));
  ASSERT_TRUE(requests.RelayStops("test", /*call_id=*/1, /*phase_tag=*/0, /*from=*/0, /*to=*/2).ok());
  float data = 0;
  const Where where{"test", 0, 0, Where::kNoChunk, false, 2};
  auto recv = requests.Recv(where, 5, &data, sizeof(data));
  ASSERT_TRUE(recv.ok()) << recv.status();
  const Status status = requests.Wait(*recv, where);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_TRUE(requests.WaitAll("test").ok());
}

// Rank 1 of 3 in an empty call's check, with peers 0 and 2. Rank 0's stop
// note receive first takes a note of another call; by then rank 0 has left,
// so posting that receive again fails PEER_LOST. Every fingerprint that
// comes is `theirs`.
class EmptyCallNoteSenderLeftEndpoint final : public ScriptedEndpoint {
 public:
  explicit EmptyCallNoteSenderLeftEndpoint(const Fingerprint& theirs)
      : ScriptedEndpoint(/*rank=*/1, /*size=*/3), theirs_(theirs) {}
  StatusOr<p2p::RequestId> PostSend(int, p2p::Tag, const void*, size_t) override {
    return ++last_;
  }
  StatusOr<p2p::RequestId> PostRecv(int peer, p2p::Tag, void* data, size_t bytes) override {
    const bool note = bytes != sizeof(Fingerprint);
    if (note && peer == 0 && note_posts_from_0_++ > 0) return PeerLostError("rank 0 has left");
    recvs_.push_back({++last_, peer, data, bytes, note, false});
    return last_;
  }
  Status PostNotice(int, p2p::Tag, const void*, size_t) override { return Status(); }
  Status WaitAll(std::span<const p2p::RequestId>, Deadline) override { return Status(); }
  StatusOr<size_t> WaitAny(std::span<const p2p::RequestId> ids, Deadline) override {
    // Rank 0's note first, then the fingerprints; no note of rank 2's.
    for (bool notes : {true, false}) {
      for (size_t i = 0; i < ids.size(); ++i) {
        Recv* recv = Find(ids[i]);
        if (recv == nullptr || recv->done || recv->note != notes || (notes && recv->peer != 0)) continue;
        if (notes) {
          // Another call's note: its call_id is its last field.
          const uint64_t other_call = 1 + kStopNoteTags;
          std::memcpy(static_cast<char*>(recv->data) + recv->bytes - sizeof(other_call), &other_call,
                      sizeof(other_call));
        } else {
          std::memcpy(recv->data, &theirs_, sizeof(theirs_));
        }
        recv->done = true;
        return i;
      }
    }
    return TimedOutError("nothing more comes");
  }

 private:
  struct Recv {
    p2p::RequestId id;
    int peer;
    void* data;
    size_t bytes;
    bool note;
    bool done;
  };
  Recv* Find(p2p::RequestId id) {
    for (Recv& recv : recvs_) {
      if (recv.id == id) return &recv;
    }
    return nullptr;
  }
  const Fingerprint theirs_;
  p2p::RequestId last_ = 0;
  int note_posts_from_0_ = 0;
  std::vector<Recv> recvs_;
};

// As for a data wait above: the empty call's check drops the note it can
// no longer get and takes the fingerprints, which agree. It failed with
// PEER_LOST from re-posting rank 0's note receive.
TEST(CheckEmptyCallTest, ANoteOfAnotherCallFromAPeerThatLeftDoesNotFailTheCheck) {
  Fingerprint mine;
  mine.count = 0;
  mine.dtype = static_cast<int32_t>(DataType::kF32);
  mine.op = static_cast<int32_t>(ReduceOp::kSum);
  mine.root = -1;
  EmptyCallNoteSenderLeftEndpoint p2p(mine);
  const std::vector<CheckRound> rounds = {{/*phase_tag=*/0, {0, 2}}};
  const Status status = CheckEmptyCall(p2p, DeadlineIn(std::chrono::milliseconds(1000)), "test", mine,
                                       rounds, /*call_id=*/1);
  EXPECT_TRUE(status.ok()) << status;
}

// Only a data receive's message of another size names the count, dtype
// and tuning.chunk_bytes as causes; another INVALID_ARGUMENT of a receive
// wait (here a request id the transport does not know) is not about them,
// and was given that hint too.
TEST(RequestsTest, OnlyASizeMismatchOfDataNamesChunkBytes) {
  p2p::LoopbackHub hub(2);
  auto ep0 = std::move(hub.Connect(0)).value();
  auto ep1 = std::move(hub.Connect(1)).value();
  const Where from0{"test", 0, 0, Where::kNoChunk, false, 0};
  {
    Requests requests(*ep1, DeadlineIn(std::chrono::milliseconds(1000)));
    const Status unknown = requests.Wait(12345, from0);
    EXPECT_EQ(unknown.code(), StatusCode::kInvalidArgument) << unknown;
    EXPECT_THAT(unknown.message(), ::testing::Not(HasSubstr("tuning.chunk_bytes"))) << unknown;
  }
  // A message of another size: the data receive names the causes, an
  // argument check's receive does not.
  for (bool check_message : {false, true}) {
    Requests requests(*ep1, DeadlineIn(std::chrono::milliseconds(5000)));
    float got[2] = {};
    const float sent[3] = {};
    Where where = from0;
    where.check_message = check_message;
    auto recv = requests.Recv(where, 7, got, sizeof(got));
    ASSERT_TRUE(recv.ok()) << recv.status();
    auto send = ep0->PostSend(1, 7, sent, sizeof(sent));
    ASSERT_TRUE(send.ok()) << send.status();
    const Status status = requests.Wait(*recv, where);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status;
    EXPECT_EQ(status.message().find("tuning.chunk_bytes") != std::string::npos, !check_message)
        << status;
    const p2p::RequestId sends[1] = {*send};
    EXPECT_TRUE(ep0->WaitAll(sends, DeadlineIn(std::chrono::milliseconds(5000))).ok());
  }
}

// Rank 0 of 3 on a ring 2 -> 0 -> 1, its stop notes from rank 2
// (RelayStops) and its argument check from rank 2 (whose fingerprint is
// this rank's own): every wait that lists request kFailing fails with
// `failure`. Counts the stop notes it posts.
class FailingWaitEndpoint final : public ScriptedEndpoint {
 public:
  static constexpr p2p::RequestId kFailing = 12345;
  FailingWaitEndpoint(const Fingerprint& theirs, Status failure)
      : ScriptedEndpoint(/*rank=*/0, /*size=*/3), theirs_(theirs), failure_(std::move(failure)) {}
  StatusOr<p2p::RequestId> PostSend(int, p2p::Tag, const void*, size_t bytes) override {
    if (bytes != sizeof(Fingerprint)) ++notes_;  // a stop note sent as a plain send
    return ++last_;
  }
  StatusOr<p2p::RequestId> PostRecv(int, p2p::Tag, void* data, size_t bytes) override {
    if (bytes == sizeof(Fingerprint)) {
      fingerprint_data_ = data;
      return fingerprint_recv_ = ++last_;
    }
    return ++last_;
  }
  Status PostNotice(int, p2p::Tag, const void*, size_t) override {
    ++notes_;
    return Status();
  }
  Status WaitAll(std::span<const p2p::RequestId> ids, Deadline) override {
    for (p2p::RequestId id : ids) {
      if (id == kFailing) return failure_;
    }
    return Status();
  }
  StatusOr<size_t> WaitAny(std::span<const p2p::RequestId> ids, Deadline) override {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] == kFailing) return failure_;
      if (ids[i] == fingerprint_recv_ && fingerprint_data_ != nullptr) {
        std::memcpy(fingerprint_data_, &theirs_, sizeof(theirs_));
        fingerprint_data_ = nullptr;
        return i;
      }
    }
    return TimedOutError("nothing more comes");
  }

  int notes() const { return notes_; }

 private:
  const Fingerprint theirs_;
  const Status failure_;
  p2p::RequestId last_ = 0;
  p2p::RequestId fingerprint_recv_ = 0;
  void* fingerprint_data_ = nullptr;
  int notes_ = 0;
};

// A data wait that fails INVALID_ARGUMENT for a message of another size
// stops the other ranks with a note naming the peer; one that fails
// INVALID_ARGUMENT for another reason (a request id the transport does not
// know) is this rank's own fault, not the peer's arguments. It sent the
// others a note all the same, blaming the peer's data, and the wait for a
// fingerprint riding with the data first waited for a note until its
// deadline.
TEST(RequestsTest, OnlyADataSizeMismatchSendsAStopNote) {
  Fingerprint mine;
  mine.count = 8;
  mine.dtype = static_cast<int32_t>(DataType::kF32);
  mine.op = static_cast<int32_t>(ReduceOp::kSum);
  mine.root = -1;
  mine.kind = kRhdAllReduceKind;
  mine.whole_count = 8;
  const Status unknown = InvalidArgumentError("loopback: rank 0 has no outstanding request 12345");
  const Status other_size =
      InvalidArgumentError("message size mismatch: rank 2 sent 36 bytes but rank 0 expected 32");
  for (bool size_mismatch : {false, true}) {
    const Status& failure = size_mismatch ? other_size : unknown;
    for (bool with_fingerprint : {false, true}) {
      const std::string what = failure.message() + (with_fingerprint ? ", with fingerprint" : "");
      FailingWaitEndpoint p2p(mine, failure);
      Requests requests(p2p, DeadlineIn(std::chrono::milliseconds(1000)));
      ASSERT_TRUE(requests.RelayStops("test", /*call_id=*/1, /*phase_tag=*/0, /*from=*/2, /*to=*/1)
                      .ok());
      PeerCheck check("test", mine);
      ASSERT_TRUE(check.Post(requests, /*phase_tag=*/0, /*call_id=*/1, {1}, {2}).ok());
      const Where where{"test", 0, 0, Where::kNoChunk, false, 2};
      unsigned char header[sizeof(PackedFingerprint)] = {};
      const Status status = with_fingerprint
                                ? requests.WaitWithFingerprint(FailingWaitEndpoint::kFailing, where,
                                                               header)
                                : requests.Wait(FailingWaitEndpoint::kFailing, where);
      EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << what << ": " << status;
      EXPECT_EQ(p2p.notes(), size_mismatch ? 1 : 0) << what << ": " << status;
    }
  }
}

// A call that fails with receives the transport could not confirm it
// cancelled (UCX, same-host peer) keeps its scratch blocks for good: a late
// write must not land in freed memory, nor in the next call's scratch.
TEST(ScratchTest, BlocksOfAFailedCallWithUnconfirmedCancelsAreQuarantined) {
  const ScratchQuarantine before = ScratchQuarantined();
  const size_t small_bytes = 1024, large_bytes = kScratchRetainBytes + 1;
  { Scratch warm(small_bytes); }
  const size_t retained_before = ScratchRetainedBytes();
  Recorder p2p;
  p2p.cancel_unconfirmed = true;
  {
    Scratch small(small_bytes);  // from the arena
    Scratch large(large_bytes);  // its own
    Requests requests(p2p, DeadlineIn(std::chrono::milliseconds(1000)));
    ASSERT_TRUE(requests.Recv(Where{"test", 0, 0, Where::kNoChunk, false, 1}, 1, small.data(),
                              small_bytes).ok());
    ASSERT_TRUE(requests.Recv(Where{"test", 0, 0, Where::kNoChunk, false, 2}, 1, large.data(),
                              large_bytes).ok());
    EXPECT_FALSE(requests.Wait(1, Where{"test", 0, 0, Where::kNoChunk, false, 1}).ok());
  }
  const ScratchQuarantine after = ScratchQuarantined();
  EXPECT_EQ(after.blocks, before.blocks + 2);
  EXPECT_GE(after.bytes, before.bytes + small_bytes + large_bytes);
  // The small block left the arena too.
  EXPECT_EQ(retained_before - ScratchRetainedBytes(), after.bytes - before.bytes - large_bytes);
}

TEST(ScratchTest, BlocksOfAFailedCallWithConfirmedCancelsAreNotQuarantined) {
  const ScratchQuarantine before = ScratchQuarantined();
  Recorder p2p;
  {
    Scratch small(1024);
    Scratch large(kScratchRetainBytes + 1);
    Requests requests(p2p, DeadlineIn(std::chrono::milliseconds(1000)));
    ASSERT_TRUE(requests.Recv(Where{"test", 0, 0, Where::kNoChunk, false, 1}, 1, small.data(),
                              1024).ok());
    ASSERT_TRUE(requests.Recv(Where{"test", 0, 0, Where::kNoChunk, false, 2}, 1, large.data(),
                              kScratchRetainBytes + 1).ok());
  }
  EXPECT_EQ(ScratchQuarantined().blocks, before.blocks);
  EXPECT_GE(ScratchRetainedBytes(), 1024u);
}

// A view of a view names the rank under both levels, the one the
// transport's own errors name; only the first level's was given.
TEST(DescribePeerTest, ViewOfAViewNamesTheRankUnderEveryLevel) {
  p2p::LoopbackHub hub(6);
  auto ep = std::move(hub.Connect(4)).value();
  EXPECT_EQ(DescribePeer(*ep, 3), "rank 3");
  // Outer group ranks 0..3 are ranks 1, 3, 4, 5; inner group ranks 0, 1
  // are outer 3, 2, so ranks 5, 4.
  auto outer = p2p::GroupView::Create(*ep, {1, 3, 4, 5});
  ASSERT_TRUE(outer.ok()) << outer.status();
  EXPECT_EQ(DescribePeer(*outer, 1), "group rank 1 (rank 3)");
  auto inner = p2p::GroupView::Create(*outer, {3, 2});
  ASSERT_TRUE(inner.ok()) << inner.status();
  EXPECT_EQ(DescribePeer(*inner, 0), "group rank 0 (rank 5)");
  EXPECT_EQ(DescribePeer(*inner, 1), "group rank 1 (rank 4)");
  auto innermost = p2p::GroupView::Create(*inner, {1, 0});
  ASSERT_TRUE(innermost.ok()) << innermost.status();
  EXPECT_EQ(DescribePeer(*innermost, 1), "group rank 1 (rank 5)");
}

// A stop note names ranks in the numbering under every view: an empty
// call's check on the whole world told a rank that waits in a view of
// another order (a ring's, or its host's) of a disagreement, and that rank
// read the world's ranks as its view's, naming itself as the finder and
// the finder as the rank that differed.
TEST(StopNoteTest, ARankInAViewOfAnotherOrderNamesTheRanksTheNoteMeant) {
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;  // rank 1 must learn of it from the note
  const Deadline deadline = DeadlineIn(10s);
  auto statuses = ::ddp::transport::testing::RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    Fingerprint mine;
    mine.count = p2p.rank() == 0 ? 0 : 5;
    mine.whole_count = mine.count;
    mine.dtype = static_cast<int32_t>(DataType::kF32);
    mine.op = static_cast<int32_t>(ReduceOp::kSum);
    mine.root = -1;
    mine.kind = kRingAllReduceKind;
    if (p2p.rank() == 0) {
      return CheckEmptyCall(p2p, deadline, "test", mine, {{/*phase_tag=*/0, {1}}},
                            /*call_id=*/1);
    }
    auto sent = p2p.PostSend(0, FingerprintTag(0, 1), &mine, sizeof(mine));
    if (!sent.ok()) return sent.status();
    const p2p::RequestId one[1] = {*sent};
    DDP_RETURN_IF_ERROR(p2p.WaitAll(one, deadline));
    // Group rank 0 is rank 1, group rank 1 is rank 0 (the finder).
    DDP_ASSIGN_OR_RETURN(p2p::GroupView view, p2p::GroupView::Create(p2p, {1, 0}));
    Requests requests(view, deadline);
    DDP_RETURN_IF_ERROR(requests.RelayStops("test", /*call_id=*/1, /*phase_tag=*/0,
                                            /*from=*/1, /*to=*/-1));
    float data = 0;
    const Where where{"test", 0, 0, Where::kNoChunk, false, 1};
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId recv,
                         requests.Recv(where, CallStepTag(0, CallDataBase(1), 0), &data,
                                       sizeof(data)));
    return requests.Wait(recv, where);
  }, options);
  EXPECT_LT(Clock::now() + 5s, deadline) << "rank 1 waited for its deadline";
  EXPECT_EQ(statuses[0].code(), StatusCode::kInvalidArgument) << statuses[0];
  ASSERT_EQ(statuses[1].code(), StatusCode::kInvalidArgument) << statuses[1];
  EXPECT_THAT(statuses[1].message(),
              HasSubstr("group rank 1 (rank 0), this rank's ring predecessor, found"));
  EXPECT_THAT(statuses[1].message(), HasSubstr("group rank 0 (rank 1) passed ring all-reduce, "
                                               "count 5 of f32, op sum but group rank 1 (rank 0) "
                                               "passed ring all-reduce, count 0"));
}

// The other way: a rank in a view of another order finds the
// disagreement and tells the empty call's rank on the whole world, which
// read the view's ranks as the world's.
TEST(StopNoteTest, AnEmptyCallsRankNamesTheRanksANoteFromAViewMeant) {
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;  // rank 0 must learn of it from the note
  const Deadline deadline = DeadlineIn(10s);
  auto statuses = ::ddp::transport::testing::RunRanks(2, [&](p2p::PointToPoint& p2p) -> Status {
    Fingerprint mine;
    mine.count = p2p.rank() == 0 ? 0 : 5;
    mine.whole_count = mine.count;
    mine.dtype = static_cast<int32_t>(DataType::kF32);
    mine.op = static_cast<int32_t>(ReduceOp::kSum);
    mine.root = -1;
    mine.kind = kRingAllReduceKind;
    if (p2p.rank() == 0) {
      return CheckEmptyCall(p2p, deadline, "test", mine, {{/*phase_tag=*/0, {1}}},
                            /*call_id=*/1);
    }
    // Group rank 0 is rank 1, group rank 1 is rank 0. This rank checks
    // rank 0 and sends it no fingerprint: only the note reaches it.
    DDP_ASSIGN_OR_RETURN(p2p::GroupView view, p2p::GroupView::Create(p2p, {1, 0}));
    Requests requests(view, deadline);
    DDP_RETURN_IF_ERROR(requests.RelayStops("test", /*call_id=*/1, /*phase_tag=*/0,
                                            /*from=*/1, /*to=*/-1, /*leaf=*/1));
    PeerCheck check("test", mine);
    DDP_RETURN_IF_ERROR(check.Post(requests, /*phase_tag=*/0, /*call_id=*/1, {}, {1}));
    return requests.WaitAll("test");
  }, options);
  EXPECT_LT(Clock::now() + 5s, deadline) << "rank 0 waited for its deadline";
  EXPECT_EQ(statuses[1].code(), StatusCode::kInvalidArgument) << statuses[1];
  ASSERT_EQ(statuses[0].code(), StatusCode::kInvalidArgument) << statuses[0];
  EXPECT_THAT(statuses[0].message(),
              HasSubstr("rank 1 found that ranks disagree on the arguments, and told this rank: "
                        "rank 0 passed ring all-reduce, count 0 of f32, op sum but rank 1 passed "
                        "ring all-reduce, count 5"));
}

// CheckEveryRank: with every rank agreeing, OK everywhere, each rank
// sending ceil(log2 p) messages; with one rank differing, wherever it is,
// INVALID_ARGUMENT on every rank naming it and both values, at once and
// with nobody killed (no rank may learn of it from a peer's death).
TEST(CheckEveryRankTest, OneDifferenceAnywhereFailsEveryRankAndAgreementPasses) {
  Fingerprint mine;
  mine.count = 16;
  mine.dtype = static_cast<int32_t>(DataType::kF32);
  mine.op = -1;
  mine.root = 0;
  mine.kind = kBroadcastKind;
  mine.whole_count = 16;
  Fingerprint odd_one = mine;
  odd_one.count = 17;
  odd_one.whole_count = 17;
  ::ddp::transport::testing::HarnessOptions no_kill;
  no_kill.kill_on_error = false;
  for (int world : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16}) {
    int rounds = 0;
    while ((1 << rounds) < world) ++rounds;
    // -1: every rank agrees (a world of one rank has no one to differ).
    for (int odd = -1; odd < (world > 1 ? world : 0); ++odd) {
      const std::string what = std::to_string(world) + " ranks, odd rank " + std::to_string(odd);
      const Deadline deadline = DeadlineIn(10s);
      p2p::LoopbackHub hub(world);
      auto statuses = ::ddp::transport::testing::RunRanks(
          hub,
          [&](p2p::PointToPoint& p2p) {
            return CheckEveryRank(p2p, deadline, "test", p2p.rank() == odd ? odd_one : mine,
                                  /*phase_tag=*/0, /*call_id=*/0);
          },
          no_kill);
      EXPECT_LT(Clock::now() + 8s, deadline) << what;
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(hub.Stats(r).messages_sent, static_cast<uint64_t>(rounds)) << what << " rank " << r;
        if (odd < 0) {
          EXPECT_TRUE(statuses[r].ok()) << what << " rank " << r << ": " << statuses[r];
          continue;
        }
        EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << what << " rank " << r;
        EXPECT_THAT(statuses[r].message(),
                    HasSubstr("test, argument check: ranks disagree on the arguments: rank "))
            << what << " rank " << r;
        EXPECT_THAT(statuses[r].message(), HasSubstr("rank " + std::to_string(odd) + " passed "))
            << what << " rank " << r;
        EXPECT_THAT(statuses[r].message(), HasSubstr("count 17 of f32"))
            << what << " rank " << r;
        EXPECT_THAT(statuses[r].message(), HasSubstr("count 16 of f32"))
            << what << " rank " << r;
      }
      if (HasFailure()) return;
    }
  }
}

// A stop note can name a rank outside the view that runs the check (a
// hierarchical call's check on a subset, the note from a ring of the whole
// world). Its base number was kept as a rank of the view: in a 4-rank
// world, base rank 1 was read as group rank 1 of the view {3, 2}, which is
// rank 2, and named so.
TEST(CheckEveryRankTest, ANoteNamingARankOutsideTheViewNamesThatRank) {
  Fingerprint mine;
  mine.count = 16;
  mine.whole_count = 16;
  mine.dtype = static_cast<int32_t>(DataType::kF32);
  mine.op = -1;
  mine.root = 0;
  mine.kind = kBroadcastKind;
  Fingerprint ring = mine;
  ring.count = 5;
  ring.whole_count = 5;
  ring.op = static_cast<int32_t>(ReduceOp::kSum);
  ring.root = -1;
  ring.kind = kRingAllReduceKind;
  // Requests::StopNote's layout, as it goes on the wire.
  struct Note {
    Fingerprint theirs;
    Fingerprint finders;
    int64_t their_rank;
    int64_t finder;
    uint64_t call_id;
  };
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;  // rank 3 must learn of it from the note
  const Deadline deadline = DeadlineIn(10s);
  auto statuses = ::ddp::transport::testing::RunRanks(4, [&](p2p::PointToPoint& p2p) -> Status {
    if (p2p.rank() < 2) return Status();
    // Group rank 0 is rank 3, group rank 1 is rank 2.
    DDP_ASSIGN_OR_RETURN(p2p::GroupView view, p2p::GroupView::Create(p2p, {3, 2}));
    if (p2p.rank() == 3) {
      return CheckEveryRank(view, deadline, "test", mine, /*phase_tag=*/0, /*call_id=*/1);
    }
    // Rank 2 found that rank 1 passed a ring all-reduce, and tells its
    // successor in the view, taking that one's first round.
    const Note note{ring, mine, /*their_rank=*/1, /*finder=*/2, /*call_id=*/1};
    Fingerprint first;
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId sent,
                         view.PostSend(0, StopNoteTag(0, 1), &note, sizeof(note)));
    DDP_ASSIGN_OR_RETURN(const p2p::RequestId got,
                         view.PostRecv(0, FingerprintTag(0, 1), &first, sizeof(first)));
    const p2p::RequestId both[2] = {sent, got};
    return view.WaitAll(both, deadline);
  }, options);
  EXPECT_LT(Clock::now() + 5s, deadline) << "rank 3 waited for its deadline";
  EXPECT_TRUE(statuses[2].ok()) << statuses[2];
  ASSERT_EQ(statuses[3].code(), StatusCode::kInvalidArgument) << statuses[3];
  EXPECT_THAT(statuses[3].message(),
              HasSubstr("ranks disagree on the arguments: rank 1 passed ring all-reduce, count 5 "
                        "of f32, op sum but group rank 1 (rank 2) passed broadcast"));
}

// Two ranks that differ from the rest, each in its own way: every rank
// fails, naming one of the differences it heard of.
TEST(CheckEveryRankTest, TwoDifferentDisagreementsFailEveryRank) {
  Fingerprint mine;
  mine.count = 8;
  mine.kind = kScatterKind;
  mine.whole_count = 8;
  ::ddp::transport::testing::HarnessOptions no_kill;
  no_kill.kill_on_error = false;
  const Deadline deadline = DeadlineIn(10s);
  auto statuses = ::ddp::transport::testing::RunRanks(
      7,
      [&](p2p::PointToPoint& p2p) {
        Fingerprint f = mine;
        if (p2p.rank() == 1) f.root = 3;
        if (p2p.rank() == 5) f.dtype = static_cast<int32_t>(DataType::kI32);
        return CheckEveryRank(p2p, deadline, "test", f, /*phase_tag=*/0, /*call_id=*/0);
      },
      no_kill);
  EXPECT_LT(Clock::now() + 8s, deadline);
  for (int r = 0; r < 7; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << statuses[r];
    EXPECT_THAT(statuses[r].message(), HasSubstr("disagree on the arguments")) << "rank " << r;
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms::internal
