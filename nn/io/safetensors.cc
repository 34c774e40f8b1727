#include "nn/io/safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zlib.h>

#include "nn/io/atomic_file.h"

namespace ddp::nn::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this code copies bytes as they are");

namespace {

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
  std::set<std::string_view> names;
  for (const TensorView& t : tensors) {
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

// Follows a JSON text's parse events and throws DuplicateKey when an object
// at any level holds a key twice: the parser keeps the last one silently (a
// second `__metadata__` could drop the data checksum). It watches only;
// the value is built by a separate plain parse. A parse callback would do
// both in one pass, but nlohmann's callback parser searches the enclosing
// object from its start every time an inner object ends, so a header of N
// tensor entries took time N^2 (40 s for 50,000 entries).
class DuplicateKeyWatcher final : public nlohmann::json_sax<nlohmann::json> {
 public:
  // `top_keys`, when given, receives the keys of the outermost object in
  // the order of the text.
  explicit DuplicateKeyWatcher(std::vector<std::string>* top_keys = nullptr) : top_keys_(top_keys) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    open_.push_back({last_key_, {}});
    return true;
  }
  bool key(string_t& key) override {
    last_key_ = key;
    if (!open_.empty() && !open_.back().keys.insert(key).second) {
      throw DuplicateKey{key, open_.size() > 1 ? open_.back().name : std::string()};
    }
    if (top_keys_ != nullptr && open_.size() == 1) top_keys_->push_back(key);
    return true;
  }
  bool end_object() override {
    if (!open_.empty()) open_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  // Ends the watch; the plain parse then throws the parser's own error.
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception&) override {
    return false;
  }

 private:
  struct Object {
    std::string name;  // the key it is the value of ("" at the top)
    std::set<std::string> keys;
  };
  std::vector<Object> open_;
  std::string last_key_;  // names the object that starts next
  std::vector<std::string>* top_keys_;
};

// Parses `text` as nlohmann::json::parse does, but throws DuplicateKey for a
// key given twice in one object (at the first such key, when it comes
// before any syntax error). Both passes take time linear in the text.
nlohmann::json ParseWithUniqueKeys(std::string_view text, std::vector<std::string>* top_keys = nullptr) {
  DuplicateKeyWatcher watcher(top_keys);
  (void)nlohmann::json::sax_parse(text.begin(), text.end(), &watcher);
  return nlohmann::json::parse(text.begin(), text.end());
}

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

// Deepest nesting of arrays and objects in `json`, outside strings. A valid
// header nests 3 deep; checking first keeps hostile input from driving the
// JSON parser into deep recursion.
int NestingDepth(std::string_view json) {
  int depth = 0, max_depth = 0;
  bool in_string = false, escaped = false;
  for (char c : json) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '{' || c == '[') max_depth = std::max(max_depth, ++depth);
    else if (c == '}' || c == ']') --depth;
  }
  return max_depth;
}

class Parser {
 public:
  explicit Parser(const std::string& source) : source_(source) {}

  [[noreturn]] void Fail(const std::string& what) const {
    throw CheckpointError(source_ + ": invalid safetensors file: " + what);
  }

  uint64_t Offset(const nlohmann::json& v, const std::string& name, int which) const {
    if (!v.is_number_unsigned()) {
      Fail("tensor `" + NameForMessage(name) + "`: data_offsets[" + std::to_string(which) + "] is " + NameForMessage(v.dump()) +
           ", expected a non-negative integer");
    }
    return v.get<uint64_t>();
  }

