#include "transport/topology/discover.h"

namespace ddp::transport::topology {

// Builds without CUDA see no GPUs.
std::vector<Gpu> DiscoverGpus(const std::string&) { return {}; }

}  // namespace ddp::transport::topology
