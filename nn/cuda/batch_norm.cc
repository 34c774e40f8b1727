// Shapes: x, y, dy, dx [N, C, S...] seen as [N, C, S]; every per-channel
// tensor is [C].
#include "nn/cuda/batch_norm.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "nn/cuda/cuda_error.h"
#include "nn/cuda/cudnn_util.h"
#include "nn/cuda/env_flag.h"
#include "nn/cuda/indexing.h"
#include "nn/cuda/launch.h"
#include "nn/cuda/stream.h"

namespace ddp::nn::cuda {

namespace {

struct Dims {
  int64_t n, c, s;
};

Dims CheckX(const char* op, const Tensor& x) {
  if (x.dim() < 2) throw std::invalid_argument(std::string(op) + ": expected [N, C, ...], got " + ShapeToString(x.shape()));
  if (!x.device().is_cuda()) throw std::invalid_argument(std::string(op) + ": CUDA kernel called on " + x.device().ToString());
  if (!IsFloating(x.dtype())) {
    throw std::invalid_argument(std::string(op) + ": needs a floating dtype, got " + std::string(DTypeName(x.dtype())));
  }
  int64_t s = 1;
  for (int64_t d = 2; d < x.dim(); ++d) s *= x.size(d);
  return {x.size(0), x.size(1), s};
}

// A per-channel tensor for the kernels (undefined stays undefined): as it is
// when they can read it in place (split reductions on: contiguous and
// floating), else converted to contiguous f64.
void CheckPerChannel(const char* op, const char* name, const Tensor& t, const Tensor& x, int64_t c) {
  if (t.defined() && (t.numel() != c || t.device() != x.device())) {
    throw std::invalid_argument(std::string(op) + ": " + name + " of shape " + ShapeToString(t.shape()) + " on " +
                                t.device().ToString() + " does not match " + std::to_string(c) + " channels on " +
                                x.device().ToString());
  }
}

Tensor PerChannel(const char* op, const char* name, const Tensor& t, const Tensor& x, int64_t c) {
  if (!t.defined()) return t;
  CheckPerChannel(op, name, t, x, c);
  NoGradGuard guard;
  Tensor r = t.Detach().Reshape({c});
  if (BatchNormSplitReductions() && r.is_contiguous() && IsFloating(r.dtype())) return r;
  if (r.dtype() != DType::kFloat64) r = r.To(DType::kFloat64);
  return r.Contiguous();
}

launch::ChannelArray Arr(const Tensor& t) {
  return t.defined() ? launch::ChannelArray{t.data_ptr(), ToDt(t.dtype())} : launch::ChannelArray{};
}

double* MutPtr(const Tensor& t) { return t.defined() ? static_cast<double*>(t.data_ptr()) : nullptr; }

Tensor Scratch(const Tensor& x, int64_t c) { return Empty({c}, {.dtype = DType::kFloat64, .device = x.device()}); }

// The split reductions' partial sums for x's shape.
Tensor SplitWork(const Tensor& x, const Dims& d) {
  return Scratch(x, 2 * d.c * launch::BatchNormSplitParts(d.n, d.c, d.s));
}

// sum_dy[c] and sum_dy_xhat[c] (f64 [C]) on the stream, split or not.
void BackwardReduce(const Tensor& dy, const Tensor& x, const Dims& d, const Tensor& mean, const Tensor& invstd,
                    const Tensor& sum_dy, const Tensor& sum_dy_xhat, cudaStream_t stream) {
  if (BatchNormSplitReductions()) {
    LaunchChecked("kernel `batch_norm_backward_reduce_split`", [&] {
      return launch::BatchNormBackwardReduceSplit(dy.data_ptr(), x.data_ptr(), d.n, d.c, d.s, MutPtr(SplitWork(x, d)),
                                                  Arr(mean), Arr(invstd), MutPtr(sum_dy), MutPtr(sum_dy_xhat),
                                                  ToDt(x.dtype()), stream);
    });
  } else {
    LaunchChecked("kernel `batch_norm_backward_reduce`", [&] {
      return launch::BatchNormBackwardReduce(dy.data_ptr(), x.data_ptr(), d.n, d.c, d.s, Arr(mean), Arr(invstd),
                                             MutPtr(sum_dy), MutPtr(sum_dy_xhat), ToDt(x.dtype()), stream);
    });
  }
}

// -1 until read from DDP_NN_CUDA_BN_SPLIT, then 0 or 1.
std::atomic<int> split_reductions{-1};

// `out` itself when the kernels can write it directly (contiguous f64 [c] on
// x's device, as nn's batch_norm allocates the saved statistics), else a
// scratch that WriteBack copies into it.
Tensor F64Target(const Tensor& out, const Tensor& x, int64_t c) {
  if (out.defined() && out.dtype() == DType::kFloat64 && out.is_contiguous() && out.numel() == c &&
      out.device() == x.device()) {
    return out;
  }
  return Scratch(x, c);
}

// Writes f64 values into a per-channel output of any dtype and layout (a
// version bump only, when the kernels wrote `out` itself, in place).
void WriteBack(const Tensor& out, const Tensor& values) {
  if (!out.defined()) return;
  if (out.is_same(values) || (out.data_ptr() == values.data_ptr() && out.dtype() == values.dtype() &&
                              out.numel() == values.numel())) {
    out.storage()->BumpVersion();
    return;
  }
  NoGradGuard guard;
  out.CopyFrom(values.View(out.shape()));
}

Tensor ContiguousOnDevice(const Tensor& t) {
  if (t.is_contiguous()) return t;
  NoGradGuard guard;
  return t.Detach().Contiguous();
}

// `out` itself when contiguous, else a temporary written back by Finish.
Tensor Target(const Tensor& out) {
  return out.is_contiguous() ? out : Empty(out.shape(), {.dtype = out.dtype(), .device = out.device()});
}

void Finish(const Tensor& out, const Tensor& target) {
  out.storage()->BumpVersion();
  if (target.is_same(out)) return;
  NoGradGuard guard;
  out.CopyFrom(target);
}

void CheckSameShape(const char* op, const Tensor& a, const char* an, const Tensor& b, const char* bn) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype() || a.device() != b.device()) {
    throw std::invalid_argument(std::string(op) + ": " + an + " " + ShapeToString(a.shape()) + " " +
                                std::string(DTypeName(a.dtype())) + " and " + bn + " " + ShapeToString(b.shape()) +
                                " " + std::string(DTypeName(b.dtype())) + " must match");
  }
}

