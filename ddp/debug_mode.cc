#include "ddp/debug_mode.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
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

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

DebugLevel DebugLevelFromEnvironment() {
  const char* raw = std::getenv("DDP_DEBUG");
  if (raw == nullptr) return DebugLevel::kOff;
  std::string value(raw);
  std::transform(value.begin(), value.end(), value.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (value.empty() || value == "off") return DebugLevel::kOff;
  if (value == "info") return DebugLevel::kInfo;
  if (value == "detail") return DebugLevel::kDetail;
  throw std::invalid_argument("DDP_DEBUG=" + std::string(raw) + ": expected off, info or detail");
}

transport::Status CheckFingerprints(transport::Communicator& comm, int rank, int size,
                                    uint64_t sequence, const std::string& description,
                                    transport::Deadline deadline) {
  Fingerprint mine{};
  mine.sequence = sequence;
  mine.hash = Fnv1a(description);
  std::strncpy(mine.text, description.c_str(), sizeof(mine.text) - 1);
  std::vector<Fingerprint> all(size);
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - transport::Clock::now());
  transport::Status s =
      comm.AllGather(&mine, all.data(), sizeof(Fingerprint), transport::DataType::kU8,
                     {.timeout = std::max(timeout, std::chrono::milliseconds(1))});
  if (!s.ok()) return s;
  bool agree = true;
  for (const Fingerprint& f : all) agree = agree && f.sequence == mine.sequence && f.hash == mine.hash;
  if (agree) return transport::Status::Ok();
  // Group ranks by what they run: "ranks 0, 2 run #7 all_reduce(...); rank 1 runs #7 broadcast(...)".
  std::map<std::pair<uint64_t, uint64_t>, std::vector<int>> groups;
  std::map<std::pair<uint64_t, uint64_t>, std::string> texts;
  for (int r = 0; r < size; ++r) {
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
                                       transport::Deadline deadline) {
  const uint8_t mine = detail ? 1 : 0;
  std::vector<uint8_t> all(comm.size());
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - transport::Clock::now());
  transport::Status s = comm.AllGather(&mine, all.data(), 1, transport::DataType::kU8,
                                       {.timeout = std::max(timeout, std::chrono::milliseconds(1))});
  if (!s.ok()) return s;
  std::string on;
  int count = 0;
  for (int r = 0; r < comm.size(); ++r) {
    if (all[r] == 0) continue;
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
