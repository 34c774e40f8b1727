// Tensor: an n-dimensional strided view of a typed, device-resident Storage,
// plus the autograd metadata (requires_grad, .grad, the node that produced
// it, a leaf's gradient hooks and post-accumulate-grad hooks) that
// nn/autograd reads and writes. A non-leaf's gradient hooks live on the node
// that produced it (NodeGradHooks), so that they outlive its handles.
//
// Member functions never record autograd history. Those that return a new
// tensor (views such as View/Transpose/Narrow, and Contiguous, Clone, To)
// throw when called on a tensor that requires grad while grad mode is on,
// because the result would silently lose its history: use the
// differentiable free functions of nn/ops/functional.h (ops::Reshape, ops::Transpose, ...),
// or Detach() first when no gradient is wanted.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "nn/tensor/allocator.h"
#include "nn/tensor/device.h"
#include "nn/tensor/dtype.h"

namespace ddp::nn {

namespace autograd {
class Node;
}  // namespace autograd

/// Sizes or strides, outermost dimension first. Strides are in elements.
using Shape = std::vector<int64_t>;

/// "[64, 784]".
std::string ShapeToString(const Shape& shape);
/// Product of the sizes (1 for a 0-d shape). Throws std::invalid_argument,
/// naming the shape, when it does not fit in int64.
int64_t NumElements(const Shape& shape);
/// Row-major strides of a contiguous tensor of this shape.
Shape ContiguousStrides(const Shape& shape);

/// A refcounted block of device memory shared by a tensor and its views.
class Storage {
 public:
  /// Allocates nbytes on `device` from the allocator registered for its type.
  Storage(size_t nbytes, Device device);
  /// Wraps memory owned elsewhere; `deleter` (may be empty) runs when the last user lets go.
  Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  /// Counts in-place writes through any tensor on this storage (autograd
  /// uses it to detect a saved tensor modified before backward). Atomic: a
  /// collective bumps it on the communication thread.
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void BumpVersion() { version_.fetch_add(1, std::memory_order_relaxed); }

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  std::function<void(void*)> deleter_;
  bool from_allocator_;
  std::atomic<uint64_t> version_{0};
};

class Tensor;

/// What a device type provides to the tensor library. The CPU's is built in;
/// the CUDA library registers its own at startup (RegisterDeviceBackend).
struct DeviceBackend {
  /// Device memory (required).
  Allocator* allocator = nullptr;
  /// Copies nbytes between contiguous buffers, at least one of them on this device type.
  void (*copy_bytes)(void* dst, Device dst_device, const void* src, Device src_device,
                     size_t nbytes) = nullptr;
  /// dst[i] = src[i] for tensors of one shape on one device of this type,
  /// any strides, converting dtypes.
  void (*copy_strided)(const Tensor& dst, const Tensor& src) = nullptr;
  /// Waits until the device has finished queued work.
  void (*synchronize)(Device device) = nullptr;
  /// Sets every element of dst (on this device type, any strides) to
  /// *value, one element of dst's dtype in host memory, stored bit for bit.
  /// Optional: without it, Fill copies from a host buffer.
  void (*fill)(const Tensor& dst, const void* value) = nullptr;
  /// Devices of this type visible to the process. Optional: without it,
  /// indices are checked when a device is first used.
  int (*device_count)() = nullptr;
};

/// Installs the backend of a device type (replacing any previous one).
void RegisterDeviceBackend(DeviceType type, const DeviceBackend& backend);
/// True when a backend is registered for the type (always true for the CPU).
bool HasDeviceBackend(DeviceType type);
/// The backend of a type; throws naming the device when none is registered
/// (e.g. CUDA in a build without --config=cuda).
const DeviceBackend& GetDeviceBackend(Device device);

/// Whether operations record autograd history on this thread (default on).
class GradMode {
 public:
  static bool IsEnabled();
  static void SetEnabled(bool enabled);
};

/// Turns grad mode off for its scope (restores the previous mode).
class NoGradGuard {
 public:
  NoGradGuard() : prev_(GradMode::IsEnabled()) { GradMode::SetEnabled(false); }
  ~NoGradGuard() { GradMode::SetEnabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

/// Sets grad mode to `enabled` for its scope.
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled) : prev_(GradMode::IsEnabled()) { GradMode::SetEnabled(enabled); }
  ~GradModeGuard() { GradMode::SetEnabled(prev_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool prev_;
};

/// Called with the parameter right after its gradient for this backward pass
/// has been accumulated into its .grad (on the thread running backward).
using PostAccumulateGradHook = std::function<void(const Tensor& param)>;

/// Called with the gradient with respect to a tensor when backward has
/// computed it (summed over every use of the tensor), before it reaches the
/// leaf's .grad or the node that produced the tensor. Returns a replacement
/// of the same shape, dtype and device, or an undefined tensor to keep it.
using GradHook = std::function<Tensor(const Tensor& grad)>;

class TensorImpl;

/// The gradient hooks registered on the outputs of one recorded node
/// (Tensor::RegisterHook on a non-leaf), each with the number of the output
/// it hooks. The node owns them, as PyTorch's grad_fn owns a tensor's
/// pre-hooks, so they run even when every handle to the tensor is gone;
/// HookHandles hold them weakly.
struct NodeGradHooks {
  struct Entry {
    uint64_t id;
    uint32_t output_nr;
    GradHook fn;
  };
  /// Guards the fields; never held while a hook runs (a pass copies the list).
  std::mutex mu;
  /// In registration order.
  std::vector<Entry> hooks;
  uint64_t next_id = 1;
  /// Set when a backward released the node's saved tensors and with them
  /// these hooks: a later pass through the node fails before any hook of
  /// it would run, so RegisterHook refuses new ones.
  bool released = false;
};

/// Removes a hook (a gradient hook or a post-accumulate-grad hook) when
/// asked; dropping the handle keeps the hook. Remove and registration may
/// be called while a backward pass runs the tensor's hooks on another
/// thread: a hook that pass is already running finishes, and one it has
/// not reached yet does not run.
class HookHandle {
 public:
  HookHandle() = default;
  /// A hook kept by a leaf tensor.
  HookHandle(std::weak_ptr<TensorImpl> owner, uint64_t id) : owner_(std::move(owner)), id_(id) {}
  /// A gradient hook kept by the node that produced a non-leaf tensor.
  HookHandle(std::weak_ptr<NodeGradHooks> node_hooks, uint64_t id) : node_hooks_(std::move(node_hooks)), id_(id) {}
  /// Unregisters the hook; idempotent, and harmless once the tensor (for a
  /// non-leaf's hook, the node that produced it) is gone.
  void Remove();
  /// Whether this hook is registered and is its tensor's last post-accumulate
  /// hook, so that no other runs after it (hooks run in registration order).
  bool IsLast() const;

 private:
  std::weak_ptr<TensorImpl> owner_;
  std::weak_ptr<NodeGradHooks> node_hooks_;
  uint64_t id_ = 0;
};

/// Undefined tensor handle: a Tensor that holds nothing (grad of a fresh
/// parameter, "no gradient" from a backward function).
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  /// Wraps memory owned elsewhere (no copy). `deleter` may be empty for borrowed memory.
  static Tensor FromBlob(void* data, const Shape& shape, DType dtype, Device device = kCPU,
                         std::function<void(void*)> deleter = {});
  /// A tensor over `storage` with explicit geometry (offset and strides in
  /// elements). Throws std::out_of_range when the geometry reaches past the
  /// storage, including when computing its extent would overflow int64, and
  /// for a negative offset even when the view is empty; a negative stride
  /// throws std::invalid_argument naming its dimension.
  static Tensor FromStorage(std::shared_ptr<Storage> storage, int64_t offset, const Shape& shape,
                            const Shape& strides, DType dtype);

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  /// True when both handles refer to the same tensor object.
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }

  // --- geometry ---
  const Shape& shape() const;
  const Shape& strides() const;
  /// Number of dimensions.
  int64_t dim() const;
  /// Size of dimension d (negative counts from the end).
  int64_t size(int64_t d) const;
  /// Stride of dimension d in elements (negative counts from the end).
  int64_t stride(int64_t d) const;
  int64_t numel() const;
  DType dtype() const;
  Device device() const;
  /// Offset of element [0, ..., 0] from the storage's start, in elements.
  int64_t storage_offset() const;
  const std::shared_ptr<Storage>& storage() const;
  size_t element_size() const { return ElementSize(dtype()); }
  /// numel() * element_size().
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  /// Row-major with no gaps (size-1 dimensions may have any stride).
  bool is_contiguous() const;
  /// Normalizes a possibly negative dimension index; throws when out of range.
  int64_t WrapDim(int64_t d) const;

  // --- data ---
  /// Address of element [0, ..., 0].
  void* data_ptr() const;
  /// Typed address of element [0, ..., 0]; throws if T does not match dtype().
  template <typename T>
  T* data() const {
    CheckDType(DTypeOf<T>());
    return static_cast<T*>(data_ptr());
  }
  /// The single element of a one-element tensor, as double (copied from the device if needed).
  double Item() const;
  /// Elements in row-major order converted to T (copied from the device if needed).
  template <typename T>
  std::vector<T> ToVector() const;