// -1 until read from DDP_NN_CUDA_BN, then a BatchNormKernels value.
std::atomic<int> kernel_choice{-1};
// Activation dtypes cuDNN declined, per mode: bit dtype for the spatial
// mode, 16 + dtype for the persistent one. Ours run them.
std::atomic<uint32_t> cudnn_declined{0};

uint32_t DeclinedBit(DType dt) {
  const int mode = BatchNormKernelChoice() == BatchNormKernels::kCudnnPersistent ? 1 : 0;
  return 1u << (static_cast<int>(dt) + 16 * mode);
}

bool UsesCudnn(DType dt) {
  if (BatchNormKernelChoice() == BatchNormKernels::kOwn) return false;
  if (dt != DType::kFloat32 && dt != DType::kFloat16 && dt != DType::kBFloat16) return false;
  return (cudnn_declined.load(std::memory_order_relaxed) & DeclinedBit(dt)) == 0;
}

cudnnBatchNormMode_t CudnnMode() {
  return BatchNormKernelChoice() == BatchNormKernels::kCudnnPersistent ? CUDNN_BATCHNORM_SPATIAL_PERSISTENT
                                                                         : CUDNN_BATCHNORM_SPATIAL;
}

// cuDNN takes the shape: every dimension and the element count fit its ints.
bool CudnnShapeFits(const Dims& d, const Tensor& x) {
  return d.n > 0 && d.n <= INT_MAX && d.c > 0 && d.c <= INT_MAX && d.s > 0 && d.s <= INT_MAX &&
         x.numel() <= INT_MAX;
}

