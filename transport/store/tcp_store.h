#ifndef DDP_TRANSPORT_STORE_TCP_STORE_H_
#define DDP_TRANSPORT_STORE_TCP_STORE_H_

// The rendezvous store over TCP: a server (one thread, epoll, many clients)
// run by rank 0 or by a launcher, and a client implementing Store.
//
// Security model: the store is reachable by anyone who can reach the master
// address, so the server binds to that address only and every connection must
// first present the job token (DDP_JOB_TOKEN), compared in constant time. A
// wrong token is refused, logged, and reported to the client as
// PERMISSION_DENIED. The token travels in clear text: it keeps out strangers
// and stray jobs, not an attacker who can read the network.
//
// Bounds: keys up to kMaxKeyBytes, values up to kMaxValueBytes (store.h),
// frames up to wire::kMaxFrameBytes; per connection, the input buffer holds at
// most one frame (and lets go of a big one's memory once it is handled, as
// the output buffer does once a big reply is out), the output buffer and the
// number of parked waits are capped, and a request stalled mid-frame is
// dropped; in total, stored bytes and buffered bytes are capped. Connections
// that have not yet presented a token are few (the oldest is evicted when a
// new one arrives) and short-lived (dropped after a deadline), so a flood of
// idle connections cannot keep the job's ranks out. A malformed or oversized
// request is refused and logged and closes that connection; the server keeps
// serving everyone else.

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "transport/status.h"
#include "transport/store/store.h"
#include "transport/types.h"

