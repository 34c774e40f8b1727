#include "transport/communicator.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <shared_mutex>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

#include "transport/algorithms/collective.h"
#include "transport/algorithms/exchange.h"
#include "transport/algorithms/gather_scatter.h"
#include "transport/algorithms/hierarchical_all_reduce.h"
#include "transport/algorithms/rooted_reduce.h"
#include "transport/collectives.h"
#include "transport/cuda/device_staging.h"
#include "transport/cuda/ipc_collectives.h"
#include "transport/cuda/staging_pipeline.h"
#include "transport/env_value.h"
#include "transport/fault/peer_monitor.h"
#include "transport/fault/process.h"
#include "transport/fork/fork_guard.h"
#include "transport/launch/env.h"
#include "transport/p2p/group_view.h"
#include "transport/reduce/reduce.h"
#include "transport/shm/shm_allreduce.h"
#include "transport/store/tcp_store.h"
#include "transport/topology/cpus.h"
#include "transport/topology/discover.h"
#include "transport/topology/topology.h"
#include "transport/ucx/resources.h"
#include "transport/ucx/ucx_p2p.h"
#include "transport/watchful_store.h"

namespace ddp::transport {
namespace {

using std::chrono::milliseconds;

// How long a rank that lost a connection looks for the failure's real cause
// (see LocalCause), and how often.
constexpr milliseconds kEchoGrace{100};
constexpr milliseconds kEchoPoll{10};
// How long a point-to-point message waits before its first health check
// (the peer's process and the job's abort key), then between checks.
constexpr milliseconds kP2pWatchdogAfter{10};
constexpr milliseconds kP2pWatchdogPeriod{100};
// How long one poll of a point-to-point request waits for the worker while
// another thread's call holds it.
constexpr milliseconds kP2pPollHold{5};
// How long past its deadline a blocking Send/Recv waits for the worker that
// another thread's collective holds, to settle its request, and then (the
// cancel handed to that thread) for the cancel to be done.
constexpr milliseconds kBlockingP2pAllowance{250};
// How long past its deadline a queued async call may take to end (failing
// there aborts, and the abort is posted in the background; a wait notices
// its deadline at its next watchdog tick, about every 100 ms).
constexpr milliseconds kQueuedCallAllowance{1000};
// After an abort, how long the rank serving the store keeps it for the
// ranks that have not left: first for all of them, then, up to the longer
// time, only while some rank that has not left may still come for the
// reason (not seen exited, or stopped for kStoppedPeerTime, on this
// host; on another host, its UCX connection unbroken). A rank busy
// elsewhere at the abort reads the reason there when it next calls; a
// rank that died never leaves, and where nothing says so (another host,
// in a communicator this rank has no connection to) it holds the store up
// to the end.
constexpr milliseconds kAbortedStoreTime{1000};
constexpr milliseconds kAbortedStoreTimeForLatePeers{3000};
// How far past its deadline (min(timeout, 30 s)) a communicator's
// destruction may run to close what it holds: its marks in the store, the
// count of the ranks not left and the endpoints' close share it. Each step
// had a bound of its own on top of the deadline (1 s, 2 s, 2 s, 1 s), so a
// store or peer that sat stopped held a 1.5 s destruction for 3 s or more.
constexpr milliseconds kShutdownCloseAllowance{200};
// What this rank's mark of leaving and its count among the ranks that left
// each get at least, past kShutdownCloseAllowance where the steps before
// used it up: without them the rank serving the store waits for this one.
constexpr milliseconds kLeaveMarkTime{200};
// A rank on this host seen stopped (SIGSTOP, SIGTSTP, a debugger) at every
// look for this long counts, after an abort, as one that will not come for
// the reason in time: it reads nothing while stopped, and held the store up
// to kAbortedStoreTimeForLatePeers. Shorter stops (a sampling profiler's)
// never add up to it; a rank that merely runs slowly is never stopped.
constexpr milliseconds kStoppedPeerTime{500};
// Most bytes of rank 0's reason for a failed registration of a split's
// communicators that it passes on to the other ranks.
constexpr int64_t kMostSplitReasonBytes = 4096;
// Beyond a split's whole timeout, how long the ranks wait for rank 0 to
// share whether it registered the new communicators: the registration's
// store calls keep to their deadline, give or take a scheduling delay.
constexpr milliseconds kSplitOutcomeGrace{1000};

// The most ranks a job may have: UCX messages carry the sender's rank in
// the tag bits above the algorithms' (UcxPointToPoint refuses more). Checked
// at the start of creation: found only at the connection step, a larger
// world_size waited out the whole timeout for ranks that cannot exist, and
// one near INT_MAX first allocated gigabytes per rank index.
constexpr int kMostRanks = 1 << (64 - p2p::kTagBits - 2);

// The longest communicator name (CheckStoreOptions): every store key is the
// name and a part of its own, the longest "/shm-host<rank>/segment/mapped/
// <rank>" at under 48 bytes.
constexpr size_t kMostNameBytes = store::kMaxKeyBytes - 64;
// The longest name Create takes: 64 bytes fewer, left for what the keys'
// name gains later, "#<n>" for a name made again and "/split<n>/<color>"
// per Split (a 955-byte name was taken, then every Split failed naming a
// length the user never passed).
constexpr size_t kMostCreateNameBytes = kMostNameBytes - 64;

// At most `most` bytes of `text`, cut between UTF-8 characters: a
// character the cut would split goes whole (at most 3 bytes back; text that
// is not UTF-8 is cut where it falls). Quoted in messages that reach logs
// and JSON error files, which must be UTF-8.
std::string Utf8Prefix(const std::string& text, size_t most) {
  if (text.size() <= most) return text;
  size_t keep = most;
  for (int back = 0; back < 3 && keep > 0 && (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80; ++back) {
    --keep;
  }
  return text.substr(0, keep);
}

// Staging slot per chunk of a device-buffer collective. Two slots are
// pinned per device in use. Large enough that a chunk's host collective
// runs at full speed, small enough that copying the first chunk in and the
// last one out (not overlapped) costs little.
constexpr size_t kDefaultDeviceChunkBytes = size_t{4} << 20;

// Bounds of the shared-memory tuning variables. Staging: ShmAllReduce
// refuses more (its segment holds twice this per rank). Chunk: one buffer of
// this size per rank; more than 1 GiB per CMA read gains nothing. Spin: a
// minute keeps the microseconds far from overflowing a clock duration.
constexpr uint64_t kMostShmStagingBytes = uint64_t{1} << 30;
constexpr uint64_t kMostShmChunkBytes = uint64_t{1} << 30;
constexpr uint64_t kMostShmSpinUs = 60'000'000;

// A parsed environment value as the settings compared between ranks show
// it: "" when unset, so that "1M" and "1048576" agree.
std::string OptionalText(const std::optional<uint64_t>& value) {
  return value ? std::to_string(*value) : "";
}

StatusOr<Algorithm> ParseAlgorithm(const std::string& text, const char* origin) {
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree, Algorithm::kRhd,
                      Algorithm::kHierarchical, Algorithm::kSharedMemory}) {
    if (text == AlgorithmName(a)) return a;
  }
  return InvalidArgumentError(std::string(origin) + "=" + text +
                              ": expected auto, ring, tree, rhd, hierarchical or shm");
}

// DDP_STAGED_REDUCE's value; "" leaves the option's choice.
StatusOr<StagedReduce> ParseStagedReduce(const std::string& text) {
  if (text == "device") return StagedReduce::kDevice;
  if (text == "host") return StagedReduce::kHost;
  return InvalidArgumentError("DDP_STAGED_REDUCE=" + text + ": expected device or host");
}

// The options this rank needs to meet the others at the store: the job's
// size (which every wait there counts ranks by), the name of the keys and
// the store's port. A bad one is refused before the store is reached (and
// before Create counts the name: InstanceKeyName); any other bad option is
// reported to the others through the store (Init).
Status CheckStoreOptions(const CommunicatorOptions& o) {
  if (o.world_size < 1) return InvalidArgumentError("world_size " + std::to_string(o.world_size) + " must be positive");
  if (o.world_size > kMostRanks) {
    return InvalidArgumentError("world_size " + std::to_string(o.world_size) + " is above " +
                                std::to_string(kMostRanks) + ", the most ranks a job may have");
  }
  // Split registrations in the store are one line per communicator, named
  // by its key prefix (FormatSplitRegistration): a name holding a newline
  // cut its line in two, the serving rank skipped it as malformed, and the
  // store could stop under that split's ranks.
  if (const size_t at = o.name.find('\n'); at != std::string::npos) {
    return InvalidArgumentError("name \"" + o.name.substr(0, at) + "\\n...\" holds a newline, which communicator "
                                "names may not");
  }
  // Every store key starts with the name, and the store takes keys of up
  // to store::kMaxKeyBytes (a split's name adds "/split<n>/<color>" per
  // level). A longer name failed at the first store call, with a key too
  // long that did not say why.
  if (o.name.size() > kMostNameBytes) {
    return InvalidArgumentError("name of " + std::to_string(o.name.size()) + " bytes is longer than " +
                                std::to_string(kMostNameBytes) + ", the most a communicator's name may have (\"" +
                                Utf8Prefix(o.name, 32) + "...\")");
  }
  // One rank that serves its own store needs no agreed port (as an MPI
  // program of one process needs no setup): 0 takes any free one.
  const bool any_port = o.world_size == 1 && o.host_store && o.store_port == 0;
  if (!any_port && (o.store_port < 1 || o.store_port > 65535)) {
    return InvalidArgumentError(
        "store_port " + std::to_string(o.store_port) + " is not a TCP port" +
        (o.store_port == 0 ? " (0, any free port, is only for a one-rank job that serves its store)"
                           : ""));
  }
  return Status::Ok();
}

// What decides the ring order and the hosts the algorithm choice sees, as
// a setting every rank must share: "discovered" (the exchanged topology,
// the same on every rank) or "described:" and a digest (FNV-1a) of the
// description as parsed, so that the same description at another path or
// spaced otherwise is the same setting.
std::string TopologySource(const std::optional<topology::Topology>& described) {
  if (!described) return "discovered";
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : topology::TopologyToJson(*described)) h = (h ^ c) * 1099511628211ull;
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return std::string("described:") + hex;
}

bool ValidDataType(DataType d) {
  return static_cast<int>(d) >= 0 && static_cast<int>(d) <= static_cast<int>(DataType::kU8);
}
bool ValidOp(ReduceOp op) {
  return static_cast<int>(op) >= 0 && static_cast<int>(op) <= static_cast<int>(ReduceOp::kProd);
}

// The CPUs this thread could use before BindToCore pinned it to one (0:
// not pinned here). The pin narrows the thread's own mask only: a
// communicator made on it later (a Split, a second Create) has the
// process's CPUs as the first did, and counted 1 instead, yielding where
// it could spin.
thread_local int cpus_before_pinning = 0;

// Pins the calling thread to the `index`-th CPU (modulo) it may run on; a
// mask it cannot read or set leaves it unbound (binding is a hint).
void BindToCore(int index) {
  if (cpus_before_pinning == 0) cpus_before_pinning = topology::UsableCpus();
  static_cast<void>(topology::BindToAllowedCpu(index));
}

// Whether process `pid` of this host is stopped: by a signal (state T) or
// by a tracer (t). False when gone: the monitor tells that apart.
bool ProcessStopped(int pid) {
  const char state = fault::ProcessState(pid);
  return state == 'T' || state == 't';
}

// Whether process `pid` of this host has exited: no such process, or a
// zombie (exited, not yet reaped by its parent, its launcher), or, given
// `start_time` (its ProcessStartTime when it was noted; 0 unknown), another
// process that took its pid since. Asked with kill(pid, 0) and readlink,
// which need no descriptor: reading /proc's stat file did, and a process
// out of descriptors counted every member as gone.
bool ProcessExited(int pid, uint64_t start_time) { return fault::ProcessGoneNow(pid, start_time); }

// The start times (ProcessStartTime; 0: not on this host, or unreadable)
// of the processes `pids` (0: not on this host), read while they run, so
// that a pid taken later by another process is not taken for the member.
std::vector<uint64_t> StartTimes(const std::vector<int>& pids) {
  std::vector<uint64_t> starts(pids.size(), 0);
  for (size_t r = 0; r < pids.size(); ++r) {
    if (pids[r] > 0) starts[r] = fault::ProcessStartTime(pids[r]);
  }
  return starts;
}

}  // namespace

namespace internal {

uint64_t ClaimNonce(const std::string& entropy_source) {
  try {
    std::random_device entropy(entropy_source);
    return (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
  } catch (const std::exception&) {
    // No entropy source (getrandom refused and no /dev/urandom, as in a
    // bare chroot): thrown out of Create, this left the other ranks
    // waiting out their timeout. The pid, the process's address space
    // layout and two clocks tell this process from another as well.
    static const int here = 0;
    uint64_t mix = static_cast<uint64_t>(getpid()) << 32;
    mix ^= static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&here));
    mix ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ULL;
    mix ^= static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
    return mix;
  }
}

}  // namespace internal

namespace {

// This process as a rank's claimant in the store (Init): a number drawn
// once per process, so that a creation this process tries again finds its
// own claim, then its pid and host for the message that names a second
// claimant.
const std::string& ClaimantName() {
  static const std::string* name = [] {
    const uint64_t nonce = internal::ClaimNonce("default");
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "?");
    return new std::string(std::to_string(nonce) + " pid " + std::to_string(getpid()) + " on host " + host);
  }();
  return *name;
}

// CPUs this process may keep busy (its affinity mask, capped by a cgroup
// CPU quota): what "oversubscribed" is measured against. On a thread that
// BindToCore pinned, the count from before the pin.
int AvailableCpus() { return cpus_before_pinning > 0 ? cpus_before_pinning : topology::UsableCpus(); }

// The rendezvous store this rank serves (host_store on rank 0), shared with
// the communicators split off here. `users` are the key prefixes and rank
// counts of every communicator using it, on any rank: the last holder
// here keeps it up until their ranks have left.
struct ServedStore {
  // Stopped with `closing_reason`, which its clients read instead of a bare
  // lost connection (set by the last holder's Shutdown; a communicator
  // sharing the store after that overwrites it with its own).
  ~ServedStore() {
    if (server != nullptr) server->Stop(closing_reason, closing_clean);
  }
  std::unique_ptr<store::TcpStoreServer> server;
  std::string job_token;
  std::mutex mu;
  std::string closing_reason;  // under mu
  // Whether closing_reason is the clean end of the job, which the clients'
  // peer monitors take as no lost server (under mu).
  bool closing_clean = false;
  std::vector<std::pair<std::string, int>> users;  // under mu
  // Communicators of this process holding it now (a rank's and its splits'),
  // under mu: the one that takes it to 0 is the last and waits for every
  // user. use_count() read without a lock let a parent and its split, going
  // away on two threads, each see the other's reference and neither wait.
  int holders = 0;
  // Key prefixes of the communicators that started or shared it as rank 0,
  // under which splits made without this process register; under mu.
  std::vector<std::string> roots;
  // Key prefixes (of `users`) of the communicators of this process whose
  // leaving found every rank left or gone, or waited for them until its
  // deadline (see Shutdown): the last holder does not wait for their ranks
  // again; under mu. Counting their "left"
  // marks alone, it waited out its whole deadline (up to 30 s) for a rank
  // that had died, which the communicator's own leaving had seen.
  std::set<std::string> settled;
  // Per key prefix (of `users`): the pid of each of its ranks on this host,
  // by that communicator's rank (0: on another host), as the communicator
  // that noted it learned them, or as a split registered in the store
  // (made without this process) listed them. The last holder tells with it a rank that died from one still
  // to come, in communicators it is not a member of; under mu.
  std::map<std::string, std::vector<int>> member_pids;
  // Per key prefix of member_pids: each pid's process start time as read
  // when the pids were noted (StartTimes), so that a member that died is
  // not taken for alive because another process has its pid now. Read late
  // for splits registered in the store (when the last holder reads them):
  // a pid taken before then still looks alive. Under mu.
  std::map<std::string, std::vector<uint64_t>> member_starts;
  // Per key prefix (of `users`) of a split, made in this process or
  // registered in the store: the key prefix of its family's first
  // communicator (Create's; a `roots` entry), and each of its ranks' rank
  // there, in its rank order. Whichever communicator of that family is the
  // last holder, a member on another host (its pid, above, is 0) whose UCX
  // connection to the last holder broke counts as gone, however deep the
  // split; under mu.
  std::map<std::string, std::pair<std::string, std::vector<int>>> member_root_ranks;
};

// A split as its rank 0 registers it in the store (RegisterSplit), one
// line: "<key prefix> <ranks> <pids> <root ranks>\n". <pids>: "-", or
// "<rank>=<pid>" for each rank on the serving process's host, joined by
// commas; <root ranks>: each rank's rank in the family's first
// communicator, in its rank order, joined by commas. The prefix is a
// communicator's name, which may hold spaces; the other fields hold none.
struct SplitRegistration {
  std::string prefix;
  int ranks = 0;
  std::vector<int> pids;        // by rank; 0: not on the serving process's host
  std::vector<int> root_ranks;  // by rank
};

// Where a family's split registrations live, under its first
// communicator's key prefix `root`: "<root>splits/count", added to once per
// registration, numbers them from 1, and registration n is the key
// "<root>splits/<n>". One key each keeps every store call as small as one
// Split's lines: a single key rewritten whole (CompareSet of all the
// history, sent twice) grew by every registration, so that the bytes moved
// grew with their square and, once it held about 2 MiB, every Split that
// registers was refused for its size.
std::string SplitRegistryKey(const std::string& root, int64_t n) {
  return root + "splits/" + (n > 0 ? std::to_string(n) : std::string("count"));
}

// How far the last holder of the store has read one family's registrations
// (ReadRegisteredSplits): the next number not yet looked at, and those
// counted but not found when looked at (a registration whose Set had not
// arrived, or never will: its Split failed), looked at again each time.
struct SplitRegistryRead {
  int64_t next = 1;
  std::vector<int64_t> missing;
};

std::string FormatSplitRegistration(const SplitRegistration& split) {
  std::string pids;
  for (size_t r = 0; r < split.pids.size(); ++r) {
    if (split.pids[r] <= 0) continue;
    pids += (pids.empty() ? "" : ",") + std::to_string(r) + "=" + std::to_string(split.pids[r]);
  }
  std::string roots;
  for (int root : split.root_ranks) roots += (roots.empty() ? "" : ",") + std::to_string(root);
  return split.prefix + " " + std::to_string(split.ranks) + " " + (pids.empty() ? "-" : pids) + " " + roots + "\n";
}

// A whole decimal number in [least, most], or nothing.
std::optional<int> ParseBoundedInt(std::string_view text, int least, int most) {
  if (text.empty() || text.size() > 10) return std::nullopt;
  int64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + (c - '0');
  }
  if (value < least || value > most) return std::nullopt;
  return static_cast<int>(value);
}

// One line of FormatSplitRegistration's, without its newline; what is
// wrong with it otherwise.
StatusOr<SplitRegistration> ParseSplitRegistration(std::string_view line) {
  constexpr int kMostInt = std::numeric_limits<int>::max();
  const size_t roots_at = line.rfind(' ');
  const size_t pids_at = roots_at == std::string_view::npos || roots_at == 0 ? std::string_view::npos
                                                                             : line.rfind(' ', roots_at - 1);
  const size_t ranks_at = pids_at == std::string_view::npos || pids_at == 0 ? std::string_view::npos
                                                                           : line.rfind(' ', pids_at - 1);
  if (ranks_at == std::string_view::npos || ranks_at == 0) {
    return InvalidArgumentError("not \"<key prefix> <ranks> <pids> <root ranks>\"");
  }
  SplitRegistration split;
  split.prefix = std::string(line.substr(0, ranks_at));
  const std::optional<int> ranks = ParseBoundedInt(line.substr(ranks_at + 1, pids_at - ranks_at - 1), 1, kMostInt);
  if (!ranks) return InvalidArgumentError("its rank count is not a positive number");
  split.ranks = *ranks;
  split.pids.assign(static_cast<size_t>(split.ranks), 0);
  const std::string_view pids = line.substr(pids_at + 1, roots_at - pids_at - 1);
  for (size_t from = 0; pids != "-" && from <= pids.size();) {
    const size_t comma = std::min(pids.find(',', from), pids.size());
    const std::string_view entry = pids.substr(from, comma - from);
    const size_t eq = entry.find('=');
    const bool paired = eq != std::string_view::npos;
    const std::optional<int> r = paired ? ParseBoundedInt(entry.substr(0, eq), 0, split.ranks - 1) : std::nullopt;
    const std::optional<int> pid = paired ? ParseBoundedInt(entry.substr(eq + 1), 1, kMostInt) : std::nullopt;
    if (!r || !pid) {
      return InvalidArgumentError("pid entry \"" + std::string(entry) + "\" is not <rank>=<pid> with a rank below " +
                                  std::to_string(split.ranks));
    }
    split.pids[static_cast<size_t>(*r)] = *pid;
    from = comma + 1;
  }
  const std::string_view roots = line.substr(roots_at + 1);
  for (size_t from = 0; from <= roots.size();) {
    const size_t comma = std::min(roots.find(',', from), roots.size());
    const std::optional<int> root = ParseBoundedInt(roots.substr(from, comma - from), 0, kMostInt);
    if (!root) {
      return InvalidArgumentError("root rank list \"" + std::string(roots) + "\" is not numbers joined by commas");
    }
    split.root_ranks.push_back(*root);
    from = comma + 1;
  }
  if (split.root_ranks.size() != static_cast<size_t>(split.ranks)) {
    return InvalidArgumentError("it lists " + std::to_string(split.root_ranks.size()) + " root ranks for " +
                                std::to_string(split.ranks) + " ranks");
  }
  return split;
}

// The stores this process serves, by "host:port": a communicator made again
// on rank 0's store while a split of the previous one still holds that
// server (it stays up for the split) shares it, where starting another on
// the same port would fail ("address in use") and leave the other ranks,
// connected to the live one, waiting out their deadline.
std::shared_ptr<ServedStore> ServedStoreFor(const std::string& endpoint, const std::string& token,
                                            const std::function<StatusOr<std::shared_ptr<ServedStore>>()>& start,
                                            Status& error) {
  static std::mutex mu;
  static auto* served = new std::map<std::string, std::weak_ptr<ServedStore>>();
  std::lock_guard lock(mu);
  // Port 0 (any free port) names no particular server.
  const bool any_port = endpoint.ends_with(":0");
  if (std::shared_ptr<ServedStore> live = any_port ? nullptr : (*served)[endpoint].lock()) {
    if (live->job_token == token) return live;
    error = FailedPreconditionError("this process already serves a store on " + endpoint +
                                    " for another job token (DDP_JOB_TOKEN differs)");
    return nullptr;
  }
  StatusOr<std::shared_ptr<ServedStore>> started = start();
  if (!started.ok()) {
    error = started.status();
    return nullptr;
  }
  if (!any_port) (*served)[endpoint] = *started;
  return *started;
}

}  // namespace

namespace internal {
namespace {
// Run by Shutdown just before it closes the poll gate; tests only.
std::function<void()>& BeforePollGateCloses() {
  static auto* hook = new std::function<void()>();
  return *hook;
}
// Run by a failed creation after it posted its reason, before it leaves;
// tests only.
std::function<void()>& AfterCreationFailurePosted() {
  static auto* hook = new std::function<void()>();
  return *hook;
}
// Run by Split just before it creates the new communicator; tests only.
std::function<void()>& BeforeSplitCreates() {
  static auto* hook = new std::function<void()>();
  return *hook;
}
}  // namespace
// For tests (declared where used): lets a test hold a rank between a
// split's exchange and the new communicator's creation.
void SetBeforeSplitCreatesForTesting(std::function<void()> hook) {
  BeforeSplitCreates() = std::move(hook);
}
// For tests (declared where used): lets a test hold a failed creation
// between its reason's post and its marks of leaving, as a slow store would.
void SetAfterCreationFailurePostedForTesting(std::function<void()> hook) {
  AfterCreationFailurePosted() = std::move(hook);
}
// For tests (declared where used): lets a test poll a handle at the moment
// Shutdown has joined its threads and not yet closed the poll gate.
void SetBeforePollGateClosesForTesting(std::function<void()> hook) {
  BeforePollGateCloses() = std::move(hook);
}
}  // namespace internal

// ---------------------------------------------------------------- Work ----

namespace {
// The communicator whose call this thread is running with its run_mu_ held
// (a collective's body, which may run user code: AllReduceThrough's slice
// function): a receive handle dropped there is cancelled without locking
// run_mu_ again, and a wait there for that communicator's calls is refused.
thread_local const void* running_under_run_mu = nullptr;

// Marks the calling thread as holding `impl`'s run_mu_ for its scope.
class RunningUnderRunMu {
 public:
  explicit RunningUnderRunMu(const void* impl) : previous_(running_under_run_mu) {
    running_under_run_mu = impl;
  }
  ~RunningUnderRunMu() { running_under_run_mu = previous_; }
  RunningUnderRunMu(const RunningUnderRunMu&) = delete;
  RunningUnderRunMu& operator=(const RunningUnderRunMu&) = delete;

 private:
  const void* previous_;
};
}  // namespace

struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  // Point-to-point calls are not queued: their request is posted at once
  // and whoever waits drives it by calling poll (which calls Finish when the
  // request completes). Collectives leave it empty; the communicator's
  // thread finishes them.
  std::function<void()> poll;
  // A point-to-point receive's: cancels its request when the last handle
  // goes while the call is unfinished (see PostP2p). Set before the state
  // is shared, never changed.
  std::function<void()> release_unfinished;
  // The call, for Wait's timeout ("all-reduce", "receive from rank 1 (tag
  // 7, 32 bytes)"). Set before the state is shared, never changed.
  std::string what;
  // The communicator's Impl whose run_mu_ the call needs (null for a
  // handle finished at creation). Set before the state is shared, never
  // changed.
  const void* owner = nullptr;
  // A point-to-point call's poll found it failed and released its request
  // (set under the communicator's run_mu_, before that is let go): it
  // finishes the call once it has aborted the communicator, and other
  // polls, on copies of the handle, leave the released request alone until
  // then (testing it aborted the communicator first, with "request id N
  // unknown or released" for the reason).
  std::atomic<bool> failing{false};

  ~State() {
    // No lock: nobody else holds this state any more.
    if (!done && release_unfinished) release_unfinished();
  }

  void Finish(Status s) {
    {
      std::lock_guard lock(mu);
      if (done) return;
      status = std::move(s);
      done = true;
      poll = nullptr;
    }
    cv.notify_all();
  }
};

Status Work::Wait() {
  if (state_ == nullptr) return FailedPreconditionError("Wait on an empty Work handle");
  // Bounded: every call gives up at its own deadline.
  return Wait(Clock::time_point::max());
}

namespace {
// A handle used in a forked child: neither the communicator's thread nor
// its UCX worker exist there, so an unfinished call never finishes. The
// state's mutex is only tried: a parent thread may have held it at the
// fork (polling or finishing the call), and in the child it stays locked
// for good. A call that had finished before the fork still reports its
// status.
Status InForkedChildStatus(Work::State& state, const char* what) {
  std::unique_lock lock(state.mu, std::try_to_lock);
  if (lock.owns_lock() && state.done) return state.status;
  return fork::CheckNotForkedChild(what);
}
}  // namespace

