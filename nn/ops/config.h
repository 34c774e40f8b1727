// Run-time settings of the CPU kernels: thread count, GEMM backend and
// convolution algorithm. Defaults come from the environment
// (DDP_NN_THREADS, DDP_NN_GEMM, DDP_NN_CONV) and can be changed by code.
#pragma once

#include <cstdint>
#include <string_view>

namespace ddp::nn::ops {

/// Threads used by one GEMM or convolution (default 1: one thread per rank,
/// ranks are the unit of parallelism; DDP_NN_THREADS overrides).
void SetNumThreads(int threads);
int GetNumThreads();

/// Who computes f32 matrix products. OpenBLAS 0.3.21 does not recognize
/// recent Xeons (family 6 model 207) and falls back to its SSE3 "Prescott"
/// kernels (7 GF/s measured on one core), while oneDNN's sgemm JITs for the
/// CPU it finds (45-130 GF/s on the same core), so oneDNN is the default;
/// DDP_NN_GEMM=openblas selects cblas_sgemm. f64 always uses cblas_dgemm.
enum class GemmBackend : int8_t { kOneDnn = 0, kOpenBlas = 1 };
void SetGemmBackend(GemmBackend backend);
GemmBackend GetGemmBackend();

/// How conv2d runs on the CPU. kIm2col: unfold + GEMM, every dtype and
/// geometry. kOneDnn: oneDNN primitives (f32 only; other dtypes use im2col).
/// kAuto picks per shape by the measured rule documented in conv.cc.
/// DDP_NN_CONV=im2col|onednn|auto.
enum class ConvAlgorithm : int8_t { kAuto = 0, kIm2col = 1, kOneDnn = 2 };
void SetConvAlgorithm(ConvAlgorithm algorithm);
ConvAlgorithm GetConvAlgorithm();

}  // namespace ddp::nn::ops
