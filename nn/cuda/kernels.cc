// Host side of the CUDA kernel table: checks operands, builds the index
// geometry and launches the .cu kernels on the current stream of the
// operands' device. Inputs may have any strides (elementwise kernels index
// them directly; softmax, cross-entropy and NLL first make them contiguous
// on the device). Outputs are written through their strides unless a kernel
// says otherwise.
#include "nn/cuda/kernels.h"

#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "nn/cuda/batch_norm.h"
#include "nn/cuda/conv.h"
#include "nn/cuda/cuda_error.h"
#include "nn/cuda/gemm.h"
#include "nn/cuda/indexing.h"
#include "nn/cuda/launch.h"
#include "nn/cuda/stream.h"

namespace ddp::nn::cuda {

namespace {

// Checks that every defined tensor is on one CUDA device; returns it.
Device CommonDevice(const char* op, std::initializer_list<const Tensor*> tensors) {
  Device device;
  bool first = true;
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    if (first) {
      device = t->device();
      first = false;
    } else if (t->device() != device) {
      throw std::invalid_argument(std::string(op) + ": operands on " + device.ToString() + " and " +
                                  t->device().ToString() + " (all must be on one CUDA device)");
    }
  }
  if (first || !device.is_cuda()) {
    throw std::invalid_argument(std::string(op) + ": CUDA kernel called on " + device.ToString());
  }
  return device;
}

void CheckSameDType(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype()) {
    throw std::invalid_argument(std::string(op) + ": dtypes " + std::string(DTypeName(a.dtype())) + " and " +
                                std::string(DTypeName(b.dtype())) + " differ");
  }
}

void CheckFloating(const char* op, const Tensor& t) {
  if (!IsFloating(t.dtype())) {
    throw std::invalid_argument(std::string(op) + ": needs a floating dtype, got " + std::string(DTypeName(t.dtype())));
  }
}

// A contiguous tensor with t's values on its device (t itself when contiguous).
Tensor ContiguousOnDevice(const Tensor& t) {
  if (t.is_contiguous()) return t;
  NoGradGuard guard;
  return t.Detach().Contiguous();
}

// Sets up the device and stream for a kernel on `device`.
struct Launch {
  explicit Launch(Device device) : guard(device.index), stream(CurrentStream(device)) {}
  DeviceGuard guard;
  cudaStream_t stream;
};

void Unary(ops::UnaryOp op, const Tensor& x, const Tensor& out) {
  const Device dev = CommonDevice("unary", {&x, &out});
  CheckSameDType("unary", x, out);
  CheckFloating("unary", out);
  if (out.numel() == 0) return;
  Launch l(dev);
  const launch::Indexing ix = MakeIndexing("unary", out.shape(), {out.strides(), BroadcastStridesTo(x, out.shape())});
  LaunchChecked("kernel `unary`", [&] {
    return launch::Unary(static_cast<int>(op), ix, out.numel(), out.data_ptr(), x.data_ptr(), ToDt(out.dtype()),
                         l.stream);
  });
}

void UnaryBackward(ops::UnaryOp op, const Tensor& grad_out, const Tensor& saved, const Tensor& grad_in) {
  const Device dev = CommonDevice("unary_backward", {&grad_out, &saved, &grad_in});
  CheckSameDType("unary_backward", grad_out, grad_in);
  CheckSameDType("unary_backward", saved, grad_in);
  CheckFloating("unary_backward", grad_in);
  if (grad_in.numel() == 0) return;
  Launch l(dev);
  const Shape& shape = grad_in.shape();
  const launch::Indexing ix = MakeIndexing(
      "unary_backward", shape,
      {grad_in.strides(), BroadcastStridesTo(grad_out, shape), BroadcastStridesTo(saved, shape)});
  LaunchChecked("kernel `unary_backward`", [&] {
    return launch::UnaryBackward(static_cast<int>(op), ix, grad_in.numel(), grad_in.data_ptr(), grad_out.data_ptr(),
                                 saved.data_ptr(), ToDt(grad_in.dtype()), l.stream);
  });
}

void Binary(ops::BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  const Device dev = CommonDevice("binary", {&a, &b, &out});
  CheckSameDType("binary", a, out);
  CheckSameDType("binary", b, out);
  // As on the CPU: ops::Div divides integers as f32, never in the integer type.
  if (op == ops::BinaryOp::kDiv && !IsFloating(out.dtype())) {
    throw std::invalid_argument("binary: division needs a floating dtype, got " + std::string(DTypeName(out.dtype())));
  }
  if (out.numel() == 0) return;
  Launch l(dev);
  const Shape& shape = out.shape();
  const launch::Indexing ix =
      MakeIndexing("binary", shape, {out.strides(), BroadcastStridesTo(a, shape), BroadcastStridesTo(b, shape)});
  LaunchChecked("kernel `binary`", [&] {
    return launch::Binary(static_cast<int>(op), ix, out.numel(), out.data_ptr(), a.data_ptr(), b.data_ptr(),
                          ToDt(out.dtype()), l.stream);
  });
}

