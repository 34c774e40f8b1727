// Convolution and pooling (NCHW). Shapes:
//   conv2d: x [N, C, H, W], w [O, C/G, KH, KW], bias [O] -> y [N, O, OH, OW]
//   pooling: x [N, C, H, W] -> y [N, C, OH, OW]
//   OH = floor_or_ceil((H + 2*pad - dilation*(K-1) - 1) / stride) + 1
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>

#include "nn/ops/autocast.h"
#include "nn/ops/functional.h"
#include "nn/ops/op_util.h"

namespace ddp::nn::ops {

using detail::LambdaNode;

namespace {

// ConvOutputSize for `op`, naming the parameters with `axis` appended
// ("dilation_h" for conv2d's height; "dilation" for the public function).
// Every step is checked for int64 overflow: a wrapped span or padded length
// gave a bogus output size (INT64_MIN, or a [1, 1, 6, 2] convolution with
// dilation 2^63 - 1), and let the kernels step through windows that do not
// exist.
int64_t OutputSize(const std::string& op, const std::string& axis, int64_t in, int64_t kernel, int64_t stride,
                   int64_t pad, int64_t dilation, bool ceil_mode) {
  const auto check = [&](const char* what, int64_t v, int64_t least) {
    if (v < least) {
      throw std::invalid_argument(op + ": " + what + axis + " must be at least " + std::to_string(least) + ", got " +
                                  std::to_string(v));
    }
  };
  check("input size", in, 0);
  check("kernel", kernel, 1);
  check("stride", stride, 1);
  check("pad", pad, 0);
  check("dilation", dilation, 1);
  int64_t reach = 0;  // span of the window minus one: dilation * (kernel - 1)
  if (__builtin_mul_overflow(dilation, kernel - 1, &reach)) {
    throw std::invalid_argument(op + ": dilation" + axis + " " + std::to_string(dilation) + " times kernel" + axis +
                                " - 1 (" + std::to_string(kernel - 1) + ") overflows int64");
  }
  int64_t padded = 0;  // in + 2 * pad
  if (__builtin_mul_overflow(pad, int64_t{2}, &padded) || __builtin_add_overflow(in, padded, &padded)) {
    throw std::invalid_argument(op + ": pad" + axis + " " + std::to_string(pad) + " on both sides of an input of " +
                                std::to_string(in) + " overflows int64");
  }
  // PyTorch's rule: floor((in + 2 pad - span [+ stride - 1 with ceil_mode]) /
  // stride) + 1, so with ceil_mode an input shorter than the window by less
  // than a stride still gives one window. Both terms are in [0, 2^63 - 1], so
  // num cannot wrap; the ceiling is taken without adding stride - 1 to it.
  const int64_t num = padded - reach - 1;
  int64_t out = 0;
  if (num >= 0) {
    out = num / stride + (ceil_mode && num % stride != 0 ? 1 : 0) + 1;
  } else if (ceil_mode && num + (stride - 1) >= 0) {
    out = 1;
  } else {
    return 0;
  }
  // With ceil_mode the last window must start inside the input or its left
  // padding: (out - 1) * stride < in + pad, compared without the product.
  if (ceil_mode) {
    const int64_t limit = in + pad;  // at most padded
    if (out - 1 >= limit / stride + (limit % stride != 0 ? 1 : 0)) --out;
  }
  return out;
}

}  // namespace

int64_t ConvOutputSize(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation, bool ceil_mode) {
  // Public, so checked here too: a stride of 0 divided by zero (SIGFPE).
  return OutputSize("ConvOutputSize", "", in, kernel, stride, pad, dilation, ceil_mode);
}

namespace {

std::string Geometry(const Conv2dParams& p) {
  return "stride (" + std::to_string(p.stride_h) + ", " + std::to_string(p.stride_w) + "), padding (" +
         std::to_string(p.pad_h) + ", " + std::to_string(p.pad_w) + "), dilation (" + std::to_string(p.dilation_h) +
         ", " + std::to_string(p.dilation_w) + ")";
}

void CheckPositive(const char* op, const char* what, int64_t a, int64_t b) {
  if (a < 1 || b < 1) {
    throw std::invalid_argument(std::string(op) + ": " + what + " must be positive, got (" + std::to_string(a) +
                                ", " + std::to_string(b) + ")");
  }
}

}  // namespace

Tensor Conv2d(const Tensor& x_orig, const Tensor& w_orig, const Tensor& bias_orig, const Conv2dParams& p) {
  // Integer operands are refused before anything is cast (an integer weight
  // gave an integer output; an integer input was converted silently).
  detail::CheckFloatingOperand("conv2d", "input", x_orig);
  detail::CheckFloatingOperand("conv2d", "weight", w_orig);
  if (bias_orig.defined()) detail::CheckFloatingOperand("conv2d", "bias", bias_orig);
  autocast::CheckNoF64Mix("conv2d", x_orig, w_orig);
  // Autocast: input, weight and bias in the low dtype (a no-op when it is off).
  const Tensor x_in = autocast::ToLowPrecision(x_orig);
  const Tensor w = autocast::ToLowPrecision(w_orig);
  const Tensor bias = autocast::ToLowPrecision(bias_orig);
  if (w.dim() != 4) throw std::invalid_argument("conv2d: weight must be [O, C/groups, KH, KW], got " + ShapeToString(w.shape()));
  if (p.groups < 1) throw std::invalid_argument("conv2d: groups must be positive, got " + std::to_string(p.groups));
  CheckPositive("conv2d", "stride", p.stride_h, p.stride_w);
  CheckPositive("conv2d", "dilation", p.dilation_h, p.dilation_w);
  if (p.pad_h < 0 || p.pad_w < 0) {
    throw std::invalid_argument("conv2d: padding must be non-negative, got (" + std::to_string(p.pad_h) + ", " +
                                std::to_string(p.pad_w) + ")");
  }
  int64_t cin = 0;
  if (__builtin_mul_overflow(w.size(1), p.groups, &cin)) {
    throw std::invalid_argument("conv2d: groups " + std::to_string(p.groups) + " times the weight's " +
                                std::to_string(w.size(1)) + " channels per group overflows int64");
  }
  if (x_in.dim() != 4 || x_in.size(1) != cin) {
    throw std::invalid_argument("conv2d: expected input [N, " + std::to_string(cin) + ", H, W], got " +
                                ShapeToString(x_in.shape()));
  }
  // As PyTorch: an empty plane is refused even where padding would give an
  // output (it would hold only padding and bias).
  if (x_in.size(2) == 0 || x_in.size(3) == 0) {
    throw std::invalid_argument("conv2d: only a zero batch or zero channels may be empty, got input " +
                                ShapeToString(x_in.shape()));
  }
  // Bounds the loops over groups; a positive O divisible by groups implies
  // it, 0 output channels run with one group only.
  if (p.groups > std::max<int64_t>(w.size(0), 1)) {
    throw std::invalid_argument("conv2d: groups " + std::to_string(p.groups) + " is more than the weight's " +
                                std::to_string(w.size(0)) + " output channels " + ShapeToString(w.shape()));
  }
  if (w.size(0) % p.groups != 0) {
    throw std::invalid_argument("conv2d: " + std::to_string(w.size(0)) + " output channels are not divisible by " +
                                std::to_string(p.groups) + " groups");
  }
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != w.size(0))) {
    throw std::invalid_argument("conv2d: bias of shape " + ShapeToString(bias.shape()) + " for " +
                                std::to_string(w.size(0)) + " output channels");
  }
  const Tensor x = x_in.dtype() == w.dtype() ? x_in : Cast(x_in, w.dtype());
  detail::CheckSameDevice("conv2d", x, w);
  if (bias.defined()) detail::CheckSameDevice("conv2d", x, bias);
  const int64_t oh = OutputSize("conv2d", "_h", x.size(2), w.size(2), p.stride_h, p.pad_h, p.dilation_h, false);
  const int64_t ow = OutputSize("conv2d", "_w", x.size(3), w.size(3), p.stride_w, p.pad_w, p.dilation_w, false);
  if (oh < 1 || ow < 1) {
    throw std::invalid_argument("conv2d: input " + ShapeToString(x.shape()) + " is smaller than the kernel " +
                                ShapeToString(w.shape()) + " with " + Geometry(p));
  }
  Tensor y = Empty({x.size(0), w.size(0), oh, ow}, {.dtype = w.dtype(), .device = w.device()});
  const Tensor b = bias.defined() && bias.dtype() != w.dtype() ? bias.Detach().To(w.dtype()) : bias;
  DDP_KERNEL(x.device(), conv2d_forward)(x, w, b, y, p);
  if (!detail::AnyRequiresGrad({&x, &w, &bias})) return y;
  // The kernel fills the bias gradient in w's dtype (the forward read the
  // bias through an unrecorded cast); it goes back in the bias's own dtype,
  // which is what the node that made the bias expects.
  const DType bias_dtype = bias.defined() ? bias.dtype() : w.dtype();
  auto node = std::make_shared<LambdaNode>("Conv2dBackward", [p, bias_dtype](LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor xv = n.saved[0].Get(), wv = n.saved[1].Get();
    Tensor gx, gw, gb;
    if (n.needs_input_grad(0)) gx = detail::NewLike(xv);
    if (n.needs_input_grad(1)) gw = detail::NewLike(wv);
    if (n.needs_input_grad(2)) gb = Empty({wv.size(0)}, {.dtype = wv.dtype(), .device = wv.device()});
    DDP_KERNEL(xv.device(), conv2d_backward)(xv, wv, g[0], gx, gw, gb, p);
    if (gb.defined() && gb.dtype() != bias_dtype) gb = gb.To(bias_dtype);
    return std::vector<Tensor>{gx, gw, gb};
  });
  node->saved.emplace_back(x);
  node->saved.emplace_back(w);
  detail::ConnectNode(node, {&x, &w, &bias}, {&y});
  return y;
}

