// What a new user meets on the command line: --help, and the mistakes that
// must get one line that says how to fix them (exit status 2, nothing
// started).

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include <gflags/gflags.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"
#include "nn/data/test_files.h"

namespace ddp::examples {
namespace {

using testing::Lines;
using testing::RunOutput;
using testing::RunToEnd;
using testing::Runfile;

RunOutput Train(std::vector<std::string> args) {
  args.insert(args.begin(), Runfile("examples/train"));
  return RunToEnd(std::move(args), {}, std::chrono::seconds(120));
}

// The one line on stderr, after checking there is exactly one.
std::string OneErrorLine(const RunOutput& r) {
  const std::vector<std::string> lines = Lines(r.err);
  EXPECT_EQ(lines.size(), 1u) << r.err;
  EXPECT_EQ(r.exit_code, 2) << r.err;
  return lines.empty() ? "" : lines[0];
}

TEST(TrainCliTest, HelpListsEveryTrainerFlagAndNoOthers) {
  const RunOutput r = Train({"--help"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* flag :
       {"model", "dataset", "data_dir", "train_samples", "test_samples", "workers", "seed",
        "epochs", "max_steps", "batch_size", "grad_accum_steps", "eval_every", "optimizer", "lr",
        "momentum", "weight_decay", "decay_norm_and_bias", "scheduler", "lr_gamma", "lr_milestones",
        "lr_t0", "lr_t_mult", "lr_patience", "cycle_momentum", "amp", "device", "flush_denormal",
        "nproc_per_node", "max_restarts",
        "sync_bn", "zero", "zero_overlap", "bucket_cap_mb", "comm_hook", "powersgd_start_step",
        "find_unused_parameters", "ddp_stats", "trace", "checkpoint", "checkpoint_every",
        "save_timeout_s", "save_stop_grace_s", "resume", "log_dir", "log_every", "timeout_s"}) {
    EXPECT_NE(r.out.find("  --" + std::string(flag)), std::string::npos) << flag;
  }
  // Flags of linked libraries (gflags' own) stay out of the way.
  EXPECT_EQ(r.out.find("--flagfile"), std::string::npos);
  EXPECT_EQ(r.out.find("--tab_completion_columns"), std::string::npos);
  EXPECT_NE(r.out.find("--model=cnn"), std::string::npos) << "defaults are shown";
  EXPECT_NE(r.out.find("--lr=0.05 "), std::string::npos) << "numbers are shown as written";
  for (const std::string& line : Lines(r.out)) EXPECT_LE(line.size(), 100u) << line;
  EXPECT_EQ(Train({"-h"}).out, r.out);
  // --decay_norm_and_bias=false works with --zero_overlap (README); its
  // help said "not with --zero_overlap" after the combination was allowed.
  const size_t decay = r.out.find("  --decay_norm_and_bias");
  ASSERT_NE(decay, std::string::npos);
  const std::string decay_help = r.out.substr(decay, r.out.find("\n  --", decay + 1) - decay);
  EXPECT_EQ(decay_help.find("zero_overlap"), std::string::npos) << decay_help;
}

TEST(TrainCliTest, DeviceIsCheckedBeforeAnythingStarts) {
  EXPECT_EQ(OneErrorLine(Train({"--device=tpu"})), "train: unknown --device=tpu; use cpu or cuda");
  // Not an option that depends on the device: the device itself.
  EXPECT_EQ(OneErrorLine(Train({"--device=gpu", "--zero", "--zero_overlap"})),
            "train: unknown --device=gpu; use cpu or cuda");
#ifndef DDP_TRAIN_BUILT_WITH_CUDA
  EXPECT_EQ(OneErrorLine(Train({"--device=cuda", "--dataset=synthetic", "--model=mlp"})),
            "train: --device=cuda: this trainer was built without CUDA; rebuild it with "
            "`bazel build --config=cuda //examples:train`");
#endif
}

TEST(TrainCliTest, MissingDatasetNamesThePackageAndDataDir) {
  const std::string line = OneErrorLine(Train({"--data_dir=/nonexistent/fmnist"}));
  EXPECT_EQ(line.rfind("train: dataset file not found: looked for "
                       "/nonexistent/fmnist/train-images-idx3-ubyte.gz",
                       0),
            0u)
      << line;
  EXPECT_NE(line.find("apt-get install dataset-fashion-mnist"), std::string::npos) << line;
  EXPECT_NE(line.find("--data_dir"), std::string::npos) << line;
}

// MNIST and CIFAR-10 have no usual folder (Debian ships neither): without
// --data_dir the run is refused in one line that says where to get them.
TEST(TrainCliTest, MnistAndCifar10WithoutDataDirSayWhatTheFolderHolds) {
  EXPECT_EQ(OneErrorLine(Train({"--dataset=mnist", "--model=mlp"})),
            "train: --dataset=mnist needs --data_dir: a folder with MNIST's four IDX files "
            "(train-images-idx3-ubyte.gz, ...); Debian ships Fashion-MNIST instead "
            "(--dataset=fashion_mnist, package dataset-fashion-mnist)");
  EXPECT_EQ(OneErrorLine(Train({"--dataset=cifar10"})),
            "train: --dataset=cifar10 needs --data_dir: a folder with CIFAR-10's binary batches "
            "(data_batch_1.bin ... test_batch.bin, from cifar-10-binary.tar.gz); "
            "--dataset=synthetic times the same shapes without files");
}

TEST(TrainCliTest, TestImagesOfAnotherShapeAreRefusedAtTheStart) {
  const std::string dir = testing::MakeTempDir("mismatched_splits");
  nn::data::testing::WriteZeroIdx(dir + "/train-images-idx3-ubyte", {64, 28, 28});
  nn::data::testing::WriteZeroIdx(dir + "/train-labels-idx1-ubyte", {64});
  nn::data::testing::WriteZeroIdx(dir + "/t10k-images-idx3-ubyte", {8, 32, 32});
  nn::data::testing::WriteZeroIdx(dir + "/t10k-labels-idx1-ubyte", {8});
  const std::string line =
      OneErrorLine(Train({"--dataset=mnist", "--data_dir=" + dir, "--model=mlp", "--batch_size=8"}));
  EXPECT_NE(line.find("the test images"), std::string::npos) << line;
  EXPECT_NE(line.find("[1, 32, 32]"), std::string::npos) << line;
  EXPECT_NE(line.find("do not match the training images"), std::string::npos) << line;
  EXPECT_NE(line.find("[1, 28, 28]"), std::string::npos) << line;
}

TEST(TrainCliTest, UnknownCommHookListsTheHooks) {
  EXPECT_EQ(OneErrorLine(Train({"--comm_hook=int8"})),
            "train: unknown --comm_hook=int8; use one of allreduce, fp16, bf16, powersgd");
  // A hook that would leave the gradients as they are is refused.
  EXPECT_EQ(OneErrorLine(Train({"--comm_hook=bf16", "--amp=bf16"})),
            "train: --amp=bf16 on the CPU makes the whole model bf16, so its gradients already travel "
            "in 16 bits and --comm_hook=bf16 would leave them as they are; drop one of the two");
}

TEST(TrainCliTest, UnknownModelListsTheModels) {
  EXPECT_EQ(OneErrorLine(Train({"--model=vgg16"})),
            "train: unknown --model=vgg16; use one of cnn, mlp, resnet18, resnet34, resnet50");
}

// Under a launcher that names an error file (torchrun, ddprun), the
// failure's message goes there too, for the launcher's report.
TEST(TrainCliTest, FailuresAreWrittenToTheLaunchersErrorFile) {
  const std::string path = testing::MakeTempDir("train_error_file") + "/error.json";
  const RunOutput r = RunToEnd({Runfile("examples/train"), "--model=vgg16"},
                               {{"TORCHELASTIC_ERROR_FILE", path}}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  EXPECT_NE(text.str().find("\"message\":\"unknown --model=vgg16; use one of cnn,"), std::string::npos)
      << text.str();
}

TEST(TrainCliTest, BatchLargerThanTheShardSaysTheLimit) {
  EXPECT_EQ(OneErrorLine(Train({"--dataset=synthetic", "--model=mlp", "--train_samples=1000",
                                "--batch_size=600", "--nproc_per_node=2"})),
            "train: --batch_size=600 is larger than the 500 training samples each of the 2 "
            "ranks gets (--train_samples=1000 of synthetic); use --batch_size=500 or less, fewer "
            "ranks, or a larger --train_samples");
}

TEST(TrainCliTest, StrayArgumentsAndBadValuesAreRefused) {
  EXPECT_EQ(OneErrorLine(Train({"epochs=3"})),
            "train: unexpected argument 'epochs=3'; flags are written --name=value (see --help)");
  EXPECT_EQ(OneErrorLine(Train({"--nproc_per_node=0"})),
            "train: --nproc_per_node=0 must be in [1, 4096]");
  EXPECT_EQ(OneErrorLine(Train({"--resume", "--checkpoint=none"})),
            "train: --resume needs a checkpoint to read; drop --checkpoint=none or give a path");
}

// A misspelt flag got gflags' "ERROR: unknown command line flag 'modle'"
// and exit status 1: no program name, no hint. It is one line as the other
// mistakes are, with the trainer's flag it is nearest to when there is one.
// Flags spelt as gflags allows still pass the check.
TEST(TrainCliTest, AnUnknownFlagIsRefusedWithTheNearestFlag) {
  EXPECT_EQ(OneErrorLine(Train({"--modle=mlp"})),
            "train: unknown flag --modle; did you mean --model? (--help lists the flags)");
  EXPECT_EQ(OneErrorLine(Train({"--model=mlp", "-nproc_per_nod", "1"})),
            "train: unknown flag -nproc_per_nod; did you mean --nproc_per_node? (--help lists the "
            "flags)");
  EXPECT_EQ(OneErrorLine(Train({"--learning_rate=0.1"})),
            "train: unknown flag --learning_rate (--help lists the flags)");
  // A value after its flag, a negated bool, a negative value and "--"
  // are not taken for flags: the run goes on to the next check.
  EXPECT_EQ(OneErrorLine(Train({"--model", "foo", "--nozero", "--lr_gamma", "-0.5", "--", "--x"})),
            "train: unexpected argument '--x'; flags are written --name=value (see --help)");
  // A value not of the flag's type got gflags' "ERROR: illegal value '-1'
  // specified for uint64 flag 'seed'" and exit status 1 too.
  EXPECT_EQ(OneErrorLine(Train({"--seed=-1"})), "train: --seed=-1: the flag takes a whole number, at least 0");
  EXPECT_EQ(OneErrorLine(Train({"--epochs", "two"})), "train: --epochs=two: the flag takes a whole number");
  EXPECT_EQ(OneErrorLine(Train({"--lr=fast"})), "train: --lr=fast: the flag takes a number");
  EXPECT_EQ(OneErrorLine(Train({"--zero=maybe"})), "train: --zero=maybe: the flag takes true or false");
  EXPECT_EQ(OneErrorLine(Train({"--epochs"})), "train: --epochs needs a value: --epochs=VALUE");
}

// A number too large for its flag's type (or a double past a double's
// range) was refused as no number at all ("--batch_size=99999999999999999999:
// the flag takes a whole number"), which sent the user looking for a typo.
// The refusal names the range instead.
TEST(TrainCliTest, AValuePastItsTypesRangeSaysTheRange) {
  EXPECT_EQ(OneErrorLine(Train({"--batch_size=99999999999999999999"})),
            "train: --batch_size=99999999999999999999 is out of range: the flag takes a whole number "
            "from -9223372036854775808 to 9223372036854775807");
  EXPECT_EQ(OneErrorLine(Train({"--workers", "-99999999999"})),
            "train: --workers=-99999999999 is out of range: the flag takes a whole number from "
            "-2147483648 to 2147483647");
  EXPECT_EQ(OneErrorLine(Train({"--seed=99999999999999999999"})),
            "train: --seed=99999999999999999999 is out of range: the flag takes a whole number from 0 "
            "to 18446744073709551615");
  EXPECT_EQ(OneErrorLine(Train({"--lr=1e400"})),
            "train: --lr=1e400 is out of range: the flag takes a number of magnitude up to about 1.8e308");
  EXPECT_EQ(OneErrorLine(Train({"--weight_decay=-1e999"})),
            "train: --weight_decay=-1e999 is out of range: the flag takes a number of magnitude up to about "
            "1.8e308");
  // Below the smallest normal double is no overflow: gflags refused such
  // a value, a valid double (PyTorch takes it); it reaches the trainer's
  // own checks now, as the same number.
  EXPECT_EQ(OneErrorLine(Train({"--lr=-1e-310"})), "train: --lr=-1e-310 must be a finite number > 0");
  EXPECT_EQ(OneErrorLine(Train({"--weight_decay", "-1e-315"})),
            "train: --weight_decay=-1e-315 must be a finite number >= 0");
  EXPECT_EQ(OneErrorLine(Train({"--lr=-1e-400"})), "train: --lr=0 would never change the model; use a positive value");
  // Values that are no number of the type are still said to be so.
  EXPECT_EQ(OneErrorLine(Train({"--workers=1.5"})), "train: --workers=1.5: the flag takes a whole number");
  EXPECT_EQ(OneErrorLine(Train({"--lr=1e400x"})), "train: --lr=1e400x: the flag takes a number");
}

// gflags' --flagfile: a missing file ended the run with gflags' "PATH: No
// such file or directory" and exit status 1, and a folder was read as an
// empty file, so the run went on with the defaults. Both are one line now.
TEST(TrainCliTest, AFlagfileThatCannotBeReadIsRefused) {
  const std::string dir = testing::MakeTempDir("flagfile");
  const std::string flags = dir + "/flags";
  std::ofstream(flags) << "--model=mlp\n";
  // Quick, should a refused one run anyway.
  const std::vector<std::string> quick = {"--dataset=synthetic", "--train_samples=64", "--test_samples=16",
                                          "--batch_size=16",     "--max_steps=1",      "--workers=0",
                                          "--nproc_per_node=1",  "--checkpoint=none"};
  std::vector<std::string> args = {"--flagfile=" + dir + "/missing"};
  args.insert(args.end(), quick.begin(), quick.end());
  EXPECT_EQ(OneErrorLine(Train(args)), "train: --flagfile=" + dir + "/missing: cannot read " + dir +
                                           "/missing (No such file or directory)");
  args = {"--flagfile", dir};
  args.insert(args.end(), quick.begin(), quick.end());
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: --flagfile=" + dir + ": " + dir + " is a folder; give the path of a file of flags");
  args = {"--flagfile=" + flags + "," + dir};
  args.insert(args.end(), quick.begin(), quick.end());
  EXPECT_EQ(OneErrorLine(Train(args)), "train: --flagfile=" + flags + "," + dir + ": " + dir +
                                           " is a folder; give the path of a file of flags");
  // A readable one is read.
  args = {"--flagfile=" + flags};
  args.insert(args.end(), quick.begin(), quick.end());
  const RunOutput read = Train(args);
  ASSERT_EQ(read.exit_code, 0) << read.err;
  EXPECT_NE(read.out.find("RESULT model=mlp "), std::string::npos) << read.out;
}

// gflags' own flags: a bad value of a help flag, a missing value, and what
// --fromenv and --tryfromenv cannot set got gflags' "ERROR: illegal value
// 'foo' specified for bool flag 'help'", "ERROR: FLAGS_seed not found in
// environment" and the like, with exit status 1. One line each now.
TEST(TrainCliTest, GflagsOwnFlagsWithBadValuesAreOneLine) {
  EXPECT_EQ(OneErrorLine(Train({"--help=foo"})), "train: --help=foo: the flag takes true or false");
  EXPECT_EQ(OneErrorLine(Train({"--helpon"})), "train: --helpon needs a value: --helpon=VALUE");
  EXPECT_EQ(OneErrorLine(Train({"--fromenv=seed"})),
            "train: --fromenv=seed: FLAGS_seed is not set; set it (export FLAGS_seed=VALUE), or use --tryfromenv, "
            "which skips a flag whose variable is unset");
  EXPECT_EQ(OneErrorLine(Train({"--tryfromenv=sed"})),
            "train: --tryfromenv=sed: unknown flag sed; did you mean seed? (--help lists the flags)");
  EXPECT_EQ(OneErrorLine(RunToEnd({Runfile("examples/train"), "--tryfromenv=seed"}, {{"FLAGS_seed", "-1"}})),
            "train: --tryfromenv=seed: FLAGS_seed=-1: the flag takes a whole number, at least 0");
}

// --decay_norm_and_bias=false needs a weight decay to spare the biases and
// norms from. (With --zero_overlap it is taken: train_resume_test's
// OverlappedShardedStepWithDecayGroupsTrainsAndResumesLikeTheUnsharded.)
// --log_every without --log_dir spaced rows nobody wrote (and gathered
// each one's losses from every rank all the same).
TEST(TrainCliTest, LogEveryWithoutALogDirIsRefused) {
  EXPECT_EQ(OneErrorLine(Train({"--log_every=5"})),
            "train: --log_every=5 sets the steps per metrics.csv row, which only --log_dir writes; "
            "add --log_dir=DIR, or drop --log_every");
}

TEST(TrainCliTest, DecayNormAndBiasOffIsRefusedWhereItCannotApply) {
  EXPECT_EQ(OneErrorLine(Train({"--decay_norm_and_bias=false"})),
            "train: --decay_norm_and_bias=false spares biases and norms from --weight_decay, which is "
            "0 here; pass a --weight_decay above 0, or drop --decay_norm_and_bias=false");
}

// The schedules' flags: refused in one line when given to another
// --scheduler, missing, or unreadable, and a schedule that would do nothing
// in this run (data read) is refused before any rank starts.
TEST(TrainCliTest, ScheduleFlagsAreCheckedBeforeAnythingStarts) {
  EXPECT_EQ(OneErrorLine(Train({"--lr_gamma=0.5"})),
            "train: --lr_gamma applies to --scheduler=step, multistep, exponential or plateau "
            "only; drop it for --scheduler=cosine");
  EXPECT_EQ(OneErrorLine(Train({"--scheduler=exponential"})),
            "train: --scheduler=exponential needs --lr_gamma, the rate's factor per optimizer step "
            "(0.999, say)");
  EXPECT_EQ(OneErrorLine(Train({"--scheduler=multistep", "--lr_milestones=10,x"})),
            "train: --lr_milestones=10,x is not a list of optimizer steps; write them as 1000,2000");
  EXPECT_EQ(OneErrorLine(Train({"--scheduler=warm_restarts"})),
            "train: --scheduler=warm_restarts needs --lr_t0, the optimizer steps of its first cycle");
  // Given at the default value, with another scheduler: refused all the same.
  EXPECT_EQ(OneErrorLine(Train({"--lr_patience=10"})),
            "train: --lr_patience applies to --scheduler=plateau only; drop it for --scheduler=cosine");
  EXPECT_EQ(OneErrorLine(Train({"--scheduler=warm_restarts", "--lr_t0=0"})), "train: --lr_t0=0 must be at least 1");
  // 2 ranks, batch 32 of 256 samples: 4 steps per epoch.
  const std::vector<std::string> quick = {"--dataset=synthetic", "--model=mlp", "--train_samples=256",
                                          "--test_samples=64",   "--batch_size=32", "--workers=0",
                                          "--checkpoint=none"};
  std::vector<std::string> args = quick;
  args.insert(args.end(), {"--scheduler=plateau", "--max_steps=3"});
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: --scheduler=plateau takes the test loss at the end of each epoch, and this run "
            "ends at step 3 (--max_steps=3), before its first epoch of 4 steps ends; pass "
            "--max_steps=0 or at least 4, or another --scheduler");
  args = quick;
  args.insert(args.end(), {"--scheduler=multistep", "--lr_milestones=2,8"});
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: --lr_milestones=2,8: step 8 would change nothing, this run ends at step 8 (2 "
            "epochs of 4 steps); pass milestones below 8");
}

// --nproc_per_node takes torchrun's forms, as SelfLaunch and ddprun do: gpu
// and auto count the GPUs CUDA_VISIBLE_DEVICES names (none needs to exist:
// the ranks train on the CPU).
TEST(TrainCliTest, NprocPerNodeTakesGpuCpuAndAuto) {
  const std::vector<std::string> quick = {"--dataset=synthetic", "--model=mlp", "--train_samples=128",
                                          "--test_samples=32",   "--batch_size=16", "--max_steps=1",
                                          "--workers=0",         "--checkpoint=none"};
  auto run = [&](const std::string& nproc, const std::string& gpus) {
    std::vector<std::string> args = {Runfile("examples/train"), "--nproc_per_node=" + nproc};
    args.insert(args.end(), quick.begin(), quick.end());
    return RunToEnd(args, {{"CUDA_VISIBLE_DEVICES", gpus}});
  };
  for (const auto& [nproc, gpus, ranks] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"gpu", "0,1", "ranks=2"}, {"auto", "3", "ranks=1"}}) {
    const RunOutput r = run(nproc, gpus);
    ASSERT_EQ(r.exit_code, 0) << nproc << ": " << r.out << r.err;
    EXPECT_NE(r.out.find("RESULT model=mlp " + ranks + " "), std::string::npos) << nproc << ": " << r.out;
  }
  EXPECT_EQ(OneErrorLine(run("gpu", "")),
            "train: --nproc_per_node=gpu: no GPU is visible (CUDA_VISIBLE_DEVICES='' names none)");
  EXPECT_EQ(OneErrorLine(Train({"--nproc_per_node=many"})),
            "train: --nproc_per_node=many is not an integer, gpu, cpu or auto");
  // cpu: one rank per CPU this process may run on; the batch check names
  // the count without starting them.
  const std::string cpu = OneErrorLine(Train({"--nproc_per_node=cpu", "--dataset=synthetic",
                                              "--model=mlp", "--batch_size=100000"}));
  EXPECT_TRUE(std::regex_match(cpu, std::regex(R"(train: --batch_size=100000 is larger than the .* )"
                                               R"(training samples each of the \d+ ranks? gets .*)")))
      << cpu;
}

// The default run (2 epochs) ended before PowerSGD's default start of 1,000
// steps and printed a plan of compressed gradients anyway.
TEST(TrainCliTest, PowerSgdThatWouldCompressNothingIsRefused) {
  const std::vector<std::string> quick = {"--comm_hook=powersgd", "--dataset=synthetic", "--model=mlp",
                                          "--train_samples=6400",  "--test_samples=64",    "--workers=0",
                                          "--checkpoint=none"};
  // 2 ranks, batch 64: 50 steps per epoch.
  EXPECT_EQ(OneErrorLine(Train(quick)),
            "train: --comm_hook=powersgd would compress nothing: it starts after "
            "--powersgd_start_step=1000 steps of full all-reduce, and this run ends at step 100 "
            "(2 epochs of 50 steps); pass --powersgd_start_step=99 or less, or another --comm_hook");
  std::vector<std::string> args = quick;
  args.push_back("--powersgd_start_step=95");
  const RunOutput r = Train(args);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("PowerSGD gradients (rank 1 after step 95)"), std::string::npos) << r.out;
}

