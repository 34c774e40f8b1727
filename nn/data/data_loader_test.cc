#include "nn/data/data_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <system_error>
#include <thread>

#include "nn/data/idx.h"
#include "nn/data/test_files.h"

namespace ddp::nn::data {
namespace {

using ::testing::HasSubstr;
using testing::StderrCapture;

// Waits until done() holds, up to 20 s; returns whether it held.
template <typename F>
bool WaitFor(F done) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

std::shared_ptr<const InMemoryImageDataset> FashionTest() {
  static auto ds = LoadFashionMnist(kFashionMnistDebianDir, Split::kTest);
  return ds;
}

std::vector<float> Floats(const Tensor& t) { return t.ToVector<float>(); }
std::vector<int64_t> Ints(const Tensor& t) { return t.ToVector<int64_t>(); }

struct Collected {
  std::vector<std::vector<float>> images;
  std::vector<std::vector<int64_t>> labels;
  std::vector<int64_t> indices;
};

Collected RunEpoch(DataLoader& loader, int64_t epoch, int64_t skip = 0) {
  Collected c;
  loader.StartEpoch(epoch, skip);
  while (auto b = loader.Next()) {
    c.images.push_back(Floats(b->images));
    c.labels.push_back(Ints(b->labels));
    c.indices.push_back(b->index);
    EXPECT_EQ(b->epoch, epoch);
  }
  return c;
}

TEST(DataLoader, SequentialBatchesOfFashionMnist) {
  auto ds = FashionTest();
  DataLoader loader(ds, nullptr, {}, {.batch_size = 64});
  EXPECT_EQ(loader.NumBatches(), (10000 + 63) / 64);
  loader.StartEpoch(0);
  auto b = loader.Next();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->images.shape(), (Shape{64, 1, 28, 28}));
  EXPECT_EQ(b->images.dtype(), DType::kFloat32);
  EXPECT_EQ(b->labels.shape(), (Shape{64}));
  EXPECT_EQ(b->labels.dtype(), DType::kInt64);
  const auto px = Floats(b->images);
  const auto lb = Ints(b->labels);
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(lb[i], ds->Label(i));
    for (int p = 0; p < 784; p += 97) {
      ASSERT_EQ(px[i * 784 + p], ds->Pixels(i)[p] / 255.0f);
    }
  }
  int64_t batches = 1, samples = 64;
  while (auto next = loader.Next()) {
    ++batches;
    samples += next->labels.size(0);
  }
  EXPECT_EQ(batches, loader.NumBatches());
  EXPECT_EQ(samples, 10000);
  EXPECT_EQ(loader.Next(), std::nullopt);
}

TEST(DataLoader, DropLastDropsTheSmallBatch) {
  DataLoader loader(FashionTest(), nullptr, {}, {.batch_size = 64, .drop_last = true, .num_workers = 2});
  EXPECT_EQ(loader.NumBatches(), 10000 / 64);
  const Collected c = RunEpoch(loader, 0);
  ASSERT_EQ(static_cast<int64_t>(c.labels.size()), 10000 / 64);
  for (const auto& l : c.labels) EXPECT_EQ(l.size(), 64u);
}

TEST(DataLoader, KeepsTheLastSmallBatch) {
  DataLoader loader(FashionTest(), nullptr, {}, {.batch_size = 3000, .num_workers = 2});
  const Collected c = RunEpoch(loader, 0);
  ASSERT_EQ(c.labels.size(), 4u);
  EXPECT_EQ(c.labels[3].size(), 1000u);
}

// Workers never change what comes out: same batches, in the same order, with
// shuffling and random augmentation on.
TEST(DataLoader, WorkerCountDoesNotChangeBatches) {
  auto ds = FashionTest();
  TransformOptions aug = FashionMnistNormalize();
  aug.random_crop = true;
  aug.crop_padding = 2;
  aug.horizontal_flip = true;
  aug.seed = 5;
  std::vector<Collected> runs;
  for (int workers : {0, 1, 3}) {
    DataLoader loader(ds, std::make_shared<RandomSampler>(ds->Size(), 17), aug,
                      {.batch_size = 500, .num_workers = workers, .prefetch_factor = 2});
    Collected both = RunEpoch(loader, 0);
    Collected e1 = RunEpoch(loader, 1);
    both.images.insert(both.images.end(), e1.images.begin(), e1.images.end());
    both.labels.insert(both.labels.end(), e1.labels.begin(), e1.labels.end());
    runs.push_back(std::move(both));
  }
  EXPECT_EQ(runs[0].labels, runs[1].labels);
  EXPECT_EQ(runs[0].labels, runs[2].labels);
  EXPECT_TRUE(runs[0].images == runs[1].images);
  EXPECT_TRUE(runs[0].images == runs[2].images);
  // Epochs are shuffled differently.
  EXPECT_NE(runs[0].labels[0], runs[0].labels[20]);
}