// Training batches cuDNN is given: the chosen kernels, a dtype it may take,
// a shape within its ints, more than one value per channel, and PyTorch's
// limits for its cuDNN path (at least 3 dimensions, N <= 880801), beyond
// which PyTorch notes cuDNN's batch norm misbehaving. The forward, the
// backward and the saved statistics' dtype all ask this one question.
bool CudnnTrains(const Dims& d, const Tensor& x) {
  return UsesCudnn(x.dtype()) && CudnnShapeFits(d, x) && d.n * d.s > 1 && x.dim() >= 3 && d.n <= 880801;
}

// True when cuDNN ran the call; false, after noting the dtype, when it
// declined it (the caller then runs ours); throws for any other failure.
// cuDNN 9 reports a decline as any code in the NOT_SUPPORTED category
// (NOT_SUPPORTED_DATA_TYPE, _SHAPE, _ARCH_MISMATCH, ...), and a shape or
// layout it refuses as one in the BAD_PARAM category (plain BAD_PARAM, or
// a sub-status such as BAD_PARAM_SHAPE_MISMATCH); either way ours run the
// call, and the message names the status.
bool CudnnRan(cudnnStatus_t status, DType dt, const char* call) {
  if (CUDNN_STATUS_CATEGORY(status) == CUDNN_STATUS_NOT_SUPPORTED ||
      CUDNN_STATUS_CATEGORY(status) == CUDNN_STATUS_BAD_PARAM) {
    const uint32_t bit = DeclinedBit(dt);
    if ((cudnn_declined.fetch_or(bit) & bit) == 0) {
      std::fprintf(stderr, "batch_norm: %s declined %s activations in %s mode (%s); our kernels run them\n",
                   call, std::string(DTypeName(dt)).c_str(),
                   CudnnMode() == CUDNN_BATCHNORM_SPATIAL_PERSISTENT ? "persistent" : "spatial",
                   cudnnGetErrorString(status));
    }
    return false;
  }
  CheckCudnn(status, call);
  return true;
}

// A per-channel tensor cuDNN reads or writes where it lies: f32, contiguous,
// [C] on x's device.
bool CudnnReadsInPlace(const Tensor& t, const Tensor& x, int64_t c) {
  return t.defined() && t.dtype() == DType::kFloat32 && t.is_contiguous() && t.numel() == c &&
         t.device() == x.device();
}

// What cuDNN reads for per-channel `t`: t itself, or an f32 copy; `fill` for
// an undefined t (no affine parameters).
Tensor CudnnIn(const Tensor& t, const Tensor& x, int64_t c, double fill) {
  if (!t.defined()) return Full({c}, fill, {.dtype = DType::kFloat32, .device = x.device()});
  if (CudnnReadsInPlace(t, x, c)) return t;
  NoGradGuard guard;
  return t.Detach().Reshape({c}).To(DType::kFloat32).Contiguous();
}

// Where cuDNN writes per-channel `out`: out itself, or f32 scratch that
// WriteBack copies into it.
Tensor CudnnOut(const Tensor& out, const Tensor& x, int64_t c) {
  return CudnnReadsInPlace(out, x, c) ? out : Empty({c}, {.dtype = DType::kFloat32, .device = x.device()});
}

