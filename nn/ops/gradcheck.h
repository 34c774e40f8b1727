// Gradient checking for tests: compares the gradients autograd computes
// with central finite differences, in f64.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "nn/tensor/tensor.h"

namespace ddp::nn::testing {

struct GradCheckOptions {
  double eps = 1e-6;   ///< finite-difference step
  double atol = 1e-6;  ///< |analytic - numeric| <= atol + rtol * |numeric|
  double rtol = 1e-5;
};

/// For fn: inputs -> output, projects the output on a fixed random tensor R
/// (so every output element matters), backpropagates R, and compares each
/// input's .grad with (L(x + eps) - L(x - eps)) / 2eps where L = sum(fn(x) * R).
/// Inputs must be f64; those that require grad are checked (they may be
/// non-contiguous views). Their .grad is reset first. An input that requires
/// grad and whose elements alias each other (an expanded view, a zero stride
/// on a dimension longer than 1) or another input's is refused, naming it:
/// the finite difference perturbs elements in place.
::testing::AssertionResult GradCheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                                     const std::vector<Tensor>& inputs, GradCheckOptions options = {});

/// A random f64 leaf of the given shape (entries in [-1, 1), seeded) that requires grad.
Tensor RandomLeaf(const Shape& shape, uint64_t seed, bool requires_grad = true);

}  // namespace ddp::nn::testing
