#include "examples/trainer/train_state.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "examples/trainer/format.h"
#include "nn/data/sampler.h"
#include "nn/io/atomic_file.h"
#include "nn/io/checkpoint.h"
#include "nn/io/safetensors.h"

namespace ddp::examples::trainer {
namespace {

using nn::io::Metadata;
using nn::io::NamedTensors;

constexpr size_t kKeysShown = 6;

// Kept checkpoints beside one --checkpoint path (<stem>.prev, .prev.2, ...)
// before KeepAsPreviousCheckpoint gives up and asks for a clean-up.
constexpr int kMaxPreviousCheckpoints = 1000;

// Whether a folder entry (a file, a folder, a dangling link) has `name`.
bool NameTaken(const std::string& name) {
  struct stat st;
  return ::lstat(name.c_str(), &st) == 0 || errno != ENOENT;
}

std::string KeyList(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < kKeysShown; ++i) {
    if (i > 0) out += ", ";
    out += keys[i];
  }
  if (keys.size() > kKeysShown) out += " (+" + std::to_string(keys.size() - kKeysShown) + " more)";
  return out;
}

std::string Get(const Metadata& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? "" : it->second;
}

// The dtype of `model`'s floating parameters (the first one's; the trainer
// converts the whole model at once), or nullopt for a model without any.
std::optional<nn::DType> FloatingDType(const nn::modules::Module& model) {
  for (const auto& [name, p] : model.NamedParameters()) {
    if (p.defined() && nn::IsFloating(p.dtype())) return p.dtype();
  }
  return std::nullopt;
}

// The f32 master copy that `optimizer` (a saved state list) holds for
// parameter `name`, when it has one of `shape`; else an undefined tensor.
nn::Tensor MasterIn(const NamedTensors& optimizer, const std::string& name,
                    const nn::Shape& shape) {
  const std::string key = "state." + name + ".master";
  for (const auto& [k, t] : optimizer) {
    if (k == key && t.defined() && t.dtype() == nn::DType::kFloat32 && t.shape() == shape) return t;
  }
  return {};
}

// Whether `optimizer` (a saved state list) updated parameter `name` at least
// once: its "state.<name>.step" is above 0.
bool UpdatedIn(const NamedTensors& optimizer, const std::string& name) {
  const std::string key = "state." + name + ".step";
  for (const auto& [k, t] : optimizer) {
    if (k == key && t.defined() && t.numel() == 1 && t.dtype() == nn::DType::kInt64) {
      return t.To(nn::kCPU).data<int64_t>()[0] > 0;
    }
  }
  return false;
}

// --amp decides the model's dtype together with --device: on CUDA the model
// stays f32 (autocast computes in 16 bits), on the CPU it is 16-bit. A
// checkpoint that records its model's dtype ("model_dtype") and differs from
// `model`'s was saved on the other kind of device; its floating model tensors
// are converted to `model`'s dtype on load (ConvertModelDType). A checkpoint
// without the key (an older trainer's) or of the same dtype is left as it is.
struct DTypeChange {
  nn::DType from;
  nn::DType to;
  std::map<std::string, nn::DType> want;  // the dtype of each of the model's tensors

  // Whether the saved model tensor `name` of `dtype` becomes `to`.
  bool Converts(const std::string& name, nn::DType dtype) const {
    const auto it = want.find(name);
    return it != want.end() && dtype == from && it->second == to;
  }
};

// The conversion of a checkpoint with metadata `m` to `model`'s dtype, or
// nullopt when there is none to make.
std::optional<DTypeChange> ModelDTypeChange(const nn::modules::Module& model, const Metadata& m) {
  const std::string saved_name = Get(m, "model_dtype");
  const std::optional<nn::DType> mine = FloatingDType(model);
  if (saved_name.empty() || !mine) return std::nullopt;
  nn::DType saved;
  try {
    saved = nn::ParseDType(saved_name);
  } catch (const std::exception&) {
    return std::nullopt;  // not a dtype: the model check reports any difference
  }
  if (saved == *mine || !nn::IsFloating(saved)) return std::nullopt;
  DTypeChange change{saved, *mine, {}};
  for (const auto& [name, t] : model.GetStateDict()) change.want[name] = t.dtype();
  return change;
}

// Converts the model tensors of a checkpoint saved on the other kind of
// device (ModelDTypeChange). From 16 bits to f32 a parameter takes the
// optimizer's f32 master copy where the state has one (the 16-bit value is
// that copy rounded); from f32 to 16 bits the f32 value becomes the master
// copy in `optimizer` (for parameters the optimizer updated: one never
// updated may hold no state), so no precision is lost either way. The
// optimizer's other slots follow by themselves (Optimizer::LoadStateDict
// converts them to each parameter's dtype, and drops a master of a
// parameter that is f32 now).
void ConvertModelDType(NamedTensors& model_state, NamedTensors& optimizer,
                       const nn::modules::Module& model, const Metadata& m) {
  const std::optional<DTypeChange> change = ModelDTypeChange(model, m);
  if (!change) return;
  std::set<std::string> params;
  for (const auto& [name, p] : model.NamedParameters()) params.insert(name);
  NamedTensors masters;
  for (auto& [name, t] : model_state) {
    if (!t.defined() || !change->Converts(name, t.dtype())) continue;
    if (params.count(name) && change->to == nn::DType::kFloat32) {
      if (nn::Tensor master = MasterIn(optimizer, name, t.shape()); master.defined()) {
        t = master.To(nn::kCPU).Clone();
        continue;
      }
    }
    if (params.count(name) && change->from == nn::DType::kFloat32 && UpdatedIn(optimizer, name) &&
        !MasterIn(optimizer, name, t.shape()).defined()) {
      masters.emplace_back("state." + name + ".master", t.To(nn::kCPU).Clone());
    }
    t = t.To(change->to);
  }
  for (auto& e : masters) optimizer.push_back(std::move(e));
}

// A saved tensor as the model check sees it.
struct SavedTensor {
  std::string name;
  nn::Shape shape;
  nn::DType dtype;
};

std::vector<SavedTensor> Described(const NamedTensors& tensors) {
  std::vector<SavedTensor> out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) out.push_back({name, t.shape(), t.dtype()});
  return out;
}

// The one-line complaint about a model state that does not fit `model`, or
// "" when it fits.
std::string ModelMismatch(const std::string& path, const std::vector<SavedTensor>& saved,
                          const nn::modules::Module& model, const TrainConfig& config,
                          const Metadata& metadata) {
  std::map<std::string, const SavedTensor*> have;
  for (const SavedTensor& t : saved) have[t.name] = &t;
  std::vector<std::string> missing, unexpected, mismatched;
  bool shapes_differ = false;
  std::set<std::string> mine;
  for (const auto& [name, t] : model.GetStateDict()) {
    mine.insert(name);
    auto it = have.find(name);
    if (it == have.end()) {
      missing.push_back(name);
    } else if (it->second->shape != t.shape() || it->second->dtype != t.dtype()) {
      shapes_differ = shapes_differ || it->second->shape != t.shape();
      mismatched.push_back(name + " " + nn::ShapeToString(it->second->shape) + " " +
                           std::string(nn::DTypeName(it->second->dtype)) + " vs " +
                           nn::ShapeToString(t.shape()) + " " +
                           std::string(nn::DTypeName(t.dtype())));
    }
  }
  for (const SavedTensor& t : saved) {
    if (!mine.count(t.name)) unexpected.push_back(t.name);
  }
  if (missing.empty() && unexpected.empty() && mismatched.empty()) return "";
  std::string msg = "checkpoint " + path + " does not match --model=" + config.model;
  if (config.amp != "off") msg += " --amp=" + config.amp;
  msg += ":";
  if (!missing.empty()) msg += " missing keys " + KeyList(missing) + ";";
  if (!unexpected.empty()) msg += " unexpected keys " + KeyList(unexpected) + ";";
  if (!mismatched.empty()) msg += " different shapes or dtypes " + KeyList(mismatched) + ";";
  const std::string saved_model = Get(metadata, "model");
  const std::string saved_amp = Get(metadata, "amp");
  if (missing.empty() && unexpected.empty() && !shapes_differ && saved_model == config.model &&
      saved_amp == config.amp && Get(metadata, "model_dtype").empty()) {
    // The same flags, the dtypes alone differ: with the same --amp that is
    // another --device (16-bit model on the CPU, f32 on CUDA), which an
    // older trainer's checkpoint does not record, so it is not converted.
    msg += " it was saved by an older trainer with --amp=" + saved_amp + " on the other "
           "--device than this run's --device=" + config.device + " (which it does not "
           "record); resume it with the --device it was saved with, or pass another "
           "--checkpoint path";
    return msg;
  }
  if (!saved_model.empty()) {
    msg += " it was saved by --model=" + saved_model +
           (saved_amp.empty() || saved_amp == "off" ? "" : " --amp=" + saved_amp) +
           "; pass the same flags, or another --checkpoint path";
  } else {
    msg += " pass the flags it was saved with, or another --checkpoint path";
  }
  return msg;
}

// The errno of a read of the file that the host failed (nn::io nests it
// in `e`: EIO, EMFILE, ENOMEM), else 0: a file that is damaged, too short,
// or at a path the user must fix (absent, not permitted, a name too long).
// Whether errno `err` from a look at or a read of a path is the path's,
// for the user to fix (absent, not permitted, a name too long), rather than
// the host's failure (EIO, EMFILE, ENOMEM, ESTALE).
bool IsThePathsErrno(int err) {
  for (const int users : {ENOENT, ENOTDIR, ELOOP, ENAMETOOLONG, EACCES, EPERM, EISDIR, ENXIO}) {
    if (err == users) return true;
  }
  return false;
}

