#include "transport/topology/discover.h"

#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "transport/testing/in_memory_store.h"

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
  std::vector<NetDevice> devices = ReadNetDevices(root.string());
  ASSERT_EQ(devices.size(), 2u);
  EXPECT_EQ(devices[0].name, "mlx5_0");
  EXPECT_FALSE(devices[0].active);
  EXPECT_EQ(devices[0].link_layer, "Ethernet");
  EXPECT_EQ(devices[1].UcxName(), "mlx5_1:1");
  EXPECT_EQ(devices[1].numa_node, 1);
  EXPECT_EQ(devices[1].rate_gbps, 200);
  EXPECT_TRUE(devices[1].active);
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

TEST(ExchangeTopology, MissingRankTimesOutNamingIt) {
  testing::InMemoryStore store;
  LocalView view;
  view.host.name = "a";
  auto result = ExchangeTopology(store, "job/", 0, 2, view,
                                 DeadlineIn(std::chrono::milliseconds(100)));
  EXPECT_EQ(result.status().code(), StatusCode::kTimedOut);
  EXPECT_NE(result.status().message().find("rank 1"), std::string::npos) << result.status();
}

}  // namespace
}  // namespace ddp::transport::topology
