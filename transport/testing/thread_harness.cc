#include "transport/testing/thread_harness.h"

#include <thread>

namespace ddp::transport::testing {

std::vector<Status> RunRanks(p2p::LoopbackHub& hub, const RankFn& fn,
                             const HarnessOptions& options) {
  const int world = hub.size();
  std::vector<Status> results(world);
  std::vector<std::thread> threads;
  threads.reserve(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto endpoint = hub.Connect(r);
      if (!endpoint.ok()) {
        results[r] = endpoint.status();
        return;
      }
      results[r] = fn(**endpoint);
      if (!results[r].ok() && options.kill_on_error) hub.Kill(r);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

std::vector<Status> RunRanks(int world, const RankFn& fn, const HarnessOptions& options) {
  p2p::LoopbackHub hub(world);
  return RunRanks(hub, fn, options);
}

}  // namespace ddp::transport::testing
