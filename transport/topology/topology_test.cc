#include "transport/topology/topology.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>


// This binary's fstat notes the descriptor flags (FD_CLOEXEC) of the
// descriptor it is asked about when that is open on `watched_path`, then
// asks the real one.
namespace {
std::atomic<bool> watching{false};
std::string watched_path;
std::atomic<int> watched_fd_flags{-1};

void NoteFlags(int fd) {
  if (!watching.load()) return;
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  char target[4096];
  const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
  if (n <= 0) return;
  if (std::string(target, static_cast<size_t>(n)) == watched_path) watched_fd_flags = ::fcntl(fd, F_GETFD);
}
}  // namespace

extern "C" int fstat(int fd, struct stat* buf) noexcept {
  NoteFlags(fd);
  using Real = int (*)(int, struct stat*);
  static const Real real = reinterpret_cast<Real>(::dlsym(RTLD_NEXT, "fstat"));
  return real(fd, buf);
}

extern "C" int fstat64(int fd, struct stat64* buf) noexcept {
  NoteFlags(fd);
  using Real = int (*)(int, struct stat64*);
  static const Real real = reinterpret_cast<Real>(::dlsym(RTLD_NEXT, "fstat64"));
  return real(fd, buf);
}

namespace ddp::transport::topology {
namespace {

Topology MustParse(const std::string& text) {
  auto t = ParseTopologyJson(text, "test.json");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : Topology{};
}

void ExpectError(const std::string& text, const std::string& fragment) {
  auto t = ParseTopologyJson(text, "bad.json");
  ASSERT_FALSE(t.ok()) << "accepted: " << text;
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find(fragment), std::string::npos)
      << "message '" << t.status().message() << "' lacks '" << fragment << "'";
  EXPECT_EQ(t.status().message().rfind("bad.json", 0), 0u) << t.status().message();
}

TEST(ParseTopologyJson, MinimalFile) {
  Topology t = MustParse(R"({"hosts": [{}], "ranks": [{"host": 0}, {"host": 0}]})");
  EXPECT_EQ(t.size(), 2);
  EXPECT_EQ(t.num_hosts(), 1);
  EXPECT_EQ(t.hosts[0].name, "host0");
  EXPECT_TRUE(t.SameHost(0, 1));
}

TEST(ParseTopologyJson, ErrorsNameTheField) {
  ExpectError("{", "not valid JSON");
  ExpectError("[]", "top level: expected an object");
  ExpectError(R"({"ranks": []})", "hosts: missing");
  ExpectError(R"({"hosts": [{}]})", "ranks: missing");
  ExpectError(R"({"hosts": {}, "ranks": []})", "hosts: expected an array, got object");
  ExpectError(R"({"hosts": [{}], "ranks": [{"host": "a"}]})",
              "ranks[0].host: expected an integer, got string");
  ExpectError(R"({"hosts": [{}], "ranks": [{"host": 0}, {}]})", "ranks[1].host: missing");
  ExpectError(R"({"hosts": [{}], "ranks": [{"host": 2}]})", "ranks[0].host: 2 is not a host index");
  ExpectError(R"({"hosts": [{"numa_nodes": 0}], "ranks": [{"host": 0}]})",
              "hosts[0].numa_nodes: 0 is out of range");
  ExpectError(R"({"hosts": [{"net_devices": [{"port": 1}]}], "ranks": [{"host": 0}]})",
              "hosts[0].net_devices[0].name: missing");
  ExpectError(R"({"hosts": [{"net_devices": [{"name": "m", "rate_gbps": "fast"}]}], "ranks": [{"host": 0}]})",
              "hosts[0].net_devices[0].rate_gbps: expected a number");
  ExpectError(R"({"hosts": [{"gpus": [{"nvlink_peers": [0]}]}], "ranks": [{"host": 0}]})",
              "hosts[0].gpus[0].nvlink_peers: 0 is not another GPU");
  ExpectError(R"({"hosts": [{"gpus": [{"nvlink_peers": [1]}, {}]}], "ranks": [{"host": 0}]})",
              "hosts[0].gpus[0].nvlink_peers lists 1, but hosts[0].gpus[1].nvlink_peers does not list 0: "
              "list each link from both ends");
  ExpectError(R"({"hosts": [{"gpus": [{"pci_bus_id": "0000:3b:00.0"}, {"pci_bus_id": "0000:3b:00.0"}]}],
                  "ranks": [{"host": 0}]})",
              "hosts[0].gpus[1].pci_bus_id: 0000:3b:00.0 is GPU 0's too");
  ExpectError(R"({"hosts": [{"gpus": [{"nvlink_peers": ["x"]}]}], "ranks": [{"host": 0}]})",
              "hosts[0].gpus[0].nvlink_peers[0]: expected an integer");
  ExpectError(R"({"hosts": [{}], "ranks": [{"host": 0, "gpu": 0}]})",
              "ranks[0].gpu: 0 but host 0 has 0 GPUs");
  ExpectError(R"({"hosts": [{}, {}], "ranks": [{"host": 0}]})", "hosts[1]: no rank runs");
  ExpectError(R"({"hosts": [{"nmua_nodes": 2}], "ranks": [{"host": 0}]})",
              "hosts[0].nmua_nodes: unknown field");
  ExpectError(R"({"hosts": [{"numa_nodes": 1}], "ranks": [{"host": 0, "numa_node": 1}]})",
              "ranks[0].numa_node: 1 but host 0 has 1 NUMA nodes");
}

