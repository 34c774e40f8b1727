#include "transport/topology/topology.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

namespace ddp::transport::topology {
namespace {

using nlohmann::json;

const char* TypeName(const json& value) { return value.type_name(); }

// Reads typed fields out of a JSON object, naming the field on error.
class FieldReader {
 public:
  FieldReader(const json& object, std::string path, std::string_view origin)
      : object_(object), path_(std::move(path)), origin_(origin) {}

  Status Error(const std::string& field, const std::string& what) const {
    return InvalidArgumentError(std::string(origin_) + ": " + Join(field) + ": " + what);
  }
  std::string Join(const std::string& field) const {
    return path_.empty() ? field : path_ + "." + field;
  }

  Status Int(const char* field, bool required, int& out, int min_value) const {
    auto it = object_.find(field);
    if (it == object_.end()) {
      return required ? Error(field, "missing (an integer is required)") : Status::Ok();
    }
    if (!it->is_number_integer()) {
      return Error(field, std::string("expected an integer, got ") + TypeName(*it));
    }
    // An unsigned value of 2^63 or more would wrap negative in get<int64_t>
    // (18446744073709551615 read as -1), so it is range-checked as unsigned.
    const bool too_big = it->is_number_unsigned()
                             ? it->get<uint64_t>() > (uint64_t{1} << 24)
                             : it->get<int64_t>() > (int64_t{1} << 24);
    if (too_big || it->get<int64_t>() < min_value) {
      return Error(field, it->dump() + " is out of range [" + std::to_string(min_value) + ", " +
                              std::to_string(1 << 24) + "]");
    }
    out = static_cast<int>(it->get<int64_t>());
    return Status::Ok();
  }
  Status Number(const char* field, double& out) const {
    auto it = object_.find(field);
    if (it == object_.end()) return Status::Ok();
    if (!it->is_number()) return Error(field, std::string("expected a number, got ") + TypeName(*it));
    out = it->get<double>();
    if (out < 0) return Error(field, "must not be negative");
    return Status::Ok();
  }
  Status String(const char* field, bool required, std::string& out) const {
    auto it = object_.find(field);
    if (it == object_.end()) {
      return required ? Error(field, "missing (a string is required)") : Status::Ok();
    }
    if (!it->is_string()) return Error(field, std::string("expected a string, got ") + TypeName(*it));
    out = it->get<std::string>();
    return Status::Ok();
  }
  Status Bool(const char* field, bool& out) const {
    auto it = object_.find(field);
    if (it == object_.end()) return Status::Ok();
    if (!it->is_boolean()) return Error(field, std::string("expected true or false, got ") + TypeName(*it));
    out = it->get<bool>();
    return Status::Ok();
  }
  // The array at `field` (nullptr when absent and optional).
  StatusOr<const json*> Array(const char* field, bool required) const {
    auto it = object_.find(field);
    if (it == object_.end()) {
      if (required) return Error(field, "missing (an array is required)");
      return static_cast<const json*>(nullptr);
    }
    if (!it->is_array()) return Error(field, std::string("expected an array, got ") + TypeName(*it));
    return &*it;
  }
  Status CheckKnown(std::initializer_list<const char*> known) const {
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      if (std::find_if(known.begin(), known.end(),
                       [&](const char* k) { return it.key() == k; }) == known.end()) {
        return Error(it.key(), "unknown field");
      }
    }
    return Status::Ok();
  }

 private:
  const json& object_;
  std::string path_;
  std::string_view origin_;
};

Status ExpectObject(const json& value, const std::string& path, std::string_view origin) {
  if (!value.is_object()) {
    return InvalidArgumentError(std::string(origin) + ": " + path + ": expected an object, got " +
                                TypeName(value));
  }
  return Status::Ok();
}

std::string Indexed(const std::string& base, size_t i) {
  return base + "[" + std::to_string(i) + "]";
}

}  // namespace

std::vector<int> Topology::RanksOnHost(int host) const {
  std::vector<int> out;
  for (int r = 0; r < size(); ++r) {
    if (ranks[r].host == host) out.push_back(r);
  }
  return out;
}

