#include "transport/store/tcp_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/store/socket.h"
#include "transport/store/wire.h"
#include "transport/testing/in_memory_store.h"

namespace ddp::transport::store {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

constexpr char kToken[] = "test-token-7f3a";

// Collects the server's log lines.
struct LogSink {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> Fn() {
    return [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mu);
      lines.push_back(line);
    };
  }
  bool Contains(const std::string& text) {
    std::lock_guard<std::mutex> lock(mu);
    for (const std::string& line : lines) {
      if (line.find(text) != std::string::npos) return true;
    }
    return false;
  }
};

std::unique_ptr<TcpStoreServer> StartServer(TcpStoreServerOptions options = {}) {
  if (options.job_token.empty()) options.job_token = kToken;
  StatusOr<std::unique_ptr<TcpStoreServer>> server = TcpStoreServer::Start(std::move(options));
  EXPECT_TRUE(server.ok()) << server.status();
  return std::move(server).value();
}

// Polls the server's counters until `reached` holds for them; false when
// `timeout` passes first. Tests order their steps by what the server has
// seen, not by sleeps, which a loaded machine outlasts.
bool StatsReach(const TcpStoreServer& server,
                const std::function<bool(const TcpStoreServerStats&)>& reached,
                std::chrono::milliseconds timeout = std::chrono::seconds(15)) {
  const Deadline deadline = DeadlineIn(timeout);
  while (!reached(server.stats())) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

std::unique_ptr<TcpStoreClient> ConnectClient(int port, std::string_view token = kToken) {
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("127.0.0.1", port, token, DeadlineIn(5s));
  EXPECT_TRUE(client.ok()) << client.status();
  return std::move(client).value();
}

std::unique_ptr<TcpStoreClient> ConnectClient(const TcpStoreServer& server,
                                              std::string_view token = kToken) {
  return ConnectClient(server.port(), token);
}

// A raw connection for speaking (or breaking) the protocol by hand.
class RawConnection {
 public:
  explicit RawConnection(int port) {
    StatusOr<UniqueFd> fd = ConnectTcp("127.0.0.1", port, DeadlineIn(5s));
    EXPECT_TRUE(fd.ok()) << fd.status();
    fd_ = std::move(fd).value();
  }
  void Send(std::string_view bytes) {
    ASSERT_TRUE(SendAll(fd_.get(), bytes, DeadlineIn(5s), nullptr).ok());
  }
  void Handshake(std::string_view token = kToken) {
    wire::Writer w;
    w.Bytes(std::string_view(wire::kMagic, 4));
    w.U16(wire::kVersion);
    w.U16(0);
    w.String(token);
    Send(w.Frame());
    std::optional<std::string> reply = ReadFrame(5s);
    ASSERT_TRUE(reply.has_value());
    wire::Reader r(*reply);
    std::string_view magic;
    uint16_t version;
    uint8_t code;
    ASSERT_TRUE(r.Bytes(4, magic) && r.U16(version) && r.U8(code));
    ASSERT_EQ(code, 0);
  }
  // The next frame's body, or nullopt when the connection closed or nothing
  // came within `timeout`.
  std::optional<std::string> ReadFrame(std::chrono::milliseconds timeout) {
    const Deadline deadline = DeadlineIn(timeout);
    while (true) {
      std::optional<uint32_t> length = wire::PeekFrameLength(buffer_);
      if (length && buffer_.size() >= 4 + *length) {
        std::string body = buffer_.substr(4, *length);
        buffer_.erase(0, 4 + *length);
        return body;
      }
      if (!RecvSome(fd_.get(), buffer_, 1 << 20, deadline).ok()) return std::nullopt;
    }
  }
  // True when the server closed the connection within `timeout`.
  bool ClosedWithin(std::chrono::milliseconds timeout) {
    const Deadline deadline = DeadlineIn(timeout);
    while (true) {
      Status s = RecvSome(fd_.get(), buffer_, 1 << 20, deadline);
      if (s.code() == StatusCode::kUnavailable) return true;
      if (s.code() == StatusCode::kTimedOut) return false;
    }
  }
  // Closes this end, as a client that gives up does.
  void Close() { fd_.Reset(); }
  // Sends all of `bytes` within `timeout`, or says why not.
  Status SendWithin(std::string_view bytes, std::chrono::milliseconds timeout) {
    return SendAll(fd_.get(), bytes, DeadlineIn(timeout), nullptr);
  }
  // Asks the kernel for a send buffer of `bytes` (SO_SNDBUF).
  void SetSendBuffer(int bytes) {
    ASSERT_EQ(setsockopt(fd_.get(), SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes)), 0) << std::strerror(errno);
  }
  // Asks the kernel for a receive buffer of `bytes` (SO_RCVBUF).
  void SetReceiveBuffer(int bytes) {
    ASSERT_EQ(setsockopt(fd_.get(), SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes)), 0) << std::strerror(errno);
  }
  // Shuts down the sending side only (a half-close): the server reads the
  // end of the stream after what was sent, and this end can still read.
  void ShutdownWrite() { ASSERT_EQ(shutdown(fd_.get(), SHUT_WR), 0) << std::strerror(errno); }
  // Status code and message of a request reply.
  static std::pair<StatusCode, std::string> ParseReply(const std::string& body, uint32_t* id) {
    wire::Reader r(body);
    uint32_t request_id = 0;
    uint8_t code = 0;
    std::string_view message;
    r.U32(request_id);
    r.U8(code);
    if (code != 0) r.String(message, 1 << 20);
    if (id) *id = request_id;
    return {static_cast<StatusCode>(code), std::string(message)};
  }

 private:
  UniqueFd fd_;
  std::string buffer_;
};

// A whole TryGet frame (request `id`) of `key`.
std::string TryGetFrame(uint32_t id, std::string_view key) {
  wire::Writer w;
  w.U8(static_cast<uint8_t>(wire::Op::kTryGet));
  w.U32(id);
  w.String(key);
  return w.Frame();
}

// Whether other hosts can reach the server: not on loopback addresses (what
// the launchers warn about for a job across hosts), yes on the wildcard.
TEST(TcpStoreTest, SaysWhetherItListensOnLoopbackOnly) {
  for (const char* address : {"127.0.0.1", "127.0.1.1", "localhost"}) {
    auto server = StartServer({.bind_address = address});
    EXPECT_TRUE(server->loopback_only()) << address;
  }
  auto everywhere = StartServer({.bind_address = "0.0.0.0"});
  EXPECT_FALSE(everywhere->loopback_only());
}

TEST(TcpStoreTest, SetGetAddWaitDeleteAcrossThreads) {
  auto server = StartServer();
  constexpr int kThreads = 8;
  constexpr int kAddsPerThread = 50;
  std::vector<std::thread> threads;
  std::vector<Status> results(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      results[t] = [&]() -> Status {
        auto client = ConnectClient(*server);
        const Deadline deadline = DeadlineIn(10s);
        DDP_RETURN_IF_ERROR(client->Set("addr/" + std::to_string(t), "value-" + std::to_string(t),
                                        deadline));
        for (int i = 0; i < kAddsPerThread; ++i) {
          DDP_ASSIGN_OR_RETURN(int64_t v, client->Add("counter", 1, deadline));
          if (v < 1) return InternalError("counter went backwards");
        }
        std::vector<std::string> keys;
        for (int peer = 0; peer < kThreads; ++peer) keys.push_back("addr/" + std::to_string(peer));
        DDP_RETURN_IF_ERROR(client->Wait(keys, deadline));
        for (int peer = 0; peer < kThreads; ++peer) {
          DDP_ASSIGN_OR_RETURN(std::string v, client->Get(keys[peer], deadline));
          if (v != "value-" + std::to_string(peer)) return InternalError("wrong value " + v);
        }
        return Status::Ok();
      }();
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(results[t].ok()) << "thread " << t << ": " << results[t];

  auto client = ConnectClient(*server);
  const Deadline deadline = DeadlineIn(5s);
  StatusOr<std::optional<std::string>> counter = client->TryGet("counter", deadline);
  ASSERT_TRUE(counter.ok()) << counter.status();
  EXPECT_EQ(counter->value(), std::to_string(kThreads * kAddsPerThread));
  EXPECT_EQ(*client->Add("counter", -10, deadline), kThreads * kAddsPerThread - 10);
  EXPECT_EQ(*client->Delete("addr/0", deadline), true);
  EXPECT_EQ(*client->Delete("addr/0", deadline), false);
  EXPECT_FALSE(client->TryGet("addr/0", deadline)->has_value());
  ASSERT_TRUE(client->Set("empty", "", deadline).ok());
  EXPECT_EQ(*client->Get("empty", deadline), "");
}

TEST(TcpStoreTest, GetParksUntilTheKeyIsSet) {
  auto server = StartServer();
  auto waiter = ConnectClient(*server);
  auto setter = ConnectClient(*server);
  std::atomic<bool> done{false};
  StatusOr<std::string> got = InternalError("not run");
  Deadline returned_at{};
  std::thread thread([&] {
    got = waiter->Get("late", DeadlineIn(10s));
    returned_at = Clock::now();
    done = true;
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(done.load());
  const Deadline set_at = Clock::now();
  ASSERT_TRUE(setter->Set("late", "here", DeadlineIn(5s)).ok());
  thread.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "here");
  EXPECT_LT(returned_at - set_at, 2s);
}

TEST(TcpStoreTest, WaitParksUntilEveryKeyExists) {
  auto server = StartServer();
  auto waiter = ConnectClient(*server);
  auto setter = ConnectClient(*server);
  std::atomic<bool> done{false};
  Status result = InternalError("not run");
  std::thread thread([&] {
    std::vector<std::string> keys = {"a", "b", "c"};
    result = waiter->Wait(keys, DeadlineIn(10s));
    done = true;
  });
  ASSERT_TRUE(setter->Set("a", "1", DeadlineIn(5s)).ok());
  ASSERT_TRUE(setter->Add("b", 1, DeadlineIn(5s)).ok());
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(done.load());
  ASSERT_TRUE(setter->Set("c", "1", DeadlineIn(5s)).ok());
  thread.join();
  EXPECT_TRUE(result.ok()) << result;
}

// More keys than one wait request may name (1024) are waited for all the
// same, under one deadline.
TEST(TcpStoreTest, WaitOnMoreKeysThanOneRequestCarries) {
  auto server = StartServer();
  auto waiter = ConnectClient(*server);
  auto setter = ConnectClient(*server);
  std::vector<std::string> keys;
  for (int i = 0; i < 2500; ++i) keys.push_back("node/" + std::to_string(i));
  for (int i = 0; i < 2500; ++i) {
    if (i == 2100) continue;
    ASSERT_TRUE(setter->Set(keys[i], "1", DeadlineIn(5s)).ok());
  }
  // One key missing, in the third piece: a timeout that names it.
  const Deadline start = Clock::now();
  // The deadline leaves time for the two complete pieces' round trips (of
  // 1024 keys each) even on a loaded machine.
  Status waited = waiter->Wait(keys, DeadlineIn(3s));
  EXPECT_EQ(waited.code(), StatusCode::kTimedOut) << waited;
  EXPECT_THAT(waited.message(), HasSubstr("wait for key 'node/2048' and 451 more timed out"));
  EXPECT_LT(Clock::now() - start, 10s);
  std::atomic<bool> done{false};
  Status result = InternalError("not run");
  std::thread thread([&] {
    result = waiter->Wait(keys, DeadlineIn(10s));
    done = true;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(done.load());
  ASSERT_TRUE(setter->Set(keys[2100], "1", DeadlineIn(5s)).ok());
  thread.join();
  EXPECT_TRUE(result.ok()) << result;
}

// MultiGet waits for every key, then answers their values in the order
// named, in one request per TcpStoreClient::kMaxMultiGetKeys keys.
TEST(TcpStoreTest, MultiGetParksUntilEveryKeyIsSetAndKeepsTheOrder) {
  auto server = StartServer();
  auto waiter = ConnectClient(*server);
  auto setter = ConnectClient(*server);
  ASSERT_TRUE(setter->Set("b", "2", DeadlineIn(5s)).ok());
  std::atomic<bool> done{false};
  StatusOr<std::vector<std::string>> got = InternalError("not run");
  std::thread thread([&] {
    const std::vector<std::string> keys = {"a", "b", "c", "b"};
    got = waiter->MultiGet(keys, DeadlineIn(10s));
    done = true;
  });
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.parked_waits == 1; }));
  ASSERT_TRUE(setter->Set("c", "", DeadlineIn(5s)).ok());
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(done.load());
  ASSERT_TRUE(setter->Set("a", "1", DeadlineIn(5s)).ok());
  thread.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<std::string>{"1", "2", "", "2"}));

  // 600 keys: three requests (256 + 256 + 88).
  std::vector<std::string> many;
  for (int i = 0; i < 600; ++i) {
    many.push_back("k/" + std::to_string(i));
    ASSERT_TRUE(setter->Set(many.back(), std::to_string(i * 7), DeadlineIn(5s)).ok());
  }
  const uint64_t before = server->stats().requests;
  StatusOr<std::vector<std::string>> values = waiter->MultiGet(many, DeadlineIn(10s));
  ASSERT_TRUE(values.ok()) << values.status();
  ASSERT_EQ(values->size(), 600u);
  for (int i = 0; i < 600; ++i) EXPECT_EQ((*values)[i], std::to_string(i * 7)) << i;
  EXPECT_EQ(server->stats().requests - before, 3u);
  EXPECT_TRUE(waiter->MultiGet({}, DeadlineIn(1s))->empty());

  // A key never set: TIMED_OUT, and the connection still serves.
  const std::vector<std::string> missing = {"a", "never"};
  StatusOr<std::vector<std::string>> late = waiter->MultiGet(missing, DeadlineIn(300ms));
  EXPECT_EQ(late.status().code(), StatusCode::kTimedOut) << late.status();
  EXPECT_NE(late.status().message().find("get of 2 keys from 'a'"), std::string::npos) << late.status();
  EXPECT_EQ(*waiter->Get("a", DeadlineIn(5s)), "1");

  // Values that one reply cannot carry together: the server refuses the
  // request, naming the way out, and the client reads them in halves.
  const std::string big(3 << 20, 'x');
  ASSERT_TRUE(setter->Set("big1", big, DeadlineIn(5s)).ok());
  ASSERT_TRUE(setter->Set("big2", big + "y", DeadlineIn(5s)).ok());
  const std::vector<std::string> bigs = {"a", "big1", "big2"};
  const uint64_t refused_before = server->stats().requests;
  StatusOr<std::vector<std::string>> halves = waiter->MultiGet(bigs, DeadlineIn(5s));
  ASSERT_TRUE(halves.ok()) << halves.status();
  ASSERT_EQ(halves->size(), 3u);
  EXPECT_EQ((*halves)[0], "1");
  EXPECT_EQ((*halves)[1], big);
  EXPECT_EQ((*halves)[2], big + "y");
  // The whole, then "a" alone, then the two big ones, then each.
  EXPECT_EQ(server->stats().requests - refused_before, 5u);
}

// A multi-get refused for the limit on parked keys is answered at once:
// only values too large for one reply are read in halves. (The keys were
// halved down to one, a request each time, every one refused alike, and the
// error named that one key.)
TEST(TcpStoreTest, MultiGetRefusedForTheParkedKeysLimitIsNotSplit) {
  TcpStoreServerOptions options;
  options.max_parked_key_bytes = 4096;
  auto server = StartServer(options);
  auto first = ConnectClient(*server);
  auto second = ConnectClient(*server);
  auto setter = ConnectClient(*server);
  std::vector<std::string> held;
  for (int i = 0; i < 10; ++i) held.push_back(std::string(90, 'h') + std::to_string(i));
  Status waited = InternalError("not run");
  std::thread thread([&] { waited = first->Wait(held, DeadlineIn(20s)); });
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.parked_waits == 1; }));
  // Less room is left than any one of these keys takes parked.
  std::vector<std::string> keys;
  for (int i = 0; i < 4; ++i) keys.push_back("m" + std::to_string(i) + std::string(1000, 'k'));
  const uint64_t before = server->stats().requests;
  StatusOr<std::vector<std::string>> got = second->MultiGet(keys, DeadlineIn(5s));
  EXPECT_EQ(got.status().code(), StatusCode::kResourceExhausted) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("get of 4 keys from 'm0k"));
  EXPECT_THAT(got.status().message(), HasSubstr("max_parked_key_bytes"));
  EXPECT_EQ(server->stats().requests - before, 1u);
  for (const std::string& key : held) ASSERT_TRUE(setter->Set(key, "v", DeadlineIn(5s)).ok());
  thread.join();
  EXPECT_TRUE(waited.ok()) << waited;
}

// The keys of parked waits count against one limit for the whole server: a
// wait past it is refused naming the option, and the room comes back when a
// wait ends. (256 waits of 1,024 keys of 1 KiB on one connection held half
// a GiB that no limit counted.)
TEST(TcpStoreTest, ParkedWaitsKeysAreBounded) {
  TcpStoreServerOptions options;
  options.max_parked_key_bytes = 4096;
  auto server = StartServer(options);
  auto first = ConnectClient(*server);
  auto second = ConnectClient(*server);
  auto setter = ConnectClient(*server);
  auto keys_named = [](const std::string& stem) {
    std::vector<std::string> keys;
    for (int i = 0; i < 10; ++i) keys.push_back(stem + std::string(90, 'k') + std::to_string(i));
    return keys;
  };
  const std::vector<std::string> a = keys_named("a"), b = keys_named("b");
  Status waited = InternalError("not run");
  std::thread thread([&] { waited = first->Wait(a, DeadlineIn(20s)); });
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.parked_waits == 1; }));
  EXPECT_GT(server->stats().parked_key_bytes, 0u);
  Status refused = second->Wait(b, DeadlineIn(5s));
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("max_parked_key_bytes"), std::string::npos) << refused;
  for (const std::string& key : a) ASSERT_TRUE(setter->Set(key, "v", DeadlineIn(5s)).ok());
  thread.join();
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.parked_key_bytes == 0; }));
  // The room is back: the refused wait parks now, and ends.
  std::thread again([&] { waited = second->Wait(b, DeadlineIn(20s)); });
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.parked_waits == 1; }));
  for (const std::string& key : b) ASSERT_TRUE(setter->Set(key, "v", DeadlineIn(5s)).ok());
  again.join();
  EXPECT_TRUE(waited.ok()) << waited;
}

