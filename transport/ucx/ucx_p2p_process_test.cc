// UcxPointToPoint between this test and a copy of it spawned as rank 1
// (DDP_TEST_SCENARIO names what the copy runs), over TCP with peer error
// handling, the way ranks on different hosts talk. The test stops rank 1
// with SIGSTOP in the middle of a large message, so that a wait gives up
// while UCX still holds a request that uses the caller's buffer. One test
// spawns several copies, all stopped, to give up sends to all at once.

#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "transport/fault/peer_monitor.h"
#include "transport/testing/in_memory_store.h"
#include "transport/testing/process_group.h"
#include "transport/ucx/resources.h"
#include "transport/ucx/ucx_p2p.h"

namespace ddp::transport::ucx {
namespace {

using std::chrono::milliseconds;
using testing::EnvOr;
using testing::ProcessGroup;

// Large enough that TCP's socket buffers (a few MiB) hold only a part.
constexpr size_t kMessageBytes = size_t{64} << 20;
constexpr p2p::Tag kTag = 1;
constexpr uint8_t kPayload = 0xAB;   // what rank 1 sends, or rank 0 sends
constexpr uint8_t kSentinel = 0x5A;  // what rank 0 writes after the wait failed

std::string Hex(const std::string& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string Unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  }
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Rank `rank` of two over TCP; the other rank is remote (peer error mode).
std::unique_ptr<UcxPointToPoint> MakeRank(int rank,
                                          milliseconds recall_grace = milliseconds(100)) {
  auto context = Context::Create({.default_tls = "tcp,self"});
  if (!context.ok()) return nullptr;
  auto p2p = UcxPointToPoint::Create(*context,
                                     {.rank = rank, .size = 2, .recall_grace = recall_grace});
  if (!p2p.ok()) return nullptr;
  return std::move(*p2p);
}

std::vector<bool> SameHost(int rank) {
  std::vector<bool> same_host(2, false);
  same_host[rank] = true;
  return same_host;
}

// ------------------------------------------------------------ rank 1 ----

// Rank 1: connects to rank 0 (DDP_PEER_ADDRESS), posts its part of the
// message (DDP_ROLE: "send" sends it, "receive" receives it; of
// DDP_MESSAGE_BYTES bytes, kMessageBytes when unset), then
// publishes its address in DDP_ADDRESS_FILE and waits until the message
// completes or fails, or rank 0 creates DDP_DONE_FILE (the watchdog).
int RunRank1(const std::string& role) {
  std::unique_ptr<UcxPointToPoint> p2p = MakeRank(1);
  WORKER_CHECK(p2p != nullptr, "creating rank 1");
  if (p2p == nullptr) return 1;
  const std::string addresses[] = {Unhex(EnvOr("DDP_PEER_ADDRESS")), p2p->address()};
  Status connected = p2p->Connect(addresses, SameHost(1));
  WORKER_CHECK(connected.ok(), "connect: " + connected.ToString());
  if (!connected.ok()) return 1;
  const std::string done_file = EnvOr("DDP_DONE_FILE");
  p2p->SetWatchdog([done_file](Deadline, std::span<const int>) -> Status {
    if (std::filesystem::exists(done_file)) return AbortedError("rank 0 is done");
    return Status::Ok();
  });
  const size_t bytes =
      std::stoull(EnvOr("DDP_MESSAGE_BYTES", std::to_string(kMessageBytes).c_str()));
  std::vector<uint8_t> buffer(bytes, role == "send" ? kPayload : 0);
  auto id = role == "send" ? p2p->PostSend(0, kTag, buffer.data(), buffer.size())
                           : p2p->PostRecv(0, kTag, buffer.data(), buffer.size());
  WORKER_CHECK(id.ok(), "post: " + id.status().ToString());
  if (!id.ok()) return 1;
  const std::string address_file = EnvOr("DDP_ADDRESS_FILE");
  std::ofstream(address_file + ".tmp") << Hex(p2p->address());
  std::filesystem::rename(address_file + ".tmp", address_file);
  p2p::RequestId ids[] = {*id};
  Status s = p2p->WaitAll(ids, DeadlineIn(milliseconds(30000)));
  std::printf("rank 1 %s: %s\n", role.c_str(), s.ToString().c_str());
  if (role == "receive" && s.ok()) {
    // Whatever arrived must be what rank 0 sent, never what it wrote into
    // its buffer after its wait had failed.
    const size_t sentinels = std::count(buffer.begin(), buffer.end(), kSentinel);
    WORKER_CHECK(sentinels == 0, "received " + std::to_string(sentinels) +
                                     " bytes that rank 0 wrote after its send had failed");
  }
  p2p->Close(DeadlineIn(milliseconds(2000))).IgnoreError();
  return testing::worker_failures == 0 ? 0 : 1;
}

// Waits (up to 20 s) until DDP_GO_FILE exists.
void AwaitGoFile() {
  const std::string go_file = EnvOr("DDP_GO_FILE");
  const Deadline deadline = DeadlineIn(milliseconds(20000));
  while (!std::filesystem::exists(go_file) && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(1));
  }
}

// Rank 2 of three on this host (over shared memory; it talks to rank 0
// alone): publishes its address in DDP_ADDRESS_FILE, and once DDP_GO_FILE
// exists sends kPayload to rank 0 and exits.
int RunRank2SendThenExit() {
  auto context = Context::Create({.default_tls = "sm,self"});
  WORKER_CHECK(context.ok(), "context: " + context.status().ToString());
  if (!context.ok()) return 1;
  auto p2p = UcxPointToPoint::Create(*context, {.rank = 2, .size = 3});
  WORKER_CHECK(p2p.ok(), "create: " + p2p.status().ToString());
  if (!p2p.ok()) return 1;
  const std::string own = (*p2p)->address();
  const std::string addresses[] = {Unhex(EnvOr("DDP_PEER_ADDRESS")), own, own};
  Status connected = (*p2p)->Connect(addresses);
  WORKER_CHECK(connected.ok(), "connect: " + connected.ToString());
  if (!connected.ok()) return 1;
  const std::string address_file = EnvOr("DDP_ADDRESS_FILE");
  std::ofstream(address_file + ".tmp") << Hex(own);
  std::filesystem::rename(address_file + ".tmp", address_file);
  AwaitGoFile();
  uint8_t payload = kPayload;
  auto id = (*p2p)->PostSend(0, kTag, &payload, sizeof(payload));
  WORKER_CHECK(id.ok(), "post: " + id.status().ToString());
  if (!id.ok()) return 1;
  p2p::RequestId ids[] = {*id};
  Status sent = (*p2p)->WaitAll(ids, DeadlineIn(milliseconds(10000)));
  WORKER_CHECK(sent.ok(), "send: " + sent.ToString());
  (*p2p)->Close(DeadlineIn(milliseconds(2000))).IgnoreError();
  return testing::worker_failures == 0 ? 0 : 1;
}

// Rank 1: publishes its address in DDP_ADDRESS_FILE and stops itself
// (SIGSTOP) before its worker makes any progress or sends anything: rank 0's
// connection request goes unanswered. Once continued it connects to rank 0
// (DDP_PEER_ADDRESS), closes and exits.
int RunRank1StopBeforeConnect() {
  std::unique_ptr<UcxPointToPoint> p2p = MakeRank(1);
  WORKER_CHECK(p2p != nullptr, "creating rank 1");
  if (p2p == nullptr) return 1;
  const std::string address_file = EnvOr("DDP_ADDRESS_FILE");
  std::ofstream(address_file + ".tmp") << Hex(p2p->address());
  std::filesystem::rename(address_file + ".tmp", address_file);
  raise(SIGSTOP);
  const std::string addresses[] = {Unhex(EnvOr("DDP_PEER_ADDRESS")), p2p->address()};
  Status connected = p2p->Connect(addresses, SameHost(1));
  WORKER_CHECK(connected.ok(), "connect: " + connected.ToString());
  p2p->Close(DeadlineIn(milliseconds(2000)), /*force_remote=*/true).IgnoreError();
  return testing::worker_failures == 0 ? 0 : 1;
}

int RunScenario(const std::string& name) {
  if (name == "rank1_send") return RunRank1("send");
  if (name == "rank1_stop_before_connect") return RunRank1StopBeforeConnect();
  if (name == "rank1_receive") return RunRank1("receive");
  if (name == "rank2_send_then_exit") return RunRank2SendThenExit();
  if (name == "exit_when_told") {
    AwaitGoFile();
    return 0;
  }
  std::fprintf(stderr, "unknown scenario %s\n", name.c_str());
  return 2;
}

// ------------------------------------------------------------ rank 0 ----

// Rank 0 in this process, rank 1 a spawned copy running `scenario`,
// connected; the destructor kills rank 1 if it still runs.
struct TwoRanks {
  std::unique_ptr<UcxPointToPoint> p2p;
  std::unique_ptr<ProcessGroup> group;
  std::string address_file;
  std::string done_file;

