// Batch norm. Shapes: x, y, dy, dx [N, C, S] contiguous (S = product of the
// trailing dimensions, 1 for BatchNorm1d); per-channel arrays [C], outputs
// in f64, inputs in any floating dtype read into f64 (ChannelArray).
// Reductions run one block per channel, summing in f64 as the CPU does
// (row by row without per-element division when a row fills a block), or
// split over several blocks per channel (the "split reductions" below);
// elementwise passes run one thread per element.
#include <cstdint>

#include "nn/cuda/device_util.cuh"
#include "nn/cuda/fast_divide.h"
#include "nn/cuda/launch.h"

namespace ddp::nn::cuda::launch {

using device::acc_t;
using device::Cast;

namespace {

// Calls f(index) for the elements of channel ch handled by this thread: rows
// of s contiguous elements when s is at least a block (no division per
// element), else the flattened n * s elements.
template <typename F>
__device__ __forceinline__ void ForChannel(int64_t n, int64_t c, int64_t s, int64_t ch, F f) {
  if (s >= blockDim.x) {
    for (int64_t b = 0; b < n; ++b) {
      const int64_t base = (b * c + ch) * s;
      for (int64_t i = threadIdx.x; i < s; i += blockDim.x) f(base + i);
    }
  } else {
    for (int64_t k = threadIdx.x; k < n * s; k += blockDim.x) f(((k / s) * c + ch) * s + k % s);
  }
}

constexpr int kReduceThreads = 256;

unsigned ChannelBlocks(int64_t c) { return static_cast<unsigned>(c < 65536 ? (c < 1 ? 1 : c) : 65536); }

// Element ch of a per-channel array, in f64 (`absent` when it has no data).
__device__ __forceinline__ double Load(const ChannelArray& a, int64_t ch, double absent = 0.0) {
  if (a.data == nullptr) return absent;
  switch (a.dt) {
    case Dt::kF32: return static_cast<const float*>(a.data)[ch];
    case Dt::kF16: return Cast<double>(static_cast<const __half*>(a.data)[ch]);
    case Dt::kBF16: return Cast<double>(static_cast<const __nv_bfloat16*>(a.data)[ch]);
    default: return static_cast<const double*>(a.data)[ch];
  }
}

// Writes element ch, rounded to the array's dtype as the CPU's conversions do.
__device__ __forceinline__ void Store(const ChannelArray& a, int64_t ch, double v) {
  switch (a.dt) {
    case Dt::kF32: static_cast<float*>(a.data)[ch] = static_cast<float>(v); break;
    case Dt::kF16: static_cast<__half*>(a.data)[ch] = Cast<__half>(v); break;
    case Dt::kBF16: static_cast<__nv_bfloat16*>(a.data)[ch] = Cast<__nv_bfloat16>(v); break;
    default: static_cast<double*>(a.data)[ch] = v; break;
  }
}

template <typename T>
__global__ void MeanVarKernel(const T* x, int64_t n, int64_t c, int64_t s, double* mean, double* var) {
  __shared__ double scratch[32];
  const int64_t m = n * s;
  for (int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
    double sum = 0;
    ForChannel(n, c, s, ch, [&](int64_t idx) { sum += static_cast<double>(Cast<acc_t<T>>(x[idx])); });
    sum = device::BlockSum(sum, scratch);
    const double mu = m > 0 ? sum / static_cast<double>(m) : 0.0;
    double q = 0;
    ForChannel(n, c, s, ch, [&](int64_t idx) {
      const double d = static_cast<double>(Cast<acc_t<T>>(x[idx])) - mu;
      q += d * d;
    });
    q = device::BlockSum(q, scratch);
    if (threadIdx.x == 0) {
      mean[ch] = mu;
      var[ch] = m > 0 ? q / static_cast<double>(m) : 0.0;
    }
  }
}

template <typename T>
__global__ void SumsKernel(const T* x, int64_t n, int64_t c, int64_t s, double* sum, double* sum_sq) {
  __shared__ double scratch[32];
  for (int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
    double a = 0, b = 0;
    ForChannel(n, c, s, ch, [&](int64_t idx) {
      const double v = static_cast<double>(Cast<acc_t<T>>(x[idx]));
      a += v;
      b += v * v;
    });
    a = device::BlockSum(a, scratch);
    b = device::BlockSum(b, scratch);
    if (threadIdx.x == 0) {
      sum[ch] = a;
      sum_sq[ch] = b;
    }
  }
}

__global__ void FinalizeKernel(int64_t c, bool training, double momentum, double eps, double unbias, double* mean,
                               const double* var, double* invstd, ChannelArray running_mean,
                               ChannelArray running_var) {
  for (int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; ch < c;
       ch += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    if (training) {
      invstd[ch] = 1.0 / sqrt(var[ch] + eps);
      if (running_mean.data != nullptr && running_var.data != nullptr) {
        Store(running_mean, ch, (1 - momentum) * Load(running_mean, ch) + momentum * mean[ch]);
        Store(running_var, ch, (1 - momentum) * Load(running_var, ch) + momentum * var[ch] * unbias);
      }
    } else {
      mean[ch] = Load(running_mean, ch);
      invstd[ch] = 1.0 / sqrt(Load(running_var, ch) + eps);
    }
  }
}

template <typename T, typename ChannelOf>
__global__ void ElementwiseKernel(const T* x, T* y, int64_t total, ChannelOf channel_of, ChannelArray mean,
                                  ChannelArray invstd, ChannelArray weight, ChannelArray bias) {
  using A = acc_t<T>;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t ch = channel_of(idx);
    const double w = Load(weight, ch, 1.0), is = Load(invstd, ch);
    // (x - mean) * scale + b with the mean as hi + lo, as on the CPU
    // (nn/ops/cpu/batch_norm.cc): a channel of tiny variance stays exact.
    const A scale = static_cast<A>(w * is);
    const double mu = Load(mean, ch);
    const A hi = static_cast<A>(mu), lo = isfinite(hi) ? static_cast<A>(mu - static_cast<double>(hi)) : A(0);
    y[idx] = Cast<T>(((Cast<A>(x[idx]) - hi) - lo) * scale + static_cast<A>(Load(bias, ch)));
  }
}

template <typename T>
__global__ void BackwardReduceKernel(const T* dy, const T* x, int64_t n, int64_t c, int64_t s, ChannelArray mean,
                                     ChannelArray invstd, double* sum_dy, double* sum_dy_xhat) {
  __shared__ double scratch[32];
  for (int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
    const double mu = Load(mean, ch);
    double a = 0, b = 0;
    ForChannel(n, c, s, ch, [&](int64_t idx) {
      const double g = static_cast<double>(Cast<acc_t<T>>(dy[idx]));
      a += g;
      b += g * (static_cast<double>(Cast<acc_t<T>>(x[idx])) - mu);
    });
    a = device::BlockSum(a, scratch);
    b = device::BlockSum(b, scratch);
    if (threadIdx.x == 0) {
      sum_dy[ch] = a;
      sum_dy_xhat[ch] = b * Load(invstd, ch);
    }
  }
}

template <typename T, typename ChannelOf>
__global__ void BackwardElementwiseKernel(const T* dy, const T* x, T* dx, int64_t total, ChannelOf channel_of,
                                          ChannelArray mean, ChannelArray invstd, ChannelArray weight,
                                          ChannelArray dy_term, ChannelArray xhat_term, double scale) {
  using A = acc_t<T>;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t ch = channel_of(idx);
    const double w = Load(weight, ch, 1.0), is = Load(invstd, ch);
    const A k = static_cast<A>(w * is);
    if (x == nullptr) {
      // Eval mode, as the CPU: x is not read, so an inf or NaN in it does
      // not turn dx into NaN through (x - mean) * 0.
      dx[idx] = Cast<T>(k * Cast<A>(dy[idx]));
      continue;
    }
    const A a = static_cast<A>(Load(dy_term, ch) * scale);
    const A coef = static_cast<A>(Load(xhat_term, ch) * scale * is);
    // x - mean with the mean as hi + lo, as the forward above and the CPU's
    // backward: the mean rounded to f32 alone put f32 dx 2e-3 off f64's at
    // a channel mean of 1e7 (nn/ops/cpu/batch_norm.cc, SplitMean).
    const double mu = Load(mean, ch);
    const A hi = static_cast<A>(mu), lo = isfinite(hi) ? static_cast<A>(mu - static_cast<double>(hi)) : A(0);
    dx[idx] = Cast<T>(k * (Cast<A>(dy[idx]) - a - ((Cast<A>(x[idx]) - hi) - lo) * coef));
  }
}

