// //examples:train: data-parallel training of an image classifier.
//
//   bazel run //examples:train                       # CNN on Fashion-MNIST, 2 ranks
//   bazel run //examples:train -- --help             # every flag
//   bazel run //examples:train -- --model=resnet50 --dataset=synthetic --max_steps=20
//   ddprun --nproc_per_node=4 bazel-bin/examples/train --epochs=1
//
// Without launch variables the binary starts its own ranks (SelfLaunch,
// before anything touches UCX); under ddprun, srun or mpirun it is one rank.
// Flags are checked once, before any rank starts, so that a mistake gets a
// single line that says how to fix it (exit status 2).

#include <gflags/gflags.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "examples/own_help.h"
#include "examples/setup_signals.h"
#include "examples/trainer/config.h"
#include "examples/trainer/parallel.h"
#include "examples/trainer/train_state.h"
#include "examples/trainer/trainer.h"
#include "examples/user_path.h"
#include "nn/ops/config.h"
#include "transport/launch/env.h"
#include "transport/launch/error_file.h"
#include "transport/launch/self_launch.h"

// Model and data.
DEFINE_string(model, "cnn", "model: cnn, mlp, resnet18, resnet34, resnet50");
DEFINE_string(dataset, "fashion_mnist",
              "dataset: fashion_mnist, mnist, cifar10 (binary batches), synthetic (generated "
              "images in CIFAR's 3x32x32 for ResNets, 28x28 for cnn and mlp)");
DEFINE_string(data_dir, "",
              "folder with the dataset's files (default for fashion_mnist: "
              "/usr/share/datasets/fashion-mnist, from the package dataset-fashion-mnist)");
DEFINE_int64(train_samples, 0, "train on the first N training samples only (0: all)");
DEFINE_int64(test_samples, 0, "evaluate on the first N test samples only (0: all)");
DEFINE_int32(workers, 1, "data loader threads per rank (0: load on the training thread)");
DEFINE_uint64(seed, 0, "seed of initialization, shuffling and augmentation");
// Schedule.
DEFINE_int64(epochs, 2, "passes over the training set");
DEFINE_int64(max_steps, 0, "stop after this many optimizer steps (0: no limit)");
DEFINE_int64(batch_size, 64,
             "samples per rank per micro-batch; a step takes --grad_accum_steps of them "
             "(default for ResNets: 256 / ranks)");
DEFINE_int64(grad_accum_steps, 1,
             "micro-batches per optimizer step; all but the last skip gradient "
             "synchronization (DDP's no_sync)");
DEFINE_int64(eval_every, 0,
             "steps between test-set evaluations (0: only at the end of each epoch)");
// Optimizer.
DEFINE_string(optimizer, "sgd", "optimizer: sgd, adam, adamw, adadelta, rmsprop, adagrad");
DEFINE_double(lr, 0.05,
              "learning rate (default 0.05; 0.1 for ResNets, 0.001 for adam and adamw, 1.0 "
              "for adadelta, 0.01 for rmsprop and adagrad)");
DEFINE_double(momentum, 0.9, "momentum of sgd (default 0.9) and rmsprop (default 0); not for the others");
DEFINE_double(weight_decay, 0, "L2 penalty (decoupled for adamw; default 1e-4 for ResNets)");
DEFINE_bool(decay_norm_and_bias, true,
            "apply --weight_decay to every parameter; false spares every parameter of at most one "
            "dimension (biases, and BatchNorm's weights and biases, --sync_bn's included), which then "
            "form a second parameter group without weight decay (needs --weight_decay above 0)");
DEFINE_string(scheduler, "cosine",
              "learning-rate schedule, stepped after each optimizer step: none, step (x --lr_gamma "
              "after each third of the run), multistep (x --lr_gamma at each of --lr_milestones), "
              "exponential (x --lr_gamma every step), cosine (to 0 at the last step), "
              "warm_restarts (cosine to 0 over --lr_t0 steps, then again, each cycle --lr_t_mult "
              "times the last), onecycle (from --lr/25 up to --lr over 30% of the run, then down "
              "to --lr/25e4; OneCycleLR, the momentum cycled with --cycle_momentum only), plateau "
              "(x --lr_gamma after more than --lr_patience epochs without a lower test loss, taken "
              "at each epoch end)");
DEFINE_double(lr_gamma, 0.1,
              "the rate's factor: for --scheduler=step after each third of the run, multistep at "
              "each milestone, exponential every optimizer step (needed: 0.999, say), plateau at "
              "each reduction (below 1)");
DEFINE_string(lr_milestones, "",
              "with --scheduler=multistep (needed): the optimizer steps at which the rate is "
              "multiplied by --lr_gamma, ascending, e.g. 1000,2000");
DEFINE_int64(lr_t0, 0, "with --scheduler=warm_restarts (needed): optimizer steps of the first cycle");
DEFINE_int64(lr_t_mult, 1,
             "with --scheduler=warm_restarts: each cycle is this many times as long as the last");