  TensorEntry Entry(const std::string& name, const nlohmann::json& info) const {
    if (!info.is_object()) Fail("tensor `" + NameForMessage(name) + "`: entry is " + std::string(info.type_name()) + ", expected an object");
    TensorEntry e;
    e.name = name;
    auto dt = info.find("dtype");
    if (dt == info.end() || !dt->is_string()) Fail("tensor `" + NameForMessage(name) + "`: missing dtype string");
    const std::optional<StDtype> dtype = StDtypeFromName(dt->get_ref<const std::string&>());
    if (!dtype) {
      Fail("tensor `" + NameForMessage(name) + "`: dtype " + NameForMessage(dt->dump()) +
           " is not supported (" + DtypeNames() + " are)");
    }
    e.dtype = *dtype;
    auto shape = info.find("shape");
    if (shape == info.end() || !shape->is_array()) Fail("tensor `" + NameForMessage(name) + "`: missing shape array");
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 62)) {
        Fail("tensor `" + NameForMessage(name) + "`: shape " + NameForMessage(shape->dump()) +
             " must hold non-negative integers");
      }
      e.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }
    auto offsets = info.find("data_offsets");
    if (offsets == info.end() || !offsets->is_array() || offsets->size() != 2) {
      Fail("tensor `" + NameForMessage(name) + "`: missing data_offsets [begin, end]");
    }
    const uint64_t begin = Offset((*offsets)[0], name, 0);
    const uint64_t end = Offset((*offsets)[1], name, 1);
    if (end < begin) {
      Fail("tensor `" + NameForMessage(name) + "`: data_offsets [" + std::to_string(begin) + ", " +
           std::to_string(end) + "] end before they begin");
    }
    const std::optional<uint64_t> expected = ByteCount(e.shape, e.dtype);
    if (!expected || *expected != end - begin) {
      Fail("tensor `" + NameForMessage(name) + "`: dtype " + StDtypeName(e.dtype) + " and shape " +
           ShapeForMessage(e.shape) + " need " +
           (expected ? std::to_string(*expected) : std::string("more than 2^62")) +
           " bytes, data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
           "] hold " + std::to_string(end - begin));
    }
    e.offset = begin;
    e.nbytes = end - begin;
    return e;
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

}  // namespace

std::string NameForMessage(std::string_view name) {
  constexpr size_t kMax = 200;
  if (name.size() <= kMax) return EscapeControlBytes(name);
  size_t cut = kMax;
  // Not inside a UTF-8 sequence: back up over its continuation bytes.
  while (cut > 0 && (static_cast<unsigned char>(name[cut]) & 0xC0) == 0x80) --cut;
  return EscapeControlBytes(name.substr(0, cut)) + "... (" + std::to_string(name.size()) + " bytes)";
}

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

void CheckJsonKeysUnique(std::string_view json, int max_depth) {
  if (NestingDepth(json) > max_depth) {
    throw std::invalid_argument("JSON nests deeper than " + std::to_string(max_depth) +
                                (max_depth == 1 ? " level" : " levels"));
  }
  try {
    ParseWithUniqueKeys(json);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument("not valid JSON: " + JsonErrorForMessage(e));
  } catch (const DuplicateKey& d) {
    throw std::invalid_argument(DuplicateKeyMessage(d));
  }
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

// The JSON header `text` (the n bytes after the length), checked as Parse
// checks it: an object, without NUL bytes, nesting or repeated keys.
// `top_keys`, when given, receives its keys in the order of the text.
nlohmann::json ParseHeader(std::string_view text, const Parser& p, std::vector<std::string>* top_keys = nullptr) {
  if (text.size() < 2 || text[0] != '{') p.Fail("header does not start with '{'");
  // Checked first: a corrupt header is reported as such, not as whatever
  // JSON error or wrong offset the corruption happens to make.
  const size_t crc_at = FindHeaderCrcKey(text);
  std::string crc_said;
  if (const size_t at = crc_at; at != std::string_view::npos) {
    const size_t value = at + HeaderCrcMark().size();
    if (value + 9 > text.size() || text[value + 8] != '"') {
      p.Fail("header checksum entry is cut short or malformed");
    }
    const std::string said(text.substr(value, 8));
    crc_said = said;
    std::string zeroed(text);
    zeroed.replace(value, 8, kNoHeaderCrc);
    const std::string got = HeaderCrc32Hex(zeroed);
    if (got != said) {
      p.Fail("header checksum is " + got + ", the header says " + said +
             " (the header is corrupt: " + ForeignEditNote() + ")");
    }
  }
  // nlohmann's parser stops at a NUL as if the input ended there, which
  // would let anything after it pass unread.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    p.Fail("header has a NUL byte at offset " + std::to_string(nul));
  }
  if (NestingDepth(text) > 3) p.Fail("header JSON nests deeper than 3 levels");
  nlohmann::json header;
  try {
    header = ParseWithUniqueKeys(text, top_keys);
  } catch (const nlohmann::json::exception& e) {
    p.Fail("header is not valid JSON: " + JsonErrorForMessage(e));
  } catch (const DuplicateKey& d) {
    p.Fail("header " + DuplicateKeyMessage(d));
  }
  if (!header.is_object()) p.Fail("header is not a JSON object");
  // The entry checked above must be the one in __metadata__: a header whose
  // metadata holds the key where the scan did not find it (or with another
  // value) went unchecked.
  if (const auto m = header.find(kMetadataKey); m != header.end() && m->is_object()) {
    if (const auto h = m->find(kHeaderChecksumKey); h != m->end()) {
      if (crc_at == std::string_view::npos || !h->is_string() || h->get<std::string>() != crc_said) {
        p.Fail(std::string("__metadata__ holds ") + kHeaderChecksumKey +
               " but not as the header checksum entry the header was checked by");
      }
    }
  }
  return header;
}

