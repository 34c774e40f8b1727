#include "nn/io/checkpoint.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

namespace ddp::nn::io {
namespace {

constexpr char kModelPrefix[] = "model.";
constexpr char kOptimPrefix[] = "optim.";

bool StartsWith(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

// Throws (naming `what`) when `device`'s index is past the devices of its
// type that this process sees.
void CheckDeviceIndex(Device device, const std::string& what) {
  if (device.is_cpu()) return;
  const DeviceBackend& backend = GetDeviceBackend(device);
  if (backend.device_count == nullptr) return;
  const int count = backend.device_count();
  if (device.index >= count) {
    throw std::invalid_argument(what + ": " + device.ToString() + " does not exist; this process sees " +
                                std::to_string(count) + (count == 1 ? " device" : " devices") +
                                " of its type");
  }
}

// The device map's entries parsed and checked, before any file is read.
std::vector<std::pair<Device, Device>> ParseDeviceMap(const std::map<std::string, std::string>& map) {
  std::vector<std::pair<Device, Device>> out;
  for (const auto& [from, to] : map) {
    const std::string entry = "device_map entry \"" + from + "\" -> \"" + to + "\"";
    Device f, t;
    try {
      f = Device::Parse(from);
      t = Device::Parse(to);
    } catch (const std::exception& e) {
      throw std::invalid_argument(entry + ": " + e.what());
    }
    if (!t.is_cpu() && !HasDeviceBackend(t.type)) {
      throw std::invalid_argument(entry + ": no backend for " + t.ToString() +
                                  " in this process (CUDA needs a build with --config=cuda and nn::cuda::Init())");
    }
    CheckDeviceIndex(t, entry);
    for (const auto& [pf, pt] : out) {
      if (pf == f) {
        throw std::invalid_argument(entry + ": " + f.ToString() + " is mapped twice (also to " + pt.ToString() + ")");
      }
    }
    out.emplace_back(f, t);
  }
  return out;
}

// Reads a file's device record (a flat JSON object: tensor name -> device
// name) while it is parsed, keeping only the map it gives: a DOM of the
// record, and the sets of keys watched for repeats before it, took about 20
// times the record's text, which a hostile header may make 100 MB long.
// Stops at the first problem in the text: a syntax error, nesting, a key
// given twice, a value that is no device name, or a tensor the file does
// not hold (so the map holds at most one entry per tensor of the file).
class DeviceRecordReader final : public nlohmann::json_sax<nlohmann::json> {
 public:
  DeviceRecordReader(const std::unordered_set<std::string_view>& held, std::unordered_map<std::string, Device>* out)
      : held_(held), out_(out) {}

  bool null() override { return NotAString(); }
  bool boolean(bool) override { return NotAString(); }
  bool number_integer(number_integer_t) override { return NotAString(); }
  bool number_unsigned(number_unsigned_t) override { return NotAString(); }
  bool number_float(number_float_t, const string_t&) override { return NotAString(); }
  bool binary(binary_t&) override { return NotAString(); }
  bool string(string_t& v) override {
    if (depth_ == 0) return Malformed("not a JSON object");
    if (top_is_array_) return true;
    try {
      out_->emplace(key_, Device::Parse(v));
    } catch (const std::exception& e) {
      return Malformed(e.what());
    }
    return true;
  }
  bool start_object(std::size_t) override {
    // A flat object of strings: depth 1. Refused as soon as it is seen: a
    // value of millions of nested brackets must cost no more than its text.
    return ++depth_ > 1 ? Malformed("JSON nests deeper than 1 level") : true;
  }
  bool start_array(std::size_t) override {
    if (++depth_ > 1) return Malformed("JSON nests deeper than 1 level");
    top_is_array_ = true;  // refused at the end, unless nesting is found first
    return true;
  }
  bool end_object() override {
    --depth_;
    return true;
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool key(string_t& k) override {
    // Keys are unique: a tensor's device given twice, which one holds?
    if (out_->count(k) != 0) return Malformed("key `" + NameForMessage(k) + "` appears twice");
    if (held_.count(k) == 0) {
      not_held_ = k;
      return false;
    }
    key_ = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) override {
    return Malformed(std::string("not valid JSON: ") + e.what());
  }

  // Why the record was refused (the cause may quote the file's text),
  // empty when it was not.
  const std::string& problem() const {
    static const std::string kNotAnObject = "not a JSON object";
    return problem_.empty() && top_is_array_ ? kNotAnObject : problem_;
  }
  // A tensor named that the file does not hold, when that refused it.
  const std::optional<std::string>& not_held() const { return not_held_; }

 private:
  bool NotAString() {
    if (top_is_array_) return true;
    return Malformed(depth_ == 0 ? std::string("not a JSON object")
                                 : "the device of `" + NameForMessage(key_) + "` is not a string");
  }
  bool Malformed(std::string why) {
    problem_ = std::move(why);
    return false;
  }

  const std::unordered_set<std::string_view>& held_;
  std::unordered_map<std::string, Device>* out_;
  int depth_ = 0;
  bool top_is_array_ = false;
  std::string key_;
  std::string problem_;
  std::optional<std::string> not_held_;
};

// The saved device of each tensor named in the file's device record.
std::unordered_map<std::string, Device> SavedDevices(const std::string& path, const SafetensorsFile& file) {
  std::unordered_map<std::string, Device> out;
  auto it = file.metadata().find(kDevicesKey);
  if (it == file.metadata().end()) return out;
  std::unordered_set<std::string_view> held;
  for (const TensorEntry& e : file.tensors()) held.insert(e.name);
  DeviceRecordReader reader(held, &out);
  const std::string& record = it->second;
  if (!nlohmann::json::sax_parse(record.begin(), record.end(), &reader) || !reader.problem().empty()) {
    if (reader.not_held()) {
      throw CheckpointError(path + ": metadata `" + kDevicesKey + "` names tensor `" +
                            NameForMessage(*reader.not_held()) + "`, which the file does not hold");
    }
    throw CheckpointError(path + ": metadata `" + kDevicesKey + "` is malformed: " + NameForMessage(reader.problem()));
  }
  return out;
}

}  // namespace

StDtype ToStDtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return StDtype::kF32;
    case DType::kFloat64: return StDtype::kF64;
    case DType::kFloat16: return StDtype::kF16;
    case DType::kBFloat16: return StDtype::kBF16;
    case DType::kInt64: return StDtype::kI64;
    case DType::kInt32: return StDtype::kI32;
    case DType::kUInt8: return StDtype::kU8;
  }
  throw std::invalid_argument("no safetensors dtype for " + std::string(DTypeName(dtype)));
}

DType FromStDtype(StDtype dtype) {
  switch (dtype) {
    case StDtype::kF32: return DType::kFloat32;
    case StDtype::kF64: return DType::kFloat64;
    case StDtype::kF16: return DType::kFloat16;
    case StDtype::kBF16: return DType::kBFloat16;
    case StDtype::kI64: return DType::kInt64;
    case StDtype::kI32: return DType::kInt32;
    case StDtype::kU8: return DType::kUInt8;
    case StDtype::kBool:
    case StDtype::kI8:
    case StDtype::kI16:
    case StDtype::kU16:
    case StDtype::kU32:
    case StDtype::kU64:
    case StDtype::kF8E4M3:
    case StDtype::kF8E5M2:
    case StDtype::kF8E8M0:
    case StDtype::kC64:
      break;
  }
  throw std::invalid_argument(std::string("safetensors dtype ") + StDtypeName(dtype) +
                              " has no tensor dtype here");
}

void SaveTensors(const std::string& path, const NamedTensors& tensors, const Metadata& metadata,
                 const std::atomic<bool>* stop) {
  if (metadata.count(kDevicesKey)) {
    throw CheckpointError(path + ": metadata key `" + kDevicesKey +
                          "` is reserved (SaveTensors records devices there)");
  }
  std::vector<Tensor> host;  // keeps CPU copies alive during the write
  std::vector<TensorView> views;
  nlohmann::json devices = nlohmann::json::object();
  host.reserve(tensors.size());
  views.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    const std::string which = "tensor `" + NameForMessage(name) + "` (#" + std::to_string(i) + ")";
    if (!t.defined()) throw CheckpointError(path + ": " + which + " is undefined");
    try {
      if (!t.device().is_cpu()) devices[name] = t.device().ToString();
      // Detach: saving reads values and must not trip the autograd checks.
      Tensor c = t.Detach();
      if (!c.device().is_cpu()) c = c.To(kCPU);
      c = c.Contiguous();
      host.push_back(c);
      views.push_back({name, ToStDtype(c.dtype()), c.shape(), c.data_ptr(), c.nbytes()});
    } catch (const std::exception& e) {
      // A failed device copy or allocation, or a dtype the format lacks.
      throw CheckpointError(path + ": " + which + ": cannot take it for saving: " + e.what());
    }
  }
  if (devices.empty()) {
    WriteSafetensorsFile(path, views, metadata, stop);  // CPU-only saves: no record, as before
  } else {
    Metadata with_devices = metadata;
    try {
      with_devices[kDevicesKey] = devices.dump();
    } catch (const nlohmann::json::exception& e) {
      // A name that is not valid UTF-8: say which tensor, by its place, as
      // the name itself would not print.
      std::string which;
      for (size_t i = 0; i < tensors.size() && which.empty(); ++i) {
        try {
          (void)nlohmann::json(tensors[i].first).dump();
        } catch (const nlohmann::json::exception&) {
          which = "tensor #" + std::to_string(i) + "'s name: ";
        }
      }
      throw CheckpointError(path + ": cannot record the tensors' devices in `" + kDevicesKey + "`: " + which +
                            e.what());
    }
    WriteSafetensorsFile(path, views, with_devices, stop);
  }
}

