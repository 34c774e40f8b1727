#include "nn/tensor/tensor.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include "nn/tensor/strided_loop.h"

namespace ddp::nn {

// ---------------------------------------------------------------- shapes

std::string ShapeToString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

namespace {

// Sizes whose element or byte count leaves int64 would wrap around and
// describe a much smaller buffer than the shape claims; they are refused,
// as PyTorch refuses them.
[[noreturn]] void ThrowSizeOverflow(const std::string& what, const Shape& shape) {
  throw std::invalid_argument(what + ": storage size calculation overflowed for shape " + ShapeToString(shape) +
                              " (more than 2^63 - 1)");
}

int64_t CountElements(const Shape& shape, const char* what) {
  int64_t n = 1;
  for (int64_t s : shape) {
    if (__builtin_mul_overflow(n, s, &n)) ThrowSizeOverflow(what, shape);
  }
  return n;
}

}  // namespace

int64_t NumElements(const Shape& shape) { return CountElements(shape, "numel"); }

Shape ContiguousStrides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    // Zero sizes count as one here, so an empty shape can overflow too.
    if (i > 0 && __builtin_mul_overflow(s, std::max<int64_t>(shape[i], 1), &s)) {
      ThrowSizeOverflow("strides", shape);
    }
  }
  return strides;
}

Shape BroadcastShapes(const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1) {
      throw std::invalid_argument("shapes " + ShapeToString(a) + " and " + ShapeToString(b) +
                                  " cannot be broadcast together (dimension " +
                                  std::to_string(i) + ": " + std::to_string(da) + " vs " +
                                  std::to_string(db) + ")");
    }
    out[i] = da == 1 ? db : da;
  }
  return out;
}

namespace detail {
void CheckVectorSize(size_t count, const Shape& shape) {
  if (static_cast<int64_t>(count) != NumElements(shape)) {
    throw std::invalid_argument("FromVector: " + std::to_string(count) +
                                " values cannot fill shape " + ShapeToString(shape) + " (" +
                                std::to_string(NumElements(shape)) + " elements)");
  }
}
}  // namespace detail

namespace {

void CheckShape(const Shape& shape, const char* what) {
  for (int64_t s : shape) {
    if (s < 0) {
      throw std::invalid_argument(std::string(what) + ": negative size in shape " +
                                  ShapeToString(shape));
    }
  }
  CountElements(shape, what);
}

// Bytes of a contiguous tensor of `shape`: checked as CheckShape does, and
// the byte count must fit in int64 as well.
size_t ContiguousBytes(const Shape& shape, DType dtype, const char* what) {
  CheckShape(shape, what);
  int64_t nbytes;
  if (__builtin_mul_overflow(NumElements(shape), static_cast<int64_t>(ElementSize(dtype)), &nbytes)) {
    ThrowSizeOverflow(std::string(what) + " (" + std::string(DTypeName(dtype)) + ")", shape);
  }
  return static_cast<size_t>(nbytes);
}

// Replaces a single -1 in `shape` by the size that makes numel elements.
Shape InferSize(const Shape& shape, int64_t numel) {
  Shape out = shape;
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      if (infer >= 0) throw std::invalid_argument("shape " + ShapeToString(shape) + " has more than one -1");
      infer = static_cast<int>(i);
    } else if (out[i] < 0) {
      throw std::invalid_argument("invalid size in shape " + ShapeToString(shape));
    } else if (__builtin_mul_overflow(known, out[i], &known)) {
      ThrowSizeOverflow("view", shape);
    }
  }
  if (infer >= 0) {
    if (known == 0 && numel == 0) {
      // Any size times 0 is 0: nothing says what the -1 should be.
      throw std::invalid_argument("shape " + ShapeToString(shape) +
                                  " is ambiguous for a tensor of 0 elements: its -1 could stand for any size, "
                                  "since the other sizes multiply to 0 (give that dimension's size instead)");
    }
    if (known == 0 || numel % known != 0) {
      throw std::invalid_argument("shape " + ShapeToString(shape) + " is invalid for " +
                                  std::to_string(numel) + " elements");
    }
    out[infer] = numel / known;
  } else if (known != numel) {
    throw std::invalid_argument("shape " + ShapeToString(shape) + " is invalid for " +
                                std::to_string(numel) + " elements");
  }
  return out;
}

