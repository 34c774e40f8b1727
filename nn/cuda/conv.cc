#include "nn/cuda/conv.h"

#include <cudnn.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "nn/cuda/cuda.h"
#include "nn/cuda/cuda_error.h"
#include "nn/cuda/cudnn_util.h"
#include "nn/cuda/indexing.h"
#include "nn/cuda/launch.h"
#include "nn/cuda/stream.h"

namespace ddp::nn::cuda {

namespace {

int ToInt(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX) throw std::invalid_argument(std::string("conv2d on CUDA: ") + what + " out of range");
  return static_cast<int>(v);
}

// Descriptors, created and set in their constructors (the base destroys
// them, also when a constructor throws).
struct TensorDesc : CudnnTensorDescriptor {
  TensorDesc(const Tensor& t) {  // NOLINT: contiguous NCHW
    CheckCudnn(cudnnCreateTensorDescriptor(&d), "cudnnCreateTensorDescriptor");
    CheckCudnn(cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, CudnnType(t.dtype()), ToInt(t.size(0), "N"),
                                          ToInt(t.size(1), "C"), ToInt(t.size(2), "H"), ToInt(t.size(3), "W")),
               "cudnnSetTensor4dDescriptor");
  }
};

struct FilterDesc : CudnnDescriptor<cudnnFilterDescriptor_t, &cudnnDestroyFilterDescriptor> {
  explicit FilterDesc(const Tensor& w) {
    CheckCudnn(cudnnCreateFilterDescriptor(&d), "cudnnCreateFilterDescriptor");
    CheckCudnn(cudnnSetFilter4dDescriptor(d, CudnnType(w.dtype()), CUDNN_TENSOR_NCHW, ToInt(w.size(0), "O"),
                                          ToInt(w.size(1), "C/g"), ToInt(w.size(2), "KH"), ToInt(w.size(3), "KW")),
               "cudnnSetFilter4dDescriptor");
  }
};

struct ConvDesc : CudnnDescriptor<cudnnConvolutionDescriptor_t, &cudnnDestroyConvolutionDescriptor> {
  ConvDesc(const ops::Conv2dParams& p, DType dt) {
    CheckCudnn(cudnnCreateConvolutionDescriptor(&d), "cudnnCreateConvolutionDescriptor");
    // Cross-correlation, as every framework's "convolution"; f64 accumulates in f64, the rest in f32.
    CheckCudnn(cudnnSetConvolution2dDescriptor(d, ToInt(p.pad_h, "pad_h"), ToInt(p.pad_w, "pad_w"),
                                               ToInt(p.stride_h, "stride_h"), ToInt(p.stride_w, "stride_w"),
                                               ToInt(p.dilation_h, "dilation_h"), ToInt(p.dilation_w, "dilation_w"),
                                               CUDNN_CROSS_CORRELATION,
                                               dt == DType::kFloat64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT),
               "cudnnSetConvolution2dDescriptor");
    CheckCudnn(cudnnSetConvolutionGroupCount(d, ToInt(p.groups, "groups")), "cudnnSetConvolutionGroupCount");
    SetMath(DefaultMath(dt));
  }

  static cudnnMathType_t DefaultMath(DType dt) {
    if (dt == DType::kFloat16 || dt == DType::kBFloat16) return CUDNN_TENSOR_OP_MATH;
    // CUDNN_DEFAULT_MATH would allow TF32 for f32 on Ampere and later.
    if (dt == DType::kFloat32 && !AllowTf32()) return CUDNN_FMA_MATH;
    return CUDNN_DEFAULT_MATH;
  }
  void SetMath(cudnnMathType_t m) { CheckCudnn(cudnnSetConvolutionMathType(d, m), "cudnnSetConvolutionMathType"); }
};

enum class Direction : int { kForward = 0, kBackwardData = 1, kBackwardFilter = 2 };

struct Choice {
  int algo;
  cudnnMathType_t math;
  size_t workspace;
};

std::mutex g_cache_mu;
std::unordered_map<std::string, Choice>* g_cache = new std::unordered_map<std::string, Choice>();
std::atomic<size_t> g_searches{0};

