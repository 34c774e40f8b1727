// Differentiable views and copies. The forward reuses Tensor's raw member
// functions on a detached alias; the node maps the gradient back to the
// input's shape.
#include <functional>
#include <numeric>
#include <stdexcept>
#include <string>

#include "nn/ops/functional.h"
#include "nn/ops/op_util.h"

namespace ddp::nn::ops {

using detail::LambdaNode;

namespace {

using Back = std::function<Tensor(const Tensor& g)>;

Tensor Record(const Tensor& x, Tensor out, const char* name, Back back) {
  if (!detail::AnyRequiresGrad({&x})) return out;
  auto node = std::make_shared<LambdaNode>(name, [back = std::move(back)](LambdaNode&, std::vector<Tensor>& g) {
    return std::vector<Tensor>{back(g[0])};
  });
  detail::ConnectNode(node, {&x}, {&out});
  return out;
}

// Runs a Tensor member view of x, so that its errors name the call: an
// undefined x is refused naming `op` (Detach would say only "Detach on an
// undefined tensor"), and `op` goes at the head of a dimension, index or
// shape error that does not name it already (Tensor::WrapDim says only
// "dimension 5 out of range ...", a -1 shape only "shape [5, -1] is
// invalid for 12 elements").
template <typename F>
Tensor Named(const char* op, const Tensor& x, F view) {
  detail::CheckDefinedOperand(op, "input", x);
  const auto named = [op](const std::exception& e) {
    const std::string what = e.what();
    return what.rfind(std::string(op) + ":", 0) == 0 ? what : std::string(op) + ": " + what;
  };
  try {
    return view();
  } catch (const std::out_of_range& e) {
    throw std::out_of_range(named(e));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(named(e));
  }
}

Back ReshapeBack(const Shape& in) {
  return [in](const Tensor& g) { return g.Reshape(in); };
}

}  // namespace

Tensor View(const Tensor& x, const Shape& shape) {
  Tensor out = Named("View", x, [&] { return x.Detach().View(shape); });
  return Record(x, out, "ViewBackward", ReshapeBack(x.shape()));
}

Tensor Reshape(const Tensor& x, const Shape& shape) {
  Tensor out = Named("Reshape", x, [&] { return x.Detach().Reshape(shape); });
  return Record(x, out, "ReshapeBackward", ReshapeBack(x.shape()));
}

Tensor Flatten(const Tensor& x, int64_t start, int64_t end) {
  Tensor out = Named("Flatten", x, [&] { return x.Detach().Flatten(start, end); });
  return Record(x, out, "FlattenBackward", ReshapeBack(x.shape()));
}

Tensor Unsqueeze(const Tensor& x, int64_t dim) {
  Tensor out = Named("Unsqueeze", x, [&] { return x.Detach().Unsqueeze(dim); });
  return Record(x, out, "UnsqueezeBackward", ReshapeBack(x.shape()));
}

Tensor Squeeze(const Tensor& x, int64_t dim) {
  Tensor out = Named("Squeeze", x, [&] { return x.Detach().Squeeze(dim); });
  return Record(x, out, "SqueezeBackward", ReshapeBack(x.shape()));
}

Tensor Transpose(const Tensor& x, int64_t d0, int64_t d1) {
  Tensor out = Named("Transpose", x, [&] { return x.Detach().Transpose(d0, d1); });
  return Record(x, out, "TransposeBackward", [d0, d1](const Tensor& g) { return g.Transpose(d0, d1); });
}

Tensor Permute(const Tensor& x, const Shape& dims) {
  Tensor out = Named("Permute", x, [&] { return x.Detach().Permute(dims); });
  Shape inverse(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inverse[x.WrapDim(dims[i])] = static_cast<int64_t>(i);
  return Record(x, out, "PermuteBackward", [inverse](const Tensor& g) { return g.Permute(inverse); });
}

Tensor Narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  Tensor out = Named("Narrow", x, [&] { return x.Detach().Narrow(dim, start, length); });
  const Shape in = x.shape();
  const DType dt = x.dtype();
  const Device dev = x.device();
  return Record(x, out, "NarrowBackward", [=](const Tensor& g) {
    Tensor z = Zeros(in, {.dtype = dt, .device = dev});
    z.Narrow(dim, start, length).CopyFrom(g);
    return z;
  });
}

Tensor Slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  Tensor out = Named("Slice", x, [&] { return x.Detach().Slice(dim, start, end, step); });
  const Shape in = x.shape();
  const DType dt = x.dtype();
  const Device dev = x.device();
  return Record(x, out, "SliceBackward", [=](const Tensor& g) {
    Tensor z = Zeros(in, {.dtype = dt, .device = dev});
    z.Slice(dim, start, end, step).CopyFrom(g);
    return z;
  });
}

Tensor Select(const Tensor& x, int64_t dim, int64_t index) {
  Tensor out = Named("Select", x, [&] { return x.Detach().Select(dim, index); });
  const Shape in = x.shape();
  const DType dt = x.dtype();
  const Device dev = x.device();
  return Record(x, out, "SelectBackward", [=](const Tensor& g) {
    Tensor z = Zeros(in, {.dtype = dt, .device = dev});
    z.Select(dim, index).CopyFrom(g);
    return z;
  });
}

Tensor Expand(const Tensor& x, const Shape& shape) {
  detail::CheckDefinedOperand("Expand", "input", x);
  const Shape in = x.shape();
  return Record(x, x.Detach().Expand(shape), "ExpandBackward",
                [in](const Tensor& g) { return detail::SumToShape(g, in); });
}

Tensor Contiguous(const Tensor& x) {
  detail::CheckDefinedOperand("Contiguous", "input", x);
  if (x.is_contiguous()) return x;
  return Clone(x);
}

Tensor Clone(const Tensor& x) {
  detail::CheckDefinedOperand("Clone", "input", x);
  return Record(x, x.Detach().Clone(), "CloneBackward", [](const Tensor& g) { return g; });
}

}  // namespace ddp::nn::ops
