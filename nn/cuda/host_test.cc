// Logic of the CUDA backend that needs no GPU: size classes, index
// geometry, error text, registration. Runs under --config=cuda on any
// machine (no "gpu" tag).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <stdexcept>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "nn/cuda/allocator.h"
#include "nn/cuda/cuda.h"
#include "nn/cuda/cuda_error.h"
#include "nn/cuda/copy.h"
#include "nn/cuda/fast_divide.h"
#include "nn/cuda/gemm.h"
#include "nn/cuda/indexing.h"
#include "nn/cuda/launch.h"
#include "nn/cuda/multi_tensor.h"
#include "nn/cuda/optim_kernels.h"
#include "nn/optim/device_kernels.h"
#include "nn/cuda/pool_math.h"
#include "nn/cuda/stream.h"
#include "nn/ops/cpu/cpu_kernels.h"
#include "nn/ops/dispatch.h"
#include "nn/tensor/generator.h"

namespace ddp::nn::cuda {
namespace {

TEST(CudaAllocatorSizes, SmallRequestsRoundTo512Bytes) {
  EXPECT_EQ(CachingCudaAllocator::RoundSize(0), 512u);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(1), 512u);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(512), 512u);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(513), 1024u);
  EXPECT_EQ(CachingCudaAllocator::RoundSize((1u << 20) - 1), size_t{1} << 20);
}

TEST(CudaAllocatorSizes, LargeRequestsUseEightClassesPerPowerOfTwo) {
  const size_t mib = size_t{1} << 20;
  EXPECT_EQ(CachingCudaAllocator::RoundSize(mib), mib);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(mib + 1), mib + mib / 8);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(3 * mib), 3 * mib);
  EXPECT_EQ(CachingCudaAllocator::RoundSize(3 * mib + 1), 3 * mib + 2 * mib / 8);
  for (size_t n = mib; n < 64 * mib; n = n * 9 / 7 + 12345) {
    const size_t r = CachingCudaAllocator::RoundSize(n);
    EXPECT_GE(r, n);
    EXPECT_LE(static_cast<double>(r), static_cast<double>(n) * 1.125 + 1) << n;
  }
}

TEST(CudaIndexing, ContiguousOperandsCollapseToOneDimension) {
  const Shape shape = {4, 5, 6};
  const Shape st = ContiguousStrides(shape);
  const launch::Indexing ix = MakeIndexing("test", shape, {st, st});
  EXPECT_TRUE(ix.contiguous);
  EXPECT_EQ(ix.ndim, 1);
  EXPECT_EQ(ix.sizes[0], 120);
}

TEST(CudaIndexing, TransposedOperandKeepsTwoDimensions) {
  // out [3, 4] contiguous, x = a transposed [4, 3] buffer: strides (1, 3).
  const launch::Indexing ix = MakeIndexing("test", {3, 4}, {Shape{4, 1}, Shape{1, 3}});
  EXPECT_FALSE(ix.contiguous);
  ASSERT_EQ(ix.ndim, 2);
  EXPECT_EQ(ix.sizes[0], 3);
  EXPECT_EQ(ix.sizes[1], 4);
  EXPECT_EQ(ix.strides[0][0], 4);
  EXPECT_EQ(ix.strides[1][0], 1);
  EXPECT_EQ(ix.strides[1][1], 3);
}

TEST(CudaIndexing, SizeOneDimensionsAreDroppedAndBroadcastKeepsStrideZero) {
  const Shape shape = {1, 2, 1, 3};
  const launch::Indexing ix = MakeIndexing("test", shape, {ContiguousStrides(shape), Shape{0, 0, 0, 1}});
  ASSERT_EQ(ix.ndim, 2);
  EXPECT_EQ(ix.sizes[0], 2);
  EXPECT_EQ(ix.sizes[1], 3);
  EXPECT_EQ(ix.strides[1][0], 0);
  EXPECT_EQ(ix.strides[1][1], 1);
}

// Row-major offset of element `linear` of `shape` in a tensor with `strides`.
int64_t DirectOffset(const Shape& shape, const Shape& strides, int64_t linear) {
  int64_t off = 0;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    off += (linear % shape[d]) * strides[d];
    linear /= shape[d];
  }
  return off;
}

// The kernels' index math (merged dimensions, fast contiguous path) gives
// every operand's offsets exactly as direct strided indexing does, for
// random shapes, permutations, slices and broadcasts.
TEST(CudaIndexing, MergedGeometryAddressesEveryElementLikeDirectIndexing) {
  Generator gen(3);
  for (int trial = 0; trial < 300; ++trial) {
    const int rank = 1 + static_cast<int>(gen.NextU64() % 5);
    Shape shape(rank);
    for (int d = 0; d < rank; ++d) shape[d] = 1 + static_cast<int64_t>(gen.NextU64() % 4);
    // Operand 0: contiguous; 1: a permuted contiguous buffer; 2: broadcast
    // (stride 0 in random dimensions) over a sliced (step 2) buffer.
    const Shape s0 = ContiguousStrides(shape);
    std::vector<int> perm(rank);
    for (int d = 0; d < rank; ++d) perm[d] = d;
    for (int d = rank - 1; d > 0; --d) std::swap(perm[d], perm[gen.NextU64() % (d + 1)]);
    Shape permuted(rank);
    for (int d = 0; d < rank; ++d) permuted[d] = shape[perm[d]];
    const Shape pst = ContiguousStrides(permuted);
    Shape s1(rank), s2(rank);
    for (int d = 0; d < rank; ++d) s1[perm[d]] = pst[d];
    int64_t stride = 2;
    for (int d = rank - 1; d >= 0; --d) {
      s2[d] = (gen.NextU64() % 3 == 0) ? 0 : stride;
      stride *= shape[d] * 2;
    }
    const launch::Indexing ix = MakeIndexing("test", shape, {s0, s1, s2});
    const int64_t n = NumElements(shape);
    for (int64_t i = 0; i < n; ++i) {
      int64_t off[3];
      launch::OffsetsOf<3>(ix, i, off);
      ASSERT_EQ(off[0], DirectOffset(shape, s0, i)) << "trial " << trial << " element " << i;
      ASSERT_EQ(off[1], DirectOffset(shape, s1, i)) << "trial " << trial << " element " << i;
      ASSERT_EQ(off[2], DirectOffset(shape, s2, i)) << "trial " << trial << " element " << i;
    }
  }
}

// The sum_to kernels visit, for output j, the x offsets kept[j] + reduced[r]
// for every r. Replayed on the host with real strided CPU tensors, that
// must give the CPU kernel's sums exactly (the same f64 additions in the
// same order per output).
TEST(CudaIndexing, SumToGeometryReproducesTheCpuSums) {
  Generator gen(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int rank = 1 + static_cast<int>(gen.NextU64() % 4);
    Shape shape(rank), out_shape(rank);
    for (int d = 0; d < rank; ++d) {
      shape[d] = 1 + static_cast<int64_t>(gen.NextU64() % 5);
      out_shape[d] = gen.NextU64() % 2 == 0 ? 1 : shape[d];
    }
    // x: a transposed view of a f64 buffer when rank >= 2, to get real strides.
    Tensor x = Empty(shape, {.dtype = DType::kFloat64});
    UniformFill(x, -1.0, 1.0, gen);
    if (rank >= 2) {
      Shape swapped = shape;
      std::swap(swapped[0], swapped[rank - 1]);
      Tensor base = Empty(swapped, {.dtype = DType::kFloat64});
      UniformFill(base, -1.0, 1.0, gen);
      x = base.Transpose(0, rank - 1);
    }
    const Tensor out = Empty(out_shape, {.dtype = DType::kFloat64});
    const launch::ReduceIndexing rx = MakeSumToIndexing(x, out);
    const double* xp = x.data<double>();
    double* op = out.data<double>();
    for (int64_t j = 0; j < rx.num_kept; ++j) {
      int64_t kept[2];
      launch::OffsetsOf<2>(rx.kept, j, kept);
      double sum = 0;
      for (int64_t r = 0; r < rx.num_reduced; ++r) {
        int64_t red[2];
        launch::OffsetsOf<2>(rx.reduced, r, red);
        sum += xp[kept[1] + red[1]];
      }
      op[kept[0]] = sum;
    }
    const Tensor want = Empty(out_shape, {.dtype = DType::kFloat64});
    ops::KernelsFor(DeviceType::kCPU).sum_to(x, want, 1.0);
    const std::vector<double> a = want.ToVector<double>(), b = out.ToVector<double>();
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_NEAR(b[i], a[i], 1e-12) << "trial " << trial << " " << ShapeToString(shape) << " -> "
                                     << ShapeToString(out_shape) << " element " << i;
    }
  }
}

