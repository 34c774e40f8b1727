// Fuzzes the IDX reader (MNIST / Fashion-MNIST files, gzip-compressed or not)
// with whole file contents, through ParseIdxFileBytes.
//
// Properties: a rejected file raises DatasetError naming the source; an
// accepted one has at least one dimension and holds exactly product(dims)
// bytes, and parsing it again with its own dimension count gives the same
// array while one more dimension is refused. Decompression is bounded (1 MiB
// here) so gzip bombs are errors: an accepted gzip file's array, with its
// 4-byte magic and 4 bytes per dimension, fits in that bound.

#include <string>

#include "nn/data/dataset.h"
#include "nn/data/idx.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ddp::nn::data;
  constexpr uint64_t kMaxDecompressed = 1 << 20;
  const std::string source = "fuzz-input-idx3-ubyte";
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  IdxArray array;
  try {
    array = ParseIdxFileBytes(bytes, source, 0, kMaxDecompressed);
  } catch (const DatasetError& e) {
    FUZZ_CHECK(std::string(e.what()).find(source) != std::string::npos,
               "the error does not name the file");
    return 0;
  }
  FUZZ_CHECK(!array.dims.empty(), "an accepted file has no dimensions");
  // The product, computed without wrapping: a zero dimension makes it zero
  // whatever the others are; otherwise a product past 2^64 is larger than
  // any data.
  bool zero = false;
  for (int64_t d : array.dims) {
    FUZZ_CHECK(d >= 0, "a negative dimension");
    zero = zero || d == 0;
  }
  uint64_t count = 0;
  if (!zero) {
    count = 1;
    for (int64_t d : array.dims) {
      const uint64_t u = static_cast<uint64_t>(d);
      FUZZ_CHECK(count <= UINT64_MAX / u,
                 "data size differs from the product of dims (which passes 2^64)");
      count *= u;
    }
  }
  FUZZ_CHECK(count == array.data.size(), "data size differs from the product of dims");
  const bool gzip = size >= 2 && data[0] == 0x1f && data[1] == 0x8b;
  FUZZ_CHECK(!gzip || 4 + 4 * array.dims.size() + array.data.size() <= kMaxDecompressed,
             "an accepted gzip file decompressed past the bound");
  const int dims = static_cast<int>(array.dims.size());
  IdxArray again = ParseIdxFileBytes(bytes, source, dims, kMaxDecompressed);
  FUZZ_CHECK(again.dims == array.dims && again.data == array.data,
             "parsing with the expected dimension count changes the result");
  bool refused = false;
  try {
    ParseIdxFileBytes(bytes, source, dims + 1, kMaxDecompressed);
  } catch (const DatasetError&) {
    refused = true;
  }
  FUZZ_CHECK(refused, "a file was accepted with the wrong number of dimensions");
  return 0;
}
