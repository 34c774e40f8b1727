// Training throughput of nn on one rank, one thread, measured like
// ../shared/peers/torch_ddp_train.py: a fixed random permutation of the
// training set, batch b = perm[(i*bs) % (n - bs):][:bs], SGD (lr 0.05,
// momentum 0.9), cross-entropy, 5 warm-up steps, then `steps` timed steps,
// then test accuracy in batches of 1000. Pixels stay u8 in memory and are
// scaled to [0, 1] per batch.
//
// Prints: model nproc samples_per_s final_loss test_acc peak_rss_mb
#include <gflags/gflags.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "examples/own_help.h"
#include "examples/user_path.h"
#include "nn/autograd/engine.h"
#include "nn/data/idx.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/ops/config.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"
#include "nn/tensor/allocator.h"
#include "nn/tensor/generator.h"

DEFINE_string(model, "cnn", "mlp or cnn (the peers' models)");
DEFINE_int32(steps, 300, "timed training steps");
DEFINE_int32(batch, 64, "batch size");
DEFINE_int32(threads, 1, "threads per GEMM/convolution");
DEFINE_string(data_dir, ddp::nn::data::kFashionMnistDebianDir, "Fashion-MNIST directory");
DEFINE_bool(eval, true, "measure test accuracy after training");
DEFINE_int32(eval_batch, 1000,
             "test-set batch size (PyTorch's script uses 1000); at most the test set's size is used");
DEFINE_bool(verbose, false, "print allocator statistics");

namespace {

using ddp::nn::Tensor;
namespace nn = ddp::nn;

// Copies samples idx[0..n) of `data` into images [n, 1, 28, 28] (scaled to [0, 1]) and labels [n].
void Gather(const nn::data::InMemoryImageDataset& data, const int64_t* idx, int64_t n, const Tensor& images,
            const Tensor& labels) {
  const int64_t pixels = data.Shape().NumPixels();
  float* x = images.data<float>();
  int64_t* y = labels.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* src = data.Pixels(idx[i]);
    for (int64_t k = 0; k < pixels; ++k) x[i * pixels + k] = static_cast<float>(src[k]) * (1.0f / 255.0f);
    y[i] = data.Label(idx[i]);
  }
}

// The mlp and cnn take Fashion-MNIST's images, copied into [batch, 1, 28,
// 28] tensors: images of another shape would be copied past their end (or
// read at the wrong offsets). Says so, naming the folder, and returns false.
bool TakesTheImagesOf(const nn::data::InMemoryImageDataset& data, const char* split) {
  if (data.Shape() == nn::data::ImageShape{1, 28, 28}) return true;
  std::fprintf(stderr,
               "nn_bench: --data_dir=%s: the %s images are %s; --model=%s takes Fashion-MNIST's "
               "[1, 28, 28]\n",
               FLAGS_data_dir.c_str(), split, data.Shape().ToString().c_str(), FLAGS_model.c_str());
  return false;
}

double PeakRssMb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

