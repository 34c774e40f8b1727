#include "examples/trainer/train_state.h"

#include <filesystem>

#include "gtest/gtest.h"
#include "nn/autograd/engine.h"
#include "nn/modules/models.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"

namespace ddp::examples::trainer {
namespace {

std::string Path(const std::string& name) {
  return std::string(std::getenv("TEST_TMPDIR")) + "/ckpt/" + name + ".safetensors";
}

// One SGD step on random data, so that the optimizer has momentum state.
void TrainOneStep(nn::modules::Module& model, nn::optim::Optimizer& opt) {
  nn::Generator gen(7);
  const nn::Tensor x = nn::Randn({4, 1, 28, 28}, {}, gen);
  nn::Backward(nn::ops::Sum(model.Forward(x)));
  opt.Step();
  opt.ZeroGrad();
}

std::string UsageErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(TrainStateTest, RoundTripsModelOptimizerAndPosition) {
  TrainConfig config;
  config.model = "mlp";
  nn::Generator g1(1), g2(2);
  auto model = nn::modules::MakeMlp(g1);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  TrainOneStep(*model, opt);
  TrainPosition pos{.epoch = 1, .batch_in_epoch = 17, .step = 486,
                    .epoch_loss_sum = 1.0 / 3.0, .epoch_loss_count = 34};
  const std::string path = Path("roundtrip");
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, pos, config, 2);

  auto other = nn::modules::MakeMlp(g2);
  nn::optim::Sgd other_opt(other->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  std::string note;
  const TrainPosition back =
      LoadTrainCheckpoint(path, {other.get(), &other_opt, nullptr, nullptr}, config, 2, &note);
  EXPECT_EQ(note, "");
  EXPECT_EQ(back.epoch, 1);
  EXPECT_EQ(back.batch_in_epoch, 17);
  EXPECT_EQ(back.step, 486);
  EXPECT_EQ(back.epoch_loss_sum, 1.0 / 3.0);
  EXPECT_EQ(back.epoch_loss_count, 34);
  const auto a = model->GetStateDict();
  const auto b = other->GetStateDict();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].second.ToVector<float>(), b[i].second.ToVector<float>()) << a[i].first;
  }
  const auto sa = opt.StateDict();
  const auto sb = other_opt.StateDict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].second.ToVector<double>(), sb[i].second.ToVector<double>()) << sa[i].first;
  }
}