Tensor Conv1d(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv1dParams& p) {
  // Checked here, naming the shapes as given: Conv2d's own errors would
  // show the added height of 1.
  detail::CheckFloatingOperand("conv1d", "input", x);
  detail::CheckFloatingOperand("conv1d", "weight", w);
  if (w.dim() != 3) {
    throw std::invalid_argument("conv1d: weight must be [O, C/groups, K], got " + ShapeToString(w.shape()));
  }
  if (p.groups < 1) throw std::invalid_argument("conv1d: groups must be positive, got " + std::to_string(p.groups));
  int64_t cin = 0;
  if (__builtin_mul_overflow(w.size(1), p.groups, &cin)) {
    throw std::invalid_argument("conv1d: groups " + std::to_string(p.groups) + " times the weight's " +
                                std::to_string(w.size(1)) + " channels per group overflows int64");
  }
  // [C, L] is an unbatched input (PyTorch 1.13 takes it): it runs as a
  // batch of one, checked and shown here as given.
  const bool unbatched = x.dim() == 2;
  if ((x.dim() != 3 && !unbatched) || x.size(-2) != cin) {
    throw std::invalid_argument("conv1d: expected input [N, " + std::to_string(cin) + ", L] or [" +
                                std::to_string(cin) + ", L], got " + ShapeToString(x.shape()));
  }
  if (x.size(-1) == 0) {
    throw std::invalid_argument("conv1d: only a zero batch or zero channels may be empty, got input " +
                                ShapeToString(x.shape()));
  }
  // Conv2d's own checks of these would show the weight with its added height.
  if (p.groups > std::max<int64_t>(w.size(0), 1)) {
    throw std::invalid_argument("conv1d: groups " + std::to_string(p.groups) + " is more than the weight's " +
                                std::to_string(w.size(0)) + " output channels " + ShapeToString(w.shape()));
  }
  if (w.size(0) % p.groups != 0) {
    throw std::invalid_argument("conv1d: " + std::to_string(w.size(0)) + " output channels are not divisible by " +
                                std::to_string(p.groups) + " groups");
  }
  const int64_t ol = OutputSize("conv1d", "", x.size(-1), w.size(2), p.stride, p.pad, p.dilation, false);
  if (ol < 1) {
    throw std::invalid_argument("conv1d: input " + ShapeToString(x.shape()) + " is shorter than the kernel " +
                                ShapeToString(w.shape()) + " with stride " + std::to_string(p.stride) +
                                ", padding " + std::to_string(p.pad) + ", dilation " + std::to_string(p.dilation));
  }
  const Conv2dParams p2{.stride_h = 1, .stride_w = p.stride, .pad_h = 0, .pad_w = p.pad, .dilation_h = 1,
                        .dilation_w = p.dilation, .groups = p.groups};
  // Autocast casts the parameters here, before the views: the view of a
  // parameter is no leaf, and its cast would not be cached (Conv2d then
  // finds its operands in the low dtype already).
  autocast::CheckNoF64Mix("conv1d", x, w);
  const Tensor w_low = autocast::ToLowPrecision(w);
  const Tensor bias_low = autocast::ToLowPrecision(bias);
  const Tensor batched = unbatched ? Unsqueeze(x, 0) : x;
  try {
    const Tensor y = Squeeze(Conv2d(Unsqueeze(batched, 2), Unsqueeze(w_low, 2), bias_low, p2), 2);
    return unbatched ? Squeeze(y, 0) : y;
  } catch (const std::invalid_argument& e) {
    // What is left (groups against channels, the bias's shape, devices)
    // names no height; it is reported as conv1d's.
    std::string what = e.what();
    if (what.rfind("conv2d: ", 0) == 0) what.replace(0, 6, "conv1d");
    throw std::invalid_argument(what);
  }
}