TEST(DataLoader, ResumeMidEpochGivesTheRemainingBatches) {
  auto ds = FashionTest();
  TransformOptions aug;
  aug.horizontal_flip = true;
  aug.seed = 3;
  auto make = [&](int workers) {
    return std::make_unique<DataLoader>(ds, std::make_shared<RandomSampler>(ds->Size(), 9), aug,
                                        DataLoaderOptions{.batch_size = 256, .num_workers = workers});
  };
  auto full_loader = make(2);
  const Collected full = RunEpoch(*full_loader, 4);
  auto resumed_loader = make(3);
  const Collected resumed = RunEpoch(*resumed_loader, 4, 11);
  ASSERT_EQ(resumed.labels.size(), full.labels.size() - 11);
  EXPECT_EQ(resumed.indices.front(), 11);
  for (size_t i = 0; i < resumed.labels.size(); ++i) {
    ASSERT_EQ(resumed.labels[i], full.labels[i + 11]);
    ASSERT_TRUE(resumed.images[i] == full.images[i + 11]);
  }
  EXPECT_THROW(resumed_loader->StartEpoch(0, full.labels.size() + 1), std::invalid_argument);
}

TEST(DataLoader, AbandonedEpochThenANewOne) {
  auto ds = FashionTest();
  DataLoader loader(ds, std::make_shared<RandomSampler>(ds->Size(), 1), {},
                    {.batch_size = 100, .num_workers = 3, .prefetch_factor = 4});
  loader.StartEpoch(0);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(loader.Next().has_value());
  const Collected e1 = RunEpoch(loader, 1);
  DataLoader fresh(ds, std::make_shared<RandomSampler>(ds->Size(), 1), {}, {.batch_size = 100});
  const Collected expect = RunEpoch(fresh, 1);
  EXPECT_EQ(e1.labels, expect.labels);
  EXPECT_EQ(e1.indices.front(), 0);
}

// Sample i's pixels are i in base 256 (low byte first), so a batch says
// which samples it holds.
class IndexDataset : public Dataset {
 public:
  explicit IndexDataset(int64_t size) : size_(size) {}
  int64_t Size() const override { return size_; }
  ImageShape Shape() const override { return {1, 1, 3}; }
  int64_t NumClasses() const override { return 10; }
  void Get(int64_t index, uint8_t* pixels) const override {
    for (int i = 0; i < 3; ++i) pixels[i] = static_cast<uint8_t>(index >> (8 * i));
  }
  int64_t Label(int64_t index) const override { return index % 10; }
  std::string Name() const override { return "index"; }

 private:
  int64_t size_;
};

// The samples of one batch of IndexDataset.
std::vector<int64_t> SampleIndices(const Batch& b) {
  const std::vector<float> px = Floats(b.images);
  std::vector<int64_t> out;
  for (size_t s = 0; s + 3 <= px.size(); s += 3) {
    int64_t index = 0;
    for (int i = 0; i < 3; ++i) index |= static_cast<int64_t>(std::lround(px[s + i] * 255.0f)) << (8 * i);
    out.push_back(index);
  }
  return out;
}

// Three ranks' loaders together deliver every sample of the dataset once,
// plus the two the sampler repeats to pad 10000 to 10002 (the shuffled
// list's first two), each rank in its sampler's order.
TEST(DataLoader, DistributedRanksCoverTheDataset) {
  const int64_t n = 10000;
  auto ds = std::make_shared<IndexDataset>(n);
  std::multiset<int64_t> seen;
  for (int64_t rank = 0; rank < 3; ++rank) {
    auto sampler = std::make_shared<DistributedSampler>(n, DistributedSamplerOptions{3, rank, true, 7, false});
    DataLoader loader(ds, sampler, {}, {.batch_size = 64, .num_workers = 1});
    EXPECT_EQ(loader.NumBatches(), (3334 + 63) / 64);
    std::vector<int64_t> mine;
    loader.StartEpoch(2);
    while (auto b = loader.Next()) {
      const std::vector<int64_t> batch = SampleIndices(*b);
      EXPECT_EQ(Ints(b->labels).size(), batch.size());
      for (size_t i = 0; i < batch.size(); ++i) EXPECT_EQ(Ints(b->labels)[i], batch[i] % 10);
      mine.insert(mine.end(), batch.begin(), batch.end());
    }
    EXPECT_EQ(mine, sampler->Indices()) << "rank " << rank;
    seen.insert(mine.begin(), mine.end());
  }
  const std::vector<int64_t> order = TorchRandperm(n, 7 + 2);
  std::multiset<int64_t> want;
  for (int64_t i = 0; i < n; ++i) want.insert(i);
  want.insert(order[0]);
  want.insert(order[1]);
  EXPECT_EQ(seen.size(), 3u * 3334u);
  EXPECT_TRUE(seen == want) << "the ranks' samples are not the dataset plus the padding";
}