namespace ddp::transport::store {

/// How long TcpStoreServer::Start may take to look up its bind address when
/// the options give no deadline.
inline constexpr std::chrono::seconds kDefaultServerStartTimeout{30};

/// Settings of a TcpStoreServer. The defaults suit jobs of thousands of ranks.
struct TcpStoreServerOptions {
  /// Address (or host name) to bind; the server listens there only, at
  /// every address a name resolves to (IPv4 and IPv6 alike). Use "0.0.0.0"
  /// or "::" to listen everywhere, only when that is intended. An IPv6
  /// address may come in brackets ("[::1]").
  std::string bind_address = "127.0.0.1";
  /// Start gives up looking up bind_address at this time (TIMED_OUT).
  /// Unset: kDefaultServerStartTimeout after Start is called.
  std::optional<Deadline> start_deadline;
  /// TCP port; 0 picks a free one (read it back with port()).
  int port = 0;
  /// Every client must present exactly this token (may be empty).
  std::string job_token;
  /// A connection that has not completed its handshake by then is dropped.
  /// Here and in frame_stall_timeout, a timeout past the clock's range
  /// (milliseconds::max()) counts as the furthest time the clock has.
  std::chrono::milliseconds handshake_timeout{10000};
  /// A connection that sent part of a request and then nothing more for
  /// this long is dropped, with the room held for the whole frame (a client
  /// that hangs or dies mid-request without its socket closing).
  std::chrono::milliseconds frame_stall_timeout{30000};
  /// How long a refused connection (wrong token, bad or oversized frame)
  /// may take to receive its error reply and to end what it was sending,
  /// before it is closed anyway.
  std::chrono::milliseconds refused_close_grace{1000};
  /// Most connections that have not yet presented a token; when a new one
  /// arrives beyond this, the oldest is dropped.
  size_t max_unauthenticated = 64;
  /// Most connections in total (a job needs one or two per rank). Start
  /// raises the process's soft RLIMIT_NOFILE (within the hard limit, never
  /// lowering it) to this plus 1024, so that connections are not refused
  /// for want of descriptors first; where the hard limit stops it short,
  /// the limit is lowered to what fits (the soft limit less a quarter of
  /// it, at most 1024, for the process's other files), so that a newcomer
  /// over it is told so instead of waiting out its handshake.
  size_t max_connections = 16384;
  /// Most bytes of keys and values held, each entry counted as its key's
  /// and value's bytes plus 128 for the server's bookkeeping of it (so that
  /// many tiny keys cannot hold many times this in memory).
  size_t max_stored_bytes = size_t{1} << 30;
  /// Most bytes waiting in one connection's output buffer; a client that
  /// stops reading its replies is dropped beyond this. A reply that comes
  /// when nothing waits goes in whatever its size.
  size_t max_connection_output_bytes = size_t{32} << 20;
  /// Most bytes buffered in all connections together (frames being received
  /// plus replies not yet sent); a connection whose next frame does not fit,
  /// or comes while other frames wait for room, stops being read until that
  /// frame's turn comes (room goes to waiting frames in arrival order).
  /// Handshakes never wait (at most max_unauthenticated of them, each at
  /// most wire::kMaxHandshakeBytes, may go over the bound).
  size_t max_buffered_bytes = size_t{256} << 20;
  /// Most Get/Wait calls parked at once on one connection.
  size_t max_waits_per_connection = 256;
  /// Most bytes of keys named by the calls parked at once, on all
  /// connections (each parked key is held twice, and counts so): a wait
  /// beyond it is refused with RESOURCE_EXHAUSTED. 256 waits of 1,024 keys
  /// of 1 KiB on one connection would hold half a GiB otherwise.
  size_t max_parked_key_bytes = size_t{256} << 20;
  /// Receives one line per refused connection or request (why, and from
  /// whom), on the server's thread: it must not block. Default: stderr,
  /// prefixed "ddp store: ", at most 20 lines a second, written by a thread
  /// of its own (a stderr nobody reads holds up that thread, not the store;
  /// past 256 lines waiting, lines are dropped and counted).
  std::function<void(const std::string&)> log;
};

/// Counters for tests and monitoring; read with TcpStoreServer::stats().
struct TcpStoreServerStats {
  uint64_t accepted = 0;              ///< Connections accepted.
  uint64_t authenticated = 0;         ///< Handshakes that presented the token.
  uint64_t refused_token = 0;         ///< Handshakes with a wrong token.
  uint64_t dropped_silent = 0;        ///< Dropped for not completing a handshake in time.
  uint64_t evicted = 0;               ///< Unauthenticated connections evicted by newer ones.
  uint64_t refused_malformed = 0;     ///< Malformed frames (bad magic, version, fields, op).
  uint64_t refused_oversized = 0;     ///< Frames over the size bound.
  uint64_t dropped_stalled = 0;       ///< Dropped for stalling mid-request (frame_stall_timeout).
  /// Connections open now, but for newcomers turned away for want of a
  /// place, which linger only until their close.
  uint64_t open_connections = 0;
  uint64_t stored_bytes = 0;          ///< Bytes of keys and values held now, with 128 per entry.
  uint64_t buffered_bytes = 0;        ///< Bytes of frames being read and replies unsent, now.
  /// Of buffered_bytes, the room held for requests still arriving (each
  /// one's whole size from its header on), now.
  uint64_t receiving_bytes = 0;
  uint64_t parked_waits = 0;          ///< Get/Wait calls parked now, on all connections.
  uint64_t parked_key_bytes = 0;      ///< What the parked calls' keys count against max_parked_key_bytes.
  uint64_t requests = 0;              ///< Requests received so far (every op, after the handshake).
  /// Frames waiting now for room under max_buffered_bytes (their
  /// connections are not read meanwhile); room goes to them in arrival order.
  uint64_t frames_waiting_for_room = 0;
  /// Bytes of memory the connections' buffers hold now (their capacity; at
  /// least buffered_bytes, and small once they are done with big frames).
  uint64_t buffer_capacity_bytes = 0;
};

/// Serves the store on one background thread until Stop() or destruction.
/// Stopping answers parked waits with UNAVAILABLE and shuts down every
/// connection and listening socket (shutdown(), not only close(), so that
/// copies of the descriptors held by a child forked without exec keep
/// nothing open), so clients fail promptly instead of hanging.
class TcpStoreServer {
 public:
  /// Binds and starts serving. When it cannot bind, the error names the
  /// address and the reason, with ListenTcp's codes (socket.h):
  /// FAILED_PRECONDITION for a port another process listens on ("Address
  /// already in use", with its likely causes), PERMISSION_DENIED for a bind
  /// refused (a privileged port, or a security policy), INVALID_ARGUMENT
  /// for an empty address or one that is not this host's, RESOURCE_EXHAUSTED
  /// when descriptors or memory ran out, UNAVAILABLE for a name that does
  /// not resolve or addresses this host cannot use now (loopback down, IPv6
  /// off), INTERNAL for any other failure; TIMED_OUT when the name service
  /// did not answer by options.start_deadline. INVALID_ARGUMENT naming the
  /// option for a timeout that is not positive, or a limit of 0 that would
  /// turn every client away (max_connections, ...).
  static StatusOr<std::unique_ptr<TcpStoreServer>> Start(TcpStoreServerOptions options);

  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  /// The bound port (the chosen one when options.port was 0).
  int port() const;
  /// The bind address as given.
  const std::string& address() const;
  /// True when it listens on loopback addresses only (the bind address is
  /// 127.0.0.1, localhost, or a host name that resolves to loopback here,
  /// as Debian's /etc/hosts maps the machine's own name to 127.0.1.1):
  /// clients on other hosts cannot reach it.
  bool loopback_only() const { return loopback_only_; }
  /// Stops serving and closes every connection. Idempotent, thread-safe.
  void Stop();
  /// Stops as Stop() does, telling the clients why: their parked calls, and
  /// the next call of a client with none under way, fail with UNAVAILABLE
  /// whose message ends with `why` ("its owner closed it after a clean
  /// shutdown; ranks 2, 3 had not left"), not with a bare lost connection.
  /// Whether the job ended cleanly is read off `why` (SaysCleanShutdown);
  /// the overload below takes it as said. The first Stop's reason stands.
  void Stop(std::string why);
  /// As Stop(why), `clean_end` saying whether the job ended cleanly: then
  /// the notice begins with wire::kCleanStopNotice, the clients'
  /// StoppedCleanly() turns true once they read it, and their peer monitors
  /// stop looking for abort reasons instead of reporting the store's
  /// server lost.
  void Stop(std::string why, bool clean_end);
  /// Whether `why` is rank 0's communicator's reason after a clean
  /// shutdown, by its end, which follows every name it quotes: "...
  /// <kCleanShutdownWords> and stopped the store", or "... had not left
  /// (destroy every communicator on every rank before rank R's)". Words
  /// inside it (a communicator named "after a clean shutdown") do not count.
  static bool SaysCleanShutdown(std::string_view why);
  /// A snapshot of the counters.
  TcpStoreServerStats stats() const;

