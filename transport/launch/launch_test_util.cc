#include "transport/launch/launch_test_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

namespace ddp::transport::launch::testing {

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return std::string(srcdir ? srcdir : ".") + "/" + (workspace ? workspace : "ddp") + "/" + path;
}

std::string MakeTempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/" + name + "_XXXXXX";
  // Folders named in `name` ("a/b") first; only the last part is new.
  for (size_t slash = pattern.find('/', 1); slash != std::string::npos; slash = pattern.find('/', slash + 1)) {
    mkdir(pattern.substr(0, slash).c_str(), 0755);
  }
  if (mkdtemp(pattern.data()) == nullptr) {
    const int err = errno;
    std::fprintf(stderr, "MakeTempDir: cannot make a folder like '%s': %s\n", pattern.c_str(), std::strerror(err));
    std::abort();
  }
  return pattern;
}

StatusOr<std::unique_ptr<WorkerGroup>> StartProgram(
    std::vector<std::string> argv, std::vector<std::pair<std::string, std::string>> env) {
  WorkerSpec spec;
  spec.rank = 0;
  spec.program = argv.at(0);
  spec.argv = std::move(argv);
  spec.env = std::move(env);
  SpawnOptions options;
  options.output.capture = true;
  options.output.to_terminal = false;
  options.output.prefix = false;
  options.forward_signals = false;
  options.grace = std::chrono::milliseconds(5000);
  std::vector<WorkerSpec> specs;
  specs.push_back(std::move(spec));
  return WorkerGroup::Start(std::move(specs), options);
}

ProgramRun WaitProgram(WorkerGroup& group, std::chrono::milliseconds timeout) {
  ProgramRun run;
  run.group = group.Wait(Clock::now() + timeout);
  const WorkerExit& w = run.group.workers.at(0);
  // Not reaped: no exit status is known (WorkerExit's code is then 0).
  if (w.exited) run.exit_code = w.signaled ? 128 + w.code : w.code;
  run.output = run.group.output.at(0);
  return run;
}

ProgramRun RunProgram(std::vector<std::string> argv,
                      std::vector<std::pair<std::string, std::string>> env,
                      std::chrono::milliseconds timeout) {
  StatusOr<std::unique_ptr<WorkerGroup>> group = StartProgram(std::move(argv), std::move(env));
  if (!group.ok()) {
    ProgramRun run;
    run.output = group.status().ToString();
    return run;
  }
  return WaitProgram(**group, timeout);
}

bool ProcessGone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

pid_t ParentPid(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!stat || !std::getline(stat, line)) return -1;
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos) return -1;
  std::istringstream rest(line.substr(paren + 1));
  std::string state;
  pid_t parent = -1;
  rest >> state >> parent;
  return rest ? parent : -1;
}

bool GoneWithin(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!ProcessGone(pid)) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

pid_t ReadPidFile(const std::string& path, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    std::ifstream in(path);
    pid_t pid = 0;
    if (in >> pid && pid > 0) return pid;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return -1;
}

int CountLines(const std::string& text, const std::string& needle) {
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) n += line.find(needle) != std::string::npos ? 1 : 0;
  return n;
}

bool CatchesSignal(pid_t pid, int signo) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("SigCgt:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> (signo - 1)) & 1;
  }
  return false;
}