int HostFailureOf(const nn::io::CheckpointError& e) {
  try {
    std::rethrow_if_nested(e);
  } catch (const std::system_error& failure) {
    const int err = failure.code().value();
    return IsThePathsErrno(err) ? 0 : err;
  } catch (...) {
  }
  return 0;
}

// What a checkpoint that nn::io cannot read or parse (`e`) ends the run
// with: the refusal of the file (UsageError, exit status 2), or, when the
// host failed to read it, that failure (exit status 1), with no advice to
// delete a checkpoint that may be good.
std::exception_ptr Unreadable(const nn::io::CheckpointError& e) {
  if (HostFailureOf(e) != 0) {
    return std::make_exception_ptr(std::runtime_error(
        std::string("--resume: ") + e.what() +
        " (the host failed to read it, which says nothing against the file; it is left as it is: retry once the "
        "host has recovered)"));
  }
  return std::make_exception_ptr(UsageError(std::string("--resume: ") + e.what() +
                                            "; delete the file or pass another --checkpoint to start afresh"));
}

// Parses a checkpoint's bytes (read here or by rank 0).
nn::io::Checkpoint Parse(const std::string& path, std::string bytes) {
  try {
    return nn::io::LoadCheckpointFromBytes(std::move(bytes), path);
  } catch (const nn::io::CheckpointError& e) {
    std::rethrow_exception(Unreadable(e));
  }
}

nn::io::Checkpoint Read(const std::string& path) { return Parse(path, ReadTrainCheckpoint(path)); }

// The saved "bucket_order": comma-separated indices. Empty when absent or
// not such a list: it only keeps a resumed DDP run bit-exact on 3 or more
// ranks, so a bad one is dropped rather than refused.
std::vector<int64_t> ParseBucketOrder(const std::string& text) {
  std::vector<int64_t> order;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, end - at);
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 18) return {};
    order.push_back(std::stoll(item));
    at = end + 1;
  }
  if (!text.empty() && text.back() == ',') return {};
  return order;
}

// The end of a refusal of a file whose metadata this trainer did not
// write (another program's safetensors file, ddp_hello's checkpoint): what
// to do instead. A fresh run's first save keeps such a file beside it.
constexpr char kNotThisTrainers[] =
    "; the file was not written by this trainer: pass another --checkpoint, or drop --resume to "
    "start afresh (the first save then keeps this file beside it, as <stem>.prev.safetensors)";

int64_t MetaInt(const Metadata& m, const std::string& key, const std::string& path) {
  try {
    return nn::io::MetadataInt(m, key, path);
  } catch (const nn::io::CheckpointError& e) {
    throw UsageError(std::string("--resume: ") + e.what() +
                     kNotThisTrainers);
  }
}

// The shortest "%g" form that reads back as `v`: "0.05", not
// "0.050000000000000003", yet 0.05 and 0.0500001 stay apart.
std::string FlagDouble(double v) {
  for (int digits = 6;; ++digits) {
    const std::string s = StringPrintf("%.*g", digits, v);
    if (digits >= 17 || std::strtod(s.c_str(), nullptr) == v) return s;
  }
}

// The f64 scalar `key` of an optimizer state list (NaN when absent).
double RateIn(const NamedTensors& state, const std::string& key) {
  for (const auto& [name, t] : state) {
    if (name == key && t.defined() && t.numel() == 1 && t.dtype() == nn::DType::kFloat64) {
      return t.Item();
    }
  }
  return NAN;
}

// The rate of an optimizer's state list: its "lr", or with parameter
// groups (which share the trainer's one rate) group 0's (NaN when absent).
double OptimizerRateIn(const NamedTensors& state) {
  const double rate = RateIn(state, "lr");
  return std::isnan(rate) ? RateIn(state, "param_groups.0.lr") : rate;
}

// One flag of --scheduler's kind, as saved in the metadata (under the
// flag's name) and as a command line gives it.
struct ScheduleSetting {
  std::string flag;
  std::string saved;
  std::string shown;
  /// The saved value of a checkpoint that lacks it (a trainer before the
  /// flag); empty: such a checkpoint is not compared.
  std::string absent;
};

// The flags that set config.scheduler's schedule besides --lr and the run's
// length, as the kind uses them (--lr_gamma's default too).
std::vector<ScheduleSetting> ScheduleSettings(const TrainConfig& c) {
  std::vector<ScheduleSetting> out;
  const auto gamma = [&] {
    out.push_back({"lr_gamma", ExactDouble(c.LrGamma()), FlagDouble(c.LrGamma()), ""});
  };
  const auto integer = [&](const char* flag, int64_t v) {
    out.push_back({flag, std::to_string(v), std::to_string(v), ""});
  };
  if (c.scheduler == "step" || c.scheduler == "exponential") gamma();
  if (c.scheduler == "multistep") {
    const std::string milestones = FormatMilestones(c.lr_milestones);
    out.push_back({"lr_milestones", milestones, milestones, ""});
    gamma();
  }
  if (c.scheduler == "warm_restarts") {
    integer("lr_t0", c.lr_t0);
    integer("lr_t_mult", c.lr_t_mult);
  }
  if (c.scheduler == "plateau") {
    gamma();
    integer("lr_patience", c.lr_patience);
  }
  if (c.scheduler == "onecycle") {
    // Another value moves the momentum that the saved one set (or leaves
    // the optimizer's own). Older trainers cycled the rate alone.
    const std::string cycle = c.cycle_momentum ? "true" : "false";
    out.push_back({"cycle_momentum", cycle, cycle, "false"});
  }
  return out;
}

// The learning-rate schedule and the optimizer's settings of the saved run
// continue unchanged, or not at all: throws UsageError for another
// --scheduler, --lr, --momentum, --weight_decay or --decay_norm_and_bias.
void CheckSameSchedule(const std::string& path, const Metadata& m, const TrainConfig& config) {
  const std::string restart = " to continue that run, or another --checkpoint path to start afresh";
  // Which parameters are decayed, and the optimizer state's groups with it.
  // (Absent: a trainer before the flag, which decayed every parameter.)
  std::string saved_decay = Get(m, "decay_norm_and_bias");
  if (saved_decay.empty()) saved_decay = "true";
  const std::string decay = config.decay_norm_and_bias ? "true" : "false";
  if (saved_decay != "true" && saved_decay != "false") {
    throw UsageError("--resume: checkpoint " + path +
                     " has no valid decay_norm_and_bias" + kNotThisTrainers);
  }
  if (saved_decay != decay) {
    throw UsageError("checkpoint " + path + " was saved with --decay_norm_and_bias=" + saved_decay +
                     " and this run has --decay_norm_and_bias=" + decay + "; pass --decay_norm_and_bias=" +
                     saved_decay + restart);
  }
  const std::string saved_scheduler = Get(m, "scheduler");
  if (!saved_scheduler.empty() && saved_scheduler != config.scheduler) {
    throw UsageError("checkpoint " + path + " was saved with --scheduler=" + saved_scheduler +
                     " and this run has --scheduler=" + config.scheduler + "; pass --scheduler=" +
                     saved_scheduler + restart);
  }
  // The flags of the schedule's kind (absent: saved before they were
  // recorded, with their defaults then).
  for (const ScheduleSetting& setting : ScheduleSettings(config)) {
    std::string saved = Get(m, setting.flag);
    if (saved.empty()) saved = setting.absent;
    if (saved.empty() || saved == setting.saved) continue;
    std::string shown = saved;
    if (setting.flag == "lr_gamma") {
      try {
        shown = FlagDouble(ParseFiniteDouble(saved));
      } catch (const std::invalid_argument& e) {
        throw UsageError("--resume: checkpoint " + path + " has no valid lr_gamma (" + e.what() + ")" +
                         kNotThisTrainers);
      }
      if (shown == setting.shown) continue;
    }
    throw UsageError("checkpoint " + path + " was saved with --" + setting.flag + "=" + shown +
                     " and this run has --" + setting.flag + "=" + setting.shown + "; pass --" +
                     setting.flag + "=" + shown + restart);
  }
  if (Get(m, "lr").empty()) return;  // an older trainer's: see LoadTrainCheckpoint
  double saved_lr = 0;
  try {
    saved_lr = ParseFiniteDouble(Get(m, "lr"));
  } catch (const std::invalid_argument& e) {
    throw UsageError("--resume: checkpoint " + path + " has no valid lr (" + e.what() + ")" + kNotThisTrainers);
  }
  if (saved_lr != config.lr) {
    throw UsageError("checkpoint " + path + " was saved with --lr=" + FlagDouble(saved_lr) +
                     " and this run has --lr=" + FlagDouble(config.lr) + "; pass --lr=" +
                     FlagDouble(saved_lr) + restart);
  }
  // The optimizer's other settings: another momentum would drop the saved
  // buffers (0) or start new ones, another weight decay change the update;
  // either way not a continuation. (Absent: an older trainer's file.)
  const std::pair<const char*, double> settings[] = {{"momentum", config.momentum},
                                                     {"weight_decay", config.weight_decay}};
  for (const auto& [flag, value] : settings) {
    if (Get(m, flag).empty()) continue;
    double saved = 0;
    try {
      saved = ParseFiniteDouble(Get(m, flag));
    } catch (const std::invalid_argument& e) {
      throw UsageError("--resume: checkpoint " + path + " has no valid " + flag + " (" + e.what() + ")" +
                       kNotThisTrainers);
    }
    if (saved != value) {
      throw UsageError("checkpoint " + path + " was saved with --" + flag + "=" + FlagDouble(saved) +
                       " and this run has --" + flag + "=" + FlagDouble(value) + "; pass --" + flag + "=" +
                       FlagDouble(saved) + restart);
    }
  }
}