  ~TwoRanks() {
    std::filesystem::remove(address_file);
    std::filesystem::remove(done_file);
  }

  // Lets rank 1 finish and returns its result.
  testing::WorkerResult Finish() {
    group->Kill(0, SIGCONT);
    std::ofstream(done_file) << "done";
    return group->Wait(DeadlineIn(milliseconds(20000)))[0];
  }
};

void Connect(const std::string& scenario, TwoRanks& ranks,
             milliseconds recall_grace = milliseconds(100)) {
  ranks.p2p = MakeRank(0, recall_grace);
  ASSERT_NE(ranks.p2p, nullptr);
  const std::string dir = EnvOr("TEST_TMPDIR", "/tmp");
  const std::string stem = dir + "/" + scenario + "." + std::to_string(getpid());
  ranks.address_file = stem + ".address";
  ranks.done_file = stem + ".done";
  const std::string& address_file = ranks.address_file;
  std::filesystem::remove(address_file);
  std::filesystem::remove(ranks.done_file);
  auto group = ProcessGroup::Spawn(1, {},
                                   {{"DDP_TEST_SCENARIO", scenario},
                                    {"DDP_PEER_ADDRESS", Hex(ranks.p2p->address())},
                                    {"DDP_ADDRESS_FILE", address_file},
                                    {"DDP_DONE_FILE", ranks.done_file}},
                                   testing::FreePort());
  ASSERT_TRUE(group.ok()) << group.status();
  ranks.group = std::move(*group);
  const Deadline deadline = DeadlineIn(milliseconds(20000));
  while (!std::filesystem::exists(address_file) && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_TRUE(std::filesystem::exists(address_file)) << "rank 1 did not start";
  const std::string addresses[] = {ranks.p2p->address(), Unhex(ReadFile(address_file))};
  Status connected = ranks.p2p->Connect(addresses, SameHost(0));
  ASSERT_TRUE(connected.ok()) << connected;
}

// A wait that gives up on a stopped peer returns 20 ms past its deadline
// plus a progress pass; the tests allow it kLateReturn more, room for a
// host where 4 test actions share 2 cores (each with a spinning rank 0).
// The waits whose bound matters (the recall grace cut at the deadline) use
// a grace of kLongGrace, twice that room, so that a grace not cut still
// fails them.
constexpr milliseconds kLateReturn(5000);
constexpr milliseconds kLongGrace(10000);

// Waits 300 ms for `id`, whose peer is stopped: the wait times out, and
// returns (within kLateReturn: it does not wait for the peer).
void ExpectWaitTimesOut(UcxPointToPoint& p2p, p2p::RequestId id) {
  p2p::RequestId ids[] = {id};
  const auto start = Clock::now();
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(300)));
  const auto waited = Clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  EXPECT_LT(waited, milliseconds(300) + kLateReturn);
}