namespace {

// As PyTorch's pooling: an empty plane or no channels is refused even where
// padding would give windows (of padding only); an empty batch runs.
void CheckOnlyBatchEmpty(const char* op, const Tensor& x) {
  if (x.size(1) == 0 || x.size(2) == 0 || x.size(3) == 0) {
    throw std::invalid_argument(std::string(op) + ": only the batch may be empty, got input " +
                                ShapeToString(x.shape()));
  }
}

Shape PoolOutput(const char* op, const Tensor& x, const Pool2dParams& p, bool dilated) {
  detail::CheckDefinedOperand(op, "input", x);
  if (x.dim() != 4) throw std::invalid_argument(std::string(op) + ": expected input [N, C, H, W], got " + ShapeToString(x.shape()));
  CheckOnlyBatchEmpty(op, x);
  CheckPositive(op, "kernel size", p.kernel_h, p.kernel_w);
  CheckPositive(op, "stride", p.stride_h, p.stride_w);
  CheckPositive(op, "dilation", p.dilation_h, p.dilation_w);
  if (p.pad_h < 0 || p.pad_w < 0 || p.pad_h > p.kernel_h / 2 || p.pad_w > p.kernel_w / 2) {
    throw std::invalid_argument(std::string(op) + ": padding (" + std::to_string(p.pad_h) + ", " +
                                std::to_string(p.pad_w) + ") must be between 0 and half the kernel size (" +
                                std::to_string(p.kernel_h) + ", " + std::to_string(p.kernel_w) + ")");
  }
  const int64_t dh = dilated ? p.dilation_h : 1, dw = dilated ? p.dilation_w : 1;
  const int64_t oh = OutputSize(op, "_h", x.size(2), p.kernel_h, p.stride_h, p.pad_h, dh, p.ceil_mode);
  const int64_t ow = OutputSize(op, "_w", x.size(3), p.kernel_w, p.stride_w, p.pad_w, dw, p.ceil_mode);
  if (oh < 1 || ow < 1) {
    throw std::invalid_argument(std::string(op) + ": input " + ShapeToString(x.shape()) + " is smaller than the " +
                                std::to_string(p.kernel_h) + "x" + std::to_string(p.kernel_w) + " window");
  }
  return {x.size(0), x.size(1), oh, ow};
}

}  // namespace

