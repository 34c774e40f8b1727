#include "transport/store/backoff.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <random>

namespace ddp::transport::store {
namespace {

// A seed that differs between processes and threads started together:
// the system's entropy where it can be read (std::random_device throws
// where it cannot), else the clock; the pid either way.
uint64_t RetrySeed() {
  uint64_t seed = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  try {
    seed = (static_cast<uint64_t>(std::random_device{}()) << 16) ^ seed;
  } catch (const std::exception&) {
  }
  return seed ^ (static_cast<uint64_t>(getpid()) << 40);
}

}  // namespace

Clock::duration RetryPause(int retry, double unit, Clock::duration first, Clock::duration most,
                           Clock::duration left) {
  if (left <= Clock::duration::zero()) return Clock::duration::zero();
  Clock::duration ceiling = std::min(first, most);
  for (int i = 0; i < retry && ceiling < most; ++i) ceiling = std::min(ceiling * 2, most);
  unit = std::clamp(unit, 0.0, 1.0);
  const auto half = ceiling / 2;
  const auto pause = half + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double, Clock::period>(
                                    static_cast<double>((ceiling - half).count()) * unit));
  return std::min(pause, left);
}

double RetryDraw() {
  thread_local std::mt19937_64 engine{RetrySeed()};
  return std::uniform_real_distribution<double>(0.0, 1.0)(engine);
}

}  // namespace ddp::transport::store
