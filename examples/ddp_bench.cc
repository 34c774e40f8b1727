// Data-parallel training throughput, measured like
// ../shared/peers/torch_ddp_train.py so that the two can be run side by
// side: Fashion-MNIST, the peers' MLP or CNN, batch 64 per rank, SGD (lr
// 0.05, momentum 0.9), cross-entropy, one compute thread per rank; each rank
// takes every n-th sample of a fixed permutation and batch i is
// shard[(i*bs) % (len - bs):][:bs]; 5 warm-up steps, a barrier, the timed
// steps, a barrier; then test accuracy on rank 0.
//
//   bazel run //examples:ddp_bench -- --model=mlp --steps=300 --nproc_per_node=2
//
// Spawns its own ranks (or runs under ddprun / srun / mpirun). Rank 0
// prints one line, the peer's five fields first:
//
//   model nproc samples_per_s final_loss test_acc fwd_ms bwd_compute_ms
//   comm_ms overlap_pct exposed_ms comm_cpu_ms buckets step_ms cpu_ms
//   peer_wait_ms
//
// fwd_ms ... buckets and peer_wait_ms are DistributedDataParallel's
// statistics over the timed steps on rank 0 (averages per step; see
// DdpStats; peer_wait_ms is the time rank 0's collectives waited for the
// other ranks); step_ms is wall time and cpu_ms rank 0's process CPU time
// (all threads) per step.

#include <gflags/gflags.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "ddp/comm_hooks.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/model_averaging.h"
#include "ddp/overlapped_zero_optimizer.h"
#include "ddp/powersgd_hook.h"
#include "ddp/trace.h"
#include "ddp/process_group.h"
#include "ddp/zero_redundancy_optimizer.h"
#include "examples/own_help.h"
#include "examples/setup_signals.h"
#include "examples/user_path.h"
#include "nn/autograd/engine.h"
#include "nn/data/idx.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/ops/config.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"
#include "transport/launch/env.h"
#include "transport/launch/self_launch.h"

DEFINE_string(model, "cnn", "mlp or cnn (the peers' models)");
DEFINE_int32(steps, 300, "timed training steps");
DEFINE_bool(flush_denormal, false,
            "subnormal floats as zero (the trainer's default; off here to match the PyTorch peer's "
            "IEEE arithmetic)");
DEFINE_int32(batch, 64, "batch size per rank");
DEFINE_string(data_dir, ddp::nn::data::kFashionMnistDebianDir, "Fashion-MNIST directory");
DEFINE_double(bucket_cap_mb, 25, "DdpOptions::bucket_cap_mb");
DEFINE_double(first_bucket_mb, 1, "DdpOptions::first_bucket_mb");
DEFINE_double(inplace_gradient_mb, 0.5, "DdpOptions::inplace_gradient_mb");
DEFINE_bool(gradient_as_bucket_view, false, "DdpOptions::gradient_as_bucket_view");
DEFINE_string(hook, "allreduce",
              "communication hook: allreduce, fp16, bf16, powersgd, noop (no communication), "
              "local_sgd (post-local SGD with periodic model averaging)");
DEFINE_int32(local_sgd_start, 0,
             "--hook=local_sgd: steps of plain DDP first (PostLocalSgdOptions::start_iteration and "
             "the averager's warm-up; the 5 untimed steps count)");
DEFINE_int32(average_period, 4, "--hook=local_sgd: average the parameters every this many steps");
DEFINE_int32(powersgd_rank, 1, "--hook=powersgd: PowerSgdOptions::matrix_approximation_rank");
DEFINE_int32(powersgd_start, 0,
             "--hook=powersgd: PowerSgdOptions::start_iteration (0: every step compressed, warm-up included)");
DEFINE_int32(comm_nice, 0, "ProcessGroupOptions::comm_thread_nice");
DEFINE_string(collective_thread, "auto",
              "ProcessGroupOptions::collective_thread: auto, comm (the communication thread) or "
              "caller (the thread that issues them)");
DEFINE_bool(bind_to_core, false, "pin each rank (and its communication) to one core");
DEFINE_string(trace_prefix, "", "write a Chrome trace per rank to <prefix>rank<r>.json");
DEFINE_bool(zero, false, "shard the optimizer state across ranks (ZeroRedundancyOptimizer)");
DEFINE_bool(zero_overlap, false,
            "run the optimizer step inside each bucket's all-reduce, sharded across ranks "
            "(OverlappedZeroOptimizer; with --hook=allreduce)");
