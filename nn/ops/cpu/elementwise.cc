// Elementwise CPU kernels. Every kernel works on any strides through
// StridedLoop, with a flat loop when everything is contiguous (the common
// case, which the compiler vectorizes). 16-bit floats compute in f32.
#include <cmath>
#include <functional>
#include <stdexcept>
#include <type_traits>

#include "nn/ops/cpu/cpu_kernels.h"
#include "nn/tensor/strided_loop.h"

namespace ddp::nn::ops::cpu {

Shape BroadcastStrides(const Tensor& t, const Shape& shape) {
  const Shape& sh = t.shape();
  const Shape& st = t.strides();
  // Callers pass shapes that broadcast, but a stale operand (a leaf's .grad
  // left behind by SetData) must not index past `out` or read past t's end.
  const auto refuse = [&] {
    throw std::invalid_argument("cannot broadcast shape " + ShapeToString(sh) + " to " + ShapeToString(shape));
  };
  if (sh.size() > shape.size()) refuse();
  Shape out(shape.size(), 0);
  const size_t lead = shape.size() - sh.size();
  for (size_t i = 0; i < sh.size(); ++i) {
    if (sh[i] != 1 && sh[i] != shape[lead + i]) refuse();
    out[lead + i] = (sh[i] == 1 && shape[lead + i] != 1) ? 0 : st[i];
  }
  return out;
}

Tensor ContiguousData(const Tensor& t) {
  if (t.is_contiguous()) return t;
  return t.Detach().Contiguous();
}

Tensor AsFloat32(const Tensor& t) {
  if (t.dtype() == DType::kFloat32) return ContiguousData(t);
  return t.Detach().To(DType::kFloat32).Contiguous();
}

namespace {

constexpr double kSqrt1_2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluCoef = 0.044715;

// out[i] = f(x[i]) for tensors of one shape.
template <typename T, typename F>
void Map1(const Tensor& x, const Tensor& out, F f) {
  const T* xp = static_cast<const T*>(x.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  if (x.is_contiguous() && out.is_contiguous()) {
    const int64_t n = out.numel();
    for (int64_t i = 0; i < n; ++i) op[i] = static_cast<T>(f(static_cast<acc_t<T>>(xp[i])));
    return;
  }
  StridedLoop<2> loop(out.shape(), {out.strides(), x.strides()});
  loop.ForEachRow([&](const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& st) {
    T* o = op + off[0];
    const T* a = xp + off[1];
    for (int64_t i = 0; i < n; ++i) o[i * st[0]] = static_cast<T>(f(static_cast<acc_t<T>>(a[i * st[1]])));
  });
}

// out[i] = f(a[i], b[i]) with a and b given by strides over out's shape.
template <typename T, typename F>
void Map2(const Tensor& a, const Shape& a_strides, const Tensor& b, const Shape& b_strides,
          const Tensor& out, F f) {
  const T* ap = static_cast<const T*>(a.data_ptr());
  const T* bp = static_cast<const T*>(b.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  using A = acc_t<T>;
  StridedLoop<3> loop(out.shape(), {out.strides(), a_strides, b_strides});
  loop.ForEachRow([&](const std::array<int64_t, 3>& off, int64_t n, const std::array<int64_t, 3>& st) {
    T* o = op + off[0];
    const T* x = ap + off[1];
    const T* y = bp + off[2];
    if (st[0] == 1 && st[1] == 1 && st[2] == 1) {
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(f(static_cast<A>(x[i]), static_cast<A>(y[i])));
    } else if (st[0] == 1 && st[1] == 1 && st[2] == 0) {
      const A yv = static_cast<A>(y[0]);
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(f(static_cast<A>(x[i]), yv));
    } else if (st[0] == 1 && st[1] == 0 && st[2] == 1) {
      const A xv = static_cast<A>(x[0]);
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(f(xv, static_cast<A>(y[i])));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        o[i * st[0]] = static_cast<T>(f(static_cast<A>(x[i * st[1]]), static_cast<A>(y[i * st[2]])));
      }
    }
  });
}

template <typename T>
void UnaryTyped(UnaryOp op, const Tensor& x, const Tensor& out) {
  using A = acc_t<T>;
  switch (op) {
    case UnaryOp::kNeg: Map1<T>(x, out, [](A v) { return -v; }); break;
    // NaN fails `v < 0` and passes through unchanged, as torch.relu keeps
    // NaN (and -0); this still compiles to a vector compare and mask.
    case UnaryOp::kRelu: Map1<T>(x, out, [](A v) { return v < A(0) ? A(0) : v; }); break;
    case UnaryOp::kGelu:
      Map1<T>(x, out, [](A v) { return A(0.5) * v * (A(1) + std::erf(v * A(kSqrt1_2))); });
      break;
    case UnaryOp::kGeluTanh:
      Map1<T>(x, out, [](A v) {
        return A(0.5) * v * (A(1) + std::tanh(A(kSqrt2OverPi) * (v + A(kGeluCoef) * v * v * v)));
      });
      break;
    case UnaryOp::kSigmoid: Map1<T>(x, out, [](A v) { return A(1) / (A(1) + std::exp(-v)); }); break;
    case UnaryOp::kTanh: Map1<T>(x, out, [](A v) { return std::tanh(v); }); break;
    case UnaryOp::kExp: Map1<T>(x, out, [](A v) { return std::exp(v); }); break;
    case UnaryOp::kLog: Map1<T>(x, out, [](A v) { return std::log(v); }); break;
    case UnaryOp::kSqrt: Map1<T>(x, out, [](A v) { return std::sqrt(v); }); break;
    case UnaryOp::kSquare: Map1<T>(x, out, [](A v) { return v * v; }); break;
    case UnaryOp::kAbs: Map1<T>(x, out, [](A v) { return std::abs(v); }); break;
    case UnaryOp::kLog1p: Map1<T>(x, out, [](A v) { return std::log1p(v); }); break;
  }
}

template <typename T>
void UnaryBackwardTyped(UnaryOp op, const Tensor& g, const Tensor& s, const Tensor& out) {
  using A = acc_t<T>;
  const Shape gs = g.strides(), ss = s.strides();
  switch (op) {
    case UnaryOp::kNeg: Map2<T>(g, gs, s, ss, out, [](A d, A) { return -d; }); break;
    case UnaryOp::kRelu: Map2<T>(g, gs, s, ss, out, [](A d, A x) { return x <= A(0) ? A(0) : d; }); break;
    case UnaryOp::kGelu:
      Map2<T>(g, gs, s, ss, out, [](A d, A x) {
        const A cdf = A(0.5) * (A(1) + std::erf(x * A(kSqrt1_2)));
        const A pdf = A(kInvSqrt2Pi) * std::exp(A(-0.5) * x * x);
        return d * (cdf + x * pdf);
      });
      break;
    case UnaryOp::kGeluTanh:
      Map2<T>(g, gs, s, ss, out, [](A d, A x) {
        const A u = A(kSqrt2OverPi) * (x + A(kGeluCoef) * x * x * x);
        const A t = std::tanh(u);
        const A du = A(kSqrt2OverPi) * (A(1) + A(3 * kGeluCoef) * x * x);
        return d * (A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * du);
      });
      break;
    case UnaryOp::kSigmoid: Map2<T>(g, gs, s, ss, out, [](A d, A y) { return d * y * (A(1) - y); }); break;
    case UnaryOp::kTanh: Map2<T>(g, gs, s, ss, out, [](A d, A y) { return d * (A(1) - y * y); }); break;
    case UnaryOp::kExp: Map2<T>(g, gs, s, ss, out, [](A d, A y) { return d * y; }); break;
    case UnaryOp::kLog: Map2<T>(g, gs, s, ss, out, [](A d, A x) { return d / x; }); break;
    case UnaryOp::kSqrt: Map2<T>(g, gs, s, ss, out, [](A d, A y) { return d / (A(2) * y); }); break;
    case UnaryOp::kSquare: Map2<T>(g, gs, s, ss, out, [](A d, A x) { return A(2) * d * x; }); break;
    case UnaryOp::kAbs:
      Map2<T>(g, gs, s, ss, out, [](A d, A x) { return x > A(0) ? d : (x < A(0) ? -d : A(0)); });
      break;
    case UnaryOp::kLog1p: Map2<T>(g, gs, s, ss, out, [](A d, A x) { return d / (A(1) + x); }); break;
  }
}

// x op y for +, - and *; on integers it wraps in two's complement as in
// PyTorch (INT64_MAX + 1 is INT64_MIN). Signed overflow is undefined, so the
// operation runs in the unsigned type of the promoted operands (unsigned int
// for u8, whose product would overflow an int otherwise) and the result is
// converted back, which C++20 defines as modular.
template <typename A, typename Op>
A WrappingOp(A x, A y, Op op) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<decltype(x + y)>;
    return static_cast<A>(op(static_cast<U>(x), static_cast<U>(y)));
  } else {
    return op(x, y);
  }
}

void CheckSameDType(const char* what, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype()) {
    throw std::invalid_argument(std::string(what) + ": dtypes " + std::string(DTypeName(a.dtype())) +
                                " and " + std::string(DTypeName(b.dtype())) + " differ");
  }
}

}  // namespace

void Unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  CheckSameDType("unary", x, out);
  DDP_DISPATCH_FLOATING(out.dtype(), "unary", UnaryTyped<scalar_t>(op, x, out));
}

void UnaryBackward(UnaryOp op, const Tensor& grad_out, const Tensor& saved, const Tensor& grad_in) {
  CheckSameDType("unary_backward", grad_out, grad_in);
  CheckSameDType("unary_backward", saved, grad_in);
  DDP_DISPATCH_FLOATING(grad_in.dtype(), "unary_backward",
                        UnaryBackwardTyped<scalar_t>(op, grad_out, saved, grad_in));
}

void Binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  CheckSameDType("binary", a, out);
  CheckSameDType("binary", b, out);
  // An integer divisor of 0 would trap (SIGFPE); ops::Div divides integers as f32.
  if (op == BinaryOp::kDiv && !IsFloating(out.dtype())) {
    throw std::invalid_argument("binary: division needs a floating dtype, got " + std::string(DTypeName(out.dtype())));
  }
  const Shape as = BroadcastStrides(a, out.shape());
  const Shape bs = BroadcastStrides(b, out.shape());
  DDP_DISPATCH_ALL(out.dtype(), "binary", {
    using A = acc_t<scalar_t>;
    switch (op) {
      case BinaryOp::kAdd:
        Map2<scalar_t>(a, as, b, bs, out, [](A x, A y) { return WrappingOp(x, y, std::plus<>()); });
        break;
      case BinaryOp::kSub:
        Map2<scalar_t>(a, as, b, bs, out, [](A x, A y) { return WrappingOp(x, y, std::minus<>()); });
        break;
      case BinaryOp::kMul:
        Map2<scalar_t>(a, as, b, bs, out, [](A x, A y) { return WrappingOp(x, y, std::multiplies<>()); });
        break;
      case BinaryOp::kDiv: Map2<scalar_t>(a, as, b, bs, out, [](A x, A y) { return x / y; }); break;
      case BinaryOp::kAddRelu:
        Map2<scalar_t>(a, as, b, bs, out, [](A x, A y) {
          const A s = WrappingOp(x, y, std::plus<>());
          return s < A(0) ? A(0) : s;
        });
        break;
    }
  });
}

