// The rendezvous store's security claims (transport/store/tcp_store.h), each
// checked the way an outsider would probe it. The store's own tests cover
// the protocol's refusals; these add what they leave open:
//
//   - the store of a real job (hosted by ddprun, or by rank 0's
//     communicator) listens on the master address only;
//   - the token comparison takes the same time wherever a guess goes wrong;
//   - memory stays bounded while many connections send the largest frames
//     and strangers announce frames far over the bound;
//   - a client that trickles its handshake is dropped at the deadline, which
//     activity does not extend;
//   - a hello replayed on an authenticated connection, or cut short, is
//     refused with its reason, and the job goes on;
//   - parked waits per connection and connections in total are bounded;
//   - a flood that exhausts the server's file descriptors does not keep the
//     job's ranks out.

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <utility>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/communicator.h"
#include "transport/launch/env.h"
#include "transport/launch/launch_test_util.h"
#include "transport/launch/test_spawn.h"
#include "transport/store/socket.h"
#include "transport/store/tcp_store.h"
#include "transport/store/wire.h"

namespace ddp::transport {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;
using store::TcpStoreClient;
using store::TcpStoreServer;
using store::TcpStoreServerOptions;
using store::UniqueFd;
namespace wire = store::wire;
namespace launch_testing = launch::testing;

constexpr char kToken[] = "security-test-token-5d1c";

// ---- probes an outsider can run ----

// Calls f(local address hex, state hex, queues "tx:rx" hex) for every
// socket of /proc/net/tcp and /proc/net/tcp6 (this network namespace) whose
// local port is `port`.
template <typename F>
void ForEachSocketOnPort(int port, F f) {
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues;
      fields >> slot >> local >> remote >> state >> queues;
      const size_t colon = local.find(':');
      if (colon == std::string::npos) continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) != port) continue;
      f(local.substr(0, colon), state, queues);
    }
  }
}

// Addresses (dotted IPv4, or "ipv6:<hex>") of sockets listening on `port`.
std::vector<std::string> ListeningAddresses(int port) {
  std::vector<std::string> out;
  ForEachSocketOnPort(port, [&](const std::string& hex, const std::string& state, const std::string&) {
    if (state != "0A") return;  // TCP_LISTEN
    if (hex.size() == 8) {
      // The kernel prints the address as a host-order (little-endian) word.
      in_addr addr;
      addr.s_addr = static_cast<in_addr_t>(std::stoul(hex, nullptr, 16));
      char text[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &addr, text, sizeof(text));
      out.push_back(text);
    } else {
      out.push_back("ipv6:" + hex);
    }
  });
  return out;
}

// Bytes received by established sockets on local port `port` that nobody
// has read yet (the rx_queue column): how much a server on that port has
// left unread.
size_t UnreadBytesAtPort(int port) {
  size_t total = 0;
  ForEachSocketOnPort(port, [&](const std::string&, const std::string& state, const std::string& queues) {
    const size_t colon = queues.find(':');
    if (state != "01" || colon == std::string::npos) return;  // TCP_ESTABLISHED
    total += std::stoul(queues.substr(colon + 1), nullptr, 16);
  });
  return total;
}

// errno of a TCP connect to `address`:`port` (0 when it connected).
int ConnectErrno(const std::string& address, int port) {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, address.c_str(), &addr.sin_addr);
  timeval tv{2, 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 ? 0 : errno;
}

// An IPv4 address of this host outside 127/8, or "" when it has none.
std::string NonLoopbackAddress() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if (!(a->ifa_flags & IFF_UP) || (a->ifa_flags & IFF_LOOPBACK)) continue;
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text,
              sizeof(text));
    found = text;
  }
  freeifaddrs(list);
  return found;
}

// The master address to test with: a real interface address when the host
// has one (then loopback must be refused), else 127.0.0.1 (then 127.0.0.2,
// which also reaches this host, must be refused).
std::string MasterAddress() {
  const std::string real = NonLoopbackAddress();
  const std::string master = real.empty() ? "127.0.0.1" : real;
  std::printf("master address %s, probed from %s\n", master.c_str(),
              master == "127.0.0.1" ? "127.0.0.2" : "127.0.0.1");
  return master;
}

