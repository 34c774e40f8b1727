#include "transport/cuda/reduce_kernels.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

namespace ddp::transport::cuda {
namespace {

TEST(ReduceKernels, SumF32MatchesHost) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess) << "no CUDA device";
  ASSERT_GT(devices, 0);
  for (size_t count : {size_t{0}, size_t{1}, size_t{1000}, size_t{3} << 20}) {
    std::vector<float> a(count), b(count);
    for (size_t i = 0; i < count; ++i) {
      a[i] = static_cast<float>(i % 97);
      b[i] = static_cast<float>(i % 31) * 0.5f;
    }
    float *da = nullptr, *db = nullptr;
    const size_t bytes = count * sizeof(float) + 1;
    ASSERT_EQ(cudaMalloc(&da, bytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&db, bytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(da, a.data(), count * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(db, b.data(), count * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(SumF32Async(da, db, count, nullptr), 0);
    std::vector<float> out(count);
    ASSERT_EQ(cudaMemcpy(out.data(), da, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], a[i] + b[i]) << "index " << i;
    cudaFree(da);
    cudaFree(db);
  }
}

}  // namespace
}  // namespace ddp::transport::cuda