// Under a launcher (ddprun, torchrun, srun, mpirun) the trainer is one rank
// and starts nothing: a --nproc_per_node that contradicts the launcher, or is
// no number at all, was dropped without a word, and a negative
// --max_restarts was accepted (a positive one was dropped). Refused as every self-launching binary
// refuses them (transport/launch/README.md), before anything starts.
TEST(TrainCliTest, LaunchedRankRefusesAContradictingNprocPerNode) {
  const std::vector<std::pair<std::string, std::string>> one_of_one = {
      {"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_WORLD_SIZE", "1"},
      {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}};
  auto launched = [&](std::vector<std::string> args) {
    const std::vector<std::string> quick = {"--dataset=synthetic", "--model=mlp", "--train_samples=64",
                                            "--test_samples=32",   "--max_steps=1", "--workers=0",
                                            "--checkpoint=none",   "--timeout_s=5"};
    args.insert(args.begin(), Runfile("examples/train"));
    args.insert(args.end(), quick.begin(), quick.end());
    return RunToEnd(args, one_of_one, std::chrono::seconds(60));
  };
  EXPECT_EQ(OneErrorLine(launched({"--nproc_per_node=4"})),
            "train: --nproc_per_node=4 asks for 4 workers on this node, but this process already "
            "is one worker of a launched job with 1 on this node (RANK=0, WORLD_SIZE=1, "
            "LOCAL_WORLD_SIZE=1); drop --nproc_per_node, or start the job with 4 workers per node "
            "(e.g. ddprun --nproc_per_node=4)");
  EXPECT_EQ(OneErrorLine(launched({"--nproc_per_node=abc"})),
            "train: --nproc_per_node=abc is not an integer, gpu, cpu or auto");
  EXPECT_EQ(OneErrorLine(launched({"--max_restarts=-1"})),
            "train: --max_restarts=-1 must not be negative");
  // Only the trainer's own launcher restarts ranks: under another one the
  // flag was dropped, and a failed rank ended the job.
  EXPECT_EQ(OneErrorLine(launched({"--max_restarts=2"})),
            "train: --max_restarts=2 restarts the ranks this program starts itself, and this "
            "process is one rank of a job another launcher started (ddprun, torchrun, srun, "
            "mpirun); drop --max_restarts and give it to the launcher (ddprun --max_restarts=2, "
            "torchrun --max_restarts=2)");
  EXPECT_EQ(OneErrorLine(launched({"--max_restarts", "1"})),
            "train: --max_restarts=1 restarts the ranks this program starts itself, and this "
            "process is one rank of a job another launcher started (ddprun, torchrun, srun, "
            "mpirun); drop --max_restarts and give it to the launcher (ddprun --max_restarts=1, "
            "torchrun --max_restarts=1)");
  // One that agrees passes: the next mistake is the one reported.
  EXPECT_EQ(OneErrorLine(launched({"--nproc_per_node=1", "--epochs=0"})),
            "train: --epochs=0 must be at least 1");
}