// The horizon a resumed schedule continues with: the saved one, or where
// this run ends when only the steps per epoch changed. Throws UsageError
// when this run's --epochs or --max_steps would move it: the rate would
// jump back up (cosine) or drop late (step).
int64_t ResumedHorizon(const std::string& path, const Metadata& m, const TrainConfig& config,
                       const TrainComponents& parts, const TrainPosition& pos, int world_size,
                       std::vector<std::string>& notes) {
  const std::string& kind = parts.schedule->kind();
  if (Get(m, "schedule_steps").empty()) {
    // An older trainer's checkpoint: the horizon from this run's flags, as
    // such checkpoints always resumed.
    notes.push_back("checkpoint " + path +
                    " was saved by an older trainer, which did not record where its schedule "
                    "ends: the " + kind + " schedule ends at step " +
                    std::to_string(parts.schedule->steps()) + ", as this run's flags set it");
    return parts.schedule->steps();
  }
  const int64_t saved = MetaInt(m, "schedule_steps", path);
  // The rate does not depend on where the run ends: it may end elsewhere.
  if (!parts.schedule->uses_horizon()) return saved;
  if (parts.batches_per_epoch < 0) return saved;
  const int64_t this_epoch =
      pos.epoch_start > 0 && parts.train_size >= 0
          ? BatchesInEpoch(parts.train_size, world_size, config.batch_size, pos.epoch_start)
          : -1;
  const int64_t run_end = RunEndStep(config, parts.batches_per_epoch, pos, this_epoch);
  if (run_end == saved) return saved;
  std::string then, now;
  for (const auto& [flag, value] :
       {std::pair<std::string, int64_t>{"epochs", config.epochs}, {"max_steps", config.max_steps}}) {
    const std::string was = Get(m, flag);
    if (!was.empty() && was != std::to_string(value)) {
      then += " --" + flag + "=" + was;
      now += " --" + flag + "=" + std::to_string(value);
    }
  }
  if (!then.empty()) {
    // The flag that put the end where it is: --max_steps when it binds,
    // else --epochs. Listing only the changed ones named --max_steps=0 (no
    // limit) as what set the end of a run that ran all its epochs.
    const std::string saved_epochs = Get(m, "epochs"), saved_max_steps = Get(m, "max_steps");
    std::string set_by = then;
    if (!saved_max_steps.empty() && saved_max_steps != "0" && saved_max_steps == std::to_string(saved)) {
      set_by = " --max_steps=" + saved_max_steps;
    } else if (!saved_epochs.empty()) {
      set_by = " --epochs=" + saved_epochs;
    }
    throw UsageError("the " + kind + " schedule of checkpoint " + path + " ends at step " +
                     std::to_string(saved) + ", as" + set_by + " set it, and this run's" + now +
                     " would end it at step " + std::to_string(run_end) + "; pass" + then +
                     " to continue that run, or another --checkpoint path to start afresh");
  }
  // The same run on other ranks, batches or accumulation: another number of
  // steps per epoch. The schedule ends with the run, as it would have.
  const int64_t per_epoch =
      (parts.batches_per_epoch + config.grad_accum_steps - 1) / config.grad_accum_steps;
  const std::string where =
      config.max_steps > 0 && run_end == config.max_steps
          ? "at --max_steps=" + std::to_string(config.max_steps)
          : "after --epochs=" + std::to_string(config.epochs) + " at " +
                std::to_string(per_epoch) + " steps per epoch";
  notes.push_back("the " + kind + " schedule now ends at step " + std::to_string(run_end) +
                  ", where this run ends (" + where + "), instead of the checkpoint's step " +
                  std::to_string(saved));
  return run_end;
}

// Throws UsageError naming the key, its value and the range it must be in.
[[noreturn]] void RefuseOutOfRange(const std::string& path, const std::string& key, int64_t value,
                                   const std::string& range) {
  throw UsageError("--resume: checkpoint " + path + " has " + key + "=" + std::to_string(value) +
                   ", out of range (" + range +
                   "); the file was not written by this trainer, or changed since; delete it or "
                   "pass another --checkpoint to start afresh");
}

// Throws UsageError when the position does not fit in an epoch of `size`
// samples cut into batches of `saved_batch` on `saved_world` ranks: an
// epoch_start or batch_in_epoch past it, or a samples_in_epoch (`trained`,
// when the file has that key) past its batches' samples. `size_is` says
// where the size comes from, for the message ("its train_size 300").
void CheckPositionInSet(const std::string& path, const TrainPosition& position, int64_t trained,
                        bool has_trained, int64_t saved_world, int64_t saved_batch, int64_t size,
                        const std::string& size_is) {
  const auto refuse = [&](const std::string& key, int64_t value, const std::string& range) {
    RefuseOutOfRange(path, key, value, range);
  };
  int64_t per_batch = 0;
  if (__builtin_mul_overflow(saved_batch, saved_world, &per_batch)) per_batch = 0;
  if (position.epoch_start > size) {
    refuse("epoch_start", position.epoch_start, "0 to " + std::to_string(size) + ", " + size_is);
  }
  const int64_t batches =
      BatchesInEpoch(size, static_cast<int>(saved_world), saved_batch, position.epoch_start);
  if (position.batch_in_epoch > batches) {
    refuse("batch_in_epoch", position.batch_in_epoch,
           "0 to " + std::to_string(batches) + ", the batches of its epoch on " +
               std::to_string(saved_world) + " ranks");
  }
  // A run on other ranks starts its epoch after this many positions of
  // the order: a larger value skips the rest of the epoch unseen. The
  // last batch of an epoch may be padded, so an epoch trained to its end
  // counts up to its batches' samples, a little past the set's size.
  int64_t covered = 0;
  if (per_batch == 0 || __builtin_mul_overflow(batches, per_batch, &covered) ||
      __builtin_add_overflow(covered, position.epoch_start, &covered)) {
    covered = INT64_MAX;
  }
  const int64_t most = std::max(size, covered);
  if (has_trained && trained > most) {
    refuse("samples_in_epoch", trained,
           "0 to " + std::to_string(most) + ", the samples of its epoch's " + std::to_string(batches) +
               " batches on " + std::to_string(saved_world) + " ranks, of " + size_is);
  }
}

// Throws UsageError when a value of the checkpoint's position is out of
// range: the load would go wrong with it (a negative epoch_start fails in
// the data sampler, far from the file; a negative epoch trains extra
// epochs). `position` holds what was read from `m`; `saved_size` is the
// saved training-set size (-1 when not recorded: an older trainer's file).
// Returns the positions of the epoch's sample order trained so far: its
// samples_in_epoch, or for an older trainer's file without that key, the
// count worked out from the position.
int64_t CheckPositionInRange(const std::string& path, const Metadata& m, const TrainPosition& position,
                             int64_t saved_world, int64_t saved_batch, int64_t saved_accum,
                             int64_t saved_size) {
  const auto refuse = [&](const std::string& key, int64_t value, const std::string& range) {
    RefuseOutOfRange(path, key, value, range);
  };
  for (const auto& [key, value] :
       {std::pair<const char*, int64_t>{"epoch", position.epoch}, {"step", position.step},
        {"epoch_loss_count", position.epoch_loss_count}, {"epoch_start", position.epoch_start},
        {"batch_in_epoch", position.batch_in_epoch}}) {
    if (value < 0) refuse(key, value, "0 or more");
  }
  if (!Get(m, "train_size").empty() && saved_size < 0) refuse("train_size", saved_size, "0 or more");
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"world_size", saved_world},
                                   {"batch_size", saved_batch},
                                   {"grad_accum_steps", saved_accum}}) {
    if (value < 1) refuse(key, value, "1 or more");
  }
  // Ranks are counted in an int: a larger count would wrap (to a negative
  // one, which the sampler below refuses without naming the file).
  if (saved_world > INT_MAX) refuse("world_size", saved_world, "1 to " + std::to_string(INT_MAX));
  const bool has_trained = !Get(m, "samples_in_epoch").empty();
  int64_t trained = 0;
  // The samples of one batch on all ranks (0: more than 64 bits hold).
  int64_t per_batch = 0;
  if (__builtin_mul_overflow(saved_batch, saved_world, &per_batch)) per_batch = 0;
  if (has_trained) {
    trained = MetaInt(m, "samples_in_epoch", path);
    if (trained < 0) refuse("samples_in_epoch", trained, "0 or more");
  } else {
    // An older trainer's file: epoch_start + batch_in_epoch * batch_size *
    // world_size, which a large batch_in_epoch (unchecked without a
    // train_size) wraps to a negative start that the sampler refuses
    // without naming the file.
    if ((per_batch == 0 && position.batch_in_epoch > 0) ||
        __builtin_mul_overflow(position.batch_in_epoch, per_batch, &trained) ||
        __builtin_add_overflow(trained, position.epoch_start, &trained)) {
      const int64_t most =
          per_batch > 0 ? (INT64_MAX - position.epoch_start) / per_batch : 0;
      refuse("batch_in_epoch", position.batch_in_epoch,
             "0 to " + std::to_string(most) +
                 ", so that epoch_start + batch_in_epoch x batch_size x world_size, the samples "
                 "of its epoch trained, fits in 64 bits");
    }
  }
  if (saved_size >= 0) {
    CheckPositionInSet(path, position, trained, has_trained, saved_world, saved_batch, saved_size,
                       "its train_size " + std::to_string(saved_size));
  }
  return trained;
}

// Throws UsageError when the scheduler's step count in `optimizer` (a saved
// state list) is not `step`, the optimizer steps of the position: the two
// disagree only in a file put together from two runs.
void CheckSchedulerStep(const std::string& path, const NamedTensors& optimizer, int64_t step) {
  for (const auto& [name, t] : optimizer) {
    if (name != "scheduler.step" || !t.defined() || t.numel() != 1 ||
        t.dtype() != nn::DType::kInt64) {
      continue;
    }
    const int64_t scheduler_step = t.To(nn::kCPU).data<int64_t>()[0];
    if (scheduler_step != step) {
      RefuseOutOfRange(path, "scheduler.step", scheduler_step, "the step, " + std::to_string(step));
    }
  }
}

}  // namespace

