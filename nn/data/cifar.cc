#include "nn/data/cifar.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "nn/data/decoded_cache.h"
#include "nn/data/file_bytes.h"

namespace ddp::nn::data {
namespace {

// Bytes per CIFAR-100 binary record: a coarse and a fine label, then the
// same 3x32x32 image as CIFAR-10's.
constexpr int64_t kCifar100RecordBytes = 2 + 3 * 32 * 32;

// How much of a file's start tells what kind of file it is: the label
// bytes of its first ~21 records of either kind.
constexpr size_t kHeadBytes = 64 << 10;

// Whether every record of `record_bytes` that starts in `head` holds label
// bytes below `limits` (one limit per leading label byte), as far as `head`
// shows them.
bool LabelsFit(std::string_view head, int64_t record_bytes, std::initializer_list<int> limits) {
  for (size_t at = 0; at + limits.size() <= head.size(); at += static_cast<size_t>(record_bytes)) {
    size_t i = at;
    for (const int limit : limits) {
      if (static_cast<uint8_t>(head[i++]) >= limit) return false;
    }
  }
  return true;
}

// Whether a file of `file_size` bytes starting with `head` could be
// CIFAR-100's binary version: whole 3074-byte records, each starting with
// a coarse label (< 20) and a fine one (< 100).
bool FitsCifar100(std::string_view head, uint64_t file_size) {
  return file_size % kCifar100RecordBytes == 0 && LabelsFit(head, kCifar100RecordBytes, {20, 100});
}

// Whether `head` (the start of a file whose first byte is no label) reads
// as text: its first KiB holds no control byte but white space (bytes from
// 0x80 are let through, as UTF-8). A text body saved under a batch's name
// is a server's error message ("403 Forbidden", JSON) rather than records;
// binary data holds control bytes every few dozen bytes.
bool LooksLikeText(std::string_view head) {
  for (const char ch : head.substr(0, 1024)) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c < 0x20 && !std::isspace(c)) || c == 0x7f) return false;
  }
  return true;
}

// The first line of `text` (up to 40 bytes, non-ASCII bytes as '?'), for an
// error message.
std::string FirstLine(std::string_view text) {
  std::string out;
  for (const char ch : text.substr(0, 40)) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\n' || c == '\r') break;
    out.push_back(c >= 0x20 && c < 0x7f ? ch : '?');
  }
  return out;
}

std::string HexByte(uint8_t b) {
  static constexpr char kDigits[] = "0123456789ABCDEF";
  return std::string("0x") + kDigits[b >> 4] + kDigits[b & 15];
}

// What a file that is no CIFAR-10 batch looks like instead, as the end of an
// error naming it; "" when it looks like nothing known. `bytes` is the
// file's start (at least kHeadBytes of it, or all), `file_size` its size.
// Asked only of a file that is no whole number of records or whose first
// byte is no label (both true of '<' and of 0x80), so a whole real batch is
// never taken for another kind; a truncated one is not either, as CIFAR-100
// is named only where CIFAR-10's labels do not fit the head.
std::string WhatItLooksLike(std::string_view bytes, uint64_t file_size) {
  const std::string size = std::to_string(file_size) + " bytes";
  // A UTF-8 byte order mark, which some servers put before a page, then
  // white space.
  size_t start = bytes.substr(0, 3) == "\xEF\xBB\xBF" ? 3 : 0;
  while (start < bytes.size() && start < 256 && std::isspace(static_cast<unsigned char>(bytes[start]))) ++start;
  std::string head(bytes.substr(start, 16));
  for (char& c : head) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (bytes[0] == '<' || head.rfind("<!doctype", 0) == 0 || head.rfind("<html", 0) == 0) {
    // A download that got the server's error or login page saved under the
    // batch's name.
    return "looks like an HTML page (" + size +
           "), not a CIFAR-10 batch: most likely a failed download; download CIFAR-10's binary version "
           "(cifar-10-binary.tar.gz) again and unpack it";
  }
  if (static_cast<uint8_t>(bytes[0]) == 0x80) {
    // Pickle protocol 2 and later start with the PROTO opcode, 0x80.
    return "looks like CIFAR-10's Python version (a pickle, " + size +
           "); this loader reads the binary version (cifar-10-binary.tar.gz, which unpacks to "
           "cifar-10-batches-bin/ with data_batch_1.bin .. data_batch_5.bin and test_batch.bin)";
  }
  if (FitsCifar100(bytes, file_size) && !LabelsFit(bytes, kCifarRecordBytes, {10})) {
    return "looks like CIFAR-100's binary version (" + size + " is a whole number of " +
           std::to_string(kCifar100RecordBytes) +
           "-byte records: a coarse and a fine label byte, then the image), which this loader does not "
           "read; it reads CIFAR-10's " + std::to_string(kCifarRecordBytes) + "-byte records";
  }
  if (static_cast<uint8_t>(bytes[0]) >= 10 && LooksLikeText(bytes)) {
    return "looks like a text file (" + size + ", starting \"" + FirstLine(bytes.substr(start)) +
           "\"), not a CIFAR-10 batch: most likely a failed download's error message; download CIFAR-10's "
           "binary version (cifar-10-binary.tar.gz) again and unpack it";
  }
  return "";
}

