// Matrix products. Shapes: Mm a [M,K] @ b [K,N] -> [M,N]; Bmm [B,M,K] @
// [B,K,N] -> [B,M,N]; Linear x [..., IN] @ w [OUT, IN]^T + bias [OUT] ->
// [..., OUT]. Backward: da = g @ b^T, db = a^T @ g (transposes are views,
// which the GEMM kernel turns into BLAS transpose flags).
#include <stdexcept>
#include <string>

#include "nn/ops/autocast.h"
#include "nn/ops/functional.h"
#include "nn/ops/op_util.h"

namespace ddp::nn::ops {

using detail::LambdaNode;

namespace {

void CheckFloatingSameType(const char* op, const Tensor& a, const Tensor& b) {
  if (!IsFloating(a.dtype()) || a.dtype() != b.dtype()) {
    throw std::invalid_argument(std::string(op) + ": operands must share a floating dtype, got " +
                                std::string(DTypeName(a.dtype())) + " and " + std::string(DTypeName(b.dtype())));
  }
  detail::CheckSameDevice(op, a, b);
}

// c = a @ b for 2-D tensors (no autograd).
Tensor MmRaw(const Tensor& a, const Tensor& b) {
  Tensor c = Empty({a.size(0), b.size(1)}, {.dtype = a.dtype(), .device = a.device()});
  DDP_KERNEL(a.device(), gemm)(a, b, c, 1.0, 0.0);
  return c;
}

Tensor Mm(const Tensor& a, const Tensor& b) {
  if (a.size(1) != b.size(0)) {
    throw std::invalid_argument("matmul: shapes " + ShapeToString(a.shape()) + " and " + ShapeToString(b.shape()) +
                                " cannot be multiplied (" + std::to_string(a.size(1)) + " != " +
                                std::to_string(b.size(0)) + ")");
  }
  Tensor out = MmRaw(a, b);
  if (!detail::AnyRequiresGrad({&a, &b})) return out;
  auto node = std::make_shared<LambdaNode>("MmBackward", [](LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor av = n.saved[0].Get(), bv = n.saved[1].Get();
    Tensor ga, gb;
    if (n.needs_input_grad(0)) ga = MmRaw(g[0], bv.Transpose(0, 1));
    if (n.needs_input_grad(1)) gb = MmRaw(av.Transpose(0, 1), g[0]);
    return std::vector<Tensor>{ga, gb};
  });
  node->saved.emplace_back(a);
  node->saved.emplace_back(b);
  detail::ConnectNode(node, {&a, &b}, {&out});
  return out;
}

// Batched product by one GEMM per batch entry (no autograd).
Tensor BmmRaw(const Tensor& a, const Tensor& b) {
  const int64_t batch = a.size(0);
  Tensor c = Empty({batch, a.size(1), b.size(2)}, {.dtype = a.dtype(), .device = a.device()});
  for (int64_t i = 0; i < batch; ++i) {
    DDP_KERNEL(a.device(), gemm)(a.Select(0, i), b.Select(0, i), c.Select(0, i), 1.0, 0.0);
  }
  return c;
}

Tensor Bmm(const Tensor& a, const Tensor& b) {
  if (a.size(0) != b.size(0) || a.size(2) != b.size(1)) {
    throw std::invalid_argument("matmul: batched shapes " + ShapeToString(a.shape()) + " and " +
                                ShapeToString(b.shape()) + " do not match");
  }
  Tensor out = BmmRaw(a.Detach(), b.Detach());
  if (!detail::AnyRequiresGrad({&a, &b})) return out;
  auto node = std::make_shared<LambdaNode>("BmmBackward", [](LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor av = n.saved[0].Get(), bv = n.saved[1].Get();
    Tensor ga, gb;
    if (n.needs_input_grad(0)) ga = BmmRaw(g[0], bv.Transpose(1, 2));
    if (n.needs_input_grad(1)) gb = BmmRaw(av.Transpose(1, 2), g[0]);
    return std::vector<Tensor>{ga, gb};
  });
  node->saved.emplace_back(a);
  node->saved.emplace_back(b);
  detail::ConnectNode(node, {&a, &b}, {&out});
  return out;
}

}  // namespace

Tensor Matmul(const Tensor& a_orig, const Tensor& b_orig) {
  detail::CheckDefinedOperand("matmul", "operand a", a_orig);
  detail::CheckDefinedOperand("matmul", "operand b", b_orig);
  // Autocast: both operands in the low dtype (a no-op when it is off).
  const Tensor a_in = autocast::ToLowPrecision(a_orig), b_in = autocast::ToLowPrecision(b_orig);
  CheckFloatingSameType("matmul", a_in, b_in);
  const int64_t da = a_in.dim(), db = b_in.dim();
  if (da == 0 || db == 0) {
    throw std::invalid_argument("matmul: both operands need at least one dimension, got shapes " +
                                ShapeToString(a_in.shape()) + " and " + ShapeToString(b_in.shape()) + " (" +
                                (da == 0 && db == 0 ? "both are" : da == 0 ? "a is" : "b is") + " 0-d)");
  }
  if (da == 1 && db == 1) {
    if (a_in.size(0) != b_in.size(0)) {
      throw std::invalid_argument("matmul: vectors of length " + std::to_string(a_in.size(0)) + " and " +
                                  std::to_string(b_in.size(0)));
    }
    // [1, K] @ [K, 1] through Mm: a dot product accumulated as a GEMM
    // accumulates (f32 under autocast) with the operands' dtype out, as
    // torch.dot; Sum(Mul) rounded every product to 16 bits and gave f32.
    return Reshape(Mm(Unsqueeze(a_in, 0), Unsqueeze(b_in, 1)), {});
  }
  // A vector against a matrix or batch: checked here, so that the error
  // names the shapes as given, not the vector with its added dimension.
  if ((da == 1 && a_in.size(0) != b_in.size(-2)) || (db == 1 && a_in.size(-1) != b_in.size(0))) {
    throw std::invalid_argument("matmul: shapes " + ShapeToString(a_in.shape()) + " and " +
                                ShapeToString(b_in.shape()) + " do not match (" +
                                std::to_string(da == 1 ? a_in.size(0) : a_in.size(-1)) + " against " +
                                std::to_string(db == 1 ? b_in.size(0) : b_in.size(-2)) + ")");
  }
  if (da == 1) return Squeeze(Matmul(Unsqueeze(a_in, 0), b_in), -2);
  if (db == 1) return Squeeze(Matmul(a_in, Unsqueeze(b_in, 1)), -1);
  // Checked before the leading dimensions are folded into M below, so that
  // the error names the shapes as given ([2, 3, 4] @ [5, 6] was reported as
  // [6, 4] against [5, 6]).
  if (a_in.size(-1) != b_in.size(-2)) {
    throw std::invalid_argument("matmul: shapes " + ShapeToString(a_in.shape()) + " and " +
                                ShapeToString(b_in.shape()) + " do not match (" + std::to_string(a_in.size(-1)) +
                                " against " + std::to_string(b_in.size(-2)) + ")");
  }
  if (da == 2 && db == 2) return Mm(a_in, b_in);
  if (db == 2) {
    // [..., M, K] @ [K, N]: fold the leading dimensions into M (counted, not
    // inferred with -1, which K = 0 would leave undetermined).
    Shape out_shape(a_in.shape().begin(), a_in.shape().end() - 1);
    const int64_t m = NumElements(out_shape);
    out_shape.push_back(b_in.size(1));
    return Reshape(Mm(Reshape(a_in, {m, a_in.size(-1)}), b_in), out_shape);
  }
  if (da == 3 && db == 3 && a_in.size(0) == b_in.size(0)) return Bmm(a_in, b_in);
  // Batched with broadcasting, as torch.matmul: [..., M, K] @ [..., K, N]
  // with the leading dimensions broadcast against each other (attention's
  // [B, H, T, D] @ [B, H, D, T], or [M, K] @ [B, K, N]). The operands are
  // expanded and folded into one batch; Expand's backward sums the
  // gradients back to each operand's own shape.
  const Shape a_batch(a_in.shape().begin(), a_in.shape().end() - 2);
  const Shape b_batch(b_in.shape().begin(), b_in.shape().end() - 2);
  Shape batch;
  try {
    batch = BroadcastShapes(a_batch, b_batch);
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("matmul: batch dimensions of " + ShapeToString(a_in.shape()) + " and " +
                                ShapeToString(b_in.shape()) + " cannot be broadcast together");
  }
  const int64_t m = a_in.size(-2), k = a_in.size(-1), n = b_in.size(-1), count = NumElements(batch);
  auto fold = [&](const Tensor& t, int64_t rows, int64_t cols) {
    Shape full = batch;
    full.push_back(rows);
    full.push_back(cols);
    const Tensor expanded = t.shape() == full ? t : Expand(t, full);
    return Reshape(expanded, {count, rows, cols});
  };
  Shape out_shape = batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  return Reshape(Bmm(fold(a_in, m, k), fold(b_in, k, n)), out_shape);
}

Tensor Linear(const Tensor& x_orig, const Tensor& w_orig, const Tensor& bias_orig) {
  // Integer operands are refused before anything is cast: an integer input
  // would otherwise be converted to the weight's dtype without a word.
  detail::CheckFloatingOperand("linear", "input", x_orig);
  detail::CheckFloatingOperand("linear", "weight", w_orig);
  if (bias_orig.defined()) detail::CheckFloatingOperand("linear", "bias", bias_orig);
  autocast::CheckNoF64Mix("linear", x_orig, w_orig);
  // Autocast: input, weight and bias in the low dtype (a no-op when it is off).
  const Tensor x_in = autocast::ToLowPrecision(x_orig);
  const Tensor w = autocast::ToLowPrecision(w_orig);
  const Tensor bias = autocast::ToLowPrecision(bias_orig);
  if (w.dim() != 2) throw std::invalid_argument("linear: weight must be 2-D, got " + ShapeToString(w.shape()));
  if (x_in.dim() < 1 || x_in.size(-1) != w.size(1)) {
    throw std::invalid_argument("linear: expected input [..., " + std::to_string(w.size(1)) + "], got " +
                                ShapeToString(x_in.shape()));
  }
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != w.size(0))) {
    throw std::invalid_argument("linear: bias of shape " + ShapeToString(bias.shape()) + " for " +
                                std::to_string(w.size(0)) + " outputs");
  }
  if (bias.defined() && bias.device() != w.device()) {
    throw std::invalid_argument("linear: bias is on " + bias.device().ToString() + ", weight on " +
                                w.device().ToString() + " (expected one device)");
  }
  // Inputs follow the layer's dtype (mixed precision: a bf16 layer after an f32 one).
  const Tensor x = x_in.dtype() == w.dtype() ? x_in : Cast(x_in, w.dtype());
  CheckFloatingSameType("linear", x, w);
  const int64_t in = w.size(1), out_features = w.size(0);
  // Rows: the product of x's leading dimensions (with in = 0, x has no
  // elements but still m rows, each the bias alone).
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) m *= x.size(d);
  const Tensor x2 = x.Detach().Reshape({m, in});
  Tensor y2 = Empty({m, out_features}, {.dtype = w.dtype(), .device = w.device()});
  double beta = 0.0;
  if (bias.defined()) {
    NoGradGuard guard;
    y2.CopyFrom(bias.dtype() == w.dtype() ? bias : bias.Detach().To(w.dtype()));  // broadcast rows
    beta = 1.0;
  }
  DDP_KERNEL(w.device(), gemm)(x2, w.Detach().Transpose(0, 1), y2, 1.0, beta);
  Shape out_shape(x.shape().begin(), x.shape().end() - 1);
  out_shape.push_back(out_features);
  Tensor y = y2.View(out_shape);
  if (!detail::AnyRequiresGrad({&x, &w, &bias})) return y;
  const Shape x_shape = x.shape();
  // The forward read the bias through an unrecorded cast to w's dtype, so its
  // gradient is turned back into the bias's own dtype here: the node that
  // made a bias of another dtype expects a gradient like its output.
  const DType bias_dtype = bias.defined() ? bias.dtype() : w.dtype();
  auto node = std::make_shared<LambdaNode>("LinearBackward", [x_shape, m, in, out_features, bias_dtype](
                                                                 LambdaNode& n, std::vector<Tensor>& g) {
    const Tensor g2 = g[0].Reshape({m, out_features});
    Tensor gx, gw, gb;
    if (n.needs_input_grad(0)) gx = MmRaw(g2, n.saved[1].Get()).View(x_shape);
    if (n.needs_input_grad(1)) gw = MmRaw(g2.Transpose(0, 1), n.saved[0].Get().Reshape({m, in}));
    if (n.needs_input_grad(2)) {
      gb = detail::SumToShape(g2, {out_features});
      if (gb.dtype() != bias_dtype) gb = gb.To(bias_dtype);
    }
    return std::vector<Tensor>{gx, gw, gb};
  });
  node->saved.emplace_back(x);
  node->saved.emplace_back(w);
  detail::ConnectNode(node, {&x, &w, &bias}, {&y});
  return y;
}

}  // namespace ddp::nn::ops