// A dataset whose Get fails or stalls on one index.
class FaultyDataset : public Dataset {
 public:
  FaultyDataset(int64_t bad, std::chrono::milliseconds stall) : bad_(bad), stall_(stall) {}
  int64_t Size() const override { return 100; }
  ImageShape Shape() const override { return {1, 2, 2}; }
  int64_t NumClasses() const override { return 2; }
  void Get(int64_t index, uint8_t* pixels) const override {
    if (index == bad_) {
      if (stall_.count() > 0) {
        stalling_ = true;
        std::this_thread::sleep_for(stall_);
      } else {
        throw DatasetError("faulty: cannot decode sample " + std::to_string(index));
      }
    }
    for (int i = 0; i < 4; ++i) pixels[i] = static_cast<uint8_t>(index);
  }
  int64_t Label(int64_t index) const override { return index % 2; }
  std::string Name() const override { return "faulty"; }
  // Whether a worker has reached the stalling sample.
  bool stalling() const { return stalling_; }

 private:
  int64_t bad_;
  std::chrono::milliseconds stall_;
  mutable std::atomic<bool> stalling_{false};
};

TEST(DataLoader, ErrorInAWorkerReachesTheCaller) {
  for (int workers : {0, 2}) {
    DataLoader loader(std::make_shared<FaultyDataset>(37, std::chrono::milliseconds(0)), nullptr, {},
                      {.batch_size = 10, .num_workers = workers});
    loader.StartEpoch(0);
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(loader.Next().has_value());
    try {
      loader.Next();
      FAIL() << "no error";
    } catch (const DatasetError& e) {
      EXPECT_THAT(e.what(), HasSubstr("cannot decode sample 37"));
      // Where the loader met it, whatever the dataset's message says.
      EXPECT_THAT(e.what(), HasSubstr("faulty sample 37 (batch 3 of epoch 0)"));
    }
    EXPECT_TRUE(loader.Next().has_value());  // batch 4 is fine
  }
}

TEST(DataLoader, StalledWorkerTimesOut) {
  DataLoader loader(std::make_shared<FaultyDataset>(5, std::chrono::milliseconds(1500)), nullptr, {},
                    {.batch_size = 10, .num_workers = 1, .timeout = std::chrono::milliseconds(200)});
  loader.StartEpoch(0);
  try {
    loader.Next();
    FAIL() << "no timeout";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("batch 0 of epoch 0 not ready after 200 ms"));
    EXPECT_THAT(e.what(), HasSubstr("(1 workers reading faulty)"));
  }
  // The stalled worker is not waited for again (see the next test).
}

// A worker stuck in the dataset for good (a read from a hung network
// mount): Next() times out, and the loader's destruction, on the way out
// with that error, leaves the worker behind instead of waiting for it.
TEST(DataLoader, DestructionAfterATimeoutLeavesAStuckWorkerBehind) {
  const auto start = std::chrono::steady_clock::now();
  {
    DataLoader loader(std::make_shared<FaultyDataset>(5, std::chrono::milliseconds(30000)), nullptr, {},
                      {.batch_size = 10, .num_workers = 2, .timeout = std::chrono::milliseconds(200)});
    loader.StartEpoch(0);
    EXPECT_THROW(loader.Next(), std::runtime_error);
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, 10.0) << "the destructor waited for the stuck worker";
}

