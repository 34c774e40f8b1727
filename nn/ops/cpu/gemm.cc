// Matrix products: c[M,N] = alpha * a[M,K] @ b[K,N] + beta * c. Operands may
// be transposed views (a unit stride in either dimension is passed to the
// BLAS as a transpose flag); anything else is copied to a contiguous buffer.
#include <cblas.h>
#include <dnnl.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "nn/ops/config.h"
#include "nn/ops/cpu/cpu_kernels.h"

extern "C" void omp_set_num_threads(int);  // libgomp, which oneDNN is built on

namespace ddp::nn::ops {

namespace {

int ThreadsFromEnv() {
  std::string problem;
  const int threads = internal::ThreadsFromEnvText(std::getenv("DDP_NN_THREADS"), &problem);
  if (!problem.empty()) std::fprintf(stderr, "[ddp] warning: %s\n", problem.c_str());
  return threads;
}

GemmBackend GemmFromEnv() {
  std::string problem;
  const GemmBackend backend = internal::GemmFromEnvText(std::getenv("DDP_NN_GEMM"), &problem);
  if (!problem.empty()) std::fprintf(stderr, "[ddp] warning: %s\n", problem.c_str());
  return backend;
}

std::atomic<int> g_threads{ThreadsFromEnv()};
std::atomic<int> g_thread_generation{0};
std::atomic<GemmBackend> g_gemm{GemmFromEnv()};
thread_local int tls_generation = -1;

}  // namespace

namespace internal {

int ThreadsFromEnvText(const char* text, std::string* problem) {
  if (text == nullptr) return 1;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || n < 1 || n > kMaxNumThreads) {
    *problem = "DDP_NN_THREADS=" + std::string(text) + " is not a thread count in [1, " +
               std::to_string(kMaxNumThreads) + "]; using 1 thread per GEMM and convolution";
    return 1;
  }
  return static_cast<int>(n);
}

GemmBackend GemmFromEnvText(const char* text, std::string* problem) {
  if (text == nullptr) return GemmBackend::kOneDnn;
  const std::string_view v(text);
  if (v == "openblas") return GemmBackend::kOpenBlas;
  if (v != "onednn") {
    *problem = "DDP_NN_GEMM=" + std::string(v) + " is neither onednn nor openblas; using onednn";
  }
  return GemmBackend::kOneDnn;
}

}  // namespace internal

void SetNumThreads(int threads) {
  // Past a few thousand, libgomp's team (each thread with its own stack)
  // cannot be made and the first GEMM crashes the process instead of failing.
  if (threads < 1 || threads > kMaxNumThreads) {
    throw std::invalid_argument("SetNumThreads: the thread count must be in [1, " + std::to_string(kMaxNumThreads) +
                                "], got " + std::to_string(threads));
  }
  g_threads = threads;
  ++g_thread_generation;
}
int GetNumThreads() { return g_threads; }
void SetGemmBackend(GemmBackend backend) { g_gemm = backend; }
GemmBackend GetGemmBackend() { return g_gemm; }

namespace cpu {

void EnsureThreadSettings() {
  const int gen = g_thread_generation.load(std::memory_order_relaxed);
  if (tls_generation == gen) return;
  // OpenMP's thread count is per calling thread, so each thread applies it once.
  openblas_set_num_threads(g_threads);
  omp_set_num_threads(g_threads);
  tls_generation = gen;
}

namespace {

// OpenBLAS's sizes are blasint (32 bits in Debian's build): a larger one
// would wrap into a wrong or negative size.
void CheckBlasSizes(const char* gemm, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc) {
  const std::pair<const char*, int64_t> sizes[] = {{"m", m},     {"n", n},     {"k", k},
                                                   {"lda", lda}, {"ldb", ldb}, {"ldc", ldc}};
  for (const auto& [name, size] : sizes) {
    if (size > std::numeric_limits<blasint>::max()) {
      throw std::length_error(std::string(gemm) + ": " + name + " = " + std::to_string(size) +
                              " exceeds OpenBLAS's limit of " + std::to_string(std::numeric_limits<blasint>::max()));
    }
  }
}

// K = 0: op(A) op(B) is an M x N matrix of zeros, so C = beta * C, and with
// beta 0 the BLAS contract is C = 0 without reading C (NaN or garbage there
// becomes 0). Neither A nor B is read, nor handed to a BLAS: with K = 0
// their leading dimensions may be 0 (an im2col of 0 input channels passes
// lda = 0), which oneDNN refuses as an invalid argument.
template <typename T>
void ScaleOnly(int64_t m, int64_t n, T beta, T* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    T* row = c + i * ldc;
    if (beta == T(0)) {
      std::fill(row, row + n, T(0));
    } else if (beta != T(1)) {
      for (int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
  }
}

std::string GemmArgs(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                     int64_t ldc) {
  return std::string("trans_a = ") + (trans_a ? "T" : "N") + ", trans_b = " + (trans_b ? "T" : "N") +
         ", m = " + std::to_string(m) + ", n = " + std::to_string(n) + ", k = " + std::to_string(k) +
         ", lda = " + std::to_string(lda) + ", ldb = " + std::to_string(ldb) + ", ldc = " + std::to_string(ldc);
}

}  // namespace

void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    ScaleOnly(m, n, beta, c, ldc);
    return;
  }
  EnsureThreadSettings();
  if (g_gemm.load(std::memory_order_relaxed) == GemmBackend::kOneDnn) {
    const dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb,
                                        beta, c, ldc);
    if (st != dnnl_success) {
      throw std::runtime_error("sgemm: oneDNN's dnnl_sgemm failed with status " + std::to_string(st) + " for " +
                               GemmArgs(trans_a, trans_b, m, n, k, lda, ldb, ldc));
    }
  } else {
    CheckBlasSizes("sgemm", m, n, k, lda, ldb, ldc);
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
                static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
  }
}

void Dgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
           int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    ScaleOnly(m, n, beta, c, ldc);
    return;
  }
  CheckBlasSizes("dgemm", m, n, k, lda, ldb, ldc);
  EnsureThreadSettings();
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

namespace {

// A 2-D operand as the BLAS sees it.
struct Operand {
  const void* data;
  bool trans;
  int64_t ld;
  Tensor holder;  // keeps a copied buffer alive
};

Operand Describe(const Tensor& t, DType want) {
  Tensor src = t;
  if (src.dtype() != want) src = t.Detach().To(want);
  const int64_t r = src.size(0), c = src.size(1), s0 = src.stride(0), s1 = src.stride(1);
  if ((c == 1 || s1 == 1) && (r == 1 || s0 >= std::max<int64_t>(c, 1))) {
    return {src.data_ptr(), false, r == 1 ? std::max<int64_t>(c, 1) : std::max<int64_t>(s0, 1), src};
  }
  if ((r == 1 || s0 == 1) && (c == 1 || s1 >= std::max<int64_t>(r, 1))) {
    return {src.data_ptr(), true, c == 1 ? std::max<int64_t>(r, 1) : std::max<int64_t>(s1, 1), src};
  }
  Tensor copy = src.Detach().Contiguous();
  return {copy.data_ptr(), false, std::max<int64_t>(c, 1), copy};
}

}  // namespace

void Gemm(const Tensor& a, const Tensor& b, const Tensor& c, double alpha, double beta) {
  if (a.dim() != 2 || b.dim() != 2 || c.dim() != 2 || a.size(1) != b.size(0) || c.size(0) != a.size(0) ||
      c.size(1) != b.size(1)) {
    throw std::invalid_argument("gemm: shapes " + ShapeToString(a.shape()) + " @ " + ShapeToString(b.shape()) +
                                " -> " + ShapeToString(c.shape()) + " do not chain");
  }
  const int64_t m = c.size(0), n = c.size(1), k = a.size(1);
  if (m == 0 || n == 0) return;
  const DType out = c.dtype();
  const DType compute = out == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  // The result goes straight into c when the BLAS can address it.
  const bool direct = out == compute && (n == 1 || c.stride(1) == 1) && (m == 1 || c.stride(0) >= n);
  Tensor cc = c;
  if (!direct) {
    cc = Empty({m, n}, {.dtype = compute});
    if (beta != 0) {
      NoGradGuard guard;
      cc.CopyFrom(c);
    }
  }
  const int64_t ldc = direct ? (m == 1 ? std::max<int64_t>(n, 1) : c.stride(0)) : n;
  if (k == 0) {
    NoGradGuard guard;
    if (beta == 0) cc.Zero(); else Affine(cc, beta, -0.0, cc);  // -0.0 keeps -0 (see ops::MulScalar)
  } else {
    const Operand oa = Describe(a, compute), ob = Describe(b, compute);
    if (compute == DType::kFloat32) {
      Sgemm(oa.trans, ob.trans, m, n, k, static_cast<float>(alpha), static_cast<const float*>(oa.data), oa.ld,
            static_cast<const float*>(ob.data), ob.ld, static_cast<float>(beta), static_cast<float*>(cc.data_ptr()),
            ldc);
    } else {
      Dgemm(oa.trans, ob.trans, m, n, k, alpha, static_cast<const double*>(oa.data), oa.ld,
            static_cast<const double*>(ob.data), ob.ld, beta, static_cast<double*>(cc.data_ptr()), ldc);
    }
  }
  c.storage()->BumpVersion();
  if (!direct) {
    NoGradGuard guard;
    c.CopyFrom(cc);
  }
}

}  // namespace cpu
}  // namespace ddp::nn::ops
