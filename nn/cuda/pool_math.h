// Window arithmetic of the pooling kernels, shared by host and device code
// so that the host tests can check it against the forward definition of
// each window. Shapes: input plane [H, W], output plane [OH, OW].
#pragma once

#include <cstdint>

#include "nn/cuda/launch.h"

namespace ddp::nn::cuda::launch {

/// An average-pooling window along one axis: [start, end) clipped to the
/// input, and its length counting padding (as the CPU kernels define it).
struct AvgWindow {
  int64_t start, end, padded;
};

/// The end is clipped without forming s + kernel, which can pass int64 for
/// windows the shape checks accept (see AvgWindow in nn/ops/cpu/pool.cc).
DDP_HOST_DEVICE AvgWindow AvgWindowOf(int64_t o, int64_t stride, int64_t pad, int64_t kernel, int64_t size) {
  int64_t s = o * stride - pad;
  int64_t e = kernel < size + pad - s ? s + kernel : size + pad;
  const int64_t padded = e - s;
  s = s > 0 ? s : 0;
  e = e < size ? e : size;
  return {s, e, padded};
}

/// The divisor of one average-pooling window in the accumulation type A,
/// formed as nn/ops/cpu/pool.cc's AvgDivisor forms it, so both backends
/// divide by the same value. With count_include_pad each padded length is up
/// to in + 2 * pad: their int64 product wrapped (kernel 2^62 with padding
/// 2^61 gave 2^124, which became 0, and every output 0). In A the product
/// rounds once; while both lengths are exact in A it is the same value the
/// cast of the int64 product was.
template <typename A>
DDP_HOST_DEVICE A AvgDivisorOf(const PoolGeometry& g, const AvgWindow& wh, const AvgWindow& ww) {
  if (g.count_include_pad) return static_cast<A>(wh.padded) * static_cast<A>(ww.padded);
  // At most H * W cells of the input plane: no overflow.
  return static_cast<A>((wh.end - wh.start) * (ww.end - ww.start));
}

/// The taps k in [first, end) of a window that starts at `start` (negative
/// inside the padding) whose cells start + k * dilation lie in [0, size).
struct TapRange {
  int64_t first, end;
};

/// Found by division, not by visiting every tap: the shape checks admit
/// windows of 2^62 taps (kernel 2^62, padding 2^61 on a 4-row input), and a
/// loop over every tap did not finish. Same arithmetic as TapsInside in
/// nn/ops/cpu/pool.cc. No step overflows: start >= -pad, and
/// size - 1 - start <= size + pad, both within the checked in + 2 * pad.
DDP_HOST_DEVICE TapRange TapsInside(int64_t start, int64_t dilation, int64_t kernel, int64_t size) {
  if (start >= size) return {0, 0};
  // Smallest k with start + k * dilation >= 0.
  const int64_t first = start >= 0 ? 0 : (-start) / dilation + ((-start) % dilation != 0 ? 1 : 0);
  // One past the largest k with start + k * dilation <= size - 1.
  const int64_t last = (size - 1 - start) / dilation + 1;
  const int64_t end = kernel < last ? kernel : last;
  return {first, end > first ? end : first};
}

/// Calls f(k, o), in increasing tap order k, for every tap k in [0, kernel)
/// and output o in [0, out) of one axis whose window places tap k on input
/// position `in`: in + pad - k * dilation == o * stride.
///
/// The taps that can qualify form the range [k_lo, k_hi] (the output index
/// must be in [0, out)); it is computed by division, since a window may have
/// 2^62 taps. Inside it, the loop runs over whichever is shorter, the taps
/// (keeping those whose offset divides by the stride) or the outputs
/// (descending, keeping those whose offset divides by the dilation), so the
/// work is at most min(kernel, out) + 1 even for strides far above the
/// dilation. Both visit the same (k, o) pairs in the same order.
template <typename F>
DDP_HOST_DEVICE void ForEachTapCovering(int64_t in, int64_t pad, int64_t dilation, int64_t stride, int64_t kernel,
                                        int64_t out, F f) {
  if (out <= 0) return;
  const int64_t c = in + pad;  // the input position counted from the padded start, >= 0
  // o >= 0: k * dilation <= c.
  const int64_t c_over_d = c / dilation;
  const int64_t k_hi = kernel - 1 < c_over_d ? kernel - 1 : c_over_d;
  // o <= out - 1: k * dilation >= c - (out - 1) * stride, which is positive
  // only when c / stride >= out (and then (out - 1) * stride < c: no overflow).
  int64_t k_lo = 0;
  if (c / stride >= out) {
    const int64_t rest = c - (out - 1) * stride;
    k_lo = rest / dilation + (rest % dilation != 0 ? 1 : 0);
  }
  if (k_lo > k_hi) return;
  // Outputs of the ends of the tap range (k_lo * dilation <= k_hi * dilation <= c).
  const int64_t o_hi = (c - k_lo * dilation) / stride;
  const int64_t top = c - k_hi * dilation;
  const int64_t o_lo = top / stride + (top % stride != 0 ? 1 : 0);
  if (o_lo > o_hi) return;  // no multiple of the stride in reach
  if (k_hi - k_lo <= o_hi - o_lo) {
    for (int64_t k = k_lo; k <= k_hi; ++k) {
      const int64_t num = c - k * dilation;
      if (num % stride == 0) f(k, num / stride);
    }
  } else {
    for (int64_t o = o_hi; o >= o_lo; --o) {
      const int64_t num = c - o * stride;
      if (num % dilation == 0) f(num / dilation, o);
    }
  }
}

/// Adaptive windows: [floor(o * in / out), ceil((o + 1) * in / out)).
DDP_HOST_DEVICE int64_t AdaptiveStartOf(int64_t o, int64_t out, int64_t in) { return (o * in) / out; }
DDP_HOST_DEVICE int64_t AdaptiveEndOf(int64_t o, int64_t out, int64_t in) { return ((o + 1) * in + out - 1) / out; }

/// Calls f(i * OW + j) for every max-pooling output whose window (with
/// stride, padding and dilation) covers input element (ih, iw), in
/// increasing (kh, kw) tap order.
template <typename F>
DDP_HOST_DEVICE void ForEachMaxWindowCovering(const PoolGeometry& g, int64_t ih, int64_t iw, F f) {
  ForEachTapCovering(ih, g.ph, g.dh, g.sh, g.kh, g.oh, [&](int64_t, int64_t i) {
    ForEachTapCovering(iw, g.pw, g.dw, g.sw, g.kw, g.ow, [&](int64_t, int64_t j) { f(i * g.ow + j); });
  });
}

/// Calls f(i * OW + j, divisor) for every average-pooling output whose
/// window covers (ih, iw) and has a positive divisor (in the accumulation
/// type A), in increasing (kh, kw) tap order.
template <typename A, typename F>
DDP_HOST_DEVICE void ForEachAvgWindowCovering(const PoolGeometry& g, int64_t ih, int64_t iw, F f) {
  ForEachTapCovering(ih, g.ph, 1, g.sh, g.kh, g.oh, [&](int64_t, int64_t i) {
    const AvgWindow wh = AvgWindowOf(i, g.sh, g.ph, g.kh, g.h);
    ForEachTapCovering(iw, g.pw, 1, g.sw, g.kw, g.ow, [&](int64_t, int64_t j) {
      const AvgWindow ww = AvgWindowOf(j, g.sw, g.pw, g.kw, g.w);
      const A div = AvgDivisorOf<A>(g, wh, ww);
      if (div > A(0)) f(i * g.ow + j, div);
    });
  });
}

/// Calls f(i * OW + j, window size) for every adaptive window covering (ih, iw).
template <typename F>
DDP_HOST_DEVICE void ForEachAdaptiveWindowCovering(const PoolGeometry& g, int64_t ih, int64_t iw, F f) {
  // Candidates around the proportional position; containment is checked exactly.
  const int64_t i_lo = (ih * g.oh) / g.h, i_hi = ((ih + 1) * g.oh + g.h - 1) / g.h;
  const int64_t j_lo = (iw * g.ow) / g.w, j_hi = ((iw + 1) * g.ow + g.w - 1) / g.w;
  for (int64_t i = i_lo > 0 ? i_lo - 1 : 0; i < i_hi + 1 && i < g.oh; ++i) {
    const int64_t hs = AdaptiveStartOf(i, g.oh, g.h), he = AdaptiveEndOf(i, g.oh, g.h);
    if (ih < hs || ih >= he) continue;
    for (int64_t j = j_lo > 0 ? j_lo - 1 : 0; j < j_hi + 1 && j < g.ow; ++j) {
      const int64_t ws = AdaptiveStartOf(j, g.ow, g.w), we = AdaptiveEndOf(j, g.ow, g.w);
      if (iw < ws || iw >= we) continue;
      f(i * g.ow + j, (he - hs) * (we - ws));
    }
  }
}

}  // namespace ddp::nn::cuda::launch