std::string OtherAddress(const std::string& master) {
  return master == "127.0.0.1" ? "127.0.0.2" : "127.0.0.1";
}

// Empty when the store on `master`:`port` listens there only; otherwise
// what is wrong.
std::string CheckListensOnlyOn(const std::string& master, int port) {
  const std::vector<std::string> listening = ListeningAddresses(port);
  if (listening != std::vector<std::string>{master}) {
    std::string all;
    for (const std::string& a : listening) all += " " + a;
    return "port " + std::to_string(port) + " listens on [" + all + " ], expected only " + master;
  }
  const std::string other = OtherAddress(master);
  const int err = ConnectErrno(other, port);
  if (err != ECONNREFUSED) {
    return "connecting to " + other + ":" + std::to_string(port) + " gave '" +
           std::strerror(err) + "', expected 'Connection refused'";
  }
  return "";
}

// ---- workers (separate processes) ----

// Under ddprun: the launcher's store must listen on MASTER_ADDR only.
DDP_TEST_WORKER(check_launcher_store) {
  StatusOr<launch::LaunchEnv> env = launch::LaunchEnvFromProcess();
  if (!env.ok()) {
    std::fprintf(stderr, "%s\n", env.status().ToString().c_str());
    return 2;
  }
  const std::string problem = CheckListensOnlyOn(env->master_addr, env->master_port);
  std::printf("%s\n", problem.empty() ? "listen check passed" : problem.c_str());
  return problem.empty() ? 0 : 1;
}

// Two ranks; rank 0's communicator serves the store on SECURITY_MASTER_ADDR.
// Rank 1 probes it once the communicator formed, then both meet in a barrier.
DDP_TEST_WORKER(check_rank0_store) {
  StatusOr<launch::LaunchEnv> env = launch::LaunchEnvFromProcess();
  if (!env.ok()) return 2;
  CommunicatorOptions options;
  options.rank = env->rank;
  options.world_size = env->world_size;
  options.local_rank = env->local_rank;
  options.local_world_size = env->local_world_size;
  options.store_host = std::getenv("SECURITY_MASTER_ADDR");
  options.store_port = env->master_port;
  options.host_store = true;
  options.job_token = env->job_token;
  options.timeout = 60s;
  StatusOr<std::unique_ptr<Communicator>> comm = Communicator::Create(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", env->rank, comm.status().ToString().c_str());
    return 3;
  }
  std::string problem;
  if (env->rank == 1) {
    problem = CheckListensOnlyOn(options.store_host, options.store_port);
    std::printf("%s\n", problem.empty() ? "listen check passed" : problem.c_str());
  }
  const Status barrier = (*comm)->Barrier();
  if (!barrier.ok()) {
    std::fprintf(stderr, "barrier: %s\n", barrier.ToString().c_str());
    return 4;
  }
  return problem.empty() ? 0 : 1;
}

// A store server allowed only 64 file descriptors. Writes its port to
// $SECURITY_PORT_FILE and serves until key "done" is set (bounded wait).
DDP_TEST_WORKER(fd_limited_store) {
  rlimit limit{64, 64};
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) return 2;
  TcpStoreServerOptions options;
  options.job_token = kToken;
  // Long enough that only file descriptor pressure can evict the flood.
  options.handshake_timeout = 30s;
  options.log = [](const std::string&) {};
  auto server = TcpStoreServer::Start(options);
  if (!server.ok()) return 3;
  {
    const std::string path = std::getenv("SECURITY_PORT_FILE");
    std::ofstream(path + ".tmp") << (*server)->port() << "\n";
    std::rename((path + ".tmp").c_str(), path.c_str());
  }
  auto client = TcpStoreClient::Connect("127.0.0.1", (*server)->port(), kToken, DeadlineIn(30s));
  if (!client.ok()) return 4;
  const std::vector<std::string> keys = {"done"};
  const Status done = (*client)->Wait(keys, DeadlineIn(60s));
  const store::TcpStoreServerStats stats = (*server)->stats();
  std::printf("accepted %llu authenticated %llu evicted %llu\n",
              static_cast<unsigned long long>(stats.accepted),
              static_cast<unsigned long long>(stats.authenticated),
              static_cast<unsigned long long>(stats.evicted));
  return done.ok() ? 0 : 5;
}

// ---- helpers for in-process servers ----