// Calls f(channel_of) with the fastest channel lookup valid for [n, c, s]:
// fixed-divisor arithmetic below 2^31 elements, hardware division above.
template <typename F>
cudaError_t WithChannelOf(int64_t n, int64_t c, int64_t s, F f) {
  if (n * c * s <= INT32_MAX) {
    return f(ChannelOf32{FastDivider(static_cast<uint32_t>(s)), FastDivider(static_cast<uint32_t>(c))});
  }
  return f(ChannelOf64{s, c});
}

// ---- split reductions: grid (parts, channels). The m = n * s elements of a
// channel are cut into `parts` contiguous ranges of `per_part` rows (when a
// row of s elements fills a block) or elements; each block sums its range and
// writes one partial per accumulator to work[ch * parts + part] and
// work[(c + ch) * parts + part]. A finishing kernel, one thread per channel,
// adds a channel's partials in order, so results are fixed for a shape. ----

// Calls f(index) for the elements of channel ch in this block's range.
template <typename F>
__device__ __forceinline__ void ForPart(int64_t n, int64_t c, int64_t s, int64_t ch, int64_t per_part, bool rows,
                                        F f) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * per_part;
  if (rows) {
    const int64_t end = begin + per_part < n ? begin + per_part : n;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t base = (b * c + ch) * s;
      for (int64_t i = threadIdx.x; i < s; i += blockDim.x) f(base + i);
    }
  } else {
    // Element k of the channel is (row k / s, column k % s); both advance by
    // fixed steps as k moves by blockDim.x (s < blockDim.x here), so only the
    // first needs a division.
    const int64_t m = n * s, end = begin + per_part < m ? begin + per_part : m;
    if (begin >= end) return;  // also keeps s = 0 out of the divisions
    const int64_t step_row = blockDim.x / s, step_col = blockDim.x % s;
    int64_t k = begin + threadIdx.x, row = k / s, col = k % s;
    for (; k < end; k += blockDim.x) {
      f((row * c + ch) * s + col);
      row += step_row;
      col += step_col;
      if (col >= s) {
        col -= s;
        ++row;
      }
    }
  }
}