Status CheckDescribedHostsSplitReal(const Topology& described, const Topology& real, std::string_view origin) {
  // The first rank seen on each described host, whose real host the others
  // of that described host must share.
  std::vector<int> first(described.hosts.size(), -1);
  const int n = std::min(described.size(), real.size());
  for (int r = 0; r < n; ++r) {
    int& f = first[described.ranks[r].host];
    if (f < 0) {
      f = r;
    } else if (!real.SameHost(f, r)) {
      return InvalidArgumentError(
          std::string(origin) + ": ranks " + std::to_string(f) + " and " + std::to_string(r) +
          " are on one described host (\"" + described.hosts[described.ranks[r].host].name +
          "\") but run on different hosts (\"" + real.hosts[real.ranks[f].host].name + "\" and \"" +
          real.hosts[real.ranks[r].host].name +
          "\"): a topology may split a host into several, not join hosts into one");
    }
  }
  return Status::Ok();
}

StatusOr<Topology> Subset(const Topology& topology, const std::vector<int>& ranks) {
  std::vector<int> new_host(topology.hosts.size(), -1);
  std::vector<bool> taken(topology.ranks.size(), false);
  for (int r : ranks) {
    if (r < 0 || r >= topology.size() || taken[r]) {
      return InvalidArgumentError("topology subset: rank " + std::to_string(r) +
                                  (r >= 0 && r < topology.size() ? " given twice" : " out of range") +
                                  " (" + std::to_string(topology.size()) + " ranks)");
    }
    taken[r] = true;
    new_host[topology.ranks[r].host] = 0;
  }
  Topology part;
  for (size_t h = 0; h < topology.hosts.size(); ++h) {
    if (new_host[h] < 0) continue;
    new_host[h] = part.num_hosts();
    part.hosts.push_back(topology.hosts[h]);
  }
  for (int r : ranks) {
    RankPlace place = topology.ranks[r];
    place.host = new_host[place.host];
    part.ranks.push_back(place);
  }
  return part;
}

bool Topology::Uniform() const {
  std::vector<int> counts(hosts.size(), 0);
  for (const RankPlace& place : ranks) ++counts[place.host];
  return std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end();
}

int Gpu::LinkRank(int peer) const {
  for (size_t i = 0; i < nvlink_peers.size(); ++i) {
    if (nvlink_peers[i] == peer) return i < peer_perf_ranks.size() ? peer_perf_ranks[i] : 0;
  }
  return -1;
}

