// Batch normalization. Shapes: x [N, C, S...] seen as [N, C, S] with S the
// product of the trailing dimensions (1 for BatchNorm1d on [N, C]); weight,
// bias, running statistics and saved statistics are [C]. Statistics
// accumulate in double, in two passes (mean, then squared deviations) so
// that large activations do not cancel.
#include <cmath>
#include <stdexcept>
#include <vector>

#include "nn/ops/cpu/cpu_kernels.h"

namespace ddp::nn::ops::cpu {

namespace {

std::vector<double> ToDoubles(const Tensor& t, int64_t c, double fallback) {
  if (!t.defined()) return std::vector<double>(c, fallback);
  return t.ToVector<double>();
}

void FromDoubles(const Tensor& t, const std::vector<double>& v) {
  if (!t.defined()) return;
  Tensor src = Tensor::FromBlob(const_cast<double*>(v.data()), {static_cast<int64_t>(v.size())}, DType::kFloat64);
  NoGradGuard guard;
  t.CopyFrom(src);
}

struct Dims {
  int64_t n, c, s;
};

Dims GetDims(const Tensor& x) {
  int64_t s = 1;
  for (int64_t d = 2; d < x.dim(); ++d) s *= x.size(d);
  return {x.size(0), x.size(1), s};
}

// An f64 mean as the sum of two accumulation-type values (hi + lo), so that
// Center(x) = (x - hi) - lo keeps the digits of x - mean that rounding the
// mean to A alone drops (f32 input has A = f32, whose ulp is 1 at a mean of
// 1e7). lo is 0 where hi is infinite (a mean beyond A's range, or an
// infinite running mean): x - mean is then infinite, not NaN.
template <typename A>
struct SplitMean {
  explicit SplitMean(double mean)
      : hi(static_cast<A>(mean)), lo(std::isfinite(hi) ? static_cast<A>(mean - hi) : A(0)) {}
  A Center(A x) const { return (x - hi) - lo; }
  A hi, lo;
};

// y = (x - mean) * scale + b with scale = w * invstd, in the accumulation
// type, x - mean through SplitMean so that it is exact where x is near the
// mean. A channel of tiny variance has invstd near 1/sqrt(eps) (about 316):
// the form x * scale + (b - mean * scale) added two terms hundreds of times
// larger than y, and rounding the mean to f32 alone left up to 4e-5 in y.
template <typename scalar_t>
void Normalize(const scalar_t* xp, scalar_t* yp, const Dims& d, const std::vector<double>& mean,
               const std::vector<double>& invstd, const std::vector<double>& w, const std::vector<double>& b) {
  using A = acc_t<scalar_t>;
  for (int64_t n = 0; n < d.n; ++n) {
    for (int64_t c = 0; c < d.c; ++c) {
      const A scale = static_cast<A>(w[c] * invstd[c]), shift = static_cast<A>(b[c]);
      const SplitMean<A> mu(mean[c]);
      const scalar_t* row = xp + (n * d.c + c) * d.s;
      scalar_t* out = yp + (n * d.c + c) * d.s;
      for (int64_t i = 0; i < d.s; ++i) {
        out[i] = static_cast<scalar_t>(mu.Center(static_cast<A>(row[i])) * scale + shift);
      }
    }
  }
}

}  // namespace

void BatchNormForward(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                      const Tensor& running_var, bool training, double momentum, double eps, const Tensor& y,
                      const Tensor& save_mean, const Tensor& save_invstd) {
  const Dims d = GetDims(x);
  const Tensor xc = ContiguousData(x);
  const int64_t m = d.n * d.s;
  std::vector<double> mean(d.c), invstd(d.c);
  const std::vector<double> w = ToDoubles(weight, d.c, 1.0), b = ToDoubles(bias, d.c, 0.0);
  if (!y.is_contiguous()) throw std::invalid_argument("batch_norm: y must be contiguous");
  DDP_DISPATCH_FLOATING(x.dtype(), "batch_norm", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    scalar_t* yp = static_cast<scalar_t*>(y.data_ptr());
    if (training) {
      std::vector<double> var(d.c);
      for (int64_t c = 0; c < d.c; ++c) {
        double s = 0;
        for (int64_t n = 0; n < d.n; ++n) {
          const scalar_t* row = xp + (n * d.c + c) * d.s;
          for (int64_t i = 0; i < d.s; ++i) s += static_cast<A>(row[i]);
        }
        mean[c] = m > 0 ? s / m : 0.0;
        double q = 0;
        for (int64_t n = 0; n < d.n; ++n) {
          const scalar_t* row = xp + (n * d.c + c) * d.s;
          for (int64_t i = 0; i < d.s; ++i) {
            const double dv = static_cast<A>(row[i]) - mean[c];
            q += dv * dv;
          }
        }
        var[c] = m > 0 ? q / m : 0.0;
        invstd[c] = 1.0 / std::sqrt(var[c] + eps);
      }
      if (running_mean.defined() && running_var.defined()) {
        std::vector<double> rm = running_mean.ToVector<double>(), rv = running_var.ToVector<double>();
        const double unbias = m > 1 ? static_cast<double>(m) / (m - 1) : 1.0;
        for (int64_t c = 0; c < d.c; ++c) {
          rm[c] = (1 - momentum) * rm[c] + momentum * mean[c];
          rv[c] = (1 - momentum) * rv[c] + momentum * var[c] * unbias;
        }
        FromDoubles(running_mean, rm);
        FromDoubles(running_var, rv);
      }
    } else {
      mean = running_mean.ToVector<double>();
      const std::vector<double> rv = running_var.ToVector<double>();
      for (int64_t c = 0; c < d.c; ++c) invstd[c] = 1.0 / std::sqrt(rv[c] + eps);
    }
    Normalize(xp, yp, d, mean, invstd, w, b);
  });
  FromDoubles(save_mean, mean);
  FromDoubles(save_invstd, invstd);
}

