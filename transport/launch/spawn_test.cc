#include "transport/launch/spawn.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <mutex>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/launch/error_file.h"
#include "transport/launch/test_spawn.h"

namespace ddp::transport::launch {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

// After each test: no SIGUSR1 or SIGUSR2 held, and no signal caught
// between groups, for the tests after it (and --gtest_repeat's next
// round); CatchInterrupts(false) forgets them. The dispositions it sets
// back to the default are those a test leaves anyway.
class ForgetHeldSignals : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo&) override { CatchInterrupts(false); }
};
const bool kForgetsHeldSignals = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new ForgetHeldSignals);
  return true;
}();

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

void SleepForever() {
  // Bounded: a test that forgets a worker still ends.
  for (int i = 0; i < 3000; ++i) std::this_thread::sleep_for(10ms);
}

// Writes this process's pid (or `pid`) to $PID_DIR/<name>.
void WritePid(const std::string& name, pid_t pid = getpid()) {
  const char* dir = std::getenv("PID_DIR");
  if (dir == nullptr) return;
  const std::string path = std::string(dir) + "/" + name;
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  std::fprintf(f, "%d\n", pid);
  std::fclose(f);
  std::rename(tmp.c_str(), path.c_str());
}

DDP_TEST_WORKER(hello) {
  const int rank = EnvInt("RANK", -1);
  std::printf("hello from rank %d\n", rank);
  std::fflush(stdout);
  std::fprintf(stderr, "warning from rank %d\n", rank);
  std::printf("no newline at the end %d", rank);
  return 0;
}

// $PID_DIR/rank<R>.term, created by the SIGTERM handler of IgnoreTerm.
char g_term_mark[4096];

void MarkTerm(int) {
  const int saved = errno;
  const int fd = open(g_term_mark, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) close(fd);
  errno = saved;
}

// Ignores SIGTERM; with $PID_DIR, leaves $PID_DIR/rank<R>.term behind when
// one arrives, so that a test sees when the group began to stop the workers.
void IgnoreTerm(int rank) {
  const char* dir = std::getenv("PID_DIR");
  if (dir == nullptr) {
    signal(SIGTERM, SIG_IGN);
    return;
  }
  std::snprintf(g_term_mark, sizeof(g_term_mark), "%s/rank%d.term", dir, rank);
  struct sigaction action = {};
  action.sa_handler = MarkTerm;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
}

// Exits 5 when descriptor $PROBE_FD is open here.
DDP_TEST_WORKER(fd_probe) {
  const int fd = EnvInt("PROBE_FD", -1);
  if (fcntl(fd, F_GETFD) != -1) {
    std::printf("descriptor %d is open in the worker\n", fd);
    return 5;
  }
  return 0;
}

// Prints what its stdin is ("stdin: pipe:[123]"), then, with $READ_LINE,
// reads one line from it byte by byte ("read 'LINE'", or "read nothing: end
// of input" at the end); with $PID_DIR, writes $PID_DIR/rank<R> just
// before the read.
DDP_TEST_WORKER(reads_stdin) {
  char target[256] = {};
  const ssize_t n = readlink("/proc/self/fd/0", target, sizeof(target) - 1);
  std::printf("stdin: %s\n", n > 0 ? target : "(closed)");
  std::fflush(stdout);
  if (!EnvInt("READ_LINE", 0)) return 0;
  WritePid("rank" + std::to_string(EnvInt("RANK", -1)));
  std::string line;
  char c = 0;
  ssize_t got = 0;
  while ((got = read(STDIN_FILENO, &c, 1)) == 1 && c != '\n') line.push_back(c);
  if (got == 0 && line.empty()) {
    std::printf("read nothing: end of input\n");
  } else {
    std::printf("read '%s'\n", line.c_str());
  }
  return 0;
}

DDP_TEST_WORKER(fail_rank1) {
  const int rank = EnvInt("RANK", -1);
  if (EnvInt("IGNORE_TERM", 0)) IgnoreTerm(rank);
  WritePid("rank" + std::to_string(rank));  // after the signal setup: "ready"
  if (rank == 1) {
    if (EnvInt("AFTER_RANK0", 0)) {
      // Rank 0 is ready (its signal setup done) once its pid file is there.
      const std::string rank0 = std::string(std::getenv("PID_DIR")) + "/rank0";
      for (int i = 0; i < 2000 && access(rank0.c_str(), F_OK) != 0; ++i) std::this_thread::sleep_for(10ms);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(EnvInt("FAIL_AFTER_MS", 100)));
    const int how = EnvInt("HOW", 0);
    if (how == 0) return 3;
    raise(how);
  }
  if (EnvInt("OTHERS_FINISH", 0)) {
    std::this_thread::sleep_for(300ms);
    return 0;
  }
  SleepForever();
  return 0;
}

// Rank 1 is killed by SIGKILL at once; rank 0 exits with code 1 once
// $PID_DIR/go is there.
DDP_TEST_WORKER(killed_then_exits) {
  const int rank = EnvInt("RANK", -1);
  if (rank == 1) raise(SIGKILL);
  const std::string go = std::string(std::getenv("PID_DIR")) + "/go";
  for (int i = 0; i < 2000 && access(go.c_str(), F_OK) != 0; ++i) std::this_thread::sleep_for(10ms);
  return 1;
}

// Rank R prints its error file's path, waits $DELAY<R> ms, writes $MSG<R>
// there (stamped $AT<R> unix seconds when given; "{" when $GARBAGE<R>;
// the text $RAW<R> as it is when given; with $STRAY<R> it also leaves
// what a writer killed before its rename leaves, "<file>.tmp.XXXXXX") and
// exits 5; a rank without
// $MSG<R>, $GARBAGE<R> or $RAW<R> sleeps ($FAIL<R>: exits 4 without a
// word).
DDP_TEST_WORKER(reports_error) {
  const std::string r = std::to_string(EnvInt("RANK", -1));
  const char* path = std::getenv(kEnvErrorFile);
  std::printf("error file: %s\n", path != nullptr ? path : "(none)");
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::milliseconds(EnvInt(("DELAY" + r).c_str(), 0)));
  if (EnvInt(("GARBAGE" + r).c_str(), 0)) {
    std::ofstream(path) << "{";
    return 5;
  }
  if (EnvInt(("STRAY" + r).c_str(), 0)) std::ofstream(std::string(path) + ".tmp.a1b2c3") << "{\"mess";
  if (const char* raw = std::getenv(("RAW" + r).c_str())) {
    std::ofstream(path) << raw;
    return 5;
  }
  if (const char* message = std::getenv(("MSG" + r).c_str())) {
    const int at = EnvInt(("AT" + r).c_str(), 0);
    const Status written = at > 0 ? WriteErrorFile(path, message,
                                                   std::chrono::system_clock::time_point(std::chrono::seconds(at)))
                                  : RecordWorkerError(message);
    return written.ok() ? 5 : 6;
  }
  if (EnvInt(("FAIL" + r).c_str(), 0)) return 4;
  SleepForever();
  return 0;
}

DDP_TEST_WORKER(sleeper) {
  const int rank = EnvInt("RANK", -1);
  // SIGQUIT's default action dumps core: not in a test's folder.
  const rlimit no_core{0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  if (EnvInt("IGNORE_TERM", 0)) signal(SIGTERM, SIG_IGN);
  if (EnvInt("IGNORING_RANK", -1) == rank) signal(SIGINT, SIG_IGN);
  // Any process may trace it (a test's tracer is its sibling, not its
  // parent: under Yama's ptrace_scope 1 that needs this leave).
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  WritePid("rank" + std::to_string(rank));  // after the signal setup: "ready"
  SleepForever();
  return 0;
}

// A worker that is a script waiting for the program it started (`sh -c
// 'python train.py; true'`): it leaves SIGTERM to its child, which marks
// $PID_DIR/child.term when the signal reaches it, and ends.
DDP_TEST_WORKER(script) {
  std::snprintf(g_term_mark, sizeof(g_term_mark), "%s/child.term", std::getenv("PID_DIR"));
  const pid_t child = fork();
  if (child == 0) {
    struct sigaction action = {};
    action.sa_handler = [](int) {
      MarkTerm(0);
      _exit(0);
    };
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, nullptr);
    // Only now: a SIGTERM sent once the pid is out must find the handler.
    WritePid("child");
    for (int i = 0; i < 300; ++i) usleep(100000);
    _exit(1);
  }
  signal(SIGTERM, SIG_IGN);
  int status = 0;
  waitpid(child, &status, 0);
  return 0;
}

DDP_TEST_WORKER(grandparent) {
  const pid_t child = fork();
  if (child == 0) {
    // The grandchild: only async-signal-safe calls after fork.
    for (int i = 0; i < 300; ++i) usleep(100000);
    _exit(0);
  }
  WritePid("grandchild", child);
  return 0;
}

// Exits 0 when this process starts as a program run from a shell does as
// to SIGPIPE: 2 when it is not at its default action, 3 when blocked, 4
// when pending.
DDP_TEST_WORKER(sigpipe_state) {
  struct sigaction action{};
  if (sigaction(SIGPIPE, nullptr, &action) != 0 || action.sa_handler != SIG_DFL) return 2;
  sigset_t blocked;
  if (sigprocmask(SIG_SETMASK, nullptr, &blocked) != 0 || sigismember(&blocked, SIGPIPE)) return 3;
  sigset_t pending;
  if (sigpending(&pending) != 0 || sigismember(&pending, SIGPIPE)) return 4;
  return 0;
}

WorkerSpec Spec(int rank, const std::string& worker,
                std::vector<std::pair<std::string, std::string>> env = {}) {
  WorkerSpec spec;
  spec.rank = rank;
  spec.program = "/proc/self/exe";
  spec.argv = {"worker"};
  spec.env = std::move(env);
  spec.env.emplace_back(testing::kTestWorkerEnv, worker);
  spec.env.emplace_back("RANK", std::to_string(rank));
  return spec;
}

std::vector<WorkerSpec> Specs(int n, const std::string& worker,
                              std::vector<std::pair<std::string, std::string>> env = {}) {
  std::vector<WorkerSpec> specs;
  for (int r = 0; r < n; ++r) specs.push_back(Spec(r, worker, env));
  return specs;
}

SpawnOptions Quiet() {
  SpawnOptions options;
  options.output.capture = true;
  options.output.to_terminal = false;
  options.forward_signals = false;
  options.grace = 2000ms;
  return options;
}

// True when `pid` no longer runs (gone, or a zombie waiting for its parent).
bool ProcessGone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

bool GoneWithin(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!ProcessGone(pid)) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

void ExpectNoChildrenLeft() {
  errno = 0;
  EXPECT_EQ(waitpid(-1, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD) << "a child process of the test is still around";
}

// A new, empty folder for each call: one named `name` alone was shared by
// every run (by hand, under /tmp) and every --gtest_repeat iteration, whose
// leftovers (pid files, FIFOs, log folders) the next one took for its own:
// ReadPid found a dead worker's pid at once, mkfifo and mkdir failed.
std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/" + name + "_XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp " << pattern << ": " << std::strerror(errno);
  }
  return pattern;
}

pid_t ReadPid(const std::string& path, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    std::ifstream in(path);
    pid_t pid = 0;
    if (in >> pid && pid > 0) return pid;
    std::this_thread::sleep_for(5ms);
  }
  return -1;
}

// Starts `specs` and waits for them (20 s at most) while this process's
// stdout and stderr, which their terminal copies go to, are the files
// `out_path` and `err_path`; puts them back before it returns. *started:
// whether the group started.
GroupResult RunWithOutputInFiles(std::vector<WorkerSpec> specs, const SpawnOptions& options,
                                 const std::string& out_path, const std::string& err_path, Status* started) {
  std::fflush(stdout);
  std::fflush(stderr);
  const int saved_out = dup(1), saved_err = dup(2);
  const int out_fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int err_fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  dup2(out_fd, 1);
  dup2(err_fd, 2);
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(std::move(specs), options);
  GroupResult result;
  if (group.ok()) result = (*group)->Wait(DeadlineIn(20s));
  dup2(saved_out, 1);
  dup2(saved_err, 2);
  close(saved_out);
  close(saved_err);
  close(out_fd);
  close(err_fd);
  *started = group.status();
  return result;
}

TEST(SpawnTest, AllSucceedAndOutputIsCapturedAndPrefixed) {
  // Send the launcher's own stdout and stderr to files to see the prefixes.
  const std::string dir = TempDir("prefix");
  const std::string out_path = dir + "/stdout", err_path = dir + "/stderr";
  SpawnOptions options = Quiet();
  options.output.to_terminal = true;
  options.output.prefix = true;
  Status started;
  const GroupResult result = RunWithOutputInFiles(Specs(3, "hello"), options, out_path, err_path, &started);
  ASSERT_TRUE(started.ok()) << started;

  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  EXPECT_EQ(result.ExitCode(), 0);
  ASSERT_EQ(result.workers.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(result.workers[r].ok()) << result.workers[r].Describe();
    EXPECT_THAT(result.output[r], HasSubstr("hello from rank " + std::to_string(r) + "\n"));
    EXPECT_THAT(result.output[r], HasSubstr("warning from rank " + std::to_string(r) + "\n"));
  }
  std::stringstream out, err;
  out << std::ifstream(out_path).rdbuf();
  err << std::ifstream(err_path).rdbuf();
  for (int r = 0; r < 3; ++r) {
    const std::string p = "[" + std::to_string(r) + "] ";
    EXPECT_THAT(out.str(), HasSubstr(p + "hello from rank " + std::to_string(r) + "\n"));
    // A last line without newline is still written, whole, with its prefix.
    EXPECT_THAT(out.str(), HasSubstr(p + "no newline at the end " + std::to_string(r) + "\n"));
    EXPECT_THAT(err.str(), HasSubstr(p + "warning from rank " + std::to_string(r) + "\n"));
  }
  ExpectNoChildrenLeft();
}

TEST(SpawnTest, PerRankLogFiles) {
  const std::string dir = TempDir("logs");
  SpawnOptions options = Quiet();
  options.output.log_dir = dir;
  options.output.log_name_prefix = "attempt_0/";
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "hello"), options);
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  // torchrun's layout: a folder per worker (its rank unless the spec names
  // it), each stream in a file of its own. Both streams went into one
  // attempt_0/rank_R.log.
  for (int r = 0; r < 2; ++r) {
    std::stringstream out, err;
    out << std::ifstream(dir + "/attempt_0/" + std::to_string(r) + "/stdout.log").rdbuf();
    err << std::ifstream(dir + "/attempt_0/" + std::to_string(r) + "/stderr.log").rdbuf();
    EXPECT_EQ(out.str(), "hello from rank " + std::to_string(r) + "\nno newline at the end " + std::to_string(r));
    EXPECT_EQ(err.str(), "warning from rank " + std::to_string(r) + "\n");
  }
  std::vector<WorkerSpec> specs = Specs(1, "hello");
  specs[0].log_name = "local7";
  group = WorkerGroup::Start(std::move(specs), options);
  ASSERT_TRUE(group.ok()) << group.status();
  result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  std::stringstream named;
  named << std::ifstream(dir + "/attempt_0/local7/stderr.log").rdbuf();
  EXPECT_EQ(named.str(), "warning from rank 0\n");
}

// Per worker and stream (torchrun's per-rank --tee and --redirects): a
// stream not logged gets no file, one not shown stays off the terminal.
TEST(SpawnTest, EachWorkerChoosesWhichStreamsAreLoggedAndShown) {
  const std::string dir = TempDir("streams");
  const std::string out_path = dir + "/stdout", err_path = dir + "/stderr";
  SpawnOptions options = Quiet();
  options.output.to_terminal = true;
  options.output.prefix = false;
  options.output.log_dir = dir + "/logs";
  std::vector<WorkerSpec> specs = Specs(2, "hello");
  specs[0].logged_streams = kStdoutStream;  // -r 0:1
  specs[0].shown_streams = kStderrStream;
  specs[1].logged_streams = kStderrStream;  // -t 1:2
  Status started;
  const GroupResult result = RunWithOutputInFiles(std::move(specs), options, out_path, err_path, &started);
  ASSERT_TRUE(started.ok()) << started;
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  auto read = [](const std::string& path) {
    std::stringstream text;
    text << std::ifstream(path).rdbuf();
    return text.str();
  };
  EXPECT_EQ(read(dir + "/logs/0/stdout.log"), "hello from rank 0\nno newline at the end 0");
  EXPECT_NE(access((dir + "/logs/0/stderr.log").c_str(), F_OK), 0);
  EXPECT_EQ(read(dir + "/logs/1/stderr.log"), "warning from rank 1\n");
  EXPECT_NE(access((dir + "/logs/1/stdout.log").c_str(), F_OK), 0);
  const std::string out = read(out_path), err = read(err_path);
  EXPECT_THAT(out, Not(HasSubstr("rank 0")));
  EXPECT_THAT(err, HasSubstr("warning from rank 0\n"));
  EXPECT_THAT(out, HasSubstr("hello from rank 1\n"));
  EXPECT_THAT(err, HasSubstr("warning from rank 1\n"));
  ExpectNoChildrenLeft();
}

// A log file that stops taking output (here /dev/full: every write fails
// with ENOSPC, as on a full disk) is named in the result with the reason;
// the other rank's log is whole. Before, the failed writes were dropped
// without a word.
TEST(SpawnTest, LogFileThatStopsTakingOutputIsReported) {
  const std::string dir = TempDir("fulllogs");
  ASSERT_EQ(mkdir((dir + "/1").c_str(), 0755), 0) << std::strerror(errno);
  ASSERT_EQ(symlink("/dev/full", (dir + "/1/stdout.log").c_str()), 0) << std::strerror(errno);
  SpawnOptions options = Quiet();
  options.output.log_dir = dir;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "hello"), options);
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  ASSERT_EQ(result.log_failures.size(), 1u);
  EXPECT_EQ(result.log_failures[0],
            "rank 1's log file '" + dir + "/1/stdout.log' stopped after 0 bytes: " +
                std::string(std::strerror(ENOSPC)));
  std::stringstream log;
  log << std::ifstream(dir + "/0/stdout.log").rdbuf();
  EXPECT_THAT(log.str(), HasSubstr("hello from rank 0\n"));
}

