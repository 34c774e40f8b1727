#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <string>

#include "transport/topology/discover.h"

namespace ddp::transport::topology {

std::vector<Gpu> DiscoverGpus(const std::string& sysfs_root) {
  std::vector<Gpu> gpus;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: a host without GPUs
    return gpus;
  }
  gpus.resize(count);
  for (int d = 0; d < count; ++d) {
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), d) == cudaSuccess) {
      std::string id = bus_id;
      std::transform(id.begin(), id.end(), id.begin(), [](unsigned char c) { return std::tolower(c); });
      gpus[d].pci_bus_id = id;
      const std::string numa_path =
          (std::filesystem::path(sysfs_root) / "bus" / "pci" / "devices" / id / "numa_node").string();
      // Close-on-exec ("e"): another thread may fork and exec meanwhile.
      if (std::FILE* file = std::fopen(numa_path.c_str(), "re")) {
        int numa = -1;
        if (std::fscanf(file, "%d", &numa) == 1) gpus[d].numa_node = numa;
        std::fclose(file);
      }
    } else {
      cudaGetLastError();  // left without a bus id; later CUDA calls must not see it
    }
    for (int peer = 0; peer < count; ++peer) {
      if (peer == d) continue;
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, d, peer) != cudaSuccess) {
        cudaGetLastError();  // counted as no peer link
        continue;
      }
      if (can) {
        gpus[d].nvlink_peers.push_back(peer);
        // 0 is the best link (NVLink/NVSwitch ahead of PCIe); unknown
        // counts as a slow peer link.
        int rank = 0;
        if (cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, d, peer) != cudaSuccess) {
          cudaGetLastError();
          rank = 100;
        }
        gpus[d].peer_perf_ranks.push_back(rank);
      }
    }
  }
  return gpus;
}

}  // namespace ddp::transport::topology