namespace {

TrainConfig WithScheduler(std::string kind) {
  TrainConfig config;
  config.scheduler = std::move(kind);
  return config;
}

}  // namespace

RunSchedule::RunSchedule(std::string kind, int64_t steps)
    : RunSchedule(WithScheduler(std::move(kind)), steps) {}

RunSchedule::RunSchedule(const TrainConfig& config, int64_t steps)
    : kind_(config.scheduler),
      gamma_(config.LrGamma()),
      milestones_(config.lr_milestones),
      t0_(config.lr_t0),
      t_mult_(config.lr_t_mult),
      max_lr_(config.lr),
      cycle_momentum_(config.cycle_momentum) {
  if (!HasRunSchedule(kind_) ||
      std::find(SchedulerNames().begin(), SchedulerNames().end(), kind_) == SchedulerNames().end()) {
    throw std::invalid_argument("RunSchedule: unknown kind `" + kind_ + "`");
  }
  set_steps(steps);
}

void RunSchedule::set_steps(int64_t steps) {
  const int64_t horizon = std::max<int64_t>(1, steps);
  std::shared_ptr<nn::optim::Schedule> schedule;
  if (kind_ == "step") {
    // --lr_gamma (0.1) times after each third of the run.
    schedule = nn::optim::StepSchedule(std::max<int64_t>(1, steps / 3), gamma_);
  } else if (kind_ == "cosine") {
    schedule = nn::optim::CosineSchedule(horizon);
  } else if (kind_ == "multistep") {
    schedule = nn::optim::MultiStepSchedule(milestones_, gamma_);
  } else if (kind_ == "exponential") {
    schedule = nn::optim::ExponentialSchedule(gamma_);
  } else if (kind_ == "warm_restarts") {
    schedule = nn::optim::CosineWarmRestartsSchedule(t0_, t_mult_);
  } else {
    nn::optim::OneCycleOptions o;
    o.max_lr = max_lr_;
    o.total_steps = horizon;
    // By default the rate alone, as before OneCycleOptions::cycle_momentum
    // (default true) existed: such runs and their checkpoints unchanged.
    o.cycle_momentum = cycle_momentum_;
    schedule = nn::optim::OneCycleSchedule(o);
  }
  steps_ = steps;
  schedule_ = std::move(schedule);
}

nn::optim::PlateauOptions PlateauOptionsOf(const TrainConfig& config) {
  nn::optim::PlateauOptions o;
  o.factor = config.LrGamma();
  o.patience = config.lr_patience;
  return o;
}

int64_t RunEndStep(const TrainConfig& config, int64_t batches_per_epoch,
                   const TrainPosition& position, int64_t batches_this_epoch) {
  const int64_t accum = config.grad_accum_steps;
  const int64_t this_epoch = batches_this_epoch >= 0 ? batches_this_epoch : batches_per_epoch;
  int64_t end = position.step;
  if (position.epoch < config.epochs) {
    // The last step of an epoch takes the micro-batches left, even fewer.
    const int64_t left = std::max<int64_t>(0, this_epoch - position.batch_in_epoch);
    end += (left + accum - 1) / accum +
           (config.epochs - position.epoch - 1) * ((batches_per_epoch + accum - 1) / accum);
  }
  if (config.max_steps > 0) end = std::min(end, config.max_steps);
  return end;
}

namespace {

// Optimizer steps in one epoch of `batches_per_epoch` batches.
int64_t StepsPerEpoch(const TrainConfig& config, int64_t batches_per_epoch) {
  return (batches_per_epoch + config.grad_accum_steps - 1) / config.grad_accum_steps;
}

// What ends a run at step `end` (RunEndStep), for messages:
// "--max_steps=N" or "E epochs of S steps".
std::string WhatEndsTheRun(const TrainConfig& config, int64_t batches_per_epoch, int64_t end) {
  if (config.max_steps > 0 && end == config.max_steps) return "--max_steps=" + std::to_string(config.max_steps);
  return std::to_string(config.epochs) + (config.epochs == 1 ? " epoch" : " epochs") + " of " +
         FormatCount(StepsPerEpoch(config, batches_per_epoch)) + " steps";
}

}  // namespace

void CheckPowerSgdStarts(const TrainConfig& config, int64_t batches_per_epoch) {
  if (config.comm_hook != "powersgd") return;
  // The hook counts its iterations over the whole run, a resumed one's
  // included (they are saved with the checkpoint).
  const int64_t end = RunEndStep(config, batches_per_epoch);
  if (config.powersgd_start_step < end) return;
  const std::string how = WhatEndsTheRun(config, batches_per_epoch, end);
  throw UsageError("--comm_hook=powersgd would compress nothing: it starts after "
                   "--powersgd_start_step=" + std::to_string(config.powersgd_start_step) +
                   " steps of full all-reduce, and this run ends at step " + FormatCount(end) +
                   " (" + how + "); pass --powersgd_start_step=" + std::to_string(end - 1) +
                   " or less, or another --comm_hook");
}

void CheckScheduleFits(const TrainConfig& config, int64_t batches_per_epoch) {
  const int64_t end = RunEndStep(config, batches_per_epoch);
  if (config.scheduler == "exponential" || config.scheduler == "step" || config.scheduler == "multistep") {
    // A factor above 1 grows the rate; past the double range the optimizer
    // would refuse it mid-run. The most factors the run applies: one per
    // step (exponential), one per milestone, or step's two or three.
    const double factors = config.scheduler == "exponential" ? static_cast<double>(end)
                           : config.scheduler == "multistep" ? static_cast<double>(config.lr_milestones.size())
                                                             : 3.0;
    const double g = config.LrGamma();
    if (g > 1 && !std::isfinite(config.lr * std::pow(g, factors))) {
      char given[32];
      std::snprintf(given, sizeof(given), "%g", g);
      throw UsageError("--lr_gamma=" + std::string(given) + " grows the rate past the largest number by the end of "
                       "this run (step " + FormatCount(end) + "): --lr x --lr_gamma^" +
                       FormatCount(static_cast<int64_t>(factors)) + " overflows; pass a smaller --lr_gamma");
    }
  }
  if (config.scheduler != "multistep" && config.scheduler != "plateau") return;
  const int64_t per_epoch = StepsPerEpoch(config, batches_per_epoch);
  const std::string how = WhatEndsTheRun(config, batches_per_epoch, end);
  if (config.scheduler == "multistep") {
    for (const int64_t milestone : config.lr_milestones) {
      if (milestone < end) continue;
      throw UsageError("--lr_milestones=" + FormatMilestones(config.lr_milestones) + ": step " +
                       std::to_string(milestone) + " would change nothing, this run ends at step " +
                       FormatCount(end) + " (" + how + "); pass milestones below " +
                       std::to_string(end));
    }
    return;
  }
  if (end < per_epoch) {
    throw UsageError("--scheduler=plateau takes the test loss at the end of each epoch, and this "
                     "run ends at step " + FormatCount(end) + " (--max_steps=" +
                     std::to_string(config.max_steps) + "), before its first epoch of " +
                     FormatCount(per_epoch) + " steps ends; pass --max_steps=0 or at least " +
                     std::to_string(per_epoch) + ", or another --scheduler");
  }
}

int64_t BatchesInEpoch(int64_t train_size, int world_size, int64_t batch_size,
                       int64_t epoch_start) {
  // The sampler itself counts: its padding decides how many are left.
  nn::data::DistributedSampler sampler(train_size, {.num_replicas = world_size, .rank = 0});
  sampler.set_start(epoch_start, 0);
  const int64_t n = sampler.Size();
  return n / batch_size + (n % batch_size != 0);
}

std::string FileWhereAFolderMustBe(const std::string& dir) {
  for (std::filesystem::path p = dir; !p.empty() && p != p.root_path(); p = p.parent_path()) {
    std::error_code ec;
    const auto status = std::filesystem::status(p, ec);
    if (ec || status.type() == std::filesystem::file_type::not_found) continue;
    if (status.type() != std::filesystem::file_type::directory) return p.string() + " is a file, not a folder";
    break;
  }
  return "";
}

namespace internal {
namespace {
std::atomic<int64_t> read_pause_ms{0};
std::mutex read_pause_mu;
std::string read_pause_mark;  // under read_pause_mu
}  // namespace

void SetReadPause(std::chrono::milliseconds pause, const std::string& started_mark) {
  {
    std::lock_guard lock(read_pause_mu);
    read_pause_mark = started_mark;
  }
  read_pause_ms.store(pause.count());
}

}  // namespace internal

