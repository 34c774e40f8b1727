// conv2d through oneDNN. Shapes as in conv.cc; weights with groups are
// [G, O/G, C/G, KH, KW] to oneDNN, which is the same memory as OIHW.
#include "nn/ops/cpu/conv_onednn.h"

#include <array>
#include <cstdint>
#include <dnnl.hpp>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>

#include "nn/ops/cpu/cpu_kernels.h"

namespace ddp::nn::ops::cpu::onednn {

namespace {

using dnnl::memory;
using Key = std::array<int64_t, 15>;

dnnl::engine& Engine() {
  static dnnl::engine* eng = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *eng;
}

dnnl::stream& Stream() {
  thread_local dnnl::stream s(Engine());
  return s;
}

// Moves data between a plain (NCHW/OIHW/x) user buffer and the layout a
// primitive wants; the reorder primitive is built once.
class Reorder {
 public:
  void Run(const memory& from, const memory& to) {
    if (!prim_) prim_.emplace(from, to);
    prim_->execute(Stream(), const_cast<memory&>(from), const_cast<memory&>(to));
  }

 private:
  std::optional<dnnl::reorder> prim_;
};

struct Entry {
  bool supported = true;  // false when oneDNN declined the geometry
  memory::desc x_user, w_user, y_user, b_user;
  std::optional<dnnl::convolution_forward::primitive_desc> fwd_pd;
  std::optional<dnnl::convolution_forward> fwd;
  std::optional<dnnl::convolution_backward_data::primitive_desc> bwd_data_pd;
  std::optional<dnnl::convolution_backward_data> bwd_data;
  std::optional<dnnl::convolution_backward_weights::primitive_desc> bwd_w_pd;
  std::optional<dnnl::convolution_backward_weights> bwd_w;
  Reorder fx, fw, fy, bdy, bw, bdx, wx, wdy, wdw;
  std::mutex mu;  // one execution at a time per shape: reorders are shared
};

Key MakeKey(const Tensor& x, const Tensor& w, bool bias, const Conv2dParams& p) {
  return {x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3), p.stride_h, p.stride_w,
          p.pad_h,   p.pad_w,   p.dilation_h, p.dilation_w, p.groups, bias ? 1 : 0};
}

// Entries are shared: one evicted while another thread runs it lives on
// until that run ends.
struct Cached {
  std::shared_ptr<Entry> entry;
  uint64_t last_use = 0;
};
std::mutex g_cache_mu;
uint64_t g_cache_clock = 0;  // under g_cache_mu
std::map<Key, Cached>& Cache() {
  static auto* cache = new std::map<Key, Cached>();
  return *cache;
}

memory::dims WeightDims(const Tensor& w, int64_t groups) {
  if (groups == 1) return {w.size(0), w.size(1), w.size(2), w.size(3)};
  return {groups, w.size(0) / groups, w.size(1), w.size(2), w.size(3)};
}

void Build(Entry* e, const Tensor& x, const Tensor& w, bool bias, const Conv2dParams& p, const Shape& y_shape);

// The cached primitives for this geometry, or null when oneDNN has no
// implementation for it. A new geometry past kOneDnnConvCacheEntries
// evicts the least recently used one.
std::shared_ptr<Entry> GetEntry(const Tensor& x, const Tensor& w, bool bias, const Conv2dParams& p,
                                const Shape& y_shape) {
  const Key key = MakeKey(x, w, bias, p);
  std::lock_guard<std::mutex> lock(g_cache_mu);
  std::map<Key, Cached>& cache = Cache();
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (static_cast<int64_t>(cache.size()) >= kOneDnnConvCacheEntries) {
      auto oldest = cache.begin();
      for (auto c = cache.begin(); c != cache.end(); ++c) {
        if (c->second.last_use < oldest->second.last_use) oldest = c;
      }
      cache.erase(oldest);
    }
    auto entry = std::make_shared<Entry>();
    try {
      Build(entry.get(), x, w, bias, p, y_shape);
    } catch (const dnnl::error&) {
      entry->supported = false;
    }
    it = cache.emplace(key, Cached{std::move(entry), 0}).first;
  }
  it->second.last_use = ++g_cache_clock;
  return it->second.entry->supported ? it->second.entry : nullptr;
}

