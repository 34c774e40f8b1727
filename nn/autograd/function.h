// Custom autograd functions defined outside nn/ (SyncBatchNorm in ddp/ is
// one): a class with a static Forward and a static Backward, called through
// Function<T>::Apply. Forward runs with grad mode off and may save tensors
// and values in the context; Backward receives one gradient per output
// (zeros for outputs that got none) and returns one per input (undefined
// for "no gradient") of the input's shape and on its device; one of another
// dtype is converted to the input's, and one of a shape the input
// broadcasts to is summed down to the input's shape (as PyTorch).
//
//   struct Scale : ddp::nn::autograd::Function<Scale> {
//     static constexpr const char* kName = "ScaleBackward";
//     static std::vector<Tensor> Forward(AutogradContext* ctx, const std::vector<Tensor>& in, double k) {
//       ctx->saved_data["k"] = k;
//       return {ops::MulScalar(in[0], k)};
//     }
//     static std::vector<Tensor> Backward(AutogradContext* ctx, const std::vector<Tensor>& grad) {
//       return {ops::MulScalar(grad[0], std::any_cast<double>(ctx->saved_data["k"]))};
//     }
//   };
//   Tensor y = Scale::Apply({x}, 2.0)[0];
#pragma once

#include <any>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "nn/autograd/node.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::autograd {

/// What a custom function's Forward leaves for its Backward.
class AutogradContext {
 public:
  /// Keeps tensors for backward (version-checked: modifying one in place
  /// before backward is reported).
  void SaveForBackward(const std::vector<Tensor>& tensors);
  /// The tensors saved by SaveForBackward, in order.
  std::vector<Tensor> GetSavedTensors() const;
  /// True when input i needs a gradient.
  bool NeedsInputGrad(size_t i) const { return i < needs_input_grad_.size() && needs_input_grad_[i]; }
  /// Arbitrary values for backward (sizes, flags, communication handles...).
  /// Not the function's outputs: one held here (as a Tensor or in a
  /// std::vector<Tensor>) would keep its own node alive, and Apply refuses
  /// it; outputs go through SaveForBackward.
  std::unordered_map<std::string, std::any> saved_data;

 private:
  template <class F>
  friend class Function;
  friend class CustomFunctionNode;
  std::vector<SavedTensor> saved_;
  std::vector<bool> needs_input_grad_;
};

/// The graph node of a custom function.
class CustomFunctionNode final : public Node {
 public:
  using BackwardFn = std::vector<Tensor> (*)(AutogradContext*, const std::vector<Tensor>&);
  CustomFunctionNode(std::string name, BackwardFn backward) : name_(std::move(name)), backward_(backward) {}
  std::vector<Tensor> Apply(std::vector<Tensor>&& grad_outputs) override;
  std::string name() const override { return name_; }
  void ReleaseSaved() override;
  AutogradContext& ctx() { return ctx_; }

  /// Records the inputs and outputs of `self` (called by Function<T>::Apply).
  static std::vector<Tensor> Wire(const std::shared_ptr<CustomFunctionNode>& self,
                                  const std::vector<Tensor>& inputs, std::vector<Tensor> outputs);

 private:
  struct Meta {
    Shape shape;
    DType dtype;
    Device device;
  };
  std::string name_;
  BackwardFn backward_;
  AutogradContext ctx_;
  std::vector<Meta> input_meta_;
  std::vector<Meta> output_meta_;
};

/// Base of a custom function T (CRTP); T provides static Forward and Backward
/// and optionally `static constexpr const char* kName`.
template <class T>
class Function {
 public:
  /// Runs T::Forward(ctx, inputs, args...) and records the node when grad
  /// mode is on and an input requires grad. Returns T::Forward's outputs.
  template <typename... Args>
  static std::vector<Tensor> Apply(const std::vector<Tensor>& inputs, Args&&... args) {
    const bool record = AnyRequiresGrad(inputs);
    std::shared_ptr<CustomFunctionNode> node;
    AutogradContext local;
    AutogradContext* ctx = &local;
    if (record) {
      std::string name = "CustomFunction";
      if constexpr (requires { T::kName; }) name = T::kName;
      node = std::make_shared<CustomFunctionNode>(std::move(name), &T::Backward);
      ctx = &node->ctx();
    }
    ctx->needs_input_grad_.clear();
    for (const Tensor& t : inputs) ctx->needs_input_grad_.push_back(record && t.defined() && t.requires_grad());
    std::vector<Tensor> outputs;
    {
      NoGradGuard guard;
      outputs = T::Forward(ctx, inputs, std::forward<Args>(args)...);
    }
    if (!record) return outputs;
    return CustomFunctionNode::Wire(node, inputs, std::move(outputs));
  }
};

}  // namespace ddp::nn::autograd
