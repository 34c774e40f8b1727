// A short real run of //examples:train on 2 ranks: what it prints, the
// metrics it writes, and the chart as a browser shows it (Chromium renders
// chart.svg to PNG; both curves must be visible). Also the trainer started
// the way ddprun starts it (RANK, WORLD_SIZE, ... set per process).

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "examples/testing/png.h"
#include "examples/testing/subprocess.h"
#include "examples/trainer/svg_chart.h"
#include "gtest/gtest.h"
#include "nn/io/checkpoint.h"

namespace ddp::examples {
namespace {

using testing::Lines;
using testing::ReadFile;
using testing::RunOutput;
using testing::RunToEnd;
using testing::Runfile;

// Small and quick: 2 ranks, 16 steps per epoch on generated 28x28 images.
std::vector<std::string> QuickRun(const std::string& dir) {
  return {Runfile("examples/train"), "--dataset=synthetic", "--model=mlp",
          "--train_samples=1024",    "--test_samples=256",  "--batch_size=32",
          "--workers=0",             "--eval_every=4",      "--log_every=2",
          "--checkpoint=" + dir + "/ckpt.safetensors", "--log_dir=" + dir + "/logs"};
}

TEST(TrainRunTest, PrintsHeaderEpochsAndResultAndWritesMetrics) {
  const std::string dir = testing::MakeTempDir("run");
  const RunOutput r = RunToEnd(QuickRun(dir));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.err, "");
  const std::vector<std::string> lines = Lines(r.out);
  ASSERT_GE(lines.size(), 5u) << r.out;
  EXPECT_EQ(lines[0],
            "mlp (535,818 parameters), 2 ranks, synthetic (1,024 train / 256 test), global "
            "batch 64 (2 x 32)");
  EXPECT_NE(r.out.find("checkpoint " + dir + "/ckpt.safetensors"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\r'), std::string::npos) << "a pipe gets no live bar";
  const std::regex epoch_line(
      R"(epoch [12]/2  train loss \d+\.\d{4}  test loss \d+\.\d{4}  test acc \d+\.\d\d%  \d+\.\ds)");
  int epoch_lines = 0;
  for (const std::string& l : lines) epoch_lines += std::regex_match(l, epoch_line);
  EXPECT_EQ(epoch_lines, 2) << r.out;
  const std::regex result(
      R"(RESULT model=mlp ranks=2 epochs=2 samples_per_s=\d+\.\d train_loss=\d+\.\d{4} test_acc=(0|1)\.\d{4} wall_s=\d+\.\d)");
  EXPECT_TRUE(std::regex_match(lines.back(), result)) << lines.back();

  // metrics.csv: a row every 2 steps, an evaluation every 4 and at epoch ends.
  const std::vector<std::string> csv = Lines(ReadFile(dir + "/logs/metrics.csv"));
  ASSERT_FALSE(csv.empty());
  EXPECT_EQ(csv[0], "step,epoch,loss,lr,samples_per_s,test_loss,test_acc");
  int step_rows = 0, eval_rows = 0;
  for (size_t i = 1; i < csv.size(); ++i) {
    if (std::regex_match(csv[i], std::regex(R"(\d+,[12],[0-9.e+-]+,[0-9.e+-]+,[0-9.]+,,)"))) ++step_rows;
    if (std::regex_match(csv[i], std::regex(R"(\d+,[12],,,,[0-9.e+-]+,[0-9.]+)"))) ++eval_rows;
  }
  EXPECT_EQ(step_rows, 16) << ReadFile(dir + "/logs/metrics.csv");
  EXPECT_EQ(eval_rows, 8) << ReadFile(dir + "/logs/metrics.csv");
  EXPECT_TRUE(std::filesystem::exists(dir + "/ckpt.safetensors"));
}

// --scheduler=onecycle over a run of --max_steps=10: metrics.csv's rate
// climbs from --lr/25 to --lr for step 3 (after 30% of the steps, less
// one), then falls to --lr/25e4 for the last step.
TEST(TrainRunTest, OneCycleRisesToTheLrAndEndsWithTheRun) {
  const std::string dir = testing::MakeTempDir("onecycle");
  std::vector<std::string> args = QuickRun(dir);
  args.insert(args.end(), {"--scheduler=onecycle", "--max_steps=10", "--log_every=1", "--epochs=1"});
  const RunOutput r = RunToEnd(args);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("sgd lr 0.05 momentum 0.9, onecycle schedule"), std::string::npos) << r.out;
  std::vector<std::string> rates;  // of steps 1, 2, ...
  for (const std::string& row : Lines(ReadFile(dir + "/logs/metrics.csv"))) {
    std::smatch m;
    if (std::regex_match(row, m, std::regex(R"(\d+,1,[0-9.e+-]+,([0-9.e+-]+),[0-9.]+,,)"))) {
      rates.push_back(m[1]);
    }
  }
  ASSERT_EQ(rates.size(), 10u) << ReadFile(dir + "/logs/metrics.csv");
  // The row of step k shows the rate step k trained with (it showed step
  // k + 1's, set by the scheduler after step k): step 1 trains at --lr/25,
  // step 3 at --lr, the last step (10) at the lowest rate.
  EXPECT_EQ(rates[0], "0.002");
  EXPECT_GT(std::stod(rates[1]), std::stod(rates[0]));
  EXPECT_EQ(rates[2], "0.05");
  for (size_t i = 3; i < 10; ++i) EXPECT_LT(std::stod(rates[i]), std::stod(rates[i - 1])) << i;
  EXPECT_EQ(rates[9], "2e-07");
}

// --cycle_momentum: OneCycleLR's momentum, cycled against the rate (0.95 at
// the start, 0.85 at the peak, 0.95 at the end), replaces SGD's 0.9. The
// run trains, and its checkpoint records the flag: a resume with the other
// value (or none, false) is refused naming it.
TEST(TrainRunTest, OneCycleWithCycledMomentumTrainsAndAResumeKeepsTheFlag) {
  const std::string dir = testing::MakeTempDir("cycle_momentum");
  std::vector<std::string> args = QuickRun(dir);
  args.insert(args.end(), {"--scheduler=onecycle", "--max_steps=10", "--epochs=1"});
  std::vector<std::string> cycled = args;
  cycled.push_back("--cycle_momentum");
  const RunOutput r = RunToEnd(cycled);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("sgd lr 0.05, onecycle schedule with momentum cycled 0.95-0.85-0.95"),
            std::string::npos)
      << r.out;
  int rows = 0;
  for (const std::string& row : Lines(ReadFile(dir + "/logs/metrics.csv"))) {
    std::smatch m;
    if (!std::regex_match(row, m, std::regex(R"(\d+,1,([^,]+),[^,]+,[^,]+,,)"))) continue;
    ++rows;
    EXPECT_TRUE(std::isfinite(std::stod(m[1]))) << row;
  }
  EXPECT_EQ(rows, 5) << ReadFile(dir + "/logs/metrics.csv");
  // The optimizer's momentum after the last step is near the cycle's end
  // (0.95 at step 10's), not --momentum's 0.9.
  double momentum = NAN;
  for (const auto& [key, t] : nn::io::LoadCheckpoint(dir + "/ckpt.safetensors").optimizer) {
    if (key == "group.momentum") momentum = t.Item();
  }
  EXPECT_GT(momentum, 0.93);
  EXPECT_LE(momentum, 0.95);
  // AdamW's beta1 is cycled the same way.
  const std::string adamw_dir = testing::MakeTempDir("cycle_momentum_adamw");
  std::vector<std::string> adamw = QuickRun(adamw_dir);
  adamw.insert(adamw.end(), {"--scheduler=onecycle", "--max_steps=10", "--epochs=1",
                             "--optimizer=adamw", "--cycle_momentum"});
  const RunOutput a = RunToEnd(adamw);
  ASSERT_EQ(a.exit_code, 0) << a.out << a.err;
  EXPECT_NE(a.out.find("adamw lr 0.001, onecycle schedule with momentum cycled 0.95-0.85-0.95"),
            std::string::npos)
      << a.out;
  double beta1 = NAN;
  for (const auto& [key, t] : nn::io::LoadCheckpoint(adamw_dir + "/ckpt.safetensors").optimizer) {
    if (key == "group.beta1") beta1 = t.Item();
  }
  EXPECT_GT(beta1, 0.93);
  EXPECT_LE(beta1, 0.95);