void Build(Entry* e, const Tensor& x, const Tensor& w, bool bias, const Conv2dParams& p, const Shape& y_shape) {
  const auto f32 = memory::data_type::f32;
  const memory::dims xd = {x.size(0), x.size(1), x.size(2), x.size(3)};
  const memory::dims yd = {y_shape[0], y_shape[1], y_shape[2], y_shape[3]};
  const memory::dims wd = WeightDims(w, p.groups);
  e->x_user = memory::desc(xd, f32, memory::format_tag::nchw);
  e->y_user = memory::desc(yd, f32, memory::format_tag::nchw);
  e->w_user = memory::desc(wd, f32, p.groups == 1 ? memory::format_tag::oihw : memory::format_tag::goihw);
  e->b_user = memory::desc({w.size(0)}, f32, memory::format_tag::x);
  const memory::desc xa(xd, f32, memory::format_tag::any), ya(yd, f32, memory::format_tag::any),
      wa(wd, f32, memory::format_tag::any);
  const memory::dims strides = {p.stride_h, p.stride_w};
  const memory::dims dilates = {p.dilation_h - 1, p.dilation_w - 1};  // oneDNN counts extra gaps
  const memory::dims pad = {p.pad_h, p.pad_w};
  const auto algo = dnnl::algorithm::convolution_direct;
  auto fwd_desc = bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, algo, xa, wa,
                                                          e->b_user, ya, strides, dilates, pad, pad)
                       : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, algo, xa, wa, ya,
                                                          strides, dilates, pad, pad);
  e->fwd_pd.emplace(fwd_desc, Engine());
  e->fwd.emplace(*e->fwd_pd);
  dnnl::convolution_backward_data::desc bd(algo, xa, wa, ya, strides, dilates, pad, pad);
  e->bwd_data_pd.emplace(bd, Engine(), *e->fwd_pd);
  e->bwd_data.emplace(*e->bwd_data_pd);
  auto bwd_w_desc = bias ? dnnl::convolution_backward_weights::desc(algo, xa, wa, e->b_user, ya, strides, dilates,
                                                                    pad, pad)
                         : dnnl::convolution_backward_weights::desc(algo, xa, wa, ya, strides, dilates, pad, pad);
  e->bwd_w_pd.emplace(bwd_w_desc, Engine(), *e->fwd_pd);
  e->bwd_w.emplace(*e->bwd_w_pd);
}

// A buffer for a primitive-side layout, from the caching allocator.
Tensor Buffer(const memory::desc& d) {
  return Empty({static_cast<int64_t>(d.get_size())}, {.dtype = DType::kUInt8});
}

// The memory a primitive reads: the user's buffer when the layouts agree,
// otherwise a reordered copy held by `hold`.
memory Input(const memory::desc& user, const memory::desc& want, void* data, Reorder& r, Tensor* hold) {
  memory u(user, Engine(), data);
  if (user == want) return u;
  *hold = Buffer(want);
  memory m(want, Engine(), hold->data_ptr());
  r.Run(u, m);
  return m;
}

// The memory a primitive writes; Finish copies it to the user's buffer.
memory Output(const memory::desc& user, const memory::desc& want, void* data, Tensor* hold) {
  if (user == want) return memory(user, Engine(), data);
  *hold = Buffer(want);
  return memory(want, Engine(), hold->data_ptr());
}

void Finish(const memory& produced, const memory::desc& user, void* data, Reorder& r) {
  if (produced.get_desc() == user) return;
  memory u(user, Engine(), data);
  r.Run(produced, u);
}

// Pointer to a contiguous f32 view of t (a copy in *hold when needed).
float* Plain(const Tensor& t, Tensor* hold) {
  *hold = AsFloat32(t);
  return hold->data<float>();
}

// An output tensor's writable f32 buffer (a temporary when it is not contiguous f32).
// Output bytes computed per oneDNN forward call (see Conv2dForward).
constexpr int64_t kForwardChunkBytes = int64_t{16} << 20;

Tensor OutBuffer(const Tensor& t) {
  if (t.dtype() == DType::kFloat32 && t.is_contiguous()) return t;
  return Empty(t.shape());
}

void WriteBack(const Tensor& dst, const Tensor& buf) {
  if (buf.is_same(dst)) return;
  NoGradGuard guard;
  dst.CopyFrom(buf);
}

}  // namespace

bool Conv2dForwardWhole(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y,
                        const Conv2dParams& p);

// Measured on the 2-core Xeon with the peers' CNN (batch 64, per step, f32):
//   conv 1->32 on 28x28: im2col fwd 2.0 ms, bwd 3.4-3.8 ms; oneDNN 1.5 / 1.7 ms
//   conv 32->64 on 13x13: im2col fwd 4.2-7.8 ms, bwd 9-17 ms; oneDNN 3.1-3.6 / 6.1-7.2 ms
// so f32 convolutions go to oneDNN; other dtypes, and geometries oneDNN
// declines, use im2col.
bool ShouldUse(const Tensor& x, const Tensor& w, const Conv2dParams& p, ConvAlgorithm algorithm) {
  (void)x;
  (void)w;
  (void)p;
  return algorithm != ConvAlgorithm::kIm2col;
}