TEST(SpawnTest, WorkerExitCodeStopsTheOthers) {
  const std::string dir = TempDir("exitcode");
  const auto start = Clock::now();
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(4, "fail_rank1", {{"PID_DIR", dir}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed);
  ASSERT_TRUE(result.first_failure.has_value());
  EXPECT_EQ(result.first_failure->rank, 1);
  EXPECT_EQ(result.reason, "rank 1 (pid " + std::to_string(pids[1]) +
                               ") exited with code 3; stopping the other workers");
  EXPECT_EQ(result.ExitCode(), 3);
  for (int r : {0, 2, 3}) {
    EXPECT_TRUE(result.workers[r].signaled) << result.workers[r].Describe();
    EXPECT_EQ(result.workers[r].code, SIGTERM);
  }
  for (pid_t pid : pids) EXPECT_TRUE(ProcessGone(pid)) << pid;
  ExpectNoChildrenLeft();
}

// A worker reaped behind the group's back (the host program's SIGCHLD
// handler waiting for any child, say) is a failure with an unknown status,
// seen at once: the group must not spin on its readable pidfd until the
// deadline, nor forever without one.
TEST(SpawnTest, AWorkerReapedBySomeoneElseFailsWithItsStatusUnknown) {
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "fail_rank1", {{"FAIL_AFTER_MS", "0"}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  int status = 0;
  ASSERT_EQ(waitpid(pids[1], &status, 0), pids[1]);  // as a stray SIGCHLD handler would
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed) << result.reason;
  ASSERT_TRUE(result.first_failure.has_value());
  EXPECT_EQ(result.first_failure->rank, 1);
  EXPECT_TRUE(result.first_failure->status_lost);
  EXPECT_EQ(result.reason, "rank 1 (pid " + std::to_string(pids[1]) +
                               ") ended, but something else in this process reaped it first (a SIGCHLD "
                               "handler or a wait for any child?), so how it ended is unknown; stopping "
                               "the other workers");
  EXPECT_EQ(result.ExitCode(), 1);
  EXPECT_TRUE(result.workers[0].signaled) << result.workers[0].Describe();
  for (pid_t pid : pids) EXPECT_TRUE(ProcessGone(pid)) << pid;
  ExpectNoChildrenLeft();
}

// Reaps `pid` (a child) within `timeout`; false when it did not end.
bool ReapWithin(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

// A process that took a pid this process's worker had (see RunInAPidNamespace),
// leading a group of its own: not a child of this process (as a stranger
// would not be), but of a helper that stays until End.
struct Stranger {
  pid_t helper = -1;
  pid_t pid = -1;
  // Sends it SIGUSR1: 0 when it lived until then, 20 when something else
  // ended it, 21 when the helper did not end in time.
  int End() const {
    if (pid > 0) kill(pid, SIGUSR1);
    const auto deadline = Clock::now() + 10s;
    int status = 0;
    pid_t done = 0;
    while ((done = waitpid(helper, &status, WNOHANG)) == 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    if (done != helper) return 21;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 21;
  }
};

// Starts a Stranger whose pid is `wanted`, free by now, through the pid
// namespace's ns_last_pid; false (nothing left running) when it did not get
// that pid.
bool StartStranger(pid_t wanted, Stranger& out) {
  int report[2];
  if (pipe(report) != 0) return false;
  const pid_t helper = fork();
  if (helper < 0) return false;
  if (helper == 0) {
    close(report[0]);
    const int fd = open("/proc/sys/kernel/ns_last_pid", O_WRONLY | O_CLOEXEC);
    const std::string last = std::to_string(wanted - 1);
    if (fd < 0 || write(fd, last.data(), last.size()) != static_cast<ssize_t>(last.size())) _exit(1);
    close(fd);
    // A launcher that forwards signals has its own handler for SIGUSR1,
    // which End's signal must not meet: the stranger has the default from
    // its fork on. Set in the stranger itself, it came too late for a
    // stranger not yet scheduled when End signalled it (a loaded host):
    // the launcher's handler took the signal and the stranger lived on.
    signal(SIGUSR1, SIG_DFL);
    sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    sigprocmask(SIG_UNBLOCK, &usr1, nullptr);
    const pid_t stranger = fork();
    if (stranger == 0) {
      setpgid(0, 0);
      SleepForever();
      _exit(0);
    }
    setpgid(stranger, stranger);  // either side's call makes it so before the report
    (void)!write(report[1], &stranger, sizeof(stranger));
    const auto deadline = Clock::now() + 60s;
    int status = 0;
    while (waitpid(stranger, &status, WNOHANG) == 0 && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    _exit(WIFSIGNALED(status) && WTERMSIG(status) == SIGUSR1 ? 0 : 20);
  }
  close(report[1]);
  out.helper = helper;
  const bool told = read(report[0], &out.pid, sizeof(out.pid)) == sizeof(out.pid);
  close(report[0]);
  if (!told || out.pid != wanted || getpgid(out.pid) != wanted) {
    out.End();
    return false;
  }
  return true;
}

// Runs `scenario` as pid 1 of a pid namespace of its own, where the next
// pid can be chosen (ns_last_pid) and nothing else takes it; returns its
// exit code (by convention 0: the stranger lived; 20: it was killed; other
// codes: a step of the setup failed).
int RunInAPidNamespace(int (*scenario)()) {
  const pid_t ns = static_cast<pid_t>(syscall(SYS_clone, CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0));
  if (ns < 0) {
    ADD_FAILURE() << "clone(CLONE_NEWPID): " << std::strerror(errno);
    return -1;
  }
  if (ns == 0) _exit(scenario());
  const auto deadline = Clock::now() + 60s;
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(ns, &status, WNOHANG)) == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  if (done != ns) {
    kill(ns, SIGKILL);
    ReapWithin(ns, 10s);
    return -2;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -3;
}

// The workers' process group id is the leader's pid. With the leader (and
// every other worker) reaped behind the group's back, nothing holds that
// id any more: it may be a stranger's group by the time Wait looks, and
// Wait must not signal it.
int StrangerInTheOldGroupIdSurvives() {
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "hello"), Quiet());
  if (!group.ok()) return 10;
  const pid_t group_id = (*group)->process_group();
  for (pid_t pid : (*group)->pids()) {
    if (!ReapWithin(pid, 10s)) return 11;  // as a stray SIGCHLD handler would
  }
  Stranger stranger;
  if (!StartStranger(group_id, stranger)) return 14;
  GroupResult result = (*group)->Wait(DeadlineIn(10s));
  group->reset();
  const bool alive = stranger.End() == 0;
  if (result.outcome != GroupOutcome::kWorkerFailed) return 16;  // their ends are unknown
  return alive ? 0 : 20;
}

TEST(SpawnTest, AGroupWhoseWorkersWereReapedBySomeoneElseSignalsNoStrangersGroup) {
  EXPECT_EQ(RunInAPidNamespace(&StrangerInTheOldGroupIdSurvives), 0) << "20: Wait killed the stranger's group";
  ExpectNoChildrenLeft();
}

// A worker that left the group (setsid) is signalled by itself. Reaped
// behind the group's back, its pid may be a stranger's by the time the
// group is destroyed, which must not kill the stranger: the signal goes
// through the worker's pidfd, which names that one process only.
int StrangerWithALostWorkersPidSurvives() {
  std::vector<WorkerSpec> specs = Specs(2, "sleeper");
  specs[1].program = "/usr/bin/setsid";  // not the group's leader: it execs at once, in a session of its own
  specs[1].argv = {"setsid", "/bin/true"};
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(specs, Quiet());
  if (!group.ok()) return 10;
  const pid_t lost = (*group)->pids()[1];
  if (!ReapWithin(lost, 10s)) return 11;  // as a stray SIGCHLD handler would
  Stranger stranger;
  if (!StartStranger(lost, stranger)) return 14;
  group->reset();  // kills whatever of the group still runs
  return stranger.End() == 0 ? 0 : 20;
}

TEST(SpawnTest, AWorkerOutsideTheGroupReapedBySomeoneElseLeavesItsPidsNextOwnerAlone) {
  EXPECT_EQ(RunInAPidNamespace(&StrangerWithALostWorkersPidSurvives), 0)
      << "20: destroying the group killed the stranger";
  ExpectNoChildrenLeft();
}

// What such a worker wrote to its error file is still its reason: its
// exit status is lost, not why it failed.
TEST(SpawnTest, AWorkerReapedBySomeoneElseStillReportsItsError) {
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "reports_error", {{"MSG1", "out of disk"}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  int status = 0;
  ASSERT_EQ(waitpid(pids[1], &status, 0), pids[1]);
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed) << result.reason;
  ASSERT_TRUE(result.first_failure.has_value());
  EXPECT_TRUE(result.first_failure->status_lost);
  EXPECT_EQ(result.first_failure->error, "out of disk");
  EXPECT_THAT(result.reason, HasSubstr("so how it ended is unknown; stopping the other workers; rank 1 "
                                       "reported: out of disk"));
  ExpectNoChildrenLeft();
}

// Rank 1 writes $PID_DIR/rank1 and exits 0 at once. The others ignore
// SIGUSR1 (the launcher passes it on to them), write $PID_DIR/rank<R> and
// sleep; rank 2 first waits for rank 0 to be ready (its file), and (5 s at
// most) until rank 1's pid names no process any more, a zombie included
// (the launcher reaped it), and then sends the launcher SIGUSR1, whose
// on_notice looks at the group.
DDP_TEST_WORKER(one_ends_early) {
  const int rank = EnvInt("RANK", -1);
  if (rank == 1) {
    WritePid("rank1");
    return 0;
  }
  signal(SIGUSR1, SIG_IGN);
  WritePid("rank" + std::to_string(rank));
  if (rank == 2) {
    ReadPid(std::string(std::getenv("PID_DIR")) + "/rank0", 20s);  // SIGUSR1 would kill it before
    const pid_t early = ReadPid(std::string(std::getenv("PID_DIR")) + "/rank1", 20s);
    const auto give_up = Clock::now() + 5s;
    while (early > 0 && kill(early, 0) == 0 && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
    kill(getppid(), SIGUSR1);
  }
  SleepForever();
  return 0;
}

// Catches SIGUSR1 (a checkpoint request), then writes $PID_DIR/rank<R>
// ("ready"); exits 0 once the signal came, 3 when it did not within 30 s.
DDP_TEST_WORKER(checkpoint_on_usr1) {
  static volatile sig_atomic_t asked = 0;
  struct sigaction action = {};
  action.sa_handler = [](int) { asked = 1; };
  sigemptyset(&action.sa_mask);
  sigaction(SIGUSR1, &action, nullptr);
  WritePid("rank" + std::to_string(EnvInt("RANK", -1)));
  for (int i = 0; i < 3000 && !asked; ++i) std::this_thread::sleep_for(10ms);
  return asked ? 0 : 3;
}

// SIGUSR1 that reaches a group after its Wait ended (its workers gone, the
// group not yet destroyed: a launcher between a failure and its restart)
// is held for the next group, whose workers get it once they catch it; the
// next group threw it away with the stale bytes of the pipe.
TEST(SpawnTest, ASigusr1BetweenTwoGroupsReachesTheNextGroupsWorkers) {
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  std::mutex mu;
  std::vector<std::string> notices;
  options.on_notice = [&](const std::string& line) {
    std::lock_guard<std::mutex> lock(mu);
    notices.push_back(line);
  };
  StatusOr<std::unique_ptr<WorkerGroup>> first = WorkerGroup::Start(Specs(1, "hello"), options);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ((*first)->Wait(DeadlineIn(20s)).outcome, GroupOutcome::kSucceeded);
  ASSERT_EQ(raise(SIGUSR1), 0);  // the first group's handler takes it
  first->reset();

  const std::string dir = TempDir("usr1_between_groups");
  StatusOr<std::unique_ptr<WorkerGroup>> next =
      WorkerGroup::Start(Specs(2, "checkpoint_on_usr1", {{"PID_DIR", dir}}), options);
  ASSERT_TRUE(next.ok()) << next.status();
  GroupResult result = (*next)->Wait(DeadlineIn(10s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  for (const WorkerExit& w : result.workers) EXPECT_TRUE(w.ok()) << w.Describe() << " (3: no SIGUSR1 came)";
  EXPECT_THAT(notices, ::testing::Contains("passed SIGUSR1 on to the workers (held until each had a handler for "
                                           "it)"));
  next->reset();
  ExpectNoChildrenLeft();
}

// As checkpoint_on_usr1, but sets its handler up only after $SLOW_MS ms
// (a program that takes a while to start, as Python does).
DDP_TEST_WORKER(late_checkpoint_on_usr1) {
  static volatile sig_atomic_t asked = 0;
  std::this_thread::sleep_for(std::chrono::milliseconds(EnvInt("SLOW_MS", 0)));
  struct sigaction action = {};
  action.sa_handler = [](int) { asked = 1; };
  sigemptyset(&action.sa_mask);
  sigaction(SIGUSR1, &action, nullptr);
  for (int i = 0; i < 3000 && !asked; ++i) std::this_thread::sleep_for(10ms);
  return asked ? 0 : 3;
}

// Prints lines for $MS ms without a handler for SIGUSR1, then exits 0.
DDP_TEST_WORKER(chatty_for) {
  const std::string line(63, 'x');
  const auto until = Clock::now() + std::chrono::milliseconds(EnvInt("MS", 0));
  while (Clock::now() < until) std::printf("%s\n", line.c_str());
  return 0;
}

// SIGUSR1 right after Start, before the workers set their handler up,
// waits for it: sent at once, its default action killed them.
TEST(SpawnTest, ASigusr1BeforeTheWorkersHaveAHandlerWaitsForIt) {
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "late_checkpoint_on_usr1", {{"SLOW_MS", "1000"}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_EQ(raise(SIGUSR1), 0);
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  for (const WorkerExit& w : result.workers) EXPECT_TRUE(w.ok()) << w.Describe() << " (3: no SIGUSR1 came)";
  group->reset();
  ExpectNoChildrenLeft();
}

// A held SIGUSR1 that the next group's workers did not get before they
// ended (here: without a handler, they end at once) is held for the group
// after; it was lost.
TEST(SpawnTest, AHeldSigusr1ThatAGroupDidNotDeliverGoesToTheNext) {
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  StatusOr<std::unique_ptr<WorkerGroup>> first = WorkerGroup::Start(Specs(1, "hello"), options);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ((*first)->Wait(DeadlineIn(20s)).outcome, GroupOutcome::kSucceeded);
  ASSERT_EQ(raise(SIGUSR1), 0);  // held for the next group
  first->reset();

  StatusOr<std::unique_ptr<WorkerGroup>> second = WorkerGroup::Start(Specs(2, "hello"), options);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->Wait(DeadlineIn(20s)).outcome, GroupOutcome::kSucceeded);
  second->reset();

  const std::string dir = TempDir("usr1_two_groups_on");
  StatusOr<std::unique_ptr<WorkerGroup>> third =
      WorkerGroup::Start(Specs(2, "checkpoint_on_usr1", {{"PID_DIR", dir}}), options);
  ASSERT_TRUE(third.ok()) << third.status();
  GroupResult result = (*third)->Wait(DeadlineIn(10s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  for (const WorkerExit& w : result.workers) EXPECT_TRUE(w.ok()) << w.Describe() << " (3: no SIGUSR1 came)";
  third->reset();
  ExpectNoChildrenLeft();
}

// A held SIGUSR1 whose workers never set a handler up is looked at once a
// second, not at each output chunk, and dropped hold_signal_for after the
// group's start (the workers live on); the workers' handlers were read at
// every round of Wait's loop for as long as the group ran.
TEST(SpawnTest, AHeldSigusr1IsLookedAtOnceASecondAndDroppedAtItsBound) {
  SpawnOptions options = Quiet();
  options.output.capture = false;  // read and thrown away: a wake per chunk
  options.forward_signals = true;
  options.hold_signal_for = 1500ms;
  std::mutex mu;
  std::vector<std::string> notices;
  options.on_notice = [&](const std::string& line) {
    std::lock_guard<std::mutex> lock(mu);
    notices.push_back(line);
  };
  StatusOr<std::unique_ptr<WorkerGroup>> first = WorkerGroup::Start(Specs(1, "hello"), options);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ((*first)->Wait(DeadlineIn(20s)).outcome, GroupOutcome::kSucceeded);
  ASSERT_EQ(raise(SIGUSR1), 0);  // held for the next group
  first->reset();

  const int64_t looks_before = SignalHandlerLooksForTesting();
  const auto start = Clock::now();
  StatusOr<std::unique_ptr<WorkerGroup>> next =
      WorkerGroup::Start(Specs(2, "chatty_for", {{"MS", "3000"}}), options);
  ASSERT_TRUE(next.ok()) << next.status();
  GroupResult result = (*next)->Wait(DeadlineIn(30s));
  const auto took = std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - start).count();
  const int64_t looks = SignalHandlerLooksForTesting() - looks_before;
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  // Two workers, looked at once a second until the bound (1.5 s): a
  // round at the start and one or two more.
  EXPECT_LE(looks, 2 * (std::min<int64_t>(took, 2) + 2)) << "in " << took << " s";
  EXPECT_THAT(notices, ::testing::Contains("dropped SIGUSR1: a worker had no handler for it 1500 ms after the "
                                           "workers' start (hold_signal_for), and its default action would "
                                           "end it"));
  next->reset();
  ExpectNoChildrenLeft();

  options.hold_signal_for = -1ms;
  next = WorkerGroup::Start(Specs(1, "hello"), options);
  ASSERT_FALSE(next.ok());
  EXPECT_EQ(next.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(next.status().message(),
            "the time a SIGUSR1 or SIGUSR2 is held for workers without a handler (hold_signal_for) is -1 ms; "
            "it must be 0 or more");
}

// A worker that ends while the others run is reaped at once, as torchrun
// reaps it: not left a zombie, counted against RLIMIT_NPROC, until the
// whole group ends. Its pid is then free; a stranger that gets it is not
// signalled when the group is stopped, while the others, in the group
// whose id the leader's zombie keeps, still get the group's SIGTERM.
// Returns 0 when all that held; 30: rank 1 was still unreaped while the
// others ran; 31: rank 0 or 2 was not running then; 32: no notice came;
// 33: the group did not end as stopped; 34: a worker did not end as
// expected; 20: the stranger with rank 1's old pid was killed.
int AnEarlyEndIsReapedWhileTheOthersRun() {
  const std::string dir = TempDir("one_ends_early");
  for (int r = 0; r < 3; ++r) unlink((dir + "/rank" + std::to_string(r)).c_str());
  SpawnOptions options = Quiet();
  options.forward_signals = true;  // for rank 2's SIGUSR1
  WorkerGroup* running = nullptr;
  int verdict = 32;
  Stranger stranger;
  options.on_notice = [&](const std::string&) {
    if (running == nullptr || verdict != 32) return;
    const std::vector<pid_t> pids = running->pids();
    verdict = 0;
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(pids[1]), &info, WEXITED | WNOHANG | WNOWAIT) == 0 || errno != ECHILD) {
      verdict = 30;
    }
    for (int r : {0, 2}) {
      info = {};
      const int got = waitid(P_PID, static_cast<id_t>(pids[r]), &info, WEXITED | WNOHANG | WNOWAIT);
      if (verdict == 0 && (got != 0 || info.si_pid != 0)) verdict = 31;
    }
    if (verdict == 0 && !StartStranger(pids[1], stranger)) verdict = 14;
    running->RequestStop("test asked to stop");
  };
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(3, "one_ends_early", {{"PID_DIR", dir}}), options);
  if (!group.ok()) return 10;
  running = group->get();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  group->reset();
  const bool alive = stranger.helper < 0 || stranger.End() == 0;
  if (verdict != 0) return verdict;
  const auto by_sigterm = [](const WorkerExit& e) { return e.exited && e.signaled && e.code == SIGTERM; };
  if (result.outcome != GroupOutcome::kStopped) return 33;
  if (!result.workers[1].ok() || !by_sigterm(result.workers[0]) || !by_sigterm(result.workers[2])) return 34;
  return alive ? 0 : 20;
}

TEST(SpawnTest, AWorkerThatEndsEarlyIsReapedWhileTheOthersRun) {
  EXPECT_EQ(RunInAPidNamespace(&AnEarlyEndIsReapedWhileTheOthersRun), 0)
      << "30: rank 1 was left a zombie while the others ran; 20: stopping the group killed the stranger that "
         "got rank 1's pid (see the scenario for the other codes)";
  ExpectNoChildrenLeft();
}

// Writes $BYTES bytes of output to stdout, in lines of 64, and exits 0.
DDP_TEST_WORKER(chatty) {
  const std::string line(63, 'x');
  for (int left = EnvInt("BYTES", 0); left > 0; left -= 64) std::printf("%s\n", line.c_str());
  return 0;
}

// Prints $BYTES of lines, then waits for SIGTERM (whose arrival it marks
// as IgnoreTerm does), prints "stopping on SIGTERM" and exits 0: the lines
// a worker writes while the launcher stops it.
DDP_TEST_WORKER(chatty_until_term) {
  static volatile sig_atomic_t termed = 0;
  std::snprintf(g_term_mark, sizeof(g_term_mark), "%s/rank0.term", std::getenv("PID_DIR"));
  struct sigaction action = {};
  action.sa_handler = [](int signo) {
    termed = 1;
    MarkTerm(signo);
  };
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  const std::string line(63, 'x');
  for (int left = EnvInt("BYTES", 0); left > 0; left -= 64) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  for (int i = 0; i < 3000 && termed == 0; ++i) usleep(10000);  // bounded, as SleepForever
  // The time a worker takes to stop (saving a checkpoint, say).
  std::this_thread::sleep_for(std::chrono::milliseconds(EnvInt("LINGER_MS", 0)));
  std::printf("stopping on SIGTERM\n");
  return 0;
}

// Makes <dir>/logs/0/stdout.log a FIFO: 0, or 1 when it cannot.
int FifoAsRankZerosLog(const std::string& dir, std::string* path) {
  if (mkdir((dir + "/logs").c_str(), 0755) != 0 && errno != EEXIST) return 1;
  if (mkdir((dir + "/logs/0").c_str(), 0755) != 0 && errno != EEXIST) return 1;
  *path = dir + "/logs/0/stdout.log";
  unlink(path->c_str());
  return mkfifo(path->c_str(), 0644) == 0 ? 0 : 1;
}

// A log file that is a FIFO nobody reads: Start refuses it, named, instead
// of waiting in open() for a reader for good. 0: so; 2: it started; 3:
// another error.
int AFifoLogWithoutReaderIsRefused() {
  const std::string dir = TempDir("fifo_log_unread");
  std::string path;
  if (FifoAsRankZerosLog(dir, &path) != 0) return 1;
  SpawnOptions options = Quiet();
  options.output.log_dir = dir + "/logs";
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(1, "hello"), options);
  if (group.ok()) return 2;
  const bool as_expected = group.status().code() == StatusCode::kInvalidArgument &&
                           group.status().message() == "cannot write log file '" + path +
                                                           "': No such device or address (a FIFO that nobody reads)";
  return as_expected ? 0 : 3;
}

// A log file that is a FIFO whose reader never reads: once it is full, the
// log stops (named in log_failures) after 2 s without progress, and the
// group goes on watching the workers instead of waiting on the write for
// good. 0: so; 4: the group did not succeed; 5: no such log failure; 6:
// Wait took too long.
int AFifoLogWhoseReaderStoppedIsGivenUp() {
  const std::string dir = TempDir("fifo_log_stalled");
  std::string path;
  if (FifoAsRankZerosLog(dir, &path) != 0) return 1;
  const int reader = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // never reads
  if (reader < 0) return 1;
  SpawnOptions options = Quiet();
  options.output.log_dir = dir + "/logs";
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(1, "chatty", {{"BYTES", std::to_string(1 << 20)}}), options);
  if (!group.ok()) return 3;
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(30s));
  const auto took = Clock::now() - start;
  close(reader);
  if (result.outcome != GroupOutcome::kSucceeded) return 4;
  if (result.log_failures.size() != 1 ||
      result.log_failures[0].find("rank 0's log file '" + path + "' stopped after ") != 0 ||
      result.log_failures[0].find(" 2000 ms (a reader that stopped reading") == std::string::npos) {
    return 5;
  }
  return took < 15s ? 0 : 6;
}

// Runs `scenario` in a child process of its own (fork) with SIGPIPE at its
// default action, as in ddprun; returns its exit code, -2 when it did not
// end within 60 s, or 1000 + the signal that killed it.
int RunInAProcess(int (*scenario)()) {
  const pid_t child = fork();
  if (child < 0) {
    ADD_FAILURE() << "fork: " << std::strerror(errno);
    return -1;
  }
  if (child == 0) {
    signal(SIGPIPE, SIG_DFL);
    _exit(scenario());
  }
  const auto deadline = Clock::now() + 60s;
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(child, &status, WNOHANG)) == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  if (done != child) {
    kill(child, SIGKILL);
    ReapWithin(child, 10s);
    return -2;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
}

// With CatchInterrupts, SIGUSR1 while no group exists (a launcher between
// two attempts) is held for the next group's workers; by its default
// action it ended the launcher there. Runs in a child of its own
// (RunInAProcess). 0: the next group's workers got it; 2: the first group
// did not start or succeed; 3: the next group did not succeed (its
// workers exit 3 without the signal); 1010: SIGUSR1 ended the launcher.
int ASigusr1WithNoGroupReachesTheNextGroup() {
  CatchInterrupts(true);
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  {
    StatusOr<std::unique_ptr<WorkerGroup>> first = WorkerGroup::Start(Specs(1, "hello"), options);
    if (!first.ok() || (*first)->Wait(DeadlineIn(20s)).outcome != GroupOutcome::kSucceeded) return 2;
  }
  raise(SIGUSR1);
  const std::string dir = TempDir("usr1_no_group");
  StatusOr<std::unique_ptr<WorkerGroup>> next =
      WorkerGroup::Start(Specs(2, "checkpoint_on_usr1", {{"PID_DIR", dir}}), options);
  if (!next.ok()) return 3;
  const GroupResult result = (*next)->Wait(DeadlineIn(10s));
  next->reset();
  CatchInterrupts(false);
  return result.outcome == GroupOutcome::kSucceeded ? 0 : 3;
}

TEST(SpawnTest, ASigusr1WithNoGroupReachesTheNextGroupUnderCatchInterrupts) {
  EXPECT_EQ(RunInAProcess(&ASigusr1WithNoGroupReachesTheNextGroup), 0)
      << "1010: SIGUSR1 ended the launcher; see the scenario for the other codes";
  ExpectNoChildrenLeft();
}


// A log file that is a FIFO whose reader takes one read and closes it: the
// next write fails with EPIPE, which stops that log (named in
// log_failures), rather than raising SIGPIPE, which would end the
// launcher. 0: so; 4: the group did not succeed; 5: no such log failure.
int AFifoLogWhoseReaderLeftIsGivenUp() {
  const std::string dir = TempDir("fifo_log_reader_left");
  std::string path;
  if (FifoAsRankZerosLog(dir, &path) != 0) return 1;
  const int reader = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (reader < 0) return 1;
  SpawnOptions options = Quiet();
  options.output.log_dir = dir + "/logs";
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(1, "chatty", {{"BYTES", std::to_string(1 << 20)}}), options);
  if (!group.ok()) return 3;
  std::thread read_once([reader] {
    pollfd p{reader, POLLIN, 0};
    poll(&p, 1, 20000);
    char buf[4096];
    (void)!read(reader, buf, sizeof(buf));
    close(reader);
  });
  GroupResult result = (*group)->Wait(DeadlineIn(30s));
  read_once.join();
  if (result.outcome != GroupOutcome::kSucceeded) return 4;
  if (result.log_failures.size() != 1 ||
      result.log_failures[0].find("rank 0's log file '" + path + "' stopped after ") != 0 ||
      result.log_failures[0].find("Broken pipe") == std::string::npos) {
    return 5;
  }
  return 0;
}

