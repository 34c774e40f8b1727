// Sums and means (differentiable) and argmax.
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "nn/ops/autocast.h"
#include "nn/ops/functional.h"
#include "nn/ops/op_util.h"

namespace ddp::nn::ops {

using detail::LambdaNode;

namespace {

// The shapes of a reduction of x over `dims`: `kept` has x's rank with the
// reduced dimensions at size 1, `result` drops them unless keepdim. Throws,
// naming `op`, for a dim out of range or repeated.
struct ReducedShapes {
  Shape kept, result;
};

ReducedShapes ShapesOf(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, const std::string& op) {
  Shape kept = x.shape();
  std::vector<bool> reduced(x.dim(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = dims[i];
    if (x.dim() == 0) {
      // A 0-d tensor takes dim 0 (or -1) once, as in PyTorch, and has
      // nothing to reduce.
      detail::WrapDimOf(op, x, d);
      if (i > 0) throw std::invalid_argument(op + ": dimension " + std::to_string(d) + " repeated");
      continue;
    }
    const int64_t w = detail::WrapDimOf(op, x, d);
    if (reduced[w]) throw std::invalid_argument(op + ": dimension " + std::to_string(d) + " repeated");
    reduced[w] = true;
    kept[w] = 1;
  }
  Shape result;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (!reduced[d] || keepdim) result.push_back(kept[d]);
  }
  return {kept, result};
}

// The sum of an integer tensor over `dims`, in i64 as torch.sum of an
// integer or bool tensor (wrapping as two's complement on overflow, as
// PyTorch's does). No gradient. Only on the CPU: the device kernels sum
// floating tensors alone.
Tensor IntegerSum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  if (!x.device().is_cpu()) {
    throw std::invalid_argument("Sum: summing an integer tensor (" + std::string(DTypeName(x.dtype())) +
                                ") is implemented on the CPU only, not on " + x.device().ToString());
  }
  const ReducedShapes shapes = ShapesOf(x, dims, keepdim, "Sum");
  const Tensor xi = x.Detach().To(DType::kInt64).Contiguous();
  Tensor out = Zeros(shapes.kept, {.dtype = DType::kInt64, .device = x.device()});
  const Shape& xs = xi.shape();
  // Where each input element lands: out's contiguous strides, 0 along the
  // reduced dimensions.
  Shape out_strides = ContiguousStrides(shapes.kept);
  for (size_t d = 0; d < xs.size(); ++d) {
    if (shapes.kept[d] != xs[d]) out_strides[d] = 0;
  }
  const int64_t* src = xi.data<int64_t>();
  int64_t* dst = out.data<int64_t>();
  std::vector<int64_t> index(xs.size(), 0);
  int64_t at = 0;
  for (int64_t i = 0; i < xi.numel(); ++i) {
    dst[at] = static_cast<int64_t>(static_cast<uint64_t>(dst[at]) + static_cast<uint64_t>(src[i]));
    // Next index, last dimension fastest.
    for (size_t d = xs.size(); d-- > 0;) {
      at += out_strides[d];
      if (++index[d] < xs[d]) break;
      at -= out_strides[d] * xs[d];
      index[d] = 0;
    }
  }
  return out.View(shapes.result);
}

// Reduces x over `dims` into keepdim shape, scaling by `scale` (the kernel
// scales the wide sum before rounding it into x's dtype).
Tensor Reduce(const Tensor& x_in, const std::vector<int64_t>& dims, bool keepdim, double scale, const char* name) {
  // Autocast: sums of many 16-bit values lose precision and overflow f16.
  const Tensor x = autocast::ToFloat32(x_in);
  if (!IsFloating(x.dtype())) {
    throw std::invalid_argument(detail::ForwardName(name) + ": needs a floating tensor, got " +
                                std::string(DTypeName(x.dtype())));
  }
  const ReducedShapes shapes = ShapesOf(x, dims, keepdim, detail::ForwardName(name));
  const Shape& kept = shapes.kept;
  const Shape& final_shape = shapes.result;
  Tensor out = Empty(kept, {.dtype = x.dtype(), .device = x.device()});
  DDP_KERNEL(x.device(), sum_to)(x, out, scale);
  out = out.View(final_shape);
  if (!detail::AnyRequiresGrad({&x})) return out;
  const Shape in = x.shape();
  auto node = std::make_shared<LambdaNode>(name, [in, kept, scale](LambdaNode&, std::vector<Tensor>& g) {
    Tensor gk = g[0].Reshape(kept);
    if (scale != 1.0) {
      Tensor s = Empty(kept, {.dtype = gk.dtype(), .device = gk.device()});
      DDP_KERNEL(gk.device(), affine)(gk, scale, -0.0, s);  // -0.0: a pure scale, as MulScalar
      gk = s;
    }
    return std::vector<Tensor>{gk.Expand(in)};
  });
  detail::ConnectNode(node, {&x}, {&out});
  return out;
}

std::vector<int64_t> AllDims(const Tensor& x) {
  std::vector<int64_t> d(x.dim());
  for (int64_t i = 0; i < x.dim(); ++i) d[i] = i;
  return d;
}

double Count(const Tensor& x, const std::vector<int64_t>& dims) {
  double n = 1;
  if (x.dim() == 0) return n;  // Reduce checks the dims
  for (int64_t d : dims) n *= static_cast<double>(x.size(detail::WrapDimOf("Mean", x, d)));
  return n;
}

// The factor that turns a sum of n elements into their mean. A mean of no
// elements is NaN, as in PyTorch (the empty sum, 0, times NaN).
double MeanScale(double n) { return n == 0 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / n; }

}  // namespace

Tensor Sum(const Tensor& x) {
  detail::CheckDefinedOperand("Sum", "input", x);
  return Sum(x, AllDims(x), false);
}

// An empty dims list means every dimension, as in PyTorch 1.13's
// sum(dim=[]) and mean(dim=[]).
Tensor Sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  detail::CheckDefinedOperand("Sum", "input", x);
  const std::vector<int64_t> over = dims.empty() ? AllDims(x) : dims;
  if (!IsFloating(x.dtype())) return IntegerSum(x, over, keepdim);
  return Reduce(x, over, keepdim, 1.0, "SumBackward");
}

Tensor Mean(const Tensor& x) {
  detail::CheckDefinedOperand("Mean", "input", x);
  return Reduce(x, AllDims(x), false, MeanScale(static_cast<double>(x.numel())), "MeanBackward");
}

Tensor Mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  detail::CheckDefinedOperand("Mean", "input", x);
  if (dims.empty()) {
    return Reduce(x, AllDims(x), keepdim, MeanScale(static_cast<double>(x.numel())), "MeanBackward");
  }
  return Reduce(x, dims, keepdim, MeanScale(Count(x, dims)), "MeanBackward");
}

Tensor Argmax(const Tensor& x, int64_t dim) {
  detail::CheckDefinedOperand("argmax", "input", x);
  dim = detail::WrapDimOf("argmax", x, dim);
  if (x.dim() == 0) return Zeros({}, {.dtype = DType::kInt64, .device = x.device()});  // its only element
  if (x.size(dim) == 0) {
    throw std::invalid_argument("argmax: dimension " + std::to_string(dim) + " of " + ShapeToString(x.shape()) +
                                " has size 0, so it has no largest element");
  }
  Shape shape = x.shape();
  shape.erase(shape.begin() + dim);
  Tensor out = Empty(shape, {.dtype = DType::kInt64, .device = x.device()});
  DDP_KERNEL(x.device(), argmax)(x, dim, out);
  return out;
}

}  // namespace ddp::nn::ops