// A host per rank pair, as ranks[r].host gives.
Topology HostsOf(const std::vector<int>& host_of_rank, const std::string& prefix) {
  Topology t;
  for (int h : host_of_rank) {
    while (t.num_hosts() <= h) t.hosts.push_back(Host{.name = prefix + std::to_string(t.num_hosts())});
    t.ranks.push_back(RankPlace{.host = h});
  }
  return t;
}

TEST(CheckDescribedHostsSplitReal, ADescribedHostMaySplitARealOneButNotJoinTwo) {
  const Topology one_machine = HostsOf({0, 0, 0, 0}, "real");
  EXPECT_TRUE(CheckDescribedHostsSplitReal(HostsOf({0, 0, 1, 1}, "file"), one_machine, "t.json").ok());
  const Topology two_machines = HostsOf({0, 1, 0, 1}, "real");  // cyclic placement
  EXPECT_TRUE(CheckDescribedHostsSplitReal(HostsOf({0, 1, 2, 3}, "file"), two_machines, "t.json").ok());
  const Status joined = CheckDescribedHostsSplitReal(HostsOf({0, 0, 1, 1}, "file"), two_machines, "t.json");
  EXPECT_EQ(joined.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(joined.message().find("t.json: ranks 0 and 1 are on one described host (\"file0\") but run on "
                                  "different hosts (\"real0\" and \"real1\")"),
            std::string::npos)
      << joined;
}

TEST(LoadTopologyFile, MissingFileIsNotFound) {
  auto t = LoadTopologyFile("/nonexistent/topology.json");
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("/nonexistent/topology.json"), std::string::npos);
  // Says why, so that a missing file is told from one that may not be read.
  EXPECT_NE(t.status().message().find(std::strerror(ENOENT)), std::string::npos) << t.status();
}

// DDP_TOPOLOGY_FILE naming a directory (a path missing its file name) is
// named as one, not parsed as an empty file ("not valid JSON").
TEST(LoadTopologyFile, DirectoryIsNamedAsOne) {
  const std::string dir = ::testing::TempDir();
  auto t = LoadTopologyFile(dir);
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("topology file " + dir + " cannot be read: " +
                                      std::strerror(EISDIR)),
            std::string::npos)
      << t.status();
}

// The bytes this process has read so far (/proc/self/io's rchar), or -1.
long long BytesReadSoFar() {
  std::ifstream io("/proc/self/io");
  std::string name;
  long long value = 0;
  while (io >> name >> value) {
    if (name == "rchar:") return value;
  }
  return -1;
}

// A path that never ends (DDP_TOPOLOGY_FILE=/dev/zero, a device) is refused
// naming the path and its type, before anything is read: it was read up to
// kMaxTopologyFileBytes, on every rank of the host, before its refusal.
TEST(LoadTopologyFile, ADeviceIsRefusedNamingItsTypeBeforeItIsRead) {
  const long long before = BytesReadSoFar();
  ASSERT_GE(before, 0) << "/proc/self/io has no rchar";
  auto t = LoadTopologyFile("/dev/zero");
  const long long read = BytesReadSoFar() - before;
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status();
  EXPECT_NE(t.status().message().find("topology file /dev/zero is a character device, not a regular file"),
            std::string::npos)
      << t.status();
  EXPECT_LT(read, 1 << 20);
}

