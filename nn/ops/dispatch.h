// The kernel table: every raw (non-differentiable) kernel the differentiable
// ops in nn/ops and the autograd engine call, one table per device type.
// The CPU table is filled in by nn/ops/cpu; the CUDA library fills in its
// own with RegisterKernels(DeviceType::kCUDA, ...). An entry left empty is
// reported by name: "op `conv2d_forward` has no kernel for device cuda:0".
//
// Conventions for every kernel: output tensors are allocated by the caller
// (contiguous unless stated), inputs may have any strides, and all tensors
// of one call live on one device.
#pragma once

#include <cstdint>

#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::ops {

/// Elementwise functions of one tensor. Values are stable.
enum class UnaryOp : int8_t {
  kNeg = 0,
  kRelu = 1,
  kGelu = 2,      ///< x * Phi(x), exact (erf)
  kGeluTanh = 3,  ///< tanh approximation
  kSigmoid = 4,
  kTanh = 5,
  kExp = 6,
  kLog = 7,
  kSqrt = 8,
  kSquare = 9,
  kAbs = 10,
  kLog1p = 11,  ///< log(1 + x), accurate where 1 + x would round (tiny x)
};

/// Elementwise functions of two tensors. Values are stable.
enum class BinaryOp : int8_t {
  kAdd = 0,
  kSub = 1,
  kMul = 2,
  kDiv = 3,
  kAddRelu = 4,  ///< max(a + b, 0) in one pass (NaN kept, as kRelu keeps it)
};

/// Convolution geometry (NCHW input, OIHW weight).
struct Conv2dParams {
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dilation_h = 1, dilation_w = 1;
  int64_t groups = 1;
};

/// Pooling geometry.
struct Pool2dParams {
  int64_t kernel_h = 1, kernel_w = 1;
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dilation_h = 1, dilation_w = 1;  ///< max pooling only
  bool ceil_mode = false;
  bool count_include_pad = true;  ///< average pooling only
};

/// Raw kernels of one device type. Shapes use N batch, C channels, H/W
/// height/width, O output channels, M/K/N matrix dimensions.
struct KernelTable {
  // --- elementwise ---
  /// out = op(x); x has out's shape.
  void (*unary)(UnaryOp op, const Tensor& x, const Tensor& out) = nullptr;
  /// grad_in = grad_out * op'(.), where `saved` is x for relu/gelu and y = op(x)
  /// for sigmoid/tanh/exp/sqrt; x for log/log1p/square/abs/neg.
  void (*unary_backward)(UnaryOp op, const Tensor& grad_out, const Tensor& saved,
                         const Tensor& grad_in) = nullptr;
  /// out = op(a, b); a and b broadcast to out's shape; computed in out's dtype
  /// (kDiv: a floating one; integers are rejected rather than divided).
  void (*binary)(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) = nullptr;
  /// out = min(max(x, lo), hi) as torch.clamp: NaN stays NaN, and lo > hi
  /// gives hi everywhere; a missing bound is -inf or +inf. Floating dtypes;
  /// lo and hi should be representable in x's dtype (ops::Clamp rounds them
  /// as PyTorch does); x broadcast to out; out may alias x.
  void (*clamp)(const Tensor& x, double lo, double hi, const Tensor& out) = nullptr;
  /// grad_in = grad_out where lo <= x <= hi (bounds included, as PyTorch's
  /// clamp_backward), else 0 (NaN x too); grad_out and x broadcast to grad_in.
  void (*clamp_backward)(const Tensor& grad_out, const Tensor& x, double lo, double hi,
                         const Tensor& grad_in) = nullptr;
  /// out = alpha * x + beta (x broadcast to out; out may alias x). A pure
  /// scale passes beta = -0.0, the additive identity that keeps -0 (+0.0
  /// would turn alpha * -0 into +0).
  void (*affine)(const Tensor& x, double alpha, double beta, const Tensor& out) = nullptr;
  /// out = x / s, a true division in the math type (f32 for 16-bit types, as
  /// `affine`; never x * (1 / s), which is a last bit off and overflows for a
  /// tiny s); x broadcast to out; out may alias x.
  void (*div_scalar)(const Tensor& x, double s, const Tensor& out) = nullptr;
  /// out += alpha * x, in place (x broadcast to out; any strides on out).
  void (*add_scaled_)(const Tensor& out, const Tensor& x, double alpha) = nullptr;
  /// out = x where mask, else 0 ... scaled: out = x * mask * scale (mask u8, x's shape).
  void (*masked_scale)(const Tensor& x, const Tensor& mask, double scale, const Tensor& out) = nullptr;
  /// mask[i] = 1 with probability keep_prob else 0 (u8), from gen.
  void (*bernoulli_mask)(const Tensor& mask, double keep_prob, Generator& gen) = nullptr;

