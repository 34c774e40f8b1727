#ifndef DDP_NN_DATA_CIFAR_H_
#define DDP_NN_DATA_CIFAR_H_

// CIFAR-10's binary version: data_batch_1.bin .. data_batch_5.bin and
// test_batch.bin, each a run of 3073-byte records (1 label byte, then 1024
// red, 1024 green and 1024 blue pixel bytes, row-major 32x32).

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "nn/data/dataset.h"
#include "nn/data/idx.h"

namespace ddp::nn::data {

/// Bytes per CIFAR-10 record: one label and a 3x32x32 image.
inline constexpr int64_t kCifarRecordBytes = 1 + 3 * 32 * 32;

/// Appends the records in `bytes` (one batch file's content) to `pixels` and
/// `labels`. Throws DatasetError naming `source` for an empty or truncated
/// file, one that looks like another kind (an HTML page or other text,
/// CIFAR-10's Python version, CIFAR-100's binary version: said so), or a
/// label outside [0, 10).
void ParseCifar10Batch(std::string_view bytes, const std::string& source,
                       std::vector<uint8_t>* pixels, std::vector<uint8_t>* labels);

/// CIFAR-10 from `dir` or `dir/cifar-10-batches-bin` (where the archive
/// unpacks): the five training batches, or the test batch.
std::shared_ptr<InMemoryImageDataset> LoadCifar10(const std::string& dir, Split split);

}  // namespace ddp::nn::data

#endif  // DDP_NN_DATA_CIFAR_H_
