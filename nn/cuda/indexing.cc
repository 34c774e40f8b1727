#include "nn/cuda/indexing.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::nn::cuda {

Shape BroadcastStridesTo(const Tensor& t, const Shape& shape) {
  const Shape& sh = t.shape();
  const Shape& st = t.strides();
  if (sh.size() > shape.size()) {
    throw std::invalid_argument("cannot broadcast shape " + ShapeToString(sh) + " to " + ShapeToString(shape));
  }
  Shape out(shape.size(), 0);
  const size_t lead = shape.size() - sh.size();
  for (size_t i = 0; i < sh.size(); ++i) {
    if (sh[i] != shape[lead + i] && sh[i] != 1) {
      throw std::invalid_argument("cannot broadcast shape " + ShapeToString(sh) + " to " + ShapeToString(shape));
    }
    out[lead + i] = (sh[i] == 1 && shape[lead + i] != 1) ? 0 : st[i];
  }
  return out;
}

launch::Indexing MakeIndexing(const char* op, const Shape& shape, std::initializer_list<Shape> strides) {
  const int nops = static_cast<int>(strides.size());
  // Keep the dimensions of size > 1, outermost first.
  std::vector<int64_t> sizes;
  std::vector<std::vector<int64_t>> st(nops);
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    sizes.push_back(shape[d]);
    int k = 0;
    for (const Shape& s : strides) st[k++].push_back(s[d]);
  }
  // Merge dimension d into d + 1 when every operand steps over d exactly as
  // over a whole run of d + 1.
  std::vector<int64_t> msizes;
  std::vector<std::vector<int64_t>> mst(nops);
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (!msizes.empty()) {
      bool mergeable = true;
      for (int k = 0; k < nops; ++k) mergeable = mergeable && mst[k].back() == st[k][d] * sizes[d];
      if (mergeable) {
        msizes.back() *= sizes[d];
        for (int k = 0; k < nops; ++k) mst[k].back() = st[k][d];
        continue;
      }
    }
    msizes.push_back(sizes[d]);
    for (int k = 0; k < nops; ++k) mst[k].push_back(st[k][d]);
  }
  if (msizes.size() > static_cast<size_t>(launch::kMaxDims)) {
    throw std::invalid_argument(std::string(op) + " on CUDA: shape " + ShapeToString(shape) + " has " +
                                std::to_string(msizes.size()) + " non-mergeable dimensions, more than the " +
                                std::to_string(launch::kMaxDims) + " the kernels index (make the operands contiguous)");
  }
  launch::Indexing ix;
  ix.ndim = static_cast<int>(msizes.size());
  bool contiguous = ix.ndim <= 1;
  for (int d = 0; d < ix.ndim; ++d) {
    ix.sizes[d] = msizes[d];
    for (int k = 0; k < nops; ++k) {
      ix.strides[k][d] = mst[k][d];
      contiguous = contiguous && mst[k][d] == 1;
    }
  }
  ix.contiguous = contiguous;
  return ix;
}

launch::ReduceIndexing MakeSumToIndexing(const Tensor& x, const Tensor& out) {
  if (out.dim() != x.dim()) {
    throw std::invalid_argument("sum_to: out rank " + std::to_string(out.dim()) + " differs from input rank " +
                                std::to_string(x.dim()));
  }
  Shape kept_shape, kept_out, kept_x, red_shape, red_zero, red_x;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (out.size(d) == x.size(d)) {
      kept_shape.push_back(x.size(d));
      kept_out.push_back(out.stride(d));
      kept_x.push_back(x.stride(d));
    } else if (out.size(d) == 1) {
      red_shape.push_back(x.size(d));
      red_zero.push_back(0);
      red_x.push_back(x.stride(d));
    } else {
      throw std::invalid_argument("sum_to: cannot sum shape " + ShapeToString(x.shape()) + " to " +
                                  ShapeToString(out.shape()));
    }
  }
  launch::ReduceIndexing rx;
  rx.kept = MakeIndexing("sum_to", kept_shape, {kept_out, kept_x});
  rx.reduced = MakeIndexing("sum_to", red_shape, {red_zero, red_x});
  rx.num_kept = NumElements(kept_shape);
  rx.num_reduced = NumElements(red_shape);
  return rx;
}

}  // namespace ddp::nn::cuda
