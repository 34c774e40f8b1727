// Fuzzes the safetensors reader (SafetensorsFile::Parse) with whole files.
//
// Properties: a rejected file raises CheckpointError naming the source (no
// other exception, no crash); an accepted file has entries, in order, that
// tile the data region (the bytes after the 8-byte length and the header it
// gives) from its first byte to its last, with sizes matching dtype and
// shape, each reading back the input's bytes at its place; the same file
// with one byte more, or (when its data region is not empty) one byte less,
// is refused; writing the accepted tensors and metadata again gives a file
// that parses to the same entries, bytes and metadata.

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

  // Accepted, so the input holds the 8-byte header length and that header.
  FUZZ_CHECK(size >= 8, "an accepted file has no 8-byte header length");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | data[i];
  FUZZ_CHECK(header_bytes <= size - 8, "an accepted file is shorter than its header length says");
  const uint64_t data_start = 8 + header_bytes;
  const uint64_t data_size = size - data_start;

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
    FUZZ_CHECK(entry.nbytes <= data_size && entry.offset <= data_size - entry.nbytes,
               "an entry extends past the data region");
    // Touch every byte: out-of-bounds offsets show up under ASan.
    copies.emplace_back(entry.nbytes, '\0');
    if (entry.nbytes > 0) std::memcpy(copies.back().data(), file->Data(entry), entry.nbytes);
    FUZZ_CHECK(entry.nbytes == 0 ||
                   std::memcmp(copies.back().data(), data + data_start + entry.offset,
                               entry.nbytes) == 0,
               "an entry's bytes are not the input's bytes at its offsets");
    views.push_back({entry.name, entry.dtype, entry.shape, copies.back().data(),
                     static_cast<size_t>(entry.nbytes)});
  }

  FUZZ_CHECK(covered == data_size, "the entries do not end where the data region ends");

  // Bytes after the last tensor belong to none, and a missing last byte
  // leaves the last tensor short: both files must be refused.
  const auto refused = [&](std::string bytes) {
    try {
      SafetensorsFile::Parse(std::move(bytes), source);
    } catch (const CheckpointError&) {
      return true;
    }
    return false;
  };
  const std::string input(reinterpret_cast<const char*>(data), size);
  FUZZ_CHECK(refused(input + '\0'), "a file with a byte after its last tensor is accepted");
  FUZZ_CHECK(data_size == 0 || refused(input.substr(0, size - 1)),
             "a file missing its last data byte is accepted");

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
  // The rewrite lists the entries in the order given (the header keeps it;
  // the data region holds them by element size).
  FUZZ_CHECK(again->header_order().size() == views.size(), "the header order lost entries");
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorEntry& e = again->tensors()[again->header_order()[i]];
    FUZZ_CHECK(e.name == views[i].name && e.dtype == views[i].dtype &&
                   e.shape == views[i].shape && e.nbytes == views[i].nbytes,
               "an entry changed in a round trip");
    FUZZ_CHECK(e.nbytes == 0 || std::memcmp(again->Data(e), views[i].data, e.nbytes) == 0,
               "tensor bytes changed in a round trip");
  }
  return 0;
}
