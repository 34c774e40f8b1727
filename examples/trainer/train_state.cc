#include "examples/trainer/train_state.h"

#include <filesystem>
#include <map>
#include <set>

#include "examples/trainer/format.h"
#include "nn/io/checkpoint.h"
#include "nn/io/safetensors.h"

namespace ddp::examples::trainer {
namespace {

using nn::io::Metadata;
using nn::io::NamedTensors;

constexpr size_t kKeysShown = 6;

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

// The one-line complaint about a model state that does not fit `model`, or
// "" when it fits.
std::string ModelMismatch(const std::string& path, const NamedTensors& saved,
                          const nn::modules::Module& model, const TrainConfig& config,
                          const Metadata& metadata) {
  std::map<std::string, const nn::Tensor*> have;
  for (const auto& [name, t] : saved) have[name] = &t;
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> mine;
  for (const auto& [name, t] : model.GetStateDict()) {
    mine.insert(name);
    auto it = have.find(name);
    if (it == have.end()) {
      missing.push_back(name);
    } else if (it->second->shape() != t.shape() || it->second->dtype() != t.dtype()) {
      mismatched.push_back(name + " " + nn::ShapeToString(it->second->shape()) + " " +
                           std::string(nn::DTypeName(it->second->dtype())) + " vs " +
                           nn::ShapeToString(t.shape()) + " " +
                           std::string(nn::DTypeName(t.dtype())));
    }
  }
  for (const auto& [name, t] : saved) {
    if (!mine.count(name)) unexpected.push_back(name);
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
  if (!saved_model.empty()) {
    msg += " it was saved by --model=" + saved_model +
           (saved_amp.empty() || saved_amp == "off" ? "" : " --amp=" + saved_amp) +
           "; pass the same flags, or another --checkpoint path";
  } else {
    msg += " pass the flags it was saved with, or another --checkpoint path";
  }
  return msg;
}

// Parses a checkpoint's bytes (read here or by rank 0).
nn::io::Checkpoint Parse(const std::string& path, std::string bytes) {
  try {
    return nn::io::LoadCheckpointFromBytes(std::move(bytes), path);
  } catch (const nn::io::CheckpointError& e) {
    throw UsageError(std::string("--resume: ") + e.what() +
                     "; delete the file or pass another --checkpoint to start afresh");
  }
}

nn::io::Checkpoint Read(const std::string& path) { return Parse(path, ReadTrainCheckpoint(path)); }

int64_t MetaInt(const Metadata& m, const std::string& key, const std::string& path) {
  try {
    return nn::io::MetadataInt(m, key, path);
  } catch (const nn::io::CheckpointError& e) {
    throw UsageError(std::string("--resume: ") + e.what() +
                     "; the file was not written by this trainer");
  }
}

}  // namespace

std::string ReadTrainCheckpoint(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    throw UsageError("--resume: no checkpoint at " + path +
                     "; run once without --resume to create it, or pass --checkpoint=PATH");
  }
  try {
    return nn::io::SafetensorsFile::ReadBytes(path);
  } catch (const nn::io::CheckpointError& e) {
    throw UsageError(std::string("--resume: ") + e.what() +
                     "; delete the file or pass another --checkpoint to start afresh");
  }
}

void SaveTrainCheckpoint(const std::string& path, const TrainComponents& parts,
                         const TrainPosition& pos, const TrainConfig& config, int world_size) {
  nn::io::Checkpoint ckpt;
  ckpt.model = parts.model->GetStateDict();
  ckpt.optimizer = parts.optimizer_state != nullptr ? *parts.optimizer_state : parts.optimizer->StateDict();
  if (parts.scheduler != nullptr) {
    for (auto& e : parts.scheduler->StateDict()) ckpt.optimizer.push_back(std::move(e));
  }
  if (parts.scaler != nullptr) {
    for (auto& e : parts.scaler->StateDict()) ckpt.optimizer.push_back(std::move(e));
  }
  Metadata& m = ckpt.metadata;
  m["format"] = "ddp-examples-train/1";
  m["model"] = config.model;
  m["dataset"] = config.dataset;
  m["optimizer"] = config.optimizer;
  m["scheduler"] = config.scheduler;
  m["amp"] = config.amp;
  m["epoch"] = std::to_string(pos.epoch);
  m["batch_in_epoch"] = std::to_string(pos.batch_in_epoch);
  m["step"] = std::to_string(pos.step);
  m["epoch_loss_sum"] = ExactDouble(pos.epoch_loss_sum);
  m["epoch_loss_count"] = std::to_string(pos.epoch_loss_count);
  m["world_size"] = std::to_string(world_size);
  m["batch_size"] = std::to_string(config.batch_size);
  m["grad_accum_steps"] = std::to_string(config.grad_accum_steps);
  m["seed"] = std::to_string(config.seed);
  m["train_samples"] = std::to_string(config.train_samples);
  if (parts.train_size >= 0) m["train_size"] = std::to_string(parts.train_size);
  if (!config.job.empty()) m["job"] = config.job;
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) {
    throw UsageError("cannot create the checkpoint folder " + parent.string() + ": " +
                     ec.message() + "; pass --checkpoint=PATH somewhere writable, or none");
  }
  try {
    nn::io::SaveCheckpoint(path, ckpt);
  } catch (const nn::io::CheckpointError& e) {
    throw UsageError(std::string("cannot save the checkpoint: ") + e.what() +
                     "; pass --checkpoint=PATH somewhere writable, or none");
  }
}

void CheckCheckpointMatchesModel(const std::string& path, const nn::modules::Module& model,
                                 const TrainConfig& config) {
  const nn::io::Checkpoint ckpt = Read(path);
  const std::string msg = ModelMismatch(path, ckpt.model, model, config, ckpt.metadata);
  if (!msg.empty()) throw UsageError(msg);
}