// A log file that is a FIFO whose reader takes a page (4 KiB) every 300 ms:
// each write makes some progress within 2 s, but a 64 KiB read of a
// worker's output would take seconds to write, and 1 MiB minutes, during
// which nothing else is watched. One write is held for 2 s at most in all,
// then the log stops. 0: so; 4: the group did not succeed; 5: no such log
// failure; 6: Wait took too long.
// Wait(DeadlineIn(wait_for)) with a FIFO log whose reader takes a page
// every 300 ms; `took` is how long Wait took.
GroupResult WaitWithASlowFifoReader(const std::string& name, std::chrono::milliseconds wait_for,
                                    std::string* path, Clock::duration* took, int* setup_failure) {
  const std::string dir = TempDir(name);
  *setup_failure = 1;
  if (FifoAsRankZerosLog(dir, path) != 0) return {};
  const int reader = open(path->c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (reader < 0) return {};
  const int stop = eventfd(0, EFD_CLOEXEC);
  if (stop < 0) return {};
  SpawnOptions options = Quiet();
  options.output.log_dir = dir + "/logs";
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(1, "chatty", {{"BYTES", std::to_string(1 << 20)}}), options);
  *setup_failure = 3;
  if (!group.ok()) return {};
  *setup_failure = 0;
  std::thread slow_reader([reader, stop] {
    pollfd p{stop, POLLIN, 0};
    while (poll(&p, 1, 300) == 0) {  // the pace: a page per 300 ms until told to stop
      char buf[4096];
      (void)!read(reader, buf, sizeof(buf));
    }
  });
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(wait_for));
  *took = Clock::now() - start;
  const uint64_t one = 1;
  (void)!write(stop, &one, sizeof(one));
  slow_reader.join();
  close(reader);
  close(stop);
  return result;
}

// As above with a Wait deadline of 1 s: the write is held to it, the group
// is stopped as timed out, within seconds (before, Wait went on writing to
// the slow reader for a 64 KiB write or more). 0: so; 4: not timed out; 6:
// Wait took too long.
int AFifoLogWithASlowReaderLetsWaitsDeadlineStopTheGroup() {
  std::string path;
  Clock::duration took{};
  int setup_failure = 0;
  GroupResult result = WaitWithASlowFifoReader("fifo_log_slow_deadline", 1000ms, &path, &took, &setup_failure);
  if (setup_failure != 0) return setup_failure;
  if (result.outcome != GroupOutcome::kTimedOut) return 4;
  // The deadline, the worker's end on SIGTERM: about 1 s; before, a 64 KiB
  // write at this pace (about 5 s) came first, and more after.
  return took < 4s ? 0 : 6;
}

int AFifoLogWithASlowReaderIsGivenUp() {
  const std::string dir = TempDir("fifo_log_slow");
  std::string path;
  if (FifoAsRankZerosLog(dir, &path) != 0) return 1;
  const int reader = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (reader < 0) return 1;
  const int stop = eventfd(0, EFD_CLOEXEC);
  if (stop < 0) return 1;
  SpawnOptions options = Quiet();
  options.output.log_dir = dir + "/logs";
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(1, "chatty", {{"BYTES", std::to_string(1 << 20)}}), options);
  if (!group.ok()) return 3;
  std::thread slow_reader([reader, stop] {
    pollfd p{stop, POLLIN, 0};
    while (poll(&p, 1, 300) == 0) {  // the pace: a page per 300 ms until told to stop
      char buf[4096];
      (void)!read(reader, buf, sizeof(buf));
    }
  });
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(30s));
  const auto took = Clock::now() - start;
  const uint64_t one = 1;
  (void)!write(stop, &one, sizeof(one));
  slow_reader.join();
  close(reader);
  if (result.outcome != GroupOutcome::kSucceeded) return 4;
  if (result.log_failures.size() != 1 ||
      result.log_failures[0].find("rank 0's log file '" + path + "' stopped after ") != 0 ||
      result.log_failures[0].find("bytes were taken in 2000 ms (a reader that stopped reading or reads too slowly)") ==
          std::string::npos) {
    return 5;
  }
  return took < 15s ? 0 : 6;
}

// A FIFO log whose reader waits until the workers are being stopped (it
// reads once the worker marks its SIGTERM): the write that Wait's deadline
// cut short leaves its rest for later, and the log goes on taking what the
// worker says while it stops, instead of ending at the deadline for the
// rest of the run (the lines that say how a job ended were lost).
TEST(SpawnTest, ALogWriteCutByWaitsDeadlineLeavesTheLogOpen) {
  const std::string dir = TempDir("fifo_log_cut_by_deadline");
  std::string path;
  ASSERT_EQ(FifoAsRankZerosLog(dir, &path), 0);
  const std::string mark = dir + "/rank0.term";
  unlink(mark.c_str());
  const int reader = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0) << std::strerror(errno);
  SpawnOptions options = Quiet();
  options.output.log_dir = dir + "/logs";
  options.grace = 10000ms;
  // More than the FIFO holds (64 KiB): a write waits for the reader.
  constexpr int kBytes = 192 * 1024;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(
      Specs(1, "chatty_until_term", {{"BYTES", std::to_string(kBytes)}, {"PID_DIR", dir}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  std::string log;
  std::thread late_reader([&] {
    const auto give_up = Clock::now() + 30s;
    while (access(mark.c_str(), F_OK) != 0 && Clock::now() < give_up) std::this_thread::sleep_for(5ms);
    // Then everything, until the launcher closes the log (end of file).
    while (Clock::now() < give_up) {
      pollfd p{reader, POLLIN, 0};
      if (poll(&p, 1, 100) < 0) break;
      char buf[65536];
      const ssize_t n = read(reader, buf, sizeof(buf));
      if (n == 0) break;
      if (n > 0) log.append(buf, static_cast<size_t>(n));
    }
  });
  // Short: the reader, which starts at the SIGTERM, must come within the
  // 2 s that a write may wait in all, counted from its first try.
  GroupResult result = (*group)->Wait(DeadlineIn(500ms));
  group->reset();  // closes the log: the reader's end of file
  late_reader.join();
  close(reader);
  EXPECT_EQ(result.outcome, GroupOutcome::kTimedOut) << result.reason;
  ASSERT_EQ(result.workers.size(), 1u);
  EXPECT_TRUE(result.workers[0].ok()) << result.workers[0].Describe();
  EXPECT_THAT(result.log_failures, ::testing::IsEmpty());
  EXPECT_EQ(log.size(), static_cast<size_t>(kBytes) + std::strlen("stopping on SIGTERM\n"));
  const std::string last = "stopping on SIGTERM\n";
  EXPECT_TRUE(log.size() >= last.size() && log.compare(log.size() - last.size(), last.size(), last) == 0)
      << "the log's last line is not the one the worker wrote while it stopped";
  ExpectNoChildrenLeft();
}

// As above, with a reader that takes a page every 100 ms once the workers
// are being stopped, and a worker that takes 5 s to stop: the 128 KiB take
// the reader about 3 s, more than the 2 s a stalled reader is given, but
// it never stalls. The log stays open until all of it is in; the 2 s were
// counted from the cut write's first try, and the log was stopped while
// the reader was still taking bytes.
TEST(SpawnTest, ALogWriteCutByADeadlineStaysOpenWhileItsReaderKeepsTakingBytes) {
  const std::string dir = TempDir("fifo_log_cut_slow_reader");
  std::string path;
  ASSERT_EQ(FifoAsRankZerosLog(dir, &path), 0);
  const std::string mark = dir + "/rank0.term";
  unlink(mark.c_str());
  const int reader = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0) << std::strerror(errno);
  SpawnOptions options = Quiet();
  options.output.log_dir = dir + "/logs";
  options.grace = 20000ms;
  constexpr int kBytes = 128 * 1024;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(
      Specs(1, "chatty_until_term", {{"BYTES", std::to_string(kBytes)}, {"PID_DIR", dir}, {"LINGER_MS", "5000"}}),
      options);
  ASSERT_TRUE(group.ok()) << group.status();
  std::string log;
  std::thread slow_reader([&] {
    const auto give_up = Clock::now() + 40s;
    while (access(mark.c_str(), F_OK) != 0 && Clock::now() < give_up) std::this_thread::sleep_for(5ms);
    // A page per 100 ms, until the launcher closes the log (end of file).
    while (Clock::now() < give_up) {
      pollfd p{reader, POLLIN, 0};
      if (poll(&p, 1, 100) < 0) break;
      if (p.revents == 0) continue;
      char buf[4096];
      const ssize_t n = read(reader, buf, sizeof(buf));
      if (n == 0) break;
      if (n > 0) log.append(buf, static_cast<size_t>(n));
      std::this_thread::sleep_for(100ms);  // the pace
    }
  });
  GroupResult result = (*group)->Wait(DeadlineIn(500ms));
  group->reset();  // closes the log: the reader's end of file
  slow_reader.join();
  close(reader);
  EXPECT_EQ(result.outcome, GroupOutcome::kTimedOut) << result.reason;
  ASSERT_EQ(result.workers.size(), 1u);
  EXPECT_TRUE(result.workers[0].ok()) << result.workers[0].Describe();
  EXPECT_THAT(result.log_failures, ::testing::IsEmpty());
  EXPECT_EQ(log.size(), static_cast<size_t>(kBytes) + std::strlen("stopping on SIGTERM\n"));
  ExpectNoChildrenLeft();
}

// open() of a UNIX socket's file fails with ENXIO, as that of a FIFO
// without a reader does: the message names what the file is.
TEST(SpawnTest, ALogFileThatIsASocketIsRefusedNamingIt) {
  const std::string dir = TempDir("socket_log");
  ASSERT_EQ(mkdir((dir + "/logs").c_str(), 0755) == 0 || errno == EEXIST, true);
  ASSERT_EQ(mkdir((dir + "/logs/0").c_str(), 0755) == 0 || errno == EEXIST, true);
  const std::string path = dir + "/logs/0/stdout.log";
  unlink(path.c_str());
  const int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(sock, 0) << std::strerror(errno);
  // Bound at a short path (sun_path holds 108 bytes, TEST_TMPDIR may be
  // longer), then moved into place.
  char short_dir[] = "/tmp/ddp_sock_XXXXXX";
  ASSERT_NE(mkdtemp(short_dir), nullptr) << std::strerror(errno);
  const std::string bound = std::string(short_dir) + "/s";
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, bound.c_str(), bound.size() + 1);
  ASSERT_EQ(bind(sock, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0) << std::strerror(errno);
  ASSERT_EQ(rename(bound.c_str(), path.c_str()), 0) << std::strerror(errno);
  rmdir(short_dir);
  SpawnOptions options = Quiet();
  options.output.log_dir = dir + "/logs";
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(1, "hello"), options);
  close(sock);
  ASSERT_FALSE(group.ok()) << "the group started";
  EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(group.status().message(), "cannot write log file '" + path +
                                          "': No such device or address (a UNIX socket, which cannot be opened as "
                                          "a file)");
  ExpectNoChildrenLeft();
}