void Clamp(const Tensor& x, double lo, double hi, const Tensor& out) {
  const Device dev = CommonDevice("clamp", {&x, &out});
  CheckSameDType("clamp", x, out);
  CheckFloating("clamp", out);
  if (out.numel() == 0) return;
  Launch l(dev);
  const launch::Indexing ix = MakeIndexing("clamp", out.shape(), {out.strides(), BroadcastStridesTo(x, out.shape())});
  LaunchChecked("kernel `clamp`", [&] {
    return launch::Clamp(ix, out.numel(), out.data_ptr(), x.data_ptr(), lo, hi, ToDt(out.dtype()), l.stream);
  });
}

void ClampBackward(const Tensor& grad_out, const Tensor& x, double lo, double hi, const Tensor& grad_in) {
  const Device dev = CommonDevice("clamp_backward", {&grad_out, &x, &grad_in});
  CheckSameDType("clamp_backward", grad_out, grad_in);
  CheckSameDType("clamp_backward", x, grad_in);
  CheckFloating("clamp_backward", grad_in);
  if (grad_in.numel() == 0) return;
  Launch l(dev);
  const Shape& shape = grad_in.shape();
  const launch::Indexing ix = MakeIndexing(
      "clamp_backward", shape, {grad_in.strides(), BroadcastStridesTo(grad_out, shape), BroadcastStridesTo(x, shape)});
  LaunchChecked("kernel `clamp_backward`", [&] {
    return launch::ClampBackward(ix, grad_in.numel(), grad_in.data_ptr(), grad_out.data_ptr(), x.data_ptr(), lo, hi,
                                 ToDt(grad_in.dtype()), l.stream);
  });
}

void Affine(const Tensor& x, double alpha, double beta, const Tensor& out) {
  const Device dev = CommonDevice("affine", {&x, &out});
  CheckSameDType("affine", x, out);
  CheckFloating("affine", out);
  if (out.numel() == 0) return;
  Launch l(dev);
  const launch::Indexing ix =
      MakeIndexing("affine", out.shape(), {out.strides(), BroadcastStridesTo(x, out.shape())});
  LaunchChecked("kernel `affine`", [&] {
    return launch::Affine(ix, out.numel(), out.data_ptr(), x.data_ptr(), alpha, beta, ToDt(out.dtype()), l.stream);
  });
}

void DivScalar(const Tensor& x, double s, const Tensor& out) {
  const Device dev = CommonDevice("div_scalar", {&x, &out});
  CheckSameDType("div_scalar", x, out);
  CheckFloating("div_scalar", out);
  if (out.numel() == 0) return;
  Launch l(dev);
  const launch::Indexing ix =
      MakeIndexing("div_scalar", out.shape(), {out.strides(), BroadcastStridesTo(x, out.shape())});
  LaunchChecked("kernel `div_scalar`", [&] {
    return launch::DivScalar(ix, out.numel(), out.data_ptr(), x.data_ptr(), s, ToDt(out.dtype()), l.stream);
  });
}

void AddScaled(const Tensor& out, const Tensor& x, double alpha) {
  const Device dev = CommonDevice("add_scaled_", {&x, &out});
  CheckSameDType("add_scaled_", x, out);
  CheckFloating("add_scaled_", out);
  if (out.numel() == 0) return;
  Launch l(dev);
  const launch::Indexing ix =
      MakeIndexing("add_scaled_", out.shape(), {out.strides(), BroadcastStridesTo(x, out.shape())});
  LaunchChecked("kernel `add_scaled_`", [&] {
    return launch::AddScaled(ix, out.numel(), out.data_ptr(), x.data_ptr(), alpha, ToDt(out.dtype()), l.stream);
  });
}

void MaskedScale(const Tensor& x, const Tensor& mask, double scale, const Tensor& out) {
  const Device dev = CommonDevice("masked_scale", {&x, &mask, &out});
  CheckSameDType("masked_scale", x, out);
  CheckFloating("masked_scale", out);
  if (mask.dtype() != DType::kUInt8) {
    throw std::invalid_argument("masked_scale: mask must be u8, got " + std::string(DTypeName(mask.dtype())));
  }
  if (out.numel() == 0) return;
  Launch l(dev);
  const Shape& shape = out.shape();
  const launch::Indexing ix = MakeIndexing("masked_scale", shape,
                                           {out.strides(), BroadcastStridesTo(x, shape), BroadcastStridesTo(mask, shape)});
  LaunchChecked("kernel `masked_scale`", [&] {
    return launch::MaskedScale(ix, out.numel(), out.data_ptr(), x.data_ptr(),
                               static_cast<const uint8_t*>(mask.data_ptr()), scale, ToDt(out.dtype()), l.stream);
  });
}

