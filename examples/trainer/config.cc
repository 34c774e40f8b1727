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

// "a, b or c" for messages.
std::string Either(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " or " : ", ";
    out += names[i];
  }
  return out;
}

// A double flag's value as it reads back: "-1e-07" and "1.5", where
// std::to_string's fixed six decimals showed "-0.000000" and "1.500000".
std::string FlagValue(double v) {
  char text[32];
  for (int digits = 6;; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, v);
    if (digits >= 17 || !std::isfinite(v) || std::strtod(text, nullptr) == v) return text;
  }
}

// The schedules' own flags: each given to its schedulers only, in range,
// and those a schedule cannot do without given.
void ValidateSchedule(const TrainConfig& c) {
  const auto only_for = [&](const char* flag, bool given, const std::vector<std::string>& kinds) {
    if (given && !Contains(kinds, c.scheduler)) {
      throw UsageError(std::string("--") + flag + " applies to --scheduler=" + Either(kinds) +
                       " only; drop it for --scheduler=" + c.scheduler);
    }
  };
  only_for("lr_gamma", c.lr_gamma.has_value(), {"step", "multistep", "exponential", "plateau"});
  only_for("lr_milestones", !c.lr_milestones.empty(), {"multistep"});
  const auto given = [&](const char* flag, bool changed) {
    return changed || Contains(c.schedule_flags_given, std::string(flag));
  };
  only_for("lr_t0", given("lr_t0", c.lr_t0 != TrainConfig{}.lr_t0), {"warm_restarts"});
  only_for("lr_t_mult", given("lr_t_mult", c.lr_t_mult != TrainConfig{}.lr_t_mult), {"warm_restarts"});
  only_for("lr_patience", given("lr_patience", c.lr_patience != TrainConfig{}.lr_patience), {"plateau"});
  only_for("cycle_momentum", c.cycle_momentum, {"onecycle"});
  if (c.cycle_momentum) {
    // The scheduler drives SGD's momentum or Adam's beta1 (LrScheduler
    // refuses an optimizer without one), and only over an unsharded
    // optimizer: --zero's scheduler drives a bare rate.
    if (c.optimizer == "adadelta" || c.optimizer == "adagrad") {
      throw UsageError("--cycle_momentum cycles SGD's or RMSprop's momentum or Adam's beta1, and "
                       "--optimizer=" + c.optimizer + " has neither; use sgd, rmsprop, adam or adamw, "
                       "or drop --cycle_momentum");
    }
    if (c.optimizer == "rmsprop" && c.momentum == 0) {
      throw UsageError("--cycle_momentum cycles RMSprop's momentum, and --momentum=0 (its default) "
                       "makes an RMSprop without one; give --momentum above 0 (the cycle then sets "
                       "it), or drop --cycle_momentum");
    }
    if (c.optimizer == "sgd" && c.momentum == 0) {
      throw UsageError("--cycle_momentum cycles SGD's momentum, and --momentum=0 makes an SGD "
                       "without one; drop --momentum=0 (the cycle sets the momentum), or "
                       "--cycle_momentum");
    }
    if (c.zero) {
      throw UsageError("--cycle_momentum cannot apply with --zero, whose sharded optimizer's "
                       "schedule drives the learning rate only; drop one of the two");
    }
  }
  if (c.lr_gamma.has_value()) {
    const double g = *c.lr_gamma;
    char given[32];
    std::snprintf(given, sizeof(given), "%g", g);
    if (!(g > 0) || !std::isfinite(g)) {
      throw UsageError("--lr_gamma=" + std::string(given) + " must be a finite number above 0");
    }
    if (c.scheduler == "plateau" && g >= 1) {
      throw UsageError("--lr_gamma=" + std::string(given) +
                       " must be below 1 for --scheduler=plateau, which multiplies the rate by it "
                       "to reduce it");
    }
  }
  if (c.scheduler == "exponential" && !c.lr_gamma.has_value()) {
    throw UsageError("--scheduler=exponential needs --lr_gamma, the rate's factor per optimizer "
                     "step (0.999, say)");
  }
  if (c.scheduler == "multistep") {
    if (c.lr_milestones.empty()) {
      throw UsageError("--scheduler=multistep needs --lr_milestones, the optimizer steps where the "
                       "rate is multiplied by --lr_gamma (1000,2000, say)");
    }
    for (size_t i = 0; i < c.lr_milestones.size(); ++i) {
      if (c.lr_milestones[i] < 1) {
        throw UsageError("--lr_milestones=" + FormatMilestones(c.lr_milestones) +
                         ": milestones are optimizer steps, at least 1");
      }
      if (i > 0 && c.lr_milestones[i] < c.lr_milestones[i - 1]) {
        throw UsageError("--lr_milestones=" + FormatMilestones(c.lr_milestones) +
                         " must be in ascending order");
      }
    }
  }
  if (c.scheduler == "warm_restarts") {
    if (!given("lr_t0", c.lr_t0 != TrainConfig{}.lr_t0)) {
      throw UsageError("--scheduler=warm_restarts needs --lr_t0, the optimizer steps of its first "
                       "cycle");
    }
    if (c.lr_t0 < 1) {
      throw UsageError("--lr_t0=" + std::to_string(c.lr_t0) + " must be at least 1");
    }
    if (c.lr_t_mult < 1) {
      throw UsageError("--lr_t_mult=" + std::to_string(c.lr_t_mult) + " must be at least 1");
    }
    if (c.lr_t_mult > 1000) {
      throw UsageError("--lr_t_mult=" + std::to_string(c.lr_t_mult) + " is more than 1000");
    }
  }
  if (c.lr_patience < 0) {
    throw UsageError("--lr_patience=" + std::to_string(c.lr_patience) + " must be at least 0");
  }
}

}  // namespace