  // --- reductions ---
  /// out = scale * (sum of x over the dimensions where out has size 1); out has
  /// x's rank. The scaling happens in the wide accumulator before rounding
  /// into out's dtype, so a 16-bit mean stays finite where its sum would not.
  void (*sum_to)(const Tensor& x, const Tensor& out, double scale) = nullptr;
  /// out[..] = index of the maximum of x along dim (out i64, x's shape without dim).
  void (*argmax)(const Tensor& x, int64_t dim, const Tensor& out) = nullptr;

  // --- matrix products (f32 accumulation for 16-bit types) ---
  /// c[M,N] = alpha * a[M,K] @ b[K,N] + beta * c; a and b may be transposed views.
  void (*gemm)(const Tensor& a, const Tensor& b, const Tensor& c, double alpha, double beta) = nullptr;

  // --- convolution ---
  /// y[N,O,OH,OW] = conv(x[N,C,H,W], w[O,C/g,KH,KW]) + bias[O] (bias may be undefined).
  void (*conv2d_forward)(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y,
                         const Conv2dParams& p) = nullptr;
  /// Gradients of conv2d: any of dx, dw, db may be undefined (not wanted).
  /// dw and db are written (not accumulated).
  void (*conv2d_backward)(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                          const Tensor& dw, const Tensor& db, const Conv2dParams& p) = nullptr;

  // --- pooling ---
  /// y[N,C,OH,OW] = max over windows; indices (i32, y's shape; undefined when
  /// no gradient is wanted) = argmax within the input plane.
  void (*max_pool2d_forward)(const Tensor& x, const Tensor& y, const Tensor& indices,
                             const Pool2dParams& p) = nullptr;
  /// dx (zeroed here) receives dy at the recorded indices; index -1 (a
  /// window with no tap inside the input, whose output is -inf) sends nothing.
  void (*max_pool2d_backward)(const Tensor& dy, const Tensor& indices, const Tensor& dx,
                              const Pool2dParams& p) = nullptr;
  void (*avg_pool2d_forward)(const Tensor& x, const Tensor& y, const Pool2dParams& p) = nullptr;
  void (*avg_pool2d_backward)(const Tensor& dy, const Tensor& dx, const Pool2dParams& p) = nullptr;
  /// y[N,C,OH,OW] averages the adaptive windows of x[N,C,H,W].
  void (*adaptive_avg_pool2d_forward)(const Tensor& x, const Tensor& y) = nullptr;
  void (*adaptive_avg_pool2d_backward)(const Tensor& dy, const Tensor& dx) = nullptr;

  // --- normalization ---
  /// Batch norm over x[N,C,*] per channel. Training: batch statistics go to
  /// save_mean/save_invstd [C] (f32) and update running_mean/var (if defined)
  /// with `momentum` (unbiased variance). Eval: uses the running statistics
  /// (save_mean/save_invstd still receive what was used).
  void (*batch_norm_forward)(const Tensor& x, const Tensor& weight, const Tensor& bias,
                             const Tensor& running_mean, const Tensor& running_var, bool training,
                             double momentum, double eps, const Tensor& y, const Tensor& save_mean,
                             const Tensor& save_invstd) = nullptr;
  /// The dtype batch_norm_forward should get save_mean/save_invstd in for x
  /// (the kernels take any floating dtype; the one they compute in saves a
  /// conversion each way). Null: f64, as the CPU kernels compute.
  DType (*batch_norm_saved_dtype)(const Tensor& x, bool training) = nullptr;
  /// Gradients of batch norm; training selects whether mean/invstd depended on x.
  /// eps is the forward's (save_invstd already holds it; cuDNN asks for the
  /// same value in both directions). Any of dx, dweight, dbias may be undefined.
  void (*batch_norm_backward)(const Tensor& x, const Tensor& dy, const Tensor& weight,
                              const Tensor& save_mean, const Tensor& save_invstd, bool training, double eps,
                              const Tensor& dx, const Tensor& dweight, const Tensor& dbias) = nullptr;