void BernoulliMask(const Tensor& mask, double keep_prob, Generator& gen) {
  const Device dev = CommonDevice("bernoulli_mask", {&mask});
  if (mask.dtype() != DType::kUInt8 || !mask.is_contiguous()) {
    throw std::invalid_argument("bernoulli_mask: mask must be contiguous u8");
  }
  if (mask.numel() == 0) return;
  Launch l(dev);
  // One draw from the generator per call seeds a counter-based hash, so a
  // seeded run is reproducible (its masks differ from the CPU's).
  const uint64_t seed = [&] {
    auto lock = gen.Lock();  // the generator may be the shared default one
    return gen.NextU64();
  }();
  LaunchChecked("kernel `bernoulli_mask`", [&] {
    return launch::BernoulliMask(static_cast<uint8_t*>(mask.data_ptr()), mask.numel(), keep_prob, seed, l.stream);
  });
}

// x: [d0, ..., dk]; out: same rank, each dimension equal to x's or 1 (summed
// over), receiving scale times the sum.
void SumTo(const Tensor& x, const Tensor& out, double scale) {
  const Device dev = CommonDevice("sum_to", {&x, &out});
  CheckFloating("sum_to", x);
  CheckFloating("sum_to", out);
  const launch::ReduceIndexing rx = MakeSumToIndexing(x, out);
  if (out.numel() == 0) return;
  Launch l(dev);
  LaunchChecked("kernel `sum_to`", [&] {
    return launch::SumTo(rx, out.data_ptr(), ToDt(out.dtype()), x.data_ptr(), ToDt(x.dtype()), scale, l.stream);
  });
}

// x: [..., D, ...] reduced along dim; out: x's shape without dim (i64).
void Argmax(const Tensor& x, int64_t dim, const Tensor& out) {
  const Device dev = CommonDevice("argmax", {&x, &out});
  dim = x.WrapDim(dim);
  if (out.dtype() != DType::kInt64) throw std::invalid_argument("argmax: out must be i64");
  Shape kept_shape, kept_x;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d == dim) continue;
    kept_shape.push_back(x.size(d));
    kept_x.push_back(x.stride(d));
  }
  if (out.numel() != NumElements(kept_shape)) {
    throw std::invalid_argument("argmax: out of shape " + ShapeToString(out.shape()) + " does not hold " +
                                ShapeToString(kept_shape));
  }
  if (out.numel() == 0) return;
  if (x.size(dim) == 0) {
    throw std::invalid_argument("argmax: dimension " + std::to_string(dim) + " of " + ShapeToString(x.shape()) +
                                " is empty");
  }
  Shape kept_out;
  if (out.shape() == kept_shape) {
    kept_out = out.strides();
  } else if (out.is_contiguous()) {
    kept_out = ContiguousStrides(kept_shape);
  } else {
    throw std::invalid_argument("argmax: out of shape " + ShapeToString(out.shape()) +
                                " must be contiguous or have shape " + ShapeToString(kept_shape));
  }
  Launch l(dev);
  const launch::Indexing ix = MakeIndexing("argmax", kept_shape, {kept_out, kept_x});
  LaunchChecked("kernel `argmax`", [&] {
    return launch::Argmax(ix, out.numel(), x.size(dim), x.stride(dim), static_cast<int64_t*>(out.data_ptr()),
                          x.data_ptr(), ToDt(x.dtype()), l.stream);
  });
}

struct Split {
  int64_t outer, d, inner;
};

Split SplitAt(const Tensor& x, int64_t dim) {
  Split s{1, x.size(dim), 1};
  for (int64_t i = 0; i < dim; ++i) s.outer *= x.size(i);
  for (int64_t i = dim + 1; i < x.dim(); ++i) s.inner *= x.size(i);
  return s;
}

// Runs `fn(dst)` into out, or into a contiguous temporary of `dtype` that is
// then copied into out (when out is strided or of another dtype).
template <typename F>
void IntoContiguous(const Tensor& out, DType dtype, F fn) {
  if (out.is_contiguous() && out.dtype() == dtype) {
    fn(out);
    return;
  }
  Tensor tmp = Empty(out.shape(), {.dtype = dtype, .device = out.device()});
  fn(tmp);
  NoGradGuard guard;
  out.CopyFrom(tmp);
}

