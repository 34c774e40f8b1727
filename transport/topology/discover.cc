#include "transport/topology/discover.h"

#include <hwloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "transport/file_text.h"

namespace ddp::transport::topology {
namespace {

namespace fs = std::filesystem;

std::string ReadFirstLine(const fs::path& path) {
  const std::optional<std::string> text = ReadWholeFile(path.string());
  return text ? text->substr(0, text->find('\n')) : std::string();
}

int ReadInt(const fs::path& path, int fallback) {
  const std::string text = ReadFirstLine(path);
  if (text.empty()) return fallback;
  try {
    return std::stoi(text);
  } catch (...) {
    return fallback;
  }
}

// Variables that make hwloc read another machine than the one sysfs shows
// (an XML export, a synthetic description, another root): with any of them
// set only hwloc knows what the caller meant.
bool HwlocTopologyRedirected() {
  for (const char* name : {"HWLOC_XMLFILE", "HWLOC_SYNTHETIC", "HWLOC_FSROOT", "HWLOC_COMPONENTS"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && value[0] != '\0') return true;
  }
  return false;
}

}  // namespace

std::optional<NumaView> SingleNumaNodeFromSysfs(const std::string& sysfs_root) {
  const fs::path root = fs::path(sysfs_root) / "devices" / "system" / "node";
  std::error_code error;
  std::optional<int> only;
  for (fs::directory_iterator it(root, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= 4 || name.compare(0, 4, "node") != 0 ||
        name.find_first_not_of("0123456789", 4) != std::string::npos) {
      continue;  // online, possible, has_cpu, power, ...
    }
    if (only.has_value()) return std::nullopt;  // several nodes: hwloc places the rank
    try {
      only = std::stoi(name.substr(4));
    } catch (...) {
      return std::nullopt;
    }
    // The count (one more) must fit the topology record, which takes up to
    // 2^24 nodes (and an int): Linux numbers nodes below 1024, so a larger
    // number is not a node this shortcut should vouch for.
    if (*only >= (1 << 24)) return std::nullopt;
  }
  if (error || !only.has_value()) return std::nullopt;
  return NumaView{*only + 1, *only};
}

// The calling thread's own binding is what counts: BindToCore binds only the
// thread that creates the communicator, and the process's binding is the
// union of all its threads'.
NumaView DiscoverNumaWithHwloc(const DiscoverOptions& options) {
  int numa_nodes = 1;
  int my_node = -1;
  hwloc_topology_t topo;
  // Without hwloc's view the node stays unknown (-1), as it always was.
  if (hwloc_topology_init(&topo) != 0) return {numa_nodes, my_node};
  if (hwloc_topology_load(topo) != 0) {
    hwloc_topology_destroy(topo);
    return {numa_nodes, my_node};
  }
  struct Node {
    int os;
    hwloc_const_cpuset_t cpus;
  };
  std::vector<Node> all;
  for (hwloc_obj_t obj = hwloc_get_next_obj_by_type(topo, HWLOC_OBJ_NUMANODE, nullptr);
       obj != nullptr; obj = hwloc_get_next_obj_by_type(topo, HWLOC_OBJ_NUMANODE, obj)) {
    const int os = static_cast<int>(obj->os_index == HWLOC_UNKNOWN_INDEX ? obj->logical_index
                                                                         : obj->os_index);
    numa_nodes = std::max(numa_nodes, os + 1);
    if (obj->cpuset != nullptr && !hwloc_bitmap_iszero(obj->cpuset)) all.push_back({os, obj->cpuset});
  }
  // The nodes of cores: hwloc gives memory without cores of its own (CXL,
  // HBM) the cpuset of the cores it is attached to, a whole package or
  // machine, so a node whose cpuset strictly contains another's is left out,
  // and of nodes with equal cpusets the first is kept.
  std::vector<Node> nodes;
  for (size_t i = 0; i < all.size(); ++i) {
    bool memory_only = false;
    for (size_t j = 0; j < all.size() && !memory_only; ++j) {
      if (j == i || !hwloc_bitmap_isincluded(all[j].cpus, all[i].cpus)) continue;
      memory_only = j < i || !hwloc_bitmap_isequal(all[j].cpus, all[i].cpus);
    }
    if (!memory_only) nodes.push_back(all[i]);
  }
  hwloc_bitmap_t bound = hwloc_bitmap_alloc();
  if (nodes.size() > 1 && hwloc_get_cpubind(topo, bound, HWLOC_CPUBIND_THREAD) == 0 &&
      !hwloc_bitmap_iszero(bound)) {
    for (const Node& node : nodes) {
      if (hwloc_bitmap_isincluded(bound, node.cpus)) {
        my_node = node.os;
        break;
      }
    }
  }
  if (my_node < 0 && !nodes.empty()) {
    // Not bound to one node: spread the local ranks evenly over the nodes,
    // which is what a binding launcher would have done.
    const size_t spread = options.local_world_size > 0 && options.local_rank >= 0
                              ? static_cast<size_t>(options.local_rank) * nodes.size() /
                                    static_cast<size_t>(options.local_world_size)
                              : 0;
    my_node = nodes[std::min(spread, nodes.size() - 1)].os;
  }
  hwloc_bitmap_free(bound);
  hwloc_topology_destroy(topo);
  if (my_node < 0) my_node = 0;
  return {numa_nodes, my_node};
}

std::string NamespaceIds() {
  std::string ids;
  for (const char* ns : {"pid", "ipc"}) {
    struct stat st {};
    if (stat((std::string("/proc/self/ns/") + ns).c_str(), &st) != 0) continue;
    ids += (ids.empty() ? "" : " ") + std::string(ns) + ":" + std::to_string(st.st_ino);
  }
  return ids;
}

std::vector<NetDevice> ReadNetDevices(const std::string& sysfs_root) {
  std::vector<NetDevice> devices;
  const fs::path root = fs::path(sysfs_root) / "class" / "infiniband";
  std::error_code error;
  if (!fs::is_directory(root, error)) return devices;
  // Stepped with error codes: a device unplugged or unbound while its
  // folder is listed fails the listing (ENODEV, EIO), which the range-for's
  // step threw out of discovery and the communicator's creation. A folder
  // whose listing fails is used as far as it was listed, and a warning
  // says so: ranks of one host may then see different ports and spread
  // over them differently.
  std::vector<std::pair<fs::path, std::error_code>> failed;
  for (fs::directory_iterator it(root, error), end; !error && it != end; it.increment(error)) {
    const fs::directory_entry& entry = *it;
    const std::string name = entry.path().filename().string();
    const int numa = ReadInt(entry.path() / "device" / "numa_node", -1);
    const fs::path ports = entry.path() / "ports";
    std::error_code port_error;
    if (!fs::is_directory(ports, port_error)) continue;
    for (fs::directory_iterator port_it(ports, port_error), port_end; !port_error && port_it != port_end;
         port_it.increment(port_error)) {
      const fs::directory_entry& port_entry = *port_it;
      NetDevice device;
      device.name = name;
      try {
        device.port = std::stoi(port_entry.path().filename().string());
      } catch (...) {
        continue;
      }
      device.numa_node = numa;
      device.link_layer = ReadFirstLine(port_entry.path() / "link_layer");
      // "200 Gb/sec (4X HDR)"
      std::istringstream rate(ReadFirstLine(port_entry.path() / "rate"));
      rate >> device.rate_gbps;
      if (!rate) device.rate_gbps = 0;
      // "4: ACTIVE"; the word alone decides ("5: ACTIVE_DEFER" is not up).
      const std::string state = ReadFirstLine(port_entry.path() / "state");
      const size_t colon = state.find(':');
      std::istringstream word(colon == std::string::npos ? state : state.substr(colon + 1));
      std::string name_of_state;
      word >> name_of_state;
      device.active = name_of_state == "ACTIVE";
      devices.push_back(std::move(device));
    }
    if (port_error) failed.emplace_back(ports, port_error);
  }
  if (error) failed.emplace_back(root, error);
  // Once per folder in a process: a job that makes many communicators on
  // such a host would repeat it at each, but a failure in another folder
  // (another device, another sysfs root) is news and is told too.
  static std::mutex warned_mutex;
  static auto* const warned = new std::set<std::string>();  // folders told of; never freed
  std::string folders;
  if (!failed.empty()) {
    std::lock_guard<std::mutex> lock(warned_mutex);
    for (const auto& [folder, why] : failed) {
      if (!warned->insert(folder.string()).second) continue;
      folders += (folders.empty() ? "" : "; ") + folder.string() + " (" + why.message() + ", errno " +
                 std::to_string(why.value()) + ")";
    }
  }
  if (!folders.empty()) {
    std::fprintf(stderr,
                 "[ddp] pid %d: warning: RDMA port discovery: the listing of %s stopped on an error; the ports "
                 "not listed are left out of this rank's topology (ranks of this host may see different "
                 "ports)\n",
                 static_cast<int>(::getpid()), folders.c_str());
  }
  std::sort(devices.begin(), devices.end(), [](const NetDevice& a, const NetDevice& b) {
    return std::tie(a.name, a.port) < std::tie(b.name, b.port);
  });
  return devices;
}

StatusOr<LocalView> DiscoverLocal(const DiscoverOptions& options) {
  // The local rank picks the GPU (modulo the count) and the NUMA node of an
  // unbound rank: a negative one would index before the GPU list.
  if (options.local_world_size < 1) {
    return InvalidArgumentError("topology discovery: local_world_size " +
                                std::to_string(options.local_world_size) + " must be at least 1");
  }
  if (options.local_rank < 0 || options.local_rank >= options.local_world_size) {
    return InvalidArgumentError("topology discovery: local_rank " + std::to_string(options.local_rank) +
                                " is not in [0, local_world_size " +
                                std::to_string(options.local_world_size) + ")");
  }
  LocalView view;
  char hostname[256] = {};
  if (gethostname(hostname, sizeof(hostname) - 1) != 0) {
    return InternalError("gethostname failed");
  }
  view.host.name = hostname;
  view.host.boot_id = ReadFirstLine(fs::path(options.sysfs_root).parent_path() / "proc" / "sys" /
                                    "kernel" / "random" / "boot_id");
  if (view.host.boot_id.empty()) view.host.boot_id = ReadFirstLine("/proc/sys/kernel/random/boot_id");
  // Loading hwloc's topology took 10-18 ms of every rank's start here; on a
  // host with one NUMA node sysfs gives the same answer at once, as there is
  // no binding to look at (DiscoverNumaWithHwloc checks it only with several
  // nodes).
  std::optional<NumaView> numa;
  if (!HwlocTopologyRedirected()) numa = SingleNumaNodeFromSysfs(options.sysfs_root);
  if (!numa.has_value()) numa = DiscoverNumaWithHwloc(options);
  view.host.numa_nodes = numa->numa_nodes;
  const int my_node = numa->my_node;
  view.host.net_devices = ReadNetDevices(options.sysfs_root);
  for (NetDevice& d : view.host.net_devices) {
    if (d.numa_node >= view.host.numa_nodes) d.numa_node = -1;
  }
  view.host.gpus = DiscoverGpus(options.sysfs_root);
  for (Gpu& g : view.host.gpus) {
    if (g.numa_node >= view.host.numa_nodes) g.numa_node = -1;
  }
  view.place.host = 0;
  view.place.numa_node = my_node;
  if (!view.host.gpus.empty()) {
    view.place.gpu = options.local_rank % static_cast<int>(view.host.gpus.size());
    const int gpu_numa = view.host.gpus[view.place.gpu].numa_node;
    if (gpu_numa >= 0) view.place.numa_node = gpu_numa;
  }
  view.pid = static_cast<int>(getpid());
  view.namespaces = NamespaceIds();
  return view;
}

namespace {

// "name=value name=value" -> {name: value}.
std::map<std::string, std::string> ParseSettings(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream words(text);
  std::string word;
  while (words >> word) {
    const size_t eq = word.find('=');
    out[word.substr(0, eq)] = eq == std::string::npos ? "" : word.substr(eq + 1);
  }
  return out;
}


bool AllHaveBusIds(const std::vector<Gpu>& gpus) {
  return std::all_of(gpus.begin(), gpus.end(), [](const Gpu& g) { return !g.pci_bus_id.empty(); });
}

// Adds a peer link to `gpu` unless it has one to `peer` already; `perf` is
// the link's performance rank, -1 when not given (counts as 0).
void AddPeer(Gpu& gpu, int peer, int perf) {
  if (std::find(gpu.nvlink_peers.begin(), gpu.nvlink_peers.end(), peer) != gpu.nvlink_peers.end()) {
    return;
  }
  if (perf >= 0 || !gpu.peer_perf_ranks.empty()) {
    // Keep one rank per peer; the peers listed without one count as 0.
    gpu.peer_perf_ranks.resize(gpu.nvlink_peers.size(), 0);
    gpu.peer_perf_ranks.push_back(std::max(perf, 0));
  }
  gpu.nvlink_peers.push_back(peer);
}

// Merges one rank's GPUs (`theirs`, numbered by its CUDA_VISIBLE_DEVICES)
// into its host's (`merged`): ranks of one host may each see other GPUs
// (Slurm --gpus-per-task, CUDA_VISIBLE_DEVICES=$LOCAL_RANK), and each
// place.gpu counts its own. The host gets the union by bus id, in first-seen
// order; `gpu` (the rank's place.gpu) and the peer links are renumbered
// into it. Where a GPU on either side has no bus id (no CUDA build, an older
// record, a failed bus id query) the GPUs cannot be matched: the list of the
// first rank that saw any stands, and a rank's GPU past it is unknown (-1)
// rather than an index the host does not have.
void MergeGpus(const std::vector<Gpu>& theirs, std::vector<Gpu>& merged, int& gpu) {
  if (merged.empty()) {
    merged = theirs;
    return;
  }
  if (!AllHaveBusIds(theirs) || !AllHaveBusIds(merged)) {
    if (gpu >= static_cast<int>(merged.size())) gpu = -1;
    return;
  }
  std::vector<int> to_merged(theirs.size());
  for (size_t g = 0; g < theirs.size(); ++g) {
    auto found = std::find_if(merged.begin(), merged.end(), [&](const Gpu& m) {
      return m.pci_bus_id == theirs[g].pci_bus_id;
    });
    if (found == merged.end()) {
      Gpu added = theirs[g];
      added.nvlink_peers.clear();  // added below, renumbered
      added.peer_perf_ranks.clear();
      merged.push_back(std::move(added));
      found = merged.end() - 1;
    }
    to_merged[g] = static_cast<int>(found - merged.begin());
  }
  for (size_t g = 0; g < theirs.size(); ++g) {
    const Gpu& own = theirs[g];
    for (size_t k = 0; k < own.nvlink_peers.size(); ++k) {
      const int peer = own.nvlink_peers[k];
      // ParseTopologyJson validated the record, so `peer` is one of its GPUs.
      if (to_merged[peer] == to_merged[g]) continue;
      AddPeer(merged[to_merged[g]], to_merged[peer],
              k < own.peer_perf_ranks.size() ? own.peer_perf_ranks[k] : -1);
    }
  }
  if (gpu >= 0 && gpu < static_cast<int>(theirs.size())) gpu = to_merged[gpu];
  // A node a rank could not see (its cpuset hides it) is -1 in its record;
  // another rank may know it.
  for (size_t g = 0; g < theirs.size(); ++g) {
    if (merged[to_merged[g]].numa_node < 0) merged[to_merged[g]].numa_node = theirs[g].numa_node;
  }
}

// As MergeGpus for the NUMA nodes of a host's network ports (the same ports
// on every rank, by name and port number): where the host's record says
// -1, another rank's known node is taken.
void MergeNetDeviceNodes(const std::vector<NetDevice>& theirs, std::vector<NetDevice>& merged) {
  for (const NetDevice& d : theirs) {
    if (d.numa_node < 0) continue;
    for (NetDevice& m : merged) {
      if (m.name == d.name && m.port == d.port && m.numa_node < 0) m.numa_node = d.numa_node;
    }
  }
}

// Keeps the peer links that both GPUs report: CUDA can answer peer access
// one way only, and a record, read as a file is, must list every link from
// both ends (a one-way link failed every rank's creation, naming a file).
void KeepMutualPeerLinks(std::vector<Gpu>& gpus) {
  const std::vector<Gpu> seen = gpus;
  for (size_t g = 0; g < gpus.size(); ++g) {
    gpus[g].nvlink_peers.clear();
    gpus[g].peer_perf_ranks.clear();
    const Gpu& own = seen[g];
    for (size_t k = 0; k < own.nvlink_peers.size(); ++k) {
      const int peer = own.nvlink_peers[k];
      if (peer < 0 || peer >= static_cast<int>(seen.size()) || peer == static_cast<int>(g)) continue;
      const auto& back = seen[peer].nvlink_peers;
      if (std::find(back.begin(), back.end(), static_cast<int>(g)) == back.end()) continue;
      gpus[g].nvlink_peers.push_back(peer);
      if (k < own.peer_perf_ranks.size()) gpus[g].peer_perf_ranks.push_back(own.peer_perf_ranks[k]);
    }
    // Performance ranks go with every link or with none.
    if (gpus[g].peer_perf_ranks.size() != gpus[g].nvlink_peers.size()) gpus[g].peer_perf_ranks.clear();
  }
}

}  // namespace

std::string DescribeSettingsMismatch(const std::string& mine, int my_rank, const std::string& theirs,
                                     int their_rank) {
  const auto a = ParseSettings(mine), b = ParseSettings(theirs);
  std::string name = "?", va = "(unset)", vb = "(unset)";
  for (const auto& [key, value] : a) {
    auto it = b.find(key);
    if (it == b.end() || it->second != value) {
      name = key;
      va = value;
      vb = it == b.end() ? "(unset)" : it->second;
      break;
    }
  }
  if (name == "?") {
    for (const auto& [key, value] : b) {
      if (a.count(key) == 0) {
        name = key;
        vb = value;
        break;
      }
    }
  }
  if (name == "?") {
    // The texts differ but no setting does (spacing, or a setting given
    // twice): the texts themselves, quoted so that spacing shows.
    return "settings differ between ranks: rank " + std::to_string(my_rank) + " has \"" + mine +
           "\", rank " + std::to_string(their_rank) + " has \"" + theirs +
           "\" (they must be equal on every rank)";
  }
  return "setting " + name + " differs between ranks: rank " + std::to_string(my_rank) + " has " +
         va + ", rank " + std::to_string(their_rank) + " has " + vb +
         " (it must be equal on every rank)";
}

StatusOr<Exchanged> ExchangeTopology(store::Store& store, const std::string& key_prefix, int rank,
                                     int size, const LocalView& local, Deadline deadline) {
  using nlohmann::json;
  // Checked before posting: a rank outside [0, size) would post under a key
  // no rank reads and wait out the deadline blaming another rank.
  if (size < 1) {
    return InvalidArgumentError("topology exchange: size " + std::to_string(size) +
                                " (the number of ranks) must be at least 1");
  }
  if (rank < 0 || rank >= size) {
    return InvalidArgumentError("topology exchange: rank " + std::to_string(rank) + " is not in [0, " +
                                std::to_string(size) + ") (size " + std::to_string(size) + ")");
  }
  Topology mine;
  mine.hosts.push_back(local.host);
  KeepMutualPeerLinks(mine.hosts[0].gpus);
  mine.ranks.push_back(local.place);
  json posted = json::parse(TopologyToJson(mine));
  posted["pid"] = local.pid;
  posted["namespaces"] = local.namespaces;
  posted["settings"] = local.settings;
  const std::string my_key = key_prefix + "topology/" + std::to_string(rank);
  if (Status set = store.Set(my_key, posted.dump(), deadline); !set.ok()) {
    return Status(set.code(), "topology exchange: posting rank " + std::to_string(rank) + "'s record under " +
                                  my_key + ": " + set.message());
  }

  Exchanged out;
  out.pids.resize(size);
  // Host name, boot id and namespaces: what makes ranks one host.
  std::map<std::tuple<std::string, std::string, std::string>, int> host_index;
  // Every rank's record at once (a round trip per few hundred ranks).
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key_prefix + "topology/" + std::to_string(r));
  StatusOr<std::vector<std::string>> texts = store.MultiGet(keys, deadline);
  if (!texts.ok()) {
    // Name the first rank that has not posted (one look at each, on this
    // path only, within one budget past the deadline: a look per rank of a
    // slow store would add up), as the ranks' keys name only their numbers.
    // The budget runs from the deadline, not from now: a store that looked
    // for the missing key itself (the communicator's WatchfulStore) has
    // spent part of the same window, and a stalled store no longer gets
    // two windows one after the other. A look that starts after that
    // window still gets kMissingRankQuickLook from its start, so that a
    // store that answers has the rank named.
    if (texts.status().code() == StatusCode::kTimedOut) {
      const Clock::time_point now = Clock::now();
      const Deadline looks_until = std::max(DeadlineAfter(std::min(deadline, now), kMissingRankLookBudget),
                                            now + kMissingRankQuickLook);
      for (int r = 0; r < size; ++r) {
        StatusOr<std::optional<std::string>> there = store.TryGet(keys[r], looks_until);
        if (!there.ok()) break;
        if (!there->has_value()) {
          return TimedOutError("topology exchange: rank " + std::to_string(r) + " has not posted its record: " +
                               texts.status().message());
        }
      }
    }
    return Status(texts.status().code(), "topology exchange: " + texts.status().message());
  }
  for (int r = 0; r < size; ++r) {
    const std::string& key = keys[r];
    json parsed = json::parse((*texts)[r], nullptr, false);
    if (parsed.is_discarded() || !parsed.contains("pid") || !parsed["pid"].is_number_integer()) {
      return InternalError("topology exchange: rank " + std::to_string(r) +
                           " posted a malformed record under " + key);
    }
    out.pids[r] = parsed["pid"].get<int>();
    parsed.erase("pid");
    std::string namespaces;
    if (parsed.contains("namespaces")) {
      if (!parsed["namespaces"].is_string()) {
        return InternalError("topology exchange: rank " + std::to_string(r) +
                             " posted malformed namespaces under " + key);
      }
      namespaces = parsed["namespaces"].get<std::string>();
      parsed.erase("namespaces");
    }
    if (parsed.contains("settings")) {
      if (!parsed["settings"].is_string()) {
        return InternalError("topology exchange: rank " + std::to_string(r) +
                             " posted malformed settings under " + key);
      }
      const std::string theirs = parsed["settings"].get<std::string>();
      parsed.erase("settings");
      if (!local.settings.empty() && !theirs.empty() && theirs != local.settings) {
        return InvalidArgumentError(DescribeSettingsMismatch(local.settings, rank, theirs, r));
      }
    }
    DDP_ASSIGN_OR_RETURN(Topology theirs,
                         ParseTopologyJson(parsed.dump(), "topology of rank " + std::to_string(r) + " (" + key + ")"));
    // A rank posts its own view: its host and itself on it. Anything else
    // would be read as its first host and first rank, the rest dropped.
    if (theirs.num_hosts() != 1 || theirs.size() != 1) {
      return InternalError("topology exchange: rank " + std::to_string(r) + " posted a record under " +
                           key + " with " + std::to_string(theirs.num_hosts()) + " hosts and " +
                           std::to_string(theirs.size()) + " ranks (one host and one rank expected)");
    }
    const Host& host = theirs.hosts[0];
    auto [it, inserted] = host_index.emplace(std::make_tuple(host.name, host.boot_id, namespaces),
                                             out.topology.num_hosts());
    RankPlace place = theirs.ranks[0];
    if (inserted) {
      out.topology.hosts.push_back(host);
    } else {
      Host& merged = out.topology.hosts[it->second];
      // A cgroup cpuset can hide NUMA nodes from some of a host's ranks.
      merged.numa_nodes = std::max(merged.numa_nodes, host.numa_nodes);
      MergeGpus(host.gpus, merged.gpus, place.gpu);
      MergeNetDeviceNodes(host.net_devices, merged.net_devices);
    }
    place.host = it->second;
    out.topology.ranks.push_back(place);
  }
  DDP_RETURN_IF_ERROR(out.topology.Validate());
  return out;
}

}  // namespace ddp::transport::topology
