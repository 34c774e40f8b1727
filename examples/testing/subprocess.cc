#include "examples/testing/subprocess.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "gtest/gtest.h"

extern char** environ;

namespace ddp::examples::testing {
namespace {

std::atomic<int> g_dirs{0};

// The start time of `pid` (/proc/PID/stat field 22, clock ticks since
// boot), or 0 where there is no such process.
uint64_t StartTimeOf(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  // Fields 3 to 21 come before it.
  std::istringstream rest(line.substr(close + 2));
  std::string skipped;
  for (int field = 3; field <= 21; ++field) rest >> skipped;
  uint64_t start = 0;
  rest >> start;
  return start;
}

pid_t ParentOf(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return -1;
  // "pid (comm) state ppid ...": comm may contain spaces; skip past ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(line.substr(close + 2));
  char state;
  pid_t ppid = -1;
  rest >> state >> ppid;
  return ppid;
}

// The children of `pid` from its threads' lists (/proc/PID/task/TID/
// children; a child is listed under the thread that made it), into *out.
// False where the kernel keeps no such lists. Subprocess::Wait polls every
// 20 ms: reading these few files instead of every process's stat keeps a
// test that waits minutes on a launcher from spending seconds of CPU.
bool ChildrenFromTasks(pid_t pid, std::vector<pid_t>* out) {
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  DIR* dir = opendir(tasks.c_str());
  if (dir == nullptr) return false;
  bool listed = false;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(tasks + "/" + e->d_name + "/children");
    if (!in) continue;  // the thread ended, or no lists at all
    listed = true;
    for (pid_t child = 0; in >> child;) out->push_back(child);
  }
  closedir(dir);
  return listed;
}

}  // namespace

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    return std::string(srcdir) + "/" + workspace + "/" + path;
  }
  return path;
}

std::string MakeTempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::filesystem::path dir = std::filesystem::path(tmp != nullptr ? tmp : "/tmp") /
                              (name + "." + std::to_string(getpid()) + "." +
                               std::to_string(g_dirs.fetch_add(1)));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

FifoReader::FifoReader(const std::string& path, std::chrono::milliseconds deadline) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) {
    ADD_FAILURE() << "cannot open the FIFO " << path << ": " << std::strerror(errno);
    return;
  }
  thread_ = std::thread([this, deadline] {
    const auto until = std::chrono::steady_clock::now() + deadline;
    char buffer[4096];
    while (std::chrono::steady_clock::now() < until) {
      // Until a writer has come, Linux reports nothing here (no POLLHUP).
      pollfd p{fd_, POLLIN, 0};
      const int ready = ::poll(&p, 1, 100);
      if (ready == 0 && finishing_) break;
      if (ready <= 0) continue;
      const ssize_t n = ::read(fd_, buffer, sizeof(buffer));
      if (n == 0) {
        ended_ = true;
        break;
      }
      if (n > 0) {
        std::lock_guard lock(mu_);
        text_.append(buffer, static_cast<size_t>(n));
      }
    }
  });
}

std::string FifoReader::Finish() {
  finishing_ = true;
  if (thread_.joinable()) thread_.join();
  return Text();
}

std::string FifoReader::Text() const {
  std::lock_guard lock(mu_);
  return text_;
}

FifoReader::~FifoReader() {
  Finish();
  if (fd_ >= 0) ::close(fd_);
}

bool ProcessGone(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return true;
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'Z') {
    return false;
  }
  // A killed process's main thread can be a zombie while its other threads
  // are still exiting, and they share its open files: a socket or lock it
  // held is released only with the last thread. Gone means only the zombie
  // main thread is left.
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  DIR* dir = opendir(tasks.c_str());
  if (dir == nullptr) return true;
  int threads = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++threads;
  }
  closedir(dir);
  return threads <= 1;
}

