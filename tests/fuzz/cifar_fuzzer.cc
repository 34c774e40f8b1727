// Fuzzes the CIFAR-10 binary batch reader (ParseCifar10Batch).
//
// Properties: a rejected batch raises DatasetError naming the source and
// leaves the output vectors as they were (nothing half-appended); an accepted
// one appends one label in [0, 10) and 3072 pixels per 3073-byte record, in
// file order.

#include <cstring>
#include <string>
#include <vector>

#include "nn/data/cifar.h"
#include "nn/data/dataset.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ddp::nn::data;
  const std::string source = "fuzz-input_batch.bin";
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  // Earlier batches already loaded: the parser appends after them.
  std::vector<uint8_t> pixels(3072, 7);
  std::vector<uint8_t> labels(1, 3);
  try {
    ParseCifar10Batch(bytes, source, &pixels, &labels);
  } catch (const DatasetError& e) {
    FUZZ_CHECK(std::string(e.what()).find(source) != std::string::npos,
               "the error does not name the file");
    FUZZ_CHECK(pixels.size() == 3072 && labels.size() == 1,
               "a rejected batch left records appended");
    return 0;
  }
  const size_t records = size / kCifarRecordBytes;
  FUZZ_CHECK(size % kCifarRecordBytes == 0 && records > 0, "accepted a partial record");
  FUZZ_CHECK(labels.size() == 1 + records && pixels.size() == 3072 * (1 + records),
             "wrong number of labels or pixels appended");
  for (size_t i = 0; i < records; ++i) {
    const uint8_t* record = data + i * kCifarRecordBytes;
    FUZZ_CHECK(labels[1 + i] == record[0] && record[0] < 10, "wrong or out-of-range label");
    FUZZ_CHECK(std::memcmp(&pixels[3072 * (1 + i)], record + 1, 3072) == 0,
               "pixels differ from the record");
  }
  return 0;
}
