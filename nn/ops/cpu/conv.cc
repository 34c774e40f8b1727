// conv2d on the CPU by unfolding (im2col) and GEMM, for every geometry and
// floating dtype (16-bit types compute in f32). Shapes:
//   x [N, C, H, W], w [O, C/G, KH, KW], bias [O], y [N, O, OH, OW]
//   OH = (H + 2*pad_h - dilation_h*(KH-1) - 1) / stride_h + 1 (same for W)
// Per group g, the unfolded input col has CKK = C/G*KH*KW rows and one
// column per output pixel; y_g = w_g [O/G, CKK] @ col [CKK, OH*OW].
// Several images share one GEMM (their columns side by side) when each
// image's GEMM would be small, which keeps the BLAS in its efficient regime.
#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "nn/ops/config.h"
#include "nn/ops/cpu/conv_onednn.h"
#include "nn/ops/cpu/cpu_kernels.h"

namespace ddp::nn::ops {

namespace {
ConvAlgorithm ConvFromEnv() {
  std::string problem;
  const ConvAlgorithm algorithm = internal::ConvFromEnvText(std::getenv("DDP_NN_CONV"), &problem);
  if (!problem.empty()) std::fprintf(stderr, "[ddp] warning: %s\n", problem.c_str());
  return algorithm;
}
std::atomic<ConvAlgorithm> g_conv{ConvFromEnv()};

int64_t Im2colBudgetFromEnv() {
  std::string problem;
  const int64_t bytes = internal::Im2colBytesFromEnvText(std::getenv("DDP_NN_IM2COL_BYTES"), &problem);
  if (!problem.empty()) std::fprintf(stderr, "[ddp] warning: %s\n", problem.c_str());
  return bytes;
}
const int64_t g_im2col_budget = Im2colBudgetFromEnv();
}  // namespace

namespace internal {

ConvAlgorithm ConvFromEnvText(const char* text, std::string* problem) {
  if (text == nullptr) return ConvAlgorithm::kAuto;
  const std::string_view v(text);
  if (v == "im2col") return ConvAlgorithm::kIm2col;
  if (v == "onednn") return ConvAlgorithm::kOneDnn;
  if (v != "auto") *problem = "DDP_NN_CONV=" + std::string(v) + " is not im2col, onednn or auto; using auto";
  return ConvAlgorithm::kAuto;
}

int64_t Im2colBytesFromEnvText(const char* text, std::string* problem) {
  constexpr int64_t kDefault = int64_t{1} << 20;
  if (text == nullptr) return kDefault;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || n < 1) {
    *problem = "DDP_NN_IM2COL_BYTES=" + std::string(text) + " is not a positive whole number of bytes; using " +
               std::to_string(kDefault);
    return kDefault;
  }
  return n;
}

}  // namespace internal

void SetConvAlgorithm(ConvAlgorithm algorithm) { g_conv = algorithm; }
ConvAlgorithm GetConvAlgorithm() { return g_conv; }

