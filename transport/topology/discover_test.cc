#include "transport/topology/discover.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <thread>

#include "transport/store/tcp_store.h"
#include "transport/testing/forwarding_store.h"
#include "transport/testing/in_memory_store.h"
#include "transport/testing/reader_descriptor_flags.h"

namespace ddp::transport::topology {
namespace {

namespace fs = std::filesystem;

void Write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text << "\n";
}

TEST(ReadNetDevices, ReadsAFakeSysfsTree) {
  const fs::path root = fs::path(::testing::TempDir()) / "fake_sys";
  fs::remove_all(root);
  const fs::path ib = root / "class" / "infiniband";
  Write(ib / "mlx5_1" / "device" / "numa_node", "1");
  Write(ib / "mlx5_1" / "ports" / "1" / "rate", "200 Gb/sec (4X HDR)");
  Write(ib / "mlx5_1" / "ports" / "1" / "state", "4: ACTIVE");
  Write(ib / "mlx5_1" / "ports" / "1" / "link_layer", "InfiniBand");
  Write(ib / "mlx5_0" / "device" / "numa_node", "0");
  Write(ib / "mlx5_0" / "ports" / "1" / "rate", "100 Gb/sec (4X EDR)");
  Write(ib / "mlx5_0" / "ports" / "1" / "state", "1: DOWN");
  Write(ib / "mlx5_0" / "ports" / "1" / "link_layer", "Ethernet");
  // A port in ACTIVE_DEFER (the link went down and may come back) is not up.
  Write(ib / "mlx5_2" / "ports" / "1" / "state", "5: ACTIVE_DEFER");
  std::vector<NetDevice> devices = ReadNetDevices(root.string());
  ASSERT_EQ(devices.size(), 3u);
  EXPECT_EQ(devices[2].name, "mlx5_2");
  EXPECT_FALSE(devices[2].active);
  EXPECT_EQ(devices[0].name, "mlx5_0");
  EXPECT_FALSE(devices[0].active);
  EXPECT_EQ(devices[0].link_layer, "Ethernet");
  EXPECT_EQ(devices[1].UcxName(), "mlx5_1:1");
  EXPECT_EQ(devices[1].numa_node, 1);
  EXPECT_EQ(devices[1].rate_gbps, 200);
  EXPECT_TRUE(devices[1].active);
}

// The sysfs files are opened close-on-exec: a fork and exec on another
// thread of the host program meanwhile must not inherit them.
TEST(ReadNetDevices, OpensTheFilesCloseOnExec) {
  const fs::path root = fs::path(::testing::TempDir()) / "fake_sys_fifo";
  fs::remove_all(root);
  const fs::path port = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1";
  fs::create_directories(port);
  const int flags = testing::FlagsOfTheReadersDescriptor((port / "state").string(),
                                                [&] { static_cast<void>(ReadNetDevices(root.string())); });
  fs::remove_all(root);
  ASSERT_GE(flags, 0) << "the reader's descriptor was not seen";
  EXPECT_NE(flags & O_CLOEXEC, 0) << std::oct << flags;
}

TEST(ReadNetDevices, NoFolderMeansNoDevices) {
  EXPECT_TRUE(ReadNetDevices("/nonexistent").empty());
}

TEST(DiscoverLocal, DescribesThisHost) {
  auto view = DiscoverLocal({});
  ASSERT_TRUE(view.ok()) << view.status();
  char hostname[256] = {};
  gethostname(hostname, sizeof(hostname) - 1);
  EXPECT_EQ(view->host.name, hostname);
  EXPECT_EQ(view->host.boot_id.size(), 36u) << view->host.boot_id;
  EXPECT_GE(view->host.numa_nodes, 1);
  EXPECT_GE(view->place.numa_node, 0);
  EXPECT_LT(view->place.numa_node, view->host.numa_nodes);
  EXPECT_EQ(view->pid, getpid());
  EXPECT_EQ(view->namespaces, NamespaceIds());
}

// A negative local rank picked GPU local_rank % count, -1 on a host with
// GPUs, and read before the start of the GPU list.
TEST(DiscoverLocal, LocalRankOutsideTheLocalWorldIsRefusedNamingIt) {
  struct Case {
    int local_rank, local_world_size;
    const char* named;
  };
  for (const Case& c : {Case{-1, 2, "local_rank -1"}, Case{2, 2, "local_rank 2"},
                        Case{0, 0, "local_world_size 0"}}) {
    DiscoverOptions options;
    options.local_rank = c.local_rank;
    options.local_world_size = c.local_world_size;
    auto view = DiscoverLocal(options);
    EXPECT_EQ(view.status().code(), StatusCode::kInvalidArgument) << c.named;
    EXPECT_NE(view.status().message().find(c.named), std::string::npos) << view.status();
  }
  DiscoverOptions last;
  last.local_rank = 1;
  last.local_world_size = 2;
  EXPECT_TRUE(DiscoverLocal(last).ok());
}

TEST(SingleNumaNodeFromSysfs, GivesHwlocsAnswerOnThisHost) {
  const auto hwloc_start = std::chrono::steady_clock::now();
  const NumaView hwloc = DiscoverNumaWithHwloc({});
  const auto sysfs_start = std::chrono::steady_clock::now();
  const std::optional<NumaView> sysfs = SingleNumaNodeFromSysfs("/sys");
  const auto end = std::chrono::steady_clock::now();
  std::cout << "hwloc " << std::chrono::duration<double, std::milli>(sysfs_start - hwloc_start).count()
            << " ms, sysfs " << std::chrono::duration<double, std::milli>(end - sysfs_start).count()
            << " ms\n";
  if (sysfs.has_value()) {
    EXPECT_EQ(sysfs->numa_nodes, hwloc.numa_nodes);
    EXPECT_EQ(sysfs->my_node, hwloc.my_node);
  } else {
    // It declines only where the host has several nodes (or sysfs says none).
    int listed = 0;
    std::error_code error;
    for (const auto& entry : fs::directory_iterator("/sys/devices/system/node", error)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("node", 0) == 0 && name.size() > 4 && std::isdigit(name[4])) ++listed;
    }
    EXPECT_NE(listed, 1) << "one node listed under /sys/devices/system/node, yet no answer from it";
  }
}

