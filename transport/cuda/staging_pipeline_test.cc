// The staging pipeline on the CPU: a copy engine whose copies run later, in
// order, on a thread of their own (like a CUDA stream), and real collective
// algorithms over the loopback transport between ranks as threads. Results
// are checked against closed forms; a pipeline that read a slot before its
// copy landed, or reused a slot too early, produces wrong values here.

#include "transport/cuda/staging_pipeline.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "transport/algorithms/all_gather.h"
#include "transport/algorithms/all_reduce.h"
#include "transport/algorithms/broadcast.h"
#include "transport/algorithms/collective.h"
#include "transport/algorithms/reduce_scatter.h"
#include "transport/testing/expected_values.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::cuda {
namespace {

using std::chrono::milliseconds;

// Copies run on a worker thread, each after a short delay, in queue order.
class ThreadCopyEngine : public CopyEngine {
 public:
  explicit ThreadCopyEngine(size_t slot_bytes, milliseconds delay = milliseconds(0))
      : slot_bytes_(slot_bytes), memory_(kSlots * slot_bytes), delay_(delay),
        worker_([this] { Loop(); }) {}
  ~ThreadCopyEngine() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  size_t slot_bytes() const override { return slot_bytes_; }
  std::byte* slot(int s) override { return memory_.data() + s * slot_bytes_; }
  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                size_t rows) override {
    Push([=] {
      for (size_t r = 0; r < rows; ++r) {
        std::memcpy(static_cast<std::byte*>(dst) + r * dst_pitch,
                    static_cast<const std::byte*>(src) + r * src_pitch, width);
      }
    });
    return Status::Ok();
  }
  Status MarkIn(int s) override {
    std::lock_guard lock(mu_);
    in_mark_[s] = enqueued_;
    return Status::Ok();
  }
  Status WaitIn(int s, Deadline deadline) override {
    std::unique_lock lock(mu_);
    return WaitFor(lock, in_mark_[s], deadline);
  }
  Status WaitAll(Deadline deadline) override {
    std::unique_lock lock(mu_);
    return WaitFor(lock, enqueued_, deadline);
  }
  size_t copies() {
    std::lock_guard lock(mu_);
    return enqueued_;
  }

 private:
  void Push(std::function<void()> copy) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(copy));
      ++enqueued_;
    }
    cv_.notify_all();
  }
  Status WaitFor(std::unique_lock<std::mutex>& lock, size_t mark, Deadline deadline) {
    if (!cv_.wait_until(lock, deadline, [&] { return completed_ >= mark; })) {
      return TimedOutError("copies not done");
    }
    return Status::Ok();
  }
  void Loop() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      std::function<void()> copy = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::this_thread::sleep_for(delay_);
      copy();
      lock.lock();
      ++completed_;
      cv_.notify_all();
    }
  }

  size_t slot_bytes_;
  std::vector<std::byte> memory_;
  milliseconds delay_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  size_t enqueued_ = 0, completed_ = 0;
  size_t in_mark_[kSlots] = {};
  bool stopping_ = false;
  std::thread worker_;
};

struct Case {
  StagedKind kind;
  int world;
  size_t count;
  DataType dtype;
  ReduceOp op;
  size_t slot_bytes;
};

std::string Describe(const Case& c) {
  static const char* kKinds[] = {"all-reduce", "broadcast", "all-gather", "reduce-scatter"};
  return std::string(kKinds[static_cast<int>(c.kind)]) + " world " + std::to_string(c.world) +
         " count " + std::to_string(c.count) + " " + DataTypeName(c.dtype) + " " +
         ReduceOpName(c.op) + " slot " + std::to_string(c.slot_bytes);
}