void* MutPtrOrNull(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// The activation's descriptor ([N, C, S, 1], NCHW) and the per-channel one
// cuDNN derives from it; `status` says whether cuDNN took them. Made only
// for shapes CudnnTrains accepts, whose sizes CudnnShapeFits has checked
// against INT_MAX (larger ones run our kernels, which index in 64 bits), so
// the casts below do not truncate.
struct CudnnBnDescs {
  CudnnTensorDescriptor x, bn;  // destroyed also when the constructor throws
  cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
  CudnnBnDescs(const Tensor& t, const Dims& d) {
    CheckCudnn(cudnnCreateTensorDescriptor(&x.d), "cudnnCreateTensorDescriptor");
    CheckCudnn(cudnnCreateTensorDescriptor(&bn.d), "cudnnCreateTensorDescriptor");
    status = cudnnSetTensor4dDescriptor(x.d, CUDNN_TENSOR_NCHW, CudnnType(t.dtype()), static_cast<int>(d.n),
                                        static_cast<int>(d.c), static_cast<int>(d.s), 1);
    if (status == CUDNN_STATUS_SUCCESS) status = cudnnDeriveBNTensorDescriptor(bn.d, x.d, CudnnMode());
  }
};

// The legacy batch-norm calls are deprecated in cuDNN 9 but are what
// PyTorch calls; the warnings are silenced around them only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

// Training-mode forward through cuDNN: y (contiguous), the running
// statistics when `update`, the saved mean and invstd. False when cuDNN
// declined (nothing written).
bool CudnnForwardTraining(const Tensor& x, const Dims& d, const Tensor& weight, const Tensor& bias,
                          const Tensor& running_mean, const Tensor& running_var, bool update, double momentum,
                          double eps, const Tensor& yt, const Tensor& save_mean, const Tensor& save_invstd) {
  const Tensor scale = CudnnIn(weight, x, d.c, 1.0), shift = CudnnIn(bias, x, d.c, 0.0);
  const Tensor rm = update ? CudnnIn(running_mean, x, d.c, 0.0) : Tensor();
  const Tensor rv = update ? CudnnIn(running_var, x, d.c, 1.0) : Tensor();
  const Tensor sm = save_mean.defined() ? CudnnOut(save_mean, x, d.c) : Tensor();
  const Tensor si = save_invstd.defined() ? CudnnOut(save_invstd, x, d.c) : Tensor();
  const CudnnBnDescs desc(x, d);
  if (!CudnnRan(desc.status, x.dtype(), "cudnnDeriveBNTensorDescriptor")) return false;
  const cudnnHandle_t h = CudnnHandleFor(x.device());
  CheckCudnn(cudnnSetStream(h, CurrentStream(x.device())), "cudnnSetStream");
  const float one = 1.0f, zero = 0.0f;
  if (!CudnnRan(cudnnBatchNormalizationForwardTraining(
                    h, CudnnMode(), &one, &zero, desc.x.d, x.data_ptr(), desc.x.d, yt.data_ptr(), desc.bn.d,
                    scale.data_ptr(), shift.data_ptr(), momentum, MutPtrOrNull(rm), MutPtrOrNull(rv),
                    std::max(eps, CUDNN_BN_MIN_EPSILON), MutPtrOrNull(sm), MutPtrOrNull(si)),
                x.dtype(), "cudnnBatchNormalizationForwardTraining")) {
    return false;
  }
  if (update) {
    WriteBack(running_mean, rm);
    WriteBack(running_var, rv);
  }
  WriteBack(save_mean, sm);
  WriteBack(save_invstd, si);
  return true;
}

// Training-mode backward through cuDNN from the saved statistics: dx (when
// defined), dweight and dbias. False when cuDNN declined (nothing written).
bool CudnnBackward(const Tensor& x, const Tensor& dy, const Dims& d, const Tensor& weight, const Tensor& save_mean,
                   const Tensor& save_invstd, double eps, const Tensor& dx, const Tensor& dweight,
                   const Tensor& dbias) {
  const Tensor scale = CudnnIn(weight, x, d.c, 1.0);
  const Tensor sm = CudnnIn(save_mean, x, d.c, 0.0), si = CudnnIn(save_invstd, x, d.c, 1.0);
  // cuDNN always writes dx and both parameter gradients.
  const Tensor dxt = dx.defined() ? Target(dx) : Empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
  const Tensor dw = dweight.defined() ? CudnnOut(dweight, x, d.c) : Empty({d.c}, {.device = x.device()});
  const Tensor db = dbias.defined() ? CudnnOut(dbias, x, d.c) : Empty({d.c}, {.device = x.device()});
  const CudnnBnDescs desc(x, d);
  if (!CudnnRan(desc.status, x.dtype(), "cudnnDeriveBNTensorDescriptor")) return false;
  const cudnnHandle_t h = CudnnHandleFor(x.device());
  CheckCudnn(cudnnSetStream(h, CurrentStream(x.device())), "cudnnSetStream");
  const float one = 1.0f, zero = 0.0f;
  // The forward's epsilon, as cuDNN asks (with saved statistics it reads
  // the saved invstd, which holds it), raised to CUDNN_BN_MIN_EPSILON like
  // the forward's so that both pass the same value.
  if (!CudnnRan(cudnnBatchNormalizationBackward(h, CudnnMode(), &one, &zero, &one, &zero, desc.x.d, x.data_ptr(),
                                                desc.x.d, dy.data_ptr(), desc.x.d, dxt.data_ptr(), desc.bn.d,
                                                scale.data_ptr(), dw.data_ptr(), db.data_ptr(),
                                                std::max(eps, CUDNN_BN_MIN_EPSILON), sm.data_ptr(), si.data_ptr()),
                x.dtype(), "cudnnBatchNormalizationBackward")) {
    return false;
  }
  if (dx.defined()) Finish(dx, dxt);
  WriteBack(dweight, dw);
  WriteBack(dbias, db);
  return true;
}

#pragma GCC diagnostic pop

}  // namespace