DEFINE_int64(lr_patience, 10,
             "with --scheduler=plateau: epochs without a lower test loss tolerated; the rate "
             "drops at the next one");
DEFINE_bool(cycle_momentum, false,
            "with --scheduler=onecycle: also cycle the momentum against the rate, from 0.95 down "
            "to 0.85 at the peak rate and back to 0.95 at the end (OneCycleLR's cycle_momentum, "
            "its default there); it replaces SGD's and RMSprop's --momentum, and Adam's and "
            "AdamW's beta1 (0.9); not with adadelta, adagrad, --momentum=0 or --zero");
DEFINE_string(amp, "off",
              "mixed precision: off, bf16, fp16; on the CPU a 16-bit model and activations "
              "with f32 master weights, on CUDA an f32 model under autocast; fp16 adds loss "
              "scaling");
// Data parallelism.
DEFINE_string(device, "cpu",
              "cpu, or cuda (needs a --config=cuda build; each rank uses the GPU of its local "
              "rank (LOCAL_RANK, SLURM_LOCALID or OMPI_COMM_WORLD_LOCAL_RANK) modulo the "
              "visible GPUs, so ranks may share one)");
DEFINE_bool(flush_denormal, true,
            "treat subnormal floats as zero on the CPU (x86 FTZ/DAZ): avoids a ~100x slow path "
            "in optimizer updates; false keeps IEEE subnormals (PyTorch's default)");
DEFINE_string(nproc_per_node, "2",
              "ranks to start on this machine: a number, gpu (one per visible GPU), cpu (one per "
              "CPU) or auto (gpu if any, else cpu); under ddprun, srun or mpirun, if given, it "
              "must match the launcher's ranks per node");
DEFINE_int32(max_restarts, 0,
             "when a rank fails, restart every rank up to N times; restarted ranks resume "
             "from this run's last checkpoint (refused under ddprun or torchrun: use their "
             "--max_restarts)");
DEFINE_bool(sync_bn, false, "synchronize BatchNorm statistics across ranks (ResNets)");
DEFINE_bool(zero, false,
            "shard the optimizer state across ranks (ZeRO stage 1); results are the same, each "
            "rank keeps the state of its own parameters only");
DEFINE_bool(zero_overlap, false,
            "with --zero: run each rank's optimizer step inside backward, on each gradient "
            "bucket as soon as it is reduced, instead of after backward (CPU; the default "
            "--comm_hook only)");
DEFINE_double(bucket_cap_mb, 25, "gradient bucket size in MiB for the overlapped all-reduce");
DEFINE_string(comm_hook, "allreduce",
              "how gradient buckets are reduced: allreduce, fp16 or bf16 (half the bytes on the "
              "wire), powersgd (rank-1 PowerSGD after --powersgd_start_step)");
DEFINE_int64(powersgd_start_step, 1000,
             "with --comm_hook=powersgd: optimizer steps all-reduced in full before compression "
             "starts (PyTorch's start_powerSGD_iter; 0: compress from the first step); must be "
             "below the run's last step");
DEFINE_int64(timeout_s, 300,
             "deadline of every collective in seconds: a rank that stops responding (hung, "
             "stopped, cut off) fails the job after this long");
DEFINE_bool(find_unused_parameters, false,
            "allow parameters that get no gradient in an iteration");
DEFINE_bool(ddp_stats, false,
            "print DDP's runtime statistics (forward, backward, communication, overlap, and each "
            "rank's wait for the others: the straggler waits least) per epoch");
DEFINE_bool(trace, false,
            "write a Chrome trace per rank (trace_rank<N>.json in --log_dir, else the "
            "working directory); one that is a FIFO or a terminal takes that rank's trace "
            "streamed, ended when the rank ends (mkfifo logs/trace_rank0.json; cat "
            "logs/trace_rank0.json), and its reader must open it within 30 s of the start (at most "
            "half --timeout_s)");
// Files.
DEFINE_string(checkpoint, "auto",
              "checkpoint path, saved by rank 0 at each epoch end; auto: "
              "~/.cache/ddp/checkpoints/<model>_<dataset>.safetensors; none: no checkpoints");
DEFINE_int64(checkpoint_every, 0, "also save every N steps (0: at epoch ends only)");
DEFINE_int64(save_timeout_s, 1800,
             "deadline of a checkpoint save, and of --resume's read, in seconds: the other ranks "
             "wait this long for rank 0's write or read (a large model, a slow disk), not "
             "--timeout_s");
DEFINE_int64(save_stop_grace_s, 60,
             "once a checkpoint's write or read ran past --save_timeout_s and was told to stop, how "
             "many seconds more rank 0 waits for it to end before it leaves it behind (a write stuck "
             "in the filesystem) and the run fails; the file at --checkpoint stays as it was");