// Reads `n` bytes at `offset` of `fd` into `dst`; false when fewer came.
bool ReadAt(int fd, void* dst, size_t n, off_t offset) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, static_cast<char*>(dst) + got, n - got, offset + static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    got += static_cast<size_t>(r);
  }
  return true;
}

// The bytes the file at `path` holds once decompressed (its size, when it
// is no gzip file), where they are fewer than `below`; std::nullopt where
// they are not, or cannot be told without decompressing a large file. Only
// a small answer must be sure (LoadDecoded then leaves the cache folder
// alone, and never caches the set): std::nullopt takes the usual path,
// which is right for any size.
std::optional<uint64_t> BytesBelow(const std::string& path, uint64_t below) {
  // O_NONBLOCK: a FIFO is not waited on (nor read: only a regular file is).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return std::nullopt;
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  char magic[2] = {};
  if (size < sizeof(magic) || !ReadAt(fd, magic, sizeof(magic), 0) ||
      !internal::IsGzip(std::string_view(magic, sizeof(magic)))) {
    return size < below ? std::optional<uint64_t>(size) : std::nullopt;
  }
  // A gzip file: the trailer's ISIZE is the last member's size (mod 2^32),
  // so at most the whole output; at least `below` of it settles the answer
  // with 4 bytes read (a real training batch, compressed, takes ~30 MB).
  uint8_t isize[4] = {};
  if (size < sizeof(isize) || !ReadAt(fd, isize, sizeof(isize), static_cast<off_t>(size - sizeof(isize)))) {
    return std::nullopt;
  }
  const uint64_t last_member =
      uint64_t{isize[0]} | (uint64_t{isize[1]} << 8) | (uint64_t{isize[2]} << 16) | (uint64_t{isize[3]} << 24);
  if (last_member >= below) return std::nullopt;
  // ISIZE alone is no upper bound (earlier members, zeros padded after the
  // last), so the file is decompressed, up to `below` bytes of output: only
  // a file short enough to hold less than `below` (deflate's stored blocks
  // add 5 bytes per 64 KiB; 64 KiB more for the header's file name) is read.
  if (size > below + below / 8192 + (uint64_t{64} << 10)) return std::nullopt;
  std::string compressed(size, '\0');
  if (!ReadAt(fd, compressed.data(), compressed.size(), 0)) return std::nullopt;
  try {
    return internal::Gunzip(compressed, path, below - 1).size();
  } catch (const std::exception&) {
    return std::nullopt;  // corrupt, or `below` bytes or more: the decode says which
  }
}

