// Reductions, log-softmax, cross-entropy and negative log-likelihood.
//
// sum_to:      x indexed as [kept j, reduced r] -> out[j] = scale * sum_r x[j, r] (f64 accumulator)
// argmax:      x[j, 0..d) with element stride dim_stride -> out[j] (i64)
// log_softmax: x, y [outer, d, inner] contiguous; one block per (outer, inner) row
// cross-entropy: log_probs [n, c], target [n] (i64), loss [n], dlogits [n, c]
// nll:         log_probs, dlog_probs [n, c, s], target, loss [n, s] (i64 / log_probs' dtype), weight [c];
//              s: the positions per sample, 1 for [n, c]
#include <cstdint>

#include "nn/cuda/device_util.cuh"
#include "nn/cuda/launch.h"

namespace ddp::nn::cuda::launch {

using device::acc_t;
using device::Cast;

namespace {

__device__ __forceinline__ float Exp(float x) { return expf(x); }
__device__ __forceinline__ double Exp(double x) { return exp(x); }
__device__ __forceinline__ float Log(float x) { return logf(x); }
__device__ __forceinline__ double Log(double x) { return log(x); }

// Offset of reduced element r of x (operand 1 of `red`).
__device__ __forceinline__ int64_t ReducedOffset(const Indexing& red, int64_t r) {
  int64_t off[2];
  device::Offsets<2>(red, r, off);
  return off[1];
}

// Few elements per output: one thread per output, summing serially.
template <typename O, typename X>
__global__ void SumToThreadKernel(ReduceIndexing rx, O* out, const X* x, double scale) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < rx.num_kept; j += step) {
    int64_t off[2];
    device::Offsets<2>(rx.kept, j, off);
    double s = 0;
    for (int64_t r = 0; r < rx.num_reduced; ++r) {
      s += static_cast<double>(Cast<acc_t<X>>(x[off[1] + ReducedOffset(rx.reduced, r)]));
    }
    out[off[0]] = Cast<O>(s * scale);
  }
}

// Many elements per output: one block per output, threads striding over r.
template <typename O, typename X>
__global__ void SumToBlockKernel(ReduceIndexing rx, O* out, const X* x, double scale) {
  __shared__ double scratch[32];
  for (int64_t j = blockIdx.x; j < rx.num_kept; j += gridDim.x) {
    int64_t off[2];
    device::Offsets<2>(rx.kept, j, off);
    double s = 0;
    for (int64_t r = threadIdx.x; r < rx.num_reduced; r += blockDim.x) {
      s += static_cast<double>(Cast<acc_t<X>>(x[off[1] + ReducedOffset(rx.reduced, r)]));
    }
    s = device::BlockSum(s, scratch);
    if (threadIdx.x == 0) out[off[0]] = Cast<O>(s * scale);
  }
}

template <typename T>
__global__ void ArgmaxKernel(Indexing kept, int64_t num_kept, int64_t d, int64_t dim_stride, int64_t* out,
                             const T* x) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < num_kept; j += step) {
    int64_t off[2];
    device::Offsets<2>(kept, j, off);
    const T* row = x + off[1];
    // Serial scan: the first maximum wins and the first NaN beats everything,
    // as on the CPU and in PyTorch (v != v is false for integers).
    acc_t<T> best = Cast<acc_t<T>>(row[0]);
    int64_t arg = 0;
    for (int64_t k = 1; k < d && best == best; ++k) {
      const acc_t<T> v = Cast<acc_t<T>>(row[k * dim_stride]);
      if (v > best || v != v) {
        best = v;
        arg = k;
      }
    }
    out[off[0]] = arg;
  }
}

template <typename T>
__global__ void LogSoftmaxForwardKernel(const T* x, T* y, int64_t rows, int64_t d, int64_t inner) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = (row / inner) * d * inner + row % inner;
    A mx = -INFINITY;
    for (int64_t k = threadIdx.x; k < d; k += blockDim.x) mx = fmax(mx, Cast<A>(x[base + k * inner]));
    mx = device::BlockMax(mx, scratch);
    A sum = 0;
    for (int64_t k = threadIdx.x; k < d; k += blockDim.x) sum += Exp(Cast<A>(x[base + k * inner]) - mx);
    sum = device::BlockSum(sum, scratch);
    // (x - max) - log(sum), as the CPU kernel and PyTorch (max + log(sum)
    // as one number is rounded at max's magnitude).
    const A log_sum = Log(sum);
    for (int64_t k = threadIdx.x; k < d; k += blockDim.x) {
      y[base + k * inner] = Cast<T>((Cast<A>(x[base + k * inner]) - mx) - log_sum);
    }
  }
}

