#include "nn/data/idx.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <new>
#include <optional>
#include <utility>

#include "nn/data/decoded_cache.h"
#include "nn/data/file_bytes.h"

namespace ddp::nn::data {
namespace {

constexpr uint8_t kUnsignedByte = 0x08;
// IDX files in the wild have 1 to 4 dimensions; more is a corrupt header.
constexpr int kMaxDims = 8;

std::string Hex(uint8_t b) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "0x%02X", b);
  return buf;
}

const char* TypeName(uint8_t type) {
  switch (type) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return "unknown type";
  }
}

std::string DimsString(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// Returns the first existing file among `dir/base.gz` and `dir/base`, or
// throws the message for a missing dataset.
std::string FindFile(const std::string& dir, const std::string& base,
                     const std::string& missing_hint) {
  const std::string prefix = dir.empty() || dir.back() == '/' ? dir : dir + "/";
  const std::string gz = prefix + base + ".gz";
  const std::string plain = prefix + base;
  if (internal::FileExists(gz)) return gz;
  if (internal::FileExists(plain)) return plain;
  // The folder given is a file (the archive itself, say): the files are
  // not "missing" from it, and installing the package would not help.
  struct stat st;
  if (!dir.empty() && ::stat(dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
    throw DatasetError("dataset folder " + dir + " is " + (S_ISREG(st.st_mode) ? "a file" : "not a folder") +
                       ": " + base + " (or " + base + ".gz) is looked for inside a folder; give the folder that " +
                       "holds it");
  }
  // A folder by the file's name (unpackers make one of `x.gz`, holding the
  // file) is named as such: "not found" alone sent the user looking for a
  // path that is there.
  throw DatasetError("dataset file not found: looked for " + gz + " and " + plain +
                     internal::NotAFileNote(gz) + internal::NotAFileNote(plain) + ". " + missing_hint);
}

std::shared_ptr<InMemoryImageDataset> LoadMnistFormat(const std::string& dataset,
                                                      const std::string& dir, Split split,
                                                      const std::string& missing_hint) {
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  const std::string images = FindFile(dir, prefix + "-images-idx3-ubyte", missing_hint);
  const std::string labels = FindFile(dir, prefix + "-labels-idx1-ubyte", missing_hint);
  const std::string name = dataset + (split == Split::kTrain ? "/train" : "/test");
  return LoadIdxDataset(name, images, labels, 10);
}

}  // namespace

namespace {

// Asks for the whole 2 MiB pages inside [p, p + n) to be backed by huge
// pages when first touched: a 47 MB image set then takes 23 page faults
// instead of 11,500 (each 4 KiB fault cost ~30 us on the 2-core VM). Only
// advice: where transparent huge pages are off, nothing changes.
void AdviseHugePages(void* p, size_t n) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~(kHuge - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

// Bytes read in order, from memory or from a gzip stream: Read fills up to
// n bytes and returns fewer only at the end.
using ReadFn = std::function<size_t(void* dst, size_t n)>;

// Parses an IDX file read through `read`, its data read straight into the
// result. `size_hint` guesses the bytes left to read (what is reserved; a
// wrong guess costs copies, never a large allocation for a forged header);
// when `size_is_exact`, it is the size, and a header asking for more or
// fewer bytes fails before any data is read. So does one asking for more
// than `max_bytes` in all, the bound on a gzip stream's output (which would
// otherwise fail only after decompressing up to the bound). After the data,
// one byte more is read, never the rest. `whole` names what is read in
// errors that give its size: "the file", or "the data" (bytes in memory, or
// decompressed). A dimension count other than `expected_dims` (when > 0)
// is reported as "<what> has N dimensions, expected M<layout>".
IdxArray ParseIdxFrom(const ReadFn& read, uint64_t size_hint, bool size_is_exact,
                      uint64_t max_bytes, const std::string& source, int expected_dims, const char* whole,
                      const char* what = "IDX file", const char* layout = "") {
  uint8_t p[4] = {};
  const size_t magic = read(p, 4);
  if (magic < 4) {
    throw DatasetError(source + ": not an IDX file: " + std::to_string(magic) +
                       " bytes, shorter than the 4-byte magic number");
  }
  if (p[0] != 0 || p[1] != 0) {
    throw DatasetError(source + ": not an IDX file: magic number starts with " + Hex(p[0]) +
                       " " + Hex(p[1]) + ", expected 0x00 0x00");
  }
  if (p[2] != kUnsignedByte) {
    throw DatasetError(source + ": IDX data type " + Hex(p[2]) + " (" + TypeName(p[2]) +
                       ") is not supported, expected 0x08 (unsigned byte)");
  }
  const int ndims = p[3];
  if (ndims < 1 || ndims > kMaxDims) {
    throw DatasetError(source + ": IDX header has " + std::to_string(ndims) +
                       " dimensions, expected 1 to " + std::to_string(kMaxDims));
  }
  if (expected_dims > 0 && ndims != expected_dims) {
    throw DatasetError(source + ": " + what + " has " + std::to_string(ndims) + " dimensions, expected " +
                       std::to_string(expected_dims) + layout);
  }
  const size_t header = 4 + 4 * static_cast<size_t>(ndims);
  uint8_t dims[4 * kMaxDims] = {};
  const size_t got_dims = read(dims, header - 4);
  if (got_dims < header - 4) {
    throw DatasetError(source + ": IDX header truncated: " + std::to_string(ndims) +
                       " dimensions need " + std::to_string(header) + " bytes, " + whole + " has " +
                       std::to_string(4 + got_dims));
  }
  IdxArray out;
  uint64_t count = 1;
  // The product of the non-zero dimensions: a file of no items whose item
  // dimensions overflow is as broken as one with items.
  uint64_t nonzero = 1;
  bool overflow = false;
  for (int d = 0; d < ndims; ++d) {
    const uint8_t* q = dims + 4 * d;
    const uint64_t dim = (uint64_t{q[0]} << 24) | (uint64_t{q[1]} << 16) |
                         (uint64_t{q[2]} << 8) | uint64_t{q[3]};
    out.dims.push_back(static_cast<int64_t>(dim));
    if (dim != 0 && nonzero > (uint64_t{1} << 62) / dim) overflow = true;
    if (dim != 0) nonzero *= dim;
    count *= dim;
  }
  auto truncated = [&](uint64_t have) {
    return DatasetError(source + ": IDX data truncated: dimensions " + DimsString(out.dims) +
                        " need " +
                        (overflow ? std::string("more than 2^62") : std::to_string(count)) +
                        " bytes after the " + std::to_string(header) + "-byte header, found " +
                        std::to_string(have));
  };
  const uint64_t after_header = size_hint > header ? size_hint - header : 0;
  if (size_is_exact && (overflow || count > after_header)) throw truncated(after_header);
  // Bytes past the data are an error found here, before the data is read: a
  // valid header on gigabytes of something else costs no read of them.
  if (size_is_exact && count < after_header) {
    throw DatasetError(source + ": " + std::to_string(after_header - count) +
                       " unexpected bytes after the IDX data: dimensions " + DimsString(out.dims) + " need " +
                       std::to_string(count) + " bytes after the " + std::to_string(header) + "-byte header, " +
                       std::to_string(header + count) + " in all, but " + whole + " has " + std::to_string(size_hint) + " bytes");
  }
  if (overflow || max_bytes < header || count > max_bytes - header) {
    throw DatasetError(source + ": IDX dimensions " + DimsString(out.dims) + " need " +
                       (overflow ? std::string("more than 2^62") : std::to_string(header + count)) +
                       " bytes with the " + std::to_string(header) + "-byte header, more than " +
                       std::to_string(max_bytes) + " bytes (the bound on decompressed data)");
  }
  // The data, in chunks that stay in cache between being zeroed by resize
  // and written by read; reserved up front when the guess allows.
  const uint64_t want = overflow ? UINT64_MAX : count;
  // Only a guess from a gzip trailer and the header, both forgeable: where
  // the memory is not there (an address-space limit), the data grows as it
  // comes instead, and only data that is really there can run out of it.
  // Before, a forged pair of sizes made the load fail with a bare
  // std::bad_alloc naming no file.
  try {
    out.data.reserve(static_cast<size_t>(std::min(want, after_header)));
  } catch (const std::bad_alloc&) {
  }
  AdviseHugePages(out.data.data(), out.data.capacity());
  constexpr size_t kChunk = size_t{1} << 20;
  while (out.data.size() < want) {
    const size_t old = out.data.size();
    const size_t step = static_cast<size_t>(std::min<uint64_t>(kChunk, want - old));
    out.data.resize(old + step);
    const size_t got = read(out.data.data() + old, step);
    out.data.resize(old + got);
    if (got < step) break;
  }
  const uint64_t have = out.data.size();
  if (overflow || count > have) throw truncated(have);
  // One byte past the data tells whether anything follows it, without
  // reading (or decompressing: a gzip bomb behind a valid header) the rest.
  // A gzip stream that has no such byte has ended, its trailer (CRC and
  // size) checked.
  uint8_t next = 0;
  if (read(&next, 1) > 0) {
    // From a gzip stream the cause may as well be a corrupt stream, which
    // gives more bytes than its header says before its CRC, at its end,
    // can tell: a flipped byte in a real label file does so one time in
    // eleven, and was reported as trailing data alone.
    throw DatasetError(source + ": unexpected bytes after the IDX data: dimensions " + DimsString(out.dims) +
                       " need " + std::to_string(count) + " bytes after the " + std::to_string(header) +
                       "-byte header, and the data goes on past them" +
                       (size_is_exact ? ""
                                      : " (or the gzip data is corrupt: its checksum, at the end of the stream, "
                                        "was not reached)"));
  }
  return out;
}

// The bytes of data the IDX file at `path` holds by its header (the
// product of its dimensions), read without the data: the decoded cache
// then leaves its folder alone for a set too small to cache. std::nullopt
// where the header cannot be read; the decode then says what is wrong.
std::optional<uint64_t> IdxDataBytes(const std::string& path) {
  // Only the file's first 64 KiB, read at each load (a load from the cache
  // takes ~15 ms; reading all 26 MB of Fashion-MNIST's compressed images
  // would add to it): a gzip stream gives the header's few bytes from its
  // first deflate block, whose code tables take at most a few hundred. A
  // FIFO is not waited on (O_NONBLOCK), nor read.
  std::string head(size_t{64} << 10, '\0');
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return std::nullopt;
  struct stat st{};
  ssize_t n = -1;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    do {
      n = ::pread(fd, head.data(), head.size(), 0);
    } while (n < 0 && errno == EINTR);
  }
  ::close(fd);
  if (n < 0) return std::nullopt;
  head.resize(static_cast<size_t>(n));
  try {
    uint8_t header[4 + 4 * kMaxDims] = {};
    size_t got = 0;
    if (internal::IsGzip(head)) {
      internal::GzipReader gzip(head, path, sizeof(header));
      got = gzip.Read(header, 4);
      if (got == 4 && header[3] >= 1 && header[3] <= kMaxDims) got += gzip.Read(header + 4, 4 * size_t{header[3]});
    } else {
      got = std::min(head.size(), sizeof(header));
      std::memcpy(header, head.data(), got);
    }
    const int ndims = got >= 4 ? header[3] : 0;
    if (ndims < 1 || ndims > kMaxDims || got < 4 + 4 * static_cast<size_t>(ndims)) return std::nullopt;
    uint64_t count = 1;
    for (int d = 0; d < ndims; ++d) {
      const uint8_t* q = header + 4 + 4 * d;
      const uint64_t dim = (uint64_t{q[0]} << 24) | (uint64_t{q[1]} << 16) | (uint64_t{q[2]} << 8) | uint64_t{q[3]};
      if (dim != 0 && count > (uint64_t{1} << 62) / dim) return std::nullopt;
      count *= dim;
    }
    return count;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

IdxArray ParseIdx(std::string_view bytes, const std::string& source, int expected_dims) {
  size_t at = 0;
  const ReadFn read = [&](void* dst, size_t n) {
    const size_t got = std::min(n, bytes.size() - at);
    if (got > 0) std::memcpy(dst, bytes.data() + at, got);
    at += got;
    return got;
  };
  return ParseIdxFrom(read, bytes.size(), /*size_is_exact=*/true, /*max_bytes=*/UINT64_MAX, source,
                      expected_dims, "the data");
}

IdxArray ParseIdxFileBytes(std::string_view file_bytes, const std::string& source,
                           int expected_dims, uint64_t max_decompressed_bytes) {
  if (internal::IsGzip(file_bytes)) {
    internal::GzipReader gzip(file_bytes, source, max_decompressed_bytes);
    const ReadFn read = [&](void* dst, size_t n) { return gzip.Read(dst, n); };
    return ParseIdxFrom(read, gzip.SizeHint(), /*size_is_exact=*/false, max_decompressed_bytes, source,
                        expected_dims, "the data");
  }
  return ParseIdx(file_bytes, source, expected_dims);
}

namespace {

// ReadIdxFile, with ParseIdxFrom's words for a wrong dimension count.
IdxArray ReadIdxFileAs(const std::string& path, int expected_dims, const char* what, const char* layout) {
  const internal::OpenFile file(path);
  char magic[2] = {};
  if (file.ReadAt(magic, sizeof(magic), 0) == sizeof(magic) &&
      internal::IsGzip(std::string_view(magic, sizeof(magic)))) {
    // The decompressed size is known only by decompressing: the stream is
    // parsed as it inflates (and the file read as the stream needs it), its
    // header checked from its first bytes.
    internal::GzipReader gzip(file, path, internal::kMaxDecompressedBytes);
    const ReadFn read = [&](void* dst, size_t n) { return gzip.Read(dst, n); };
    try {
      return ParseIdxFrom(read, gzip.SizeHint(), /*size_is_exact=*/false, internal::kMaxDecompressedBytes, path,
                          expected_dims, "the data", what, layout);
    } catch (const DatasetError&) {
      // A file written in place meanwhile fails its CRC or its inflate:
      // said as what it is, not as corrupt data.
      file.CheckUnchanged();
      throw;
    }
  }
  // A plain file: its header is checked against its size before the data
  // is read, so that a wrong file of gigabytes fails at once, and then
  // exactly the data is read, straight into the result.
  uint64_t at = 0;
  const ReadFn read = [&](void* dst, size_t n) {
    const size_t got = file.ReadAt(dst, n, at);
    at += got;
    return got;
  };
  IdxArray out = ParseIdxFrom(read, file.size(), /*size_is_exact=*/true, /*max_bytes=*/UINT64_MAX, path,
                              expected_dims, "the file", what, layout);
  // A gzip file's CRC catches most such mixes; a plain file has nothing else.
  file.CheckUnchanged();
  return out;
}

}  // namespace

IdxArray ReadIdxFile(const std::string& path, int expected_dims) {
  return ReadIdxFileAs(path, expected_dims, "IDX file", "");
}

std::shared_ptr<InMemoryImageDataset> LoadIdxDataset(const std::string& name,
                                                     const std::string& images_path,
                                                     const std::string& labels_path,
                                                     int64_t num_classes) {
  // The images through the decoded cache (mapped, shared by every process
  // that loads them); the labels are small.
  const internal::SharedArray images = internal::LoadDecoded(
      images_path,
      [&] {
        IdxArray a = ReadIdxFile(images_path);
        return std::make_pair(std::move(a.dims), std::move(a.data));
      },
      internal::kMinCachedBytes, internal::kEntryLockWait, [&] { return IdxDataBytes(images_path); });
  if (images.dims.size() != 3 && images.dims.size() != 4) {
    throw DatasetError(images_path + ": image file has " + std::to_string(images.dims.size()) +
                       " dimensions " + DimsString(images.dims) +
                       ", expected 3 ([N, H, W]) or 4 ([N, C, H, W])");
  }
  // The rank is checked at the header: an image file given as the labels
  // fails there, before megabytes of it are read or inflated.
  IdxArray labels = ReadIdxFileAs(labels_path, 1, "label file", " ([N])");
  if (labels.dims[0] != images.dims[0]) {
    throw DatasetError(labels_path + " has " + std::to_string(labels.dims[0]) + " labels but " +
                       images_path + " has " + std::to_string(images.dims[0]) +
                       " images; the counts must match");
  }
  ImageShape shape;
  if (images.dims.size() == 3) {
    shape = {1, images.dims[1], images.dims[2]};
  } else {
    shape = {images.dims[1], images.dims[2], images.dims[3]};
  }
  // Each dimension is checked before their product is formed: a cache entry
  // may hold any int64 dimensions (no images of [2^40, 2^40, 2^40] pixels
  // match 0 bytes of data), whose product overflowed and read as empty.
  if (shape.channels == 0 || shape.height == 0 || shape.width == 0) {
    throw DatasetError(images_path + ": image shape " + shape.ToString() + " is empty");
  }
  if (!shape.PixelsFit()) {
    throw DatasetError(images_path + ": image shape " + shape.ToString() + " has more pixels than int64 holds");
  }
  if (images.dims[0] == 0) throw DatasetError(images_path + ": holds no images");
  for (size_t i = 0; i < labels.data.size(); ++i) {
    if (labels.data[i] >= num_classes) {
      // The label file's header is 8 bytes ([N]: magic and one dimension).
      throw DatasetError(labels_path + ": label " + std::to_string(labels.data[i]) +
                         " of sample " + std::to_string(i) + " is out of range [0, " +
                         std::to_string(num_classes) + ") (at byte " + std::to_string(8 + i) +
                         " of the IDX data, decompressed if gzip)");
    }
  }
  return std::make_shared<InMemoryImageDataset>(name, shape, num_classes, images.owner, images.data, images.size,
                                                std::move(labels.data));
}

std::shared_ptr<InMemoryImageDataset> LoadFashionMnist(const std::string& dir, Split split) {
  return LoadMnistFormat(
      "fashion_mnist", dir, split,
      std::string("Fashion-MNIST comes in Debian's package dataset-fashion-mnist "
                  "(apt-get install dataset-fashion-mnist puts it in ") +
          kFashionMnistDebianDir + "); --data_dir can point at another folder holding the files.");
}

std::shared_ptr<InMemoryImageDataset> LoadMnist(const std::string& dir, Split split) {
  return LoadMnistFormat("mnist", dir, split,
                         "Put MNIST's four IDX files (train-images-idx3-ubyte.gz, ...) in a "
                         "folder and point --data_dir at it.");
}

}  // namespace ddp::nn::data
