#include "nn/data/file_bytes.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>

#include "nn/data/dataset.h"

namespace ddp::nn::data::internal {

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string ReadFileBytes(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) {
    throw DatasetError(path + ": cannot open: " + std::strerror(errno));
  }
  struct stat st;
  if (::fstat(fileno(f.get()), &st) != 0) {
    throw DatasetError(path + ": cannot stat: " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    throw DatasetError(path + ": not a regular file");
  }
  std::string bytes;
  bytes.resize(static_cast<size_t>(st.st_size));
  size_t got = std::fread(bytes.data(), 1, bytes.size(), f.get());
  if (got != bytes.size() || std::ferror(f.get())) {
    throw DatasetError(path + ": read " + std::to_string(got) + " of " +
                       std::to_string(bytes.size()) + " bytes: " + std::strerror(errno));
  }
  return bytes;
}

bool IsGzip(std::string_view bytes) {
  return bytes.size() >= 2 && static_cast<uint8_t>(bytes[0]) == 0x1f &&
         static_cast<uint8_t>(bytes[1]) == 0x8b;
}

std::string Gunzip(std::string_view bytes, const std::string& source, uint64_t max_bytes) {
  z_stream zs;
  std::memset(&zs, 0, sizeof(zs));
  // 16 + MAX_WBITS: expect a gzip wrapper (header and CRC-32 trailer).
  if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) {
    throw DatasetError(source + ": zlib inflateInit2 failed");
  }
  struct Closer {
    z_stream* zs;
    ~Closer() { inflateEnd(zs); }
  } closer{&zs};

  std::string out;
  // The gzip trailer's last four bytes hold the decompressed size modulo
  // 2^32: reserved up front, the output is written once instead of being
  // copied at every doubling (the 47 MB of Fashion-MNIST's training images
  // were copied and faulted into fresh memory some 7 times). It is only a
  // hint: a corrupt one is capped by max_bytes and by deflate's largest
  // ratio (1032:1), and the output still grows as data arrives.
  if (bytes.size() >= 18) {
    const auto* t = reinterpret_cast<const uint8_t*>(bytes.data() + bytes.size() - 4);
    const uint64_t hint = uint64_t{t[0]} | (uint64_t{t[1]} << 8) | (uint64_t{t[2]} << 16) |
                          (uint64_t{t[3]} << 24);
    out.reserve(std::min<uint64_t>({hint, max_bytes, uint64_t{1032} * bytes.size()}));
  }
  // Grow as data arrives, so a corrupt size never allocates up front.
  constexpr size_t kChunk = size_t{1} << 20;
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  zs.avail_in = static_cast<uInt>(bytes.size());
  if (bytes.size() > UINT32_MAX) {
    throw DatasetError(source + ": compressed file larger than 4 GiB is not supported");
  }
  while (true) {
    if (out.size() >= max_bytes) {
      throw DatasetError(source + ": decompresses to more than " + std::to_string(max_bytes) +
                         " bytes");
    }
    const size_t old = out.size();
    const size_t room = std::min<uint64_t>(kChunk, max_bytes - old);
    out.resize(old + room);
    zs.next_out = reinterpret_cast<Bytef*>(out.data() + old);
    zs.avail_out = static_cast<uInt>(room);
    int rc = inflate(&zs, Z_NO_FLUSH);
    out.resize(old + (room - zs.avail_out));
    if (rc == Z_STREAM_END) {
      if (zs.avail_in == 0) break;
      // Another gzip member follows (gzip files may be concatenations).
      if (inflateReset(&zs) != Z_OK) {
        throw DatasetError(source + ": zlib inflateReset failed");
      }
      continue;
    }
    if (rc == Z_BUF_ERROR && zs.avail_in == 0) {
      throw DatasetError(source + ": gzip data is truncated after " +
                         std::to_string(bytes.size()) + " compressed bytes");
    }
    if (rc != Z_OK && rc != Z_BUF_ERROR) {
      throw DatasetError(source + ": corrupt gzip data at compressed byte " +
                         std::to_string(bytes.size() - zs.avail_in) + ": " +
                         (zs.msg ? zs.msg : "zlib error " + std::to_string(rc)));
    }
  }
  return out;
}

std::string ReadMaybeGzipFile(const std::string& path) {
  std::string raw = ReadFileBytes(path);
  if (IsGzip(raw)) return Gunzip(raw, path);
  return raw;
}

}  // namespace ddp::nn::data::internal
