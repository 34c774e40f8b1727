// Logic of the CUDA backend that needs no GPU: size classes, index
// geometry, error text, registration. Runs under --config=cuda on any
// machine (no "gpu" tag).
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nn/cuda/allocator.h"
#include "nn/cuda/cuda.h"
#include "nn/cuda/cuda_error.h"
#include "nn/cuda/indexing.h"
#include "nn/cuda/stream.h"
#include "nn/ops/dispatch.h"
#include "nn/tensor/generator.h"

namespace ddp::nn::cuda {
namespace {

TEST(CudaAllocatorSizes, SmallRequestsRoundTo512Bytes) {
  EXPECT_EQ(CachingCudaAllocator::RoundSize(0), 512u);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(1), 512u);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(512), 512u);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(513), 1024u);
  EXPECT_EQ(CachingCudaAllocator::RoundSize((1u << 20) - 1), size_t{1} << 20);
}

TEST(CudaAllocatorSizes, LargeRequestsUseEightClassesPerPowerOfTwo) {
  const size_t mib = size_t{1} << 20;
  EXPECT_EQ(CachingCudaAllocator::RoundSize(mib), mib);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(mib + 1), mib + mib / 8);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(3 * mib), 3 * mib);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(3 * mib + 1), 3 * mib + 2 * mib / 8);
  for (size_t n = mib; n < 64 * mib; n = n * 9 / 7 + 12345) {
    const size_t r = CachingCudaAllocator::RoundSize(n);
    EXPECT_GE(r, n);
    EXPECT_LE(static_cast<double>(r), static_cast<double>(n) * 1.125 + 1) << n;
  }
}

TEST(CudaIndexing, ContiguousOperandsCollapseToOneDimension) {
  const Shape shape = {4, 5, 6};
  const Shape st = ContiguousStrides(shape);
  const launch::Indexing ix = MakeIndexing("test", shape, {st, st});
  EXPECT_TRUE(ix.contiguous);
  EXPECT_EQ(ix.ndim, 1);
  EXPECT_EQ(ix.sizes[0], 120);
}

TEST(CudaIndexing, TransposedOperandKeepsTwoDimensions) {
  // out [3, 4] contiguous, x = a transposed [4, 3] buffer: strides (1, 3).
  const launch::Indexing ix = MakeIndexing("test", {3, 4}, {Shape{4, 1}, Shape{1, 3}});
  EXPECT_FALSE(ix.contiguous);
  ASSERT_EQ(ix.ndim, 2);
  EXPECT_EQ(ix.sizes[0], 3);
  EXPECT_EQ(ix.sizes[1], 4);
  EXPECT_EQ(ix.strides[0][0], 4);
  EXPECT_EQ(ix.strides[1][0], 1);
  EXPECT_EQ(ix.strides[1][1], 3);
}

TEST(CudaIndexing, SizeOneDimensionsAreDroppedAndBroadcastKeepsStrideZero) {
  const Shape shape = {1, 2, 1, 3};
  const launch::Indexing ix = MakeIndexing("test", shape, {ContiguousStrides(shape), Shape{0, 0, 0, 1}});
  ASSERT_EQ(ix.ndim, 2);
  EXPECT_EQ(ix.sizes[0], 2);
  EXPECT_EQ(ix.sizes[1], 3);
  EXPECT_EQ(ix.strides[1][0], 0);
  EXPECT_EQ(ix.strides[1][1], 1);
}

// Row-major offset of element `linear` of `shape` in a tensor with `strides`.
int64_t DirectOffset(const Shape& shape, const Shape& strides, int64_t linear) {
  int64_t off = 0;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    off += (linear % shape[d]) * strides[d];
    linear /= shape[d];
  }
  return off;
}

// The kernels' index math (merged dimensions, fast contiguous path) gives
// every operand's offsets exactly as direct strided indexing does, for
// random shapes, permutations, slices and broadcasts.
TEST(CudaIndexing, MergedGeometryAddressesEveryElementLikeDirectIndexing) {
  Generator gen(3);
  for (int trial = 0; trial < 300; ++trial) {
    const int rank = 1 + static_cast<int>(gen.NextU64() % 5);
    Shape shape(rank);
    for (int d = 0; d < rank; ++d) shape[d] = 1 + static_cast<int64_t>(gen.NextU64() % 4);
    // Operand 0: contiguous; 1: a permuted contiguous buffer; 2: broadcast
    // (stride 0 in random dimensions) over a sliced (step 2) buffer.
    const Shape s0 = ContiguousStrides(shape);
    std::vector<int> perm(rank);
    for (int d = 0; d < rank; ++d) perm[d] = d;
    for (int d = rank - 1; d > 0; --d) std::swap(perm[d], perm[gen.NextU64() % (d + 1)]);
    Shape permuted(rank);
    for (int d = 0; d < rank; ++d) permuted[d] = shape[perm[d]];
    const Shape pst = ContiguousStrides(permuted);
    Shape s1(rank), s2(rank);
    for (int d = 0; d < rank; ++d) s1[perm[d]] = pst[d];
    int64_t stride = 2;
    for (int d = rank - 1; d >= 0; --d) {
      s2[d] = (gen.NextU64() % 3 == 0) ? 0 : stride;
      stride *= shape[d] * 2;
    }
    const launch::Indexing ix = MakeIndexing("test", shape, {s0, s1, s2});
    const int64_t n = NumElements(shape);
    for (int64_t i = 0; i < n; ++i) {
      int64_t off[3];
      launch::OffsetsOf<3>(ix, i, off);
      ASSERT_EQ(off[0], DirectOffset(shape, s0, i)) << "trial " << trial << " element " << i;
      ASSERT_EQ(off[1], DirectOffset(shape, s1, i)) << "trial " << trial << " element " << i;
      ASSERT_EQ(off[2], DirectOffset(shape, s2, i)) << "trial " << trial << " element " << i;
    }
  }
}

