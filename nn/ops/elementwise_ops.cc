// Elementwise differentiable ops: out[i] = f(a[i], b[i]) with broadcasting.
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "nn/ops/functional.h"
#include "nn/ops/op_util.h"

namespace ddp::nn::ops {

namespace detail {

bool Exclusive(const Tensor& g, const Tensor& like) {
  return g.defined() && g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 && g.is_contiguous() &&
         g.dtype() == like.dtype() && g.shape() == like.shape() && g.device() == like.device();
}

void CheckSameDevice(const char* op, const Tensor& a, const Tensor& b) {
  if (a.device() != b.device()) {
    throw std::invalid_argument(std::string(op) + ": tensors on different devices (" + a.device().ToString() +
                                " and " + b.device().ToString() + ")");
  }
}

void CheckDefinedOperand(const char* op, const char* what, const Tensor& t) {
  if (!t.defined()) throw std::invalid_argument(std::string(op) + ": " + what + " is undefined");
}

void CheckFloatingOperand(const char* op, const char* what, const Tensor& t) {
  CheckDefinedOperand(op, what, t);
  if (!IsFloating(t.dtype())) {
    throw std::invalid_argument(std::string(op) + ": " + what + " must be floating, got " +
                                std::string(DTypeName(t.dtype())));
  }
}

}  // namespace detail

using detail::LambdaNode;
using detail::NewLike;
using detail::SavedTensor;

namespace {

const char* BinaryName(BinaryOp op) {
  switch (op) {
    case BinaryOp::kAdd: return "AddBackward";
    case BinaryOp::kSub: return "SubBackward";
    case BinaryOp::kMul: return "MulBackward";
    case BinaryOp::kDiv: return "DivBackward";
    case BinaryOp::kAddRelu: return "AddReluBackward";
  }
  return "BinaryBackward";
}

Tensor BinaryOpImpl(BinaryOp op, const Tensor& a_in, const Tensor& b_in) {
  // The op's own name ("AddRelu", not a prefix of the node's name) in errors.
  const std::string name = detail::ForwardName(BinaryName(op));
  if (!a_in.defined() || !b_in.defined()) {
    const auto describe = [](const Tensor& t) { return t.defined() ? ShapeToString(t.shape()) : "undefined"; };
    const std::string which = !a_in.defined() && !b_in.defined() ? "operands a and b are"
                              : !a_in.defined()                  ? "operand a is"
                                                                 : "operand b is";
    throw std::invalid_argument(name + ": " + which + " undefined (a: " + describe(a_in) +
                                ", b: " + describe(b_in) + ")");
  }
  detail::CheckSameDevice(name.c_str(), a_in, b_in);
  // torch.result_type: a 0-d operand (a loss, a scale) gives way to the
  // other's dtype unless it is floating and the other is not.
  DType dtype = ResultType(a_in.dtype(), a_in.dim() == 0, b_in.dtype(), b_in.dim() == 0);
  // Division is true division, as torch.div: integer operands divide as the
  // default float dtype (f32), so 7 / 2 is 3.5 and x / 0 is inf, never a trap.
  if (op == BinaryOp::kDiv && !IsFloating(dtype)) dtype = DType::kFloat32;
  const Tensor a = a_in.dtype() == dtype ? a_in : Cast(a_in, dtype);
  const Tensor b = b_in.dtype() == dtype ? b_in : Cast(b_in, dtype);
  Shape shape;
  try {
    shape = BroadcastShapes(a.shape(), b.shape());
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(name + ": " + e.what());
  }
  Tensor out = Empty(shape, {.dtype = dtype, .device = a.device()});
  DDP_KERNEL(out.device(), binary)(op, a, b, out);
  if (!detail::AnyRequiresGrad({&a, &b})) return out;

  const Shape as = a.shape(), bs = b.shape();
  auto node = std::make_shared<LambdaNode>(BinaryName(op), [op, as, bs](LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor& go = g[0];
    const Device dev = go.device();
    Tensor ga, gb;
    switch (op) {
      case BinaryOp::kAdd:
        if (n.needs_input_grad(0)) ga = detail::SumToShape(go, as);
        if (n.needs_input_grad(1)) gb = detail::SumToShape(go, bs);
        break;
      case BinaryOp::kSub:
        if (n.needs_input_grad(0)) ga = detail::SumToShape(go, as);
        if (n.needs_input_grad(1)) {
          Tensor t = NewLike(go);
          DDP_KERNEL(dev, affine)(go, -1.0, -0.0, t);  // -0.0: see MulScalar
          gb = detail::SumToShape(t, bs);
        }
        break;
      case BinaryOp::kMul: {
        const Tensor av = n.saved[0].Get(), bv = n.saved[1].Get();
        if (n.needs_input_grad(0)) {
          Tensor t = NewLike(go);
          DDP_KERNEL(dev, binary)(BinaryOp::kMul, go, bv, t);
          ga = detail::SumToShape(t, as);
        }
        if (n.needs_input_grad(1)) {
          Tensor t = NewLike(go);
          DDP_KERNEL(dev, binary)(BinaryOp::kMul, go, av, t);
          gb = detail::SumToShape(t, bs);
        }
        break;
      }
      case BinaryOp::kDiv: {
        const Tensor av = n.saved[0].Get(), bv = n.saved[1].Get();
        Tensor t = NewLike(go);
        DDP_KERNEL(dev, binary)(BinaryOp::kDiv, go, bv, t);  // g / b
        if (n.needs_input_grad(0)) ga = detail::SumToShape(t, as);
        if (n.needs_input_grad(1)) {
          // -g * a / b^2 = -(g / b) * (a / b)
          Tensor q = NewLike(go), r = NewLike(go);
          DDP_KERNEL(dev, binary)(BinaryOp::kDiv, av, bv, q);
          DDP_KERNEL(dev, binary)(BinaryOp::kMul, t, q, r);
          DDP_KERNEL(dev, affine)(r, -1.0, -0.0, r);
          gb = detail::SumToShape(r, bs);
        }
        break;
      }
      case BinaryOp::kAddRelu: {
        // ReLU's derivative from the output (y > 0 exactly where a + b > 0),
        // shared by both operands as Add's gradient is.
        const Tensor y = n.saved[0].Get();
        Tensor t = detail::Exclusive(go, y) ? go : NewLike(y);
        DDP_KERNEL(dev, unary_backward)(UnaryOp::kRelu, go, y, t);
        if (n.needs_input_grad(0)) ga = detail::SumToShape(t, as);
        if (n.needs_input_grad(1)) gb = detail::SumToShape(t, bs);
        break;
      }
    }
    return std::vector<Tensor>{ga, gb};
  });
  if (op == BinaryOp::kMul || op == BinaryOp::kDiv) {
    node->saved.emplace_back(a);
    node->saved.emplace_back(b);
  }
  if (op == BinaryOp::kAddRelu) node->saved.emplace_back(out);
  detail::ConnectNode(node, {&a, &b}, {&out});
  return out;
}

const char* UnaryName(UnaryOp op) {
  switch (op) {
    case UnaryOp::kNeg: return "NegBackward";
    case UnaryOp::kRelu: return "ReluBackward";
    case UnaryOp::kGelu: return "GeluBackward";
    case UnaryOp::kGeluTanh: return "GeluBackward";
    case UnaryOp::kSigmoid: return "SigmoidBackward";
    case UnaryOp::kTanh: return "TanhBackward";
    case UnaryOp::kExp: return "ExpBackward";
    case UnaryOp::kLog: return "LogBackward";
    case UnaryOp::kSqrt: return "SqrtBackward";
    case UnaryOp::kSquare: return "SquareBackward";
    case UnaryOp::kAbs: return "AbsBackward";
    case UnaryOp::kLog1p: return "Log1pBackward";
  }
  return "UnaryBackward";
}

// Whether the backward of op needs the output (else the input).
bool SavesOutput(UnaryOp op) {
  return op == UnaryOp::kSigmoid || op == UnaryOp::kTanh || op == UnaryOp::kExp || op == UnaryOp::kSqrt ||
         op == UnaryOp::kRelu;
}

// An elementwise map of an integer tensor (i64, i32, u8) that keeps its
// dtype, as PyTorch's abs, relu and clamp of integers: f takes and returns
// i64, the result stored at the tensor's width (so i32 abs(-2^31) wraps to
// -2^31 as in PyTorch). No gradient: an integer tensor never requires one.
// Only on the CPU: the device kernels take floating tensors alone.
template <typename F>
Tensor IntegerMap(const char* op, const Tensor& x, F f) {
  if (!x.device().is_cpu()) {
    throw std::invalid_argument(std::string(op) + ": an integer tensor (" + std::string(DTypeName(x.dtype())) +
                                ") is implemented on the CPU only, not on " + x.device().ToString());
  }
  const Tensor xc = x.Detach().Contiguous();
  Tensor out = Empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
  const auto map = [&]<typename T>(T*) {
    const T* src = xc.data<T>();
    T* dst = out.data<T>();
    for (int64_t i = 0; i < out.numel(); ++i) dst[i] = static_cast<T>(f(static_cast<int64_t>(src[i])));
  };
  switch (x.dtype()) {
    case DType::kInt64: map(static_cast<int64_t*>(nullptr)); break;
    case DType::kInt32: map(static_cast<int32_t*>(nullptr)); break;
    case DType::kUInt8: map(static_cast<uint8_t*>(nullptr)); break;
    default:
      throw std::invalid_argument(std::string(op) + ": unsupported dtype " + std::string(DTypeName(x.dtype())));
  }
  return out;
}

// |v| with two's-complement wrap at the most negative value, without the
// undefined behaviour of negating it in i64.
int64_t WrappingAbs(int64_t v) { return v < 0 ? static_cast<int64_t>(0 - static_cast<uint64_t>(v)) : v; }

Tensor UnaryOpImpl(UnaryOp op, const Tensor& x) {
  if (!x.defined()) throw std::invalid_argument(detail::ForwardName(UnaryName(op)) + ": undefined input");
  // torch.abs and torch.relu keep an integer tensor's dtype.
  if (op == UnaryOp::kAbs && !IsFloating(x.dtype())) return IntegerMap("Abs", x, &WrappingAbs);
  if (op == UnaryOp::kRelu && !IsFloating(x.dtype())) {
    return IntegerMap("Relu", x, [](int64_t v) { return v < 0 ? int64_t{0} : v; });
  }
  if (!IsFloating(x.dtype())) {
    throw std::invalid_argument(detail::ForwardName(UnaryName(op)) + ": needs a floating tensor, got " +
                                std::string(DTypeName(x.dtype())));
  }
  Tensor out = NewLike(x);
  DDP_KERNEL(x.device(), unary)(op, x, out);
  if (!detail::AnyRequiresGrad({&x})) return out;
  auto node = std::make_shared<LambdaNode>(UnaryName(op), [op](LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor s = n.saved[0].Get();
    // The incoming gradient is overwritten when nobody else holds it (saves
    // a buffer and its write-allocate traffic). ReLU's derivative comes from
    // its output: y > 0 exactly where x > 0.
    Tensor gi = detail::Exclusive(g[0], s) ? g[0] : NewLike(s);
    DDP_KERNEL(s.device(), unary_backward)(op, g[0], s, gi);
    return std::vector<Tensor>{gi};
  });
  node->saved.emplace_back(SavesOutput(op) ? out : x);
  detail::ConnectNode(node, {&x}, {&out});
  return out;
}

// A scalar op's operand: an integer (or bool) tensor promotes to f32, as
// torch.result_type does for an integer tensor and a float scalar (the
// scalar is a double here), and as Div divides integers.
Tensor FloatingOperand(const Tensor& x, const char* name) {
  if (!x.defined()) throw std::invalid_argument(detail::ForwardName(name) + ": undefined input");
  return IsFloating(x.dtype()) ? x : Cast(x, DType::kFloat32);
}

Tensor AffineImpl(const Tensor& x_in, double alpha, double beta, const char* name) {
  const Tensor x = FloatingOperand(x_in, name);
  Tensor out = NewLike(x);
  DDP_KERNEL(x.device(), affine)(x, alpha, beta, out);
  if (!detail::AnyRequiresGrad({&x})) return out;
  auto node = std::make_shared<LambdaNode>(name, [alpha](LambdaNode&, std::vector<Tensor>& g) {
    if (alpha == 1.0) return std::vector<Tensor>{g[0]};
    Tensor gi = NewLike(g[0]);
    DDP_KERNEL(gi.device(), affine)(g[0], alpha, -0.0, gi);  // a pure scale: see MulScalar
    return std::vector<Tensor>{gi};
  });
  detail::ConnectNode(node, {&x}, {&out});
  return out;
}

}  // namespace

Tensor Add(const Tensor& a, const Tensor& b) { return BinaryOpImpl(BinaryOp::kAdd, a, b); }
Tensor Sub(const Tensor& a, const Tensor& b) { return BinaryOpImpl(BinaryOp::kSub, a, b); }
Tensor Mul(const Tensor& a, const Tensor& b) { return BinaryOpImpl(BinaryOp::kMul, a, b); }
Tensor Div(const Tensor& a, const Tensor& b) { return BinaryOpImpl(BinaryOp::kDiv, a, b); }
Tensor AddRelu(const Tensor& a, const Tensor& b) {
  if (a.defined() && b.defined() && !IsFloating(ResultType(a.dtype(), a.dim() == 0, b.dtype(), b.dim() == 0))) {
    throw std::invalid_argument("AddRelu: needs floating tensors, got " + std::string(DTypeName(a.dtype())) +
                                " and " + std::string(DTypeName(b.dtype())));
  }
  return BinaryOpImpl(BinaryOp::kAddRelu, a, b);
}
Tensor AddScalar(const Tensor& x, double s) { return AffineImpl(x, 1.0, s, "AddScalarBackward"); }
// -0.0, not +0.0, is the additive identity: -0.0 + y is y for every y, -0
// included, so -0.0 * 2 and -0.0 * 1 stay -0 as in PyTorch (+0.0 would turn
// them into +0). The same add, so no slower.
Tensor MulScalar(const Tensor& x, double s) { return AffineImpl(x, s, -0.0, "MulScalarBackward"); }

Tensor DivScalar(const Tensor& x_in, double s) {
  const Tensor x = FloatingOperand(x_in, "DivScalarBackward");
  Tensor out = NewLike(x);
  DDP_KERNEL(x.device(), div_scalar)(x, s, out);
  if (!detail::AnyRequiresGrad({&x})) return out;
  auto node = std::make_shared<LambdaNode>("DivScalarBackward", [s](LambdaNode&, std::vector<Tensor>& g) {
    Tensor gi = NewLike(g[0]);
    DDP_KERNEL(gi.device(), div_scalar)(g[0], s, gi);  // g / s
    return std::vector<Tensor>{gi};
  });
  detail::ConnectNode(node, {&x}, {&out});
  return out;
}
Tensor Neg(const Tensor& x) {
  // An integer tensor negates in its own dtype, as torch.neg (u8 wraps:
  // -1 is 255): a product with -1 taken at the tensor's width. No gradient.
  if (x.defined() && !IsFloating(x.dtype())) {
    return Mul(x, ::ddp::nn::detail::IntegralScalarOf(-1, x.dtype(), x.device()));
  }
  return UnaryOpImpl(UnaryOp::kNeg, x);
}
Tensor Relu(const Tensor& x) { return UnaryOpImpl(UnaryOp::kRelu, x); }

Tensor ReluOwned(Tensor x) {
  const bool exclusive = x.defined() && x.impl_ptr().use_count() == 1 && x.storage().use_count() == 1 &&
                         IsFloating(x.dtype()) && (x.grad_fn() != nullptr || !x.requires_grad());
  if (!exclusive) return Relu(x);
  DDP_KERNEL(x.device(), unary)(UnaryOp::kRelu, x, x);
  x.storage()->BumpVersion();
  // A fresh handle on the same memory carries the new history; x's own
  // history (its producer) becomes this node's input edge.
  Tensor out = x.Detach();
  if (!detail::AnyRequiresGrad({&x})) return out;
  auto node = std::make_shared<LambdaNode>("ReluBackward", [](LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor s = n.saved[0].Get();
    Tensor gi = detail::Exclusive(g[0], s) ? g[0] : NewLike(s);
    DDP_KERNEL(s.device(), unary_backward)(UnaryOp::kRelu, g[0], s, gi);
    return std::vector<Tensor>{gi};
  });
  detail::ConnectNode(node, {&x}, {&out});
  node->saved.emplace_back(out);
  return out;
}
Tensor Gelu(const Tensor& x, bool tanh_approximation) {
  return UnaryOpImpl(tanh_approximation ? UnaryOp::kGeluTanh : UnaryOp::kGelu, x);
}
Tensor Sigmoid(const Tensor& x) { return UnaryOpImpl(UnaryOp::kSigmoid, x); }
Tensor Tanh(const Tensor& x) { return UnaryOpImpl(UnaryOp::kTanh, x); }
Tensor Exp(const Tensor& x) { return UnaryOpImpl(UnaryOp::kExp, x); }
Tensor Log(const Tensor& x) { return UnaryOpImpl(UnaryOp::kLog, x); }
Tensor Sqrt(const Tensor& x) { return UnaryOpImpl(UnaryOp::kSqrt, x); }
Tensor Square(const Tensor& x) { return UnaryOpImpl(UnaryOp::kSquare, x); }
Tensor Abs(const Tensor& x) { return UnaryOpImpl(UnaryOp::kAbs, x); }
Tensor Log1p(const Tensor& x) { return UnaryOpImpl(UnaryOp::kLog1p, x); }

namespace {

// v rounded to dtype, as PyTorch converts a scalar bound to the tensor's
// type before comparing (bf16 clamp(max=1.005) clamps at 1.0078125).
double RoundToDType(double v, DType dtype) {
  double r = v;
  DDP_DISPATCH_FLOATING(dtype, "Clamp", r = static_cast<double>(static_cast<acc_t<scalar_t>>(scalar_t(v))));
  return r;
}

}  // namespace

Tensor Clamp(const Tensor& x, std::optional<double> min, std::optional<double> max) {
  if (!x.defined()) throw std::invalid_argument("Clamp: undefined input");
  // Bounds given as doubles are floating scalars: an integer x is clamped
  // as f32, as torch.clamp promotes with float bounds (the integral
  // overload keeps the dtype).
  if (!IsFloating(x.dtype())) return Clamp(Cast(x, DType::kFloat32), min, max);
  if (!min.has_value() && !max.has_value()) {
    throw std::invalid_argument("Clamp: at least one of min and max must be given");
  }
  for (const auto& [what, bound] : {std::pair<const char*, const std::optional<double>*>{"min", &min}, {"max", &max}}) {
    if (bound->has_value() && std::isnan(**bound)) {
      throw std::invalid_argument(std::string("Clamp: ") + what +
                                  " is NaN (PyTorch would make every element NaN; pass no bound instead)");
    }
  }
  // A missing bound is the infinity on its side: the same values and the
  // same gradient mask (x >= -inf holds for every x but NaN).
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const double lo = min.has_value() ? RoundToDType(*min, x.dtype()) : -kInf;
  const double hi = max.has_value() ? RoundToDType(*max, x.dtype()) : kInf;
  Tensor out = NewLike(x);
  DDP_KERNEL(x.device(), clamp)(x, lo, hi, out);
  if (!detail::AnyRequiresGrad({&x})) return out;
  auto node = std::make_shared<LambdaNode>("ClampBackward", [lo, hi](LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor s = n.saved[0].Get();
    Tensor gi = detail::Exclusive(g[0], s) ? g[0] : NewLike(s);
    DDP_KERNEL(s.device(), clamp_backward)(g[0], s, lo, hi, gi);
    return std::vector<Tensor>{gi};
  });
  node->saved.emplace_back(x);
  detail::ConnectNode(node, {&x}, {&out});
  return out;
}

namespace detail {

Tensor ClampIntegral(const Tensor& x, std::optional<int64_t> min, std::optional<int64_t> max) {
  if (!x.defined()) throw std::invalid_argument("Clamp: undefined input");
  if (IsFloating(x.dtype())) {
    const auto as_double = [](std::optional<int64_t> b) {
      return b.has_value() ? std::optional<double>(static_cast<double>(*b)) : std::nullopt;
    };
    return Clamp(x, as_double(min), as_double(max));
  }
  if (!min.has_value() && !max.has_value()) {
    throw std::invalid_argument("Clamp: at least one of min and max must be given");
  }
  // A bound must fit the dtype: PyTorch wraps one for u8 (-10 becomes 246,
  // so clamp(-10, 10) gives 10 everywhere) and refuses one for i8; refusing
  // is the choice that cannot silently give a wrong answer.
  int64_t lowest = std::numeric_limits<int64_t>::min(), highest = std::numeric_limits<int64_t>::max();
  if (x.dtype() == DType::kUInt8) {
    lowest = 0;
    highest = 255;
  } else if (x.dtype() == DType::kInt32) {
    lowest = std::numeric_limits<int32_t>::min();
    highest = std::numeric_limits<int32_t>::max();
  }
  for (const auto& [what, bound] : {std::pair<const char*, std::optional<int64_t>>{"min", min}, {"max", max}}) {
    if (bound.has_value() && (*bound < lowest || *bound > highest)) {
      throw std::invalid_argument(std::string("Clamp: ") + what + " " + std::to_string(*bound) +
                                  " is outside the range of " + std::string(DTypeName(x.dtype())) + " [" +
                                  std::to_string(lowest) + ", " + std::to_string(highest) + "]");
    }
  }
  const int64_t lo = min.value_or(lowest), hi = max.value_or(highest);
  // max, then min: lo > hi gives hi everywhere, as torch.clamp.
  return IntegerMap("Clamp", x, [lo, hi](int64_t v) {
    const int64_t t = v < lo ? lo : v;
    return t > hi ? hi : t;
  });
}

}  // namespace detail

Tensor Dropout(const Tensor& x, double p, bool training, Generator& gen) {
  // Written so that NaN fails it too.
  if (!(p >= 0.0 && p <= 1.0)) {
    throw std::invalid_argument("Dropout: probability must be in [0, 1], got " + detail::ErrorValue(p));
  }
  // Outside training it is the identity for any tensor, as in PyTorch.
  if (!training || p == 0.0) return x;
  // Checked here, before a mask is drawn, rather than left to masked_scale.
  detail::CheckFloatingOperand("Dropout", "input", x);
  if (p == 1.0) return MulScalar(x, 0.0);
  Tensor mask = Empty(x.shape(), {.dtype = DType::kUInt8, .device = x.device()});
  DDP_KERNEL(x.device(), bernoulli_mask)(mask, 1.0 - p, gen);
  const double scale = 1.0 / (1.0 - p);
  Tensor out = NewLike(x);
  DDP_KERNEL(x.device(), masked_scale)(x, mask, scale, out);
  if (!detail::AnyRequiresGrad({&x})) return out;
  auto node = std::make_shared<LambdaNode>("DropoutBackward", [scale](LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor m = n.saved[0].Get();
    Tensor gi = NewLike(g[0]);
    DDP_KERNEL(gi.device(), masked_scale)(g[0], m, scale, gi);
    return std::vector<Tensor>{gi};
  });
  node->saved.emplace_back(mask);
  detail::ConnectNode(node, {&x}, {&out});
  return out;
}

Tensor Cast(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor out = Empty(x.shape(), {.dtype = dtype, .device = x.device()});
  {
    NoGradGuard guard;
    out.CopyFrom(x);
  }
  if (!IsFloating(dtype) || !detail::AnyRequiresGrad({&x})) return out;
  const DType from = x.dtype();
  auto node = std::make_shared<LambdaNode>("CastBackward", [from](LambdaNode&, std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0].To(from)};
  });
  detail::ConnectNode(node, {&x}, {&out});
  return out;
}

}  // namespace ddp::nn::ops