// Strides that express `new_shape` over the memory of (old_shape,
// old_strides) without copying, or nothing when impossible. Old dimensions
// are taken in chunks whose elements are evenly spaced; each chunk must map
// onto a run of new dimensions with the same element count.
std::optional<Shape> ViewStrides(const Shape& old_shape, const Shape& old_strides,
                                 const Shape& new_shape) {
  if (old_shape.empty() || NumElements(old_shape) == 0) return ContiguousStrides(new_shape);
  Shape new_strides(new_shape.size(), 1);
  int64_t view_d = static_cast<int64_t>(new_shape.size()) - 1;
  int64_t chunk_stride = old_strides.back();
  int64_t chunk_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(old_shape.size()) - 1; d >= 0; --d) {
    chunk_numel *= old_shape[d];
    const bool chunk_ends =
        d == 0 || (old_shape[d - 1] != 1 && old_strides[d - 1] != chunk_numel * chunk_stride);
    if (!chunk_ends) continue;
    while (view_d >= 0 && (view_numel < chunk_numel || new_shape[view_d] == 1)) {
      new_strides[view_d] = view_numel * chunk_stride;
      view_numel *= new_shape[view_d];
      --view_d;
    }
    if (view_numel != chunk_numel) return std::nullopt;
    if (d > 0) {
      chunk_stride = old_strides[d - 1];
      chunk_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

template <typename D, typename S>
inline D ConvertScalar(S s) {
  if constexpr (std::is_same_v<D, S>) {
    return s;
  } else if constexpr (std::is_integral_v<D> && !std::is_same_v<D, bool> && !std::is_integral_v<S>) {
    // A floating value an integer cannot hold (NaN, inf, out of range) is
    // undefined behaviour for static_cast: NaN gives 0, the others the
    // nearest end of the integer's range.
    const double v = static_cast<double>(static_cast<acc_t<S>>(s));
    if (v != v) return D{0};
    if (v <= static_cast<double>(std::numeric_limits<D>::min())) return std::numeric_limits<D>::min();
    if (v >= static_cast<double>(std::numeric_limits<D>::max())) return std::numeric_limits<D>::max();
    return static_cast<D>(v);
  } else {
    return static_cast<D>(static_cast<acc_t<S>>(s));
  }
}

// dst[i] = src[i] on the CPU: one shape (src already expanded), any strides and dtypes.
void CpuCopyStrided(const Tensor& dst, const Tensor& src) {
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    if (dst.data_ptr() != src.data_ptr()) std::memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes());
    return;
  }
  StridedLoop<2> loop(dst.shape(), {dst.strides(), src.strides()});
  DDP_DISPATCH_ALL(dst.dtype(), "copy", {
    using dst_t = scalar_t;
    dst_t* d = static_cast<dst_t*>(dst.data_ptr());
    DDP_DISPATCH_ALL(src.dtype(), "copy", {
      const scalar_t* s = static_cast<const scalar_t*>(src.data_ptr());
      loop.ForEachRow([&](const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& st) {
        dst_t* dp = d + off[0];
        const scalar_t* sp = s + off[1];
        if (st[0] == 1 && st[1] == 1) {
          for (int64_t i = 0; i < n; ++i) dp[i] = ConvertScalar<dst_t>(sp[i]);
        } else {
          for (int64_t i = 0; i < n; ++i) dp[i * st[0]] = ConvertScalar<dst_t>(sp[i * st[1]]);
        }
      });
    });
  });
}

void CpuCopyBytes(void* dst, Device, const void* src, Device, size_t nbytes) {
  std::memcpy(dst, src, nbytes);
}

void CpuSynchronize(Device) {}

struct BackendRegistry {
  DeviceBackend backends[kNumDeviceTypes];
  bool registered[kNumDeviceTypes] = {};
  BackendRegistry() {
    DeviceBackend cpu;
    cpu.allocator = &CpuAllocator();
    cpu.copy_bytes = &CpuCopyBytes;
    cpu.copy_strided = &CpuCopyStrided;
    cpu.synchronize = &CpuSynchronize;
    backends[0] = cpu;
    registered[0] = true;
  }
};

BackendRegistry& Backends() {
  static BackendRegistry* registry = new BackendRegistry();
  return *registry;
}

thread_local bool grad_mode_enabled = true;

std::string DeviceTypeName(DeviceType t) { return t == DeviceType::kCPU ? "cpu" : "cuda"; }

}  // namespace

// ---------------------------------------------------------------- backends

void RegisterDeviceBackend(DeviceType type, const DeviceBackend& backend) {
  if (backend.allocator == nullptr) {
    throw std::invalid_argument("RegisterDeviceBackend(" + DeviceTypeName(type) + "): allocator is null");
  }
  Backends().backends[static_cast<int>(type)] = backend;
  Backends().registered[static_cast<int>(type)] = true;
}

bool HasDeviceBackend(DeviceType type) { return Backends().registered[static_cast<int>(type)]; }

const DeviceBackend& GetDeviceBackend(Device device) {
  const int i = static_cast<int>(device.type);
  if (i < 0 || i >= kNumDeviceTypes || !Backends().registered[i]) {
    throw std::runtime_error("device " + device.ToString() +
                             " is not available: this binary has no backend for it"
                             " (CUDA needs a build with --config=cuda and the CUDA library linked)");
  }
  return Backends().backends[i];
}

bool GradMode::IsEnabled() { return grad_mode_enabled; }
void GradMode::SetEnabled(bool enabled) { grad_mode_enabled = enabled; }

// ---------------------------------------------------------------- storage

Storage::Storage(size_t nbytes, Device device)
    : data_(nullptr), nbytes_(nbytes), device_(device), from_allocator_(true) {
  data_ = GetDeviceBackend(device).allocator->Allocate(nbytes, device);
}

Storage::Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)), from_allocator_(false) {}

Storage::~Storage() {
  if (from_allocator_) {
    GetDeviceBackend(device_).allocator->Deallocate(data_, nbytes_, device_);
  } else if (deleter_) {
    deleter_(data_);
  }
}

// ---------------------------------------------------------------- impl

TensorImpl::TensorImpl(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, Shape strides,
                       DType dtype)
    : storage_(std::move(storage)),
      offset_(offset),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      dtype_(dtype),
      numel_(NumElements(shape_)) {}

AutogradMeta& TensorImpl::mutable_autograd() {
  if (!autograd_) autograd_ = std::make_unique<AutogradMeta>();
  return *autograd_;
}

void TensorImpl::Reset(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, Shape strides,
                       DType dtype) {
  storage_ = std::move(storage);
  offset_ = offset;
  shape_ = std::move(shape);
  strides_ = std::move(strides);
  dtype_ = dtype;
  numel_ = NumElements(shape_);
}