DEFINE_bool(resume, false,
            "continue from --checkpoint (model, optimizer, schedule, epoch and position in it); "
            "the schedule as saved: the same --scheduler, --lr, --lr_* flags, and --epochs and "
            "--max_steps that end it where it ended (other ones are fine with multistep, "
            "exponential, warm_restarts and plateau; --comm_hook=powersgd's iteration and "
            "low-rank state are saved too, so compression goes on where it was)");
DEFINE_string(log_dir, "",
              "write metrics.csv and chart.svg (loss and accuracy over steps) into this folder (an "
              "earlier run's there are kept as metrics.prev.csv and chart.prev.svg; --resume "
              "continues them instead when they are the checkpoint's run's, named in metrics.run); "
              "a named pipe (mkfifo) or a terminal already at metrics.csv "
              "gets the rows as a stream, line by line (its reader must open it within 10 s of the "
              "start)");
DEFINE_int64(log_every, 10, "with --log_dir (needed): steps per metrics.csv row");

// gflags' own help flags (defined in gflags_reporting.cc).
DECLARE_bool(help);
DECLARE_bool(helpshort);

namespace {

using ddp::examples::trainer::TrainConfig;
using ddp::examples::trainer::UsageError;

constexpr char kProgram[] = "train";

std::atomic<int> g_stop{0};
// CLOCK_MONOTONIC of the first stop signal in nanoseconds (0: none yet).
std::atomic<int64_t> g_stop_at_ns{0};

// A repeat of the first stop signal this soon after it is the same request
// delivered twice, not a second one: SLURM's scancel and systemd's stop send
// SIGTERM to every process of the job, and the launcher forwards its own.
constexpr int64_t kRepeatWindowNs = 2'000'000'000;

int64_t MonotonicNs() {  // async-signal-safe
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// Records stop signal `signo` sent by `sender` (0: by the kernel, a
// terminal's Ctrl-C); true when it asks to end the process now instead.
// The first signal asks for a stop at the next step and a checkpoint. Not a
// second request, so no reason to end at once: anything from the parent (a
// launcher forwards what it gets, and answers a second Ctrl-C itself with
// SIGKILL), and the same signal again within kRepeatWindowNs. A second
// Ctrl-C pressed after that ends the process. Async-signal-safe.
bool EndsNow(int signo, pid_t sender) {
  const int64_t now = MonotonicNs();
  int none = 0;
  if (g_stop.compare_exchange_strong(none, signo)) {
    g_stop_at_ns.store(now);
    return false;
  }
  if (sender != 0 && sender == getppid()) return false;
  const int64_t first_at = g_stop_at_ns.load();
  // 0: the first one's time is being stored by another thread just now.
  if (signo == g_stop.load() && (first_at == 0 || now - first_at < kRepeatWindowNs)) return false;
  return true;
}

// The sender of a signal: its pid when a process sent it (kill, sigqueue),
// 0 when the kernel did.
pid_t Sender(const siginfo_t& info) { return info.si_code <= 0 ? info.si_pid : 0; }

void OnStopSignal(int signo, siginfo_t* info, void*) {
  if (!EndsNow(signo, info != nullptr ? Sender(*info) : 0)) return;
  std::signal(signo, SIG_DFL);
  std::raise(signo);
}

// SIGINT and SIGTERM must not interrupt the training thread: a handler
// that ran on it while oneDNN's code was computing was followed by heap
// corruption in about 1 of 20 interrupted runs ("corrupted size vs.
// prev_size" at the next free inside dnnl_sgemm; 0 of 180 runs once the
// thread blocked the signals). So this thread, and every thread it starts
// later, blocks them; a thread of its own takes them with sigwaitinfo.
// Threads that libraries started before main (OpenBLAS's pool, idle) may
// still take one, hence the handler as well.
void WatchStopSignals() {
  struct sigaction action{};
  action.sa_sigaction = OnStopSignal;
  action.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGHUP, &action, nullptr);  // a closed terminal or ssh session
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    for (;;) {
      siginfo_t info{};
      const int signo = sigwaitinfo(&set, &info);
      if (signo < 0 || !EndsNow(signo, Sender(info))) continue;
      // Asked again: the default action, now.
      std::signal(signo, SIG_DFL);
      sigset_t one;
      sigemptyset(&one);
      sigaddset(&one, signo);
      pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
      raise(signo);
    }
  }).detach();
}

