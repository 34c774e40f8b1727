// Host names the test controls, for real: each case builds a network
// namespace whose /etc files (resolv.conf, hosts, nsswitch.conf) are its
// own, bind-mounted by `ip netns exec` from /etc/netns/<name>/, and runs the
// probe (resolve_probe) inside.
//
// - A name the name service never answers for: connecting ends at the
//   caller's deadline with TIMED_OUT, not after the C library's own resolver
//   retries, and so does a server's start at its start_deadline. resolv.conf names 127.0.0.1, where the probe holds UDP port 53
//   and never answers; a control run of plain getaddrinfo shows the lookup
//   really hangs there.
// - A name without an address (answered at once from the hosts file): the
//   client looks it up again until its deadline, and connects once the name
//   gets one (a Kubernetes headless service has no record until its pod is
//   up).
// - A name with an IPv4 and an IPv6 address: the server listens on both.
//
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

// Files of a namespace's own /etc: name, contents.
using EtcFiles = std::vector<std::pair<std::string, std::string>>;

// A namespace with its own /etc `files`, removed with its /etc/netns entry
// on destruction, and left-overs of dead runs first.
class TestNamespace {
 public:
  explicit TestNamespace(const EtcFiles& files) {
    for (const auto& entry : std::filesystem::directory_iterator("/run/netns", ec_)) {
      const std::string name = entry.path().filename();
      if (name.rfind(kPrefix, 0) != 0) continue;
      const std::string pid = name.substr(sizeof(kPrefix) - 1, name.find('-') - (sizeof(kPrefix) - 1));
      if (access(("/proc/" + pid).c_str(), F_OK) != 0) Remove(name);
    }
    static int count = 0;
    ns_ = kPrefix + std::to_string(getpid()) + "-" + std::to_string(count++);
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
    std::filesystem::create_directories(Dir());
    for (const auto& [name, contents] : files) std::ofstream(Dir() + "/" + name) << contents;
  }
  ~TestNamespace() { Remove(ns_); }
  TestNamespace(const TestNamespace&) = delete;
  TestNamespace& operator=(const TestNamespace&) = delete;

  const std::string& error() const { return error_; }
  // The namespace's own copy of /etc/<name>, as seen from outside and inside.
  std::string EtcFile(const std::string& name) const { return Dir() + "/" + name; }

  // Runs `argv` inside the namespace; returns its output.
  std::string Exec(std::vector<std::string> argv) {
    argv.insert(argv.begin(), {Ip(), "netns", "exec", ns_});
    return Run(std::move(argv)).output;
  }

 private:
  std::string Dir() const { return "/etc/netns/" + ns_; }

  static void Remove(const std::string& ns) {
    Run({Ip(), "netns", "del", ns});
    std::error_code ec;
    std::filesystem::remove_all("/etc/netns/" + ns, ec);
  }

  std::error_code ec_;
  std::string ns_, error_;
};

// A namespace whose names are those of `hosts` and no others: no name
// server is asked.
EtcFiles HostsOnly(const std::string& hosts) {
  return {{"nsswitch.conf", "hosts: files\n"}, {"hosts", hosts}};
}

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
  // The resolver's timeout is what a lookup that ignores the deadline
  // waits: long against the 800 ms deadline, so that the bound below (half
  // of it) leaves a loaded machine seconds past the deadline.
  constexpr long kResolverMs = 8000;
  constexpr long kBoundMs = kResolverMs / 2;
  TestNamespace dns(EtcFiles{
      {"resolv.conf", "nameserver 127.0.0.1\noptions timeout:" + std::to_string(kResolverMs / 1000) +
                          " attempts:1\n"}});
  ASSERT_EQ(dns.error(), "");
  const std::string probe = lt::Runfile("transport/store/resolve_probe");

  // Control: the resolver by itself is still waiting well past the bound
  // (given up there, at about half its timeout: the rest of the wait
  // shows nothing more).
  std::string code;
  long ms = 0;
  const std::string plain = dns.Exec({probe, "--plain", kName, "29500", std::to_string(kBoundMs + 500)});
  ASSERT_TRUE(ParseProbe(plain, &code, &ms)) << plain;
  EXPECT_EQ(code, "HUNG") << "the name server answered; the test cannot show a deadline\n" << plain;
  EXPECT_GE(ms, kBoundMs + 500) << plain;

  // The store client gives up at its 800 ms deadline.
  const std::string bounded = dns.Exec({probe, kName, "29500", "800"});
  ASSERT_TRUE(ParseProbe(bounded, &code, &ms)) << bounded;
  EXPECT_EQ(code, "TIMED_OUT") << bounded;
  EXPECT_GE(ms, 750) << bounded;
  EXPECT_LE(ms, kBoundMs) << bounded;
  EXPECT_NE(bounded.find(std::string("cannot resolve ") + kName), std::string::npos) << bounded;

  // A server's start gives up at its start_deadline too (it used to wait
  // for up to 30 s, here for the resolver's timeout).
  const std::string served = dns.Exec({probe, "--serve", kName, "800"});
  ASSERT_TRUE(ParseProbe(served, &code, &ms)) << served;
  EXPECT_EQ(code, "TIMED_OUT") << served;
  EXPECT_GE(ms, 750) << served;
  EXPECT_LE(ms, kBoundMs) << served;
  EXPECT_NE(served.find(std::string("cannot resolve ") + kName), std::string::npos) << served;
}