// A parked wait counts the keys it still misses: a key deleted after it
// was set is missing again, and the wait ends only once every key exists.
TEST(TcpStoreTest, AKeyDeletedWhileAWaitIsParkedIsMissingAgain) {
  auto server = StartServer();
  auto waiter = ConnectClient(*server);
  auto setter = ConnectClient(*server);
  std::atomic<bool> done{false};
  StatusOr<std::vector<std::string>> got = InternalError("not run");
  std::thread thread([&] {
    const std::vector<std::string> keys = {"x", "y", "x"};
    got = waiter->MultiGet(keys, DeadlineIn(10s));
    done = true;
  });
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.parked_waits == 1; }));
  ASSERT_TRUE(setter->Set("x", "1", DeadlineIn(5s)).ok());
  ASSERT_TRUE(*setter->Delete("x", DeadlineIn(5s)));
  ASSERT_TRUE(setter->Set("y", "2", DeadlineIn(5s)).ok());
  ASSERT_TRUE(setter->Set("y", "3", DeadlineIn(5s)).ok());  // set again: still one key
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(done.load());
  EXPECT_EQ(server->stats().parked_waits, 1u);
  ASSERT_TRUE(setter->Set("x", "4", DeadlineIn(5s)).ok());
  thread.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<std::string>{"4", "3", "4"}));
}

TEST(TcpStoreTest, DeadlinesAreHonouredAndTheConnectionSurvives) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  Deadline start = Clock::now();
  StatusOr<std::string> got = client->Get("never", DeadlineIn(300ms));
  auto took = Clock::now() - start;
  EXPECT_EQ(got.status().code(), StatusCode::kTimedOut);
  EXPECT_THAT(got.status().message(), HasSubstr("get of key 'never' timed out"));
  EXPECT_GE(took, 290ms);
  EXPECT_LT(took, 2s);

  std::vector<std::string> keys = {"never1", "never2"};
  start = Clock::now();
  Status waited = client->Wait(keys, DeadlineIn(200ms));
  EXPECT_EQ(waited.code(), StatusCode::kTimedOut);
  EXPECT_THAT(waited.message(), HasSubstr("wait for key 'never1' and 1 more timed out"));
  EXPECT_LT(Clock::now() - start, 2s);

  // The late server-side answers to the calls above are told apart by
  // request id; the connection keeps working.
  ASSERT_TRUE(client->Set("x", "y", DeadlineIn(5s)).ok());
  EXPECT_EQ(*client->Get("x", DeadlineIn(5s)), "y");
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(client->TryGet("x", DeadlineIn(5s))->value(), "y");

  // A deadline already in the past fails at once.
  start = Clock::now();
  EXPECT_EQ(client->Get("never", Clock::now() - 1s).status().code(), StatusCode::kTimedOut);
  EXPECT_LT(Clock::now() - start, 1s);
}

// The server's word on a wait that ran out of time reaches the caller: the
// key it still missed, not only the first key asked for. The client used to
// give up at its own deadline, before the server's answer (sent at the
// server's deadline, a little later) could come, and to put its own text in
// place of the server's when it did come.
TEST(TcpStoreTest, ATimedOutCallNamesAKeyStillMissing) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  ASSERT_TRUE(client->Set("here", "1", DeadlineIn(5s)).ok());
  const std::vector<std::string> keys = {"here", "gone", "also_gone"};
  Deadline start = Clock::now();
  StatusOr<std::vector<std::string>> got = client->MultiGet(keys, DeadlineIn(300ms));
  EXPECT_EQ(got.status().code(), StatusCode::kTimedOut);
  EXPECT_THAT(got.status().message(), HasSubstr("key 'gone' not set before the deadline (2 of the 3 keys missing)"));
  EXPECT_GE(Clock::now() - start, 290ms);
  EXPECT_LT(Clock::now() - start, 2s);

  const Status waited = client->Wait(std::span<const std::string>(keys).subspan(1), DeadlineIn(200ms));
  EXPECT_EQ(waited.code(), StatusCode::kTimedOut);
  EXPECT_THAT(waited.message(), HasSubstr("wait for key 'gone' and 1 more timed out"));
  EXPECT_THAT(waited.message(), HasSubstr("key 'gone' not set before the deadline (2 of the 2 keys missing)"));

  const StatusOr<std::string> one = client->Get("gone", DeadlineIn(200ms));
  EXPECT_EQ(one.status().code(), StatusCode::kTimedOut);
  EXPECT_THAT(one.status().message(), HasSubstr("key 'gone' not set before the deadline"));
  // The connection serves on.
  EXPECT_EQ(*client->Get("here", DeadlineIn(5s)), "1");
}

// A store that answers Check with Store's own default (TryGet key by key).
class DefaultCheckStore final : public Store {
 public:
  explicit DefaultCheckStore(TcpStoreClient& inner) : inner_(inner) {}
  Status Set(std::string_view key, std::string_view value, Deadline deadline) override {
    return inner_.Set(key, value, deadline);
  }
  StatusOr<std::string> Get(std::string_view key, Deadline deadline) override { return inner_.Get(key, deadline); }
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline deadline) override {
    return inner_.TryGet(key, deadline);
  }
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline deadline) override {
    return inner_.Add(key, delta, deadline);
  }
  Status Wait(std::span<const std::string> keys, Deadline deadline) override { return inner_.Wait(keys, deadline); }
  StatusOr<bool> Delete(std::string_view key, Deadline deadline) override { return inner_.Delete(key, deadline); }
  StatusOr<std::optional<std::string>> CompareSet(std::string_view key, std::optional<std::string_view> expected,
                                                  std::string_view desired, Deadline deadline) override {
    return inner_.CompareSet(key, expected, desired, deadline);
  }

 private:
  TcpStoreClient& inner_;
};

// torch.distributed's num_keys and check: what the store holds now, with
// no waiting.
TEST(TcpStoreTest, NumKeysAndCheckAnswerForTheStoreAsItIsNow) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  const Deadline deadline = DeadlineIn(10s);
  EXPECT_EQ(*client->NumKeys(deadline), 0);
  const std::string nul_key("k\0ey", 4);
  ASSERT_TRUE(client->Set("a", "1", deadline).ok());
  ASSERT_TRUE(client->Set(nul_key, "", deadline).ok());
  ASSERT_TRUE(client->Add("count", 2, deadline).ok());
  ASSERT_TRUE(client->CompareSet("posted", std::nullopt, "x", deadline).ok());
  ASSERT_TRUE(client->CompareSet("absent", "expected", "x", deadline).ok());  // sets nothing
  ASSERT_TRUE(client->Set("a", "2", deadline).ok());                         // overwrites
  EXPECT_EQ(*client->NumKeys(deadline), 4);
  ASSERT_TRUE(*client->Delete("a", deadline));
  EXPECT_EQ(*client->NumKeys(deadline), 3);

  DefaultCheckStore by_default(*client);
  for (Store* store : {static_cast<Store*>(client.get()), static_cast<Store*>(&by_default)}) {
    EXPECT_TRUE(*store->Check({}, deadline));
    EXPECT_TRUE(*store->Check(std::vector<std::string>{nul_key, "count", "posted"}, deadline));
    EXPECT_FALSE(*store->Check(std::vector<std::string>{"count", "k"}, deadline)) << "'k' is not 'k\\0ey'";
    // Not there: false at once, not at the deadline.
    const Deadline start = Clock::now();
    EXPECT_FALSE(*store->Check(std::vector<std::string>{"a"}, deadline));
    EXPECT_LT(Clock::now() - start, 2s);
  }

  // More keys than one request names: one request per wire::kMaxWaitKeys.
  std::vector<std::string> many;
  for (uint32_t i = 0; i < wire::kMaxWaitKeys + 5; ++i) many.push_back("many/" + std::to_string(i));
  for (const std::string& key : many) ASSERT_TRUE(client->Set(key, "", deadline).ok());
  const uint64_t before = server->stats().requests;
  EXPECT_TRUE(*client->Check(many, deadline));
  EXPECT_EQ(server->stats().requests - before, 2u);
  ASSERT_TRUE(*client->Delete(many.back(), deadline));
  EXPECT_FALSE(*client->Check(many, deadline));
  EXPECT_EQ(*client->NumKeys(deadline), 3 + static_cast<int64_t>(many.size()) - 1);

  StatusOr<bool> empty = client->Check(std::vector<std::string>{"a", ""}, deadline);
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("store check: a key is empty (key 2 of 2)"));
}

// A token longer than a handshake carries is refused by the server and
// the client alike, before anything binds or connects, naming the token
// and the limit ("job token of 1025 bytes is too long" left the limit out).
TEST(TcpStoreTest, ATokenOverTheLimitIsRefusedNamingTheLimit) {
  const std::string longest(wire::kMaxTokenBytes, 't');
  const std::string too_long = longest + "t";
  TcpStoreServerOptions options;
  options.job_token = too_long;
  StatusOr<std::unique_ptr<TcpStoreServer>> refused = TcpStoreServer::Start(options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("TcpStoreServerOptions::job_token (DDP_JOB_TOKEN) is 1025 bytes, more than the limit of 1024"));
  options.job_token = longest;
  StatusOr<std::unique_ptr<TcpStoreServer>> server = TcpStoreServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("127.0.0.1", (*server)->port(), too_long, DeadlineIn(5s));
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(client.status().message(),
              HasSubstr("the job token (DDP_JOB_TOKEN) is 1025 bytes, more than the limit of 1024"));
  EXPECT_EQ((*server)->stats().accepted, 0u);
  EXPECT_TRUE(TcpStoreClient::Connect("127.0.0.1", (*server)->port(), longest, DeadlineIn(5s)).ok());
}

TEST(TcpStoreTest, WrongTokenIsRefusedAndLogged) {
  LogSink log;
  TcpStoreServerOptions options;
  options.log = log.Fn();
  auto server = StartServer(options);
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("127.0.0.1", server->port(), "guess", DeadlineIn(5s));
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(client.status().message(), HasSubstr("refused this process's job token"));
  EXPECT_THAT(client.status().message(), HasSubstr("DDP_JOB_TOKEN"));
  EXPECT_EQ(server->stats().refused_token, 1u);
  EXPECT_TRUE(log.Contains("wrong job token"));
  // An empty token is a wrong token too.
  client = TcpStoreClient::Connect("127.0.0.1", server->port(), "", DeadlineIn(5s));
  EXPECT_EQ(client.status().code(), StatusCode::kPermissionDenied);
  // The right token still gets in.
  auto good = ConnectClient(*server);
  EXPECT_TRUE(good->Set("k", "v", DeadlineIn(5s)).ok());
}

TEST(TcpStoreTest, BindsToTheGivenAddressOnly) {
  auto server = StartServer();  // 127.0.0.1
  // 127.0.0.2 is this host too, but the server did not bind it.
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("127.0.0.2", server->port(), kToken, DeadlineIn(300ms));
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(client.status().message(), HasSubstr("127.0.0.2"));
}

// A port another process listens on: most often a second process given
// RANK=0 where rank 0 serves the store, whose bind is the first thing to
// fail. The error names the address and port and says so; it is no
// service that cannot be reached (UNAVAILABLE) but a port held by another.
TEST(TcpStoreTest, PortInUseIsReportedWithASecondRankZeroAsACause) {
  auto server = StartServer();
  TcpStoreServerOptions options;
  options.port = server->port();
  StatusOr<std::unique_ptr<TcpStoreServer>> second = TcpStoreServer::Start(options);
  ASSERT_FALSE(second.ok());
  const std::string at = "127.0.0.1:" + std::to_string(server->port());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(second.status().message(),
              HasSubstr(at + ": Address already in use: another process on this host already listens on " + at +
                        " (a second process started as rank 0 of a job whose rank 0 serves the store, a store "
                        "left running by an earlier job, or another program holding MASTER_PORT " +
                        std::to_string(server->port()) + "); check RANK and MASTER_PORT"));
}

// An address that is not this host's is the caller's to fix (a MASTER_ADDR
// naming another host, given to rank 0), not a store that is unavailable.
TEST(TcpStoreTest, AnAddressOfAnotherHostIsBadInput) {
  TcpStoreServerOptions options;
  options.bind_address = "192.0.2.1";  // TEST-NET-1: no host has it
  options.job_token = kToken;
  StatusOr<std::unique_ptr<TcpStoreServer>> server = TcpStoreServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), StatusCode::kInvalidArgument) << server.status();
  EXPECT_THAT(server.status().message(),
              HasSubstr("cannot listen on 192.0.2.1:0: 192.0.2.1:0: Cannot assign requested address (not an "
                        "address of this host)"));
}

// No descriptor left for the listening socket: the process ran out of
// something (RESOURCE_EXHAUSTED), which a retry or a higher `ulimit -n`
// may fix, not a store that cannot be reached. In a child, whose limit
// is lowered to none.
TEST(TcpStoreTest, NoDescriptorForTheListenerIsAShortage) {
  const pid_t parent = getpid();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    alarm(30);  // bounds the child whatever happens
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(2);
    limit.rlim_cur = 0;
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(2);
    StatusOr<std::vector<UniqueFd>> fds = ListenTcp("127.0.0.1", 0, 4, DeadlineIn(5s));
    if (fds.ok()) _exit(3);
    if (fds.status().code() != StatusCode::kResourceExhausted) _exit(4);
    if (fds.status().message().find("cannot listen on 127.0.0.1:0: socket: Too many open files") ==
        std::string::npos) {
      _exit(5);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: it listened; 4: another code than RESOURCE_EXHAUSTED; 5: another text";
}

// Room for the listening socket but for nothing after it (the server's
// epoll and wake descriptors): a shortage (RESOURCE_EXHAUSTED) named as
// the store's start, not an internal error. In a child whose limit, hard
// and soft, stops one above the first free descriptor.
TEST(TcpStoreTest, NoDescriptorForTheServersOwnFilesIsAShortage) {
  const pid_t parent = getpid();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    alarm(30);  // bounds the child whatever happens
    const int first_free = dup(0);
    if (first_free < 0) _exit(2);
    close(first_free);
    const rlimit limit{static_cast<rlim_t>(first_free + 1), static_cast<rlim_t>(first_free + 1)};
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(2);
    TcpStoreServerOptions options;
    options.job_token = kToken;
    StatusOr<std::unique_ptr<TcpStoreServer>> server = TcpStoreServer::Start(options);
    if (server.ok()) _exit(3);
    if (server.status().code() != StatusCode::kResourceExhausted) _exit(4);
    if (server.status().message() != "cannot start the store server: epoll_create1: Too many open files") _exit(5);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: it started; 4: another code than RESOURCE_EXHAUSTED; 5: another text";
}

// A port whose listener never answers (another service that waits for its
// client to speak first, a store process that is stopped): Connect gives up
// at its deadline, TIMED_OUT, naming the endpoint and what to check.
TEST(TcpStoreTest, AListenerThatNeverAnswersTimesOutNamingTheLikelyCause) {
  // Never accepted: the kernel completes the connection, nobody reads.
  StatusOr<std::vector<UniqueFd>> silent = ListenTcp("127.0.0.1", 0, 4, DeadlineIn(5s));
  ASSERT_TRUE(silent.ok()) << silent.status();
  StatusOr<int> port = LocalPort(silent->front().get());
  ASSERT_TRUE(port.ok()) << port.status();
  const auto start = Clock::now();
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("127.0.0.1", *port, kToken, DeadlineIn(300ms));
  const auto took = Clock::now() - start;
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kTimedOut) << client.status();
  EXPECT_THAT(client.status().message(),
              HasSubstr("the store at 127.0.0.1:" + std::to_string(*port) +
                        " accepted the connection but did not answer the handshake before the deadline (a store "
                        "answers at once: is MASTER_PORT another service's port"));
  EXPECT_LT(took, 5s);
}

// Settings that would turn every client away are refused at Start, named,
// instead of a server that starts and leaves its clients to time out (a
// max_connection_output_bytes of 0 dropped every connection at its
// handshake reply; a max_waits_per_connection of 0 refused every Get).
TEST(TcpStoreTest, OptionsThatWouldTurnEveryClientAwayAreRefused) {
  const std::vector<std::pair<std::function<void(TcpStoreServerOptions&)>, std::string>> cases = {
      {[](TcpStoreServerOptions& o) { o.handshake_timeout = 0ms; }, "handshake_timeout is 0 ms"},
      {[](TcpStoreServerOptions& o) { o.frame_stall_timeout = -5ms; }, "frame_stall_timeout is -5 ms"},
      {[](TcpStoreServerOptions& o) { o.max_unauthenticated = 0; }, "max_unauthenticated is 0"},
      {[](TcpStoreServerOptions& o) { o.max_connections = 0; }, "max_connections is 0"},
      {[](TcpStoreServerOptions& o) { o.max_stored_bytes = 0; }, "max_stored_bytes is 0"},
      {[](TcpStoreServerOptions& o) { o.max_connection_output_bytes = 0; }, "max_connection_output_bytes is 0"},
      {[](TcpStoreServerOptions& o) { o.max_waits_per_connection = 0; }, "max_waits_per_connection is 0"},
      {[](TcpStoreServerOptions& o) { o.max_parked_key_bytes = 0; }, "max_parked_key_bytes is 0"},
  };
  for (const auto& [set, message] : cases) {
    TcpStoreServerOptions options;
    options.job_token = kToken;
    set(options);
    StatusOr<std::unique_ptr<TcpStoreServer>> server = TcpStoreServer::Start(options);
    ASSERT_FALSE(server.ok()) << message;
    EXPECT_EQ(server.status().code(), StatusCode::kInvalidArgument) << server.status();
    EXPECT_THAT(server.status().message(), HasSubstr("TcpStoreServerOptions::" + message)) << server.status();
  }
}