// x, y: [outer, D, inner] around dimension dim.
void LogSoftmaxForward(const Tensor& x, int64_t dim, const Tensor& y) {
  const Device dev = CommonDevice("log_softmax", {&x, &y});
  CheckFloating("log_softmax", x);
  dim = x.WrapDim(dim);
  if (y.shape() != x.shape()) {
    throw std::invalid_argument("log_softmax: output " + ShapeToString(y.shape()) + " differs from input " +
                                ShapeToString(x.shape()));
  }
  if (x.numel() == 0) return;
  const Tensor xc = ContiguousOnDevice(x);
  const Split s = SplitAt(x, dim);
  IntoContiguous(y, x.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `log_softmax_forward`", [&] {
      return launch::LogSoftmaxForward(xc.data_ptr(), dst.data_ptr(), s.outer, s.d, s.inner, ToDt(x.dtype()), l.stream);
    });
  });
}

// dy, y, dx: [outer, D, inner] around dimension dim.
void LogSoftmaxBackward(const Tensor& dy, const Tensor& y, int64_t dim, const Tensor& dx) {
  const Device dev = CommonDevice("log_softmax_backward", {&dy, &y, &dx});
  CheckFloating("log_softmax_backward", y);
  CheckSameDType("log_softmax_backward", dy, y);
  dim = y.WrapDim(dim);
  if (dy.shape() != y.shape() || dx.shape() != y.shape()) {
    throw std::invalid_argument("log_softmax_backward: shapes " + ShapeToString(dy.shape()) + ", " +
                                ShapeToString(y.shape()) + ", " + ShapeToString(dx.shape()) + " differ");
  }
  if (y.numel() == 0) return;
  const Tensor dyc = ContiguousOnDevice(dy), yc = ContiguousOnDevice(y);
  const Split s = SplitAt(y, dim);
  IntoContiguous(dx, y.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `log_softmax_backward`", [&] {
      return launch::LogSoftmaxBackward(dyc.data_ptr(), yc.data_ptr(), dst.data_ptr(), s.outer, s.d, s.inner,
                                        ToDt(y.dtype()), l.stream);
    });
  });
}

// logits [N, C], target [N] (i64), log_probs [N, C], loss [N].
void CrossEntropyForward(const Tensor& logits, const Tensor& target, double label_smoothing, int64_t ignore_index,
                         const Tensor& log_probs, const Tensor& loss) {
  const Device dev = CommonDevice("cross_entropy", {&logits, &target, &log_probs, &loss});
  CheckFloating("cross_entropy", logits);
  CheckFloating("cross_entropy", log_probs);
  if (target.dtype() != DType::kInt64) {
    throw std::invalid_argument("cross_entropy: target must be i64, got " + std::string(DTypeName(target.dtype())));
  }
  if (logits.dim() != 2 || target.dim() != 1 || target.size(0) != logits.size(0) ||
      log_probs.shape() != logits.shape() || loss.numel() != logits.size(0)) {
    throw std::invalid_argument("cross_entropy: logits " + ShapeToString(logits.shape()) + ", target " +
                                ShapeToString(target.shape()) + ", log_probs " + ShapeToString(log_probs.shape()) +
                                ", loss " + ShapeToString(loss.shape()) + " do not fit [N, C], [N], [N, C], [N]");
  }
  const int64_t n = logits.size(0), c = logits.size(1);
  // The labels are checked on the host (a copy of N integers, which waits
  // for the device) so that a bad one is named instead of read out of bounds.
  const Tensor host_target = target.Detach().To(kCPU).Contiguous();
  const int64_t* t = host_target.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == ignore_index) continue;
    if (t[i] < 0 || t[i] >= c) {
      throw std::out_of_range("cross_entropy: target " + std::to_string(t[i]) + " (sample " + std::to_string(i) +
                              ") is out of range for " + std::to_string(c) + " classes [0, " +
                              std::to_string(c - 1) + "]");
    }
  }
  if (n == 0) return;
  Tensor lg = logits;
  if (logits.dtype() != log_probs.dtype()) {
    NoGradGuard guard;
    lg = logits.Detach().To(log_probs.dtype());
  }
  LogSoftmaxForward(lg, 1, log_probs);
  const Tensor lp = ContiguousOnDevice(log_probs);
  const Tensor tc = ContiguousOnDevice(target);
  IntoContiguous(loss, lp.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `cross_entropy_loss`", [&] {
      return launch::CrossEntropyLoss(lp.data_ptr(), static_cast<const int64_t*>(tc.data_ptr()), dst.data_ptr(), n, c,
                                      label_smoothing, ignore_index, ToDt(lp.dtype()), l.stream);
    });
  });
}

