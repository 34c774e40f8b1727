// Fuzzes the safetensors reader (SafetensorsFile::Parse) with whole files.
//
// Properties: a rejected file raises CheckpointError naming the source (no
// other exception, no crash); an accepted file has entries that fit the data
// region exactly with sizes matching dtype and shape, all readable; writing
// the accepted tensors and metadata again gives a file that parses to the
// same entries, bytes and metadata.

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "nn/io/safetensors.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ddp::nn::io;
  const std::string source = "fuzz-input.safetensors";
  std::optional<SafetensorsFile> file;
  try {
    file.emplace(SafetensorsFile::Parse(std::string(reinterpret_cast<const char*>(data), size),
                                        source));
  } catch (const CheckpointError& e) {
    FUZZ_CHECK(std::string(e.what()).find(source) != std::string::npos,
               "the error does not name the file");
    return 0;
  }

  uint64_t covered = 0;
  std::vector<TensorView> views;
  std::vector<std::string> copies;
  copies.reserve(file->tensors().size());
  for (const TensorEntry& entry : file->tensors()) {
    uint64_t elements = 1;
    for (int64_t d : entry.shape) {
      FUZZ_CHECK(d >= 0, "an accepted shape has a negative dimension");
      FUZZ_CHECK(d == 0 || elements <= UINT64_MAX / static_cast<uint64_t>(d),
                 "an accepted shape overflows");
      elements *= static_cast<uint64_t>(d);
    }
    FUZZ_CHECK(elements <= UINT64_MAX / StDtypeSize(entry.dtype), "element bytes overflow");
    FUZZ_CHECK(elements * StDtypeSize(entry.dtype) == entry.nbytes,
               "an entry's size does not match its dtype and shape");
    FUZZ_CHECK(entry.offset == covered, "entries do not tile the data region in order");
    covered += entry.nbytes;
    FUZZ_CHECK(file->Find(entry.name) == &entry, "Find does not return the entry");
    // Touch every byte: out-of-bounds offsets show up under ASan.
    copies.emplace_back(entry.nbytes, '\0');
    if (entry.nbytes > 0) std::memcpy(copies.back().data(), file->Data(entry), entry.nbytes);
    views.push_back({entry.name, entry.dtype, entry.shape, copies.back().data(),
                     static_cast<size_t>(entry.nbytes)});
  }

  std::string rewritten;
  try {
    rewritten = SerializeSafetensors(views, file->metadata());
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, (std::string("an accepted file cannot be written again: ") + e.what())
                          .c_str());
  }
  std::optional<SafetensorsFile> again;
  try {
    again.emplace(SafetensorsFile::Parse(rewritten, "rewritten"));
  } catch (const CheckpointError& e) {
    FUZZ_CHECK(false, (std::string("a rewritten file does not parse: ") + e.what()).c_str());
  }
  FUZZ_CHECK(again->metadata() == file->metadata(), "metadata changed in a round trip");
  FUZZ_CHECK(again->tensors().size() == file->tensors().size(), "tensor count changed");
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorEntry& e = again->tensors()[i];
    FUZZ_CHECK(e.name == views[i].name && e.dtype == views[i].dtype &&
                   e.shape == views[i].shape && e.nbytes == views[i].nbytes,
               "an entry changed in a round trip");
    FUZZ_CHECK(e.nbytes == 0 || std::memcmp(again->Data(e), views[i].data, e.nbytes) == 0,
               "tensor bytes changed in a round trip");
  }
  return 0;
}
