// End to end on the real dataset: the peers' CNN, one epoch of
// Fashion-MNIST (938 batches of 64, shuffled), SGD lr 0.05 momentum 0.9.
// The loss must fall and test accuracy must reach 85%.
#include <gtest/gtest.h>

#include <memory>
#include <numeric>

#include "nn/autograd/engine.h"
#include "nn/data/data_loader.h"
#include "nn/data/idx.h"
#include "nn/data/sampler.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"

namespace ddp::nn {
namespace {

double Mean(const std::vector<double>& v, size_t from, size_t to) {
  return std::accumulate(v.begin() + from, v.begin() + to, 0.0) / static_cast<double>(to - from);
}

TEST(TrainTest, CnnReaches85PercentOnFashionMnistInOneEpoch) {
  ManualSeed(0);
  auto model = modules::MakeCnn();
  auto train = data::LoadFashionMnist(data::kFashionMnistDebianDir, data::Split::kTrain);
  auto test = data::LoadFashionMnist(data::kFashionMnistDebianDir, data::Split::kTest);
  data::DataLoader loader(train, std::make_shared<data::RandomSampler>(train->Size(), 1), data::TransformOptions{},
                          {.batch_size = 64, .num_workers = 1});
  optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  std::vector<double> losses;
  loader.StartEpoch(0);
  while (auto batch = loader.Next()) {
    opt.ZeroGrad();
    const Tensor loss = loss::CrossEntropy(model->Forward(batch->images), batch->labels);
    Backward(loss);
    opt.Step();
    losses.push_back(loss.Item());
  }
  ASSERT_EQ(losses.size(), 938u);
  const double first = Mean(losses, 0, 50), last = Mean(losses, losses.size() - 50, losses.size());
  EXPECT_LT(last, 0.6 * first) << "loss fell from " << first << " to " << last;

  model->Eval();
  NoGradGuard no_grad;
  data::DataLoader test_loader(test, nullptr, data::TransformOptions{}, {.batch_size = 500});
  test_loader.StartEpoch(0);
  int64_t correct = 0, seen = 0;
  while (auto batch = test_loader.Next()) {
    const Tensor pred = ops::Argmax(model->Forward(batch->images), 1);
    const int64_t* p = pred.data<int64_t>();
    const int64_t* y = batch->labels.data<int64_t>();
    for (int64_t i = 0; i < pred.numel(); ++i) correct += p[i] == y[i];
    seen += pred.numel();
  }
  ASSERT_EQ(seen, 10000);
  const double accuracy = static_cast<double>(correct) / static_cast<double>(seen);
  std::printf("first-50 loss %.4f, last-50 loss %.4f, test accuracy %.4f\n", first, last, accuracy);
  EXPECT_GE(accuracy, 0.85);
}

}  // namespace
}  // namespace ddp::nn