TEST(TrainStateTest, AnotherModelGetsTheKeysAndTheFix) {
  TrainConfig mlp_config;
  mlp_config.model = "mlp";
  auto mlp = nn::modules::MakeMlp();
  nn::optim::Sgd opt(mlp->NamedParameters(), {.lr = 0.1});
  const std::string path = Path("mlp");
  SaveTrainCheckpoint(path, {mlp.get(), &opt, nullptr, nullptr}, {}, mlp_config, 1);

  TrainConfig cnn_config;
  auto cnn = nn::modules::MakeCnn();
  const std::string msg =
      UsageErrorOf([&] { CheckCheckpointMatchesModel(path, *cnn, cnn_config); });
  EXPECT_NE(msg.find("checkpoint " + path + " does not match --model=cnn"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("missing keys 0.weight, 0.bias, 7.weight, 7.bias, 9.weight, 9.bias;"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected keys 1.weight, 1.bias, 5.weight, 5.bias;"), std::string::npos) << msg;
  EXPECT_NE(msg.find("different shapes or dtypes 3.weight [256, 512] f32 vs [64, 32, 3, 3] f32"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("it was saved by --model=mlp; pass the same flags"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line";
}

TEST(TrainStateTest, MissingFileSaysHowToCreateIt) {
  auto mlp = nn::modules::MakeMlp();
  TrainConfig c;
  const std::string msg =
      UsageErrorOf([&] { CheckCheckpointMatchesModel(Path("absent"), *mlp, c); });
  EXPECT_NE(msg.find("no checkpoint at"), std::string::npos) << msg;
  EXPECT_NE(msg.find("run once without --resume"), std::string::npos) << msg;
}

TEST(TrainStateTest, AnotherDataOrderContinuesAtTheNextEpoch) {
  TrainConfig config;
  config.model = "mlp";
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  const std::string path = Path("order");
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr},
                      {.epoch = 0, .batch_in_epoch = 5, .step = 5}, config, 2);
  std::string note;
  const TrainPosition pos =
      LoadTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, config, 4, &note);
  EXPECT_EQ(pos.epoch, 1);
  EXPECT_EQ(pos.batch_in_epoch, 0);
  EXPECT_EQ(pos.step, 5);
  EXPECT_NE(note.find("another data order (2 ranks"), std::string::npos) << note;
}

// The same flags over another training set (another --data_dir of the same
// dataset name) is another data order too; an equal size is not.
TEST(TrainStateTest, AnotherTrainingSetSizeContinuesAtTheNextEpoch) {
  TrainConfig config;
  config.model = "mlp";
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  const std::string path = Path("size");
  TrainComponents saved{model.get(), &opt, nullptr, nullptr};
  saved.train_size = 60000;
  SaveTrainCheckpoint(path, saved, {.epoch = 0, .batch_in_epoch = 5, .step = 5}, config, 2);
  for (const int64_t size : {int64_t{10000}, int64_t{60000}}) {
    TrainComponents loading{model.get(), &opt, nullptr, nullptr};
    loading.train_size = size;
    std::string note;
    const TrainPosition pos = LoadTrainCheckpoint(path, loading, config, 2, &note);
    if (size == 60000) {
      EXPECT_EQ(pos.epoch, 0);
      EXPECT_EQ(pos.batch_in_epoch, 5);
      EXPECT_EQ(note, "");
    } else {
      EXPECT_EQ(pos.epoch, 1);
      EXPECT_EQ(pos.batch_in_epoch, 0);
      EXPECT_NE(note.find("60000 training samples"), std::string::npos) << note;
    }
  }
}

// A restarted job resumes from a checkpoint only when this job saved it
// (the default path is shared by every run of a model and dataset).
TEST(TrainStateTest, RestartResumesOnlyFromThisJobsCheckpoint) {
  EXPECT_EQ(JobFingerprint(""), "");
  EXPECT_EQ(JobFingerprint("token-a"), JobFingerprint("token-a"));
  EXPECT_NE(JobFingerprint("token-a"), JobFingerprint("token-b"));
  EXPECT_EQ(JobFingerprint("token-a").find("token"), std::string::npos);

  TrainConfig config;
  config.model = "mlp";
  config.checkpoint = Path("restart");
  config.job = JobFingerprint("token-a");
  std::string note = ResumeAfterRestart(config, 1);
  EXPECT_FALSE(config.resume);
  EXPECT_NE(note.find("restart 1 of the job: no checkpoint at " + config.checkpoint + " yet"),
            std::string::npos) << note;

  nn::Generator g(1);
  auto model = nn::modules::MakeMlp(g);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  SaveTrainCheckpoint(config.checkpoint, {model.get(), &opt, nullptr, nullptr}, {}, config, 2);
  note = ResumeAfterRestart(config, 2);
  EXPECT_TRUE(config.resume) << note;
  EXPECT_NE(note.find("resuming from this run's checkpoint"), std::string::npos) << note;

  config.resume = false;
  config.job = JobFingerprint("token-b");
  note = ResumeAfterRestart(config, 1);
  EXPECT_FALSE(config.resume) << note;
  EXPECT_NE(note.find("is from another run; starting over"), std::string::npos) << note;

  config.checkpoint.clear();
  EXPECT_NE(ResumeAfterRestart(config, 1).find("starting over"), std::string::npos);
  EXPECT_FALSE(config.resume);
}

TEST(TrainStateTest, UnwritableFolderIsAUsageError) {
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  const std::string msg = UsageErrorOf([&] {
    SaveTrainCheckpoint("/proc/no/such/dir/x.safetensors", {model.get(), &opt, nullptr, nullptr},
                        {}, TrainConfig{}, 1);
  });
  EXPECT_NE(msg.find("--checkpoint=PATH somewhere writable"), std::string::npos) << msg;
}

}  // namespace
}  // namespace ddp::examples::trainer
