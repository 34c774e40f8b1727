// Elementwise kernels. Shapes: every operand is indexed by one shared index
// space of n elements (the output's shape); inputs that broadcast have
// stride 0 in the dimensions they repeat. Grid-stride loops over 256-thread
// blocks; 16-bit floats compute in f32, f64 in f64, integers in their type.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "nn/cuda/device_util.cuh"
#include "nn/cuda/env_flag.h"
#include "nn/cuda/launch.h"

namespace ddp::nn::cuda::launch {

using device::acc_t;
using device::Cast;

namespace {

__device__ __forceinline__ float Erf(float x) { return erff(x); }
__device__ __forceinline__ double Erf(double x) { return erf(x); }
__device__ __forceinline__ float Exp(float x) { return expf(x); }
__device__ __forceinline__ double Exp(double x) { return exp(x); }
__device__ __forceinline__ float Log(float x) { return logf(x); }
__device__ __forceinline__ double Log(double x) { return log(x); }
__device__ __forceinline__ float Log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double Log1p(double x) { return log1p(x); }
__device__ __forceinline__ float Tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double Tanh(double x) { return tanh(x); }
__device__ __forceinline__ float Sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double Sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float Abs(float x) { return fabsf(x); }
__device__ __forceinline__ double Abs(double x) { return fabs(x); }

constexpr double kSqrt1_2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluCoef = 0.044715;

// The op codes are ops::UnaryOp's values.
template <typename A>
__device__ __forceinline__ A UnaryFn(OpCode op, A v) {
  switch (op) {
    case 0: return -v;
    case 1: return v < A(0) ? A(0) : v;  // keeps NaN, as the CPU kernel and torch.relu
    case 2: return A(0.5) * v * (A(1) + Erf(v * A(kSqrt1_2)));
    case 3: return A(0.5) * v * (A(1) + Tanh(A(kSqrt2OverPi) * (v + A(kGeluCoef) * v * v * v)));
    case 4: return A(1) / (A(1) + Exp(-v));
    case 5: return Tanh(v);
    case 6: return Exp(v);
    case 7: return Log(v);
    case 8: return Sqrt(v);
    case 9: return v * v;
    case 10: return Abs(v);
    default: return Log1p(v);  // 11
  }
}

// d: incoming gradient; s: x for relu/gelu/log/log1p/square/abs/neg, y = op(x) for
// sigmoid/tanh/exp/sqrt (what the CPU kernels and the autograd nodes save).
template <typename A>
__device__ __forceinline__ A UnaryGradFn(OpCode op, A d, A s) {
  switch (op) {
    case 0: return -d;
    case 1: return s <= A(0) ? A(0) : d;
    case 2: {
      const A cdf = A(0.5) * (A(1) + Erf(s * A(kSqrt1_2)));
      const A pdf = A(kInvSqrt2Pi) * Exp(A(-0.5) * s * s);
      return d * (cdf + s * pdf);
    }
    case 3: {
      const A u = A(kSqrt2OverPi) * (s + A(kGeluCoef) * s * s * s);
      const A t = Tanh(u);
      const A du = A(kSqrt2OverPi) * (A(1) + A(3 * kGeluCoef) * s * s);
      return d * (A(0.5) * (A(1) + t) + A(0.5) * s * (A(1) - t * t) * du);
    }
    case 4: return d * s * (A(1) - s);
    case 5: return d * (A(1) - s * s);
    case 6: return d * s;
    case 7: return d / s;
    case 8: return d / (A(2) * s);
    case 9: return A(2) * d * s;
    case 10: return s > A(0) ? d : (s < A(0) ? -d : A(0));
    default: return d / (A(1) + s);  // 11: log1p
  }
}

// x + y, x - y or x * y (op 0, 1, 2); signed integers wrap in two's
// complement, as on the CPU (nn/ops/cpu/elementwise.cc) and in PyTorch:
// computed in the unsigned type (widened to unsigned int for the narrow
// ones, whose product would otherwise overflow int), since signed overflow
// is undefined.
template <typename A>
__device__ __forceinline__ A Wrapping(OpCode op, A x, A y) {
  if constexpr (std::is_integral_v<A> && std::is_signed_v<A>) {
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    const U a = static_cast<U>(x), b = static_cast<U>(y);
    return static_cast<A>(op == 0 ? a + b : op == 1 ? a - b : a * b);
  } else {
    return op == 0 ? x + y : op == 1 ? x - y : x * y;
  }
}

// The op codes are ops::BinaryOp's values.
template <typename A>
__device__ __forceinline__ A BinaryFn(OpCode op, A x, A y) {
  switch (op) {
    case 0:
    case 1:
    case 2: return Wrapping(op, x, y);
    case 3: return x / y;
    default: {  // 4: add (wrapping, as case 0), then relu as UnaryFn's case 1 (NaN kept)
      const A s = Wrapping(0, x, y);
      if constexpr (std::is_unsigned_v<A>) {
        return s;
      } else {
        return s < A(0) ? A(0) : s;
      }
    }
  }
}

template <int N, typename F>
__global__ void ElementwiseKernel(Indexing ix, int64_t n, F f) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t off[N];
    device::Offsets<N>(ix, i, off);
    f(off);
  }
}

