// The replica description DDP compares across ranks at construction: a
// tensor's GPU index is not part of it (one process per GPU puts rank r's
// replica on cuda:r), its device type is; BroadcastCoalesced's groups come
// in the order of their first tensor, not of the device index.

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

// BroadcastCoalesced's groups are paired across ranks by position. Ordered
// by device index, a model whose first part is on cuda:1 and second on
// cuda:0 on one rank (cuda:0 then cuda:1 on another, which VerifyReplicas
// accepts) sent its first part's values into the other rank's second part.
// In the order of first appearance, both ranks list the first part first.
TEST(GroupByDtypeAndDeviceTest, GroupsComeInTheOrderOfTheirFirstTensor) {
  float storage[4] = {};
  const nn::Device gpu0(nn::DeviceType::kCUDA, 0), gpu1(nn::DeviceType::kCUDA, 1);
  const nn::Tensor empty = nn::Tensor::FromBlob(storage, {0}, nn::DType::kFloat32, gpu0);
  const nn::Tensor half = nn::Tensor::FromBlob(storage, {2, 2}, nn::DType::kBFloat16, gpu1);
  // Rank A: first part on cuda:1, second on cuda:0; rank B the other way.
  const std::vector<std::vector<size_t>> a =
      GroupByDtypeAndDevice({On(storage, gpu1), empty, On(storage, gpu0), half, On(storage, gpu1)});
  const std::vector<std::vector<size_t>> b =
      GroupByDtypeAndDevice({On(storage, gpu0), empty, On(storage, gpu1), half, On(storage, gpu0)});
  // The empty tensor is in no group; bf16 on cuda:1 is a group of its own.
  const std::vector<std::vector<size_t>> expected = {{0, 4}, {2}, {3}};
  EXPECT_EQ(a, expected);
  EXPECT_EQ(b, expected);
  // A CPU tensor after the GPU ones comes after them.
  EXPECT_EQ(GroupByDtypeAndDevice({On(storage, gpu0), On(storage, nn::kCPU)}),
            (std::vector<std::vector<size_t>>{{0}, {1}}));
}

}  // namespace
}  // namespace ddp::dist::internal