// The bytes LoadCifar10's decode gives for `files` (n x 3073: their
// records, decompressed), where fewer than `below`; std::nullopt where not,
// or where that cannot be told cheaply (BytesBelow).
std::optional<uint64_t> CifarBytesBelow(const std::vector<std::string>& files, uint64_t below) {
  uint64_t total = 0;
  for (const std::string& f : files) {
    const std::optional<uint64_t> bytes = BytesBelow(f, below - total);
    if (!bytes.has_value()) return std::nullopt;
    total += *bytes;
  }
  return total;
}

// Throws DatasetError naming `source` where a batch of `file_size` bytes
// that starts with `head` (at least kHeadBytes of it, or all) cannot be
// one: empty, no whole number of records, or another kind of file. Needs
// no more of the file, so a plain file is checked before it is read.
void CheckBatchStart(std::string_view head, uint64_t file_size, const std::string& source) {
  if (file_size == 0 || head.empty()) {
    throw DatasetError(source + ": empty file, expected CIFAR-10 records of " +
                       std::to_string(kCifarRecordBytes) + " bytes");
  }
  const uint64_t rem = file_size % kCifarRecordBytes;
  if (const std::string looks =
          rem != 0 || static_cast<uint8_t>(head[0]) >= 10 ? WhatItLooksLike(head, file_size) : "";
      !looks.empty()) {
    throw DatasetError(source + ": " + looks);
  }
  if (rem != 0 && static_cast<uint8_t>(head[0]) >= 10) {
    // Neither whole records nor a label first: no batch cut short.
    throw DatasetError(source + ": not a CIFAR-10 binary batch: its first byte " +
                       HexByte(static_cast<uint8_t>(head[0])) + " is no label (0-9), and " +
                       std::to_string(file_size) + " bytes is not a whole number of " +
                       std::to_string(kCifarRecordBytes) + "-byte records");
  }
  if (rem != 0) {
    // Where CIFAR-100's records fit the head as well as CIFAR-10's labels
    // do (images of tiny values), both are said.
    throw DatasetError(source + ": truncated CIFAR-10 batch: " + std::to_string(file_size) +
                       " bytes is not a whole number of " + std::to_string(kCifarRecordBytes) +
                       "-byte records (the last record has " + std::to_string(rem) + " bytes)" +
                       (FitsCifar100(head, file_size)
                            ? "; or CIFAR-100's binary version, whose " + std::to_string(kCifar100RecordBytes) +
                                  "-byte records it also fits, which this loader does not read"
                            : ""));
  }
}

// Names the label byte's offset too, so that it can be found with a hex
// dump: in the file, or in the decompressed data of a gzip file.
DatasetError LabelError(const std::string& source, uint64_t record, uint8_t label, bool decompressed) {
  return DatasetError(source + ": label " + std::to_string(label) + " of record " + std::to_string(record) +
                      " is out of range [0, 10) (at byte " + std::to_string(record * kCifarRecordBytes) +
                      (decompressed ? " of the decompressed data)" : ")"));
}

// Bytes read in order, from a file or a gzip stream: fills up to n bytes
// and returns fewer only at the end.
using ReadFn = std::function<size_t(void* dst, size_t n)>;

// Records read at a time: ~768 KiB between the file (or the gzip stream)
// and the destinations.
constexpr size_t kRecordsPerRead = 256;

