// A training run interrupted by a checkpoint and resumed in a fresh model,
// optimizer, scheduler and loader continues exactly as the uninterrupted run:
// the pieces the trainer's --resume puts together (nn/data, nn/optim,
// nn/io, nn/modules), on real Fashion-MNIST batches.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <memory>

#include "nn/autograd/engine.h"
#include "nn/data/data_loader.h"
#include "nn/data/idx.h"
#include "nn/io/checkpoint.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/generator.h"

namespace ddp::nn::io {
namespace {

using ::testing::HasSubstr;

std::string TmpPath(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return std::string(base ? base : "/tmp") + "/" + std::to_string(getpid()) + "_" + name;
}

std::shared_ptr<const data::Dataset> Train() {
  static auto ds = data::LoadFashionMnist(data::kFashionMnistDebianDir, data::Split::kTrain);
  return ds;
}

struct Trainer {
  std::shared_ptr<modules::Module> model;
  std::unique_ptr<optim::Sgd> opt;
  std::unique_ptr<optim::LrScheduler> sched;
  std::unique_ptr<data::DataLoader> loader;

  explicit Trainer(uint64_t init_seed) {
    Generator gen(init_seed);
    model = modules::MakeMlp(gen);
    opt = std::make_unique<optim::Sgd>(model->NamedParameters(),
                                       optim::SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4});
    sched = std::make_unique<optim::LrScheduler>(*opt, optim::StepSchedule(4, 0.5));
    loader = std::make_unique<data::DataLoader>(
        Train(), std::make_shared<data::DistributedSampler>(Train()->Size(), data::DistributedSamplerOptions{2, 1, true, 3, false}),
        data::FashionMnistNormalize(), data::DataLoaderOptions{.batch_size = 64, .num_workers = 1});
  }

  // Trains `steps` batches; returns the losses.
  std::vector<double> Steps(int steps) {
    std::vector<double> losses;
    for (int i = 0; i < steps; ++i) {
      auto batch = loader->Next();
      EXPECT_TRUE(batch.has_value());
      model->ZeroGrad();
      Tensor loss = loss::CrossEntropy(model->Forward(batch->images), batch->labels);
      Backward(loss);
      opt->Step();
      sched->Step();
      losses.push_back(loss.Item());
    }
    return losses;
  }

  std::vector<std::vector<uint8_t>> ParamBytes() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& [n, p] : model->NamedParameters()) {
      const auto* b = static_cast<const uint8_t*>(p.data_ptr());
      out.emplace_back(b, b + p.nbytes());
    }
    return out;
  }
};

Checkpoint Capture(const Trainer& r, int64_t epoch, int64_t step) {
  Checkpoint c;
  c.model = r.model->GetStateDict();
  c.optimizer = r.opt->StateDict();
  for (auto& kv : r.sched->StateDict()) c.optimizer.push_back(kv);
  c.metadata = {{"epoch", std::to_string(epoch)}, {"step", std::to_string(step)}};
  return c;
}

TEST(CheckpointResume, ResumedRunMatchesTheUninterruptedOne) {
  const std::string path = TmpPath("resume.safetensors");
  Trainer a(1);
  a.loader->StartEpoch(2);
  const std::vector<double> first = a.Steps(6);
  SaveCheckpoint(path, Capture(a, 2, 6));
  const std::vector<double> rest = a.Steps(6);
  EXPECT_LT(rest.back(), first.front());  // it learns

  Trainer b(99);  // another initialization, replaced by the checkpoint
  Checkpoint c = LoadCheckpoint(path);
  b.model->LoadStateDict(c.model);
  b.opt->LoadStateDict(c.optimizer);
  b.sched->LoadStateDict(c.optimizer);
  b.loader->StartEpoch(MetadataInt(c.metadata, "epoch", path), MetadataInt(c.metadata, "step", path));
  const std::vector<double> resumed = b.Steps(6);
  EXPECT_EQ(resumed, rest);
  EXPECT_EQ(b.ParamBytes(), a.ParamBytes());
  EXPECT_EQ(b.opt->lr(), a.opt->lr());
}

TEST(CheckpointResume, CorruptCheckpointLeavesTheModelUntouched) {
  const std::string path = TmpPath("corrupt.safetensors");
  Trainer a(1);
  SaveCheckpoint(path, Capture(a, 0, 0));
  Trainer b(5);
  const auto before = b.ParamBytes();
  // Flip one byte in the middle of the data: the checksum catches it.
  FILE* f = std::fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::fseek(f, 100000, SEEK_SET);
  const int c = std::fgetc(f);
  std::fseek(f, 100000, SEEK_SET);
  std::fputc(c ^ 0x40, f);
  std::fclose(f);
  try {
    Checkpoint ck = LoadCheckpoint(path);
    b.model->LoadStateDict(ck.model);
    FAIL() << "corrupt checkpoint loaded";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path));
    EXPECT_THAT(e.what(), HasSubstr("checksum"));
  }
  EXPECT_EQ(b.ParamBytes(), before);
}

// Registers the tensor it is given, so that two of them can share one.
class Holder : public modules::Module {
 public:
  explicit Holder(Tensor w) { RegisterParameter("weight", std::move(w)); }
  std::string TypeName() const override { return "Holder"; }
};

class Tied : public modules::Module {
 public:
  explicit Tied(uint64_t seed) {
    Generator gen(seed);
    const Tensor w = Randn({3, 2}, {}, gen);
    RegisterModule("embed", std::make_shared<Holder>(w));
    RegisterModule("head", std::make_shared<Holder>(w));
  }
  std::string TypeName() const override { return "Tied"; }
};

// A tied weight is saved under both names (as torch.save(model.state_dict())
// does) and loads back into a tied model, strictly.
TEST(CheckpointResume, TiedWeightRoundTripsUnderBothNames) {
  Tied a(1), b(2);
  const std::string path = TmpPath("tied.safetensors");
  SaveCheckpoint(path, Checkpoint{.model = a.GetStateDict()});
  const Checkpoint back = LoadCheckpoint(path);
  ASSERT_EQ(back.model.size(), 2u);
  EXPECT_EQ(back.model[0].first, "embed.weight");
  EXPECT_EQ(back.model[1].first, "head.weight");
  b.LoadStateDict(back.model);
  const modules::StateDict sb = b.GetStateDict();
  EXPECT_EQ(sb[0].second.ToVector<float>(), a.GetStateDict()[0].second.ToVector<float>());
  EXPECT_TRUE(sb[0].second.is_same(sb[1].second));
}

TEST(CheckpointResume, CheckpointOfAnotherModelIsRejectedByKey) {
  const std::string path = TmpPath("cnn.safetensors");
  Generator gen(0);
  auto cnn = modules::MakeCnn(gen);
  Checkpoint c;
  c.model = cnn->GetStateDict();
  SaveCheckpoint(path, c);
  Trainer b(5);
  const auto before = b.ParamBytes();
  Checkpoint loaded = LoadCheckpoint(path);
  EXPECT_ANY_THROW(b.model->LoadStateDict(loaded.model));
  EXPECT_EQ(b.ParamBytes(), before);
}

}  // namespace
}  // namespace ddp::nn::io
