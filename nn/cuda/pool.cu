// Pooling. Shapes: x, dx [P, H, W] and y, dy, ind [P, OH, OW], where P = N * C
// planes, all contiguous. Forward: one thread per output. Backward gathers:
// one thread per input element sums the outputs whose windows use it, so no
// atomics are needed and the result is deterministic.
#include <cstdint>

#include "nn/cuda/device_util.cuh"
#include "nn/cuda/launch.h"

namespace ddp::nn::cuda::launch {

using device::acc_t;
using device::Cast;

namespace {

struct AvgWindow {
  int64_t start, end, padded;
};

// As the CPU's: the window clipped to the input, and its length with padding.
__device__ __forceinline__ AvgWindow MakeAvgWindow(int64_t o, int64_t stride, int64_t pad, int64_t kernel,
                                                   int64_t size) {
  int64_t s = o * stride - pad;
  int64_t e = s + kernel < size + pad ? s + kernel : size + pad;
  const int64_t padded = e - s;
  s = s > 0 ? s : 0;
  e = e < size ? e : size;
  return {s, e, padded};
}

__device__ __forceinline__ int64_t AvgDivisor(const PoolGeometry& g, const AvgWindow& wh, const AvgWindow& ww) {
  return g.count_include_pad ? wh.padded * ww.padded : (wh.end - wh.start) * (ww.end - ww.start);
}

__device__ __forceinline__ int64_t AdaptiveStart(int64_t o, int64_t out, int64_t in) { return (o * in) / out; }
__device__ __forceinline__ int64_t AdaptiveEnd(int64_t o, int64_t out, int64_t in) {
  return ((o + 1) * in + out - 1) / out;
}

#define DDP_GRID_LOOP(i, n)                                                                      \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);         \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

template <typename T>
__global__ void MaxPoolForwardKernel(PoolGeometry g, const T* x, T* y, int32_t* ind) {
  using A = acc_t<T>;
  DDP_GRID_LOOP(idx, g.planes * g.oh * g.ow) {
    const int64_t j = idx % g.ow, i = (idx / g.ow) % g.oh, pl = idx / (g.ow * g.oh);
    const T* xp = x + pl * g.h * g.w;
    const int64_t h0 = i * g.sh - g.ph, w0 = j * g.sw - g.pw;
    A best = -INFINITY;
    int64_t bi = -1;
    bool done = false;
    for (int64_t kh = 0; kh < g.kh && !done; ++kh) {
      const int64_t ih = h0 + kh * g.dh;
      if (ih < 0 || ih >= g.h) continue;
      for (int64_t kw = 0; kw < g.kw; ++kw) {
        const int64_t iw = w0 + kw * g.dw;
        if (iw < 0 || iw >= g.w) continue;
        const A v = Cast<A>(xp[ih * g.w + iw]);
        if (bi < 0 || v > best || isnan(v)) {  // the first maximum wins; NaN wins and stops the scan
          best = v;
          bi = ih * g.w + iw;
          if (isnan(v)) {
            done = true;
            break;
          }
        }
      }
    }
    y[idx] = Cast<T>(best);
    if (ind != nullptr) ind[idx] = static_cast<int32_t>(bi < 0 ? 0 : bi);
  }
}

template <typename T>
__global__ void MaxPoolBackwardKernel(PoolGeometry g, const T* dy, const int32_t* ind, T* dx) {
  using A = acc_t<T>;
  DDP_GRID_LOOP(idx, g.planes * g.h * g.w) {
    const int64_t iw = idx % g.w, ih = (idx / g.w) % g.h, pl = idx / (g.w * g.h);
    const int64_t self = ih * g.w + iw;
    const int64_t base = pl * g.oh * g.ow;
    A sum = 0;
    for (int64_t kh = 0; kh < g.kh; ++kh) {
      const int64_t num_h = ih + g.ph - kh * g.dh;
      if (num_h < 0 || num_h % g.sh != 0) continue;
      const int64_t i = num_h / g.sh;
      if (i >= g.oh) continue;
      for (int64_t kw = 0; kw < g.kw; ++kw) {
        const int64_t num_w = iw + g.pw - kw * g.dw;
        if (num_w < 0 || num_w % g.sw != 0) continue;
        const int64_t j = num_w / g.sw;
        if (j >= g.ow) continue;
        const int64_t o = base + i * g.ow + j;
        if (ind[o] == self) sum += Cast<A>(dy[o]);
      }
    }
    dx[idx] = Cast<T>(sum);
  }
}

template <typename T>
__global__ void AvgPoolForwardKernel(PoolGeometry g, const T* x, T* y) {
  using A = acc_t<T>;
  DDP_GRID_LOOP(idx, g.planes * g.oh * g.ow) {
    const int64_t j = idx % g.ow, i = (idx / g.ow) % g.oh, pl = idx / (g.ow * g.oh);
    const T* xp = x + pl * g.h * g.w;
    const AvgWindow wh = MakeAvgWindow(i, g.sh, g.ph, g.kh, g.h);
    const AvgWindow ww = MakeAvgWindow(j, g.sw, g.pw, g.kw, g.w);
    A s = 0;
    for (int64_t ih = wh.start; ih < wh.end; ++ih) {
      for (int64_t iw = ww.start; iw < ww.end; ++iw) s += Cast<A>(xp[ih * g.w + iw]);
    }
    const int64_t div = AvgDivisor(g, wh, ww);
    y[idx] = Cast<T>(div > 0 ? s / static_cast<A>(div) : A(0));
  }
}

template <typename T>
__global__ void AvgPoolBackwardKernel(PoolGeometry g, const T* dy, T* dx) {
  using A = acc_t<T>;
  DDP_GRID_LOOP(idx, g.planes * g.h * g.w) {
    const int64_t iw = idx % g.w, ih = (idx / g.w) % g.h, pl = idx / (g.w * g.h);
    const int64_t base = pl * g.oh * g.ow;
    A sum = 0;
    for (int64_t kh = 0; kh < g.kh; ++kh) {
      const int64_t num_h = ih + g.ph - kh;
      if (num_h < 0 || num_h % g.sh != 0) continue;
      const int64_t i = num_h / g.sh;
      if (i >= g.oh) continue;
      const AvgWindow wh = MakeAvgWindow(i, g.sh, g.ph, g.kh, g.h);
      for (int64_t kw = 0; kw < g.kw; ++kw) {
        const int64_t num_w = iw + g.pw - kw;
        if (num_w < 0 || num_w % g.sw != 0) continue;
        const int64_t j = num_w / g.sw;
        if (j >= g.ow) continue;
        const AvgWindow ww = MakeAvgWindow(j, g.sw, g.pw, g.kw, g.w);
        const int64_t div = AvgDivisor(g, wh, ww);
        if (div > 0) sum += Cast<A>(dy[base + i * g.ow + j]) / static_cast<A>(div);
      }
    }
    dx[idx] = Cast<T>(sum);
  }
}

template <typename T>
__global__ void AdaptiveAvgForwardKernel(PoolGeometry g, const T* x, T* y) {
  using A = acc_t<T>;
  DDP_GRID_LOOP(idx, g.planes * g.oh * g.ow) {
    const int64_t j = idx % g.ow, i = (idx / g.ow) % g.oh, pl = idx / (g.ow * g.oh);
    const T* xp = x + pl * g.h * g.w;
    const int64_t hs = AdaptiveStart(i, g.oh, g.h), he = AdaptiveEnd(i, g.oh, g.h);
    const int64_t ws = AdaptiveStart(j, g.ow, g.w), we = AdaptiveEnd(j, g.ow, g.w);
    A s = 0;
    for (int64_t ih = hs; ih < he; ++ih) {
      for (int64_t iw = ws; iw < we; ++iw) s += Cast<A>(xp[ih * g.w + iw]);
    }
    y[idx] = Cast<T>(s / static_cast<A>((he - hs) * (we - ws)));
  }
}

template <typename T>
__global__ void AdaptiveAvgBackwardKernel(PoolGeometry g, const T* dy, T* dx) {
  using A = acc_t<T>;
  DDP_GRID_LOOP(idx, g.planes * g.h * g.w) {
    const int64_t iw = idx % g.w, ih = (idx / g.w) % g.h, pl = idx / (g.w * g.h);
    const int64_t base = pl * g.oh * g.ow;
    // Outputs whose windows may contain ih (checked exactly below).
    const int64_t i_lo = (ih * g.oh) / g.h, i_hi = ((ih + 1) * g.oh + g.h - 1) / g.h;
    const int64_t j_lo = (iw * g.ow) / g.w, j_hi = ((iw + 1) * g.ow + g.w - 1) / g.w;
    A sum = 0;
    for (int64_t i = i_lo > 0 ? i_lo - 1 : 0; i < i_hi + 1 && i < g.oh; ++i) {
      const int64_t hs = AdaptiveStart(i, g.oh, g.h), he = AdaptiveEnd(i, g.oh, g.h);
      if (ih < hs || ih >= he) continue;
      for (int64_t j = j_lo > 0 ? j_lo - 1 : 0; j < j_hi + 1 && j < g.ow; ++j) {
        const int64_t ws = AdaptiveStart(j, g.ow, g.w), we = AdaptiveEnd(j, g.ow, g.w);
        if (iw < ws || iw >= we) continue;
        sum += Cast<A>(dy[base + i * g.ow + j]) / static_cast<A>((he - hs) * (we - ws));
      }
    }
    dx[idx] = Cast<T>(sum);
  }
}

}  // namespace

cudaError_t MaxPoolForward(const PoolGeometry& g, const void* x, void* y, int32_t* ind, Dt dt, cudaStream_t stream) {
  const int64_t n = g.planes * g.oh * g.ow;
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    MaxPoolForwardKernel<scalar_t><<<device::GridFor(n), 256, 0, stream>>>(g, static_cast<const scalar_t*>(x),
                                                                           static_cast<scalar_t*>(y), ind);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t MaxPoolBackward(const PoolGeometry& g, const void* dy, const int32_t* ind, void* dx, Dt dt,
                            cudaStream_t stream) {
  const int64_t n = g.planes * g.h * g.w;
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    MaxPoolBackwardKernel<scalar_t><<<device::GridFor(n), 256, 0, stream>>>(g, static_cast<const scalar_t*>(dy), ind,
                                                                            static_cast<scalar_t*>(dx));
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t AvgPoolForward(const PoolGeometry& g, const void* x, void* y, Dt dt, cudaStream_t stream) {
  const int64_t n = g.planes * g.oh * g.ow;
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    AvgPoolForwardKernel<scalar_t><<<device::GridFor(n), 256, 0, stream>>>(g, static_cast<const scalar_t*>(x),
                                                                           static_cast<scalar_t*>(y));
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t AvgPoolBackward(const PoolGeometry& g, const void* dy, void* dx, Dt dt, cudaStream_t stream) {
  const int64_t n = g.planes * g.h * g.w;
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    AvgPoolBackwardKernel<scalar_t><<<device::GridFor(n), 256, 0, stream>>>(g, static_cast<const scalar_t*>(dy),
                                                                            static_cast<scalar_t*>(dx));
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t AdaptiveAvgPoolForward(const PoolGeometry& g, const void* x, void* y, Dt dt, cudaStream_t stream) {
  const int64_t n = g.planes * g.oh * g.ow;
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    AdaptiveAvgForwardKernel<scalar_t><<<device::GridFor(n), 256, 0, stream>>>(g, static_cast<const scalar_t*>(x),
                                                                               static_cast<scalar_t*>(y));
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t AdaptiveAvgPoolBackward(const PoolGeometry& g, const void* dy, void* dx, Dt dt, cudaStream_t stream) {
  const int64_t n = g.planes * g.h * g.w;
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    AdaptiveAvgBackwardKernel<scalar_t><<<device::GridFor(n), 256, 0, stream>>>(
        g, static_cast<const scalar_t*>(dy), static_cast<scalar_t*>(dx));
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace ddp::nn::cuda::launch