// Keeps rank 0's worker busy for `time` (a wait for a message to itself
// that never comes): whatever UCX still does with a request happens now.
void Progress(UcxPointToPoint& p2p, milliseconds time) {
  int unused = 0;
  auto id = p2p.PostRecv(0, 99, &unused, sizeof(unused));
  ASSERT_TRUE(id.ok()) << id.status();
  p2p::RequestId ids[] = {*id};
  EXPECT_EQ(p2p.WaitAll(ids, DeadlineIn(time)).code(), StatusCode::kTimedOut);
}

// Stops rank 1, which has posted its receive, and posts rank 0's send of
// `out` (kMessageBytes) to it: the send waits for rank 1, with the buffer
// in UCX's hands.
StatusOr<p2p::RequestId> StopRank1AndPostSend(TwoRanks& ranks, std::vector<uint8_t>& out) {
  ranks.group->Kill(0, SIGSTOP);
  out.assign(kMessageBytes, kPayload);
  return ranks.p2p->PostSend(1, kTag, out.data(), out.size());
}

// Closes rank 0 (within 2 s), lets rank 1 finish and expects both to
// succeed; returns rank 1's result.
testing::WorkerResult CloseAndFinish(TwoRanks& ranks) {
  Status closed = ranks.p2p->Close(DeadlineIn(milliseconds(2000)));
  EXPECT_TRUE(closed.ok()) << closed;
  testing::WorkerResult rank1 = ranks.Finish();
  EXPECT_EQ(rank1.exit_code, 0) << rank1.output;
  return rank1;
}

TEST(UcxPointToPointProcesses, ReceiveThatTimedOutMidMessageNeverWritesAfterwards) {
  TwoRanks ranks;
  ASSERT_NO_FATAL_FAILURE(Connect("rank1_send", ranks));
  UcxPointToPoint& p2p = *ranks.p2p;
  std::vector<uint8_t> in(kMessageBytes, 0);
  auto id = p2p.PostRecv(1, kTag, in.data(), in.size());
  ASSERT_TRUE(id.ok()) << id.status();
  // Stop rank 1 as soon as the message has begun to arrive: the receive is
  // matched, and most of the message is still to come.
  const Deadline deadline = DeadlineIn(milliseconds(20000));
  while (in[0] == 0 && Clock::now() < deadline) {
    auto done = p2p.Test(*id);
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_FALSE(*done) << "the whole message arrived before rank 1 could be stopped";
  }
  ASSERT_EQ(in[0], kPayload) << "nothing arrived from rank 1";
  ranks.group->Kill(0, SIGSTOP);
  ExpectWaitTimesOut(p2p, *id);
  ASSERT_EQ(in.back(), 0) << "the message completed although rank 1 was stopped";
  // The caller owns the buffer again: nothing may write into it now, also
  // once rank 1 sends the rest.
  std::fill(in.begin(), in.end(), kSentinel);
  ranks.group->Kill(0, SIGCONT);
  Progress(p2p, milliseconds(1000));
  EXPECT_EQ(static_cast<size_t>(std::count(in.begin(), in.end(), kSentinel)), in.size())
      << "the abandoned receive wrote into the buffer after WaitAll returned";
  // Its endpoint was closed to get the receive back: rank 1 is lost.
  int v = 0;
  Status later = p2p.PostSend(1, 2, &v, sizeof(v)).status();
  EXPECT_EQ(later.code(), StatusCode::kPeerLost) << later;
  EXPECT_NE(later.message().find("rank 1"), std::string::npos) << later;
  const auto close_start = Clock::now();
  Status closed = p2p.Close(DeadlineIn(milliseconds(2000)));
  EXPECT_TRUE(closed.ok()) << closed;
  EXPECT_LT(Clock::now() - close_start, milliseconds(3000));
  EXPECT_EQ(static_cast<size_t>(std::count(in.begin(), in.end(), kSentinel)), in.size());
  testing::WorkerResult rank1 = ranks.Finish();
  EXPECT_EQ(rank1.signal, 0) << rank1.output;
}

