// A store host name that the name service never answers for: connecting
// ends at the caller's deadline with TIMED_OUT, not after the C library's
// own resolver retries. The test builds that world for real: a network
// namespace whose resolv.conf (bind-mounted by `ip netns exec` from
// /etc/netns/<name>/) names 127.0.0.1, where the probe holds UDP port 53
// and never answers. A control run of plain getaddrinfo in the same setting
// shows the lookup really hangs there.
// Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), as CI runs it.

#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "transport/launch/launch_test_util.h"

namespace ddp::transport::store {
namespace {

using namespace std::chrono_literals;
namespace lt = launch::testing;

constexpr char kPrefix[] = "ddpdns";
constexpr char kName[] = "store.ddp-test.invalid";

std::string Ip() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(path, X_OK) == 0) return path;
  }
  return "ip";
}

lt::ProgramRun Run(std::vector<std::string> argv) {
  return lt::RunProgram(std::move(argv), {}, 30s);
}

// A namespace whose name server is 127.0.0.1; removed with its
// /etc/netns entry on destruction, and left-overs of dead runs first.
class SilentDns {
 public:
  SilentDns() {
    for (const auto& entry : std::filesystem::directory_iterator("/run/netns", ec_)) {
      const std::string name = entry.path().filename();
      if (name.rfind(kPrefix, 0) != 0) continue;
      if (access(("/proc/" + name.substr(sizeof(kPrefix) - 1)).c_str(), F_OK) != 0) Remove(name);
    }
    ns_ = kPrefix + std::to_string(getpid());
    const std::string ip = Ip();
    for (const std::vector<std::string>& cmd : std::vector<std::vector<std::string>>{
             {ip, "netns", "add", ns_},
             {ip, "-n", ns_, "link", "set", "lo", "up"},
         }) {
      const lt::ProgramRun run = Run(cmd);
      if (run.exit_code != 0) {
        error_ = "setting up the namespace failed (this test needs root): " + cmd[1] + " " +
                 cmd[2] + ": " + run.output;
        return;
      }
    }
    std::filesystem::create_directories("/etc/netns/" + ns_);
    std::ofstream("/etc/netns/" + ns_ + "/resolv.conf")
        << "nameserver 127.0.0.1\noptions timeout:4 attempts:1\n";
  }
  ~SilentDns() { Remove(ns_); }

  const std::string& error() const { return error_; }

  // Runs `argv` inside the namespace; returns its first output line.
  std::string Exec(std::vector<std::string> argv) {
    argv.insert(argv.begin(), {Ip(), "netns", "exec", ns_});
    return Run(std::move(argv)).output;
  }

 private:
  static void Remove(const std::string& ns) {
    Run({Ip(), "netns", "del", ns});
    std::error_code ec;
    std::filesystem::remove_all("/etc/netns/" + ns, ec);
  }

  std::error_code ec_;
  std::string ns_, error_;
};

// "<CODE> <ms>" from the probe's stdout (stderr lines come first or last).
bool ParseProbe(const std::string& output, std::string* code, long* ms) {
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    if (fields >> *code >> *ms && fields.eof()) return true;
  }
  return false;
}

TEST(ResolveDeadlineTest, UnansweredLookupEndsAtTheConnectDeadline) {
  SilentDns dns;
  ASSERT_EQ(dns.error(), "");
  const std::string probe = lt::Runfile("transport/store/resolve_probe");

  // Control: the resolver by itself waits out its 4 s timeout here.
  std::string code;
  long ms = 0;
  const std::string plain = dns.Exec({probe, "--plain", kName, "29500"});
  ASSERT_TRUE(ParseProbe(plain, &code, &ms)) << plain;
  EXPECT_EQ(code, "EAI") << plain;
  EXPECT_GE(ms, 3500) << "the name server answered; the test cannot show a deadline\n" << plain;

  // The store client gives up at its 800 ms deadline.
  const std::string bounded = dns.Exec({probe, kName, "29500", "800"});
  ASSERT_TRUE(ParseProbe(bounded, &code, &ms)) << bounded;
  EXPECT_EQ(code, "TIMED_OUT") << bounded;
  EXPECT_GE(ms, 750) << bounded;
  EXPECT_LE(ms, 2000) << bounded;
  EXPECT_NE(bounded.find(std::string("cannot resolve ") + kName), std::string::npos) << bounded;
}

}  // namespace
}  // namespace ddp::transport::store