TEST(SpawnTest, ALogFileThatIsAFifoNeverHoldsTheGroupUp) {
  // (Each in a process of its own, with a deadline: -2 means it hung.)
  EXPECT_EQ(RunInAPidNamespace(&AFifoLogWithoutReaderIsRefused), 0) << "-2: Start waited for a reader";
  EXPECT_EQ(RunInAPidNamespace(&AFifoLogWhoseReaderStoppedIsGivenUp), 0) << "-2: Wait hung on the write";
  EXPECT_EQ(RunInAProcess(&AFifoLogWhoseReaderLeftIsGivenUp), 0) << "1013: SIGPIPE ended the launcher";
  EXPECT_EQ(RunInAProcess(&AFifoLogWithASlowReaderIsGivenUp), 0) << "4 or -2: Wait was held by the slow writes (past its deadline)";
  EXPECT_EQ(RunInAProcess(&AFifoLogWithASlowReaderLetsWaitsDeadlineStopTheGroup), 0)
      << "6 or -2: Wait was held past its deadline by the slow writes";
  ExpectNoChildrenLeft();
}

TEST(SpawnTest, WorkerKilledBySignalStopsTheOthers) {
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(
      Specs(3, "fail_rank1", {{"HOW", std::to_string(SIGKILL)}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed);
  EXPECT_EQ(result.reason, "rank 1 (pid " + std::to_string(pids[1]) +
                               ") was killed by signal 9 (SIGKILL); stopping the other workers");
  EXPECT_EQ(result.ExitCode(), 128 + SIGKILL);
  for (pid_t pid : pids) EXPECT_TRUE(ProcessGone(pid)) << pid;
  ExpectNoChildrenLeft();
}

// What a failed worker wrote to TORCHELASTIC_ERROR_FILE (its own, in a
// directory the group removes at the end) is in the reason, on one line.
TEST(SpawnTest, AFailedWorkersErrorFileIsInTheReason) {
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(
      Specs(2, "reports_error", {{"MSG1", "dataset '/data/x' is missing\nsee --data_dir"}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed);
  EXPECT_EQ(result.reason, "rank 1 (pid " + std::to_string(pids[1]) +
                               ") exited with code 5; stopping the other workers; rank 1 reported: "
                               "dataset '/data/x' is missing | see --data_dir");
  ASSERT_TRUE(result.first_failure.has_value());
  EXPECT_EQ(result.first_failure->error, "dataset '/data/x' is missing\nsee --data_dir");
  ASSERT_TRUE(result.first_error.has_value());
  EXPECT_EQ(result.first_error->rank, 1);
  EXPECT_GT(result.first_error->error_timestamp_us, int64_t{1600000000} * 1000000);
  EXPECT_EQ(result.workers[0].error, "");  // stopped by the group: nothing read
  EXPECT_EQ(result.ExitCode(), 5);

  // The file was in a directory of the group's, gone with the group.
  const size_t at = result.output[1].find("error file: ");
  ASSERT_NE(at, std::string::npos) << result.output[1];
  const std::string path = result.output[1].substr(at + 12, result.output[1].find('\n', at) - at - 12);
  EXPECT_THAT(path, ::testing::EndsWith("/rank_1.error.json"));
  const std::string dir = path.substr(0, path.rfind('/'));
  EXPECT_THAT(dir, HasSubstr("/ddp_worker_errors_"));
  EXPECT_EQ(access(dir.c_str(), F_OK), 0);
  group->reset();
  EXPECT_EQ(access(dir.c_str(), F_OK), -1) << dir << " outlived the group";
  ExpectNoChildrenLeft();
}

// As torchrun: of the failed workers' messages, the earliest written is the
// root cause, whichever worker exited first.
TEST(SpawnTest, TheEarliestErrorWrittenIsTheRootCause) {
  SpawnOptions options = Quiet();
  options.stop_all_on_failure = false;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(
      Specs(3, "reports_error",
            {{"MSG0", "lost the connection to rank 1"}, {"AT0", "1700000900"},
             {"MSG1", "CUDA out of memory"}, {"AT1", "1700000100"}, {"DELAY1", "300"},
             {"FAIL2", "1"}, {"DELAY2", "100"}}),
      options);
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  ASSERT_TRUE(result.first_failure.has_value());
  EXPECT_EQ(result.first_failure->rank, 0);
  ASSERT_TRUE(result.first_error.has_value());
  EXPECT_EQ(result.first_error->rank, 1);
  EXPECT_THAT(result.reason, ::testing::EndsWith("; rank 1 reported: CUDA out of memory"));
  EXPECT_EQ(result.workers[0].error, "lost the connection to rank 1");
  EXPECT_EQ(result.workers[0].error_timestamp_us, int64_t{1700000900} * 1000000);
  EXPECT_EQ(result.workers[2].error, "");
  ExpectNoChildrenLeft();
}

// A long message is cut for the reason line at a character's start: a
// UTF-8 character across the cut was left half there (a byte that is no
// text), which a terminal shows as garbage and a JSON reader refuses.
TEST(SpawnTest, ALongErrorIsCutForTheReasonBetweenCharacters) {
  const std::string message = std::string(399, 'a') + "\xc3\xa9 and more after the cut";
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(1, "reports_error", {{"MSG0", message}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  ASSERT_EQ(result.workers.size(), 1u);
  EXPECT_EQ(result.workers[0].error, message);
  EXPECT_THAT(result.reason, ::testing::EndsWith("; rank 0 reported: " + std::string(399, 'a') + "..."));
  ExpectNoChildrenLeft();
}

// A file whose time is missing or unusable (negative here) says nothing of
// when it was written: a worker that wrote one and failed first is not the
// root cause over one that gave its time. (Its time read as 0, the
// earliest of all, and it was.)
TEST(SpawnTest, AnErrorWithoutAUsableTimeIsNotTheEarliest) {
  SpawnOptions options = Quiet();
  options.stop_all_on_failure = false;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(
      Specs(2, "reports_error",
            {{"RAW0", R"({"message": {"message": "lost rank 1", "extraInfo": {"timestamp": "-5"}}})"},
             {"MSG1", "CUDA out of memory"}, {"DELAY1", "300"}}),
      options);
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  ASSERT_TRUE(result.first_failure.has_value());
  EXPECT_EQ(result.first_failure->rank, 0);
  EXPECT_EQ(result.workers[0].error, "lost rank 1");
  EXPECT_EQ(result.workers[0].error_timestamp_us, 0);
  ASSERT_TRUE(result.first_error.has_value());
  EXPECT_EQ(result.first_error->rank, 1);
  EXPECT_THAT(result.reason, ::testing::EndsWith("; rank 1 reported: CUDA out of memory"));
  ExpectNoChildrenLeft();
}

// The group's folder of error files goes with the group also when a
// worker's writer was killed between writing its temporary and renaming it
// into place: the temporary kept the folder (rmdir: not empty), and every
// such run left one in $TMPDIR.
TEST(SpawnTest, TheErrorFolderGoesAlsoWithAHalfWrittenFileInIt) {
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(1, "reports_error", {{"MSG0", "bad batch"}, {"STRAY0", "1"}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_THAT(result.reason, ::testing::EndsWith("; rank 0 reported: bad batch"));
  const size_t at = result.output[0].find("error file: ");
  ASSERT_NE(at, std::string::npos) << result.output[0];
  const std::string path = result.output[0].substr(at + 12, result.output[0].find('\n', at) - at - 12);
  const std::string dir = path.substr(0, path.rfind('/'));
  ASSERT_THAT(dir, HasSubstr("/ddp_worker_errors_"));
  EXPECT_EQ(access((path + ".tmp.a1b2c3").c_str(), F_OK), 0);
  group->reset();
  EXPECT_EQ(access(dir.c_str(), F_OK), -1) << dir << " outlived the group";
}

// No writable temporary folder: the workers start all the same, without an
// error file (before this, the group refused to start).
TEST(SpawnTest, WorkersStartWithoutErrorFilesWhenNoTemporaryFolderCanBeMade) {
  const char* saved = std::getenv("TMPDIR");
  const std::string before = saved != nullptr ? saved : "";
  setenv("TMPDIR", "/proc/no_such_folder", 1);
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(1, "reports_error", {{"FAIL0", "1"}}), Quiet());
  if (saved != nullptr) {
    setenv("TMPDIR", before.c_str(), 1);
  } else {
    unsetenv("TMPDIR");
  }
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_THAT(result.output[0], HasSubstr("error file: (none)\n"));
  EXPECT_EQ(result.ExitCode(), 4);
}

// A worker without an error file of its own does not get the launcher's:
// TORCHELASTIC_ERROR_FILE, set for the launcher by whoever started it, is
// unset for the workers (with error_files=false, and when no temporary
// folder can be made), so that none writes the launcher's file.
TEST(SpawnTest, WorkersWithoutErrorFilesDoNotGetTheLaunchersOwn) {
  const std::string dir = TempDir("launchererrorfile");
  const std::string own = dir + "/launcher.json";
  setenv(kEnvErrorFile, own.c_str(), 1);
  // Both ranks fail: each must get to its word before the group stops.
  SpawnOptions both = Quiet();
  both.stop_all_on_failure = false;
  SpawnOptions off = both;
  off.error_files = false;
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "reports_error", {{"MSG0", "rank 0 failed"}, {"MSG1", "rank 1 failed"}}), off);
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  for (int r = 0; r < 2; ++r) EXPECT_THAT(result.output[r], HasSubstr("error file: (none)\n")) << r;
  EXPECT_EQ(access(own.c_str(), F_OK), -1) << "a worker wrote the launcher's error file";

  const char* saved = std::getenv("TMPDIR");
  const std::string before = saved != nullptr ? saved : "";
  setenv("TMPDIR", "/proc/no_such_folder", 1);
  group = WorkerGroup::Start(Specs(2, "reports_error", {{"MSG0", "rank 0 failed"}, {"MSG1", "rank 1 failed"}}),
                             both);
  if (saved != nullptr) {
    setenv("TMPDIR", before.c_str(), 1);
  } else {
    unsetenv("TMPDIR");
  }
  unsetenv(kEnvErrorFile);
  ASSERT_TRUE(group.ok()) << group.status();
  result = (*group)->Wait(DeadlineIn(20s));
  for (int r = 0; r < 2; ++r) EXPECT_THAT(result.output[r], HasSubstr("error file: (none)\n")) << r;
  EXPECT_EQ(access(own.c_str(), F_OK), -1) << "a worker wrote the launcher's error file";
  ExpectNoChildrenLeft();
}

// Under a log_dir the error files sit beside the logs and stay; one left
// there by an earlier run is removed before the worker starts, and a file
// that is not JSON is named.
TEST(SpawnTest, ErrorFilesBesideTheLogsStayAndStaleOnesGo) {
  const std::string dir = TempDir("errorfiles");
  mkdir((dir + "/attempt_0").c_str(), 0755);
  mkdir((dir + "/attempt_0/0").c_str(), 0755);
  ASSERT_TRUE(WriteErrorFile(dir + "/attempt_0/0/error.json", "from an earlier run").ok());
  SpawnOptions options = Quiet();
  options.stop_all_on_failure = false;
  options.output.log_dir = dir;
  options.output.log_name_prefix = "attempt_0/";
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(
      Specs(3, "reports_error", {{"FAIL0", "1"}, {"MSG1", "bad flag"}, {"DELAY1", "100"},
                                 {"GARBAGE2", "1"}, {"DELAY2", "200"}}),
      options);
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  group->reset();
  ASSERT_TRUE(result.first_failure.has_value());
  EXPECT_EQ(result.first_failure->rank, 0);
  EXPECT_EQ(result.workers[0].error, "");
  ASSERT_TRUE(result.first_error.has_value());
  EXPECT_EQ(result.first_error->rank, 1);
  EXPECT_THAT(result.reason, HasSubstr("; rank 2's error file '" + dir +
                                       "/attempt_0/2/error.json' is malformed: not JSON"));
  EXPECT_THAT(result.reason, HasSubstr("; rank 1 reported: bad flag"));
  EXPECT_THAT(result.reason, ::testing::Not(HasSubstr("earlier run")));
  StatusOr<WorkerError> kept = ReadErrorFile(dir + "/attempt_0/1/error.json");
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->message, "bad flag");
  EXPECT_EQ(access((dir + "/attempt_0/0/error.json").c_str(), F_OK), -1);
}

// A spec's own TORCHELASTIC_ERROR_FILE wins; error_files=false gives none.
TEST(SpawnTest, ErrorFilesCanBeNamedByTheSpecOrTurnedOff) {
  const std::string dir = TempDir("ownerrorfile");
  std::vector<WorkerSpec> specs = Specs(1, "reports_error", {{"MSG0", "mine"}});
  specs[0].env.emplace_back(kEnvErrorFile, dir + "/mine.json");
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(specs, Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_THAT(result.output[0], HasSubstr("error file: " + dir + "/mine.json\n"));
  EXPECT_TRUE(ReadErrorFile(dir + "/mine.json").ok());

  SpawnOptions off = Quiet();
  off.error_files = false;
  unsetenv(kEnvErrorFile);
  group = WorkerGroup::Start(Specs(1, "reports_error", {{"FAIL0", "1"}}), off);
  ASSERT_TRUE(group.ok()) << group.status();
  result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_THAT(result.output[0], HasSubstr("error file: (none)\n"));
  EXPECT_EQ(result.ExitCode(), 4);
}

// A worker whose spec names its own error file writes there, and that is
// where its message is read from; one left there from before is removed
// first, so that a worker that fails without a word is not blamed with it.
TEST(SpawnTest, ASpecsOwnErrorFileIsReadAndAStaleOneGoes) {
  const std::string dir = TempDir("own_error_file_read");
  std::vector<WorkerSpec> specs = Specs(2, "reports_error", {{"MSG0", "mine"}, {"FAIL1", "1"}});
  specs[0].env.emplace_back(kEnvErrorFile, dir + "/rank0.json");
  specs[1].env.emplace_back(kEnvErrorFile, dir + "/rank1.json");
  ASSERT_TRUE(WriteErrorFile(dir + "/rank1.json", "stale, from an earlier run").ok());
  SpawnOptions options = Quiet();
  options.stop_all_on_failure = false;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(specs, options);
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed) << result.reason;
  EXPECT_EQ(result.workers[0].code, 5);
  EXPECT_EQ(result.workers[0].error, "mine");
  EXPECT_EQ(result.workers[1].code, 4);
  EXPECT_EQ(result.workers[1].error, "");
  EXPECT_THAT(result.reason, HasSubstr("rank 0 reported: mine"));
  EXPECT_THAT(result.reason, Not(HasSubstr("stale")));
  EXPECT_NE(access((dir + "/rank1.json").c_str(), F_OK), 0) << "the stale error file is still there";
}

// A worker stopped by SIGTTOU (it wrote to the terminal from its background
// process group with `stty tostop`) stops the job, named, instead of
// leaving the launcher waiting for an exit that never comes; the stopped
// worker takes its SIGTERM too (with a SIGCONT).
TEST(SpawnTest, WorkerStoppedByTheTerminalStopsTheOthers) {
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(
      Specs(3, "fail_rank1", {{"HOW", std::to_string(SIGTTOU)}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed);
  EXPECT_EQ(result.reason, "rank 1 (pid " + std::to_string(pids[1]) +
                               ") was stopped by SIGTTOU: it wrote to or changed the terminal, which "
                               "workers (in a process group of their own) may not do; stopping the workers");
  EXPECT_EQ(result.ExitCode(), 1);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(result.workers[r].signaled) << result.workers[r].Describe();
    EXPECT_EQ(result.workers[r].code, SIGTERM) << result.workers[r].Describe();
  }
  for (pid_t pid : pids) EXPECT_TRUE(ProcessGone(pid)) << pid;
  ExpectNoChildrenLeft();
}

// What a descriptor is, as /proc/self/fd shows it ("pipe:[123]").
std::string DescriptorTarget(int fd) {
  char target[256] = {};
  const ssize_t n = readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), target, sizeof(target) - 1);
  return n > 0 ? target : "(closed)";
}

// Puts a pipe in place of this process's stdin for the life of the object
// and puts the old stdin back after.
class PipedStdin {
 public:
  PipedStdin() {
    saved_ = dup(STDIN_FILENO);
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) return;
    dup2(p[0], STDIN_FILENO);  // dup2 clears close-on-exec on stdin
    close(p[0]);
    write_end_ = p[1];
  }
  ~PipedStdin() {
    if (write_end_ >= 0) close(write_end_);
    if (saved_ >= 0) {
      dup2(saved_, STDIN_FILENO);
      close(saved_);
    } else {
      close(STDIN_FILENO);
    }
  }
  bool Write(const std::string& text) {
    return write(write_end_, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  }
  void CloseWriteEnd() {
    close(write_end_);
    write_end_ = -1;
  }

 private:
  int saved_ = -1;
  int write_end_ = -1;
};

// Workers inherit the launcher's stdin, as torchrun's do (`echo 3 | ddprun
// ... prog`, pdb in a lone worker reading from a pipe). They got /dev/null.
TEST(SpawnTest, WorkersReadTheLaunchersStdin) {
  PipedStdin in;
  const std::string pipe_name = DescriptorTarget(STDIN_FILENO);
  ASSERT_EQ(pipe_name.rfind("pipe:", 0), 0u) << pipe_name;
  ASSERT_TRUE(in.Write("first line\nsecond\n"));
  in.CloseWriteEnd();
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(1, "reads_stdin", {{"READ_LINE", "1"}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  ASSERT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  EXPECT_EQ(result.output[0], "stdin: " + pipe_name + "\nread 'first line'\n");
  // Every worker of a group shares the one stdin.
  group = WorkerGroup::Start(Specs(3, "reads_stdin"), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  result = (*group)->Wait(DeadlineIn(20s));
  ASSERT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  for (int r = 0; r < 3; ++r) EXPECT_EQ(result.output[r], "stdin: " + pipe_name + "\n") << "rank " << r;
}

// A worker blocked reading stdin (a pipe whose writer never writes) does
// not hold up the group's stop: SIGTERM ends it.
TEST(SpawnTest, AWorkerWaitingOnStdinIsStopped) {
  PipedStdin in;
  const std::string dir = TempDir("waiting_on_stdin");
  for (int r = 0; r < 2; ++r) unlink((dir + "/rank" + std::to_string(r)).c_str());
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "reads_stdin", {{"READ_LINE", "1"}, {"PID_DIR", dir}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  for (int r = 0; r < 2; ++r) EXPECT_GT(ReadPid(dir + "/rank" + std::to_string(r), 20s), 0);
  (*group)->RequestStop("test asked to stop");
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_EQ(result.outcome, GroupOutcome::kStopped) << result.reason;
  for (const WorkerExit& w : result.workers) {
    EXPECT_TRUE(w.signaled) << w.Describe() << "\n" << result.output[w.rank];
    EXPECT_EQ(w.code, SIGTERM) << w.Describe();
  }
  ExpectNoChildrenLeft();
}

// A launcher whose stdin is closed gives its workers /dev/null there, so
// that the first file a worker opens does not become its stdin.
TEST(SpawnTest, WorkersOfALauncherWithoutStdinGetDevNull) {
  const int saved = dup(STDIN_FILENO);
  close(STDIN_FILENO);
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "reads_stdin", {{"READ_LINE", "1"}}), Quiet());
  GroupResult result;
  if (group.ok()) result = (*group)->Wait(DeadlineIn(20s));
  // Only once the group is gone: one of its descriptors may have number 0.
  if (group.ok()) group->reset();
  if (saved >= 0) {
    dup2(saved, STDIN_FILENO);
    close(saved);
  }
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(result.output[r], "stdin: /dev/null\nread nothing: end of input\n") << "rank " << r;
  }
}

// A worker that reads the terminal (pdb, input()) is stopped by SIGTTIN;
// the reason says how to give the workers their input after all.
TEST(SpawnTest, AWorkerStoppedForReadingTheTerminalIsToldOfPipes) {
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(
      Specs(2, "fail_rank1", {{"HOW", std::to_string(SIGTTIN)}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed);
  EXPECT_EQ(result.reason, "rank 1 (pid " + std::to_string(pids[1]) +
                               ") was stopped by SIGTTIN: it read from the terminal, which workers (in a "
                               "process group of their own) may not do (give the launcher its input from a "
                               "pipe or a file instead); stopping the workers");
  ExpectNoChildrenLeft();
}

TEST(SpawnTest, WithoutStopAllSurvivorsRunToTheirEnd) {
  SpawnOptions options = Quiet();
  options.stop_all_on_failure = false;
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(3, "fail_rank1", {{"OTHERS_FINISH", "1"}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed);
  EXPECT_EQ(result.first_failure->rank, 1);
  EXPECT_TRUE(result.workers[0].ok());
  EXPECT_TRUE(result.workers[2].ok());
}

TEST(SpawnTest, WorkerIgnoringSigtermIsKilledAfterTheGrace) {
  SpawnOptions options = Quiet();
  options.grace = 300ms;
  const std::string dir = TempDir("ignoring_sigterm");
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "sleeper", {{"IGNORE_TERM", "1"}, {"PID_DIR", dir}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  // Both have installed SIG_IGN (a fixed sleep was too short under ASan).
  for (int r = 0; r < 2; ++r) EXPECT_GT(ReadPid(dir + "/rank" + std::to_string(r), 20s), 0);
  const auto start = Clock::now();
  (*group)->RequestStop("test asked to stop");
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  const auto took = Clock::now() - start;
  EXPECT_EQ(result.outcome, GroupOutcome::kStopped);
  EXPECT_EQ(result.reason, "test asked to stop");
  EXPECT_EQ(result.ExitCode(), 1);
  EXPECT_GE(took, 290ms);
  EXPECT_LT(took, 5s);
  for (const WorkerExit& w : result.workers) {
    EXPECT_TRUE(w.signaled);
    EXPECT_EQ(w.code, SIGKILL) << w.Describe();
  }
  ExpectNoChildrenLeft();
}

// A worker that cannot be reaped in time keeps the group's watcher armed
// with the group's id, so Wait leaves the group leader a zombie: its pid is
// that id, which must not pass to a new group before the destructor has
// killed the group. Here another process traces rank 1, and alone sees its
// death until it lets go. Wait used to reap the leader all the same.
TEST(SpawnTest, TheLeaderStaysUnreapedWhileAWorkerCannotBeReaped) {
  SpawnOptions options = Quiet();
  options.grace = 100ms;
  const std::string dir = TempDir("unreapable_worker");
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "sleeper", {{"PID_DIR", dir}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  for (int r = 0; r < 2; ++r) ASSERT_GT(ReadPid(dir + "/rank" + std::to_string(r), 20s), 0);
  const pid_t leader = (*group)->process_group();
  ASSERT_EQ(leader, (*group)->pids()[0]);
  const pid_t traced = (*group)->pids()[1];
  int ready[2];
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  const pid_t tracer = fork();
  ASSERT_GE(tracer, 0);
  if (tracer == 0) {
    // Raw calls only: this test process may have other threads.
    const char seized = ptrace(PTRACE_SEIZE, traced, nullptr, nullptr) == 0 ? 1 : 0;
    ssize_t n = write(ready[1], &seized, 1);
    (void)n;
    for (;;) pause();  // until the test kills it
  }
  close(ready[1]);
  char seized = 0;
  const ssize_t got = read(ready[0], &seized, 1);  // its write, or end-of-file should it die
  close(ready[0]);
  if (got != 1 || seized != 1) {
    kill(tracer, SIGKILL);
    waitpid(tracer, nullptr, 0);
    FAIL() << "could not trace rank 1 (pid " << traced << ")";
  }

  (*group)->RequestStop("test asked to stop");
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_FALSE(result.workers[1].exited) << result.workers[1].Describe();
  std::ifstream stat("/proc/" + std::to_string(leader) + "/stat");
  EXPECT_TRUE(stat.good()) << "the leader (pid " << leader << ") was reaped";
  EXPECT_TRUE(ProcessGone(leader));

  kill(tracer, SIGKILL);  // lets go of rank 1, whose death reaches this process
  ASSERT_EQ(waitpid(tracer, nullptr, 0), tracer);
  group->reset();
  ExpectNoChildrenLeft();
}

// A worker stopped by SIGSTOP (or a debugger) is left stopped, and its
// peers wait for it: the group says so once, and again when it continues,
// instead of nothing at all.
TEST(SpawnTest, AWorkerStoppedBySigstopIsToldOfAndLeftStopped) {
  const std::string dir = TempDir("sigstop");
  std::mutex mu;
  std::vector<std::string> notices;
  SpawnOptions options = Quiet();
  options.on_notice = [&](const std::string& line) {
    std::lock_guard lock(mu);
    notices.push_back(line);
  };
  auto told = [&](size_t n, std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    while (Clock::now() < until) {
      {
        std::lock_guard lock(mu);
        if (notices.size() >= n) return true;
      }
      std::this_thread::sleep_for(10ms);
    }
    return false;
  };
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "sleeper", {{"PID_DIR", dir}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  const pid_t pid = ReadPid(dir + "/rank1", 20s);
  ASSERT_GT(pid, 0);
  std::thread driver([&] {
    kill(pid, SIGSTOP);
    if (told(1, 10s)) kill(pid, SIGCONT);
    if (told(2, 10s)) (*group)->RequestStop("test done");
  });
  GroupResult result = (*group)->Wait(DeadlineIn(30s));
  driver.join();
  EXPECT_EQ(result.outcome, GroupOutcome::kStopped) << result.reason;
  std::lock_guard lock(mu);
  ASSERT_EQ(notices.size(), 2u);
  const std::string who = "rank 1 (pid " + std::to_string(pid) + ")";
  EXPECT_EQ(notices[0], who + " is stopped (SIGSTOP); the other ranks wait for it until their timeout; "
                              "SIGCONT continues it");
  EXPECT_EQ(notices[1], who + " continues");
  ExpectNoChildrenLeft();
}

// Exits 7 200 ms after its first SIGTERM (a worker that saves a checkpoint
// before it leaves); writes $PID_DIR/rank<R> once the handler is set.
std::atomic<bool> g_term_seen{false};
DDP_TEST_WORKER(slow_to_stop) {
  struct sigaction action = {};
  action.sa_handler = [](int) { g_term_seen.store(true); };
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  WritePid("rank" + std::to_string(EnvInt("RANK", -1)));
  for (int i = 0; i < 3000 && !g_term_seen.load(); ++i) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(200ms);
  return 7;
}

// A grace period too long to add to the clock (milliseconds::max(): wait
// for as long as the workers take) lets them end in their own time, rather
// than wrapping into the past and killing them at once; a negative one is
// refused.
TEST(SpawnTest, AGracePeriodWithoutEndIsWaitedAndANegativeOneIsRefused) {
  const std::string dir = TempDir("endless_grace");
  unlink((dir + "/rank0").c_str());
  SpawnOptions options = Quiet();
  options.grace = std::chrono::milliseconds::max();
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(1, "slow_to_stop", {{"PID_DIR", dir}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_GT(ReadPid(dir + "/rank0", 20s), 0);
  (*group)->RequestStop("test asked to stop");
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kStopped);
  EXPECT_FALSE(result.workers[0].signaled) << result.workers[0].Describe();
  EXPECT_EQ(result.workers[0].code, 7) << result.workers[0].Describe();

  options.grace = -1ms;
  group = WorkerGroup::Start(Specs(1, "hello"), options);
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(group.status().message(), "the grace period between SIGTERM and SIGKILL is -1 ms; it must be 0 or more");
  ExpectNoChildrenLeft();
}

// Wait watches once; called again, it says what it found the first time
// rather than a success of workers that are gone.
TEST(SpawnTest, ASecondWaitReturnsWhatTheFirstFound) {
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "fail_rank1", {{"FAIL_AFTER_MS", "0"}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const GroupResult first = (*group)->Wait(DeadlineIn(20s));
  ASSERT_EQ(first.outcome, GroupOutcome::kWorkerFailed) << first.reason;
  const auto start = Clock::now();
  const GroupResult second = (*group)->Wait(DeadlineIn(20s));
  EXPECT_LT(Clock::now() - start, 1s);
  EXPECT_EQ(second.outcome, GroupOutcome::kWorkerFailed) << second.reason;
  EXPECT_EQ(second.reason, first.reason);
  EXPECT_EQ(second.ExitCode(), 3);
  ASSERT_EQ(second.workers.size(), 2u);
  EXPECT_EQ(second.workers[1].code, 3);
  EXPECT_EQ(second.output, first.output);
  ExpectNoChildrenLeft();
}

TEST(SpawnTest, DeadlineStopsTheWorkers) {
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "sleeper"), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(300ms));
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_EQ(result.outcome, GroupOutcome::kTimedOut);
  EXPECT_TRUE(result.deadline_passed);
  EXPECT_THAT(result.reason, HasSubstr("(the deadline); stopped them"));
  ExpectNoChildrenLeft();
}

TEST(SpawnTest, RequestStopFromAnotherThread) {
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "sleeper"), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    (*group)->RequestStop("node 1 failed");
  });
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  stopper.join();
  EXPECT_EQ(result.outcome, GroupOutcome::kStopped);
  EXPECT_EQ(result.reason, "node 1 failed");
  for (const WorkerExit& w : result.workers) EXPECT_EQ(w.code, SIGTERM) << w.Describe();
}

// A stop requested without a reason still says why the workers were
// stopped: the reason is empty on success only (it was empty, and a
// launcher printing it said nothing).
TEST(SpawnTest, AStopRequestedWithoutAReasonSaysSo) {
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(1, "sleeper"), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  (*group)->RequestStop("");
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kStopped);
  EXPECT_EQ(result.reason, "a stop was requested (RequestStop, no reason given)");
  ExpectNoChildrenLeft();
}

// A stop requested (another node failed) when a worker of this group had
// already failed: that worker is the group's failure, with its exit code.
// Wait used to act on the stop first and never record the failure (kStopped,
// exit status 1).
TEST(SpawnTest, AFailureThatCameBeforeAStopRequestCounts) {
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "fail_rank1", {{"FAIL_AFTER_MS", "0"}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  ASSERT_TRUE(GoneWithin(pids[1], 10s));  // exited with code 3, not yet reaped
  (*group)->RequestStop("node 1 failed");
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed) << result.reason;
  ASSERT_TRUE(result.first_failure.has_value()) << result.reason;
  EXPECT_EQ(result.first_failure->rank, 1);
  EXPECT_EQ(result.reason, "rank 1 (pid " + std::to_string(pids[1]) +
                               ") exited with code 3; stopping the other workers");
  EXPECT_EQ(result.ExitCode(), 3);
  EXPECT_EQ(result.workers[0].code, SIGTERM) << result.workers[0].Describe();
  ExpectNoChildrenLeft();
}

// Without stop_all_on_failure a failed worker leaves the others running; a
// stop requested afterwards stops them, and the group's outcome is still
// that failure (the stop used to replace it: kStopped, exit status 1).
TEST(SpawnTest, AStopAfterAFailureThatLeftTheOthersRunningKeepsTheFailure) {
  SpawnOptions options = Quiet();
  options.stop_all_on_failure = false;
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "fail_rank1", {{"FAIL_AFTER_MS", "0"}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  ASSERT_TRUE(GoneWithin(pids[1], 10s));
  // Wait sees the failure first, then the stop (a later round).
  std::thread stopper([&] {
    std::this_thread::sleep_for(500ms);
    (*group)->RequestStop("node 1 failed");
  });
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  stopper.join();
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed) << result.reason;
  ASSERT_TRUE(result.first_failure.has_value()) << result.reason;
  EXPECT_EQ(result.first_failure->rank, 1);
  EXPECT_EQ(result.ExitCode(), 3);
  EXPECT_EQ(result.workers[0].code, SIGTERM) << result.workers[0].Describe();
  ExpectNoChildrenLeft();
}

// The same with Wait's deadline in place of the stop: the failure stays
// the outcome, with its exit code (the deadline used to replace it:
// kTimedOut, exit status 1, and the failure gone from the reason).
TEST(SpawnTest, ADeadlineAfterAFailureThatLeftTheOthersRunningKeepsTheFailure) {
  SpawnOptions options = Quiet();
  options.stop_all_on_failure = false;
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "fail_rank1", {{"FAIL_AFTER_MS", "0"}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  ASSERT_TRUE(GoneWithin(pids[1], 10s));
  GroupResult result = (*group)->Wait(DeadlineIn(1000ms));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed) << result.reason;
  ASSERT_TRUE(result.first_failure.has_value()) << result.reason;
  EXPECT_EQ(result.first_failure->rank, 1);
  EXPECT_EQ(result.ExitCode(), 3);
  EXPECT_THAT(result.reason, ::testing::StartsWith("rank 1 (pid " + std::to_string(pids[1]) +
                                                   ") exited with code 3; the others were still running after "));
  EXPECT_THAT(result.reason, ::testing::EndsWith(" ms (the deadline); stopped them"));
  EXPECT_TRUE(result.deadline_passed) << "nothing but the reason's text said that the survivors hung";
  EXPECT_EQ(result.workers[0].code, SIGTERM) << result.workers[0].Describe();
  ExpectNoChildrenLeft();
}

// Two workers found dead at one look: rank 1 was killed by a signal, then
// rank 0 exited with code 1. The one killed by the signal is the first
// failure (it used to be the first in rank order: rank 0, exit status 1).
TEST(SpawnTest, OfWorkersFoundDeadTogetherOneKilledByASignalFailedFirst) {
  const std::string dir = TempDir("killed_then_exits");
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "killed_then_exits", {{"PID_DIR", dir}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> pids = (*group)->pids();
  ASSERT_TRUE(GoneWithin(pids[1], 10s));
  std::ofstream(dir + "/go").put('\n');
  ASSERT_TRUE(GoneWithin(pids[0], 10s));
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed) << result.reason;
  ASSERT_TRUE(result.first_failure.has_value()) << result.reason;
  EXPECT_EQ(result.first_failure->rank, 1);
  EXPECT_EQ(result.reason, "rank 1 (pid " + std::to_string(pids[1]) + ") was killed by signal 9 (SIGKILL)");
  EXPECT_EQ(result.ExitCode(), 128 + SIGKILL);
  EXPECT_FALSE(result.workers[0].signaled);
  EXPECT_EQ(result.workers[0].code, 1);
  ExpectNoChildrenLeft();
}

TEST(SpawnTest, SignalsToTheLauncherReachEveryWorker) {
  for (int signo : {SIGTERM, SIGINT, SIGQUIT}) {
    SpawnOptions options = Quiet();
    options.forward_signals = true;
    StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(3, "sleeper"), options);
    ASSERT_TRUE(group.ok()) << group.status();
    const pthread_t waiter = pthread_self();
    std::thread sender([signo, waiter] {
      std::this_thread::sleep_for(100ms);
      pthread_kill(waiter, signo);
    });
    GroupResult result = (*group)->Wait(DeadlineIn(20s));
    sender.join();
    EXPECT_EQ(result.outcome, GroupOutcome::kInterrupted);
    EXPECT_EQ(result.signal, signo);
    EXPECT_EQ(result.reason, "interrupted by " + SignalName(signo) + "; forwarded it to every worker");
    EXPECT_EQ(result.ExitCode(), 128 + signo);
    for (const WorkerExit& w : result.workers) {
      EXPECT_TRUE(w.signaled);
      EXPECT_EQ(w.code, signo) << w.Describe();
    }
  }
  ExpectNoChildrenLeft();
}

// A worker that did not end by the forwarded signal (here: ignored it and
// was killed after the grace) is named, so that a rank that hung on Ctrl-C
// does not pass unnoticed.
TEST(SpawnTest, InterruptionNamesAWorkerThatDidNotStopAsAsked) {
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  options.grace = 300ms;
  const std::string dir = TempDir("ignoring_sigint");
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(3, "sleeper", {{"IGNORING_RANK", "1"}, {"PID_DIR", dir}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  const pthread_t waiter = pthread_self();
  std::thread sender([waiter, dir] {
    // Rank 1 has installed SIG_IGN (a fixed sleep was too short under ASan).
    ReadPid(dir + "/rank1", 20s);
    pthread_kill(waiter, SIGINT);
  });
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  sender.join();
  EXPECT_EQ(result.outcome, GroupOutcome::kInterrupted);
  EXPECT_EQ(result.ExitCode(), 128 + SIGINT);
  EXPECT_EQ(result.reason, "interrupted by SIGINT; forwarded it to every worker; rank 1 (pid " +
                               std::to_string(result.workers[1].pid) +
                               ") was killed by signal 9 (SIGKILL)");
  ExpectNoChildrenLeft();
}

// A signal that arrives while the workers are being stopped after a
// failure is not lost: Wait reports the interruption (so that a launcher does
// not restart), keeps the first failure, and forwards the signal.
TEST(SpawnTest, SignalWhileStoppingAfterAFailureIsReported) {
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  // Far longer than the test takes when the signal ends the stop.
  options.grace = 15000ms;
  const std::string dir = TempDir("signal_while_stopping");
  for (const char* name : {"/rank0", "/rank1", "/rank0.term"}) unlink((dir + name).c_str());
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(
      Specs(2, "fail_rank1", {{"IGNORE_TERM", "1"}, {"FAIL_AFTER_MS", "500"}, {"PID_DIR", dir}, {"AFTER_RANK0", "1"}}),
      options);
  ASSERT_TRUE(group.ok()) << group.status();
  const pthread_t waiter = pthread_self();
  std::thread sender([waiter, dir] {
    // Rank 1 exits 500 ms after rank 0 is ready, and the group sends
    // SIGTERM to rank 0, which ignores it but marks its arrival: the group
    // is stopping from then until the grace period ends.
    const auto deadline = Clock::now() + 20s;
    while (access((dir + "/rank0.term").c_str(), F_OK) != 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(5ms);
    }
    pthread_kill(waiter, SIGINT);
  });
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(30s));
  sender.join();
  // The signal cut the grace period short.
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_EQ(access((dir + "/rank0.term").c_str(), F_OK), 0) << "rank 0 got no SIGTERM";
  EXPECT_EQ(result.outcome, GroupOutcome::kInterrupted) << result.reason;
  EXPECT_EQ(result.signal, SIGINT);
  EXPECT_EQ(result.ExitCode(), 128 + SIGINT);
  ASSERT_TRUE(result.first_failure.has_value());
  EXPECT_EQ(result.first_failure->rank, 1);
  EXPECT_THAT(result.reason, HasSubstr("rank 1 (pid "));
  EXPECT_THAT(result.reason, HasSubstr("stopping the other workers; then interrupted by SIGINT"));
  // Rank 0 ignored SIGTERM but not SIGINT: the forwarded signal ended it.
  EXPECT_TRUE(result.workers[0].signaled);
  EXPECT_EQ(result.workers[0].code, SIGINT) << result.workers[0].Describe();
  EXPECT_NE(InterruptSignal(), 0);  // recorded for the launcher's restart loop
  ExpectNoChildrenLeft();
}

// A monitor loop that cannot poll (here: more descriptors to watch than
// RLIMIT_NOFILE allows, which poll refuses with EINVAL) stops the workers
// and reports a failure, never a success.
TEST(SpawnTest, PollFailureIsAnErrorAndStopsTheWorkers) {
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "sleeper"), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = 3;  // the group watches 7: a stop event, 2 pidfds, 4 pipes
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_EQ(result.outcome, GroupOutcome::kMonitorFailed) << result.reason;
  EXPECT_EQ(result.ExitCode(), 1);
  EXPECT_EQ(result.reason,
            "cannot watch the workers (poll: Invalid argument); killed every worker still running");
  for (const WorkerExit& w : result.workers) {
    EXPECT_TRUE(w.signaled) << w.Describe();
    EXPECT_EQ(w.code, SIGKILL) << w.Describe();
  }
  group->reset();
  ExpectNoChildrenLeft();
}

// Under nohup SIGHUP is ignored; forwarding leaves it so (and the workers
// inherit that), while it still catches the signals not ignored.
TEST(SpawnTest, IgnoredSignalStaysIgnored) {
  struct sigaction saved{};
  struct sigaction ignore{};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ASSERT_EQ(sigaction(SIGHUP, &ignore, &saved), 0);
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(1, "sleeper"), options);
  ASSERT_TRUE(group.ok()) << group.status();
  struct sigaction hup{}, term{};
  sigaction(SIGHUP, nullptr, &hup);
  sigaction(SIGTERM, nullptr, &term);
  EXPECT_EQ(hup.sa_handler, SIG_IGN);
  EXPECT_NE(term.sa_handler, SIG_DFL);  // forwarded
  const pid_t worker = (*group)->pids()[0];
  std::this_thread::sleep_for(100ms);
  kill(worker, SIGHUP);  // the worker ignores it too
  pthread_kill(pthread_self(), SIGHUP);
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(ProcessGone(worker));
  (*group)->RequestStop("done");
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kStopped) << result.reason;
  EXPECT_EQ(result.workers[0].code, SIGTERM) << result.workers[0].Describe();
  group->reset();
  sigaction(SIGHUP, nullptr, &hup);
  EXPECT_EQ(hup.sa_handler, SIG_IGN);
  sigaction(SIGHUP, &saved, nullptr);
  ExpectNoChildrenLeft();
}

// on_interrupt runs once, for the first signal, before any worker got it
// (a launcher tells the other nodes there, before its workers end).
TEST(SpawnTest, OnInterruptRunsBeforeTheSignalIsForwarded) {
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  const std::string dir = TempDir("on_interrupt");
  for (const char* name : {"/rank0", "/rank1"}) unlink((dir + name).c_str());
  std::vector<pid_t> pids;
  int calls = 0;
  int seen = 0;
  bool all_alive = false;
  options.on_interrupt = [&](int signo) {
    ++calls;
    seen = signo;
    all_alive = !pids.empty() && std::none_of(pids.begin(), pids.end(), ProcessGone);
  };
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(2, "sleeper", {{"IGNORING_RANK", "1"}, {"PID_DIR", dir}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  pids = (*group)->pids();
  const pthread_t waiter = pthread_self();
  std::thread sender([waiter, dir] {
    ReadPid(dir + "/rank0", 20s);
    ReadPid(dir + "/rank1", 20s);
    pthread_kill(waiter, SIGINT);
    // Rank 1 ignores SIGINT; a second signal ends the grace (SIGKILL).
    std::this_thread::sleep_for(200ms);
    pthread_kill(waiter, SIGTERM);
  });
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  sender.join();
  EXPECT_EQ(result.outcome, GroupOutcome::kInterrupted) << result.reason;
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, SIGINT);
  EXPECT_TRUE(all_alive) << "a worker was gone when on_interrupt ran";
  group->reset();
  ExpectNoChildrenLeft();
}

// Between groups a launcher may catch the signals (recorded, not fatal)
// once; a group takes them over and puts that back.
TEST(SpawnTest, CatchInterruptsRecordsOneSignalBetweenGroups) {
  auto handler = [](int signo) {
    struct sigaction current{};
    sigaction(signo, nullptr, &current);
    return current.sa_handler;
  };
  CatchInterrupts(true);
  const auto caught = handler(SIGHUP);
  EXPECT_NE(caught, SIG_DFL);
  EXPECT_NE(caught, SIG_IGN);
  {
    SpawnOptions options = Quiet();
    options.forward_signals = true;
    StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(1, "hello"), options);
    ASSERT_TRUE(group.ok()) << group.status();
    (*group)->Wait(DeadlineIn(20s));
  }
  EXPECT_EQ(handler(SIGHUP), caught);  // put back
  ASSERT_EQ(raise(SIGHUP), 0);         // recorded; this process goes on
  EXPECT_NE(InterruptSignal(), 0);
  EXPECT_EQ(handler(SIGHUP), SIG_DFL);  // a second one would end it
  EXPECT_NE(handler(SIGTERM), SIG_DFL);
  CatchInterrupts(false);
  EXPECT_EQ(handler(SIGTERM), SIG_DFL);
  EXPECT_EQ(handler(SIGINT), SIG_DFL);
  ExpectNoChildrenLeft();
}

// A signal caught between groups after the launcher's last look (ddprun
// checks InterruptSignal() just before it starts its workers) reaches the
// next group at once, instead of no worker at all.
TEST(SpawnTest, ASignalCaughtJustBeforeTheGroupStartsReachesIt) {
  CatchInterrupts(true);
  ASSERT_EQ(raise(SIGTERM), 0);  // recorded; no group forwards yet
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "sleeper"), options);
  ASSERT_TRUE(group.ok()) << group.status();
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kInterrupted) << result.reason;
  EXPECT_EQ(result.signal, SIGTERM);
  EXPECT_LT(Clock::now() - start, 10s);
  group->reset();
  CatchInterrupts(false);
  // Once the launcher stops catching, nothing caught reaches a later group.
  CatchInterrupts(true);
  ASSERT_EQ(raise(SIGINT), 0);
  CatchInterrupts(false);
  group = WorkerGroup::Start(Specs(1, "hello"), options);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ((*group)->Wait(DeadlineIn(20s)).outcome, GroupOutcome::kSucceeded);
  group->reset();
  ExpectNoChildrenLeft();
}

