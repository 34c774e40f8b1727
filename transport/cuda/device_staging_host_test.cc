// The CUDA build on any machine, GPU or not: host memory is never taken for
// device memory, and asking is cheap (on a machine without a driver the
// answer is remembered instead of failing a driver start-up per call).

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "transport/cuda/device_staging.h"

namespace ddp::transport::cuda {
namespace {

TEST(DeviceStagingHost, HostMemoryIsHostMemory) {
  EXPECT_TRUE(BuiltWithCuda());
  std::vector<float> heap(1000);
  float stack[4] = {};
  static float global[4];
  EXPECT_FALSE(ClassifyPointer(heap.data()).device);
  EXPECT_FALSE(ClassifyPointer(heap.data() + 999).device);
  EXPECT_FALSE(ClassifyPointer(stack).device);
  EXPECT_FALSE(ClassifyPointer(global).device);
  EXPECT_FALSE(ClassifyPointer(nullptr).device);
}

TEST(DeviceStagingHost, ClassifyingIsCheap) {
  std::vector<char> buffer(64);
  ClassifyPointer(buffer.data());  // the runtime's start-up, if any, happens here
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 10000; ++i) ASSERT_FALSE(ClassifyPointer(buffer.data() + i % 64).device);
  // 100 us per call (a driver start-up attempted every time) fails this.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
}

}  // namespace
}  // namespace ddp::transport::cuda