void HookHandle::Remove() {
  if (std::shared_ptr<NodeGradHooks> list = node_hooks_.lock()) {
    GradHook dead;  // destroyed after the lock is let go, as below
    std::lock_guard<std::mutex> lock(list->mu);
    auto& hooks = list->hooks;
    const auto it =
        std::find_if(hooks.begin(), hooks.end(), [&](const NodeGradHooks::Entry& e) { return e.id == id_; });
    if (it != hooks.end()) {
      dead = std::move(it->fn);
      hooks.erase(it);
    }
  }
  node_hooks_.reset();
  std::shared_ptr<TensorImpl> impl = owner_.lock();
  if (!impl || impl->autograd() == nullptr) return;
  AutogradMeta& meta = *impl->autograd();
  const auto same_id = [&](const auto& h) { return h.first == id_; };
  // Declared before the lock so that the removed function is destroyed
  // after it is let go: destroying what the hook captured may run any code.
  PostAccumulateGradHook dead_post;
  GradHook dead_grad;
  // Under hooks_mu: a backward on another thread may be copying the lists.
  std::lock_guard<std::mutex> lock(meta.hooks_mu);
  auto& post = meta.post_accumulate_hooks;
  if (auto p = std::find_if(post.begin(), post.end(), same_id); p != post.end()) {
    dead_post = std::move(p->second);
    post.erase(p);
  }
  auto& grad = meta.grad_hooks;
  if (auto g = std::find_if(grad.begin(), grad.end(), same_id); g != grad.end()) {
    dead_grad = std::move(g->second);
    grad.erase(g);
  }
  owner_.reset();
}

bool HookHandle::IsLast() const {
  std::shared_ptr<TensorImpl> impl = owner_.lock();
  if (!impl || impl->autograd() == nullptr) return false;
  AutogradMeta& meta = *impl->autograd();
  std::lock_guard<std::mutex> lock(meta.hooks_mu);
  const auto& hooks = meta.post_accumulate_hooks;
  return !hooks.empty() && hooks.back().first == id_;
}

// ---------------------------------------------------------------- tensor

Tensor Tensor::FromBlob(void* data, const Shape& shape, DType dtype, Device device,
                        std::function<void(void*)> deleter) {
  const size_t nbytes = ContiguousBytes(shape, dtype, "FromBlob");
  auto storage = std::make_shared<Storage>(data, nbytes, device, std::move(deleter));
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), 0, shape, ContiguousStrides(shape), dtype));
}

Tensor Tensor::FromStorage(std::shared_ptr<Storage> storage, int64_t offset, const Shape& shape,
                           const Shape& strides, DType dtype) {
  CheckShape(shape, "FromStorage");
  if (strides.size() != shape.size()) {
    throw std::invalid_argument("FromStorage: shape " + ShapeToString(shape) + " and strides " +
                                ShapeToString(strides) + " differ in length");
  }
  // Checked before the emptiness test below, as torch.as_strided does: an
  // empty view with a negative offset would point before its storage, and
  // one with a negative stride becomes out of range once a size grows.
  if (offset < 0) {
    throw std::out_of_range("FromStorage: storage offset " + std::to_string(offset) + " is negative (shape " +
                            ShapeToString(shape) + ", strides " + ShapeToString(strides) + ")");
  }
  for (size_t i = 0; i < strides.size(); ++i) {
    if (strides[i] < 0) {
      throw std::invalid_argument("FromStorage: stride " + std::to_string(strides[i]) + " of dimension " +
                                  std::to_string(i) + " in strides " + ShapeToString(strides) +
                                  " is negative (negative strides are not supported)");
    }
  }
  if (NumElements(shape) > 0) {
    // The byte just past the last element, computed without wrapping: a huge
    // stride must not come back around into the storage's range.
    int64_t last = offset, end_bytes = 0;
    bool overflow = false;
    for (size_t i = 0; i < shape.size(); ++i) {
      int64_t reach;
      overflow |= __builtin_mul_overflow(shape[i] - 1, strides[i], &reach);
      overflow |= __builtin_add_overflow(last, reach, &last);
    }
    overflow |= __builtin_add_overflow(last, 1, &last);
    overflow |= __builtin_mul_overflow(last, static_cast<int64_t>(ElementSize(dtype)), &end_bytes);
    if (overflow) {
      throw std::out_of_range("FromStorage: storage size calculation overflowed for shape " + ShapeToString(shape) +
                              " strides " + ShapeToString(strides) + " offset " + std::to_string(offset));
    }
    if (static_cast<size_t>(end_bytes) > storage->nbytes()) {
      throw std::out_of_range("FromStorage: shape " + ShapeToString(shape) + " strides " +
                              ShapeToString(strides) + " offset " + std::to_string(offset) +
                              " reach past the storage's " + std::to_string(storage->nbytes()) + " bytes");
    }
  }
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), offset, shape, strides, dtype));
}

void Tensor::CheckDefined(const char* what) const {
  if (!impl_) throw std::logic_error(std::string(what) + " on an undefined tensor");
}

void Tensor::CheckNoHistoryLoss(const char* what) const {
  CheckDefined(what);
  if (GradMode::IsEnabled() && requires_grad()) {
    // The differentiable counterpart in nn/ops/functional.h, where there is one.
    const std::string name = what;
    std::string instead;
    if (name == "To(dtype)") {
      instead = "use the differentiable ops::Cast (nn/ops/functional.h), or Detach() first";
    } else if (name == "AsStrided" || name == "To(device)") {
      instead = "there is no differentiable " + name + ": Detach() first, or call it under a NoGradGuard";
    } else {
      instead = "use the differentiable ops::" + name + " (nn/ops/functional.h), or Detach() first";
    }
    throw std::logic_error("Tensor::" + name + " on a tensor that requires grad would drop its autograd history; " +
                           instead);
  }
}

void Tensor::CheckDType(DType expected) const {
  CheckDefined("data");
  if (dtype() != expected) {
    throw std::invalid_argument("tensor has dtype " + std::string(DTypeName(dtype())) +
                                ", accessed as " + std::string(DTypeName(expected)));
  }
}