// The value every block of a channel subtracts before summing (its first
// element), so that the sum of squares does not cancel: var is formed from
// sums of x - shift. 0 when that element is an infinity or NaN: a shift of
// +inf would make x - shift NaN at the element itself (inf - inf), and the
// mean NaN where the CPU's two passes give inf; with 0 the sums carry the
// inf, or a NaN when +inf and -inf (or a NaN) occur, as on the CPU.
template <typename T>
__device__ __forceinline__ double ChannelShift(const T* x, int64_t n, int64_t s, int64_t ch) {
  if (n <= 0 || s <= 0) return 0.0;
  const double first = static_cast<double>(Cast<acc_t<T>>(x[ch * s]));
  return isfinite(first) ? first : 0.0;
}

// Which sums a split pass accumulates for an element: kShifted (x - shift and
// its square), kPlain (x and x^2), kBackward (dy and dy * (x - mean)).
enum class Sums { kShifted, kPlain, kBackward };

template <Sums kWhat, typename T>
__global__ void PartialSumsKernel(const T* x, const T* dy, int64_t n, int64_t c, int64_t s, int64_t per_part,
                                  bool rows, ChannelArray mean, double* work) {
  __shared__ double scratch[32];
  const int64_t parts = gridDim.x;
  for (int64_t ch = blockIdx.y; ch < c; ch += gridDim.y) {
    const double shift = kWhat == Sums::kShifted ? ChannelShift(x, n, s, ch) : 0.0;
    const double mu = kWhat == Sums::kBackward ? Load(mean, ch) : 0.0;
    double a = 0, b = 0;
    ForPart(n, c, s, ch, per_part, rows, [&](int64_t idx) {
      const double v = static_cast<double>(Cast<acc_t<T>>(x[idx]));
      if constexpr (kWhat == Sums::kBackward) {
        const double g = static_cast<double>(Cast<acc_t<T>>(dy[idx]));
        a += g;
        b += g * (v - mu);
      } else {
        const double d = v - shift;
        a += d;
        b += d * d;
      }
    });
    a = device::BlockSum(a, scratch);
    b = device::BlockSum(b, scratch);
    if (threadIdx.x == 0) {
      work[ch * parts + blockIdx.x] = a;
      work[(c + ch) * parts + blockIdx.x] = b;
    }
  }
}

// Sums of a channel's partials, in order.
__device__ __forceinline__ void AddParts(const double* work, int64_t c, int64_t parts, int64_t ch, double* a,
                                         double* b) {
  double sa = 0, sb = 0;
  for (int64_t k = 0; k < parts; ++k) {
    sa += work[ch * parts + k];
    sb += work[(c + ch) * parts + k];
  }
  *a = sa;
  *b = sb;
}