// The flags of this file, grouped as --help shows them.
const std::vector<std::pair<const char*, std::vector<const char*>>>& HelpSections() {
  static const std::vector<std::pair<const char*, std::vector<const char*>>> kSections = {
      {"Model and data",
       {"model", "dataset", "data_dir", "train_samples", "test_samples", "workers", "seed"}},
      {"Schedule", {"epochs", "max_steps", "batch_size", "grad_accum_steps", "eval_every"}},
      {"Optimizer",
       {"optimizer", "lr", "momentum", "weight_decay", "decay_norm_and_bias", "scheduler", "lr_gamma",
        "lr_milestones", "lr_t0", "lr_t_mult", "lr_patience", "cycle_momentum", "amp"}},
      {"Device", {"device", "flush_denormal"}},
      {"Data parallelism",
       {"nproc_per_node", "max_restarts", "sync_bn", "zero", "zero_overlap", "bucket_cap_mb",
        "comm_hook", "powersgd_start_step", "find_unused_parameters", "ddp_stats", "trace",
        "timeout_s"}},
      {"Checkpoints and logs",
       {"checkpoint", "checkpoint_every", "save_timeout_s", "save_stop_grace_s", "resume", "log_dir",
        "log_every"}},
  };
  return kSections;
}

constexpr size_t kHelpWidth = 100;
constexpr size_t kHelpIndent = 30;

// "0.05" rather than gflags' "0.050000000000000003".
std::string FormatDouble(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// Breaks text into lines of at most `width` characters at spaces.
std::vector<std::string> Wrap(const std::string& text, size_t width) {
  std::vector<std::string> lines(1);
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(' ', pos);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(pos, end - pos);
    if (!lines.back().empty() && lines.back().size() + 1 + word.size() > width) lines.emplace_back();
    if (!lines.back().empty()) lines.back() += ' ';
    lines.back() += word;
    pos = end + 1;
  }
  return lines;
}

// gflags' --help lists the flags of every linked library; this lists the
// trainer's own, grouped, with their defaults. --helpfull still shows all.
void PrintHelp() {
  std::vector<gflags::CommandLineFlagInfo> all;
  gflags::GetAllFlags(&all);
  std::map<std::string, gflags::CommandLineFlagInfo> mine;
  for (const auto& f : all) {
    if (f.filename.find("examples/train_main.cc") != std::string::npos) mine[f.name] = f;
  }
  std::printf(
      "Trains an image classifier on several ranks with DistributedDataParallel.\n"
      "\n"
      "Usage: bazel run //examples:train -- [--flag=value ...]\n"
      "       ddprun --nproc_per_node=N bazel-bin/examples/train [flags]   (also srun, mpirun)\n"
      "\n"
      "With no flags: the CNN on Fashion-MNIST, 2 ranks, 2 epochs, SGD lr 0.05 momentum 0.9\n"
      "with cosine decay, batch 64 per rank, test-set evaluation after each epoch, and a\n"
      "checkpoint in ~/.cache/ddp/checkpoints. The last line is machine-readable:\n"
      "  RESULT model=... ranks=... epochs=... samples_per_s=... train_loss=... test_acc=... "
      "wall_s=...\n");
  auto print = [](const gflags::CommandLineFlagInfo& f) {
    std::string head = "  --" + f.name;
    if (f.type == "bool") {
      head += f.default_value == "true" ? " (default on)" : "";
    } else if (f.type == "double") {
      head += "=" + FormatDouble(std::stod(f.default_value));
    } else {
      head += "=" + (f.default_value.empty() ? std::string("\"\"") : f.default_value);
    }
    const std::vector<std::string> lines = Wrap(f.description, kHelpWidth - kHelpIndent);
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i == 0 && head.size() < kHelpIndent) {
        std::printf("%-*s%s\n", static_cast<int>(kHelpIndent), head.c_str(), lines[0].c_str());
        continue;
      }
      if (i == 0) std::printf("%s\n", head.c_str());
      std::printf("%-*s%s\n", static_cast<int>(kHelpIndent), "", lines[i].c_str());
    }
  };
  for (const auto& [title, names] : HelpSections()) {
    std::printf("\n%s\n", title);
    for (const char* name : names) {
      auto it = mine.find(name);
      if (it == mine.end()) continue;
      print(it->second);
      mine.erase(it);
    }
  }
  if (!mine.empty()) {
    std::printf("\nOther\n");
    for (const auto& [name, f] : mine) print(f);
  }
  std::printf(
      "\nCtrl-C (or SIGTERM, SIGHUP) stops every rank at the same step, one step later;\n"
      "rank 0 saves a checkpoint there first. --helpfull lists the flags of the libraries\n"
      "too.\n");
}

bool IsDefault(const char* flag) { return gflags::GetCommandLineFlagInfoOrDie(flag).is_default; }