TEST(SingleNumaNodeFromSysfs, ReadsTheOnlyNodeOfAFakeTree) {
  const fs::path root = fs::path(::testing::TempDir()) / "fake_numa_sys";
  fs::remove_all(root);
  const fs::path nodes = root / "devices" / "system" / "node";
  EXPECT_FALSE(SingleNumaNodeFromSysfs(root.string()).has_value()) << "no node folder";
  Write(nodes / "online", "3");
  Write(nodes / "possible", "0-3");
  Write(nodes / "power" / "async", "disabled");
  EXPECT_FALSE(SingleNumaNodeFromSysfs(root.string()).has_value()) << "no node listed";
  Write(nodes / "node3" / "cpulist", "0-1");
  const std::optional<NumaView> one = SingleNumaNodeFromSysfs(root.string());
  ASSERT_TRUE(one.has_value());
  EXPECT_EQ(one->numa_nodes, 4);
  EXPECT_EQ(one->my_node, 3);
  Write(nodes / "node0" / "cpulist", "2-3");
  EXPECT_FALSE(SingleNumaNodeFromSysfs(root.string()).has_value()) << "two nodes";
}

// A node number whose count (one more) does not fit an int overflowed, and
// one whose count passes the topology record's limit (2^24) made a record
// every rank refused: such a tree is left to hwloc.
TEST(SingleNumaNodeFromSysfs, ANodeNumberBeyondTheRecordsLimitIsLeftToHwloc) {
  const fs::path root = fs::path(::testing::TempDir()) / "fake_numa_huge_sys";
  const fs::path nodes = root / "devices" / "system" / "node";
  for (const char* name : {"node2147483647", "node16777216", "node99999999999"}) {
    fs::remove_all(root);
    Write(nodes / name / "cpulist", "0");
    const std::optional<NumaView> view = SingleNumaNodeFromSysfs(root.string());
    EXPECT_FALSE(view.has_value()) << name << ": " << view->numa_nodes << " nodes, on " << view->my_node;
  }
  fs::remove_all(root);
  Write(nodes / "node16777215" / "cpulist", "0");
  const std::optional<NumaView> last = SingleNumaNodeFromSysfs(root.string());
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->numa_nodes, 1 << 24);
  EXPECT_EQ(last->my_node, (1 << 24) - 1);
}