// Appends the records that `read` gives (one batch's content, to its end)
// to `pixels` and `labels`, kRecordsPerRead at a time: the batch is never
// held whole (it was read into a string and then copied, twice its size).
// Checks what ParseCifar10Batch checks and says it as that does. A plain
// file's start was checked by its size (`known_size`, from its open): its
// first bad label fails at once, and an end elsewhere means it got shorter
// while read. A gzip stream's size is known at its end, where its start is
// checked; after a bad label its records are counted, not kept.
void AppendRecords(const ReadFn& read, const std::string& source, std::optional<uint64_t> known_size,
                   std::vector<uint8_t>* pixels, std::vector<uint8_t>* labels) {
  std::vector<uint8_t> buf(kRecordsPerRead * kCifarRecordBytes);
  std::string head;
  uint64_t total = 0;
  std::optional<DatasetError> bad_label;
  for (;;) {
    const size_t got = read(buf.data(), buf.size());
    if (head.size() < kHeadBytes) {
      head.append(reinterpret_cast<const char*>(buf.data()), std::min(got, kHeadBytes - head.size()));
    }
    for (size_t i = 0; i < got / kCifarRecordBytes && !bad_label.has_value(); ++i) {
      const uint8_t* rec = buf.data() + i * kCifarRecordBytes;
      if (rec[0] >= 10) {
        bad_label = LabelError(source, total / kCifarRecordBytes + i, rec[0], !known_size.has_value());
        break;
      }
      labels->push_back(rec[0]);
      pixels->insert(pixels->end(), rec + 1, rec + kCifarRecordBytes);
    }
    total += got;
    if (bad_label.has_value() && known_size.has_value()) throw *bad_label;
    if (got < buf.size()) break;
  }
  if (known_size.has_value() && total != *known_size) {
    throw DatasetError(source + ": read " + std::to_string(total) + " of " + std::to_string(*known_size) +
                       " bytes: the file got shorter while read");
  }
  if (!known_size.has_value()) CheckBatchStart(head, total, source);
  if (bad_label.has_value()) throw *bad_label;
}

// The records of the batch files `files`, pixels then labels (n x 3073
// bytes, the layout the cache keeps), in one array reserved once. Each file
// is opened and a plain one's start checked before any is read (a wrong
// file of gigabytes fails at once, and a set's size is known), then its
// records are read straight to where they belong: a plain set takes its
// size and ~1 MB, where the copies of each batch and of the growing array
// took three times its size at the peak.
std::vector<uint8_t> ReadBatches(const std::vector<std::string>& files) {
  std::vector<std::unique_ptr<internal::OpenFile>> open;
  std::vector<bool> gzip;
  uint64_t expected = 0;  // bytes of records: plain files' sizes, gzip streams' hints
  for (const std::string& f : files) {
    open.push_back(std::make_unique<internal::OpenFile>(f));
    const internal::OpenFile& file = *open.back();
    std::string head(kHeadBytes, '\0');
    head.resize(file.ReadAt(head.data(), head.size(), 0));
    gzip.push_back(internal::IsGzip(head));
    if (gzip.back()) {
      // Its trailer's size, capped (never trusted beyond a reservation).
      expected += internal::GzipReader(file, f, internal::kMaxDecompressedBytes, 2).SizeHint();
    } else {
      CheckBatchStart(head, file.size(), f);
      expected += file.size();
    }
  }
  const uint64_t records = expected / kCifarRecordBytes;
  std::vector<uint8_t> all, labels;
  // Gzip batches' part is a guess from their forgeable trailers: where the
  // memory for it is not there, the arrays grow as records come instead
  // (a forged trailer made the load fail with a bare std::bad_alloc).
  try {
    all.reserve(static_cast<size_t>(records * kCifarRecordBytes));
    labels.reserve(static_cast<size_t>(records));
  } catch (const std::bad_alloc&) {
  }
  for (size_t i = 0; i < files.size(); ++i) {
    const internal::OpenFile& file = *open[i];
    if (gzip[i]) {
      internal::GzipReader reader(file, files[i]);
      try {
        AppendRecords([&](void* dst, size_t n) { return reader.Read(dst, n); }, files[i], std::nullopt, &all,
                      &labels);
      } catch (const DatasetError&) {
        // A batch written in place meanwhile fails its CRC or its inflate:
        // said as what it is, not as corrupt data.
        file.CheckUnchanged();
        throw;
      }
    } else {
      // The size at the open, which the start was checked against.
      uint64_t at = 0;
      const ReadFn read = [&](void* dst, size_t n) {
        const size_t got = file.ReadAt(dst, static_cast<size_t>(std::min<uint64_t>(n, file.size() - at)), at);
        at += got;
        return got;
      };
      AppendRecords(read, files[i], file.size(), &all, &labels);
      // A gzip batch's CRC catches most such mixes; a plain one has nothing else.
      file.CheckUnchanged();
    }
  }
  all.insert(all.end(), labels.begin(), labels.end());
  return all;
}

}  // namespace

