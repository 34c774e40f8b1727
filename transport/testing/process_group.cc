#include "transport/testing/process_group.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "transport/store/socket.h"

extern char** environ;

namespace ddp::transport::testing {

#ifndef P_PIDFD
#define P_PIDFD 3
#endif

namespace {

// A pidfd for the child `pid`, taken as soon as it is spawned: from then on
// signals and waits go through it, and cannot reach another process that
// got the worker's number after the kernel reaped the worker (SIGCHLD
// ignored), as a kill(pid) after a check could. -1 on kernels without
// pidfds (before 5.3), where the checked kill(pid) stays the way.
int OpenPidfd(pid_t pid) {
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
}

}  // namespace

int FreePort() {
  StatusOr<int> port = store::FreeTcpPort();
  return port.ok() ? *port : 0;
}

StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Spawn(int size,
                                                           const std::vector<std::string>& args,
                                                           const Env& env, int port,
                                                           const std::map<int, Env>& rank_env) {
  std::unique_ptr<ProcessGroup> group(new ProcessGroup());
  // The group's own number in this process goes into its log names: two
  // groups on one port (an intruder job beside the real one, say) shared
  // the files, the second's spawn truncated the first's output, and the
  // first's Wait removed the second's.
  static std::atomic<uint64_t> groups_spawned{0};
  const uint64_t group_number = groups_spawned.fetch_add(1);
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  for (int rank = 0; rank < size; ++rank) {
    std::map<std::string, std::string> vars;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const size_t eq = entry.find('=');
      if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
    }
    vars["RANK"] = std::to_string(rank);
    vars["WORLD_SIZE"] = std::to_string(size);
    vars["LOCAL_RANK"] = std::to_string(rank);
    vars["LOCAL_WORLD_SIZE"] = std::to_string(size);
    vars["MASTER_ADDR"] = "127.0.0.1";
    vars["MASTER_PORT"] = std::to_string(port);
    for (const auto& [k, v] : env) vars[k] = v;
    if (auto it = rank_env.find(rank); it != rank_env.end()) {
      for (const auto& [k, v] : it->second) vars[k] = v;
    }
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);

    std::vector<std::string> argv_strings = {"/proc/self/exe"};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);

    const std::string log = dir + "/rank" + std::to_string(rank) + "." +
                            std::to_string(getpid()) + "." + std::to_string(port) + "." +
                            std::to_string(group_number) + ".log";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      return InternalError("posix_spawn of rank " + std::to_string(rank) + ": " + std::strerror(rc));
    }
    group->pids_.push_back(pid);
    group->logs_.push_back(log);
    const int pidfd = OpenPidfd(pid);
    // ESRCH: the worker already ended and the kernel reaped it (SIGCHLD
    // ignored) before its pidfd could be taken. Its number may be another
    // process's by now, so it counts as reaped and is never signalled; a
    // checked kill(pid) would reach a new child of this process that got it.
    const bool gone = pidfd < 0 && errno == ESRCH;
    group->reaped_.push_back(gone);
    group->lost_.push_back(gone ? "the worker ended and was reaped before its pidfd was opened" : "");
    group->pidfds_.push_back(pidfd);
  }
  return group;
}

namespace {

// True when `pid` is no child of this process any more: the kernel reaped
// it as it exited (SIGCHLD ignored), or someone else did. Its number may
// then be another process's already, which must not be signalled.
bool NoLongerOurs(pid_t pid) {
  siginfo_t info{};
  return waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 && errno == ECHILD;
}

}  // namespace

void ProcessGroup::Signal(size_t i, int signal) {
  if (pidfds_[i] >= 0) {
    // ESRCH once the worker is gone: nothing else can be hit.
    syscall(SYS_pidfd_send_signal, pidfds_[i], signal, nullptr, 0);
  } else if (!NoLongerOurs(pids_[i])) {
    kill(pids_[i], signal);
  }
}