TEST(DiscoverLocal, TakesTheOnlyNumaNodeFromSysfsWithoutHwloc) {
  // A fake tree whose one node is numbered 5: hwloc, reading the real host,
  // could not give that answer.
  const fs::path root = fs::path(::testing::TempDir()) / "fake_numa5_sys";
  fs::remove_all(root);
  Write(root / "devices" / "system" / "node" / "node5" / "cpulist", "0");
  DiscoverOptions options;
  options.sysfs_root = root.string();
  auto view = DiscoverLocal(options);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->host.numa_nodes, 6);
  if (view->host.gpus.empty()) {
    EXPECT_EQ(view->place.numa_node, 5);
  }
}

TEST(NamespaceIds, AreTheInodesOfThisProcesssNamespaces) {
  struct stat pid_ns {}, ipc_ns {};
  ASSERT_EQ(stat("/proc/self/ns/pid", &pid_ns), 0);
  ASSERT_EQ(stat("/proc/self/ns/ipc", &ipc_ns), 0);
  EXPECT_EQ(NamespaceIds(), "pid:" + std::to_string(pid_ns.st_ino) +
                                " ipc:" + std::to_string(ipc_ns.st_ino));
}

// Exchanges `views` among as many ranks (threads); every rank's result.
std::vector<StatusOr<Exchanged>> Exchange(const std::vector<LocalView>& views) {
  testing::InMemoryStore store;
  const int n = static_cast<int>(views.size());
  std::vector<StatusOr<Exchanged>> results(n, InternalError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      results[r] = ExchangeTopology(store, "job/", r, n, views[r],
                                    DeadlineIn(std::chrono::milliseconds(5000)));
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// Each rank posts its record and reads everyone's in one round trip (per
// few hundred ranks): a Get per rank made the exchange world^2 requests.
TEST(ExchangeTopology, TakesARoundTripPerRankNotPerPair) {
  constexpr int kRanks = 16;
  StatusOr<std::unique_ptr<store::TcpStoreServer>> server =
      store::TcpStoreServer::Start({.bind_address = "127.0.0.1", .job_token = "t"});
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<StatusOr<Exchanged>> results(kRanks, InternalError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      const Deadline deadline = DeadlineIn(std::chrono::milliseconds(10000));
      auto client = store::TcpStoreClient::Connect("127.0.0.1", (*server)->port(), "t", deadline);
      if (!client.ok()) {
        results[r] = client.status();
        return;
      }
      LocalView view;
      view.host.name = "node";
      view.host.boot_id = "1";
      view.pid = 100 + r;
      results[r] = ExchangeTopology(**client, "job/", r, kRanks, view, deadline);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    EXPECT_EQ(results[r]->pids[kRanks - 1], 100 + kRanks - 1);
  }
  EXPECT_LE((*server)->stats().requests, uint64_t{2 * kRanks});
}

TEST(ExchangeTopology, RanksInOtherPidOrIpcNamespacesAreOtherHosts) {
  // One machine's name and boot id (containers with the host's network):
  // ranks 0 and 1 share their namespaces, rank 2 has its own PID namespace,
  // rank 3 its own IPC namespace.
  const char* namespaces[] = {"pid:10 ipc:20", "pid:10 ipc:20", "pid:11 ipc:20", "pid:10 ipc:21"};
  std::vector<LocalView> views(4);
  for (int r = 0; r < 4; ++r) {
    views[r].host.name = "node";
    views[r].host.boot_id = "1";
    views[r].namespaces = namespaces[r];
    views[r].pid = 1;  // each namespace's first process
  }
  std::vector<StatusOr<Exchanged>> results = Exchange(views);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    EXPECT_EQ(t.num_hosts(), 3);
    EXPECT_TRUE(t.SameHost(0, 1));
    EXPECT_FALSE(t.SameHost(0, 2));
    EXPECT_FALSE(t.SameHost(0, 3));
    EXPECT_FALSE(t.SameHost(2, 3));
    // One kernel and one set of cores all the same.
    EXPECT_EQ(RanksSharingKernel(t, r), 4);
  }
}

// A process in PID and IPC namespaces of its own (as a container has) is
// another host to this one, though it has this host's name and boot id.
// Needs root (CAP_SYS_ADMIN), as CI runs it; skipped otherwise.
TEST(ExchangeTopology, AProcessInItsOwnPidAndIpcNamespacesIsAnotherHost) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(fds[0]);
    if (unshare(CLONE_NEWPID | CLONE_NEWIPC) != 0) _exit(2);
    // A new PID namespace holds the caller's children, not the caller.
    const pid_t inner = fork();
    if (inner == 0) {
      const std::string ids = NamespaceIds();
      _exit(write(fds[1], ids.data(), ids.size()) == static_cast<ssize_t>(ids.size()) ? 0 : 4);
    }
    int status = 0;
    if (inner < 0 || waitpid(inner, &status, 0) != inner) _exit(3);
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 3);
  }
  close(fds[1]);
  std::string theirs;
  char buffer[256];
  ssize_t n;
  while ((n = read(fds[0], buffer, sizeof(buffer))) > 0) theirs.append(buffer, n);
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_NE(WEXITSTATUS(status), 2) << "unshare(CLONE_NEWPID | CLONE_NEWIPC) was refused: this test needs root";
  ASSERT_EQ(WEXITSTATUS(status), 0);

  StatusOr<LocalView> mine = DiscoverLocal({});
  ASSERT_TRUE(mine.ok()) << mine.status();
  ASSERT_NE(mine->namespaces, "");
  ASSERT_NE(theirs, "");
  EXPECT_NE(theirs, mine->namespaces);
  std::vector<LocalView> views = {*mine, *mine};
  views[1].namespaces = theirs;
  std::vector<StatusOr<Exchanged>> results = Exchange(views);
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  EXPECT_EQ(results[0]->topology.num_hosts(), 2);
  EXPECT_FALSE(results[0]->topology.SameHost(0, 1));
}