// A FIFO (a pipe's path, or one left by some tool) is refused naming it,
// without waiting for a writer: the open blocked until one came.
TEST(LoadTopologyFile, AFifoIsRefusedWithoutWaitingForAWriter) {
  const std::string path = ::testing::TempDir() + "/topology_never_written.fifo";
  std::remove(path.c_str());
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  auto loaded = std::async(std::launch::async, [&] { return LoadTopologyFile(path); });
  const bool returned = loaded.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  if (!returned) {
    // Let the blocked reader go: a writer that writes nothing.
    const int writer = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (writer >= 0) ::close(writer);
  }
  auto t = loaded.get();
  std::remove(path.c_str());
  ASSERT_TRUE(returned) << "LoadTopologyFile waited 10 s for a writer";
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status();
  EXPECT_NE(t.status().message().find("topology file " + path + " is a FIFO, not a regular file"),
            std::string::npos)
      << t.status();
}

// A file over kMaxTopologyFileBytes is refused naming the path, its size
// and the limit, before anything is read (here a sparse file, which costs
// no disk): it was read up to the limit first.
TEST(LoadTopologyFile, AFileOverTheLimitIsRefusedBeforeItIsRead) {
  const std::string path = ::testing::TempDir() + "/topology_too_big.json";
  {
    std::ofstream(path) << "{}";
  }
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(kMaxTopologyFileBytes) + 1), 0) << std::strerror(errno);
  const long long before = BytesReadSoFar();
  ASSERT_GE(before, 0) << "/proc/self/io has no rchar";
  auto t = LoadTopologyFile(path);
  const long long read = BytesReadSoFar() - before;
  std::remove(path.c_str());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status();
  EXPECT_NE(t.status().message().find("topology file " + path + " holds " +
                                      std::to_string(kMaxTopologyFileBytes + 1) + " bytes, more than " +
                                      std::to_string(kMaxTopologyFileBytes) + " bytes"),
            std::string::npos)
      << t.status();
  EXPECT_LT(read, 1 << 20);
}

// The file is opened close-on-exec: a fork and exec on another thread of
// the host program meanwhile must not inherit it. Its descriptor's flags
// are taken when LoadTopologyFile asks its type (this binary's fstat).
TEST(LoadTopologyFile, OpensTheFileCloseOnExec) {
  const std::string path = ::testing::TempDir() + "/topology_cloexec.json";
  {
    std::ofstream(path) << "{}";
  }
  watched_path = std::filesystem::canonical(path).string();
  watched_fd_flags = -1;
  watching = true;
  LoadTopologyFile(path).status().IgnoreError();
  watching = false;
  std::remove(path.c_str());
  const int flags = watched_fd_flags.load();
  ASSERT_GE(flags, 0) << "the reader's descriptor was not seen";
  EXPECT_NE(flags & FD_CLOEXEC, 0) << flags;
}

TEST(LoadTopologyFile, RoundTripsThroughJson) {
  Topology t = MustParse(R"({"hosts": [
      {"name": "a", "numa_nodes": 2,
       "net_devices": [{"name": "mlx5_0", "port": 1, "numa_node": 1, "rate_gbps": 200}],
       "gpus": [{"numa_node": 0, "nvlink_peers": [1]}, {"numa_node": 1, "nvlink_peers": [0]}]}],
      "ranks": [{"host": 0, "gpu": 1, "numa_node": 1}, {"host": 0, "gpu": 0, "numa_node": 0}]})");
  const std::string path = ::testing::TempDir() + "/topo.json";
  std::ofstream(path) << TopologyToJson(t);
  auto back = LoadTopologyFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(TopologyToJson(*back), TopologyToJson(t));
  EXPECT_EQ(back->hosts[0].net_devices[0].rate_gbps, 200);
  EXPECT_EQ(back->hosts[0].gpus[1].nvlink_peers, std::vector<int>{0});
}