const Shape& Tensor::shape() const { CheckDefined("shape"); return impl_->shape(); }
const Shape& Tensor::strides() const { CheckDefined("strides"); return impl_->strides(); }
int64_t Tensor::dim() const { return static_cast<int64_t>(shape().size()); }
int64_t Tensor::numel() const { CheckDefined("numel"); return impl_->numel(); }
DType Tensor::dtype() const { CheckDefined("dtype"); return impl_->dtype(); }
Device Tensor::device() const { CheckDefined("device"); return impl_->storage()->device(); }
int64_t Tensor::storage_offset() const { CheckDefined("storage_offset"); return impl_->offset(); }
const std::shared_ptr<Storage>& Tensor::storage() const { CheckDefined("storage"); return impl_->storage(); }
void* Tensor::data_ptr() const { CheckDefined("data_ptr"); return impl_->data(); }

int64_t Tensor::WrapDim(int64_t d) const {
  const int64_t n = dim();
  const int64_t w = d < 0 ? d + n : d;
  if (w < 0 || w >= n) {
    throw std::out_of_range("dimension " + std::to_string(d) + " out of range for a " +
                            std::to_string(n) + "-d tensor of shape " + ShapeToString(shape()));
  }
  return w;
}

int64_t Tensor::size(int64_t d) const { return shape()[WrapDim(d)]; }
int64_t Tensor::stride(int64_t d) const { return strides()[WrapDim(d)]; }

bool Tensor::is_contiguous() const {
  const Shape& sh = shape();
  const Shape& st = strides();
  int64_t expected = 1;
  for (size_t i = sh.size(); i-- > 0;) {
    if (sh[i] == 1) continue;
    if (st[i] != expected) return numel() == 0;
    expected *= sh[i];
  }
  return true;
}

double Tensor::Item() const {
  CheckDefined("Item");
  if (numel() != 1) {
    throw std::invalid_argument("Item() needs a tensor with one element, got shape " + ShapeToString(shape()));
  }
  Tensor cpu = device().is_cpu() ? *this : Detach().To(kCPU);
  double v = 0;
  DDP_DISPATCH_ALL(dtype(), "Item", { v = static_cast<double>(static_cast<acc_t<scalar_t>>(*static_cast<const scalar_t*>(cpu.data_ptr()))); });
  return v;
}

template <typename T>
std::vector<T> Tensor::ToVector() const {
  CheckDefined("ToVector");
  Tensor c = Detach();
  if (!c.device().is_cpu()) c = c.To(kCPU);
  Tensor typed = Empty(shape(), {.dtype = DTypeOf<T>()});
  typed.CopyFrom(c);
  return std::vector<T>(typed.data<T>(), typed.data<T>() + typed.numel());
}
template std::vector<float> Tensor::ToVector<float>() const;
template std::vector<double> Tensor::ToVector<double>() const;
template std::vector<int64_t> Tensor::ToVector<int64_t>() const;
template std::vector<int32_t> Tensor::ToVector<int32_t>() const;
template std::vector<uint8_t> Tensor::ToVector<uint8_t>() const;

// ---------------------------------------------------------------- views

Tensor Tensor::AsStrided(const Shape& shape, const Shape& strides, int64_t storage_offset) const {
  CheckNoHistoryLoss("AsStrided");
  return FromStorage(storage(), storage_offset, shape, strides, dtype());
}

Tensor Tensor::View(const Shape& shape) const {
  CheckNoHistoryLoss("View");
  Shape target = InferSize(shape, numel());
  std::optional<Shape> strides = ViewStrides(this->shape(), this->strides(), target);
  if (!strides) {
    throw std::invalid_argument("View: shape " + ShapeToString(shape) +
                                " cannot be expressed over a tensor of shape " +
                                ShapeToString(this->shape()) + " with strides " +
                                ShapeToString(this->strides()) + " (use Reshape, which copies)");
  }
  return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset(), std::move(target),
                                             std::move(*strides), dtype()));
}

Tensor Tensor::Reshape(const Shape& shape) const {
  CheckNoHistoryLoss("Reshape");
  Shape target = InferSize(shape, numel());
  std::optional<Shape> strides = ViewStrides(this->shape(), this->strides(), target);
  if (strides) {
    return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset(), std::move(target),
                                               std::move(*strides), dtype()));
  }
  return Clone().View(target);
}

Tensor Tensor::Transpose(int64_t d0, int64_t d1) const {
  CheckNoHistoryLoss("Transpose");
  if (dim() == 0) {
    // torch.transpose takes a 0-d tensor as having one dimension, 0 (or
    // -1): swapping it with itself leaves the scalar as it is.
    for (const int64_t d : {d0, d1}) {
      if (d != 0 && d != -1) {
        throw std::out_of_range("Transpose: dimension " + std::to_string(d) +
                                " out of range for a 0-d tensor (expected 0 or -1)");
      }
    }
    return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset(), shape(), strides(), dtype()));
  }
  d0 = WrapDim(d0);
  d1 = WrapDim(d1);
  Shape sh = shape(), st = strides();
  std::swap(sh[d0], sh[d1]);
  std::swap(st[d0], st[d1]);
  return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset(), std::move(sh), std::move(st), dtype()));
}

Tensor Tensor::Permute(const Shape& dims) const {
  CheckNoHistoryLoss("Permute");
  if (static_cast<int64_t>(dims.size()) != dim()) {
    throw std::invalid_argument("Permute: " + ShapeToString(dims) + " does not list the " +
                                std::to_string(dim()) + " dimensions of shape " + ShapeToString(shape()));
  }
  Shape sh(dims.size()), st(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = WrapDim(dims[i]);
    if (seen[d]) throw std::invalid_argument("Permute: dimension repeated in " + ShapeToString(dims));
    seen[d] = true;
    sh[i] = shape()[d];
    st[i] = strides()[d];
  }
  return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset(), std::move(sh), std::move(st), dtype()));
}

