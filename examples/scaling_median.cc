#include "examples/scaling_median.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace ddp::examples {

ScalingRun MedianRun(std::vector<ScalingRun> runs) {
  if (runs.empty()) std::abort();  // the caller reports a count with no success itself
  std::sort(runs.begin(), runs.end(), [](const ScalingRun& a, const ScalingRun& b) {
    return a.samples_per_s < b.samples_per_s;
  });
  const size_t n = runs.size();
  if (n % 2 == 1) return runs[n / 2];
  // With two runs, runs[(n - 1) / 2] alone was the slower of them.
  const ScalingRun& lo = runs[n / 2 - 1];
  const ScalingRun& hi = runs[n / 2];
  ScalingRun m = lo;
  m.samples_per_s = (lo.samples_per_s + hi.samples_per_s) / 2;
  // step_ms * samples_per_s is the global batch (times 1000) in both runs.
  m.step_ms = lo.step_ms * lo.samples_per_s / m.samples_per_s;
  // NaN (one rank: no communication) stays NaN.
  m.comm_share = (lo.comm_share + hi.comm_share) / 2;
  m.overlap = (lo.overlap + hi.overlap) / 2;
  m.on_caller = lo.on_caller || hi.on_caller;
  return m;
}

std::string Percent(double fraction) {
  if (!std::isfinite(fraction)) return "-";
  char text[32];
  // Rounded first, then + 0.0, which turns -0 into 0.
  std::snprintf(text, sizeof(text), "%.0f%%", std::round(100 * fraction) + 0.0);
  return text;
}

}  // namespace ddp::examples
