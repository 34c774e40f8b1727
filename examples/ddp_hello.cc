// The smallest complete data-parallel training program: the MLP on
// Fashion-MNIST, each rank on its own shard of every epoch, gradients
// averaged by DistributedDataParallel, a test accuracy summed over the
// ranks, and a checkpoint written by rank 0 (its path checked before
// training). It is PyTorch's "getting
// started with DDP" recipe, line for line in C++; the trainer
// (//examples:train) is the same loop with every option around it.
//
//   bazel run //examples:ddp_hello                        # 2 ranks, 1 epoch
//   bazel run //examples:ddp_hello -- --nproc_per_node=4 --epochs=2
//   bazel run //examples:ddp_hello -- --checkpoint=/tmp/hello.safetensors
//
// Under ddprun, srun or mpirun, drop --nproc_per_node: the launch variables
// are already set and the binary runs as one rank.

#include <gflags/gflags.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>

#include "ddp/checkpoint.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/process_group.h"
#include "examples/own_help.h"
#include "examples/setup_signals.h"
#include "examples/user_path.h"
#include "nn/autograd/engine.h"
#include "nn/data/data_loader.h"
#include "nn/data/idx.h"
#include "nn/data/sampler.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"
#include "transport/launch/env.h"
#include "transport/launch/self_launch.h"

DEFINE_int32(epochs, 1, "passes over the training set (0: evaluate and save the initial model)");
DEFINE_int32(batch_size, 64, "samples per rank and step");
DEFINE_double(lr, 0.05, "SGD learning rate (momentum 0.9)");
DEFINE_string(data_dir, ddp::nn::data::kFashionMnistDebianDir, "Fashion-MNIST's IDX files");
DEFINE_string(checkpoint, "", "rank 0 writes the model and optimizer here at the end ('': none)");

