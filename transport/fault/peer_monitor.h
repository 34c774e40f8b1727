#ifndef DDP_TRANSPORT_FAULT_PEER_MONITOR_H_
#define DDP_TRANSPORT_FAULT_PEER_MONITOR_H_

// Learning that the job is broken while waiting for something else.
//
// A rank blocked on a message from a live peer cannot see that a third rank
// died, and UCX cannot report the death of a peer on this host at all (its
// shared-memory transports have no failure detection). So every long wait
// calls Check() at a low rate (every ~100 ms), which
//   1. polls a pidfd per peer on this host: an exited process is noticed
//      within one period, and a pidfd cannot be fooled by pid reuse (if an
//      abort reason was posted already, that reason wins: the exited rank
//      may just be one that reported the failure and left);
//   2. reads the job's abort key in the store: the first rank that fails
//      posts its reason there (PostAbort), so every rank learns it;
//   3. treats an unreachable store as the loss of the rank serving it: a
//      refused or lost connection at once, a read slower than the cap on
//      the second such round in a row (one slow answer is a stall, not a
//      loss); an error the store answers with keeps its own code.
//      A store whose owner stopped it after a clean end of the job
//      (Store::StoppedCleanly: rank 0 destroyed its communicator without
//      an abort while ranks of a split finish their last collectives) is
//      no loss: no abort reason will come, and it is not asked again.
//      Except to a wait that may need something from the store's rank when
//      it is a member of this communicator (the wait awaits it, or does not
//      say whom it awaits): that rank stopped the store only after
//      destroying its communicators, this one included, so the wait would
//      never end: PEER_LOST names it, with the stop's reason.
//      Stopped after an abort, or without a reason, it still counts as
//      lost: the reason posted went with it, and the ranks must not wait on.
// A peer that closed its communicator cleanly (posted under `closed/`) may
// exit without being reported, unless the wait is for that very peer: it
// left the job early (ranks stopping at different points, e.g. on a signal)
// and what the wait needs from it will never come. When its mark cannot be
// read (the store hiccups), that round skips the peer rather than calling
// it lost; a second unreadable round in a row reports it. With no time left
// (the call's deadline passed, or the read ran into it) there is no next
// round, and a mark not read counts as not set: the exited peer is lost.
// The call fails at its deadline either way; PEER_LOST names a peer that
// crashed, which is what this check is for, at the cost of misnaming one
// that closed cleanly, was not awaited and whose mark was unreadable at
// that very moment (the wait's own TIMED_OUT would have been right). A
// mark once read is not read again: a clean close is final. Once the store
// is stopped after a clean end of the job, a peer closing since could not
// post its mark: its exit is reported only to a wait for that very peer,
// saying that it may have closed first (a mark posted before the stop but
// not yet read here cannot be read any more).
//
// Every store access takes the deadline of the call it serves: a store that
// stopped answering (its host cut off) must not hold a call past its own
// deadline. A store access is also capped (PeerMonitorOptions::
// store_call_cap, kStoreCallCap by default), after which the store counts as
// unreachable.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "transport/status.h"
#include "transport/store/store.h"

namespace ddp::transport::fault {

/// Longest a single store access may take before the store counts as
/// unreachable (when the caller's deadline is further away), by default.
inline constexpr std::chrono::milliseconds kStoreCallCap{2000};

struct PeerMonitorOptions {
  int rank = 0;
  /// Per rank: its pid when it runs on this host, else 0. This rank's own
  /// entry is ignored.
  std::vector<int> local_pids;
  /// Store keys: "<prefix>abort" and "<prefix>closed/<rank>".
  std::string key_prefix;
  /// Which rank serves the store (-1: a launcher does; -2: a process
  /// outside this group, rank 0 of the group it was split from), for
  /// messages.
  int store_rank = 0;
  /// What this rank knows of the rank serving the store ("rank 0, which
  /// serves the store (pid 41 on this host), has exited"), asked when the
  /// server ended the connection to it: the abort reason that rank may have
  /// posted went with the store, so this is all there is to say. It goes
  /// ahead of the store's own words. `told_why`: the server sent its stop
  /// notice, so its owner stopped it on purpose and the store's words say
  /// why (after a clean shutdown, or after an abort); false: it went
  /// without a word. Unset, or an empty answer: nothing.
  std::function<std::string(bool told_why)> describe_server;
  /// Longest a single store access may take before the store counts as
  /// unreachable (when the caller's deadline is further away).
  std::chrono::milliseconds store_call_cap = kStoreCallCap;
};

class PeerMonitor {
 public:
  /// `store` must outlive the monitor; nullptr: no store checks.
  PeerMonitor(PeerMonitorOptions options, store::Store* store);
  ~PeerMonitor();
  PeerMonitor(const PeerMonitor&) = delete;
  PeerMonitor& operator=(const PeerMonitor&) = delete;