std::unique_ptr<TcpStoreServer> StartServer(TcpStoreServerOptions options) {
  options.job_token = kToken;
  if (!options.log) options.log = [](const std::string&) {};
  auto server = TcpStoreServer::Start(std::move(options));
  EXPECT_TRUE(server.ok()) << server.status();
  return std::move(server).value();
}

UniqueFd RawConnect(int port) {
  auto fd = store::ConnectTcp("127.0.0.1", port, DeadlineIn(5s));
  EXPECT_TRUE(fd.ok()) << fd.status();
  return std::move(fd).value();
}

std::string HandshakeFrame(std::string_view token) {
  wire::Writer w;
  w.Bytes(std::string_view(wire::kMagic, 4));
  w.U16(wire::kVersion);
  w.U16(0);
  w.String(token);
  return w.Frame();
}

// Reads one frame body (blocking until `deadline`); nullopt on close.
std::optional<std::string> ReadFrame(int fd, std::string& buffer, Deadline deadline) {
  for (;;) {
    std::optional<uint32_t> length = wire::PeekFrameLength(buffer);
    if (length && buffer.size() >= 4 + *length) {
      std::string body = buffer.substr(4, *length);
      buffer.erase(0, 4 + *length);
      return body;
    }
    if (!store::RecvSome(fd, buffer, 1 << 20, deadline).ok()) return std::nullopt;
  }
}

// True when the server closes `fd` before `deadline`.
bool ClosedBy(int fd, Deadline deadline) {
  std::string sink;
  for (;;) {
    const Status s = store::RecvSome(fd, sink, 1 << 16, deadline);
    if (s.code() == StatusCode::kUnavailable) return true;
    if (s.code() == StatusCode::kTimedOut) return false;
    sink.clear();
  }
}

long StatusField(const char* name) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) == 0) return std::atol(line.c_str() + std::strlen(name));
  }
  return -1;
}

// The test binary's own path (workers are this binary, selected by
// DDP_TEST_WORKER); "/proc/self/exe" would name ddprun inside ddprun.
std::string SelfExe() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  EXPECT_GT(n, 0);
  return std::string(path, n > 0 ? static_cast<size_t>(n) : 0);
}

// ---- the listening address ----

TEST(RendezvousSecurity, LauncherStoreListensOnTheMasterAddressOnly) {
  const std::string master = MasterAddress();
  StatusOr<int> port = launch_testing::PickFreePort();
  ASSERT_TRUE(port.ok());
  const auto run = launch_testing::RunProgram(
      {launch_testing::Runfile("transport/launch/ddprun"), "--nproc_per_node=1",
       "--master_addr=" + master, "--master_port=" + std::to_string(*port), SelfExe()},
      {{launch_testing::kTestWorkerEnv, "check_launcher_store"}}, 60s);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("listen check passed"));
}

TEST(RendezvousSecurity, RankZeroStoreListensOnTheMasterAddressOnly) {
  launch_testing::TestRunOptions options;
  options.world_size = 2;
  options.host_store = false;
  options.timeout = 90s;
  options.env = {{"SECURITY_MASTER_ADDR", MasterAddress()}};
  auto run = launch_testing::RunTestWorkers("check_rank0_store", options);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << run->Summary() << run->Output(0) << run->Output(1);
  EXPECT_THAT(run->Output(1), HasSubstr("listen check passed"));
}

// ---- the token ----

using Compare = bool (*)(std::string_view, std::string_view);

// What a naive comparison does: stop at the first difference. The control
// that shows the timing harness can see an early exit.
[[gnu::noinline]] bool EarlyExitEqual(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// Time of 100 comparisons, in ns; adds to `accepted` how many said equal
// (which also keeps the calls from being optimised away). Called through a
// volatile pointer so that the loop cannot be hoisted.
double BatchTimeNs(Compare compare, const std::string& expected, const std::string& given, int* accepted) {
  Compare volatile fn = compare;
  int equal = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 100; ++i) equal += fn(expected, given);
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  *accepted += equal;
  return ns;
}

