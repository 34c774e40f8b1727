#include "transport/launch/launch_test_util.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
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
  const std::string dir = std::string(base ? base : "/tmp") + "/" + name;
  std::string partial;
  for (size_t pos = 0; pos != std::string::npos;) {
    pos = dir.find('/', pos + 1);
    partial = dir.substr(0, pos);
    mkdir(partial.c_str(), 0755);
  }
  return dir;
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

}  // namespace ddp::transport::launch::testing