// A signal that reaches the launcher's own handler (CatchInterrupts) while
// a group that forwarded signals is being destroyed is one no group has
// seen: it must reach the next group. The group went on as the signals'
// recipient until after it had put the handlers back, and a signal in
// between went into the pipe that the next group empties of stale bytes
// on start: lost to every worker.
TEST(SpawnTest, ASignalCaughtWhileAGroupIsDestroyedReachesTheNextGroup) {
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  CatchInterrupts(true);
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(1, "hello"), options);
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_EQ((*group)->Wait(DeadlineIn(20s)).outcome, GroupOutcome::kSucceeded);
  // To this thread: its handler runs before raise returns.
  SetForwardingEndStepForTesting([] { raise(SIGINT); });
  group->reset();
  SetForwardingEndStepForTesting(nullptr);
  group = WorkerGroup::Start(Specs(1, "sleeper"), options);
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(5s));
  EXPECT_EQ(result.outcome, GroupOutcome::kInterrupted) << result.reason;
  EXPECT_EQ(result.signal, SIGINT);
  group->reset();
  CatchInterrupts(false);
  ExpectNoChildrenLeft();
}

TEST(SpawnTest, OnlyOneGroupForwardsSignals) {
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  StatusOr<std::unique_ptr<WorkerGroup>> first = WorkerGroup::Start(Specs(1, "hello"), options);
  ASSERT_TRUE(first.ok()) << first.status();
  StatusOr<std::unique_ptr<WorkerGroup>> second = WorkerGroup::Start(Specs(1, "hello"), options);
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  (*first)->Wait(DeadlineIn(20s));
}

