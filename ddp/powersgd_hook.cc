#include "ddp/powersgd_hook.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "nn/tensor/generator.h"

namespace ddp::dist {
namespace {

// How one tensor of a bucket travels. Offsets are in elements: `offset`
// into the bucket, the others into the bucket state's arrays.
struct TensorPlan {
  int64_t offset = 0;
  int64_t numel = 0;
  int64_t rows = 0, cols = 0;  // n, m of the matrix view
  int64_t rank = 0;            // r; 0: reduced exactly
  int64_t exact_at = 0;        // into BucketState::wire (exact tensors)
  int64_t p_at = 0;            // into BucketState::wire (P^T, [r, n])
  int64_t q_at = 0;            // into BucketState::qs (Q^T, [r, m])
  int64_t residual_at = 0;     // into BucketState::residuals ([n, m])
  bool compressed() const { return rank > 0; }
};

// With error feedback, M and P Q^T are formed this many rows at a time and
// each block used while it is in cache: whole-tensor steps would read or
// write every gradient once more each (the hook is memory-bound at small r).
constexpr int64_t kRowBlock = 32;

// The longest vector or matrix side the BLAS takes: Debian's OpenBLAS counts
// in 32-bit ints, and a longer one would wrap.
constexpr int64_t kBlasMost = sizeof(blasint) >= 8 ? INT64_MAX : INT32_MAX;

TensorPlan PlanTensor(const nn::Shape& shape, const PowerSgdOptions& options) {
  TensorPlan plan;
  plan.numel = 1;
  for (int64_t d : shape) plan.numel *= d;
  if (shape.size() < 2 || plan.numel == 0) return plan;
  const int64_t n = shape[0], m = plan.numel / n;
  const int64_t r = std::min<int64_t>({options.matrix_approximation_rank, n, m});
  // In doubles: n m and (n + m) r overflow nothing here, and the rate is
  // fractional.
  // Sent exactly: a matrix whose rows, or blocks of kRowBlock rows, pass
  // what the BLAS can count (it would compute on a wrapped size).
  if (n > kBlasMost || m > kBlasMost / kRowBlock) return plan;
  if (static_cast<double>(n) * static_cast<double>(m) >
      options.min_compression_rate * static_cast<double>(n + m) * static_cast<double>(r)) {
    plan.rows = n;
    plan.cols = m;
    plan.rank = r;
  }
  return plan;
}

// Whether every one of x[0, n) is finite (no inf, no NaN).
template <typename T>
bool AllFinite(const T* x, int64_t n) {
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(x[i]);
  return finite;
}

// ---------------------------------------------------------------- BLAS ----
// Row-major, no scaling of C (beta = 0): C = op(A) op(B).

void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const float* b, int64_t ldb, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), 0.0f, c, static_cast<blasint>(ldc));
}
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double* a, int64_t lda,
          const double* b, int64_t ldb, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), 1.0, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), 0.0, c, static_cast<blasint>(ldc));
}
void Axpy(int64_t n, float a, const float* x, float* y) { cblas_saxpy(static_cast<blasint>(n), a, x, 1, y, 1); }
void Axpy(int64_t n, double a, const double* x, double* y) { cblas_daxpy(static_cast<blasint>(n), a, x, 1, y, 1); }

// ------------------------------------------------ the same on every rank ----
// What runs on all-reduced values (P and Q, identical on every rank) must
// round identically on every rank, or the replicas drift apart with no
// error: the BLAS picks its kernels by CPU and splits work by its thread
// count (OPENBLAS_NUM_THREADS), either of which can change the order of a
// sum. These loops fix the order; the compiler keeps it (no -ffast-math,
// and every rank runs the same binary).

// sum of x[i] y[i], i ascending, accumulated in T.
template <typename T>
T FixedDot(int64_t n, const T* x, const T* y) {
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

// y += a x.
template <typename T>
void FixedAxpy(int64_t n, T a, const T* x, T* y) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// The Euclidean norm without overflow or underflow of the squares: the
// values are scaled by a power of two (exact) that brings the largest into
// [0.5, 1) and squared in double. NaN when x holds a NaN, inf when an inf.
template <typename T>
T FixedNorm(int64_t n, const T* x) {
  T largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return x[i];
    largest = std::max(largest, std::abs(x[i]));
  }
  if (largest == 0 || std::isinf(largest)) return largest;
  int exponent = 0;
  std::frexp(largest, &exponent);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = std::ldexp(static_cast<double>(x[i]), -exponent);
    sum += v * v;
  }
  return static_cast<T>(std::ldexp(std::sqrt(sum), exponent));
}

template <typename T>
void FixedScale(int64_t n, T a, T* x) {
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

// C [rows, cols] = A^T B with A [rank, lda] (columns from `a`) and B [rank,
// cols]: each element a sum over k ascending. For P Q^T, the largest
// product after the all-reduces; vectorized across a row of C, which leaves
// each element's order alone.
template <typename T>
void FixedOuterSum(int64_t rows, int64_t cols, int64_t rank, const T* a, int64_t lda, const T* b, int64_t ldb,
                   T* c, int64_t ldc) {
  for (int64_t i = 0; i < rows; ++i) {
    T* out = c + i * ldc;
    const T first = a[i];
    const T* b0 = b;
    for (int64_t j = 0; j < cols; ++j) out[j] = first * b0[j];
    for (int64_t k = 1; k < rank; ++k) {
      const T factor = a[k * lda + i];
      const T* bk = b + k * ldb;
      for (int64_t j = 0; j < cols; ++j) out[j] += factor * bk[j];
    }
  }
}

// a: [rows, len], row-major; its rows become orthonormal, or zero where a
// row depends on the ones before it (the columns of P and Q are kept as
// rows of P^T and Q^T so that this walks contiguous memory). Modified
// Gram-Schmidt, each projection done twice, and Kahan and Parlett's test:
// a row that loses most of what was left of it in the second pass lies in
// the span of the earlier rows (up to rounding) and is set to zero. Without
// that, a gradient of rank k < r (at most the batch size; dead units make
// zero rows) leaves rows of pure rounding noise inside the earlier rows'
// span, and normalizing them makes P far from orthonormal: full-rank
// settings on a real MLP gave gradients wrong by 90%. A zero row costs
// nothing: its column of Q is zero too. A row whose norm is not finite
// (NaN or inf in it) is zeroed as well: normalized, it would make every
// later product with it NaN.
template <typename T>
void OrthonormalizeRows(T* a, int64_t rows, int64_t len, T epsilon) {
  for (int64_t j = 0; j < rows; ++j) {
    T* row = a + j * len;
    T norm[2] = {0, 0};
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t i = 0; i < j; ++i) {
        const T* done = a + i * len;
        FixedAxpy(len, -FixedDot(len, done, row), done, row);
      }
      norm[pass] = FixedNorm(len, row);
    }
    // Written so that a NaN norm fails it (NaN compares false).
    const bool independent = std::isfinite(norm[1]) && norm[1] > 0 && norm[1] >= T(0.5) * norm[0];
    if (!independent) {
      std::fill(row, row + len, T(0));
      continue;
    }
    T inverse = T(1) / (norm[1] + epsilon);
    if (!std::isfinite(inverse)) {
      // A norm below 1 / max (about 2.9e-39 in f32: tiny gradients, or a
      // warm-start Q of a small gradient times that gradient) has no finite
      // reciprocal; scaled by it the row was inf and NaN, and the bucket
      // went uncompressed at every step. Bring the norm into [0.5, 1) by a
      // power of two first, which is exact; the result is the same
      // row / (norm + epsilon).
      int exponent = 0;
      std::frexp(norm[1], &exponent);
      for (int64_t i = 0; i < len; ++i) row[i] = std::ldexp(row[i], -exponent);
      inverse = T(1) / (std::ldexp(norm[1], -exponent) + std::ldexp(epsilon, -exponent));
    }
    FixedScale(len, inverse, row);
  }
}

