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

DDP_HOST_DEVICE AvgWindow AvgWindowOf(int64_t o, int64_t stride, int64_t pad, int64_t kernel, int64_t size) {
  int64_t s = o * stride - pad;
  int64_t e = s + kernel < size + pad ? s + kernel : size + pad;
  const int64_t padded = e - s;
  s = s > 0 ? s : 0;
  e = e < size ? e : size;
  return {s, e, padded};
}

DDP_HOST_DEVICE int64_t AvgDivisorOf(const PoolGeometry& g, const AvgWindow& wh, const AvgWindow& ww) {
  return g.count_include_pad ? wh.padded * ww.padded : (wh.end - wh.start) * (ww.end - ww.start);
}

/// Adaptive windows: [floor(o * in / out), ceil((o + 1) * in / out)).
DDP_HOST_DEVICE int64_t AdaptiveStartOf(int64_t o, int64_t out, int64_t in) { return (o * in) / out; }
DDP_HOST_DEVICE int64_t AdaptiveEndOf(int64_t o, int64_t out, int64_t in) { return ((o + 1) * in + out - 1) / out; }

/// Calls f(i * OW + j) for every max-pooling output whose window (with
/// stride, padding and dilation) covers input element (ih, iw).
template <typename F>
DDP_HOST_DEVICE void ForEachMaxWindowCovering(const PoolGeometry& g, int64_t ih, int64_t iw, F f) {
  for (int64_t kh = 0; kh < g.kh; ++kh) {
    const int64_t num_h = ih + g.ph - kh * g.dh;
    if (num_h < 0 || num_h % g.sh != 0) continue;
    const int64_t i = num_h / g.sh;
    if (i >= g.oh) continue;
    for (int64_t kw = 0; kw < g.kw; ++kw) {
      const int64_t num_w = iw + g.pw - kw * g.dw;
      if (num_w < 0 || num_w % g.sw != 0) continue;
      const int64_t j = num_w / g.sw;
      if (j >= g.ow) continue;
      f(i * g.ow + j);
    }
  }
}

/// Calls f(i * OW + j, divisor) for every average-pooling output whose
/// window covers (ih, iw) and has a positive divisor.
template <typename F>
DDP_HOST_DEVICE void ForEachAvgWindowCovering(const PoolGeometry& g, int64_t ih, int64_t iw, F f) {
  for (int64_t kh = 0; kh < g.kh; ++kh) {
    const int64_t num_h = ih + g.ph - kh;
    if (num_h < 0 || num_h % g.sh != 0) continue;
    const int64_t i = num_h / g.sh;
    if (i >= g.oh) continue;
    const AvgWindow wh = AvgWindowOf(i, g.sh, g.ph, g.kh, g.h);
    for (int64_t kw = 0; kw < g.kw; ++kw) {
      const int64_t num_w = iw + g.pw - kw;
      if (num_w < 0 || num_w % g.sw != 0) continue;
      const int64_t j = num_w / g.sw;
      if (j >= g.ow) continue;
      const AvgWindow ww = AvgWindowOf(j, g.sw, g.pw, g.kw, g.w);
      const int64_t div = AvgDivisorOf(g, wh, ww);
      if (div > 0) f(i * g.ow + j, div);
    }
  }
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
