#include "nn/ops/gradcheck.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <sstream>
#include <string>

#include "nn/autograd/engine.h"
#include "nn/tensor/generator.h"

namespace ddp::nn::testing {

namespace {

// Element offsets (in elements, from data_ptr) of a strided tensor in row-major order.
std::vector<int64_t> Offsets(const Tensor& t) {
  std::vector<int64_t> out;
  out.reserve(t.numel());
  std::vector<int64_t> idx(t.dim(), 0);
  for (int64_t k = 0; k < t.numel(); ++k) {
    int64_t off = 0;
    for (int64_t d = 0; d < t.dim(); ++d) off += idx[d] * t.stride(d);
    out.push_back(off);
    for (int64_t d = t.dim() - 1; d >= 0; --d) {
      if (++idx[d] < t.size(d)) break;
      idx[d] = 0;
    }
  }
  return out;
}

// The bytes of t's elements, each counted once per element that covers it
// (an expanded view covers its bytes more than once).
std::vector<uintptr_t> ElementBytes(const Tensor& t) {
  std::vector<uintptr_t> bytes;
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const size_t size = t.element_size();
  for (int64_t off : Offsets(t)) {
    for (size_t b = 0; b < size; ++b) bytes.push_back(base + static_cast<uintptr_t>(off) * size + b);
  }
  std::sort(bytes.begin(), bytes.end());
  return bytes;
}

// Why input k cannot be perturbed one element at a time, or "": the finite
// difference writes the element in place, so an element another element (of
// k or of another input) aliases would move both.
std::string AliasingProblem(const std::vector<Tensor>& inputs, size_t k) {
  const Tensor& in = inputs[k];
  const std::vector<uintptr_t> own = ElementBytes(in);
  if (std::adjacent_find(own.begin(), own.end()) != own.end()) {
    return "input " + std::to_string(k) + " (shape " + ShapeToString(in.shape()) + ", strides " +
           ShapeToString(in.strides()) + ") has elements that share memory (an expanded view?)";
  }
  for (size_t j = 0; j < inputs.size(); ++j) {
    const Tensor& other = inputs[j];
    if (j == k || !other.defined() || other.storage() != in.storage()) continue;
    const std::vector<uintptr_t> theirs = ElementBytes(other);
    std::vector<uintptr_t> common;
    std::set_intersection(own.begin(), own.end(), theirs.begin(), theirs.end(), std::back_inserter(common));
    if (!common.empty()) {
      return "input " + std::to_string(k) + " shares memory with input " + std::to_string(j);
    }
  }
  return "";
}

double Project(const Tensor& out, const Tensor& r) {
  const std::vector<double> o = out.ToVector<double>(), rv = r.ToVector<double>();
  double s = 0;
  for (size_t i = 0; i < o.size(); ++i) s += o[i] * rv[i];
  return s;
}

}  // namespace

Tensor RandomLeaf(const Shape& shape, uint64_t seed, bool requires_grad) {
  Generator gen(seed);
  Tensor t = Empty(shape, {.dtype = DType::kFloat64});
  UniformFill(t, -1.0, 1.0, gen);
  if (requires_grad) t.set_requires_grad(true);
  return t;
}

::testing::AssertionResult GradCheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                                     const std::vector<Tensor>& inputs, GradCheckOptions options) {
  for (const Tensor& in : inputs) {
    if (in.defined() && in.requires_grad()) {
      if (in.dtype() != DType::kFloat64) return ::testing::AssertionFailure() << "GradCheck needs f64 inputs";
      in.set_grad(Tensor());
    }
  }
  // Checked before fn runs: perturbing such an input in place makes the
  // finite difference meaningless (it moves several elements at once).
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!inputs[k].defined() || !inputs[k].requires_grad()) continue;
    const std::string problem = AliasingProblem(inputs, k);
    if (!problem.empty()) {
      return ::testing::AssertionFailure() << "GradCheck: " << problem
                                           << "; pass a contiguous clone instead";
    }
  }
  Tensor out = fn(inputs);
  if (!out.requires_grad()) return ::testing::AssertionFailure() << "output does not require grad";
  Generator gen(1234);
  Tensor r = Empty(out.shape(), {.dtype = DType::kFloat64});
  UniformFill(r, -1.0, 1.0, gen);
  nn::Backward(out, r.To(out.dtype()));

  for (size_t k = 0; k < inputs.size(); ++k) {
    const Tensor& in = inputs[k];
    if (!in.defined() || !in.requires_grad()) continue;
    if (!in.grad().defined()) return ::testing::AssertionFailure() << "input " << k << " got no gradient";
    if (in.grad().shape() != in.shape()) {
      return ::testing::AssertionFailure() << "input " << k << " gradient shape " << ShapeToString(in.grad().shape());
    }
    const std::vector<double> analytic = in.grad().ToVector<double>();
    const std::vector<int64_t> offsets = Offsets(in);
    double* base = static_cast<double*>(in.data_ptr());
    for (size_t i = 0; i < offsets.size(); ++i) {
      double& x = base[offsets[i]];
      const double saved = x;
      double plus, minus;
      {
        NoGradGuard guard;
        x = saved + options.eps;
        plus = Project(fn(inputs), r);
        x = saved - options.eps;
        minus = Project(fn(inputs), r);
        x = saved;
      }
      const double numeric = (plus - minus) / (2 * options.eps);
      if (std::fabs(analytic[i] - numeric) > options.atol + options.rtol * std::fabs(numeric)) {
        return ::testing::AssertionFailure() << "input " << k << " (shape " << ShapeToString(in.shape())
                                             << ") element " << i << ": analytic " << analytic[i] << ", numeric "
                                             << numeric;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace ddp::nn::testing
