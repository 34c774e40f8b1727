// The replica description DDP compares across ranks at construction: a
// tensor's GPU index is not part of it (one process per GPU puts rank r's
// replica on cuda:r), its device type is.

#include "ddp/replicas.h"

#include <gtest/gtest.h>

namespace ddp::dist::internal {
namespace {

// Metadata only: DescribeTensor never reads the memory behind it.
nn::Tensor On(float* storage, nn::Device device) {
  return nn::Tensor::FromBlob(storage, {2, 2}, nn::DType::kFloat32, device);
}

TEST(DescribeTensorTest, GpuIndexIsNotPartOfTheDescription) {
  float storage[4] = {};
  const std::string gpu0 = DescribeTensor(On(storage, nn::Device(nn::DeviceType::kCUDA, 0)), true);
  const std::string gpu1 = DescribeTensor(On(storage, nn::Device(nn::DeviceType::kCUDA, 1)), true);
  const std::string cpu = DescribeTensor(On(storage, nn::kCPU), true);
  EXPECT_EQ(gpu0, gpu1);
  EXPECT_EQ(gpu0, "f32 [2, 2] strides [2, 1] on cuda no-grad");
  EXPECT_EQ(cpu, "f32 [2, 2] strides [2, 1] no-grad");
}

}  // namespace
}  // namespace ddp::dist::internal
