// Fuzzes the topology file parser (DDP_TOPOLOGY_FILE) with file contents.
//
// Properties: a rejected file is an INVALID_ARGUMENT whose message starts
// with the file's name; an accepted topology validates, survives a round
// trip through TopologyToJson unchanged, gives a ring order that is a
// permutation of its ranks, and a network device choice for every rank.

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_target.h"
#include "transport/topology/topology.h"

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
  for (int rank = 0; rank < t.size(); ++rank) {
    const std::string device = PickNetDevice(t, rank);
    (void)device;
  }
  return 0;
}
