// Helpers shared by the differentiable ops (private to nn/ops).
#pragma once

#include <memory>
#include <string>
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

/// g summed over the dimensions that broadcasting added or expanded, so
/// that it has `shape` (no autograd; used inside backward).
Tensor SumToShape(const Tensor& g, const Shape& shape);

/// True when g may be overwritten in place as a result shaped like `like`:
/// nothing else refers to its handle or memory, and it is contiguous with
/// like's shape, dtype and device (for gradients handed to a backward).
bool Exclusive(const Tensor& g, const Tensor& like);

/// Throws when tensors live on different devices, naming the op.
void CheckSameDevice(const char* op, const Tensor& a, const Tensor& b);

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