bool BatchNormSplitReductions() {
  int on = split_reductions.load(std::memory_order_relaxed);
  if (on < 0) {
    on = EnvFlag("DDP_NN_CUDA_BN_SPLIT", true) ? 1 : 0;
    split_reductions.store(on, std::memory_order_relaxed);
  }
  return on == 1;
}

void SetBatchNormSplitReductions(bool on) { split_reductions.store(on ? 1 : 0, std::memory_order_relaxed); }

BatchNormKernels BatchNormKernelChoice() {
  int choice = kernel_choice.load(std::memory_order_relaxed);
  if (choice < 0) {
    const char* env = std::getenv("DDP_NN_CUDA_BN");
    const std::string value = env != nullptr ? env : "";
    if (value == "own") {
      choice = static_cast<int>(BatchNormKernels::kOwn);
    } else if (value.empty() || value == "cudnn") {
      choice = static_cast<int>(BatchNormKernels::kCudnn);
    } else if (value == "cudnn_persistent") {
      choice = static_cast<int>(BatchNormKernels::kCudnnPersistent);
    } else {
      throw std::invalid_argument("DDP_NN_CUDA_BN=" + value + " is not one of own, cudnn, cudnn_persistent");
    }
    kernel_choice.store(choice, std::memory_order_relaxed);
  }
  return static_cast<BatchNormKernels>(choice);
}

void SetBatchNormKernels(BatchNormKernels kernels) {
  kernel_choice.store(static_cast<int>(kernels), std::memory_order_relaxed);
}

DType BatchNormSavedDType(const Tensor& x, bool training) {
  return training && CudnnTrains(CheckX("batch_norm", x), x) ? DType::kFloat32 : DType::kFloat64;
}

bool BatchNormCudnnDeclined(DType dt) {
  return (cudnn_declined.load(std::memory_order_relaxed) & DeclinedBit(dt)) != 0;
}

