// Run-time settings of the CPU kernels: thread count, GEMM backend,
// convolution algorithm and subnormal flushing. Defaults come from the environment
// (DDP_NN_THREADS, DDP_NN_GEMM, DDP_NN_CONV) and can be changed by code.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ddp::nn::ops {

/// Threads used by one GEMM or convolution (default 1: one thread per rank,
/// ranks are the unit of parallelism; DDP_NN_THREADS overrides). Throws
/// std::invalid_argument outside [1, kMaxNumThreads].
inline constexpr int kMaxNumThreads = 4096;
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
/// Geometries (input shape with its batch size, kernel, stride, ...) whose
/// oneDNN primitives are cached now. At most kOneDnnConvCacheEntries: each
/// holds a forward and two backward primitives, and a run that meets many
/// shapes (images of varying sizes) evicts the least recently used. Room
/// for a ResNet-50's layers at four batch sizes (training, its last partial
/// batch, evaluation, its last) with no eviction.
inline constexpr int64_t kOneDnnConvCacheEntries = 256;
int64_t OneDnnConvCacheSize();

/// Whether f32/f64 arithmetic on the calling thread treats subnormal
/// numbers (below 1.2e-38 in f32) as zero, as torch.set_flush_denormal
/// does; threads started afterwards inherit the setting (threads already
/// running, such as OpenMP's, keep theirs). On x86 every operation that
/// reads or yields a subnormal takes a microcode assist about 100 times
/// slower than a normal one, and they are not rare in training: SGD momentum
/// of a weight whose gradient stays zero (an always-black pixel's) decays
/// through the subnormal range over ~150 steps. Measured: the Fashion-MNIST
/// MLP trains 20% faster on one rank with flushing (docs/benchmarks.md).
/// Off by default, as in PyTorch; the trainer turns it on
/// (--flush_denormal). Returns false where unsupported (not x86).
bool SetFlushDenormal(bool on);
bool GetFlushDenormal();

namespace internal {
/// The defaults above from their environment variables' text (null: unset).
/// A value that is not one the variable takes keeps the default and sets
/// `*problem` to a line naming the variable, the value and what it takes,
/// which the kernels print once, as a warning, at start-up.
int ThreadsFromEnvText(const char* text, std::string* problem);
GemmBackend GemmFromEnvText(const char* text, std::string* problem);
ConvAlgorithm ConvFromEnvText(const char* text, std::string* problem);
int64_t Im2colBytesFromEnvText(const char* text, std::string* problem);
}  // namespace internal

}  // namespace ddp::nn::ops
