#ifndef DDP_EXAMPLES_SCALING_MEDIAN_H_
#define DDP_EXAMPLES_SCALING_MEDIAN_H_

// The figures of one measured scaling_bench job, and the median of a rank
// count's repeated runs.

#include <cmath>
#include <string>
#include <vector>

namespace ddp::examples {

struct ScalingRun {
  int ranks = 0;
  double samples_per_s = NAN;  ///< Global samples per second.
  double step_ms = NAN;        ///< Wall time per step (global batch), ms.
  double comm_share = NAN;     ///< DDP communication / (forward + backward).
  double overlap = NAN;        ///< Share of communication hidden behind backward.
  bool on_caller = false;      ///< Rank 0 ran its collectives on the calling thread.
  bool ok = false;
};

/// The median run by samples/s of `runs` (the successful runs of one rank
/// count; not empty). An odd count gives the middle run as it was. An even
/// count gives the mean of the two middle rates, its step time from that
/// rate (the step time is inversely proportional to it, so the row stays
/// consistent), and the mean of their communication share and overlap;
/// on_caller when either ran its collectives on the calling thread.
ScalingRun MedianRun(std::vector<ScalingRun> runs);

/// `fraction` as a whole percentage ("47%"; "-" when not finite). A share
/// just below zero (timing noise in the overlap) reads "0%", not "-0%".
std::string Percent(double fraction);

}  // namespace ddp::examples

#endif  // DDP_EXAMPLES_SCALING_MEDIAN_H_