// A forwarded signal reaches the worker's whole process group, as torchrun's
// killpg: the program a script worker runs gets it too, and can end
// cleanly, instead of being killed with the group once the grace is over.
TEST(SpawnTest, ForwardedSignalsReachTheChildrenOfWorkers) {
  const std::string dir = TempDir("script_child");
  unlink((dir + "/child.term").c_str());
  SpawnOptions options = Quiet();
  options.forward_signals = true;
  options.grace = 10000ms;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(1, "script", {{"PID_DIR", dir}}), options);
  ASSERT_TRUE(group.ok()) << group.status();
  const pthread_t waiter = pthread_self();
  std::thread sender([waiter, dir] {
    ReadPid(dir + "/child", 20s);
    pthread_kill(waiter, SIGTERM);
  });
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(30s));
  sender.join();
  EXPECT_EQ(result.outcome, GroupOutcome::kInterrupted) << result.reason;
  EXPECT_EQ(access((dir + "/child.term").c_str(), F_OK), 0) << "SIGTERM never reached the script's child";
  EXPECT_LT(Clock::now() - start, 8s) << "the group waited for the grace";
  group->reset();
  ExpectNoChildrenLeft();
}

// SIGCHLD's handler now, as SIG_DFL, SIG_IGN or another.
__sighandler_t SigchldHandler() {
  struct sigaction now{};
  sigaction(SIGCHLD, nullptr, &now);
  return now.sa_handler;
}

// A launcher started with SIGCHLD ignored (a parent that set it, inherited
// through exec) would never see its workers end: the kernel reaps them
// itself. The group sets it back to the default while it lives, and puts
// the ignoring back when it ends: the host program chose it (it was left
// at the default for good, and the program's later children stayed
// zombies until waited for).
TEST(SpawnTest, WorkersEndAlsoWhenTheLauncherStartedWithSigchldIgnored) {
  struct sigaction ignore{}, saved{};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ASSERT_EQ(sigaction(SIGCHLD, &ignore, &saved), 0);
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "hello"), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(SigchldHandler(), SIG_DFL);
  const auto start = Clock::now();
  GroupResult result = (*group)->Wait(DeadlineIn(10s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  EXPECT_LT(Clock::now() - start, 5s);
  group->reset();
  EXPECT_EQ(SigchldHandler(), SIG_IGN);
  sigaction(SIGCHLD, &saved, nullptr);
  ExpectNoChildrenLeft();
}

// With two groups alive, the one that ends first leaves SIGCHLD at the
// default (the other's workers must still be seen to end); the last one
// puts back what the host program had. One the host program set while
// the groups ran is its choice, and stays.
TEST(SpawnTest, SigchldIgnoredComesBackWhenTheLastGroupEnds) {
  struct sigaction ignore{}, saved{};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ASSERT_EQ(sigaction(SIGCHLD, &ignore, &saved), 0);
  StatusOr<std::unique_ptr<WorkerGroup>> first = WorkerGroup::Start(Specs(1, "hello"), Quiet());
  ASSERT_TRUE(first.ok()) << first.status();
  StatusOr<std::unique_ptr<WorkerGroup>> second = WorkerGroup::Start(Specs(2, "hello"), Quiet());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*first)->Wait(DeadlineIn(10s)).outcome, GroupOutcome::kSucceeded);
  first->reset();
  EXPECT_EQ(SigchldHandler(), SIG_DFL) << "the first group to end put SIG_IGN back under the second";
  GroupResult result = (*second)->Wait(DeadlineIn(10s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  for (const WorkerExit& w : result.workers) EXPECT_TRUE(w.exited && !w.status_lost) << w.Describe();
  second->reset();
  EXPECT_EQ(SigchldHandler(), SIG_IGN);
  // A handler the host program installed while a group ran (one that
  // waits for nobody) stays.
  first = WorkerGroup::Start(Specs(1, "hello"), Quiet());
  ASSERT_TRUE(first.ok()) << first.status();
  struct sigaction own{};
  own.sa_handler = [](int) {};
  own.sa_flags = SA_RESTART;
  sigemptyset(&own.sa_mask);
  ASSERT_EQ(sigaction(SIGCHLD, &own, nullptr), 0);
  EXPECT_EQ((*first)->Wait(DeadlineIn(10s)).outcome, GroupOutcome::kSucceeded);
  first->reset();
  EXPECT_EQ(SigchldHandler(), own.sa_handler);
  sigaction(SIGCHLD, &saved, nullptr);
  ExpectNoChildrenLeft();
}

// SIGCHLD set to SIG_IGN by the host program while a group runs: a group
// started after that must set the default back too, or the kernel reaps
// its workers and their exit statuses are lost (only the first group alive
// looked). The ignoring is the host program's choice, and comes back when
// the last group ends.
TEST(SpawnTest, AGroupStartedAfterSigchldWasIgnoredUnderAnotherSeesItsWorkersExit) {
  struct sigaction ignore{}, saved{};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ASSERT_EQ(sigaction(SIGCHLD, nullptr, &saved), 0);
  const std::string dir = TempDir("sigchldlater");
  StatusOr<std::unique_ptr<WorkerGroup>> first =
      WorkerGroup::Start(Specs(1, "sleeper", {{"PID_DIR", dir}}), Quiet());
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(sigaction(SIGCHLD, &ignore, nullptr), 0);
  StatusOr<std::unique_ptr<WorkerGroup>> second =
      WorkerGroup::Start(Specs(2, "fail_rank1", {{"FAIL_AFTER_MS", "0"}}), Quiet());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(SigchldHandler(), SIG_DFL) << "the second group left SIGCHLD ignored";
  GroupResult result = (*second)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed) << result.reason;
  ASSERT_TRUE(result.first_failure.has_value()) << result.reason;
  EXPECT_EQ(result.first_failure->rank, 1);
  EXPECT_FALSE(result.first_failure->status_lost) << result.first_failure->Describe();
  EXPECT_EQ(result.ExitCode(), 3) << result.reason;
  second->reset();
  first->reset();
  EXPECT_EQ(SigchldHandler(), SIG_IGN);
  sigaction(SIGCHLD, &saved, nullptr);
  ExpectNoChildrenLeft();
}

