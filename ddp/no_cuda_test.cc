// A build without --config=cuda: a CUDA tensor reaching a collective is
// refused at the call, with one line naming the tensor, its device and the
// flag to build with; nothing is queued.

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "ddp/process_group.h"

namespace ddp::dist {
namespace {

// A tensor that claims to live on cuda:0. Its memory is host memory that is
// never read: the call must refuse it first.
nn::Tensor FakeCudaTensor(float* storage) {
  return nn::Tensor::FromBlob(storage, {4}, nn::DType::kFloat32, nn::Device(nn::DeviceType::kCUDA, 0));
}

TEST(NoCudaTest, CollectiveOnACudaTensorNamesTheBuildFlag) {
  auto pg = ProcessGroup::Single();
  float storage[4] = {1, 2, 3, 4};
  const nn::Tensor t = FakeCudaTensor(storage);
  for (const std::string call : {"AllReduce", "Broadcast"}) {
    try {
      if (call == "AllReduce") pg->AllReduce(t);
      if (call == "Broadcast") pg->Broadcast(t, 0);
      FAIL() << call << " accepted a CUDA tensor";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("ProcessGroup::" + call + ": tensor is on cuda:0"), std::string::npos) << what;
      EXPECT_NE(what.find("--config=cuda"), std::string::npos) << what;
    }
  }
  EXPECT_EQ(pg->collectives_run(), 0u);
  EXPECT_EQ(storage[0], 1.0f);
}

TEST(NoCudaTest, AllGatherWithOneCudaSideIsRefused) {
  auto pg = ProcessGroup::Single();
  float storage[4] = {0, 0, 0, 0};
  const nn::Tensor out = FakeCudaTensor(storage);
  try {
    pg->AllGather(out, nn::Zeros({4}));
    FAIL() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("output is on cuda:0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--config=cuda"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ddp::dist