void BatchNormBackward(const Tensor& x, const Tensor& dy, const Tensor& weight, const Tensor& save_mean,
                       const Tensor& save_invstd, bool training, double /*eps: in save_invstd*/, const Tensor& dx,
                       const Tensor& dweight, const Tensor& dbias) {
  const Dims d = GetDims(x);
  const Tensor xc = ContiguousData(x), dyc = ContiguousData(dy);
  const int64_t m = d.n * d.s;
  const std::vector<double> mean = save_mean.ToVector<double>(), invstd = save_invstd.ToVector<double>();
  const std::vector<double> w = ToDoubles(weight, d.c, 1.0);
  std::vector<double> sum_dy(d.c, 0.0), sum_dy_xhat(d.c, 0.0);
  DDP_DISPATCH_FLOATING(x.dtype(), "batch_norm_backward", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    const scalar_t* gp = static_cast<const scalar_t*>(dyc.data_ptr());
    for (int64_t n = 0; n < d.n; ++n) {
      for (int64_t c = 0; c < d.c; ++c) {
        const scalar_t* xr = xp + (n * d.c + c) * d.s;
        const scalar_t* gr = gp + (n * d.c + c) * d.s;
        double s = 0, sx = 0;
        const double mu = mean[c];
        for (int64_t i = 0; i < d.s; ++i) {
          const double g = static_cast<A>(gr[i]);
          s += g;
          sx += g * (static_cast<A>(xr[i]) - mu);
        }
        sum_dy[c] += s;
        sum_dy_xhat[c] += sx * invstd[c];
      }
    }
    if (dx.defined()) {
      if (!dx.is_contiguous()) throw std::invalid_argument("batch_norm_backward: dx must be contiguous");
      scalar_t* dp = static_cast<scalar_t*>(dx.data_ptr());
      for (int64_t n = 0; n < d.n; ++n) {
        for (int64_t c = 0; c < d.c; ++c) {
          const scalar_t* xr = xp + (n * d.c + c) * d.s;
          const scalar_t* gr = gp + (n * d.c + c) * d.s;
          scalar_t* out = dp + (n * d.c + c) * d.s;
          const double k = w[c] * invstd[c];
          if (training && m > 0) {
            // dx = k * (dy - mean(dy) - xhat * mean(dy * xhat)), x - mean as
            // the forward takes it: with the mean rounded to f32, f32 dx was
            // off f64's by 2e-3 of its largest value at a channel mean of 1e7
            // and spread 3 (ops_gradcheck_test).
            const A mdy = static_cast<A>(sum_dy[c] / m);
            const A coef = static_cast<A>(sum_dy_xhat[c] / m * invstd[c]);
            const SplitMean<A> mu(mean[c]);
            const A kk = static_cast<A>(k);
            for (int64_t i = 0; i < d.s; ++i) {
              const A centered = mu.Center(static_cast<A>(xr[i]));
              out[i] = static_cast<scalar_t>(kk * (static_cast<A>(gr[i]) - mdy - centered * coef));
            }
          } else {
            const A kk = static_cast<A>(k);
            for (int64_t i = 0; i < d.s; ++i) out[i] = static_cast<scalar_t>(kk * static_cast<A>(gr[i]));
          }
        }
      }
    }
  });
  FromDoubles(dweight, sum_dy_xhat);
  FromDoubles(dbias, sum_dy);
}

// --- building blocks ---