// The launcher's stdout is a pipe whose reader is gone (`ddprun ... | head`,
// or `| tee` ended by the same Ctrl-C): copying the workers' output there
// must not kill it with SIGPIPE (and its workers with it). What cannot be
// written is dropped; the process's SIGPIPE handling stays as it was.
TEST(SpawnTest, OutputToAPipeNobodyReadsDoesNotKillTheLauncher) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  close(fds[0]);
  std::fflush(stdout);
  const int saved_stdout = dup(STDOUT_FILENO);
  ASSERT_GE(saved_stdout, 0);
  ASSERT_EQ(dup2(fds[1], STDOUT_FILENO), STDOUT_FILENO);
  close(fds[1]);
  SpawnOptions options = Quiet();
  options.output.to_terminal = true;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "hello"), options);
  GroupResult result;
  if (group.ok()) result = (*group)->Wait(DeadlineIn(20s));
  dup2(saved_stdout, STDOUT_FILENO);
  close(saved_stdout);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  EXPECT_THAT(result.output[0], HasSubstr("hello from rank 0"));
  struct sigaction now{};
  sigaction(SIGPIPE, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);
  sigset_t pending;
  sigpending(&pending);
  EXPECT_EQ(sigismember(&pending, SIGPIPE), 0);
  group->reset();
  ExpectNoChildrenLeft();
}

TEST(SpawnTest, ChildrenOfWorkersDoNotOutliveTheGroup) {
  const std::string dir = TempDir("grandchild");
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(1, "grandparent", {{"PID_DIR", dir}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  const pid_t grandchild = ReadPid(dir + "/grandchild", 5s);
  ASSERT_GT(grandchild, 0);
  EXPECT_TRUE(GoneWithin(grandchild, 5s));
}

// With the worker reaped by someone else, its children still hold the
// group's id (a process group's id is not reused while it has members):
// they are killed with the group, not left running.
TEST(SpawnTest, ChildrenOfAWorkerReapedBySomeoneElseDoNotOutliveTheGroup) {
  const std::string dir = TempDir("grandchild_of_a_lost_worker");
  StatusOr<std::unique_ptr<WorkerGroup>> group =
      WorkerGroup::Start(Specs(1, "grandparent", {{"PID_DIR", dir}}), Quiet());
  ASSERT_TRUE(group.ok()) << group.status();
  const pid_t grandchild = ReadPid(dir + "/grandchild", 5s);
  ASSERT_GT(grandchild, 0);
  ASSERT_TRUE(ReapWithin((*group)->pids()[0], 10s));  // as a stray SIGCHLD handler would
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kWorkerFailed) << result.reason;
  if (!GoneWithin(grandchild, 5s)) {
    ADD_FAILURE() << "the worker's child " << grandchild << " outlived the group";
    kill(grandchild, SIGKILL);  // not left running
  }
}

// The last rank, and the first (which leads the group and has told the
// watcher its id, and whose failure ends the watcher before it is reaped).
// Specs that would make two workers write over each other's log and error
// files, or set a variable other than the one named, are refused before
// any worker starts, with the spec named.
TEST(SpawnTest, BadSpecsAreRefusedBeforeAnyWorkerStarts) {
  const std::string dir = TempDir("bad_specs");
  // Must outlive its case (a launcher that removed it would be wrong).
  ASSERT_EQ(mkfifo((dir + "/error.fifo").c_str(), 0644), 0) << std::strerror(errno);
  char cwd_now[PATH_MAX];
  ASSERT_NE(getcwd(cwd_now, sizeof(cwd_now)), nullptr) << std::strerror(errno);
  struct Case {
    std::string what;
    std::function<void(std::vector<WorkerSpec>&, SpawnOptions&)> spoil;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"one rank twice", [](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[2].rank = 0; },
       "rank 0 is given to two workers (specs 0 and 2); each worker needs a rank of its own"},
      {"one log folder twice",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         specs[1].log_name = "0";
       },
       "ranks 0 and 1 would share the log folder '" + dir + "/logs/0'; give them different log names"},
      {"one log folder twice, spelled './0'",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         specs[1].log_name = "./0";
       },
       "ranks 0 and 1 would share the log folder '" + dir + "/logs/./0'; give them different log names"},
      {"one log folder twice, spelled '0/'",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         specs[2].log_name = "0/";
       },
       "ranks 0 and 2 would share the log folder '" + dir + "/logs/0/'; give them different log names"},
      {"one log folder twice, spelled 'x/../0'",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         specs[1].log_name = "x/../0";
       },
       "ranks 0 and 1 would share the log folder '" + dir + "/logs/x/../0'; give them different log names"},
      {"a log name that climbs out of log_dir",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         specs[1].log_name = "a/../../outside";
       },
       "rank 1: its log folder 'a/../../outside' (log_name_prefix and log name) is not a folder inside log_dir '" +
           dir + "/logs'; give it a relative name without '..'"},
      {"a log name with a leading '/'",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         specs[2].log_name = dir + "/elsewhere";
       },
       "rank 2: its log folder '" + dir + "/elsewhere' (log_name_prefix and log name) is not a folder inside "
           "log_dir '" + dir + "/logs'; give it a relative name without '..'"},
      {"a log name that is log_dir itself",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         specs[0].log_name = ".";
       },
       "rank 0: its log folder '.' (log_name_prefix and log name) is not a folder inside log_dir '" + dir +
           "/logs'; give it a relative name without '..'"},
      {"one error file of their own twice",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions&) {
         specs[0].env.emplace_back(kEnvErrorFile, dir + "/error.json");
         specs[2].env.emplace_back(kEnvErrorFile, dir + "/./error.json");
       },
       "ranks 0 and 2 name one error file of their own, '" + dir + "/error.json' and '" + dir +
           "/./error.json' (TORCHELASTIC_ERROR_FILE), whose message would be blamed on either; give each its own"},
      {"one error file of their own twice, spelled alike",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions&) {
         specs[1].env.emplace_back(kEnvErrorFile, dir + "/same.json");
         specs[2].env.emplace_back(kEnvErrorFile, dir + "/same.json");
       },
       "ranks 1 and 2 name one error file of their own, '" + dir +
           "/same.json' (TORCHELASTIC_ERROR_FILE), whose message would be blamed on either; give each its own"},
      {"one error file of their own twice, once relative",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions&) {
         char cwd[PATH_MAX];
         ASSERT_NE(getcwd(cwd, sizeof(cwd)), nullptr);
         specs[0].env.emplace_back(kEnvErrorFile, std::string(cwd) + "/no_such_folder/error.json");
         specs[1].env.emplace_back(kEnvErrorFile, "./no_such_folder/error.json");
       },
       "ranks 0 and 1 name one error file of their own, '" + std::string(cwd_now) +
           "/no_such_folder/error.json' and './no_such_folder/error.json' (TORCHELASTIC_ERROR_FILE), "
           "whose message would be blamed on either; give each its own"},
      {"an error file of its own that is another worker's default one",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         specs[2].env.emplace_back(kEnvErrorFile, dir + "/logs/./0/error.json");
       },
       "rank 2's own error file '" + dir + "/logs/./0/error.json' (TORCHELASTIC_ERROR_FILE) is rank 0's default "
           "one, '" + dir + "/logs/0/error.json', whose message would be blamed on either; give it another"},
      {"an error file of its own that is a later worker's default one",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         options.output.log_name_prefix = "attempt_0/";
         specs[0].env.emplace_back(kEnvErrorFile, dir + "/logs/attempt_0/2/error.json");
       },
       "rank 0's own error file '" + dir + "/logs/attempt_0/2/error.json' (TORCHELASTIC_ERROR_FILE) is rank 2's "
           "default one, '" + dir + "/logs/attempt_0/2/error.json', whose message would be blamed on either; give "
           "it another"},
      {"an error file of its own that is a FIFO",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[1].env.emplace_back(kEnvErrorFile, dir + "/error.fifo"); },
       "rank 1: its error file '" + dir + "/error.fifo' (TORCHELASTIC_ERROR_FILE) is a FIFO, not a regular file; "
           "the launcher removes a stale one and reads it after the worker ends, so it must name a regular file or "
           "none there yet"},
      {"a variable name with '='",
       [](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[1].env.emplace_back("A=B", "c"); },
       "rank 1: environment variable name 'A=B' is empty or holds '=' or a NUL byte"},
      {"an empty variable name",
       [](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[0].env.emplace_back("", "c"); },
       "rank 0: environment variable name '' is empty or holds '=' or a NUL byte"},
      {"no argument vector", [](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[2].argv.clear(); },
       "rank 2: no argument vector given (it holds argv[0] at least)"},
      {"a NUL byte in an argument",
       [](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[1].argv.push_back(std::string("a\0b", 3)); },
       "rank 1: argv[1] holds a NUL byte"},
      {"a NUL byte in a variable's value",
       [](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[0].env.emplace_back("X", std::string("a\0b", 3)); },
       "rank 0: the value of X holds a NUL byte"},
      {"a NUL byte in the program's path",
       [](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[2].program += std::string(1, '\0'); },
       "rank 2: its program's path holds a NUL byte"},
      {"a NUL byte in a log name",
       [&](std::vector<WorkerSpec>& specs, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         specs[1].log_name = std::string("a\0b", 3);
       },
       "rank 1: its log name holds a NUL byte"},
      {"a NUL byte in log_name_prefix",
       [&](std::vector<WorkerSpec>&, SpawnOptions& options) {
         options.output.log_dir = dir + "/logs";
         options.output.log_name_prefix = std::string("attempt_0\0/", 11);
       },
       "log_name_prefix holds a NUL byte"},
      {"a negative rank", [](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[1].rank = -1; },
       "rank -1 (spec 1): a rank is 0 or more"},
      {"a stream set beyond stdout and stderr",
       [](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[2].logged_streams = 4; },
       "rank 2: its logged_streams is 4; it takes 0 (no stream), 1 (stdout), 2 (stderr) or 3 (both)"},
      {"a negative stream set",
       [](std::vector<WorkerSpec>& specs, SpawnOptions&) { specs[0].shown_streams = -1; },
       "rank 0: its shown_streams is -1; it takes 0 (no stream), 1 (stdout), 2 (stderr) or 3 (both)"},
      // Shown nowhere: a filter that names no worker would leave the
      // terminal silent with no word of why.
      {"a terminal rank that no worker has",
       [](std::vector<WorkerSpec>&, SpawnOptions& options) {
         options.output.to_terminal = true;
         options.output.terminal_ranks = {1, 7};
       },
       "terminal_ranks names rank 7, which no worker has (their ranks: 0, 1, 2)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<WorkerSpec> specs = Specs(3, "hello");
    SpawnOptions options = Quiet();
    c.spoil(specs, options);
    StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(specs, options);
    EXPECT_FALSE(group.ok()) << "the group started";
    EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(group.status().message(), c.message);
    if (group.ok()) group->reset();  // one that started anyway is stopped here
    ExpectNoChildrenLeft();
  }
  struct stat fifo_st{};
  EXPECT_EQ(lstat((dir + "/error.fifo").c_str(), &fifo_st), 0) << "the FIFO named as an error file was removed";
  EXPECT_NE(access((dir + "/outside").c_str(), F_OK), 0) << "a log folder was made outside log_dir";
  EXPECT_NE(access((dir + "/elsewhere").c_str(), F_OK), 0) << "a log folder was made outside log_dir";
  struct stat st{};
  EXPECT_NE(stat((dir + "/logs").c_str(), &st), 0) << "a log folder was made for a group that never started";
}

TEST(SpawnTest, ProgramThatCannotStartLeavesNothingRunning) {
  for (const int bad : {2, 0}) {
    SCOPED_TRACE("rank " + std::to_string(bad));
    std::vector<WorkerSpec> specs = Specs(3, "sleeper");
    specs[bad].program = "/nonexistent/program";
    StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(specs, Quiet());
    ASSERT_FALSE(group.ok());
    EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(group.status().message(), "cannot start rank " + std::to_string(bad) +
                                            ": exec '/nonexistent/program': No such file or directory");
    ExpectNoChildrenLeft();
  }
}

// An exec that does not finish (here: a write lease on the program, held
// as an NFS server's delegation or Samba's oplock holds one, makes the
// kernel's open for exec wait for its break, 45 s by default; a hung
// network mount does the same) is killed at exec_timeout, and Start fails
// TIMED_OUT naming the rank and the program, with nothing left running;
// it held Start until the lease broke.
TEST(SpawnTest, AnExecThatDoesNotFinishIsKilledAtItsDeadline) {
  const std::string dir = TempDir("exec_held");
  const std::string program = dir + "/true";
  {
    std::ifstream in("/bin/true", std::ios::binary);
    std::ofstream out(program, std::ios::binary | std::ios::trunc);
    out << in.rdbuf();
  }
  ASSERT_EQ(chmod(program.c_str(), 0755), 0);
  const int held = open(program.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(held, 0) << std::strerror(errno);
  ASSERT_EQ(fcntl(held, F_SETLEASE, F_WRLCK), 0) << std::strerror(errno);
  // No one to tell of the break (SIGIO would end this process).
  ASSERT_EQ(fcntl(held, F_SETOWN, 0), 0) << std::strerror(errno);
  std::vector<WorkerSpec> specs = Specs(3, "sleeper");
  specs[1].program = program;
  SpawnOptions options = Quiet();
  // Long enough for the healthy ranks' exec on a loaded host too.
  options.exec_timeout = 3000ms;
  const auto start = Clock::now();
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(specs, options);
  const auto took = Clock::now() - start;
  fcntl(held, F_SETLEASE, F_UNLCK);
  close(held);
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), StatusCode::kTimedOut) << group.status();
  EXPECT_EQ(group.status().message(),
            "cannot start rank 1: exec '" + program +
                "' did not finish within 3000 ms (a file system that does not answer, such as a hung network "
                "mount, or a lease or delegation held on the file), so it was killed");
  EXPECT_LT(took, 10s);
  ExpectNoChildrenLeft();

  options.exec_timeout = 0ms;
  group = WorkerGroup::Start(Specs(1, "hello"), options);
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(group.status().message(),
            "the time a worker may take to exec (exec_timeout) is 0 ms; it must be more than 0");
}

// A child that another thread of the launcher forks while a worker starts
// holds a copy of the worker's exec report pipe: the watch of the exec
// ends when vfork returns, not when that copy closes; it waited for it
// and, at exec_timeout, killed the worker that had exec'd and failed Start
// as TIMED_OUT.
TEST(SpawnTest, AForkByAnotherThreadDoesNotHoldTheExecWatch) {
  std::atomic<bool> starting{true};
  std::vector<pid_t> forked;
  std::thread forker([&] {
    while (starting.load()) {
      const pid_t child = fork();
      if (child == 0) {
        usleep(2500 * 1000);  // holds whatever pipes were open at the fork
        _exit(0);
      }
      if (child > 0) forked.push_back(child);
      std::this_thread::sleep_for(200us);
    }
  });
  SpawnOptions options = Quiet();
  options.exec_timeout = 1000ms;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(8, "hello"), options);
  starting.store(false);
  forker.join();
  for (const pid_t child : forked) kill(child, SIGKILL);
  for (const pid_t child : forked) ReapWithin(child, 10s);
  ASSERT_TRUE(group.ok()) << group.status() << " (" << forked.size() << " children forked meanwhile)";
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  group->reset();
  ExpectNoChildrenLeft();
}

// The tasks (processes and threads, as RLIMIT_NPROC counts them) whose
// real user is `uid`.
int TasksOf(uid_t uid) {
  int count = 0;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return -1;
  while (const dirent* entry = readdir(proc)) {
    if (std::atoi(entry->d_name) <= 0) continue;
    std::ifstream status(std::string("/proc/") + entry->d_name + "/status");
    std::string line;
    unsigned real = 0, threads = 0;
    bool mine = false;
    while (std::getline(status, line)) {
      if (std::sscanf(line.c_str(), "Uid: %u", &real) == 1) mine = real == uid;
      std::sscanf(line.c_str(), "Threads: %u", &threads);
    }
    if (mine) count += static_cast<int>(threads);
  }
  closedir(proc);
  return count;
}

// A process that may start one more process or thread (RLIMIT_NPROC), which
// the group's watcher takes, fails to start its first worker with
// RESOURCE_EXHAUSTED naming the rank, as a shortage, and goes on: the
// thread that watches a worker's exec must not end it (an uncaught
// std::system_error). Runs in a child of its own (RunInAProcess), which
// drops root first (the limit does not hold for root). The count covers
// every task of the user, on the whole host: one that starts or ends
// between the count and the start (a parallel test, a build) makes it
// miss, so up to 10 tries, each with a fresh count (the soft limit only,
// which the next try may raise again). 0: so; 2: the limit could not be
// set; 3: the group started; 4: another code; 5: another message.
int NoProcessesLeftIsAShortage() {
  if (getuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) return 2;
  rlimit limit{};
  if (getrlimit(RLIMIT_NPROC, &limit) != 0) return 2;
  int verdict = 2;
  for (int attempt = 0; attempt < 10 && verdict != 0; ++attempt) {
    const int tasks = TasksOf(getuid());
    if (tasks <= 0) return 2;
    if (limit.rlim_max != RLIM_INFINITY && static_cast<rlim_t>(tasks + 1) > limit.rlim_max) return 2;
    limit.rlim_cur = static_cast<rlim_t>(tasks + 1);
    if (setrlimit(RLIMIT_NPROC, &limit) != 0) return 2;
    StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "hello"), Quiet());
    if (group.ok()) {
      verdict = 3;
    } else if (group.status().code() != StatusCode::kResourceExhausted) {
      verdict = 4;
    } else if (group.status().message().rfind("cannot start rank 0: ", 0) == 0) {
      verdict = 0;
    } else {
      std::fprintf(stderr, "%s\n", group.status().ToString().c_str());
      verdict = 5;
    }
  }
  return verdict;
}

