// Differentiable operations on tensors. Each records a node when grad mode
// is on and an input requires grad; each checks its inputs' shapes first and
// reports a mismatch with both shapes. Binary ops broadcast (numpy rules)
// and promote dtypes as torch.result_type (a bf16 tensor plus an f32 tensor
// gives f32, plus a 0-d f32 tensor bf16: a 0-d operand decides only when it
// is floating and the other is an integer). Layers
// that own weights (Linear, Conv2d) cast their input to the weight's dtype,
// so f16/bf16 layers can sit next to f32 ones (under autocast, never between
// f64 and 16 bits: see autocast.h).
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nn/ops/dispatch.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::ops {

// --- elementwise ---
Tensor Add(const Tensor& a, const Tensor& b);
Tensor Sub(const Tensor& a, const Tensor& b);
Tensor Mul(const Tensor& a, const Tensor& b);
/// True division, as torch.div: two integer tensors give f32.
Tensor Div(const Tensor& a, const Tensor& b);
// Scalar ops: an integer or bool x gives f32, as in PyTorch for a float
// scalar (the scalar is a double here, so i64 + 2 gives f32 too, where
// PyTorch keeps i64 for an integer scalar).
/// x + s.
Tensor AddScalar(const Tensor& x, double s);
/// x * s.
Tensor MulScalar(const Tensor& x, double s);
/// x / s, a true division (not x * (1 / s)): f32 [7] / 3 is 2.3333333, and a
/// tiny s does not overflow a reciprocal. Computed in f32 for 16-bit x.
Tensor DivScalar(const Tensor& x, double s);
/// -x; an integer tensor keeps its dtype (u8 wraps, as torch.neg).
Tensor Neg(const Tensor& x);
/// max(x, 0); an integer tensor keeps its dtype (CPU only, as torch.relu).
Tensor Relu(const Tensor& x);
/// Relu(Add(a, b)) in one pass over memory, as a residual block ends; its
/// backward is ReLU's, from the output, shared by a and b (each summed to
/// its shape). Floating tensors.
Tensor AddRelu(const Tensor& a, const Tensor& b);
/// Relu that writes into x's memory when x is the only reference to it
/// (its storage is shared with no view and no saved tensor) and x is not a
/// leaf that requires grad; otherwise the same as Relu. Saves one
/// activation-sized buffer per ReLU in a sequential model.
Tensor ReluOwned(Tensor x);
/// GELU, exact (erf) or with the tanh approximation.
Tensor Gelu(const Tensor& x, bool tanh_approximation = false);
Tensor Sigmoid(const Tensor& x);
Tensor Tanh(const Tensor& x);
Tensor Exp(const Tensor& x);
Tensor Log(const Tensor& x);
/// log(1 + x) without rounding 1 + x first: accurate for tiny x (f32
/// log1p(1e-10) is 1e-10 where log(1 + 1e-10) is 0).
Tensor Log1p(const Tensor& x);
Tensor Sqrt(const Tensor& x);
Tensor Square(const Tensor& x);
/// |x|; an integer tensor keeps its dtype (CPU only; the most negative
/// value stays itself, as torch.abs).
Tensor Abs(const Tensor& x);
/// torch.clamp: min(max(x, min), max); each bound is optional, but one
/// must be given. NaN elements stay NaN; min > max gives max everywhere.
/// The bounds are rounded to x's dtype first (as PyTorch compares a 16-bit
/// tensor with a scalar in 16 bits). Gradient: passed where min <= x <= max
/// (the bounds themselves included, as PyTorch), 0 elsewhere and at NaN.
/// The bounds are floating scalars: an integer x gives f32, as torch.clamp
/// with float bounds; integral bounds (the overload below) keep its dtype.
/// Throws std::invalid_argument for a NaN bound (PyTorch would return NaN
/// everywhere) or no bound.
Tensor Clamp(const Tensor& x, std::optional<double> min, std::optional<double> max);

namespace detail {
/// A bound of the integral Clamp: an integer type (not bool) or std::nullopt.
template <typename B>
concept IntegralBound = (std::integral<B> && !std::same_as<B, bool>) || std::same_as<B, std::nullopt_t>;
Tensor ClampIntegral(const Tensor& x, std::optional<int64_t> min, std::optional<int64_t> max);
template <typename B>
std::optional<int64_t> IntegralBoundValue(B bound, const char* what) {
  if constexpr (std::same_as<B, std::nullopt_t>) {
    return std::nullopt;
  } else {
    if (!std::in_range<int64_t>(bound)) {
      throw std::invalid_argument(std::string("Clamp: ") + what + " " + std::to_string(bound) +
                                  " is outside the range of i64");
    }
    return static_cast<int64_t>(bound);
  }
}
}  // namespace detail

/// torch.clamp with integral bounds (std::nullopt for a missing one), as
/// `labels.clamp(0, C - 1)`: an integer x (i64, i32, u8; CPU only) keeps
/// its dtype, without a gradient, compared in i64 so that i64 bounds beyond
/// 2^53 hold exactly; a bound outside x's dtype range is refused, naming
/// it. A floating x takes the bounds as the double overload does.
template <detail::IntegralBound Lo, detail::IntegralBound Hi>
Tensor Clamp(const Tensor& x, Lo min, Hi max) {
  return detail::ClampIntegral(x, detail::IntegralBoundValue(min, "min"), detail::IntegralBoundValue(max, "max"));
}
/// Zeroes each element with probability p and scales the rest by 1/(1-p)
/// when training; the identity otherwise.
Tensor Dropout(const Tensor& x, double p, bool training, Generator& gen = DefaultGenerator());
/// Converts to dtype; the gradient is converted back.
Tensor Cast(const Tensor& x, DType dtype);

// --- shape (views share storage with the input) ---
Tensor View(const Tensor& x, const Shape& shape);
/// A view when the strides allow it, else a copy.
Tensor Reshape(const Tensor& x, const Shape& shape);
/// Merges dimensions start..end (inclusive) into one.
Tensor Flatten(const Tensor& x, int64_t start = 0, int64_t end = -1);
Tensor Transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor Permute(const Tensor& x, const Shape& dims);
Tensor Narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
/// x[..., start:end:step, ...] along dim, as Python slicing of a torch
/// tensor: negative start and end count from the end, both are clamped to
/// the dimension (an empty range gives size 0); step must be positive.
/// Gradient: g scattered back into zeros of x's shape.
Tensor Slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor Select(const Tensor& x, int64_t dim, int64_t index);
Tensor Unsqueeze(const Tensor& x, int64_t dim);
Tensor Squeeze(const Tensor& x, int64_t dim);
Tensor Expand(const Tensor& x, const Shape& shape);
/// x when contiguous, else a contiguous copy.
Tensor Contiguous(const Tensor& x);
/// A contiguous copy.
Tensor Clone(const Tensor& x);

// --- reductions ---
/// Sum of all elements (0-d). An integer tensor (i64, i32, u8) sums to i64
/// without a gradient, as torch.sum, on the CPU only (another device
/// throws, naming it).
Tensor Sum(const Tensor& x);
/// Sum over dims (negative allowed; an empty list is every dimension, as in
/// PyTorch); keepdim keeps them as size 1.
Tensor Sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim = false);
Tensor Mean(const Tensor& x);
/// Mean over dims, as Sum (an empty list is every dimension).
Tensor Mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim = false);
/// Index of the maximum along dim (i64, no gradient).
Tensor Argmax(const Tensor& x, int64_t dim);