TEST(ExchangeTopology, GroupsRanksByHostAndBootId) {
  testing::InMemoryStore store;
  // Four ranks: two on "a", one on "b", and one on a second "a" with another
  // boot id (a container sharing the name).
  std::vector<LocalView> views(4);
  const char* names[] = {"a", "b", "a", "a"};
  const char* boots[] = {"1", "1", "1", "2"};
  for (int r = 0; r < 4; ++r) {
    views[r].host.name = names[r];
    views[r].host.boot_id = boots[r];
    views[r].pid = 100 + r;
  }
  std::vector<StatusOr<Exchanged>> results(4, InternalError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      results[r] = ExchangeTopology(store, "job/", r, 4, views[r],
                                    DeadlineIn(std::chrono::milliseconds(5000)));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    EXPECT_EQ(t.num_hosts(), 3);
    EXPECT_TRUE(t.SameHost(0, 2));
    EXPECT_FALSE(t.SameHost(0, 1));
    EXPECT_FALSE(t.SameHost(0, 3));
    EXPECT_EQ(results[r]->pids, (std::vector<int>{100, 101, 102, 103}));
  }
}

// A view of host "node" (boot id "k") seeing `gpus` (its CUDA numbering),
// placed on its GPU `gpu`.
LocalView ViewOnNode(std::vector<Gpu> gpus, int gpu) {
  LocalView view;
  view.host.name = "node";
  view.host.boot_id = "k";
  view.host.gpus = std::move(gpus);
  view.place.gpu = gpu;
  view.pid = 100 + gpu;
  return view;
}

Gpu GpuAt(const std::string& bus_id, std::vector<int> peers = {}, std::vector<int> perf = {}) {
  Gpu gpu;
  gpu.pci_bus_id = bus_id;
  gpu.nvlink_peers = std::move(peers);
  gpu.peer_perf_ranks = std::move(perf);
  return gpu;
}

TEST(ExchangeTopology, RanksSeeingDifferentGpusOfAHostGetTheUnionOfThem) {
  // CUDA_VISIBLE_DEVICES=$LOCAL_RANK: each rank sees one GPU, its device 0.
  std::vector<StatusOr<Exchanged>> results =
      Exchange({ViewOnNode({GpuAt("0000:3b:00.0")}, 0), ViewOnNode({GpuAt("0000:5e:00.0")}, 0)});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    ASSERT_EQ(t.num_hosts(), 1);
    ASSERT_EQ(t.hosts[0].gpus.size(), 2u);
    EXPECT_EQ(t.hosts[0].gpus[t.ranks[0].gpu].pci_bus_id, "0000:3b:00.0");
    EXPECT_EQ(t.hosts[0].gpus[t.ranks[1].gpu].pci_bus_id, "0000:5e:00.0");
  }
}

TEST(ExchangeTopology, ARankWithoutAGpuDoesNotHideAnotherRanksGpu) {
  std::vector<StatusOr<Exchanged>> results =
      Exchange({ViewOnNode({}, -1), ViewOnNode({GpuAt("0000:3b:00.0")}, 0)});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    ASSERT_EQ(t.hosts[0].gpus.size(), 1u);
    EXPECT_EQ(t.ranks[0].gpu, -1);
    EXPECT_EQ(t.ranks[1].gpu, 0);
  }
}

