#ifndef DDP_TRANSPORT_TOPOLOGY_TOPOLOGY_H_
#define DDP_TRANSPORT_TOPOLOGY_TOPOLOGY_H_

// Where every rank runs: which host, NUMA node and GPU, and what network
// devices and GPU peer links each host has. Discovered on the machine
// (discover.h) and exchanged through the store, or loaded from a JSON file
// (DDP_TOPOLOGY_FILE) so that tests can describe machines this host is not.
//
// File format (every field but "hosts" and "ranks" may be left out):
//
//   {
//     "hosts": [
//       {"name": "node-a", "numa_nodes": 2,
//        "net_devices": [{"name": "mlx5_0", "port": 1, "numa_node": 0,
//                         "link_layer": "InfiniBand", "rate_gbps": 200,
//                         "active": true}],
//        "gpus": [{"numa_node": 0, "nvlink_peers": [1], "peer_perf_ranks": [0]},
//                 {"numa_node": 0, "nvlink_peers": [0], "peer_perf_ranks": [0]}]}
//     ],
//     "ranks": [{"host": 0, "numa_node": 0, "gpu": 0},
//               {"host": 0, "numa_node": 0, "gpu": 1}]
//   }
//
// "boot_id" (optional, a host's) is the kernel's boot id
// (/proc/sys/kernel/random/boot_id): hosts with one boot id share a kernel
// and its cores when waits choose to spin or yield, whatever their names
// (containers on one node); without it, only a host shares with itself.
//
// "pci_bus_id" (optional) names a GPU ("0000:3b:00.0"), so that ranks that
// see different GPUs of one host can be told apart when views are merged.
//
// "peer_perf_ranks" (optional) has one entry per "nvlink_peers" entry: the
// CUDA P2P performance rank of that link (cudaDevP2PAttrPerformanceRank;
// 0 is the best link, larger is slower). Without it every peer link counts
// as rank 0.

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "transport/status.h"

namespace ddp::transport::topology {

/// One port of an RDMA device (from /sys/class/infiniband).
struct NetDevice {
  std::string name;             ///< "mlx5_0".
  int port = 1;                 ///< 1-based port number.
  int numa_node = -1;           ///< -1: unknown.
  std::string link_layer;       ///< "InfiniBand" or "Ethernet".
  double rate_gbps = 0;         ///< Link rate in Gb/s.
  bool active = true;           ///< Port state ACTIVE.
  /// "mlx5_0:1", the UCX_NET_DEVICES spelling.
  std::string UcxName() const { return name + ":" + std::to_string(port); }
};

/// One GPU of a host. A rank's own view numbers them as its CUDA runtime
/// does (after CUDA_VISIBLE_DEVICES); the exchanged topology numbers the
/// union of its ranks' GPUs (see ExchangeTopology).
struct Gpu {
  int numa_node = -1;
  /// "0000:3b:00.0" (lower case): which GPU this is, whatever a rank's
  /// CUDA_VISIBLE_DEVICES numbering; empty where unknown (no CUDA build).
  std::string pci_bus_id;
  std::vector<int> nvlink_peers;  ///< GPUs of the same host it reaches by peer access.
  /// Empty, or one P2P performance rank per nvlink_peers entry (0: best link).
  std::vector<int> peer_perf_ranks;
  /// Performance rank of the link to `peer`; -1 when there is no peer link.
  int LinkRank(int peer) const;
};

struct Host {
  std::string name;     ///< Host name.
  std::string boot_id;  ///< Distinguishes containers/VMs that share a name.
  /// NUMA node numbers (the OS's, as sysfs gives them) are below this.
  int numa_nodes = 1;
  std::vector<NetDevice> net_devices;
  std::vector<Gpu> gpus;
};

/// Where one rank runs.
struct RankPlace {
  int host = 0;        ///< Index into Topology::hosts.
  /// Its GPU's node where that is known, else the node it is bound to, else
  /// (discovery) its share of the host's nodes by local rank; -1: unknown.
  int numa_node = -1;
  int gpu = -1;        ///< Index into that host's gpus; -1: none.
};

struct Topology {
  std::vector<Host> hosts;
  std::vector<RankPlace> ranks;

