// Pooling over NCHW planes. Shapes: x [N, C, H, W], y [N, C, OH, OW]; each
// (n, c) plane is independent, so kernels loop over N*C planes.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "nn/ops/cpu/cpu_kernels.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ddp::nn::ops::cpu {

namespace {

// 2x2 windows, stride 2, every window inside the plane (no padding, no
// ceil_mode: its last windows may hang over an odd-sized edge).
bool IsFast22(const Pool2dParams& p) {
  return p.kernel_h == 2 && p.kernel_w == 2 && p.stride_h == 2 && p.stride_w == 2 && p.pad_h == 0 &&
         p.pad_w == 0 && p.dilation_h == 1 && p.dilation_w == 1 && !p.ceil_mode;
}

// One output row of 2x2/2 max pooling over input rows r0 and r1 (f32):
// y[j] = max of the window, ind[j] = its position in the plane (base is the
// plane offset of r0). The last NaN wins, as in PyTorch. Branch-free: on activations
// a data-dependent branch mispredicts half the time, which made the scalar
// loop 13x slower than this (9 ms vs 0.7 ms for [64, 32, 26, 26]).
void MaxPoolRow22(const float* r0, const float* r1, float* y, int32_t* ind, int64_t ow, int32_t base, int32_t w) {
  int64_t j = 0;
#if defined(__SSE2__)
  auto select = [](__m128 m, __m128 a, __m128 b) { return _mm_or_ps(_mm_and_ps(m, a), _mm_andnot_ps(m, b)); };
  const __m128i one = _mm_set1_epi32(1), wv = _mm_set1_epi32(w), lanes = _mm_set_epi32(6, 4, 2, 0);
  for (; j + 4 <= ow; j += 4) {
    const __m128 a_lo = _mm_loadu_ps(r0 + 2 * j), a_hi = _mm_loadu_ps(r0 + 2 * j + 4);
    const __m128 b_lo = _mm_loadu_ps(r1 + 2 * j), b_hi = _mm_loadu_ps(r1 + 2 * j + 4);
    const __m128 a0 = _mm_shuffle_ps(a_lo, a_hi, _MM_SHUFFLE(2, 0, 2, 0));
    const __m128 a1 = _mm_shuffle_ps(a_lo, a_hi, _MM_SHUFFLE(3, 1, 3, 1));
    const __m128 b0 = _mm_shuffle_ps(b_lo, b_hi, _MM_SHUFFLE(2, 0, 2, 0));
    const __m128 b1 = _mm_shuffle_ps(b_lo, b_hi, _MM_SHUFFLE(3, 1, 3, 1));
    const __m128 ta = _mm_or_ps(_mm_cmpgt_ps(a1, a0), _mm_cmpunord_ps(a1, a1));
    const __m128 ma = select(ta, a1, a0);
    const __m128 tb = _mm_or_ps(_mm_cmpgt_ps(b1, b0), _mm_cmpunord_ps(b1, b1));
    const __m128 mb = select(tb, b1, b0);
    const __m128 t = _mm_or_ps(_mm_cmpgt_ps(mb, ma), _mm_cmpunord_ps(mb, mb));
    _mm_storeu_ps(y + j, select(t, mb, ma));
    const __m128i col = _mm_add_epi32(_mm_set1_epi32(base + static_cast<int32_t>(2 * j)), lanes);
    const __m128i ia = _mm_add_epi32(col, _mm_and_si128(_mm_castps_si128(ta), one));
    const __m128i ib = _mm_add_epi32(_mm_add_epi32(col, wv), _mm_and_si128(_mm_castps_si128(tb), one));
    const __m128i tm = _mm_castps_si128(t);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ind + j), _mm_or_si128(_mm_and_si128(tm, ib), _mm_andnot_si128(tm, ia)));
  }