namespace {

// internal::SetReadPause's wait before a read of a file that is there, as
// on a slow disk; it gives way to `*stop` (when given) within 10 ms.
void PauseIfAskedForTesting(const std::atomic<bool>* stop) {
  if (const int64_t pause = internal::read_pause_ms.load(); pause > 0) {
    std::string mark;
    {
      std::lock_guard lock(internal::read_pause_mu);
      mark = internal::read_pause_mark;
    }
    if (!mark.empty()) std::ofstream(mark).put('\n');
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(pause);
    while (std::chrono::steady_clock::now() < until && (stop == nullptr || !stop->load())) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

}  // namespace

namespace {

// Throws the UsageError of a checkpoint path that --resume cannot read from:
// one that cannot be looked at, or holds nothing.
void RefuseAbsentCheckpoint(const std::string& path) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(path, ec);
  if (ec && !IsThePathsErrno(ec.value())) {
    // The host failed the look (EIO, ENOMEM): the path may be right, and
    // the run fails (exit status 1) instead of refusing its flags.
    throw std::runtime_error("--resume: cannot look at the checkpoint " + path + ": " + ec.message() +
                             " (the host failed, which says nothing against the path or the file; it is left "
                             "as it is: retry once the host has recovered)");
  }
  if (ec) {
    // Not the same as absent (EACCES on a folder above it, ENAMETOOLONG,
    // ELOOP): a checkpoint may well be there, and a run started afresh
    // would replace it.
    throw UsageError("--resume: cannot look at the checkpoint " + path + ": " + ec.message() +
                     "; fix the path or its folders' permissions, or pass another --checkpoint");
  }
  if (!exists) {
    // A file where a folder of the path must be reads as absent too
    // (ENOTDIR), yet a run without --resume cannot create the checkpoint
    // there either.
    const std::string folder = std::filesystem::path(path).parent_path().string();
    if (const std::string file = folder.empty() ? "" : FileWhereAFolderMustBe(folder); !file.empty()) {
      throw UsageError("--resume: no checkpoint can be at " + path + ": " + file +
                       "; fix the path, or pass another --checkpoint");
    }
    throw UsageError("--resume: no checkpoint at " + path +
                     "; run once without --resume to create it, or pass --checkpoint=PATH");
  }
}

// A checkpoint as its header describes it.
struct CheckpointHeader {
  Metadata metadata;              // without the checksums and nn::io's own keys
  std::vector<SavedTensor> model;  // the tensors of the model ("model." taken off)
};

// Reads the header of the checkpoint at `path` alone, no tensor's data:
// throws the UsageError of a path that holds none, of a header that is not
// valid (nn::io's checks, the file's size against it included), and of a
// file that is not a checkpoint or whose tensors cannot load (the
// refusals LoadCheckpointFromBytes makes of the header).
CheckpointHeader ReadCheckpointHeader(const std::string& path) {
  RefuseAbsentCheckpoint(path);
  // ReadInto checks the header, hands over its entries, and reads the data
  // only after: an exception thrown there ends the read first.
  struct HeaderRead {};
  std::vector<nn::io::TensorEntry> entries;
  Metadata m;
  try {
    (void)nn::io::SafetensorsFile::ReadInto(path, [&](const nn::io::SafetensorsFile& file) -> std::vector<void*> {
      for (const size_t i : file.header_order()) entries.push_back(file.tensors()[i]);
      m = file.metadata();
      throw HeaderRead{};
    });
  } catch (const HeaderRead&) {
  } catch (const nn::io::CheckpointError& e) {
    std::rethrow_exception(Unreadable(e));
  }
  const auto refuse = [&](const std::string& why) {
    return UsageError("--resume: " + path + ": " + why + kNotThisTrainers);
  };
  const auto marker = m.find(nn::io::kCheckpointMarkerKey);
  if (marker == m.end()) throw refuse(std::string("no ") + nn::io::kCheckpointMarkerKey + " metadata, not a checkpoint");
  if (marker->second != "1") {
    throw refuse("checkpoint format version " + nn::io::NameForMessage(marker->second) +
                 ", where this build reads version 1");
  }
  for (const char* key : {nn::io::kCheckpointMarkerKey, nn::io::kChecksumKey, nn::io::kHeaderChecksumKey,
                          nn::io::kDevicesKey}) {
    m.erase(key);
  }
  CheckpointHeader header{std::move(m), {}};
  for (const nn::io::TensorEntry& e : entries) {
    nn::DType dtype;
    try {
      dtype = nn::io::FromStDtype(e.dtype);
    } catch (const std::invalid_argument&) {
      throw refuse("tensor `" + nn::io::NameForMessage(e.name) + "` has dtype " + nn::io::StDtypeName(e.dtype) +
                   ", which nn::Tensor does not have");
    }
    constexpr std::string_view kModel = "model.", kOptim = "optim.";
    if (e.name.starts_with(kModel)) {
      header.model.push_back({e.name.substr(kModel.size()), e.shape, dtype});
    } else if (!e.name.starts_with(kOptim)) {
      throw refuse("tensor `" + nn::io::NameForMessage(e.name) +
                   "` belongs to neither the model (model.) nor the optimizer (optim.)");
    }
  }
  return header;
}

}  // namespace

std::string ReadTrainCheckpoint(const std::string& path, const std::atomic<bool>* stop) {
  RefuseAbsentCheckpoint(path);
  PauseIfAskedForTesting(stop);
  if (stop != nullptr && stop->load()) {
    throw UsageError("--resume: the read of the checkpoint " + path + " was stopped");
  }
  try {
    return nn::io::SafetensorsFile::ReadBytes(path, stop);
  } catch (const nn::io::CheckpointError& e) {
    std::rethrow_exception(Unreadable(e));
  }
}

nn::io::Checkpoint TrainCheckpointOf(const TrainComponents& parts, const TrainPosition& pos,
                                     const TrainConfig& config, int world_size) {
  nn::io::Checkpoint ckpt;
  ckpt.model = parts.model->GetStateDict();
  ckpt.optimizer = parts.optimizer_state != nullptr ? *parts.optimizer_state : parts.optimizer->StateDict();
  if (parts.scheduler != nullptr) {
    for (auto& e : parts.scheduler->StateDict()) ckpt.optimizer.push_back(std::move(e));
  }
  if (parts.scaler != nullptr) {
    for (auto& e : parts.scaler->StateDict()) ckpt.optimizer.push_back(std::move(e));
  }
  if (parts.powersgd != nullptr) {
    for (auto& e : parts.powersgd->StateDict(parts.model->NamedParameters())) ckpt.optimizer.push_back(std::move(e));
  }
  if (parts.plateau != nullptr) {
    for (auto& e : parts.plateau->StateDict()) ckpt.optimizer.push_back(std::move(e));
  }
  Metadata& m = ckpt.metadata;
  m["format"] = "ddp-examples-train/1";
  m["model"] = config.model;
  m["dataset"] = config.dataset;
  m["optimizer"] = config.optimizer;
  m["scheduler"] = config.scheduler;
  m["amp"] = config.amp;
  // What --amp made of the model on this --device (see ConvertModelDType).
  m["device"] = config.device;
  if (const std::optional<nn::DType> dtype = FloatingDType(*parts.model)) {
    m["model_dtype"] = std::string(nn::DTypeName(*dtype));
  }
  // The schedule: its base rate (the scheduler's, or the constant one), and
  // the step it ends at with the flags that set it.
  // (A plateau's reductions are the optimizer's rate; its base is --lr.)
  const double rate = parts.scheduler != nullptr ? parts.scheduler->base_lr()
                      : parts.plateau != nullptr ? config.lr
                                                 : OptimizerRateIn(ckpt.optimizer);
  if (!std::isnan(rate)) m["lr"] = ExactDouble(rate);
  for (const ScheduleSetting& setting : ScheduleSettings(config)) m[setting.flag] = setting.saved;
  if (parts.plateau != nullptr) m["plateau_at_step"] = std::to_string(pos.plateau_at_step);
  m["comm_hook"] = config.comm_hook;
  m["sync_bn"] = config.sync_bn ? "true" : "false";
  m["momentum"] = ExactDouble(config.momentum);
  m["weight_decay"] = ExactDouble(config.weight_decay);
  m["decay_norm_and_bias"] = config.decay_norm_and_bias ? "true" : "false";
  if (parts.schedule != nullptr) m["schedule_steps"] = std::to_string(parts.schedule->steps());
  m["epochs"] = std::to_string(config.epochs);
  m["max_steps"] = std::to_string(config.max_steps);
  m["epoch"] = std::to_string(pos.epoch);
  m["batch_in_epoch"] = std::to_string(pos.batch_in_epoch);
  m["epoch_start"] = std::to_string(pos.epoch_start);
  // Rank r trained positions epoch_start + r, + world_size, ... of the
  // epoch's order, batch_in_epoch * batch_size of them on every rank: the
  // order's positions up to here, which a run on other ranks continues from.
  m["samples_in_epoch"] =
      std::to_string(pos.epoch_start + pos.batch_in_epoch * config.batch_size * world_size);
  m["step"] = std::to_string(pos.step);
  m["epoch_loss_sum"] = ExactDouble(pos.epoch_loss_sum);
  m["epoch_loss_count"] = std::to_string(pos.epoch_loss_count);
  m["epoch_loss_per"] = "sample";
  m["world_size"] = std::to_string(world_size);
  m["batch_size"] = std::to_string(config.batch_size);
  m["grad_accum_steps"] = std::to_string(config.grad_accum_steps);
  m["seed"] = std::to_string(config.seed);
  m["train_samples"] = std::to_string(config.train_samples);
  if (parts.train_size >= 0) m["train_size"] = std::to_string(parts.train_size);
  if (!config.job.empty()) m["job"] = config.job;
  if (!pos.run.empty()) m["run"] = pos.run;
  if (!parts.bucket_order.empty()) {
    std::string order;
    for (size_t i = 0; i < parts.bucket_order.size(); ++i) {
      order += (i ? "," : "") + std::to_string(parts.bucket_order[i]);
    }
    m["bucket_order"] = order;
  }
  return ckpt;
}

namespace {

// `detail` (a failed write's message, "<path>: <call>: <reason> (temporary
// file T)") without what the line around it says already: a leading
// "<path>: " and the ": <reason>" after the call.
std::string WithoutPathAndReason(std::string detail, const std::string& path, const std::string& reason) {
  if (detail.rfind(path + ": ", 0) == 0) detail.erase(0, path.size() + 2);
  if (const size_t at = detail.find(": " + reason); at != std::string::npos) detail.erase(at, reason.size() + 2);
  // Inside the line's own brackets: "write failed, temporary file T".
  static const std::string kTemporary = " (temporary file ";
  if (const size_t at = detail.find(kTemporary); at != std::string::npos && detail.back() == ')') {
    detail = detail.substr(0, at) + ", " + detail.substr(at + 2, detail.size() - at - 3);
  }
  return detail;
}

}  // namespace

std::string CheckpointSaveProblem(const std::string& path, int err, const std::string& detail) {
  std::string reason = std::strerror(err);
  std::string advice;
  switch (err) {
    case ENOSPC:
      advice = "the disk is full: free some space on it, or pass --checkpoint=PATH on another disk, or none";
      break;
    case EDQUOT:
      advice = "the disk quota is used up: free some of it, or pass --checkpoint=PATH on another disk, or none";
      break;
    case EACCES:
    case EPERM:
      advice = "pass --checkpoint=PATH in a folder this user may write to, or none";
      break;
    case EROFS:
      advice = "pass --checkpoint=PATH on a writable filesystem, or none";
      break;
    default:
      if (!detail.empty()) reason += " (" + WithoutPathAndReason(detail, path, reason) + ")";
      advice = "pass --checkpoint=PATH on a working, writable disk, or none";
  }
  return "cannot save the checkpoint " + path + ": " + reason + "; " + advice;
}

namespace {

// How a CheckpointSaveError for a checkpoint that is in place begins (see
// SavedButNotDurable).
constexpr char kSavedInPlace[] = "the checkpoint ";
constexpr char kSavedInPlaceAfterPath[] = " is saved and in place";

}  // namespace

bool SavedButNotDurable(const std::string& failure) {
  return failure.rfind(kSavedInPlace, 0) == 0 && failure.find(kSavedInPlaceAfterPath) != std::string::npos;
}

void WriteTrainCheckpoint(const std::string& path, const nn::io::Checkpoint& ckpt,
                          const std::atomic<bool>* stop) {
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  // The folders made here, deepest first: each one's entry is in its
  // parent's table, which must reach the disk too, or a crash soon after
  // the save could lose the folder with the checkpoint in it.
  std::vector<std::filesystem::path> made;
  for (std::filesystem::path p = parent; !p.empty() && !std::filesystem::exists(p, ec) && !ec;
       p = p.parent_path()) {
    made.push_back(p);
    if (p == p.parent_path()) break;
  }
  ec.clear();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) {
    throw CheckpointSaveError(
        CheckpointSaveProblem(path, ec.value(), "creating its folder " + parent.string()));
  }
  // Failures of the write are the run's, not its flags' (CheckpointSaveError):
  // the path was fine when the run began, and every rank reports them alike.
  // The message names the checkpoint, not the temporary file the write was
  // in, and gives the system's reason.
  try {
    for (const std::filesystem::path& folder : made) {
      const std::filesystem::path above = folder.parent_path();
      nn::io::SyncFolder(above.empty() ? "." : above.string());
    }
    nn::io::SaveCheckpoint(path, ckpt, stop);
  } catch (const nn::io::FileWriteError& e) {
    if (e.in_place()) {
      // Only the fsync of the folder failed, after the file was whole,
      // fsynced and renamed into place: readers (a --resume) get it, and
      // only a crash of the host before the folder reaches the disk could
      // lose its name. Said as it is: "cannot save" was untrue.
      throw CheckpointSaveError(std::string(kSavedInPlace) + path + kSavedInPlaceAfterPath +
                                " (--resume continues from it), but the fsync of its folder failed: " +
                                std::strerror(e.error_number()) +
                                ", so a crash of this host may still lose it; pass --checkpoint=PATH on a "
                                "working disk, or none");
    }
    throw CheckpointSaveError(CheckpointSaveProblem(path, e.error_number(), e.what()));
  } catch (const nn::io::CheckpointError& e) {
    throw CheckpointSaveError("cannot save the checkpoint " + path + ": " + e.what());
  }
}