  // --- batch-norm building blocks (SyncBatchNorm composes these across ranks) ---
  /// Per-channel sum and sum of squares of x[N,C,*] (f64 outputs [C]).
  void (*batch_norm_stats)(const Tensor& x, const Tensor& sum, const Tensor& sum_sq) = nullptr;
  /// y = (x - mean[c]) * invstd[c] * weight[c] + bias[c] (weight/bias may be undefined).
  void (*batch_norm_elementwise)(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& weight,
                                 const Tensor& bias, const Tensor& y) = nullptr;
  /// Per-channel sum(dy) and sum(dy * (x - mean) * invstd) (f64 outputs [C]).
  void (*batch_norm_backward_reduce)(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                                     const Tensor& sum_dy, const Tensor& sum_dy_xhat) = nullptr;
  /// dx = weight * invstd * (dy - mean_dy - xhat * mean_dy_xhat), where
  /// mean_dy / mean_dy_xhat are the (global) sums above divided by the (global) count.
  void (*batch_norm_backward_elementwise)(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                          const Tensor& invstd, const Tensor& weight, const Tensor& mean_dy,
                                          const Tensor& mean_dy_xhat, const Tensor& dx) = nullptr;

  // --- softmax and losses ---
  /// y = log_softmax(x) along dim.
  void (*log_softmax_forward)(const Tensor& x, int64_t dim, const Tensor& y) = nullptr;
  /// dx = dy - exp(y) * sum(dy) along dim.
  void (*log_softmax_backward)(const Tensor& dy, const Tensor& y, int64_t dim, const Tensor& dx) = nullptr;
  /// Per-sample cross-entropy of logits[N,C] against class indices target[N]
  /// (i64) with label smoothing; log_probs[N,C] (f32 or logits' dtype) is kept
  /// for backward; loss[N] (f32) is 0 where target == ignore_index. Throws
  /// naming the label and the class count when a target is out of range.
  void (*cross_entropy_forward)(const Tensor& logits, const Tensor& target, double label_smoothing,
                                int64_t ignore_index, const Tensor& log_probs, const Tensor& loss) = nullptr;
  /// dlogits[N,C] = grad_loss[n] * (softmax - smoothed one-hot).
  void (*cross_entropy_backward)(const Tensor& log_probs, const Tensor& target, const Tensor& grad_loss,
                                 double label_smoothing, int64_t ignore_index,
                                 const Tensor& dlogits) = nullptr;
  /// Negative log-likelihood per element, for log_probs[N,C,S] (S: the
  /// product of any trailing dims, 1 for [N,C]) and target[N,S] (i64):
  /// loss[N,S] = -weight[t] * log_probs[n,t,s] with t = target[n,s], in
  /// log_probs' dtype; weight [C] in that dtype, or undefined for all ones;
  /// 0 where t == ignore_index. Throws naming the target, its position and
  /// the class count when a target is out of range.
  void (*nll_loss_forward)(const Tensor& log_probs, const Tensor& target, const Tensor& weight,
                           int64_t ignore_index, const Tensor& loss) = nullptr;
  /// dlog_probs[N,C,S] = -weight[t] * grad_loss[n,s] at c == t, 0 elsewhere
  /// and on ignored elements; a one-element grad_loss applies to every one.
  void (*nll_loss_backward)(const Tensor& target, const Tensor& weight, const Tensor& grad_loss,
                            int64_t ignore_index, const Tensor& dlog_probs) = nullptr;
};

/// Installs the table of a device type (the CPU's is installed at startup).
void RegisterKernels(DeviceType type, const KernelTable& table);
/// The table of a device type (all entries empty when nothing was registered).
const KernelTable& KernelsFor(DeviceType type);

namespace detail {
[[noreturn]] void ThrowNoKernel(const char* op, Device device);

/// g summed over the dimensions that broadcasting added or expanded, so
/// that it has `shape` (no autograd; used inside backward).
Tensor SumToShape(const Tensor& g, const Shape& shape);
}  // namespace detail

}  // namespace ddp::nn::ops

// The kernel `field` for `device`, or an error naming the op and the device.
#define DDP_KERNEL(device, field)                                                       \
  ([&]() {                                                                              \
    const ::ddp::nn::Device ddp_kernel_device_ = (device);                              \
    auto fn = ::ddp::nn::ops::KernelsFor(ddp_kernel_device_.type).field;                \
    if (fn == nullptr) ::ddp::nn::ops::detail::ThrowNoKernel(#field, ddp_kernel_device_); \
    return fn;                                                                          \
  }())