#endif
  for (; j < ow; ++j) {
    const float a0 = r0[2 * j], a1 = r0[2 * j + 1], b0 = r1[2 * j], b1 = r1[2 * j + 1];
    const bool ta = a1 > a0 || a1 != a1;
    const float ma = ta ? a1 : a0;
    const bool tb = b1 > b0 || b1 != b1;
    const float mb = tb ? b1 : b0;
    const bool t = mb > ma || mb != mb;
    y[j] = t ? mb : ma;
    ind[j] = base + static_cast<int32_t>(2 * j) + (t ? w + tb : ta);
  }
}

// The gradient of one 2x2/2 output row: each window's four input cells get
// dy where the max was and 0 elsewhere (windows do not overlap, so every
// covered cell is written exactly once and no zero fill is needed).
void MaxPoolBackwardRow22(const float* dy, const int32_t* ind, float* d0, float* d1, int64_t ow, int32_t base,
                          int32_t w) {
  int64_t j = 0;
#if defined(__SSE2__)
  const __m128i lanes = _mm_set_epi32(6, 4, 2, 0), one = _mm_set1_epi32(1), wv = _mm_set1_epi32(w);
  for (; j + 4 <= ow; j += 4) {
    const __m128 g = _mm_loadu_ps(dy + j);
    const __m128i idx = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ind + j));
    const __m128i p00 = _mm_add_epi32(_mm_set1_epi32(base + static_cast<int32_t>(2 * j)), lanes);
    const __m128i p01 = _mm_add_epi32(p00, one), p10 = _mm_add_epi32(p00, wv), p11 = _mm_add_epi32(p10, one);
    const __m128 v00 = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(idx, p00)), g);
    const __m128 v01 = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(idx, p01)), g);
    const __m128 v10 = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(idx, p10)), g);
    const __m128 v11 = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(idx, p11)), g);
    _mm_storeu_ps(d0 + 2 * j, _mm_unpacklo_ps(v00, v01));
    _mm_storeu_ps(d0 + 2 * j + 4, _mm_unpackhi_ps(v00, v01));
    _mm_storeu_ps(d1 + 2 * j, _mm_unpacklo_ps(v10, v11));
    _mm_storeu_ps(d1 + 2 * j + 4, _mm_unpackhi_ps(v10, v11));
  }
#endif
  for (; j < ow; ++j) {
    const int32_t p = base + static_cast<int32_t>(2 * j);
    const float g = dy[j];
    d0[2 * j] = ind[j] == p ? g : 0.0f;
    d0[2 * j + 1] = ind[j] == p + 1 ? g : 0.0f;
    d1[2 * j] = ind[j] == p + w ? g : 0.0f;
    d1[2 * j + 1] = ind[j] == p + w + 1 ? g : 0.0f;
  }
}

// The taps k in [first, end) of a window starting at `start` (possibly in
// the padding, so negative) whose cells start + k * dilation fall in
// [0, size). They are found by division rather than by visiting every tap:
// ConvOutputSize admits windows of up to 2^62 taps (kernel 2^62, padding
// 2^61 on a 4-row input), and a loop over every tap did not finish. The taps
// visited, and their order, are those the loop kept, so the result and the
// tie rule are unchanged. No step overflows: start >= -pad, and
// size - 1 - start <= size + pad, both bounded by ConvOutputSize's checked
// in + 2 * pad.
struct TapRange {
  int64_t first, end;
};

TapRange TapsInside(int64_t start, int64_t dilation, int64_t kernel, int64_t size) {
  if (start >= size) return {0, 0};
  // Smallest k with start + k * dilation >= 0.
  const int64_t first = start >= 0 ? 0 : (-start) / dilation + ((-start) % dilation != 0 ? 1 : 0);
  // One past the largest k with start + k * dilation <= size - 1.
  const int64_t end = std::min(kernel, (size - 1 - start) / dilation + 1);
  return {first, std::max(first, end)};
}

Tensor OutBuffer(const Tensor& t) {
  if (t.is_contiguous()) return t;
  return Empty(t.shape(), {.dtype = t.dtype()});
}

void WriteBack(const Tensor& dst, const Tensor& buf) {
  if (buf.is_same(dst)) return;
  NoGradGuard guard;
  dst.CopyFrom(buf);
}

}  // namespace