// Keys and values are bytes: NUL bytes anywhere in them, empty values and
// values of the largest size go through every call unchanged, and a key
// that differs from another only past a NUL byte is another key.
TEST(TcpStoreTest, NulBytesEmptyAndLargestValuesGoThroughEveryCall) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  const Deadline deadline = DeadlineIn(20s);
  const std::string key("rank\0" "1", 6), other("rank\0" "2", 6), value("\0v\0", 3);
  std::string largest(kMaxValueBytes, 'x');
  largest[0] = '\0';
  largest[kMaxValueBytes / 2] = '\0';
  ASSERT_TRUE(client->Set(key, value, deadline).ok());
  EXPECT_EQ(*client->Get(key, deadline), value);
  EXPECT_FALSE(client->TryGet(other, deadline)->has_value());
  EXPECT_FALSE(client->TryGet("rank", deadline)->has_value());
  EXPECT_EQ(client->Get(other, DeadlineIn(200ms)).status().code(), StatusCode::kTimedOut);
  ASSERT_TRUE(client->Set(other, "", deadline).ok());
  EXPECT_EQ(**client->TryGet(other, deadline), "");
  ASSERT_TRUE(client->Set("largest", largest, deadline).ok());
  const std::vector<std::string> keys = {key, other, "largest"};
  ASSERT_TRUE(client->Wait(keys, deadline).ok());
  StatusOr<std::vector<std::string>> values = client->MultiGet(keys, deadline);
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<std::string>{value, "", largest}));
  EXPECT_EQ(*client->Add(std::string("n\0", 2), 7, deadline), 7);
  EXPECT_FALSE(client->TryGet("n", deadline)->has_value());
  // One request carries both values: the largest and an empty one.
  EXPECT_EQ(**client->CompareSet("largest", largest, "", deadline), "");
  EXPECT_EQ(**client->CompareSet(key, value, std::string("\0w", 2), deadline), std::string("\0w", 2));
  EXPECT_EQ(**client->CompareSet(other, std::string(), largest, deadline), largest);
  EXPECT_EQ(*client->Get(other, deadline), largest);
  EXPECT_TRUE(*client->Delete(key, deadline));
  EXPECT_EQ(client->TryGet(other, deadline)->value().size(), largest.size());
}

TEST(TcpStoreTest, SizeBounds) {
  TcpStoreServerOptions options;
  options.max_stored_bytes = 10 << 20;
  auto server = StartServer(options);
  auto client = ConnectClient(*server);
  const std::string big(kMaxValueBytes, 'v');
  ASSERT_TRUE(client->Set("big", big, DeadlineIn(10s)).ok());
  EXPECT_EQ(*client->Get("big", DeadlineIn(10s)), big);

  Status too_big = client->Set("big2", big + "x", DeadlineIn(5s));
  EXPECT_EQ(too_big.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(too_big.message(), HasSubstr("exceeds the limit of 4194304"));
  Status long_key = client->Set(std::string(kMaxKeyBytes + 1, 'k'), "v", DeadlineIn(5s));
  EXPECT_EQ(long_key.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(client->Set("", "v", DeadlineIn(5s)).code(), StatusCode::kInvalidArgument);

  // The server's total bound: 10 MiB holds two big values, not three.
  ASSERT_TRUE(client->Set("big2", big, DeadlineIn(10s)).ok());
  Status full = client->Set("big3", big, DeadlineIn(10s));
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("would exceed its limit"));
  // Overwriting in place and deleting free room again.
  ASSERT_TRUE(client->Set("big2", "small", DeadlineIn(5s)).ok());
  EXPECT_TRUE(client->Set("big3", big, DeadlineIn(10s)).ok());
  EXPECT_EQ(client->Set("big4", big, DeadlineIn(10s)).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(*client->Delete("big", DeadlineIn(5s)));
  EXPECT_TRUE(client->Set("big4", big, DeadlineIn(10s)).ok());
}

// A key over the limit or empty is refused before anything is sent, naming
// the call and the key (its first bytes) or its place in a list: "store key
// of 1025 bytes exceeds the limit" left the caller to guess which of its
// keys, in which call.
TEST(TcpStoreTest, ABadKeyIsRefusedNamingTheCallAndTheKey) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  const std::string long_key = "rank/7/" + std::string(kMaxKeyBytes, 'k');
  Status set = client->Set(long_key, "v", DeadlineIn(5s));
  EXPECT_EQ(set.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(set.message(), HasSubstr("store set: key 'rank/7/kkk"));
  EXPECT_THAT(set.message(), HasSubstr(std::to_string(long_key.size()) + " bytes, more than the limit of " +
                                       std::to_string(kMaxKeyBytes)));
  StatusOr<std::string> get = client->Get(long_key, DeadlineIn(5s));
  EXPECT_THAT(get.status().message(), HasSubstr("store get: key 'rank/7/kkk"));
  const std::vector<std::string> keys = {"a", "b", long_key};
  Status wait = client->Wait(keys, DeadlineIn(5s));
  EXPECT_EQ(wait.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(wait.message(), HasSubstr("store wait: key 'rank/7/kkk"));
  EXPECT_THAT(wait.message(), HasSubstr("(key 3 of 3)"));
  const std::vector<std::string> with_empty = {"a", ""};
  StatusOr<std::vector<std::string>> got = client->MultiGet(with_empty, DeadlineIn(5s));
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(), HasSubstr("store multi_get: a key is empty (key 2 of 2)"));
  EXPECT_EQ(server->stats().requests, 0u) << "a refused key reached the server";
}

// Each entry counts its bookkeeping against max_stored_bytes, not only its
// key and value: keys of a few bytes with empty values used to fit by the
// hundred thousand into a bound meant for a few MiB.
TEST(TcpStoreTest, ManyTinyKeysAreRefusedPastTheStoredBytesBound) {
  TcpStoreServerOptions options;
  options.max_stored_bytes = 64 << 10;
  auto server = StartServer(options);
  auto client = ConnectClient(*server);
  constexpr int kKeys = 2000;  // 8 KiB of keys and values, 250 KiB held
  int stored = 0;
  Status full;
  for (; stored < kKeys; ++stored) {
    full = client->Set("k" + std::to_string(stored), "", DeadlineIn(5s));
    if (!full.ok()) break;
  }
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full;
  EXPECT_THAT(full.message(), HasSubstr("would exceed its limit of 65536"));
  EXPECT_LE(stored, (64 << 10) / 128);
  EXPECT_LE(server->stats().stored_bytes, uint64_t{64 << 10});
  // Deleting an entry gives back what it was charged.
  ASSERT_TRUE(*client->Delete("k0", DeadlineIn(5s)));
  EXPECT_TRUE(client->Set("k" + std::to_string(stored), "", DeadlineIn(5s)).ok());
}

TEST(TcpStoreTest, AddToNonIntegerIsRefused) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  ASSERT_TRUE(client->Set("name", "alice", DeadlineIn(5s)).ok());
  StatusOr<int64_t> added = client->Add("name", 1, DeadlineIn(5s));
  EXPECT_EQ(added.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(added.status().message(), HasSubstr("key 'name' holds a value that is not an integer"));
  ASSERT_TRUE(client->Set("n", "9223372036854775807", DeadlineIn(5s)).ok());
  EXPECT_THAT(client->Add("n", 1, DeadlineIn(5s)).status().message(), HasSubstr("overflows"));
  // The connection is still fine.
  EXPECT_EQ(*client->Add("m", 5, DeadlineIn(5s)), 5);
}

// The in-memory store that tests of other layers use refuses the Adds the
// TCP store refuses, with the same code and words: a layer tested against
// it sees what it will see in a job (it threw std::invalid_argument on a
// non-integer and took "12abc" for 12).
TEST(TcpStoreTest, AddRefusesTheSameValuesInTheInMemoryStore) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  testing::InMemoryStore in_memory;
  for (Store* store : {static_cast<Store*>(client.get()), static_cast<Store*>(&in_memory)}) {
    SCOPED_TRACE(store == &in_memory ? "in-memory store" : "TCP store");
    for (const char* text : {"alice", "12abc", " 12", "", "99999999999999999999"}) {
      SCOPED_TRACE(std::string("value '") + text + "'");
      ASSERT_TRUE(store->Set("v", text, DeadlineIn(5s)).ok());
      StatusOr<int64_t> added = store->Add("v", 1, DeadlineIn(5s));
      EXPECT_EQ(added.status().code(), StatusCode::kFailedPrecondition);
      EXPECT_THAT(added.status().message(), HasSubstr("key 'v' holds a value that is not an integer"));
      EXPECT_EQ(*store->TryGet("v", DeadlineIn(5s)), std::optional<std::string>(text));
    }
    ASSERT_TRUE(store->Set("n", "9223372036854775807", DeadlineIn(5s)).ok());
    StatusOr<int64_t> overflowed = store->Add("n", 1, DeadlineIn(5s));
    EXPECT_EQ(overflowed.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(overflowed.status().message(), HasSubstr("adding 1 to key 'n' overflows"));
    EXPECT_EQ(*store->Add("n", -7, DeadlineIn(5s)), 9223372036854775800);
    ASSERT_TRUE(store->Set("m", "-12", DeadlineIn(5s)).ok());
    EXPECT_EQ(*store->Add("m", 2, DeadlineIn(5s)), -10);
    EXPECT_EQ(*store->Add("absent", 3, DeadlineIn(5s)), 3);
  }
}

// The in-memory store refuses the keys and values the TCP store refuses,
// with the same codes: a layer tested against it meets those bounds in its
// tests, not first in a job.
TEST(TcpStoreTest, BadKeysAndValuesAreRefusedAlikeInTheInMemoryStore) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  testing::InMemoryStore in_memory;
  const std::string long_key(kMaxKeyBytes + 1, 'k');
  const std::string big_value(kMaxValueBytes + 1, 'v');
  for (Store* store : {static_cast<Store*>(client.get()), static_cast<Store*>(&in_memory)}) {
    SCOPED_TRACE(store == &in_memory ? "in-memory store" : "TCP store");
    for (const std::string& key : {std::string(), long_key}) {
      const StatusCode code = key.empty() ? StatusCode::kInvalidArgument : StatusCode::kResourceExhausted;
      SCOPED_TRACE("key of " + std::to_string(key.size()) + " bytes");
      const std::vector<std::string> keys = {"fine", key};
      EXPECT_EQ(store->Set(key, "v", DeadlineIn(5s)).code(), code);
      EXPECT_EQ(store->Get(key, DeadlineIn(5s)).status().code(), code);
      EXPECT_EQ(store->TryGet(key, DeadlineIn(5s)).status().code(), code);
      EXPECT_EQ(store->Add(key, 1, DeadlineIn(5s)).status().code(), code);
      EXPECT_EQ(store->Wait(keys, DeadlineIn(5s)).code(), code);
      EXPECT_EQ(store->Delete(key, DeadlineIn(5s)).status().code(), code);
      EXPECT_EQ(store->CompareSet(key, std::nullopt, "v", DeadlineIn(5s)).status().code(), code);
    }
    EXPECT_EQ(store->Set("k", big_value, DeadlineIn(5s)).code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(store->CompareSet("k", std::nullopt, big_value, DeadlineIn(5s)).status().code(),
              StatusCode::kResourceExhausted);
    EXPECT_EQ(*store->NumKeys(DeadlineIn(5s)), 0);  // nothing half-done
    EXPECT_TRUE(store->Set("k", std::string(kMaxValueBytes, 'v'), DeadlineIn(5s)).ok());
  }
}

// NumKeys through the Store interface, alike in both stores: keys made by
// Set, Add and CompareSet count, a failed CompareSet and deleted keys not.
TEST(TcpStoreTest, NumKeysCountsTheSameInTheInMemoryStore) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  testing::InMemoryStore in_memory;
  for (Store* store : {static_cast<Store*>(client.get()), static_cast<Store*>(&in_memory)}) {
    SCOPED_TRACE(store == &in_memory ? "in-memory store" : "TCP store");
    EXPECT_EQ(*store->NumKeys(DeadlineIn(5s)), 0);
    ASSERT_TRUE(store->Set("a", "1", DeadlineIn(5s)).ok());
    ASSERT_TRUE(store->Set("a", "2", DeadlineIn(5s)).ok());
    ASSERT_TRUE(store->Add("b", 1, DeadlineIn(5s)).ok());
    ASSERT_TRUE(store->CompareSet("c", std::nullopt, "x", DeadlineIn(5s)).ok());
    ASSERT_TRUE(store->CompareSet("d", std::string_view("y"), "z", DeadlineIn(5s)).ok());
    EXPECT_EQ(*store->NumKeys(DeadlineIn(5s)), 3);
    ASSERT_TRUE(*store->Delete("a", DeadlineIn(5s)));
    EXPECT_EQ(*store->NumKeys(DeadlineIn(5s)), 2);
  }
}

// A store that does not count says so, naming the call.
TEST(TcpStoreTest, NumKeysOfAStoreThatCannotCountSaysSo) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  DefaultCheckStore store(*client);
  StatusOr<int64_t> count = store.NumKeys(DeadlineIn(5s));
  EXPECT_EQ(count.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(count.status().message(), HasSubstr("num_keys"));
}

TEST(TcpStoreTest, CompareSetWritesOnlyOverTheExpectedValue) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  auto waiter = ConnectClient(*server);
  const Deadline deadline = DeadlineIn(10s);
  // A Get parked on the key is answered by the compare_set that creates it.
  StatusOr<std::string> parked = InternalError("not run");
  std::thread get([&] { parked = waiter->Get("k", deadline); });
  EXPECT_EQ(*client->CompareSet("k", std::nullopt, "first", deadline), "first");
  get.join();
  EXPECT_EQ(*parked, "first");
  // Not absent any more, nor "other": left as it is, and returned.
  EXPECT_EQ(*client->CompareSet("k", std::nullopt, "second", deadline), "first");
  EXPECT_EQ(*client->CompareSet("k", "other", "second", deadline), "first");
  EXPECT_EQ(*client->CompareSet("k", "first", "second", deadline), "second");
  EXPECT_EQ(*client->Get("k", deadline), "second");
  // An expected value where there is none: nothing is set.
  EXPECT_EQ(*client->CompareSet("absent", "x", "y", deadline), std::nullopt);
  EXPECT_FALSE(client->TryGet("absent", deadline)->has_value());
  EXPECT_EQ(*client->CompareSet("empty", std::nullopt, "", deadline), "");
  EXPECT_EQ(*client->CompareSet("empty", "", "full", deadline), "full");
  const std::string big(kMaxValueBytes / 2 + 1, 'v');
  EXPECT_EQ(client->CompareSet("k", big, big, deadline).status().code(), StatusCode::kResourceExhausted);
}

// Many clients post to one absent key at once: exactly one value is
// written, and every client is told that one.
TEST(TcpStoreTest, CompareSetOfAnAbsentKeyHasOneWinner) {
  auto server = StartServer();
  constexpr int kClients = 16;
  std::vector<std::unique_ptr<TcpStoreClient>> clients;
  for (int i = 0; i < kClients; ++i) clients.push_back(ConnectClient(*server));
  std::vector<std::optional<std::string>> seen(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      auto posted = clients[i]->CompareSet("failure", std::nullopt, "notice " + std::to_string(i), DeadlineIn(10s));
      if (posted.ok()) seen[i] = *posted;
    });
  }
  for (auto& t : threads) t.join();
  auto stored = clients[0]->TryGet("failure", DeadlineIn(5s));
  ASSERT_TRUE(stored.ok() && stored->has_value());
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(seen[i], **stored) << "client " << i;
}

TEST(TcpStoreTest, MalformedRequestsAreRefusedAndTheServerKeepsServing) {
  LogSink log;
  TcpStoreServerOptions options;
  options.log = log.Fn();
  auto server = StartServer(options);
  auto bystander = ConnectClient(*server);

  {  // Unknown operation.
    RawConnection raw(server->port());
    raw.Handshake();
    wire::Writer w;
    w.U8(99);
    w.U32(5);
    raw.Send(w.Frame());
    std::optional<std::string> reply = raw.ReadFrame(5s);
    ASSERT_TRUE(reply.has_value());
    uint32_t id = 0;
    auto [code, message] = RawConnection::ParseReply(*reply, &id);
    EXPECT_EQ(id, 5u);
    EXPECT_EQ(code, StatusCode::kInvalidArgument);
    EXPECT_EQ(message, "unknown operation 99");
    EXPECT_TRUE(raw.ClosedWithin(5s));
  }
  {  // A key length that runs past the end of the frame.
    RawConnection raw(server->port());
    raw.Handshake();
    wire::Writer w;
    w.U8(static_cast<uint8_t>(wire::Op::kSet));
    w.U32(6);
    w.U32(1000);
    w.Bytes("abc");
    raw.Send(w.Frame());
    std::optional<std::string> reply = raw.ReadFrame(5s);
    ASSERT_TRUE(reply.has_value());
    auto [code, message] = RawConnection::ParseReply(*reply, nullptr);
    EXPECT_EQ(code, StatusCode::kInvalidArgument);
    EXPECT_EQ(message, "truncated key");
    EXPECT_TRUE(raw.ClosedWithin(5s));
  }
  {  // Trailing garbage after a well-formed request.
    RawConnection raw(server->port());
    raw.Handshake();
    wire::Writer w;
    w.U8(static_cast<uint8_t>(wire::Op::kTryGet));
    w.U32(7);
    w.String("k");
    w.U8(0);
    raw.Send(w.Frame());
    std::optional<std::string> reply = raw.ReadFrame(5s);
    ASSERT_TRUE(reply.has_value());
    EXPECT_EQ(RawConnection::ParseReply(*reply, nullptr).second, "trailing bytes after try_get");
  }
  {  // An oversized frame is refused from its header, before any body.
    RawConnection raw(server->port());
    raw.Handshake();
    wire::Writer w;
    w.U32(0x7fffffff);
    raw.Send(w.body());
    std::optional<std::string> reply = raw.ReadFrame(5s);
    ASSERT_TRUE(reply.has_value());
    auto [code, message] = RawConnection::ParseReply(*reply, nullptr);
    EXPECT_EQ(code, StatusCode::kResourceExhausted);
    EXPECT_THAT(message, HasSubstr("frame of 2147483647 bytes exceeds the limit"));
    EXPECT_TRUE(raw.ClosedWithin(5s));
  }
  {  // A key over the bound inside a well-formed frame: answered, not closed.
    RawConnection raw(server->port());
    raw.Handshake();
    raw.Send(TryGetFrame(8, std::string(kMaxKeyBytes + 1, 'k')));
    std::optional<std::string> reply = raw.ReadFrame(5s);
    ASSERT_TRUE(reply.has_value());
    auto [code, message] = RawConnection::ParseReply(*reply, nullptr);
    EXPECT_EQ(code, StatusCode::kResourceExhausted);
    EXPECT_EQ(message, "key of 1025 bytes exceeds the limit of 1024");
    EXPECT_FALSE(raw.ClosedWithin(200ms));
  }
  {  // Not our protocol at all: its first bytes read as a huge length.
    RawConnection raw(server->port());
    raw.Send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_TRUE(raw.ClosedWithin(5s));
  }
  {  // A well-framed handshake without the magic.
    RawConnection raw(server->port());
    wire::Writer w;
    w.Bytes("HELO and some more");
    raw.Send(w.Frame());
    EXPECT_TRUE(raw.ClosedWithin(5s));
  }
  {  // An oversized handshake.
    RawConnection raw(server->port());
    wire::Writer w;
    w.U32(1 << 20);
    raw.Send(w.body());
    EXPECT_TRUE(raw.ClosedWithin(5s));
  }
  {  // Another protocol version.
    RawConnection raw(server->port());
    wire::Writer w;
    w.Bytes(std::string_view(wire::kMagic, 4));
    w.U16(wire::kVersion + 1);
    w.U16(0);
    w.String(kToken);
    raw.Send(w.Frame());
    EXPECT_TRUE(raw.ClosedWithin(5s));
  }
  EXPECT_GE(server->stats().refused_malformed, 5u);
  EXPECT_GE(server->stats().refused_oversized, 3u);
  EXPECT_TRUE(log.Contains("refused unknown request from 127.0.0.1:"));
  EXPECT_TRUE(log.Contains("not a store handshake"));
  EXPECT_TRUE(log.Contains("client speaks store protocol version 2, this server speaks 1"));
  // Everyone else was served throughout.
  ASSERT_TRUE(bystander->Set("still", "here", DeadlineIn(5s)).ok());
  EXPECT_EQ(*bystander->Get("still", DeadlineIn(5s)), "here");
}