// log_probs [N, C], target [N], grad_loss [N] or one element, dlogits [N, C].
void CrossEntropyBackward(const Tensor& log_probs, const Tensor& target, const Tensor& grad_loss,
                          double label_smoothing, int64_t ignore_index, const Tensor& dlogits) {
  const Device dev = CommonDevice("cross_entropy_backward", {&log_probs, &target, &grad_loss, &dlogits});
  CheckFloating("cross_entropy_backward", log_probs);
  if (target.dtype() != DType::kInt64) {
    throw std::invalid_argument("cross_entropy_backward: target must be i64, got " +
                                std::string(DTypeName(target.dtype())));
  }
  if (log_probs.dim() != 2 || target.dim() != 1 || target.size(0) != log_probs.size(0) ||
      dlogits.shape() != log_probs.shape()) {
    throw std::invalid_argument("cross_entropy_backward: log_probs " + ShapeToString(log_probs.shape()) +
                                ", target " + ShapeToString(target.shape()) + ", dlogits " +
                                ShapeToString(dlogits.shape()) + " do not fit [N, C], [N], [N, C]");
  }
  const int64_t n = log_probs.size(0), c = log_probs.size(1);
  if (grad_loss.numel() != 1 && grad_loss.numel() != n) {
    throw std::invalid_argument("cross_entropy_backward: grad_loss of shape " + ShapeToString(grad_loss.shape()) +
                                " for " + std::to_string(n) + " samples");
  }
  if (dlogits.numel() == 0) return;
  Tensor g = grad_loss;
  if (g.dtype() != log_probs.dtype()) {
    NoGradGuard guard;
    g = grad_loss.Detach().To(log_probs.dtype());
  }
  g = ContiguousOnDevice(g);
  const Tensor lp = ContiguousOnDevice(log_probs);
  const Tensor tc = ContiguousOnDevice(target);
  IntoContiguous(dlogits, lp.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `cross_entropy_backward`", [&] {
      return launch::CrossEntropyBackward(lp.data_ptr(), static_cast<const int64_t*>(tc.data_ptr()), g.data_ptr(),
                                          g.numel() == 1 ? 0 : 1, dst.data_ptr(), n, c, label_smoothing, ignore_index,
                                          ToDt(lp.dtype()), l.stream);
    });
  });
}

// N, C and S (the positions per sample: the sizes after the class dim, 1 for
// [N, C]; not numel / (N * C), which is 0 without classes) of an NLL on
// `input` [N, C, S...] (log_probs or dlog_probs), after checking target
// [N, S...] (i64) and weight [C] (floating) or undefined.
struct NllSizes {
  int64_t n, c, s;
};

NllSizes CheckNllOperands(const char* op, const char* input_name, const Tensor& input, const Tensor& target,
                          const Tensor& weight) {
  if (target.dtype() != DType::kInt64) {
    throw std::invalid_argument(std::string(op) + ": target must be i64, got " +
                                std::string(DTypeName(target.dtype())));
  }
  Shape expected = input.shape();
  if (input.dim() >= 2) expected.erase(expected.begin() + 1);
  if (input.dim() < 2 || target.shape() != expected) {
    throw std::invalid_argument(std::string(op) + ": " + input_name + " " + ShapeToString(input.shape()) +
                                ", target " + ShapeToString(target.shape()) + " do not fit [N, C, d...], [N, d...]");
  }
  NllSizes z{input.size(0), input.size(1), 1};
  for (int64_t d = 2; d < input.dim(); ++d) z.s *= input.size(d);
  if (weight.defined()) {
    if (weight.dim() != 1 || weight.size(0) != z.c) {
      throw std::invalid_argument(std::string(op) + ": weight of shape " + ShapeToString(weight.shape()) +
                                  " does not match " + std::to_string(z.c) + " classes (expected [" +
                                  std::to_string(z.c) + "])");
    }
    CheckFloating(op, weight);
  }
  return z;
}

// Names the first target that is neither a class in [0, c) nor ignore_index,
// in the words of the CPU's CheckNllTargets (nn/ops/cpu/softmax.cc). The
// targets are copied to the host (N * S integers; the copy waits for the
// device) so that a bad one is named instead of read out of bounds.
void CheckNllTargets(const Tensor& target, int64_t c, int64_t s, int64_t ignore_index) {
  if (target.numel() == 0) return;
  const Tensor host_target = target.Detach().To(kCPU).Contiguous();
  const int64_t* t = host_target.data<int64_t>();
  for (int64_t i = 0; i < host_target.numel(); ++i) {
    if (t[i] == ignore_index || (t[i] >= 0 && t[i] < c)) continue;
    const std::string where = s == 1 ? "sample " + std::to_string(i)
                                     : "sample " + std::to_string(i / s) + ", position " + std::to_string(i % s);
    throw std::out_of_range("nll_loss: target " + std::to_string(t[i]) + " (" + where + ") is out of range for " +
                            std::to_string(c) + " classes [0, " + std::to_string(c - 1) + "]");
  }
}