// Training statistics from the shifted partials, then as FinalizeKernel.
template <typename T>
__global__ void SplitStatsFinalizeKernel(const T* x, int64_t n, int64_t c, int64_t s, int64_t parts,
                                         const double* work, double momentum, double eps, double unbias, double* mean,
                                         double* var, double* invstd, ChannelArray running_mean,
                                         ChannelArray running_var) {
  const double m = static_cast<double>(n * s);
  for (int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; ch < c;
       ch += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    double sum, sum_sq;
    AddParts(work, c, parts, ch, &sum, &sum_sq);
    const double mu = m > 0 ? ChannelShift(x, n, s, ch) + sum / m : 0.0;
    // Rounding can leave the shifted formula slightly negative; clamp
    // that, but let a NaN (an inf or NaN in x) through as the two-pass
    // kernels do: fmax would turn it into 0.
    double v = m > 0 ? (sum_sq - sum * sum / m) / m : 0.0;
    if (v < 0.0) v = 0.0;
    mean[ch] = mu;
    var[ch] = v;
    invstd[ch] = 1.0 / sqrt(v + eps);
    if (running_mean.data != nullptr && running_var.data != nullptr) {
      Store(running_mean, ch, (1 - momentum) * Load(running_mean, ch) + momentum * mu);
      Store(running_var, ch, (1 - momentum) * Load(running_var, ch) + momentum * v * unbias);
    }
  }
}

// out_a = sum of the first partials; out_b = sum of the second, times
// b_scale[ch] when given.
__global__ void SplitSumsFinalizeKernel(int64_t c, int64_t parts, const double* work, ChannelArray b_scale,
                                        double* out_a, double* out_b) {
  for (int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; ch < c;
       ch += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    double a, b;
    AddParts(work, c, parts, ch, &a, &b);
    out_a[ch] = a;
    out_b[ch] = b_scale.data != nullptr ? b * Load(b_scale, ch) : b;
  }
}

// The split plan of a shape: per_part rows (rows) or elements per block.
struct SplitPlan {
  int64_t parts, per_part;
  bool rows;
};

SplitPlan PlanSplit(int64_t n, int64_t c, int64_t s) {
  const int64_t parts = BatchNormSplitParts(n, c, s);
  const bool rows = s >= kReduceThreads;
  const int64_t units = rows ? n : n * s;
  const int64_t per_part = units > 0 ? (units + parts - 1) / parts : 1;
  return {parts, per_part, rows};
}

dim3 SplitGrid(const SplitPlan& p, int64_t c) {
  return dim3(static_cast<unsigned>(p.parts), static_cast<unsigned>(c < 65535 ? c : 65535));
}

