#ifndef DDP_NN_IO_SAFETENSORS_H_
#define DDP_NN_IO_SAFETENSORS_H_

// The safetensors format, on a neutral in-memory representation (name,
// dtype, shape, little-endian bytes) that knows nothing of nn::Tensor, so the
// parser can be fuzzed alone. Layout of a file:
//
//   u64 little-endian N | N bytes of JSON header | data region
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets":
// [begin, end]} (byte offsets into the data region) and may hold
// "__metadata__", a map of strings. Files written here pad the header with
// spaces to a multiple of 8 bytes, so the data region starts 8-aligned, as
// the Python `safetensors` package writes them.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace ddp::nn::io {

/// A checkpoint or safetensors file is missing, unreadable, malformed or does
/// not match what was asked; the message names the file and the problem.
/// When a read failed for a reason of the host rather than of the file's
/// bytes (open, stat or read failing with ENOENT, EACCES, EIO, EMFILE...,
/// or no memory for the data: ENOMEM), a std::system_error holding that
/// errno is nested in it: std::rethrow_if_nested(e) throws it, so a caller
/// tells a failing disk from a damaged file without reading the message.
/// A malformed or changed file has nothing nested.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Element types of the format (those of Python's safetensors with whole
/// bytes per element). Files holding any of them parse and list their
/// tensors; nn::Tensor has no counterpart for kBool and below, so loading
/// one as a Tensor is refused (see FromStDtype). Values are stable: append
/// only.
enum class StDtype : int {
  kF32 = 0,
  kF64 = 1,
  kF16 = 2,
  kBF16 = 3,
  kI64 = 4,
  kI32 = 5,
  kU8 = 6,
  kBool = 7,
  kI8 = 8,
  kI16 = 9,
  kU16 = 10,
  kU32 = 11,
  kU64 = 12,
  kF8E4M3 = 13,
  kF8E5M2 = 14,
  kF8E8M0 = 15,
  kC64 = 16,
};

/// The format's name: "F32", "BF16", "I64", ...
const char* StDtypeName(StDtype dtype);
/// Bytes per element.
int64_t StDtypeSize(StDtype dtype);
/// The dtype of a format name, or nullopt for names not handled here.
std::optional<StDtype> StDtypeFromName(std::string_view name);

/// String metadata stored under "__metadata__".
using Metadata = std::map<std::string, std::string>;

/// A tensor to write: the caller keeps `data` alive during the write.
struct TensorView {
  std::string name;
  StDtype dtype = StDtype::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  ///< nbytes little-endian bytes, row-major.
  size_t nbytes = 0;           ///< Must equal product(shape) * StDtypeSize(dtype).
};

/// A tensor of a parsed file: where its bytes are in the data region.
struct TensorEntry {
  std::string name;
  StDtype dtype = StDtype::kF32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  ///< Start in the data region.
  uint64_t nbytes = 0;
};

/// Metadata key of the CRC-32 of the data region (8 lowercase hex digits):
/// added by the writers, checked and removed from metadata() by the reader
/// when present (files from elsewhere may lack it).
inline constexpr char kChecksumKey[] = "ddp.data_crc32";
/// Metadata key of the CRC-32 of the header itself (the JSON text as
/// written, with this value read as "00000000"): added by the writers,
/// checked before the header is parsed and removed from metadata() by the
/// readers when present. Without it a flipped digit in a position or shape
/// would load silently.
inline constexpr char kHeaderChecksumKey[] = "ddp.header_crc32";

/// `name` as error messages quote it: names longer than 200 bytes are cut
/// (at a UTF-8 character boundary) and their length given; control bytes
/// (below 0x20, and 0x7f) are written as `\xNN`.
std::string NameForMessage(std::string_view name);

/// Largest header accepted (100 MB, as the Python implementation).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;
/// Most entries a header's "__metadata__" may hold, the two checksums the
/// writers add included. Each one costs a reader about 100 bytes besides
/// its text (a std::map entry), ten times what a short one takes in the
/// header: without a bound, a hostile header of many short entries made
/// reading it take about a gigabyte.
inline constexpr size_t kMaxMetadataEntries = 65'536;
/// Most dimensions a tensor's shape may have in a header (NumPy allows 64).
/// Each costs a reader 8 bytes for 2 of text ("1,"), more while its vector
/// grows; without a bound one shape of a hostile header took gigabytes.
inline constexpr size_t kMaxShapeDims = 1024;

/// The bytes of a safetensors file holding `tensors` and `metadata` (plus
/// the checksum). The header lists the tensors in the order given; their
/// bytes are laid out by element size, largest first (in the order given
/// within one size), as the reference writer does, so that every tensor
/// starts at a multiple of its element size. Throws std::invalid_argument for a
/// duplicate or reserved name or metadata key,
/// a negative size, a byte count that does not match dtype and shape, a
/// shape of more than kMaxShapeDims dimensions, more than
/// kMaxMetadataEntries - 2 metadata entries (the writers add two), or a
/// header longer than kMaxHeaderBytes: what readers would refuse.
std::string SerializeSafetensors(const std::vector<TensorView>& tensors,
                                 const Metadata& metadata = {});

/// Writes `tensors` and `metadata` to `path` so that a crash never leaves a
/// broken file there: write to a temporary file in the same folder, fsync,
/// rename over `path`, fsync the folder. Throws CheckpointError naming the
/// path and the OS error; the temporary file is removed on failure. Once
/// `*stop` (when given) is true, the write ends at the next piece of
/// kStopCheckBytes with a CheckpointError, leaving `path` as it was. The
/// data checksum is checked against the bytes as they are written: a tensor
/// changed by another thread during the write is refused (CheckpointError
/// naming the path and the tensor), `path` left as it was.
void WriteSafetensorsFile(const std::string& path, const std::vector<TensorView>& tensors,
                          const Metadata& metadata = {}, const std::atomic<bool>* stop = nullptr);