// A receive posted after its peer was marked lost still takes what the
// peer sent before (see Recv); here that is the start of a rendezvous
// (rank 1, stopped, has announced its message but sent none of the data),
// so the receive matches it and cannot finish. The post gives it up and
// fails PEER_LOST; nothing writes into the buffer afterwards.
TEST(UcxPointToPointProcesses, AReceiveFromALostPeerMidRendezvousFailsAndNeverWritesAfterwards) {
  TwoRanks ranks;
  ASSERT_NO_FATAL_FAILURE(Connect("rank1_send", ranks));
  UcxPointToPoint& p2p = *ranks.p2p;
  // Rank 1's announcement of its send reaches rank 0's worker.
  Progress(p2p, milliseconds(300));
  ranks.group->Kill(0, SIGSTOP);
  p2p.MarkPeerLost(1, PeerLostError("rank 1 marked lost by the test"));
  std::vector<uint8_t> in(kMessageBytes, 0);
  auto id = p2p.PostRecv(1, kTag, in.data(), in.size());
  EXPECT_EQ(id.status().code(), StatusCode::kPeerLost) << id.status();
  std::fill(in.begin(), in.end(), kSentinel);
  ranks.group->Kill(0, SIGCONT);
  Progress(p2p, milliseconds(500));
  EXPECT_EQ(static_cast<size_t>(std::count(in.begin(), in.end(), kSentinel)), in.size())
      << "the given-up receive wrote into the buffer after its post returned";
  p2p.Close(DeadlineIn(milliseconds(2000))).IgnoreError();
  testing::WorkerResult rank1 = ranks.Finish();
  EXPECT_EQ(rank1.signal, 0) << rank1.output;
}

TEST(UcxPointToPointProcesses, SendThatTimedOutNeverReadsAfterwards) {
  TwoRanks ranks;
  ASSERT_NO_FATAL_FAILURE(Connect("rank1_receive", ranks));
  UcxPointToPoint& p2p = *ranks.p2p;
  // Rank 1 is stopped before the message goes.
  std::vector<uint8_t> out;
  auto id = StopRank1AndPostSend(ranks, out);
  ASSERT_TRUE(id.ok()) << id.status();
  ExpectWaitTimesOut(p2p, *id);
  // The caller reuses the buffer; rank 1 runs again and must never receive
  // what was written into it after the send had failed.
  std::fill(out.begin(), out.end(), kSentinel);
  ranks.group->Kill(0, SIGCONT);
  Progress(p2p, milliseconds(1000));
  int v = 0;
  Status later = p2p.PostSend(1, 2, &v, sizeof(v)).status();
  EXPECT_EQ(later.code(), StatusCode::kPeerLost) << later;
  testing::WorkerResult rank1 = CloseAndFinish(ranks);
  EXPECT_EQ(rank1.signal, 0) << rank1.output;
}

// A wait that times out returns soon after its deadline however long the
// recall grace is: the grace is cut at the deadline, and the forced close
// of the stopped peer's endpoint follows within a bounded overrun.
TEST(UcxPointToPointProcesses, WaitThatTimedOutReturnsSoonAfterItsDeadline) {
  TwoRanks ranks;
  ASSERT_NO_FATAL_FAILURE(Connect("rank1_receive", ranks, /*recall_grace=*/kLongGrace));
  UcxPointToPoint& p2p = *ranks.p2p;
  std::vector<uint8_t> out;
  auto id = StopRank1AndPostSend(ranks, out);
  ASSERT_TRUE(id.ok()) << id.status();
  p2p::RequestId ids[] = {*id};
  const auto start = Clock::now();
  Status s = p2p.WaitAll(ids, DeadlineIn(milliseconds(50)));
  const auto waited = Clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kTimedOut) << s;
  // 50 ms deadline + 20 ms overrun, with room for a loaded machine; the
  // 10 s grace would be far past it.
  EXPECT_LT(waited, milliseconds(50) + kLateReturn);
  std::fill(out.begin(), out.end(), kSentinel);
  ranks.group->Kill(0, SIGCONT);
  Progress(p2p, milliseconds(500));
  CloseAndFinish(ranks);
}