template <typename T>
__global__ void LogSoftmaxBackwardKernel(const T* dy, const T* y, T* dx, int64_t rows, int64_t d, int64_t inner) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = (row / inner) * d * inner + row % inner;
    A sum = 0;
    for (int64_t k = threadIdx.x; k < d; k += blockDim.x) sum += Cast<A>(dy[base + k * inner]);
    sum = device::BlockSum(sum, scratch);
    for (int64_t k = threadIdx.x; k < d; k += blockDim.x) {
      const int64_t i = base + k * inner;
      dx[i] = Cast<T>(Cast<A>(dy[i]) - Exp(Cast<A>(y[i])) * sum);
    }
  }
}

template <typename T>
__global__ void CrossEntropyLossKernel(const T* lp, const int64_t* target, T* loss, int64_t n, int64_t c, double eps,
                                       int64_t ignore_index) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const A e = static_cast<A>(eps);
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t t = target[i];
    // Uniform per block: every thread of the block sees the same t.
    if (t == ignore_index) {
      if (threadIdx.x == 0) loss[i] = Cast<T>(A(0));
      continue;
    }
    const T* row = lp + i * c;
    A sum = 0;
    if (e != A(0)) {
      for (int64_t k = threadIdx.x; k < c; k += blockDim.x) sum += Cast<A>(row[k]);
      sum = device::BlockSum(sum, scratch);
    }
    if (threadIdx.x == 0) {
      A v = -(A(1) - e) * Cast<A>(row[t]);
      if (e != A(0)) v -= e / static_cast<A>(c) * sum;
      loss[i] = Cast<T>(v);
    }
  }
}

template <typename T>
__global__ void CrossEntropyBackwardKernel(const T* lp, const int64_t* target, const T* grad, int64_t g_stride,
                                           T* dlogits, int64_t n, int64_t c, double eps, int64_t ignore_index) {
  using A = acc_t<T>;
  const A e = static_cast<A>(eps);
  const A off = e / static_cast<A>(c);
  const int64_t total = n * c;
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const int64_t i = idx / c, k = idx % c;
    const int64_t t = target[i];
    if (t == ignore_index) {
      dlogits[idx] = Cast<T>(A(0));
      continue;
    }
    const A g = Cast<A>(grad[i * g_stride]);
    A v = g * (Exp(Cast<A>(lp[idx])) - off);
    if (k == t) v -= g * (A(1) - e);
    dlogits[idx] = Cast<T>(v);
  }
}

// One thread per element (sample, position): a gather of one log-probability.
template <typename T>
__global__ void NllLossKernel(const T* lp, const int64_t* target, const T* weight, T* loss, int64_t n, int64_t c,
                              int64_t s, int64_t ignore_index) {
  using A = acc_t<T>;
  const int64_t total = n * s;
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t t = target[i];
    if (t == ignore_index) {
      loss[i] = Cast<T>(A(0));
      continue;
    }
    const A w = weight != nullptr ? Cast<A>(weight[t]) : A(1);
    loss[i] = Cast<T>(-w * Cast<A>(lp[((i / s) * c + t) * s + i % s]));
  }
}

// One thread per element of dlog_probs, so every element is written once
// (no zero fill, no scatter): the target's class gets -w[t] * g, others 0.
template <typename T>
__global__ void NllLossBackwardKernel(const int64_t* target, const T* weight, const T* grad, int64_t g_stride,
                                      T* dlp, int64_t n, int64_t c, int64_t s, int64_t ignore_index) {
  using A = acc_t<T>;
  const int64_t total = n * c * s;
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const int64_t p = idx % s, k = (idx / s) % c;
    const int64_t i = (idx / (c * s)) * s + p;  // the element's (sample, position)
    const int64_t t = target[i];
    if (t == ignore_index || k != t) {
      dlp[idx] = Cast<T>(A(0));
      continue;
    }
    const A w = weight != nullptr ? Cast<A>(weight[t]) : A(1);
    dlp[idx] = Cast<T>(-w * Cast<A>(grad[i * g_stride]));
  }
}

unsigned BlocksFor(int64_t rows) { return static_cast<unsigned>(rows < 65536 ? (rows < 1 ? 1 : rows) : 65536); }

}  // namespace

