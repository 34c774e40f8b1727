// The fault matrix: a real training job (//examples:train under ddprun, two
// ranks, Fashion-MNIST, checkpoints every 5 steps) meets one fault per row,
// injected into the unmodified trainer with a ptrace breakpoint:
//
//   kill -9 of a rank in forward, backward, the optimizer step, and in the
//   middle of writing a checkpoint; SIGSTOP of a rank (a hang, not a death);
//   a rank that exits 0 early; and two hosts (network namespaces) whose link
//   is cut.
//
// Each row measures: the time from the fault until the launcher named it
// and until every rank had ended; the launcher's exit status; processes of
// the job left running after the launcher exited; and whether the last
// checkpoint loads (strictly, into the model). It asserts bounds on each
// and prints a markdown row; docs/reliability.md holds the measured table.

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "nn/io/checkpoint.h"
#include "nn/modules/models.h"
#include "tests/faults/injector.h"
#include "transport/launch/launch_test_util.h"

namespace ddp::faults {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
namespace lt = transport::launch::testing;

// Collective deadline given to the trainer: a hung or cut-off rank is
// declared failed after this. Generous, so that a rank starved of CPU (CI
// runs several tests on 2 cores) does not time out before the fault, and
// twice the death bound, so that a death found only by the deadline fails
// the death rows.
constexpr int kTimeoutS = 20;
// Bounds asserted per row (seconds from the fault).
// A rank died or exited: the launcher sees it at once and stops the others
// (3 s grace at most); this does not wait for the deadline, and must not.
// Half the deadline: wide for a loaded machine, and a row that waited for
// the deadline (the survivor's collective began about when the fault hit)
// takes about twice this.
constexpr double kDeathBoundS = 10;
static_assert(kDeathBoundS <= kTimeoutS / 2, "a death found by the deadline must fail the bound");
constexpr double kHangBoundS = kTimeoutS + 12;      // deadline, then the launcher's grace
// A cut link: the launchers' heartbeat (--node_timeout=5) or the deadline,
// then the grace period and the store's own timeouts.
constexpr double kPartitionBoundS = kTimeoutS + 20;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Processes (not zombies) whose command line mentions `marker`.
std::vector<pid_t> ProcessesMentioning(const std::string& marker) {
  std::vector<pid_t> found;
  DIR* d = opendir("/proc");
  if (d == nullptr) return found;
  while (dirent* e = readdir(d)) {
    const pid_t pid = std::atoi(e->d_name);
    if (pid <= 0 || pid == getpid()) continue;
    const std::string base = "/proc/" + std::string(e->d_name);
    std::string cmdline = ReadFile(base + "/cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (cmdline.find(marker) == std::string::npos) continue;
    const std::string stat = ReadFile(base + "/stat");
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z') continue;
    found.push_back(pid);
  }
  closedir(d);
  return found;
}

// The value of `name` in a process's environment, or "".
std::string EnvOf(pid_t pid, const std::string& name) {
  const std::string env = ReadFile("/proc/" + std::to_string(pid) + "/environ");
  const std::string key = name + "=";
  for (size_t pos = 0; pos < env.size();) {
    const size_t end = env.find('\0', pos);
    const std::string entry = env.substr(pos, end == std::string::npos ? end : end - pos);
    if (entry.rfind(key, 0) == 0) return entry.substr(key.size());
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  return "";
}

bool Alive(pid_t pid) {
  const std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

// A launcher (and its ranks) started by the test, with its output read line
// by line as it comes, each line stamped with its arrival time.
class Launcher {
 public:
  explicit Launcher(std::vector<std::string> argv,
                    std::vector<std::pair<std::string, std::string>> env = {}) {
    int out[2];
    EXPECT_EQ(pipe2(out, O_CLOEXEC), 0);
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ == 0) {
      // Dies with the test (killed by its timeout, say) rather than running
      // on as an orphan; a test that died before this line is caught by
      // the parent check. (The signal follows the death of the thread that
      // forked: the test's main thread.)
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(126);
      setpgid(0, 0);
      dup2(out[1], 1);
      dup2(out[1], 2);
      for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
      std::vector<char*> args;
      for (std::string& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      std::fprintf(stderr, "exec %s: %s\n", args[0], std::strerror(errno));
      _exit(127);
    }
    close(out[1]);
    reader_ = std::thread([this, fd = out[0]] { Read(fd); });
  }

  // Bounded: a process of the job that outlives its launcher (in a process
  // group of its own) may hold the output pipe open for ever; the reader
  // then gives up on it, told to stop.
  ~Launcher() {
    if (!exited_) {
      kill(-pid_, SIGKILL);
      Wait(10s);
    }
    WaitForOutputEnd(5s);
    stop_ = true;
    if (reader_.joinable()) reader_.join();
  }

  pid_t pid() const { return pid_; }

  // Waits for the launcher to exit; its exit code (128 + signal), or -1.
  int Wait(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    while (!exited_) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        exit_time_ = Clock::now();
        code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      if (Clock::now() >= until) return -1;
      std::this_thread::sleep_for(2ms);
    }
    return code_;
  }
  Clock::time_point exit_time() const { return exit_time_; }

  // The first line containing `text` and when it arrived.
  std::optional<std::pair<Clock::time_point, std::string>> FindLine(const std::string& text) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [t, line] : lines_) {
      if (line.find(text) != std::string::npos) return std::make_pair(t, line);
    }
    return std::nullopt;
  }

  // The first line matching `pattern` (ECMAScript) and when it arrived.
  std::optional<std::pair<Clock::time_point, std::string>> FindLineMatching(
      const std::regex& pattern) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [t, line] : lines_) {
      if (std::regex_search(line, pattern)) return std::make_pair(t, line);
    }
    return std::nullopt;
  }

  std::string Output() {
    std::lock_guard<std::mutex> lock(mu_);
    std::string all;
    for (const auto& [t, line] : lines_) all += line + "\n";
    return all;
  }

  // The pids of its ranks (its children), by RANK; waits until there are
  // `count` of them.
  std::map<int, pid_t> Ranks(int count, std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    std::map<int, pid_t> ranks;
    while (Clock::now() < until) {
      ranks.clear();
      std::istringstream children(ReadFile("/proc/" + std::to_string(pid_) + "/task/" +
                                           std::to_string(pid_) + "/children"));
      for (pid_t child; children >> child;) {
        const std::string rank = EnvOf(child, "RANK");
        if (!rank.empty()) ranks[std::atoi(rank.c_str())] = child;
      }
      if (static_cast<int>(ranks.size()) >= count) break;
      std::this_thread::sleep_for(5ms);
    }
    return ranks;
  }

 private:
  // Reads until the end of the output or, waiting for more, until told to
  // stop.
  void Read(int fd) {
    std::string partial;
    char buf[4096];
    while (!stop_.load()) {
      pollfd p{fd, POLLIN, 0};
      const int ready = poll(&p, 1, 50);
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) break;
      if (ready == 0) continue;
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n <= 0) break;
      const auto now = Clock::now();
      partial.append(buf, static_cast<size_t>(n));
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t nl; (nl = partial.find('\n')) != std::string::npos;) {
        lines_.emplace_back(now, partial.substr(0, nl));
        partial.erase(0, nl + 1);
      }
    }
    close(fd);
    eof_ = true;
  }

 public:
  // Waits (bounded: a leftover process may hold the pipe) until the output
  // ended, so that the last lines are in.
  void WaitForOutputEnd(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    while (!eof_.load() && Clock::now() < until) std::this_thread::sleep_for(2ms);
  }

 private:
  std::atomic<bool> eof_{false};
  std::atomic<bool> stop_{false};
  pid_t pid_ = -1;
  bool exited_ = false;
  int code_ = -1;
  Clock::time_point exit_time_{};
  std::thread reader_;
  std::mutex mu_;
  std::vector<std::pair<Clock::time_point, std::string>> lines_;
};