TEST(ExchangeTopology, RanksSeeingTheSameGpusKeepTheirNumberingAndLinks) {
  const std::vector<Gpu> both = {GpuAt("0000:3b:00.0", {1}, {0}), GpuAt("0000:5e:00.0", {0}, {0})};
  std::vector<StatusOr<Exchanged>> results = Exchange({ViewOnNode(both, 0), ViewOnNode(both, 1)});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    ASSERT_EQ(t.hosts[0].gpus.size(), 2u);
    EXPECT_EQ(t.ranks[0].gpu, 0);
    EXPECT_EQ(t.ranks[1].gpu, 1);
    EXPECT_EQ(t.hosts[0].gpus[0].nvlink_peers, std::vector<int>{1});
    EXPECT_EQ(t.hosts[0].gpus[1].nvlink_peers, std::vector<int>{0});
    EXPECT_EQ(t.hosts[0].gpus[0].peer_perf_ranks, std::vector<int>{0});
  }
}

TEST(ExchangeTopology, PeerLinksAreRenumberedIntoTheUnion) {
  // Rank 0 sees GPU A; rank 1 sees B and A (in that order), linked with
  // performance rank 2: the link joins A (0) and B (1) of the union.
  std::vector<StatusOr<Exchanged>> results =
      Exchange({ViewOnNode({GpuAt("a")}, 0),
                ViewOnNode({GpuAt("b", {1}, {2}), GpuAt("a", {0}, {2})}, 0)});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    ASSERT_EQ(t.hosts[0].gpus.size(), 2u);
    EXPECT_EQ(t.hosts[0].gpus[1].pci_bus_id, "b");
    EXPECT_EQ(t.ranks[1].gpu, 1);
    EXPECT_EQ(t.hosts[0].gpus[0].LinkRank(1), 2);
    EXPECT_EQ(t.hosts[0].gpus[1].LinkRank(0), 2);
  }
}

TEST(ExchangeTopology, WithoutBusIdsTheFirstRanksGpusStand) {
  // Records without bus ids (no CUDA build, an older record): as before,
  // the host's GPUs are its first rank's and each place.gpu is kept.
  std::vector<StatusOr<Exchanged>> results =
      Exchange({ViewOnNode({GpuAt(""), GpuAt("")}, 0), ViewOnNode({GpuAt("")}, 0)});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    EXPECT_EQ(t.hosts[0].gpus.size(), 2u);
    EXPECT_EQ(t.ranks[0].gpu, 0);
    EXPECT_EQ(t.ranks[1].gpu, 0);
  }
}

// Without bus ids a rank's GPU number past the list that stands (another
// rank saw fewer GPUs, or none) failed every rank's exchange ("ranks[1].gpu:
// 1 but host 0 has 1 GPUs"): the GPUs cannot be matched, so its GPU is
// unknown. A host whose first rank saw no GPU takes the first list seen.
TEST(ExchangeTopology, WithoutBusIdsAGpuPastTheListThatStandsIsUnknown) {
  std::vector<StatusOr<Exchanged>> results =
      Exchange({ViewOnNode({GpuAt("")}, 0), ViewOnNode({GpuAt(""), GpuAt("")}, 1)});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    EXPECT_EQ(t.hosts[0].gpus.size(), 1u);
    EXPECT_EQ(t.ranks[0].gpu, 0);
    EXPECT_EQ(t.ranks[1].gpu, -1);
  }
  results = Exchange({ViewOnNode({}, -1), ViewOnNode({GpuAt(""), GpuAt("")}, 1)});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    EXPECT_EQ(t.hosts[0].gpus.size(), 2u);
    EXPECT_EQ(t.ranks[0].gpu, -1);
    EXPECT_EQ(t.ranks[1].gpu, 1);
  }
}

TEST(ExchangeTopology, AHostHasTheMostNumaNodesAnyOfItsRanksSees) {
  // A cgroup cpuset hides node 1 from rank 0, not from rank 1 (bound there).
  std::vector<LocalView> views = {ViewOnNode({}, -1), ViewOnNode({}, -1)};
  views[1].host.numa_nodes = 2;
  views[1].place.numa_node = 1;
  std::vector<StatusOr<Exchanged>> results = Exchange(views);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    EXPECT_EQ(results[r]->topology.hosts[0].numa_nodes, 2);
    EXPECT_EQ(results[r]->topology.ranks[1].numa_node, 1);
  }
}