TEST(ParseTopologyJson, PciBusIdIsOptionalAndRoundTrips) {
  Topology t = MustParse(R"({"hosts": [{"gpus": [{"pci_bus_id": "0000:3b:00.0"}, {}]}],
      "ranks": [{"host": 0, "gpu": 0}]})");
  EXPECT_EQ(t.hosts[0].gpus[0].pci_bus_id, "0000:3b:00.0");
  EXPECT_EQ(t.hosts[0].gpus[1].pci_bus_id, "");
  const std::string json = TopologyToJson(t);
  EXPECT_EQ(json.find("pci_bus_id", json.find("pci_bus_id") + 1), std::string::npos)
      << "an unknown bus id is written: " << json;
  auto back = ParseTopologyJson(json, "round trip");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->hosts[0].gpus[0].pci_bus_id, "0000:3b:00.0");
  ExpectError(R"({"hosts": [{"gpus": [{"pci_bus_id": 3}]}], "ranks": [{"host": 0}]})",
              "hosts[0].gpus[0].pci_bus_id: expected a string");
}

TEST(Subset, KeepsTheChosenRanksInTheirNewOrderAndTheirHosts) {
  Topology t;
  t.hosts.resize(3);
  t.hosts[0].name = "a";
  t.hosts[1].name = "b";
  t.hosts[2].name = "c";
  t.hosts[2].gpus.resize(2);
  t.ranks = {{.host = 0}, {.host = 1}, {.host = 2, .gpu = 1}, {.host = 2, .gpu = 0}};
  auto part = Subset(t, {3, 0, 2});
  ASSERT_TRUE(part.ok()) << part.status();
  ASSERT_EQ(part->num_hosts(), 2);  // host "b" runs none of them
  EXPECT_EQ(part->hosts[0].name, "a");
  EXPECT_EQ(part->hosts[1].name, "c");
  EXPECT_EQ(part->hosts[1].gpus.size(), 2u);
  ASSERT_EQ(part->size(), 3);
  EXPECT_EQ(part->ranks[0].host, 1);
  EXPECT_EQ(part->ranks[0].gpu, 0);
  EXPECT_EQ(part->ranks[1].host, 0);
  EXPECT_EQ(part->ranks[2].gpu, 1);
  EXPECT_TRUE(part->Validate().ok());
  EXPECT_EQ(Subset(t, {0, 4}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(Subset(t, {1, 1}).status().message().find("rank 1 given twice"), std::string::npos);
}

TEST(RingOrder, InterleavedHostsLeaveEachHostOnce) {
  // Ranks alternate between two hosts (a round-robin scheduler): the natural
  // ring would cross the network on every hop; the ordered ring twice.
  Topology t = MustParse(R"({"hosts": [{"name": "a"}, {"name": "b"}], "ranks": [
      {"host": 0}, {"host": 1}, {"host": 0}, {"host": 1},
      {"host": 0}, {"host": 1}, {"host": 0}, {"host": 1}]})");
  EXPECT_EQ(RingOrder(t), (std::vector<int>{0, 2, 4, 6, 1, 3, 5, 7}));
  EXPECT_TRUE(t.Uniform());
}

TEST(RingOrder, FollowsNumaThenNvlinkPeers) {
  // Four GPUs where NVLink joins 0-2 and 1-3; GPUs 0 and 2 on NUMA 0.
  Topology t = MustParse(R"({"hosts": [{"numa_nodes": 2, "gpus": [
      {"numa_node": 0, "nvlink_peers": [2]}, {"numa_node": 1, "nvlink_peers": [3]},
      {"numa_node": 0, "nvlink_peers": [0]}, {"numa_node": 1, "nvlink_peers": [1]}]}],
      "ranks": [{"host": 0, "gpu": 0}, {"host": 0, "gpu": 1}, {"host": 0, "gpu": 2},
                {"host": 0, "gpu": 3}]})");
  EXPECT_EQ(RingOrder(t), (std::vector<int>{0, 2, 1, 3}));
}

TEST(RingOrder, NvlinkChainWithinOneNode) {
  // A chain 0-3-1-2 (all one NUMA node): the ring walks the chain.
  Topology t = MustParse(R"({"hosts": [{"gpus": [
      {"nvlink_peers": [3]}, {"nvlink_peers": [3, 2]}, {"nvlink_peers": [1]},
      {"nvlink_peers": [0, 1]}]}],
      "ranks": [{"host": 0, "gpu": 0}, {"host": 0, "gpu": 1}, {"host": 0, "gpu": 2},
                {"host": 0, "gpu": 3}]})");
  EXPECT_EQ(RingOrder(t), (std::vector<int>{0, 3, 1, 2}));
}

// The orders below are what the link costs force; each test says why.

