#include "examples/trainer/zoo.h"

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace ddp::examples::trainer {
namespace {

std::string UsageErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(ZooTest, MissingFashionMnistNamesThePackageAndTheFlag) {
  TrainConfig c;
  c.data_dir = "/nonexistent/fmnist";
  const std::string msg = UsageErrorOf([&] { LoadDatasets(c); });
  EXPECT_NE(msg.find("/nonexistent/fmnist/train-images-idx3-ubyte"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dataset-fashion-mnist"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--data_dir"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos);
}

TEST(ZooTest, CifarWithoutFilesPointsAtSynthetic) {
  TrainConfig c;
  c.model = "resnet18";
  c.dataset = "cifar10";
  EXPECT_NE(UsageErrorOf([&] { LoadDatasets(c); }).find("--dataset=synthetic"),
            std::string::npos);
  c.data_dir = "/nonexistent";
  EXPECT_NE(UsageErrorOf([&] { LoadDatasets(c); }).find("--data_dir"), std::string::npos);
}

// A file at --data_dir (the archive itself, or one of its files) was
// refused as "dataset file not found: looked for FILE/train-images-...",
// with the advice to install the package or unpack the files there. The
// refusal says what --data_dir is instead.
TEST(ZooTest, ADataDirThatIsAFileIsNamedAsOne) {
  const std::string file = std::string(std::getenv("TEST_TMPDIR")) + "/fashion-mnist.tar.gz";
  std::ofstream(file) << "not a folder";
  for (const std::string dataset : {"fashion_mnist", "mnist", "cifar10"}) {
    TrainConfig c;
    c.model = dataset == "cifar10" ? "resnet18" : "mlp";
    c.dataset = dataset;
    c.data_dir = file;
    EXPECT_EQ(UsageErrorOf([&] { LoadDatasets(c); }),
              "--data_dir=" + file + " is a file, not a folder; give the folder that holds --dataset=" +
                  dataset + "'s files")
        << dataset;
  }
}

TEST(ZooTest, SyntheticDataTakesTheModelsShape) {
  TrainConfig c;
  c.dataset = "synthetic";
  c.model = "resnet18";
  Datasets d = LoadDatasets(c);
  EXPECT_EQ(d.train->Shape(), (nn::data::ImageShape{3, 32, 32}));
  EXPECT_EQ(d.train->Size(), 50000);
  EXPECT_EQ(d.test->Size(), 10000);
  EXPECT_TRUE(d.train_transform.random_crop);
  EXPECT_TRUE(d.train_transform.horizontal_flip);
  c.model = "mlp";
  c.train_samples = 100;
  d = LoadDatasets(c);
  EXPECT_EQ(d.train->Shape(), (nn::data::ImageShape{1, 28, 28}));
  EXPECT_EQ(d.train->Size(), 100);
}

// More samples than the set has were quietly the whole set: a run asked
// for 100,000 trained on 50,000.
TEST(ZooTest, MoreSamplesThanTheDatasetHasAreRefused) {
  TrainConfig c;
  c.dataset = "synthetic";
  c.model = "mlp";
  c.train_samples = 50001;
  EXPECT_EQ(UsageErrorOf([&] { LoadDatasets(c); }),
            "--train_samples=50001 is more than the 50,000 training samples synthetic has; use "
            "50000 or less, or 0 for all");
  c.train_samples = 50000;
  c.test_samples = 20000;
  EXPECT_EQ(UsageErrorOf([&] { LoadDatasets(c); }),
            "--test_samples=20000 is more than the 10,000 test samples synthetic has; use 10000 or "
            "less, or 0 for all");
  c.test_samples = 10000;
  const Datasets d = LoadDatasets(c);
  EXPECT_EQ(d.train->Size(), 50000);
  EXPECT_EQ(d.test->Size(), 10000);
}

// Writes an IDX image file of `n` black 28x28 images and an IDX label file
// of `n` zeros as `dir`/`prefix`-images-idx3-ubyte and -labels-idx1-ubyte.
void WriteIdx(const std::string& dir, const std::string& prefix, int n) {
  const auto be32 = [](std::string& out, uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>(v >> shift));
  };
  std::string images, labels;
  be32(images, 0x803);
  be32(images, n);
  be32(images, 28);
  be32(images, 28);
  images.append(static_cast<size_t>(n) * 28 * 28, '\0');
  be32(labels, 0x801);
  be32(labels, n);
  labels.append(static_cast<size_t>(n), '\0');
  std::ofstream(dir + "/" + prefix + "-images-idx3-ubyte", std::ios::binary) << images;
  std::ofstream(dir + "/" + prefix + "-labels-idx1-ubyte", std::ios::binary) << labels;
}

// A set cut by --train_samples / --test_samples is named once, with its own
// count (it read "mnist/train (5 x [1, 28, 28]) (2 x [1, 28, 28])", in
// loader errors and in the check that all ranks have the same settings).
TEST(ZooTest, SamplesFlagsCutSetIsNamedWithItsOwnCount) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/idx_cut";
  std::filesystem::create_directories(dir);
  WriteIdx(dir, "train", 5);
  WriteIdx(dir, "t10k", 3);
  TrainConfig c;
  c.dataset = "mnist";
  c.data_dir = dir;
  Datasets d = LoadDatasets(c);
  EXPECT_EQ(d.train->Name(), "mnist/train (5 x [1, 28, 28])");
  c.train_samples = 2;
  c.test_samples = 1;
  d = LoadDatasets(c);
  EXPECT_EQ(d.train->Name(), "mnist/train (2 x [1, 28, 28])");
  EXPECT_EQ(d.test->Name(), "mnist/test (1 x [1, 28, 28])");
}

TEST(ZooTest, MlpCannotTakeCifarImages) {
  TrainConfig c;
  c.model = "mlp";
  c.dataset = "cifar10";
  const std::string msg = UsageErrorOf([&] { MakeModel(c, {3, 32, 32}, 10); });
  EXPECT_EQ(msg,
            "--model=mlp takes 1x28x28 images in 10 classes and cifar10 has [3, 32, 32]; use a "
            "resnet (resnet18, resnet34, resnet50) for it");
}

TEST(ZooTest, ModelsByName) {
  TrainConfig c;
  c.model = "cnn";
  EXPECT_EQ(CountParameters(*MakeModel(c, {1, 28, 28}, 10)), 225034);
  c.model = "mlp";
  EXPECT_EQ(CountParameters(*MakeModel(c, {1, 28, 28}, 10)), 535818);
  c.model = "resnet18";
  EXPECT_EQ(CountParameters(*MakeModel(c, {3, 32, 32}, 10)), 11173962);
}

TEST(ZooTest, BatchLargerThanTheShardSaysTheLimit) {
  TrainConfig c;
  c.batch_size = 40000;
  const std::string msg = UsageErrorOf([&] { CheckBatchFitsShard(c, 60000, 2); });
  EXPECT_EQ(msg,
            "--batch_size=40000 is larger than the 30,000 training samples each of the 2 ranks "
            "gets (fashion_mnist has 60,000); use --batch_size=30000 or less, or fewer ranks");
  c.batch_size = 30000;
  EXPECT_EQ(UsageErrorOf([&] { CheckBatchFitsShard(c, 60000, 2); }), "");
}

// With --train_samples the run has that many samples, not the dataset's
// all: the refusal said "(fashion_mnist has 1)" for --train_samples=1, and
// "1 training samples each of the 1 ranks".
TEST(ZooTest, BatchLargerThanATrainSamplesShardNamesTheFlag) {
  TrainConfig c;
  c.train_samples = 1;
  EXPECT_EQ(UsageErrorOf([&] { CheckBatchFitsShard(c, 1, 1); }),
            "--batch_size=64 is larger than the 1 training sample each of the 1 rank gets "
            "(--train_samples=1 of fashion_mnist); use --batch_size=1 or less, or a larger "
            "--train_samples");
  c.train_samples = 1000;
  c.batch_size = 600;
  EXPECT_EQ(UsageErrorOf([&] { CheckBatchFitsShard(c, 1000, 2); }),
            "--batch_size=600 is larger than the 500 training samples each of the 2 ranks gets "
            "(--train_samples=1000 of fashion_mnist); use --batch_size=500 or less, fewer ranks, or a "
            "larger --train_samples");
}

}  // namespace
}  // namespace ddp::examples::trainer