// The trainer's own launcher restarts its ranks, and its workers (which run
// with the launch variables set) refuse --max_restarts. It took the flag
// off their command line, but one from --flagfile or --tryfromenv still
// reached them, and each worker exited 2 saying another launcher started it.
TEST(TrainCliTest, MaxRestartsFromAFlagfileOrTheEnvironmentReachesNoWorker) {
  const std::string dir = testing::MakeTempDir("max_restarts_flagfile");
  const std::string flagfile = dir + "/flags";
  std::ofstream(flagfile) << "--max_restarts=1\n";
  const std::vector<std::string> quick = {"--dataset=synthetic", "--model=mlp", "--train_samples=256",
                                          "--test_samples=32",   "--max_steps=1", "--workers=0",
                                          "--checkpoint=none",   "--nproc_per_node=2"};
  std::vector<std::string> args = quick;
  args.insert(args.begin(), "--flagfile=" + flagfile);
  const RunOutput from_file = Train(args);
  EXPECT_EQ(from_file.exit_code, 0) << from_file.err;
  EXPECT_EQ(from_file.err.find("another launcher started"), std::string::npos) << from_file.err;
  args = quick;
  args.insert(args.begin(), Runfile("examples/train"));
  args.push_back("--tryfromenv=max_restarts");
  const RunOutput from_env = RunToEnd(args, {{"FLAGS_max_restarts", "1"}}, std::chrono::seconds(120));
  EXPECT_EQ(from_env.exit_code, 0) << from_env.err;
  EXPECT_EQ(from_env.err.find("another launcher started"), std::string::npos) << from_env.err;
}