TEST(SpawnTest, NoProcessesLeftIsAShortage) {
  EXPECT_EQ(RunInAProcess(&NoProcessesLeftIsAShortage), 0)
      << "1006: the launcher aborted (an uncaught exception); see the scenario for the other codes";
  ExpectNoChildrenLeft();
}

// A program given by its name alone ("sh") is not looked up in PATH (the
// caller resolves it): the error says so, where "No such file or
// directory" alone sent the user looking at a file that is there.
TEST(SpawnTest, AProgramGivenByNameSaysThatPathIsNotSearched) {
  std::vector<WorkerSpec> specs = Specs(1, "hello");
  specs[0].program = "sh";
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(specs, Quiet());
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(group.status().message(),
            "cannot start rank 0: exec 'sh': No such file or directory (a program's name is not looked up in "
            "PATH; give its path, or resolve it with ResolveProgram)");
  ExpectNoChildrenLeft();
}

// An atfork handler that exits the child of any fork() (as the transport's
// fork guard once did) while armed; workers must start anyway, because
// spawning runs no pthread_atfork handler. Armed only during that test: a
// handler cannot be taken back, and one always armed killed the forked
// helpers (RunInAProcess, the strangers, the tracer) of every later test,
// those of a second --gtest_repeat iteration too.
std::atomic<bool> g_fork_guard_armed{false};
void ForkGuardLikeTheTransports() {
  if (g_fork_guard_armed.load()) _exit(99);
}

// A group too large for the descriptors this process may open fails to
// start naming the rank, the limit and what to do ("pipe2: Too many open
// files" alone said none of it), and leaves nothing running.
TEST(SpawnTest, AGroupThatRunsOutOfDescriptorsSaysWhichLimit) {
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  // Room for a few workers' descriptors, not for 40: the limit is put at
  // the 24th free number, so that 24 numbers are free below it whatever
  // this process holds (sized from the highest open one instead, a shell
  // that passed on descriptor 251 left some 250 free below the limit, and
  // the group started).
  std::vector<int> free_numbers;
  for (int fd = 0; fd < 4096 && free_numbers.size() <= 24; ++fd) {
    if (fcntl(fd, F_GETFD) < 0) free_numbers.push_back(fd);
  }
  ASSERT_EQ(free_numbers.size(), 25u);
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(free_numbers[24]);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(40, "hello"), Quiet());
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), StatusCode::kResourceExhausted) << group.status();
  EXPECT_THAT(group.status().message(), HasSubstr("cannot start rank "));
  EXPECT_THAT(group.status().message(), HasSubstr("Too many open files"));
  EXPECT_THAT(group.status().message(),
              HasSubstr("this process may open " + std::to_string(low.rlim_cur) + " descriptors (ulimit -n"));
  EXPECT_THAT(group.status().message(), HasSubstr("raise the limit or start fewer workers"));
  ExpectNoChildrenLeft();
}

// However few descriptors are left, a start that runs out of them says so
// as RESOURCE_EXHAUSTED (the same start may succeed later: not bad input,
// not an internal error), naming the limit, also when it is the group's
// own setup (its stop event, the pipe to its watcher) that found none.
TEST(SpawnTest, AGroupWithNoDescriptorsLeftIsOutOfResources) {
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  std::vector<int> free_numbers;  // the lowest descriptor numbers not open here
  for (int fd = 0; fd < 4096 && free_numbers.size() < 12; ++fd) {
    if (fcntl(fd, F_GETFD) < 0) free_numbers.push_back(fd);
  }
  ASSERT_EQ(free_numbers.size(), 12u);
  int refused = 0;
  for (size_t room = 0; room < free_numbers.size(); ++room) {
    SCOPED_TRACE(std::to_string(room) + " descriptors left");
    // With the limit at the room-th free number, `room` numbers are free below it.
    rlimit low = saved;
    low.rlim_cur = static_cast<rlim_t>(free_numbers[room]);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
    StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "hello"), Quiet());
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
    if (group.ok()) {
      EXPECT_EQ((*group)->Wait(DeadlineIn(20s)).outcome, GroupOutcome::kSucceeded);
      continue;
    }
    ++refused;
    EXPECT_EQ(group.status().code(), StatusCode::kResourceExhausted) << group.status();
    EXPECT_THAT(group.status().message(), HasSubstr("Too many open files"));
    EXPECT_THAT(group.status().message(),
                HasSubstr("this process may open " + std::to_string(low.rlim_cur) + " descriptors (ulimit -n"));
    ExpectNoChildrenLeft();
  }
  EXPECT_GT(refused, 2);
}

TEST(SpawnTest, AtforkHandlersDoNotRunWhenSpawning) {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, &ForkGuardLikeTheTransports); });
  g_fork_guard_armed = true;
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(2, "hello"), Quiet());
  g_fork_guard_armed = false;
  ASSERT_TRUE(group.ok()) << group.status();
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason;
  EXPECT_THAT(result.output[1], HasSubstr("hello from rank 1"));
}

// This process's children named `name` (the comm field of /proc/<pid>/stat).
std::vector<pid_t> ChildrenNamed(const std::string& name) {
  std::vector<pid_t> found;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return found;
  while (const dirent* entry = readdir(proc)) {
    const pid_t pid = std::atoi(entry->d_name);
    if (pid <= 0) continue;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t open = line.find('('), close = line.rfind(')');
    if (open == std::string::npos || close == std::string::npos || close + 4 > line.size()) continue;
    std::istringstream rest(line.substr(close + 2));
    std::string state;
    pid_t parent = 0;
    rest >> state >> parent;
    if (line.substr(open + 1, close - open - 1) == name && parent == getpid()) found.push_back(pid);
  }
  closedir(proc);
  return found;
}

// Descriptors open in `pid`; -1 when they cannot be listed.
int OpenDescriptors(pid_t pid) {
  DIR* dir = opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (const dirent* entry = readdir(dir)) n += entry->d_name[0] != '.';
  closedir(dir);
  return n;
}

// A descriptor the host program opened without O_CLOEXEC reaches neither
// the workers nor the watcher, with close_range and with the fallbacks
// that kernels without it (before Linux 5.9, 5.11 for CLOSE_RANGE_CLOEXEC)
// take.
TEST(SpawnTest, LaunchersDescriptorsStayOutOfWorkersAndWatcher) {
  for (const bool fallback : {false, true}) {
    SCOPED_TRACE(fallback ? "fallback" : "close_range");
    ForceCloseRangeFallbackForTesting(fallback);
    const int plain = open("/dev/null", O_RDONLY);
    ASSERT_GE(plain, 0);
    // Above every other descriptor here, so that the fallbacks' bound must
    // reach it.
    constexpr int kLeaked = 300;
    ASSERT_EQ(dup2(plain, kLeaked), kLeaked);
    close(plain);
    StatusOr<std::unique_ptr<WorkerGroup>> group =
        WorkerGroup::Start(Specs(2, "fd_probe", {{"PROBE_FD", std::to_string(kLeaked)}}), Quiet());
    ASSERT_TRUE(group.ok()) << group.status();
    // The watcher names itself once it runs, which on a loaded machine may
    // come after Start returned (it was looked for at once, and not found
    // in one run of the whole test target).
    const auto give_up = Clock::now() + 5s;
    std::vector<pid_t> watchers = ChildrenNamed("ddp-watcher");
    while (watchers.empty() && Clock::now() < give_up) {
      std::this_thread::sleep_for(10ms);
      watchers = ChildrenNamed("ddp-watcher");
    }
    ASSERT_EQ(watchers.size(), 1u);
    // It closes the others right after it starts: only its pipe stays.
    while (OpenDescriptors(watchers[0]) > 1 && Clock::now() < give_up) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(OpenDescriptors(watchers[0]), 1);
    GroupResult result = (*group)->Wait(DeadlineIn(20s));
    close(kLeaked);
    ForceCloseRangeFallbackForTesting(false);
    EXPECT_EQ(result.outcome, GroupOutcome::kSucceeded) << result.reason << "\n" << result.output[0];
  }
}

// A watcher that someone killed (the OOM killer, a user's kill) leaves a
// pipe without a reader: the launcher's word to it at the group's end must
// not raise SIGPIPE, whose default action ended the launcher (and its
// workers with it). Runs in a child of its own (RunInAProcess, SIGPIPE at
// its default). 0: the group ended as it should; 2: no watcher found; 3:
// another outcome; 1013: SIGPIPE ended the launcher.
int AKilledWatcherLeavesTheLauncherRunning() {
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(1, "hello"), Quiet());
  if (!group.ok()) return 4;
  const auto give_up = Clock::now() + 5s;
  std::vector<pid_t> watchers = ChildrenNamed("ddp-watcher");
  while (watchers.size() != 1 && Clock::now() < give_up) {
    std::this_thread::sleep_for(10ms);
    watchers = ChildrenNamed("ddp-watcher");
  }
  if (watchers.size() != 1) return 2;
  kill(watchers[0], SIGKILL);
  if (!GoneWithin(watchers[0], 5s)) return 2;
  GroupResult result = (*group)->Wait(DeadlineIn(20s));
  group->reset();
  return result.outcome == GroupOutcome::kSucceeded ? 0 : 3;
}

TEST(SpawnTest, AKilledWatcherLeavesTheLauncherRunning) {
  EXPECT_EQ(RunInAProcess(&AKilledWatcherLeavesTheLauncherRunning), 0)
      << "1013: SIGPIPE ended the launcher; see the scenario for the other codes";
  ExpectNoChildrenLeft();
}


// A watcher killed before the first worker told it the group's id: the
// worker's write to the pipe without a reader raised SIGPIPE in it before
// its exec, which killed it as its mask came back (or, blocked, was left
// pending for the program). The worker starts as from a shell all the
// same, SIGPIPE unblocked even though the launcher's thread blocks it.
// Runs in a child of its own (RunInAProcess). 0: the worker saw SIGPIPE
// at its default, unblocked and not pending; 2: the watcher did not die;
// 3: Start failed; 10 + the worker's exit code (see sigpipe_state);
// 100 + the signal that killed the worker.
int AWatcherKilledBeforeTheFirstWorkerLeavesItsSigpipeAlone() {
  sigset_t pipe_only;
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_only, nullptr);
  bool watcher_died = false;
  SetBeforeFirstWorkerStepForTesting([&watcher_died](pid_t watcher) {
    kill(watcher, SIGKILL);
    watcher_died = GoneWithin(watcher, 5s);
  });
  StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(Specs(1, "sigpipe_state"), Quiet());
  SetBeforeFirstWorkerStepForTesting(nullptr);
  if (!watcher_died) return 2;
  if (!group.ok()) return 3;
  const GroupResult result = (*group)->Wait(DeadlineIn(20s));
  const WorkerExit& exit = result.workers.at(0);
  if (exit.signaled) return 100 + exit.code;
  return exit.code == 0 ? 0 : 10 + exit.code;
}

TEST(SpawnTest, AWatcherKilledBeforeTheFirstWorkerLeavesItsSigpipeAlone) {
  EXPECT_EQ(RunInAProcess(&AWatcherKilledBeforeTheFirstWorkerLeavesItsSigpipeAlone), 0)
      << "113: SIGPIPE killed the worker before its exec; 13: it was blocked; 14: pending; see the scenario";
  ExpectNoChildrenLeft();
}
// Every signal that can end or stop a worker is named in its report (a
// worker over its file size limit dies of SIGXFSZ, one under a profiler's
// timer of SIGPROF); a real-time one by its place after SIGRTMIN.
TEST(SpawnTest, SignalNamesCoverEverySignal) {
  EXPECT_EQ(SignalName(SIGKILL), "SIGKILL");
  EXPECT_EQ(SignalName(SIGXFSZ), "SIGXFSZ");
  EXPECT_EQ(SignalName(SIGPROF), "SIGPROF");
  EXPECT_EQ(SignalName(SIGVTALRM), "SIGVTALRM");
  EXPECT_EQ(SignalName(SIGPWR), "SIGPWR");
  EXPECT_EQ(SignalName(SIGSTKFLT), "SIGSTKFLT");
  EXPECT_EQ(SignalName(SIGIO), "SIGIO");
  EXPECT_EQ(SignalName(SIGCONT), "SIGCONT");
  EXPECT_EQ(SignalName(SIGRTMIN + 3), "SIGRTMIN+3");
  EXPECT_EQ(SignalName(0), "signal 0");
  EXPECT_EQ(SignalName(200), "signal 200");
  // (32 and 33, between SIGSYS and SIGRTMIN, are the C library's own.)
  for (int signo = 1; signo <= SIGRTMAX; signo = signo == SIGSYS ? SIGRTMIN : signo + 1) {
    EXPECT_THAT(SignalName(signo), Not(HasSubstr("signal "))) << signo;
  }
  WorkerExit e;
  e.rank = 2;
  e.pid = 42;
  e.exited = true;
  e.signaled = true;
  e.code = SIGXFSZ;
  EXPECT_EQ(e.Describe(), "rank 2 (pid 42) was killed by signal 25 (SIGXFSZ)");
}

TEST(SpawnTest, ResolveProgram) {
  StatusOr<std::string> sh = ResolveProgram("sh");
  ASSERT_TRUE(sh.ok()) << sh.status();
  EXPECT_THAT(*sh, HasSubstr("/sh"));
  EXPECT_EQ(ResolveProgram("no-such-program-xyz").status().message(),
            "program 'no-such-program-xyz' not found in PATH");
  EXPECT_EQ(ResolveProgram("/nonexistent/x").status().message(),
            "program '/nonexistent/x': No such file or directory");
  EXPECT_EQ(ResolveProgram("/").status().message(), "program '/' is not a file");
  const std::string plain = TempDir("resolve") + "/plain";
  std::ofstream(plain) << "data";
  chmod(plain.c_str(), 0644);
  EXPECT_EQ(ResolveProgram(plain).status().message(), "program '" + plain + "' is not executable");
}

// A name found in PATH only as a file that cannot be run (a script without
// its x bit, a folder) is named with where it is and why, not as missing;
// an executable one further down PATH is still found.
TEST(SpawnTest, ResolveProgramNamesAPathEntryThatCannotRun) {
  const std::string first = TempDir("resolve_first");
  const std::string second = TempDir("resolve_second");
  unlink((second + "/ddp_tool").c_str());  // left by an earlier run
  std::ofstream(first + "/ddp_tool") << "#!/bin/sh\n";
  chmod((first + "/ddp_tool").c_str(), 0644);
  ASSERT_TRUE(mkdir((first + "/ddp_folder").c_str(), 0755) == 0 || errno == EEXIST);
  const char* saved = std::getenv("PATH");
  const std::string before = saved != nullptr ? saved : "";
  setenv("PATH", (first + ":" + second).c_str(), 1);
  const std::string tool = ResolveProgram("ddp_tool").status().message();
  const std::string folder = ResolveProgram("ddp_folder").status().message();
  std::ofstream(second + "/ddp_tool") << "#!/bin/sh\n";
  chmod((second + "/ddp_tool").c_str(), 0755);
  StatusOr<std::string> found = ResolveProgram("ddp_tool");
  setenv("PATH", before.c_str(), 1);
  EXPECT_EQ(tool, "program 'ddp_tool' not found in PATH as an executable file: '" + first +
                      "/ddp_tool' is not executable");
  EXPECT_EQ(folder, "program 'ddp_folder' not found in PATH as an executable file: '" + first +
                        "/ddp_folder' is not a file");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, second + "/ddp_tool");
}

TEST(SpawnTest, RunTestWorkersHelper) {
  StatusOr<testing::TestRunResult> run =
      testing::RunTestWorkers("fail_rank1", {.world_size = 3, .timeout = 20s});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_FALSE(run->AllSucceeded());
  EXPECT_EQ(run->ExitCode(1), 3);
  EXPECT_EQ(run->ExitCode(0), 128 + SIGTERM);
  EXPECT_THAT(run->Summary(), HasSubstr("rank 1 (pid"));
  EXPECT_FALSE(run->group.deadline_passed) << run->Summary();

  // Survivors left running by a failure (stop_all_on_failure off) that
  // hang until the run's timeout: the failure stays the outcome, and the
  // result says that the deadline passed.
  run = testing::RunTestWorkers("fail_rank1",
                                {.world_size = 2, .timeout = 1000ms, .stop_all_on_failure = false});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->group.outcome, GroupOutcome::kWorkerFailed) << run->Summary();
  EXPECT_EQ(run->ExitCode(1), 3);
  EXPECT_EQ(run->ExitCode(0), 128 + SIGTERM);
  EXPECT_TRUE(run->group.deadline_passed) << run->Summary();

  // A worker that was never reaped has no exit code: not 0, which a test
  // would take for its success.
  testing::TestRunResult unreaped;
  WorkerExit stuck;
  stuck.rank = 0;
  stuck.pid = 4242;
  unreaped.group.workers.push_back(stuck);
  WorkerExit lost = stuck;
  lost.rank = 1;
  lost.status_lost = true;
  unreaped.group.workers.push_back(lost);
  EXPECT_EQ(unreaped.ExitCode(0), -1);
  EXPECT_EQ(unreaped.ExitCode(1), -1);

  run = testing::RunTestWorkers("hello", {.world_size = 2, .timeout = 20s});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->AllSucceeded()) << run->Summary();
  EXPECT_THAT(run->Output(1), HasSubstr("hello from rank 1"));
}

}  // namespace
}  // namespace ddp::transport::launch