template <int N, typename F>
cudaError_t LaunchElementwise(const Indexing& ix, int64_t n, cudaStream_t stream, F f) {
  if (n <= 0) return cudaSuccess;
  ElementwiseKernel<N><<<device::GridFor(n), 256, 0, stream>>>(ix, n, f);
  return cudaGetLastError();
}

// ---- the vectorized path (VectorizedElementwise(): contiguous operands of
// one dtype, each 16-byte aligned) ----

// -1 until read from DDP_NN_CUDA_VEC, then 0 or 1.
std::atomic<int> vectorized{-1};
// Launches of PackedKernel so far (PackedElementwiseLaunches).
std::atomic<uint64_t> packed_launches{0};

// 16 bytes of T: one 128-bit load or store per operand and pack.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
bool Aligned16(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// out[i] = f(in[0][i], ..., in[K-1][i]) over n contiguous elements: each
// thread moves whole packs, then the last n % kSize elements one by one.
template <typename T, int K, typename F>
__global__ void PackedKernel(T* out, const T* in0, const T* in1, int64_t n, F f) {
  using P = Pack<T>;
  constexpr int kV = P::kSize;
  const int64_t packs = n / kV;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t p = first; p < packs; p += step) {
    const P a = reinterpret_cast<const P*>(in0)[p];
    P b;
    if constexpr (K == 2) b = reinterpret_cast<const P*>(in1)[p];
    P r;
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      if constexpr (K == 2) {
        r.v[k] = f(a.v[k], b.v[k]);
      } else {
        r.v[k] = f(a.v[k], a.v[k]);
      }
    }
    reinterpret_cast<P*>(out)[p] = r;
  }
  for (int64_t i = packs * kV + first; i < n; i += step) out[i] = f(in0[i], K == 2 ? in1[i] : in0[i]);
}

// Launches PackedKernel when the setting is on and the operands qualify;
// false (nothing launched) otherwise, and the caller runs the indexed path.
template <typename T, int K, typename F>
bool LaunchPacked(const Indexing& ix, int64_t n, T* out, const T* in0, const T* in1, cudaStream_t stream,
                  cudaError_t* err, F f) {
  if (!VectorizedElementwise() || !ix.contiguous || n <= 0) return false;
  if (!Aligned16(out) || !Aligned16(in0) || (K == 2 && !Aligned16(in1))) return false;
  const int64_t packs = n / Pack<T>::kSize;
  PackedKernel<T, K><<<device::GridFor(packs > 0 ? packs : n), 256, 0, stream>>>(out, in0, in1, n, f);
  *err = cudaGetLastError();
  packed_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// splitmix64: a bijective 64-bit mixer; its outputs for consecutive inputs
// are statistically independent enough for dropout masks.
__device__ __forceinline__ uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void BernoulliKernel(uint8_t* mask, int64_t n, uint64_t threshold, uint64_t seed) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    mask[i] = (Mix64(seed ^ Mix64(static_cast<uint64_t>(i))) >> 40) < threshold ? 1 : 0;
  }
}

}  // namespace

bool VectorizedElementwise() {
  int on = vectorized.load(std::memory_order_relaxed);
  if (on < 0) {
    on = EnvFlag("DDP_NN_CUDA_VEC", false) ? 1 : 0;
    vectorized.store(on, std::memory_order_relaxed);
  }
  return on == 1;
}

void SetVectorizedElementwise(bool on) { vectorized.store(on ? 1 : 0, std::memory_order_relaxed); }