uint64_t Mix(uint64_t h, uint64_t v) {
  // SplitMix64's finalizer over the running hash and the next value.
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Mixed last into the seed of a row of Q drawn again (RedrawZeroRows).
constexpr uint64_t kRedrawStream = 0x7265647261770000ull;  // "redraw"

// ------------------------------------------------------- bucket state ----

// What the hook keeps for one bucket between iterations; touched only on
// the communication thread.
struct BucketState {
  // The bucket the state was built for; another one rebuilds it
  // (RebuildBucketState). `params` are the parameters' tensor objects: two
  // parameters of one shape that trade places leave shapes and offsets as
  // they were.
  std::vector<nn::Shape> shapes;
  std::vector<int64_t> offsets;
  std::vector<const nn::TensorImpl*> params;
  // The same parameters, held weakly: once a parameter is freed, a new
  // tensor (of another model, another shape) may get its address, and the
  // state kept under that address is not the new tensor's.
  std::vector<std::weak_ptr<nn::TensorImpl>> owners;
  nn::DType dtype = nn::DType::kFloat32;

  std::vector<TensorPlan> plans;
  bool any_compressed = false;
  bool q_ready = false;
  // The last iteration whose task used this state (-1: none yet).
  int64_t used_at = -1;
  int64_t ps_at = 0;     // into wire: where the P^T's begin
  int64_t flag_at = 0;   // into wire: 1 where this rank's M is not all finite
  nn::Tensor wire;       // [exact tensors..., P^T of each compressed tensor, flag]
  nn::Tensor qs;         // Q^T of each compressed tensor
  nn::Tensor residuals;  // error feedback: [n, m] per compressed tensor
  nn::Tensor scratch;    // error feedback: kRowBlock rows of P Q^T
};

nn::Tensor Buffer(int64_t n, nn::DType dtype, bool zero) {
  const nn::Shape shape{std::max<int64_t>(n, 1)};
  return zero ? nn::Zeros(shape, {.dtype = dtype}) : nn::Empty(shape, {.dtype = dtype});
}

void BuildBucketState(BucketState& b, std::vector<nn::Shape> shapes, std::vector<int64_t> offsets,
                      nn::DType dtype, const PowerSgdOptions& options) {
  b = BucketState{};
  b.plans.reserve(shapes.size());
  int64_t exact = 0, p = 0, q = 0, residual = 0, widest = 0;
  for (size_t t = 0; t < shapes.size(); ++t) {
    TensorPlan plan = PlanTensor(shapes[t], options);
    plan.offset = offsets[t];
    if (plan.compressed()) {
      plan.p_at = p;
      plan.q_at = q;
      plan.residual_at = residual;
      p += plan.rank * plan.rows;
      q += plan.rank * plan.cols;
      residual += plan.numel;
      widest = std::max(widest, plan.cols);
      b.any_compressed = true;
    } else {
      plan.exact_at = exact;
      exact += plan.numel;
    }
    b.plans.push_back(plan);
  }
  // P^T's follow the exact tensors in the first all-reduce.
  for (TensorPlan& plan : b.plans) {
    if (plan.compressed()) plan.p_at += exact;
  }
  // A bucket with nothing to compress is all-reduced in place.
  if (!b.any_compressed) exact = 0;
  // One element more: the finiteness flag (SendUncompressed).
  b.ps_at = exact;
  b.flag_at = exact + p;
  b.wire = Buffer(exact + p + 1, dtype, false);
  b.qs = Buffer(q, dtype, false);
  if (options.use_error_feedback) {
    b.residuals = Buffer(residual, dtype, true);
    b.scratch = Buffer(kRowBlock * widest, dtype, false);
  }
  b.shapes = std::move(shapes);
  b.offsets = std::move(offsets);
  b.dtype = dtype;
}

// Builds b for another bucket (DDP rebuilds its buckets once, in the order
// the gradients arrived, so parameters move). Each compressed tensor's Q and
// residual follow its parameter to its new place when every compressed
// tensor of the new bucket was compressed in the old one, with the same
// plan; otherwise the bucket starts over (a fresh Q, zero residuals). Kept
// by place alone, two parameters of one shape that traded places got each
// other's residual and Q. Every rank has the same buckets, so every rank
// takes the same branch.
void RebuildBucketState(BucketState& b, std::vector<nn::Shape> shapes, std::vector<int64_t> offsets,
                        std::vector<const nn::TensorImpl*> params, std::vector<std::weak_ptr<nn::TensorImpl>> owners,
                        nn::DType dtype, const PowerSgdOptions& options) {
  BucketState old = std::move(b);
  BuildBucketState(b, std::move(shapes), std::move(offsets), dtype, options);
  b.params = std::move(params);
  b.owners = std::move(owners);
  if (old.dtype != dtype || !old.any_compressed) return;
  // from[t]: the old place of the new bucket's compressed tensor t.
  std::vector<size_t> from(b.plans.size(), 0);
  for (size_t t = 0; t < b.plans.size(); ++t) {
    if (!b.plans[t].compressed()) continue;
    const auto it = std::find(old.params.begin(), old.params.end(), b.params[t]);
    if (it == old.params.end()) return;
    from[t] = static_cast<size_t>(it - old.params.begin());
    // The old tensor was freed and this is a new one at its address.
    if (old.owners[from[t]].expired()) return;
    const TensorPlan& was = old.plans[from[t]];
    const TensorPlan& now = b.plans[t];
    if (!was.compressed() || was.rows != now.rows || was.cols != now.cols || was.rank != now.rank) return;
  }
  const size_t elem = nn::ElementSize(dtype);
  for (size_t t = 0; t < b.plans.size(); ++t) {
    const TensorPlan& now = b.plans[t];
    if (!now.compressed()) continue;
    const TensorPlan& was = old.plans[from[t]];
    std::memcpy(static_cast<char*>(b.qs.data_ptr()) + now.q_at * elem,
                static_cast<const char*>(old.qs.data_ptr()) + was.q_at * elem,
                static_cast<size_t>(now.rank * now.cols) * elem);
    if (options.use_error_feedback) {
      std::memcpy(static_cast<char*>(b.residuals.data_ptr()) + now.residual_at * elem,
                  static_cast<const char*>(old.residuals.data_ptr()) + was.residual_at * elem,
                  static_cast<size_t>(now.numel) * elem);
    }
  }
  b.q_ready = old.q_ready;
}

// A row of Q^T that came out all zero (its row of P^T was zeroed: the
// gradient was zero, or of lower rank than r, this iteration) would stay
// zero as a warm start forever: P^T = Q^T M^T and Q^T = P^T M keep a zero
// row zero, so that direction never returned (a parameter unused once kept
// a zero gradient, and with error feedback its residual grew without end).
// Such rows are drawn again, from the seed, the bucket, the tensor and the
// iteration (the same on every rank, as the summed Q is), and Q^T's rows
// made orthonormal again. After the approximation of this iteration, which
// they would not have changed (their rows of P^T are zero). A row with a
// value that is not finite is drawn again too (a bucket whose summed Q is
// not finite is sent uncompressed and its Q dropped; this is the last line
// of defence for the warm start).
template <typename T>
void RedrawZeroRows(BucketState& b, size_t bucket_index, int64_t iteration, uint64_t seed) {
  T* qs = b.qs.data<T>();
  for (size_t t = 0; t < b.plans.size(); ++t) {
    const TensorPlan& plan = b.plans[t];
    if (!plan.compressed()) continue;
    T* q = qs + plan.q_at;
    bool redrawn = false;
    for (int64_t j = 0; j < plan.rank; ++j) {
      T* row = q + j * plan.cols;
      if (AllFinite(row, plan.cols) && std::any_of(row, row + plan.cols, [](T v) { return v != T(0); })) continue;
      // Another stream than the initial draw's (which ends in 0, or in
      // iteration + 1 without warm start).
      nn::Generator gen(Mix(Mix(Mix(Mix(Mix(seed, bucket_index), t), iteration + 1), j), kRedrawStream));
      for (int64_t i = 0; i < plan.cols; ++i) row[i] = static_cast<T>(gen.NextNormal());
      redrawn = true;
    }
    if (redrawn) OrthonormalizeRows(q, plan.rank, plan.cols, T(0));
  }
}

// (data, count, what) -> the sum over ranks, in place.
using AllReduceFn = std::function<transport::Status(void* data, int64_t count, const char* what)>;

// A bucket in which some rank's M (gradient plus residual) of a compressed
// tensor, or the summed P or Q, holds an inf or a NaN: compressed, the NaN
// would spread into Q and the residuals, which are kept, and every later
// gradient of the bucket would be NaN, even after a GradScaler skipped the
// step. Every rank decides this from all-reduced values alone, so all take
// this path together. The bucket is all-reduced as it is: the exact tensors
// as the local gradients, the compressed ones as M, so the inf or NaN reaches
// .grad (a GradScaler sees it and skips the step) and what the residuals
// held is delivered in full; the residuals are then zero and Q is drawn
// afresh at the next call, the state of a bucket the hook has not seen.
template <typename T>
transport::Status SendUncompressed(BucketState& b, T* grads, int64_t grads_numel, const PowerSgdOptions& options,
                                   const AllReduceFn& all_reduce) {
  if (options.use_error_feedback) {
    T* residuals = b.residuals.data<T>();
    std::fill(residuals, residuals + b.residuals.numel(), T(0));
  }
  b.q_ready = false;
  return all_reduce(grads, grads_numel, "the bucket uncompressed (a value was not finite)");
}

// What comes next in one hook call's reduction of a bucket. The call runs
// as up to three tasks of the group, one per all-reduce, so that each
// all-reduce gets a deadline of its own, counted from when it starts, as
// every collective does: in one task, a peer late to the P all-reduce by
// most of the timeout left the Q all-reduce none. Every rank decides the
// next step from all-reduced values (or from the bucket's layout), so all
// take the same one.
enum class Step {
  kQ,             // make P orthonormal, form Q, all-reduce it
  kUncompressed,  // a value was not finite: all-reduce the bucket as it is
  kFinish,        // P Q^T into the bucket, the residuals (no all-reduce)
  kDone,
};

// What the tasks of one hook call hand on to each other.
struct BucketCall {
  BucketState* bucket = nullptr;  // set by the first task
  Step next = Step::kDone;
  bool failed = true;  // from a task's start until it returns OK
};

// The first step: M (gradient plus residual) and P, all-reduced with the
// exact tensors; a bucket with nothing to compress is all-reduced as it
// is. grads: the bucket, this rank's already divided gradients in; the
// sum over ranks (approximated) out once the last step has run.
template <typename T>
transport::Status SendP(BucketState& b, T* grads, int64_t grads_numel, const PowerSgdOptions& options,
                        size_t bucket_index, int64_t iteration, const AllReduceFn& all_reduce, Step& next) {
  next = Step::kDone;
  if (!b.any_compressed) return all_reduce(grads, grads_numel, "exact tensors");
  T* wire = b.wire.data<T>();
  T* qs = b.qs.data<T>();
  const bool feedback = options.use_error_feedback;
  if (!b.q_ready || !options.warm_start) {
    // Same seed on every rank: Q agrees without being sent. Without warm
    // start every iteration draws a new one.
    for (size_t t = 0; t < b.plans.size(); ++t) {
      const TensorPlan& plan = b.plans[t];
      if (!plan.compressed()) continue;
      uint64_t seed = Mix(Mix(Mix(options.seed, bucket_index), t), options.warm_start ? 0 : iteration + 1);
      nn::Generator gen(seed);
      T* q = qs + plan.q_at;
      for (int64_t i = 0; i < plan.rank * plan.cols; ++i) q[i] = static_cast<T>(gen.NextNormal());
      OrthonormalizeRows(q, plan.rank, plan.cols, T(0));
    }
    b.q_ready = true;
  }

  // M: grads [n, m];  P^T [r, n] = Q^T [r, m] . M^T.
  bool finite = true;
  for (const TensorPlan& plan : b.plans) {
    T* g = grads + plan.offset;
    if (!plan.compressed()) {
      std::memcpy(wire + plan.exact_at, g, static_cast<size_t>(plan.numel) * sizeof(T));
      continue;
    }
    if (!feedback) {
      finite &= AllFinite(g, plan.numel);
      Gemm(false, true, plan.rank, plan.rows, plan.cols, qs + plan.q_at, plan.cols, g, plan.cols, wire + plan.p_at,
           plan.rows);
      continue;
    }
    // M = gradient + residual, then its block's columns of P^T while the
    // block is still in cache.
    const T* residual = b.residuals.data<T>() + plan.residual_at;
    for (int64_t row = 0; row < plan.rows; row += kRowBlock) {
      const int64_t block = std::min(kRowBlock, plan.rows - row);
      const int64_t at = row * plan.cols;
      Axpy(block * plan.cols, T(1), residual + at, g + at);
      finite &= AllFinite(g + at, block * plan.cols);
      Gemm(false, true, plan.rank, block, plan.cols, qs + plan.q_at, plan.cols, g + at, plan.cols,
           wire + plan.p_at + row, plan.rows);
    }
  }
  // sum_ranks(M_i Q) = (sum_ranks M_i) Q: the P of the summed gradient.
  // The flags' sum counts the ranks whose M is not all finite (a NaN or
  // inf in M need not reach P: BLAS may skip a zero of Q).
  wire[b.flag_at] = finite ? T(0) : T(1);
  transport::Status s = all_reduce(wire, b.wire.numel(), "P and the exact tensors");
  if (!s.ok()) return s;
  const bool sent_finite = wire[b.flag_at] == T(0) && AllFinite(wire + b.ps_at, b.flag_at - b.ps_at);
  next = sent_finite ? Step::kQ : Step::kUncompressed;
  return transport::Status::Ok();
}

// The second step: Q^T [r, m] = P^T [r, n] . M [n, m], with P orthonormal,
// all-reduced. The exact tensors' sums stay in the wire until Q is known
// to be finite: until then the bucket must still hold what
// SendUncompressed sends.
template <typename T>
transport::Status SendQ(BucketState& b, T* grads, const PowerSgdOptions& options, const AllReduceFn& all_reduce,
                        Step& next) {
  T* wire = b.wire.data<T>();
  T* qs = b.qs.data<T>();
  for (const TensorPlan& plan : b.plans) {
    if (!plan.compressed()) continue;
    T* g = grads + plan.offset;
    T* pt = wire + plan.p_at;
    OrthonormalizeRows(pt, plan.rank, plan.rows, static_cast<T>(options.orthogonalization_epsilon));
    Gemm(false, false, plan.rank, plan.cols, plan.rows, pt, plan.rows, g, plan.cols, qs + plan.q_at, plan.cols);
  }
  // sum_ranks(M_i^T P) = (sum_ranks M_i)^T P; kept as the next warm start.
  transport::Status s = all_reduce(qs, b.qs.numel(), "Q");
  if (!s.ok()) return s;
  // Finite M's can still sum past the largest float.
  next = AllFinite(qs, b.qs.numel()) ? Step::kFinish : Step::kUncompressed;
  return transport::Status::Ok();
}

// The last step: the exact tensors' sums and P Q^T into the bucket, and
// this rank's residuals.
template <typename T>
void Finish(BucketState& b, T* grads, const PowerSgdOptions& options, int world, size_t bucket_index,
            int64_t iteration) {
  const T* wire = b.wire.data<T>();
  const T* qs = b.qs.data<T>();
  const bool feedback = options.use_error_feedback;
  // The sum's approximation: P Q^T [n, m] = (P^T)^T [n, r] . Q^T [r, m].
  const T inv_world = T(1) / static_cast<T>(world);
  for (const TensorPlan& plan : b.plans) {
    T* g = grads + plan.offset;
    if (!plan.compressed()) {
      std::memcpy(g, wire + plan.exact_at, static_cast<size_t>(plan.numel) * sizeof(T));
      continue;
    }
    const T* pt = wire + plan.p_at;
    const T* qt = qs + plan.q_at;
    if (!feedback) {
      FixedOuterSum(plan.rows, plan.cols, plan.rank, pt, plan.rows, qt, plan.cols, g, plan.cols);
      continue;
    }
    T* approx = b.scratch.data<T>();
    T* residual = b.residuals.data<T>() + plan.residual_at;
    for (int64_t row = 0; row < plan.rows; row += kRowBlock) {
      const int64_t block = std::min(kRowBlock, plan.rows - row);
      FixedOuterSum(block, plan.cols, plan.rank, pt + row, plan.rows, qt, plan.cols, approx, plan.cols);
      // This rank's share of what the sum lost: the residuals of all ranks
      // add up to sum M_i - P Q^T.
      const int64_t at = row * plan.cols;
      for (int64_t i = 0; i < block * plan.cols; ++i) {
        residual[at + i] = g[at + i] - approx[i] * inv_world;
        g[at + i] = approx[i];
      }
    }
  }
  if (options.warm_start) RedrawZeroRows<T>(b, bucket_index, iteration, options.seed);
}

// Runs the step after SendP that `next` names (nothing once done) and
// moves `next` on.
template <typename T>
transport::Status RunStep(BucketState& b, T* grads, int64_t grads_numel, const PowerSgdOptions& options, int world,
                          size_t bucket_index, int64_t iteration, const AllReduceFn& all_reduce, Step& next) {
  switch (next) {
    case Step::kQ:
      return SendQ(b, grads, options, all_reduce, next);
    case Step::kUncompressed:
      next = Step::kDone;
      return SendUncompressed(b, grads, grads_numel, options, all_reduce);
    case Step::kFinish:
      Finish(b, grads, options, world, bucket_index, iteration);
      next = Step::kDone;
      return transport::Status::Ok();
    case Step::kDone:
      break;
  }
  return transport::Status::Ok();
}

// A [shape] copy of n elements of `elem` bytes at `from`.
nn::Tensor CopyOut(const void* from, const nn::Shape& shape, nn::DType dtype) {
  nn::Tensor t = nn::Empty(shape, {.dtype = dtype});
  std::memcpy(t.data_ptr(), from, static_cast<size_t>(t.numel()) * nn::ElementSize(dtype));
  return t;
}

// A parameter's state loaded by LoadStateDict, not yet placed in its
// bucket (contiguous CPU tensors of the parameter's dtype; either may be
// undefined).
struct SavedTensorState {
  nn::Tensor q;         // Q^T [r, m]
  nn::Tensor residual;  // [n, m] as the parameter's shape
  // The parameter it was saved for (the map's key is its address, which a
  // new tensor may get once this one is freed).
  std::weak_ptr<nn::TensorImpl> owner;
};
using SavedStates = std::map<const nn::TensorImpl*, SavedTensorState>;

// Whether `saved` can go into b's compressed tensor t: it was saved for
// that very parameter (not for a freed one whose address it now has), in
// b's dtype (not before the model was converted), and its Q and residual
// have the sizes b's plan for t gives (the parameter's shape may have
// changed since, through Tensor::SetData). Copied unchecked, a state of
// another shape was read past its end into the bucket.
bool Fits(const SavedTensorState& saved, const BucketState& b, size_t t) {
  const TensorPlan& plan = b.plans[t];
  if (saved.owner.lock().get() != b.params[t]) return false;
  if (saved.q.defined() && (saved.q.dtype() != b.dtype || saved.q.shape() != nn::Shape{plan.rank, plan.cols})) {
    return false;
  }
  return !saved.residual.defined() ||
         (saved.residual.dtype() == b.dtype && saved.residual.shape() == b.shapes[t]);
}

// Drops the saved states of parameters freed since (a model destroyed after
// LoadStateDict, or after a rebuild carried its state here): no parameter
// can take them, and they held their Q and residual until the next
// LoadStateDict.
void DropFreed(SavedStates& pending) {
  for (auto it = pending.begin(); it != pending.end();) {
    it = it->second.owner.expired() ? pending.erase(it) : std::next(it);
  }
}

// Puts the loaded state of b's parameters into b, which was just built
// for its bucket, and forgets it (a later rebuild carries it by parameter,
// as any state). Q only when every compressed tensor of the bucket has
// one: the others' Q would be drawn, and drawing overwrites the bucket's
// whole Q. A state that does not fit its tensor (Fits) is dropped: that
// tensor starts as under a new hook (zero residual, and its bucket draws
// a fresh Q). Every rank loaded the same Q's of the same model, so every
// rank decides alike.
void ApplySaved(BucketState& b, SavedStates& pending, const PowerSgdOptions& options) {
  if (pending.empty() || !b.any_compressed) return;
  bool every_q = options.warm_start;
  for (size_t t = 0; t < b.plans.size(); ++t) {
    if (!b.plans[t].compressed()) continue;
    const auto it = pending.find(b.params[t]);
    if (it == pending.end() || !it->second.q.defined() || !Fits(it->second, b, t)) every_q = false;
  }
  const size_t elem = nn::ElementSize(b.dtype);
  for (size_t t = 0; t < b.plans.size(); ++t) {
    const TensorPlan& plan = b.plans[t];
    if (!plan.compressed()) continue;
    const auto it = pending.find(b.params[t]);
    if (it == pending.end()) continue;
    const SavedTensorState& saved = it->second;
    if (!Fits(saved, b, t)) {
      pending.erase(it);
      continue;
    }
    if (every_q) {
      std::memcpy(static_cast<char*>(b.qs.data_ptr()) + plan.q_at * elem, saved.q.data_ptr(),
                  static_cast<size_t>(plan.rank * plan.cols) * elem);
    }
    if (options.use_error_feedback && saved.residual.defined()) {
      std::memcpy(static_cast<char*>(b.residuals.data_ptr()) + plan.residual_at * elem, saved.residual.data_ptr(),
                  static_cast<size_t>(plan.numel) * elem);
    }
    pending.erase(it);
  }
  if (every_q) b.q_ready = true;
}

// When a bucket's layout changed (DDP rebuilds its buckets after the first
// iteration), its parameters may come from any old bucket, not only the one
// at the same index. So every bucket this iteration has not yet used is
// still laid out the old way: each compressed parameter's Q (when the
// bucket had one) and residual move into `pending`, by parameter, and the
// bucket is emptied; each bucket then takes its parameters' state back at
// its rebuild through ApplySaved, as after LoadStateDict. One copy of the
// residuals, once per rebuild. Every rank has the same buckets and the
// same Q's, so every rank carries the same Q's. Called with `mu` held, on
// the communication thread, which runs every bucket's task.
void MoveStaleStateToPending(std::map<size_t, BucketState>& buckets, SavedStates& pending, int64_t iteration,
                             const PowerSgdOptions& options);

// Moves one bucket's state into `pending` (see above) and empties it.
void MoveToPending(BucketState& old, SavedStates& pending, const PowerSgdOptions& options) {
  if (!old.any_compressed) return;
  const size_t elem = nn::ElementSize(old.dtype);
  for (size_t t = 0; t < old.plans.size(); ++t) {
    const TensorPlan& plan = old.plans[t];
    // A freed parameter's state goes with it.
    if (!plan.compressed() || old.owners[t].expired()) continue;
    SavedTensorState& saved = pending[old.params[t]];
    saved.owner = old.owners[t];
    if (options.warm_start && old.q_ready) {
      saved.q = CopyOut(static_cast<const char*>(old.qs.data_ptr()) + plan.q_at * elem, {plan.rank, plan.cols},
                        old.dtype);
    }
    if (options.use_error_feedback) {
      saved.residual = CopyOut(static_cast<const char*>(old.residuals.data_ptr()) + plan.residual_at * elem,
                               old.shapes[t], old.dtype);
    }
  }
  old = BucketState{};
}

void MoveStaleStateToPending(std::map<size_t, BucketState>& buckets, SavedStates& pending, int64_t iteration,
                             const PowerSgdOptions& options) {
  for (auto& [index, old] : buckets) {
    if (old.used_at < iteration) MoveToPending(old, pending, options);
  }
}

}  // namespace

