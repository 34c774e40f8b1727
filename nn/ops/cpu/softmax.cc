// log-softmax, cross-entropy and negative log-likelihood. Shapes:
// log_softmax over dimension `dim` of x viewed as [outer, D, inner];
// cross-entropy on logits [N, C] with class indices target [N]; NLL on
// log_probs [N, C, S] (S: trailing positions, 1 for [N, C]) with target
// [N, S] and class weights [C].
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "nn/ops/cpu/cpu_kernels.h"

namespace ddp::nn::ops::cpu {

namespace {

struct Split {
  int64_t outer, d, inner;
};

Split SplitAt(const Tensor& x, int64_t dim) {
  Split s{1, x.size(dim), 1};
  for (int64_t i = 0; i < dim; ++i) s.outer *= x.size(i);
  for (int64_t i = dim + 1; i < x.dim(); ++i) s.inner *= x.size(i);
  return s;
}

}  // namespace

void LogSoftmaxForward(const Tensor& x, int64_t dim, const Tensor& y) {
  dim = x.WrapDim(dim);
  const Tensor xc = ContiguousData(x);
  const Split s = SplitAt(x, dim);
  DDP_DISPATCH_FLOATING(x.dtype(), "log_softmax", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    scalar_t* yp = static_cast<scalar_t*>(y.data_ptr());
    for (int64_t o = 0; o < s.outer; ++o) {
      for (int64_t in = 0; in < s.inner; ++in) {
        const scalar_t* row = xp + o * s.d * s.inner + in;
        scalar_t* out = yp + o * s.d * s.inner + in;
        A mx = -std::numeric_limits<A>::infinity();
        for (int64_t k = 0; k < s.d; ++k) mx = std::max(mx, static_cast<A>(row[k * s.inner]));
        A sum = 0;
        for (int64_t k = 0; k < s.d; ++k) sum += std::exp(static_cast<A>(row[k * s.inner]) - mx);
        // (x - max) - log(sum), as PyTorch: folding max and log(sum) into
        // one number first rounds it at max's magnitude, which for logits
        // of 1e4 in f32 moves every output by about 1e-3.
        const A log_sum = std::log(sum);
        for (int64_t k = 0; k < s.d; ++k) {
          out[k * s.inner] = static_cast<scalar_t>((static_cast<A>(row[k * s.inner]) - mx) - log_sum);
        }
      }
    }
  });
}

void LogSoftmaxBackward(const Tensor& dy, const Tensor& y, int64_t dim, const Tensor& dx) {
  dim = y.WrapDim(dim);
  const Tensor dyc = ContiguousData(dy), yc = ContiguousData(y);
  const Split s = SplitAt(y, dim);
  DDP_DISPATCH_FLOATING(y.dtype(), "log_softmax_backward", {
    using A = acc_t<scalar_t>;
    const scalar_t* gp = static_cast<const scalar_t*>(dyc.data_ptr());
    const scalar_t* yp = static_cast<const scalar_t*>(yc.data_ptr());
    scalar_t* dp = static_cast<scalar_t*>(dx.data_ptr());
    for (int64_t o = 0; o < s.outer; ++o) {
      for (int64_t in = 0; in < s.inner; ++in) {
        const int64_t base = o * s.d * s.inner + in;
        A sum = 0;
        for (int64_t k = 0; k < s.d; ++k) sum += static_cast<A>(gp[base + k * s.inner]);
        for (int64_t k = 0; k < s.d; ++k) {
          const int64_t i = base + k * s.inner;
          dp[i] = static_cast<scalar_t>(static_cast<A>(gp[i]) - std::exp(static_cast<A>(yp[i])) * sum);
        }
      }
    }
  });
}