Status Topology::Validate() const {
  if (hosts.empty()) return InvalidArgumentError("hosts: at least one host is required");
  if (ranks.empty()) return InvalidArgumentError("ranks: at least one rank is required");
  std::vector<bool> used(hosts.size(), false);
  for (size_t h = 0; h < hosts.size(); ++h) {
    const Host& host = hosts[h];
    const int gpus = static_cast<int>(host.gpus.size());
    for (size_t g = 0; g < host.gpus.size(); ++g) {
      const std::vector<int>& peers = host.gpus[g].nvlink_peers;
      for (size_t k = 0; k < peers.size(); ++k) {
        const int peer = peers[k];
        if (peer < 0 || peer >= gpus || peer == static_cast<int>(g)) {
          return InvalidArgumentError(Indexed(Indexed("hosts", h) + ".gpus", g) +
                                      ".nvlink_peers: " + std::to_string(peer) +
                                      " is not another GPU of this host (" +
                                      std::to_string(gpus) + " GPUs)");
        }
        if (std::find(peers.begin(), peers.begin() + static_cast<std::ptrdiff_t>(k), peer) !=
            peers.begin() + static_cast<std::ptrdiff_t>(k)) {
          return InvalidArgumentError(Indexed(Indexed("hosts", h) + ".gpus", g) + ".nvlink_peers: " +
                                      std::to_string(peer) + " is listed twice");
        }
      }
      const Gpu& gpu = host.gpus[g];
      if (!gpu.peer_perf_ranks.empty() && gpu.peer_perf_ranks.size() != gpu.nvlink_peers.size()) {
        return InvalidArgumentError(Indexed(Indexed("hosts", h) + ".gpus", g) + ".peer_perf_ranks: " +
                                    std::to_string(gpu.peer_perf_ranks.size()) + " entries for " +
                                    std::to_string(gpu.nvlink_peers.size()) +
                                    " nvlink_peers; give one per peer");
      }
      for (size_t k = 0; k < gpu.peer_perf_ranks.size(); ++k) {
        if (gpu.peer_perf_ranks[k] < 0) {
          return InvalidArgumentError(Indexed(Indexed(Indexed("hosts", h) + ".gpus", g) + ".peer_perf_ranks", k) +
                                      ": " + std::to_string(gpu.peer_perf_ranks[k]) +
                                      " is negative (0 is the best link)");
        }
      }
      if (host.gpus[g].numa_node >= host.numa_nodes) {
        return InvalidArgumentError(Indexed(Indexed("hosts", h) + ".gpus", g) + ".numa_node: " +
                                    std::to_string(host.gpus[g].numa_node) + " but the host has " +
                                    std::to_string(host.numa_nodes) + " NUMA nodes");
      }
    }
    for (size_t d = 0; d < host.net_devices.size(); ++d) {
      if (host.net_devices[d].numa_node >= host.numa_nodes) {
        return InvalidArgumentError(Indexed(Indexed("hosts", h) + ".net_devices", d) +
                                    ".numa_node: " + std::to_string(host.net_devices[d].numa_node) +
                                    " but the host has " + std::to_string(host.numa_nodes) +
                                    " NUMA nodes");
      }
    }
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    const RankPlace& place = ranks[r];
    if (place.host < 0 || place.host >= num_hosts()) {
      return InvalidArgumentError(Indexed("ranks", r) + ".host: " + std::to_string(place.host) +
                                  " is not a host index (" + std::to_string(num_hosts()) +
                                  " hosts)");
    }
    used[place.host] = true;
    const Host& host = hosts[place.host];
    if (place.numa_node >= host.numa_nodes) {
      return InvalidArgumentError(Indexed("ranks", r) + ".numa_node: " +
                                  std::to_string(place.numa_node) + " but host " +
                                  std::to_string(place.host) + " has " +
                                  std::to_string(host.numa_nodes) + " NUMA nodes");
    }
    if (place.gpu >= static_cast<int>(host.gpus.size())) {
      return InvalidArgumentError(Indexed("ranks", r) + ".gpu: " + std::to_string(place.gpu) +
                                  " but host " + std::to_string(place.host) + " has " +
                                  std::to_string(host.gpus.size()) + " GPUs");
    }
  }
  for (size_t h = 0; h < hosts.size(); ++h) {
    if (!used[h]) return InvalidArgumentError(Indexed("hosts", h) + ": no rank runs on this host");
  }
  return Status::Ok();
}

