#include "transport/store/wire.h"

namespace ddp::transport::store::wire {

const char* OpName(uint8_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kSet: return "set";
    case Op::kGet: return "get";
    case Op::kTryGet: return "try_get";
    case Op::kAdd: return "add";
    case Op::kWait: return "wait";
    case Op::kDelete: return "delete";
    case Op::kCompareSet: return "compare_set";
    case Op::kMultiGet: return "multi_get";
    case Op::kNumKeys: return "num_keys";
    case Op::kCheck: return "check";
  }
  return "unknown";
}

void Writer::U16(uint16_t v) {
  for (int i = 0; i < 2; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void Writer::U32(uint32_t v) {
  for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void Writer::I64(int64_t v) {
  const uint64_t u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}

void Writer::String(std::string_view s) {
  U32(static_cast<uint32_t>(s.size()));
  out_.append(s);
}

std::string Writer::Frame() const {
  Writer header;
  header.U32(static_cast<uint32_t>(out_.size()));
  return header.out_ + out_;
}

namespace {
template <typename T>
bool ReadLittleEndian(std::string_view body, size_t& pos, T& v) {
  if (body.size() - pos < sizeof(T)) return false;
  uint64_t u = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    u |= static_cast<uint64_t>(static_cast<unsigned char>(body[pos + i])) << (8 * i);
  }
  v = static_cast<T>(u);
  pos += sizeof(T);
  return true;
}
}  // namespace

bool Reader::U8(uint8_t& v) { return ReadLittleEndian(body_, pos_, v); }
bool Reader::U16(uint16_t& v) { return ReadLittleEndian(body_, pos_, v); }
bool Reader::U32(uint32_t& v) { return ReadLittleEndian(body_, pos_, v); }
bool Reader::I64(int64_t& v) { return ReadLittleEndian(body_, pos_, v); }

bool Reader::Bytes(size_t n, std::string_view& v) {
  if (remaining() < n) return false;
  v = body_.substr(pos_, n);
  pos_ += n;
  return true;
}

bool Reader::String(std::string_view& v, size_t max_bytes, bool* too_long) {
  uint32_t n = 0;
  if (!U32(n)) return false;
  if (n > max_bytes) {
    if (too_long != nullptr) *too_long = true;
    return false;
  }
  return Bytes(n, v);
}

std::optional<uint32_t> PeekFrameLength(std::string_view buffer) {
  if (buffer.size() < kFrameHeaderBytes) return std::nullopt;
  Reader reader(buffer.substr(0, kFrameHeaderBytes));
  uint32_t n = 0;
  reader.U32(n);
  return n;
}

bool TokensEqual(std::string_view expected, std::string_view given) {
  // Accumulate every difference instead of returning at the first one, so
  // the time taken says nothing about how much of a guess was right.
  unsigned diff = expected.size() == given.size() ? 0u : 1u;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff |= static_cast<unsigned char>(expected[i]) ^ g;
  }
  // Keep the compiler from turning the loop back into an early exit.
  volatile unsigned sink = diff;
  return sink == 0;
}

}  // namespace ddp::transport::store::wire