bool HasChildNamed(pid_t parent, const std::string& name) {
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return false;
  bool found = false;
  while (const dirent* entry = readdir(proc)) {
    if (found || std::atoi(entry->d_name) <= 0) continue;
    std::ifstream stat(std::string("/proc/") + entry->d_name + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t open = line.find('('), close = line.rfind(')');
    if (open == std::string::npos || close == std::string::npos || close + 4 > line.size()) continue;
    std::istringstream rest(line.substr(close + 2));
    std::string state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    found = ppid == parent && line.substr(open + 1, close - open - 1) == name;
  }
  closedir(proc);
  return found;
}

bool Within(std::chrono::milliseconds timeout, const std::function<bool()>& condition) {
  const auto give_up = Clock::now() + timeout;
  while (!condition()) {
    if (Clock::now() >= give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

StatusOr<std::unique_ptr<HeldLauncher>> HeldLauncher::Start(std::vector<std::string> argv,
                                                            const std::string& stdout_path) {
  int err[2];
  if (pipe2(err, O_CLOEXEC) != 0) return InternalError(std::string("pipe2: ") + std::strerror(errno));
  // Filled while the write end does not block; the launcher gets it blocking.
  fcntl(err[1], F_SETFL, O_NONBLOCK);
  const std::string block(4096, '.');
  while (write(err[1], block.data(), block.size()) > 0) {
  }
  fcntl(err[1], F_SETFL, 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, err[1], STDERR_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, stdout_path.c_str(), O_WRONLY | O_CREAT, 0644);
  std::vector<char*> args;
  for (std::string& arg : argv) args.push_back(arg.data());
  args.push_back(nullptr);
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(err[1]);
  if (spawned != 0) {
    close(err[0]);
    return InternalError("cannot start '" + argv[0] + "': " + std::strerror(spawned));
  }
  return std::unique_ptr<HeldLauncher>(new HeldLauncher(pid, err[0]));
}

HeldLauncher::~HeldLauncher() {
  if (stderr_fd_ >= 0) close(stderr_fd_);
  if (reaped_) return;
  kill(pid_, SIGKILL);
  if (GoneWithin(pid_, std::chrono::seconds(5))) waitpid(pid_, nullptr, 0);
}

std::string HeldLauncher::ReadStderr(std::chrono::milliseconds timeout) {
  std::string output;
  const auto give_up = Clock::now() + timeout;
  while (stderr_fd_ >= 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - Clock::now());
    pollfd p{stderr_fd_, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char buffer[4096];
    const ssize_t n = read(stderr_fd_, buffer, sizeof(buffer));
    if (n <= 0) {
      close(stderr_fd_);
      stderr_fd_ = -1;
      break;
    }
    output.append(buffer, static_cast<size_t>(n));
  }
  output.erase(0, output.find_first_not_of('.'));
  return output;
}

namespace {

// The whole of the small /proc file `path`, or an error naming it and the
// reason (a read may fail where the open did not: access to another
// process's syscall and mem is checked at the read).
StatusOr<std::string> ReadProcFile(const std::string& path, const char* why) {
  const auto refused = [&](int err) {
    return FailedPreconditionError("cannot read " + path + ": " + std::strerror(err) + " (" + why + ")");
  };
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return refused(errno);
  char buffer[512];
  const ssize_t n = read(fd, buffer, sizeof(buffer) - 1);
  const int err = errno;
  close(fd);
  if (n < 0) return refused(err);
  return std::string(buffer, static_cast<size_t>(n));
}

constexpr char kNeedsPtrace[] =
    "HeldAtStderr needs ptrace access to the launcher, refused under Yama ptrace_scope 2 or 3, for a "
    "launcher that is not dumpable, or where /proc has no such file (gVisor)";

}  // namespace

StatusOr<bool> HeldLauncher::HeldAtStderr() const {
  if (stderr_fd_ < 0) return FailedPreconditionError("its stderr was read to its end: it holds nothing");
  const std::string proc = "/proc/" + std::to_string(pid_);
  // "NR ARG0 ARG1 ...": the system call the main thread is in ("running"
  // when in none).
  DDP_ASSIGN_OR_RETURN(const std::string syscall_text, ReadProcFile(proc + "/syscall", kNeedsPtrace));
  std::istringstream syscall_fields(syscall_text);
  long number = -1;
  std::string fds_text, count_text;
  if (!(syscall_fields >> number >> fds_text >> count_text)) return false;
  bool polls = false;
#ifdef SYS_poll
  polls = polls || number == SYS_poll;
#endif
#ifdef SYS_ppoll
  polls = polls || number == SYS_ppoll;
#endif
  if (!polls || std::strtoull(count_text.c_str(), nullptr, 16) != 1) return false;
  const std::string mem_path = proc + "/mem";
  const int mem = open(mem_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (mem < 0) {
    return FailedPreconditionError("cannot read " + mem_path + ": " + std::strerror(errno) + " (" + kNeedsPtrace +
                                   ")");
  }
  pollfd waited{};
  const ssize_t got = pread(mem, &waited, sizeof(waited),
                            static_cast<off_t>(std::strtoull(fds_text.c_str(), nullptr, 16)));
  const int err = errno;
  close(mem);
  // A short read: the poll returned, and its stack went, meanwhile.
  if (got < 0 && (err == EACCES || err == EPERM)) {
    return FailedPreconditionError("cannot read " + mem_path + ": " + std::strerror(err) + " (" + kNeedsPtrace +
                                   ")");
  }
  if (got != static_cast<ssize_t>(sizeof(waited)) || (waited.events & POLLOUT) == 0) return false;
  // The same pipe ("pipe:[inode]") as the read end here.
  char theirs[64] = {}, ours[64] = {};
  const std::string their_fd = proc + "/fd/" + std::to_string(waited.fd);
  const std::string our_fd = "/proc/self/fd/" + std::to_string(stderr_fd_);
  const ssize_t a = readlink(their_fd.c_str(), theirs, sizeof(theirs) - 1);
  const ssize_t b = readlink(our_fd.c_str(), ours, sizeof(ours) - 1);
  return a > 0 && a == b && std::strcmp(theirs, ours) == 0;
}

Status HeldLauncher::AwaitHeldAtStderr(std::chrono::milliseconds timeout) const {
  const auto give_up = Clock::now() + timeout;
  while (true) {
    DDP_ASSIGN_OR_RETURN(const bool held, HeldAtStderr());
    if (held) return Status::Ok();
    if (Clock::now() >= give_up) {
      return TimedOutError("the launcher (pid " + std::to_string(pid_) + ") was not seen waiting for room in " +
                           "its stderr pipe within " + std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

int HeldLauncher::Reap(std::chrono::milliseconds timeout) {
  if (reaped_ || !GoneWithin(pid_, timeout)) return -1;
  int status = 0;
  if (waitpid(pid_, &status, 0) != pid_) return -1;
  reaped_ = true;
  return status;
}

}  // namespace ddp::transport::launch::testing
