#include "examples/trainer/config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "examples/user_path.h"

namespace ddp::examples::trainer {
namespace {

bool Contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

std::string OneOf(const std::vector<std::string>& names) {
  std::string out = "one of ";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ", ";
    out += names[i];
  }
  return out;
}

void ValidateConfig(const TrainConfig& c) {
  if (!Contains(ModelNames(), c.model)) {
    throw UsageError("unknown --model=" + c.model + "; use " + OneOf(ModelNames()));
  }
  if (!Contains(DatasetNames(), c.dataset)) {
    throw UsageError("unknown --dataset=" + c.dataset + "; use " + OneOf(DatasetNames()));
  }
  const std::vector<std::string> optimizers = {"sgd", "adam", "adamw", "adadelta"};
  if (!Contains(optimizers, c.optimizer)) {
    throw UsageError("unknown --optimizer=" + c.optimizer + "; use " + OneOf(optimizers));
  }
  const std::vector<std::string> schedulers = {"none", "step", "cosine"};
  if (!Contains(schedulers, c.scheduler)) {
    throw UsageError("unknown --scheduler=" + c.scheduler + "; use " + OneOf(schedulers));
  }
  const std::vector<std::string> hooks = {"allreduce", "fp16", "bf16", "powersgd"};
  if (!Contains(hooks, c.comm_hook)) {
    throw UsageError("unknown --comm_hook=" + c.comm_hook + "; use " + OneOf(hooks));
  }
  const std::vector<std::string> amps = {"off", "bf16", "fp16"};
  if (!Contains(amps, c.amp)) {
    throw UsageError("unknown --amp=" + c.amp + "; use " + OneOf(amps));
  }
  // The name before the combinations below, which compare it with "cpu"
  // and "cuda"; whether this build has CUDA is CheckDeviceFlag's to say.
  if (c.device != "cpu" && c.device != "cuda") {
    throw UsageError("unknown --device=" + c.device + "; use cpu or cuda");
  }
  auto positive = [](const char* flag, int64_t v) {
    if (v < 1) {
      throw UsageError(std::string("--") + flag + "=" + std::to_string(v) +
                       " must be at least 1");
    }
  };
  // Counts stay integers in the message: "--max_steps=-5", not "-5.000000".
  auto not_negative = [](const char* flag, int64_t v) {
    if (v < 0) {
      throw UsageError(std::string("--") + flag + "=" + std::to_string(v) + " must be at least 0");
    }
  };
  auto non_negative = [](const char* flag, double v) {
    if (!(v >= 0) || !std::isfinite(v)) {
      throw UsageError(std::string("--") + flag + "=" + std::to_string(v) +
                       " must be a finite number >= 0");
    }
  };
  // Upper bounds keep the step and sample counts (epochs times steps,
  // batch times ranks times micro-batches) and the deadlines in nanoseconds
  // far from overflowing 64 bits.
  auto at_most = [](const char* flag, int64_t v, int64_t most, const char* unit) {
    if (v > most) {
      throw UsageError(std::string("--") + flag + "=" + std::to_string(v) + " is more than " +
                       std::to_string(most) + unit);
    }
  };
  positive("epochs", c.epochs);
  at_most("epochs", c.epochs, 1000000, "");
  positive("batch_size", c.batch_size);
  positive("grad_accum_steps", c.grad_accum_steps);
  at_most("grad_accum_steps", c.grad_accum_steps, 65536, "");
  positive("log_every", c.log_every);
  positive("timeout_s", c.timeout_s);
  at_most("timeout_s", c.timeout_s, 7 * 24 * 3600, " (7 days)");
  not_negative("max_steps", c.max_steps);
  not_negative("eval_every", c.eval_every);
  not_negative("checkpoint_every", c.checkpoint_every);
  positive("save_timeout_s", c.save_timeout_s);
  at_most("save_timeout_s", c.save_timeout_s, 7 * 24 * 3600, " (7 days)");
  not_negative("train_samples", c.train_samples);
  not_negative("test_samples", c.test_samples);
  not_negative("workers", c.workers);
  not_negative("powersgd_start_step", c.powersgd_start_step);
  non_negative("lr", c.lr);
  non_negative("momentum", c.momentum);
  non_negative("weight_decay", c.weight_decay);
  if (c.lr == 0) throw UsageError("--lr=0 would never change the model; use a positive value");
  if (c.workers > 64) {
    throw UsageError("--workers=" + std::to_string(c.workers) +
                     " loader threads per rank is too many; use at most 64");
  }
  // Past 1 TiB no model has a bucket to fill; DDP's own bound (2^40 MiB)
  // would be met only after the data is loaded, naming its option.
  if (!(c.bucket_cap_mb > 0) || !(c.bucket_cap_mb <= 1048576)) {
    char given[32];
    std::snprintf(given, sizeof(given), "%g", c.bucket_cap_mb);
    throw UsageError("--bucket_cap_mb=" + std::string(given) +
                     " must be a positive number of MiB, at most 1048576 (1 TiB)");
  }
  if (c.momentum > 0 && c.optimizer != "sgd") {
    // Adam's betas play momentum's part; a silently ignored flag misleads.
    // (The default momentum is only applied with sgd; see train_main.cc.)
    throw UsageError("--momentum applies to --optimizer=sgd only; drop it for --optimizer=" +
                     c.optimizer);
  }
  if (c.momentum >= 1) {
    throw UsageError("--momentum=" + std::to_string(c.momentum) + " must be below 1");
  }
  if (c.resume && c.checkpoint.empty()) {
    throw UsageError("--resume needs a checkpoint to read; drop --checkpoint=none or give a path");
  }
  if (c.checkpoint_every > 0 && c.checkpoint.empty()) {
    throw UsageError("--checkpoint_every needs --checkpoint (a path, or auto)");
  }
  if (c.zero && c.amp == "fp16") {
    throw UsageError("--zero leaves each rank the optimizer of its own parameters, and --amp=fp16's "
                     "loss scaler must see every gradient; use --amp=bf16, or drop --zero");
  }
  if (c.zero_overlap) {
    // The fused step is DDP's communication hook, works on host memory,
    // and needs the same buckets in every iteration.
    if (!c.zero) throw UsageError("--zero_overlap runs --zero's sharded step inside backward; add --zero");
    if (c.comm_hook != "allreduce") {
      throw UsageError("--zero_overlap reduces the buckets itself, so --comm_hook=" + c.comm_hook +
                       " cannot apply; drop one of the two");
    }
    if (c.device != "cpu") {
      throw UsageError("--zero_overlap steps parameters in host memory; drop it for --device=" + c.device);
    }
    if (c.find_unused_parameters) {
      throw UsageError("--zero_overlap would step unused parameters with a zero gradient; drop it, or "
                       "--find_unused_parameters");
    }
  }
  // Hooks that would do nothing say so instead of printing a plan they do
  // not follow.
  if (c.comm_hook == "powersgd" && c.device == "cuda") {
    throw UsageError("--comm_hook=powersgd compresses gradients in host memory only; with "
                     "--device=cuda they would travel uncompressed: use --comm_hook=fp16 or bf16");
  }
  if (c.comm_hook != "allreduce" && c.amp != "off" && c.device != "cuda") {
    throw UsageError("--amp=" + c.amp + " on the CPU makes the whole model " + c.amp +
                     ", so its gradients already travel in 16 bits and --comm_hook=" + c.comm_hook +
                     " would leave them as they are; drop one of the two");
  }
  // (Whether the run reaches the start step depends on the dataset's size:
  // CheckPowerSgdStarts, train_state.h.)
  if (c.comm_hook != "powersgd" && c.powersgd_start_step != TrainConfig{}.powersgd_start_step) {
    throw UsageError("--powersgd_start_step applies to --comm_hook=powersgd only; drop it for "
                     "--comm_hook=" + c.comm_hook);
  }
  // Generated images read no files; a folder given for them would be
  // dropped without a word (perhaps meant for --dataset=cifar10).
  if (c.dataset == "synthetic" && !c.data_dir.empty()) {
    throw UsageError("--data_dir=" + c.data_dir + " would not be read: --dataset=synthetic "
                     "generates its images; drop --data_dir, or pass the --dataset whose files it "
                     "holds (fashion_mnist, mnist or cifar10)");
  }
  if (c.sync_bn && c.model.rfind("resnet", 0) != 0) {
    throw UsageError("--sync_bn converts BatchNorm layers, and --model=" + c.model +
                     " has none; use it with a resnet");
  }
}

std::string DefaultCheckpointPath(const TrainConfig& c) {
  std::filesystem::path base;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg == '/') {
    base = xdg;
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home) {
    base = std::filesystem::path(home) / ".cache";
  } else {
    base = std::filesystem::temp_directory_path();
  }
  return (base / "ddp" / "checkpoints" / (c.model + "_" + c.dataset + ".safetensors")).string();
}

void ResolvePaths(TrainConfig& c) {
  if (c.checkpoint == kDefaultCheckpoint) {
    c.checkpoint = DefaultCheckpointPath(c);
  } else if (c.checkpoint == "none") {
    c.checkpoint.clear();
  }
  c.checkpoint = UserPath(c.checkpoint);
  c.data_dir = UserPath(c.data_dir);
  c.log_dir = UserPath(c.log_dir);
}

}  // namespace ddp::examples::trainer
