// A program for injector_test: two threads call Victim() every millisecond
// for --ms milliseconds, then it prints "finished" and exits 0. NeverCalled()
// is, as its name says, never called.

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace ddp::faults::target {

std::atomic<long> g_calls{0};

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
  std::atomic<bool> done{false};
  const auto loop = [&] {
    while (!done.load()) {
      Victim(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  std::thread worker(loop);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < until) {
    Victim(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  done = true;
  worker.join();
  if (argc > 100) NeverCalled();  // keeps it linked, never runs
  std::printf("finished after %ld calls\n", g_calls.load());
  return 0;
}
