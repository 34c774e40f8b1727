#include "nn/data/file_bytes.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <utility>

#include "nn/data/dataset.h"

namespace ddp::nn::data::internal {

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string NotAFileNote(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return "";
  const char* what = "not a regular file";
  if (S_ISLNK(st.st_mode)) {
    struct stat target;
    if (::stat(path.c_str(), &target) != 0) {
      what = "a symbolic link to nothing";
    } else if (S_ISDIR(target.st_mode)) {
      what = "a symbolic link to a folder";
    }
  } else if (S_ISDIR(st.st_mode)) {
    what = "a folder";
  }
  return " (" + path + " is " + what + ")";
}

namespace {

// Opens the regular file `path` for reading. O_NONBLOCK lets the open of a
// FIFO (or a device) return at once to be refused, where a plain open waited
// for a writer that may never come; a regular file's reads then block as
// usual (the flag is cleared). Throws DatasetError naming the path.
int OpenForReading(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw DatasetError(path + ": cannot open: " + std::strerror(errno));
  struct stat st;
  std::string problem;
  if (::fstat(fd, &st) != 0) {
    problem = std::string("cannot stat: ") + std::strerror(errno);
  } else if (!S_ISREG(st.st_mode)) {
    problem = "not a regular file";
  } else if (const int flags = ::fcntl(fd, F_GETFL); flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    problem = std::string("cannot set blocking reads: ") + std::strerror(errno);
  }
  if (!problem.empty()) {
    ::close(fd);
    throw DatasetError(path + ": " + problem);
  }
  return fd;
}

}  // namespace

namespace {

int64_t ModifiedNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

std::function<void(const std::string&, uint64_t)>& ReadAtHook() {
  static std::function<void(const std::string&, uint64_t)> hook;
  return hook;
}

}  // namespace

void SetReadAtHookForTesting(std::function<void(const std::string&, uint64_t)> hook) {
  ReadAtHook() = std::move(hook);
}

OpenFile::OpenFile(const std::string& path) : path_(path), fd_(OpenForReading(path)) {
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    throw DatasetError(path + ": cannot stat: " + std::strerror(err));
  }
  size_ = static_cast<uint64_t>(st.st_size);
  modified_ns_ = ModifiedNs(st);
}

void OpenFile::CheckUnchanged() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) throw DatasetError(path_ + ": cannot stat: " + std::strerror(errno));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == size_ && ModifiedNs(st) == modified_ns_) return;
  throw DatasetError(path_ + ": the file was written to while read (" +
                     (size != size_ ? "its size went from " + std::to_string(size_) + " to " + std::to_string(size) +
                                          " bytes"
                                    : std::string("its modification time changed")) +
                     "): what was read may mix two versions of it; load it again once its writer is done");
}

OpenFile::~OpenFile() { ::close(fd_); }