// A refused run creates no folder (the checkpoint's folder is made only
// once every other check passed).
TEST(TrainCliTest, MissingCheckpointToResumeLeavesNoFolderBehind) {
  const std::string dir = testing::MakeTempDir("no_folder") + "/not_there";
  EXPECT_EQ(OneErrorLine(Train({"--dataset=synthetic", "--model=mlp", "--resume", "--nproc_per_node=1",
                                "--checkpoint=" + dir + "/ckpt.safetensors"})),
            "train: --resume: no checkpoint at " + dir +
                "/ckpt.safetensors; run once without --resume to create it, or pass "
                "--checkpoint=PATH");
  EXPECT_FALSE(std::filesystem::exists(dir)) << dir << " was created";
}

TEST(TrainCliTest, CheckpointOfAnotherModelListsTheKeys) {
  const std::string dir = testing::MakeTempDir("mismatch");
  const std::string ckpt = dir + "/mlp.safetensors";
  const RunOutput made = Train({"--dataset=synthetic", "--model=mlp", "--train_samples=256",
                                "--test_samples=64", "--batch_size=32", "--max_steps=2",
                                "--nproc_per_node=1", "--checkpoint=" + ckpt});
  ASSERT_EQ(made.exit_code, 0) << made.out << made.err;
  const std::string line = OneErrorLine(Train({"--dataset=synthetic", "--model=cnn", "--resume",
                                               "--nproc_per_node=1", "--checkpoint=" + ckpt}));
  EXPECT_EQ(line,
            "train: checkpoint " + ckpt +
                " does not match --model=cnn: missing keys 0.weight, 0.bias, 7.weight, 7.bias, "
                "9.weight, 9.bias; unexpected keys 1.weight, 1.bias, 5.weight, 5.bias; different "
                "shapes or dtypes 3.weight [256, 512] f32 vs [64, 32, 3, 3] f32, 3.bias [256] f32 "
                "vs [64] f32; it was saved by --model=mlp; pass the same flags, or another "
                "--checkpoint path");
}

