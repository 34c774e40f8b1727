#ifndef DDP_NN_IO_CHECKPOINT_H_
#define DDP_NN_IO_CHECKPOINT_H_

// nn::Tensor on top of the safetensors format, and training checkpoints.
//
// A checkpoint is one safetensors file (one atomic rename, so model and
// optimizer can never come from different saves):
//   model.<name>   the model's state dict (parameters and buffers)
//   optim.<name>   the optimizer's state (and any other trainer state:
//                  scheduler, loss scaler), as named tensors
//   __metadata__   free-form strings (epoch, step, ...) plus
//                  "ddp.checkpoint" = "1"
// Python reads it with safetensors.torch.load_file; stripping "model."
// gives a plain state dict.

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "nn/io/safetensors.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::io {

/// Tensors with their names, in a meaningful order (a state dict).
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

/// Metadata key that marks a file as a checkpoint.
inline constexpr char kCheckpointMarkerKey[] = "ddp.checkpoint";

/// Metadata key under which SaveTensors records the device of every tensor
/// that was not on the CPU (a JSON object: name -> "cuda:N"). Reserved:
/// LoadTensors consumes it; a caller's metadata may not hold it.
inline constexpr char kDevicesKey[] = "ddp.devices";

/// Options of the loaders.
struct LoadOptions {
  /// Device the loaded tensors are placed on (PyTorch's map_location),
  /// unless device_map names the device a tensor was saved from.
  /// CUDA needs a build with --config=cuda; otherwise loading throws
  /// std::invalid_argument naming LoadOptions::device before the file is
  /// read.
  Device device = kCPU;
  /// Saved device -> target device, as device names ("cpu", "cuda",
  /// "cuda:N"): {{"cuda:0", "cuda:1"}} puts what rank 0 saved from its GPU
  /// on this rank's GPU; {{"cuda:0", "cpu"}} loads it on the CPU. A tensor
  /// saved from a device not named here goes to `device`. Files written
  /// without device records (by Python, or from the CPU) count as saved from
  /// "cpu". Every entry is checked before the file is read: a name that does
  /// not parse, or a target without a backend, is an std::invalid_argument
  /// naming the entry.
  std::map<std::string, std::string> device_map;
  /// When set: once `*stop` is true, the file's read ends at its next piece
  /// (kStopCheckBytes) with a CheckpointError (a caller past its deadline).
  const std::atomic<bool>* stop = nullptr;
};

/// Checks `options` as every loader does before it reads anything: each
/// device_map entry parses and its target has a backend and exists, and so
/// does a non-CPU `device`. Throws std::invalid_argument naming the entry
/// or LoadOptions::device. For callers that must refuse options before
/// work of their own (ddp's collective loads, before any rank reads).
void CheckLoadOptions(const LoadOptions& options);

/// The format's dtype of a tensor dtype (every nn::DType has one).
StDtype ToStDtype(DType dtype);
/// The tensor dtype of a format dtype; std::invalid_argument for those
/// nn::Tensor has no counterpart of (BOOL, I8, ..., F8_*, C64).
DType FromStDtype(StDtype dtype);

/// Writes tensors (any device, any strides: copied to contiguous CPU memory
/// as needed) and metadata to `path` atomically; the device of each non-CPU
/// tensor is recorded under kDevicesKey. Throws CheckpointError. `stop`:
/// as for WriteSafetensorsFile.
void SaveTensors(const std::string& path, const NamedTensors& tensors, const Metadata& metadata = {},
                 const std::atomic<bool>* stop = nullptr);

/// A loaded safetensors file.
struct LoadedTensors {
  NamedTensors tensors;  ///< In file order, new tensors on options.device.
  Metadata metadata;
  /// SafetensorsFile::data_checksum of what was read (empty: none in it).
  std::string data_checksum;
};

/// Reads and fully validates `path` (header, entries, then the data
/// checksum) before returning any tensor or moving one to its device; a bad
/// file throws CheckpointError naming it and the problem, as does a tensor
/// of a dtype nn::Tensor lacks (named with its dtype; SafetensorsFile::Read
/// still reads such a file). The file is not held in memory: each tensor's
/// bytes are read straight into it (SafetensorsFile::ReadInto).
LoadedTensors LoadTensors(const std::string& path, const LoadOptions& options = {});
/// The same from a file's bytes already in memory (SafetensorsFile::ReadBytes,
/// perhaps on another rank); errors name `source`.
LoadedTensors LoadTensorsFromBytes(std::string bytes, const std::string& source,
                                   const LoadOptions& options = {});

/// What a training checkpoint holds.
struct Checkpoint {
  NamedTensors model;      ///< State dict, saved under "model.".
  NamedTensors optimizer;  ///< Optimizer (and scheduler, scaler) state, under "optim.".
  Metadata metadata;       ///< Epoch, step and anything else.
  /// Set by loading: the data checksum of the file read (see
  /// SafetensorsFile::data_checksum); ignored by SaveCheckpoint.
  std::string data_checksum;
};

/// Saves a checkpoint atomically (call on one rank only). `stop`: as for
/// WriteSafetensorsFile.
void SaveCheckpoint(const std::string& path, const Checkpoint& checkpoint, const std::atomic<bool>* stop = nullptr);

/// Loads a checkpoint written by SaveCheckpoint. Never touches a model: the
/// caller hands `model` to Module::LoadStateDict, which checks the keys.
Checkpoint LoadCheckpoint(const std::string& path, const LoadOptions& options = {});
/// The same from a checkpoint file's bytes already in memory; errors name
/// `source`.
Checkpoint LoadCheckpointFromBytes(std::string bytes, const std::string& source,
                                   const LoadOptions& options = {});

/// Metadata value of `key` as an integer; throws CheckpointError naming the
/// key (and `source`) when it is missing or not an integer.
int64_t MetadataInt(const Metadata& metadata, const std::string& key, const std::string& source);

}  // namespace ddp::nn::io

#endif  // DDP_NN_IO_CHECKPOINT_H_
