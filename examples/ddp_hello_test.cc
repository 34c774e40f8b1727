// //examples:ddp_hello, run as a user runs it: 2 ranks, one epoch of the
// real Fashion-MNIST, a checkpoint. It must learn (test accuracy well above
// chance), count the whole test set once, and leave a checkpoint that loads
// with the MLP's parameters; a checkpoint path that cannot be written is
// refused before training, and the ranks say which path.

#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"
#include "nn/data/idx.h"
#include "nn/io/checkpoint.h"
#include "nn/modules/models.h"

namespace ddp::examples {
namespace {

using testing::RunOutput;
using testing::RunToEnd;
using testing::Runfile;

// --help started both ranks, each printing "SetUsageMessage() never called"
// and the flags of every linked library.
TEST(DdpHelloTest, HelpListsItsOwnFlagsOnce) {
  const RunOutput r = RunToEnd({Runfile("examples/ddp_hello"), "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("--nproc_per_node"), std::string::npos) << all;
  EXPECT_NE(all.find("-checkpoint"), std::string::npos) << all;
  EXPECT_EQ(all.find("-epochs"), all.rfind("-epochs")) << "listed more than once:\n" << all;
  EXPECT_EQ(all.find("SetUsageMessage"), std::string::npos) << all;
  EXPECT_EQ(all.find("tab_completion"), std::string::npos) << all;
}

TEST(DdpHelloTest, TrainsEvaluatesAndCheckpoints) {
  const std::string path = testing::MakeTempDir("hello") + "/hello.safetensors";
  const RunOutput r = RunToEnd({Runfile("examples/ddp_hello"), "--checkpoint=" + path});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  double loss = 0, accuracy = 0, images = 0;
  int ranks = 0;
  ASSERT_EQ(std::sscanf(r.out.c_str(), "[0] epoch 1: train loss %lf\n[0] test accuracy %lf%% (%d ranks, %lf images)",
                        &loss, &accuracy, &ranks, &images), 4)
      << r.out;
  EXPECT_LT(loss, 0.7) << r.out;       // ln(10) = 2.30 at chance
  EXPECT_GT(accuracy, 80.0) << r.out;  // one epoch of the MLP: about 85%
  EXPECT_EQ(ranks, 2);
  EXPECT_EQ(images, 10000);
  EXPECT_NE(r.out.find("[0] checkpoint " + path), std::string::npos) << r.out;

  const nn::io::Checkpoint checkpoint = nn::io::LoadCheckpoint(path);
  auto model = nn::modules::MakeMlp();
  model->LoadStateDict(checkpoint.model);  // throws on a missing or misshapen tensor
}

// A --checkpoint that rank 0 cannot write is refused before training,
// naming the flag and the path (before, the run trained to the end and
// then failed in SaveCheckpoint).
TEST(DdpHelloTest, ACheckpointPathThatCannotBeWrittenIsRefusedBeforeTraining) {
  const std::string dir = testing::MakeTempDir("hello_missing");
  {
    std::FILE* f = std::fopen((dir + "/file").c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
  }
  const std::vector<std::pair<std::string, std::string>> cases = {
      {dir + "/no/such/folder/h.safetensors",
       "--checkpoint=" + dir + "/no/such/folder/h.safetensors: the folder " + dir +
           "/no/such/folder does not exist"},
      {dir + "/file/h.safetensors",
       "--checkpoint=" + dir + "/file/h.safetensors: " + dir + "/file is not a folder"},
      {dir, "--checkpoint=" + dir + " is a folder; give the path of a file"},
  };
  for (const auto& [path, message] : cases) {
    const RunOutput r = RunToEnd({Runfile("examples/ddp_hello"), "--checkpoint=" + path});
    EXPECT_EQ(r.exit_code, 2) << path << "\n" << r.out << r.err;
    // Every rank refuses; the launcher may stop one before it prints.
    EXPECT_NE(r.err.find("] ddp_hello: " + message + "\n"), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("epoch 1"), std::string::npos) << "trained first: " << r.out;
    EXPECT_EQ(r.out.find("[0] checkpoint"), std::string::npos) << r.out;
  }
}

// Relative --data_dir and --checkpoint are the user's (under `bazel run`,
// from $BUILD_WORKING_DIRECTORY), not the runfiles folder's the binary
// starts in.
TEST(DdpHelloTest, RelativePathsAreFromTheUsersDirectory) {
  const std::string dir = testing::MakeTempDir("hello_relative");
  std::filesystem::create_directory_symlink(nn::data::kFashionMnistDebianDir, dir + "/fmnist");
  const RunOutput r = RunToEnd({Runfile("examples/ddp_hello"), "--epochs=0", "--data_dir=fmnist",
                                "--checkpoint=out/../hello.safetensors"},
                               {{"BUILD_WORKING_DIRECTORY", dir}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[0] checkpoint " + dir + "/hello.safetensors\n"), std::string::npos) << r.out;
  auto model = nn::modules::MakeMlp();
  model->LoadStateDict(nn::io::LoadCheckpoint(dir + "/hello.safetensors").model);
}

// Flags out of range are refused by name before the process group is made
// and before any data is read (exit 2, nothing trained). Before,
// --batch_size=0 failed inside the DataLoader after the ranks had connected,
// --lr=-1 got the optimizer's message and --lr=inf trained to NaN.
TEST(DdpHelloTest, BadFlagsAreRefusedBeforeAnythingStarts) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--batch_size=0", "--batch_size=0 must be at least 1"},
      {"--batch_size=-3", "--batch_size=-3 must be at least 1"},
      {"--lr=-1", "--lr=-1 must be a finite number > 0"},
      {"--lr=0", "--lr=0 must be a finite number > 0"},
      {"--lr=inf", "--lr=inf must be a finite number > 0"},
      {"--lr=nan", "--lr=nan must be a finite number > 0"},
      {"--epochs=-1", "--epochs=-1 must be at least 0"},
  };
  for (const auto& [flag, message] : cases) {
    const RunOutput r = RunToEnd({Runfile("examples/ddp_hello"), flag});
    EXPECT_EQ(r.exit_code, 2) << flag << "\n" << r.out << r.err;
    // Every rank checks; the launcher may stop one before it prints.
    EXPECT_NE(r.err.find("] ddp_hello: " + message + "\n"), std::string::npos) << flag << "\n" << r.err;
    EXPECT_EQ(r.out, "") << flag;
  }
}

}  // namespace
}  // namespace ddp::examples