Tensor MaxPool2d(const Tensor& x, const Pool2dParams& p) {
  const Shape out_shape = PoolOutput("max_pool2d", x, p, true);
  const bool grad = detail::AnyRequiresGrad({&x});
  // Backward finds each maximum by its i32 offset within its plane. Divided
  // rather than multiplied (W >= 1 here): with an empty batch, H * W of a
  // broadcast view can leave int64 and wrap to a small count.
  if (grad && x.size(2) > std::numeric_limits<int32_t>::max() / x.size(3)) {
    throw std::invalid_argument("max_pool2d: an input plane of " + std::to_string(x.size(2)) + "x" +
                                std::to_string(x.size(3)) +
                                " elements is more than the i32 indices kept for backward address "
                                "(2^31 - 1)");
  }
  Tensor y = detail::NewLike(x, out_shape);
  // Indices are only kept for backward.
  Tensor indices = grad ? Empty(out_shape, {.dtype = DType::kInt32, .device = x.device()}) : Tensor();
  DDP_KERNEL(x.device(), max_pool2d_forward)(x, y, indices, p);
  if (!grad) return y;
  const Shape in = x.shape();
  const DType dt = x.dtype();
  auto node = std::make_shared<LambdaNode>("MaxPool2dBackward", [in, dt, p](LambdaNode& n, std::vector<Tensor>& g) {
    Tensor gx = Empty(in, {.dtype = dt, .device = g[0].device()});
    DDP_KERNEL(gx.device(), max_pool2d_backward)(g[0], n.saved[0].Get(), gx, p);
    return std::vector<Tensor>{gx};
  });
  node->saved.emplace_back(indices);
  detail::ConnectNode(node, {&x}, {&y});
  return y;
}