// A client refused while it is still sending (the body of a frame refused
// from its header) finishes sending and then reads why: the server shuts
// down its writing side after the reply and reads the rest before it
// closes. Closing with input unread reset the connection, and the client's
// send failed ("Connection reset by peer") with the reason unread.
TEST(TcpStoreTest, AClientStillSendingWhenRefusedReadsTheReason) {
  // A grace far past what the send takes, even on a loaded host.
  TcpStoreServerOptions options;
  options.refused_close_grace = 30s;
  auto server = StartServer(options);
  RawConnection raw(server->port());
  raw.Handshake();
  // A small send buffer: most of the body is still to send when the
  // refusal comes.
  raw.SetSendBuffer(16 << 10);
  wire::Writer w;
  w.U32(wire::kMaxFrameBytes + 1);
  raw.Send(w.body());
  // 1 MiB more of it (all of it, 5 MiB through this small buffer, took
  // longer than the default 1 s grace for a refused client on a loaded
  // host).
  const Status sent = raw.SendWithin(std::string(1 << 20, 'x'), 10s);
  ASSERT_TRUE(sent.ok()) << sent;
  std::optional<std::string> reply = raw.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value());
  auto [code, message] = RawConnection::ParseReply(*reply, nullptr);
  EXPECT_EQ(code, StatusCode::kResourceExhausted);
  EXPECT_THAT(message, HasSubstr("exceeds the limit"));
  EXPECT_TRUE(raw.ClosedWithin(5s));
}

// A newcomer turned away because every place is taken, that sends more
// than a hello (a request behind it, here 1 MiB of one), reads why: closed
// with that input unread, its connection was reset and the reply lost
// ("Connection reset by peer" in its send).
TEST(TcpStoreTest, ANewcomerSendingMoreThanAHelloWhenEveryPlaceIsTakenReadsWhy) {
  TcpStoreServerOptions options;
  options.max_connections = 1;
  options.refused_close_grace = 30s;  // far past the send, even on a loaded host
  auto server = StartServer(options);
  auto holder = ConnectClient(*server);  // the only place
  RawConnection raw(server->port());
  raw.SetSendBuffer(16 << 10);
  wire::Writer w;
  w.Bytes(std::string_view(wire::kMagic, 4));
  w.U16(wire::kVersion);
  w.U16(0);
  w.String(kToken);
  raw.Send(w.Frame());
  const Status sent = raw.SendWithin(std::string(1 << 20, 'x'), 10s);
  ASSERT_TRUE(sent.ok()) << sent;
  std::optional<std::string> reply = raw.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value()) << "no reply to the refused newcomer";
  EXPECT_THAT(*reply, HasSubstr("already holds 1 connections"));
  EXPECT_TRUE(raw.ClosedWithin(5s));
  EXPECT_TRUE(holder->Set("k", "v", DeadlineIn(5s)).ok());
}

// Clients refused for a wrong token that never hang up linger at most a
// few at a time (max_unauthenticated), and give their places up to a
// newcomer at once: they do not keep the job out for their grace (10 s
// here, so that the bounds below can leave room for a loaded host and
// still be far below it).
TEST(TcpStoreTest, RefusedClientsThatNeverHangUpDoNotHoldThePlaces) {
  TcpStoreServerOptions options;
  options.max_connections = 4;
  options.max_unauthenticated = 2;
  options.refused_close_grace = 10s;
  auto server = StartServer(options);
  std::vector<std::unique_ptr<RawConnection>> refused;
  for (int i = 0; i < 8; ++i) {
    refused.push_back(std::make_unique<RawConnection>(server->port()));
    wire::Writer w;
    w.Bytes(std::string_view(wire::kMagic, 4));
    w.U16(wire::kVersion);
    w.U16(0);
    w.String("wrong token");
    refused.back()->Send(w.Frame());
    std::optional<std::string> reply = refused.back()->ReadFrame(5s);
    ASSERT_TRUE(reply.has_value()) << "connection " << i;
  }
  // Well within the 10 s each could linger.
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& st) { return st.open_connections <= 2; }, 3s))
      << server->stats().open_connections << " connections open";
  const auto start = Clock::now();
  auto client = TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, DeadlineIn(5s));
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_LT(Clock::now() - start, 3s);
}

// A client that goes on sending past what the server drains (more than the
// largest frame) is closed anyway, and the server keeps serving.
TEST(TcpStoreTest, ARefusedClientThatNeverStopsSendingIsClosed) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  RawConnection raw(server->port());
  raw.Handshake();
  wire::Writer w;
  w.U32(wire::kMaxFrameBytes + 1);
  raw.Send(w.body());
  const std::string chunk(1 << 20, 'x');
  Status sent = Status::Ok();
  const Deadline until = DeadlineIn(20s);
  while (sent.ok() && Clock::now() < until) sent = raw.SendWithin(chunk, 5s);
  EXPECT_EQ(sent.code(), StatusCode::kUnavailable) << sent;
  EXPECT_TRUE(client->Set("k", "v", DeadlineIn(5s)).ok());
}

// A Get with a deadline further out than a request carries (INT_MAX ms,
// 24.8 days) is asked again when the server's wait of that length ends
// with the caller's deadline still ahead. A stand-in server answers the
// first request at once as the real one would after those days.
TEST(TcpStoreTest, AGetWithADeadlinePastWhatARequestCarriesIsAskedAgain) {
  StatusOr<std::vector<UniqueFd>> listening = ListenTcp("127.0.0.1", 0, 4, DeadlineIn(5s));
  ASSERT_TRUE(listening.ok()) << listening.status();
  const int listen_fd = (*listening)[0].get();
  const int port = *LocalPort(listen_fd);
  std::vector<uint32_t> carried_ms;  // each Get's timeout, as the server got it
  std::thread server([&] {
    pollfd pfd{listen_fd, POLLIN, 0};
    if (poll(&pfd, 1, 5000) != 1) return;
    UniqueFd fd(accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    std::string in;
    auto next_frame = [&]() -> std::optional<std::string> {
      const Deadline until = DeadlineIn(5s);
      while (true) {
        std::optional<uint32_t> length = wire::PeekFrameLength(in);
        if (length && in.size() >= wire::kFrameHeaderBytes + *length) {
          std::string body = in.substr(wire::kFrameHeaderBytes, *length);
          in.erase(0, wire::kFrameHeaderBytes + *length);
          return body;
        }
        if (!RecvSome(fd.get(), in, 1 << 16, until).ok()) return std::nullopt;
      }
    };
    if (!next_frame()) return;  // the hello
    wire::Writer hello;
    hello.Bytes(std::string_view(wire::kMagic, 4));
    hello.U16(wire::kVersion);
    hello.U8(0);
    hello.String("");
    if (!SendAll(fd.get(), hello.Frame(), DeadlineIn(5s), nullptr).ok()) return;
    for (int round = 0; round < 2; ++round) {
      std::optional<std::string> request = next_frame();
      if (!request) return;
      wire::Reader r(*request);
      uint8_t op = 0;
      uint32_t id = 0, timeout_ms = 0;
      if (!r.U8(op) || !r.U32(id) || !r.U32(timeout_ms)) return;
      carried_ms.push_back(timeout_ms);
      wire::Writer reply;
      reply.U32(id);
      if (round == 0) {
        reply.U8(static_cast<uint8_t>(StatusCode::kTimedOut));
        reply.String("key 'k' was not set before the deadline");
      } else {
        reply.U8(0);
        reply.String("v");
      }
      if (!SendAll(fd.get(), reply.Frame(), DeadlineIn(5s), nullptr).ok()) return;
    }
    // Holds the connection until the client is done with it.
    std::string rest;
    (void)RecvSome(fd.get(), rest, 1, DeadlineIn(5s));
  });
  StatusOr<std::unique_ptr<TcpStoreClient>> client = TcpStoreClient::Connect("127.0.0.1", port, "", DeadlineIn(5s));
  StatusOr<std::string> got = client.ok() ? (*client)->Get("k", Deadline::max()) : client.status();
  if (client.ok()) (*client).reset();  // ends the connection, and the stand-in's wait
  server.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "v");
  EXPECT_EQ(carried_ms, (std::vector<uint32_t>{static_cast<uint32_t>(INT_MAX), static_cast<uint32_t>(INT_MAX)}));
}

TEST(TcpStoreTest, SilentClientIsDropped) {
  LogSink log;
  TcpStoreServerOptions options;
  // Long enough for the client below, which must be accepted, to finish
  // its handshake on a loaded machine.
  options.handshake_timeout = 1s;
  options.log = log.Fn();
  auto server = StartServer(options);
  // A client that authenticated and then idles, for longer than the
  // handshake may take, is not dropped. It idles while the silent one
  // below is dropped (it used to idle after, 1.5 s more).
  auto idle = ConnectClient(*server);
  const Deadline idle_since = Clock::now();
  // The server's clock starts when it accepts, which may be before the
  // connect call returns here.
  const Deadline start = Clock::now();
  RawConnection silent(server->port());
  EXPECT_TRUE(silent.ClosedWithin(5s));
  EXPECT_GE(Clock::now() - start, 950ms);
  EXPECT_EQ(server->stats().dropped_silent, 1u);
  EXPECT_TRUE(log.Contains("no handshake within 1000 ms"));
  std::this_thread::sleep_until(idle_since + 1500ms);
  EXPECT_TRUE(idle->Set("k", "v", DeadlineIn(5s)).ok());
  EXPECT_EQ(server->stats().dropped_silent, 1u);
}

// A per-connection bound on unread replies smaller than one reply drops
// clients that stop reading, not those that read: a Get of a value larger
// than the bound, with nothing else unread, dropped the connection.
TEST(TcpStoreTest, AReplyLargerThanTheUnreadBoundGoesToAClientThatReads) {
  LogSink log;
  TcpStoreServerOptions options;
  options.max_connection_output_bytes = 64 << 10;
  options.log = log.Fn();
  auto server = StartServer(options);
  auto client = ConnectClient(*server);
  const std::string value(1 << 20, 'v');
  ASSERT_TRUE(client->Set("big", value, DeadlineIn(5s)).ok());
  for (int i = 0; i < 3; ++i) {
    StatusOr<std::string> got = client->Get("big", DeadlineIn(5s));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->size(), value.size());
  }
  EXPECT_FALSE(log.Contains("replies unread"));
  EXPECT_EQ(server->stats().open_connections, 1u);
}

TEST(TcpStoreTest, ClientThatStopsReadingIsDropped) {
  TcpStoreServerOptions options;
  options.max_connection_output_bytes = 3 << 20;
  auto server = StartServer(options);
  auto setter = ConnectClient(*server);
  ASSERT_TRUE(setter->Set("blob", std::string(1 << 20, 'b'), DeadlineIn(5s)).ok());
  RawConnection greedy(server->port());
  greedy.Handshake();
  // Ask for the 1 MiB value many times and never read: the replies pile up
  // past the socket buffers and then past the per-connection bound. All
  // requests in one send (about 1 KiB): sent one by one, a client thread
  // descheduled part-way on a loaded machine found the connection already
  // dropped, and its next send failed.
  std::string requests;
  for (uint32_t i = 0; i < 64; ++i) requests += TryGetFrame(i + 1, "blob");
  greedy.Send(requests);
  const Deadline deadline = DeadlineIn(5s);
  while (server->stats().open_connections > 1 && Clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(server->stats().open_connections, 1u);
  EXPECT_TRUE(setter->Set("ok", "1", DeadlineIn(5s)).ok());
}

TEST(TcpStoreTest, TotalBufferBoundQueuesFramesWithoutDeadlock) {
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 5 << 20;  // about one large frame at a time
  auto server = StartServer(options);
  constexpr int kClients = 4;
  std::vector<std::thread> threads;
  std::vector<Status> results(kClients);
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      auto client = ConnectClient(*server);
      const std::string value(3 << 20, static_cast<char>('a' + t));
      results[t] = client->Set("big/" + std::to_string(t), value, DeadlineIn(20s));
      if (results[t].ok()) {
        StatusOr<std::string> got = client->Get("big/" + std::to_string(t), DeadlineIn(20s));
        if (!got.ok()) results[t] = got.status();
        else if (*got != value) results[t] = InternalError("value differs");
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kClients; ++t) EXPECT_TRUE(results[t].ok()) << results[t];
}

// A whole Set frame (request `id`) of a 3 MiB value under `key`, for tests
// that send it in pieces.
std::string SetFrame(uint32_t id, const std::string& key) {
  wire::Writer w;
  w.U8(static_cast<uint8_t>(wire::Op::kSet));
  w.U32(id);
  w.String(key);
  w.String(std::string(3 << 20, 'x'));
  return w.Frame();
}

// Frames waiting for room get it in the order they began to wait, whatever
// their connections' age (it used to go by connection id, so a young
// connection's frame could wait behind older ones that kept coming).
TEST(TcpStoreTest, FramesWaitingForRoomGetItInTheOrderTheyCame) {
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 5 << 20;  // one 3 MiB frame at a time
  auto server = StartServer(options);
  // A 3 MiB Set whose first bytes hold room for the whole frame until the
  // rest is sent.
  auto older = ConnectClient(*server);  // connected first, waits second
  RawConnection holder(server->port()), newer(server->port());
  holder.Handshake();
  newer.Handshake();
  const std::string held = SetFrame(1, "held"), waits_first = SetFrame(2, "newer");
  // Each step waits until the server has seen the one before, so the order
  // in which the frames began to wait is the order written here.
  holder.Send(std::string_view(held).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [&](const TcpStoreServerStats& s) {
    return s.buffered_bytes >= held.size();
  })) << "the holder's frame never got its room: " << server->stats().buffered_bytes
      << " bytes buffered";
  newer.Send(std::string_view(waits_first).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 1;
  })) << "the newer connection's frame never began to wait for room: "
      << server->stats().frames_waiting_for_room << " frames waiting";
  std::atomic<bool> older_done{false};
  Status older_status;
  std::thread older_set([&] {
    older_status = older->Set("older", std::string(3 << 20, 'o'), DeadlineIn(20s));
    older_done = true;
  });
  // EXPECT, not ASSERT, from here on: the steps below let older_set end.
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 2;
  })) << "the older connection's frame never began to wait for room: "
      << server->stats().frames_waiting_for_room << " frames waiting";
  holder.Send(std::string_view(held).substr(1000));
  ASSERT_TRUE(holder.ReadFrame(5s).has_value());
  // The room went to the newer connection's frame, which stops half-way:
  // the older one's keeps waiting.
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 1;
  })) << "the held room was not handed on: " << server->stats().frames_waiting_for_room
      << " frames waiting";
  // Time for a wrongly ordered handover to show (the older Set would
  // finish); with the right order nothing changes here.
  std::this_thread::sleep_for(500ms);
  EXPECT_FALSE(older_done.load()) << "the older connection's frame got the room first";
  newer.Send(std::string_view(waits_first).substr(1000));
  std::optional<std::string> reply = newer.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value());
  uint32_t id = 0;
  EXPECT_EQ(RawConnection::ParseReply(*reply, &id).first, StatusCode::kOk);
  older_set.join();
  EXPECT_TRUE(older_status.ok()) << older_status;
}

// A client that closes while its frame waits for room is dropped at once,
// with its place in the queue: its connection is not read while it waits,
// and its close used to go unseen until the room came (here, never: the
// holder's frame is neither finished nor dropped within the test).
TEST(TcpStoreTest, AClientThatClosesWhileWaitingForRoomIsDroppedPromptly) {
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 5 << 20;  // one 3 MiB frame at a time
  auto server = StartServer(options);
  RawConnection holder(server->port()), quitter(server->port()), stays(server->port());
  holder.Handshake();
  quitter.Handshake();
  stays.Handshake();
  const std::string held = SetFrame(1, "held"), quits = SetFrame(2, "quits"),
                    waits = SetFrame(3, "stays");
  holder.Send(std::string_view(held).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [&](const TcpStoreServerStats& s) {
    return s.buffered_bytes >= held.size();
  })) << "the holder's frame never got its room: " << server->stats().buffered_bytes
      << " bytes buffered";
  quitter.Send(std::string_view(quits).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 1;
  })) << server->stats().frames_waiting_for_room << " frames waiting";
  stays.Send(std::string_view(waits).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 2;
  })) << server->stats().frames_waiting_for_room << " frames waiting";
  ASSERT_EQ(server->stats().open_connections, 3u);
  quitter.Close();
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.open_connections == 2 && s.frames_waiting_for_room == 1;
  }, 3s)) << "the closed client was kept: " << server->stats().open_connections
          << " connections open, " << server->stats().frames_waiting_for_room
          << " frames waiting";
  // The holder's room goes to the frame still waiting, which completes.
  holder.Send(std::string_view(held).substr(1000));
  std::optional<std::string> reply = holder.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(RawConnection::ParseReply(*reply, nullptr).first, StatusCode::kOk);
  stays.Send(std::string_view(waits).substr(1000));
  reply = stays.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(RawConnection::ParseReply(*reply, nullptr).first, StatusCode::kOk);
  EXPECT_EQ(server->stats().dropped_stalled, 0u);
}