// A cpuset that hides node 1 from rank 0 also hid where the node-1 port
// and GPU are (rank 0 reports them at -1): the host keeps what another of
// its ranks knows, and rank 2, on node 1, gets the port of its node.
TEST(ExchangeTopology, ADeviceLocatedByAnyRankOfTheHostKeepsItsNode) {
  auto view = [](int nodes, int numa_node, int node_of_second) {
    LocalView v = ViewOnNode({GpuAt("0000:3b:00.0"), GpuAt("0000:5e:00.0")}, numa_node == 1 ? 1 : 0);
    v.host.numa_nodes = nodes;
    v.host.gpus[0].numa_node = 0;
    v.host.gpus[1].numa_node = node_of_second;
    v.host.net_devices = {NetDevice{.name = "mlx5_0", .numa_node = 0},
                          NetDevice{.name = "mlx5_1", .numa_node = node_of_second}};
    v.place.numa_node = numa_node;
    return v;
  };
  std::vector<StatusOr<Exchanged>> results =
      Exchange({view(1, 0, -1), view(2, 0, 1), view(2, 1, 1), view(2, 1, 1)});
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    ASSERT_EQ(t.hosts[0].net_devices.size(), 2u);
    EXPECT_EQ(t.hosts[0].net_devices[1].numa_node, 1);
    EXPECT_EQ(t.hosts[0].gpus[1].numa_node, 1);
    EXPECT_EQ(PickNetDevice(t, 2), "mlx5_1:1");
  }
}

// CUDA may report peer access one way only; a record is read as a file is,
// where a link must be listed from both ends, so such a link failed every
// rank's creation telling it to fix a file. Only links both ends report
// are posted.
TEST(ExchangeTopology, APeerLinkReportedOneWayIsDropped) {
  const std::vector<Gpu> gpus = {GpuAt("0000:3b:00.0", {1}, {0}), GpuAt("0000:5e:00.0")};
  std::vector<StatusOr<Exchanged>> results = Exchange({ViewOnNode(gpus, 0), ViewOnNode(gpus, 1)});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    const Topology& t = results[r]->topology;
    EXPECT_TRUE(t.hosts[0].gpus[0].nvlink_peers.empty());
    EXPECT_EQ(t.hosts[0].gpus[0].LinkRank(1), -1);
  }
}

TEST(ExchangeTopology, DifferentSettingsFailEveryRankNamingTheSetting) {
  testing::InMemoryStore store;
  std::vector<LocalView> views(3);
  for (int r = 0; r < 3; ++r) {
    views[r].host.name = "a";
    views[r].host.boot_id = "1";
    views[r].pid = 100 + r;
    views[r].settings = "chunk_bytes=0 staged_reduce=device";
  }
  views[2].settings = "chunk_bytes=0 staged_reduce=host";
  std::vector<StatusOr<Exchanged>> results(3, InternalError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      results[r] = ExchangeTopology(store, "job/", r, 3, views[r],
                                    DeadlineIn(std::chrono::milliseconds(5000)));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].status().code(), StatusCode::kInvalidArgument) << results[r].status();
    EXPECT_NE(results[r].status().message().find("setting staged_reduce differs between ranks"),
              std::string::npos)
        << results[r].status();
  }
  EXPECT_NE(results[0].status().message().find("rank 0 has device, rank 2 has host"),
            std::string::npos)
      << results[0].status();
  EXPECT_NE(results[2].status().message().find("rank 2 has host, rank 0 has device"),
            std::string::npos)
      << results[2].status();
}

TEST(ExchangeTopology, SettingsMismatchNamesTheFirstDifferenceOrAMissingSetting) {
  EXPECT_EQ(DescribeSettingsMismatch("a=1 b=2 c=3", 0, "a=1 b=5 c=4", 1),
            "setting b differs between ranks: rank 0 has 2, rank 1 has 5 (it must be equal on "
            "every rank)");
  EXPECT_NE(DescribeSettingsMismatch("a=1", 0, "a=1 z=9", 3).find("setting z differs between ranks: "
                                                                   "rank 0 has (unset), rank 3 has 9"),
            std::string::npos);
  EXPECT_NE(DescribeSettingsMismatch("a=1 y=", 2, "a=1", 0).find("rank 2 has , rank 0 has (unset)"),
            std::string::npos);
}

