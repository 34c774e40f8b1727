#include "nn/io/safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <tuple>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <zlib.h>

#include "nn/io/atomic_file.h"

namespace ddp::nn::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this code copies bytes as they are");

namespace {

// Throws CheckpointError `what` for a read the host failed with errno
// `err` (EIO, EMFILE, ENOMEM: nothing wrong with the file's bytes), with a
// std::system_error holding `err` nested in it (std::rethrow_if_nested), so
// that a caller tells such a failure from a damaged file without reading
// the message.
[[noreturn]] void ThrowHostFailure(const std::string& what, int err) {
  try {
    throw std::system_error(err, std::generic_category());
  } catch (const std::system_error&) {
    std::throw_with_nested(CheckpointError(what));
  }
}

constexpr char kMetadataKey[] = "__metadata__";

// `crc` carried over `n` bytes at `data` (zlib takes at most 4 GiB a call).
uLong CrcUpdate(uLong crc, const void* data, size_t n) {
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {
    const uInt k = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = crc32(crc, p, k);
    p += k;
    n -= k;
  }
  return crc;
}

std::string CrcHex(uLong crc) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08lx", static_cast<unsigned long>(crc & 0xffffffffu));
  return buf;
}

// The CRC-32 of each tensor's bytes, in order.
std::vector<uLong> TensorCrcs(const std::vector<TensorView>& tensors) {
  std::vector<uLong> out;
  out.reserve(tensors.size());
  for (const TensorView& t : tensors) out.push_back(CrcUpdate(crc32(0L, Z_NULL, 0), t.data, t.nbytes));
  return out;
}

// The CRC-32 of the tensors' bytes one after another in the order
// `order` (indices into `tensors`), from theirs.
uLong CombinedCrc(const std::vector<TensorView>& tensors, const std::vector<uLong>& crcs,
                  const std::vector<size_t>& order) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const size_t i : order) {
    crc = crc32_combine(crc, crcs[i], static_cast<z_off_t>(tensors[i].nbytes));
  }
  return crc;
}

// The order of the tensors' bytes in the data region (indices into
// `tensors`): by element size, largest first, and as given within one
// size, as the reference writer lays them out. The region starts 8-aligned
// and every tensor's size is a multiple of its element size, so each
// tensor then starts at a multiple of its element size with no padding
// (given in order, an odd-length BF16 tensor left the F32 one after it
// 2 bytes off alignment).
std::vector<size_t> DataOrder(const std::vector<TensorView>& tensors) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return StDtypeSize(tensors[a].dtype) > StDtypeSize(tensors[b].dtype);
  });
  return order;
}

// The format itself has no checksum, and a flipped bit in a weight would
// otherwise load silently.
std::string Crc32Hex(const std::vector<TensorView>& tensors) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const TensorView& t : tensors) crc = CrcUpdate(crc, t.data, t.nbytes);
  return CrcHex(crc);
}

// The header checksum's entry as the writer puts it in the JSON text; its
// value is computed over the text with the value as kNoHeaderCrc.
constexpr char kNoHeaderCrc[] = "00000000";
std::string HeaderCrcMark() { return std::string("\"") + kHeaderChecksumKey + "\":\""; }

// Where the header checksum's entry begins in `json`, or npos: the first
// place the mark starts a string token, so that the same characters inside
// a user's key or value (`a\"ddp.header_crc32":"`, with the quote escaped)
// are passed over. A string directly followed by ':' is a key.
size_t FindHeaderCrcKey(std::string_view json) {
  const std::string mark = HeaderCrcMark();
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c != '"') continue;
    if (json.substr(i, mark.size()) == mark) return i;
    in_string = true;
  }
  return std::string_view::npos;
}

std::string HeaderCrc32Hex(std::string_view text_with_zero_value) {
  return Crc32Hex({TensorView{"", StDtype::kU8, {static_cast<int64_t>(text_with_zero_value.size())},
                              text_with_zero_value.data(), text_with_zero_value.size()}});
}

struct DtypeInfo {
  StDtype dtype;
  const char* name;
  int64_t size;
};
constexpr DtypeInfo kDtypes[] = {
    {StDtype::kF32, "F32", 4}, {StDtype::kF64, "F64", 8}, {StDtype::kF16, "F16", 2},
    {StDtype::kBF16, "BF16", 2}, {StDtype::kI64, "I64", 8}, {StDtype::kI32, "I32", 4},
    {StDtype::kU8, "U8", 1}, {StDtype::kBool, "BOOL", 1}, {StDtype::kI8, "I8", 1},
    {StDtype::kI16, "I16", 2}, {StDtype::kU16, "U16", 2}, {StDtype::kU32, "U32", 4},
    {StDtype::kU64, "U64", 8}, {StDtype::kF8E4M3, "F8_E4M3", 1}, {StDtype::kF8E5M2, "F8_E5M2", 1},
    {StDtype::kF8E8M0, "F8_E8M0", 1}, {StDtype::kC64, "C64", 8},
};

// The list of accepted names, for the message refusing another.
std::string DtypeNames() {
  std::string out;
  for (const DtypeInfo& d : kDtypes) out += (out.empty() ? "" : ", ") + std::string(d.name);
  return out;
}

// Bytes of a tensor, or nullopt when the count overflows 2^62. An empty
// tensor counts too: its other dimensions multiplied (0 taken as 1) must
// stay within the bound, as a tensor of that shape could not be made.
std::optional<uint64_t> ByteCount(const std::vector<int64_t>& shape, StDtype dtype) {
  uint64_t bound = static_cast<uint64_t>(StDtypeSize(dtype));
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    const uint64_t u = d == 0 ? 1 : static_cast<uint64_t>(d);
    if (bound > (uint64_t{1} << 62) / u) return std::nullopt;
    bound *= u;
    empty = empty || d == 0;
  }
  return empty ? 0 : bound;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// `shape` as messages quote it: a hostile header may give a shape of
// millions of dimensions, so only the first ones are written out (about 200
// bytes) with the count of them all.
std::string ShapeForMessage(const std::vector<int64_t>& shape) {
  constexpr size_t kMax = 200;
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (s.size() > kMax) return s + ", ... (" + std::to_string(shape.size()) + " dimensions)]";
    s += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return s + "]";
}

