// The staging pipeline on the CPU: a copy engine whose copies and
// reductions run later, in order, on a thread of their own (like a CUDA
// stream), and real collective algorithms over the loopback transport
// between ranks as threads. Results are checked against closed forms; a
// pipeline that read a slot before its copy landed, or reused a slot or the
// scratch too early, produces wrong values here.

#include "transport/cuda/staging_pipeline.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "transport/algorithms/all_gather.h"
#include "transport/algorithms/all_reduce.h"
#include "transport/algorithms/broadcast.h"
#include "transport/algorithms/collective.h"
#include "transport/algorithms/exchange.h"
#include "transport/algorithms/gather_scatter.h"
#include "transport/algorithms/reduce_scatter.h"
#include "transport/algorithms/rooted_reduce.h"
#include "transport/reduce/reduce.h"
#include "transport/testing/expected_values.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::cuda {
namespace {

using std::chrono::milliseconds;

// Copies and reductions run on a worker thread, each after a short delay,
// in queue order. The "device" scratch is ordinary memory that only queued
// work touches; reductions use transport/reduce, the host's kernels.
class ThreadCopyEngine : public CopyEngine {
 public:
  explicit ThreadCopyEngine(size_t slot_bytes, milliseconds delay = milliseconds(0))
      : slot_bytes_(slot_bytes), memory_(kSlots * slot_bytes),
        scratch_(kSlots * slot_bytes), delay_(delay), worker_([this] { Loop(); }) {}
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
  std::byte* scratch(int s) override { return scratch_.data() + s * slot_bytes_; }
  Status Reduce(void* dst, const void* const* sources, int num_sources, size_t count,
                DataType dtype, ReduceOp op) override {
    if (num_sources < 1 || num_sources > kMaxDeviceReduceSources) {
      return InvalidArgumentError("reduce of " + std::to_string(num_sources) + " sources");
    }
    std::vector<const void*> in(sources, sources + num_sources);
    ++reductions_;
    Push([=] {
      // Into a temporary: dst may equal any source.
      const size_t bytes = count * DataTypeSize(dtype);
      if (bytes == 0) return;  // (memcpy of a null vector's data is undefined)
      std::vector<std::byte> acc(bytes);
      std::memcpy(acc.data(), in[0], bytes);
      for (int k = 1; k < num_sources; ++k) reduce::Reduce(dtype, op, acc.data(), in[k], count);
      if (op == ReduceOp::kAvg) reduce::DivideInPlace(dtype, acc.data(), count, num_sources);
      std::memcpy(dst, acc.data(), bytes);
    });
    return Status::Ok();
  }
  size_t reductions() const { return reductions_; }
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
  std::vector<std::byte> scratch_;
  size_t reductions_ = 0;  // enqueued, by the pipeline's thread
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
  int root = -1;  // rooted kinds (and broadcast); -1: the last rank
};

std::string Describe(const Case& c) {
  static const char* kKinds[] = {"all-reduce", "broadcast", "all-gather", "reduce-scatter",
                                 "reduce",     "gather",    "scatter"};
  return std::string(kKinds[static_cast<int>(c.kind)]) + " world " + std::to_string(c.world) +
         " count " + std::to_string(c.count) + " " + DataTypeName(c.dtype) + " " +
         ReduceOpName(c.op) + " slot " + std::to_string(c.slot_bytes) + " root " +
         std::to_string(c.root >= 0 ? c.root : c.world - 1);
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
    if (c.kind == StagedKind::kAllGather || c.kind == StagedKind::kGather) recv_count = n * c.count;
    if (c.kind == StagedKind::kReduceScatter || c.kind == StagedKind::kScatter) {
      send_count = n * c.count;
    }
    std::vector<std::byte> send(send_count * e + 1), recv(recv_count * e + 1, std::byte{0x5A});
    const int root = c.root >= 0 ? c.root : c.world - 1;
    // The rooted kinds get null for the buffer this rank does not use: the
    // pipeline must not touch it.
    const bool rooted = c.kind == StagedKind::kReduce || c.kind == StagedKind::kGather ||
                        c.kind == StagedKind::kScatter;
    const bool unused_recv = rooted && c.kind != StagedKind::kScatter && me != root;
    const bool unused_send = c.kind == StagedKind::kScatter && me != root;
    if (c.kind == StagedKind::kBroadcast) {
      testing::FillInput(c.dtype, recv.data(), c.count, me == root ? 0 : 5, ReduceOp::kMax);
    } else {
      testing::FillInput(c.dtype, send.data(), send_count, me, c.op);
    }
    StagedCall call{.kind = c.kind,
                    .send = c.kind == StagedKind::kBroadcast ? recv.data()
                            : unused_send                    ? nullptr
                                                             : send.data(),
                    .recv = unused_recv ? nullptr : recv.data(),
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
        case StagedKind::kReduce: return algorithms::Reduce(p2p, args, algorithm);
        case StagedKind::kGather: return algorithms::Gather(p2p, args);
        case StagedKind::kScatter: return algorithms::Scatter(p2p, args);
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
      case StagedKind::kReduce:
        if (me == root) {
          wrong = testing::CountWrong(c.dtype, recv.data(), c.count, n, c.op, 0, &first);
        }
        break;
      case StagedKind::kGather:
        for (int r = 0; me == root && r < n; ++r) {
          for (size_t i = 0; i < c.count; ++i) {
            wrong += testing::Load(c.dtype, recv.data(), r * c.count + i) !=
                     testing::InputValue(r, i, c.op);
          }
        }
        break;
      case StagedKind::kScatter:
        for (size_t i = 0; i < c.count; ++i) {
          wrong += testing::Load(c.dtype, recv.data(), i) !=
                   testing::InputValue(root, me * c.count + i, c.op);
        }
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

TEST(StagingPipeline, RootedCollectivesManyChunks) {
  // The root is the first or the last rank; the others pass null for the
  // buffer they do not use. Reduce runs both of its algorithms and averages.
  for (StagedKind kind : {StagedKind::kReduce, StagedKind::kGather, StagedKind::kScatter}) {
    for (int world : {1, 2, 3, 4}) {
      for (int root : {world - 1, 0}) {
        if (root == 0 && world == 1) continue;
        for (DataType dtype : {DataType::kF32, DataType::kBF16}) {
          for (size_t count : {size_t{0}, size_t{1}, size_t{37}, size_t{1001}}) {
            for (size_t slot : {size_t{80}, size_t{1} << 16}) {
              for (Algorithm algorithm : {Algorithm::kTree, Algorithm::kRing}) {
                if (kind != StagedKind::kReduce && algorithm == Algorithm::kRing) continue;
                for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
                  if (kind != StagedKind::kReduce && op != ReduceOp::kSum) continue;
                  Check({kind, world, count, dtype, op, slot, root}, algorithm);
                }
              }
            }
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

// ---------------------------------------------------- device-reduce mode --

constexpr DataType kAllTypes[] = {DataType::kF32, DataType::kF64, DataType::kF16,
                                  DataType::kBF16, DataType::kI32, DataType::kI64,
                                  DataType::kU8};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax,
                                ReduceOp::kMin, ReduceOp::kProd};

struct DeviceCase {
  StagedKind kind;  // all-reduce or reduce-scatter
  int world;
  size_t count;
  DataType dtype;
  ReduceOp op;
  size_t slot_bytes;
  bool direct = false;    // the network reads the "device" buffers
  bool in_place = false;
};

std::string Describe(const DeviceCase& c) {
  return std::string(c.kind == StagedKind::kAllReduce ? "all-reduce" : "reduce-scatter") +
         " world " + std::to_string(c.world) + " count " + std::to_string(c.count) + " " +
         DataTypeName(c.dtype) + " " + ReduceOpName(c.op) + " slot " +
         std::to_string(c.slot_bytes) + (c.direct ? " direct" : " staged") +
         (c.in_place ? " in-place" : "");
}

// The exchange the communicator runs: DirectExchange over `p2p`, one tag
// per call.
HostExchange LoopbackExchange(p2p::PointToPoint& p2p, DataType dtype, uint64_t* sequence,
                              Deadline deadline, size_t* calls) {
  return [&p2p, dtype, sequence, deadline, calls](
             std::span<const algorithms::ExchangeBlock> blocks, size_t chunk) {
    ++*calls;
    algorithms::CollectiveArgs args{.count = chunk, .dtype = dtype,
                                    .tag = algorithms::CollectiveTag((*sequence)++),
                                    .deadline = deadline};
    return algorithms::DirectExchange(p2p, blocks, args);
  };
}

// Runs one case on every rank; per-rank mismatches land in `errors`.
Status RunDeviceCase(const DeviceCase& c, std::vector<std::string>* errors) {
  errors->assign(c.world, "");
  const size_t e = DataTypeSize(c.dtype);
  std::vector<Status> statuses = testing::RunRanks(c.world, [&](p2p::PointToPoint& p2p) -> Status {
    const int me = p2p.rank(), n = p2p.size();
    ThreadCopyEngine engine(c.slot_bytes, milliseconds(c.count > 100 ? 0 : 1));
    const bool rs = c.kind == StagedKind::kReduceScatter;
    const size_t send_count = rs ? n * c.count : c.count;
    std::vector<std::byte> send(send_count * e + 1, std::byte{0x3C});
    std::vector<std::byte> recv(c.count * e + 1, std::byte{0x5A});
    testing::FillInput(c.dtype, send.data(), send_count, me, c.op);
    const std::vector<std::byte> original = send;
    std::byte* out = recv.data();
    if (c.in_place) out = rs ? send.data() + me * c.count * e : send.data();
    StagedCall call{.kind = c.kind, .send = send.data(), .recv = out, .count = c.count,
                    .dtype = c.dtype, .rank = me, .size = n, .op = c.op};
    uint64_t sequence = 0;
    size_t exchanges = 0;
    const Deadline deadline = DeadlineIn(milliseconds(20000));
    DDP_RETURN_IF_ERROR(RunStagedDeviceReduce(
        engine, call, LoopbackExchange(p2p, c.dtype, &sequence, deadline, &exchanges), c.direct,
        deadline));
    const size_t n_max = DeviceReduceChunkElements(call, c.slot_bytes);
    const size_t chunks = c.count == 0 ? 0 : (c.count + n_max - 1) / n_max;
    std::string& error = (*errors)[me];
    if (exchanges != chunks * (rs ? 1 : 2)) {
      error = std::to_string(exchanges) + " exchanges for " + std::to_string(chunks) + " chunks";
    }
    if (engine.reductions() != chunks) {
      error += " " + std::to_string(engine.reductions()) + " device reductions";
    }
    // The host staging slots stay unused when the network reads the device.
    if (c.direct && engine.copies() != engine.reductions()) {
      error += " " + std::to_string(engine.copies() - engine.reductions()) + " host copies";
    }
    std::string first;
    const size_t wrong = testing::CountWrong(c.dtype, out, c.count, n, c.op,
                                             rs ? me * c.count : 0, &first);
    if (wrong > 0) error += " " + std::to_string(wrong) + " wrong " + first;
    if (!c.in_place && recv[c.count * e] != std::byte{0x5A}) error += " wrote past the end";
    if (!c.in_place && send != original) error += " modified the send buffer";
    if (c.in_place && send[send_count * e] != std::byte{0x3C}) error += " wrote past the end";
    return Status::Ok();
  });
  for (const Status& s : statuses) DDP_RETURN_IF_ERROR(s);
  return Status::Ok();
}

void CheckDevice(const DeviceCase& c) {
  std::vector<std::string> errors;
  Status s = RunDeviceCase(c, &errors);
  ASSERT_TRUE(s.ok()) << Describe(c) << ": " << s.ToString();
  for (int r = 0; r < c.world; ++r) EXPECT_EQ(errors[r], "") << Describe(c) << " rank " << r;
}

TEST(StagingPipelineDeviceReduce, EveryDtypeAndOpAcrossChunkBoundaries) {
  for (StagedKind kind : {StagedKind::kAllReduce, StagedKind::kReduceScatter}) {
    for (bool direct : {false, true}) {
      for (int world : {1, 2, 3, 4, 5}) {
        for (DataType dtype : kAllTypes) {
          for (ReduceOp op : kAllOps) {
            // 96-byte slots: a few elements per chunk, several chunks.
            CheckDevice({kind, world, 23, dtype, op, 96, direct});
          }
        }
      }
    }
  }
}

TEST(StagingPipelineDeviceReduce, CountsFromZeroToManyChunksInAndOutOfPlace) {
  for (StagedKind kind : {StagedKind::kAllReduce, StagedKind::kReduceScatter}) {
    for (bool direct : {false, true}) {
      for (int world : {1, 2, 3, 4, 5}) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{3}, size_t{37}, size_t{1001}}) {
          for (size_t slot : {size_t{64}, size_t{100}, size_t{1} << 16}) {
            for (bool in_place : {false, true}) {
              CheckDevice({kind, world, count, DataType::kBF16, ReduceOp::kSum, slot, direct,
                           in_place});
            }
          }
        }
      }
    }
  }
}

TEST(StagingPipelineDeviceReduce, ChunksFitTheSlotsExactly) {
  for (StagedKind kind : {StagedKind::kAllReduce, StagedKind::kReduceScatter}) {
    for (int world = 1; world <= kMaxDeviceReduceSources; ++world) {
      for (size_t slot : {size_t{8}, size_t{64}, size_t{100}, size_t{4} << 20}) {
        StagedCall call{.kind = kind, .count = 1, .dtype = DataType::kF32, .size = world};
        const size_t n = DeviceReduceChunkElements(call, slot);
        const size_t slot_elems = slot / 4;
        // What one chunk of n and of n + 1 elements needs of a slot.
        auto need = [&](size_t m) {
          const size_t segment = kind == StagedKind::kReduceScatter ? m : (m + world - 1) / world;
          const size_t out = kind == StagedKind::kReduceScatter ? world * m : m;
          return out + (world - 1) * segment;
        };
        const std::string what = std::to_string(world) + " ranks, slot " + std::to_string(slot);
        if (n > 0) {
          EXPECT_LE(need(n), slot_elems) << what;
        }
        EXPECT_GT(need(n + 1), slot_elems) << what;
      }
    }
  }
}

TEST(StagingPipelineDeviceReduce, PlanFollowsKindPreferenceWorldAndNetwork) {
  StagedCall call{.kind = StagedKind::kAllReduce, .size = 4};
  EXPECT_EQ(ChooseStagedPlan(call, true, false), StagedPlan::kDeviceReduce);
  EXPECT_EQ(ChooseStagedPlan(call, true, true), StagedPlan::kDeviceReduceDirect);
  EXPECT_EQ(ChooseStagedPlan(call, false, true), StagedPlan::kHostSlots);
  call.kind = StagedKind::kReduceScatter;
  EXPECT_EQ(ChooseStagedPlan(call, true, false), StagedPlan::kDeviceReduce);
  call.size = kMaxDeviceReduceSources;
  EXPECT_EQ(ChooseStagedPlan(call, true, false), StagedPlan::kDeviceReduce);
  // One kernel takes at most kMaxDeviceReduceSources segments.
  call.size = kMaxDeviceReduceSources + 1;
  EXPECT_EQ(ChooseStagedPlan(call, true, true), StagedPlan::kHostSlots);
  EXPECT_EQ(ChooseStagedPlan(call, true, false), StagedPlan::kHostSlots);
  // Broadcast and all-gather move bytes only: straight from device memory
  // when the network reads it, whatever the reduction preference.
  call.size = 2;
  for (StagedKind kind : {StagedKind::kBroadcast, StagedKind::kAllGather}) {
    call.kind = kind;
    for (bool prefer_device : {false, true}) {
      EXPECT_EQ(ChooseStagedPlan(call, prefer_device, false), StagedPlan::kHostSlots);
      EXPECT_EQ(ChooseStagedPlan(call, prefer_device, true), StagedPlan::kDirect);
    }
  }
}

TEST(StagingPipelineDeviceReduce, TooManyRanksOrAnotherKindIsRefused) {
  ThreadCopyEngine engine(1024);
  std::vector<float> data(40, 1.0f);
  StagedCall call{.kind = StagedKind::kAllReduce, .send = data.data(), .recv = data.data(),
                  .count = 2, .dtype = DataType::kF32, .rank = 0,
                  .size = kMaxDeviceReduceSources + 1};
  int calls = 0;
  auto exchange = [&](std::span<const algorithms::ExchangeBlock>, size_t) {
    ++calls;
    return Status::Ok();
  };
  Status s = RunStagedDeviceReduce(engine, call, exchange, false, DeadlineIn(milliseconds(1000)));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("at most 16 ranks, not 17"), std::string::npos) << s.ToString();
  call.size = 2;
  call.kind = StagedKind::kAllGather;
  s = RunStagedDeviceReduce(engine, call, exchange, false, DeadlineIn(milliseconds(1000)));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  call.kind = StagedKind::kReduceScatter;
  ThreadCopyEngine tiny(4);  // one f32 cannot hold two ranks' segments
  s = RunStagedDeviceReduce(tiny, call, exchange, false, DeadlineIn(milliseconds(1000)));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("4 bytes"), std::string::npos) << s.ToString();
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(engine.copies() + tiny.copies(), 0u);
}

TEST(StagingPipelineDeviceReduce, ExchangeFailureMidPipelineLeavesNothingPending) {
  for (bool direct : {false, true}) {
    for (StagedKind kind : {StagedKind::kAllReduce, StagedKind::kReduceScatter}) {
      ThreadCopyEngine engine(32, milliseconds(5));
      std::vector<float> send(2 * 40, 1.0f), recv(40, 0.0f);
      StagedCall call{.kind = kind, .send = send.data(), .recv = recv.data(), .count = 40,
                      .dtype = DataType::kF32, .rank = 1, .size = 2};
      int calls = 0;
      Status s = RunStagedDeviceReduce(
          engine, call,
          [&](std::span<const algorithms::ExchangeBlock> blocks, size_t) {
            EXPECT_EQ(blocks.size(), 2u);
            return ++calls == 3 ? PeerLostError("rank 0 died") : Status::Ok();
          },
          direct, DeadlineIn(milliseconds(5000)));
      EXPECT_EQ(s.code(), StatusCode::kPeerLost) << s.ToString();
      EXPECT_EQ(calls, 3);
      // Every copy and reduction queued before the failure has landed.
      EXPECT_TRUE(engine.WaitAll(Clock::now()).ok());
    }
  }
}

TEST(StagingPipelineDeviceReduce, SlowDeviceTimesOutAtTheDeadline) {
  for (bool direct : {false, true}) {
    ThreadCopyEngine engine(16, milliseconds(300));
    std::vector<float> data(64, 1.0f);
    StagedCall call{.kind = StagedKind::kAllReduce, .send = data.data(), .recv = data.data(),
                    .count = data.size(), .dtype = DataType::kF32, .rank = 0, .size = 1};
    const auto start = Clock::now();
    Status s = RunStagedDeviceReduce(
        engine, call, [](std::span<const algorithms::ExchangeBlock>, size_t) { return Status::Ok(); },
        direct, DeadlineIn(milliseconds(100)));
    EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s.ToString();
    EXPECT_LT(Clock::now() - start, milliseconds(2500));
  }
}

TEST(StagingPipelineDeviceReduce, RanksWithDifferentSlotSizesFailFast) {
  const auto start = Clock::now();
  std::vector<Status> statuses = testing::RunRanks(3, [&](p2p::PointToPoint& p2p) -> Status {
    const int me = p2p.rank();
    ThreadCopyEngine engine(me == 2 ? 128 : 64);
    std::vector<float> data(300, 1.0f);
    StagedCall call{.kind = StagedKind::kAllReduce, .send = data.data(), .recv = data.data(),
                    .count = data.size(), .dtype = DataType::kF32, .rank = me, .size = 3};
    uint64_t sequence = 0;
    size_t calls = 0;
    const Deadline deadline = DeadlineIn(milliseconds(20000));
    return RunStagedDeviceReduce(
        engine, call, LoopbackExchange(p2p, call.dtype, &sequence, deadline, &calls), false,
        deadline);
  });
  EXPECT_LT(Clock::now() - start, milliseconds(10000));
  // Rank 0 checks rank 2's chunk size and rank 2 checks rank 1's: whichever
  // compares first reports the mismatch; the others may lose it first.
  bool named = false;
  for (const Status& s : statuses) {
    EXPECT_FALSE(s.ok());
    named |= s.code() == StatusCode::kInvalidArgument &&
             s.message().find("direct exchange") != std::string::npos;
  }
  EXPECT_TRUE(named) << statuses[0].ToString() << "\n" << statuses[2].ToString();
}

// The communicator's classification of a call's buffers: a device plan
// given a host buffer would hand it to a kernel (cudaErrorIllegalAddress)
// or to a copy that blocks in the driver.
TEST(CallDevice, HostNextToDeviceIsRefusedNamingBoth) {
  int host = 0, dev = 0;  // only the addresses count
  const PointerKind on0{.device = true, .device_id = 0};
  const PointerKind on1{.device = true, .device_id = 1};
  const CallBuffer host_send_device_recv[] = {{"send buffer", &host, {}},
                                              {"receive buffer", &dev, on1}};
  StatusOr<int> device = CallDevice(host_send_device_recv, "all-reduce");
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device.status().message(),
            "all-reduce: the send buffer is host memory and the receive buffer is on CUDA "
            "device 1; one call takes host buffers or device buffers, not both");
  const CallBuffer device_send_host_recv[] = {{"send buffer", &dev, on0},
                                              {"receive buffer", &host, {}}};
  device = CallDevice(device_send_host_recv, "all-gather");
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().message(),
            "all-gather: the receive buffer is host memory and the send buffer is on CUDA "
            "device 0; one call takes host buffers or device buffers, not both");
}