TEST(RingOrder, PerformanceRanksPickTheNvlinkPairs) {
  // Four GPUs, every pair P2P-capable: NVLink (rank 0) joins 0-2 and 1-3,
  // PCIe (rank 1) the rest. Peer access alone cannot tell them apart; the
  // ranks make the ring use both NVLinks: GPUs 0, 2, 1, 3.
  // Ranks are placed on GPUs 3, 1, 0, 2.
  Topology t = MustParse(R"({"hosts": [{"gpus": [
      {"nvlink_peers": [1, 2, 3], "peer_perf_ranks": [1, 0, 1]},
      {"nvlink_peers": [0, 2, 3], "peer_perf_ranks": [1, 1, 0]},
      {"nvlink_peers": [0, 1, 3], "peer_perf_ranks": [0, 1, 1]},
      {"nvlink_peers": [0, 1, 2], "peer_perf_ranks": [1, 0, 1]}]}],
      "ranks": [{"host": 0, "gpu": 3}, {"host": 0, "gpu": 1}, {"host": 0, "gpu": 0},
                {"host": 0, "gpu": 2}]})");
  EXPECT_EQ(RingOrder(t), (std::vector<int>{2, 3, 1, 0}));  // GPUs 0, 2, 1, 3
  EXPECT_EQ(RingHopCost(t.hosts[0], 0, 2), 0);
  EXPECT_EQ(RingHopCost(t.hosts[0], 2, 1), 1);
}

TEST(RingOrder, TwoNvlinkPairsBridgedByPcieClosesOnPcie) {
  // NVLink pairs 0-1 and 2-3; PCIe P2P (rank 2) only between 1-2 and 3-0;
  // no peer access between 0-2 and 1-3 (through host memory: 1000). The
  // ring 0-1-2-3-0 has no host hop at all.
  Topology t = MustParse(R"({"hosts": [{"gpus": [
      {"nvlink_peers": [1, 3], "peer_perf_ranks": [0, 2]},
      {"nvlink_peers": [0, 2], "peer_perf_ranks": [0, 2]},
      {"nvlink_peers": [3, 1], "peer_perf_ranks": [0, 2]},
      {"nvlink_peers": [2, 0], "peer_perf_ranks": [0, 2]}]}],
      "ranks": [{"host": 0, "gpu": 2}, {"host": 0, "gpu": 0}, {"host": 0, "gpu": 3},
                {"host": 0, "gpu": 1}]})");
  EXPECT_EQ(RingOrder(t), (std::vector<int>{1, 3, 0, 2}));  // GPUs 0, 1, 2, 3
  EXPECT_EQ(RingHopCost(t.hosts[0], 0, 2), 1000);
}

TEST(RingOrder, RanksSharingAGpuAreAdjacent) {
  // Four ranks on two GPUs (two per GPU, as when ranks share a device),
  // placed alternately: each GPU's ranks stay together.
  Topology t = MustParse(R"({"hosts": [{"gpus": [{"nvlink_peers": [1]}, {"nvlink_peers": [0]}]}],
      "ranks": [{"host": 0, "gpu": 1}, {"host": 0, "gpu": 0}, {"host": 0, "gpu": 1},
                {"host": 0, "gpu": 0}]})");
  EXPECT_EQ(RingOrder(t), (std::vector<int>{1, 3, 0, 2}));
}

TEST(RingOrder, SeveralHostsOrderEachHostAsAnOpenPath) {
  // Host 0: a chain 0-1-2 of NVLinks (rank 0) plus a slow 2-0 peer link
  // (rank 5). As a closed ring the slow link would close it; the ring goes
  // on to host 1, so the host is a path and the best path is the chain.
  Topology t = MustParse(R"({"hosts": [
      {"gpus": [{"nvlink_peers": [1, 2], "peer_perf_ranks": [0, 5]},
                {"nvlink_peers": [0, 2], "peer_perf_ranks": [0, 0]},
                {"nvlink_peers": [1, 0], "peer_perf_ranks": [0, 5]}]},
      {"gpus": [{}]}],
      "ranks": [{"host": 1, "gpu": 0}, {"host": 0, "gpu": 2}, {"host": 0, "gpu": 0},
                {"host": 0, "gpu": 1}]})");
  EXPECT_EQ(RingOrder(t), (std::vector<int>{2, 3, 1, 0}));  // GPUs 0, 1, 2, then host 1
}

