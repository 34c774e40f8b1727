// Connects to a store by host name with a deadline, for
// resolve_deadline_test, which runs it inside a network namespace of its
// own (with its own resolv.conf, hosts and nsswitch.conf, bind-mounted by
// `ip netns exec` from /etc/netns/<name>/). Prints one line:
//
//   <status code name> <elapsed ms>
//
//   resolve_probe HOST PORT DEADLINE_MS          # TcpStoreClient::Connect
//   resolve_probe --plain HOST PORT [GIVE_UP_MS] # getaddrinfo alone (the control);
//       with GIVE_UP_MS, a lookup still unanswered then prints HUNG and exits
//   resolve_probe --serve HOST DEADLINE_MS       # TcpStoreServer::Start on HOST
//   resolve_probe --appear HOSTS NAME DELAY_MS DEADLINE_MS
//       serves a store on 127.0.0.1 and connects to it as NAME, which the
//       probe adds to the hosts file HOSTS (the namespace's) after DELAY_MS
//   resolve_probe --dual NAME
//       serves a store on NAME and connects to it at 127.0.0.1 and at ::1
//
// The first three hold UDP port 53 on 127.0.0.1 and never answer there, so
// that a lookup through a resolv.conf naming 127.0.0.1 waits (a closed port
// would be refused at once).

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include "transport/store/tcp_store.h"

namespace {

namespace store = ddp::transport::store;
using Clock = std::chrono::steady_clock;
constexpr char kToken[] = "probe-token";

std::string Outcome(const ddp::transport::Status& status) {
  if (!status.ok()) std::fprintf(stderr, "%s\n", status.ToString().c_str());
  return status.ok() ? "OK" : ddp::transport::StatusCodeName(status.code());
}

std::string Connect(const std::string& host, int port, Clock::time_point deadline) {
  auto client = store::TcpStoreClient::Connect(host, port, kToken, deadline);
  if (!client.ok()) return Outcome(client.status());
  return Outcome((*client)->Set("probe", "1", deadline));
}

std::string Serve(const std::string& bind_address,
                  std::unique_ptr<store::TcpStoreServer>* server) {
  store::TcpStoreServerOptions options;
  options.bind_address = bind_address;
  options.job_token = kToken;
  auto started = store::TcpStoreServer::Start(options);
  if (!started.ok()) return Outcome(started.status());
  *server = std::move(started).value();
  return "OK";
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool plain = (argc == 4 || argc == 5) && mode == "--plain";
  const bool appear = argc == 6 && mode == "--appear";
  const bool dual = argc == 3 && mode == "--dual";
  const bool serve = argc == 4 && mode == "--serve";
  const bool bounded = argc == 4 && mode.rfind("--", 0) != 0;
  if (!plain && !appear && !dual && !serve && !bounded) {
    std::fprintf(stderr,
                 "usage: %s HOST PORT DEADLINE_MS | --plain HOST PORT [GIVE_UP_MS] | --serve HOST DEADLINE_MS | "
                 "--appear HOSTS NAME DELAY_MS DEADLINE_MS | --dual NAME\n",
                 argv[0]);
    return 2;
  }
  int dns = -1;
  if (plain || bounded || serve) {
    // The silent name server.
    dns = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(53);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (dns < 0 || bind(dns, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      std::fprintf(stderr, "%s: cannot hold 127.0.0.1:53 (run inside the test's namespace): %s\n",
                   argv[0], std::strerror(errno));
      return 1;
    }
  }
  const auto start = Clock::now();
  std::string outcome;
  if (plain) {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    // Detached: a lookup that hangs past GIVE_UP_MS is left to the exit.
    std::thread([&, host = std::string(argv[2]), service = std::string(argv[3])] {
      addrinfo hints{};
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* result = nullptr;
      const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
      if (result != nullptr) freeaddrinfo(result);
      std::lock_guard lock(mu);
      outcome = rc == 0 ? "OK" : "EAI";
      done = true;
      cv.notify_all();
    }).detach();
    std::unique_lock lock(mu);
    if (argc == 5) {
      if (!cv.wait_for(lock, std::chrono::milliseconds(std::atoi(argv[4])), [&] { return done; })) {
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
        std::printf("HUNG %lld\n", static_cast<long long>(ms.count()));
        std::fflush(stdout);
        _exit(0);  // the lookup's thread still holds `outcome`
      }
    } else {
      cv.wait(lock, [&] { return done; });
    }
  } else if (bounded) {
    outcome = Connect(argv[1], std::atoi(argv[2]),
                      Clock::now() + std::chrono::milliseconds(std::atoi(argv[3])));
  } else if (serve) {
    store::TcpStoreServerOptions options;
    options.bind_address = argv[2];
    options.start_deadline = Clock::now() + std::chrono::milliseconds(std::atoi(argv[3]));
    outcome = Outcome(store::TcpStoreServer::Start(options).status());
  } else if (appear) {
    const std::string hosts = argv[2], name = argv[3];
    const auto delay = std::chrono::milliseconds(std::atoi(argv[4]));
    const auto deadline = Clock::now() + std::chrono::milliseconds(std::atoi(argv[5]));
    std::unique_ptr<store::TcpStoreServer> server;
    outcome = Serve("127.0.0.1", &server);
    if (outcome == "OK") {
      std::thread publisher([&] {
        std::this_thread::sleep_for(delay);
        // Appended in place: the namespace's /etc/hosts is this very file.
        std::ofstream(hosts, std::ios::app) << "127.0.0.1 " << name << "\n";
      });
      outcome = Connect(name, server->port(), deadline);
      publisher.join();
    }
  } else {  // dual
    std::unique_ptr<store::TcpStoreServer> server;
    outcome = Serve(argv[2], &server);
    for (const char* address : {"127.0.0.1", "::1"}) {
      if (outcome != "OK") break;
      outcome = Connect(address, server->port(), Clock::now() + std::chrono::seconds(2));
    }
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  std::printf("%s %lld\n", outcome.c_str(), static_cast<long long>(ms.count()));
  if (dns >= 0) close(dns);
  return 0;
}