// The name has no address, and the hosts file says so at once: the client
// asks again until its deadline (the old client gave up after the first
// answer), then names the host and the lookup's answer.
TEST(ResolveDeadlineTest, NameWithoutAnAddressIsLookedUpUntilTheDeadline) {
  TestNamespace ns(HostsOnly("127.0.0.1 localhost\n"));
  ASSERT_EQ(ns.error(), "");
  const std::string probe = lt::Runfile("transport/store/resolve_probe");
  std::string code;
  long ms = 0;
  // Control: the lookup itself is answered at once.
  const std::string plain = ns.Exec({probe, "--plain", kName, "29500"});
  ASSERT_TRUE(ParseProbe(plain, &code, &ms)) << plain;
  EXPECT_EQ(code, "EAI") << plain;
  EXPECT_LT(ms, 500) << plain;

  const std::string bounded = ns.Exec({probe, kName, "29500", "800"});
  ASSERT_TRUE(ParseProbe(bounded, &code, &ms)) << bounded;
  EXPECT_EQ(code, "UNAVAILABLE") << bounded;
  EXPECT_GE(ms, 750) << bounded;
  EXPECT_LE(ms, 3000) << bounded;
  EXPECT_NE(bounded.find(std::string("cannot resolve ") + kName +
                         ":29500: Name or service not known"),
            std::string::npos)
      << bounded;
}

// The name gets its address 500 ms into a 10 s connect: the client finds
// it and connects.
TEST(ResolveDeadlineTest, NameThatGetsAnAddressLaterIsConnectedTo) {
  TestNamespace ns(HostsOnly("127.0.0.1 localhost\n"));
  ASSERT_EQ(ns.error(), "");
  const std::string probe = lt::Runfile("transport/store/resolve_probe");
  const std::string run =
      ns.Exec({probe, "--appear", ns.EtcFile("hosts"), kName, "500", "10000"});
  std::string code;
  long ms = 0;
  ASSERT_TRUE(ParseProbe(run, &code, &ms)) << run;
  EXPECT_EQ(code, "OK") << run;
  EXPECT_GE(ms, 450) << run;
  EXPECT_LE(ms, 5000) << run;
}

// A name with an IPv4 and an IPv6 address (listed twice): the server
// listens at both, so a client trying either finds it. The old server bound
// the first address only and refused clients at the other.
TEST(ResolveDeadlineTest, ServerListensAtEveryAddressOfItsName) {
  TestNamespace ns(HostsOnly(std::string("127.0.0.1 localhost\n") + "127.0.0.1 " + kName +
                             "\n::1 " + kName + "\n127.0.0.1 " + kName + "\n"));
  ASSERT_EQ(ns.error(), "");
  const std::string addresses = ns.Exec({Ip(), "-6", "addr", "show", "dev", "lo"});
  ASSERT_NE(addresses.find("::1"), std::string::npos)
      << "the namespace's loopback has no ::1: this test needs IPv6 (off in this kernel?): " << addresses;
  const std::string probe = lt::Runfile("transport/store/resolve_probe");
  const std::string run = ns.Exec({probe, "--dual", kName});
  std::string code;
  long ms = 0;
  ASSERT_TRUE(ParseProbe(run, &code, &ms)) << run;
  EXPECT_EQ(code, "OK") << run;
}

}  // namespace
}  // namespace ddp::transport::store