// After Next() timed out on a batch stuck in the dataset, the destructor
// gives 100 ms only to the worker on that batch: another worker in the
// middle of a slow but healthy batch is waited for and joined, not left
// detached and counted as stuck (the warning named both before).
class StuckAndSlowDataset : public Dataset {
 public:
  int64_t Size() const override { return 40; }
  ImageShape Shape() const override { return {1, 2, 2}; }
  int64_t NumClasses() const override { return 2; }
  void Get(int64_t index, uint8_t* pixels) const override {
    if (index == 5) std::this_thread::sleep_for(std::chrono::seconds(30));  // batch 0: stuck
    if (index == 15) {  // batch 1: slow but healthy, still being built at the loader's destruction
      slow_started = true;
      std::this_thread::sleep_for(std::chrono::seconds(3));
      slow_finished = true;
    }
    for (int i = 0; i < 4; ++i) pixels[i] = static_cast<uint8_t>(index);
  }
  int64_t Label(int64_t index) const override { return index % 2; }
  std::string Name() const override { return "stuck-and-slow"; }
  mutable std::atomic<bool> slow_started{false}, slow_finished{false};
};

TEST(DataLoader, DestructionAfterATimeoutWaitsForTheHealthyWorkers) {
  auto ds = std::make_shared<StuckAndSlowDataset>();
  StderrCapture capture;
  {
    DataLoader loader(ds, nullptr, {},
                      {.batch_size = 10, .num_workers = 2, .prefetch_factor = 1,
                       .timeout = std::chrono::milliseconds(300)});
    loader.StartEpoch(0);
    ASSERT_TRUE(WaitFor([&] { return ds->slow_started.load(); })) << "premise: the second worker is in batch 1";
    EXPECT_THROW(loader.Next(), std::runtime_error);
    ASSERT_FALSE(ds->slow_finished) << "premise: the second worker is still in batch 1 at the destruction";
  }
  const std::string warned = capture.Take();
  EXPECT_THAT(warned, HasSubstr("1 of its workers are still building a batch")) << warned;
}