TEST(CallDevice, TwoDevicesAreRefusedNamingBoth) {
  int a = 0, b = 0;
  const CallBuffer buffers[] = {{"send buffer", &a, {.device = true, .device_id = 0}},
                                {"receive buffer", &b, {.device = true, .device_id = 2}}};
  StatusOr<int> device = CallDevice(buffers, "reduce-scatter");
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().message(),
            "reduce-scatter: the send buffer is on CUDA device 0 and the receive buffer on CUDA "
            "device 2; one call uses one device");
}

TEST(CallDevice, UnusedInPlaceAndSingleKindBuffersAreAccepted) {
  int a = 0, b = 0;
  const PointerKind on3{.device = true, .device_id = 3};
  // A non-root's recv is not used: nullptr, whatever it would be.
  const CallBuffer unused_recv[] = {{"send buffer", &a, on3}, {"receive buffer", nullptr, {}}};
  EXPECT_EQ(*CallDevice(unused_recv, "reduce"), 3);
  const CallBuffer unused_send[] = {{"send buffer", nullptr, {}}, {"receive buffer", &a, on3}};
  EXPECT_EQ(*CallDevice(unused_send, "scatter"), 3);
  const CallBuffer in_place[] = {{"send buffer", &a, on3}, {"receive buffer", &a, on3}};
  EXPECT_EQ(*CallDevice(in_place, "all-reduce"), 3);
  const CallBuffer host[] = {{"send buffer", &a, {}}, {"receive buffer", &b, {}}};
  EXPECT_EQ(*CallDevice(host, "all-reduce"), -1);
  const CallBuffer none[] = {{"send buffer", nullptr, {}}, {"receive buffer", nullptr, {}}};
  EXPECT_EQ(*CallDevice(none, "gather"), -1);
}

