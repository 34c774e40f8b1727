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
// Each all-reduce is a collective of its own, issued in order on the
// group's queue, with the group's timeout from when it starts (as in
// PyTorch, where they are separate collectives): a peer late to the P
// all-reduce by most of the timeout still leaves the Q all-reduce its own.
//
// Q is kept for the next step (warm start), which is what makes a single
// power-iteration step per training step enough. A column of Q that comes
// out zero (the gradient was zero, or of rank below r, this step) is drawn
// again, the same on every rank, so that a gradient that was zero once (an
// unused parameter) is compressed again when it is not. The residual carries what
// the approximation dropped into the next step, so that nothing is lost in
// the long run, with one exception: under find_unused_parameters, in an
// iteration where no rank used a parameter, M is its residual alone, and
// the new residual keeps only what the approximation of M missed, while
// the reducer leaves that parameter's .grad alone, so the part counted as
// delivered is dropped: the residual of a parameter no rank uses decays. 1-D tensors (biases, norms) and tensors whose compression
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
// Every rank must pass the same PowerSgdOptions. The hook's first call
// compares them across the ranks (one small all-reduce, before that call's
// own collective): when they differ, that call fails on every rank with
// INVALID_ARGUMENT naming each option that differs and two of its values,
// and the group is aborted, so every later collective fails with the same
// message. Different seeds, for one, would sum the products of unrelated
// Q's without any error.
//
// What each rank computes from the all-reduced P and Q (P made orthonormal,
// with its keep-or-zero test per column, and the gradient P Q^T) is done in
// plain loops of a fixed order, not by the BLAS, whose kernels and thread
// split may round differently on another CPU or under another
// OPENBLAS_NUM_THREADS: every rank gets the same bits, so the replicas do
// not drift apart. The cost is in P Q^T: for a [512, 784] f32 gradient, one
// thread on a shared 2-core x86 host, about 0.2 ms against the BLAS's 0.06
// at r = 1, 0.6 against 0.3 at r = 4, 3.4 against 0.7 at r = 16.
//
// Usage, before the first backward:
//
//   ddp_model.RegisterCommHook(ddp::dist::hooks::PowerSgdHook(
//       {.matrix_approximation_rank = 2, .start_iteration = 100}));
//
// Compresses f32 and f64 buckets in host memory. Buckets of other dtypes
// and buckets on a CUDA device, and every bucket before start_iteration,
// are averaged as DDP with no hook averages them, bit for bit on any world
// size (the hook takes local gradients for that: sum, then divide, as the
// default all-reduce; a hook given divided gradients and summing them
// rounds otherwise on 3 ranks); the first such bucket from start_iteration
// on prints a note on stderr naming its dtype and device (once per hook).
// The hook keeps state per bucket (Q, the
// residuals) across iterations: one hook object per DistributedDataParallel
// (a state refuses a second wrapper while the first's hook is alive).
// When the buckets are rebuilt (after the first iteration, so with a
// start_iteration of 0 or 1 while the hook already holds state), each
// parameter's Q and residual follow it to its new place, in whichever
// bucket it lands (one copy of the residuals, once). A new bucket keeps its
// parameters' Q's when every compressed parameter of it had one, and draws
// a fresh Q otherwise (the same on every rank); the residuals follow in
// either case. Parameters are told apart by their tensor objects, so a
// GradBucket must pass the same parameter tensors at every call. The state
// of a parameter that was freed (a state reused by a new wrapper of a new
// model) is dropped, whatever tensor gets its address, and a kept or
// loaded state whose sizes no longer fit its parameter (given data of
// another shape) is dropped too: that parameter starts as under a new
// hook (zero residual, its bucket draws a fresh Q).
//
// Checkpoints. PowerSgdState is the hook's state; a hook built from a
// shared PowerSgdState exports it with StateDict and takes it back with
// LoadStateDict, as PyTorch pickles its PowerSGDState:
//
//   auto state = std::make_shared<PowerSgdState>(options);
//   ddp_model.RegisterCommHook(hooks::PowerSgdHook(state));
//   ... save: state->StateDict(model->NamedParameters())
//   ... resume: state->LoadStateDict(saved, model->NamedParameters())
//
// The iteration counter and each compressed parameter's Q (keyed by the
// parameter's name, so they survive a restart in which the tensors are new
// objects) are the same on every rank: rank 0's copy in a shared checkpoint
// restores every rank exactly. The residuals are not: each rank's error
// feedback is its own. A shared checkpoint leaves them out, and a resumed
// run starts them at zero: the part of past gradients that the
// approximations had not yet delivered is dropped, once. Gathering them
// instead would store a copy of the compressed weights per rank in rank
// 0's file. StateDict(params, true) adds this rank's residuals for a
// per-rank file, as PyTorch's per-process pickle of its state holds them.
// The restored Q's apply to the buckets as they were saved: save the DDP
// wrapper's BucketOrder() with them and pass it back as
// DdpOptions::bucket_order on resume (the example trainer does). Without
// it, a bucket that the first iteration's rebuild lays out otherwise
// starts over with a fresh Q, as above, so the resumed run differs from
// an uninterrupted one.
//
// Under a GradScaler the residuals are kept in the scaled units of the
// step that left them: when the scale changes, the carried-over part of
// the gradient is off by the ratio for one step (PyTorch's hook has the
// same limit).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
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
  /// (>= 0, at most f32's largest value, since f32 buckets add it in f32);
  /// 0 leaves an all-zero column as zeros.
  double orthogonalization_epsilon = 0.0;
  /// Seed of the random initial Q. Q is derived from it, the bucket's
  /// index and the tensor's place in the bucket, so every rank builds the
  /// same Q without communication; must be equal on every rank (the
  /// hook's first call checks, with the other options).
  uint64_t seed = 0;
};