// A batch delivered after a timeout does not make the stuck worker look
// healthy again: it is still on the batch Next() gave up on, and the
// destructor gives it 100 ms, not the shutdown grace (the successful Next()
// made the loader forget the overdue batch, and it waited 10 s).
TEST(DataLoader, ABatchDeliveredAfterATimeoutDoesNotRestoreTheStuckWorkersGrace) {
  auto ds = std::make_shared<FaultyDataset>(5, std::chrono::milliseconds(30000));
  StderrCapture capture;
  const auto start = std::chrono::steady_clock::now();
  {
    DataLoader loader(ds, nullptr, {},
                      {.batch_size = 10, .num_workers = 2, .timeout = std::chrono::milliseconds(300),
                       .shutdown_grace = std::chrono::seconds(10)});
    loader.StartEpoch(0);
    EXPECT_THROW(loader.Next(), std::runtime_error);  // batch 0 holds sample 5
    loader.StartEpoch(1, 1);
    auto b = loader.Next();  // from the other worker
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(b->index, 1);
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string warned = capture.Take();
  EXPECT_LT(took, 2.0) << "the destructor gave the stuck worker its full shutdown grace";
  EXPECT_THAT(warned, HasSubstr("1 of its workers are still building a batch from faulty")) << warned;
}

// Get(0) blocks on its first call until released, and takes 500 ms on its
// second (batch 0 of the next epoch, slow but healthy).
class GatedDataset : public Dataset {
 public:
  int64_t Size() const override { return 20; }
  ImageShape Shape() const override { return {1, 2, 2}; }
  int64_t NumClasses() const override { return 2; }
  void Get(int64_t index, uint8_t* pixels) const override {
    if (index == 0) {
      const int call = ++calls_of_0;
      if (call == 1) {
        blocked = true;
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (!release && std::chrono::steady_clock::now() < give_up) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      } else if (call == 2) {
        slow_started = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      }
    }
    for (int i = 0; i < 4; ++i) pixels[i] = static_cast<uint8_t>(index);
  }
  int64_t Label(int64_t index) const override { return index % 2; }
  std::string Name() const override { return "gated"; }
  mutable std::atomic<int> calls_of_0{0};
  mutable std::atomic<bool> blocked{false}, slow_started{false};
  std::atomic<bool> release{false};
};

// Next() times out on a batch no worker has claimed yet (the only worker is
// still on the abandoned epoch's batch): the worker that takes it later is
// healthy, and the destructor waits its shutdown grace for it and joins it
// (the batch was marked overdue at the timeout, and the worker that
// inherited the mark was detached after 100 ms as "stuck in the dataset").
TEST(DataLoader, TimeoutOnAnUnclaimedBatchDoesNotMarkItsLaterWorkerStuck) {
  auto ds = std::make_shared<GatedDataset>();
  StderrCapture capture;
  {
    DataLoader loader(ds, nullptr, {},
                      {.batch_size = 10, .num_workers = 1, .timeout = std::chrono::milliseconds(200),
                       .shutdown_grace = std::chrono::seconds(10)});
    loader.StartEpoch(0);
    ASSERT_TRUE(WaitFor([&] { return ds->blocked.load(); })) << "the worker never reached sample 0";
    loader.StartEpoch(1);  // batch 0 of epoch 1 waits for the busy worker
    EXPECT_THROW(loader.Next(), std::runtime_error);
    ds->release = true;
    ASSERT_TRUE(WaitFor([&] { return ds->slow_started.load(); })) << "the worker never took epoch 1's batch 0";
  }
  const std::string warned = capture.Take();
  EXPECT_EQ(ds.use_count(), 1) << "a worker still holds the dataset: it was not joined";
  EXPECT_THAT(warned, ::testing::Not(HasSubstr("still building a batch"))) << warned;
}

// Without a timeout on Next(), the destructor waits for a batch being built
// (up to options.shutdown_grace) and joins every worker: none is left
// holding the dataset.
TEST(DataLoader, DestructionWaitsForABatchBeingBuilt) {
  auto slow = std::make_shared<FaultyDataset>(0, std::chrono::milliseconds(500));
  {
    DataLoader loader(slow, nullptr, {}, {.batch_size = 10, .num_workers = 1});
    loader.StartEpoch(0);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!slow->stalling() && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(slow->stalling()) << "the worker never reached sample 0";
  }
  EXPECT_EQ(slow.use_count(), 1) << "a worker still holds the dataset: it was not joined";
}

// A worker inside a batch that never ends while the loader is destroyed
// for another reason (Next() did not time out): the destructor waits for
// it only options.shutdown_grace, not the batch timeout (10 minutes by
// default), and leaves it running detached.
TEST(DataLoader, DestructionWaitsForABatchBeingBuiltOnlyTheShutdownGrace) {
  auto stuck = std::make_shared<FaultyDataset>(0, std::chrono::milliseconds(30000));
  const auto start = std::chrono::steady_clock::now();
  {
    DataLoader loader(stuck, nullptr, {},
                      {.batch_size = 10, .num_workers = 1, .shutdown_grace = std::chrono::milliseconds(300)});
    loader.StartEpoch(0);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!stuck->stalling() && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(stuck->stalling()) << "the worker never reached sample 0";
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, 10.0) << "the destructor waited for the stuck worker";
  EXPECT_THROW(DataLoader(stuck, nullptr, {}, {.shutdown_grace = std::chrono::milliseconds(0)}),
               std::invalid_argument);
}

TEST(DataLoader, TimeoutMustBePositiveAndMaxMeansVeryLong) {
  auto ds = std::make_shared<FaultyDataset>(5, std::chrono::milliseconds(300));
  for (int64_t bad : {0, -1}) {
    try {
      DataLoader loader(ds, nullptr, {}, {.num_workers = 1, .timeout = std::chrono::milliseconds(bad)});
      FAIL() << "timeout " << bad << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("timeout " + std::to_string(bad) + " ms must be positive"));
    }
  }
  // milliseconds::max() overflowed the timed wait, which then failed at once.
  DataLoader loader(ds, nullptr, {},
                    {.batch_size = 10, .num_workers = 1, .timeout = std::chrono::milliseconds::max()});
  loader.StartEpoch(0);
  int batches = 0;
  while (loader.Next()) ++batches;
  EXPECT_EQ(batches, 10);
}

TEST(DataLoader, AHugeBatchSizeMakesOneBatch) {
  auto ds = std::make_shared<FaultyDataset>(-1, std::chrono::milliseconds(0));
  DataLoader loader(ds, nullptr, {}, {.batch_size = INT64_MAX});
  EXPECT_EQ(loader.NumBatches(), 1);
  loader.StartEpoch(0);
  auto b = loader.Next();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->labels.numel(), 100);
  EXPECT_FALSE(loader.Next().has_value());
}

TEST(DataLoader, DestroyedMidEpochWithoutHanging) {
  auto ds = FashionTest();
  for (int round = 0; round < 5; ++round) {
    DataLoader loader(ds, nullptr, {}, {.batch_size = 32, .num_workers = 4, .prefetch_factor = 3});
    loader.StartEpoch(0);
    ASSERT_TRUE(loader.Next().has_value());
  }
}

