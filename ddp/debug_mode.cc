#include "ddp/debug_mode.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::dist {
namespace {

// One rank's fingerprint, identical in size on every rank.
struct Fingerprint {
  uint64_t sequence;
  uint64_t hash;  // of the whole description (the text may be cut)
  char text[240];
};
static_assert(sizeof(Fingerprint) == 256);

// One rank's part of the exchange when a group is made, identical in size
// on every rank. A bad DDP_DEBUG or DDP_COLLECTIVE_THREAD travels in it (cut
// to fit) so that every rank can name it.
struct ModeRecord {
  uint8_t state;         // kModeOff, kModeDetail or kModeBadValue (DDP_DEBUG)
  uint8_t cut;           // 1: `value` holds only the start of DDP_DEBUG
  uint8_t thread_bad;    // 1: `thread_value` holds a bad DDP_COLLECTIVE_THREAD
  uint8_t thread_cut;    // 1: `thread_value` holds only its start
  char value[62];
  char thread_value[62];
};
static_assert(sizeof(ModeRecord) == 128);
constexpr uint8_t kModeOff = 0;
constexpr uint8_t kModeDetail = 1;
constexpr uint8_t kModeBadValue = 2;

// Copies `value` into `slot` (the last byte stays '\0'); true when it did
// not fit whole.
template <size_t N>
bool CopyCut(const std::string& value, char (&slot)[N]) {
  const size_t room = N - 1;
  std::memcpy(slot, value.data(), std::min(value.size(), room));
  return value.size() > room;
}

std::chrono::milliseconds TimeLeft(transport::Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - transport::Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

// Puts `description` into `text`, NUL-terminated. One too long keeps its
// start and its last kTailBytes around "...": the dtype and shape come
// last ("all_reduce <label>(sum, f32 [4])"), and they are what most often
// differs, so a long label must not push them out of the message.
constexpr size_t kTailBytes = 96;
template <size_t N>
void FillText(const std::string& description, char (&text)[N]) {
  static_assert(N > kTailBytes + 4);
  const size_t room = N - 1;
  if (description.size() <= room) {
    std::memcpy(text, description.data(), description.size());
    text[description.size()] = '\0';
    return;
  }
  const size_t head = room - kTailBytes - 3;
  std::memcpy(text, description.data(), head);
  std::memcpy(text + head, "...", 3);
  std::memcpy(text + head + 3, description.data() + description.size() - kTailBytes, kTailBytes);
  text[room] = '\0';
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

DebugSetting DebugSettingFromEnvironment() {
  const char* raw = std::getenv("DDP_DEBUG");
  if (raw == nullptr) return {};
  std::string value(raw);
  std::transform(value.begin(), value.end(), value.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (value.empty() || value == "off") return {};
  if (value == "info") return {.level = DebugLevel::kInfo};
  if (value == "detail") return {.level = DebugLevel::kDetail};
  return {.bad_value = std::string(raw)};
}

transport::Status CheckFingerprints(transport::Communicator& comm, int rank, int size,
                                    uint64_t sequence, const std::string& description,
                                    transport::Deadline deadline) {
  Fingerprint mine{};
  mine.sequence = sequence;
  mine.hash = Fnv1a(description);
  FillText(description, mine.text);
  // Sized by the communicator, which writes one entry per rank it has.
  std::vector<Fingerprint> all(comm.size());
  transport::Status s = comm.AllGather(&mine, all.data(), sizeof(Fingerprint),
                                       transport::DataType::kU8, {.timeout = TimeLeft(deadline)});
  if (!s.ok()) return s;
  if (rank != comm.rank() || size != comm.size()) {
    return transport::InvalidArgumentError(
        "CheckFingerprints: given rank " + std::to_string(rank) + " of " + std::to_string(size) +
        ", but the communicator is rank " + std::to_string(comm.rank()) + " of " +
        std::to_string(comm.size()));
  }
  bool agree = true;
  for (const Fingerprint& f : all) agree = agree && f.sequence == mine.sequence && f.hash == mine.hash;
  if (agree) return transport::Status::Ok();
  // Group ranks by what they run: "ranks 0, 2 run #7 all_reduce(...); rank 1 runs #7 broadcast(...)".
  std::map<std::pair<uint64_t, uint64_t>, std::vector<int>> groups;
  std::map<std::pair<uint64_t, uint64_t>, std::string> texts;
  for (int r = 0; r < comm.size(); ++r) {
    const auto key = std::make_pair(all[r].sequence, all[r].hash);
    groups[key].push_back(r);
    all[r].text[sizeof(all[r].text) - 1] = '\0';
    texts[key] = all[r].text;
  }
  std::string message = "collective desync detected (DDP_DEBUG=detail) on rank " +
                        std::to_string(rank) + ": ";
  bool first = true;
  for (const auto& [key, ranks] : groups) {
    if (!first) message += "; ";
    first = false;
    message += ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) message += (i ? ", " : "") + std::to_string(ranks[i]);
    message += (ranks.size() == 1 ? " runs collective #" : " run collective #") +
               std::to_string(key.first) + " " + texts[key];
  }
  return transport::InvalidArgumentError(message);
}

transport::Status CheckDebugModeAgrees(transport::Communicator& comm, bool detail,
                                       const std::optional<std::string>& bad_debug_value,
                                       const std::optional<std::string>& bad_collective_thread,
                                       transport::Deadline deadline) {
  ModeRecord mine{};
  mine.state = bad_debug_value ? kModeBadValue : detail ? kModeDetail : kModeOff;
  if (bad_debug_value) mine.cut = CopyCut(*bad_debug_value, mine.value) ? 1 : 0;
  if (bad_collective_thread) {
    mine.thread_bad = 1;
    mine.thread_cut = CopyCut(*bad_collective_thread, mine.thread_value) ? 1 : 0;
  }
  std::vector<ModeRecord> all(comm.size());
  transport::Status s = comm.AllGather(&mine, all.data(), sizeof(ModeRecord),
                                       transport::DataType::kU8, {.timeout = TimeLeft(deadline)});
  if (!s.ok()) return s;
  // A bad value anywhere stops every rank, with the same message.
  const std::string of = " (of " + std::to_string(comm.size()) + "): ";
  std::string bad_debug, bad_thread;
  for (int r = 0; r < comm.size(); ++r) {
    ModeRecord& got = all[r];
    if (got.state == kModeBadValue) {
      got.value[sizeof(got.value) - 1] = '\0';
      bad_debug += (bad_debug.empty() ? "" : ", ") + std::string("DDP_DEBUG=") + got.value +
                   (got.cut ? "..." : "") + " on rank " + std::to_string(r);
    }
    if (got.thread_bad != 0) {
      got.thread_value[sizeof(got.thread_value) - 1] = '\0';
      bad_thread += (bad_thread.empty() ? "" : ", ") + std::string("DDP_COLLECTIVE_THREAD=") +
                    got.thread_value + (got.thread_cut ? "..." : "") + " on rank " +
                    std::to_string(r);
    }
  }
  if (!bad_debug.empty() || !bad_thread.empty()) {
    std::string message;
    if (!bad_debug.empty()) message = bad_debug + of + kDebugAccepted + "; ";
    if (!bad_thread.empty()) message += bad_thread + of + kCollectiveThreadAccepted + "; ";
    throw std::invalid_argument(message + "every rank of the group stops");
  }
  std::string on;
  int count = 0;
  for (int r = 0; r < comm.size(); ++r) {
    if (all[r].state != kModeDetail) continue;
    on += (count++ ? ", " : "") + std::to_string(r);
  }
  if (count == 0 || count == comm.size()) return transport::Status::Ok();
  return transport::InvalidArgumentError(
      "DDP_DEBUG=detail (ProcessGroupOptions::debug_detail) is on in rank" +
      std::string(count == 1 ? " " : "s ") + on + " of " + std::to_string(comm.size()) +
      " and off in the others: the fingerprint check is itself a collective, so every rank "
      "must have it, or none");
}

}  // namespace ddp::dist
