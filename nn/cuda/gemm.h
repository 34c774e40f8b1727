// Matrix products with cuBLAS (the KernelTable's gemm entry).
#pragma once

#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {

/// c[M,N] = alpha * a[M,K] @ b[K,N] + beta * c on a's CUDA device, in c's
/// dtype: f32 (TF32 only when AllowTf32()), f64, or f16/bf16 with f32
/// accumulation (cublasGemmEx). a and b are converted to c's dtype when they
/// differ; transposed views go to cuBLAS as transpose flags, other strides
/// are made contiguous first.
void Gemm(const Tensor& a, const Tensor& b, const Tensor& c, double alpha, double beta);

}  // namespace ddp::nn::cuda