// Best time with a wrong first byte over best time with a wrong last byte of
// a 4 KiB token. Both wrong guesses are the same buffer with one byte
// flipped, so that where the strings lie in memory cannot tell them apart,
// and the two kinds of batch alternate, so a busy spell of the machine falls
// on both; the best of hundreds filters the rest of the noise out.
double FirstOverLast(Compare compare) {
  const std::string expected(4096, 'k');
  std::string guess = expected;
  double first = 1e300, last = 1e300;
  int accepted = 0;
  for (int round = 0; round < 400; ++round) {
    guess.front() ^= 1;
    first = std::min(first, BatchTimeNs(compare, expected, guess, &accepted));
    guess.front() ^= 1;
    guess.back() ^= 1;
    last = std::min(last, BatchTimeNs(compare, expected, guess, &accepted));
    guess.back() ^= 1;
  }
  // Every guess timed has one wrong byte: a comparison fast or slow is no
  // use if it accepts them.
  EXPECT_EQ(accepted, 0) << "guesses with one wrong byte accepted, of 80000";
  std::printf("first/last wrong byte: %.0f ns / %.0f ns per 100 comparisons\n", first, last);
  return first / last;
}

// An early-exit comparison of a 4 KiB token answers a wrong first byte
// hundreds of times faster than a wrong last byte; the store's takes the
// same time for both.
TEST(RendezvousSecurity, TokenComparisonTakesTheSameTimeWhereverAGuessIsWrong) {
  const std::string expected(4096, 'k');
  ASSERT_TRUE(wire::TokensEqual(expected, expected));
  EXPECT_FALSE(wire::TokensEqual(expected, expected.substr(0, 1)));
  EXPECT_FALSE(wire::TokensEqual(expected, expected + "k"));
  EXPECT_FALSE(wire::TokensEqual(expected, ""));

  const double control = FirstOverLast(&EarlyExitEqual);
  EXPECT_LT(control, 0.05) << "the harness cannot see an early exit on this machine";
  // Constant time gives about 1, an early exit about 0.002; the band is wide
  // because tests run four at a time on two cores.
  const double ratio = FirstOverLast(&wire::TokensEqual);
  EXPECT_GT(ratio, 0.2);
  EXPECT_LT(ratio, 5.0);
}

// The probe itself sees a server that listens everywhere.
TEST(RendezvousSecurity, ListenProbeSeesAWildcardBind) {
  TcpStoreServerOptions options;
  options.bind_address = "0.0.0.0";
  options.job_token = kToken;
  auto server = TcpStoreServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_THAT(CheckListensOnlyOn("127.0.0.1", (*server)->port()),
              HasSubstr("listens on [ 0.0.0.0 ], expected only 127.0.0.1"));
}

// ---- memory ----