StatusOr<Topology> ParseTopologyJson(std::string_view text, std::string_view origin) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    // Not only parse_error: a number too large for a double is out_of_range.
    return InvalidArgumentError(std::string(origin) + ": not valid JSON: " + e.what());
  }
  DDP_RETURN_IF_ERROR(ExpectObject(root, "top level", origin));
  FieldReader top(root, "", origin);
  DDP_RETURN_IF_ERROR(top.CheckKnown({"hosts", "ranks"}));
  Topology topology;

  DDP_ASSIGN_OR_RETURN(const json* hosts, top.Array("hosts", true));
  for (size_t h = 0; h < hosts->size(); ++h) {
    const std::string path = Indexed("hosts", h);
    DDP_RETURN_IF_ERROR(ExpectObject((*hosts)[h], path, origin));
    FieldReader in(( *hosts)[h], path, origin);
    DDP_RETURN_IF_ERROR(in.CheckKnown({"name", "boot_id", "numa_nodes", "net_devices", "gpus"}));
    Host host;
    DDP_RETURN_IF_ERROR(in.String("name", false, host.name));
    if (host.name.empty()) host.name = "host" + std::to_string(h);
    DDP_RETURN_IF_ERROR(in.String("boot_id", false, host.boot_id));
    DDP_RETURN_IF_ERROR(in.Int("numa_nodes", false, host.numa_nodes, 1));
    DDP_ASSIGN_OR_RETURN(const json* devices, in.Array("net_devices", false));
    for (size_t d = 0; devices != nullptr && d < devices->size(); ++d) {
      const std::string dpath = Indexed(path + ".net_devices", d);
      DDP_RETURN_IF_ERROR(ExpectObject((*devices)[d], dpath, origin));
      FieldReader dev((*devices)[d], dpath, origin);
      DDP_RETURN_IF_ERROR(
          dev.CheckKnown({"name", "port", "numa_node", "link_layer", "rate_gbps", "active"}));
      NetDevice device;
      DDP_RETURN_IF_ERROR(dev.String("name", true, device.name));
      DDP_RETURN_IF_ERROR(dev.Int("port", false, device.port, 1));
      DDP_RETURN_IF_ERROR(dev.Int("numa_node", false, device.numa_node, -1));
      DDP_RETURN_IF_ERROR(dev.String("link_layer", false, device.link_layer));
      DDP_RETURN_IF_ERROR(dev.Number("rate_gbps", device.rate_gbps));
      DDP_RETURN_IF_ERROR(dev.Bool("active", device.active));
      host.net_devices.push_back(std::move(device));
    }
    DDP_ASSIGN_OR_RETURN(const json* gpus, in.Array("gpus", false));
    for (size_t g = 0; gpus != nullptr && g < gpus->size(); ++g) {
      const std::string gpath = Indexed(path + ".gpus", g);
      DDP_RETURN_IF_ERROR(ExpectObject((*gpus)[g], gpath, origin));
      FieldReader gpu_in((*gpus)[g], gpath, origin);
      DDP_RETURN_IF_ERROR(
          gpu_in.CheckKnown({"numa_node", "pci_bus_id", "nvlink_peers", "peer_perf_ranks"}));
      Gpu gpu;
      DDP_RETURN_IF_ERROR(gpu_in.Int("numa_node", false, gpu.numa_node, -1));
      DDP_RETURN_IF_ERROR(gpu_in.String("pci_bus_id", false, gpu.pci_bus_id));
      // Integers up to 2^24, as the other fields: a larger one would wrap
      // in the conversion to int (4294967297 read as 1) or overflow the
      // ring search's sums of performance ranks.
      auto read_ints = [&](const char* field, std::vector<int>& out) -> Status {
        DDP_ASSIGN_OR_RETURN(const json* list, gpu_in.Array(field, false));
        for (size_t p = 0; list != nullptr && p < list->size(); ++p) {
          const json& item = (*list)[p];
          const std::string where = std::string(origin) + ": " + Indexed(gpath + "." + field, p);
          if (!item.is_number_integer()) {
            return InvalidArgumentError(where + ": expected an integer, got " + TypeName(item));
          }
          // (Negative ones are named by Validate.)
          // Both bounds compared directly: std::abs of INT64_MIN is undefined
          // (it read -9223372036854775808 as peer 0).
          const int64_t limit = int64_t{1} << 24;
          const bool huge = item.is_number_unsigned()
                                ? item.get<uint64_t>() > static_cast<uint64_t>(limit)
                                : item.get<int64_t>() > limit || item.get<int64_t>() < -limit;
          if (huge) {
            return InvalidArgumentError(where + ": " + item.dump() + " is out of range [0, " +
                                        std::to_string(1 << 24) + "]");
          }
          out.push_back(static_cast<int>(item.get<int64_t>()));
        }
        return Status::Ok();
      };
      DDP_RETURN_IF_ERROR(read_ints("nvlink_peers", gpu.nvlink_peers));
      DDP_RETURN_IF_ERROR(read_ints("peer_perf_ranks", gpu.peer_perf_ranks));
      host.gpus.push_back(std::move(gpu));
    }
    topology.hosts.push_back(std::move(host));
  }

  DDP_ASSIGN_OR_RETURN(const json* ranks, top.Array("ranks", true));
  for (size_t r = 0; r < ranks->size(); ++r) {
    const std::string path = Indexed("ranks", r);
    DDP_RETURN_IF_ERROR(ExpectObject((*ranks)[r], path, origin));
    FieldReader in((*ranks)[r], path, origin);
    DDP_RETURN_IF_ERROR(in.CheckKnown({"host", "numa_node", "gpu"}));
    RankPlace place;
    DDP_RETURN_IF_ERROR(in.Int("host", true, place.host, 0));
    DDP_RETURN_IF_ERROR(in.Int("numa_node", false, place.numa_node, -1));
    DDP_RETURN_IF_ERROR(in.Int("gpu", false, place.gpu, -1));
    topology.ranks.push_back(place);
  }
  Status valid = topology.Validate();
  if (!valid.ok()) return InvalidArgumentError(std::string(origin) + ": " + valid.message());
  // What a hand-written file gets wrong and Validate lets pass (discovery
  // cannot make these): a link listed from one end only costs differently
  // each way round the ring, and two GPUs with one bus id would be merged
  // into one when ranks' views of a host are joined.
  for (size_t h = 0; h < topology.hosts.size(); ++h) {
    const std::vector<Gpu>& gpus = topology.hosts[h].gpus;
    for (size_t g = 0; g < gpus.size(); ++g) {
      const std::string path = Indexed(Indexed("hosts", h) + ".gpus", g);
      for (const int peer : gpus[g].nvlink_peers) {
        const std::vector<int>& back = gpus[static_cast<size_t>(peer)].nvlink_peers;
        if (std::find(back.begin(), back.end(), static_cast<int>(g)) == back.end()) {
          return InvalidArgumentError(std::string(origin) + ": " + path + ".nvlink_peers lists " +
                                      std::to_string(peer) + ", but " +
                                      Indexed(Indexed("hosts", h) + ".gpus", static_cast<size_t>(peer)) +
                                      ".nvlink_peers does not list " + std::to_string(g) +
                                      ": list each link from both ends");
        }
      }
      if (gpus[g].pci_bus_id.empty()) continue;
      for (size_t k = 0; k < g; ++k) {
        if (gpus[k].pci_bus_id == gpus[g].pci_bus_id) {
          return InvalidArgumentError(std::string(origin) + ": " + path + ".pci_bus_id: " +
                                      gpus[g].pci_bus_id + " is GPU " + std::to_string(k) +
                                      "'s too");
        }
      }
    }
  }
  return topology;
}

