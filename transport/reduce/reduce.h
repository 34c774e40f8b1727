#ifndef DDP_TRANSPORT_REDUCE_REDUCE_H_
#define DDP_TRANSPORT_REDUCE_REDUCE_H_

// CPU reduction kernels: the arithmetic on the hot path of every all-reduce.
//
// Shapes: every buffer is a flat vector of `count` elements of one DataType;
// element i of the result depends only on element i of the inputs.
//
// Semantics:
//   - f16 and bf16 are widened to f32, combined, and rounded back to
//     nearest-even on every call (so a chain of reductions rounds per step).
//   - kAvg reduces like kSum; the caller divides the final sum by the number
//     of ranks with DivideInPlace.
//   - Integer sum and prod wrap around (two's complement) instead of
//     overflowing into undefined behaviour.
//   - Floating max/min propagate NaN: if either input is NaN the result is
//     NaN (like torch.maximum, unlike std::fmax). They order -0 below +0
//     (IEEE 754-2019 maximum/minimum): max(+0, -0) = +0 and min(+0, -0) = -0
//     in either operand order.
//
// Buffers are aligned to their element size (no stronger alignment is
// assumed), and either do not overlap at all or are the same pointer
// (in-place); partial overlap is not supported.
//
// Kernels are chosen once per process from the CPU's features (AVX2, F16C);
// the generic versions are plain loops that the compiler vectorizes for the
// baseline ISA.

#include <cstddef>
#include <cstdint>

#include "transport/types.h"

namespace ddp::transport::reduce {

/// Instruction sets the kernels are built for.
enum class Isa : int {
  kGeneric = 0,  ///< Baseline x86-64 (or any other architecture).
  kAvx2 = 1,     ///< AVX2 + FMA + F16C.
};

/// The best Isa this CPU supports.
Isa DetectIsa();
/// "generic", "avx2".
const char* IsaName(Isa isa);

/// dst[i] = a[i] op b[i] for i in [0, count). dst may equal a or b or both,
/// and a may equal b.
using ReduceFn = void (*)(void* dst, const void* a, const void* b, size_t count);

/// The kernel for (dtype, op) on `isa` (DetectIsa() by default); never null
/// for valid enum values. Look it up once per collective, call it per chunk.
/// Every overload that takes an Isa aborts with a message naming it when
/// it is not an Isa value or this CPU lacks it (kAvx2 where DetectIsa()
/// is kGeneric, e.g. on aarch64).
ReduceFn GetReduceFn(DataType dtype, ReduceOp op);
ReduceFn GetReduceFn(DataType dtype, ReduceOp op, Isa isa);

/// inout[i] = inout[i] op in[i].
void Reduce(DataType dtype, ReduceOp op, void* inout, const void* in, size_t count);

/// dst[i] = a[i] op b[i] (dst, a and b may be the same pointer, any two
/// or all three).
void Reduce(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b,
            size_t count);

/// data[i] /= divisor: finishes kAvg. Floats divide (f16/bf16 in f32, then
/// rounded); integers truncate toward zero. divisor must be positive.
void DivideInPlace(DataType dtype, void* data, size_t count, int64_t divisor);
void DivideInPlace(DataType dtype, void* data, size_t count, int64_t divisor, Isa isa);

/// dst[i] = (a[i] + b[i]) / divisor (dst may equal a or b): the last fold
/// of kAvg and its division in one pass, with the same bits as
/// Reduce(kSum) followed by DivideInPlace. divisor must be positive.
void SumDivide(DataType dtype, void* dst, const void* a, const void* b, size_t count,
               int64_t divisor);
void SumDivide(DataType dtype, void* dst, const void* a, const void* b, size_t count,
               int64_t divisor, Isa isa);

/// data[i] *= factor. Floats: the product is computed in double and rounded
/// once to the element type (f32: what C++ `x *= factor` gives; f16 and
/// bf16: no intermediate rounding to f32). Integers: the double product
/// truncated toward zero and clamped to the type's range (NaN gives 0).
void ScaleInPlace(DataType dtype, void* data, size_t count, double factor);
void ScaleInPlace(DataType dtype, void* data, size_t count, double factor, Isa isa);

}  // namespace ddp::transport::reduce

#endif  // DDP_TRANSPORT_REDUCE_REDUCE_H_