// A client that sends a whole request and then shuts down its sending side
// (a half-close) while that request waits for room still gets its answer,
// as it does when the request is read at once: it used to be dropped
// unanswered, its end of stream taken for a hang-up. One whose request is
// cut short by the half-close is still dropped at once (nothing to answer).
TEST(TcpStoreTest, AHalfClosedClientWhoseRequestWaitsForRoomIsAnswered) {
  LogSink log;
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 5 << 20;  // one 3 MiB frame at a time
  options.log = log.Fn();
  auto server = StartServer(options);
  RawConnection holder(server->port()), large(server->port()), whole(server->port()),
      cut(server->port());
  holder.Handshake();
  large.Handshake();
  whole.Handshake();
  cut.Handshake();
  const std::string held = SetFrame(1, "held"), waits = SetFrame(2, "large");
  holder.Send(std::string_view(held).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [&](const TcpStoreServerStats& s) {
    return s.buffered_bytes >= held.size();
  })) << "the holder's frame never got its room: " << server->stats().buffered_bytes
      << " bytes buffered";
  large.Send(std::string_view(waits).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 1;
  })) << server->stats().frames_waiting_for_room << " frames waiting";
  // A small Set, whole, waits behind the large frame, and so does a request
  // of which only the first bytes come; then both clients half-close.
  wire::Writer set;
  set.U8(static_cast<uint8_t>(wire::Op::kSet));
  set.U32(7);
  set.String("half-closed");
  set.String("its value");
  const std::string set_frame = set.Frame();
  whole.Send(set_frame);
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 2;
  })) << server->stats().frames_waiting_for_room << " frames waiting";
  cut.Send(std::string_view(set_frame).substr(0, 8));
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 3;
  })) << server->stats().frames_waiting_for_room << " frames waiting";
  whole.ShutdownWrite();
  cut.ShutdownWrite();
  // The cut request's end is seen after the whole one's, which came first.
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.open_connections <= 3 && s.frames_waiting_for_room <= 2;
  }, 3s)) << "the cut request's connection was kept: " << server->stats().open_connections
          << " connections open, " << server->stats().frames_waiting_for_room << " frames waiting";
  EXPECT_TRUE(log.Contains("its client closed while its request waited for room"));
  ASSERT_EQ(server->stats().open_connections, 3u) << "the half-closed client with a whole request was dropped";
  ASSERT_EQ(server->stats().frames_waiting_for_room, 2u);
  // The room goes to the large frame, and what is left to the small one.
  holder.Send(std::string_view(held).substr(1000));
  ASSERT_TRUE(holder.ReadFrame(5s).has_value());
  std::optional<std::string> reply = whole.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value()) << "the half-closed client got no answer";
  uint32_t id = 0;
  EXPECT_EQ(RawConnection::ParseReply(*reply, &id).first, StatusCode::kOk);
  EXPECT_EQ(id, 7u);
  // Then its end of stream: the server closes the connection.
  EXPECT_TRUE(whole.ClosedWithin(5s)) << "the half-closed client's connection stayed open";
  EXPECT_TRUE(cut.ClosedWithin(1s)) << "the cut request's connection stayed open";
  auto client = ConnectClient(*server);
  StatusOr<std::optional<std::string>> stored = client->TryGet("half-closed", DeadlineIn(5s));
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->value_or("(absent)"), "its value");
  large.Send(std::string_view(waits).substr(1000));
  reply = large.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(RawConnection::ParseReply(*reply, nullptr).first, StatusCode::kOk);
  EXPECT_EQ(server->stats().dropped_stalled, 0u);
}

// A half-closed client gets the whole of a reply larger than the socket
// buffers take at once: the server used to drop the connection at the end
// of stream with the rest of the reply unsent.
TEST(TcpStoreTest, AHalfClosedClientGetsAllOfALargeReply) {
  auto server = StartServer();
  auto setter = ConnectClient(*server);
  const std::string value(kMaxValueBytes, 'v');
  ASSERT_TRUE(setter->Set("large", value, DeadlineIn(5s)).ok());
  RawConnection reader(server->port());
  reader.Handshake();
  // A small receive buffer, read late: most of the reply waits in the
  // server when it reads the end of stream.
  reader.SetReceiveBuffer(64 << 10);
  reader.Send(TryGetFrame(3, "large"));
  reader.ShutdownWrite();
  std::this_thread::sleep_for(500ms);
  std::optional<std::string> reply = reader.ReadFrame(10s);
  ASSERT_TRUE(reply.has_value()) << "the reply was cut short";
  wire::Reader r(*reply);
  uint32_t id = 0;
  uint8_t code = 255, present = 0;
  std::string_view got;
  ASSERT_TRUE(r.U32(id) && r.U8(code) && r.U8(present) && r.String(got, kMaxValueBytes));
  EXPECT_EQ(id, 3u);
  EXPECT_EQ(code, 0);
  EXPECT_EQ(present, 1);
  EXPECT_EQ(got.size(), value.size());
  EXPECT_TRUE(reader.ClosedWithin(5s));
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.open_connections == 1 && s.buffered_bytes == 0;
  }, 5s)) << server->stats().open_connections << " connections open, "
          << server->stats().buffered_bytes << " bytes buffered";
}

// A client that ends its stream part-way through a request while replies
// to it are still unsent: the request is not answered, and the room held
// for it goes at once, not when the connection closes after the replies.
TEST(TcpStoreTest, AClientEndingItsStreamMidRequestLetsGoOfItsRoomAtOnce) {
  auto server = StartServer();
  auto setter = ConnectClient(*server);
  ASSERT_TRUE(setter->Set("large", std::string(kMaxValueBytes, 'v'), DeadlineIn(5s)).ok());
  RawConnection reader(server->port());
  reader.Handshake();
  reader.SetReceiveBuffer(64 << 10);  // most of the reply waits in the server
  reader.Send(TryGetFrame(4, "large"));
  const std::string cut = SetFrame(5, "cut");
  reader.Send(std::string_view(cut).substr(0, 1000));
  // The reply may have gone whole into the kernel's socket buffers (they
  // grow to 4 MiB); the room held for the cut frame is counted apart.
  ASSERT_TRUE(StatsReach(*server, [&](const TcpStoreServerStats& s) {
    return s.receiving_bytes == cut.size();
  })) << "the cut frame's room was never held: " << server->stats().receiving_bytes << " bytes";
  const uint64_t held = server->stats().buffered_bytes;
  reader.ShutdownWrite();
  EXPECT_TRUE(StatsReach(*server, [&](const TcpStoreServerStats& s) {
    return s.receiving_bytes == 0 && s.buffered_bytes + cut.size() <= held;
  }, 3s)) << "the cut frame's room was kept: " << server->stats().receiving_bytes << " bytes held for it, "
          << server->stats().buffered_bytes << " buffered, " << held << " before the end of the stream";
  std::optional<std::string> reply = reader.ReadFrame(10s);
  ASSERT_TRUE(reply.has_value()) << "the reply was cut short";
  uint32_t id = 0;
  EXPECT_EQ(RawConnection::ParseReply(*reply, &id).first, StatusCode::kOk);
  EXPECT_EQ(id, 4u);
  EXPECT_TRUE(reader.ClosedWithin(5s)) << "the cut request was answered, or the connection kept";
}

// A rank that connects while the frames of others hold every bit of room
// under max_buffered_bytes is let in at once: its handshake used to wait
// for room like a request, until the frames ahead were done or its
// handshake deadline dropped it.
TEST(TcpStoreTest, HandshakeIsReadWhileOtherFramesHoldAllTheRoom) {
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 1 << 20;  // less than the one 3 MiB frame
  auto server = StartServer(options);
  RawConnection holder(server->port());
  holder.Handshake();
  const std::string held = SetFrame(1, "held");
  holder.Send(std::string_view(held).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [&](const TcpStoreServerStats& s) {
    return s.buffered_bytes >= held.size();
  })) << "the holder's frame never got its room: " << server->stats().buffered_bytes
      << " bytes buffered";
  const Deadline start = Clock::now();
  StatusOr<std::unique_ptr<TcpStoreClient>> newcomer =
      TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, DeadlineIn(3s));
  EXPECT_TRUE(newcomer.ok()) << newcomer.status();
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_EQ(server->stats().frames_waiting_for_room, 0u);
  // The held frame completes as before.
  holder.Send(std::string_view(held).substr(1000));
  std::optional<std::string> reply = holder.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(RawConnection::ParseReply(*reply, nullptr).first, StatusCode::kOk);
  if (newcomer.ok()) {
    StatusOr<std::string> got = (*newcomer)->Get("held", DeadlineIn(5s));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->size(), size_t{3} << 20);
  }
}

// A frame that would fit still waits while others wait for room: steady
// small requests used to take every bit of room freed, and a large Set
// waiting for it never got its turn.
TEST(TcpStoreTest, ANewFrameThatWouldFitWaitsBehindFramesWaitingForRoom) {
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 5 << 20;  // one 3 MiB frame at a time
  auto server = StartServer(options);
  auto small = ConnectClient(*server);
  RawConnection holder(server->port()), large(server->port());
  holder.Handshake();
  large.Handshake();
  const std::string held = SetFrame(1, "held"), waits = SetFrame(2, "large");
  holder.Send(std::string_view(held).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [&](const TcpStoreServerStats& s) {
    return s.buffered_bytes >= held.size();
  }));
  large.Send(std::string_view(waits).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 1;
  }));
  // 3 MiB held of 5: the small Set would fit, but the large one came first.
  std::atomic<bool> small_done{false};
  Status small_status;
  std::thread small_set([&] {
    small_status = small->Set("small", "x", DeadlineIn(20s));
    small_done = true;
  });
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 2;
  }, 3s)) << "the small Set did not wait: " << server->stats().frames_waiting_for_room
          << " frames waiting";
  EXPECT_FALSE(small_done.load()) << "the small Set went ahead of the waiting large one";
  // The held room goes to the large frame, and what is left to the small one.
  holder.Send(std::string_view(held).substr(1000));
  ASSERT_TRUE(holder.ReadFrame(5s).has_value());
  small_set.join();
  EXPECT_TRUE(small_status.ok()) << small_status;
  large.Send(std::string_view(waits).substr(1000));
  std::optional<std::string> reply = large.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(RawConnection::ParseReply(*reply, nullptr).first, StatusCode::kOk);
}

// Sends `n` Gets of `key` on `c` (request ids 1..n), each with a
// server-side deadline of `timeout_ms`, without reading the replies.
void SendGets(RawConnection& c, int n, uint32_t timeout_ms, const std::string& key) {
  for (uint32_t i = 0; i < static_cast<uint32_t>(n); ++i) {
    wire::Writer w;
    w.U8(static_cast<uint8_t>(wire::Op::kGet));
    w.U32(i + 1);
    w.U32(timeout_ms);
    w.String(key);
    c.Send(w.Frame());
  }
}

// A client that half-closes while calls of its wait parked gets an answer
// to each, naming why, and then the close; they used to be dropped
// unanswered, leaving it waiting for its deadline (20 s here). The store
// cannot keep them until their keys are set: a client that exited or
// called Close() ends its stream the same way (CloseWakesAParkedCall).
TEST(TcpStoreTest, AHalfClosedClientsParkedCallsAreAnsweredAtTheEndOfItsStream) {
  auto server = StartServer();
  RawConnection waiter(server->port());
  waiter.Handshake();
  SendGets(waiter, 2, 20000, "never");
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.parked_waits == 2; }))
      << server->stats().parked_waits << " waits parked";
  waiter.ShutdownWrite();
  for (uint32_t want : {1u, 2u}) {
    std::optional<std::string> reply = waiter.ReadFrame(5s);
    ASSERT_TRUE(reply.has_value()) << "no answer to parked call " << want;
    uint32_t id = 0;
    const auto [code, message] = RawConnection::ParseReply(*reply, &id);
    EXPECT_EQ(id, want);
    EXPECT_EQ(code, StatusCode::kUnavailable);
    EXPECT_THAT(message, HasSubstr("the store stopped waiting: the client ended its stream"));
  }
  EXPECT_TRUE(waiter.ClosedWithin(5s)) << "the half-closed client's connection stayed open";
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.parked_waits == 0 && s.open_connections == 0;
  })) << server->stats().parked_waits << " waits parked, " << server->stats().open_connections
      << " connections open";
}

// The same when the stream ends part-way through a request that waits for
// room: the connection is dropped at once (the request can never be
// answered), but its parked call is answered first.
TEST(TcpStoreTest, AParkedCallIsAnsweredWhenItsClientEndsItsStreamInARequestWaitingForRoom) {
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 5 << 20;  // one 3 MiB frame at a time
  auto server = StartServer(options);
  RawConnection holder(server->port()), cut(server->port());
  holder.Handshake();
  cut.Handshake();
  SendGets(cut, 1, 20000, "never");
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.parked_waits == 1; }))
      << server->stats().parked_waits << " waits parked";
  const std::string held = SetFrame(7, "held"), waits = SetFrame(2, "cut");
  holder.Send(std::string_view(held).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [&](const TcpStoreServerStats& s) {
    return s.buffered_bytes >= held.size();
  })) << "the holder's frame never got its room";
  cut.Send(std::string_view(waits).substr(0, 1000));
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.frames_waiting_for_room == 1;
  })) << server->stats().frames_waiting_for_room << " frames waiting";
  cut.ShutdownWrite();
  std::optional<std::string> reply = cut.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value()) << "the parked call got no answer";
  uint32_t id = 0;
  const auto [code, message] = RawConnection::ParseReply(*reply, &id);
  EXPECT_EQ(id, 1u);
  EXPECT_EQ(code, StatusCode::kUnavailable);
  EXPECT_THAT(message, HasSubstr("the store stopped waiting: the client ended its stream"));
  EXPECT_TRUE(cut.ClosedWithin(5s));
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.parked_waits == 0 && s.frames_waiting_for_room == 0;
  }));
}

// A wait held back for room until its deadline is told that the key was
// set and the store had no room, not that the key was never set (which
// sends the caller looking for a rank that did write it).
TEST(TcpStoreTest, AWaitHeldBackForRoomUntilItsDeadlineSaysTheKeyWasSet) {
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 8 << 20;
  options.max_connection_output_bytes = 256 << 20;
  auto server = StartServer(options);
  constexpr int kWaits = 24;
  RawConnection waiter(server->port());
  waiter.Handshake();
  SendGets(waiter, kWaits, 1000, "large");
  ASSERT_TRUE(StatsReach(*server, [&](const TcpStoreServerStats& s) {
    return s.parked_waits == kWaits;
  }));
  auto setter = ConnectClient(*server);
  ASSERT_TRUE(setter->Set("large", std::string(4 << 20, 'v'), DeadlineIn(10s)).ok());
  // Nobody reads until every wait is answered: with the value, or, held
  // back for room, at its deadline (a held-back wait stays parked until
  // then). The test slept a fixed 1.5 s for it.
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.parked_waits == 0; }))
      << server->stats().parked_waits << " waits still parked";
  int values = 0, held_back = 0, not_set = 0;
  for (int i = 0; i < kWaits; ++i) {
    std::optional<std::string> reply = waiter.ReadFrame(20s);
    ASSERT_TRUE(reply.has_value()) << "reply " << i;
    if (reply->size() > (4 << 20)) ++values;
    if (reply->find("waited for room") != std::string::npos) ++held_back;
    if (reply->find("not set before") != std::string::npos) ++not_set;
  }
  EXPECT_GT(values, 0);
  EXPECT_GT(held_back, 0);
  EXPECT_EQ(not_set, 0);
  EXPECT_EQ(values + held_back, kWaits);
}

// Many waits parked on one large value, by a client that does not read
// yet: setting it must not copy a reply per waiter into memory at once. The
// replies count against the total bound and the rest are answered as the
// reader drains them; every wait gets the value.
TEST(TcpStoreTest, ManyWaitersOnALargeValueStayWithinTheBufferBound) {
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 8 << 20;
  options.max_connection_output_bytes = 256 << 20;  // not the bound under test
  auto server = StartServer(options);
  constexpr int kWaits = 24;
  const std::string value(4 << 20, 'v');
  RawConnection waiter(server->port());
  waiter.Handshake();
  SendGets(waiter, kWaits, 30000, "large");
  ASSERT_TRUE(StatsReach(*server, [&](const TcpStoreServerStats& s) {
    return s.parked_waits == kWaits;
  })) << "only " << server->stats().parked_waits << " of " << kWaits << " waits parked";
  auto setter = ConnectClient(*server);
  ASSERT_TRUE(setter->Set("large", value, DeadlineIn(10s)).ok());
  // Time for the server to copy replies, were it to copy one per waiter;
  // the bound below holds at every moment when it is right.
  std::this_thread::sleep_for(300ms);
  // Nobody has read: what is held stays near the bound (one reply may
  // exceed it), not 24 replies of 4 MiB less what the sockets took.
  EXPECT_LE(server->stats().buffered_bytes, uint64_t{(8 << 20) + (4 << 20) + 4096});
  for (int i = 0; i < kWaits; ++i) {
    std::optional<std::string> reply = waiter.ReadFrame(20s);
    ASSERT_TRUE(reply.has_value()) << "reply " << i;
    EXPECT_GT(reply->size(), value.size());
  }
}