  // --- views (share storage; see the header comment on autograd) ---
  /// Same data with a new shape (one size may be -1); throws when the strides
  /// cannot express it (call Reshape, which copies then).
  Tensor View(const Shape& shape) const;
  /// View when possible, otherwise a contiguous copy.
  Tensor Reshape(const Shape& shape) const;
  Tensor Transpose(int64_t d0, int64_t d1) const;
  Tensor Permute(const Shape& dims) const;
  /// Elements [start, start + length) of dimension d.
  Tensor Narrow(int64_t d, int64_t start, int64_t length) const;
  /// Elements start, start + step, ... below end of dimension d.
  Tensor Slice(int64_t d, int64_t start, int64_t end, int64_t step = 1) const;
  /// Index `index` of dimension d, which is removed.
  Tensor Select(int64_t d, int64_t index) const;
  Tensor Unsqueeze(int64_t d) const;
  /// Removes dimension d if its size is 1 (otherwise returns the same geometry).
  Tensor Squeeze(int64_t d) const;
  /// Broadcasts size-1 dimensions (and new leading ones) to `shape` with stride 0.
  Tensor Expand(const Shape& shape) const;
  /// Merges dimensions start..end into one.
  Tensor Flatten(int64_t start = 0, int64_t end = -1) const;
  Tensor AsStrided(const Shape& shape, const Shape& strides, int64_t storage_offset) const;

  // --- copies ---
  /// This tensor if contiguous, else a contiguous copy.
  Tensor Contiguous() const;
  /// A contiguous copy.
  Tensor Clone() const;
  /// A copy converted to dtype (this tensor when it already has it).
  Tensor To(DType dtype) const;
  /// A copy on device (this tensor when it is already there).
  Tensor To(Device device) const;
  /// Writes src into this tensor, in place: src is broadcast to this shape and
  /// converted to this dtype; devices may differ. Bumps the storage version.
  void CopyFrom(const Tensor& src) const;
  /// Sets every element to value, in place.
  const Tensor& Fill(double value) const;
  const Tensor& Zero() const { return Fill(0.0); }
  /// Same data, no autograd history, requires_grad false.
  Tensor Detach() const;
  /// Replaces this tensor's storage, geometry and dtype by src's, keeping the
  /// object (and so every handle, .grad and hook) alive: how Module::To moves parameters.
  /// A .grad it keeps must be cleared when src has another shape, dtype or
  /// device: the next backward refuses to accumulate into it.
  void SetData(const Tensor& src) const;

  // --- autograd ---
  bool requires_grad() const;
  /// Marks a leaf as needing a gradient (or not). On a non-leaf, which
  /// always requires grad, true is a no-op and false throws (as PyTorch's
  /// requires_grad_): Detach() gives a tensor outside the graph.
  const Tensor& set_requires_grad(bool requires_grad) const;
  /// Accumulated gradient (undefined until the first backward that reaches this tensor).
  const Tensor& grad() const;
  /// Replaces .grad; it may be a view into another tensor's storage (a
  /// slice of a flat bucket): later accumulation writes into it in place.
  /// Shape and dtype must match this tensor's; an undefined tensor clears .grad.
  void set_grad(const Tensor& grad) const;
  /// The node that produced this tensor, or null for a leaf.
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  /// Which output of grad_fn this tensor is.
  uint32_t output_nr() const;
  /// True unless the tensor was produced by a recorded operation.
  bool is_leaf() const;
  /// Keeps .grad on a non-leaf during backward (leaves always get it).
  void RetainGrad() const;
  bool retains_grad() const;
  /// Registers fn to run each time this leaf's gradient has been accumulated
  /// into .grad during backward, in the order gradients become ready.
  /// Throws std::invalid_argument, naming the tensor, when fn is empty.
  HookHandle RegisterPostAccumulateGradHook(PostAccumulateGradHook fn) const;
  /// PyTorch's register_hook: fn runs each time backward computes the
  /// gradient with respect to this tensor (leaf or not), once per pass on
  /// the sum over its uses, before that gradient is accumulated into .grad
  /// or passed to grad_fn; hooks run in registration order, each seeing the
  /// previous one's result. A replacement of another shape, dtype or device
  /// fails the backward, naming the tensor. On a non-leaf, the hook is kept
  /// by grad_fn under output_nr (as PyTorch's), so it runs even when every
  /// handle to the tensor is gone; the leaf keeps its own.
  /// Throws when the tensor does not require grad, fn is empty, or an
  /// earlier backward without retain_graph released grad_fn's saved
  /// tensors (a pass through it fails before the hook would run).
  HookHandle RegisterHook(GradHook fn) const;

  /// PyTorch-style rendering: "tensor([[1.0000, 2.0000], ...], requires_grad=True)".
  std::string ToString() const;

  /// Internal: throws when dtype() != expected.
  void CheckDType(DType expected) const;