Tensor AvgPool2d(const Tensor& x, const Pool2dParams& p) {
  if (p.dilation_h != 1 || p.dilation_w != 1) {
    throw std::invalid_argument("avg_pool2d: average pooling has no dilation, got (" + std::to_string(p.dilation_h) +
                                ", " + std::to_string(p.dilation_w) + ")");
  }
  const Shape out_shape = PoolOutput("avg_pool2d", x, p, false);
  Tensor y = detail::NewLike(x, out_shape);
  DDP_KERNEL(x.device(), avg_pool2d_forward)(x, y, p);
  if (!detail::AnyRequiresGrad({&x})) return y;
  const Shape in = x.shape();
  const DType dt = x.dtype();
  auto node = std::make_shared<LambdaNode>("AvgPool2dBackward", [in, dt, p](LambdaNode&, std::vector<Tensor>& g) {
    Tensor gx = Empty(in, {.dtype = dt, .device = g[0].device()});
    DDP_KERNEL(gx.device(), avg_pool2d_backward)(g[0], gx, p);
    return std::vector<Tensor>{gx};
  });
  detail::ConnectNode(node, {&x}, {&y});
  return y;
}

Tensor AdaptiveAvgPool2d(const Tensor& x, int64_t out_h, int64_t out_w) {
  detail::CheckDefinedOperand("adaptive_avg_pool2d", "input", x);
  if (x.dim() != 4) {
    throw std::invalid_argument("adaptive_avg_pool2d: expected input [N, C, H, W], got " + ShapeToString(x.shape()));
  }
  // 0 is taken, as in PyTorch 1.13: an empty output (and a zero gradient).
  if (out_h < 0 || out_w < 0) {
    throw std::invalid_argument("adaptive_avg_pool2d: output size must not be negative, got (" +
                                std::to_string(out_h) + ", " + std::to_string(out_w) + ")");
  }
  CheckOnlyBatchEmpty("adaptive_avg_pool2d", x);
  // The kernels bound output row o's window by (o * H) / out_h and
  // ((o + 1) * H + out_h - 1) / out_h (columns alike): out_h * (H + 1) must
  // fit in int64, or the windows would wrap and read outside the plane.
  for (const auto& [what, out, in] : {std::tuple{"height", out_h, x.size(2)}, std::tuple{"width", out_w, x.size(3)}}) {
    int64_t product = 0;
    if (__builtin_mul_overflow(out, in, &product) || __builtin_add_overflow(product, out, &product)) {
      throw std::invalid_argument(std::string("adaptive_avg_pool2d: output ") + what + " " + std::to_string(out) +
                                  " times the input's " + what + " " + std::to_string(in) +
                                  " overflows the int64 window bounds; got input " + ShapeToString(x.shape()));
    }
  }
  Tensor y = detail::NewLike(x, {x.size(0), x.size(1), out_h, out_w});
  // An empty output has no window to average, and no input element reaches
  // it: the kernels are skipped both ways, and the gradient is zeros.
  const bool empty_output = out_h == 0 || out_w == 0;
  if (!empty_output) DDP_KERNEL(x.device(), adaptive_avg_pool2d_forward)(x, y);
  if (!detail::AnyRequiresGrad({&x})) return y;
  const Shape in = x.shape();
  const DType dt = x.dtype();
  auto backward = [in, dt, empty_output](LambdaNode&, std::vector<Tensor>& g) {
    if (empty_output) return std::vector<Tensor>{Zeros(in, {.dtype = dt, .device = g[0].device()})};
    Tensor gx = Empty(in, {.dtype = dt, .device = g[0].device()});
    DDP_KERNEL(gx.device(), adaptive_avg_pool2d_backward)(g[0], gx);
    return std::vector<Tensor>{gx};
  };
  auto node = std::make_shared<LambdaNode>("AdaptiveAvgPool2dBackward", backward);
  detail::ConnectNode(node, {&x}, {&y});
  return y;
}

}  // namespace ddp::nn::ops