namespace {

using namespace ddp;
using nn::Tensor;

// What gflags left of the command line (`argc`, `argv`) and the flags'
// ranges, checked before the ranks connect or read data; "" when they are
// fine, else what is wrong, naming the argument or the flag.
std::string RangeProblem(int argc, char** argv) {
  if (argc > 1) {
    return std::string("unexpected argument '") + argv[1] + "'; flags are written --name=value (see --help)";
  }
  if (FLAGS_epochs < 0) return "--epochs=" + std::to_string(FLAGS_epochs) + " must be at least 0";
  if (FLAGS_batch_size < 1) {
    return "--batch_size=" + std::to_string(FLAGS_batch_size) + " must be at least 1";
  }
  // An infinite rate trains to NaN; zero never changes the model.
  if (!(FLAGS_lr > 0) || !std::isfinite(FLAGS_lr)) {
    char text[64];
    std::snprintf(text, sizeof(text), "--lr=%g must be a finite number > 0", FLAGS_lr);
    return text;
  }
  return "";
}

// Why rank 0 could not write --checkpoint (resolved: `path`), or "".
// Checked before training, so that a typo does not cost a whole run.
std::string CheckpointPathProblem(const std::string& path) {
  namespace fs = std::filesystem;
  const std::string flag = "--checkpoint=" + path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return flag + " is a folder; give the path of a file";
  fs::path folder = fs::path(path).parent_path();
  if (folder.empty()) folder = ".";
  if (!fs::exists(folder, ec)) return flag + ": the folder " + folder.string() + " does not exist";
  if (!fs::is_directory(folder, ec)) return flag + ": " + folder.string() + " is not a folder";
  if (access(folder.c_str(), W_OK | X_OK) != 0) {
    return flag + ": the folder " + folder.string() + " is not writable (" + std::strerror(errno) + ")";
  }
  return "";
}

// Why the Fashion-MNIST files in `dir` cannot be read (the loader's own
// message, which names the files looked for and the package), or "".
std::string DataProblem(const std::string& dir) {
  try {
    for (const nn::data::Split split : {nn::data::Split::kTrain, nn::data::Split::kTest}) {
      nn::data::LoadFashionMnist(dir, split);
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// For SelfLaunchOptions::check_arguments: in the process that starts the
// ranks, the flags as every rank will parse them, so that a wrong one is
// refused once and nothing starts. An unknown flag or a malformed value
// was refused before (ddp::examples::FlagProblem in main).
std::string LaunchFlagProblem(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  if (std::string problem = RangeProblem(argc, argv); !problem.empty()) return problem;
  // The ranks run on this host and read the same files: a wrong
  // --data_dir is said once here, not by every rank after it connected.
  // (Once decoded, the images are mapped from the data cache, by this
  // process and then by each rank.)
  if (std::string problem = DataProblem(ddp::examples::UserPath(FLAGS_data_dir)); !problem.empty()) {
    return problem;
  }
  // Rank 0 runs on this host: its --checkpoint can be checked here too.
  if (FLAGS_checkpoint.empty()) return "";
  return CheckpointPathProblem(ddp::examples::UserPath(FLAGS_checkpoint));
}

int Run() {
  // One process group for the job, from RANK, WORLD_SIZE, MASTER_ADDR, ...
  std::shared_ptr<dist::ProcessGroup> pg = dist::InitProcessGroup();
  const int rank = pg->rank(), world = pg->size();

  // Rank 0 writes the checkpoint, on its host: it checks the path, and
  // every rank refuses with its answer.
  if (!FLAGS_checkpoint.empty()) {
    std::string problem = rank == 0 ? CheckpointPathProblem(FLAGS_checkpoint) : "";
    pg->BroadcastObject(&problem, 0);
    if (!problem.empty()) {
      std::fprintf(stderr, "ddp_hello: %s\n", problem.c_str());
      dist::DestroyProcessGroup();
      return 2;
    }
  }

  // Every rank builds the same model; DDP checks that the replicas agree
  // and copies rank 0's weights to the others.
  auto model = nn::modules::MakeMlp();
  dist::DistributedDataParallel ddp_model(model);
  nn::optim::Sgd optimizer(model->NamedParameters(), {.lr = FLAGS_lr, .momentum = 0.9});

  // Each rank reads its 1/world of every epoch (a different permutation
  // per epoch, the same on every rank).
  auto train = nn::data::LoadFashionMnist(FLAGS_data_dir, nn::data::Split::kTrain);
  auto sampler = std::make_shared<nn::data::DistributedSampler>(
      train->Size(), nn::data::DistributedSamplerOptions{.num_replicas = world, .rank = rank});
  nn::data::DataLoader loader(train, sampler, nn::data::FashionMnistNormalize(),
                              {.batch_size = FLAGS_batch_size, .num_workers = 1});

  for (int epoch = 0; epoch < FLAGS_epochs; ++epoch) {
    loader.StartEpoch(epoch);
    double loss_sum = 0;
    int64_t steps = 0;
    while (auto batch = loader.Next()) {
      optimizer.ZeroGrad();
      Tensor loss = nn::loss::CrossEntropy(ddp_model(batch->images), batch->labels);
      nn::Backward(loss);  // the buckets' all-reduces run while backward does
      optimizer.Step();    // every rank applies the same averaged gradients
      loss_sum += loss.Item();
      ++steps;
    }
    // The mean training loss over all ranks: an all-reduce of a tensor.
    Tensor mean = nn::FromVector({loss_sum / static_cast<double>(steps)}, {1});
    pg->AllReduce(mean, transport::ReduceOp::kAvg).Wait();
    if (rank == 0) std::printf("epoch %d: train loss %.4f\n", epoch + 1, mean.Item());
  }

  // Test accuracy: each rank scores every world-th image (each image once
  // over all ranks), the counts are summed. Evaluation runs the module
  // itself, not the DDP wrapper.
  auto test = nn::data::LoadFashionMnist(FLAGS_data_dir, nn::data::Split::kTest);
  nn::data::DataLoader test_loader(test, std::make_shared<nn::data::StridedSampler>(test->Size(), world, rank),
                                   nn::data::FashionMnistNormalize(), {.batch_size = 500});
  model->Eval();
  double correct = 0, seen = 0;
  {
    nn::NoGradGuard no_grad;
    test_loader.StartEpoch(0);
    while (auto batch = test_loader.Next()) {
      const auto predicted = nn::ops::Argmax(model->Forward(batch->images), 1).ToVector<int64_t>();
      const auto truth = batch->labels.ToVector<int64_t>();
      for (size_t i = 0; i < truth.size(); ++i) correct += predicted[i] == truth[i];
      seen += static_cast<double>(truth.size());
    }
  }
  Tensor counts = nn::FromVector({correct, seen}, {2}, {.dtype = nn::DType::kFloat64});
  pg->AllReduce(counts).Wait();
  const std::vector<double> total = counts.ToVector<double>();
  if (rank == 0) {
    std::printf("test accuracy %.2f%% (%d rank%s, %.0f images)\n", 100 * total[0] / total[1], world,
                world == 1 ? "" : "s", total[1]);
  }

  // Rank 0 writes the file atomically; the others wait for it.
  if (!FLAGS_checkpoint.empty()) {
    dist::SaveCheckpoint(*pg, FLAGS_checkpoint, dist::MakeCheckpoint(*model, &optimizer));
    if (rank == 0) std::printf("checkpoint %s\n", FLAGS_checkpoint.c_str());
  }
  // As dist.destroy_process_group(): the default group lets go of the
  // process group, which closes its connections once `pg` and the DDP
  // wrapper are gone too (at the end of this function), instead of leaving
  // them open until the process exits.
  dist::DestroyProcessGroup();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Before the launch, which would start every rank to print gflags' help
  // of every linked library: this program's flags, once.
  gflags::SetUsageMessage(
      "the MLP on Fashion-MNIST on --nproc_per_node ranks (default 2) with DistributedDataParallel\n"
      "Usage: bazel run //examples:ddp_hello -- [--nproc_per_node=N] [--flag=value ...]");
  if (ddp::examples::ShowOwnHelpIfAsked(argc, argv, "examples/ddp_hello")) return 0;
  // Ctrl-C while the process that starts the ranks checks the flags and
  // the data is said in one line (it ended without a word), as train says it.
  namespace launch = ddp::transport::launch;
  if (!launch::HasLaunchVariables(launch::CurrentEnvironment())) ddp::examples::WatchSetupSignals("ddp_hello");
  // A misspelt flag or a value of the wrong type, in one line that names
  // the nearest flag (gflags' own message names no program and exits 1),
  // as train and the benchmarks say it; every rank under another launcher.
  if (const std::string problem = ddp::examples::CommandLineProblem(&argc, &argv, "examples/ddp_hello");
      !problem.empty()) {
    ddp::examples::StopIfInterruptedInSetup();  // said already: the refusal is beside the point
    std::fprintf(stderr, "ddp_hello: %s\n", problem.c_str());
    return 2;
  }
  // Before anything touches UCX or starts a thread: become N ranks, once
  // the flags are found fine.
  launch::SelfLaunchOrExit(argc, argv,
                           {.default_nproc_per_node = 2, .check_arguments = [](int argc, char** argv) {
                              std::string problem = LaunchFlagProblem(argc, argv);
                              ddp::examples::EndSetup();
                              return problem;
                            }});
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach the launcher as they are printed
  // Under another launcher (ddprun, srun, mpirun), which does not know
  // these flags, every rank checks them: all refuse.
  if (const std::string problem = RangeProblem(argc, argv); !problem.empty()) {
    std::fprintf(stderr, "ddp_hello: %s\n", problem.c_str());
    return 2;
  }
  // Relative paths are the user's, not the runfiles folder `bazel run`
  // starts the binary in.
  FLAGS_data_dir = ddp::examples::UserPath(FLAGS_data_dir);
  FLAGS_checkpoint = ddp::examples::UserPath(FLAGS_checkpoint);
  try {
    return Run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_hello: %s\n", e.what());
    return 1;
  }
}