// The hook's state, shared by the copies of the std::function.
struct PowerSgdState::Impl {
  explicit Impl(PowerSgdOptions o) : options(o) {}
  const PowerSgdOptions options;
  // Hook calls on the last bucket so far (the backward thread's).
  int64_t iteration = 0;
  // By bucket index. A BucketState is used by its bucket's task alone, on
  // the communication thread; the map itself also by the hook, which drops
  // the buckets that a rebuild into fewer left behind, so `mu` guards it,
  // and `pending`, which the tasks take from.
  mutable std::mutex mu;
  std::map<size_t, BucketState> buckets;
  SavedStates pending;
  // Whether a bucket past start_iteration was sent uncompressed (not f32
  // or f64, or not in host memory) and the note about it printed.
  std::atomic<bool> warned_uncompressed{false};
  // The hook copy (and group) this state serves: a second live wrapper is
  // refused, since its buckets of one index would overwrite the first's
  // (from another communication thread, on another group) and its
  // backward would count `iteration` too, unsynchronized.
  internal::StateAttachment attachment;
};

namespace {

void Require(bool ok, const char* option, const std::string& rule, double value) {
  if (ok) return;
  std::ostringstream message;
  message << "PowerSgdOptions::" << option << " must be " << rule << ", got " << value;
  throw std::invalid_argument(message.str());
}

}  // namespace