  /// OK while the job looks healthy; otherwise the reason, naming the rank.
  /// Cheap (a poll per local peer and one store round trip). Returns by
  /// `deadline` (the calling operation's): TIMED_OUT when the store did not
  /// answer before it; with no time left, only the local peers are checked.
  /// `awaited_peer` is the rank the calling wait needs something from (-1:
  /// unknown): its exit is a failure even after a clean close.
  Status Check(Deadline deadline, int awaited_peer = -1);
  /// As above, for a wait that needs something from each of `awaited_peers`.
  Status Check(Deadline deadline, std::span<const int> awaited_peers);

  /// The ranks on this host whose process has exited, cleanly or not.
  std::vector<int> ExitedPeers() const;

  /// The rank on this host found dead by the last Check(), or -1.
  int lost_peer() const { return lost_peer_.load(std::memory_order_relaxed); }

  /// The abort reason another rank posted, if any (OK when none or when the
  /// store cannot be read by `deadline`).
  Status PostedAbort(Deadline deadline);

  /// Posts `reason` (from this rank) as the job's abort reason unless one is
  /// already posted. Best effort: gives up at `deadline`.
  void PostAbort(const Status& reason, Deadline deadline);

  /// Marks this rank as closed cleanly, so its exit is not a failure.
  void PostClosed(Deadline deadline);

  /// Encoding of an abort reason in the store, and back. Decoding a posted
  /// reason keeps its code and says which rank posted it. A reason past the
  /// store's value limit (store::kMaxValueBytes) is cut to fit, between
  /// UTF-8 characters, ending with a note that says so and how long it was.
  static std::string EncodeAbort(int rank, const Status& reason);
  static Status DecodeAbort(const std::string& value);

 private:
  // When one store access on behalf of a call ending at `deadline` gives up.
  Deadline StoreDeadline(Deadline deadline) const;
  // Whether `peer` posted its clean close: kUnknown when the store could
  // not be read (an error or a timeout), kNo also when there is no store or
  // no time left to ask it, kStoreStopped when its owner stopped the store
  // after a clean end of the job (a mark not read by then never will be).
  enum class Closed { kYes, kNo, kUnknown, kStoreStopped };
  Closed PeerClosed(int peer, Deadline deadline);
  // Check's answer once the store's owner stopped it after a clean end of
  // the job: OK, unless the store's rank is a member here and the wait may
  // need something from it (it awaits that rank, or does not say whom it
  // awaits): then PEER_LOST naming it, with the stop's reason.
  Status StoppedCleanly(Deadline deadline, std::span<const int> awaited_peers);
  bool Exited(size_t rank) const;

  PeerMonitorOptions options_;
  store::Store* store_;
  std::vector<int> pidfds_;  // per rank; -1: not watched
  std::vector<bool> gone_at_start_;  // per rank: no process when the monitor started
  // Per rank without a pidfd: its process's start time (ProcessStartTime),
  // read when the monitor starts or, where that failed (no descriptor left
  // to open /proc with), at the first look after, unless the process found
  // then started after the monitor did (kReplaced: the peer is gone and
  // another process has its pid); 0 unknown.
  std::unique_ptr<std::atomic<uint64_t>[]> start_times_;
  static constexpr uint64_t kReplaced = UINT64_MAX;
  // When the monitor started (TicksSinceBoot; 0 unknown): every peer it
  // watches was running by then.
  const uint64_t started_at_;
  std::atomic<int> lost_peer_{-1};  // Check() may run on two threads
  // Per rank: when (Clock ticks) the first of the latest unbroken run of
  // Check rounds that found it exited and could not read its "closed" mark
  // got its answer; 0 when the last round read the mark.
  std::unique_ptr<std::atomic<int64_t>[]> first_unread_;
  // Per rank: its "closed" mark was read once (a clean close is final), so
  // later rounds neither ask the store again nor depend on its answer.
  std::unique_ptr<std::atomic<bool>[]> closed_seen_;
  // The same for the abort key's reads that ran past store_call_cap: when
  // the first of the latest unbroken run got its answer; 0 after a read.
  std::atomic<int64_t> first_slow_abort_read_{0};
};

}  // namespace ddp::transport::fault

#endif  // DDP_TRANSPORT_FAULT_PEER_MONITOR_H_
