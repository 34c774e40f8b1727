#include "transport/cuda/reduce_kernels.h"
#include "transport/reduce/half.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstring>
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

namespace ddp::transport::cuda {
namespace {

using reduce::BFloat16ToFloat;
using reduce::FloatToBFloat16;
using reduce::FloatToHalf;
using reduce::HalfToFloat;

// Host copies of the values a kernel reads and writes, per dtype code
// (transport/types.h): small integers, exact in every dtype.
void StoreAs(int dtype, std::vector<char>& buf, size_t i, double v) {
  switch (dtype) {
    case 0: { float x = static_cast<float>(v); std::memcpy(&buf[i * 4], &x, 4); break; }
    case 1: std::memcpy(&buf[i * 8], &v, 8); break;
    case 2: { uint16_t b = FloatToHalf(static_cast<float>(v)); std::memcpy(&buf[i * 2], &b, 2); break; }
    case 3: { uint16_t b = FloatToBFloat16(static_cast<float>(v)); std::memcpy(&buf[i * 2], &b, 2); break; }
    case 4: { int32_t x = static_cast<int32_t>(v); std::memcpy(&buf[i * 4], &x, 4); break; }
    case 5: { int64_t x = static_cast<int64_t>(v); std::memcpy(&buf[i * 8], &x, 8); break; }
    case 6: buf[i] = static_cast<char>(static_cast<uint8_t>(v)); break;
  }
}

double LoadAs(int dtype, const std::vector<char>& buf, size_t i) {
  switch (dtype) {
    case 0: { float x; std::memcpy(&x, &buf[i * 4], 4); return x; }
    case 1: { double x; std::memcpy(&x, &buf[i * 8], 8); return x; }
    case 2: { uint16_t b; std::memcpy(&b, &buf[i * 2], 2); return HalfToFloat(b); }
    case 3: { uint16_t b; std::memcpy(&b, &buf[i * 2], 2); return BFloat16ToFloat(b); }
    case 4: { int32_t x; std::memcpy(&x, &buf[i * 4], 4); return x; }
    case 5: { int64_t x; std::memcpy(&x, &buf[i * 8], 8); return static_cast<double>(x); }
    case 6: return static_cast<uint8_t>(buf[i]);
  }
  return 0;
}

TEST(ReduceKernels, EveryDtypeAndOpOverSeveralSources) {
  constexpr int kSources = 4;
  constexpr size_t kCount = 10007;
  const size_t sizes[] = {4, 8, 2, 2, 4, 8, 1};
  for (int dtype = 0; dtype < 7; ++dtype) {
    for (int op = 0; op < 5; ++op) {
      const size_t e = sizes[dtype];
      // Source k, element i: 1 + (i + k) % 3 (prod stays small; 3 and 4
      // divide the sum exactly for avg only sometimes, so avg expects the
      // integer quotient for integer dtypes).
      std::vector<void*> device(kSources);
      for (int k = 0; k < kSources; ++k) {
        std::vector<char> host(kCount * e);
        for (size_t i = 0; i < kCount; ++i) StoreAs(dtype, host, i, 1 + (i + k) % 3);
        ASSERT_EQ(cudaMalloc(&device[k], host.size()), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(device[k], host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
      }
      // In place into source 0, as the IPC all-reduce does for its own slice.
      ASSERT_EQ(ReduceAsync(device[0], device.data(), kSources, kCount, dtype, op, nullptr), 0);
      std::vector<char> out(kCount * e);
      ASSERT_EQ(cudaMemcpy(out.data(), device[0], out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      size_t wrong = 0;
      for (size_t i = 0; i < kCount; ++i) {
        double sum = 0, max = 0, min = 1e9, prod = 1;
        for (int k = 0; k < kSources; ++k) {
          const double v = 1 + (i + k) % 3;
          sum += v;
          max = std::max(max, v);
          min = std::min(min, v);
          prod *= v;
        }
        double want = op == 0 ? sum : op == 2 ? max : op == 3 ? min : op == 4 ? prod : sum / kSources;
        if (op == 1 && dtype >= 4) want = std::trunc(want);
        wrong += LoadAs(dtype, out, i) != want;
      }
      EXPECT_EQ(wrong, 0u) << "dtype " << dtype << " op " << op;
      for (void* p : device) cudaFree(p);
    }
  }
  EXPECT_EQ(ReduceAsync(nullptr, nullptr, 0, 1, 0, 0, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(ReduceAsync(nullptr, nullptr, kMaxReduceSources + 1, 1, 0, 0, nullptr),
            cudaErrorInvalidValue);
}

// Integer sums and products wrap, as the host kernels promise
// (transport/reduce/reduce.h): i32, i64 and u8, sum, avg and prod, past
// the type's range. Signed overflow was left to the compiler.
TEST(ReduceKernels, IntegerSumAndProductWrapAsOnTheHost) {
  struct Case {
    int dtype, op;
    int64_t a, b, want;
  };
  const int64_t i32_max = INT32_MAX, i64_max = INT64_MAX;
  const Case cases[] = {
      {4, 0, i32_max, 1, INT32_MIN},
      {4, 1, i32_max, 3, static_cast<int32_t>(0x80000002u) / 2},
      {4, 4, 65536, 65536, 0},
      {5, 0, i64_max, 1, INT64_MIN},
      {5, 4, int64_t{1} << 62, 4, 0},
      {6, 0, 200, 100, 44},
      {6, 4, 16, 17, 16},
  };
  const size_t sizes[] = {4, 8, 2, 2, 4, 8, 1};
  for (const Case& c : cases) {
    const size_t e = sizes[c.dtype];
    void* device[2] = {nullptr, nullptr};
    int64_t values[2] = {c.a, c.b};
    for (int k = 0; k < 2; ++k) {
      char host[8] = {};
      std::memcpy(host, &values[k], e);  // little-endian: the low bytes
      ASSERT_EQ(cudaMalloc(&device[k], e), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(device[k], host, e, cudaMemcpyHostToDevice), cudaSuccess);
    }
    ASSERT_EQ(ReduceAsync(device[0], device, 2, 1, c.dtype, c.op, nullptr), 0);
    char out[8] = {};
    ASSERT_EQ(cudaMemcpy(out, device[0], e, cudaMemcpyDeviceToHost), cudaSuccess);
    char want[8] = {};
    std::memcpy(want, &c.want, e);
    EXPECT_EQ(std::memcmp(out, want, e), 0) << "dtype " << c.dtype << " op " << c.op << " of " << c.a
                                            << " and " << c.b;
    for (void* p : device) cudaFree(p);
  }
}

// Max and min give NaN wherever any source holds one, whichever source it
// is (the host kernels' rule): element k has its NaN in source k.
TEST(ReduceKernels, MaxAndMinPropagateANanFromAnySource) {
  constexpr int kSources = 3;
  constexpr size_t kCount = kSources + 1;  // the last element has no NaN
  const size_t sizes[] = {4, 8, 2, 2};
  for (int dtype = 0; dtype < 4; ++dtype) {
    for (int op : {2, 3}) {
      const size_t e = sizes[dtype];
      std::vector<void*> device(kSources);
      for (int k = 0; k < kSources; ++k) {
        std::vector<char> host(kCount * e);
        for (size_t i = 0; i < kCount; ++i) {
          StoreAs(dtype, host, i, i == static_cast<size_t>(k) ? std::nan("") : 1.0 + k);
        }
        ASSERT_EQ(cudaMalloc(&device[k], host.size()), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(device[k], host.data(), host.size(), cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
      ASSERT_EQ(ReduceAsync(device[0], device.data(), kSources, kCount, dtype, op, nullptr), 0);
      std::vector<char> out(kCount * e);
      ASSERT_EQ(cudaMemcpy(out.data(), device[0], out.size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (size_t i = 0; i < kSources; ++i) {
        EXPECT_TRUE(std::isnan(LoadAs(dtype, out, i)))
            << "dtype " << dtype << " op " << op << ": NaN in source " << i << " lost";
      }
      EXPECT_EQ(LoadAs(dtype, out, kSources), op == 2 ? kSources : 1.0)
          << "dtype " << dtype << " op " << op;
      for (void* p : device) cudaFree(p);
    }
  }
}

// +0 and -0 compare equal: max gives +0 and min -0 in either order, as in
// the host kernels (transport/reduce).
TEST(ReduceKernels, MaxAndMinOfSignedZerosDoNotDependOnTheOrder) {
  const float plus_first[] = {0.0f, -0.0f}, minus_first[] = {-0.0f, 0.0f};
  for (const float* pair : {plus_first, minus_first}) {
    for (int op : {2, 3}) {
      std::vector<void*> device(2);
      for (int k = 0; k < 2; ++k) {
        ASSERT_EQ(cudaMalloc(&device[k], 4), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(device[k], &pair[k], 4, cudaMemcpyHostToDevice), cudaSuccess);
      }
      ASSERT_EQ(ReduceAsync(device[0], device.data(), 2, 1, 0, op, nullptr), 0);
      float out = 1.0f;
      ASSERT_EQ(cudaMemcpy(&out, device[0], 4, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(std::signbit(out), op == 3) << "op " << op << (pair == plus_first ? " (+0 first)" : " (-0 first)");
      for (void* p : device) cudaFree(p);
    }
  }
}

// An error pending before the call (left unread by other code) is not
// taken for the launch's, nor cleared: the caller can say the device had
// failed already.
TEST(ReduceKernels, ErrorPendingBeforeTheLaunchIsFlaggedAndLeftPending) {
  float* data = nullptr;
  ASSERT_EQ(cudaMalloc(&data, 4), cudaSuccess);
  // A launch-configuration error: not sticky, pending until read.
  ASSERT_NE(cudaMemcpy(data, data, 4, static_cast<cudaMemcpyKind>(42)), cudaSuccess);
  bool failed_before = false;
  const void* sources[] = {data};
  const int launched = ReduceAsync(data, sources, 1, 1, 0, 0, nullptr, &failed_before);
  if (cudaPeekAtLastError() == cudaSuccess) {
    // This runtime does not leave such errors pending: nothing to tell apart.
    EXPECT_EQ(launched, 0);
    EXPECT_FALSE(failed_before);
  } else {
    EXPECT_NE(launched, 0);
    EXPECT_TRUE(failed_before);
    EXPECT_NE(cudaGetLastError(), cudaSuccess);  // still pending, now read
  }
  EXPECT_EQ(ReduceAsync(data, sources, 1, 1, 0, 0, nullptr, &failed_before), 0);
  EXPECT_FALSE(failed_before);
  cudaFree(data);
}

}  // namespace
}  // namespace ddp::transport::cuda
