#ifndef DDP_NN_DATA_IDX_H_
#define DDP_NN_DATA_IDX_H_

// IDX files as MNIST and Fashion-MNIST ship them, gzip-compressed or plain:
// a 4-byte magic (0, 0, type, number of dimensions), each dimension as a
// big-endian u32, then the data. Only unsigned-byte data (type 0x08) is
// accepted: that is what image and label files hold.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "nn/data/dataset.h"

namespace ddp::nn::data {

/// Train or test part of a dataset. Values are stable.
enum class Split : int { kTrain = 0, kTest = 1 };

/// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr char kFashionMnistDebianDir[] = "/usr/share/datasets/fashion-mnist";

/// A parsed IDX array of unsigned bytes.
struct IdxArray {
  std::vector<int64_t> dims;  ///< Sizes, outermost first.
  std::vector<uint8_t> data;  ///< Product(dims) bytes, row-major.
};

/// Parses decompressed IDX bytes. `source` names the data in errors (magic,
/// type, dimension count, truncated or trailing data); `expected_dims`, when
/// > 0, is the required number of dimensions.
IdxArray ParseIdx(std::string_view bytes, const std::string& source, int expected_dims = 0);

/// Parses the bytes of an IDX file as stored: gzip-compressed (detected by
/// its magic) or plain. Decompressed output above `max_decompressed_bytes`
/// is an error. The whole reader without the file system, for fuzzing.
IdxArray ParseIdxFileBytes(std::string_view file_bytes, const std::string& source,
                           int expected_dims = 0,
                           uint64_t max_decompressed_bytes = uint64_t{4} << 30);

/// Reads and parses an IDX file, gzip-compressed or not. A plain file's
/// header is checked against the file's size before its data is read; a
/// gzip file is read as it is decompressed, and stops at the first error.
IdxArray ReadIdxFile(const std::string& path, int expected_dims = 0);

/// Builds a dataset from an image file ([N, H, W], or [N, C, H, W]) and a
/// label file ([N]); checks that the counts agree and labels < num_classes.
std::shared_ptr<InMemoryImageDataset> LoadIdxDataset(const std::string& name,
                                                     const std::string& images_path,
                                                     const std::string& labels_path,
                                                     int64_t num_classes);

/// Fashion-MNIST from `dir` (files named as upstream ships them, with or
/// without .gz). A missing file names the package that provides it.
std::shared_ptr<InMemoryImageDataset> LoadFashionMnist(const std::string& dir, Split split);

/// MNIST from `dir` (same file names and format as Fashion-MNIST).
std::shared_ptr<InMemoryImageDataset> LoadMnist(const std::string& dir, Split split);

}  // namespace ddp::nn::data

#endif  // DDP_NN_DATA_IDX_H_
