// The host-side interface of the .cu kernels. It speaks in raw pointers,
// dtype codes and index geometry, not Tensors, so the .cu files need no nn
// header and the C++ side (kernels.cc) does all checking and conversion.
// Every function queues work on `stream` and returns the launch's error
// code (cudaSuccess when queued); completion is asynchronous.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

// Functions shared by host and device code (the host tests check them).
#ifdef __CUDACC__
#define DDP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DDP_HOST_DEVICE inline
#endif

namespace ddp::nn::cuda::launch {

/// Most dimensions an indexed operand may have after merging contiguous runs.
inline constexpr int kMaxDims = 8;

/// Element types, numbered as ddp::nn::DType (whose values are stable).
enum class Dt : int8_t { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kI64 = 4, kU8 = 5, kI32 = 6 };

/// Index geometry shared by up to three operands of an elementwise kernel:
/// element i (row-major over `sizes`) of operand k is at
/// sum_d index_d(i) * strides[k][d] elements from its base pointer.
/// `contiguous` means every operand's offset is i (the fast path).
struct Indexing {
  int ndim = 0;
  bool contiguous = true;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[3][kMaxDims] = {};
};

/// Offsets (in elements) of element `linear` of the index space in the
/// first N operands.
template <int N>
DDP_HOST_DEVICE void OffsetsOf(const Indexing& ix, int64_t linear, int64_t (&off)[N]) {
  for (int k = 0; k < N; ++k) off[k] = 0;
  if (ix.contiguous) {
    for (int k = 0; k < N; ++k) off[k] = linear;
    return;
  }
  for (int d = ix.ndim - 1; d >= 0; --d) {
    const int64_t size = ix.sizes[d];
    const int64_t i = linear % size;
    linear /= size;
    for (int k = 0; k < N; ++k) off[k] += i * ix.strides[k][d];
  }
}

/// Unary and binary op codes: the values of ops::UnaryOp / ops::BinaryOp.
using OpCode = int;

// ---- elementwise (n = product of ix.sizes) ----
/// The setting behind cuda::VectorizedElementwise (kernels.h): Unary,
/// UnaryBackward and Binary take whole 16-byte packs where it is on and the
/// operands are contiguous and 16-byte aligned.
bool VectorizedElementwise();
void SetVectorizedElementwise(bool on);
/// How many launches took the packed path in this process.
uint64_t PackedElementwiseLaunches();

/// dst[i] = convert(src[i]): operand 0 is dst, 1 is src; any dtypes.
cudaError_t Copy(const Indexing& ix, int64_t n, void* dst, Dt dst_dt, const void* src, Dt src_dt, cudaStream_t stream);
/// out[i] = op(x[i]); operands 0 out, 1 x; floating dt.
cudaError_t Unary(OpCode op, const Indexing& ix, int64_t n, void* out, const void* x, Dt dt, cudaStream_t stream);
/// grad_in[i] = grad_out[i] * op'(saved[i]); operands 0 grad_in, 1 grad_out, 2 saved.
cudaError_t UnaryBackward(OpCode op, const Indexing& ix, int64_t n, void* grad_in, const void* grad_out,
                          const void* saved, Dt dt, cudaStream_t stream);
/// out[i] = a[i] op b[i]; operands 0 out, 1 a, 2 b (broadcast by stride 0); any dt.
cudaError_t Binary(OpCode op, const Indexing& ix, int64_t n, void* out, const void* a, const void* b, Dt dt,
                   cudaStream_t stream);
/// out[i] = min(max(x[i], lo), hi) in acc_t, NaN kept; operands 0 out, 1 x.
cudaError_t Clamp(const Indexing& ix, int64_t n, void* out, const void* x, double lo, double hi, Dt dt,
                  cudaStream_t stream);
/// grad_in[i] = lo <= x[i] <= hi ? grad_out[i] : 0; operands 0 grad_in, 1 grad_out, 2 x.
cudaError_t ClampBackward(const Indexing& ix, int64_t n, void* grad_in, const void* grad_out, const void* x,
                          double lo, double hi, Dt dt, cudaStream_t stream);
/// out[i] = alpha * x[i] + beta; operands 0 out, 1 x.
cudaError_t Affine(const Indexing& ix, int64_t n, void* out, const void* x, double alpha, double beta, Dt dt,
                   cudaStream_t stream);
/// out[i] = x[i] / s, in acc_t (a true division); operands 0 out, 1 x.
cudaError_t DivScalar(const Indexing& ix, int64_t n, void* out, const void* x, double s, Dt dt, cudaStream_t stream);
/// out[i] += alpha * x[i]; operands 0 out, 1 x.
cudaError_t AddScaled(const Indexing& ix, int64_t n, void* out, const void* x, double alpha, Dt dt,
                      cudaStream_t stream);
/// out[i] = x[i] * (mask[i] ? scale : 0); operands 0 out, 1 x, 2 mask (u8).
cudaError_t MaskedScale(const Indexing& ix, int64_t n, void* out, const void* x, const uint8_t* mask, double scale,
                        Dt dt, cudaStream_t stream);
/// dst[i] = the element at `value` (host memory, element_size bytes: 1, 2,
/// 4 or 8), stored bit for bit, whatever the dtype; operand 0 is dst.
cudaError_t Fill(const Indexing& ix, int64_t n, void* dst, const void* value, int element_size, cudaStream_t stream);
/// mask[i] = 1 with probability keep_prob: a counter-based hash of (seed, i),
/// so the result depends only on the seed, not on the launch geometry.
cudaError_t BernoulliMask(uint8_t* mask, int64_t n, double keep_prob, uint64_t seed, cudaStream_t stream);

// ---- reductions ----
/// Geometry of a reduction: `kept` indexes the outputs (operand 0: out
/// strides, operand 1: x strides), `reduced` the elements summed into each
/// output (operand 1: x strides).
struct ReduceIndexing {
  Indexing kept;
  Indexing reduced;
  int64_t num_kept = 1;
  int64_t num_reduced = 1;
};
/// out[j] = scale * sum over reduced r of x[j, r], accumulated and scaled in
/// f64 before rounding into out; x and out floating.
cudaError_t SumTo(const ReduceIndexing& rx, void* out, Dt out_dt, const void* x, Dt x_dt, double scale,
                  cudaStream_t stream);
/// out[j] (i64) = first index of the maximum of x[j, 0..d) where element k
/// is k * dim_stride from x[j]; `kept` as in ReduceIndexing.
cudaError_t Argmax(const Indexing& kept, int64_t num_kept, int64_t d, int64_t dim_stride, int64_t* out,
                   const void* x, Dt dt, cudaStream_t stream);

// ---- softmax, cross-entropy and NLL (contiguous operands) ----
/// x, y: [outer, d, inner]; y = log_softmax(x) along d.
cudaError_t LogSoftmaxForward(const void* x, void* y, int64_t outer, int64_t d, int64_t inner, Dt dt,
                              cudaStream_t stream);
/// dy, y, dx: [outer, d, inner]; dx = dy - exp(y) * sum_d(dy).
cudaError_t LogSoftmaxBackward(const void* dy, const void* y, void* dx, int64_t outer, int64_t d, int64_t inner,
                               Dt dt, cudaStream_t stream);
/// log_probs [n, c], target [n] (i64, already range-checked), loss [n]:
/// loss = -(1 - eps) * lp[t] - eps / c * sum_k lp[k], 0 where t == ignore.
cudaError_t CrossEntropyLoss(const void* log_probs, const int64_t* target, void* loss, int64_t n, int64_t c,
                             double eps, int64_t ignore_index, Dt dt, cudaStream_t stream);
/// dlogits [n, c] = g[i * g_stride] * (exp(lp) - eps / c - (1 - eps) * onehot(t)), 0 where t == ignore.
cudaError_t CrossEntropyBackward(const void* log_probs, const int64_t* target, const void* grad, int64_t g_stride,
                                 void* dlogits, int64_t n, int64_t c, double eps, int64_t ignore_index, Dt dt,
                                 cudaStream_t stream);
/// log_probs [n, c, s], target [n, s] (i64, already range-checked), weight
/// [c] in dt or null for all ones, loss [n, s]: loss = -w[t] * lp[i, t, p]
/// with t = target[i, p], 0 where t == ignore.
cudaError_t NllLoss(const void* log_probs, const int64_t* target, const void* weight, void* loss, int64_t n,
                    int64_t c, int64_t s, int64_t ignore_index, Dt dt, cudaStream_t stream);
/// dlog_probs [n, c, s]: -w[t] * g[(i * s + p) * g_stride] at [i, t, p] with t = target[i, p], 0 elsewhere
/// and where t == ignore; every element is written.
cudaError_t NllLossBackward(const int64_t* target, const void* weight, const void* grad, int64_t g_stride,
                            void* dlog_probs, int64_t n, int64_t c, int64_t s, int64_t ignore_index, Dt dt,
                            cudaStream_t stream);

// ---- pooling (contiguous NCHW operands; planes = N * C) ----
/// Window geometry of a pooling op, as ops::Pool2dParams plus the sizes.
struct PoolGeometry {
  int64_t planes = 0, h = 0, w = 0, oh = 0, ow = 0;
  int64_t kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1;
  bool count_include_pad = true;
};
/// y[p, i, j] = max over the window; ind (may be null) = argmax as ih * w + iw.
cudaError_t MaxPoolForward(const PoolGeometry& g, const void* x, void* y, int32_t* ind, Dt dt, cudaStream_t stream);
/// dx[p, ih, iw] = sum of dy over the windows whose recorded argmax is (ih, iw).
cudaError_t MaxPoolBackward(const PoolGeometry& g, const void* dy, const int32_t* ind, void* dx, Dt dt,
                            cudaStream_t stream);
/// y = mean over the window (divisor per count_include_pad).
cudaError_t AvgPoolForward(const PoolGeometry& g, const void* x, void* y, Dt dt, cudaStream_t stream);
/// dx[p, ih, iw] = sum over windows containing (ih, iw) of dy / divisor.
cudaError_t AvgPoolBackward(const PoolGeometry& g, const void* dy, void* dx, Dt dt, cudaStream_t stream);
/// Adaptive windows [floor(o * in / out), ceil((o + 1) * in / out)); kernel fields unused.
cudaError_t AdaptiveAvgPoolForward(const PoolGeometry& g, const void* x, void* y, Dt dt, cudaStream_t stream);
cudaError_t AdaptiveAvgPoolBackward(const PoolGeometry& g, const void* dy, void* dx, Dt dt, cudaStream_t stream);

// ---- batch norm: x, y, dy, dx [N, C, S] contiguous; m = N * S. Per-channel
// outputs are f64 [C]; per-channel inputs (and the running statistics, read
// and written) are ChannelArrays of any floating dtype, read into f64 (no
// data where noted means "absent") ----

/// A contiguous per-channel array [C] on the device in its own dtype.
struct ChannelArray {
  void* data = nullptr;
  Dt dt = Dt::kF64;
};
/// mean[c] and biased var[c] of x, two passes in f64 (0 when m = 0).
cudaError_t BatchNormMeanVar(const void* x, int64_t n, int64_t c, int64_t s, double* mean, double* var, Dt dt,
                             cudaStream_t stream);
/// sum[c] and sum_sq[c] of x in f64.
cudaError_t BatchNormSums(const void* x, int64_t n, int64_t c, int64_t s, double* sum, double* sum_sq, Dt dt,
                          cudaStream_t stream);
/// Per-channel finishing, one thread per channel. Training: invstd =
/// 1 / sqrt(var + eps), and when running_mean/var are given they move by
/// momentum towards mean and var * unbias. Eval: mean = running_mean,
/// invstd = 1 / sqrt(running_var + eps) (var unused).
cudaError_t BatchNormFinalize(int64_t c, bool training, double momentum, double eps, double unbias, double* mean,
                              const double* var, double* invstd, ChannelArray running_mean, ChannelArray running_var,
                              cudaStream_t stream);
/// y = x * scale + shift, scale = weight * invstd, shift = bias - mean * scale (weight, bias may be absent).
cudaError_t BatchNormElementwise(const void* x, void* y, int64_t n, int64_t c, int64_t s, ChannelArray mean,
                                 ChannelArray invstd, ChannelArray weight, ChannelArray bias, Dt dt,
                                 cudaStream_t stream);
/// sum_dy[c] = sum dy, sum_dy_xhat[c] = sum dy * (x - mean) * invstd, in f64.
cudaError_t BatchNormBackwardReduce(const void* dy, const void* x, int64_t n, int64_t c, int64_t s,
                                    ChannelArray mean, ChannelArray invstd, double* sum_dy, double* sum_dy_xhat,
                                    Dt dt, cudaStream_t stream);
/// dx = weight * invstd * (dy - a - (x - mean) * invstd * b) with a = dy_term[c] * scale,
/// b = xhat_term[c] * scale (both 0 when absent; weight 1 when absent). With x null
/// (eval mode), dx = weight * invstd * dy: mean, dy_term and xhat_term unused.
cudaError_t BatchNormBackwardElementwise(const void* dy, const void* x, void* dx, int64_t n, int64_t c, int64_t s,
                                         ChannelArray mean, ChannelArray invstd, ChannelArray weight,
                                         ChannelArray dy_term, ChannelArray xhat_term, double scale, Dt dt,
                                         cudaStream_t stream);

// The split reductions: each channel's m elements are cut over several blocks
// (BatchNormSplitParts of them) whose partial sums go to `work`, 2 * c *
// BatchNormSplitParts(n, c, s) doubles, and are added in a fixed order by a
// second kernel. Same results as the one-block-per-channel kernels above, up
// to f64 rounding; many more blocks when channels are few and long.
int64_t BatchNormSplitParts(int64_t n, int64_t c, int64_t s);
/// Training statistics and finishing in one call (BatchNormMeanVar, then
/// BatchNormFinalize with training = true). The variance is formed from sums
/// of x - shift, shift = the channel's first element (0 when that is not
/// finite), in one pass over x.
cudaError_t BatchNormTrainStatsSplit(const void* x, int64_t n, int64_t c, int64_t s, double* work, double momentum,
                                     double eps, double unbias, double* mean, double* var, double* invstd,
                                     ChannelArray running_mean, ChannelArray running_var, Dt dt,
                                     cudaStream_t stream);
/// As BatchNormSums.
cudaError_t BatchNormSumsSplit(const void* x, int64_t n, int64_t c, int64_t s, double* work, double* sum,
                               double* sum_sq, Dt dt, cudaStream_t stream);
/// As BatchNormBackwardReduce.
cudaError_t BatchNormBackwardReduceSplit(const void* dy, const void* x, int64_t n, int64_t c, int64_t s,
                                         double* work, ChannelArray mean, ChannelArray invstd, double* sum_dy,
                                         double* sum_dy_xhat, Dt dt, cudaStream_t stream);

// ---- optimizer updates (contiguous [n], one dtype: f32 or f64) ----
/// PyTorch's SGD, as nn/optim/sgd.cc: coefficients rounded to the element type first.
struct SgdCoefficients {
  double weight_decay, momentum, keep, neg_lr, grad_scale;  // keep = 1 - dampening
  bool first_step, nesterov;
};
cudaError_t SgdStep(void* p, const void* g, void* momentum_buffer, int64_t n, const SgdCoefficients& c, Dt dt,
                    cudaStream_t stream);
/// PyTorch's Adam/AdamW, as nn/optim/adam.cc (max_exp_avg_sq null without amsgrad).
struct AdamCoefficients {
  double beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay, neg_step_size, bc2_sqrt,
      grad_scale;
  bool coupled_weight_decay, decoupled_weight_decay;
};
cudaError_t AdamStep(void* p, const void* g, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq, int64_t n,
                     const AdamCoefficients& c, Dt dt, cudaStream_t stream);
/// t[i] *= inv_scale; *found_inf = 1.0f when some t[i] is inf or NaN (never reset here).
cudaError_t UnscaleAndCheck(void* t, int64_t n, double inv_scale, float* found_inf, Dt dt, cudaStream_t stream);
/// PyTorch's Adadelta, as nn/optim/adadelta.cc (one_minus_rho = 1 - rho, neg_lr = -lr).
struct AdadeltaCoefficients {
  double rho, one_minus_rho, eps, weight_decay, neg_lr, grad_scale;
};
cudaError_t AdadeltaStep(void* p, const void* g, void* square_avg, void* acc_delta, int64_t n,
                         const AdadeltaCoefficients& c, Dt dt, cudaStream_t stream);
/// PyTorch's RMSprop, as nn/optim/rmsprop.cc (one_minus_alpha = 1 - alpha,
/// neg_lr = -lr); momentum_buffer is read and written when momentum != 0,
/// grad_avg when centered (either may be null otherwise).
struct RmspropCoefficients {
  double alpha, one_minus_alpha, eps, weight_decay, momentum, neg_lr, grad_scale;
  bool centered;
};
cudaError_t RmspropStep(void* p, const void* g, void* square_avg, void* momentum_buffer, void* grad_avg, int64_t n,
                        const RmspropCoefficients& c, Dt dt, cudaStream_t stream);
/// PyTorch's Adagrad, as nn/optim/adagrad.cc (neg_clr = -(this step's rate)).
struct AdagradCoefficients {
  double eps, weight_decay, neg_clr, grad_scale;
};
cudaError_t AdagradStep(void* p, const void* g, void* sum, int64_t n, const AdagradCoefficients& c, Dt dt,
                        cudaStream_t stream);
/// *out = max(*out, |x[0]|, ..., |x[n-1]|), computed in f64; NaN if any x[i]
/// is NaN (or *out already is). x: [n], any floating dtype; *out >= 0.
cudaError_t MaxAbs(const void* x, int64_t n, double* out, Dt dt, cudaStream_t stream);

// ---- multi-tensor launches (multi_tensor.h): many tensors of one dtype per
// launch, each a contiguous [numel] array per operand; empty ones skipped ----
inline constexpr int kMultiTensorMaxOperands = 3;
/// One tensor of a multi-tensor launch: its operands, numel elements each
/// (the kernel says which operands it reads; the others are ignored).
struct MultiTensorEntry {
  void* operands[kMultiTensorMaxOperands] = {};
  int64_t numel = 0;
};
/// UnscaleAndCheck over tensors[0, count) (operand 0: t), any floating dt.
cudaError_t UnscaleAndCheckMulti(const MultiTensorEntry* tensors, int64_t count, double inv_scale, float* found_inf,
                                 Dt dt, cudaStream_t stream);
/// SgdStep over tensors[0, count) (operands p, g and, when c.momentum != 0,
/// the momentum buffer), f32 or f64; the same arithmetic as SgdStep, element for element.
cudaError_t SgdStepMulti(const MultiTensorEntry* tensors, int64_t count, const SgdCoefficients& c, Dt dt,
                         cudaStream_t stream);

}  // namespace ddp::nn::cuda::launch
