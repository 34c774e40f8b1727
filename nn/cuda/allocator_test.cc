// The caching allocator on a real GPU (tag "gpu").
#include "nn/cuda/allocator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "nn/cuda/cuda.h"
#include "nn/cuda/cuda_error.h"
#include "nn/cuda/stream.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

class CudaAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override { Init(); }
};

// What one training step of a small model asks for, freed at the end.
void FakeStep() {
  std::vector<Tensor> live;
  for (int64_t n : {64 * 784, 784 * 512, 512, 512 * 10, 10, 64 * 512, 64 * 10, 1, 0, 3 * 1024 * 1024}) {
    live.push_back(Empty({n}, {.device = kGpu}));
  }
  live.push_back(Empty({64, 512}, {.dtype = DType::kFloat16, .device = kGpu}));
}

TEST_F(CudaAllocatorTest, SecondStepAllocatesNothingNew) {
  FakeStep();
  const AllocatorStats warm = CudaAllocator().Stats(kGpu);
  for (int i = 0; i < 5; ++i) FakeStep();
  const AllocatorStats after = CudaAllocator().Stats(kGpu);
  EXPECT_EQ(after.system_allocations, warm.system_allocations);
  EXPECT_EQ(after.requests, warm.requests + 5 * 11);
  EXPECT_EQ(after.in_use_bytes, warm.in_use_bytes);
}

TEST_F(CudaAllocatorTest, InUseAndCachedBytesFollowTheTensors) {
  const AllocatorStats before = CudaAllocator().Stats(kGpu);
  {
    Tensor t = Empty({1000}, {.device = kGpu});  // 4000 bytes -> 4096
    EXPECT_EQ(CudaAllocator().Stats(kGpu).in_use_bytes, before.in_use_bytes + 4096);
  }
  const AllocatorStats after = CudaAllocator().Stats(kGpu);
  EXPECT_EQ(after.in_use_bytes, before.in_use_bytes);
  EXPECT_GE(after.cached_bytes, 4096u);
}

TEST_F(CudaAllocatorTest, BlocksAreReusedOnlyOnTheirOwnStream) {
  Stream side(kGpu);
  const int64_t n = 12345;  // a size no other test uses
  { StreamGuard guard(kGpu, side.get()); Tensor t = Empty({n}, {.device = kGpu}); }
  const uint64_t before = CudaAllocator().Stats(kGpu).system_allocations;
  { Tensor t = Empty({n}, {.device = kGpu}); }  // default stream: the side stream's block is not eligible
  EXPECT_EQ(CudaAllocator().Stats(kGpu).system_allocations, before + 1);
  { StreamGuard guard(kGpu, side.get()); Tensor t = Empty({n}, {.device = kGpu}); }
  { Tensor t = Empty({n}, {.device = kGpu}); }
  EXPECT_EQ(CudaAllocator().Stats(kGpu).system_allocations, before + 1);
  side.Synchronize();
}

TEST_F(CudaAllocatorTest, ARecreatedStreamDoesNotInheritTheDestroyedOnesBlocks) {
  const int64_t n = 13579;  // a size no other test uses
  uint64_t first_id = 0;
  {
    Stream first(kGpu);
    first_id = first.id();
    StreamGuard guard(kGpu, first.get());
    Tensor t = Empty({n}, {.device = kGpu});
    first.Synchronize();
  }  // the block is cached under the destroyed stream's id
  EXPECT_FALSE(StreamAlive(first_id));
  Stream second(kGpu);  // CUDA may give it the same handle
  EXPECT_NE(second.id(), first_id);
  EXPECT_TRUE(StreamAlive(second.id()));
  const uint64_t before = CudaAllocator().Stats(kGpu).system_allocations;
  {
    StreamGuard guard(kGpu, second.get());
    EXPECT_EQ(CurrentStreamId(kGpu), second.id());
    Tensor t = Empty({n}, {.device = kGpu});
  }
  EXPECT_EQ(CudaAllocator().Stats(kGpu).system_allocations, before + 1);
  second.Synchronize();
}

