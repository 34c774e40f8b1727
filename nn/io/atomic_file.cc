#include "nn/io/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "nn/io/safetensors.h"

namespace ddp::nn::io {
namespace {

std::string Folder(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

[[noreturn]] void Fail(const std::string& path, const std::string& what, int err) {
  throw CheckpointError(path + ": " + what + ": " + std::strerror(err));
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  static std::atomic<uint64_t> counter{0};
  if (path_.empty() || path_.back() == '/') {
    throw CheckpointError("cannot write a file at '" + path_ + "': not a file name");
  }
  temp_path_ = path_ + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) Fail(temp_path_, "cannot create temporary file", errno);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_path_.c_str());
}

void AtomicFileWriter::Write(const void* data, size_t nbytes) {
  if (committed_ || fd_ < 0) throw CheckpointError(path_ + ": write after commit");
  const char* p = static_cast<const char*>(data);
  while (nbytes > 0) {
    const ssize_t n = ::write(fd_, p, nbytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      Fail(temp_path_, "write failed", errno);
    }
    p += n;
    nbytes -= static_cast<size_t>(n);
  }
}

void AtomicFileWriter::Commit() {
  if (committed_ || fd_ < 0) throw CheckpointError(path_ + ": committed twice");
  // The data must be on disk before the rename makes it visible under the
  // final name, or a crash could expose a renamed but empty file.
  if (::fsync(fd_) != 0) Fail(temp_path_, "fsync failed", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) Fail(temp_path_, "close failed", errno);
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    Fail(path_, "cannot rename " + temp_path_ + " to it", errno);
  }
  committed_ = true;
  // The rename itself lives in the folder's entry table.
  const std::string folder = Folder(path_);
  const int dfd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) Fail(folder, "cannot open folder to fsync it", errno);
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  if (rc != 0) Fail(folder, "fsync of folder failed", err);
}

}  // namespace ddp::nn::io