namespace {
// Work::Wait's timeout, naming the call (the call goes on: its own deadline
// may be later).
Status NotFinishedByWaitDeadline(const Work::State& state) {
  const std::string what = state.what.empty() ? std::string("call") : state.what;
  return TimedOutError("asynchronous " + what + " not finished by the deadline given to Work::Wait "
                       "(the call itself runs on until its own deadline)");
}
}  // namespace

namespace {
// A Wait or Test of an unfinished call, made on a thread inside a call of
// the same communicator (AllReduceThrough's slice function): refused at
// once. A queued collective runs only after the call in flight ends, and a
// point-to-point poll needs the run_mu_ this thread holds (trying to lock
// it again is undefined for std::timed_mutex; in practice each poll failed
// its try and Wait() spun for good). Driving the request from here instead
// would progress UCX and run health checks in the middle of the outer
// collective, while the peers wait for this rank's slice: the call is left
// to go on, and may be waited for once the slice function has returned.
// Call with state.mu held.
Status RefuseWaitInsideOwnersCall(const Work::State& state, const char* waiting) {
  if (state.done || state.owner == nullptr || running_under_run_mu != state.owner) {
    return Status::Ok();
  }
  const std::string what = state.what.empty() ? std::string("call") : state.what;
  return FailedPreconditionError(
      std::string(waiting) + " asynchronous " + what +
      " from inside AllReduceThrough's slice function, which runs inside a call of the same "
      "communicator and holds it: the call cannot finish before the slice function returns "
      "(it goes on; wait for it after the slice function)");
}
}  // namespace

Status Work::Wait(Deadline deadline) {
  if (state_ == nullptr) return FailedPreconditionError("Wait on an empty Work handle");
  if (fork::InForkedChild()) return InForkedChildStatus(*state_, "waiting for an asynchronous call");
  while (true) {
    std::function<void()> poll;
    {
      std::unique_lock lock(state_->mu);
      if (state_->done) return state_->status;
      DDP_RETURN_IF_ERROR(RefuseWaitInsideOwnersCall(*state_, "waiting for"));
      if (!state_->poll) {
        if (!state_->cv.wait_until(lock, deadline, [&] { return state_->done; })) {
          return NotFinishedByWaitDeadline(*state_);
        }
        return state_->status;
      }
      poll = state_->poll;
    }
    if (Clock::now() >= deadline) return NotFinishedByWaitDeadline(*state_);
    poll();
  }
}

StatusOr<bool> Work::Test() {
  if (state_ == nullptr) return FailedPreconditionError("Test on an empty Work handle");
  if (fork::InForkedChild()) {
    const Status status = InForkedChildStatus(*state_, "testing an asynchronous call");
    if (status.ok()) return true;  // finished before the fork
    return status;
  }
  std::function<void()> poll;
  {
    std::lock_guard lock(state_->mu);
    DDP_RETURN_IF_ERROR(RefuseWaitInsideOwnersCall(*state_, "testing"));
    poll = state_->poll;
  }
  if (poll) poll();
  std::lock_guard lock(state_->mu);
  if (!state_->done) return false;
  if (!state_->status.ok()) return state_->status;
  return true;
}

// ---------------------------------------------------------------- Impl ----

class Communicator::Impl {
 public:
  using Body = std::function<Status(Deadline)>;
  // body(deadline), with an exception turned into an INTERNAL status.
  static Status RunGuarded(const Body& body, Deadline deadline);

  explicit Impl(const CommunicatorOptions& options) : options_(options) {}
  ~Impl();

  Status Init();
  Status ReadEnvironment();
  // After a failed Init: posts `status` as the job's abort reason (unless one
  // is posted already), where the others' creation waits see it.
  void PostCreationFailure(const Status& status) {
    creation_failed_ = true;
    failure_store_by_ = DeadlineIn(options_.abort_store_time);
    const Status reason(status.code(), "creating its communicator: " + status.message());
    if (monitor_ != nullptr) {
      Abort(reason, std::nullopt).IgnoreError();
    } else if (store_ != nullptr && !fails_alone_) {
      // Only where no reason is yet, in one call (as PeerMonitor::PostAbort):
      // ranks that fail creation together must not overwrite each other's.
      abort_posted_ = store_->CompareSet(prefix_ + "abort", std::nullopt,
                                         fault::PeerMonitor::EncodeAbort(options_.rank, reason),
                                         *failure_store_by_)
                          .ok();
    }
    // A store that answered within the shared time is slow at worst, not
    // stalled: the marks of leaving then get their floor (Shutdown).
    failure_store_answered_ = Clock::now() < *failure_store_by_;
    if (internal::AfterCreationFailurePosted()) internal::AfterCreationFailurePosted()();
  }

  // This thread is inside a call of this communicator, holding run_mu_:
  // AllReduceThrough's slice function runs there.
  bool InsideCall() const;
  // FAILED_PRECONDITION naming `what` when this thread is inside a call of
  // this communicator: a call made there would wait for the run_mu_ its
  // own thread holds (until its deadline, or for good for Work::Wait() on
  // a queued call). Every rank's slice function refuses alike, so nothing
  // was exchanged and the communicator is not aborted for it.
  Status CheckNotInsideCall(const std::string& what) const;

  // Runs `body` on the caller's thread after earlier async calls finished.
  Status RunBlocking(const CallOptions& call, const Body& body);
  // Queues `body` (the call `what`, for messages) for the communicator's thread.
  Work Enqueue(const CallOptions& call, std::string what, Body body);

  Status AllReduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                   Algorithm requested, Deadline deadline);
  std::vector<std::pair<size_t, size_t>> ThroughPieces(size_t count, DataType dtype) const {
    // No call takes an unknown dtype, and its size of 0 would divide the
    // shared-memory engine's piece below.
    if (!ValidDataType(dtype)) return {};
    const size_t elem = DataTypeSize(dtype);
    const shm::SliceRange mine = shm::SliceOf(count, elem, options_.world_size, options_.rank);
    if (mine.begin == mine.end) return {{mine.begin, 0}};
    const size_t piece = options_.world_size > 1 && Choose(count * elem, Algorithm::kAuto) ==
                                                        Algorithm::kSharedMemory
                             ? shm_->apply_piece_elems(dtype)
                             : mine.end - mine.begin;
    std::vector<std::pair<size_t, size_t>> pieces;
    for (size_t a = mine.begin; a < mine.end; a += piece) {
      pieces.emplace_back(a, std::min(piece, mine.end - a));
    }
    return pieces;
  }
  // Communicator::AllReduceThrough on host buffers.
  Status AllReduceThrough(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                          const SliceFn& apply, Algorithm requested, Deadline deadline);
  // host_memory: `buffer` is host memory (the shared-memory path may take
  // it); device memory goes to UCX.
  Status Broadcast(void* buffer, size_t count, DataType dtype, int root, Deadline deadline,
                   bool host_memory);
  Status AllGather(const void* send, void* recv, size_t count, DataType dtype, Deadline deadline);
  // Checks AllToAllV's arguments (every failure before anything moves);
  // returns the buffers' CUDA device, or -1 for host memory.
  // The dtype is an agreed check; the rest (the counts may differ per rank)
  // are local ones (Refuse), made through `call`.
  StatusOr<int> CheckAllToAll(const void* send, std::span<const size_t> send_counts,
                              const void* recv, std::span<const size_t> recv_counts,
                              DataType dtype, const CallOptions& call);
  StatusOr<int> CheckAllToAllLocal(const void* send, std::span<const size_t> send_counts,
                                   const void* recv, std::span<const size_t> recv_counts,
                                   DataType dtype) const;
  Status AllToAllV(const void* send, const std::vector<size_t>& send_counts, void* recv,
                   const std::vector<size_t>& recv_counts, DataType dtype, Deadline deadline);
  // The host exchange (device < 0) or, on device buffers, the whole send
  // buffer copied to the host through the staging slot, the host exchange
  // (which may use shared memory and CMA, which cannot read device memory),
  // and the result copied back. The exchange is AllToAllV's, or with
  // `equal_blocks` (AllToAll) AllToAll's: a rank passing device buffers
  // takes the path a rank passing host buffers takes.
  Status AllToAllVOn(int device, const void* send, const std::vector<size_t>& send_counts,
                     void* recv, const std::vector<size_t>& recv_counts, DataType dtype,
                     Deadline deadline, bool equal_blocks = false);
  // Equal blocks: through shared memory when every rank is on this host.
  Status AllToAll(const void* send, void* recv, size_t count, DataType dtype, Deadline deadline);
  // An f16 average is taken as the sum of each rank's value divided by
  // the ranks first (NCCL's order for floating types): summed first, the
  // ranks' values overflow f16's 65504 where their mean does not (two
  // ranks at 40000). Host memory; the device paths divide on the device.
  bool DividesFirst(DataType dtype, ReduceOp op) const {
    return dtype == DataType::kF16 && op == ReduceOp::kAvg && options_.world_size > 1;
  }
  Status ReduceScatter(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                       Deadline deadline);
  Status Barrier(Deadline deadline);

  // The rooted collectives, checked on the caller's thread by CheckRooted,
  // which returns the CUDA device of the buffers this rank uses (-1: host).
  // dtype, op, root, algorithm and the count's overflow are agreed checks;
  // the buffers, which only the root uses in part, local ones (Refuse).
  enum class Rooted { kReduce, kGather, kScatter };
  StatusOr<int> CheckRooted(Rooted which, const void* send, const void* recv, size_t count,
                            DataType dtype, ReduceOp op, int root, const CallOptions& call);
  // Runs one rooted collective: on host memory (device < 0) directly, on
  // device buffers through the staging slots (cuda::RunStaged), chunk by
  // chunk, with the host collective on each chunk.
  Status RunRooted(Rooted which, int device, const void* send, void* recv, size_t count,
                   DataType dtype, ReduceOp op, int root, Algorithm algorithm, Deadline deadline);
  // The shm engine when it is up (unless tree or ring is requested), else
  // the tree or the ring by size (algorithms::ChooseReduce).
  Algorithm ChooseReduce(size_t bytes, Algorithm requested) const {
    if (requested == Algorithm::kTree || requested == Algorithm::kRing) return requested;
    if (shm_ != nullptr) return Algorithm::kSharedMemory;
    return algorithms::ChooseReduce(bytes);
  }
  Status Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root,
                Algorithm requested, Deadline deadline);
  Status Gather(const void* send, void* recv, size_t count, DataType dtype, int root,
                Deadline deadline);
  Status Scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
                 Deadline deadline);

  // Device buffers (a CUDA build): the same collectives, staged through
  // pinned host slots chunk by chunk (transport/cuda/staging_pipeline.h),
  // each chunk one host collective above.
  Status DeviceAllReduce(int device, const void* send, void* recv, size_t count, DataType dtype,
                         ReduceOp op, Algorithm requested, StagedReduce where,
                         Deadline deadline);
  Status DeviceBroadcast(int device, void* buffer, size_t count, DataType dtype, int root,
                         Deadline deadline);
  Status DeviceAllGather(int device, const void* send, void* recv, size_t count, DataType dtype,
                         Deadline deadline);
  Status DeviceReduceScatter(int device, const void* send, void* recv, size_t count,
                             DataType dtype, ReduceOp op, StagedReduce where, Deadline deadline);
  // The CUDA device of `buffers` ({send, recv} or {buffer}; nullptr: not
  // used by this rank), or -1 when all are host memory (always, without
  // CUDA) or count is 0. INVALID_ARGUMENT (cuda::CallDevice) when they are
  // on two devices, or host memory next to device memory.
  StatusOr<int> DeviceOf(std::initializer_list<const void*> buffers, size_t count,
                         const char* what) const;
  // Copies `bytes` from a device buffer to host memory (or back, when
  // `to_device`) through `device`'s staging slot, slot by slot, each copy
  // awaited against `deadline`; for Send/Recv when UCX cannot move device
  // memory. Host memory is touched only by the host, so no copy ever waits
  // inside the driver on pageable memory.
  Status StageCopy(int device, void* dst, const void* src, size_t bytes, bool to_device,
                   Deadline deadline);
  // StageCopy for a caller holding run_mu_.
  Status StageCopyLocked(int device, void* dst, const void* src, size_t bytes, bool to_device,
                         Deadline deadline);
  // UCX moves device memory itself (a CUDA-enabled UCX).
  bool ucx_cuda_memory() const { return info_.ucx_cuda_memory; }
  // Before UCX gets a device buffer as it is (the kDirect plans, Send/Recv
  // with a CUDA-enabled UCX): as before a staged call's first copy, the
  // staging queue, and through it the work queued on the legacy default
  // stream (the class comment's contract: inputs complete or ordered on
  // that stream), are done. Under run_mu_.
  Status DeviceReady(int device, Deadline deadline) {
    DDP_ASSIGN_OR_RETURN(cuda::CopyEngine* engine, StagingEngine(device));
    return engine->WaitAll(deadline);
  }
  // How a staged call on device buffers runs: `where` is the call's
  // choice (kAuto: the communicator's). Equal on every rank.
  cuda::StagedPlan Plan(const cuda::StagedCall& call,
                        StagedReduce where = StagedReduce::kAuto) const {
    if (where == StagedReduce::kAuto) where = options_.staged_reduce;
    return cuda::ChooseStagedPlan(call, where == StagedReduce::kDevice, ucx_cuda_memory());
  }
  static Status CheckStagedReduce(StagedReduce where) {
    if (where == StagedReduce::kAuto || where == StagedReduce::kDevice ||
        where == StagedReduce::kHost) {
      return Status::Ok();
    }
    return InvalidArgumentError("unknown staged_reduce " +
                                std::to_string(static_cast<int>(where)));
  }
  // An agreed check: `a` is one of the Algorithm values. Any named one may
  // be asked for (one that cannot run here falls back), but a value past
  // them would reach the algorithm table as a choice of its own and fail
  // the call only once it ran, aborting the communicator on every rank.
  static Status CheckAlgorithm(Algorithm a, const char* what) {
    if (static_cast<int>(a) >= static_cast<int>(Algorithm::kAuto) &&
        static_cast<int>(a) <= static_cast<int>(Algorithm::kSharedMemory)) {
      return Status::Ok();
    }
    return InvalidArgumentError(std::string(what) + ": unknown algorithm " +
                                std::to_string(static_cast<int>(a)));
  }
  // Agreed checks of the CallOptions of the call `what`: algorithm and
  // staged_reduce are values of their enums, and a call with no algorithm
  // to choose (`chooses_algorithm` false: all but all-reduce,
  // all-reduce-through and reduce) is not given one, as that choice would
  // be dropped unseen. A valid staged_reduce is ignored by the calls that
  // reduce nothing on device buffers.
  static Status CheckCallOptions(const CallOptions& call, const std::string& what,
                                 bool chooses_algorithm) {
    if (Status staged = CheckStagedReduce(call.staged_reduce); !staged.ok()) {
      return InvalidArgumentError(what + ": " + staged.message());
    }
    DDP_RETURN_IF_ERROR(CheckAlgorithm(call.algorithm, what.c_str()));
    if (!chooses_algorithm && call.algorithm != Algorithm::kAuto) {
      return InvalidArgumentError(what + ": CallOptions::algorithm is " +
                                  AlgorithmName(call.algorithm) +
                                  ", but only all-reduce, all-reduce-through and reduce choose an "
                                  "algorithm (leave it at kAuto)");
    }
    return Status::Ok();
  }
  Deadline DeadlineFor(const CallOptions& call) const {
    return DeadlineIn(call.timeout.count() > 0 ? call.timeout : options_.timeout);
  }

  // Posts a user Send/Recv at once (not queued) and returns its Work.
  // `blocking`: the caller waits and settles the request itself
  // (BlockingP2p), so dropping its handle does not cancel it.
  // For a posted request, `posted` (when given) gets its state and id.
  // `device` >= 0: `data` is device memory of it, posted after DeviceReady.
  struct Posted {
    std::shared_ptr<Work::State> state;
    p2p::RequestId id = 0;
  };
  Work PostP2p(bool send, void* data, size_t bytes, int peer, uint32_t tag,
               const CallOptions& call, bool blocking = false, Posted* posted = nullptr,
               int device = -1);
  // Send/Recv on host memory: PostP2p and a wait bounded by the call's
  // deadline (plus kBlockingP2pAllowance), even while a collective on
  // another thread holds the worker.
  // `keep` (a staging copy) lives until the request is settled.
  Status BlockingP2p(bool send, void* data, size_t bytes, int peer, uint32_t tag,
                     const CallOptions& call, std::shared_ptr<void> keep = nullptr,
                     int device = -1);
  // Cancels the requests handed over by BlockingP2p calls that timed out
  // while another thread held the worker. With run_mu_ held.
  void CancelDeferred();

  Algorithm Choose(size_t bytes, Algorithm requested) const;
  // Aborts with `reason`, unless the job or this communicator was aborted
  // already; returns the reason in force (the one callers should see).
  // `call_deadline`: the deadline of the call that failed, or nullopt outside
  // any call. A failing call reads the job's reason only until its own
  // deadline and leaves posting its reason to a background thread, so that
  // it returns on time even when the store went silent (its host cut off);
  // outside a call both happen here, for up to options_.abort_store_time.
  Status Abort(const Status& reason, std::optional<Deadline> call_deadline);
  // What to report for `reason` when no other rank has posted one yet: for
  // a lost peer, a rank on this host found dead or a reason posted within
  // kEchoGrace, followed by `reason` as what this rank saw; else `reason`.
  Status LocalCause(const Status& reason, Deadline deadline);
  Status aborted_reason() const {
    if (fork::InForkedChild()) {
      // A parent thread may have held abort_mu_ at the fork (it stays
      // locked in the child): only try it.
      std::unique_lock lock(abort_mu_, std::try_to_lock);
      if (lock.owns_lock()) return aborted_;
      return fork::CheckNotForkedChild("reading the abort reason");
    }
    std::lock_guard lock(abort_mu_);
    return aborted_;
  }

  std::chrono::nanoseconds PeerWaitTime() const {
    std::chrono::nanoseconds total{0};
    if (shm_ != nullptr) total += shm_->peer_wait();
    if (host_shm_ != nullptr) total += host_shm_->peer_wait();
    return total;
  }
  bool aborted() const { return is_aborted_.load(std::memory_order_acquire); }

  // Argument checks come in two kinds (communicator.h, Error model). Those
  // that depend only on what every rank passes alike (dtype, op, root,
  // algorithm, count and what it overflows) fail identically on every rank
  // of a well-formed program: they return INVALID_ARGUMENT and leave the
  // communicator usable, as no rank takes part. Those that depend on this
  // rank's own buffers, count lists or function go through Refuse: the
  // others cannot tell that this rank will not take part, and would wait
  // for it until their deadline and then pair their next call with its
  // next one (one collective apart). So the refusal aborts the
  // communicator as a failed collective does: the reason, naming this
  // rank, is posted to the store, and the peers' waits, which look there
  // about every 100 ms, fail with it. OK passes through.
  Status Refuse(const Status& local, const CallOptions& call) {
    if (local.ok()) return local;
    return Abort(Status(local.code(), "rank " + std::to_string(options_.rank) +
                                          " refused the call: " + local.message()),
                 DeadlineFor(call));
  }
  template <typename T>
  StatusOr<T> Refuse(StatusOr<T> local, const CallOptions& call) {
    if (local.ok()) return local;
    return Refuse(local.status(), call);
  }

  // An agreed check: `elems` elements of `dtype` (a valid one) fit the
  // address space.
  Status CheckCount(size_t elems, DataType dtype, const char* what) const {
    if (elems > std::numeric_limits<size_t>::max() / DataTypeSize(dtype)) {
      return InvalidArgumentError(std::string(what) + ": " + std::to_string(elems) +
                                  " elements of " + DataTypeName(dtype) +
                                  " overflow the address space");
    }
    return Status::Ok();
  }

  // A local check (Refuse): a buffer of `count` elements is not null.
  Status CheckBuffer(const void* p, size_t count, const char* name) const {
    if (p == nullptr && count > 0) {
      return InvalidArgumentError(std::string(name) + " is null with count " + std::to_string(count));
    }
    return Status::Ok();
  }
  // The send and receive buffers of a collective that reads one and writes
  // the other: aligned to the element size, and overlapping only in place,
  // where `recv` starts `in_place` bytes after `send` (negative: before),
  // as `rule` says.
  // Checked here, before any engine: the shared-memory one reads and writes
  // both directly and cannot take a partial overlap either. A local check
  // (Refuse), after CheckCount of the larger count.
  Status CheckLayout(const void* send, size_t send_elems, const void* recv, size_t recv_elems,
                     DataType dtype, std::ptrdiff_t in_place, const char* rule, const char* what) const {
    const size_t es = DataTypeSize(dtype);
    const auto s = reinterpret_cast<uintptr_t>(send), r = reinterpret_cast<uintptr_t>(recv);
    if ((send_elems > 0 && s % es != 0) || (recv_elems > 0 && r % es != 0)) {
      const char* which = s == r ? "" : send_elems > 0 && s % es != 0 ? "send " : "receive ";
      return InvalidArgumentError(std::string(what) + ": the " + which + "buffer is not aligned to the " +
                                  std::to_string(es) + "-byte size of " + DataTypeName(dtype));
    }
    if (send_elems == 0 || recv_elems == 0) return Status::Ok();
    const bool overlap = s < r + recv_elems * es && r < s + send_elems * es;
    if (overlap && static_cast<std::ptrdiff_t>(r - s) != in_place) {
      return InvalidArgumentError(std::string(what) +
                                  ": the send and receive buffers overlap other than in place (" + rule + ")");
    }
    return Status::Ok();
  }
  // count elements per rank times the ranks (saturating: CheckCount then
  // reports the overflow).
  size_t AllBlocks(size_t count) const {
    const auto ranks = static_cast<size_t>(options_.world_size);
    return count > std::numeric_limits<size_t>::max() / ranks ? std::numeric_limits<size_t>::max()
                                                              : count * ranks;
  }
  // Bytes of this rank's block, for the in-place layouts of all-gather and
  // reduce-scatter (count elements per rank).
  std::ptrdiff_t OwnBlock(size_t count, DataType dtype) const {
    return static_cast<std::ptrdiff_t>(static_cast<size_t>(options_.rank) * count * DataTypeSize(dtype));
  }
  // `what` names the call ("all-reduce"); an unknown value's error lists
  // the valid ones, as a caller passing a cast integer needs them.
  Status CheckTypes(DataType dtype, ReduceOp op, bool uses_op, std::string_view what) const {
    if (!ValidDataType(dtype)) {
      std::string valid;
      for (int d = 0; d <= static_cast<int>(DataType::kU8); ++d) {
        valid += (d == 0 ? "" : ", ") + std::to_string(d) + " " + DataTypeName(static_cast<DataType>(d));
      }
      return InvalidArgumentError(std::string(what) + ": unknown dtype " +
                                  std::to_string(static_cast<int>(dtype)) + " (valid: " + valid + ")");
    }
    if (uses_op && !ValidOp(op)) {
      std::string valid;
      for (int o = 0; o <= static_cast<int>(ReduceOp::kProd); ++o) {
        valid += (o == 0 ? "" : ", ") + std::to_string(o) + " " + ReduceOpName(static_cast<ReduceOp>(o));
      }
      return InvalidArgumentError(std::string(what) + ": unknown reduce op " +
                                  std::to_string(static_cast<int>(op)) + " (valid: " + valid + ")");
    }
    return Status::Ok();
  }
  // Asynchronous point-to-point calls post the user's buffer to UCX as it
  // is; a device buffer needs a UCX that moves device memory (the blocking
  // Send/Recv stage it instead). Returns the buffer's device (-1: host).
  StatusOr<int> CheckUnstagedP2p(const void* p, size_t count, const char* what) const {
    if (count == 0) return -1;
    const cuda::PointerKind kind = cuda::ClassifyPointer(p);
    if (!kind.device) return -1;
    if (info_.ucx_cuda_memory) return kind.device_id;
    return InvalidArgumentError(std::string(what) +
                                " is CUDA device memory and this UCX cannot move device memory; "
                                "use the blocking call (it stages through host memory) or a host "
                                "buffer");
  }
  Status CheckRank(int r, const char* what) const {
    if (r < 0 || r >= options_.world_size) {
      return InvalidArgumentError(std::string(what) + " " + std::to_string(r) +
                                  " is outside a world of size " +
                                  std::to_string(options_.world_size));
    }
    return Status::Ok();
  }

  CommunicatorOptions options_;
  // DDP_SHM_STAGING_BYTES, DDP_SHM_CHUNK_BYTES, DDP_SHM_SPIN_US as Init
  // parsed them; nullopt when unset.
  struct ShmEnvironment {
    std::optional<uint64_t> staging_bytes;
    std::optional<uint64_t> chunk_bytes;
    std::optional<uint64_t> spin_us;
  };
  ShmEnvironment shm_env_;
  CommunicatorInfo info_;

 private:
  friend class Communicator;  // Split reads the topology and seeds a child
  // The staging engine of `device`, made on first use. Under run_mu_.
  StatusOr<cuda::CopyEngine*> StagingEngine(int device);
  // The IPC collectives of `device`, made on first use; nullptr when this
  // job does not use IPC (option off, several hosts, one rank, more ranks
  // than an IPC kernel takes): the same answer on every rank. Under run_mu_.
  StatusOr<cuda::IpcCollectives*> Ipc(int device);
  // The host collectives an IPC call synchronizes with.
  cuda::IpcHostSteps IpcSteps(Deadline deadline);
  Status Staged(int device, const cuda::StagedCall& call, const cuda::HostCollective& host,
                Deadline deadline);
  // An all-reduce or reduce-scatter reduced on the device (plan
  // kDeviceReduce or kDeviceReduceDirect).
  Status StagedDeviceReduce(int device, const cuda::StagedCall& call, cuda::StagedPlan plan,
                            Deadline deadline);
  algorithms::CollectiveArgs Args(const void* send, void* recv, size_t count, DataType dtype,
                                  ReduceOp op, int root, Deadline deadline) {
    algorithms::CollectiveArgs args;
    args.send = send;
    args.recv = recv;
    args.count = count;
    args.dtype = dtype;
    args.op = op;
    args.root = root;
    args.call_id = sequence_ + 1;  // the same on every rank; 0 would mean unknown
    args.tag = algorithms::CollectiveTag(sequence_++);
    args.deadline = deadline;
    args.tuning.chunk_bytes = options_.chunk_bytes;
    return args;
  }
  shm::ShmOptions SharedMemoryOptions() const;
  // Chooses how waits idle for options_.busy_threads_per_rank, records it
  // in info_ and hands it to the engines (Init calls it once they exist).
  void ApplyIdlePolicy();
  Status InitHostSharedMemory(const topology::Topology& real, const std::vector<int>& pids,
                              Deadline deadline);
  Status Watchdog(Deadline deadline, int awaited_peer = -1) {
    return monitor_ ? monitor_->Check(deadline, awaited_peer) : Status::Ok();
  }
  void AsyncLoop();
  // Waits until no async call is queued or running, until `deadline`, or,
  // with `their_time`, until the later queue_done_by_ (which each call
  // queued meanwhile moves on).
  Status WaitForQueue(Deadline deadline, bool their_time = false);
  void Shutdown();
  // Notes `users` (FormatSplitRegistration's lines) under
  // served_root_prefix_, as one registration of its own (see
  // SplitRegistryKey).
  Status RegisterSplit(const std::string& users, const CallOptions& call);
  // Appends to `users` the communicators registered under each family
  // this process serves (ServedStore::roots) that `read[root]` has not
  // seen yet, and notes them there.
  void ReadRegisteredSplits(std::map<std::string, SplitRegistryRead>& read,
                            std::vector<std::pair<std::string, int>>& users, Deadline deadline);
  // For Shutdown of the last holder of the served store: the ranks of the
  // communicators `awaited` (key prefix, ranks) that have not left, by
  // their "left/<rank>" marks ("ranks 2, 3 of communicator 'x'; ..."), or
  // how many when not `name_them` or the marks cannot all be read by
  // `deadline`; "" when every rank left.
  std::string NotLeftRanks(const std::vector<std::pair<std::string, int>>& awaited, bool name_them,
                           Deadline deadline);
  // For the same Shutdown, after a clean end of its own: the abort reasons
  // posted by the communicators of `awaited` whose ranks have not all left
  // ("communicator 'x': rank 1 aborted the job: ..."; "; " between them),
  // when each of them has one or has this process as a member (which left
  // it: it runs no collective any more); "" when none is aborted, another
  // is not (its ranks may run on past the store's clean stop), or a key
  // cannot be read by `deadline`. It never holds store::kCleanShutdownWords, which would
  // make the stop read as clean.
  std::string AbortsOfRanksNotLeft(const std::vector<std::pair<std::string, int>>& awaited, Deadline deadline);

  // Destroyed bottom-up: the async thread is joined in Shutdown(), then the
  // engines, then UCX (requests, endpoints, worker, context), then the store
  // client, then the server.
  std::shared_ptr<ServedStore> server_;
  std::unique_ptr<store::TcpStoreClient> store_;
  std::unique_ptr<internal::WatchfulStore> setup_store_;  // store_ as Init waits on it
  // The name of this communicator's store keys: its options' name, and for
  // the second and later communicators of that name made by this process
  // on one store, "#n" after it (see Create).
  std::string key_name_;
  // When creation must be done by (Create's, across its attempts); else
  // options_.timeout from Init's start.
  std::optional<Deadline> creation_deadline_;
  // Init failed (PostCreationFailure): Shutdown, which the failing Create
  // or Split runs before it returns, keeps to the creation deadline.
  bool creation_failed_ = false;
  // After a failed creation: when the one abort_store_time that the post of
  // its reason and the marks of leaving share ends (PostCreationFailure
  // sets it; the post and the marks each had one, so with a stalled store
  // Create or Split returned up to twice that after the failure).
  std::optional<Deadline> failure_store_by_;
  // The post of a failed creation's reason was over before
  // failure_store_by_ (answered, or failed at once): the store is not
  // stalled, and the marks of leaving get kLeaveMarkTime each at least.
  bool failure_store_answered_ = false;
  // Init found this process no member: its rank claimed by another process
  // (the job's member), or outside [0, world_size). Shutdown marks nothing
  // as this rank's leaving, which would count a member as left (and let the
  // rank serving the store stop it under a member still there).
  bool not_a_member_ = false;
  // Init found every member's rank claimed while this process had a rank
  // outside the job (one process more than world_size): the job forms
  // without it, so its failure is not posted as the job's abort.
  bool fails_alone_ = false;
  // PostCreationFailure found the job's abort reason in the store (this
  // rank's or an earlier one): a member arriving late reads it at once, so
  // the rank serving the store keeps it up for late members only as long
  // as after an abort (a member that never comes, as rank 1 when a process
  // was given rank 7 in its place, held it to the creation deadline).
  bool abort_posted_ = false;
  std::string prefix_;
  topology::Topology topology_;  // for algorithm choice (file or discovered)
  topology::Topology real_topology_;  // as discovered
  // Set by Split before Init: the parent's described topology, cut to the
  // new communicator's ranks (it replaces the file, which describes the
  // parent's ranks).
  std::optional<topology::Topology> described_;
  // Set by Split before Init: the settings come from the parent as its Init
  // settled them (options_ and shm_env_), and the DDP_* environment is not
  // read again; a variable changed since the parent was made would give the
  // child other settings, and the ranks that saw the change would fail the
  // split with a settings mismatch.
  bool inherits_environment_ = false;
  // This process's place among the processes of its host, for discovering
  // its GPU, NUMA node and network port: the creating communicator's local
  // rank and size, kept by every split (a child's own local rank counts
  // only its members: a child holding one rank per host would put every
  // process on GPU 0 and its port). -1: take the options'.
  int place_local_rank_ = -1;
  int place_local_world_size_ = -1;
  uint64_t splits_ = 0;          // Split calls so far (names the children)
  // Which rank of this communicator serves the store: -1 a launcher (or
  // another outside store), -2 a process outside this communicator (rank 0
  // of the one it was split from, at some depth). For messages, and
  // whether ranks mark that they left (Shutdown).
  int store_rank_ = -1;
  // When a rank serves the store: the key prefix of the first communicator
  // of this family (Create's, which Splits descend from), under which splits
  // made without that rank register (RegisterSplit), so that it stays up
  // for them (ServedStore::roots lists each family's). Empty otherwise.
  std::string served_root_prefix_;
  bool single_host_ = true;      // as discovered, whatever the file says
  // Per rank: its pid when on this host (as the monitor watches it), else 0.
  std::vector<int> local_pids_;
  // Per rank: its pid when it shares a host (as SameHost tells it: name,
  // boot id and namespaces) with the process serving the store, else 0;
  // empty when no member of this family serves it. A split without that
  // process takes its members' from its parent: its rank 0 registers them
  // with the split (RegisterSplit), so that the serving process can tell a
  // member that died from one still to come.
  std::vector<int> server_host_pids_;
  // Per rank: its rank in the first communicator of this family (Create's,
  // which Splits descend from), which names one process at any depth of
  // splits. Split carries it to its children and their registration, so
  // that the store's last holder can tell a member of any split that died
  // on another host by its own connection to that process (Shutdown).
  std::vector<int> root_ranks_;
  // What the idle policy is chosen from (ApplyIdlePolicy).
  int available_cpus_ = 1;
  bool kernel_network_ = false;
  std::vector<int> ring_order_;
  bool ring_is_rank_order_ = true;
  // All-gather and reduce-scatter go around the ring's order, which leaves
  // each host once (in rank order, ranks of hosts placed cyclically cross
  // the network at every hop), their blocks kept at the job's ranks' places.
  std::pair<p2p::PointToPoint&, algorithms::CollectiveArgs> OnRing(algorithms::CollectiveArgs args) {
    if (ring_is_rank_order_) return {*p2p_, args};
    args.tuning.block_owner = &ring_order_;
    return {*ring_view_, args};
  }
  std::unique_ptr<ucx::UcxPointToPoint> p2p_;
  std::unique_ptr<p2p::GroupView> ring_view_;
  std::unique_ptr<fault::PeerMonitor> monitor_;
  std::unique_ptr<shm::ShmAllReduce> shm_;
  // Several hosts: this rank's host's ranks in shared memory, and the ranks
  // of the other hosts with its local index (the hierarchical all-reduce).
  std::unique_ptr<shm::ShmAllReduce> host_shm_;
  std::unique_ptr<p2p::GroupView> host_inter_;
  // The watchdog for host_shm_'s waits, which name peers by their index in
  // this host's group: it asks about their global ranks.
  std::function<Status(Deadline, int)> host_watchdog_;
  std::function<Status(Deadline, int)> watchdog_;
  // Pinned slots and a stream per CUDA device used, under run_mu_.
  std::map<int, std::unique_ptr<cuda::DeviceCopyEngine>> staging_;
  std::map<int, std::unique_ptr<cuda::IpcCollectives>> ipc_;  // under run_mu_

  // AllReduceThrough's scratch off shared memory, kept between calls (some
  // (1 + 1/size) times the largest vector it was given); under run_mu_.
  std::vector<char> through_whole_;
  std::vector<char> through_slice_;
  std::vector<char> through_divided_;  // an f16 average's divided input

  // Held by whichever thread drives UCX / shm. Timed: a blocking call
  // gives up at its deadline, and a point-to-point poll does not sit out
  // another thread's whole collective (Work::Wait keeps its own deadline).
  std::timed_mutex run_mu_;
  uint64_t sequence_ = 0; // collective number, under run_mu_

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::function<void()>> queue_;
  size_t unfinished_ = 0;  // queued or running async calls
  // By when the queued and running async calls have ended at the latest:
  // each starts once the one before has ended and ends by its own deadline
  // (plus kQueuedCallAllowance). Bounds a blocking call's wait for them.
  Deadline queue_done_by_{};
  bool stopping_ = false;
  std::thread thread_;

  mutable std::mutex abort_mu_;
  Status aborted_;
  std::atomic<bool> is_aborted_{false};
  // Posts a failed call's reason; under abort_mu_. Shutdown sets
  // posters_closed_ (under abort_mu_) once no poll can run, then joins it.
  std::thread abort_poster_;
  bool posters_closed_ = false;
  bool shut_down_ = false;

  // A posted SendAsync/RecvAsync, kept so that Shutdown can fail its
  // handles and SweepDroppedP2p can settle it once its handles are gone.
  struct PostedP2p {
    std::weak_ptr<Work::State> work;
    p2p::RequestId id = 0;
    bool send = false;
    Deadline deadline;
  };
  // With run_mu_ held.
  void SweepDroppedP2p();
  // Requests whose blocking Send/Recv gave up at its deadline while the
  // worker was held elsewhere: whoever holds run_mu_ next (or the holder's
  // next watchdog tick inside its wait) cancels them and sets `cancelled`.
  struct DeferredCancel {
    p2p::RequestId id = 0;
    bool cancelled = false;  // under deferred_mu_
    std::shared_ptr<void> keep;  // a staging copy the request uses
  };
  std::mutex deferred_mu_;
  std::condition_variable deferred_cv_;
  std::vector<std::shared_ptr<DeferredCancel>> deferred_;  // under deferred_mu_
  std::atomic<bool> any_deferred_{false};
  std::mutex p2p_works_mu_;  // after run_mu_ where both are held
  std::vector<PostedP2p> p2p_works_;  // posted, maybe pending
  // What a point-to-point handle's poll reaches this communicator through.
  // The handle may outlive it, and another thread may be inside a poll
  // while this one destroys it: a poll holds `mu` shared for its whole
  // run and does nothing once `closed`; Shutdown closes it exclusively,
  // so no poll is running, or will run, once Shutdown goes on.
  struct PollGate {
    std::shared_mutex mu;
    bool closed = false;
  };
  std::shared_ptr<PollGate> poll_gate_ = std::make_shared<PollGate>();
};