// The header JSON of `tensors`, listed in the order given, with offsets
// assigned in DataOrder, padded with spaces to a multiple of 8 bytes.
// `crcs` receives each tensor's CRC-32 as the data checksum was computed
// from them, for the writer to check the bytes it writes against, and
// `order` the order in which the data is to be written.
std::string BuildHeader(const std::vector<TensorView>& tensors, const Metadata& metadata,
                        std::vector<uLong>* crcs, std::vector<size_t>* order) {
  for (const char* reserved : {kChecksumKey, kHeaderChecksumKey}) {
    if (metadata.count(reserved)) {
      throw std::invalid_argument(std::string("safetensors: metadata key ") + reserved +
                                  " is reserved");
    }
  }
  // The writers add the two checksums.
  if (metadata.size() > kMaxMetadataEntries - 2) {
    throw std::invalid_argument("safetensors: " + std::to_string(metadata.size()) +
                                " metadata entries, more than the " + std::to_string(kMaxMetadataEntries - 2) +
                                " that readers accept besides the checksums (kMaxMetadataEntries)");
  }
  std::set<std::string_view> names;
  for (const TensorView& t : tensors) {
    if (t.shape.size() > kMaxShapeDims) {
      throw std::invalid_argument("safetensors: tensor `" + NameForMessage(t.name) + "` has " +
                                  std::to_string(t.shape.size()) + " dimensions, more than the " +
                                  std::to_string(kMaxShapeDims) + " that readers accept (kMaxShapeDims)");
    }
    if (t.name == kMetadataKey) {
      throw std::invalid_argument("safetensors: tensor name __metadata__ is reserved");
    }
    if (!names.insert(t.name).second) {
      throw std::invalid_argument("safetensors: tensor name `" + NameForMessage(t.name) + "` appears twice");
    }
    const std::optional<uint64_t> expected = ByteCount(t.shape, t.dtype);
    if (!expected) {
      throw std::invalid_argument("safetensors: tensor `" + NameForMessage(t.name) + "` has invalid shape " +
                                  ShapeString(t.shape));
    }
    if (*expected != t.nbytes) {
      throw std::invalid_argument("safetensors: tensor `" + NameForMessage(t.name) + "` of dtype " +
                                  StDtypeName(t.dtype) + " and shape " + ShapeString(t.shape) +
                                  " needs " + std::to_string(*expected) + " bytes, got " +
                                  std::to_string(t.nbytes));
    }
    if (t.nbytes > 0 && t.data == nullptr) {
      throw std::invalid_argument("safetensors: tensor `" + NameForMessage(t.name) + "` has no data pointer");
    }
  }
  *crcs = TensorCrcs(tensors);
  *order = DataOrder(tensors);
  std::vector<uint64_t> offsets(tensors.size());
  uint64_t offset = 0;
  for (const size_t i : *order) {
    offsets[i] = offset;
    offset += tensors[i].nbytes;
  }
  // The object's text is put together here, key by key, as dump() would
  // write it: an ordered_json finds the place of every key it is given by a
  // linear search, which made a header of N tensors take time N^2 (5.7 s
  // for 40,000). Keys are unique already (checked above, or a std::map's).
  // The metadata object comes first in the file.
  auto quoted = [](const std::string& text) { return nlohmann::json(text).dump(); };
  std::string json;
  try {
    json = "{" + quoted(kMetadataKey) + ":{";
    for (const auto& [k, v] : metadata) json += quoted(k) + ":" + quoted(v) + ",";
    json += quoted(kChecksumKey) + ":" + quoted(CrcHex(CombinedCrc(tensors, *crcs, *order))) + "," +
            quoted(kHeaderChecksumKey) + ":" + quoted(kNoHeaderCrc) + "}";  // filled in below, over the text
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorView& t = tensors[i];
      nlohmann::ordered_json e = nlohmann::ordered_json::object();
      e["dtype"] = StDtypeName(t.dtype);
      e["shape"] = t.shape;
      e["data_offsets"] = {offsets[i], offsets[i] + t.nbytes};
      json += "," + quoted(t.name) + ":" + e.dump();
    }
    json += "}";
  } catch (const nlohmann::json::exception& e) {
    // Invalid UTF-8 in a name or a metadata key or value: say which, by its
    // place, as the text itself would not print.
    auto encodes = [](const std::string& text) {
      try {
        (void)nlohmann::json(text).dump();
        return true;
      } catch (const nlohmann::json::exception&) {
        return false;
      }
    };
    std::string which;
    for (size_t i = 0; i < tensors.size() && which.empty(); ++i) {
      if (!encodes(tensors[i].name)) which = "tensor #" + std::to_string(i) + "'s name: ";
    }
    size_t i = 0;
    for (auto m = metadata.begin(); m != metadata.end() && which.empty(); ++m, ++i) {
      if (!encodes(m->first)) which = "metadata key #" + std::to_string(i) + ": ";
      else if (!encodes(m->second)) which = "metadata value of `" + NameForMessage(m->first) + "`: ";
    }
    throw std::invalid_argument("safetensors: cannot encode header: " + which + e.what());
  }
  json.append((8 - json.size() % 8) % 8, ' ');
  // Checked here, before any file is opened: a longer header would be
  // committed, then refused by our reader and by Python's.
  if (json.size() > kMaxHeaderBytes) {
    throw std::invalid_argument("safetensors: header is " + std::to_string(json.size()) +
                                " bytes, over the limit of " + std::to_string(kMaxHeaderBytes) +
                                " bytes that readers accept (metadata too large?)");
  }
  // The metadata object comes first, and the scan skips the mark's text
  // inside the user's own keys and values.
  const size_t at = FindHeaderCrcKey(json);
  if (at == std::string::npos) throw std::logic_error("safetensors: header checksum entry not written");
  json.replace(at + HeaderCrcMark().size(), 8, HeaderCrc32Hex(json));
  return json;
}

std::string LengthPrefix(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A key that appears twice in one JSON object, with the key of that object
// when it is nested ("" at the top level).
struct DuplicateKey {
  std::string key;
  std::string in;
};

// The JSON parser's message, which quotes the last token read (a string
// token may be megabytes long), cut to a few hundred bytes.
std::string JsonErrorForMessage(const nlohmann::json::exception& e) {
  constexpr size_t kMax = 400;
  const std::string_view what = e.what();
  if (what.size() <= kMax) return std::string(what);
  size_t cut = kMax;
  while (cut > 0 && (static_cast<unsigned char>(what[cut]) & 0xC0) == 0x80) --cut;
  return std::string(what.substr(0, cut)) + "... (" + std::to_string(what.size()) + " bytes)";
}

std::string DuplicateKeyMessage(const DuplicateKey& d) {
  return "key `" + NameForMessage(d.key) + "` appears twice" +
         (d.in.empty() ? std::string() : " in `" + NameForMessage(d.in) + "`");
}

// Calls `bracket(c)` for every '{', '[', '}' and ']' of `json` outside
// strings, in order.
template <typename Fn>
void ForEachBracket(std::string_view json, Fn&& bracket) {
  bool in_string = false, escaped = false;
  for (char c : json) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '{' || c == '[' || c == '}' || c == ']') bracket(c);
  }
}

// Deepest nesting of arrays and objects in `json`, outside strings. A valid
// header nests 3 deep; checking first keeps hostile input from driving the
// JSON parser into deep recursion.
int NestingDepth(std::string_view json) {
  int depth = 0, max_depth = 0;
  ForEachBracket(json, [&](char c) {
    if (c == '{' || c == '[') max_depth = std::max(max_depth, ++depth);
    else --depth;
  });
  return max_depth;
}

// Objects that open at the second level of `json`, outside strings: in a
// header, the entries (and "__metadata__").
size_t SecondLevelObjects(std::string_view json) {
  size_t count = 0;
  int depth = 0;
  ForEachBracket(json, [&](char c) {
    if (c == '{' || c == '[') count += ++depth == 2 && c == '{';
    else --depth;
  });
  return count;
}

class Parser {
 public:
  explicit Parser(const std::string& source) : source_(source) {}

  [[noreturn]] void Fail(const std::string& what) const {
    throw CheckpointError(source_ + ": invalid safetensors file: " + what);
  }

 private:
  const std::string& source_;
};

// What a file that is not a regular one is, for the message refusing it.
std::string FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "of file type " + std::to_string(mode & S_IFMT);
}

}  // namespace

namespace {

// `text` with its control bytes spelled `\xNN`. A JSON header may hold any
// of them escaped (`"w\u0000"` is a valid tensor name): a NUL would end the
// message at what() (the rest, saying what is wrong, unread), and a newline
// or an escape sequence would forge log lines or terminal output.
std::string EscapeControlBytes(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u != 0x7f) {
      out.push_back(c);
      continue;
    }
    char buf[5];
    std::snprintf(buf, sizeof(buf), "\\x%02x", u);
    out += buf;
  }
  return out;
}

// `head`, the first bytes of a text of `total` bytes (at least 201 of them
// when there are more than 200), cut as NameForMessage cuts the text.
std::string CutForMessage(std::string_view head, size_t total) {
  constexpr size_t kMax = 200;
  if (total <= kMax) return EscapeControlBytes(head.substr(0, total));
  size_t cut = kMax;
  // Not inside a UTF-8 sequence: back up over its continuation bytes.
  while (cut > 0 && (static_cast<unsigned char>(head[cut]) & 0xC0) == 0x80) --cut;
  return EscapeControlBytes(head.substr(0, cut)) + "... (" + std::to_string(total) + " bytes)";
}

}  // namespace

std::string NameForMessage(std::string_view name) { return CutForMessage(name, name.size()); }

