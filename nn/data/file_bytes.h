#ifndef DDP_NN_DATA_FILE_BYTES_H_
#define DDP_NN_DATA_FILE_BYTES_H_

// File reads for the dataset readers, whole or a piece at a time, with gzip
// detected by its magic bytes so that a reader accepts `x.gz` and `x` alike.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

struct z_stream_s;

namespace ddp::nn::data::internal {

/// Largest decompressed size accepted by default (4 GiB): a bound against
/// gzip bombs, far above any dataset file these readers handle.
inline constexpr uint64_t kMaxDecompressedBytes = uint64_t{4} << 30;

/// True if `path` names an existing regular file.
bool FileExists(const std::string& path);

/// For a message about a file that is not there: what is at `path` instead,
/// as " (<path> is a folder)" or another such note; "" when nothing is.
std::string NotAFileNote(const std::string& path);

/// A regular file open for reading, closed with this object: a FIFO or a
/// device is refused at once (never waited on). Lets a reader check a
/// file's header against its size before reading the rest. Read with pread,
/// never mapped: a mapped source cut short while read (`curl -o` overwriting
/// the set in place while a rank loads it) raised SIGBUS in the decoder and
/// killed the process without a word; a read past the end returns short
/// instead. Throws DatasetError naming `path` and the cause.
class OpenFile {
 public:
  explicit OpenFile(const std::string& path);
  ~OpenFile();
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  /// The file's size in bytes when it was opened.
  uint64_t size() const { return size_; }
  /// Throws DatasetError naming the path where the file's size or
  /// modification time is no longer what it was at the open: written in
  /// place since (a copy over the set while a rank loads it), so that what
  /// was read may mix two versions of it. Called once a reader of a plain
  /// file has read all it needs, and where a gzip stream fails (a write
  /// meanwhile is then named as such, not as corrupt data). Not the change time, which a rename over the name moves
  /// while this file's bytes stay.
  void CheckUnchanged() const;
  /// Reads up to `n` bytes at byte `offset` into `dst`; fewer only at the
  /// end of the file. Throws DatasetError naming the path.
  size_t ReadAt(void* dst, size_t n, uint64_t offset) const;
  /// The first byte at or after `offset` that may hold data: the bytes
  /// between are a hole (read as zeros, stored nowhere); at least size()
  /// where the rest is one, and `offset` itself where the file system
  /// cannot tell.
  uint64_t DataFrom(uint64_t offset) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  int64_t modified_ns_ = 0;
};

/// For tests only: calls `hook` with the path and the offset before each
/// OpenFile::ReadAt, so that a test can write to a file in the middle of
/// its read. Process-wide; an empty function (the default) turns it off.
void SetReadAtHookForTesting(std::function<void(const std::string&, uint64_t)> hook);

/// True if `bytes` starts with the gzip magic (1f 8b).
bool IsGzip(std::string_view bytes);

/// Compressed bytes a GzipReader over a file reads at a time.
inline constexpr size_t kGzipInputChunk = size_t{1} << 20;

/// Most zero bytes a GzipReader reads after a member (64 MiB), far above
/// any block a file is padded to. More is refused, not read to the end: a
/// tail of gigabytes of written zeros (or a file that grows with them while
/// read) took as long to scan as to read, for nothing. Zeros in a hole of
/// the file are skipped unread and do not count.
inline constexpr uint64_t kMaxGzipZeroPaddingRead = uint64_t{64} << 20;

/// Decompresses one or more concatenated gzip members (zeros after a member
/// are padding, skipped as Python's gzip does, up to
/// kMaxGzipZeroPaddingRead of them read; a hole in a file there is skipped
/// unread) as they are read, so
/// that a reader can put the output straight where it belongs. `source`
/// names the data in errors: corrupt or truncated data, and more than
/// `max_bytes` of output.
class GzipReader {
 public:
  /// Over compressed bytes in memory (at most 4 GiB), which must outlive
  /// the reader.
  GzipReader(std::string_view bytes, std::string source, uint64_t max_bytes = kMaxDecompressedBytes);
  /// Over an open file, read `input_chunk` bytes at a time as the output
  /// needs them (so a caller that stops early reads no more of the file);
  /// the file must outlive the reader. A file that ends early (cut short
  /// while read) is truncated gzip data.
  GzipReader(const OpenFile& file, std::string source, uint64_t max_bytes = kMaxDecompressedBytes,
             size_t input_chunk = kGzipInputChunk);
  ~GzipReader();
  GzipReader(const GzipReader&) = delete;
  GzipReader& operator=(const GzipReader&) = delete;

  /// Writes the next up to `n` bytes of output to `dst`; fewer only at the
  /// end of the data. Throws DatasetError.
  size_t Read(void* dst, size_t n);
  /// The output size the last member's trailer states (modulo 2^32), capped
  /// by max_bytes and by deflate's largest ratio (1032:1): a size to reserve,
  /// never trusted.
  uint64_t SizeHint() const { return size_hint_; }

 private:
  std::unique_ptr<z_stream_s> zs_;
  std::string source_;
  uint64_t max_bytes_;
  uint64_t produced_ = 0;
  uint64_t earlier_members_in_ = 0;  // compressed bytes of the members before this one
  uint64_t size_hint_ = 0;
  bool ended_ = false;
  // Reading from a file (else all input was given at construction): the
  // input buffer, and the file offset its next read starts at.
  const OpenFile* file_ = nullptr;
  std::string in_;
  uint64_t file_at_ = 0;

  void Init(uint64_t compressed_bytes, const uint8_t* size_field);
  // Moves the unread input to the buffer's start and reads more after it;
  // false when no more came (always, over bytes in memory).
  bool Refill();
  // Compressed bytes not yet consumed, read or not.
  uint64_t InputLeft() const;
};

/// Decompresses one or more concatenated gzip members. `source` names the
/// data in errors; more than `max_bytes` of output is an error.
std::string Gunzip(std::string_view bytes, const std::string& source,
                   uint64_t max_bytes = kMaxDecompressedBytes);

/// The whole file, decompressed if it is gzip-compressed.
std::string ReadMaybeGzipFile(const std::string& path);

}  // namespace ddp::nn::data::internal

#endif  // DDP_NN_DATA_FILE_BYTES_H_