void ValidatePowerSgdOptions(const PowerSgdOptions& o) {
  Require(o.matrix_approximation_rank >= 1, "matrix_approximation_rank", "at least 1",
          o.matrix_approximation_rank);
  Require(o.start_iteration >= 0, "start_iteration", "at least 0", static_cast<double>(o.start_iteration));
  Require(std::isfinite(o.min_compression_rate) && o.min_compression_rate >= 0, "min_compression_rate",
          "a finite number >= 0", o.min_compression_rate);
  // f32 buckets add it in f32: above f32's largest value it would become
  // inf there, and every compressed column of those buckets zero.
  Require(std::isfinite(o.orthogonalization_epsilon) && o.orthogonalization_epsilon >= 0 &&
              o.orthogonalization_epsilon <= std::numeric_limits<float>::max(),
          "orthogonalization_epsilon", "a number >= 0 and at most f32's largest (3.40282e+38)",
          o.orthogonalization_epsilon);
}

int64_t PowerSgdElementsPerStep(const std::vector<nn::Shape>& shapes, const PowerSgdOptions& options) {
  ValidatePowerSgdOptions(options);
  int64_t total = 0;
  for (const nn::Shape& shape : shapes) {
    const TensorPlan plan = PlanTensor(shape, options);
    total += plan.compressed() ? (plan.rows + plan.cols) * plan.rank : plan.numel;
  }
  return total;
}