// How long a rank with a bad DDP_* variable (or another of its own bad
// options: Init) tries to reach the store to post it for the others before
// it names it and gives up; a bad timeout's creation deadline.
constexpr std::chrono::milliseconds kEnvironmentReportTime(5000);
// How long a process given a rank outside the job waits for every member
// to claim its rank (Init) before it takes the job for one that cannot
// form without it and posts its failure as the job's abort. Processes
// launched together reach the store within it on a loaded host; short
// enough that the others still learn an off-by-one RANK within moments.
constexpr std::chrono::milliseconds kMembersClaimWait(1000);

// The DDP_* variables that adjust options_ and shm_env_.
Status Communicator::Impl::ReadEnvironment() {
  // Each variable is checked even where the option has decided and the
  // value is not used: a misspelt value is named, not ignored.
  const std::string env_algo = GetEnv("DDP_ALLREDUCE_ALGO");
  if (!env_algo.empty()) {
    DDP_ASSIGN_OR_RETURN(const Algorithm env_algorithm, ParseAlgorithm(env_algo, "DDP_ALLREDUCE_ALGO"));
    if (options_.algorithm == Algorithm::kAuto) options_.algorithm = env_algorithm;
  }
  if (options_.topology_file.empty()) options_.topology_file = GetEnv("DDP_TOPOLOGY_FILE");
  // A true DDP_CUDA_IPC turns the option on and a false DDP_SHARED_MEMORY
  // turns it off; the other value leaves the program's choice.
  DDP_ASSIGN_OR_RETURN(const std::optional<bool> env_ipc, EnvBool("DDP_CUDA_IPC"));
  if (env_ipc.value_or(false)) options_.cuda_ipc = true;
  DDP_ASSIGN_OR_RETURN(const std::optional<bool> env_shm, EnvBool("DDP_SHARED_MEMORY"));
  if (!env_shm.value_or(true)) options_.shared_memory = false;
  DDP_ASSIGN_OR_RETURN(shm_env_.staging_bytes, EnvBytes("DDP_SHM_STAGING_BYTES", kMostShmStagingBytes));
  DDP_ASSIGN_OR_RETURN(shm_env_.chunk_bytes, EnvBytes("DDP_SHM_CHUNK_BYTES", kMostShmChunkBytes));
  DDP_ASSIGN_OR_RETURN(shm_env_.spin_us, EnvCount("DDP_SHM_SPIN_US", kMostShmSpinUs));
  const std::string env_reduce = GetEnv("DDP_STAGED_REDUCE");
  // Host by default: on an H200 (2 ranks sharing it, f32 and bf16, 4 KiB to
  // 64 MiB) reducing on the host was faster at every size but one
  // (docs/benchmarks.md, GPU).
  StagedReduce env_staged = StagedReduce::kHost;
  if (!env_reduce.empty()) {
    DDP_ASSIGN_OR_RETURN(env_staged, ParseStagedReduce(env_reduce));
  }
  if (options_.staged_reduce == StagedReduce::kAuto) options_.staged_reduce = env_staged;
  info_.staged_reduce = options_.staged_reduce;
  return Status::Ok();
}

Status Communicator::Impl::Init() {
  const CommunicatorOptions& o = options_;
  DDP_RETURN_IF_ERROR(CheckStoreOptions(o));
  const bool any_port = o.world_size == 1 && o.host_store && o.store_port == 0;
  // This rank's own mistakes (its rank, its place on its host, a time or a
  // size out of range, a value outside an enum): one rank's, as a launch
  // that set RANK or LOCAL_WORLD_SIZE wrongly on one host, or options built
  // per rank. Each is reported as a bad DDP_* variable is, once the store is
  // reached (below): returned at once, it left the other ranks waiting out
  // their whole timeout.
  Status own = CheckRank(o.rank, "rank");
  const auto also = [&own](Status found) {
    if (own.ok()) own = std::move(found);
  };
  if (o.local_world_size < 1) {
    also(InvalidArgumentError("local_world_size " + std::to_string(o.local_world_size) + " must be positive"));
  } else if (o.local_world_size > o.world_size) {
    // More processes on this host than in the job: nothing later would
    // name it; it only skews the topology's per-host view.
    also(InvalidArgumentError("local_world_size " + std::to_string(o.local_world_size) +
                              " is above world_size " + std::to_string(o.world_size) +
                              ": a host cannot hold more of the job's ranks than it has"));
  } else if (o.local_rank < 0 || o.local_rank >= o.local_world_size) {
    also(InvalidArgumentError("local_rank " + std::to_string(o.local_rank) +
                              " is outside a local world of size " + std::to_string(o.local_world_size)));
  }
  const std::pair<const char*, milliseconds> times[] = {
      {"timeout", o.timeout}, {"abort_store_time", o.abort_store_time}, {"store_call_cap", o.store_call_cap}};
  for (const auto& [name, time] : times) {
    if (time.count() <= 0) {
      also(InvalidArgumentError(std::string(name) + " " + std::to_string(time.count()) + " ms must be positive"));
    }
  }
  // Bounded as DDP_SHM_CHUNK_BYTES is: the shared-memory engine allocates a
  // chunk per rank (a size near SIZE_MAX threw out of Create, and 16 chunks
  // of staging wrapped), and a device chunk is pinned memory per slot.
  const std::pair<const char*, size_t> chunks[] = {{"chunk_bytes", o.chunk_bytes},
                                                   {"device_chunk_bytes", o.device_chunk_bytes}};
  for (const auto& [name, bytes] : chunks) {
    if (bytes > kMostShmChunkBytes) {
      also(InvalidArgumentError(std::string(name) + " " + std::to_string(bytes) + " is above " +
                                std::to_string(kMostShmChunkBytes) + " (1 GiB), the most it may be"));
    }
  }
  also(CheckStagedReduce(options_.staged_reduce));
  also(CheckAlgorithm(options_.algorithm, "options"));
  // The report and this rank's leaving keep to the defaults' times in
  // place of bad ones: an expired deadline would post nothing.
  if (o.timeout.count() <= 0) {
    options_.timeout = kEnvironmentReportTime;
    creation_deadline_ = DeadlineIn(kEnvironmentReportTime);
  }
  if (o.abort_store_time.count() <= 0) options_.abort_store_time = CommunicatorOptions().abort_store_time;
  if (o.store_call_cap.count() <= 0) options_.store_call_cap = CommunicatorOptions().store_call_cap;
  // A bad variable is reported once the store is reached, where the other
  // ranks' creation waits see it: failing before would leave them waiting
  // out their whole timeout (or, on rank 0, never start their store). The
  // store gets a few seconds for that, then the variable is named anyway,
  // also when reaching or serving the store fails.
  Status environment = own;
  if (inherits_environment_) {
    info_.staged_reduce = options_.staged_reduce;
  } else if (environment.ok()) {
    environment = ReadEnvironment();
  }

  fork::InstallForkGuard();
  const Deadline deadline = creation_deadline_.value_or(DeadlineIn(o.timeout));
  creation_deadline_ = deadline;  // for Shutdown, should this fail
  // Count the cores before pinning narrows the view to one.
  const int available_cpus = AvailableCpus();
  if (o.bind_to_core && environment.ok()) BindToCore(o.local_rank);
  prefix_ = (key_name_.empty() ? o.name : key_name_) + "/";

  // 1. Rendezvous store.
  if (o.host_store && o.rank == 0) {
    store::TcpStoreServerOptions server_options;
    server_options.bind_address = o.store_host;
    server_options.port = o.store_port;
    server_options.job_token = o.job_token;
    server_options.start_deadline = deadline;  // looking up store_host counts against creation
    Status error;
    server_ = ServedStoreFor(
        o.store_host + ":" + std::to_string(o.store_port), o.job_token,
        [&]() -> StatusOr<std::shared_ptr<ServedStore>> {
          auto fresh = std::make_shared<ServedStore>();
          DDP_ASSIGN_OR_RETURN(fresh->server, store::TcpStoreServer::Start(server_options));
          fresh->job_token = o.job_token;
          return fresh;
        },
        error);
    if (server_ == nullptr) return environment.ok() ? error : environment;
    // The port chosen, for the connection below and for Splits, which
    // connect to these options' store.
    if (any_port) options_.store_port = server_->server->port();
    {
      std::lock_guard lock(server_->mu);
      ++server_->holders;  // released in Shutdown
      server_->users.emplace_back(prefix_, o.world_size);
      server_->roots.push_back(prefix_);
    }
    if (environment.ok() && o.world_size > o.local_world_size && server_->server->loopback_only()) {
      // Ranks on other hosts would only time out connecting; say why here,
      // before they do. Worded as a possibility: options filled by hand may
      // leave local_world_size at 1 on a one-host job, and which hosts the
      // ranks run on is learned only once they reach the store.
      std::fprintf(stderr,
                   "[ddp] rank 0: warning: world_size %d is more than local_world_size %d, so "
                   "ranks may run on other hosts, but the rendezvous store listens on loopback "
                   "addresses only (what %s resolves to on this host), which other hosts cannot "
                   "reach; if ranks run elsewhere, set MASTER_ADDR (store_host) to an address of "
                   "this host that they can reach; if every rank runs on this host, set "
                   "local_world_size (LOCAL_WORLD_SIZE) to %d\n",
                   o.world_size, o.local_world_size, o.store_host.c_str(), o.world_size);
    }
  }
  if (o.host_store) {  // a Split's child has it off and these set already
    store_rank_ = 0;
    served_root_prefix_ = prefix_;
  }
  if (root_ranks_.empty()) {  // Create's: the family's first
    root_ranks_.resize(static_cast<size_t>(o.world_size));
    std::iota(root_ranks_.begin(), root_ranks_.end(), 0);
  }
  {
    const Deadline connect_by =
        environment.ok() ? deadline : std::min(deadline, DeadlineIn(kEnvironmentReportTime));
    StatusOr<std::unique_ptr<store::TcpStoreClient>> connected =
        store::TcpStoreClient::Connect(o.store_host, o.store_port, o.job_token, connect_by);
    if (!connected.ok()) return environment.ok() ? connected.status() : environment;
    store_ = std::move(*connected);
  }
  setup_store_ = std::make_unique<internal::WatchfulStore>(*store_, prefix_ + "abort");
  if (!CheckRank(o.rank, "rank").ok()) {
    // No member of the job. When every rank of it has claimed its place
    // (Create's claim, below) within kMembersClaimWait, the job forms
    // without this process (one launched more than world_size) and it
    // fails alone: posted as the abort, its failure ended a job that was
    // fine. Otherwise a member is missing too (RANK off by one on every
    // host), and the others, waiting for that member until their timeout,
    // learn this rank's reason at once (PostCreationFailure).
    not_a_member_ = true;
    std::vector<std::string> claims;
    claims.reserve(static_cast<size_t>(o.world_size));
    for (int r = 0; r < o.world_size; ++r) claims.push_back(prefix_ + "claimed/" + std::to_string(r));
    if (store_->Wait(claims, std::min(deadline, DeadlineIn(kMembersClaimWait))).ok()) {
      fails_alone_ = true;
      return Status(environment.code(),
                    environment.message() + "; ranks 0 to " + std::to_string(o.world_size - 1) +
                        " have all taken their places, so this process fails alone and the job goes on "
                        "(was one process more than WORLD_SIZE launched?)");
    }
  }
  DDP_RETURN_IF_ERROR(environment);
  // Two processes given one rank (RANK set wrongly on one host) overwrote
  // each other's keys below: two of them made the communicator, and the
  // third failed far from the cause ("Shared memory error") or waited out
  // its timeout. The first claim of a rank wins; the second process fails,
  // which tells every rank (PostCreationFailure).
  {
    const std::string& me = ClaimantName();
    DDP_ASSIGN_OR_RETURN(const std::optional<std::string> claimant,
                         store_->CompareSet(prefix_ + "claimed/" + std::to_string(o.rank), std::nullopt, me,
                                            deadline));
    if (claimant != me) {
      const std::string other = claimant ? claimant->substr(std::min(claimant->find(' ') + 1, claimant->size()))
                                         : std::string("unknown");
      const std::string mine = me.substr(me.find(' ') + 1);
      not_a_member_ = true;
      return InvalidArgumentError("two processes were given rank " + std::to_string(o.rank) + ": " + other +
                                  " took it first, then " + mine + " (check RANK on each host)");
    }
  }

  // 2. Topology: discovered and exchanged (hosts, pids), or from a file for
  // the algorithm choice.
  if (place_local_rank_ < 0) {
    place_local_rank_ = o.local_rank;
    place_local_world_size_ = o.local_world_size;
  }
  DDP_ASSIGN_OR_RETURN(topology::LocalView local,
                       topology::DiscoverLocal({.local_rank = place_local_rank_,
                                                .local_world_size = place_local_world_size_}));
  // A described topology (Split's cut of the parent's, or a file) replaces
  // the discovered one for the algorithm choice and the ring order. Read
  // before the exchange, which compares it.
  std::optional<topology::Topology> described = described_;
  if (!described && !options_.topology_file.empty()) {
    DDP_ASSIGN_OR_RETURN(described, topology::LoadTopologyFile(options_.topology_file));
    if (described->size() != o.world_size) {
      return InvalidArgumentError("topology file " + options_.topology_file + " describes " +
                                  std::to_string(described->size()) + " ranks, the job has " +
                                  std::to_string(o.world_size));
    }
  }
  // Settings that must agree across ranks, compared in the exchange: a
  // difference fails creation on every rank, naming the setting, where it
  // would otherwise show as a collective waiting for messages its peers
  // never send: different chunkings, device reduction on one rank and host
  // reduction on another, a forced algorithm on some ranks only (a rank
  // running the UCX ring waits for its predecessor's arguments while the
  // others wait for it in shared memory, and nobody compares), or another
  // topology (other ring neighbours, other hosts).
  local.settings =
      std::string("staged_reduce=") +
      (options_.staged_reduce == StagedReduce::kHost ? "host" : "device") +
      " cuda_ipc=" + (options_.cuda_ipc ? "1" : "0") +
      " shared_memory=" + (o.shared_memory ? "1" : "0") +
      " chunk_bytes=" + std::to_string(o.chunk_bytes) +
      " device_chunk_bytes=" + std::to_string(o.device_chunk_bytes) +
      " DDP_SHM_STAGING_BYTES=" + OptionalText(shm_env_.staging_bytes) +
      " DDP_SHM_CHUNK_BYTES=" + OptionalText(shm_env_.chunk_bytes) +
      " algorithm=" + AlgorithmName(options_.algorithm) +
      " topology=" + TopologySource(described);
  DDP_ASSIGN_OR_RETURN(topology::Exchanged exchanged,
                       topology::ExchangeTopology(*setup_store_, prefix_, o.rank, o.world_size, local,
                                                  deadline));
  const topology::Topology& real = exchanged.topology;
  if (described) {
    DDP_RETURN_IF_ERROR(topology::CheckDescribedHostsSplitReal(
        *described, real, described_ ? "the topology its parent was given" : "topology file " + options_.topology_file));
  }
  single_host_ = real.num_hosts() == 1;
  real_topology_ = real;
  topology_ = described ? *described : real;
  info_.num_hosts = topology_.num_hosts();
  ring_order_ = topology::RingOrder(topology_);
  ring_is_rank_order_ = true;
  for (size_t i = 0; i < ring_order_.size(); ++i) ring_is_rank_order_ &= ring_order_[i] == static_cast<int>(i);
  {
    std::ostringstream order;
    for (size_t i = 0; i < ring_order_.size(); ++i) order << (i ? " " : "") << ring_order_[i];
    info_.ring_order = order.str();
  }

  // 3. UCX. On one host only shared memory is useful; otherwise UCX picks
  // among all transports, on the RDMA port nearest this rank.
  ucx::ContextOptions context_options;
  if (single_host_) context_options.default_tls = "sm,self";
  info_.net_device = topology::PickNetDevice(real, o.rank);
  context_options.default_net_devices = info_.net_device;
  if (!GetEnv("UCX_NET_DEVICES").empty()) info_.net_device = GetEnv("UCX_NET_DEVICES");
  context_options.name = "ddp-rank" + std::to_string(o.rank);
  DDP_ASSIGN_OR_RETURN(std::shared_ptr<ucx::Context> context, ucx::Context::Create(context_options));
  info_.ucx_tls = context->tls();
  info_.ucx_cuda_memory = context->cuda_memory();
  // Busy threads that outnumber the cores of this kernel must not spin
  // against each other, nor, over TCP, against the kernel's network stack:
  // yield while idle (topology::ChooseIdlePolicy). UCX names RDMA ports
  // "device:port"; any other device (or none) between hosts is TCP.
  available_cpus_ = available_cpus;
  kernel_network_ = !single_host_ && info_.net_device.find(':') == std::string::npos;
  info_.ranks_sharing_kernel = topology::RanksSharingKernel(real, o.rank);
  ucx::P2pOptions p2p_options;
  p2p_options.rank = o.rank;
  p2p_options.size = o.world_size;
  DDP_ASSIGN_OR_RETURN(p2p_, ucx::UcxPointToPoint::Create(context, p2p_options));
  ApplyIdlePolicy();  // for the connection set-up; again once shm engines exist
  // Whether UCX moves device memory is a setting every rank must share
  // too: it decides whether a broadcast or all-gather of device buffers
  // goes to UCX as it is or through the host collectives (shared memory on
  // one host). Known only now, it leads the worker address.
  const std::string cuda_memory = info_.ucx_cuda_memory ? "1" : "0";
  DDP_RETURN_IF_ERROR(store_->Set(prefix_ + "ucx/" + std::to_string(o.rank),
                                  cuda_memory + p2p_->address(), deadline));
  // Every rank's address in a round trip per few hundred ranks (a Get per
  // rank made creation O(world) round trips per rank, O(world^2) in all).
  std::vector<std::string> address_keys;
  for (int r = 0; r < o.world_size; ++r) address_keys.push_back(prefix_ + "ucx/" + std::to_string(r));
  DDP_ASSIGN_OR_RETURN(std::vector<std::string> addresses, setup_store_->MultiGet(address_keys, deadline));
  std::vector<bool> same_host(o.world_size);
  std::vector<int> local_pids(o.world_size, 0);
  for (int r = 0; r < o.world_size; ++r) {
    const std::string theirs = addresses[r].substr(0, 1);
    if (theirs != cuda_memory) {
      return InvalidArgumentError(topology::DescribeSettingsMismatch(
          "ucx_cuda_memory=" + cuda_memory, o.rank, "ucx_cuda_memory=" + theirs, r));
    }
    addresses[r].erase(0, 1);
    same_host[r] = real.SameHost(r, o.rank);
    if (same_host[r]) local_pids[r] = exchanged.pids[r];
  }
  if (store_rank_ >= 0 && store_rank_ < o.world_size) {
    server_host_pids_.assign(static_cast<size_t>(o.world_size), 0);
    for (int r = 0; r < o.world_size; ++r) {
      if (real.SameHost(r, store_rank_)) server_host_pids_[r] = exchanged.pids[r];
    }
  }
  DDP_RETURN_IF_ERROR(p2p_->Connect(addresses, same_host));
  DDP_ASSIGN_OR_RETURN(p2p::GroupView view, p2p::GroupView::Create(*p2p_, ring_order_));
  ring_view_ = std::make_unique<p2p::GroupView>(std::move(view));

  local_pids_ = local_pids;
  if (server_ != nullptr) {
    std::lock_guard lock(server_->mu);
    server_->member_pids.emplace(prefix_, local_pids);
    server_->member_starts.emplace(prefix_, StartTimes(local_pids));
  }

  // 4. Fault detection inside waits.
  // What this rank can tell of another member that serves the store, for
  // when the connection to it breaks (Shutdown: it serves until the ranks
  // have left, after an abort for at most kAbortedStoreTimeForLatePeers).
  // `told_why`: the server sent its stop notice, whose reason (after a
  // clean shutdown or after an abort) follows in the store's words, so no
  // guess is made here about why it left: a clean leaving was called
  // "most likely after aborting it".
  auto describe_server = [this, local_pids](bool told_why) {
    if (store_rank_ < 0 || store_rank_ >= static_cast<int>(local_pids.size()) || store_rank_ == options_.rank) {
      return std::string();
    }
    const int pid = local_pids[static_cast<size_t>(store_rank_)];
    const std::string who = "rank " + std::to_string(store_rank_);
    const std::string stops = " (the store stops at most " + std::to_string(kAbortedStoreTimeForLatePeers.count()) +
                              " ms after an abort, and the posted reason goes with it; otherwise once every "
                              "rank has left this communicator and its splits)";
    const std::string stopped = ": it left this communicator and stopped the store, saying why" + stops;
    if (pid <= 0) {
      const auto& place = real_topology_.ranks[static_cast<size_t>(store_rank_)];
      const std::string where =
          who + ", which serves the store on host " + real_topology_.hosts[static_cast<size_t>(place.host)].name;
      if (told_why) return where + stopped;
      return where + ", died, or left this communicator, most likely after aborting it" + stops;
    }
    const std::vector<int> exited = monitor_ == nullptr ? std::vector<int>() : monitor_->ExitedPeers();
    if (std::find(exited.begin(), exited.end(), store_rank_) != exited.end()) {
      return who + ", which serves the store (pid " + std::to_string(pid) + " on this host), has exited";
    }
    const std::string running = who + ", which serves the store (pid " + std::to_string(pid) +
                                " on this host), is still running";
    if (told_why) return running + stopped;
    return running + ": it left this communicator, most likely after aborting it" + stops;
  };
  monitor_ = std::make_unique<fault::PeerMonitor>(
      fault::PeerMonitorOptions{.rank = o.rank, .local_pids = local_pids, .key_prefix = prefix_,
                                .store_rank = store_rank_, .describe_server = std::move(describe_server),
                                .store_call_cap = o.store_call_cap},
      store_.get());
  watchdog_ = [this](Deadline deadline, int awaited_peer) {
    // Called inside waits, by the thread holding run_mu_.
    CancelDeferred();
    return Watchdog(deadline, awaited_peer);
  };
  p2p_->SetWatchdog([this](Deadline deadline, std::span<const int> awaited_peers) {
    // As watchdog_, for a UCX wait on requests with several peers.
    CancelDeferred();
    return monitor_ ? monitor_->Check(deadline, awaited_peers) : Status::Ok();
  });

  // 5. The shared-memory path, when every rank is on this host.
  if (single_host_ && o.world_size > 1 && o.shared_memory) {
    shm::ShmOptions shm_options = SharedMemoryOptions();
    shm_options.rank = o.rank;
    shm_options.size = o.world_size;
    shm_options.pids = exchanged.pids;
    auto engine = shm::ShmAllReduce::Create(*setup_store_, prefix_ + "shm/", shm_options, deadline);
    if (engine.ok()) {
      shm_ = std::move(*engine);
    } else if (engine.status().code() != StatusCode::kUnavailable) {
      return engine.status();
    } else {
      // UNAVAILABLE (no segment on some rank, no CMA permission): every
      // rank decided the same; UCX only.
      info_.shared_memory_unavailable = engine.status().message();
    }
  }
  info_.shared_memory = shm_ != nullptr;

  // 6. Several hosts: the hierarchical all-reduce's steps inside a host in
  // shared memory.
  if (topology_.num_hosts() > 1 && o.world_size > 1 && o.shared_memory) {
    DDP_RETURN_IF_ERROR(InitHostSharedMemory(real, exchanged.pids, deadline));
  }
  info_.host_shared_memory = host_shm_ != nullptr;

  // 7. No rank leaves creation while another still connects to it: one that
  // went on and destroyed the communicator at once (its first call refused,
  // say) failed the other's connection (UCX's shared-memory transports
  // attach to the peer's segments as they connect: "Shared memory error").
  DDP_RETURN_IF_ERROR(store_->Set(prefix_ + "connected/" + std::to_string(o.rank), "", deadline));
  std::vector<std::string> connected_keys;
  for (int r = 0; r < o.world_size; ++r) connected_keys.push_back(prefix_ + "connected/" + std::to_string(r));
  DDP_RETURN_IF_ERROR(setup_store_->Wait(connected_keys, deadline));
  ApplyIdlePolicy();
  return Status::Ok();
}

