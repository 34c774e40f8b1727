// Connects to a store by host name with a deadline, for
// resolve_deadline_test, which runs it inside a network namespace whose
// resolv.conf names 127.0.0.1. The probe itself holds UDP port 53 there and
// never answers, so every lookup waits (a closed port would be refused at
// once). Prints one line:
//
//   <status code name> <elapsed ms>
//
//   resolve_probe HOST PORT DEADLINE_MS          # TcpStoreClient::Connect
//   resolve_probe --plain HOST PORT              # getaddrinfo alone (the control)

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "transport/store/tcp_store.h"

int main(int argc, char** argv) {
  using Clock = std::chrono::steady_clock;
  const bool plain = argc == 4 && std::strcmp(argv[1], "--plain") == 0;
  if (!plain && argc != 4) {
    std::fprintf(stderr, "usage: %s HOST PORT DEADLINE_MS | --plain HOST PORT\n", argv[0]);
    return 2;
  }
  // The silent name server.
  const int dns = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(53);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (dns < 0 || bind(dns, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    std::fprintf(stderr, "%s: cannot hold 127.0.0.1:53 (run inside the test's namespace): %s\n",
                 argv[0], std::strerror(errno));
    return 1;
  }
  const auto start = Clock::now();
  std::string outcome;
  if (plain) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* result = nullptr;
    const int rc = getaddrinfo(argv[2], argv[3], &hints, &result);
    if (result != nullptr) freeaddrinfo(result);
    outcome = rc == 0 ? "OK" : "EAI";
  } else {
    const auto deadline = Clock::now() + std::chrono::milliseconds(std::atoi(argv[3]));
    auto client = ddp::transport::store::TcpStoreClient::Connect(argv[1], std::atoi(argv[2]),
                                                                 "token", deadline);
    outcome = client.ok() ? "OK" : ddp::transport::StatusCodeName(client.status().code());
    if (!client.ok()) std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  std::printf("%s %lld\n", outcome.c_str(), static_cast<long long>(ms.count()));
  close(dns);
  return 0;
}