DEFINE_bool(eval, true, "measure test accuracy after training");
DEFINE_int32(timeout_ms, 120000, "deadline of every collective");

namespace {

namespace nn = ddp::nn;
namespace dist = ddp::dist;
using nn::Tensor;

// Copies samples idx[0..n) into images [n, 1, 28, 28] (scaled to [0, 1]) and labels [n].
void Gather(const nn::data::InMemoryImageDataset& data, const int64_t* idx, int64_t n,
            const Tensor& images, const Tensor& labels) {
  float* x = images.data<float>();
  int64_t* y = labels.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* src = data.Pixels(idx[i]);
    for (int64_t k = 0; k < 784; ++k) x[i * 784 + k] = static_cast<float>(src[k]) * (1.0f / 255.0f);
    y[i] = data.Label(idx[i]);
  }
}

// The mlp and cnn take Fashion-MNIST's images, copied into [batch, 1, 28,
// 28] tensors: images of another shape would be copied past their end (or
// read at the wrong offsets). Says so, naming the folder, and returns false.
bool TakesTheImagesOf(const nn::data::InMemoryImageDataset& data, const char* split) {
  if (data.Shape() == nn::data::ImageShape{1, 28, 28}) return true;
  std::fprintf(stderr,
               "ddp_bench: --data_dir=%s: the %s images are %s; --model=%s takes Fashion-MNIST's "
               "[1, 28, 28]\n",
               FLAGS_data_dir.c_str(), split, data.Shape().ToString().c_str(), FLAGS_model.c_str());
  return false;
}

// CPU time of this process (every thread), in seconds.
double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// "" when the hook-specific flags given on the command line fit --hook;
// else a message naming the first that does not (a flag of another hook
// was accepted and silently ignored).
std::string HookFlagProblem() {
  struct HookFlag {
    const char* flag;
    const char* hook;
  };
  for (const HookFlag& f : {HookFlag{"local_sgd_start", "local_sgd"}, HookFlag{"average_period", "local_sgd"},
                            HookFlag{"powersgd_rank", "powersgd"}, HookFlag{"powersgd_start", "powersgd"}}) {
    const gflags::CommandLineFlagInfo info = gflags::GetCommandLineFlagInfoOrDie(f.flag);
    if (!info.is_default && FLAGS_hook != f.hook) {
      return std::string("--") + f.flag + "=" + info.current_value + " applies to --hook=" + f.hook +
             " only, not --hook=" + FLAGS_hook + "; drop it";
    }
  }
  return "";
}

// "" when the flags, taken alone, are fine; else one line naming the first
// that is not. Needs no process group: the launching process asks it before
// any rank starts (LaunchFlagProblem), and each rank again under another
// launcher.
std::string FlagsProblem() {
  if (std::string problem = HookFlagProblem(); !problem.empty()) return problem;
  if (FLAGS_steps < 1) return "--steps=" + std::to_string(FLAGS_steps) + " must be at least 1";
  // The process group refuses it too, but in words that name no flag.
  if (FLAGS_timeout_ms < 1) return "--timeout_ms=" + std::to_string(FLAGS_timeout_ms) + " must be at least 1";
  if (FLAGS_collective_thread != "auto" && FLAGS_collective_thread != "comm" &&
      FLAGS_collective_thread != "caller") {
    return "--collective_thread must be auto, comm or caller, got '" + FLAGS_collective_thread + "'";
  }
  if (FLAGS_model != "mlp" && FLAGS_model != "cnn") return "unknown --model=" + FLAGS_model + " (mlp or cnn)";
  const std::string& hook = FLAGS_hook;
  if (hook != "allreduce" && hook != "fp16" && hook != "bf16" && hook != "powersgd" && hook != "noop" &&
      hook != "local_sgd") {
    return "unknown --hook=" + hook + " (allreduce, fp16, bf16, powersgd, noop, local_sgd)";
  }
  if (hook == "local_sgd") {
    // ZeRO broadcasts each shard from its owner: the replicas would never differ.
    if (FLAGS_zero) return "--hook=local_sgd cannot be combined with --zero";
    if (FLAGS_local_sgd_start < 0 || FLAGS_average_period < 1) {
      return "--local_sgd_start=" + std::to_string(FLAGS_local_sgd_start) +
             " must be at least 0 and --average_period=" + std::to_string(FLAGS_average_period) + " at least 1";
    }
  }
  if (FLAGS_zero_overlap && (FLAGS_zero || hook != "allreduce")) {
    return "--zero_overlap is its own hook and optimizer: not with --zero or --hook=" + hook;
  }
  return "";
}