// Watches processes and records when each one ended.
class EndWatch {
 public:
  explicit EndWatch(std::vector<pid_t> pids) : pids_(std::move(pids)) {
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        bool all = true;
        {
          std::lock_guard<std::mutex> lock(mu_);
          for (pid_t pid : pids_) {
            if (ended_.count(pid)) continue;
            if (!Alive(pid)) {
              ended_[pid] = Clock::now();
            } else {
              all = false;
            }
          }
        }
        if (all) break;
        std::this_thread::sleep_for(2ms);
      }
    });
  }
  ~EndWatch() {
    stop_ = true;
    thread_.join();
  }
  // When `pid` ended, as the watcher saw it. The watcher polls every 2 ms
  // but may not have run since the process ended (the launcher can reap a
  // rank and exit before the watcher's next turn on a busy machine), so a
  // process found dead here but not yet recorded is waited for, bounded.
  std::optional<Clock::time_point> EndOf(pid_t pid,
                                         std::chrono::milliseconds timeout = 2000ms) {
    const auto until = Clock::now() + timeout;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = ended_.find(pid);
        if (it != ended_.end()) return it->second;
      }
      if (Alive(pid) || Clock::now() >= until) break;
      std::this_thread::sleep_for(1ms);
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ended_.find(pid);
    if (it == ended_.end()) return std::nullopt;
    return it->second;
  }

 private:
  std::vector<pid_t> pids_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::map<pid_t, Clock::time_point> ended_;
  std::thread thread_;
};