TEST(CudaIndexing, SumToRejectsShapesThatDoNotReduce) {
  const Tensor x = Empty({3, 4}), out = Empty({2, 4});
  try {
    (void)MakeSumToIndexing(x, out);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[3, 4] to [2, 4]"), std::string::npos) << e.what();
  }
}

TEST(CudaIndexing, TooManyDimensionsNameTheOp) {
  // Alternating strides that cannot merge: 9 dimensions.
  Shape shape(9, 2), a(9), b(9);
  for (int d = 8, s = 1; d >= 0; --d, s *= 2) {
    a[d] = s;
    b[d] = (d % 2 == 0) ? s * 3 : s;
  }
  try {
    (void)MakeIndexing("binary", shape, {a, b});
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("binary on CUDA"), std::string::npos) << e.what();
  }
}

TEST(CudaIndexing, BroadcastStridesRejectIncompatibleShapes) {
  EXPECT_THROW(BroadcastStridesTo(Tensor::FromBlob(nullptr, {3}, DType::kFloat32), {4}), std::invalid_argument);
}

// PyTorch's output size of a pooling window (ceil mode: the last window
// must start inside the input or its left padding).
int64_t PoolOut(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d, bool ceil) {
  const int64_t num = in + 2 * p - d * (k - 1) - 1;
  int64_t out = (ceil ? (num + s - 1) / s : num / s) + 1;
  if (ceil && (out - 1) * s >= in + p) --out;
  return out;
}

launch::PoolGeometry RandomPool(Generator& gen, bool dilated) {
  launch::PoolGeometry g;
  for (;;) {
    g.planes = 1;
    g.h = 1 + static_cast<int64_t>(gen.NextU64() % 12);
    g.w = 1 + static_cast<int64_t>(gen.NextU64() % 12);
    g.kh = 1 + static_cast<int64_t>(gen.NextU64() % 4);
    g.kw = 1 + static_cast<int64_t>(gen.NextU64() % 4);
    g.sh = 1 + static_cast<int64_t>(gen.NextU64() % 3);
    g.sw = 1 + static_cast<int64_t>(gen.NextU64() % 3);
    g.ph = static_cast<int64_t>(gen.NextU64() % (g.kh / 2 + 1));  // PyTorch: pad <= kernel / 2
    g.pw = static_cast<int64_t>(gen.NextU64() % (g.kw / 2 + 1));
    g.dh = dilated ? 1 + static_cast<int64_t>(gen.NextU64() % 2) : 1;
    g.dw = dilated ? 1 + static_cast<int64_t>(gen.NextU64() % 2) : 1;
    g.count_include_pad = gen.NextU64() % 2 == 0;
    const bool ceil = gen.NextU64() % 2 == 0;
    g.oh = PoolOut(g.h, g.kh, g.sh, g.ph, g.dh, ceil);
    g.ow = PoolOut(g.w, g.kw, g.sw, g.pw, g.dw, ceil);
    if (g.oh > 0 && g.ow > 0) return g;
  }
}

// The backward kernels gather, per input element, the outputs whose windows
// cover it; the forward kernels define the windows per output. Both views
// must name the same (output, input) pairs, with the same divisors.
TEST(CudaPoolMath, MaxWindowsGatheredPerInputAreTheForwardWindows) {
  Generator gen(17);
  for (int trial = 0; trial < 500; ++trial) {
    const launch::PoolGeometry g = RandomPool(gen, true);
    std::set<std::pair<int64_t, int64_t>> forward, gathered;
    for (int64_t i = 0; i < g.oh; ++i) {
      for (int64_t j = 0; j < g.ow; ++j) {
        for (int64_t kh = 0; kh < g.kh; ++kh) {
          for (int64_t kw = 0; kw < g.kw; ++kw) {
            const int64_t ih = i * g.sh - g.ph + kh * g.dh, iw = j * g.sw - g.pw + kw * g.dw;
            if (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w) forward.insert({i * g.ow + j, ih * g.w + iw});
          }
        }
      }
    }
    for (int64_t ih = 0; ih < g.h; ++ih) {
      for (int64_t iw = 0; iw < g.w; ++iw) {
        launch::ForEachMaxWindowCovering(g, ih, iw, [&](int64_t o) { gathered.insert({o, ih * g.w + iw}); });
      }
    }
    ASSERT_EQ(gathered, forward) << "trial " << trial;
  }
}

TEST(CudaPoolMath, AverageWindowsGatheredPerInputAreTheForwardWindows) {
  Generator gen(18);
  for (int trial = 0; trial < 500; ++trial) {
    const launch::PoolGeometry g = RandomPool(gen, false);
    std::set<std::tuple<int64_t, int64_t, double>> forward, gathered;
    for (int64_t i = 0; i < g.oh; ++i) {
      const launch::AvgWindow wh = launch::AvgWindowOf(i, g.sh, g.ph, g.kh, g.h);
      for (int64_t j = 0; j < g.ow; ++j) {
        const launch::AvgWindow ww = launch::AvgWindowOf(j, g.sw, g.pw, g.kw, g.w);
        const double div = launch::AvgDivisorOf<double>(g, wh, ww);
        if (!(div > 0)) continue;
        for (int64_t ih = wh.start; ih < wh.end; ++ih) {
          for (int64_t iw = ww.start; iw < ww.end; ++iw) forward.insert({i * g.ow + j, ih * g.w + iw, div});
        }
      }
    }
    for (int64_t ih = 0; ih < g.h; ++ih) {
      for (int64_t iw = 0; iw < g.w; ++iw) {
        launch::ForEachAvgWindowCovering<double>(
            g, ih, iw, [&](int64_t o, double div) { gathered.insert({o, ih * g.w + iw, div}); });
      }
    }
    ASSERT_EQ(gathered, forward) << "trial " << trial;
  }
}

TEST(CudaPoolMath, AdaptiveWindowsGatheredPerInputAreTheForwardWindows) {
  for (int64_t h = 1; h <= 13; ++h) {
    for (int64_t oh = 1; oh <= 15; ++oh) {
      launch::PoolGeometry g;
      g.planes = 1;
      g.h = h;
      g.w = 14 - h;
      g.oh = oh;
      g.ow = 16 - oh;
      std::set<std::tuple<int64_t, int64_t, int64_t>> forward, gathered;
      for (int64_t i = 0; i < g.oh; ++i) {
        const int64_t hs = launch::AdaptiveStartOf(i, g.oh, g.h), he = launch::AdaptiveEndOf(i, g.oh, g.h);
        for (int64_t j = 0; j < g.ow; ++j) {
          const int64_t ws = launch::AdaptiveStartOf(j, g.ow, g.w), we = launch::AdaptiveEndOf(j, g.ow, g.w);
          for (int64_t ih = hs; ih < he; ++ih) {
            for (int64_t iw = ws; iw < we; ++iw) forward.insert({i * g.ow + j, ih * g.w + iw, (he - hs) * (we - ws)});
          }
        }
      }
      for (int64_t ih = 0; ih < g.h; ++ih) {
        for (int64_t iw = 0; iw < g.w; ++iw) {
          launch::ForEachAdaptiveWindowCovering(
              g, ih, iw, [&](int64_t o, int64_t count) { gathered.insert({o, ih * g.w + iw, count}); });
        }
      }
      ASSERT_EQ(gathered, forward) << h << "x" << g.w << " -> " << oh << "x" << g.ow;
    }
  }
}

