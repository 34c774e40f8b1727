// Optimizer updates and the mixed-precision unscale/check. Shapes: every
// operand is a contiguous [n] array of one dtype (f32 or f64 for updates,
// any floating type for unscaling); one thread per element, grid-stride.
// The arithmetic follows nn/optim's CPU kernels operation by operation
// (nvcc may still fuse a multiply and an add into one FMA, which rounds once
// instead of twice).
#include <cstdint>

#include "nn/cuda/device_util.cuh"
#include "nn/cuda/launch.h"

namespace ddp::nn::cuda::launch {

using device::acc_t;
using device::Cast;

namespace {

#define DDP_GRID_LOOP(i, n)                                                              \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

__device__ __forceinline__ float Sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double Sqrt(double x) { return sqrt(x); }

template <typename T>
__global__ void SgdKernel(T* p, const T* g, T* buf, int64_t n, SgdCoefficients c) {
  const T wd = static_cast<T>(c.weight_decay), mom = static_cast<T>(c.momentum), keep = static_cast<T>(c.keep);
  const T neg_lr = static_cast<T>(c.neg_lr), scale = static_cast<T>(c.grad_scale);
  DDP_GRID_LOOP(i, n) {
    T d = g[i] * scale;
    if (c.weight_decay != 0) d = d + wd * p[i];
    if (c.momentum != 0) {
      const T b = c.first_step ? d : buf[i] * mom + keep * d;
      buf[i] = b;
      d = c.nesterov ? d + mom * b : b;
    }
    p[i] = p[i] + neg_lr * d;
  }
}

template <typename T>
__global__ void AdamKernel(T* p, const T* g, T* m, T* v, T* vmax, int64_t n, AdamCoefficients c) {
  const T b1 = static_cast<T>(c.beta1), one_b1 = static_cast<T>(c.one_minus_beta1);
  const T b2 = static_cast<T>(c.beta2), one_b2 = static_cast<T>(c.one_minus_beta2);
  const T eps = static_cast<T>(c.eps), wd = static_cast<T>(c.weight_decay), decay = static_cast<T>(c.decay);
  const T neg_step = static_cast<T>(c.neg_step_size), bc2_sqrt = static_cast<T>(c.bc2_sqrt);
  const T scale = static_cast<T>(c.grad_scale);
  DDP_GRID_LOOP(i, n) {
    T gi = g[i] * scale;
    T pi = p[i];
    if (c.coupled_weight_decay) gi = gi + wd * pi;
    if (c.decoupled_weight_decay) pi = pi * decay;
    const T mi = m[i] * b1 + one_b1 * gi;
    const T vi = v[i] * b2 + one_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    T s = vi;
    if (vmax != nullptr) {
      s = vmax[i] > vi ? vmax[i] : vi;
      vmax[i] = s;
    }
    const T denom = Sqrt(s) / bc2_sqrt + eps;
    p[i] = pi + neg_step * (mi / denom);
  }
}

template <typename T>
__global__ void UnscaleKernel(T* t, int64_t n, double inv_scale, float* found_inf) {
  using A = acc_t<T>;
  const A s = static_cast<A>(inv_scale);
  bool bad = false;
  DDP_GRID_LOOP(i, n) {
    const A v = Cast<A>(t[i]);
    bad = bad || !isfinite(v);
    t[i] = Cast<T>(v * s);
  }
  // One store per warp that saw a bad value; every writer stores the same 1.
  if (__any_sync(0xffffffffu, bad) && threadIdx.x % 32 == 0) *found_inf = 1.0f;
}

}  // namespace

cudaError_t SgdStep(void* p, const void* g, void* momentum_buffer, int64_t n, const SgdCoefficients& c, Dt dt,
                    cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dt == Dt::kF32) {
    SgdKernel<float><<<device::GridFor(n), 256, 0, stream>>>(static_cast<float*>(p), static_cast<const float*>(g),
                                                             static_cast<float*>(momentum_buffer), n, c);
  } else if (dt == Dt::kF64) {
    SgdKernel<double><<<device::GridFor(n), 256, 0, stream>>>(static_cast<double*>(p), static_cast<const double*>(g),
                                                              static_cast<double*>(momentum_buffer), n, c);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t AdamStep(void* p, const void* g, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq, int64_t n,
                     const AdamCoefficients& c, Dt dt, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dt == Dt::kF32) {
    AdamKernel<float><<<device::GridFor(n), 256, 0, stream>>>(
        static_cast<float*>(p), static_cast<const float*>(g), static_cast<float*>(exp_avg),
        static_cast<float*>(exp_avg_sq), static_cast<float*>(max_exp_avg_sq), n, c);
  } else if (dt == Dt::kF64) {
    AdamKernel<double><<<device::GridFor(n), 256, 0, stream>>>(
        static_cast<double*>(p), static_cast<const double*>(g), static_cast<double*>(exp_avg),
        static_cast<double*>(exp_avg_sq), static_cast<double*>(max_exp_avg_sq), n, c);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t UnscaleAndCheck(void* t, int64_t n, double inv_scale, float* found_inf, Dt dt, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    UnscaleKernel<scalar_t><<<device::GridFor(n), 256, 0, stream>>>(static_cast<scalar_t*>(t), n, inv_scale,
                                                                    found_inf);
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace ddp::nn::cuda::launch