TEST(RingOrder, ManyGpusFallBackToAWalkThatVisitsEachOnce) {
  // 12 GPUs in a NVLink ring 0-1-...-11-0, beyond the exhaustive search:
  // the walk follows the links.
  std::string gpus;
  for (int g = 0; g < 12; ++g) {
    if (g > 0) gpus += ", ";
    gpus += "{\"nvlink_peers\": [" + std::to_string((g + 11) % 12) + ", " + std::to_string((g + 1) % 12) + "]}";
  }
  std::string ranks;
  for (int r = 0; r < 12; ++r) {
    if (r > 0) ranks += ", ";
    ranks += "{\"host\": 0, \"gpu\": " + std::to_string((r * 5) % 12) + "}";
  }
  Topology t = MustParse("{\"hosts\": [{\"gpus\": [" + gpus + "]}], \"ranks\": [" + ranks + "]}");
  const std::vector<int> order = RingOrder(t);
  ASSERT_EQ(order.size(), 12u);
  for (size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(t.ranks[order[i]].gpu, static_cast<int>(i)) << "position " << i;
  }
}

// Integers past int64's range used to wrap: an unsigned 2^64 - 1 read as -1
// (so "gpu" meant no GPU), and the most negative int64 went through
// std::abs, which is undefined for it, and came out as peer 0.
TEST(ParseTopologyJson, IntegersAtTheEdgesOf64BitsAreOutOfRange) {
  ExpectError(R"({"hosts": [{}], "ranks": [{"host": 0, "gpu": 18446744073709551615}]})",
              "ranks[0].gpu: 18446744073709551615 is out of range [-1, 16777216]");
  ExpectError(R"({"hosts": [{}], "ranks": [{"host": 18446744073709551615}]})",
              "ranks[0].host: 18446744073709551615 is out of range [0, 16777216]");
  ExpectError(R"({"hosts": [{}], "ranks": [{"host": -9223372036854775808}]})",
              "ranks[0].host: -9223372036854775808 is out of range [0, 16777216]");
  ExpectError(R"({"hosts": [{"gpus": [{}, {"nvlink_peers": [-9223372036854775808]}]}],
      "ranks": [{"host": 0}]})",
              "hosts[0].gpus[1].nvlink_peers[0]: -9223372036854775808 is out of range [0, 16777216]");
  ExpectError(R"({"hosts": [{"gpus": [{}, {"nvlink_peers": [18446744073709551615]}]}],
      "ranks": [{"host": 0}]})",
              "hosts[0].gpus[1].nvlink_peers[0]: 18446744073709551615 is out of range [0, 16777216]");
}

TEST(ParseTopologyJson, PeerPerfRanksAreCheckedAndRoundTrip) {
  ExpectError(R"({"hosts": [{"gpus": [{"nvlink_peers": [1], "peer_perf_ranks": [0, 1]}, {}]}],
      "ranks": [{"host": 0}]})",
              "hosts[0].gpus[0].peer_perf_ranks: 2 entries for 1 nvlink_peers; give one per peer");
  ExpectError(R"({"hosts": [{"gpus": [{"nvlink_peers": [1], "peer_perf_ranks": [-1]}, {}]}],
      "ranks": [{"host": 0}]})",
              "hosts[0].gpus[0].peer_perf_ranks[0]: -1 is negative");
  ExpectError(R"({"hosts": [{"gpus": [{"nvlink_peers": [1], "peer_perf_ranks": ["fast"]}, {}]}],
      "ranks": [{"host": 0}]})",
              "hosts[0].gpus[0].peer_perf_ranks[0]: expected an integer");
  // Past int's range they wrapped: 4294967297 was peer 1, and huge
  // performance ranks overflowed the ring search's sums.
  ExpectError(R"({"hosts": [{"gpus": [{"nvlink_peers": [4294967297]}, {}]}], "ranks": [{"host": 0}]})",
              "hosts[0].gpus[0].nvlink_peers[0]: 4294967297 is out of range [0, 16777216]");
  ExpectError(R"({"hosts": [{"gpus": [{"nvlink_peers": [1], "peer_perf_ranks": [2147483647]}, {}]}],
      "ranks": [{"host": 0}]})",
              "hosts[0].gpus[0].peer_perf_ranks[0]: 2147483647 is out of range [0, 16777216]");
  ExpectError(R"({"hosts": [{"gpus": [{"nvlink_peers": [1, 1]}, {}]}], "ranks": [{"host": 0}]})",
              "hosts[0].gpus[0].nvlink_peers: 1 is listed twice");
  Topology t = MustParse(R"({"hosts": [{"gpus": [
      {"nvlink_peers": [1], "peer_perf_ranks": [3]}, {"nvlink_peers": [0]}]}],
      "ranks": [{"host": 0, "gpu": 0}]})");
  auto back = ParseTopologyJson(TopologyToJson(t), "round trip");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->hosts[0].gpus[0].peer_perf_ranks, std::vector<int>{3});
  EXPECT_EQ(back->hosts[0].gpus[0].LinkRank(1), 3);
  EXPECT_EQ(back->hosts[0].gpus[1].LinkRank(0), 0);   // no ranks given: best
  EXPECT_EQ(back->hosts[0].gpus[1].LinkRank(1), -1);  // not a peer
}

