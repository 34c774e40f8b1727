// Which all-reduce algorithm and ring order each described machine gets.
// The topologies are written as DDP_TOPOLOGY_FILE would hold them, so these
// are machines this host is not.

#include "transport/collectives.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "transport/topology/topology.h"

namespace ddp::transport::internal {
namespace {

topology::Topology Parse(const std::string& json) {
  auto t = topology::ParseTopologyJson(json, "described.json");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : topology::Topology{};
}

// `hosts` hosts with `per_host` ranks each, assigned round-robin (rank r on
// host r % hosts), as a scheduler that spreads ranks would.
topology::Topology RoundRobin(int hosts, int per_host) {
  std::string json = R"({"hosts": [)";
  for (int h = 0; h < hosts; ++h) json += std::string(h ? "," : "") + "{}";
  json += R"(], "ranks": [)";
  for (int r = 0; r < hosts * per_host; ++r) {
    json += std::string(r ? "," : "") + R"({"host": )" + std::to_string(r % hosts) + "}";
  }
  return Parse(json + "]}");
}

Algorithm Auto(size_t bytes, const topology::Topology& t, bool shm) {
  return ChooseAllReduce({.bytes = bytes, .shared_memory = shm}, t);
}

std::string Order(const topology::Topology& t) {
  std::string out;
  for (int r : topology::RingOrder(t)) out += (out.empty() ? "" : " ") + std::to_string(r);
  return out;
}

TEST(Choice, OneHostUsesSharedMemoryWhenItIsUp) {
  topology::Topology t = RoundRobin(1, 4);
  for (size_t bytes : {size_t{4}, size_t{64} << 10, size_t{64} << 20}) {
    EXPECT_EQ(Auto(bytes, t, true), Algorithm::kSharedMemory) << bytes;
  }
  EXPECT_EQ(Order(t), "0 1 2 3");
}

TEST(Choice, OneHostWithoutSharedMemoryFollowsTheTable) {
  topology::Topology t = RoundRobin(1, 4);
  EXPECT_EQ(Auto(4 << 10, t, false), Algorithm::kRhd);
  EXPECT_EQ(Auto(64 << 20, t, false), Algorithm::kRing);
  topology::Topology big = RoundRobin(1, 16);
  EXPECT_EQ(Auto(1 << 20, big, false), Algorithm::kTree);
}

TEST(Choice, TwoHostsGoHierarchicalWithRingsLeavingEachHostOnce) {
  topology::Topology t = RoundRobin(2, 4);
  EXPECT_EQ(t.num_hosts(), 2);
  EXPECT_EQ(Auto(4 << 10, t, false), Algorithm::kRhd);  // latency-bound
  EXPECT_EQ(Auto(1 << 20, t, false), Algorithm::kHierarchical);
  EXPECT_EQ(Auto(64 << 20, t, false), Algorithm::kHierarchical);
  EXPECT_EQ(Order(t), "0 2 4 6 1 3 5 7");
  // With shared memory inside each host, hierarchical at every size: one
  // exchange between hosts instead of several.
  for (size_t bytes : {size_t{4}, size_t{4} << 10, size_t{64} << 10, size_t{64} << 20}) {
    EXPECT_EQ(ChooseAllReduce({.bytes = bytes, .host_shared_memory = true}, t),
              Algorithm::kHierarchical)
        << bytes;
  }
  // Not for uneven hosts.
  topology::Topology uneven = Parse(R"({"hosts": [{}, {}], "ranks": [
      {"host": 0}, {"host": 1}, {"host": 0}]})");
  EXPECT_EQ(ChooseAllReduce({.bytes = 4 << 10, .host_shared_memory = true}, uneven),
            Algorithm::kRhd);
}

TEST(Choice, UnevenHostsFallBackToAFlatRingInTopologyOrder) {
  topology::Topology t = Parse(R"({"hosts": [{}, {}], "ranks": [
      {"host": 0}, {"host": 1}, {"host": 0}]})");
  EXPECT_FALSE(t.Uniform());
  EXPECT_EQ(Auto(64 << 20, t, false), Algorithm::kRing);
  EXPECT_EQ(Order(t), "0 2 1");
  // Forcing hierarchical where it cannot group evenly is the algorithm's
  // business (it falls back to a ring); on one host it is ignored.
  EXPECT_EQ(ChooseAllReduce({.bytes = 1, .requested = Algorithm::kHierarchical}, RoundRobin(1, 2)),
            Algorithm::kRhd);
}

TEST(Choice, GpuHostsOrderRingsAlongNvlink) {
  // Two hosts of four GPUs each; NVLink pairs 0-1 and 2-3; GPUs 0,1 on NUMA 0.
  const std::string host = R"({"numa_nodes": 2,
      "net_devices": [{"name": "mlx5_0", "numa_node": 0, "rate_gbps": 200},
                      {"name": "mlx5_1", "numa_node": 1, "rate_gbps": 200}],
      "gpus": [{"numa_node": 0, "nvlink_peers": [1]}, {"numa_node": 0, "nvlink_peers": [0]},
               {"numa_node": 1, "nvlink_peers": [3]}, {"numa_node": 1, "nvlink_peers": [2]}]})";
  // Local ranks got GPUs in the order 2, 0, 3, 1.
  std::string ranks;
  const int gpu_of_local[] = {2, 0, 3, 1};
  for (int r = 0; r < 8; ++r) {
    ranks += std::string(r ? "," : "") + R"({"host": )" + std::to_string(r / 4) + R"(, "gpu": )" +
             std::to_string(gpu_of_local[r % 4]) + "}";
  }
  topology::Topology t = Parse(R"({"hosts": [)" + host + "," + host + R"(], "ranks": [)" + ranks + "]}");
  EXPECT_EQ(Order(t), "1 3 0 2 5 7 4 6");
  EXPECT_EQ(Auto(16 << 20, t, false), Algorithm::kHierarchical);
  // Each rank's RDMA port sits on its GPU's NUMA node.
  EXPECT_EQ(topology::PickNetDevice(t, 0), "mlx5_1:1");  // GPU 2, NUMA 1
  EXPECT_EQ(topology::PickNetDevice(t, 1), "mlx5_0:1");  // GPU 0, NUMA 0
}

TEST(Choice, ExplicitRequestsWin) {
  topology::Topology t = RoundRobin(1, 3);
  EXPECT_EQ(ChooseAllReduce({.bytes = 1 << 20, .requested = Algorithm::kTree, .shared_memory = true}, t),
            Algorithm::kTree);
  EXPECT_EQ(ChooseAllReduce({.bytes = 1 << 20, .configured = Algorithm::kRing, .shared_memory = true}, t),
            Algorithm::kRing);
  // shm requested but not up: the table decides.
  EXPECT_EQ(ChooseAllReduce({.bytes = 64 << 20, .requested = Algorithm::kSharedMemory}, t),
            Algorithm::kRing);
  // ... unless an algorithm is configured (DDP_ALLREDUCE_ALGO): that one.
  EXPECT_EQ(ChooseAllReduce({.bytes = 4 << 10, .requested = Algorithm::kSharedMemory, .configured = Algorithm::kTree},
                            t),
            Algorithm::kTree);
  EXPECT_EQ(ChooseAllReduce({.bytes = 4 << 10, .requested = Algorithm::kHierarchical, .configured = Algorithm::kRing},
                            t),
            Algorithm::kRing);
}

}  // namespace
}  // namespace ddp::transport::internal