const char* StDtypeName(StDtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

int64_t StDtypeSize(StDtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 0;
}

std::optional<StDtype> StDtypeFromName(std::string_view name) {
  for (const DtypeInfo& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

// The message refusing a save during which tensor `t` changed.
std::string ChangedDuringSave(const std::string& where, const TensorView& t, uLong before, uLong written) {
  return where + ": tensor `" + NameForMessage(t.name) +
         "` changed while it was being saved (its bytes had CRC-32 " + CrcHex(before) +
         " when the header was made, " + CrcHex(written) +
         " as written): another thread modified it during the save; the file was left as it was";
}

std::string SerializeSafetensors(const std::vector<TensorView>& tensors, const Metadata& metadata) {
  std::vector<uLong> crcs;
  std::vector<size_t> order;
  const std::string header = BuildHeader(tensors, metadata, &crcs, &order);
  std::string out = LengthPrefix(header.size()) + header;
  for (const size_t i : order) {
    const TensorView& t = tensors[i];
    const size_t at = out.size();
    out.append(static_cast<const char*>(t.data), t.nbytes);
    const uLong written = CrcUpdate(crc32(0L, Z_NULL, 0), out.data() + at, t.nbytes);
    if (written != crcs[i]) throw std::invalid_argument(ChangedDuringSave("safetensors", t, crcs[i], written));
  }
  return out;
}

void WriteSafetensorsFile(const std::string& path, const std::vector<TensorView>& tensors,
                          const Metadata& metadata, const std::atomic<bool>* stop) {
  std::string header;
  std::vector<uLong> crcs;
  std::vector<size_t> order;
  try {
    header = BuildHeader(tensors, metadata, &crcs, &order);
  } catch (const std::invalid_argument& e) {
    throw CheckpointError(path + ": " + e.what());
  }
  AtomicFileWriter out(path, stop);
  const std::string prefix = LengthPrefix(header.size());
  out.Write(prefix.data(), prefix.size());
  out.Write(header.data(), header.size());
  // The caller's tensors may still be changing (a save of live CPU
  // tensors while training goes on), and the header's checksum was taken
  // from an earlier look at them. Each piece is copied first, and the copy
  // is both checksummed and written, so that the checksum covers exactly
  // the bytes in the file; a tensor whose bytes differ from the header's
  // checksum aborts the save before the rename.
  size_t largest = 0;
  for (const TensorView& t : tensors) largest = std::max(largest, t.nbytes);
  std::unique_ptr<char[]> piece(new char[std::max<size_t>(1, std::min(largest, kStopCheckBytes))]);
  for (const size_t i : order) {
    const TensorView& t = tensors[i];
    const char* p = static_cast<const char*>(t.data);
    uLong written = crc32(0L, Z_NULL, 0);
    for (size_t left = t.nbytes; left > 0;) {
      const size_t n = std::min(left, kStopCheckBytes);
      std::memcpy(piece.get(), p, n);
      written = CrcUpdate(written, piece.get(), n);
      out.Write(piece.get(), n);
      p += n;
      left -= n;
    }
    if (written != crcs[i]) throw CheckpointError(ChangedDuringSave(path, t, crcs[i], written));
  }
  out.Commit();
}

namespace {

// Why a checksum recorded in __metadata__ may not match other than damage:
// another tool (Python's safetensors with metadata=f.metadata()) rewrote
// the file and carried the ddp.* keys over to bytes they do not describe.
std::string ForeignEditNote() {
  return std::string("it no longer matches the checksum recorded when the file was written; a file "
                     "edited by another tool that kept the metadata (Python's safetensors with "
                     "metadata=f.metadata()) must drop the ") +
         kChecksumKey + " and " + kHeaderChecksumKey + " keys";
}

// A text put together piece by piece, of which only what a message quotes
// is kept (its first 201 bytes) with its length: the JSON text of a value
// that a message names, which a hostile header may make megabytes long.
class CappedText {
 public:
  CappedText() = default;
  explicit CappedText(std::string_view text) { Append(text); }
  void Append(std::string_view piece) {
    total_ += piece.size();
    if (head_.size() < kKeep) head_.append(piece.substr(0, kKeep - head_.size()));
  }
  // What `text` kept is all that this one keeps of it.
  void Append(const CappedText& text) {
    total_ += text.total_;
    if (head_.size() < kKeep) head_.append(std::string_view(text.head_).substr(0, kKeep - head_.size()));
  }
  // The whole text as NameForMessage quotes it.
  std::string ForMessage() const { return CutForMessage(head_, total_); }

 private:
  static constexpr size_t kKeep = 201;
  std::string head_;
  size_t total_ = 0;
};

// `text` (UTF-8, as the JSON parser gives strings) as a JSON string token,
// as nlohmann's dump() writes it, of which CappedText keeps what a message
// quotes: written out a piece of whole characters at a time, so that a
// token of megabytes is not copied and written out whole (twice its size
// again, besides what the parser holds) for 200 bytes of a message.
CappedText JsonStringForMessage(std::string_view text) {
  constexpr size_t kPiece = 4096;
  CappedText out("\"");
  while (!text.empty()) {
    size_t n = std::min(text.size(), kPiece);
    while (n > 0 && n < text.size() && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
    if (n == 0) n = std::min(text.size(), kPiece);  // no UTF-8: dump() names the problem
    const std::string piece = nlohmann::json(std::string(text.substr(0, n))).dump();
    out.Append(std::string_view(piece).substr(1, piece.size() - 2));
    text.remove_prefix(n);
  }
  out.Append("\"");
  return out;
}

// What a header holds, as ParseHeader reads it from its text.
struct ParsedHeader {
  // The tensors' entries in the order the header lists them: all of them
  // when they were asked for and the header has no problem; else none.
  std::vector<TensorEntry> tensors;
  // "__metadata__", the checksum keys included; without meaning when
  // `metadata_problem` is set.
  Metadata metadata;
  // The problem that Parse reports for this header, if any (without the
  // "<source>: invalid safetensors file: " before it): of the top-level
  // keys with a problem (an entry, "__metadata__"), the first in sorted
  // order, as the loop over a nlohmann::json object (a sorted map) that
  // checked them before found it first.
  std::optional<std::string> problem;
  // The problem of "__metadata__" alone (ReadMetadata's): of its keys with
  // a value that is no string, the first in sorted order.
  std::optional<std::string> metadata_problem;
};

// Reads a header's JSON text while the parser goes through it (nlohmann's
// SAX interface), keeping only what a reader wants of it: the entries, the
// metadata, and what a message quotes. The DOM of the whole header that
// this replaces took about 20 times the text's size (a node for every
// value, a map entry for every key; one for each element of a shape), and
// the watcher of repeated keys that ran first as much again (a set of the
// keys of every object): a hostile header of 100 MB, as long as the format
// allows, made a reader take 2 to 3 GB. Here the entries, metadata and
// names are kept, no more (see nn/io/README.md for numbers); a metadata of
// more than kMaxMetadataEntries entries and a shape of more than
// kMaxShapeDims dimensions are refused, as their cost per byte of text is
// the highest.
//
// A key given twice in the top-level object, in "__metadata__", or (dtype,
// shape, data_offsets) in an entry is refused, the first in the text, as
// before, unless a syntax error comes first. Keys that the reader ignores
// (an entry's other keys, keys inside their values or inside a metadata
// value, which is refused anyway) are not checked: which one a parser
// would keep makes no difference, holding them all is what cost the
// memory, and Python's reader (serde) ignores them too.
class HeaderReader final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit HeaderReader(bool want_tensors) : want_tensors_(want_tensors) {}

  // Room for `entries` entries and names, so that the vectors do not grow
  // by doubling (their old and new blocks held at once).
  void Reserve(size_t entries) {
    names_.reserve(entries);
    if (want_tensors_) result_.tensors.reserve(entries);
  }

  bool null() override { return Scalar("null", "null", std::nullopt); }
  bool boolean(bool v) override { return Scalar("boolean", v ? "true" : "false", std::nullopt); }
  // Only a literal with a minus sign arrives here (the others are
  // unsigned), so a 0 was written -0, and is quoted so: "is 0, expected a
  // non-negative integer" said nothing.
  bool number_integer(number_integer_t v) override {
    return Scalar("number", v == 0 ? "-0" : std::to_string(v), std::nullopt);
  }
  bool number_unsigned(number_unsigned_t v) override {
    return Scalar("number", std::to_string(v), static_cast<uint64_t>(v));
  }
  bool number_float(number_float_t v, const string_t&) override {
    return Scalar("number", nlohmann::json(v).dump(), std::nullopt);
  }
  bool string(string_t& v) override {
    if (Top() == Kind::kMetadataObject) {
      if (*meta_key_ == kHeaderChecksumKey) header_crc_value_ = v;
      // Taken from the parser, not copied: a value may be nearly as long as
      // the header (one of 90 MiB took 4 times its size to read, 3.2 now).
      *meta_value_ = std::move(v);
      return true;
    }
    if (Top() == Kind::kEntryObject && field_ == Field::kDtype) {
      entry_.dtype_seen = true;
      entry_.dtype = StDtypeFromName(v);
      if (!entry_.dtype) entry_.dtype_text = JsonStringForMessage(v).ForMessage();
      return true;
    }
    return Scalar("string", JsonStringForMessage(v), std::nullopt);
  }
  bool binary(binary_t&) override { return Scalar("binary", "<binary>", std::nullopt); }

  bool start_object(std::size_t) override { return Open(/*object=*/true); }
  bool start_array(std::size_t) override { return Open(/*object=*/false); }
  bool end_object() override { return Close(/*object=*/true); }
  bool end_array() override { return Close(/*object=*/false); }

  bool key(string_t& k) override {
    switch (Top()) {
      case Kind::kTop:
        top_is_metadata_ = k == kMetadataKey;
        if (top_is_metadata_) {
          if (metadata_seen_) return Twice(k, "");
          metadata_seen_ = true;
        } else {
          // Taken from the parser, not copied, and moved into the entry at
          // the end: a name of 45 MiB took 4.0 times its size to read when
          // names_ held a copy of it, 3.2 now (the header text and the
          // lexer's raw characters hold it besides).
          names_.push_back(std::move(k));
        }
        return true;
      case Kind::kMetadataObject: {
        if (result_.metadata.size() >= kMaxMetadataEntries) {
          stop_ = "__metadata__ has more than " + std::to_string(kMaxMetadataEntries) +
                  " entries, the most a header may hold (kMaxMetadataEntries)";
          return false;
        }
        // The key is taken from the parser, not copied (twice, with
        // meta_key_ a copy): a key of 90 MiB took 5 times its size to read.
        // try_emplace leaves `k` as it was when the map holds it already.
        const auto [it, added] = result_.metadata.try_emplace(std::move(k));
        if (!added) return Twice(k, kMetadataKey);
        meta_key_ = &it->first;
        meta_value_ = &it->second;
        return true;
      }
      case Kind::kEntryObject: {
        field_ = k == "dtype" ? Field::kDtype
                 : k == "shape" ? Field::kShape
                 : k == "data_offsets" ? Field::kOffsets
                                       : Field::kOther;
        if (field_ == Field::kOther) return true;
        const unsigned bit = 1u << static_cast<int>(field_);
        if (entry_.fields_seen & bit) return Twice(k, std::string(EntryName()));
        entry_.fields_seen |= bit;
        return true;
      }
      case Kind::kDumped:
        if (!dump_first_.back()) dump_.Append(",");
        dump_first_.back() = false;
        dump_.Append(JsonStringForMessage(k));
        dump_.Append(":");
        dump_after_key_ = true;
        return true;
      default:
        return true;
    }
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) override {
    syntax_error_ = JsonErrorForMessage(e);
    return false;
  }

  // After the parse (`parsed`: whether it went to the end): the header, or
  // a CheckpointError from `p` for a key given twice, a limit passed or a
  // syntax error, the first of them in the text. `crc_found`: whether the
  // caller found the header checksum entry, and checked the header by
  // `crc_said`.
  ParsedHeader Finish(const Parser& p, bool parsed, bool crc_found, std::string_view crc_said) {
    // A top-level key given twice is found now, over the keys read: its
    // second place comes before wherever the parse stopped.
    if (const std::optional<std::string_view> twice = FirstTopLevelKeyTwice()) {
      p.Fail("header " + DuplicateKeyMessage(DuplicateKey{std::string(*twice), ""}));
    }
    if (duplicate_) p.Fail("header " + DuplicateKeyMessage(*duplicate_));
    if (!stop_.empty()) p.Fail(stop_);
    if (!parsed) p.Fail("header is not valid JSON: " + syntax_error_);
    if (!top_is_object_) p.Fail("header is not a JSON object");
    // The entry checked by the caller must be the one in __metadata__: a
    // header whose metadata holds the key where the scan did not find it
    // (or with another value) went unchecked.
    if (metadata_is_object_ && result_.metadata.count(kHeaderChecksumKey) != 0 &&
        (!crc_found || header_crc_value_ != crc_said)) {
      p.Fail(std::string("__metadata__ holds ") + kHeaderChecksumKey +
             " but not as the header checksum entry the header was checked by");
    }
    if (metadata_problem_) {
      result_.metadata_problem = metadata_problem_->second;
      Problem(kMetadataKey, metadata_problem_->second);
    }
    if (problem_) {
      result_.problem = problem_->second;
    } else if (want_tensors_) {
      if (result_.tensors.size() != names_.size()) {
        throw std::logic_error("safetensors: " + std::to_string(result_.tensors.size()) + " entries read for " +
                               std::to_string(names_.size()) + " names");
      }
      for (size_t i = 0; i < result_.tensors.size(); ++i) result_.tensors[i].name = std::move(names_[i]);
    }
    return std::move(result_);
  }

 private:
  // What the innermost open container is.
  enum class Kind {
    kNone,            // none is open (before the top-level value)
    kTop,             // the header object
    kMetadataObject,  // "__metadata__"
    kEntryObject,     // a tensor's entry
    kShapeArray,      // its "shape"
    kOffsetsArray,    // its "data_offsets"
    kDumped,          // (in) a metadata value that is no string, written out for the message
    kSkipped,         // (in) a value read for nothing: another key's of an entry, one refused
  };
  // Which key of an entry the value that comes next is of.
  enum class Field { kDtype = 0, kShape = 1, kOffsets = 2, kOther = 3 };

  // What is known of the entry being read.
  struct Entry {
    unsigned fields_seen = 0;  // bits 1 << Field
    bool dtype_seen = false;   // as a string
    std::optional<StDtype> dtype;
    std::string dtype_text;    // one not handled, as the message quotes it
    bool shape_seen = false;   // as an array
    bool shape_bad = false;    // an element that is no integer in [0, 2^62]
    size_t rank = 0;
    std::vector<int64_t> shape;  // kept while rank <= kMaxShapeDims
    CappedText shape_text;
    bool offsets_seen = false;  // as an array
    size_t offsets_count = 0;
    std::optional<uint64_t> offsets[2];
    std::string offsets_text[2];  // as the message quotes one that is no offset
  };

  Kind Top() const { return open_.empty() ? Kind::kNone : open_.back(); }

  // The top-level key (but "__metadata__") given twice whose second place
  // is the first in the text, if any.
  std::optional<std::string_view> FirstTopLevelKeyTwice() const {
    const size_t n = names_.size();
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const std::string& x = names_[a];
      const std::string& y = names_[b];
      return x != y ? x < y : a < b;
    });
    size_t first = n;
    for (size_t k = 1; k < n; ++k) {
      if (names_[order[k]] == names_[order[k - 1]]) first = std::min(first, order[k]);
    }
    if (first == n) return std::nullopt;
    return names_[first];
  }

  bool Twice(const std::string& key, const std::string& in) {
    duplicate_ = DuplicateKey{key, in};
    return false;
  }

  // Records `message` as the problem of top-level key `key` (of the keys
  // with one, the first in sorted order is reported); the entries read are
  // no longer wanted.
  void Problem(std::string_view key, std::string message) {
    if (!problem_ || key < problem_->first) problem_.emplace(std::string(key), std::move(message));
    std::vector<TensorEntry>().swap(result_.tensors);
  }

  void MetadataProblem(const std::string& meta_key, std::string message) {
    if (!metadata_problem_ || meta_key < metadata_problem_->first) {
      metadata_problem_.emplace(meta_key, std::move(message));
    }
  }

  // The name of the entry being read.
  std::string_view EntryName() const { return names_.back(); }
  std::string EntryPrefix() const { return "tensor `" + NameForMessage(EntryName()) + "`: "; }

  // A value that is no container: `type` as nlohmann's type_name() names
  // it, `text` as its dump() writes it, `unsigned_value` for an integer
  // that is not negative.
  bool Scalar(const char* type, std::string_view text, std::optional<uint64_t> unsigned_value) {
    return Scalar(type, CappedText(text), unsigned_value);
  }
  bool Scalar(const char* type, const CappedText& text, std::optional<uint64_t> unsigned_value) {
    switch (Top()) {
      case Kind::kNone:
        top_is_object_ = false;
        break;
      case Kind::kTop:
        if (top_is_metadata_) {
          // A null stands for no metadata, as for the reference reader (its
          // metadata is an optional map); writers that put
          // `"__metadata__": null` for none exist.
          if (std::string_view(type) != "null") MetadataProblem("", "__metadata__ is not an object of strings");
        } else {
          Problem(EntryName(), EntryPrefix() + "entry is " + type + ", expected an object");
        }
        break;
      case Kind::kMetadataObject:
        MetadataProblem(*meta_key_, "__metadata__ value for `" + NameForMessage(*meta_key_) + "` is " +
                                        text.ForMessage() + ", expected a string");
        break;
      case Kind::kShapeArray:
        if (entry_.rank > 0) entry_.shape_text.Append(",");
        entry_.shape_text.Append(text);
        ++entry_.rank;
        if (!unsigned_value || *unsigned_value > (uint64_t{1} << 62)) entry_.shape_bad = true;
        if (!entry_.shape_bad && entry_.rank <= kMaxShapeDims) {
          entry_.shape.push_back(static_cast<int64_t>(*unsigned_value));
        }
        break;
      case Kind::kOffsetsArray:
        OffsetElement(unsigned_value, text);
        break;
      case Kind::kDumped:
        DumpValue(text);
        break;
      case Kind::kEntryObject:  // a dtype that is no string is missing at the entry's end
      case Kind::kSkipped:
        break;
    }
    return true;
  }

  void OffsetElement(std::optional<uint64_t> value, const CappedText& text) {
    if (entry_.offsets_count < 2) {
      entry_.offsets[entry_.offsets_count] = value;
      if (!value) entry_.offsets_text[entry_.offsets_count] = text.ForMessage();
    }
    ++entry_.offsets_count;
  }

  // A scalar, or the bracket opening a container, in the metadata value
  // being written out.
  void DumpValue(const CappedText& text) {
    if (!dump_first_.empty()) {
      if (!dump_after_key_ && !dump_first_.back()) dump_.Append(",");
      dump_first_.back() = false;
    }
    dump_after_key_ = false;
    dump_.Append(text);
  }

  bool Open(bool object) {
    Kind kind = Kind::kSkipped;
    switch (Top()) {
      case Kind::kNone:
        if (object) kind = Kind::kTop;
        else top_is_object_ = false;
        break;
      case Kind::kTop:
        if (top_is_metadata_) {
          if (object) {
            kind = Kind::kMetadataObject;
            metadata_is_object_ = true;
          } else {
            MetadataProblem("", "__metadata__ is not an object of strings");
          }
        } else if (object) {
          kind = Kind::kEntryObject;
          entry_ = Entry();
        } else {
          Problem(EntryName(), EntryPrefix() + "entry is array, expected an object");
        }
        break;
      case Kind::kMetadataObject:
        dump_ = CappedText();
        dump_first_.clear();
        [[fallthrough]];
      case Kind::kDumped:
        DumpValue(CappedText(object ? "{" : "["));
        dump_first_.push_back(true);
        kind = Kind::kDumped;
        break;
      case Kind::kEntryObject:
        if (!object && field_ == Field::kShape) {
          kind = Kind::kShapeArray;
          entry_.shape_seen = true;
          entry_.shape_text.Append("[");
        } else if (!object && field_ == Field::kOffsets) {
          kind = Kind::kOffsetsArray;
          entry_.offsets_seen = true;
        }
        break;
      case Kind::kShapeArray:  // nesting deeper than is allowed, refused before
        entry_.shape_bad = true;
        break;
      case Kind::kOffsetsArray:
        OffsetElement(std::nullopt, CappedText(object ? "{...}" : "[...]"));
        break;
      case Kind::kSkipped:
        break;
    }
    open_.push_back(kind);
    return true;
  }

  bool Close(bool object) {
    const Kind kind = Top();
    open_.pop_back();
    switch (kind) {
      case Kind::kEntryObject:
        EndEntry();
        break;
      case Kind::kShapeArray:
        entry_.shape_text.Append("]");
        break;
      case Kind::kDumped:
        dump_first_.pop_back();
        dump_.Append(object ? "}" : "]");
        dump_after_key_ = false;
        if (dump_first_.empty()) {
          MetadataProblem(*meta_key_, "__metadata__ value for `" + NameForMessage(*meta_key_) + "` is " +
                                          dump_.ForMessage() + ", expected a string");
        }
        break;
      default:
        break;
    }
    return true;
  }

  // The checks of an entry, in the order they were made on the DOM.
  void EndEntry() {
    Entry& e = entry_;
    const auto fail = [&](const std::string& what) { Problem(EntryName(), EntryPrefix() + what); };
    if (!e.dtype_seen) return fail("missing dtype string");
    if (!e.dtype) return fail("dtype " + e.dtype_text + " is not supported (" + DtypeNames() + " are)");
    if (!e.shape_seen) return fail("missing shape array");
    if (e.shape_bad) return fail("shape " + e.shape_text.ForMessage() + " must hold non-negative integers");
    if (e.rank > kMaxShapeDims) {
      return fail("shape has " + std::to_string(e.rank) + " dimensions, more than the " +
                  std::to_string(kMaxShapeDims) + " a header may give (kMaxShapeDims)");
    }
    if (!e.offsets_seen || e.offsets_count != 2) return fail("missing data_offsets [begin, end]");
    for (int i = 0; i < 2; ++i) {
      if (!e.offsets[i]) {
        return fail("data_offsets[" + std::to_string(i) + "] is " + e.offsets_text[i] +
                    ", expected a non-negative integer");
      }
    }
    const uint64_t begin = *e.offsets[0], end = *e.offsets[1];
    if (end < begin) {
      return fail("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                  "] end before they begin");
    }
    const std::optional<uint64_t> expected = ByteCount(e.shape, *e.dtype);
    if (!expected || *expected != end - begin) {
      return fail("dtype " + std::string(StDtypeName(*e.dtype)) + " and shape " + ShapeForMessage(e.shape) +
                  " need " + (expected ? std::to_string(*expected) : std::string("more than 2^62")) +
                  " bytes, data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] hold " +
                  std::to_string(end - begin));
    }
    if (!want_tensors_ || problem_) return;
    TensorEntry t;  // named in Finish, from names_ (moved)
    t.dtype = *e.dtype;
    t.shape = std::move(e.shape);
    t.offset = begin;
    t.nbytes = end - begin;
    result_.tensors.push_back(std::move(t));
  }

  const bool want_tensors_;
  ParsedHeader result_;
  std::vector<Kind> open_;
  bool top_is_object_ = true;
  bool top_is_metadata_ = false;  // whether the last key of the header object read is "__metadata__"
  bool metadata_seen_ = false;
  bool metadata_is_object_ = false;
  const std::string* meta_key_ = nullptr;  // the last key of "__metadata__" read, in the map
  std::string* meta_value_ = nullptr;
  std::optional<std::string> header_crc_value_;  // the header checksum entry's, when a string
  Field field_ = Field::kOther;
  Entry entry_;
  // A metadata value that is no string, being written out; whether the
  // container open at each level has no element yet, and whether a key
  // was just written.
  CappedText dump_;
  std::vector<bool> dump_first_;
  bool dump_after_key_ = false;
  // The top-level keys but "__metadata__", in the order of the text: for
  // keys given twice, for messages, and the entries' names at the end.
  std::vector<std::string> names_;
  std::optional<std::pair<std::string, std::string>> problem_;           // top-level key, message
  std::optional<std::pair<std::string, std::string>> metadata_problem_;  // metadata key, message
  std::optional<DuplicateKey> duplicate_;
  std::string stop_;          // a limit passed
  std::string syntax_error_;  // the parser's message
};

// Checks that entries tile a data region of `data_size` bytes: `at(k)` is
// the k-th of `count` in data-region order (by offset, size, then name).
// Fails through `p` on the first problem in that order: an entry past the
// region's end, one overlapping the one before, bytes between two entries,
// or bytes after the last one.
template <typename At>
void CheckTiling(size_t count, const At& at, uint64_t data_size, const Parser& p) {
  uint64_t pos = 0;
  const TensorEntry* prev = nullptr;
  auto range = [](const TensorEntry& e) {
    return "[" + std::to_string(e.offset) + ", " + std::to_string(e.offset + e.nbytes) + "]";
  };
  for (size_t k = 0; k < count; ++k) {
    const TensorEntry& e = at(k);
    if (e.offset + e.nbytes > data_size) {
      p.Fail("tensor `" + NameForMessage(e.name) + "`: data_offsets " + range(e) + " extend past the " +
             std::to_string(data_size) + "-byte data region (truncated file?)");
    }
    if (e.offset < pos) {
      p.Fail("tensor `" + NameForMessage(e.name) + "`: data_offsets " + range(e) + " overlap tensor `" +
             NameForMessage(prev->name) + "` " + range(*prev));
    }
    if (e.offset > pos) {
      p.Fail("bytes [" + std::to_string(pos) + ", " + std::to_string(e.offset) +
             ") of the data region belong to no tensor");
    }
    pos = e.offset + e.nbytes;
    prev = &e;
  }
  if (pos != data_size) {
    p.Fail("bytes [" + std::to_string(pos) + ", " + std::to_string(data_size) +
           ") of the data region belong to no tensor (" + std::to_string(data_size - pos) +
           " trailing bytes after the last tensor's end)");
  }
}

// The JSON header `text` (the n bytes after the length), checked as Parse
// checks it: its checksum (when it has one), an object without NUL bytes,
// nesting deeper than 3 or repeated keys, and read (the entries, only when
// `want_tensors`). Throws CheckpointError from `p` for those problems; the
// problems of entries and metadata are in the result.
ParsedHeader ParseHeader(std::string_view text, const Parser& p, bool want_tensors) {
  if (text.size() < 2 || text[0] != '{') p.Fail("header does not start with '{'");
  // Checked first: a corrupt header is reported as such, not as whatever
  // JSON error or wrong offset the corruption happens to make.
  const size_t crc_at = FindHeaderCrcKey(text);
  std::string crc_said;
  if (crc_at != std::string_view::npos) {
    const size_t value = crc_at + HeaderCrcMark().size();
    if (value + 9 > text.size() || text[value + 8] != '"') {
      p.Fail("header checksum entry is cut short or malformed");
    }
    crc_said = std::string(text.substr(value, 8));
    // Over the text with the value read as kNoHeaderCrc (without a copy of
    // the text).
    uLong crc = CrcUpdate(crc32(0L, Z_NULL, 0), text.data(), value);
    crc = CrcUpdate(crc, kNoHeaderCrc, 8);
    crc = CrcUpdate(crc, text.data() + value + 8, text.size() - value - 8);
    const std::string got = CrcHex(crc);
    if (got != crc_said) {
      p.Fail("header checksum is " + got + ", the header says " + crc_said +
             " (the header is corrupt: " + ForeignEditNote() + ")");
    }
  }
  // nlohmann's parser stops at a NUL as if the input ended there, which
  // would let anything after it pass unread.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    p.Fail("header has a NUL byte at offset " + std::to_string(nul));
  }
  if (NestingDepth(text) > 3) p.Fail("header JSON nests deeper than 3 levels");
  HeaderReader reader(want_tensors);
  // No more than a header of such entries could hold, whatever the count
  // says: an entry takes at least 49 bytes (`"":{"dtype":"U8","shape":[0],
  // "data_offsets":[0,0]}`), while `"a":{}` takes 6.
  constexpr size_t kSmallestEntry = 49;
  reader.Reserve(std::min(SecondLevelObjects(text), text.size() / kSmallestEntry));
  const bool parsed = nlohmann::json::sax_parse(text.begin(), text.end(), &reader);
  return reader.Finish(p, parsed, crc_at != std::string_view::npos, crc_said);
}

}  // namespace