template <Sums kWhat>
cudaError_t LaunchPartialSums(const void* x, const void* dy, int64_t n, int64_t c, int64_t s, const SplitPlan& p,
                              ChannelArray mean, double* work, Dt dt, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    PartialSumsKernel<kWhat, scalar_t><<<SplitGrid(p, c), kReduceThreads, 0, stream>>>(
        static_cast<const scalar_t*>(x), static_cast<const scalar_t*>(dy), n, c, s, p.per_part, p.rows, mean, work);
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace

cudaError_t BatchNormMeanVar(const void* x, int64_t n, int64_t c, int64_t s, double* mean, double* var, Dt dt,
                             cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    MeanVarKernel<scalar_t><<<ChannelBlocks(c), 256, 0, stream>>>(static_cast<const scalar_t*>(x), n, c, s, mean, var);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t BatchNormSums(const void* x, int64_t n, int64_t c, int64_t s, double* sum, double* sum_sq, Dt dt,
                          cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    SumsKernel<scalar_t><<<ChannelBlocks(c), 256, 0, stream>>>(static_cast<const scalar_t*>(x), n, c, s, sum, sum_sq);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t BatchNormFinalize(int64_t c, bool training, double momentum, double eps, double unbias, double* mean,
                              const double* var, double* invstd, ChannelArray running_mean,
                              ChannelArray running_var, cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  FinalizeKernel<<<device::GridFor(c), 256, 0, stream>>>(c, training, momentum, eps, unbias, mean, var, invstd,
                                                         running_mean, running_var);
  return cudaGetLastError();
}

cudaError_t BatchNormElementwise(const void* x, void* y, int64_t n, int64_t c, int64_t s, ChannelArray mean,
                                 ChannelArray invstd, ChannelArray weight, ChannelArray bias, Dt dt,
                                 cudaStream_t stream) {
  const int64_t total = n * c * s;
  if (total <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    err = WithChannelOf(n, c, s, [&](auto channel_of) {
      ElementwiseKernel<<<device::GridFor(total), 256, 0, stream>>>(
          static_cast<const scalar_t*>(x), static_cast<scalar_t*>(y), total, channel_of, mean, invstd, weight, bias);
      return cudaGetLastError();
    });
  });
  return err;
}

cudaError_t BatchNormBackwardReduce(const void* dy, const void* x, int64_t n, int64_t c, int64_t s,
                                    ChannelArray mean, ChannelArray invstd, double* sum_dy, double* sum_dy_xhat,
                                    Dt dt, cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    BackwardReduceKernel<scalar_t><<<ChannelBlocks(c), 256, 0, stream>>>(
        static_cast<const scalar_t*>(dy), static_cast<const scalar_t*>(x), n, c, s, mean, invstd, sum_dy,
        sum_dy_xhat);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t BatchNormBackwardElementwise(const void* dy, const void* x, void* dx, int64_t n, int64_t c, int64_t s,
                                         ChannelArray mean, ChannelArray invstd, ChannelArray weight,
                                         ChannelArray dy_term, ChannelArray xhat_term, double scale, Dt dt,
                                         cudaStream_t stream) {
  const int64_t total = n * c * s;
  if (total <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    err = WithChannelOf(n, c, s, [&](auto channel_of) {
      BackwardElementwiseKernel<<<device::GridFor(total), 256, 0, stream>>>(
          static_cast<const scalar_t*>(dy), static_cast<const scalar_t*>(x), static_cast<scalar_t*>(dx), total,
          channel_of, mean, invstd, weight, dy_term, xhat_term, scale);
      return cudaGetLastError();
    });
  });
  return err;
}

int64_t BatchNormSplitParts(int64_t n, int64_t c, int64_t s) {
  // Enough blocks to fill a large GPU (about 1024 in all), but at least 4096
  // elements per block, at most one row per block on the row path and at
  // most 1024 parts.
  constexpr int64_t kTargetBlocks = 1024, kMinPerBlock = 4096, kMaxParts = 1024;
  if (c <= 0 || n <= 0 || s <= 0) return 1;
  int64_t parts = (kTargetBlocks + c - 1) / c;
  const int64_t m = n * s;
  if (parts > m / kMinPerBlock) parts = m / kMinPerBlock;
  if (s >= kReduceThreads && parts > n) parts = n;
  if (parts > kMaxParts) parts = kMaxParts;
  return parts < 1 ? 1 : parts;
}

cudaError_t BatchNormTrainStatsSplit(const void* x, int64_t n, int64_t c, int64_t s, double* work, double momentum,
                                     double eps, double unbias, double* mean, double* var, double* invstd,
                                     ChannelArray running_mean, ChannelArray running_var, Dt dt,
                                     cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  const SplitPlan p = PlanSplit(n, c, s);
  cudaError_t err = LaunchPartialSums<Sums::kShifted>(x, nullptr, n, c, s, p, {}, work, dt, stream);
  if (err != cudaSuccess) return err;
  err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    SplitStatsFinalizeKernel<scalar_t><<<device::GridFor(c), 256, 0, stream>>>(
        static_cast<const scalar_t*>(x), n, c, s, p.parts, work, momentum, eps, unbias, mean, var, invstd,
        running_mean, running_var);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t BatchNormSumsSplit(const void* x, int64_t n, int64_t c, int64_t s, double* work, double* sum,
                               double* sum_sq, Dt dt, cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  const SplitPlan p = PlanSplit(n, c, s);
  const cudaError_t err = LaunchPartialSums<Sums::kPlain>(x, nullptr, n, c, s, p, {}, work, dt, stream);
  if (err != cudaSuccess) return err;
  SplitSumsFinalizeKernel<<<device::GridFor(c), 256, 0, stream>>>(c, p.parts, work, {}, sum, sum_sq);
  return cudaGetLastError();
}

cudaError_t BatchNormBackwardReduceSplit(const void* dy, const void* x, int64_t n, int64_t c, int64_t s,
                                         double* work, ChannelArray mean, ChannelArray invstd, double* sum_dy,
                                         double* sum_dy_xhat, Dt dt, cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  const SplitPlan p = PlanSplit(n, c, s);
  const cudaError_t err = LaunchPartialSums<Sums::kBackward>(x, dy, n, c, s, p, mean, work, dt, stream);
  if (err != cudaSuccess) return err;
  SplitSumsFinalizeKernel<<<device::GridFor(c), 256, 0, stream>>>(c, p.parts, work, invstd, sum_dy, sum_dy_xhat);
  return cudaGetLastError();
}

}  // namespace ddp::nn::cuda::launch