void BatchNormForward(const Tensor& x_in, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                      const Tensor& running_var, bool training, double momentum, double eps, const Tensor& y,
                      const Tensor& save_mean, const Tensor& save_invstd) {
  const char* op = "batch_norm";
  const Dims d = CheckX(op, x_in);
  CheckSameShape(op, x_in, "x", y, "y");
  const Tensor x = ContiguousOnDevice(x_in);
  if (training && CudnnTrains(d, x)) {
    CheckPerChannel(op, "weight", weight, x, d.c);
    CheckPerChannel(op, "bias", bias, x, d.c);
    CheckPerChannel(op, "running_mean", running_mean, x, d.c);
    CheckPerChannel(op, "running_var", running_var, x, d.c);
    const Tensor yt = Target(y);
    DeviceGuard guard(x.device().index);
    if (CudnnForwardTraining(x, d, weight, bias, running_mean, running_var,
                             running_mean.defined() && running_var.defined(), momentum, eps, yt, save_mean,
                             save_invstd)) {
      Finish(y, yt);
      return;
    }
  }
  const Tensor w = PerChannel(op, "weight", weight, x, d.c), b = PerChannel(op, "bias", bias, x, d.c);
  const Tensor rm = PerChannel(op, "running_mean", running_mean, x, d.c);
  const Tensor rv = PerChannel(op, "running_var", running_var, x, d.c);
  if (!training && (!rm.defined() || !rv.defined())) {
    throw std::invalid_argument("batch_norm: evaluation mode needs running_mean and running_var");
  }
  const bool update = training && rm.defined() && rv.defined();
  const Tensor mean = F64Target(save_mean, x, d.c), invstd = F64Target(save_invstd, x, d.c);
  const Tensor var = Scratch(x, d.c);
  const int64_t m = d.n * d.s;
  const Tensor yt = Target(y);
  {
    DeviceGuard guard(x.device().index);
    const cudaStream_t stream = CurrentStream(x.device());
    const double unbias = m > 1 ? static_cast<double>(m) / static_cast<double>(m - 1) : 1.0;
    if (training && BatchNormSplitReductions()) {
      LaunchChecked("kernel `batch_norm_train_stats_split`", [&] {
        return launch::BatchNormTrainStatsSplit(x.data_ptr(), d.n, d.c, d.s, MutPtr(SplitWork(x, d)), momentum, eps,
                                                unbias, MutPtr(mean), MutPtr(var), MutPtr(invstd),
                                                update ? Arr(rm) : launch::ChannelArray{},
                                                update ? Arr(rv) : launch::ChannelArray{}, ToDt(x.dtype()), stream);
      });
    } else {
      if (training) {
        LaunchChecked("kernel `batch_norm_mean_var`", [&] {
          return launch::BatchNormMeanVar(x.data_ptr(), d.n, d.c, d.s, MutPtr(mean), MutPtr(var), ToDt(x.dtype()),
                                          stream);
        });
      }
      LaunchChecked("kernel `batch_norm_finalize`", [&] {
        return launch::BatchNormFinalize(d.c, training, momentum, eps, unbias, MutPtr(mean), MutPtr(var),
                                         MutPtr(invstd), update || !training ? Arr(rm) : launch::ChannelArray{},
                                         update || !training ? Arr(rv) : launch::ChannelArray{}, stream);
      });
    }
    LaunchChecked("kernel `batch_norm_elementwise`", [&] {
      return launch::BatchNormElementwise(x.data_ptr(), yt.data_ptr(), d.n, d.c, d.s, Arr(mean), Arr(invstd), Arr(w),
                                          Arr(b), ToDt(x.dtype()), stream);
    });
  }
  Finish(y, yt);
  if (update) {
    WriteBack(running_mean, rm);
    WriteBack(running_var, rv);
  }
  WriteBack(save_mean, mean);
  WriteBack(save_invstd, invstd);
}

