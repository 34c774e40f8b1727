// Helpers shared by the differentiable ops (private to nn/ops).
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "nn/autograd/node.h"
#include "nn/ops/dispatch.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::ops::detail {

using autograd::AnyRequiresGrad;
using autograd::ConnectNode;
using autograd::Node;
using autograd::SavedTensor;

/// Uninitialized contiguous tensor with t's dtype and device (shape given or t's).
inline Tensor NewLike(const Tensor& t) { return Empty(t.shape(), {.dtype = t.dtype(), .device = t.device()}); }
inline Tensor NewLike(const Tensor& t, const Shape& shape) {
  return Empty(shape, {.dtype = t.dtype(), .device = t.device()});
}

/// The op's name for an error in its forward: its backward node's name
/// without "Backward" ("SumBackward" -> "Sum"), so that the message does not
/// send the reader to a backward they never called.
inline std::string ForwardName(const std::string& node_name) {
  constexpr std::string_view kSuffix = "Backward";
  const size_t stem = node_name.size() - kSuffix.size();
  if (node_name.size() > kSuffix.size() && node_name.compare(stem, kSuffix.size(), kSuffix) == 0) {
    return node_name.substr(0, stem);
  }
  return node_name;
}

/// True when g may be overwritten in place as a result shaped like `like`:
/// nothing else refers to its handle or memory, and it is contiguous with
/// like's shape, dtype and device (for gradients handed to a backward).
bool Exclusive(const Tensor& g, const Tensor& like);

/// dim wrapped as PyTorch wraps a dim argument: a 0-d tensor counts as
/// having one dimension there, so 0 and -1 are accepted for it (and give 0).
/// Throws std::out_of_range for anything else.
inline int64_t WrapDimAllowingScalar(const Tensor& x, int64_t dim) {
  if (x.dim() > 0) return x.WrapDim(dim);
  if (dim != 0 && dim != -1) {
    throw std::out_of_range("dimension " + std::to_string(dim) +
                            " out of range for a 0-d tensor (expected 0 or -1)");
  }
  return 0;
}

/// A refused floating option for an error message: the fewest significant
/// digits that read back as the same double ("-1e-09", "1.0000001", "nan"),
/// where std::to_string's six decimals showed -1e-9 as "-0.000000" and
/// 1.0000001 as "1.000000", a value the checks accept.
inline std::string ErrorValue(double v) {
  if (std::isnan(v)) return "nan";  // glibc prints a negative NaN as "-nan"
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

/// WrapDimAllowingScalar, with `op` at the head of the error
/// ("log_softmax: dimension 5 out of range for a 2-d tensor ...").
inline int64_t WrapDimOf(const std::string& op, const Tensor& x, int64_t dim) {
  try {
    return WrapDimAllowingScalar(x, dim);
  } catch (const std::out_of_range& e) {
    throw std::out_of_range(op + ": " + e.what());
  }
}

/// Throws when tensors live on different devices, naming the op.
void CheckSameDevice(const char* op, const Tensor& a, const Tensor& b);
/// Throws "<op>: <what> is undefined" for an undefined t, so that a missing
/// operand names the op it was passed to (the tensor accessors can only
/// say "shape on an undefined tensor").
void CheckDefinedOperand(const char* op, const char* what, const Tensor& t);
/// Throws "<op>: <what> must be floating, got <dtype>" for an integer t (and
/// as CheckDefinedOperand for an undefined one).
void CheckFloatingOperand(const char* op, const char* what, const Tensor& t);

/// A node whose backward is a lambda; for simple ops.
class LambdaNode final : public Node {
 public:
  using Fn = std::function<std::vector<Tensor>(LambdaNode&, std::vector<Tensor>&)>;
  LambdaNode(std::string name, Fn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::vector<Tensor> Apply(std::vector<Tensor>&& grads) override { return fn_(*this, grads); }
  std::string name() const override { return name_; }
  void ReleaseSaved() override {
    for (auto& s : saved) s.Release();
  }
  std::vector<SavedTensor> saved;

 private:
  std::string name_;
  Fn fn_;
};

}  // namespace ddp::nn::ops::detail