// 24 of the job's connections each announce a Set of the largest value (4
// MiB) and push what their sockets take; 60 strangers announce frames of 1
// GiB. Returns how much the process's peak resident memory grew, in KiB.
long PeakGrowthUnderLargeFrames(size_t max_buffered_bytes, size_t max_stored_bytes) {
  TcpStoreServerOptions options;
  options.max_buffered_bytes = max_buffered_bytes;
  options.max_stored_bytes = max_stored_bytes;
  auto server = StartServer(options);

  wire::Writer set;
  set.U8(static_cast<uint8_t>(wire::Op::kSet));
  set.U32(1);
  set.String("big");
  set.String(std::string(store::kMaxValueBytes, 'v'));
  const std::string frame = set.Frame();  // touched now: part of the baseline

  constexpr int kRanks = 24;
  std::vector<UniqueFd> ranks;
  for (int i = 0; i < kRanks; ++i) {
    ranks.push_back(RawConnect(server->port()));
    std::string buffer;
    EXPECT_TRUE(store::SendAll(ranks.back().get(), HandshakeFrame(kToken), DeadlineIn(5s),
                               nullptr)
                    .ok());
    EXPECT_TRUE(ReadFrame(ranks.back().get(), buffer, DeadlineIn(5s)).has_value());
  }
  std::this_thread::sleep_for(100ms);
  std::ofstream("/proc/self/clear_refs") << "5";  // restart the peak (VmHWM) count
  const long baseline_kb = StatusField("VmRSS:");
  EXPECT_GT(baseline_kb, 0);

  size_t total_sent = 0;
  for (UniqueFd& fd : ranks) {
    size_t sent = 0;
    while (sent < frame.size()) {
      const ssize_t n = send(fd.get(), frame.data() + sent, frame.size() - sent,
                             MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    total_sent += sent;
  }
  std::vector<UniqueFd> strangers;
  for (int i = 0; i < 60; ++i) {
    strangers.push_back(RawConnect(server->port()));
    wire::Writer header;
    header.U32(1u << 30);
    EXPECT_TRUE(store::SendAll(strangers.back().get(), header.body(), DeadlineIn(5s), nullptr)
                    .ok());
  }
  // Let the server read whatever it is willing to: until it has refused the
  // strangers and either read every byte the ranks sent (loose bounds) or
  // reserved a quarter of its bound (which it may fill only with whole
  // frames), then a little longer for anything in flight. A fixed sleep
  // measured nothing when the machine was busy and the server thread had
  // not run yet. Under loose bounds the server's reserved bytes are no
  // measure of what it read: a frame read whole is handled and its
  // reservation released, so the sockets' unread bytes are watched instead.
  const bool loose = max_buffered_bytes >= total_sent;
  const Deadline deadline = DeadlineIn(20s);
  for (;;) {
    const store::TcpStoreServerStats stats = server->stats();
    const size_t unread = UnreadBytesAtPort(server->port());
    const bool read_enough =
        loose ? unread == 0 : stats.buffered_bytes >= max_buffered_bytes / 4;
    if (stats.refused_oversized >= 60 && read_enough) break;
    if (Clock::now() > deadline) {
      ADD_FAILURE() << "the server reserved " << stats.buffered_bytes << " bytes and left "
                    << unread << " unread of " << total_sent << " sent (bound "
                    << max_buffered_bytes << ") and refused " << stats.refused_oversized
                    << " strangers in 20 s";
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  std::this_thread::sleep_for(300ms);
  const long growth_kb = StatusField("VmHWM:") - baseline_kb;
  for (UniqueFd& fd : strangers) EXPECT_TRUE(ClosedBy(fd.get(), DeadlineIn(5s)));
  EXPECT_GE(server->stats().refused_oversized, 60u);
  ranks.clear();  // the server drops their half-sent frames
  auto client = TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, DeadlineIn(10s));
  EXPECT_TRUE(client.ok()) << client.status();
  if (client.ok()) {
    EXPECT_TRUE((*client)->Set("after", "ok", DeadlineIn(10s)).ok());
  }
  return growth_kb;
}

// The server holds at most max_buffered_bytes of frames being received and
// max_stored_bytes of data, plus the one frame being handled: its peak
// resident memory grows by less than three times the bound, where the same
// traffic against a server with loose bounds costs several times more.
TEST(RendezvousSecurity, MemoryStaysBoundedWhileManyConnectionsSendTheLargestFrames) {
  constexpr size_t kBound = 8 << 20;
  const long bounded_kb = PeakGrowthUnderLargeFrames(kBound, kBound);
  const long loose_kb = PeakGrowthUnderLargeFrames(size_t{1} << 30, size_t{1} << 30);
  std::printf("peak resident growth: %ld KiB with an 8 MiB bound, %ld KiB with 1 GiB\n",
              bounded_kb, loose_kb);
  EXPECT_LT(bounded_kb, static_cast<long>(3 * kBound / 1024));
  EXPECT_GT(loose_kb, 2 * bounded_kb) << "the traffic did not stress the bound";
}

// ---- idle and slow clients ----

// The handshake deadline counts from the accept: sending a byte now and then
// does not extend it.
TEST(RendezvousSecurity, ClientThatTricklesItsHandshakeIsDroppedAtTheDeadline) {
  TcpStoreServerOptions options;
  options.handshake_timeout = 300ms;
  auto server = StartServer(options);
  // The deadline counts from the server's accept, which may come before the
  // connect call returns here: the clock starts before connecting.
  const auto start = Clock::now();
  UniqueFd fd = RawConnect(server->port());
  const std::string handshake = HandshakeFrame(kToken);
  bool closed = false;
  for (size_t i = 0; i + 1 < handshake.size() && !closed; ++i) {
    if (send(fd.get(), handshake.data() + i, 1, MSG_NOSIGNAL) != 1) break;
    closed = ClosedBy(fd.get(), DeadlineIn(40ms));
  }
  if (!closed) closed = ClosedBy(fd.get(), DeadlineIn(2s));
  const auto elapsed = Clock::now() - start;
  EXPECT_TRUE(closed);
  EXPECT_GE(elapsed, 250ms);
  EXPECT_LT(elapsed, 1500ms) << "the trickle kept the connection open";
  EXPECT_EQ(server->stats().dropped_silent, 1u);
  EXPECT_EQ(server->stats().authenticated, 0u);
}

TEST(RendezvousSecurity, ParkedWaitsPerConnectionAreBounded) {
  TcpStoreServerOptions options;
  options.max_waits_per_connection = 4;
  auto server = StartServer(options);
  UniqueFd fd = RawConnect(server->port());
  std::string buffer;
  ASSERT_TRUE(store::SendAll(fd.get(), HandshakeFrame(kToken), DeadlineIn(5s), nullptr).ok());
  ASSERT_TRUE(ReadFrame(fd.get(), buffer, DeadlineIn(5s)).has_value());
  for (uint32_t id = 1; id <= 5; ++id) {
    wire::Writer get;
    get.U8(static_cast<uint8_t>(wire::Op::kGet));
    get.U32(id);
    get.U32(30000);
    get.String("later");
    ASSERT_TRUE(store::SendAll(fd.get(), get.Frame(), DeadlineIn(5s), nullptr).ok());
  }
  // Only the fifth is answered now, with the bound.
  std::optional<std::string> refused = ReadFrame(fd.get(), buffer, DeadlineIn(5s));
  ASSERT_TRUE(refused.has_value());
  wire::Reader r(*refused);
  uint32_t id = 0;
  uint8_t code = 0;
  std::string_view message;
  ASSERT_TRUE(r.U32(id) && r.U8(code) && r.String(message, 4096));
  EXPECT_EQ(id, 5u);
  EXPECT_EQ(static_cast<StatusCode>(code), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(message), HasSubstr("already 4 waits parked on this connection"));
  // The four parked ones are answered once the key is set.
  auto setter = TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, DeadlineIn(5s));
  ASSERT_TRUE(setter.ok());
  ASSERT_TRUE((*setter)->Set("later", "now", DeadlineIn(5s)).ok());
  std::set<uint32_t> answered;
  for (int i = 0; i < 4; ++i) {
    std::optional<std::string> reply = ReadFrame(fd.get(), buffer, DeadlineIn(5s));
    ASSERT_TRUE(reply.has_value());
    wire::Reader rr(*reply);
    ASSERT_TRUE(rr.U32(id) && rr.U8(code));
    EXPECT_EQ(code, 0);
    answered.insert(id);
  }
  EXPECT_EQ(answered, (std::set<uint32_t>{1, 2, 3, 4}));
}

TEST(RendezvousSecurity, ConnectionsInTotalAreBoundedAndStrangersMakeRoomForTheJob) {
  TcpStoreServerOptions options;
  options.max_connections = 4;
  options.handshake_timeout = 30s;
  auto server = StartServer(options);
  std::vector<std::unique_ptr<TcpStoreClient>> job;
  for (int i = 0; i < 3; ++i) {
    auto c = TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, DeadlineIn(5s));
    ASSERT_TRUE(c.ok()) << c.status();
    job.push_back(std::move(c).value());
  }
  // A stranger takes the fourth place and says nothing.
  UniqueFd stranger = RawConnect(server->port());
  const Deadline settle = DeadlineIn(5s);
  while (server->stats().open_connections < 4 && Clock::now() < settle) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_EQ(server->stats().open_connections, 4u);
  // A rank arriving at the limit takes the stranger's place.
  auto fourth = TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, DeadlineIn(5s));
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  EXPECT_TRUE(ClosedBy(stranger.get(), DeadlineIn(5s)));
  EXPECT_EQ(server->stats().evicted, 1u);
  EXPECT_TRUE((*fourth)->Set("k", "v", DeadlineIn(5s)).ok());
  // With every place held by the job, newcomers are refused, and told why.
  auto fifth = TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, DeadlineIn(1s));
  ASSERT_FALSE(fifth.ok());
  EXPECT_EQ(fifth.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(fifth.status().message(),
              HasSubstr("already holds 4 connections, its limit (TcpStoreServerOptions::"
                        "max_connections)"));
  EXPECT_EQ(server->stats().open_connections, 4u);
  for (auto& c : job) EXPECT_TRUE(c->TryGet("k", DeadlineIn(5s)).ok());
}