// Runs one case on every rank; returns the number of wrong elements (and a
// description of the first).
Status RunCase(const Case& c, Algorithm algorithm, std::vector<std::string>* errors) {
  errors->assign(c.world, "");
  const size_t e = DataTypeSize(c.dtype);
  std::vector<Status> statuses = testing::RunRanks(c.world, [&](p2p::PointToPoint& p2p) -> Status {
    const int me = p2p.rank(), n = p2p.size();
    ThreadCopyEngine engine(c.slot_bytes, milliseconds(c.count > 100 ? 0 : 1));
    size_t send_count = c.count, recv_count = c.count;
    if (c.kind == StagedKind::kAllGather) recv_count = n * c.count;
    if (c.kind == StagedKind::kReduceScatter) send_count = n * c.count;
    std::vector<std::byte> send(send_count * e + 1), recv(recv_count * e + 1, std::byte{0x5A});
    const int root = c.world - 1;
    if (c.kind == StagedKind::kBroadcast) {
      testing::FillInput(c.dtype, recv.data(), c.count, me == root ? 0 : 5, ReduceOp::kMax);
    } else {
      testing::FillInput(c.dtype, send.data(), send_count, me, c.op);
    }
    StagedCall call{.kind = c.kind,
                    .send = c.kind == StagedKind::kBroadcast ? recv.data() : send.data(),
                    .recv = recv.data(),
                    .count = c.count,
                    .dtype = c.dtype,
                    .rank = me,
                    .size = n,
                    .root = root};
    uint64_t sequence = 0;
    const Deadline deadline = DeadlineIn(milliseconds(20000));
    size_t chunks = 0;
    auto host = [&](const void* s, void* r, size_t count) -> Status {
      ++chunks;
      algorithms::CollectiveArgs args{.send = s, .recv = r, .count = count, .dtype = c.dtype,
                                      .op = c.op, .root = root,
                                      .tag = algorithms::CollectiveTag(sequence++),
                                      .deadline = deadline};
      switch (c.kind) {
        case StagedKind::kAllReduce: return algorithms::AllReduce(p2p, args, algorithm);
        case StagedKind::kBroadcast: return algorithms::Broadcast(p2p, args);
        case StagedKind::kAllGather: return algorithms::RingAllGather(p2p, args);
        case StagedKind::kReduceScatter: return algorithms::RingReduceScatter(p2p, args);
      }
      return InternalError("kind");
    };
    DDP_RETURN_IF_ERROR(RunStaged(engine, call, host, deadline));
    const size_t n_max = ChunkElements(call, c.slot_bytes);
    const size_t want_chunks = c.count == 0 ? 0 : (c.count + n_max - 1) / n_max;
    std::string& error = (*errors)[me];
    if (chunks != want_chunks) {
      error = "ran " + std::to_string(chunks) + " chunks, expected " + std::to_string(want_chunks);
    }
    std::string first;
    size_t wrong = 0;
    switch (c.kind) {
      case StagedKind::kAllReduce:
        wrong = testing::CountWrong(c.dtype, recv.data(), c.count, n, c.op, 0, &first);
        break;
      case StagedKind::kBroadcast:
        for (size_t i = 0; i < c.count; ++i) {
          wrong += testing::Load(c.dtype, recv.data(), i) != testing::InputValue(0, i, ReduceOp::kMax);
        }
        break;
      case StagedKind::kAllGather:
        for (int r = 0; r < n; ++r) {
          for (size_t i = 0; i < c.count; ++i) {
            wrong += testing::Load(c.dtype, recv.data(), r * c.count + i) !=
                     testing::InputValue(r, i, c.op);
          }
        }
        break;
      case StagedKind::kReduceScatter:
        wrong = testing::CountWrong(c.dtype, recv.data(), c.count, n, c.op, me * c.count, &first);
        break;
    }
    if (wrong > 0) error += " " + std::to_string(wrong) + " wrong " + first;
    if (recv[recv_count * e] != std::byte{0x5A}) error += " wrote past the end";
    return Status::Ok();
  });
  for (const Status& s : statuses) DDP_RETURN_IF_ERROR(s);
  return Status::Ok();
}