void BatchNormStats(const Tensor& x, const Tensor& sum, const Tensor& sum_sq) {
  const Dims d = GetDims(x);
  const Tensor xc = ContiguousData(x);
  std::vector<double> s(d.c, 0.0), q(d.c, 0.0);
  DDP_DISPATCH_FLOATING(x.dtype(), "batch_norm_stats", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    for (int64_t n = 0; n < d.n; ++n) {
      for (int64_t c = 0; c < d.c; ++c) {
        const scalar_t* row = xp + (n * d.c + c) * d.s;
        double a = 0, b = 0;
        for (int64_t i = 0; i < d.s; ++i) {
          const double v = static_cast<A>(row[i]);
          a += v;
          b += v * v;
        }
        s[c] += a;
        q[c] += b;
      }
    }
  });
  FromDoubles(sum, s);
  FromDoubles(sum_sq, q);
}

void BatchNormElementwise(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& weight,
                          const Tensor& bias, const Tensor& y) {
  const Dims d = GetDims(x);
  const Tensor xc = ContiguousData(x);
  if (!y.is_contiguous()) throw std::invalid_argument("batch_norm_elementwise: y must be contiguous");
  const std::vector<double> mu = mean.ToVector<double>(), is = invstd.ToVector<double>();
  const std::vector<double> w = ToDoubles(weight, d.c, 1.0), b = ToDoubles(bias, d.c, 0.0);
  DDP_DISPATCH_FLOATING(x.dtype(), "batch_norm_elementwise", {
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    scalar_t* yp = static_cast<scalar_t*>(y.data_ptr());
    Normalize(xp, yp, d, mu, is, w, b);
  });
}

void BatchNormBackwardReduce(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                             const Tensor& sum_dy, const Tensor& sum_dy_xhat) {
  const Dims d = GetDims(x);
  const Tensor xc = ContiguousData(x), dyc = ContiguousData(dy);
  const std::vector<double> mu = mean.ToVector<double>(), is = invstd.ToVector<double>();
  std::vector<double> s(d.c, 0.0), sx(d.c, 0.0);
  DDP_DISPATCH_FLOATING(x.dtype(), "batch_norm_backward_reduce", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    const scalar_t* gp = static_cast<const scalar_t*>(dyc.data_ptr());
    for (int64_t n = 0; n < d.n; ++n) {
      for (int64_t c = 0; c < d.c; ++c) {
        const scalar_t* xr = xp + (n * d.c + c) * d.s;
        const scalar_t* gr = gp + (n * d.c + c) * d.s;
        double a = 0, b = 0;
        for (int64_t i = 0; i < d.s; ++i) {
          const double g = static_cast<A>(gr[i]);
          a += g;
          b += g * (static_cast<A>(xr[i]) - mu[c]);
        }
        s[c] += a;
        sx[c] += b * is[c];
      }
    }
  });
  FromDoubles(sum_dy, s);
  FromDoubles(sum_dy_xhat, sx);
}

void BatchNormBackwardElementwise(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                                  const Tensor& weight, const Tensor& mean_dy, const Tensor& mean_dy_xhat,
                                  const Tensor& dx) {
  const Dims d = GetDims(x);
  const Tensor xc = ContiguousData(x), dyc = ContiguousData(dy);
  if (!dx.is_contiguous()) throw std::invalid_argument("batch_norm_backward_elementwise: dx must be contiguous");
  const std::vector<double> mu = mean.ToVector<double>(), is = invstd.ToVector<double>();
  const std::vector<double> w = ToDoubles(weight, d.c, 1.0);
  const std::vector<double> mdy = mean_dy.ToVector<double>(), mdx = mean_dy_xhat.ToVector<double>();
  DDP_DISPATCH_FLOATING(x.dtype(), "batch_norm_backward_elementwise", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    const scalar_t* gp = static_cast<const scalar_t*>(dyc.data_ptr());
    scalar_t* dp = static_cast<scalar_t*>(dx.data_ptr());
    for (int64_t n = 0; n < d.n; ++n) {
      for (int64_t c = 0; c < d.c; ++c) {
        const scalar_t* xr = xp + (n * d.c + c) * d.s;
        const scalar_t* gr = gp + (n * d.c + c) * d.s;
        scalar_t* out = dp + (n * d.c + c) * d.s;
        const A k = static_cast<A>(w[c] * is[c]);
        const A m = static_cast<A>(mdy[c]);
        const A coef = static_cast<A>(mdx[c] * is[c]);
        const SplitMean<A> mu_c(mu[c]);  // as BatchNormBackward's
        for (int64_t i = 0; i < d.s; ++i) {
          out[i] = static_cast<scalar_t>(k * (static_cast<A>(gr[i]) - m - mu_c.Center(static_cast<A>(xr[i])) * coef));
        }
      }
    }
  });
}

}  // namespace ddp::nn::ops::cpu