void MaxPool2dForward(const Tensor& x, const Tensor& y, const Tensor& indices, const Pool2dParams& p) {
  // An empty batch has nothing to pool; the scratch below would still take
  // a plane's worth of memory (or overflow, for a huge broadcast plane).
  if (y.numel() == 0) return;
  const Tensor xc = ContiguousData(x);
  const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = y.size(2), ow = y.size(3);
  Tensor yb = OutBuffer(y);
  // Without indices (no gradient wanted) the kernel still needs somewhere to
  // put them: one plane's worth of scratch, reused.
  Tensor scratch;
  int64_t ind_plane_stride = oh * ow;
  if (!indices.defined()) {
    scratch = Empty({oh * ow}, {.dtype = DType::kInt32});
    ind_plane_stride = 0;
  } else if (indices.dtype() != DType::kInt32 || !indices.is_contiguous()) {
    throw std::invalid_argument("max_pool2d: indices must be contiguous i32");
  }
  int32_t* ind = indices.defined() ? indices.data<int32_t>() : scratch.data<int32_t>();
  if (x.dtype() == DType::kFloat32 && IsFast22(p)) {
    const float* xp = xc.data<float>();
    float* yp = yb.data<float>();
    for (int64_t pl = 0; pl < planes; ++pl) {
      for (int64_t i = 0; i < oh; ++i) {
        const float* r0 = xp + pl * h * w + 2 * i * w;
        MaxPoolRow22(r0, r0 + w, yp + (pl * oh + i) * ow, ind + pl * ind_plane_stride + i * ow, ow,
                     static_cast<int32_t>(2 * i * w), static_cast<int32_t>(w));
      }
    }
    WriteBack(y, yb);
    return;
  }
  DDP_DISPATCH_FLOATING(x.dtype(), "max_pool2d", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    scalar_t* yp = static_cast<scalar_t*>(yb.data_ptr());
    const bool fast22 = IsFast22(p);
    for (int64_t pl = 0; pl < planes; ++pl) {
      const scalar_t* xpl = xp + pl * h * w;
      scalar_t* ypl = yp + pl * oh * ow;
      int32_t* ipl = ind + pl * ind_plane_stride;
      for (int64_t i = 0; i < oh; ++i) {
        if (fast22) {
          // Not f32 (that case returned above): scalar, same selects.
          for (int64_t j = 0; j < ow; ++j) {
            const int64_t c = 2 * i * w + 2 * j;
            const A a0 = static_cast<A>(xpl[c]), a1 = static_cast<A>(xpl[c + 1]);
            const A b0 = static_cast<A>(xpl[c + w]), b1 = static_cast<A>(xpl[c + w + 1]);
            const bool ta = a1 > a0 || a1 != a1;
            const A ma = ta ? a1 : a0;
            const bool tb = b1 > b0 || b1 != b1;
            const A mb = tb ? b1 : b0;
            const bool t = mb > ma || mb != mb;
            ypl[i * ow + j] = static_cast<scalar_t>(t ? mb : ma);
            ipl[i * ow + j] = static_cast<int32_t>(c + (t ? w + tb : ta));
          }
          continue;
        }
        const int64_t h0 = i * p.stride_h - p.pad_h;
        for (int64_t j = 0; j < ow; ++j) {
          const int64_t w0 = j * p.stride_w - p.pad_w;
          A best = -std::numeric_limits<A>::infinity();
          int64_t bi = -1;
          const TapRange th = TapsInside(h0, p.dilation_h, p.kernel_h, h);
          const TapRange tw = TapsInside(w0, p.dilation_w, p.kernel_w, w);
          for (int64_t kh = th.first; kh < th.end; ++kh) {
            const int64_t ih = h0 + kh * p.dilation_h;
            for (int64_t kw = tw.first; kw < tw.end; ++kw) {
              const int64_t iw = w0 + kw * p.dilation_w;
              const A v = static_cast<A>(xpl[ih * w + iw]);
              // The first maximum wins, and the last NaN, as in PyTorch.
              if (bi < 0 || v > best || std::isnan(v)) {
                best = v;
                bi = ih * w + iw;
              }
            }
          }
          // The argument checks leave windows whose taps all miss the input:
          // padding 1 with a dilation that steps over a short input (a 2-tap
          // window with dilation 2 on one row reads rows -1 and 1). As in
          // PyTorch the output is -inf; index -1 tells backward that no
          // input cell gets its gradient.
          ypl[i * ow + j] = static_cast<scalar_t>(best);
          ipl[i * ow + j] = static_cast<int32_t>(bi);
        }
      }
    }
  });
  WriteBack(y, yb);
}