namespace {

// What a file that is not a regular one is, for the refusal.
std::string FileTypeName(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

StatusOr<Topology> LoadTopologyFile(const std::string& path) {
  // open(2), for errno: a path that is not there and one that may not be
  // read need different fixes. Close-on-exec: another thread may fork and
  // exec meanwhile. Non-blocking: a FIFO without a writer would block the
  // open itself; it is refused below without waiting.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int error = errno;
    return NotFoundError("topology file " + path + " cannot be opened: " + std::strerror(error));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    return InvalidArgumentError("topology file " + path + " cannot be read: " + std::strerror(error));
  }
  // Only a regular file has an end and a size known before reading: a
  // device (/dev/zero) or a FIFO could be read until memory ran out, or
  // forever, on every rank of the host.
  if (S_ISDIR(info.st_mode)) {
    ::close(fd);
    return InvalidArgumentError("topology file " + path + " cannot be read: " + std::strerror(EISDIR));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return InvalidArgumentError("topology file " + path + " is " + FileTypeName(info.st_mode) +
                                ", not a regular file");
  }
  const std::string limit = std::to_string(kMaxTopologyFileBytes) +
                            " bytes, the most a topology file may hold (is it a topology file?)";
  if (static_cast<uint64_t>(info.st_size) > kMaxTopologyFileBytes) {
    ::close(fd);
    return InvalidArgumentError("topology file " + path + " holds " + std::to_string(info.st_size) +
                                " bytes, more than " + limit);
  }
  // Read to the end, the limit still a guard: the file may grow meanwhile.
  std::string text;
  text.reserve(static_cast<size_t>(info.st_size));
  char block[65536];
  while (true) {
    const ssize_t got = ::read(fd, block, sizeof(block));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      return InvalidArgumentError("topology file " + path + " cannot be read: " + std::strerror(error));
    }
    if (got == 0) break;
    if (text.size() + static_cast<size_t>(got) > kMaxTopologyFileBytes) {
      ::close(fd);
      return InvalidArgumentError("topology file " + path + " grew while it was read past " + limit);
    }
    text.append(block, static_cast<size_t>(got));
  }
  ::close(fd);
  return ParseTopologyJson(text, path);
}

std::string TopologyToJson(const Topology& topology) {
  json root;
  root["hosts"] = json::array();
  for (const Host& host : topology.hosts) {
    json h;
    h["name"] = host.name;
    h["boot_id"] = host.boot_id;
    h["numa_nodes"] = host.numa_nodes;
    h["net_devices"] = json::array();
    for (const NetDevice& d : host.net_devices) {
      h["net_devices"].push_back({{"name", d.name}, {"port", d.port}, {"numa_node", d.numa_node},
                                  {"link_layer", d.link_layer}, {"rate_gbps", d.rate_gbps},
                                  {"active", d.active}});
    }
    h["gpus"] = json::array();
    for (const Gpu& g : host.gpus) {
      json gpu = {{"numa_node", g.numa_node}, {"nvlink_peers", g.nvlink_peers}};
      if (!g.pci_bus_id.empty()) gpu["pci_bus_id"] = g.pci_bus_id;
      if (!g.peer_perf_ranks.empty()) gpu["peer_perf_ranks"] = g.peer_perf_ranks;
      h["gpus"].push_back(std::move(gpu));
    }
    root["hosts"].push_back(std::move(h));
  }
  root["ranks"] = json::array();
  for (const RankPlace& p : topology.ranks) {
    root["ranks"].push_back({{"host", p.host}, {"numa_node", p.numa_node}, {"gpu", p.gpu}});
  }
  return root.dump();
}