// The header's "__metadata__" entry `value` as strings. A null stands for
// no metadata, as for the reference reader (its metadata is an optional
// map), and writers that put `"__metadata__": null` for none exist.
Metadata MetadataOf(const nlohmann::json& value, const Parser& p) {
  if (value.is_null()) return {};
  if (!value.is_object()) p.Fail("__metadata__ is not an object of strings");
  Metadata out;
  for (auto m = value.begin(); m != value.end(); ++m) {
    if (!m->is_string()) {
      p.Fail("__metadata__ value for `" + NameForMessage(m.key()) + "` is " + NameForMessage(m->dump()) +
             ", expected a string");
    }
    out[m.key()] = m->get<std::string>();
  }
  return out;
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
  const uint64_t n = header_text.size();
  std::vector<std::string> listed;
  const nlohmann::json header = ParseHeader(header_text, p, &listed);

  SafetensorsFile f;
  f.source_ = source;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == kMetadataKey) {
      f.metadata_ = MetadataOf(*it, p);
      continue;
    }
    f.tensors_.push_back(p.Entry(it.key(), *it));
  }

  // The entries must tile the data region: sorted by offset, each begins
  // where the previous one ended and the last ends at the file's end.
  std::stable_sort(f.tensors_.begin(), f.tensors_.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.nbytes < b.nbytes;
  });
  uint64_t pos = 0;
  const TensorEntry* prev = nullptr;
  auto range = [](const TensorEntry& e) {
    return "[" + std::to_string(e.offset) + ", " + std::to_string(e.offset + e.nbytes) + "]";
  };
  for (const TensorEntry& e : f.tensors_) {
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
           ") of the data region belong to no tensor");
  }
  // The order the header lists the tensors in: the order a writer here
  // was given them, which is not the data's (see DataOrder).
  std::unordered_map<std::string_view, size_t> index;
  index.reserve(f.tensors_.size());
  for (size_t i = 0; i < f.tensors_.size(); ++i) index.emplace(f.tensors_[i].name, i);
  f.header_order_.reserve(f.tensors_.size());
  for (const std::string& key : listed) {
    if (const auto it = index.find(key); it != index.end()) f.header_order_.push_back(it->second);
  }
  if (f.header_order_.size() != f.tensors_.size()) {
    throw std::logic_error(source + ": the header lists " + std::to_string(f.header_order_.size()) +
                           " of its " + std::to_string(f.tensors_.size()) + " tensors in order");
  }
  f.data_start_ = 8 + n;
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
    throw CheckpointError(path + ": cannot open: " + std::strerror(err));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw CheckpointError(path + ": cannot stat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw CheckpointError(path + ": not a regular file but " + FileKind(st.st_mode));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    throw CheckpointError(path + ": cannot make its reads blocking: " + std::strerror(err));
  }
  FilePtr f(::fdopen(fd, "rb"), &std::fclose);
  if (!f) {
    const int err = errno;
    ::close(fd);
    throw CheckpointError(path + ": cannot open as a stream: " + std::strerror(err));
  }
  return {std::move(f), static_cast<uint64_t>(st.st_size)};
}

}  // namespace