TEST(DataLoader, SyntheticDataWithCifarShapes) {
  auto ds = std::make_shared<SyntheticDataset>(SyntheticOptions{1000, {3, 32, 32}, 10, 4});
  DataLoader loader(ds, std::make_shared<RandomSampler>(1000, 0), Cifar10TrainAugment(0),
                    {.batch_size = 256, .num_workers = 2});
  loader.StartEpoch(0);
  auto b = loader.Next();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->images.shape(), (Shape{256, 3, 32, 32}));
  for (int64_t l : Ints(b->labels)) {
    EXPECT_GE(l, 0);
    EXPECT_LT(l, 10);
  }
}

// An in-memory dataset that serves its samples in reverse order through Get
// and Label, the way an index remap or a subset view would.
class ReversedDataset : public InMemoryImageDataset {
 public:
  using InMemoryImageDataset::InMemoryImageDataset;
  void Get(int64_t index, uint8_t* pixels) const override {
    InMemoryImageDataset::Get(Size() - 1 - index, pixels);
  }
  int64_t Label(int64_t index) const override { return InMemoryImageDataset::Label(Size() - 1 - index); }
};

TEST(DataLoader, SubclassOfInMemoryDatasetIsReadThroughGet) {
  constexpr int64_t kSamples = 6, kPixels = 4;
  std::vector<uint8_t> pixels(kSamples * kPixels), labels(kSamples);
  for (int64_t i = 0; i < kSamples; ++i) {
    for (int64_t p = 0; p < kPixels; ++p) pixels[i * kPixels + p] = static_cast<uint8_t>(40 * i + p);
    labels[i] = static_cast<uint8_t>(i);
  }
  auto ds = std::make_shared<ReversedDataset>("reversed", ImageShape{1, 2, 2}, kSamples, pixels, labels);
  for (int workers : {0, 2}) {
    DataLoader loader(ds, nullptr, {}, {.batch_size = kSamples, .num_workers = workers});
    loader.StartEpoch(0);
    auto b = loader.Next();
    ASSERT_TRUE(b.has_value());
    const auto px = Floats(b->images);
    const auto lb = Ints(b->labels);
    for (int64_t i = 0; i < kSamples; ++i) {
      const int64_t source = kSamples - 1 - i;
      EXPECT_EQ(lb[i], source) << "sample " << i;
      for (int64_t p = 0; p < kPixels; ++p) {
        EXPECT_EQ(px[i * kPixels + p], static_cast<float>(40 * source + p) / 255.0f)
            << "sample " << i << " pixel " << p << " with " << workers << " workers";
      }
    }
  }
}

TEST(DataLoader, RejectsBadOptionsAndIndices) {
  auto ds = FashionTest();
  EXPECT_THROW(DataLoader(ds, nullptr, {}, {.batch_size = 0}), std::invalid_argument);
  EXPECT_THROW(DataLoader(ds, nullptr, {}, {.num_workers = -1}), std::invalid_argument);
  try {
    DataLoader shard(ds, std::make_shared<DistributedSampler>(ds->Size(), DistributedSamplerOptions{64, 0, true, 0, false}),
                     {}, {.batch_size = 512, .drop_last = true});
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("batch size 512 is larger than the 157 samples"));
  }
  DataLoader loader(ds, std::make_shared<SequentialSampler>(10001), {}, {});
  EXPECT_THROW(loader.StartEpoch(0), std::out_of_range);
  EXPECT_THROW(loader.Next(), std::logic_error);
}

// A sampler moved past most of its epoch (resuming) leaves fewer samples
// than a batch: with drop_last, the epoch has no batches, as PyTorch's
// DataLoader gives (StartEpoch threw, so such a job could not resume), and
// the next epoch, started from the list's beginning again, has them all.
// A loader made for a sampler already resumed so is no error either.
TEST(DataLoader, DropLastEpochAfterSetStartPastTheLastBatchIsEmpty) {
  auto ds = FashionTest();
  auto sampler = std::make_shared<DistributedSampler>(ds->Size(), DistributedSamplerOptions{2, 0, false, 0, false});
  for (int workers : {0, 2}) {
    sampler->set_start(0, 0);
    DataLoader loader(ds, sampler, {}, {.batch_size = 100, .drop_last = true, .num_workers = workers});
    loader.StartEpoch(0);
    EXPECT_EQ(loader.NumBatches(), ds->Size() / 2 / 100);
    sampler->set_start(ds->Size() - 20, 1);
    loader.StartEpoch(1);
    EXPECT_EQ(loader.NumBatches(), 0);
    EXPECT_FALSE(loader.Next().has_value()) << "a batch from the 10 samples left, with " << workers << " workers";
    loader.StartEpoch(2);
    EXPECT_EQ(loader.NumBatches(), ds->Size() / 2 / 100);
    ASSERT_TRUE(loader.Next().has_value());
  }
  sampler->set_start(ds->Size() - 20, 1);
  DataLoader resumed(ds, sampler, {}, {.batch_size = 100, .drop_last = true});
  resumed.StartEpoch(1);
  EXPECT_FALSE(resumed.Next().has_value());
  // Without drop_last the short epoch is one small batch, as before.
  DataLoader keep(ds, sampler, {}, {.batch_size = 100});
  keep.StartEpoch(1);
  EXPECT_EQ(keep.NumBatches(), 1);
}