TEST_F(CudaAllocatorTest, BlockRecordedOnADestroyedStreamIsNeverReused) {
  const int64_t n = 24680;  // a size no other test uses
  void* first = nullptr;
  {
    Tensor t = Empty({n}, {.device = kGpu});
    first = t.data_ptr();
    Stream side(kGpu);
    RecordStream(t, side.get());
    side.Synchronize();
  }  // freed after `side` is gone: reported on stderr and leaked
  Tensor u = Empty({n}, {.device = kGpu});
  EXPECT_NE(u.data_ptr(), first);
}

// Holds a stream in a host callback until opened (or for 10 s at most), so
// that work queued behind it is known not to have run yet.
struct Gate {
  std::atomic<bool> open{false};
};

void CUDART_CB HoldUntilOpen(void* arg) {
  auto* gate = static_cast<Gate*>(arg);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!gate->open.load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

TEST_F(CudaAllocatorTest, BlockUsedOnAnotherStreamIsReusedOnlyAfterThatStream) {
  Stream side(kGpu);
  Gate gate;
  const int64_t n = 23456;  // a size no other test uses
  void* first = nullptr;
  {
    Tensor t = Empty({n}, {.device = kGpu});  // allocated on the default stream
    first = t.data_ptr();
    CheckCuda(cudaLaunchHostFunc(side.get(), &HoldUntilOpen, &gate), "cudaLaunchHostFunc");
    RecordStream(t, side.get());  // the side stream (stalled) still "uses" t
  }
  void* second = nullptr;
  {
    Tensor u = Empty({n}, {.device = kGpu});
    second = u.data_ptr();
    EXPECT_NE(second, first) << "a block was reused before the stream that uses it had passed";
  }
  gate.open = true;
  side.Synchronize();
  const uint64_t before = CudaAllocator().Stats(kGpu).system_allocations;
  Tensor a = Empty({n}, {.device = kGpu}), b = Empty({n}, {.device = kGpu});
  EXPECT_EQ(CudaAllocator().Stats(kGpu).system_allocations, before) << "both blocks should be back in the cache";
  EXPECT_TRUE((a.data_ptr() == first && b.data_ptr() == second) || (a.data_ptr() == second && b.data_ptr() == first));
}

TEST_F(CudaAllocatorTest, RecordStreamRejectsForeignMemory) {
  float host = 0;
  EXPECT_THROW(RecordStream(Tensor::FromBlob(&host, {1}, DType::kFloat32), cudaStreamLegacy), std::invalid_argument);
}

TEST_F(CudaAllocatorTest, EmptyCacheReturnsEveryCachedBlock) {
  { Tensor t = Empty({1 << 20}, {.device = kGpu}); }
  EXPECT_GT(CudaAllocator().Stats(kGpu).cached_bytes, 0u);
  CudaAllocator().EmptyCache();
  EXPECT_EQ(CudaAllocator().Stats(kGpu).cached_bytes, 0u);
  const uint64_t before = CudaAllocator().Stats(kGpu).system_allocations;
  { Tensor t = Empty({1 << 20}, {.device = kGpu}); }
  EXPECT_EQ(CudaAllocator().Stats(kGpu).system_allocations, before + 1);
}

TEST_F(CudaAllocatorTest, OutOfMemoryIsABadAllocNamingTheDevice) {
  try {
    Tensor t = Empty({int64_t{1} << 50}, {.device = kGpu});  // 4 PiB
    FAIL() << "expected out of memory";
  } catch (const std::bad_alloc& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cuda:0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cudaMalloc"), std::string::npos) << msg;
  }
  // The allocator still works afterwards.
  Tensor t = Empty({16}, {.device = kGpu});
  EXPECT_EQ(t.numel(), 16);
}

TEST_F(CudaAllocatorTest, MissingDeviceIsNamed) {
  try {
    Tensor t = Empty({16}, {.device = Device(DeviceType::kCUDA, 4096)});
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:4096"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ddp::nn::cuda