// A resumed run continues the saved schedule or is refused, before any rank
// starts (a cosine checkpoint used to continue under --scheduler=step, and
// a changed --lr gave way to the saved one without a word).
TEST(TrainCliTest, CheckpointOfAnotherScheduleOrRateIsRefusedInOneLine) {
  const std::string dir = testing::MakeTempDir("schedule");
  const std::string ckpt = dir + "/mlp.safetensors";
  const std::vector<std::string> quick = {"--dataset=synthetic", "--model=mlp", "--train_samples=256",
                                          "--test_samples=64",   "--batch_size=32", "--max_steps=2",
                                          "--workers=0",         "--checkpoint=" + ckpt};
  const RunOutput made = Train(quick);  // 2 ranks, 4 steps per epoch
  ASSERT_EQ(made.exit_code, 0) << made.out << made.err;
  std::vector<std::string> args = quick;
  args.insert(args.end(), {"--resume", "--scheduler=step"});
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: checkpoint " + ckpt + " was saved with --scheduler=cosine and this run has "
            "--scheduler=step; pass --scheduler=cosine to continue that run, or another "
            "--checkpoint path to start afresh");
  args = quick;
  args.insert(args.end(), {"--resume", "--lr=0.1"});
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: checkpoint " + ckpt + " was saved with --lr=0.05 and this run has --lr=0.1; "
            "pass --lr=0.05 to continue that run, or another --checkpoint path to start afresh");
  args = quick;
  args.insert(args.end(), {"--resume", "--max_steps=0"});
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: the cosine schedule of checkpoint " + ckpt + " ends at step 2, as "
            "--max_steps=2 set it, and this run's --max_steps=0 would end it at step 8; pass "
            "--max_steps=2 to continue that run, or another --checkpoint path to start afresh");
}

// A file where --log_dir or the checkpoint's folder must be, at the
// folder itself or above it, is named: the refusal said "folder
// DIR/notes.txt/run1: Not a directory".
TEST(TrainCliTest, AFileWhereAFolderMustBeIsNamed) {
  const std::string dir = testing::MakeTempDir("file_for_folder");
  const std::string file = dir + "/notes.txt";
  std::ofstream(file) << "not a folder\n";
  const std::vector<std::string> quick = {"--dataset=synthetic", "--model=mlp", "--nproc_per_node=1"};
  std::vector<std::string> args = quick;
  args.insert(args.end(), {"--checkpoint=none", "--log_dir=" + file});
  EXPECT_EQ(OneErrorLine(Train(args)), "train: cannot write --log_dir=" + file + " (" + file +
                                           " is a file, not a folder); choose a writable path");
  args = quick;
  args.insert(args.end(), {"--checkpoint=none", "--log_dir=" + file + "/run1/logs"});
  EXPECT_EQ(OneErrorLine(Train(args)), "train: cannot write --log_dir=" + file + "/run1/logs (" + file +
                                           " is a file, not a folder); choose a writable path");
  args = quick;
  args.push_back("--checkpoint=" + file + "/ckpt.safetensors");
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: cannot write --checkpoint=" + file + "/ckpt.safetensors (" + file +
                " is a file, not a folder); choose a writable path, or --checkpoint=none");
}

// A checkpoint file name longer than the filesystem takes (NAME_MAX, 255
// bytes on Linux) was taken for "another run's checkpoint" at the start
// (the look for one failed with ENAMETOOLONG, not ENOENT): the run trained
// and failed at its first save, "cannot keep another run's checkpoint",
// leaving the folder it had made. It is refused before training, and the
// folder made for it is removed.
TEST(TrainCliTest, ACheckpointNameTooLongForTheFilesystemIsRefusedAtTheStart) {
  const std::string dir = testing::MakeTempDir("long_name") + "/run1";
  const std::string path = dir + "/" + std::string(300, 'a') + ".safetensors";
  EXPECT_EQ(OneErrorLine(Train({"--dataset=synthetic", "--model=mlp", "--train_samples=64", "--test_samples=16",
                                "--batch_size=16", "--max_steps=1", "--nproc_per_node=1", "--checkpoint=" + path})),
            "train: cannot write --checkpoint=" + path + " (" + path +
                ": File name too long); choose a writable path, or --checkpoint=none");
  EXPECT_FALSE(std::filesystem::exists(dir)) << dir << " was left behind";
}

// Another run's file at a --checkpoint name of 255 bytes, the most the
// filesystem takes: a fresh run keeps it as <stem>.prev<extension> before
// its first save, a name 5 bytes longer. The run announced it would keep
// it "as <stem>.prev.1000.safetensors" (every longer name looked taken),
// trained, and failed at the first save. It is refused at the start,
// and the file is left as it was.
TEST(TrainCliTest, AnotherRunsFileWhoseKeptNameIsTooLongIsRefusedAtTheStart) {
  const std::string dir = testing::MakeTempDir("long_kept_name");
  const std::string path = dir + "/" + std::string(255 - 12, 'a') + ".safetensors";
  std::ofstream(path) << "another program's file\n";
  const std::string kept = dir + "/" + std::string(255 - 12, 'a') + ".prev.safetensors";
  EXPECT_EQ(OneErrorLine(Train({"--dataset=synthetic", "--model=mlp", "--train_samples=64", "--test_samples=16",
                                "--batch_size=16", "--max_steps=1", "--nproc_per_node=1", "--checkpoint=" + path})),
            "train: --checkpoint=" + path + " holds another run's file, which this run would keep as " + kept +
                " before its first save, and that name cannot be made (File name too long); pass a "
                "shorter --checkpoint path, or move that file away");
  EXPECT_EQ(testing::ReadFile(path), "another program's file\n");
}