namespace {

constexpr char kIterationKey[] = "powersgd.iteration";
constexpr char kQPrefix[] = "powersgd.q.";
constexpr char kResidualPrefix[] = "powersgd.residual.";

[[noreturn]] void Refuse(const std::string& what) {
  throw std::invalid_argument("PowerSgdState.LoadStateDict: " + what);
}

bool StartsWith(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// A contiguous CPU copy of `t`, whose values must all be finite.
nn::Tensor FiniteCopy(const nn::Tensor& t, const std::string& key) {
  nn::Tensor c = t.To(nn::kCPU).Contiguous().Clone();
  const bool finite = c.dtype() == nn::DType::kFloat32 ? AllFinite(c.data<float>(), c.numel())
                                                       : AllFinite(c.data<double>(), c.numel());
  if (!finite) Refuse("`" + key + "` holds a value that is not finite");
  return c;
}

struct ParsedState {
  int64_t iteration = 0;
  SavedStates saved;
};

// LoadStateDict's checks: what it would load, or throws naming the key and
// what is wrong with it.
ParsedState ParseState(const PowerSgdState::NamedTensors& state, const PowerSgdState::NamedTensors& params,
                       const PowerSgdOptions& options) {
  std::map<std::string, const nn::Tensor*> by_name;
  for (const auto& [name, p] : params) by_name[name] = &p;
  ParsedState parsed;
  const nn::Tensor* iteration = nullptr;
  std::map<std::string, bool> seen;
  for (const auto& [key, t] : state) {
    if (!StartsWith(key, "powersgd.")) continue;
    if (seen[key]) Refuse("`" + key + "` appears twice");
    seen[key] = true;
    if (key == kIterationKey) {
      iteration = &t;
      continue;
    }
    const bool is_q = StartsWith(key, kQPrefix);
    const bool is_residual = StartsWith(key, kResidualPrefix);
    if (!is_q && !is_residual) {
      Refuse("unexpected `" + key + "` (PowerSGD's keys are `" + kIterationKey + "`, `" + kQPrefix + "<parameter>` and `" +
             kResidualPrefix + "<parameter>`)");
    }
    const std::string name = key.substr(std::string(is_q ? kQPrefix : kResidualPrefix).size());
    const auto found = by_name.find(name);
    if (found == by_name.end()) Refuse("`" + key + "` is for parameter `" + name + "`, which this model does not have");
    const nn::Tensor& p = *found->second;
    if (!p.defined() || !p.device().is_cpu() ||
        (p.dtype() != nn::DType::kFloat32 && p.dtype() != nn::DType::kFloat64)) {
      Refuse("`" + key + "`: parameter `" + name + "` is not compressed by the hook (only f32 and f64 parameters in " +
             "host memory are)");
    }
    const TensorPlan plan = PlanTensor(p.shape(), options);
    if (!plan.compressed()) {
      Refuse("`" + key + "`: parameter `" + name + "` " + nn::ShapeToString(p.shape()) +
             " is not compressed under these options (matrix_approximation_rank " +
             std::to_string(options.matrix_approximation_rank) + ", min_compression_rate " +
             std::to_string(options.min_compression_rate) + ")");
    }
    if (!t.defined()) Refuse("`" + key + "` is undefined");
    if (t.dtype() != p.dtype()) {
      Refuse("`" + key + "` is " + std::string(nn::DTypeName(t.dtype())) + ", parameter `" + name + "` is " +
             std::string(nn::DTypeName(p.dtype())));
    }
    SavedTensorState& entry = parsed.saved[p.impl()];
    entry.owner = p.impl_ptr();
    if (is_q) {
      if (!options.warm_start) Refuse("`" + key + "` holds a warm-start Q, and these options have warm_start off");
      const nn::Shape want{plan.rank, plan.cols};
      if (t.shape() != want) {
        Refuse("`" + key + "` is " + nn::ShapeToString(t.shape()) + ", parameter `" + name + "` " +
               nn::ShapeToString(p.shape()) + " needs Q^T " + nn::ShapeToString(want) +
               " under matrix_approximation_rank " + std::to_string(options.matrix_approximation_rank));
      }
      entry.q = FiniteCopy(t, key);
    } else {
      if (!options.use_error_feedback) {
        Refuse("`" + key + "` holds a residual, and these options have use_error_feedback off");
      }
      if (t.shape() != p.shape()) {
        Refuse("`" + key + "` is " + nn::ShapeToString(t.shape()) + ", parameter `" + name + "` is " +
               nn::ShapeToString(p.shape()));
      }
      entry.residual = FiniteCopy(t, key);
    }
  }
  if (iteration == nullptr) Refuse(std::string("missing i64 scalar `") + kIterationKey + "`");
  // 0-d only, as StateDict writes it: a one-element [1] or [1, 1] is refused.
  if (!iteration->defined() || iteration->dtype() != nn::DType::kInt64 || iteration->shape() != nn::Shape{}) {
    Refuse(std::string("`") + kIterationKey + "` is " +
           (iteration->defined() ? std::string(nn::DTypeName(iteration->dtype())) + " " +
                                       nn::ShapeToString(iteration->shape())
                                 : std::string("undefined")) +
           ", expected an i64 scalar");
  }
  parsed.iteration = iteration->To(nn::kCPU).data<int64_t>()[0];
  if (parsed.iteration < 0) Refuse(std::string("`") + kIterationKey + "` is " + std::to_string(parsed.iteration) + ", below 0");
  if (parsed.iteration == std::numeric_limits<int64_t>::max()) {
    Refuse(std::string("`") + kIterationKey + "` is the largest i64: the next hook call's count would overflow");
  }
  return parsed;
}


// The options every rank must share, each as the 64 bits of its value (a
// double's bit pattern, a bool as 0 or 1), with its name.
std::vector<std::pair<const char*, int64_t>> OptionBits(const PowerSgdOptions& o) {
  auto bits = [](double v) {
    // -0.0 passes the range checks and computes as 0.0 does; its bit
    // pattern differs, and a rank that wrote it failed every rank's first
    // call as a mismatch. Adding +0.0 makes it +0.0 and changes no other.
    v += 0.0;
    int64_t b = 0;
    std::memcpy(&b, &v, sizeof b);
    return b;
  };
  return {{"matrix_approximation_rank", o.matrix_approximation_rank},
          {"start_iteration", o.start_iteration},
          {"min_compression_rate", bits(o.min_compression_rate)},
          {"use_error_feedback", o.use_error_feedback ? 1 : 0},
          {"warm_start", o.warm_start ? 1 : 0},
          {"orthogonalization_epsilon", bits(o.orthogonalization_epsilon)},
          {"seed", static_cast<int64_t>(o.seed)}};
}

// The lowest and highest value of each option over the ranks, in one
// all-reduce (max of v and of ~v: ~ reverses the order, so the max of ~v is
// ~ the min of v). Every rank gets the same extremes, so either every rank
// passes or every rank fails, naming the options that differ: ranks seeded
// apart draw different Q's and sum products of unrelated bases, and other
// differences mismatch the collectives or the state; none of it fails by
// itself.
transport::Status AgreeOnOptions(const PowerSgdOptions& options, transport::Communicator* comm,
                                 transport::Deadline deadline) {
  if (comm == nullptr) return transport::Status::Ok();
  const auto named = OptionBits(options);
  const size_t n = named.size();
  std::vector<int64_t> wire(2 * n);
  for (size_t i = 0; i < n; ++i) {
    wire[i] = named[i].second;
    wire[n + i] = ~named[i].second;
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - transport::Clock::now());
  if (left.count() <= 0) return transport::TimedOutError("powersgd options: the deadline passed before comparing them");
  transport::Status s = comm->AllReduce(wire.data(), wire.size(), transport::DataType::kI64,
                                        transport::ReduceOp::kMax, {.timeout = left});
  if (!s.ok()) return s;
  std::ostringstream differ;
  for (size_t i = 0; i < n; ++i) {
    const int64_t high = wire[i], low = ~wire[n + i];
    if (low == high) continue;
    const std::string name = named[i].first;
    differ << (differ.tellp() > 0 ? "; " : "") << name << " differs (";
    if (name == "min_compression_rate" || name == "orthogonalization_epsilon") {
      double a = 0, b = 0;
      std::memcpy(&a, &low, sizeof a);
      std::memcpy(&b, &high, sizeof b);
      differ << a << " and " << b;
    } else if (name == "seed") {
      differ << static_cast<uint64_t>(low) << " and " << static_cast<uint64_t>(high);
    } else {
      differ << low << " and " << high;
    }
    differ << " among others)";
  }
  if (differ.tellp() == 0) return transport::Status::Ok();
  return transport::Status(transport::StatusCode::kInvalidArgument,
                           "PowerSgdHook: the ranks' PowerSgdOptions differ: " + differ.str() +
                               "; every rank must pass the same options");
}

}  // namespace

PowerSgdState::PowerSgdState(PowerSgdOptions options) {
  ValidatePowerSgdOptions(options);
  impl_ = std::make_unique<Impl>(options);
}

PowerSgdState::~PowerSgdState() = default;

const PowerSgdOptions& PowerSgdState::options() const { return impl_->options; }

int64_t PowerSgdState::iteration() const { return impl_->iteration; }

size_t PowerSgdState::held_parameter_states() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->pending.size();
}

