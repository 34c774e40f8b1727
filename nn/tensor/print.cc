// PyTorch-style printing: one format for all elements (integers as "1.",
// fixed with four decimals, or scientific when magnitudes differ by more
// than 1000x), right-aligned to a common width, long tensors summarized with
// "..." after the first and before the last three entries of each dimension.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "nn/tensor/tensor.h"

namespace ddp::nn {

namespace {

constexpr int64_t kSummarizeThreshold = 1000;
constexpr int64_t kEdgeItems = 3;
constexpr int kLineWidth = 80;

std::string (*g_grad_fn_namer)(const autograd::Node&) = nullptr;

struct Formatter {
  bool int_mode = false;
  bool sci_mode = false;

  std::string Format(double v) const {
    char buf[64];
    if (std::isnan(v)) {
      std::snprintf(buf, sizeof(buf), "nan");
    } else if (std::isinf(v)) {
      std::snprintf(buf, sizeof(buf), v > 0 ? "inf" : "-inf");
    } else if (sci_mode) {
      std::snprintf(buf, sizeof(buf), "%.4e", v);
    } else if (int_mode) {
      std::snprintf(buf, sizeof(buf), "%.0f.", v);
    } else {
      std::snprintf(buf, sizeof(buf), "%.4f", v);
    }
    return buf;
  }
};

// Indices printed along a dimension of size n (all, or the edges around a gap marked -1).
std::vector<int64_t> ShownIndices(int64_t n, bool summarize) {
  std::vector<int64_t> idx;
  if (summarize && n > 2 * kEdgeItems) {
    for (int64_t i = 0; i < kEdgeItems; ++i) idx.push_back(i);
    idx.push_back(-1);
    for (int64_t i = n - kEdgeItems; i < n; ++i) idx.push_back(i);
  } else {
    for (int64_t i = 0; i < n; ++i) idx.push_back(i);
  }
  return idx;
}

// Appends the shown elements of data (element strides), in printing order,
// as V: only these are read, so a summarized tensor costs a few dozen reads.
template <typename T, typename V>
void CollectShown(const T* data, const Shape& shape, const Shape& strides, size_t d, int64_t offset,
                  bool summarize, std::vector<V>* out) {
  if (d == shape.size()) {
    out->push_back(static_cast<V>(static_cast<acc_t<T>>(data[offset])));
    return;
  }
  for (int64_t i : ShownIndices(shape[d], summarize)) {
    if (i >= 0) CollectShown(data, shape, strides, d + 1, offset + i * strides[d], summarize, out);
  }
}

// Writes the elements text[*next], text[*next + 1], ... (each padded to
// width) in the nested brackets of shape.
void Render(const std::vector<std::string>& text, size_t* next, const Shape& shape, size_t d, size_t indent,
            bool summarize, size_t width, std::string* out) {
  if (d == shape.size()) {
    const std::string& s = text[(*next)++];
    if (s.size() < width) out->append(width - s.size(), ' ');
    *out += s;
    return;
  }
  *out += "[";
  const std::vector<int64_t> idx = ShownIndices(shape[d], summarize);
  const bool last_dim = d + 1 == shape.size();
  // Elements of the last dimension wrap at the line width, like PyTorch.
  const size_t per_line = std::max<size_t>(1, (kLineWidth - indent) / (width + 2));
  size_t on_line = 0;
  for (size_t k = 0; k < idx.size(); ++k) {
    if (k > 0) {
      if (last_dim) {
        *out += ",";
        if (++on_line >= per_line) {
          *out += "\n" + std::string(indent + 1, ' ');
          on_line = 0;
        } else {
          *out += " ";
        }
      } else {
        *out += ",";
        *out += std::string(shape.size() - d - 1, '\n');
        *out += std::string(indent + 1, ' ');
      }
    }
    if (idx[k] < 0) {
      *out += last_dim ? " ..." : "...";
      continue;
    }
    Render(text, next, shape, d + 1, indent + 1, summarize, width, out);
  }
  *out += "]";
}

}  // namespace

std::string Tensor::ToString() const {
  if (!defined()) return "tensor(undefined)";
  Tensor cpu = Detach();
  if (!cpu.device().is_cpu()) cpu = cpu.To(kCPU);
  const Shape& sh = shape();
  const bool summarize = numel() > kSummarizeThreshold;

  // Integers are read as int64 (through double, values past 2^53 would
  // round and INT64_MAX would wrap to INT64_MIN).
  std::vector<std::string> text;
  if (!IsFloating(dtype())) {
    std::vector<int64_t> shown;
    DDP_DISPATCH_ALL(dtype(), "ToString", {
      CollectShown(static_cast<const scalar_t*>(cpu.data_ptr()), sh, cpu.strides(), 0, 0, summarize, &shown);
    });
    for (int64_t v : shown) text.push_back(std::to_string(v));
  } else {
    std::vector<double> shown;
    DDP_DISPATCH_ALL(dtype(), "ToString", {
      CollectShown(static_cast<const scalar_t*>(cpu.data_ptr()), sh, cpu.strides(), 0, 0, summarize, &shown);
    });
    Formatter f;
    double max_abs = 0, min_abs = INFINITY;
    bool all_int = true;
    for (double v : shown) {
      if (!std::isfinite(v)) continue;
      if (v != std::ceil(v)) all_int = false;
      const double a = std::fabs(v);
      if (a == 0) continue;
      max_abs = std::max(max_abs, a);
      min_abs = std::min(min_abs, a);
    }
    f.int_mode = all_int;
    if (max_abs > 0) {
      const double ratio = max_abs / min_abs;
      f.sci_mode = all_int ? (ratio > 1000 || max_abs > 1e8)
                           : (ratio > 1000 || max_abs > 1e8 || min_abs < 1e-4);
    }
    for (double v : shown) text.push_back(f.Format(v));
  }
  size_t width = 1;
  for (const std::string& s : text) width = std::max(width, s.size());

  std::string out = "tensor(";
  if (numel() == 0) {
    out += "[]";
  } else if (sh.empty()) {
    out += text[0];
  } else {
    size_t next = 0;
    Render(text, &next, sh, 0, 7, summarize, width, &out);
  }
  if (numel() == 0 && sh.size() != 1) {
    std::string size = ShapeToString(sh);
    size.front() = '(';
    size.back() = ')';
    out += ", size=" + size;
  }
  if (!device().is_cpu()) out += ", device='" + device().ToString() + "'";
  if (dtype() != DType::kFloat32 && dtype() != DType::kInt64) {
    out += ", dtype=" + std::string(DTypeName(dtype()));
  }
  if (requires_grad()) {
    if (is_leaf()) {
      out += ", requires_grad=True";
    } else {
      out += ", grad_fn=<" + (g_grad_fn_namer != nullptr ? g_grad_fn_namer(*grad_fn()) : std::string("recorded")) + ">";
    }
  }
  return out + ")";
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.ToString(); }

namespace detail {
void SetGradFnNamer(std::string (*namer)(const autograd::Node&)) { g_grad_fn_namer = namer; }
std::string GradFnName(const autograd::Node& node) {
  return g_grad_fn_namer != nullptr ? g_grad_fn_namer(node) : std::string("a recorded operation");
}
}  // namespace detail

}  // namespace ddp::nn
