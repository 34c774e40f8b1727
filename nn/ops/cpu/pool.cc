// Pooling over NCHW planes. Shapes: x [N, C, H, W], y [N, C, OH, OW]; each
// (n, c) plane is independent, so kernels loop over N*C planes.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "nn/ops/cpu/cpu_kernels.h"

namespace ddp::nn::ops::cpu {

namespace {

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
  const Tensor xc = ContiguousData(x);
  const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = y.size(2), ow = y.size(3);
  Tensor yb = OutBuffer(y);
  if (indices.dtype() != DType::kInt32 || !indices.is_contiguous()) {
    throw std::invalid_argument("max_pool2d: indices must be contiguous i32");
  }
  int32_t* ind = indices.data<int32_t>();
  DDP_DISPATCH_FLOATING(x.dtype(), "max_pool2d", {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = static_cast<const scalar_t*>(xc.data_ptr());
    scalar_t* yp = static_cast<scalar_t*>(yb.data_ptr());
    const bool fast22 = p.kernel_h == 2 && p.kernel_w == 2 && p.stride_h == 2 && p.stride_w == 2 &&
                        p.pad_h == 0 && p.pad_w == 0 && p.dilation_h == 1 && p.dilation_w == 1;
    for (int64_t pl = 0; pl < planes; ++pl) {
      const scalar_t* xpl = xp + pl * h * w;
      scalar_t* ypl = yp + pl * oh * ow;
      int32_t* ipl = ind + pl * oh * ow;
      for (int64_t i = 0; i < oh; ++i) {
        if (fast22) {
          // 2x2 windows, stride 2: the CNN's pooling, every window inside the plane.
          const scalar_t* r0 = xpl + (2 * i) * w;
          const scalar_t* r1 = r0 + w;
          for (int64_t j = 0; j < ow; ++j) {
            const int64_t c = 2 * j;
            A best = static_cast<A>(r0[c]);
            int64_t bi = 2 * i * w + c;
            const A v1 = static_cast<A>(r0[c + 1]), v2 = static_cast<A>(r1[c]), v3 = static_cast<A>(r1[c + 1]);
            if (v1 > best || std::isnan(v1)) { best = v1; bi = 2 * i * w + c + 1; }
            if (v2 > best || std::isnan(v2)) { best = v2; bi = (2 * i + 1) * w + c; }
            if (v3 > best || std::isnan(v3)) { best = v3; bi = (2 * i + 1) * w + c + 1; }
            ypl[i * ow + j] = static_cast<scalar_t>(best);
            ipl[i * ow + j] = static_cast<int32_t>(bi);
          }
          continue;
        }
        const int64_t h0 = i * p.stride_h - p.pad_h;
        for (int64_t j = 0; j < ow; ++j) {
          const int64_t w0 = j * p.stride_w - p.pad_w;
          A best = -std::numeric_limits<A>::infinity();
          int64_t bi = -1;
          for (int64_t kh = 0; kh < p.kernel_h; ++kh) {
            const int64_t ih = h0 + kh * p.dilation_h;
            if (ih < 0 || ih >= h) continue;
            for (int64_t kw = 0; kw < p.kernel_w; ++kw) {
              const int64_t iw = w0 + kw * p.dilation_w;
              if (iw < 0 || iw >= w) continue;
              const A v = static_cast<A>(xpl[ih * w + iw]);
              if (bi < 0 || v > best || std::isnan(v)) {  // NaN wins, as in PyTorch
                best = v;
                bi = ih * w + iw;
                if (std::isnan(v)) break;
              }
            }
          }
          ypl[i * ow + j] = static_cast<scalar_t>(best);
          ipl[i * ow + j] = static_cast<int32_t>(bi < 0 ? 0 : bi);
        }
      }
    }
  });
  WriteBack(y, yb);
}

void MaxPool2dBackward(const Tensor& dy, const Tensor& indices, const Tensor& dx) {
  const Tensor dyc = ContiguousData(dy);
  const int64_t planes = dx.size(0) * dx.size(1), hw = dx.size(2) * dx.size(3);
  const int64_t ohw = dy.size(2) * dy.size(3);
  Tensor dxb = OutBuffer(dx);
  const int32_t* ind = indices.data<int32_t>();
  DDP_DISPATCH_FLOATING(dx.dtype(), "max_pool2d_backward", {
    using A = acc_t<scalar_t>;
    const scalar_t* g = static_cast<const scalar_t*>(dyc.data_ptr());
    scalar_t* d = static_cast<scalar_t*>(dxb.data_ptr());
    std::fill(d, d + planes * hw, scalar_t(0));
    for (int64_t pl = 0; pl < planes; ++pl) {
      scalar_t* dpl = d + pl * hw;
      const scalar_t* gpl = g + pl * ohw;
      const int32_t* ipl = ind + pl * ohw;
      for (int64_t k = 0; k < ohw; ++k) {
        dpl[ipl[k]] = static_cast<scalar_t>(static_cast<A>(dpl[ipl[k]]) + static_cast<A>(gpl[k]));
      }
    }
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

Window AvgWindow(int64_t o, int64_t stride, int64_t pad, int64_t kernel, int64_t size) {
  int64_t s = o * stride - pad;
  int64_t e = std::min(s + kernel, size + pad);
  const int64_t padded = e - s;
  s = std::max<int64_t>(s, 0);
  e = std::min(e, size);
  return {s, e, padded};
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
          const int64_t div = p.count_include_pad ? wh.padded_len * ww.padded_len
                                                  : (wh.end - wh.start) * (ww.end - ww.start);
          yp[(pl * oh + i) * ow + j] = static_cast<scalar_t>(div > 0 ? s / static_cast<A>(div) : A(0));
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
    scalar_t* d = static_cast<scalar_t*>(dxb.data_ptr());
    std::fill(d, d + planes * h * w, scalar_t(0));
    for (int64_t pl = 0; pl < planes; ++pl) {
      scalar_t* dpl = d + pl * h * w;
      for (int64_t i = 0; i < oh; ++i) {
        const Window wh = AvgWindow(i, p.stride_h, p.pad_h, p.kernel_h, h);
        for (int64_t j = 0; j < ow; ++j) {
          const Window ww = AvgWindow(j, p.stride_w, p.pad_w, p.kernel_w, w);
          const int64_t div = p.count_include_pad ? wh.padded_len * ww.padded_len
                                                  : (wh.end - wh.start) * (ww.end - ww.start);
          if (div <= 0) continue;
          const A v = static_cast<A>(g[(pl * oh + i) * ow + j]) / static_cast<A>(div);
          for (int64_t ih = wh.start; ih < wh.end; ++ih) {
            for (int64_t iw = ww.start; iw < ww.end; ++iw) {
              dpl[ih * w + iw] = static_cast<scalar_t>(static_cast<A>(dpl[ih * w + iw]) + v);
            }
          }
        }
      }
    }
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
    scalar_t* d = static_cast<scalar_t*>(dxb.data_ptr());
    std::fill(d, d + planes * h * w, scalar_t(0));
    for (int64_t pl = 0; pl < planes; ++pl) {
      scalar_t* dpl = d + pl * h * w;
      for (int64_t i = 0; i < oh; ++i) {
        const int64_t hs = AdaptiveStart(i, oh, h), he = AdaptiveEnd(i, oh, h);
        for (int64_t j = 0; j < ow; ++j) {
          const int64_t ws = AdaptiveStart(j, ow, w), we = AdaptiveEnd(j, ow, w);
          const A v = static_cast<A>(g[(pl * oh + i) * ow + j]) / static_cast<A>((he - hs) * (we - ws));
          for (int64_t ih = hs; ih < he; ++ih) {
            for (int64_t iw = ws; iw < we; ++iw) {
              dpl[ih * w + iw] = static_cast<scalar_t>(static_cast<A>(dpl[ih * w + iw]) + v);
            }
          }
        }
      }
    }
  });
  WriteBack(dx, dxb);
}

}  // namespace ddp::nn::ops::cpu