// A Cancel run by the watchdog (as the communicator's does) waits no longer
// than the wait that runs the watchdog may: that wait still returns near
// its deadline. The deadline, 1 s, leaves the watchdog time to run on a
// loaded host (with 50 ms, beside three busy loops, the wait's first clock
// read came after its deadline in 3 of 20 runs, and the watchdog never ran); 1 s
// plus kLateReturn stays well below the 10 s grace that the Cancel would
// otherwise take.
TEST(UcxPointToPointProcesses, CancelInsideTheWatchdogKeepsTheWaitsDeadline) {
  TwoRanks ranks;
  ASSERT_NO_FATAL_FAILURE(Connect("rank1_receive", ranks, /*recall_grace=*/kLongGrace));
  UcxPointToPoint& p2p = *ranks.p2p;
  std::vector<uint8_t> out;
  auto id = StopRank1AndPostSend(ranks, out);
  std::vector<uint8_t> other(size_t{3} << 20, kPayload);
  ASSERT_TRUE(id.ok()) << id.status();
  auto other_id = p2p.PostSend(1, kTag + 1, other.data(), other.size());
  ASSERT_TRUE(other_id.ok()) << other_id.status();
  bool cancelled = false;
  p2p.SetWatchdog([&](Deadline, std::span<const int>) {
    if (!cancelled) p2p.Cancel(*other_id);
    cancelled = true;
    return Status::Ok();
  });
  p2p::RequestId ids[] = {*id};
  const auto start = Clock::now();
  constexpr milliseconds kWait(1000);
  Status s = p2p.WaitAll(ids, DeadlineIn(kWait));
  const auto waited = Clock::now() - start;
  EXPECT_TRUE(cancelled);
  EXPECT_FALSE(s.ok());
  EXPECT_LT(waited, kWait + kLateReturn) << s;
  p2p.SetWatchdog(nullptr);
  ranks.group->Kill(0, SIGCONT);
  CloseAndFinish(ranks);
}

// Rank 0 of kPeers + 1 in this process; the others are spawned copies each
// running RunRank1("receive") as rank 1 of its own pair with rank 0 (a
// receive from rank 0 matches rank 0's send to it under any rank number:
// the tag carries the sender's rank). Every one is remote to rank 0 (peer
// error mode), as on other hosts.
struct ManyRanks {
  std::unique_ptr<UcxPointToPoint> p2p;
  std::unique_ptr<ProcessGroup> group;
  std::vector<std::string> address_files;
  std::string done_file;
  int peers = 0;

  ~ManyRanks() {
    for (const std::string& file : address_files) std::filesystem::remove(file);
    std::filesystem::remove(done_file);
  }

  void Signal(int signal) {
    for (int i = 0; i < peers; ++i) group->Kill(i, signal);
  }

  std::vector<testing::WorkerResult> Finish() {
    Signal(SIGCONT);
    std::ofstream(done_file) << "done";
    return group->Wait(DeadlineIn(milliseconds(20000)));
  }
};