void BatchNormBackward(const Tensor& x_in, const Tensor& dy_in, const Tensor& weight, const Tensor& save_mean,
                       const Tensor& save_invstd, bool training, double eps, const Tensor& dx,
                       const Tensor& dweight, const Tensor& dbias) {
  const char* op = "batch_norm_backward";
  const Dims d = CheckX(op, x_in);
  CheckSameShape(op, x_in, "x", dy_in, "dy");
  const Tensor x = ContiguousOnDevice(x_in), dy = ContiguousOnDevice(dy_in);
  if (training && CudnnTrains(d, x) && save_mean.defined() && save_invstd.defined()) {
    CheckPerChannel(op, "weight", weight, x, d.c);
    CheckPerChannel(op, "save_mean", save_mean, x, d.c);
    CheckPerChannel(op, "save_invstd", save_invstd, x, d.c);
    if (dx.defined()) CheckSameShape(op, x_in, "x", dx, "dx");
    DeviceGuard guard(x.device().index);
    if (CudnnBackward(x, dy, d, weight, save_mean, save_invstd, eps, dx, dweight, dbias)) return;
  }
  const Tensor w = PerChannel(op, "weight", weight, x, d.c);
  const Tensor mean = PerChannel(op, "save_mean", save_mean, x, d.c);
  const Tensor invstd = PerChannel(op, "save_invstd", save_invstd, x, d.c);
  if (!mean.defined() || !invstd.defined()) throw std::invalid_argument("batch_norm_backward: saved statistics missing");
  const Tensor sum_dy = Scratch(x, d.c), sum_dy_xhat = Scratch(x, d.c);
  const int64_t m = d.n * d.s;
  DeviceGuard guard(x.device().index);
  const cudaStream_t stream = CurrentStream(x.device());
  BackwardReduce(dy, x, d, mean, invstd, sum_dy, sum_dy_xhat, stream);
  if (dx.defined()) {
    CheckSameShape(op, x_in, "x", dx, "dx");
    const Tensor t = Target(dx);
    // Eval mode: dx = weight * invstd * dy, as on the CPU; x is not passed,
    // so an inf or NaN in it cannot reach dx.
    const bool centered = training && m > 0;
    LaunchChecked("kernel `batch_norm_backward_elementwise`", [&] {
      return launch::BatchNormBackwardElementwise(
          dy.data_ptr(), centered ? x.data_ptr() : nullptr, t.data_ptr(), d.n, d.c, d.s, Arr(mean), Arr(invstd), Arr(w),
          centered ? Arr(sum_dy) : launch::ChannelArray{}, centered ? Arr(sum_dy_xhat) : launch::ChannelArray{},
          m > 0 ? 1.0 / static_cast<double>(m) : 0.0, ToDt(x.dtype()), stream);
    });
    Finish(dx, t);
  }
  WriteBack(dweight, sum_dy_xhat);
  WriteBack(dbias, sum_dy);
}

void BatchNormStats(const Tensor& x_in, const Tensor& sum, const Tensor& sum_sq) {
  const char* op = "batch_norm_stats";
  const Dims d = CheckX(op, x_in);
  const Tensor x = ContiguousOnDevice(x_in);
  const Tensor s = Scratch(x, d.c), q = Scratch(x, d.c);
  {
    DeviceGuard guard(x.device().index);
    const cudaStream_t stream = CurrentStream(x.device());
    if (BatchNormSplitReductions()) {
      LaunchChecked("kernel `batch_norm_stats_split`", [&] {
        return launch::BatchNormSumsSplit(x.data_ptr(), d.n, d.c, d.s, MutPtr(SplitWork(x, d)), MutPtr(s), MutPtr(q),
                                          ToDt(x.dtype()), stream);
      });
    } else {
      LaunchChecked("kernel `batch_norm_stats`", [&] {
        return launch::BatchNormSums(x.data_ptr(), d.n, d.c, d.s, MutPtr(s), MutPtr(q), ToDt(x.dtype()), stream);
      });
    }
  }
  WriteBack(sum, s);
  WriteBack(sum_sq, q);
}