// A batch larger than a resumed DistributedSampler's whole epoch (without
// its start) is refused as for one never resumed: such a loader made every
// other epoch empty, without a word (a run that trains nothing). A batch
// that fits the whole epoch is accepted, with the resumed epoch empty.
TEST(DataLoader, DropLastBatchLargerThanAResumedSamplersWholeEpochIsRefused) {
  auto ds = std::make_shared<SyntheticDataset>(SyntheticOptions{.size = 100, .shape = {1, 2, 2}});
  auto sampler = std::make_shared<DistributedSampler>(ds->Size(), DistributedSamplerOptions{2, 0, false, 0, false});
  sampler->set_start(10, 0);
  try {
    DataLoader loader(ds, sampler, {}, {.batch_size = 100, .drop_last = true});
    FAIL() << "a batch of 100 accepted for 50 samples per rank per epoch";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("batch size 100 is larger than the 50 samples"));
    EXPECT_THAT(e.what(), HasSubstr("set_start(10, 0) resumes epoch 0 only"));
  }
}

// The start applies to the epoch it was set for: with a batch that fits a
// whole epoch but not the resumed one, only that epoch is empty, and the
// next ones are whole without the caller clearing the start (it applied to
// every epoch until set_start(0), and each was empty, without a word).
TEST(DataLoader, DropLastOnlyTheResumedEpochIsShortOfABatch) {
  auto ds = std::make_shared<SyntheticDataset>(SyntheticOptions{.size = 100, .shape = {1, 2, 2}});
  auto sampler = std::make_shared<DistributedSampler>(ds->Size(), DistributedSamplerOptions{2, 0, false, 0, false});
  sampler->set_start(10, 0);
  DataLoader loader(ds, sampler, {}, {.batch_size = 50, .drop_last = true});
  loader.StartEpoch(0);
  EXPECT_EQ(loader.NumBatches(), 0) << "45 samples left after the start";
  for (int64_t epoch : {1, 2}) {
    loader.StartEpoch(epoch);
    EXPECT_EQ(loader.NumBatches(), 1) << "epoch " << epoch;
    ASSERT_TRUE(loader.Next().has_value()) << "epoch " << epoch;
  }
  // Started again, the resumed epoch is resumed again.
  loader.StartEpoch(0);
  EXPECT_EQ(loader.NumBatches(), 0);
}

// A DistributedSampler subclass that yields fewer or more indices than its
// base is measured by its own Size(), not by the base's count (the check
// used the base's count for every DistributedSampler).
TEST(DataLoader, DropLastMeasuresADistributedSamplerSubclassByItsOwnSize) {
  struct Capped : DistributedSampler {
    using DistributedSampler::DistributedSampler;
    int64_t Size() const override { return 10; }
    std::vector<int64_t> Indices() const override {
      std::vector<int64_t> all = DistributedSampler::Indices();
      all.resize(10);
      return all;
    }
  };
  struct Twice : DistributedSampler {
    using DistributedSampler::DistributedSampler;
    int64_t Size() const override { return 2 * DistributedSampler::Size(); }
    std::vector<int64_t> Indices() const override {
      std::vector<int64_t> all = DistributedSampler::Indices();
      std::vector<int64_t> both = all;
      both.insert(both.end(), all.begin(), all.end());
      return both;
    }
  };
  auto ds = std::make_shared<SyntheticDataset>(SyntheticOptions{.size = 100, .shape = {1, 2, 2}});
  try {
    DataLoader loader(ds, std::make_shared<Capped>(100, DistributedSamplerOptions{}), {},
                      {.batch_size = 20, .drop_last = true});
    ADD_FAILURE() << "a batch of 20 accepted for a sampler of 10 per epoch";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("batch size 20 is larger than the 10 samples"));
  }
  DataLoader twice(ds, std::make_shared<Twice>(100, DistributedSamplerOptions{}), {},
                   {.batch_size = 150, .drop_last = true});
  twice.StartEpoch(0);
  EXPECT_EQ(twice.NumBatches(), 1);
}

