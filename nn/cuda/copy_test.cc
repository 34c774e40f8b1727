// Copies between host and device, on the device, and stream order (tag "gpu").
#include "nn/cuda/copy.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "nn/cuda/cuda.h"
#include "nn/cuda/stream.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {
namespace {

const Device kGpu(DeviceType::kCUDA, 0);

class CudaCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Init();
    ManualSeed(7);
  }
};

// Byte-exact equality of two CPU tensors of one shape and dtype.
void ExpectSameBytes(const Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.shape(), b.shape());
  ASSERT_EQ(a.dtype(), b.dtype());
  const Tensor ac = a.Contiguous(), bc = b.Contiguous();
  EXPECT_EQ(std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()), 0);
}

TEST_F(CudaCopyTest, RoundTripIsExactForEveryDtypeAndSize) {
  // 0, 1, odd, and more than two pinned staging chunks (4 MiB each).
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{5} * 1024 * 1024 / 2 + 3}) {
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt64,
                     DType::kUInt8, DType::kInt32}) {
      Tensor values = Empty({n});
      UniformFill(values, 0.0, 100.0);  // non-negative: u8 conversion is defined
      const Tensor host = values.To(dt);
      const Tensor dev = host.To(kGpu);
      EXPECT_EQ(dev.device(), kGpu);
      ExpectSameBytes(dev.To(kCPU), host);
    }
  }
}

TEST_F(CudaCopyTest, NonContiguousSourcesAndDestinations) {
  const Tensor host = Randn({37, 53});
  const Tensor dev = host.To(kGpu);
  // Transposed view copied on the device.
  ExpectSameBytes(dev.Transpose(0, 1).Contiguous().To(kCPU), host.Transpose(0, 1).Contiguous());
  // Strided slice, device to host.
  ExpectSameBytes(dev.Slice(1, 3, 50, 4).To(kCPU), host.Slice(1, 3, 50, 4).Contiguous());
  // Host into a non-contiguous device destination.
  Tensor dst = Zeros({53, 37}, {.device = kGpu});
  dst.Transpose(0, 1).CopyFrom(host);
  ExpectSameBytes(dst.To(kCPU), host.Transpose(0, 1).Contiguous());
}

TEST_F(CudaCopyTest, DtypeConversionsOnTheDeviceMatchTheCpu) {
  Tensor host = Empty({4099});
  NormalFill(host, 0.0, 300.0);
  const Tensor dev = host.To(kGpu);
  for (DType dt : {DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt64, DType::kInt32}) {
    // Both sides round to nearest even (16-bit floats) or truncate (integers).
    ExpectSameBytes(dev.To(dt).To(kCPU), host.To(dt));
  }
  const Tensor half = host.To(DType::kFloat16);
  ExpectSameBytes(half.To(kGpu).To(DType::kBFloat16).To(kCPU), half.To(DType::kBFloat16));
  // f64 rounds to 16 bits in one step on both sides: a hair above a midpoint
  // goes up, a hair under 65520 stays finite (through f32: down, and inf).
  const Tensor wide = FromVector({1.0 + 0x1p-11 + 0x1p-30, 1.0 + 0x1p-8 + 0x1p-40, 65520.0 - 0x1p-20}, {3},
                                 {.dtype = DType::kFloat64});
  for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dt));
    ExpectSameBytes(wide.To(kGpu).To(dt).To(kCPU), wide.To(dt));
  }
}

TEST_F(CudaCopyTest, FillAndBroadcastCopy) {
  const Tensor t = Full({3, 5}, 2.5, {.device = kGpu});
  EXPECT_EQ(t.To(kCPU).ToVector<float>(), std::vector<float>(15, 2.5f));
  Tensor row = FromVector({1, 2, 3, 4, 5}, {5}).To(kGpu);
  Tensor dst = Empty({3, 5}, {.device = kGpu});
  dst.CopyFrom(row);  // broadcast on the device: row has stride 0 over dim 0
  ExpectSameBytes(dst.To(kCPU), FromVector({1, 2, 3, 4, 5}, {5}).Expand({3, 5}).Contiguous());
}

TEST_F(CudaCopyTest, FillZerosAndFullMatchTheCpuForEveryDtype) {
  // Zero and values whose bytes are all equal (-1 in the integers, every
  // u8) take the memset, the others the fill kernel; strided views always
  // take the kernel. Negative values and values past 255 are left out for
  // u8, whose conversion from them is undefined.
  const std::vector<double> any_dtype = {0.0, 1.0, 2.5, 3.7, 255.0};
  const std::vector<double> signed_only = {-1.0, -0.0, -2.5, 1.0 / 3, 1e-3, 65504.0, 1e30};
  for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt64,
                   DType::kUInt8, DType::kInt32}) {
    std::vector<double> values = any_dtype;
    if (dt != DType::kUInt8) values.insert(values.end(), signed_only.begin(), signed_only.end());
    if (dt == DType::kInt64 || dt == DType::kInt32) values.pop_back();  // 1e30 overflows integers
    SCOPED_TRACE(DTypeName(dt));
    for (const Shape& shape : std::vector<Shape>{{0}, {1}, {1001}, {37, 53}}) {
      ExpectSameBytes(Zeros(shape, {.dtype = dt, .device = kGpu}).To(kCPU), Zeros(shape, {.dtype = dt}));
      for (double v : values) {
        SCOPED_TRACE(v);
        ExpectSameBytes(Full(shape, v, {.dtype = dt, .device = kGpu}).To(kCPU), Full(shape, v, {.dtype = dt}));
      }
    }
    for (double v : values) {
      SCOPED_TRACE(v);
      // Every third column of rows 1..4 of a [6, 10] tensor, the rest kept.
      const Tensor host = Full({6, 10}, 7.0, {.dtype = dt});
      const Tensor dev = host.To(kGpu);
      host.Slice(0, 1, 5, 1).Slice(1, 1, 9, 3).Fill(v);
      dev.Slice(0, 1, 5, 1).Slice(1, 1, 9, 3).Fill(v);
      ExpectSameBytes(dev.To(kCPU), host);
      // Transposed: the whole storage, not contiguous as a view.
      const Tensor t = Empty({5, 3}, {.dtype = dt, .device = kGpu});
      t.Transpose(0, 1).Fill(v);
      ExpectSameBytes(t.To(kCPU), Full({5, 3}, v, {.dtype = dt}));
    }
    // Zero() on a contiguous device tensor.
    const Tensor z = Full({17}, 3.0, {.dtype = dt, .device = kGpu});
    z.Zero();
    ExpectSameBytes(z.To(kCPU), Zeros({17}, {.dtype = dt}));
  }
}

TEST_F(CudaCopyTest, WorkOnACurrentSideStreamStaysInOrder) {
  Stream side(kGpu);
  const Tensor host = Randn({3, 1 << 20});  // 12 MiB: three staging chunks
  Tensor back;
  {
    StreamGuard guard(kGpu, side.get());
    const Tensor dev = host.To(kGpu);
    const Tensor moved = dev.Transpose(0, 1).Contiguous();  // a kernel on the side stream
    back = moved.To(kCPU);                                    // waits for the side stream only
  }
  ExpectSameBytes(back, host.Transpose(0, 1).Contiguous());
}

TEST_F(CudaCopyTest, ItemAndSynchronize) {
  const Tensor t = FromVector({42.0}, {}).To(kGpu);
  Synchronize(kGpu);
  EXPECT_EQ(t.Item(), 42.0);
}

}  // namespace
}  // namespace ddp::nn::cuda