void Communicator::Impl::ApplyIdlePolicy() {
  const topology::IdlePolicy idle =
      topology::ChooseIdlePolicy(real_topology_, options_.rank, options_.busy_threads_per_rank,
                                 available_cpus_, kernel_network_);
  info_.yields_when_idle = idle.yield;
  info_.yields_at_once = idle.at_once;
  info_.busy_threads_per_rank = std::max(1, options_.busy_threads_per_rank);
  if (p2p_) {
    p2p_->set_idle_mode(idle.yield ? ucx::IdleMode::kYield : ucx::IdleMode::kSpin,
                        idle.at_once ? 1 : ucx::P2pOptions{}.idle_polls_before_backoff);
  }
  for (shm::ShmAllReduce* engine : {shm_.get(), host_shm_.get()}) {
    if (engine != nullptr) engine->set_yield_when_idle(idle.yield);
  }
}

shm::ShmOptions Communicator::Impl::SharedMemoryOptions() const {
  shm::ShmOptions shm_options;  // yield_when_idle: ApplyIdlePolicy
  if (options_.chunk_bytes > 0) {
    shm_options.chunk_bytes = options_.chunk_bytes;
    shm_options.staging_bytes = std::min(shm_options.staging_bytes, 16 * options_.chunk_bytes);
    shm_options.rooted_staging_bytes =
        std::min(shm_options.rooted_staging_bytes, 16 * options_.chunk_bytes);
  }
  // Tuning knobs for benchmarks (docs/benchmarks.md), read in Init; equal
  // on every rank.
  if (shm_env_.staging_bytes) shm_options.staging_bytes = *shm_env_.staging_bytes;
  if (shm_env_.spin_us) shm_options.spin_time = std::chrono::microseconds(*shm_env_.spin_us);
  if (shm_env_.chunk_bytes) shm_options.chunk_bytes = std::max<size_t>(4096, *shm_env_.chunk_bytes);
  return shm_options;
}

// The hosts are those of topology_ (what the algorithm choice sees: a
// topology file may describe several on one machine); a host's group takes
// shared memory when all of its ranks are really on this machine, there are
// at least two, every host holds as many, and cross-memory attach works
// between them. All hosts or none: the shared-memory form slices the vector
// differently from the UCX one, so a host on each would disagree.
Status Communicator::Impl::InitHostSharedMemory(const topology::Topology& real,
                                                const std::vector<int>& pids,
                                                Deadline deadline) {
  const CommunicatorOptions& o = options_;
  std::vector<int> host_of_rank(topology_.size());
  for (int r = 0; r < topology_.size(); ++r) host_of_rank[r] = topology_.ranks[r].host;
  DDP_ASSIGN_OR_RETURN(const algorithms::HostGroups groups,
                       algorithms::GroupByHost(*p2p_, host_of_rank));
  bool able = groups.ranks_per_host > 1;
  for (int r : groups.intra) able = able && real.SameHost(r, o.rank);
  std::unique_ptr<shm::ShmAllReduce> engine;
  if (able) {
    shm::ShmOptions shm_options = SharedMemoryOptions();
    shm_options.size = static_cast<int>(groups.intra.size());
    for (size_t i = 0; i < groups.intra.size(); ++i) {
      if (groups.intra[i] == o.rank) shm_options.rank = static_cast<int>(i);
      shm_options.pids.push_back(pids[groups.intra[i]]);
    }
    shm_options.names = groups.intra;  // messages name ranks of the job
    auto made = shm::ShmAllReduce::Create(
        *setup_store_, prefix_ + "shm-host" + std::to_string(groups.intra[0]) + "/", shm_options,
        deadline);
    if (made.ok()) {
      engine = std::move(*made);
    } else if (made.status().code() != StatusCode::kUnavailable) {
      return made.status();
    } else {
      info_.shared_memory_unavailable = made.status().message();
    }
  }
  // Every rank counts itself in "seen" after its verdict in "able"; the
  // last one in posts the total, which every rank waits for: O(1) store
  // calls per rank.
  DDP_RETURN_IF_ERROR(store_->Add(prefix_ + "shm-hosts/able", engine ? 1 : 0, deadline).status());
  DDP_ASSIGN_OR_RETURN(const int64_t seen, store_->Add(prefix_ + "shm-hosts/seen", 1, deadline));
  if (seen == o.world_size) {
    DDP_ASSIGN_OR_RETURN(const int64_t total, store_->Add(prefix_ + "shm-hosts/able", 0, deadline));
    DDP_RETURN_IF_ERROR(store_->Set(prefix_ + "shm-hosts/total", std::to_string(total), deadline));
  }
  DDP_ASSIGN_OR_RETURN(const std::string total, setup_store_->Get(prefix_ + "shm-hosts/total", deadline));
  if (total != std::to_string(o.world_size)) return Status::Ok();
  DDP_ASSIGN_OR_RETURN(p2p::GroupView inter, p2p::GroupView::Create(*p2p_, groups.inter));
  host_inter_ = std::make_unique<p2p::GroupView>(std::move(inter));
  host_shm_ = std::move(engine);
  host_watchdog_ = [this, members = groups.intra](Deadline deadline, int peer) {
    CancelDeferred();
    return Watchdog(deadline, peer >= 0 ? members[static_cast<size_t>(peer)] : -1);
  };
  return Status::Ok();
}

Communicator::Impl::~Impl() { Shutdown(); }

Status Communicator::Impl::RegisterSplit(const std::string& users, const CallOptions& call) {
  // A number first, then the key it names: the reader looks again for a
  // number it counted before its key was set, so a registration cut short
  // between the two hides none of the later ones.
  const Deadline deadline = DeadlineIn(call.timeout.count() > 0 ? call.timeout : options_.timeout);
  const auto failed = [](const Status& why) {
    return Status(why.code(), "registering the new communicators with the rendezvous store: " + why.message());
  };
  StatusOr<int64_t> n = store_->Add(SplitRegistryKey(served_root_prefix_, 0), 1, deadline);
  if (!n.ok()) return failed(n.status());
  if (*n < 1) {
    return failed(InternalError("key \"" + SplitRegistryKey(served_root_prefix_, 0) + "\" counted " +
                                std::to_string(*n) + " registrations after one was added"));
  }
  if (Status set = store_->Set(SplitRegistryKey(served_root_prefix_, *n), users, deadline); !set.ok()) {
    return failed(set);
  }
  return Status::Ok();
}

void Communicator::Impl::ReadRegisteredSplits(std::map<std::string, SplitRegistryRead>& read,
                                              std::vector<std::pair<std::string, int>>& users,
                                              Deadline deadline) {
  std::vector<std::string> roots;
  {
    std::lock_guard lock(server_->mu);
    roots = server_->roots;
  }
  for (const std::string& root : roots) {
    SplitRegistryRead& at = read[root];
    const auto call_by = [&] { return std::min(deadline, DeadlineIn(milliseconds(1000))); };
    StatusOr<int64_t> count = store_->Add(SplitRegistryKey(root, 0), 0, call_by());
    if (!count.ok()) continue;  // read again on the next round, if any
    std::vector<int64_t> numbers = std::move(at.missing);
    at.missing.clear();
    for (; at.next <= *count; ++at.next) numbers.push_back(at.next);
    for (const int64_t n : numbers) {
      const std::string key = SplitRegistryKey(root, n);
      auto value = store_->TryGet(key, call_by());
      if (!value.ok() || !value->has_value()) {
        at.missing.push_back(n);
        continue;
      }
      const std::string& all = **value;
      for (size_t from = 0; from < all.size();) {
        const size_t end = std::min(all.find('\n', from), all.size());
        const std::string_view line = std::string_view(all).substr(from, end - from);
        from = end + 1;
        StatusOr<SplitRegistration> split = ParseSplitRegistration(line);
        if (!split.ok()) {
          // Every rank runs this binary, which writes them: a bug, or a
          // writer that is not this job's. Its ranks cannot be counted.
          std::fprintf(stderr,
                       "[ddp] rank %d: warning: rendezvous store key \"%s\" holds a malformed split "
                       "registration \"%.*s\" (%s); the store is not kept up for its ranks\n",
                       options_.rank, key.c_str(), static_cast<int>(line.size()), line.data(),
                       split.status().message().c_str());
          continue;
        }
        users.emplace_back(split->prefix, split->ranks);
        // Its members, by pid on this host and by rank in the family's first
        // communicator: members_gone in Shutdown tells one that died.
        std::lock_guard lock(server_->mu);
        server_->member_starts.emplace(split->prefix, StartTimes(split->pids));
        server_->member_pids.emplace(split->prefix, std::move(split->pids));
        server_->member_root_ranks.emplace(split->prefix, std::make_pair(root, std::move(split->root_ranks)));
      }
    }
  }
}

std::string Communicator::Impl::NotLeftRanks(const std::vector<std::pair<std::string, int>>& awaited,
                                             bool name_them, Deadline deadline) {
  constexpr size_t kMostNamed = 16;
  std::string all;
  for (const auto& [prefix, ranks] : awaited) {
    StatusOr<int64_t> count = store_->Add(prefix + "left", 0, deadline);
    if (count.ok() && *count >= ranks) continue;
    std::vector<int> missing;
    // Naming them takes a store read per rank.
    bool read_all = count.ok() && name_them;
    for (int r = 0; r < ranks && read_all; ++r) {
      StatusOr<std::optional<std::string>> mark = store_->TryGet(prefix + "left/" + std::to_string(r), deadline);
      if (!mark.ok()) {
        read_all = false;
      } else if (!mark->has_value()) {
        missing.push_back(r);
      }
    }
    const std::string name = prefix.ends_with('/') ? prefix.substr(0, prefix.size() - 1) : prefix;
    std::string part;
    if (!read_all || missing.empty()) {
      part = count.ok() ? std::to_string(ranks - *count) + " of the " + std::to_string(ranks) + " ranks"
                        : "ranks (how many could not be read)";
    } else {
      part = missing.size() == 1 ? "rank " : "ranks ";
      for (size_t i = 0; i < missing.size() && i < kMostNamed; ++i) {
        part += (i == 0 ? "" : ", ") + std::to_string(missing[i]);
      }
      if (missing.size() > kMostNamed) part += " and " + std::to_string(missing.size() - kMostNamed) + " more";
    }
    all += (all.empty() ? "" : "; ") + part + " of communicator '" + name + "'";
  }
  return all;
}

std::string Communicator::Impl::AbortsOfRanksNotLeft(const std::vector<std::pair<std::string, int>>& awaited,
                                                     Deadline deadline) {
  // Whether this process (rank 0 of a family's first communicator, as the
  // one serving the store) is a member of the communicator `prefix`.
  const auto has_this_process = [&](const std::string& prefix) {
    std::lock_guard lock(server_->mu);
    const std::vector<std::string>& roots = server_->roots;
    if (std::find(roots.begin(), roots.end(), prefix) != roots.end()) return true;
    const auto it = server_->member_root_ranks.find(prefix);
    return it != server_->member_root_ranks.end() &&
           std::find(roots.begin(), roots.end(), it->second.first) != roots.end() &&
           std::find(it->second.second.begin(), it->second.second.end(), 0) != it->second.second.end();
  };
  std::string all;
  for (const auto& [prefix, ranks] : awaited) {
    StatusOr<int64_t> count = store_->Add(prefix + "left", 0, deadline);
    if (!count.ok()) return "";
    if (*count >= ranks) continue;
    StatusOr<std::optional<std::string>> posted = store_->TryGet(prefix + "abort", deadline);
    if (!posted.ok()) return "";
    if (!posted->has_value()) {
      // Not aborted: its ranks may go on past a clean stop, unless this
      // process, which has left it, is a member: none of its collectives
      // can run any more, and its ranks only leave, which a stopped store
      // does not hold up.
      if (has_this_process(prefix)) continue;
      return "";
    }
    std::string reason = fault::PeerMonitor::DecodeAbort(**posted).ToString();
    for (size_t at = reason.find(store::kCleanShutdownWords); at != std::string::npos;
         at = reason.find(store::kCleanShutdownWords, at)) {
      reason.replace(at, store::kCleanShutdownWords.size(), "after a shutdown");
    }
    const std::string name = prefix.ends_with('/') ? prefix.substr(0, prefix.size() - 1) : prefix;
    all += (all.empty() ? "" : "; ") + ("communicator '" + name + "': ") + reason;
  }
  return all;
}

