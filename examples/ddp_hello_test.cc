// //examples:ddp_hello, run as a user runs it: 2 ranks, one epoch of the
// real Fashion-MNIST, a checkpoint. It must learn (test accuracy well above
// chance), count the whole test set once, and leave a checkpoint that loads
// with the MLP's parameters; a checkpoint path that cannot be written is
// refused before training, and the ranks say which path.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
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
  // The default rate as written, not gflags' "0.050000000000000003".
  EXPECT_NE(all.find("type: double default: 0.05\n"), std::string::npos) << all;
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
// then failed in SaveCheckpoint); once, by the process that would start
// the ranks (rank 0 runs on its host), before any rank starts (every rank
// used to start and refuse it).
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
    EXPECT_EQ(r.err, "ddp_hello: " + message + "\n");
    EXPECT_EQ(r.out, "") << "trained first";
  }
}

// One rank is one rank: the summary said "(1 ranks, 10000 images)".
TEST(DdpHelloTest, OneRankIsCountedInTheSingular) {
  const RunOutput r = RunToEnd({Runfile("examples/ddp_hello"), "--nproc_per_node=1", "--epochs=0"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("% (1 rank, 10000 images)\n"), std::string::npos) << r.out;
}

// A --data_dir without Fashion-MNIST's files is refused in one line, exit
// 2, before any rank starts. Before, both ranks connected, each printed the
// loader's message prefixed with its rank, and the launcher added a third
// line; the run ended with exit status 1.
TEST(DdpHelloTest, AFolderWithoutTheDataIsRefusedOnceBeforeAnyRankStarts) {
  const std::string dir = testing::MakeTempDir("hello_no_data") + "/empty";
  std::filesystem::create_directory(dir);
  const RunOutput r = RunToEnd({Runfile("examples/ddp_hello"), "--data_dir=" + dir});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_EQ(r.err.rfind("ddp_hello: dataset file not found: looked for " + dir +
                            "/train-images-idx3-ubyte.gz and " + dir + "/train-images-idx3-ubyte. ",
                        0),
            0u)
      << r.err;
  EXPECT_NE(r.err.find("--data_dir"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "more than one line:\n" << r.err;
  EXPECT_EQ(r.out, "") << "a rank started";
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

// Flags out of range and stray arguments are refused by name before the
// process group is made and before any data is read (exit 2, nothing
// trained). Before, --batch_size=0 failed inside the DataLoader after the
// ranks had connected, --lr=-1 got the optimizer's message, --lr=inf
// trained to NaN and a stray argument was ignored. The process that would
// start the ranks refuses them, once, before any rank starts (every rank
// used to start and refuse them); one rank of a job that another launcher
// started (launch variables set) refuses them itself.
TEST(DdpHelloTest, BadFlagsAreRefusedBeforeAnythingStarts) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--batch_size=0"}, "--batch_size=0 must be at least 1"},
      {{"--batch_size=-3"}, "--batch_size=-3 must be at least 1"},
      {{"--lr=-1"}, "--lr=-1 must be a finite number > 0"},
      {{"--lr=0"}, "--lr=0 must be a finite number > 0"},
      {{"--lr=inf"}, "--lr=inf must be a finite number > 0"},
      {{"--lr=nan"}, "--lr=nan must be a finite number > 0"},
      {{"--epochs=-1"}, "--epochs=-1 must be at least 0"},
      {{"--nproc_per_node=3", "--epochs=-1"}, "--epochs=-1 must be at least 0"},
      {{"epochs=3", "--epochs=0"},
       "unexpected argument 'epochs=3'; flags are written --name=value (see --help)"},
  };
  const std::string hello = Runfile("examples/ddp_hello");
  const std::vector<std::pair<std::string, std::string>> one_rank = {
      {"RANK", "0"},         {"WORLD_SIZE", "1"},         {"LOCAL_RANK", "0"},
      {"LOCAL_WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> argv = {hello};
    argv.insert(argv.end(), flags.begin(), flags.end());
    for (const bool launched : {false, true}) {
      // (--nproc_per_node under a launcher is refused for another reason.)
      if (launched && flags[0].rfind("--nproc_per_node", 0) == 0) continue;
      const std::string what = flags.back() + (launched ? " under a launcher" : "");
      const RunOutput r = launched ? RunToEnd(argv, one_rank) : RunToEnd(argv);
      EXPECT_EQ(r.exit_code, 2) << what << "\n" << r.out << r.err;
      EXPECT_EQ(r.err, "ddp_hello: " + message + "\n") << what;
      EXPECT_EQ(r.out, "") << what;
    }
  }
}

// Ctrl-C while the launching process checks the flags and the data ended
// it without a word. Held in that check by a --flagfile that is a FIFO (the
// check waits in its read, the writer's end held open until the program
// has ended), it now says so, and that the read stopped, ends by the
// signal, and starts no rank. (The writer's end closed right after the
// signal raced the read's stop: one line or two.)
TEST(DdpHelloTest, CtrlCDuringTheCheckBeforeLaunchSaysSoInOneLine) {
  const std::string dir = testing::MakeTempDir("ctrl_c_setup");
  const std::string fifo = dir + "/flags";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << fifo << ": " << std::strerror(errno);
  testing::Subprocess running({Runfile("examples/ddp_hello"), "--flagfile=" + fifo, "--nproc_per_node=1",
                               "--checkpoint=" + dir + "/saved/model.ckpt"});
  // Opens once the program has the FIFO open for reading (ENXIO before).
  int writer = -1;
  ASSERT_NO_FATAL_FAILURE(testing::OpenFifoOnceRead(fifo, running, &writer));
  running.Signal(SIGINT);
  const int code = running.Wait(std::chrono::seconds(60));
  ::close(writer);
  ASSERT_EQ(code, 128 + SIGINT) << running.Stdout() << running.Stderr();
  EXPECT_EQ(running.Stderr(),
            "ddp_hello: interrupted by Ctrl-C during setup; stopping before any rank starts (Ctrl-C again: at once)\n"
            "ddp_hello: --flagfile=" + fifo + ": stopped reading " + fifo +
            " before its end (its writer had not closed it); none of its flags were taken\n");
  EXPECT_EQ(running.Stdout(), "");
  EXPECT_TRUE(running.Children().empty());
  EXPECT_FALSE(std::filesystem::exists(dir + "/saved"));
}

// A misspelt flag or a malformed value gets one line naming the nearest
// flag, exit 2, as train and the benchmarks answer (gflags' own "ERROR:
// unknown command line flag 'epoch'" named no program and exited 1), and it
// is refused before any rank starts; one rank under another launcher
// refuses it the same way.
TEST(DdpHelloTest, AnUnknownFlagIsRefusedOnceNamingTheNearest) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--epoch=2", "unknown flag --epoch; did you mean --epochs? (--help lists the flags)"},
      {"--batchsize", "unknown flag --batchsize; did you mean --batch_size? (--help lists the flags)"},
      {"--epochs=two", "--epochs=two: the flag takes a whole number"},
      {"--lr=fast", "--lr=fast: the flag takes a number"},
  };
  const std::vector<std::pair<std::string, std::string>> one_rank = {
      {"RANK", "0"},         {"WORLD_SIZE", "1"},         {"LOCAL_RANK", "0"},
      {"LOCAL_WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  for (const auto& [flag, message] : cases) {
    for (const bool launched : {false, true}) {
      const std::string what = flag + (launched ? " under a launcher" : "");
      const RunOutput r =
          launched ? RunToEnd({Runfile("examples/ddp_hello"), flag}, one_rank)
                   : RunToEnd({Runfile("examples/ddp_hello"), "--nproc_per_node=3", flag});
      EXPECT_EQ(r.exit_code, 2) << what << "\n" << r.out << r.err;
      EXPECT_EQ(r.err, "ddp_hello: " + message + "\n") << what;
      EXPECT_EQ(r.out, "") << what;
    }
  }
}

}  // namespace
}  // namespace ddp::examples