cudaError_t SumTo(const ReduceIndexing& rx, void* out, Dt out_dt, const void* x, Dt x_dt, double scale,
                  cudaStream_t stream) {
  if (rx.num_kept <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(out_dt, {
    using O = scalar_t;
    DDP_CUDA_DISPATCH_FLOATING(x_dt, {
      using X = scalar_t;
      if (rx.num_reduced < 64) {
        SumToThreadKernel<O, X><<<device::GridFor(rx.num_kept), 256, 0, stream>>>(
            rx, static_cast<O*>(out), static_cast<const X*>(x), scale);
      } else {
        SumToBlockKernel<O, X><<<BlocksFor(rx.num_kept), 256, 0, stream>>>(rx, static_cast<O*>(out),
                                                                             static_cast<const X*>(x), scale);
      }
      err = cudaGetLastError();
    });
  });
  return err;
}

cudaError_t Argmax(const Indexing& kept, int64_t num_kept, int64_t d, int64_t dim_stride, int64_t* out,
                   const void* x, Dt dt, cudaStream_t stream) {
  if (num_kept <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_ALL(dt, {
    ArgmaxKernel<scalar_t><<<device::GridFor(num_kept), 256, 0, stream>>>(kept, num_kept, d, dim_stride, out,
                                                                           static_cast<const scalar_t*>(x));
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t LogSoftmaxForward(const void* x, void* y, int64_t outer, int64_t d, int64_t inner, Dt dt,
                              cudaStream_t stream) {
  const int64_t rows = outer * inner;
  if (rows <= 0 || d <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    LogSoftmaxForwardKernel<scalar_t><<<BlocksFor(rows), device::RowThreads(d), 0, stream>>>(
        static_cast<const scalar_t*>(x), static_cast<scalar_t*>(y), rows, d, inner);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t LogSoftmaxBackward(const void* dy, const void* y, void* dx, int64_t outer, int64_t d, int64_t inner,
                               Dt dt, cudaStream_t stream) {
  const int64_t rows = outer * inner;
  if (rows <= 0 || d <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    LogSoftmaxBackwardKernel<scalar_t><<<BlocksFor(rows), device::RowThreads(d), 0, stream>>>(
        static_cast<const scalar_t*>(dy), static_cast<const scalar_t*>(y), static_cast<scalar_t*>(dx), rows, d,
        inner);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t CrossEntropyLoss(const void* log_probs, const int64_t* target, void* loss, int64_t n, int64_t c,
                             double eps, int64_t ignore_index, Dt dt, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    CrossEntropyLossKernel<scalar_t><<<BlocksFor(n), device::RowThreads(c), 0, stream>>>(
        static_cast<const scalar_t*>(log_probs), target, static_cast<scalar_t*>(loss), n, c, eps, ignore_index);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t CrossEntropyBackward(const void* log_probs, const int64_t* target, const void* grad, int64_t g_stride,
                                 void* dlogits, int64_t n, int64_t c, double eps, int64_t ignore_index, Dt dt,
                                 cudaStream_t stream) {
  if (n <= 0 || c <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    CrossEntropyBackwardKernel<scalar_t><<<device::GridFor(n * c), 256, 0, stream>>>(
        static_cast<const scalar_t*>(log_probs), target, static_cast<const scalar_t*>(grad), g_stride,
        static_cast<scalar_t*>(dlogits), n, c, eps, ignore_index);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t NllLoss(const void* log_probs, const int64_t* target, const void* weight, void* loss, int64_t n,
                    int64_t c, int64_t s, int64_t ignore_index, Dt dt, cudaStream_t stream) {
  if (n <= 0 || s <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    NllLossKernel<scalar_t><<<device::GridFor(n * s), 256, 0, stream>>>(
        static_cast<const scalar_t*>(log_probs), target, static_cast<const scalar_t*>(weight),
        static_cast<scalar_t*>(loss), n, c, s, ignore_index);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t NllLossBackward(const int64_t* target, const void* weight, const void* grad, int64_t g_stride,
                            void* dlog_probs, int64_t n, int64_t c, int64_t s, int64_t ignore_index, Dt dt,
                            cudaStream_t stream) {
  if (n <= 0 || c <= 0 || s <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    NllLossBackwardKernel<scalar_t><<<device::GridFor(n * c * s), 256, 0, stream>>>(
        target, static_cast<const scalar_t*>(weight), static_cast<const scalar_t*>(grad), g_stride,
        static_cast<scalar_t*>(dlog_probs), n, c, s, ignore_index);
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace ddp::nn::cuda::launch