void Communicator::Impl::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  const Deadline deadline = DeadlineIn(std::min<milliseconds>(options_.timeout, milliseconds(30000)));
  // What every step after the waits below gets at most, whatever its own
  // bound (kShutdownCloseAllowance).
  const Deadline close_by = deadline + kShutdownCloseAllowance;
  const auto close_within = [&](milliseconds most) { return std::min(DeadlineIn(most), close_by); };
  if (thread_.joinable()) {
    if (Status queued = WaitForQueue(deadline); !queued.ok()) {
      // Calls still queued or running would each run to their own deadline
      // (a call's timeout may be far longer): the abort ends the running
      // one within a watchdog tick and fails the others at once, so the
      // join below keeps to this bound. The peers learn it as they would
      // of any failure, instead of waiting for a rank that is leaving.
      Abort(TimedOutError("the communicator was destroyed while calls were still queued or running "
                          "(" + queued.message() + ")"),
            std::nullopt)
          .IgnoreError();
    }
    {
      std::lock_guard lock(queue_mu_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    thread_.join();
  }
  {
    // Point-to-point calls not finished yet: their handles must not poll a
    // communicator that is going away. A poll running on another thread
    // finishes first (it is short: one try of the worker and one health
    // check); later ones see the gate closed.
    if (internal::BeforePollGateCloses()) internal::BeforePollGateCloses()();
    {
      std::unique_lock close(poll_gate_->mu);
      poll_gate_->closed = true;
    }
    // Only now is the poster joined: a poll that failed just before the
    // gate closed may have started it, and no thread can start another
    // once posters_closed_ is set (a later Abort posts on its own thread).
    std::thread poster;
    {
      std::lock_guard lock(abort_mu_);
      posters_closed_ = true;
      poster = std::move(abort_poster_);
    }
    if (poster.joinable()) poster.join();
    std::lock_guard lock(p2p_works_mu_);
    for (auto& posted : p2p_works_) {
      if (auto state = posted.work.lock()) {
        state->Finish(
            FailedPreconditionError(state->what + ": the communicator was destroyed before the call finished"));
      }
    }
    p2p_works_.clear();
  }
  // Let go of the served store (every holder, whatever else fails here),
  // learning whether this was the last holder in this process.
  bool last_holder = false;
  if (server_ != nullptr) {
    std::lock_guard lock(server_->mu);
    last_holder = --server_->holders == 0;
  }
  // The communicators whose ranks this one waits for (its own, or as the
  // last holder every user of the store), and those of them with ranks that
  // had not left when the wait ended (NotLeftRanks).
  std::vector<std::pair<std::string, int>> awaited = {{prefix_, options_.world_size}};
  std::string not_left;
  if (store_ != nullptr) {
    if (!aborted() && monitor_ != nullptr) {
      monitor_->PostClosed(close_within(options_.abort_store_time));
    }
    // The rank serving the store keeps it up until the others have left
    // (they may still post or read the abort key); bounded. After a failed
    // creation, never past the creation deadline: its Create or Split
    // returns only after this.
    const bool failed = aborted() || creation_failed_;
    Deadline leave_by = close_within(failed ? options_.abort_store_time : milliseconds(2000));
    if (failure_store_by_) leave_by = std::min(leave_by, *failure_store_by_);
    // Which ranks left, for the wait of the rank serving the store (see
    // rest_gone, and members_gone for communicators without it; a
    // launcher's store keeps keys for good): marked before the count, so
    // that a rank counted as left has its mark unless the store failed it
    // in between.
    // Each gets kLeaveMarkTime at least, however late it is: steps before
    // (a queued call run to the deadline, its abort's post) may have used
    // up close_by, and a mark not sent left the rank serving the store
    // waiting for this one, then warning that it had not left. After a
    // failed creation only when its post was over within their shared
    // time: a store that answers slowly still gets the marks (so a failed
    // Create or Split returns at most 2 * kLeaveMarkTime past that time),
    // while one that stalled, having taken all of it, gets no more.
    const auto leave_mark_by = [&] {
      return failure_store_by_ && !failure_store_answered_ ? leave_by
                                                           : std::max(leave_by, DeadlineIn(kLeaveMarkTime));
    };
    if (store_rank_ != -1 && !not_a_member_) {
      store_->Set(prefix_ + "left/" + std::to_string(options_.rank), "", leave_mark_by()).IgnoreError();
    }
    auto left = not_a_member_ ? StatusOr<int64_t>(UnavailableError("not a member"))
                            : store_->Add(prefix_ + "left", 1, leave_mark_by());
    // The last communicator here to hold the server waits for the ranks of
    // every communicator using it (those split off included).
    const Clock::time_point leaving_since = Clock::now();
    if (server_ != nullptr && last_holder) {
      std::lock_guard lock(server_->mu);
      awaited = server_->users;
    }
    if (server_ != nullptr && left.ok()) {
      const bool last = last_holder;
      // After a failed creation that posted no abort, the others may still
      // be on their way to the store to read the reason: they get until
      // the creation deadline, which Create or Split keeps to.
      Deadline wait_until = aborted() ? std::min(deadline, DeadlineIn(kAbortedStoreTimeForLatePeers)) : deadline;
      if (creation_failed_ && creation_deadline_) wait_until = std::min(wait_until, *creation_deadline_);
      if (creation_failed_ && abort_posted_) {
        wait_until = std::min(wait_until, DeadlineIn(kAbortedStoreTimeForLatePeers));
      }
      // Past this, the communicator's own ranks are waited for only while
      // one not yet left may be alive: from the start when it was not
      // aborted (a rank that crashed after this one's last call never
      // leaves, and held this exit for the whole timeout, up to 30 s).
      const Deadline all_until =
          aborted() ? std::min(wait_until, DeadlineIn(kAbortedStoreTime)) : Clock::now();
      // After an abort, a rank of this host that stays stopped counts as
      // gone too (kStoppedPeerTime): per rank, since when every look found
      // it stopped (a look that did not restarts it).
      std::vector<std::optional<Clock::time_point>> stopped_since(local_pids_.size());
      const auto note_stopped = [&] {
        if (!aborted()) return;
        const Clock::time_point now = Clock::now();
        for (size_t r = 0; r < local_pids_.size(); ++r) {
          if (!ProcessStopped(local_pids_[r])) {
            stopped_since[r].reset();
          } else if (!stopped_since[r]) {
            stopped_since[r] = now;
          }
        }
      };
      // Whether the ranks of this communicator that are not counted as left
      // are all gone: exited or, after an abort, stopped (ranks on this
      // host; note_stopped), or, on other hosts, their UCX connection
      // broke. UCX reports that for a process that died, and
      // also for one that closed its endpoint to this rank by force: on
      // leaving, or when a call of its own failed, which it aborts at once,
      // reading the posted reason; after that it uses the store only to
      // leave, best effort. (A link that broke under a process that lives
      // on counts as gone too, at the risk that it still wanted the
      // store: it then reads that the store cannot be reached.) A gone
      // rank that left too (its "left/<rank>" mark) counts once: counted
      // twice, it hid a rank still on its way to read the abort.
      std::vector<int> seen_left;  // gone ranks whose mark was read
      const auto rest_gone = [&](int64_t left) {
        std::vector<int> gone = monitor_ != nullptr ? monitor_->ExitedPeers() : std::vector<int>();
        for (size_t r = 0; r < stopped_since.size(); ++r) {
          if (stopped_since[r] && Clock::now() - *stopped_since[r] >= kStoppedPeerTime) {
            gone.push_back(static_cast<int>(r));
          }
        }
        if (p2p_ != nullptr) {
          for (int r : p2p_->PeersWithFailedEndpoints()) gone.push_back(r);
        }
        std::sort(gone.begin(), gone.end());
        gone.erase(std::unique(gone.begin(), gone.end()), gone.end());
        const int64_t not_left = options_.world_size - left;
        if (static_cast<int64_t>(gone.size()) < not_left) return false;
        int64_t gone_not_left = 0;
        for (int r : gone) {
          if (std::find(seen_left.begin(), seen_left.end(), r) != seen_left.end()) continue;
          auto mark = store_->TryGet(prefix_ + "left/" + std::to_string(r),
                                     std::min(wait_until, DeadlineIn(milliseconds(1000))));
          if (!mark.ok()) return false;  // cannot tell: wait on
          if (mark->has_value()) {
            seen_left.push_back(r);
          } else {
            ++gone_not_left;
          }
        }
        return gone_not_left >= not_left;
      };
      // The same for another communicator using the store: its ranks not
      // yet left are all gone, each without its "left/<rank>" mark. Gone:
      // on this host, exited (by the pids of ServedStore::member_pids); on
      // another host, for a split of this communicator's family at any
      // depth (ServedStore::member_root_ranks), its process's UCX
      // connection to this rank broke while it had not left this
      // communicator (as rest_gone tells it for this communicator's own
      // ranks). Any other rank (on another host, a process this
      // communicator has no connection to, or of a communicator of another
      // family or whose pids are not known here) is waited for by the count
      // alone. A pid taken since by another process counts as gone (its
      // start time differs: ServedStore::member_starts), except one of a
      // split registered in the store taken before the last holder read
      // the registration: that looks alive, and is waited for, to the bound.
      std::map<std::string, std::set<int>> marked;  // per prefix: gone ranks seen left
      std::map<int, int> rank_of_root;  // this communicator's rank of each process it holds
      for (size_t r = 0; r < root_ranks_.size(); ++r) rank_of_root[root_ranks_[r]] = static_cast<int>(r);
      std::set<int> here_left;  // ranks of this communicator seen left (their mark)
      const auto members_gone = [&](const std::string& prefix, int ranks, int64_t left) {
        std::vector<int> pids;
        std::vector<uint64_t> starts;  // by rank, as pids; 0: unknown
        std::vector<int> roots;  // in the family's first communicator, when of this family
        {
          std::lock_guard lock(server_->mu);
          if (auto it = server_->member_pids.find(prefix); it != server_->member_pids.end()) {
            pids = it->second;
          }
          if (auto it = server_->member_starts.find(prefix); it != server_->member_starts.end()) {
            starts = it->second;
          }
          if (auto it = server_->member_root_ranks.find(prefix);
              it != server_->member_root_ranks.end() && it->second.first == served_root_prefix_) {
            roots = it->second.second;
          }
        }
        if (pids.size() != static_cast<size_t>(ranks) && roots.size() != static_cast<size_t>(ranks)) {
          return false;
        }
        const int64_t not_left = ranks - left;
        std::vector<int> gone;
        if (pids.size() == static_cast<size_t>(ranks)) {
          for (size_t r = 0; r < pids.size(); ++r) {
            const uint64_t start = r < starts.size() ? starts[r] : 0;
            if (pids[r] > 0 && ProcessExited(pids[r], start)) gone.push_back(static_cast<int>(r));
          }
        }
        if (p2p_ != nullptr && roots.size() == static_cast<size_t>(ranks)) {
          const std::vector<int> failed = p2p_->PeersWithFailedEndpoints();
          for (size_t r = 0; r < roots.size(); ++r) {
            const auto held = rank_of_root.find(roots[r]);
            if (held == rank_of_root.end()) continue;  // no connection to it here
            const int here = held->second;
            if (std::find(failed.begin(), failed.end(), here) == failed.end()) continue;
            if (here_left.count(here) > 0) continue;
            // A member that left this communicator closed its endpoints to
            // it, which reads the same as a death, while the split may
            // live on and still need the store: counted only without its
            // mark here (set before the endpoints close).
            auto mark = store_->TryGet(prefix_ + "left/" + std::to_string(here),
                                       std::min(wait_until, DeadlineIn(milliseconds(1000))));
            if (!mark.ok()) return false;  // cannot tell: wait on
            if (mark->has_value()) {
              here_left.insert(here);
            } else {
              gone.push_back(static_cast<int>(r));
            }
          }
          std::sort(gone.begin(), gone.end());
          gone.erase(std::unique(gone.begin(), gone.end()), gone.end());
        }
        if (static_cast<int64_t>(gone.size()) < not_left) return false;
        int64_t gone_not_left = 0;
        for (int r : gone) {
          if (marked[prefix].count(r) > 0) continue;
          auto mark = store_->TryGet(prefix + "left/" + std::to_string(r),
                                     std::min(wait_until, DeadlineIn(milliseconds(1000))));
          if (!mark.ok()) return false;  // cannot tell: wait on
          if (mark->has_value()) {
            marked[prefix].insert(r);
          } else {
            ++gone_not_left;
          }
        }
        return gone_not_left >= not_left;
      };
      // Splits registered in the store (made without this rank) are read
      // after the waits: each was registered before its parent's ranks had
      // all left, and one may have split again meanwhile.
      std::map<std::string, SplitRegistryRead> registered;
      for (size_t next = 0; next < awaited.size() && Clock::now() < wait_until;) {
        for (; next < awaited.size(); ++next) {
          const auto& [prefix, ranks] = awaited[next];
          const bool own = prefix == prefix_;
          bool settled = false;  // every rank of `prefix` left or gone
          while (Clock::now() < wait_until) {
            // Another communicator of this process (on another thread, may
            // be) found its own ranks left or gone.
            if (!own) {
              std::lock_guard lock(server_->mu);
              if (server_->settled.count(prefix) > 0) break;
            }
            auto count =
                store_->Add(prefix + "left", 0, std::min(wait_until, DeadlineIn(milliseconds(1000))));
            if (!count.ok()) break;
            if (*count >= ranks) {
              settled = true;
              break;
            }
            if (own) note_stopped();
            if (own && Clock::now() >= all_until && rest_gone(*count)) {
              settled = true;
              break;
            }
            if (!own && Clock::now() >= all_until && members_gone(prefix, ranks, *count)) break;
            std::this_thread::sleep_for(milliseconds(5));
          }
          // Waited for until the deadline counts too: the last holder,
          // waiting for them again, made the waits add up (a rank that
          // lives on but never leaves held each holder to its deadline).
          if (own && (settled || Clock::now() >= wait_until)) {
            std::lock_guard lock(server_->mu);
            server_->settled.insert(prefix_);
          }
        }
        if (last) ReadRegisteredSplits(registered, awaited, wait_until);
      }
    }
    if (server_ != nullptr && last_holder) {
      // The store stops with this communicator: ranks still using it (a
      // split of theirs, or their own calls, running longer than this
      // wait) read why, and which ranks it gave up on, instead of a bare
      // lost connection; this rank says so too.
      // After an abort (or a failed creation) ranks that died are expected
      // not to leave and no warning is printed: their count is enough, and
      // spares every failed job's exit a store read per rank.
      not_left =
          NotLeftRanks(awaited, !aborted() && !creation_failed_, close_within(milliseconds(1000)));
      std::string why = "rank " + std::to_string(options_.rank) + " of communicator '" +
                        prefix_.substr(0, prefix_.size() - 1) + "', which served the rendezvous store, was destroyed " +
                        (aborted()            ? std::string("after the job was aborted")
                         : creation_failed_ ? std::string("after its creation failed")
                                            : std::string(store::kCleanShutdownWords)) +
                        " and stopped the store";
      if (!not_left.empty()) {
        const auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - leaving_since);
        why += " after waiting " + std::to_string(waited.count()) + " ms for every rank to leave; " +
               not_left + " had not left";
        // After an abort or a failed creation, ranks that never leave (they
        // died, or gave up) are what was expected; after a clean shutdown
        // they are ranks the store went away under.
        if (!aborted() && !creation_failed_) {
          why += " (destroy every communicator on every rank before rank " + std::to_string(options_.rank) +
                 "'s)";
          std::fprintf(stderr, "[ddp] rank %d: warning: %s\n", options_.rank, why.c_str());
        }
      }
      std::lock_guard lock(server_->mu);
      server_->closing_reason = std::move(why);
      server_->closing_clean = !aborted() && !creation_failed_;
    }
  }
  shm_.reset();
  host_shm_.reset();
  staging_.clear();  // waits (bounded) for its copies; the async thread is gone
  ipc_.clear();
  ring_view_.reset();
  host_inter_.reset();
  // After an abort (or a failed creation), endpoints to other hosts close
  // without flushing: the host may be unreachable, and its peers have given
  // up on us anyway.
  if (p2p_ != nullptr) {
    // UCX cannot detect the death of a rank on this host, and a flush
    // towards it never completes; its endpoint must be forced closed.
    if (monitor_ != nullptr) {
      for (int r : monitor_->ExitedPeers()) {
        p2p_->MarkPeerLost(r, PeerLostError("rank " + std::to_string(r) + " exited"));
      }
    }
    p2p_->Close(close_within(milliseconds(2000)), aborted() || creation_failed_).IgnoreError();
  }
  p2p_.reset();
  monitor_.reset();
  if (server_ != nullptr && last_holder && store_ != nullptr && !not_left.empty() && !aborted() &&
      !creation_failed_) {
    // A communicator that ranks still use, aborted before the store stops
    // (a split without this rank, say): its ranks that have not yet read
    // the reason would find a cleanly stopped store, which tells no abort,
    // and wait out their deadlines. Read as late as can be, just before the
    // stop, so that an abort posted during the wait above counts too.
    const std::string aborts = AbortsOfRanksNotLeft(awaited, close_within(milliseconds(1000)));
    if (!aborts.empty()) {
      std::lock_guard lock(server_->mu);
      server_->closing_clean = false;
      server_->closing_reason = "rank " + std::to_string(options_.rank) + " of communicator '" +
                                prefix_.substr(0, prefix_.size() - 1) +
                                "', which served the rendezvous store, was destroyed and stopped the store while " +
                                not_left + " had not left, and their communicators had been aborted: " + aborts;
      std::fprintf(stderr, "[ddp] rank %d: warning: %s\n", options_.rank, server_->closing_reason.c_str());
    }
  }
  store_.reset();
  server_.reset();
}

Status Communicator::Impl::Abort(const Status& reason, std::optional<Deadline> call_deadline) {
  // A forked child must not post to the parent's job.
  DDP_RETURN_IF_ERROR(fork::CheckNotForkedChild("rank " + std::to_string(options_.rank) +
                                                ": aborting the communicator"));
  // Aborted already: that reason stands, without asking the store again
  // (a store that stopped answering held every later failing call up to
  // abort_store_time).
  if (aborted()) return aborted_reason();
  // The job's first reason wins: a failure seen here may only be the echo
  // of another rank's (it reported, left, and its endpoints reset ours).
  Status first = reason;
  bool post = false;  // whether `first` is this rank's to post
  // Outside a call, reading the job's reason and posting this one share
  // one abort_store_time: with a store that stopped answering, each took
  // all of it, and Abort twice that. The read (with the look for a lost
  // peer's cause, up to kEchoGrace) gets only the first half, so that the
  // post keeps the second: a look that used it all left the post none.
  const Deadline store_by = DeadlineIn(options_.abort_store_time);
  if (monitor_ != nullptr) {
    const Deadline deadline = call_deadline.value_or(DeadlineIn(options_.abort_store_time / 2));
    Status posted = monitor_->PostedAbort(deadline);
    post = posted.ok();
    first = post ? LocalCause(reason, deadline) : posted;
  }
  {
    std::lock_guard lock(abort_mu_);
    if (!aborted_.ok()) return aborted_;
    aborted_ = first;
    is_aborted_.store(true, std::memory_order_release);
    if (!post) return first;
    if (call_deadline && !posters_closed_) {
      // Only the rank that set aborted_ gets here, once.
      abort_poster_ = std::thread([monitor = monitor_.get(), first,
                                   time = options_.abort_store_time] {
        monitor->PostAbort(first, DeadlineIn(time));
      });
      return first;
    }
  }
  monitor_->PostAbort(first, store_by);
  return first;
}

Status Communicator::Impl::LocalCause(const Status& reason, Deadline deadline) {
  if (reason.code() != StatusCode::kPeerLost) return reason;
  // A lost connection may be the echo of a failure elsewhere: the rank that
  // saw it first cancels its messages, which resets its connections to us,
  // before its reason reaches the store. Give the cause a moment to show: a
  // posted reason, or a process on this host that died.
  const Deadline until = std::min(deadline, Clock::now() + kEchoGrace);
  Status seen = monitor_->Check(until);
  while (seen.ok() && Clock::now() + kEchoPoll < until) {
    std::this_thread::sleep_for(kEchoPoll);
    seen = monitor_->Check(until);
  }
  if (seen.ok() || seen.code() == StatusCode::kTimedOut ||
      reason.message().find(seen.message()) != std::string::npos) {
    return reason;
  }
  return Status(seen.code(), seen.message() + "; this rank saw it as: " + reason.message());
}

bool Communicator::Impl::InsideCall() const { return running_under_run_mu == this; }

Status Communicator::Impl::CheckNotInsideCall(const std::string& what) const {
  if (!InsideCall()) return Status::Ok();
  return FailedPreconditionError(
      what + " called from inside AllReduceThrough's slice function, which runs inside a call of "
             "the same communicator and holds it: the slice function must not call its "
             "communicator");
}

Status Communicator::Impl::RunGuarded(const Body& body, Deadline deadline) {
  // An exception (a scratch allocation that fails) becomes the call's
  // error and so aborts the communicator: escaping the communicator's
  // thread it would end the process, and escaping a blocking call it would
  // leave this rank a collective behind its peers, which wait until their
  // deadline.
  try {
    return body(deadline);
  } catch (const std::exception& e) {
    return InternalError(std::string("the call threw ") + e.what());
  } catch (...) {
    return InternalError("the call threw an exception");
  }
}

Status Communicator::Impl::WaitForQueue(Deadline deadline, bool their_time) {
  std::unique_lock lock(queue_mu_);
  auto until = [&] { return their_time ? std::max(deadline, queue_done_by_) : deadline; };
  while (unfinished_ > 0) {
    if (Clock::now() >= until()) {
      return TimedOutError(their_time ? "earlier asynchronous calls did not finish within their own "
                                        "timeouts (counted from when each could start)"
                                      : "earlier asynchronous calls did not finish before the deadline");
    }
    queue_cv_.wait_until(lock, until());
  }
  return Status::Ok();
}

Status Communicator::Impl::RunBlocking(const CallOptions& call, const Body& body) {
  DDP_RETURN_IF_ERROR(fork::CheckNotForkedChild("rank " + std::to_string(options_.rank) +
                                                ": a collective call"));
  DDP_RETURN_IF_ERROR(CheckNotInsideCall("a collective"));
  if (aborted()) return aborted_reason();
  {
    // Keep issue order: calls issued before this one run first. As an
    // async call's, this call's deadline counts from when it can start:
    // waiting its turn is bounded by the earlier calls' own deadlines
    // instead (or this call's from now, if later), so a call behind a
    // queue of long all-reduces does not time out (and abort) merely for
    // waiting.
    std::unique_lock lock(queue_mu_);
    if (unfinished_ > 0) {
      lock.unlock();
      // Returning without running the body would leave this rank a
      // collective behind its peers, and its next call paired with the
      // wrong one of theirs: the communicator fails instead.
      const Deadline issued = DeadlineFor(call);
      if (Status queued = WaitForQueue(issued, /*their_time=*/true); !queued.ok()) {
        return Abort(queued, issued);
      }
    }
  }
  const Deadline deadline = DeadlineFor(call);
  std::unique_lock run(run_mu_, std::defer_lock);
  if (!run.try_lock_until(deadline)) {
    // Another thread's call held the communicator past this one's deadline;
    // this rank would now be a collective behind its peers.
    return Abort(TimedOutError("the communicator was busy with another thread's call until this "
                               "call's deadline"),
                 deadline);
  }
  CancelDeferred();
  if (aborted()) return aborted_reason();
  Status status;
  {
    RunningUnderRunMu holding(this);
    status = RunGuarded(body, deadline);
  }
  if (!status.ok()) return Abort(status, deadline);
  return status;
}

Work Communicator::Impl::Enqueue(const CallOptions& call, std::string what, Body body) {
  auto state = std::make_shared<Work::State>();
  state->what = std::move(what);
  state->owner = this;
  Work work = Communicator::NewWork(state);
  if (Status forked = fork::CheckNotForkedChild("rank " + std::to_string(options_.rank) +
                                                ": an asynchronous collective call");
      !forked.ok()) {
    state->Finish(forked);
    return work;
  }
  if (Status inside = CheckNotInsideCall("asynchronous " + state->what); !inside.ok()) {
    state->Finish(inside);
    return work;
  }
  if (aborted()) {
    state->Finish(aborted_reason());
    return work;
  }
  const milliseconds timeout = call.timeout.count() > 0 ? call.timeout : options_.timeout;
  {
    std::lock_guard lock(queue_mu_);
    ++unfinished_;
    // The deadline counts from when the call starts running, so a queue of
    // bucketed all-reduces does not time out merely for waiting its turn.
    // Counted from now when nothing else is queued or running: an earlier
    // call that ended before its far deadline (an unbounded timeout keeps
    // queue_done_by_ at Deadline::max()) must not loosen the bound for
    // good.
    const Deadline base = unfinished_ == 1 ? Clock::now() : std::max(queue_done_by_, Clock::now());
    queue_done_by_ = DeadlineAfter(DeadlineAfter(base, timeout), kQueuedCallAllowance);
    queue_.push_back([this, state, timeout, body = std::move(body)] {
      Status status;
      if (aborted()) {
        status = aborted_reason();
      } else {
        // The deadline counts from here, and waiting for a blocking call
        // that another thread runs counts against it: so the call ends by
        // its own deadline, within the queue_done_by_ that a blocking call
        // behind it waits for. Had it to give up, this rank would be a
        // collective behind its peers: as in RunBlocking, it aborts.
        const Deadline deadline = DeadlineIn(timeout);
        std::unique_lock run(run_mu_, std::defer_lock);
        if (!run.try_lock_until(deadline)) {
          status = Abort(TimedOutError("asynchronous " + state->what +
                                       ": the communicator was busy with another thread's call "
                                       "until this call's deadline"),
                         deadline);
        } else {
          CancelDeferred();
          RunningUnderRunMu holding(this);
          status = aborted() ? aborted_reason() : RunGuarded(body, deadline);
          if (!status.ok()) status = Abort(status, deadline);
        }
      }
      state->Finish(status);
    });
    if (!thread_.joinable()) {
      thread_ = std::thread([this] {
        if (options_.bind_to_core) BindToCore(options_.local_rank);
        AsyncLoop();
      });
    }
  }
  queue_cv_.notify_all();
  return work;
}

void Communicator::Impl::AsyncLoop() {
  std::unique_lock lock(queue_mu_);
  while (true) {
    queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping with nothing left
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    task();
    lock.lock();
    --unfinished_;
    queue_cv_.notify_all();
  }
}

Algorithm Communicator::Impl::Choose(size_t bytes, Algorithm requested) const {
  return internal::ChooseAllReduce({.bytes = bytes,
                                    .requested = requested,
                                    .configured = options_.algorithm,
                                    .shared_memory = shm_ != nullptr,
                                    .host_shared_memory = host_shm_ != nullptr},
                                   topology_);
}

Status Communicator::Impl::AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                                     ReduceOp op, Algorithm requested, Deadline deadline) {
  // The op the ranks compare: the caller's, also where it is rewritten (an
  // f16 average summed after dividing must not agree with a plain sum).
  std::optional<ReduceOp> checked_op;
  if (DividesFirst(dtype, op)) {
    if (recv != send) std::memcpy(recv, send, count * DataTypeSize(dtype));
    reduce::DivideInPlace(dtype, recv, count, options_.world_size);
    send = recv;
    checked_op = op;
    op = ReduceOp::kSum;
  }
  const Algorithm algorithm = Choose(count * DataTypeSize(dtype), requested);
  if (algorithm == Algorithm::kSharedMemory) {
    ++sequence_;  // keeps collective numbering equal on every path
    return shm_->AllReduce(send, recv, count, dtype, op, deadline, watchdog_, checked_op);
  }
  algorithms::CollectiveArgs args = Args(send, recv, count, dtype, op, 0, deadline);
  if (checked_op) args.tuning.checked_op = checked_op;
  if (algorithm == Algorithm::kHierarchical) {
    if (host_shm_ != nullptr) {
      // A rank whose host step failed aborts before it waits for its host's
      // ranks: its inter-host peers' waits read the job's abort reason
      // (the UCX watchdog), and would otherwise wait for it until their
      // deadline. The call's own failure then returns the same reason.
      const auto abort = [this, deadline](const Status& error) {
        Abort(error, deadline).IgnoreError();
      };
      return internal::RunHierarchicalThroughShm(*host_shm_, *host_inter_, options_.world_size,
                                                 args, host_watchdog_, abort);
    }
    return internal::RunHierarchicalAllReduce(*p2p_, topology_, args);
  }
  // Rings run in topology order: each hop stays on the fastest link.
  return internal::RunAllReduce(algorithm, *ring_view_, args);
}

Status Communicator::Impl::AllReduceThrough(const void* send, void* recv, size_t count,
                                            DataType dtype, ReduceOp op, const SliceFn& user_apply,
                                            Algorithm requested, Deadline deadline) {
  // An exception from the function becomes the call's error, so that the
  // peers hear of it as of any failure instead of waiting for this rank.
  const SliceFn apply = [&user_apply](const void* reduced, void* out, size_t offset,
                                      size_t n) -> Status {
    try {
      return user_apply(reduced, out, offset, n);
    } catch (const std::exception& e) {
      return InternalError(std::string("all-reduce-through: the slice function threw: ") + e.what());
    } catch (...) {
      return InternalError("all-reduce-through: the slice function threw");
    }
  };
  const size_t elem = DataTypeSize(dtype);
  const int size = options_.world_size;
  const shm::SliceRange mine = shm::SliceOf(count, elem, size, options_.rank);
  char* out = static_cast<char*>(recv) + mine.begin * elem;
  if (size == 1) {
    // The function's `reduced` must not be `out`: a copy of send.
    std::vector<char> reduced(static_cast<const char*>(send),
                              static_cast<const char*>(send) + count * elem);
    return apply(reduced.data(), out, 0, count);
  }
  std::optional<ReduceOp> checked_op;  // as AllReduce's
  if (DividesFirst(dtype, op)) {
    // As AllReduce: the f16 sum of the divided values, not the mean of
    // their sum, which passes 65504 first. On a copy: recv must keep its
    // values for the slice function, and send may be recv.
    through_divided_.assign(static_cast<const char*>(send), static_cast<const char*>(send) + count * elem);
    reduce::DivideInPlace(dtype, through_divided_.data(), count, size);
    send = through_divided_.data();
    checked_op = op;
    op = ReduceOp::kSum;
  }
  if (Choose(count * elem, requested) == Algorithm::kSharedMemory) {
    ++sequence_;  // keeps collective numbering equal on every path
    return shm_->AllReduceApply(send, recv, count, dtype, op, apply, deadline, watchdog_, checked_op);
  }
  // Elsewhere: equal blocks (the slices, the last ones padded with zeros
  // that no slice reads) through the reduce-scatter and all-gather
  // algorithms, on scratch copies (recv must keep its values for the slice
  // function). Each gathered block carries its rank's outcome in a word
  // after the slice, so every rank learns of a failed slice function
  // without another collective; a failed rank still takes part in the
  // all-gather, and no peer is left waiting for it.
  const size_t block = shm::SliceOf(count, elem, size, 0).end;
  const size_t wide = block * elem + sizeof(int32_t);  // bytes of a gathered block
  std::vector<char>& whole = through_whole_;
  std::vector<char>& slice = through_slice_;
  whole.resize(wide * static_cast<size_t>(size));  // more than block * size elements
  slice.resize(wide);
  if (count > 0) std::memcpy(whole.data(), send, count * elem);
  std::memset(whole.data() + count * elem, 0, (block * static_cast<size_t>(size) - count) * elem);
  algorithms::CollectiveArgs scatter_args = Args(whole.data(), slice.data(), block, dtype, op, 0, deadline);
  if (checked_op) scatter_args.tuning.checked_op = checked_op;
  DDP_RETURN_IF_ERROR(internal::RunReduceScatter(*p2p_, scatter_args));
  const size_t mine_bytes = (mine.end - mine.begin) * elem;
  const Status applied = apply(slice.data(), out, mine.begin, mine.end - mine.begin);
  if (mine_bytes > 0) std::memcpy(slice.data(), out, mine_bytes);
  const int32_t outcome = applied.ok() ? 0 : 1;
  std::memcpy(slice.data() + block * elem, &outcome, sizeof(outcome));
  DDP_RETURN_IF_ERROR(internal::RunAllGather(
      *p2p_, Args(slice.data(), whole.data(), wide, DataType::kU8, ReduceOp::kSum, 0, deadline)));
  DDP_RETURN_IF_ERROR(applied);
  for (int r = 0; r < size; ++r) {
    int32_t failed = 0;
    std::memcpy(&failed, whole.data() + static_cast<size_t>(r) * wide + block * elem, sizeof(failed));
    if (failed != 0) {
      return InternalError("all-reduce-through: the slice function failed on rank " + std::to_string(r));
    }
  }
  for (int r = 0; r < size; ++r) {
    const shm::SliceRange range = shm::SliceOf(count, elem, size, r);
    if (range.end > range.begin) {
      std::memcpy(static_cast<char*>(recv) + range.begin * elem, whole.data() + static_cast<size_t>(r) * wide,
                  (range.end - range.begin) * elem);
    }
  }
  return Status::Ok();
}

Status Communicator::Impl::Broadcast(void* buffer, size_t count, DataType dtype, int root,
                                     Deadline deadline, bool host_memory) {
  if (shm_ != nullptr && host_memory) {
    ++sequence_;  // keeps collective numbering equal on every path
    return shm_->Broadcast(buffer, count, dtype, root, deadline, watchdog_);
  }
  // In topology order, as the reduce's: the chain then leaves each host
  // once, and the argument check meets the other collectives' (a rank
  // running another collective fails at once rather than at the deadline).
  algorithms::CollectiveArgs args = Args(buffer, buffer, count, dtype, ReduceOp::kSum, root, deadline);
  if (ring_is_rank_order_) return internal::RunBroadcast(*p2p_, args);
  args.root = static_cast<int>(std::find(ring_order_.begin(), ring_order_.end(), root) - ring_order_.begin());
  args.tuning.checked_root = root;
  return internal::RunBroadcast(*ring_view_, args);
}

Status Communicator::Impl::AllGather(const void* send, void* recv, size_t count, DataType dtype,
                                     Deadline deadline) {
  auto [p2p, args] = OnRing(Args(send, recv, count, dtype, ReduceOp::kSum, 0, deadline));
  return internal::RunAllGather(p2p, args);
}

Status Communicator::Impl::ReduceScatter(const void* send, void* recv, size_t count,
                                         DataType dtype, ReduceOp op, Deadline deadline) {
  if (DividesFirst(dtype, op)) {
    const size_t total = count * static_cast<size_t>(options_.world_size);
    std::vector<uint16_t> divided(static_cast<const uint16_t*>(send), static_cast<const uint16_t*>(send) + total);
    reduce::DivideInPlace(dtype, divided.data(), total, options_.world_size);
    auto [p2p, args] = OnRing(Args(divided.data(), recv, count, dtype, ReduceOp::kSum, 0, deadline));
    args.tuning.checked_op = op;  // not to agree with a plain sum
    return internal::RunReduceScatter(p2p, args);
  }
  auto [p2p, args] = OnRing(Args(send, recv, count, dtype, op, 0, deadline));
  return internal::RunReduceScatter(p2p, args);
}