namespace {

// Input gradients of pooling, where overlapping windows add into one cell:
// add(pl, acc) adds plane pl's terms into acc (the plane's h * w cells,
// zeroed, in the accumulation type). A 16-bit gradient is summed in f32 and
// rounded once, as the CUDA kernels do, not after every term.
template <typename scalar_t, typename Add>
void AccumulatePlanes(scalar_t* dx, int64_t planes, int64_t plane_size, Add add) {
  using A = acc_t<scalar_t>;
  if (planes == 0) return;  // the 16-bit path's plane buffer would be for nothing
  if constexpr (std::is_same_v<A, scalar_t>) {
    std::fill(dx, dx + planes * plane_size, scalar_t(0));
    for (int64_t pl = 0; pl < planes; ++pl) add(pl, dx + pl * plane_size);
  } else {
    std::vector<A> acc(static_cast<size_t>(plane_size));
    for (int64_t pl = 0; pl < planes; ++pl) {
      std::fill(acc.begin(), acc.end(), A(0));
      add(pl, acc.data());
      scalar_t* d = dx + pl * plane_size;
      for (int64_t k = 0; k < plane_size; ++k) d[k] = static_cast<scalar_t>(acc[k]);
    }
  }
}

}  // namespace

void MaxPool2dBackward(const Tensor& dy, const Tensor& indices, const Tensor& dx, const Pool2dParams& p) {
  const Tensor dyc = ContiguousData(dy);
  const int64_t planes = dx.size(0) * dx.size(1), h = dx.size(2), w = dx.size(3);
  const int64_t oh = dy.size(2), ow = dy.size(3);
  Tensor dxb = OutBuffer(dx);
  const int32_t* ind = indices.data<int32_t>();
  if (dx.dtype() == DType::kFloat32 && IsFast22(p)) {
    const float* g = dyc.data<float>();
    float* d = dxb.data<float>();
    for (int64_t pl = 0; pl < planes; ++pl) {
      float* dpl = d + pl * h * w;
      for (int64_t i = 0; i < oh; ++i) {
        MaxPoolBackwardRow22(g + (pl * oh + i) * ow, ind + (pl * oh + i) * ow, dpl + 2 * i * w,
                             dpl + (2 * i + 1) * w, ow, static_cast<int32_t>(2 * i * w), static_cast<int32_t>(w));
        // An odd width leaves a last column no window covers.
        for (int64_t r = 2 * i; r < 2 * i + 2 && 2 * ow < w; ++r) std::fill(dpl + r * w + 2 * ow, dpl + (r + 1) * w, 0.0f);
      }
      std::fill(dpl + 2 * oh * w, dpl + h * w, 0.0f);  // rows below the last window
    }
    WriteBack(dx, dxb);
    return;
  }
  DDP_DISPATCH_FLOATING(dx.dtype(), "max_pool2d_backward", {
    using A = acc_t<scalar_t>;
    const scalar_t* g = static_cast<const scalar_t*>(dyc.data_ptr());
    AccumulatePlanes(static_cast<scalar_t*>(dxb.data_ptr()), planes, h * w, [&](int64_t pl, A* dpl) {
      const scalar_t* gpl = g + pl * oh * ow;
      const int32_t* ipl = ind + pl * oh * ow;
      for (int64_t k = 0; k < oh * ow; ++k) {
        if (ipl[k] >= 0) dpl[ipl[k]] += static_cast<A>(gpl[k]);  // -1: a window with no input cell
      }
    });
  });
  WriteBack(dx, dxb);
}

