#include "examples/setup_signals.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

namespace ddp::examples {
namespace {

constexpr int kSetupSignals[] = {SIGINT, SIGTERM, SIGHUP};

// The actions found by WatchSetupSignals, put back by EndSetupSignals.
struct sigaction g_before[std::size(kSetupSignals)];

// Each signal's line, written before the handler is in place: the handler
// may only write it (snprintf is not async-signal-safe).
char g_lines[std::size(kSetupSignals)][256];

// Set (to the signal number) by OnSetupSignal.
std::atomic<int> g_taken{0};

// WatchSetupSignals' `program`, for StopIfInterruptedInSetup's line.
const char* g_program = "";

// Between WatchSetupSignals and EndSetupSignals.
bool g_watching = false;

// RemoveIfInterruptedInSetup's folders, outermost first. Read on the main
// thread only, never in the handler.
std::vector<std::string> g_made_folders;

// Async-signal-safe. SA_RESETHAND puts the default action back for a second
// signal, which then ends the process at once.
void OnSetupSignal(int signo) {
  g_taken.store(signo);
  for (size_t i = 0; i < std::size(kSetupSignals); ++i) {
    if (kSetupSignals[i] == signo) (void)!write(STDERR_FILENO, g_lines[i], std::strlen(g_lines[i]));
  }
}

}  // namespace

void WatchSetupSignals(const char* program) {
  g_program = program;
  for (size_t i = 0; i < std::size(kSetupSignals); ++i) {
    const char* name = kSetupSignals[i] == SIGINT ? "Ctrl-C" : kSetupSignals[i] == SIGTERM ? "SIGTERM" : "SIGHUP";
    std::snprintf(g_lines[i], sizeof(g_lines[i]),
                  "%s: interrupted by %s during setup; stopping before any rank starts (%s again: at once)\n",
                  program, name, name);
  }
  struct sigaction action{};
  action.sa_handler = OnSetupSignal;
  action.sa_flags = SA_RESTART | SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < std::size(kSetupSignals); ++i) {
    sigaction(kSetupSignals[i], nullptr, &g_before[i]);
    if (g_before[i].sa_handler != SIG_IGN) sigaction(kSetupSignals[i], &action, nullptr);
  }
  g_watching = true;
}

void EndSetupSignals() {
  if (!g_watching) return;
  g_watching = false;
  for (size_t i = 0; i < std::size(kSetupSignals); ++i) sigaction(kSetupSignals[i], &g_before[i], nullptr);
}

bool InterruptedInSetup() { return g_taken.load() != 0; }

void StopIfInterruptedInSetup() {
  const int signo = g_taken.load();
  if (signo == 0) return;
  for (auto it = g_made_folders.rbegin(); it != g_made_folders.rend(); ++it) ::rmdir(it->c_str());
  std::signal(signo, SIG_DFL);
  std::raise(signo);
  std::_Exit(128 + signo);  // not reached
}

void StopIfInterruptedInSetup(const std::string& cut_short) {
  if (g_taken.load() == 0) return;
  std::fprintf(stderr, "%s: %s\n", g_program, cut_short.c_str());
  std::fflush(stderr);
  StopIfInterruptedInSetup();
}

void RemoveIfInterruptedInSetup(const std::vector<std::string>& folders) {
  g_made_folders.insert(g_made_folders.end(), folders.begin(), folders.end());
}

void EndSetup() {
  EndSetupSignals();
  StopIfInterruptedInSetup();
}

}  // namespace ddp::examples