SafetensorsFile SafetensorsFile::Parse(std::string bytes, const std::string& source) {
  Parser p(source);
  if (bytes.size() < 8) {
    p.Fail("file is " + std::to_string(bytes.size()) +
           " bytes, shorter than the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  if (n > bytes.size() - 8) {
    p.Fail("header length " + std::to_string(n) + " exceeds the " +
           std::to_string(bytes.size() - 8) + " bytes after the length field (truncated file?)");
  }
  if (n > kMaxHeaderBytes) {
    p.Fail("header length " + std::to_string(n) + " exceeds the limit of " +
           std::to_string(kMaxHeaderBytes) + " bytes");
  }
  const uint64_t data_size = bytes.size() - 8 - n;
  SafetensorsFile f = ParseLayout(std::string_view(bytes.data() + 8, n), data_size, source);
  std::string got;
  if (f.metadata_.count(kChecksumKey)) {
    got = CrcHex(CrcUpdate(crc32(0L, Z_NULL, 0), bytes.data() + f.data_start_, data_size));
  }
  f.CheckDataCrc(got);
  f.bytes_ = std::move(bytes);
  return f;
}

SafetensorsFile SafetensorsFile::ParseLayout(std::string_view header_text, uint64_t data_size,
                                             const std::string& source) {
  Parser p(source);
  ParsedHeader header = ParseHeader(header_text, p, /*want_tensors=*/true);
  if (header.problem) p.Fail(*header.problem);
  return Layout(std::move(header.tensors), std::move(header.metadata), 8 + header_text.size(), data_size,
                source);
}

SafetensorsFile SafetensorsFile::Layout(std::vector<TensorEntry> entries, Metadata metadata,
                                        uint64_t data_start, uint64_t data_size, const std::string& source) {
  Parser p(source);
  SafetensorsFile f;
  f.source_ = source;
  f.metadata_ = std::move(metadata);
  f.tensors_ = std::move(entries);  // in the order the header lists them
  // The entries must tile the data region: sorted by offset, each begins
  // where the previous one ended and the last ends at the file's end.
  // Equal offsets (empty tensors) go by size, then by name.
  const size_t count = f.tensors_.size();
  std::vector<size_t> order(count);  // order[k]: the listed entry that goes k-th
  for (size_t i = 0; i < count; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const TensorEntry& x = f.tensors_[a];
    const TensorEntry& y = f.tensors_[b];
    if (x.offset != y.offset) return x.offset < y.offset;
    if (x.nbytes != y.nbytes) return x.nbytes < y.nbytes;
    return x.name < y.name;
  });
  // The order the header lists the tensors in: the order a writer here
  // was given them, which is not the data's (see DataOrder).
  f.header_order_.resize(count);
  for (size_t k = 0; k < count; ++k) f.header_order_[order[k]] = k;
  // The entries put in that order where they are, a cycle at a time.
  constexpr size_t kPlaced = static_cast<size_t>(-1);
  for (size_t start = 0; start < count; ++start) {
    if (order[start] == kPlaced) continue;
    TensorEntry first = std::move(f.tensors_[start]);
    size_t k = start;
    while (order[k] != start) {
      const size_t from = order[k];
      f.tensors_[k] = std::move(f.tensors_[from]);
      order[k] = kPlaced;
      k = from;
    }
    f.tensors_[k] = std::move(first);
    order[k] = kPlaced;
  }

  CheckTiling(count, [&](size_t k) -> const TensorEntry& { return f.tensors_[k]; }, data_size, p);
  f.data_start_ = data_start;
  return f;
}