 private:
  void CheckDefined(const char* what) const;
  void CheckNoHistoryLoss(const char* what) const;
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

namespace detail {
/// Set by nn/autograd so that printing can name a tensor's grad_fn.
void SetGradFnNamer(std::string (*namer)(const autograd::Node&));
/// Set by nn/autograd so that RegisterHook on a non-leaf can reach the hook
/// list of its grad_fn (created on first use).
void SetNodeGradHooksGetter(std::shared_ptr<NodeGradHooks> (*getter)(autograd::Node&));
/// The name of a recorded node ("MulBackward") for messages, through the
/// namer nn/autograd set ("a recorded operation" before it did).
std::string GradFnName(const autograd::Node& node);
}  // namespace detail

/// Autograd state of a tensor; created on first need.
struct AutogradMeta {
  bool requires_grad = false;
  bool retains_grad = false;
  Tensor grad;
  std::shared_ptr<autograd::Node> grad_fn;
  uint32_t output_nr = 0;
  /// The leaf's accumulation node, shared by every graph that uses the leaf.
  /// Read and written under grad_accumulator_mu: threads running forwards on
  /// shared parameters (grad mode on) reach it at once, and each must find
  /// the node another made rather than make a second one.
  std::weak_ptr<autograd::Node> grad_accumulator;
  std::mutex grad_accumulator_mu;
  /// Guards the two hook lists and next_hook_id: hooks may be registered or
  /// removed while a backward on another thread runs them. Never held while
  /// a hook runs (the pass copies the list first).
  std::mutex hooks_mu;
  std::vector<std::pair<uint64_t, PostAccumulateGradHook>> post_accumulate_hooks;
  /// A leaf's gradient hooks (a non-leaf's are in its grad_fn's NodeGradHooks).
  std::vector<std::pair<uint64_t, GradHook>> grad_hooks;
  uint64_t next_hook_id = 1;
};

/// The object behind a Tensor handle.
class TensorImpl {
 public:
  TensorImpl(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, Shape strides,
             DType dtype);

  const std::shared_ptr<Storage>& storage() const { return storage_; }
  int64_t offset() const { return offset_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  void* data() const {
    return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(ElementSize(dtype_));
  }
  /// Null when the tensor never took part in autograd.
  AutogradMeta* autograd() const { return autograd_.get(); }
  /// Creates the autograd metadata if absent.
  AutogradMeta& mutable_autograd();
  /// Replaces storage and geometry (SetData).
  void Reset(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, Shape strides, DType dtype);

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_;
  Shape shape_;
  Shape strides_;
  DType dtype_;
  int64_t numel_;
  std::unique_ptr<AutogradMeta> autograd_;
};

/// How a factory makes its tensor.
struct TensorOptions {
  DType dtype = DType::kFloat32;
  Device device = kCPU;
  bool requires_grad = false;
};

/// Uninitialized memory.
Tensor Empty(const Shape& shape, TensorOptions options = {});
Tensor Zeros(const Shape& shape, TensorOptions options = {});
Tensor Ones(const Shape& shape, TensorOptions options = {});
Tensor Full(const Shape& shape, double value, TensorOptions options = {});
/// 0, 1, ..., n-1.
Tensor Arange(int64_t n, TensorOptions options = {});
/// Same shape, dtype and device as t (contiguous), uninitialized / zeros.
Tensor EmptyLike(const Tensor& t);
Tensor ZerosLike(const Tensor& t);
/// A CPU tensor holding a copy of values (in row-major order), converted to options.dtype.
Tensor FromVector(const std::vector<double>& values, const Shape& shape, TensorOptions options = {});
namespace detail {
/// Throws unless count elements fill shape.
void CheckVectorSize(size_t count, const Shape& shape);
}  // namespace detail

/// A CPU tensor of T's dtype holding a copy of values.
template <typename T>
Tensor FromVectorOf(const std::vector<T>& values, const Shape& shape) {
  Tensor t = Empty(shape, {.dtype = DTypeOf<T>()});
  detail::CheckVectorSize(values.size(), shape);
  std::copy(values.begin(), values.end(), t.data<T>());
  return t;
}

/// Broadcast shape of a and b (numpy rules); throws naming both shapes.
Shape BroadcastShapes(const Shape& a, const Shape& b);

/// Clears `param`'s .grad (set_to_none), or zeroes it in place as PyTorch's
/// zero_grad: a gradient that is itself part of a graph first leaves it
/// (replaced by its detached alias, same storage; a leaf one stops
/// requiring grad), so that the zeros carry no history into the next
/// backward. Module::ZeroGrad and the optimizers' ZeroGrad use it.
void ZeroGradOf(const Tensor& param, bool set_to_none);

}  // namespace ddp::nn