TEST(TcpStoreTest, ConnectionFloodDoesNotStopTheJobFromForming) {
  TcpStoreServerOptions options;
  options.max_unauthenticated = 16;
  options.handshake_timeout = 5s;
  auto server = StartServer(options);
  std::atomic<bool> stop{false};
  std::atomic<int> opened{0};
  // Strangers keep opening connections that never say anything.
  std::thread flood([&] {
    std::vector<UniqueFd> held;
    while (!stop.load()) {
      UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(server->port()));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      held.push_back(std::move(fd));
      ++opened;
      if (held.size() > 300) held.erase(held.begin(), held.begin() + 100);
    }
  });
  while (opened.load() < 200) std::this_thread::sleep_for(1ms);
  // The ranks start once the flood presses on the server's limit (it has
  // evicted a stranger), not merely once the strangers have connected: on
  // a busy machine the server may not have accepted them yet.
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.evicted > 0; }))
      << "the flood never made the server evict a connection";

  constexpr int kRanks = 4;
  std::vector<std::thread> ranks;
  std::vector<Status> results(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      results[r] = [&]() -> Status {
        const Deadline deadline = DeadlineIn(20s);
        DDP_ASSIGN_OR_RETURN(auto client,
                             TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, deadline));
        DDP_RETURN_IF_ERROR(client->Set("rank/" + std::to_string(r), "up", deadline));
        std::vector<std::string> keys;
        for (int peer = 0; peer < kRanks; ++peer) keys.push_back("rank/" + std::to_string(peer));
        return client->Wait(keys, deadline);
      }();
    });
  }
  for (auto& th : ranks) th.join();
  stop = true;
  flood.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r];
  EXPECT_GT(server->stats().evicted, 0u);
  EXPECT_EQ(server->stats().authenticated, static_cast<uint64_t>(kRanks));
}

// A process started with a low soft descriptor limit (1024 is common; 64
// here) still serves many ranks: the server raises the soft limit within
// the hard one. Before, accept failed with EMFILE and clients waited out
// their deadline at the handshake.
TEST(TcpStoreTest, ServesMoreConnectionsThanALowSoftDescriptorLimit) {
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  ASSERT_TRUE(before.rlim_max == RLIM_INFINITY || before.rlim_max >= 2048) << before.rlim_max;
  rlimit low = before;
  low.rlim_cur = 64;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  TcpStoreServerOptions options;
  options.max_connections = 300;
  auto server = StartServer(options);
  rlimit raised{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &raised), 0);
  EXPECT_GE(raised.rlim_cur, rlim_t{300 + 1024});
  std::vector<std::unique_ptr<TcpStoreClient>> clients;
  Status failed;
  for (int i = 0; i < 100 && failed.ok(); ++i) {
    auto client = TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, DeadlineIn(5s));
    if (!client.ok()) {
      failed = Status(client.status().code(), "client " + std::to_string(i) + ": " + client.status().message());
      break;
    }
    failed = (*client)->Set("k" + std::to_string(i), "v", DeadlineIn(5s));
    clients.push_back(std::move(*client));
  }
  EXPECT_TRUE(failed.ok()) << failed;
  EXPECT_EQ(clients.size(), 100u);
  clients.clear();
  server.reset();
  setrlimit(RLIMIT_NOFILE, &before);
}

// In a forked child: makes stderr a pipe that nobody reads and that is
// already full, so a write to stderr blocks. 0 when done, else the child's
// exit status naming the step that failed (2 pipe, 3 reopen, 4 fill/dup2).
int StderrToAFullPipe() {
  int log_pipe[2];
  if (pipe(log_pipe) != 0) return 2;
  // Filled through a non-blocking description of its own (reopened
  // through /proc), so that stderr's, the other, still blocks when full.
  const std::string filler_path = "/proc/self/fd/" + std::to_string(log_pipe[1]);
  const int filler = open(filler_path.c_str(), O_WRONLY | O_NONBLOCK);
  if (filler < 0) return 3;
  const std::string chunk(4096, 'x');
  while (write(filler, chunk.data(), chunk.size()) > 0) {
  }
  if (errno != EAGAIN || dup2(log_pipe[1], STDERR_FILENO) < 0) return 4;
  return 0;
}

// The default log goes to stderr, which may be a pipe nobody reads (a
// launcher that stopped reading, a full terminal buffer): a server whose
// own thread wrote its log lines there stopped at the first one, and every
// rank's call then waited out its deadline. In a child whose stderr is
// such a full pipe, a refused client is logged and the job's client is
// still served.
TEST(TcpStoreTest, AStderrNobodyReadsDoesNotHoldTheServer) {
  const pid_t parent = getpid();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    alarm(30);  // bounds the child whatever happens
    if (const int failed = StderrToAFullPipe(); failed != 0) _exit(failed);
    TcpStoreServerOptions options;
    options.job_token = kToken;
    auto server = TcpStoreServer::Start(options);
    if (!server.ok()) _exit(5);
    const int port = (*server)->port();
    auto stranger = TcpStoreClient::Connect("127.0.0.1", port, "wrong token", DeadlineIn(3s));
    if (stranger.ok() || stranger.status().code() != StatusCode::kPermissionDenied) _exit(6);
    auto rank = TcpStoreClient::Connect("127.0.0.1", port, kToken, DeadlineIn(3s));
    if (!rank.ok() || !(*rank)->Set("k", "v", DeadlineIn(3s)).ok()) _exit(7);
    _exit(0);  // the log's thread is still blocked on stderr: no teardown
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "6: the stranger was not refused in time; 7: the rank was not served";
}

// A thread of this process blocked in write(2) on stderr: the default
// log's writer, stuck on a full pipe.
bool AThreadWritesToStderr() {
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return false;
  bool found = false;
  while (dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    const std::string path = std::string("/proc/self/task/") + entry->d_name + "/syscall";
    const int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) continue;
    char text[64] = {};
    const ssize_t n = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (n > 0 && std::string_view(text, n).starts_with("1 0x2 ")) found = true;
  }
  closedir(tasks);
  return found;
}

// A child forked while the default log had lines queued (its writer stuck
// on a full stderr) prints only its own lines, and a line it logs just
// before exit() is written: before, the child printed the parent's queue
// again, and the line could be lost with the detached writer at exit.
TEST(TcpStoreTest, AForkedChildLogsOnlyItsOwnLinesAndFlushesThemAtExit) {
  const pid_t parent = getpid();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    alarm(30);  // bounds the child whatever happens
    if (const int failed = StderrToAFullPipe(); failed != 0) _exit(failed);
    {
      TcpStoreServerOptions options;
      options.job_token = kToken;
      auto server = TcpStoreServer::Start(options);
      if (!server.ok()) _exit(5);
      // The first refusal takes the writer into the blocked write; the
      // second stays queued behind it.
      (void)TcpStoreClient::Connect("127.0.0.1", (*server)->port(), "wrong token", DeadlineIn(3s));
      const Deadline deadline = DeadlineIn(10s);
      while (!AThreadWritesToStderr()) {
        if (Clock::now() > deadline) _exit(6);
        std::this_thread::yield();
      }
      (void)TcpStoreClient::Connect("127.0.0.1", (*server)->port(), "wrong token", DeadlineIn(3s));
    }
    int child_log[2];
    if (pipe(child_log) != 0) _exit(7);
    const pid_t grandchild = fork();
    if (grandchild < 0) _exit(8);
    if (grandchild == 0) {
      if (dup2(child_log[1], STDERR_FILENO) < 0) _exit(1);
      close(child_log[0]);
      close(child_log[1]);
      TcpStoreServerOptions options;
      options.job_token = kToken;
      auto server = TcpStoreServer::Start(options);
      if (!server.ok()) _exit(2);
      // Not a store handshake: refused and logged, then the server closes.
      UniqueFd fd(socket(AF_INET, SOCK_STREAM, 0));
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>((*server)->port()));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) _exit(3);
      wire::Writer w;
      w.Bytes("GET / HTTP/1.0");
      const std::string junk = w.Frame();
      if (write(fd.get(), junk.data(), junk.size()) != static_cast<ssize_t>(junk.size())) _exit(4);
      char byte;
      while (read(fd.get(), &byte, 1) > 0) {
      }
      server->reset();
      std::exit(0);  // not _exit: the log's lines are flushed at exit
    }
    close(child_log[1]);
    std::string text;
    char buf[4096];
    for (ssize_t n; (n = read(child_log[0], buf, sizeof(buf))) != 0;) {
      if (n < 0 && errno != EINTR) _exit(9);
      if (n > 0) text.append(buf, n);
    }
    int status = 0;
    if (waitpid(grandchild, &status, 0) != grandchild || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      _exit(10);
    }
    if (text.find("wrong job token") != std::string::npos) _exit(11);
    if (text.find("not a store handshake") == std::string::npos) _exit(12);
    _exit(0);  // the log's thread is still blocked on stderr: no teardown
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "11: the forked child printed the parent's queued lines; 12: its own line was lost at exit";
}

// A server whose hard descriptor limit is too low for max_connections
// (here 160, in a process of its own) tells a newcomer past what fits that
// the store is full (the newcomer retries until its deadline, as a place
// may come free); before, accept failed with EMFILE, the server paused
// accepting, and the newcomer's deadline passed at the handshake without a
// word of why.
TEST(TcpStoreTest, AHardDescriptorLimitBelowTheConnectionLimitIsToldNotTimedOut) {
  int port_pipe[2], hold_pipe[2];
  ASSERT_EQ(pipe(port_pipe), 0);
  ASSERT_EQ(pipe(hold_pipe), 0);
  const pid_t parent = getpid();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    close(port_pipe[0]);
    close(hold_pipe[1]);
    rlimit low{160, 160};
    if (setrlimit(RLIMIT_NOFILE, &low) != 0) _exit(2);
    TcpStoreServerOptions options;
    options.bind_address = "127.0.0.1";
    options.job_token = kToken;
    auto server = TcpStoreServer::Start(options);
    if (!server.ok()) _exit(3);
    const int port = (*server)->port();
    if (write(port_pipe[1], &port, sizeof(port)) != sizeof(port)) _exit(4);
    char byte;
    while (read(hold_pipe[0], &byte, 1) < 0 && errno == EINTR) {
    }
    _exit(0);
  }
  close(port_pipe[1]);
  close(hold_pipe[0]);
  int port = 0;
  ASSERT_EQ(read(port_pipe[0], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  close(port_pipe[0]);
  std::vector<std::unique_ptr<TcpStoreClient>> clients;
  Status failed;
  for (int i = 0; i < 200 && failed.ok(); ++i) {
    auto client = TcpStoreClient::Connect("127.0.0.1", port, kToken, DeadlineIn(2s));
    if (!client.ok()) {
      failed = client.status();
      break;
    }
    clients.push_back(std::move(*client));
  }
  EXPECT_GE(clients.size(), 100u);
  EXPECT_FALSE(failed.ok()) << "200 connections under a limit of 160 descriptors";
  EXPECT_NE(failed.message().find("its limit"), std::string::npos) << failed;
  clients.clear();
  close(hold_pipe[1]);
  int status = 0;
  const Deadline reap_by = DeadlineIn(10s);
  while (waitpid(child, &status, WNOHANG) == 0) {
    if (Clock::now() >= reap_by) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
}

// A connection refused because the store is full, whose peer keeps
// streaming bytes at it: the server drains no more than a hello's worth
// and goes on serving. It drained until the socket ran dry, which a peer
// streaming over loopback kept from happening, and the store's only thread
// stayed there: the job's own requests went unanswered until their
// deadlines.
TEST(TcpStoreTest, APeerStreamingIntoARefusedConnectionDoesNotHoldTheServer) {
  std::atomic<size_t> streamed{0};
  std::atomic<bool> refused{false};
  TcpStoreServerOptions options;
  options.max_connections = 1;
  // Runs on the server's thread just before it drains the refused
  // connection: it lets the streamer get well ahead first, so that the
  // drain meets a socket that is never empty (bounded, should it not).
  options.log = [&](const std::string& line) {
    if (line.find("refused connection") == std::string::npos) return;
    const Deadline until = DeadlineIn(5s);
    while (streamed.load() < (256u << 10) && Clock::now() < until) std::this_thread::sleep_for(1ms);
    refused.store(true);
  };
  auto server = StartServer(options);
  auto holder = ConnectClient(*server);  // the only place
  std::atomic<bool> stop{false};
  std::thread streamer([&] {
    StatusOr<UniqueFd> fd = ConnectTcp("127.0.0.1", server->port(), DeadlineIn(5s));
    if (!fd.ok()) return;
    const std::string chunk(64 << 10, 'x');
    const Deadline until = DeadlineIn(30s);
    while (!stop.load() && Clock::now() < until) {
      size_t sent = 0;
      const Status s = SendAll(fd->get(), chunk, DeadlineIn(50ms), &sent);
      streamed.fetch_add(sent);
      if (!s.ok() && s.code() != StatusCode::kTimedOut) return;  // refused and closed: done
    }
  });
  const Deadline refused_by = DeadlineIn(10s);
  while (!refused.load() && Clock::now() < refused_by) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(refused.load()) << "the streaming connection was never refused";
  const Status set = holder->Set("k", "v", DeadlineIn(3s));
  const size_t streamed_by_then = streamed.load();
  stop.store(true);
  streamer.join();
  EXPECT_TRUE(set.ok()) << set << " (" << streamed_by_then << " bytes streamed by then)";
}

// Waits until the server holds `n` parked Get/Wait calls; false if it did
// not within `timeout`.
bool ParkedWithin(const TcpStoreServer& server, uint64_t n, std::chrono::milliseconds timeout) {
  const Deadline deadline = DeadlineIn(timeout);
  while (server.stats().parked_waits != n) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// One run of the scenario below on a fresh server: the time from the close
// that frees the room to the held-back Get's return; nullopt (with the
// failure recorded) when a step failed.
std::optional<std::chrono::nanoseconds> HeldBackWakeDelayAfterAClose() {
  constexpr size_t kValueBytes = 32768;
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 65536;
  auto server = StartServer(options);
  auto waiter = ConnectClient(*server);
  auto setter = ConnectClient(*server);
  StatusOr<std::string> got = InternalError("not run");
  Deadline returned_at{};
  std::thread thread([&] {
    got = waiter->Get("big", DeadlineIn(30s));
    returned_at = Clock::now();
  });
  struct Joiner {  // on an early return, the Get ends at its deadline
    std::thread& t;
    ~Joiner() {
      if (t.joinable()) t.join();
    }
  } joiner{thread};
  if (!ParkedWithin(*server, 1, 10s)) {
    ADD_FAILURE() << "the Get never reached the server";
    return std::nullopt;
  }
  // A frame begun and left: room for all of it is held, so that the Set
  // below fits (its frame is 20 bytes over its value) and the Get's reply
  // (counted as 64 bytes over the value) does not.
  RawConnection holder(server->port());
  holder.Handshake();
  constexpr uint32_t kHeldLength = 32726;  // 32730 bytes with the header
  wire::Writer w;
  w.U32(kHeldLength);
  w.Bytes("xy");
  holder.Send(w.body());
  if (!StatsReach(*server, [](const TcpStoreServerStats& st) { return st.receiving_bytes == 32730; }) ||
      !setter->Set("big", std::string(kValueBytes, 'v'), DeadlineIn(10s)).ok() ||
      server->stats().parked_waits != 1) {
    ADD_FAILURE() << "the Get's reply was not held back for room";
    holder.Close();
    return std::nullopt;
  }
  const Deadline closed_at = Clock::now();
  holder.Close();
  thread.join();
  if (!got.ok() || got->size() != kValueBytes) {
    ADD_FAILURE() << "the Get returned " << (got.ok() ? std::to_string(got->size()) + " bytes" : got.status().ToString());
    return std::nullopt;
  }
  return returned_at - closed_at;
}

// A wake held back for room is answered as soon as the room is freed by a
// connection that closed: that close is handled at the end of the server's
// round, after the held-back wakes were retried, and the wake then waited
// for the next event. Nothing else happens here, so that next event was
// the loop's longest poll, 1 s after the close, every time. The bound is
// a little under that, and one run of three within it suffices, so that a
// busy machine descheduling the test does not fail it.
TEST(TcpStoreTest, AWakeHeldBackForRoomIsAnsweredWhenAClosingConnectionFreesIt) {
  std::string delays;
  for (int run = 0; run < 3; ++run) {
    const std::optional<std::chrono::nanoseconds> delay = HeldBackWakeDelayAfterAClose();
    if (!delay) return;
    if (*delay < 900ms) return;
    delays += " " + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(*delay).count()) + " ms";
  }
  ADD_FAILURE() << "the held-back Get returned only after the server's idle poll, in each of three runs:" << delays;
}

TEST(TcpStoreTest, StoppingTheServerFailsClientsPromptly) {
  auto server = StartServer();
  auto parked = ConnectClient(*server);
  auto idle = ConnectClient(*server);
  StatusOr<std::string> got = InternalError("not run");
  Deadline returned_at{};
  std::thread thread([&] {
    got = parked->Get("never", DeadlineIn(30s));
    returned_at = Clock::now();
  });
  EXPECT_TRUE(ParkedWithin(*server, 1, 10s)) << "the Get never reached the server";
  const Deadline stopped_at = Clock::now();
  server->Stop();
  thread.join();
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(got.status().message(), HasSubstr("shutting down"));
  EXPECT_LT(returned_at - stopped_at, 2s);

  const Deadline start = Clock::now();
  Status s = idle->Set("k", "v", DeadlineIn(30s));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("lost the connection to the store at 127.0.0.1:"));
  EXPECT_THAT(s.message(), HasSubstr("(during the set of key 'k')"));
  EXPECT_THAT(got.status().message(), HasSubstr("get of key 'never'"));
  // Later calls fail at once with the same reason.
  EXPECT_EQ(idle->TryGet("k", DeadlineIn(30s)).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(parked->Add("k", 1, DeadlineIn(30s)).status().code(), StatusCode::kUnavailable);
  EXPECT_LT(Clock::now() - start, 2s);

  // Nobody listens any more: connecting gives up at its deadline.
  const int port = server->port();
  server.reset();
  StatusOr<std::unique_ptr<TcpStoreClient>> late =
      TcpStoreClient::Connect("127.0.0.1", port, kToken, DeadlineIn(300ms));
  EXPECT_EQ(late.status().code(), StatusCode::kUnavailable);
}

// Stopped with a reason (rank 0's communicator closing the store it served
// after a clean shutdown), the server tells it to a parked call and to a
// client with no call under way, whose next call reads it instead of a bare
// "lost the connection"; later calls keep it.
TEST(TcpStoreTest, StoppingWithAReasonTellsEveryClientWhy) {
  auto server = StartServer();
  auto parked = ConnectClient(*server);
  auto idle = ConnectClient(*server);
  ASSERT_TRUE(idle->Set("k", "v", DeadlineIn(10s)).ok());
  StatusOr<std::string> got = InternalError("not run");
  std::thread thread([&] { got = parked->Get("never", DeadlineIn(30s)); });
  ASSERT_TRUE(ParkedWithin(*server, 1, 10s)) << "the Get never reached the server";
  const std::string why = "its owner closed it after a clean shutdown; rank 2 of 'job/' had not left";
  server->Stop(why);
  server->Stop("a second reason");
  thread.join();
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(got.status().message(), HasSubstr("shutting down: " + why));

  const Deadline start = Clock::now();
  StatusOr<std::optional<std::string>> read = idle->TryGet("k", DeadlineIn(30s));
  EXPECT_EQ(read.status().code(), StatusCode::kUnavailable) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("shutting down: " + why));
  EXPECT_THAT(read.status().message(), HasSubstr("(during the try_get of key 'k')"));
  Status later = idle->Set("k", "w", DeadlineIn(30s));
  EXPECT_EQ(later.code(), StatusCode::kUnavailable);
  EXPECT_THAT(later.message(), HasSubstr(why));
  EXPECT_THAT(later.message(), Not(HasSubstr("a second reason")));
  EXPECT_LT(Clock::now() - start, 2s);
}

// A client learns that the store was stopped after a clean end of the job
// (its reason ends as rank 0's communicator's does then) from its parked call's answer or
// from its next call, and only then: not from a stop after an abort or
// without a reason, nor from closing its own connection. Its calls still
// fail UNAVAILABLE with the reason.
TEST(TcpStoreTest, AClientKnowsAStopAfterACleanShutdownFromAnyOther) {
  const std::string clean = "rank 0 of communicator 'job', which served the rendezvous store, was destroyed " +
                            std::string(kCleanShutdownWords) + " and stopped the store";
  {
    auto server = StartServer();
    auto parked = ConnectClient(*server);
    auto idle = ConnectClient(*server);
    auto closed = ConnectClient(*server);
    EXPECT_FALSE(parked->StoppedCleanly());
    StatusOr<std::string> got = InternalError("not run");
    std::thread thread([&] { got = parked->Get("never", DeadlineIn(30s)); });
    ASSERT_TRUE(ParkedWithin(*server, 1, 10s)) << "the Get never reached the server";
    closed->Close();
    server->Stop(clean);
    thread.join();
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status();
    EXPECT_TRUE(parked->StoppedCleanly());
    EXPECT_FALSE(idle->StoppedCleanly());  // not read yet
    StatusOr<std::optional<std::string>> read = idle->TryGet("k", DeadlineIn(30s));
    EXPECT_EQ(read.status().code(), StatusCode::kUnavailable) << read.status();
    EXPECT_THAT(read.status().message(), HasSubstr(clean));
    EXPECT_TRUE(idle->StoppedCleanly());
    EXPECT_EQ(closed->TryGet("k", DeadlineIn(30s)).status().code(), StatusCode::kUnavailable);
    EXPECT_FALSE(closed->StoppedCleanly());
  }
  for (const std::string& why : {std::string("rank 0 of communicator 'job' was destroyed after the job was aborted"),
                                std::string()}) {
    auto server = StartServer();
    auto parked = ConnectClient(*server);
    auto idle = ConnectClient(*server);
    StatusOr<std::string> got = InternalError("not run");
    std::thread thread([&] { got = parked->Get("never", DeadlineIn(30s)); });
    ASSERT_TRUE(ParkedWithin(*server, 1, 10s)) << "the Get never reached the server";
    if (why.empty()) {
      server->Stop();
    } else {
      server->Stop(why);
    }
    thread.join();
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status();
    EXPECT_EQ(idle->TryGet("k", DeadlineIn(30s)).status().code(), StatusCode::kUnavailable);
    EXPECT_FALSE(parked->StoppedCleanly()) << "'" << why << "'";
    EXPECT_FALSE(idle->StoppedCleanly()) << "'" << why << "'";
  }
}

// Whether the job ended cleanly is told by the notice's start, which only
// the server writes, not by words anywhere in the free-text reason: a
// communicator named "after a clean shutdown", aborted, or named in the
// list of ranks that had not left, is no clean stop; rank 0's clean reason
// (its end, after every name) is, with or without that list, and so is any
// reason its owner says is one.
TEST(TcpStoreTest, AStopIsCleanByTheNoticesStartNotByWordsInsideTheReason) {
  const std::string head = "rank 0 of communicator 'job', which served the rendezvous store, was destroyed ";
  const std::string clean = head + std::string(kCleanShutdownWords) + " and stopped the store";
  const std::string named = "rank 0 of communicator 'retry " + std::string(kCleanShutdownWords) +
                            "', which served the rendezvous store, was destroyed after the job was aborted and "
                            "stopped the store";
  const std::string listed = head + "after the job was aborted and stopped the store after waiting 3000 ms for "
                                    "every rank to leave; 1 of the 2 ranks of communicator 'x " +
                             std::string(kCleanShutdownWords) + " and stopped the store' had not left";
  const std::string waited = clean + " after waiting 2000 ms for every rank to leave; rank 1 of communicator "
                                     "'job' had not left (destroy every communicator on every rank before rank 0's)";
  struct Case {
    std::string why;
    std::optional<bool> said;  // what the owner says; unset: Stop(why)
    bool clean;
  };
  for (const Case& c : {Case{named, std::nullopt, false}, Case{listed, std::nullopt, false},
                        Case{clean, std::nullopt, true}, Case{waited, std::nullopt, true},
                        Case{clean, false, false}, Case{"done", true, true}, Case{"", true, true}}) {
    if (!c.said.has_value()) {
      EXPECT_EQ(TcpStoreServer::SaysCleanShutdown(c.why), c.clean) << c.why;
    }
    auto server = StartServer();
    auto client = ConnectClient(*server);
    if (c.said.has_value()) {
      server->Stop(c.why, *c.said);
    } else {
      server->Stop(c.why);
    }
    StatusOr<std::optional<std::string>> read = client->TryGet("k", DeadlineIn(30s));
    EXPECT_EQ(read.status().code(), StatusCode::kUnavailable) << read.status();
    EXPECT_THAT(read.status().message(), HasSubstr(c.why));
    EXPECT_EQ(client->StoppedCleanly(), c.clean) << read.status();
  }
}

// A client parked in a Wait when the store restarts on the same port fails
// UNAVAILABLE naming the store's host:port, and stays failed: there is no
// reconnection (README), although a new client reaches the new server.
TEST(TcpStoreTest, AWaitParkedAcrossAStoreRestartFailsNamingHostPortAndDoesNotReconnect) {
  auto server = StartServer();
  const int port = server->port();
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  auto parked = ConnectClient(*server);
  Status waited = InternalError("not run");
  std::thread thread([&] {
    const std::vector<std::string> keys = {"never"};
    waited = parked->Wait(keys, DeadlineIn(30s));
  });
  EXPECT_TRUE(ParkedWithin(*server, 1, 10s)) << "the Wait never reached the server";
  server->Stop();
  server.reset();
  thread.join();
  auto restarted = StartServer({.port = port});
  ASSERT_NE(restarted, nullptr);
  EXPECT_EQ(waited.code(), StatusCode::kUnavailable) << waited;
  EXPECT_THAT(waited.message(), HasSubstr("the store at " + endpoint)) << waited;

  Status later = parked->Set("k", "v", DeadlineIn(5s));
  EXPECT_EQ(later.code(), StatusCode::kUnavailable) << later;
  EXPECT_THAT(later.message(), HasSubstr(endpoint)) << later;
  auto fresh = ConnectClient(*restarted);
  EXPECT_TRUE(fresh->Set("k", "v", DeadlineIn(5s)).ok());
}

// A child forked without exec that sleeps holding copies of the process's
// descriptors (a data loader worker), killed when the test ends.
class SleepingChild {
 public:
  SleepingChild() {
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      sleep(60);
      _exit(0);
    }
    EXPECT_GT(pid_, 0);
  }
  ~SleepingChild() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }

 private:
  pid_t pid_ = -1;
};