/// Throws std::invalid_argument naming the first option out of range.
void ValidatePowerSgdOptions(const PowerSgdOptions& options);

/// Elements one rank all-reduces per iteration once compression runs, for
/// gradients of `shapes` in f32 or f64 buckets in host memory: exact
/// tensors plus (n + m) r per compressed one. Buckets of other dtypes or on
/// a device are sent whole (all their elements), which this does not count.
/// Bucketing changes it only by one element per bucket that compresses a
/// tensor (the finiteness flag), not counted here.
int64_t PowerSgdElementsPerStep(const std::vector<nn::Shape>& shapes, const PowerSgdOptions& options);

class PowerSgdState;

namespace hooks {

/// The PowerSGD hook (see the header comment). Throws std::invalid_argument
/// for options out of range. It takes local gradients
/// (on_local_gradients() is true): a hook that calls it from its own body
/// must be made with CommHook::OnLocalGradients too. Called with a bucket
/// already divided (GradBucket::divided(), from a plain hook) it throws
/// std::logic_error naming itself rather than divide the gradients twice.
/// When the calling hook wrote the bucket's buffer in place before calling
/// it (GradBucket::buffer_written(): clipped it, or divided it, which this
/// hook then does again) it warns once per state on stderr, naming the
/// bucket, and goes on.
CommHook PowerSgdHook(PowerSgdOptions options = {});
/// The same hook keeping its state in `state`, which the caller keeps to save
/// and restore it. One DistributedDataParallel per state: a call from a second
/// wrapper (on any group) throws std::logic_error while the hook copy serving
/// the first (the one its wrapper keeps) is alive; once it is gone, the state
/// serves the new one. That call is a hook failing in backward: the second
/// wrapper's group is aborted with the message, as for any hook that throws
/// (when both wrappers share a group, the first one stops with it). Throws
/// std::invalid_argument for a null state.
CommHook PowerSgdHook(std::shared_ptr<PowerSgdState> state);

}  // namespace hooks

/// What the PowerSGD hook keeps across iterations: the iteration counter,
/// and per compressed parameter the warm-start Q and the error-feedback
/// residual. StateDict and LoadStateDict must not run while a backward (or
/// its bucket tasks) is in flight: call them between iterations.
class PowerSgdState {
 public:
  using NamedTensors = std::vector<std::pair<std::string, nn::Tensor>>;

  /// Throws std::invalid_argument for options out of range.
  explicit PowerSgdState(PowerSgdOptions options = {});
  ~PowerSgdState();
  PowerSgdState(const PowerSgdState&) = delete;
  PowerSgdState& operator=(const PowerSgdState&) = delete;

  const PowerSgdOptions& options() const;
  /// Hook calls on the last bucket so far (iterations; compression runs
  /// from iteration options().start_iteration on).
  int64_t iteration() const;
  /// Parameters whose Q or residual this state holds outside its buckets
  /// (loaded, or carried across a bucket rebuild, and not placed yet).
  /// Those of parameters freed since are dropped at the hook's next call.
  size_t held_parameter_states() const;

  /// "powersgd.iteration" (i64 scalar); "powersgd.q.<name>" (Q^T, [r, m],
  /// the parameter's dtype) for each compressed parameter whose bucket has
  /// a warm-start Q (none without warm_start); with `with_residuals`,
  /// "powersgd.residual.<name>" (this rank's residual, the parameter's
  /// shape) for each one that has error feedback. `params` names the
  /// parameters (model->NamedParameters()); throws std::invalid_argument
  /// when a bucket holds a parameter that is not among them. Q is the same
  /// on every rank; the residuals are this rank's (see the header comment).
  NamedTensors StateDict(const NamedTensors& params, bool with_residuals = false) const;
  /// Restores StateDict's keys from a list that may hold other components'
  /// keys; `params` are this run's parameters by name (new objects are
  /// fine). Residuals not in `state` start at zero; a bucket gets the saved
  /// Q only when every compressed parameter in it has one (otherwise it
  /// draws a fresh Q, as a new hook does). Throws std::invalid_argument,
  /// changing nothing, for a missing or malformed iteration, an unexpected
  /// "powersgd." key, a Q or residual of a parameter `params` lacks or that
  /// these options do not compress, one of another shape (another
  /// matrix_approximation_rank) or dtype, a Q under warm_start = false, a
  /// residual under use_error_feedback = false, or a value not finite.
  void LoadStateDict(const NamedTensors& state, const NamedTensors& params);
  /// The checks of LoadStateDict alone: throws as it would, changes nothing.
  void CheckStateDict(const NamedTensors& state, const NamedTensors& params) const;

  struct Impl;

 private:
  friend CommHook hooks::PowerSgdHook(std::shared_ptr<PowerSgdState> state);
  std::unique_ptr<Impl> impl_;
};
}  // namespace ddp::dist

#endif  // DDP_DDP_POWERSGD_HOOK_H_