Status Communicator::Impl::Barrier(Deadline deadline) {
  if (shm_ != nullptr) {
    ++sequence_;
    return shm_->Barrier(deadline, watchdog_);
  }
  // On the ring's order, where the other collectives check their
  // neighbours' arguments.
  return internal::RunBarrier(ring_is_rank_order_ ? static_cast<p2p::PointToPoint&>(*p2p_) : *ring_view_,
                              Args(nullptr, nullptr, 0, DataType::kU8, ReduceOp::kSum, 0, deadline));
}

StatusOr<int> Communicator::Impl::CheckRooted(Rooted which, const void* send, const void* recv,
                                              size_t count, DataType dtype, ReduceOp op, int root,
                                              const CallOptions& call) {
  const Algorithm algorithm = call.algorithm;
  const std::string what = which == Rooted::kReduce   ? "reduce"
                           : which == Rooted::kGather ? "gather"
                                                      : "scatter";
  DDP_RETURN_IF_ERROR(CheckTypes(dtype, op, which == Rooted::kReduce, what));
  DDP_RETURN_IF_ERROR(CheckRank(root, (what + " root").c_str()));
  DDP_RETURN_IF_ERROR(CheckCallOptions(call, what, /*chooses_algorithm=*/which == Rooted::kReduce));
  if (which == Rooted::kReduce && algorithm != Algorithm::kAuto && algorithm != Algorithm::kTree &&
      algorithm != Algorithm::kRing && algorithm != Algorithm::kSharedMemory) {
    return InvalidArgumentError("reduce: algorithm " + std::string(AlgorithmName(algorithm)) +
                                " is not auto, tree, ring or shm");
  }
  const bool is_root = options_.rank == root;
  const size_t ranks = static_cast<size_t>(options_.world_size);
  const size_t es = DataTypeSize(dtype);
  const size_t blocks = which == Rooted::kReduce ? 1 : ranks;
  if (count > std::numeric_limits<size_t>::max() / es / blocks) {
    return InvalidArgumentError(what + ": count " + std::to_string(count) + " times " +
                                std::to_string(blocks) + " blocks of " + DataTypeName(dtype) +
                                " overflows the address space");
  }
  // Elements each buffer holds on this rank (0: not used here).
  const size_t whole = blocks * count;
  const size_t send_elems = which == Rooted::kScatter ? (is_root ? whole : 0) : count;
  const size_t recv_elems = which == Rooted::kScatter ? count : (is_root ? whole : 0);
  // From here on, local checks: the root's buffers differ from the others'.
  auto local = [&]() -> StatusOr<int> {
    DDP_RETURN_IF_ERROR(CheckBuffer(send, send_elems, (what + " send buffer").c_str()));
    DDP_RETURN_IF_ERROR(CheckBuffer(recv, recv_elems, (what + " receive buffer").c_str()));
    // Aligned as the other collectives' buffers (the reduce folds them in
    // place as typed elements), and overlapping only in place: at the
    // root's own block (reduce: the whole vector).
    const auto own = static_cast<std::ptrdiff_t>(
        which == Rooted::kReduce ? 0 : static_cast<size_t>(root) * count * es);
    DDP_RETURN_IF_ERROR(CheckLayout(send, send_elems, recv, recv_elems, dtype,
                                    which == Rooted::kScatter ? own : -own,
                                    which == Rooted::kReduce   ? "send == recv"
                                    : which == Rooted::kGather ? "send == recv + root * count"
                                                               : "recv == send + root * count",
                                    what.c_str()));
    // Only the buffers this rank uses: the others may be null or anything.
    return DeviceOf({send_elems > 0 ? send : nullptr, recv_elems > 0 ? recv : nullptr},
                    std::max(send_elems, recv_elems), what.c_str());
  };
  return Refuse(local(), call);
}

Status Communicator::Impl::RunRooted(Rooted which, int device, const void* send, void* recv,
                                     size_t count, DataType dtype, ReduceOp op, int root,
                                     Algorithm algorithm, Deadline deadline) {
  auto host = [&](const void* s, void* r, size_t n) -> Status {
    switch (which) {
      case Rooted::kReduce: return Reduce(s, r, n, dtype, op, root, algorithm, deadline);
      case Rooted::kGather: return Gather(s, r, n, dtype, root, deadline);
      case Rooted::kScatter: return Scatter(s, r, n, dtype, root, deadline);
    }
    return InternalError("unknown rooted collective");
  };
  if (device < 0) return host(send, recv, count);
  // Through the slots even when UCX moves device memory: the reduce needs
  // the host's arithmetic, and gather and scatter are rare enough on GPUs
  // (object collectives, evaluation) not to need a direct path yet.
  const cuda::StagedKind kind = which == Rooted::kReduce   ? cuda::StagedKind::kReduce
                                : which == Rooted::kGather ? cuda::StagedKind::kGather
                                                           : cuda::StagedKind::kScatter;
  const cuda::StagedCall call{.kind = kind, .send = send, .recv = recv, .count = count,
                              .dtype = dtype, .rank = options_.rank,
                              .size = options_.world_size, .root = root, .op = op};
  Status status = Staged(device, call, host, deadline);
  if (status.ok()) return status;
  const char* name = which == Rooted::kReduce ? "reduce" : which == Rooted::kGather ? "gather" : "scatter";
  return Status(status.code(), std::string(name) + " of device " + std::to_string(device) +
                                   " buffers (staged through host memory) on rank " +
                                   std::to_string(options_.rank) + ": " + status.message());
}

Status Communicator::Impl::Reduce(const void* send, void* recv, size_t count, DataType dtype,
                                  ReduceOp op, int root, Algorithm requested, Deadline deadline) {
  if (options_.rank != root) recv = nullptr;
  std::vector<uint16_t> divided;
  std::optional<ReduceOp> checked_op;  // as AllReduce's
  if (DividesFirst(dtype, op)) {
    divided.assign(static_cast<const uint16_t*>(send), static_cast<const uint16_t*>(send) + count);
    reduce::DivideInPlace(dtype, divided.data(), count, options_.world_size);
    send = divided.data();
    checked_op = op;
    op = ReduceOp::kSum;
  }
  if (ChooseReduce(count * DataTypeSize(dtype), requested) == Algorithm::kSharedMemory) {
    ++sequence_;  // keeps collective numbering equal on every path
    return shm_->Reduce(send, recv, count, dtype, op, root, deadline, watchdog_, checked_op);
  }
  const Algorithm algorithm = ChooseReduce(count * DataTypeSize(dtype), requested);
  algorithms::CollectiveArgs args = Args(send, recv, count, dtype, op, root, deadline);
  if (checked_op) args.tuning.checked_op = checked_op;
  // Both in topology order, as the all-reduce's, the root by its place in
  // it (errors name its rank): the ring reduce checks its ring
  // predecessor's arguments, the tree reduce every rank's (CheckEveryRank),
  // and the ring's ranks post the tree's check rounds too, so a rank that
  // took the other (another CallOptions::algorithm, or a count past the
  // tree's size) fails every tree rank and its ring neighbours at once; the
  // other ring ranks learn it from the abort that follows.
  args.root = static_cast<int>(std::find(ring_order_.begin(), ring_order_.end(), root) -
                               ring_order_.begin());
  args.tuning.checked_root = root;
  if (algorithm == Algorithm::kTree) return algorithms::TreeReduce(*ring_view_, args);
  return algorithms::RingReduce(*ring_view_, args);
}

Status Communicator::Impl::Gather(const void* send, void* recv, size_t count, DataType dtype,
                                  int root, Deadline deadline) {
  if (options_.rank != root) recv = nullptr;
  if (shm_ != nullptr) {
    ++sequence_;
    return shm_->Gather(send, recv, count, dtype, root, deadline, watchdog_);
  }
  return algorithms::Gather(*p2p_, Args(send, recv, count, dtype, ReduceOp::kSum, root, deadline));
}

Status Communicator::Impl::Scatter(const void* send, void* recv, size_t count, DataType dtype,
                                   int root, Deadline deadline) {
  if (options_.rank != root) send = nullptr;
  if (shm_ != nullptr) {
    ++sequence_;
    return shm_->Scatter(send, recv, count, dtype, root, deadline, watchdog_);
  }
  return algorithms::Scatter(*p2p_, Args(send, recv, count, dtype, ReduceOp::kSum, root, deadline));
}

StatusOr<int> Communicator::Impl::DeviceOf(std::initializer_list<const void*> buffers,
                                          size_t count, const char* what) const {
  if (count == 0) return -1;
  static constexpr const char* kPairNames[] = {"send buffer", "receive buffer"};
  std::vector<cuda::CallBuffer> classified;
  for (const void* p : buffers) {
    const char* name = buffers.size() == 2 ? kPairNames[classified.size()] : "buffer";
    classified.push_back({.name = name, .p = p, .kind = cuda::ClassifyPointer(p)});
  }
  return cuda::CallDevice(classified, what);
}

StatusOr<cuda::CopyEngine*> Communicator::Impl::StagingEngine(int device) {
  auto it = staging_.find(device);
  if (it == staging_.end()) {
    // Room for one element of the widest dtype per rank and one more (the
    // reduce-scatter layout), whatever a test asked for, rounded up so that
    // slot 1 and scratch 1 stay aligned.
    const size_t slot = cuda::StagingSlotBytes(
        options_.device_chunk_bytes > 0 ? options_.device_chunk_bytes : kDefaultDeviceChunkBytes,
        options_.world_size);
    DDP_ASSIGN_OR_RETURN(std::unique_ptr<cuda::DeviceCopyEngine> engine,
                         cuda::DeviceCopyEngine::Create(device, slot));
    it = staging_.emplace(device, std::move(engine)).first;
  }
  return it->second.get();
}

StatusOr<cuda::IpcCollectives*> Communicator::Impl::Ipc(int device) {
  if (!options_.cuda_ipc || !single_host_ || options_.world_size < 2 ||
      options_.world_size > cuda::kMaxIpcRanks) {
    return nullptr;
  }
  auto it = ipc_.find(device);
  if (it == ipc_.end()) {
    DDP_ASSIGN_OR_RETURN(std::unique_ptr<cuda::IpcCollectives> ipc,
                         cuda::IpcCollectives::Create(device, options_.rank, options_.world_size));
    it = ipc_.emplace(device, std::move(ipc)).first;
  }
  return it->second.get();
}

cuda::IpcHostSteps Communicator::Impl::IpcSteps(Deadline deadline) {
  return {.all_gather = [this, deadline](const void* mine, void* all, size_t bytes) {
            return AllGather(mine, all, bytes, DataType::kU8, deadline);
          },
          .barrier = [this, deadline] { return Barrier(deadline); }};
}

Status Communicator::Impl::Staged(int device, const cuda::StagedCall& call,
                                  const cuda::HostCollective& host, Deadline deadline) {
  DDP_ASSIGN_OR_RETURN(cuda::CopyEngine* engine, StagingEngine(device));
  return cuda::RunStaged(*engine, call, host, deadline);
}

Status Communicator::Impl::StagedDeviceReduce(int device, const cuda::StagedCall& call,
                                              cuda::StagedPlan plan, Deadline deadline) {
  DDP_ASSIGN_OR_RETURN(cuda::CopyEngine* engine, StagingEngine(device));
  // Over UCX even on one host: the shared-memory engine reduces, and these
  // exchanges only move bytes. Each exchange is a collective of its own
  // (its own tag), checked against the ring predecessor's arguments.
  auto exchange = [&](std::span<const algorithms::ExchangeBlock> blocks, size_t chunk) {
    return algorithms::DirectExchange(
        *p2p_, blocks, Args(nullptr, nullptr, chunk, call.dtype, call.op, 0, deadline));
  };
  return cuda::RunStagedDeviceReduce(*engine, call, exchange,
                                     plan == cuda::StagedPlan::kDeviceReduceDirect, deadline);
}

// Staged all-reduce and reduce-scatter (no CUDA IPC) run one of three
// plans (cuda::ChooseStagedPlan). PCIe crossings per rank for an
// all-reduce of N bytes on p ranks, and who does the arithmetic:
//   host reduce (the default, DDP_STAGED_REDUCE=host): N out, N back = 2N; the host
//     CPU reduces, at memory speed for f32 and slower for f16/bf16 (it
//     converts every element), and the algorithm table (shm, ring, tree)
//     moves the data.
//   device reduce (DDP_STAGED_REDUCE=device, up to 16 ranks): the (p-1)N/p this rank
//     does not own out, the (p-1)N/p received from peers in, its reduced
//     N/p out and the others' (p-1)N/p in = (3p-2)N/p, about 3N: half as
//     much PCIe traffic again, but the CPU never reduces, and every rank
//     sends each segment straight to its owner (p-1 messages at once, the
//     same bytes as a ring). A reduce-scatter of p blocks of N/p bytes
//     crosses 2(p-1)N/p either way (host: (p+1)N/p).
//   device reduce, direct (UCX moves device memory): no staging copies;
//     UCX reads and writes the device buffers and the device scratch.
// Which of the first two is faster depends on PCIe bandwidth against the
// host's reduction speed; neither has been measured on a GPU yet
// (device_allreduce_bench --staged_reduce compares them).
Status Communicator::Impl::DeviceAllReduce(int device, const void* send, void* recv, size_t count,
                                           DataType dtype, ReduceOp op, Algorithm requested,
                                           StagedReduce where, Deadline deadline) {
  DDP_ASSIGN_OR_RETURN(cuda::IpcCollectives* ipc, Ipc(device));
  if (ipc != nullptr) {
    DDP_ASSIGN_OR_RETURN(bool ran,
                         ipc->AllReduce(send, recv, count, dtype, op, IpcSteps(deadline), deadline));
    if (ran) return Status::Ok();
  }
  const cuda::StagedCall call{.kind = cuda::StagedKind::kAllReduce, .send = send, .recv = recv,
                              .count = count, .dtype = dtype, .rank = options_.rank,
                              .size = options_.world_size, .op = op};
  const cuda::StagedPlan plan = Plan(call, where);
  if (plan != cuda::StagedPlan::kHostSlots) return StagedDeviceReduce(device, call, plan, deadline);
  return Staged(device, call, [&](const void* s, void* r, size_t n) {
    return AllReduce(s, r, n, dtype, op, requested, deadline);
  }, deadline);
}

Status Communicator::Impl::DeviceBroadcast(int device, void* buffer, size_t count, DataType dtype,
                                           int root, Deadline deadline) {
  DDP_ASSIGN_OR_RETURN(cuda::IpcCollectives* ipc, Ipc(device));
  if (ipc != nullptr) {
    DDP_ASSIGN_OR_RETURN(bool ran,
                         ipc->Broadcast(buffer, count, dtype, root, IpcSteps(deadline), deadline));
    if (ran) return Status::Ok();
  }
  const cuda::StagedCall call{.kind = cuda::StagedKind::kBroadcast, .send = buffer,
                              .recv = buffer, .count = count, .dtype = dtype,
                              .rank = options_.rank, .size = options_.world_size, .root = root};
  return Staged(device, call, [&](const void*, void* r, size_t n) {
    return Broadcast(r, n, dtype, root, deadline, /*host_memory=*/true);
  }, deadline);
}

Status Communicator::Impl::DeviceAllGather(int device, const void* send, void* recv, size_t count,
                                           DataType dtype, Deadline deadline) {
  DDP_ASSIGN_OR_RETURN(cuda::IpcCollectives* ipc, Ipc(device));
  if (ipc != nullptr) {
    DDP_ASSIGN_OR_RETURN(bool ran,
                         ipc->AllGather(send, recv, count, dtype, IpcSteps(deadline), deadline));
    if (ran) return Status::Ok();
  }
  const cuda::StagedCall call{.kind = cuda::StagedKind::kAllGather, .send = send, .recv = recv,
                              .count = count, .dtype = dtype, .rank = options_.rank,
                              .size = options_.world_size};
  if (Plan(call) == cuda::StagedPlan::kDirect) {
    // UCX moves device memory: a ring all-gather in place on the device
    // buffer. The own block is put in place by the device (the algorithm
    // would move it with the host); waiting for the staging queue also
    // waits for the legacy default stream, so the input is complete before
    // UCX reads it.
    DDP_ASSIGN_OR_RETURN(cuda::CopyEngine* engine, StagingEngine(device));
    const size_t bytes = count * DataTypeSize(dtype);
    auto* own = static_cast<std::byte*>(recv) + options_.rank * bytes;
    if (own != send) DDP_RETURN_IF_ERROR(engine->Copy2D(own, bytes, send, bytes, bytes, 1));
    DDP_RETURN_IF_ERROR(engine->WaitAll(deadline));
    return AllGather(own, recv, count, dtype, deadline);
  }
  return Staged(device, call, [&](const void* s, void* r, size_t n) {
    return AllGather(s, r, n, dtype, deadline);
  }, deadline);
}

Status Communicator::Impl::DeviceReduceScatter(int device, const void* send, void* recv,
                                               size_t count, DataType dtype, ReduceOp op,
                                               StagedReduce where, Deadline deadline) {
  DDP_ASSIGN_OR_RETURN(cuda::IpcCollectives* ipc, Ipc(device));
  if (ipc != nullptr) {
    DDP_ASSIGN_OR_RETURN(bool ran, ipc->ReduceScatter(send, recv, count, dtype, op,
                                                      IpcSteps(deadline), deadline));
    if (ran) return Status::Ok();
  }
  const cuda::StagedCall call{.kind = cuda::StagedKind::kReduceScatter, .send = send,
                              .recv = recv, .count = count, .dtype = dtype,
                              .rank = options_.rank, .size = options_.world_size, .op = op};
  const cuda::StagedPlan plan = Plan(call, where);
  if (plan != cuda::StagedPlan::kHostSlots) return StagedDeviceReduce(device, call, plan, deadline);
  return Staged(device, call, [&](const void* s, void* r, size_t n) {
    return ReduceScatter(s, r, n, dtype, op, deadline);
  }, deadline);
}

Status Communicator::Impl::StageCopy(int device, void* dst, const void* src, size_t bytes,
                                     bool to_device, Deadline deadline) {
  DDP_RETURN_IF_ERROR(CheckNotInsideCall(std::string("staging a copy ") + (to_device ? "to" : "from") +
                                         " device " + std::to_string(device) +
                                         " for a point-to-point message"));
  if (aborted()) return aborted_reason();
  // As PostP2p: a collective on another thread holds the worker for as long
  // as its own deadline allows; this copy waits only until its own.
  std::unique_lock run(run_mu_, std::defer_lock);
  if (!run.try_lock_until(deadline)) {
    return TimedOutError(std::string("staging a copy ") + (to_device ? "to" : "from") +
                         " device " + std::to_string(device) +
                         " for a point-to-point message: the communicator was busy with a "
                         "collective on another thread until the call's deadline");
  }
  CancelDeferred();
  return StageCopyLocked(device, dst, src, bytes, to_device, deadline);
}

Status Communicator::Impl::StageCopyLocked(int device, void* dst, const void* src, size_t bytes,
                                           bool to_device, Deadline deadline) {
  DDP_ASSIGN_OR_RETURN(cuda::CopyEngine* engine, StagingEngine(device));
  std::byte* slot = engine->slot(0);
  auto* out = static_cast<std::byte*>(dst);
  const auto* in = static_cast<const std::byte*>(src);
  auto copy = [&]() -> Status {
    // A staged call whose bounded drain gave up may have left a copy out of
    // slot 0 queued; it must finish before the slot is written.
    DDP_RETURN_IF_ERROR(engine->WaitAll(deadline));
    for (size_t offset = 0; offset < bytes; offset += engine->slot_bytes()) {
      const size_t n = std::min(engine->slot_bytes(), bytes - offset);
      if (to_device) {
        std::memcpy(slot, in + offset, n);
        DDP_RETURN_IF_ERROR(engine->Copy2D(out + offset, n, slot, n, n, 1));
        DDP_RETURN_IF_ERROR(engine->WaitAll(deadline));
      } else {
        DDP_RETURN_IF_ERROR(engine->Copy2D(slot, n, in + offset, n, n, 1));
        DDP_RETURN_IF_ERROR(engine->WaitAll(deadline));
        std::memcpy(out + offset, slot, n);
      }
    }
    return Status::Ok();
  };
  Status status = copy();
  if (!status.ok()) {
    // As RunStaged: a copy still queued must land before the caller gets its
    // buffer back or the slot is reused (bounded: a wedged device must not
    // hang the call).
    engine->WaitAll(std::max(deadline, DeadlineIn(std::chrono::milliseconds(1000)))).IgnoreError();
    return Status(status.code(), std::string(to_device ? "staging a copy to device "
                                                       : "staging a copy from device ") +
                                     std::to_string(device) + ": " + status.message());
  }
  return Status::Ok();
}

Work Communicator::Impl::PostP2p(bool send, void* data, size_t bytes, int peer, uint32_t tag,
                                 const CallOptions& call, bool blocking, Posted* posted,
                                 int device) {
  const std::string what = std::string(send ? "send to" : "receive from") + " rank " +
                           std::to_string(peer) + " (tag " + std::to_string(tag) + ", " +
                           std::to_string(bytes) + " bytes)";
  if (Status forked = fork::CheckNotForkedChild(what); !forked.ok()) {
    return Communicator::FinishedWork(forked);
  }
  if (Status inside = CheckNotInsideCall(what); !inside.ok()) {
    return Communicator::FinishedWork(inside);
  }
  if (aborted()) return Communicator::FinishedWork(aborted_reason());
  const Deadline deadline = DeadlineFor(call);
  StatusOr<p2p::RequestId> id = InternalError("not posted");
  {
    // Posting needs the worker, which a collective on another thread (the
    // communicator's own, for async calls) may hold until its own deadline:
    // wait for it only until this call's. Nothing was posted then, so no
    // peer is paired with a message that never comes: the communicator is
    // not aborted, and the call may be issued again.
    std::unique_lock run(run_mu_, std::defer_lock);
    if (!run.try_lock_until(deadline)) {
      return Communicator::FinishedWork(TimedOutError(
          what + " not posted: the communicator was busy with a collective on another thread "
                 "until this call's deadline"));
    }
    CancelDeferred();
    if (aborted()) return Communicator::FinishedWork(aborted_reason());
    if (device >= 0) {
      // Nothing posted yet: a failure here leaves the communicator usable.
      if (Status ready = DeviceReady(device, deadline); !ready.ok()) {
        return Communicator::FinishedWork(
            Status(ready.code(), what + " not posted: " + ready.message()));
      }
    }
    SweepDroppedP2p();
    id = send ? p2p_->PostUserSend(peer, tag, data, bytes) : p2p_->PostUserRecv(peer, tag, data, bytes);
  }
  if (!id.ok()) return Communicator::FinishedWork(Abort(id.status(), deadline));
  auto state = std::make_shared<Work::State>();
  state->what = what;
  state->owner = this;
  std::weak_ptr<Work::State> weak = state;
  if (!send && !blocking) {
    // The last handle of an unfinished receive is gone: nobody will use
    // what it receives, and its caller may free the buffer as soon as the
    // handle's destructor returns. So the request is cancelled there and
    // then, before any other progress of the worker (a collective, another
    // handle's poll, the communicator's thread) can match a message into
    // that buffer. This takes the worker, and so waits for a collective
    // that another thread is running (bounded by that call's deadline). A
    // communicator already destroyed has cancelled everything itself.
    state->release_unfinished = [this, gate = poll_gate_, id = *id] {
      if (fork::InForkedChild()) return;  // the parent's worker: not ours to touch
      std::shared_lock open(gate->mu);
      if (gate->closed) return;
      if (running_under_run_mu == this) {
        p2p_->Cancel(id);
        return;
      }
      std::lock_guard run(run_mu_);
      p2p_->Cancel(id);  // a no-op when a poll has released it meanwhile
    };
  }
  // The first health check (a store round trip) only once the message has
  // waited a while: most complete within microseconds, and a check on the
  // first unfinished poll made small messages 20-50x slower.
  auto next_watchdog = std::make_shared<Clock::time_point>(Clock::now() + kP2pWatchdogAfter);
  // One poll: a short hold of the worker, so that the communicator's thread
  // can run queued collectives between polls (the peer may need them done
  // before it sends what this request waits for).
  state->poll = [this, gate = poll_gate_, weak, id = *id, deadline, what, next_watchdog, peer] {
    std::shared_ptr<Work::State> state = weak.lock();
    if (state == nullptr) return;
    std::shared_lock open(gate->mu);
    if (gate->closed) {
      state->Finish(FailedPreconditionError(what + ": the communicator was destroyed before the call finished"));
      return;
    }
    if (state->failing.load()) {
      sched_yield();  // the poll that found the failure finishes the call
      return;
    }
    Status failure;
    {
      // Briefly: the communicator's thread may be inside a collective, and
      // the caller's Work::Wait checks its own deadline between polls.
      std::unique_lock run(run_mu_, std::defer_lock);
      if (!run.try_lock_for(kP2pPollHold)) return;
      CancelDeferred();
      if (state->failing.load()) return;
      {
        std::lock_guard lock(state->mu);
        if (state->done) return;
      }
      if (aborted()) {
        p2p_->Cancel(id);
        state->Finish(aborted_reason());
        return;
      }
      StatusOr<bool> done = p2p_->Test(id);
      if (done.ok() && *done) {
        state->Finish(Status::Ok());
        return;
      }
      const Clock::time_point now = Clock::now();
      if (!done.ok()) {
        failure = done.status();
      } else if (now >= deadline) {
        p2p_->Cancel(id);
        failure = TimedOutError(what + " still pending at its deadline");
      } else if (now >= *next_watchdog) {
        *next_watchdog = now + kP2pWatchdogPeriod;
        failure = Watchdog(deadline, peer);
        if (!failure.ok()) {
          // A peer that sent and then exited: its message may be here.
          for (int i = 0; i < 16; ++i) {
            StatusOr<bool> last = p2p_->Test(id);
            if (!last.ok()) break;
            if (*last) {
              state->Finish(Status::Ok());
              return;
            }
          }
          p2p_->Cancel(id);
        }
      }
      if (!failure.ok()) state->failing.store(true);  // the request is released
    }
    if (!failure.ok()) {
      state->Finish(Abort(failure, deadline));
      return;
    }
    sched_yield();
  };
  {
    std::lock_guard lock(p2p_works_mu_);
    p2p_works_.push_back({weak, *id, send, deadline});
  }
  if (posted != nullptr) *posted = {state, *id};
  return Communicator::NewWork(std::move(state));
}

void Communicator::Impl::SweepDroppedP2p() {
  // Requests whose every Work handle is gone: nobody polls them any more.
  // A finished one (already released by its poll, or complete now) is let
  // go, and with it its slot and UCX request. A send still running keeps
  // running (its buffer is the caller's promise, as for MPI_Request_free)
  // until it completes or its deadline passes. A receive is cancelled at
  // once: it would take a message meant for a later receive with the same
  // tag, into a buffer its caller may have freed.
  std::lock_guard lock(p2p_works_mu_);
  const Clock::time_point now = Clock::now();
  std::erase_if(p2p_works_, [&](const PostedP2p& posted) {
    if (!posted.work.expired()) return false;
    if (!posted.send || now >= posted.deadline) {
      p2p_->Cancel(posted.id);  // a no-op for a released id
      return true;
    }
    const StatusOr<bool> done = p2p_->Test(posted.id);
    return !done.ok() || *done;  // a failure is nobody's to report
  });
}

