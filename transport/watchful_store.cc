#include "transport/watchful_store.h"

#include "transport/fault/peer_monitor.h"

namespace ddp::transport::internal {
namespace {

using std::chrono::milliseconds;

// The last slice's timeout ("... timed out after 187 ms ...") told as the
// whole wait's, which is what ran out.
Status WholeWait(const Status& last, Clock::time_point start) {
  std::string message = last.message();
  const std::string mark = " timed out after ";
  const size_t at = message.find(mark);
  const size_t end = at == std::string::npos ? at : message.find(" ms", at + mark.size());
  if (end == std::string::npos) return last;
  const auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  message.replace(at + mark.size(), end - at - mark.size(), std::to_string(waited));
  return TimedOutError(message);
}

}  // namespace

StatusOr<std::string> WatchfulStore::Get(std::string_view key, Deadline deadline) {
  const Clock::time_point start = Clock::now();
  while (true) {
    StatusOr<std::string> got = inner_.Get(key, Slice(deadline));
    if (got.ok() || got.status().code() != StatusCode::kTimedOut) return got;
    if (Clock::now() >= deadline) return WholeWait(got.status(), start);
    if (Status aborted = Posted(deadline); !aborted.ok()) {
      // Set by the time the abort was seen: as if seen within the slice.
      StatusOr<std::optional<std::string>> there = inner_.TryGet(key, deadline);
      if (there.ok() && there->has_value()) return std::move(**there);
      return aborted;
    }
  }
}

StatusOr<std::vector<std::string>> WatchfulStore::MultiGet(std::span<const std::string> keys,
                                                           Deadline deadline) {
  const Clock::time_point start = Clock::now();
  DDP_RETURN_IF_ERROR(Wait(keys, deadline));
  StatusOr<std::vector<std::string>> got = inner_.MultiGet(keys, deadline);
  if (!got.ok() && got.status().code() == StatusCode::kTimedOut) {
    return NameMissing(WholeWait(got.status(), start), keys, deadline);
  }
  return got;
}

Status WatchfulStore::Wait(std::span<const std::string> keys, Deadline deadline) {
  const Clock::time_point start = Clock::now();
  while (true) {
    Status waited = inner_.Wait(keys, Slice(deadline));
    if (waited.ok() || waited.code() != StatusCode::kTimedOut) return waited;
    if (Clock::now() >= deadline) return NameMissing(WholeWait(waited, start), keys, deadline);
    if (Status aborted = Posted(deadline); !aborted.ok()) {
      // A rank that aborts after reading every key (a setting that differs)
      // set them all before its abort: this wait then succeeds, as it does
      // when they come within the slice, and the caller checks them itself
      // and names what it finds from its own view instead of taking the
      // other rank's, a choice that otherwise hung on how late this rank
      // was scheduled between its slice and this look. The abort still
      // ends the next wait.
      StatusOr<bool> all_set = inner_.Check(keys, deadline);
      if (all_set.ok() && *all_set) return Status::Ok();
      return aborted;
    }
  }
}

Status WatchfulStore::NameMissing(const Status& timed_out, std::span<const std::string> keys,
                                  Deadline deadline) {
  if (keys.size() < 2) return timed_out;
  // One look per key, all against one budget: at thousands of keys a
  // timeout per look made this report take longer than the wait it explains.
  // The budget runs from the wait's deadline, not from now, so that the
  // topology exchange's own look for the rank behind the key
  // (ExchangeTopology), which runs from the same deadline, shares it
  // instead of adding as much again. A look that starts after that window
  // (a read that overran the deadline by more, a caller whose deadline was
  // long past) still gets kNameMissingQuickLook from its start, so that a
  // store that answers at once has the missing key named, not "no key read".
  const Clock::time_point now = Clock::now();
  const Deadline window = DeadlineAfter(std::min(deadline, now), kNameMissingBudget);
  const bool quick = window < now + kNameMissingQuickLook;
  const Deadline budget = quick ? now + kNameMissingQuickLook : window;
  size_t looked = 0;
  Status stopped;
  for (const std::string& key : keys) {
    if (Clock::now() >= budget) {
      stopped = TimedOutError(
          quick ? "its " + std::to_string(kNameMissingQuickLook.count()) + " ms, begun " +
                      std::to_string(std::chrono::duration_cast<milliseconds>(now - deadline).count()) +
                      " ms past the deadline, were spent"
                : "its " + std::to_string(kNameMissingBudget.count()) + " ms past the deadline were spent");
      break;
    }
    StatusOr<std::optional<std::string>> there = inner_.TryGet(key, budget);
    if (!there.ok()) {
      stopped = there.status();
      break;
    }
    ++looked;
    if (!there->has_value()) return TimedOutError(timed_out.message() + "; key '" + key + "' is not set");
  }
  if (stopped.ok()) return timed_out;
  const std::string total = std::to_string(keys.size());
  if (looked == 0) {
    return TimedOutError(timed_out.message() + "; no key of " + total +
                         " could be read to name the missing one (" + stopped.message() + ")");
  }
  return TimedOutError(timed_out.message() + "; the look for the missing key was cut short: " +
                       std::to_string(looked) + " of " + total + " keys were read, all set; the other " +
                       std::to_string(keys.size() - looked) + " were not read (" + stopped.message() + ")");
}

Status WatchfulStore::Posted(Deadline deadline) {
  StatusOr<std::optional<std::string>> posted = inner_.TryGet(abort_key_, deadline);
  if (posted.ok() && posted->has_value()) return fault::PeerMonitor::DecodeAbort(**posted);
  return Status::Ok();
}

}  // namespace ddp::transport::internal
