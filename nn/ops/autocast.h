// Automatic mixed precision (PyTorch's torch.autocast), per thread:
//
//   nn::AutocastGuard guard(nn::DType::kBFloat16);   // or kFloat16
//   nn::Tensor logits = model->Forward(x);            // GEMMs and convolutions in bf16
//   nn::Tensor loss = nn::loss::CrossEntropy(logits, y);  // f32
//
// Inside the guard:
//   - Matmul, Linear, Conv2d and Conv1d cast their floating operands
//     (input, weight, bias; f32, f16 or bf16, never f64) to the autocast
//     dtype and return that dtype. The casts are recorded by autograd, so an
//     f32 weight gets an f32 gradient: the parameters stay f32 master
//     weights. f64 is not eligible, as in PyTorch: all-f64 operands run in
//     f64, and an f64 operand next to one that autocast casts is an error
//     (Matmul's dtype mismatch; Linear and the convolutions name the input's
//     and the weight's dtypes), never a silent cast of the f64 input to 16
//     bits.
//   - Ops that need range compute in f32: LogSoftmax and Softmax, Sum and
//     Mean, MseLoss promote 16-bit inputs to f32 (CrossEntropy always
//     computes in f32). BatchNorm keeps the input's dtype for its output,
//     as PyTorch does, but its statistics are always accumulated in f64 and
//     kept in f32.
//   - Everything else runs in its inputs' dtype (ReLU and pooling stay
//     16-bit; a binary op of bf16 and f32 gives f32).
//
// Guards nest and restore the previous state on exit; AutocastGuard(nullopt)
// turns autocast off for its scope (e.g. a part that must run in f32).
// Backward is not autocast (it follows the forward's dtypes), so it may run
// outside the guard, as PyTorch recommends.
//
// Within the outermost enabled guard, the cast of a parameter (a leaf that
// requires grad) is cached and reused while the parameter's storage and
// version are unchanged; the cache is dropped when that guard ends. Code
// that writes parameters through raw pointers must bump the storage version
// (every nn optimizer does).
#pragma once

#include <optional>

#include "nn/tensor/dtype.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn {

/// The dtype GEMMs and convolutions run in on this thread (kFloat16 or
/// kBFloat16), or nullopt when autocast is off (the default).
std::optional<DType> AutocastDType();

/// Turns autocast on (kFloat16 or kBFloat16) or off (nullopt) on this thread
/// for its scope, restoring the previous state on destruction. Throws
/// std::invalid_argument for any other dtype.
class AutocastGuard {
 public:
  explicit AutocastGuard(std::optional<DType> dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  std::optional<DType> prev_;
  bool counted_;  // whether this guard holds the cast cache open
};

namespace ops::autocast {

/// x cast (differentiably) to the autocast dtype when autocast is on and x
/// is f32, f16 or bf16; otherwise x itself. Undefined stays undefined.
Tensor ToLowPrecision(const Tensor& x);
/// Throws std::invalid_argument, naming op and both dtypes, when autocast is
/// on and exactly one of a layer's input and weight is f64 (the layer would
/// otherwise cast its input to the weight's dtype across f64 and 16 bits).
void CheckNoF64Mix(const char* op, const Tensor& input, const Tensor& weight);
/// x cast (differentiably) to f32 when autocast is on and x is f16 or bf16;
/// otherwise x itself.
Tensor ToFloat32(const Tensor& x);
/// Entries in this thread's cast cache (for tests).
size_t CachedCasts();

}  // namespace ops::autocast

}  // namespace ddp::nn