void SaveTrainCheckpoint(const std::string& path, const TrainComponents& parts,
                         const TrainPosition& pos, const TrainConfig& config, int world_size,
                         const std::atomic<bool>* stop) {
  WriteTrainCheckpoint(path, TrainCheckpointOf(parts, pos, config, world_size), stop);
}

void CheckCheckpointMatchesModel(const std::string& path, const nn::modules::Module& model,
                                 const TrainConfig& config) {
  nn::io::Checkpoint ckpt = Read(path);
  ConvertModelDType(ckpt.model, ckpt.optimizer, model, ckpt.metadata);
  const std::string msg = ModelMismatch(path, Described(ckpt.model), model, config, ckpt.metadata);
  if (!msg.empty()) throw UsageError(msg);
}

TrainPosition LoadTrainCheckpoint(const std::string& path, const TrainComponents& parts,
                                  const TrainConfig& config, int world_size, std::string* note) {
  return LoadTrainCheckpoint(path, ReadTrainCheckpoint(path), parts, config, world_size, note);
}

namespace {

// What a resume continues from: the position, the schedule's horizon (0
// without a schedule) and the notes for the user.
struct ResumePlan {
  TrainPosition pos;
  int64_t horizon = 0;
  std::vector<std::string> notes;
};

// The refusals of a resume that the checkpoint's header decides, each a
// UsageError: `m` is its metadata, and `model` its model tensors as they
// load (converted as ModelDTypeChange says), checked against this run's
// model, flags and ranks. Nothing of `parts` changes.
ResumePlan PlanResume(const std::string& path, const Metadata& m, const std::vector<SavedTensor>& model,
                      const TrainComponents& parts, const TrainConfig& config, int world_size) {
  if (std::string msg = ModelMismatch(path, model, *parts.model, config, m); !msg.empty()) {
    throw UsageError(msg);
  }
  const std::string saved_optimizer = Get(m, "optimizer");
  if (!saved_optimizer.empty() && saved_optimizer != config.optimizer) {
    throw UsageError("checkpoint " + path + " holds " + saved_optimizer +
                     " state and this run uses --optimizer=" + config.optimizer +
                     "; pass --optimizer=" + saved_optimizer + ", or another --checkpoint path");
  }
  // On a GPU the model and optimizer state are f32 under every --amp, so
  // the model check above cannot tell: another precision (or fp16's loss
  // scaler state left behind) is refused here. (The same --amp on another
  // --device loads: ConvertModelDType.)
  const std::string saved_amp = Get(m, "amp");
  if (!saved_amp.empty() && saved_amp != config.amp) {
    throw UsageError("checkpoint " + path + " was saved with --amp=" + saved_amp +
                     " and this run has --amp=" + config.amp + "; pass --amp=" + saved_amp +
                     " to continue that run, or another --checkpoint path to start afresh");
  }
  // Another dataset of the same image shape (mnist for fashion_mnist) fits
  // the model, yet training it on would not continue that run.
  const std::string saved_dataset = Get(m, "dataset");
  if (!saved_dataset.empty() && saved_dataset != config.dataset) {
    throw UsageError("checkpoint " + path + " was saved with --dataset=" + saved_dataset +
                     " and this run has --dataset=" + config.dataset + "; pass --dataset=" +
                     saved_dataset +
                     " to continue that run, or another --checkpoint path to start afresh");
  }
  CheckSameSchedule(path, m, config);
  TrainPosition pos;
  pos.epoch = MetaInt(m, "epoch", path);
  pos.batch_in_epoch = MetaInt(m, "batch_in_epoch", path);
  pos.step = MetaInt(m, "step", path);
  pos.epoch_loss_count = MetaInt(m, "epoch_loss_count", path);
  try {
    pos.epoch_loss_sum = ParseExactDouble(Get(m, "epoch_loss_sum"));
  } catch (const std::invalid_argument&) {
    throw UsageError("--resume: checkpoint " + path +
                     " has no valid epoch_loss_sum" + kNotThisTrainers);
  }
  // An older trainer summed each micro-batch's mean loss and counted
  // batches. Inside an epoch, where the sum is kept, its batches were
  // full (only an epoch's last may be short, and its end clears the sum):
  // times the batch size they are the samples' sum and count, and the
  // mean is unchanged.
  if (Get(m, "epoch_loss_per").empty() && pos.epoch_loss_count > 0) {
    const int64_t batch = MetaInt(m, "batch_size", path);
    pos.epoch_loss_sum *= static_cast<double>(batch);
    pos.epoch_loss_count *= batch;
  }

  pos.epoch_start = Get(m, "epoch_start").empty() ? 0 : MetaInt(m, "epoch_start", path);
  pos.bucket_order = ParseBucketOrder(Get(m, "bucket_order"));
  pos.run = Get(m, "run");
  if (parts.plateau != nullptr && !Get(m, "plateau_at_step").empty()) {
    pos.plateau_at_step = MetaInt(m, "plateau_at_step", path);
  }
  const int64_t saved_world = MetaInt(m, "world_size", path);
  const int64_t saved_batch = MetaInt(m, "batch_size", path);
  const int64_t saved_accum = MetaInt(m, "grad_accum_steps", path);
  // The training-set size of the saved run (-1: an older trainer's file).
  const int64_t saved_size = Get(m, "train_size").empty() ? -1 : MetaInt(m, "train_size", path);
  const int64_t trained = CheckPositionInRange(path, m, pos, saved_world, saved_batch, saved_accum,
                                               saved_size);

  std::vector<std::string> notes;
  // The epoch's sample order is a function of the seed and the training
  // set; how it is cut into batches, of the ranks, batch size and
  // accumulation.
  std::string saved_samples, these_samples;
  // (`optional`: absent from files of older trainers, which still load.)
  const auto compare = [&](const std::string& what, const std::string& saved,
                           const std::string& now, bool optional = false) {
    if (saved == now || (optional && saved.empty())) return;
    saved_samples +=
        (saved_samples.empty() ? "" : ", ") + what + " " + (saved.empty() ? "unknown" : saved);
    these_samples += (these_samples.empty() ? "" : ", ") + what + " " + now;
  };
  compare("seed", Get(m, "seed"), std::to_string(config.seed));
  if (saved_size >= 0 && parts.train_size >= 0) {
    // The training set's size, not the flag that cut it: --train_samples=0
    // and --train_samples=60000 are the same 60,000 samples. (Another
    // --data_dir of the same dataset name may hold another number.)
    compare("training samples", std::to_string(saved_size), std::to_string(parts.train_size));
  } else {
    // An older trainer's file, or a size not known here: the flag.
    compare("--train_samples", Get(m, "train_samples"), std::to_string(config.train_samples));
  }
  const bool same_samples = saved_samples.empty();
  if (saved_size < 0 && parts.train_size >= 0 && same_samples) {
    // An older trainer's file records no train_size; the same seed and
    // --train_samples make it this run's set, so its position must fit that:
    // a samples_in_epoch past it would start the epoch past its end.
    CheckPositionInSet(path, pos, trained, !Get(m, "samples_in_epoch").empty(), saved_world, saved_batch,
                       parts.train_size,
                       "this run's training set of " + std::to_string(parts.train_size) +
                           " samples (the file has no train_size)");
  }
  const bool same_order = same_samples && saved_world == world_size &&
                          saved_batch == config.batch_size &&
                          saved_accum == config.grad_accum_steps;
  const bool mid_epoch = pos.batch_in_epoch > 0 || pos.epoch_start > 0;
  if (!same_order && mid_epoch && same_samples) {
    // The same order cut otherwise: train the positions not yet trained.
    notes.push_back("the checkpoint was saved in the middle of epoch " +
                    std::to_string(pos.epoch + 1) + " by a run on " + std::to_string(saved_world) +
                    " ranks, batch " + std::to_string(saved_batch) +
                    (saved_accum > 1 ? " x " + std::to_string(saved_accum) + " accumulated" : "") +
                    ", after " + FormatCount(trained) +
                    " samples of the epoch's order; this run trains the rest of that epoch");
    pos.epoch_start = trained;
    pos.batch_in_epoch = 0;
  } else if (!same_order && mid_epoch) {
    // Another order: the samples not yet trained are not known.
    const int64_t left = pos.epoch;
    std::string note = "the checkpoint was saved in the middle of epoch " +
                       std::to_string(left + 1) + " by a run with another sample order (" +
                       saved_samples + "; this run has " + these_samples + "): ";
    if (left + 1 >= config.epochs) {
      note += "it was the last of --epochs=" + std::to_string(config.epochs) +
              ", so nothing is left to train, and it does not count as done; resume with the "
              "settings it was saved with to finish it";
    } else {
      note += "continuing with epoch " + std::to_string(left + 2) + "; epoch " +
              std::to_string(left + 1) + " does not count as done";
    }
    notes.push_back(note);
    pos.epoch += 1;
    pos.batch_in_epoch = 0;
    pos.epoch_start = 0;
    pos.epoch_loss_sum = 0;
    pos.epoch_loss_count = 0;
    pos.untrained_epochs = 1;
  }
  const int64_t horizon = parts.schedule != nullptr
                              ? ResumedHorizon(path, m, config, parts, pos, world_size, notes)
                              : 0;
  return {pos, horizon, std::move(notes)};
}

}  // namespace