#ifdef DDP_TRAIN_SETUP_HOLD_FOR_TESTING
// Built into //examples:train_setup_hold only, for train_setup_test: holds
// the launcher in its setup where CheckSetup starts (past the last
// StopIfInterruptedInSetup before the data is read and the folders are
// made), so that the test can send a signal there. It opens the FIFO that
// $DDP_TRAIN_SETUP_HOLD names and reads it until the test closes its end;
// the test's own deadline bounds the wait (it kills the program when it
// gives up).
void HoldSetupForTesting() {
  const char* fifo = std::getenv("DDP_TRAIN_SETUP_HOLD");
  if (fifo == nullptr) return;
  std::ifstream in(fifo, std::ios::binary);
  const std::string rest{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Also for train_setup_test: where $DDP_TRAIN_THROW_FOR_TESTING names
// `where` ("setup": the launcher's check; "rank": a rank's run; "main":
// outside both), throws an object that is not a std::exception, as a
// library might.
void ThrowIfAskedForTesting(const char* where) {
  struct NotAStdException {};
  const char* asked = std::getenv("DDP_TRAIN_THROW_FOR_TESTING");
  if (asked != nullptr && std::strcmp(asked, where) == 0) throw NotAStdException{};
}
#endif

// What a caught exception that is not a std::exception is said as.
constexpr char kNotAStdException[] = "error: an exception that is not a std::exception";

// Why an empty path flag given on the command line is refused, or "". Each
// one's empty value means something other than a path (no checkpoints, no
// metrics, the dataset's usual folder), so `--checkpoint="$CKPT"` with CKPT
// unset would train for hours and save nothing (and each --max_restarts
// restart start over): an empty value is a mistake, said at once.
std::string EmptyPathFlagProblem() {
  if (!IsDefault("checkpoint") && FLAGS_checkpoint.empty()) {
    return "--checkpoint is empty; give a path, auto (the default: "
           "~/.cache/ddp/checkpoints/<model>_<dataset>.safetensors), or none to save no "
           "checkpoints";
  }
  if (!IsDefault("log_dir") && FLAGS_log_dir.empty()) {
    return "--log_dir is empty; give a folder for metrics.csv and chart.svg, or drop the flag to "
           "write none";
  }
  if (!IsDefault("data_dir") && FLAGS_data_dir.empty()) {
    return "--data_dir is empty; give the dataset's folder, or drop the flag to read its usual "
           "one";
  }
  return "";
}

[[noreturn]] void Fail(int status, int rank, int world_size, const std::string& message,
                       bool from_lead = false);

TrainConfig ConfigFromFlags(int world_size) {
  TrainConfig c;
  c.model = FLAGS_model;
  c.dataset = FLAGS_dataset;
  c.data_dir = FLAGS_data_dir;
  c.train_samples = FLAGS_train_samples;
  c.test_samples = FLAGS_test_samples;
  c.workers = FLAGS_workers;
  c.seed = FLAGS_seed;
  c.epochs = FLAGS_epochs;
  c.max_steps = FLAGS_max_steps;
  c.batch_size = FLAGS_batch_size;
  c.grad_accum_steps = FLAGS_grad_accum_steps;
  c.eval_every = FLAGS_eval_every;
  c.optimizer = FLAGS_optimizer;
  c.lr = FLAGS_lr;
  c.momentum = FLAGS_momentum;
  c.weight_decay = FLAGS_weight_decay;
  c.decay_norm_and_bias = FLAGS_decay_norm_and_bias;
  c.scheduler = FLAGS_scheduler;
  // Unset, the schedule's default (and refused for exponential, which has none).
  if (!IsDefault("lr_gamma")) c.lr_gamma = FLAGS_lr_gamma;
  try {
    c.lr_milestones = ddp::examples::trainer::ParseMilestones(FLAGS_lr_milestones);
  } catch (const UsageError& e) {
    Fail(2, 0, 1, e.what());
  }
  c.lr_t0 = FLAGS_lr_t0;
  c.lr_t_mult = FLAGS_lr_t_mult;
  c.lr_patience = FLAGS_lr_patience;
  c.cycle_momentum = FLAGS_cycle_momentum;
  for (const char* flag : {"lr_t0", "lr_t_mult", "lr_patience"}) {
    if (!IsDefault(flag)) c.schedule_flags_given.emplace_back(flag);
  }
  c.amp = FLAGS_amp;
  c.device = FLAGS_device;
  c.flush_denormal = FLAGS_flush_denormal;
  c.sync_bn = FLAGS_sync_bn;
  c.zero = FLAGS_zero;
  c.zero_overlap = FLAGS_zero_overlap;
  c.bucket_cap_mb = FLAGS_bucket_cap_mb;
  c.comm_hook = FLAGS_comm_hook;
  c.powersgd_start_step = FLAGS_powersgd_start_step;
  c.timeout_s = FLAGS_timeout_s;
  c.find_unused_parameters = FLAGS_find_unused_parameters;
  c.ddp_stats = FLAGS_ddp_stats;
  c.trace = FLAGS_trace;
  c.checkpoint = FLAGS_checkpoint;
  c.checkpoint_every = FLAGS_checkpoint_every;
  c.save_timeout_s = FLAGS_save_timeout_s;
  c.save_stop_grace_s = FLAGS_save_stop_grace_s;
  c.resume = FLAGS_resume;
  c.log_dir = FLAGS_log_dir;
  c.log_every = FLAGS_log_every;

  // Defaults that depend on the model or optimizer, for flags not given.
  const bool resnet = c.model.rfind("resnet", 0) == 0;
  if (resnet) {
    // The DDP tutorials' ResNet recipe: global batch 256, lr 0.1, wd 1e-4.
    if (IsDefault("batch_size")) c.batch_size = std::max(1, 256 / std::max(1, world_size));
    if (IsDefault("lr")) c.lr = 0.1;
    if (IsDefault("weight_decay")) c.weight_decay = 1e-4;
  }
  if (c.optimizer != "sgd") {
    if (IsDefault("momentum")) c.momentum = 0;
    if (IsDefault("lr")) {
      // PyTorch's defaults; Adam's is 1e-3.
      c.lr = c.optimizer == "adadelta" ? 1.0 : c.optimizer == "rmsprop" || c.optimizer == "adagrad" ? 1e-2 : 1e-3;
    }
  }
  return c;
}

// Under a launcher (launch variables set; call only there): refuses a
// --nproc_per_node that is not one of torchrun's forms, or that asks for
// another number of ranks per node than the launcher started, as every
// self-launching binary does. SelfLaunch under a launcher starts nothing; it
// checks the flag and words the refusal, naming the launch variables.
// Dropped, the flag would leave a job of another size than asked for
// without a word.
ddp::transport::Status CheckNprocPerNodeUnderLauncher(const std::string& program,
                                                      const std::string& nproc_per_node) {
  std::string arg0 = program;
  std::string flag = "--nproc_per_node=" + nproc_per_node;
  char* argv[] = {arg0.data(), flag.data(), nullptr};
  int argc = 2;
  auto launched = ddp::transport::launch::SelfLaunch(argc, argv);
  if (!launched.ok()) return launched.status();
  return ddp::transport::Status::Ok();
}

// `args` (argv[0] first) without flag `name` in any form gflags takes:
// --name=V, -name=V, or --name V and -name V as two arguments; nothing after
// "--", which ends the flags.
std::vector<std::string> WithoutFlag(const std::vector<std::string>& args, const std::string& name) {
  std::vector<std::string> out;
  bool flags_ended = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (i == 0 || flags_ended) {
      out.push_back(a);
      continue;
    }
    if (a == "--") flags_ended = true;
    const std::string bare = a.rfind("--", 0) == 0 ? a.substr(2) : a.rfind("-", 0) == 0 ? a.substr(1) : "";
    if (bare.rfind(name + "=", 0) == 0) continue;
    if (bare == name) {
      ++i;  // and its value
      continue;
    }
    out.push_back(a);
  }
  return out;
}

// Prints `message` (one rank's failure) and exits with `status`. A failure
// that the rank learned from rank 0 (`from_lead`, see
// trainer::FromLead) is printed in full by rank 0 alone; the others say in
// a short line that they stopped with it, as torchrun's workers report
// their own failures only. The launcher's error file gets the whole reason
// from every rank, for its summary of whichever rank ended first.
[[noreturn]] void Fail(int status, int rank, int world_size, const std::string& message,
                       bool from_lead) {
  ddp::examples::StopIfInterruptedInSetup();  // said already: the refusal is beside the point
  std::fflush(stdout);
  if (world_size > 1 && rank > 0 && from_lead) {
    std::fprintf(stderr, "%s: rank %d: stopped with rank 0, whose output gives the reason\n", kProgram, rank);
  } else if (world_size > 1 && rank > 0) {
    std::fprintf(stderr, "%s: rank %d: %s\n", kProgram, rank, message.c_str());
  } else {
    std::fprintf(stderr, "%s: %s\n", kProgram, message.c_str());
  }
  std::fflush(stderr);
  // For the launcher's report (ddprun, torchrun, this program's own): a
  // worker's reason is then there even when its output went to a log file.
  (void)ddp::transport::launch::RecordWorkerError(message);
  std::exit(status);
}

}  // namespace

