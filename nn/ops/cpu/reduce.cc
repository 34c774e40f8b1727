// Reductions. Sums accumulate in double whatever the element type, so the
// bias gradient of a large batch loses nothing to rounding; the kernels are
// memory bound and the wider accumulator costs nothing measurable.
#include <limits>
#include <stdexcept>
#include <vector>

#include "nn/ops/cpu/cpu_kernels.h"
#include "nn/tensor/strided_loop.h"

namespace ddp::nn::ops::cpu {

// x: [d0, ..., dk]; out: same rank, each dimension equal to x's or 1 (summed
// over), receiving scale times the sum.
void SumTo(const Tensor& x, const Tensor& out, double scale) {
  if (out.dim() != x.dim()) {
    throw std::invalid_argument("sum_to: out rank " + std::to_string(out.dim()) + " differs from input rank " +
                                std::to_string(x.dim()));
  }
  const Shape& xs = x.shape();
  const Shape& os = out.shape();
  Shape acc_strides = ContiguousStrides(os);
  for (size_t d = 0; d < xs.size(); ++d) {
    if (os[d] != xs[d]) {
      if (os[d] != 1) {
        throw std::invalid_argument("sum_to: cannot sum shape " + ShapeToString(xs) + " to " + ShapeToString(os));
      }
      acc_strides[d] = 0;
    }
  }
  std::vector<double> acc(static_cast<size_t>(out.numel()), 0.0);
  StridedLoop<2> loop(xs, {acc_strides, x.strides()});
  DDP_DISPATCH_FLOATING(x.dtype(), "sum_to", {
    const scalar_t* xp = static_cast<const scalar_t*>(x.data_ptr());
    double* a = acc.data();
    loop.ForEachRow([&](const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& st) {
      const scalar_t* src = xp + off[1];
      if (st[0] == 0) {
        double s = 0;
        if (st[1] == 1) {
          for (int64_t i = 0; i < n; ++i) s += static_cast<double>(static_cast<acc_t<scalar_t>>(src[i]));
        } else {
          for (int64_t i = 0; i < n; ++i) s += static_cast<double>(static_cast<acc_t<scalar_t>>(src[i * st[1]]));
        }
        a[off[0]] += s;
      } else {
        double* dst = a + off[0];
        for (int64_t i = 0; i < n; ++i) {
          dst[i * st[0]] += static_cast<double>(static_cast<acc_t<scalar_t>>(src[i * st[1]]));
        }
      }
    });
  });
  // Scaled before the rounding into out: a mean of many 16-bit values fits
  // in the 16-bit type even when their sum does not.
  if (scale != 1.0) {
    for (double& v : acc) v *= scale;
  }
  Tensor acc_t = Tensor::FromBlob(acc.data(), os, DType::kFloat64);
  NoGradGuard guard;
  out.CopyFrom(acc_t);
}

// x: [..., D, ...] reduced along dim; out: x's shape without dim (i64).
void Argmax(const Tensor& x, int64_t dim, const Tensor& out) {
  dim = x.WrapDim(dim);
  if (out.dtype() != DType::kInt64) throw std::invalid_argument("argmax: out must be i64");
  // Rows of D contiguous elements, in the order of out's elements: dim goes
  // last and the other dimensions keep their order (a transpose of dim with
  // the last one would swap that one into dim's place).
  Shape order;
  for (int64_t k = 0; k < x.dim(); ++k) {
    if (k != dim) order.push_back(k);
  }
  order.push_back(dim);
  const Tensor moved = x.Detach().Permute(order).Contiguous();
  const int64_t d = x.size(dim);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  Tensor res = Empty({rows}, {.dtype = DType::kInt64});
  int64_t* r = res.data<int64_t>();
  DDP_DISPATCH_ALL(x.dtype(), "argmax", {
    const scalar_t* p = static_cast<const scalar_t*>(moved.data_ptr());
    for (int64_t i = 0; i < rows; ++i) {
      const scalar_t* row = p + i * d;
      // The first maximum wins; NaN counts as larger than everything, so the
      // first NaN ends the scan (PyTorch's rule). v != v is false for integers.
      int64_t best = 0;
      acc_t<scalar_t> bv = static_cast<acc_t<scalar_t>>(row[0]);
      for (int64_t j = 1; j < d && bv == bv; ++j) {
        const acc_t<scalar_t> v = static_cast<acc_t<scalar_t>>(row[j]);
        if (v > bv || v != v) {
          bv = v;
          best = j;
        }
      }
      r[i] = best;
    }
  });
  NoGradGuard guard;
  out.CopyFrom(res.View(out.shape()));
}

}  // namespace ddp::nn::ops::cpu
