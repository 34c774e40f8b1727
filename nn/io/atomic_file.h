#ifndef DDP_NN_IO_ATOMIC_FILE_H_
#define DDP_NN_IO_ATOMIC_FILE_H_

// Crash-safe replacement of a file: readers of `path` see the old content or
// the new one, never a mix or a prefix.

#include <cstddef>
#include <string>

namespace ddp::nn::io {

/// Writes a new version of a file beside it and swaps it in on Commit().
/// Destroying the writer without Commit() removes the temporary file and
/// leaves `path` as it was. Errors throw CheckpointError naming the path.
class AtomicFileWriter {
 public:
  /// Creates `<path>.tmp.<pid>.<n>` in the folder of `path`, first removing
  /// such files of processes that no longer exist (killed writers).
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  /// Appends bytes to the temporary file.
  void Write(const void* data, size_t nbytes);
  /// fsync, rename over the target, fsync the folder. Call at most once.
  void Commit();
  /// Path of the temporary file (for tests).
  const std::string& temp_path() const { return temp_path_; }

 private:
  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace ddp::nn::io

#endif  // DDP_NN_IO_ATOMIC_FILE_H_