void CrossEntropyForward(const Tensor& logits, const Tensor& target, double label_smoothing, int64_t ignore_index,
                         const Tensor& log_probs, const Tensor& loss) {
  const int64_t n = logits.size(0), c = logits.size(1);
  const Tensor tc = ContiguousData(target);
  const int64_t* t = tc.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == ignore_index) continue;
    if (t[i] < 0 || t[i] >= c) {
      throw std::out_of_range("cross_entropy: target " + std::to_string(t[i]) + " (sample " + std::to_string(i) +
                              ") is out of range for " + std::to_string(c) + " classes [0, " +
                              std::to_string(c - 1) + "]");
    }
  }
  // log_probs = log_softmax(logits) in log_probs' dtype (f32 for 16-bit logits).
  Tensor lg = logits.dtype() == log_probs.dtype() ? logits : logits.Detach().To(log_probs.dtype());
  LogSoftmaxForward(lg, 1, log_probs);
  DDP_DISPATCH_FLOATING(log_probs.dtype(), "cross_entropy", {
    using A = acc_t<scalar_t>;
    const scalar_t* lp = static_cast<const scalar_t*>(log_probs.data_ptr());
    scalar_t* l = static_cast<scalar_t*>(loss.data_ptr());
    const A eps = static_cast<A>(label_smoothing);
    for (int64_t i = 0; i < n; ++i) {
      if (t[i] == ignore_index) {
        l[i] = scalar_t(0);
        continue;
      }
      const scalar_t* row = lp + i * c;
      A v = -(A(1) - eps) * static_cast<A>(row[t[i]]);
      if (eps != A(0)) {
        A sum = 0;
        for (int64_t k = 0; k < c; ++k) sum += static_cast<A>(row[k]);
        v -= eps / static_cast<A>(c) * sum;
      }
      l[i] = static_cast<scalar_t>(v);
    }
  });
}

void CrossEntropyBackward(const Tensor& log_probs, const Tensor& target, const Tensor& grad_loss,
                          double label_smoothing, int64_t ignore_index, const Tensor& dlogits) {
  const int64_t n = log_probs.size(0), c = log_probs.size(1);
  const Tensor tc = ContiguousData(target);
  const int64_t* t = tc.data<int64_t>();
  const Tensor g = ContiguousData(grad_loss.dtype() == log_probs.dtype() ? grad_loss
                                                                         : grad_loss.Detach().To(log_probs.dtype()));
  Tensor out = dlogits.dtype() == log_probs.dtype() && dlogits.is_contiguous()
                   ? dlogits
                   : Empty(dlogits.shape(), {.dtype = log_probs.dtype()});
  DDP_DISPATCH_FLOATING(log_probs.dtype(), "cross_entropy_backward", {
    using A = acc_t<scalar_t>;
    const scalar_t* lp = static_cast<const scalar_t*>(log_probs.data_ptr());
    const scalar_t* gp = static_cast<const scalar_t*>(g.data_ptr());
    const int64_t gstride = g.numel() == 1 ? 0 : 1;  // a scalar grad applies to every sample
    scalar_t* d = static_cast<scalar_t*>(out.data_ptr());
    const A eps = static_cast<A>(label_smoothing);
    const A off = eps / static_cast<A>(c);
    for (int64_t i = 0; i < n; ++i) {
      scalar_t* row = d + i * c;
      if (t[i] == ignore_index) {
        std::fill(row, row + c, scalar_t(0));
        continue;
      }
      const A gi = static_cast<A>(gp[i * gstride]);
      const scalar_t* lr = lp + i * c;
      for (int64_t k = 0; k < c; ++k) row[k] = static_cast<scalar_t>(gi * (std::exp(static_cast<A>(lr[k])) - off));
      row[t[i]] = static_cast<scalar_t>(static_cast<A>(row[t[i]]) - gi * (A(1) - eps));
    }
  });
  if (!out.is_same(dlogits)) {
    NoGradGuard guard;
    dlogits.CopyFrom(out);
  }
}

namespace {

// The weights as a contiguous tensor of log_probs' dtype, or undefined.
Tensor WeightIn(const Tensor& weight, DType dtype) {
  if (!weight.defined()) return Tensor();
  return ContiguousData(weight.dtype() == dtype ? weight : weight.Detach().To(dtype));
}

// A contiguous buffer to write `t` through, and the copy back when it is not t.
Tensor ContiguousOut(const Tensor& t) { return t.is_contiguous() ? t : Empty(t.shape(), {.dtype = t.dtype()}); }

void CopyBack(const Tensor& dst, const Tensor& buf) {
  if (buf.is_same(dst)) return;
  NoGradGuard guard;
  dst.CopyFrom(buf);
}

void CheckNllTargets(const int64_t* t, int64_t n, int64_t c, int64_t s, int64_t ignore_index) {
  for (int64_t i = 0; i < n * s; ++i) {
    if (t[i] == ignore_index || (t[i] >= 0 && t[i] < c)) continue;
    const std::string where = s == 1 ? "sample " + std::to_string(i)
                                     : "sample " + std::to_string(i / s) + ", position " + std::to_string(i % s);
    throw std::out_of_range("nll_loss: target " + std::to_string(t[i]) + " (" + where + ") is out of range for " +
                            std::to_string(c) + " classes [0, " + std::to_string(c - 1) + "]");
  }
}

}  // namespace