std::string CacheKey(Direction dir, Device dev, const Tensor& x, const Tensor& w, const ops::Conv2dParams& p) {
  std::string k = std::to_string(static_cast<int>(dir)) + "|" + std::to_string(dev.index) + "|" +
                  std::to_string(static_cast<int>(x.dtype())) + "|" + (AllowTf32() ? "tf32" : "fma");
  for (int64_t v : x.shape()) k += "," + std::to_string(v);
  k += "|";
  for (int64_t v : w.shape()) k += "," + std::to_string(v);
  for (int64_t v : {p.stride_h, p.stride_w, p.pad_h, p.pad_w, p.dilation_h, p.dilation_w, p.groups}) {
    k += ";" + std::to_string(v);
  }
  return k;
}

// How each convolution shape gets its algorithm, from DDP_NN_CUDA_CONV_SEARCH:
// unset or "1": timed by cuDNN's Find calls (the fastest usable one);
// "0": cuDNN's plain implicit-GEMM algorithms, fixed (not chosen by timing)
// and deterministic, for runs that must repeat bit for bit and for telling a
// suspect searched algorithm from a bug elsewhere; "heuristic": the first
// usable one of cuDNN's heuristics (cudnnGet*Algorithm_v7, no timing), as
// PyTorch picks with torch.backends.cudnn.benchmark off. Anything else is
// refused naming the variable.
enum class SearchMode { kFind, kFixed, kHeuristic };

SearchMode Mode() {
  static const SearchMode mode = [] {
    const char* env = std::getenv("DDP_NN_CUDA_CONV_SEARCH");
    const std::string value = env == nullptr ? "1" : env;
    if (value == "1" || value.empty()) return SearchMode::kFind;
    if (value == "0") return SearchMode::kFixed;
    if (value == "heuristic") return SearchMode::kHeuristic;
    throw std::invalid_argument("DDP_NN_CUDA_CONV_SEARCH=" + value + ": expected 1 (time the algorithms, the "
                                "default), 0 (fixed implicit-GEMM algorithms) or heuristic");
  }();
  return mode;
}
bool SearchEnabled() { return Mode() != SearchMode::kFixed; }

// The most workspace a heuristic pick may need (as the timed search's).
constexpr size_t kHeuristicWorkspaceLimit = size_t{1} << 30;

// Device scratch from the caching allocator (a u8 tensor keeps it alive).
Tensor Workspace(Device dev, size_t bytes) {
  return Empty({static_cast<int64_t>(bytes)}, {.dtype = DType::kUInt8, .device = dev});
}

// The search gets up to 1 GiB of workspace (less when that much is not
// free): algorithms needing more are not considered.
Tensor SearchWorkspace(Device dev) {
  for (size_t bytes : {size_t{1} << 30, size_t{256} << 20, size_t{32} << 20, size_t{0}}) {
    try {
      return Workspace(dev, bytes);
    } catch (const std::bad_alloc&) {
    }
  }
  return Workspace(dev, 0);
}