// One axis of the window arithmetic against the loops over every tap that
// it replaced, for every small geometry (input 1-7, kernel 1-5, stride 1-4,
// dilation 1-3, padding up to half the kernel, 1-8 outputs): the same taps
// in the same order, since the backward kernels add floating-point terms in
// that order and the max forward's tie rule depends on it.
TEST(CudaPoolMath, TapRangesVisitTheFullLoopsTapsInItsOrder) {
  int64_t nonempty = 0;
  for (int64_t size = 1; size <= 7; ++size) {
    for (int64_t kernel = 1; kernel <= 5; ++kernel) {
      for (int64_t stride = 1; stride <= 4; ++stride) {
        for (int64_t dilation = 1; dilation <= 3; ++dilation) {
          for (int64_t pad = 0; pad <= kernel / 2; ++pad) {
            for (int64_t out = 1; out <= 8; ++out) {
              const std::string where = "size " + std::to_string(size) + " kernel " + std::to_string(kernel) +
                                        " stride " + std::to_string(stride) + " dilation " +
                                        std::to_string(dilation) + " pad " + std::to_string(pad) + " out " +
                                        std::to_string(out);
              for (int64_t in = 0; in < size; ++in) {
                std::vector<std::pair<int64_t, int64_t>> full, ranged;
                for (int64_t k = 0; k < kernel; ++k) {
                  const int64_t num = in + pad - k * dilation;
                  if (num >= 0 && num % stride == 0 && num / stride < out) full.push_back({k, num / stride});
                }
                launch::ForEachTapCovering(in, pad, dilation, stride, kernel, out,
                                           [&](int64_t k, int64_t o) { ranged.push_back({k, o}); });
                ASSERT_EQ(ranged, full) << where << " input " << in;
                nonempty += full.empty() ? 0 : 1;
              }
              for (int64_t o = 0; o < out; ++o) {
                const int64_t start = o * stride - pad;
                std::vector<int64_t> full, ranged;
                for (int64_t k = 0; k < kernel; ++k) {
                  const int64_t cell = start + k * dilation;
                  if (cell >= 0 && cell < size) full.push_back(k);
                }
                const launch::TapRange r = launch::TapsInside(start, dilation, kernel, size);
                for (int64_t k = r.first; k < r.end; ++k) ranged.push_back(k);
                ASSERT_EQ(ranged, full) << where << " output " << o;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(nonempty, 10000);  // the sweep reaches real windows, not only empty ones
}

// The 2-D gathers against the loops over every (kh, kw) tap they replaced:
// the same outputs and divisors in the same order.
TEST(CudaPoolMath, GathersVisitOutputsInTheFullLoopsOrder) {
  Generator gen(19);
  for (int trial = 0; trial < 300; ++trial) {
    const launch::PoolGeometry g = RandomPool(gen, true);
    const launch::PoolGeometry ga = RandomPool(gen, false);
    for (int64_t ih = 0; ih < g.h; ++ih) {
      for (int64_t iw = 0; iw < g.w; ++iw) {
        std::vector<int64_t> full, ranged;
        for (int64_t kh = 0; kh < g.kh; ++kh) {
          const int64_t nh = ih + g.ph - kh * g.dh;
          if (nh < 0 || nh % g.sh != 0 || nh / g.sh >= g.oh) continue;
          for (int64_t kw = 0; kw < g.kw; ++kw) {
            const int64_t nw = iw + g.pw - kw * g.dw;
            if (nw < 0 || nw % g.sw != 0 || nw / g.sw >= g.ow) continue;
            full.push_back(nh / g.sh * g.ow + nw / g.sw);
          }
        }
        launch::ForEachMaxWindowCovering(g, ih, iw, [&](int64_t o) { ranged.push_back(o); });
        ASSERT_EQ(ranged, full) << "max trial " << trial << " input (" << ih << ", " << iw << ")";
      }
    }
    for (int64_t ih = 0; ih < ga.h; ++ih) {
      for (int64_t iw = 0; iw < ga.w; ++iw) {
        std::vector<std::pair<int64_t, double>> full, ranged;
        for (int64_t kh = 0; kh < ga.kh; ++kh) {
          const int64_t nh = ih + ga.ph - kh;
          if (nh < 0 || nh % ga.sh != 0 || nh / ga.sh >= ga.oh) continue;
          const launch::AvgWindow wh = launch::AvgWindowOf(nh / ga.sh, ga.sh, ga.ph, ga.kh, ga.h);
          for (int64_t kw = 0; kw < ga.kw; ++kw) {
            const int64_t nw = iw + ga.pw - kw;
            if (nw < 0 || nw % ga.sw != 0 || nw / ga.sw >= ga.ow) continue;
            const launch::AvgWindow ww = launch::AvgWindowOf(nw / ga.sw, ga.sw, ga.pw, ga.kw, ga.w);
            const double div = launch::AvgDivisorOf<double>(ga, wh, ww);
            if (div > 0) full.push_back({nh / ga.sh * ga.ow + nw / ga.sw, div});
          }
        }
        launch::ForEachAvgWindowCovering<double>(ga, ih, iw,
                                                 [&](int64_t o, double div) { ranged.push_back({o, div}); });
        ASSERT_EQ(ranged, full) << "avg trial " << trial << " input (" << ih << ", " << iw << ")";
      }
    }
  }
}

// pool.cu's kernels over one plane, run on the host with the same window
// arithmetic (pool_math.h), to compare with nn/ops' CPU kernels.
struct PlaneResult {
  std::vector<double> y, dx;
  std::vector<int32_t> ind;
};

template <typename A>
PlaneResult MaxPoolLikeTheKernels(const launch::PoolGeometry& g, const std::vector<double>& x) {
  PlaneResult r;
  for (int64_t i = 0; i < g.oh; ++i) {
    for (int64_t j = 0; j < g.ow; ++j) {
      const int64_t h0 = i * g.sh - g.ph, w0 = j * g.sw - g.pw;
      const launch::TapRange th = launch::TapsInside(h0, g.dh, g.kh, g.h);
      const launch::TapRange tw = launch::TapsInside(w0, g.dw, g.kw, g.w);
      A best = -std::numeric_limits<A>::infinity();
      int64_t bi = -1;
      for (int64_t kh = th.first; kh < th.end; ++kh) {
        for (int64_t kw = tw.first; kw < tw.end; ++kw) {
          const int64_t cell = (h0 + kh * g.dh) * g.w + w0 + kw * g.dw;
          const A v = static_cast<A>(x[cell]);
          if (bi < 0 || v > best || std::isnan(v)) {
            best = v;
            bi = cell;
          }
        }
      }
      r.y.push_back(best);
      r.ind.push_back(static_cast<int32_t>(bi));
    }
  }
  // Backward with dy = 1 everywhere.
  for (int64_t ih = 0; ih < g.h; ++ih) {
    for (int64_t iw = 0; iw < g.w; ++iw) {
      A sum = 0;
      launch::ForEachMaxWindowCovering(g, ih, iw, [&](int64_t o) {
        if (r.ind[o] == ih * g.w + iw) sum += A(1);
      });
      r.dx.push_back(sum);
    }
  }
  return r;
}

template <typename A>
PlaneResult AvgPoolLikeTheKernels(const launch::PoolGeometry& g, const std::vector<double>& x) {
  PlaneResult r;
  for (int64_t i = 0; i < g.oh; ++i) {
    for (int64_t j = 0; j < g.ow; ++j) {
      const launch::AvgWindow wh = launch::AvgWindowOf(i, g.sh, g.ph, g.kh, g.h);
      const launch::AvgWindow ww = launch::AvgWindowOf(j, g.sw, g.pw, g.kw, g.w);
      A s = 0;
      for (int64_t ih = wh.start; ih < wh.end; ++ih) {
        for (int64_t iw = ww.start; iw < ww.end; ++iw) s += static_cast<A>(x[ih * g.w + iw]);
      }
      const A div = launch::AvgDivisorOf<A>(g, wh, ww);
      r.y.push_back(div > A(0) ? s / div : A(0));
    }
  }
  for (int64_t ih = 0; ih < g.h; ++ih) {
    for (int64_t iw = 0; iw < g.w; ++iw) {
      A sum = 0;
      launch::ForEachAvgWindowCovering<A>(g, ih, iw, [&](int64_t, A div) { sum += A(1) / div; });
      r.dx.push_back(sum);
    }
  }
  return r;
}

launch::PoolGeometry GeometryOf(const ops::Pool2dParams& p, int64_t h, int64_t w, int64_t oh, int64_t ow) {
  launch::PoolGeometry g;
  g.planes = 1;
  g.h = h;
  g.w = w;
  g.oh = oh;
  g.ow = ow;
  g.kh = p.kernel_h;
  g.kw = p.kernel_w;
  g.sh = p.stride_h;
  g.sw = p.stride_w;
  g.ph = p.pad_h;
  g.pw = p.pad_w;
  g.dh = p.dilation_h;
  g.dw = p.dilation_w;
  g.count_include_pad = p.count_include_pad;
  return g;
}

// Runs `work` in a fresh child process with `seconds` to finish: the old
// arithmetic looped over 2^62 taps, which a plain call would never return
// from. threadsafe: the child re-runs this test alone instead of forking a
// process that holds other tests' threads.
void FinishesWithin(unsigned seconds, const std::function<void()>& work) {
  const std::string style = ::testing::GTEST_FLAG(death_test_style);
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  EXPECT_EXIT(
      {
        alarm(seconds);
        work();
        std::fprintf(stderr, "finished\n");
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "finished");
  ::testing::GTEST_FLAG(death_test_style) = style;
}

// Kernel 2^62 with padding 2^61 on a 4-row input passes every shape check
// (as in PyTorch). The gather looped over all 2^62 taps per input cell; the
// ranges make it finish at once, with the CPU kernels' values and indices.
TEST(CudaPoolMath, MaxPoolOfHugeWindowsFinishesWithTheCpuResults) {
  ops::Pool2dParams p;
  p.kernel_h = int64_t{1} << 62;
  p.kernel_w = 2;
  p.pad_h = p.kernel_h / 2;
  const launch::PoolGeometry g = GeometryOf(p, 4, 4, 5, 3);
  std::vector<double> x(16);
  for (int k = 0; k < 16; ++k) x[k] = k;
  FinishesWithin(20, [&] { (void)MaxPoolLikeTheKernels<float>(g, x); });
  // The same work in this process would not return either.
  ASSERT_FALSE(HasFailure()) << "the gather did not finish within 20 s";
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    const Tensor xt = FromVector(x, {1, 1, 4, 4}, {.dtype = dt});
    const Tensor y = Empty({1, 1, 5, 3}, {.dtype = dt}), ind = Empty({1, 1, 5, 3}, {.dtype = DType::kInt32});
    ops::cpu::MaxPool2dForward(xt, y, ind, p);
    const Tensor dx = Empty({1, 1, 4, 4}, {.dtype = dt});
    ops::cpu::MaxPool2dBackward(Ones({1, 1, 5, 3}, {.dtype = dt}), ind, dx, p);
    const PlaneResult r =
        dt == DType::kFloat32 ? MaxPoolLikeTheKernels<float>(g, x) : MaxPoolLikeTheKernels<double>(g, x);
    EXPECT_EQ(r.y, y.ToVector<double>()) << DTypeName(dt);
    EXPECT_EQ(r.ind, ind.ToVector<int32_t>()) << DTypeName(dt);
    EXPECT_EQ(r.dx, dx.ToVector<double>()) << DTypeName(dt);
    // Every window spans all four rows: its maximum is in the last one.
    EXPECT_EQ(r.y, (std::vector<double>{13, 14, 15, 13, 14, 15, 13, 14, 15, 13, 14, 15, 13, 14, 15})) << DTypeName(dt);
  }
}

// A stride far above the dilation: 2^40 taps lie between the two outputs
// that cover the cell, so a loop over the taps of the range (keeping those
// that divide by the stride) would take 2^40 steps; the outputs are walked
// instead.
TEST(CudaPoolMath, CoveringTapsOfAHugeStrideWalkTheOutputs) {
  const int64_t pad = int64_t{1} << 61, stride = int64_t{1} << 40, kernel = (int64_t{1} << 62) + 3;
  std::vector<std::pair<int64_t, int64_t>> visited;
  const auto gather = [&] {
    launch::ForEachTapCovering(0, pad, 1, stride, kernel, 2,
                               [&](int64_t k, int64_t o) { visited.push_back({k, o}); });
  };
  FinishesWithin(20, gather);
  ASSERT_FALSE(HasFailure()) << "the gather did not finish within 20 s";
  gather();
  // Tap k reaches cell 0 from output o when 2^61 - k == o * 2^40.
  EXPECT_EQ(visited, (std::vector<std::pair<int64_t, int64_t>>{{pad - stride, 1}, {pad, 0}}));
}

// Average pooling with kernel 2^62 x 2^62 and padding 2^61 on a 4x4 input:
// each padded length is 2^62, and their int64 product 2^124 wrapped to 0, so
// every output was 0 and the gather (which also looped over all 2^62 taps)
// would have dropped every window. As the CPU kernels: 16 / 2^124 forward
// and 25 / 2^124 per cell backward.
TEST(CudaPoolMath, AvgPoolOfHugeWindowsFinishesWithTheCpuResults) {
  ops::Pool2dParams p;
  p.kernel_h = p.kernel_w = int64_t{1} << 62;
  p.pad_h = p.pad_w = p.kernel_h / 2;
  const launch::PoolGeometry g = GeometryOf(p, 4, 4, 5, 5);
  const std::vector<double> x(16, 1.0);
  FinishesWithin(20, [&] { (void)AvgPoolLikeTheKernels<float>(g, x); });
  // The same work in this process would not return either.
  ASSERT_FALSE(HasFailure()) << "the gather did not finish within 20 s";
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    const Tensor xt = FromVector(x, {1, 1, 4, 4}, {.dtype = dt});
    const Tensor y = Empty({1, 1, 5, 5}, {.dtype = dt}), dx = Empty({1, 1, 4, 4}, {.dtype = dt});
    ops::cpu::AvgPool2dForward(xt, y, p);
    ops::cpu::AvgPool2dBackward(Ones({1, 1, 5, 5}, {.dtype = dt}), dx, p);
    const PlaneResult r =
        dt == DType::kFloat32 ? AvgPoolLikeTheKernels<float>(g, x) : AvgPoolLikeTheKernels<double>(g, x);
    EXPECT_EQ(r.y, y.ToVector<double>()) << DTypeName(dt);
    EXPECT_EQ(r.dx, dx.ToVector<double>()) << DTypeName(dt);
    EXPECT_EQ(r.y, std::vector<double>(25, std::ldexp(1.0, -120))) << DTypeName(dt);
    EXPECT_EQ(r.dx, std::vector<double>(16, 25 * std::ldexp(1.0, -124))) << DTypeName(dt);
  }
}

// ceil_mode, a 4-row input, kernel 2^63 - 3, padding 2^62 - 3, stride 2^62:
// the shape checks accept it and give two windows (kernels_test checks the
// output size). The second starts at row 3 and s + kernel (2^63) overflowed
// int64; the wrapped end emptied the window. Its end is the padded edge
// 4 + pad, so it holds row 3 and 2^62 - 2 padded rows. The first window
// covers rows 0..3.
TEST(CudaPoolMath, AverageWindowEndPastInt64IsClippedToThePadding) {
  const int64_t pad = (int64_t{1} << 62) - 3, kernel = 2 * pad + 3, stride = int64_t{1} << 62;
  const launch::AvgWindow w1 = launch::AvgWindowOf(1, stride, pad, kernel, 4);
  EXPECT_EQ(w1.start, 3);
  EXPECT_EQ(w1.end, 4);
  EXPECT_EQ(w1.padded, (int64_t{1} << 62) - 2);
  const launch::AvgWindow w0 = launch::AvgWindowOf(0, stride, pad, kernel, 4);
  EXPECT_EQ(w0.start, 0);
  EXPECT_EQ(w0.end, 4);
  EXPECT_EQ(w0.padded, kernel);
}

TEST(CudaFastDivide, QuotientsEqualHardwareDivision) {
  // Every divisor up to 4096, powers of two and their neighbours, and the
  // largest; numerators at the edges (0, d - 1, d, 2^31 - 1) and spread out.
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (int k = 1; k < 31; ++k) {
    for (uint32_t d : {(1u << k) - 1, 1u << k, (1u << k) + 1}) divisors.push_back(d);
  }
  divisors.push_back(0x7fffffffu);
  for (uint32_t d : divisors) {
    const launch::FastDivider div(d);
    std::vector<uint32_t> numerators = {0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, 0x7fffffffu, 0x7ffffffeu};
    for (uint32_t i = 0; i < 64; ++i) numerators.push_back(i * 0x2000003u % 0x80000000u);
    for (uint32_t n : numerators) {
      if (n > 0x7fffffffu) continue;
      ASSERT_EQ(div.Div(n), n / d) << n << " / " << d;
    }
  }
}

TEST(CudaFastDivide, ChannelOfElementsMatchesIndexArithmetic) {
  for (const auto& [n, c, s] : {std::tuple<int64_t, int64_t, int64_t>{256, 64, 1024}, {3, 7, 5}, {16, 2048, 1},
                                {1, 1, 1}, {5, 3, 4099}}) {
    const launch::ChannelOf32 fast{launch::FastDivider(static_cast<uint32_t>(s)),
                                   launch::FastDivider(static_cast<uint32_t>(c))};
    const launch::ChannelOf64 plain{s, c};
    const int64_t total = n * c * s;
    for (int64_t idx = 0; idx < total; idx += 1 + total / 100000) {
      ASSERT_EQ(fast(idx), plain(idx)) << idx << " in [" << n << ", " << c << ", " << s << "]";
      ASSERT_EQ(plain(idx), (idx / s) % c);
    }
    ASSERT_EQ(fast(total - 1), c - 1);
  }
}

TEST(CudaBatchNormSplit, PartsFillTheGpuWithoutTinyBlocks) {
  // ResNet-50 on CIFAR at batch 256: few long channels get many parts, the
  // 2048-channel layer one block per channel.
  EXPECT_EQ(launch::BatchNormSplitParts(256, 64, 1024), 16);
  EXPECT_EQ(launch::BatchNormSplitParts(256, 512, 256), 2);
  EXPECT_EQ(launch::BatchNormSplitParts(256, 2048, 16), 1);
  // The shapes batch_norm_test runs on a GPU.
  EXPECT_EQ(launch::BatchNormSplitParts(64, 3, 1024), 16);
  EXPECT_EQ(launch::BatchNormSplitParts(2048, 4, 9), 4);
  EXPECT_EQ(launch::BatchNormSplitParts(40000, 2, 1), 9);
  EXPECT_EQ(launch::BatchNormSplitParts(256, 5, 64), 4);
  // Small inputs, empty batches and huge ones stay within [1, 1024]; on the
  // row path (s >= 256) a part holds at least one row.
  EXPECT_EQ(launch::BatchNormSplitParts(8, 6, 20), 1);
  EXPECT_EQ(launch::BatchNormSplitParts(0, 6, 20), 1);
  EXPECT_EQ(launch::BatchNormSplitParts(4, 1, 1 << 20), 4);
  EXPECT_EQ(launch::BatchNormSplitParts(1 << 24, 1, 1), 1024);
}

// What one table of a multi-tensor launch held: (tensor, chunk) per block,
// tensors named by their index in the list packed.
struct PackedTable {
  std::vector<std::pair<int64_t, int64_t>> blocks;
  int tensors = 0;
};

// Packs tensors of these sizes with fake operand addresses that encode the
// tensor's index and the operand, checking each table as it is launched.
template <int kDepth>
std::vector<PackedTable> Pack(const std::vector<int64_t>& numels) {
  std::vector<launch::MultiTensorEntry> entries(numels.size());
  for (size_t k = 0; k < numels.size(); ++k) {
    entries[k].numel = numels[k];
    for (int d = 0; d < launch::kMultiTensorMaxOperands; ++d) {
      entries[k].operands[d] = reinterpret_cast<void*>(static_cast<uintptr_t>((k + 1) * 16 + d));
    }
  }
  std::vector<PackedTable> tables;
  const cudaError_t err = launch::ForEachMultiTensorTable<kDepth>(
      entries.data(), static_cast<int64_t>(entries.size()),
      [&](const launch::MultiTensorTable<kDepth>& table, int blocks) {
        EXPECT_GT(blocks, 0);
        EXPECT_LE(blocks, launch::kMultiTensorMaxBlocks);
        PackedTable packed;
        for (int b = 0; b < blocks; ++b) {
          const int t = table.block_tensor[b];
          EXPECT_LT(t, launch::MultiTensorMaxTensors(kDepth));
          packed.tensors = std::max(packed.tensors, t + 1);
          const uintptr_t address = reinterpret_cast<uintptr_t>(table.ptrs[0][t]);
          const int64_t k = static_cast<int64_t>(address / 16) - 1;
          for (int d = 0; d < kDepth; ++d) {
            EXPECT_EQ(reinterpret_cast<uintptr_t>(table.ptrs[d][t]), address + d) << "operand " << d;
          }
          EXPECT_EQ(table.numels[t], numels[k]);
          packed.blocks.emplace_back(k, table.block_chunk[b]);
        }
        tables.push_back(packed);
        return cudaSuccess;
      });
  EXPECT_EQ(err, cudaSuccess);
  return tables;
}

template <int kDepth>
void ExpectEveryChunkOnceWithinTheLimits(const std::vector<int64_t>& numels) {
  SCOPED_TRACE("depth " + std::to_string(kDepth));
  const std::vector<PackedTable> tables = Pack<kDepth>(numels);
  std::vector<std::pair<int64_t, int64_t>> got, want;
  for (size_t k = 0; k < numels.size(); ++k) {
    for (int64_t c = 0; c * launch::kMultiTensorChunk < numels[k]; ++c) want.emplace_back(k, c);
  }
  for (size_t i = 0; i < tables.size(); ++i) {
    got.insert(got.end(), tables[i].blocks.begin(), tables[i].blocks.end());
    // Every table but the last is full, of chunks or of tensors.
    if (i + 1 < tables.size()) {
      EXPECT_TRUE(static_cast<int>(tables[i].blocks.size()) == launch::kMultiTensorMaxBlocks ||
                  tables[i].tensors == launch::MultiTensorMaxTensors(kDepth))
          << "table " << i << ": " << tables[i].blocks.size() << " blocks, " << tables[i].tensors << " tensors";
    }
  }
  EXPECT_EQ(got, want);
}

TEST(CudaMultiTensor, TablesCoverEveryChunkOnceInOrderWithinTheLimits) {
  std::vector<int64_t> numels = {0, 1, launch::kMultiTensorChunk, launch::kMultiTensorChunk + 1, 0, 3};
  for (int i = 0; i < 300; ++i) numels.push_back(1 + (i * 7919) % 150000);
  numels.push_back(launch::kMultiTensorChunk * 700 + 5);  // spans three tables
  numels.push_back(17);
  numels.push_back(0);
  ExpectEveryChunkOnceWithinTheLimits<1>(numels);
  ExpectEveryChunkOnceWithinTheLimits<2>(numels);
  ExpectEveryChunkOnceWithinTheLimits<3>(numels);
  ExpectEveryChunkOnceWithinTheLimits<3>({});
  ExpectEveryChunkOnceWithinTheLimits<1>({0, 0});
}

TEST(CudaMultiTensor, LaunchCountsForFullTables) {
  // ResNet-50's 161 parameters, were they all small: 4 launches of 48 tensors with momentum, 2 of 110 without.
  EXPECT_EQ(Pack<3>(std::vector<int64_t>(161, 1000)).size(), 4u);
  EXPECT_EQ(Pack<1>(std::vector<int64_t>(161, 1000)).size(), 2u);
  // One tensor of 321 chunks: 320 in the first launch, 1 in the second.
  const std::vector<PackedTable> tables = Pack<1>({launch::kMultiTensorChunk * 320 + 1});
  ASSERT_EQ(tables.size(), 2u);
  EXPECT_EQ(tables[0].blocks.size(), 320u);
  EXPECT_EQ(tables[1].blocks, (std::vector<std::pair<int64_t, int64_t>>{{0, 320}}));
  EXPECT_EQ(Pack<2>({0, 0, 0}).size(), 0u);
}

TEST(CudaMultiTensor, StopsAtTheFirstFailedLaunch) {
  std::vector<launch::MultiTensorEntry> entries(200);
  for (auto& e : entries) e.numel = 10;
  int launches = 0;
  const cudaError_t err = launch::ForEachMultiTensorTable<3>(
      entries.data(), static_cast<int64_t>(entries.size()), [&](const launch::MultiTensorTable<3>&, int) {
        return ++launches == 2 ? cudaErrorInvalidValue : cudaSuccess;
      });
  EXPECT_EQ(err, cudaErrorInvalidValue);
  EXPECT_EQ(launches, 2);
}

TEST(CudaErrors, MessageNamesTheCallAndTheCudaError) {
  try {
    CheckCuda(cudaErrorInvalidValue, "cudaMemcpyAsync(host to device)");
    FAIL() << "expected an error";
  } catch (const CudaError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cudaMemcpyAsync(host to device) failed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cudaErrorInvalidValue"), std::string::npos) << msg;
    EXPECT_EQ(e.code(), static_cast<int>(cudaErrorInvalidValue));
  }
  try {
    CheckCublas(CUBLAS_STATUS_INVALID_VALUE, "cublasGemmEx");
    FAIL() << "expected an error";
  } catch (const CudaError& e) {
    EXPECT_NE(std::string(e.what()).find("CUBLAS_STATUS_INVALID_VALUE"), std::string::npos) << e.what();
  }
}

TEST(CudaErrors, AnErrorPendingBeforeALaunchIsNotBlamedOnIt) {
  EXPECT_NO_THROW(CheckNotFailedBefore(cudaSuccess, "kernel `unary`"));
  try {
    CheckNotFailedBefore(cudaErrorIllegalAddress, "kernel `unary`");
    FAIL() << "expected an error";
  } catch (const CudaError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("CUDA had already failed before kernel `unary`: "), std::string::npos) << msg;
    EXPECT_NE(msg.find("cudaErrorIllegalAddress"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("kernel `unary` failed"), std::string::npos) << msg;
    EXPECT_EQ(e.code(), static_cast<int>(cudaErrorIllegalAddress));
  }
}

// Misuse is reported before any CUDA call, so these run without a GPU. The
// tensors wrap a host buffer labelled as device memory; it is never read.
class CudaMisuseTest : public ::testing::Test {
 protected:
  Tensor On(int device, const Shape& shape, DType dt = DType::kFloat32) {
    return Tensor::FromBlob(buffer_.data(), shape, dt, Device(DeviceType::kCUDA, device));
  }
  static void ExpectMessage(const std::function<void()>& fn, const std::string& part) {
    try {
      fn();
      ADD_FAILURE() << "expected an error containing `" << part << "`";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
  std::vector<double> buffer_ = std::vector<double>(64);
};

TEST_F(CudaMisuseTest, CopyBetweenTwoDevicesIsNotAStridedCopy) {
  ExpectMessage([&] { CopyStrided(On(0, {4}), On(1, {4})); }, "cuda:1 and destination on cuda:0");
}

TEST_F(CudaMisuseTest, KernelsNameOperandsOnDifferentDevices) {
  Init();
  const ops::KernelTable& t = ops::KernelsFor(DeviceType::kCUDA);
  ExpectMessage([&] { t.binary(ops::BinaryOp::kAdd, On(0, {4}), On(1, {4}), On(0, {4})); }, "cuda:0 and cuda:1");
  ExpectMessage([&] { t.unary(ops::UnaryOp::kRelu, On(0, {4}), On(0, {4}, DType::kFloat64)); }, "f32 and f64");
  ExpectMessage([&] { t.sum_to(On(0, {3, 4}), On(0, {2, 4}), 1.0); }, "cannot sum shape [3, 4] to [2, 4]");
  ExpectMessage([&] { t.argmax(On(0, {3, 4}), 1, On(0, {3})); }, "out must be i64");
}

// All named before the targets are copied to the host for the range check.
TEST_F(CudaMisuseTest, NllLossNamesOperandsThatDoNotFit) {
  Init();
  const ops::KernelTable& t = ops::KernelsFor(DeviceType::kCUDA);
  const Tensor lp = On(0, {3, 5}), target = On(0, {3}, DType::kInt64), loss = On(0, {3});
  ExpectMessage([&] { t.nll_loss_forward(lp, On(1, {3}, DType::kInt64), Tensor(), -100, loss); }, "cuda:0 and cuda:1");
  ExpectMessage([&] { t.nll_loss_forward(lp, On(0, {3}), Tensor(), -100, loss); }, "target must be i64, got f32");
  ExpectMessage([&] { t.nll_loss_forward(On(0, {3, 5}, DType::kInt64), target, Tensor(), -100, loss); },
                "needs a floating dtype, got i64");
  ExpectMessage([&] { t.nll_loss_forward(lp, On(0, {4}, DType::kInt64), Tensor(), -100, loss); },
                "log_probs [3, 5], target [4] do not fit [N, C, d...], [N, d...]");
  ExpectMessage([&] { t.nll_loss_forward(On(0, {3}), target, Tensor(), -100, loss); }, "log_probs [3], target [3]");
  ExpectMessage([&] { t.nll_loss_forward(On(0, {3, 5, 2}), target, Tensor(), -100, loss); },
                "log_probs [3, 5, 2], target [3]");
  ExpectMessage([&] { t.nll_loss_forward(lp, target, On(0, {4}), -100, loss); },
                "weight of shape [4] does not match 5 classes (expected [5])");
  ExpectMessage([&] { t.nll_loss_forward(lp, target, On(0, {5}, DType::kInt64), -100, loss); },
                "needs a floating dtype, got i64");
  ExpectMessage([&] { t.nll_loss_forward(lp, target, Tensor(), -100, On(0, {2})); },
                "loss of shape [2] for 3 elements of target [3]");
  ExpectMessage([&] { t.nll_loss_backward(target, Tensor(), On(0, {2}), -100, On(0, {3, 5})); },
                "grad_loss of shape [2] for 3 elements of target [3]");
  ExpectMessage([&] { t.nll_loss_backward(target, Tensor(), On(0, {3}), -100, On(0, {3, 5}, DType::kInt64)); },
                "needs a floating dtype, got i64");
  ExpectMessage([&] { t.nll_loss_backward(On(0, {3, 2}, DType::kInt64), Tensor(), On(0, {3}), -100, On(0, {3, 5})); },
                "dlog_probs [3, 5], target [3, 2] do not fit");
}

TEST_F(CudaMisuseTest, GemmNamesShapesThatDoNotChain) {
  ExpectMessage([&] { Gemm(On(0, {2, 3}), On(0, {4, 5}), On(0, {2, 5}), 1.0, 0.0); }, "[2, 3] @ [4, 5] -> [2, 5]");
  ExpectMessage([&] { Gemm(On(0, {2, 3}), On(1, {3, 5}), On(0, {2, 5}), 1.0, 0.0); }, "cuda:1");
}

TEST_F(CudaMisuseTest, OptimizerStepsNameMismatchedState) {
  ExpectMessage([&] { SgdStep(On(0, {4}), On(0, {5}), Tensor(), {}); }, "grad [5]");
  ExpectMessage([&] { SgdStep(On(0, {4}), On(0, {4}), Tensor(), {.step = 0}); }, "step counts from 1");
  ExpectMessage([&] { SgdStep(On(0, {4}), On(0, {4}), Tensor(), {.momentum = 0.9}); }, "momentum_buffer");
  ExpectMessage([&] { AdamStep(On(0, {4}), On(0, {4}), On(0, {4}), On(0, {3}), Tensor(), {}); }, "exp_avg_sq [3]");
  ExpectMessage([&] { UnscaleAndCheck({On(0, {4})}, 0.5, On(0, {1}, DType::kFloat64)); }, "one-element f32");
  // Every tensor is checked before the first launch: nothing is queued here.
  ExpectMessage([&] { UnscaleAndCheck({On(0, {4}), Tensor(), On(1, {4})}, 0.5, On(0, {1})); },
                "tensor 2 ([4] f32 on cuda:1)");
  ExpectMessage([&] { UnscaleAndCheck({On(0, {4}), On(0, {4}, DType::kInt64)}, 0.5, On(0, {1})); },
                "must be a contiguous floating tensor on cuda:0");
  ExpectMessage([&] { SgdStepMulti({On(0, {4})}, {On(0, {4}), On(0, {4})}, {Tensor()}, {}); },
                "1 parameters, 2 gradients and 1 momentum buffers");
  ExpectMessage([&] { SgdStepMulti({On(0, {4}), On(1, {4})}, {On(0, {4}), On(1, {4})}, {Tensor(), Tensor()}, {}); },
                "parameter 1 is on cuda:1, parameter 0 on cuda:0");
  ExpectMessage([&] { SgdStepMulti({On(0, {4}), On(0, {4})}, {On(0, {4}), On(0, {5})}, {Tensor(), Tensor()}, {}); },
                "parameter 1: grad [5]");
  ExpectMessage(
      [&] { SgdStepMulti({On(0, {4})}, {On(0, {4})}, {Tensor()}, {.momentum = 0.9}); }, "parameter 0: momentum_buffer");
  ExpectMessage([&] { SgdStepMulti({On(0, {4})}, {On(0, {4})}, {Tensor()}, {.step = 0}); }, "step counts from 1");
  ExpectMessage([&] { SgdStepMulti({On(0, {4}, DType::kFloat16)}, {On(0, {4}, DType::kFloat16)}, {Tensor()}, {}); },
                "contiguous f32 or f64 CUDA tensor");
  ExpectMessage([&] { AdadeltaStep(On(0, {4}), On(0, {4}), On(0, {4}), On(0, {2, 2}), {}); }, "acc_delta [2, 2]");
  ExpectMessage([&] { AdadeltaStep(On(0, {4}), On(0, {4}), On(0, {4}, DType::kFloat64), On(0, {4}), {}); },
                "square_avg [4] f64");
  ExpectMessage([&] { AdadeltaStep(On(0, {4}, DType::kInt64), On(0, {4}), On(0, {4}), On(0, {4}), {}); },
                "contiguous f32 or f64 CUDA tensor");
  ExpectMessage([&] { RmspropStep(On(0, {4}), On(0, {4}), On(0, {4}), Tensor(), Tensor(), {.centered = true}); },
                "RmspropStep: grad_avg is undefined");
  ExpectMessage([&] { RmspropStep(On(0, {4}), On(0, {4}), On(0, {4}), Tensor(), Tensor(), {.momentum = 0.9}); },
                "RmspropStep: momentum_buffer is undefined");
  ExpectMessage([&] { RmspropStep(On(0, {4}), On(0, {4}), On(1, {4}), Tensor(), Tensor(), {}); },
                "square_avg [4] f32 on cuda:1");
  ExpectMessage([&] { AdagradStep(On(0, {4}), On(0, {4}), On(0, {2, 2}), {}); }, "AdagradStep: sum [2, 2]");
  // The refusal of a parameter says what it is.
  ExpectMessage([&] { AdagradStep(On(0, {4}, DType::kInt64), On(0, {4}), On(0, {4}), {}); },
                "AdagradStep: the parameter [4] " + std::string(DTypeName(DType::kInt64)) +
                    " on cuda:0 must be a contiguous f32 or f64 CUDA tensor");
  ExpectMessage([&] { MaxAbs({On(0, {4})}, On(0, {1})); }, "one-element f64");
  ExpectMessage([&] { MaxAbs({On(0, {4}), On(1, {4})}, On(0, {1}, DType::kFloat64)); }, "tensor 1 ([4] f32 on cuda:1)");
  ExpectMessage([&] { MaxAbs({On(0, {4}, DType::kInt64)}, On(0, {1}, DType::kFloat64)); }, "floating tensor on cuda:0");
}

TEST(CudaStream, TimeoutMustBePositive) {
  EXPECT_THROW(SetWaitTimeout(std::chrono::milliseconds(0)), std::invalid_argument);
}

TEST(CudaStream, HandlesNotMadeByStreamHaveTaggedIdsThatStayAlive) {
  // No CUDA call: neither the lookup nor the guard touches the driver.
  const Device gpu(DeviceType::kCUDA, 0);
  const uint64_t legacy = StreamId(cudaStreamLegacy);
  EXPECT_EQ(CurrentStreamId(gpu), legacy);
  EXPECT_NE(legacy >> 63, 0u) << "an id from the handle value carries the top bit; Stream ids never do";
  EXPECT_TRUE(StreamAlive(legacy));
  const cudaStream_t other = reinterpret_cast<cudaStream_t>(uintptr_t{0x1000});
  EXPECT_NE(StreamId(other), legacy);
  {
    StreamGuard guard(gpu, other);
    EXPECT_EQ(CurrentStream(gpu), other);
    EXPECT_EQ(CurrentStreamId(gpu), StreamId(other));
  }
  EXPECT_EQ(CurrentStream(gpu), cudaStreamLegacy);
  EXPECT_EQ(CurrentStreamId(gpu), legacy);
}

TEST(CudaInit, RegistersBackendAndKernelsWithoutTouchingTheDevice) {
  // On a machine without a GPU (where this test also runs), Init() succeeds:
  // it registers and touches no device.
  Init();
  Init();  // idempotent
  EXPECT_TRUE(HasDeviceBackend(DeviceType::kCUDA));
  EXPECT_EQ(GetDeviceBackend(Device(DeviceType::kCUDA, 0)).allocator, &CudaAllocator());
  EXPECT_EQ(GetDeviceBackend(Device(DeviceType::kCUDA, 0)).fill, &Fill);
  // nn/optim reaches the fused device updates through its registry.
  const optim::DeviceOptimKernels& k = optim::DeviceOptimKernelsFor(DeviceType::kCUDA);
  EXPECT_NE(k.sgd_step, nullptr);
  EXPECT_NE(k.adam_step, nullptr);
  EXPECT_EQ(k.unscale_and_check, &UnscaleAndCheck);
  EXPECT_EQ(k.adadelta_step, &AdadeltaStep);
  EXPECT_EQ(k.max_abs, &MaxAbs);
  EXPECT_EQ(k.sgd_step_multi, &SgdStepMulti);
  EXPECT_EQ(k.rmsprop_step, &RmspropStep);
  EXPECT_EQ(k.adagrad_step, &AdagradStep);
  EXPECT_TRUE(optim::internal::UsesDevicePath(Device(DeviceType::kCUDA, 0)));
  EXPECT_FALSE(optim::internal::UsesDevicePath(kCPU));
}

TEST(CudaInit, EveryKernelOfTheTableHasACudaPath) {
  Init();
  const ops::KernelTable& t = ops::KernelsFor(DeviceType::kCUDA);
  const std::pair<const char*, const void*> entries[] = {
      {"unary", reinterpret_cast<const void*>(t.unary)},
      {"unary_backward", reinterpret_cast<const void*>(t.unary_backward)},
      {"binary", reinterpret_cast<const void*>(t.binary)},
      {"clamp", reinterpret_cast<const void*>(t.clamp)},
      {"clamp_backward", reinterpret_cast<const void*>(t.clamp_backward)},
      {"affine", reinterpret_cast<const void*>(t.affine)},
      {"div_scalar", reinterpret_cast<const void*>(t.div_scalar)},
      {"add_scaled_", reinterpret_cast<const void*>(t.add_scaled_)},
      {"masked_scale", reinterpret_cast<const void*>(t.masked_scale)},
      {"bernoulli_mask", reinterpret_cast<const void*>(t.bernoulli_mask)},
      {"sum_to", reinterpret_cast<const void*>(t.sum_to)},
      {"argmax", reinterpret_cast<const void*>(t.argmax)},
      {"gemm", reinterpret_cast<const void*>(t.gemm)},
      {"conv2d_forward", reinterpret_cast<const void*>(t.conv2d_forward)},
      {"conv2d_backward", reinterpret_cast<const void*>(t.conv2d_backward)},
      {"max_pool2d_forward", reinterpret_cast<const void*>(t.max_pool2d_forward)},
      {"max_pool2d_backward", reinterpret_cast<const void*>(t.max_pool2d_backward)},
      {"avg_pool2d_forward", reinterpret_cast<const void*>(t.avg_pool2d_forward)},
      {"avg_pool2d_backward", reinterpret_cast<const void*>(t.avg_pool2d_backward)},
      {"adaptive_avg_pool2d_forward", reinterpret_cast<const void*>(t.adaptive_avg_pool2d_forward)},
      {"adaptive_avg_pool2d_backward", reinterpret_cast<const void*>(t.adaptive_avg_pool2d_backward)},
      {"batch_norm_forward", reinterpret_cast<const void*>(t.batch_norm_forward)},
      {"batch_norm_saved_dtype", reinterpret_cast<const void*>(t.batch_norm_saved_dtype)},
      {"batch_norm_backward", reinterpret_cast<const void*>(t.batch_norm_backward)},
      {"batch_norm_stats", reinterpret_cast<const void*>(t.batch_norm_stats)},
      {"batch_norm_elementwise", reinterpret_cast<const void*>(t.batch_norm_elementwise)},
      {"batch_norm_backward_reduce", reinterpret_cast<const void*>(t.batch_norm_backward_reduce)},
      {"batch_norm_backward_elementwise", reinterpret_cast<const void*>(t.batch_norm_backward_elementwise)},
      {"log_softmax_forward", reinterpret_cast<const void*>(t.log_softmax_forward)},
      {"log_softmax_backward", reinterpret_cast<const void*>(t.log_softmax_backward)},
      {"cross_entropy_forward", reinterpret_cast<const void*>(t.cross_entropy_forward)},
      {"cross_entropy_backward", reinterpret_cast<const void*>(t.cross_entropy_backward)},
      {"nll_loss_forward", reinterpret_cast<const void*>(t.nll_loss_forward)},
      {"nll_loss_backward", reinterpret_cast<const void*>(t.nll_loss_backward)},
  };
  // The table has exactly these entries (a new one must be added here and to
  // CudaKernelTable).
  static_assert(sizeof(ops::KernelTable) == 34 * sizeof(void*));
  for (const auto& [name, fn] : entries) EXPECT_NE(fn, nullptr) << name;
}

// DDP_NN_CUDA_CACHE, DDP_NN_CUDA_TF32 and DDP_NN_CUDA_TIMEOUT_S take the
// spellings DDP_NN_CPU_CACHE takes and warn on others: TF32=True left TF32
// off, TIMEOUT_S=12abc gave 12 s and CACHE=maybe kept caching, all without a
// word. TF32 and the timeout are read when the library loads, so each case
// runs in a fresh process (a threadsafe death test re-executes this binary
// with the environment set here).
TEST(CudaEnvironment, SettingsTakeTheCpuSpellingsAndWarnOnOthers) {
  const std::string style = ::testing::GTEST_FLAG(death_test_style);
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  ::setenv("DDP_NN_CUDA_TF32", "True", 1);
  ::setenv("DDP_NN_CUDA_TIMEOUT_S", "12abc", 1);
  ::setenv("DDP_NN_CUDA_CACHE", "maybe", 1);
  const auto settings = [] {
    CachingCudaAllocator allocator;  // reads DDP_NN_CUDA_CACHE
    std::fprintf(stderr, "tf32 %d timeout_ms %lld\n", AllowTf32() ? 1 : 0,
                 static_cast<long long>(WaitTimeout().count()));
    std::_Exit(0);
  };
  EXPECT_EXIT(settings(), ::testing::ExitedWithCode(0), "tf32 1 timeout_ms 600000");
  EXPECT_EXIT(settings(), ::testing::ExitedWithCode(0),
              "DDP_NN_CUDA_TIMEOUT_S=12abc is not a whole number of seconds in \\[1, 31536000\\]; keeping 600 s");
  EXPECT_EXIT(settings(), ::testing::ExitedWithCode(0),
              "DDP_NN_CUDA_CACHE=maybe is neither on \\(1, on, true, yes\\) nor off \\(0, off, false, no, none\\); "
              "keeping the CUDA allocator's default \\(caching\\)");
  ::setenv("DDP_NN_CUDA_TF32", "maybe", 1);
  ::setenv("DDP_NN_CUDA_TIMEOUT_S", "30", 1);
  EXPECT_EXIT(settings(), ::testing::ExitedWithCode(0), "tf32 0 timeout_ms 30000");
  EXPECT_EXIT(settings(), ::testing::ExitedWithCode(0),
              "DDP_NN_CUDA_TF32=maybe is neither on \\(1, on, true, yes\\) nor off \\(0, off, false, no, none\\); "
              "keeping TF32 off");
  ::unsetenv("DDP_NN_CUDA_TF32");
  ::unsetenv("DDP_NN_CUDA_TIMEOUT_S");
  ::unsetenv("DDP_NN_CUDA_CACHE");
  ::testing::GTEST_FLAG(death_test_style) = style;
}

}  // namespace
}  // namespace ddp::nn::cuda