int ProcessGroup::WaitWorker(size_t i, siginfo_t* info, int flags) const {
  *info = siginfo_t{};
  const idtype_t type = pidfds_[i] >= 0 ? static_cast<idtype_t>(P_PIDFD) : P_PID;
  const id_t id = pidfds_[i] >= 0 ? static_cast<id_t>(pidfds_[i]) : static_cast<id_t>(pids_[i]);
  int rc = -1;
  do {
    rc = waitid(type, id, info, WEXITED | flags);
  } while (rc < 0 && errno == EINTR);
  if (rc < 0 && errno == EINVAL && type == static_cast<idtype_t>(P_PIDFD)) {
    // Linux 5.3 has pidfd_open but waits on a pidfd only from 5.4: the
    // worker is still this process's child, so its pid serves.
    do {
      rc = waitid(P_PID, static_cast<id_t>(pids_[i]), info, WEXITED | flags);
    } while (rc < 0 && errno == EINTR);
  }
  return rc;
}

void ProcessGroup::Kill(int rank, int signal) {
  if (!reaped_[rank]) Signal(static_cast<size_t>(rank), signal);
}

namespace {

// 128 random bits in hex.
std::string RandomToken() {
  std::random_device random;
  std::string token;
  for (int i = 0; i < 4; ++i) {
    char word[9];
    std::snprintf(word, sizeof(word), "%08x", static_cast<unsigned>(random()));
    token += word;
  }
  return "test-" + token;
}

}  // namespace

bool ProcessGroup::WaitForOutput(const std::string& text, Deadline deadline) {
  std::vector<int> every(pids_.size());
  for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<int>(i);
  return WaitForOutput(text, deadline, every);
}

bool ProcessGroup::WaitForOutput(const std::string& text, Deadline deadline, const std::vector<int>& ranks) {
  std::vector<bool> seen(pids_.size(), true);
  for (int r : ranks) {
    if (r < 0 || static_cast<size_t>(r) >= pids_.size()) {
      ADD_FAILURE() << "WaitForOutput: rank " << r << " is not one of the " << pids_.size() << " workers";
      return false;
    }
    seen[static_cast<size_t>(r)] = false;
  }
  size_t left = static_cast<size_t>(std::count(seen.begin(), seen.end(), false));
  while (left > 0) {
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (seen[i]) continue;
      std::ifstream in(logs_[i]);
      std::stringstream got;
      got << in.rdbuf();
      if (got.str().find(text) != std::string::npos) {
        seen[i] = true;
        --left;
      } else if (reaped_[i] || Exited(i)) {
        return false;  // gone without printing it
      }
    }
    if (left == 0) break;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

bool ProcessGroup::Exited(size_t i) const {
  siginfo_t info{};
  if (WaitWorker(i, &info, WNOHANG | WNOWAIT) == 0) return info.si_pid != 0;
  // ECHILD: not a child to wait for any more. With SIGCHLD ignored the
  // kernel reaps a worker as it exits (a running one still answers above),
  // and WaitForOutput polled it to its deadline as if it still ran.
  return errno == ECHILD;
}

std::vector<WorkerResult> ProcessGroup::Wait(Deadline deadline) {
  std::vector<WorkerResult> results(pids_.size());
  size_t left = 0;
  for (bool r : reaped_) left += r ? 0 : 1;
  // The workers' pidfds: poll on them sleeps until one exits or the
  // deadline passes, where a fixed nap made every Wait up to 5 ms late.
  // Without one for each (kernels before 5.3, no descriptors left) the nap.
  std::vector<pollfd> exits;
  std::vector<std::string> failed_waits(pids_.size());
  bool all_fds = true;
  for (size_t i = 0; i < pids_.size(); ++i) all_fds = all_fds && (reaped_[i] || pidfds_[i] >= 0);
  while (left > 0) {
    exits.clear();
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (reaped_[i]) continue;
      siginfo_t info{};
      int done = WaitWorker(i, &info, WNOHANG);
      int wait_error = errno;
      const bool running = done == 0 && info.si_pid == 0;
      if (running && Clock::now() >= deadline) {
        Signal(i, SIGKILL);
        done = WaitWorker(i, &info, 0);
        wait_error = errno;
        results[i].timed_out = true;
      } else if (running) {
        exits.push_back({pidfds_[i], POLLIN, 0});
        continue;
      }
      reaped_[i] = true;
      --left;
      if (done < 0) {
        // Reaped elsewhere, or SIGCHLD ignored (the kernel reaps it): how it
        // ended is unknown, so the result keeps exit_code -1, never the 0
        // of a status that was not filled in.
        failed_waits[i] = std::string("waitpid failed: ") + std::strerror(wait_error);
        continue;
      }
      if (info.si_code == CLD_EXITED) results[i].exit_code = info.si_status;
      if (info.si_code == CLD_KILLED || info.si_code == CLD_DUMPED) results[i].signal = info.si_status;
    }
    if (left == 0) break;
    if (!all_fds) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    // Rounded up, so that the round after the wake-up finds the deadline
    // passed rather than polling again with no time left.
    const auto until_deadline =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    poll(exits.data(), exits.size(),
         static_cast<int>(std::clamp<int64_t>(until_deadline, 1, 1000)));
  }
  for (size_t i = 0; i < pids_.size(); ++i) {
    std::ifstream in(logs_[i]);
    std::stringstream text;
    text << in.rdbuf();
    results[i].output = text.str();
    if (!failed_waits[i].empty()) results[i].output += "\n[harness] " + failed_waits[i] + "\n";
    if (!lost_[i].empty()) results[i].output += "\n[harness] " + lost_[i] + "\n";
    std::remove(logs_[i].c_str());
  }
  return results;
}

