#ifndef DDP_TRANSPORT_TYPES_H_
#define DDP_TRANSPORT_TYPES_H_

// Value types of the transport's public API. Enum values are stable: append
// only, never renumber (other teams persist and exchange them).

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace ddp::transport {

/// Element types. f16 and bf16 are reduced in f32 and rounded back.
enum class DataType : int {
  kF32 = 0,
  kF64 = 1,
  kF16 = 2,
  kBF16 = 3,
  kI32 = 4,
  kI64 = 5,
  kU8 = 6,
};

/// Bytes per element of `dtype`.
size_t DataTypeSize(DataType dtype);
/// "f32", "f64", "f16", "bf16", "i32", "i64", "u8".
const char* DataTypeName(DataType dtype);

/// Reductions. kAvg is a sum divided by the number of contributing ranks
/// (integers: truncated toward zero). Integers are summed in their own type
/// before the division, as NCCL does, so a sum that overflows it (u8: above
/// 255) wraps first: average small integers or widen them. f16 in host
/// memory is the exception: each rank's value is divided first, then the
/// ranks sum (NCCL's order for floats), since f16 sums pass its 65504
/// where the mean does not.
enum class ReduceOp : int {
  kSum = 0,
  kAvg = 1,
  kMax = 2,
  kMin = 3,
  kProd = 4,
};

/// "sum", "avg", "max", "min", "prod".
const char* ReduceOpName(ReduceOp op);

/// All-reduce algorithms (CommunicatorOptions::algorithm,
/// CallOptions::algorithm, DDP_ALLREDUCE_ALGO). kAuto picks per message
/// size and topology. A Reduce takes kAuto, kTree, kRing or kSharedMemory
/// (its meanings in parentheses).
enum class Algorithm : int {
  kAuto = 0,
  /// Reduce-scatter then all-gather around a ring, pipelined (Reduce: the
  /// reduce-scatter, then each block to the root).
  kRing = 1,
  /// Double binary tree, pipelined (Reduce: a binomial tree to the root).
  kTree = 2,
  kRhd = 3,           ///< Recursive halving-doubling (Rabenseifner).
  kHierarchical = 4,  ///< Inside each host, across hosts, inside each host.
  kSharedMemory = 5,  ///< One host: shared memory and CMA, no UCX (transport/shm).
};

/// "auto", "ring", "tree", "rhd", "hierarchical", "shm".
const char* AlgorithmName(Algorithm algo);

using Clock = std::chrono::steady_clock;
/// An absolute point in time after which a blocking call gives up.
using Deadline = Clock::time_point;

/// The deadline `timeout` from now (a non-positive timeout: now or
/// earlier, never "no deadline": every wait in the project has one). A
/// timeout too long for the clock's range (hundreds of years) gives
/// Deadline::max() instead of wrapping into the past; one reaching back
/// past the clock's epoch gives the epoch instead of wrapping into the
/// future (and stays far from Deadline::min(), whose distance to now
/// overflows).
inline Deadline DeadlineIn(std::chrono::milliseconds timeout) {
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  const Deadline now = Clock::now();
  if (timeout >= duration_cast<milliseconds>(Deadline::max() - now)) return Deadline::max();
  // Compared in milliseconds: the timeout in the clock's nanoseconds may
  // not fit.
  if (timeout <= -duration_cast<milliseconds>(now.time_since_epoch())) return Deadline{};
  return now + timeout;
}

/// `deadline` moved by `extra` (an allowance past a call's deadline, or a
/// queued call's timeout), held at Deadline::max() or Deadline::min()
/// instead of wrapping: a deadline from an unbounded timeout
/// (DeadlineIn(milliseconds::max())) plus any allowance stays unbounded,
/// not far in the past. An `extra` beyond the clock's range (about 292
/// years) counts as the longest the clock holds.
inline Deadline DeadlineAfter(Deadline deadline, std::chrono::milliseconds extra) {
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  constexpr milliseconds kMost = duration_cast<milliseconds>(Clock::duration::max());
  constexpr milliseconds kLeast = duration_cast<milliseconds>(Clock::duration::min());
  if (extra >= milliseconds::zero()) {
    const Clock::duration by = extra >= kMost ? Clock::duration::max() : Clock::duration(extra);
    return deadline > Deadline::max() - by ? Deadline::max() : deadline + by;
  }
  const Clock::duration by = extra <= kLeast ? Clock::duration::min() : Clock::duration(extra);
  return deadline < Deadline::min() - by ? Deadline::min() : deadline + by;
}

/// The stable API version of //transport (bumped on incompatible change).
inline constexpr int kTransportApiVersion = 1;

}  // namespace ddp::transport

#endif  // DDP_TRANSPORT_TYPES_H_