// Slot 1 and scratch 1 start slot_bytes after slot 0: an odd chunk size
// would misalign every element there (cudaErrorMisalignedAddress).
TEST(StagingSlotBytes, RoundsUpToTheAlignmentAndKeepsOneElementPerRank) {
  EXPECT_EQ(StagingSlotBytes(size_t{4} << 20, 2), size_t{4} << 20);
  EXPECT_EQ(StagingSlotBytes((size_t{4} << 20) + 1, 2), (size_t{4} << 20) + kStagingSlotAlign);
  EXPECT_EQ(StagingSlotBytes(100, 2), kStagingSlotAlign);
  EXPECT_EQ(StagingSlotBytes(1, 63), 512u);  // 8 * 64 bytes
  EXPECT_EQ(StagingSlotBytes(1, 64), 768u);  // 8 * 65 = 520, rounded up
  for (size_t requested : {size_t{1}, size_t{255}, size_t{257}, size_t{4194305},
                           std::numeric_limits<size_t>::max()}) {
    const size_t slot = StagingSlotBytes(requested, 4);
    EXPECT_EQ(slot % kStagingSlotAlign, 0u) << requested;
    EXPECT_GE(slot, std::min(requested, std::numeric_limits<size_t>::max() / 4)) << requested;
    EXPECT_LE(slot, std::numeric_limits<size_t>::max() / CopyEngine::kSlots) << requested;
  }
}

}  // namespace
}  // namespace ddp::transport::cuda
