// The replica description DDP compares across ranks at construction: a
// tensor's GPU index is not part of it (one process per GPU puts rank r's
// replica on cuda:r), its GPU's order of first appearance is;
// BroadcastCoalesced's groups come in the order of their first tensor, not
// of the device index.

#include "ddp/replicas.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ddp::dist::internal {
namespace {

// Metadata only: DescribeTensor never reads the memory behind it.
nn::Tensor On(float* storage, nn::Device device) {
  return nn::Tensor::FromBlob(storage, {2, 2}, nn::DType::kFloat32, device);
}

// Descriptions of one rank's parameters, as DDP makes them.
std::vector<std::string> Describe(const std::vector<nn::Tensor>& params) {
  GpuOrder gpus;
  std::vector<std::string> out;
  for (const nn::Tensor& p : params) out.push_back(DescribeTensor(p, true, gpus));
  return out;
}

TEST(DescribeTensorTest, GpuIndexIsNotPartOfTheDescription) {
  float storage[4] = {};
  const std::vector<std::string> gpu0 = Describe({On(storage, nn::Device(nn::DeviceType::kCUDA, 0))});
  const std::vector<std::string> gpu1 = Describe({On(storage, nn::Device(nn::DeviceType::kCUDA, 1))});
  const std::vector<std::string> cpu = Describe({On(storage, nn::kCPU)});
  EXPECT_EQ(gpu0, gpu1);
  EXPECT_EQ(gpu0.at(0), "f32 [2, 2] strides [2, 1] on cuda#0 no-grad");
  EXPECT_EQ(cpu.at(0), "f32 [2, 2] strides [2, 1] no-grad");
}

// Rank 0 has every parameter on cuda:0; rank 1 has its first layer on
// cuda:0 and the rest on cuda:1. BroadcastCoalesced and the Reducer form
// one group per GPU and pair the groups by position, so these ranks would
// pair broadcasts of different sizes: their descriptions must differ, from
// the first parameter on the second GPU on. Before, both were "on cuda" and
// VerifyReplicas let them through. The same split over other GPUs (cuda:3,
// then cuda:0) is the same model.
TEST(DescribeTensorTest, GpusAreNumberedInTheOrderTheyFirstAppear) {
  float storage[4] = {};
  const nn::Device gpu0(nn::DeviceType::kCUDA, 0), gpu1(nn::DeviceType::kCUDA, 1), gpu3(nn::DeviceType::kCUDA, 3);
  const std::vector<nn::Tensor> all_on_0 = {On(storage, gpu0), On(storage, gpu0), On(storage, gpu0)};
  const std::vector<nn::Tensor> split = {On(storage, gpu0), On(storage, gpu1), On(storage, gpu1)};
  ASSERT_NE(GroupByDtypeAndDevice(all_on_0), GroupByDtypeAndDevice(split));
  const std::vector<std::string> rank0 = Describe(all_on_0), rank1 = Describe(split);
  EXPECT_EQ(rank0[0], rank1[0]);
  EXPECT_EQ(rank0[1], "f32 [2, 2] strides [2, 1] on cuda#0 no-grad");
  EXPECT_EQ(rank1[1], "f32 [2, 2] strides [2, 1] on cuda#1 no-grad");
  EXPECT_EQ(rank1[2], rank1[1]);
  EXPECT_EQ(Describe({On(storage, gpu3), On(storage, gpu0), On(storage, gpu0)}), rank1);
  // A CPU tensor between them takes no number.
  EXPECT_EQ(Describe({On(storage, gpu3), On(storage, nn::kCPU), On(storage, gpu0)})[2], rank1[1]);
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