// The exchange compares the texts; where they differ only in spacing, or in
// a setting given twice, no setting differs, and the message showed
// "setting ? ... (unset) ... (unset)".
TEST(ExchangeTopology, SettingsMismatchWithNoSettingDifferentQuotesBothTexts) {
  EXPECT_EQ(DescribeSettingsMismatch("a=1  b=2", 0, "a=1 b=2", 1),
            "settings differ between ranks: rank 0 has \"a=1  b=2\", rank 1 has \"a=1 b=2\" "
            "(they must be equal on every rank)");
  EXPECT_EQ(DescribeSettingsMismatch("a=2", 1, "a=1 a=2", 2),
            "settings differ between ranks: rank 1 has \"a=2\", rank 2 has \"a=1 a=2\" "
            "(they must be equal on every rank)");
}

TEST(ExchangeTopology, MissingRankTimesOutNamingIt) {
  testing::InMemoryStore store;
  LocalView view;
  view.host.name = "a";
  auto result = ExchangeTopology(store, "job/", 0, 2, view,
                                 DeadlineIn(std::chrono::milliseconds(100)));
  EXPECT_EQ(result.status().code(), StatusCode::kTimedOut);
  EXPECT_NE(result.status().message().find("rank 1"), std::string::npos) << result.status();
}

// A rank's record describes one host and one rank, its own: a record of
// two hosts or two ranks (another build, a stray writer) was read as its
// first host and first rank, taking a host that rank does not run on, and
// the rest was dropped unseen.
TEST(ExchangeTopology, ARecordOfOtherThanOneHostAndOneRankIsRefusedNamingTheRank) {
  const std::string two_hosts =
      R"({"hosts": [{"name": "x"}, {"name": "y"}], "ranks": [{"host": 1}, {"host": 0}], "pid": 7})";
  const std::string two_ranks = R"({"hosts": [{"name": "x"}], "ranks": [{"host": 0}, {"host": 0}], "pid": 7})";
  for (const std::string& record : {two_hosts, two_ranks}) {
    testing::InMemoryStore store;
    ASSERT_TRUE(store.Set("job/topology/1", record, DeadlineIn(std::chrono::seconds(1))).ok());
    LocalView view;
    view.host.name = "a";
    auto result = ExchangeTopology(store, "job/", 0, 2, view, DeadlineIn(std::chrono::seconds(2)));
    ASSERT_FALSE(result.ok()) << record;
    EXPECT_NE(result.status().message().find("rank 1"), std::string::npos) << result.status();
    EXPECT_NE(result.status().message().find("job/topology/1"), std::string::npos) << result.status();
    EXPECT_NE(result.status().message().find("one host and one rank"), std::string::npos) << result.status();
  }
  // A record its own checks refuse names the key too.
  testing::InMemoryStore store;
  ASSERT_TRUE(store.Set("job/topology/1", R"({"hosts": [{"name": "x"}, {"name": "y"}], "ranks": [{"host": 1}], "pid": 7})",
                        DeadlineIn(std::chrono::seconds(1)))
                  .ok());
  LocalView view;
  view.host.name = "a";
  auto result = ExchangeTopology(store, "job/", 0, 2, view, DeadlineIn(std::chrono::seconds(2)));
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("rank 1"), std::string::npos) << result.status();
  EXPECT_NE(result.status().message().find("job/topology/1"), std::string::npos) << result.status();
}

// A store that refuses every write, as a server out of memory does.
class RefusingStore final : public testing::ForwardingStore {
 public:
  Status Set(std::string_view, std::string_view, Deadline) override {
    return UnavailableError("the store refused the write");
  }
};

// A failed post of the rank's record says what was posted where: the
// store's own error ("the store refused the write") named neither the
// exchange nor the key.
TEST(ExchangeTopology, AFailedPostNamesTheExchangeAndTheKey) {
  RefusingStore store;
  LocalView view;
  view.host.name = "a";
  auto result = ExchangeTopology(store, "job/", 1, 2, view, DeadlineIn(std::chrono::seconds(1)));
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kUnavailable) << result.status();
  EXPECT_NE(result.status().message().find("topology exchange"), std::string::npos) << result.status();
  EXPECT_NE(result.status().message().find("job/topology/1"), std::string::npos) << result.status();
  EXPECT_NE(result.status().message().find("the store refused the write"), std::string::npos) << result.status();
}