// Copies of the server's sockets in a forked child keep nothing open: the
// server shuts its connections and listeners down (closing them left the
// child's copies alive, so a client waited out its whole deadline, and a
// new one completed the TCP handshake with the dead listener).
TEST(TcpStoreTest, StoppingTheServerFailsClientsPromptlyWhileAForkedChildHoldsItsSockets) {
  auto server = StartServer();
  const int port = server->port();
  auto idle = ConnectClient(*server);
  ASSERT_TRUE(idle->Set("k", "v", DeadlineIn(5s)).ok());
  SleepingChild child;
  server->Stop();
  const Deadline start = Clock::now();
  Status s = idle->Set("k", "v2", DeadlineIn(10s));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_LT(Clock::now() - start, 2s) << s;
  StatusOr<std::unique_ptr<TcpStoreClient>> late =
      TcpStoreClient::Connect("127.0.0.1", port, kToken, DeadlineIn(500ms));
  EXPECT_EQ(late.status().code(), StatusCode::kUnavailable) << late.status();
}

// A client destroyed in the process that connected ends its connection
// even while a forked child holds a copy of the socket (the server kept it
// and its parked calls); one destroyed in the child leaves the parent's
// connection alone.
TEST(TcpStoreTest, AClientsConnectionEndsWithItDespiteAForkedChildButNotWithTheChildsCopy) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  ASSERT_TRUE(client->Set("k", "v", DeadlineIn(5s)).ok());
  const pid_t destroyer = fork();
  if (destroyer == 0) {
    client.reset();
    _exit(0);
  }
  ASSERT_GT(destroyer, 0);
  int child_status = 0;
  ASSERT_EQ(waitpid(destroyer, &child_status, 0), destroyer);
  EXPECT_TRUE(client->Set("k", "v2", DeadlineIn(5s)).ok());
  EXPECT_EQ(*client->Get("k", DeadlineIn(5s)), "v2");

  SleepingChild holder;
  client.reset();
  EXPECT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) {
    return s.open_connections == 0;
  }, 3s)) << server->stats().open_connections << " connections still open";
}

TEST(TcpStoreTest, CloseWakesAParkedCall) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  StatusOr<std::string> got = InternalError("not run");
  std::thread thread([&] { got = client->Get("never", DeadlineIn(30s)); });
  std::this_thread::sleep_for(100ms);
  const Deadline closed_at = Clock::now();
  client->Close();
  thread.join();
  EXPECT_LT(Clock::now() - closed_at, 2s);
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(got.status().message(), HasSubstr("was closed by this process"));
  EXPECT_EQ(client->Set("k", "v", DeadlineIn(5s)).code(), StatusCode::kUnavailable);
  // The server drops the connection and its parked call.
  const Deadline deadline = DeadlineIn(5s);
  while (server->stats().open_connections > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(server->stats().open_connections, 0u);
}

// A server that completes the handshake and then records the requests it
// gets, answering none: what a client puts on the wire, as it arrives.
class SilentServer {
 public:
  struct Request {
    uint8_t op = 0;
    uint32_t id = 0;
    uint32_t timeout_ms = 0;  // for kGet
    Deadline received_at{};
  };

  SilentServer() {
    StatusOr<std::vector<UniqueFd>> fds = ListenTcp("127.0.0.1", 0, 4, DeadlineIn(5s));
    EXPECT_TRUE(fds.ok()) << fds.status();
    listen_fd_ = std::move(fds->front());
    StatusOr<int> port = LocalPort(listen_fd_.get());
    EXPECT_TRUE(port.ok()) << port.status();
    port_ = port.ok() ? *port : 0;
    thread_ = std::thread([this] { Serve(); });
  }
  ~SilentServer() {
    stop_ = true;
    thread_.join();
  }
  int port() const { return port_; }
  // True once `n` requests arrived, false if they did not within `timeout`.
  bool ReceivedWithin(size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return requests_.size() >= n; });
  }
  std::vector<Request> requests() {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }

 private:
  void Serve() {
    UniqueFd conn;
    while (!stop_.load() && !conn.valid()) {
      pollfd pfd{listen_fd_.get(), POLLIN, 0};
      if (poll(&pfd, 1, 20) == 1) {
        conn = UniqueFd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      }
    }
    std::string buffer;
    bool greeted = false;
    while (!stop_.load()) {
      std::optional<uint32_t> length = wire::PeekFrameLength(buffer);
      if (length && buffer.size() >= 4 + *length) {
        const std::string body = buffer.substr(4, *length);
        buffer.erase(0, 4 + *length);
        const Deadline now = Clock::now();
        if (!greeted) {
          wire::Writer w;
          w.Bytes(std::string_view(wire::kMagic, 4));
          w.U16(wire::kVersion);
          w.U8(0);
          w.String("");
          EXPECT_TRUE(SendAll(conn.get(), w.Frame(), DeadlineIn(5s), nullptr).ok());
          greeted = true;
          continue;
        }
        wire::Reader r(body);
        Request request;
        request.received_at = now;
        EXPECT_TRUE(r.U8(request.op) && r.U32(request.id));
        if (request.op == static_cast<uint8_t>(wire::Op::kGet)) {
          EXPECT_TRUE(r.U32(request.timeout_ms));
        }
        std::lock_guard<std::mutex> lock(mu_);
        requests_.push_back(request);
        cv_.notify_all();
        continue;
      }
      Status s = RecvSome(conn.get(), buffer, 1 << 20, DeadlineIn(20ms));
      if (!s.ok() && s.code() != StatusCode::kTimedOut) return;
    }
  }

  UniqueFd listen_fd_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Request> requests_;
};

TEST(TcpStoreTest, QueuedGetTellsTheServerTheTimeLeftWhenItIsSent) {
  // The server records each Get's timeout field and never answers. A Get
  // holds the connection until its deadline; a second Get, due 1 s after
  // the first, queues behind it and must tell the server the time left
  // when it is sent (at most 1 s), not the time left when it was called
  // (about 3 s here): the server would hold that wait, and with it one of
  // the connection's parked waits, long after the client gave up.
  SilentServer server;
  auto client = ConnectClient(server.port());
  constexpr auto kGap = 1000ms;
  const Deadline first_due = DeadlineIn(2000ms);
  std::thread first([&] {
    EXPECT_EQ(client->Get("never-1", first_due).status().code(), StatusCode::kTimedOut);
  });
  // The first Get is on the wire, so it holds the connection.
  ASSERT_TRUE(server.ReceivedWithin(1, 10s));
  const Deadline called_at = Clock::now();
  const Deadline second_due = first_due + kGap;
  StatusOr<std::string> queued = client->Get("never-2", second_due);
  first.join();
  EXPECT_EQ(queued.status().code(), StatusCode::kTimedOut) << queued.status();
  ASSERT_TRUE(server.ReceivedWithin(2, 10s));
  const std::vector<SilentServer::Request> requests = server.requests();
  const SilentServer::Request& sent = requests[1];
  ASSERT_EQ(sent.op, static_cast<uint8_t>(wire::Op::kGet));
  const auto told = std::chrono::milliseconds(sent.timeout_ms);
  // Sent once the first Get gave up at its deadline: at most the 1 s
  // between the two deadlines was left (give or take rounding to ms).
  EXPECT_LE(told, kGap + 5ms)
      << "told the server " << told.count() << " ms; "
      << std::chrono::duration_cast<std::chrono::milliseconds>(second_due - called_at).count()
      << " ms were left when the Get was called";
  // ...and no less than what was left when it arrived.
  EXPECT_GE(told + 5ms, second_due - sent.received_at);
}

// A call queued behind another thread's parked Get on the same client
// gives up at its own deadline, saying why: it waited for the parked
// call's deadline (minutes for an abort watcher) instead.
TEST(TcpStoreTest, ACallQueuedBehindAParkedGetEndsAtItsOwnDeadline) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  auto observer = ConnectClient(*server);
  StatusOr<std::string> parked_got = InternalError("not run");
  std::thread parked([&] { parked_got = client->Get("gate", DeadlineIn(8s)); });
  ASSERT_TRUE(ParkedWithin(*server, 1, 10s)) << "the Get did not park";
  const Deadline start = Clock::now();
  Status queued = client->Set("queued", "1", DeadlineIn(300ms));
  const auto took = Clock::now() - start;
  ASSERT_TRUE(observer->Set("gate", "open", DeadlineIn(5s)).ok());
  parked.join();
  EXPECT_EQ(queued.code(), StatusCode::kTimedOut) << queued;
  EXPECT_THAT(queued.message(), HasSubstr("waiting for another thread's call on this connection")) << queued;
  EXPECT_LT(took, 2s) << "the queued Set waited for the parked Get";
  ASSERT_TRUE(parked_got.ok()) << parked_got.status();
  EXPECT_FALSE(observer->TryGet("queued", DeadlineIn(5s))->has_value());
  EXPECT_TRUE(client->Set("k", "v", DeadlineIn(5s)).ok());
}

TEST(TcpStoreTest, CallWhoseDeadlinePassedWhileQueuedIsNotSent) {
  auto server = StartServer();
  auto client = ConnectClient(*server);
  auto observer = ConnectClient(*server);
  // A Get parked on a key that the observer sets only later holds the
  // client's connection.
  StatusOr<std::string> parked_got = InternalError("not run");
  std::thread parked([&] { parked_got = client->Get("gate", DeadlineIn(30s)); });
  ASSERT_TRUE(ParkedWithin(*server, 1, 10s)) << "the Get did not park";
  // A Set due while the connection is still busy: it must time out without
  // taking effect, not time out after setting the key.
  const Deadline set_due = DeadlineIn(300ms);
  Status set_status = InternalError("not run");
  std::thread setter([&] { set_status = client->Set("late-set", "1", set_due); });
  std::this_thread::sleep_until(set_due + 50ms);
  ASSERT_TRUE(observer->Set("gate", "open", DeadlineIn(5s)).ok());
  parked.join();
  setter.join();
  ASSERT_TRUE(parked_got.ok()) << parked_got.status();
  EXPECT_EQ(*parked_got, "open");
  EXPECT_EQ(set_status.code(), StatusCode::kTimedOut) << set_status;
  StatusOr<std::optional<std::string>> got = observer->TryGet("late-set", DeadlineIn(5s));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(got->has_value());
  // The connection still serves.
  EXPECT_TRUE(client->Set("k", "v", DeadlineIn(5s)).ok());
}