TEST(TrainCliTest, UnwritableCheckpointFailsBeforeTraining) {
  EXPECT_EQ(OneErrorLine(Train({"--checkpoint=/proc/self/ckpt.safetensors"})),
            "train: cannot write --checkpoint=/proc/self/ckpt.safetensors (folder /proc/self: "
            "not writable (No such file or directory)); choose a writable path, or --checkpoint=none");
}

// A symbolic link at --checkpoint is written through: the folder checked at
// the start is its target's (an unwritable one was found only at the first
// save), and a link whose target's folder is missing is refused naming both.
TEST(TrainCliTest, CheckpointLinkIsCheckedWhereItLeads) {
  const std::string dir = testing::MakeTempDir("ckpt_link");
  const std::string link = dir + "/ckpt.safetensors";
  ASSERT_EQ(::symlink("/proc/self/ckpt.safetensors", link.c_str()), 0);
  EXPECT_EQ(OneErrorLine(Train({"--checkpoint=" + link})),
            "train: cannot write --checkpoint=" + link +
                " (folder /proc/self: not writable (No such file or directory)); choose a writable path, or "
                "--checkpoint=none");
  const std::string dangling = dir + "/dangling.safetensors";
  ASSERT_EQ(::symlink((dir + "/missing/ckpt.safetensors").c_str(), dangling.c_str()), 0);
  EXPECT_EQ(OneErrorLine(Train({"--checkpoint=" + dangling})),
            "train: cannot write --checkpoint=" + dangling + " (cannot write a file at '" + dangling +
                "': it is a symbolic link to '" + dir + "/missing/ckpt.safetensors', whose folder '" + dir +
                "/missing' does not exist); choose a writable path, or --checkpoint=none");
}

// A folder for --checkpoint would be found only when the first epoch's
// checkpoint cannot be written over it.
TEST(TrainCliTest, CheckpointThatNamesAFolderIsRefusedAtTheStart) {
  const std::string dir = testing::MakeTempDir("ckpt_folder");
  const std::vector<std::string> quick = {"--dataset=synthetic", "--model=mlp", "--train_samples=128",
                                          "--test_samples=32",   "--batch_size=16", "--max_steps=2",
                                          "--workers=0",         "--nproc_per_node=1"};
  std::vector<std::string> args = quick;
  args.push_back("--checkpoint=" + dir);
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: --checkpoint=" + dir + " is a folder; it names the checkpoint file itself: pass "
            "--checkpoint=" + dir + "/mlp_synthetic.safetensors, for example, or --checkpoint=none");
  args = quick;
  args.push_back("--checkpoint=" + dir + "/new/");
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: --checkpoint=" + dir + "/new/ ends in '/'; it names the checkpoint file itself: "
            "pass --checkpoint=" + dir + "/new/mlp_synthetic.safetensors, for example, or "
            "--checkpoint=none");
  EXPECT_FALSE(std::filesystem::exists(dir + "/new")) << "a refused run made the folder";
}

// The trainer's outputs are written beside their path and renamed over it,
// which is refused for anything but a regular file. A FIFO (or socket, or
// device) at --checkpoint, or at chart.svg in --log_dir, or a folder at a
// trace file, is refused before training, naming the flag and the file:
// the checkpoint's was found only at the first save, after the FIFO had
// been linked to <stem>.prev as "another run's checkpoint"; chart.svg's and
// the trace's only as a warning during or after the run (exit status 0).
// (metrics.csv and trace files may be FIFOs: AFifoAtMetricsCsvStreamsTheRows,
// AFifoAtATraceFileStreamsTheTrace.)
TEST(TrainCliTest, OutputPathThatIsAFifoIsRefusedAtTheStart) {
  const std::string dir = testing::MakeTempDir("output_fifo");
  const std::vector<std::string> quick = {"--dataset=synthetic", "--model=mlp", "--train_samples=128",
                                          "--test_samples=32",   "--batch_size=16", "--max_steps=2",
                                          "--workers=0",         "--nproc_per_node=1"};
  const std::string fifo = dir + "/ckpt.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::vector<std::string> args = quick;
  args.push_back("--checkpoint=" + fifo);
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: --checkpoint=" + fifo + " is a FIFO, not a regular file, and each save would replace "
            "it; pass the path of a checkpoint file (new or old), or --checkpoint=none");
  EXPECT_FALSE(std::filesystem::exists(dir + "/ckpt.prev.safetensors")) << "the FIFO was kept as a checkpoint";
  const std::string link = dir + "/link.safetensors";
  ASSERT_EQ(::symlink(fifo.c_str(), link.c_str()), 0);
  args = quick;
  args.push_back("--checkpoint=" + link);
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: --checkpoint=" + link + " leads to " + fifo + ", a FIFO, not a regular file, and each "
            "save would replace it; pass the path of a checkpoint file (new or old), or --checkpoint=none");
  const std::string logs = dir + "/logs";
  std::filesystem::create_directories(logs);
  ASSERT_EQ(::mkfifo((logs + "/chart.svg").c_str(), 0600), 0);
  args = quick;
  args.insert(args.end(), {"--checkpoint=none", "--log_dir=" + logs});
  EXPECT_EQ(OneErrorLine(Train(args)),
            "train: --log_dir=" + logs + ": " + logs + "/chart.svg is a FIFO, not a regular file, and "
            "the run would replace it with its chart.svg; move it away, or pass another --log_dir");
  const std::string traces = dir + "/traces";
  std::filesystem::create_directories(traces);
  std::filesystem::create_directories(traces + "/trace_rank0.json");
  args = quick;
  args.insert(args.end(), {"--checkpoint=none", "--log_dir=" + traces, "--trace"});
  const RunOutput r = Train(args);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--trace cannot write this rank's trace into --log_dir=" + traces + ": " + traces +
                       "/trace_rank0.json is a folder, not a regular file, and the trace would replace it; "
                       "move it away, pass another --log_dir, or drop --trace\n"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("done in"), std::string::npos) << "it trained: " << r.out;
}

// A named pipe at metrics.csv in --log_dir (metrics streamed to a reader,
// as a PyTorch script prints them into `| tee`) gets the header and every
// row, line by line, and stays a pipe; chart.svg beside it is a file. It
// was refused, as a FIFO that the run would replace.
TEST(TrainCliTest, AFifoAtMetricsCsvStreamsTheRows) {
  const std::string logs = testing::MakeTempDir("metrics_fifo");
  const std::string csv = logs + "/metrics.csv";
  ASSERT_EQ(::mkfifo(csv.c_str(), 0600), 0);
  // Opened first, as `cat logs/metrics.csv &` would be; read once the run
  // ended (its few rows fit in the pipe).
  const int reader = ::open(csv.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0);
  const RunOutput r = Train({"--dataset=synthetic", "--model=mlp", "--train_samples=128", "--test_samples=32",
                             "--batch_size=16", "--max_steps=2", "--log_every=1", "--workers=0",
                             "--nproc_per_node=1", "--checkpoint=none", "--log_dir=" + logs});
  std::string streamed;
  char buffer[4096];
  for (ssize_t n; (n = ::read(reader, buffer, sizeof(buffer))) > 0;) streamed.append(buffer, n);
  ::close(reader);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> rows = Lines(streamed);
  ASSERT_GE(rows.size(), 3u) << streamed;
  EXPECT_EQ(rows[0], "step,epoch,loss,lr,samples_per_s,test_loss,test_acc");
  EXPECT_EQ(rows[1].rfind("1,1,", 0), 0u) << streamed;
  EXPECT_EQ(rows[2].rfind("2,1,", 0), 0u) << streamed;
  EXPECT_EQ(streamed.back(), '\n') << streamed;
  EXPECT_EQ(std::filesystem::status(csv).type(), std::filesystem::file_type::fifo);
  EXPECT_TRUE(std::filesystem::is_regular_file(logs + "/chart.svg"));
}

