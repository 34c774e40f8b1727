#ifndef DDP_NN_DATA_TEST_FILES_H_
#define DDP_NN_DATA_TEST_FILES_H_

// Test helpers: write crafted dataset files into a fresh folder under
// TEST_TMPDIR.

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::nn::data::testing {

/// A new empty folder under TEST_TMPDIR (or /tmp), unique per call.
inline std::string FreshDir(const std::string& tag) {
  static int counter = 0;
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(base ? base : "/tmp") + "/" + tag + "_" +
                    std::to_string(::getpid()) + "_" + std::to_string(counter++);
  if (::mkdir(dir.c_str(), 0755) != 0) throw std::runtime_error("mkdir " + dir);
  return dir;
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

/// gzip-compresses `bytes` (one member).
inline std::string Gzip(const std::string& bytes) {
  z_stream zs{};
  if (deflateInit2(&zs, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    throw std::runtime_error("deflateInit2");
  }
  std::string out(deflateBound(&zs, bytes.size()) + 64, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  zs.avail_in = bytes.size();
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = out.size();
  if (deflate(&zs, Z_FINISH) != Z_STREAM_END) throw std::runtime_error("deflate");
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

/// IDX bytes: magic (0, 0, type, dims.size()), big-endian dims, then data.
inline std::string IdxBytes(const std::vector<uint32_t>& dims, const std::string& data,
                            uint8_t type = 0x08) {
  std::string s;
  s.push_back(0);
  s.push_back(0);
  s.push_back(static_cast<char>(type));
  s.push_back(static_cast<char>(dims.size()));
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>((d >> shift) & 0xff));
  }
  return s + data;
}

/// Writes an IDX file of unsigned bytes at `path`: `dims`, all zeros.
inline void WriteZeroIdx(const std::string& path, const std::vector<uint32_t>& dims) {
  size_t count = 1;
  for (uint32_t d : dims) count *= d;
  WriteFile(path, IdxBytes(dims, std::string(count, '\0')));
}

}  // namespace ddp::nn::data::testing

#endif  // DDP_NN_DATA_TEST_FILES_H_