void Communicator::Impl::CancelDeferred() {
  if (!any_deferred_.load(std::memory_order_acquire)) return;
  std::vector<std::shared_ptr<DeferredCancel>> handed;
  {
    std::lock_guard lock(deferred_mu_);
    handed.swap(deferred_);
    any_deferred_.store(false, std::memory_order_release);
  }
  for (const auto& d : handed) p2p_->Cancel(d->id);  // a no-op once released
  {
    std::lock_guard lock(deferred_mu_);
    for (const auto& d : handed) d->cancelled = true;
  }
  deferred_cv_.notify_all();
}

Status Communicator::Impl::BlockingP2p(bool send, void* data, size_t bytes, int peer, uint32_t tag,
                                       const CallOptions& call, std::shared_ptr<void> keep,
                                       int device) {
  const Deadline deadline = DeadlineFor(call);
  Posted posted;
  {
    Work work = PostP2p(send, data, bytes, peer, tag, call, /*blocking=*/true, &posted, device);
    // Polls give up the worker at once while another thread's collective
    // holds it, so this wait keeps to the call's deadline (the allowance
    // lets a poll that has the worker finish its round; a deadline at
    // Deadline::max(), from an unbounded timeout, stays there).
    const Status waited = work.Wait(DeadlineAfter(deadline, kBlockingP2pAllowance));
    if (posted.state == nullptr) return waited;  // refused before posting
    std::lock_guard lock(posted.state->mu);
    if (posted.state->done) return posted.state->status;
    if (waited.code() != StatusCode::kTimedOut) return waited;
  }
  // Still posted, with the caller's buffer, and only the thread holding the
  // worker may touch UCX: take it briefly to cancel, else hand the cancel
  // to its holder (its next watchdog tick inside a wait, or whoever takes
  // the worker next) and wait for that, bounded too.
  const std::string what = std::string(send ? "send to" : "receive from") + " rank " +
                           std::to_string(peer) + " (tag " + std::to_string(tag) + ", " +
                           std::to_string(bytes) + " bytes)";
  std::string released;
  {
    std::unique_lock run(run_mu_, std::defer_lock);
    if (run.try_lock_for(kP2pPollHold)) {
      CancelDeferred();
      p2p_->Cancel(posted.id);  // a no-op when it completed meanwhile
      released = "cancelled; the buffer is the caller's again";
    }
  }
  if (released.empty()) {
    auto handed = std::make_shared<DeferredCancel>();
    handed->id = posted.id;
    handed->keep = std::move(keep);
    std::unique_lock lock(deferred_mu_);
    deferred_.push_back(handed);
    any_deferred_.store(true, std::memory_order_release);
    if (deferred_cv_.wait_for(lock, kBlockingP2pAllowance, [&] { return handed->cancelled; })) {
      released = "cancelled by the thread holding the communicator; the buffer is the caller's again";
    } else {
      released = std::string("its cancel is left to the collective holding the communicator on "
                             "another thread, which does it at its next health check (about every "
                             "100 ms while it waits for messages) or when it ends; until then the ") +
                 (send ? "buffer may still be read" : "buffer may still be written");
    }
  }
  return Abort(TimedOutError(what + " not finished by its deadline: the communicator was busy with "
                             "a collective on another thread; " + released),
               deadline);
}

// --------------------------------------------------------- Communicator ----

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() {
  // In a forked child the communicator's threads do not exist, and its UCX
  // endpoints, shared memory and store connection are the parent's: shutting
  // it down would hang or disturb the parent's job. It is left alone.
  if (fork::InForkedChild()) static_cast<void>(impl_.release());
}

namespace {

// The store keys of a communicator made again with the same name on the
// same store (InitProcessGroup after DestroyProcessGroup, or a retry) must
// not meet the previous one's: a store the launcher serves keeps them, and
// the new one would read its peers' old addresses, their "connected" and
// "closed" marks and an old abort reason. Every rank makes its
// communicators in the same order (creation is collective), so counting
// them per process gives each one the same number on every rank.
std::string InstanceKeyName(const CommunicatorOptions& options) {
  static std::mutex mu;
  static auto* made = new std::map<std::string, uint64_t>();
  const std::string store = options.store_host + ":" + std::to_string(options.store_port);
  std::lock_guard lock(mu);
  const uint64_t n = (*made)[store + "/" + options.name]++;
  return n == 0 ? options.name : options.name + "#" + std::to_string(n);
}

}  // namespace

StatusOr<std::unique_ptr<Communicator>> Communicator::Create(const CommunicatorOptions& options) {
  DDP_RETURN_IF_ERROR(fork::CheckNotForkedChild("rank " + std::to_string(options.rank) +
                                                ": creating a communicator"));
  // Refused here, the name is not counted: this rank's next, corrected
  // creation must take the keys the others are still waiting on.
  if (options.name.size() > kMostCreateNameBytes) {
    return InvalidArgumentError("rank " + std::to_string(options.rank) + ": creating the communicator: name of " +
                                std::to_string(options.name.size()) + " bytes is longer than " +
                                std::to_string(kMostCreateNameBytes) + ", the most a communicator's name may have "
                                "(the store's keys leave " + std::to_string(kMostNameBytes) +
                                " bytes, 64 of them kept for the suffixes of Splits and of names made again: \"" +
                                Utf8Prefix(options.name, 32) + "...\")");
  }
  if (Status refused = CheckStoreOptions(options); !refused.ok()) {
    return Status(refused.code(),
                  "rank " + std::to_string(options.rank) + ": creating the communicator: " + refused.message());
  }
  const std::string key_name = InstanceKeyName(options);
  const Deadline deadline = DeadlineIn(options.timeout);
  // A communicator made again where rank 0 serves the store: this rank may
  // have reached rank 0's previous server, which stops once every rank has
  // left the previous communicator, before rank 0 starts the new one on the
  // same port. Losing the store during creation then means "connect again",
  // until the creation deadline (a first creation still fails at once: the
  // store's owner is gone).
  const bool may_meet_a_stopping_server =
      key_name != options.name && options.host_store && options.rank != 0;
  while (true) {
    auto impl = std::make_unique<Impl>(options);
    impl->key_name_ = key_name;
    impl->creation_deadline_ = deadline;
    Status status = impl->Init();
    if (status.ok()) return std::unique_ptr<Communicator>(new Communicator(std::move(impl)));
    const bool store_lost = status.code() == StatusCode::kUnavailable &&
                            status.message().find("connection to the store") != std::string::npos;
    if (may_meet_a_stopping_server && store_lost && Clock::now() + milliseconds(50) < deadline) {
      impl.reset();
      std::this_thread::sleep_for(milliseconds(20));
      continue;
    }
    // Tell the ranks still forming the job instead of letting them time out
    // (their creation waits watch the abort key; see WatchfulStore).
    impl->PostCreationFailure(status);
    return Status(status.code(), "rank " + std::to_string(options.rank) +
                                     ": creating the communicator: " + status.message());
  }
}

StatusOr<std::unique_ptr<Communicator>> Communicator::CreateFromEnvironment(
    CommunicatorOptions defaults) {
  DDP_ASSIGN_OR_RETURN(launch::LaunchEnv env, launch::LaunchEnvFromProcess());
  defaults.rank = env.rank;
  defaults.world_size = env.world_size;
  defaults.local_rank = env.local_rank;
  defaults.local_world_size = env.local_world_size;
  defaults.store_host = env.master_addr;
  defaults.store_port = env.master_port;
  defaults.host_store = !env.store_hosted_by_launcher;
  defaults.job_token = env.job_token;
  // A restarted group must not read what the previous attempt wrote.
  defaults.name = env.StoreKeyPrefix() + defaults.name;
  StatusOr<std::unique_ptr<Communicator>> created = Create(defaults);
  if (!created.ok() && env.store_port_beside_torch_agent) {
    // The port was a guess (torchrun's agent holds MASTER_PORT): say so.
    return Status(created.status().code(),
                  created.status().message() + " (torchrun's agent serves MASTER_PORT=" +
                      std::to_string(env.master_port - 1) +
                      " itself, TORCHELASTIC_USE_AGENT_STORE=True, so rank 0 serves this job's store on " +
                      std::to_string(env.master_port) +
                      "; set DDP_STORE_PORT to a port that is free on MASTER_ADDR)");
  }
  return created;
}