// --- matrix products ---
/// torch.matmul: a [M,K] @ b [K,N]; [..., M, K] @ [K, N]; batched
/// [..., M, K] @ [..., K, N] with the leading dimensions broadcast; 1-D
/// operands (a vector is a row on the left, a column on the right).
Tensor Matmul(const Tensor& a, const Tensor& b);
/// y [..., out] = x [..., in] @ w[out, in]^T + bias[out] (bias may be undefined).
Tensor Linear(const Tensor& x, const Tensor& w, const Tensor& bias);

// --- convolution and pooling (NCHW) ---
/// y [N, O, OH, OW] from x [N, C, H, W], w [O, C/groups, KH, KW], bias [O] (may be undefined).
Tensor Conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p = {});
/// Options of a 1-D convolution (one value each, for the length).
struct Conv1dParams {
  int64_t stride = 1;
  int64_t pad = 0;
  int64_t dilation = 1;
  int64_t groups = 1;
};
/// y [N, O, OL] from x [N, C, L], w [O, C/groups, K], bias [O] (may be
/// undefined): Conv2d on a plane of height 1, so it runs wherever Conv2d
/// does; errors name conv1d and the shapes as given. An unbatched x [C, L]
/// gives y [O, OL], as PyTorch 1.13's F.conv1d.
Tensor Conv1d(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv1dParams& p = {});
Tensor MaxPool2d(const Tensor& x, const Pool2dParams& p);
Tensor AvgPool2d(const Tensor& x, const Pool2dParams& p);
/// Averages x [N, C, H, W] into [N, C, out_h, out_w] windows. An output size
/// of 0 gives an empty output and a zero gradient, as PyTorch 1.13. Refuses
/// (std::invalid_argument) a negative output size, and, naming the axis,
/// sizes whose window bounds leave int64: out_h * (H + 1) or
/// out_w * (W + 1) above 2^63 - 1.
Tensor AdaptiveAvgPool2d(const Tensor& x, int64_t out_h, int64_t out_w);
/// Output length of a convolution or pooling along one axis, by PyTorch's
/// rule; 0 when no window fits (the ops then throw). Throws
/// std::invalid_argument naming the parameter when kernel, stride or
/// dilation is below 1 or pad below 0.
int64_t ConvOutputSize(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation,
                       bool ceil_mode = false);

