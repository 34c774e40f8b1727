#ifndef DDP_TRANSPORT_TOPOLOGY_DISCOVER_H_
#define DDP_TRANSPORT_TOPOLOGY_DISCOVER_H_

// Discovery of this host (hwloc for NUMA, sysfs for RDMA devices, the CUDA
// runtime for GPUs when built with CUDA) and the exchange of every rank's
// view through the store, which yields the job's Topology.

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "transport/status.h"
#include "transport/store/store.h"
#include "transport/topology/topology.h"
#include "transport/types.h"

namespace ddp::transport::topology {

struct DiscoverOptions {
  std::string sysfs_root = "/sys";  ///< Tests point this at a fake tree.
  int local_rank = 0;
  int local_world_size = 1;
};

/// This process's view: its host (hosts[0] of a one-host topology) and place.
struct LocalView {
  Host host;
  RankPlace place;
  int pid = 0;
  /// This process's PID and IPC namespaces (NamespaceIds()).
  std::string namespaces;
  /// Settings every rank must share, as "name=value" words separated by
  /// spaces; ExchangeTopology fails on every rank when two ranks differ.
  /// Empty: nothing to compare.
  std::string settings;
};

/// The identity of this process's PID and IPC namespaces, "pid:<inode>
/// ipc:<inode>" (the inodes of /proc/self/ns/pid and /proc/self/ns/ipc);
/// empty where /proc does not tell. Containers that share a machine's
/// network (Kubernetes hostNetwork) share its host name and boot id, but each
/// may have its own processes, System V IPC and /dev/shm (container runtimes
/// give a container with its own IPC namespace its own /dev/shm): ranks in
/// different namespaces cannot check each other's pids or share memory, so
/// they are not one host.
std::string NamespaceIds();

/// RDMA ports under `<sysfs_root>/class/infiniband`, sorted by name and port;
/// none when the folder does not exist. A folder whose listing stops on an
/// error (a device unplugged meanwhile: ENODEV, EIO) gives the ports listed
/// before it, and a warning on stderr names the folder and the error (once
/// a process).
std::vector<NetDevice> ReadNetDevices(const std::string& sysfs_root);

/// A host's NUMA node count (one more than the highest node number, nodes
/// numbered as the OS numbers them) and the node of the calling rank.
struct NumaView {
  int numa_nodes = 1;
  int my_node = 0;
};

/// hwloc's answer: the node the calling thread is bound to where the host has
/// several, else the local ranks spread evenly over the nodes; my_node -1
/// (unknown) when hwloc cannot load the topology.
NumaView DiscoverNumaWithHwloc(const DiscoverOptions& options);

/// The same answer without loading hwloc's topology, where
/// `<sysfs_root>/devices/system/node` holds exactly one node folder `nodeN`:
/// N + 1 nodes, the rank on N. nullopt where it holds none or several, or
/// where N + 1 passes the topology record's 2^24 nodes.
std::optional<NumaView> SingleNumaNodeFromSysfs(const std::string& sysfs_root);

/// GPUs visible to the CUDA runtime; none in builds without CUDA.
std::vector<Gpu> DiscoverGpus(const std::string& sysfs_root);

/// Host name, boot id, NUMA nodes, RDMA ports and GPUs of this host, and this
/// rank's GPU (local_rank modulo the GPU count) and NUMA node: its GPU's
/// where sysfs gives that, else where it is bound, else spread by local
/// rank. INVALID_ARGUMENT naming them when local_world_size < 1 or
/// local_rank is outside [0, local_world_size).
StatusOr<LocalView> DiscoverLocal(const DiscoverOptions& options);

/// The result of an exchange: the topology and every rank's process id.
struct Exchanged {
  Topology topology;
  std::vector<int> pids;
};

/// "setting staged_reduce differs between ranks: rank 0 has device, rank 1
/// has host (it must be equal on every rank)", for the first setting (by
/// name) whose values differ in two ranks' LocalView::settings. When the
/// texts differ but no setting does (spacing, a setting given twice), both
/// texts, quoted.
std::string DescribeSettingsMismatch(const std::string& mine, int my_rank, const std::string& theirs,
                                     int their_rank);

/// Posts `local` under `<key_prefix>topology/<rank>` and reads every rank's;
/// ranks whose host name, boot id and namespaces all agree share a host (its
/// shared memory and pids; RanksSharingKernel still counts ranks by boot id
/// alone). A host's GPUs are the union of its ranks' by PCI bus id, in
/// first-seen order, and each rank's place.gpu and the peer links are
/// renumbered into it (ranks may see different GPUs through
/// CUDA_VISIBLE_DEVICES); where bus ids are missing, the GPUs of its first
/// rank that saw any, and a rank's GPU past that list is unknown (-1).
/// Its NUMA node count is the most any of its ranks sees. Must be called on
/// every rank. INVALID_ARGUMENT, on every rank,
/// naming the first setting and both values, when some rank's `settings`
/// differ from this rank's; INVALID_ARGUMENT naming them, before anything
/// is posted, when `size` < 1 or `rank` is outside [0, size). TIMED_OUT
/// names the first rank that has not posted, found by looking at each
/// rank's key after `deadline`, all the looks together by `deadline` +
/// kMissingRankLookBudget: a window past the deadline that a store's own
/// look for the missing key (the communicator's) shares, so that the
/// exchange fails within its deadline and this budget; a look that starts
/// after that window (a read that overran it) gets kMissingRankQuickLook
/// from its start instead, so that a store that answers still has the
/// rank named.
inline constexpr std::chrono::milliseconds kMissingRankLookBudget{2000};
inline constexpr std::chrono::milliseconds kMissingRankQuickLook{200};
StatusOr<Exchanged> ExchangeTopology(store::Store& store, const std::string& key_prefix,
                                     int rank, int size, const LocalView& local,
                                     Deadline deadline);

}  // namespace ddp::transport::topology

#endif  // DDP_TRANSPORT_TOPOLOGY_DISCOVER_H_