// Picks the fastest successful algorithm of a search. f32 and f64 never take
// kernels that convert to 16-bit (ALLOW_CONVERSION), and f32 takes no tensor
// core (TF32) kernel unless allowed; it then runs with FMA math, because
// CUDNN_DEFAULT_MATH would let cuDNN use TF32 on Ampere and later.
template <typename Perf>
Choice Pick(const Perf* perfs, int count, DType dt, const char* what) {
  const bool wide = dt == DType::kFloat32 || dt == DType::kFloat64;
  const bool fma_only = dt == DType::kFloat32 && !AllowTf32();
  for (int i = 0; i < count; ++i) {
    if (perfs[i].status != CUDNN_STATUS_SUCCESS) continue;
    if (wide && perfs[i].mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    if (fma_only && perfs[i].mathType == CUDNN_TENSOR_OP_MATH) continue;
    return {static_cast<int>(perfs[i].algo), fma_only ? CUDNN_FMA_MATH : perfs[i].mathType, perfs[i].memory};
  }
  throw CudaError(std::string("cuDNN found no usable algorithm for ") + what, 0);
}

// Times every algorithm with cuDNN's Find call `find(perfs, &count, ws)`
// and picks the fastest usable one. The device is synchronized first, and
// the Find call runs twice with the second one deciding: the first run of
// each candidate pays for loading its kernels (CUDA loads modules lazily)
// and for warming clocks and caches, which made the choice differ from
// process to process (on an H200, one process's bf16 ResNet-50 step took 58
// ms where others took 36-41 ms).
constexpr int kSearchRounds = 2;

// DDP_NN_CUDA_CONV_LOG=1 prints every search's candidates to stderr: which
// algorithm (and math) each convolution shape got, and what the others took.
bool SearchLogged() {
  static const bool logged = [] {
    const char* env = std::getenv("DDP_NN_CUDA_CONV_LOG");
    return env != nullptr && std::string(env) == "1";
  }();
  return logged;
}

template <typename Perf, int kCount, typename Find>
Choice Search(Device dev, DType dt, const char* what, const std::string& key, Find find) {
  SynchronizeDevice(dev);
  Tensor ws = SearchWorkspace(dev);
  Perf perfs[kCount];
  int count = 0;
  for (int round = 0; round < kSearchRounds; ++round) {
    count = 0;
    find(perfs, &count, ws.data_ptr(), static_cast<size_t>(ws.numel()));
  }
  const Choice c = Pick(perfs, count, dt, what);
  ++g_searches;
  if (SearchLogged()) {
    std::string line = std::string("conv search: ") + what + " [" + key + "] picked algo " + std::to_string(c.algo) +
                       " math " + std::to_string(static_cast<int>(c.math)) + "; candidates:";
    for (int i = 0; i < count; ++i) {
      if (perfs[i].status != CUDNN_STATUS_SUCCESS) continue;
      line += " " + std::to_string(static_cast<int>(perfs[i].algo)) + "/" +
              std::to_string(static_cast<int>(perfs[i].mathType)) + "=" + std::to_string(perfs[i].time) + "ms";
    }
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  return c;
}

// The first usable algorithm of cuDNN's heuristics `get(perfs, &count)`,
// leaving out those that need more than kHeuristicWorkspaceLimit.
template <typename Perf, int kCount, typename Get>
Choice Heuristic(DType dt, const char* what, const std::string& key, Get get) {
  Perf perfs[kCount];
  int count = 0;
  get(perfs, &count);
  for (int i = 0; i < count; ++i) {
    if (perfs[i].memory > kHeuristicWorkspaceLimit) perfs[i].status = CUDNN_STATUS_NOT_SUPPORTED;
  }
  const Choice c = Pick(perfs, count, dt, what);
  ++g_searches;
  if (SearchLogged()) {
    std::fprintf(stderr, "conv search: %s [%s] picked algo %d math %d; heuristic\n", what, key.c_str(), c.algo,
                 static_cast<int>(c.math));
  }
  return c;
}

Choice ChooseForward(cudnnHandle_t h, const Tensor& x, const Tensor& w, const Tensor& y, const ops::Conv2dParams& p,
                     const TensorDesc& xd, const FilterDesc& wd, const ConvDesc& cd, const TensorDesc& yd) {
  const std::string key = CacheKey(Direction::kForward, x.device(), x, w, p);
  {
    std::lock_guard<std::mutex> lock(g_cache_mu);
    auto it = g_cache->find(key);
    if (it != g_cache->end()) return it->second;
  }
  if (!SearchEnabled()) {
    const auto algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
    size_t bytes = 0;
    CheckCudnn(cudnnGetConvolutionForwardWorkspaceSize(h, xd.d, wd.d, cd.d, yd.d, algo, &bytes),
               "cudnnGetConvolutionForwardWorkspaceSize");
    return {algo, ConvDesc::DefaultMath(x.dtype()), bytes};
  }
  const Choice c =
      Mode() == SearchMode::kHeuristic
          ? Heuristic<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT>(
                x.dtype(), "conv2d forward", key,
                [&](auto* perfs, int* count) {
                  CheckCudnn(cudnnGetConvolutionForwardAlgorithm_v7(h, xd.d, wd.d, cd.d, yd.d,
                                                                    CUDNN_CONVOLUTION_FWD_ALGO_COUNT, count, perfs),
                             "cudnnGetConvolutionForwardAlgorithm_v7");
                })
          : Search<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT>(
      x.device(), x.dtype(), "conv2d forward", key, [&](auto* perfs, int* count, void* ws, size_t ws_bytes) {
        CheckCudnn(cudnnFindConvolutionForwardAlgorithmEx(h, xd.d, x.data_ptr(), wd.d, w.data_ptr(), cd.d, yd.d,
                                                          y.data_ptr(), CUDNN_CONVOLUTION_FWD_ALGO_COUNT, count, perfs,
                                                          ws, ws_bytes),
                   "cudnnFindConvolutionForwardAlgorithmEx");
      });
  std::lock_guard<std::mutex> lock(g_cache_mu);
  (*g_cache)[key] = c;
  return c;
}

Choice ChooseBackwardData(cudnnHandle_t h, const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                          const ops::Conv2dParams& p, const FilterDesc& wd, const TensorDesc& dyd, const ConvDesc& cd,
                          const TensorDesc& dxd) {
  const std::string key = CacheKey(Direction::kBackwardData, x.device(), x, w, p);
  {
    std::lock_guard<std::mutex> lock(g_cache_mu);
    auto it = g_cache->find(key);
    if (it != g_cache->end()) return it->second;
  }
  if (!SearchEnabled()) {
    const auto algo = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
    size_t bytes = 0;
    CheckCudnn(cudnnGetConvolutionBackwardDataWorkspaceSize(h, wd.d, dyd.d, cd.d, dxd.d, algo, &bytes),
               "cudnnGetConvolutionBackwardDataWorkspaceSize");
    return {algo, ConvDesc::DefaultMath(x.dtype()), bytes};
  }
  const Choice c =
      Mode() == SearchMode::kHeuristic
          ? Heuristic<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT>(
                x.dtype(), "conv2d backward (data)", key,
                [&](auto* perfs, int* count) {
                  CheckCudnn(cudnnGetConvolutionBackwardDataAlgorithm_v7(
                                 h, wd.d, dyd.d, cd.d, dxd.d, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, count, perfs),
                             "cudnnGetConvolutionBackwardDataAlgorithm_v7");
                })
          : Search<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT>(
      x.device(), x.dtype(), "conv2d backward (data)", key, [&](auto* perfs, int* count, void* ws, size_t ws_bytes) {
        CheckCudnn(cudnnFindConvolutionBackwardDataAlgorithmEx(h, wd.d, w.data_ptr(), dyd.d, dy.data_ptr(), cd.d,
                                                               dxd.d, dx.data_ptr(),
                                                               CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, count, perfs,
                                                               ws, ws_bytes),
                   "cudnnFindConvolutionBackwardDataAlgorithmEx");
      });
  std::lock_guard<std::mutex> lock(g_cache_mu);
  (*g_cache)[key] = c;
  return c;
}

Choice ChooseBackwardFilter(cudnnHandle_t h, const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dw,
                            const ops::Conv2dParams& p, const TensorDesc& xd, const TensorDesc& dyd,
                            const ConvDesc& cd, const FilterDesc& dwd) {
  const std::string key = CacheKey(Direction::kBackwardFilter, x.device(), x, w, p);
  {
    std::lock_guard<std::mutex> lock(g_cache_mu);
    auto it = g_cache->find(key);
    if (it != g_cache->end()) return it->second;
  }
  if (!SearchEnabled()) {
    const auto algo = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;
    size_t bytes = 0;
    CheckCudnn(cudnnGetConvolutionBackwardFilterWorkspaceSize(h, xd.d, dyd.d, cd.d, dwd.d, algo, &bytes),
               "cudnnGetConvolutionBackwardFilterWorkspaceSize");
    return {algo, ConvDesc::DefaultMath(x.dtype()), bytes};
  }
  const Choice c =
      Mode() == SearchMode::kHeuristic
          ? Heuristic<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT>(
                x.dtype(), "conv2d backward (filter)", key,
                [&](auto* perfs, int* count) {
                  CheckCudnn(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                                 h, xd.d, dyd.d, cd.d, dwd.d, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, count, perfs),
                             "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
                })
          : Search<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT>(
      x.device(), x.dtype(), "conv2d backward (filter)", key, [&](auto* perfs, int* count, void* ws, size_t ws_bytes) {
        CheckCudnn(cudnnFindConvolutionBackwardFilterAlgorithmEx(h, xd.d, x.data_ptr(), dyd.d, dy.data_ptr(), cd.d,
                                                                 dwd.d, dw.data_ptr(),
                                                                 CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, count,
                                                                 perfs, ws, ws_bytes),
                   "cudnnFindConvolutionBackwardFilterAlgorithmEx");
      });
  std::lock_guard<std::mutex> lock(g_cache_mu);
  (*g_cache)[key] = c;
  return c;
}

// alpha = 1, beta = 0 in the type cuDNN wants for this data type.
struct Scalars {
  float f1 = 1.0f, f0 = 0.0f;
  double d1 = 1.0, d0 = 0.0;
  const void* one(DType dt) const { return dt == DType::kFloat64 ? static_cast<const void*>(&d1) : &f1; }
  const void* zero(DType dt) const { return dt == DType::kFloat64 ? static_cast<const void*>(&d0) : &f0; }
};

void CheckConvOperands(const char* op, const Tensor& x, const Tensor& w) {
  if (x.dim() != 4 || w.dim() != 4) {
    throw std::invalid_argument(std::string(op) + ": expected x [N,C,H,W] and w [O,C/g,KH,KW], got " +
                                ShapeToString(x.shape()) + " and " + ShapeToString(w.shape()));
  }
  if (x.dtype() != w.dtype()) {
    throw std::invalid_argument(std::string(op) + ": input " + std::string(DTypeName(x.dtype())) + " and weight " +
                                std::string(DTypeName(w.dtype())) + " differ in dtype");
  }
  if (!x.device().is_cuda() || w.device() != x.device()) {
    throw std::invalid_argument(std::string(op) + ": operands on " + x.device().ToString() + " and " +
                                w.device().ToString() + " (expected one CUDA device)");
  }
}

Tensor ContiguousOnDevice(const Tensor& t) {
  if (t.is_contiguous()) return t;
  NoGradGuard guard;
  return t.Detach().Contiguous();
}

// out, or a contiguous temporary of out's shape and `dt` to be copied into it.
Tensor Target(const Tensor& out, DType dt) {
  if (out.is_contiguous() && out.dtype() == dt) return out;
  return Empty(out.shape(), {.dtype = dt, .device = out.device()});
}

void Finish(const Tensor& out, const Tensor& target) {
  out.storage()->BumpVersion();
  if (target.is_same(out)) return;
  NoGradGuard guard;
  out.CopyFrom(target);
}

// yt[n, o, :, :] += bias[o]: the broadcasting add_scaled_ kernel.
// Detached: a parameter's bias requires grad, and the add reads its values only.
void AddBias(const Tensor& yt, const Tensor& bias, cudaStream_t stream) {
  const DType dt = yt.dtype();
  const Tensor b = bias.dtype() == dt ? bias.Detach() : bias.Detach().To(dt);
  const Shape bs = BroadcastStridesTo(b.View({1, b.numel(), 1, 1}), yt.shape());
  const launch::Indexing ix = MakeIndexing("conv2d bias", yt.shape(), {yt.strides(), bs});
  LaunchChecked("kernel `add_scaled_` (conv2d bias)",
                [&] { return launch::AddScaled(ix, yt.numel(), yt.data_ptr(), b.data_ptr(), 1.0, ToDt(dt), stream); });
}

}  // namespace

size_t ConvAlgorithmSearches() { return g_searches; }

void Conv2dForward(const Tensor& x_in, const Tensor& w_in, const Tensor& bias, const Tensor& y,
                   const ops::Conv2dParams& p) {
  CheckConvOperands("conv2d_forward", x_in, w_in);
  const Device dev = x_in.device();
  const DType dt = x_in.dtype();
  const Tensor x = ContiguousOnDevice(x_in), w = ContiguousOnDevice(w_in);
  const Tensor yt = Target(y, dt);
  DeviceGuard guard(dev.index);
  const cudaStream_t stream = CurrentStream(dev);
  if (x.numel() == 0 || y.numel() == 0) {
    // cuDNN rejects a 0 dimension in a descriptor. An empty batch has an
    // empty output; an input with no channels or pixels convolves to zeros
    // (plus the bias).
    if (yt.numel() > 0) {
      yt.Zero();
      if (bias.defined()) AddBias(yt, bias, stream);
    }
    Finish(y, yt);
    return;
  }
  const cudnnHandle_t h = CudnnHandleFor(dev);
  CheckCudnn(cudnnSetStream(h, stream), "cudnnSetStream");
  const TensorDesc xd(x), yd(yt);
  const FilterDesc wd(w);
  ConvDesc cd(p, dt);
  int on, oc, oh, ow;
  CheckCudnn(cudnnGetConvolution2dForwardOutputDim(cd.d, xd.d, wd.d, &on, &oc, &oh, &ow),
             "cudnnGetConvolution2dForwardOutputDim");
  if (Shape{on, oc, oh, ow} != y.shape()) {
    throw std::invalid_argument("conv2d_forward: output " + ShapeToString(y.shape()) + " does not match the " +
                                ShapeToString({on, oc, oh, ow}) + " of input " + ShapeToString(x.shape()) +
                                " and weight " + ShapeToString(w.shape()));
  }
  if (y.numel() > 0) {
    const Choice c = ChooseForward(h, x, w, yt, p, xd, wd, cd, yd);
    cd.SetMath(c.math);
    Tensor ws = Workspace(dev, c.workspace);
    const Scalars s;
    CheckCudnn(cudnnConvolutionForward(h, s.one(dt), xd.d, x.data_ptr(), wd.d, w.data_ptr(), cd.d,
                                       static_cast<cudnnConvolutionFwdAlgo_t>(c.algo), ws.data_ptr(), c.workspace,
                                       s.zero(dt), yd.d, yt.data_ptr()),
               "cudnnConvolutionForward");
    if (bias.defined()) AddBias(yt, bias, stream);
  }
  Finish(y, yt);
}

void Conv2dBackward(const Tensor& x_in, const Tensor& w_in, const Tensor& dy_in, const Tensor& dx, const Tensor& dw,
                    const Tensor& db, const ops::Conv2dParams& p) {
  CheckConvOperands("conv2d_backward", x_in, w_in);
  const Device dev = x_in.device();
  const DType dt = x_in.dtype();
  const Tensor x = ContiguousOnDevice(x_in), w = ContiguousOnDevice(w_in);
  const Tensor dy = ContiguousOnDevice(dy_in.dtype() == dt ? dy_in : dy_in.Detach().To(dt));
  DeviceGuard guard(dev.index);
  if (x.numel() == 0 || dy.numel() == 0) {
    // cuDNN rejects a 0 dimension in a descriptor; with no products to sum
    // every gradient is zero (db is the sum of an empty dy).
    NoGradGuard no_grad;
    for (const Tensor* g : {&dx, &dw, &db}) {
      if (g->defined() && g->numel() > 0) g->Zero();
    }
    return;
  }
  const cudaStream_t stream = CurrentStream(dev);
  const cudnnHandle_t h = CudnnHandleFor(dev);
  CheckCudnn(cudnnSetStream(h, stream), "cudnnSetStream");
  const TensorDesc xd(x), dyd(dy);
  const FilterDesc wd(w);
  const Scalars s;
  if (dx.defined()) {
    const Tensor t = Target(dx, dt);
    if (t.numel() > 0 && dy.numel() > 0) {
      ConvDesc cd(p, dt);
      const Choice c = ChooseBackwardData(h, x, w, dy, t, p, wd, dyd, cd, xd);
      cd.SetMath(c.math);
      Tensor ws = Workspace(dev, c.workspace);
      CheckCudnn(cudnnConvolutionBackwardData(h, s.one(dt), wd.d, w.data_ptr(), dyd.d, dy.data_ptr(), cd.d,
                                              static_cast<cudnnConvolutionBwdDataAlgo_t>(c.algo), ws.data_ptr(),
                                              c.workspace, s.zero(dt), xd.d, t.data_ptr()),
                 "cudnnConvolutionBackwardData");
    } else if (t.numel() > 0) {
      t.Zero();
    }
    Finish(dx, t);
  }
  if (dw.defined()) {
    const Tensor t = Target(dw, dt);
    if (t.numel() > 0 && dy.numel() > 0) {
      ConvDesc cd(p, dt);
      const Choice c = ChooseBackwardFilter(h, x, w, dy, t, p, xd, dyd, cd, wd);
      cd.SetMath(c.math);
      Tensor ws = Workspace(dev, c.workspace);
      CheckCudnn(cudnnConvolutionBackwardFilter(h, s.one(dt), xd.d, x.data_ptr(), dyd.d, dy.data_ptr(), cd.d,
                                                static_cast<cudnnConvolutionBwdFilterAlgo_t>(c.algo), ws.data_ptr(),
                                                c.workspace, s.zero(dt), wd.d, t.data_ptr()),
                 "cudnnConvolutionBackwardFilter");
    } else if (t.numel() > 0) {
      t.Zero();
    }
    Finish(dw, t);
  }
  if (db.defined()) {
    // db[o] = sum of dy over n, h, w.
    NoGradGuard no_grad;
    const Tensor db4 = db.View({1, db.numel(), 1, 1});
    ops::KernelsFor(DeviceType::kCUDA).sum_to(dy, db4, 1.0);
  }
}

}  // namespace ddp::nn::cuda