namespace {

// Checks the options before any reading, so that a bad device map fails
// before a large file is read.
std::vector<std::pair<Device, Device>> CheckOptions(const LoadOptions& options) {
  std::vector<std::pair<Device, Device>> map = ParseDeviceMap(options.device_map);
  if (!options.device.is_cpu()) {
    // Fails here, before any work, when the device has no backend or
    // does not exist: the same kind of error as a device_map entry's.
    if (!HasDeviceBackend(options.device.type)) {
      throw std::invalid_argument("LoadOptions::device: no backend for " + options.device.ToString() +
                                  " in this process (CUDA needs a build with --config=cuda and nn::cuda::Init())");
    }
    CheckDeviceIndex(options.device, "LoadOptions::device");
  }
  return map;
}

// Throws, naming the first in the order saved (the header's, the order the
// tensors load in), when a tensor of `file` has a dtype that nn::Tensor
// lacks: no tensor is made for a file that cannot load whole.
void CheckDtypes(const SafetensorsFile& file, const std::string& source) {
  // The file itself is valid, and SafetensorsFile gives the bytes of such a
  // tensor (and of the others) by name.
  for (const size_t i : file.header_order()) {
    const TensorEntry& e = file.tensors()[i];
    try {
      (void)FromStDtype(e.dtype);
    } catch (const std::invalid_argument&) {
      throw CheckpointError(source + ": tensor `" + NameForMessage(e.name) + "` has dtype " +
                            StDtypeName(e.dtype) +
                            ", which nn::Tensor does not have; it cannot be loaded as a tensor "
                            "(SafetensorsFile::Read and Find give its bytes, and the other tensors')");
    }
  }
}

// Where the tensor of entry `e` goes.
Device TargetOf(const TensorEntry& e, const std::unordered_map<std::string, Device>& saved,
                const LoadOptions& options, const std::vector<std::pair<Device, Device>>& map) {
  auto s = saved.find(e.name);
  const Device from = s == saved.end() ? kCPU : s->second;
  Device target = options.device;
  for (const auto& [f, t] : map) {
    if (f == from) target = t;
  }
  return target;
}

// An allocation or device copy that failed.
CheckpointError CannotLoad(const std::string& source, const TensorEntry& e, Device target,
                           const std::exception& x) {
  return CheckpointError(source + ": tensor `" + NameForMessage(e.name) + "` (" + std::to_string(e.nbytes) +
                         " bytes, for " + target.ToString() + "): cannot load it: " + x.what());
}

// Parse validated the whole file before a single tensor is made.
LoadedTensors MakeTensors(const SafetensorsFile& file, const std::string& source,
                          const LoadOptions& options,
                          const std::vector<std::pair<Device, Device>>& map) {
  const std::unordered_map<std::string, Device> saved = SavedDevices(source, file);
  LoadedTensors out;
  out.metadata = file.metadata();
  out.metadata.erase(kDevicesKey);
  out.data_checksum = file.data_checksum();
  CheckDtypes(file, source);
  out.tensors.reserve(file.tensors().size());
  // In the order they were saved in, which the header keeps (the data
  // region holds them by element size).
  for (const size_t i : file.header_order()) {
    const TensorEntry& e = file.tensors()[i];
    const Device target = TargetOf(e, saved, options, map);
    Tensor t;
    try {
      t = Empty(e.shape, {.dtype = FromStDtype(e.dtype)});
      if (e.nbytes > 0) std::memcpy(t.data_ptr(), file.Data(e), e.nbytes);
      if (!target.is_cpu()) t = t.To(target);
    } catch (const std::exception& x) {
      throw CannotLoad(source, e, target, x);
    }
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

Checkpoint SplitCheckpoint(LoadedTensors loaded, const std::string& source) {
  auto marker = loaded.metadata.find(kCheckpointMarkerKey);
  if (marker == loaded.metadata.end()) {
    throw CheckpointError(source + ": not a checkpoint written by SaveCheckpoint (no " +
                          kCheckpointMarkerKey +
                          " metadata); plain safetensors files load with LoadTensors");
  }
  if (marker->second != "1") {
    throw CheckpointError(source + ": checkpoint format version " + NameForMessage(marker->second) +
                          " is not supported (this build reads version 1)");
  }
  loaded.metadata.erase(marker);
  Checkpoint c;
  c.metadata = std::move(loaded.metadata);
  c.data_checksum = std::move(loaded.data_checksum);
  for (auto& [name, t] : loaded.tensors) {
    if (StartsWith(name, kModelPrefix)) {
      c.model.emplace_back(name.substr(std::strlen(kModelPrefix)), std::move(t));
    } else if (StartsWith(name, kOptimPrefix)) {
      c.optimizer.emplace_back(name.substr(std::strlen(kOptimPrefix)), std::move(t));
    } else {
      throw CheckpointError(source + ": tensor `" + NameForMessage(name) +
                            "` belongs to neither the model (model.) nor the optimizer (optim.)");
    }
  }
  return c;
}

}  // namespace

void CheckLoadOptions(const LoadOptions& options) { (void)CheckOptions(options); }

LoadedTensors LoadTensors(const std::string& path, const LoadOptions& options) {
  const std::vector<std::pair<Device, Device>> map = CheckOptions(options);
  // Each tensor is made on the CPU once the header is checked, and the file
  // read straight into it: the file is never held whole beside the tensors.
  // A problem found before the data is read (a bad device record, a dtype
  // nn::Tensor lacks, a failed allocation) is kept and thrown only once the
  // data checksum has passed, so that a file with several problems is
  // refused for the same one as when the whole file was parsed first; such
  // a file's data is read for the checksum only.
  LoadedTensors out;
  std::vector<Device> targets;
  std::vector<size_t> entry_of;  // of each of out.tensors, in tensors()
  std::exception_ptr deferred;
  auto place = [&](const SafetensorsFile& layout) {
    std::vector<void*> where(layout.tensors().size(), nullptr);
    try {
      const std::unordered_map<std::string, Device> saved = SavedDevices(path, layout);
      CheckDtypes(layout, path);
      out.tensors.reserve(layout.tensors().size());
      targets.reserve(layout.tensors().size());
      // In the order they were saved in, which the header keeps (the data
      // region holds them by element size).
      entry_of = layout.header_order();
      for (const size_t i : entry_of) {
        const TensorEntry& e = layout.tensors()[i];
        const Device target = TargetOf(e, saved, options, map);
        Tensor t;
        try {
          t = Empty(e.shape, {.dtype = FromStDtype(e.dtype)});
        } catch (const std::exception& x) {
          throw CannotLoad(path, e, target, x);
        }
        if (e.nbytes > 0) where[i] = t.data_ptr();
        out.tensors.emplace_back(e.name, std::move(t));
        targets.push_back(target);
      }
    } catch (...) {
      deferred = std::current_exception();
      out.tensors.clear();
      out.tensors.shrink_to_fit();
      std::fill(where.begin(), where.end(), nullptr);
    }
    return where;
  };
  const SafetensorsFile file = SafetensorsFile::ReadInto(path, place, options.stop);
  if (deferred) std::rethrow_exception(deferred);
  for (size_t i = 0; i < out.tensors.size(); ++i) {
    if (targets[i].is_cpu()) continue;
    try {
      out.tensors[i].second = out.tensors[i].second.To(targets[i]);
    } catch (const std::exception& x) {
      throw CannotLoad(path, file.tensors()[entry_of[i]], targets[i], x);
    }
  }
  out.metadata = file.metadata();
  out.metadata.erase(kDevicesKey);
  out.data_checksum = file.data_checksum();
  return out;
}

LoadedTensors LoadTensorsFromBytes(std::string bytes, const std::string& source,
                                   const LoadOptions& options) {
  const std::vector<std::pair<Device, Device>> map = CheckOptions(options);
  return MakeTensors(SafetensorsFile::Parse(std::move(bytes), source), source, options, map);
}

void SaveCheckpoint(const std::string& path, const Checkpoint& checkpoint, const std::atomic<bool>* stop) {
  NamedTensors all;
  all.reserve(checkpoint.model.size() + checkpoint.optimizer.size());
  for (const auto& [name, t] : checkpoint.model) all.emplace_back(kModelPrefix + name, t);
  for (const auto& [name, t] : checkpoint.optimizer) all.emplace_back(kOptimPrefix + name, t);
  Metadata metadata = checkpoint.metadata;
  metadata[kCheckpointMarkerKey] = "1";
  SaveTensors(path, all, metadata, stop);
}

Checkpoint LoadCheckpoint(const std::string& path, const LoadOptions& options) {
  return SplitCheckpoint(LoadTensors(path, options), path);
}

Checkpoint LoadCheckpointFromBytes(std::string bytes, const std::string& source,
                                   const LoadOptions& options) {
  return SplitCheckpoint(LoadTensorsFromBytes(std::move(bytes), source, options), source);
}

int64_t MetadataInt(const Metadata& metadata, const std::string& key, const std::string& source) {
  auto it = metadata.find(key);
  if (it == metadata.end()) {
    throw CheckpointError(source + ": metadata has no `" + NameForMessage(key) + "`");
  }
  // An optional '-' and digits only: std::stoll also took leading
  // whitespace and a '+' (" 5" and "+5" read as 5), which no writer here
  // produces, so such a value was edited or corrupted.
  const std::string& text = it->second;
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc() && end == text.data() + text.size()) return v;
  throw CheckpointError(source + ": metadata `" + NameForMessage(key) + "` is \"" + NameForMessage(text) +
                        "\", expected an integer" +
                        (ec == std::errc::result_out_of_range ? " within 64 bits" : ""));
}

}  // namespace ddp::nn::io
