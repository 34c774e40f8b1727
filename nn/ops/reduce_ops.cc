// Sums and means (differentiable) and argmax.
#include <limits>
#include <stdexcept>

#include "nn/ops/autocast.h"
#include "nn/ops/functional.h"
#include "nn/ops/op_util.h"

namespace ddp::nn::ops {

using detail::LambdaNode;

namespace {

// Reduces x over `dims` into keepdim shape, scaling by `scale` (the kernel
// scales the wide sum before rounding it into x's dtype).
Tensor Reduce(const Tensor& x_in, const std::vector<int64_t>& dims, bool keepdim, double scale, const char* name) {
  // Autocast: sums of many 16-bit values lose precision and overflow f16.
  const Tensor x = autocast::ToFloat32(x_in);
  if (!IsFloating(x.dtype())) {
    throw std::invalid_argument(detail::ForwardName(name) + ": needs a floating tensor, got " +
                                std::string(DTypeName(x.dtype())));
  }
  Shape kept = x.shape();
  std::vector<bool> reduced(x.dim(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = dims[i];
    if (x.dim() == 0) {
      // A 0-d tensor takes dim 0 (or -1) once, as in PyTorch, and has
      // nothing to reduce.
      detail::WrapDimOf(detail::ForwardName(name), x, d);
      if (i > 0) {
        throw std::invalid_argument(detail::ForwardName(name) + ": dimension " + std::to_string(d) + " repeated");
      }
      continue;
    }
    const int64_t w = detail::WrapDimOf(detail::ForwardName(name), x, d);
    if (reduced[w]) {
      throw std::invalid_argument(detail::ForwardName(name) + ": dimension " + std::to_string(d) + " repeated");
    }
    reduced[w] = true;
    kept[w] = 1;
  }
  Shape final_shape;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (!reduced[d] || keepdim) final_shape.push_back(kept[d]);
  }
  Tensor out = Empty(kept, {.dtype = x.dtype(), .device = x.device()});
  DDP_KERNEL(x.device(), sum_to)(x, out, scale);
  out = out.View(final_shape);
  if (!detail::AnyRequiresGrad({&x})) return out;
  const Shape in = x.shape();
  auto node = std::make_shared<LambdaNode>(name, [in, kept, scale](LambdaNode&, std::vector<Tensor>& g) {
    Tensor gk = g[0].Reshape(kept);
    if (scale != 1.0) {
      Tensor s = Empty(kept, {.dtype = gk.dtype(), .device = gk.device()});
      DDP_KERNEL(gk.device(), affine)(gk, scale, 0.0, s);
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

Tensor Sum(const Tensor& x) { return Reduce(x, AllDims(x), false, 1.0, "SumBackward"); }

// An empty dims list means every dimension, as in PyTorch 1.13's
// sum(dim=[]) and mean(dim=[]).
Tensor Sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  if (dims.empty()) return Reduce(x, AllDims(x), keepdim, 1.0, "SumBackward");
  return Reduce(x, dims, keepdim, 1.0, "SumBackward");
}

Tensor Mean(const Tensor& x) {
  return Reduce(x, AllDims(x), false, MeanScale(static_cast<double>(x.numel())), "MeanBackward");
}

Tensor Mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  if (dims.empty()) {
    return Reduce(x, AllDims(x), keepdim, MeanScale(static_cast<double>(x.numel())), "MeanBackward");
  }
  return Reduce(x, dims, keepdim, MeanScale(Count(x, dims)), "MeanBackward");
}

Tensor Argmax(const Tensor& x, int64_t dim) {
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
