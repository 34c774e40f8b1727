// The trainer with --device=cuda (tag "gpu", --config=cuda; written without
// a GPU, so its first run is on the GPU machine): two ranks sharing one GPU
// train a few steps and print their RESULT line; the checkpoint they wrote
// from the GPU loads on the CPU, a CPU run resumes from it and a GPU run
// from the CPU's; --amp=bf16
// and --amp=fp16 on CUDA (autocast over f32 master weights, fp16 with the
// loss scaler) train too.

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"
#include "nn/io/checkpoint.h"

namespace ddp::examples {
namespace {

using testing::Lines;
using testing::RunOutput;
using testing::RunToEnd;
using testing::Runfile;

// No learning-rate schedule: each resume below runs longer (--max_steps)
// than the checkpoint's run, whose schedule it could not continue.
std::vector<std::string> Args(const std::string& dir, std::vector<std::string> extra) {
  std::vector<std::string> args = {Runfile("examples/train"), "--dataset=synthetic", "--model=cnn",
                                   "--train_samples=256",      "--test_samples=64",
                                   "--batch_size=16",          "--epochs=2",
                                   "--workers=1",              "--nproc_per_node=2",
                                   "--scheduler=none",
                                   "--checkpoint=" + dir + "/ckpt.safetensors"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void ExpectResult(const RunOutput& r) {
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> lines = Lines(r.out);
  ASSERT_FALSE(lines.empty()) << r.err;
  EXPECT_EQ(lines.back().rfind("RESULT model=cnn ranks=2 ", 0), 0u) << r.out;
  EXPECT_EQ(lines.back().find("nan"), std::string::npos) << lines.back();
}

TEST(TrainGpuTest, TwoRanksShareOneGpuAndCheckpointsMoveBetweenGpuAndCpu) {
  const std::string dir = TempDir("gpu_train");
  ExpectResult(RunToEnd(Args(dir, {"--device=cuda", "--max_steps=6"}), {}, std::chrono::seconds(100)));

  // Saved from the GPU, read on the CPU: every tensor is a finite CPU tensor.
  const nn::io::Checkpoint c = nn::io::LoadCheckpoint(dir + "/ckpt.safetensors");
  EXPECT_EQ(nn::io::MetadataInt(c.metadata, "step", "ckpt"), 6);
  ASSERT_FALSE(c.model.empty());
  for (const auto& [name, t] : c.model) {
    EXPECT_TRUE(t.device().is_cpu()) << name;
    for (double v : t.ToVector<double>()) ASSERT_TRUE(std::isfinite(v)) << name;
  }

  // A CPU run continues from it, and a GPU run from the CPU's checkpoint.
  ExpectResult(RunToEnd(Args(dir, {"--device=cpu", "--resume", "--max_steps=8"}), {},
                        std::chrono::seconds(100)));
  EXPECT_EQ(nn::io::MetadataInt(nn::io::LoadCheckpoint(dir + "/ckpt.safetensors").metadata, "step",
                                "ckpt"),
            8);
  ExpectResult(RunToEnd(Args(dir, {"--device=cuda", "--resume", "--max_steps=10"}), {},
                        std::chrono::seconds(100)));
  EXPECT_EQ(nn::io::MetadataInt(nn::io::LoadCheckpoint(dir + "/ckpt.safetensors").metadata, "step",
                                "ckpt"),
            10);
}

TEST(TrainGpuTest, AutocastOnTheGpu) {
  // bf16: f32's range, no loss scaling; fp16: GradScaler on the device.
  for (const std::string amp : {"bf16", "fp16"}) {
    const std::string dir = TempDir("gpu_amp_" + amp);
    ExpectResult(RunToEnd(Args(dir, {"--device=cuda", "--amp=" + amp, "--max_steps=4"}), {},
                          std::chrono::seconds(100)));
  }
}

}  // namespace
}  // namespace ddp::examples