  class Impl;

 private:
  TcpStoreServer(std::unique_ptr<Impl> impl, bool loopback_only);
  std::unique_ptr<Impl> impl_;
  bool loopback_only_ = false;
};

/// A connection to a TcpStoreServer.
///
/// Thread-safe; calls from several threads take turns, and a blocking Get or
/// Wait holds the connection until it returns, so a thread that parks on a
/// key for long (an abort watcher) should have a client of its own. A call
/// queued behind another waits no later than its own deadline (TIMED_OUT,
/// nothing sent).
/// Get, Wait and MultiGet carry their timeout to the server, which answers
/// at its own deadline, a little after the caller's: they read on for that
/// answer up to 100 ms past their deadline, and a TIMED_OUT then says what
/// the server said (a key still missing, by name, or an overloaded store);
/// without it in that time, only the keys asked for are named.
/// After a call runs out of time the connection stays usable: the late reply
/// is recognised by its request id and dropped. Once the connection breaks
/// (server gone, stream corrupt) every later call fails with UNAVAILABLE;
/// there is no reconnection.
class TcpStoreClient final : public Store {
 public:
  /// Connects to `host`:`port` and presents `job_token`, retrying refused
  /// connections until `deadline` (the server may not be up yet). An IPv6
  /// address may come in brackets ("[::1]"), as in an endpoint.
  /// PERMISSION_DENIED when the server refuses the token; UNAVAILABLE or
  /// TIMED_OUT when the server cannot be reached in time.
  static StatusOr<std::unique_ptr<TcpStoreClient>> Connect(const std::string& host, int port,
                                                           std::string_view job_token,
                                                           Deadline deadline);
  ~TcpStoreClient() override;