void BatchNormElementwise(const Tensor& x_in, const Tensor& mean, const Tensor& invstd, const Tensor& weight,
                          const Tensor& bias, const Tensor& y) {
  const char* op = "batch_norm_elementwise";
  const Dims d = CheckX(op, x_in);
  CheckSameShape(op, x_in, "x", y, "y");
  const Tensor x = ContiguousOnDevice(x_in);
  const Tensor mu = PerChannel(op, "mean", mean, x, d.c), is = PerChannel(op, "invstd", invstd, x, d.c);
  const Tensor w = PerChannel(op, "weight", weight, x, d.c), b = PerChannel(op, "bias", bias, x, d.c);
  if (!mu.defined() || !is.defined()) throw std::invalid_argument("batch_norm_elementwise: mean and invstd are required");
  const Tensor yt = Target(y);
  {
    DeviceGuard guard(x.device().index);
    LaunchChecked("kernel `batch_norm_elementwise`", [&] {
      return launch::BatchNormElementwise(x.data_ptr(), yt.data_ptr(), d.n, d.c, d.s, Arr(mu), Arr(is), Arr(w), Arr(b),
                                          ToDt(x.dtype()), CurrentStream(x.device()));
    });
  }
  Finish(y, yt);
}

void BatchNormBackwardReduce(const Tensor& dy_in, const Tensor& x_in, const Tensor& mean, const Tensor& invstd,
                             const Tensor& sum_dy, const Tensor& sum_dy_xhat) {
  const char* op = "batch_norm_backward_reduce";
  const Dims d = CheckX(op, x_in);
  CheckSameShape(op, x_in, "x", dy_in, "dy");
  const Tensor x = ContiguousOnDevice(x_in), dy = ContiguousOnDevice(dy_in);
  const Tensor mu = PerChannel(op, "mean", mean, x, d.c), is = PerChannel(op, "invstd", invstd, x, d.c);
  if (!mu.defined() || !is.defined()) throw std::invalid_argument("batch_norm_backward_reduce: mean and invstd are required");
  const Tensor s = Scratch(x, d.c), sx = Scratch(x, d.c);
  {
    DeviceGuard guard(x.device().index);
    BackwardReduce(dy, x, d, mu, is, s, sx, CurrentStream(x.device()));
  }
  WriteBack(sum_dy, s);
  WriteBack(sum_dy_xhat, sx);
}

void BatchNormBackwardElementwise(const Tensor& dy_in, const Tensor& x_in, const Tensor& mean, const Tensor& invstd,
                                  const Tensor& weight, const Tensor& mean_dy, const Tensor& mean_dy_xhat,
                                  const Tensor& dx) {
  const char* op = "batch_norm_backward_elementwise";
  const Dims d = CheckX(op, x_in);
  CheckSameShape(op, x_in, "x", dy_in, "dy");
  CheckSameShape(op, x_in, "x", dx, "dx");
  const Tensor x = ContiguousOnDevice(x_in), dy = ContiguousOnDevice(dy_in);
  const Tensor mu = PerChannel(op, "mean", mean, x, d.c), is = PerChannel(op, "invstd", invstd, x, d.c);
  const Tensor w = PerChannel(op, "weight", weight, x, d.c);
  const Tensor mdy = PerChannel(op, "mean_dy", mean_dy, x, d.c);
  const Tensor mdx = PerChannel(op, "mean_dy_xhat", mean_dy_xhat, x, d.c);
  if (!mu.defined() || !is.defined() || !mdy.defined() || !mdx.defined()) {
    throw std::invalid_argument("batch_norm_backward_elementwise: mean, invstd, mean_dy and mean_dy_xhat are required");
  }
  const Tensor t = Target(dx);
  {
    DeviceGuard guard(x.device().index);
    LaunchChecked("kernel `batch_norm_backward_elementwise`", [&] {
      return launch::BatchNormBackwardElementwise(dy.data_ptr(), x.data_ptr(), t.data_ptr(), d.n, d.c, d.s, Arr(mu),
                                                  Arr(is), Arr(w), Arr(mdy), Arr(mdx), 1.0, ToDt(x.dtype()),
                                                  CurrentStream(x.device()));
    });
  }
  Finish(dx, t);
}

}  // namespace ddp::nn::cuda