TEST(TcpStoreTest, ClientConnectsBeforeTheServerStarts) {
  // Reserve a port, free it, and start the server there a little later.
  int port = 0;
  {
    auto probe = StartServer();
    port = probe->port();
  }
  std::unique_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(200ms);
    TcpStoreServerOptions options;
    options.port = port;
    server = StartServer(options);
  });
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("127.0.0.1", port, kToken, DeadlineIn(10s));
  starter.join();
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->Set("k", "v", DeadlineIn(5s)).ok());
}

// A name that does not resolve (yet: a Kubernetes headless service before
// its pod is up) is looked up again until the deadline, as a refused
// connection is tried again; the old client gave up at the first answer.
// Whether this machine's name service answers "no such name" at once or
// not at all, the connect ends at its deadline and names the host.
// (resolve_deadline_test checks the answer in the message, and a name that
// gets its address later, in a namespace where the test owns the names.)
TEST(TcpStoreTest, NameThatDoesNotResolveIsLookedUpUntilTheDeadline) {
  const Deadline start = Clock::now();
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("no-such-store.ddp-test.invalid", 29500, kToken, DeadlineIn(600ms));
  const auto took = Clock::now() - start;
  ASSERT_FALSE(client.ok());
  EXPECT_THAT(client.status().code(),
              ::testing::AnyOf(StatusCode::kUnavailable, StatusCode::kTimedOut))
      << client.status();
  EXPECT_THAT(client.status().message(),
              HasSubstr("cannot resolve no-such-store.ddp-test.invalid:29500: "));
  EXPECT_GE(took, 550ms) << client.status();
  EXPECT_LT(took, 5s) << client.status();
}

// An empty host is no name to wait for: the client refuses it at once,
// naming it, instead of looking "" up again until its deadline; a server
// with an empty bind_address is refused the same way.
TEST(TcpStoreTest, EmptyHostIsRefusedAtOnce) {
  const Deadline start = Clock::now();
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("", 29500, kToken, DeadlineIn(10s));
  const auto took = Clock::now() - start;
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kInvalidArgument) << client.status();
  EXPECT_THAT(client.status().message(), HasSubstr("the host is empty (\"\")"));
  EXPECT_LT(took, 2s) << client.status();

  TcpStoreServerOptions options;
  options.job_token = kToken;
  options.bind_address = "";
  StatusOr<std::unique_ptr<TcpStoreServer>> server = TcpStoreServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), StatusCode::kInvalidArgument) << server.status();
  EXPECT_THAT(server.status().message(), HasSubstr("the address to bind is empty"));
}

// A server on "localhost" listens at every address the name has: clients
// that try 127.0.0.1 and ::1 both find it.
TEST(TcpStoreTest, ServerOnANameListensAtEachOfItsAddresses) {
  TcpStoreServerOptions options;
  options.bind_address = "localhost";
  auto server = StartServer(options);
  auto v4 = ConnectClient(*server);  // 127.0.0.1
  EXPECT_TRUE(v4->Set("k", "v", DeadlineIn(5s)).ok());
  addrinfo hints{};
  hints.ai_family = AF_INET6;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const bool has_ipv6 = getaddrinfo("localhost", nullptr, &hints, &found) == 0;
  if (found != nullptr) freeaddrinfo(found);
  // Where localhost has no IPv6 address (/etc/hosts here), 127.0.0.1 above
  // is all there is; resolve_deadline_test serves a name with both.
  if (!has_ipv6) return;
  StatusOr<std::unique_ptr<TcpStoreClient>> v6 =
      TcpStoreClient::Connect("::1", server->port(), kToken, DeadlineIn(2s));
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(*(*v6)->Get("k", DeadlineIn(5s)), "v");
}

// A listening socket that answers one handshake with `answer(hello body)`
// and then holds the connection (reading nothing more) until destroyed.
class HandshakeServer {
 public:
  explicit HandshakeServer(std::function<std::string(const std::string&)> answer,
                           int receive_buffer = 0)
      : answer_(std::move(answer)) {
    StatusOr<std::vector<UniqueFd>> fds = ListenTcp("127.0.0.1", 0, 4, DeadlineIn(5s));
    EXPECT_TRUE(fds.ok()) << fds.status();
    listen_fd_ = std::move(fds->front());
    // A small receive buffer (inherited by the accepted socket) fills fast.
    if (receive_buffer > 0) {
      setsockopt(listen_fd_.get(), SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
    }
    port_ = *LocalPort(listen_fd_.get());
    thread_ = std::thread([this] { Serve(); });
  }
  ~HandshakeServer() { Join(); }
  int port() const { return port_; }
  // The accepted connection, once the handshake is answered.
  int Join() {
    if (thread_.joinable()) thread_.join();
    return conn_.get();
  }

 private:
  void Serve() {
    pollfd pfd{listen_fd_.get(), POLLIN, 0};
    if (poll(&pfd, 1, 5000) != 1) return;
    conn_ = UniqueFd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    std::string buffer;
    const Deadline deadline = DeadlineIn(5s);
    while (true) {
      std::optional<uint32_t> length = wire::PeekFrameLength(buffer);
      if (length && buffer.size() >= 4 + *length) break;
      if (!RecvSome(conn_.get(), buffer, 1 << 20, deadline).ok()) return;
    }
    const std::string body = buffer.substr(4, *wire::PeekFrameLength(buffer));
    EXPECT_TRUE(SendAll(conn_.get(), answer_(body), DeadlineIn(5s), nullptr).ok());
  }

  std::function<std::string(const std::string&)> answer_;
  UniqueFd listen_fd_;
  UniqueFd conn_;
  int port_ = 0;
  std::thread thread_;
};

// An IPv6 address written in brackets, as an endpoint spells it
// ("[::1]:29500") and a MASTER_ADDR copied from one keeps it, is that
// address, for the server and the client alike: "[::1]" went to the name
// service, and a client looked it up again and again until its deadline.
TEST(TcpStoreTest, AnAddressInBracketsIsTheAddress) {
  // ::1 where this host can bind it, else the same in IPv4.
  std::string address = "127.0.0.1";
  {
    UniqueFd probe(socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in6 loopback{};
    loopback.sin6_family = AF_INET6;
    loopback.sin6_addr = in6addr_loopback;
    if (probe.valid() && bind(probe.get(), reinterpret_cast<sockaddr*>(&loopback), sizeof(loopback)) == 0) {
      address = "::1";
    }
  }
  TcpStoreServerOptions options;
  options.bind_address = "[" + address + "]";
  options.job_token = kToken;
  StatusOr<std::unique_ptr<TcpStoreServer>> server = TcpStoreServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("[" + address + "]", port, kToken, DeadlineIn(5s));
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->endpoint(),
            (address == "::1" ? "[::1]" : address) + ":" + std::to_string(port));
  ASSERT_TRUE((*client)->Set("k", "v", DeadlineIn(5s)).ok());
  EXPECT_EQ(*(*client)->Get("k", DeadlineIn(5s)), "v");
}

// A connection that reached itself (TCP's simultaneous open, when nobody
// listens on a port in the ephemeral range) reads back the client's own
// hello. With an empty token that parses as an OK reply with a byte left
// over; the client must refuse it.
TEST(TcpStoreTest, HandshakeEchoedBackIsRefused) {
  HandshakeServer echo([](const std::string& hello) {
    wire::Writer w;
    w.Bytes(hello);
    return w.Frame();
  });
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("127.0.0.1", echo.port(), "", DeadlineIn(5s));
  ASSERT_FALSE(client.ok()) << "the client took its own hello for the store's answer";
  EXPECT_EQ(client.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(client.status().message(),
              HasSubstr("answered the handshake with something else than the store protocol"));
}

// MASTER_PORT pointing at another service: its answer (here an HTTP error
// page; an SSH server's greeting alike) reads as a frame of a gigabyte. The
// client says so at once, quoting it. Before, it took that for a closed
// connection and reconnected until its deadline, then reported the frame's
// size.
TEST(TcpStoreTest, AnotherServicesAnswerIsNamedAtOnce) {
  HandshakeServer http([](const std::string&) { return std::string("HTTP/1.1 400 Bad Request\r\n\r\n"); });
  const auto start = Clock::now();
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("127.0.0.1", http.port(), kToken, DeadlineIn(5s));
  ASSERT_FALSE(client.ok());
  EXPECT_LT(Clock::now() - start, 2s) << "retried until the deadline";
  EXPECT_EQ(client.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(client.status().message(),
              HasSubstr("answered the handshake with something else than the store protocol (it began "
                        "\"HTTP/1.1 400 Bad Request\"): is MASTER_PORT another service's port?"));
}

TEST(TcpStoreTest, HandshakeReplyOfAnotherVersionIsRefused) {
  HandshakeServer newer([](const std::string&) {
    wire::Writer w;
    w.Bytes(std::string_view(wire::kMagic, 4));
    w.U16(wire::kVersion + 1);
    w.U8(static_cast<uint8_t>(StatusCode::kOk));
    w.String("");
    return w.Frame();
  });
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("127.0.0.1", newer.port(), kToken, DeadlineIn(5s));
  ASSERT_FALSE(client.ok()) << "the client took a version 2 reply";
  EXPECT_EQ(client.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(client.status().message(), HasSubstr("speaks store protocol version 2"));
}

// A store that closes every connection before answering (evicting while
// flooded, or restarting): the client tries again, each time waiting longer.
// Before, it came back every 10 ms until its deadline, well over a hundred
// times in 1.5 s, and every rank turned away with it came back in step.
TEST(TcpStoreTest, AClientTurnedAwayBacksOffInsteadOfRetryingInStep) {
  StatusOr<std::vector<UniqueFd>> fds = ListenTcp("127.0.0.1", 0, 64, DeadlineIn(5s));
  ASSERT_TRUE(fds.ok()) << fds.status();
  UniqueFd listener = std::move(fds->front());
  const int port = *LocalPort(listener.get());
  std::atomic<bool> done{false};
  std::atomic<int> accepted{0};
  std::thread closer([&] {
    while (!done.load()) {
      pollfd pfd{listener.get(), POLLIN, 0};
      if (poll(&pfd, 1, 20) != 1) continue;
      UniqueFd conn(accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (conn.valid()) ++accepted;
    }
  });
  StatusOr<std::unique_ptr<TcpStoreClient>> client =
      TcpStoreClient::Connect("127.0.0.1", port, kToken, DeadlineIn(1500ms));
  done = true;
  closer.join();
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kUnavailable) << client.status();
  EXPECT_THAT(client.status().message(), HasSubstr("cannot connect to the store at 127.0.0.1:" +
                                                   std::to_string(port)));
  // Doubling from 10 ms to at most 500 ms, each pause at least half its
  // ceiling: at most 11 tries fit in 1.5 s.
  EXPECT_GE(accepted.load(), 2) << "never tried again";
  EXPECT_LE(accepted.load(), 12) << "retried without backing off";
}

std::string OkHandshakeReply(const std::string&) {
  wire::Writer w;
  w.Bytes(std::string_view(wire::kMagic, 4));
  w.U16(wire::kVersion);
  w.U8(static_cast<uint8_t>(StatusCode::kOk));
  w.String("");
  return w.Frame();
}

// A request that timed out half-sent leaves the stream unusable; the client
// shuts the socket down, so the server sees the end at once instead of
// waiting for the rest of the frame with room held for it.
TEST(TcpStoreTest, RequestTimedOutHalfSentEndsTheConnection) {
  HandshakeServer server(OkHandshakeReply, /*receive_buffer=*/4096);
  auto client = ConnectClient(server.port());
  const int conn = server.Join();
  ASSERT_GE(conn, 0);
  // The server reads nothing; a 4 MiB Set fills the socket buffers. When
  // they took a whole frame, the server reads a little to make room for
  // part of the next one.
  const std::string value(kMaxValueBytes, 'v');
  bool half_sent = false;
  std::string drained;
  for (int i = 0; i < 8 && !half_sent; ++i) {
    Status s = client->Set("big/" + std::to_string(i), value, DeadlineIn(200ms));
    half_sent = s.code() == StatusCode::kUnavailable &&
                s.message().find("timed out half-sent") != std::string::npos;
    if (!half_sent) {
      ASSERT_EQ(s.code(), StatusCode::kTimedOut) << s;
      (void)RecvSome(conn, drained, 256 << 10, DeadlineIn(10ms));
    }
  }
  ASSERT_TRUE(half_sent) << "no Set timed out half-sent";
  // Everything the client sent arrives, then the end of the stream.
  const Deadline deadline = DeadlineIn(3s);
  Status s;
  do {
    drained.clear();
    s = RecvSome(conn, drained, 1 << 20, deadline);
  } while (s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable)
      << "the client kept the half-sent request's connection open: " << s;
}

// A client that sends part of a request and then nothing is dropped after
// frame_stall_timeout, with the room held for its frame; one that sends a
// request slowly but steadily, or idles between requests, is not.
TEST(TcpStoreTest, RequestStalledMidFrameIsDropped) {
  LogSink log;
  TcpStoreServerOptions options;
  // Long against the slow sender's pauses below, so that a loaded machine
  // that holds this thread up for a while does not look like a stall.
  constexpr auto kStall = 2s;
  options.frame_stall_timeout = kStall;
  options.log = log.Fn();
  auto server = StartServer(options);
  // The slow client below first idles between requests for longer than the
  // stall limit; it does so while the stalled one is dropped (it used to
  // idle after, 2.5 s more).
  RawConnection slow(server->port());
  slow.Handshake();
  const Deadline slow_idle_since = Clock::now();
  RawConnection stalled(server->port());
  stalled.Handshake();
  wire::Writer header;
  header.U32(100);
  const Deadline start = Clock::now();
  stalled.Send(header.body() + std::string(10, 'x'));
  EXPECT_TRUE(stalled.ClosedWithin(10s)) << "the stalled request's connection stayed open";
  EXPECT_GE(Clock::now() - start, kStall - 50ms);
  EXPECT_EQ(server->stats().dropped_stalled, 1u);
  EXPECT_TRUE(log.Contains("it sent 14 of the 104 bytes of a request and then nothing for 2000 ms"));
  const Deadline released = DeadlineIn(5s);
  while (server->stats().buffered_bytes > 0 && Clock::now() < released) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(server->stats().buffered_bytes, 0u);

  // One byte every 200 ms: slow (the whole request takes twice the stall
  // limit), but never the stall limit without progress.
  std::this_thread::sleep_until(slow_idle_since + kStall + 500ms);  // idle between requests is fine
  const std::string frame = TryGetFrame(9, "slow-key");
  const Deadline slow_start = Clock::now();
  for (char byte : frame) {
    slow.Send(std::string_view(&byte, 1));
    std::this_thread::sleep_for(200ms);
  }
  EXPECT_GT(Clock::now() - slow_start, kStall) << "the request was not slow";
  std::optional<std::string> reply = slow.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value()) << "the slow request's connection was dropped";
  uint32_t id = 0;
  EXPECT_EQ(RawConnection::ParseReply(*reply, &id).first, StatusCode::kOk);
  EXPECT_EQ(id, 9u);
  EXPECT_EQ(server->stats().dropped_stalled, 1u);
}

// Timeouts past the clock's range (milliseconds::max(), a way to say "no
// limit") count as the furthest deadline the clock has. Added to now they
// wrapped into the past: every connection was dropped at its first round,
// "no handshake within 9223372036854775807 ms", and a request in two parts
// as stalled.
TEST(TcpStoreTest, ServerTimeoutsBeyondTheClocksRangeDropNobody) {
  TcpStoreServerOptions options;
  options.handshake_timeout = std::chrono::milliseconds::max();
  options.frame_stall_timeout = std::chrono::milliseconds::max();
  auto server = StartServer(options);
  RawConnection raw(server->port());
  // The hello goes out once the server has accepted the connection (and so
  // set its handshake timer), not with the connect.
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.accepted == 1; }));
  ASSERT_NO_FATAL_FAILURE(raw.Handshake());
  EXPECT_EQ(server->stats().dropped_silent, 0u);
  // Half a request, then (once the server holds room for it, so has read
  // its header and set its stall timer) the rest.
  const std::string frame = TryGetFrame(3, "k");
  raw.Send(std::string_view(frame).substr(0, 6));
  ASSERT_TRUE(StatsReach(*server, [](const TcpStoreServerStats& s) { return s.receiving_bytes > 0; }));
  raw.Send(std::string_view(frame).substr(6));
  std::optional<std::string> reply = raw.ReadFrame(5s);
  ASSERT_TRUE(reply.has_value()) << "the connection was dropped";
  uint32_t id = 0;
  EXPECT_EQ(RawConnection::ParseReply(*reply, &id).first, StatusCode::kOk);
  EXPECT_EQ(id, 3u);
  EXPECT_EQ(server->stats().dropped_stalled, 0u);
}

// Connections that once moved a large value let go of the memory when
// done: they must not keep 1 MiB each (input and output) for as long as
// they live, outside the bound on buffered bytes.
TEST(TcpStoreTest, ConnectionsLetGoOfBigBuffersOnceDone) {
  auto server = StartServer();
  constexpr int kClients = 8;
  const std::string value(1 << 20, 'v');
  std::vector<std::unique_ptr<TcpStoreClient>> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(ConnectClient(*server));
    const std::string key = "big/" + std::to_string(i);
    ASSERT_TRUE(clients.back()->Set(key, value, DeadlineIn(10s)).ok());
    StatusOr<std::string> got = clients.back()->Get(key, DeadlineIn(10s));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->size(), value.size());
    ASSERT_TRUE(clients.back()->Set("small/" + std::to_string(i), "v", DeadlineIn(5s)).ok());
  }
  // Every connection may keep a small buffer (64 KiB) each way.
  constexpr uint64_t kBound = kClients * 2 * (64 << 10);
  const Deadline deadline = DeadlineIn(5s);
  while (server->stats().buffer_capacity_bytes > kBound && Clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_LE(server->stats().buffer_capacity_bytes, kBound)
      << "the connections keep the memory of the large values they moved";
  // And they still serve large values.
  StatusOr<std::string> again = clients.front()->Get("big/3", DeadlineIn(10s));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, value);
}

}  // namespace
}  // namespace ddp::transport::store