namespace {

// Window [start, end) of output index o along one axis, and its divisor
// contribution, following PyTorch: the divisor counts padding cells inside
// the padded extent when count_include_pad.
struct Window {
  int64_t start, end, padded_len;
};

// s + kernel can exceed int64 for windows the shape checks accept: with
// ceil_mode, input 4, kernel 2^63 - 3, padding 2^62 - 3 and stride 2^62 the
// second window starts at 3 and s + kernel is 2^63. So the end is clipped by
// comparing kernel with the room left, size + pad - s (>= 1: s < size + pad).
Window AvgWindow(int64_t o, int64_t stride, int64_t pad, int64_t kernel, int64_t size) {
  int64_t s = o * stride - pad;
  int64_t e = kernel < size + pad - s ? s + kernel : size + pad;
  const int64_t padded = e - s;
  s = std::max<int64_t>(s, 0);
  e = std::min(e, size);
  return {s, e, padded};
}

// The divisor of one average-pooling window, in the accumulation type A.
// With count_include_pad it is the product of two padded lengths, each up
// to in + 2 * pad: in int64 that product could wrap (kernel 2^62 with
// padding 2^61 gave 2^124, which wrapped to 0 and made every output 0).
// While both lengths are exact in A (below 2^24 in f32), the product in A
// rounds the same exact value once, as the cast of the int64 product did:
// the same bits.
template <typename A>
A AvgDivisor(const Window& wh, const Window& ww, bool count_include_pad) {
  if (count_include_pad) return static_cast<A>(wh.padded_len) * static_cast<A>(ww.padded_len);
  // At most H * W cells of the input plane: no overflow.
  return static_cast<A>((wh.end - wh.start) * (ww.end - ww.start));
}

}  // namespace

void AvgPool2dForward(const Tensor& x, const Tensor& y, const Pool2dParams& p) {
  const Tensor xc = ContiguousData(x);
  const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = y.size(2), ow = y.size(3);
  Tensor yb = OutBuffer(y);
  DDP_DISPATCH_FLOATING(x.dtype(), "avg_pool2d", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    scalar_t* yp = static_cast<scalar_t*>(yb.data_ptr());
    for (int64_t pl = 0; pl < planes; ++pl) {
      const scalar_t* xpl = xp + pl * h * w;
      for (int64_t i = 0; i < oh; ++i) {
        const Window wh = AvgWindow(i, p.stride_h, p.pad_h, p.kernel_h, h);
        for (int64_t j = 0; j < ow; ++j) {
          const Window ww = AvgWindow(j, p.stride_w, p.pad_w, p.kernel_w, w);
          A s = 0;
          for (int64_t ih = wh.start; ih < wh.end; ++ih) {
            for (int64_t iw = ww.start; iw < ww.end; ++iw) s += static_cast<A>(xpl[ih * w + iw]);
          }
          const A div = AvgDivisor<A>(wh, ww, p.count_include_pad);
          yp[(pl * oh + i) * ow + j] = static_cast<scalar_t>(div > A(0) ? s / div : A(0));
        }
      }
    }
  });
  WriteBack(y, yb);
}