// A StartEpoch that fails leaves the sampler on the epoch the loader still
// serves (it had moved on to the refused one).
TEST(DataLoader, ARefusedStartEpochLeavesTheSamplerOnTheServedEpoch) {
  auto ds = FashionTest();
  auto sampler = std::make_shared<RandomSampler>(ds->Size(), 4);
  DataLoader loader(ds, sampler, {}, {.batch_size = 100, .num_workers = 1});
  loader.StartEpoch(0);
  const std::vector<int64_t> epoch0 = sampler->Indices();
  try {
    loader.StartEpoch(1, 999);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot skip 999 batches of an epoch that has 100"));
  }
  EXPECT_TRUE(sampler->Indices() == epoch0) << "the sampler moved on to epoch 1";
  // The loader still serves epoch 0, in the sampler's order.
  auto b = loader.Next();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->epoch, 0);
  const auto labels = Ints(b->labels);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(labels[i], ds->Label(epoch0[i])) << "sample " << i;
}

// The same on the first StartEpoch: the sampler goes back to the epoch it
// was on (it stayed on the refused one, as no epoch was served yet).
TEST(DataLoader, ARefusedFirstStartEpochSetsTheSamplerBack) {
  auto ds = std::make_shared<FaultyDataset>(-1, std::chrono::milliseconds(0));
  auto random = std::make_shared<RandomSampler>(ds->Size(), 4);
  random->SetEpoch(3);
  const std::vector<int64_t> epoch3 = random->Indices();
  auto distributed = std::make_shared<DistributedSampler>(ds->Size(), DistributedSamplerOptions{2, 1, true, 4, false});
  const std::vector<int64_t> epoch0 = distributed->Indices();  // never set: epoch 0
  for (const std::shared_ptr<Sampler>& sampler : std::vector<std::shared_ptr<Sampler>>{random, distributed}) {
    DataLoader loader(ds, sampler, {}, {.batch_size = 10, .num_workers = 1});
    try {
      loader.StartEpoch(5, 999);
      FAIL() << "no error";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("cannot skip 999 batches"));
    }
  }
  EXPECT_EQ(random->epoch(), 3);
  EXPECT_TRUE(random->Indices() == epoch3) << "the sampler moved on to epoch 5";
  EXPECT_EQ(distributed->epoch(), 0);
  EXPECT_TRUE(distributed->Indices() == epoch0) << "the sampler moved on to epoch 5";
}

// A user sampler whose Indices() hold fewer than its Size() says.
class ShortSampler : public Sampler {
 public:
  int64_t Size() const override { return 100; }
  void SetEpoch(int64_t) override {}
  std::vector<int64_t> Indices() const override { return std::vector<int64_t>(40, 0); }
};

TEST(DataLoader, SamplerWhoseIndicesDisagreeWithItsSizeIsRefused) {
  DataLoader loader(FashionTest(), std::make_shared<ShortSampler>(), {}, {.batch_size = 32});
  try {
    loader.StartEpoch(3);
    FAIL() << "no error";
  } catch (const std::logic_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("Indices() for epoch 3 hold 40 indices but its Size() is 100"));
  }
}

// Out of threads after two of four workers started: the constructor stops
// the two and throws the error at once; the two never started are not
// waited for (it waited the whole shutdown grace for them).
TEST(DataLoader, AWorkerThatCannotStartFailsTheConstructorAtOnce) {
  internal::FailWorkerStartForTesting(2);
  struct Reset {
    ~Reset() { internal::FailWorkerStartForTesting(-1); }
  } reset;
  auto ds = std::make_shared<FaultyDataset>(-1, std::chrono::milliseconds(0));
  const auto start = std::chrono::steady_clock::now();
  try {
    DataLoader loader(ds, nullptr, {}, {.num_workers = 4, .shutdown_grace = std::chrono::seconds(5)});
    FAIL() << "no error";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code(), std::errc::resource_unavailable_try_again);
    EXPECT_THAT(e.what(), HasSubstr("worker 2 not started"));
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, 2.0) << "the constructor waited for workers that never started";
  EXPECT_EQ(ds.use_count(), 1) << "a started worker still holds the dataset: it was not joined";
}

}  // namespace
}  // namespace ddp::nn::data