void Clamp(const Tensor& x, double lo, double hi, const Tensor& out) {
  CheckSameDType("clamp", x, out);
  DDP_DISPATCH_FLOATING(out.dtype(), "clamp", {
    using A = acc_t<scalar_t>;
    const A l = static_cast<A>(lo), h = static_cast<A>(hi);
    const Shape xs = BroadcastStrides(x, out.shape());
    // max, then min, each written so that a NaN x fails the comparison and
    // passes through; lo > hi then ends at hi, as torch.clamp.
    Map2<scalar_t>(x, xs, x, xs, out, [l, h](A v, A) {
      const A t = v < l ? l : v;
      return t > h ? h : t;
    });
  });
}

void ClampBackward(const Tensor& grad_out, const Tensor& x, double lo, double hi, const Tensor& grad_in) {
  CheckSameDType("clamp_backward", grad_out, grad_in);
  CheckSameDType("clamp_backward", x, grad_in);
  DDP_DISPATCH_FLOATING(grad_in.dtype(), "clamp_backward", {
    using A = acc_t<scalar_t>;
    const A l = static_cast<A>(lo), h = static_cast<A>(hi);
    Map2<scalar_t>(grad_out, BroadcastStrides(grad_out, grad_in.shape()), x, BroadcastStrides(x, grad_in.shape()),
                   grad_in, [l, h](A d, A v) { return v >= l && v <= h ? d : A(0); });
  });
}

