// Layer normalization. Shapes: x [M, D] (M rows: the product of the
// dimensions before the normalized ones; D: the product of the normalized
// ones), weight and bias [D], saved mean and invstd [M] (f64). Each row is
// accumulated in double, in two passes (mean, then squared deviations), so
// that a large common offset does not cancel the variance away.
#include <cmath>
#include <stdexcept>
#include <vector>

#include "nn/ops/cpu/cpu_kernels.h"

namespace ddp::nn::ops::cpu {

namespace {

std::vector<double> ToDoubles(const Tensor& t, int64_t n, double fallback) {
  if (!t.defined()) return std::vector<double>(n, fallback);
  return t.ToVector<double>();
}

void FromDoubles(const Tensor& t, const std::vector<double>& v) {
  if (!t.defined()) return;
  Tensor src = Tensor::FromBlob(const_cast<double*>(v.data()), {static_cast<int64_t>(v.size())}, DType::kFloat64);
  NoGradGuard guard;
  t.CopyFrom(src.View(t.shape()));
}

}  // namespace

void LayerNormForward(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                      double eps, const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd) {
  const int64_t d = cols;
  const Tensor xc = ContiguousData(x);
  if (!y.is_contiguous()) throw std::invalid_argument("layer_norm: y must be contiguous");
  const std::vector<double> w = ToDoubles(weight, d, 1.0), b = ToDoubles(bias, d, 0.0);
  std::vector<double> mean(rows, 0.0), invstd(rows, 0.0);
  DDP_DISPATCH_FLOATING(x.dtype(), "layer_norm", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    scalar_t* yp = static_cast<scalar_t*>(y.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* row = xp + r * d;
      double s = 0;
      for (int64_t i = 0; i < d; ++i) s += static_cast<A>(row[i]);
      const double mu = d > 0 ? s / d : 0.0;
      double q = 0;
      for (int64_t i = 0; i < d; ++i) {
        const double dv = static_cast<A>(row[i]) - mu;
        q += dv * dv;
      }
      const double is = 1.0 / std::sqrt((d > 0 ? q / d : 0.0) + eps);
      mean[r] = mu;
      invstd[r] = is;
      scalar_t* out = yp + r * d;
      for (int64_t i = 0; i < d; ++i) {
        out[i] = static_cast<scalar_t>((static_cast<A>(row[i]) - mu) * is * w[i] + b[i]);
      }
    }
  });
  FromDoubles(save_mean, mean);
  FromDoubles(save_invstd, invstd);
}

// With g = dy * weight and xhat = (x - mean) * invstd per row:
// dx = invstd * (g - mean(g) - xhat * mean(g * xhat)), dweight = sum over
// rows of dy * xhat, dbias = sum over rows of dy.
void LayerNormBackward(const Tensor& x, const Tensor& dy, const Tensor& weight, int64_t rows, int64_t cols,
                       const Tensor& save_mean, const Tensor& save_invstd, const Tensor& dx, const Tensor& dweight,
                       const Tensor& dbias) {
  const int64_t d = cols;
  const Tensor xc = ContiguousData(x), dyc = ContiguousData(dy);
  if (dx.defined() && !dx.is_contiguous()) throw std::invalid_argument("layer_norm_backward: dx must be contiguous");
  const std::vector<double> w = ToDoubles(weight, d, 1.0);
  const std::vector<double> mean = save_mean.ToVector<double>(), invstd = save_invstd.ToVector<double>();
  std::vector<double> dw(d, 0.0), db(d, 0.0);
  DDP_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    const scalar_t* gp = static_cast<const scalar_t*>(dyc.data_ptr());
    scalar_t* dp = dx.defined() ? static_cast<scalar_t*>(dx.data_ptr()) : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* xr = xp + r * d;
      const scalar_t* gr = gp + r * d;
      const double mu = mean[r], is = invstd[r];
      double sum_g = 0, sum_gx = 0;
      for (int64_t i = 0; i < d; ++i) {
        const double g = static_cast<A>(gr[i]);
        const double xhat = (static_cast<A>(xr[i]) - mu) * is;
        dw[i] += g * xhat;
        db[i] += g;
        sum_g += g * w[i];
        sum_gx += g * w[i] * xhat;
      }
      if (dp == nullptr) continue;
      const double mean_g = sum_g / d, mean_gx = sum_gx / d;
      scalar_t* out = dp + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const double xhat = (static_cast<A>(xr[i]) - mu) * is;
        out[i] = static_cast<scalar_t>(is * (static_cast<A>(gr[i]) * w[i] - mean_g - xhat * mean_gx));
      }
    }
  });
  FromDoubles(dweight, dw);
  FromDoubles(dbias, db);
}

}  // namespace ddp::nn::ops::cpu
