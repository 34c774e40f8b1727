// --device checks, which need no GPU: "cpu" always, "cuda" only in a CUDA
// build (otherwise one line naming --config=cuda), anything else named.

#include "examples/trainer/device.h"

#include <gtest/gtest.h>

#include <string>

#include "examples/trainer/config.h"

namespace ddp::examples::trainer {
namespace {

std::string ErrorOf(const std::string& device) {
  try {
    CheckDeviceFlag(device);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(DeviceTest, CpuIsAlwaysAccepted) {
  EXPECT_EQ(ErrorOf("cpu"), "");
  EXPECT_EQ(WorkerDevice("cpu", 3), nn::kCPU);
}

TEST(DeviceTest, UnknownDeviceIsNamed) {
  EXPECT_EQ(ErrorOf("tpu"), "unknown --device=tpu; use cpu or cuda");
}

TEST(DeviceTest, CudaNeedsACudaBuild) {
  const std::string error = ErrorOf("cuda");
  if (CudaBuilt()) {
    EXPECT_EQ(error, "");
  } else {
    EXPECT_EQ(error,
              "--device=cuda: this trainer was built without CUDA; rebuild it with "
              "`bazel build --config=cuda //examples:train`");
    EXPECT_EQ(error.find('\n'), std::string::npos);
    EXPECT_THROW(WorkerDevice("cuda", 0), UsageError);
  }
}

}  // namespace
}  // namespace ddp::examples::trainer