  Status Set(std::string_view key, std::string_view value, Deadline deadline) override;
  StatusOr<std::string> Get(std::string_view key, Deadline deadline) override;
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline deadline) override;
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline deadline) override;
  /// Any number of keys: more than one request carries (wire::kMaxWaitKeys)
  /// are waited for in turn, against the one deadline.
  Status Wait(std::span<const std::string> keys, Deadline deadline) override;
  /// One round trip per kMaxMultiGetKeys keys, against the one deadline;
  /// keys whose values together are more than one reply carries are read
  /// in halves.
  StatusOr<std::vector<std::string>> MultiGet(std::span<const std::string> keys, Deadline deadline) override;
  static constexpr size_t kMaxMultiGetKeys = 256;
  StatusOr<bool> Delete(std::string_view key, Deadline deadline) override;
  /// One round trip per wire::kMaxWaitKeys keys; values are not sent.
  StatusOr<bool> Check(std::span<const std::string> keys, Deadline deadline) override;
  /// How many keys the store holds now (torch.distributed's
  /// TCPStore.num_keys; keys made by Add and CompareSet count, deleted ones
  /// do not).
  StatusOr<int64_t> NumKeys(Deadline deadline) override;
  /// Sets `key` to `desired` if it holds `expected` (nullopt: if it does not
  /// exist), in one step of the server that no other call comes between.
  /// Returns what `key` holds afterwards: `desired` when it was set, else
  /// the value found (nullopt: none). `expected` and `desired` are at most
  /// kMaxValueBytes together (one request carries both).
  StatusOr<std::optional<std::string>> CompareSet(std::string_view key,
                                                  std::optional<std::string_view> expected,
                                                  std::string_view desired, Deadline deadline) override;

  /// Set when a call of this client read the server's stop notice (a
  /// parked call's answer, or the next call's) with a reason that says the
  /// job ended cleanly (Store::StoppedCleanly).
  bool StoppedCleanly() const override;

  /// "host:port" of the server.
  const std::string& endpoint() const { return endpoint_; }

  /// Breaks the connection: a call blocked in another thread (a Get parked
  /// on a key) returns UNAVAILABLE at once, and so does every later call.
  /// Thread-safe; the way to stop a watcher thread before its deadline.
  void Close();

 private:
  TcpStoreClient(int fd, std::string endpoint);
  struct Reply;
  // Sends one request (op, fields) and waits for its reply until `deadline`.
  // With `carries_timeout` the request starts with the milliseconds left
  // until `deadline`, counted once this call holds the connection (a call
  // queued behind another thread's parked Get must not hand the server a
  // wait that outlasts its own). A call whose deadline passed while it
  // queued is not sent at all: TIMED_OUT then means nothing happened.
  StatusOr<Reply> Call(uint8_t op, bool carries_timeout, std::string_view fields,
                       Deadline deadline, const std::string& what);
  // One MultiGet request for `part` (in halves if the server cannot reply
  // to it whole), its values appended to `values`.
  Status MultiGetPart(std::span<const std::string> part, Deadline deadline, std::vector<std::string>& values);

  std::mutex mu_;                       // guards busy_
  std::condition_variable idle_cv_;     // busy_ went false
  bool busy_ = false;                   // a call has the connection, and the last three fields
  const int fd_;                        // valid until destruction
  const pid_t owner_pid_;               // the process that connected (see ~TcpStoreClient)
  std::atomic<bool> closed_{false};     // set by Close()
  std::atomic<bool> stopped_cleanly_{false};  // see StoppedCleanly()
  const std::string endpoint_;
  uint32_t next_request_id_ = 1;
  std::string read_buffer_;  // bytes received but not yet parsed
  Status broken_;            // set once the connection is unusable
};

}  // namespace ddp::transport::store

#endif  // DDP_TRANSPORT_STORE_TCP_STORE_H_
