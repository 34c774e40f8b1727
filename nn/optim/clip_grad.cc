#include "nn/optim/clip_grad.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace ddp::nn::optim {
namespace {

// Sum of |g|^q (or the max of |g| for the infinity norm), accumulated in f64.
template <typename T>
double Accumulate(const T* g, int64_t n, double q) {
  double acc = 0;
  if (std::isinf(q)) {
    for (int64_t i = 0; i < n; ++i) {
      const double a = std::fabs(static_cast<double>(static_cast<acc_t<T>>(g[i])));
      if (!(a <= acc)) acc = a;  // keeps NaN
    }
  } else if (q == 2.0) {
    for (int64_t i = 0; i < n; ++i) {
      const double v = static_cast<double>(static_cast<acc_t<T>>(g[i]));
      acc += v * v;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      acc += std::pow(std::fabs(static_cast<double>(static_cast<acc_t<T>>(g[i]))), q);
    }
  }
  return acc;
}

template <typename T>
void Scale(T* g, int64_t n, float coef) {
  for (int64_t i = 0; i < n; ++i) g[i] = static_cast<T>(static_cast<acc_t<T>>(g[i]) * coef);
}

}  // namespace

double ClipGradNorm(const std::vector<Tensor>& params, double max_norm, double norm_type,
                    bool error_if_nonfinite) {
  if (!(norm_type > 0)) throw std::invalid_argument("ClipGradNorm: norm_type must be > 0");
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    if (!p.defined() || !p.grad().defined()) continue;
    const Tensor& g = p.grad();
    if (!g.device().is_cpu() || !g.is_contiguous()) {
      throw std::invalid_argument("ClipGradNorm: gradients must be contiguous CPU tensors");
    }
    grads.push_back(g);
  }
  double acc = 0;
  for (const Tensor& g : grads) {
    double part = 0;
    DDP_DISPATCH_FLOATING(g.dtype(), "ClipGradNorm", part = Accumulate(g.data<scalar_t>(), g.numel(), norm_type));
    if (std::isinf(norm_type)) {
      if (!(part <= acc)) acc = part;
    } else {
      acc += part;
    }
  }
  const double total = std::isinf(norm_type) ? acc : std::pow(acc, 1.0 / norm_type);
  if (!std::isfinite(total) && error_if_nonfinite) {
    throw std::runtime_error("ClipGradNorm: the total norm of order " + std::to_string(norm_type) +
                             " of the gradients is " + std::to_string(total));
  }
  // PyTorch rounds the coefficient to f32 and clamps it at 1.
  const float coef = static_cast<float>(max_norm / (total + 1e-6));
  if (coef < 1.0f || std::isnan(coef)) {
    for (const Tensor& g : grads) {
      DDP_DISPATCH_FLOATING(g.dtype(), "ClipGradNorm", Scale(g.data<scalar_t>(), g.numel(), coef));
      g.storage()->BumpVersion();
    }
  }
  return total;
}

}  // namespace ddp::nn::optim