namespace {

// The program, called by main, which catches what it throws past its own
// handlers.
int TrainMain(int argc, char** argv) {
  const auto start = std::chrono::steady_clock::now();
  namespace launch = ddp::transport::launch;
  const bool is_worker = launch::HasLaunchVariables(launch::CurrentEnvironment());
  // A rank's own setup is short; its signals are watched from before it
  // starts a thread (WatchStopSignals).
  if (!is_worker) ddp::examples::WatchSetupSignals(kProgram);
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-h") == 0) argv[i] = const_cast<char*>("--help");
  }
  gflags::SetUsageMessage("trains an image classifier data-parallel; see --help");
  // A --flagfile that is a stream (a FIFO, <(...), /dev/stdin) can be read
  // once: its flags take its place here, for gflags and for the ranks.
  if (const std::string problem = ddp::examples::CommandLineProblem(&argc, &argv, "examples/train_main");
      !problem.empty()) {
    Fail(2, 0, 1, problem);
  }
  // SelfLaunch re-executes this program with these arguments, so keep them
  // before gflags reorders them.
  std::vector<std::string> original(argv, argv + argc);
  gflags::ParseCommandLineNonHelpFlags(&argc, &argv, /*remove_flags=*/true);
  if (FLAGS_help || FLAGS_helpshort) {
    PrintHelp();
    return 0;
  }
  gflags::HandleCommandLineHelpFlags();  // --helpfull, --version, ...
  ddp::examples::StopIfInterruptedInSetup();  // a --flagfile can take its time to read
  // Output into a pipe whose reader is gone (`train ... | tee log`, and
  // Ctrl-C ends tee as well) must not end a rank before it saves, nor the
  // launcher, whose end ends the ranks: a write fails with EPIPE instead,
  // and the console stops printing. (Workers start with the default
  // action, see spawn.cc, and set this again.)
  std::signal(SIGPIPE, SIG_IGN);
  if (argc > 1) {
    Fail(2, 0, 1, std::string("unexpected argument '") + argv[1] +
                      "'; flags are written --name=value (see --help)");
  }

