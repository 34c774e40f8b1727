// A program for injector_test: two threads call Victim() every millisecond
// for --ms milliseconds, or until SIGUSR1 and then kMoreCalls more times
// each, then it prints "finished" and exits 0. --ms bounds a run that no
// one ends; the signal lets a test that has seen what it needs end the run
// at once instead of waiting out a length chosen for a loaded machine.
// NeverCalled() is, as its name says, never called.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace ddp::faults::target {

std::atomic<long> g_calls{0};
std::atomic<bool> g_finish{false};
static_assert(std::atomic<bool>::is_always_lock_free, "set from a signal handler");

// Calls each thread still makes after SIGUSR1: a program continued after a
// breakpoint must get through more calls of the function to finish.
constexpr int kMoreCalls = 20;

void OnFinish(int) { g_finish.store(true); }

[[gnu::noinline]] void Victim(int amount) {
  g_calls.fetch_add(amount);
  asm volatile("" ::: "memory");
}

[[gnu::noinline]] void NeverCalled() {
  g_calls.store(-1000000);
  asm volatile("" ::: "memory");
}

}  // namespace ddp::faults::target

int main(int argc, char** argv) {
  using namespace ddp::faults::target;
  long ms = 2000;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--ms=", 5) == 0) ms = std::atol(argv[i] + 5);
  }
  // Before the second thread starts: the test signals only once it sees two.
  struct sigaction action = {};
  action.sa_handler = OnFinish;
  sigemptyset(&action.sa_mask);
  sigaction(SIGUSR1, &action, nullptr);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  const auto loop = [&] {
    while (!g_finish.load() && std::chrono::steady_clock::now() < until) {
      Victim(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (int i = 0; g_finish.load() && i < kMoreCalls; ++i) {
      Victim(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  std::thread worker(loop);
  loop();
  worker.join();
  if (argc > 100) NeverCalled();  // keeps it linked, never runs
  std::printf("finished after %ld calls\n", g_calls.load());
  return 0;
}
