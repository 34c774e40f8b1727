// CPU kernels behind the kernel table (nn/ops' own; tests call the raw
// GEMMs).
#pragma once

#include "nn/ops/dispatch.h"

namespace ddp::nn::ops::cpu {

/// The CPU kernel table.
KernelTable CpuKernelTable();

// elementwise.cc
void Unary(UnaryOp op, const Tensor& x, const Tensor& out);
void UnaryBackward(UnaryOp op, const Tensor& grad_out, const Tensor& saved, const Tensor& grad_in);
void Binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);
void Clamp(const Tensor& x, double lo, double hi, const Tensor& out);
void ClampBackward(const Tensor& grad_out, const Tensor& x, double lo, double hi, const Tensor& grad_in);
void Affine(const Tensor& x, double alpha, double beta, const Tensor& out);
void DivScalar(const Tensor& x, double s, const Tensor& out);
void AddScaled(const Tensor& out, const Tensor& x, double alpha);
void MaskedScale(const Tensor& x, const Tensor& mask, double scale, const Tensor& out);
void BernoulliMask(const Tensor& mask, double keep_prob, Generator& gen);

// reduce.cc
void SumTo(const Tensor& x, const Tensor& out, double scale);
void Argmax(const Tensor& x, int64_t dim, const Tensor& out);

// gemm.cc
void Gemm(const Tensor& a, const Tensor& b, const Tensor& c, double alpha, double beta);
/// Row-major f32 GEMM on raw pointers through the selected backend:
/// C[M,N] = alpha * op(A) op(B) + beta * C. OpenBLAS takes 32-bit sizes: a
/// size or leading dimension past 2^31 - 1 is an std::length_error naming
/// it (oneDNN takes 64-bit ones).
void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
/// The same in f64, always through OpenBLAS (with its 32-bit limit).
void Dgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
           int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);
/// Makes the calling thread use the configured thread count in BLAS/oneDNN.
void EnsureThreadSettings();

// conv.cc
void Conv2dForward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y,
                   const Conv2dParams& p);
void Conv2dBackward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                    const Tensor& dw, const Tensor& db, const Conv2dParams& p);

// pool.cc
void MaxPool2dForward(const Tensor& x, const Tensor& y, const Tensor& indices, const Pool2dParams& p);
void MaxPool2dBackward(const Tensor& dy, const Tensor& indices, const Tensor& dx, const Pool2dParams& p);
void AvgPool2dForward(const Tensor& x, const Tensor& y, const Pool2dParams& p);
void AvgPool2dBackward(const Tensor& dy, const Tensor& dx, const Pool2dParams& p);
void AdaptiveAvgPool2dForward(const Tensor& x, const Tensor& y);
void AdaptiveAvgPool2dBackward(const Tensor& dy, const Tensor& dx);

// batch_norm.cc
void BatchNormForward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                      const Tensor& running_mean, const Tensor& running_var, bool training,
                      double momentum, double eps, const Tensor& y, const Tensor& save_mean,
                      const Tensor& save_invstd);
void BatchNormBackward(const Tensor& x, const Tensor& dy, const Tensor& weight, const Tensor& save_mean,
                       const Tensor& save_invstd, bool training, double eps, const Tensor& dx,
                       const Tensor& dweight, const Tensor& dbias);

void BatchNormStats(const Tensor& x, const Tensor& sum, const Tensor& sum_sq);
void BatchNormElementwise(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& weight,
                          const Tensor& bias, const Tensor& y);
void BatchNormBackwardReduce(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                             const Tensor& sum_dy, const Tensor& sum_dy_xhat);
void BatchNormBackwardElementwise(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                                  const Tensor& weight, const Tensor& mean_dy, const Tensor& mean_dy_xhat,
                                  const Tensor& dx);

// softmax.cc
void LogSoftmaxForward(const Tensor& x, int64_t dim, const Tensor& y);
void LogSoftmaxBackward(const Tensor& dy, const Tensor& y, int64_t dim, const Tensor& dx);
void CrossEntropyForward(const Tensor& logits, const Tensor& target, double label_smoothing,
                         int64_t ignore_index, const Tensor& log_probs, const Tensor& loss);
void CrossEntropyBackward(const Tensor& log_probs, const Tensor& target, const Tensor& grad_loss,
                          double label_smoothing, int64_t ignore_index, const Tensor& dlogits);
void NllLossForward(const Tensor& log_probs, const Tensor& target, const Tensor& weight, int64_t ignore_index,
                    const Tensor& loss);
void NllLossBackward(const Tensor& target, const Tensor& weight, const Tensor& grad_loss, int64_t ignore_index,
                     const Tensor& dlog_probs);

// Layer norm and embedding lookup are CPU-only ops, outside the kernel
// table (whose entries every device's library fills): nn/ops calls them
// directly after refusing another device by name.

// layer_norm.cc
/// Normalizes each row of x seen as [rows, cols] (cols: the product of the
/// normalized dimensions) by its own mean and biased variance, then
/// y = xhat * weight[d] + bias[d] (weight/bias [cols] or undefined). Saves
/// the rows' mean and 1 / sqrt(var + eps) into save_mean/save_invstd
/// [rows] (f64). y contiguous with x's shape.
void LayerNormForward(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                      double eps, const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd);
/// Gradients of LayerNormForward; any of dx, dweight, dbias may be
/// undefined (not wanted); dweight and dbias are written, not accumulated.
void LayerNormBackward(const Tensor& x, const Tensor& dy, const Tensor& weight, int64_t rows, int64_t cols,
                       const Tensor& save_mean, const Tensor& save_invstd, const Tensor& dx, const Tensor& dweight,
                       const Tensor& dbias);

// embedding.cc
/// out[i, :] = weight[indices[i], :] for weight [V, D], indices (i64 or
/// i32) of any shape seen flat [I], out [I, D] contiguous. Throws
/// std::out_of_range naming the index, its position and the range [0, V)
/// when an index falls outside it (nothing is written then).
void EmbeddingForward(const Tensor& weight, const Tensor& indices, const Tensor& out);
/// grad_weight [V, D] (zeroed here) accumulates grad_out[i, :] into row
/// indices[i] (a repeated index sums its rows); row padding_idx gets
/// nothing (-1: no padding row).
void EmbeddingBackward(const Tensor& indices, const Tensor& grad_out, int64_t padding_idx,
                       const Tensor& grad_weight);

/// Strides of t when broadcast to `shape` (0 along broadcast dimensions);
/// std::invalid_argument when t's shape does not broadcast to `shape`.
Shape BroadcastStrides(const Tensor& t, const Shape& shape);
/// A contiguous tensor with t's data (t itself when already contiguous); never records autograd.
Tensor ContiguousData(const Tensor& t);
/// A contiguous f32 copy of t's data (t itself when already contiguous f32).
Tensor AsFloat32(const Tensor& t);

}  // namespace ddp::nn::ops::cpu