int RingHopCost(const Host& host, int gpu_a, int gpu_b) {
  const int link = host.gpus[gpu_a].LinkRank(gpu_b);
  if (link >= 0) return link;
  const int na = host.gpus[gpu_a].numa_node, nb = host.gpus[gpu_b].numa_node;
  return na >= 0 && nb >= 0 && na != nb ? 2000 : 1000;
}

namespace {

// The hop costs of visiting `gpus` in order (closing the ring when `closed`).
std::vector<int> HopCosts(const Host& host, const std::vector<int>& gpus, bool closed) {
  std::vector<int> costs;
  for (size_t i = 0; i + 1 < gpus.size(); ++i) costs.push_back(RingHopCost(host, gpus[i], gpus[i + 1]));
  if (closed && gpus.size() > 2) costs.push_back(RingHopCost(host, gpus.back(), gpus.front()));
  return costs;
}

// Orders `gpus` (ascending, distinct) by exhaustive search: the slowest hop
// first, then the sum of hops, then the hop costs in ring order (so that of
// a ring's two directions the one starting on the better link wins), then
// the GPU numbers. A closed ring starts at the lowest GPU (rotations are the
// same ring).
std::vector<int> BestGpuOrder(const Host& host, std::vector<int> gpus, bool closed) {
  std::vector<int> best;
  std::tuple<int, int, std::vector<int>> best_key;
  do {
    if (closed && gpus.front() != *std::min_element(gpus.begin(), gpus.end())) continue;
    std::vector<int> costs = HopCosts(host, gpus, closed);
    int worst = 0, sum = 0;
    for (int c : costs) {
      worst = std::max(worst, c);
      sum += c;
    }
    auto key = std::make_tuple(worst, sum, std::move(costs));
    if (best.empty() || key < best_key || (key == best_key && gpus < best)) {
      best = gpus;
      best_key = std::move(key);
    }
  } while (std::next_permutation(gpus.begin(), gpus.end()));
  return best;
}

// Beyond kExactRingGpus: within a NUMA node, walk along peer links from the
// lowest GPU to its best-linked unvisited peer (lowest number on ties),
// else to the lowest unvisited GPU.
std::vector<int> WalkGpuOrder(const Host& host, const std::vector<int>& gpus) {
  std::vector<int> sorted = gpus;
  std::stable_sort(sorted.begin(), sorted.end(), [&](int a, int b) {
    return host.gpus[a].numa_node < host.gpus[b].numa_node;
  });
  std::set<int> todo(gpus.begin(), gpus.end());
  std::vector<int> order;
  for (int start : sorted) {
    int current = start;
    while (current >= 0 && todo.count(current) > 0) {
      todo.erase(current);
      order.push_back(current);
      int next = -1, next_rank = 0;
      const Gpu& g = host.gpus[current];
      for (size_t k = 0; k < g.nvlink_peers.size(); ++k) {
        const int peer = g.nvlink_peers[k];
        const int rank = g.LinkRank(peer);
        if (todo.count(peer) == 0) continue;
        if (next < 0 || rank < next_rank || (rank == next_rank && peer < next)) {
          next = peer;
          next_rank = rank;
        }
      }
      current = next;
    }
  }
  return order;
}

}  // namespace