std::string TempDir(const std::string& name) {
  return lt::MakeTempDir("faults_" + name);
}

// The trainer's arguments for a row: MLP on 4096 Fashion-MNIST samples, many
// epochs (the fault ends it), a checkpoint every 5 steps into `dir`.
std::vector<std::string> TrainerArgs(const std::string& dir) {
  return {lt::Runfile("examples/train"),
          "--model=mlp",
          "--train_samples=4096",
          "--test_samples=256",
          "--batch_size=32",
          "--epochs=100",
          "--checkpoint=" + dir + "/ckpt.safetensors",
          "--checkpoint_every=5",
          "--timeout_s=" + std::to_string(kTimeoutS)};
}

// Step of the checkpoint at `path` after loading it strictly into the MLP,
// or -1 (and why, in `error`) when it does not load.
int64_t LoadCheckpointStep(const std::string& path, std::string* error) {
  try {
    const nn::io::Checkpoint c = nn::io::LoadCheckpoint(path);
    auto model = nn::modules::MakeMlp();
    model->LoadStateDict(c.model);  // strict: every key, shape and dtype
    return nn::io::MetadataInt(c.metadata, "step", path);
  } catch (const std::exception& e) {
    *error = e.what();
    return -1;
  }
}

// Waits until the checkpoint loads with a step of at least `step`.
bool WaitForCheckpoint(const std::string& path, int64_t step, std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  while (Clock::now() < until) {
    std::string error;
    if (access(path.c_str(), F_OK) == 0 && LoadCheckpointStep(path, &error) >= step) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

struct RowResult {
  std::string fault;
  double first_report_s = -1;      // a surviving rank or the launcher reported the failure
  double launcher_reports_s = -1;  // the launcher named the failed rank
  double all_ranks_ended_s = -1;   // the last rank process ended
  double launcher_exit_s = -1;     // the launcher exited
  int launcher_exit = -1;
  int survivors_reporting = 0;     // surviving ranks that printed the failure themselves
  int survivors = 0;
  int left_over = 0;
  int64_t checkpoint_step = -1;
  std::string checkpoint_error;
  bool crashed = false;            // a survivor aborted or crashed instead of failing cleanly
  // The temporary checkpoint file (nn/io's `<name>.tmp.<pid>.<n>.<host>`)
  // the victim left: its size, the length its safetensors prefix gives the
  // header, and the size of the checkpoint on disk; -1 when none.
  int64_t victim_temporary_size = -1;
  int64_t victim_temporary_header = -1;
  int64_t checkpoint_size = -1;
};

// The size of the temporary file process `pid` left beside `path`, and the
// header length in its first 8 bytes (-1 when shorter); {-1, -1} when none.
std::pair<int64_t, int64_t> TemporaryOf(const std::string& path, pid_t pid) {
  const size_t slash = path.rfind('/');
  const std::string dir = path.substr(0, slash);
  const std::string prefix = path.substr(slash + 1) + ".tmp." + std::to_string(pid) + ".";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return {-1, -1};
  std::string found;
  while (dirent* e = readdir(d)) {
    if (std::string(e->d_name).rfind(prefix, 0) == 0) found = dir + "/" + e->d_name;
  }
  closedir(d);
  if (found.empty()) return {-1, -1};
  const std::string bytes = ReadFile(found);
  int64_t header = -1;
  if (bytes.size() >= 8) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
    header = static_cast<int64_t>(n);
  }
  return {static_cast<int64_t>(bytes.size()), header};
}

void PrintRow(const RowResult& r) {
  std::printf(
      "| %s | %.2f s | %.2f s | %.2f s | %d after %.2f s | %d of %d | %d | %s |\n",
      r.fault.c_str(), r.first_report_s, r.launcher_reports_s, r.all_ranks_ended_s,
      r.launcher_exit, r.launcher_exit_s, r.survivors_reporting, r.survivors, r.left_over,
      r.checkpoint_step >= 0 ? ("loads, step " + std::to_string(r.checkpoint_step)).c_str()
                             : ("does not load: " + r.checkpoint_error).c_str());
  std::fflush(stdout);
}

// When a surviving rank reported the failed job itself (its first line
// naming PEER_LOST or TIMED_OUT), if it did. With `prefixed`, the rank's
// lines start with "[rank] " (several ranks share the launcher's output).
std::optional<Clock::time_point> RankReport(Launcher& launcher, int rank, bool prefixed = true) {
  std::optional<Clock::time_point> first;
  for (const char* word : {"PEER_LOST", "TIMED_OUT"}) {
    if (auto line = launcher.FindLine(word)) {
      if (prefixed && line->second.rfind("[" + std::to_string(rank) + "] ", 0) != 0) continue;
      if (!first || line->first < *first) first = line->first;
    }
  }
  return first;
}

// A survivor that crashed (rather than failing cleanly) leaves one of these.
bool ShowsACrash(const std::string& output) {
  for (const char* sign : {"SIGABRT", "SIGSEGV", "SIGBUS", "Assertion", "terminate called"}) {
    if (output.find(sign) != std::string::npos) return true;
  }
  return false;
}

// One row on one host: ddprun with 2 ranks; the fault is `action` at
// `function` in rank `victim` (the `hit_number`th call), once the job has
// saved step 10.
RowResult RunRow(const std::string& fault, int victim, const std::string& function,
                 FaultAction action, const std::string& launcher_line, int hit_number = 1) {
  RowResult row;
  row.fault = fault;
  std::string slug;
  for (char ch : fault) slug.push_back(std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_');
  const std::string dir = TempDir(slug);
  const std::string checkpoint = dir + "/ckpt.safetensors";
  std::vector<std::string> argv = {lt::Runfile("transport/launch/ddprun"), "--standalone",
                                   "--nproc_per_node=2", "--grace_period=3"};
  for (const std::string& a : TrainerArgs(dir)) argv.push_back(a);
  Launcher launcher(argv);
  std::map<int, pid_t> ranks = launcher.Ranks(2, 30s);
  EXPECT_EQ(ranks.size(), 2u) << launcher.Output();
  if (ranks.size() != 2) return row;
  EXPECT_TRUE(WaitForCheckpoint(checkpoint, 10, 60s)) << launcher.Output();

  std::vector<pid_t> pids = {ranks[0], ranks[1]};
  EndWatch watch(pids);
  auto injected = InjectAtFunction(ranks[victim], function, action, 20s, hit_number);
  EXPECT_TRUE(injected.ok()) << injected.status() << "\n" << launcher.Output();
  if (!injected.ok()) return row;
  const Clock::time_point t0 = injected->at;

  row.launcher_exit = launcher.Wait(std::chrono::seconds(kTimeoutS + 40));
  EXPECT_NE(row.launcher_exit, -1) << "the launcher did not exit\n" << launcher.Output();
  if (row.launcher_exit == -1) return row;
  row.launcher_exit_s = Seconds(launcher.exit_time() - t0);
  launcher.WaitForOutputEnd(3s);
  // Left over: anything of this job still running once the launcher is gone.
  row.left_over = static_cast<int>(ProcessesMentioning(dir).size());
  std::optional<Clock::time_point> first;
  if (auto line = launcher.FindLine(launcher_line)) {
    row.launcher_reports_s = Seconds(line->first - t0);
    first = line->first;
  }
  Clock::time_point last_end = t0;
  std::string ends;
  for (int r = 0; r < 2; ++r) {
    auto end = watch.EndOf(pids[r]);
    EXPECT_TRUE(end.has_value()) << "rank " << r << " did not end";
    if (end) {
      last_end = std::max(last_end, *end);
      ends += " rank " + std::to_string(r) + " " + std::to_string(Seconds(*end - t0)) + " s";
    }
  }
  row.all_ranks_ended_s = Seconds(last_end - t0);
  std::printf("ended:%s\n", ends.c_str());
  const std::string output = launcher.Output();
  for (int r = 0; r < 2; ++r) {
    if (r == victim) continue;
    ++row.survivors;
    if (auto report = RankReport(launcher, r)) {
      ++row.survivors_reporting;
      if (!first || *report < *first) first = report;
    }
  }
  if (first) row.first_report_s = Seconds(*first - t0);
  row.checkpoint_step = LoadCheckpointStep(checkpoint, &row.checkpoint_error);
  row.crashed = ShowsACrash(output);
  std::tie(row.victim_temporary_size, row.victim_temporary_header) =
      TemporaryOf(checkpoint, pids[victim]);
  struct stat st{};
  if (stat(checkpoint.c_str(), &st) == 0) row.checkpoint_size = st.st_size;
  PrintRow(row);
  std::printf("victim's temporary file: %lld bytes (header %lld); checkpoint %lld bytes\n%s\n",
              static_cast<long long>(row.victim_temporary_size),
              static_cast<long long>(row.victim_temporary_header),
              static_cast<long long>(row.checkpoint_size), output.c_str());
  return row;
}

void ExpectBounds(const RowResult& r, double bound_s) {
  EXPECT_NE(r.launcher_exit, 0) << r.fault << ": the launcher must fail the job";
  EXPECT_NE(r.launcher_exit, -1) << r.fault;
  EXPECT_GE(r.first_report_s, 0) << r.fault << ": nobody reported the failure";
  EXPECT_LE(r.first_report_s, bound_s) << r.fault;
  EXPECT_GE(r.launcher_reports_s, 0) << r.fault << ": the launcher did not name the failure";
  EXPECT_LE(r.launcher_reports_s, bound_s) << r.fault;
  EXPECT_LE(r.all_ranks_ended_s, bound_s) << r.fault;
  EXPECT_LE(r.launcher_exit_s, bound_s) << r.fault;
  EXPECT_EQ(r.left_over, 0) << r.fault << ": processes left running";
  EXPECT_FALSE(r.crashed) << r.fault << ": a surviving rank crashed instead of failing cleanly";
  EXPECT_GE(r.checkpoint_step, 10) << r.fault << ": " << r.checkpoint_error;
}

// ---- two hosts: network namespaces joined by a veth pair ----

constexpr char kNsPrefix[] = "ddpfm";
constexpr char kAddrA[] = "10.232.0.1";
constexpr char kAddrB[] = "10.232.0.2";
constexpr char kDevice[] = "fm0";

std::string Tool(const std::string& name) {
  for (const char* dir : {"/usr/sbin/", "/usr/bin/", "/sbin/", "/bin/"}) {
    if (access((dir + name).c_str(), X_OK) == 0) return dir + name;
  }
  return name;
}

int RunTool(std::vector<std::string> argv, std::string* output = nullptr) {
  const lt::ProgramRun run = lt::RunProgram(std::move(argv), {}, 20s);
  if (output != nullptr) *output = run.output;
  return run.exit_code;
}

// Kills whatever runs in namespace `ns` and deletes it.
void RemoveNamespace(const std::string& ns) {
  std::string pids;
  RunTool({Tool("ip"), "netns", "pids", ns}, &pids);
  std::istringstream in(pids);
  for (pid_t pid; in >> pid;) kill(pid, SIGKILL);
  RunTool({Tool("ip"), "netns", "del", ns});
}

// Namespaces A and B with a veth pair between them; removed (with anything
// running in them) on destruction, and first any left by a run that died.
class TwoHosts {
 public:
  TwoHosts() {
    std::string list;
    RunTool({Tool("ip"), "netns", "list"}, &list);
    std::istringstream in(list);
    for (std::string line; std::getline(in, line);) {
      const std::string name = line.substr(0, line.find(' '));
      if (name.rfind(kNsPrefix, 0) != 0 || name.size() <= sizeof(kNsPrefix)) continue;
      if (access(("/proc/" + name.substr(sizeof(kNsPrefix))).c_str(), F_OK) != 0) {
        RemoveNamespace(name);
      }
    }
    const std::string pid = std::to_string(getpid());
    a_ = std::string(kNsPrefix) + "A" + pid;
    b_ = std::string(kNsPrefix) + "B" + pid;
    const std::string va = "fva" + pid, vb = "fvb" + pid, ip = Tool("ip");
    for (const std::vector<std::string>& cmd : std::vector<std::vector<std::string>>{
             {ip, "netns", "add", a_},
             {ip, "netns", "add", b_},
             {ip, "link", "add", va, "type", "veth", "peer", "name", vb},
             {ip, "link", "set", va, "netns", a_},
             {ip, "link", "set", vb, "netns", b_},
             {ip, "-n", a_, "link", "set", va, "name", kDevice},
             {ip, "-n", b_, "link", "set", vb, "name", kDevice},
             {ip, "-n", a_, "addr", "add", std::string(kAddrA) + "/24", "dev", kDevice},
             {ip, "-n", b_, "addr", "add", std::string(kAddrB) + "/24", "dev", kDevice},
             {ip, "-n", a_, "link", "set", kDevice, "up"},
             {ip, "-n", b_, "link", "set", kDevice, "up"},
             {ip, "-n", a_, "link", "set", "lo", "up"},
             {ip, "-n", b_, "link", "set", "lo", "up"}}) {
      std::string out;
      if (RunTool(cmd, &out) != 0) {
        error_ = "setting up network namespaces failed (this test needs root): ";
        for (const std::string& part : cmd) error_ += part + " ";
        error_ += ": " + out;
        return;
      }
    }
  }
  ~TwoHosts() {
    RemoveNamespace(a_);
    RemoveNamespace(b_);
  }
  const std::string& error() const { return error_; }

  // ddprun for `node` (one rank) in its namespace under its own host name.
  std::unique_ptr<Launcher> StartNode(int node, const std::string& dir) {
    std::vector<std::string> argv = {Tool("ip"), "netns", "exec", node == 0 ? a_ : b_,
                                     Tool("unshare"), "--uts", Tool("sh"), "-c",
                                     "hostname \"$0\" && exec \"$@\"",
                                     "fm-node" + std::to_string(node),
                                     lt::Runfile("transport/launch/ddprun"), "--nnodes=2",
                                     "--node_rank=" + std::to_string(node),
                                     std::string("--master_addr=") + kAddrA,
                                     "--master_port=29556", "--nproc_per_node=1",
                                     "--grace_period=3", "--node_timeout=5"};
    for (const std::string& a : TrainerArgs(dir)) argv.push_back(a);
    return std::make_unique<Launcher>(
        argv, std::vector<std::pair<std::string, std::string>>{
                  {"DDP_JOB_TOKEN", "fault-matrix-token"}, {"UCX_NET_DEVICES", kDevice}});
  }

  void CutLink() {
    RunTool({Tool("ip"), "-n", a_, "link", "set", kDevice, "down"});
    RunTool({Tool("ip"), "-n", b_, "link", "set", kDevice, "down"});
  }

  bool Empty() {
    std::string pa, pb;
    RunTool({Tool("ip"), "netns", "pids", a_}, &pa);
    RunTool({Tool("ip"), "netns", "pids", b_}, &pb);
    return pa.empty() && pb.empty();
  }

 private:
  std::string a_, b_, error_;
};

constexpr char kForward[] = "ddp::dist::DistributedDataParallel::Forward(ddp::nn::Tensor const&";
constexpr char kBackward[] = "ddp::nn::Backward(";
constexpr char kOptimizerStep[] = "ddp::nn::optim::Optimizer::Step(";
constexpr char kCheckpointWrite[] = "ddp::nn::io::AtomicFileWriter::Write(";
// A save writes the 8-byte length prefix, the JSON header, then one tensor
// per call (nn/io/safetensors.cc, WriteSafetensorsFile): the 4th call
// starts the second tensor, with the first one's data already written.
constexpr int kCheckpointWriteHit = 4;

TEST(FaultMatrix, KillDuringForward) {
  ExpectBounds(RunRow("kill -9 rank 1 in forward", 1, kForward, FaultAction::kKill,
                      "rank 1 (pid"),
               kDeathBoundS);
}

TEST(FaultMatrix, KillDuringBackward) {
  ExpectBounds(RunRow("kill -9 rank 1 in backward", 1, kBackward, FaultAction::kKill,
                      "rank 1 (pid"),
               kDeathBoundS);
}

TEST(FaultMatrix, KillDuringOptimizerStep) {
  ExpectBounds(RunRow("kill -9 rank 0 in the optimizer step", 0, kOptimizerStep,
                      FaultAction::kKill, "rank 0 (pid"),
               kDeathBoundS);
}

TEST(FaultMatrix, KillDuringCheckpointWrite) {
  const RowResult row = RunRow("kill -9 rank 0 while writing a checkpoint", 0, kCheckpointWrite,
                               FaultAction::kKill, "rank 0 (pid", kCheckpointWriteHit);
  ExpectBounds(row, kDeathBoundS);
  // The kill came in the middle of the data: the writer's temporary file
  // holds the prefix, the header and some tensor data, not all of it; the
  // previous checkpoint (step 10 or later, checked above) loads strictly.
  EXPECT_GT(row.victim_temporary_header, 0) << "no temporary file with a header was left";
  EXPECT_GT(row.victim_temporary_size, 8 + row.victim_temporary_header)
      << "no tensor data in the temporary file";
  EXPECT_LT(row.victim_temporary_size, row.checkpoint_size)
      << "the temporary file was complete: the kill came after the data";
}

TEST(FaultMatrix, StoppedRankIsAHang) {
  // Nobody dies: the other rank's collective deadline finds the hang.
  ExpectBounds(RunRow("SIGSTOP rank 1 in backward", 1, kBackward, FaultAction::kStop,
                      "rank 0 (pid"),
               kHangBoundS);
}

TEST(FaultMatrix, RankExitsZeroEarly) {
  ExpectBounds(RunRow("rank 1 exits 0 in the optimizer step", 1, kOptimizerStep,
                      FaultAction::kExitZero, "rank 0 (pid"),
               kDeathBoundS);
}

// Two hosts, one rank each; the link between them goes down mid-training.
// Nobody dies: each rank gives up, reporting the cut itself or stopped by
// its launcher, which names it (a missed heartbeat); both launchers must
// exit non-zero.
TEST(FaultMatrix, NetworkLinkCutBetweenTwoHosts) {
  TwoHosts hosts;
  ASSERT_EQ(hosts.error(), "");
  RowResult row;
  row.fault = "link cut between two hosts (network namespaces)";
  const std::string dir = TempDir("netns");
  const std::string checkpoint = dir + "/ckpt.safetensors";
  std::unique_ptr<Launcher> node0 = hosts.StartNode(0, dir);
  std::unique_ptr<Launcher> node1 = hosts.StartNode(1, dir);
  std::map<int, pid_t> ranks0 = node0->Ranks(1, 30s), ranks1 = node1->Ranks(1, 30s);
  ASSERT_EQ(ranks0.size(), 1u) << node0->Output();
  ASSERT_EQ(ranks1.size(), 1u) << node1->Output();
  ASSERT_TRUE(WaitForCheckpoint(checkpoint, 10, 90s)) << node0->Output() << node1->Output();
  const std::vector<pid_t> pids = {ranks0.begin()->second, ranks1.begin()->second};
  EndWatch watch(pids);

  const Clock::time_point t0 = Clock::now();
  hosts.CutLink();
  const int exit0 = node0->Wait(std::chrono::seconds(kTimeoutS + 60));
  const int exit1 = node1->Wait(std::chrono::seconds(kTimeoutS + 60));
  node0->WaitForOutputEnd(3s);
  node1->WaitForOutputEnd(3s);
  row.launcher_exit = exit0 != 0 ? exit0 : exit1;
  row.launcher_exit_s = Seconds(std::max(node0->exit_time(), node1->exit_time()) - t0);
  row.left_over = static_cast<int>(ProcessesMentioning(dir).size());
  EXPECT_TRUE(hosts.Empty());
  std::optional<Clock::time_point> first;
  for (Launcher* l : {node0.get(), node1.get()}) {
    if (auto line = l->FindLine("ddprun: ")) {
      const double s = Seconds(line->first - t0);
      if (row.launcher_reports_s < 0 || s < row.launcher_reports_s) row.launcher_reports_s = s;
      if (!first || line->first < *first) first = line->first;
    }
  }
  // Each rank's own report of the failure, on its own node's output: the
  // trainer's failure line (train_main.cc's Fail: "train: " for rank 0,
  // "train: rank 1: " for the others) naming PEER_LOST or TIMED_OUT; not
  // the launcher's lines, which quote a rank's error too. A rank without
  // one must have been stopped by its launcher for the cut, which says so
  // (the heartbeat of the other node's launcher is missed after
  // --node_timeout=5, before the 10 s collective deadline: node 0's rank,
  // which serves nothing itself, is stopped so).
  const std::regex launcher_stopped("^ddprun: .*(sent no heartbeat|PEER_LOST|TIMED_OUT)");
  for (int r = 0; r < 2; ++r) {
    ++row.survivors;
    Launcher& node = r == 0 ? *node0 : *node1;
    const std::regex own_line(r == 0 ? "^train: (?!rank [0-9]+: ).*\\b(PEER_LOST|TIMED_OUT)\\b"
                                     : "^train: rank " + std::to_string(r) +
                                           ": .*\\b(PEER_LOST|TIMED_OUT)\\b");
    auto report = node.FindLineMatching(own_line);
    if (!report) {
      EXPECT_TRUE(node.FindLineMatching(launcher_stopped).has_value())
          << "rank " << r << " neither reported the cut itself nor was stopped by its launcher "
          << "for it:\n" << node.Output();
    }
    if (report) {
      ++row.survivors_reporting;
      if (!first || report->first < *first) first = report->first;
    }
  }
  if (first) row.first_report_s = Seconds(*first - t0);
  Clock::time_point last_end = t0;
  for (int r = 0; r < 2; ++r) {
    auto end = watch.EndOf(pids[r]);
    EXPECT_TRUE(end.has_value()) << "rank " << r << " did not end";
    if (end) last_end = std::max(last_end, *end);
  }
  row.all_ranks_ended_s = Seconds(last_end - t0);
  row.checkpoint_step = LoadCheckpointStep(checkpoint, &row.checkpoint_error);
  row.crashed = ShowsACrash(node0->Output() + node1->Output());
  PrintRow(row);
  std::printf("node 0 (exit %d):\n%s\nnode 1 (exit %d):\n%s\n", exit0, node0->Output().c_str(),
              exit1, node1->Output().c_str());
  EXPECT_NE(exit0, 0);
  EXPECT_NE(exit1, 0);
  EXPECT_NE(exit0, -1);
  EXPECT_NE(exit1, -1);
  // Nobody died: a rank cut off from the store (served on node 0) reports
  // PEER_LOST itself (docs/reliability.md: 1 of 2; the other is stopped by
  // its launcher, checked above).
  EXPECT_GE(row.survivors_reporting, 1) << row.fault;
  ExpectBounds(row, kPartitionBoundS);
}

}  // namespace
}  // namespace ddp::faults