PowerSgdState::NamedTensors PowerSgdState::StateDict(const NamedTensors& params, bool with_residuals) const {
  std::map<const nn::TensorImpl*, std::string> names;
  for (const auto& [name, p] : params) names[p.impl()] = name;
  auto name_of = [&](const nn::TensorImpl* p) -> const std::string& {
    const auto it = names.find(p);
    if (it == names.end()) {
      throw std::invalid_argument(
          "PowerSgdState.StateDict: a bucket holds a parameter that is not among `params` (pass the model's "
          "NamedParameters())");
    }
    return it->second;
  };
  const PowerSgdOptions& o = impl_->options;
  NamedTensors out;
  out.emplace_back(kIterationKey, nn::FromVectorOf<int64_t>({impl_->iteration}, {}));
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (const auto& [index, b] : impl_->buckets) {
    const size_t elem = nn::ElementSize(b.dtype);
    for (size_t t = 0; t < b.plans.size(); ++t) {
      const TensorPlan& plan = b.plans[t];
      // A freed parameter's state (of a model gone since): its address
      // may now be another parameter's.
      if (!plan.compressed() || b.owners[t].expired()) continue;
      const std::string& name = name_of(b.params[t]);
      if (o.warm_start && b.q_ready) {
        out.emplace_back(kQPrefix + name, CopyOut(static_cast<const char*>(b.qs.data_ptr()) + plan.q_at * elem,
                                                  {plan.rank, plan.cols}, b.dtype));
      }
      if (with_residuals && o.use_error_feedback) {
        out.emplace_back(kResidualPrefix + name,
                         CopyOut(static_cast<const char*>(b.residuals.data_ptr()) + plan.residual_at * elem,
                                 b.shapes[t], b.dtype));
      }
    }
  }
  // Loaded and not yet placed in a bucket (no backward since the load).
  for (const auto& [p, saved] : impl_->pending) {
    if (saved.owner.expired()) continue;
    const std::string& name = name_of(p);
    if (saved.q.defined()) out.emplace_back(kQPrefix + name, saved.q.Clone());
    if (with_residuals && saved.residual.defined()) out.emplace_back(kResidualPrefix + name, saved.residual.Clone());
  }
  return out;
}

