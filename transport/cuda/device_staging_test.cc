// The CUDA copy engine on a real GPU (tag "gpu"): pointer classification,
// strided copies between device buffers and pinned slots, and one staged
// all-reduce over a single rank end to end.

#include "transport/cuda/device_staging.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "transport/cuda/cuda_util.h"

namespace ddp::transport::cuda {
namespace {

using std::chrono::milliseconds;

// Classifying a host pointer must not make a CUDA context (a CPU trainer
// built with CUDA would get hundreds of MiB on GPU 0 in every rank). Checked
// in a freshly started copy of this binary (the threadsafe death-test style
// re-executes it), where no CUDA call has made a context yet, whatever the
// other tests of this process did.
TEST(DeviceStaging, HostPointerClassifiedWithoutCreatingAContext) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess) << "no CUDA device";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        for (int d = 0; d < devices; ++d) {
          if (PrimaryContextActive(d)) {
            std::fprintf(stderr, "device %d has a context before any CUDA work\n", d);
            std::exit(2);
          }
        }
        std::vector<char> pageable(64);
        if (ClassifyPointer(pageable.data()).device) {
          std::fprintf(stderr, "a host pointer was classified as device memory\n");
          std::exit(3);
        }
        for (int d = 0; d < devices; ++d) {
          if (PrimaryContextActive(d)) {
            std::fprintf(stderr, "classifying a host pointer made a context on device %d\n", d);
            std::exit(4);
          }
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(DeviceStaging, ClassifiesDeviceAndHostPointers) {
  ASSERT_TRUE(BuiltWithCuda());
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess) << "no CUDA device";
  ASSERT_GT(devices, 0);
  void* device = nullptr;
  void* pinned = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 64), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&pinned, 64), cudaSuccess);
  std::vector<char> pageable(64);
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);

  const PointerKind d = ClassifyPointer(static_cast<char*>(device) + 8);
  EXPECT_TRUE(d.device);
  EXPECT_EQ(d.device_id, current);
  EXPECT_FALSE(ClassifyPointer(pinned).device);
  EXPECT_FALSE(ClassifyPointer(pageable.data()).device);
  EXPECT_FALSE(ClassifyPointer(nullptr).device);
  cudaFree(device);
  cudaFreeHost(pinned);
}

TEST(DeviceStaging, StridedCopiesRoundTrip) {
  auto engine = DeviceCopyEngine::Create(0, 4096);
  ASSERT_TRUE(engine.ok()) << engine.status();
  // A 3 x 100-byte block out of rows of 256 bytes on the device, packed
  // into slot 1, then written back to another device buffer with rows of
  // 128 bytes.
  std::vector<unsigned char> host(3 * 256);
  std::iota(host.begin(), host.end(), 0);
  void *src = nullptr, *dst = nullptr;
  ASSERT_EQ(cudaMalloc(&src, host.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dst, 3 * 128), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(src, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dst, 0, 3 * 128), cudaSuccess);
  DeviceCopyEngine& e = **engine;
  ASSERT_TRUE(e.Copy2D(e.slot(1), 100, src, 256, 100, 3).ok());
  ASSERT_TRUE(e.MarkIn(1).ok());
  ASSERT_TRUE(e.WaitIn(1, DeadlineIn(milliseconds(5000))).ok());
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 100; ++i) {
      ASSERT_EQ(static_cast<unsigned char>(e.slot(1)[r * 100 + i]), host[r * 256 + i]);
    }
  }
  ASSERT_TRUE(e.Copy2D(dst, 128, e.slot(1), 100, 100, 3).ok());
  ASSERT_TRUE(e.WaitAll(DeadlineIn(milliseconds(5000))).ok());
  std::vector<unsigned char> back(3 * 128);
  ASSERT_EQ(cudaMemcpy(back.data(), dst, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 128; ++i) {
      ASSERT_EQ(back[r * 128 + i], i < 100 ? host[r * 256 + i] : 0) << r << " " << i;
    }
  }
  cudaFree(src);
  cudaFree(dst);
}

// Slot 1 and scratch 1 start slot_bytes() after slot 0: an odd size would
// misalign them (cudaErrorMisalignedAddress in a kernel on f32 there).
TEST(DeviceStaging, OddSlotSizesAreRoundedSoEverySlotIsAligned) {
  auto engine = DeviceCopyEngine::Create(0, 1001);
  ASSERT_TRUE(engine.ok()) << engine.status();
  DeviceCopyEngine& e = **engine;
  EXPECT_EQ(e.slot_bytes(), 1024u);
  for (int s = 0; s < CopyEngine::kSlots; ++s) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(e.slot(s)) % kStagingSlotAlign, 0u) << s;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(e.scratch(s)) % kStagingSlotAlign, 0u) << s;
  }
  // A reduction of f32 in scratch 1 (1001 bytes past an aligned base
  // before the rounding).
  const float* sources[] = {reinterpret_cast<const float*>(e.scratch(1))};
  ASSERT_TRUE(e.Reduce(e.scratch(1), reinterpret_cast<const void* const*>(sources), 1, 16,
                       DataType::kF32, ReduceOp::kSum)
                  .ok());
  EXPECT_TRUE(e.WaitAll(DeadlineIn(milliseconds(5000))).ok());
}

// The destructor frees the scratch in its stream's order (cudaFreeAsync,
// awaited with a bound) rather than with cudaFree, which waits for the
// whole device: the memory must still come back, with the user's work
// queued on another stream meanwhile.
TEST(DeviceStaging, EngineDestroyedWithWorkOnAnotherStreamFreesItsScratch) {
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  auto engine = DeviceCopyEngine::Create(0, size_t{64} << 20);  // 128 MiB of scratch
  ASSERT_TRUE(engine.ok()) << engine.status();
  cudaStream_t busy = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking), cudaSuccess);
  void* big = nullptr;
  ASSERT_EQ(cudaMalloc(&big, size_t{1} << 26), cudaSuccess);
  for (int i = 0; i < 100; ++i) cudaMemsetAsync(big, i, size_t{1} << 26, busy);
  engine->reset();
  EXPECT_EQ(cudaStreamSynchronize(busy), cudaSuccess);
  cudaStreamDestroy(busy);
  cudaFree(big);
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_GE(free_after + (size_t{32} << 20), free_before);
}

TEST(DeviceStaging, OneRankAllReduceThroughManyChunks) {
  // 1000 floats through slots of 64 bytes asked for (256 made, the
  // alignment): 16 chunks, each doubled on the host.
  auto engine = DeviceCopyEngine::Create(0, 64);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_EQ((*engine)->slot_bytes(), 256u);
  std::vector<float> host(1000);
  std::iota(host.begin(), host.end(), 0.0f);
  float* data = nullptr;
  ASSERT_EQ(cudaMalloc(&data, host.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(data, host.data(), host.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  StagedCall call{.kind = StagedKind::kAllReduce, .send = data, .recv = data,
                  .count = host.size(), .dtype = DataType::kF32, .rank = 0, .size = 1};
  int chunks = 0;
  Status s = RunStaged(
      **engine, call,
      [&](const void* send, void* recv, size_t n) {
        ++chunks;
        const float* in = static_cast<const float*>(send);
        float* out = static_cast<float*>(recv);
        for (size_t i = 0; i < n; ++i) out[i] = 2 * in[i];
        return Status::Ok();
      },
      DeadlineIn(milliseconds(10000)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(chunks, 16);
  std::vector<float> back(host.size());
  ASSERT_EQ(cudaMemcpy(back.data(), data, back.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], 2.0f * i) << i;
  cudaFree(data);
}

}  // namespace
}  // namespace ddp::transport::cuda
