// Batch norm. Shapes: x, y, dy, dx [N, C, S] contiguous (S = product of the
// trailing dimensions, 1 for BatchNorm1d); per-channel arrays [C] in f64.
// Reductions run one block per channel, summing in f64 as the CPU does
// (row by row without per-element division when a row fills a block);
// elementwise passes run one thread per element.
#include <cstdint>

#include "nn/cuda/device_util.cuh"
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

unsigned ChannelBlocks(int64_t c) { return static_cast<unsigned>(c < 65536 ? (c < 1 ? 1 : c) : 65536); }

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
                               const double* var, double* invstd, double* running_mean, double* running_var) {
  for (int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; ch < c;
       ch += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    if (training) {
      invstd[ch] = 1.0 / sqrt(var[ch] + eps);
      if (running_mean != nullptr && running_var != nullptr) {
        running_mean[ch] = (1 - momentum) * running_mean[ch] + momentum * mean[ch];
        running_var[ch] = (1 - momentum) * running_var[ch] + momentum * var[ch] * unbias;
      }
    } else {
      mean[ch] = running_mean[ch];
      invstd[ch] = 1.0 / sqrt(running_var[ch] + eps);
    }
  }
}

template <typename T>
__global__ void ElementwiseKernel(const T* x, T* y, int64_t n, int64_t c, int64_t s, const double* mean,
                                  const double* invstd, const double* weight, const double* bias) {
  using A = acc_t<T>;
  const int64_t total = n * c * s;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t ch = (idx / s) % c;
    const double w = weight != nullptr ? weight[ch] : 1.0, b = bias != nullptr ? bias[ch] : 0.0;
    // The scale and shift are formed in f64 and rounded once, as on the CPU.
    const A scale = static_cast<A>(w * invstd[ch]);
    const A shift = static_cast<A>(b - mean[ch] * w * invstd[ch]);
    y[idx] = Cast<T>(Cast<A>(x[idx]) * scale + shift);
  }
}

template <typename T>
__global__ void BackwardReduceKernel(const T* dy, const T* x, int64_t n, int64_t c, int64_t s, const double* mean,
                                     const double* invstd, double* sum_dy, double* sum_dy_xhat) {
  __shared__ double scratch[32];
  for (int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
    const double mu = mean[ch];
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
      sum_dy_xhat[ch] = b * invstd[ch];
    }
  }
}

template <typename T>
__global__ void BackwardElementwiseKernel(const T* dy, const T* x, T* dx, int64_t n, int64_t c, int64_t s,
                                          const double* mean, const double* invstd, const double* weight,
                                          const double* dy_term, const double* xhat_term, double scale) {
  using A = acc_t<T>;
  const int64_t total = n * c * s;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t ch = (idx / s) % c;
    const double w = weight != nullptr ? weight[ch] : 1.0;
    const A k = static_cast<A>(w * invstd[ch]);
    const A a = static_cast<A>(dy_term != nullptr ? dy_term[ch] * scale : 0.0);
    const A coef = static_cast<A>(xhat_term != nullptr ? xhat_term[ch] * scale * invstd[ch] : 0.0);
    const A mu = static_cast<A>(mean[ch]);
    dx[idx] = Cast<T>(k * (Cast<A>(dy[idx]) - a - (Cast<A>(x[idx]) - mu) * coef));
  }
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
                              const double* var, double* invstd, double* running_mean, double* running_var,
                              cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  FinalizeKernel<<<device::GridFor(c), 256, 0, stream>>>(c, training, momentum, eps, unbias, mean, var, invstd,
                                                         running_mean, running_var);
  return cudaGetLastError();
}

cudaError_t BatchNormElementwise(const void* x, void* y, int64_t n, int64_t c, int64_t s, const double* mean,
                                 const double* invstd, const double* weight, const double* bias, Dt dt,
                                 cudaStream_t stream) {
  const int64_t total = n * c * s;
  if (total <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    ElementwiseKernel<scalar_t><<<device::GridFor(total), 256, 0, stream>>>(
        static_cast<const scalar_t*>(x), static_cast<scalar_t*>(y), n, c, s, mean, invstd, weight, bias);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t BatchNormBackwardReduce(const void* dy, const void* x, int64_t n, int64_t c, int64_t s,
                                    const double* mean, const double* invstd, double* sum_dy, double* sum_dy_xhat,
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
                                         const double* mean, const double* invstd, const double* weight,
                                         const double* dy_term, const double* xhat_term, double scale, Dt dt,
                                         cudaStream_t stream) {
  const int64_t total = n * c * s;
  if (total <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    BackwardElementwiseKernel<scalar_t><<<device::GridFor(total), 256, 0, stream>>>(
        static_cast<const scalar_t*>(dy), static_cast<const scalar_t*>(x), static_cast<scalar_t*>(dx), n, c, s, mean,
        invstd, weight, dy_term, xhat_term, scale);
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace ddp::nn::cuda::launch
