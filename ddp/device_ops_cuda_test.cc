// The CUDA build of //ddp on any machine (tag "cuda"; no GPU needed): a
// tensor on a CUDA device this process cannot use is refused at the call,
// naming the tensor and the device, before anything is queued.

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "ddp/process_group.h"

namespace ddp::dist {
namespace {

TEST(DeviceOpsCudaTest, UnusableDeviceIsNamedAtTheCall) {
  auto pg = ProcessGroup::Single();
  float storage[4] = {1, 2, 3, 4};
  // No machine has 64 GPUs: refused here and on a GPU machine alike. The
  // host memory behind it is never read.
  const nn::Tensor t =
      nn::Tensor::FromBlob(storage, {4}, nn::DType::kFloat32, nn::Device(nn::DeviceType::kCUDA, 63));
  try {
    pg->AllReduce(t);
    FAIL() << "accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("ProcessGroup::AllReduce: tensor is on cuda:63, which cannot be used: ", 0), 0u)
        << what;
  }
  EXPECT_EQ(pg->collectives_run(), 0u);
  EXPECT_EQ(storage[0], 1.0f);
}

}  // namespace
}  // namespace ddp::dist