bool Conv2dForward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const Conv2dParams& p) {
  // A large output is computed a slice of the batch at a time: the primitive
  // writes its own layout, which is then reordered into y, so an unsliced
  // call holds two copies of the output at once (173 MB for the CNN's first
  // layer on an evaluation batch of 1000).
  const int64_t n = x.size(0);
  const int64_t per_image = y.numel() / std::max<int64_t>(n, 1) * static_cast<int64_t>(sizeof(float));
  const int64_t chunk = std::max<int64_t>(1, kForwardChunkBytes / std::max<int64_t>(per_image, 1));
  if (n > chunk && x.is_contiguous() && y.is_contiguous()) {
    for (int64_t n0 = 0; n0 < n; n0 += chunk) {
      const int64_t cnt = std::min(chunk, n - n0);
      if (!Conv2dForwardWhole(x.Detach().Narrow(0, n0, cnt), w, bias, y.Detach().Narrow(0, n0, cnt), p)) return false;
    }
    return true;
  }
  return Conv2dForwardWhole(x, w, bias, y, p);
}

bool Conv2dForwardWhole(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y,
                        const Conv2dParams& p) {
  EnsureThreadSettings();
  const std::shared_ptr<Entry> entry = GetEntry(x, w, bias.defined(), p, y.shape());
  if (entry == nullptr) return false;
  Entry& e = *entry;
  std::lock_guard<std::mutex> lock(e.mu);
  Tensor xh, wh, bh, xr, wr, yr;
  memory xm = Input(e.x_user, e.fwd_pd->src_desc(), Plain(x, &xh), e.fx, &xr);
  memory wm = Input(e.w_user, e.fwd_pd->weights_desc(), Plain(w, &wh), e.fw, &wr);
  Tensor yb = OutBuffer(y);
  memory ym = Output(e.y_user, e.fwd_pd->dst_desc(), yb.data_ptr(), &yr);
  std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}};
  if (bias.defined()) args[DNNL_ARG_BIAS] = memory(e.b_user, Engine(), Plain(bias, &bh));
  e.fwd->execute(Stream(), args);
  Finish(ym, e.y_user, yb.data_ptr(), e.fy);
  Stream().wait();
  WriteBack(y, yb);
  return true;
}

bool Conv2dBackward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                    const Tensor& db, const Conv2dParams& p) {
  EnsureThreadSettings();
  const std::shared_ptr<Entry> entry = GetEntry(x, w, db.defined(), p, dy.shape());
  if (entry == nullptr) return false;
  Entry& e = *entry;
  std::lock_guard<std::mutex> lock(e.mu);
  Tensor dyh, xh, wh;
  float* dyp = Plain(dy, &dyh);
  if (dx.defined()) {
    Tensor dyr, wr, dxr;
    memory dym = Input(e.y_user, e.bwd_data_pd->diff_dst_desc(), dyp, e.bdy, &dyr);
    memory wm = Input(e.w_user, e.bwd_data_pd->weights_desc(), Plain(w, &wh), e.bw, &wr);
    Tensor dxb = OutBuffer(dx);
    memory dxm = Output(e.x_user, e.bwd_data_pd->diff_src_desc(), dxb.data_ptr(), &dxr);
    e.bwd_data->execute(Stream(), {{DNNL_ARG_DIFF_DST, dym}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DIFF_SRC, dxm}});
    Finish(dxm, e.x_user, dxb.data_ptr(), e.bdx);
    Stream().wait();
    WriteBack(dx, dxb);
  }
  if (dw.defined() || db.defined()) {
    Tensor xr, dyr, dwr;
    memory xm = Input(e.x_user, e.bwd_w_pd->src_desc(), Plain(x, &xh), e.wx, &xr);
    memory dym = Input(e.y_user, e.bwd_w_pd->diff_dst_desc(), dyp, e.wdy, &dyr);
    Tensor dwb = dw.defined() ? OutBuffer(dw) : Empty(w.shape());
    memory dwm = Output(e.w_user, e.bwd_w_pd->diff_weights_desc(), dwb.data_ptr(), &dwr);
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, xm}, {DNNL_ARG_DIFF_DST, dym}, {DNNL_ARG_DIFF_WEIGHTS, dwm}};
    Tensor dbb;
    if (db.defined()) {
      dbb = OutBuffer(db);
      args[DNNL_ARG_DIFF_BIAS] = memory(e.b_user, Engine(), dbb.data_ptr());
    }
    e.bwd_w->execute(Stream(), args);
    Finish(dwm, e.w_user, dwb.data_ptr(), e.wdw);
    Stream().wait();
    if (dw.defined()) WriteBack(dw, dwb);
    if (db.defined()) WriteBack(db, dbb);
  }
  return true;
}

}  // namespace ddp::nn::ops::cpu::onednn

namespace ddp::nn::ops {

int64_t OneDnnConvCacheSize() {
  std::lock_guard<std::mutex> lock(cpu::onednn::g_cache_mu);
  return static_cast<int64_t>(cpu::onednn::Cache().size());
}

}  // namespace ddp::nn::ops