std::vector<int> RingOrder(const Topology& topology) {
  std::vector<int> order;
  order.reserve(topology.size());
  const bool one_host = topology.num_hosts() == 1;
  for (int h = 0; h < topology.num_hosts(); ++h) {
    const Host& host = topology.hosts[h];
    std::map<int, std::vector<int>> ranks_of_gpu;  // GPU -> its ranks, ascending
    std::vector<int> without_gpu;
    for (int r : topology.RanksOnHost(h)) {
      const int gpu = topology.ranks[r].gpu;
      if (gpu >= 0) {
        ranks_of_gpu[gpu].push_back(r);
      } else {
        without_gpu.push_back(r);
      }
    }
    std::vector<int> gpus;
    for (const auto& [gpu, ranks] : ranks_of_gpu) gpus.push_back(gpu);
    // A ring that visits other hosts enters and leaves this one once: an
    // open path. A ring of one host closes on itself.
    const bool closed = one_host && without_gpu.empty();
    const std::vector<int> gpu_order = gpus.size() <= static_cast<size_t>(kExactRingGpus)
                                           ? (gpus.empty() ? gpus : BestGpuOrder(host, gpus, closed))
                                           : WalkGpuOrder(host, gpus);
    for (int gpu : gpu_order) {
      const std::vector<int>& ranks = ranks_of_gpu[gpu];
      order.insert(order.end(), ranks.begin(), ranks.end());
    }
    std::stable_sort(without_gpu.begin(), without_gpu.end(), [&](int a, int b) {
      return topology.ranks[a].numa_node < topology.ranks[b].numa_node;
    });
    order.insert(order.end(), without_gpu.begin(), without_gpu.end());
  }
  return order;
}

namespace {

// Ranks `a` and `b` run on one kernel: their hosts have the same boot id, or,
// where either has none, they are one host.
bool ShareKernel(const Topology& topology, int a, int b) {
  const Host& ha = topology.hosts[topology.ranks[a].host];
  const Host& hb = topology.hosts[topology.ranks[b].host];
  if (ha.boot_id.empty() || hb.boot_id.empty()) return topology.SameHost(a, b);
  return ha.boot_id == hb.boot_id;
}

}  // namespace

std::string PickNetDevice(const Topology& topology, int rank) {
  const RankPlace& place = topology.ranks[rank];
  const Host& host = topology.hosts[place.host];
  int numa = place.numa_node;
  if (place.gpu >= 0 && host.gpus[place.gpu].numa_node >= 0) numa = host.gpus[place.gpu].numa_node;

  std::vector<const NetDevice*> active;
  for (const NetDevice& d : host.net_devices) {
    if (d.active) active.push_back(&d);
  }
  if (active.empty()) return "";
  std::vector<const NetDevice*> near;
  for (const NetDevice* d : active) {
    if (numa >= 0 && d->numa_node == numa) near.push_back(d);
  }
  std::vector<const NetDevice*>& pool = near.empty() ? active : near;
  const double best_rate =
      (*std::max_element(pool.begin(), pool.end(), [](auto* a, auto* b) {
        return a->rate_gbps < b->rate_gbps;
      }))->rate_gbps;
  std::vector<const NetDevice*> fastest;
  for (const NetDevice* d : pool) {
    if (d->rate_gbps == best_rate) fastest.push_back(d);
  }
  // Spread the ranks that compete for the same devices: the i-th such rank
  // on this kernel takes the i-th device, round robin. Those are the ranks of
  // this NUMA node when the pool is its ports; when no port is near, the
  // pool is every port of the host, and so are the ranks counted (ranks of
  // different nodes would otherwise each start at the first port). Ranks
  // are counted by kernel, not by host: pods with the machine's network but
  // their own namespaces are separate hosts that share its ports.
  int index = 0;
  for (int r = 0; r < rank; ++r) {
    if (!ShareKernel(topology, r, rank)) continue;
    const RankPlace& other = topology.ranks[r];
    const Host& other_host = topology.hosts[other.host];
    int other_numa = other.numa_node;
    if (other.gpu >= 0 && other_host.gpus[other.gpu].numa_node >= 0) {
      other_numa = other_host.gpus[other.gpu].numa_node;
    }
    if (near.empty() || other_numa == numa) ++index;
  }
  return fastest[index % fastest.size()]->UcxName();
}

int RanksSharingKernel(const Topology& topology, int rank) {
  int n = 0;
  for (int r = 0; r < topology.size(); ++r) n += ShareKernel(topology, r, rank) ? 1 : 0;
  return n;
}

IdlePolicy ChooseIdlePolicy(const Topology& topology, int rank, int busy_threads_per_rank,
                            int available_cpus, bool kernel_network) {
  const int busy = RanksSharingKernel(topology, rank) * std::max(1, busy_threads_per_rank);
  IdlePolicy policy;
  if (kernel_network && busy >= available_cpus) {
    policy.yield = true;
    policy.at_once = true;
  } else {
    policy.yield = busy > available_cpus;
  }
  return policy;
}

}  // namespace ddp::transport::topology