// The class weights as a contiguous tensor of `dtype` on their device (as the
// CPU's, which converts them to log_probs' dtype), or undefined.
Tensor WeightOnDevice(const Tensor& weight, DType dtype) {
  if (!weight.defined()) return Tensor();
  NoGradGuard guard;
  return ContiguousOnDevice(weight.dtype() == dtype ? weight : weight.Detach().To(dtype));
}

// log_probs [N, C, S...], target [N, S...] (i64), weight [C] or undefined,
// loss [N, S...] (any shape of N * S elements), computed in log_probs' dtype.
void NllLossForward(const Tensor& log_probs, const Tensor& target, const Tensor& weight, int64_t ignore_index,
                    const Tensor& loss) {
  const Device dev = CommonDevice("nll_loss", {&log_probs, &target, &weight, &loss});
  CheckFloating("nll_loss", log_probs);
  CheckFloating("nll_loss", loss);
  const NllSizes z = CheckNllOperands("nll_loss", "log_probs", log_probs, target, weight);
  if (loss.numel() != z.n * z.s) {
    throw std::invalid_argument("nll_loss: loss of shape " + ShapeToString(loss.shape()) + " for " +
                                std::to_string(z.n * z.s) + " elements of target " + ShapeToString(target.shape()));
  }
  CheckNllTargets(target, z.c, z.s, ignore_index);
  if (z.n * z.s == 0) return;
  const Tensor lp = ContiguousOnDevice(log_probs);
  const Tensor tc = ContiguousOnDevice(target);
  const Tensor w = WeightOnDevice(weight, lp.dtype());
  IntoContiguous(loss, lp.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `nll_loss_forward`", [&] {
      return launch::NllLoss(lp.data_ptr(), static_cast<const int64_t*>(tc.data_ptr()),
                             w.defined() ? w.data_ptr() : nullptr, dst.data_ptr(), z.n, z.c, z.s, ignore_index,
                             ToDt(lp.dtype()), l.stream);
    });
  });
}

// target [N, S...] (i64), weight [C] or undefined, grad_loss [N, S...] (any
// shape of N * S elements) or one element, dlog_probs [N, C, S...]; computed
// in dlog_probs' dtype, to which grad_loss and weight are converted as on the
// CPU. Targets are checked as in the forward (the CPU checks them in both).
void NllLossBackward(const Tensor& target, const Tensor& weight, const Tensor& grad_loss, int64_t ignore_index,
                     const Tensor& dlog_probs) {
  const Device dev = CommonDevice("nll_loss_backward", {&target, &weight, &grad_loss, &dlog_probs});
  CheckFloating("nll_loss_backward", dlog_probs);
  const NllSizes z = CheckNllOperands("nll_loss_backward", "dlog_probs", dlog_probs, target, weight);
  if (grad_loss.numel() != 1 && grad_loss.numel() != z.n * z.s) {
    throw std::invalid_argument("nll_loss_backward: grad_loss of shape " + ShapeToString(grad_loss.shape()) +
                                " for " + std::to_string(z.n * z.s) + " elements of target " +
                                ShapeToString(target.shape()));
  }
  CheckNllTargets(target, z.c, z.s, ignore_index);
  if (dlog_probs.numel() == 0) return;
  const DType dt = dlog_probs.dtype();
  Tensor g = grad_loss;
  if (g.dtype() != dt) {
    NoGradGuard guard;
    g = grad_loss.Detach().To(dt);
  }
  g = ContiguousOnDevice(g);
  const Tensor tc = ContiguousOnDevice(target);
  const Tensor w = WeightOnDevice(weight, dt);
  IntoContiguous(dlog_probs, dt, [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `nll_loss_backward`", [&] {
      return launch::NllLossBackward(static_cast<const int64_t*>(tc.data_ptr()), w.defined() ? w.data_ptr() : nullptr,
                                     g.data_ptr(), g.numel() == 1 ? 0 : 1, dst.data_ptr(), z.n, z.c, z.s, ignore_index,
                                     ToDt(dt), l.stream);
    });
  });
}


// ---- pooling: x, dx [N, C, H, W]; y, dy, indices [N, C, OH, OW] ----

void CheckPoolShapes(const char* op, const Tensor& in, const Tensor& out) {
  if (in.dim() != 4 || out.dim() != 4 || in.size(0) != out.size(0) || in.size(1) != out.size(1)) {
    throw std::invalid_argument(std::string(op) + ": expected [N, C, H, W] and [N, C, OH, OW], got " +
                                ShapeToString(in.shape()) + " and " + ShapeToString(out.shape()));
  }
}

