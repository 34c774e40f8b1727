#ifndef DDP_DDP_POWERSGD_HOOK_H_
#define DDP_DDP_POWERSGD_HOOK_H_

// PowerSGD (Vogels, Karimireddy and Jaggi, 2019): a communication hook that
// sends a low-rank approximation of each gradient instead of the gradient.
// A gradient with n rows and m = numel / n columns (a weight [out, in], a
// convolution [out, in, kh, kw] as [out, in*kh*kw]) is approximated as
// P Q^T with P [n, r] and Q [m, r], found by one step of power iteration
// per training step, so a rank sends (n + m) r numbers instead of n m:
//
//   M  = gradient + residual                 (error feedback, this rank)
//   P  = sum over ranks of M Q               (one all-reduce per bucket)
//   P  = P with orthonormal columns          (Gram-Schmidt)
//   Q  = sum over ranks of M^T P             (one all-reduce per bucket)
//   gradient = P Q^T;  residual = M - P Q^T / world
//
// Q is kept for the next step (warm start), which is what makes a single
// power-iteration step per training step enough. A column of Q that comes
// out zero (the gradient was zero, or of rank below r, this step) is drawn
// again, the same on every rank, so that a gradient that was zero once (an
// unused parameter) is compressed again when it is not. The residual carries what
// the approximation dropped into the next step, so that nothing is lost in
// the long run. 1-D tensors (biases, norms) and tensors whose compression
// saves less than min_compression_rate are reduced exactly, in the same
// all-reduce as the P's.
//
// An inf or NaN (an overflow under mixed precision) is not compressed: a
// bucket where some rank's gradient plus residual of a compressed tensor
// holds one (a flag summed in the P all-reduce says so), or where the summed
// P or Q does, is all-reduced uncompressed that iteration, so the value
// reaches .grad on every rank and a GradScaler skips the step. That bucket's
// residuals (sent in that all-reduce) become zero and its Q is drawn afresh,
// so from the next iteration it is compressed as by a new hook. Compressed,
// the NaN would have stayed in Q and the residuals and made every later
// gradient of the bucket NaN. Every rank decides from all-reduced values,
// so all take the same path.
//
// Usage, before the first backward:
//
//   ddp_model.RegisterCommHook(ddp::dist::hooks::PowerSgdHook(
//       {.matrix_approximation_rank = 2, .start_iteration = 100}));
//
// Compresses f32 and f64 buckets in host memory. Buckets of other dtypes
// and buckets on a CUDA device go through the default all-reduce
// unchanged (AllReduceHook). The hook keeps state per bucket (Q, the
// residuals) across iterations: one hook object per DistributedDataParallel.
// When the buckets are rebuilt (after the first iteration), each
// parameter's Q and residual follow it to its new place in its bucket, as
// long as every compressed parameter of the new bucket was compressed in
// the old one; otherwise the bucket starts over with a fresh Q and zero
// residuals, the same on every rank. Parameters are told apart by their
// tensor objects, so a GradBucket must pass the same parameter tensors at
// every call. The state of buckets that no longer exist is dropped.

#include <cstdint>
#include <vector>

#include "ddp/comm_hooks.h"
#include "nn/tensor/tensor.h"

namespace ddp::dist {

/// PowerSGD's settings, with PyTorch's meanings and defaults
/// (PowerSGDState; start_powerSGD_iter is start_iteration here).
struct PowerSgdOptions {
  /// Rank r of the approximation (>= 1); a tensor [n, m] uses min(r, n, m).
  int matrix_approximation_rank = 1;
  /// Iterations (calls of the hook on the last bucket) reduced with the
  /// default all-reduce before compression starts (>= 0). Compressing from
  /// the first step slows early training; PyTorch's default is 1000.
  int64_t start_iteration = 1000;
  /// A tensor [n, m] is compressed only when n m > this * (n + m) r
  /// (>= 0; 0 compresses every tensor of two or more dimensions).
  double min_compression_rate = 2.0;
  /// Add what the last approximation dropped to the next gradient.
  bool use_error_feedback = true;
  /// Start each iteration's power step from the last iteration's Q (else
  /// from a fresh random Q every iteration).
  bool warm_start = true;
  /// Added to each column's norm before dividing by it in Gram-Schmidt
  /// (>= 0); 0 leaves an all-zero column as zeros.
  double orthogonalization_epsilon = 0.0;
  /// Seed of the random initial Q. Q is derived from it, the bucket's
  /// index and the tensor's place in the bucket, so every rank builds the
  /// same Q without communication; must be equal on every rank.
  uint64_t seed = 0;
};

/// Throws std::invalid_argument naming the first option out of range.
void ValidatePowerSgdOptions(const PowerSgdOptions& options);

/// Elements one rank all-reduces per iteration once compression runs, for
/// gradients of `shapes`: exact tensors plus (n + m) r per compressed one.
/// Bucketing changes it only by one element per bucket that compresses a
/// tensor (the finiteness flag), not counted here.
int64_t PowerSgdElementsPerStep(const std::vector<nn::Shape>& shapes, const PowerSgdOptions& options);

namespace hooks {

/// The PowerSGD hook (see the header comment). Throws std::invalid_argument
/// for options out of range.
CommHook PowerSgdHook(PowerSgdOptions options = {});

}  // namespace hooks
}  // namespace ddp::dist

#endif  // DDP_DDP_POWERSGD_HOOK_H_
