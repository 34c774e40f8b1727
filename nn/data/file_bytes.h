#ifndef DDP_NN_DATA_FILE_BYTES_H_
#define DDP_NN_DATA_FILE_BYTES_H_

// Whole-file reads for the dataset readers, with gzip detected by its magic
// bytes so that a reader accepts `x.gz` and `x` alike.

#include <cstdint>
#include <string>
#include <string_view>

namespace ddp::nn::data::internal {

/// Largest decompressed size accepted by default (4 GiB): a bound against
/// gzip bombs, far above any dataset file these readers handle.
inline constexpr uint64_t kMaxDecompressedBytes = uint64_t{4} << 30;

/// True if `path` names an existing regular file.
bool FileExists(const std::string& path);

/// Reads the whole file. Throws DatasetError naming `path` and the OS error.
std::string ReadFileBytes(const std::string& path);

/// True if `bytes` starts with the gzip magic (1f 8b).
bool IsGzip(std::string_view bytes);

/// Decompresses one or more concatenated gzip members. `source` names the
/// data in errors; more than `max_bytes` of output is an error.
std::string Gunzip(std::string_view bytes, const std::string& source,
                   uint64_t max_bytes = kMaxDecompressedBytes);

/// ReadFileBytes, then Gunzip if the file is gzip-compressed.
std::string ReadMaybeGzipFile(const std::string& path);

}  // namespace ddp::nn::data::internal

#endif  // DDP_NN_DATA_FILE_BYTES_H_