void Check(const Case& c, Algorithm algorithm = Algorithm::kRing) {
  std::vector<std::string> errors;
  Status s = RunCase(c, algorithm, &errors);
  ASSERT_TRUE(s.ok()) << Describe(c) << ": " << s.ToString();
  for (int r = 0; r < c.world; ++r) {
    EXPECT_EQ(errors[r], "") << Describe(c) << " " << AlgorithmName(algorithm) << " rank " << r;
  }
}

TEST(StagingPipeline, AllReduceEveryAlgorithmManyChunks) {
  for (Algorithm algorithm : {Algorithm::kRing, Algorithm::kTree, Algorithm::kRhd}) {
    for (int world : {1, 2, 3, 4}) {
      for (DataType dtype : {DataType::kF32, DataType::kF16, DataType::kBF16}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
          for (size_t count : {size_t{0}, size_t{1}, size_t{37}, size_t{1001}}) {
            Check({StagedKind::kAllReduce, world, count, dtype, op, 64}, algorithm);
          }
        }
      }
    }
  }
}

TEST(StagingPipeline, OtherCollectivesManyChunks) {
  for (StagedKind kind : {StagedKind::kBroadcast, StagedKind::kAllGather,
                          StagedKind::kReduceScatter}) {
    for (int world : {1, 2, 3, 4}) {
      for (DataType dtype : {DataType::kF32, DataType::kBF16}) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{37}, size_t{1001}}) {
          for (size_t slot : {size_t{80}, size_t{1} << 16}) {
            Check({kind, world, count, dtype, ReduceOp::kSum, slot});
          }
        }
      }
    }
  }
}

TEST(StagingPipeline, SlotsTooSmallForOneElementPerRankAreRefused) {
  ThreadCopyEngine engine(6);
  StagedCall call{.kind = StagedKind::kReduceScatter, .count = 10, .dtype = DataType::kF32,
                  .rank = 0, .size = 4};
  int calls = 0;
  Status s = RunStaged(engine, call, [&](const void*, void*, size_t) { ++calls; return Status::Ok(); },
                       DeadlineIn(milliseconds(1000)));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("6 bytes"), std::string::npos) << s.ToString();
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(engine.copies(), 0u);
}

TEST(StagingPipeline, HostFailureStopsTheCallAndLeavesNoCopyPending) {
  ThreadCopyEngine engine(16, milliseconds(5));
  std::vector<float> data(40, 1.0f);
  StagedCall call{.kind = StagedKind::kAllReduce, .send = data.data(), .recv = data.data(),
                  .count = data.size(), .dtype = DataType::kF32, .rank = 0, .size = 2};
  int calls = 0;
  Status s = RunStaged(
      engine, call,
      [&](const void*, void*, size_t) {
        return ++calls == 2 ? PeerLostError("rank 1 died") : Status::Ok();
      },
      DeadlineIn(milliseconds(5000)));
  EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s.ToString();
  EXPECT_EQ(calls, 2);
  // Every copy queued before the failure has landed.
  EXPECT_TRUE(engine.WaitAll(Clock::now()).ok());
}

TEST(StagingPipeline, SlowCopyTimesOutAtTheDeadline) {
  ThreadCopyEngine engine(16, milliseconds(300));
  std::vector<float> data(8, 1.0f);
  StagedCall call{.kind = StagedKind::kAllReduce, .send = data.data(), .recv = data.data(),
                  .count = data.size(), .dtype = DataType::kF32, .rank = 0, .size = 1};
  const auto start = Clock::now();
  Status s = RunStaged(engine, call, [](const void*, void*, size_t) { return Status::Ok(); },
                       DeadlineIn(milliseconds(100)));
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s.ToString();
  EXPECT_LT(Clock::now() - start, milliseconds(2000));
}

}  // namespace
}  // namespace ddp::transport::cuda