uint64_t PackedElementwiseLaunches() { return packed_launches.load(std::memory_order_relaxed); }

cudaError_t Copy(const Indexing& ix, int64_t n, void* dst, Dt dst_dt, const void* src, Dt src_dt,
                 cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_ALL(dst_dt, {
    using D = scalar_t;
    D* d = static_cast<D*>(dst);
    DDP_CUDA_DISPATCH_ALL(src_dt, {
      using S = scalar_t;
      const S* s = static_cast<const S*>(src);
      err = LaunchElementwise<2>(ix, n, stream, [=] __device__(const int64_t(&off)[2]) {
        d[off[0]] = Cast<D>(Cast<acc_t<S>>(s[off[1]]));
      });
    });
  });
  return err;
}

cudaError_t Unary(OpCode op, const Indexing& ix, int64_t n, void* out, const void* x, Dt dt, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    using T = scalar_t;
    using A = acc_t<T>;
    T* o = static_cast<T*>(out);
    const T* xp = static_cast<const T*>(x);
    if (!LaunchPacked<T, 1>(ix, n, o, xp, nullptr, stream, &err,
                            [=] __device__(T v, T) { return Cast<T>(UnaryFn<A>(op, Cast<A>(v))); })) {
      err = LaunchElementwise<2>(ix, n, stream, [=] __device__(const int64_t(&off)[2]) {
        o[off[0]] = Cast<T>(UnaryFn<A>(op, Cast<A>(xp[off[1]])));
      });
    }
  });
  return err;
}

cudaError_t UnaryBackward(OpCode op, const Indexing& ix, int64_t n, void* grad_in, const void* grad_out,
                          const void* saved, Dt dt, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    using T = scalar_t;
    using A = acc_t<T>;
    T* gi = static_cast<T*>(grad_in);
    const T* go = static_cast<const T*>(grad_out);
    const T* sv = static_cast<const T*>(saved);
    if (!LaunchPacked<T, 2>(ix, n, gi, go, sv, stream, &err, [=] __device__(T g, T v) {
          return Cast<T>(UnaryGradFn<A>(op, Cast<A>(g), Cast<A>(v)));
        })) {
      err = LaunchElementwise<3>(ix, n, stream, [=] __device__(const int64_t(&off)[3]) {
        gi[off[0]] = Cast<T>(UnaryGradFn<A>(op, Cast<A>(go[off[1]]), Cast<A>(sv[off[2]])));
      });
    }
  });
  return err;
}

cudaError_t Binary(OpCode op, const Indexing& ix, int64_t n, void* out, const void* a, const void* b, Dt dt,
                   cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_ALL(dt, {
    using T = scalar_t;
    using A = acc_t<T>;
    T* o = static_cast<T*>(out);
    const T* ap = static_cast<const T*>(a);
    const T* bp = static_cast<const T*>(b);
    if (!LaunchPacked<T, 2>(ix, n, o, ap, bp, stream, &err, [=] __device__(T x, T y) {
          return Cast<T>(BinaryFn<A>(op, Cast<A>(x), Cast<A>(y)));
        })) {
      err = LaunchElementwise<3>(ix, n, stream, [=] __device__(const int64_t(&off)[3]) {
        o[off[0]] = Cast<T>(BinaryFn<A>(op, Cast<A>(ap[off[1]]), Cast<A>(bp[off[2]])));
      });
    }
  });
  return err;
}

cudaError_t Clamp(const Indexing& ix, int64_t n, void* out, const void* x, double lo, double hi, Dt dt,
                  cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    using T = scalar_t;
    using A = acc_t<T>;
    T* o = static_cast<T*>(out);
    const T* xp = static_cast<const T*>(x);
    const A l = static_cast<A>(lo), h = static_cast<A>(hi);
    // As the CPU kernel: NaN fails both comparisons; lo > hi ends at hi.
    err = LaunchElementwise<2>(ix, n, stream, [=] __device__(const int64_t(&off)[2]) {
      const A v = Cast<A>(xp[off[1]]);
      const A t = v < l ? l : v;
      o[off[0]] = Cast<T>(t > h ? h : t);
    });
  });
  return err;
}