Tensor Tensor::Slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  CheckNoHistoryLoss("Slice");
  d = WrapDim(d);
  const int64_t n = shape()[d];
  if (step <= 0) throw std::invalid_argument("Slice: step must be positive, got " + std::to_string(step));
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape sh = shape(), st = strides();
  // Without end - start + step - 1, which overflows for a step near 2^63.
  sh[d] = end == start ? 0 : 1 + (end - start - 1) / step;
  const int64_t offset = storage_offset() + start * st[d];
  // One element or none: its stride is never used (and stride * step may
  // not fit).
  if (sh[d] <= 1) {
    st[d] = 1;
  } else if (__builtin_mul_overflow(st[d], step, &st[d])) {
    throw std::invalid_argument("Slice: step " + std::to_string(step) + " times the stride of dimension " +
                                std::to_string(d) + " overflows");
  }
  return Tensor(std::make_shared<TensorImpl>(storage(), offset, std::move(sh), std::move(st), dtype()));
}

Tensor Tensor::Narrow(int64_t d, int64_t start, int64_t length) const {
  CheckNoHistoryLoss("Narrow");
  d = WrapDim(d);
  const int64_t n = shape()[d];
  const int64_t given = start;  // for the message: -2 wrapped to 2 misreports what was asked
  if (start < 0 && start >= -n) start += n;  // counted from the end, as torch.narrow
  if (start < 0 || start > n || length < 0 || length > n - start) {
    throw std::out_of_range("Narrow: " + std::to_string(length) + " elements from " + std::to_string(given) +
                            " of dimension " + std::to_string(d) +
                            " are outside shape " + ShapeToString(shape()));
  }
  Shape sh = shape();
  sh[d] = length;
  return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset() + start * strides()[d],
                                             std::move(sh), strides(), dtype()));
}

Tensor Tensor::Select(int64_t d, int64_t index) const {
  CheckNoHistoryLoss("Select");
  d = WrapDim(d);
  const int64_t n = shape()[d];
  // The index as given goes in the message: after wrapping, -5 of 3 read as -2.
  if (index < -n || index >= n) {
    const std::string valid = n == 0 ? "none, the dimension is empty"
                                     : "[" + std::to_string(-n) + ", " + std::to_string(n - 1) + "]";
    throw std::out_of_range("Select: index " + std::to_string(index) + " out of range for dimension " +
                            std::to_string(d) + " of shape " + ShapeToString(shape()) + " (valid: " + valid + ")");
  }
  if (index < 0) index += n;
  Shape sh = shape(), st = strides();
  const int64_t offset = storage_offset() + index * st[d];
  sh.erase(sh.begin() + d);
  st.erase(st.begin() + d);
  return Tensor(std::make_shared<TensorImpl>(storage(), offset, std::move(sh), std::move(st), dtype()));
}

Tensor Tensor::Unsqueeze(int64_t d) const {
  CheckNoHistoryLoss("Unsqueeze");
  const int64_t n = dim();
  const int64_t given = d;
  if (d < 0) d += n + 1;
  if (d < 0 || d > n) {
    throw std::out_of_range("Unsqueeze: dimension " + std::to_string(given) + " out of range for shape " +
                            ShapeToString(shape()) + " (expected " + std::to_string(-n - 1) + " to " +
                            std::to_string(n) + ")");
  }
  Shape sh = shape(), st = strides();
  const int64_t s = d < n ? st[d] * sh[d] : 1;
  sh.insert(sh.begin() + d, 1);
  st.insert(st.begin() + d, s);
  return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset(), std::move(sh), std::move(st), dtype()));
}

Tensor Tensor::Squeeze(int64_t d) const {
  CheckNoHistoryLoss("Squeeze");
  if (dim() == 0 && (d == 0 || d == -1)) {  // a scalar stays one, as in PyTorch
    return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset(), shape(), strides(), dtype()));
  }
  d = WrapDim(d);
  Shape sh = shape(), st = strides();
  if (sh[d] == 1) {
    sh.erase(sh.begin() + d);
    st.erase(st.begin() + d);
  }
  return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset(), std::move(sh), std::move(st), dtype()));
}

Tensor Tensor::Expand(const Shape& target) const {
  CheckNoHistoryLoss("Expand");
  const Shape& sh = shape();
  if (target.size() < sh.size()) {
    throw std::invalid_argument("Expand: cannot expand shape " + ShapeToString(sh) + " to " + ShapeToString(target));
  }
  const size_t lead = target.size() - sh.size();
  Shape st(target.size(), 0);
  Shape out = target;
  for (size_t i = 0; i < target.size(); ++i) {
    if (i < lead) {
      if (target[i] < 0) {
        throw std::invalid_argument("Expand: size " + std::to_string(target[i]) + " in new leading dimension " +
                                    std::to_string(i) + " of " + ShapeToString(target) +
                                    " (a new dimension needs its size; the tensor has shape " + ShapeToString(sh) +
                                    ")");
      }
      continue;
    }
    const int64_t s = sh[i - lead];
    if (target[i] < -1) {
      throw std::invalid_argument("Expand: size " + std::to_string(target[i]) + " in " +
                                  ShapeToString(target) + " is negative");
    }
    if (target[i] == -1 || target[i] == s) {
      out[i] = s;
      st[i] = strides()[i - lead];
    } else if (s == 1) {
      st[i] = 0;
    } else {
      throw std::invalid_argument("Expand: cannot expand shape " + ShapeToString(sh) + " to " +
                                  ShapeToString(target));
    }
  }
  return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset(), std::move(out), std::move(st), dtype()));
}