  if (const std::string problem = EmptyPathFlagProblem(); !problem.empty()) Fail(2, 0, 1, problem);

  if (FLAGS_max_restarts < 0) {
    Fail(2, 0, 1, "--max_restarts=" + std::to_string(FLAGS_max_restarts) + " must not be negative");
  }
  int world_size = 1;
  int rank = 0;
  int restart = 0;
  int local_rank = 0;  // LOCAL_RANK, or srun's and mpirun's own variable
  std::string job_token;
  std::string run_id;
  if (is_worker) {
    auto env = launch::LaunchEnvFromProcess();
    if (!env.ok()) Fail(2, 0, 1, env.status().message());
    world_size = env->world_size;
    rank = env->rank;
    restart = env->restart_count;
    local_rank = env->local_rank;
    job_token = env->job_token;
    run_id = env->run_id;
    if (!IsDefault("nproc_per_node")) {
      const ddp::transport::Status refused =
          CheckNprocPerNodeUnderLauncher(original[0], FLAGS_nproc_per_node);
      if (!refused.ok()) Fail(2, rank, world_size, refused.message());
    }
    // Only this program's own launcher restarts ranks (and it hands its
    // workers the command line without the flag): here the flag would be
    // dropped, and a failed rank would end the job that was to survive it.
    if (FLAGS_max_restarts > 0) {
      const std::string n = std::to_string(FLAGS_max_restarts);
      Fail(2, rank, world_size,
           "--max_restarts=" + n + " restarts the ranks this program starts itself, and this "
           "process is one rank of a job another launcher started (ddprun, torchrun, srun, "
           "mpirun); drop --max_restarts and give it to the launcher (ddprun --max_restarts=" + n +
           ", torchrun --max_restarts=" + n + ")");
    }
  } else {
    // torchrun's forms, resolved as SelfLaunch resolves them (it reads the
    // flag again from the original arguments).
    auto nproc = launch::ParseNprocPerNode(FLAGS_nproc_per_node, launch::CurrentEnvironment());
    if (!nproc.ok()) Fail(2, 0, 1, nproc.status().message());
    world_size = *nproc;
  }

  TrainConfig config = ConfigFromFlags(world_size);
  ddp::examples::trainer::ResolvePaths(config);
  config.job = ddp::examples::trainer::JobFingerprint(job_token, run_id);