Metadata SafetensorsFile::ReadMetadata(const std::string& path) {
  auto [f, size] = OpenRegularFile(path);
  Parser p(path);
  unsigned char length[8];
  if (size < 8 || std::fread(length, 1, 8, f.get()) != 8) {
    const int err = errno;
    if (size >= 8 && std::ferror(f.get())) {
      throw CheckpointError(path + ": cannot read its first 8 bytes: " + std::strerror(err));
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
    throw CheckpointError(path + ": cannot read its header: " +
                          (std::ferror(f.get()) ? std::string(std::strerror(err))
                                                : std::string("the file got shorter while being read")));
  }
  const nlohmann::json header = ParseHeader(text, p);
  const auto it = header.find(kMetadataKey);
  if (it == header.end()) return {};
  Metadata metadata = MetadataOf(*it, p);
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
// entries end before or after the file's end is refused here.
std::string ReadHead(const std::string& path, FILE* f, uint64_t size, bool* valid) {
  // The header's length first: a file that is no safetensors file at all
  // (a dataset archive given by mistake) is refused before its whole size
  // is allocated. Parse checks the rest.
  unsigned char length[8];
  if (std::fread(length, 1, 8, f) != 8) {
    // errno says something only when the stream has its error flag set.
    const int err = errno;
    throw CheckpointError(path + ": cannot read its first 8 bytes: " +
                          (std::ferror(f) ? std::string(std::strerror(err))
                                          : std::string("the file got shorter while being read")));
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
    throw CheckpointError(path + ": cannot read its header: " +
                          (std::ferror(f) ? std::string(std::strerror(err))
                                          : std::string("the file got shorter while being read")));
  }
  // The header is checked here as Parse checks it. A bad one ends the
  // read at once: only the length and the header are returned, which
  // Parse refuses with the very message it would give for the whole file
  // (it checks the header and every entry before the data region), on
  // every rank that gets these bytes. Reading the data first would cost
  // the whole file's size in memory and time, or fail for want of memory,
  // before the real problem were named.
  Parser p(path);
  std::optional<uint64_t> data_end;
  std::optional<TensorEntry> last;
  try {
    const nlohmann::json header = ParseHeader(std::string_view(header_text).substr(8), p);
    uint64_t end = 0;
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == kMetadataKey) {
        (void)MetadataOf(*it, p);
        continue;
      }
      TensorEntry e = p.Entry(it.key(), *it);
      if (e.offset + e.nbytes >= end) {
        end = e.offset + e.nbytes;
        last = std::move(e);
      }
    }
    data_end = end;
  } catch (const CheckpointError&) {
    *valid = false;
    return header_text;
  }
  const uint64_t data_size = size - 8 - n;
  if (data_end && *data_end > data_size) {
    p.Fail("tensor `" + NameForMessage(last->name) + "`: data_offsets [" +
           std::to_string(last->offset) + ", " + std::to_string(*data_end) + "] extend past the " +
           std::to_string(data_size) + "-byte data region (truncated file?)");
  }
  if (data_end && *data_end < data_size) {
    p.Fail("bytes [" + std::to_string(*data_end) + ", " + std::to_string(data_size) +
           ") of the data region belong to no tensor (" + std::to_string(data_size - *data_end) +
           " trailing bytes after the last tensor's end)");
  }
  *valid = true;
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
    throw CheckpointError(path + ": cannot hold its " + std::to_string(size) + " bytes in memory");
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
    throw CheckpointError(path + ": read " + std::to_string(got) + " of " +
                          std::to_string(bytes.size()) + " bytes" + (where ? where(bytes, got) : std::string()) +
                          (std::ferror(f) ? std::string(": ") + std::strerror(read_errno)
                                          : std::string(": the file got shorter while read")));
  }
  return bytes;
}

}  // namespace

namespace internal {

void SetReadPieceHookForTesting(std::function<void(uint64_t)> hook) { ReadPieceHook() = std::move(hook); }

}  // namespace internal