// A named pipe at a rank's trace file in --log_dir (mkfifo
// logs/trace_rank0.json; cat logs/trace_rank0.json) is streamed: its reader
// gets one complete JSON document, the rank's timeline, and the pipe stays
// a pipe. It was refused, as a FIFO that the trace's rename would replace.
TEST(TrainCliTest, AFifoAtATraceFileStreamsTheTrace) {
  const std::string logs = testing::MakeTempDir("trace_fifo");
  const std::string fifo = logs + "/trace_rank0.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Opened first, as `cat logs/trace_rank0.json &` would be.
  testing::FifoReader reader(fifo);
  const RunOutput r = Train({"--dataset=synthetic", "--model=mlp", "--train_samples=128", "--test_samples=32",
                             "--batch_size=16", "--max_steps=2", "--workers=0", "--nproc_per_node=1",
                             "--checkpoint=none", "--log_dir=" + logs, "--trace"});
  const std::string streamed = reader.Finish();
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("  trace streamed into " + fifo), std::string::npos) << r.out;
  EXPECT_TRUE(reader.ended()) << "the trace was not ended: " << streamed;
  nlohmann::json doc;
  ASSERT_NO_THROW(doc = nlohmann::json::parse(streamed)) << streamed;
  int forwards = 0;
  for (const auto& e : doc["traceEvents"]) {
    EXPECT_EQ(e["pid"], 0) << e.dump();
    forwards += e["ph"] == "X" && e["name"] == "forward";
  }
  EXPECT_GE(forwards, 2) << streamed;
  EXPECT_EQ(std::filesystem::status(fifo).type(), std::filesystem::file_type::fifo);
}

// A second run into the first one's --log_dir replaced its metrics.csv
// and chart.svg without a word. It keeps them beside the new ones, and
// says where.
TEST(TrainCliTest, ASecondRunIntoALogDirKeepsTheFirstRunsMetrics) {
  const std::string logs = testing::MakeTempDir("log_dir_again");
  const std::vector<std::string> quick = {"--dataset=synthetic", "--model=mlp", "--train_samples=128",
                                          "--test_samples=32",   "--batch_size=16", "--max_steps=2",
                                          "--log_every=1",       "--workers=0",     "--nproc_per_node=1",
                                          "--checkpoint=none",   "--log_dir=" + logs};
  const RunOutput first = Train(quick);
  ASSERT_EQ(first.exit_code, 0) << first.out << first.err;
  std::stringstream rows;
  rows << std::ifstream(logs + "/metrics.csv").rdbuf();
  std::vector<std::string> args = quick;
  args.push_back("--lr=0.01");
  const RunOutput second = Train(args);
  ASSERT_EQ(second.exit_code, 0) << second.out << second.err;
  EXPECT_NE(second.out.find("  note: --log_dir held an earlier run's metrics; kept as " + logs +
                            "/metrics.prev.csv and " + logs +
                            "/chart.prev.svg (--resume continues a run's rows instead)\n"),
            std::string::npos)
      << second.out;
  std::stringstream kept;
  kept << std::ifstream(logs + "/metrics.prev.csv").rdbuf();
  EXPECT_EQ(kept.str(), rows.str());
  EXPECT_TRUE(std::filesystem::is_regular_file(logs + "/chart.prev.svg"));
  EXPECT_EQ(first.out.find("note: --log_dir"), std::string::npos) << first.out;
}