void NllLossForward(const Tensor& log_probs, const Tensor& target, const Tensor& weight, int64_t ignore_index,
                    const Tensor& loss) {
  const int64_t n = log_probs.size(0), c = log_probs.size(1);
  // Positions per sample: the sizes after the class dim (not numel / (n * c),
  // which is 0 when there are no classes and then checked no target).
  int64_t s = 1;
  for (size_t d = 2; d < log_probs.shape().size(); ++d) s *= log_probs.shape()[d];
  const Tensor tc = ContiguousData(target);
  const int64_t* t = tc.data<int64_t>();
  CheckNllTargets(t, n, c, s, ignore_index);
  const Tensor lpc = ContiguousData(log_probs);
  const Tensor wc = WeightIn(weight, log_probs.dtype());
  Tensor out = ContiguousOut(loss);
  DDP_DISPATCH_FLOATING(log_probs.dtype(), "nll_loss", {
    using A = acc_t<scalar_t>;
    const scalar_t* lp = static_cast<const scalar_t*>(lpc.data_ptr());
    const scalar_t* w = wc.defined() ? static_cast<const scalar_t*>(wc.data_ptr()) : nullptr;
    scalar_t* l = static_cast<scalar_t*>(out.data_ptr());
    for (int64_t i = 0; i < n * s; ++i) {
      const int64_t k = t[i];
      if (k == ignore_index) {
        l[i] = scalar_t(0);
        continue;
      }
      const A wk = w != nullptr ? static_cast<A>(w[k]) : A(1);
      l[i] = static_cast<scalar_t>(-wk * static_cast<A>(lp[((i / s) * c + k) * s + i % s]));
    }
  });
  CopyBack(loss, out);
}

void NllLossBackward(const Tensor& target, const Tensor& weight, const Tensor& grad_loss, int64_t ignore_index,
                     const Tensor& dlog_probs) {
  const int64_t n = dlog_probs.size(0), c = dlog_probs.size(1);
  // Positions per sample: the sizes after the class dim (not numel / (n * c),
  // which is 0 when there are no classes and then checked no target).
  int64_t s = 1;
  for (size_t d = 2; d < dlog_probs.shape().size(); ++d) s *= dlog_probs.shape()[d];
  const Tensor tc = ContiguousData(target);
  const int64_t* t = tc.data<int64_t>();
  CheckNllTargets(t, n, c, s, ignore_index);
  const DType dt = dlog_probs.dtype();
  const Tensor g = ContiguousData(grad_loss.dtype() == dt ? grad_loss : grad_loss.Detach().To(dt));
  const Tensor wc = WeightIn(weight, dt);
  Tensor out = ContiguousOut(dlog_probs);
  DDP_DISPATCH_FLOATING(dt, "nll_loss_backward", {
    using A = acc_t<scalar_t>;
    const scalar_t* gp = static_cast<const scalar_t*>(g.data_ptr());
    const int64_t gstride = g.numel() == 1 ? 0 : 1;
    const scalar_t* w = wc.defined() ? static_cast<const scalar_t*>(wc.data_ptr()) : nullptr;
    scalar_t* d = static_cast<scalar_t*>(out.data_ptr());
    std::fill(d, d + out.numel(), scalar_t(0));
    for (int64_t i = 0; i < n * s; ++i) {
      const int64_t k = t[i];
      if (k == ignore_index) continue;
      const A wk = w != nullptr ? static_cast<A>(w[k]) : A(1);
      d[((i / s) * c + k) * s + i % s] = static_cast<scalar_t>(-wk * static_cast<A>(gp[i * gstride]));
    }
  });
  CopyBack(dlog_probs, out);
}

}  // namespace ddp::nn::ops::cpu