// ---- replayed and truncated hellos ----

// The code and message of a handshake reply body; code -1 when it is none.
std::pair<int, std::string> HandshakeReplyOf(const std::optional<std::string>& body) {
  if (!body.has_value()) return {-1, "the connection closed without a reply"};
  wire::Reader r(*body);
  std::string_view magic, message;
  uint16_t version = 0;
  uint8_t code = 0;
  if (!r.Bytes(4, magic) || !r.U16(version) || !r.U8(code) || !r.String(message, 4096)) {
    return {-1, "not a handshake reply"};
  }
  return {code, std::string(message)};
}

// A hello sent again on a connection it already opened is no request: the
// server refuses it with a reply naming why and drops the connection, it
// does not authenticate it a second time, and the job goes on.
TEST(RendezvousSecurity, AHelloReplayedOnAnAuthenticatedConnectionIsRefusedAndTheJobGoesOn) {
  auto server = StartServer({});
  auto job = TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, DeadlineIn(5s));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE((*job)->Set("k", "v", DeadlineIn(5s)).ok());
  UniqueFd fd = RawConnect(server->port());
  std::string buffer;
  ASSERT_TRUE(store::SendAll(fd.get(), HandshakeFrame(kToken), DeadlineIn(5s), nullptr).ok());
  const auto accepted = HandshakeReplyOf(ReadFrame(fd.get(), buffer, DeadlineIn(5s)));
  ASSERT_EQ(accepted.first, 0) << accepted.second;
  ASSERT_TRUE(store::SendAll(fd.get(), HandshakeFrame(kToken), DeadlineIn(5s), nullptr).ok());
  std::optional<std::string> refused = ReadFrame(fd.get(), buffer, DeadlineIn(5s));
  ASSERT_TRUE(refused.has_value()) << "the replayed hello got no reply";
  wire::Reader r(*refused);
  uint32_t id = 0;
  uint8_t code = 0;
  std::string_view message;
  ASSERT_TRUE(r.U32(id) && r.U8(code) && r.String(message, 4096));
  EXPECT_EQ(static_cast<StatusCode>(code), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(message), HasSubstr("unknown operation"));
  EXPECT_TRUE(ClosedBy(fd.get(), DeadlineIn(5s)));
  EXPECT_EQ(server->stats().authenticated, 2u);
  EXPECT_EQ(server->stats().refused_malformed, 1u);
  auto value = (*job)->Get("k", DeadlineIn(5s));
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "v");
}

