#ifndef DDP_DDP_DEBUG_MODE_H_
#define DDP_DDP_DEBUG_MODE_H_

// DDP_DEBUG: how much checking and logging //ddp does (PyTorch's
// TORCH_DISTRIBUTED_DEBUG levels). Private to //ddp.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "transport/communicator.h"

namespace ddp::dist {

enum class DebugLevel : int {
  kOff = 0,     ///< Unset, "off": no extra work.
  kInfo = 1,    ///< "info": DDP logs its bucket layout and runtime statistics.
  kDetail = 2,  ///< "detail": also the cross-rank fingerprint before every collective.
};

/// DDP_DEBUG as this process sees it, read without throwing: `level` when
/// the value is accepted (unset, empty, off, info or detail, in any case),
/// else `bad_value` holds the value as set and `level` is kOff.
struct DebugSetting {
  DebugLevel level = DebugLevel::kOff;
  std::optional<std::string> bad_value;
};
/// A group reads it when it is made; past that, use the level the group
/// read (ProcessGroup::debug_level) rather than the environment, which may
/// have changed since, on some ranks only.
DebugSetting DebugSettingFromEnvironment();

/// `value` in double quotes, with `"`, `\\`, control characters and bytes
/// past ASCII escaped (`"detail\r"`), so that a refused environment value
/// shows exactly what was set; a value with whitespace around it gets a
/// hint that it is not trimmed.
std::string QuotedEnvValue(const std::string& value);

/// "rank 5", "ranks 0-3, 7": `ranks` (ascending) with consecutive ranks as
/// ranges; past `most_ranges` ranges, "..." and how many ranks were left
/// out. What the messages that name ranks use, so that their size does not
/// grow with the group's.
std::string RankSet(const std::vector<int>& ranks, size_t most_ranges = 16);

/// CheckDebugModeAgrees' refusal for one variable: each distinct value of
/// `shown` once, with the ranks that had it (`shown[r]` is rank r's value
/// as the message shows it, nullopt where the value was fine), at most 8
/// values and then how many more; "" when no rank had a bad value.
/// `accepted`: what the variable accepts.
std::string DescribeBadValues(const std::string& variable, const std::vector<std::optional<std::string>>& shown,
                              const char* accepted);

/// One rank's fingerprint of a collective, as CheckFingerprints compares it.
struct CollectiveFingerprint {
  uint64_t sequence = 0;
  uint64_t hash = 0;     ///< of the whole description
  std::string text;      ///< the description, as short as the exchange carries it
};

/// CheckFingerprints' message for ranks that disagree (`all[r]` is rank
/// r's): ranks grouped by (sequence, hash) in that order, at most 8 groups
/// and then how many more (and their ranks), each group's ranks as
/// RankSet ranges. Bounded whatever the group's size.
std::string ExplainDesync(int rank, const std::vector<CollectiveFingerprint>& all);

/// What DDP_DEBUG and DDP_COLLECTIVE_THREAD accept, for messages refusing
/// another value.
inline constexpr char kDebugAccepted[] = "expected off, info or detail";
inline constexpr char kCollectiveThreadAccepted[] = "expected auto, comm or caller";

/// Collective: every rank passes its `sequence`-th collective's
/// `description`; OK when all agree, else INVALID_ARGUMENT saying what each
/// rank runs. Uses one fixed-size all-gather, so it cannot itself desync.
/// The whole description is compared; the message shows one longer than
/// 239 bytes as its start, "..." and its last 96 bytes (dtype and shape).
/// `rank` and `size` must be comm.rank() and comm.size(): when they are not,
/// this rank still takes its part in the all-gather (so no other rank is
/// left waiting) and then returns INVALID_ARGUMENT.
transport::Status CheckFingerprints(transport::Communicator& comm, int rank, int size,
                                    uint64_t sequence, const std::string& description,
                                    transport::Deadline deadline);

/// Collective, when a group is made. Every rank passes whether it has the
/// fingerprint check on (`detail`) and the environment values it could not
/// accept: its DDP_DEBUG (`bad_debug_value`, from DebugSetting) and its
/// DDP_COLLECTIVE_THREAD (`bad_collective_thread`), each empty when fine.
/// Throws std::invalid_argument on every rank, after the exchange, when any
/// rank had a bad value: the message names the variable and each bad value,
/// quoted (QuotedEnvValue; one longer than 61 bytes is cut and ends in
/// "..."), with the ranks that had it (DescribeBadValues). Otherwise OK when every rank has the check on, or every rank
/// off; else INVALID_ARGUMENT naming the ranks with it on, as RankSet ranges (a rank that
/// checks runs an all-gather before each collective that the others do not,
/// which pairs with their collectives). A failed exchange returns its
/// status. Ranks may differ in valid DDP_COLLECTIVE_THREAD values: which
/// thread runs a rank's collectives changes nothing its peers see.
transport::Status CheckDebugModeAgrees(transport::Communicator& comm, bool detail,
                                       const std::optional<std::string>& bad_debug_value,
                                       const std::optional<std::string>& bad_collective_thread,
                                       transport::Deadline deadline);

}  // namespace ddp::dist

#endif  // DDP_DDP_DEBUG_MODE_H_