  for (const std::string& other : {std::string("--cycle_momentum=false"), std::string()}) {
    std::vector<std::string> resumed = args;
    resumed.push_back("--resume");
    if (!other.empty()) resumed.push_back(other);
    const RunOutput refused = RunToEnd(resumed);
    EXPECT_EQ(refused.exit_code, 2) << refused.out << refused.err;
    EXPECT_EQ(refused.err, "train: checkpoint " + dir + "/ckpt.safetensors was saved with "
                           "--cycle_momentum=true and this run has --cycle_momentum=false; pass "
                           "--cycle_momentum=true to continue that run, or another --checkpoint "
                           "path to start afresh\n");
  }
}

TEST(TrainRunTest, CompressedGradientsTrainAndSaySo) {
  const std::string dir = testing::MakeTempDir("bf16_hook");
  std::vector<std::string> args = QuickRun(dir);
  args.push_back("--comm_hook=bf16");
  args.push_back("--epochs=1");
  const RunOutput r = RunToEnd(args);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> lines = Lines(r.out);
  ASSERT_GE(lines.size(), 2u) << r.out;
  EXPECT_NE(lines[1].find(", bf16-compressed gradients"), std::string::npos) << lines[1];
  EXPECT_NE(lines.back().find("RESULT model=mlp ranks=2 epochs=1"), std::string::npos) << lines.back();
}

// --comm_hook=powersgd saves its iteration and Q's with the checkpoint, and
// a resumed run loads them: it counts on from the saved iteration (past the
// warm-up of 4 steps, so it compresses from its first step; a resume that
// counted from 0 would not compress in its 2 steps) and saves the Q's it
// went on with. Before, the checkpoint held neither. (The default warm-up of
// 1,000 steps made the case train 1,000 steps that showed nothing more.)
TEST(TrainRunTest, PowerSgdStateIsSavedAndAResumeContinuesIt) {
  const std::string dir = testing::MakeTempDir("powersgd_resume");
  const std::string ckpt = dir + "/ckpt.safetensors";
  std::vector<std::string> args = {
      Runfile("examples/train"), "--dataset=synthetic", "--model=mlp",  "--train_samples=128",
      "--test_samples=64",       "--batch_size=4",      "--workers=0",  "--epochs=1",
      "--scheduler=none",        "--comm_hook=powersgd", "--powersgd_start_step=4",
      "--checkpoint=" + ckpt};
  // The PowerSGD part of the checkpoint: its iteration and the Q's by key.
  auto powersgd_state = [&ckpt](int64_t* iteration) {
    std::map<std::string, std::vector<float>> qs;
    *iteration = -1;
    for (const auto& [key, t] : nn::io::LoadCheckpoint(ckpt).optimizer) {
      if (key == "powersgd.iteration") *iteration = t.ToVector<int64_t>().at(0);
      if (key.rfind("powersgd.q.", 0) == 0) qs[key] = t.ToVector<float>();
    }
    return qs;
  };
  std::vector<std::string> first = args;
  first.push_back("--max_steps=6");
  const RunOutput r1 = RunToEnd(first);
  ASSERT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  int64_t iteration = 0;
  const auto saved = powersgd_state(&iteration);
  EXPECT_EQ(iteration, 6);
  std::vector<std::string> keys;
  for (const auto& [key, q] : saved) keys.push_back(key);
  // The MLP's three weights; its biases are not compressed.
  EXPECT_EQ(keys, (std::vector<std::string>{"powersgd.q.1.weight", "powersgd.q.3.weight", "powersgd.q.5.weight"}));

  std::vector<std::string> resumed = args;
  resumed.insert(resumed.end(), {"--max_steps=8", "--resume"});
  const RunOutput r2 = RunToEnd(resumed);
  ASSERT_EQ(r2.exit_code, 0) << r2.out << r2.err;
  const auto after = powersgd_state(&iteration);
  EXPECT_EQ(iteration, 8);
  ASSERT_EQ(after.size(), saved.size());
  for (const auto& [key, q] : saved) {
    ASSERT_EQ(after.at(key).size(), q.size()) << key;
    EXPECT_NE(after.at(key), q) << key << ": the resumed run did not compress";
  }
}

// --decay_norm_and_bias=false on 2 ranks, with the whole optimizer (`extra`
// empty), --zero or --zero --zero_overlap: the plan says so, the run trains, its checkpoint holds
// two groups (biases and norms without weight decay) whose rates the
// schedule moved together and records the flag, a resume with it trains
// on, and one without it is refused naming the flag and both values.
void ExpectNormsAndBiasesUndecayedTrainAndResume(const std::string& name,
                                                 const std::vector<std::string>& extra) {
  const std::string dir = testing::MakeTempDir(name);
  const std::string ckpt = dir + "/ckpt.safetensors";
  std::vector<std::string> args = {
      Runfile("examples/train"), "--dataset=synthetic",    "--model=mlp",
      "--train_samples=256",     "--test_samples=64",      "--batch_size=32",
      "--workers=0",             "--nproc_per_node=2",     "--optimizer=adamw",
      "--weight_decay=0.01",     "--scheduler=exponential", "--lr_gamma=0.5",
      "--checkpoint=" + ckpt};
  args.insert(args.end(), extra.begin(), extra.end());
  // The groups' scalars of the saved optimizer state, and its step.
  auto saved_groups = [&ckpt](std::string* step) {
    const nn::io::Checkpoint saved = nn::io::LoadCheckpoint(ckpt);
    EXPECT_EQ(saved.metadata.at("decay_norm_and_bias"), "false");
    *step = saved.metadata.at("step");
    std::map<std::string, double> scalars;
    for (const auto& [key, t] : saved.optimizer) {
      if (key.rfind("param_groups.", 0) != 0 || t.numel() != 1) continue;
      scalars[key] =
          t.dtype() == nn::DType::kInt64 ? static_cast<double>(t.ToVector<int64_t>().at(0)) : t.Item();
    }
    return scalars;
  };

  std::vector<std::string> first = args;
  first.insert(first.end(), {"--decay_norm_and_bias=false", "--max_steps=2"});
  const RunOutput r1 = RunToEnd(first);
  ASSERT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  EXPECT_NE(r1.out.find("adamw lr 0.001 weight decay 0.01 (none on biases and norms)"), std::string::npos)
      << r1.out;
  EXPECT_NE(r1.out.find("RESULT model=mlp ranks=2 "), std::string::npos) << r1.out;
  std::string step;
  std::map<std::string, double> groups = saved_groups(&step);
  EXPECT_EQ(step, "2");
  EXPECT_EQ(groups["param_groups.count"], 2);
  EXPECT_EQ(groups["param_groups.0.weight_decay"], 0.01);
  EXPECT_EQ(groups["param_groups.1.weight_decay"], 0);
  // The MLP's three weight matrices, and its three biases.
  EXPECT_EQ(groups["param_groups.0.size"], 3);
  EXPECT_EQ(groups["param_groups.1.size"], 3);
  EXPECT_EQ(groups["param_groups.0.lr"], 0.001 * 0.25);
  EXPECT_EQ(groups["param_groups.1.lr"], 0.001 * 0.25);

  std::vector<std::string> resumed = args;
  resumed.insert(resumed.end(), {"--decay_norm_and_bias=false", "--max_steps=4", "--resume"});
  const RunOutput r2 = RunToEnd(resumed);
  ASSERT_EQ(r2.exit_code, 0) << r2.out << r2.err;
  EXPECT_NE(r2.out.find("resumed at epoch 1, step 2"), std::string::npos) << r2.out;
  groups = saved_groups(&step);
  EXPECT_EQ(step, "4");
  EXPECT_EQ(groups["param_groups.0.lr"], 0.001 * 0.0625);
  EXPECT_EQ(groups["param_groups.1.lr"], 0.001 * 0.0625);

  std::vector<std::string> other = args;
  other.insert(other.end(), {"--max_steps=6", "--resume"});
  const RunOutput r3 = RunToEnd(other);
  EXPECT_EQ(r3.exit_code, 2) << r3.out << r3.err;
  EXPECT_NE(r3.err.find("checkpoint " + ckpt + " was saved with --decay_norm_and_bias=false and this "
                        "run has --decay_norm_and_bias=true; pass --decay_norm_and_bias=false to "
                        "continue that run, or another --checkpoint path to start afresh"),
            std::string::npos)
      << r3.err;
}

TEST(TrainRunTest, NormsAndBiasesWithoutWeightDecayTrainAndResume) {
  ExpectNormsAndBiasesUndecayedTrainAndResume("no_decay_norms", {});
}

TEST(TrainRunTest, NormsAndBiasesWithoutWeightDecayTrainAndResumeSharded) {
  ExpectNormsAndBiasesUndecayedTrainAndResume("no_decay_norms_zero", {"--zero"});
}

// And with the step inside backward, which takes the groups too.
TEST(TrainRunTest, NormsAndBiasesWithoutWeightDecayTrainAndResumeShardedInsideBackward) {
  ExpectNormsAndBiasesUndecayedTrainAndResume("no_decay_norms_zero_overlap", {"--zero", "--zero_overlap"});
}

TEST(TrainRunTest, DdpStatisticsNameEachRanksWait) {
  const std::string dir = testing::MakeTempDir("ddp_stats");
  std::vector<std::string> args = QuickRun(dir);
  args.push_back("--ddp_stats");
  args.push_back("--epochs=1");
  const RunOutput r = RunToEnd(args);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::regex stats(
      R"(  ddp: forward \d+\.\d\d ms, .*, waiting for other ranks \d+\.\d\d ms, .*; each rank's wait for the )"
      R"(others \(ms per iteration\): 0:\d+\.\d\d 1:\d+\.\d\d)");
  int found = 0;
  for (const std::string& l : Lines(r.out)) found += std::regex_match(l, stats);
  EXPECT_EQ(found, 1) << r.out;
}

TEST(TrainRunTest, ChromiumShowsBothCurvesOfTheChart) {
  const std::string dir = testing::MakeTempDir("chart");
  const RunOutput r = RunToEnd(QuickRun(dir));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string svg = dir + "/logs/chart.svg";
  ASSERT_TRUE(std::filesystem::exists(svg));

  const std::string chromium = "/usr/bin/chromium";
  ASSERT_TRUE(std::filesystem::exists(chromium))
      << "Chromium renders the chart in this test: run tools/setup.sh (it installs chromium)";
  const std::string png = dir + "/chart.png";
  const RunOutput shot = RunToEnd(
      {chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
       "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
       "--user-data-dir=" + testing::MakeTempDir("chromium-profile"), "--window-size=960,760",
       "--screenshot=" + png, "file://" + svg},
      {}, std::chrono::seconds(90));
  ASSERT_EQ(shot.exit_code, 0) << shot.err;
  const testing::Image image = testing::DecodePng(ReadFile(png));
  EXPECT_EQ(image.width, 960);
  EXPECT_EQ(image.height, 760);
  // A drawn curve is a 2-pixel line across most of the plot: hundreds of
  // pixels of its colour (anti-aliasing blends the edges, so the count uses
  // a small tolerance). The legend swatches alone are about 60.
  const int64_t loss = image.CountColor(testing::ParseHexColor(trainer::kTrainLossColor), 12);
  const int64_t accuracy = image.CountColor(testing::ParseHexColor(trainer::kAccuracyColor), 12);
  EXPECT_GT(loss, 600) << "training-loss curve not visible";
  EXPECT_GT(accuracy, 600) << "accuracy curve not visible";
  // Mostly white page: the chart, not an error page, was rendered.
  EXPECT_GT(image.CountColor(0xffffff, 8), image.width * image.height / 2);
}

// The test loss of the last evaluation row of `dir`/metrics.csv (NaN: none).
double LastTestLoss(const std::string& dir) {
  const std::vector<std::string> csv = Lines(ReadFile(dir + "/metrics.csv"));
  for (auto it = csv.rbegin(); it != csv.rend(); ++it) {
    std::smatch m;
    if (std::regex_match(*it, m, std::regex(R"(\d+,\d+,,,,([0-9.e+-]+),[0-9.]+)"))) return std::stod(m[1]);
  }
  return NAN;
}

// Without --sync_bn each rank's BatchNorm running statistics follow its own
// batches. The test loss of 2 ranks, each scoring its half of the test set,
// must be that of rank 0's model, the one saved, which a resumed run scores
// on one rank: every rank evaluates with rank 0's statistics. (With its own,
// this run's loss was off by 0.4%, with 64 test samples as with these 16.)
TEST(TrainRunTest, EveryRankEvaluatesWithRankZerosBatchNormStatistics) {
  const std::string dir = testing::MakeTempDir("bn_eval");
  // Batches of 2 make the ranks' statistics differ clearly.
  const std::vector<std::string> args = {
      Runfile("examples/train"), "--dataset=synthetic", "--model=resnet18", "--train_samples=32",
      "--test_samples=16",       "--batch_size=2",      "--max_steps=3",      "--workers=0",
      "--checkpoint=" + dir + "/ckpt.safetensors"};
  std::vector<std::string> two = args;
  two.push_back("--log_dir=" + dir + "/two");
  const RunOutput trained = RunToEnd(two);
  ASSERT_EQ(trained.exit_code, 0) << trained.out << trained.err;
  std::vector<std::string> one = args;
  one.insert(one.end(), {"--log_dir=" + dir + "/one", "--resume", "--nproc_per_node=1"});
  const RunOutput scored = RunToEnd(one);
  ASSERT_EQ(scored.exit_code, 0) << scored.out << scored.err;
  const double two_ranks = LastTestLoss(dir + "/two");
  const double one_rank = LastTestLoss(dir + "/one");
  ASSERT_FALSE(std::isnan(two_ranks)) << ReadFile(dir + "/two/metrics.csv");
  ASSERT_FALSE(std::isnan(one_rank)) << ReadFile(dir + "/one/metrics.csv");
  // metrics.csv has 6 digits; other batch sizes may round differently.
  EXPECT_NEAR(two_ranks, one_rank, 1e-4 * one_rank);
}

// A 2-rank run's checkpoint after its first epoch, resumed on 1 rank, which
// takes twice the steps per epoch: the cosine schedule still ends at 0 with
// the run (it used to end 4 steps past it), and RESULT counts 2 epochs (it
// divided all steps by 1 rank's steps per epoch: 1.50).
TEST(TrainRunTest, ResumedOnFewerRanksTheScheduleEndsWithTheRun) {
  const std::string dir = testing::MakeTempDir("fewer_ranks");
  const std::string ckpt = dir + "/ckpt.safetensors";
  // 2 epochs of 4 steps on 2 ranks, of 8 on 1.
  const std::vector<std::string> args = {
      Runfile("examples/train"), "--dataset=synthetic", "--model=mlp", "--train_samples=256",
      "--test_samples=64",       "--batch_size=32",     "--workers=0", "--checkpoint=" + ckpt};
  const RunOutput two = RunToEnd(args);
  ASSERT_EQ(two.exit_code, 0) << two.out << two.err;
  // As if stopped after epoch 1 (too short a run to stop reliably there).
  nn::io::Checkpoint c = nn::io::LoadCheckpoint(ckpt);
  ASSERT_EQ(c.metadata.at("step"), "8");
  c.metadata["epoch"] = "1";
  c.metadata["batch_in_epoch"] = "0";
  c.metadata["step"] = "4";
  c.metadata["epoch_loss_sum"] = "0";
  c.metadata["epoch_loss_count"] = "0";
  bool found = false;
  for (auto& [name, t] : c.optimizer) {
    if (name == "scheduler.step") {
      t = nn::FromVectorOf<int64_t>({4}, {});
      found = true;
    }
  }
  ASSERT_TRUE(found);
  nn::io::SaveCheckpoint(ckpt, c);

  std::vector<std::string> one = args;
  one.insert(one.end(), {"--resume", "--nproc_per_node=1", "--log_dir=" + dir + "/logs", "--log_every=1"});
  const RunOutput r = RunToEnd(one);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("  note: the cosine schedule now ends at step 12, where this run ends "
                       "(after --epochs=2 at 8 steps per epoch), instead of the checkpoint's step 8"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("RESULT model=mlp ranks=1 epochs=2 "), std::string::npos) << r.out;
  // The learning rate each step trained with (a row per step): the last
  // step, 12, trains at the cosine's value one step before its end, where
  // the rate reaches 0; a schedule 4 steps too long would still be at 0.011.
  std::string last_step_row, last_lr;
  for (const std::string& row : Lines(ReadFile(dir + "/logs/metrics.csv"))) {
    std::smatch m;
    if (std::regex_match(row, m, std::regex(R"(\d+,\d+,[^,]+,([^,]+),[^,]+,,)"))) {
      last_step_row = row;
      last_lr = m[1];
    }
  }
  ASSERT_FALSE(last_step_row.empty());
  EXPECT_EQ(last_step_row.rfind("12,2,", 0), 0u) << last_step_row;
  EXPECT_NEAR(std::stod(last_lr), 0.05 * (1 + std::cos(M_PI * 11 / 12)) / 2, 1e-8) << last_step_row;
}

// A checkpoint saved before runs had an identity, resumed twice (the first
// resume stopped before its first save, so the second starts from the same
// file): both resumes continue the run's metrics.csv. A new identity made
// at each resume set the run's own rows aside as another run's.
TEST(TrainRunTest, AnOlderCheckpointResumedTwiceContinuesItsRunsMetrics) {
  const std::string dir = testing::MakeTempDir("older_run_id");
  const std::string ckpt = dir + "/ckpt.safetensors";
  const std::string logs = dir + "/logs";
  // 8 steps per epoch on 1 rank, no schedule to move.
  const std::vector<std::string> args = {
      Runfile("examples/train"), "--dataset=synthetic", "--model=mlp",   "--train_samples=256",
      "--test_samples=64",       "--batch_size=32",     "--workers=0",   "--nproc_per_node=1",
      "--scheduler=none",        "--log_every=1",       "--checkpoint=" + ckpt, "--log_dir=" + logs};
  std::vector<std::string> first = args;
  first.push_back("--epochs=1");
  const RunOutput trained = RunToEnd(first);
  ASSERT_EQ(trained.exit_code, 0) << trained.out << trained.err;
  // As an older trainer left them: no identity in the checkpoint, no
  // metrics.run beside the rows.
  nn::io::Checkpoint c = nn::io::LoadCheckpoint(ckpt);
  ASSERT_EQ(c.metadata.erase("run"), 1u);
  nn::io::SaveCheckpoint(ckpt, c);
  const std::string older = dir + "/older.safetensors";
  std::filesystem::copy_file(ckpt, older);
  std::filesystem::remove(logs + "/metrics.run");
  std::vector<std::string> resumed = args;
  resumed.insert(resumed.end(), {"--epochs=2", "--resume"});
  for (int resume = 0; resume < 2; ++resume) {
    // The second resume starts from the older file again.
    if (resume == 1) std::filesystem::copy_file(older, ckpt, std::filesystem::copy_options::overwrite_existing);
    const RunOutput r = RunToEnd(resumed);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_EQ(r.out.find("another run"), std::string::npos) << "resume " << resume << ": " << r.out;
    EXPECT_FALSE(std::filesystem::exists(logs + "/metrics.prev.csv")) << "resume " << resume;
    // The first epoch's rows are still there.
    const std::string rows = ReadFile(logs + "/metrics.csv");
    EXPECT_NE(rows.find("\n1,1,"), std::string::npos) << "resume " << resume << ": " << rows;
  }
}

// A signal during the evaluation at an epoch end (or at a multiple of
// --eval_every) stops the run after the checkpoint of that step was saved
// and before the evaluation's row was written. The resumed run starts past
// that step; it evaluates there first, so metrics.csv holds every
// evaluation once. The interrupted evaluation is made here by dropping its
// row, as a signal there leaves the files.
TEST(TrainRunTest, ResumeMakesTheEvaluationASignalCutShort) {
  const std::string dir = testing::MakeTempDir("missed_eval");
  // 8 steps per epoch on 2 ranks; evaluations at the epoch ends only.
  std::vector<std::string> args = {
      Runfile("examples/train"), "--dataset=synthetic", "--model=mlp", "--train_samples=512",
      "--test_samples=64",       "--batch_size=32",     "--workers=0", "--log_every=4",
      "--scheduler=none",  // a schedule would tie the checkpoint to --epochs=1
      "--checkpoint=" + dir + "/ckpt.safetensors", "--log_dir=" + dir + "/logs"};
  std::vector<std::string> first = args;
  first.push_back("--epochs=1");
  const RunOutput one = RunToEnd(first);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  const std::string csv_path = dir + "/logs/metrics.csv";
  std::string kept;
  int dropped = 0;
  for (const std::string& row : Lines(ReadFile(csv_path))) {
    if (row.rfind("8,1,,,,", 0) == 0) {
      ++dropped;
      continue;
    }
    kept += row + "\n";
  }
  ASSERT_EQ(dropped, 1) << ReadFile(csv_path);
  {
    std::ofstream out(csv_path, std::ios::trunc);
    out << kept;
  }

  std::vector<std::string> resumed = args;
  resumed.insert(resumed.end(), {"--epochs=2", "--resume"});
  const RunOutput r = RunToEnd(resumed);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(std::regex_search(
      r.out, std::regex(R"(  evaluated at step 8 \(epoch 1\), missing from the metrics: test loss \d+\.\d{4}  test acc \d+\.\d\d%)")))
      << r.out;
  std::vector<std::string> evals;
  for (const std::string& row : Lines(ReadFile(csv_path))) {
    if (std::regex_match(row, std::regex(R"(\d+,\d+,,,,[^,]+,[^,]+)"))) evals.push_back(row.substr(0, row.find(",,")));
  }
  EXPECT_EQ(evals, (std::vector<std::string>{"8,1", "16,2"})) << ReadFile(csv_path);

  // Resumed again at the end: the evaluation at step 16 is logged, so it is
  // reported but not written twice.
  const RunOutput again = RunToEnd(resumed);
  ASSERT_EQ(again.exit_code, 0) << again.out << again.err;
  EXPECT_EQ(again.out.find("missing from the metrics"), std::string::npos) << again.out;
  evals.clear();
  for (const std::string& row : Lines(ReadFile(csv_path))) {
    if (std::regex_match(row, std::regex(R"(\d+,\d+,,,,[^,]+,[^,]+)"))) evals.push_back(row.substr(0, row.find(",,")));
  }
  EXPECT_EQ(evals, (std::vector<std::string>{"8,1", "16,2"})) << ReadFile(csv_path);
}

// Without --log_dir nothing says whether the run before finished the
// evaluation at its checkpoint's step: the resumed run makes it again
// rather than perhaps never, and says why.
TEST(TrainRunTest, ResumeWithoutALogMakesTheEvaluationAtTheCheckpointAgain) {
  const std::string dir = testing::MakeTempDir("missed_eval_no_log");
  std::vector<std::string> args = {
      Runfile("examples/train"), "--dataset=synthetic", "--model=mlp", "--train_samples=512",
      "--test_samples=64",       "--batch_size=32",     "--workers=0",
      "--scheduler=none", "--checkpoint=" + dir + "/ckpt.safetensors"};
  std::vector<std::string> first = args;
  first.push_back("--epochs=1");
  const RunOutput one = RunToEnd(first);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  std::vector<std::string> resumed = args;
  resumed.insert(resumed.end(), {"--epochs=2", "--resume"});
  const RunOutput r = RunToEnd(resumed);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(std::regex_search(
      r.out, std::regex(R"(  evaluated at step 8 \(epoch 1\), where the run before was to evaluate \(no --log_dir says whether it did\): test loss \d+\.\d{4}  test acc \d+\.\d\d%)")))
      << r.out;
  EXPECT_NE(r.out.find("epoch 2/2"), std::string::npos) << r.out;
}

// --eval_every's evaluations inside an epoch were only written to
// metrics.csv: without --log_dir they were made (every rank stopping for
// them) and shown nowhere. Each now prints a line; the epoch's end keeps
// its own line.
TEST(TrainRunTest, EvaluationsInsideAnEpochPrintALineWithoutALog) {
  const std::string dir = testing::MakeTempDir("eval_every_no_log");
  const RunOutput r = RunToEnd({Runfile("examples/train"), "--dataset=synthetic", "--model=mlp",
                                "--train_samples=1024", "--test_samples=256", "--batch_size=32", "--workers=0",
                                "--eval_every=4", "--epochs=2", "--checkpoint=none"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // 16 steps per epoch: steps 4, 8, 12 of the first, 20, 24, 28 of the second.
  std::vector<std::string> steps;
  for (const std::string& l : Lines(r.out)) {
    std::smatch m;
    if (std::regex_match(l, m, std::regex(R"(  step (\d+) \(epoch ([12])/2\)  test loss \d+\.\d{4}  test acc \d+\.\d\d%)"))) {
      steps.push_back(m[1].str() + "/" + m[2].str());
    }
  }
  EXPECT_EQ(steps, (std::vector<std::string>{"4/1", "8/1", "12/1", "20/2", "24/2", "28/2"})) << r.out;
  const std::regex epoch_line(
      R"(epoch [12]/2  train loss \d+\.\d{4}  test loss \d+\.\d{4}  test acc \d+\.\d\d%  \d+\.\ds)");
  int epoch_lines = 0;
  for (const std::string& l : Lines(r.out)) epoch_lines += std::regex_match(l, epoch_line);
  EXPECT_EQ(epoch_lines, 2) << r.out;
}

// `--resume` after a run that had finished (the README's next command
// after the default run) trained nothing and said only "resumed at epoch 2"
// of a 1-epoch run, then "- samples/s": a note says the run had ended and
// what would train more, which depends on whether the schedule ends with
// the run.
TEST(TrainRunTest, ResumingARunThatHadEndedSaysSoAndHowToTrainMore) {
  const std::string dir = testing::MakeTempDir("resume_ended");
  const std::vector<std::string> args = {
      Runfile("examples/train"), "--dataset=synthetic", "--model=mlp", "--train_samples=512",
      "--test_samples=64",       "--batch_size=32",     "--workers=0", "--epochs=1"};
  std::vector<std::string> cosine = args;
  cosine.push_back("--checkpoint=" + dir + "/cosine.safetensors");
  ASSERT_EQ(RunToEnd(cosine).exit_code, 0);
  cosine.push_back("--resume");
  const RunOutput again = RunToEnd(cosine);
  ASSERT_EQ(again.exit_code, 0) << again.out << again.err;
  EXPECT_NE(again.out.find("\n  note: nothing is left to train: the checkpoint is already where --epochs=1 "
                           "ends the run; its --scheduler=cosine schedule ended there too, so to train more "
                           "start a new run, without --resume\n"),
            std::string::npos)
      << again.out;

  std::vector<std::string> flat = args;
  flat.insert(flat.end(), {"--scheduler=none", "--checkpoint=" + dir + "/flat.safetensors"});
  std::vector<std::string> first = flat;
  first.push_back("--max_steps=4");
  ASSERT_EQ(RunToEnd(first).exit_code, 0);
  first.push_back("--resume");
  const RunOutput stopped = RunToEnd(first);
  ASSERT_EQ(stopped.exit_code, 0) << stopped.out << stopped.err;
  EXPECT_NE(stopped.out.find("\n  note: nothing is left to train: the checkpoint is already where --max_steps=4 "
                             "ends the run; pass a larger --epochs or --max_steps to train on\n"),
            std::string::npos)
      << stopped.out;
  // As the note says: a larger --max_steps trains on, and says nothing of an end.
  flat.insert(flat.end(), {"--max_steps=8", "--resume"});
  const RunOutput more = RunToEnd(flat);
  ASSERT_EQ(more.exit_code, 0) << more.out << more.err;
  EXPECT_NE(more.out.find("epoch 1/1  train loss"), std::string::npos) << more.out;
  EXPECT_EQ(more.out.find("nothing is left to train"), std::string::npos) << more.out;
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// Two ranks started as ddprun (or a torchrun-style script) starts them: one
// process each with the launch variables set (and `env`), on a free port;
// `args(rank)` is each rank's command line.
std::vector<std::unique_ptr<testing::Subprocess>> LaunchTwoRanks(
    const std::function<std::vector<std::string>(int)>& args,
    const std::vector<std::pair<std::string, std::string>>& env = {}) {
  const std::string port = std::to_string(FreePort());
  std::vector<std::unique_ptr<testing::Subprocess>> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<std::pair<std::string, std::string>> rank_env = {
        {"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}};
    rank_env.insert(rank_env.end(), env.begin(), env.end());
    ranks.push_back(std::make_unique<testing::Subprocess>(args(rank), rank_env));
  }
  return ranks;
}

TEST(TrainRunTest, RunsAsOneRankOfALaunchedJob) {
  // What ddprun (or torchrun-style scripts) do: one process per rank with
  // the launch variables set; the trainer then starts nothing itself.
  const std::string dir = testing::MakeTempDir("launched");
  auto ranks = LaunchTwoRanks([&](int) {
    std::vector<std::string> args = QuickRun(dir);
    args.push_back("--epochs=1");
    // Under a launcher it must agree with the launch (2 ranks on one node);
    // one that does not is refused (train_cli_test).
    args.push_back("--nproc_per_node=2");
    return args;
  });
  for (auto& p : ranks) EXPECT_EQ(p->Wait(std::chrono::seconds(120)), 0) << p->Stderr();
  EXPECT_NE(ranks[0]->Stdout().find("RESULT model=mlp ranks=2 epochs=1 "), std::string::npos)
      << ranks[0]->Stdout();
  EXPECT_EQ(ranks[1]->Stdout(), "") << "only rank 0 talks";
}

// Under a launcher each rank parses its own command line: one started with
// another flag (a wrapper script adding --train_samples=$((1000 + RANK)))
// stops every rank at once, itself naming the flag and both values,
// instead of training apart or waiting in mismatched collectives.
TEST(TrainRunTest, RanksStartedWithOtherFlagsStopNamingTheFlag) {
  const std::string dir = testing::MakeTempDir("disagree");
  auto ranks = LaunchTwoRanks([&](int rank) {
    std::vector<std::string> args = QuickRun(dir);
    args.push_back("--timeout_s=600");  // a hang would show as the test's timeout
    if (rank == 1) args.push_back("--train_samples=1100");
    return args;
  });
  for (auto& p : ranks) EXPECT_EQ(p->Wait(std::chrono::seconds(60)), 2) << p->Stderr();
  // The rank is named once, by the line's prefix: it read "rank 1: rank 1
  // was started with".
  EXPECT_NE(ranks[1]->Stderr().find("train: rank 1: started with --train_samples=1100 but rank 0 with "
                                    "--train_samples=1024; every rank needs the same flags and data\n"),
            std::string::npos)
      << ranks[1]->Stderr();
  EXPECT_NE(ranks[0]->Stderr().find("1 rank(s) were started with other flags or data than rank 0"),
            std::string::npos)
      << ranks[0]->Stderr();

  // Flags set per process or for the saves, which the comparison missed:
  // the ranks trained on, each with its own.
  for (const auto& [flag, rank_0] :
       std::vector<std::pair<std::string, std::string>>{{"--flush_denormal=false", "--flush_denormal=true"},
                                                        {"--save_timeout_s=600", "--save_timeout_s=1800"},
                                                        {"--save_stop_grace_s=5", "--save_stop_grace_s=60"}}) {
    auto others = LaunchTwoRanks([&](int rank) {
      std::vector<std::string> args = QuickRun(dir);
      args.push_back("--timeout_s=600");
      if (rank == 1) args.push_back(flag);
      return args;
    });
    for (auto& p : others) EXPECT_EQ(p->Wait(std::chrono::seconds(60)), 2) << flag << p->Stderr();
    EXPECT_NE(others[1]->Stderr().find("train: rank 1: started with " + flag + " but rank 0 with " + rank_0 +
                                       "; every rank needs the same flags and data\n"),
              std::string::npos)
        << others[1]->Stderr();
  }
}

// What a rank other than 0 prints when it stops with rank 0's failure (a
// checkpoint rank 0 cannot read or write): rank 0's line gives the reason,
// once; every rank used to print it again, as a torchrun user does not see
// from their workers.
const char kStoppedWithRankZero[] = "train: rank 1: stopped with rank 0, whose output gives the reason\n";

// torchrun restarts a failed job with TORCHELASTIC_RESTART_COUNT raised and
// the same TORCHELASTIC_RUN_ID: the trainer resumes from the checkpoint that
// run saved, and starts over from another run's (another rendezvous id) or
// where there is no id to tell runs apart (torchrun's "none").
TEST(TrainRunTest, ResumesAfterATorchrunRestartOfTheSameRun) {
  const std::string dir = testing::MakeTempDir("torchrun");
  auto run = [&](const std::string& run_id, int restart, const std::string& extra_flag) {
    auto ranks = LaunchTwoRanks(
        [&](int) {
          std::vector<std::string> args = QuickRun(dir);
          args.push_back("--epochs=2");
          if (!extra_flag.empty()) args.push_back(extra_flag);
          return args;
        },
        {{"TORCHELASTIC_RUN_ID", run_id}, {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)}});
    for (auto& p : ranks) EXPECT_EQ(p->Wait(std::chrono::seconds(120)), 0) << p->Stderr();
    return ranks[0]->Stdout();
  };
  // The first attempt of run job-a trains and saves (and, say, a rank then
  // fails on its way out).
  std::string out = run("job-a", 0, "");
  EXPECT_EQ(out.find("of the job"), std::string::npos) << out;
  EXPECT_NE(out.find("epoch 2/2"), std::string::npos) << out;
  // Its restart continues from the checkpoint: nothing is trained again.
  out = run("job-a", 1, "");
  EXPECT_NE(out.find("restart 1 of the job: resuming from this run's checkpoint " + dir +
                     "/ckpt.safetensors"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find(", step 32 ("), std::string::npos) << out;
  EXPECT_EQ(out.find("epoch 1/2"), std::string::npos) << "trained again: " << out;
  // Another run's restart leaves job-a's checkpoint alone and starts over.
  out = run("job-b", 1, "");
  EXPECT_NE(out.find("is from another run; starting over"), std::string::npos) << out;
  EXPECT_NE(out.find("epoch 1/2"), std::string::npos) << out;
  out = run("none", 1, "");
  EXPECT_NE(out.find("this job has no name"), std::string::npos) << out;
  EXPECT_NE(out.find("epoch 1/2"), std::string::npos) << out;
}

// Runs `args` with stdout into a pipe whose read end is closed before it
// starts (a `| tee log` that Ctrl-C ended) and stderr into `err_path`, with
// SIGPIPE's default action, as a shell starts it. Returns the exit status
// (128 + signal when killed by one), or -1 when it ran past 120 s.
int RunIntoClosedPipe(const std::vector<std::string>& args, const std::string& err_path) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return -2;
  close(fds[0]);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int started = posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(fds[1]);
  if (started != 0) return -2;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);  // its ranks die with it (PR_SET_PDEATHSIG)
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

// `train ... | tee log`, and Ctrl-C ended tee too: rank 0's output has no
// reader. It used to die of SIGPIPE at its first line, before any save;
// now its writes fail, it stops printing, and it trains, saves and ends
// as without the pipe.
TEST(TrainRunTest, OutputIntoAPipeWithoutAReaderStillTrainsAndSaves) {
  const std::string dir = testing::MakeTempDir("closed_pipe");
  std::vector<std::string> args = QuickRun(dir);
  args.push_back("--epochs=1");
  const std::string err_path = dir + "/stderr.txt";
  const int code = RunIntoClosedPipe(args, err_path);
  EXPECT_EQ(code, 0) << ReadFile(err_path);
  const nn::io::Checkpoint saved = nn::io::LoadCheckpoint(dir + "/ckpt.safetensors");
  EXPECT_EQ(saved.metadata.at("step"), "16");
}

// A restart finds the job's checkpoint there but cannot read its header
// (here cut short; in life also EIO, ESTALE): whose it is cannot be told,
// and it may be the job's own good one. The restart stops every rank,
// naming the file and the reason, and leaves it as it is; it used to start
// over and replace it at its first save. A file whose header says it is
// the job's but whose data is damaged is refused by the resume, and left
// as it is too.
TEST(TrainRunTest, RestartWithAnUnreadableCheckpointStopsAndKeepsIt) {
  const std::string dir = testing::MakeTempDir("restart_unreadable");
  const std::string ckpt = dir + "/ckpt.safetensors";
  auto run = [&](int restart) {
    return LaunchTwoRanks(
        [&](int) {
          std::vector<std::string> args = QuickRun(dir);
          args.push_back("--epochs=1");
          return args;
        },
        {{"TORCHELASTIC_RUN_ID", "job-a"}, {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)}});
  };
  for (auto& p : run(0)) ASSERT_EQ(p->Wait(std::chrono::seconds(120)), 0) << p->Stderr();
  const std::string whole = ReadFile(ckpt);
  ASSERT_GT(whole.size(), 1000u);
  const std::pair<size_t, std::string> cases[] = {
      {100, "restart 1 of the job: cannot read the checkpoint at " + ckpt + " (" + ckpt + ": "},
      {whole.size() / 2, "--resume: " + ckpt + ": invalid safetensors file: "},
  };
  for (const auto& [size, message] : cases) {
    std::filesystem::resize_file(ckpt, size);
    const std::string cut = ReadFile(ckpt);
    auto ranks = run(1);
    for (int rank = 0; rank < 2; ++rank) {
      testing::Subprocess& p = *ranks[rank];
      EXPECT_EQ(p.Wait(std::chrono::seconds(120)), 2) << p.Stdout() << p.Stderr();
      EXPECT_EQ(p.Stdout().find("epoch 1/1"), std::string::npos) << "it trained: " << p.Stdout();
    }
    // Rank 0's reason, said by rank 0; rank 1 points at it.
    EXPECT_NE(ranks[0]->Stderr().find(message), std::string::npos) << ranks[0]->Stderr();
    EXPECT_EQ(ranks[1]->Stderr(), kStoppedWithRankZero) << ranks[1]->Stderr();
    EXPECT_TRUE(ReadFile(ckpt) == cut) << "the checkpoint cut to " << size << " bytes was replaced";
    std::ofstream(ckpt, std::ios::binary | std::ios::trunc) << whole;
  }
}

// Under a launcher no CheckSetup runs before the ranks start: rank 0 checks
// the paths it writes at setup, and every rank stops with its message
// before training (not rank 0 alone at the first save, an epoch later).
TEST(TrainRunTest, UnwritableCheckpointStopsEveryLaunchedRankBeforeTraining) {
  const std::string dir = testing::MakeTempDir("launched_unwritable");
  const std::string port = std::to_string(FreePort());
  std::vector<std::unique_ptr<testing::Subprocess>> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<std::string> args = QuickRun(dir);
    args.push_back("--epochs=1");
    args.push_back("--checkpoint=/proc/self/ckpt.safetensors");
    ranks.push_back(std::make_unique<testing::Subprocess>(
        args, std::vector<std::pair<std::string, std::string>>{{"RANK", std::to_string(rank)},
                                                               {"WORLD_SIZE", "2"},
                                                               {"MASTER_ADDR", "127.0.0.1"},
                                                               {"MASTER_PORT", port}}));
  }
  const std::string message =
      "cannot write --checkpoint=/proc/self/ckpt.safetensors (folder /proc/self: not writable (No such file or "
      "directory)); "
      "choose a writable path, or --checkpoint=none";
  for (int rank = 0; rank < 2; ++rank) {
    testing::Subprocess& p = *ranks[rank];
    EXPECT_EQ(p.Wait(std::chrono::seconds(120)), 2) << p.Stdout() << p.Stderr();
    EXPECT_EQ(p.Stderr(), rank == 0 ? "train: " + message + "\n" : kStoppedWithRankZero);
    EXPECT_EQ(p.Stdout().find("epoch 1/1"), std::string::npos) << "it trained: " << p.Stdout();
  }
}

// --trace writes each rank's file into its own --log_dir (on its own host)
// when the rank ends. A folder that rank cannot write is found at setup, and
// every rank stops before training, naming the rank and --trace, instead of
// training the whole run and failing at the end.
TEST(TrainRunTest, UnwritableTraceFolderOnOneRankStopsEveryRankBeforeTraining) {
  const std::string dir = testing::MakeTempDir("launched_trace");
  auto ranks = LaunchTwoRanks([&](int rank) {
    std::vector<std::string> args = QuickRun(dir);
    for (std::string& arg : args) {
      if (rank == 1 && arg.rfind("--log_dir=", 0) == 0) arg = "--log_dir=/proc/self/logs";
    }
    args.push_back("--epochs=1");
    args.push_back("--trace");
    args.push_back("--timeout_s=600");  // a hang would show as the test's timeout
    return args;
  });
  const std::string message =
      "--trace cannot write this rank's trace into --log_dir=/proc/self/logs (folder "
      "/proc/self/logs: ";
  for (int rank = 0; rank < 2; ++rank) {
    testing::Subprocess& p = *ranks[rank];
    EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 2) << p.Stdout() << p.Stderr();
    const std::string start = rank == 1 ? "train: rank 1: " : "train: rank 1 cannot go on: ";
    EXPECT_EQ(p.Stderr().rfind(start + message, 0), 0u) << p.Stderr();
    EXPECT_NE(p.Stderr().find("); pass a writable --log_dir, or drop --trace\n"), std::string::npos)
        << p.Stderr();
    EXPECT_EQ(p.Stdout().find("epoch 1/1"), std::string::npos) << "it trained: " << p.Stdout();
  }
}

}  // namespace
}  // namespace ddp::examples