TEST(PickNetDevice, NearestToTheGpuThenSpread) {
  Topology t = MustParse(R"({"hosts": [{"numa_nodes": 2,
      "net_devices": [{"name": "mlx5_0", "numa_node": 0, "rate_gbps": 200},
                      {"name": "mlx5_1", "numa_node": 1, "rate_gbps": 200},
                      {"name": "mlx5_2", "numa_node": 1, "rate_gbps": 200},
                      {"name": "mlx5_3", "numa_node": 1, "rate_gbps": 100},
                      {"name": "mlx5_4", "numa_node": 0, "active": false}],
      "gpus": [{"numa_node": 0}, {"numa_node": 1}, {"numa_node": 1}]}],
      "ranks": [{"host": 0, "gpu": 0}, {"host": 0, "gpu": 1}, {"host": 0, "gpu": 2}]})");
  EXPECT_EQ(PickNetDevice(t, 0), "mlx5_0:1");
  EXPECT_EQ(PickNetDevice(t, 1), "mlx5_1:1");  // fastest on NUMA 1 ...
  EXPECT_EQ(PickNetDevice(t, 2), "mlx5_2:1");  // ... spread over the two
}

TEST(PickNetDevice, ByNumaNodeWithoutGpusAndFallbacks) {
  Topology t = MustParse(R"({"hosts": [{"numa_nodes": 2,
      "net_devices": [{"name": "ib0", "numa_node": 1, "rate_gbps": 100}]}, {}],
      "ranks": [{"host": 0, "numa_node": 0}, {"host": 0, "numa_node": 1}, {"host": 1}]})");
  EXPECT_EQ(PickNetDevice(t, 0), "ib0:1");  // nothing near: any active port
  EXPECT_EQ(PickNetDevice(t, 1), "ib0:1");
  EXPECT_EQ(PickNetDevice(t, 2), "");       // a host with no RDMA port
}

TEST(PickNetDevice, RanksWithNoNearPortSpreadOverEveryPortOfTheHost) {
  // The ports' NUMA node is unknown, so no rank has a port near it: the
  // ranks of both nodes share both ports, instead of each node's first rank
  // taking ib0.
  Topology t = MustParse(R"({"hosts": [{"numa_nodes": 2,
      "net_devices": [{"name": "ib0", "rate_gbps": 100}, {"name": "ib1", "rate_gbps": 100}]}],
      "ranks": [{"host": 0, "numa_node": 0}, {"host": 0, "numa_node": 1},
                {"host": 0, "numa_node": 0}, {"host": 0, "numa_node": 1}]})");
  EXPECT_EQ(PickNetDevice(t, 0), "ib0:1");
  EXPECT_EQ(PickNetDevice(t, 1), "ib1:1");
  EXPECT_EQ(PickNetDevice(t, 2), "ib0:1");
  EXPECT_EQ(PickNetDevice(t, 3), "ib1:1");
}

