#ifndef DDP_TRANSPORT_STORE_WIRE_H_
#define DDP_TRANSPORT_STORE_WIRE_H_

// The TCP store's wire protocol, shared by server and client (and by the
// protocol fuzzer). Private to //transport.
//
// Every message is a frame: a little-endian u32 body length, then the body.
// Integers are little-endian; a string is a u32 length then its bytes.
//
//   handshake (client first):  "DDPS" u16 version u16 0 string job_token
//   handshake reply:           "DDPS" u16 version u8 status string message
//   request:                   u8 op u32 request_id, then per op:
//     kSet      string key, string value
//     kGet      u32 timeout_ms, string key        (waits for the key)
//     kTryGet   string key
//     kAdd      i64 delta, string key
//     kWait     u32 timeout_ms, u32 n, n x string key
//     kDelete   string key
//     kCompareSet  string key, u8 has_expected, [string expected], string desired
//     kMultiGet u32 timeout_ms, u32 n, n x string key  (waits for all of them)
//     kNumKeys  -
//     kCheck    u32 n, n x string key             (does not wait)
//   reply:                     u32 request_id u8 status, then
//     on error: string message; on success per op:
//     kSet -, kGet string value, kTryGet u8 found [string value],
//     kAdd i64 new_value, kWait -, kDelete u8 existed,
//     kCompareSet u8 found [string value] (what the key holds afterwards),
//     kMultiGet n x string value (in the order the keys were named),
//     kNumKeys i64 count, kCheck u8 all_exist
//
// The request id lets a client drop the late reply of a call that it already
// gave up on locally, without closing the connection. A reply with request
// id 0 answers no request: the server is closing the connection, and its
// message says why (a refused request, or kStopNotice when it stops). The server answers
// each request independently: a parked Get does not hold back later requests.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "transport/store/store.h"

namespace ddp::transport::store::wire {

inline constexpr char kMagic[4] = {'D', 'D', 'P', 'S'};
/// Bumped on any incompatible change; client and server must agree.
inline constexpr uint16_t kVersion = 1;

/// Opcodes. Values are on the wire: append only.
enum class Op : uint8_t {
  kSet = 1,
  kGet = 2,
  kTryGet = 3,
  kAdd = 4,
  kWait = 5,
  kDelete = 6,
  kCompareSet = 7,
  kMultiGet = 8,
  kNumKeys = 9,
  kCheck = 10,
};

/// Most keys one Wait, MultiGet or Check may name.
inline constexpr uint32_t kMaxWaitKeys = 1024;
/// Longest job token a handshake carries.
inline constexpr uint32_t kMaxTokenBytes = 1024;
/// Largest handshake body: magic, version, padding, token (with its length).
inline constexpr uint32_t kMaxHandshakeBytes = 4 + 2 + 2 + 4 + kMaxTokenBytes;
/// Largest request or reply body. A Set of the largest value or a Wait on the
/// most keys of the largest size fits, with room for the fixed fields.
inline constexpr uint32_t kMaxFrameBytes =
    static_cast<uint32_t>(kMaxValueBytes + kMaxWaitKeys * (kMaxKeyBytes + 4) + 64);
/// Bytes of the length prefix.
inline constexpr size_t kFrameHeaderBytes = 4;
/// In the RESOURCE_EXHAUSTED message of a multi-get whose values are more
/// than one reply carries: the one refusal that asking for fewer keys at
/// once gets past (the server's limits on waiting calls are not).
inline constexpr char kReplyTooLarge[] = "more than one reply carries";

/// How the UNAVAILABLE message begins with which a stopping server answers
/// parked calls and tells idle connections (request id 0) that it stops;
/// its owner's reason, if any, follows after ": ".
inline constexpr std::string_view kStopNotice = "the store server is shutting down";
/// The notice instead when its owner stopped it after a clean end of the
/// job (TcpStoreServer::Stop): the words right after kStopNotice, where no
/// reason can put them (a reason follows ": "), are what clients go by,
/// never words inside the reason (which holds communicator names).
inline constexpr std::string_view kCleanStopNotice = "the store server is shutting down after a clean end of the job";

/// "set", "get", ...; "unknown" for anything else.
const char* OpName(uint8_t op);

/// Appends fixed-width little-endian fields to a byte string.
class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v);
  void U32(uint32_t v);
  void I64(int64_t v);
  void Bytes(std::string_view s) { out_.append(s); }
  void String(std::string_view s);
  /// The body with its length prefix in front.
  std::string Frame() const;
  const std::string& body() const { return out_; }

 private:
  std::string out_;
};

/// Reads fields from a frame body. Every read fails (returns false) once the
/// body is exhausted; nothing reads past the end.
class Reader {
 public:
  explicit Reader(std::string_view body) : body_(body) {}
  bool U8(uint8_t& v);
  bool U16(uint16_t& v);
  bool U32(uint32_t& v);
  bool I64(int64_t& v);
  bool Bytes(size_t n, std::string_view& v);
  /// A string of at most `max_bytes`; longer ones fail with `too_long` set.
  bool String(std::string_view& v, size_t max_bytes, bool* too_long = nullptr);
  bool at_end() const { return pos_ == body_.size(); }
  size_t remaining() const { return body_.size() - pos_; }

 private:
  std::string_view body_;
  size_t pos_ = 0;
};

/// Reads the length prefix at the start of `buffer` when all four bytes are
/// there.
std::optional<uint32_t> PeekFrameLength(std::string_view buffer);

/// Compares two job tokens in time that depends only on the expected token's
/// length, never on where they first differ.
bool TokensEqual(std::string_view expected, std::string_view given);

}  // namespace ddp::transport::store::wire

#endif  // DDP_TRANSPORT_STORE_WIRE_H_