// --- normalization ---
/// Batch norm over x [N, C, *]. Training: batch statistics, and running_mean
/// / running_var (if defined) are updated in place with momentum. Eval: the
/// running statistics. weight and bias may be undefined (no affine); the
/// running statistics both or neither (one alone throws).
Tensor BatchNorm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                 const Tensor& bias, bool training, double momentum, double eps);

/// Layer norm, as torch.nn.functional.layer_norm: x [*, D1, ..., Dk] is
/// normalized over its last k dimensions, normalized_shape [D1, ..., Dk],
/// by each row's mean and biased variance, then scaled by weight and
/// shifted by bias (each normalized_shape, or undefined). Throws
/// std::invalid_argument naming both shapes when x's last dimensions are
/// not normalized_shape, or a parameter has another shape; eps must be
/// finite and > 0 (as batch norm's). Forward and backward run on the CPU;
/// another device is refused (std::invalid_argument) naming it.
Tensor LayerNorm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight, const Tensor& bias,
                 double eps = 1e-5);

// --- embedding ---
/// Rows of weight [V, D] picked by indices (i64 or i32, any shape S):
/// out [S..., D], as torch.nn.functional.embedding. Throws
/// std::out_of_range naming the index, its position and [0, V) when an
/// index is outside the table. padding_idx (in [-V, V), a negative one
/// counting from the end, or nullopt) names a row whose gradient stays
/// zero. weight's gradient is dense, a repeated index summing its rows. CPU
/// only: another device is refused (std::invalid_argument) naming it.
Tensor Embedding(const Tensor& weight, const Tensor& indices, std::optional<int64_t> padding_idx = std::nullopt);
/// The row padding_idx names in a table of num_embeddings rows, as the
/// Embedding op and module read it: padding_idx + num_embeddings for a
/// negative one. Throws std::invalid_argument "padding_idx must be in
/// [-V, V), got P" (the caller puts its name in front) outside that range.
int64_t EmbeddingPaddingRow(int64_t padding_idx, int64_t num_embeddings);

// --- batch-norm building blocks (no autograd) ---
// SyncBatchNorm computes statistics over the global batch: each rank makes
// a row [count, mean per channel, sum of squared deviations per channel]
// (on a device from BatchNormStats of x, then of x less its local mean),
// the rows are all-gathered to the host and merged there
// (ddp/sync_batch_norm.cc), and the elementwise parts run with the global
// mean and invstd; backward all-reduces sum_dy and sum_dy_xhat across
// ranks. Sums are f64 [C].
struct BatchNormSums {
  Tensor sum;     ///< sum of x (or of dy)
  Tensor sum_sq;  ///< sum of x^2 (or of dy * xhat)
};
/// Per-channel sum and sum of squares of x [N, C, *] (count = numel / C).
BatchNormSums BatchNormStats(const Tensor& x);
/// (x - mean) * invstd * weight + bias per channel (weight/bias may be undefined).
Tensor BatchNormElementwise(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& weight,
                            const Tensor& bias);