TEST(PickNetDevice, HostsSharingABootIdSpreadOverItsPorts) {
  // Two pods with the machine's network (Kubernetes hostNetwork), one per
  // GPU: other PID and IPC namespaces make them two hosts, but they share
  // the machine's kernel and its two ports, so they take one port each.
  Topology t = MustParse(R"({"hosts": [
      {"name": "node", "boot_id": "k", "numa_nodes": 1,
       "net_devices": [{"name": "mlx5_0", "numa_node": 0, "rate_gbps": 200},
                       {"name": "mlx5_1", "numa_node": 0, "rate_gbps": 200}]},
      {"name": "node", "boot_id": "k", "numa_nodes": 1,
       "net_devices": [{"name": "mlx5_0", "numa_node": 0, "rate_gbps": 200},
                       {"name": "mlx5_1", "numa_node": 0, "rate_gbps": 200}]}],
      "ranks": [{"host": 0, "numa_node": 0}, {"host": 1, "numa_node": 0}]})");
  EXPECT_EQ(PickNetDevice(t, 0), "mlx5_0:1");
  EXPECT_EQ(PickNetDevice(t, 1), "mlx5_1:1");
  // Without a boot id, hosts stay apart: each has its own ports.
  t.hosts[0].boot_id = t.hosts[1].boot_id = "";
  EXPECT_EQ(PickNetDevice(t, 1), "mlx5_0:1");
}

// Two hosts of two ranks each, with the given boot ids.
Topology TwoHosts(const std::string& boot_a, const std::string& boot_b) {
  Topology t;
  t.hosts = {Host{.name = "a", .boot_id = boot_a}, Host{.name = "b", .boot_id = boot_b}};
  t.ranks = {RankPlace{.host = 0}, RankPlace{.host = 0}, RankPlace{.host = 1}, RankPlace{.host = 1}};
  return t;
}

TEST(RanksSharingKernel, CountsByBootIdAcrossHostNames) {
  // Two machines: each rank shares its kernel with its host's ranks.
  EXPECT_EQ(RanksSharingKernel(TwoHosts("k1", "k2"), 0), 2);
  EXPECT_EQ(RanksSharingKernel(TwoHosts("k1", "k2"), 3), 2);
  // Two containers (network namespaces) on one machine: one kernel.
  EXPECT_EQ(RanksSharingKernel(TwoHosts("k1", "k1"), 0), 4);
  EXPECT_EQ(RanksSharingKernel(TwoHosts("k1", "k1"), 2), 4);
  // No boot id: by host.
  EXPECT_EQ(RanksSharingKernel(TwoHosts("", ""), 1), 2);
  EXPECT_EQ(RanksSharingKernel(TwoHosts("k1", ""), 2), 2);
}

TEST(ChooseIdlePolicy, SpinsWhileEveryBusyThreadHasACore) {
  const Topology machines = TwoHosts("k1", "k2");
  // RDMA between hosts: yield only when the busy threads outnumber cores.
  EXPECT_FALSE(ChooseIdlePolicy(machines, 0, 2, 4, false).yield);
  EXPECT_FALSE(ChooseIdlePolicy(machines, 0, 1, 2, false).yield);
  IdlePolicy p = ChooseIdlePolicy(machines, 0, 2, 3, false);
  EXPECT_TRUE(p.yield);
  EXPECT_FALSE(p.at_once);
  // TCP between hosts: the kernel's network stack needs a core as well.
  EXPECT_FALSE(ChooseIdlePolicy(machines, 0, 2, 5, true).yield);
  p = ChooseIdlePolicy(machines, 0, 2, 4, true);
  EXPECT_TRUE(p.yield);
  EXPECT_TRUE(p.at_once);
  // busy_threads_per_rank 0 counts as one.
  EXPECT_TRUE(ChooseIdlePolicy(machines, 0, 0, 2, true).at_once);
  EXPECT_FALSE(ChooseIdlePolicy(machines, 0, 0, 3, true).yield);
}

TEST(ChooseIdlePolicy, ContainersOnOneMachineCountTogether) {
  // One rank per "host", both on one 2-core kernel, over TCP: 2 busy threads
  // fill both cores, so they yield at once (by host they would spin).
  Topology t;
  t.hosts = {Host{.name = "pod-a", .boot_id = "k"}, Host{.name = "pod-b", .boot_id = "k"}};
  t.ranks = {RankPlace{.host = 0}, RankPlace{.host = 1}};
  const IdlePolicy p = ChooseIdlePolicy(t, 1, 1, 2, true);
  EXPECT_TRUE(p.yield);
  EXPECT_TRUE(p.at_once);
  // The same ranks on one host (shared memory, no network): spin.
  t.ranks = {RankPlace{.host = 0}, RankPlace{.host = 0}};
  t.hosts.pop_back();
  EXPECT_FALSE(ChooseIdlePolicy(t, 1, 1, 2, false).yield);
}

}  // namespace
}  // namespace ddp::transport::topology