Tensor Tensor::Flatten(int64_t start, int64_t end) const {
  CheckNoHistoryLoss("Flatten");
  if (dim() == 0) {
    // As torch.flatten, a 0-d tensor takes 0 and -1 (as one dimension would) and nothing else.
    for (const int64_t d : {start, end}) {
      if (d != 0 && d != -1) {
        throw std::out_of_range("Flatten: dimension " + std::to_string(d) +
                                " out of range for a 0-d tensor (expected 0 or -1)");
      }
    }
    return Reshape({1});
  }
  const int64_t given_start = start, given_end = end;
  start = WrapDim(start);
  end = WrapDim(end);
  if (start > end) {
    throw std::invalid_argument("Flatten: start dimension " + std::to_string(given_start) +
                                " comes after end dimension " + std::to_string(given_end) + " in shape " +
                                ShapeToString(shape()));
  }
  Shape target;
  for (int64_t i = 0; i < start; ++i) target.push_back(shape()[i]);
  int64_t m = 1;
  for (int64_t i = start; i <= end; ++i) m *= shape()[i];
  target.push_back(m);
  for (int64_t i = end + 1; i < dim(); ++i) target.push_back(shape()[i]);
  return Reshape(target);
}

// ---------------------------------------------------------------- copies

Tensor Tensor::Contiguous() const {
  CheckNoHistoryLoss("Contiguous");
  if (is_contiguous()) return *this;
  return Clone();
}

Tensor Tensor::Clone() const {
  CheckNoHistoryLoss("Clone");
  Tensor out = Empty(shape(), {.dtype = dtype(), .device = device()});
  out.CopyFrom(*this);
  return out;
}

Tensor Tensor::To(DType dtype) const {
  CheckNoHistoryLoss("To(dtype)");
  if (dtype == this->dtype()) return *this;
  Tensor out = Empty(shape(), {.dtype = dtype, .device = device()});
  out.CopyFrom(*this);
  return out;
}

Tensor Tensor::To(Device device) const {
  CheckNoHistoryLoss("To(device)");
  if (device == this->device()) return *this;
  Tensor out = Empty(shape(), {.dtype = dtype(), .device = device});
  out.CopyFrom(*this);
  return out;
}

void Tensor::CopyFrom(const Tensor& src) const {
  CheckDefined("CopyFrom");
  if (!src.defined()) throw std::invalid_argument("CopyFrom: source tensor is undefined");
  if (GradMode::IsEnabled() && (requires_grad() || src.requires_grad())) {
    throw std::logic_error("Tensor::CopyFrom with a tensor that requires grad while grad mode is "
                           "on (wrap in NoGradGuard, or Detach() the source)");
  }
  Tensor s = src.Detach();
  if (s.shape() != shape()) {
    try {
      s = s.Expand(shape());
    } catch (const std::invalid_argument&) {
      throw std::invalid_argument("CopyFrom: source of shape " + ShapeToString(src.shape()) +
                                  " cannot be broadcast to destination shape " + ShapeToString(shape()));
    }
  }
  if (numel() == 0) {
    storage()->BumpVersion();
    return;
  }
  for (int64_t d = 0; d < dim(); ++d) {
    if (strides()[d] == 0 && shape()[d] > 1) {
      throw std::invalid_argument("CopyFrom: the destination " + ShapeToString(shape()) +
                                  " has several elements at one memory location (stride 0 in dimension " +
                                  std::to_string(d) + ", an expanded view); copy into a tensor of its own");
    }
  }
  const Device dd = device(), sd = s.device();
  // Compared by address, not by storage: two FromBlob tensors over one
  // buffer have storages of their own but share memory all the same.
  if (dd == sd) {
    if (s.data_ptr() == data_ptr() && s.strides() == strides() && s.dtype() == dtype()) {
      storage()->BumpVersion();  // the same elements: nothing to copy
      return;
    }
    // Overlapping memory (x.CopyFrom(x.Transpose(0, 1))): an element may be
    // overwritten before it is read, so the source is read from a copy.
    auto range = [](const Tensor& t) {
      const uintptr_t lo = reinterpret_cast<uintptr_t>(t.data_ptr());
      int64_t span = 0;
      for (int64_t d = 0; d < t.dim(); ++d) span += (t.shape()[d] - 1) * t.strides()[d];
      return std::make_pair(lo, lo + static_cast<uintptr_t>((span + 1) * ElementSize(t.dtype())));
    };
    const auto [dst_lo, dst_hi] = range(*this);
    const auto [src_lo, src_hi] = range(s);
    if (src_lo < dst_hi && dst_lo < src_hi) s = s.Clone();
  }
  storage()->BumpVersion();
  if (dd == sd) {
    GetDeviceBackend(dd).copy_strided(*this, s);
    return;
  }
  // Across devices: make both sides contiguous with one dtype, then move bytes.
  const DeviceBackend& backend = GetDeviceBackend(dd.is_cpu() ? sd : dd);
  Tensor src_c = s;
  if (!src_c.is_contiguous() || src_c.dtype() != dtype()) {
    src_c = Empty(shape(), {.dtype = dtype(), .device = sd});
    GetDeviceBackend(sd).copy_strided(src_c, s);
  }
  if (is_contiguous()) {
    backend.copy_bytes(data_ptr(), dd, src_c.data_ptr(), sd, nbytes());
  } else {
    Tensor staging = Empty(shape(), {.dtype = dtype(), .device = dd});
    backend.copy_bytes(staging.data_ptr(), dd, src_c.data_ptr(), sd, nbytes());
    GetDeviceBackend(dd).copy_strided(*this, staging);
  }
}

