// GPU discovery on a GPU machine (tag "gpu", --config=cuda): what
// DiscoverGpus reports must agree with the CUDA runtime.

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "transport/topology/discover.h"

namespace ddp::transport::topology {
namespace {

TEST(DiscoverGpus, ReportsEveryDeviceWithItsPeers) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess) << "no CUDA device";
  const std::vector<Gpu> gpus = DiscoverGpus("/sys");
  ASSERT_GE(gpus.size(), 1u);
  ASSERT_EQ(gpus.size(), static_cast<size_t>(count));
  for (size_t d = 0; d < gpus.size(); ++d) {
    EXPECT_GE(gpus[d].numa_node, -1) << "GPU " << d;
    // The runtime's bus id in lower case: ExchangeTopology matches GPUs by it.
    char bus_id[32] = {};
    ASSERT_EQ(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), static_cast<int>(d)), cudaSuccess);
    std::string expected = bus_id;
    std::transform(expected.begin(), expected.end(), expected.begin(),
                   [](unsigned char c) { return std::tolower(c); });
    EXPECT_EQ(gpus[d].pci_bus_id, expected) << "GPU " << d;
    for (int peer : gpus[d].nvlink_peers) {
      EXPECT_NE(peer, static_cast<int>(d)) << "GPU " << d << " lists itself as a peer";
      EXPECT_GE(peer, 0);
      EXPECT_LT(peer, count);
      int can = 0;
      ASSERT_EQ(cudaDeviceCanAccessPeer(&can, static_cast<int>(d), peer), cudaSuccess);
      EXPECT_EQ(can, 1) << "GPU " << d << " lists " << peer << " without peer access";
    }
    // One CUDA P2P performance rank per peer, as the runtime reports it.
    ASSERT_EQ(gpus[d].peer_perf_ranks.size(), gpus[d].nvlink_peers.size()) << "GPU " << d;
    for (size_t k = 0; k < gpus[d].nvlink_peers.size(); ++k) {
      int rank = -1;
      ASSERT_EQ(cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, static_cast<int>(d),
                                          gpus[d].nvlink_peers[k]),
                cudaSuccess);
      EXPECT_EQ(gpus[d].peer_perf_ranks[k], rank) << "GPU " << d << " -> " << gpus[d].nvlink_peers[k];
    }
    // Peers are listed once each.
    std::vector<int> sorted = gpus[d].nvlink_peers;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end()) << "GPU " << d;
  }
}

}  // namespace
}  // namespace ddp::transport::topology
