// Fuzzes the topology file parser (DDP_TOPOLOGY_FILE) with file contents.
//
// Properties: a rejected file is an INVALID_ARGUMENT whose message starts
// with the file's name; an accepted topology validates, survives a round
// trip through TopologyToJson unchanged, gives a ring order that is a
// permutation of its ranks, and for every rank a network device choice that
// follows PickNetDevice's documented rule: empty exactly when the rank's host
// has no active port; otherwise one of the fastest active ports of that host
// on the NUMA node of the rank's GPU (or of the rank itself), or of all its
// active ports when none is on that node; and ranks of one host that compete
// for the same ports get different ones while there are enough to go round.

#include <algorithm>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_target.h"
#include "transport/topology/topology.h"

namespace {

using ddp::transport::topology::NetDevice;
using ddp::transport::topology::Topology;

// The NUMA node a rank's port should be near: its GPU's when known,
// otherwise the rank's own (-1: none).
int EffectiveNuma(const Topology& t, int rank) {
  const auto& place = t.ranks[rank];
  const auto& host = t.hosts[place.host];
  if (place.gpu >= 0 && host.gpus[place.gpu].numa_node >= 0) return host.gpus[place.gpu].numa_node;
  return place.numa_node;
}

// Two ranks run under one kernel: their hosts have the same boot id, or
// (where either host lacks one) they are the same host.
bool OneKernel(const Topology& t, int a, int b) {
  const auto& ha = t.hosts[t.ranks[a].host];
  const auto& hb = t.hosts[t.ranks[b].host];
  if (ha.boot_id.empty() || hb.boot_id.empty()) return t.ranks[a].host == t.ranks[b].host;
  return ha.boot_id == hb.boot_id;
}

// What the documented rule allows `rank` to pick from.
struct Choice {
  bool near = false;                    // the pool is the ports on the rank's node
  std::vector<const NetDevice*> fastest;  // the pool's ports at its best rate
};

Choice Allowed(const Topology& t, int rank) {
  const auto& host = t.hosts[t.ranks[rank].host];
  const int numa = EffectiveNuma(t, rank);
  std::vector<const NetDevice*> active, near;
  for (const NetDevice& d : host.net_devices) {
    if (!d.active) continue;
    active.push_back(&d);
    if (numa >= 0 && d.numa_node == numa) near.push_back(&d);
  }
  Choice c;
  c.near = !near.empty();
  const std::vector<const NetDevice*>& pool = c.near ? near : active;
  if (pool.empty()) return c;
  double best = pool.front()->rate_gbps;
  for (const NetDevice* d : pool) best = std::max(best, d->rate_gbps);
  for (const NetDevice* d : pool) {
    if (d->rate_gbps == best) c.fastest.push_back(d);
  }
  return c;
}

// Ranks that compete with `rank` for its pool: those of its kernel, and of
// its NUMA node when the pool is that node's ports; `rank` included.
int Competitors(const Topology& t, int rank, bool near) {
  int n = 0;
  for (int r = 0; r < t.size(); ++r) {
    if (OneKernel(t, r, rank) && (!near || EffectiveNuma(t, r) == EffectiveNuma(t, rank))) ++n;
  }
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ddp::transport;
  using namespace ddp::transport::topology;
  const std::string origin = "fuzz-topology.json";
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  StatusOr<Topology> parsed = ParseTopologyJson(text, origin);
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.status().code() == StatusCode::kInvalidArgument,
               "a bad file is not INVALID_ARGUMENT");
    FUZZ_CHECK(parsed.status().message().rfind(origin, 0) == 0,
               "the error does not start with the file's name");
    return 0;
  }
  const Topology& t = *parsed;
  FUZZ_CHECK(t.Validate().ok(), "an accepted topology does not validate");

  const std::string json = TopologyToJson(t);
  StatusOr<Topology> again = ParseTopologyJson(json, "round-trip");
  FUZZ_CHECK(again.ok(), "a written topology does not parse");
  FUZZ_CHECK(TopologyToJson(*again) == json, "a topology changed in a round trip");

  std::vector<int> order = RingOrder(t);
  std::sort(order.begin(), order.end());
  std::vector<int> expected(t.size());
  std::iota(expected.begin(), expected.end(), 0);
  FUZZ_CHECK(order == expected, "the ring order is not a permutation of the ranks");
  std::vector<std::string> devices(t.size());
  std::vector<Choice> allowed(t.size());
  for (int rank = 0; rank < t.size(); ++rank) {
    devices[rank] = PickNetDevice(t, rank);
    allowed[rank] = Allowed(t, rank);
    const std::vector<const NetDevice*>& fastest = allowed[rank].fastest;
    if (fastest.empty()) {
      FUZZ_CHECK(devices[rank].empty(), "a port was picked on a host with no active port");
      continue;
    }
    FUZZ_CHECK(std::any_of(fastest.begin(), fastest.end(),
                           [&](const NetDevice* d) { return d->UcxName() == devices[rank]; }),
               "the picked port is not one of the fastest active ports the rule allows");
    FUZZ_CHECK(RanksSharingKernel(t, rank) == Competitors(t, rank, /*near=*/false),
               "RanksSharingKernel does not count the ranks of the rank's kernel");
  }
  // Spreading: two ranks of one host drawing from the same pool (both from
  // the ports of one NUMA node, or both from all ports) take different ports
  // when no more ranks compete for that pool than it has fastest ports
  // (with distinct names, so that different ports read differently).
  for (int s = 0; s < t.size(); ++s) {
    const Choice& cs = allowed[s];
    if (cs.fastest.empty()) continue;
    std::set<std::string> names;
    for (const NetDevice* d : cs.fastest) names.insert(d->UcxName());
    if (names.size() != cs.fastest.size()) continue;
    if (Competitors(t, s, cs.near) > static_cast<int>(names.size())) continue;
    for (int r = 0; r < s; ++r) {
      if (t.ranks[r].host != t.ranks[s].host || allowed[r].near != cs.near) continue;
      if (cs.near && EffectiveNuma(t, r) != EffectiveNuma(t, s)) continue;
      FUZZ_CHECK(devices[r] != devices[s],
                 "two ranks competing for enough ports were given the same one");
    }
  }
  return 0;
}
