// Prints the time of one optimizer step over ResNet-50-sized parameters
// (25.6M f32 in 16 tensors), one thread. Compare with
// tools/bench/torch_optim_step.py run right after it on the same machine.
//
//   bazel run //nn/optim:optim_bench

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/optim/adadelta.h"
#include "nn/optim/adam.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/generator.h"

namespace ddp::nn::optim {
namespace {

// CPU time of this thread: robust against other processes on a shared machine.
double ThreadCpuMs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

constexpr int kTensors = 16;
constexpr int64_t kPerTensor = 1600000;

void Run(const std::string& name, int slots,
         const std::function<std::unique_ptr<Optimizer>(NamedParameters)>& make) {
  Generator gen(0);
  NamedParameters params;
  for (int i = 0; i < kTensors; ++i) {
    Tensor p = Randn({kPerTensor}, {}, gen);
    p.set_grad(Randn({kPerTensor}, {}, gen));
    params.emplace_back("p" + std::to_string(i), p);
  }
  auto opt = make(params);
  opt->Step();  // state allocation
  std::vector<double> ms, cpu_ms;
  for (int rep = 0; rep < 10; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = ThreadCpuMs();
    opt->Step();
    cpu_ms.push_back(ThreadCpuMs() - c0);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::sort(cpu_ms.begin(), cpu_ms.end());
  const double elems = double(kTensors) * kPerTensor;
  // Bytes moved per element: read p, g and each slot, write p and each slot.
  const double bytes = elems * 4 * (3 + 2 * slots);
  std::printf("%-10s wall median %7.2f ms  min %7.2f ms  cpu min %7.2f ms  %5.2f GB/s\n",
              name.c_str(), (ms[(ms.size() - 1) / 2] + ms[ms.size() / 2]) / 2, ms[0], cpu_ms[0],
              bytes / (cpu_ms[0] * 1e-3) / 1e9);
}

}  // namespace
}  // namespace ddp::nn::optim

int main() {
  using namespace ddp::nn::optim;
  std::printf("optimizer step, %d x %lld f32 parameters, 1 thread\n", kTensors,
              static_cast<long long>(kPerTensor));
  Run("sgd", 1, [](NamedParameters p) {
    return std::make_unique<Sgd>(p, SgdOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4});
  });
  Run("adam", 2, [](NamedParameters p) { return std::make_unique<Adam>(p, AdamOptions{}); });
  Run("adamw", 2, [](NamedParameters p) { return std::make_unique<AdamW>(p, AdamWOptions{}); });
  Run("adadelta", 2, [](NamedParameters p) { return std::make_unique<Adadelta>(p, AdadeltaOptions{}); });
  return 0;
}