void PowerSgdState::CheckStateDict(const NamedTensors& state, const NamedTensors& params) const {
  ParseState(state, params, impl_->options);
}

void PowerSgdState::LoadStateDict(const NamedTensors& state, const NamedTensors& params) {
  ParsedState parsed = ParseState(state, params, impl_->options);
  std::lock_guard<std::mutex> lock(impl_->mu);
  // Every bucket is built anew at its next call, from the loaded state.
  impl_->buckets.clear();
  impl_->pending = std::move(parsed.saved);
  impl_->iteration = parsed.iteration;
}

namespace hooks {

CommHook PowerSgdHook(PowerSgdOptions options) { return PowerSgdHook(std::make_shared<PowerSgdState>(options)); }

CommHook PowerSgdHook(std::shared_ptr<PowerSgdState> shared) {
  if (shared == nullptr) throw std::invalid_argument("hooks::PowerSgdHook: the state is null");
  // The closure keeps `shared` alive; `state` is its Impl.
  PowerSgdState::Impl* state = shared->impl_.get();
  // The group whose ranks' options were compared (AgreeOnOptions): at this
  // hook's first call, and again when it serves another group (a state
  // reused by a new wrapper or group after a failure).
  auto compared = std::make_shared<std::atomic<const ProcessGroup*>>(nullptr);
  // On local gradients, so that the iterations before the start (and the
  // buckets not compressed) average as DDP with no hook does, bit for bit
  // on any world size: sum, then divide (kAvg). Divided first and summed,
  // as the reducer hands a hook its bucket, the result differed in the
  // last bit on 3 ranks. Compressed buckets are divided here instead.
  return CommHook::OnLocalGradients([shared, state, compared, copy = internal::HookCopy()](
                                        ProcessGroup& group, GradBucket& bucket) -> Work {
    internal::RequireUndividedBucket(bucket, "PowerSgdHook", state->attachment);
    state->attachment.Attach(group, copy, "PowerSgdHook", "PowerSgdState", bucket.index());
    if (compared->exchange(&group) != &group && group.size() > 1) {
      // Before this call's own collective, in issue order on every rank.
      // Its failure aborts the group, so this bucket's work and every later
      // one fail with its message.
      const CollectiveDescription compare{"powersgd options", nn::DType::kInt64,
                                          {static_cast<int64_t>(2 * OptionBits(state->options).size())}, -1,
                                          transport::ReduceOp::kMax, true};
      group.Run(compare, [state](transport::Communicator* comm, transport::Deadline deadline) {
        return AgreeOnOptions(state->options, comm, deadline);
      });
    }
    const int64_t iteration = state->iteration;
    if (bucket.is_last()) {
      ++state->iteration;
      // Buckets past the last one exist no more (rebuilt into fewer): their
      // parameters' Q and residuals move to `pending`, where the new
      // buckets' tasks find them (before or after this, either way), and
      // the buckets go. The tasks still to run use this iteration's
      // buckets, which stay (std::map keeps their places).
      std::lock_guard<std::mutex> lock(state->mu);
      const auto gone = state->buckets.upper_bound(bucket.index());
      for (auto it = gone; it != state->buckets.end(); ++it) MoveToPending(it->second, state->pending, state->options);
      state->buckets.erase(gone, state->buckets.end());
    }
    const nn::Tensor& buffer = bucket.buffer();
    const nn::DType dtype = buffer.dtype();
    const std::string label = "bucket " + std::to_string(bucket.index());
    // Exactly what DDP with no hook does before the start, and for what
    // is not compressed here (16-bit and integer buckets, device memory).
    if (iteration < state->options.start_iteration) {
      return internal::AverageAsNoHook(group, buffer, bucket.divisor(), label);
    }
    if (!buffer.device().is_cpu() || (dtype != nn::DType::kFloat32 && dtype != nn::DType::kFloat64)) {
      // Said once per hook: a model converted to f16 or moved to a GPU
      // would otherwise train at full traffic with no sign of it.
      if (!state->warned_uncompressed.exchange(true)) {
        std::fprintf(stderr,
                     "[ddp] rank %d: PowerSgdHook: %s, a bucket of %s gradients on %s, is all-reduced "
                     "uncompressed (PowerSGD compresses f32 and f64 buckets in host memory only); said once "
                     "per hook\n",
                     group.rank(), label.c_str(), std::string(nn::DTypeName(dtype)).c_str(),
                     buffer.device().ToString().c_str());
      }
      return internal::AverageAsNoHook(group, buffer, bucket.divisor(), label);
    }
    // The compressed path works on divided gradients (the residuals are in
    // those units), as the reducer would have handed them: the same scaling.
    if (bucket.divisor() != 1.0) internal::ScaleTensor(buffer, buffer, 1.0 / bucket.divisor());
    std::vector<nn::Shape> shapes;
    std::vector<const nn::TensorImpl*> params;
    std::vector<std::weak_ptr<nn::TensorImpl>> owners;
    shapes.reserve(bucket.parameters().size());
    params.reserve(bucket.parameters().size());
    owners.reserve(bucket.parameters().size());
    for (const nn::Tensor& p : bucket.parameters()) {
      shapes.push_back(p.shape());
      params.push_back(p.impl());
      owners.push_back(p.impl_ptr());
    }
    // One task per all-reduce (see Step); they share `call`. A bucket with
    // nothing to compress takes one all-reduce, so one task.
    bool any_compressed = false;
    for (const nn::Shape& shape : shapes) any_compressed |= PlanTensor(shape, state->options).compressed();
    auto call = std::make_shared<BucketCall>();
    const auto describe = [&](const std::string& what) {
      return CollectiveDescription{what, dtype, buffer.shape(), -1, transport::ReduceOp::kSum, true};
    };
    // The all-reduce of a task, within that task's deadline.
    const auto all_reduce_within = [label, type = ToTransportType(dtype)](transport::Communicator* comm,
                                                                           transport::Deadline deadline) {
      return [comm, deadline, label, type](void* data, int64_t count, const char* what) {
        if (comm == nullptr || count == 0) return transport::Status::Ok();
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - transport::Clock::now());
        if (left.count() <= 0) {
          return transport::TimedOutError("powersgd " + label + ": the deadline passed before the all-reduce of " +
                                          what);
        }
        return comm->AllReduce(data, static_cast<size_t>(count), type, transport::ReduceOp::kSum, {.timeout = left});
      };
    };
    Work first = group.Run(
        describe(any_compressed ? "powersgd P " + label : "powersgd " + label),
        [shared, state, call, buffer, shapes = std::move(shapes), params = std::move(params),
         owners = std::move(owners), offsets = bucket.offsets(), index = bucket.index(), iteration,
         all_reduce_within](transport::Communicator* comm, transport::Deadline deadline) mutable {
          const nn::DType dtype = buffer.dtype();
          BucketState* found;
          {
            std::lock_guard<std::mutex> lock(state->mu);
            DropFreed(state->pending);
            found = &state->buckets[index];
          }
          BucketState& b = *found;
          // Equal addresses are the same parameters only while the ones the
          // state was built for live (a new model may reuse their memory).
          const bool owners_gone = std::any_of(b.owners.begin(), b.owners.end(),
                                               [](const std::weak_ptr<nn::TensorImpl>& o) { return o.expired(); });
          if (b.params != params || owners_gone || b.shapes != shapes || b.offsets != offsets || b.dtype != dtype) {
            {
              std::lock_guard<std::mutex> lock(state->mu);
              MoveStaleStateToPending(state->buckets, state->pending, iteration, state->options);
            }
            RebuildBucketState(b, std::move(shapes), std::move(offsets), std::move(params), std::move(owners), dtype,
                               state->options);
            std::lock_guard<std::mutex> lock(state->mu);
            ApplySaved(b, state->pending, state->options);
          }
          b.used_at = iteration;
          call->bucket = &b;
          const AllReduceFn all_reduce = all_reduce_within(comm, deadline);
          const transport::Status s =
              dtype == nn::DType::kFloat32
                  ? SendP(b, buffer.data<float>(), buffer.numel(), state->options, index, iteration, all_reduce,
                          call->next)
                  : SendP(b, buffer.data<double>(), buffer.numel(), state->options, index, iteration, all_reduce,
                          call->next);
          call->failed = !s.ok();
          return s;
        });
    if (!any_compressed) return first;
    const auto later = [shared, state, call, buffer, index = bucket.index(), iteration, world = group.size(),
                        label, all_reduce_within](transport::Communicator* comm, transport::Deadline deadline) {
      // Normally the group is aborted after a failed task and this one
      // does not run; if it does, the bucket is not in a state to go on.
      if (call->failed || call->bucket == nullptr) {
        return transport::AbortedError("powersgd " + label + ": an earlier step of this bucket failed");
      }
      call->failed = true;  // stays so if the step throws
      const AllReduceFn all_reduce = all_reduce_within(comm, deadline);
      const transport::Status s =
          buffer.dtype() == nn::DType::kFloat32
              ? RunStep(*call->bucket, buffer.data<float>(), buffer.numel(), state->options, world, index, iteration,
                        all_reduce, call->next)
              : RunStep(*call->bucket, buffer.data<double>(), buffer.numel(), state->options, world, index,
                        iteration, all_reduce, call->next);
      call->failed = !s.ok();
      return s;
    };
    group.Run(describe("powersgd Q " + label), later);
    return group.Run(describe("powersgd " + label), later);
  });
}

}  // namespace hooks
}  // namespace ddp::dist