cudaError_t ClampBackward(const Indexing& ix, int64_t n, void* grad_in, const void* grad_out, const void* x,
                          double lo, double hi, Dt dt, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    using T = scalar_t;
    using A = acc_t<T>;
    T* gi = static_cast<T*>(grad_in);
    const T* go = static_cast<const T*>(grad_out);
    const T* xp = static_cast<const T*>(x);
    const A l = static_cast<A>(lo), h = static_cast<A>(hi);
    err = LaunchElementwise<3>(ix, n, stream, [=] __device__(const int64_t(&off)[3]) {
      const A v = Cast<A>(xp[off[2]]);
      gi[off[0]] = Cast<T>(v >= l && v <= h ? Cast<A>(go[off[1]]) : A(0));
    });
  });
  return err;
}

cudaError_t Affine(const Indexing& ix, int64_t n, void* out, const void* x, double alpha, double beta, Dt dt,
                   cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    using T = scalar_t;
    using A = acc_t<T>;
    T* o = static_cast<T*>(out);
    const T* xp = static_cast<const T*>(x);
    const A al = static_cast<A>(alpha), be = static_cast<A>(beta);
    err = LaunchElementwise<2>(ix, n, stream, [=] __device__(const int64_t(&off)[2]) {
      o[off[0]] = Cast<T>(al * Cast<A>(xp[off[1]]) + be);
    });
  });
  return err;
}

cudaError_t DivScalar(const Indexing& ix, int64_t n, void* out, const void* x, double s, Dt dt, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    using T = scalar_t;
    using A = acc_t<T>;
    T* o = static_cast<T*>(out);
    const T* xp = static_cast<const T*>(x);
    const A d = static_cast<A>(s);
    err = LaunchElementwise<2>(ix, n, stream, [=] __device__(const int64_t(&off)[2]) {
      o[off[0]] = Cast<T>(Cast<A>(xp[off[1]]) / d);
    });
  });
  return err;
}

cudaError_t AddScaled(const Indexing& ix, int64_t n, void* out, const void* x, double alpha, Dt dt,
                      cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    using T = scalar_t;
    using A = acc_t<T>;
    T* o = static_cast<T*>(out);
    const T* xp = static_cast<const T*>(x);
    const A al = static_cast<A>(alpha);
    err = LaunchElementwise<2>(ix, n, stream, [=] __device__(const int64_t(&off)[2]) {
      o[off[0]] = Cast<T>(Cast<A>(o[off[0]]) + al * Cast<A>(xp[off[1]]));
    });
  });
  return err;
}

cudaError_t MaskedScale(const Indexing& ix, int64_t n, void* out, const void* x, const uint8_t* mask, double scale,
                        Dt dt, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  DDP_CUDA_DISPATCH_FLOATING(dt, {
    using T = scalar_t;
    using A = acc_t<T>;
    T* o = static_cast<T*>(out);
    const T* xp = static_cast<const T*>(x);
    const A s = static_cast<A>(scale);
    err = LaunchElementwise<3>(ix, n, stream, [=] __device__(const int64_t(&off)[3]) {
      o[off[0]] = Cast<T>(Cast<A>(xp[off[1]]) * (mask[off[2]] ? s : A(0)));
    });
  });
  return err;
}

// Stores `value`'s bits as an unsigned integer U of the element's width: no
// conversion on the device, so each dtype gets the host's bits.
template <typename U>
cudaError_t FillBits(const Indexing& ix, int64_t n, void* dst, const void* value, cudaStream_t stream) {
  U v;
  std::memcpy(&v, value, sizeof(v));
  U* d = static_cast<U*>(dst);
  return LaunchElementwise<1>(ix, n, stream, [=] __device__(const int64_t(&off)[1]) { d[off[0]] = v; });
}

cudaError_t Fill(const Indexing& ix, int64_t n, void* dst, const void* value, int element_size,
                 cudaStream_t stream) {
  switch (element_size) {
    case 1: return FillBits<uint8_t>(ix, n, dst, value, stream);
    case 2: return FillBits<uint16_t>(ix, n, dst, value, stream);
    case 4: return FillBits<uint32_t>(ix, n, dst, value, stream);
    case 8: return FillBits<uint64_t>(ix, n, dst, value, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t BernoulliMask(uint8_t* mask, int64_t n, double keep_prob, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  // 24-bit uniform draws, as on the CPU.
  const uint64_t threshold = static_cast<uint64_t>(keep_prob * 16777216.0);
  BernoulliKernel<<<device::GridFor(n), 256, 0, stream>>>(mask, n, threshold, seed);
  return cudaGetLastError();
}

}  // namespace ddp::nn::cuda::launch
