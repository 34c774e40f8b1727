// Optimizer updates, the mixed-precision unscale/check and the max-|x|
// reduction of the infinity-norm gradient clip. Shapes: every operand is a
// contiguous [n] array of one dtype (f32 or f64 for updates, any floating
// type for unscaling and max-|x|); one thread per element, grid-stride.
// The arithmetic follows nn/optim's CPU kernels operation by operation. In
// SGD and Adam nvcc may still fuse a multiply and an add into one FMA, which
// rounds once instead of twice; Adadelta rounds every product and sum on its
// own (the _rn intrinsics are never contracted), as the x86-64 CPU loop does;
// so do RMSprop and Adagrad.
//
// SGD and the unscale also come as multi-tensor kernels (multi_tensor.h):
// one launch for many tensors, block b on one chunk of one tensor. They
// call the same element functions as the one-tensor kernels, so both give
// the same bits.
#include <cstdint>

#include "nn/cuda/device_util.cuh"
#include "nn/cuda/launch.h"
#include "nn/cuda/multi_tensor.h"

namespace ddp::nn::cuda::launch {

using device::acc_t;
using device::Cast;

namespace {

#define DDP_GRID_LOOP(i, n)                                                              \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

__device__ __forceinline__ float Sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double Sqrt(double x) { return sqrt(x); }

// SgdCoefficients rounded to T, as PyTorch passes Python floats to kernels of the tensor's type.
template <typename T>
struct SgdConstants {
  T wd, mom, keep, neg_lr, scale;
  __device__ explicit SgdConstants(const SgdCoefficients& c)
      : wd(static_cast<T>(c.weight_decay)), mom(static_cast<T>(c.momentum)), keep(static_cast<T>(c.keep)),
        neg_lr(static_cast<T>(c.neg_lr)), scale(static_cast<T>(c.grad_scale)) {}
};

// One element's SGD update: returns the new p. `b` is the momentum buffer's
// element, read unless c.first_step and written when c.momentum != 0.
template <typename T>
__device__ __forceinline__ T SgdUpdate(T p, T g, T& b, const SgdCoefficients& c, const SgdConstants<T>& k) {
  T d = g * k.scale;
  if (c.weight_decay != 0) d = d + k.wd * p;
  if (c.momentum != 0) {
    b = c.first_step ? d : b * k.mom + k.keep * d;
    d = c.nesterov ? d + k.mom * b : b;
  }
  return p + k.neg_lr * d;
}

template <typename T>
__global__ void SgdKernel(T* p, const T* g, T* buf, int64_t n, SgdCoefficients c) {
  const SgdConstants<T> k(c);
  const bool reads_buf = c.momentum != 0 && !c.first_step;
  DDP_GRID_LOOP(i, n) {
    T b = reads_buf ? buf[i] : T(0);
    p[i] = SgdUpdate(p[i], g[i], b, c, k);
    if (c.momentum != 0) buf[i] = b;
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
      // torch.maximum: a NaN on either side is kept (vmax != vmax is NaN).
      const T old_max = vmax[i];
      s = (old_max > vi || old_max != old_max) ? old_max : vi;
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

__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double Sub(double a, double b) { return __dsub_rn(a, b); }

// The loop of nn/optim/rmsprop.cc, same operands in the same order, each
// product and sum rounded on its own. The centered average is ATen's scalar
// lerp(ga, g, w), w = 1 - alpha in T: ga + w * (g - ga) for |w| < 0.5, else
// g - (g - ga) * (1 - w), with 1 - w taken in T as the CPU loop does.
template <typename T>
__global__ void RmspropKernel(T* p, const T* g, T* sq, T* buf, T* ga, int64_t n, RmspropCoefficients c) {
  const T alpha = static_cast<T>(c.alpha), one_alpha = static_cast<T>(c.one_minus_alpha);
  const T lerp_keep = Sub(T(1), one_alpha);
  const bool small_w = fabs(one_alpha) < T(0.5);
  const T eps = static_cast<T>(c.eps), wd = static_cast<T>(c.weight_decay), mom = static_cast<T>(c.momentum);
  const T neg_lr = static_cast<T>(c.neg_lr), scale = static_cast<T>(c.grad_scale);
  DDP_GRID_LOOP(i, n) {
    T gi = Mul(g[i], scale);
    if (c.weight_decay != 0) gi = Add(gi, Mul(wd, p[i]));
    const T s = Add(Mul(sq[i], alpha), Mul(Mul(one_alpha, gi), gi));
    sq[i] = s;
    T avg;
    if (c.centered) {
      const T a = small_w ? Add(ga[i], Mul(one_alpha, Sub(gi, ga[i]))) : Sub(gi, Mul(Sub(gi, ga[i]), lerp_keep));
      ga[i] = a;
      avg = Add(Sqrt(Sub(s, Mul(a, a))), eps);
    } else {
      avg = Add(Sqrt(s), eps);
    }
    if (c.momentum != 0) {
      const T b = Add(Mul(buf[i], mom), gi / avg);
      buf[i] = b;
      p[i] = Add(p[i], Mul(neg_lr, b));
    } else {
      p[i] = Add(p[i], Mul(neg_lr, gi) / avg);
    }
  }
}

// The loop of nn/optim/adagrad.cc, same operands in the same order.
template <typename T>
__global__ void AdagradKernel(T* p, const T* g, T* sum, int64_t n, AdagradCoefficients c) {
  const T eps = static_cast<T>(c.eps), wd = static_cast<T>(c.weight_decay);
  const T neg_clr = static_cast<T>(c.neg_clr), scale = static_cast<T>(c.grad_scale);
  DDP_GRID_LOOP(i, n) {
    T gi = Mul(g[i], scale);
    if (c.weight_decay != 0) gi = Add(gi, Mul(wd, p[i]));
    const T s = Add(sum[i], Mul(gi, gi));
    sum[i] = s;
    const T std_dev = Add(Sqrt(s), eps);
    p[i] = Add(p[i], Mul(neg_clr, gi) / std_dev);
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

// One element unscaled: x * s in the accumulation type, rounded back to T;
// `bad` is set when x is inf or NaN.
template <typename T>
__device__ __forceinline__ T Unscaled(T x, acc_t<T> s, bool& bad) {
  const acc_t<T> v = Cast<acc_t<T>>(x);
  bad = bad || !isfinite(v);
  return Cast<T>(v * s);
}

// One store per warp that saw a bad value; every writer stores the same 1.
// Every thread of the block must call it.
__device__ __forceinline__ void FlagIfAny(bool bad, float* found_inf) {
  if (__any_sync(0xffffffffu, bad) && threadIdx.x % 32 == 0) *found_inf = 1.0f;
}

template <typename T>
__global__ void UnscaleKernel(T* t, int64_t n, double inv_scale, float* found_inf) {
  const acc_t<T> s = static_cast<acc_t<T>>(inv_scale);
  bool bad = false;
  DDP_GRID_LOOP(i, n) t[i] = Unscaled(t[i], s, bad);
  FlagIfAny(bad, found_inf);
}

// ---- multi-tensor kernels ----
// 512 threads, each with kIlp elements in flight (loads issued before any
// store, which the compiler may not reorder across possibly aliasing
// pointers): a chunk of 64 Ki elements is 32 rounds of 2048.
constexpr int kMultiThreads = 512;
constexpr int kIlp = 4;

// The part of table entry blockIdx.x this block handles: elements
// [start, start + n) of tensor `tensor`.
struct BlockChunk {
  int tensor;
  int64_t start, n;
};

template <int kDepth>
__device__ __forceinline__ BlockChunk ChunkOfBlock(const MultiTensorTable<kDepth>& table) {
  BlockChunk b;
  b.tensor = table.block_tensor[blockIdx.x];
  b.start = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * kMultiTensorChunk;
  const int64_t left = table.numels[b.tensor] - b.start;
  b.n = left < kMultiTensorChunk ? left : kMultiTensorChunk;
  return b;
}

template <typename T>
__global__ void __launch_bounds__(kMultiThreads) UnscaleMultiKernel(MultiTensorTable<1> table, double inv_scale,
                                                                    float* found_inf) {
  const BlockChunk b = ChunkOfBlock(table);
  T* t = static_cast<T*>(table.ptrs[0][b.tensor]) + b.start;
  const acc_t<T> s = static_cast<acc_t<T>>(inv_scale);
  bool bad = false;
  for (int64_t base = threadIdx.x; base < b.n; base += int64_t{kIlp} * kMultiThreads) {
    T v[kIlp];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t i = base + u * kMultiThreads;
      if (i < b.n) v[u] = t[i];
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t i = base + u * kMultiThreads;
      if (i < b.n) t[i] = Unscaled(v[u], s, bad);
    }
  }
  FlagIfAny(bad, found_inf);
}

// Operands p, g and (kDepth 3, with momentum) the momentum buffer.
template <typename T, int kDepth>
__global__ void __launch_bounds__(kMultiThreads) SgdMultiKernel(MultiTensorTable<kDepth> table, SgdCoefficients c) {
  static_assert(kDepth == 2 || kDepth == 3);
  const BlockChunk b = ChunkOfBlock(table);
  T* p = static_cast<T*>(table.ptrs[0][b.tensor]) + b.start;
  const T* g = static_cast<const T*>(table.ptrs[1][b.tensor]) + b.start;
  T* buf = kDepth == 3 ? static_cast<T*>(table.ptrs[kDepth - 1][b.tensor]) + b.start : nullptr;
  const SgdConstants<T> k(c);
  const bool reads_buf = kDepth == 3 && !c.first_step;
  for (int64_t base = threadIdx.x; base < b.n; base += int64_t{kIlp} * kMultiThreads) {
    T pv[kIlp], gv[kIlp], bv[kIlp];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t i = base + u * kMultiThreads;
      bv[u] = T(0);
      if (i < b.n) {
        pv[u] = p[i];
        gv[u] = g[i];
        if (reads_buf) bv[u] = buf[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t i = base + u * kMultiThreads;
      if (i < b.n) {
        p[i] = SgdUpdate(pv[u], gv[u], bv[u], c, k);
        if (kDepth == 3) buf[i] = bv[u];
      }
    }
  }
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

cudaError_t RmspropStep(void* p, const void* g, void* square_avg, void* momentum_buffer, void* grad_avg, int64_t n,
                        const RmspropCoefficients& c, Dt dt, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dt == Dt::kF32) {
    RmspropKernel<float><<<device::GridFor(n), 256, 0, stream>>>(
        static_cast<float*>(p), static_cast<const float*>(g), static_cast<float*>(square_avg),
        static_cast<float*>(momentum_buffer), static_cast<float*>(grad_avg), n, c);
  } else if (dt == Dt::kF64) {
    RmspropKernel<double><<<device::GridFor(n), 256, 0, stream>>>(
        static_cast<double*>(p), static_cast<const double*>(g), static_cast<double*>(square_avg),
        static_cast<double*>(momentum_buffer), static_cast<double*>(grad_avg), n, c);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t AdagradStep(void* p, const void* g, void* sum, int64_t n, const AdagradCoefficients& c, Dt dt,
                        cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dt == Dt::kF32) {
    AdagradKernel<float><<<device::GridFor(n), 256, 0, stream>>>(
        static_cast<float*>(p), static_cast<const float*>(g), static_cast<float*>(sum), n, c);
  } else if (dt == Dt::kF64) {
    AdagradKernel<double><<<device::GridFor(n), 256, 0, stream>>>(
        static_cast<double*>(p), static_cast<const double*>(g), static_cast<double*>(sum), n, c);
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

cudaError_t UnscaleAndCheckMulti(const MultiTensorEntry* tensors, int64_t count, double inv_scale, float* found_inf,
                                 Dt dt, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    err = ForEachMultiTensorTable<1>(tensors, count, [&](const MultiTensorTable<1>& table, int blocks) {
      UnscaleMultiKernel<scalar_t><<<blocks, kMultiThreads, 0, stream>>>(table, inv_scale, found_inf);
      return cudaGetLastError();
    });
  });
  return err;
}

namespace {

template <typename T>
cudaError_t SgdMulti(const MultiTensorEntry* tensors, int64_t count, const SgdCoefficients& c, cudaStream_t stream) {
  if (c.momentum == 0) {
    return ForEachMultiTensorTable<2>(tensors, count, [&](const MultiTensorTable<2>& table, int blocks) {
      SgdMultiKernel<T, 2><<<blocks, kMultiThreads, 0, stream>>>(table, c);
      return cudaGetLastError();
    });
  }
  return ForEachMultiTensorTable<3>(tensors, count, [&](const MultiTensorTable<3>& table, int blocks) {
    SgdMultiKernel<T, 3><<<blocks, kMultiThreads, 0, stream>>>(table, c);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t SgdStepMulti(const MultiTensorEntry* tensors, int64_t count, const SgdCoefficients& c, Dt dt,
                         cudaStream_t stream) {
  if (dt == Dt::kF32) return SgdMulti<float>(tensors, count, c, stream);
  if (dt == Dt::kF64) return SgdMulti<double>(tensors, count, c, stream);
  return cudaErrorInvalidValue;
}

}  // namespace ddp::nn::cuda::launch