TrainPosition LoadTrainCheckpoint(const std::string& path, std::string bytes,
                                  const TrainComponents& parts, const TrainConfig& config,
                                  int world_size, std::string* note) {
  nn::io::Checkpoint ckpt = Parse(path, std::move(bytes));
  const Metadata& m = ckpt.metadata;
  ConvertModelDType(ckpt.model, ckpt.optimizer, *parts.model, m);
  ResumePlan plan = PlanResume(path, m, Described(ckpt.model), parts, config, world_size);
  CheckSchedulerStep(path, ckpt.optimizer, plan.pos.step);
  const TrainPosition& pos = plan.pos;
  std::vector<std::string>& notes = plan.notes;
  const int64_t horizon = plan.horizon;

  // PowerSGD's state is checked before anything is loaded, and loaded last.
  const bool has_powersgd = std::any_of(ckpt.optimizer.begin(), ckpt.optimizer.end(), [](const auto& e) {
    return e.first.rfind("powersgd.", 0) == 0;
  });
  const bool load_powersgd = parts.powersgd != nullptr && has_powersgd;
  if (load_powersgd) {
    try {
      parts.powersgd->CheckStateDict(ckpt.optimizer, parts.model->NamedParameters());
    } catch (const std::invalid_argument& e) {
      throw UsageError("checkpoint " + path + " has PowerSGD state this run cannot use (" + e.what() +
                       "); resume with the settings it was saved with");
    }
  }
  // Load everything or nothing: the optimizer and scheduler check their keys
  // before they change anything, and the model's keys were checked above.
  // Only their refusals of the file's content (std::invalid_argument) are
  // bad input. Anything else (std::bad_alloc, the JobError of a collective
  // that failed in a sharded load) is this rank's own failure of the run,
  // and goes on as it is: as a UsageError it ended with exit status 2 and,
  // on ranks other than 0, was reported as rank 0's refusal.
  try {
    if (parts.plateau != nullptr) parts.plateau->CheckStateDict(ckpt.optimizer);
    if (parts.load_optimizer) {
      parts.load_optimizer(ckpt.optimizer);
    } else {
      parts.optimizer->LoadStateDict(ckpt.optimizer);
    }
    if (parts.schedule != nullptr) parts.schedule->set_steps(horizon);
    if (parts.scheduler != nullptr) parts.scheduler->LoadStateDict(ckpt.optimizer);
    if (parts.plateau != nullptr) parts.plateau->LoadStateDict(ckpt.optimizer);
    if (parts.scaler != nullptr) parts.scaler->LoadStateDict(ckpt.optimizer);
    if (load_powersgd) parts.powersgd->LoadStateDict(ckpt.optimizer, parts.model->NamedParameters());
  } catch (const std::invalid_argument& e) {
    std::string what = e.what();
    for (char& c : what) {
      if (c == '\n') c = ' ';
    }
    throw UsageError("checkpoint " + path + " has optimizer state this run cannot use (" + what +
                     "); pass the --optimizer, --scheduler and --amp it was saved with");
  }
  parts.model->LoadStateDict(ckpt.model);

  if (Get(m, "lr").empty()) {
    // An older trainer's checkpoint: the rate it saved wins, as it always did.
    const double rate = RateIn(ckpt.optimizer, parts.scheduler != nullptr ? "scheduler.base_lr" : "lr");
    if (!std::isnan(rate) && rate != config.lr) {
      notes.push_back("checkpoint " + path +
                      " was saved by an older trainer, which did not record --lr: the run "
                      "continues from its rate " + FlagDouble(rate) + ", not --lr=" +
                      FlagDouble(config.lr));
    }
  }
  // How gradients travel and whether BatchNorm statistics are shared
  // change the training from here on, not what it continues from: a run
  // may switch them (to save bandwidth, say), but not without a word.
  // (Absent: an older trainer's file.)
  const std::pair<const char*, std::string> comm_settings[] = {
      {"comm_hook", config.comm_hook}, {"sync_bn", config.sync_bn ? "true" : "false"}};
  for (const auto& [flag, value] : comm_settings) {
    const std::string was = Get(m, flag);
    if (was.empty() || was == value) continue;
    notes.push_back("checkpoint " + path + " was saved with --" + flag + "=" + was +
                    " and this run has --" + flag + "=" + value + ", which it goes on with");
  }
  if (note != nullptr) {
    note->clear();
    for (const std::string& n : notes) *note += (note->empty() ? "" : "; ") + n;
  }
  return pos;
}

void CheckTrainCheckpointHeader(const std::string& path, const TrainComponents& parts,
                                const TrainConfig& config, int world_size) {
  CheckpointHeader header = ReadCheckpointHeader(path);
  if (const std::optional<DTypeChange> change = ModelDTypeChange(*parts.model, header.metadata)) {
    for (SavedTensor& t : header.model) {
      if (change->Converts(t.name, t.dtype)) t.dtype = change->to;
    }
  }
  (void)PlanResume(path, header.metadata, header.model, parts, config, world_size);
}

std::string NewRunId() {
  // The device's randomness, with the time and the process as a fallback
  // where it is a fixed sequence (some libstdc++ builds without one).
  std::random_device device;
  uint64_t id = (static_cast<uint64_t>(device()) << 32) ^ device();
  id ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
  id ^= static_cast<uint64_t>(::getpid()) << 17;
  return StringPrintf("%016llx", static_cast<unsigned long long>(id));
}

std::string JobFingerprint(const std::string& token, const std::string& run_id) {
  // Without a token, the run id alone names the job (torchrun gives no
  // token, only its rendezvous id); without either, there is no name.
  if (token.empty() && run_id.empty()) return "";
  // FNV-1a, 64 bits, over a fixed prefix, the token and the run id.
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char ch : "ddp-job:" + token + (run_id.empty() ? "" : "\nrun:" + run_id)) {
    h ^= static_cast<unsigned char>(ch);
    h *= 0x100000001b3ull;
  }
  return StringPrintf("%016llx", static_cast<unsigned long long>(h));
}

bool IsAnotherRunsCheckpoint(const std::string& path, const std::string& job) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec) && !ec) return false;
  PauseIfAskedForTesting(nullptr);
  try {
    // The header says whose it is; the tensors need not be read.
    const Metadata m = nn::io::SafetensorsFile::ReadMetadata(path);
    // A safetensors file the trainer did not write (weights exported from
    // Python, say) is kept like a checkpoint of another run.
    if (Get(m, "format").empty()) return true;
    return job.empty() || Get(m, "job") != job;
  } catch (const std::exception&) {
    // Unreadable now (EIO, ESTALE) says nothing of whose it is: it may be
    // a good checkpoint a retry could read. A file that is not safetensors
    // at all (a PyTorch .pt) is no run's, but is kept all the same rather
    // than replaced (KeptFileKind tells them apart).
    return true;
  }
}