void Affine(const Tensor& x, double alpha, double beta, const Tensor& out) {
  CheckSameDType("affine", x, out);
  DDP_DISPATCH_FLOATING(out.dtype(), "affine", {
    using A = acc_t<scalar_t>;
    const A al = static_cast<A>(alpha), be = static_cast<A>(beta);
    const Shape xs = BroadcastStrides(x, out.shape());
    Map2<scalar_t>(x, xs, x, xs, out, [al, be](A v, A) { return al * v + be; });
  });
}

void DivScalar(const Tensor& x, double s, const Tensor& out) {
  CheckSameDType("div_scalar", x, out);
  DDP_DISPATCH_FLOATING(out.dtype(), "div_scalar", {
    using A = acc_t<scalar_t>;
    const A d = static_cast<A>(s);
    const Shape xs = BroadcastStrides(x, out.shape());
    Map2<scalar_t>(x, xs, x, xs, out, [d](A v, A) { return v / d; });
  });
}

void AddScaled(const Tensor& out, const Tensor& x, double alpha) {
  CheckSameDType("add_scaled_", x, out);
  DDP_DISPATCH_FLOATING(out.dtype(), "add_scaled_", {
    using A = acc_t<scalar_t>;
    const A al = static_cast<A>(alpha);
    const Shape xs = BroadcastStrides(x, out.shape());
    if (al == A(1)) {
      Map2<scalar_t>(out, out.strides(), x, xs, out, [](A o, A v) { return o + v; });
    } else {
      Map2<scalar_t>(out, out.strides(), x, xs, out, [al](A o, A v) { return o + al * v; });
    }
  });
}

void MaskedScale(const Tensor& x, const Tensor& mask, double scale, const Tensor& out) {
  CheckSameDType("masked_scale", x, out);
  if (mask.dtype() != DType::kUInt8) throw std::invalid_argument("masked_scale: mask must be u8");
  Tensor xc = ContiguousData(x), mc = ContiguousData(mask);
  if (!out.is_contiguous()) throw std::invalid_argument("masked_scale: out must be contiguous");
  const uint8_t* m = mc.data<uint8_t>();
  DDP_DISPATCH_FLOATING(out.dtype(), "masked_scale", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    scalar_t* op = static_cast<scalar_t*>(out.data_ptr());
    const A s = static_cast<A>(scale);
    for (int64_t i = 0; i < out.numel(); ++i) op[i] = static_cast<scalar_t>(static_cast<A>(xp[i]) * (m[i] ? s : A(0)));
  });
}

void BernoulliMask(const Tensor& mask, double keep_prob, Generator& gen) {
  if (mask.dtype() != DType::kUInt8 || !mask.is_contiguous()) {
    throw std::invalid_argument("bernoulli_mask: mask must be contiguous u8");
  }
  uint8_t* m = mask.data<uint8_t>();
  // 24-bit uniform draws are plenty for a keep probability.
  const uint64_t threshold = static_cast<uint64_t>(keep_prob * 16777216.0);
  auto lock = gen.Lock();  // once per mask: the generator may be the shared default one
  for (int64_t i = 0; i < mask.numel(); ++i) m[i] = (gen.NextU64() >> 40) < threshold ? 1 : 0;
}

}  // namespace ddp::nn::ops::cpu
