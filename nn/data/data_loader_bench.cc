// Prints DataLoader throughput (samples per second, thread CPU time per
// batch) for Fashion-MNIST as the trainer loads it and for CIFAR-shaped
// synthetic data with the CIFAR augmentation.
//
//   bazel run //nn/data:data_loader_bench

#include <time.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "nn/data/data_loader.h"
#include "nn/data/idx.h"

namespace ddp::nn::data {
namespace {

double CpuMs() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

void Run(const std::string& label, std::shared_ptr<const Dataset> ds, TransformOptions t,
         int64_t batch, int workers) {
  DataLoader loader(ds, std::make_shared<RandomSampler>(ds->Size(), 0), t,
                    {.batch_size = batch, .drop_last = true, .num_workers = workers});
  loader.StartEpoch(0);
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = CpuMs();
  int64_t samples = 0, batches = 0;
  while (auto b = loader.Next()) {
    samples += b->labels.size(0);
    ++batches;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%-34s batch %4lld workers %d: %9.0f samples/s, %6.3f ms CPU per batch\n",
              label.c_str(), static_cast<long long>(batch), workers, samples / s,
              (CpuMs() - c0) / batches);
}

}  // namespace
}  // namespace ddp::nn::data

int main() {
  using namespace ddp::nn::data;
  auto fm = LoadFashionMnist(kFashionMnistDebianDir, Split::kTrain);
  for (int w : {0, 1, 2}) Run("fashion_mnist, scale only", fm, {}, 64, w);
  auto cifar = std::make_shared<SyntheticDataset>(SyntheticOptions{50000, {3, 32, 32}, 10, 0});
  for (int w : {0, 1, 2}) Run("synthetic 3x32x32, crop+flip+norm", cifar, Cifar10TrainAugment(0), 256, w);
  return 0;
}