void SafetensorsFile::CheckDataCrc(const std::string& got) {
  auto crc = metadata_.find(kChecksumKey);
  if (crc != metadata_.end()) {
    if (got != crc->second) {
      Parser(source_).Fail("data region checksum is " + got + ", the header says " + crc->second +
                           " (the tensor data is corrupt: " + ForeignEditNote() + ")");
    }
    data_checksum_ = crc->second;
    metadata_.erase(crc);
  }
  metadata_.erase(kHeaderChecksumKey);
}

namespace {

using FilePtr = std::unique_ptr<FILE, int (*)(FILE*)>;

// `path` opened for reading, and its size. Throws CheckpointError naming
// the path unless it is a regular file that opens.
std::pair<FilePtr, uint64_t> OpenRegularFile(const std::string& path) {
  // Opened without blocking: a FIFO at the path would otherwise wait in
  // open for a writer forever, with no deadline to end it. Only once the
  // file is known to be a regular one are its reads made blocking again.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    ThrowHostFailure(path + ": cannot open: " + std::strerror(err), err);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    ThrowHostFailure(path + ": cannot stat: " + std::strerror(err), err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw CheckpointError(path + ": not a regular file but " + FileKind(st.st_mode));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    ThrowHostFailure(path + ": cannot make its reads blocking: " + std::strerror(err), err);
  }
  FilePtr f(::fdopen(fd, "rb"), &std::fclose);
  if (!f) {
    const int err = errno;
    ::close(fd);
    ThrowHostFailure(path + ": cannot open as a stream: " + std::strerror(err), err);
  }
  return {std::move(f), static_cast<uint64_t>(st.st_size)};
}

