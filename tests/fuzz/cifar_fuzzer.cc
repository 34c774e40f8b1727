// Fuzzes the CIFAR-10 binary batch reader (ParseCifar10Batch).
//
// Properties: a rejected batch raises DatasetError naming the source and
// leaves the output vectors as they were (same sizes, same contents: nothing
// half-appended or overwritten); an accepted one leaves what they held
// before unchanged and appends one label in [0, 10) and 3072 pixels per
// 3073-byte record, in file order.

#include <algorithm>
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
  const std::vector<uint8_t> earlier_pixels(3072, 7);
  const std::vector<uint8_t> earlier_labels(1, 3);
  std::vector<uint8_t> pixels = earlier_pixels;
  std::vector<uint8_t> labels = earlier_labels;
  try {
    ParseCifar10Batch(bytes, source, &pixels, &labels);
  } catch (const DatasetError& e) {
    FUZZ_CHECK(std::string(e.what()).find(source) != std::string::npos,
               "the error does not name the file");
    FUZZ_CHECK(pixels == earlier_pixels && labels == earlier_labels,
               "a rejected batch changed the output vectors");
    return 0;
  }
  const size_t records = size / kCifarRecordBytes;
  FUZZ_CHECK(size % kCifarRecordBytes == 0 && records > 0, "accepted a partial record");
  FUZZ_CHECK(labels.size() == 1 + records && pixels.size() == 3072 * (1 + records),
             "wrong number of labels or pixels appended");
  FUZZ_CHECK(std::equal(earlier_pixels.begin(), earlier_pixels.end(), pixels.begin()) &&
                 labels[0] == earlier_labels[0],
             "an accepted batch changed the records loaded before it");
  for (size_t i = 0; i < records; ++i) {
    const uint8_t* record = data + i * kCifarRecordBytes;
    FUZZ_CHECK(labels[1 + i] == record[0] && record[0] < 10, "wrong or out-of-range label");
    FUZZ_CHECK(std::memcmp(&pixels[3072 * (1 + i)], record + 1, 3072) == 0,
               "pixels differ from the record");
  }
  return 0;
}