TrainPosition LoadTrainCheckpoint(const std::string& path, const TrainComponents& parts,
                                  const TrainConfig& config, int world_size, std::string* note) {
  return LoadTrainCheckpoint(path, ReadTrainCheckpoint(path), parts, config, world_size, note);
}

TrainPosition LoadTrainCheckpoint(const std::string& path, std::string bytes,
                                  const TrainComponents& parts, const TrainConfig& config,
                                  int world_size, std::string* note) {
  const nn::io::Checkpoint ckpt = Parse(path, std::move(bytes));
  const Metadata& m = ckpt.metadata;
  if (std::string msg = ModelMismatch(path, ckpt.model, *parts.model, config, m); !msg.empty()) {
    throw UsageError(msg);
  }
  const std::string saved_optimizer = Get(m, "optimizer");
  if (!saved_optimizer.empty() && saved_optimizer != config.optimizer) {
    throw UsageError("checkpoint " + path + " holds " + saved_optimizer +
                     " state and this run uses --optimizer=" + config.optimizer +
                     "; pass --optimizer=" + saved_optimizer + ", or another --checkpoint path");
  }
  TrainPosition pos;
  pos.epoch = MetaInt(m, "epoch", path);
  pos.batch_in_epoch = MetaInt(m, "batch_in_epoch", path);
  pos.step = MetaInt(m, "step", path);
  pos.epoch_loss_count = MetaInt(m, "epoch_loss_count", path);
  try {
    pos.epoch_loss_sum = ParseExactDouble(Get(m, "epoch_loss_sum"));
  } catch (const std::invalid_argument&) {
    throw UsageError("--resume: checkpoint " + path +
                     " has no valid epoch_loss_sum; the file was not written by this trainer");
  }
  // Load everything or nothing: the optimizer and scheduler check their keys
  // before they change anything, and the model's keys were checked above.
  try {
    if (parts.load_optimizer) {
      parts.load_optimizer(ckpt.optimizer);
    } else {
      parts.optimizer->LoadStateDict(ckpt.optimizer);
    }
    if (parts.scheduler != nullptr) parts.scheduler->LoadStateDict(ckpt.optimizer);
    if (parts.scaler != nullptr) parts.scaler->LoadStateDict(ckpt.optimizer);
  } catch (const std::exception& e) {
    std::string what = e.what();
    for (char& c : what) {
      if (c == '\n') c = ' ';
    }
    throw UsageError("checkpoint " + path + " has optimizer state this run cannot use (" + what +
                     "); pass the --optimizer, --scheduler and --amp it was saved with");
  }
  parts.model->LoadStateDict(ckpt.model);

  const bool same_order = MetaInt(m, "world_size", path) == world_size &&
                          MetaInt(m, "batch_size", path) == config.batch_size &&
                          MetaInt(m, "grad_accum_steps", path) == config.grad_accum_steps &&
                          Get(m, "seed") == std::to_string(config.seed) &&
                          Get(m, "dataset") == config.dataset &&
                          Get(m, "train_samples") == std::to_string(config.train_samples) &&
                          // Another --data_dir of the same dataset name: other samples.
                          (parts.train_size < 0 || Get(m, "train_size").empty() ||
                           Get(m, "train_size") == std::to_string(parts.train_size));
  if (!same_order && pos.batch_in_epoch > 0) {
    if (note != nullptr) {
      *note = "the checkpoint was saved in the middle of epoch " + std::to_string(pos.epoch + 1) +
              " by a run with another data order (" + Get(m, "world_size") + " ranks, batch " +
              Get(m, "batch_size") + ", seed " + Get(m, "seed") +
              (Get(m, "train_size").empty() ? "" : ", " + Get(m, "train_size") + " training samples") +
              "); continuing with epoch " +
              std::to_string(pos.epoch + 2);
    }
    pos.epoch += 1;
    pos.batch_in_epoch = 0;
    pos.epoch_loss_sum = 0;
    pos.epoch_loss_count = 0;
  }
  return pos;
}

std::string JobFingerprint(const std::string& token) {
  if (token.empty()) return "";
  // FNV-1a, 64 bits, over a fixed prefix and the token.
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char ch : "ddp-job:" + token) {
    h ^= static_cast<unsigned char>(ch);
    h *= 0x100000001b3ull;
  }
  return StringPrintf("%016llx", static_cast<unsigned long long>(h));
}

std::string ResumeAfterRestart(TrainConfig& config, int restart) {
  const std::string attempt = "restart " + std::to_string(restart) + " of the job: ";
  if (config.resume) return attempt + "resuming from " + config.checkpoint + " as asked";
  if (config.checkpoint.empty()) return attempt + "no checkpoints (--checkpoint=none); starting over";
  if (!std::filesystem::exists(config.checkpoint)) {
    return attempt + "no checkpoint at " + config.checkpoint + " yet; starting over";
  }
  std::string saved_by;
  try {
    const Metadata m = nn::io::SafetensorsFile::Read(config.checkpoint).metadata();
    const auto job = m.find("job");
    if (job != m.end()) saved_by = job->second;
  } catch (const std::exception& e) {
    return attempt + "cannot read " + config.checkpoint + " (" + e.what() + "); starting over";
  }
  if (config.job.empty() || saved_by != config.job) {
    return attempt + "the checkpoint at " + config.checkpoint +
           " is from another run; starting over (it is overwritten at the first save)";
  }
  config.resume = true;
  return attempt + "resuming from this run's checkpoint " + config.checkpoint;
}

}  // namespace ddp::examples::trainer