// Hellos cut short (the stream ended inside the frame, the frame ended
// inside the hello) let nobody in: a whole frame is answered with the
// reason, a stream that ends mid-frame is closed, and the job then forms.
TEST(RendezvousSecurity, TruncatedHellosAreRefusedAndTheJobGoesOn) {
  auto server = StartServer({});
  const std::string hello = HandshakeFrame(kToken);
  {  // The stream ends halfway through the frame.
    UniqueFd fd = RawConnect(server->port());
    ASSERT_TRUE(store::SendAll(fd.get(), hello.substr(0, hello.size() / 2), DeadlineIn(5s), nullptr).ok());
    shutdown(fd.get(), SHUT_WR);
    EXPECT_TRUE(ClosedBy(fd.get(), DeadlineIn(5s)));
  }
  // Whole frames whose hello stops early: after the magic, and inside the
  // token (its length says more bytes than the frame holds).
  struct Case {
    std::string body;
    std::string why;
  };
  const size_t header = wire::kFrameHeaderBytes;
  const std::string whole = hello.substr(header);
  const std::vector<Case> cases = {
      {whole.substr(0, 4), "truncated handshake"},
      {whole.substr(0, whole.size() - 5), "malformed handshake"},
  };
  for (const Case& c : cases) {
    UniqueFd fd = RawConnect(server->port());
    wire::Writer w;
    w.Bytes(c.body);
    ASSERT_TRUE(store::SendAll(fd.get(), w.Frame(), DeadlineIn(5s), nullptr).ok());
    std::string buffer;
    const auto reply = HandshakeReplyOf(ReadFrame(fd.get(), buffer, DeadlineIn(5s)));
    EXPECT_EQ(reply.first, static_cast<int>(StatusCode::kInvalidArgument)) << c.why << ": " << reply.second;
    EXPECT_EQ(reply.second, c.why);
    EXPECT_TRUE(ClosedBy(fd.get(), DeadlineIn(5s))) << c.why;
  }
  EXPECT_EQ(server->stats().authenticated, 0u);
  EXPECT_GE(server->stats().refused_malformed, 2u);
  auto job = TcpStoreClient::Connect("127.0.0.1", server->port(), kToken, DeadlineIn(5s));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_TRUE((*job)->Set("formed", "yes", DeadlineIn(5s)).ok());
  EXPECT_EQ(server->stats().authenticated, 1u);
}

