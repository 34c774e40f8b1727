#ifndef DDP_TRANSPORT_STORE_STORE_H_
#define DDP_TRANSPORT_STORE_STORE_H_

// Rendezvous key-value store: ranks exchange UCX worker addresses through it
// and post an abort reason that every rank can read. Served over TCP by rank 0
// or by the launcher (transport/store/tcp_store.h); this is the client view.
//
// Every call has a deadline. Keys are at most kMaxKeyBytes, values at most
// kMaxValueBytes; larger ones are refused with RESOURCE_EXHAUSTED. The TCP
// store and the in-memory test store refuse an empty key with
// INVALID_ARGUMENT (torch.distributed's stores take one); an empty value is
// fine. Keys and values are bytes (NUL included).

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::store {

inline constexpr size_t kMaxKeyBytes = 1024;
inline constexpr size_t kMaxValueBytes = 4 << 20;

/// The words by which the reason rank 0's communicator gives for stopping
/// the store's server says that the job ended cleanly ("... was destroyed
/// after a clean shutdown and stopped the store ..."); the server reads
/// them at the reason's end only (TcpStoreServer::SaysCleanShutdown).
/// Clients then take the store's end for the end of abort information,
/// not for the loss of the rank that served it.
inline constexpr std::string_view kCleanShutdownWords = "after a clean shutdown";

class Store {
 public:
  virtual ~Store() = default;

  /// Sets `key` to `value` (overwrites).
  virtual Status Set(std::string_view key, std::string_view value,
                     Deadline deadline) = 0;

  /// Waits until `key` exists, then returns its value. TIMED_OUT names the key.
  virtual StatusOr<std::string> Get(std::string_view key, Deadline deadline) = 0;

  /// Returns the value of `key` now, or nullopt if it does not exist.
  virtual StatusOr<std::optional<std::string>> TryGet(std::string_view key,
                                                      Deadline deadline) = 0;

  /// Atomically adds `delta` to the integer stored at `key` (absent: 0) and
  /// returns the new value.
  virtual StatusOr<int64_t> Add(std::string_view key, int64_t delta,
                                Deadline deadline) = 0;

  /// Waits until every key in `keys` exists.
  virtual Status Wait(std::span<const std::string> keys, Deadline deadline) = 0;

  /// Waits until every key in `keys` exists, then returns their values in
  /// that order. The TCP store answers many keys per round trip (ranks
  /// exchanging one key each: a round trip per rank otherwise); this
  /// default Gets them one by one. TIMED_OUT names a key still missing.
  virtual StatusOr<std::vector<std::string>> MultiGet(std::span<const std::string> keys, Deadline deadline);

  /// Whether every key in `keys` exists now (true for none), without
  /// waiting: torch.distributed's Store.check. This default asks TryGet
  /// key by key; the TCP store answers up to 1,024 keys per round trip.
  virtual StatusOr<bool> Check(std::span<const std::string> keys, Deadline deadline);

  /// How many keys the store holds now: torch.distributed's Store.num_keys
  /// (keys made by Add and CompareSet count, deleted ones do not). This
  /// default, for stores that cannot count, is FAILED_PRECONDITION saying
  /// so; the TCP and in-memory stores count.
  virtual StatusOr<int64_t> NumKeys(Deadline deadline);

  /// Deletes `key`; returns whether it existed.
  virtual StatusOr<bool> Delete(std::string_view key, Deadline deadline) = 0;

  /// Sets `key` to `desired` if it holds `expected` (nullopt: if it does not
  /// exist), in one step that no other call comes between. Returns what
  /// `key` holds afterwards: `desired` when it was set, else the value
  /// found (nullopt: none). "The first to post wins" without a race.
  /// torch.distributed's compare_set(key, "", v) ("set if absent") is
  /// CompareSet(key, std::nullopt, v) here: an expected "" matches only a
  /// key that exists and holds "", so on an absent key it sets nothing.
  virtual StatusOr<std::optional<std::string>> CompareSet(std::string_view key,
                                                          std::optional<std::string_view> expected,
                                                          std::string_view desired, Deadline deadline) = 0;

  /// Whether this client has read that the store's server was stopped by
  /// its owner after the job ended cleanly (the TCP store's notice begins
  /// with wire::kCleanStopNotice): no abort reason will be posted any more, and
  /// every later call fails UNAVAILABLE. False while it serves, after a
  /// stop for another reason (an abort) or none, and when it went away
  /// without a word (its process died). Thread-safe. This default, for
  /// stores without a server to stop: false.
  virtual bool StoppedCleanly() const { return false; }
};

}  // namespace ddp::transport::store

#endif  // DDP_TRANSPORT_STORE_STORE_H_