/// A fully validated safetensors file held in memory.
class SafetensorsFile {
 public:
  /// Parses and validates `bytes`: header length, JSON, every entry's dtype,
  /// shape and offsets (in bounds, non-overlapping, covering the data region
  /// exactly, size = elements * dtype size). Throws CheckpointError naming
  /// `source` and the first problem found.
  static SafetensorsFile Parse(std::string bytes, const std::string& source);
  /// Reads and parses a file: the header as ReadBytes checks it, then the
  /// data region alone, read as ReadInto reads it (the same errors, `stop`
  /// as there) into memory the file keeps and its copies share.
  static SafetensorsFile Read(const std::string& path, const std::atomic<bool>* stop = nullptr);
  /// A file's bytes (to hand to Parse here or on another rank). The header
  /// is read and checked first. When it is not valid, only the length field
  /// and the header are returned, without reading the data: Parse refuses
  /// them with the same message as the whole file. When it is valid, the
  /// file's size must be the one it implies, so a file with bytes after its
  /// last tensor is refused without reading them. Throws CheckpointError
  /// naming the path and the OS error or the problem, and where the file's
  /// size or modification time changed during the read (written in place
  /// meanwhile: the bytes may mix two versions). Once `*stop`
  /// (when given) is true, the read ends at the next piece of
  /// kStopCheckBytes with a CheckpointError.
  static std::string ReadBytes(const std::string& path, const std::atomic<bool>* stop = nullptr);
  /// Given a file's validated entries (tensors() in data-region order,
  /// metadata() still holding the checksum keys), where each entry's bytes
  /// are to go: one pointer per entry, to entry.nbytes writable bytes, or
  /// null to read that entry's bytes for the checksum only. The bytes of
  /// two entries must not overlap.
  using Placer = std::function<std::vector<void*>(const SafetensorsFile&)>;
  /// Read without holding the file in memory: the header is read and
  /// checked, and every error is the one Read gives for the same file (the
  /// data checksum still last, after all the data). Then `place` is called
  /// once and each entry's bytes are read (in file order, neighbouring
  /// entries with one preadv) straight to where it says, the data checksum
  /// computed as they come; at most one piece of kStopCheckBytes is held
  /// besides. A file written in place during the read is refused as
  /// ReadBytes refuses it, before the data checksum is compared (so it is
  /// not called corrupt). `stop` as for ReadBytes. The
  /// file returned holds no bytes (Data() gives null). An
  /// exception from `place` ends the read and passes through.
  static SafetensorsFile ReadInto(const std::string& path, const Placer& place,
                                  const std::atomic<bool>* stop = nullptr);
  /// A file's metadata (as metadata() has it) from its header alone: the
  /// tensors and their data are neither read nor checked. Throws
  /// CheckpointError naming the path and the problem, as Read would for
  /// the header.
  static Metadata ReadMetadata(const std::string& path);

  /// Entries in data-region order (see header_order for the order listed).
  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  /// Indices into tensors() in the order the header lists the entries:
  /// the order the writers here were given the tensors (the data region
  /// holds them by element size, see SerializeSafetensors).
  const std::vector<size_t>& header_order() const { return header_order_; }
  const Metadata& metadata() const { return metadata_; }
  /// The entry called `name`, or null.
  const TensorEntry* Find(std::string_view name) const;
  /// Start of an entry's bytes (may be unaligned: copy with memcpy); null
  /// for a file from ReadInto, which holds none.
  const std::byte* Data(const TensorEntry& entry) const;
  /// Name of the file or buffer, for messages.
  const std::string& source() const { return source_; }
  /// The data region's CRC-32 (8 hex digits) as the header gave it and the
  /// data matched; empty for a file written without one. It names the
  /// contents: two ranks holding the same one read the same data.
  const std::string& data_checksum() const { return data_checksum_; }

 private:
  // Validates the header (the `n` bytes after the length field) and the
  // entries against a data region of `data_size` bytes, as Parse does; the
  // checksum keys stay in metadata_.
  static SafetensorsFile ParseLayout(std::string_view header_text, uint64_t data_size,
                                     const std::string& source);
  // The file of a parsed header's `entries` (in the order the header lists
  // them, without a problem) and `metadata`: the entries are put in
  // data-region order and checked to tile a data region of `data_size`
  // bytes, which starts `data_start` bytes into the file.
  static SafetensorsFile Layout(std::vector<TensorEntry> entries, Metadata metadata, uint64_t data_start,
                                uint64_t data_size, const std::string& source);
  // Compares `got` (the data region's CRC-32 in hex) with the header's,
  // when it has one, and takes the checksum keys out of metadata_.
  void CheckDataCrc(const std::string& got);

  std::string source_;
  std::string data_checksum_;
  // The whole file, for one from Parse; its data region starts at
  // data_start_.
  std::string bytes_;
  uint64_t data_start_ = 0;
  // The data region alone, for one from Read (shared by copies; never
  // written once read).
  std::shared_ptr<const std::byte> region_;
  std::vector<TensorEntry> tensors_;
  std::vector<size_t> header_order_;
  Metadata metadata_;
};

namespace internal {

/// Calls `hook` with the file position before each piece's stop check of
/// ReadBytes and ReadInto (so a test can set the stop flag partway through
/// a read). Process-wide; an empty function (the default) turns it off.
/// For tests only.
void SetReadPieceHookForTesting(std::function<void(uint64_t)> hook);

}  // namespace internal

}  // namespace ddp::nn::io

#endif  // DDP_NN_IO_SAFETENSORS_H_
