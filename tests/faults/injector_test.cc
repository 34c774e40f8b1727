// The fault injector against a small target program: it finds functions by
// name, and at the breakpoint it kills, stops (and the stopped program runs
// on correctly once continued) or makes the program exit 0; a function that
// is never reached times out and leaves the program unharmed.

#include "tests/faults/injector.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/launch/launch_test_util.h"

namespace ddp::faults {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;
namespace lt = transport::launch::testing;

// The target runs under a shell, as ranks run under their launcher: the
// injector must not be its parent. The shell exits with the target's status.
struct Target {
  std::unique_ptr<transport::launch::WorkerGroup> group;
  pid_t pid = -1;
};

pid_t FirstChild(pid_t parent) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in("/proc/" + std::to_string(parent) + "/task/" + std::to_string(parent) +
                     "/children");
    pid_t child = 0;
    if (in >> child && child > 0) return child;
    std::this_thread::sleep_for(1ms);
  }
  return -1;
}

// Whether `pid` runs the program whose path ends in `name`, in its main():
// its /proc/PID/exe names it (set early in exec, before the program is
// mapped) and it has started the second thread that main() starts first.
bool RunsMain(pid_t pid, const std::string& name) {
  const std::string proc = "/proc/" + std::to_string(pid);
  char buf[4096];
  const ssize_t n = readlink((proc + "/exe").c_str(), buf, sizeof(buf) - 1);
  if (n <= 0) return false;
  const std::string exe(buf, static_cast<size_t>(n));
  if (exe.size() < name.size() || exe.compare(exe.size() - name.size(), name.size(), name) != 0) return false;
  std::ifstream status(proc + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8) >= 2;
  }
  return false;
}

// Starts the target for `ms` milliseconds under a shell; returns once the
// shell's child runs it (until then it is the shell, or half exec'd). A
// test that needs the program to finish calls Finish() rather than wait
// out `ms`, which is long for the sake of a loaded machine.
Target Start(long ms) {
  Target t;
  auto group = lt::StartProgram({"/bin/sh", "-c", "\"$0\" \"$1\" & wait $!",
                                 lt::Runfile("tests/faults/injector_target"),
                                 "--ms=" + std::to_string(ms)});
  EXPECT_TRUE(group.ok()) << group.status();
  t.group = std::move(group).value();
  t.pid = FirstChild(t.group->pids().at(0));
  EXPECT_GT(t.pid, 0);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (t.pid > 0 && !RunsMain(t.pid, "/injector_target") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_TRUE(t.pid > 0 && RunsMain(t.pid, "/injector_target")) << "the shell's child never ran the target";
  return t;
}

// Tells the target to make its last few calls of Victim() and finish.
void Finish(pid_t pid) { kill(pid, SIGUSR1); }

char ProcessState(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
}

// The state of `pid` once it is 'T' (stopped), or whatever it is after 5 s.
char StateOnceStopped(pid_t pid) {
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  char state = ProcessState(pid);
  while (state != 'T' && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
    state = ProcessState(pid);
  }
  return state;
}

TEST(InjectorTest, FindsFunctionsByDemangledName) {
  // Long enough to outlive the look-ups on a loaded machine; killed after.
  Target t = Start(20000);
  auto f = FindFunction(t.pid, "ddp::faults::target::Victim(");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->name, "ddp::faults::target::Victim(int)");
  EXPECT_EQ(FindFunction(t.pid, "no::such::Function(").status().code(),
            transport::StatusCode::kNotFound);
  EXPECT_EQ(FindFunction(t.pid, "ddp::faults::target::").status().code(),
            transport::StatusCode::kInvalidArgument);
  kill(t.pid, SIGKILL);
  lt::WaitProgram(*t.group, 10s);
}

TEST(InjectorTest, KillAtAFunction) {
  Target t = Start(20000);
  auto injected = InjectAtFunction(t.pid, "ddp::faults::target::Victim(", FaultAction::kKill, 5s);
  ASSERT_TRUE(injected.ok()) << injected.status();
  const auto run = lt::WaitProgram(*t.group, 10s);
  EXPECT_EQ(run.exit_code, 128 + SIGKILL) << run.output;
  EXPECT_THAT(run.output, Not(HasSubstr("finished")));
}

TEST(InjectorTest, StopAtAFunctionThenContinueRunsCorrectly) {
  // Still calling Victim when the injector attaches on a loaded machine.
  Target t = Start(20000);
  auto injected = InjectAtFunction(t.pid, "ddp::faults::target::Victim(", FaultAction::kStop, 5s);
  ASSERT_TRUE(injected.ok()) << injected.status();
  EXPECT_EQ(StateOnceStopped(t.pid), 'T');
  kill(t.pid, SIGCONT);
  Finish(t.pid);
  const auto run = lt::WaitProgram(*t.group, 10s);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("finished"));
}

// The action at a later call: the 50 calls before it step over the
// breakpoint and run as they should (the program, continued, finishes).
TEST(InjectorTest, StopAtTheFiftiethCallThenContinueRunsCorrectly) {
  Target t = Start(20000);
  auto injected = InjectAtFunction(t.pid, "ddp::faults::target::Victim(", FaultAction::kStop, 5s,
                                   /*hit_number=*/50);
  ASSERT_TRUE(injected.ok()) << injected.status();
  EXPECT_EQ(injected->hits, 50);
  EXPECT_EQ(StateOnceStopped(t.pid), 'T');
  kill(t.pid, SIGCONT);
  Finish(t.pid);
  const auto run = lt::WaitProgram(*t.group, 10s);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("finished"));
}

TEST(InjectorTest, ExitZeroAtAFunction) {
  Target t = Start(20000);
  auto injected =
      InjectAtFunction(t.pid, "ddp::faults::target::Victim(", FaultAction::kExitZero, 5s);
  ASSERT_TRUE(injected.ok()) << injected.status();
  const auto run = lt::WaitProgram(*t.group, 10s);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, Not(HasSubstr("finished")));
}

TEST(InjectorTest, RefusesToTraceItsOwnChild) {
  auto group = lt::StartProgram({lt::Runfile("tests/faults/injector_target"), "--ms=20000"});
  ASSERT_TRUE(group.ok());
  const pid_t pid = (*group)->pids().at(0);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!RunsMain(pid, "/injector_target") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(RunsMain(pid, "/injector_target")) << "the target never reached its main()";
  auto injected = InjectAtFunction(pid, "ddp::faults::target::Victim(", FaultAction::kKill, 1s);
  EXPECT_EQ(injected.status().code(), transport::StatusCode::kInvalidArgument);
  EXPECT_THAT(injected.status().message(), HasSubstr("is a child of the injecting process"));
  Finish(pid);
  EXPECT_EQ(lt::WaitProgram(**group, 10s).exit_code, 0);
}

TEST(InjectorTest, UnreachedFunctionTimesOutAndLeavesTheProgramUnharmed) {
  // Runs well past the injector's 300 ms wait, so that the wait times out
  // rather than ending with the program.
  Target t = Start(20000);
  auto injected =
      InjectAtFunction(t.pid, "ddp::faults::target::NeverCalled(", FaultAction::kKill, 300ms);
  EXPECT_EQ(injected.status().code(), transport::StatusCode::kTimedOut) << injected.status();
  Finish(t.pid);
  const auto run = lt::WaitProgram(*t.group, 10s);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("finished"));
}

}  // namespace
}  // namespace ddp::faults
