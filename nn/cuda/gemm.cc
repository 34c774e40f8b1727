// cuBLAS is column-major and our tensors are row-major. A row-major [R, C]
// matrix with row stride ld is, to cuBLAS, the column-major [C, R] matrix
// (its transpose) with leading dimension ld. So c = a @ b is computed as
// c^T = b^T @ a^T: cuBLAS gets (b, a) in that order with m and n swapped,
// and writes c^T column-major, which is c row-major.
#include "nn/cuda/gemm.h"

#include <cublas_v2.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "nn/cuda/cuda.h"
#include "nn/cuda/cuda_error.h"
#include "nn/cuda/indexing.h"
#include "nn/cuda/launch.h"
#include "nn/cuda/library_handles.h"
#include "nn/cuda/stream.h"
#include "nn/tensor/env_value.h"

namespace ddp::nn::cuda {

namespace {

// DDP_NN_CUDA_TF32, with the spellings DDP_NN_CPU_CACHE takes: only "1"
// used to turn TF32 on, so "true" or "on" left it off without a word.
bool Tf32FromEnv() { return OnOffFromEnv("DDP_NN_CUDA_TF32", false, "TF32 off"); }

std::atomic<bool> g_allow_tf32{Tf32FromEnv()};

void CreateCublas(cublasHandle_t* handle) { CheckCublas(cublasCreate(handle), "cublasCreate"); }

cublasHandle_t HandleFor(Device device) {
  return LibraryHandles<cublasHandle_t, CreateCublas>::For(device);
}

// cuBLAS's workspace, from the caching allocator: one per (device, stream)
// for this thread's handle, set after every cublasSetStream (which resets
// it). 32 MiB is what cuBLAS recommends for Hopper; without it cuBLAS would
// cudaMalloc its own pool per stream. Keyed by StreamId, not by handle: a
// new stream that got a destroyed one's handle must not share its workspace.
constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;

struct WorkspaceKey {
  int device;
  uint64_t stream_id;
  bool operator==(const WorkspaceKey& o) const { return device == o.device && stream_id == o.stream_id; }
};
struct WorkspaceKeyHash {
  size_t operator()(const WorkspaceKey& k) const {
    return std::hash<uint64_t>()(k.stream_id) ^ (static_cast<size_t>(k.device) * 0x9e3779b97f4a7c15ull);
  }
};
thread_local std::unordered_map<WorkspaceKey, Tensor, WorkspaceKeyHash> tls_workspaces;

const Tensor& CublasWorkspace(Device device, cudaStream_t stream, uint64_t stream_id) {
  auto it = tls_workspaces.find(WorkspaceKey{device.index, stream_id});
  if (it != tls_workspaces.end()) return it->second;
  // Workspaces of destroyed Streams are never used again: drop them (their
  // blocks go back to the allocator, under the dead stream's id).
  for (auto w = tls_workspaces.begin(); w != tls_workspaces.end();) {
    w = StreamAlive(w->first.stream_id) ? std::next(w) : tls_workspaces.erase(w);
  }
  // Allocated while `stream` is current, so the block belongs to that stream.
  StreamGuard on(device, stream);
  Tensor ws = Empty({kCublasWorkspaceBytes}, {.dtype = DType::kUInt8, .device = device});
  return tls_workspaces.emplace(WorkspaceKey{device.index, stream_id}, std::move(ws)).first->second;
}

// A 2-D operand as cuBLAS sees it (row-major view; see the file comment).
struct Operand {
  const void* data;
  bool trans;  // stored column-major (a transposed view)
  int64_t ld;
  Tensor holder;  // keeps a converted or copied buffer alive
};

Operand Describe(const Tensor& t, DType want) {
  NoGradGuard no_grad;
  Tensor src = t.Detach();
  if (src.dtype() != want) src = src.To(want);
  const int64_t r = src.size(0), c = src.size(1), s0 = src.stride(0), s1 = src.stride(1);
  if ((c == 1 || s1 == 1) && (r == 1 || s0 >= std::max<int64_t>(c, 1))) {
    return {src.data_ptr(), false, r == 1 ? std::max<int64_t>(c, 1) : std::max<int64_t>(s0, 1), src};
  }
  if ((r == 1 || s0 == 1) && (c == 1 || s1 >= std::max<int64_t>(r, 1))) {
    return {src.data_ptr(), true, c == 1 ? std::max<int64_t>(r, 1) : std::max<int64_t>(s1, 1), src};
  }
  Tensor copy = src.Contiguous();
  return {copy.data_ptr(), false, std::max<int64_t>(c, 1), copy};
}

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat64: return CUDA_R_64F;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    default:
      throw std::invalid_argument("gemm on CUDA: unsupported dtype " + std::string(DTypeName(t)) +
                                  " (f32, f64, f16, bf16)");
  }
}