int Run() {
  if (FLAGS_steps < 1) {
    std::fprintf(stderr, "nn_bench: --steps=%d must be at least 1\n", FLAGS_steps);
    return 2;
  }
  // nn::ops::SetNumThreads's range (past it the first GEMM crashed).
  if (FLAGS_threads < 1 || FLAGS_threads > nn::ops::kMaxNumThreads) {
    std::fprintf(stderr, "nn_bench: --threads=%d must be in [1, %d]\n", FLAGS_threads, nn::ops::kMaxNumThreads);
    return 2;
  }
  if (FLAGS_eval_batch < 1) {
    std::fprintf(stderr, "nn_bench: --eval_batch=%d must be at least 1\n", FLAGS_eval_batch);
    return 2;
  }
  nn::ops::SetNumThreads(FLAGS_threads);
  nn::ManualSeed(0);
  std::shared_ptr<nn::modules::Sequential> model;
  if (FLAGS_model == "mlp") {
    model = nn::modules::MakeMlp();
  } else if (FLAGS_model == "cnn") {
    model = nn::modules::MakeCnn();
  } else {
    std::fprintf(stderr, "nn_bench: unknown --model=%s (mlp or cnn)\n", FLAGS_model.c_str());
    return 2;
  }
  if (FLAGS_verbose) std::printf("peak RSS before loading data: %.1f MB\n", PeakRssMb());
  const auto train = nn::data::LoadFashionMnist(FLAGS_data_dir, nn::data::Split::kTrain);
  if (FLAGS_verbose) std::printf("peak RSS after loading the training set: %.1f MB\n", PeakRssMb());
  if (!TakesTheImagesOf(*train, "training")) return 2;
  // Loaded (and checked) before training, so that a wrong shape costs no
  // training; it stays resident to the end either way.
  std::shared_ptr<nn::data::InMemoryImageDataset> test;
  if (FLAGS_eval) {
    test = nn::data::LoadFashionMnist(FLAGS_data_dir, nn::data::Split::kTest);
    if (!TakesTheImagesOf(*test, "test")) return 2;
  }
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  nn::Generator gen(1);
  const Tensor perm = nn::RandPerm(train->Size(), gen);
  const int64_t bs = FLAGS_batch;
  // Batch i starts at (i * bs) % span, so a batch must leave part of the set out.
  const int64_t span = train->Size() - bs;
  if (bs < 1 || span < 1) {
    std::fprintf(stderr, "nn_bench: --batch=%d must be in [1, %lld): the batches are drawn from the %lld samples of %s\n",
                 FLAGS_batch, static_cast<long long>(train->Size()), static_cast<long long>(train->Size()),
                 FLAGS_data_dir.c_str());
    return 2;
  }
  Tensor images = nn::Empty({bs, 1, 28, 28});
  Tensor labels = nn::Empty({bs}, {.dtype = nn::DType::kInt64});
  double loss_value = 0;
  auto step = [&](int64_t i) {
    Gather(*train, perm.data<int64_t>() + (i * bs) % span, bs, images, labels);
    opt.ZeroGrad();
    Tensor loss = nn::loss::CrossEntropy(model->Forward(images), labels);
    nn::Backward(loss);
    opt.Step();
    loss_value = loss.Item();
  };
  for (int i = 0; i < 5; ++i) step(i);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < FLAGS_steps; ++i) step(i + 5);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double train_rss = PeakRssMb();
  double acc = -1;
  if (FLAGS_eval) {
    model->Eval();
    nn::NoGradGuard no_grad;
    int64_t correct = 0;
    // A batch past the test set's size would allocate buffers for images
    // that do not exist (--eval_batch=2000000000: terabytes, and the run
    // dies after training); the whole set in one batch is the most it needs.
    const int64_t eb = std::min<int64_t>(FLAGS_eval_batch, test->Size());
    Tensor timages = nn::Empty({eb, 1, 28, 28});
    Tensor tlabels = nn::Empty({eb}, {.dtype = nn::DType::kInt64});
    std::vector<int64_t> idx(eb);
    for (int64_t k = 0; k < test->Size(); k += eb) {
      const int64_t n = std::min(eb, test->Size() - k);
      for (int64_t i = 0; i < n; ++i) idx[i] = k + i;
      Gather(*test, idx.data(), n, timages, tlabels);
      const Tensor pred = nn::ops::Argmax(model->Forward(timages.Narrow(0, 0, n)), 1);
      const int64_t* p = pred.data<int64_t>();
      for (int64_t i = 0; i < n; ++i) correct += p[i] == tlabels.data<int64_t>()[i];
    }
    acc = static_cast<double>(correct) / static_cast<double>(test->Size());
  }
  std::printf("%s 1 %.1f %.4f %.4f %.1f\n", FLAGS_model.c_str(), FLAGS_steps * bs / dt, loss_value, acc, PeakRssMb());
  if (FLAGS_verbose) {
    std::printf("peak RSS after training (before evaluation): %.1f MB\n", train_rss);
    const nn::AllocatorStats s = nn::CpuAllocator().Stats();
    std::printf("allocator: requests %llu system %llu peak_in_use %.1f MB cached %.1f MB\n",
                static_cast<unsigned long long>(s.requests), static_cast<unsigned long long>(s.system_allocations),
                s.peak_in_use_bytes / 1048576.0, s.cached_bytes / 1048576.0);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage("one-process training throughput (samples/s) and peak memory of the MLP or CNN");
  if (ddp::examples::ShowOwnHelpIfAsked(argc, argv, "examples/nn_bench")) return 0;
  // It times one process and starts no ranks: --nproc_per_node, which the
  // other benchmarks take, is refused by name, on the command line or in a
  // --flagfile; gflags' "unknown command line flag" exited 1.
  if (const std::string problem = ddp::examples::CommandLineProblem(
          &argc, &argv, "examples/nn_bench", "nn_bench runs one process; drop the flag (ddp_bench runs several ranks)");
      !problem.empty()) {
    std::fprintf(stderr, "nn_bench: %s\n", problem.c_str());
    return 2;
  }
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  // Relative: the user's directory, not the runfiles folder of `bazel run`.
  FLAGS_data_dir = ddp::examples::UserPath(FLAGS_data_dir);
  try {
    return Run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nn_bench: %s\n", e.what());
    return 1;
  }
}