std::vector<int64_t> ParseMilestones(const std::string& text) {
  std::vector<int64_t> out;
  if (text.empty()) return out;
  size_t at = 0;
  while (true) {
    const size_t end = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, end - at);
    const bool digits = !item.empty() && item.size() <= 18 &&
                        item.find_first_not_of("0123456789") == std::string::npos;
    if (!digits) {
      throw UsageError("--lr_milestones=" + text +
                       " is not a list of optimizer steps; write them as 1000,2000");
    }
    out.push_back(std::stoll(item));
    if (end == text.size()) break;
    at = end + 1;
  }
  return out;
}

std::string FormatMilestones(const std::vector<int64_t>& milestones) {
  std::string out;
  for (size_t i = 0; i < milestones.size(); ++i) {
    out += (i > 0 ? "," : "") + std::to_string(milestones[i]);
  }
  return out;
}

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
  const std::vector<std::string> optimizers = {"sgd", "adam", "adamw", "adadelta", "rmsprop", "adagrad"};
  if (!Contains(optimizers, c.optimizer)) {
    throw UsageError("unknown --optimizer=" + c.optimizer + "; use " + OneOf(optimizers));
  }
  if (!Contains(SchedulerNames(), c.scheduler)) {
    throw UsageError("unknown --scheduler=" + c.scheduler + "; use " + OneOf(SchedulerNames()));
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
      throw UsageError(std::string("--") + flag + "=" + FlagValue(v) +
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
  positive("save_stop_grace_s", c.save_stop_grace_s);
  at_most("save_stop_grace_s", c.save_stop_grace_s, 7 * 24 * 3600, " (7 days)");
  not_negative("train_samples", c.train_samples);
  not_negative("test_samples", c.test_samples);
  not_negative("workers", c.workers);
  not_negative("powersgd_start_step", c.powersgd_start_step);
  // 0 has its own reason; the others are told the range 0 is not in.
  if (c.lr == 0) throw UsageError("--lr=0 would never change the model; use a positive value");
  if (!(c.lr > 0) || !std::isfinite(c.lr)) {
    throw UsageError("--lr=" + FlagValue(c.lr) + " must be a finite number > 0");
  }
  non_negative("momentum", c.momentum);
  non_negative("weight_decay", c.weight_decay);
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
  if (c.momentum > 0 && c.optimizer != "sgd" && c.optimizer != "rmsprop") {
    // Adam's betas play momentum's part; a silently ignored flag misleads.
    // (The default momentum is only applied with sgd; see train_main.cc.)
    throw UsageError("--momentum applies to --optimizer=sgd and rmsprop only; drop it for --optimizer=" +
                     c.optimizer);
  }
  if (c.momentum >= 1) {
    throw UsageError("--momentum=" + FlagValue(c.momentum) + " must be below 1");
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
  if (!c.decay_norm_and_bias) {
    // A flag that would change nothing is refused, as --momentum with adam.
    if (c.weight_decay == 0) {
      throw UsageError("--decay_norm_and_bias=false spares biases and norms from --weight_decay, which "
                       "is 0 here; pass a --weight_decay above 0, or drop --decay_norm_and_bias=false");
    }
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
  // Without a log the rows are not written, yet each one still gathers the
  // losses from every rank: the flag would cost and do nothing.
  if (c.log_dir.empty() && c.log_every != TrainConfig{}.log_every) {
    throw UsageError("--log_every=" + std::to_string(c.log_every) +
                     " sets the steps per metrics.csv row, which only --log_dir writes; add "
                     "--log_dir=DIR, or drop --log_every");
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
  ValidateSchedule(c);
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