// For SelfLaunchOptions::check_arguments: the flags as every rank will
// parse them, checked once in the process that would start the ranks.
std::string LaunchFlagProblem(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  return FlagsProblem();
}

int Run() {
  if (const std::string problem = FlagsProblem(); !problem.empty()) {
    std::fprintf(stderr, "ddp_bench: %s\n", problem.c_str());
    return 2;
  }
  nn::ops::SetNumThreads(1);
  // Before the process group's thread starts: threads inherit it.
  nn::ops::SetFlushDenormal(FLAGS_flush_denormal);
  dist::ProcessGroupOptions pg_options;
  pg_options.timeout = std::chrono::milliseconds(FLAGS_timeout_ms);
  pg_options.comm_thread_nice = FLAGS_comm_nice;
  if (FLAGS_collective_thread == "comm") {
    pg_options.collective_thread = dist::CollectiveThread::kCommThread;
  } else if (FLAGS_collective_thread == "caller") {
    pg_options.collective_thread = dist::CollectiveThread::kCaller;
  }
  ddp::transport::CommunicatorOptions comm_options;
  comm_options.bind_to_core = FLAGS_bind_to_core;
  auto pg = dist::ProcessGroup::CreateFromEnvironment(pg_options, comm_options);
  const int rank = pg->rank(), world = pg->size();
  // A trace is written when the run ends, beside its name and renamed over
  // it, which is refused for a folder, a socket or a device; a FIFO or a
  // terminal there is streamed to instead (DdpOptions::trace_prefix). Found
  // now, not after the timed steps. Every rank looks at every rank's name,
  // so that all of them stop together.
  if (!FLAGS_trace_prefix.empty()) {
    for (int r = 0; r < world; ++r) {
      const std::string trace = FLAGS_trace_prefix + "rank" + std::to_string(r) + ".json";
      std::error_code ec;
      const auto type = std::filesystem::status(trace, ec).type();
      if (type != std::filesystem::file_type::not_found && type != std::filesystem::file_type::regular &&
          type != std::filesystem::file_type::none && !dist::TraceRecorder::IsStreamTarget(trace)) {
        if (rank == 0) {
          std::fprintf(stderr,
                       "ddp_bench: --trace_prefix=%s: rank %d's trace %s exists and is neither a regular file "
                       "nor a FIFO or terminal to stream it to; pass another --trace_prefix\n",
                       FLAGS_trace_prefix.c_str(), r, trace.c_str());
          std::fflush(stderr);
        }
        // The others leave once rank 0 has said why: the launcher stops
        // every rank when the first exits with an error, which came before
        // rank 0's line 3 runs in 30 under load. A failed barrier changes
        // nothing here: the run ends with 2 all the same.
        try {
          pg->Barrier().Wait();
        } catch (const std::exception&) {
        }
        return 2;
      }
    }
  }

  nn::ManualSeed(0);
  std::shared_ptr<nn::modules::Sequential> model;
  if (FLAGS_model == "mlp") {
    model = nn::modules::MakeMlp();
  } else {
    model = nn::modules::MakeCnn();
  }
  dist::DdpOptions options;
  options.process_group = pg;
  options.bucket_cap_mb = FLAGS_bucket_cap_mb;
  options.first_bucket_mb = FLAGS_first_bucket_mb;
  options.inplace_gradient_mb = FLAGS_inplace_gradient_mb;
  options.gradient_as_bucket_view = FLAGS_gradient_as_bucket_view;
  options.trace_prefix = FLAGS_trace_prefix;
  dist::DistributedDataParallel ddp_model(model, options);
  std::unique_ptr<dist::PeriodicModelAverager> averager;  // --hook=local_sgd
  if (FLAGS_hook == "fp16") {
    ddp_model.RegisterCommHook(dist::hooks::Fp16CompressHook());
  } else if (FLAGS_hook == "bf16") {
    ddp_model.RegisterCommHook(dist::hooks::Bf16CompressHook());
  } else if (FLAGS_hook == "powersgd") {
    const dist::PowerSgdOptions powersgd{.matrix_approximation_rank = FLAGS_powersgd_rank,
                                         .start_iteration = FLAGS_powersgd_start};
    ddp_model.RegisterCommHook(dist::hooks::PowerSgdHook(powersgd));
    if (rank == 0) {
      // What one rank hands to all-reduces per step, compressed and not
      // (f32; a ring moves about 2 (world - 1) / world times this per rank).
      std::vector<nn::Shape> shapes;
      int64_t plain_elements = 0;
      for (const auto& [name, p] : model->NamedParameters()) {
        shapes.push_back(p.shape());
        plain_elements += p.numel();
      }
      const int64_t elements = dist::PowerSgdElementsPerStep(shapes, powersgd);
      std::fprintf(stderr,
                   "ddp_bench: powersgd rank %d: %lld bytes all-reduced per step (uncompressed %lld, "
                   "%.1fx less)\n",
                   FLAGS_powersgd_rank, static_cast<long long>(4 * elements),
                   static_cast<long long>(4 * plain_elements),
                   static_cast<double>(plain_elements) / static_cast<double>(elements));
    }
  } else if (FLAGS_hook == "noop") {
    ddp_model.RegisterCommHook(dist::hooks::NoopHook());
  } else if (FLAGS_hook == "local_sgd") {
    ddp_model.RegisterCommHook(dist::hooks::PostLocalSgdHook({.start_iteration = FLAGS_local_sgd_start}));
    averager = std::make_unique<dist::PeriodicModelAverager>(dist::ModelAveragerOptions{
        .period = FLAGS_average_period, .warmup_steps = FLAGS_local_sgd_start, .process_group = pg});
  }
  auto make_sgd = [](nn::optim::NamedParameters params) {
    return std::make_unique<nn::optim::Sgd>(std::move(params), nn::optim::SgdOptions{.lr = 0.05, .momentum = 0.9});
  };
  std::unique_ptr<nn::optim::Optimizer> plain;
  std::unique_ptr<dist::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<dist::OverlappedZeroOptimizer> overlapped;
  if (FLAGS_zero_overlap) {
    overlapped = std::make_unique<dist::OverlappedZeroOptimizer>(ddp_model, make_sgd);
  } else if (FLAGS_zero) {
    zero = std::make_unique<dist::ZeroRedundancyOptimizer>(model->NamedParameters(), pg, make_sgd);
  } else {
    plain = make_sgd(model->NamedParameters());
  }

  const auto train = nn::data::LoadFashionMnist(FLAGS_data_dir, nn::data::Split::kTrain);
  // Every rank loads the same files: all of them refuse, or none. The test
  // set too (rank 0 evaluates after training): a shape found wrong there
  // would leave the other ranks waiting at the last barrier.
  if (!TakesTheImagesOf(*train, "training")) return 2;
  std::shared_ptr<nn::data::InMemoryImageDataset> test;
  if (FLAGS_eval) {
    test = nn::data::LoadFashionMnist(FLAGS_data_dir, nn::data::Split::kTest);
    if (!TakesTheImagesOf(*test, "test")) return 2;
  }
  nn::Generator gen(1);
  const Tensor perm = nn::RandPerm(train->Size(), gen);
  std::vector<int64_t> shard;
  for (int64_t i = rank; i < train->Size(); i += world) shard.push_back(perm.data<int64_t>()[i]);
  const int64_t bs = FLAGS_batch;
  // Batch i starts at (i * bs) % span, so a batch must leave part of the
  // shard out. Checked against the smallest shard, so that every rank agrees.
  const int64_t span = static_cast<int64_t>(shard.size()) - bs;
  const int64_t smallest = train->Size() / world;
  if (bs < 1 || bs >= smallest) {
    std::fprintf(stderr,
                 "ddp_bench: --batch=%d must be in [1, %lld): each of the %d ranks draws its batches from "
                 "its %lld-sample share of %s\n",
                 FLAGS_batch, static_cast<long long>(smallest), world, static_cast<long long>(smallest),
                 FLAGS_data_dir.c_str());
    return 2;
  }
  Tensor images = nn::Empty({bs, 1, 28, 28});
  Tensor labels = nn::Empty({bs}, {.dtype = nn::DType::kInt64});
  double loss_value = 0;
  auto step = [&](int64_t i) {
    Gather(*train, shard.data() + (i * bs) % span, bs, images, labels);
    if (zero) zero->ZeroGrad(); else if (plain) plain->ZeroGrad();
    Tensor loss = nn::loss::CrossEntropy(ddp_model(images), labels);
    nn::Backward(loss);
    if (zero) zero->Step(); else if (overlapped) overlapped->Step(); else plain->Step();
    if (averager) averager->AverageParameters(model->Parameters());
    loss_value = loss.Item();
  };
  for (int i = 0; i < 5; ++i) step(i);
  pg->Barrier().Wait();
  ddp_model.ResetStats();
  const auto t0 = std::chrono::steady_clock::now();
  const double cpu0 = ProcessCpuSeconds();
  for (int i = 0; i < FLAGS_steps; ++i) step(i + 5);
  const double cpu_ms = 1e3 * (ProcessCpuSeconds() - cpu0) / FLAGS_steps;
  // The timed steps' statistics, taken before the barrier below: its wait
  // for the slowest rank would otherwise count as peer wait and
  // communication-thread CPU time. The barrier still ends dt, so that the
  // rate is the slowest rank's.
  const dist::DdpStats stats = ddp_model.Stats();
  pg->Barrier().Wait();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  double acc = -1;
  if (FLAGS_eval && rank == 0) {
    model->Eval();
    nn::NoGradGuard no_grad;
    int64_t correct = 0;
    const int64_t eb = 1000;
    Tensor timages = nn::Empty({eb, 1, 28, 28});
    Tensor tlabels = nn::Empty({eb}, {.dtype = nn::DType::kInt64});
    std::vector<int64_t> idx(eb);
    for (int64_t k = 0; k < test->Size(); k += eb) {
      const int64_t n = std::min(eb, test->Size() - k);
      for (int64_t i = 0; i < n; ++i) idx[i] = k + i;
      Gather(*test, idx.data(), n, timages, tlabels);
      const Tensor pred = nn::ops::Argmax(model->Forward(timages.Narrow(0, 0, n)), 1);
      for (int64_t i = 0; i < n; ++i) correct += pred.data<int64_t>()[i] == tlabels.data<int64_t>()[i];
    }
    acc = static_cast<double>(correct) / static_cast<double>(test->Size());
  }
  if (rank == 0) {
    std::printf("%s %d %.1f %.4f %.4f %.3f %.3f %.3f %.0f %.3f %.3f %zu %.3f %.3f %.3f\n", FLAGS_model.c_str(),
                world, FLAGS_steps * bs * world / dt, loss_value, acc, stats.forward_ms,
                stats.backward_compute_ms, stats.backward_comm_ms, 100 * stats.overlap_fraction(),
                stats.exposed_ms, stats.comm_thread_cpu_ms, stats.bucket_bytes.size(),
                1e3 * dt / FLAGS_steps, cpu_ms, stats.peer_wait_ms);
    std::fflush(stdout);
  }
  // Everyone leaves together: rank 0 evaluated while the others waited.
  pg->Barrier().Wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage("DDP training throughput of the MLP or CNN (samples/s), one line per run, "
                          "comparable with PyTorch DDP");
  // Before the launch, which would start every rank to print gflags' help
  // of every linked library and exit 1: this program's flags, once.
  if (ddp::examples::ShowOwnHelpIfAsked(argc, argv, "examples/ddp_bench")) return 0;
  // Ctrl-C while the process that starts the ranks checks the flags and
  // the data is said in one line (it ended without a word), as train says it.
  namespace launch = ddp::transport::launch;
  if (!launch::HasLaunchVariables(launch::CurrentEnvironment())) ddp::examples::WatchSetupSignals("ddp_bench");
  if (const std::string problem = ddp::examples::CommandLineProblem(&argc, &argv, "examples/ddp_bench"); !problem.empty()) {
    ddp::examples::StopIfInterruptedInSetup();  // said already: the refusal is beside the point
    std::fprintf(stderr, "ddp_bench: %s\n", problem.c_str());
    return 2;
  }
  // Spawn the ranks before anything touches UCX, once the flags are found
  // fine (a wrong one said once, not by every rank); rank 0 alone prints.
  launch::SelfLaunchOrExit(argc, argv,
                           {.default_nproc_per_node = 2,
                            .prefix_output = false,
                            .check_arguments = [](int argc, char** argv) {
                              std::string problem = LaunchFlagProblem(argc, argv);
                              ddp::examples::EndSetup();
                              return problem;
                            }});
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  // Relative: the user's directory, not the runfiles folder of `bazel run`.
  FLAGS_data_dir = ddp::examples::UserPath(FLAGS_data_dir);
  FLAGS_trace_prefix = ddp::examples::UserPath(FLAGS_trace_prefix);
  try {
    return Run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench: %s\n", e.what());
    return 1;
  }
}