Subprocess::Subprocess(std::vector<std::string> argv,
                       std::vector<std::pair<std::string, std::string>> env)
    : dir_(MakeTempDir("subprocess")) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq != nullptr) vars[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  for (auto& [k, v] : env) vars[k] = v;
  std::vector<std::string> env_strings;
  for (auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<char*> args;
  for (std::string& s : argv) args.push_back(s.data());
  args.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  const std::string out = dir_ + "/stdout";
  const std::string err = dir_ + "/stderr";
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK |
                                      POSIX_SPAWN_SETSIGDEF);
  const int rc = posix_spawn(&pid_, args[0], &actions, &attr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    ADD_FAILURE() << "cannot start " << argv[0] << ": " << std::strerror(rc);
    pid_ = -1;
    reaped_ = true;
  }
}

Subprocess::~Subprocess() {
  if (!reaped_) {
    RememberChildren();
    kill(-pid_, SIGKILL);
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  // Only a pid that still has the start time it had when seen: the child
  // itself, not a process that got its number after it was reaped.
  for (const auto& [child, start] : seen_children_) {
    if (!ProcessGone(child) && StartTimeOf(child) == start) kill(child, SIGKILL);
  }
}

void Subprocess::RememberChildren() {
  for (pid_t child : Children()) {
    const std::pair<pid_t, uint64_t> seen(child, StartTimeOf(child));
    if (seen.second != 0 && std::find(seen_children_.begin(), seen_children_.end(), seen) == seen_children_.end()) {
      seen_children_.push_back(seen);
    }
  }
}

void Subprocess::Signal(int signal) const {
  if (!reaped_) kill(pid_, signal);
}

int Subprocess::Wait(std::chrono::milliseconds timeout) {
  if (reaped_) return exit_code_;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    // Remember the workers while they can still be found by their parent.
    RememberChildren();
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string Subprocess::Stdout() const { return ReadFile(dir_ + "/stdout"); }
std::string Subprocess::Stderr() const { return ReadFile(dir_ + "/stderr"); }

std::vector<pid_t> Subprocess::Children() const {
  std::vector<pid_t> out;
  if (reaped_ || pid_ <= 0) return out;
  std::vector<pid_t> candidates;
  if (!ChildrenFromTasks(pid_, &candidates)) {
    // No per-thread children lists: every process's parent is read.
    DIR* proc = opendir("/proc");
    if (proc == nullptr) return out;
    while (dirent* e = readdir(proc)) {
      char* end = nullptr;
      const long pid = std::strtol(e->d_name, &end, 10);
      if (end == e->d_name || *end != '\0') continue;
      if (ParentOf(static_cast<pid_t>(pid)) == pid_) candidates.push_back(static_cast<pid_t>(pid));
    }
    closedir(proc);
  }
  for (pid_t pid : candidates) {
    // The group's watcher names itself before leaving the launcher's group.
    if (getpgid(pid) == getpgid(pid_)) continue;
    if (ReadFile("/proc/" + std::to_string(pid) + "/comm") == "ddp-watcher\n") continue;
    out.push_back(pid);
  }
  return out;
}

void OpenFifoOnceRead(const std::string& path, Subprocess& running, int* writer,
                      std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while ((*writer = open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC)) < 0) {
    ASSERT_EQ(errno, ENXIO) << path << ": " << std::strerror(errno);
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << path << " was never opened:\n" << running.Stderr();
    ASSERT_EQ(running.Wait(std::chrono::milliseconds(20)), -1) << "the program ended first:\n" << running.Stderr();
  }
}

RunOutput RunToEnd(std::vector<std::string> argv,
                   std::vector<std::pair<std::string, std::string>> env,
                   std::chrono::milliseconds timeout) {
  Subprocess p(std::move(argv), std::move(env));
  RunOutput r;
  r.exit_code = p.Wait(timeout);
  r.out = p.Stdout();
  r.err = p.Stderr();
  return r;
}

}  // namespace ddp::examples::testing