std::string SafetensorsFile::ReadBytes(const std::string& path, const std::atomic<bool>* stop) {
  auto [f, size] = OpenRegularFile(path);
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
    for (const TensorEntry& e : layout.tensors()) {
      if (position - data_start < e.offset + e.nbytes) return ", in tensor `" + NameForMessage(e.name) + "`";
    }
    return "";
  };
  return ReadRest(path, f.get(), size, std::move(head), stopped, where);
}

SafetensorsFile SafetensorsFile::Read(const std::string& path, const std::atomic<bool>* stop) {
  return Parse(ReadBytes(path, stop), path);
}

SafetensorsFile SafetensorsFile::ReadInto(const std::string& path, const Placer& place,
                                          const std::atomic<bool>* stop) {
  auto [f, size] = OpenRegularFile(path);
  const StopCheck stopped{path, size, stop};
  stopped(0);
  std::string head;
  bool valid = false;
  if (size >= 8) head = ReadHead(path, f.get(), size, &valid);
  if (!valid) {
    // Parse names the problem, as Read does; a file under 8 bytes is read
    // whole first (it is no bigger than the length field).
    if (size < 8) head = ReadRest(path, f.get(), size, std::move(head), stopped);
    (void)Parse(std::move(head), path);
    throw std::logic_error(path + ": a header found bad was accepted by Parse");
  }
  const uint64_t data_start = head.size();
  SafetensorsFile file =
      ParseLayout(std::string_view(head).substr(8), size - data_start, path);
  std::string().swap(head);

  const std::vector<void*> where = place(file);
  if (where.size() != file.tensors_.size()) {
    throw std::logic_error(path + ": the placer gave " + std::to_string(where.size()) +
                           " destinations for " + std::to_string(file.tensors_.size()) + " tensors");
  }
  // Tensors given no destination are read here, only for the checksum.
  std::unique_ptr<char[]> scratch;
  const int fd = ::fileno(f.get());
  uLong crc = crc32(0L, Z_NULL, 0);
  uint64_t got = data_start;  // file position reached, as ReadBytes counts it
  size_t t = 0;               // tensor being read
  uint64_t in_t = 0;          // bytes of it read
  while (got < size) {
    BeforePiece(got);
    stopped(got);
    uint64_t piece = std::min<uint64_t>(size - got, kStopCheckBytes);
    while (piece > 0) {
      while (in_t == file.tensors_[t].nbytes) {
        ++t;
        in_t = 0;
      }
      const uint64_t k = std::min(piece, file.tensors_[t].nbytes - in_t);
      char* dest;
      if (where[t] != nullptr) {
        dest = static_cast<char*>(where[t]) + in_t;
      } else {
        if (!scratch) scratch = std::make_unique<char[]>(kStopCheckBytes);
        dest = scratch.get();
      }
      uint64_t done = 0;
      while (done < k) {
        const ssize_t r = ::pread(fd, dest + done, static_cast<size_t>(k - done),
                                  static_cast<off_t>(got + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          const int err = errno;
          throw CheckpointError(path + ": read " + std::to_string(got + done) + " of " +
                                std::to_string(size) + " bytes, in tensor `" +
                                NameForMessage(file.tensors_[t].name) + "`" +
                                (r < 0 ? std::string(": ") + std::strerror(err)
                                       : std::string(": the file got shorter while read")));
        }
        done += static_cast<uint64_t>(r);
      }
      crc = CrcUpdate(crc, dest, k);
      got += k;
      in_t += k;
      piece -= k;
    }
  }
  file.CheckDataCrc(CrcHex(crc));
  return file;
}

const TensorEntry* SafetensorsFile::Find(std::string_view name) const {
  for (const TensorEntry& e : tensors_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

const std::byte* SafetensorsFile::Data(const TensorEntry& entry) const {
  if (bytes_.empty()) return nullptr;  // from ReadInto: the bytes went elsewhere
  return reinterpret_cast<const std::byte*>(bytes_.data()) + data_start_ + entry.offset;
}

}  // namespace ddp::nn::io