void ParseCifar10Batch(std::string_view bytes, const std::string& source,
                       std::vector<uint8_t>* pixels, std::vector<uint8_t>* labels) {
  CheckBatchStart(bytes, bytes.size(), source);
  const int64_t n = bytes.size() / kCifarRecordBytes;
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  for (int64_t i = 0; i < n; ++i) {
    if (p[i * kCifarRecordBytes] >= 10) throw LabelError(source, i, p[i * kCifarRecordBytes], false);
  }
  pixels->reserve(pixels->size() + n * (kCifarRecordBytes - 1));
  labels->reserve(labels->size() + n);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* rec = p + i * kCifarRecordBytes;
    labels->push_back(rec[0]);
    pixels->insert(pixels->end(), rec + 1, rec + kCifarRecordBytes);
  }
}

std::shared_ptr<InMemoryImageDataset> LoadCifar10(const std::string& dir, Split split) {
  const std::string base = dir.empty() || dir.back() == '/' ? dir : dir + "/";
  const std::string first = split == Split::kTrain ? "data_batch_1.bin" : "test_batch.bin";
  std::string folder;
  for (const std::string& candidate : {base, base + "cifar-10-batches-bin/"}) {
    if (internal::FileExists(candidate + first)) {
      folder = candidate;
      break;
    }
  }
  if (folder.empty()) {
    throw DatasetError("CIFAR-10 file not found: looked for " + base + first + " and " + base +
                       "cifar-10-batches-bin/" + first + internal::NotAFileNote(base + first) +
                       internal::NotAFileNote(base + "cifar-10-batches-bin/" + first) +
                       ". Unpack CIFAR-10's binary version there and point --data_dir at it "
                       "(--dataset=synthetic gives CIFAR's shapes for timing without files).");
  }
  std::vector<std::string> files;
  if (split == Split::kTrain) {
    for (int i = 1; i <= 5; ++i) files.push_back(folder + "data_batch_" + std::to_string(i) + ".bin");
  } else {
    files.push_back(folder + "test_batch.bin");
  }
  for (const std::string& f : files) {
    if (!internal::FileExists(f)) {
      throw DatasetError("CIFAR-10 file not found: " + f + internal::NotAFileNote(f) +
                         " (the training set is data_batch_1.bin to data_batch_5.bin in one folder)");
    }
  }
  // Through the decoded cache (mapped, shared by every process that loads
  // the set): the records' pixels, then their labels, as one array of
  // n x 3073 bytes.
  constexpr int64_t kPixels = kCifarRecordBytes - 1;
  // A set that the files' sizes show too small to cache (a test's few
  // records) leaves the cache folder alone.
  const internal::SharedArray all = internal::LoadDecoded(
      files,
      [&] {
        std::vector<uint8_t> all = ReadBatches(files);
        const int64_t n = static_cast<int64_t>(all.size() / kCifarRecordBytes);
        return std::make_pair(std::vector<int64_t>{n, kCifarRecordBytes}, std::move(all));
      },
      internal::kMinCachedBytes, internal::kEntryLockWait,
      [&] { return CifarBytesBelow(files, internal::kMinCachedBytes); });
  const int64_t n = all.dims.size() == 2 ? all.dims[0] : 0;
  if (all.dims.size() != 2 || all.dims[1] != kCifarRecordBytes) {
    throw DatasetError(files.front() + ": decoded CIFAR-10 array has an unexpected shape");
  }
  const uint8_t* labels = all.data + n * kPixels;
  return std::make_shared<InMemoryImageDataset>(
      split == Split::kTrain ? "cifar10/train" : "cifar10/test", ImageShape{3, 32, 32}, 10, all.owner, all.data,
      static_cast<size_t>(n * kPixels), std::vector<uint8_t>(labels, labels + n));
}

}  // namespace ddp::nn::data