// A fresh run on a safetensors file another program wrote (weights from
// Python, ddp_hello's checkpoint) keeps it, as it keeps another run's
// checkpoint, but called it "another run's checkpoint" and offered
// "(--resume continues it instead)", which --resume then refused.
TEST(TrainCliTest, AFileAnotherProgramWroteIsKeptWithoutOfferingResume) {
  const std::string dir = testing::MakeTempDir("foreign_checkpoint");
  const std::string path = dir + "/weights.safetensors";
  // A safetensors file with no tensor and no metadata: an 8-byte header
  // length, then the header, "{}" padded with spaces.
  std::ofstream(path, std::ios::binary) << std::string("\x08\0\0\0\0\0\0\0", 8) << "{}      ";
  const RunOutput r = Train({"--dataset=synthetic", "--model=mlp", "--train_samples=128", "--test_samples=32",
                             "--batch_size=16", "--max_steps=2", "--workers=0", "--nproc_per_node=1",
                             "--checkpoint=" + path});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string kept = dir + "/weights.prev.safetensors";
  EXPECT_NE(r.out.find("  note: " + path + " holds a file this trainer did not write; this run's first "
                       "save keeps it as " + kept + "\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("  a file this trainer did not write, which was at " + path + ", is now " + kept + "\n"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("--resume continues it"), std::string::npos) << r.out;
  EXPECT_EQ(std::filesystem::file_size(kept), 16u);
}

// A device at metrics.csv other than a terminal (here a node of the null
// device's number made in the test's folder) is refused at the start,
// before anything opens it: only a named pipe or a terminal is a stream.
TEST(TrainCliTest, ADeviceAtMetricsCsvThatIsNoTerminalIsRefused) {
  const std::string logs = testing::MakeTempDir("metrics_device");
  const std::string csv = logs + "/metrics.csv";
  ASSERT_EQ(::mknod(csv.c_str(), S_IFCHR | 0600, makedev(1, 3)), 0);
  const RunOutput r = Train({"--dataset=synthetic", "--model=mlp", "--train_samples=128", "--test_samples=32",
                             "--batch_size=16", "--max_steps=2", "--workers=0", "--nproc_per_node=1",
                             "--checkpoint=none", "--log_dir=" + logs});
  EXPECT_EQ(OneErrorLine(r),
            "train: --log_dir=" + logs + ": " + csv + " is a character device, not a regular file, and the "
            "run would replace it with its metrics.csv; move it away, or pass another --log_dir (a named "
            "pipe or a terminal there takes the rows as a stream)");
}

// metrics.csv linked to the run's own stdout (/proc/self/fd/1, as through
// /dev/stdout) where that is a regular file (`> out.txt`): the run would
// replace the file its progress goes to, and the output so far would be
// gone. Refused at the start, naming the file and the way that streams
// (stdout into a pipe). The test's stdout is a file in its own folder.
TEST(TrainCliTest, MetricsCsvThatIsTheRunsOwnStdoutFileIsRefused) {
  const std::string logs = testing::MakeTempDir("metrics_own_stdout");
  const std::string csv = logs + "/metrics.csv";
  ASSERT_EQ(::symlink("/proc/self/fd/1", csv.c_str()), 0);
  const RunOutput r = Train({"--dataset=synthetic", "--model=mlp", "--train_samples=128", "--test_samples=32",
                             "--batch_size=16", "--max_steps=2", "--workers=0", "--nproc_per_node=1",
                             "--checkpoint=none", "--log_dir=" + logs});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_EQ(OneErrorLine(r),
            "train: --log_dir=" + logs + ": " + csv + " is this run's stdout, a regular file, and the run "
            "would replace it with its metrics.csv (and lose what was written there); pass another "
            "--log_dir, or send stdout into a pipe (| tee FILE), where metrics.csv streams");
  EXPECT_EQ(r.out, "");
  EXPECT_TRUE(std::filesystem::is_symlink(csv));
}

// An empty path (a script's `--checkpoint="$CKPT"` with CKPT unset) is
// refused, naming the flag and its meaningful values. Before, an empty
// --checkpoint meant no checkpoints: hours of training saved nothing, and
// each --max_restarts restart started over; an empty --log_dir wrote no
// metrics, and an empty --data_dir read the dataset's usual folder.
TEST(TrainCliTest, EmptyPathFlagsAreRefused) {
  EXPECT_EQ(OneErrorLine(Train({"--checkpoint="})),
            "train: --checkpoint is empty; give a path, auto (the default: "
            "~/.cache/ddp/checkpoints/<model>_<dataset>.safetensors), or none to save no "
            "checkpoints");
  EXPECT_EQ(OneErrorLine(Train({"--dataset=synthetic", "--model=mlp", "--log_dir="})),
            "train: --log_dir is empty; give a folder for metrics.csv and chart.svg, or drop the "
            "flag to write none");
  EXPECT_EQ(OneErrorLine(Train({"--data_dir="})),
            "train: --data_dir is empty; give the dataset's folder, or drop the flag to read its "
            "usual one");
}

TEST(TrainCliTest, ResumeWithoutACheckpointSaysHowToMakeOne) {
  const std::string dir = testing::MakeTempDir("nockpt");
  const std::string line = OneErrorLine(
      Train({"--resume", "--nproc_per_node=1", "--checkpoint=" + dir + "/none.safetensors"}));
  EXPECT_EQ(line, "train: --resume: no checkpoint at " + dir +
                      "/none.safetensors; run once without --resume to create it, or pass "
                      "--checkpoint=PATH");
}

// Two runs at once saving to one checkpoint file replaced each other's saves,
// and a later --resume continued whichever wrote last; both ended with exit
// status 0. The second is refused at the start, naming the file, while the
// first trains on.
TEST(TrainCliTest, SecondRunOnACheckpointInUseIsRefused) {
  const std::string dir = testing::MakeTempDir("ckpt_in_use");
  const std::string ckpt = dir + "/ckpt.safetensors";
  const std::vector<std::string> args = {"--dataset=synthetic", "--model=mlp",     "--batch_size=16",
                                         "--workers=0",         "--nproc_per_node=1", "--checkpoint=" + ckpt};
  std::vector<std::string> first = {Runfile("examples/train"), "--epochs=1000"};
  first.insert(first.end(), args.begin(), args.end());
  testing::Subprocess running(first);
  // The first run's progress lines start once rank 0 has claimed the file.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (running.Stdout().find("epoch 1/1000") == std::string::npos) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the first run did not start:\n"
                                                         << running.Stdout() << running.Stderr();
    ASSERT_EQ(running.Wait(std::chrono::milliseconds(50)), -1) << "the first run ended:\n" << running.Stderr();
  }
  std::vector<std::string> second = {"--epochs=1", "--train_samples=64", "--test_samples=16"};
  second.insert(second.end(), args.begin(), args.end());
  EXPECT_EQ(OneErrorLine(Train(second)),
            "train: --checkpoint=" + ckpt + " is in use: another run on this host saves to it now; wait "
            "for that run to end, or pass another --checkpoint (or --checkpoint=none)");
  EXPECT_EQ(running.Wait(std::chrono::milliseconds(0)), -1) << "the first run ended:\n" << running.Stderr();
  running.Signal(SIGINT);
  EXPECT_NE(running.Wait(std::chrono::seconds(60)), -1) << "the first run did not stop on SIGINT";
}

// chart.svg was drawn at epoch ends only: a run stopped by Ctrl-C in its
// first epoch left metrics.csv with its rows and no chart. The stop draws
// it too.
TEST(TrainCliTest, CtrlCInTheFirstEpochLeavesAChart) {
  const std::string logs = testing::MakeTempDir("ctrl_c_chart");
  // 50,000 images per epoch: the stop comes long before its end.
  testing::Subprocess running({Runfile("examples/train"), "--dataset=synthetic", "--model=cnn", "--batch_size=16",
                               "--workers=0", "--nproc_per_node=1", "--epochs=1", "--checkpoint=none",
                               "--log_every=1", "--log_dir=" + logs});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (Lines(testing::ReadFile(logs + "/metrics.csv")).size() < 3) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no rows:\n" << running.Stdout() << running.Stderr();
    ASSERT_EQ(running.Wait(std::chrono::milliseconds(50)), -1) << "the run ended:\n" << running.Stderr();
  }
  running.Signal(SIGINT);
  ASSERT_EQ(running.Wait(std::chrono::seconds(60)), 128 + SIGINT) << running.Stdout() << running.Stderr();
  ASSERT_NE(running.Stdout().find("stopped by Ctrl-C at epoch 1, step "), std::string::npos) << running.Stdout();
  const std::string chart = testing::ReadFile(logs + "/chart.svg");
  EXPECT_NE(chart.find("<svg"), std::string::npos) << "no chart at the stop";
  EXPECT_NE(chart.find("</svg>"), std::string::npos) << chart;
}

// More ranks than usable CPUs start, with a note before they do (999 ranks
// on 2 cores started without a word). One CPU (taskset) and 2 ranks.
TEST(TrainCliTest, MoreRanksThanCpusGetANote) {
  const RunOutput r = RunToEnd({"/usr/bin/taskset", "-c", "0", Runfile("examples/train"), "--nproc_per_node=2",
                                "--dataset=synthetic", "--model=mlp", "--batch_size=16", "--workers=0",
                                "--epochs=1", "--train_samples=64", "--test_samples=16", "--checkpoint=none"},
                               {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("train: note: 2 ranks on 1 usable CPUs: ranks share cores"), std::string::npos) << r.err;
  // One rank, on any host, says nothing of it.
  const RunOutput fits = Train({"--nproc_per_node=1", "--dataset=synthetic", "--model=mlp", "--batch_size=16",
                                "--workers=0", "--epochs=1", "--train_samples=64", "--test_samples=16",
                                "--checkpoint=none"});
  ASSERT_EQ(fits.exit_code, 0) << fits.err;
  EXPECT_EQ(fits.err.find("usable CPUs"), std::string::npos) << fits.err;
}

}  // namespace
}  // namespace ddp::examples