namespace cpu {

namespace {

struct Geometry {
  int64_t n, c, h, w, o, kh, kw, oh, ow, groups, cg, og, ckk, ohw;
};

Geometry MakeGeometry(const Tensor& x, const Tensor& w, const Conv2dParams& p, const Shape& y_shape) {
  Geometry g;
  g.n = x.size(0);
  g.c = x.size(1);
  g.h = x.size(2);
  g.w = x.size(3);
  g.o = w.size(0);
  g.kh = w.size(2);
  g.kw = w.size(3);
  g.oh = y_shape[2];
  g.ow = y_shape[3];
  g.groups = p.groups;
  g.cg = g.c / p.groups;
  g.og = g.o / p.groups;
  g.ckk = g.cg * g.kh * g.kw;
  g.ohw = g.oh * g.ow;
  return g;
}

template <typename T>
void GemmRaw(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    Sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    Dgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// Uninitialized scratch memory from the caching allocator (no page faults
// or zeroing per call, unlike a std::vector).
template <typename T>
Tensor Scratch(int64_t n) {
  return Empty({n}, {.dtype = DTypeOf<T>()});
}

// Unfolds one image's group x [Cg, H, W] into col rows of length OH*OW
// placed `ld` elements apart.
template <typename T>
void Im2col(const T* x, const Geometry& g, const Conv2dParams& p, T* col, int64_t ld) {
  for (int64_t c = 0; c < g.cg; ++c) {
    for (int64_t kh = 0; kh < g.kh; ++kh) {
      for (int64_t kw = 0; kw < g.kw; ++kw) {
        T* row = col + ((c * g.kh + kh) * g.kw + kw) * ld;
        const int64_t iw0 = kw * p.dilation_w - p.pad_w;
        // Output columns whose input column is inside the image (stride 1 fast path).
        const int64_t lo = std::clamp<int64_t>(-iw0, 0, g.ow);
        const int64_t hi = std::clamp<int64_t>(g.w - iw0, lo, g.ow);
        for (int64_t oh = 0; oh < g.oh; ++oh) {
          T* d = row + oh * g.ow;
          const int64_t ih = oh * p.stride_h - p.pad_h + kh * p.dilation_h;
          if (ih < 0 || ih >= g.h) {
            std::fill(d, d + g.ow, T(0));
            continue;
          }
          const T* src = x + (c * g.h + ih) * g.w;
          if (p.stride_w == 1) {
            std::fill(d, d + lo, T(0));
            // Only when a column is copied: src + lo + iw0 may lie past the
            // buffer otherwise (forming such a pointer is undefined).
            if (hi > lo) std::memcpy(d + lo, src + (lo + iw0), (hi - lo) * sizeof(T));
            std::fill(d + hi, d + g.ow, T(0));
          } else {
            for (int64_t ow = 0; ow < g.ow; ++ow) {
              const int64_t iw = ow * p.stride_w + iw0;
              d[ow] = (iw >= 0 && iw < g.w) ? src[iw] : T(0);
            }
          }
        }
      }
    }
  }
}

// The adjoint of Im2col: adds col back into dx [Cg, H, W].
template <typename T>
void Col2im(const T* col, int64_t ld, const Geometry& g, const Conv2dParams& p, T* dx) {
  for (int64_t c = 0; c < g.cg; ++c) {
    for (int64_t kh = 0; kh < g.kh; ++kh) {
      for (int64_t kw = 0; kw < g.kw; ++kw) {
        const T* row = col + ((c * g.kh + kh) * g.kw + kw) * ld;
        const int64_t iw0 = kw * p.dilation_w - p.pad_w;
        const int64_t lo = std::clamp<int64_t>(-iw0, 0, g.ow);
        const int64_t hi = std::clamp<int64_t>(g.w - iw0, lo, g.ow);
        for (int64_t oh = 0; oh < g.oh; ++oh) {
          const int64_t ih = oh * p.stride_h - p.pad_h + kh * p.dilation_h;
          if (ih < 0 || ih >= g.h) continue;
          const T* s = row + oh * g.ow;
          T* dst = dx + (c * g.h + ih) * g.w;
          if (p.stride_w == 1) {
            // Indexed from dst: dst + iw0 may point before the buffer.
            for (int64_t ow = lo; ow < hi; ++ow) dst[ow + iw0] += s[ow];
          } else {
            for (int64_t ow = 0; ow < g.ow; ++ow) {
              const int64_t iw = ow * p.stride_w + iw0;
              if (iw >= 0 && iw < g.w) dst[iw] += s[ow];
            }
          }
        }
      }
    }
  }
}

bool IsPointwise(const Geometry& g, const Conv2dParams& p) {
  return g.kh == 1 && g.kw == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_h == 0 && p.pad_w == 0;
}

// Images per GEMM: enough that the unfolded chunk fills the budget.
int64_t ChunkImages(const Geometry& g, size_t elem) {
  const int64_t per_image = std::max<int64_t>(1, g.ckk * g.ohw * static_cast<int64_t>(elem));
  return std::clamp<int64_t>(g_im2col_budget / per_image, 1, std::max<int64_t>(g.n, 1));
}

template <typename T>
void ForwardTyped(const T* x, const T* w, const T* bias, T* y, const Geometry& g, const Conv2dParams& p) {
  const bool pointwise = IsPointwise(g, p);
  const int64_t nb = pointwise ? 1 : ChunkImages(g, sizeof(T));
  Tensor col_t = Scratch<T>(pointwise ? 0 : g.ckk * g.ohw * nb);
  Tensor out_t = Scratch<T>(nb > 1 ? g.og * g.ohw * nb : 0);
  T* col = static_cast<T*>(col_t.data_ptr());
  T* out = static_cast<T*>(out_t.data_ptr());
  for (int64_t grp = 0; grp < g.groups; ++grp) {
    const T* wg = w + grp * g.og * g.ckk;
    for (int64_t n0 = 0; n0 < g.n; n0 += nb) {
      const int64_t cnt = std::min(nb, g.n - n0);
      if (cnt == 1) {
        const T* xn = x + (n0 * g.c + grp * g.cg) * g.h * g.w;
        const T* src = xn;
        if (!pointwise) {
          Im2col(xn, g, p, col, g.ohw);
          src = col;
        }
        T* yn = y + (n0 * g.o + grp * g.og) * g.ohw;
        GemmRaw<T>(false, false, g.og, g.ohw, g.ckk, T(1), wg, g.ckk, src, g.ohw, T(0), yn, g.ohw);
        continue;
      }
      const int64_t ld = cnt * g.ohw;
      for (int64_t i = 0; i < cnt; ++i) {
        Im2col(x + ((n0 + i) * g.c + grp * g.cg) * g.h * g.w, g, p, col + i * g.ohw, ld);
      }
      GemmRaw<T>(false, false, g.og, ld, g.ckk, T(1), wg, g.ckk, col, ld, T(0), out, ld);
      for (int64_t i = 0; i < cnt; ++i) {
        for (int64_t o = 0; o < g.og; ++o) {
          std::memcpy(y + ((n0 + i) * g.o + grp * g.og + o) * g.ohw, out + o * ld + i * g.ohw,
                      g.ohw * sizeof(T));
        }
      }
    }
  }
  if (bias != nullptr) {
    for (int64_t n = 0; n < g.n; ++n) {
      for (int64_t o = 0; o < g.o; ++o) {
        T* row = y + (n * g.o + o) * g.ohw;
        const T b = bias[o];
        for (int64_t i = 0; i < g.ohw; ++i) row[i] += b;
      }
    }
  }
}

template <typename T>
void BackwardTyped(const T* x, const T* w, const T* dy, T* dx, T* dw, T* db, const Geometry& g,
                   const Conv2dParams& p) {
  const bool pointwise = IsPointwise(g, p);
  const int64_t nb = ChunkImages(g, sizeof(T));
  Tensor col_t = Scratch<T>(g.ckk * g.ohw * nb);
  Tensor dyc_t = Scratch<T>(nb > 1 ? g.og * g.ohw * nb : 0);
  T* col = static_cast<T*>(col_t.data_ptr());
  T* dyc = static_cast<T*>(dyc_t.data_ptr());
  if (dx != nullptr) std::fill(dx, dx + g.n * g.c * g.h * g.w, T(0));
  for (int64_t grp = 0; grp < g.groups; ++grp) {
    const T* wg = w + grp * g.og * g.ckk;
    T* dwg = dw != nullptr ? dw + grp * g.og * g.ckk : nullptr;
    bool first = true;
    for (int64_t n0 = 0; n0 < g.n; n0 += nb) {
      const int64_t cnt = std::min(nb, g.n - n0);
      const int64_t ld = cnt * g.ohw;
      // dy of this chunk as [O/G, cnt*OH*OW].
      const T* dyg;
      if (cnt == 1) {
        dyg = dy + (n0 * g.o + grp * g.og) * g.ohw;
      } else {
        for (int64_t i = 0; i < cnt; ++i) {
          for (int64_t o = 0; o < g.og; ++o) {
            std::memcpy(dyc + o * ld + i * g.ohw, dy + ((n0 + i) * g.o + grp * g.og + o) * g.ohw,
                        g.ohw * sizeof(T));
          }
        }
        dyg = dyc;
      }
      if (dwg != nullptr) {
        const T* src;
        if (pointwise && cnt == 1) {
          src = x + (n0 * g.c + grp * g.cg) * g.h * g.w;
        } else {
          for (int64_t i = 0; i < cnt; ++i) {
            const T* xn = x + ((n0 + i) * g.c + grp * g.cg) * g.h * g.w;
            if (pointwise) {
              for (int64_t c = 0; c < g.cg; ++c) {
                std::memcpy(col + c * ld + i * g.ohw, xn + c * g.ohw, g.ohw * sizeof(T));
              }
            } else {
              Im2col(xn, g, p, col + i * g.ohw, ld);
            }
          }
          src = col;
        }
        // dw_g [O/G, CKK] (+)= dy_chunk [O/G, L] @ col^T [L, CKK]
        GemmRaw<T>(false, true, g.og, g.ckk, ld, T(1), dyg, ld, src, ld, first ? T(0) : T(1), dwg, g.ckk);
      }
      if (dx != nullptr) {
        if (pointwise && cnt == 1) {
          T* dxn = dx + (n0 * g.c + grp * g.cg) * g.h * g.w;
          GemmRaw<T>(true, false, g.ckk, ld, g.og, T(1), wg, g.ckk, dyg, ld, T(0), dxn, ld);
        } else {
          // dcol [CKK, L] = w_g^T [CKK, O/G] @ dy_chunk [O/G, L], then fold back.
          GemmRaw<T>(true, false, g.ckk, ld, g.og, T(1), wg, g.ckk, dyg, ld, T(0), col, ld);
          for (int64_t i = 0; i < cnt; ++i) {
            T* dxn = dx + ((n0 + i) * g.c + grp * g.cg) * g.h * g.w;
            if (pointwise) {
              for (int64_t c = 0; c < g.cg; ++c) {
                const T* s = col + c * ld + i * g.ohw;
                T* d = dxn + c * g.ohw;
                for (int64_t j = 0; j < g.ohw; ++j) d[j] += s[j];
              }
            } else {
              Col2im(col + i * g.ohw, ld, g, p, dxn);
            }
          }
        }
      }
      first = false;
    }
    if (dwg != nullptr && g.n == 0) std::fill(dwg, dwg + g.og * g.ckk, T(0));
  }
  if (db != nullptr) {
    for (int64_t o = 0; o < g.o; ++o) {
      double s = 0;
      for (int64_t n = 0; n < g.n; ++n) {
        const T* row = dy + (n * g.o + o) * g.ohw;
        for (int64_t i = 0; i < g.ohw; ++i) s += row[i];
      }
      db[o] = static_cast<T>(s);
    }
  }
}

// A contiguous tensor of `t`'s data in dtype `want` (t itself when it already is one).
Tensor Prepared(const Tensor& t, DType want) {
  if (!t.defined()) return t;
  if (t.dtype() == want) return ContiguousData(t);
  return t.Detach().To(want).Contiguous();
}

// An output buffer in dtype `want`: `t` itself when it qualifies, else a temporary.
Tensor OutputBuffer(const Tensor& t, DType want) {
  if (!t.defined()) return t;
  if (t.dtype() == want && t.is_contiguous()) return t;
  return Empty(t.shape(), {.dtype = want});
}

void WriteBack(const Tensor& dst, const Tensor& buf) {
  if (!dst.defined() || buf.is_same(dst)) return;
  NoGradGuard guard;
  dst.CopyFrom(buf);
}

}  // namespace

void Conv2dForward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const Conv2dParams& p) {
  // Nothing to compute; the im2col scratch would still be sized for one image.
  if (y.numel() == 0) return;
  const DType compute = x.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  if (compute == DType::kFloat32 && onednn::ShouldUse(x, w, p, GetConvAlgorithm()) &&
      onednn::Conv2dForward(x, w, bias, y, p)) {
    return;
  }
  const Geometry g = MakeGeometry(x, w, p, y.shape());
  Tensor xc = Prepared(x, compute), wc = Prepared(w, compute), bc = Prepared(bias, compute);
  Tensor yb = OutputBuffer(y, compute);
  if (compute == DType::kFloat32) {
    ForwardTyped<float>(xc.data<float>(), wc.data<float>(), bc.defined() ? bc.data<float>() : nullptr,
                        yb.data<float>(), g, p);
  } else {
    ForwardTyped<double>(xc.data<double>(), wc.data<double>(), bc.defined() ? bc.data<double>() : nullptr,
                         yb.data<double>(), g, p);
  }
  WriteBack(y, yb);
}

void Conv2dBackward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                    const Tensor& db, const Conv2dParams& p) {
  if (x.size(0) == 0) {
    // An empty batch: dx is empty, dw and db are zero (written, not
    // accumulated), and no scratch sized for one image is taken.
    NoGradGuard guard;
    if (dw.defined()) dw.Fill(0.0);
    if (db.defined()) db.Fill(0.0);
    return;
  }
  const DType compute = x.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  if (compute == DType::kFloat32 && onednn::ShouldUse(x, w, p, GetConvAlgorithm()) &&
      onednn::Conv2dBackward(x, w, dy, dx, dw, db, p)) {
    return;
  }
  const Geometry g = MakeGeometry(x, w, p, dy.shape());
  Tensor xc = Prepared(x, compute), wc = Prepared(w, compute), dyc = Prepared(dy, compute);
  Tensor dxb = OutputBuffer(dx, compute), dwb = OutputBuffer(dw, compute), dbb = OutputBuffer(db, compute);
  if (compute == DType::kFloat32) {
    BackwardTyped<float>(xc.data<float>(), wc.data<float>(), dyc.data<float>(),
                         dxb.defined() ? dxb.data<float>() : nullptr, dwb.defined() ? dwb.data<float>() : nullptr,
                         dbb.defined() ? dbb.data<float>() : nullptr, g, p);
  } else {
    BackwardTyped<double>(xc.data<double>(), wc.data<double>(), dyc.data<double>(),
                          dxb.defined() ? dxb.data<double>() : nullptr,
                          dwb.defined() ? dwb.data<double>() : nullptr,
                          dbb.defined() ? dbb.data<double>() : nullptr, g, p);
  }
  WriteBack(dx, dxb);
  WriteBack(dw, dwb);
  WriteBack(db, dbb);
}

}  // namespace cpu
}  // namespace ddp::nn::ops