int CheckedInt(int64_t v, const char* what) {
  if (v > INT_MAX) {
    throw std::invalid_argument(std::string("gemm on CUDA: ") + what + " = " + std::to_string(v) +
                                " exceeds cuBLAS's 32-bit limit");
  }
  return static_cast<int>(v);
}

}  // namespace

void SetAllowTf32(bool allow) { g_allow_tf32 = allow; }
bool AllowTf32() { return g_allow_tf32; }

void Gemm(const Tensor& a, const Tensor& b, const Tensor& c, double alpha, double beta) {
  if (a.dim() != 2 || b.dim() != 2 || c.dim() != 2 || a.size(1) != b.size(0) || c.size(0) != a.size(0) ||
      c.size(1) != b.size(1)) {
    throw std::invalid_argument("gemm: shapes " + ShapeToString(a.shape()) + " @ " + ShapeToString(b.shape()) +
                                " -> " + ShapeToString(c.shape()) + " do not chain");
  }
  const Device dev = c.device();
  if (!dev.is_cuda() || a.device() != dev || b.device() != dev) {
    throw std::invalid_argument("gemm: operands on " + a.device().ToString() + ", " + b.device().ToString() + ", " +
                                dev.ToString() + " (all must be on one CUDA device)");
  }
  const int64_t m = c.size(0), n = c.size(1), k = a.size(1);
  if (m == 0 || n == 0) return;
  const DType dt = c.dtype();
  const cudaDataType_t type = CudaType(dt);
  NoGradGuard no_grad;
  // The result goes straight into c when cuBLAS can address it.
  const bool direct = (n == 1 || c.stride(1) == 1) && (m == 1 || c.stride(0) >= n);
  Tensor cc = c;
  if (!direct) {
    cc = Empty({m, n}, {.dtype = dt, .device = dev});
    if (beta != 0) cc.CopyFrom(c);
  }
  const int64_t ldc = direct ? (m == 1 ? std::max<int64_t>(n, 1) : c.stride(0)) : n;
  DeviceGuard guard(dev.index);
  const cudaStream_t stream = CurrentStream(dev);
  if (k == 0 && beta == 0) {
    // Nothing to multiply and c not read, as BLAS and the CPU kernel do:
    // beta * c would turn a NaN or an infinity left in c (often fresh from
    // Empty) into NaN. All-zero bytes are +0 in every floating dtype; cc's
    // rows lie ldc elements apart.
    const size_t elem = cc.element_size();
    CheckCuda(cudaMemset2DAsync(cc.data_ptr(), static_cast<size_t>(ldc) * elem, 0, static_cast<size_t>(n) * elem,
                                static_cast<size_t>(m), stream),
              "cudaMemset2DAsync (gemm with k = 0)");
  } else if (k == 0) {
    // Nothing to multiply: c = beta * c.
    const launch::Indexing ix = MakeIndexing("gemm", cc.shape(), {cc.strides(), cc.strides()});
    LaunchChecked("kernel `affine` (gemm with k = 0)", [&] {
      return launch::Affine(ix, cc.numel(), cc.data_ptr(), cc.data_ptr(), beta, 0.0, ToDt(dt), stream);
    });
  } else {
    const Operand oa = Describe(a, dt), ob = Describe(b, dt);
    const cublasHandle_t handle = HandleFor(dev);
    CheckCublas(cublasSetStream(handle, stream), "cublasSetStream");
    const Tensor& ws = CublasWorkspace(dev, stream, CurrentStreamId(dev));
    CheckCublas(cublasSetWorkspace(handle, ws.data_ptr(), ws.nbytes()), "cublasSetWorkspace");
    const cublasOperation_t op_b = ob.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_a = oa.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int in = CheckedInt(n, "N"), im = CheckedInt(m, "M"), ik = CheckedInt(k, "K");
    const int lda = CheckedInt(oa.ld, "lda"), ldb = CheckedInt(ob.ld, "ldb"), ildc = CheckedInt(ldc, "ldc");
    if (dt == DType::kFloat64) {
      const double al = alpha, be = beta;
      CheckCublas(cublasGemmEx(handle, op_b, op_a, in, im, ik, &al, ob.data, type, ldb, oa.data, type, lda, &be,
                               cc.data_ptr(), type, ildc, CUBLAS_COMPUTE_64F, CUBLAS_GEMM_DEFAULT),
                  "cublasGemmEx(f64)");
    } else {
      const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
      const cublasComputeType_t compute =
          dt == DType::kFloat32 && AllowTf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
      CheckCublas(cublasGemmEx(handle, op_b, op_a, in, im, ik, &al, ob.data, type, ldb, oa.data, type, lda, &be,
                               cc.data_ptr(), type, ildc, compute, CUBLAS_GEMM_DEFAULT),
                  "cublasGemmEx");
    }
  }
  c.storage()->BumpVersion();
  if (!direct) c.CopyFrom(cc);
}

}  // namespace ddp::nn::cuda
