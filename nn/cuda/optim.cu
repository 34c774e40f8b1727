// Optimizer updates, the mixed-precision unscale/check and the max-|x|
// reduction of the infinity-norm gradient clip. Shapes: every operand is a
// contiguous [n] array of one dtype (f32 or f64 for updates, any floating
// type for unscaling and max-|x|); one thread per element, grid-stride.
// The arithmetic follows nn/optim's CPU kernels operation by operation. In
// SGD and Adam nvcc may still fuse a multiply and an add into one FMA, which
// rounds once instead of twice; Adadelta rounds every product and sum on its
// own (the _rn intrinsics are never contracted), as the x86-64 CPU loop does.
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

__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double Mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double Add(double a, double b) { return __dadd_rn(a, b); }

// The loop of nn/optim/adadelta.cc, same operands in the same order.
template <typename T>
__global__ void AdadeltaKernel(T* p, const T* g, T* sq, T* acc, int64_t n, AdadeltaCoefficients c) {
  const T rho = static_cast<T>(c.rho), one_rho = static_cast<T>(c.one_minus_rho), eps = static_cast<T>(c.eps);
  const T wd = static_cast<T>(c.weight_decay), neg_lr = static_cast<T>(c.neg_lr);
  const T scale = static_cast<T>(c.grad_scale);
  DDP_GRID_LOOP(i, n) {
    T gi = Mul(g[i], scale);
    if (c.weight_decay != 0) gi = Add(gi, Mul(wd, p[i]));
    const T s = Add(Mul(sq[i], rho), Mul(Mul(one_rho, gi), gi));
    sq[i] = s;
    const T std_dev = Sqrt(Add(s, eps));
    const T delta = Mul(Sqrt(Add(acc[i], eps)) / std_dev, gi);
    acc[i] = Add(Mul(acc[i], rho), Mul(Mul(one_rho, delta), delta));
    p[i] = Add(p[i], Mul(neg_lr, delta));
  }
}

// max-|x| compares the bit patterns of |x| in f64 as unsigned integers: for
// values >= 0 that order is numeric order, and every NaN pattern (whatever
// sign bit fabs leaves on a NaN) lies above +inf's, so the integer maximum is
// the largest |x|, or a NaN when there is one. Blocks then combine with the
// integer atomicMax.
using Bits = unsigned long long;

__device__ __forceinline__ Bits MaxBits(Bits a, Bits b) { return a > b ? a : b; }

constexpr int kMaxAbsThreads = 256;
// Enough blocks to fill the GPU; each then reads many elements, and only
// this many atomics meet at *out.
constexpr unsigned kMaxAbsBlocks = 1024;

template <typename T>
__global__ void MaxAbsKernel(const T* x, int64_t n, Bits* out) {
  __shared__ Bits warp_max[kMaxAbsThreads / 32];
  Bits m = 0;  // +0.0
  DDP_GRID_LOOP(i, n) {
    const double a = fabs(static_cast<double>(Cast<acc_t<T>>(x[i])));
    m = MaxBits(m, static_cast<Bits>(__double_as_longlong(a)));
  }
  for (int o = 16; o > 0; o /= 2) m = MaxBits(m, __shfl_down_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kMaxAbsThreads / 32; ++w) m = MaxBits(m, warp_max[w]);
    atomicMax(out, m);
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

cudaError_t AdadeltaStep(void* p, const void* g, void* square_avg, void* acc_delta, int64_t n,
                         const AdadeltaCoefficients& c, Dt dt, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dt == Dt::kF32) {
    AdadeltaKernel<float><<<device::GridFor(n), 256, 0, stream>>>(
        static_cast<float*>(p), static_cast<const float*>(g), static_cast<float*>(square_avg),
        static_cast<float*>(acc_delta), n, c);
  } else if (dt == Dt::kF64) {
    AdadeltaKernel<double><<<device::GridFor(n), 256, 0, stream>>>(
        static_cast<double*>(p), static_cast<const double*>(g), static_cast<double*>(square_avg),
        static_cast<double*>(acc_delta), n, c);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t MaxAbs(const void* x, int64_t n, double* out, Dt dt, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const unsigned grid = device::GridFor(n) < kMaxAbsBlocks ? device::GridFor(n) : kMaxAbsBlocks;
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    MaxAbsKernel<scalar_t><<<grid, kMaxAbsThreads, 0, stream>>>(static_cast<const scalar_t*>(x), n,
                                                                reinterpret_cast<Bits*>(out));
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace ddp::nn::cuda::launch