launch::PoolGeometry Geometry(const Tensor& in, const Tensor& out, const ops::Pool2dParams* p) {
  launch::PoolGeometry g;
  g.planes = in.size(0) * in.size(1);
  g.h = in.size(2);
  g.w = in.size(3);
  g.oh = out.size(2);
  g.ow = out.size(3);
  if (p != nullptr) {
    g.kh = p->kernel_h;
    g.kw = p->kernel_w;
    g.sh = p->stride_h;
    g.sw = p->stride_w;
    g.ph = p->pad_h;
    g.pw = p->pad_w;
    g.dh = p->dilation_h;
    g.dw = p->dilation_w;
    g.count_include_pad = p->count_include_pad;
    if (g.kh < 1 || g.kw < 1 || g.sh < 1 || g.sw < 1 || g.dh < 1 || g.dw < 1 || g.ph < 0 || g.pw < 0) {
      throw std::invalid_argument("pooling on CUDA: kernel, stride and dilation must be >= 1 and padding >= 0");
    }
  }
  return g;
}

void MaxPool2dForward(const Tensor& x, const Tensor& y, const Tensor& indices, const ops::Pool2dParams& p) {
  const Device dev = CommonDevice("max_pool2d", {&x, &y, &indices});
  CheckFloating("max_pool2d", x);
  CheckSameDType("max_pool2d", x, y);
  CheckPoolShapes("max_pool2d", x, y);
  if (indices.defined() && (indices.dtype() != DType::kInt32 || !indices.is_contiguous() ||
                            indices.shape() != y.shape())) {
    throw std::invalid_argument("max_pool2d: indices must be contiguous i32 of shape " + ShapeToString(y.shape()));
  }
  if (y.numel() == 0) return;
  const launch::PoolGeometry g = Geometry(x, y, &p);
  const Tensor xc = ContiguousOnDevice(x);
  IntoContiguous(y, x.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `max_pool2d_forward`", [&] {
      return launch::MaxPoolForward(g, xc.data_ptr(), dst.data_ptr(),
                                    indices.defined() ? static_cast<int32_t*>(indices.data_ptr()) : nullptr,
                                    ToDt(x.dtype()), l.stream);
    });
  });
}

void MaxPool2dBackward(const Tensor& dy, const Tensor& indices, const Tensor& dx, const ops::Pool2dParams& p) {
  const Device dev = CommonDevice("max_pool2d_backward", {&dy, &indices, &dx});
  CheckFloating("max_pool2d_backward", dx);
  CheckSameDType("max_pool2d_backward", dy, dx);
  CheckPoolShapes("max_pool2d_backward", dx, dy);
  if (indices.dtype() != DType::kInt32 || indices.shape() != dy.shape()) {
    throw std::invalid_argument("max_pool2d_backward: indices must be i32 of shape " + ShapeToString(dy.shape()));
  }
  if (dx.numel() == 0) return;
  const launch::PoolGeometry g = Geometry(dx, dy, &p);
  const Tensor dyc = ContiguousOnDevice(dy), ic = ContiguousOnDevice(indices);
  IntoContiguous(dx, dx.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `max_pool2d_backward`", [&] {
      return launch::MaxPoolBackward(g, dyc.data_ptr(), static_cast<const int32_t*>(ic.data_ptr()), dst.data_ptr(),
                                     ToDt(dx.dtype()), l.stream);
    });
  });
}

void AvgPool2dForward(const Tensor& x, const Tensor& y, const ops::Pool2dParams& p) {
  const Device dev = CommonDevice("avg_pool2d", {&x, &y});
  CheckFloating("avg_pool2d", x);
  CheckSameDType("avg_pool2d", x, y);
  CheckPoolShapes("avg_pool2d", x, y);
  if (y.numel() == 0) return;
  const launch::PoolGeometry g = Geometry(x, y, &p);
  const Tensor xc = ContiguousOnDevice(x);
  IntoContiguous(y, x.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `avg_pool2d_forward`",
                  [&] { return launch::AvgPoolForward(g, xc.data_ptr(), dst.data_ptr(), ToDt(x.dtype()), l.stream); });
  });
}

