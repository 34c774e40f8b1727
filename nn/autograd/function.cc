#include "nn/autograd/function.h"

#include <stdexcept>

#include "nn/ops/dispatch.h"

namespace ddp::nn::autograd {

namespace {

// True when a tensor of shape `input` broadcasts to `grad` (PyTorch's
// is_expandable_to): aligned at the right, each of input's dimensions is
// 1 or grad's.
bool BroadcastsTo(const Shape& input, const Shape& grad) {
  if (input.size() > grad.size()) return false;
  const size_t lead = grad.size() - input.size();
  for (size_t i = 0; i < input.size(); ++i) {
    if (input[i] != 1 && input[i] != grad[lead + i]) return false;
  }
  return true;
}

}  // namespace

void AutogradContext::SaveForBackward(const std::vector<Tensor>& tensors) {
  saved_.clear();
  for (const Tensor& t : tensors) saved_.emplace_back(t);
}

std::vector<Tensor> AutogradContext::GetSavedTensors() const {
  std::vector<Tensor> out;
  out.reserve(saved_.size());
  for (const SavedTensor& s : saved_) out.push_back(s.Get());
  return out;
}

std::vector<Tensor> CustomFunctionNode::Wire(const std::shared_ptr<CustomFunctionNode>& self,
                                             const std::vector<Tensor>& inputs, std::vector<Tensor> outputs) {
  std::vector<Edge> edges;
  for (const Tensor& t : inputs) {
    edges.push_back(GradientEdge(t));
    self->input_meta_.push_back(t.defined() ? Meta{t.shape(), t.dtype(), t.device()}
                                            : Meta{{}, DType::kFloat32, kCPU});
  }
  self->set_next_edges(std::move(edges));
  for (size_t i = 0; i < outputs.size(); ++i) {
    Tensor& t = outputs[i];
    if (!t.defined()) throw std::invalid_argument(self->name_ + ": Forward returned an undefined tensor");
    // An output that is one of the inputs (or already has history) gets its
    // own handle, so that the input's history stays intact.
    bool alias = t.grad_fn() != nullptr || t.requires_grad();
    for (const Tensor& in : inputs) alias = alias || t.is_same(in);
    if (alias) t = t.Detach();
    self->output_meta_.push_back({t.shape(), t.dtype(), t.device()});
    self->AddOutput(t);
    if (!IsFloating(t.dtype())) continue;  // indices and counts carry no gradient
    AutogradMeta& meta = t.impl()->mutable_autograd();
    meta.requires_grad = true;
    meta.grad_fn = self;
    meta.output_nr = static_cast<uint32_t>(i);
  }
  // An output kept in saved_data holds its own node (output -> grad_fn ->
  // ctx -> output): a cycle that is never freed, with the whole graph below
  // it. Refused, and saved_data cleared so that the refusal leaks nothing.
  for (const auto& [key, value] : self->ctx_.saved_data) {
    std::vector<const Tensor*> held;
    if (const auto* t = std::any_cast<Tensor>(&value)) held.push_back(t);
    if (const auto* v = std::any_cast<std::vector<Tensor>>(&value)) {
      for (const Tensor& t : *v) held.push_back(&t);
    }
    for (const Tensor* t : held) {
      for (size_t i = 0; i < outputs.size(); ++i) {
        if (!t->is_same(outputs[i]) || outputs[i].grad_fn() != self) continue;
        const std::string message = self->name_ + ": saved_data[\"" + key + "\"] holds output " +
                                    std::to_string(i) +
                                    " of Forward, which would keep its own graph alive for ever; "
                                    "keep it with SaveForBackward instead";
        self->ctx_.saved_data.clear();
        throw std::invalid_argument(message);
      }
    }
  }
  return outputs;
}

std::vector<Tensor> CustomFunctionNode::Apply(std::vector<Tensor>&& grad_outputs) {
  std::vector<Tensor> grads = std::move(grad_outputs);
  grads.resize(output_meta_.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) {
      const Meta& m = output_meta_[i];
      grads[i] = Zeros(m.shape, {.dtype = m.dtype, .device = m.device});
    }
  }
  std::vector<Tensor> result = backward_(&ctx_, grads);
  if (result.size() != input_meta_.size()) {
    throw std::invalid_argument(name_ + ": Backward returned " + std::to_string(result.size()) +
                                " gradients, expected " + std::to_string(input_meta_.size()) +
                                " (one per input, undefined for none)");
  }
  for (size_t i = 0; i < result.size(); ++i) {
    if (!needs_input_grad(i)) {
      result[i] = Tensor();
      continue;
    }
    if (!result[i].defined()) continue;
    const Meta& m = input_meta_[i];
    if (result[i].shape() != m.shape && !BroadcastsTo(m.shape, result[i].shape())) {
      throw std::invalid_argument(name_ + ": Backward returned a gradient of shape " +
                                  ShapeToString(result[i].shape()) + " for input " + std::to_string(i) +
                                  " of shape " + ShapeToString(m.shape) +
                                  " (expected that shape or one the input broadcasts to)");
    }
    if (result[i].device() != m.device) {
      throw std::invalid_argument(name_ + ": Backward returned a gradient on " + result[i].device().ToString() +
                                  " for input " + std::to_string(i) + " on " + m.device.ToString());
    }
    // As PyTorch's engine: a gradient of the broadcast shape (a backward
    // that skipped the reduction) is summed down to the input's shape.
    if (result[i].shape() != m.shape) result[i] = ops::detail::SumToShape(result[i], m.shape);
    // As PyTorch's engine (validate_outputs): the nodes below compute in the
    // input's dtype.
    if (result[i].dtype() != m.dtype) result[i] = result[i].To(m.dtype);
  }
  return result;
}

void CustomFunctionNode::ReleaseSaved() {
  for (SavedTensor& s : ctx_.saved_) s.Release();
}

}  // namespace ddp::nn::autograd