// What shows that a file's bytes were changed in place: its size and its
// modification time. Not its change time, which an unlink, a link or a
// rename of another file over its name moves while the bytes stay.
struct ContentStamp {
  uint64_t size = 0;
  timespec modified{};
};

ContentStamp StampOf(const std::string& path, FILE* f) {
  struct stat st;
  if (::fstat(::fileno(f), &st) != 0) {
    const int err = errno;
    ThrowHostFailure(path + ": cannot stat: " + std::strerror(err), err);
  }
  return {static_cast<uint64_t>(st.st_size), st.st_mtim};
}

// Throws CheckpointError where the file open as `f` was written since
// `before` was taken: the bytes read may mix two versions of it (a `cp`
// over a checkpoint while a rank loads it), which the data checksum
// catches only in files that have one, and then as corrupt data.
void CheckUnchanged(const std::string& path, FILE* f, const ContentStamp& before) {
  const ContentStamp now = StampOf(path, f);
  if (now.size == before.size && now.modified.tv_sec == before.modified.tv_sec &&
      now.modified.tv_nsec == before.modified.tv_nsec) {
    return;
  }
  throw CheckpointError(path + ": the file was written to while read (" +
                        (now.size != before.size
                             ? "its size went from " + std::to_string(before.size) + " to " + std::to_string(now.size) +
                                   " bytes"
                             : std::string("its modification time changed")) +
                        "): the bytes read may mix two versions of it; read it again once its writer is done");
}

}  // namespace