ProcessGroup::~ProcessGroup() {
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (!reaped_[i]) {
      std::remove(logs_[i].c_str());
      if (pidfds_[i] >= 0 || !NoLongerOurs(pids_[i])) {
        Signal(i, SIGKILL);
        siginfo_t info{};
        WaitWorker(i, &info, 0);  // ECHILD when the kernel reaped it
      }
    }
    if (pidfds_[i] >= 0) close(pidfds_[i]);
  }
}

std::string DescribeResults(const std::vector<WorkerResult>& results) {
  std::string text;
  for (size_t r = 0; r < results.size(); ++r) {
    text += "--- rank " + std::to_string(r) + " exit " + std::to_string(results[r].exit_code) + " signal " +
            std::to_string(results[r].signal) + (results[r].timed_out ? " TIMED OUT" : "") + "\n" +
            results[r].output;
  }
  return text;
}

Job RunJob(int size, const std::string& scenario, ProcessGroup::Env env,
           std::chrono::milliseconds limit,
           const std::function<void(ProcessGroup&, int port)>& during,
           const std::map<int, ProcessGroup::Env>& rank_env) {
  env["DDP_TEST_SCENARIO"] = scenario;
  // A token of this job's own: FreePort's port may be taken by another
  // test's job before this one binds it, and a shared token would let the
  // two jobs' ranks join each other's store instead of failing.
  if (env.count("DDP_JOB_TOKEN") == 0) env["DDP_JOB_TOKEN"] = RandomToken();
  const int port = FreePort();
  auto group = ProcessGroup::Spawn(size, {}, env, port, rank_env);
  if (!group.ok()) {
    WorkerResult failed;
    failed.output = "spawning the job failed: " + group.status().ToString();
    return Job{std::vector<WorkerResult>(static_cast<size_t>(std::max(size, 1)), failed)};
  }
  if (during) during(**group, port);
  return Job{(*group)->Wait(DeadlineIn(limit))};
}

namespace {

std::string MarkFile(const std::string& mark) {
  return EnvOr("TEST_TMPDIR", "/tmp") + "/mark_" + mark + "_" + EnvOr("MASTER_PORT", "0") + "_" +
         EnvOr("DDP_JOB_TOKEN");
}

}  // namespace

void SetMark(const std::string& mark) { std::ofstream(MarkFile(mark)) << mark; }

bool AwaitMark(const std::string& mark, std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (access(MarkFile(mark).c_str(), F_OK) != 0) {
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

int WorkerOrTestsMain(int argc, char** argv, int (*run_scenario)(const std::string& name)) {
  const char* scenario = std::getenv("DDP_TEST_SCENARIO");
  if (scenario != nullptr) {
    // A failed WORKER_CHECK fails the worker even when its scenario forgot
    // to fold worker_failures into what it returns.
    const int rc = run_scenario(scenario);
    return rc != 0 ? rc : (worker_failures != 0 ? 1 : 0);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

std::string EnvOr(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value == nullptr ? fallback : value;
}

}  // namespace ddp::transport::testing
