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

// The most distinct values, or groups of ranks, a message lists.
constexpr size_t kMostGroups = 8;

// `value` quoted and escaped; "..." after the closing quote when `cut`
// (the value went on past what the exchange carries).
std::string Quote(const std::string& value, bool cut) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "\"";
  for (const unsigned char c : value) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\r': out += "\\r"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c >= 0x7f) {
          out += "\\x";
          out += kHex[c >> 4];
          out += kHex[c & 15];
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += cut ? "\"..." : "\"";
  // A CRLF env file or a YAML value leaves whitespace that is easy to miss.
  if (!value.empty() && (std::isspace(static_cast<unsigned char>(value.front())) ||
                         (!cut && std::isspace(static_cast<unsigned char>(value.back()))))) {
    out += " (whitespace around a value is not trimmed)";
  }
  return out;
}

}  // namespace

std::string QuotedEnvValue(const std::string& value) { return Quote(value, false); }

std::string RankSet(const std::vector<int>& ranks, size_t most_ranges) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  size_t ranges = 0, i = 0;
  for (; i < ranks.size() && ranges < most_ranges; ++ranges) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (ranges ? ", " : "") + std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  if (i < ranks.size()) out += ", ... (" + std::to_string(ranks.size() - i) + " more)";
  return out;
}

std::string DescribeBadValues(const std::string& variable, const std::vector<std::optional<std::string>>& shown,
                              const char* accepted) {
  // Each distinct value with its ranks, in the order of its first rank.
  std::vector<std::pair<std::string, std::vector<int>>> values;
  std::map<std::string, size_t> place;
  for (int r = 0; r < static_cast<int>(shown.size()); ++r) {
    if (!shown[r]) continue;
    const auto [it, added] = place.try_emplace(*shown[r], values.size());
    if (added) values.push_back({*shown[r], {}});
    values[it->second].second.push_back(r);
  }
  if (values.empty()) return "";
  std::string out;
  for (size_t v = 0; v < values.size() && v < kMostGroups; ++v) {
    out += (v ? ", " : "") + variable + "=" + values[v].first + " on " + RankSet(values[v].second);
  }
  if (values.size() > kMostGroups) {
    size_t more_ranks = 0;
    for (size_t v = kMostGroups; v < values.size(); ++v) more_ranks += values[v].second.size();
    out += ", and " + std::to_string(values.size() - kMostGroups) + " more values on " +
           std::to_string(more_ranks) + " more ranks";
  }
  return out + " (of " + std::to_string(shown.size()) + "): " + accepted;
}

std::string ExplainDesync(int rank, const std::vector<CollectiveFingerprint>& all) {
  // Group ranks by what they run: "ranks 0, 2 run #7 all_reduce(...); rank 1 runs #7 broadcast(...)".
  std::map<std::pair<uint64_t, uint64_t>, std::vector<int>> groups;
  std::map<std::pair<uint64_t, uint64_t>, const std::string*> texts;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    const auto key = std::make_pair(all[r].sequence, all[r].hash);
    groups[key].push_back(r);
    texts[key] = &all[r].text;
  }
  std::string message = "collective desync detected (DDP_DEBUG=detail) on rank " + std::to_string(rank) + ": ";
  size_t shown = 0;
  std::vector<int> rest;
  for (const auto& [key, ranks] : groups) {
    if (shown == kMostGroups) {
      rest.insert(rest.end(), ranks.begin(), ranks.end());
      continue;
    }
    message += (shown++ ? "; " : "") + RankSet(ranks) + (ranks.size() == 1 ? " runs collective #" : " run collective #") +
               std::to_string(key.first) + " " + *texts[key];
  }
  if (!rest.empty()) {
    std::sort(rest.begin(), rest.end());
    message += "; and " + std::to_string(groups.size() - kMostGroups) + " more groups: " + RankSet(rest);
  }
  return message;
}

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
  std::vector<CollectiveFingerprint> views(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    all[r].text[sizeof(all[r].text) - 1] = '\0';
    views[r] = {all[r].sequence, all[r].hash, all[r].text};
  }
  return transport::InvalidArgumentError(ExplainDesync(rank, views));
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
  std::vector<std::optional<std::string>> debug_values(all.size()), thread_values(all.size());
  std::vector<int> on;
  for (size_t r = 0; r < all.size(); ++r) {
    ModeRecord& got = all[r];
    if (got.state == kModeBadValue) {
      got.value[sizeof(got.value) - 1] = '\0';
      debug_values[r] = Quote(got.value, got.cut != 0);
    }
    if (got.thread_bad != 0) {
      got.thread_value[sizeof(got.thread_value) - 1] = '\0';
      thread_values[r] = Quote(got.thread_value, got.thread_cut != 0);
    }
    if (got.state == kModeDetail) on.push_back(static_cast<int>(r));
  }
  const std::string bad_debug = DescribeBadValues("DDP_DEBUG", debug_values, kDebugAccepted);
  const std::string bad_thread = DescribeBadValues("DDP_COLLECTIVE_THREAD", thread_values, kCollectiveThreadAccepted);
  if (!bad_debug.empty() || !bad_thread.empty()) {
    std::string message;
    if (!bad_debug.empty()) message = bad_debug + "; ";
    if (!bad_thread.empty()) message += bad_thread + "; ";
    throw std::invalid_argument(message + "every rank of the group stops");
  }
  if (on.empty() || on.size() == all.size()) return transport::Status::Ok();
  return transport::InvalidArgumentError(
      "DDP_DEBUG=detail (ProcessGroupOptions::debug_detail) is on in " + RankSet(on) + " of " +
      std::to_string(comm.size()) +
      " and off in the others: the fingerprint check is itself a collective, so every rank "
      "must have it, or none");
}

}  // namespace ddp::dist