Metadata SafetensorsFile::ReadMetadata(const std::string& path) {
  auto [f, size] = OpenRegularFile(path);
  Parser p(path);
  unsigned char length[8];
  if (size < 8 || std::fread(length, 1, 8, f.get()) != 8) {
    const int err = errno;
    if (size >= 8 && std::ferror(f.get())) {
      ThrowHostFailure(path + ": cannot read its first 8 bytes: " + std::strerror(err), err);
    }
    p.Fail("file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
  if (n > size - 8) {
    p.Fail("header length " + std::to_string(n) + " exceeds the " + std::to_string(size - 8) +
           " bytes after the length field (truncated file?)");
  }
  if (n > kMaxHeaderBytes) {
    p.Fail("header length " + std::to_string(n) + " exceeds the limit of " +
           std::to_string(kMaxHeaderBytes) + " bytes");
  }
  std::string text(static_cast<size_t>(n), '\0');
  if (std::fread(text.data(), 1, text.size(), f.get()) != text.size()) {
    const int err = errno;
    if (std::ferror(f.get())) ThrowHostFailure(path + ": cannot read its header: " + std::strerror(err), err);
    throw CheckpointError(path + ": cannot read its header: the file got shorter while being read");
  }
  ParsedHeader header = ParseHeader(text, p, /*want_tensors=*/false);
  if (header.metadata_problem) p.Fail(*header.metadata_problem);
  Metadata metadata = std::move(header.metadata);
  metadata.erase(kChecksumKey);
  metadata.erase(kHeaderChecksumKey);
  return metadata;
}

namespace {

// Ends a read once `*stop` is true, naming how far it got.
struct StopCheck {
  const std::string& path;
  uint64_t size;
  const std::atomic<bool>* stop;
  void operator()(uint64_t got) const {
    if (stop != nullptr && stop->load(std::memory_order_relaxed)) {
      throw CheckpointError(path + ": the read was stopped after " + std::to_string(got) + " of " +
                            std::to_string(size) + " bytes");
    }
  }
};

std::function<void(uint64_t)>& ReadPieceHook() {
  static std::function<void(uint64_t)> hook;
  return hook;
}

// Before each piece's stop check.
void BeforePiece(uint64_t got) {
  if (ReadPieceHook()) ReadPieceHook()(got);
}

// The length field and the header of a file of `size` >= 8 bytes, read
// from the start of `f` and checked as Parse checks them. `valid` is false
// when the header or an entry is bad: Parse refuses the returned bytes with
// the message it would give for the whole file. A valid header whose
// entries end before or after the file's end is refused here. `parsed`,
// when given, receives a valid header's entries and metadata, so that the
// caller need not parse the text again.
std::string ReadHead(const std::string& path, FILE* f, uint64_t size, bool* valid,
                     ParsedHeader* parsed = nullptr) {
  // The header's length first: a file that is no safetensors file at all
  // (a dataset archive given by mistake) is refused before its whole size
  // is allocated. Parse checks the rest.
  unsigned char length[8];
  if (std::fread(length, 1, 8, f) != 8) {
    // errno says something only when the stream has its error flag set.
    const int err = errno;
    if (std::ferror(f)) ThrowHostFailure(path + ": cannot read its first 8 bytes: " + std::strerror(err), err);
    throw CheckpointError(path + ": cannot read its first 8 bytes: the file got shorter while being read");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
  if (n > size - 8 || n > kMaxHeaderBytes) {
    throw CheckpointError(path + ": header length " + std::to_string(n) + " exceeds " +
                          (n > size - 8 ? "the " + std::to_string(size - 8) +
                                              " bytes after the length field"
                                        : "the limit of " + std::to_string(kMaxHeaderBytes) +
                                              " bytes") +
                          " (truncated, or not a safetensors file)");
  }
  // Then the header itself, and the data region's size it implies: a file
  // whose size differs (a huge tail after the last tensor, or a truncated
  // one) is refused before its data is allocated or read.
  std::string header_text(reinterpret_cast<const char*>(length), 8);
  header_text.resize(8 + static_cast<size_t>(n));
  if (std::fread(header_text.data() + 8, 1, n, f) != n) {
    const int err = errno;
    if (std::ferror(f)) ThrowHostFailure(path + ": cannot read its header: " + std::strerror(err), err);
    throw CheckpointError(path + ": cannot read its header: the file got shorter while being read");
  }
  // The header is checked here as Parse checks it. A bad one ends the
  // read at once: only the length and the header are returned, which
  // Parse refuses with the very message it would give for the whole file
  // (it checks the header and every entry before the data region), on
  // every rank that gets these bytes. Reading the data first would cost
  // the whole file's size in memory and time, or fail for want of memory,
  // before the real problem were named.
  Parser p(path);
  ParsedHeader header;
  try {
    header = ParseHeader(std::string_view(header_text).substr(8), p, /*want_tensors=*/true);
    if (header.problem) p.Fail(*header.problem);
  } catch (const CheckpointError&) {
    *valid = false;
    return header_text;
  }
  // A header that does not tile the file's data region is refused here,
  // before the data is allocated or read (a huge tail after the last
  // tensor, a file cut short), with the problem Parse reports for the same
  // bytes: the first in data-region order.
  const uint64_t data_size = size - 8 - n;
  uint64_t data_end = 0;
  for (const TensorEntry& e : header.tensors) data_end = std::max(data_end, e.offset + e.nbytes);
  if (data_end != data_size) {
    std::vector<const TensorEntry*> order;
    order.reserve(header.tensors.size());
    for (const TensorEntry& e : header.tensors) order.push_back(&e);
    std::sort(order.begin(), order.end(), [](const TensorEntry* x, const TensorEntry* y) {
      return std::tie(x->offset, x->nbytes, x->name) < std::tie(y->offset, y->nbytes, y->name);
    });
    CheckTiling(order.size(), [&](size_t k) -> const TensorEntry& { return *order[k]; }, data_size, p);
    throw std::logic_error(path + ": entries that end at " + std::to_string(data_end) + " tile a data region of " +
                           std::to_string(data_size) + " bytes");
  }
  *valid = true;
  if (parsed != nullptr) *parsed = std::move(header);
  return header_text;
}

// The whole file of `size` bytes whose first `head` bytes were read from
// `f` already: the rest is read after them, kStopCheckBytes at a time.
// `where`, when given, names what a file position holds (", in tensor
// `w`"), given the bytes whose header was read, for the message of a read
// that stops short.
using PositionNamer = std::function<std::string(const std::string& bytes, uint64_t position)>;
std::string ReadRest(const std::string& path, FILE* f, uint64_t size, std::string head,
                     const StopCheck& stopped, const PositionNamer& where = {}) {
  std::string bytes;
  try {
    bytes.resize(static_cast<size_t>(size));
  } catch (const std::bad_alloc&) {
    ThrowHostFailure(path + ": cannot hold its " + std::to_string(size) + " bytes in memory", ENOMEM);
  }
  // The length and header already read are not read again.
  size_t got = head.size();
  std::memcpy(bytes.data(), head.data(), got);
  std::string().swap(head);
  int read_errno = 0;
  while (got < bytes.size()) {
    BeforePiece(got);
    stopped(got);
    const size_t want = std::min(bytes.size() - got, kStopCheckBytes);
    const size_t n = std::fread(bytes.data() + got, 1, want, f);
    got += n;
    if (n != want) {
      read_errno = errno;
      break;
    }
  }
  if (got != bytes.size()) {
    // A short read without an error is a file that shrank since fstat.
    const std::string what = path + ": read " + std::to_string(got) + " of " + std::to_string(bytes.size()) +
                             " bytes" + (where ? where(bytes, got) : std::string());
    if (std::ferror(f)) ThrowHostFailure(what + ": " + std::strerror(read_errno), read_errno);
    throw CheckpointError(what + ": the file got shorter while read");
  }
  return bytes;
}

// The header of `f` (open at `path`, `size` bytes) when it is valid, read
// and parsed once into `*header`; a bad one throws what Parse says of it.
std::string ReadValidHead(const std::string& path, FILE* f, uint64_t size, const StopCheck& stopped,
                          ParsedHeader* header) {
  std::string head;
  bool valid = false;
  if (size >= 8) head = ReadHead(path, f, size, &valid, header);
  if (!valid) {
    // A file under 8 bytes is read whole first (it is no bigger than the
    // length field).
    if (size < 8) head = ReadRest(path, f, size, std::move(head), stopped);
    (void)SafetensorsFile::Parse(std::move(head), path);
    throw std::logic_error(path + ": a header found bad was accepted by Parse");
  }
  return head;
}

// The tensor a data position (counted from the file's start; the data
// begins at `data_start`) falls in, as the end of a message: ", in tensor
// `w`"; "" in the header or past every tensor.
std::string TensorAt(const std::vector<TensorEntry>& tensors, uint64_t data_start, uint64_t position) {
  if (position < data_start) return "";
  for (const TensorEntry& e : tensors) {
    if (position - data_start < e.offset + e.nbytes) return ", in tensor `" + NameForMessage(e.name) + "`";
  }
  return "";
}

// Most buffers one preadv may take.
size_t IovMax() {
  const long n = ::sysconf(_SC_IOV_MAX);
  return n > 0 ? static_cast<size_t>(n) : size_t{16};  // POSIX's least
}

}  // namespace

namespace internal {

void SetReadPieceHookForTesting(std::function<void(uint64_t)> hook) { ReadPieceHook() = std::move(hook); }

}  // namespace internal

std::string SafetensorsFile::ReadBytes(const std::string& path, const std::atomic<bool>* stop) {
  auto [f, size] = OpenRegularFile(path);
  const ContentStamp opened = StampOf(path, f.get());
  const StopCheck stopped{path, size, stop};
  stopped(0);
  std::string head;
  if (size >= 8) {
    bool valid = false;
    head = ReadHead(path, f.get(), size, &valid);
    if (!valid) return head;
  }
  // The header was found valid: a read that stops short names the tensor
  // it stopped in, as ReadInto does.
  const uint64_t data_start = head.size();
  const PositionNamer where = [&](const std::string& bytes, uint64_t position) -> std::string {
    if (data_start <= 8 || position < data_start) return "";
    const SafetensorsFile layout =
        ParseLayout(std::string_view(bytes).substr(8, data_start - 8), size - data_start, path);
    return TensorAt(layout.tensors(), data_start, position);
  };
  std::string bytes = ReadRest(path, f.get(), size, std::move(head), stopped, where);
  CheckUnchanged(path, f.get(), opened);
  return bytes;
}

namespace {

// Reads the data region of the file open at `fd` (`path`, `size` bytes,
// the region starting at `data_start`) to `where`: one destination per
// entry of `tensors` (data-region order), or null to read that entry's
// bytes only for the checksum. Returns the region's CRC-32, when
// `want_crc`. A read that stops short names the tensor it stopped in.
uLong ReadRegion(const std::string& path, int fd, uint64_t size, uint64_t data_start,
                 const std::vector<TensorEntry>& tensors, const std::vector<void*>& where, bool want_crc,
                 const StopCheck& stopped) {
  // Neighbouring tensors are read with one preadv, up to IOV_MAX
  // destinations a call (destinations that touch merged into one): with
  // one pread per tensor, 200,000 tensors of 4 bytes took 0.63 s of CPU
  // time against 0.20 s so; 4 of 64 MiB take about 0.065 s either way
  // (safetensors_bench). Tensors given no
  // destination are read into `scratch`, at their place in the piece, only
  // for the checksum.
  std::unique_ptr<char[]> scratch;
  const size_t iov_max = IovMax();
  std::vector<iovec> batch;    // where the bytes [got, batch_end) go, in order
  std::vector<iovec> pending;  // what of `batch` is still to be read
  uLong crc = crc32(0L, Z_NULL, 0);
  uint64_t got = data_start;  // file position reached, as ReadBytes counts it
  size_t t = 0;               // tensor the next batch starts in
  uint64_t in_t = 0;          // bytes of it before the next batch
  while (got < size) {
    BeforePiece(got);
    stopped(got);
    const uint64_t piece_start = got;
    const uint64_t piece_end = got + std::min<uint64_t>(size - got, kStopCheckBytes);
    while (got < piece_end) {
      batch.clear();
      uint64_t batch_end = got;
      while (batch_end < piece_end) {
        while (in_t == tensors[t].nbytes) {
          ++t;
          in_t = 0;
        }
        char* dest;
        if (where[t] != nullptr) {
          dest = static_cast<char*>(where[t]) + in_t;
        } else {
          if (!scratch) scratch = std::make_unique<char[]>(kStopCheckBytes);
          dest = scratch.get() + (batch_end - piece_start);
        }
        const uint64_t k = std::min(piece_end - batch_end, tensors[t].nbytes - in_t);
        if (!batch.empty() && static_cast<char*>(batch.back().iov_base) + batch.back().iov_len == dest) {
          batch.back().iov_len += k;
        } else if (batch.size() == iov_max) {
          break;
        } else {
          batch.push_back(iovec{dest, static_cast<size_t>(k)});
        }
        batch_end += k;
        in_t += k;
      }
      pending = batch;
      size_t first = 0;  // of `pending`, the first not read whole
      while (got < batch_end) {
        const ssize_t r = ::preadv(fd, pending.data() + first, static_cast<int>(pending.size() - first),
                                   static_cast<off_t>(got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          // The tensor named is the first whose bytes are missing (empty
          // ones before it are whole).
          const int err = errno;
          const std::string what = path + ": read " + std::to_string(got) + " of " + std::to_string(size) +
                                   " bytes" + TensorAt(tensors, data_start, got);
          if (r < 0) ThrowHostFailure(what + ": " + std::strerror(err), err);
          throw CheckpointError(what + ": the file got shorter while read");
        }
        got += static_cast<uint64_t>(r);
        // A short read leaves the rest for the next call.
        for (size_t left = static_cast<size_t>(r); left > 0;) {
          iovec& v = pending[first];
          const size_t n = std::min(left, v.iov_len);
          v.iov_base = static_cast<char*>(v.iov_base) + n;
          v.iov_len -= n;
          left -= n;
          if (v.iov_len == 0) ++first;
        }
      }
      // Destinations do not overlap (the Placer's contract), so each holds
      // what was read into it.
      if (want_crc) {
        for (const iovec& v : batch) crc = CrcUpdate(crc, v.iov_base, v.iov_len);
      }
    }
  }
  return crc;
}

// Room for a data region of `n` bytes, left as the allocator gives it (not
// zero-filled: every byte is read over). Large regions are mapped on
// 2 MiB boundaries and offered to transparent huge pages: reading 256 MiB
// into fresh memory took about 1.0 s of CPU time with 4 KiB pages (a page
// fault each, costly in the paravirtualized build host), 0.07 s with huge
// pages. Without them the mapping still works, at the cost of the faults.
std::shared_ptr<const std::byte> AllocateRegion(const std::string& path, uint64_t n) {
  constexpr uint64_t kHugePage = uint64_t{2} << 20;
  // No memory is a failure of the host, as for a read: ENOMEM is nested.
  const auto fail = [&]() -> CheckpointError {
    ThrowHostFailure(path + ": cannot hold its data region of " + std::to_string(n) + " bytes in memory", ENOMEM);
  };
  if (n < kHugePage) {
    std::byte* p = new (std::nothrow) std::byte[std::max<uint64_t>(n, 1)];
    if (p == nullptr) throw fail();
    return std::shared_ptr<const std::byte>(p, std::default_delete<const std::byte[]>());
  }
  const uint64_t len = (n + kHugePage - 1) / kHugePage * kHugePage;
  if (len + kHugePage > static_cast<uint64_t>(SIZE_MAX)) throw fail();
  void* mapped = ::mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) throw fail();
  // The mapping is cut down to the aligned `len` bytes in it.
  const auto start = reinterpret_cast<uintptr_t>(mapped);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) ::munmap(mapped, aligned - start);
  if (const uintptr_t tail = start + len + kHugePage - (aligned + len); tail > 0) {
    ::munmap(reinterpret_cast<void*>(aligned + len), tail);
  }
  // Only advice: a kernel without transparent huge pages maps 4 KiB ones.
  (void)::madvise(reinterpret_cast<void*>(aligned), len, MADV_HUGEPAGE);
  return std::shared_ptr<const std::byte>(reinterpret_cast<const std::byte*>(aligned), [len](const std::byte* p) {
    ::munmap(const_cast<std::byte*>(p), len);
  });
}

}  // namespace

SafetensorsFile SafetensorsFile::Read(const std::string& path, const std::atomic<bool>* stop) {
  // ReadInto, into a data region of its own, which the file keeps. Before,
  // the whole file went into a zero-filled std::string first (the header
  // copied into it again): 1.3 s of CPU time for a file of 4 tensors of
  // 64 MiB, against 0.065 s for ReadInto (safetensors_bench).
  std::shared_ptr<const std::byte> region;
  SafetensorsFile file = ReadInto(
      path,
      [&](const SafetensorsFile& laid_out) {
        // The entries tile the data region (checked with the header), so
        // the last one ends where the region does.
        uint64_t bytes = 0;
        for (const TensorEntry& e : laid_out.tensors()) bytes = std::max(bytes, e.offset + e.nbytes);
        region = AllocateRegion(path, bytes);
        std::vector<void*> where;
        where.reserve(laid_out.tensors().size());
        std::byte* base = const_cast<std::byte*>(region.get());
        for (const TensorEntry& e : laid_out.tensors()) where.push_back(base + e.offset);
        return where;
      },
      stop);
  file.region_ = std::move(region);
  return file;
}

SafetensorsFile SafetensorsFile::ReadInto(const std::string& path, const Placer& place,
                                          const std::atomic<bool>* stop) {
  auto [f, size] = OpenRegularFile(path);
  const ContentStamp opened = StampOf(path, f.get());
  const StopCheck stopped{path, size, stop};
  stopped(0);
  ParsedHeader header;
  const uint64_t data_start = ReadValidHead(path, f.get(), size, stopped, &header).size();
  // The header as ReadHead read it: its text is not parsed a second time.
  SafetensorsFile file =
      Layout(std::move(header.tensors), std::move(header.metadata), data_start, size - data_start, path);

  const std::vector<void*> where = place(file);
  if (where.size() != file.tensors_.size()) {
    throw std::logic_error(path + ": the placer gave " + std::to_string(where.size()) +
                           " destinations for " + std::to_string(file.tensors_.size()) + " tensors");
  }
  const bool want_crc = file.metadata_.count(kChecksumKey) != 0;
  const uLong crc =
      ReadRegion(path, ::fileno(f.get()), size, data_start, file.tensors_, where, want_crc, stopped);
  // Before the checksum: a file written meanwhile is said to be so, not
  // to be corrupt.
  CheckUnchanged(path, f.get(), opened);
  file.CheckDataCrc(want_crc ? CrcHex(crc) : std::string());
  return file;
}

const TensorEntry* SafetensorsFile::Find(std::string_view name) const {
  for (const TensorEntry& e : tensors_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

const std::byte* SafetensorsFile::Data(const TensorEntry& entry) const {
  if (region_) return region_.get() + entry.offset;
  if (bytes_.empty()) return nullptr;  // from ReadInto: the bytes went elsewhere
  return reinterpret_cast<const std::byte*>(bytes_.data()) + data_start_ + entry.offset;
}

}  // namespace ddp::nn::io