// A rank outside [0, size) posted under a key no rank reads, waited out the
// whole deadline and then blamed a rank that had done nothing wrong.
TEST(ExchangeTopology, RankOrSizeOutOfRangeIsRefusedAtOnceNamingThem) {
  testing::InMemoryStore store;
  LocalView view;
  view.host.name = "a";
  struct Case {
    int rank, size;
    const char* named;
  };
  for (const Case& c : {Case{2, 2, "rank 2"}, Case{-1, 2, "rank -1"}, Case{0, 0, "size 0"}}) {
    const auto start = std::chrono::steady_clock::now();
    auto result = ExchangeTopology(store, "job/", c.rank, c.size, view, DeadlineIn(std::chrono::seconds(2)));
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1)) << c.named;
    EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument) << result.status();
    EXPECT_NE(result.status().message().find(c.named), std::string::npos) << result.status();
  }
  // Nothing was posted: a later, valid exchange sees no stray record.
  auto stray = store.TryGet("job/topology/2", DeadlineIn(std::chrono::seconds(1)));
  ASSERT_TRUE(stray.ok()) << stray.status();
  EXPECT_FALSE(stray->has_value());
}

// A store that takes `lag` to answer each TryGet (a loaded store server far
// away), or fails it with TIMED_OUT at its deadline when that comes first.
class LaggingStore final : public testing::ForwardingStore {
 public:
  explicit LaggingStore(std::chrono::milliseconds lag) : lag_(lag) {}
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline deadline) override {
    if (std::chrono::steady_clock::now() + lag_ > deadline) {
      std::this_thread::sleep_until(deadline);
      return TimedOutError("TryGet " + std::string(key));
    }
    std::this_thread::sleep_for(lag_);
    return inner_.TryGet(key, deadline);
  }

 private:
  std::chrono::milliseconds lag_;
};

// Naming the missing rank looks at each rank's key after the deadline: on
// a slow store those looks share one budget. Here 40 ranks have posted,
// the 41st has not, and each look takes 150 ms: one look after another
// went on for 6 s past the deadline.
TEST(ExchangeTopology, LookingForTheMissingRankStaysWithinItsBudget) {
  LaggingStore store(std::chrono::milliseconds(150));
  constexpr int kSize = 41;
  for (int r = 1; r < kSize - 1; ++r) {
    ASSERT_TRUE(store.Set("job/topology/" + std::to_string(r), "{}", DeadlineIn(std::chrono::seconds(1))).ok());
  }
  LocalView view;
  view.host.name = "a";
  const auto start = std::chrono::steady_clock::now();
  auto result = ExchangeTopology(store, "job/", 0, kSize, view, DeadlineIn(std::chrono::milliseconds(100)));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(result.status().code(), StatusCode::kTimedOut) << result.status();
  EXPECT_LT(seconds, 0.1 + std::chrono::duration<double>(kMissingRankLookBudget).count() + 1.0)
      << result.status();
}

// An in-memory store whose look at a key fails TIMED_OUT once its deadline
// has passed, as the TCP store's does.
class DeadlineKeepingStore final : public testing::ForwardingStore {
 public:
  StatusOr<std::optional<std::string>> TryGet(std::string_view key, Deadline deadline) override {
    if (std::chrono::steady_clock::now() >= deadline) return TimedOutError("TryGet " + std::string(key));
    return inner_.TryGet(key, deadline);
  }
};

// A look for the missing rank that starts more than its window past the
// deadline (here the caller's deadline was 3 s past) still names the rank:
// every look was given a deadline already past, and no rank was named.
TEST(ExchangeTopology, ALookBegunLongAfterTheDeadlineStillNamesTheMissingRank) {
  DeadlineKeepingStore store;
  ASSERT_TRUE(store.Set("job/topology/1", "{}", DeadlineIn(std::chrono::seconds(1))).ok());
  LocalView view;
  view.host.name = "a";
  auto result = ExchangeTopology(store, "job/", 0, 3, view,
                                 std::chrono::steady_clock::now() - std::chrono::seconds(3));
  EXPECT_EQ(result.status().code(), StatusCode::kTimedOut) << result.status();
  EXPECT_NE(result.status().message().find("rank 2 has not posted its record"), std::string::npos)
      << result.status();
}

}  // namespace
}  // namespace ddp::transport::topology