void AvgPool2dBackward(const Tensor& dy, const Tensor& dx, const ops::Pool2dParams& p) {
  const Device dev = CommonDevice("avg_pool2d_backward", {&dy, &dx});
  CheckFloating("avg_pool2d_backward", dx);
  CheckSameDType("avg_pool2d_backward", dy, dx);
  CheckPoolShapes("avg_pool2d_backward", dx, dy);
  if (dx.numel() == 0) return;
  const launch::PoolGeometry g = Geometry(dx, dy, &p);
  const Tensor dyc = ContiguousOnDevice(dy);
  IntoContiguous(dx, dx.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `avg_pool2d_backward`", [&] {
      return launch::AvgPoolBackward(g, dyc.data_ptr(), dst.data_ptr(), ToDt(dx.dtype()), l.stream);
    });
  });
}

void AdaptiveAvgPool2dForward(const Tensor& x, const Tensor& y) {
  const Device dev = CommonDevice("adaptive_avg_pool2d", {&x, &y});
  CheckFloating("adaptive_avg_pool2d", x);
  CheckSameDType("adaptive_avg_pool2d", x, y);
  CheckPoolShapes("adaptive_avg_pool2d", x, y);
  // An empty plane never gets here: ops::AdaptiveAvgPool2d refuses it first.
  if (y.numel() == 0) return;
  const launch::PoolGeometry g = Geometry(x, y, nullptr);
  const Tensor xc = ContiguousOnDevice(x);
  IntoContiguous(y, x.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `adaptive_avg_pool2d_forward`", [&] {
      return launch::AdaptiveAvgPoolForward(g, xc.data_ptr(), dst.data_ptr(), ToDt(x.dtype()), l.stream);
    });
  });
}

void AdaptiveAvgPool2dBackward(const Tensor& dy, const Tensor& dx) {
  const Device dev = CommonDevice("adaptive_avg_pool2d_backward", {&dy, &dx});
  CheckFloating("adaptive_avg_pool2d_backward", dx);
  CheckSameDType("adaptive_avg_pool2d_backward", dy, dx);
  CheckPoolShapes("adaptive_avg_pool2d_backward", dx, dy);
  if (dx.numel() == 0) return;
  const launch::PoolGeometry g = Geometry(dx, dy, nullptr);
  const Tensor dyc = ContiguousOnDevice(dy);
  IntoContiguous(dx, dx.dtype(), [&](const Tensor& dst) {
    Launch l(dev);
    LaunchChecked("kernel `adaptive_avg_pool2d_backward`", [&] {
      return launch::AdaptiveAvgPoolBackward(g, dyc.data_ptr(), dst.data_ptr(), ToDt(dx.dtype()), l.stream);
    });
  });
}

}  // namespace

ops::KernelTable CudaKernelTable() {
  ops::KernelTable t;
  t.unary = &Unary;
  t.unary_backward = &UnaryBackward;
  t.binary = &Binary;
  t.clamp = &Clamp;
  t.clamp_backward = &ClampBackward;
  t.affine = &Affine;
  t.div_scalar = &DivScalar;
  t.add_scaled_ = &AddScaled;
  t.masked_scale = &MaskedScale;
  t.bernoulli_mask = &BernoulliMask;
  t.sum_to = &SumTo;
  t.argmax = &Argmax;
  t.gemm = &Gemm;
  t.conv2d_forward = &Conv2dForward;
  t.conv2d_backward = &Conv2dBackward;
  t.max_pool2d_forward = &MaxPool2dForward;
  t.max_pool2d_backward = &MaxPool2dBackward;
  t.avg_pool2d_forward = &AvgPool2dForward;
  t.avg_pool2d_backward = &AvgPool2dBackward;
  t.adaptive_avg_pool2d_forward = &AdaptiveAvgPool2dForward;
  t.adaptive_avg_pool2d_backward = &AdaptiveAvgPool2dBackward;
  t.batch_norm_forward = &BatchNormForward;
  t.batch_norm_backward = &BatchNormBackward;
  t.batch_norm_saved_dtype = &BatchNormSavedDType;
  t.batch_norm_stats = &BatchNormStats;
  t.batch_norm_elementwise = &BatchNormElementwise;
  t.batch_norm_backward_reduce = &BatchNormBackwardReduce;
  t.batch_norm_backward_elementwise = &BatchNormBackwardElementwise;
  t.log_softmax_forward = &LogSoftmaxForward;
  t.log_softmax_backward = &LogSoftmaxBackward;
  t.cross_entropy_forward = &CrossEntropyForward;
  t.cross_entropy_backward = &CrossEntropyBackward;
  t.nll_loss_forward = &NllLossForward;
  t.nll_loss_backward = &NllLossBackward;
  return t;
}

bool VectorizedElementwise() { return launch::VectorizedElementwise(); }

void SetVectorizedElementwise(bool on) { launch::SetVectorizedElementwise(on); }

uint64_t PackedElementwiseLaunches() { return launch::PackedElementwiseLaunches(); }

}  // namespace ddp::nn::cuda