TEST(CudaIndexing, TooManyDimensionsNameTheOp) {
  // Alternating strides that cannot merge: 9 dimensions.
  Shape shape(9, 2), a(9), b(9);
  for (int d = 8, s = 1; d >= 0; --d, s *= 2) {
    a[d] = s;
    b[d] = (d % 2 == 0) ? s * 3 : s;
  }
  try {
    (void)MakeIndexing("binary", shape, {a, b});
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("binary on CUDA"), std::string::npos) << e.what();
  }
}

TEST(CudaIndexing, BroadcastStridesRejectIncompatibleShapes) {
  EXPECT_THROW(BroadcastStridesTo(Tensor::FromBlob(nullptr, {3}, DType::kFloat32), {4}), std::invalid_argument);
}

TEST(CudaErrors, MessageNamesTheCallAndTheCudaError) {
  try {
    CheckCuda(cudaErrorInvalidValue, "cudaMemcpyAsync(host to device)");
    FAIL() << "expected an error";
  } catch (const CudaError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cudaMemcpyAsync(host to device) failed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cudaErrorInvalidValue"), std::string::npos) << msg;
    EXPECT_EQ(e.code(), static_cast<int>(cudaErrorInvalidValue));
  }
  try {
    CheckCublas(CUBLAS_STATUS_INVALID_VALUE, "cublasGemmEx");
    FAIL() << "expected an error";
  } catch (const CudaError& e) {
    EXPECT_NE(std::string(e.what()).find("CUBLAS_STATUS_INVALID_VALUE"), std::string::npos) << e.what();
  }
}

TEST(CudaStream, TimeoutMustBePositive) {
  EXPECT_THROW(SetWaitTimeout(std::chrono::milliseconds(0)), std::invalid_argument);
}

TEST(CudaInit, RegistersBackendAndKernelsWithoutTouchingTheDevice) {
  EXPECT_FALSE(HasDeviceBackend(DeviceType::kCUDA));
  Init();
  Init();  // idempotent
  EXPECT_TRUE(HasDeviceBackend(DeviceType::kCUDA));
  EXPECT_EQ(GetDeviceBackend(Device(DeviceType::kCUDA, 0)).allocator, &CudaAllocator());
}

TEST(CudaInit, EveryKernelOfTheTableHasACudaPath) {
  Init();
  const ops::KernelTable& t = ops::KernelsFor(DeviceType::kCUDA);
  const std::pair<const char*, const void*> entries[] = {
      {"unary", reinterpret_cast<const void*>(t.unary)},
      {"unary_backward", reinterpret_cast<const void*>(t.unary_backward)},
      {"binary", reinterpret_cast<const void*>(t.binary)},
      {"affine", reinterpret_cast<const void*>(t.affine)},
      {"add_scaled_", reinterpret_cast<const void*>(t.add_scaled_)},
      {"masked_scale", reinterpret_cast<const void*>(t.masked_scale)},
      {"bernoulli_mask", reinterpret_cast<const void*>(t.bernoulli_mask)},
      {"sum_to", reinterpret_cast<const void*>(t.sum_to)},
      {"argmax", reinterpret_cast<const void*>(t.argmax)},
      {"gemm", reinterpret_cast<const void*>(t.gemm)},
      {"conv2d_forward", reinterpret_cast<const void*>(t.conv2d_forward)},
      {"conv2d_backward", reinterpret_cast<const void*>(t.conv2d_backward)},
      {"max_pool2d_forward", reinterpret_cast<const void*>(t.max_pool2d_forward)},
      {"max_pool2d_backward", reinterpret_cast<const void*>(t.max_pool2d_backward)},
      {"avg_pool2d_forward", reinterpret_cast<const void*>(t.avg_pool2d_forward)},
      {"avg_pool2d_backward", reinterpret_cast<const void*>(t.avg_pool2d_backward)},
      {"adaptive_avg_pool2d_forward", reinterpret_cast<const void*>(t.adaptive_avg_pool2d_forward)},
      {"adaptive_avg_pool2d_backward", reinterpret_cast<const void*>(t.adaptive_avg_pool2d_backward)},
      {"batch_norm_forward", reinterpret_cast<const void*>(t.batch_norm_forward)},
      {"batch_norm_backward", reinterpret_cast<const void*>(t.batch_norm_backward)},
      {"batch_norm_stats", reinterpret_cast<const void*>(t.batch_norm_stats)},
      {"batch_norm_elementwise", reinterpret_cast<const void*>(t.batch_norm_elementwise)},
      {"batch_norm_backward_reduce", reinterpret_cast<const void*>(t.batch_norm_backward_reduce)},
      {"batch_norm_backward_elementwise", reinterpret_cast<const void*>(t.batch_norm_backward_elementwise)},
      {"log_softmax_forward", reinterpret_cast<const void*>(t.log_softmax_forward)},
      {"log_softmax_backward", reinterpret_cast<const void*>(t.log_softmax_backward)},
      {"cross_entropy_forward", reinterpret_cast<const void*>(t.cross_entropy_forward)},
      {"cross_entropy_backward", reinterpret_cast<const void*>(t.cross_entropy_backward)},
  };
  // The table has exactly these entries (a new one must be added here and to CudaKernelTable).
  static_assert(sizeof(ops::KernelTable) == 28 * sizeof(void*));
  for (const auto& [name, fn] : entries) EXPECT_NE(fn, nullptr) << name;
}

}  // namespace
}  // namespace ddp::nn::cuda