  if (!is_worker) {
    // The launcher checks once, then starts the ranks; it never touches UCX.
    ddp::examples::StopIfInterruptedInSetup();
#ifdef DDP_TRAIN_SETUP_HOLD_FOR_TESTING
    HoldSetupForTesting();
#endif
    // The folders it makes last (--checkpoint's, --log_dir) go again when
    // a signal taken meanwhile, or before the ranks start, ends the run:
    // it would leave them empty.
    std::vector<std::string> made_folders;
    try {
#ifdef DDP_TRAIN_SETUP_HOLD_FOR_TESTING
      ThrowIfAskedForTesting("setup");
#endif
      ddp::examples::trainer::CheckSetup(config, world_size, &made_folders);
    } catch (const UsageError& e) {
      Fail(2, 0, 1, e.what());
    } catch (const std::exception& e) {
      Fail(1, 0, 1, std::string("error: ") + e.what());
    } catch (...) {
      Fail(1, 0, 1, kNotAStdException);
    }
    ddp::examples::RemoveIfInterruptedInSetup(made_folders);
    // More ranks than the CPUs this process may use still start (a check
    // of many ranks may want that), but each step then waits for ranks
    // that share a core: said once, before they start.
    const auto cpus = launch::ParseNprocPerNode("cpu", launch::CurrentEnvironment());
    if (cpus.ok() && world_size > *cpus) {
      std::fprintf(stderr,
                   "train: note: %d ranks on %d usable CPUs: ranks share cores and every step waits for "
                   "the slowest (--nproc_per_node=cpu starts one per CPU)\n",
                   world_size, *cpus);
    }
    // The workers run with the launch variables set, where --max_restarts
    // is refused: it is this launcher's flag, as --nproc_per_node, which
    // SelfLaunch takes out itself. Taken out of the command line, and set
    // to 0 after every other flag (gflags keeps the last value), since one
    // from --flagfile or --fromenv/--tryfromenv would reach the workers
    // too. Before a "--", which ends the flags.
    std::vector<std::string> worker_args = WithoutFlag(original, "max_restarts");
    const auto flags_end = std::find(worker_args.begin() + 1, worker_args.end(), "--");
    worker_args.insert(flags_end, "--max_restarts=0");
    std::vector<char*> args;
    for (std::string& s : worker_args) args.push_back(s.data());
    args.push_back(nullptr);
    int args_count = static_cast<int>(worker_args.size());
    launch::SelfLaunchOptions options;
    options.default_nproc_per_node = world_size;
    options.max_restarts = FLAGS_max_restarts;
    // Only rank 0 prints progress, and it needs the terminal itself (not a
    // pipe) to draw the live bar; other ranks print errors only, prefixed.
    options.prefix_output = false;
    // After forwarding Ctrl-C or SIGTERM, time for the ranks to finish the
    // step, agree to stop and save the checkpoint before SIGKILL: the save
    // may take up to --save_timeout_s, and a write stuck past it up to
    // --save_stop_grace_s more (the ranks end it there themselves). A
    // second Ctrl-C does not wait.
    options.grace = std::chrono::seconds(30 + config.save_timeout_s + config.save_stop_grace_s);
    // The ranks learn from it whether a restart follows a failure (said
    // in rank 0's "stopped by" line), as ddprun's and torchrun's ranks do;
    // they count the restarts in DDP_RESTART_COUNT, which SelfLaunch sets.
    setenv("TORCHELASTIC_MAX_RESTARTS", std::to_string(FLAGS_max_restarts).c_str(), 1);
    unsetenv("TORCHELASTIC_RESTART_COUNT");
    ddp::examples::EndSetupSignals();
    ddp::examples::StopIfInterruptedInSetup();
    launch::SelfLaunchOrExit(args_count, args.data(), options);
    return 0;  // not reached: the launcher exits with the workers' status
  }

  // One rank from here on. Before any thread starts: threads inherit it.
  ddp::nn::ops::SetFlushDenormal(config.flush_denormal);
  WatchStopSignals();
  ddp::examples::trainer::RunOptions options;
  options.stop = &g_stop;
  options.local_rank = local_rank;
  options.start_time = start;
  try {
#ifdef DDP_TRAIN_SETUP_HOLD_FOR_TESTING
    ThrowIfAskedForTesting("rank");
#endif
    // Before JoinJob, which takes --timeout_s as its deadline.
    ddp::examples::trainer::ValidateConfig(config);
    std::unique_ptr<ddp::examples::trainer::Parallel> parallel =
        ddp::examples::trainer::JoinJob(config.log_dir.empty()
                                            ? ddp::examples::UserWorkingDirectory()
                                            : config.log_dir,
                                        std::chrono::seconds(config.timeout_s));
    if (restart > 0) {
      // A restarted job continues from its own last checkpoint, if any.
      const std::string note = ddp::examples::trainer::FollowRankZeroOnRestart(config, restart, *parallel);
      if (!note.empty()) {
        std::printf("%s\n", note.c_str());
        std::fflush(stdout);
      }
    }
    const auto result = ddp::examples::trainer::Train(config, *parallel, options);
    parallel.reset();
    if (result.stopped_by_signal != 0) return 128 + result.stopped_by_signal;
    return 0;
  } catch (const UsageError& e) {
    Fail(2, rank, world_size, e.what(), ddp::examples::trainer::IsFromLead(e));
  } catch (const ddp::examples::trainer::JobError& e) {
    if (g_stop.load() != 0) return 128 + g_stop.load();
    Fail(1, rank, world_size, e.what(), ddp::examples::trainer::IsFromLead(e));
  } catch (const std::exception& e) {
    if (g_stop.load() != 0) return 128 + g_stop.load();
    Fail(1, rank, world_size, std::string("error: ") + e.what());
  } catch (...) {
    if (g_stop.load() != 0) return 128 + g_stop.load();
    Fail(1, rank, world_size, kNotAStdException);
  }
}

}  // namespace

// Anything thrown past TrainMain's own handlers (there, the rank is known)
// ends the program with its one line and exit status 1, as every failure
// does; uncaught, it aborted the program (status 134, and a core file)
// with the C++ runtime's words instead.
int main(int argc, char** argv) {
  try {
#ifdef DDP_TRAIN_SETUP_HOLD_FOR_TESTING
    ThrowIfAskedForTesting("main");
#endif
    return TrainMain(argc, argv);
  } catch (const std::exception& e) {
    Fail(1, 0, 1, std::string("error: ") + e.what());
  } catch (...) {
    Fail(1, 0, 1, kNotAStdException);
  }
}