std::string KeptFileKind(const std::string& path) {
  try {
    if (Get(nn::io::SafetensorsFile::ReadMetadata(path), "format").empty()) {
      return "a file this trainer did not write";
    }
  } catch (const nn::io::CheckpointError& e) {
    // nn/io nests the errno of a read the host failed (EIO, ESTALE,
    // ENOMEM): perhaps a good checkpoint a retry could read. Nothing
    // nested: the bytes themselves are not safetensors (a PyTorch .pt, a
    // text file), which --resume refuses as well.
    try {
      std::rethrow_if_nested(e);
    } catch (...) {
      return "a file whose header cannot be read now";
    }
    return "a file that does not read as a safetensors file";
  } catch (const std::exception&) {
    return "a file whose header cannot be read now";
  }
  return "another run's checkpoint";
}

std::string PreviousCheckpointPath(const std::string& path, int n) {
  const std::filesystem::path p(path);
  const std::string number = n > 1 ? "." + std::to_string(n) : "";
  return (p.parent_path() / (p.stem().string() + ".prev" + number + p.extension().string())).string();
}

namespace {

// Where the kept names of the file at `path` go: beside `path`, or, when
// `path` is a symbolic link to a file on another filesystem, beside that
// file (a hard link cannot cross filesystems; see KeepAsPreviousCheckpoint).
std::string KeptNamesBeside(const std::string& path) {
  struct stat link{};
  if (::lstat(path.c_str(), &link) != 0 || !S_ISLNK(link.st_mode)) return path;
  std::string target;
  try {
    target = nn::io::AtomicWriteTarget(path);
  } catch (const nn::io::CheckpointError&) {
    return path;
  }
  const std::string folder = std::filesystem::path(path).parent_path().string();
  struct stat file{}, here{};
  if (::stat(target.c_str(), &file) != 0 || ::stat(folder.empty() ? "." : folder.c_str(), &here) != 0) {
    return path;
  }
  return file.st_dev == here.st_dev ? path : target;
}

// Whether errno `err` from link(2) says that the filesystem makes no hard
// link here (some network and FUSE filesystems, protected_hardlinks, a file
// on another filesystem), rather than that something is wrong.
bool NoHardLinkHere(int err) {
  return err == EPERM || err == ENOTSUP || err == EOPNOTSUPP || err == EMLINK || err == ENOSYS ||
         err == EXDEV;
}

// Gives `file` the first free PreviousCheckpointPath(named_after, n) name
// (*kept), as a second name (a hard link; of the file a symbolic link at
// `file` leads to when `follow`) or, where there are no hard links, by
// renaming it. Returns 0 or the errno of the failure (EEXIST: every name
// is taken). With `follow`, a symbolic link at `file` that cannot be given
// a hard link there is not renamed: the result is then kLinkNotKept.
constexpr int kLinkNotKept = -1;
int KeepUnderAFreeName(const std::string& file, const std::string& named_after, bool follow, std::string* kept) {
  int err = 0;
  for (int n = 1; n <= kMaxPreviousCheckpoints; ++n) {
    *kept = PreviousCheckpointPath(named_after, n);
    if (::linkat(AT_FDCWD, file.c_str(), AT_FDCWD, kept->c_str(), follow ? AT_SYMLINK_FOLLOW : 0) == 0) return 0;
    err = errno;
    if (err == EEXIST) continue;
    if (!NoHardLinkHere(err)) return err;
    if (follow) {
      struct stat st{};
      if (::lstat(file.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) return kLinkNotKept;
    }
    if (::renameat2(AT_FDCWD, file.c_str(), AT_FDCWD, kept->c_str(), RENAME_NOREPLACE) == 0) return 0;
    err = errno;
    if (err == EEXIST) continue;
    if (err != EINVAL && err != ENOSYS) return err;
    // Nor RENAME_NOREPLACE: a plain rename to a name free a moment ago.
    if (NameTaken(*kept)) {
      err = EEXIST;
      continue;
    }
    return ::rename(file.c_str(), kept->c_str()) == 0 ? 0 : errno;
  }
  return err;
}

}  // namespace

std::string FreePreviousCheckpointPath(const std::string& path) {
  const std::string named_after = KeptNamesBeside(path);
  std::string candidate;
  for (int n = 1; n <= kMaxPreviousCheckpoints; ++n) {
    candidate = PreviousCheckpointPath(named_after, n);
    // Free, or a name the folder cannot hold (longer than NAME_MAX): the
    // keep stops there either way, as the later names are longer still.
    struct stat st{};
    if (::lstat(candidate.c_str(), &st) != 0 && (errno == ENOENT || errno == ENAMETOOLONG)) break;
  }
  return candidate;
}

std::string KeepAsPreviousCheckpoint(const std::string& path) {
  // Each name is claimed by a call that fails on an existing entry (link(2),
  // rename(2) with RENAME_NOREPLACE) rather than checked first: two jobs
  // keeping files at once cannot both take it, and nothing kept before is
  // ever replaced.
  //
  // A second name: `path` stays in place until the save renames the new
  // checkpoint over it, so a save that fails leaves it there. Of the file
  // a symbolic link at `path` leads to, not of the link: the save writes
  // through the link (AtomicFileWriter), and a second name of the link
  // would show the new file. Where there are no hard links (some network
  // and FUSE filesystems, or protected_hardlinks), the file is renamed
  // instead, and the save makes a new one at `path`.
  std::string previous;
  int err = KeepUnderAFreeName(path, path, /*follow=*/true, &previous);
  if (err == kLinkNotKept) {
    // A link at `path` to a file that cannot have a second name beside the
    // link (on another filesystem, or on one without hard links). Moving
    // the link would keep the old file, but the save would then make a
    // plain file at `path` rather than write through the link to where
    // it leads. The file it leads to is kept beside itself instead (a hard
    // link, or renamed where there are none), and the link stays.
    std::string target;
    try {
      target = nn::io::AtomicWriteTarget(path);
    } catch (const nn::io::CheckpointError& e) {
      throw UsageError("cannot keep another run's checkpoint " + path + ": " + e.what() +
                       "; move it yourself, or pass another --checkpoint path");
    }
    err = KeepUnderAFreeName(target, target, /*follow=*/false, &previous);
  }
  if (err != 0) {
    throw UsageError("cannot keep another run's checkpoint " + path + " as " + previous + ": " +
                     (err == EEXIST ? "the " + std::to_string(kMaxPreviousCheckpoints) +
                                          " names for kept checkpoints are all taken"
                                    : std::string(std::strerror(err))) +
                     "; move it yourself, or pass another --checkpoint path");
  }
  const std::string folder = std::filesystem::path(previous).parent_path().string();
  try {
    nn::io::SyncFolder(folder.empty() ? "." : folder);
  } catch (const nn::io::CheckpointError&) {
    // The new name is made; only its durability across a crash is not
    // certain, and the save that follows syncs the folder again.
  }
  return previous;
}

bool ForgetKeptCheckpoint(const std::string& path, const std::string& previous) {
  std::error_code ec;
  if (!std::filesystem::equivalent(path, previous, ec) || ec) return false;
  return std::filesystem::remove(previous, ec) && !ec;
}

std::string ResumeAfterRestart(TrainConfig& config, int restart) {
  const std::string attempt = "restart " + std::to_string(restart) + " of the job: ";
  if (config.resume) return attempt + "resuming from " + config.checkpoint + " as asked";
  if (config.checkpoint.empty()) return attempt + "no checkpoints (--checkpoint=none); starting over";
  std::error_code ec;
  const bool exists = std::filesystem::exists(config.checkpoint, ec);
  if (!exists && !ec) {
    return attempt + "no checkpoint at " + config.checkpoint + " yet; starting over";
  }
  // Whose it is cannot be told from a file whose header cannot be read.
  // Starting over would replace it at the first save, and it may be this
  // job's own good checkpoint, unreadable for a moment (EIO, ESTALE): the
  // restart stops instead and leaves the file as it is.
  const auto unreadable = [&](const std::string& why) {
    return UsageError(attempt + "cannot read the checkpoint at " + config.checkpoint + " (" + why +
                      "), so it cannot tell whether it is this job's; it is left as it is rather "
                      "than replaced at the first save. Delete it or pass another --checkpoint to "
                      "start afresh, or --resume to continue from it once it reads");
  };
  if (ec) throw unreadable(ec.message());
  PauseIfAskedForTesting(nullptr);
  std::string saved_by;
  try {
    // The header alone: the resume reads the rest, and refuses a file
    // whose data is damaged without replacing it either.
    const Metadata m = nn::io::SafetensorsFile::ReadMetadata(config.checkpoint);
    const auto job = m.find("job");
    if (job != m.end()) saved_by = job->second;
  } catch (const nn::io::CheckpointError& e) {
    // The file's fault (or its disk's). Anything else (out of memory) is
    // the restart's own failure, and goes on as it came.
    throw unreadable(e.what());
  }
  if (config.job.empty()) {
    return attempt + "this job has no name (no DDP_JOB_TOKEN, DDP_RUN_ID or torchrun --rdzv_id), so the "
           "checkpoint at " + config.checkpoint + " cannot be told from another run's; starting over";
  }
  if (saved_by != config.job) {
    return attempt + "the checkpoint at " + config.checkpoint +
           " is from another run; starting over (the first save keeps it as " +
           FreePreviousCheckpointPath(config.checkpoint) + ")";
  }
  config.resume = true;
  return attempt + "resuming from this run's checkpoint " + config.checkpoint;
}

}  // namespace ddp::examples::trainer