size_t OpenFile::ReadAt(void* dst, size_t n, uint64_t offset) const {
  if (ReadAtHook()) ReadAtHook()(path_, offset);
  size_t got = 0;
  while (got < n) {
    // Pieces of at most 1 GiB: Linux reads at most ~2 GiB in one call.
    const ssize_t r = ::pread(fd_, static_cast<char*>(dst) + got, std::min<size_t>(n - got, size_t{1} << 30),
                              static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      throw DatasetError(path_ + ": cannot read at byte " + std::to_string(offset + got) + ": " +
                         std::strerror(errno));
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

uint64_t OpenFile::DataFrom(uint64_t offset) const {
  // Only the descriptor's position moves, which ReadAt (pread) ignores.
  const off_t at = ::lseek(fd_, static_cast<off_t>(offset), SEEK_DATA);
  if (at >= 0) return std::max(offset, static_cast<uint64_t>(at));
  // ENXIO: no data from `offset` to the end. Anything else (EINVAL where
  // the file system has no SEEK_DATA): unknown, so the bytes are read.
  return errno == ENXIO ? std::max(offset, size_) : offset;
}

bool IsGzip(std::string_view bytes) {
  return bytes.size() >= 2 && static_cast<uint8_t>(bytes[0]) == 0x1f &&
         static_cast<uint8_t>(bytes[1]) == 0x8b;
}

GzipReader::GzipReader(std::string_view bytes, std::string source, uint64_t max_bytes)
    : zs_(std::make_unique<z_stream>()),
      source_(std::move(source)),
      max_bytes_(max_bytes) {
  if (bytes.size() > UINT32_MAX) {
    throw DatasetError(source_ + ": compressed file larger than 4 GiB is not supported");
  }
  Init(bytes.size(), bytes.size() >= 4 ? reinterpret_cast<const uint8_t*>(bytes.data() + bytes.size() - 4) : nullptr);
  zs_->next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  zs_->avail_in = static_cast<uInt>(bytes.size());
}

GzipReader::GzipReader(const OpenFile& file, std::string source, uint64_t max_bytes, size_t input_chunk)
    : zs_(std::make_unique<z_stream>()),
      source_(std::move(source)),
      max_bytes_(max_bytes),
      file_(&file),
      in_(std::max<size_t>(input_chunk, 2), '\0') {  // 2: room to peek at a member's magic
  uint8_t size_field[4] = {};
  const bool has_field = file.size() >= 4 && file.ReadAt(size_field, 4, file.size() - 4) == 4;
  Init(file.size(), has_field ? size_field : nullptr);
  zs_->next_in = reinterpret_cast<Bytef*>(in_.data());
  zs_->avail_in = 0;
}

void GzipReader::Init(uint64_t compressed_bytes, const uint8_t* size_field) {
  std::memset(zs_.get(), 0, sizeof(z_stream));
  // 16 + MAX_WBITS: expect a gzip wrapper (header and CRC-32 trailer).
  if (inflateInit2(zs_.get(), 16 + MAX_WBITS) != Z_OK) {
    zs_.reset();
    throw DatasetError(source_ + ": zlib inflateInit2 failed");
  }
  // The gzip trailer's last four bytes hold the decompressed size modulo
  // 2^32. Reserving it lets the output be written once instead of being
  // copied at every doubling; a corrupt one is capped, and zlib checks it
  // against the data when the member ends.
  if (compressed_bytes >= 18 && size_field != nullptr) {
    const uint8_t* t = size_field;
    const uint64_t hint = uint64_t{t[0]} | (uint64_t{t[1]} << 8) | (uint64_t{t[2]} << 16) |
                          (uint64_t{t[3]} << 24);
    const uint64_t ratio_cap =
        compressed_bytes > UINT64_MAX / 1032 ? UINT64_MAX : uint64_t{1032} * compressed_bytes;
    size_hint_ = std::min<uint64_t>({hint, max_bytes_, ratio_cap});
  }
}

bool GzipReader::Refill() {
  if (file_ == nullptr) return false;
  z_stream& zs = *zs_;
  const size_t kept = zs.avail_in;
  if (kept > 0 && zs.next_in != reinterpret_cast<Bytef*>(in_.data())) std::memmove(in_.data(), zs.next_in, kept);
  const size_t got = file_->ReadAt(in_.data() + kept, in_.size() - kept, file_at_);
  file_at_ += got;
  zs.next_in = reinterpret_cast<Bytef*>(in_.data());
  zs.avail_in = static_cast<uInt>(kept + got);
  return got > 0;
}

uint64_t GzipReader::InputLeft() const {
  const uint64_t unread = file_ != nullptr && file_->size() > file_at_ ? file_->size() - file_at_ : 0;
  return zs_->avail_in + unread;
}

GzipReader::~GzipReader() {
  if (zs_ != nullptr) inflateEnd(zs_.get());
}

size_t GzipReader::Read(void* dst, size_t n) {
  z_stream& zs = *zs_;
  size_t got = 0;
  while (got < n && !ended_) {
    if (zs.avail_in == 0) Refill();
    // One byte past max_bytes is room enough to tell that the output is too long.
    const uint64_t left = max_bytes_ - produced_ + (max_bytes_ < UINT64_MAX ? 1 : 0);
    const size_t room = static_cast<size_t>(std::min<uint64_t>({n - got, left, uint64_t{1} << 30}));
    zs.next_out = static_cast<Bytef*>(dst) + got;
    zs.avail_out = static_cast<uInt>(room);
    const int rc = inflate(&zs, Z_NO_FLUSH);
    const size_t made = room - zs.avail_out;
    got += made;
    produced_ += made;
    if (produced_ > max_bytes_) {
      throw DatasetError(source_ + ": decompresses to more than " + std::to_string(max_bytes_) + " bytes");
    }
    if (rc == Z_STREAM_END) {
      // What follows a member's end is another member (gzip files may be
      // concatenations), zeros padding the file to a block size, or zeros
      // and then another member (padded members concatenated): Python's
      // gzip (so torchvision) skips zeros between members and reads on.
      // Anything else is not gzip data: said so plainly, rather than as a
      // corrupt member header.
      const uint64_t end_at = earlier_members_in_ + zs.total_in;
      // The zeros, across refills of the input, then two bytes to look at
      // where there are more.
      uint64_t zeros = 0;
      uint64_t zeros_read = 0;  // those scanned, not skipped as a hole
      for (;;) {
        const uint8_t* rest = zs.next_in;
        const uint8_t* next = std::find_if(rest, rest + zs.avail_in, [](uint8_t b) { return b != 0; });
        zeros += static_cast<uint64_t>(next - rest);
        zeros_read += static_cast<uint64_t>(next - rest);
        zs.avail_in -= static_cast<uInt>(next - rest);
        zs.next_in = const_cast<Bytef*>(next);
        if (zs.avail_in >= 2) break;
        if (zeros_read > kMaxGzipZeroPaddingRead) {
          throw DatasetError(source_ + ": more than " + std::to_string(kMaxGzipZeroPaddingRead) +
                             " bytes of zeros after the gzip data, which ends at compressed byte " +
                             std::to_string(end_at) + ": far more than any block padding; not read further");
        }
        // Zeros up to the end of the input read so far: a hole in the file
        // from here on is more of them, counted without being read (4 GiB
        // of a file extended by truncate were read and scanned to find the
        // end, seconds spent on nothing).
        if (zs.avail_in == 0 && file_ != nullptr) {
          const uint64_t data = file_->DataFrom(file_at_);
          zeros += data - file_at_;
          file_at_ = data;
        }
        if (!Refill()) break;
      }
      if (zs.avail_in == 0) {
        ended_ = true;
        break;
      }
      if (zs.avail_in < 2 || zs.next_in[0] != 0x1f || zs.next_in[1] != 0x8b) {
        throw DatasetError(source_ + ": " + std::to_string(zeros + InputLeft()) +
                           " bytes after the gzip data, which ends at compressed byte " + std::to_string(end_at) +
                           ", are neither another gzip member nor zero padding");
      }
      // The reset starts total_in again at 0; the zeros skipped count as
      // compressed bytes before the next member.
      earlier_members_in_ = end_at + zeros;
      if (inflateReset(&zs) != Z_OK) throw DatasetError(source_ + ": zlib inflateReset failed");
      continue;
    }
    if (rc == Z_BUF_ERROR && zs.avail_in == 0) {
      throw DatasetError(source_ + ": gzip data is truncated after " +
                         std::to_string(earlier_members_in_ + zs.total_in) +
                         " compressed bytes");
    }
    if (rc != Z_OK && rc != Z_BUF_ERROR) {
      throw DatasetError(source_ + ": corrupt gzip data at compressed byte " +
                         std::to_string(earlier_members_in_ + zs.total_in) +
                         ": " + (zs.msg ? zs.msg : "zlib error " + std::to_string(rc)));
    }
  }
  return got;
}

namespace {

// All the output of `reader`.
std::string ReadToEnd(GzipReader& reader) {
  std::string out;
  // A hint from a forgeable trailer: without the memory for it, the output
  // grows as it comes instead of failing with a bare std::bad_alloc.
  try {
    out.reserve(reader.SizeHint());
  } catch (const std::bad_alloc&) {
  }
  // Grows as data arrives, so a corrupt size never allocates up front.
  constexpr size_t kChunk = size_t{1} << 20;
  while (true) {
    const size_t old = out.size();
    out.resize(old + kChunk);
    const size_t got = reader.Read(out.data() + old, kChunk);
    out.resize(old + got);
    if (got < kChunk) return out;
  }
}

}  // namespace

std::string Gunzip(std::string_view bytes, const std::string& source, uint64_t max_bytes) {
  GzipReader reader(bytes, source, max_bytes);
  return ReadToEnd(reader);
}

std::string ReadMaybeGzipFile(const std::string& path) {
  const OpenFile file(path);
  char magic[2] = {};
  if (file.ReadAt(magic, sizeof(magic), 0) == sizeof(magic) && IsGzip(std::string_view(magic, sizeof(magic)))) {
    // Decompressed as the file is read, a piece at a time: a file that
    // fails early (not gzip data after all, over the bound) is not read on.
    GzipReader reader(file, path);
    return ReadToEnd(reader);
  }
  std::string bytes(static_cast<size_t>(file.size()), '\0');
  const size_t got = file.ReadAt(bytes.data(), bytes.size(), 0);
  if (got != bytes.size()) {
    throw DatasetError(path + ": read " + std::to_string(got) + " of " + std::to_string(bytes.size()) +
                       " bytes: the file got shorter while read");
  }
  file.CheckUnchanged();
  return bytes;
}

}  // namespace ddp::nn::data::internal