/// Per-channel sum(dy) and sum(dy * (x - mean) * invstd). dy must have x's
/// shape, dtype and device (both backward blocks throw otherwise).
BatchNormSums BatchNormBackwardReduce(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd);
/// dx = weight * invstd * (dy - mean_dy - (x - mean) * invstd * mean_dy_xhat).
Tensor BatchNormBackwardElementwise(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                                    const Tensor& weight, const Tensor& mean_dy, const Tensor& mean_dy_xhat);

// --- softmax ---
Tensor LogSoftmax(const Tensor& x, int64_t dim);
Tensor Softmax(const Tensor& x, int64_t dim);

}  // namespace ddp::nn::ops

namespace ddp::nn {
// Arithmetic operators (differentiable, broadcasting).
inline Tensor operator+(const Tensor& a, const Tensor& b) { return ops::Add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return ops::Sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return ops::Mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return ops::Div(a, b); }
inline Tensor operator+(const Tensor& a, double s) { return ops::AddScalar(a, s); }
inline Tensor operator-(const Tensor& a, double s) { return ops::AddScalar(a, -s); }
inline Tensor operator*(const Tensor& a, double s) { return ops::MulScalar(a, s); }
inline Tensor operator/(const Tensor& a, double s) { return ops::DivScalar(a, s); }
inline Tensor operator*(double s, const Tensor& a) { return ops::MulScalar(a, s); }
inline Tensor operator-(const Tensor& a) { return ops::Neg(a); }

namespace detail {
// s as a 0-d tensor of the integer dtype `dtype`, taken modulo its width
// (u8 300 is 44, u8 -1 is 255), as PyTorch casts a wrapped number; built
// from the integer itself, not a double, so an i64 beyond 2^53 stays exact.
inline Tensor IntegralScalarOf(int64_t s, DType dtype, Device device) {
  Tensor t;
  switch (dtype) {
    case DType::kUInt8: t = FromVectorOf<uint8_t>({static_cast<uint8_t>(s)}, {}); break;
    case DType::kInt32: t = FromVectorOf<int32_t>({static_cast<int32_t>(s)}, {}); break;
    default: t = FromVectorOf<int64_t>({s}, {}); break;
  }
  return t.To(device);
}

// An integer tensor with an integral scalar, as
// PyTorch's wrapped numbers: int64 + 2 stays int64 (the scalar operators
// above take a double and compute in floating point, f32 for an integer
// tensor). A floating tensor takes the scalar as the double overloads do.
inline Tensor WithIntegralScalar(const Tensor& a, int64_t s, Tensor (*op)(const Tensor&, const Tensor&),
                                 Tensor (*floating)(const Tensor&, double)) {
  if (!a.defined() || IsFloating(a.dtype())) return floating(a, static_cast<double>(s));
  return op(a, IntegralScalarOf(s, a.dtype(), a.device()));
}
}  // namespace detail

template <std::integral I>
Tensor operator+(const Tensor& a, I s) {
  return detail::WithIntegralScalar(a, static_cast<int64_t>(s), &ops::Add, &ops::AddScalar);
}
template <std::integral I>
Tensor operator-(const Tensor& a, I s) {
  return detail::WithIntegralScalar(a, static_cast<int64_t>(s), &ops::Sub,
                                    [](const Tensor& t, double v) { return ops::AddScalar(t, -v); });
}
template <std::integral I>
Tensor operator*(const Tensor& a, I s) {
  return detail::WithIntegralScalar(a, static_cast<int64_t>(s), &ops::Mul, &ops::MulScalar);
}
template <std::integral I>
Tensor operator*(I s, const Tensor& a) {
  return a * s;
}
}  // namespace ddp::nn