const Tensor& Tensor::Fill(double value) const {
  CheckDefined("Fill");
  if (GradMode::IsEnabled() && requires_grad()) {
    throw std::logic_error("Tensor::Fill on a tensor that requires grad while grad mode is on "
                           "(wrap parameter initialization in NoGradGuard)");
  }
  storage()->BumpVersion();
  if (numel() == 0) return *this;
  if (!device().is_cpu()) {
    const DeviceBackend& backend = GetDeviceBackend(device());
    if (backend.fill != nullptr) {
      // Converted here, as on the CPU; the device stores the element's bytes.
      DDP_DISPATCH_ALL(dtype(), "Fill", {
        const scalar_t v = ConvertScalar<scalar_t>(value);
        backend.fill(*this, &v);
      });
    } else {
      Tensor one = Full({}, value, {.dtype = dtype()});
      CopyFrom(one);
    }
    return *this;
  }
  DDP_DISPATCH_ALL(dtype(), "Fill", {
    const scalar_t v = ConvertScalar<scalar_t>(value);
    scalar_t* p = static_cast<scalar_t*>(data_ptr());
    if (is_contiguous()) {
      std::fill(p, p + numel(), v);
    } else {
      StridedLoop<1> loop(shape(), {strides()});
      loop.ForEachRow([&](const std::array<int64_t, 1>& off, int64_t n, const std::array<int64_t, 1>& st) {
        for (int64_t i = 0; i < n; ++i) p[off[0] + i * st[0]] = v;
      });
    }
  });
  return *this;
}

Tensor Tensor::Detach() const {
  CheckDefined("Detach");
  return Tensor(std::make_shared<TensorImpl>(storage(), storage_offset(), shape(), strides(), dtype()));
}

void Tensor::SetData(const Tensor& src) const {
  CheckDefined("SetData");
  if (!src.defined()) throw std::invalid_argument("SetData: source tensor is undefined");
  impl_->Reset(src.storage(), src.storage_offset(), src.shape(), src.strides(), src.dtype());
}

// ---------------------------------------------------------------- autograd

namespace {
// "tensor [2, 3] float32 on cpu", for messages about a tensor's autograd state and hooks.
std::string DescribeForHook(const Tensor& t) {
  return "tensor " + ShapeToString(t.shape()) + " " + std::string(DTypeName(t.dtype())) + " on " +
         t.device().ToString();
}
}  // namespace

bool Tensor::requires_grad() const {
  CheckDefined("requires_grad");
  return impl_->autograd() != nullptr && impl_->autograd()->requires_grad;
}

const Tensor& Tensor::set_requires_grad(bool requires_grad) const {
  CheckDefined("set_requires_grad");
  if (!is_leaf()) {
    // As PyTorch's requires_grad_(True): a non-leaf already requires grad.
    if (requires_grad) return *this;
    throw std::logic_error("set_requires_grad: " + DescribeForHook(*this) +
                           " is a non-leaf (it was produced by a recorded operation and gets requires_grad from "
                           "its inputs); use Detach() for a copy outside the graph");
  }
  if (requires_grad && !IsFloating(dtype())) {
    throw std::invalid_argument("only floating-point tensors can require grad, this one is " +
                                std::string(DTypeName(dtype())));
  }
  if (requires_grad || impl_->autograd() != nullptr) impl_->mutable_autograd().requires_grad = requires_grad;
  return *this;
}

const Tensor& Tensor::grad() const {
  static const Tensor* kUndefined = new Tensor();
  CheckDefined("grad");
  return impl_->autograd() ? impl_->autograd()->grad : *kUndefined;
}

void Tensor::set_grad(const Tensor& grad) const {
  CheckDefined("set_grad");
  if (grad.defined()) {
    if (grad.shape() != shape() || grad.dtype() != dtype() || grad.device() != device()) {
      throw std::invalid_argument("set_grad: gradient " + ShapeToString(grad.shape()) + " " +
                                  std::string(DTypeName(grad.dtype())) + " on " + grad.device().ToString() +
                                  " does not match tensor " + ShapeToString(shape()) + " " +
                                  std::string(DTypeName(dtype())) + " on " + device().ToString());
    }
    // Backward adds into .grad in place: several elements at one memory
    // location would each receive every one's gradient (as CopyFrom refuses).
    for (int64_t d = 0; d < grad.dim(); ++d) {
      if (grad.strides()[d] == 0 && grad.shape()[d] > 1) {
        throw std::invalid_argument("set_grad: the gradient " + ShapeToString(grad.shape()) +
                                    " has several elements at one memory location (stride 0 in dimension " +
                                    std::to_string(d) + ", an expanded view); give it a tensor of its own");
      }
    }
  }
  if (!grad.defined() && impl_->autograd() == nullptr) return;
  impl_->mutable_autograd().grad = grad;
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<autograd::Node>* kNull = new std::shared_ptr<autograd::Node>();
  CheckDefined("grad_fn");
  return impl_->autograd() ? impl_->autograd()->grad_fn : *kNull;
}

uint32_t Tensor::output_nr() const {
  CheckDefined("output_nr");
  return impl_->autograd() ? impl_->autograd()->output_nr : 0;
}

bool Tensor::is_leaf() const { return grad_fn() == nullptr; }

void Tensor::RetainGrad() const {
  CheckDefined("RetainGrad");
  if (!requires_grad()) {
    throw std::logic_error("RetainGrad: " + DescribeForHook(*this) +
                           " does not require grad, so no gradient is computed for it to keep");
  }
  if (is_leaf()) return;  // a leaf gets .grad anyway (PyTorch's retain_grad does nothing there)
  impl_->mutable_autograd().retains_grad = true;
}

bool Tensor::retains_grad() const {
  CheckDefined("retains_grad");
  return impl_->autograd() != nullptr && impl_->autograd()->retains_grad;
}

