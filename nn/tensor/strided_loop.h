// Iteration over the elements of several tensors of one shape with their own
// strides (broadcast inputs have stride 0). Dimensions that are contiguous
// with their neighbour in every operand are merged first, so that the common
// case (everything contiguous) becomes one flat loop the compiler vectorizes.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "nn/tensor/tensor.h"

namespace ddp::nn {

/// Shape and K stride vectors, merged where possible; innermost dimension last.
template <size_t K>
class StridedLoop {
 public:
  StridedLoop(const Shape& shape, const std::array<Shape, K>& strides) {
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] == 1) continue;  // size-1 dimensions contribute nothing
      if (!sizes_.empty()) {
        bool mergeable = true;
        for (size_t k = 0; k < K; ++k) {
          if (strides_[k].back() != strides[k][d] * shape[d]) mergeable = false;
        }
        if (mergeable) {
          sizes_.back() *= shape[d];
          for (size_t k = 0; k < K; ++k) strides_[k].back() = strides[k][d];
          continue;
        }
      }
      sizes_.push_back(shape[d]);
      for (size_t k = 0; k < K; ++k) strides_[k].push_back(strides[k][d]);
    }
    numel_ = 1;
    for (int64_t s : shape) numel_ *= s;
    if (sizes_.empty()) {  // 0-d or all ones: one element
      sizes_.push_back(1);
      for (size_t k = 0; k < K; ++k) strides_[k].push_back(0);
    }
  }

  /// Calls fn(offsets, n, inner_strides) once per innermost row: offsets[k]
  /// is the element offset of the row's first element in operand k.
  template <typename Fn>
  void ForEachRow(Fn&& fn) const {
    if (numel_ == 0) return;
    const int nd = static_cast<int>(sizes_.size());
    const int64_t n = sizes_[nd - 1];
    std::array<int64_t, K> inner;
    for (size_t k = 0; k < K; ++k) inner[k] = strides_[k][nd - 1];
    std::vector<int64_t> counter(nd, 0);
    std::array<int64_t, K> offsets{};
    const int64_t rows = numel_ / n;
    for (int64_t r = 0; r < rows; ++r) {
      fn(offsets, n, inner);
      // Advance the outer counter (odometer style).
      for (int d = nd - 2; d >= 0; --d) {
        ++counter[d];
        for (size_t k = 0; k < K; ++k) offsets[k] += strides_[k][d];
        if (counter[d] < sizes_[d]) break;
        for (size_t k = 0; k < K; ++k) offsets[k] -= strides_[k][d] * sizes_[d];
        counter[d] = 0;
      }
    }
  }

  int64_t numel() const { return numel_; }
  /// Merged dimension count.
  size_t ndim() const { return sizes_.size(); }

 private:
  std::vector<int64_t> sizes_;
  std::array<std::vector<int64_t>, K> strides_;
  int64_t numel_ = 0;
};

}  // namespace ddp::nn
