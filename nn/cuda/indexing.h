// Host-side construction of the kernels' index geometry from tensors.
#pragma once

#include <initializer_list>

#include "nn/cuda/launch.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {

/// The launch code of a dtype (same numbering).
inline launch::Dt ToDt(DType t) { return static_cast<launch::Dt>(static_cast<int8_t>(t)); }

/// Strides of t broadcast to `shape` (0 where t repeats), right-aligned as numpy does.
Shape BroadcastStridesTo(const Tensor& t, const Shape& shape);

/// Geometry for up to three operands over `shape`, each given by its strides
/// (same rank as shape). Size-1 dimensions are dropped and runs that are
/// contiguous in every operand merged, so the common cases become one
/// dimension (and `contiguous` when every stride is 1). Throws naming `op`
/// when more than launch::kMaxDims dimensions remain.
launch::Indexing MakeIndexing(const char* op, const Shape& shape, std::initializer_list<Shape> strides);

/// Geometry of summing x into out (same rank; each of out's sizes equals
/// x's or is 1, which sums that dimension). Throws naming both shapes otherwise.
launch::ReduceIndexing MakeSumToIndexing(const Tensor& x, const Tensor& out);

}  // namespace ddp::nn::cuda
