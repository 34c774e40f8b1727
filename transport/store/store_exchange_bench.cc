// How long W ranks take to exchange one value each through the TCP store,
// the pattern of communicator creation (each rank sets its key, then reads
// everyone's): with a Get per rank, as creation did, and with MultiGet, as
// it does now. Ranks are threads of this process, each with its own
// connection to one server thread.
//
//   bazel run -c opt //transport/store:store_exchange_bench -- 64 256 512
//
// Prints per world size: ranks, the way, wall ms (slowest rank), server
// requests.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "transport/store/tcp_store.h"

namespace ddp::transport::store {
namespace {

// One exchange among `ranks` threads; returns the wall time in ms, or -1
// with a message on stderr when some rank failed.
double Exchange(TcpStoreServer& server, int ranks, bool multi, const std::string& prefix) {
  std::vector<std::unique_ptr<TcpStoreClient>> clients(ranks);
  for (int r = 0; r < ranks; ++r) {
    auto client = TcpStoreClient::Connect("127.0.0.1", server.port(), "bench", DeadlineIn(std::chrono::seconds(60)));
    if (!client.ok()) {
      std::fprintf(stderr, "store_exchange_bench: connect: %s\n", client.status().ToString().c_str());
      return -1;
    }
    clients[r] = std::move(*client);
  }
  std::vector<std::string> keys;
  for (int r = 0; r < ranks; ++r) keys.push_back(prefix + std::to_string(r));
  const std::string value(600, 'a');  // about a UCX worker address
  std::vector<Status> results(ranks);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      const Deadline deadline = DeadlineIn(std::chrono::seconds(120));
      TcpStoreClient& c = *clients[r];
      results[r] = c.Set(keys[r], value, deadline);
      if (!results[r].ok()) return;
      if (multi) {
        results[r] = c.MultiGet(keys, deadline).status();
        return;
      }
      for (const std::string& key : keys) {
        results[r] = c.Get(key, deadline).status();
        if (!results[r].ok()) return;
      }
    });
  }
  for (auto& t : threads) t.join();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < ranks; ++r) {
    if (!results[r].ok()) {
      std::fprintf(stderr, "store_exchange_bench: rank %d: %s\n", r, results[r].ToString().c_str());
      return -1;
    }
  }
  return ms;
}

int Main(int argc, char** argv) {
  std::vector<int> sizes;
  for (int i = 1; i < argc; ++i) {
    char* end = nullptr;
    const long n = std::strtol(argv[i], &end, 10);
    if (end == argv[i] || *end != '\0' || n < 1 || n > 4096) {
      std::fprintf(stderr, "store_exchange_bench: world size '%s' is not a number in [1, 4096]\n", argv[i]);
      return 2;
    }
    sizes.push_back(static_cast<int>(n));
  }
  if (sizes.empty()) sizes = {64, 256};
  TcpStoreServerOptions options;
  options.job_token = "bench";
  auto server = TcpStoreServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "store_exchange_bench: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("# ranks way wall_ms server_requests\n");
  int round = 0;
  for (int ranks : sizes) {
    for (bool multi : {false, true}) {
      const uint64_t before = (*server)->stats().requests;
      const double ms = Exchange(**server, ranks, multi, "round" + std::to_string(round++) + "/");
      if (ms < 0) return 1;
      std::printf("%d %s %.1f %llu\n", ranks, multi ? "multi_get" : "get_each", ms,
                  static_cast<unsigned long long>((*server)->stats().requests - before));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace ddp::transport::store

int main(int argc, char** argv) { return ddp::transport::store::Main(argc, argv); }