// ---- flood ----

// The server runs in its own process with 64 file descriptors; a stranger
// process (this one) holds hundreds of connections open and keeps opening
// more. The job's four ranks still connect, rendezvous and finish.
TEST(RendezvousSecurity, FloodBeyondTheServersFileDescriptorsDoesNotKeepTheJobOut) {
  const std::string dir = launch_testing::MakeTempDir("fd_flood");
  const std::string port_file = dir + "/port";
  auto server = launch_testing::StartProgram(
      {SelfExe()}, {{launch_testing::kTestWorkerEnv, "fd_limited_store"},
                           {"SECURITY_PORT_FILE", port_file}});
  ASSERT_TRUE(server.ok()) << server.status();
  int port = 0;
  for (const Deadline until = DeadlineIn(20s); port == 0 && Clock::now() < until;) {
    std::ifstream(port_file) >> port;
    if (port == 0) std::this_thread::sleep_for(10ms);
  }
  ASSERT_GT(port, 0) << "the store process did not start";

  std::atomic<bool> stop{false};
  std::atomic<int> opened{0};
  std::thread flood([&] {
    std::vector<UniqueFd> held;
    while (!stop.load()) {
      UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(port));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      held.push_back(std::move(fd));
      ++opened;
      if (held.size() > 600) held.erase(held.begin(), held.begin() + 100);
      std::this_thread::sleep_for(200us);
    }
  });
  // Bounded: should the flood stall (connect or socket blocking), the test
  // fails instead of waiting for ever.
  for (const Deadline until = DeadlineIn(30s); opened.load() < 300 && Clock::now() < until;) {
    std::this_thread::sleep_for(1ms);
  }
  if (opened.load() < 300) {
    stop = true;
    flood.join();
    FAIL() << "the flood opened only " << opened.load() << " connections in 30 s";
  }

  constexpr int kRanks = 4;
  std::vector<Status> results(kRanks);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      results[r] = [&]() -> Status {
        const Deadline deadline = DeadlineIn(30s);
        DDP_ASSIGN_OR_RETURN(auto client,
                             TcpStoreClient::Connect("127.0.0.1", port, kToken, deadline));
        DDP_RETURN_IF_ERROR(client->Set("rank/" + std::to_string(r), "up", deadline));
        std::vector<std::string> keys;
        for (int peer = 0; peer < kRanks; ++peer) keys.push_back("rank/" + std::to_string(peer));
        return client->Wait(keys, deadline);
      }();
    });
  }
  for (auto& t : ranks) t.join();
  stop = true;
  flood.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r];

  auto done = TcpStoreClient::Connect("127.0.0.1", port, kToken, DeadlineIn(30s));
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE((*done)->Set("done", "1", DeadlineIn(10s)).ok());
  const auto run = launch_testing::WaitProgram(**server, 30s);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::printf("flood: %d connections opened; store process: %s", opened.load(),
              run.output.c_str());
  unsigned long long accepted = 0, authenticated = 0, evicted = 0;
  ASSERT_EQ(std::sscanf(run.output.c_str(), "accepted %llu authenticated %llu evicted %llu",
                        &accepted, &authenticated, &evicted),
            3)
      << run.output;
  // The ranks, the checker and the server's own client got in; the flood
  // was evicted to make room.
  EXPECT_EQ(authenticated, static_cast<unsigned long long>(kRanks + 2));
  EXPECT_GT(evicted, 0u);
}

}  // namespace
}  // namespace ddp::transport