void AvgPool2dBackward(const Tensor& dy, const Tensor& dx, const Pool2dParams& p) {
  const Tensor dyc = ContiguousData(dy);
  const int64_t planes = dx.size(0) * dx.size(1), h = dx.size(2), w = dx.size(3);
  const int64_t oh = dy.size(2), ow = dy.size(3);
  Tensor dxb = OutBuffer(dx);
  DDP_DISPATCH_FLOATING(dx.dtype(), "avg_pool2d_backward", {
    using A = acc_t<scalar_t>;
    const scalar_t* g = static_cast<const scalar_t*>(dyc.data_ptr());
    AccumulatePlanes(static_cast<scalar_t*>(dxb.data_ptr()), planes, h * w, [&](int64_t pl, A* dpl) {
      for (int64_t i = 0; i < oh; ++i) {
        const Window wh = AvgWindow(i, p.stride_h, p.pad_h, p.kernel_h, h);
        for (int64_t j = 0; j < ow; ++j) {
          const Window ww = AvgWindow(j, p.stride_w, p.pad_w, p.kernel_w, w);
          const A div = AvgDivisor<A>(wh, ww, p.count_include_pad);
          if (!(div > A(0))) continue;
          const A v = static_cast<A>(g[(pl * oh + i) * ow + j]) / div;
          for (int64_t ih = wh.start; ih < wh.end; ++ih) {
            for (int64_t iw = ww.start; iw < ww.end; ++iw) dpl[ih * w + iw] += v;
          }
        }
      }
    });
  });
  WriteBack(dx, dxb);
}

namespace {
inline int64_t AdaptiveStart(int64_t o, int64_t out, int64_t in) { return (o * in) / out; }
inline int64_t AdaptiveEnd(int64_t o, int64_t out, int64_t in) { return ((o + 1) * in + out - 1) / out; }
}  // namespace

void AdaptiveAvgPool2dForward(const Tensor& x, const Tensor& y) {
  const Tensor xc = ContiguousData(x);
  const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = y.size(2), ow = y.size(3);
  Tensor yb = OutBuffer(y);
  DDP_DISPATCH_FLOATING(x.dtype(), "adaptive_avg_pool2d", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    scalar_t* yp = static_cast<scalar_t*>(yb.data_ptr());
    for (int64_t pl = 0; pl < planes; ++pl) {
      const scalar_t* xpl = xp + pl * h * w;
      for (int64_t i = 0; i < oh; ++i) {
        const int64_t hs = AdaptiveStart(i, oh, h), he = AdaptiveEnd(i, oh, h);
        for (int64_t j = 0; j < ow; ++j) {
          const int64_t ws = AdaptiveStart(j, ow, w), we = AdaptiveEnd(j, ow, w);
          A s = 0;
          for (int64_t ih = hs; ih < he; ++ih) {
            for (int64_t iw = ws; iw < we; ++iw) s += static_cast<A>(xpl[ih * w + iw]);
          }
          yp[(pl * oh + i) * ow + j] = static_cast<scalar_t>(s / static_cast<A>((he - hs) * (we - ws)));
        }
      }
    }
  });
  WriteBack(y, yb);
}

void AdaptiveAvgPool2dBackward(const Tensor& dy, const Tensor& dx) {
  const Tensor dyc = ContiguousData(dy);
  const int64_t planes = dx.size(0) * dx.size(1), h = dx.size(2), w = dx.size(3);
  const int64_t oh = dy.size(2), ow = dy.size(3);
  Tensor dxb = OutBuffer(dx);
  DDP_DISPATCH_FLOATING(dx.dtype(), "adaptive_avg_pool2d_backward", {
    using A = acc_t<scalar_t>;
    const scalar_t* g = static_cast<const scalar_t*>(dyc.data_ptr());
    AccumulatePlanes(static_cast<scalar_t*>(dxb.data_ptr()), planes, h * w, [&](int64_t pl, A* dpl) {
      for (int64_t i = 0; i < oh; ++i) {
        const int64_t hs = AdaptiveStart(i, oh, h), he = AdaptiveEnd(i, oh, h);
        for (int64_t j = 0; j < ow; ++j) {
          const int64_t ws = AdaptiveStart(j, ow, w), we = AdaptiveEnd(j, ow, w);
          const A v = static_cast<A>(g[(pl * oh + i) * ow + j]) / static_cast<A>((he - hs) * (we - ws));
          for (int64_t ih = hs; ih < he; ++ih) {
            for (int64_t iw = ws; iw < we; ++iw) dpl[ih * w + iw] += v;
          }
        }
      }
    });
  });
  WriteBack(dx, dxb);
}

}  // namespace ddp::nn::ops::cpu
