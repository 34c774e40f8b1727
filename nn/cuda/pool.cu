// Pooling. Shapes: x, dx [P, H, W] and y, dy, ind [P, OH, OW], where P = N * C
// planes, all contiguous. Forward: one thread per output. Backward gathers:
// one thread per input element sums the outputs whose windows use it, so no
// atomics are needed and the result is deterministic.
#include <cstdint>

#include "nn/cuda/device_util.cuh"
#include "nn/cuda/launch.h"
#include "nn/cuda/pool_math.h"

namespace ddp::nn::cuda::launch {

using device::acc_t;
using device::Cast;

namespace {

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
    // Only the taps inside the input, in the order of the full loop.
    const TapRange th = TapsInside(h0, g.dh, g.kh, g.h), tw = TapsInside(w0, g.dw, g.kw, g.w);
    for (int64_t kh = th.first; kh < th.end; ++kh) {
      const int64_t ih = h0 + kh * g.dh;
      for (int64_t kw = tw.first; kw < tw.end; ++kw) {
        const int64_t iw = w0 + kw * g.dw;
        const A v = Cast<A>(xp[ih * g.w + iw]);
        if (bi < 0 || v > best || isnan(v)) {  // the first maximum wins, and the last NaN, as in PyTorch
          best = v;
          bi = ih * g.w + iw;
        }
      }
    }
    y[idx] = Cast<T>(best);
    // -1 for a window whose taps all miss the input (as the CPU kernel).
    if (ind != nullptr) ind[idx] = static_cast<int32_t>(bi);
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
    ForEachMaxWindowCovering(g, ih, iw, [&](int64_t o) {
      if (ind[base + o] == self) sum += Cast<A>(dy[base + o]);
    });
    dx[idx] = Cast<T>(sum);
  }
}

template <typename T>
__global__ void AvgPoolForwardKernel(PoolGeometry g, const T* x, T* y) {
  using A = acc_t<T>;
  DDP_GRID_LOOP(idx, g.planes * g.oh * g.ow) {
    const int64_t j = idx % g.ow, i = (idx / g.ow) % g.oh, pl = idx / (g.ow * g.oh);
    const T* xp = x + pl * g.h * g.w;
    const AvgWindow wh = AvgWindowOf(i, g.sh, g.ph, g.kh, g.h);
    const AvgWindow ww = AvgWindowOf(j, g.sw, g.pw, g.kw, g.w);
    A s = 0;
    for (int64_t ih = wh.start; ih < wh.end; ++ih) {
      for (int64_t iw = ww.start; iw < ww.end; ++iw) s += Cast<A>(xp[ih * g.w + iw]);
    }
    const A div = AvgDivisorOf<A>(g, wh, ww);
    y[idx] = Cast<T>(div > A(0) ? s / div : A(0));
  }
}

template <typename T>
__global__ void AvgPoolBackwardKernel(PoolGeometry g, const T* dy, T* dx) {
  using A = acc_t<T>;
  DDP_GRID_LOOP(idx, g.planes * g.h * g.w) {
    const int64_t iw = idx % g.w, ih = (idx / g.w) % g.h, pl = idx / (g.w * g.h);
    const int64_t base = pl * g.oh * g.ow;
    A sum = 0;
    ForEachAvgWindowCovering<A>(g, ih, iw, [&](int64_t o, A div) {
      sum += Cast<A>(dy[base + o]) / div;
    });
    dx[idx] = Cast<T>(sum);
  }
}

template <typename T>
__global__ void AdaptiveAvgForwardKernel(PoolGeometry g, const T* x, T* y) {
  using A = acc_t<T>;
  DDP_GRID_LOOP(idx, g.planes * g.oh * g.ow) {
    const int64_t j = idx % g.ow, i = (idx / g.ow) % g.oh, pl = idx / (g.ow * g.oh);
    const T* xp = x + pl * g.h * g.w;
    const int64_t hs = AdaptiveStartOf(i, g.oh, g.h), he = AdaptiveEndOf(i, g.oh, g.h);
    const int64_t ws = AdaptiveStartOf(j, g.ow, g.w), we = AdaptiveEndOf(j, g.ow, g.w);
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
    A sum = 0;
    ForEachAdaptiveWindowCovering(g, ih, iw, [&](int64_t o, int64_t count) {
      sum += Cast<A>(dy[base + o]) / static_cast<A>(count);
    });
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