  int size() const { return static_cast<int>(ranks.size()); }
  int num_hosts() const { return static_cast<int>(hosts.size()); }
  bool SameHost(int a, int b) const { return ranks[a].host == ranks[b].host; }
  /// Ranks on `host`, ascending.
  std::vector<int> RanksOnHost(int host) const;
  /// True when every host runs the same number of ranks.
  bool Uniform() const;
  /// Checks indices (hosts, GPUs, peers) for consistency; INVALID_ARGUMENT
  /// naming the field otherwise.
  Status Validate() const;
};

/// The part of `topology` that ranks `ranks` (indices into it, in their new
/// order) make up: rank i of the result is ranks[i]; hosts none of them
/// runs on are dropped, the others keep their order. INVALID_ARGUMENT for an
/// index out of range or given twice.
StatusOr<Topology> Subset(const Topology& topology, const std::vector<int>& ranks);

/// Checks that a described topology (a file's, for `origin` in messages)
/// puts ranks of different real hosts on different described hosts: it may
/// split a machine into several hosts (to run multi-host algorithms on
/// one), not join machines into one, whose "shared" memory and ring order
/// would be wrong. INVALID_ARGUMENT naming two such ranks and their hosts.
/// Both topologies must have the same ranks.
Status CheckDescribedHostsSplitReal(const Topology& described, const Topology& real, std::string_view origin);

/// Parses the file format above. `origin` (a path) leads error messages,
/// which name the offending field: "t.json: ranks[2].host: 5 is not a host
/// index (2 hosts)".
StatusOr<Topology> ParseTopologyJson(std::string_view text, std::string_view origin);
/// Reads and parses a topology file. INVALID_ARGUMENT naming the path and
/// its type, before anything is read, when it is not a regular file (a
/// device such as /dev/zero would be read until memory ran out, a FIFO
/// could block forever); naming the path and its size, before anything is
/// read, when it holds more than kMaxTopologyFileBytes (a description of a
/// million ranks takes about 50 MB), or when it grows past that while read.
inline constexpr size_t kMaxTopologyFileBytes = size_t{256} << 20;
StatusOr<Topology> LoadTopologyFile(const std::string& path);
/// The file format for `topology` (round-trips through ParseTopologyJson).
std::string TopologyToJson(const Topology& topology);

/// Rank order for rings: grouped by host, so that the ring leaves each host
/// exactly once. Within a host, ranks with GPUs come first, ordered so that
/// every hop between GPUs is the best link available (see RingHopCost):
/// for up to kExactRingGpus GPUs the order minimizes the slowest hop, then
/// the sum of hops, over every order (a closed ring when the job has one
/// host, an open path when the ring goes on to other hosts); beyond that, a
/// walk along peer links. Ranks sharing one GPU are adjacent. Ranks without
/// a GPU follow, by NUMA node. Deterministic: every rank computes the same
/// order from the same topology. Returns a permutation of [0, size).
std::vector<int> RingOrder(const Topology& topology);

/// Most GPUs of one host ordered by exhaustive search in RingOrder.
inline constexpr int kExactRingGpus = 8;

/// Cost of a ring hop between two GPUs of `host`: the link's P2P
/// performance rank (0 best) over a peer link; otherwise 1000 through host
/// memory on one NUMA node, 2000 across NUMA nodes.
int RingHopCost(const Host& host, int gpu_a, int gpu_b);

/// The RDMA port `rank` should use: an active port on the NUMA node of its
/// GPU (or, without a GPU, of its own NUMA node), the fastest such, spread
/// over the ranks on its kernel (see RanksSharingKernel) that share that
/// node. Falls back to the fastest of any active port, spread over all the
/// kernel's ranks. Empty when the host has none.
std::string PickNetDevice(const Topology& topology, int rank);

/// Ranks that share `rank`'s kernel, itself included: those whose host has
/// its host's boot id, whatever the host names (containers on one machine
/// each have their own name and network, but one kernel and one set of
/// cores). Hosts without a boot id count by host.
int RanksSharingKernel(const Topology& topology, int rank);

/// What a rank's waits do while there is nothing to progress.
struct IdlePolicy {
  /// Yield the core between polls instead of spinning.
  bool yield = false;
  /// Yield at the first idle poll rather than after a short spin.
  bool at_once = false;
};

/// Spin while every busy thread of the ranks on this kernel
/// (RanksSharingKernel times busy_threads_per_rank) has a core of its own
/// among `available_cpus`; otherwise yield. When a rank reaches peers
/// through the kernel's TCP stack (`kernel_network`: another host, no RDMA),
/// that stack needs a core too: spinning threads that fill every core leave
/// delivering the peers' packets to whenever the scheduler next runs the
/// kernel's softirq thread, milliseconds per message. Then the waits yield at
/// once, and also when the busy threads exactly fill the cores
/// (docs/benchmarks.md, "All-reduce between hosts over TCP").
IdlePolicy ChooseIdlePolicy(const Topology& topology, int rank, int busy_threads_per_rank,
                            int available_cpus, bool kernel_network);

}  // namespace ddp::transport::topology

#endif  // DDP_TRANSPORT_TOPOLOGY_TOPOLOGY_H_