HookHandle Tensor::RegisterPostAccumulateGradHook(PostAccumulateGradHook fn) const {
  CheckDefined("RegisterPostAccumulateGradHook");
  if (!is_leaf() || !requires_grad()) {
    const char* wrong =
        is_leaf() ? " does not require grad" : " is a non-leaf (it was produced by a recorded operation)";
    throw std::logic_error("RegisterPostAccumulateGradHook: " + DescribeForHook(*this) + wrong +
                           "; post-accumulate-grad hooks can only be registered on leaf tensors that require grad");
  }
  // Refused here, where the tensor can be named: called during backward, an
  // empty function would throw a bare std::bad_function_call.
  if (!fn) {
    throw std::invalid_argument("RegisterPostAccumulateGradHook: the hook for " + DescribeForHook(*this) +
                                " is empty");
  }
  AutogradMeta& meta = impl_->mutable_autograd();
  std::lock_guard<std::mutex> lock(meta.hooks_mu);
  const uint64_t id = meta.next_hook_id++;
  meta.post_accumulate_hooks.emplace_back(id, std::move(fn));
  return HookHandle(impl_, id);
}

namespace {
std::atomic<std::shared_ptr<NodeGradHooks> (*)(autograd::Node&)> g_node_grad_hooks_getter{nullptr};
}  // namespace

namespace detail {
void SetNodeGradHooksGetter(std::shared_ptr<NodeGradHooks> (*getter)(autograd::Node&)) {
  g_node_grad_hooks_getter.store(getter);
}
}  // namespace detail

HookHandle Tensor::RegisterHook(GradHook fn) const {
  CheckDefined("RegisterHook");
  if (!requires_grad()) {
    throw std::logic_error("RegisterHook: " + DescribeForHook(*this) +
                           " does not require grad, so no gradient is computed for it to hook");
  }
  if (!fn) throw std::invalid_argument("RegisterHook: the hook for " + DescribeForHook(*this) + " is empty");
  if (const std::shared_ptr<autograd::Node>& node = grad_fn()) {
    // Kept by the node, under this tensor's output number: the node lives
    // as long as the graph that will carry this tensor's gradient, whether
    // or not a handle to the tensor does.
    const auto getter = g_node_grad_hooks_getter.load();
    if (getter == nullptr) {
      // Every node's constructor registers the getter, so this cannot happen.
      throw std::logic_error("RegisterHook: the autograd library did not register its node hook lists");
    }
    const std::shared_ptr<NodeGradHooks> list = getter(*node);
    std::lock_guard<std::mutex> lock(list->mu);
    // Checked under the list's lock, which the release holds while it
    // takes the hooks: a hook is either released with the others or refused.
    if (list->released) {
      throw std::logic_error("RegisterHook: " + DescribeForHook(*this) + " is output " +
                             std::to_string(output_nr()) + " of " + detail::GradFnName(*node) +
                             ", whose saved tensors and hooks an earlier Backward released (it did not pass "
                             "retain_graph = true): a backward through it would fail before this hook ran; "
                             "register the hook before that Backward, or pass retain_graph = true to it");
    }
    const uint64_t id = list->next_id++;
    list->hooks.push_back({id, output_nr(), std::move(fn)});
    return HookHandle(std::weak_ptr<NodeGradHooks>(list), id);
  }
  AutogradMeta& meta = impl_->mutable_autograd();
  std::lock_guard<std::mutex> lock(meta.hooks_mu);
  const uint64_t id = meta.next_hook_id++;
  meta.grad_hooks.emplace_back(id, std::move(fn));
  return HookHandle(impl_, id);
}

// ---------------------------------------------------------------- factories

Tensor Empty(const Shape& shape, TensorOptions options) {
  const size_t nbytes = ContiguousBytes(shape, options.dtype, "Empty");
  auto storage = std::make_shared<Storage>(nbytes, options.device);
  Tensor t(std::make_shared<TensorImpl>(std::move(storage), 0, shape, ContiguousStrides(shape), options.dtype));
  if (options.requires_grad) t.set_requires_grad(true);
  return t;
}

Tensor Full(const Shape& shape, double value, TensorOptions options) {
  TensorOptions plain = options;
  plain.requires_grad = false;
  Tensor t = Empty(shape, plain);
  t.Fill(value);
  if (options.requires_grad) t.set_requires_grad(true);
  return t;
}

Tensor Zeros(const Shape& shape, TensorOptions options) { return Full(shape, 0.0, options); }
Tensor Ones(const Shape& shape, TensorOptions options) { return Full(shape, 1.0, options); }

Tensor Arange(int64_t n, TensorOptions options) {
  if (n < 0) throw std::invalid_argument("Arange: n " + std::to_string(n) + " must be >= 0");
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>(i);
  return FromVector(v, {n}, options);
}

Tensor EmptyLike(const Tensor& t) { return Empty(t.shape(), {.dtype = t.dtype(), .device = t.device()}); }
Tensor ZerosLike(const Tensor& t) { return Zeros(t.shape(), {.dtype = t.dtype(), .device = t.device()}); }

Tensor FromVector(const std::vector<double>& values, const Shape& shape, TensorOptions options) {
  detail::CheckVectorSize(values.size(), shape);
  Tensor host = Tensor::FromBlob(const_cast<double*>(values.data()), shape, DType::kFloat64);
  Tensor out = Empty(shape, {.dtype = options.dtype, .device = options.device});
  out.CopyFrom(host);
  if (options.requires_grad) out.set_requires_grad(true);
  return out;
}

void ZeroGradOf(const Tensor& param, bool set_to_none) {
  const Tensor& grad = param.grad();
  if (!grad.defined()) return;
  if (set_to_none) {
    param.set_grad(Tensor());
    return;
  }
  if (grad.grad_fn() != nullptr) {
    param.set_grad(grad.Detach());
  } else if (grad.requires_grad()) {
    grad.set_requires_grad(false);
  }
  NoGradGuard guard;
  param.grad().Zero();
}

}  // namespace ddp::nn