StatusOr<std::unique_ptr<Communicator>> Communicator::Split(int color, int key,
                                                            const CallOptions& call) {
  // Every rank's color and key, in order with this communicator's other
  // collectives. A bad color is this rank's own: it is checked after the
  // exchange, so that every rank refuses the split alike (and the
  // communicator stays usable) instead of leaving the others waiting.
  DDP_RETURN_IF_ERROR(impl_->CheckNotInsideCall("split"));
  DDP_RETURN_IF_ERROR(Impl::CheckCallOptions(call, "split", /*chooses_algorithm=*/false));
  const int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * static_cast<size_t>(size()));
  // The whole split keeps one deadline, counted as a blocking call's (once
  // earlier async calls have finished): the exchange below, the
  // registration and its broadcasts, and the new communicator's creation
  // each get what is left of it. Each used to get the full timeout anew.
  Deadline deadline{};
  DDP_RETURN_IF_ERROR(impl_->RunBlocking(call, [&](Deadline d) {
    deadline = d;
    return impl_->AllGather(mine, all.data(), 2, DataType::kI64, d);
  }));
  // What is left of it for one step (at least 1 ms: 0 would mean the
  // communicator's timeout); a deadline that never comes stays so.
  const auto rest = [&] {
    CallOptions step = call;
    step.timeout = deadline == Deadline::max()
                       ? milliseconds::max()
                       : std::max(milliseconds(1), std::chrono::ceil<milliseconds>(deadline - Clock::now()));
    return step;
  };
  for (int r = 0; r < size(); ++r) {
    if (all[2 * r] < kNoColor) {
      return InvalidArgumentError("split: rank " + std::to_string(r) + " passed color " +
                                  std::to_string(all[2 * r]) +
                                  ", negative (kNoColor, -1, joins no group)");
    }
  }
  // The longest new name, alike on every rank (colors are exchanged):
  // past the store's keys, every rank refuses the split here, naming its
  // cause, instead of each child failing on the name it was given.
  int64_t top_color = 0;
  for (int r = 0; r < size(); ++r) top_color = std::max(top_color, all[2 * r]);
  if (const std::string longest = impl_->key_name_ + "/split" + std::to_string(impl_->splits_) + "/" +
                                  std::to_string(top_color);
      longest.size() > kMostNameBytes) {
    return InvalidArgumentError("split: the new communicator's name \"<this name>" +
                                longest.substr(impl_->key_name_.size()) + "\" would have " +
                                std::to_string(longest.size()) + " bytes, more than the " +
                                std::to_string(kMostNameBytes) + " the store's keys leave: this communicator's " +
                                "name has " + std::to_string(impl_->key_name_.size()) +
                                " bytes (splits of splits add to it; give Create a shorter name)");
  }
  const uint64_t split = impl_->splits_++;  // the same on every rank
  auto child_name = [&](int64_t c) {
    return impl_->key_name_ + "/split" + std::to_string(split) + "/" + std::to_string(c);
  };
  // The store must stay up until every new communicator is done with it,
  // those without the rank serving it too: that rank notes them itself, and
  // where it is not a member (a split of a split it has left), rank 0 here
  // registers them in the store, where it reads them before leaving.
  // This rank's own children are registered before it can post that it left
  // this communicator, so the serving rank, which waits for that, sees them.
  std::map<int64_t, int> ranks_of_color;
  for (int r = 0; r < size(); ++r) {
    if (all[2 * r] != kNoColor) ++ranks_of_color[all[2 * r]];
  }
  const std::string this_split =
      color == kNoColor ? std::string("split") : "split (color " + std::to_string(color) + ")";
  std::vector<int> members;  // ranks of this communicator with this color
  for (int r = 0; r < size(); ++r) {
    if (color != kNoColor && all[2 * r] == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
  const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
  if (impl_->server_ != nullptr) {
    std::lock_guard lock(impl_->server_->mu);
    for (const auto& [c, ranks] : ranks_of_color) {
      impl_->server_->users.emplace_back(child_name(c) + "/", ranks);
      // Its ranks' pids on this host in its rank order (by key, ties by
      // rank here), so that the last holder can tell one that died.
      std::vector<int> of_color;
      for (int r = 0; r < size(); ++r) {
        if (all[2 * r] == c) of_color.push_back(r);
      }
      std::stable_sort(of_color.begin(), of_color.end(),
                       [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
      std::vector<int> pids;
      for (int r : of_color) {
        pids.push_back(static_cast<size_t>(r) < impl_->local_pids_.size() ? impl_->local_pids_[r] : 0);
      }
      std::vector<int> roots;
      for (int r : of_color) roots.push_back(impl_->root_ranks_[static_cast<size_t>(r)]);
      impl_->server_->member_starts.emplace(child_name(c) + "/", StartTimes(pids));
      impl_->server_->member_pids.emplace(child_name(c) + "/", std::move(pids));
      impl_->server_->member_root_ranks.emplace(child_name(c) + "/",
                                                std::make_pair(impl_->served_root_prefix_, std::move(roots)));
    }
  } else if (impl_->store_rank_ == -2 && !ranks_of_color.empty()) {
    // Every rank learns from rank 0 whether the registration went through:
    // had only rank 0 known, the members of the colors without it would
    // make theirs unregistered, and the serving rank could stop the store
    // while they still need it. On a failure none is made, of any color.
    Status registered;
    if (rank() == 0) {
      std::string users;
      for (const auto& [c, ranks] : ranks_of_color) {
        // Its ranks (by key, ties by rank here): their pids on the serving
        // process's host, and their ranks in the family's first
        // communicator.
        std::vector<int> of_color;
        for (int r = 0; r < size(); ++r) {
          if (all[2 * r] == c) of_color.push_back(r);
        }
        std::stable_sort(of_color.begin(), of_color.end(),
                         [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
        SplitRegistration split{.prefix = child_name(c) + "/", .ranks = ranks};
        for (int r : of_color) {
          const size_t at = static_cast<size_t>(r);
          split.pids.push_back(at < impl_->server_host_pids_.size() ? impl_->server_host_pids_[at] : 0);
          split.root_ranks.push_back(impl_->root_ranks_[at]);
        }
        users += FormatSplitRegistration(split);
      }
      registered = impl_->RegisterSplit(users, rest());
    }
    std::string reason = Utf8Prefix(registered.message(), kMostSplitReasonBytes);
    int64_t outcome[2] = {static_cast<int64_t>(registered.code()), static_cast<int64_t>(reason.size())};
    // The outcome's broadcasts wait for rank 0's registration, which may
    // run to rank 0's own deadline, later than that of a rank that came to
    // the split first. A timed-out broadcast aborts this communicator, so
    // they do not get only what is left of the split's deadline: each gets
    // the split's whole timeout and a grace from now. The exchange above
    // ended after rank 0 began the split, so its registration ends within
    // that, and a registration that runs out of time fails only the split.
    const auto outcome_step = [&] {
      CallOptions step = call;
      const milliseconds whole = call.timeout.count() > 0 ? call.timeout : impl_->options_.timeout;
      step.timeout = deadline == Deadline::max() || whole > milliseconds::max() - kSplitOutcomeGrace
                         ? milliseconds::max()
                         : whole + kSplitOutcomeGrace;
      return step;
    };
    Status shared = Broadcast(outcome, 2, DataType::kI64, 0, outcome_step());
    if (shared.ok() && outcome[0] != 0 && outcome[1] > 0) {
      reason.resize(static_cast<size_t>(std::clamp<int64_t>(outcome[1], 0, kMostSplitReasonBytes)));
      shared = Broadcast(reason.data(), reason.size(), DataType::kU8, 0, outcome_step());
    }
    if (!shared.ok()) {
      // This rank cannot tell whether the others make theirs: those of its
      // color that do wait for it, watching the new communicator's abort
      // key (as after a failed Init), where the reason goes.
      const Status why(shared.code(), "learning whether rank 0 registered the new communicators with the "
                                      "rendezvous store: " + shared.message());
      if (color != kNoColor) {
        impl_->store_
            ->CompareSet(child_name(color) + "/abort", std::nullopt,
                         fault::PeerMonitor::EncodeAbort(new_rank, Status(why.code(), "creating its communicator: " +
                                                                                       why.message())),
                         DeadlineIn(impl_->options_.abort_store_time))
            .status()
            .IgnoreError();
      }
      return Status(why.code(), this_split + ": " + why.message());
    }
    if (outcome[0] != 0) {
      const StatusCode code = outcome[0] > 0 && outcome[0] <= static_cast<int64_t>(StatusCode::kResourceExhausted)
                                  ? static_cast<StatusCode>(outcome[0])
                                  : StatusCode::kInternal;
      return Status(code, this_split + ": no communicator was made, of any color: " +
                              (rank() == 0 ? "" : "rank 0 of this communicator failed ") + reason);
    }
  }
  if (color == kNoColor) return std::unique_ptr<Communicator>();

  const Impl& parent = *impl_;
  CommunicatorOptions o = parent.options_;  // as Init settled them
  o.rank = new_rank;
  o.world_size = static_cast<int>(members.size());
  // Local ranks among the members on this rank's (real) host.
  o.local_rank = 0;
  o.local_world_size = 0;
  for (int r : members) {
    if (!parent.real_topology_.SameHost(r, rank())) continue;
    if (r == rank()) o.local_rank = o.local_world_size;
    ++o.local_world_size;
  }
  o.host_store = false;      // the store is served already
  o.bind_to_core = false;    // a pinned creating thread stays pinned
  o.name = child_name(color);
  if (call.timeout.count() > 0) o.timeout = call.timeout;
  auto impl = std::make_unique<Impl>(o);
  impl->key_name_ = o.name;
  impl->creation_deadline_ = deadline;  // what is left of the split's
  impl->server_ = parent.server_;  // its rendezvous store, if this rank serves it
  if (impl->server_ != nullptr) {
    std::lock_guard lock(impl->server_->mu);
    ++impl->server_->holders;  // released in the split's Shutdown
  }
  impl->served_root_prefix_ = parent.served_root_prefix_;
  impl->store_rank_ = parent.store_rank_;
  if (parent.store_rank_ >= 0) {
    const auto it = std::find(members.begin(), members.end(), parent.store_rank_);
    impl->store_rank_ = it == members.end() ? -2 : static_cast<int>(it - members.begin());
  }
  if (!parent.server_host_pids_.empty()) {
    // Init recomputes them where the serving rank is a member.
    for (int r : members) impl->server_host_pids_.push_back(parent.server_host_pids_[static_cast<size_t>(r)]);
  }
  for (int r : members) impl->root_ranks_.push_back(parent.root_ranks_[static_cast<size_t>(r)]);
  impl->place_local_rank_ = parent.place_local_rank_;
  impl->place_local_world_size_ = parent.place_local_world_size_;
  impl->shm_env_ = parent.shm_env_;
  impl->inherits_environment_ = true;
  if (!parent.options_.topology_file.empty()) {
    DDP_ASSIGN_OR_RETURN(impl->described_, topology::Subset(parent.topology_, members));
  }
  if (internal::BeforeSplitCreates()) internal::BeforeSplitCreates()();
  Status status = impl->Init();
  if (!status.ok()) {
    // Posted where the other members' creation waits look (as Create does):
    // before its monitor exists, Abort alone told nobody, and they waited
    // for this rank until the split's timeout.
    impl->PostCreationFailure(status);
    impl->Abort(status, std::nullopt).IgnoreError();
    return Status(status.code(), "rank " + std::to_string(rank()) + ": split (color " +
                                     std::to_string(color) + "): " + status.message());
  }
  impl->options_.timeout = parent.options_.timeout;
  return std::unique_ptr<Communicator>(new Communicator(std::move(impl)));
}

int Communicator::rank() const { return impl_->options_.rank; }
int Communicator::size() const { return impl_->options_.world_size; }
int Communicator::local_rank() const { return impl_->options_.local_rank; }
int Communicator::local_size() const { return impl_->options_.local_world_size; }
const CommunicatorInfo& Communicator::info() const { return impl_->info_; }
void Communicator::SetBusyThreadsPerRank(int busy_threads_per_rank) {
  // A forked child cannot run calls, and a thread of the parent may have held
  // the mutex when it forked.
  if (fork::InForkedChild()) return;
  // From AllReduceThrough's slice function this thread holds run_mu_
  // already (locking it again would wait for itself): the call in flight
  // is its own, and the new policy applies to the rest of it.
  std::unique_lock lock(impl_->run_mu_, std::defer_lock);
  if (!impl_->InsideCall()) lock.lock();
  impl_->options_.busy_threads_per_rank = busy_threads_per_rank;
  impl_->ApplyIdlePolicy();
}
void Communicator::Abort(const Status& reason) {
  // An OK reason would mark the communicator aborted with an OK status:
  // every later call would return OK without moving data, and nothing would
  // reach the peers.
  impl_->Abort(reason.ok() ? AbortedError("Abort was called with an OK status (no reason given)") : reason,
               std::nullopt)
      .IgnoreError();
}
Status Communicator::aborted_reason() const { return impl_->aborted_reason(); }
std::chrono::nanoseconds Communicator::PeerWaitTime() const { return impl_->PeerWaitTime(); }
Algorithm Communicator::SelectedAlgorithm(size_t bytes) const {
  return impl_->Choose(bytes, Algorithm::kAuto);
}
Algorithm Communicator::SelectedReduceAlgorithm(size_t bytes, Algorithm requested) const {
  return impl_->ChooseReduce(bytes, requested);
}

Status Communicator::AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                               ReduceOp op, const CallOptions& call) {
  // Agreed checks, then local ones (Impl::Refuse: they abort).
  DDP_RETURN_IF_ERROR(impl_->CheckTypes(dtype, op, true, "all-reduce"));
  DDP_RETURN_IF_ERROR(Impl::CheckCallOptions(call, "all-reduce", /*chooses_algorithm=*/true));
  DDP_RETURN_IF_ERROR(impl_->CheckCount(count, dtype, "all-reduce"));
  DDP_RETURN_IF_ERROR(impl_->Refuse(impl_->CheckBuffer(send, count, "all-reduce send buffer"), call));
  DDP_RETURN_IF_ERROR(impl_->Refuse(impl_->CheckBuffer(recv, count, "all-reduce receive buffer"), call));
  DDP_RETURN_IF_ERROR(impl_->Refuse(
      impl_->CheckLayout(send, count, recv, count, dtype, 0, "send == recv", "all-reduce"), call));
  DDP_ASSIGN_OR_RETURN(const int device,
                       impl_->Refuse(impl_->DeviceOf({send, recv}, count, "all-reduce"), call));
  return impl_->RunBlocking(call, [=, this](Deadline d) {
    if (device >= 0) {
      return impl_->DeviceAllReduce(device, send, recv, count, dtype, op, call.algorithm,
                                    call.staged_reduce, d);
    }
    return impl_->AllReduce(send, recv, count, dtype, op, call.algorithm, d);
  });
}

Status Communicator::AllReduce(void* buffer, size_t count, DataType dtype, ReduceOp op,
                               const CallOptions& call) {
  return AllReduce(buffer, buffer, count, dtype, op, call);
}

Status Communicator::AllReduceThrough(const void* send, void* recv, size_t count, DataType dtype,
                                      ReduceOp op, const SliceFn& apply, const CallOptions& call) {
  DDP_RETURN_IF_ERROR(impl_->CheckTypes(dtype, op, true, "all-reduce-through"));
  DDP_RETURN_IF_ERROR(Impl::CheckCallOptions(call, "all-reduce-through", /*chooses_algorithm=*/true));
  DDP_RETURN_IF_ERROR(impl_->CheckCount(count, dtype, "all-reduce-through"));
  auto local = [&]() -> Status {
    DDP_RETURN_IF_ERROR(impl_->CheckBuffer(send, count, "all-reduce-through send buffer"));
    DDP_RETURN_IF_ERROR(impl_->CheckBuffer(recv, count, "all-reduce-through receive buffer"));
    DDP_RETURN_IF_ERROR(impl_->CheckLayout(send, count, recv, count, dtype, 0, "send == recv",
                                           "all-reduce-through"));
    if (!apply) return InvalidArgumentError("all-reduce-through: no slice function");
    DDP_ASSIGN_OR_RETURN(const int device,
                         impl_->DeviceOf({send, recv}, count, "all-reduce-through"));
    if (device >= 0) {
      return InvalidArgumentError(
          "all-reduce-through: send and recv must be host memory (got cuda:" +
          std::to_string(device) + " buffers)");
    }
    return Status::Ok();
  };
  DDP_RETURN_IF_ERROR(impl_->Refuse(local(), call));
  return impl_->RunBlocking(call, [=, this](Deadline d) {
    return impl_->AllReduceThrough(send, recv, count, dtype, op, apply, call.algorithm, d);
  });
}

std::pair<size_t, size_t> Communicator::ThroughSlice(size_t count, DataType dtype, int size,
                                                     int rank) {
  // SliceOf divides by the size, and takes the rank as an index.
  if (size < 1 || rank < 0 || rank >= size) return {0, 0};
  const shm::SliceRange range = shm::SliceOf(count, DataTypeSize(dtype), size, rank);
  return {range.begin, range.end};
}

std::vector<std::pair<size_t, size_t>> Communicator::ThroughPieces(size_t count,
                                                                   DataType dtype) const {
  return impl_->ThroughPieces(count, dtype);
}

Status Communicator::Broadcast(void* buffer, size_t count, DataType dtype, int root,
                               const CallOptions& call) {
  DDP_RETURN_IF_ERROR(impl_->CheckTypes(dtype, ReduceOp::kSum, false, "broadcast"));
  DDP_RETURN_IF_ERROR(Impl::CheckCallOptions(call, "broadcast", /*chooses_algorithm=*/false));
  DDP_RETURN_IF_ERROR(impl_->CheckRank(root, "broadcast root"));
  DDP_RETURN_IF_ERROR(impl_->CheckCount(count, dtype, "broadcast"));
  DDP_RETURN_IF_ERROR(impl_->Refuse(impl_->CheckBuffer(buffer, count, "broadcast buffer"), call));
  DDP_RETURN_IF_ERROR(impl_->Refuse(
      impl_->CheckLayout(buffer, count, buffer, 0, dtype, 0, "", "broadcast"), call));
  DDP_ASSIGN_OR_RETURN(const int device,
                       impl_->Refuse(impl_->DeviceOf({buffer}, count, "broadcast"), call));
  // A CUDA-enabled UCX takes the device buffer as it is: broadcast only
  // sends and receives whole buffers in place, the host never touches them.
  const bool staged = device >= 0 && impl_->Plan({.kind = cuda::StagedKind::kBroadcast,
                                                  .size = size()}) != cuda::StagedPlan::kDirect;
  return impl_->RunBlocking(call, [=, this](Deadline d) {
    if (staged) return impl_->DeviceBroadcast(device, buffer, count, dtype, root, d);
    if (device >= 0) DDP_RETURN_IF_ERROR(impl_->DeviceReady(device, d));
    return impl_->Broadcast(buffer, count, dtype, root, d, /*host_memory=*/device < 0);
  });
}

Status Communicator::AllGather(const void* send, void* recv, size_t count, DataType dtype,
                               const CallOptions& call) {
  DDP_RETURN_IF_ERROR(impl_->CheckTypes(dtype, ReduceOp::kSum, false, "all-gather"));
  DDP_RETURN_IF_ERROR(Impl::CheckCallOptions(call, "all-gather", /*chooses_algorithm=*/false));
  DDP_RETURN_IF_ERROR(impl_->CheckCount(impl_->AllBlocks(count), dtype, "all-gather"));
  DDP_RETURN_IF_ERROR(impl_->Refuse(impl_->CheckBuffer(send, count, "all-gather send buffer"), call));
  DDP_RETURN_IF_ERROR(impl_->Refuse(impl_->CheckBuffer(recv, count, "all-gather receive buffer"), call));
  DDP_RETURN_IF_ERROR(impl_->Refuse(
      impl_->CheckLayout(send, count, recv, impl_->AllBlocks(count), dtype,
                         -impl_->OwnBlock(count, dtype), "send == recv + rank * count", "all-gather"),
      call));
  DDP_ASSIGN_OR_RETURN(const int device,
                       impl_->Refuse(impl_->DeviceOf({send, recv}, count, "all-gather"), call));
  return impl_->RunBlocking(call, [=, this](Deadline d) {
    if (device >= 0) return impl_->DeviceAllGather(device, send, recv, count, dtype, d);
    return impl_->AllGather(send, recv, count, dtype, d);
  });
}

Status Communicator::ReduceScatter(const void* send, void* recv, size_t count, DataType dtype,
                                   ReduceOp op, const CallOptions& call) {
  DDP_RETURN_IF_ERROR(impl_->CheckTypes(dtype, op, true, "reduce-scatter"));
  DDP_RETURN_IF_ERROR(Impl::CheckCallOptions(call, "reduce-scatter", /*chooses_algorithm=*/false));
  DDP_RETURN_IF_ERROR(impl_->CheckCount(impl_->AllBlocks(count), dtype, "reduce-scatter"));
  DDP_RETURN_IF_ERROR(
      impl_->Refuse(impl_->CheckBuffer(send, count, "reduce-scatter send buffer"), call));
  DDP_RETURN_IF_ERROR(
      impl_->Refuse(impl_->CheckBuffer(recv, count, "reduce-scatter receive buffer"), call));
  DDP_RETURN_IF_ERROR(impl_->Refuse(
      impl_->CheckLayout(send, impl_->AllBlocks(count), recv, count, dtype,
                         impl_->OwnBlock(count, dtype), "recv == send + rank * count",
                         "reduce-scatter"),
      call));
  DDP_ASSIGN_OR_RETURN(const int device,
                       impl_->Refuse(impl_->DeviceOf({send, recv}, count, "reduce-scatter"), call));
  return impl_->RunBlocking(call, [=, this](Deadline d) {
    if (device >= 0) {
      return impl_->DeviceReduceScatter(device, send, recv, count, dtype, op, call.staged_reduce,
                                        d);
    }
    return impl_->ReduceScatter(send, recv, count, dtype, op, d);
  });
}

StatusOr<int> Communicator::Impl::CheckAllToAll(const void* send,
                                                std::span<const size_t> send_counts,
                                                const void* recv,
                                                std::span<const size_t> recv_counts,
                                                DataType dtype, const CallOptions& call) {
  DDP_RETURN_IF_ERROR(CheckTypes(dtype, ReduceOp::kSum, false, "all-to-all"));
  DDP_RETURN_IF_ERROR(CheckCallOptions(call, "all-to-all", /*chooses_algorithm=*/false));
  return Refuse(CheckAllToAllLocal(send, send_counts, recv, recv_counts, dtype), call);
}

StatusOr<int> Communicator::Impl::CheckAllToAllLocal(const void* send,
                                                     std::span<const size_t> send_counts,
                                                     const void* recv,
                                                     std::span<const size_t> recv_counts,
                                                     DataType dtype) const {
  const size_t n = static_cast<size_t>(options_.world_size);
  if (send_counts.size() != n || recv_counts.size() != n) {
    return InvalidArgumentError("all-to-all: " + std::to_string(send_counts.size()) +
                                " send counts and " + std::to_string(recv_counts.size()) +
                                " receive counts for " + std::to_string(n) + " ranks");
  }
  const size_t es = DataTypeSize(dtype);
  size_t sent = 0, received = 0;
  for (size_t q = 0; q < n; ++q) {
    const size_t limit = std::numeric_limits<size_t>::max() / es;
    if (send_counts[q] > limit - sent || recv_counts[q] > limit - received) {
      return InvalidArgumentError("all-to-all: the counts add up past the address space");
    }
    sent += send_counts[q];
    received += recv_counts[q];
  }
  const size_t me = static_cast<size_t>(options_.rank);
  if (send_counts[me] != recv_counts[me]) {
    return InvalidArgumentError("all-to-all: rank " + std::to_string(me) + " sends itself " +
                                std::to_string(send_counts[me]) + " elements but receives " +
                                std::to_string(recv_counts[me]));
  }
  DDP_RETURN_IF_ERROR(CheckBuffer(send, sent, "all-to-all send buffer"));
  DDP_RETURN_IF_ERROR(CheckBuffer(recv, received, "all-to-all receive buffer"));
  const auto* s = static_cast<const char*>(send);
  const auto* r = static_cast<const char*>(recv);
  if (sent > 0 && received > 0 && s < r + received * es && r < s + sent * es) {
    return InvalidArgumentError("all-to-all: the send and receive buffers overlap");
  }
  return DeviceOf({sent > 0 ? send : nullptr, received > 0 ? recv : nullptr},
                  std::max(sent, received), "all-to-all");
}

Status Communicator::Impl::AllToAllVOn(int device, const void* send,
                                       const std::vector<size_t>& send_counts, void* recv,
                                       const std::vector<size_t>& recv_counts, DataType dtype,
                                       Deadline deadline, bool equal_blocks) {
  auto exchange = [&](const void* s, void* r) {
    return equal_blocks ? AllToAll(s, r, send_counts.empty() ? 0 : send_counts[0], dtype, deadline)
                        : AllToAllV(s, send_counts, r, recv_counts, dtype, deadline);
  };
  if (device < 0) return exchange(send, recv);
  const size_t es = DataTypeSize(dtype);
  size_t sent = 0, received = 0;
  for (size_t c : send_counts) sent += c;
  for (size_t c : recv_counts) received += c;
  // Either buffer may be host memory (the copy engine reads and writes both).
  // Uninitialized: every byte is written before it is read.
  const std::unique_ptr<std::byte[]> host_send(new std::byte[sent * es]);
  const std::unique_ptr<std::byte[]> host_recv(new std::byte[received * es]);
  DDP_RETURN_IF_ERROR(StageCopyLocked(device, host_send.get(), send, sent * es, false, deadline));
  DDP_RETURN_IF_ERROR(exchange(host_send.get(), host_recv.get()));
  return StageCopyLocked(device, recv, host_recv.get(), received * es, true, deadline);
}

Status Communicator::Impl::AllToAllV(const void* send, const std::vector<size_t>& send_counts,
                                     void* recv, const std::vector<size_t>& recv_counts,
                                     DataType dtype, Deadline deadline) {
  const size_t es = DataTypeSize(dtype);
  const int n = options_.world_size, me = options_.rank;
  std::vector<algorithms::ExchangeBlock> blocks(static_cast<size_t>(n));
  size_t sent = 0, received = 0;
  for (int q = 0; q < n; ++q) {
    blocks[q] = {static_cast<const char*>(send) + sent * es, send_counts[q] * es,
                 static_cast<char*>(recv) + received * es, recv_counts[q] * es};
    sent += send_counts[q];
    received += recv_counts[q];
  }
  if (blocks[me].send_bytes > 0) std::memcpy(blocks[me].recv, blocks[me].send, blocks[me].send_bytes);
  // The count the ranks compare is the world size: the blocks differ per
  // rank, and each pair compares its two blocks' sizes (empty messages), so
  // that both ranks of a pair that disagrees fail, naming both sizes.
  return algorithms::DirectExchange(
      *p2p_, blocks, Args(send, recv, static_cast<size_t>(n), dtype, ReduceOp::kSum, 0, deadline),
      /*empty_messages=*/true);
}

Status Communicator::Impl::AllToAll(const void* send, void* recv, size_t count, DataType dtype,
                                    Deadline deadline) {
  if (shm_ != nullptr) {
    ++sequence_;  // keeps collective numbering equal on every path
    return shm_->AllToAll(send, recv, count, dtype, deadline, watchdog_);
  }
  const std::vector<size_t> counts(static_cast<size_t>(options_.world_size), count);
  return AllToAllV(send, counts, recv, counts, dtype, deadline);
}

Status Communicator::AllToAll(const void* send, void* recv, size_t count, DataType dtype,
                              const CallOptions& call) {
  DDP_RETURN_IF_ERROR(impl_->CheckTypes(dtype, ReduceOp::kSum, false, "all-to-all"));
  DDP_RETURN_IF_ERROR(impl_->CheckCount(impl_->AllBlocks(count), dtype, "all-to-all"));
  const std::vector<size_t> counts(static_cast<size_t>(size()), count);
  DDP_ASSIGN_OR_RETURN(const int device,
                       impl_->CheckAllToAll(send, counts, recv, counts, dtype, call));
  return impl_->RunBlocking(call, [&, this](Deadline d) {
    return impl_->AllToAllVOn(device, send, counts, recv, counts, dtype, d, /*equal_blocks=*/true);
  });
}

Status Communicator::AllToAllV(const void* send, std::span<const size_t> send_counts, void* recv,
                               std::span<const size_t> recv_counts, DataType dtype,
                               const CallOptions& call) {
  DDP_ASSIGN_OR_RETURN(const int device,
                       impl_->CheckAllToAll(send, send_counts, recv, recv_counts, dtype, call));
  std::vector<size_t> sends(send_counts.begin(), send_counts.end());
  std::vector<size_t> receives(recv_counts.begin(), recv_counts.end());
  return impl_->RunBlocking(call, [&, this](Deadline d) {
    return impl_->AllToAllVOn(device, send, sends, recv, receives, dtype, d);
  });
}

Status Communicator::Reduce(const void* send, void* recv, size_t count, DataType dtype,
                            ReduceOp op, int root, const CallOptions& call) {
  DDP_ASSIGN_OR_RETURN(const int device,
                       impl_->CheckRooted(Impl::Rooted::kReduce, send, recv, count, dtype, op, root,
                                          call));
  return impl_->RunBlocking(call, [=, this](Deadline d) {
    return impl_->RunRooted(Impl::Rooted::kReduce, device, send, recv, count, dtype, op, root,
                            call.algorithm, d);
  });
}

Status Communicator::Gather(const void* send, void* recv, size_t count, DataType dtype, int root,
                            const CallOptions& call) {
  DDP_ASSIGN_OR_RETURN(const int device,
                       impl_->CheckRooted(Impl::Rooted::kGather, send, recv, count, dtype,
                                          ReduceOp::kSum, root, call));
  return impl_->RunBlocking(call, [=, this](Deadline d) {
    return impl_->RunRooted(Impl::Rooted::kGather, device, send, recv, count, dtype, ReduceOp::kSum,
                            root, call.algorithm, d);
  });
}

Status Communicator::Scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
                             const CallOptions& call) {
  DDP_ASSIGN_OR_RETURN(const int device,
                       impl_->CheckRooted(Impl::Rooted::kScatter, send, recv, count, dtype,
                                          ReduceOp::kSum, root, call));
  return impl_->RunBlocking(call, [=, this](Deadline d) {
    return impl_->RunRooted(Impl::Rooted::kScatter, device, send, recv, count, dtype,
                            ReduceOp::kSum, root, call.algorithm, d);
  });
}

Status Communicator::Barrier(const CallOptions& call) {
  DDP_RETURN_IF_ERROR(Impl::CheckCallOptions(call, "barrier", /*chooses_algorithm=*/false));
  return impl_->RunBlocking(call, [this](Deadline d) { return impl_->Barrier(d); });
}

Status Communicator::Send(const void* data, size_t count, DataType dtype, int peer, uint32_t tag,
                          const CallOptions& call) {
  DDP_RETURN_IF_ERROR(impl_->CheckTypes(dtype, ReduceOp::kSum, false, "send"));
  DDP_RETURN_IF_ERROR(Impl::CheckCallOptions(call, "send", /*chooses_algorithm=*/false));
  DDP_RETURN_IF_ERROR(impl_->CheckCount(count, dtype, "send"));
  DDP_RETURN_IF_ERROR(impl_->CheckBuffer(data, count, "send buffer"));
  DDP_RETURN_IF_ERROR(impl_->CheckRank(peer, "send to rank"));
  DDP_ASSIGN_OR_RETURN(const int device, impl_->DeviceOf({data}, count, "send"));
  const size_t bytes = count * DataTypeSize(dtype);
  if (device >= 0 && !impl_->ucx_cuda_memory()) {
    // One host copy of the whole message: the receiver matches one message
    // per Send, so it cannot be chunked. Shared: a send whose cancel is left
    // to another thread (BlockingP2p) keeps it until then.
    auto host = std::make_shared<std::vector<std::byte>>(bytes);
    DDP_RETURN_IF_ERROR(
        impl_->StageCopy(device, host->data(), data, bytes, false, impl_->DeadlineFor(call)));
    return impl_->BlockingP2p(true, host->data(), bytes, peer, tag, call, host);
  }
  return impl_->BlockingP2p(true, const_cast<void*>(data), bytes, peer, tag, call, nullptr, device);
}

Status Communicator::Recv(void* data, size_t count, DataType dtype, int peer, uint32_t tag,
                          const CallOptions& call) {
  DDP_RETURN_IF_ERROR(impl_->CheckTypes(dtype, ReduceOp::kSum, false, "receive"));
  DDP_RETURN_IF_ERROR(Impl::CheckCallOptions(call, "receive", /*chooses_algorithm=*/false));
  DDP_RETURN_IF_ERROR(impl_->CheckCount(count, dtype, "receive"));
  DDP_RETURN_IF_ERROR(impl_->CheckBuffer(data, count, "receive buffer"));
  DDP_RETURN_IF_ERROR(impl_->CheckRank(peer, "receive from rank"));
  DDP_ASSIGN_OR_RETURN(const int device, impl_->DeviceOf({data}, count, "receive"));
  const size_t bytes = count * DataTypeSize(dtype);
  if (device >= 0 && !impl_->ucx_cuda_memory()) {
    const Deadline deadline = impl_->DeadlineFor(call);
    auto host = std::make_shared<std::vector<std::byte>>(bytes);
    DDP_RETURN_IF_ERROR(impl_->BlockingP2p(false, host->data(), bytes, peer, tag, call, host));
    return impl_->StageCopy(device, data, host->data(), bytes, true, deadline);
  }
  return impl_->BlockingP2p(false, data, bytes, peer, tag, call, nullptr, device);
}

Work Communicator::FinishedWork(Status status) {
  auto state = std::make_shared<Work::State>();
  state->Finish(std::move(status));
  return Work(std::move(state));
}

Work Communicator::NewWork(std::shared_ptr<Work::State> state) { return Work(std::move(state)); }

// Argument errors of an async call come back in its Work; local ones abort
// (Impl::Refuse), agreed ones do not.
#define DDP_ASYNC_CHECK(expr)                      \
  do {                                             \
    Status ddp_check_ = (expr);                    \
    if (!ddp_check_.ok()) return FinishedWork(ddp_check_); \
  } while (0)

#define DDP_ASYNC_CONCAT_INNER(a, b) a##b
#define DDP_ASYNC_CONCAT(a, b) DDP_ASYNC_CONCAT_INNER(a, b)
#define DDP_ASYNC_ASSIGN(lhs, expr) \
  DDP_ASYNC_ASSIGN_IMPL(DDP_ASYNC_CONCAT(ddp_async_or_, __LINE__), lhs, expr)
#define DDP_ASYNC_ASSIGN_IMPL(tmp, lhs, expr)          \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return FinishedWork(tmp.status());    \
  lhs = std::move(*tmp)

// The queued bodies below hold the Impl, never the Communicator: a body
// still queued when the communicator is destroyed runs from ~Impl's
// Shutdown, after ~Communicator's own body has finished.
Work Communicator::AllReduceAsync(const void* send, void* recv, size_t count, DataType dtype,
                                  ReduceOp op, const CallOptions& call) {
  DDP_ASYNC_CHECK(impl_->CheckTypes(dtype, op, true, "all-reduce"));
  DDP_ASYNC_CHECK(Impl::CheckCallOptions(call, "all-reduce", /*chooses_algorithm=*/true));
  DDP_ASYNC_CHECK(impl_->CheckCount(count, dtype, "all-reduce"));
  DDP_ASYNC_CHECK(impl_->Refuse(impl_->CheckBuffer(send, count, "all-reduce send buffer"), call));
  DDP_ASYNC_CHECK(impl_->Refuse(impl_->CheckBuffer(recv, count, "all-reduce receive buffer"), call));
  DDP_ASYNC_CHECK(impl_->Refuse(
      impl_->CheckLayout(send, count, recv, count, dtype, 0, "send == recv", "all-reduce"), call));
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->Refuse(impl_->DeviceOf({send, recv}, count, "all-reduce"), call));
  return impl_->Enqueue(call, "all-reduce", [=, impl = impl_.get()](Deadline d) {
    if (device >= 0) {
      return impl->DeviceAllReduce(device, send, recv, count, dtype, op, call.algorithm,
                                   call.staged_reduce, d);
    }
    return impl->AllReduce(send, recv, count, dtype, op, call.algorithm, d);
  });
}

Work Communicator::BroadcastAsync(void* buffer, size_t count, DataType dtype, int root,
                                  const CallOptions& call) {
  DDP_ASYNC_CHECK(impl_->CheckTypes(dtype, ReduceOp::kSum, false, "broadcast"));
  DDP_ASYNC_CHECK(Impl::CheckCallOptions(call, "broadcast", /*chooses_algorithm=*/false));
  DDP_ASYNC_CHECK(impl_->CheckRank(root, "broadcast root"));
  DDP_ASYNC_CHECK(impl_->CheckCount(count, dtype, "broadcast"));
  DDP_ASYNC_CHECK(impl_->Refuse(impl_->CheckBuffer(buffer, count, "broadcast buffer"), call));
  DDP_ASYNC_CHECK(impl_->Refuse(
      impl_->CheckLayout(buffer, count, buffer, 0, dtype, 0, "", "broadcast"), call));
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->Refuse(impl_->DeviceOf({buffer}, count, "broadcast"), call));
  const bool staged = device >= 0 && impl_->Plan({.kind = cuda::StagedKind::kBroadcast,
                                                  .size = size()}) != cuda::StagedPlan::kDirect;
  return impl_->Enqueue(call, "broadcast", [=, impl = impl_.get()](Deadline d) {
    if (staged) return impl->DeviceBroadcast(device, buffer, count, dtype, root, d);
    if (device >= 0) DDP_RETURN_IF_ERROR(impl->DeviceReady(device, d));
    return impl->Broadcast(buffer, count, dtype, root, d, /*host_memory=*/device < 0);
  });
}

Work Communicator::AllGatherAsync(const void* send, void* recv, size_t count, DataType dtype,
                                  const CallOptions& call) {
  DDP_ASYNC_CHECK(impl_->CheckTypes(dtype, ReduceOp::kSum, false, "all-gather"));
  DDP_ASYNC_CHECK(Impl::CheckCallOptions(call, "all-gather", /*chooses_algorithm=*/false));
  DDP_ASYNC_CHECK(impl_->CheckCount(impl_->AllBlocks(count), dtype, "all-gather"));
  DDP_ASYNC_CHECK(impl_->Refuse(impl_->CheckBuffer(send, count, "all-gather send buffer"), call));
  DDP_ASYNC_CHECK(impl_->Refuse(impl_->CheckBuffer(recv, count, "all-gather receive buffer"), call));
  DDP_ASYNC_CHECK(impl_->Refuse(
      impl_->CheckLayout(send, count, recv, impl_->AllBlocks(count), dtype,
                         -impl_->OwnBlock(count, dtype), "send == recv + rank * count", "all-gather"),
      call));
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->Refuse(impl_->DeviceOf({send, recv}, count, "all-gather"), call));
  return impl_->Enqueue(call, "all-gather", [=, impl = impl_.get()](Deadline d) {
    if (device >= 0) return impl->DeviceAllGather(device, send, recv, count, dtype, d);
    return impl->AllGather(send, recv, count, dtype, d);
  });
}

Work Communicator::ReduceScatterAsync(const void* send, void* recv, size_t count, DataType dtype,
                                      ReduceOp op, const CallOptions& call) {
  DDP_ASYNC_CHECK(impl_->CheckTypes(dtype, op, true, "reduce-scatter"));
  DDP_ASYNC_CHECK(Impl::CheckCallOptions(call, "reduce-scatter", /*chooses_algorithm=*/false));
  DDP_ASYNC_CHECK(impl_->CheckCount(impl_->AllBlocks(count), dtype, "reduce-scatter"));
  DDP_ASYNC_CHECK(
      impl_->Refuse(impl_->CheckBuffer(send, count, "reduce-scatter send buffer"), call));
  DDP_ASYNC_CHECK(
      impl_->Refuse(impl_->CheckBuffer(recv, count, "reduce-scatter receive buffer"), call));
  DDP_ASYNC_CHECK(impl_->Refuse(
      impl_->CheckLayout(send, impl_->AllBlocks(count), recv, count, dtype,
                         impl_->OwnBlock(count, dtype), "recv == send + rank * count",
                         "reduce-scatter"),
      call));
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->Refuse(impl_->DeviceOf({send, recv}, count, "reduce-scatter"), call));
  return impl_->Enqueue(call, "reduce-scatter", [=, impl = impl_.get()](Deadline d) {
    if (device >= 0) {
      return impl->DeviceReduceScatter(device, send, recv, count, dtype, op, call.staged_reduce, d);
    }
    return impl->ReduceScatter(send, recv, count, dtype, op, d);
  });
}

Work Communicator::AllToAllAsync(const void* send, void* recv, size_t count, DataType dtype,
                                 const CallOptions& call) {
  DDP_ASYNC_CHECK(impl_->CheckTypes(dtype, ReduceOp::kSum, false, "all-to-all"));
  DDP_ASYNC_CHECK(impl_->CheckCount(impl_->AllBlocks(count), dtype, "all-to-all"));
  const std::vector<size_t> counts(static_cast<size_t>(size()), count);
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->CheckAllToAll(send, counts, recv, counts, dtype, call));
  return impl_->Enqueue(call, "all-to-all", [=, impl = impl_.get()](Deadline d) {
    return impl->AllToAllVOn(device, send, counts, recv, counts, dtype, d, /*equal_blocks=*/true);
  });
}

Work Communicator::AllToAllVAsync(const void* send, std::span<const size_t> send_counts,
                                  void* recv, std::span<const size_t> recv_counts, DataType dtype,
                                  const CallOptions& call) {
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->CheckAllToAll(send, send_counts, recv, recv_counts, dtype, call));
  return impl_->Enqueue(call, "all-to-all (uneven blocks)",
                        [=, impl = impl_.get(), sends = std::vector<size_t>(send_counts.begin(), send_counts.end()),
                         receives = std::vector<size_t>(recv_counts.begin(), recv_counts.end())](Deadline d) {
                          return impl->AllToAllVOn(device, send, sends, recv, receives, dtype, d);
                        });
}

Work Communicator::ReduceAsync(const void* send, void* recv, size_t count, DataType dtype,
                               ReduceOp op, int root, const CallOptions& call) {
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->CheckRooted(Impl::Rooted::kReduce, send, recv, count, dtype, op, root,
                                      call));
  return impl_->Enqueue(call, "reduce", [=, impl = impl_.get()](Deadline d) {
    return impl->RunRooted(Impl::Rooted::kReduce, device, send, recv, count, dtype, op, root,
                           call.algorithm, d);
  });
}

Work Communicator::GatherAsync(const void* send, void* recv, size_t count, DataType dtype,
                               int root, const CallOptions& call) {
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->CheckRooted(Impl::Rooted::kGather, send, recv, count, dtype,
                                      ReduceOp::kSum, root, call));
  return impl_->Enqueue(call, "gather", [=, impl = impl_.get()](Deadline d) {
    return impl->RunRooted(Impl::Rooted::kGather, device, send, recv, count, dtype, ReduceOp::kSum,
                           root, call.algorithm, d);
  });
}

Work Communicator::ScatterAsync(const void* send, void* recv, size_t count, DataType dtype,
                                int root, const CallOptions& call) {
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->CheckRooted(Impl::Rooted::kScatter, send, recv, count, dtype,
                                      ReduceOp::kSum, root, call));
  return impl_->Enqueue(call, "scatter", [=, impl = impl_.get()](Deadline d) {
    return impl->RunRooted(Impl::Rooted::kScatter, device, send, recv, count, dtype,
                           ReduceOp::kSum, root, call.algorithm, d);
  });
}

Work Communicator::BarrierAsync(const CallOptions& call) {
  DDP_ASYNC_CHECK(Impl::CheckCallOptions(call, "barrier", /*chooses_algorithm=*/false));
  return impl_->Enqueue(call, "barrier", [impl = impl_.get()](Deadline d) { return impl->Barrier(d); });
}

Work Communicator::SendAsync(const void* data, size_t count, DataType dtype, int peer,
                             uint32_t tag, const CallOptions& call) {
  DDP_ASYNC_CHECK(impl_->CheckTypes(dtype, ReduceOp::kSum, false, "send"));
  DDP_ASYNC_CHECK(Impl::CheckCallOptions(call, "send", /*chooses_algorithm=*/false));
  DDP_ASYNC_CHECK(impl_->CheckCount(count, dtype, "send"));
  DDP_ASYNC_CHECK(impl_->CheckBuffer(data, count, "send buffer"));
  DDP_ASYNC_CHECK(impl_->CheckRank(peer, "send to rank"));
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->CheckUnstagedP2p(data, count, "SendAsync: the send buffer"));
  return impl_->PostP2p(true, const_cast<void*>(data), count * DataTypeSize(dtype), peer, tag, call,
                        /*blocking=*/false, /*posted=*/nullptr, device);
}

Work Communicator::RecvAsync(void* data, size_t count, DataType dtype, int peer, uint32_t tag,
                             const CallOptions& call) {
  DDP_ASYNC_CHECK(impl_->CheckTypes(dtype, ReduceOp::kSum, false, "receive"));
  DDP_ASYNC_CHECK(Impl::CheckCallOptions(call, "receive", /*chooses_algorithm=*/false));
  DDP_ASYNC_CHECK(impl_->CheckCount(count, dtype, "receive"));
  DDP_ASYNC_CHECK(impl_->CheckBuffer(data, count, "receive buffer"));
  DDP_ASYNC_CHECK(impl_->CheckRank(peer, "receive from rank"));
  DDP_ASYNC_ASSIGN(const int device,
                   impl_->CheckUnstagedP2p(data, count, "RecvAsync: the receive buffer"));
  return impl_->PostP2p(false, data, count * DataTypeSize(dtype), peer, tag, call,
                        /*blocking=*/false, /*posted=*/nullptr, device);
}

}  // namespace ddp::transport