void ConnectMany(int peers, size_t message_bytes, ManyRanks& ranks, milliseconds recall_grace) {
  const int size = peers + 1;
  ranks.peers = peers;
  auto context = Context::Create({.default_tls = "tcp,self"});
  ASSERT_TRUE(context.ok()) << context.status();
  auto p2p = UcxPointToPoint::Create(*context, {.rank = 0, .size = size, .recall_grace = recall_grace});
  ASSERT_TRUE(p2p.ok()) << p2p.status();
  ranks.p2p = std::move(*p2p);
  const std::string dir = EnvOr("TEST_TMPDIR", "/tmp");
  const std::string stem = dir + "/many." + std::to_string(getpid());
  ranks.done_file = stem + ".done";
  std::filesystem::remove(ranks.done_file);
  std::map<int, ProcessGroup::Env> rank_env;
  for (int i = 0; i < peers; ++i) {
    ranks.address_files.push_back(stem + "." + std::to_string(i) + ".address");
    std::filesystem::remove(ranks.address_files.back());
    rank_env[i] = {{"DDP_ADDRESS_FILE", ranks.address_files.back()}};
  }
  auto group = ProcessGroup::Spawn(peers, {},
                                   {{"DDP_TEST_SCENARIO", "rank1_receive"},
                                    {"DDP_PEER_ADDRESS", Hex(ranks.p2p->address())},
                                    {"DDP_DONE_FILE", ranks.done_file},
                                    {"DDP_MESSAGE_BYTES", std::to_string(message_bytes)}},
                                   testing::FreePort(), rank_env);
  ASSERT_TRUE(group.ok()) << group.status();
  ranks.group = std::move(*group);
  std::vector<std::string> addresses = {ranks.p2p->address()};
  const Deadline deadline = DeadlineIn(milliseconds(30000));
  for (const std::string& file : ranks.address_files) {
    while (!std::filesystem::exists(file) && Clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    ASSERT_TRUE(std::filesystem::exists(file)) << "a peer did not start";
    addresses.push_back(Unhex(ReadFile(file)));
  }
  std::vector<bool> same_host(size, false);
  same_host[0] = true;
  Status connected = ranks.p2p->Connect(addresses, same_host);
  ASSERT_TRUE(connected.ok()) << connected;
}

// Several remote peers hang (stopped) with rank 0's rendezvous sends to
// them under way. CancelAll gets every send back within one grace (1 s
// here) and one round of forced closes (bounded by 1 s, a few ms here),
// where a loop of Cancel took a grace and a forced close per peer in turn
// (8 x 1 s at least); afterwards nothing reads the buffers.
TEST(UcxPointToPointProcesses, CancelAllGetsSendsToHungPeersBackInOneRound) {
  constexpr int kPeers = 8;
  constexpr milliseconds kGrace(1000);
  // Above UCX's rendezvous threshold: no data goes before the stopped peer
  // answers.
  constexpr size_t kBytes = size_t{4} << 20;
  ManyRanks ranks;
  ASSERT_NO_FATAL_FAILURE(ConnectMany(kPeers, kBytes, ranks, kGrace));
  UcxPointToPoint& p2p = *ranks.p2p;
  // Every peer has posted its receive; all are stopped before data goes.
  ranks.Signal(SIGSTOP);
  std::vector<std::vector<uint8_t>> out(kPeers, std::vector<uint8_t>(kBytes, kPayload));
  std::vector<p2p::RequestId> ids;
  for (int peer = 1; peer <= kPeers; ++peer) {
    auto id = p2p.PostSend(peer, kTag, out[peer - 1].data(), kBytes);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  // Under way: what the sockets take is gone, the rest waits.
  Progress(p2p, milliseconds(300));
  for (p2p::RequestId id : ids) {
    auto done = p2p.Test(id);
    ASSERT_TRUE(done.ok() && !*done) << "a send completed to a stopped peer";
  }
  const auto start = Clock::now();
  p2p.CancelAll(ids);
  const auto took = Clock::now() - start;
  std::printf("CancelAll of sends to %d hung peers: %lld ms\n", kPeers,
              static_cast<long long>(
                  std::chrono::duration_cast<milliseconds>(took).count()));
  // Half of a grace per peer: one grace and a round of forced closes on a
  // loaded machine stay well below it.
  EXPECT_LT(took, kPeers * kGrace / 2) << "the peers were waited for one at a time";
  // The buffers are the caller's again: rank 0 reuses them, the peers run
  // again and must never receive what it wrote.
  for (auto& buffer : out) std::fill(buffer.begin(), buffer.end(), kSentinel);
  ranks.Signal(SIGCONT);
  Progress(p2p, milliseconds(1000));
  for (int peer = 1; peer <= kPeers; ++peer) {
    int v = 0;
    Status later = p2p.PostSend(peer, 2, &v, sizeof(v)).status();
    EXPECT_EQ(later.code(), StatusCode::kPeerLost) << later;
  }
  Status closed = p2p.Close(DeadlineIn(milliseconds(2000)));
  EXPECT_TRUE(closed.ok()) << closed;
  std::vector<testing::WorkerResult> results = ranks.Finish();
  for (const testing::WorkerResult& result : results) {
    EXPECT_EQ(result.exit_code, 0) << result.output;
    EXPECT_EQ(result.signal, 0) << result.output;
  }
}

// Rank 1, remote, stops itself before it answers rank 0's connection, and
// rank 0 closes normally (a flush first): the flush cannot finish, so Close
// gives up on it at its deadline and closes the endpoint by force (bounded
// by 1 s more), rather than leaving it closing when the worker is
// destroyed, which UCX 1.13 does not support. Close names the forced close;
// the destructor and rank 1, once continued, finish cleanly.
TEST(UcxPointToPointProcesses, CloseForcesARemoteEndpointWhoseFlushDidNotFinish) {
  TwoRanks ranks;
  ASSERT_NO_FATAL_FAILURE(Connect("rank1_stop_before_connect", ranks));
  // Rank 1 has stopped ('T' in /proc/PID/stat), and rank 0's connection
  // request is out (its TCP connection is made while rank 0 progresses):
  // the flush waits for rank 1's answer.
  const std::string stat = "/proc/" + std::to_string(ranks.group->pid(0)) + "/stat";
  const Deadline deadline = DeadlineIn(milliseconds(20000));
  while (ReadFile(stat).find(") T ") == std::string::npos && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  ASSERT_NE(ReadFile(stat).find(") T "), std::string::npos) << "rank 1 did not stop";
  Progress(*ranks.p2p, milliseconds(300));
  const auto start = Clock::now();
  Status closed = ranks.p2p->Close(DeadlineIn(milliseconds(1000)));
  const auto took = Clock::now() - start;
  EXPECT_EQ(closed.code(), StatusCode::kTimedOut) << closed;
  EXPECT_NE(closed.message().find("rank(s) 1 did not take what was sent in time; closed by force"),
            std::string::npos)
      << closed;
  EXPECT_LT(took, milliseconds(3000));
  ranks.p2p.reset();
  testing::WorkerResult rank1 = ranks.Finish();
  EXPECT_EQ(rank1.exit_code, 0) << rank1.output;
  EXPECT_EQ(rank1.signal, 0) << rank1.output;
}

// Rank 0 of three on this host, over shared memory, waits for a message
// from rank 1 or rank 2 (WaitAny). Rank 2, a spawned copy, sends and exits
// while rank 0 is inside its watchdog, which then reports rank 2 gone: the
// drain after the report takes in rank 2's message, and the wait returns
// it. (It returned PEER_LOST: the drain only counted when it completed the
// first request listed.) The watchdog hears of both peers waited for.
TEST(UcxPointToPointProcesses, WaitAnyReturnsWhatAPeerSentBeforeTheWatchdogFoundItGone) {
  auto context = Context::Create({.default_tls = "sm,self"});
  ASSERT_TRUE(context.ok()) << context.status();
  auto created = UcxPointToPoint::Create(*context, {.rank = 0, .size = 3});
  ASSERT_TRUE(created.ok()) << created.status();
  UcxPointToPoint& p2p = **created;
  const std::string stem = EnvOr("TEST_TMPDIR", "/tmp") + "/wait_any." + std::to_string(getpid());
  const std::string address_file = stem + ".address", go_file = stem + ".go";
  std::filesystem::remove(address_file);
  std::filesystem::remove(go_file);
  auto group = ProcessGroup::Spawn(1, {},
                                   {{"DDP_TEST_SCENARIO", "rank2_send_then_exit"},
                                    {"DDP_PEER_ADDRESS", Hex(p2p.address())},
                                    {"DDP_ADDRESS_FILE", address_file},
                                    {"DDP_GO_FILE", go_file}},
                                   testing::FreePort());
  ASSERT_TRUE(group.ok()) << group.status();
  const Deadline started = DeadlineIn(milliseconds(20000));
  while (!std::filesystem::exists(address_file) && Clock::now() < started) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_TRUE(std::filesystem::exists(address_file)) << "rank 2 did not start";
  // Rank 1 is this process again: nothing ever comes from it.
  const std::string addresses[] = {p2p.address(), p2p.address(), Unhex(ReadFile(address_file))};
  ASSERT_TRUE(p2p.Connect(addresses).ok());
  uint8_t from1 = 0, from2 = 0;
  auto r1 = p2p.PostRecv(1, kTag, &from1, sizeof(from1));
  auto r2 = p2p.PostRecv(2, kTag, &from2, sizeof(from2));
  ASSERT_TRUE(r1.ok() && r2.ok()) << r1.status() << r2.status();
  int calls = 0;
  std::vector<int> awaited;
  testing::WorkerResult rank2;
  p2p.SetWatchdog([&](Deadline, std::span<const int> peers) -> Status {
    if (++calls == 1) {
      awaited.assign(peers.begin(), peers.end());
      // Rank 2 sends and exits while this rank makes no progress.
      std::ofstream(go_file) << "go";
      rank2 = (*group)->Wait(DeadlineIn(milliseconds(20000)))[0];
    }
    return PeerLostError("rank 2 exited");
  });
  p2p::RequestId ids[] = {*r1, *r2};
  StatusOr<size_t> index = p2p.WaitAny(ids, DeadlineIn(milliseconds(10000)));
  p2p.SetWatchdog(nullptr);
  EXPECT_EQ(rank2.exit_code, 0) << rank2.output;
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(*index, 1u);
  EXPECT_EQ(from2, kPayload);
  EXPECT_EQ(awaited, (std::vector<int>{1, 2}));
  p2p.Cancel(*r1);
  EXPECT_TRUE(p2p.Close(DeadlineIn(milliseconds(2000))).ok());
  std::filesystem::remove(address_file);
  std::filesystem::remove(go_file);
}

// A peer on this host that closed cleanly and exited is lost to a wait
// that needs something from it, also when another request is listed first:
// WaitAny on receives from ranks 1 and 2, with the job's PeerMonitor as the
// watchdog, fails within a watchdog period once rank 2 (a spawned process,
// marked closed) exits. The monitor used to hear only of rank 1 and skip
// rank 2 as closed, so the wait ran until its deadline.
// A watched receive (MarkWatched: a stop note that may come) from rank 2
// is another matter: with the receive from rank 1 still needed, the
// monitor does not hear of rank 2, nor does rank 2's loss fail the wait,
// which runs to its deadline naming rank 1. (A 4-rank job failed
// PEER_LOST when the ring predecessor a rank watched for a note had left
// cleanly while the rank still waited for data from another.) Alone, the
// watched receive fails as any other.
TEST(UcxPointToPointProcesses, WaitAnyFailsWhenALaterListedPeerClosedAndExited) {
  auto context = Context::Create({.default_tls = "sm,self"});
  ASSERT_TRUE(context.ok()) << context.status();
  auto created = UcxPointToPoint::Create(*context, {.rank = 0, .size = 3});
  ASSERT_TRUE(created.ok()) << created.status();
  UcxPointToPoint& p2p = **created;
  const std::string addresses[] = {p2p.address(), p2p.address(), p2p.address()};
  ASSERT_TRUE(p2p.Connect(addresses).ok());
  const std::string go_file =
      EnvOr("TEST_TMPDIR", "/tmp") + "/closed_peer." + std::to_string(getpid()) + ".go";
  std::filesystem::remove(go_file);
  auto group = ProcessGroup::Spawn(1, {}, {{"DDP_TEST_SCENARIO", "exit_when_told"},
                                           {"DDP_GO_FILE", go_file}},
                                   testing::FreePort());
  ASSERT_TRUE(group.ok()) << group.status();
  testing::InMemoryStore store;
  ASSERT_TRUE(store.Set("job/closed/2", "1", DeadlineIn(milliseconds(1000))).ok());
  fault::PeerMonitor monitor({.rank = 0, .local_pids = {getpid(), 0, (*group)->pid(0)},
                              .key_prefix = "job/"},
                             &store);
  std::ofstream(go_file) << "go";
  testing::WorkerResult rank2 = (*group)->Wait(DeadlineIn(milliseconds(20000)))[0];
  ASSERT_EQ(rank2.exit_code, 0) << rank2.output;
  p2p.SetWatchdog([&monitor](Deadline deadline, std::span<const int> peers) {
    return monitor.Check(deadline, peers);
  });
  int from1 = 0, from2 = 0;
  auto r1 = p2p.PostRecv(1, kTag, &from1, sizeof(from1));
  auto r2 = p2p.PostRecv(2, kTag, &from2, sizeof(from2));
  ASSERT_TRUE(r1.ok() && r2.ok()) << r1.status() << r2.status();
  p2p::RequestId ids[] = {*r1, *r2};
  const auto start = Clock::now();
  StatusOr<size_t> index = p2p.WaitAny(ids, DeadlineIn(milliseconds(3000)));
  const auto waited = Clock::now() - start;
  p2p.SetWatchdog(nullptr);
  EXPECT_EQ(index.status().code(), StatusCode::kPeerLost) << index.status();
  EXPECT_NE(index.status().message().find("rank 2"), std::string::npos) << index.status();
  EXPECT_LT(waited, milliseconds(2000));
  p2p.CancelAll(ids);

  std::vector<std::vector<int>> heard;
  // The monitor gets time of its own to read the closed marks: a round
  // just before the wait's deadline could no longer ask the store whether
  // rank 2 closed, and would report it.
  p2p.SetWatchdog([&](Deadline, std::span<const int> peers) {
    heard.emplace_back(peers.begin(), peers.end());
    return monitor.Check(DeadlineIn(milliseconds(1000)), peers);
  });
  auto needed = p2p.PostRecv(1, kTag, &from1, sizeof(from1));
  auto watched = p2p.PostRecv(2, kTag, &from2, sizeof(from2));
  ASSERT_TRUE(needed.ok() && watched.ok()) << needed.status() << watched.status();
  p2p.MarkWatched(*watched);
  p2p::RequestId both[] = {*needed, *watched};
  StatusOr<size_t> timed_out = p2p.WaitAny(both, DeadlineIn(milliseconds(1000)));
  EXPECT_EQ(timed_out.status().code(), StatusCode::kTimedOut) << timed_out.status();
  EXPECT_NE(timed_out.status().message().find("from rank 1"), std::string::npos)
      << timed_out.status();
  ASSERT_FALSE(heard.empty());
  for (const auto& peers : heard) EXPECT_EQ(peers, std::vector<int>{1});
  // The loss of the watched receive's peer as UCX would report it (an
  // endpoint error) fails the wait no more than the monitor's report.
  p2p.MarkPeerLost(2, PeerLostError("rank 2's endpoint failed"));
  timed_out = p2p.WaitAny(both, DeadlineIn(milliseconds(300)));
  EXPECT_EQ(timed_out.status().code(), StatusCode::kTimedOut) << timed_out.status();
  p2p::RequestId watched_only[] = {*watched};
  StatusOr<size_t> alone = p2p.WaitAny(watched_only, DeadlineIn(milliseconds(3000)));
  EXPECT_EQ(alone.status().code(), StatusCode::kPeerLost) << alone.status();
  p2p.SetWatchdog(nullptr);
  p2p.CancelAll(both);
  // Rank 2 marked lost: its endpoint closes by force, which Close reports.
  Status closed = p2p.Close(DeadlineIn(milliseconds(2000)));
  EXPECT_NE(closed.message().find("rank 2"), std::string::npos) << closed;
  std::filesystem::remove(go_file);
}

}  // namespace
}  // namespace ddp::transport::ucx

int main(int argc, char** argv) {
  return ddp::transport::testing::WorkerOrTestsMain(argc, argv,
                                                    ddp::transport::ucx::RunScenario);
}
